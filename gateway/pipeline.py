"""One request's way through the gateway, independent of the response shape.

    authenticate (deps) -> scope_for(user) -> canonicalize -> resolve backend -> check params
    -> count prompt tokens, check context length -> admit (quotas) -> run choices -> account

``prepare`` does everything up to admission and raises ``OpenAIError`` for anything the client
must fix; ``run_choices`` streams the engine outputs of all ``n`` choices (and prompts) merged;
``Accounting`` turns the final outputs into usage, one ledger row, metrics and dashboard totals.
The chat and completions routers only format what these produce.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
from collections.abc import AsyncGenerator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, TypeVar
from urllib.parse import quote

import anyio

from engine.protocol import (
    AbortReport,
    EngineClient,
    EngineError,
    GenerateRequest,
    GuidedSpec,
    PromptDecoder,
    RequestOutput,
    RequestPart,
    Retention,
    SamplingParams,
)
from gateway.errors import OpenAIError, invalid_request, unsupported_parameter, unsupported_value
from gateway.ingress import effective_temperature
from gateway.metrics import GatewayMetrics, LiveStats, RequestSample, outcome_of_status
from gateway.miss_tracker import MissRecord, MissTracker, Observation, header_value, usage_fields
from gateway.ports import (
    QuotaExceededError,
    TenancyPort,
    TenantCtx,
    UsageRecord,
    UsageStatus,
    canonicalize,
    quota_error,
)
from gateway.remote import NodeFailure
from gateway.routing import Backend, Router
from gateway.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest, Usage, now, usage_dict
from gateway.settings import GatewaySettings
from gateway.structured_output import guided_for_response_format
from gateway.tenant_threads import TenantThreads
from gateway.tool_calls import ToolPlan, plan_tools
from gateway.upstream import ProviderOutput, UpstreamRequest
from promptlint.cache_control import CacheControlError, retention_seconds
from promptlint.canon import CanonMode, CanonResult

log = logging.getLogger("prefixgate.gateway")

T = TypeVar("T")

# Fields that only an upstream provider can honour; forwarded to it as-is.
_PROVIDER_PASSTHROUGH = ("tool_choice", "response_format", "presence_penalty", "frequency_penalty", "logprobs",
                         "top_logprobs", "logit_bias", "parallel_tool_calls", "reasoning_effort")


@dataclass(frozen=True)
class MessageSource:
    """Where a door's client wrote one chat message: ``path`` (``input[2]``, ``instructions``), and
    whether its content parts are the client's own, one for one (part j at ``{path}.content[j]``)."""

    path: str
    parts: bool = False


@dataclass(frozen=True)
class MessagePaths:
    """Where the client wrote the chat messages a request runs with, so that a refused content part
    is named as the client sent it: chat's ``messages[i].content[j]``, or a door's own
    (``input[2].content[0]`` on /v1/responses), never a path in a chat body the client never saw."""

    sources: tuple[MessageSource, ...] = ()  # one per message; () = chat's own messages
    part_types: tuple[tuple[str, str], ...] = ()  # (chat part type, the door's name for it)

    def part(self, i: int, j: int, field: str) -> str:
        """The path of ``field`` of content part ``j`` of message ``i``."""
        if i >= len(self.sources):
            return f"messages[{i}].content[{j}].{field}"
        source = self.sources[i]
        return f"{source.path}.content[{j}].{field}" if source.parts else source.path

    def part_type(self, kind: str) -> str:
        """A chat part type by the door's name (a Responses ``input_image`` runs as ``image_url``)."""
        return next((theirs for ours, theirs in self.part_types if ours == kind), kind)


@dataclass(frozen=True)
class RequestFields:
    """What a front door calls the prompt, the output budget, the output format and the messages:
    the context-length error, the engine's errors and a refused content part name them."""

    prompt: str  # named when the prompt alone fills the context, or the engine refuses it
    max_tokens: str
    overflow: str  # named when the prompt fits but not with the output asked for
    response_format: str = "response_format"  # named when its schema's grammar is refused
    messages: MessagePaths = MessagePaths()

    def engine_params(self) -> dict[RequestPart, str]:
        """The names ``errors.from_engine_error`` gives the parts of an engine request. A grammar is
        left out: whether it came from the response format or a forced tool call is the caller's
        to say (``responder``)."""
        return {RequestPart.PROMPT: self.prompt, RequestPart.LOGIT_BIAS: "logit_bias"}


# OpenAI names the prompt's field even when max_tokens is what overflows (chat's "messages").
CHAT_FIELDS = RequestFields(prompt="messages", max_tokens="max_tokens", overflow="messages")
COMPLETION_FIELDS = RequestFields(prompt="prompt", max_tokens="max_tokens", overflow="prompt")


@dataclass
class Prepared:
    kind: str  # "chat" | "completion"
    request_id: str
    created: int
    model: str  # the name the client asked for (echoed back)
    backend: Backend
    requests: list[GenerateRequest]  # one per choice; choice i = prompt i // n, sample i % n
    n: int
    stream: bool
    include_usage: bool
    canon_applied: tuple[str, ...]
    tenant: TenantCtx  # the scoped TenantContext (also the engine's TenantScope)
    # Cache-miss explanation: the tracker's view before the run, and after it (set by Accounting.record).
    miss_tracker: MissTracker | None = None
    miss: Observation | None = None
    miss_record: MissRecord | None = None
    cached_tokens: int | None = None
    # Local engine output features: parse tool calls out of the text; logprobs to report per token
    # (None: no logprobs object; k: the sampled token plus k alternatives).
    tool_parsing: bool = False
    logprobs: int | None = None
    # The route's price (RouteConfig.price): a cost-map name, "unpriced", or None (the model's own).
    price_as: str | None = None
    # The engine's KV block size: a retained prompt writes (and is later read back in) full blocks.
    block_size: int = 16
    # What the client's API calls the request's fields: the engine's errors name them.
    fields: RequestFields = CHAT_FIELDS
    # Completions' echo: each prompt's text, which its choices start with (choice i: prompt i // n).
    echo: tuple[str, ...] | None = None

    @property
    def headers(self) -> dict[str, str]:
        headers = {
            "x-prefixgate-canonical": ",".join(self.canon_applied) or "none",
            "x-request-id": self.request_id,
            "x-prefixgate-backend": self.backend.label,
        }
        # Streaming headers go out before the engine reports cached tokens: then only a predicted
        # break (rule, character position); a whole response carries cached tokens and the settled break.
        predicted = self.miss.brk if self.miss is not None and self.cached_tokens is None else None
        cache = header_value(self.cached_tokens, self.miss_record, predicted)
        if cache != "none":
            headers["x-prefixgate-cache"] = cache
        return {name: header_text(value) for name, value in headers.items()}


