"""Why a request missed the prefix cache: its first divergence from an earlier request, classified.

A prefix cache serves the longest byte-identical prefix. When a request shares less with an earlier
one of the same family than it should, the first character where the two differ says why::

    previous: [tools ......][system ...... Now: 2026-11-29T10:00Z ......][user: question A]
    current:  [tools ......][system ...... Now: 2026-11-29T10:05Z ......][user: question B]
                                                              ^ first divergence, inside a timestamp
    -> Break(rule="PC002", detail="timestamp", position=<offset>, message="a timestamp value ...")

Both bodies (OpenAI chat shape, Anthropic ``system`` accepted) are rendered the way a provider
orders them: tools first, then the system prompt, then the messages. The divergence is classified
with the lint rules' knowledge:

============  ===========================================================================
PC004         tools (or schema keys) are the same but in another order
PC002         the divergence lies in a timestamp/date/time/UUID/id, or a ``session: ...`` line
PC003         it lies in a per-user ``name: value`` line, or the system prompt differs between users
PC009         the differing parts are equal once whitespace is normalized
PC012         an earlier message of the conversation was edited, removed or summarized
PC007         nothing diverged before the input, but the shared prefix is below the minimum
``other``     something else changed (a prompt edit, new tool definitions)
============  ===========================================================================

A divergence inside the previous request's *last* message (its input), or after the end of the
previous request (the conversation was appended to), is no break: that is what a cache hit looks
like. ``explain`` is pure and stdlib-only, so the gateway can call it on the request path.
"""

from __future__ import annotations

import json
import re
from bisect import bisect_right
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from promptlint.canon import canonicalize, find_dynamic_spans, per_user_line_pattern, tool_name
from promptlint.parse import PER_USER_KEYS, classify_name

UNEXPLAINED = "other"
RULE_NAMES = {
    "PC002": "volatile-value-in-prefix",
    "PC003": "per-user-value-in-system",
    "PC004": "unstable-tool-order",
    "PC007": "prefix-below-minimum",
    "PC009": "unstable-whitespace",
    "PC010": "cache-breakpoint-after-dynamic",
    "PC012": "history-edited",
    UNEXPLAINED: "prefix-changed",
}
SNIPPET = 32  # characters of context each side of a break, for people and for --from-usage matching
_KEY_LINE = re.compile(r"^[ \t]*(?:[-*][ \t]+)?(?P<key>[A-Za-z][\w .\-]{0,40}?)[ \t]*[:=][ \t]*\S")
_INVISIBLE = re.compile("[\u200b\u200c\u200d\u2060\ufeff\u00a0]")
_TRAILING = re.compile(r"[ \t]+$", re.MULTILINE)


# Not frozen: made on every request, and a frozen dataclass sets each field through object.__setattr__
# (2-3x the construction time; issue #17). Nothing hashes it or relies on it not changing.
@dataclass
class Segment:
    """One rendered part: ``text[start:end]`` is the tools block or message ``index``'s text."""

    where: str  # "tools", "system" (Anthropic top level) or "messages[i]"
    role: str  # "tools" or the message's role
    index: int | None  # the message index; None for tools and a top-level system
    start: int
    end: int


# Not frozen: made on every request, and a frozen dataclass sets each field through object.__setattr__
# (2-3x the construction time; issue #17). Nothing hashes it or relies on it not changing.
@dataclass
class Rendered:
    """A request body as one string in provider order, and where each part lies in it."""

    text: str
    segments: tuple[Segment, ...]

    def segment_at(self, pos: int) -> Segment | None:
        """The segment holding character ``pos`` (a separator belongs to the segment before it)."""
        starts = [s.start for s in self.segments]
        i = bisect_right(starts, pos) - 1
        return self.segments[i] if i >= 0 else None


