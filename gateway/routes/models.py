"""``GET /v1/models`` and ``GET /v1/models/{id}`` in the OpenAI list shape."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from gateway.deps import EngineDep, RouterDep, TenantDep
from gateway.errors import OpenAIError

router = APIRouter(prefix="/v1", tags=["models"])


def _card(card: Any) -> dict[str, Any]:
    return {"id": card.id, "object": "model", "created": 0, "owned_by": card.owned_by,
            "max_model_len": card.max_model_len}


@router.get("/models")
async def list_models(_: TenantDep, router_: RouterDep, engine: EngineDep) -> dict[str, Any]:
    return {"object": "list", "data": [_card(c) for c in router_.model_cards(engine)]}


@router.get("/models/{model_id:path}")
async def get_model(model_id: str, _: TenantDep, router_: RouterDep, engine: EngineDep) -> dict[str, Any]:
    for card in router_.model_cards(engine):
        if card.id == model_id:
            return _card(card)
    raise OpenAIError(404, f"The model `{model_id}` does not exist or you do not have access to it.",
                      code="model_not_found", param="model")
