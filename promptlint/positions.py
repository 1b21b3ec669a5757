"""Where a string value of a JSON/YAML request sits in the physical file.

A rule reports an offset into a decoded string ("Today is ..." as Python sees it); an editor or a
GitHub annotation needs the line and column of the file. The two differ by everything the file
format adds: the key and quotes before the value, JSON escapes (``\\n`` is two characters in the
file, one in the string), a YAML block scalar's indentation, continuation lines of a folded scalar.

``StringPositions.index_for(path)`` gives a :class:`~promptlint.parse.LineIndex` for the string at
``path`` (``("messages", 0, "content")``) whose ``at(offset)`` answers in physical coordinates.
Columns count Unicode code points from the start of the physical line (SARIF ``unicodeCodePoints``).
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections.abc import Iterator
from typing import Any, Protocol

import yaml

from promptlint.model import JsonPath
from promptlint.parse import LineIndex

_JSON_STRING = re.compile(r'"((?:[^"\\]|\\.)*)"', re.DOTALL)
_JSON_ESCAPE = re.compile(r"\\(?:u[0-9a-fA-F]{4}|.)", re.DOTALL)
_YAML_DOUBLE_ESCAPE = re.compile(r"\\(?:x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|.)", re.DOTALL)
_YAML_SINGLE_ESCAPE = re.compile(r"''")


class StringPositions(Protocol):
    def index_for(self, path: JsonPath) -> LineIndex | None:
        """Physical positions of the string at ``path``; ``None`` when it cannot be found."""

    def is_block_scalar(self, path: JsonPath) -> bool:
        """Whether the string at ``path`` is written as a YAML block scalar (``|`` or ``>``)."""


class PhysicalIndex(LineIndex):
    """A decoded string's offsets -> the file's (line, column).

    Built from *anchors*: stretches of the file copied verbatim into the string (the text between
    escapes, one physical line of a block scalar). Each is found in the decoded string in order;
    a decoded character no anchor covers (an escape's result, a folded line break) takes the
    position just after the previous anchored one.
    """

    def __init__(self, file_index: LineIndex, decoded: str, anchors: list[tuple[int, str]]) -> None:
        self._file = file_index
        self._raw_at = [-1] * (len(decoded) + 1)
        d = 0
        for raw_start, piece in anchors:
            if not piece:
                continue
            found = decoded.find(piece, d)
            if found < 0:
                continue
            for k in range(len(piece)):
                self._raw_at[found + k] = raw_start + k
            d = found + len(piece)
        previous = anchors[0][0] - 1 if anchors else 0
        for i, raw in enumerate(self._raw_at):
            if raw < 0:
                self._raw_at[i] = previous + 1
            previous = self._raw_at[i]

    def at(self, offset: int) -> tuple[int, int]:
        raw = self._raw_at[min(max(offset, 0), len(self._raw_at) - 1)]
        return self._file.at(raw)


def _pieces(raw: str, start: int, end: int, escape: re.Pattern[str] | None) -> list[tuple[int, str]]:
    """The verbatim stretches of ``raw[start:end]`` between escapes, with where each starts."""
    if escape is None:
        return [(start, raw[start:end])]
    out = []
    pos = start
    for m in escape.finditer(raw, start, end):
        out.append((pos, raw[pos : m.start()]))
        pos = m.end()
    out.append((pos, raw[pos:end]))
    return out


# --- JSON --------------------------------------------------------------------------------------------


def _strings_in_order(body: Any) -> Iterator[tuple[JsonPath, str] | None]:
    """Every string of a parsed JSON document in file order: ``None`` for a key, (path, value) for a value."""
    stack: list[tuple[JsonPath, Any]] = [((), body)]
    while stack:
        path, value = stack.pop()
        if value is _KEY:
            yield None
        elif isinstance(value, str):
            yield path, value
        elif isinstance(value, dict):
            for key, item in reversed(list(value.items())):
                stack.append(((*path, key), item))
                stack.append(((), _KEY))
        elif isinstance(value, list):
            stack.extend(((*path, i), item) for i, item in reversed(list(enumerate(value))))


_KEY = object()


class JsonPositions:
    """String positions of a JSON file: its string literals, in order, paired with the parsed values."""

    def __init__(self, raw: str, body: Any) -> None:
        self._raw = raw
        self._file = LineIndex(raw)
        literals = [(m.start(1), m.end(1)) for m in _JSON_STRING.finditer(raw)]
        strings = list(_strings_in_order(body))
        # Duplicate keys (the parser keeps the last) break the pairing: then nothing is located.
        self._spans: dict[JsonPath, tuple[str, int, int]] = {}
        if len(strings) == len(literals):
            for found, (start, end) in zip(strings, literals):
                if found is not None:
                    self._spans[found[0]] = (found[1], start, end)

    def index_for(self, path: JsonPath) -> LineIndex | None:
        if path not in self._spans:
            return None
        value, start, end = self._spans[path]
        return PhysicalIndex(self._file, value, _pieces(self._raw, start, end, _JSON_ESCAPE))

    def is_block_scalar(self, path: JsonPath) -> bool:
        return False  # JSON has only quoted strings


# --- YAML --------------------------------------------------------------------------------------------


class YamlPositions:
    """String positions of a YAML file, from the composed node tree (each scalar knows its marks)."""

    def __init__(self, raw: str, root: yaml.Node | None) -> None:
        self._raw = raw
        self._file = LineIndex(raw)
        self._root = root
        self._line_starts = [0] + [i + 1 for i, c in enumerate(raw) if c == "\n"]

    def _node(self, path: JsonPath) -> yaml.ScalarNode | None:
        node = self._root
        for key in path:
            if isinstance(node, yaml.MappingNode):
                node = next((v for k, v in reversed(node.value) if isinstance(k, yaml.ScalarNode)
                             and k.value == str(key)), None)
            elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and 0 <= key < len(node.value):
                node = node.value[key]
            else:
                return None
        return node if isinstance(node, yaml.ScalarNode) else None

    def is_block_scalar(self, path: JsonPath) -> bool:
        node = self._node(path)
        return node is not None and node.style in ("|", ">")

    def index_for(self, path: JsonPath) -> LineIndex | None:
        node = self._node(path)
        if node is None:
            return None
        start, end = node.start_mark.index, node.end_mark.index
        escape = {'"': _YAML_DOUBLE_ESCAPE, "'": _YAML_SINGLE_ESCAPE}.get(node.style or "")
        anchors: list[tuple[int, str]] = []
        for k, (line_start, line_end) in enumerate(self._lines_between(start, end)):
            if k == 0 and node.style in ("|", ">"):
                continue  # the block header (`|`, `>-`): the content starts on the next line
            text = self._raw[line_start:line_end]
            stripped = len(text) - len(text.lstrip(" \t"))
            first = line_start + stripped
            last = line_end
            if node.style in ('"', "'"):
                first += 1 if first == start else 0
                last -= 1 if line_end == end else 0
            anchors.extend(_pieces(self._raw, first, last, escape))
        return PhysicalIndex(self._file, node.value, anchors)

    def _lines_between(self, start: int, end: int) -> Iterator[tuple[int, int]]:
        i = bisect_right(self._line_starts, start) - 1
        pos = start
        while pos < end:
            nxt = self._line_starts[i + 1] - 1 if i + 1 < len(self._line_starts) else len(self._raw)
            yield pos, min(nxt, end)
            i += 1
            if i >= len(self._line_starts):
                return
            pos = self._line_starts[i]
