"""PC007 prefix-below-minimum: the static prefix is shorter than the provider's minimum cacheable length.

What:
    The prompt has enough static text to be cached (at least the provider's minimum), but the part
    that precedes the first dynamic value is shorter than that minimum, so nothing is cached.

Why:
    Providers only cache prefixes of a minimum length: OpenAI 1,024 tokens; Anthropic 1,024 for
    most models, 2,048 for Claude Haiku 3/3.5, 4,096 for Claude Opus 4.5 and Haiku 4.5. A 900-token
    prefix followed by a variable and 2,000 more static tokens is cached by nobody.

Example:
    You are a support bot. (300 tokens)
    Customer tier: {tier}
    Policies: ... (1,500 tokens)

Fix:
    Move static text ahead of the first variable until the prefix passes the minimum. Prompts whose
    static text is below the minimum in total are left alone: they cannot benefit.
"""

from collections.abc import Iterator

from promptlint.analysis import LintContext
from promptlint.model import Finding, PromptDoc, Severity

CODE = "PC007"
NAME = "prefix-below-minimum"
SEVERITY: Severity = "warning"
SUMMARY = "the static prefix is below the provider's minimum cacheable length"
FIXABLE = False


def check(doc: PromptDoc, ctx: LintContext) -> Iterator[Finding]:
    first = doc.first_dynamic
    if first is None or doc.prefix_tokens >= ctx.min_cache_tokens or doc.static_tokens < ctx.min_cache_tokens:
        return
    e = doc.elements[first]
    yield Finding(
        CODE, doc.display, e.line, e.column,
        f"the cacheable prefix is {doc.prefix_tokens} tokens, below {ctx.provider}'s {ctx.min_cache_tokens}-token "
        f"minimum for {ctx.model}, while the prompt has {doc.static_tokens} static tokens; move static text "
        "ahead of the first variable",
        SEVERITY,
    )
