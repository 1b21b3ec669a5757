"""Inputs: discovery (.gitignore), file kinds, front matter, placeholder syntaxes, invalid files."""

from __future__ import annotations

import json

import pytest

from promptlint.loader import discover, load
from promptlint.model import Finding, PromptDoc
from promptlint.parse import LineIndex, classify_name, split_text


def _dyn(text, syntax="auto"):
    return [(e.dyn, e.name) for e in split_text(text, "system", LineIndex(text), syntax) if e.dyn]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Hi {name}.", [("per-user", "name")]),
        ("Hi {{ user.email }}.", [("per-user", "user")]),
        ("Q: {{question|trim}}", [("input", "question")]),
        ("At $timestamp and ${request_id}", [("volatile", "timestamp"), ("volatile", "request_id")]),
        ("{% if premium %}Gold{% endif %}", [("control", "if premium")]),
        ("{{ now().isoformat() }}", [("volatile", "now")]),
        ("{# a comment #}{% set x = 1 %}static", []),
        ("JSON {\"type\": \"object\"} and code { return x; }", []),
        ("Style: {tone}", [("placeholder", "tone")]),
        ("user_name: Alice\nRules.", [("per-user", "user_name")]),
        ("Generated 2026-11-29T10:00:00Z", [("volatile", "timestamp")]),
    ],
)
def test_placeholder_syntaxes_and_classes(text, expected):
    assert _dyn(text) == expected


def test_syntax_restriction():
    text = "Price $amount for {name} and {{ user_name }}"
    assert [n for _, n in _dyn(text, "jinja")] == ["user_name"]
    assert [n for _, n in _dyn(text, "dollar")] == ["amount"]
    # str.format reads ``{{ user_name }}`` as the literal text "{ user_name }": not a field.
    assert [n for _, n in _dyn(text, "format")] == ["name"]
    assert _dyn(text, "none") == []


@pytest.mark.parametrize(
    ("name", "cls"),
    [("current_date", "volatile"), ("requestId", "volatile"), ("user_question", "input"),
     ("customer_email", "per-user"), ("first_name", "per-user"), ("retrieved_documents", "input"),
     ("tone", "placeholder"), ("TODAY", "volatile")],
)
def test_classify_name(name, cls):
    assert classify_name(name) == cls


def test_element_lines_and_columns():
    text = "line one\nHello {name}, welcome.\n"
    els = split_text(text, "system", LineIndex(text, first_line=5))
    name = next(e for e in els if e.dyn)
    assert (name.line, name.column) == (6, 7)


def test_gitignore_and_hidden_dirs_are_honoured(tmp_path):
    (tmp_path / ".git").mkdir()
    (tmp_path / ".gitignore").write_text("build/\n*.tmp.txt\n")
    for rel in ("a.txt", "b.tmp.txt", "build/c.txt", "sub/d.j2", "sub/e.py", ".venv/f.txt", "sub/deep/g.yaml"):
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("x")
    (tmp_path / "sub" / ".gitignore").write_text("deep/\n")
    found = [(p.relative_to(tmp_path).as_posix(), named) for p, named in discover([tmp_path])]
    # .py files are found too (source_scan); one without an SDK call is then skipped by load().
    assert found == [("a.txt", False), ("sub/d.j2", False), ("sub/e.py", False)]
    assert load(tmp_path / "sub" / "e.py", named=False) is None
    # a file named explicitly is linted even when ignored
    assert [n for _, n in discover([tmp_path / "b.tmp.txt"])] == [True]
    with pytest.raises(FileNotFoundError):
        list(discover([tmp_path / "nope"]))


def test_non_prompt_data_files_skipped_when_walked_reported_when_named(tmp_path):
    p = tmp_path / "package.json"
    p.write_text(json.dumps({"name": "x", "version": "1"}))
    assert load(p, named=False) is None
    f = load(p, named=True)
    assert isinstance(f, Finding) and f.code == "PC000" and "not a prompt file" in f.message


