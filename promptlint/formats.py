"""Output formats: text (people), json (tools), github (workflow annotations), sarif 2.1.0, junit."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from typing import Any
from urllib.parse import quote

from promptlint import __version__
from promptlint.linter import Report
from promptlint.pricing import Savings
from promptlint.rules import all_rules

FORMATS = ("text", "json", "github", "sarif", "junit")
MAX_TABLE_ROWS = 50
_SARIF_LEVEL = {"error": "error", "warning": "warning", "info": "note"}
INFO_URI = "https://github.com/prefixgate/prefixgate/blob/main/docs/promptlint.md"


def render(report: Report, fmt: str, savings: Savings | None = None, fail_under: float | None = None) -> str:
    return {"text": _text, "json": _json, "github": _github, "sarif": _sarif, "junit": _junit}[fmt](
        report, savings, fail_under
    )


def _text(report: Report, savings: Savings | None, fail_under: float | None) -> str:
    rules = all_rules()
    out = []
    for f in report.findings:
        mark = " [*]" if f.fixable else ""
        out.append(f"{f.path}:{f.line}:{f.column}: {f.code} {rules[f.code].name}: {f.message}{mark}")
    if out:
        out.append("")
    scored = [(r, r.doc) for r in report.files if r.doc is not None]
    if scored:
        shown = scored
        if len(scored) > MAX_TABLE_ROWS:  # a big tree: the files most worth a look
            shown = sorted(scored, key=lambda rd: (rd[1].score, rd[0].path))[:MAX_TABLE_ROWS]
        names = {id(r): _row_name(r) for r, _ in shown}
        width = max(len(n) for n in names.values())
        out.append(f"{'file':<{width}}  score  prefix/total tokens")
        for r, d in shown:
            out.append(f"{names[id(r)]:<{width}}  {d.score:5.1f}  {d.prefix_tokens}/{d.total_tokens}")
        if len(shown) < len(scored):
            out.append(f"... the {len(shown)} lowest of {len(scored)} files (--format json lists all)")
        out.append("")
    findings = report.findings
    fixable = sum(f.fixable for f in findings)
    out.append(
        f"Score {report.score:.1f}/100 over {len(report.files)} file(s) "
        f"(share of expected prompt tokens that stay cacheable; {report.model}, {report.encoding})"
    )
    if savings is not None:
        out.append(
            f"At {savings.volume_per_day:g} requests/day per file: ${savings.saved_per_month:,.2f}/month saved "
            f"by caching now, ${savings.left_per_month:,.2f}/month left on the table ({savings.model} prices)"
        )
    if fail_under is not None and report.score < fail_under:
        out.append(f"Score {report.score:.1f} is below --fail-under {fail_under:g}")
    score_failed = fail_under is not None and report.score < fail_under
    if findings:
        info = sum(f.severity == "info" for f in findings)
        notes = [f"{fixable} fixable with --fix"] if fixable else []
        if info:
            notes.append(f"{info} info-level, which fail the run only when selected")
        out.append(f"Found {len(findings)} finding(s)" + (f" ({'; '.join(notes)})." if notes else "."))
    elif score_failed:
        out.append("No findings, but the score check failed.")
    else:
        out.append("All checks passed!")
    return "\n".join(out) + "\n"


def _row_name(r: Any) -> str:
    """A table row's name: the path, and for a Python file the line of the SDK call (one row per call)."""
    return f"{r.path}:{r.doc.body_line}" if r.doc is not None and r.doc.kind == "source" else r.path


def report_dict(report: Report, savings: Savings | None = None) -> dict[str, Any]:
    rules = all_rules()
    data: dict[str, Any] = {
        "version": __version__,
        "model": report.model,
        "encoding": report.encoding,
        "score": round(report.score, 2),
        "files": [
            {
                "path": r.path,
                "score": None if r.doc is None else round(r.doc.score, 2),
                "prefix_tokens": None if r.doc is None else r.doc.prefix_tokens,
                "static_tokens": None if r.doc is None else r.doc.static_tokens,
                "total_tokens": None if r.doc is None else r.doc.total_tokens,
                **({"call_line": r.doc.body_line} if r.doc is not None and r.doc.kind == "source" else {}),
            }
            for r in report.files
        ],
        "findings": [
            {
                "code": f.code,
                "name": rules[f.code].name,
                "severity": f.severity,
                "path": f.path,
                "line": f.line,
                "column": f.column,
                "message": f.message,
                "fixable": f.fixable,
            }
            for f in report.findings
        ],
    }
    if savings is not None:
        data["savings"] = {
            "model": savings.model,
            "volume_per_day": savings.volume_per_day,
            "input_price_per_token": savings.input_price,
            "cache_read_price_per_token": savings.cache_read_price,
            "saved_per_month_usd": round(savings.saved_per_month, 2),
            "left_per_month_usd": round(savings.left_per_month, 2),
        }
    return data


