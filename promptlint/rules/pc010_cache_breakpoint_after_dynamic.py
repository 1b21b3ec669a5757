"""PC010 cache-breakpoint-after-dynamic: an Anthropic ``cache_control`` breakpoint caches dynamic content.

What:
    A ``cache_control`` breakpoint sits on or after a block that holds a volatile value, a per-user
    value, a template variable or the request's input (``{{documents}}``), so the cached prefix it
    writes includes that value. (Input in the last user message, with a breakpoint on it, is the
    usual multi-turn pattern and is fine.)

Why:
    The breakpoint pays the cache-write premium (1.25x input price) on every request, and the entry
    it writes is only read by a request with the same value: with a timestamp, never.

Example:
    "system": [{"type": "text", "text": "Now: 2026-11-29T10:00Z. You are ...",
                "cache_control": {"type": "ephemeral"}}]

Fix:
    Put the breakpoint on the last block of static content, before the first dynamic value, and
    move dynamic values after it.
"""

from collections.abc import Iterator

from promptlint.analysis import LintContext, finding, shown
from promptlint.model import Finding, PromptDoc, Severity

CODE = "PC010"
NAME = "cache-breakpoint-after-dynamic"
SEVERITY: Severity = "warning"
SUMMARY = "a cache_control breakpoint comes after dynamic content"
FIXABLE = False


def _last_user_message(doc: PromptDoc) -> range:
    """Indices of the elements of the last user message (the trailing run of ``user`` elements)."""
    last = max((i for i, e in enumerate(doc.elements) if e.role == "user"), default=-1)
    first = last
    while first > 0 and doc.elements[first - 1].role == "user":
        first -= 1
    return range(first, last + 1)


def check(doc: PromptDoc, ctx: LintContext) -> Iterator[Finding]:
    exempt = _last_user_message(doc)
    first_dyn = None
    late = []
    for i, e in enumerate(doc.elements):
        # Any dynamic value counts, the request's input ({{documents}}, {{question}}) included, except
        # in the last user message: a breakpoint there is the usual multi-turn pattern.
        if first_dyn is None and e.dyn is not None and i not in exempt:
            first_dyn = e
        if e.breakpoint and first_dyn is not None:
            late.append(e)
    if late:
        assert first_dyn is not None  # a breakpoint is late only after the first dynamic value
        more = f" ({len(late) - 1} later breakpoint(s) likewise)" if len(late) > 1 else ""
        yield finding(
            doc, late[0], CODE, SEVERITY,
            f"cache_control breakpoint caches a prefix that includes dynamic value {shown(first_dyn)} "
            f"(line {first_dyn.line}), so it is written on every request and rarely read{more}; put the "
            "breakpoint before the first dynamic value",
        )
