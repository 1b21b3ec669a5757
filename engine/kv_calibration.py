"""fp8 KV-cache calibration: a per-channel key bias and per-layer scales, from one unquantized forward.

Key bias (what makes fp8 work): keys carry large per-channel offsets (SmolLM2: channel means up to
~14 against a per-layer max of ~17), so most of each key's magnitude is the same for every token,
and e4m3's ~3.6% relative rounding error on that shared part swamps the part that differs. The
cache stores ``k - mu`` instead, ``mu`` = the layer's mean key per (kv head, channel) over the
calibration text. Attention is unchanged: ``q . (k - mu) = q . k - q . mu`` and ``q . mu`` is the
same for every key of a query, which softmax ignores. Measured on 2,048 tokens of real text: fp8
K+V perplexity +4.38% with plain keys, -0.62% (noise) with the bias; K alone caused +4.32%, V
+0.28%.

e4m3 holds magnitudes up to 448 with ~3 significant bits, and subnormals below 2^-6. A fixed scale
of 1.0 (x stored as is) clips a layer whose keys reach hundreds and flushes small values of a layer
whose keys stay below 0.1. A per-layer scale ``HEADROOM * amax / 448`` (rounded up to a power of
two) maps each layer's observed range onto the top of the format's range, leaving ``HEADROOM`` (2 binades) above it for inputs
whose K/V exceed what the calibration text produced: e4m3's normal range spans ~15 binades, so
the headroom costs no precision where the values are, while a clipped outlier would.

How the amax is observed: the model runs once over ``CALIBRATION_TEXT`` with a recording stand-in
for the KV ops: it notes ``|k|`` and ``|v|`` maxima per layer and attends over the chunk's own,
unquantized K/V (plain causal SDPA, nothing written to the cache), so every layer sees exactly the
activations an unquantized cache would give it. The text is fixed, so every process serving the
same checkpoint computes the same scales (exported fp8 blocks stay valid across nodes).

The scales live in one float32 tensor ``[num_layers, 2 (k|v), 1]`` and the bias in one
``[num_layers, num_kv_heads, head_dim]`` tensor owned by the runner; each layer's ``LayerCache``
holds views of them. The kernels' per-tensor scale interface is unchanged: the plain path
subtracts the bias before ``write_kv`` (engine/models/attention.py); the fused GPU path passes it
to ``rotary_write_kv``, which subtracts it after RoPE (prefixgate_kernels/rotary.py). No attention kernel
reads it (softmax cancels the shift).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from prefixgate_kernels.reference import FP8_MAX

HEADROOM = 4.0

# English prose, code and a chat turn: the kinds of text a served cache holds.
CALIBRATION_TEXT = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    "Summarize the history of the printing press in three sentences, then list two open questions.<|im_end|>\n"
    "<|im_start|>assistant\nThe printing press, developed by Johannes Gutenberg around 1440, used movable "
    "metal type to reproduce text far faster than hand copying. Within fifty years presses operated in more "
    "than two hundred European cities, spreading literacy, scientific results and religious debate. Cheap "
    "books changed how knowledge was stored, checked and taught.\n\n1. How quickly did literacy rates "
    "respond?\n2. What did scribes do afterwards?<|im_end|>\n"
    "def merge(a: list[int], b: list[int]) -> list[int]:\n    out, i, j = [], 0, 0\n"
    "    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n"
    "        else:\n            out.append(b[j]); j += 1\n    return out + a[i:] + b[j:]\n\n"
    "Table 3: 2019 revenue was $12.4M (up 8.5%), 2020 was $10.1M, and 2021 reached $15,730,000.\n"
)


class AmaxRecorder:
    """Stands in for the KV ops (an ``engine.models.kernel_ops.AttentionOps``) during one prefill from
    position 0 (one sequence).

    ``write_kv`` records each layer's K/V absolute maxima (calls arrive in layer order) and keeps
    the new K/V; ``paged_prefill_attention`` attends causally over exactly those tensors.
    """

    def __init__(self, centre_keys: bool = True) -> None:
        self.centre_keys = centre_keys
        self.k_mean: list[torch.Tensor] = []  # per layer [Hkv, D] (zeros when keys are not centred)
        self.k_amax: list[float] = []  # of the stored keys: k - mean, or k
        self.v_amax: list[float] = []
        self._kv: tuple[torch.Tensor, torch.Tensor] | None = None

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> None:
        # key, value: [T, Hkv, D]
        mean = key.float().mean(dim=0) if self.centre_keys else torch.zeros_like(key[0], dtype=torch.float32)
        self.k_mean.append(mean)
        self.k_amax.append(float((key.float() - mean).abs().amax()))
        self.v_amax.append(float(value.float().abs().amax()))
        self._kv = (key, value)

    def paged_prefill_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                seq_lens: torch.Tensor, scale: float, k_scale: torch.Tensor | None = None,
                                v_scale: torch.Tensor | None = None, *,
                                context_lens: Sequence[int] | None = None) -> torch.Tensor:
        assert self._kv is not None, "write_kv runs before attention"
        key, value = self._kv
        group = q.shape[1] // key.shape[1]
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, T, D]
        kh = key.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0)
        vh = value.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(qh.float(), kh.float(), vh.float(), scale=scale, is_causal=True)
        return out.squeeze(0).transpose(0, 1).to(q.dtype)

    def paged_decode_attention(self, *args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("calibration runs a prefill only")


def fp8_scales_from_amax(k_amax: list[float], v_amax: list[float]) -> torch.Tensor:
    """Per-layer scales [L, 2, 1] float32: ``HEADROOM * amax / FP8_MAX`` rounded up to a power of
    two (floored so an all-zero layer stays finite).

    Why a power of two: dividing by it only shifts exponents, so quantization adds no rounding of
    its own; the scale's one job is to place the layer's range inside e4m3's normal range."""
    amax = torch.tensor([k_amax, v_amax], dtype=torch.float32).T  # [L, 2]
    raw = HEADROOM * amax.clamp(min=1e-6) / FP8_MAX
    return torch.exp2(torch.ceil(torch.log2(raw))).unsqueeze(-1)


def calibrate_fp8(
    run_prefill: Callable[[AmaxRecorder], None], num_layers: int, *, centre_keys: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``run_prefill(recorder)`` (one forward of the calibration tokens with ``recorder`` as the
    KV ops). Returns (scales [num_layers, 2, 1], key bias [num_layers, Hkv, D]), float32 on CPU.

    ``centre_keys=False`` gives a zero bias and scales for the raw keys: fp8 without the bias, a
    baseline to compare against."""
    recorder = AmaxRecorder(centre_keys)
    run_prefill(recorder)
    if len(recorder.k_amax) != num_layers:
        raise RuntimeError(f"calibration saw {len(recorder.k_amax)} layers, expected {num_layers}")
    bias = torch.stack([m.cpu() for m in recorder.k_mean])
    return fp8_scales_from_amax(recorder.k_amax, recorder.v_amax), bias