# HTTP header values are latin-1 on the wire (and non-ASCII is unsafe in practice): the break detail
# quotes the client's prompt ("user_имя"), which made the response itself fail with a 500 (issue 16.4).
_HEADER_SAFE = " !#$&'()*+,/:;=?@[]~"


def header_text(value: str) -> str:
    """``value`` as printable ASCII: anything else percent-encoded as UTF-8 (RFC 3986 style)."""
    return value if value.isascii() and value.isprintable() and "%" not in value else quote(value, safe=_HEADER_SAFE)


def provider_message(message: Mapping[str, object]) -> dict[str, object]:
    """One message of the canonical body (``model_dump(exclude_unset=True)`` of the request, then
    canonicalized) as a provider gets it: ``ChatMessage.model_dump(exclude_none=True)``, which drops
    the fields and extras that are None at the top level of the message only (nested values stay).

    Taken from the dict at hand rather than validated into a ``ChatMessage`` again and dumped: that
    round trip cost ~25 us of every provider request (issue #17) and changed nothing."""
    return {name: value for name, value in message.items() if value is not None}


def _part_text(i: int, j: int, role: str, part: dict[str, Any], paths: MessagePaths) -> str:
    """The text of content part ``j`` of message ``i``. An assistant's earlier ``refusal`` part
    (OpenAI's history shape for a refused turn) is what that assistant said: its text, as the
    Responses door reads it too. Anything else but text is refused (images, audio, files), named
    as the client wrote it (``paths``)."""
    kind = part.get("type")
    if kind == "text":
        return part.get("text", "")
    if kind == "refusal" and role == "assistant":
        return part["refusal"]  # a string: schemas.ChatMessage checked it
    raise invalid_request(
        f"content part type {paths.part_type(str(kind))!r} is not supported by this model in a {role} message; "
        "send text parts only", param=paths.part(i, j, "type"),
    )


def _local_message(i: int, m: ChatMessage, paths: MessagePaths) -> dict[str, Any]:
    """Message ``i`` as the local engine's chat template takes it: text parts joined, others refused."""
    d = m.model_dump(exclude_none=True)
    if isinstance(d.get("content"), list):
        d["content"] = "".join(_part_text(i, j, m.role, part, paths) for j, part in enumerate(d["content"]))
    return d


@dataclass(frozen=True)
class Unsupported:
    """A request field the local engine cannot honour: refused with ``hint`` unless its value is
    absent (None) or one of ``harmless`` (the field's default: it asks for nothing different)."""

    hint: str
    harmless: tuple[object, ...] = ()

    def refuses(self, value: object) -> bool:
        # the type too: True == 1 in Python, but ``min_tokens: true`` is not the default 0
        return value is not None and not any(type(value) is type(h) and value == h for h in self.harmless)


_GUIDED = "use response_format (json_schema) or tools"
# vLLM's sampling extras the local engine honours (fields of schemas._Common): a door that translates its
# own body into a chat request (/v1/responses) carries them over with the ones refused below.
HONOURED_VLLM_EXTRAS = ("top_k", "stop_token_ids", "ignore_eos", "min_p", "repetition_penalty", "min_tokens")
# OpenAI and vLLM request fields outside the schema models that the local engine cannot honour: each
# gets a 400 naming it (with what to use instead), never a silent drop. Bookkeeping fields that change
# nothing about the output (metadata, store, service_tier, prompt_cache_key, priority...) are tolerated.
UNSUPPORTED_LOCAL_EXTRAS: dict[str, Unsupported] = {
    "functions": Unsupported("use tools"),
    "function_call": Unsupported("use tool_choice"),
    "audio": Unsupported("this model outputs text only"),
    "prediction": Unsupported("predicted outputs are not supported"),
    "reasoning_effort": Unsupported("this model does not reason in a separate channel"),
    "web_search_options": Unsupported("web search is not available"),
    # vLLM's extras (sent through extra_body): top_k, stop_token_ids, ignore_eos, min_p,
    # repetition_penalty and min_tokens are honoured (schemas._Common); these would change the output
    # and are not implemented.
    "guided_json": Unsupported(_GUIDED),
    "guided_regex": Unsupported(_GUIDED),
    "guided_choice": Unsupported(_GUIDED),
    "guided_grammar": Unsupported(_GUIDED),
    "structured_outputs": Unsupported(_GUIDED),
    "use_beam_search": Unsupported("beam search is not available", harmless=(False,)),
    "length_penalty": Unsupported("beam search is not available", harmless=(1, 1.0)),
    "bad_words": Unsupported("use logit_bias", harmless=([],)),
    "allowed_token_ids": Unsupported("use logit_bias"),
    "logits_processors": Unsupported("omit it"),
    "include_stop_str_in_output": Unsupported("omit it", harmless=(False,)),
    "skip_special_tokens": Unsupported("special tokens are always skipped", harmless=(True,)),
    "spaces_between_special_tokens": Unsupported("omit it", harmless=(True,)),
    "truncate_prompt_tokens": Unsupported("shorten the prompt"),
    "prompt_logprobs": Unsupported("on /v1/completions send echo: true with logprobs"),
    "chat_template": Unsupported("the model's own chat template is used"),
    "chat_template_kwargs": Unsupported("the model's own chat template is used"),
    "add_generation_prompt": Unsupported("omit it", harmless=(True,)),
    "continue_final_message": Unsupported("omit it", harmless=(False,)),
    "add_special_tokens": Unsupported("omit it", harmless=(False,)),
}


def refuse_verbosity(verbosity: object, param: str) -> None:
    """OpenAI's ``verbosity`` (chat) and ``text.verbosity`` (/v1/responses): this model writes as it
    writes, which is what "medium", the default, asks for; "low" or "high" would be silently ignored."""
    if verbosity is not None and verbosity != "medium":
        raise unsupported_value(f"{param}: only 'medium' (the default) is supported", param)


