"""``RemoteEngineClient``: one ``EngineClient`` for every engine node, PrefixGate or vLLM.

A node is any server that speaks the OpenAI-compatible API that vLLM speaks::

    POST /v1/completions        {"model", "prompt": [token ids] | "text", "cache_salt": <namespace hex>,
                                 "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                                 "stop_token_ids", "ignore_eos", "logit_bias",
                                 "presence_penalty", "frequency_penalty", "min_p", "min_tokens" (when not 0),
                                 "repetition_penalty" (when not 1),
                                 "priority", "prefixgate_tenant" (PrefixGate nodes only),
                                 "stream": true, "return_token_ids": true,
                                 "stream_options": {"include_usage": true, "continuous_usage_stats": true}}
    POST /v1/chat/completions   the same with "messages" (and "tools") instead of "prompt"
    GET  /v1/models             {"data": [{"id", "max_model_len"}]}
    GET  /health                200 = serving; 503 = unhealthy or draining (PrefixGate nodes)

The tenant reaches the node only as ``cache_salt`` (its server-derived namespace, hex): vLLM folds
it into its block hashes, a PrefixGate node uses it as the namespace itself, so two tenants'
identical prompts never share KV on either. A prompt the gateway has tokenized travels as token
ids, so the node computes exactly the tokens the router hashed. Every call streams; closing the
``generate`` iterator (client gone) closes the HTTP stream, which both servers treat as an abort.

Usage: ``prompt_tokens_details.cached_tokens`` when the node reports it. vLLM reports it only when
started with ``--enable-prompt-tokens-details``; a node whose usage lacks the field is marked
``cached_tokens_reported = False`` (shown in ``/health``), and its hits count as 0. The gateway asks
for vLLM's ``continuous_usage_stats`` (usage so far in every chunk; vLLM leaves the cached tokens
out of it, a PrefixGate node sends them): every output then carries the prompt (and cached) tokens
the node counted, so a stream that ends early (the client gone, the node failing) is billed for the
prompt the node prefilled. A node that ignores the option reports usage only at the end; until then
the outputs carry the prompt the gateway tokenized (none: 0) with nothing cached.

Failures of the node rather than of the request are ``NodeFailure``s, by ``NodeFault``: refused or
lost connection, draining, the gateway's node token refused (401/403), HTTP 5xx or an error inside
the stream, no byte within the read timeout (``NodeTimeouts``). The pipeline moves such a request to
another node before its first token and the router counts them (``Router.record_failure``); the
tenant's error names the node by its configured name and never repeats what the node answered.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import httpx

from engine.protocol import (
    EngineError,
    EngineOverloadedError,
    GenerateRequest,
    GrammarQueueFullError,
    InvalidRequestError,
    ModelCard,
    PrepareQueueFullError,
    PromptTooLongError,
    RequestOutput,
    backend_finish_reason,
)

if TYPE_CHECKING:  # transformers is the engine extra's; a gateway-only install never loads it
    from engine.prompt_tokenizer import PromptTokenizer

_BY_CODE: dict[str, type[EngineError]] = {
    PromptTooLongError.code: PromptTooLongError,
    EngineOverloadedError.code: EngineOverloadedError,
    GrammarQueueFullError.code: GrammarQueueFullError,  # keeps its retry hint
    PrepareQueueFullError.code: PrepareQueueFullError,  # likewise
}
HEALTH_TIMEOUT_S = 2.0
CONNECT_TIMEOUT_S = 5.0  # NodeTimeouts' defaults (GatewaySettings.node_connect_timeout_s / node_read_timeout_s)
READ_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class NodeTimeouts:
    """How long the gateway waits on a node: ``connect`` for the TCP connection; ``read`` for the
    node's next bytes, i.e. the response's first byte (queueing + prefill on the node) and every gap
    between stream chunks. A node past either limit fails the request (``NodeTimeoutError``)."""

    connect: float = CONNECT_TIMEOUT_S
    read: float = READ_TIMEOUT_S


class NodeFault(StrEnum):
    """Why a node failed a request. The first three take it out of rotation at once (``Router.record_failure``);
    the last two count toward its cool-down (a node may fail one request and serve the next)."""

    UNREACHABLE = "unreachable"  # connection refused / reset, not reachable
    DRAINING = "draining"  # the node said it takes no new requests
    AUTH = "auth"  # the node rejected the gateway's node token (401/403)
    SERVER_ERROR = "server_error"  # HTTP 5xx, or an error inside its stream
    TIMEOUT = "timeout"  # no byte within NodeTimeouts.read


class NodeFailure(EngineError):
    """The node failed, not the request: before the first output another node of the pool may take it.

    ``str(exc)`` is the detail for the gateway's log (it may name the node's URL and repeat what the
    node said); the tenant sees ``for_tenant(node_name)``, which names the node by its configured
    name and repeats nothing of the node's answer (a 401's text can quote the gateway's token)."""

    status = 502
    code = "node_error"
    fault = NodeFault.SERVER_ERROR

    def tenant_message(self, node: str) -> str:
        return f"Engine node {node!r} failed while serving this request."

    def for_tenant(self, node: str) -> EngineError:
        exc = EngineError(self.tenant_message(node))
        exc.status, exc.code = self.status, self.code
        return exc


