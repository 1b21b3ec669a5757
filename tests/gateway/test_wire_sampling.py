"""Chat and completions on the wire: vLLM's sampling extras honoured or refused, explicit nulls,
empty stop strings, the context-length error's numbers (the gateway audit's findings 4, 6, 7, 9).

Against a real ``prefixgate serve --model tiny`` through the openai SDK and raw HTTP. The
random-weight model cannot answer anything, so each check holds for any model: greedy decoding
reruns identically, and a +100 logit_bias makes greedy emit that token (so a test knows its id)."""

from __future__ import annotations

import pytest
from wire_server import FORCED, error_of, max_model_len

from engine.models.tiny import ENCODING, TINY_DIMS
from engine.models.tokenizer_build import build_tokenizer

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Write something"}], "max_tokens": 6}


# -- #6 vLLM-style sampling extras: honoured or refused ------------------------------------------------


def test_top_k_1_is_greedy_whatever_the_temperature(oai):
    greedy = oai.chat.completions.create(**CHAT, temperature=0).choices[0].message.content
    for seed in (1, 2):
        hot = oai.chat.completions.create(**CHAT, temperature=1.5, seed=seed, extra_body={"top_k": 1})
        assert hot.choices[0].message.content == greedy
    sampled = [oai.chat.completions.create(**CHAT, temperature=1.5, seed=s).choices[0].message.content for s in (1, 2)]
    assert greedy not in sampled  # without top_k the same seeds sample other text


def test_stop_token_ids_end_the_output(oai):
    kw = dict(model="tiny", prompt="Hello", max_tokens=3, temperature=0, logit_bias={str(FORCED): 100})
    forced = oai.completions.create(**kw)
    assert forced.usage.completion_tokens == 3 and forced.choices[0].finish_reason == "length"
    stopped = oai.completions.create(**kw, extra_body={"stop_token_ids": [FORCED]})
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 1
    assert stopped.choices[0].text == ""  # the stop token ends the output, its text is not shown


def test_ignore_eos_generates_past_eos(oai):
    eos = build_tokenizer(ENCODING, TINY_DIMS["vocab_size"]).convert_tokens_to_ids("<|endoftext|>")
    kw = dict(model="tiny", prompt="Hello", max_tokens=3, temperature=0, logit_bias={str(eos): 100})
    ended = oai.completions.create(**kw)
    assert ended.choices[0].finish_reason == "stop" and ended.usage.completion_tokens == 1
    past = oai.completions.create(**kw, extra_body={"ignore_eos": True})
    assert past.choices[0].finish_reason == "length" and past.usage.completion_tokens == 3


@pytest.mark.parametrize(("extra", "param"), [
    ({"min_tokens": 4}, "min_tokens"),  # more than max_tokens (2)
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"guided_choice": ["a", "b"]}, "guided_choice"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
    ({"guided_regex": "a+"}, "guided_regex"),
    ({"guided_grammar": "root ::= 'a'"}, "guided_grammar"),
    ({"skip_special_tokens": False}, "skip_special_tokens"),
    ({"include_stop_str_in_output": True}, "include_stop_str_in_output"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"top_k": -2}, "top_k"),
])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_vllm_extras_that_are_not_implemented_or_out_of_range_are_refused(post, path, extra, param):
    body = CHAT if path == "/v1/chat/completions" else {"model": "tiny", "prompt": "Hi"}
    error_of(post(path, {**body, "max_tokens": 2, **extra}), param)


def test_ignore_eos_with_a_grammar_is_refused(post):
    error_of(post("/v1/chat/completions", {**CHAT, "ignore_eos": True, "response_format": {"type": "json_object"}}),
             "ignore_eos")


