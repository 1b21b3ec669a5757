"""``prefixgate bench``: replay multi-tenant traces against gateways over HTTP and show whether the
prefix cache pays for itself.

One run = configurations x workloads. Each configuration is its own ``prefixgate serve`` process
(temporary ``--home``, free loopback port) with the same model and KV size::

    cache+canon   prefix cache on,  tenants canonicalize (``--canon``, default reorder)
    cache         prefix cache on,  canonicalization off
    nocache       prefix cache off (``serve --no-prefix-cache``): the cold-prefill baseline

or, with ``--url`` and ``--api-key``, one already running gateway (configuration ``external``).
Within a configuration the workloads of ``gateway.bench.traces`` run one after another, each
with its own tenants, sessions run concurrently up to ``--concurrency``, and no new session starts
after ``--max-duration`` seconds of a workload. ``/metrics`` is scraped before and after each
workload (counter deltas) and sampled while it runs (gauges).

The break-even of a cell (configuration x workload)::

    prefill saved  = reused tokens / cold prefill throughput
                     (prefill tokens / prefill seconds of the nocache run of the same workload;
                      this run's own figure when there is no nocache run)
    cache cost     = engine seconds in hashing + matching + eviction (spill included) + indexing
                     + tier work (restores) during the workload
    net            = saved - cost    (> 0: the cache paid for itself)

Run: ``prefixgate bench [--workloads a,b] [--configs ...] [--requests N] ...`` or, from a checkout,
``python benchmarks/workloads.py ...`` (a thin caller, same flags). This module is part of the
installed package (``pip install 'prefixgate[all]'``), so ``prefixgate bench`` works from any
directory. Writes ``workloads_<utc>.json``, ``.txt`` (the table) and two PNGs under ``--out-dir``
(default: ``benchmarks/results/`` when run from a checkout, else ``./prefixgate-bench/``), with
command, machine and git commit (when the code runs from a git checkout).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import platform
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from gateway.bench.traces import WORKLOADS, Session, TraceSizes, build_trace

if TYPE_CHECKING:  # matplotlib loads inside write_plots only
    from matplotlib.axes import Axes

# Where the ``gateway`` package was imported from: a checkout's root, or site-packages when installed.
# Child ``serve`` processes get it on PYTHONPATH so that they run this same code.
CODE_ROOT = Path(__file__).resolve().parents[2]


def default_results_dir(cwd: Path | None = None) -> Path:
    """``benchmarks/results`` under the working directory when it is a checkout, else ``prefixgate-bench``."""
    cwd = cwd or Path.cwd()
    in_checkout = (cwd / "benchmarks" / "results").is_dir()
    return cwd / "benchmarks" / "results" if in_checkout else cwd / "prefixgate-bench"


class BenchError(ValueError):
    """A user error (bad flag, gateway that will not start): one line for the CLI."""


@dataclass(frozen=True)
class GatewayConfig:
    name: str
    prefix_cache: bool
    canon: str  # tenants' canon_mode


def configs_for(names: list[str], canon: str) -> list[GatewayConfig]:
    known = {"cache+canon": GatewayConfig("cache+canon", True, canon),
             "cache": GatewayConfig("cache", True, "off"),
             "nocache": GatewayConfig("nocache", False, "off")}
    bad = [n for n in names if n not in known]
    if bad:
        raise BenchError(f"unknown configuration {bad[0]!r}; choose from {', '.join(known)}")
    return [known[n] for n in names]


# ---------------------------------------------------------------------- metrics scraping

Snapshot = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse_metrics(text: str) -> Snapshot:
    out: Snapshot = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def msum(snap: Snapshot, name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in snap.items() if n == name and want <= ls)


def label_values(snap: Snapshot, name: str, label: str) -> list[str]:
    return sorted({dict(ls)[label] for (n, ls) in snap if n == name and label in dict(ls)})


# ---------------------------------------------------------------------- gateways


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Target:
    """A gateway to drive: its URL, the model name and an API key per (workload, tenant index)."""

    config: GatewayConfig
    url: str
    model: str
    keys: dict[tuple[str, int], str]
    # Bearer credential for /metrics (a metrics token or an admin key): the gateway does not serve it openly.
    metrics_key: str = ""

    @property
    def metrics_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.metrics_key}"} if self.metrics_key else {}

    def key(self, workload: str, tenant: int) -> str:
        if (workload, tenant) in self.keys:
            return self.keys[(workload, tenant)]
        ring = sorted(self.keys.values())  # --url mode: a few keys shared round-robin
        return ring[tenant % len(ring)]


_METRICS_TOKEN = secrets.token_urlsafe(16)


def _bench_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(CODE_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PREFIXGATE_METRICS_TOKEN"] = _METRICS_TOKEN  # the local gateways' /metrics credential
    return env


class LocalGateway:
    """``prefixgate serve`` for one configuration: temporary home, fresh tenants, free loopback port.

    ``start`` only launches the process, so several gateways can load their model at once;
    ``wait_healthy`` blocks until ``/health`` answers; ``stop`` ends the process and removes the home.
    """

    def __init__(self, config: GatewayConfig, model_dir: Path, *, device: str, kv_blocks: int | None,
                 tenants: dict[str, int], dram_bytes: str | None = None, nvme_bytes: str | None = None) -> None:
        self.config, self.model_dir, self.device, self.kv_blocks = config, model_dir, device, kv_blocks
        self.dram_bytes, self.nvme_bytes = dram_bytes, nvme_bytes
        self.tenants = tenants
        self._tmp = tempfile.TemporaryDirectory(prefix=f"pg-bench-{config.name.replace('+', '-')}-")
        self.home = Path(self._tmp.name)
        self.log_path = self.home / "serve.log"
        self.proc: subprocess.Popen | None = None
        self.target: Target | None = None

    def start(self) -> None:
        from tenancy.service import TenancyService

        keys: dict[tuple[str, int], str] = {}
        # tenancy warns on stderr that it created fresh secrets: expected in a throwaway home
        with contextlib.redirect_stderr(io.StringIO()), TenancyService.open(self.home) as svc:
            for workload, count in self.tenants.items():
                for i in range(count):
                    created = svc.create_tenant(f"{workload}-{i}", canon_mode=self.config.canon)
                    keys[(workload, i)] = created.api_key
            svc.flush()
        port = _free_port()
        cmd = [sys.executable, "-m", "gateway.cli.main", "serve", "--home", str(self.home), "--port", str(port),
               "--model", str(self.model_dir), "--device", self.device, "--log-level", "warning"]
        if self.kv_blocks:
            cmd += ["--kv-blocks", str(self.kv_blocks)]
        if self.dram_bytes:
            cmd += ["--dram-bytes", self.dram_bytes]
        if self.nvme_bytes:  # the NVMe tier's files live in the throwaway home
            cmd += ["--nvme-dir", str(self.home / "nvme"), "--nvme-bytes", self.nvme_bytes]
        if not self.config.prefix_cache:
            cmd.append("--no-prefix-cache")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=self.home, env=_bench_env(), stdout=log, stderr=subprocess.STDOUT)
        self.target = Target(self.config, f"http://127.0.0.1:{port}", self.model_dir.name, keys, _METRICS_TOKEN)

    def wait_healthy(self, timeout_s: float) -> Target:
        assert self.proc is not None and self.target is not None, "start() first"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                lines = self.log_path.read_text(errors="replace").strip().splitlines()
                raise BenchError(f"{self.config.name} gateway exited with status {self.proc.returncode}: "
                                 f"{(lines or ['(no output)'])[-1]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.target.url + "/health", timeout=2, trust_env=False).status_code == 200:
                    return self.target
            time.sleep(0.3)
        raise BenchError(f"{self.config.name} gateway at {self.target.url} not healthy after {timeout_s:.0f}s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._tmp.cleanup()


def external_target(url: str, api_keys: list[str], model: str | None) -> Target:
    url = url.rstrip("/")
    host = httpx.URL(url).host
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise BenchError(f"--url must be a loopback address (127.0.0.1/localhost), got {host!r}")
    if not api_keys:
        raise BenchError("--url needs at least one --api-key")
    if model is None:
        try:
            r = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {api_keys[0]}"}, timeout=10,
                          trust_env=False)
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
            raise BenchError(f"cannot list models at {url}/v1/models: {exc}") from None
    # /metrics: PREFIXGATE_METRICS_TOKEN when set, else the first key (it must be an admin key then)
    return Target(GatewayConfig("external", True, "as configured"), url, model,
                  {("*", i): k for i, k in enumerate(api_keys)},
                  os.environ.get("PREFIXGATE_METRICS_TOKEN") or api_keys[0])


# ---------------------------------------------------------------------- running a workload


@dataclass
class RequestRecord:
    workload: str
    config: str
    tenant: int
    start_s: float  # since the workload started
    end_s: float = 0.0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None


async def _one_request(client: httpx.AsyncClient, target: Target, workload: str, tenant: int, body: dict,
                       t0: float) -> tuple[RequestRecord, str]:
    rec = RequestRecord(workload, target.config.name, tenant, time.monotonic() - t0)
    headers = {"Authorization": f"Bearer {target.key(workload, tenant)}"}
    sent = time.monotonic()
    last: float | None = None
    text: list[str] = []
    try:
        async with client.stream("POST", target.url + "/v1/chat/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                detail = (await r.aread()).decode(errors="replace")[:200]
                rec.error = f"HTTP {r.status_code}: {detail}"
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("error"):
                        rec.error = str(chunk["error"].get("message", chunk["error"]))[:200]
                    for choice in chunk.get("choices") or ():
                        piece = (choice.get("delta") or {}).get("content")
                        if piece is None:
                            continue
                        now = time.monotonic()
                        if rec.ttft_s is None:
                            rec.ttft_s = now - sent
                        else:
                            rec.itl_s.append(now - last)  # type: ignore[operator]
                        last = now
                        text.append(piece)
                    usage = chunk.get("usage")
                    if usage:
                        rec.prompt_tokens = usage.get("prompt_tokens", 0)
                        rec.completion_tokens = usage.get("completion_tokens", 0)
                        rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    except httpx.HTTPError as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    rec.end_s = time.monotonic() - t0
    return rec, "".join(text)


async def _run_session(client: httpx.AsyncClient, target: Target, session: Session, sem: asyncio.Semaphore,
                       t0: float, deadline: float, records: list[RequestRecord], progress: Any) -> None:
    async with sem:
        if time.monotonic() > deadline:
            return
        history: list[dict] = []
        for turn in session.turns:
            body: dict[str, Any] = {
                "model": target.model, "messages": history + turn.messages, "max_tokens": session.max_tokens,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                "user": f"{session.workload}-{session.tenant}",
            }
            if turn.tools:
                body["tools"] = turn.tools
            rec, reply = await _one_request(client, target, session.workload, session.tenant, body, t0)
            records.append(rec)
            if progress is not None:
                progress.update(1)
            if rec.error or not session.carry_history:
                break
            history = history + turn.messages
            if session.keep_replies:
                history.append({"role": "assistant", "content": reply})


async def _sample_metrics(client: httpx.AsyncClient, url: str, headers: dict[str, str], t0: float,
                          interval_s: float, out: list[tuple[float, Snapshot]], stop: asyncio.Event) -> None:
    while not stop.is_set():
        with contextlib.suppress(httpx.HTTPError):
            r = await client.get(url + "/metrics", headers=headers)
            out.append((time.monotonic() - t0, parse_metrics(r.text)))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s)


async def run_workload(target: Target, workload: str, sessions: list[Session], *, concurrency: int,
                       max_duration_s: float, sample_interval_s: float, progress: Any = None) -> dict[str, Any]:
    """Replay ``sessions`` against ``target``; returns the records and metric snapshots of the run."""
    limits = httpx.Limits(max_connections=concurrency + 2)
    # trust_env=False: loopback only, never through a proxy from the environment
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10), limits=limits, trust_env=False) as client:
        before = parse_metrics((await client.get(target.url + "/metrics", headers=target.metrics_headers)).text)
        records: list[RequestRecord] = []
        samples: list[tuple[float, Snapshot]] = []
        stop = asyncio.Event()
        t0 = time.monotonic()
        sampler = asyncio.create_task(_sample_metrics(client, target.url, target.metrics_headers, t0, sample_interval_s, samples, stop))
        sem = asyncio.Semaphore(concurrency)
        await asyncio.gather(*(_run_session(client, target, s, sem, t0, t0 + max_duration_s, records, progress)
                               for s in sessions))
        wall = time.monotonic() - t0
        stop.set()
        await sampler
        await asyncio.sleep(0.05)  # the engine publishes its counters after the step that finished
        after = parse_metrics((await client.get(target.url + "/metrics", headers=target.metrics_headers)).text)
    return {"records": records, "before": before, "after": after, "samples": samples, "wall_s": wall}


# ---------------------------------------------------------------------- summarising


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def _dist(values: list[float]) -> dict[str, float | None]:
    return {"p50": _pct(values, 50), "p95": _pct(values, 95), "p99": _pct(values, 99),
            "mean": statistics.fmean(values) if values else None, "n": len(values)}


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    """Every figure of one cell (configuration x workload), from client records and /metrics."""
    recs: list[RequestRecord] = run["records"]
    ok = [r for r in recs if r.error is None]
    before, after, samples = run["before"], run["after"], run["samples"]

    def d(name: str, **labels: str) -> float:
        return msum(after, name, **labels) - msum(before, name, **labels)

    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    completion = sum(r.completion_tokens for r in ok)
    wall = max(run["wall_s"], 1e-9)
    tpots = [statistics.fmean(r.itl_s) for r in ok if r.itl_s]
    phases = {ls_dict["phase"]: d("prefixgate_cache_manage_seconds_total", phase=ls_dict["phase"])
              for ls_dict in (dict(ls) for (n, ls) in after if n == "prefixgate_cache_manage_seconds_total")}
    prefill_tokens = d("prefixgate_prefill_tokens_total")
    prefill_s = d("prefixgate_prefill_seconds_total")
    evictions = {t: d("prefixgate_kv_evictions_total", tier=t)
                 for t in label_values(after, "prefixgate_kv_evictions_total", "tier")}
    for tier in label_values(after, "prefixgate_tier_drops_total", "tier"):
        evictions[tier] = d("prefixgate_tier_drops_total", tier=tier)

    def gauge_series(name: str, **labels: str) -> list[float]:
        return [msum(s, name, **labels) for _, s in samples if any(n == name for (n, _) in s)]

    bpt = msum(after, "prefixgate_kv_bytes_per_token")
    used = gauge_series("prefixgate_kv_blocks_used")
    evictable = gauge_series("prefixgate_kv_blocks_evictable")
    total_blocks = msum(after, "prefixgate_kv_blocks_used") + msum(after, "prefixgate_kv_blocks_free")
    block_size = msum(after, "prefixgate_kv_block_size") or 16
    frag = gauge_series("prefixgate_kv_fragmentation")
    reasons = {reason: statistics.fmean(gauge_series("prefixgate_waiting_requests", reason=reason) or [0.0])
               for reason in label_values(after, "prefixgate_waiting_requests", "reason")}
    tier_bytes = {t: max(gauge_series("prefixgate_tier_bytes_used", tier=t) or [0.0])
                  for t in label_values(after, "prefixgate_tier_bytes_used", "tier")}
    return {
        "requests": len(recs), "errors": len(recs) - len(ok),
        "first_error": next((r.error for r in recs if r.error), None),
        "wall_s": run["wall_s"],
        "ttft_s": _dist([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_s": _dist(tpots),
        "itl_s": _dist([x for r in ok for x in r.itl_s]),
        "prompt_tokens": prompt, "completion_tokens": completion,
        "prompt_tokens_per_s": prompt / wall, "output_tokens_per_s": completion / wall,
        "hit_rate": cached / prompt if prompt else 0.0,
        "reused_tokens": cached,
        "engine_hit_rate": (d("prefixgate_prompt_tokens_hit_total") / d("prefixgate_prompt_tokens_queried_total")
                            if d("prefixgate_prompt_tokens_queried_total") else None),
        "evictions": evictions,
        "preemptions": d("prefixgate_preemptions_total"),
        "restore_bytes": d("prefixgate_tier_restore_bytes_total"),
        "restored_blocks": d("prefixgate_tier_restores_total"),
        "tier_hit_blocks": d("prefixgate_tier_hits_total"),  # found in DRAM/NVMe by a prefix lookup
        "demoted_blocks": d("prefixgate_tier_demotions_total"),
        "demotions_skipped": {r: d("prefixgate_tier_demotions_skipped_total", reason=r)
                              for r in label_values(after, "prefixgate_tier_demotions_skipped_total", "reason")},
        "fragmentation": {"mean": statistics.fmean(frag) if frag else None, "max": max(frag) if frag else None},
        "hbm": {"blocks_total": total_blocks, "blocks_used_max": max(used, default=0.0),
                "blocks_cached_max": max(evictable, default=0.0),
                "bytes_used_max": max((u + e for u, e in zip(used, evictable)), default=0.0) * bpt * block_size},
        "dram_bytes_max": tier_bytes.get("dram"), "nvme_bytes_max": tier_bytes.get("nvme"),
        "queue_reasons_mean_waiting": reasons,
        "cache_time_s": phases,
        "prefill_tokens": prefill_tokens, "prefill_s": prefill_s,
        "prefill_tokens_per_s": prefill_tokens / prefill_s if prefill_s > 0 else None,
        "timeline": [{"t_end_s": r.end_s, "prompt": r.prompt_tokens, "cached": r.cached_tokens} for r in ok],
        "ttfts": [r.ttft_s for r in ok if r.ttft_s is not None],
    }


def add_break_even(cells: list[dict[str, Any]]) -> None:
    """Fill each cell's ``break_even``: prefill time its hits saved vs time its cache management cost."""
    cold = {c["workload"]: c["summary"]["prefill_tokens_per_s"] for c in cells if c["config"] == "nocache"}
    for c in cells:
        s = c["summary"]
        tps = cold.get(c["workload"]) or s["prefill_tokens_per_s"]
        cost = sum(s["cache_time_s"].values())
        saved = s["reused_tokens"] / tps if tps else None
        c["break_even"] = {
            "cold_prefill_tokens_per_s": tps,
            "cold_prefill_from": "nocache" if c["workload"] in cold and cold[c["workload"]] else "own run",
            "prefill_saved_s": saved, "cache_cost_s": cost,
            "net_s": saved - cost if saved is not None else None,
            "saved_per_cost": saved / cost if saved is not None and cost > 0 else None,
        }


