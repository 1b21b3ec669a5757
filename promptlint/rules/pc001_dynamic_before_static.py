"""PC001 dynamic-before-static: a placeholder ahead of static content.

What:
    A template variable (or a Jinja ``if``/``for``) comes before a stretch of static text. Variables
    that PC002 (volatile) and PC003 (per-user) recognise are left to those rules.

Why:
    Prefix caches reuse the longest byte-identical *prefix*. Everything after the first value that
    changes between requests is prefilled again on every request, however static it is.

Example:
    Context: {documents}
    You are a careful research assistant. Answer only from the context ...  (800 static tokens)

Fix:
    Put the static instructions first and the variables last:
    "You are a careful research assistant ... \\n\\nContext: {documents}". Mark a line that may move
    with ``promptlint: movable`` (in a comment your renderer strips) and ``--fix`` moves it.
"""

from collections.abc import Iterator

from promptlint.analysis import MIN_STATIC_AFTER, LintContext, finding, is_movable, move_hint, shown
from promptlint.model import Finding, PromptDoc, Severity

CODE = "PC001"
NAME = "dynamic-before-static"
SEVERITY: Severity = "warning"
SUMMARY = "a template variable comes before static text, which then cannot be cached"
FIXABLE = True


def check(doc: PromptDoc, ctx: LintContext) -> Iterator[Finding]:
    # Once per file: the first variable that cuts the prefix is the one to fix first.
    for i, e in enumerate(doc.elements):
        if e.dyn in ("placeholder", "input", "control") and doc.static_after[i] >= MIN_STATIC_AFTER:
            what = "control block" if e.dyn == "control" else "placeholder"
            yield finding(
                doc, e, CODE, SEVERITY,
                f"{what} {shown(e)} comes before {doc.static_after[i]} tokens of static text that are "
                f"re-prefilled on every request; move the static text ahead of it" + move_hint(doc, e),
                fixable=is_movable(doc, e),
            )
            return
