"""How long the ingress scan holds the GIL in one C call, per string against joined (session 26).

``gateway.ingress.scan`` walks a parsed body in Python (bytecode: the interpreter hands the GIL to
another thread every 5 ms), then ends in C: it searched every collected string for a lone surrogate
with ``any(map(search, texts))`` and summed their lengths with ``sum(map(len, texts))``. Both loops
run inside C, where no switch happens, so for a body of many short strings (allowed: at most 4,096
entries a list, but any number of lists) no other thread ran until both were done, the event loop
serving every other tenant included. ``scan`` now joins the strings and searches once, and takes the
length of the join. This times both tails on the same strings, and what a ticker thread (waking every
millisecond) sees as its longest wait while each runs, beside the whole ``scan`` and the whole
validation of the same body for scale::

    python benchmarks/ingress_gil.py [--lists 160] [--per-list 4000] [--rounds 7]

Writes ``benchmarks/results/ingress_gil.json`` (command, machine, commit, medians, ratios).

Prediction, written before the first run (2-core build machine, 160 lists of 4,000 two-letter
strings, ~3.9 MB): per string ~45-60 ms, joined ~10-15 ms (3-5x); the ticker's longest wait
the same figures (the C call is the whole stall); the whole validation ~140 ms, of which the scan
~80 ms before and ~45 ms after.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dashboard_sampler import commit, machine  # noqa: E402

from gateway.ingress import _SURROGATE, scan  # noqa: E402
from gateway.schemas import ChatCompletionRequest  # noqa: E402


def many_strings_body(lists: int, per_list: int) -> bytes:
    """A chat body within the limits (lists of <= 4,096 entries) that holds lists x per_list short strings."""
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object",
                                                                             "enum": ["ab"] * per_list}}}
             for i in range(lists)]
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools}).encode()


def strings_of(value: object) -> list[str]:
    """Every string of a parsed body, keys included, as ``scan`` collects them."""
    out: list[str] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, dict):
            out.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return out


def per_string(texts: list[str]) -> int:
    """The tail as it was: one C-level loop of searches, one of lengths."""
    assert not any(map(_SURROGATE.search, texts))
    return sum(map(len, texts))


def joined(texts: list[str]) -> int:
    """The tail as it is: one join, one search, its length."""
    text = "".join(texts)
    assert not _SURROGATE.search(text)
    return len(text)


def longest_wait_ms(fn: Callable[[], object]) -> tuple[float, float]:
    """(fn's wall ms, the longest gap in ms between two wakeups of a thread sleeping 1 ms at a time
    while fn ran): a gap far over 1 ms is time that thread could not get the GIL."""
    stop = threading.Event()
    gaps: list[float] = []

    def tick() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    time.sleep(0.02)  # the ticker running before fn starts
    gaps.clear()
    t0 = time.perf_counter()
    fn()
    wall = time.perf_counter() - t0
    stop.set()
    ticker.join()
    return 1e3 * wall, 1e3 * max(gaps, default=0.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lists", type=int, default=160)
    ap.add_argument("--per-list", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default="benchmarks/results/ingress_gil.json")
    args = ap.parse_args()
    raw = many_strings_body(args.lists, args.per_list)
    data = json.loads(raw)
    texts = strings_of(data)
    assert per_string(texts) == joined(texts) == scan(data).chars
    rows: dict[str, dict[str, float]] = {}
    runs: dict[str, list[tuple[float, float]]] = {"per_string": [], "joined": [], "scan": [], "validate": []}
    for _ in range(args.rounds):  # interleaved, so the machine's load hits all alike
        runs["per_string"].append(longest_wait_ms(lambda: per_string(texts)))
        runs["joined"].append(longest_wait_ms(lambda: joined(texts)))
        runs["scan"].append(longest_wait_ms(lambda: scan(data)))
        runs["validate"].append(longest_wait_ms(lambda: ChatCompletionRequest.model_validate_json(raw)))
    for name, samples in runs.items():
        rows[name] = {"wall_ms": statistics.median(s[0] for s in samples),
                      "longest_wait_ms": statistics.median(s[1] for s in samples)}
    result = {"command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]), "machine": machine(),
              "commit": commit(), "body_bytes": len(raw), "strings": len(texts), "rounds": args.rounds,
              "medians": rows,
              "tail_speedup": rows["per_string"]["wall_ms"] / rows["joined"]["wall_ms"],
              "tail_wait_ratio": rows["per_string"]["longest_wait_ms"] / rows["joined"]["longest_wait_ms"]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"{len(raw) / 1e6:.1f} MB body, {len(texts)} strings, median of {args.rounds} rounds")
    print(f"{'step':<12}{'wall ms':>10}{'longest wait ms':>18}")
    for name, row in rows.items():
        print(f"{name:<12}{row['wall_ms']:>10.1f}{row['longest_wait_ms']:>18.1f}")
    print(f"tail: joined {result['tail_speedup']:.1f}x faster, the longest wait {result['tail_wait_ratio']:.1f}x shorter")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
