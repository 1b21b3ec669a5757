"""--fix: only safe rewrites, meaning preserved, idempotent, and it says what it changed."""

from __future__ import annotations

import json
import shutil

import yaml

from tests.promptlint.promptlint_paths import EXAMPLES, FIXTURES


def _copy(src, dst_dir):
    dst = dst_dir / src.name
    shutil.copy(src, dst)
    return dst


def _same_meaning(before: dict, after: dict) -> None:
    """Only order and edge whitespace may change: tools as a set, every object equal when parsed."""
    assert set(before) == set(after)
    tools_before = {t["function"]["name"]: t for t in before.get("tools", [])}
    tools_after = {t["function"]["name"]: t for t in after.get("tools", [])}
    assert tools_before == tools_after  # dict == ignores key order
    assert [t["function"]["name"] for t in after.get("tools", [])] == sorted(tools_before)
    for m_before, m_after in zip(before["messages"], after["messages"], strict=True):
        assert m_before["role"] == m_after["role"]
        assert m_before["content"].replace("\r\n", "\n").strip() == m_after["content"]
    rest = {k: v for k, v in before.items() if k not in ("tools", "messages")}
    assert rest == {k: v for k, v in after.items() if k not in ("tools", "messages")}


def test_fix_request_sorts_tools_and_keys_and_is_idempotent(run_cli, tmp_path):
    path = _copy(EXAMPLES / "agent" / "tools_request.json", tmp_path)
    before = json.loads(path.read_text())
    res = run_cli("check", str(path), "--fix", "--format", "json")
    assert "tools-sorted" in res.err and "tool-schemas-canonical" in res.err
    after_text = path.read_text()
    after = json.loads(after_text)
    _same_meaning(before, after)
    # What is left is the timestamp, which --fix may not move in a request file.
    assert [f["code"] for f in json.loads(res.out)["findings"]] == ["PC002"]
    assert res.code == 1
    again = run_cli("check", str(path), "--fix")
    assert "nothing to fix" in again.err
    assert path.read_text() == after_text


def test_fix_request_whitespace(run_cli, tmp_path):
    path = _copy(FIXTURES / "PC009" / "bad_request.json", tmp_path)
    before = json.loads(path.read_text())
    res = run_cli("check", str(path), "--fix")
    assert res.code == 0 and "whitespace-normalized" in res.err
    _same_meaning(before, json.loads(path.read_text()))


def test_fix_yaml_request_without_comments_and_refuses_with_comments(run_cli, tmp_path):
    body = json.loads((FIXTURES / "PC004" / "bad.json").read_text())
    plain = tmp_path / "plain.yaml"
    plain.write_text(yaml.safe_dump(body, sort_keys=False))
    res = run_cli("check", str(plain), "--fix")
    assert res.code == 0, res.out
    _same_meaning(body, yaml.safe_load(plain.read_text()))
    commented = tmp_path / "commented.yaml"
    text = "# tools for the calendar agent\n" + yaml.safe_dump(body, sort_keys=False)
    commented.write_text(text)
    res = run_cli("check", str(commented), "--fix")
    assert res.code == 1 and "not fixed" in res.err and commented.read_text() == text


def test_fix_moves_marked_template_lines_to_the_end(run_cli, tmp_path):
    path = _copy(EXAMPLES / "code" / "review.prompt", tmp_path)
    before = path.read_text()
    prefix_before = json.loads(run_cli("check", str(path), "--format", "json").out)["files"][0]["prefix_tokens"]
    res = run_cli("check", str(path), "--fix", "--format", "json")
    assert "moved line 6 to the end" in res.err
    assert res.code == 0, res.out
    after = path.read_text()
    # Same lines, one moved: nothing added, removed or edited.
    assert sorted(before.strip().split("\n")) == sorted(after.strip().split("\n"))
    assert after.rstrip().split("\n")[-1].startswith("Today is {{ today }}")
    # The instructions (about 170 tokens) now precede every variable.
    assert prefix_before < 5 and json.loads(res.out)["files"][0]["prefix_tokens"] > 150
    again = run_cli("check", str(path), "--fix")
    assert "nothing to fix" in again.err and path.read_text() == after


def test_fix_leaves_unmarked_templates_alone(run_cli, tmp_path):
    path = _copy(FIXTURES / "PC002" / "bad.md", tmp_path)
    before = path.read_text()
    res = run_cli("check", str(path), "--fix")
    assert res.code == 1 and "nothing to fix" in res.err and path.read_text() == before


def test_fix_respects_front_matter_movable(run_cli, tmp_path):
    src = (FIXTURES / "PC002" / "good.md").read_text().split("\n")
    # the date line first, declared movable by name in front matter
    text = "---\nmovable: [current_date]\n---\n" + "\n".join([src[-2], *src[:-2]]) + "\n"
    path = tmp_path / "t.md"
    path.write_text(text)
    res = run_cli("check", str(path), "--fix")
    assert res.code == 0, res.out + res.err
    assert path.read_text().rstrip().endswith("Current date: {{ current_date }}")
    assert path.read_text().startswith("---\nmovable: [current_date]\n---\nYou are Acme")
