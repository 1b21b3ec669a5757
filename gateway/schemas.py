"""OpenAI wire format: request models (validated, unknown fields tolerated) and response builders.

Unknown top-level fields are kept (``extra="allow"``) because OpenAI tolerates new fields and
upstream providers may understand them. Every sampling and output field OpenAI defines is either
honoured by the local engine (tools and ``tool_choice``, ``response_format``, ``logprobs`` /
``top_logprobs``, ``logit_bias``, ``presence_penalty`` / ``frequency_penalty``, vLLM's ``top_k`` /
``stop_token_ids`` / ``ignore_eos``, and completions' ``echo`` with prompt logprobs; see
docs/gateway.md) or rejected in ``gateway.pipeline._reject_unsupported_local`` with a 400 that names
the parameter (chat's ``echo``, ``suffix``, ``best_of``, and extra fields such as ``functions``,
``audio``, ``reasoning_effort``, chat's ``verbosity`` other than "medium"): never silently dropped.
Extra fields that change nothing in the output (``service_tier``...) are accepted; chat's ``store``
keeps the completion (``gateway.chat_store``) with its ``metadata``. A chat history is checked as
OpenAI checks it (``_check_history``), whatever the backend.
"""

from __future__ import annotations

import re
import time
from typing import Annotated, Any, Literal, TypedDict

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    field_validator,
    model_validator,
)

from gateway.ingress import ScannedBody, body_limit

# Strings that are stored per request (ledger rows, miss families) or echoed: bounded at ingress so
# that a rejected request cannot store megabytes (issue 16.9). OpenAI caps `user` at 256 too.
MAX_NAME_CHARS = 256
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
# OpenAI's rule for the name of a response format's schema (chat's json_schema.name, the Responses
# API's text.format.name).
SCHEMA_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"


# OpenAI's bounds on ``metadata`` (chat completions and their update, the Responses API): a
# stored object keeps it, and a list route filters on it, so the bounds are checked at ingress.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


def _bounded_metadata(metadata: dict[str, str] | None) -> dict[str, str] | None:
    if metadata is None:
        return None
    if len(metadata) > MAX_METADATA_PAIRS:
        raise body_limit(f"metadata accepts at most {MAX_METADATA_PAIRS} key-value pairs, got {len(metadata)}",
                         "metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise body_limit(f"a metadata key may have at most {MAX_METADATA_KEY_CHARS} characters, "
                             f"got one of {len(key)}", "metadata")
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise body_limit(f"a metadata value may have at most {MAX_METADATA_VALUE_CHARS} characters, "
                             f"got one of {len(value)}", "metadata")
    return metadata


Metadata = Annotated[dict[str, str] | None, AfterValidator(_bounded_metadata)]


# Boolean fields are StrictBool: JSON true or false only. Pydantic's lax mode would read "yes",
# "on", "1" or 0 as booleans, which OpenAI refuses; a client sending them has a bug worth a 400.


def null_means(default: object) -> BeforeValidator:
    """An explicit JSON ``null`` read as the field's default. OpenAI declares ``n``, ``stream``,
    ``echo``, ``store``... nullable, and proxies and serialised clients send ``null`` for "unset";
    the field itself keeps its plain type for every reader."""
    return BeforeValidator(lambda value: default if value is None else value)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: Annotated[StrictBool, null_means(False)] = False


