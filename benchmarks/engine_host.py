"""The prefix hit's host time on a CPU: the engine's work around the runner, and the runner's own
host work before and after its model forward (issue #19 item 3).

    python benchmarks/engine_host.py [--hits 25] [--colds 3] [--out benchmarks/results/engine_host.json]

Same token counts as ``benchmarks/engine_gpu.py``'s prefix section: an 8,192-token prompt whose
first 7,680 tokens are cached, block size 16, ``max_tokens`` 1, the whole prompt in one step's
budget. The runner is the real ``ModelRunner`` on the tiny model's shape (engine.models.tiny's
TINY_DIMS; random fp32 weights, since the tiny checkpoint stops at 8,192 positions and the request
needs 8,193), reference CPU ops, one torch thread.

What is timed, per request (each a fresh 512-token tail after the same cached head):

  engine_outside_runner  CPU time from ``add_request`` to the step that returns the first token,
                         minus the time inside the runner's ``execute`` (or ``launch`` + ``collect``
                         with overlapped steps): prompt validation and hashing, the cache's match and
                         allocation, scheduling, commit, the token's bookkeeping, finishing, output.
  after_token            CPU time from the first token to the engine going idle (``has_unfinished``
                         false): work done after the token was handed out, such as the finished
                         request's block frees since session 6. Not on the TTFT path.
  runner_pre_forward     ``execute``/``launch`` entry to the model's forward (forward pre-hook on
                         ``runner.model``): metadata (positions, slot mapping, block tables, lengths)
                         and the host-to-device copies. On the GPU the device idles during it.
  runner_post_forward    the model's forward end to the runner's return, minus the LM head
                         (``lm_head`` hooks; device work on a GPU): the last-row selection, the
                         sampler, and the token's way back to the host.

CPU time (``time.process_time``) because the machine is shared; medians over ``--hits`` requests.
cProfile's top entries over the hits' engine and runner host code are recorded too, with the
profiler off during the model's forward and LM head (so cumulative times are host time; cProfile
inflates Python-heavy code several-fold, its call counts are exact).

Predictions (written before the changes were measured; docs/gpu.md "Session 5"):
  before: engine outside the runner ~4 ms on this CPU (hashing 512 blocks ~1 ms, the prompt's
  per-token validation ~0.5 ms, the match / admission / free walks of 512 blocks ~1.5 ms); runner
  pre-forward ~0.4 ms, post-forward ~0.1 ms.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import random
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.engine_gpu import IdTokenizer, arch_for, greedy  # noqa: E402
from benchmarks.provenance import git_commit  # noqa: E402
from engine.batch import ScheduledBatch, StepResult  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.model_runner import LaunchedStep, ModelRunner  # noqa: E402
from engine.models.random_init import build_random_model  # noqa: E402
from engine.models.tiny import TINY_DIMS  # noqa: E402
from engine.protocol import GenerateRequest, StaticTenantScope  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMPT_TOKENS = 8192
CACHED_TOKENS = 7680
BLOCK_SIZE = 16
MAX_LEN = PROMPT_TOKENS + 256
# host code whose cProfile entries are reported (the model's compute is the device's work on a GPU)
HOST_CODE = r"engine/(llm_engine|scheduler|kv_cache_manager|block_pool|prefix_index|request|eviction|model_runner|" \
            r"sampling|host_to_device|metrics|computed_prefixes|batch)\.py"


@dataclass
class Clock:
    """One point in time on both clocks."""

    cpu: float = field(default_factory=time.process_time)
    wall: float = field(default_factory=time.perf_counter)


@dataclass
class StepTimes:
    """One runner call's marks: entry, model forward start/end, LM head start/end, return."""

    entry: Clock
    marks: dict[str, Clock] = field(default_factory=dict)
    done: Clock | None = None


