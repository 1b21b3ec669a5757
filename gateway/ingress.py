"""Bounds on a request body's shape, checked once on the parsed JSON before any other work.

The body-size limit (``app.BodySizeLimit``) caps bytes; this caps what bytes can still hide:

- nesting depth: every later step that walks the body (canonicalization, the miss tracker,
  ``model_dump``) recurses, and Python's recursion limit turned a 600-deep ``tools`` schema into a
  500. The walk here is iterative, so it has no depth limit of its own;
- text that cannot be stored or encoded: a lone UTF-16 surrogate (``"\\ud800"``) is valid JSON but
  not Unicode text; UTF-8 encoders (SQLite, the namespace HMAC, HTTP) raise on it;
- total text: characters in all strings, so work that is linear in the text is bounded per request.

``scan`` is called from the request schema's ``mode="before"`` validator, so a failure becomes a
400 in the OpenAI shape (``errors._validation_message`` knows the ``body_limit`` error type).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, model_validator
from pydantic_core import PydanticCustomError

# Deeper than any real JSON schema a tool declares (OpenAI documents 5 levels for strict schemas),
# far below the ~1000 frames at which a recursive walk fails.
MAX_DEPTH = 64
# Entries of one list that holds text or objects (prompts, messages, tools, enum values); checked
# before the walk visits them, so 300,000 one-letter prompts cost one len().
MAX_ITEMS = 4096
# Integers in all-integer lists (token-id prompts) in one body: such a list skips the item bound above
# (a prompt of ids is long by nature), so this bounds them before any model is built. 262,144 is the
# default max_prompt_chars (1 M characters) at ~4 characters a token; the pipeline then counts each id
# as 4 characters against the configured max_prompt_chars, and each prompt against max_model_len.
MAX_TOKEN_IDS = 262_144
_SURROGATE = re.compile("[\ud800-\udfff]")


# Not frozen: made on every request, and a frozen dataclass sets each field through object.__setattr__
# (2-3x the construction time; issue #17). Nothing hashes it or relies on it not changing.
@dataclass
class BodyShape:
    depth: int
    chars: int  # characters in every string, keys included
    token_ids: int = 0  # integers in all-integer lists (token-id prompts)


def body_limit(message: str, param: str | None = None) -> PydanticCustomError:
    """A validation error that the gateway reports as a 400 naming ``param``."""
    return PydanticCustomError("body_limit", "{message}", {"message": message, "param": param})


def _where(path: tuple[str | int, ...]) -> str:
    """A path for an error message. A key may itself hold a lone surrogate (the very thing being
    refused): it is shown escaped (``\\ud800``), so the message can be encoded into the 400's JSON;
    unescaped, the error's own text failed to encode (tests/gateway/test_front_door_cuts.py found it)."""
    text = ".".join(str(p) for p in path) or "body"
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def scan(value: Any, *, max_depth: int = MAX_DEPTH) -> BodyShape:
    """Walk parsed JSON without recursion. Raises ``PydanticCustomError("body_limit")``.

    Fast path: strings are collected, then searched for surrogates by the regex engine in one
    ``map``; only a body that fails is walked again, for the path in the error message. A container
    on the stack carries its parent's entry and its key there, not its whole path: the path is only
    read for an error message (``_path_of``), and building it per container cost a tuple copy each.
    """
    texts: list[str] = []
    deepest = 0
    token_ids = 0
    stack: list[_Entry] = [(value, 1, None, None)]
    while stack:
        entry = stack.pop()
        item, depth = entry[0], entry[1]
        if isinstance(item, str):
            texts.append(item)
            continue
        if depth > deepest:
            deepest = depth
            if depth > max_depth:
                path = _path_of(entry)
                raise body_limit(f"the request is nested more than {max_depth} levels deep (at '{_where(path[:8])}...')",
                                 _where(path[:1]) if path else None)
        if isinstance(item, dict):
            texts.extend(item)  # the keys
            for key, child in item.items():
                if isinstance(child, str):
                    texts.append(child)
                elif isinstance(child, (dict, list)):
                    stack.append((child, depth + 1, entry, key))
        elif isinstance(item, list):
            # token ids and numbers need no visit: skipping them keeps a 1M-id prompt at C speed
            if item and type(item[0]) is int and all(type(child) is int for child in item):
                token_ids += len(item)
                if token_ids > MAX_TOKEN_IDS:
                    where = _where(_path_of(entry)[:1])
                    raise body_limit(f"the request holds more than {MAX_TOKEN_IDS} token ids", where)
                continue
            if len(item) > MAX_ITEMS:
                where = _where(_path_of(entry))
                raise body_limit(f"'{where}' has {len(item)} entries; at most {MAX_ITEMS} are accepted", where)
            for i, child in enumerate(item):
                if isinstance(child, str):
                    texts.append(child)
                elif isinstance(child, (dict, list)):
                    stack.append((child, depth + 1, entry, i))
    if any(map(_SURROGATE.search, texts)):
        where = _where(_surrogate_path(value))
        raise body_limit(f"'{where}' holds a lone UTF-16 surrogate, which is not valid Unicode text", where)
    return BodyShape(deepest, sum(map(len, texts)), token_ids)


