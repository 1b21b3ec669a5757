"""--fix: only safe rewrites, meaning preserved, idempotent, and it says what it changed."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from promptlint.fixability import has_yaml_comment
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


def _parses_as_jinja(text: str) -> bool:
    import jinja2

    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError:
        return False
    return True


_STATIC = ("You are the support agent of Acme. Follow the refund policy, escalate outages, never share "
           "internal notes, keep answers short.\n") * 3


@pytest.mark.parametrize("mark", ["front-matter", "comment"])
def test_fix_moves_a_marked_jinja_block_whole_and_stays_valid(run_cli, tmp_path, mark):
    """The audit's repro: marking the ``{% for %}`` line movable used to move that line alone, leaving
    an ``{% endfor %}`` without its ``{% for %}`` (PC000), and a second --fix said "nothing to fix"."""
    src = (EXAMPLES / "rag" / "answer_v1.j2").read_text()
    if mark == "front-matter":
        text = "---\nmovable: [for doc in documents]\n---\n" + src
    else:
        text = "---\nrole: system\n---\n" + src.replace("{% for doc in documents %}", "{% for doc in documents %}{# promptlint: movable #}")
    path = tmp_path / "answer.j2"
    path.write_text(text)
    res = run_cli("check", str(path), "--fix", "--format", "json")
    assert "moved lines 6-9 to the end" in res.err, res.err
    after = path.read_text()
    assert _parses_as_jinja(after.split("---\n", 2)[2])
    assert "PC000" not in {f["code"] for f in json.loads(res.out)["findings"]}
    block = after.rstrip().split("\n")[-4:]
    assert block[0].startswith("{% for doc in documents %}") and block[-1] == "{% endfor %}"
    assert sorted(text.strip().split("\n")) == sorted(after.strip().split("\n"))
    again = run_cli("check", str(path), "--fix")
    assert "nothing to fix" in again.err and path.read_text() == after


def test_pc001_hint_on_a_block_tag_names_the_mark_that_fix_honours(run_cli, tmp_path):
    path = _copy(EXAMPLES / "rag" / "answer_v1.j2", tmp_path)
    found = json.loads(run_cli("check", str(path), "--format", "json").out)["findings"]
    pc001 = next(f for f in found if f["code"] == "PC001")
    assert "movable: [for doc in documents]" not in pc001["message"]
    assert "mark its opening line `{# promptlint: movable #}` and --fix moves the block" in pc001["message"]


def test_fix_never_moves_a_line_out_of_its_block(run_cli, tmp_path):
    """A marked line inside ``{% if is_beta %}`` moved to the end would render for everyone."""
    text = "{% if is_beta %}\nBeta build as of {{ today }} {# promptlint: movable #}\n{% endif %}\n" + _STATIC
    text += "Question: {{ question }}\n"
    path = tmp_path / "cond.j2"
    path.write_text(text)
    res = run_cli("check", str(path), "--fix", "--format", "json")
    assert path.read_text() == text and "nothing to fix" in res.err
    pc002 = next(f for f in json.loads(res.out)["findings"] if f["code"] == "PC002")
    assert not pc002["fixable"]
    assert "it is marked movable, but --fix leaves it: it lies inside `{% if is_beta %}" in pc002["message"]


def test_fix_does_not_drag_an_unmarked_value_along(run_cli, tmp_path):
    text = "---\nmovable: [current_date]\n---\nHello {user_name}, today is {current_date}.\n" + _STATIC
    path = tmp_path / "two.txt"
    path.write_text(text)
    res = run_cli("check", str(path), "--fix", "--format", "json")
    assert path.read_text() == text
    found = json.loads(res.out)["findings"]
    assert {f["code"] for f in found} == {"PC002", "PC003"}  # user_name's PC003 is still reported
    pc002 = next(f for f in found if f["code"] == "PC002")
    assert "line 4 also holds {user_name}, which is not marked movable" in pc002["message"]


def test_fix_keeps_the_response_schema_field_order(run_cli, tmp_path):
    """OpenAI Structured Outputs write fields in schema order: reasoning must stay before answer."""
    body = {
        "model": "gpt-4o",
        "response_format": {"type": "json_schema", "json_schema": {"name": "grade", "strict": True, "schema": {
            "type": "object", "additionalProperties": False, "required": ["reasoning", "answer"],
            "properties": {"reasoning": {"type": "string"}, "answer": {"type": "string"}}}}},
        "messages": [{"role": "system", "content": _STATIC}, {"role": "user", "content": "grade this"}],
    }
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(body, indent=2))
    res = run_cli("check", str(path), "--fix")
    after = json.loads(path.read_text())
    schema = after["response_format"]["json_schema"]["schema"]
    assert list(schema["properties"]) == ["reasoning", "answer"]
    assert list(schema) == sorted(schema)  # other keys are still canonical
    assert after["response_format"] == body["response_format"] and res.code == 0


def _anthropic_tools(marked: list[int]) -> dict:
    # keys already in canonical order: only the tool order is in question
    tools = [{"description": f"{name} tool", "input_schema": {"type": "object"}, "name": name}
             for name in ("search_code", "read_file", "list_dir")]
    for i in marked:
        tools[i] = dict(sorted({**tools[i], "cache_control": {"type": "ephemeral"}}.items()))
    return {"model": "claude-sonnet-4-5", "tools": tools, "system": _STATIC,
            "messages": [{"role": "user", "content": "Review my diff"}]}


def test_fix_sorting_tools_keeps_the_breakpoint_on_the_last_tool(run_cli, tmp_path):
    path = tmp_path / "anth.json"
    path.write_text(json.dumps(_anthropic_tools([2]), indent=2))
    res = run_cli("check", str(path), "--fix")
    assert "tools-sorted" in res.err
    tools = json.loads(path.read_text())["tools"]
    assert [t["name"] for t in tools] == ["list_dir", "read_file", "search_code"]
    assert [i for i, t in enumerate(tools) if "cache_control" in t] == [2]  # still covers every tool


def test_fix_does_not_sort_tools_when_a_breakpoint_sits_before_the_last(run_cli, tmp_path):
    path = tmp_path / "anth.json"
    text = json.dumps(_anthropic_tools([1]), indent=2)
    path.write_text(text)
    res = run_cli("check", str(path), "--fix", "--format", "json")
    assert path.read_text() == text
    pc004 = next(f for f in json.loads(res.out)["findings"] if f["code"] == "PC004")
    assert not pc004["fixable"] and "--fix does not sort them: a cache_control breakpoint on tool read_file" in pc004["message"]


def _unsorted_tools_and_trailing_space() -> dict:
    body = json.loads((FIXTURES / "PC004" / "bad.json").read_text())
    body["messages"][0]["content"] += "   "  # PC009: trailing whitespace at the message's edge
    return body


@pytest.mark.parametrize("how", ["--ignore", "per-file-ignores", "noqa-file"])
def test_fix_never_applies_the_fix_of_a_rule_that_is_off(run_cli, tmp_path, how):
    """The audit's repro: with PC004 ignored, --fix still sorted the tools (it canonicalized the whole
    request for the PC009 finding). Each step runs only for a rule reported on that file."""
    body = _unsorted_tools_and_trailing_space()
    args = []
    if how == "--ignore":
        args = ["--ignore", "PC004"]
    elif how == "per-file-ignores":
        config = tmp_path / "pyproject.toml"
        config.write_text('[tool.promptlint.per-file-ignores]\n"req.json" = ["PC004"]\n')
        args = ["--config", str(config)]
    else:
        body["promptlint"] = {"note": "promptlint: noqa-file[PC004]"}
    path = tmp_path / "req.json"
    path.write_text(json.dumps(body, indent=2))
    res = run_cli("check", str(path), "--fix", *args, cwd=tmp_path)
    assert "whitespace-normalized" in res.err and "tools-sorted" not in res.err, res.err
    assert "tool-schemas-canonical" not in res.err
    after = json.loads(path.read_text())
    assert after["tools"] == body["tools"] and list(after["tools"][0]) == list(body["tools"][0])  # order kept
    assert after["messages"][0]["content"] == body["messages"][0]["content"].rstrip()


def test_fix_leaves_message_whitespace_alone_when_pc009_is_off(run_cli, tmp_path):
    body = _unsorted_tools_and_trailing_space()
    path = tmp_path / "req.json"
    path.write_text(json.dumps(body, indent=2))
    res = run_cli("check", str(path), "--fix", "--ignore", "PC009")
    assert "tools-sorted" in res.err and "whitespace-normalized" not in res.err, res.err
    assert json.loads(path.read_text())["messages"] == body["messages"]


def test_a_yaml_request_with_comments_offers_no_fix(run_cli, tmp_path):
    """--fix leaves a commented YAML file alone, so its PC004 is neither [*] nor counted as fixable."""
    body = json.loads((FIXTURES / "PC004" / "bad.json").read_text())
    path = tmp_path / "commented.yaml"
    text = "# tools for the calendar agent\n" + yaml.safe_dump(body, sort_keys=False)
    path.write_text(text)
    found = json.loads(run_cli("check", str(path), "--format", "json").out)["findings"]
    assert [(f["code"], f["fixable"]) for f in found] == [("PC004", False), ("PC004", False)]
    report = run_cli("check", str(path)).out
    assert "[*]" not in report and "fixable with --fix" not in report
    res = run_cli("check", str(path), "--fix")
    assert "not fixed (tools-sorted, tool-schemas-canonical): YAML with comments" in res.err
    assert path.read_text() == text
    # the same request without the comment is fixable, and fixed
    plain = tmp_path / "plain.yaml"
    plain.write_text(yaml.safe_dump(body, sort_keys=False))
    found = json.loads(run_cli("check", str(plain), "--format", "json").out)["findings"]
    assert [f["fixable"] for f in found] == [True, True]


def test_a_hash_inside_yaml_text_is_not_a_comment(run_cli, tmp_path):
    """"Ticket #42" in a message, a quoted '#', a hash in a | block: text, not comments, so the file
    stays fixable and --fix keeps every one of them."""
    body = json.loads((FIXTURES / "PC004" / "bad.json").read_text())
    body["messages"] = [{"role": "system", "content": "Ticket #42 is open.\nAnswer with # headings."},
                        {"role": "user", "content": "a # b"}]
    path = tmp_path / "hashes.yaml"
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    found = json.loads(run_cli("check", str(path), "--format", "json").out)["findings"]
    assert found and all(f["fixable"] for f in found if f["code"] == "PC004")
    res = run_cli("check", str(path), "--fix")
    assert "tools-sorted" in res.err and "YAML with comments" not in res.err, res.err
    assert yaml.safe_load(path.read_text())["messages"] == body["messages"]


@pytest.mark.parametrize(("text", "commented"), [
    ("a: 1  # why\n", True),
    ("# header\na: 1\n", True),
    ("a: |\n  # not a comment: block text\n", False),
    ("a: 'x # y'\nb: \"#\"\nc: x#y\n", False),
    ("a: [1, 2]  # flow, then a comment\n", True),
    ("a: 'unclosed # quote\n", True),  # unreadable: left for a human
    ("a: 1\n", False),
])
def test_yaml_comment_detection(text: str, commented: bool) -> None:
    assert has_yaml_comment(text) is commented


def test_a_marked_line_of_a_template_inside_yaml_is_not_offered_as_fixable(run_cli, tmp_path):
    """--fix never moves raw lines inside a YAML/JSON file (it could break the document): the marked
    line's finding says so instead of promising a fix."""
    path = tmp_path / "tpl.yaml"
    text = ("movable: [current_date]\ntemplate: |\n  Current date: {{ current_date }}\n"
            + "".join(f"  {line}\n" for line in _STATIC.strip().split("\n")) + "  Question: {{ question }}\n")
    path.write_text(text)
    res = run_cli("check", str(path), "--format", "json")
    pc002 = next(f for f in json.loads(res.out)["findings"] if f["code"] == "PC002")
    assert not pc002["fixable"] and "--fix leaves it" in pc002["message"] and "YAML/JSON" in pc002["message"]
    res = run_cli("check", str(path), "--fix")
    assert "nothing to fix" in res.err and path.read_text() == text