def _reject_unsupported_local(req: ChatCompletionRequest | CompletionRequest) -> None:
    """Parameters the local engine cannot honour get a 400 naming them (never a silent drop), with
    OpenAI's code: ``unsupported_parameter``, or ``unsupported_value`` for a value of one it honours."""
    extras = req.model_extra or {}
    for name, unsupported in UNSUPPORTED_LOCAL_EXTRAS.items():
        if unsupported.refuses(extras.get(name)):
            raise unsupported_parameter(f"{name} is not supported by this model: {unsupported.hint}", name)
    modalities = extras.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise unsupported_value("modalities: this model outputs text only; send [\"text\"] or omit it", "modalities")
    if isinstance(req, ChatCompletionRequest):
        if req.echo:  # completions' field (OpenAI has none on chat; vLLM's repeats the last message)
            raise unsupported_parameter("echo is not supported on chat completions; use /v1/completions", "echo")
        refuse_verbosity(extras.get("verbosity"), "verbosity")
        return
    if req.suffix:
        raise unsupported_parameter("suffix is not supported by this model", "suffix")
    if req.best_of not in (None, 1, req.n):
        raise unsupported_value("best_of is not supported by this model other than 1 or equal to n", "best_of")


_MAX_LOGIT_BIAS = 1024  # entries; each is a tensor write per step


@dataclass(frozen=True)
class LocalFeatures:
    """What a request asks of the local engine beyond plain sampling (all validated)."""

    tools: ToolPlan
    guided: GuidedSpec | None
    logprobs: int | None
    logit_bias: tuple[tuple[int, float], ...]
    # completions' echo with logprobs: the prompt is scored too (its top-k as logprobs asks)
    prompt_logprobs: int | None = None


# A token id as a JSON object key: ASCII digits, no sign, no leading zero. Python's int() also takes
# " 12 ", "1_0", "+5", "012" and other scripts' digits; each is then a second spelling of a token id,
# so two keys could name one token and one bias would silently replace the other.
_TOKEN_ID_KEY = re.compile(r"0|[1-9][0-9]*")


