"""Splitting prompt text into static text and dynamic elements.

A template's text is cut at every placeholder (Jinja ``{{ x }}``/``{% if %}``, ``{x}``, ``$x``/``${x}``),
every literal dynamic value (``canon.find_dynamic_spans``) and every ``user_name: Alice``-style line of
a per-user key. Each cut becomes a dynamic :class:`Element` classified by what it holds (see
``model.DynClass``): the rules then reason over element order alone.

Each syntax is read by its own rules: in ``str.format`` templates ``{{``/``}}`` are literal braces;
the text of a Jinja ``{% raw %}`` block is literal; a mustache comment ``{{! ... }}`` renders nothing.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections.abc import Iterator

from promptlint.canon import (
    DIGITS,
    ForwardFinder,
    find_any,
    find_dynamic_spans,
    lines_with,
    per_user_line_pattern,
)
from promptlint.model import DynClass, Element

# Variable-name vocabularies; matched against the name's words (split on _ . - and camelCase).
_VOLATILE_WORDS = {
    "date", "time", "timestamp", "now", "today", "datetime", "uuid", "guid", "nonce", "random", "rand",
    "ts", "epoch", "clock", "tomorrow", "yesterday", "weekday",
}
_VOLATILE_PAIRS = {("request", "id"), ("req", "id"), ("trace", "id"), ("session", "id"), ("run", "id"),
                   ("message", "id"), ("conversation", "id"), ("correlation", "id")}
_PER_USER_WORDS = {
    "user", "username", "email", "customer", "account", "member", "client", "profile", "phone", "address",
    "firstname", "lastname", "fullname", "persona", "preferences", "memory", "memories", "subscriber",
    "patient", "employee", "tenant", "locale", "timezone", "tz",
}
_PER_USER_PAIRS = {("first", "name"), ("last", "name"), ("full", "name"), ("display", "name")}
_INPUT_WORDS = {
    "question", "query", "input", "message", "prompt", "request", "text", "content", "document",
    "documents", "docs", "context", "history", "conversation", "chat", "code", "snippet", "diff",
    "file", "files", "passage", "passages", "chunks", "results", "retrieved", "ticket", "issue", "task",
    "instruction", "utterance", "transcript", "selection", "body", "data", "article",
}
# ``key: value`` lines whose value is per-user even when written out literally in a sample prompt.
PER_USER_KEYS = (
    "user_name", "username", "user", "user_email", "email", "user_id", "customer_name", "customer",
    "customer_id", "customer_email", "account_id", "account", "member_id", "first_name", "last_name",
    "full_name", "phone", "user_phone",
)
_per_user_line = per_user_line_pattern(PER_USER_KEYS)
assert _per_user_line is not None  # None only for no names
_PER_USER_LINE: re.Pattern[str] = _per_user_line

_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_WORD_SPLIT = re.compile(r"[^A-Za-z0-9]+")
_VOLATILE_CALL = re.compile(r"\b(now|utcnow|today|uuid\d?|random|randint|time|datetime|strftime)\b", re.I)


def classify_name(name: str) -> DynClass:
    """Guess what a template variable holds from its name (``current_date`` -> volatile)."""
    words = [w.lower() for w in _WORD_SPLIT.split(_CAMEL.sub("_", name)) if w]
    if not words:
        return "placeholder"
    pairs = set(zip(words, words[1:]))
    wordset = set(words)
    if wordset & _VOLATILE_WORDS or pairs & _VOLATILE_PAIRS:
        return "volatile"
    if wordset & _INPUT_WORDS:  # user_question is the input, not a per-user value
        return "input"
    if wordset & _PER_USER_WORDS or pairs & _PER_USER_PAIRS or words == ["name"]:
        return "per-user"
    return "placeholder"


_PLACEHOLDER_RE = re.compile(
    r"(?P<jcomment>\{#.*?#\})"
    r"|\{\{-?\s*(?P<jexpr>.*?)\s*-?\}\}"
    r"|\{%-?\s*(?P<jstmt>\w+)(?P<jrest>.*?)-?%\}"
    r"|\$\{(?P<dbrace>[A-Za-z_]\w*)\}|\$(?P<dollar>[A-Za-z_]\w*)"
    r"|\{(?<!\{\{)(?P<fmt>[A-Za-z_][\w.]*(?:\[[^\]{}\n]*\])?)(?:![rsa])?(?::[^{}\n]*)?\}(?!\})",
    re.DOTALL,
)
# ``str.format`` / LangChain f-string templates: a replacement field. ``{{`` and ``}}`` are escaped
# braces there (literal text), which ``_format_fields`` skips before trying this.
_FORMAT_FIELD_RE = re.compile(r"\{(?P<fmt>[A-Za-z_][\w.]*(?:\[[^\]{}\n]*\])?)(?:![rsa])?(?::[^{}\n]*)?\}")
_RAW_END = re.compile(r"\{%-?\s*endraw\s*-?%\}")
_SYNTAX_GROUPS = {
    "jinja": {"jcomment", "jexpr", "jstmt"},
    "format": {"fmt"},
    "dollar": {"dbrace", "dollar"},
}
# Jinja statements that open a block closed by ``end<name>`` (``set`` only in its block form, without ``=``).
_BLOCK_STATEMENTS = {"for", "if", "macro", "call", "filter", "with", "autoescape", "block", "trans", "set"}
# Jinja statements after which the rendered text depends on data.
_CONTROL_STATEMENTS = {"if", "elif", "else", "for", "include", "call", "macro", "import", "from", "extends"}
_IDENT = re.compile(r"[A-Za-z_]\w*")
_NEWLINE = re.compile(r"\n")
# One cut of a text into elements: (start, end, class, name, literal); split_text makes them
_Cut = tuple[int, int, DynClass, str, bool]


def _placeholder(m: re.Match[str]) -> tuple[DynClass, str] | None:
    """Classify one placeholder match; ``None`` for text that renders to nothing (comments, ``set``)."""
    groups = m.groupdict()
    if groups.get("jcomment") is not None:
        return None
    if (expr := groups.get("jexpr")) is not None:
        if expr.startswith(("!", "/")):  # mustache comment ``{{! note }}`` / section end ``{{/items}}``
            return None
        if expr.startswith(("#", "^", ">")):  # mustache section, inverted section, partial
            return "control", expr
        ident = _IDENT.search(expr)
        name = ident.group() if ident else expr.strip()
        if _VOLATILE_CALL.search(expr):
            return "volatile", name
        return classify_name(expr.split("|")[0]), name
    if (stmt := groups.get("jstmt")) is not None:
        if stmt in _CONTROL_STATEMENTS:
            rest = m.group("jrest").strip()
            return "control", f"{stmt} {rest}".strip()
        return None
    name = groups.get("dbrace") or groups.get("dollar") or groups.get("fmt")
    assert name is not None, "placeholder regex matched no alternative"
    return classify_name(name), name


def _placeholders(text: str, syntax: str) -> Iterator[re.Match[str]]:
    """The placeholder matches of ``text`` under ``syntax``'s own rules, in order."""
    if syntax == "format":
        return _format_fields(text)
    return _template_placeholders(text, jinja=syntax in ("auto", "jinja"))