@dataclass(frozen=True)
class Break:
    """Why the current request stopped sharing its prefix with the previous one.

    ``position`` is the character offset of the first divergence in ``render(current).text``;
    ``token_position`` the same in tokens when a counter was given. ``previous`` / ``current`` are
    up to ``SNIPPET`` characters each side of the break in each request; ``context`` is the text
    just before it (the same in both), which ``promptlint check --from-usage`` matches templates by.
    """

    rule: str
    name: str
    detail: str
    message: str
    where: str
    position: int
    token_position: int | None
    context: str
    previous: str
    current: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def content_text(content: Any) -> str:
    """A message's text: a string, or the text parts of a content list joined by newlines."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:  # images, tool results: their bytes are part of the prefix too
                parts.append(json.dumps(part, ensure_ascii=False))
        return "\n".join(parts)
    return json.dumps(content, ensure_ascii=False)


def _message_text(msg: Any) -> str:
    if not isinstance(msg, dict):
        return json.dumps(msg, ensure_ascii=False)
    text = content_text(msg.get("content"))
    if msg.get("tool_calls"):
        text += "\n" + json.dumps(msg["tool_calls"], ensure_ascii=False)
    return text


def render(body: Mapping[str, Any]) -> Rendered:
    """Render ``body`` as ``tools``, ``system`` and each message, in provider order (see module doc).

    Tools are JSON in the order and key order given: that order is what a provider tokenizes.
    """
    pieces: list[str] = []
    segments: list[Segment] = []
    pos = 0

    def add(where: str, role: str, index: int | None, text: str) -> None:
        nonlocal pos
        chunk = f"<{role}>\n{text}\n"
        segments.append(Segment(where, role, index, pos, pos + len(chunk)))
        pieces.append(chunk)
        pos += len(chunk)

    tools = body.get("tools") or body.get("functions")
    if tools:
        add("tools", "tools", None, json.dumps(tools, ensure_ascii=False))
    if body.get("system") is not None:
        add("system", "system", None, content_text(body["system"]))
    messages = body.get("messages")
    if isinstance(messages, list):
        for i, msg in enumerate(messages):
            role = msg.get("role", "?") if isinstance(msg, dict) else "?"
            add(f"messages[{i}]", str(role), i, _message_text(msg))
    return Rendered("".join(pieces), tuple(segments))


def first_divergence(a: Sequence[Any], b: Sequence[Any]) -> int:
    """Length of the common prefix of ``a`` and ``b`` (== the index of the first differing item).

    Any sliceable sequence: the characters of two prompts, the lines of two templates, two chains of
    block hashes."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # binary search on slice equality: C-speed compares instead of a Python loop
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def explain(
    previous: dict[str, Any],
    current: dict[str, Any],
    *,
    per_user_vars: Sequence[str] = (),
    min_prefix_tokens: int = 0,
    count_tokens: Callable[[str], int] | None = None,
    rendered: tuple[Rendered, Rendered] | None = None,
) -> Break | None:
    """Classify why ``current`` shares less of its prefix with ``previous`` than it could.

    Args:
        previous: an earlier request of the same family (OpenAI chat body). Not mutated.
        current: the request that missed. Not mutated.
        per_user_vars: the tenant's per-user variable names (``user_name: Alice`` lines).
        min_prefix_tokens: the smallest prefix the cache serves (a provider's 1,024, an engine's
            block size); with ``count_tokens``, a shared prefix below it is reported as PC007.
        count_tokens: text -> token count; fills ``Break.token_position``.
        rendered: ``(render(previous), render(current))`` when the caller has them already.

    Returns:
        A :class:`Break`, or ``None`` when ``current`` keeps all of ``previous`` up to its input
        (an appended conversation, a new question) and the shared prefix is long enough.
    """
    prev_r, cur_r = rendered if rendered is not None else (render(previous), render(current))
    pos = first_divergence(prev_r.text, cur_r.text)
    seg_prev = prev_r.segment_at(pos)
    seg_cur = cur_r.segment_at(pos)
    if _is_input_or_append(prev_r, previous, seg_prev, pos) or pos >= len(cur_r.text):
        # Current extends previous, changes only its input, or lies wholly inside previous's prompt.
        return _below_minimum(cur_r, previous, current, pos, min_prefix_tokens, count_tokens)
    assert seg_cur is not None and seg_prev is not None  # pos < len of both: inside a segment of each
    rule, detail, message = _classify(previous, current, prev_r, cur_r, seg_prev, seg_cur, pos, per_user_vars)
    return _make(rule, detail, message, seg_cur.where, pos, prev_r.text, cur_r.text, count_tokens)


def _is_input_or_append(prev_r: Rendered, previous: dict, seg: Segment | None, pos: int) -> bool:
    if pos >= len(prev_r.text) or seg is None:
        return True  # current = previous + more (or identical)
    messages = previous.get("messages")
    if not isinstance(messages, list) or seg.index is None or seg.index != len(messages) - 1:
        return False
    # The previous request's last message was its input; a new input there is not a break.
    return seg.role in ("user", "tool", "function")


