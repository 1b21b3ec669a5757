"""The engine's public surface: what the gateway (or a remote node) may rely on.

The gateway talks to every engine — in-process, a remote node over HTTP — through the small
``EngineClient`` Protocol below, and a tenant reaches the engine only as a ``TenantScope``: an
opaque namespace (what its prompts share a cache with), an opaque tenant key (whose quotas and
fair share they count against), a ``BlockCipher`` and a few quota numbers. Tenancy implements these Protocols
structurally; the engine never imports tenancy or gateway code (import-linter enforces it).

This module imports no torch, so the gateway can depend on it cheaply.
"""

from __future__ import annotations

import math
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "length", "abort", "error"]  # how the in-process engine ends a request
# what a RequestOutput may carry: the engine's reasons and those an OpenAI-compatible backend (an engine
# node, a provider) reports besides
OutputFinishReason = FinishReason | Literal["tool_calls", "content_filter"]
_BACKEND_FINISH: dict[str, OutputFinishReason] = {
    "stop": "stop", "length": "length", "tool_calls": "tool_calls", "content_filter": "content_filter", "abort": "abort"}


def backend_finish_reason(reported: object) -> OutputFinishReason:
    """A backend's reported ``finish_reason`` as an output's: one OpenAI defines (or abort) as it is, anything
    else (missing, a provider's own word) as "stop", which every OpenAI client can read."""
    return _BACKEND_FINISH.get(reported, "stop") if isinstance(reported, str) else "stop"


class OutputFailure(Enum):
    """Why a request finished with ``finish_reason="error"``, where the caller can act on it
    (``RequestOutput.failure``; None for an engine fault)."""

    # The grammar reached a state from which no token can continue the output (llguidance's
    # error state: for example a required property that refers back to its own object forces
    # an endless value). The output so far is not valid for the schema; the schema is the cause.
    GRAMMAR_DEAD_END = "grammar_dead_end"


MAX_TOP_LOGPROBS = 20  # OpenAI's bound for chat top_logprobs
MAX_GUIDED_ITEMS = 64  # GuidedSpec.max_items: a bounded repetition keeps the compiled grammar small


@runtime_checkable
class BlockCipher(Protocol):
    """Authenticated encryption for KV bytes that leave HBM (one tenant's data key).

    Contract:
        - ``encrypt`` returns a self-contained blob (nonce, ciphertext and tag inside it); every
          call uses a fresh nonce, so equal plaintexts give unequal blobs.
        - ``decrypt`` returns the plaintext, or ``None`` when the blob is truncated, tampered
          with, bound to other ``aad`` bytes, or was made under another key. It never raises for
          bad ciphertext: a failed tag is a cache miss, never served.
        - Both are thread-safe: the engine calls them from a thread pool.
    """

    def encrypt(self, plaintext: bytes | memoryview, aad: bytes) -> bytes: ...

    def decrypt(self, blob: bytes | memoryview, aad: bytes) -> bytes | None: ...


@runtime_checkable
class TenantScope(Protocol):
    """What the engine knows of a tenant. Implemented by ``tenancy`` (``TenantContext``).

    Attributes:
        namespace: the server-derived cache namespace (HMAC of tenant id and share scope). It
            seeds the prefix hash chain, so two namespaces never share a cache entry in any tier.
            A sharing scope, not a tenant: one tenant may have many (share scope ``user``: one
            per end user) and tenants may share one (share scope ``group:NAME``).
        tenant_key: an opaque, stable id of the tenant (never a chain seed). Everything that is
            per tenant is keyed by it, never by the namespace: the KV block quotas (HBM, and the
            DRAM / NVMe tier caps), the scheduler's fair share (VTC counter, waiting queue) and
            the choice of whose request is preempted to free quota, and the per-tenant figures
            shown back to a tenant (labels are cut names: two tenants, or a deleted tenant and a
            new one of its name, can share one).
        metrics_label: a bounded-cardinality label for Prometheus (never a raw end-user id).
        cipher: encrypts this tenant's blocks when they leave HBM; ``None`` disables spilling for
            this tenant (its evicted blocks are dropped, never written in clear).
        priority: larger is served first among waiting requests (0 = default class).
        kv_block_quota: most HBM blocks this tenant may hold at once; ``None`` = no cap.
        kv_block_quota_dram / kv_block_quota_nvme: most KV blocks it may keep in the DRAM / NVMe
            tier (over it, its own oldest blocks there are dropped first); ``None`` = no cap.
        ttft_target_s: optional time-to-first-token target that orders admission.
    """

    @property
    def namespace(self) -> bytes: ...

    @property
    def tenant_key(self) -> bytes: ...

    @property
    def metrics_label(self) -> str: ...

    @property
    def cipher(self) -> BlockCipher | None: ...

    @property
    def priority(self) -> int: ...

    @property
    def kv_block_quota(self) -> int | None: ...

    @property
    def kv_block_quota_dram(self) -> int | None: ...

    @property
    def kv_block_quota_nvme(self) -> int | None: ...

    @property
    def ttft_target_s(self) -> float | None: ...