class HostTimedRunner:
    """A ``ModelRunner`` whose calls are timed (process CPU time and wall) and split at the model's
    forward and LM head by module hooks. Forwards everything else to the runner."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.calls: list[StepTimes] = []
        # while set, profiles the host code only: off during the model's forward and LM head
        self.profiler: cProfile.Profile | None = None
        runner.model.register_forward_pre_hook(lambda *_: self._mark("forward_start", pause=True))
        runner.model.register_forward_hook(lambda *_: self._mark("forward_end", pause=False))
        runner.model.lm_head.register_forward_pre_hook(lambda *_: self._mark("head_start", pause=True))
        runner.model.lm_head.register_forward_hook(lambda *_: self._mark("head_end", pause=False))

    def __getattr__(self, name: str) -> object:
        return getattr(self.runner, name)

    def _mark(self, name: str, pause: bool) -> None:
        if self.profiler is not None and pause:
            self.profiler.disable()
        if self.calls and self.calls[-1].done is None:
            self.calls[-1].marks[name] = Clock()
        if self.profiler is not None and not pause:
            self.profiler.enable()

    def _timed(self, fn: Callable[[], object]) -> object:
        self.calls.append(StepTimes(Clock()))
        try:
            return fn()
        finally:
            self.calls[-1].done = Clock()

    def execute(self, batch: ScheduledBatch) -> StepResult:
        out = self._timed(lambda: self.runner.execute(batch))
        assert isinstance(out, StepResult)
        return out

    def launch(self, batch: ScheduledBatch, feed: Sequence[tuple[int, int]] = (),
               after: LaunchedStep | None = None) -> LaunchedStep:
        out = self._timed(lambda: self.runner.launch(batch, feed, after))
        assert isinstance(out, LaunchedStep)
        return out

    def collect(self, step: LaunchedStep) -> StepResult:
        out = self._timed(lambda: self.runner.collect(step))
        assert isinstance(out, StepResult)
        return out


def build_runner(threads: int) -> ModelRunner:
    torch.set_num_threads(threads)
    _cfg, arch = arch_for({**TINY_DIMS, "max_position_embeddings": MAX_LEN, "tie_word_embeddings": True}, MAX_LEN)
    model = build_random_model(arch, "cpu", torch.float32, seed=0)
    # room for the head and every timed tail without evicting (the H200's cache does not evict either)
    config = EngineConfig(model_dir=Path("random-tiny-shape"), device="cpu", block_size=BLOCK_SIZE,
                          num_kv_blocks=6144, max_num_seqs=8, max_num_batched_tokens=16384,
                          max_model_len=MAX_LEN, num_threads=threads)
    return ModelRunner(config, arch=arch, tokenizer=IdTokenizer(), model=model)


@dataclass
class RequestTimes:
    """CPU milliseconds of one request, add_request to its first token."""

    total: float
    add_request: float  # of total: validation, the Request, its block hashes
    runner: float
    pre_forward: float
    post_forward: float
    wall_ttft: float
    after_token: float  # CPU ms from the first token to idle (off the TTFT path)

    @property
    def outside_runner(self) -> float:
        return self.total - self.runner


def run_one(engine: LLMEngine, timed: HostTimedRunner, rid: str, prompt: list[int]) -> RequestTimes:
    timed.calls.clear()
    start = Clock()
    engine.add_request(GenerateRequest(rid, StaticTenantScope(), greedy(1), prompt_token_ids=prompt))
    added = time.process_time()
    first: Clock | None = None
    while first is None:
        outs = engine.step()
        if any(o.request_id == rid and o.new_token_ids for o in outs):
            first = Clock()
    while engine.has_unfinished():
        engine.step()
    idle = time.process_time()
    runner = pre = post = 0.0
    for call in timed.calls:
        assert call.done is not None
        runner += call.done.cpu - call.entry.cpu
        m = call.marks
        if "forward_start" in m:
            pre += m["forward_start"].cpu - call.entry.cpu
        if "forward_end" in m and "head_start" in m and "head_end" in m:
            post += (m["head_start"].cpu - m["forward_end"].cpu) + (call.done.cpu - m["head_end"].cpu)
        elif "forward_start" not in m:
            post += call.done.cpu - call.entry.cpu  # a collect: the token's way to the host
    return RequestTimes(1e3 * (first.cpu - start.cpu), 1e3 * (added - start.cpu), 1e3 * runner, 1e3 * pre, 1e3 * post,
                        1e3 * (first.wall - start.wall), 1e3 * (idle - first.cpu))


def median_of(rows: list[RequestTimes]) -> dict[str, float]:
    return {
        "engine_outside_runner_ms": statistics.median(r.outside_runner for r in rows),
        "add_request_ms": statistics.median(r.add_request for r in rows),
        "runner_pre_forward_ms": statistics.median(r.pre_forward for r in rows),
        "runner_post_forward_ms": statistics.median(r.post_forward for r in rows),
        "runner_ms": statistics.median(r.runner for r in rows),
        "ttft_cpu_ms": statistics.median(r.total for r in rows),
        "ttft_wall_ms": statistics.median(r.wall_ttft for r in rows),
        "after_token_ms": statistics.median(r.after_token for r in rows),
        "outside_runner_min_ms": min(r.outside_runner for r in rows),
        "outside_runner_max_ms": max(r.outside_runner for r in rows),
    }


def profile_top(prof: cProfile.Profile, per: int, n: int) -> list[dict[str, float | str]]:
    """The ``n`` host-code entries with the most cumulative time, per request (``per`` requests
    were profiled): calls, own time and cumulative time in ms."""
    rows: list[dict[str, float | str]] = []
    for (filename, line, func), (_cc, ncalls, tottime, cumtime, _callers) in pstats.Stats(prof).stats.items():  # type: ignore[attr-defined]
        if re.search(HOST_CODE, filename):
            rows.append({"function": f"{Path(filename).parent.name}/{Path(filename).name}:{line}({func})",
                         "calls": ncalls / per, "tottime_ms": 1e3 * tottime / per, "cumtime_ms": 1e3 * cumtime / per})
    rows.sort(key=lambda r: -float(r["cumtime_ms"]))
    return rows[:n]


@dataclass
class ModeResult:
    """One engine mode's figures: medians of the hits and of the cold requests (``median_of``)."""

    hit: dict[str, float]
    cold: dict[str, float]
    hits: int
    colds: int
    prompt_tokens_hit_total: int
    profile_top_per_hit: list[dict[str, float | str]]


