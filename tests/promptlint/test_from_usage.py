"""``promptlint check --from-usage``: live breaks (from the explainer) land on the template lines behind them."""

from __future__ import annotations

import json

from promptlint.explain import explain

POLICY = "\n".join(f"Rule {i}: answer from the handbook, cite the section, stay polite and brief." for i in range(12))
TEMPLATE = f"""---
family: support-bot
---
You are Acme's support assistant.
Current time: {{timestamp}}
{POLICY}
"""
GREETER = f"""You are Acme's greeter.
{POLICY}
customer_name: {{customer_name}}
Welcome them by name.
"""


def _body(system, question="Where is my order?"):
    return {"model": "gpt-4o", "messages": [{"role": "system", "content": system},
                                            {"role": "user", "content": question}]}


def _render(template, **values):
    text = template.split("---\n", 2)[-1]
    for k, v in values.items():
        text = text.replace("{" + k + "}", v)
    return text


def _miss(prev, cur, **extra):
    brk = explain(prev, cur)
    assert brk is not None
    return {**brk.as_dict(), **extra}


def _write(tmp_path, misses):
    path = tmp_path / "usage.json"
    path.write_text(json.dumps({"schema": "prefixgate.report/v1", "rows": [], "misses": misses}))
    return path


def _setup(tmp_path):
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    (prompts / "support.txt").write_text(TEMPLATE)
    (prompts / "greeter.txt").write_text(GREETER)
    t1, t2, t3 = (_body(_render(TEMPLATE, timestamp=ts)) for ts in
                  ("2026-11-29T10:00:00Z", "2026-11-29T10:07:00Z", "2026-11-29T11:30:00Z"))
    g1, g2 = (_body(_render(GREETER, customer_name=n)) for n in ("Alice Smith", "Bob Jones"))
    misses = [
        _miss(t1, t2, family="support-bot", tokens_lost=300, usd_lost=0.00075),
        _miss(t2, t3, family="support-bot", tokens_lost=310, usd_lost=0.000775),
        _miss(g1, g2, family="u-42", tokens_lost=200),  # family is the end user: matched by text
    ]
    return prompts, misses


def test_live_breaks_become_findings_on_the_template_lines(run_cli, tmp_path):
    prompts, misses = _setup(tmp_path)
    assert [m["rule"] for m in misses] == ["PC002", "PC002", "PC003"]
    res = run_cli("check", str(prompts), "--from-usage", str(_write(tmp_path, misses)), "--format", "json")
    assert res.code == 1, res.err
    live = [f for f in json.loads(res.out)["findings"] if f["message"].startswith("live traffic")]
    got = sorted((f["path"].rsplit("/", 1)[-1], f["code"], f["line"]) for f in live)
    # support.txt line 5 (after 3 lines of front matter) holds {timestamp}; greeter.txt line 14 the name.
    assert got == [("greeter.txt", "PC003", 14), ("support.txt", "PC002", 5)]
    support = next(f for f in live if f["code"] == "PC002")
    assert "2 request(s)" in support["message"] and "610 tokens" in support["message"]
    assert "$0.0015" in support["message"] and "timestamp" in support["message"]


def test_text_output_and_unmatched_records(run_cli, tmp_path):
    prompts, misses = _setup(tmp_path)
    other = {"rule": "other", "detail": "changed", "context": "zzz", "message": "a prompt edit"}
    stray = {**misses[0], "family": "nobody", "context": "text that is in no template at all"}
    res = run_cli("check", str(prompts), "--from-usage", str(_write(tmp_path, [*misses, other, stray])))
    assert res.code == 1
    assert "support.txt:5:1: PC002 volatile-value-in-prefix: live traffic: 2 request(s)" in res.out
    assert "2 of 5 miss record(s) matched no linted file (rules PC002, other)" in res.err


def test_json_lines_miss_log_is_accepted(run_cli, tmp_path):
    prompts, misses = _setup(tmp_path)
    log = tmp_path / "misses.jsonl"
    log.write_text("\n".join(json.dumps(m) for m in misses) + "\n")
    res = run_cli("check", str(prompts), "--from-usage", str(log), "--format", "json")
    assert sum(f["message"].startswith("live traffic") for f in json.loads(res.out)["findings"]) == 2


def test_bad_usage_files_are_usage_errors(run_cli, tmp_path):
    prompts, _ = _setup(tmp_path)
    cases = {
        "missing.json": None,
        "garbage.json": "{not json",
        "nomisses.json": json.dumps({"rows": []}),
        "norule.json": json.dumps({"misses": [{"detail": "x"}]}),
    }
    for name, text in cases.items():
        path = tmp_path / name
        if text is not None:
            path.write_text(text)
        res = run_cli("check", str(prompts), "--from-usage", str(path))
        assert res.code == 2 and res.err.startswith("promptlint: error: ") and res.err.count("\n") == 1, (name, res.err)


def test_prompt_cache_key_family_matches_the_template_by_name(run_cli, tmp_path):
    prompts, misses = _setup(tmp_path)
    # The text before the break is nowhere in the files, but the client sent prompt_cache_key=support-bot.
    rec = {**misses[0], "family": "prompt_cache_key:support-bot", "context": "no such text in any template"}
    res = run_cli("check", str(prompts), "--from-usage", str(_write(tmp_path, [rec])), "--format", "json")
    live = [f for f in json.loads(res.out)["findings"] if f["message"].startswith("live traffic")]
    # Attributed to support.txt, at its first dynamic value ({timestamp}, line 5).
    assert [(f["path"].rsplit("/", 1)[-1], f["code"], f["line"]) for f in live] == [("support.txt", "PC002", 5)]


def test_live_findings_honour_noqa_and_per_file_ignores(run_cli, tmp_path):
    prompts, misses = _setup(tmp_path)
    usage = str(_write(tmp_path, misses))

    def live_codes():
        res = run_cli("check", "prompts", "--from-usage", usage, "--format", "json", cwd=tmp_path)
        return sorted(f["code"] for f in json.loads(res.out)["findings"] if f["message"].startswith("live traffic"))

    assert live_codes() == ["PC002", "PC003"]
    (tmp_path / "pyproject.toml").write_text(
        '[tool.promptlint]\n[tool.promptlint.per-file-ignores]\n"prompts/greeter.txt" = ["PC003"]\n')
    assert live_codes() == ["PC002"]
    support = prompts / "support.txt"
    lines = support.read_text().split("\n")
    lines[4] += "  # promptlint: noqa[PC002]"
    support.write_text("\n".join(lines))
    assert live_codes() == []