@dataclass(frozen=True)
class StaticTenantScope:
    """A plain ``TenantScope`` for the CLI, tests, benchmarks and remote nodes (no tenancy database).

    ``tenant_key`` left empty means one tenant per namespace: the key is the namespace itself
    (what a node gets from a peer that sends no tenant key)."""

    namespace: bytes = b"default"
    metrics_label: str = "default"
    cipher: BlockCipher | None = None
    priority: int = 0
    kv_block_quota: int | None = None
    ttft_target_s: float | None = None
    kv_block_quota_dram: int | None = None
    kv_block_quota_nvme: int | None = None
    tenant_key: bytes = b""

    def __post_init__(self) -> None:
        if not self.tenant_key:
            object.__setattr__(self, "tenant_key", self.namespace)


@dataclass(frozen=True)
class GrammarOwner:
    """Whose compiled grammar a ``GuidedSpec`` names (set by the engine at admission, from the
    request's tenant scope; hex strings so that a spec stays JSON-serializable).

    ``cache_scope`` (the cache namespace) keys the compile cache, as it salts the prefix cache:
    a grammar compiled for one namespace is never a cache hit for another, so its compile time
    tells nothing about another tenant's schemas. ``tenant`` (the tenant key) bounds how many
    compiles one tenant runs at once (``engine.guided``)."""

    cache_scope: str
    tenant: str