def _template_placeholders(text: str, jinja: bool) -> Iterator[re.Match[str]]:
    """``_PLACEHOLDER_RE.finditer(text)``, but only tried where a ``{`` or ``$`` is: every placeholder
    starts with one, and a regex alternation scans slowly through the long static text between.
    The text of a Jinja ``{% raw %}...{% endraw %}`` block is literal: only its two tags are matched."""
    pos = 0
    finder = ForwardFinder(text, "{$")
    while (i := finder.find(pos)) >= 0:
        m = _PLACEHOLDER_RE.match(text, i)
        if m is None:
            pos = i + 1
            continue
        yield m
        pos = max(m.end(), i + 1)
        if jinja and m.group("jstmt") == "raw" and (end := _RAW_END.search(text, pos)) is not None:
            yield end  # matches no named group of the scanner: renders nothing
            pos = end.end()


def _format_fields(text: str) -> Iterator[re.Match[str]]:
    """The replacement fields of a ``str.format`` template, read left to right as ``str.format`` does:
    ``{{`` and ``}}`` are literal braces, so ``{{"answer": ...}}`` holds no field and ``{{{x}}}`` one."""
    pos = 0
    finder = ForwardFinder(text, "{}")
    while (i := finder.find(pos)) >= 0:
        if text.startswith("{{", i) or text.startswith("}}", i):
            pos = i + 2
        elif text[i] == "{" and (m := _FORMAT_FIELD_RE.match(text, i)) is not None:
            yield m
            pos = m.end()
        else:
            pos = i + 1


def _style(m: re.Match[str]) -> str:
    groups = m.groupdict()
    for group in ("jcomment", "jexpr", "jstmt", "dbrace", "dollar", "fmt"):
        if groups.get(group) is not None:
            return group
    return "jstmt"  # an ``{% endraw %}`` tag (``_RAW_END``)


