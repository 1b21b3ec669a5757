"""Gateway settings: one frozen pydantic model, loaded from a TOML/YAML file and overridden by flags.

Config file layout (TOML shown; YAML with the same keys works too)::

    [server]
    host = "127.0.0.1"
    port = 8000
    max_body_bytes = "4MiB"
    node_token_env = "PREFIXGATE_NODE_TOKEN"   # enables POST /internal/v1/generate on this process
    metrics_token_env = "PREFIXGATE_METRICS_TOKEN"  # Prometheus scrapes /metrics with this bearer token

    [engine]                    # the in-process engine; omit `model` for a gateway-only process
    model = "tiny"              # or a checkpoint directory
    device = "cpu"
    kv_blocks = 512
    dram_bytes = "1GiB"

    [[routes]]                  # an upstream provider through litellm
    model = "gpt-4o-mini"       # the name clients send
    provider = "openai/gpt-4o-mini"
    api_base = "https://api.openai.com/v1"
    api_key_env = "OPENAI_API_KEY"
    cache_salt = false          # true: send the tenant namespace (hex) as `cache_salt` (vLLM)

    [[routes]]                  # remote engine nodes (other `prefixgate serve` processes)
    model = "tiny"
    nodes = ["http://10.0.0.2:8000", "http://10.0.0.3:8000"]
    node_token_env = "PREFIXGATE_NODE_TOKEN"

Secrets never live in the file: routes name the environment variable that holds them.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.config import parse_size


def _size(value: Any) -> int:
    return parse_size(value) if isinstance(value, str | int) else value


class RouteConfig(BaseModel):
    """One client-visible model name and where its requests go: a provider *or* a node pool."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    provider: str | None = None  # litellm model string, e.g. "openai/gpt-4o-mini", "anthropic/claude-..."
    api_base: str | None = None
    api_key_env: str | None = None
    cache_salt: bool = False
    extra_body: dict[str, Any] = Field(default_factory=dict)
    nodes: tuple[str, ...] = ()
    node_token_env: str | None = None
    # Prefill/decode split (docs/disaggregation.md): `nodes` are decode nodes, fed by these prefill nodes.
    prefill_nodes: tuple[str, ...] = ()
    split_min_tokens: int = Field(256, ge=1)  # uncached prompt tokens below which a request stays colocated
    max_prefill_queue: int = Field(8, ge=1)
    max_model_len: int | None = None  # advertised in /v1/models for providers; nodes report their own
    # "litellm" (any provider) or "direct": a keep-alive HTTP client straight to an OpenAI-compatible
    # api_base, skipping litellm's per-call work (the gateway's added latency in front of vLLM/SGLang).
    transport: Literal["litellm", "direct"] = "litellm"

    @model_validator(mode="after")
    def _one_target(self) -> RouteConfig:
        if bool(self.provider) == bool(self.nodes):
            raise ValueError(f"route {self.model!r}: give exactly one of `provider` or `nodes`")
        if self.prefill_nodes and not self.nodes:
            raise ValueError(f"route {self.model!r}: `prefill_nodes` needs `nodes` (the decode nodes they feed)")
        if self.transport == "direct" and not (
            self.provider and self.provider.startswith("openai/") and self.api_base
        ):
            raise ValueError(
                f"route {self.model!r}: transport = \"direct\" needs provider = \"openai/<model>\" and an api_base"
            )
        return self

    @property
    def api_key(self) -> str | None:
        return os.environ.get(self.api_key_env) if self.api_key_env else None

    @property
    def node_token(self) -> str | None:
        return os.environ.get(self.node_token_env) if self.node_token_env else None


class GatewaySettings(BaseModel):
    """Everything ``create_app`` needs. Frozen: build a new one to change anything."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    home: Path | None = None  # tenancy database and keys; None = tenancy injected (tests)
    # Local engine: None = gateway-only (every model is routed elsewhere).
    model: str | None = None
    model_dir: Path | None = None  # resolved checkpoint directory (serve_cmd fills it from `model`)
    device: str = "cpu"
    kv_blocks: int | None = None
    dram_bytes: int = 0
    nvme_dir: Path | None = None
    nvme_bytes: int = 0
    role: Literal["both", "prefill", "decode"] = "both"  # prefill/decode split role of the local engine
    kv_port: int = Field(0, ge=0, le=65535)  # a decode engine's KV receiver port (0 = any free port)
    prefix_caching: bool = True  # False = every request computes its whole prompt (benchmark baseline)
    routes: tuple[RouteConfig, ...] = ()
    node_token: str | None = None  # shared secret for /internal/v1/* (None = node API disabled)
    # /metrics: a bearer token for Prometheus (None = admin keys only), or no auth at all (opt-in)
    metrics_token: str | None = None
    metrics_public: bool = False
    max_body_bytes: int = 4 * 1024 * 1024
    default_max_tokens: int = Field(256, ge=1)
    max_n: int = Field(8, ge=1)
    auth_cache_ttl_s: float = 5.0
    # Node choice: hash this many bytes of the canonical prompt with the namespace (the shared prefix).
    route_prefix_bytes: int = Field(1024, ge=16)
    # Load guard: leave the rendezvous choice when it has more than factor * (least load + 1) in flight.
    load_factor: float = Field(2.0, ge=1.0)

    @model_validator(mode="after")
    def _role_needs_token(self) -> GatewaySettings:
        if self.role != "both" and self.model_dir is None:
            raise ValueError(f"role {self.role} needs a local engine (--model DIR or tiny)")
        if self.role != "both" and not self.node_token:
            raise ValueError(f"role {self.role} needs a node token (--node-token-env): the KV transfer key "
                             "is derived from it and the split's node calls are authenticated with it")
        return self

    @field_validator("dram_bytes", "nvme_bytes", "max_body_bytes", mode="before")
    @classmethod
    def _sizes(cls, v: Any) -> Any:
        return _size(v)

    @field_validator("routes")
    @classmethod
    def _unique(cls, routes: tuple[RouteConfig, ...]) -> tuple[RouteConfig, ...]:
        names = [r.model for r in routes]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"duplicate route model names: {sorted(dup)}")
        return routes


def read_config_file(path: Path) -> dict[str, Any]:
    """Parse a TOML or YAML config file into flat ``GatewaySettings`` keys. Raises ValueError."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"cannot read config file {path}: {exc.strerror}") from None
    suffix = Path(path).suffix.lower()
    try:
        if suffix == ".toml":
            raw = tomllib.loads(text)
        elif suffix in (".yaml", ".yml"):
            raw = yaml.safe_load(text) or {}
        else:
            raise ValueError(f"config file {path} must end in .toml, .yaml or .yml")
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise ValueError(f"cannot parse config file {path}: {exc}".splitlines()[0]) from None
    if not isinstance(raw, dict):
        raise ValueError(f"config file {path}: top level must be a table/mapping")
    flat: dict[str, Any] = {}
    for section in ("server", "engine"):
        part = raw.get(section) or {}
        if not isinstance(part, dict):
            raise ValueError(f"config file {path}: [{section}] must be a table")
        flat.update(part)
    token_env = flat.pop("node_token_env", None)
    if token_env:
        flat["node_token"] = os.environ.get(token_env)
    metrics_env = flat.pop("metrics_token_env", None)
    if metrics_env:
        flat["metrics_token"] = os.environ.get(metrics_env)
    if "routes" in raw:
        flat["routes"] = raw["routes"]
    unknown = set(raw) - {"server", "engine", "routes"}
    if unknown:
        raise ValueError(f"config file {path}: unknown sections {sorted(unknown)}")
    return flat