@pytest.mark.parametrize(
    ("name", "content", "line", "message"),
    [
        ("a.json", '{"messages": [}', 1, "invalid JSON"),
        ("b.yaml", "messages: [\n  - a\n  b: c", 2, "invalid YAML"),
        ("c.md", "---\nvars: [unclosed\n---\nHi", 2, "invalid YAML front matter"),
        ("d.md", "---\nrole: system\nHi", 1, "no closing '---'"),
        ("e.j2", "Hi\n\n{{ name ", 3, "invalid Jinja2 template"),
        ("f.json", '{"messages": "hi"}', 1, "'messages' must be a list"),
        ("g.json", '{"messages": [{"content": "no role"}]}', 1, "must be an object with a string 'role'"),
        ("h.md", "---\nvars: {x: weird}\n---\n{x}", 1, "unknown kind 'weird'"),
        ("i.md", "---\nsyntax: perl\n---\nHi", 1, "'syntax' must be"),
    ],
)
def test_invalid_files_are_pc000_findings(tmp_path, name, content, line, message):
    p = tmp_path / name
    p.write_text(content)
    f = load(p, named=False)
    assert isinstance(f, Finding), f
    assert f.code == "PC000" and f.severity == "error" and f.line == line and message in f.message


def test_unreadable_file(tmp_path):
    d = tmp_path / "dir.txt"
    d.mkdir()
    f = load(d, named=True)
    assert isinstance(f, Finding) and f.code == "PC000" and "cannot read" in f.message


def test_front_matter_and_yaml_template(tmp_path):
    p = tmp_path / "t.prompt"
    p.write_text("---\nrole: user\nvars:\n  tone: static\n  doc: {kind: input, tokens: 900}\n---\n"
                 "Tone {tone}. Doc: {doc}\n")
    doc = load(p, named=True)
    assert isinstance(doc, PromptDoc) and doc.body_line == 7
    assert [(e.role, e.dyn, e.name, e.line) for e in doc.elements if e.name] == [
        ("user", None, "tone", 7), ("user", "input", "doc", 7)]
    y = tmp_path / "t.yaml"
    y.write_text("family: greeters\ntemplate: |\n  Hello {user_name}!\n  Be brief.\n")
    doc = load(y, named=True)
    assert isinstance(doc, PromptDoc) and doc.kind == "template" and doc.meta == {"family": "greeters"}
    assert [(e.dyn, e.line) for e in doc.elements if e.dyn] == [("per-user", 3)]


def test_request_shapes(tmp_path):
    anthropic = {
        "system": [{"type": "text", "text": "Static.", "cache_control": {"type": "ephemeral"}}],
        "tools": [{"name": "b", "input_schema": {}}, {"name": "a", "input_schema": {}}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Q?"}]}],
    }
    p = tmp_path / "r.json"
    p.write_text(json.dumps(anthropic, indent=2))
    doc = load(p, named=True)
    assert isinstance(doc, PromptDoc) and doc.kind == "request"
    assert [(e.role, e.dyn, e.breakpoint, e.is_tools) for e in doc.elements] == [
        ("tools", None, False, True), ("tools", None, False, True), ("system", None, True, False),
        ("user", "input", False, False)]
    # A request whose messages hold variables is a template: variables, not the last message, are dynamic.
    templated = {"messages": [{"role": "system", "content": "Rules."}, {"role": "user", "content": "Q: {{ question }}"}]}
    p.write_text(json.dumps(templated))
    doc = load(p, named=True)
    assert [(e.dyn, e.name) for e in doc.elements if e.dyn] == [("input", "question")]


def test_literal_dates_are_constants_in_templates_but_values_in_requests(tmp_path):
    t = tmp_path / "t.md"
    t.write_text("Policy effective 2024-01-01.\nGenerated 2026-11-29T10:00:00Z.\n")
    doc = load(t, named=True)
    assert [(e.dyn, e.name) for e in doc.elements if e.dyn] == [("volatile", "timestamp")]
    r = tmp_path / "r.json"
    r.write_text(json.dumps({"messages": [{"role": "system", "content": "Today is 2026-11-29."},
                                          {"role": "user", "content": "hi"}]}))
    doc = load(r, named=True)
    assert [(e.dyn, e.name) for e in doc.elements if e.dyn] == [("volatile", "date"), ("input", "last user message")]