def test_min_tokens_holds_back_a_stop_token(oai):
    """+100 makes greedy pick FORCED, which is also a stop token: under min_tokens 3 it is banned for the
    first three tokens, then picked and ends the output (vLLM's min_tokens)."""
    kw = dict(model="tiny", prompt="Hello", max_tokens=6, temperature=0, logit_bias={str(FORCED): 100})
    stopped = oai.completions.create(**kw, extra_body={"stop_token_ids": [FORCED]})
    assert stopped.usage.completion_tokens == 1 and stopped.choices[0].finish_reason == "stop"
    held = oai.completions.create(**kw, extra_body={"stop_token_ids": [FORCED], "min_tokens": 3})
    assert held.usage.completion_tokens == 4 and held.choices[0].finish_reason == "stop"


def test_min_p_of_one_keeps_only_the_top_token(oai):
    """min_p 1 drops every token less likely than the most likely one: sampling at any temperature and
    seed is then greedy."""
    greedy = oai.chat.completions.create(**CHAT, temperature=0).choices[0].message.content
    for seed in (1, 2):
        hot = oai.chat.completions.create(**CHAT, temperature=1.5, seed=seed, extra_body={"min_p": 1.0})
        assert hot.choices[0].message.content == greedy


def test_responses_carry_the_vllm_extras_to_the_engine(post):
    """/v1/responses runs as a chat request: vLLM's extras in its body reach the sampler (min_p 1 makes
    a hot sample greedy), not dropped on the way."""
    body = {"model": "tiny", "input": "Write something", "max_output_tokens": 6}

    def text(extra: dict) -> str:
        r = post("/v1/responses", {**body, **extra})
        assert r.status_code == 200, r.text
        return r.json()["output"][0]["content"][0]["text"]

    assert text({"temperature": 1.5, "min_p": 1.0}) == text({"temperature": 0})


def test_min_tokens_with_a_grammar_is_refused(post):
    error_of(post("/v1/chat/completions", {**CHAT, "min_tokens": 2, "response_format": {"type": "json_object"}}),
             "min_tokens")


def test_vllm_extras_at_their_defaults_are_accepted(post):
    r = post("/v1/chat/completions", {**CHAT, "min_tokens": 0, "min_p": 0, "repetition_penalty": 1,
                                      "skip_special_tokens": True, "top_k": -1,
                                      "include_stop_str_in_output": False, "ignore_eos": None, "priority": 0})
    assert r.status_code == 200, r.text


# -- #4 explicit nulls mean the default -----------------------------------------------------------------


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                              "n": None, "stream": None, "stream_options": None}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "echo": None, "stream": None, "n": None}),
])
def test_an_explicit_null_means_the_default(post, path, body):
    r = post(path, {"model": "tiny", **body})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/json")  # stream: null = not streamed
    assert len(r.json()["choices"]) == 1  # n: null = 1


# -- #7 empty stop strings are ignored ------------------------------------------------------------------


def test_empty_stop_strings_are_ignored(oai):
    base = oai.chat.completions.create(**CHAT, temperature=0)
    for stop in ("", [""], ["", "never-in-the-output"]):
        r = oai.chat.completions.create(**CHAT, temperature=0, stop=stop)
        assert r.choices[0].message.content == base.choices[0].message.content
        assert r.usage.completion_tokens == base.usage.completion_tokens == 6


# -- #9 the context-length error -------------------------------------------------------------------------


def test_context_length_errors_give_the_real_numbers(server, post):
    max_len = max_model_len(*server)
    # no max_tokens: the prompt alone is too long; no negative completion in the message
    err = error_of(post("/v1/completions", {"model": "tiny", "prompt": [FORCED] * (max_len + 5)}), "prompt")
    assert err["code"] == "context_length_exceeded" and "-" not in err["message"]
    assert f"your prompt resulted in {max_len + 5} tokens" in err["message"]
    long_text = "word " * (max_len + 50)
    for stream in (False, True):
        err = error_of(post("/v1/chat/completions", {"model": "tiny", "stream": stream,
                                                     "messages": [{"role": "user", "content": long_text}]}),
                       "messages")
        assert "-" not in err["message"] and "your messages resulted in" in err["message"]
    # the prompt fits, the output asked for does not: the completions message speaks of the prompt
    err = error_of(post("/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": max_len}), "prompt")
    assert "in the prompt" in err["message"] and f"{max_len} in max_tokens" in err["message"]
