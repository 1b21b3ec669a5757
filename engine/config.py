"""Engine configuration: frozen, validated once, never mutated.

Values discovered at run time (how many KV blocks fit, the model's context length) live in
``EngineRuntimeInfo`` objects built by the engine, not here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

KVDtype = Literal["auto", "bfloat16", "float16", "float32", "fp8", "int8"]
ComputeDtype = Literal["auto", "bfloat16", "float16", "float32"]
# Short names users type (vLLM's --kv-cache-dtype / --dtype spellings) -> the canonical ones.
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32",
                 "fp8_e4m3": "fp8"}
KV_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8", "int8")
COMPUTE_DTYPES = ("auto", "bfloat16", "float16", "float32")
EvictionPolicyName = Literal["cost", "lru"]
KVPageLayoutName = Literal["auto", "token", "head"]
KV_PAGE_LAYOUTS = ("auto", "token", "head")
# Default ``max_mixed_prefill_tokens`` on a CPU device: a step of 2,048 prefill tokens takes seconds
# on a CPU, and every decode riding in it waits that long; a 256-token step costs ~1/8 of that and
# keeps the prefill throughput (measured in docs/engine.md, "Prefill cap in shared steps").
CPU_MIXED_PREFILL_TOKENS = 256


@dataclass(frozen=True)
class EngineConfig:
    """Args:
    model_dir: a Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer).
    device: "cpu" or "cuda" (or "cuda:N").
    dtype: compute dtype; "auto" = float32 on CPU, bfloat16 on CUDA.
    kv_dtype: KV cache storage; "auto" follows dtype; fp8 (e4m3) and int8 quantize on write.
    block_size: tokens per KV block (the prefix-cache granularity).
    kv_page_layout: the order of a block's bytes in device memory (``engine.kv_layout``): "token"
        (a token's KV heads adjacent) or "head" (each page head by head); "auto" = head on CUDA,
        token on CPU. Blocks leave the pool in token order either way.
    num_kv_blocks: HBM blocks; None = size from ``kv_memory_fraction`` of free device memory
        (CUDA) or ``cpu_kv_bytes`` (CPU).
    max_num_seqs: most requests in one running batch.
    max_num_batched_tokens: per-step token budget (prefill chunks + decodes).
    max_mixed_prefill_tokens: most prefill tokens in a step that more than one request may share
        (bounds a decode's time per token, and a newcomer's wait, under other requests' long
        prompts); a lone request's prefill still gets ``max_num_batched_tokens``. None = the
        device's default (``CPU_MIXED_PREFILL_TOKENS`` on CPU, no cap on CUDA), 0 = no cap (every
        step may fill ``max_num_batched_tokens`` with prefill).
    enable_prefix_caching: off = every request computes its whole prompt (for comparisons).
    eviction_policy: "cost" (reuse frequency x recompute cost) or "lru".
    max_waiting: most queued requests before generate() raises EngineOverloadedError.
    prepare_workers: threads that prepare requests (chat render, tokenization, validation) off the
        event loop; each tenant uses at most one at a time (engine.tenant_lanes).
    prepare_queued_per_tenant: most requests of one tenant waiting behind its one being prepared;
        more: generate() raises PrepareQueueFullError (429).
    seed: seeds the model's random weights where a test builds one, and default sampling.
    num_threads: torch intra-op threads for CPU compute (process-wide); None = torch's default.
    use_cuda_graphs: on a CUDA device, replay decode steps (and one-sequence prefill steps of up to
        ``prefill_graph_tokens`` new tokens) from captured CUDA graphs.
    warm_up_kernels: on a CUDA device, run once at start an eager step of each distinct launch the
        eager path may make, then the kernels of a request's features once each (the sampling penalties
        and the sampler's other paths, a scored prompt, the block moves of a copy-on-write and a KV
        export or import, the prefill's split merge at every split count; engine/kernel_warmup.py), so
        that Triton compiles those kernels before a request waits for them; False starts faster and
        compiles at first use instead.
    prefill_graph_tokens: the longest one-sequence prefill step replayed from a graph (a prefix
        hit's suffix, a chat turn), capped by ``max_num_batched_tokens`` and the model's context;
        0 = prefill steps always run eagerly (engine/prefill_graphs.py).
    overlap_steps: schedule and launch step n+1 while the device runs step n (the host reads
        step n's tokens one step behind; engine/llm_engine.py); None = on for a CUDA device.
    kv_events_endpoint: publish the HBM index's stored/removed blocks on this ZMQ endpoint
        (``tcp://host:port``, vLLM's KV event schema; ``engine.kv_events``) for a fleet's router;
        None = not published.
    dtype / kv_dtype also accept the short names bf16, fp16, fp32 (normalized here).
    """

    model_dir: Path
    device: str = "cpu"
    dtype: ComputeDtype = "auto"
    kv_dtype: KVDtype = "auto"
    block_size: int = 16
    kv_page_layout: KVPageLayoutName = "auto"
    num_kv_blocks: int | None = None
    kv_memory_fraction: float = 0.85
    cpu_kv_bytes: int = 256 * 1024 * 1024
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_mixed_prefill_tokens: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    eviction_policy: EvictionPolicyName = "cost"
    max_waiting: int = 4096
    prepare_workers: int = 4
    prepare_queued_per_tenant: int = 64
    use_cuda_graphs: bool = True
    warm_up_kernels: bool = True
    prefill_graph_tokens: int = 512
    dram_bytes: int = 0
    nvme_dir: Path | None = None
    nvme_bytes: int = 0
    model_id: str | None = None
    num_threads: int | None = None
    kv_events_endpoint: str | None = None
    overlap_steps: bool | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "model_dir", Path(self.model_dir))
        object.__setattr__(self, "dtype", DTYPE_ALIASES.get(self.dtype, self.dtype))
        object.__setattr__(self, "kv_dtype", DTYPE_ALIASES.get(self.kv_dtype, self.kv_dtype))
        if self.dtype not in COMPUTE_DTYPES:
            raise ValueError(f"dtype must be one of {'/'.join(COMPUTE_DTYPES)} (or bf16/fp16/fp32), got {self.dtype!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {'/'.join(KV_DTYPES)} (or bf16/fp16/fp32), got {self.kv_dtype!r}")
        if self.kv_page_layout not in KV_PAGE_LAYOUTS:
            raise ValueError(f"kv_page_layout must be one of {'/'.join(KV_PAGE_LAYOUTS)}, got {self.kv_page_layout!r}")
        if self.prepare_workers < 1 or self.prepare_queued_per_tenant < 0:
            raise ValueError(f"prepare_workers must be >= 1 and prepare_queued_per_tenant >= 0, got "
                             f"{self.prepare_workers} and {self.prepare_queued_per_tenant}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.nvme_dir is not None:
            object.__setattr__(self, "nvme_dir", Path(self.nvme_dir))
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8/16/32/64/128, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError("num_kv_blocks must be >= 2")
        if not 0.05 <= self.kv_memory_fraction <= 0.98:
            raise ValueError("kv_memory_fraction must be in [0.05, 0.98]")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < self.block_size:
            raise ValueError("max_num_seqs must be >= 1 and max_num_batched_tokens >= block_size")
        if self.max_mixed_prefill_tokens is not None and self.max_mixed_prefill_tokens < 0:
            raise ValueError(f"max_mixed_prefill_tokens must be >= 0 (0 = no cap), got {self.max_mixed_prefill_tokens}")
        if self.prefill_graph_tokens < 0 or self.prefill_graph_tokens == 1:
            raise ValueError(f"prefill_graph_tokens must be 0 (off) or >= 2, got {self.prefill_graph_tokens}")
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.eviction_policy not in ("cost", "lru"):
            raise ValueError(f"eviction_policy must be 'cost' or 'lru', got {self.eviction_policy!r}")
        for name in ("dram_bytes", "nvme_bytes", "cpu_kv_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")

    @property
    def mixed_prefill_cap(self) -> int | None:
        """The scheduler's ``max_mixed_prefill_tokens``: None = no cap. On CUDA a 2,048-token
        prefill step takes tens of milliseconds and the GPU's prefill throughput needs full steps,
        so only a CPU device gets a cap by default."""
        if self.max_mixed_prefill_tokens is None:
            return CPU_MIXED_PREFILL_TOKENS if self.device == "cpu" else None
        return self.max_mixed_prefill_tokens or None

    @property
    def resolved_model_id(self) -> str:
        return self.model_id or self.model_dir.name


def parse_size(text: str | int) -> int:
    """'512MiB', '8GiB', '1.5GB', '4096' -> bytes. Raises ValueError with a clear message."""
    if isinstance(text, int):
        return text
    units = {
        "": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
        "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4,
        "tib": 1024**4,
    }
    s = str(text).strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    try:
        value = float(num)
    except ValueError:
        raise ValueError(f"invalid size {text!r}: expected e.g. 512MiB, 8GiB or plain bytes") from None
    if unit not in units or value < 0:
        raise ValueError(f"invalid size {text!r}: expected e.g. 512MiB, 8GiB or plain bytes")
    return int(value * units[unit])