# A container on scan's stack: (value, depth, the parent's entry, the key or index in the parent).
_Entry = tuple[Any, int, "_Entry | None", str | int | None]


def _path_of(entry: _Entry) -> tuple[str | int, ...]:
    """The keys and indices from the body down to ``entry`` (for an error message only)."""
    path: list[str | int] = []
    node: _Entry | None = entry
    while node is not None:
        _, _, node, key = node
        if key is not None:  # None only at the body itself
            path.append(key)
    return tuple(reversed(path))


def _surrogate_path(value: Any) -> tuple[str | int, ...]:
    """Where the first lone surrogate is (slow path, for the error message only; depth already bounded)."""
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(value, ())]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return path
        elif isinstance(item, dict):
            for key, child in item.items():
                if _SURROGATE.search(key):
                    return path
                stack.append((child, (*path, key)))
        elif isinstance(item, list):
            stack.extend((child, (*path, i)) for i, child in enumerate(item))
    return ()


# Below this a temperature is greedy decoding (as in vLLM): dividing logits by 1e-300 gave inf/nan
# probabilities, a 500, and slowed the rest of the batch (issue 16.11).
GREEDY_BELOW = 1e-5


def effective_temperature(temperature: float) -> float:
    """The temperature to sample with: ``temperature``, or 0 (greedy) where it is too small to divide by."""
    return 0.0 if temperature < GREEDY_BELOW else temperature


class ScannedBody(BaseModel):
    """A request body whose raw JSON is scanned (``scan``: depth, text validity, size) before any
    field is built from it; every front door's request model derives from it."""

    # The scan's character count is kept in the instance's own __dict__ under a name no field can
    # have, not in a pydantic PrivateAttr: a model with private attributes runs
    # init_private_attributes once per class level on every construction and a Python-level
    # __setattr__/__getattr__ per write and read, ~14 Python calls a request (issue #17). Pydantic
    # leaves underscore entries of __dict__ out of dumps, ``dict(model)`` and the repr, and copies
    # them with the model (model_copy, pickle); tests/gateway/test_front_door_cuts_2.py pins that.

    @model_validator(mode="wrap")
    @classmethod
    def _bounded(cls, data: Any, handler: Any) -> Any:
        shape = scan(data) if isinstance(data, dict) else None
        model = handler(data)
        if shape is not None:
            model.__dict__[_TEXT_CHARS] = shape.chars
            model.__dict__[_TOKEN_IDS] = shape.token_ids
        return model

    @property
    def text_chars(self) -> int:
        """Characters in every string of the body as received (0 for a model not built from a dict)."""
        return self.__dict__.get(_TEXT_CHARS, 0)

    @property
    def token_ids(self) -> int:
        """Integers in all-integer lists of the body as received (token-id prompts; 0 for a model not
        built from a dict)."""
        return self.__dict__.get(_TOKEN_IDS, 0)


_TEXT_CHARS = "_text_chars"  # ScannedBody's entries in a model's __dict__ (underscore: never a field name)
_TOKEN_IDS = "_token_ids"
