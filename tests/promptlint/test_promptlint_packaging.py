"""What users wire into CI (pre-commit, GitHub Actions), the docs table, and canon's import weight."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from promptlint.tokens import cache_minimum, encoding_name
from tests.promptlint.promptlint_paths import REPO


def test_pre_commit_hooks_declare_promptlint():
    hooks = yaml.safe_load((REPO / ".pre-commit-hooks.yaml").read_text())
    by_id = {h["id"]: h for h in hooks}
    assert by_id["promptlint"]["entry"].startswith("promptlint check")
    assert "--skip-non-prompts" in by_id["promptlint"]["entry"]
    assert by_id["promptlint"]["language"] == "python" and by_id["promptlint"]["require_serial"] is True
    assert "--fix" in by_id["promptlint-fix"]["entry"]


def test_github_workflow_uploads_sarif_and_annotates(run_cli):
    wf = yaml.safe_load((REPO / "examples" / "ci" / "promptlint.yml").read_text())
    steps = wf["jobs"]["promptlint"]["steps"]
    runs = [s.get("run", "") for s in steps]
    assert any("--format github" in r for r in runs)
    assert any("--format sarif --output promptlint.sarif" in r for r in runs)
    upload = next(s for s in steps if str(s.get("uses", "")).startswith("github/codeql-action/upload-sarif"))
    assert upload["with"]["sarif_file"] == "promptlint.sarif"
    assert wf["permissions"]["security-events"] == "write"


def test_docs_rules_table_is_generated(run_cli):
    table = run_cli("rules", "--format", "markdown").out.strip()
    doc = (REPO / "docs" / "promptlint.md").read_text()
    start = doc.index("<!-- rules-table:start -->") + len("<!-- rules-table:start -->")
    end = doc.index("<!-- rules-table:end -->")
    assert doc[start:end].strip() == table, "regenerate with `promptlint rules --format markdown`"


def test_canon_imports_only_the_standard_library():
    code = (
        "import sys, promptlint.canon\n"
        "third = {m.split('.')[0] for m in sys.modules} & {'tiktoken', 'yaml', 'jinja2', 'pathspec', 'litellm'}\n"
        "print(sorted(third))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("model", "encoding", "minimum"),
    [("gpt-4o", "o200k_base", 1024), ("openai/gpt-4.1-mini", "o200k_base", 1024), ("gpt-4", "cl100k_base", 1024),
     ("claude-sonnet-4-5", "cl100k_base", 1024), ("claude-3-5-haiku-20241022", "cl100k_base", 2048),
     ("claude-haiku-4-5", "cl100k_base", 4096), ("anthropic/claude-opus-4-5", "cl100k_base", 4096)],
)
def test_model_encoding_and_cache_minimum(model, encoding, minimum):
    assert encoding_name(model) == encoding
    assert cache_minimum(model)[1] == minimum
