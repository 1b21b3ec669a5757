"""A ``GenerateRequest`` as JSON, for the split topology's KV calls (``/internal/v1/kv/*``).

The prefill/decode split needs the whole request on the prefill node (sampling, tenant scope,
guided grammar) to compute exactly the blocks the decode node will look up; generation itself goes
through the OpenAI-compatible node API (``gateway.remote``). The tenant travels only as its
server-derived namespace (hex) and its opaque tenant key (hex, ``tenant_key``: what the node's
quotas and fair share count by): the node never sees API keys or tenant ids, and holds no data key.
``tenant_key`` is optional on the wire: a request from a gateway that sends none is its namespace's
own tenant, as before the key existed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.protocol import (
    GenerateRequest,
    GuidedSpec,
    SamplingParams,
    StaticTenantScope,
)


def request_to_wire(req: GenerateRequest) -> dict[str, Any]:
    t = req.tenant
    out: dict[str, Any] = {
        "request_id": req.request_id,
        "model": req.model,
        "tenant": {
            "namespace": bytes(t.namespace).hex(),
            "tenant_key": bytes(t.tenant_key).hex(),
            "metrics_label": t.metrics_label,
            "priority": t.priority,
            "kv_block_quota": t.kv_block_quota,
            "ttft_target_s": t.ttft_target_s,
        },
        "sampling": dataclasses.asdict(req.sampling),
    }
    for name in ("messages", "tools", "prompt", "prompt_token_ids"):
        value = getattr(req, name)
        if value is not None:
            out[name] = list(value) if name != "prompt" else value
    return out


def request_from_wire(d: dict[str, Any]) -> GenerateRequest:
    """Inverse of ``request_to_wire``. Raises ValueError/TypeError/KeyError on malformed input."""
    t = d["tenant"]
    scope = StaticTenantScope(
        namespace=bytes.fromhex(t["namespace"]),
        tenant_key=bytes.fromhex(t.get("tenant_key") or ""),  # "" = the namespace (an older peer)
        metrics_label=str(t.get("metrics_label") or "remote"),
        cipher=None,
        priority=int(t.get("priority") or 0),
        kv_block_quota=t.get("kv_block_quota"),
        ttft_target_s=t.get("ttft_target_s"),
    )
    s = dict(d.get("sampling") or {})
    for name in ("stop", "stop_token_ids"):
        if name in s:
            s[name] = tuple(s[name])
    if "logit_bias" in s:
        s["logit_bias"] = tuple((int(t), float(b)) for t, b in s["logit_bias"])
    if s.get("guided") is not None:
        # the owner is the receiving engine's to set (from the tenant scope above), never the peer's
        s["guided"] = GuidedSpec(**{k: v for k, v in s["guided"].items() if k != "owner"})
    return GenerateRequest(
        request_id=str(d["request_id"]),
        tenant=scope,
        sampling=SamplingParams(**s),
        messages=d.get("messages"),
        tools=d.get("tools"),
        prompt=d.get("prompt"),
        prompt_token_ids=d.get("prompt_token_ids"),
        model=d.get("model"),
    )