def _below_minimum(cur_r: Rendered, previous: dict[str, Any], current: dict[str, Any], pos: int,
                   min_tokens: int, count: Callable[[str], int] | None) -> Break | None:
    if not min_tokens or count is None:
        return None
    shared = count(cur_r.text[:pos])
    if shared >= min_tokens:
        return None
    seg = cur_r.segment_at(max(0, min(pos, len(cur_r.text) - 1)))
    message = (f"the prefix shared with the previous request is {shared} tokens, below the {min_tokens}-token "
               "minimum the cache serves; put more static text ahead of the per-request input")
    return _make("PC007", "below-minimum", message, seg.where if seg else "messages", pos,
                 render(previous).text, cur_r.text, count)


def _make(rule: str, detail: str, message: str, where: str, pos: int, prev_text: str, cur_text: str,
          count: Callable[[str], int] | None) -> Break:
    return Break(
        rule=rule, name=RULE_NAMES[rule], detail=detail, message=message, where=where, position=pos,
        token_position=count(cur_text[:pos]) if count is not None else None,
        context=cur_text[max(0, pos - SNIPPET) : pos],
        previous=prev_text[max(0, pos - SNIPPET) : pos + SNIPPET],
        current=cur_text[max(0, pos - SNIPPET) : pos + SNIPPET],
    )


def _classify(previous: dict[str, Any], current: dict[str, Any], prev_r: Rendered, cur_r: Rendered,
              seg_prev: Segment, seg_cur: Segment, pos: int,
              per_user_vars: Sequence[str]) -> tuple[str, str, str]:
    if seg_prev.where == "tools" or seg_cur.where == "tools":
        return _classify_tools(previous, current, prev_r, cur_r, pos)
    # Both at the same message (the text before pos is equal, so the segment starts line up).
    local = pos - seg_cur.start
    prev_text = prev_r.text[seg_prev.start : seg_prev.end]
    cur_text = cur_r.text[seg_cur.start : seg_cur.end]
    role = seg_cur.role
    place = "the system prompt" if role in ("system", "developer") else f"{seg_cur.where} ({role})"
    if seg_prev.role == seg_cur.role and _ws_at(prev_text, cur_text, local) and _ws_norm(prev_text) == _ws_norm(cur_text):
        return "PC009", "whitespace", (
            f"{place} differs only in whitespace (line endings, trailing or invisible spaces); the client "
            "sends the same text with different bytes")
    dyn = _dynamic_at(prev_text, cur_text, local)
    if dyn is not None:
        return "PC002", dyn, (
            f"a {dyn} value changed in {place} at character {pos}; everything after it was prefilled again. "
            "Move the value after the static text")
    per_user = _per_user_at(cur_text, local, per_user_vars) or _per_user_at(prev_text, local, per_user_vars)
    if per_user is not None:
        return "PC003", per_user, (
            f"a per-user value ({per_user}) changed in {place}; each user gets a separate cache entry. "
            "Pass user details after the shared text")
    if role in ("system", "developer") and _end_user(previous) != _end_user(current) and _end_user(current):
        return "PC003", "user", (
            f"{place} differs between end users {_end_user(previous)!r} and {_end_user(current)!r}; a per-user "
            "value in it gives each user a separate cache entry")
    history = _history_edit(previous, current, seg_cur, role)
    if history is not None:
        return "PC012", history[0], history[1]
    return UNEXPLAINED, "changed", f"{place} changed at character {pos} (a prompt edit or deploy?)"


def _classify_tools(previous: dict[str, Any], current: dict[str, Any], prev_r: Rendered, cur_r: Rendered,
                    pos: int) -> tuple[str, str, str]:
    prev_tools = previous.get("tools") or previous.get("functions") or []
    cur_tools = current.get("tools") or current.get("functions") or []
    canon_prev = canonicalize({"tools": prev_tools}, "safe").body
    canon_cur = canonicalize({"tools": cur_tools}, "safe").body
    if canon_prev == canon_cur and json.dumps(canon_prev) == json.dumps(canon_cur):
        if [tool_name(t) for t in prev_tools] != [tool_name(t) for t in cur_tools]:
            names = ", ".join(tool_name(t) for t in cur_tools)
            return "PC004", "tools-reordered", (
                f"the same tools were sent in another order ({names}); sort tools by name")
        return "PC004", "schema-key-order", (
            "the same tool schemas were serialized with another key order; serialize with sorted keys")
    prev_text, cur_text = prev_r.text, cur_r.text
    dyn = _dynamic_at(prev_text, cur_text, pos)
    if dyn is not None:
        return "PC002", dyn, f"a {dyn} value changed inside the tool definitions at character {pos}"
    return UNEXPLAINED, "tools-changed", "the tool definitions changed (added, removed or edited tools)"


