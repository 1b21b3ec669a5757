"""``[tool.promptlint]`` in pyproject.toml: which rules run, where, and the bar to pass.

    [tool.promptlint]
    model = "gpt-4o"                 # tokenizer, cache minimum and prices
    select = ["PC"]                  # codes or prefixes; default: all
    ignore = ["PC008"]
    exclude = ["prompts/README.md"]  # skipped when walking directories
    fail-under = 80                  # exit 1 when the overall score is lower
    [tool.promptlint.per-file-ignores]
    "prompts/legacy/**" = ["PC001", "PC002"]

The file is found by walking up from the working directory (like ruff); ``--config`` names one.
Any unknown key, unknown code or wrong type is a usage error (exit 2), never silently ignored.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path

import pathspec

from promptlint.errors import UsageError
from promptlint.rules import all_rules
from promptlint.tokens import DEFAULT_MODEL

_KEYS = {"select", "ignore", "per-file-ignores", "fail-under", "model", "exclude"}


@dataclass(frozen=True)
class Config:
    select: tuple[str, ...] = ()  # empty: every rule
    ignore: tuple[str, ...] = ()
    per_file_ignores: tuple[tuple[str, tuple[str, ...]], ...] = ()
    fail_under: float | None = None
    model: str = DEFAULT_MODEL
    exclude: tuple[str, ...] = ()  # gitignore-style patterns: files skipped when walking directories
    root: Path = field(default_factory=Path.cwd)  # per-file-ignores patterns are relative to it

    def enabled(self, code: str) -> bool:
        selected = not self.select or any(code.startswith(p) for p in self.select)
        return selected and not any(code.startswith(p) for p in self.ignore)

    def fails(self, code: str, severity: str) -> bool:
        """Whether a finding makes the run exit 1.

        Like ruff's default rule set: errors and warnings fail; ``info`` findings (style the gateway's
        ``safe`` canonicalization already neutralizes, such as PC009 whitespace, or advice such as
        PC008) are reported but fail only when ``select`` names them (a code, or a prefix like "PC").
        """
        return severity != "info" or any(code.startswith(p) for p in self.select)

    def _relative(self, path: Path) -> str:
        # abspath, not Path.absolute(): it collapses "..", so "../prompts/x" from a subdirectory
        # is "prompts/x" below the root and the patterns match (without following symlinks).
        try:
            return Path(os.path.abspath(path)).relative_to(os.path.abspath(self.root)).as_posix()
        except ValueError:
            return path.as_posix()

    def excluded(self, path: Path) -> bool:
        rel = self._relative(path) if self.exclude else ""
        return any(_spec(p).match_file(rel) for p in self.exclude)

    def ignored_in_file(self, code: str, path: Path) -> bool:
        if not self.per_file_ignores:
            return False
        rel = self._relative(path)
        for pattern, codes in self.per_file_ignores:
            if any(code.startswith(c) for c in codes) and _spec(pattern).match_file(rel):
                return True
        return False


@lru_cache(maxsize=256)
def _spec(pattern: str) -> pathspec.PathSpec:
    return pathspec.GitIgnoreSpec.from_lines([pattern])


def find_pyproject(start: Path) -> Path | None:
    """The nearest pyproject.toml at or above ``start`` that has a [tool.promptlint] table."""
    for d in [start, *start.parents]:
        candidate = d / "pyproject.toml"
        if candidate.is_file():
            try:
                data = tomllib.loads(candidate.read_text(encoding="utf-8"))
            except OSError:
                continue
            except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
                # Like ruff: a broken pyproject.toml on the way up is an error, not silently skipped.
                raise UsageError(f"invalid TOML in {candidate}: {exc}") from None
            if "promptlint" in data.get("tool", {}):
                return candidate
    return None


def _codes(value: object, key: str) -> tuple[str, ...]:
    where = key if key.startswith("--") else f"[tool.promptlint] {key}"
    if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
        raise UsageError(f"{where} must be a list of rule codes")
    known = all_rules()
    for c in value:
        if not c.startswith("PC") or not any(k.startswith(c) for k in known):
            raise UsageError(f"{where}: unknown rule code {c!r} (see `promptlint rules`)")
    return tuple(value)


def load_config(path: Path | None = None, start: Path | None = None) -> Config:
    """Read the config from ``path``, else the nearest pyproject.toml; defaults if there is none.

    Raises:
        UsageError: the file cannot be read or parsed, or holds an unknown key, code or bad value.
    """
    if path is None:
        path = find_pyproject(start or Path.cwd())
        if path is None:
            return Config()
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise UsageError(f"cannot read config {path}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"invalid TOML in {path}: {exc}") from None
    table = data.get("tool", {}).get("promptlint", {})
    if not isinstance(table, dict):
        raise UsageError(f"{path}: [tool.promptlint] must be a table")
    table = {k.replace("_", "-"): v for k, v in table.items()}
    unknown = sorted(set(table) - _KEYS)
    if unknown:
        raise UsageError(f"{path}: unknown [tool.promptlint] key {unknown[0]!r}; known: {', '.join(sorted(_KEYS))}")
    fail_under = table.get("fail-under")
    if fail_under is not None and (isinstance(fail_under, bool) or not isinstance(fail_under, int | float)
                                   or not 0 <= fail_under <= 100):
        raise UsageError(f"{path}: [tool.promptlint] fail-under must be a number from 0 to 100")
    model = table.get("model", DEFAULT_MODEL)
    if not isinstance(model, str) or not model:
        raise UsageError(f"{path}: [tool.promptlint] model must be a model name string")
    exclude = table.get("exclude", [])
    if not isinstance(exclude, list) or not all(isinstance(p, str) for p in exclude):
        raise UsageError(f"{path}: [tool.promptlint] exclude must be a list of glob patterns")
    pfi = table.get("per-file-ignores", {})
    if not isinstance(pfi, dict):
        raise UsageError(f"{path}: [tool.promptlint] per-file-ignores must be a table of glob = [codes]")
    return Config(
        select=_codes(table.get("select", []), "select"),
        ignore=_codes(table.get("ignore", []), "ignore"),
        per_file_ignores=tuple((str(k), _codes(v, f"per-file-ignores.{k!r}")) for k, v in pfi.items()),
        fail_under=None if fail_under is None else float(fail_under),
        model=model,
        exclude=tuple(exclude),
        root=path.parent,
    )


def with_cli_codes(config: Config, select: str | None, ignore: str | None) -> Config:
    """``--select`` replaces the config's select, ``--ignore`` adds to its ignore (ruff's behaviour)."""
    def split(value: str, flag: str) -> tuple[str, ...]:
        codes = [c.strip().upper() for c in value.split(",") if c.strip()]
        return _codes(codes, flag)

    if select is not None:
        config = replace(config, select=split(select, "--select"))
    if ignore is not None:
        config = replace(config, ignore=config.ignore + split(ignore, "--ignore"))
    return config
