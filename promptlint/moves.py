"""Which template lines ``--fix`` may move to the end, and why it may not move the others.

A line marked movable moves only as a unit that renders the same text for the same requests at its
new place and leaves a valid template behind:

- a line inside a Jinja block (``{% if is_beta %} ... {% endif %}``) stays: moved out of the block
  it would render for every request (the block itself may be marked and then moves whole);
- a line that opens a block moves together with every line up to the one that closes it, and a
  ``{{ }}``/``{# #}``/``{% raw %}`` construct spanning lines is never cut;
- a unit that binds a name (``set``, ``macro``, ``import``, ``from``, ``extends``, ``block``) stays:
  lines after it may use the name;
- nothing moves in a template that is a string inside a YAML/JSON file: its raw lines are the
  document's, and moving them could break it;
- a unit whose lines also hold a value that is not marked movable stays: moving ``Hello {user_name},
  today is {current_date}.`` for ``current_date`` would drag ``user_name`` along.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from promptlint.loader import REQUEST_EXTS
from promptlint.model import Element, PromptDoc

_MOVABLE = re.compile(r"promptlint:\s*movable\b")
_OPENERS = {"for", "if", "macro", "call", "filter", "with", "autoescape", "block", "trans", "set"}
_BINDERS = {"set", "macro", "import", "from", "extends", "block"}
_SPANS = {"variable_begin": "variable_end", "comment_begin": "comment_end", "raw_begin": "raw_end"}


@dataclass(frozen=True)
class Unit:
    """Lines ``first..last`` (1-based, in the file) that move together."""

    first: int
    last: int


@dataclass
class MovePlan:
    units: list[Unit] = field(default_factory=list)
    refused: dict[int, str] = field(default_factory=dict)  # marked line -> why it stays


@dataclass
class _Structure:
    """Per body line (0-based): the Jinja construct open at its start ("" at the top level), whether
    the constructs it touches balance at its end, and the binding statements on it."""

    open_at_start: list[str]
    depth_at_end: list[int]
    binders: list[list[str]]


def is_marked(doc: PromptDoc, e: Element) -> bool:
    """Whether the template marks this value movable: by name in front matter, or on its line."""
    if doc.kind != "template":
        return False
    movable = doc.meta.get("movable") or []
    if isinstance(movable, list) and e.name in movable:
        return True
    return bool(_MOVABLE.search(doc.line_text(e.line)))


def plan(doc: PromptDoc, marked_lines: Iterable[int]) -> MovePlan:
    """The units to move for the marked lines (file line numbers), and the lines refused with why."""
    if doc.path.suffix.lower() in REQUEST_EXTS:
        # The template is a string inside YAML/JSON: moving raw lines could break the document.
        return MovePlan(refused=dict.fromkeys(marked_lines, "the template is a string inside a YAML/JSON file, "
                                              "where moving raw lines could break the document; move it by hand"))
    body = doc.raw.split("\n")[doc.body_line - 1 :]
    structure = _structure(doc, body)
    out = MovePlan()
    taken: set[int] = set()
    for line in sorted(set(marked_lines)):
        i = line - doc.body_line
        if not 0 <= i < len(body) or line in taken:
            continue
        unit, why = _unit(doc, structure, i)
        if unit is None:
            out.refused[line] = why
            continue
        out.units.append(unit)
        taken.update(range(unit.first, unit.last + 1))
    return out


def refusal(doc: PromptDoc, e: Element) -> str:
    """Why ``--fix`` will not move ``e``'s line ("" when it will)."""
    return plan(doc, [e.line]).refused.get(e.line, "")


def _block_at_line_start(doc: PromptDoc, line: int) -> str:
    """The block (Jinja or mustache section) open where ``line`` starts, from the parsed elements."""
    covering = [e for e in doc.elements if (e.line, e.column) <= (line, 1)]
    return covering[-1].block if covering else ""


def _unit(doc: PromptDoc, s: _Structure, i: int) -> tuple[Unit | None, str]:
    enclosing = s.open_at_start[i] or _block_at_line_start(doc, doc.body_line + i)
    if enclosing:
        return None, (f"it lies inside `{enclosing}`; moved out of it alone it would no longer render "
                      "only where that block does (mark the block's opening line movable to move the whole block)")
    j = i
    while s.depth_at_end[j] > 0 and j + 1 < len(s.depth_at_end):
        j += 1
    if s.depth_at_end[j] > 0:
        return None, "the Jinja block it opens is not closed"
    binders = sorted({b for k in range(i, j + 1) for b in s.binders[k]})
    if binders:
        return None, f"it holds `{{% {binders[0]} %}}`, which defines a name the lines after it may use"
    unit = Unit(doc.body_line + i, doc.body_line + j)
    if any(e.dyn == "control" and e.text.startswith("{{") for e in doc.elements if unit.first <= e.line <= unit.last):
        return None, "it holds a mustache section tag, whose section --fix does not move"
    dragged = [e for e in doc.elements if e.dyn is not None and unit.first <= e.line <= unit.last
               and not e.block and not is_marked(doc, e)]
    if dragged:
        return None, (f"line {dragged[0].line} also holds {dragged[0].text.strip()}, which is not marked movable "
                      "and would move with it")
    return unit, ""


def _structure(doc: PromptDoc, body: list[str]) -> _Structure:
    n = len(body)
    s = _Structure([""] * n, [0] * n, [[] for _ in range(n)])
    if str(doc.meta.get("syntax", "auto")) not in ("auto", "jinja"):
        return s  # no Jinja: every line is its own unit
    events = _jinja_events("\n".join(body))
    if events is None:
        return s
    stack: list[str] = []
    k = 0
    for i in range(n):
        s.open_at_start[i] = stack[-1] if stack else ""
        while k < len(events) and events[k][0] == i + 1:
            _, kind, what = events[k]
            if kind == "open":
                stack.append(what)
            elif kind == "close" and stack:
                stack.pop()
            elif kind == "bind":
                s.binders[i].append(what)
            k += 1
        s.depth_at_end[i] = len(stack)
    return s


def _jinja_events(text: str) -> list[tuple[int, str, str]] | None:
    """(line, open|close|bind, what) for every Jinja block tag and multi-line construct, in order;
    ``None`` when the text does not lex as Jinja (then it has no block structure to respect)."""
    import jinja2  # deferred: only --fix and marked lines pay for it

    try:
        tokens = list(jinja2.Environment().lex(text))
    except jinja2.TemplateSyntaxError:
        return None
    events: list[tuple[int, str, str]] = []
    for k, (line, kind, value) in enumerate(tokens):
        if kind in _SPANS:
            end = next((t[0] for t in tokens[k + 1 :] if t[1] == _SPANS[kind]), line)
            if end > line:  # a construct that spans lines: never cut it
                events += [(line, "open", f"the `{value}` construct of line {line}"), (end, "close", "")]
        elif kind == "block_begin":
            events += _statement_events(line, tokens, k)
    return sorted(events, key=lambda ev: ev[0])


def _statement_events(line: int, tokens: list[tuple[int, str, str]], k: int) -> list[tuple[int, str, str]]:
    words = []
    for _, kind, value in tokens[k + 1 :]:
        if kind == "block_end":
            break
        if kind != "whitespace":
            words.append(value)
    if not words:
        return []
    stmt, tag = words[0], "{% " + " ".join(words) + " %}"
    events = [(line, "bind", stmt)] if stmt in _BINDERS else []
    if stmt.startswith("end"):
        events.append((line, "close", ""))
    elif stmt in _OPENERS and not (stmt == "set" and "=" in words):
        events.append((line, "open", f"{tag} (line {line})"))
    return events
