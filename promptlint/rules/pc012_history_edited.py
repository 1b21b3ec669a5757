"""PC012 history-edited: the conversation history is rewritten or truncated instead of appended to.

What:
    Application code sends a slice of the conversation that drops its oldest messages
    (``history[-10:]``, ``messages[-N:]``) or rebuilds earlier turns, so the messages that a previous
    request sent are not sent again unchanged. At run time the PrefixGate gateway reports the same
    code when a request's earlier message differs from what the previous request of its family sent.

Why:
    A prefix cache reuses what comes first. Dropping the oldest turn shifts every later message, and
    editing turn 2 of 10 changes everything after it: the whole history is prefilled again on
    every request, though all of it was cached a moment ago.

Example:
    messages = [{"role": "system", "content": SYSTEM}] + history[-10:]

Fix:
    Append new turns and keep earlier ones byte-identical. When the history must shrink, summarize
    at a fixed point (every 20 turns), keep that summary unchanged, and append after it.
"""

from collections.abc import Iterator

from promptlint.analysis import LintContext
from promptlint.model import Finding, PromptDoc, Severity

CODE = "PC012"
NAME = "history-edited"
SEVERITY: Severity = "warning"
SUMMARY = "the conversation history is truncated or rewritten instead of appended to"
FIXABLE = False


def check(doc: PromptDoc, ctx: LintContext) -> Iterator[Finding]:
    # Source files record history slices while building their elements (promptlint.source_scan).
    for line, column, expr in doc.meta.get("history_slices", ()):
        yield Finding(
            CODE, doc.display, line, column,
            f"{expr} drops the oldest messages, so each request's history starts at a different message "
            "and none of it is served from the cache; append, and summarize at fixed points instead",
            SEVERITY,
        )
