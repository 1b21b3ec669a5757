"""PC003 per-user-value-in-system: a user's name, id or email in the system prompt or ahead of static text.

What:
    A per-user value — a variable such as ``{user_name}``, ``{{ customer.email }}``, ``$user_id``, or a
    literal line like ``user_name: Alice`` — sits in the system prompt ahead of static text.

Why:
    Every user then has their own prefix: the instructions after the name are cached once per user
    instead of once for everybody, and a tenant with 10,000 users gets a hit rate near zero.

Example:
    You are helping {user_name} ({user_email}).
    Follow these support policies: ... (2,000 static tokens)

Fix:
    Keep the system prompt identical for everyone and pass user details last, e.g. a final
    "User profile: ..." message before the question. The gateway's ``reorder`` mode moves
    ``key: value`` lines of the variables a tenant marks as per-user.
"""

from collections.abc import Iterator

from promptlint.analysis import MIN_STATIC_AFTER, LintContext, finding, is_movable, move_hint, shown
from promptlint.model import Finding, PromptDoc, Severity

CODE = "PC003"
NAME = "per-user-value-in-system"
SEVERITY: Severity = "warning"
SUMMARY = "a per-user value (name, id, email) comes before static text"
FIXABLE = True


def check(doc: PromptDoc, ctx: LintContext) -> Iterator[Finding]:
    for i, e in enumerate(doc.elements):
        if e.dyn == "per-user" and doc.static_after[i] >= MIN_STATIC_AFTER:
            where = ("in a tool definition" if e.is_tools else "in the system prompt"
                     if e.role in ("system", "developer") else f"in a {e.role} message")
            yield finding(
                doc, e, CODE, SEVERITY,
                f"per-user value {shown(e)} {where} precedes {doc.static_after[i]} static tokens, so each "
                "user gets a separate cache entry; pass user details after the shared text" + move_hint(doc, e),
                fixable=is_movable(doc, e),
            )
