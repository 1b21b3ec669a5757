"""Chat request files: hostile YAML, values inside tool definitions, breakpoint counts, positions."""

from __future__ import annotations

import json
import time

import pytest

from promptlint.loader import load
from promptlint.model import Finding, PromptDoc

_STATIC = "You are Acme's operations agent. Confirm before destructive actions. " * 20


def _findings(run_cli, *paths):
    res = run_cli("check", *map(str, paths), "--format", "json", cwd=paths[0] if paths[0].is_dir() else paths[0].parent)
    assert res.code in (0, 1), res.err
    return json.loads(res.out)


def _alias_bomb(levels: int = 9) -> str:
    lines = ["a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for n in range(1, levels):
        lines.append(f"a{n}: &a{n} [{', '.join([f'*a{n - 1}'] * 9)}]")
    return "\n".join([*lines, f"tools: [*a{levels - 1}]", "messages: [{role: user, content: hi}]", ""])


def test_yaml_alias_bomb_is_one_pc000_and_fast(tmp_path):
    (tmp_path / "bomb.yaml").write_text(_alias_bomb())
    (tmp_path / "ok.txt").write_text("Static instructions.\n")
    started = time.monotonic()
    f = load(tmp_path / "bomb.yaml", named=False)
    assert isinstance(f, Finding) and f.code == "PC000" and "alias" in f.message
    assert time.monotonic() - started < 5


def test_yaml_alias_bomb_in_a_walked_directory(run_cli, tmp_path):
    (tmp_path / "bomb.yaml").write_text(_alias_bomb())
    out = _findings(run_cli, tmp_path)
    assert [(f["code"], f["path"].rsplit("/", 1)[-1]) for f in out["findings"]] == [("PC000", "bomb.yaml")]


def test_recursive_yaml_alias_is_pc000(tmp_path):
    (tmp_path / "r.yaml").write_text("tools: &t [*t]\nmessages: [{role: user, content: hi}]\n")
    f = load(tmp_path / "r.yaml", named=True)
    assert isinstance(f, Finding) and f.code == "PC000"


def test_honest_yaml_aliases_still_load(tmp_path):
    (tmp_path / "r.yaml").write_text(
        "schema: &s {type: object, properties: {q: {type: string}}}\n"
        "tools: [{name: a, input_schema: *s}, {name: b, input_schema: *s}]\n"
        "messages: [{role: user, content: hi}]\n")
    assert isinstance(load(tmp_path / "r.yaml", named=True), PromptDoc)


def _tool_request(description: str) -> dict:
    return {
        "model": "gpt-4o",
        "tools": [{"type": "function", "function": {
            "name": "scale", "description": description,
            "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}}}}],
        "messages": [{"role": "system", "content": _STATIC}, {"role": "user", "content": "restart api"}],
    }


@pytest.mark.parametrize(
    ("description", "code", "value"),
    [
        ("Scale a service. Generated 2026-11-29T10:00:00Z.", "PC002", "2026-11-29T10:00:00Z"),
        ("Scale a service. Request id req_8f3a9c2b1d.", "PC002", "req_8f3a9c2b1d"),
        ("Data as of {{ now }}.", "PC002", "{{ now }}"),
        ("Scale for tenant {{ user_id }}.", "PC003", "{{ user_id }}"),
    ],
)
def test_dynamic_values_in_tool_definitions_are_findings(run_cli, tmp_path, description, code, value):
    p = tmp_path / "req.json"
    p.write_text(json.dumps(_tool_request(description), indent=2))
    out = _findings(run_cli, p)
    found = [f for f in out["findings"] if f["code"] == code]
    assert len(found) == 1 and value in found[0]["message"]
    line = p.read_text().split("\n")[found[0]["line"] - 1]
    assert line[found[0]["column"] - 1 :].startswith(value)
    assert not [f for f in out["findings"] if f["code"] == "PC005"]  # the tool list itself is not "after"
    assert out["files"][0]["score"] < 20  # the whole prompt after the tool is re-prefilled


def test_static_tools_keep_a_full_score(run_cli, tmp_path):
    p = tmp_path / "req.json"
    p.write_text(json.dumps(_tool_request("Scale a service."), indent=2))
    out = _findings(run_cli, p)
    assert not [f for f in out["findings"] if f["code"] in ("PC001", "PC002", "PC003")]
    assert out["files"][0]["score"] > 90


def test_pc011_counts_breakpoints_on_tools(run_cli, tmp_path):
    mark = {"type": "ephemeral"}
    body = {
        "model": "claude-sonnet-4",
        "tools": [{"name": f"t{i}", "description": "d", "input_schema": {"type": "object"}, "cache_control": mark}
                  for i in range(3)],
        "system": [{"type": "text", "text": "Rules one.", "cache_control": mark},
                   {"type": "text", "text": "Rules two.", "cache_control": mark}],
        "messages": [{"role": "user", "content": "hi"}],
    }
    p = tmp_path / "r.json"
    p.write_text(json.dumps(body, indent=2))
    found = [f for f in _findings(run_cli, p)["findings"] if f["code"] == "PC011"]
    assert len(found) == 1 and found[0]["message"].startswith("5 cache_control breakpoints")
    assert p.read_text().split("\n")[found[0]["line"] - 1].strip().startswith('"text": "Rules two."')
    body["system"][1].pop("cache_control")
    p.write_text(json.dumps(body, indent=2))
    assert not [f for f in _findings(run_cli, p)["findings"] if f["code"] == "PC011"]


def _at(path, finding) -> str:
    """The physical file text from a finding's line:column on."""
    return path.read_text(encoding="utf-8").split("\n")[finding["line"] - 1][finding["column"] - 1 :]


def test_json_positions_are_physical_columns(run_cli, tmp_path):
    # Escapes (\n, \", \u00e9) and non-ASCII text before the value: the column is still the file's.
    content = 'R\u00e8gles "strictes".\nHeure : 2026-11-29T10:00:00Z\n' + _STATIC
    p = tmp_path / "fr.json"
    p.write_text('{\n  "messages": [\n    {"role": "system", "content": "Bref."},\n'
                 f'    {{"role": "system", "content": {json.dumps(content, ensure_ascii=False)}}},\n'
                 '    {"role": "user", "content": "hi"}\n  ]\n}\n', encoding="utf-8")
    found = [f for f in _findings(run_cli, p)["findings"] if f["code"] == "PC002"]
    assert len(found) == 1 and found[0]["line"] == 4
    assert _at(p, found[0]).startswith("2026-11-29T10:00:00Z")
    p.write_text(p.read_text(encoding="utf-8").replace('"Bref."', json.dumps("Bref \u00e9t\u00e9.")))
    found = [f for f in _findings(run_cli, p)["findings"] if f["code"] == "PC002"]
    assert _at(p, found[0]).startswith("2026-11-29T10:00:00Z")


@pytest.mark.parametrize("style", ["|", ">", "plain", "double"])
def test_yaml_positions_are_physical_columns(run_cli, tmp_path, style):
    first = "You are the support agent for Acme. Be polite."
    value = "3f2b8c1e-9d4a-4b6f-8e2a-1c5d7e9f0a3b"
    rest = "Policy: refunds within 30 days; escalate outages; never share internal notes; keep answers short."
    if style in ("|", ">"):
        content = f"{style}\n      {first}\n      Request id: {value}\n      {rest}"
    elif style == "plain":
        content = f"{first} Request id {value}\n      {rest}".replace(": ", " - ")  # continued on a second line
    else:
        content = f'"{first}\\n\\tRequest id: {value} {rest}"'
    p = tmp_path / "r.yaml"
    p.write_text(f"model: gpt-4o\nmessages:\n  - role: system\n    content: {content}\n"
                 "  - role: user\n    content: hi\n")
    found = [f for f in _findings(run_cli, p)["findings"] if f["code"] == "PC002"]
    assert len(found) == 1
    assert _at(p, found[0]).startswith(value)
