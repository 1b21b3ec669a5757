"""``/v1/completions`` with ``echo``: the prompt before the completion, and with ``logprobs`` the prompt's
tokens scored (the first one ``null``), as OpenAI's legacy API and vLLM answer it, which is what
lm-eval-harness's ``local-completions`` loglikelihood tasks read.

Against a real ``prefixgate serve --model tiny`` through the openai SDK and raw HTTP; the scores are
checked against ``transformers``' full-sequence forward of the server's own checkpoint (tolerances:
another batch shape, another summation order).
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from wire_server import error_of, max_model_len, poster, tiny_server

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from engine.launch import default_tiny_dir  # noqa: E402

TOL = 1e-3
CONTEXT = "Question: which month follows March in the calendar year?\nAnswer:"
CONTINUATION = " April, which has thirty days"


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("pg-echo")


@pytest.fixture(scope="module")
def server(home):
    yield from tiny_server(home)


@pytest.fixture(scope="module")
def post(server):
    return poster(*server)


@pytest.fixture(scope="module")
def oai(server):
    url, key = server
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tok(home, server):
    return transformers.AutoTokenizer.from_pretrained(default_tiny_dir(home))


@pytest.fixture(scope="module")
def hf_model(home, server):
    return transformers.AutoModelForCausalLM.from_pretrained(default_tiny_dir(home), dtype=torch.float32).eval()


def ref_logprobs(hf_model, ids: list[int]) -> list[float]:
    """Token i's logprob given tokens 0..i-1, for i >= 1: log_softmax(logits at i - 1)[ids[i]]."""
    with torch.no_grad():
        logp = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return [float(logp[i - 1, ids[i]]) for i in range(1, len(ids))]


def assert_prompt_scored(logprobs, ids: list[int], ref: list[float]) -> None:
    """The first len(ids) entries are the prompt: the first null, the rest the reference's."""
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    got = logprobs.token_logprobs[1:len(ids)]
    assert len(got) == len(ref)
    assert all(abs(g - r) < TOL for g, r in zip(got, ref)), list(zip(got, ref))
    for lp, top in zip(got, logprobs.top_logprobs[1:len(ids)]):
        assert len(top) == 1 and lp <= max(top.values()) + 1e-6  # the top-1 is at least as likely
    offsets = logprobs.text_offset
    assert offsets[0] == 0 and all(b - a == len(t) for a, b, t in zip(offsets, offsets[1:], logprobs.tokens))


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_loglikelihood_as_lm_eval_asks_for_it(oai, tok, hf_model, max_tokens):
    """lm-eval sends context + continuation as token ids, echo, logprobs 1, max_tokens 0 or 1,
    temperature 0, and sums the continuation's token_logprobs."""
    ctx = tok.encode(CONTEXT)
    ids = ctx + tok.encode(CONTINUATION)
    resp = oai.completions.create(model="tiny", prompt=ids, echo=True, logprobs=1, max_tokens=max_tokens,
                                  temperature=0)
    choice = resp.choices[0]
    ref = ref_logprobs(hf_model, ids)
    assert_prompt_scored(choice.logprobs, ids, ref)
    continuation = sum(choice.logprobs.token_logprobs[len(ctx):len(ids)])
    assert abs(continuation - sum(ref[len(ctx) - 1:])) < TOL * len(ids)
    prompt_text = tok.decode(ids, skip_special_tokens=False)
    assert choice.text.startswith(prompt_text)
    assert resp.usage.prompt_tokens == len(ids)
    assert resp.usage.prompt_tokens_details.cached_tokens == 0
    if max_tokens == 0:
        assert choice.text == prompt_text and len(choice.logprobs.tokens) == len(ids)
        assert resp.usage.completion_tokens == 0 and choice.finish_reason == "length"
    else:
        assert resp.usage.completion_tokens == 1


def test_echo_text_prompts_in_a_list(oai):
    prompts = ["The capital of France is", "Two plus two equals"]
    resp = oai.completions.create(model="tiny", prompt=prompts, echo=True, max_tokens=2, temperature=0)
    assert [c.index for c in resp.choices] == [0, 1]
    for choice, prompt in zip(resp.choices, prompts):
        assert choice.text.startswith(prompt) and len(choice.text) > len(prompt) - 1
        assert choice.logprobs is None
    zero = oai.completions.create(model="tiny", prompt=prompts, echo=True, max_tokens=0, logprobs=0)
    for choice, prompt in zip(zero.choices, prompts):
        assert choice.text == prompt
        assert choice.logprobs.token_logprobs[0] is None and all(v is not None for v in choice.logprobs.token_logprobs[1:])
        assert all(top == {} for top in choice.logprobs.top_logprobs[1:])  # logprobs 0: the token alone
        assert "".join(choice.logprobs.tokens) == prompt
    assert zero.usage.completion_tokens == 0


