"""Explicit prompt-cache control: Anthropic ``cache_control`` breakpoints and OpenAI retention.

The one parser of these fields. The gateway (``/v1/messages``, ``/v1/responses``) uses it to
validate a request and to know which prefix a client asked to keep and for how long; the linter
(PC010, PC011) and its request loader use it to find the same breakpoints in a prompt file.

Anthropic's prefix order is tools -> system -> messages; a breakpoint marks "cache everything up to
and including this block". Rules the API enforces, and so do we::

    at most 4 breakpoints per request
    type must be "ephemeral"; ttl "5m" (default) or "1h"
    a 1h breakpoint may not come after a 5m one (longer-lived entries first)

OpenAI's ``prompt_cache_retention`` is "in_memory" (the default) or "24h".
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

MAX_BREAKPOINTS = 4
TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}
RETENTION_SECONDS = {"in_memory": None, "24h": 86400.0}

Section = Literal["tools", "system", "messages"]


class CacheControlError(ValueError):
    """A cache-control field the provider would reject. ``param`` names where (``messages.2.content.0``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Breakpoint:
    """One ``cache_control`` mark: where it sits and how long the prefix up to it should live.

    ``message`` is the index in ``messages`` (None for tools/system); ``block`` the index of the
    tool, system block or content block (None for a whole-message mark on string content).
    """

    section: Section
    message: int | None
    block: int | None
    ttl: str

    @property
    def ttl_s(self) -> float:
        return TTL_SECONDS[self.ttl]

    @property
    def param(self) -> str:
        parts: list[str] = [self.section]
        if self.message is not None:
            parts += [str(self.message), "content"]
        if self.block is not None:
            parts.append(str(self.block))
        return ".".join([*parts, "cache_control"])


def is_marked(block: Any) -> bool:
    """Whether a tool, system block or content block carries ``cache_control``."""
    # type() first: a dict (what JSON parses to) skips the Mapping ABC's Python-level __instancecheck__
    return (type(block) is dict or isinstance(block, Mapping)) and block.get("cache_control") is not None


def _marks(body: Mapping[str, Any]) -> Iterator[tuple[Section, int | None, int | None, Any]]:
    """Every ``cache_control`` value in prefix order, with where it sits (no validation)."""
    tools = body.get("tools")
    if isinstance(tools, list):
        for i, tool in enumerate(tools):
            if is_marked(tool):
                yield "tools", None, i, tool["cache_control"]
    system = body.get("system")
    if isinstance(system, list):
        for i, block in enumerate(system):
            if is_marked(block):
                yield "system", None, i, block["cache_control"]
    messages = body.get("messages")
    if isinstance(messages, list):
        for m, message in enumerate(messages):
            if type(message) is not dict and not isinstance(message, Mapping):
                continue
            content = message.get("content")
            if isinstance(content, list):
                for i, block in enumerate(content):
                    if is_marked(block):
                        yield "messages", m, i, block["cache_control"]
            elif is_marked(message):  # a mark on a message with string content covers all of it
                yield "messages", m, None, message["cache_control"]


def _ttl_of(value: Any, param: str) -> str:
    if not isinstance(value, Mapping):
        raise CacheControlError(f"{param}: cache_control must be an object like {{\"type\": \"ephemeral\"}}", param)
    if value.get("type") != "ephemeral":
        raise CacheControlError(f"{param}.type: Input should be 'ephemeral'", f"{param}.type")
    ttl = value.get("ttl", "5m")
    if ttl not in TTL_SECONDS:
        raise CacheControlError(f"{param}.ttl: Input should be '5m' or '1h'", f"{param}.ttl")
    return ttl


def parse_breakpoints(body: Mapping[str, Any]) -> list[Breakpoint]:
    """The request's breakpoints in prefix order. Raises ``CacheControlError`` as Anthropic would."""
    found: list[Breakpoint] = []
    for section, message, block, value in _marks(body):
        param = Breakpoint(section, message, block, "5m").param
        found.append(Breakpoint(section, message, block, _ttl_of(value, param)))
    if len(found) > MAX_BREAKPOINTS:
        raise CacheControlError(
            f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. Found {len(found)}.",
            found[MAX_BREAKPOINTS].param)
    seen_short = None
    for bp in found:
        if bp.ttl == "5m":
            seen_short = seen_short or bp
        elif seen_short is not None:
            raise CacheControlError(
                f"a ttl='1h' cache_control block must not come after a ttl='5m' cache_control block "
                f"({bp.param} comes after {seen_short.param}); put the longer-lived breakpoints first",
                bp.param)
    return found


def count_marks(body: Mapping[str, Any]) -> int:
    """How many ``cache_control`` marks a request holds (valid or not): the linter's PC011 count."""
    return sum(1 for _ in _marks(body))


Position = tuple[Section, int | None, int | None]


def marked_positions(body: Mapping[str, Any]) -> set[Position]:
    """Where the marks sit, valid or not: ``(section, message index, block index)`` as in ``Breakpoint``.
    The linter's loader tags its prompt elements from this, so it sees exactly the gateway's breakpoints."""
    return {(section, message, block) for section, message, block, _ in _marks(body)}


def retention_seconds(value: Any) -> float | None:
    """OpenAI ``prompt_cache_retention`` -> seconds to keep the prefix (None = the default policy).

    Raises ``CacheControlError`` for a value the API does not accept."""
    if value is None:
        return None
    if value not in RETENTION_SECONDS:
        raise CacheControlError(
            f"Invalid value for 'prompt_cache_retention': {value!r}. Supported values are: 'in_memory' and '24h'.",
            "prompt_cache_retention")
    return RETENTION_SECONDS[value]