def _logit_bias(raw: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    if not raw:
        return ()
    if len(raw) > _MAX_LOGIT_BIAS:
        raise invalid_request(f"logit_bias accepts at most {_MAX_LOGIT_BIAS} tokens", param="logit_bias")
    out = []
    for key, bias in raw.items():
        if not _TOKEN_ID_KEY.fullmatch(key):
            raise invalid_request(
                f"logit_bias keys must be token ids: non-negative integers in decimal digits, without a sign, "
                f"spaces or leading zeros; got {key!r}", param="logit_bias", code="invalid_value")
        token = int(key)
        if not -100.0 <= bias <= 100.0:
            raise invalid_request(f"logit_bias values must be in [-100, 100], got {bias}", param="logit_bias")
        out.append((token, float(bias)))
    return tuple(sorted(out))


def local_features(req: ChatCompletionRequest | CompletionRequest,
                   response_format: str = "response_format") -> LocalFeatures:
    """Tools, structured output, logprobs and logit_bias as the engine takes them. 400s name the field
    (``response_format``: what the client's API calls it, ``text.format`` on /v1/responses)."""
    bias = _logit_bias(req.logit_bias)
    guided = guided_for_response_format(req.response_format, response_format)
    if isinstance(req, CompletionRequest):  # a raw prompt: no tools; JSON forced from its first token
        _refuse_ignore_eos_with(guided, req.ignore_eos)
        _refuse_min_tokens_with(guided, req.min_tokens)
        prompt_logprobs = req.logprobs if req.echo else None
        return LocalFeatures(ToolPlan(tools=None, parse=False, guided=None), guided, req.logprobs, bias, prompt_logprobs)
    if req.top_logprobs is not None and not req.logprobs:
        raise invalid_request("top_logprobs requires logprobs to be true", param="top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    tools = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
    if guided is not None and tools.guided is not None:
        raise invalid_request(
            "response_format json_object/json_schema cannot be combined with tool_choice 'required' or a "
            "named function: the output is either a tool call or JSON content", param="response_format")
    if guided is not None:  # JSON content is forced, so no tool call can appear in it
        tools = ToolPlan(tools=tools.tools, parse=False, guided=None)
    grammar = guided or tools.guided
    _refuse_ignore_eos_with(grammar, req.ignore_eos)
    _refuse_min_tokens_with(grammar, req.min_tokens)
    return LocalFeatures(tools, grammar, logprobs, bias)


def _refuse_ignore_eos_with(grammar: GuidedSpec | None, ignore_eos: bool) -> None:
    """A grammar's last token is EOS (the value, or the call, is complete): it cannot go on past it."""
    if grammar is not None and ignore_eos:
        raise invalid_request(
            "ignore_eos cannot be combined with response_format json_object/json_schema or a forced tool call: "
            "the grammar ends the output with EOS", param="ignore_eos")


def _refuse_min_tokens_with(grammar: GuidedSpec | None, min_tokens: int | None) -> None:
    """A grammar may end its output at any length with EOS, which min_tokens would forbid."""
    if grammar is not None and min_tokens:
        raise invalid_request(
            "min_tokens cannot be combined with response_format json_object/json_schema or a forced tool call: "
            "the grammar ends the output with EOS", param="min_tokens")


def _charge_rejected(tenancy: TenancyPort, scoped: TenantCtx) -> None:
    """A request refused before admission still takes its place in the rate limit (issue 16.9), so
    that an over-limit tenant cannot make the gateway validate huge bodies for free."""
    with contextlib.suppress(QuotaExceededError):  # already over: the refusal stands as it is
        tenancy.admit(scoped, estimated_tokens=0)


def _check_size(req: ChatCompletionRequest | CompletionRequest, settings: GatewaySettings, prompts: int,
                text_chars: int, param: str) -> None:
    """The work a request asks for, bounded before any of it is done (issue 16.2); ``param`` is the
    prompt's field as the client named it (``messages``, ``prompt``, or a door's own, ``input``)."""
    if req.n > settings.max_n:
        raise invalid_request(f"n must be at most {settings.max_n}, got {req.n}", param="n",
                              code="integer_above_max_value")
    if prompts > settings.max_prompts:
        raise invalid_request(f"at most {settings.max_prompts} prompts per request, got {prompts}", param=param,
                              code="array_above_max_length")
    if prompts * req.n > settings.max_choices:
        raise invalid_request(
            f"prompts x n must be at most {settings.max_choices}, got {prompts} x {req.n}", param="n",
            code="integer_above_max_value")
    check_prompt_chars(text_chars, req.token_ids, settings.max_prompt_chars, param)


def _retention_asked(req: ChatCompletionRequest | CompletionRequest) -> float | None:
    """Seconds to keep the whole prompt cached, from OpenAI's ``prompt_cache_retention`` (chat, and
    /v1/responses, which runs as chat): None for none asked or ``"in_memory"`` (the default policy).
    Legacy completions has no such field, at OpenAI as here: there it is an unknown field, ignored."""
    if not isinstance(req, ChatCompletionRequest):
        return None
    try:
        return retention_seconds(req.prompt_cache_retention)
    except CacheControlError as exc:
        raise invalid_request(str(exc), param=exc.param, code="invalid_value") from None


def _check_stream_options(req: ChatCompletionRequest | CompletionRequest) -> None:
    """``stream_options`` only on a stream, as OpenAI and vLLM refuse it (in their words): on a whole
    response its ``include_usage`` would ask for a usage chunk that never comes."""
    if req.stream_options is not None and not req.stream:
        raise invalid_request("The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                              param="stream_options", code="invalid_value")


def check_prompt_chars(text_chars: int, token_ids: int, max_prompt_chars: int, param: str) -> None:
    """The bound on a body's text (``max_prompt_chars``, each token id counting as CHARS_PER_TOKEN
    characters): a 400 ``request_too_large`` naming ``param``. The chat pipeline checks it on the
    body it runs; a door checks it on its own body first, before translating it (``door.translated``)."""
    if text_chars + CHARS_PER_TOKEN * token_ids > max_prompt_chars:
        ids = f" and {token_ids} token ids ({CHARS_PER_TOKEN} characters each)" if token_ids else ""
        raise invalid_request(
            f"the request holds {text_chars} characters of text{ids}; the limit is {max_prompt_chars}",
            param=param, code="request_too_large")


# Characters a token stands for in the bounds and the admission estimate (as for providers): a token
# id in a prompt counts as this much text against max_prompt_chars, and as one token in the estimate.
CHARS_PER_TOKEN = 4


# A body with more characters of text than this has its whole-body steps in ``prepare`` (the dump,
# canonicalization, the engine's messages, the miss tracker's render) run in the tenant's worker
# thread; below it they run inline: a thread hop costs more than the work (~1 ms at 64k characters).
_INLINE_CHARS = 65_536


async def _sized(large: bool, threads: TenantThreads, tenant_id: str, fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)``: in the tenant's worker thread for a ``large`` body, inline for a small one.
    A dump of 3 MB of small parts is ~15 ms of C that holds the GIL: on the event loop every other
    tenant's stream waited for it (the DoS audit's many-small-strings bodies)."""
    if large:
        return await threads.run(tenant_id, fn, *args)
    return fn(*args)


def _canonical(req: ChatCompletionRequest | CompletionRequest, mode: CanonMode,
               per_user_vars: Sequence[str]) -> CanonResult:
    """The body as the backend will see it: the request dumped, the client's salt dropped, canonicalized."""
    body = req.model_dump(exclude_unset=True)
    body.pop("cache_salt", None)  # the namespace is server-derived; a client salt is ignored
    return canonicalize(body, mode, per_user_vars)


def _chat_inputs(req: ChatCompletionRequest, canonical: dict[str, Any], features: LocalFeatures | None,
                 paths: MessagePaths) -> list[dict[str, Any]]:
    """The one prompt of a chat request as the backend takes it: a provider the canonical body's
    messages as sent, the local engine the validated messages with their text parts joined."""
    if features is None:
        return [{"messages": [provider_message(m) for m in canonical["messages"]], "tools": canonical.get("tools")}]
    messages = [_local_message(i, m, paths) for i, m in enumerate(req.messages)]
    return [{"messages": messages, "tools": features.tools.tools}]


async def _tokenize(threads: TenantThreads, tenant_id: str, engine: EngineClient,
                    requests: list[GenerateRequest], prompt: str) -> list[list[int]]:
    """Tokenize through the engine's chat template; a prompt it cannot render is the client's error,
    naming its field as the client's API calls it (``prompt``: ``messages``, ``input``)."""
    try:
        return await threads.run(tenant_id, _tokenize_all, engine, requests)
    except (EngineError, OpenAIError):  # the engine's own errors; the pool's 429 (too many waiting)
        raise
    except Exception as exc:  # noqa: BLE001 - template/tokenizer errors carry the useful message
        raise invalid_request(
            f"the model's chat template could not render this request: {exc}", param=prompt,
        ) from None


async def prepare(
    kind: str,
    req: ChatCompletionRequest | CompletionRequest,
    ctx: TenantCtx,
    *,
    tenancy: TenancyPort,
    router: Router,
    engine: EngineClient | None,
    settings: GatewaySettings,
    threads: TenantThreads,
    tracker: MissTracker | None = None,
    fields: RequestFields | None = None,
) -> Prepared:
    """Bound, admit, canonicalize, route and size a request. Raises ``OpenAIError``.

    ``fields``: what the client's API calls the prompt and the output budget (a door's own names,
    e.g. the Responses API's ``input``/``max_output_tokens``); by default chat's or completions'.

    Order matters: everything before ``tenancy.admit`` is O(1) or already bounded by the body
    size; tokenization (seconds for a long prompt) runs after admission, off the event loop.
    With a ``tracker``, an admitted chat request is compared with its family's recent requests
    (the canonical body, as the backend will see it) to explain a cache break.
    """
    fields = fields or (CHAT_FIELDS if kind == "chat" else COMPLETION_FIELDS)
    scoped = tenancy.scope_for(ctx, req.user)
    prompts = req.prompts() if isinstance(req, CompletionRequest) else []
    max_tokens_asked = req.effective_max_tokens()
    text_chars = req.text_chars  # read once: a pydantic private attribute is a Python-level __getattr__
    try:
        _check_stream_options(req)
        retain_s = _retention_asked(req)
        _check_size(req, settings, len(prompts) or 1, text_chars, fields.prompt)
        if isinstance(req, CompletionRequest) and not prompts:
            raise invalid_request("prompt must not be empty", param="prompt", code="empty_prompt")  # as the engine's
    except OpenAIError:
        _charge_rejected(tenancy, scoped)
        raise
    choices = (len(prompts) or 1) * req.n
    # Admission before any costly work, on an estimate (~4 characters a token, as for providers);
    # the ledger row records the real counts.
    output_budget = settings.default_max_tokens if max_tokens_asked is None else max_tokens_asked
    estimated = text_chars // CHARS_PER_TOKEN + req.token_ids + output_budget * choices
    try:
        tenancy.admit(scoped, estimated_tokens=estimated)
    except QuotaExceededError as exc:
        raise quota_error(exc) from None

    # Chat bodies only: a raw completions prompt is opaque text that no transform may reorder.
    mode: CanonMode = scoped.canon_mode if kind == "chat" else "off"
    per_user_vars = scoped.per_user_vars
    large = text_chars > _INLINE_CHARS  # reorder's regexes, and every step below that walks the body
    tid = scoped.tenant_id
    canon = await _sized(large, threads, tid, _canonical, req, mode, per_user_vars)
    backend = router.resolve(req.model, engine, scoped.namespace, canon.body)
    if canon.applied and isinstance(req, ChatCompletionRequest) and not backend.takes_openai_fields:
        # The local engine reads the validated fields; a provider takes the canonical body's own dicts.
        req = await _sized(large, threads, tid, _with_canonical_fields, req, canon.body)
    stops = req.stop_list()
    extra: dict[str, object] = {}
    body_extras: dict[str, object] = {}
    features: LocalFeatures | None = None
    if backend.takes_openai_fields:
        # From the canonical body: canon's rewrites (a response_format schema's key order) reach the provider.
        extra = {k: canon.body[k] for k in _PROVIDER_PASSTHROUGH if k in canon.body}
        body_extras = {k: canon.body[k] for k in HONOURED_VLLM_EXTRAS if canon.body.get(k) is not None}
        if isinstance(req, CompletionRequest) and req.echo and req.logprobs is not None:
            # the gateway echoes the prompt's text itself; its logprobs only an engine here can score
            raise unsupported_value("echo with logprobs needs the prompt scored, which this model's provider route "
                                    "does not return; send echo without logprobs, or use a local model", "echo")
    else:
        _reject_unsupported_local(req)
        features = local_features(req, fields.response_format)

    request_id = new_request_id(kind)
    inputs: list[dict[str, Any]]
    if isinstance(req, ChatCompletionRequest):
        inputs = await _sized(large, threads, tid, _chat_inputs, req, canon.body, features, fields.messages)
    else:
        inputs = [{"prompt": p} if isinstance(p, str) else {"prompt_token_ids": list(p)} for p in req.prompts()]

    asked = req.effective_max_tokens()
    if req.min_tokens and asked is not None and req.min_tokens > asked:  # a defaulted budget clamps it below
        raise invalid_request(f"min_tokens ({req.min_tokens}) must be at most max_tokens ({asked})",
                              param="min_tokens", code="invalid_value")
    max_len = router.max_model_len(backend) if backend.tokenizes_here else None
    prompt_counts: list[int] = []
    if backend.tokenizes_here:
        probe = SamplingParams(max_tokens=1)
        probes = [GenerateRequest(request_id=request_id, tenant=scoped, sampling=probe, model=backend.target_model,
                                  **inp) for inp in inputs]
        if max_len:  # token ids need no tokenizer: a list longer than the context fails without one
            for inp in inputs:
                ids = inp.get("prompt_token_ids")
                if ids is not None and len(ids) > max_len - _least_output(asked):
                    raise _prompt_too_long(max_len, len(ids), fields)
        # Tokenized once: the engine gets the ids and skips its own tokenization (issue 17).
        token_ids = await _tokenize(threads, scoped.tenant_id, backend.client, probes, fields.prompt)
        prompt_counts = [len(ids) for ids in token_ids]
        inputs = [{"prompt_token_ids": ids} for ids in token_ids]
        if backend.tokenizer_here and token_ids:
            # A node pool tokenized here: pick its node on the block chain the nodes will cache.
            backend = router.resolve(req.model, engine, scoped.namespace, canon.body, token_ids=token_ids[0])
    longest = max(prompt_counts, default=0)
    if max_len:
        room = max_len - longest
        if room < _least_output(asked):
            raise _prompt_too_long(max_len, longest, fields)
        if asked is None:
            asked = min(settings.default_max_tokens, room)
        elif asked > room:
            raise _output_too_long(max_len, longest, asked, fields)
    max_tokens = settings.default_max_tokens if asked is None else asked  # 0: echo's prompt alone

    temperature = effective_temperature(1.0 if req.temperature is None else req.temperature)
    requests: list[GenerateRequest] = []
    for p, inp in enumerate(inputs):
        for i in range(req.n):
            try:
                sampling = SamplingParams(
                    max_tokens=max_tokens,
                    temperature=temperature,
                    top_p=1.0 if req.top_p is None else req.top_p,
                    top_k=max(0, req.top_k or 0),  # vLLM's -1 = off, the engine's 0
                    seed=None if req.seed is None else req.seed + i,  # n samples must differ
                    stop=stops,
                    stop_token_ids=tuple(req.stop_token_ids or ()),
                    ignore_eos=req.ignore_eos,
                    logit_bias=features.logit_bias if features else (),
                    logprobs=features.logprobs if features else None,
                    guided=features.guided if features else None,
                    presence_penalty=req.presence_penalty or 0.0,
                    frequency_penalty=req.frequency_penalty or 0.0,
                    repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                    min_p=req.min_p or 0.0,
                    min_tokens=min(req.min_tokens or 0, max_tokens),
                    prompt_logprobs=features.prompt_logprobs if features else None,
                )
            except ValueError as exc:
                raise invalid_request(str(exc)) from None
            rid = f"{request_id}-{p}-{i}"
            model = backend.target_model or None
            if backend.takes_openai_fields:  # the same generate() call, with what only a provider reads
                requests.append(UpstreamRequest(request_id=rid, tenant=scoped, sampling=sampling, model=model,
                                                passthrough=extra, body_extras=body_extras, incremental=req.stream,
                                                tenant_name=scoped.name, **inp))
            else:
                requests.append(GenerateRequest(request_id=rid, tenant=scoped, sampling=sampling, model=model, **inp))

    # Explicit cache control: the request's own (prompt_cache_retention), then the tenant's (#24.3).
    keep = tuple(seconds for seconds in (retain_s, scoped.cache_retention_s) if seconds)
    if keep and backend.honours_retention:
        requests = [replace(r, retention=tuple(Retention(len(r.prompt_token_ids or ()), s) for s in keep))
                    for r in requests]

    miss = None
    if tracker is not None and kind == "chat":
        ids = inputs[0].get("prompt_token_ids") if backend.tokenizes_here else None  # the cache's own tokens
        observe = partial(tracker.observe, token_ids=ids, per_user_vars=tuple(per_user_vars))
        miss = await _sized(large, threads, tid, observe, scoped.tenant_id, canon.body)  # renders the prompt
    echo = None
    if isinstance(req, CompletionRequest) and req.echo:
        echo = await _echo_texts(threads, tid, backend.client, req.prompts(), fields)
    opts = req.stream_options
    return Prepared(
        kind=kind, request_id=request_id, created=now(), model=req.model, backend=backend, requests=requests,
        n=req.n, stream=req.stream, include_usage=bool(req.stream and opts and opts.include_usage),
        canon_applied=canon.applied, tenant=scoped, miss_tracker=tracker, miss=miss,
        tool_parsing=bool(features and features.tools.parse), logprobs=features.logprobs if features else None,
        price_as=_route_price(router, req.model), block_size=settings.block_size, fields=fields, echo=echo,
    )


# Request ids are cut from one os.urandom read of this many ids: os.urandom releases the GIL on every
# call, and with the ledger writer thread runnable the request then waited for it (issue #17).
_IDS_PER_READ = 256


def _id_batch() -> Iterator[str]:
    """``_IDS_PER_READ`` ids of 128 random bits each, as 32 hex digits, from one ``os.urandom`` call."""
    digits = os.urandom(16 * _IDS_PER_READ).hex()
    return iter([digits[i:i + 32] for i in range(0, len(digits), 32)])


_ids: Iterator[str] = iter(())


def _forget_ids() -> None:
    """In a forked child: the parent's unread ids are the parent's (both would hand them out)."""
    global _ids
    _ids = iter(())


os.register_at_fork(after_in_child=_forget_ids)


def new_request_id(kind: str) -> str:
    """``chatcmpl-`` / ``cmpl-`` + 128 random bits as 32 hex digits (OpenAI's shape), as unique and
    unpredictable as one ``os.urandom(16)`` each. ``next`` on a list iterator is one C call, so
    two threads never get the same id; two that find the batch empty each read a fresh one."""
    global _ids
    digits = next(_ids, None)
    if digits is None:
        batch = _ids = _id_batch()
        digits = next(batch)
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + digits


async def _echo_texts(threads: TenantThreads, tenant_id: str, client: EngineClient,
                      prompts: Sequence[str | list[int]], fields: RequestFields) -> tuple[str, ...]:
    """Each prompt's text as echo returns it: the client's own text, or token ids decoded by the
    engine (special tokens included, as vLLM echoes them), off the event loop."""
    if all(isinstance(p, str) for p in prompts):
        return tuple(p for p in prompts if isinstance(p, str))
    if not isinstance(client, PromptDecoder):
        raise unsupported_value("echo of a token-id prompt needs the model's tokenizer, which this route does not "
                                "have here; send the prompt as text", "echo")

    def decode_all() -> tuple[str, ...]:
        return tuple(p if isinstance(p, str) else client.decode_prompt(p) for p in prompts)

    try:
        return await threads.run(tenant_id, decode_all)
    except EngineError as exc:  # an id outside the vocabulary: the prompt's 400, as the engine gives it
        raise engine_failure(exc, fields) from None


def _with_canonical_fields(req: ChatCompletionRequest, canonical: dict[str, Any]) -> ChatCompletionRequest:
    """``req`` with the fields canonicalization rewrites (messages, tools, response_format) taken
    from ``canonical``: those validated on their own, not the whole body parsed (and scanned at
    ingress) a second time, which cost ~90 us of every canonicalized request."""
    update: dict[str, object] = {"messages": [ChatMessage.model_validate(m) for m in canonical["messages"]]}
    for name in ("tools", "response_format"):
        if name in canonical:
            update[name] = canonical[name]
    return req.model_copy(update=update)


def _route_price(router: Router, model: str) -> str | None:
    """The configured route's ``price`` ("unpriced", a cost-map name), None for the model's own."""
    route = router.routes.get(model)
    price = route.extra.get("price") if route is not None else None
    return price if isinstance(price, str) else None


def _tokenize_all(engine: EngineClient, requests: list[GenerateRequest]) -> list[list[int]]:
    return [engine.tokenize(r) for r in requests]


def _least_output(asked: int | None) -> int:
    """Context a request must leave after its prompt: none for ``max_tokens: 0`` (echo's prompt scored
    alone, which lm-eval-harness sends at the full context; the engine's own check is prompt + max_tokens
    <= max_model_len), one token for anything that generates."""
    return 0 if asked == 0 else 1


def _prompt_too_long(max_len: int, prompt: int, fields: RequestFields) -> OpenAIError:
    """The prompt alone fills the context (whatever the output budget)."""
    return OpenAIError(
        400,
        f"This model's maximum context length is {max_len} tokens. However, your {fields.prompt} resulted in "
        f"{prompt} tokens, which leaves no room for the output. Please reduce the length of the {fields.prompt}.",
        code="context_length_exceeded", param=fields.prompt,
    )


def _output_too_long(max_len: int, prompt: int, asked: int, fields: RequestFields) -> OpenAIError:
    """The prompt fits, but not with the output budget the client asked for."""
    return OpenAIError(
        400,
        f"This model's maximum context length is {max_len} tokens. However, you requested "
        f"{prompt + asked} tokens ({prompt} in the {fields.prompt}, {asked} in {fields.max_tokens}). "
        f"Please reduce the length of the {fields.prompt} or {fields.max_tokens}.",
        code="context_length_exceeded", param=fields.overflow,
    )


# Told, for each choice aborted before it finished, how far its engine got with the prompt.
AbortSink = Callable[[int, AbortReport | None], None]


def run_choices(prep: Prepared, router: Router, *, one_task: bool = False, on_abort: AbortSink | None = None
                ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Run every choice concurrently and yield ``(choice_index, output)`` as they arrive.

    An ``EngineError`` from any choice propagates. However the consumer stops (finished, error,
    client disconnect = cancellation), every unfinished engine request is cancelled and aborted,
    which frees its KV blocks; ``on_abort`` (``Accounting.aborted``) gets each one's ``AbortReport``
    before the generator closes, so the ledger row bills a prefill that ran but never answered.

    ``one_task``: the consumer iterates this generator from one task only; then a single choice
    runs in that task (``_run_one``) instead of in a pump task feeding a queue. A backend's
    generator may hold anyio cancel scopes (httpx), which must be left in the task that entered them.

    Returns the async generator that does the work (``_run_one`` or ``_run_all``) rather than being
    one that re-yields it: a generator layer costs Python calls per output and per request (issue #17).
    """
    if one_task and len(prep.requests) == 1:
        return _run_one(prep, router, on_abort)
    return _run_all(prep, router, on_abort)


def _node_failed(prep: Prepared, router: Router, backend: Backend, exc: NodeFailure, started: bool) -> Backend | None:
    """Record ``backend``'s failure and pick where the request goes now: another node of the pool
    when nothing was generated yet, else None (the caller raises ``exc.for_tenant``)."""
    router.record_failure(prep.model, backend, exc.fault, str(exc))
    return None if started else router.failover(prep.model, backend, exc.fault)


def _move(prep: Prepared, alternative: Backend) -> None:
    """The request now runs on ``alternative``: the in-flight count, the ``x-prefixgate-backend``
    header, the ledger row and the metrics follow it (they read ``prep.backend``)."""
    prep.backend.inflight -= 1
    alternative.inflight += 1
    prep.backend = alternative


async def _run_all(prep: Prepared, router: Router, on_abort: AbortSink | None = None
                   ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """``run_choices`` for any number of choices: one pump task each, merged through a queue."""
    used: dict[int, Backend] = {}  # the backend each choice ended on (after any failover)
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()
    finished: set[int] = set()

    async def pump(i: int, gr: GenerateRequest) -> None:
        backend = prep.backend
        while True:
            used[i] = backend
            started = False
            try:
                async for out in backend.client.generate(gr):
                    started = True
                    await queue.put((i, out))
            except asyncio.CancelledError:
                raise
            except NodeFailure as exc:
                # Nothing was generated yet: another node of the pool can take the request.
                alternative = _node_failed(prep, router, backend, exc, started)
                if alternative is None:
                    await queue.put((i, exc.for_tenant(backend.name)))
                    return
                if prep.backend is backend:
                    _move(prep, alternative)
                backend = alternative
                continue
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which re-raises
                await queue.put((i, exc))
                return
            router.record_success(backend)
            await queue.put((i, None))
            return

    prep.backend.inflight += 1  # Router.track, on whichever node ends up serving (``_move``)
    try:
        tasks = [asyncio.create_task(pump(i, gr)) for i, gr in enumerate(prep.requests)]
        done = 0
        try:
            while done < len(tasks):
                i, item = await queue.get()
                if item is None:
                    done += 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    finished.add(i)
                yield i, item
        finally:
            # Shielded: under a cancelled anyio scope (client gone) every await would re-raise, and
            # the abort must still reach the engine to free the request's KV blocks.
            with anyio.CancelScope(shield=True):
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                unfinished = [i for i in range(len(prep.requests)) if i not in finished]
                reports = await asyncio.gather(*(used.get(i, prep.backend).client.abort(prep.requests[i].request_id)
                                                 for i in unfinished))
            if on_abort is not None:
                for i, report in zip(unfinished, reports):
                    on_abort(i, report)
    finally:
        prep.backend.inflight -= 1


async def _run_one(prep: Prepared, router: Router, on_abort: AbortSink | None = None
                   ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """``run_choices`` for one choice, in the caller's task: same failover, same abort on leaving.

    ``Router.track`` and ``aclosing`` are written out (try/finally): as context managers they cost
    nine Python calls a request (issue #17); the order of the exits is theirs. The in-flight count
    moves with a failover (``_move``)."""
    gr = prep.requests[0]
    backend = prep.backend
    finished = False
    backend.inflight += 1  # Router.track: in flight on the backend that serves the request
    try:
        try:
            while True:
                started = False
                outputs = backend.client.generate(gr)
                try:
                    try:
                        async for out in outputs:
                            started = True
                            finished = finished or out.finished
                            yield 0, out
                    finally:
                        await outputs.aclose()  # aclosing's exit: before the failover and before the abort
                    router.record_success(backend)
                    return
                except NodeFailure as exc:
                    # Nothing was generated yet: another node of the pool can take the request.
                    alternative = _node_failed(prep, router, backend, exc, started)
                    if alternative is None:
                        raise exc.for_tenant(backend.name) from exc
                    _move(prep, alternative)
                    backend = alternative
        finally:
            if not finished:  # shielded, as in run_choices: the abort must reach the engine
                with anyio.CancelScope(shield=True):
                    report = await backend.client.abort(gr.request_id)
                if on_abort is not None:
                    on_abort(0, report)
    finally:
        prep.backend.inflight -= 1


class Accounting:
    """Collects final outputs and writes exactly one ledger row per HTTP request."""

    def __init__(self, prep: Prepared, tenancy: TenancyPort, metrics: GatewayMetrics, live: LiveStats) -> None:
        self.prep = prep
        self.tenancy = tenancy
        self.metrics = metrics
        self.live = live
        self.arrived_at = time.time()  # the ledger row's created_at: when the request arrived
        self.start = time.perf_counter()
        self.ttft: float | None = None
        self.last: dict[int, RequestOutput] = {}
        self.completion_seen: dict[int, int] = {}
        # Choices aborted before they finished: how far their engine got (None: it cannot tell).
        self.stopped: dict[int, AbortReport | None] = {}
        self.recorded = False
        self.settled = False
        # Prompt tokens written to a prompt cache, from (prompt, cached): what a provider reported,
        # else what the local engine wrote under an explicit retention, unless a door knows better
        # (/v1/messages' breakpoints).
        self.cache_writes: Callable[[int, int], int] = self.default_cache_writes

    def default_cache_writes(self, prompt: int, cached: int) -> int:
        """Anthropic's cache_creation_input_tokens through a provider route (once per prompt); for
        the local engine, the full blocks of a prompt under explicit retention (OpenAI's
        ``prompt_cache_retention``, the tenant's setting) that it did not read from the cache."""
        written, provider = 0, False  # one loop, not any() and sum() over generators (issue #17)
        for i, out in self.last.items():
            if isinstance(out, ProviderOutput):
                provider = True
                if i % self.prep.n == 0:
                    written += out.cache_creation_tokens
        if provider:
            return max(0, min(written, prompt - cached))
        return self.retained_writes(prompt, cached)

    def retained_writes(self, prompt: int, cached: int) -> int:
        """Summed over prompts (choice 0 of each): the retained span's full blocks, minus the prompt's
        cached tokens. Without a retention the engine caches too, but nobody asked for a write."""
        block = max(1, self.prep.block_size)
        written = 0
        for i, (prompt_i, cached_i) in self._prompts(client_left=True).items():
            if i >= len(self.prep.requests):
                continue
            keep = max((r.tokens for r in self.prep.requests[i].retention), default=0)
            upto = min(keep, prompt_i) // block * block
            written += max(0, upto - cached_i)
        return max(0, min(written, prompt - cached))

    def observe(self, i: int, out: RequestOutput) -> None:
        if self.ttft is None and (out.new_text or out.new_token_ids or out.finished):
            self.ttft = time.perf_counter() - self.start
        self.last[i] = out
        self.completion_seen[i] = max(self.completion_seen.get(i, 0), out.completion_tokens)

    def aborted(self, i: int, report: AbortReport | None) -> None:
        """``run_choices``' ``on_abort``: choice ``i`` stopped unfinished, its engine's report."""
        self.stopped[i] = report

    def _prompts(self, *, client_left: bool) -> dict[int, tuple[int, int]]:
        """(prompt, cached) tokens of choice 0 of each prompt: from its last output, else, for a
        choice aborted before its first output, from how far its prefill got (``AbortReport``: the
        engine's own count, exact to the step and split into cached and computed). A backend that
        cannot tell (a node, a provider) bills, when the client left, the prompt tokens counted here
        at preparation with none cached: the prefill may well have run, and nothing says what it hit.
        That holds too for a choice whose outputs so far reported no prompt (a provider reports usage
        only at its stream's end): a prompt is never empty, so 0 means not reported yet."""
        rows = {i: (out.prompt_tokens, out.cached_tokens) for i, out in self.last.items() if i % self.prep.n == 0}
        for i, report in self.stopped.items():
            if i % self.prep.n or rows.get(i, (0, 0))[0] > 0:
                continue
            if report is not None:
                rows[i] = (report.prefilled_tokens, report.cached_tokens)
            elif client_left and i < len(self.prep.requests):
                rows[i] = (len(self.prep.requests[i].prompt_token_ids or ()), 0)
        return rows

    def usage(self, *, client_left: bool = False) -> tuple[int, int, int]:
        """Prompt and cached tokens count once per prompt (choice 0 of it); completions add up."""
        prompt = cached = 0
        for prompt_i, cached_i in self._prompts(client_left=client_left).values():
            prompt += prompt_i
            cached += cached_i
        # A provider can report cache reads its prompt count does not cover; never claim more hits than prompt.
        return prompt, min(cached, prompt), sum(self.completion_seen.values())

    def usage_dict(self) -> Usage:
        return usage_dict(*self.usage())

    def settle(self) -> None:
        """Fix the cached tokens and the cache-break explanation of a finished request (once); the
        whole response's headers carry both, so this runs before they are built."""
        if self.settled:
            return
        self.settled = True
        prep = self.prep
        prompt, cached, _ = self.usage()
        prep.cached_tokens = cached
        if prep.miss is not None and prep.miss_tracker is not None:
            prep.miss_record = prep.miss_tracker.settle(
                prep.miss, request_id=prep.request_id, prompt_tokens=prompt, cached_tokens=cached)

    def record(self, status: UsageStatus) -> None:
        """Write the ledger row, metrics and dashboard totals once. A ledger failure is logged with
        the request id, never turned into an error for a response that has already been produced."""
        if self.recorded:
            return
        self.recorded = True
        try:
            self._record(status)
        except Exception:
            log.exception("could not record usage of request %s", self.prep.request_id)

    def _record(self, status: UsageStatus) -> None:
        prep = self.prep
        prompt, cached, completion = self.usage(client_left=status == "aborted")
        latency = time.perf_counter() - self.start
        # The ledger and the price use the model that did the work: for a provider route that is the
        # provider's model (priced from litellm's map), not the alias the client sent.
        model = prep.backend.target_model if prep.backend.takes_openai_fields else prep.model
        written = max(0, min(self.cache_writes(prompt, cached), prompt - cached))
        t = prep.tenant
        prep.cached_tokens = cached
        if status == "ok":
            self.settle()
        # record_usage prices the row and returns that price: the metrics' cost and saving are the
        # ledger's own, priced once (it was priced here and again inside record_usage).
        price = self.tenancy.record_usage(UsageRecord(
            request_id=prep.request_id, tenant_id=t.tenant_id, key_id=t.key_id, model=model,
            backend=prep.backend.label, prompt_tokens=prompt, cached_tokens=cached, completion_tokens=completion,
            ttft_s=self.ttft, latency_s=latency, status=status, created_at=self.arrived_at,
            price_as=prep.price_as, cache_creation_tokens=written, **usage_fields(prep.miss_record),
        ))
        cost, saved = float(price.cost_usd or 0.0), float(price.saved_usd or 0.0)
        label, backend = t.metrics_label, prep.backend.label
        if prep.miss_record is not None:
            self.metrics.cache_breaks.labels(label, prep.miss_record.rule).inc()
        outcome = outcome_of_status(status)
        self.metrics.count(label, backend, status, outcome)
        self.metrics.series(label, backend).add(prompt, cached, completion, cost, saved, latency, self.ttft)
        self.live.add(RequestSample(
            tenant_id=t.tenant_id, tenant=t.name, outcome=outcome, prompt=prompt, cached=cached,
            completion=completion, cost=cost, saved=saved, ttft=self.ttft, latency=latency,
            family=prep.miss.family if prep.miss is not None else None, spill_encrypted=t.cipher is not None))


def engine_failure(exc: BaseException, fields: RequestFields | None = None) -> OpenAIError:
    """An exception from ``run_choices`` as the error the client sees; ``fields``: what the client's
    API calls the request's fields (the prompt: ``messages``, ``prompt``, ``input``)."""
    from gateway.errors import from_engine_error

    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, EngineError):
        return from_engine_error(exc, fields.engine_params() if fields is not None else None)
    return OpenAIError(500, "The server had an error while processing your request.", code="internal_error")
