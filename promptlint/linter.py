"""Linting a set of paths: load, measure, run the rules, apply suppressions, score.

Suppressions, most local first:
- inline ``promptlint: noqa`` / ``promptlint: noqa[PC002,PC003]`` anywhere on the finding's line
  (put it in a comment your renderer strips: ``{# ... #}``, ``<!-- -->``, YAML ``#``);
- file-level ``promptlint: noqa-file`` / ``promptlint: noqa-file[PC008]`` on any line;
- ``per-file-ignores``, ``ignore`` and ``select`` in the config.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from promptlint.analysis import LintContext, measure
from promptlint.config import Config
from promptlint.errors import UsageError
from promptlint.fixability import rewrite_refusal
from promptlint.loader import discover, load
from promptlint.model import Finding, PromptDoc
from promptlint.rules import all_rules

_NOQA = re.compile(r"promptlint:\s*noqa(?P<file>-file)?(?:\[(?P<codes>[A-Z0-9,\s]*)\])?")


@dataclass
class FileResult:
    path: str
    doc: PromptDoc | None  # None when the file could not be loaded (a PC000 finding)
    findings: list[Finding] = field(default_factory=list)

    @property
    def score(self) -> float | None:
        return None if self.doc is None else self.doc.score


@dataclass
class Report:
    files: list[FileResult]
    model: str
    encoding: str

    @property
    def findings(self) -> list[Finding]:
        return sorted((f for r in self.files for f in r.findings), key=lambda f: (f.path, f.line, f.column, f.code))

    @property
    def score(self) -> float:
        """Overall score: token-weighted over files, so a long template counts for more."""
        docs = [r.doc for r in self.files if r.doc is not None]
        total = sum(d.total_tokens for d in docs)
        return 100.0 if total == 0 else 100.0 * sum(d.prefix_tokens for d in docs) / total


def _suppressions(raw: str) -> tuple[dict[int, set[str] | None], set[str] | None, bool]:
    """(line -> codes or None for all, file-level codes, whole file suppressed)."""
    per_line: dict[int, set[str] | None] = {}
    file_codes: set[str] = set()
    whole_file = False
    if "promptlint:" not in raw:
        return per_line, file_codes, whole_file
    for n, line in enumerate(raw.split("\n"), start=1):
        for m in _NOQA.finditer(line):
            codes = {c.strip() for c in m.group("codes").split(",") if c.strip()} if m.group("codes") else None
            if m.group("file"):
                if codes is None:
                    whole_file = True
                else:
                    file_codes |= codes
            elif codes is None or per_line.get(n, set()) is None:
                per_line[n] = None
            else:
                per_line[n] = per_line.get(n, set()) | codes  # type: ignore[operator]
    return per_line, file_codes, whole_file


def _keep(f: Finding, raw: str | None, path: Path, config: Config, cache: dict) -> bool:
    if not config.enabled(f.code) or config.ignored_in_file(f.code, path):
        return False
    if raw is None:
        return True
    if path not in cache:
        cache[path] = _suppressions(raw)
    per_line, file_codes, whole_file = cache[path]
    if whole_file or f.code in file_codes:
        return False
    if f.line in per_line:
        codes = per_line[f.line]
        return codes is not None and f.code not in codes
    return True


def attach_findings(report: Report, findings: list[Finding], config: Config) -> None:
    """Attach findings made after linting (``--from-usage``) to the files they name, through the same
    filter as the rules' own: select/ignore, per-file-ignores and ``noqa`` comments."""
    by_path: dict[str, FileResult] = {}
    for r in report.files:
        by_path.setdefault(r.path, r)
    cache: dict = {}
    for f in findings:
        res = by_path[f.path]
        raw = res.doc.raw if res.doc is not None else None
        path = res.doc.path if res.doc is not None else Path(res.path)
        if _keep(f, raw, path, config, cache):
            res.findings.append(f)


def declared_model(doc: PromptDoc) -> str | None:
    """The model a file names for itself: a request's ``"model"``, or a template's front-matter ``model``."""
    value = (doc.body or {}).get("model") if doc.kind == "request" else doc.meta.get("model")
    return value.strip() if isinstance(value, str) and 0 < len(value.strip()) <= 200 else None


def _context_for(doc: PromptDoc, default: LintContext, cli_model: str | None,
                 contexts: dict[str, LintContext]) -> LintContext:
    """A file that declares its model is measured against that model (tokenizer, cache minimum), so
    PC007 names the model the request will really go to; ``--model`` on the command line still wins."""
    model = declared_model(doc) if cli_model is None else None
    if model is None:
        return default
    if model not in contexts:
        contexts[model] = LintContext.for_model(model)
    return contexts[model]


def lint(paths: list[Path], config: Config, model: str | None = None, skip_non_prompts: bool = False) -> Report:
    """Lint files and directories. Raises UsageError if a named path does not exist.

    ``skip_non_prompts``: treat named data files like walked ones (a non-prompt is skipped, not PC000).
    """
    ctx = LintContext.for_model(model or config.model)
    results: list[FileResult] = []
    try:
        found = list(discover(paths))
    except FileNotFoundError as exc:
        raise UsageError(f"no such file or directory: {exc}") from None
    rules = [r for r in all_rules().values() if config.enabled(r.code)]
    docs: list[PromptDoc] = []
    contexts: dict[str, LintContext] = {ctx.model: ctx}
    for path, named in found:
        if not named and config.excluded(path):
            continue
        loaded = load(path, named and not skip_non_prompts)
        if loaded is None:
            continue
        if isinstance(loaded, Finding):
            results.append(FileResult(loaded.path, None, [loaded]))
            continue
        for doc in loaded if isinstance(loaded, list) else [loaded]:  # a .py file: one doc per SDK call
            doc_ctx = _context_for(doc, ctx, model, contexts)
            measure(doc, doc_ctx)
            docs.append(doc)
            findings = [f for r in rules if r.check is not None for f in r.check(doc, doc_ctx)]
            results.append(FileResult(doc.display, doc, findings))
    by_path = {r.path: r for r in results}
    for r in rules:
        if r.check_project is not None:
            for f in r.check_project(docs, ctx):
                by_path[f.path].findings.append(f)
    cache: dict = {}
    for res in results:
        raw = res.doc.raw if res.doc is not None else None
        path = res.doc.path if res.doc is not None else Path(res.path)
        res.findings = [f for f in res.findings if _keep(f, raw, path, config, cache)]
        if res.doc is not None and rewrite_refusal(res.doc):
            # The rule has a fix for this kind of finding, but --fix never rewrites this file.
            res.findings = [replace(f, fixable=False) for f in res.findings]
    results.sort(key=lambda r: (r.path, r.doc.body_line if r.doc is not None else 0))
    return Report(results, ctx.model, ctx.counter.encoding)