# ---------------------------------------------------------------------- output


def _fmt(v: Any, scale: float = 1.0, digits: int = 0) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}"


def format_table(cells: list[dict[str, Any]]) -> str:
    cols = [("workload", 14), ("config", 11), ("req", 4), ("err", 3), ("ttft50", 7), ("ttft95", 7), ("ttft99", 7),
            ("tpot50", 7), ("itl95", 7), ("ptok/s", 7), ("otok/s", 6), ("hit%", 5), ("reused", 7), ("evict", 5),
            ("frag%", 5), ("cost", 7), ("saved", 7), ("net", 8)]
    lines = ["  ".join(f"{n:>{w}}" for n, w in cols)]
    lines.append("  ".join(f"{'':>{w}}" if n not in ("ttft50", "ttft95", "ttft99", "tpot50", "itl95", "cost",
                                                      "saved", "net") else f"{'ms':>{w}}" for n, w in cols))
    for c in cells:
        s, b = c["summary"], c["break_even"]
        row = [c["workload"], c["config"], s["requests"], s["errors"], _fmt(s["ttft_s"]["p50"], 1e3),
               _fmt(s["ttft_s"]["p95"], 1e3), _fmt(s["ttft_s"]["p99"], 1e3), _fmt(s["tpot_s"]["p50"], 1e3),
               _fmt(s["itl_s"]["p95"], 1e3), _fmt(s["prompt_tokens_per_s"]), _fmt(s["output_tokens_per_s"], 1, 1),
               _fmt(s["hit_rate"], 100), s["reused_tokens"], int(sum(s["evictions"].values())),
               _fmt(s["fragmentation"]["max"], 100, 1), _fmt(b["cache_cost_s"], 1e3, 1),
               _fmt(b["prefill_saved_s"], 1e3, 1), _fmt(b["net_s"], 1e3, 1)]
        lines.append("  ".join(f"{str(v):>{w}}" for v, (_, w) in zip(row, cols)))
    return "\n".join(lines)


