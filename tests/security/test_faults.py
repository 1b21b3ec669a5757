"""Faults inside one process: a request whose model step raises fails alone (500, OpenAI shape)
while the requests batched with it finish; afterwards every KV block is accounted for."""

from __future__ import annotations

import threading
import time

from security_helpers import assert_openai_error, auth

POISON = "POISON-PILL-7f3a"


def _wait_idle(engine, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not engine.engine.has_unfinished():
            time.sleep(0.05)  # let the thread finish its step and go back to waiting
            if not engine.engine.has_unfinished():
                return
        time.sleep(0.02)
    raise AssertionError("engine did not become idle")


def test_one_failing_request_fails_alone(gateway) -> None:
    client, keys, app = gateway
    engine = app.state.engine  # AsyncEngine; engine.engine is the LLMEngine its thread drives
    runner = engine.engine.runner
    poisoned: set[str] = set()
    real_execute = runner.execute
    tokenizer = runner.tokenizer

    def execute(batch):  # raise for any batch that holds a chunk of a poisoned prompt
        for chunk in batch.chunks:
            if chunk.request_id in poisoned or POISON in tokenizer.decode(list(chunk.token_ids)):
                poisoned.add(chunk.request_id)
                raise RuntimeError("injected fault in the model step")
        return real_execute(batch)

    runner.execute = execute
    results: dict[str, tuple[int, dict]] = {}

    def call(name: str, content: str, stream: bool) -> None:
        body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 6,
                "temperature": 0}
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
            with client.stream("POST", "/v1/chat/completions", json=body, headers=auth(keys["acme"])) as r:
                lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
            results[name] = (r.status_code, {"lines": lines})
            return
        r = client.post("/v1/chat/completions", json=body, headers=auth(keys["acme"]))
        results[name] = (r.status_code, r.json())

    try:
        threads = [threading.Thread(target=call, args=(f"ok{i}", f"healthy request number {i}", i % 2 == 0))
                   for i in range(6)]
        threads.append(threading.Thread(target=call, args=("bad", f"please {POISON} now", False)))
        threads.append(threading.Thread(target=call, args=("bad_stream", f"stream {POISON} now", True)))
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        runner.execute = real_execute
    assert poisoned, "the fault was never injected: the test would prove nothing"
    status, body = results["bad"]
    assert status == 500, (status, body)
    assert_openai_error(body, 500)
    # a stream that already sent 200 ends with an error event in the OpenAI shape, then [DONE]
    status, body = results["bad_stream"]
    if status == 200:
        import json

        events = [json.loads(ln[6:]) for ln in body["lines"] if ln != "data: [DONE]"]
        assert any("error" in e for e in events), body
    else:
        assert status == 500
    for i in range(6):
        status, body = results[f"ok{i}"]
        assert status == 200, (i, body)
    _wait_idle(engine)
    engine.engine.check_integrity()
    assert engine.engine.cache.num_used == 0
    # and the engine keeps serving
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "after the fault", "max_tokens": 2},
                    headers=auth(keys["acme"]))
    assert r.status_code == 200, r.text


def test_failed_and_aborted_requests_free_their_blocks(gateway) -> None:
    """Clients that hang up mid-stream and requests that time out leave no block held."""
    client, keys, app = gateway
    engine = app.state.engine
    body = {"model": "tiny", "messages": [{"role": "user", "content": "tell me a long story " * 20}],
            "max_tokens": 64, "stream": True}
    for _ in range(4):
        with client.stream("POST", "/v1/chat/completions", json=body, headers=auth(keys["beta"])) as r:
            for i, _line in enumerate(r.iter_lines()):
                if i >= 2:
                    break  # hang up after the first chunks
    _wait_idle(engine)
    engine.engine.check_integrity()
    assert engine.engine.cache.num_used == 0
