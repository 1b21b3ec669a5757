"""The internal node API's wire format: ``GenerateRequest`` and ``RequestOutput`` as JSON.

A gateway talks to a remote engine node (another ``prefixgate serve``) with::

    POST /internal/v1/generate        Authorization: Bearer <shared node token>
    {"request_id", "model", "tenant": {"namespace": hex, "metrics_label", "priority",
     "kv_block_quota", "ttft_target_s"}, "sampling": {...SamplingParams},
     "messages" | "prompt" | "prompt_token_ids", "tools"}
    -> 200, application/x-ndjson: one RequestOutput object per line, the last with "finished": true
    -> 4xx/5xx before streaming: {"error": {"message", "code"}} (engine errors keep their code)

    POST /internal/v1/abort {"request_id"}      GET /internal/v1/health|stats|models
    POST /internal/v1/count {request as above}  -> {"prompt_tokens": n}

The tenant arrives only as its server-derived namespace: the node never sees keys or tenant
ids. Its ``cipher`` is None on the node, so a remote node drops evicted blocks of remote
tenants instead of spilling them (it holds no tenant data key).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.protocol import (
    GenerateRequest,
    GuidedSpec,
    RequestOutput,
    SamplingParams,
    StaticTenantScope,
    TokenLogprob,
)


def request_to_wire(req: GenerateRequest) -> dict[str, Any]:
    t = req.tenant
    out: dict[str, Any] = {
        "request_id": req.request_id,
        "model": req.model,
        "tenant": {
            "namespace": bytes(t.namespace).hex(),
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
        s["guided"] = GuidedSpec(**s["guided"])
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


def output_to_wire(out: RequestOutput) -> dict[str, Any]:
    return dataclasses.asdict(out)


def output_from_wire(d: dict[str, Any]) -> RequestOutput:
    d = dict(d)
    d["new_token_ids"] = tuple(d.get("new_token_ids") or ())
    d["token_times_s"] = tuple(d.get("token_times_s") or ())
    d["logprobs"] = tuple(
        TokenLogprob(token_id=int(lp["token_id"]), token=str(lp["token"]), token_bytes=tuple(lp["token_bytes"]),
                     logprob=float(lp["logprob"]),
                     top=tuple((str(t), tuple(b), float(v)) for t, b, v in lp.get("top") or ()))
        for lp in d.get("logprobs") or ()
    )
    return RequestOutput(**d)
