"""Severity like ruff's default set, PC007's model, the --fix hint, and inputs that must not hang or escape.

#15.6: info-level findings (PC009 whitespace the gateway's `safe` canon neutralizes) fail only when
selected; PC007 names the model a file declares; an unmarked template line hints `promptlint: movable`.
#16.14/#16.15: --from-usage on binary or 100k-deep JSON, a FIFO in a walked directory, and --fix
through a symlink that leaves the tree.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.promptlint.promptlint_paths import FIXTURES, REPO

POLICY = " ".join(f"Policy {i}: refunds over {i} dollars need a ticket number and a manager's approval."
                  for i in range(160))


def _request(tmp_path: Path, name: str, body: dict) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(body, indent=2), encoding="utf-8")
    return path


def _good_request_with_trailing_newline(tmp_path: Path) -> Path:
    # Cache-friendly in every way but one: the system message ends with a newline (PC009, info).
    return _request(tmp_path, "support.json", {"model": "gpt-4o-mini", "messages": [
        {"role": "system", "content": "You are Acme's support assistant. " + POLICY + "\n"},
        {"role": "user", "content": "Where is my refund?"}]})


def test_an_info_finding_is_reported_but_does_not_fail_unless_selected(run_cli, tmp_path):
    path = _good_request_with_trailing_newline(tmp_path)
    res = run_cli("check", str(path), "--format", "json")
    found = json.loads(res.out)["findings"]
    assert [(f["code"], f["severity"]) for f in found] == [("PC009", "info")]
    assert res.code == 0
    text = run_cli("check", str(path))
    assert text.code == 0 and "1 info-level, which fail the run only when selected" in text.out
    assert run_cli("check", str(path), "--select", "PC009").code == 1
    assert run_cli("check", str(path), "--select", "PC").code == 1
    assert run_cli("check", str(path), "--ignore", "PC009", "--format", "json").code == 0
    assert run_cli("check", str(path), "--select", "PC999").code == 2


def test_config_select_makes_an_info_rule_fail(run_cli, tmp_path):
    path = _good_request_with_trailing_newline(tmp_path)
    (tmp_path / "pyproject.toml").write_text('[tool.promptlint]\nselect = ["PC009", "PC001"]\n')
    assert run_cli("check", str(path), cwd=tmp_path).code == 1
    (tmp_path / "pyproject.toml").write_text('[tool.promptlint]\nselect = ["PC001"]\n')
    assert run_cli("check", str(path), cwd=tmp_path).code == 0


def test_a_warning_still_fails_by_default(run_cli):
    assert run_cli("check", str(FIXTURES / "PC001" / "bad.txt")).code == 1


def test_rules_say_which_fail_by_default(run_cli):
    out = run_cli("rules", "--format", "markdown").out
    assert "| PC009 | `unstable-whitespace` | info | when selected |" in out
    assert "| PC002 | `volatile-value-in-prefix` | warning | yes |" in out
    assert "Fails the run by default: only when selected" in run_cli("rule", "PC009").out


def _short_prefix_request(tmp_path: Path, model: str) -> Path:
    # ~20 static tokens, a timestamp, then ~3,000 static tokens: PC007 for any 1,024-token minimum.
    return _request(tmp_path, f"{model.replace('/', '_')}.json", {"model": model, "messages": [
        {"role": "system", "content": "You are Acme's support assistant.\nNow: 2026-11-29 10:00:00 UTC\n" + POLICY},
        {"role": "user", "content": "Where is my refund?"}]})


def test_pc007_names_the_model_the_file_declares(run_cli, tmp_path):
    path = _short_prefix_request(tmp_path, "gpt-4o-mini")
    found = json.loads(run_cli("check", str(path), "--format", "json").out)["findings"]
    pc007 = [f["message"] for f in found if f["code"] == "PC007"]
    assert len(pc007) == 1 and "minimum for gpt-4o-mini," in pc007[0]
    claude = _short_prefix_request(tmp_path, "claude-3-5-haiku-20241022")
    found = json.loads(run_cli("check", str(claude), "--format", "json").out)["findings"]
    msg = next(f["message"] for f in found if f["code"] == "PC007")
    assert "anthropic's 2048-token minimum for claude-3-5-haiku-20241022" in msg
    # --model on the command line overrides what the file declares
    found = json.loads(run_cli("check", str(path), "--model", "gpt-4.1", "--format", "json").out)["findings"]
    assert "minimum for gpt-4.1," in next(f["message"] for f in found if f["code"] == "PC007")


def test_an_unmarked_template_line_hints_the_movable_marker(run_cli, tmp_path):
    found = json.loads(run_cli("check", str(FIXTURES / "PC002" / "bad.md"), "--format", "json").out)["findings"]
    pc002 = next(f for f in found if f["code"] == "PC002")
    assert not pc002["fixable"] and "promptlint: movable" in pc002["message"] and "--fix moves it" in pc002["message"]
    marked = tmp_path / "marked.txt"
    lines = (FIXTURES / "PC001" / "bad.txt").read_text().split("\n")
    lines[0] += "  <!-- promptlint: movable -->"
    marked.write_text("\n".join(lines))
    found = json.loads(run_cli("check", str(marked), "--format", "json").out)["findings"]
    pc001 = next(f for f in found if f["code"] == "PC001")
    assert pc001["fixable"] and "promptlint: movable" not in pc001["message"]


def test_pc013_points_at_each_unstable_order(run_cli):
    found = json.loads(run_cli("check", str(FIXTURES / "PC013" / "bad.py"), "--format", "json").out)["findings"]
    assert [(f["code"], f["line"]) for f in found] == [("PC013", 16), ("PC013", 19), ("PC013", 21)]
    msgs = " ".join(f["message"] for f in found)
    assert "random.shuffle" in msgs and "iterating names" in msgs and "sort_keys=True" in msgs


# -- inputs that must not hang, escape or crash ------------------------------------------------------


def _from_usage(run_cli, tmp_path: Path, data: bytes) -> tuple[int, str]:
    usage = tmp_path / "usage.json"
    usage.write_bytes(data)
    res = run_cli("check", str(FIXTURES / "PC001" / "good.txt"), "--from-usage", str(usage))
    return res.code, res.err


@pytest.mark.parametrize(("data", "says"), [
    (bytes(range(256)) * 4, "not UTF-8"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"misses": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    (b"\n".join([b'{"rule": "PC002"}', b"[" * 100_000]), "nested too deeply"),
])
def test_from_usage_on_binary_or_deep_json_is_one_line(run_cli, tmp_path, data, says):
    code, err = _from_usage(run_cli, tmp_path, data)
    assert code == 2 and says in err and err.strip().count("\n") == 0, err


def test_from_usage_with_odd_field_types_does_not_crash(run_cli, tmp_path):
    rec = {"rule": "PC001", "template": "good", "tokens_lost": "lots", "usd_lost": [1], "context": 5,
           "message": {"x": 1}}
    recs = [rec, {**rec, "tokens_lost": 1e400}, {**rec, "tokens_lost": 10**400, "usd_lost": float("nan")}]
    code, err = _from_usage(run_cli, tmp_path, json.dumps({"misses": recs}).encode())
    assert code in (0, 1) and "Traceback" not in err


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_in_a_walked_directory_is_skipped_and_a_named_one_is_pc000(tmp_path):
    tree = tmp_path / "prompts"
    tree.mkdir()
    (tree / "good.txt").write_text((FIXTURES / "PC001" / "good.txt").read_text())
    os.mkfifo(tree / "stuck.txt")
    os.mkfifo(tmp_path / "usage.json")
    cmd = [sys.executable, "-m", "promptlint"]
    # A reader of a FIFO with no writer blocks forever: the timeout is the test.
    walked = subprocess.run([*cmd, "check", str(tree), "--format", "json"], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert walked.returncode == 0, walked.stderr
    assert [f["path"].rsplit("/", 1)[-1] for f in json.loads(walked.stdout)["files"]] == ["good.txt"]
    named = subprocess.run([*cmd, "check", str(tree / "stuck.txt"), "--format", "json"], cwd=REPO,
                           capture_output=True, text=True, timeout=120)
    found = json.loads(named.stdout)["findings"]
    assert named.returncode == 1 and [f["code"] for f in found] == ["PC000"] and "not a regular file" in found[0]["message"]
    usage = subprocess.run([*cmd, "check", str(tree / "good.txt"), "--from-usage", str(tmp_path / "usage.json")],
                           cwd=REPO, capture_output=True, text=True, timeout=120)
    assert usage.returncode == 2 and "not a regular file" in usage.stderr


def test_fix_never_writes_through_a_symlink_out_of_the_tree(run_cli, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "target.json"
    victim.write_text((FIXTURES / "PC004" / "bad.json").read_text())
    before = victim.read_bytes()
    tree = tmp_path / "repo" / "prompts"
    tree.mkdir(parents=True)
    (tree / "link.json").symlink_to(victim)
    own = tree / "own.json"
    own.write_text((FIXTURES / "PC004" / "bad.json").read_text())
    res = run_cli("check", str(tree), "--fix", cwd=tmp_path)
    assert victim.read_bytes() == before
    assert "symlink" in res.err and "not fixed" in res.err
    assert own.read_text() != (FIXTURES / "PC004" / "bad.json").read_text()  # a regular file in the tree is fixed
    assert "fixed " in res.err and (tree / "link.json").is_symlink()
