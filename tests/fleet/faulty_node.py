"""A real HTTP server in an engine node's shape that fails on demand, next to real nodes in a pool.

PrefixGate and vLLM nodes cannot be made to answer 500 or to hang at will; this one can, and it
switches at run time (``behaviour``, ``health``): ``"ok"`` streams a one-token completion with its
usage at the end (as a vLLM that ignores ``continuous_usage_stats``), ``"error"`` answers HTTP 500
with an internal message a tenant must never see, ``"hang"`` never answers, ``"cut"`` streams one
token (with the usage so far, ``CUT_USAGE``, when asked for ``continuous_usage_stats``) and then an
error inside the stream, as a node that fails after its prefill ran. Its
``/health`` answers ``health`` (200 by default: a node whose completions fail while its health
endpoint says fine, the case only passive health catches). ``calls`` counts completion requests.
"""

from __future__ import annotations

import asyncio
import json

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

INTERNAL_TEXT = "CUDA out of memory at /srv/secret-node-path"  # what the 500 says; no tenant may see it
CUT_USAGE = {"prompt_tokens": 37, "completion_tokens": 1, "total_tokens": 38,
             "prompt_tokens_details": {"cached_tokens": 16}}  # what "cut" reports before it fails


class FaultyNode:
    def __init__(self, behaviour: str = "error") -> None:
        self.behaviour = behaviour
        self.health = 200
        self.calls = 0
        self.app = Starlette(routes=[
            Route("/health", self._health),
            Route("/v1/models", self._models),
            Route("/v1/completions", self._completion, methods=["POST"]),
            Route("/v1/chat/completions", self._completion, methods=["POST"]),
        ])

    async def _health(self, request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok" if self.health == 200 else "unhealthy"}, status_code=self.health)

    async def _models(self, request: Request) -> JSONResponse:
        return JSONResponse({"data": [{"id": "tiny", "max_model_len": 2048, "owned_by": "prefixgate"}]})

    async def _completion(self, request: Request):
        body = json.loads(await request.body())
        self.calls += 1
        if self.behaviour == "hang":
            await asyncio.sleep(3600)
        if self.behaviour == "error":
            return JSONResponse({"error": {"message": INTERNAL_TEXT, "type": "server_error", "code": "internal_error"}},
                                status_code=500)

        async def events():
            yield "data: " + json.dumps({"choices": [{"index": 0, "text": " ok", "token_ids": [7],
                                                      "finish_reason": "stop"}]}) + "\n\n"
            yield "data: " + json.dumps({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}) + "\n\n"
            yield "data: [DONE]\n\n"

        async def cut():
            chunk: dict = {"choices": [{"index": 0, "text": " ok", "token_ids": [7], "finish_reason": None}]}
            if (body.get("stream_options") or {}).get("continuous_usage_stats"):
                chunk["usage"] = CUT_USAGE
            yield "data: " + json.dumps(chunk) + "\n\n"
            yield "data: " + json.dumps({"error": {"message": INTERNAL_TEXT, "type": "server_error"}}) + "\n\n"

        return StreamingResponse(cut() if self.behaviour == "cut" else events(), media_type="text/event-stream")