class _Common(ScannedBody):
    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    n: Annotated[int, null_means(1)] = Field(1, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: Annotated[StrictBool, null_means(False)] = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=MAX_NAME_CHARS)
    prompt_cache_key: str | None = Field(None, max_length=MAX_NAME_CHARS)
    logprobs: Any = None  # chat: bool; completions: int 0..5 (the subclasses narrow it)
    logit_bias: dict[str, float] | None = None  # token id (as a string key) -> bias in [-100, 100]
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    # vLLM's sampling extras that the engine honours (engine.protocol.SamplingParams): top_k (-1 or
    # 0 = off), stop_token_ids (each ends the output, as EOS does), ignore_eos (generate past EOS),
    # min_p (0 = off), repetition_penalty (1 = off), min_tokens (EOS, stop tokens and stop strings
    # held back until that many tokens are out).
    top_k: int | None = Field(None, ge=-1)
    stop_token_ids: list[int] | None = None
    ignore_eos: Annotated[StrictBool, null_means(False)] = False
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, allow_inf_nan=False)
    min_tokens: int | None = Field(None, ge=0)
    # Completions: the prompt before the completion (and its logprobs, with logprobs). Chat has no echo
    # at OpenAI and refuses it (pipeline._reject_unsupported_local); a field here, on chat too, so that
    # it is read as a JSON boolean as on completions ("yes" is a 400).
    echo: Annotated[StrictBool, null_means(False)] = False
    # JSON output enforced while decoding (gateway.structured_output): OpenAI's chat field, which vLLM
    # takes on completions too; a raw prompt is constrained as a chat prompt is.
    response_format: dict[str, Any] | None = None

    @field_validator("stop")
    @classmethod
    def _short_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        """Empty stop strings are dropped, as OpenAI and vLLM ignore them (one would end every output at once)."""
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > 4:
            raise body_limit("stop accepts at most 4 sequences", "stop")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise body_limit(f"each stop sequence may have at most {MAX_STOP_CHARS} characters", "stop")
        kept = [s for s in stops if s]
        if not kept:
            return None
        return kept[0] if isinstance(stop, str) else kept

    @field_validator("response_format")
    @classmethod
    def _format_is_named(cls, fmt: dict[str, Any] | None) -> dict[str, Any] | None:
        """A format says its ``type`` (``{}`` asked for nothing and was taken as text), and a JSON
        schema's ``name`` follows OpenAI's rule, as OpenAI refuses both whatever the backend."""
        if fmt is None:
            return None
        if not isinstance(fmt.get("type"), str):
            raise body_limit("response_format needs a 'type': 'text', 'json_object' or 'json_schema'",
                             "response_format.type")
        spec = fmt.get("json_schema")
        if fmt["type"] == "json_schema" and isinstance(spec, dict):
            name = spec.get("name")
            if not isinstance(name, str) or not re.fullmatch(SCHEMA_NAME_PATTERN, name):
                raise body_limit("response_format.json_schema.name must be 1 to 64 letters, digits, underscores "
                                 "or dashes", "response_format.json_schema.name")
        return fmt

    @field_validator("stop_token_ids")
    @classmethod
    def _few_stop_token_ids(cls, ids: list[int] | None) -> list[int] | None:
        if ids is not None:
            if len(ids) > MAX_STOP_TOKEN_IDS:  # each is checked against every generated token
                raise body_limit(f"stop_token_ids accepts at most {MAX_STOP_TOKEN_IDS} ids", "stop_token_ids")
            if any(t < 0 for t in ids):
                raise body_limit("stop_token_ids must be token ids >= 0", "stop_token_ids")
        return ids


    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    arguments: str  # the JSON text the model wrote, as OpenAI sends it back (never parsed here)


class ToolCall(BaseModel):
    """An assistant's earlier tool call, in the history, with OpenAI's required fields: a malformed
    entry is a 400 naming its field here, not the chat template's failure to render it."""

    model_config = ConfigDict(extra="allow")

    id: str
    type: Literal["function"]
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    function_call: dict[str, Any] | None = None  # legacy: an assistant's earlier call (stands for content)

    @field_validator("content")
    @classmethod
    def _text_parts_are_text(cls, content: Any) -> Any:
        """A part of type "text" carries a string (a number or object there used to be a 500), and so
        does a "refusal" part (an assistant's refused turn, in the history)."""
        if isinstance(content, list):
            for i, part in enumerate(content):
                kind = part.get("type")
                if not isinstance(kind, str):
                    raise body_limit(f"content part {i} needs a string 'type'", "content")
                if kind == "text" and not isinstance(part.get("text"), str):
                    raise body_limit(f"content part {i} of type 'text' needs a string 'text'", "content")
                if kind == "refusal" and not isinstance(part.get("refusal"), str):
                    raise body_limit(f"content part {i} of type 'refusal' needs a string 'refusal'", "content")
        return content


