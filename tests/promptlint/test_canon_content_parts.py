"""`safe` canonicalization of content-part lists: the parts concatenate, so it must keep their text.

Regression: each text part was stripped on its own, so ``"What is the weather "`` + ``"in Paris?"``
reached the model as "weatherin" and the answer changed.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from promptlint.canon import canonicalize


def _joined(content) -> str:
    return "".join(p["text"] for p in content if p.get("type") == "text")


def _norm(text: str) -> str:
    return text.replace("\r\n", "\n").replace("\r", "\n")


def test_inner_part_edges_keep_their_whitespace():
    parts = [{"type": "text", "text": "  What is the weather "}, {"type": "text", "text": "in Paris?  "}]
    out = canonicalize({"messages": [{"role": "user", "content": parts}]}, "safe").body
    assert _joined(out["messages"][0]["content"]) == "What is the weather in Paris?"


def test_crlf_split_across_parts_is_one_newline():
    parts = [{"type": "text", "text": "line one\r"}, {"type": "text", "text": "\nline two"}]
    out = canonicalize({"messages": [{"role": "user", "content": parts}]}, "safe").body
    assert _joined(out["messages"][0]["content"]) == "line one\nline two"


_piece = st.text(alphabet=st.sampled_from(list("ab \n\r\t")), max_size=6)
_part = st.one_of(
    st.builds(lambda t: {"type": "text", "text": t}, _piece),
    st.just({"type": "image_url", "image_url": {"url": "data:,x"}}),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_part, min_size=1, max_size=6))
def test_canonical_text_equals_original_modulo_outer_whitespace(parts):
    body = {"messages": [{"role": "user", "content": parts}]}
    out = canonicalize(body, "safe").body["messages"][0]["content"]
    assert [p["type"] for p in out] == [p["type"] for p in parts]
    # each run of adjacent text parts is one text to the model; only the message's outer edges move
    runs_before, runs_after, cur_b, cur_a = [], [], "", ""
    for b, a in zip(parts, out, strict=True):
        if b["type"] == "text":
            cur_b, cur_a = cur_b + b["text"], cur_a + a["text"]
        else:
            runs_before.append(cur_b)
            runs_after.append(cur_a)
            cur_b = cur_a = ""
    runs_before.append(cur_b)
    runs_after.append(cur_a)
    for k, (b, a) in enumerate(zip(runs_before, runs_after, strict=True)):
        want = _norm(b)
        if k == 0:
            want = want.lstrip()
        if k == len(runs_before) - 1:
            want = want.rstrip()
        assert a == want
    again = canonicalize({"messages": [{"role": "user", "content": out}]}, "safe")
    assert again.applied == ()
