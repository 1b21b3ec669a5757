"""The cache-miss loop, end to end on this machine (CPU, the tiny model, no network):

    1. start `prefixgate serve` and send traffic from an app that renders prompts/support.txt
       (it stamps the current time into the system prompt, a classic cache breaker);
    2. read `prefixgate report --format json`: the top break reason and what it cost;
    3. `promptlint check prompts --from-usage report.json` points at the template line;
    4. `promptlint check prompts --fix` moves the line (the template marks it movable);
    5. send the same traffic again: the hit rate rises.

Run:  python examples/miss_loop/run.py [--requests N]   (from the repository root; ~1-2 minutes)
Everything happens in a temporary directory; the template in the repository is not modified.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import openai

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
QUESTIONS = ["Where is my parcel?", "Can I return shoes I wore once?", "How long do refunds take?",
             "My mug arrived broken.", "Do gift cards expire?", "Is there a warranty on the kettle?"]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "NO_PROXY": "127.0.0.1,localhost",
            "LITELLM_LOCAL_MODEL_COST_MAP": "True", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, *argv], cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    if check and out.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(argv)} failed ({out.returncode}): {out.stderr}")
    return out


def render(template_path: Path, now: datetime) -> str:
    """What the application does: strip the front matter, fill the template."""
    text = template_path.read_text(encoding="utf-8").split("---\n", 2)[-1]
    return text.format(timestamp=now.isoformat(timespec="seconds")).strip()


def traffic(client: openai.OpenAI, template: Path, n: int, start: datetime) -> tuple[int, int]:
    prompt = cached = 0
    for i in range(n):
        now = start + timedelta(seconds=37 * i)
        r = client.chat.completions.with_raw_response.create(
            model="tiny", max_tokens=1, temperature=0,
            messages=[{"role": "system", "content": render(template, now)},
                      {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
        usage = r.parse().usage
        prompt += usage.prompt_tokens
        cached += usage.prompt_tokens_details.cached_tokens
        print(f"  request {i + 1:2d}: {usage.prompt_tokens} prompt tokens, "
              f"{usage.prompt_tokens_details.cached_tokens:3d} cached   x-prefixgate-cache: "
              f"{r.headers.get('x-prefixgate-cache')}")
    return prompt, cached


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=8)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="miss-loop-"))
    home = work / "home"
    prompts = work / "prompts"
    shutil.copytree(HERE / "prompts", prompts)
    template = prompts / "support.txt"
    sh("-m", "gateway.cli.main", "model", "init-tiny", "--home", str(home))
    # --store-miss-context: the ledger keeps the text around each break (off by default), which is what
    # `promptlint --from-usage` matches against the template in step 3.
    key = json.loads(sh("-m", "gateway.cli.main", "tenant", "create", "shop", "--canon", "off",
                        "--store-miss-context", "--json", "--home", str(home)).stdout)["api_key"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "gateway.cli.main", "serve", "--home", str(home), "--port",
                               str(port), "--model", "tiny", "--kv-blocks", "1024", "--log-level", "warning"],
                              cwd=REPO, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)
        start = datetime(2026, 11, 29, 9, 0, tzinfo=UTC)

        print(f"1. traffic with the template as written ({args.requests} requests)")
        p1, c1 = traffic(client, template, args.requests, start)
        time.sleep(1.0)  # the ledger writer batches rows
        report = work / "report.json"
        report.write_text(sh("-m", "gateway.cli.main", "report", "--home", str(home), "--format", "json").stdout)
        rep = json.loads(report.read_text())
        print("\n2. prefixgate report: top cache-break reasons")
        for b in rep["breaks"]:
            print(f"  {b['tenant']}: {b['rule']} x{b['requests']}, {b['tokens_lost']} tokens lost, "
                  f"${b['usd_lost']:.6f} (priced as {rep['rows'][0]['priced_as']})")
        print(f"  e.g. {json.dumps({k: rep['misses'][0][k] for k in ('rule', 'detail', 'position', 'context')})}")

        print("\n3. promptlint check prompts --from-usage report.json")
        out = sh("-m", "promptlint", "check", str(prompts), "--from-usage", str(report))
        for line in out.stdout.splitlines():
            if "live traffic" in line:
                print("  " + line.replace(str(work) + "/", ""))

        print("\n4. promptlint check prompts --fix")
        out = sh("-m", "promptlint", "check", str(prompts), "--fix")
        print("  " + out.stderr.strip().replace(str(work) + "/", ""))

        print(f"\n5. the same traffic with the fixed template ({args.requests} requests)")
        p2, c2 = traffic(client, template, args.requests, start + timedelta(hours=1))
    finally:
        server.terminate()
        server.wait(timeout=30)
    before, after = c1 / p1, c2 / p2
    print(f"\nhit rate (cached / prompt tokens): before {100 * before:.1f}%  after {100 * after:.1f}%")
    shutil.rmtree(work, ignore_errors=True)
    return 0 if after > before else 1


if __name__ == "__main__":
    sys.exit(main())