_YAML_PROMPT = """\
model: gpt-4o
tools:
  - type: function
    function:
      name: search_orders
      description: |
        Search the customer's orders by date or status.
        Returns at most ten orders, newest first.
      parameters:
        type: object
        properties:
          status:
            type: string
  - type: function
    function:
      name: cancel_order
      description: Cancel one order that has not shipped yet.
      parameters:
        type: object
        properties:
          order_id:
            type: string
messages:
  - role: system
    content: |
      You are the order assistant of Acme.

      Answer from the order data only; never guess a delivery date.
      Keep answers under five sentences.
  - role: user
    content: Where is my last order?
"""


def test_a_block_scalars_own_final_newline_is_not_a_finding(run_cli, tmp_path):
    """`content: |` ends its text with the block's own line end: the same bytes on every load, not
    whitespace noise, so PC009 (even selected) has nothing to report and --fix nothing to change."""
    path = tmp_path / "plain.yaml"
    path.write_text("model: gpt-4o\nmessages:\n  - role: system\n    content: |\n      You help.\n"
                    "      Be brief.\n      Cite the policy.\n  - role: user\n    content: Hi\n")
    before = path.read_text()
    assert yaml.safe_load(before)["messages"][0]["content"].endswith("policy.\n")
    res = run_cli("check", str(path), "--select", "PC009", "--fix", "--format", "json")
    assert json.loads(res.out)["findings"] == [] and "nothing to fix" in res.err, res.err
    assert path.read_text() == before
    # The same newline typed into a JSON string, or blank lines kept by `|+`, are still findings.
    kept = tmp_path / "keep.yaml"
    kept.write_text(before.replace("content: |", "content: |+").replace("policy.\n", "policy.\n\n"))
    found = json.loads(run_cli("check", str(kept), "--select", "PC009", "--format", "json").out)["findings"]
    assert [f["code"] for f in found] == ["PC009"]
    typed = tmp_path / "typed.json"
    typed.write_text(json.dumps(yaml.safe_load(before)))
    found = json.loads(run_cli("check", str(typed), "--select", "PC009", "--format", "json").out)["findings"]
    assert [f["code"] for f in found] == ["PC009"]


