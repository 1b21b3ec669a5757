"""What the non-chat front doors (``/v1/responses``, ``/v1/messages``) share: entering the chat pipeline.

A door translates its body to a chat completions body, validates it as one (``chat_request``),
and prepares it through ``pipeline.prepare`` (``prepare_door``): the same admission, size limits,
canonicalization, routing, tokenization and refused-request accounting as ``/v1/chat/completions``.
Explicit cache control (a retention span per prompt) is attached to the prepared engine requests.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from pydantic import ValidationError

from engine.protocol import GenerateRequest, Retention
from gateway.errors import OpenAIError, validation_error
from gateway.ingress import ScannedBody
from gateway.metrics import GatewayMetrics, LiveStats
from gateway.pipeline import CHAT_FIELDS, Prepared, RequestFields, check_prompt_chars, prepare
from gateway.ports import QuotaExceededError, TenancyPort, TenantCtx
from gateway.routes.completions import Parts, record_rejected
from gateway.schemas import ChatCompletionRequest

# prompt tokens -> the retention spans for that prompt (the door knows where its breakpoints fall)
RetentionPlan = Callable[[list[int]], tuple[Retention, ...]]

T = TypeVar("T")

# A body with more characters of text than this is translated in the tenant's worker thread: below
# it the translation costs less than the thread hop (as ``pipeline``'s inline canonicalization bound).
OFF_LOOP_CHARS = 65_536


async def translated(body: ScannedBody, ctx: TenantCtx, parts: Parts, translate: Callable[[], T],
                     fields: RequestFields = CHAT_FIELDS) -> T:
    """``translate()`` (a door's ``body`` to chat, and its validation as a chat body), once ``body``
    is known to be within ``max_prompt_chars``: inline for a small body, in the tenant's worker
    thread for a large one.

    The character bound is checked on the body as sent, with the 400 the chat pipeline gives (its
    param the door's own prompt field, ``fields.prompt``), before the translation: that walks and
    rebuilds the whole body, and ``chat_request`` validates it again, tenths of a second of pure
    Python for 3 MB of small parts. Run in a worker thread, it still held the GIL against the event loop, and every other
    tenant's stream waited for a body that was then refused for its size anyway (the DoS audit).
    The chat pipeline checks the bound again on the chat body, which a stored conversation
    (``previous_response_id``) can make longer than the body sent."""
    check_prompt_chars(body.text_chars, body.token_ids, parts.settings.max_prompt_chars, fields.prompt)
    if body.text_chars <= OFF_LOOP_CHARS:
        return translate()
    return await parts.threads.run(ctx.tenant_id, translate)


def chat_request(body: dict[str, Any]) -> ChatCompletionRequest:
    """Validate a translated body; a field that fails is the client's (400, worded as the chat
    route's), never a 500."""
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


@contextlib.contextmanager
def refusals_counted(tenancy: TenancyPort, ctx: TenantCtx, model: str, metrics: GatewayMetrics,
                     live: LiveStats) -> Iterator[None]:
    """A door's own 400s (translation, cache_control) are refused requests like the pipeline's: they
    take their place in the rate limit (issue 16.9) and get their ledger row and counts."""
    try:
        yield
    except OpenAIError as err:
        with contextlib.suppress(QuotaExceededError):  # already over: the refusal stands as it is
            tenancy.admit(tenancy.scope_for(ctx, None), estimated_tokens=0)
        record_rejected(tenancy, ctx, model, "chat", err, metrics, live)
        raise


def whole_prompt_for(seconds: float | None) -> RetentionPlan | None:
    """A plan that keeps the whole prompt for ``seconds`` (a warmed prompt's ``ttl``; OpenAI's
    ``prompt_cache_retention`` is the chat pipeline's own)."""
    if seconds is None:
        return None
    return lambda ids: (Retention(len(ids), seconds),)


def with_retention(request: GenerateRequest, spans: tuple[Retention, ...]) -> GenerateRequest:
    """``request`` keeping ``spans`` as well as what it already keeps (the tenant's default retention)."""
    return dataclasses.replace(request, retention=(*spans, *request.retention))


async def prepare_door(chat: ChatCompletionRequest, ctx: TenantCtx, parts: Parts,
                       retention: RetentionPlan | None = None, fields: RequestFields | None = None) -> Prepared:
    """``pipeline.prepare`` for a door's chat request; a refusal gets its ledger row and counts.
    ``fields``: the door's names for the prompt and the output budget (chat's by default)."""
    tenancy, metrics, live = parts.tenancy, parts.metrics, parts.live
    try:
        prep = await prepare("chat", chat, ctx, tenancy=tenancy, router=parts.router, engine=parts.engine,
                             settings=parts.settings, threads=parts.threads, tracker=parts.tracker, fields=fields)
    except OpenAIError as err:  # a refusal: its one row, and counted by outcome
        record_rejected(tenancy, ctx, chat.model, "chat", err, metrics, live)
        raise
    except Exception:  # a bug: the request still gets its one row (a 500), as on the chat route
        record_rejected(tenancy, ctx, chat.model, "chat", OpenAIError(500, "internal error"), metrics, live)
        raise
    if retention is not None and prep.backend.honours_retention:
        prep.requests = [with_retention(r, retention(list(r.prompt_token_ids or ()))) for r in prep.requests]
    return prep
