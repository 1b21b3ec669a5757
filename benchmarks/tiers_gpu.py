"""Restore a 16K-token prefix of the 8B-shaped model's KV (2 GiB) from DRAM / NVMe vs recomputing it.

One run, on one GPU, measures side by side (docs/gpu.md, "KV tiers on the GPU", has the
predictions written before the first run and the results):

    ceilings    pinned and pageable host-to-device copy of 2 GiB (the link)
    kernel      ChaCha20-Poly1305 opened by the Triton kernels on device-resident ciphertext (32 x 64 MiB),
                checked byte for byte against the plaintext `cryptography` sealed
    recompute   the engine's TTFT of a fresh 16,384-token prompt (the 8B-shaped random bf16 model, one step)
    restore     TierManager.restore + runner.import_blocks of the same 1,024 blocks, until they are in
                the KV pool, for each tier (DRAM pinned, NVMe files with the page cache dropped) and mode:
                  plain       no encryption (InsecureNullCipher): the stored blobs copied to HBM
                  gpu_chacha  ChaCha20-Poly1305 blobs: ciphertext over the link, opened in HBM (DeviceAeadOpener)
                  cpu_chacha  the same blobs decrypted by `cryptography` on 8 CPU threads into pinned
                              buffers, copies pipelined (PinnedHostOpener: the fallback and oracle)
                  cpu_aes     AES-256-GCM blobs (tenancy's default), the same CPU path
                every restored tensor is compared with the original KV bytes; ``demote_s`` is the time to
                spill the 2 GiB into the tier (gpu_chacha: sealed in HBM from device memory by
                DeviceSealer; cpu_chacha / cpu_aes: `cryptography` on the tier's worker threads)
    stepload    decode step time p50 / p99 of 32 sequences whose KV pool evicts cached blocks to DRAM on
                (nearly) every step, against the same workload with tiers off, in one run: modes off,
                gpu_seal (the CUDA default: device gather, sealed in HBM), cpu_seal (host export +
                `cryptography`: the fallback), off again (the run-to-run noise)
    engine_ttft the engine's TTFT (scheduler, restore, import, prefill of the 15-token suffix) of a request
                whose 16,384-token prefix is restored from DRAM, against the same-sized prompt recomputed
                and the prefix hit in HBM, in the same engine

    python benchmarks/tiers_gpu.py [--out FILE] [--trials 5] [--nvme-dir DIR]
    python benchmarks/tiers_gpu.py --smoke            # CPU, tiny shapes, kernels in Triton's interpreter

Writes ``benchmarks/results/tiers_gpu_h200.json`` (or ``--out``) with command, machine and commit.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import gc
import json
import os
import platform
import pstats
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.provenance import git_commit  # noqa: E402 - after the path insert

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import torch  # noqa: E402
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305  # noqa: E402

from engine.config import KV_PAGE_LAYOUTS, EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.model_runner import ModelRunner  # noqa: E402
from engine.models.random_init import LLAMA31_8B_SHAPE, build_random_model, llama_config_dict  # noqa: E402
from engine.models.spec import parse_checkpoint_config  # noqa: E402
from engine.protocol import BlockCipher, GenerateRequest, SamplingParams, StaticTenantScope  # noqa: E402
from engine.tiers import InsecureNullCipher, TierManager, TierRates  # noqa: E402
from engine.tiers.device_kv import DeviceKV  # noqa: E402
from engine.tiers.engine_hook import TierHook  # noqa: E402
from engine.tiers.gpu_opener import DeviceAeadOpener, PinnedHostOpener  # noqa: E402
from engine.tiers.gpu_sealer import DeviceSealer  # noqa: E402
from engine.tiers.opener import OpenedRuns, SealedRun, SegmentOpener  # noqa: E402
from prefixgate_kernels import chacha20_poly1305 as gpu_aead  # noqa: E402
from prefixgate_kernels.jit_watch import CompileRecorder  # noqa: E402
from tenancy.crypto import TenantCipher, new_data_key  # noqa: E402

SMOKE_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "rms_norm_eps": 1e-5,
               "rope_theta": 10000.0, "max_position_embeddings": 4096}
MODES = ("plain", "gpu_chacha", "cpu_chacha", "cpu_aes")


ID_VOCAB = 1 << 17  # ids IdTokenizer can stand for: 131,072 >= Llama 3's 128,256


class IdTokenizer:
    """Random-weight models have no vocabulary: token ids are the text."""

    eos_token_id = None
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(f" {int(i)}" for i in ids)

    def get_vocab(self) -> dict[str, int]:
        """Token text -> id as ``decode`` writes it, for every id a Llama 3 vocabulary (128,256) can
        hold: the runner reads the longest entry for its prompt bound (engine.prompt_bounds)."""
        return {f" {i}": i for i in range(ID_VOCAB)}


class PlainCopyOpener:
    """No encryption (the blobs are the plaintext: ``InsecureNullCipher``): each stored segment's
    wanted blocks copied to the device on a side stream. The floor every encrypted mode is measured
    against. Benchmark only."""

    def __init__(self, device: torch.device):
        self.device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def open_runs(self, cipher: BlockCipher, runs: Sequence[SealedRun], block_bytes: int) -> OpenedRuns:
        row = 0
        with torch.cuda.stream(self._stream) if self._stream is not None else _nothing():
            out = torch.empty(sum(r.count for r in runs), block_bytes, dtype=torch.uint8, device=self.device)
            for r in runs:
                src = torch.frombuffer(r.blob, dtype=torch.uint8)[r.first * block_bytes:(r.first + r.count) * block_bytes]
                out[row:row + r.count].copy_(src.view(r.count, block_bytes), non_blocking=True)
                row += r.count
        if self._stream is not None:
            self._stream.synchronize()
        return OpenedRuns(len(runs), out)

    def close(self) -> None:
        pass


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn: Callable[[], Any], dev: torch.device) -> float:
    sync(dev)
    t0 = time.perf_counter()
    fn()
    sync(dev)
    return time.perf_counter() - t0


# ---- sections ----------------------------------------------------------------------------------------
def sec_ceilings(dev: torch.device, nbytes: int, trials: int) -> dict:
    if dev.type != "cuda":
        return {"skipped": "no CUDA"}
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    pinned.fill_(1)
    pageable.fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    out = {}
    for name, src in (("pinned", pinned), ("pageable", pageable)):
        dst.copy_(src, non_blocking=True)
        ts = [timed(lambda s=src: dst.copy_(s, non_blocking=True), dev) for _ in range(trials)]
        out[f"h2d_{name}_ms"] = 1e3 * statistics.median(ts)
        out[f"h2d_{name}_GBps"] = nbytes / statistics.median(ts) / 1e9
    return out


def sec_kernel(dev: torch.device, seg_bytes: int, segments: int, trials: int) -> dict:
    """Device-resident ciphertext: what the kernels alone cost (no link)."""
    key = new_data_key()
    aead = ChaCha20Poly1305(key)
    plain = torch.randint(0, 256, (seg_bytes,), dtype=torch.uint8).numpy().tobytes()
    raw, spans = bytearray(), []
    for i in range(segments):
        nonce, aad = os.urandom(12), b"aad-%d" % i
        sealed = aead.encrypt(nonce, plain, aad)
        off = len(raw) + 16
        raw += bytes(16) + sealed[:-16] + bytes(-(len(sealed) - 16) % 64)
        spans.append(gpu_aead.SealedSpan(nonce, off // 4, seg_bytes, sealed[-16:], aad, i * seg_bytes // 4))
    src = torch.frombuffer(raw, dtype=torch.uint8).to(dev).view(torch.int32)
    dst = torch.empty(segments * seg_bytes // 4, dtype=torch.int32, device=dev)
    ok = gpu_aead.open_sealed(key, src, spans, dst)  # compile + check
    expect = torch.frombuffer(bytearray(plain), dtype=torch.uint8).to(dev)
    equal = all(torch.equal(dst.view(torch.uint8)[i * seg_bytes:(i + 1) * seg_bytes], expect) for i in range(segments))
    ts = [timed(lambda: gpu_aead.open_sealed(key, src, spans, dst), dev) for _ in range(trials)]
    total = segments * seg_bytes
    # the kernels without the host's per-segment work (Poly1305 key, AAD, tag): device time only
    r = [gpu_aead.poly1305_key(key, s.nonce)[0] for s in spans]

    def kernels_only() -> None:
        for s, rr in zip(spans, r, strict=True):
            gpu_aead.poly1305_lane_sums(src, s.ct_word, s.nbytes, rr)
            gpu_aead.chacha20_xor(src, s.ct_word, s.nbytes, key, s.nonce, 1, dst, s.out_word)

    tk = [timed(kernels_only, dev) for _ in range(trials)]
    return {"segments": segments, "segment_bytes": seg_bytes, "tags_ok": all(ok), "plaintext_equal": equal,
            "open_ms": 1e3 * statistics.median(ts), "open_GBps": total / statistics.median(ts) / 1e9,
            "kernels_ms": 1e3 * statistics.median(tk), "kernels_GBps": total / statistics.median(tk) / 1e9}


def make_runner(dev: torch.device, shape: dict, prefix: int, blocks: int, max_num_seqs: int = 4,
                graphs: bool = False, kv_page_layout: str = "auto") -> ModelRunner:
    cfg = llama_config_dict(**shape)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
        arch = parse_checkpoint_config(Path(tmp), prefix + 256)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = build_random_model(arch, dev, dtype, seed=0)
    config = EngineConfig(model_dir=Path("random-8b"), device=str(dev), num_kv_blocks=blocks, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=prefix + 256, max_model_len=prefix + 256, use_cuda_graphs=graphs,
                          prefill_graph_tokens=0,  # decode graphs only: these runs time restores and decode steps
                          kv_page_layout=kv_page_layout)
    return ModelRunner(config, arch=arch, tokenizer=IdTokenizer(), model=model)


def sec_recompute(dev: torch.device, runner: ModelRunner, prefix: int, trials: int) -> dict:
    """TTFT of a fresh prompt of ``prefix`` tokens: what a restore saves (one prefill step)."""
    config, vocab = runner.config, runner.arch.vocab_size
    g = torch.Generator().manual_seed(5)

    def ttft(n: int) -> float:
        engine = LLMEngine(config, runner)
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        engine.add_request(GenerateRequest("r", StaticTenantScope(), SamplingParams(max_tokens=1, temperature=0.0),
                                           prompt_token_ids=ids))
        sync(dev)
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        sync(dev)
        return time.perf_counter() - t0

    ttft(min(prefix, 2048))
    ttft(prefix)  # first use of the full shape
    ts = [ttft(prefix) for _ in range(trials)]
    return {"tokens": prefix, "ttft_ms": 1e3 * statistics.median(ts), "ttft_all_ms": [1e3 * t for t in ts]}


def drop_page_cache_of(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def sec_restore(dev: torch.device, runner: ModelRunner, tier: str, mode: str, num_blocks: int, seg_blocks: int,
                trials: int, data: torch.Tensor, nvme_root: Path) -> dict:
    bb = runner.kv_bytes_per_block
    cipher: BlockCipher = InsecureNullCipher() if mode == "plain" else TenantCipher(new_data_key(), owner="bench")
    opener: SegmentOpener = {"plain": lambda: PlainCopyOpener(dev), "gpu_chacha": lambda: DeviceAeadOpener(dev),
                             "cpu_chacha": lambda: PinnedHostOpener(dev), "cpu_aes": lambda: PinnedHostOpener(dev)}[mode]()
    total = num_blocks * bb
    room = 2 * total + (64 << 20)
    nvme_dir = nvme_root / f"{tier}-{mode}"
    sizes = {"dram_bytes": room} if tier == "dram" else {"nvme_dir": nvme_dir, "nvme_bytes": room}
    # min_gain=0: store whatever is demoted. At its default rates the cost model drops 64 MiB NVMe
    # segments (recomputing 512 tokens is cheaper than reading them back): the first run stored none.
    sealer = DeviceSealer(dev) if mode == "gpu_chacha" else None
    m = TierManager(model_id="bench-8b", block_size=16, block_bytes=bb, max_segment_blocks=seg_blocks,
                    max_workers=8, pin_memory=dev.type == "cuda", opener=opener, rates=TierRates(min_gain=0.0),
                    device_seal=mode in ("gpu_chacha", "cpu_chacha"), sealer=sealer, **sizes)
    try:
        who = StaticTenantScope(namespace=b"bench-" + mode.encode(), metrics_label=mode, cipher=cipher)
        hashes = [os.urandom(32) for _ in range(num_blocks)]
        # gpu_chacha spills from device memory (what the engine's CUDA spill path hands over)
        src = data.to(dev) if sealer is not None else data
        sync(dev)
        t0 = time.perf_counter()
        futs = [m.demote(who, hashes[i:i + seg_blocks],
                         DeviceKV(src[i:i + seg_blocks]) if sealer is not None else src[i:i + seg_blocks])
                for i in range(0, num_blocks, seg_blocks)]
        stored = sum(sum(f.result().stored.values()) for f in futs)
        m.drain()
        demote_s = time.perf_counter() - t0
        del src
        if stored != num_blocks:
            return {"error": f"only {stored} of {num_blocks} blocks stored"}
        ids = list(range(num_blocks))
        expect = data.to(dev)
        times, equal = [], True
        for trial in range(trials + 1):  # the first one warms up (kernels compiled, pools started)
            if tier == "nvme":
                drop_page_cache_of(nvme_dir)
            match = m.lookup(who.namespace, hashes)
            sync(dev)
            t0 = time.perf_counter()
            res = m.restore(who, match).result()
            got = res.data if isinstance(res.data, torch.Tensor) else \
                torch.frombuffer(bytearray(res.data), dtype=torch.uint8).view(-1, bb)
            runner.import_blocks(ids[:res.num_blocks], got)
            sync(dev)
            if trial:
                times.append(time.perf_counter() - t0)
            equal = equal and res.num_blocks == num_blocks and torch.equal(got.to(dev), expect)
        back = runner.export_blocks(ids[:8])  # what landed in the KV pool
        equal = equal and torch.equal(back, data[:8])
        med = statistics.median(times)
        return {"tier": tier, "mode": mode, "blocks": num_blocks, "bytes": total, "restore_ms": 1e3 * med,
                "restore_all_ms": [1e3 * t for t in times], "GBps": total / med / 1e9, "plaintext_equal": equal,
                "demote_s": demote_s, "demote_GBps": total / demote_s / 1e9, "sealed_on_device": bool(sealer and sealer.sealed),
                "stored_bytes": m.stats()[tier]["used_bytes"]}
    finally:
        m.close()
        del m
        gc.collect()


def _tenant(name: str) -> StaticTenantScope:
    return StaticTenantScope(namespace=b"bench-" + name.encode(), metrics_label=name,
                             cipher=TenantCipher(new_data_key(), owner=name))


def _tier_hook(dev: torch.device, runner: ModelRunner, mode: str, dram_bytes: int, seg_blocks: int) -> TierHook | None:
    """The engine's tier hook in one of the benchmark's modes (None: tiers off). gpu_seal is what
    ``build_tier_hook`` builds on a CUDA host; cpu_seal is the fallback path (host export,
    `cryptography` on the workers), both opened on the device on restore."""
    if mode == "off":
        return None
    gpu = mode == "gpu_seal"
    m = TierManager(model_id="bench-8b", block_size=16, block_bytes=runner.kv_bytes_per_block, dram_bytes=dram_bytes,
                    max_segment_blocks=seg_blocks, pin_memory=dev.type == "cuda", opener=DeviceAeadOpener(dev),
                    rates=TierRates(min_gain=0.0), device_seal=True, sealer=DeviceSealer(dev) if gpu else None,
                    max_workers=2 if dev.type == "cuda" else 1)  # --smoke: Triton's interpreter is not thread-safe
    return TierHook(m, runner, device_spill=gpu)


def _timed(fn: Callable[..., Any], acc: list[float], label: str) -> Callable[..., Any]:
    """``fn`` adding its wall and thread-CPU seconds to ``acc[0]`` / ``acc[1]`` (per-step counters),
    and named ``label`` in a torch.profiler trace (``--stepload-trace``)."""
    def wrapped(*a: Any, **k: Any) -> Any:
        w0, c0 = time.perf_counter(), time.thread_time()
        try:
            with torch.profiler.record_function(label):
                return fn(*a, **k)
        finally:
            acc[0] += time.perf_counter() - w0
            acc[1] += time.thread_time() - c0
    return wrapped


def _percentile(xs: Sequence[float], q: float) -> float:
    ys = sorted(xs)
    return ys[min(len(ys) - 1, max(0, round(q * (len(ys) - 1))))]


def sec_stepload(dev: torch.device, runner: ModelRunner, *, seqs: int, prompt: int, decode: int, pool: int,
                 filler: int, dram_bytes: int, seg_blocks: int, modes: Sequence[str], profile: bool = False,
                 trace: bool = False, trace_dir: Path | None = None) -> dict:
    """Per-step wall time of ``seqs`` sequences decoding ``decode`` tokens while the pool evicts.

    The pool (``pool`` blocks) is first filled with cached blocks of finished ``filler``-token
    prompts; then every block a decoding sequence grows into evicts one of them (spilled to DRAM
    when tiers are on). Prompt lengths are staggered (``prompt + i % 16``) so the sequences cross
    block boundaries on different steps: ~seqs/16 evictions on every step, not a burst every 16th.

    A step's time is the interval between two steps' outputs in a free-running loop, the cadence a
    client sees (its time per output token): with overlapped steps the host prepares step n+1 while
    the device runs step n, so a spill's host work costs nothing until host time passes device time.
    (Session 5's runs 1-5 synchronised before each step, which timed the host's part alone: the
    gpu_seal "overhead" they showed was host work the overlap hides; ``cpu_p50_ms`` still shows it.)"""
    vocab = runner.arch.vocab_size
    config = dataclasses.replace(runner.config, max_num_seqs=seqs)
    out: dict[str, Any] = {"seqs": seqs, "prompt_tokens": prompt, "decode_tokens": decode, "pool_blocks": pool,
                           "block_bytes": runner.kv_bytes_per_block,
                           "cuda_graphs": runner.decode_graphs is not None, "runs": []}
    t_section = time.perf_counter()

    def run(mode: str, steps: int) -> dict:
        g = torch.Generator().manual_seed(11)
        t_run = time.perf_counter()
        # "<mode>_si": the same with a 0.2 ms GIL switch interval (default 5 ms): how much of a spill's
        # cost is the step loop waiting for the GIL that a tier worker's Python holds
        base_mode, short_switch = (mode[:-3], True) if mode.endswith("_si") else (mode, False)
        switch0 = sys.getswitchinterval()
        if short_switch:
            sys.setswitchinterval(2e-4)
        hook = _tier_hook(dev, runner, base_mode, dram_bytes, seg_blocks)
        compiles = CompileRecorder()
        engine = LLMEngine(config, runner, lower_tier=hook, num_blocks=pool)
        who = _tenant(mode)
        try:
            for i in range(-(-pool * 16 // filler) + 1):  # fill the pool with cached, evictable blocks
                engine.add_request(GenerateRequest(f"f{i}", who, SamplingParams(max_tokens=1, temperature=0.0),
                                                   prompt_token_ids=torch.randint(0, vocab, (filler,), generator=g).tolist()))
                while engine.has_unfinished():
                    engine.step()
            if hook is not None:
                hook.flush_spills()
                hook.manager.drain()
            evicted0 = engine.cache.num_evictions
            for i in range(seqs):
                engine.add_request(GenerateRequest(f"d{i}", who, SamplingParams(max_tokens=steps, temperature=0.0,
                                                                                ignore_eos=True),
                                                   prompt_token_ids=torch.randint(0, vocab, (prompt + i % 16,),
                                                                                  generator=g).tolist()))
            times, cpu, replay_at, evicting, n = [], [], [], [], 0
            # each graph replay's device time from its own event pair, read after the run: a per-step
            # ``last_replay_ms()`` waits for the replay just launched, which takes the overlap away
            # (the host then prepares every step while the device idles: session 6's runs 3-8 and
            # session 7's run 1 timed steps that way, host work and device work added up)
            graphs = runner.decode_graphs
            if graphs is not None:
                graphs.replay_log = []
            # the hook's own calls on the step loop (spill copies, flushes): wall and thread CPU per step
            # per step, wall and CPU seconds of the hook's calls on the step loop, and of which the
            # hand-off to the tier manager (its submit)
            acc = {k: [0.0, 0.0] for k in ("hook", "demote")}
            per_step: dict[str, list[tuple[float, float]]] = {k: [] for k in acc}
            if hook is not None:
                for name in ("spill", "flush_spills"):
                    setattr(hook, name, _timed(getattr(hook, name), acc["hook"], f"hook.{name}"))
                hook.manager.demote = _timed(hook.manager.demote, acc["demote"], "hook.demote")
            prof = cProfile.Profile() if profile else None  # the step loop's thread only
            if prof is not None:
                prof.enable()
            # a torch.profiler trace of a spilling run: the CUDA runtime calls' host time, per name
            acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda" else [])
            tracer = torch.profiler.profile(activities=acts) if trace and base_mode != "off" else None
            if tracer is not None:
                tracer.__enter__()
            sync(dev)
            compiles.start()
            t_prev = time.perf_counter()
            while engine.has_unfinished():
                e0 = engine.cache.num_evictions
                c0 = time.thread_time()
                for a in acc.values():
                    a[0] = a[1] = 0.0
                if tracer is not None:  # each step named in the trace, to find the slow ones in the timeline
                    with torch.profiler.record_function(f"stepload.step {n + 1}"):
                        outs = engine.step()
                else:
                    outs = engine.step()
                now = time.perf_counter()
                dt, dc, t_prev = now - t_prev, time.thread_time() - c0, now
                n += 1
                if n > 2 and len(outs) == seqs:  # every sequence decoding (after the prefill steps)
                    times.append(dt)
                    cpu.append(dc)
                    for k, a in acc.items():
                        per_step[k].append((a[0], a[1]))
                    # the replay this call launched (overlapped steps: the one whose output the next call returns)
                    replay_at.append(len(graphs.replay_log) - 1 if graphs is not None and graphs.replay_log else None)
                    evicting.append(engine.cache.num_evictions > e0)
            if prof is not None:
                prof.disable()
            replay: list[float] = []
            if graphs is not None:
                log, graphs.replay_log = graphs.replay_log or [], None
                if log:
                    log[-1][1].synchronize()
                replay = [log[i][0].elapsed_time(log[i][1]) for i in replay_at if i is not None]
            trace_top = None
            if tracer is not None:
                tracer.__exit__(None, None, None)
                trace_top = tracer.key_averages().table(sort_by="cpu_time_total", row_limit=30).splitlines()
                if trace_dir is not None:  # the whole timeline (host ops, runtime calls, kernels) for offline reading
                    trace_dir.mkdir(parents=True, exist_ok=True)
                    tracer.export_chrome_trace(str(trace_dir / f"stepload_{mode}.json"))
            spilled = engine.cache.num_evictions - evicted0
            t0 = time.perf_counter()
            if hook is not None:
                hook.flush_spills()
                hook.manager.drain()
            drain_s = time.perf_counter() - t0
            compiles.stop()
            tier = hook.stats() if hook is not None else {}
            arena = hook.manager.dram.arena_stats() if hook is not None and hook.manager.dram is not None else None
            return {"mode": mode, "at_s": t_run - t_section, "steps": len(times), "p50_ms": 1e3 * _percentile(times, 0.5),
                    "p99_ms": 1e3 * _percentile(times, 0.99), "mean_ms": 1e3 * statistics.fmean(times),
                    # the step loop thread's own CPU time per step: wall minus this is waiting (GPU, GIL, backlog)
                    "cpu_p50_ms": 1e3 * _percentile(cpu, 0.5), "switch_interval_s": sys.getswitchinterval(),
                    "replay_p50_ms": _percentile(replay, 0.5) if replay else None,
                    "replay_p99_ms": _percentile(replay, 0.99) if replay else None,
                    # per step, beside step_ms: does a slow step have a slow replay (the GPU) or not (the host)
                    "replay_ms": [round(t, 3) for t in replay],
                    "cpu_ms": [round(1e3 * t, 3) for t in cpu],
                    **{f"{k}_ms": [round(1e3 * w, 3) for w, _ in v] for k, v in per_step.items()},
                    **{f"{k}_cpu_ms": [round(1e3 * c, 3) for _, c in v] for k, v in per_step.items()},
                    "backlog_waits": hook.backlog_waits if hook else 0,
                    "backlog_wait_s": hook.backlog_wait_s if hook else 0.0,
                    # Triton kernels compiled during the run and its drain, by any thread (the tier worker's
                    # seals among them): each a stall unless it was the step loop's own first launch
                    "compiles": [k.split("[", 1)[0] for k in compiles.kernels],  # the kernels' names
                    "max_ms": 1e3 * max(times), "steps_evicting": sum(evicting), "blocks_evicted": spilled,
                    "drain_after_s": drain_s, "dram_used_bytes": tier.get("dram", {}).get("used_bytes"),
                    "sealed_on_device": getattr(hook.manager.sealer, "sealed", 0) if hook else 0,
                    # the DRAM tier's page-locked arena: blobs that found no extent went to pageable memory
                    "arena": dataclasses.asdict(arena) if arena is not None else None,
                    "step_ms": [round(1e3 * t, 3) for t in times],
                    "profile_top": _profile_top(prof, n) if prof is not None else None,
                    "trace_top": trace_top}
        finally:
            compiles.stop()
            sys.setswitchinterval(switch0)
            if hook is not None:
                hook.close()
            del engine
            gc.collect()

    run("off", decode)  # warm-up: every shape of the measured runs once (kernels compiled, tuned)
    for mode in modes:
        r = run(mode, decode)
        print(f"   stepload {mode}: " + str({k: v for k, v in r.items() if k not in ("step_ms", "profile_top", "trace_top")
                                              and not k.endswith("_ms")} | {"p50_ms": r["p50_ms"], "p99_ms": r["p99_ms"]}),
              flush=True)
        for line in (r.get("profile_top") or []) + (r.get("trace_top") or []):
            print(f"     {line}", flush=True)
        out["runs"].append(r)
    out["summary"] = stepload_summary(out["runs"])
    return out


def _profile_top(prof: cProfile.Profile, steps: int, n: int = 18) -> list[str]:
    """The step loop's functions by own time, per step of the loop (its prefill steps included)."""
    st = pstats.Stats(prof)
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:n]  # (file, line, name) -> (cc, nc, tt, ct, callers)
    return [f"{1e6 * tt / steps:8.1f} us/step own, {1e6 * ct / steps:8.1f} cum, {nc / steps:6.1f} calls: "
            f"{Path(f).name}:{line} {name}" for (f, line, name), (_cc, nc, tt, ct, _c) in rows]


