"""Request canonicalization: one implementation for the gateway (per request) and ``promptlint --fix``.

A prefix cache matches bytes (tokens), not meaning. Two requests that mean the same thing but differ
in tool order, JSON key order or edge whitespace share no cached prefix; a system prompt that carries
today's date or the user's name is a new prefix on every request. This module rewrites an OpenAI chat
request so that its leading part is byte-stable:

``off``
    the request unchanged (still a new object).
``safe`` (meaning-preserving)
    tools sorted by name (a ``cache_control`` mark on the last tool moves to the new last tool; a list
    with a mark on another tool is left unsorted), tool and response schemas with recursively sorted
    keys (except the field names under a response schema's ``properties``, whose order is the order
    the model writes them in), ``\\r\\n`` -> ``\\n`` and whitespace stripped at the outer edges of
    each message's text (never on a trailing assistant message, which may be a deliberate prefill).
    Text parts of one message concatenate, so only the edges of the whole run are stripped:
    ``"What is the weather "`` + ``"in Paris?"`` keeps its space.
``reorder``
    ``safe`` plus: lines of system/developer messages that hold dynamic values (timestamps, dates,
    times, UUIDs, request ids, and ``key: value`` lines of the tenant's per-user variables) move into
    one labelled context message inserted just before the last user message; other occurrences of a
    moved per-user value in the system text become ``<key>``. The system prompt then no longer
    changes from request to request.

Contract: ``canonicalize`` never mutates its input, returns a new body, and is idempotent for every
mode (``canonicalize(canonicalize(b, m).body, m).body == canonicalize(b, m).body``). ``applied`` lists
stable short names of the transforms that changed something, in the order they ran.

``find_dynamic_spans`` is the detector the lint rules and the gateway's cache-miss explainer share.
Everything here is stdlib and precompiled: the gateway calls it on every request (target << 1 ms).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

CanonMode = Literal["off", "safe", "reorder"]
CANON_MODES: tuple[str, ...] = ("off", "safe", "reorder")

# Label of the context message that ``reorder`` inserts; also how a second pass recognises it.
CONTEXT_HEADER = (
    "Request context (moved out of the system prompt by PrefixGate so the prompt prefix stays cacheable):"
)

SpanKind = Literal["timestamp", "date", "time", "uuid", "request-id", "random-id"]


@dataclass(frozen=True)
class Span:
    """A dynamic value found in text: ``text[start:end]`` is of ``kind``."""

    kind: str
    start: int
    end: int
    text: str


# Not frozen: made on every request, and a frozen dataclass sets each field through object.__setattr__
# (2-3x the construction time; issue #17). Nothing hashes it or relies on it not changing.
@dataclass
class CanonResult:
    """The canonicalized request and the names of the transforms that changed it.

    ``body`` is a new object (the input is never mutated). ``applied`` holds stable short names:
    ``tools-sorted``, ``tool-schemas-canonical``, ``response-schema-canonical``,
    ``whitespace-normalized``, ``dynamic-moved:<kind>`` (kind of :class:`Span`, or ``per-user``).
    """

    body: dict
    applied: tuple[str, ...]


_MONTH = (
    r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?|"
    r"Sep(?:t(?:ember)?)?|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)\.?"
)
_WEEKDAY = r"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)[a-z]*\.?,?\s+"
# One alternation, tried left to right at each position: longer shapes (a full timestamp) come before
# their parts (a date), so a timestamp is one span, not a date plus a time.
_DYNAMIC_RE = re.compile(
    r"(?P<timestamp>"
    r"\b\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?(?:\s?(?:Z|UTC|GMT|[+-]\d{2}:?\d{2}))?"
    rf"|\b{_WEEKDAY}\d{{1,2}}\s+{_MONTH}\s+\d{{4}}\s+\d{{2}}:\d{{2}}(?::\d{{2}})?(?:\s+(?:[+-]\d{{4}}|GMT|UTC))?"
    r"|\b1[5-9]\d{8}(?:\d{3})?\b"  # unix epoch seconds / milliseconds, 2017..2033
    r")"
    r"|(?P<uuid>\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b)"
    r"|(?P<date>"
    r"\b\d{4}-\d{2}-\d{2}\b"
    r"|\b\d{1,2}/\d{1,2}/\d{2,4}\b"
    rf"|\b(?:{_WEEKDAY})?{_MONTH}\s+\d{{1,2}}(?:st|nd|rd|th)?,?\s+\d{{4}}\b"
    rf"|\b(?:{_WEEKDAY})?\d{{1,2}}(?:st|nd|rd|th)?\s+{_MONTH}\s+\d{{4}}\b"
    r")"
    r"|(?P<time>\b\d{1,2}:\d{2}:\d{2}(?:\.\d+)?(?:\s?(?:[AaPp][Mm]))?(?:\s?(?:Z|UTC|GMT|[A-Z]{3}))?\b)"
    r"|(?P<request_id>\b(?:req|request|chatcmpl|msg|run|sess|session|trace|span|conv|thread|call|evt|txn)"
    r"[-_](?=[A-Za-z0-9]*\d)[A-Za-z0-9]{6,}\b)"
    r"|(?P<random_id>\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{16,}\b"
    r"|\b[0-9A-HJKMNP-TV-Z]{26}\b)"  # long lowercase hex (hashes, trace ids) or a ULID
)
_GROUP_KIND = {
    "timestamp": "timestamp",
    "uuid": "uuid",
    "date": "date",
    "time": "time",
    "request_id": "request-id",
    "random_id": "random-id",
}
DIGITS = "0123456789"


def find_any(text: str, chars: str, pos: int = 0) -> int:
    """Index of the first of ``chars`` in ``text`` at or after ``pos``, or -1.

    One ``str.find`` (memchr) per character beats a regex character class by 20-50x on long text,
    and this runs on every line of every prompt.
    """
    best = -1
    for ch in chars:
        i = text.find(ch, pos)
        if i >= 0 and (best < 0 or i < best):
            best = i
    return best


class ForwardFinder:
    """``find_any`` over one text at positions that never decrease (a scanner's loop).

    Each character's next index is remembered and searched again only once the scan has passed it,
    so a character that does not occur in the rest of the text is searched for once, not on every
    call: with ``find_any`` in a loop, a 100,000-line template holding many ``{`` and no ``$`` made
    every step scan to the end for the ``$`` (quadratic; minutes instead of a fraction of a second).
    """

    def __init__(self, text: str, chars: str) -> None:
        self.text = text
        self._next = dict.fromkeys(chars, -2)  # -2: not searched yet; -1: not in the rest of the text
        self._pos = 0

    def find(self, pos: int) -> int:
        """Index of the first of the characters at or after ``pos`` (>= any earlier ``pos``), or -1."""
        assert pos >= self._pos, "ForwardFinder positions must not decrease"
        self._pos = pos
        best = -1
        for ch, at in self._next.items():
            if at == -1:
                continue
            if at < pos:
                at = self._next[ch] = self.text.find(ch, pos)
                if at < 0:
                    continue
            if best < 0 or at < best:
                best = at
        return best


def lines_with(chars: str, text: str) -> Iterator[tuple[int, str]]:
    """Yield (offset, line) for each line of ``text`` that contains one of ``chars``."""
    pos = 0
    finder = ForwardFinder(text, chars)
    while (i := finder.find(pos)) >= 0:
        start = text.rfind("\n", 0, i) + 1
        end = text.find("\n", i)
        end = len(text) if end < 0 else end
        yield start, text[start:end]
        pos = end + 1


def find_dynamic_spans(text: str) -> list[Span]:
    """Dynamic values in ``text`` (timestamps, dates, times, UUIDs, request ids, random ids).

    Returns non-overlapping spans in text order. Every recognised shape holds a digit, so only lines
    with a digit go through the (slow) alternation: static instructions cost one cheap scan. (A value
    broken across lines, like "November\\n29, 2026", is therefore not found.)
    """
    spans = []
    for base, line in lines_with(DIGITS, text):
        for m in _DYNAMIC_RE.finditer(line):
            group = m.lastgroup
            assert group is not None
            spans.append(Span(_GROUP_KIND[group], base + m.start(), base + m.end(), m.group()))
    return spans


def per_user_line_pattern(names: Sequence[str]) -> re.Pattern[str] | None:
    """A regex for ``name: value`` / ``name = value`` lines of the given per-user variables.

    ``user_name`` also matches ``User name:`` and ``user-name:`` (case-insensitive); bullets are
    allowed. Group ``key`` is the variable as written, ``value`` its value. ``None`` for no names.
    Compiled patterns are cached per tuple of names.
    """
    return _per_user_line_pattern(tuple(names))


@lru_cache(maxsize=64)  # the gateway passes the same tenant variables on every request
def _per_user_line_pattern(names: tuple[str, ...]) -> re.Pattern[str] | None:
    alts = []
    for name in names:
        words = [re.escape(w) for w in re.split(r"[\s_\-]+", name.strip()) if w]
        if words:
            alts.append(r"[\s_\-]*".join(words))
    if not alts:
        return None
    return re.compile(
        rf"^[ \t]*(?:[-*][ \t]+)?(?P<key>(?:{'|'.join(alts)}))[ \t]*[:=][ \t]*(?P<value>\S.*?)[ \t]*$",
        re.IGNORECASE | re.MULTILINE,
    )


def canonicalize(body: dict, mode: CanonMode, per_user_vars: Sequence[str] = ()) -> CanonResult:
    """Canonicalize an OpenAI chat-completions request body (see the module docstring).

    Args:
        body: the request as parsed JSON. Not mutated.
        mode: ``"off"``, ``"safe"`` or ``"reorder"``.
        per_user_vars: variable names whose ``name: value`` lines in system messages are per-user
            (``reorder`` only).

    Raises:
        ValueError: unknown ``mode``; ``CanonDepthError`` (a ValueError) for a body nested deeper
            than ``MAX_DEPTH``.
        TypeError: ``body`` is not a dict.
    """
    if mode not in CANON_MODES:
        raise ValueError(f"unknown canonicalization mode {mode!r}; expected one of {', '.join(CANON_MODES)}")
    if not isinstance(body, dict):
        raise TypeError(f"request body must be a JSON object, got {type(body).__name__}")
    depth = json_depth(body)
    if depth > MAX_DEPTH:  # the transforms below recurse; past ~1000 frames that is a RecursionError
        raise CanonDepthError(f"request body is nested {depth} levels deep; canonicalization accepts {MAX_DEPTH}")
    return canonicalize_owned(_copy_json(body), mode, per_user_vars)


def canonicalize_owned(body: dict, mode: CanonMode, per_user_vars: Sequence[str] = ()) -> CanonResult:
    """``canonicalize`` for a caller that hands ``body`` over: it is rewritten in place and becomes
    the result's body. For the gateway, whose body is its own fresh ``model_dump`` of a request the
    ingress scan held to 64 levels of nesting (far below ``MAX_DEPTH``): the deep copy and the depth
    walk that protect a caller's body cost ~20 Python calls of every request (issue 17)."""
    if mode not in CANON_MODES:
        raise ValueError(f"unknown canonicalization mode {mode!r}; expected one of {', '.join(CANON_MODES)}")
    if mode == "off":
        return CanonResult(body, ())
    applied: list[str] = []
    _sort_tools(body, applied)
    _canonical_schemas(body, applied)
    _normalize_whitespace(body, applied)
    if mode == "reorder":
        _move_dynamic(body, per_user_vars, applied)
    return CanonResult(body, tuple(applied))


# Nesting that the recursive transforms below accept: two Python frames per level at most, far from
# the interpreter's recursion limit (1000), far beyond any real tool schema.
MAX_DEPTH = 200


class CanonDepthError(ValueError):
    """The body is nested deeper than ``MAX_DEPTH``."""


def json_depth(value: Any) -> int:
    """Levels of dict/list nesting in ``value`` (a scalar is 0), computed without recursion."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children: Iterable[object]
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return deepest


# --- safe transforms -------------------------------------------------------------------------------


def _copy_json(value: Any) -> Any:
    """A deep copy of JSON-shaped data; several times faster than ``copy.deepcopy`` for it."""
    if isinstance(value, dict):
        return {k: _copy_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy_json(v) for v in value]
    return value


def _sorted_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _sorted_keys(value[k]) for k in sorted(value, key=str)}
    if isinstance(value, list):
        return [_sorted_keys(v) for v in value]
    return value


def _sorted_schema_keys(value: Any) -> Any:
    """``_sorted_keys`` for a JSON schema, except that the names under ``properties`` keep their order:
    OpenAI Structured Outputs generate an object's fields in its schema's key order, so sorting
    ``{"reasoning", "answer"}`` would make the model answer before it reasons (a change of meaning)."""
    if isinstance(value, dict):
        return {
            k: ({name: _sorted_schema_keys(sub) for name, sub in value[k].items()}
                if k == "properties" and isinstance(value[k], dict) else _sorted_schema_keys(value[k]))
            for k in sorted(value, key=str)
        }
    if isinstance(value, list):
        return [_sorted_schema_keys(v) for v in value]
    return value


def _key_order_differs(a: Any, b: Any) -> bool:
    """Whether two equal JSON values differ in dict key order anywhere (== ignores order)."""
    if isinstance(a, dict):
        return list(a) != list(b) or any(_key_order_differs(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return any(_key_order_differs(x, y) for x, y in zip(a, b))
    return False


def tool_name(tool: Any) -> str:
    """The name a tool is sorted by: OpenAI ``function.name``, else Anthropic/legacy ``name``."""
    if isinstance(tool, dict):
        fn = tool.get("function")
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            return fn["name"]
        if isinstance(tool.get("name"), str):
            return tool["name"]
    return ""


def _has_breakpoint(tool: Any) -> bool:
    return isinstance(tool, dict) and tool.get("cache_control") is not None


def tool_sort_blocker(tools: list[Any]) -> str:
    """Why sorting ``tools`` would change what is cached ("" when sorting is safe).

    An Anthropic ``cache_control`` mark on a tool caches every tool up to it. A mark on the last tool
    (the usual "cache all tools") stays meaningful after a sort if it moves to the new last tool; a
    mark on any other tool would cover a different set of tools, so such a list is not sorted."""
    marked = [i for i, t in enumerate(tools) if _has_breakpoint(t)]
    if marked and marked != [len(tools) - 1]:
        names = ", ".join(tool_name(tools[i]) or f"#{i}" for i in marked)
        return (f"a cache_control breakpoint on tool {names} (not the last tool) would cover a different "
                "set of tools after sorting")
    return ""


def _sort_tools(body: dict, applied: list[str]) -> None:
    changed = False
    for field in ("tools", "functions"):
        tools = body.get(field)
        if isinstance(tools, list) and len(tools) > 1 and not tool_sort_blocker(tools):
            # Stable sort: tools without a name sort first, in their original order.
            ordered = sorted(tools, key=tool_name)
            if [id(t) for t in ordered] != [id(t) for t in tools]:
                body[field] = _keep_last_breakpoint(tools, ordered)
                changed = True
    if changed:
        applied.append("tools-sorted")


def _keep_last_breakpoint(tools: list[Any], ordered: list[Any]) -> list[Any]:
    """Move a ``cache_control`` mark from the formerly last tool to the new last tool, so that the
    breakpoint still caches all the tools (the tool objects are the caller's own: copied, not edited)."""
    if not _has_breakpoint(tools[-1]) or ordered[-1] is tools[-1]:
        return ordered
    mark = tools[-1]["cache_control"]
    moved = [{k: v for k, v in t.items() if k != "cache_control"} if t is tools[-1] else t for t in ordered]
    moved[-1] = {**moved[-1], "cache_control": mark}
    return moved


def _canonical_schemas(body: dict, applied: list[str]) -> None:
    tools_changed = False
    for field in ("tools", "functions"):
        tools = body.get(field)
        if isinstance(tools, list):
            canon = [_sorted_keys(t) for t in tools]
            if _key_order_differs(tools, canon):
                body[field] = canon
                tools_changed = True
    if tools_changed:
        applied.append("tool-schemas-canonical")
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and isinstance(fmt.get("json_schema"), dict):
        canon = _sorted_schema_keys(fmt["json_schema"])
        if _key_order_differs(fmt["json_schema"], canon):
            body["response_format"] = {**fmt, "json_schema": canon}
            applied.append("response-schema-canonical")


def _norm_newlines(text: str) -> str:
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    return text


def _norm_text(text: str) -> str:
    return _norm_newlines(text).strip()


def _norm_parts(parts: list[Any]) -> bool:
    """Normalize a content-part list as ONE text: the parts concatenate (that is what a model
    reads), so only the edges of the whole run are stripped, never a part's inner edges
    (``"What is the weather "`` + ``"in Paris?"`` keeps its space), and a ``\r\n`` split across
    two parts becomes one newline. Returns whether anything changed."""
    idx = [i for i, p in enumerate(parts)
           if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)]
    if not idx:
        return False
    old = [parts[i]["text"] for i in idx]
    new = []
    for k, text in enumerate(old):
        # a CR ending the previous adjacent text part and an LF opening this one are one newline
        if k and idx[k - 1] == idx[k] - 1 and old[k - 1].endswith("\r") and text.startswith("\n"):
            text = text[1:]
        new.append(_norm_newlines(text))
    # Only the message's outer edges: a run of text parts opening (closing) the list. Whitespace
    # next to an image part stays, as does everything between parts.
    k = 0 if idx[0] == 0 else len(new)
    while k < len(new) and idx[k] == k:  # leading run of adjacent text parts
        new[k] = new[k].lstrip()
        if new[k]:
            break
        k += 1
    k = len(new) - 1 if idx[-1] == len(parts) - 1 else -1
    while k >= 0 and idx[k] == len(parts) - len(new) + k:  # trailing run
        new[k] = new[k].rstrip()
        if new[k]:
            break
        k -= 1
    changed = False
    for i, before, after in zip(idx, old, new, strict=True):
        if after != before:
            parts[i] = {**parts[i], "text": after}
            changed = True
    return changed


def _normalize_whitespace(body: dict, applied: list[str]) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list):
        return
    changed = False
    last = len(messages) - 1
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or (i == last and msg.get("role") == "assistant"):
            continue
        content = msg.get("content")
        if isinstance(content, str):
            new = _norm_text(content)
            if new != content:
                msg["content"] = new
                changed = True
        elif isinstance(content, list):
            changed = _norm_parts(content) or changed
    if changed:
        applied.append("whitespace-normalized")


# --- reorder ---------------------------------------------------------------------------------------

_LINE_RE = re.compile(r"[^\n]*\n?")
_BLANK_RUNS = re.compile(r"\n{3,}")


def _split_dynamic_lines(
    text: str, per_user: re.Pattern[str] | None
) -> tuple[str, list[str], list[str], dict[str, str]]:
    """Split ``text`` into (kept text, moved lines, kinds moved, per-user key -> value)."""
    kept: list[str] = []
    moved: list[str] = []
    kinds: list[str] = []
    values: dict[str, str] = {}
    for line in _LINE_RE.findall(text):
        if not line:
            continue
        stripped = line.rstrip("\n")
        m = per_user.match(stripped) if per_user is not None else None
        if m is not None:
            moved.append(stripped.strip())
            kinds.append("per-user")
            values[m.group("key")] = m.group("value")
            continue
        spans = find_dynamic_spans(stripped)
        if spans:
            moved.append(stripped.strip())
            kinds.extend(s.kind for s in spans)
            continue
        kept.append(line)
    new_text = "".join(kept)
    for key, value in values.items():
        if len(value) < 3:
            continue  # too short to replace without hitting unrelated words
        # Other mentions of the moved value would keep the prompt per-user; point them at the context.
        new_text = re.sub(rf"(?<!\w){re.escape(value)}(?!\w)", f"<{key}>", new_text)
    if moved:
        new_text = _BLANK_RUNS.sub("\n\n", new_text).strip()
    return new_text, moved, kinds, values


def _move_dynamic(body: dict, per_user_vars: Sequence[str], applied: list[str]) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list):
        return
    # Without a user message the context goes last, but never after a trailing assistant prefill: that
    # message must stay last (and unnormalized), or a second pass would change it (idempotence).
    end = len(messages)
    if messages and isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant":
        end -= 1
    last_user = max(
        (i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"),
        default=end,
    )
    per_user = per_user_line_pattern(per_user_vars)
    moved_lines: list[str] = []
    kinds: list[str] = []
    for msg in messages[:last_user]:
        if not isinstance(msg, dict) or msg.get("role") not in ("system", "developer"):
            continue
        content = msg.get("content")
        if isinstance(content, str):
            if content.startswith(CONTEXT_HEADER):
                continue  # our own context message from an earlier pass: idempotence
            msg["content"], lines, k, _ = _split_dynamic_lines(content, per_user)
            moved_lines += lines
            kinds += k
        elif isinstance(content, list):
            for part in content:
                if (
                    isinstance(part, dict)
                    and part.get("type") == "text"
                    and isinstance(part.get("text"), str)
                ):
                    part["text"], lines, k, _ = _split_dynamic_lines(part["text"], per_user)
                    moved_lines += lines
                    kinds += k
    if not moved_lines:
        return
    # A system message that held nothing but dynamic lines would be sent empty: drop it.
    kept = [m for m in messages[:last_user] if not (
        isinstance(m, dict) and m.get("role") in ("system", "developer") and m.get("content") in ("", [])
    )]
    context = {"role": "system", "content": CONTEXT_HEADER + "\n" + "\n".join(moved_lines)}
    tail = messages[last_user:]
    if not tail and kept and isinstance(kept[-1], dict) and kept[-1].get("role") == "assistant":
        # no user turn: a trailing assistant message is a prefill and must stay last (appending
        # the context after it would change its meaning and break idempotence)
        tail, kept = kept[-1:], kept[:-1]
    messages[:] = kept + [context] + tail
    for kind in dict.fromkeys(kinds):
        applied.append(f"dynamic-moved:{kind}")
