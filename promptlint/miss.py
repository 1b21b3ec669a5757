"""The prompt analysis behind a cache-miss explanation, on the cache's own block grid.

The gateway records what it already holds for each request, as :class:`PromptFacts`: the canonical
body it sent, the prompt's token ids when it tokenized them for the local engine, and when it saw
it. Everything else is prompt knowledge and lives here::

    family_key(body)                  which earlier requests a new one should share its prefix with
    PromptFacts.shared_blocks(other)  how many leading full cache blocks two prompts have in common
    near_hit(candidates, current)     the candidate that shares the most blocks (the near-hit)
    explain_miss(near, current)       why the current prompt stops sharing: promptlint.explain's rule,
                                      the block the cache stops at, and cache_control breakpoints

The block grid is the engine's: a prompt is indexed by chained hashes of its full blocks of
``block_size`` tokens (``h_i = H(h_{i-1} || tokens of block i)``), so two prompts of one tenant
share exactly as many cached blocks as there are full blocks in the common prefix of their token
ids -- no hashing needed to know it::

    near-hit ids  [ block 0 ][ block 1 ][ block 2 ][ blo|ck 3 ][ block 4 ] ...
    current ids   [ block 0 ][ block 1 ][ block 2 ][ blo|CK 3 ][ ...
                                                       ^ first differing token: 3 blocks shared,
                                                         token_position = 3 * block_size

A prompt whose token ids the gateway does not know (a provider route tokenizes upstream) is put
on the same grid through its rendered text at ``CHARS_PER_TOKEN`` characters a token.

Breakpoints (Anthropic ``cache_control``, parsed by the one parser ``promptlint.cache_control``)
add three explanations the text comparison alone cannot give:

==============  =========================  ====================================================
``PC010``       ``breakpoint-changed``     the divergence lies inside the prefix an earlier
                                           breakpoint marked: its cache entry cannot be read
``unwritten``   ``below-one-block``        the breakpoint's prefix is shorter than one cache
                                           block: the cache writes full blocks only
``unwritten``   ``no-earlier-breakpoint``  nothing diverged, but no earlier request marked this
                                           prefix, so nothing kept it for its TTL
``ttl``         ``5m`` / ``1h``            nothing diverged, but the near-hit's breakpoint TTL
                                           ran out before this request came
==============  =========================  ====================================================

Pure and stdlib-only, like ``explain``: the gateway calls it on the request path.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any

from promptlint.cache_control import Breakpoint, CacheControlError, parse_breakpoints
from promptlint.canon import find_dynamic_spans
from promptlint.explain import (
    RULE_NAMES,
    UNEXPLAINED,
    Break,
    Rendered,
    content_text,
    explain,
    first_divergence,
    render,
)

CHARS_PER_TOKEN = 4  # the providers' own rule of thumb, for prompts whose token ids are unknown
TTL_EXPIRED = "ttl"
UNWRITTEN = "unwritten"
# What only the cache's runtime can say, so no lint rule and no template line to point at (like "other").
RUNTIME_RULE_NAMES = {UNWRITTEN: "breakpoint-never-written", TTL_EXPIRED: "cache-ttl-expired"}
_FAMILY_LEAD = 200

JsonBody = Mapping[str, Any]


def family_key(body: JsonBody) -> str:
    """The prompt family of a request: its ``prompt_cache_key``, else its ``user``, else the model
    with the tool names and the system prompt's first 200 characters, dynamic values masked (so a
    timestamp on line 1 does not make every request a family of its own)."""
    for key in ("prompt_cache_key", "user"):
        value = body.get(key)
        if isinstance(value, str) and value:
            return f"{key}:{value}"
    system = content_text(body.get("system")) if body.get("system") is not None else ""
    if not system:  # a chat body: its leading system (or developer) message
        for msg in body.get("messages") or []:
            if isinstance(msg, dict) and msg.get("role") in ("system", "developer"):
                system = content_text(msg.get("content"))
                break
    tools = tuple(sorted(str((t.get("function") or t).get("name"))
                         for t in body.get("tools") or [] if isinstance(t, dict)))
    return f"prefix:{body.get('model', '')}:{_family_digest(system[:_FAMILY_LEAD], tools)}"


@lru_cache(maxsize=4096)
def _family_digest(lead: str, tools: tuple[str, ...]) -> str:
    """Cached: a family sends the same lead and tools again and again (the timestamp case misses
    the cache, which is still correct, only slower)."""
    for span in reversed(find_dynamic_spans(lead)):
        lead = lead[: span.start] + f"<{span.kind}>" + lead[span.end :]
    return hashlib.sha256(json.dumps([lead, list(tools)], ensure_ascii=False).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class MarkedPrefix:
    """A breakpoint and where its prefix ends: in the rendered text, and in tokens (estimated in
    proportion to the prompt's token count: the template's own markup is not in the rendering)."""

    breakpoint: Breakpoint
    char_end: int
    token_end: int


# Not frozen: made on every request, and a frozen dataclass sets each field through object.__setattr__
# (2-3x the construction time; issue #17). Nothing hashes it or relies on it not changing.
@dataclass
class PromptFacts:
    """What the gateway records of one request for later explanations (see the module docstring).

    ``token_ids`` are the prompt as the cache sees it (None: not tokenized here); ``seen_at`` is on
    the clock the caller compares ages with (``time.monotonic`` in the gateway).
    """

    body: JsonBody
    rendered: Rendered
    text: str  # rendered.text
    token_ids: array | None
    prompt_tokens: int  # exact with token ids, else estimated from the text
    block_size: int
    seen_at: float
    reachable_chars: int  # characters before its own input (its last user/tool message)
    marks: tuple[MarkedPrefix, ...] = field(default=())

    @classmethod
    def of(cls, body: JsonBody, *, token_ids: Sequence[int] | None, block_size: int, seen_at: float) -> PromptFacts:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        rendered = render(body)
        text = rendered.text
        ids = array("q", token_ids) if token_ids is not None else None
        tokens = len(ids) if ids is not None else -(-len(text) // CHARS_PER_TOKEN)
        return cls(body, rendered, text, ids, tokens, block_size, seen_at, _reachable(rendered),
                   _marked_prefixes(body, rendered, tokens))

    @property
    def size(self) -> int:
        """Memory units this record costs a bounded store: one per character and per token id."""
        return len(self.text) + (len(self.token_ids) if self.token_ids is not None else 0)

    def tokens_at(self, char: int) -> int:
        """A character offset of the rendering -> tokens, in proportion to the prompt's token count."""
        return _tokens_at(char, len(self.text), self.prompt_tokens)

    @property
    def reachable_tokens(self) -> int:
        """Full blocks of this prompt before its own input: what the next request of its family can
        be served from the cache had nothing broken.

        Counted back from the end (the input is short; the template's markup around tools and the
        system prompt, which the rendering lacks, is all before it), so the estimate is off by at
        most the input's own share of the template's extra tokens."""
        if not self.text:
            return 0
        after = len(self.text) - min(self.reachable_chars, len(self.text))
        tokens = self.prompt_tokens - round(self.prompt_tokens * after / len(self.text))
        return max(0, tokens) // self.block_size * self.block_size

    def shared_blocks(self, other: PromptFacts) -> int:
        """Full cache blocks in the common prefix of two prompts (token ids when both have them)."""
        if self.token_ids is not None and other.token_ids is not None:
            return first_divergence(self.token_ids, other.token_ids) // self.block_size
        return first_divergence(self.text, other.text) // (self.block_size * CHARS_PER_TOKEN)


