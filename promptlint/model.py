"""The small core types: a finding, an element of a prompt, a loaded prompt document."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

Severity = Literal["error", "warning", "info"]
# What a dynamic element is, which decides the rule that owns it and its expected size:
#   volatile  - changes every request (timestamp, date, uuid, request id, now())
#   per-user  - changes per end user (name, email, user id)
#   input     - the request's own input (question, query, retrieved documents, last user message)
#   placeholder - any other template variable
#   control   - a Jinja if/for/include: what follows may differ between requests
DynClass = Literal["volatile", "per-user", "input", "placeholder", "control"]
# Where a string sits in a parsed request: ("messages", 0, "content"), ("tools", 1, "function", "name").
JsonPath = tuple[str | int, ...]


@dataclass(frozen=True, slots=True)
class Finding:
    """One problem at one place. ``line``/``column`` are 1-based."""

    code: str
    path: str
    line: int
    column: int
    message: str
    severity: Severity
    fixable: bool = False


@dataclass(slots=True)
class Element:
    """A piece of the prompt in the order the provider sees it (tools, system, messages).

    ``dyn`` is ``None`` for static text. ``tokens`` is the measured size of static text, or the
    expected size of a dynamic value (front-matter ``vars`` or a default per class).
    """

    text: str
    role: str
    line: int
    column: int = 1
    dyn: DynClass | None = None
    name: str = ""  # placeholder name, span kind or "last user message"
    is_tools: bool = False
    breakpoint: bool = False  # an Anthropic cache_control breakpoint ends here
    literal: bool = False  # a value written out in the file (a date, ``user: Alice``), not a variable
    # The innermost Jinja block this element lies in (``if is_beta``), "" at the top level: a line in a
    # block renders only when the block does, so it may not move out of it on its own.
    block: str = ""
    tokens: int = 0


@dataclass(slots=True)
class PromptDoc:
    """A loaded prompt file: templates and chat requests alike become a list of elements."""

    path: Path
    display: str  # the path as reported (relative to the working directory when possible)
    kind: Literal["template", "request", "source"]  # source: one SDK call in a .py file
    raw: str
    meta: dict[str, Any] = field(default_factory=dict)  # front matter / non-prompt keys
    elements: list[Element] = field(default_factory=list)
    body: dict[str, Any] | None = None  # the parsed request (request files)
    # Message texts whose final "\n" is the line end of a YAML block scalar (``content: |``): the
    # format's, not whitespace the author typed (see ``promptlint.line_ends``).
    block_line_ends: frozenset[JsonPath] = frozenset()
    body_line: int = 1  # line where the template body starts (after front matter)
    # filled by measure():
    prefix_tokens: int = 0
    static_tokens: int = 0
    total_tokens: int = 0
    static_after: list[int] = field(default_factory=list)
    _lines: list[str] | None = field(default=None, repr=False, compare=False)

    def line_text(self, line: int) -> str:
        """The raw file's 1-based ``line`` ("" past the end). Split once: rules ask per finding,
        and a split per question made a 100k-line template quadratic."""
        if self._lines is None:
            self._lines = self.raw.split("\n")
        return self._lines[line - 1] if 0 < line <= len(self._lines) else ""

    @property
    def first_dynamic(self) -> int | None:
        return next((i for i, e in enumerate(self.elements) if e.dyn is not None), None)

    @property
    def score(self) -> float:
        """Share (0-100) of the expected prompt tokens that precede every dynamic value."""
        return 100.0 if self.total_tokens == 0 else 100.0 * self.prefix_tokens / self.total_tokens