def write_plots(cells: list[dict[str, Any]], prefix: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(c["workload"] for c in cells))
    colors = {"cache+canon": "tab:green", "cache": "tab:blue", "nocache": "tab:red", "external": "tab:purple"}
    ncols = min(3, len(workloads))
    nrows = -(-len(workloads) // ncols)
    paths = []

    def grid(name: str, title: str, draw: Callable[[Axes, dict[str, Any]], None], xlabel: str, ylabel: str,
             legend_loc: str, **limits: tuple[float | None, float | None]) -> None:
        """One panel per workload, ``draw(ax, cell)`` for each of its cells, saved as ``<prefix>_<name>.png``."""
        fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.2 * nrows), squeeze=False)
        for ax, wl in zip(axes.flat, workloads):
            for c in (c for c in cells if c["workload"] == wl):
                draw(ax, c)
            ax.set(title=wl, xlabel=xlabel, ylabel=ylabel, **limits)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8, loc=legend_loc)
        for ax in list(axes.flat)[len(workloads):]:
            ax.axis("off")
        fig.suptitle(title)
        fig.tight_layout()
        paths.append(prefix.with_name(f"{prefix.name}_{name}.png"))
        fig.savefig(paths[-1], dpi=72)
        plt.close(fig)

    def ttft_cdf(ax: Axes, c: dict[str, Any]) -> None:
        xs = sorted(t * 1e3 for t in c["summary"]["ttfts"])
        if xs:
            ys = [i / len(xs) for i in range(len(xs) + 1)]
            ax.step([0.0, *xs], ys, where="post", color=colors[c["config"]], label=c["config"])

    def hit_rate(ax: Axes, c: dict[str, Any]) -> None:
        tl = sorted(c["summary"]["timeline"], key=lambda x: x["t_end_s"])
        xs, ys, p, h = [], [], 0, 0
        for point in tl:  # cumulative hit rate as requests finish
            p += point["prompt"]
            h += point["cached"]
            xs.append(point["t_end_s"])
            ys.append(100 * h / p if p else 0)
        ax.plot(xs, ys, marker=".", color=colors[c["config"]], label=c["config"])

    grid("ttft", "Time to first token: CDF per workload (left = faster)", ttft_cdf,
         "TTFT (ms)", "fraction of requests", "lower right", xlim=(0, None), ylim=(0, 1.02))
    grid("hitrate", "Prefix-cache hit rate over time (cached / prompt tokens, cumulative)", hit_rate,
         "time since workload start (s)", "cumulative hit rate (%)", "upper left", ylim=(-2, 102))
    return paths


