"""A request whose client leaves before its first token is billed for the prefill that ran.

The engine keeps the full blocks an aborted prefill computed in its prefix cache, so a client that
disconnects just before the first token would otherwise warm its cache for free. The ledger row
(status ``aborted``) holds what the engine reports at the abort: the prompt tokens it got through,
split into read-from-cache and computed; a backend that cannot tell bills the tokenized prompt.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator

import httpx
import pytest
from fleetutil import read_rows
from gateway_fakes import FakeEngine, FakeTenancy, LoopbackServer, render

from engine.config import EngineConfig
from engine.launch import build_engine
from engine.llm_engine import LLMEngine
from engine.protocol import GenerateRequest, RequestOutput
from gateway.app import create_app
from gateway.settings import GatewaySettings
from tenancy.service import TenancyService
from tests.serverutil import wait_for

BLOCK = 16
LONG = [{"role": "user", "content": " ".join(f"item{i} costs {i * 7 % 101} euros" for i in range(60))}]


def _send_and_hold(port: int, key: str, body: dict) -> socket.socket:
    """A raw HTTP request whose connection the test closes when it chooses (the client leaving)."""
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 + f"Authorization: Bearer {key}\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


@pytest.fixture
def engine(tiny_model_dir):
    # 16 tokens a step: the long prompt's prefill takes ~100 steps, so it can be caught half done.
    eng = build_engine(EngineConfig(model_dir=tiny_model_dir, num_kv_blocks=512, block_size=BLOCK,
                                    max_num_batched_tokens=BLOCK))
    try:
        yield eng
    finally:
        eng.shutdown()


def test_prefill_cut_short_by_the_client_is_billed_as_the_engine_ran_it(engine, tmp_path):
    svc = TenancyService.open(tmp_path)
    key = svc.create_tenant("acme").api_key
    gate, holding, held = threading.Event(), threading.Event(), {}

    def hold_mid_prefill(e: LLMEngine) -> bool:
        """Between two steps: once the prompt is partly computed, stop the engine thread there."""
        for req in e.requests.values():
            if BLOCK * 3 <= req.num_computed_tokens < req.num_prompt_tokens // 2:
                held.update(computed=req.num_computed_tokens, prompt=req.num_prompt_tokens)
                holding.set()
                gate.wait(30)
                return True
        return False

    try:
        with LoopbackServer(create_app(GatewaySettings(home=tmp_path), engine=engine, tenancy=svc)) as srv:
            body = {"model": "tiny", "messages": LONG, "max_tokens": 8, "stream": True, "temperature": 0}
            sock = _send_and_hold(srv.port, key, body)
            deadline = time.monotonic() + 60
            while not holding.is_set():
                probe = engine.call_in_engine_thread(hold_mid_prefill)
                while not (probe.done() or holding.wait(0.001)):
                    pass
                assert time.monotonic() < deadline, "the prefill was never caught half done"
            sock.close()  # the client leaves before its first token, the engine thread held
            time.sleep(0.5)  # the gateway sees it and queues the abort behind the held call
            gate.set()
            svc.flush()
            assert wait_for(lambda: svc.flush() or read_rows(svc, "SELECT 1 FROM usage"), timeout=30)
            (row,) = read_rows(svc, "SELECT status, prompt_tokens, cached_tokens, completion_tokens FROM usage")
            assert row["status"] == "aborted"
            # what the engine had committed when the abort reached it: at least the held boundary
            # (the step already begun there runs out first), never the whole prompt
            assert held["computed"] <= row["prompt_tokens"] < held["prompt"]
            assert row["cached_tokens"] == 0 and row["completion_tokens"] == 0

            # The same prompt again reads back the blocks that aborted prefill wrote: they were billed.
            again = httpx.post(f"{srv.url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                               json={**body, "stream": False, "max_tokens": 1}, timeout=120).json()
            assert again["usage"]["prompt_tokens"] == held["prompt"]
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == row["prompt_tokens"] // BLOCK * BLOCK
    finally:
        gate.set()
        svc.close()


class SlowStartEngine(FakeEngine):
    """A backend that answers nothing for a while and cannot report an abort's progress (a node)."""

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        self.started.set()
        await asyncio.sleep(30)
        async for out in super().generate(request):
            yield out


def _leave_streaming_chat(engine: FakeEngine, *, after_first_token: bool) -> tuple[object, int]:
    """A streamed chat the client leaves once ``engine`` started it (and, if asked, once the first
    token arrived): the request's one ledger row, and the prompt tokens the gateway counted for it."""
    tenancy = FakeTenancy()
    engine.started = threading.Event()
    key = tenancy.add("acme")
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "one two three four five six"}],
            "max_tokens": 4, "stream": True}
    with LoopbackServer(create_app(GatewaySettings(), engine=engine, tenancy=tenancy)) as srv:
        sock = _send_and_hold(srv.port, key, chat)
        assert engine.started.wait(10)
        if after_first_token:
            assert b"first" in _read_until(sock, b"first")  # the client saw its first token
        sock.close()
        assert wait_for(lambda: tenancy.rows, timeout=10)
    (row,) = tenancy.rows
    return row, len(render(engine.tokenized[0]))  # what the gateway counted when it prepared the request


def test_a_backend_that_cannot_report_bills_the_tokenized_prompt():
    row, tokenized = _leave_streaming_chat(SlowStartEngine(), after_first_token=False)
    assert row.status == "aborted" and row.prompt_tokens == tokenized > 0 and row.cached_tokens == 0


class UsageAtEndEngine(FakeEngine):
    """A provider's stream: its first token comes with no usage (prompt_tokens 0), which a provider
    reports only in its last chunk; then it goes quiet."""

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        yield RequestOutput(request.request_id, (), " first", False, 0, 0, 1)
        self.started.set()
        await asyncio.sleep(30)


def test_a_stream_cut_after_its_first_token_without_usage_bills_the_tokenized_prompt():
    row, tokenized = _leave_streaming_chat(UsageAtEndEngine(), after_first_token=True)
    assert row.status == "aborted" and row.prompt_tokens == tokenized > 0 and row.cached_tokens == 0
    assert row.completion_tokens == 1


def _read_until(sock: socket.socket, marker: bytes, timeout_s: float = 10.0) -> bytes:
    sock.settimeout(timeout_s)
    seen = b""
    while marker not in seen:
        chunk = sock.recv(4096)
        if not chunk:
            break
        seen += chunk
    return seen
