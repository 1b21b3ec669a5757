"""PC011 too-many-cache-breakpoints: more than four Anthropic ``cache_control`` breakpoints.

What:
    The request marks more than four blocks (tools, system blocks, message blocks) with
    ``cache_control``.

Why:
    Anthropic allows at most four breakpoints per request and rejects the request otherwise;
    gateways that strip the extra ones keep an arbitrary subset.

Example:
    Five system blocks, each with "cache_control": {"type": "ephemeral"}.

Fix:
    Keep at most four: typically one after the tools, one after the system prompt, one at the end
    of the conversation history.
"""

from collections.abc import Iterator

from promptlint.analysis import LintContext, finding
from promptlint.cache_control import MAX_BREAKPOINTS, count_marks
from promptlint.model import Finding, PromptDoc, Severity

CODE = "PC011"
NAME = "too-many-cache-breakpoints"
SEVERITY: Severity = "error"
SUMMARY = "more than four cache_control breakpoints"
FIXABLE = False


def check(doc: PromptDoc, ctx: LintContext) -> Iterator[Finding]:
    marked = [e for e in doc.elements if e.breakpoint]
    # The request itself is the count (the gateway's parser, the one Anthropic's limit applies to);
    # elements only say where the marks sit.
    count = count_marks(doc.body) if doc.body is not None else len(marked)
    if count > MAX_BREAKPOINTS and marked:
        where = marked[MAX_BREAKPOINTS] if len(marked) > MAX_BREAKPOINTS else marked[-1]
        yield finding(
            doc, where, CODE, SEVERITY,
            f"{count} cache_control breakpoints; Anthropic accepts at most {MAX_BREAKPOINTS} "
            f"(this is number {MAX_BREAKPOINTS + 1})",
        )
