"""Gateway settings: one frozen pydantic model, loaded from a TOML/YAML file and overridden by flags.

Config file layout (TOML shown; YAML with the same keys works too)::

    [server]
    host = "127.0.0.1"
    port = 8000
    max_body_bytes = "4MiB"
    node_token_env = "PREFIXGATE_NODE_TOKEN"   # makes this process an engine node (docs/nodes.md)
    metrics_token_env = "PREFIXGATE_METRICS_TOKEN"  # Prometheus scrapes /metrics with this bearer token
    # $PREFIXGATE_DATABASE_URL / $PREFIXGATE_REDIS_URL beat these two, a flag beats both
    database_url = "postgresql://prefixgate@db:5432/prefixgate"  # shared state of a fleet (default: SQLite under --home)
    redis_url = "redis://redis:6379/0"  # fleet-wide rpm/tpm limits, budgets and revocation (default: per process)
    shutdown_grace_s = 30       # SIGTERM: requests in flight may finish for this long, then are stopped
    header_timeout_s = 10       # a request's line and headers must arrive within this; max_connections = 4096

    [engine]                    # the in-process engine; model = "none" for a gateway-only process
    model = "smol"              # SmolLM2-135M-Instruct (the default), "tiny", or a checkpoint directory
    device = "cpu"
    dtype = "auto"              # compute: auto (fp32 on CPU, bf16 on CUDA) / bf16 / fp16 / fp32
    kv_dtype = "auto"           # KV cache: auto (= dtype) / bf16 / fp16 / fp32 / fp8 / int8
    kv_blocks = 512
    block_size = 16             # tokens per KV block (8/16/32/64/128)
    kv_page_layout = "auto"     # a block's bytes: auto (head on CUDA, token on CPU) / token / head (docs/gpu.md)
    max_num_seqs = 64           # most requests in one running batch
    max_num_batched_tokens = 2048
    max_mixed_prefill_tokens = 256  # prefill tokens of a shared step (default: 256 on CPU, no cap on CUDA; 0 = no cap)
    prefill_graph_tokens = 512  # CUDA: one-sequence prefill steps up to this many tokens from graphs (0 = off)
    warm_up_kernels = true      # CUDA: compile the eager path's Triton kernels at start (false: at first use)
    max_model_len = 8192        # longest context served (default: the model's, capped by the KV pool)
    threads = 2                 # torch CPU threads (default: torch's choice)
    dram_bytes = "1GiB"

    [[routes]]                  # an upstream provider through litellm
    model = "gpt-4o-mini"       # the name clients send
    provider = "openai/gpt-4o-mini"
    api_base = "https://api.openai.com/v1"
    api_key_env = "OPENAI_API_KEY"
    # cache_salt / tenant_prefix / prompt_cache_key: tenant isolation upstream (docs/gateway.md)

    [[routes]]                  # engine nodes: `prefixgate serve` nodes or vLLM servers (docs/nodes.md)
    model = "tiny"
    nodes = ["http://10.0.0.2:8000", "http://10.0.0.3:8000"]
    node_token_env = "PREFIXGATE_NODE_TOKEN"   # omit for a keyless node (vLLM without --api-key)
    price = "unpriced"          # tokens, no money; or a litellm cost-map model to price as

Secrets never live in the file: ``node_token_env``, ``metrics_token_env`` and a route's ``api_key_env`` /
``node_token_env`` name the environment variable that holds them, and a named variable that is unset
or empty fails start-up. ``node_token`` / ``metrics_token`` themselves (and ``home`` / ``model_dir``,
which the command line resolves) are refused in a file. [server] and [engine] are one namespace: a key
is read from either section; the split is for the reader.
"""

from __future__ import annotations

import contextlib
import importlib.util
import ipaddress
import os
import re
import tomllib
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from engine.config import (
    COMPUTE_DTYPES,
    DTYPE_ALIASES,
    KV_DTYPES,
    ComputeDtype,
    EngineConfig,
    KVDtype,
    parse_size,
)

_NODE_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")  # safe in a header, a metric label and a log line