def test_fix_of_a_yaml_prompt_keeps_its_block_scalars(run_cli, tmp_path):
    """The audit's repro: --fix rewrote `content: |` into a single-quoted scalar with doubled blank
    lines. Sorting the tools must keep the block style and what every string says."""
    path = tmp_path / "orders.yaml"
    path.write_text(_YAML_PROMPT)
    before = yaml.safe_load(_YAML_PROMPT)
    res = run_cli("check", str(path), "--fix")
    assert "tools-sorted" in res.err and "whitespace-normalized" not in res.err, res.err
    after_text = path.read_text()
    after = yaml.safe_load(after_text)
    assert after["messages"] == before["messages"]  # the system prompt's text, final newline included
    assert [t["function"]["name"] for t in after["tools"]] == ["cancel_order", "search_orders"]
    assert {t["function"]["name"]: t for t in after["tools"]} == {t["function"]["name"]: t for t in before["tools"]}
    assert "    content: |\n      You are the order assistant of Acme.\n\n      Answer" in after_text
    assert "description: |\n" in after_text and ": '" not in after_text and ': "' not in after_text
    assert after_text.startswith("model: gpt-4o\ntools:\n  - function:\n")  # the file's sequence indentation
    again = run_cli("check", str(path), "--fix", "--select", "PC")
    assert "nothing to fix" in again.err and path.read_text() == after_text


def test_fix_of_yaml_message_whitespace_keeps_block_style(run_cli, tmp_path):
    """A real PC009 finding (trailing spaces) in a file with a block scalar: only that edge changes,
    and the block stays a block with its own line end."""
    path = tmp_path / "orders.yaml"
    path.write_text(_YAML_PROMPT.replace("Where is my last order?", "'Where is my last order?   '"))
    res = run_cli("check", str(path), "--fix", "--ignore", "PC004")
    assert "whitespace-normalized" in res.err and "tools-sorted" not in res.err, res.err
    after_text = path.read_text()
    after = yaml.safe_load(after_text)
    assert after["messages"][1]["content"] == "Where is my last order?"
    assert after["messages"][0]["content"] == yaml.safe_load(_YAML_PROMPT)["messages"][0]["content"]
    assert "    content: |\n      You are the order assistant" in after_text
    again = run_cli("check", str(path), "--fix", "--ignore", "PC004")
    assert "nothing to fix" in again.err and path.read_text() == after_text