class NodeUnavailableError(NodeFailure):
    """The node could not take the request (unreachable, draining): another node may."""

    status = 503
    code = "node_unavailable"
    fault = NodeFault.UNREACHABLE

    def tenant_message(self, node: str) -> str:
        return f"Engine node {node!r} is unavailable; retry later."


class NodeDrainingError(NodeUnavailableError):
    code = "node_draining"
    fault = NodeFault.DRAINING

    def tenant_message(self, node: str) -> str:
        return f"Engine node {node!r} is draining and takes no new requests; retry later."


class NodeTimeoutError(NodeFailure):
    status = 504
    code = "node_timeout"
    fault = NodeFault.TIMEOUT

    def tenant_message(self, node: str) -> str:
        return f"Engine node {node!r} did not answer in time."


class NodeServerError(NodeFailure):
    """HTTP 5xx from the node (other than the codes the engine defines), or an error in its stream."""


class NodeAuthError(NodeFailure):
    """The node refused the *gateway's* node token: the operator's configuration, not the tenant's key."""

    code = "upstream_auth_failed"
    fault = NodeFault.AUTH
    LOG_TEXT = "rejected the gateway's node token"

    def tenant_message(self, node: str) -> str:
        return (f"Engine node {node!r} rejected the gateway's credentials: the gateway's node configuration is "
                "wrong, not your API key. The operator has to fix it.")


def _error_from_response(status: int, body: bytes) -> EngineError:
    """A node's HTTP error (OpenAI error JSON, or anything else) as the matching ``EngineError``."""
    if status in (401, 403):  # never keep the body: a node's 401 text may quote the gateway's token
        return NodeAuthError(f"{NodeAuthError.LOG_TEXT} (HTTP {status})")
    try:
        err = json.loads(body)["error"]
        message, code = str(err.get("message")), err.get("code")
    except (ValueError, KeyError, TypeError, AttributeError):
        message, code = body.decode(errors="replace")[:200] or f"node returned HTTP {status}", None
    if code == NodeDrainingError.code:
        return NodeDrainingError(message)
    cls = _BY_CODE.get(code or "")
    if cls is None and status == 400 and "maximum context length" in message:  # vLLM's wording
        cls = PromptTooLongError
    if cls is not None:
        return cls(message)
    if status >= 500:
        return NodeServerError(f"HTTP {status} {code or ''}: {message}")
    exc = EngineError(message)
    exc.status = status if status >= 400 else 502
    exc.code = code if isinstance(code, str) and code else "node_error"
    return exc


