"""The rule registry: one module per rule, ``pcNNN_<name>.py``, discovered at import time.

A rule module defines ``CODE`` (stable, ``PC`` + 3 digits), ``NAME`` (the bad pattern, kebab-case),
``SEVERITY``, ``SUMMARY`` (one line), ``FIXABLE`` (``--fix`` can repair some findings), a module
docstring with What / Why / Example / Fix sections (``promptlint rule CODE`` prints it), and either
``check(doc, ctx) -> Iterable[Finding]`` (one file) or ``check_project(docs, ctx)`` (across files).
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, get_args

from promptlint.model import Finding, Severity


@dataclass(frozen=True)
class Rule:
    code: str
    name: str
    severity: Severity
    summary: str
    fixable: bool
    doc: str
    check: Callable[..., Iterable[Finding]] | None
    check_project: Callable[..., Iterable[Finding]] | None


@lru_cache(maxsize=1)
def all_rules() -> dict[str, Rule]:
    """Every rule by code, in code order."""
    rules: dict[str, Rule] = {}
    for mod_info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if not mod_info.name.startswith("pc"):
            continue
        mod: Any = importlib.import_module(f"{__name__}.{mod_info.name}")
        rule = Rule(
            code=mod.CODE,
            name=mod.NAME,
            severity=mod.SEVERITY,
            summary=mod.SUMMARY,
            fixable=mod.FIXABLE,
            doc=inspect.cleandoc(mod.__doc__ or ""),
            check=getattr(mod, "check", None),
            check_project=getattr(mod, "check_project", None),
        )
        assert rule.code not in rules, f"duplicate rule code {rule.code}"
        assert mod_info.name.startswith(rule.code.lower()), f"{mod_info.name} does not match {rule.code}"
        assert rule.severity in get_args(Severity), f"{rule.code}: unknown severity {rule.severity!r}"
        rules[rule.code] = rule
    return rules