def _strict_json(data: dict[str, Any]) -> str:
    """JSON that every parser reads: a NaN or infinity (which ``json.dumps`` writes as the invalid
    ``NaN``/``Infinity`` by default) is an error here, never output. The flags are checked before."""
    try:
        return json.dumps(data, indent=2, allow_nan=False) + "\n"
    except ValueError as exc:
        raise ValueError(f"refusing to write invalid JSON: {exc}") from None


def _json(report: Report, savings: Savings | None, fail_under: float | None) -> str:
    return _strict_json(report_dict(report, savings))


def _escape_data(s: str) -> str:
    return s.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _escape_prop(s: str) -> str:
    return _escape_data(s).replace(":", "%3A").replace(",", "%2C")


def _github(report: Report, savings: Savings | None, fail_under: float | None) -> str:
    rules = all_rules()
    out = []
    for f in report.findings:
        level = {"error": "error", "warning": "warning", "info": "notice"}[f.severity]
        title = _escape_prop(f"{f.code} {rules[f.code].name}")
        out.append(
            f"::{level} file={_escape_prop(f.path)},line={f.line},col={f.column},title={title}::"
            f"{_escape_data(f.message)}"
        )
    if fail_under is not None and report.score < fail_under:
        out.append(f"::error title=promptlint score::Score {report.score:.1f} is below {fail_under:g}")
    return "\n".join(out) + ("\n" if out else "")


def sarif_dict(report: Report) -> dict[str, Any]:
    rules = list(all_rules().values())
    index = {r.code: i for i, r in enumerate(rules)}
    return {
        "$schema": "https://json.schemastore.org/sarif-2.1.0.json",
        "version": "2.1.0",
        "runs": [
            {
                "tool": {
                    "driver": {
                        "name": "promptlint",
                        "version": __version__,
                        "informationUri": INFO_URI,
                        "rules": [
                            {
                                "id": r.code,
                                "name": r.name,
                                "shortDescription": {"text": r.summary},
                                "fullDescription": {"text": r.doc.split("\n\n", 1)[-1].strip()},
                                "help": {"text": r.doc},
                                "helpUri": f"{INFO_URI}#{r.code.lower()}",
                                "defaultConfiguration": {"level": _SARIF_LEVEL[r.severity]},
                            }
                            for r in rules
                        ],
                    }
                },
                "columnKind": "unicodeCodePoints",
                "results": [
                    {
                        "ruleId": f.code,
                        "ruleIndex": index[f.code],
                        "level": _SARIF_LEVEL[f.severity],
                        "message": {"text": f.message},
                        "locations": [
                            {
                                "physicalLocation": {
                                    "artifactLocation": {"uri": _uri_reference(f.path)},
                                    "region": {"startLine": f.line, "startColumn": f.column},
                                }
                            }
                        ],
                    }
                    for f in report.findings
                ],
                "properties": {"score": round(report.score, 2), "model": report.model},
            }
        ],
    }


def _uri_reference(path: str) -> str:
    """A relative path as an RFC 3986 URI reference: a space or '#' in a file name would otherwise
    read as the end of the URI or a fragment. '/' stays a path separator."""
    return quote(path, safe="/")


def _sarif(report: Report, savings: Savings | None, fail_under: float | None) -> str:
    return _strict_json(sarif_dict(report))


# Characters XML 1.0 cannot hold, even escaped (C0 controls but tab/newline/CR, surrogates, U+FFFE/F).
_XML_ILLEGAL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def _xml_text(s: str) -> str:
    """``s`` with each character XML cannot carry written as a visible escape (``\\x0b``)."""
    return _XML_ILLEGAL.sub(lambda m: f"\\x{ord(m.group()):02x}", s)


def _junit(report: Report, savings: Savings | None, fail_under: float | None) -> str:
    rules = all_rules()
    suites = ET.Element("testsuites", name="promptlint", tests=str(len(report.files)),
                        failures=str(sum(1 for r in report.files if r.findings)))
    suite = ET.SubElement(suites, "testsuite", name="promptlint", tests=str(len(report.files)),
                          failures=str(sum(1 for r in report.files if r.findings)), errors="0")
    for r in report.files:
        # One case per linted unit: a file, or one SDK call of a Python file with that call's findings.
        case = ET.SubElement(suite, "testcase", classname="promptlint", name=_xml_text(_row_name(r)))
        mine = sorted(r.findings, key=lambda f: (f.line, f.column, f.code))
        if mine:
            fail = ET.SubElement(case, "failure", message=f"{len(mine)} finding(s)", type=mine[0].code)
            fail.text = _xml_text("\n".join(
                f"{f.path}:{f.line}:{f.column}: {f.code} {rules[f.code].name}: {f.message}" for f in mine
            ))
        if r.doc is not None:
            props = ET.SubElement(case, "properties")
            ET.SubElement(props, "property", name="score", value=f"{r.doc.score:.1f}")
    ET.indent(suites)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"
