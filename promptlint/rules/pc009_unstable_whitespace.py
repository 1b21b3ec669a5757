"""PC009 unstable-whitespace: line endings, trailing or invisible whitespace in the cacheable prefix.

What:
    The prefix contains ``\\r\\n`` line endings, trailing spaces/tabs, or invisible characters
    (zero-width space, non-breaking space, BOM, word joiner); or a request's messages carry
    leading/trailing whitespace or ``\\r\\n`` that canonical form would strip. The newline that ends a
    YAML block scalar (``content: |``) is the format's line end, not such whitespace.

Why:
    These bytes are invisible in review but not to the tokenizer. A checkout with ``autocrlf``, an
    editor that strips trailing spaces, or a client that trims messages turns the same prompt into a
    different prefix on some machines, and their caches never match each other's.

Example:
    "You are a helpful assistant.  \\r\\n"   (two trailing spaces, CRLF)

Fix:
    Use LF endings, strip trailing whitespace, remove invisible characters. For request files
    ``--fix`` normalises message edges (the gateway's ``safe`` canonicalization does the same).
"""

import re
from collections.abc import Iterator

from promptlint.analysis import LintContext
from promptlint.canon import canonicalize
from promptlint.line_ends import without_line_ends
from promptlint.model import Finding, PromptDoc, Severity

CODE = "PC009"
NAME = "unstable-whitespace"
SEVERITY: Severity = "info"
SUMMARY = "line endings, trailing or invisible whitespace in the prefix"
FIXABLE = True
# The request keys this rule checks, and the only ones its fix (their ``safe`` canonical form) rewrites.
CANON_KEYS = ("messages",)

_INVISIBLE = re.compile("[\u200b\u200c\u200d\u2060\ufeff\u00a0]")
_TRAILING = re.compile(r"[ \t]+\r?$")


def check(doc: PromptDoc, ctx: LintContext) -> Iterator[Finding]:
    if doc.kind == "source":
        return  # the raw text is Python code, not the prompt; its whitespace is the code's business
    if doc.kind == "request":
        if doc.body is None:
            return
        # Judged without the newline a YAML block scalar (`content: |`) ends with: the format's line
        # end, the same bytes on every load, not whitespace the author typed (promptlint.line_ends).
        probe = without_line_ends({k: doc.body[k] for k in CANON_KEYS if k in doc.body}, doc.block_line_ends)
        if "whitespace-normalized" in canonicalize(probe, "safe").applied:
            line = next((e.line for e in doc.elements if not e.is_tools), 1)
            yield Finding(CODE, doc.display, line, 1,
                          "message text has leading/trailing whitespace or \\r\\n line endings; clients that "
                          "trim or re-encode it send a different prefix", SEVERITY, True)
        return
    first = doc.first_dynamic
    end_line = doc.elements[first].line if first is not None else doc.raw.count("\n") + 1
    lines = doc.raw.split("\n")[doc.body_line - 1 : end_line]
    if "\r" in doc.raw:
        n = next(i for i, x in enumerate(doc.raw.split("\n")) if "\r" in x) + 1
        yield Finding(CODE, doc.display, n, 1, "\\r\\n line endings: a checkout with other settings renders a "
                      "different prefix; use LF", SEVERITY)
    trailing = [i for i, x in enumerate(lines) if _TRAILING.search(x)]
    if trailing:
        n = doc.body_line + trailing[0]
        yield Finding(CODE, doc.display, n, 1,
                      f"trailing whitespace on {len(trailing)} line(s) of the cacheable prefix; editors strip "
                      "it inconsistently", SEVERITY)
    for i, x in enumerate(lines):
        m = _INVISIBLE.search(x)
        if m:
            yield Finding(CODE, doc.display, doc.body_line + i, m.start() + 1,
                          f"invisible character U+{ord(m.group()):04X} in the cacheable prefix", SEVERITY)
            break
