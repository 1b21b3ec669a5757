"""The newline a YAML block scalar ends with: the format's line end, not the author's whitespace.

    content: |
      You are the order assistant of Acme.
      Keep answers short.

loads as ``"You are ... short.\\n"``: a block with the default (clip) chomping ends its text with
exactly one newline, the line end of its last line. It is the same bytes on every load, like the
trailing newline of a template file, so PC009 does not report it, and ``--fix`` keeps it (and with
it the ``|``) when it trims a message's real edge whitespace. ``|-`` has no final newline and ``|+``
keeps trailing blank lines on purpose: those are text the author wrote, judged like any other.

The loader records which message texts end this way (``PromptDoc.block_line_ends``); PC009 and
``--fix`` look at the messages without those newlines and ``--fix`` puts them back.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Collection

from promptlint.model import JsonPath


def is_block_line_end(text: str) -> bool:
    """Whether ``text`` ends as a clipped block scalar does: one newline, no blank line before it."""
    return text.endswith("\n") and not text.endswith("\n\n")


def without_line_ends(body: dict[str, object], paths: Collection[JsonPath]) -> dict[str, object]:
    """A copy of ``body`` (the part holding ``paths``) with each block's final newline dropped."""
    if not paths:
        return body
    out = copy.deepcopy(body)
    for path in paths:
        _edit(out, path, lambda text: text[:-1])
    return out


def restore_line_ends(body: dict[str, object], paths: Collection[JsonPath]) -> None:
    """Put back, in place, the newline ``without_line_ends`` dropped (the paths of a request whose
    messages were only edited, never reordered, still point at the same texts)."""
    for path in paths:
        _edit(body, path, lambda text: text + "\n")


def _edit(body: dict[str, object], path: JsonPath, change: Callable[[str], str]) -> None:
    parent: object = body
    for key in path[:-1]:
        parent = _child(parent, key)
    key = path[-1]
    text = _child(parent, key)
    if not isinstance(text, str):
        return
    if isinstance(parent, dict):
        parent[key] = change(text)
    elif isinstance(parent, list):
        assert isinstance(key, int)  # _child finds a list's item by an index only
        parent[key] = change(text)


def _child(value: object, key: str | int) -> object:
    if isinstance(value, dict):
        return value.get(key)
    if isinstance(value, list) and isinstance(key, int) and 0 <= key < len(value):
        return value[key]
    return None
