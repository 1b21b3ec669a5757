"""PC013 unstable-build-order: Python code builds prompt parts in an order that changes between runs.

What:
    In a file that calls an LLM SDK: ``random.shuffle``/``random.sample``, iterating a set (or
    ``list(set(...))``), or ``json.dumps`` without ``sort_keys=True``.

Why:
    A prefix cache serves only identical bytes. Shuffled tools or few-shot examples give a new prefix
    on every request; a set of strings iterates in a different order in every process (hash
    randomization), so each worker of a fleet caches its own copy; ``json.dumps`` keeps whatever key
    order the object was built in, which differs between code paths.

Example:
    tools = [SEARCH, WEATHER, CALENDAR]
    random.shuffle(tools)
    for name in set(enabled): ...
    schema_text = json.dumps(schema)

Fix:
    Keep one fixed order: ``sorted(...)`` instead of a set, no shuffle (rotate examples at fixed
    points if you must), ``json.dumps(obj, sort_keys=True, separators=(",", ":"))``. A line that is
    not part of a prompt can say ``# promptlint: noqa[PC013]``.
"""

from collections.abc import Iterator

from promptlint.analysis import LintContext
from promptlint.model import Finding, PromptDoc, Severity

CODE = "PC013"
NAME = "unstable-build-order"
SEVERITY: Severity = "warning"
SUMMARY = "source code shuffles, iterates a set or dumps JSON unsorted while building prompts"
FIXABLE = False


def check(doc: PromptDoc, ctx: LintContext) -> Iterator[Finding]:
    # promptlint.source_scan attaches the file's hazards (promptlint.order_hazards) to its first doc.
    for h in doc.meta.get("order_hazards", ()):
        yield Finding(
            CODE, doc.display, h.line, h.column,
            f"{h.what}: {h.why}, so a prompt built from it is a different prefix each time; use a fixed "
            "order (sorted(...), sort_keys=True)",
            SEVERITY,
        )
