"""The README's first hour against a real server: one home, a banner that tells the truth, clear failures.

Every test here starts the real ``prefixgate`` entry point in a subprocess (what ``make serve`` runs
is ``dev-serve``) and talks to it over loopback with the real openai SDK.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.serverutil import REPO, error_lines, free_port, stop

README = REPO / "README.md"
CLI = [sys.executable, "-m", "gateway.cli.main"]


def _env(tmp_path: Path) -> dict[str, str]:
    """A user whose data directory is under tmp_path, with no PREFIXGATE_HOME: the default home rule."""
    env = {k: v for k, v in os.environ.items() if k != "PREFIXGATE_HOME"}
    env.update({"XDG_DATA_HOME": str(tmp_path / "xdg"), "HOME": str(tmp_path / "user"), "PYTHONPATH": str(REPO),
                "NO_PROXY": "127.0.0.1,localhost"})
    return env


def _seed_default_model(home: Path, smol_model_dir: Path) -> None:
    """Copy the session's converted default model where the server would convert it (same files)."""
    shutil.copytree(smol_model_dir, home / "models" / "smol")


def _readme_sequence() -> tuple[list[str], str]:
    """The shell commands and the Python snippet between the README's readme-sequence markers."""
    text = README.read_text(encoding="utf-8")
    block = text[text.index("<!-- readme-sequence:start -->"):text.index("<!-- readme-sequence:end -->")]
    bash = re.search(r"```bash\n(.*?)```", block, re.S).group(1)
    python = re.search(r"```python\n(.*?)```", block, re.S).group(1)
    commands = [line for line in bash.splitlines() if line.strip() and not line.startswith("#")]
    return commands, python


def _wait_for(log: Path, needle: str, proc: subprocess.Popen, timeout: float = 180.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace") if log.exists() else ""
        if needle in text:
            return text
        if proc.poll() is not None:
            raise AssertionError(f"server exited ({proc.returncode}) before {needle!r}:\n{text[-3000:]}")
        time.sleep(0.05)
    raise AssertionError(f"{needle!r} not printed within {timeout} s:\n{log.read_text(errors='replace')[-3000:]}")


@pytest.fixture
def make_serve(tmp_path, smol_model_dir):
    """Start ``dev-serve`` (what `make serve` runs) with the default home rule; yields (url, log, env)."""
    env = _env(tmp_path)
    home = tmp_path / "xdg" / "prefixgate"
    _seed_default_model(home, smol_model_dir)
    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([*CLI, "dev-serve", "--port", str(port), "--log-level", "warning"],
                                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield f"http://127.0.0.1:{port}", log, env, proc, home
    finally:
        stop(proc)


def test_banner_only_once_health_answers_and_says_how_to_go_on(make_serve):
    url, log, _, proc, home = make_serve
    text = _wait_for(log, "API key:", proc)
    # The banner is printed by a thread that saw /health 200 first: it must answer now.
    assert httpx.get(f"{url}/health", timeout=5, trust_env=False).status_code == 200
    text = _wait_for(log, "stop: Ctrl-C", proc)
    assert f"home={home}" in text
    assert "tenant create acme --json" in text and "activate" in text
    assert "make serve PORT=" in text
    key = re.search(r"API key:\s+(pg-\S+)", text).group(1)
    assert key == (home / "dev-api-key").read_text().strip()


def test_the_readme_sequence_works_verbatim_against_make_serve(make_serve, tmp_path):
    url, log, env, proc, home = make_serve
    _wait_for(log, "API key:", proc)
    started = time.time()
    commands, snippet = _readme_sequence()
    assert commands == [".venv/bin/prefixgate tenant create acme --json"]
    argv = commands[0].split()
    assert argv[0] == ".venv/bin/prefixgate"  # the venv's script is this interpreter's entry point
    res = subprocess.run([*CLI, *argv[1:]], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    created = json.loads(res.stdout)
    assert set(created) == {"tenant_id", "name", "api_key", "key_id"}
    # The snippet, as written, with the printed key and this test's port.
    port = url.rsplit(":", 1)[1]
    code = snippet.replace("pg-...the api_key printed above...", created["api_key"]).replace(":8000/", f":{port}/")
    assert code != snippet
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "README.md", "exec"), {})  # noqa: S102 - the README's own code is the test
    assert printed.getvalue().strip().endswith(" 0")  # content, then cached_tokens of a first request
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=created["api_key"], max_retries=0)
    models = client.models.list().data
    assert models and all(started - 600 < m.created <= time.time() + 1 for m in models)


def test_a_command_that_creates_the_home_says_which_and_why(tmp_path):
    env = _env(tmp_path)
    res = subprocess.run([*CLI, "tenant", "list", "--json"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and json.loads(res.stdout) == []
    home = tmp_path / "xdg" / "prefixgate"
    assert f"created home directory {home}" in res.stderr and "$XDG_DATA_HOME" in res.stderr
    again = subprocess.run([*CLI, "tenant", "list"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert "created home" not in again.stderr
    env["PREFIXGATE_HOME"] = str(tmp_path / "elsewhere")
    other = subprocess.run([*CLI, "tenant", "list"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert "(from $PREFIXGATE_HOME)" in other.stderr


def test_a_busy_port_fails_before_the_banner_and_before_any_model_build(tmp_path):
    env = _env(tmp_path)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = subprocess.run([*CLI, "dev-serve", "--port", str(port)], cwd=REPO, env=env, capture_output=True,
                             text=True, timeout=120)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("prefixgate: created home directory")
    assert f"cannot listen on 127.0.0.1:{port}" in lines[1] and "make serve PORT=" in lines[1]
    assert "API key" not in res.stdout and "Traceback" not in res.stderr
    assert not (tmp_path / "xdg" / "prefixgate" / "models").exists()


def test_an_unsupported_checkpoint_is_one_line_and_exit_2(tmp_path):
    ckpt = tmp_path / "gpt2"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    res = subprocess.run([*CLI, "serve", "--home", str(tmp_path / "h"), "--port", str(free_port()), "--model",
                          str(ckpt)], cwd=REPO, env=_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    errors = error_lines(res.stderr)
    assert len(errors) == 1 and "unsupported model_type 'gpt2'" in errors[0], res.stderr
    assert "Traceback" not in res.stderr


def test_help_lists_no_suppressed_placeholder():
    res = subprocess.run([*CLI, "--help"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "==SUPPRESS==" not in res.stdout and "dev-serve" not in res.stdout
    assert "serve" in res.stdout and "tenant" in res.stdout
