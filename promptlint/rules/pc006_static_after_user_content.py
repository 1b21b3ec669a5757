"""PC006 static-after-user-content: few-shot examples or long instructions after the user's input.

What:
    Few-shot examples ("Example 1:", "Q:/A:", ``<example>``, "Input:/Output:") or a long run of
    static instructions (200+ tokens) come after the user's input (``{question}``, ``{query}``, the
    retrieved documents, or the last user message of a request).

Why:
    The user's input differs on every request, so everything after it is prefilled every time.
    Examples and instructions are the same for everyone: placed before the input they are cached.

Example:
    Question: {question}
    Here are some examples of good answers:
    Example 1: ...

Fix:
    Move the examples and instructions above the input; end the prompt with the input (and at most
    a short "Answer:" cue).
"""

import re
from collections.abc import Iterator

from promptlint.analysis import LintContext, shown
from promptlint.model import Finding, PromptDoc, Severity

CODE = "PC006"
NAME = "static-after-user-content"
SEVERITY: Severity = "warning"
SUMMARY = "few-shot examples or long instructions come after the user's input"
FIXABLE = False
LONG_STATIC = 200

_EXAMPLES = re.compile(
    r"^\s*(?:#+\s*)?(?:examples?\b|example\s*\d+|few[- ]shot|q:|a:|input:|output:|<examples?>)",
    re.IGNORECASE | re.MULTILINE,
)


def check(doc: PromptDoc, ctx: LintContext) -> Iterator[Finding]:
    first_input = next((i for i, e in enumerate(doc.elements) if e.dyn == "input"), None)
    if first_input is None:
        return
    user = doc.elements[first_input]
    run = 0
    for e in doc.elements[first_input + 1 :]:
        if e.dyn is not None:
            run = 0
            continue
        run += e.tokens
        m = _EXAMPLES.search(e.text)
        if m or run >= LONG_STATIC:
            what = "few-shot examples" if m else f"{run} tokens of static instructions"
            line = e.line
            if m and doc.kind == "template":  # template text keeps its newlines: point at the examples
                line += e.text.count("\n", 0, m.start() + len(m.group()) - len(m.group().lstrip()))
            yield Finding(
                CODE, doc.display, line, 1,
                f"{what} after the user's input {shown(user)} (line {user.line}) are prefilled on every "
                "request; move them before the input",
                SEVERITY,
            )
            return