def near_hit(candidates: Sequence[PromptFacts], current: PromptFacts) -> PromptFacts | None:
    """The candidate sharing the most leading blocks with ``current``; on a tie the latest, whose
    blocks the cache is the likeliest to still hold."""
    if not candidates:
        return None
    return max(candidates, key=lambda c: (c.shared_blocks(current), c.seen_at))


def explain_miss(
    near: PromptFacts,
    current: PromptFacts,
    *,
    per_user_vars: Sequence[str] = (),
    now: float | None = None,
    same_family: bool = True,
) -> Break | None:
    """Why ``current`` shares less with ``near`` than the cache could have served, on the block grid.

    Returns ``promptlint.explain``'s break with ``token_position`` at the block boundary where the
    cache stops serving (``shared blocks x block_size``), turned into a breakpoint rule when the
    break lies inside a marked prefix; or, when nothing diverged, a breakpoint rule that explains a
    miss all the same (never written, TTL expired); else None.

    ``same_family=False``: ``near`` is merely the tenant's latest request (the current family has no
    history); only a classified divergence is kept from it, since an unrelated prompt is no near-hit.
    """
    brk = None
    # Nothing diverges before the near-hit's own input (the common case: a new question): explain
    # would say so after re-reading both bodies; the rendered texts already do.
    if first_divergence(near.text, current.text) < near.reachable_chars:
        brk = explain(dict(near.body), dict(current.body), per_user_vars=per_user_vars,
                      rendered=(near.rendered, current.rendered))
    if brk is not None:
        if brk.rule == UNEXPLAINED and not same_family:
            return None
        brk = replace(brk, token_position=near.shared_blocks(current) * current.block_size)
        marked = next((m for m in near.marks if m.char_end > brk.position), None)
        return brk if marked is None else _breakpoint_changed(brk, marked)
    if not same_family:
        return None
    return _unwritten(near, current) or _expired(near, current, now)


