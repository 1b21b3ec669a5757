"""Hypothesis strategies for hostile OpenAI request bodies, shared by the fast and the slow harness.

Every field of the chat and completions schemas gets, at random, a well-typed value, an extreme
one, or arbitrary JSON: text from all of Unicode *including* lone surrogates, NUL and non-Latin
scripts; integers far past 64 bits; denormal, huge and negative floats; and nesting deep enough to
pass any recursion limit. Bodies are serialised with ``ensure_ascii`` so a lone surrogate travels
as the JSON escape ``\\ud800``, as a hostile client would send it.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

SPICY = ["\ud800", "\udfff", "a\ud83d", "\x00", "user_имя: Иван", "中文提示", "🙂" * 3, "\u202e", "\r\n", "%", ""]

text = st.one_of(
    st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0x10FFFF, exclude_categories=()), max_size=40),
    st.sampled_from(SPICY),
    st.builds(lambda a, b: a + b, st.sampled_from(SPICY), st.text(max_size=10)),
)
numbers = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 1, 2**31, 2**63, 2**64 + 1, 10**30]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([1e-300, 5e-324, -0.0, 1e308, 2.0000001, 1e-6, 0.5]),
)
scalars = st.one_of(st.none(), st.booleans(), numbers, text)


def deep(depth: int, leaf: Any = 1) -> Any:
    value = leaf
    for i in range(depth):
        value = {"a": value} if i % 2 else [value]
    return value


json_values = st.one_of(
    st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
                 max_leaves=12),
    st.integers(min_value=30, max_value=700).map(deep),
)


def _message() -> st.SearchStrategy[Any]:
    part = st.one_of(
        st.fixed_dictionaries({"type": st.just("text"), "text": st.one_of(text, json_values)}),
        st.fixed_dictionaries({"type": text}),
        json_values,
    )
    content = st.one_of(text, st.lists(part, max_size=3), json_values)
    role = st.one_of(st.sampled_from(["system", "user", "assistant", "developer", "tool"]), text)
    return st.one_of(
        st.fixed_dictionaries({"role": role, "content": content}),
        st.fixed_dictionaries({"role": st.just("user"), "content": text}, optional={"name": st.one_of(text, json_values)}),
        json_values,
    )


COMMON_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": st.one_of(st.integers(min_value=-5, max_value=6), numbers, json_values),
    "temperature": st.one_of(numbers, json_values),
    "top_p": st.one_of(numbers, json_values),
    "n": st.one_of(st.integers(min_value=-1, max_value=10), numbers, json_values),
    "stop": st.one_of(text, st.lists(text, max_size=6), json_values),
    "seed": st.one_of(numbers, json_values),
    "stream": st.one_of(st.booleans(), json_values),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), json_values),
    "user": st.one_of(text, json_values),
    "prompt_cache_key": st.one_of(text, json_values),
    "cache_salt": st.one_of(text, json_values),
    "logprobs": json_values,
    "presence_penalty": st.one_of(numbers, json_values),
    "model": st.one_of(st.just("tiny"), text, json_values),
    "extra_field": json_values,
}
CHAT_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    **COMMON_FIELDS,
    "messages": st.one_of(st.lists(_message(), min_size=1, max_size=3), json_values),
    "tools": st.one_of(
        st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
            {"name": text, "parameters": json_values})}), max_size=2),
        json_values),
    "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required"]), json_values),
    "response_format": json_values,
    "max_completion_tokens": st.one_of(st.integers(min_value=-1, max_value=6), json_values),
}
COMPLETION_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    **COMMON_FIELDS,
    "prompt": st.one_of(text, st.lists(text, max_size=4), st.lists(st.integers(-3, 70000), max_size=8),
                        st.lists(st.lists(st.integers(-3, 300), max_size=4), max_size=3), json_values),
    "echo": json_values,
    "suffix": st.one_of(text, json_values),
    "best_of": json_values,
}

CHAT_BASE = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
COMPLETION_BASE = {"model": "tiny", "prompt": "hi", "max_tokens": 1}


def bodies(base: dict[str, Any], fields: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[bytes]:
    """A valid ``base`` with 1-3 of ``fields`` replaced by generated values, as JSON bytes."""
    names = sorted(fields)

    @st.composite
    def build(draw: Any) -> bytes:
        chosen = draw(st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True))
        body = dict(base)
        for name in chosen:
            body[name] = draw(fields[name])
        # Keep runs short: a max_tokens the context allows only makes the tiny model talk longer
        # (larger values stay, they are the context-length 400s).
        for name in ("max_tokens", "max_completion_tokens"):
            value = body.get(name)
            if type(value) is int and 6 < value <= 4096:
                body[name] = 6
        return json.dumps(body, ensure_ascii=True).encode()

    return build()
