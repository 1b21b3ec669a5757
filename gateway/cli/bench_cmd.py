"""``prefixgate bench``: workload benchmarks (code in ``gateway.bench``, an installed package).

The flags live here (they are the CLI contract; registering them imports nothing heavy); the run
itself is ``gateway.bench.replay.run_bench``, imported only when the command runs.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from gateway.cli.http_args import api_key, gateway_url
from gateway.cli.main import CLIError, resolve_home

_WORKLOADS = ("system_prompts", "chat", "agents", "rag", "random")
# flag -> TraceSizes field (defaults live in TraceSizes)
_SIZE_FLAGS = {
    "tenants": "tenants of system_prompts, chat, rag and random", "agent_tenants": "tenants of agents", "requests": "requests of system_prompts, rag and random",
    "system_words": "words of a long system prompt", "chat_sessions": "chat sessions",
    "chat_turns": "turns per chat session", "agent_sessions": "agent sessions",
    "agent_steps": "tool call + result rounds per agent session", "tools": "tools per agent",
    "rag_docs": "shared RAG documents", "rag_top_k": "documents per RAG request",
    "doc_words": "words per document / tool result", "user_words": "words per user message",
    "max_tokens": "completion tokens per request",
}


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workloads", default=",".join(_WORKLOADS),
                   help=f"comma-separated subset of {','.join(_WORKLOADS)} (default: all)")
    p.add_argument("--configs", default="cache+canon,cache,nocache",
                   help="comma-separated gateway configurations to compare (default: all three)")
    p.add_argument("--canon", default="reorder", choices=["safe", "reorder"],
                   help="canonicalization mode of the cache+canon tenants (default reorder)")
    p.add_argument("--model", default="tiny", help="checkpoint directory or 'tiny' (built under --home)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] for the local gateways")
    p.add_argument("--kv-blocks", type=int, default=384,
                   help="KV blocks of each local gateway (default 384: small enough to evict; 0 = engine default)")
    p.add_argument("--dram-bytes", default=None, help="DRAM KV tier of each local gateway, e.g. 256MiB (default off)")
    p.add_argument("--nvme-bytes", default=None,
                   help="NVMe KV tier of each local gateway, in its temporary home, e.g. 1GiB (default off)")
    p.add_argument("--concurrency", type=int, default=4, help="sessions in flight at once (default 4)")
    p.add_argument("--max-duration", type=float, default=60.0,
                   help="seconds per workload after which no new session starts (default 60)")
    p.add_argument("--sample-interval", type=float, default=0.2, help="seconds between /metrics samples")
    p.add_argument("--seed", type=int, default=0, help="trace seed (default 0)")
    for name, help_text in _SIZE_FLAGS.items():
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None, dest=name, help=help_text)
    p.add_argument("--url", default=None, help="drive this running gateway (loopback) instead of starting ones")
    p.add_argument("--api-key", action="append", default=[], dest="api_keys",
                   help="tenant API key for --url (repeat for several tenants)")
    p.add_argument("--model-name", default=None, help="model name to request with --url (default: the first listed)")
    p.add_argument("--out-dir", default=None,
                   help="where results go (default: benchmarks/results in a checkout, else ./prefixgate-bench)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNGs")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def register(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    p = subparsers.add_parser(
        "bench", parents=[common], help="replay multi-tenant workloads; cache on/off, canon on/off",
        description="Replay multi-tenant traces (system prompts, chat, agents, RAG, random) against "
        "gateways over loopback HTTP and report latency, hit rate and the cache's break-even.")
    add_bench_arguments(p)
    p.set_defaults(func=run_bench_cmd)


def _model_dir(args: argparse.Namespace) -> Path | None:
    if args.url:
        return None
    if args.model == "tiny":
        from engine.launch import ensure_tiny_model

        return ensure_tiny_model(resolve_home(args.home))
    path = Path(args.model).expanduser()
    if not (path / "config.json").exists():
        raise CLIError(f"--model {args.model}: not a checkpoint directory (no config.json); use a directory or 'tiny'")
    return path


def _size(value: str | None, flag: str) -> str | None:
    """Checked here so a typo fails before any gateway starts; serve gets the text as given."""
    if value is None:
        return None
    from engine.config import parse_size

    try:
        parse_size(value)
    except ValueError as exc:
        raise CLIError(f"{flag}: {exc}") from None
    return value


def run_bench_cmd(args: argparse.Namespace) -> int:
    if args.url is not None:  # before anything starts: a bad one is one line, not httpx's traceback
        gateway_url(args.url)
    for key in args.api_keys:
        api_key(key, "--api-key")
    try:
        from gateway.bench import replay as wl
        from gateway.bench.traces import TraceSizes
    except ModuleNotFoundError as exc:  # matplotlib/tqdm come with the [bench] extra
        raise CLIError(f"prefixgate bench needs {exc.name!r}: pip install 'prefixgate[bench]'") from None

    try:
        sizes = TraceSizes(**{k: getattr(args, k) for k in _SIZE_FLAGS if getattr(args, k) is not None})
        opts = wl.BenchOptions(
            workloads=tuple(w.strip() for w in args.workloads.split(",") if w.strip()),
            configs=tuple(c.strip() for c in args.configs.split(",") if c.strip()),
            canon=args.canon, model_dir=_model_dir(args), device=args.device,
            kv_blocks=args.kv_blocks or None, dram_bytes=_size(args.dram_bytes, "--dram-bytes"),
            nvme_bytes=_size(args.nvme_bytes, "--nvme-bytes"), concurrency=args.concurrency, max_duration_s=args.max_duration,
            sample_interval_s=args.sample_interval, seed=args.seed, sizes=sizes, url=args.url,
            api_keys=tuple(args.api_keys), model_name=args.model_name,
            out_dir=Path(args.out_dir) if args.out_dir else wl.default_results_dir(), plots=not args.no_plots,
            progress=not args.no_progress, command="prefixgate " + shlex.join(sys.argv[1:]),
        )
        doc = wl.run_bench(opts)
    except ValueError as exc:  # BenchError and TraceSizes validation
        raise CLIError(str(exc)) from None
    except ModuleNotFoundError as exc:  # plots and progress are imported when first used
        raise CLIError(f"prefixgate bench needs {exc.name!r}: pip install 'prefixgate[bench]'") from None
    print(doc["table"])
    print(f"\nwrote {doc['json_path']}" + "".join(f"\nwrote {p}" for p in doc["plots"]))
    return 0
