"""``GET /v1/models`` and ``GET /v1/models/{id}`` in the OpenAI list shape."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from gateway.deps import EngineDep, RouterDep, TenantDep
from gateway.errors import OpenAIError

router = APIRouter(prefix="/v1", tags=["models"])


def _card(card: Any, created: int) -> dict[str, Any]:
    # created: when this gateway started serving the model (Unix seconds), as OpenAI's field means.
    return {"id": card.id, "object": "model", "created": created, "owned_by": card.owned_by,
            "max_model_len": card.max_model_len}


@router.get("/models")
async def list_models(request: Request, _: TenantDep, router_: RouterDep, engine: EngineDep) -> dict[str, Any]:
    created = request.app.state.started_at
    return {"object": "list", "data": [_card(c, created) for c in router_.model_cards(engine)]}


@router.get("/models/{model_id:path}")
async def get_model(request: Request, model_id: str, _: TenantDep, router_: RouterDep,
                    engine: EngineDep) -> dict[str, Any]:
    for card in router_.model_cards(engine):
        if card.id == model_id:
            return _card(card, request.app.state.started_at)
    raise OpenAIError(404, f"The model `{model_id}` does not exist or you do not have access to it.",
                      code="model_not_found", param="model")
