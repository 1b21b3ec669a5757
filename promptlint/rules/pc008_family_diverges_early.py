"""PC008 family-diverges-early: templates of one family share most of their text but differ at the start.

What:
    Two or more templates of the same family (front matter ``family:``, else the same directory)
    have most of their lines in common, yet their common *prefix* is short: each one starts with its
    own text (a role line, a product name) and only then repeats the shared instructions.

Why:
    A prefix cache can only share what comes first. Five variants of a 2,000-token prompt that
    differ on line 1 are five cache entries; hoisting the shared 1,800 tokens to the top makes them
    one, and every variant hits it.

Example:
    support_billing.txt:   You handle billing questions.\\n<shared policy, 60 lines>
    support_shipping.txt:  You handle shipping questions.\\n<shared policy, 60 lines>

Fix:
    Start every variant with the shared text and put the variant-specific lines after it (or make
    the shared part one template that each variant extends).
"""

from collections import defaultdict
from collections.abc import Iterator

from promptlint.analysis import LintContext
from promptlint.explain import first_divergence
from promptlint.model import Finding, PromptDoc, Severity

CODE = "PC008"
NAME = "family-diverges-early"
SEVERITY: Severity = "info"
SUMMARY = "templates of one family share most text but diverge early"
FIXABLE = False
MIN_SHARED_SHARE = 0.5  # of a template's characters in lines that a sibling also has
MIN_SHARED_CHARS = 400  # about 100 tokens: below that, hoisting is not worth a finding


def _lines(doc: PromptDoc) -> list[str]:
    return "".join(e.text for e in doc.elements).split("\n")


def check_project(docs: list[PromptDoc], ctx: LintContext) -> Iterator[Finding]:
    families: dict[str, list[PromptDoc]] = defaultdict(list)
    for doc in docs:
        if doc.kind == "template":
            families[str(doc.meta.get("family") or doc.path.parent.as_posix())].append(doc)
    for family, members in sorted(families.items()):
        if len(members) < 2:
            continue
        lines = {id(d): tuple(_lines(d)) for d in members}
        df: dict[str, int] = defaultdict(int)
        for d in members:
            for line in set(lines[id(d)]):
                if line.strip():
                    df[line] += 1
        # The longest common prefix with any sibling is the LCP with a neighbour in sorted order.
        ordered = sorted(members, key=lambda d: lines[id(d)])
        best = {id(d): 0 for d in members}
        for a, b in zip(ordered, ordered[1:]):
            n = first_divergence(lines[id(a)], lines[id(b)])
            best[id(a)] = max(best[id(a)], n)
            best[id(b)] = max(best[id(b)], n)
        for d in members:
            ls = lines[id(d)]
            total = sum(len(x) + 1 for x in ls)
            shared = sum(len(x) + 1 for x in ls if df.get(x, 0) >= 2)
            prefix = sum(len(x) + 1 for x in ls[: best[id(d)]])
            if shared < MIN_SHARED_CHARS or shared < MIN_SHARED_SHARE * total or prefix >= 0.5 * shared:
                continue
            yield Finding(
                CODE, d.display, d.body_line + best[id(d)], 1,
                f"{100 * shared // total}% of this template is shared with other templates of family "
                f"{family!r} ({len(members)} files), but they diverge at this line; hoist the shared text to "
                "the top so they share one cached prefix",
                SEVERITY,
            )
