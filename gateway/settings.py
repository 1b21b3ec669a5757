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
    # cache_salt / tenant_prefix / prompt_cache_key: tenant isolation upstream (docs/gateway.md)

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
from urllib.parse import urlsplit

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
    # Tenant isolation in the upstream's own prompt cache (SECURITY.md, "Provider routes"):
    # cache_salt: send the namespace as vLLM's `cache_salt`; None = on for a self-hosted
    #   OpenAI-compatible api_base (vLLM, SGLang, PrefixGate), off for hosted providers, which refuse it.
    # tenant_prefix: start every prompt with a per-tenant marker, so that upstreams which cache per
    #   account (OpenAI, Anthropic) or ignore cache_salt never match one tenant's prefix for another.
    # prompt_cache_key: send a per-tenant OpenAI `prompt_cache_key` (routing, hit rate; not isolation);
    #   None = on for api.openai.com.
    cache_salt: bool | None = None
    tenant_prefix: bool = True
    prompt_cache_key: bool | None = None
    extra_body: dict[str, Any] = Field(default_factory=dict)
    nodes: tuple[str, ...] = ()
    node_token_env: str | None = None
    max_model_len: int | None = None  # advertised in /v1/models for providers; nodes report their own
    # "litellm" (any provider) or "direct": a keep-alive HTTP client straight to an OpenAI-compatible
    # api_base, skipping litellm's per-call work (the gateway's added latency in front of vLLM/SGLang).
    transport: Literal["litellm", "direct"] = "litellm"

    @model_validator(mode="after")
    def _one_target(self) -> RouteConfig:
        if bool(self.provider) == bool(self.nodes):
            raise ValueError(f"route {self.model!r}: give exactly one of `provider` or `nodes`")
        if self.transport == "direct" and not (
            self.provider and self.provider.startswith("openai/") and self.api_base
        ):
            raise ValueError(
                f"route {self.model!r}: transport = \"direct\" needs provider = \"openai/<model>\" and an api_base"
            )
        return self

    @property
    def hosted_openai(self) -> bool:
        """OpenAI's own API (no api_base, or api.openai.com)."""
        return bool(self.provider and self.provider.startswith("openai/")) and (
            not self.api_base or urlsplit(self.api_base).hostname == "api.openai.com")

    @property
    def self_hosted(self) -> bool:
        """An OpenAI-compatible server the operator runs: ``openai/...`` or ``hosted_vllm/...`` at an api_base."""
        prefixes = ("openai/", "hosted_vllm/")
        return bool(self.provider and self.provider.startswith(prefixes) and self.api_base) and not self.hosted_openai

    @property
    def sends_cache_salt(self) -> bool:
        return self.self_hosted if self.cache_salt is None else self.cache_salt

    @property
    def sends_prompt_cache_key(self) -> bool:
        return self.hosted_openai if self.prompt_cache_key is None else self.prompt_cache_key

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
    prefix_caching: bool = True  # False = every request computes its whole prompt (benchmark baseline)
    routes: tuple[RouteConfig, ...] = ()
    node_token: str | None = None  # shared secret for /internal/v1/* (None = node API disabled)
    # /metrics: a bearer token for Prometheus (None = admin keys only), or no auth at all (opt-in)
    metrics_token: str | None = None
    metrics_public: bool = False
    max_body_bytes: int = 4 * 1024 * 1024
    default_max_tokens: int = Field(256, ge=1)
    max_n: int = Field(8, ge=1)
    # Work one request may ask for, refused with a 400 before anything costly (issue 16.2): prompts in
    # one completions request, choices (prompts x n), characters of text in the whole body.
    max_prompts: int = Field(64, ge=1)
    max_choices: int = Field(64, ge=1)
    max_prompt_chars: int = Field(1_000_000, ge=1)
    # Threads for tokenization and large canonicalizations, and how many one tenant may hold at once.
    worker_threads: int = Field(2, ge=1)
    worker_threads_per_tenant: int = Field(1, ge=1)
    auth_cache_ttl_s: float = 5.0
    # Node choice: hash this many bytes of the canonical prompt with the namespace (the shared prefix).
    route_prefix_bytes: int = Field(1024, ge=16)
    # Load guard: leave the rendezvous choice when it has more than factor * (least load + 1) in flight.
    load_factor: float = Field(2.0, ge=1.0)

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
