"""One bad and one good fixture per rule; the rule registry and its docs."""

from __future__ import annotations

import json

import pytest

from promptlint.rules import all_rules
from tests.promptlint.promptlint_paths import FIXTURES

CODES = sorted(all_rules())


def _findings(run_cli, path):
    res = run_cli("check", str(path), "--format", "json")
    assert res.code in (0, 1), res.err
    return json.loads(res.out)["findings"]


def _bad_and_good(code):
    d = FIXTURES / code
    bad = sorted(p for p in d.iterdir() if p.name.startswith("bad"))
    good = sorted(p for p in d.iterdir() if p.name.startswith("good"))
    return bad, good


def test_every_rule_has_fixtures():
    for code in CODES:
        bad, good = _bad_and_good(code)
        assert bad and good, f"{code} needs bad* and good* fixtures under {FIXTURES / code}"


@pytest.mark.parametrize("code", CODES)
def test_bad_fixture_triggers_the_rule(run_cli, code):
    bad, _ = _bad_and_good(code)
    for path in bad:
        found = _findings(run_cli, path)
        assert code in {f["code"] for f in found}, f"{path.name}: {found}"


@pytest.mark.parametrize("code", CODES)
def test_good_fixture_is_clean(run_cli, code):
    _, good = _bad_and_good(code)
    for path in good:
        found = _findings(run_cli, path)
        assert found == [], f"{path.name}: {found}"


# Exact places and counts for a few rules, so a rule that fires everywhere cannot pass.
@pytest.mark.parametrize(
    ("fixture", "expected"),
    [
        ("PC001/bad.txt", [("PC001", 1)]),
        ("PC002/bad.md", [("PC002", 1)]),
        ("PC003/bad.j2", [("PC003", 1), ("PC003", 1)]),
        ("PC004/bad.json", [("PC004", 4), ("PC004", 4)]),
        ("PC006/bad.txt", [("PC001", 2), ("PC006", 3)]),
        ("PC007/bad", [("PC001", 2), ("PC007", 2)]),
        ("PC009/bad.txt", [("PC009", 1), ("PC009", 1)]),
        ("PC010/bad.json", [("PC010", 4)]),
        ("PC011/bad.yaml", [("PC011", 7)]),
        ("PC000/bad_yaml.yaml", [("PC000", 4)]),
        ("PC000/bad_jinja.j2", [("PC000", 2)]),
    ],
)
def test_findings_point_at_the_right_line(run_cli, fixture, expected):
    found = _findings(run_cli, FIXTURES / fixture)
    assert sorted((f["code"], f["line"]) for f in found) == sorted(expected)


def test_family_rule_needs_siblings(run_cli, tmp_path):
    # One file alone has no family to share with.
    src = FIXTURES / "PC008" / "bad" / "invoices.txt"
    (tmp_path / "invoices.txt").write_text(src.read_text())
    assert _findings(run_cli, tmp_path) == []


def test_rule_docs_have_the_four_sections(run_cli):
    for code, rule in all_rules().items():
        for section in ("What:", "Why:", "Example:", "Fix:"):
            assert section in rule.doc, f"{code} docs lack {section}"
        assert rule.doc.startswith(f"{code} {rule.name}:")
        res = run_cli("rule", code)
        assert res.code == 0 and res.out.startswith(f"{code} {rule.name}:") and "Fix:" in res.out


def test_rule_by_name_and_unknown_rule(run_cli):
    assert run_cli("rule", "unstable-tool-order").out.startswith("PC004")
    res = run_cli("rule", "PC999")
    assert res.code == 2 and res.err.startswith("promptlint: error: unknown rule") and res.err.count("\n") == 1


def test_rules_lists_every_code(run_cli):
    res = run_cli("rules")
    assert res.code == 0
    assert [line.split()[0] for line in res.out.splitlines()] == CODES
