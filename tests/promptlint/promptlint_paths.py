"""Paths the promptlint tests share (a module, not conftest, so tests can import it by name)."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parent / "fixtures"
GOLDEN = Path(__file__).resolve().parent / "golden"
EXAMPLES = REPO / "examples" / "prompts"