def _breakpoint_changed(brk: Break, marked: MarkedPrefix) -> Break:
    cause = brk.message[0].lower() + brk.message[1:] if brk.message else "it changed"
    message = (f"the prefix marked by the cache_control breakpoint at {marked.breakpoint.param} changed before its "
               f"end ({brk.rule} {brk.detail}: {cause}); the breakpoint's cache entry cannot be read. Keep what "
               "changes per request after the last breakpoint")
    return replace(brk, rule="PC010", name=RULE_NAMES["PC010"], detail="breakpoint-changed", message=message)


def _unwritten(near: PromptFacts, current: PromptFacts) -> Break | None:
    for mark in current.marks:
        if mark.token_end < current.block_size:
            return _marked_break(
                UNWRITTEN, "below-one-block", current, mark,
                f"the breakpoint at {mark.breakpoint.param} marks ~{mark.token_end} tokens, less than one "
                f"{current.block_size}-token cache block: the cache writes full blocks only, so it holds nothing "
                "for it. Put the breakpoint after a longer static prefix")
    if current.marks and not near.marks:
        mark = current.marks[-1]
        return _marked_break(
            UNWRITTEN, "no-earlier-breakpoint", current, mark,
            f"no earlier request of this family marked the prefix up to {mark.breakpoint.param}, so nothing kept "
            "it for a TTL and it was evicted before this request; this request writes it")
    return None


def _expired(near: PromptFacts, current: PromptFacts, now: float | None) -> Break | None:
    if now is None:
        return None
    age = now - near.seen_at
    for mark in reversed(near.marks):  # the longest marked prefix first: it covers the most
        if age > mark.breakpoint.ttl_s and mark.char_end <= len(current.text):
            return _marked_break(
                TTL_EXPIRED, mark.breakpoint.ttl, current, mark,
                f"the near-hit's breakpoint at {mark.breakpoint.param} kept its prefix for {mark.breakpoint.ttl}, "
                f"and this request came {age:.0f} s later: the entry had expired. Send the family within its TTL, "
                "or ask for ttl '1h'")
    return None


def _marked_break(rule: str, detail: str, current: PromptFacts, mark: MarkedPrefix, message: str) -> Break:
    text = current.text
    pos = min(mark.char_end, len(text))
    seg = current.rendered.segment_at(max(0, pos - 1))
    return Break(
        rule=rule, name=RUNTIME_RULE_NAMES[rule], detail=detail, message=message,
        where=seg.where if seg is not None else "messages", position=pos,
        token_position=mark.token_end // current.block_size * current.block_size,
        context=text[max(0, pos - 32) : pos], previous="", current=text[max(0, pos - 32) : pos + 32],
    )


def _reachable(rendered: Rendered) -> int:
    segments = rendered.segments
    if segments and segments[-1].role in ("user", "tool", "function"):
        return segments[-1].start
    return len(rendered.text)


def _tokens_at(char: int, chars: int, tokens: int) -> int:
    return round(tokens * min(max(char, 0), chars) / chars) if chars else 0


def _marked_prefixes(body: JsonBody, rendered: Rendered, tokens: int) -> tuple[MarkedPrefix, ...]:
    """Each valid breakpoint of ``body`` with the end of its prefix in the rendering.

    A request with invalid marks has no breakpoints here: the doors refuse it before it runs."""
    try:
        breakpoints = parse_breakpoints(body)
    except CacheControlError:
        return ()
    if not breakpoints:
        return ()
    by_where = {s.where: s for s in rendered.segments}
    out = []
    for bp in breakpoints:
        where = "tools" if bp.section == "tools" else "system" if bp.section == "system" else f"messages[{bp.message}]"
        seg = by_where.get(where)
        if seg is None:
            continue
        end = seg.end
        content = _content_of(body, bp)
        if isinstance(content, list) and bp.block is not None:  # the mark ends after its own block
            head = len(f"<{seg.role}>\n")
            end = seg.start + head + len(content_text(content[: bp.block + 1]))
        out.append(MarkedPrefix(bp, end, _tokens_at(end, len(rendered.text), tokens)))
    return tuple(out)


def _content_of(body: JsonBody, bp: Breakpoint) -> Any:
    if bp.section == "system":
        return body.get("system")
    if bp.section == "messages":
        messages = body.get("messages") or []
        if bp.message is not None and bp.message < len(messages) and isinstance(messages[bp.message], Mapping):
            return messages[bp.message].get("content")
    return None  # a tool's mark: the tools block ends the prefix


__all__ = ["CHARS_PER_TOKEN", "RUNTIME_RULE_NAMES", "TTL_EXPIRED", "UNEXPLAINED", "UNWRITTEN", "MarkedPrefix", "PromptFacts",
           "explain_miss", "family_key", "near_hit"]
