"""Broken input to the command-line tools: one clear line on stderr and exit 2 (CLI), or a PC000
diagnostic (promptlint) — never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run(args: list[str], home: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("since", ["99999999999999d", "yesterday", "5 fortnights"])
def test_report_since_garbage_is_exit_2(tmp_path: Path, since: str) -> None:
    r = _run(["-m", "gateway.cli.main", "report", "--home", str(tmp_path), "--since", since])
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr and r.stderr.strip().startswith("prefixgate: error:")


def _broken_corpus(root: Path) -> list[Path]:
    """Files a prompt repository really contains when something went wrong."""
    files = {
        "truncated.json": b'{"messages": [{"role": "system", "content": "You are',
        "not_object.json": b"[1, 2, 3]",
        "null.json": b"null",
        "deep.json": b"[" * 3000 + b"]" * 3000,
        "deep_obj.json": b'{"messages": ' + b"[" * 3000 + b"]" * 3000 + b"}",
        "deep.yaml": b"messages: " + b"[" * 3000 + b"]" * 3000 + b"\n",
        "latin1.txt": "Syst\u00e8me: r\u00e9ponds".encode("latin-1"),
        "utf16.txt": "You are a helpful assistant.".encode("utf-16"),
        "binary.txt": bytes(range(256)) * 4,
        "nul.txt": b"You are\x00 helpful",
        "empty.txt": b"",
        "bad.j2": b"{% for x in %}{{ x }",
        "unclosed.j2": b"{{ user.name ",
        "bad.yaml": b"messages:\n  - role: system\n    content: [unclosed\n",
        "yaml_bomb.yaml": b"a: &a [\"x\"]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a]\nc: &c [*b, *b, *b, *b, *b, *b, *b, *b]\n"
                          b"d: &d [*c, *c, *c, *c, *c, *c, *c, *c]\ne: [*d, *d, *d, *d, *d, *d, *d, *d]\n",
        "tab_yaml.yaml": b"\tmessages: x\n",
        "weird.prompt": b"\xef\xbb\xbf\r\n\r\n\t   ",
        "huge_line.txt": b"x" * 2_000_000,
        "tools_wrong.json": json.dumps({"messages": [], "tools": "not a list"}).encode(),
        "msgs_wrong.json": json.dumps({"messages": [{"role": 5, "content": {"a": 1}}]}).encode(),
    }
    paths = []
    for name, data in files.items():
        p = root / name
        p.write_bytes(data)
        paths.append(p)
    return paths


def test_promptlint_on_a_broken_corpus_never_crashes(tmp_path: Path) -> None:
    corpus = tmp_path / "prompts"
    corpus.mkdir()
    paths = _broken_corpus(corpus)
    (corpus / "a_dir.json").mkdir()  # a directory with a prompt-like name
    for fmt in ("json", "sarif", "text"):
        r = _run(["-m", "promptlint", "check", str(corpus), "--format", fmt])
        assert r.returncode in (0, 1), (fmt, r.returncode, r.stderr[-2000:])
        assert "Traceback" not in r.stderr, r.stderr[-2000:]
    r = _run(["-m", "promptlint", "check", str(corpus), "--format", "json"])
    report = json.loads(r.stdout)
    assert report, "empty report"
    seen = json.dumps(report)
    # every file that is not a readable prompt is reported, not silently skipped
    for name in ("truncated.json", "bad.j2", "bad.yaml"):
        assert name in seen, name
    assert len(paths) >= 15


def test_promptlint_fix_on_a_broken_corpus_changes_nothing_it_cannot_parse(tmp_path: Path) -> None:
    corpus = tmp_path / "prompts"
    corpus.mkdir()
    paths = _broken_corpus(corpus)
    before = {p: p.read_bytes() for p in paths}
    r = _run(["-m", "promptlint", "check", str(corpus), "--fix", "--format", "json"])
    assert r.returncode in (0, 1) and "Traceback" not in r.stderr, r.stderr[-2000:]
    for p in ("truncated.json", "bad.j2", "bad.yaml", "binary.txt", "latin1.txt"):
        assert (corpus / p).read_bytes() == before[corpus / p], p


def test_canon_reorder_keeps_a_trailing_assistant_prefill_last() -> None:
    """Found by the promptlint hypothesis property (idempotence): with no user turn, the moved
    context message was appended after the assistant prefill, so a second pass changed it."""
    from promptlint.canon import canonicalize

    body = {"model": "m", "messages": [{"role": "system", "content": "Current time: 2026-11-29T10:00:00Z"},
                                       {"role": "assistant", "content": "  Be brief.  "}]}
    once = canonicalize(body, "reorder")
    msgs = once.body["messages"]
    assert msgs[-1] == {"role": "assistant", "content": "  Be brief.  "}
    assert canonicalize(once.body, "reorder").body == once.body