# Roles whose message says something only through its content (an assistant's may be its tool calls;
# a legacy "function" message is left as OpenAI left it).
_CONTENT_REQUIRED = ("system", "developer", "user", "tool")


def _check_history(messages: list[ChatMessage]) -> None:
    """What OpenAI refuses in a conversation, refused here too whatever the backend, each a 400 naming
    the field (the local chat template rendered them as something the client never sent): a message
    without content (an assistant's may have tool calls instead), a tool message without
    ``tool_call_id``, or answering no call an earlier assistant message made."""
    called: set[str] = set()
    for i, m in enumerate(messages):
        if m.content is None and m.role in _CONTENT_REQUIRED:
            raise body_limit(f"messages with role '{m.role}' must have a 'content'", f"messages[{i}].content",
                             code="missing_required_parameter")
        if m.role == "assistant":
            if m.content is None and not m.tool_calls and m.function_call is None:
                raise body_limit("messages with role 'assistant' must have a 'content' unless they have "
                                 "'tool_calls' or 'function_call'", f"messages[{i}].content",
                                 code="missing_required_parameter")
            called.update(call.id for call in m.tool_calls or ())
        elif m.role == "tool":
            if m.tool_call_id is None:
                raise body_limit("messages with role 'tool' must have a 'tool_call_id'",
                                 f"messages[{i}].tool_call_id", code="missing_required_parameter")
            if m.tool_call_id not in called:  # OpenAI's words (and spelling), which clients may match on
                raise body_limit("messages with role 'tool' must be a response to a preceeding message with "
                                 "'tool_calls'", f"messages[{i}].tool_call_id")


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    logprobs: StrictBool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # "24h" keeps the prompt cached, "in_memory" is the default policy; checked and honoured in
    # gateway.pipeline (for /v1/responses too, which runs as chat), anything else a 400 there.
    prompt_cache_retention: str | None = None
    # Keep the completion and its input messages for the tenant (gateway.chat_store); off by
    # default, as at OpenAI. Metadata is kept with it; sent without store it changes nothing.
    store: Annotated[StrictBool, null_means(False)] = False
    metadata: Metadata = None

    @model_validator(mode="after")
    def _history_holds_together(self) -> ChatCompletionRequest:
        _check_history(self.messages)
        return self

    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Common):
    # Left to right with strict ids: each shape is tried once, so a list of 200,000 ids costs one
    # list[StrictInt] pass (~10 ms) where the smart union tried every member, lax and strict (~5x).
    # Strict: "1" or 1.0 is not a token id (lax mode turned ["1", "2"] into ids, not two prompts).
    prompt: Annotated[str | list[StrictInt] | list[str] | list[list[StrictInt]], Field(union_mode="left_to_right")]
    logprobs: int | None = Field(None, ge=0, le=5)
    suffix: str | None = None
    best_of: int | None = None
    # 0 = the prompt alone, which only echo returns (OpenAI's legacy API and vLLM take it so)
    max_tokens: int | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _nothing_to_return(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise body_limit("max_tokens must be at least 1; 0 is accepted only with echo (the prompt alone)",
                             "max_tokens")
        return self

    def effective_max_tokens(self) -> int | None:
        return self.max_tokens

    def prompts(self) -> list[str | list[int]]:
        """Each prompt as text or token ids (OpenAI accepts all four shapes)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            return []
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class PromptTokensDetails(TypedDict):
    cached_tokens: int


class CompletionTokensDetails(TypedDict):
    reasoning_tokens: int


class Usage(TypedDict):
    """OpenAI's ``usage`` object: what every response shape (chat, completions, Responses, Messages)
    derives its own usage from."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails


def usage_dict(prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> Usage:
    """``usage`` with ``prompt_tokens_details.cached_tokens`` always present (0 when none)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


def now() -> int:
    return int(time.time())
