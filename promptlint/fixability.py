"""Which files ``--fix`` rewrites at all, decided from the file alone.

A rule marks a finding fixable when that kind of problem has a safe fix (unsorted tools, message
edge whitespace, a marked template line). Whether ``--fix`` applies it also depends on the file:
it never rewrites Python source (the fix is a change to the code) or a YAML request that holds
comments (a YAML dump would drop them). The linter clears ``fixable`` on such files and
:mod:`promptlint.fix` refuses them for the same reason, so ``[*]`` and "N fixable with --fix"
promise only what ``--fix`` does.
"""

from __future__ import annotations

import yaml

from promptlint.model import PromptDoc


def has_yaml_comment(raw: str) -> bool:
    """Whether the YAML text ``raw`` holds a comment: a ``#`` outside every scalar. PyYAML's scanner
    drops comments but reports where each scalar (plain, quoted or block) starts and ends, so a ``#``
    inside text ("Ticket #42", ``'a # b'``, a ``|`` block) is not taken for one. Text the scanner
    cannot read counts as commented: the file is then left for a human to fix."""
    if "#" not in raw:
        return False
    try:
        spans = [(t.start_mark.index, t.end_mark.index) for t in yaml.scan(raw) if isinstance(t, yaml.ScalarToken)]
    except yaml.YAMLError:
        return True
    hashes = (i for i, c in enumerate(raw) if c == "#")
    return any(not any(start <= i < end for start, end in spans) for i in hashes)


def rewrite_refusal(doc: PromptDoc) -> str:
    """Why ``--fix`` never rewrites ``doc``'s file ("" when it may)."""
    if doc.kind == "source":
        return "source files are never rewritten: the fix is a change to the code"
    if doc.kind == "request" and doc.path.suffix.lower() != ".json" and has_yaml_comment(doc.raw):
        return "YAML with comments would lose them; fix by hand"
    return ""
