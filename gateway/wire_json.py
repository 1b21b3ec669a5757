"""JSON bytes for responses, the same bytes as the stdlib encoders they replace, written in Rust.

Two encodings leave the gateway on every request (issue #17):

- ``utf8_json``: a whole response body, as Starlette's ``JSONResponse.render`` writes it
  (``json.dumps(ensure_ascii=False, allow_nan=False, separators=(",", ":"))``, UTF-8);
- ``ascii_json``: one server-sent event's data, as ``formats.sse`` wrote it
  (``json.dumps(separators=(",", ":"))``: non-ASCII as ``\\uXXXX`` escapes).

``pydantic_core.to_json`` (pydantic is a dependency already) writes a response in ~1.4 us where the
stdlib takes ~10 us. Its output is byte-identical for strings, ints, bools, None, lists and dicts
with string keys, except that it leaves DEL (0x7f) unescaped where ``ensure_ascii`` escapes it,
which ``ascii_json`` puts right. Floats it writes differently (``1e-05`` as ``0.00001``, NaN
accepted), and other types (tuples, enums, non-string keys) it may; so a value holding anything but
the plain types above, or a string it refuses (a lone surrogate), goes to the stdlib encoder, and
the bytes (or the error) are what they always were.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic_core import PydanticSerializationError, to_json

_SCALARS = frozenset({str, int, bool, type(None)})


def is_plain(value: object) -> bool:
    """Only str, int, bool, None, lists and dicts with str keys, at any depth (no floats).

    One loop over a stack, not a recursion or ``all()`` over a generator: each Python call (and each
    generator step) costs more than the check itself, and this runs for every stream frame."""
    # Any: each item's type is checked by ``type(...) is`` (exact, so a dict subclass is not plain), which
    # mypy does not narrow on; isinstance would, at a cost on this per-frame path and with another meaning
    stack: list[Any] = [value]
    while stack:
        item = stack.pop()
        kind = type(item)
        if kind is dict:
            for key, child in item.items():
                if type(key) is not str:
                    return False
                if type(child) not in _SCALARS:
                    stack.append(child)
        elif kind is list:
            for child in item:
                if type(child) not in _SCALARS:
                    stack.append(child)
        elif kind not in _SCALARS:
            return False
    return True


def utf8_json(value: object) -> bytes:
    """``JSONResponse.render``'s bytes for ``value`` (raises where it raises)."""
    if is_plain(value):
        try:
            return to_json(value)
        except PydanticSerializationError:  # a lone surrogate: the stdlib's own error below
            pass
    return json.dumps(value, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode("utf-8")


def ascii_json(value: object) -> bytes:
    """``json.dumps(value, separators=(",", ":")).encode()``: every non-ASCII character escaped."""
    if is_plain(value):
        try:
            data = to_json(value, ensure_ascii=True)
        except PydanticSerializationError:  # a lone surrogate, which the stdlib escapes as it is
            pass
        else:
            # Pure ASCII output, so a 0x7f byte can only be a DEL inside a string.
            return data.replace(b"\x7f", b"\\u007f") if b"\x7f" in data else data
    return json.dumps(value, separators=(",", ":")).encode()