@dataclass(frozen=True)
class GuidedSpec:
    """A grammar the output must follow, enforced token by token while decoding (engine.guided).

    The output is an item, ``prefix`` + one JSON value matching ``json_schema`` + ``suffix``,
    then EOS; with ``max_items`` > 1, one to ``max_items`` items with ``separator`` between two
    of them (only between: EOS is allowed after every complete item, so nothing forces another).
    ``json_schema`` is the schema's JSON text (``'{"type": "object"}'`` for any JSON object);
    ``prefix``/``suffix``/``separator`` are literal text (a tool-call wrapper such as
    ``<tool_call>\\n``). Frozen and hashable: equal specs share one compiled grammar.
    """

    json_schema: str
    prefix: str = ""
    suffix: str = ""
    max_items: int = 1  # several tool calls: up to this many items
    separator: str = ""  # between two items
    owner: GrammarOwner | None = None  # the engine's, from the request's tenant (never the client's)

    def __post_init__(self) -> None:
        if not self.json_schema:
            raise ValueError("a guided spec needs a JSON schema")
        if not 1 <= self.max_items <= MAX_GUIDED_ITEMS:
            raise ValueError(f"max_items must be in [1, {MAX_GUIDED_ITEMS}], got {self.max_items}")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop. Validated on construction.

    ``logit_bias``: (token id, bias) pairs added to the logits before anything else (OpenAI's
    range -100..100); ids are checked against the vocabulary when the engine admits the request.
    ``logprobs``: None = no logprobs; k >= 0 = the sampled token's logprob plus the k most likely
    alternatives at each step. ``guided``: a grammar the output must follow.
    ``presence_penalty`` / ``frequency_penalty``: OpenAI's (-2..2), subtracted from a token's logit
    once if it appears among the tokens generated so far / once per time it appears there (the
    prompt's tokens are not counted, as in vLLM).
    ``repetition_penalty`` (vLLM's; > 0, 1 = off): a token seen in the prompt or the output so far has
    its logit divided by it where positive, multiplied where not; applied before the two above.
    ``min_p`` (vLLM's; 0..1, 0 = off): when sampling, tokens less likely than ``min_p`` times the most
    likely one are dropped (after temperature, before top-k / top-p). ``min_tokens`` (vLLM's): EOS and
    ``stop_token_ids`` cannot be picked, and stop strings do not end the output, until that many
    tokens are generated (not with a grammar, which ends its output with EOS).
    ``prompt_logprobs``: None = the prompt is not scored; k >= 0 = every prompt token after the first
    gets its logprob given the tokens before it, plus the k most likely alternatives at its position
    (``RequestOutput.prompt_logprobs``). Scoring needs every prompt position's logits, which a
    prefix-cache hit does not have: such a request computes its whole prompt (no prefix reuse; its
    blocks are still cached for later requests).
    ``max_tokens`` 0 computes the prompt and generates nothing (finish reason "length"): what a
    caller that only scores the prompt asks for.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    guided: GuidedSpec | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        for name, penalty in (("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)):
            if not -2.0 <= penalty <= 2.0:  # also refuses NaN
                raise ValueError(f"{name} must be in [-2, 2], got {penalty}")
        if not 0.0 < self.repetition_penalty < math.inf:  # also refuses NaN
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if self.min_tokens and self.guided is not None:
            raise ValueError("min_tokens cannot be combined with a grammar, which ends its output with EOS")
        for token_id, bias in self.logit_bias:
            if token_id < 0:
                raise ValueError(f"logit_bias token id must be >= 0, got {token_id}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top prompt logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs}")
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if len(self.stop) > 4:
            raise ValueError("at most 4 stop sequences are supported")
        if "" in self.stop:  # it would match at once: callers drop empty stops (OpenAI ignores them)
            raise ValueError("stop sequences must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def penalised(self) -> bool:
        """Whether the logits depend on the tokens seen so far (a presence, frequency or repetition penalty)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


@dataclass(frozen=True)
class Retention:
    """Keep the prompt's first ``tokens`` tokens cached for ``seconds`` (explicit cache control).

    The full blocks inside that prefix are not evicted from the tiers while the deadline holds:
    under HBM pressure they are demoted to a lower tier rather than dropped (within the tenant's
    quotas). From Anthropic ``cache_control`` ttl, OpenAI ``prompt_cache_retention``, or a warm-up."""

    tokens: int
    seconds: float

    def __post_init__(self) -> None:
        if self.tokens < 0 or not self.seconds > 0:
            raise ValueError(f"retention needs tokens >= 0 and seconds > 0, got {self.tokens}, {self.seconds}")


@dataclass(frozen=True)
class GenerateRequest:
    """One generation. Exactly one of ``messages``, ``prompt``, ``prompt_token_ids`` is set.

    ``messages`` (OpenAI chat shape, optionally with ``tools``) are rendered by the engine's chat
    template, since the engine owns the tokenizer; ``prompt`` is raw text; ``prompt_token_ids``
    skips tokenization.
    """

    request_id: str
    tenant: TenantScope
    sampling: SamplingParams = field(default_factory=SamplingParams)
    messages: Sequence[dict[str, Any]] | None = None
    tools: Sequence[dict[str, Any]] | None = None
    prompt: str | None = None
    prompt_token_ids: Sequence[int] | None = None
    model: str | None = None
    retention: tuple[Retention, ...] = ()  # explicit cache control; () = the default eviction policy

    def __post_init__(self) -> None:
        given = sum(x is not None for x in (self.messages, self.prompt, self.prompt_token_ids))
        if given != 1:
            raise ValueError("exactly one of messages, prompt, prompt_token_ids must be given")
        if not self.request_id:
            raise ValueError("request_id must be non-empty")


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token with its log-probability and, when asked, the most likely alternatives.

    ``token`` is the token's text (UTF-8 decoded, U+FFFD where it holds part of a character);
    ``token_bytes`` its exact bytes. Log-probabilities are of the model's distribution before
    logit_bias, grammar masks, temperature and top-k/top-p (what vLLM reports by default).
    ``top`` holds ``(token, token_bytes, logprob)`` triples, most likely first.
    """

    token_id: int
    token: str
    token_bytes: tuple[int, ...]
    logprob: float
    top: tuple[tuple[str, tuple[int, ...], float], ...] = ()


@dataclass(frozen=True)
class PromptLogprobs:
    """A request's prompt scored token by token (``SamplingParams.prompt_logprobs``).

    The first prompt token has nothing before it and so no logprob (OpenAI and vLLM report
    ``null``): only its id and text are here. ``scored`` holds every later prompt token in order,
    its logprob under the model given the tokens before it, and the top alternatives at its
    position (``TokenLogprob``: raw distribution, as for output tokens).
    """

    first_token_id: int
    first_token: str
    first_token_bytes: tuple[int, ...]
    scored: tuple[TokenLogprob, ...]


@dataclass(frozen=True)
class RequestOutput:
    """One streamed increment of a request (the last one has ``finished=True``).

    Times are seconds. ``cached_tokens`` counts prompt tokens served from the prefix cache in any
    tier (what OpenAI reports as ``usage.prompt_tokens_details.cached_tokens``).
    """

    request_id: str
    new_token_ids: tuple[int, ...]
    new_text: str
    finished: bool
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: OutputFinishReason | None = None
    # On the last output of a request that a stop string ended: that string (as the request listed
    # it); None for every other ending (EOS, a stop token id, max_tokens) and on earlier outputs.
    stop_sequence: str | None = None
    queue_time_s: float | None = None
    ttft_s: float | None = None
    token_times_s: tuple[float, ...] = ()
    error: str | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # one per new text token, when the sampling asked for them
    failure: OutputFailure | None = None  # with finish_reason "error": a cause the caller can act on
    # The prompt scored (SamplingParams.prompt_logprobs): once, on the request's first output, and
    # only when every prompt token was scored (never a partial prompt); None on every other output.
    prompt_logprobs: PromptLogprobs | None = None


@dataclass(frozen=True)
class AbortReport:
    """How far an aborted request got with its prompt, as the engine that ran it knows.

    ``prefilled_tokens``: prompt tokens whose K/V the request held when it stopped (read from the
    prefix cache or computed); the full blocks among them stay in the cache after the abort, so a
    prefill cut short before the first token is still work done (and billed). ``cached_tokens``:
    how many of those were read from the cache rather than computed. Both 0: it never ran.
    """

    prefilled_tokens: int
    cached_tokens: int


class RequestPart(Enum):
    """The part of a ``GenerateRequest`` an error is about. The engine knows the part, not the
    field the client wrote it in: the caller names it in its own API's terms (the prompt is chat's
    ``messages``, completions' ``prompt``, the Responses API's ``input``)."""

    PROMPT = "prompt"  # prompt / prompt_token_ids / messages
    LOGIT_BIAS = "logit_bias"  # SamplingParams.logit_bias
    GUIDED = "guided"  # SamplingParams.guided: the grammar of a response format or a forced tool call


class EngineError(Exception):
    """Base for errors a caller can act on. ``status`` is the HTTP status it maps to; ``part``, when
    set, the part of the request at fault (None: the request as a whole, or the server);
    ``retry_after_s``, when set, the seconds to wait before retrying (the ``Retry-After`` header)."""

    status: int = 500
    code: str = "engine_error"
    part: RequestPart | None = None
    retry_after_s: int | None = None


class PromptTooLongError(EngineError):
    """The prompt plus ``max_tokens`` does not fit the model's context."""

    status = 400
    code = "context_length_exceeded"
    part = RequestPart.PROMPT


class InvalidRequestError(EngineError):
    """The request cannot be served as given (empty prompt, token id outside the vocabulary...).

    ``code`` says what is wrong (``invalid_value``, ``empty_prompt``...; ``invalid_request`` when
    nothing more precise applies) and ``part`` where, so that the client's error names its field."""

    status = 400
    code = "invalid_request"

    def __init__(self, message: str, *, part: RequestPart | None = None, code: str | None = None) -> None:
        super().__init__(message)
        if part is not None:
            self.part = part
        if code is not None:
            self.code = code


class UnenforceableSchemaError(InvalidRequestError):
    """A guided request's JSON schema cannot be enforced while decoding: refused when its grammar
    is compiled (or its forced start fails), or found when the grammar dead-ends mid-output
    (``OutputFailure.GRAMMAR_DEAD_END``)."""

    code = "unenforceable_schema"
    part = RequestPart.GUIDED


class GrammarQueueFullError(EngineError):
    """The tenant already has the most grammar compiles waiting that one tenant may
    (``engine.guided.COMPILES_QUEUED_PER_TENANT``): a new schema is refused before any work is
    queued. Too many in flight, not a bad request: a 429 to retry shortly, as OpenAI's clients expect."""

    status = 429
    code = "grammar_queue_full"
    part = RequestPart.GUIDED
    retry_after_s = 1


class PrepareQueueFullError(EngineError):
    """The tenant already has the most requests waiting to be prepared (rendered, tokenized) that
    one tenant may (``EngineConfig.prepare_queued_per_tenant``, behind its one being prepared): a
    new one is refused before any work is queued. Too many in flight: a 429 to retry shortly."""

    status = 429
    code = "prepare_queue_full"
    retry_after_s = 1


class EngineOverloadedError(EngineError):
    """The engine's waiting queue is full; retry later."""

    status = 503
    code = "engine_overloaded"


@dataclass(frozen=True)
class ModelCard:
    id: str
    max_model_len: int
    owned_by: str = "prefixgate"


@runtime_checkable
class EngineClient(Protocol):
    """The one interface between the gateway and any engine (in-process or remote).

    - ``generate`` yields increments until one with ``finished=True``; raises ``EngineError``
      subclasses for requests that cannot start (prompt too long, overloaded). Cancelling the
      iterator (client disconnect) aborts the request and frees its blocks.
    - ``abort`` is idempotent; unknown ids are ignored. It returns the request's ``AbortReport``
      (an unknown or finished id: what the engine last knew of it, else nothing done), or None
      when this client cannot tell (a remote node, an upstream provider).
    - ``health`` is cheap and never raises; ``stats`` returns a JSON-serialisable snapshot.
    """

    def generate(self, request: GenerateRequest) -> AsyncGenerator[RequestOutput, None]:
        """An async generator (``async def`` with ``yield``) in implementations."""
        ...

    async def abort(self, request_id: str) -> AbortReport | None: ...

    async def health(self) -> bool: ...

    async def stats(self) -> dict[str, Any]: ...

    def models(self) -> list[ModelCard]: ...

    def count_prompt_tokens(self, request: GenerateRequest) -> int: ...

    def tokenize(self, request: GenerateRequest) -> list[int]:
        """The prompt's token ids exactly as ``generate`` would compute them (chat template applied).

        Blocking, and slow for long prompts: call it off the event loop. Sending the ids back as
        ``prompt_token_ids`` lets ``generate`` skip tokenizing again. A client without the model's
        tokenizer in this process (remote node, upstream provider) raises ``NotImplementedError``.
        """
        ...


class OwnedEngine(EngineClient, Protocol):
    """An in-process engine the serving process built (``engine.launch.build_engine``: ``AsyncEngine``, or
    ``DisaggEngine`` for a prefill/decode node) and so must stop: ``shutdown`` ends its thread, waiting up
    to ``timeout`` seconds for the step in progress."""

    def shutdown(self, timeout: float = 10.0) -> None: ...


@runtime_checkable
class PromptDecoder(Protocol):
    """An engine that can turn prompt token ids back into text (the in-process engine can).

    ``decode_prompt`` returns the text of ``token_ids`` as the model's tokenizer decodes it, special
    tokens included (what vLLM echoes for a token-id prompt). Blocking (a long prompt takes
    milliseconds): call it off the event loop. Thread-safe."""

    def decode_prompt(self, token_ids: Sequence[int]) -> str: ...


@runtime_checkable
class CacheInspector(Protocol):
    """An engine that can say what it holds for one tenant (the in-process engine does).

    ``cache_usage`` returns prompt tokens cached per tier (``"hbm"``, and ``"dram"``/``"nvme"``
    where enabled) and ``"retained"``: tokens of HBM blocks under explicit retention, for the
    tenant's namespace. ``tenant_blocks`` returns the KV blocks charged to the tenant
    (``tenant.tenant_key``) per tier now, which its block quotas count: its own only, whatever its
    metrics label (two tenants may share one). Both cheap; never raise.
    """

    def cache_usage(self, tenant: TenantScope) -> dict[str, int]: ...

    def tenant_blocks(self, tenant: TenantScope) -> dict[str, int]: ...
