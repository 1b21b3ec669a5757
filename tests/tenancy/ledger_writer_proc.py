"""A ledger-writing process for the crash test: ``python ledger_writer_proc.py HOME [DATABASE_URL]``.

Records rows ``r0, r1, ...`` forever through a TenancyService (batched writer thread). Every 200
rows it flushes and prints ``committed N`` (rows r0..r{N-1} are on disk). Row i's values are a pure
function of i (``expected_row``), so the parent can check every surviving row is whole.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: the project is not installed

from tenancy.service import TenancyService  # noqa: E402
from tenancy.types import UsageRecord  # noqa: E402


def expected_row(i: int, tenant_id: str, key_id: str) -> dict:
    return {
        "request_id": f"r{i}", "tenant_id": tenant_id, "key_id": key_id, "model": f"model-{i % 3}",
        "backend": "local", "prompt_tokens": 100 + i, "cached_tokens": i % 50, "completion_tokens": i % 7,
        "ttft_s": i / 1000.0, "latency_s": i / 100.0, "status": "ok", "created_at": 1_700_000_000.0 + i,
    }


def main() -> None:
    home = Path(sys.argv[1])
    url = sys.argv[2] if len(sys.argv) > 2 else None
    svc = TenancyService.open(home, ledger_batch_max=64, ledger_max_delay_s=0.001, database_url=url)
    created = svc.create_tenant("crash")
    ctx = svc.authenticate(created.api_key)
    print(f"tenant {ctx.tenant_id} {ctx.key_id}", flush=True)
    i = 0
    while True:
        svc.record_usage(UsageRecord(**expected_row(i, ctx.tenant_id, ctx.key_id)))
        i += 1
        if i % 200 == 0:
            svc.flush()
            print(f"committed {i}", flush=True)


if __name__ == "__main__":
    main()
