"""vLLM's ``POST /tokenize`` and ``POST /detokenize``: the served model's token ids, as the engine makes them.

Clients that keep token ids next to the server's (RL rollouts, prompt-length budgets, a cache breakpoint
at a block boundary) ask the server to tokenize, so that the ids are those of the server's own chat
template. Here the request goes through the same preparation as a completion (authentication,
bounds, admission, canonicalization, the route), so ``tokens`` are exactly the ids the engine would
run and cache for this tenant, canonicalized prompt included; nothing is generated and no ledger row is
written for a request that succeeds (a refused one gets its row, as every refused request does).

Request shapes (vLLM's): ``{"model"?, "prompt", "add_special_tokens"?: true}`` or ``{"model"?,
"messages", "tools"?, "add_generation_prompt"?: true, "continue_final_message"?: false,
"add_special_tokens"?: false}`` -> ``{"count", "max_model_len", "tokens", "token_strs": null}``;
``{"model"?, "tokens"}`` -> ``{"prompt"}``. ``model`` defaults to the local engine's. Settings the engine
does not have (another ``add_special_tokens`` than the engine's own for that shape, no generation
prompt, continuing the last message, ``return_token_strs``) are a 400 naming the field, never
silently different ids. A model served through a provider has no tokenizer here: a 400 naming
``model``.
"""

from __future__ import annotations

from typing import Any, TypeVar

from fastapi import APIRouter
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, model_validator

from engine.protocol import EngineClient, EngineError, PromptDecoder
from gateway.deps import TenantDep
from gateway.errors import OpenAIError, invalid_request, unsupported_value
from gateway.ingress import MAX_TOKEN_IDS, body_limit
from gateway.pipeline import Prepared, engine_failure, prepare
from gateway.ports import TenantCtx
from gateway.routes.completions import Parts, PartsDep, record_rejected
from gateway.routes.completions_asgi import under_body
from gateway.schemas import ChatCompletionRequest, CompletionRequest

router = APIRouter(tags=["tokenize"])
M = TypeVar("M", ChatCompletionRequest, CompletionRequest)


class TokenizeRequest(BaseModel):
    """vLLM's two tokenize shapes in one model: exactly one of ``prompt`` and ``messages``."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, max_length=256)
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = Field(None, min_length=1)
    tools: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if self.prompt is None and self.messages is None:
            raise body_limit("give exactly one of 'prompt' and 'messages'", "prompt", code="missing_required_parameter")
        if self.prompt is not None and self.messages is not None:
            raise body_limit("give exactly one of 'prompt' and 'messages', not both", "messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, max_length=256)
    tokens: list[StrictInt] = Field(max_length=MAX_TOKEN_IDS)


def _model_of(requested: str | None, engine: EngineClient | None) -> str:
    """The model asked for, or the local engine's when none is named (vLLM's default: its one model)."""
    if requested is not None:
        return requested
    if engine is None or not engine.models():
        raise invalid_request("'model' is required: this gateway has no local model to default to", param="model")
    return engine.models()[0].id


def _only_the_engines_setting(body: TokenizeRequest) -> None:
    """Refuse, naming the field, a setting under which the engine would not make these ids."""
    chat = body.messages is not None
    special = body.add_special_tokens
    if special is not None and special != (not chat):  # text: the tokenizer's own BOS; chat: the template's
        raise unsupported_value(f"add_special_tokens={special} for a {'messages' if chat else 'prompt'} request: "
                                f"the engine tokenizes it with {not chat}; omit it", "add_special_tokens")
    if chat and not body.add_generation_prompt:
        raise unsupported_value("the engine's prompts end with the generation prompt; omit add_generation_prompt",
                                "add_generation_prompt")
    if chat and body.continue_final_message:
        raise unsupported_value("the engine does not continue a final message; omit continue_final_message",
                                "continue_final_message")
    if body.return_token_strs:
        raise unsupported_value("token strings are not returned here; decode ids with /detokenize",
                                "return_token_strs")


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, ctx: TenantDep, parts: PartsDep) -> dict[str, Any]:
    _only_the_engines_setting(body)
    model = _model_of(body.model, parts.engine)
    # one output token asked for: the prompt must leave room for it, as a completion's would
    if body.messages is not None:
        kind = "chat"
        fields: dict[str, Any] = {"model": model, "messages": body.messages, "max_tokens": 1}
        if body.tools is not None:
            fields["tools"] = body.tools
        req: ChatCompletionRequest | CompletionRequest = _as_request(ChatCompletionRequest, fields)
    else:
        if body.tools is not None:
            raise invalid_request("'tools' go with 'messages', not with a text 'prompt'", param="tools")
        kind = "completion"
        req = _as_request(CompletionRequest, {"model": model, "prompt": body.prompt, "max_tokens": 1})
    prep = await _prepared(kind, req, ctx, parts)
    ids = prep.requests[0].prompt_token_ids
    if ids is None:  # a provider route: the upstream tokenizes
        raise invalid_request(f"model {model!r} is served through a provider; its tokens cannot be counted here",
                              param="model")
    tokens = list(ids)
    return {"count": len(tokens), "max_model_len": parts.router.max_model_len(prep.backend), "tokens": tokens,
            "token_strs": None}


def _as_request(schema: type[M], fields: dict[str, Any]) -> M:
    """The completion request these fields make, its errors reported as the body's (a message a chat
    completion would refuse is the same 400 here, under ``messages``), not as a server error."""
    try:
        return schema.model_validate(fields)
    except ValidationError as exc:
        raise RequestValidationError(under_body(exc)) from None


async def _prepared(kind: str, req: ChatCompletionRequest | CompletionRequest, ctx: TenantCtx,
                    parts: Parts) -> Prepared:
    """``pipeline.prepare`` as a completion's; a refusal gets its one ledger row, as there. No miss tracker:
    a prompt tokenized and never run is not a request of its family, whose misses the tracker explains."""
    try:
        return await prepare(kind, req, ctx, tenancy=parts.tenancy, router=parts.router, engine=parts.engine,
                             settings=parts.settings, threads=parts.threads, tracker=None)
    except OpenAIError as err:
        record_rejected(parts.tenancy, ctx, req.model, kind, err, parts.metrics, parts.live)
        raise


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, ctx: TenantDep, parts: PartsDep) -> dict[str, Any]:
    model = _model_of(body.model, parts.engine)
    scoped = parts.tenancy.scope_for(ctx, None)
    backend = parts.router.resolve(model, parts.engine, scoped.namespace, {})
    client = backend.client
    if not isinstance(client, PromptDecoder):
        raise invalid_request(f"model {model!r} is served through a provider; its token ids cannot be decoded here",
                              param="model")
    tokens = body.tokens
    try:  # off the event loop, in the tenant's own share of the worker threads
        text = await parts.threads.run(ctx.tenant_id, client.decode_prompt, tokens)
    except EngineError as exc:  # an id outside the vocabulary
        raise engine_failure(exc) from None
    return {"prompt": text}
