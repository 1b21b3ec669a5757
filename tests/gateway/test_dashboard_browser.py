"""The operations panel in a real browser: headless Chromium against a real ``prefixgate serve`` (tiny
model, DRAM tier, real tenancy) under a small load from the openai SDK.

Asserts the charts are drawn with data, the numbers on the page are the ledger's, a tenant key sees
only its own row, and the page logs nothing to the console. Screenshots (1400x900 and a phone) go to
``tests/artifacts/`` for a person to look at.
"""

from __future__ import annotations

import re
import subprocess
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tenancy.service import TenancyService
from tests.serverutil import serve_tiny, stop

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="chromium is not installed (apt-get install chromium)")

SYSTEM = "You are the support assistant of ExampleCo. Answer briefly and only about our products. " * 4


@pytest.fixture(scope="module")
def loaded_server(tmp_path_factory):
    home = tmp_path_factory.mktemp("panel-home")
    with TenancyService.open(home) as svc:
        keys = {"acme": svc.create_tenant("acme").api_key, "beta": svc.create_tenant("beta", rpm=4).api_key,
                "ops": svc.create_tenant("ops", admin=True).api_key}
        svc.flush()
    url, proc = serve_tiny(home, "--kv-blocks", "24", "--dram-bytes", "32MiB", timeout=300)
    stop_load = threading.Event()
    counts = {"acme": 0, "beta_ok": 0, "beta_429": 0}

    def load() -> None:
        acme = openai.OpenAI(base_url=f"{url}/v1", api_key=keys["acme"], max_retries=0, timeout=60)
        beta = openai.OpenAI(base_url=f"{url}/v1", api_key=keys["beta"], max_retries=0, timeout=60)
        i = 0
        while not stop_load.is_set():
            # a few families that recur (hits) and enough distinct prompts to evict into DRAM
            system = f"Variant {i % 8}. " + SYSTEM
            acme.chat.completions.create(model="tiny", max_tokens=4, messages=[
                {"role": "system", "content": system}, {"role": "user", "content": f"question {i}"}])
            counts["acme"] += 1
            if i < 6:  # beta: 6 requests against rpm 4 -> 2 refused
                try:
                    beta.chat.completions.create(model="tiny", max_tokens=2, messages=[
                        {"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}])
                    counts["beta_ok"] += 1
                except openai.RateLimitError:
                    counts["beta_429"] += 1
            i += 1
            time.sleep(0.05)

    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    time.sleep(12)  # at least two samples of the 5 s ring with traffic between them
    try:
        yield url, keys, counts, stop_load
    finally:
        stop_load.set()
        loader.join(60)
        stop(proc)


def chromium(url: str, profile: Path, *, size: str, shot: Path | None = None) -> tuple[str, list[str]]:
    """Run headless Chromium on ``url``: (DOM after the scripts ran, console lines). Saves ``shot``."""
    flags = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--hide-scrollbars", f"--user-data-dir={profile}", "--virtual-time-budget=6000",
             f"--window-size={size}", "--enable-logging=stderr", "--v=0"]
    mode = [f"--screenshot={shot}"] if shot is not None else ["--dump-dom"]
    run = subprocess.run([*flags, *mode, url], capture_output=True, text=True, timeout=90)
    console = [ln for ln in run.stderr.splitlines() if ":CONSOLE(" in ln or "Uncaught" in ln]
    return run.stdout, console


def test_panel_in_chromium_shows_live_charts_and_the_ledgers_numbers(loaded_server, tmp_path):
    url, keys, counts, stop_load = loaded_server
    page = f"{url}/dashboard#key={keys['ops']}"
    dom, console = chromium(page, tmp_path / "p1", size="1400,900")
    assert console == [], console
    assert 'data-loaded="1"' in dom and "all tenants" in dom, dom[-2000:]
    charts = dict(re.findall(r'data-chart="(\w+)" data-points="(\d+)"', dom))
    assert set(charts) >= {"ttft", "tpot", "tokens", "outcomes", "hit", "kvshare", "kvbytes", "evict", "restore",
                           "frag", "queue"}, charts
    assert all(int(n) >= 2 for n in charts.values()), charts
    assert dom.count('class="uplot') >= 11  # uPlot drew every chart
    # the rows: beta made 6 requests, 2 of them refused with 429, and the page says so
    beta = re.search(r'<tr data-tenant="beta">(.*?)</tr>', dom).group(1)
    cells = re.findall(r"<td[^>]*>(.*?)</td>", beta)
    assert cells[1] == "6 (2 err)" and cells[2] == "429_rate_limit 2", cells
    assert counts["beta_ok"] == 4 and counts["beta_429"] == 2
    stop_load.set()
    time.sleep(1.0)
    # numbers on the page equal the ledger's (its own endpoint, same process)
    usage = httpx.get(f"{url}/v1/usage", headers={"Authorization": f"Bearer {keys['ops']}"}, timeout=30).json()
    ledger = {t["tenant"]: t for t in usage["tenants"]}
    dom, console = chromium(page, tmp_path / "p2", size="1400,900")
    assert console == [], console
    acme = re.findall(r"<td[^>]*>(.*?)</td>", re.search(r'<tr data-tenant="acme">(.*?)</tr>', dom).group(1))
    assert acme[1] == f"{ledger['acme']['requests']:,}" and acme[4] == f"{ledger['acme']['prompt_tokens']:,}", acme
    assert acme[5] == f"{ledger['acme']['cached_tokens']:,}", acme
    assert "Prompt family (most computed)" in dom and "prefix:tiny:" in dom and "ExampleCo" not in dom
    # the engine's most recomputed prefixes by block hash, and each tier's "used / quota"
    prefixes = re.search(r'<tbody id="prefixes">(.*?)</tbody>', dom, re.S).group(1)
    assert re.search(r">[0-9a-f]{12}<", prefixes), prefixes
    isolation = re.search(r'<tbody id="isolation">(.*?)</tbody>', dom, re.S).group(1)
    assert re.search(r">\d[\d,]* / ∞<", isolation), isolation

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    for name, size in (("panel-1400x900.png", "1400,900"), ("panel-phone-390x844.png", "390,844"),
                       ("panel-full-1400x2600.png", "1400,2600")):
        shot = ARTIFACTS / name
        shot.unlink(missing_ok=True)
        _, console = chromium(page, tmp_path / f"s-{name}", size=size, shot=shot)
        assert console == [] and shot.exists() and shot.stat().st_size > 20_000, (name, console)


def test_a_tenant_key_sees_only_its_own_row_and_no_engine_charts(loaded_server, tmp_path):
    url, keys, _, _ = loaded_server
    dom, console = chromium(f"{url}/dashboard#key={keys['beta']}", tmp_path / "p", size="1400,900")
    assert console == [], console
    assert "your tenant" in dom and dom.count("data-tenant=") == 1 and 'data-tenant="beta"' in dom
    assert 'data-chart="' not in dom  # the engine-wide series are the operator's
