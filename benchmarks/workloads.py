"""``python benchmarks/workloads.py ...``: the workload replay, the same flags as ``prefixgate bench``.

A thin caller kept for the benchmark scripts' habit of one file per claim. The code lives in the
installed package, ``gateway.bench`` (runner, metrics, table, plots in ``replay``; traces in
``traces``), so ``prefixgate bench`` also works outside a checkout.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__" and __package__ in (None, ""):  # `python benchmarks/workloads.py` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.cli.main import main as cli_main  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    return cli_main(["bench", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