def stepload_summary(runs: Sequence[dict]) -> dict:
    """Per mode: medians over its repetitions of p50 / p99, and of each repetition's p99 over the
    ``off`` run nearest to it in time (the host's speed drifts between runs: session 3's first run
    saw ``off`` at p50 16 ms, then 28 ms four runs later)."""
    offs = [r for r in runs if r["mode"] == "off"]
    out: dict[str, dict] = {}
    for mode in dict.fromkeys(r["mode"] for r in runs):
        mine = [r for r in runs if r["mode"] == mode]
        ratios = []
        for r in mine:
            if mode != "off" and offs:
                near = min(offs, key=lambda o: abs(o["at_s"] - r["at_s"]))
                ratios.append(r["p99_ms"] / near["p99_ms"])
        out[mode] = {"runs": len(mine), "p50_ms": statistics.median(r["p50_ms"] for r in mine),
                     "p99_ms": statistics.median(r["p99_ms"] for r in mine),
                     "p99_vs_nearest_off": statistics.median(ratios) if ratios else None,
                     "p99_vs_nearest_off_all": ratios}
    return out


def sec_engine_ttft(dev: torch.device, runner: ModelRunner, *, prefix: int, suffix: int, trials: int, pool: int,
                    dram_bytes: int, seg_blocks: int) -> dict:
    """TTFT through the engine of ``prefix + suffix`` tokens: recomputed (a fresh prompt each trial),
    prefix hit in HBM, prefix restored from DRAM (evicted to DRAM before each trial). One engine with
    the CUDA tier path (gpu_seal)."""
    vocab = runner.arch.vocab_size
    g = torch.Generator().manual_seed(21)
    hook = _tier_hook(dev, runner, "gpu_seal", dram_bytes, seg_blocks)
    assert hook is not None
    engine = LLMEngine(runner.config, runner, lower_tier=hook, num_blocks=pool)
    who = _tenant("ttft")

    def ids(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    def evict_all() -> None:
        engine.cache.evict_all_cached()
        hook.flush_spills()
        hook.manager.drain()

    def ttft(rid: str, prompt: list[int]) -> tuple[float, int, int]:
        sync(dev)
        t0 = time.perf_counter()
        engine.add_request(GenerateRequest(rid, who, SamplingParams(max_tokens=1, temperature=0.0), prompt_token_ids=prompt))
        outs = []
        while engine.has_unfinished():
            outs += engine.step()
        sync(dev)
        dt = time.perf_counter() - t0
        return dt, outs[-1].cached_tokens, outs[-1].new_token_ids[0] if outs[-1].new_token_ids else -1

    try:
        ttft("warm", ids(min(prefix, 2048) + suffix))
        rec = []
        for i in range(trials + 1):  # fresh prompts: nothing cached anywhere
            evict_all()
            t, cached, _ = ttft(f"rec{i}", ids(prefix + suffix))
            if i:
                rec.append(t)
            assert cached == 0, cached
        shared = ids(prefix)
        tail = ids(suffix)  # under one block: the suffix itself is never cached
        evict_all()
        _, _, first_cold = ttft("cold", shared + tail)
        hbm, hbm_cached, first_hbm = [], 0, -1
        for i in range(trials):
            t, hbm_cached, first_hbm = ttft(f"hbm{i}", shared + tail)
            hbm.append(t)
        dram, dram_cached, first_dram = [], 0, -1
        for i in range(trials + 1):
            evict_all()
            t, dram_cached, first_dram = ttft(f"dram{i}", shared + tail)
            if i:
                dram.append(t)
        med = {k: statistics.median(v) for k, v in (("recompute", rec), ("hbm", hbm), ("dram", dram))}
        return {"prefix_tokens": prefix, "suffix_tokens": suffix, "trials": trials,
                "recompute_ttft_ms": 1e3 * med["recompute"], "hbm_hit_ttft_ms": 1e3 * med["hbm"],
                "dram_restore_ttft_ms": 1e3 * med["dram"], "dram_vs_recompute": med["recompute"] / med["dram"],
                "hbm_vs_recompute": med["recompute"] / med["hbm"],
                "all_ms": {k: [1e3 * t for t in v] for k, v in (("recompute", rec), ("hbm", hbm), ("dram", dram))},
                "cached_tokens": {"hbm": hbm_cached, "dram": dram_cached},
                "first_token_same": {"hbm_vs_cold": first_hbm == first_cold, "dram_vs_cold": first_dram == first_cold},
                "opened_on_device": getattr(hook.manager.opener, "opened_on_device", None),
                "sealed_on_device": getattr(hook.manager.sealer, "sealed", None)}
    finally:
        hook.close()
        engine.requests.clear()
        gc.collect()


# ---- report ------------------------------------------------------------------------------------------
def table(r: dict) -> str:
    s = r["sections"]
    lines = []
    c = s.get("ceilings", {})
    if "h2d_pinned_GBps" in c:
        lines.append(f"link: pinned H2D {c['h2d_pinned_GBps']:.1f} GB/s ({c['h2d_pinned_ms']:.1f} ms for 2 GiB), "
                     f"pageable {c['h2d_pageable_GBps']:.1f} GB/s")
    k = s.get("kernel", {})
    if "open_GBps" in k:
        lines.append(f"kernels on device-resident ciphertext: open {k['open_GBps']:.0f} GB/s, kernels only "
                     f"{k['kernels_GBps']:.0f} GB/s; tags ok {k['tags_ok']}, plaintext equal {k['plaintext_equal']}")
    rec = s.get("recompute", {}).get("ttft_ms")
    if rec:
        lines.append(f"recompute: TTFT of {s['recompute']['tokens']} tokens {rec:.1f} ms")
    lines.append(f"{'tier':<6}{'mode':<12}{'restore ms':>11}{'GB/s':>7}{'vs recompute':>14}{'vs plain':>10}"
                 f"{'equal':>7}{'demote s':>10}")
    rows = s.get("restore", [])
    plain = {x["tier"]: x["restore_ms"] for x in rows if x.get("mode") == "plain" and "restore_ms" in x}
    for x in rows:
        if "restore_ms" not in x:
            lines.append(f"{x.get('tier', '?'):<6}{x.get('mode', '?'):<12}ERROR {x.get('error', '')[:70]}")
            continue
        vs_rec = f"{rec / x['restore_ms']:.1f}x" if rec else "-"
        vs_plain = f"+{100 * (x['restore_ms'] / plain[x['tier']] - 1):.0f}%" if x["tier"] in plain else "-"
        lines.append(f"{x['tier']:<6}{x['mode']:<12}{x['restore_ms']:>11.1f}{x['GBps']:>7.1f}{vs_rec:>14}"
                     f"{vs_plain:>10}{str(x['plaintext_equal']):>7}{x['demote_s']:>10.2f}")
    sl = s.get("stepload", {})
    if sl.get("runs"):
        lines.append(f"stepload: {sl['seqs']} seqs decoding, pool {sl['pool_blocks']} blocks evicting to DRAM, "
                     f"CUDA graphs {sl.get('cuda_graphs', False)}")
        base = next((x for x in sl["runs"] if x["mode"] == "off"), None)
        lines.append(f"{'mode':<10}{'p50 ms':>8}{'p99 ms':>8}{'p99 vs off':>11}{'steps':>7}{'evicting':>9}"
                     f"{'blocks':>8}{'drain s':>8}{'cpu p50':>8}{'gpu p50':>8}{'gpu p99':>8}{'waits':>6}{'wait s':>7}"
                     f"{'jit':>5}  arena (pinned, fallbacks)")
        for x in sl["runs"]:
            vs = f"{100 * (x['p99_ms'] / base['p99_ms'] - 1):+.1f}%" if base else "-"
            a = x.get("arena")
            lines.append(f"{x['mode']:<10}{x['p50_ms']:>8.2f}{x['p99_ms']:>8.2f}{vs:>11}{x['steps']:>7}"
                         f"{x['steps_evicting']:>9}{x['blocks_evicted']:>8}{x['drain_after_s']:>8.2f}"
                         f"{x.get('cpu_p50_ms', float('nan')):>8.2f}{x.get('replay_p50_ms') or float('nan'):>8.2f}"
                         f"{x.get('replay_p99_ms') or float('nan'):>8.2f}"
                         f"{x.get('backlog_waits', 0):>6}"
                         f"{x.get('backlog_wait_s', 0.0):>7.2f}"
                         f"{len(x.get('compiles', [])):>5}"
                         + (f"  {a['pinned']}, {a['fallbacks']}/{a['allocations']}" if a else ""))
        for mode, m in sl.get("summary", {}).items():
            vs = f"{100 * (m['p99_vs_nearest_off'] - 1):+.1f}%" if m["p99_vs_nearest_off"] else "-"
            lines.append(f"  {mode}: median of {m['runs']} runs p50 {m['p50_ms']:.2f} ms, p99 {m['p99_ms']:.2f} ms, "
                         f"p99 vs the nearest off run {vs}")
    et = s.get("engine_ttft", {})
    if "dram_restore_ttft_ms" in et:
        lines.append(f"engine TTFT {et['prefix_tokens']}+{et['suffix_tokens']} tokens: recompute "
                     f"{et['recompute_ttft_ms']:.1f} ms, DRAM restore {et['dram_restore_ttft_ms']:.1f} ms "
                     f"({et['dram_vs_recompute']:.1f}x), HBM hit {et['hbm_hit_ttft_ms']:.1f} ms "
                     f"({et['hbm_vs_recompute']:.1f}x); cached {et['cached_tokens']}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default=None, help="default: cuda when available (the full run), else cpu")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/tiers_gpu_h200.json)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the flow")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--nvme-dir", default=None, help="directory on the disk to test (default: a temp dir)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--nvme-modes", default="plain,gpu_chacha,cpu_aes")
    ap.add_argument("--nvme-trials", type=int, default=3, help="(each reads 2 GiB from the disk)")
    ap.add_argument("--sections", default="ceilings,kernel,recompute,restore,stepload,engine_ttft")
    ap.add_argument("--stepload-modes", default="off,gpu_seal,cpu_seal,off")
    ap.add_argument("--kv-page-layout", choices=list(KV_PAGE_LAYOUTS), default="auto",
                    help="the runners' KV page layout (engine/kv_layout.py; auto = head on CUDA): imports and exports "
                         "convert head-major pages to the token-ordered transfer format")
    ap.add_argument("--stepload-decode", type=int, default=256, help="decode tokens per sequence")
    ap.add_argument("--stepload-profile", action="store_true",
                    help="cProfile each stepload run (top entries per step in the JSON; on Python 3.12+ "
                         "cProfile sees every thread, the tier workers too)")
    ap.add_argument("--stepload-trace", action="store_true",
                    help="torch.profiler over each spilling stepload run: host time per op and CUDA runtime call "
                         "(every thread), the table in the JSON")
    ap.add_argument("--trace-dir", default=None,
                    help="with --stepload-trace: also write each run's Chrome trace (stepload_<mode>.json) here")
    ap.add_argument("--stepload-graphs", action="store_true",
                    help="stepload on a second runner with CUDA graphs (the engine's GPU default)")
    args = ap.parse_args()
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.smoke else "cpu"))
    shape, prefix, seg_blocks = (SMOKE_SHAPE, 128, 4) if args.smoke else (LLAMA31_8B_SHAPE, 16384, 32)
    trials = min(args.trials, 2) if args.smoke else args.trials
    num_blocks = prefix // 16
    out_path = Path(args.out or Path(__file__).resolve().parent / "results" /
                    ("tiers_gpu_smoke.json" if args.smoke else "tiers_gpu_h200.json"))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    import triton

    result: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "commit": os.environ.get("PREFIXGATE_COMMIT") or git_commit(),
        "machine": {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
                    "host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "triton": triton.__version__, "python": platform.python_version(),
                    "interpreter": os.environ.get("TRITON_INTERPRET") == "1"},
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "shape": {"prefix_tokens": prefix, "blocks": num_blocks, "segment_blocks": seg_blocks},
        "sections": {},
    }
    t_start = time.perf_counter()
    wanted = args.sections.split(",")

    def save() -> None:
        result["elapsed_s"] = time.perf_counter() - t_start
        out_path.write_text(json.dumps(result, indent=2, default=str) + "\n", encoding="utf-8")

    def section(name: str, fn: Callable[..., Any], *a: Any) -> Any:
        print(f"== {name} ...", flush=True)
        t0 = time.perf_counter()
        try:
            r = fn(*a)
        except Exception as exc:  # one run must yield every figure it can
            traceback.print_exc()
            r = {"error": f"{type(exc).__name__}: {exc}"}
        if isinstance(r, dict):
            r["section_s"] = time.perf_counter() - t0
        print(f"   {name}: {r if not isinstance(r, list) else len(r)}", flush=True)
        save()
        return r

    result["kv_page_layout"] = args.kv_page_layout
    runner = make_runner(dev, shape, prefix, num_blocks + 64, max_num_seqs=4 if args.smoke else 32,
                         kv_page_layout=args.kv_page_layout)
    bb = runner.kv_bytes_per_block
    result["shape"].update(block_bytes=bb, kv_bytes=num_blocks * bb)
    if "ceilings" in wanted:
        result["sections"]["ceilings"] = section("ceilings", sec_ceilings, dev, num_blocks * bb, trials)
    if "kernel" in wanted:
        result["sections"]["kernel"] = section("kernel", sec_kernel, dev, seg_blocks * bb, num_blocks // seg_blocks,
                                               trials)
    if "recompute" in wanted:
        result["sections"]["recompute"] = section("recompute", sec_recompute, dev, runner, prefix, trials)
    # the engine-level sections before the restore rows: NVMe's (disk-bound) come last
    if "stepload" in wanted:
        sl = dict(seqs=4, prompt=20, decode=24, pool=40, filler=64) if args.smoke else \
            dict(seqs=32, prompt=64, decode=args.stepload_decode, pool=768, filler=2048)
        sl_runner = runner
        if args.stepload_graphs and dev.type == "cuda":
            sl_runner = make_runner(dev, shape, 2048, 768 + 8, max_num_seqs=32, graphs=True,
                                    kv_page_layout=args.kv_page_layout)
        result["sections"]["stepload"] = section("stepload", lambda: sec_stepload(
            dev, sl_runner, **sl, dram_bytes=4 << 30 if not args.smoke else 16 << 20, seg_blocks=seg_blocks,
            modes=args.stepload_modes.split(","), profile=args.stepload_profile, trace=args.stepload_trace,
            trace_dir=Path(args.trace_dir) if args.trace_dir else None))
    if "engine_ttft" in wanted:
        result["sections"]["engine_ttft"] = section("engine_ttft", lambda: sec_engine_ttft(
            dev, runner, prefix=prefix, suffix=15, trials=trials, pool=num_blocks + 8,
            dram_bytes=6 << 30 if not args.smoke else 16 << 20, seg_blocks=seg_blocks))
    if "restore" in wanted:
        g = torch.Generator(device=dev).manual_seed(1)
        data = torch.randint(0, 256, (num_blocks, bb), dtype=torch.uint8, device=dev, generator=g).cpu()
        if dev.type == "cuda":
            data = data.pin_memory()
        rows: list[dict] = []
        result["sections"]["restore"] = rows
        with tempfile.TemporaryDirectory(dir=args.nvme_dir) as tmp:
            for tier, modes in (("dram", args.modes), ("nvme", args.nvme_modes)):
                for mode in modes.split(","):
                    n = trials if tier == "dram" else min(trials, args.nvme_trials)
                    rows.append(section(f"restore {tier} {mode}", sec_restore, dev, runner, tier, mode, num_blocks,
                                        seg_blocks, n, data, Path(tmp)))
                    save()
    result["table"] = table(result)
    save()
    print(result["table"], flush=True)
    print(f"JSON: {out_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
