"""``ProviderClient``: an ``EngineClient`` over an upstream provider, through litellm.

Any litellm model string works (``openai/...``, ``anthropic/...``, ``deepseek/...``, or
``openai/<name>`` with an ``api_base`` for any OpenAI-compatible server such as vLLM, SGLang or
another PrefixGate). Each provider reports prompt-cache hits in its own fields; ``normalize_usage``
folds them into the one number OpenAI clients read (``prompt_tokens_details.cached_tokens``)::

    OpenAI     prompt_tokens_details.cached_tokens              (prompt_tokens includes them)
    Anthropic  cache_read_input_tokens, cache_creation_input_tokens (raw input_tokens excludes both)
    DeepSeek   prompt_cache_hit_tokens, prompt_cache_miss_tokens    (prompt_tokens = hit + miss)

Upstream responses carry text (and tool calls), not our token ids, so outputs have empty
``new_token_ids``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
import urllib.request
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from engine.protocol import EngineError, GenerateRequest, ModelCard, RequestOutput, backend_finish_reason
from gateway.http1 import Http1Client

if TYPE_CHECKING:
    import aiohttp

KEYLESS_PLACEHOLDER = "EMPTY"


@dataclass(frozen=True)
class ProviderOutput(RequestOutput):
    """A ``RequestOutput`` that may also carry streamed tool-call deltas (OpenAI chunk shape) and
    the prompt tokens the provider wrote to its cache (Anthropic's cache_creation_input_tokens)."""

    tool_call_deltas: tuple[dict[str, Any], ...] = ()
    cache_creation_tokens: int = 0


@dataclass(frozen=True)
class UpstreamRequest(GenerateRequest):
    """A ``GenerateRequest`` with what only a provider can use, so that every backend is driven by the
    same ``generate(request)`` call.

    passthrough: OpenAI fields forwarded as they are (tool_choice, response_format, ...).
    body_extras: fields the OpenAI SDK has no parameter for (vLLM's sampling extras: top_k, min_p,
        ...), sent in the request body as the client sent them (litellm's ``extra_body``): an upstream
        that honours them does, one that does not refuses them; never silently dropped here.
    incremental: stream from the upstream (the client asked to stream); False makes one whole call.
    """

    passthrough: Mapping[str, Any] = field(default_factory=dict)
    body_extras: Mapping[str, Any] = field(default_factory=dict)
    incremental: bool = True
    tenant_name: str | None = None  # picks the tenant's own upstream key where the route has one


# Not frozen: made on every request, and a frozen dataclass sets each field through object.__setattr__
# (2-3x the construction time; issue #17). Nothing hashes it or relies on it not changing.
@dataclass
class NormalizedUsage:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cache_creation_tokens: int = 0


def _get(obj: Any, name: str) -> Any:
    if obj is None:
        return None
    if isinstance(obj, dict):
        return obj.get(name)
    return getattr(obj, name, None)


def normalize_usage(usage: Any) -> NormalizedUsage:
    """Provider usage (dict or litellm object) -> prompt/cached/completion tokens, OpenAI semantics."""
    # A JSON usage (the direct transport) is read with its own dict.get: _get is a Python call per field.
    get = usage.get if isinstance(usage, dict) else functools.partial(_get, usage)
    completion = get("completion_tokens") or get("output_tokens") or 0
    cache_read = get("cache_read_input_tokens") or 0
    cache_creation = get("cache_creation_input_tokens") or 0
    prompt = get("prompt_tokens")
    if prompt is None:  # Anthropic's raw shape: input_tokens excludes cache reads and writes
        prompt = (get("input_tokens") or 0) + cache_read + cache_creation
    cached = _get(get("prompt_tokens_details"), "cached_tokens") or 0
    cached = cached or cache_read or get("prompt_cache_hit_tokens") or 0
    return NormalizedUsage(int(prompt), int(cached), int(completion), int(cache_creation))


class ProviderError(EngineError):
    status = 502
    code = "upstream_error"


def _provider_error(exc: Exception) -> EngineError:
    """Keep the upstream's status where it is a client error the caller can fix."""
    status = getattr(exc, "status_code", None)
    err = ProviderError(f"upstream provider error: {getattr(exc, 'message', None) or exc}")
    if isinstance(status, int) and status in (400, 404, 413, 429):
        err.status = status
        err.code = {429: "rate_limit_exceeded", 404: "model_not_found"}.get(status, "upstream_invalid_request")
    return err


class ProviderClient:
    """One upstream model. ``extra`` OpenAI fields (tool_choice, response_format...) pass through."""

    def __init__(
        self,
        provider: str,
        *,
        api_base: str | None = None,
        api_key: str | None = None,
        cache_salt: bool = False,
        tenant_prefix: bool = True,
        prompt_cache_key: bool = False,
        extra_body: dict[str, Any] | None = None,
        max_model_len: int | None = None,
        model_id: str | None = None,
        tenant_api_keys: Mapping[str, str] | None = None,
        shared_api_key: bool = True,
        keyless: bool = False,
    ) -> None:
        self.provider = provider
        self.api_base = api_base
        self.api_key = api_key
        # A self-hosted upstream started without a key (vLLM without --api-key): litellm's OpenAI
        # client refuses to send a request without one ("Missing credentials"), so it gets vLLM's
        # documented placeholder, which such a server ignores. The direct transport sends no header.
        self.keyless = keyless
        # Per-tenant upstream accounts: each has its own prompt cache (and bill) at the provider.
        self.tenant_api_keys = dict(tenant_api_keys or {})
        self.shared_api_key = shared_api_key
        self.cache_salt = cache_salt
        self.tenant_prefix = tenant_prefix
        self.prompt_cache_key = prompt_cache_key
        self.extra_body = dict(extra_body or {})
        self._card = ModelCard(id=model_id or provider, max_model_len=max_model_len or 0, owned_by="upstream")

    def _api_key(self, request: GenerateRequest) -> str | None:
        """The tenant's own upstream key, else the route's shared one (if the route allows sharing)."""
        name = request.tenant_name if isinstance(request, UpstreamRequest) else None
        own = self.tenant_api_keys.get(name) if name is not None else None
        if own is not None:
            return own
        if not self.shared_api_key:
            err = ProviderError("this route serves only tenants with their own upstream account; "
                                "ask the operator to add one for your tenant")
            err.status, err.code = 403, "upstream_account_required"
            raise err
        return self.api_key

    def _params(self, request: GenerateRequest, extra: dict[str, Any]) -> dict[str, Any]:
        s = request.sampling
        params: dict[str, Any] = {
            "model": self.provider,
            "max_tokens": s.max_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "api_base": self.api_base,
            "api_key": self._api_key(request) or (KEYLESS_PLACEHOLDER if self.keyless else None),
            **extra,
        }
        if s.seed is not None:
            params["seed"] = s.seed
        if s.stop:
            params["stop"] = list(s.stop)
        extra_body = {**(request.body_extras if isinstance(request, UpstreamRequest) else {}), **self.extra_body}
        if self.cache_salt:  # vLLM-style per-request cache isolation, keyed by our namespace
            extra_body["cache_salt"] = bytes(request.tenant.namespace).hex()
        if self.prompt_cache_key:  # OpenAI: keeps one tenant's requests on the same cache machines
            extra_body["prompt_cache_key"] = scope_marker(request.tenant.namespace)
        if extra_body:
            params["extra_body"] = extra_body
        if request.tools:
            params["tools"] = list(request.tools)
        return params

    def _messages(self, request: GenerateRequest) -> list[dict[str, Any]]:
        messages = list(request.messages or ())
        return scoped_messages(messages, request.tenant.namespace) if self.tenant_prefix else messages

    def _prompt(self, request: GenerateRequest) -> str | list[int]:
        if request.prompt is None:  # token ids: no tokenizer here to prefix them (SECURITY.md says so)
            return list(request.prompt_token_ids or ())
        return scoped_prompt(request.prompt, request.tenant.namespace) if self.tenant_prefix else request.prompt

    def generate(self, request: GenerateRequest) -> AsyncGenerator[RequestOutput, None]:
        """The ``EngineClient`` call; an ``UpstreamRequest`` adds pass-through fields and the stream choice.

        Returns ``_outputs``' async generator itself (nothing runs before the first output is asked
        for) rather than re-yielding it: one generator layer less per request and per output."""
        upstream = request if isinstance(request, UpstreamRequest) else None
        extra = dict(upstream.passthrough) if upstream is not None else {}
        incremental = upstream.incremental if upstream is not None else True
        return self._outputs(request, extra, incremental=incremental)

    async def _outputs(
        self, request: GenerateRequest, extra: dict[str, Any], *, incremental: bool = True
    ) -> AsyncGenerator[RequestOutput, None]:
        """Outputs for ``request``. ``incremental=False`` (the client did not ask to stream) makes one
        non-streamed upstream call: measured 8 ms instead of 29 ms per call through litellm on loopback."""
        import litellm  # heavy import: only when a provider route is used

        params = self._params(request, extra)
        start = time.perf_counter()
        rid = request.request_id
        if request.messages is not None and not incremental:
            try:
                resp = await litellm.acompletion(messages=self._messages(request), **params)
            except Exception as exc:
                raise _provider_error(exc) from exc
            yield _whole_output(rid, resp, chat=True, start=start)
            return
        if request.messages is None:  # text completion: one upstream call, one output
            try:
                resp = await litellm.atext_completion(prompt=self._prompt(request), **params)
            except Exception as exc:
                raise _provider_error(exc) from exc
            yield _whole_output(rid, resp, chat=False, start=start)
            return
        try:
            chunks = await litellm.acompletion(
                messages=self._messages(request), stream=True, stream_options={"include_usage": True}, **params
            )
        except Exception as exc:
            raise _provider_error(exc) from exc
        try:
            async for out in _chunk_outputs(rid, chunks, start):
                yield out
        except Exception as exc:
            raise _provider_error(exc) from exc

    async def abort(self, request_id: str) -> None:
        return None  # closing the stream ends the upstream request

    async def health(self) -> bool:
        return True

    async def stats(self) -> dict[str, Any]:
        return {"provider": self.provider, "api_base": self.api_base}

    def models(self) -> list[ModelCard]:
        return [self._card]

    def count_prompt_tokens(self, request: GenerateRequest) -> int:
        import litellm

        if request.messages is not None:
            return int(litellm.token_counter(model=self.provider, messages=list(request.messages)))
        return int(litellm.token_counter(model=self.provider, text=request.prompt or ""))

    def tokenize(self, request: GenerateRequest) -> list[int]:
        raise NotImplementedError("an upstream provider tokenizes with its own tokenizer")


def scope_marker(namespace: bytes) -> str:
    """An opaque per-scope id for upstreams: 128 bits of SHA-256 over the namespace, so the upstream
    never sees the namespace itself (the seed of our own block hashes) where it does not need it."""
    return hashlib.sha256(b"prefixgate-upstream-scope\0" + bytes(namespace)).hexdigest()[:32]


def _marker_line(namespace: bytes) -> str:
    return _scope_line(bytes(namespace))


@functools.lru_cache(maxsize=4096)
def _scope_line(namespace: bytes) -> str:
    """Cached: a scope sends many requests, and the digest was hashed again for each one (issue #17).
    Bounded; a scope that drops out is hashed again, which is only slower."""
    return f"[cache-scope {scope_marker(namespace)}]"


def scoped_messages(messages: list[dict[str, Any]], namespace: bytes) -> list[dict[str, Any]]:
    """``messages`` with the tenant's marker as the very first text of the prompt.

    Providers that cache prompts per account (OpenAI, Anthropic) match exact leading tokens, so two
    tenants whose prompts start differently can never share a cached prefix there. The marker joins
    the leading system message where there is one (some templates allow only one), else it is one.
    """
    line = _marker_line(namespace)
    if messages and messages[0].get("role") in ("system", "developer"):
        first = dict(messages[0])
        content = first.get("content")
        if isinstance(content, list):
            first["content"] = [{"type": "text", "text": line + "\n"}, *content]
        else:
            first["content"] = f"{line}\n{content or ''}"
        return [first, *messages[1:]]
    return [{"role": "system", "content": line}, *messages]


def scoped_prompt(prompt: str, namespace: bytes) -> str:
    """A text-completions prompt with the tenant's marker line in front (see ``scoped_messages``)."""
    return f"{_marker_line(namespace)}\n{prompt}"


def _as_dict(obj: Any) -> dict[str, Any]:
    if isinstance(obj, dict):
        return obj
    dump = getattr(obj, "model_dump", None)
    return dump(exclude_none=True) if dump else dict(vars(obj))


def _whole_output(rid: str, resp: Any, *, chat: bool, start: float) -> ProviderOutput:
    """A non-streamed chat or text completion (litellm object or OpenAI JSON) as one final output."""
    u = normalize_usage(_get(resp, "usage"))
    choice = (_get(resp, "choices") or [{}])[0]
    message = _get(choice, "message")
    text = _get(message, "content") if chat else _get(choice, "text")
    calls = tuple({**_as_dict(c), "index": i} for i, c in enumerate(_get(message, "tool_calls") or []))
    return ProviderOutput(
        rid, (), text or "", True, u.prompt_tokens, u.cached_tokens, u.completion_tokens,
        finish_reason=backend_finish_reason(_get(choice, "finish_reason")), ttft_s=time.perf_counter() - start,
        tool_call_deltas=calls, cache_creation_tokens=u.cache_creation_tokens,
    )


async def _chunk_outputs(rid: str, chunks: AsyncIterator[Any], start: float) -> AsyncIterator[ProviderOutput]:
    """Streamed chat chunks (litellm objects or OpenAI JSON): one output per content or tool-call delta,
    then a final one with the usage (counted deltas where the upstream sent none)."""
    ttft: float | None = None
    finish = None
    usage = None
    seen = 0
    async for chunk in chunks:
        usage = _get(chunk, "usage") or usage
        for choice in _get(chunk, "choices") or []:
            delta = _get(choice, "delta")
            text = _get(delta, "content") or ""
            tools = _get(delta, "tool_calls") or []
            finish = _get(choice, "finish_reason") or finish
            if text or tools:
                ttft = ttft if ttft is not None else time.perf_counter() - start
                seen += 1
                yield ProviderOutput(rid, (), text, False, 0, 0, seen, ttft_s=ttft,
                                     tool_call_deltas=tuple(_as_dict(t) for t in tools))
    u = normalize_usage(usage) if usage is not None else NormalizedUsage(0, 0, seen)
    yield ProviderOutput(rid, (), "", True, u.prompt_tokens, u.cached_tokens, u.completion_tokens or seen,
                         finish_reason=backend_finish_reason(finish), ttft_s=ttft, cache_creation_tokens=u.cache_creation_tokens)


async def _sse_chunks(body: AsyncIterator[bytes]) -> AsyncIterator[dict[str, Any]]:
    """The JSON chunks of an OpenAI server-sent-events stream, from its body in pieces of any size.

    Lines are split here rather than by the client's ``readline``: aiohttp's has a length limit
    (a long tool-call delta is one line), and an event may end in ``\n`` or ``\r\n``."""
    pending = b""
    async for piece in body:
        pending += piece
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                yield json.loads(line[6:])
    if pending.startswith(b"data: ") and not pending.startswith(b"data: [DONE]"):
        yield json.loads(pending[6:])


_JSON = {"Content-Type": "application/json"}  # the body's type: a default of the direct pool, per request on aiohttp


class DirectOpenAIClient(ProviderClient):
    """An OpenAI-compatible upstream (vLLM, SGLang, another PrefixGate) over one keep-alive HTTP pool.

    Same outputs and error mapping as ``ProviderClient``, without litellm on the request path: litellm
    rebuilds its client and parses provider quirks on every call, which was most of the gateway's added
    latency in front of a loopback upstream. ``provider`` is ``openai/<upstream model name>``.

    The pool is ``gateway.http1`` (httptools' compiled parser under ~20 Python frames a request): httpx +
    httpcore + h11 made ~800 Python calls per upstream request, aiohttp's layers ~145 (benchmarks/gateway.py
    profile, docs/gateway.md). aiohttp stays for an upstream behind an ``HTTP(S)_PROXY``.
    """

    def __init__(self, provider: str, **kwargs: Any) -> None:
        super().__init__(provider, **kwargs)
        self._upstream_model = provider.split("/", 1)[1]
        self._base = str(self.api_base).rstrip("/")
        self._default_headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self._proxy = env_proxy_for(self._base)
        self._http: aiohttp.ClientSession | None = None  # made in the serving event loop on first use
        # aiohttp where a proxy applies (or the URL is not http(s), to fail as before: on first use)
        direct = self._proxy is None and self._base.startswith(("http://", "https://"))
        self._h1 = Http1Client(self._base, self._pool_headers()) if direct else None

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None:
            import aiohttp  # ~0.1 s to import: only when a direct route serves its first request

            self._http = aiohttp.ClientSession(
                headers=self._default_headers, proxy=self._proxy,
                connector=aiohttp.TCPConnector(limit=256, keepalive_timeout=60),
                timeout=aiohttp.ClientTimeout(total=600.0, connect=10.0))
        return self._http

    def _pool_headers(self) -> dict[str, str]:
        """The direct pool's headers on every request: the route's key and the body's type, written
        into its request head once (a per-request header makes ``Http1Client.post`` merge heads)."""
        return {**self._default_headers, "Content-Type": "application/json"}

    def _body(self, request: GenerateRequest, extra: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
        """The JSON body and the headers beyond the direct pool's own: the key, when it is not the
        route's (aiohttp adds Content-Type: ``_JSON``)."""
        params = self._params(request, extra)
        key = params.pop("api_key", None)
        params.pop("api_base", None)
        params["model"] = self._upstream_model
        params.update(params.pop("extra_body", {}))  # the OpenAI SDK merges extra_body into the JSON body
        headers = {"Authorization": f"Bearer {key}"} if key and key != self.api_key else {}
        return params, headers

    async def _post(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
        payload = json.dumps(body).encode()
        try:
            if self._h1 is not None:
                resp = await self._h1.post(path, payload, headers)
                status, data = resp.status, await resp.read()  # read releases the connection
            else:
                async with self._session().post(self._base + path, data=payload, headers={**_JSON, **headers}) as aresp:
                    status, data = aresp.status, await aresp.read()
        except Exception as exc:
            raise _provider_error(exc) from exc
        if status >= 400:
            raise _http_error(status, data.decode("utf-8", "replace"))
        return json.loads(data)

    async def _outputs(
        self, request: GenerateRequest, extra: dict[str, Any], *, incremental: bool = True
    ) -> AsyncGenerator[RequestOutput, None]:
        body, headers = self._body(request, extra)
        start = time.perf_counter()
        rid = request.request_id
        if request.messages is None or not incremental:
            if request.messages is None:
                body["prompt"] = self._prompt(request)
                data = await self._post("/completions", body, headers)
            else:
                body["messages"] = self._messages(request)
                data = await self._post("/chat/completions", body, headers)
            yield _whole_output(rid, data, chat=request.messages is not None, start=start)
            return
        body.update(messages=self._messages(request), stream=True, stream_options={"include_usage": True})
        if self._h1 is not None:
            async for out in _h1_stream(self._h1, rid, json.dumps(body).encode(), headers, start):
                yield out
            return
        try:
            async with self._session().post(self._base + "/chat/completions", data=json.dumps(body).encode(),
                                            headers={**_JSON, **headers}) as resp:
                if resp.status >= 400:
                    raise _http_error(resp.status, (await resp.read()).decode("utf-8", "replace"))
                async for out in _chunk_outputs(rid, _sse_chunks(resp.content.iter_any()), start):
                    yield out
        except EngineError:
            raise
        except Exception as exc:
            raise _provider_error(exc) from exc

    async def stats(self) -> dict[str, Any]:
        return {"provider": self.provider, "api_base": self.api_base, "transport": "direct"}

    async def aclose(self) -> None:
        """Close the keep-alive pool (the app's lifespan calls this at shutdown)."""
        if self._http is not None:
            await self._http.close()
            self._http = None
        if self._h1 is not None:  # a fresh pool: an app served again (tests) runs in another event loop
            await self._h1.aclose()
            self._h1 = Http1Client(self._base, self._pool_headers())


async def _h1_stream(
    h1: Http1Client, rid: str, payload: bytes, headers: dict[str, str], start: float
) -> AsyncIterator[ProviderOutput]:
    """A streamed chat completion over the direct pool, errors mapped as ``ProviderClient`` maps them."""
    try:
        resp = await h1.post("/chat/completions", payload, headers)
        try:
            if resp.status >= 400:
                raise _http_error(resp.status, (await resp.read()).decode("utf-8", "replace"))
            async for out in _chunk_outputs(rid, _sse_chunks(resp.pieces()), start):
                yield out
        finally:  # a stream left early (client gone, cancelled) closes the connection, never pools it
            resp.release()
    except EngineError:
        raise
    except Exception as exc:
        raise _provider_error(exc) from exc


def env_proxy_for(url: str) -> str | None:
    """The proxy that ``HTTP(S)_PROXY`` / ``NO_PROXY`` name for ``url`` (as httpx and the OpenAI SDK
    honour them), read once per upstream: aiohttp's ``trust_env`` reads them and ``~/.netrc`` again
    on every request, +0.4 ms each on loopback."""
    parts = urlsplit(url)
    if parts.hostname and urllib.request.proxy_bypass(parts.hostname):
        return None
    return urllib.request.getproxies().get(parts.scheme)


def _http_error(status: int, text: str) -> EngineError:
    """An upstream HTTP error, with the upstream's OpenAI error message where it sent one."""
    try:
        message = json.loads(text)["error"]["message"]
    except Exception:
        message = text[:500]
    exc = Exception(message)
    exc.status_code = status  # type: ignore[attr-defined]
    exc.message = message  # type: ignore[attr-defined]
    return _provider_error(exc)