def _stream_error(base_url: str, err: object) -> EngineError:
    message = err.get("message") if isinstance(err, Mapping) else err
    return NodeServerError(f"engine node {base_url} failed mid-stream: {message}")


def _transport_error(base_url: str, exc: httpx.TransportError) -> NodeFailure:
    """An httpx failure as the fault it is: no answer in time, or no connection at all."""
    if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout):
        return NodeTimeoutError(f"engine node {base_url} timed out: {exc!r}")
    return NodeUnavailableError(f"engine node {base_url} unreachable: {exc!r}")


@dataclass
class NodeState:
    """What the gateway knows about one node (read by ``/health`` and by the router)."""

    healthy: bool = True  # the last probe answered 200 (True until a probe says otherwise)
    draining: bool = False  # the node said it takes no new requests
    last_probe_at: float | None = None
    last_error: str | None = None  # why the last probe found it unfit (None: it was fit)
    # None = no finished request seen yet; False = the node's usage has no prompt_tokens_details
    # (vLLM without --enable-prompt-tokens-details): its cache hits are not known, recorded as 0.
    cached_tokens_reported: bool | None = None


def request_body(request: GenerateRequest, model: str | None, *, prefixgate_node: bool = False) -> tuple[str, dict[str, Any]]:
    """The OpenAI-compatible path and JSON body for ``request``. ``prefixgate_node``: also send what
    only a PrefixGate node reads: the tenant's priority (vLLM refuses it unless started with
    priority scheduling) and its opaque tenant key (``prefixgate_tenant``, hex), so the node counts
    fairness and quotas per tenant, not per namespace.

    Raises ``InvalidRequestError`` for what this API cannot carry (logprobs objects, prompt logprobs,
    grammars)."""
    s = request.sampling
    if s.guided is not None:
        raise InvalidRequestError("response_format / guided output is not supported on engine-node routes")
    if s.prompt_logprobs is not None:  # the node API answers no prompt logprobs back to this client
        raise InvalidRequestError("prompt logprobs (echo with logprobs) are not supported on engine-node routes")
    if s.logprobs is not None:
        raise InvalidRequestError("logprobs are not supported on engine-node routes")
    body: dict[str, Any] = {
        "max_tokens": s.max_tokens, "temperature": s.temperature, "top_p": s.top_p,
        "cache_salt": bytes(request.tenant.namespace).hex(),
        "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "return_token_ids": True,
    }
    if model:
        body["model"] = model
    if s.top_k:
        body["top_k"] = s.top_k
    if s.seed is not None:
        body["seed"] = s.seed
    if s.stop:
        body["stop"] = list(s.stop)
    if s.stop_token_ids:
        body["stop_token_ids"] = list(s.stop_token_ids)
    if s.ignore_eos:
        body["ignore_eos"] = True
    if s.logit_bias:
        body["logit_bias"] = {str(t): b for t, b in s.logit_bias}
    if s.presence_penalty:
        body["presence_penalty"] = s.presence_penalty
    if s.frequency_penalty:
        body["frequency_penalty"] = s.frequency_penalty
    if s.repetition_penalty != 1.0:
        body["repetition_penalty"] = s.repetition_penalty
    if s.min_p:
        body["min_p"] = s.min_p
    if s.min_tokens:
        body["min_tokens"] = s.min_tokens
    if prefixgate_node and request.tenant.priority:
        body["priority"] = request.tenant.priority
    if prefixgate_node and request.tenant.tenant_key != request.tenant.namespace:
        body["prefixgate_tenant"] = bytes(request.tenant.tenant_key).hex()
    if request.messages is not None:
        body["messages"] = list(request.messages)
        if request.tools:
            body["tools"] = list(request.tools)
        return "/v1/chat/completions", body
    body["prompt"] = list(request.prompt_token_ids) if request.prompt_token_ids is not None else request.prompt
    return "/v1/completions", body


