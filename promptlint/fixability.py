"""Which files ``--fix`` rewrites at all, decided from the file alone.

A rule marks a finding fixable when that kind of problem has a safe fix (unsorted tools, message
edge whitespace, a marked template line). Whether ``--fix`` applies it also depends on the file:
it never rewrites Python source (the fix is a change to the code) or a YAML request that holds
comments (a YAML dump would drop them). The linter clears ``fixable`` on such files and
:mod:`promptlint.fix` refuses them for the same reason, so ``[*]`` and "N fixable with --fix"
promise only what ``--fix`` does.
"""

from __future__ import annotations

import re

from promptlint.model import PromptDoc

# Conservative: " #" inside a quoted string counts too; a file is then left for a human to fix.
_YAML_COMMENT = re.compile(r"^\s*#|\s#", re.MULTILINE)


def rewrite_refusal(doc: PromptDoc) -> str:
    """Why ``--fix`` never rewrites ``doc``'s file ("" when it may)."""
    if doc.kind == "source":
        return "source files are never rewritten: the fix is a change to the code"
    if doc.kind == "request" and doc.path.suffix.lower() != ".json" and _YAML_COMMENT.search(doc.raw):
        return "YAML with comments would lose them; fix by hand"
    return ""