def _machine() -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                            "cpus": os.cpu_count(), "python": platform.python_version(),
                            "load_average_1_5_15": list(os.getloadavg())}
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10)
        if gpu.returncode == 0 and gpu.stdout.strip():
            info["gpu"] = gpu.stdout.strip().splitlines()
    return info


def _git_commit() -> str | None:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=CODE_ROOT,
                                timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=CODE_ROOT, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (commit + ("-dirty" if dirty else "")) or None


# ---------------------------------------------------------------------- the whole run


@dataclass(frozen=True)
class BenchOptions:
    workloads: tuple[str, ...] = WORKLOADS
    configs: tuple[str, ...] = ("cache+canon", "cache", "nocache")
    canon: str = "reorder"
    model_dir: Path | None = None  # local gateways' model (None with url)
    device: str = "cpu"
    kv_blocks: int | None = 384
    dram_bytes: str | None = None  # lower KV tiers of the local gateways (serve's SIZE syntax)
    nvme_bytes: str | None = None
    concurrency: int = 4
    max_duration_s: float = 60.0
    sample_interval_s: float = 0.2
    seed: int = 0
    sizes: TraceSizes = field(default_factory=TraceSizes)
    url: str | None = None
    api_keys: tuple[str, ...] = ()
    model_name: str | None = None
    out_dir: Path = field(default_factory=default_results_dir)
    plots: bool = True
    progress: bool = True
    start_timeout_s: float = 180.0
    command: str = ""

    def __post_init__(self) -> None:
        bad = [w for w in self.workloads if w not in WORKLOADS]
        if bad:
            raise BenchError(f"unknown workload {bad[0]!r}; choose from {', '.join(WORKLOADS)}")
        if not self.workloads:
            raise BenchError("no workloads selected")
        if self.canon not in ("safe", "reorder"):
            raise BenchError(f"--canon must be safe or reorder, got {self.canon!r}")
        if self.concurrency < 1 or self.max_duration_s <= 0 or self.sample_interval_s <= 0:
            raise BenchError("--concurrency must be >= 1, --max-duration and --sample-interval > 0")
        if self.url is None and self.model_dir is None:
            raise BenchError("give a model for local gateways, or --url of a running gateway")


