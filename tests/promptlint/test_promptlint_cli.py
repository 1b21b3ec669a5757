"""The command line: exit codes, output formats (golden json/sarif), config, suppressions, money."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import jsonschema
import pytest

from promptlint.rules import all_rules
from tests.promptlint.promptlint_paths import EXAMPLES, FIXTURES, GOLDEN, REPO

# What each example is meant to show (its cache-hostile patterns), independent of the goldens.
EXPECTED_EXAMPLE_CODES = {
    "examples/prompts/agent/tools_request.json": ["PC002", "PC004", "PC004"],
    "examples/prompts/agent/tools_request_good.json": [],
    "examples/prompts/code/assistant_anthropic.json": ["PC002", "PC003", "PC004", "PC010", "PC011"],
    "examples/prompts/code/review.prompt": ["PC002"],
    "examples/prompts/rag/answer_v1.j2": ["PC001", "PC006"],
    "examples/prompts/rag/answer_v2.j2": [],
    "examples/prompts/support/billing.txt": ["PC008"],
    "examples/prompts/support/security.txt": ["PC008"],
    "examples/prompts/support/storage.txt": ["PC008"],
    "examples/prompts/support/system_personalized.txt": ["PC001", "PC002", "PC003", "PC003", "PC007", "PC008"],
    "examples/prompts/support_system_good.txt": [],
}
UPDATE = os.environ.get("PROMPTLINT_UPDATE_GOLDEN") == "1"


def _golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if UPDATE:
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert text == path.read_text(), f"{name} differs; rerun with PROMPTLINT_UPDATE_GOLDEN=1 and review the diff"


def test_examples_show_their_patterns(run_cli):
    res = run_cli("check", "examples/prompts", "--format", "json")
    assert res.code == 1
    data = json.loads(res.out)
    got = {f["path"]: [] for f in data["files"]}
    for f in data["findings"]:
        got[f["path"]].append(f["code"])
    assert {k: sorted(v) for k, v in got.items()} == EXPECTED_EXAMPLE_CODES
    scores = {f["path"]: f["score"] for f in data["files"]}
    # The rewritten versions of the same prompts score higher than the cache-hostile ones.
    assert scores["examples/prompts/support_system_good.txt"] > 90 > scores["examples/prompts/support/system_personalized.txt"]
    assert scores["examples/prompts/agent/tools_request_good.json"] > scores["examples/prompts/agent/tools_request.json"]
    assert scores["examples/prompts/rag/answer_v1.j2"] < 5


def test_golden_json(run_cli):
    res = run_cli("check", "examples/prompts", "--format", "json")
    _golden("examples.json", res.out)


def test_golden_sarif_validates_and_declares_every_rule(run_cli):
    res = run_cli("check", "examples/prompts", "--format", "sarif")
    assert res.code == 1
    _golden("examples.sarif", res.out)
    sarif = json.loads(res.out)
    schema = json.loads((GOLDEN.parent / "sarif-2.1.0-required.schema.json").read_text())
    jsonschema.validate(sarif, schema, format_checker=jsonschema.FormatChecker())
    run = sarif["runs"][0]
    declared = [r["id"] for r in run["tool"]["driver"]["rules"]]
    assert declared == sorted(all_rules())
    for result in run["results"]:
        assert declared[result["ruleIndex"]] == result["ruleId"]
        assert (REPO / result["locations"][0]["physicalLocation"]["artifactLocation"]["uri"]).is_file()


def test_sarif_schema_rejects_broken_logs():
    schema = json.loads((GOLDEN.parent / "sarif-2.1.0-required.schema.json").read_text())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"version": "2.1.0", "runs": [{"tool": {"driver": {}}}]}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"version": "2.1.0", "runs": [{"tool": {"driver": {"name": "x"}}, "results": [{}]}]}, schema)


def test_github_annotations(run_cli):
    res = run_cli("check", str(FIXTURES / "PC004" / "bad.json"), "--format", "github")
    assert res.code == 1
    lines = res.out.splitlines()
    assert len(lines) == 2
    for line in lines:
        assert line.startswith("::warning file=tests/promptlint/fixtures/PC004/bad.json,line=4,col=1,title=PC004 ")
        assert "::tools are" in line or "::tool schemas" in line


def test_junit_is_xml_with_a_case_per_file(run_cli):
    res = run_cli("check", str(FIXTURES / "PC006"), "--format", "junit")
    root = ET.fromstring(res.out)
    cases = root.findall("./testsuite/testcase")
    assert sorted(c.get("name") for c in cases) == [
        "tests/promptlint/fixtures/PC006/bad.txt", "tests/promptlint/fixtures/PC006/good.txt"]
    failed = [c.get("name") for c in cases if c.find("failure") is not None]
    assert failed == ["tests/promptlint/fixtures/PC006/bad.txt"]


def test_junit_is_well_formed_with_control_characters_and_one_case_per_sdk_call(run_cli, tmp_path):
    (tmp_path / "a.txt").write_text("Hi {{ user\x0bname }}.\n" + "Static rules for everyone. " * 20)
    root = ET.fromstring(run_cli("check", "a.txt", "--format", "junit", cwd=tmp_path).out)
    assert "\\x0b" in root.find("./testsuite/testcase/failure").text
    app = tmp_path / "app.py"
    app.write_text((FIXTURES / "source" / "app.py").read_text())
    res = run_cli("check", "app.py", "--format", "junit", cwd=tmp_path)
    cases = ET.fromstring(res.out).findall("./testsuite/testcase")
    assert len(cases) > 1 and len({c.get("name") for c in cases}) == len(cases)
    listed = [line for c in cases if c.find("failure") is not None for line in c.find("failure").text.split("\n")]
    total = json.loads(run_cli("check", "app.py", "--format", "json", cwd=tmp_path).out)["findings"]
    assert sorted(listed) == sorted(f"{f['path']}:{f['line']}:{f['column']}: {f['code']} {f['name']}: {f['message']}"
                                    for f in total)


def test_sarif_uri_is_percent_encoded(run_cli, tmp_path):
    (tmp_path / "my prompts").mkdir()
    (tmp_path / "my prompts" / "a#1.txt").write_text("Today is {current_date}.\n" + "Static rules. " * 30)
    sarif = json.loads(run_cli("check", "my prompts", "--format", "sarif", cwd=tmp_path).out)
    uris = {loc["physicalLocation"]["artifactLocation"]["uri"]
            for r in sarif["runs"][0]["results"] for loc in r["locations"]}
    assert uris == {"my%20prompts/a%231.txt"}


def test_text_report_says_the_score_failed(run_cli, tmp_path):
    (tmp_path / "a.txt").write_text(("Static rules. " * 30).strip() + "\nQuestion: {question}\n")
    res = run_cli("check", "a.txt", "--fail-under", "100", cwd=tmp_path)
    assert res.code == 1 and "All checks passed" not in res.out and "score check failed" in res.out
    assert "All checks passed!" in run_cli("check", "a.txt", cwd=tmp_path).out


def test_exit_codes(run_cli, tmp_path):
    good = FIXTURES / "PC001" / "good.txt"
    assert run_cli("check", str(good)).code == 0
    assert run_cli("check", str(FIXTURES / "PC001" / "bad.txt")).code == 1
    # clean but the score is below the bar
    res = run_cli("check", str(good), "--fail-under", "99.9")
    assert res.code == 1 and "below --fail-under" in res.out
    assert run_cli("check", str(good), "--fail-under", "10").code == 0
    res = run_cli("check", str(tmp_path / "missing"))
    assert res.code == 2 and res.err.startswith("promptlint: error: no such file") and res.err.count("\n") == 1
    assert run_cli("check", str(good), "--format", "xml").code == 2
    assert run_cli("check", str(good), "--fail-under", "150").code == 2
    assert run_cli().code == 2
    (tmp_path / "empty").mkdir()
    res = run_cli("check", str(tmp_path / "empty"))
    assert res.code == 0 and "no prompt files found" in res.err


@pytest.mark.parametrize("argv", [
    (),
    ("bogus",),
    ("check",),
    ("check", "prompts", "--format", "xml"),
    ("check", "prompts", "--volume", "lots"),
    ("check", "prompts", "--volume", "-inf"),  # argparse reads it as a flag: "expected one argument"
    ("check", "prompts", "--no-such-flag"),
    ("rule",),
    ("rules", "--format", "html"),
])
def test_usage_errors_are_one_line_on_stderr(run_cli, argv):
    """docs/promptlint.md: "2 usage or configuration error (one line on stderr)"; argparse's own
    errors printed its usage block first."""
    res = run_cli(*argv)
    assert res.code == 2 and res.out == "", (argv, res.out)
    assert res.err.count("\n") == 1 and res.err.startswith("promptlint: error: "), (argv, res.err)
    assert "usage:" not in res.err


def test_usage_error_of_the_real_command_names_the_subcommand_and_help_still_prints():
    cmd = [sys.executable, "-m", "promptlint"]
    res = subprocess.run([*cmd, "check", "--format", "xml", "prompts"], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.startswith("promptlint: error: check: argument --format: invalid choice: 'xml'"), res.stderr
    assert res.stderr.count("\n") == 1
    for argv in (["--help"], ["check", "--help"]):
        res = subprocess.run([*cmd, *argv], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert res.returncode == 0 and res.stdout.startswith("usage: promptlint") and res.stderr == ""


def test_text_output_lists_findings_and_scores(run_cli):
    res = run_cli("check", str(FIXTURES / "PC002"))
    assert res.code == 1
    assert "tests/promptlint/fixtures/PC002/bad.md:1:15: PC002 volatile-value-in-prefix:" in res.out
    assert "Found 1 finding(s)." in res.out and "Score " in res.out


def _project(tmp_path, config: str) -> None:
    (tmp_path / "pyproject.toml").write_text(config)
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    for name in ("PC001/bad.txt", "PC002/bad.md"):
        (prompts / name.replace("/", "_")).write_text((FIXTURES / name).read_text())


def _codes(res):
    return sorted(f["code"] for f in json.loads(res.out)["findings"])


def test_config_select_ignore_and_per_file_ignores(run_cli, tmp_path):
    _project(tmp_path, '[tool.promptlint]\nignore = ["PC002"]\n')
    assert _codes(run_cli("check", "prompts", "--format", "json", cwd=tmp_path)) == ["PC001"]
    (tmp_path / "pyproject.toml").write_text('[tool.promptlint]\nselect = ["PC002"]\n')
    assert _codes(run_cli("check", "prompts", "--format", "json", cwd=tmp_path)) == ["PC002"]
    (tmp_path / "pyproject.toml").write_text(
        '[tool.promptlint]\n[tool.promptlint.per-file-ignores]\n"prompts/PC001_*" = ["PC001"]\n')
    assert _codes(run_cli("check", "prompts", "--format", "json", cwd=tmp_path)) == ["PC002"]
    (tmp_path / "pyproject.toml").write_text('[tool.promptlint]\nexclude = ["prompts/PC002_*"]\n')
    assert _codes(run_cli("check", "prompts", "--format", "json", cwd=tmp_path)) == ["PC001"]
    # a named file is linted even when excluded (like ruff without --force-exclude)
    assert _codes(run_cli("check", "prompts/PC002_bad.md", "--format", "json", cwd=tmp_path)) == ["PC002"]
    (tmp_path / "pyproject.toml").write_text(
        '[tool.promptlint]\n[tool.promptlint.per-file-ignores]\n"prompts/PC001_*" = ["PC001"]\n')
    # config is found from a subdirectory too
    assert _codes(run_cli("check", ".", "--format", "json", cwd=tmp_path / "prompts")) == ["PC002"]
    # paths with ".." are normalised before matching
    assert _codes(run_cli("check", "../prompts", "--format", "json", cwd=tmp_path / "prompts")) == ["PC002"]
    assert _codes(run_cli("check", "prompts/../prompts", "--format", "json", cwd=tmp_path)) == ["PC002"]
    (tmp_path / "pyproject.toml").write_text('[tool.promptlint]\nexclude = ["prompts/PC002_*"]\n')
    assert _codes(run_cli("check", "../prompts", "--format", "json", cwd=tmp_path / "prompts")) == ["PC001"]


def test_config_fail_under_and_model(run_cli, tmp_path):
    _project(tmp_path, '[tool.promptlint]\nselect = ["PC005"]\nfail-under = 99\nmodel = "gpt-4"\n')
    res = run_cli("check", "prompts", "--format", "json", cwd=tmp_path)
    data = json.loads(res.out)
    assert res.code == 1 and data["findings"] == [] and data["score"] < 99
    assert data["model"] == "gpt-4" and data["encoding"] == "cl100k_base"
    assert run_cli("check", "prompts", "--fail-under", "0", cwd=tmp_path).code == 0  # the flag wins


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ('[tool.promptlint]\nselekt = ["PC001"]\n', "unknown [tool.promptlint] key 'selekt'"),
        ('[tool.promptlint]\nignore = ["PC999"]\n', "unknown rule code 'PC999'"),
        ('[tool.promptlint]\nfail-under = "high"\n', "fail-under must be a number"),
        ("[tool.promptlint\n", "invalid TOML"),
    ],
)
def test_bad_config_is_a_usage_error(run_cli, tmp_path, config, message):
    _project(tmp_path, config)
    res = run_cli("check", "prompts", cwd=tmp_path)
    assert res.code == 2 and message in res.err and res.err.count("\n") == 1


def test_inline_and_file_noqa(run_cli, tmp_path):
    body = (FIXTURES / "PC003" / "bad.j2").read_text().split("\n")
    (tmp_path / "a.j2").write_text("\n".join([body[0] + " {# promptlint: noqa[PC003] #}", *body[1:]]))
    (tmp_path / "b.j2").write_text("\n".join([body[0] + " {# promptlint: noqa[PC001] #}", *body[1:]]))
    (tmp_path / "c.j2").write_text("\n".join(["{# promptlint: noqa-file[PC003] #}", *body]))
    (tmp_path / "d.j2").write_text("\n".join([body[0] + " {# promptlint: noqa #}", *body[1:]]))
    data = json.loads(run_cli("check", str(tmp_path), "--format", "json").out)
    by_file = {}
    for f in data["findings"]:
        by_file.setdefault(f["path"].rsplit("/", 1)[-1], []).append(f["code"])
    assert by_file == {"b.j2": ["PC003", "PC003"]}


def _bundled_prices():
    import importlib.util

    spec = importlib.util.find_spec("litellm")
    root = next(iter(spec.submodule_search_locations))
    return json.loads((REPO.__class__(root) / "model_prices_and_context_window_backup.json").read_text())


def test_volume_estimates_money_from_litellm_prices(run_cli):
    res = run_cli("check", str(FIXTURES / "PC007" / "good"), "--format", "json", "--volume", "10000")
    data = json.loads(res.out)
    s = data["savings"]
    info = _bundled_prices()["gpt-4o"]
    assert s["input_price_per_token"] == info["input_cost_per_token"]
    assert s["cache_read_price_per_token"] == info["cache_read_input_token_cost"]
    prefix = data["files"][0]["prefix_tokens"]
    cached = 1024 + (prefix - 1024) // 128 * 128  # OpenAI: 1,024 then 128-token steps
    expected = 10000 * 30 * cached * (info["input_cost_per_token"] - info["cache_read_input_token_cost"])
    assert s["saved_per_month_usd"] == pytest.approx(expected, abs=0.01)
    assert s["left_per_month_usd"] == 0
    # The cache-hostile twin saves nothing and leaves money on the table.
    bad = json.loads(run_cli("check", str(FIXTURES / "PC007" / "bad"), "--format", "json", "--volume", "10000").out)
    assert bad["savings"]["saved_per_month_usd"] == 0 and bad["savings"]["left_per_month_usd"] > 0
    res = run_cli("check", str(FIXTURES / "PC001"), "--volume", "5", "--model", "no-such-model")
    assert res.code == 2 and "no price for model 'no-such-model'" in res.err


@pytest.mark.parametrize("volume", ["nan", "NaN", "inf", "-inf", "1e400", "-1", "1e307"])
def test_volume_must_be_a_finite_non_negative_number(run_cli, volume):
    """``--volume nan`` (or 1e400, which float() reads as inf) used to print NaN/Infinity in JSON,
    which no JSON parser accepts, and ``$nan/month`` in text; 1e307 overflows the monthly sum."""
    for fmt in ("json", "text"):
        res = run_cli("check", str(FIXTURES / "PC007" / "good"), "--format", fmt, f"--volume={volume}")
        assert res.code == 2 and res.out == "", (volume, res.out)
        assert res.err.count("\n") == 1 and res.err.startswith("promptlint: error: --volume"), res.err


def test_json_writers_never_emit_nan_or_infinity(run_cli):
    """A last guard behind the flag checks: a non-finite number is an error, never invalid JSON."""
    from promptlint.config import Config
    from promptlint.formats import render
    from promptlint.linter import lint
    from promptlint.pricing import Savings

    report = lint([FIXTURES / "PC007" / "good"], Config())
    for bad in (float("nan"), float("inf")):
        savings = Savings("gpt-4o", bad, 2.5e-06, 1.25e-06, bad, 0.0, {})
        with pytest.raises(ValueError, match="JSON"):
            render(report, "json", savings)


def test_module_entry_point_sets_up_tiktoken_itself():
    env = {k: v for k, v in os.environ.items() if k != "TIKTOKEN_CACHE_DIR"}
    proc = subprocess.run(
        [sys.executable, "-m", "promptlint", "check", str(EXAMPLES / "support_system_good.txt"), "--format", "json"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["files"][0]["total_tokens"] > 700


@pytest.mark.slow
def test_bundled_price_file_is_what_litellm_loads():
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    import litellm  # 5-15 s: why promptlint reads the bundled file instead

    from promptlint.pricing import cost_map

    for model in ("gpt-4o", "gpt-4o-mini", "claude-sonnet-4-5"):
        assert cost_map()[model]["input_cost_per_token"] == litellm.model_cost[model]["input_cost_per_token"]