def _ws_at(a: str, b: str, i: int) -> bool:
    """Cheap guard for the whitespace test: a whitespace-only difference starts at a blank character."""
    def blank(t: str) -> bool:
        return i >= len(t) or t[i].isspace() or bool(_INVISIBLE.match(t, i))
    return blank(a) or blank(b)


def _ws_norm(text: str) -> str:
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _INVISIBLE.sub("", text)
    text = _TRAILING.sub("", text)
    return "\n".join(line.strip() for line in text.strip().split("\n"))


def _dynamic_at(prev_text: str, cur_text: str, local: int) -> str | None:
    """The kind of a dynamic value (span or ``volatile: ...`` line) at offset ``local``, if any."""
    for text in (cur_text, prev_text):
        # find_dynamic_spans never crosses a line, so only the line holding the break is scanned.
        start = text.rfind("\n", 0, local) + 1
        end = text.find("\n", local)
        for span in find_dynamic_spans(text[start : len(text) if end < 0 else end]):
            if start + span.start <= local <= start + span.end:
                return span.kind
        key = _key_at(text, local)
        if key is not None and classify_name(key) == "volatile":
            return f"{key} value"
    return None


def _key_at(text: str, local: int) -> str | None:
    """The ``key`` of a ``key: value`` line when ``local`` lies in its value."""
    start = text.rfind("\n", 0, local) + 1
    end = text.find("\n", local)
    line = text[start : len(text) if end < 0 else end]
    m = _KEY_LINE.match(line)
    if m is None or local - start < m.end("key"):
        return None
    return m.group("key").strip()


def _per_user_at(text: str, local: int, per_user_vars: Sequence[str]) -> str | None:
    pattern = per_user_line_pattern(tuple(PER_USER_KEYS) + tuple(per_user_vars))
    start = text.rfind("\n", 0, local) + 1
    end = text.find("\n", local)
    line = text[start : len(text) if end < 0 else end]
    if pattern is not None and (m := pattern.match(line)) is not None:
        return m.group("key")
    key = _key_at(text, local)
    if key is not None and classify_name(key) == "per-user":
        return key
    return None


def _end_user(body: dict) -> str | None:
    user = body.get("user")
    if user is None and isinstance(body.get("metadata"), dict):
        user = body["metadata"].get("user_id")
    return str(user) if user is not None else None


def _msg_key(msg: Any) -> str:
    return json.dumps(msg, sort_keys=True, ensure_ascii=False)


def _history_edit(previous: dict[str, Any], current: dict[str, Any], seg: Segment,
                  role: str) -> tuple[str, str] | None:
    """(detail, message) when message ``seg.index`` was history in ``previous`` and was rewritten."""
    prev_msgs = previous.get("messages") or []
    cur_msgs = current.get("messages") or []
    i = seg.index
    if i is None or i >= len(prev_msgs) - 1:
        return None
    if role in ("system", "developer") and i == 0:
        return None  # the leading system prompt is not history
    prev_keys = [_msg_key(m) for m in prev_msgs]
    cur_keys = [_msg_key(m) for m in cur_msgs]
    rest = cur_keys[i:]
    # Older messages dropped from the front: current continues with a later part of previous.
    for k in range(1, len(prev_keys) - i):
        tail = prev_keys[i + k :]
        if rest[: len(tail)] == tail or (rest and rest[0] == prev_keys[i + k]):
            return "truncated", (
                f"{k} earlier message(s) were dropped from the conversation at messages[{i}] (a sliding window "
                "or truncation), so every later message moved and was prefilled again; append to the history, "
                "or summarize at a fixed point and keep the summary")
    if i + 1 < len(cur_keys) and cur_keys[i + 1 :][: len(prev_keys) - i - 1] == prev_keys[i + 1 :]:
        return "edited", (
            f"messages[{i}] ({role}) of the conversation was edited while the messages after it stayed; an "
            "edit anywhere in the history re-prefills everything after it. Append instead of rewriting")
    return "rewritten", (
        f"the conversation history was rewritten from messages[{i}] ({role}) on (summarized or regenerated); "
        "only messages appended after the previous request keep the cache")
