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


_POLICY = ("You are the support agent of Acme. Follow the refund policy, escalate outages to on-call, never "
           "share internal notes, keep answers short and polite.\n") * 3


@pytest.mark.parametrize(
    ("name", "first_line"),
    [
        # str.format / LangChain: ``{{`` and ``}}`` are literal braces
        ("langchain.txt", '---\nsyntax: format\n---\nReply with JSON like {{"answer": "...", "sources": []}}.'),
        # Jinja raw blocks are literal text
        ("raw.j2", "{% raw %}Users write templates like {{ name }} and {{ today }}.{% endraw %}"),
        # a mustache comment renders nothing
        ("mustache.txt", "{{! internal note: keep this prompt in sync with v2 }}"),
        # in a Jinja file, $HOME and {answer: string} are text
        ("shell.j2", "Explain that $HOME and ${PATH} are set by the shell."),
        ("shape.j2", "Return an object like {answer: string}."),
    ],
)
def test_literal_braces_and_dollars_are_not_placeholders(run_cli, tmp_path, name, first_line):
    question = "Question: {question}" if name.startswith("langchain") else "Question: {{ question }}"
    path = tmp_path / name
    path.write_text(f"{first_line}\n{_POLICY}{question}\n")
    found = [f for f in _findings(run_cli, path) if f["severity"] != "info"]
    assert found == []


def _fewshot_request(after_user: str) -> dict:
    return {"model": "gpt-4o", "messages": [
        {"role": "system", "content": _POLICY},
        {"role": "user", "content": "How do I see hidden files?"},
        {"role": "system", "content": after_user * 10},
    ]}


def test_a_stray_dollar_var_does_not_turn_a_sample_request_into_a_template(run_cli, tmp_path):
    """The user's real question is the input whatever another message holds: PC006 still fires."""
    example = "Example 1:\nQ: how do I list files?\nA: use ls -la in the ${HOME}.\n"
    path = tmp_path / "fewshot.json"
    path.write_text(json.dumps(_fewshot_request(example), indent=2))
    found = _findings(run_cli, path)
    pc006 = [f for f in found if f["code"] == "PC006"]
    assert len(pc006) == 1 and "How do I see hidden files?" in pc006[0]["message"]


def test_pc010_breakpoint_after_retrieved_documents(run_cli, tmp_path):
    body = {"model": "claude-sonnet-4", "system": [
        {"type": "text", "text": "Context documents: {{documents}}"},
        {"type": "text", "text": _POLICY, "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": "{{question}}"}]}
    path = tmp_path / "docs.json"
    path.write_text(json.dumps(body, indent=2))
    pc010 = [f for f in _findings(run_cli, path) if f["code"] == "PC010"]
    assert len(pc010) == 1 and "{{documents}}" in pc010[0]["message"] and pc010[0]["line"] == 10


def test_pc010_breakpoint_on_the_last_user_message_input_is_fine(run_cli, tmp_path):
    body = {"model": "claude-sonnet-4", "system": _POLICY, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "{{question}}", "cache_control": {"type": "ephemeral"}}]}]}
    path = tmp_path / "turn.json"
    path.write_text(json.dumps(body, indent=2))
    assert "PC010" not in {f["code"] for f in _findings(run_cli, path)}
