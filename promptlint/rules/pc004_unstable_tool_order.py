"""PC004 unstable-tool-order: tools not sorted by name, or schemas not in canonical key order.

What:
    The request's ``tools`` (or ``functions``) are not sorted by name, or a tool or response schema
    has object keys in an order other than the canonical (sorted) one.

Why:
    Tools are rendered at the very start of the prompt. Code that builds the list from a dict, a
    plugin registry or a set sends them in a different order from one process to the next, and
    every ordering is a different prefix: the cache misses before the system prompt even starts.

Example:
    "tools": [{"function": {"name": "search", ...}}, {"function": {"name": "create_ticket", ...}}]

Fix:
    Sort tools by name and serialise schemas with sorted keys (``json.dumps(..., sort_keys=True)``).
    ``promptlint check --fix`` rewrites the file that way (only order changes); the gateway's
    ``safe`` canonicalization does the same per request. A ``cache_control`` mark on the last tool
    moves to the new last tool; a list with a mark on another tool is not sorted (the mark would
    then cache a different set of tools). The field names under a response schema's
    ``properties`` keep their order: it is the order the model writes the fields in.
"""

from collections.abc import Iterator

from promptlint.analysis import LintContext
from promptlint.canon import canonicalize, tool_name, tool_sort_blocker
from promptlint.model import Finding, PromptDoc, Severity

CODE = "PC004"
NAME = "unstable-tool-order"
SEVERITY: Severity = "warning"
SUMMARY = "tools unsorted or schema keys in a non-canonical order"
FIXABLE = True
# The request keys this rule checks, and the only ones its fix (their ``safe`` canonical form) rewrites.
CANON_KEYS = ("tools", "functions", "response_format")


def check(doc: PromptDoc, ctx: LintContext) -> Iterator[Finding]:
    if doc.body is None:
        return
    probe = {k: doc.body[k] for k in CANON_KEYS if k in doc.body}
    if not probe:
        return
    applied = canonicalize(probe, "safe").applied
    line = next((e.line for e in doc.elements if e.is_tools), 1)
    tools = doc.body.get("tools") or doc.body.get("functions") or []
    names = ", ".join(tool_name(t) for t in tools) if isinstance(tools, list) else ""
    blocker = tool_sort_blocker(tools) if isinstance(tools, list) else ""
    if "tools-sorted" in applied:
        yield Finding(CODE, doc.display, line, 1,
                      f"tools are not sorted by name ({names}); any other order is a different prefix",
                      SEVERITY, True)
    elif blocker and [tool_name(t) for t in tools] != sorted(tool_name(t) for t in tools):
        yield Finding(CODE, doc.display, line, 1,
                      f"tools are not sorted by name ({names}); any other order is a different prefix. "
                      f"--fix does not sort them: {blocker}; sort them by hand and put the breakpoint on "
                      "the last tool", SEVERITY, False)
    if "tool-schemas-canonical" in applied or "response-schema-canonical" in applied:
        what = "tool schemas" if "tool-schemas-canonical" in applied else "the response schema"
        yield Finding(CODE, doc.display, line, 1,
                      f"{what} have keys in a non-canonical order; serialise with sorted keys so the "
                      "bytes never depend on how the dict was built", SEVERITY, True)
