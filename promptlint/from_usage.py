"""``promptlint check --from-usage FILE``: live cache breaks become findings on the templates behind them.

The PrefixGate gateway records every request that missed the cache after a near-hit (a *miss
record*, see ``docs/explain.md``); ``prefixgate report --format json`` exports them under
``"misses"``. This module reads that export (or a bare JSON list, or JSON lines, of miss records)
and attributes each record to a linted file:

1. by name: the record's ``template`` or ``family`` (the gateway's ``prompt_cache_key:<key>``
   counts as ``<key>``) equals a file's front-matter ``family``, its stem, or its name
   (``support-bot`` matches ``support-bot.txt``);
2. by text: the static text just before the break (``context``) is found in the file's static text;
   the finding points at the line where that text ends, i.e. where the changing value sits.

Records of one rule at one place are merged into one finding that says how many requests broke
there and the tokens and money they lost. Records whose rule is ``other`` (a plain prompt edit) or
that match no file are returned as unmatched, for the caller to mention.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass
from difflib import SequenceMatcher
from pathlib import Path
from typing import Any

from promptlint.errors import UsageError
from promptlint.linter import Report
from promptlint.model import Finding, PromptDoc
from promptlint.rules import all_rules

MIN_MATCH_CHARS = 8  # shorter shared text ("\n", "You ") says nothing about which template it was
# The matcher is quadratic in the worst case: only the text just before the break locates it anyway.
MAX_CONTEXT_CHARS = 2000
_MARKER_END = ">\n"  # promptlint.explain.render wraps each part as "<role>\n...text...\n"


@dataclass(frozen=True)
class Attribution:
    findings: list[Finding]
    unmatched: list[dict[str, Any]]


def load_misses(path: Path) -> list[dict[str, Any]]:
    """Miss records from a report export (``{"misses": [...]}``), a JSON list, or JSON lines.

    Raises:
        UsageError: the file cannot be read, is not JSON, or holds no miss records list.
    """
    if not path.is_file():  # a FIFO or a device would block or never end; a directory cannot be read
        raise UsageError(f"cannot read --from-usage file {path}: not a regular file")
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise UsageError(f"cannot read --from-usage file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise UsageError(f"--from-usage {path}: not UTF-8 text (byte {exc.start}); give a JSON report") from None
    try:
        data: Any = json.loads(text)
    except RecursionError:
        raise UsageError(f"--from-usage {path}: JSON nested too deeply to be a usage report") from None
    except json.JSONDecodeError:
        try:
            data = [json.loads(line) for line in text.splitlines() if line.strip()]
        except RecursionError:
            raise UsageError(f"--from-usage {path}: JSON nested too deeply to be a usage report") from None
        except json.JSONDecodeError as exc:
            raise UsageError(f"--from-usage {path}: not JSON or JSON lines ({exc.msg}, line {exc.lineno})") from None
    if isinstance(data, dict):
        if "misses" not in data:
            raise UsageError(f"--from-usage {path}: no 'misses' key; export it with `prefixgate report --format json`")
        data = data["misses"]
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise UsageError(f"--from-usage {path}: 'misses' must be a list of miss records (objects)")
    for i, r in enumerate(data):
        if not isinstance(r.get("rule"), str):
            raise UsageError(f"--from-usage {path}: miss record {i} has no 'rule' code")
    return data


def attribute(report: Report, misses: list[dict[str, Any]]) -> Attribution:
    """Findings for the records that match a linted file; the rest are unmatched."""
    docs = [r.doc for r in report.files if r.doc is not None]
    rules = all_rules()
    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = defaultdict(list)
    where: dict[tuple[str, int, str], PromptDoc] = {}
    unmatched = []
    for rec in misses:
        if rec["rule"] not in rules:
            unmatched.append(rec)
            continue
        hit = _match(docs, rec)
        if hit is None:
            unmatched.append(rec)
            continue
        doc, line = hit
        key = (doc.display, line, rec["rule"])
        groups[key].append(rec)
        where[key] = doc
    findings = []
    for (display, line, code), recs in sorted(groups.items()):
        rule = rules[code]
        tokens = int(sum(_amount(r.get("tokens_lost")) for r in recs))
        usd = sum(_amount(r.get("usd_lost")) for r in recs)
        details = ", ".join(sorted({str(r.get("detail") or "") for r in recs} - {""}))
        money = f", ${usd:,.4f}" if usd else ""
        findings.append(Finding(
            code, display, line, 1,
            f"live traffic: {len(recs)} request(s) lost the cache here ({details or rule.name}; {tokens:,} tokens"
            f"{money} re-prefilled). {recs[0].get('message') or rule.summary}",
            rule.severity,
        ))
    return Attribution(findings, unmatched)


def _amount(value: Any) -> float:
    """A finite non-negative number from a record field; anything else (text, lists, NaN, 1e400) counts 0."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0.0
    number = float(value) if abs(value) < 1e300 else 0.0  # int(1e999-ish) would overflow float()
    return number if math.isfinite(number) and number > 0 else 0.0


def _match(docs: list[PromptDoc], rec: dict[str, Any]) -> tuple[PromptDoc, int] | None:
    names = {str(rec[k]) for k in ("template", "family") if rec.get(k)}
    # The gateway names a family "prompt_cache_key:<key>" when the client sent one: send the template's
    # family name as prompt_cache_key and attribution is exact.
    names |= {n.split(":", 1)[1] for n in names if n.startswith("prompt_cache_key:")}
    named = [d for d in docs if names & {str(d.meta.get("family") or ""), d.path.stem, d.path.name}]
    piece = _context_piece(str(rec.get("context") or ""))
    best: tuple[int, PromptDoc, int] | None = None
    for doc in named or docs:
        found = _find_in(doc, piece)
        if found is not None and (best is None or found[0] > best[0]):
            best = (found[0], doc, found[1])
    if best is not None:
        return best[1], best[2]
    if len(named) == 1:  # named, but the text around the break is not in it: point at its first value
        doc = named[0]
        first = doc.first_dynamic
        return doc, doc.elements[first].line if first is not None else doc.body_line
    return None


def _context_piece(context: str) -> str:
    """The text of the broken part before the break (drop render markers of earlier parts)."""
    cut = context.rfind(_MARKER_END)
    piece = context[cut + len(_MARKER_END):] if cut >= 0 else context
    return piece[-MAX_CONTEXT_CHARS:]


def _find_in(doc: PromptDoc, piece: str) -> tuple[int, int] | None:
    """(match length, line where the match ends) of the longest part of ``piece`` in doc's static text."""
    if len(piece) < MIN_MATCH_CHARS:
        return None
    best: tuple[int, int] | None = None
    for e in doc.elements:
        if e.dyn is not None or e.is_tools or len(e.text) < MIN_MATCH_CHARS:
            continue
        m = SequenceMatcher(None, piece, e.text, autojunk=False).find_longest_match(0, len(piece), 0, len(e.text))
        if m.size >= MIN_MATCH_CHARS and (best is None or m.size > best[0]):
            end = m.b + m.size
            # The break follows the matched text; a match ending a line means the value starts the next.
            line = e.line + e.text.count("\n", 0, end) + (1 if e.text[end - 1 : end] == "\n" else 0)
            if doc.kind == "request":
                line = e.line  # a JSON string sits on one physical line
            best = (m.size, line)
    return best