def node_url_problem(url: str) -> str | None:
    """What is wrong with an engine node's base URL (None: nothing): it must be http(s)://host[:port]."""
    try:
        parts = urlsplit(url)
        port = parts.port  # raises ValueError on a port that is not a number in 0-65535
    except ValueError as exc:
        return f"is not a valid URL ({exc})"
    if parts.scheme not in ("http", "https"):
        return "must start with http:// or https://"
    if not parts.hostname:
        return "has no host"
    if port == 0:
        return "has port 0"
    return None


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
    # Per-tenant upstream accounts (separate caches at the provider): tenant name -> the environment
    # variable with that tenant's own key. shared_api_key = false: tenants without one get a 403.
    tenant_api_key_envs: dict[str, str] = Field(default_factory=dict)
    shared_api_key: bool = True
    extra_body: dict[str, Any] = Field(default_factory=dict)
    nodes: tuple[str, ...] = ()
    # What tenants, metrics and the ledger call each node (in the order of `nodes`): the
    # `x-prefixgate-backend` header says `node:<name>`, never the node's URL. Empty = "<model>-1", ...
    node_names: tuple[str, ...] = ()
    node_token_env: str | None = None
    # Prefill/decode split (docs/disaggregation.md): `nodes` are decode nodes, fed by these prefill nodes.
    prefill_nodes: tuple[str, ...] = ()
    split_min_tokens: int = Field(256, ge=1)  # uncached prompt tokens below which a request stays colocated
    max_prefill_queue: int = Field(8, ge=1)
    split_when_decode_idle: bool = True  # False: a decode node running and queueing nothing prefills itself
    max_model_len: int | None = None  # advertised in /v1/models for providers; nodes report their own
    # "litellm" (any provider) or "direct": a keep-alive HTTP client straight to an OpenAI-compatible
    # api_base, skipping litellm's per-call work (the gateway's added latency in front of vLLM/SGLang).
    transport: Literal["litellm", "direct"] = "litellm"
    # What the ledger prices this route's requests at: None = the provider's own model (a node or a
    # model missing from litellm's map: the reference model, PREFIXGATE_REFERENCE_MODEL);
    # "unpriced" = tokens only, no cost and no saving (a self-hosted engine that costs nothing per
    # token); any other string = that litellm cost-map entry ("gpt-4o", "deepseek/deepseek-chat").
    price: str | None = Field(None, min_length=1)
    # The nodes' KV event endpoints (ZMQ, vLLM's schema), in the order of `nodes`; they feed the
    # fleet index that routing_policy = "kv_aware" asks (docs/fleet.md). Empty = none published.
    kv_events: tuple[str, ...] = ()
    # The nodes' checkpoint (or tokenizer) directory, readable here: the gateway then renders chat
    # and text prompts itself and sends every node token ids, so that nodes see the tokens the
    # router hashed (kv_aware routing for chat, not only for token-id prompts), and checks the
    # context length before a node is asked. None = nodes tokenize (chat goes as messages).
    tokenizer: str | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _one_target(self) -> RouteConfig:
        if self.tokenizer:
            if not self.nodes:
                raise ValueError(f"route {self.model!r}: `tokenizer` is for node pools (`nodes`)")
            tok_dir = Path(self.tokenizer).expanduser()
            if not any((tok_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
                raise ValueError(f"route {self.model!r}: no tokenizer at {tok_dir} "
                                 "(a checkpoint directory with tokenizer.json or tokenizer_config.json)")
            if importlib.util.find_spec("transformers") is None:
                raise ValueError(f"route {self.model!r}: `tokenizer` needs transformers: pip install 'prefixgate[engine]'")
        for url in (*self.nodes, *self.prefill_nodes):
            problem = node_url_problem(url)
            if problem:
                raise ValueError(f"route {self.model!r}: node URL {url!r} {problem}")
        if self.node_names:
            if len(self.node_names) != len(self.nodes):
                raise ValueError(f"route {self.model!r}: `node_names` needs one name per node, in the order of `nodes`")
            bad = [n for n in self.node_names if not _NODE_NAME.fullmatch(n)]
            if bad:
                raise ValueError(f"route {self.model!r}: node name {bad[0]!r} must be 1-64 letters, digits, "
                                 "'.', '_' or '-'")
            if len(set(self.node_names)) != len(self.node_names):
                raise ValueError(f"route {self.model!r}: `node_names` must be distinct")
        if self.kv_events and len(self.kv_events) != len(self.nodes):
            raise ValueError(f"route {self.model!r}: `kv_events` needs one endpoint per node, in the order of `nodes`")
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
    def names_of_nodes(self) -> tuple[str, ...]:
        """Each node's name: ``node_names``, or ``<model>-1``, ``<model>-2``... in the order of ``nodes``."""
        return self.node_names or tuple(f"{self.model}-{i}" for i in range(1, len(self.nodes) + 1))

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
    def tenant_api_keys(self) -> dict[str, str]:
        """Tenant name -> its own upstream key (tenants whose variable is unset are left out)."""
        return {name: os.environ[env] for name, env in self.tenant_api_key_envs.items() if os.environ.get(env)}

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
    # A fleet: tenants, keys and the ledger in PostgreSQL (None = SQLite under home) and limits in Redis.
    database_url: str | None = None
    redis_url: str | None = None
    # Local engine: None = gateway-only (every model is routed elsewhere).
    model: str | None = None
    model_dir: Path | None = None  # resolved checkpoint directory (serve_cmd fills it from `model`)
    device: str = "cpu"
    dtype: ComputeDtype = "auto"
    kv_dtype: KVDtype = "auto"
    kv_blocks: int | None = None
    block_size: Literal[8, 16, 32, 64, 128] = 16
    # EngineConfig.kv_page_layout: the order of a KV block's bytes (engine/kv_layout.py)
    kv_page_layout: Literal["auto", "token", "head"] = "auto"
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=8)
    # EngineConfig.max_mixed_prefill_tokens: None = the device's default (CPU 256, CUDA no cap), 0 = no cap
    max_mixed_prefill_tokens: int | None = Field(None, ge=0)
    prefill_graph_tokens: int = Field(512, ge=0)  # EngineConfig.prefill_graph_tokens (0 = eager prefill)
    warm_up_kernels: bool = True  # EngineConfig.warm_up_kernels (CUDA: the eager path's kernels compiled at start)
    # EngineConfig.prepare_workers / prepare_queued_per_tenant: the engine's per-tenant prepare lanes
    prepare_workers: int = Field(4, ge=1)
    prepare_queued_per_tenant: int = Field(64, ge=0)
    # Longest context served (prompt + output); None = the model's own, capped by the KV pool. On CUDA it
    # is also the width of the captured block tables (docs/gpu.md): set it to what you serve.
    max_model_len: int | None = Field(None, ge=1)
    threads: int | None = Field(None, ge=1)
    dram_bytes: int = 0
    nvme_dir: Path | None = None
    nvme_bytes: int = 0
    role: Literal["both", "prefill", "decode"] = "both"  # prefill/decode split role of the local engine
    kv_port: int = Field(0, ge=0, le=65535)  # a decode engine's KV receiver port (0 = any free port)
    # the host prefill nodes reach that receiver at (None = the bound host; a wildcard bind: the gateway's)
    kv_advertise_host: str | None = None
    prefix_caching: bool = True  # False = every request computes its whole prompt (benchmark baseline)
    routes: tuple[RouteConfig, ...] = ()
    node_token: str | None = None  # shared secret of the engine-node API (None = this is no node)
    node_probe_interval_s: float = Field(2.0, gt=0.0)  # GET /health of every engine node this often
    # Engine nodes' requests (docs/nodes.md): connect timeout; read timeout = the longest wait for a
    # node's next bytes (its first byte, then each gap in its stream); passive health: this many
    # failed requests in a row (5xx, timeouts) take a node out for node_cooldown_s.
    node_connect_timeout_s: float = Field(5.0, gt=0.0)
    node_read_timeout_s: float = Field(120.0, gt=0.0)
    node_cooldown_failures: int = Field(3, ge=1)
    node_cooldown_s: float = Field(30.0, ge=0.0)
    # SIGTERM: requests in flight get this long to finish; then they are stopped (aborted rows).
    shutdown_grace_s: float = Field(30.0, ge=0.0)
    # Connections (gateway/connection_limits.py): a request's line and headers must arrive within
    # header_timeout_s (a client trickling them is closed), and at most max_connections are open (more
    # are closed on accept, so the process's file descriptors stay bounded).
    header_timeout_s: float = Field(10.0, gt=0.0)
    max_connections: int = Field(4096, ge=1)
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
    # A tenant's steps waiting for its threads, beyond which its next request is refused (429).
    worker_queue_per_tenant: int = Field(64, ge=0)
    auth_cache_ttl_s: float = 5.0
    # Stored responses and chat completions (store: true) are deleted this many days after they were
    # stored (OpenAI keeps them 30); 0 keeps them until they, or their tenant, are deleted.
    store_retention_days: float = Field(30.0, ge=0.0, allow_inf_nan=False)
    # Node choice: hash this many bytes of the canonical prompt with the namespace (the shared prefix).
    route_prefix_bytes: int = Field(1024, ge=16)
    # Load guard: leave the rendezvous choice when it has more than factor * (least load + 1) in flight.
    load_factor: float = Field(2.0, ge=1.0)
    # How a node pool is chosen from (gateway/routing_policy.py): prefix_hash (stateless rendezvous),
    # kv_aware (the fleet index fed by the nodes' KV events, within a (1 + epsilon) x mean load
    # bound), least_loaded, round_robin.
    routing_policy: Literal["prefix_hash", "kv_aware", "least_loaded", "round_robin"] = "prefix_hash"
    route_epsilon: float = Field(0.25, ge=0.0)
    route_prefix_tokens: int = Field(256, ge=1)  # token-id prompts: the span the rendezvous key covers
    route_block_size: Literal[8, 16, 32, 64, 128] = 16  # the nodes' KV block size
    fleet_index_max_blocks: int = Field(1_000_000, ge=1)  # bounded memory (~150 B a block)
    fleet_index_ttl_s: float = Field(900.0, gt=0)  # an entry not re-stored for this long is gone
    # Local engine as a fleet node: publish its stored/removed KV blocks here (ZMQ, e.g.
    # tcp://127.0.0.1:5557); None = not published.
    kv_events_endpoint: str | None = None

    def engine_config(self) -> EngineConfig:
        """The in-process engine's configuration (every [engine] setting reaches the engine here).
        Raises ValueError when there is no local model (``model_dir`` is None)."""
        if self.model_dir is None:
            raise ValueError("no local model: this gateway only routes")
        return EngineConfig(
            model_dir=self.model_dir, device=self.device, dtype=self.dtype, kv_dtype=self.kv_dtype,
            block_size=self.block_size, kv_page_layout=self.kv_page_layout, num_kv_blocks=self.kv_blocks,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens, max_mixed_prefill_tokens=self.max_mixed_prefill_tokens,
            prefill_graph_tokens=self.prefill_graph_tokens, warm_up_kernels=self.warm_up_kernels,
            prepare_workers=self.prepare_workers, prepare_queued_per_tenant=self.prepare_queued_per_tenant,
            max_model_len=self.max_model_len, num_threads=self.threads,
            dram_bytes=self.dram_bytes, nvme_dir=self.nvme_dir, nvme_bytes=self.nvme_bytes,
            enable_prefix_caching=self.prefix_caching, kv_events_endpoint=self.kv_events_endpoint,
            model_id=self.model if self.model and self.model != str(self.model_dir) else None,
        )

    # before the Literal's own check: the short names (bf16, ...) become the engine's, and a wrong one
    # gets this message, which names the short forms too
    @field_validator("dtype", "kv_dtype", mode="before")
    @classmethod
    def _dtype(cls, v: object, info: ValidationInfo) -> object:
        if not isinstance(v, str):
            return v  # the Literal's check says what was expected
        v = DTYPE_ALIASES.get(v, v)
        allowed = KV_DTYPES if info.field_name == "kv_dtype" else COMPUTE_DTYPES
        if v not in allowed:
            raise ValueError(f"must be one of {', '.join(allowed)} (or bf16, fp16, fp32), got {v!r}")
        return v

    @model_validator(mode="after")
    def _role_needs_token(self) -> GatewaySettings:
        if self.role != "both" and self.model_dir is None:
            raise ValueError(f"role {self.role} needs a local engine (--model DIR or tiny)")
        if self.role != "both" and not self.node_token:
            raise ValueError(f"role {self.role} needs a node token (--node-token-env VAR, or node_token_env in "
                             "[server]): the KV transfer key is derived from it and the split's node calls are "
                             "authenticated with it")
        return self

    @model_validator(mode="after")
    def _engine_settings_agree(self) -> GatewaySettings:
        """The engine's own checks (max_num_batched_tokens >= block_size, prefill_graph_tokens != 1, ...),
        run here so that ``prefixgate serve`` reports them before it loads the model, not after."""
        if self.model_dir is not None:
            self.engine_config()  # raises ValueError
        return self

    @model_validator(mode="after")
    def _kv_events_need_their_libraries(self) -> GatewaySettings:
        endpoints = [self.kv_events_endpoint] if self.kv_events_endpoint else []
        endpoints += [e for r in self.routes for e in r.kv_events]
        bad = [e for e in endpoints if not e.startswith(("tcp://", "ipc://"))]
        if bad:
            raise ValueError(f"KV event endpoints are ZMQ addresses (tcp://HOST:PORT or ipc://PATH), got {bad[0]!r}")
        missing = [m for m in ("zmq", "msgpack") if endpoints and importlib.util.find_spec(m) is None]
        if missing:
            raise ValueError(f"KV events need pyzmq and msgpack ({', '.join(missing)} not installed): "
                             "pip install 'prefixgate[fleet]'")
        return self

    @field_validator("kv_advertise_host")
    @classmethod
    def _a_host(cls, v: str | None) -> str | None:
        if v is not None and not is_host(v):
            raise ValueError(f"must be a host name or an IP address (no port), got {v!r}")
        return v

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


def is_host(value: str) -> bool:
    """A DNS name or an IPv4/IPv6 address (IPv6 with or without brackets); never a host:port."""
    with contextlib.suppress(ValueError):
        ipaddress.ip_address(value.removeprefix("[").removesuffix("]"))
        return True
    return bool(re.fullmatch(r"[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?", value))


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
    _refuse_command_line_only_keys(path, flat)
    for env_key, secret_key in SECRET_ENV_KEYS.items():
        var = flat.pop(env_key, None)
        if var:
            flat[secret_key] = _secret_from_env(path, env_key, var)
    if "routes" in raw:
        _check_route_env_vars(path, raw["routes"])
        flat["routes"] = raw["routes"]
    unknown = set(raw) - {"server", "engine", "routes"}
    if unknown:
        raise ValueError(f"config file {path}: unknown sections {sorted(unknown)}")
    return flat


# `[server]` keys naming the environment variable of a secret -> the setting that holds its value.
SECRET_ENV_KEYS = {"node_token_env": "node_token", "metrics_token_env": "metrics_token"}
# Settings a config file may not hold: secrets (their *_env key names the variable instead), and what
# the command line resolves itself (the state directory, the checkpoint directory behind `model`).
_NOT_FILE_KEYS = {
    "node_token": "a secret is not read from the file: name its environment variable with node_token_env",
    "metrics_token": "a secret is not read from the file: name its environment variable with metrics_token_env",
    "home": "the state directory is --home (or $PREFIXGATE_HOME), not a config key",
    "model_dir": "name the checkpoint with `model` (a directory, 'smol' or 'tiny')",
}
_ROUTE_ENV_KEYS = ("api_key_env", "node_token_env")


def _refuse_command_line_only_keys(path: Path, flat: dict[str, Any]) -> None:
    for key, why in _NOT_FILE_KEYS.items():
        if key in flat:
            raise ValueError(f"config file {path}: `{key}`: {why}")


def _secret_from_env(path: Path, key: str, var: str) -> str:
    """The value of the variable a ``*_env`` key names; an unset or empty one fails start-up, as the
    flags do: a node whose token did not reach its environment must not start as a non-node."""
    value = os.environ.get(str(var))
    if not value:
        raise ValueError(f"config file {path}: {key} = {var!r}: that environment variable is empty or unset")
    return value


def _check_route_env_vars(path: Path, routes: Any) -> None:
    """A route's ``api_key_env`` / ``node_token_env`` must name a set variable (omit the key for a
    keyless upstream). ``tenant_api_key_envs`` is exempt: a tenant without its own key uses the shared one."""
    if not isinstance(routes, list):
        return  # the settings model reports the wrong shape
    for route in routes:
        if not isinstance(route, dict):
            continue
        for key in _ROUTE_ENV_KEYS:
            var = route.get(key)
            if var:
                _secret_from_env(path, f"route {route.get('model')!r}: {key}", var)