def run_bench(opts: BenchOptions) -> dict[str, Any]:
    """Run every configuration x workload, write JSON/table/PNGs; returns the result document."""
    from tqdm import tqdm

    traces = {w: build_trace(w, opts.sizes, opts.seed) for w in opts.workloads}
    tenants = {w: 1 + max(s.tenant for s in traces[w]) for w in opts.workloads}
    configs = ([GatewayConfig("external", True, "as configured")] if opts.url
               else configs_for(list(opts.configs), opts.canon))
    total = sum(len(s.turns) for w in opts.workloads for s in traces[w]) * len(configs)
    started = datetime.now(UTC)
    commit = _git_commit()  # at the start: the code that ran, even if the tree changes meanwhile
    cells: list[dict[str, Any]] = []
    gateways: list[LocalGateway] = []
    if not opts.url:
        assert opts.model_dir is not None
        gateways = [LocalGateway(c, opts.model_dir, device=opts.device, kv_blocks=opts.kv_blocks, tenants=tenants,
                                 dram_bytes=opts.dram_bytes, nvme_bytes=opts.nvme_bytes)
                    for c in configs]
    # On CPU the gateways load side by side (an idle engine thread sleeps, so waiting gateways do not
    # disturb the one being measured); on a GPU one at a time, so each sizes its KV cache alone.
    parallel_start = opts.device == "cpu"
    progress = tqdm(total=total, unit="req", disable=not opts.progress, file=sys.stderr)
    try:
        if parallel_start:
            for gw in gateways:
                gw.start()
        for i, config in enumerate(configs):
            if opts.url:
                target = external_target(opts.url, list(opts.api_keys), opts.model_name)
            else:
                if not parallel_start:
                    gateways[i].start()
                progress.set_description(f"starting {config.name}")
                target = gateways[i].wait_healthy(opts.start_timeout_s)
            try:
                for workload in opts.workloads:
                    progress.set_description(f"{config.name}/{workload}")
                    run = asyncio.run(run_workload(
                        target, workload, traces[workload], concurrency=opts.concurrency,
                        max_duration_s=opts.max_duration_s, sample_interval_s=opts.sample_interval_s,
                        progress=progress))
                    cells.append({"config": config.name, "workload": workload, "summary": summarize(run),
                                  "sessions": len(traces[workload]), "tenants": tenants[workload]})
            finally:
                if gateways:
                    gateways[i].stop()
    finally:
        progress.close()
        for gw in gateways:
            gw.stop()
    add_break_even(cells)
    table = format_table(cells)
    stamp = started.strftime("%Y%m%dT%H%M%SZ")
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    prefix = opts.out_dir / f"workloads_{stamp}"
    plots = [str(p) for p in write_plots(cells, prefix)] if opts.plots else []
    doc = {
        "benchmark": "workloads",
        "command": opts.command or " ".join(sys.argv),
        "started_at": started.isoformat(),
        "git_commit": commit,
        "machine": _machine(),
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(opts).items()
                    if k not in ("api_keys", "sizes", "command")},
        "sizes": asdict(opts.sizes),
        "configs": [asdict(c) for c in configs],
        "cells": cells,
        "table": table,
        "plots": plots,
    }
    json_path = prefix.with_suffix(".json")
    json_path.write_text(json.dumps(doc, indent=1, default=str))
    prefix.with_suffix(".txt").write_text(f"{doc['command']}\ncommit {doc['git_commit']}  {started.isoformat()}\n\n"
                                          f"{table}\n")
    doc["json_path"] = str(json_path)
    return doc
