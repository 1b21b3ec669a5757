"""The light install: `pip install prefixgate` gives promptlint without torch, triton, transformers, litellm.

Fast checks here (the metadata, and what linting imports in a fresh interpreter); the real fresh-venv
install is tests/slow/test_light_install_venv.py.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib

from tests.promptlint.promptlint_paths import REPO

HEAVY = ("torch", "triton", "transformers", "litellm", "safetensors", "fastapi", "uvicorn", "matplotlib")


def _project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower()


def test_base_requirements_are_promptlint_only():
    base = {_name(r) for r in _project()["dependencies"]}
    assert base == {"tiktoken", "pyyaml", "pathspec", "jinja2"}
    assert not base & set(HEAVY)


def test_extras_add_the_rest_and_dev_pulls_everything():
    extras = _project()["optional-dependencies"]
    names = {k: {_name(r) for r in v} for k, v in extras.items()}
    assert {"torch", "triton", "transformers", "safetensors"} <= names["engine"]
    assert {"litellm", "fastapi", "uvicorn", "cryptography", "sqlite-utils"} <= names["gateway"]
    assert extras["all"] == ["prefixgate[gateway,engine,bench,fleet]"]
    assert "prefixgate[all]" in extras["dev"]


def test_linting_imports_nothing_heavy():
    """A fresh interpreter that lints the examples (every loader, rule and format) imports no heavy package."""
    code = (
        "import sys, io, contextlib\n"
        "from promptlint.cli import main\n"
        "for fmt in ('text', 'json', 'github', 'sarif', 'junit'):\n"
        "    with contextlib.redirect_stdout(io.StringIO()):\n"
        "        main(['check', 'examples/prompts', 'tests/promptlint/fixtures/source', '--format', fmt])\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.strip().splitlines()[-1].replace("'", '"')) == []


def test_import_time_of_the_cli_module_lists_no_heavy_module():
    res = subprocess.run([sys.executable, "-X", "importtime", "-c", "import promptlint.cli, promptlint.linter"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    imported = {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in res.stderr.splitlines() if "|" in line}
    assert not imported & set(HEAVY), imported & set(HEAVY)