class _BlockMap:
    """Offset -> the innermost Jinja block open there, from the statements met in text order."""

    def __init__(self) -> None:
        self._stack: list[str] = []
        self._at: list[int] = [0]
        self._block: list[str] = [""]

    def statement(self, m: re.Match[str]) -> None:
        stmt, rest = m.group("jstmt"), m.group("jrest").strip()
        if stmt.startswith("end") and self._stack:
            self._stack.pop()
        elif stmt in _BLOCK_STATEMENTS and not (stmt == "set" and "=" in rest):
            self._stack.append(f"{stmt} {rest}".strip())
        else:
            return
        self._at.append(m.end())
        self._block.append(self._stack[-1] if self._stack else "")

    def section(self, m: re.Match[str]) -> None:
        """A mustache section: ``{{#items}}``/``{{^items}}`` opens one, ``{{/items}}`` closes it."""
        expr = m.group("jexpr")
        if expr.startswith("/") and self._stack:
            self._stack.pop()
        elif expr.startswith(("#", "^")):
            self._stack.append(m.group().strip("{} "))
        else:
            return
        self._at.append(m.end())
        self._block.append(self._stack[-1] if self._stack else "")

    def at(self, offset: int) -> str:
        return self._block[bisect_right(self._at, offset) - 1]


class LineIndex:
    """Offset -> (line, column) for a text, 1-based, given the line its first character is on."""

    def __init__(self, text: str, first_line: int = 1) -> None:
        self._starts = [0] + [m.end() for m in _NEWLINE.finditer(text)]
        self._first = first_line

    def at(self, offset: int) -> tuple[int, int]:
        i = bisect_right(self._starts, offset) - 1
        return self._first + i, offset - self._starts[i] + 1


def split_text(
    text: str,
    role: str,
    lines: LineIndex,
    syntax: str = "auto",
    var_classes: dict[str, DynClass] | None = None,
    offset: int = 0,
) -> list[Element]:
    """Cut ``text`` into static and dynamic elements (``offset``: where ``text`` starts in ``lines``).

    ``syntax`` limits which placeholder styles count (``auto``: all; ``jinja``; ``format``;
    ``dollar``; ``none``). ``var_classes`` overrides the name-based guess for listed variables.
    """
    allowed = None if syntax == "auto" else _SYNTAX_GROUPS.get(syntax, set())
    cuts: list[_Cut] = []
    blocks = _BlockMap()
    for m in _placeholders(text, syntax):
        style = _style(m)
        if allowed is not None and style not in allowed:
            continue
        if style == "jstmt" and m.re is _PLACEHOLDER_RE:
            blocks.statement(m)
        elif style == "jexpr":
            blocks.section(m)
        got = None if m.re is _RAW_END else _placeholder(m)
        if got is None:
            cuts.append((m.start(), m.end(), "placeholder", "", False))  # renders to nothing: drop the text
            continue
        cls, name = got
        if var_classes and name in var_classes:
            cls = var_classes[name]
        cuts.append((m.start(), m.end(), cls, name, False))
    # Literal per-user lines and dynamic values live in the static stretches between placeholders.
    literal: list[_Cut] = []
    if find_any(text, ":=" + DIGITS) >= 0:
        for base, text_line in lines_with(":=", text):
            hit = _PER_USER_LINE.match(text_line)
            if hit is not None:
                literal.append((base + hit.start("value"), base + hit.end("value"), "per-user", hit.group("key"),
                                True))
        for s in find_dynamic_spans(text):
            literal.append((s.start, s.end, "volatile", s.kind, True))
    if literal:
        cuts = _merge_cuts(cuts, literal)
    elements: list[Element] = []
    pos = 0
    for start, end, cls, name, is_literal in cuts:
        if start > pos:
            line, col = lines.at(offset + pos)
            elements.append(Element(text[pos:start], role, line, col, block=blocks.at(pos)))
        if name:  # a dropped comment/set has no name and adds no element
            line, col = lines.at(offset + start)
            elements.append(Element(text[start:end], role, line, col, dyn=cls, name=name, literal=is_literal,
                                    block=blocks.at(start)))
        pos = end
    if pos < len(text):
        line, col = lines.at(offset + pos)
        elements.append(Element(text[pos:], role, line, col, block=blocks.at(pos)))
    return elements


def _merge_cuts(placeholders: list[_Cut], literal: list[_Cut]) -> list[_Cut]:
    """Add literal cuts that do not overlap a placeholder (a placeholder wins)."""
    merged = sorted(placeholders + literal, key=lambda c: (c[0], -c[1]))
    out: list[_Cut] = []
    end = -1
    for cut in merged:
        if cut[0] >= end:
            out.append(cut)
            end = cut[1]
    return out
