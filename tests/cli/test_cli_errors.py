"""CLI user errors are one line and exit 2, never a traceback; destructive commands ask first."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.cli.main import main
from tenancy.service import TenancyService
from tests.serverutil import REPO, error_lines, free_port

SURROGATE = "\udced\udca0\udc80"  # what Python makes of the shell bytes ed a0 80 (a lone UTF-16 surrogate)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse's own errors
        code = exc.code if isinstance(exc.code, int) else 2
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def home(tmp_path: Path, capsys) -> Path:
    h = tmp_path / "home"
    assert run(capsys, "--home", str(h), "tenant", "create", "acme")[0] == 0
    return h


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _tenants(home: Path) -> list[str]:
    with TenancyService.open(home) as svc:
        return [t.name for t in svc.list_tenants()]


def test_tenant_delete_without_a_terminal_refuses_unless_yes(capsys, home, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("acme\n"))  # piped: nobody to ask
    code, _, err = run(capsys, "--home", str(home), "tenant", "delete", "acme")
    assert code == 2 and "--yes" in err and err.count("\n") == 1
    assert _tenants(home) == ["acme"]
    code, out, _ = run(capsys, "--home", str(home), "tenant", "delete", "acme", "--yes", "--json")
    assert code == 0 and json.loads(out)["deleted"] is True and _tenants(home) == []


def test_tenant_delete_on_a_terminal_asks_for_the_name(capsys, home, monkeypatch):
    monkeypatch.setattr(sys, "stdin", _Terminal("yes\n"))  # not the name: nothing happens
    code, _, err = run(capsys, "--home", str(home), "tenant", "delete", "acme")
    assert code == 2 and "not deleted" in err and _tenants(home) == ["acme"]
    monkeypatch.setattr(sys, "stdin", _Terminal("acme\n"))
    code, out, err = run(capsys, "--home", str(home), "tenant", "delete", "acme")
    assert code == 0 and "crypto" not in out and "deleted tenant acme" in out and _tenants(home) == []
    assert "can never be decrypted" in err  # the warning was shown before the question


def test_tenant_delete_of_an_unknown_tenant_fails_before_asking(capsys, home, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    code, _, err = run(capsys, "--home", str(home), "tenant", "delete", "nobody")
    assert code == 2 and "no tenant named 'nobody'" in err


@pytest.mark.parametrize("argv", [
    ("report", "--since", "0001-01-01T00:00:00+14:00"),
    ("report", "--since", "9999-12-31T23:59:59-14:00"),
    ("report", "--since", "99999999999999999999999999999999d"),
    ("tenant", "quota", "set", "acme", "--tpm", "99999999999999999999999"),
    ("tenant", "quota", "set", "acme", "--rpm", str(2**63)),
    ("tenant", "quota", "set", "acme", "--kv-blocks-nvme", "1" + "0" * 40),
    ("tenant", "quota", "set", "acme", "--budget-usd", "1e400"),
    ("tenant", "set", "acme", "--priority", "99999999999999999999999"),
    ("tenant", "show", SURROGATE),
    ("tenant", "create", "x" + SURROGATE),
    ("key", "create", SURROGATE),
    ("report", "--tenant", SURROGATE),
    ("serve", "--port", "99999999"),
    ("serve", "--port", "-1"),
    ("serve", "--shutdown-grace-s", "-1"),
    ("serve", "--shutdown-grace-s", "soon"),
    ("serve", "--shutdown-grace-s", "inf"),
    # argparse's own errors: one line too, without its usage block (OneLineParser)
    ("tenant", "quota", "set", "acme", "--rpm", "-5"),
    ("tenant", "quota", "set", "acme", "--budget-usd", "nan"),
    ("tenant", "quota", "set", "acme", "--kv-blocks", "0"),
    ("tenant", "create", "x", "--canon", "wrong"),
    ("tenant", "create", "x", "--ttft-target", "0"),
    ("tenant", "create", "x", "--cache-retention", "0"),
    ("tenant", "create", "-x"),
    ("tenant",),
    ("nosuch",),
    # commands that call a running gateway: a bad URL or key fails before any request
    ("cache", "show", "--key", "pg-é"),
    ("cache", "show", "--key", "pg-x", "--url", "http://[::1"),
    ("cache", "show", "--key", "pg-x", "--url", "ftp://example"),
    ("bench", "--url", "http://[::1", "--api-key", "pg-x"),
    ("bench", "--url", "http://127.0.0.1:9", "--api-key", "pg-é"),
])
def test_bad_values_are_one_line_and_exit_2(capsys, home, argv):
    code, _, err = run(capsys, "--home", str(home), *argv)
    assert code == 2, (argv, err)
    assert "Traceback" not in err, err
    lines = error_lines(err)
    assert len(lines) == 1 and lines[0].startswith("prefixgate: error: "), err


@pytest.mark.parametrize(("argv", "message"), [
    ((), "prefixgate: error: the following arguments are required: COMMAND"),
    (("model",), "prefixgate: error: model: the following arguments are required: ACTION"),
    (("tenant",), "prefixgate: error: tenant: the following arguments are required: ACTION"),
    (("cache",), "prefixgate: error: cache: the following arguments are required: ACTION"),
])
def test_a_missing_command_or_action_is_one_line_on_stderr(capsys, home, argv, message):
    """`prefixgate` and `prefixgate model` printed their help on stdout with exit 2 and nothing on
    stderr, while `prefixgate tenant` gave the one-line error: now all do the latter."""
    code, out, err = run(capsys, "--home", str(home), *argv)
    assert (code, out, err) == (2, "", message + "\n")


def test_home_is_taken_by_every_command_that_keeps_state_and_not_by_cache(capsys, home):
    """docs: `--home` on serve, dev-serve, bench, generate, model, tenant, key, kek and report; the
    cache commands talk to a running gateway (--url, --key) and keep nothing under a home."""
    for argv in (("serve",), ("dev-serve",), ("bench",), ("generate",), ("model", "init-tiny"),
                 ("model", "init-smol"), ("tenant", "list"), ("key", "list"), ("kek", "rotate"), ("report",)):
        code, out, _ = run(capsys, *argv, "--home", str(home), "--help")
        assert code == 0 and "--home" in out, argv
    for action in ("warm", "show"):
        code, out, _ = run(capsys, "cache", action, "--help")
        assert code == 0 and "--home" not in out and "--url" in out
    text = (REPO / "docs" / "tenancy.md").read_text() + (REPO / "README.md").read_text()
    assert "`cache warm` and `cache show` take no `--home`" in text


def test_usage_errors_name_the_subcommand_and_help_keeps_its_usage(capsys, home):
    code, _, err = run(capsys, "--home", str(home), "tenant", "quota", "set", "acme", "--rpm", "-5")
    assert code == 2 and err.startswith("prefixgate: error: tenant quota set: argument --rpm:"), err
    code, out, _ = run(capsys, "tenant", "quota", "set", "--help")
    assert code == 0 and out.startswith("usage: prefixgate tenant quota set")


def test_cache_warm_of_a_file_that_is_not_utf8_is_one_line(capsys, home, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_bytes(b"\xff\xfe{}")
    code, _, err = run(capsys, "--home", str(home), "cache", "warm", str(bad), "--key", "pg-x")
    assert code == 2 and error_lines(err) == [f"prefixgate: error: {bad} is not UTF-8 text"], err


def test_the_limit_bound_is_what_sqlite_stores(capsys, home):
    code, out, _ = run(capsys, "--home", str(home), "tenant", "quota", "set", "acme", "--tpm", str(2**63 - 1), "--json")
    assert code == 0 and json.loads(out)["quotas"]["tpm"] == 2**63 - 1


def test_a_server_that_cannot_start_says_why_in_one_line(tmp_path, tiny_model_dir):
    home = tmp_path / "home"
    shutil.copytree(tiny_model_dir, home / "models" / "tiny")
    res = subprocess.run(
        [sys.executable, "-m", "gateway.cli.main", "serve", "--home", str(home), "--port", str(free_port()),
         "--kv-blocks", "99999999999999999999999", "--log-level", "warning"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2
    assert "Traceback" not in res.stderr and "could not start" in res.stderr
    assert len(error_lines(res.stderr)) == 1, res.stderr


@pytest.mark.parametrize("argv", [
    ["-m", "promptlint", "rules"],
    ["-m", "promptlint", "check", "examples/prompts"],
    ["-m", "gateway.cli.main", "--help"],
])
def test_a_reader_that_leaves_early_is_not_a_traceback(argv):
    """`promptlint rules | head`: the pipe's reader is gone before the first write (closed at once here)."""
    proc = subprocess.Popen([sys.executable, *argv], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    proc.wait(timeout=120)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert proc.returncode in (0, 1, 141)


def test_bench_runs_from_the_installed_package_outside_a_checkout(tmp_path):
    """#17: `prefixgate bench` imports gateway.bench, not benchmarks/ through a sys.path insert."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    probe = subprocess.run(
        [sys.executable, "-c", "import sys, gateway.bench.replay as r, gateway.cli.bench_cmd; "
         "print(r.default_results_dir()); print(any(m.startswith('benchmarks') for m in sys.modules))"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.split() == [str(tmp_path / "prefixgate-bench"), "False"]
    res = subprocess.run([sys.executable, "-m", "gateway.cli.main", "--home", str(tmp_path / "h"), "bench",
                          "--url", "http://127.0.0.1:1", "--api-key", "pg-x", "--workloads", "nope"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "unknown workload 'nope'" in res.stderr, res.stderr
    assert "sys.path" not in (REPO / "gateway" / "cli" / "bench_cmd.py").read_text()


@pytest.mark.parametrize(("host", "url"), [("127.0.0.1", "http://127.0.0.1:9"), ("0.0.0.0", "http://127.0.0.1:9"),
                                           ("::", "http://[::1]:9"), ("::1", "http://[::1]:9"),
                                           ("localhost", "http://localhost:9")])
def test_the_banner_probes_its_own_server_on_a_reachable_address(host, url):
    from gateway.cli.serve_cmd import _probe_url
    from gateway.settings import GatewaySettings

    assert _probe_url(GatewaySettings(host=host, port=9)) == url
