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

import json
import re
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, model_validator
from pydantic_core import PydanticCustomError

from gateway.errors import field_path

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


def body_limit(message: str, param: str | None = None, code: str | None = None) -> PydanticCustomError:
    """A validation error that the gateway reports as a 400 naming ``param``, with OpenAI's ``code``
    (``invalid_value`` unless one is given)."""
    context = {"message": message, "param": param} if code is None else {"message": message, "param": param,
                                                                          "code": code}
    return PydanticCustomError("body_limit", "{message}", context)


def _where(path: tuple[str | int, ...]) -> str:
    """A path for an error message. A key may itself hold a lone surrogate (the very thing being
    refused): it is shown escaped (``\\ud800``), so the message can be encoded into the 400's JSON;
    unescaped, the error's own text failed to encode (tests/gateway/test_front_door_cuts.py found it)."""
    text = field_path(path) or "body"
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def scan(value: Any, *, max_depth: int = MAX_DEPTH) -> BodyShape:
    """Walk parsed JSON without recursion. Raises ``PydanticCustomError("body_limit")``.

    Fast path: strings are collected, joined and searched for surrogates by the regex engine in one
    call; only a body that fails is walked again, for the path in the error message. A container
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
    # One search over all the text, not one per string: ``any(map(search, texts))`` and ``sum(map(len,
    # texts))`` run in C without ever giving up the GIL, ~70 ms for a body of a million short strings
    # during which no other thread (the event loop included) ran; the join and one search take ~15.
    joined = "".join(texts)
    if _SURROGATE.search(joined):
        where = _where(_surrogate_path(value))
        raise body_limit(f"'{where}' holds a lone UTF-16 surrogate, which is not valid Unicode text", where)
    return BodyShape(deepest, len(joined), token_ids)


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


# The token-id bound decided on the raw bytes, before any JSON decode (``excess_token_ids``). A
# 4 MiB body of ids is ~2 M integers: decoding them into Python objects, before ``scan`` could count
# them, held the GIL for a second or more and stalled every other tenant's stream (the DoS audit).
#
# Why the count below is exact (the same number ``scan`` counts) for every valid JSON object:
# - Strings are blanked first (``_JSON_STRING``, each becomes ``""``), so a comma, bracket or digit
#   inside text never counts. The pattern cannot fail to match from a quote (an unterminated string
#   runs to the end of the body), so the blanking is one linear pass with no retries.
# - Outside strings, JSON holds only structure, numbers, ``true``/``false``/``null`` and whitespace.
#   A list whose bytes are only digits, ``-``, ``,`` and whitespace (``_INT_LIST``) is then exactly
#   an all-integer list (a float needs ``.``, ``e`` or ``E``; a nested value needs a bracket or a
#   quote) or an empty one (``_EMPTY_LIST``), and a non-empty one holds one more integer than it has
#   commas. That is what ``scan`` counts: the integers of every all-integer list in the body.
# - Cheap upper bounds skip all of it for almost every body: each id takes a digit and is followed
#   by a ``,`` or a ``]``, so a body of at most 2 x MAX_TOKEN_IDS bytes, or with at most
#   MAX_TOKEN_IDS commas and closing brackets in all, cannot hold more than MAX_TOKEN_IDS ids. Then
#   the same count on the raw bytes, strings not blanked, is an upper bound too: text can only add
#   lists that look like ids (``"[1,2]"``), never hide a real one (a match cannot cross a quote), so
#   strings are blanked only for a body whose raw count is over the bound. That keeps the one pass
#   whose cost grows with the number of strings away from bodies of many short strings.
# The regex passes cost ~0.5 us per list and per string they replace (the pieces ``re.sub``
# builds): a body of more than _MAX_PIECES lists and strings is left to the parser and ``scan``, as
# before (in the worker thread), rather than counted here at up to half a second a body.
# A body that is not valid JSON may be counted wrongly; it is refused either way (a 400 from the
# parser or from here). The one valid body counted higher than ``scan`` counts is one with a key
# repeated, whose earlier value the parser reads and then drops: refusing that is wanted.
_JSON_STRING = re.compile(rb'"[^"\\]*+(?:\\[\s\S]?[^"\\]*+)*+(?:"|\Z)')
_INT_LIST = re.compile(rb"\[[0-9, \t\n\r-]*+\]")
_EMPTY_LIST = re.compile(rb"\[[ \t\n\r]*+\]")
_MAX_PIECES = 65_536
_OBJECT_START = re.compile(rb"[ \t\n\r]*\{")  # scan runs on objects only: anything else fails as before
# One token of the walk that names the field (``_field_with_most_ids``): a string, an all-integer
# list, or a structural byte; everything else (numbers, literals, whitespace) is skipped.
_TOKEN = re.compile(rb'(?P<string>"[^"\\]*+(?:\\[\s\S]?[^"\\]*+)*+(?:"|\Z))|(?P<ints>\[[0-9, \t\n\r-]*+\])|[\[\]{}:]')


def excess_token_ids(body: bytes) -> PydanticCustomError | None:
    """``scan``'s refusal of a body holding more than MAX_TOKEN_IDS token ids, decided on ``body``'s
    bytes before it is parsed (see the comment above for why the count is exact), or None.

    Costs two ``bytes.count`` passes for a body that cannot hold that many ids, and a few regex passes
    in C (~15 ms for a 4 MiB prompt of ids) for one that might; only a refused body is walked again,
    token by token (a prompt of ids is a handful of tokens), to name its field.
    """
    if len(body) <= 2 * MAX_TOKEN_IDS or body.count(b",") + body.count(b"]") <= MAX_TOKEN_IDS:
        return None
    if body.count(b"[") + body.count(b'"') // 2 > _MAX_PIECES or not _OBJECT_START.match(body):
        return None
    if _int_list_items(body) <= MAX_TOKEN_IDS:
        return None
    if _int_list_items(_JSON_STRING.sub(b'""', body)) <= MAX_TOKEN_IDS:
        return None
    return body_limit(f"the request holds more than {MAX_TOKEN_IDS} token ids", _field_with_most_ids(body))


def _int_list_items(body: bytes) -> int:
    """Integers in the all-integer lists of ``body``: exact once its strings are blanked (all ``""``),
    an upper bound before."""
    rest, lists = _INT_LIST.subn(b"", body)
    empty = len(_EMPTY_LIST.findall(body))
    return body.count(b",") - rest.count(b",") + lists - empty


# Tokens the naming walk reads at most (a refused body only; ~0.1 s of Python, which lets other threads
# run every 5 ms): a prompt of ids is a handful of tokens, a body that passed the _MAX_PIECES gate fewer.
_NAMING_TOKENS = 4 * _MAX_PIECES


def _field_with_most_ids(body: bytes) -> str | None:
    """The top-level key whose value holds the most token ids (the first of equals): the field to
    name in the refusal (``scan`` names the one it was counting when the total went over, which for
    the usual body, one prompt of ids, is the same). None where it cannot tell (not JSON, or more
    than ``_NAMING_TOKENS`` strings, lists and brackets to walk)."""
    depth, candidate, key = 0, b"", b""
    counts: dict[bytes, int] = {}
    for n, token in enumerate(_TOKEN.finditer(body)):
        if n == _NAMING_TOKENS:  # braces and colons are not gated: not worth more walking to name a field
            return None
        text = token[0]
        if token["string"] is not None:
            candidate = text if depth == 1 else candidate
        elif token["ints"] is not None:
            if depth >= 1 and text.strip(b"[] \t\n\r"):
                counts[key] = counts.get(key, 0) + text.count(b",") + 1
        elif text == b":":
            key = candidate if depth == 1 else key
        else:
            depth += 1 if text in b"[{" else -1
    return _decoded_key(max(counts, key=counts.__getitem__)) if counts else None


def _decoded_key(raw: bytes) -> str | None:
    try:
        key = json.loads(raw)
    except ValueError:
        return None
    return _where((key,)) if isinstance(key, str) else None


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