def bench_mode(runner: ModelRunner, overlap: bool, hits: int, colds: int, profiled: int) -> ModeResult:
    timed = HostTimedRunner(runner)
    config = EngineConfig(model_dir=Path("random-tiny-shape"), device="cpu", block_size=BLOCK_SIZE,
                          num_kv_blocks=runner.num_kv_blocks, max_num_seqs=8, max_num_batched_tokens=16384,
                          max_model_len=MAX_LEN, overlap_steps=overlap)
    engine = LLMEngine(config, timed)  # type: ignore[arg-type]  # forwards to a ModelRunner
    g = random.Random(5)
    vocab = runner.spec.vocab_size
    head = [g.randrange(vocab) for _ in range(CACHED_TOKENS)]

    def prompt(prefix: list[int]) -> list[int]:
        return prefix + [g.randrange(vocab) for _ in range(PROMPT_TOKENS - len(prefix))]

    tag = "o" if overlap else "s"
    run_one(engine, timed, f"{tag}warm", prompt([]))  # first-call costs (allocator, lazy imports)
    cold = [run_one(engine, timed, f"{tag}c{i}", prompt([g.randrange(vocab) for _ in range(CACHED_TOKENS)]))
            for i in range(colds)]
    run_one(engine, timed, f"{tag}head", prompt(head))  # caches the head
    hit = [run_one(engine, timed, f"{tag}h{i}", prompt(head)) for i in range(hits)]
    cached = int(engine.stats()["prompt_tokens_hit"])
    prof = cProfile.Profile()
    prompts = [prompt(head) for _ in range(profiled)]
    timed.profiler = prof
    prof.enable()
    for i, p in enumerate(prompts):
        run_one(engine, timed, f"{tag}p{i}", p)
    prof.disable()
    timed.profiler = None
    top = profile_top(prof, profiled, 30)
    return ModeResult(median_of(hit), median_of(cold), hits, colds, cached, top)


def table(result: dict[str, ModeResult]) -> str:
    lines = [f"{'mode':<10} {'request':<6} {'outside runner':>15} {'add_request':>12} {'pre-forward':>12} {'post-forward':>13} "
             f"{'runner':>9} {'TTFT CPU':>9} {'after token':>12}"]
    for mode, res in result.items():
        for kind, r in (("hit", res.hit), ("cold", res.cold)):
            lines.append(f"{mode:<10} {kind:<6} {r['engine_outside_runner_ms']:>12.3f} ms {r['add_request_ms']:>9.3f} ms "
                         f"{r['runner_pre_forward_ms']:>9.3f} ms {r['runner_post_forward_ms']:>10.3f} ms "
                         f"{r['runner_ms']:>6.1f} ms {r['ttft_cpu_ms']:>6.1f} ms {r['after_token_ms']:>9.3f} ms")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hits", type=int, default=25)
    ap.add_argument("--colds", type=int, default=3)
    ap.add_argument("--profiled", type=int, default=5, help="further hits run under cProfile")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--label", default="", help="a name for this run in the JSON (e.g. before, after)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "engine_host.json"))
    args = ap.parse_args()
    commit = git_commit()
    runner = build_runner(args.threads)
    modes = {name: bench_mode(runner, overlap, args.hits, args.colds, args.profiled)
             for name, overlap in (("sync", False), ("overlap", True))}
    print(table(modes))
    for name, res in modes.items():
        print(f"\ncProfile, {name}, per hit (top 12 by cumulative):")
        for row in res.profile_top_per_hit[:12]:
            print(f"  {row['calls']:>7.0f} calls {row['tottime_ms']:>7.3f} own {row['cumtime_ms']:>8.3f} cum ms  "
                  f"{row['function']}")
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "git_commit": commit,
        "label": args.label,
        "machine": {"processor": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                    "python": platform.python_version(), "platform": platform.platform(),
                    "load_avg_1m": os.getloadavg()[0]},
        "workload": {"prompt_tokens": PROMPT_TOKENS, "cached_tokens": CACHED_TOKENS, "block_size": BLOCK_SIZE,
                     "max_tokens": 1, "model": "tiny shape (TINY_DIMS), random fp32, reference CPU ops"},
        "modes": {name: asdict(res) for name, res in modes.items()},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n", encoding="utf-8")
    print(f"\n-> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
