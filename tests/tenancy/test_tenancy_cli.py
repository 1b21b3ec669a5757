"""The CLI contract: `prefixgate tenant|key|kek|report`, --json shapes, one-line errors with exit 2."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gateway.cli.main import main
from tenancy.service import TenancyService
from tenancy.types import UsageRecord

ROOT = Path(__file__).resolve().parents[2]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_tenant_create_json_shape_and_the_key_works(capsys, home: Path) -> None:
    code, out, _ = run(capsys, "--home", str(home), "tenant", "create", "acme", "--json", "--share-scope", "user",
                       "--canon", "reorder", "--per-user-var", "user_name")
    assert code == 0
    created = json.loads(out)
    assert set(created) == {"tenant_id", "name", "api_key", "key_id"} and created["name"] == "acme"
    with TenancyService.open(home) as svc:
        ctx = svc.authenticate(created["api_key"])
        assert (ctx.share_scope, ctx.canon_mode, ctx.per_user_vars) == ("user", "reorder", ("user_name",))
    # --home after the sub-command works too, and list shows the tenant
    code, out, _ = run(capsys, "tenant", "list", "--json", "--home", str(home))
    assert code == 0 and [t["name"] for t in json.loads(out)] == ["acme"]


def test_user_errors_are_one_line_on_stderr_with_exit_2(capsys, home: Path) -> None:
    h = ["--home", str(home)]
    assert run(capsys, *h, "tenant", "create", "acme")[0] == 0
    cases = [
        ("tenant", "create", "acme"),  # duplicate
        ("tenant", "create", "bad name"),
        ("tenant", "create", "x", "--share-scope", "everyone"),
        ("tenant", "show", "nobody"),
        ("tenant", "delete", "nobody"),
        ("key", "create", "nobody"),
        ("key", "revoke", "deadbeef"),
        ("tenant", "quota", "set", "acme"),  # nothing to set
        ("report", "--since", "last tuesday"),
        ("report", "--tenant", "nobody"),
    ]
    for argv in cases:
        code, out, err = run(capsys, *h, *argv)
        assert code == 2, argv
        assert err.startswith("prefixgate: error: ") and err.count("\n") == 1, (argv, err)
        assert "Traceback" not in err


def test_a_missing_kek_is_one_line_exit_2_and_leaves_no_new_file(capsys, tmp_path: Path) -> None:
    """Audit findings 4 and 5 through the CLI: the home it creates is 0700; with ``kek.key`` moved
    away, ``tenant list`` says the file is missing (one line, exit 2) and writes no new one."""
    home = tmp_path / "new" / "home"
    old_umask = os.umask(0o022)
    try:
        assert run(capsys, "--home", str(home), "tenant", "create", "acme")[0] == 0
    finally:
        os.umask(old_umask)
    assert home.stat().st_mode & 0o777 == 0o700
    (home / "kek.key").rename(home / "kek.key.orig")
    code, _, err = run(capsys, "--home", str(home), "tenant", "list")
    assert code == 2 and err.count("\n") == 1 and "kek.key is missing" in err, err
    assert not (home / "kek.key").exists() and "created a new" not in err


def test_argparse_rejects_bad_quota_values_with_exit_2(capsys, home: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--home", str(home), "tenant", "quota", "set", "acme", "--rpm", "-3"])
    assert exc.value.code == 2
    assert "positive integer" in capsys.readouterr().err


def test_quota_set_show_and_clear(capsys, home: Path) -> None:
    h = ["--home", str(home)]
    run(capsys, *h, "tenant", "create", "acme")
    code, out, _ = run(capsys, *h, "tenant", "quota", "set", "acme", "--rpm", "60", "--tpm", "10000",
                       "--budget-usd", "2.5", "--period", "day", "--kv-blocks", "128", "--kv-blocks-nvme", "4096",
                       "--json")
    assert code == 0
    q = json.loads(out)["quotas"]
    assert q == {"rpm": 60, "tpm": 10000, "budget_usd": 2.5, "budget_period": "day", "kv_blocks_hbm": 128,
                 "kv_blocks_dram": None, "kv_blocks_nvme": 4096}
    code, out, _ = run(capsys, *h, "tenant", "quota", "set", "acme", "--rpm", "none", "--json")
    q = json.loads(out)["quotas"]
    assert q["rpm"] is None and q["tpm"] == 10000  # untouched limits stay
    code, out, _ = run(capsys, *h, "tenant", "show", "acme")
    assert "tpm=10000" in out and "budget=$2.50/day" in out


def test_tenant_set_changes_settings(capsys, home: Path) -> None:
    h = ["--home", str(home)]
    created = json.loads(run(capsys, *h, "tenant", "create", "acme", "--json")[1])
    code, out, _ = run(capsys, *h, "tenant", "set", "acme", "--share-scope", "group:docs", "--canon", "off",
                       "--priority", "5", "--json")
    t = json.loads(out)
    assert code == 0 and (t["share_scope"], t["canon_mode"], t["priority"]) == ("group:docs", "off", 5)
    with TenancyService.open(home) as svc:
        ctx = svc.authenticate(created["api_key"])
        assert ctx.cipher.owner == "group:docs" and ctx.canon_mode == "off"
    code, _, err = run(capsys, *h, "tenant", "set", "acme")
    assert code == 2 and "nothing to change" in err


def test_key_create_list_revoke(capsys, home: Path) -> None:
    h = ["--home", str(home)]
    first = json.loads(run(capsys, *h, "tenant", "create", "acme", "--json")[1])
    second = json.loads(run(capsys, *h, "key", "create", "acme", "--json")[1])
    keys = json.loads(run(capsys, *h, "key", "list", "acme", "--json")[1])
    assert {k["key_id"] for k in keys} == {first["key_id"], second["key_id"]}
    assert all(first["api_key"] not in json.dumps(k) for k in keys)  # listing never shows a key
    assert run(capsys, *h, "key", "revoke", first["key_id"])[0] == 0
    keys = {k["key_id"]: k for k in json.loads(run(capsys, *h, "key", "list", "--json")[1])}
    assert keys[first["key_id"]]["revoked_at"] is not None and keys[second["key_id"]]["revoked_at"] is None


def _secret(api_key: str) -> str:
    """The part of a ``pg-<id>_<secret>`` key that must never be printed."""
    return api_key.partition("_")[2]


def test_key_revoke_takes_the_whole_key_and_prints_only_its_id(capsys, home: Path) -> None:
    """The audit's repro: `key revoke pg-133e6627_GKwh...` said "no API key with id '133e6627_GKwh...'"
    and so printed most of the secret. The whole key names its key id (the part between pg- and _)."""
    h = ["--home", str(home)]
    first = json.loads(run(capsys, *h, "tenant", "create", "acme", "--json")[1])
    second = json.loads(run(capsys, *h, "key", "create", "acme", "--json")[1])
    code, out, err = run(capsys, *h, "key", "revoke", first["api_key"])
    assert code == 0 and f"revoked {first['key_id']};" in out, err
    assert _secret(first["api_key"]) not in out + err
    code, out, err = run(capsys, *h, "key", "revoke", first["api_key"], "--json")  # twice: still revoked
    assert code == 0 and json.loads(out) == {"revoked": True, "key_id": first["key_id"]}
    keys = {k["key_id"]: k for k in json.loads(run(capsys, *h, "key", "list", "--json")[1])}
    assert keys[first["key_id"]]["revoked_at"] is not None and keys[second["key_id"]]["revoked_at"] is None
    with TenancyService.open(home) as svc:
        assert svc.authenticate(second["api_key"]).key_id == second["key_id"]


@pytest.mark.parametrize("kind", ["forged", "unknown", "truncated", "foreign"])
def test_key_revoke_errors_never_print_a_secret(capsys, home: Path, kind: str) -> None:
    h = ["--home", str(home)]
    created = json.loads(run(capsys, *h, "tenant", "create", "acme", "--json")[1])
    key_id, secret = created["key_id"], _secret(created["api_key"])
    given, said = {
        # the real id with another secret: not this key, so this key is not revoked
        "forged": (f"pg-{key_id}_{secret[::-1]}", f"API key pg-{key_id}"),
        "unknown": (f"pg-0000abcd_{secret}", "no API key with id '0000abcd'"),
        "truncated": (created["api_key"][:20], "not an API key id"),
        "foreign": ("sk-proj-" + secret, "not an API key id"),
    }[kind]
    code, out, err = run(capsys, *h, "key", "revoke", given)
    assert code == 2 and out == "" and err.count("\n") == 1 and said in err, err
    for chunk in (secret[:8], secret[-8:], secret[::-1][:8]):  # what each case gave of a secret
        assert chunk not in err, err
    keys = json.loads(run(capsys, *h, "key", "list", "--json")[1])
    assert keys[0]["revoked_at"] is None


def test_tenant_delete_and_kek_rotate(capsys, home: Path) -> None:
    h = ["--home", str(home)]
    created = json.loads(run(capsys, *h, "tenant", "create", "acme", "--json")[1])
    run(capsys, *h, "tenant", "create", "beta")
    with TenancyService.open(home) as svc:
        blob = svc.authenticate(created["api_key"]).cipher.encrypt(b"kv", b"aad")
    code, out, _ = run(capsys, *h, "kek", "rotate", "--json")
    r = json.loads(out)
    assert code == 0 and r["data_keys"] == 3 and r["old_fingerprint"] != r["new_fingerprint"]  # two tenants + the namespace root key
    with TenancyService.open(home) as svc:
        assert svc.authenticate(created["api_key"]).cipher.decrypt(blob, b"aad") == b"kv"
    code, out, _ = run(capsys, *h, "tenant", "delete", "acme", "--json", "--yes")
    assert code == 0 and json.loads(out)["deleted"] is True
    names = [t["name"] for t in json.loads(run(capsys, *h, "tenant", "list", "--json")[1])]
    assert names == ["beta"]


def test_report_formats(capsys, home: Path, tmp_path: Path) -> None:
    h = ["--home", str(home)]
    with TenancyService.open(home) as svc:
        for name in ("a", "b"):
            ctx = svc.authenticate(svc.create_tenant(name).api_key)
            for i in range(5):
                svc.record_usage(UsageRecord(f"{name}{i}", ctx.tenant_id, ctx.key_id, "gpt-4o-mini", "local",
                                             100, 20 * i, 10, 0.1 * (i + 1), 1.0, "ok", time.time() - 60))
    code, out, _ = run(capsys, *h, "report", "--format", "json")
    rep = json.loads(out)
    assert code == 0 and rep["totals"]["requests"] == 10 and rep["totals"]["cached_tokens"] == 2 * (0 + 20 + 40 + 60 + 80)
    assert json.loads(run(capsys, *h, "report", "--json")[1])["totals"] == rep["totals"]
    code, out, _ = run(capsys, *h, "report", "--tenant", "a", "--format", "csv")
    rows = list(csv.DictReader(io.StringIO(out)))
    assert [(r["tenant"], r["requests"]) for r in rows] == [("a", "5")]
    code, out, _ = run(capsys, *h, "report", "--since", "30s")
    assert code == 0 and "TOTAL" in out and " a " not in out  # rows are 60 s old
    target = tmp_path / "r.html"
    code, out, _ = run(capsys, *h, "report", "--format", "html", "--out", str(target), "--since", "all")
    assert code == 0 and str(target) in out and target.read_text().startswith("<!DOCTYPE html>")


def test_the_prefixgate_entry_point_runs_in_a_fresh_process(home: Path) -> None:
    """The console-script entry (gateway.cli.main:main) end to end, as a user's shell runs it."""
    env = os.environ | {"PREFIXGATE_HOME": str(home), "PYTHONPATH": str(ROOT)}
    code = "import sys; from gateway.cli.main import main; sys.exit(main(sys.argv[1:]))"
    ok = subprocess.run([sys.executable, "-c", code, "tenant", "create", "acme", "--json"],
                        capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["name"] == "acme"
    assert "key-encryption key" in ok.stderr  # first run: the warning that the KEK was created
    dup = subprocess.run([sys.executable, "-c", code, "tenant", "create", "acme"],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert dup.returncode == 2 and dup.stderr == "prefixgate: error: a tenant named 'acme' already exists\n"
