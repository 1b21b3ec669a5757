"""PC005 tools-after-dynamic: tool definitions or schemas placed after dynamic content.

What:
    A block of tool definitions or a JSON schema (``"parameters"``, ``"properties"``, a "## Tools"
    section, ``<tools>``) written into the prompt text comes after a variable or the user's input.

Why:
    Tool definitions are long and identical for every request: they are the best thing to cache.
    Written after a dynamic value they are re-prefilled every time.

Example:
    User question: {question}
    ## Tools
    {"name": "search", "parameters": {"type": "object", "properties": {...}}}

Fix:
    Declare tools through the API's ``tools`` field (providers render them first) or move the
    block to the top of the system prompt, before any variable.
"""

import re
from collections.abc import Iterator

from promptlint.analysis import LintContext, shown
from promptlint.model import Finding, PromptDoc, Severity

CODE = "PC005"
NAME = "tools-after-dynamic"
SEVERITY: Severity = "warning"
SUMMARY = "tool definitions or schemas come after dynamic content"
FIXABLE = False

_TOOLS_BLOCK = re.compile(
    r'"(?:parameters|properties|input_schema|json_schema)"\s*:'
    r"|^\s*#{1,6}\s*(?:available\s+)?(?:tools|functions)\b"
    r"|<(?:tools|functions|tool_definitions)>"
    r"|\bjson schema\b",
    re.IGNORECASE | re.MULTILINE,
)


_HINTS = ("parameters", "properties", "schema", "tools", "functions", "tool_definitions")


def _maybe_tools(text: str) -> bool:
    # Substring tests are far cheaper than the regex; most static text has none of these words.
    lower = text.lower()
    return any(h in lower for h in _HINTS)


def check(doc: PromptDoc, ctx: LintContext) -> Iterator[Finding]:
    first = doc.first_dynamic
    if first is None:
        return
    cut = doc.elements[first]
    for e in doc.elements[first + 1 :]:
        if e.is_tools:
            continue  # the rest of a tool list cut by a value inside it: PC001/2/3 report that value
        m = _TOOLS_BLOCK.search(e.text) if e.dyn is None and _maybe_tools(e.text) else None
        if m is None:
            continue
        # Template text keeps its newlines; a JSON string sits on one physical line.
        line = e.line + (e.text.count("\n", 0, m.start()) if doc.kind == "template" else 0)
        yield Finding(
            CODE, doc.display, line, 1,
            f"tool definitions or a schema come after dynamic content {shown(cut)} (line {cut.line}), "
            "so they are re-prefilled on every request; put them before any variable",
            SEVERITY,
        )
        return
