"""Application source: SDK calls whose messages are built from f-strings, .format, % and +."""

from __future__ import annotations

import json
import textwrap

from promptlint.loader import load
from promptlint.model import Finding
from promptlint.source_scan import scan
from tests.promptlint.promptlint_paths import FIXTURES

APP = FIXTURES / "source" / "app.py"


def _check(run_cli, path):
    res = run_cli("check", str(path), "--format", "json")
    assert res.code in (0, 1), res.err
    return json.loads(res.out)


def test_each_sdk_call_is_scored_and_its_dynamic_values_found(run_cli):
    data = _check(run_cli, APP)
    got = sorted((f["code"], f["line"], f["column"]) for f in data["findings"])
    assert got == [
        ("PC001", 40, 35),  # "Context:\n%s" % documents ahead of the policy (responses.create instructions)
        ("PC002", 16, 26),  # {datetime.datetime.now()} in an f-string system prompt
        ("PC002", 16, 70),  # {uuid.uuid4()}
        ("PC003", 27, 10),  # "You help {name} ({email})".format(name=user.name, ...)
        ("PC003", 27, 18),
    ]
    messages = {f["line"]: f["message"] for f in data["findings"]}
    assert "datetime.datetime.now()" in messages[16] or "uuid.uuid4()" in messages[16]
    # Four calls send prompts (models.list does not); the one with the policy first scores best.
    scores = [f["score"] for f in data["files"]]
    assert len(scores) == 4 and max(scores) == scores[2] > 20 > max(scores[:2] + scores[3:])
    assert [f["call_line"] for f in data["files"]] == [17, 24, 33, 41]  # one entry per SDK call
    table = run_cli("check", str(APP)).out
    assert all(f"app.py:{n} " in table for n in (17, 24, 33, 41))


def test_module_constants_and_locals_are_followed(tmp_path):
    src = tmp_path / "bot.py"
    src.write_text(textwrap.dedent('''
        import openai
        from datetime import datetime

        HEADER = "You are a careful assistant."

        def ask(client, user_email, q):
            sys_prompt = HEADER + f" Now: {datetime.utcnow().isoformat()}."
            msgs = [{"role": "system", "content": sys_prompt}]
            msgs.append({"role": "user", "content": q})
            return client.chat.completions.create(model="gpt-4o", messages=msgs)
    '''))
    (doc,) = scan(src, "bot.py", src.read_text())
    parts = [(e.role, e.dyn, e.text) for e in doc.elements]
    assert parts[0] == ("system", None, "You are a careful assistant.")
    assert parts[1] == ("system", None, " Now: ")
    assert parts[2] == ("system", "volatile", "{datetime.utcnow().isoformat()}")
    assert parts[-1] == ("user", "input", "q")


def test_literal_tools_in_source_are_checked_for_order(run_cli, tmp_path):
    src = tmp_path / "tools.py"
    src.write_text(textwrap.dedent('''
        import litellm

        TOOLS = [{"function": {"name": "search", "parameters": {}}, "type": "function"},
                 {"function": {"name": "create", "parameters": {}}, "type": "function"}]

        def run(q):
            return litellm.completion(model="gpt-4o", tools=TOOLS, messages=[{"role": "user", "content": q}])
    '''))
    data = _check(run_cli, src)
    # --fix never rewrites source code, so the finding is not offered as fixable (no [*], not counted).
    assert [(f["code"], f["fixable"]) for f in data["findings"]] == [("PC004", False)]
    text = run_cli("check", str(src)).out
    assert "[*]" not in text and "fixable with --fix" not in text
    before = src.read_text()
    run_cli("check", str(src), "--fix")
    assert src.read_text() == before


def test_noqa_applies_in_source(run_cli, tmp_path):
    src = tmp_path / "q.py"
    text = APP.read_text().replace(
        'system = f"Today', '# promptlint: noqa[PC002]\n    system = f"Today'
    ).replace('\\n" + POLICY\n    return client.chat', '\\n" + POLICY  # promptlint: noqa[PC002]\n    return client.chat')
    src.write_text(text)
    codes = [f["code"] for f in _check(run_cli, src)["findings"]]
    assert "PC002" not in codes and codes.count("PC003") == 2


def test_python_without_sdk_calls_is_skipped_when_walked_reported_when_named(run_cli, tmp_path):
    plain = tmp_path / "util.py"
    plain.write_text("def add(a, b):\n    return a + b\n")
    uses_sdk_no_call = tmp_path / "models.py"
    uses_sdk_no_call.write_text("import openai\nprint(openai.__version__)\n")
    assert load(plain, named=False) is None and load(uses_sdk_no_call, named=False) is None
    named = load(uses_sdk_no_call, named=True)
    assert isinstance(named, Finding) and named.code == "PC000"
    res = run_cli("check", str(tmp_path))
    assert res.code == 0 and "no prompt files found" in res.err


def test_invalid_python_is_pc000_at_its_line(tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("import openai\n\ndef f(:\n    pass\n")
    got = load(bad, named=False)
    assert isinstance(got, Finding) and (got.code, got.line) == ("PC000", 3) and "invalid Python" in got.message


def test_history_slice_is_pc012(run_cli):
    data = _check(run_cli, FIXTURES / "PC012" / "bad.py")
    assert [(f["code"], f["line"]) for f in data["findings"]] == [("PC012", 10)]


def test_escaped_newlines_keep_values_on_their_physical_line(run_cli, tmp_path):
    # "\n" escapes are not line breaks in the file: the value and a noqa on its line share one line.
    src = tmp_path / "esc.py"
    policy = "Follow the refund policy. Escalate outages to on-call. Never share internal notes. " * 3
    src.write_text(textwrap.dedent(f'''\
        import datetime
        from openai import OpenAI

        client = OpenAI()
        POLICY = "{policy}"


        def answer(question):
            system = f"You are Acme's agent.\\nRules follow.\\nToday is {{datetime.datetime.now()}}.\\n" + POLICY
            return client.chat.completions.create(
                model="gpt-4o",
                messages=[{{"role": "system", "content": system}}, {{"role": "user", "content": question}}],
            )
        '''))
    found = [f for f in _check(run_cli, src)["findings"] if f["code"] == "PC002"]
    assert [f["line"] for f in found] == [9]
    src.write_text(src.read_text().replace("+ POLICY\n", "+ POLICY  # promptlint: noqa[PC002]\n"))
    assert not [f for f in _check(run_cli, src)["findings"] if f["code"] == "PC002"]


def test_joining_or_formatting_a_set_into_a_prompt_is_pc013(run_cli, tmp_path):
    path = tmp_path / "tags.py"
    path.write_text(textwrap.dedent('''\
        from openai import OpenAI

        client = OpenAI()


        def tagged(question, tags):
            tagset = set(tags)
            joined = "Allowed topics: " + ", ".join(tagset)
            shown = f"Tags: {tagset}"
            stable = "Sorted: " + ", ".join(sorted(tagset))
            system = joined + shown + stable
            return client.chat.completions.create(
                model="gpt-4o",
                messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
            )
        '''))
    found = [f for f in _check(run_cli, path)["findings"] if f["code"] == "PC013"]
    assert [(f["line"], f["column"]) for f in found] == [(8, 35), (9, 22)]
