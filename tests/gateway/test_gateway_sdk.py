"""The real openai SDK and headless Chromium against a real gateway on loopback (fake engine/tenancy).

The same flows run against the real engine, tenancy and canonicalizer in test_gateway_e2e.py.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import openai
import pytest
from gateway_fakes import FakeEngine, FakeTenancy, LoopbackServer

from gateway.app import create_app
from gateway.settings import GatewaySettings

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
MESSAGES = [{"role": "system", "content": "You answer in one word. " * 4}, {"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server():
    engine, tenancy = FakeEngine(), FakeTenancy()
    keys = {"a": tenancy.add("acme"), "b": tenancy.add("beta"), "admin": tenancy.add("ops", admin=True)}
    with LoopbackServer(create_app(GatewaySettings(), engine=engine, tenancy=tenancy)) as srv:
        yield srv, keys, tenancy


def sdk(srv, key):
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=key, max_retries=0)


def test_openai_sdk_chat_stream_and_errors(server):
    srv, keys, _ = server
    client = sdk(srv, keys["a"])
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3)
    assert r.choices[0].message.content == " w0 w1 w2" and r.usage.prompt_tokens_details.cached_tokens == 0
    r2 = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3)
    assert r2.usage.prompt_tokens_details.cached_tokens > 0
    other = sdk(srv, keys["b"]).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3)
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, stream=True,
                                                 stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == " w0 w1"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2
    comp = client.completions.create(model="tiny", prompt="a b c", max_tokens=2)
    assert comp.choices[0].text == " w0 w1"
    assert [m.id for m in client.models.list()] == ["tiny"]
    with pytest.raises(openai.AuthenticationError):
        sdk(srv, "sk-wrong").chat.completions.create(model="tiny", messages=MESSAGES)
    with pytest.raises(openai.NotFoundError) as nf:
        client.chat.completions.create(model="nope", messages=MESSAGES)
    assert nf.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as br:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10_000)
    assert br.value.code == "context_length_exceeded"


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="chromium is not installed")
def test_dashboard_renders_in_headless_chromium(server, tmp_path):
    srv, keys, _ = server
    client = sdk(srv, keys["a"])
    for _ in range(2):
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1)
    sdk(srv, keys["b"]).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1)
    dom = render_dashboard(f"{srv.url}/dashboard#key={keys['admin']}", tmp_path, "dashboard.png")
    assert 'data-tenant="acme"' in dom and 'data-tenant="beta"' in dom
    assert "all tenants" in dom


def render_dashboard(url: str, tmp_path: Path, png: str) -> str:
    """Load the dashboard in headless Chromium: return the DOM after its script ran; save a screenshot."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / png
    shot.unlink(missing_ok=True)
    flags = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=4000", "--window-size=1280,720"]
    dom = subprocess.run([*flags, "--dump-dom", url], capture_output=True, text=True, timeout=60).stdout
    assert 'data-loaded="1"' in dom and '<span id="status">error' not in dom, dom[-2000:]
    subprocess.run([*flags, f"--screenshot={shot}", url], capture_output=True, timeout=60)
    assert shot.exists() and shot.stat().st_size > 5000
    return dom