def _cached_tokens(usage: Mapping[str, Any]) -> int | None:
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, Mapping) or details.get("cached_tokens") is None:
        return None
    return int(details["cached_tokens"])


@dataclass
class PromptSoFar:
    """The prompt and cached tokens of one node stream, as known before its end: what the gateway
    tokenized (0 when the node tokenizes), replaced by the node's own counts from the first chunk
    whose usage has them (continuous usage stats). What an output before the final one carries, so
    that a stream cut short bills the prompt the node prefilled rather than none."""

    prompt: int
    cached: int = 0

    def update(self, usage: Mapping[str, Any]) -> None:
        prompt = usage.get("prompt_tokens")
        if isinstance(prompt, int) and prompt > 0:
            self.prompt = prompt
        cached = _cached_tokens(usage)
        if cached is not None:
            self.cached = cached
        self.cached = min(self.cached, self.prompt)


class RemoteEngineClient:
    """Talks to one node at ``base_url``; ``token`` (None = a keyless node) goes as a Bearer token.
    ``timeouts``: how long to wait for a connection and for the node's next bytes (``NodeTimeouts``);
    ``timeout_s``, when given, is the read timeout alone (the prefill/decode split's clients)."""

    def __init__(self, base_url: str, token: str | None, *, timeouts: NodeTimeouts | None = None,
                 timeout_s: float | None = None, tokenizer: PromptTokenizer | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        # The pool's tokenizer in this process (RouteConfig.tokenizer): the gateway renders prompts
        # and sends ids; None = the node tokenizes (chat goes as messages).
        self.tokenizer = tokenizer
        # No key, no header: a vLLM started without --api-key must not see "Authorization: Bearer None".
        self._headers = {"authorization": f"Bearer {token}"} if token else {}
        limits = timeouts or NodeTimeouts()
        read = timeout_s if timeout_s is not None else limits.read
        self._timeout = httpx.Timeout(read, connect=limits.connect)
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=self._headers, timeout=self._timeout,
                                       trust_env=False)
        self._models: list[ModelCard] = []
        self.state = NodeState()

    async def refresh_models(self, timeout_s: float | None = None) -> list[ModelCard]:
        """Fetch the node's model cards (``models()`` returns the last fetched list); ``timeout_s``:
        this call's read timeout (None: the client's)."""
        resp = await self._http.get("/v1/models", timeout=timeout_s or httpx.USE_CLIENT_DEFAULT)
        resp.raise_for_status()
        self._models = [ModelCard(id=str(c["id"]), max_model_len=int(c.get("max_model_len") or 0),
                                  owned_by=str(c.get("owned_by") or "node"))
                        for c in resp.json()["data"]]
        return self._models

    def _served_model(self, request: GenerateRequest) -> str | None:
        """The name to send: the request's, else the node's first model (vLLM requires one)."""
        if request.model:
            return request.model
        return self._models[0].id if self._models else None

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[RequestOutput, None]:
        prefixgate = any(c.owned_by == "prefixgate" for c in self._models)
        path, body = request_body(request, self._served_model(request), prefixgate_node=prefixgate)
        start = time.perf_counter()
        try:
            async with self._http.stream("POST", path, json=body) as resp:
                if resp.status_code != 200:
                    err = _error_from_response(resp.status_code, await resp.aread())
                    if isinstance(err, NodeDrainingError):
                        self.state.draining = True
                    raise err
                async for out in self._outputs(request, resp, start):
                    yield out
        except httpx.TransportError as exc:
            raise _transport_error(self.base_url, exc) from exc

    async def _outputs(self, request: GenerateRequest, resp: httpx.Response,
                       start: float) -> AsyncGenerator[RequestOutput, None]:
        """Server-sent chunks -> one output per text delta, then a final one with the usage. Each
        output carries the prompt and cached tokens known so far (``PromptSoFar``)."""
        rid = request.request_id
        ttft: float | None = None
        finish: Any = None
        usage: Mapping[str, Any] | None = None
        known = PromptSoFar(len(request.prompt_token_ids or ()))
        seen = 0
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:  # vLLM reports a failure after the 200 inside the stream
                raise _stream_error(self.base_url, chunk["error"])
            usage = chunk.get("usage") or usage
            if chunk.get("usage"):  # continuous_usage_stats: the node's counts, before this chunk's tokens
                known.update(chunk["usage"])
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta")
                text = (delta.get("content") if isinstance(delta, Mapping) else choice.get("text")) or ""
                ids = tuple(int(t) for t in choice.get("token_ids") or ())
                finish = choice.get("finish_reason") or finish
                if text or ids:
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    seen += max(len(ids), 1)
                    yield RequestOutput(rid, ids, text, False, known.prompt, known.cached, seen, ttft_s=ttft)
        usage = usage or {}
        cached = _cached_tokens(usage)
        self.state.cached_tokens_reported = cached is not None
        prompt = int(usage.get("prompt_tokens") or known.prompt)
        completion = int(usage.get("completion_tokens") or seen)
        reason = backend_finish_reason(finish)
        yield RequestOutput(rid, (), "", True, prompt, min(cached or 0, prompt), completion,
                            finish_reason=reason, ttft_s=ttft)

    async def abort(self, request_id: str) -> None:
        return None  # the closed stream is the abort: both vLLM and PrefixGate nodes stop on disconnect

    async def probe(self) -> bool:
        """``GET /health``, then the authenticated ``GET /v1/models``: updates ``state`` (healthy,
        draining, why not) and returns whether to send work here. The second call is what finds a
        node that refuses the gateway's node token: its ``/health`` needs no token and says 200."""
        self.state.last_probe_at = time.time()
        try:
            resp = await self._http.get("/health", timeout=HEALTH_TIMEOUT_S)
        except httpx.HTTPError as exc:
            self.state.healthy, self.state.last_error = False, repr(exc)
            return False
        draining = False
        if resp.status_code == 503:
            try:
                draining = resp.json().get("status") == "draining"
            except ValueError:
                draining = False
        self.state.draining = draining
        self.state.healthy = resp.status_code == 200
        self.state.last_error = None if self.state.healthy else f"HTTP {resp.status_code}"
        if self.state.healthy:
            await self._probe_models()
        return self.state.healthy

    async def _probe_models(self) -> None:
        """Refresh the model list with the node token; a 401/403 marks the node unfit (the one fault
        ``/health`` cannot show), any other failure leaves the list as it was."""
        try:
            await self.refresh_models(HEALTH_TIMEOUT_S)
        except httpx.HTTPStatusError as exc:
            status = exc.response.status_code
            if status in (401, 403):
                self.state.healthy = False
                self.state.last_error = f"{NodeAuthError.LOG_TEXT} (HTTP {status}): check the route's node_token_env"
        except (httpx.HTTPError, KeyError, ValueError, TypeError):
            pass

    async def health(self) -> bool:
        return await self.probe()

    async def stats(self) -> dict[str, Any]:
        s = self.state
        return {"base_url": self.base_url, "healthy": s.healthy, "draining": s.draining,
                "cached_tokens_reported": s.cached_tokens_reported, "last_error": s.last_error}

    def models(self) -> list[ModelCard]:
        return list(self._models)

    def count_prompt_tokens(self, request: GenerateRequest) -> int:
        return len(self.tokenize(request))

    def tokenize(self, request: GenerateRequest) -> list[int]:
        if self.tokenizer is None:
            raise NotImplementedError("this node pool has no tokenizer in the gateway (RouteConfig.tokenizer)")
        return self.tokenizer.tokenize(request)

    @property
    def closed(self) -> bool:
        """Whether ``aclose`` released the HTTP pool (the gateway's lifespan does at shutdown)."""
        return self._http.is_closed

    async def aclose(self) -> None:
        await self._http.aclose()
