"""PC002 volatile-value-in-prefix: a timestamp, date, time, UUID or request id ahead of static content.

What:
    A value that changes on every request — a variable named like ``current_date``/``request_id``,
    a Jinja ``now()``, or a literal timestamp/time/UUID/request id (and, in a chat request file, a
    date) captured in the file — is followed by static text. A plain date written into a template
    is taken for a constant ("policy effective 2024-01-01") and not reported.

Why:
    "Today is 2026-11-29" on the first line of a system prompt makes every request's prompt differ
    from byte 12 on: the provider caches nothing, each request pays a full prefill.

Example:
    Current time: {timestamp}
    You are Acme's support assistant. ... (1,500 static tokens)

Fix:
    Move the value to the end of the prompt (or into the last user message). The PrefixGate
    gateway's ``reorder`` canonicalization does this at request time; ``--fix`` does it in the file
    for lines marked ``promptlint: movable``.
"""

from collections.abc import Iterator

from promptlint.analysis import MIN_STATIC_AFTER, LintContext, finding, is_movable, move_hint, shown
from promptlint.model import Finding, PromptDoc, Severity

CODE = "PC002"
NAME = "volatile-value-in-prefix"
SEVERITY: Severity = "warning"
SUMMARY = "a timestamp, date, UUID or request id comes before static text"
FIXABLE = True


def check(doc: PromptDoc, ctx: LintContext) -> Iterator[Finding]:
    for i, e in enumerate(doc.elements):
        if e.dyn == "volatile" and doc.static_after[i] >= MIN_STATIC_AFTER:
            kind = f"{e.name} value" if e.literal else "volatile placeholder"
            yield finding(
                doc, e, CODE, SEVERITY,
                f"{kind} {shown(e)} changes on every request and precedes {doc.static_after[i]} static "
                "tokens; move it after the static text" + move_hint(doc, e),
                fixable=is_movable(doc, e),
            )