def test_a_scored_prompt_bypasses_the_cache_and_leaves_it_warm(oai, tok, hf_model):
    """A prompt the tenant already cached is still scored in full (cached_tokens 0: every position
    was computed); its blocks stay cached for the next plain request."""
    ids = tok.encode("A long shared preamble that this tenant sends again and again. " * 3)
    oai.completions.create(model="tiny", prompt=ids, max_tokens=1)
    warm = oai.completions.create(model="tiny", prompt=ids, max_tokens=1)
    assert warm.usage.prompt_tokens_details.cached_tokens > 0
    scored = oai.completions.create(model="tiny", prompt=ids, echo=True, logprobs=1, max_tokens=0)
    assert scored.usage.prompt_tokens_details.cached_tokens == 0
    assert_prompt_scored(scored.choices[0].logprobs, ids, ref_logprobs(hf_model, ids))
    # echo without logprobs scores nothing, so it reads the cache as any request does
    echoed = oai.completions.create(model="tiny", prompt=ids, echo=True, max_tokens=1)
    assert echoed.usage.prompt_tokens_details.cached_tokens > 0


def test_streaming_echo_sends_the_prompt_first(oai, tok):
    ids = tok.encode(CONTEXT)
    whole = oai.completions.create(model="tiny", prompt=ids, echo=True, logprobs=1, max_tokens=3, temperature=0)
    chunks = list(oai.completions.create(model="tiny", prompt=ids, echo=True, logprobs=1, max_tokens=3,
                                         temperature=0, stream=True))
    prompt_text = tok.decode(ids, skip_special_tokens=False)
    first = chunks[0].choices[0]
    assert first.text.startswith(prompt_text)
    assert first.logprobs.token_logprobs[0] is None and len(first.logprobs.tokens) >= len(ids)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    values = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert text == whole.choices[0].text and tokens == whole.choices[0].logprobs.tokens
    assert offsets == whole.choices[0].logprobs.text_offset
    assert values[0] is None
    assert all(abs(a - b) < TOL for a, b in zip(values[1:], whole.choices[0].logprobs.token_logprobs[1:]))


def test_streaming_echo_of_the_prompt_alone(server, tok):
    url, key = server
    body = {"model": "tiny", "prompt": CONTEXT, "echo": True, "max_tokens": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=120, trust_env=False) as resp:
        assert resp.status_code == 200
        events = [line.removeprefix("data: ") for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert texts == [CONTEXT]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]] == ["length"]
    assert chunks[-1]["usage"]["completion_tokens"] == 0 and chunks[-1]["usage"]["prompt_tokens"] > 0


@pytest.mark.parametrize(("extra", "param", "code"), [
    ({"echo": True, "logprobs": 21}, "logprobs", "invalid_value"),  # past OpenAI's 5 and the engine's 20
    ({"echo": True, "logprobs": 6}, "logprobs", "invalid_value"),
    ({"max_tokens": 0}, "max_tokens", "invalid_value"),  # nothing to return without echo
    ({"echo": True, "prompt_logprobs": 1}, "prompt_logprobs", "unsupported_parameter"),  # vLLM's extra: echo says it
    ({"echo": True, "logprobs": 1, "prompt": [1, 2, 10**6]}, "prompt", "invalid_value"),  # an id past the vocabulary
])
def test_bad_echo_requests_get_openai_errors(post, extra, param, code):
    body = {"model": "tiny", "prompt": "Write something", "max_tokens": 1, **extra}
    assert error_of(post("/v1/completions", body), param)["code"] == code


def test_a_prompt_filling_the_whole_context_is_scored(server, oai, post, tok):
    """lm-eval-harness cuts loglikelihood requests to the model's full context: with ``max_tokens: 0``
    nothing is generated, so a prompt of exactly ``max_model_len`` tokens fits; one more does not, and
    neither does the full context with a token to generate."""
    limit = max_model_len(*server)
    seed = tok.encode("Counting on: one two three four five six seven eight nine ten. ")
    ids = (seed * (limit // len(seed) + 1))[:limit]
    scored = oai.completions.create(model="tiny", prompt=ids, echo=True, logprobs=0, max_tokens=0)
    assert scored.usage.prompt_tokens == limit and scored.usage.completion_tokens == 0
    values = scored.choices[0].logprobs.token_logprobs
    assert len(values) == limit and values[0] is None and all(v is not None for v in values[1:])
    body = {"model": "tiny", "echo": True, "logprobs": 0}
    over = error_of(post("/v1/completions", {**body, "prompt": ids + ids[:1], "max_tokens": 0}), "prompt")
    assert over["code"] == "context_length_exceeded"
    generating = error_of(post("/v1/completions", {**body, "prompt": ids, "max_tokens": 1}), "prompt")
    assert generating["code"] == "context_length_exceeded"


def test_echo_stays_refused_on_chat(oai):
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                    extra_body={"echo": True})
    assert err.value.code == "unsupported_parameter" and err.value.param == "echo"
