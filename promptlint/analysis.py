"""Measuring a loaded prompt: token counts, the cacheable prefix, and what the rules share.

Everything a rule needs about *where* the cacheable prefix ends is computed here once per file:

    elements:  [ static | static | DYN | static | DYN | static ]
    tokens:       120      300     12     900     200     40
    prefix_tokens = 420 (static tokens before the first dynamic element)
    static_after[i] = static tokens after element i (e.g. 940 after the first DYN)
    total_tokens = all static + expected dynamic = 1572;  score = 100 * 420 / 1572
"""

from __future__ import annotations

from dataclasses import dataclass

from promptlint.loader import REQUEST_EXTS
from promptlint.model import Element, Finding, PromptDoc, Severity
from promptlint.moves import is_marked, refusal
from promptlint.tokens import TokenCounter, cache_minimum

# Expected size of a value when the template does not say (front matter ``vars: {x: {tokens: N}}``).
DEFAULT_DYNAMIC_TOKENS = {"volatile": 12, "per-user": 8, "input": 200, "placeholder": 50, "control": 0}
# Static text shorter than this after a dynamic value is not worth a finding (a closing tag, "Answer:").
MIN_STATIC_AFTER = 16


@dataclass(frozen=True)
class LintContext:
    """What every rule may know besides the document: the target model and its tokenizer."""

    model: str
    counter: TokenCounter
    provider: str
    min_cache_tokens: int

    @classmethod
    def for_model(cls, model: str) -> LintContext:
        provider, minimum = cache_minimum(model)
        return cls(model, TokenCounter(model), provider, minimum)


def var_sizes(doc: PromptDoc) -> dict[str, int]:
    spec = doc.meta.get("vars") or {}
    return {str(k): v["tokens"] for k, v in spec.items() if isinstance(v, dict) and isinstance(v.get("tokens"), int)}


def measure(doc: PromptDoc, ctx: LintContext) -> None:
    """Fill ``tokens`` of every element and the document's prefix/static/total counts."""
    sizes = var_sizes(doc)
    for e in doc.elements:
        if e.dyn is None or e.literal or e.name == "last user message":
            e.tokens = ctx.counter.count(e.text)
        else:
            e.tokens = sizes.get(e.name, DEFAULT_DYNAMIC_TOKENS[e.dyn])
    after = [0] * len(doc.elements)
    running = 0
    for i in range(len(doc.elements) - 1, -1, -1):
        after[i] = running
        if doc.elements[i].dyn is None:
            running += doc.elements[i].tokens
    doc.static_after = after
    doc.static_tokens = running
    first = doc.first_dynamic
    doc.prefix_tokens = running if first is None else sum(e.tokens for e in doc.elements[:first])
    doc.total_tokens = sum(e.tokens for e in doc.elements)


def is_movable(doc: PromptDoc, e: Element) -> bool:
    """Whether the template marks this value's line as safe to move to the end and ``--fix`` can
    move it without changing the template's meaning (see :mod:`promptlint.moves`)."""
    return is_marked(doc, e) and not refusal(doc, e)


def move_hint(doc: PromptDoc, e: Element) -> str:
    """How ``--fix`` could move a template value, or why it will not ("" when it will)."""
    if doc.kind != "template":
        return ""
    if is_marked(doc, e):
        why = refusal(doc, e)
        return f"; it is marked movable, but --fix leaves it: {why}" if why else ""
    if doc.path.suffix.lower() in REQUEST_EXTS:
        return ""  # --fix moves no line of a template inside a YAML/JSON file: no mark to suggest
    if e.block:
        return (f"; --fix cannot move it on its own: it lies inside `{{% {e.block} %}}` and would then render "
                "for every request (move the whole block, or mark the block's opening line `promptlint: movable`)")
    if e.dyn == "control" and e.text.startswith("{{"):
        return ""  # a mustache section: --fix does not move sections
    if e.dyn == "control":
        # Only the line mark: --fix moves the whole block from the marked opening line to its end tag.
        return ("; or, if the whole block may go last, mark its opening line `{# promptlint: movable #}` and "
                "--fix moves the block")
    return (f"; or, if that line may go last, mark it `promptlint: movable` (in a comment your renderer strips, "
            f"or front matter `movable: [{e.name or 'var'}]`) and --fix moves it")


def finding(doc: PromptDoc, e: Element, code: str, severity: Severity, message: str, fixable: bool = False) -> Finding:
    return Finding(code, doc.display, e.line, e.column, message, severity, fixable)


def shown(e: Element) -> str:
    """How to name an element in a message: the placeholder as written, or the literal value."""
    text = e.text.strip().replace("\n", " ")
    return text if len(text) <= 40 else text[:37] + "..."
