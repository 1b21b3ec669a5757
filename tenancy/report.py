"""Usage reports from the ledger: per tenant and model, as a table, CSV, JSON or one HTML file.

JSON shape (``schema: "prefixgate.report/v1"``; fields are only ever added, never renamed)::

    {
      "schema": "prefixgate.report/v1",
      "generated_at": ISO-8601 UTC, "since": ISO-8601 | null, "until": ISO-8601,
      "tenant_ids": [str] | null,            # the filter; null = all tenants
      "rows":    [Row],                      # one per (tenant, model), sorted by tenant then model
      "tenants": [Row without "model"],      # one per tenant
      "totals":  Row without tenant/model,
      "bucket_s": 3600 | 86400,              # timeline granularity (hour when the span <= 2 days)
      "timeline": [{"bucket_start": ISO, "tenant_id", "tenant", "requests", "prompt_tokens",
                    "cached_tokens", "hit_rate", "cost_usd", "saved_usd"}],
      "misses": [Miss],                      # explained cache breaks, newest first (at most MAX_MISSES)
      "breaks": [Break]                      # per tenant and rule, most tokens lost first
    }

    Miss = {"request_id", "tenant_id", "tenant", "model", "created_at": ISO, "rule", "detail",
            "position" (token), "family", "context" (text before the break), "tokens_lost", "usd_lost"}
    Break = {"tenant_id", "tenant", "rule", "requests", "tokens_lost", "usd_lost"}

    Row = {"tenant_id", "tenant", "model", "requests", "ok", "errors", "aborted",
           "prompt_tokens", "cached_tokens", "completion_tokens",
           "cache_creation_tokens",  # prompt tokens written to a prompt cache (priced as cache writes)
           "hit_rate",           # cached_tokens / prompt_tokens (0 when no prompt tokens)
           "request_hit_rate",   # share of requests with cached_tokens > 0
           "cost_usd", "saved_usd", "ttft_p50_s", "ttft_p95_s",   # p50/p95: null when no TTFT
           "priced_as"}          # rows only: the cost-map entry used (the reference model for local ones)

"Reused tokens" are ``cached_tokens``: prompt tokens served from the prefix cache instead of being
recomputed. TTFT percentiles use linear interpolation between closest ranks (numpy's default).
A deleted tenant's rows are kept and shown with tenant name ``deleted:<tenant_id>``.
"""

from __future__ import annotations

import csv
import html
import io
import json
import math
import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, TypedDict

from tenancy.database import Database
from tenancy.pricing import UNPRICED

SCHEMA = "prefixgate.report/v1"
_SINCE_RE = re.compile(r"^(\d+)\s*([smhdw])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_since(value: str, now: datetime | None = None) -> datetime:
    """``7d``, ``24h``, ``30m``, ``2w``, ``90s`` (ago) or an ISO date/time (UTC if no zone). Raises ValueError."""
    now = now or datetime.now(UTC)
    m = _SINCE_RE.match(value.strip())
    if m:
        try:
            return now - timedelta(seconds=int(m.group(1)) * _UNITS[m.group(2)])
        except (OverflowError, ValueError):  # before year 1: a clear error, not a traceback
            raise ValueError(f"--since is too far in the past: {value!r}") from None
    try:
        dt = datetime.fromisoformat(value.strip())
    except ValueError:
        raise ValueError(f"--since must look like 7d, 24h, 30m or an ISO date (2026-01-31), got {value!r}") from None
    return dt if dt.tzinfo else dt.replace(tzinfo=UTC)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (``q`` in [0, 100]) of ``values``; None when empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


class _Acc:
    __slots__ = ("requests", "ok", "errors", "aborted", "prompt", "cached", "completion", "hit_requests",
                 "cost", "saved", "ttfts", "priced_as", "priced", "written")

    def __init__(self) -> None:
        self.requests = self.ok = self.errors = self.aborted = 0
        self.prompt = self.cached = self.completion = self.hit_requests = self.written = 0
        self.cost = self.saved = 0.0
        self.ttfts: list[float] = []
        self.priced_as: set[str] = set()
        self.priced = 0  # rows with a price (not "unpriced"): none -> the group has no cost at all

    def add(self, r: dict[str, Any]) -> None:
        self.requests += 1
        self.ok += r["status"] == "ok"
        self.errors += r["status"] == "error"
        self.aborted += r["status"] == "aborted"
        self.prompt += r["prompt_tokens"]
        self.cached += r["cached_tokens"]
        self.completion += r["completion_tokens"]
        self.written += r.get("cache_creation_tokens") or 0
        self.hit_requests += r["cached_tokens"] > 0
        self.cost += r["cost_usd"]
        self.saved += r["saved_usd"]
        if r["ttft_s"] is not None:
            self.ttfts.append(r["ttft_s"])
        self.priced_as.add(r["priced_as"])
        self.priced += r["priced_as"] != UNPRICED

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests, "ok": self.ok, "errors": self.errors, "aborted": self.aborted,
            "prompt_tokens": self.prompt, "cached_tokens": self.cached, "completion_tokens": self.completion,
            "cache_creation_tokens": self.written,
            "hit_rate": self.cached / self.prompt if self.prompt else 0.0,
            "request_hit_rate": self.hit_requests / self.requests if self.requests else 0.0,
            # Only unpriced rows (a self-hosted route priced "unpriced"): tokens, and no money (null).
            "cost_usd": self.cost if self.priced else None, "saved_usd": self.saved if self.priced else None,
            "ttft_p50_s": percentile(self.ttfts, 50), "ttft_p95_s": percentile(self.ttfts, 95),
        }


_FIRST_TS = datetime(1, 1, 1, tzinfo=UTC).timestamp()
_LAST_TS = datetime(9999, 12, 31, 23, 59, 59, tzinfo=UTC).timestamp()


def _iso(ts: float) -> str:
    # Clamped to what datetime can show: a bound like 0001-01-01T00:00:00+14:00 is before year 1 in
    # UTC, and one odd stored time must not make every report of its tenant fail.
    clamped = min(max(ts, _FIRST_TS), _LAST_TS) if ts == ts else _FIRST_TS
    return datetime.fromtimestamp(clamped, UTC).isoformat().replace("+00:00", "Z")


def fetch_rows(db: Database, *, tenant_ids: list[str] | None, since: datetime | None, until: datetime) -> list[dict]:
    sql = (
        "SELECT u.*, COALESCE(t.name, 'deleted:' || u.tenant_id) AS tenant "
        "FROM usage u LEFT JOIN tenants t ON t.id = u.tenant_id WHERE u.created_at < ?"
    )
    params: list[Any] = [until.timestamp()]
    if since is not None:
        sql += " AND u.created_at >= ?"
        params.append(since.timestamp())
    if tenant_ids is not None:
        sql += f" AND u.tenant_id IN ({', '.join('?' for _ in tenant_ids)})"
        params.extend(tenant_ids)
    return list(db.query(sql + " ORDER BY u.created_at", params))


def aggregate(
    rows: Iterable[dict[str, Any]], *, tenant_ids: list[str] | None, since: datetime | None, until: datetime
) -> dict[str, Any]:
    """The report dict (module docstring) from ledger rows that carry a ``tenant`` name column."""
    rows = list(rows)
    by_model: dict[tuple[str, str, str], _Acc] = defaultdict(_Acc)
    by_tenant: dict[tuple[str, str], _Acc] = defaultdict(_Acc)
    total = _Acc()
    span = (rows[-1]["created_at"] - rows[0]["created_at"]) if rows else 0.0
    bucket_s = 3600 if span <= 2 * 86400 else 86400
    timeline: dict[tuple[int, str, str], _Acc] = defaultdict(_Acc)
    for r in rows:
        by_model[(r["tenant"], r["tenant_id"], r["model"])].add(r)
        by_tenant[(r["tenant"], r["tenant_id"])].add(r)
        total.add(r)
        timeline[(int(r["created_at"] // bucket_s) * bucket_s, r["tenant"], r["tenant_id"])].add(r)
    return {
        "schema": SCHEMA,
        "generated_at": _iso(datetime.now(UTC).timestamp()),
        "since": _iso(since.timestamp()) if since else None,
        "until": _iso(until.timestamp()),
        "tenant_ids": tenant_ids,
        "rows": [{"tenant_id": tid, "tenant": name, "model": model, **acc.as_dict(),
                  "priced_as": ",".join(sorted(acc.priced_as))}
                 for (name, tid, model), acc in sorted(by_model.items())],
        "tenants": [{"tenant_id": tid, "tenant": name, **acc.as_dict()} for (name, tid), acc in sorted(by_tenant.items())],
        "totals": total.as_dict(),
        "bucket_s": bucket_s,
        "timeline": [
            {"bucket_start": _iso(b), "tenant_id": tid, "tenant": name,
             **{k: v for k, v in acc.as_dict().items()
                if k in ("requests", "prompt_tokens", "cached_tokens", "hit_rate", "cost_usd", "saved_usd")}}
            for (b, name, tid), acc in sorted(timeline.items())
        ],
        **_breaks(rows),
    }


MAX_MISSES = 1000  # the export stays small; `breaks` counts every miss of the period


class Break(TypedDict):
    """One entry of the report's ``breaks``: a tenant's cache misses under one rule."""

    tenant_id: str
    tenant: str
    rule: str
    requests: int
    tokens_lost: int
    usd_lost: float


def _breaks(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``misses`` and ``breaks`` parts of the report, from rows that carry a ``miss_rule``."""
    missed = [r for r in rows if r.get("miss_rule")]
    by_rule: dict[tuple[str, str, str], list[float]] = defaultdict(lambda: [0, 0, 0.0])
    for r in missed:
        acc = by_rule[(r["tenant"], r["tenant_id"], r["miss_rule"])]
        acc[0] += 1
        acc[1] += r.get("miss_tokens") or 0
        acc[2] += r.get("miss_usd") or 0.0
    breaks: list[Break] = [
        {"tenant_id": tid, "tenant": name, "rule": rule, "requests": int(n), "tokens_lost": int(tok),
         "usd_lost": usd}
        for (name, tid, rule), (n, tok, usd) in by_rule.items()
    ]
    breaks.sort(key=lambda b: (-b["tokens_lost"], -b["requests"], b["tenant"], b["rule"]))
    misses = [
        {"request_id": r["request_id"], "tenant_id": r["tenant_id"], "tenant": r["tenant"], "model": r["model"],
         "created_at": _iso(r["created_at"]), "rule": r["miss_rule"], "detail": r.get("miss_detail"),
         "position": r.get("miss_position"), "family": r.get("miss_family"), "context": r.get("miss_context"),
         "tokens_lost": r.get("miss_tokens") or 0, "usd_lost": r.get("miss_usd") or 0.0}
        for r in reversed(missed[-MAX_MISSES:])
    ]
    return {"misses": misses, "breaks": breaks}


def build_report(
    db: Database, *, tenant_ids: list[str] | None = None, since: datetime | None = None, until: datetime | None = None
) -> dict[str, Any]:
    until = until or datetime.now(UTC) + timedelta(seconds=1)
    rows = fetch_rows(db, tenant_ids=tenant_ids, since=since, until=until)
    return aggregate(rows, tenant_ids=tenant_ids, since=since, until=until)


# -- renderers -----------------------------------------------------------------------------------

_COLUMNS: tuple[tuple[str, str], ...] = (
    ("tenant", "tenant"), ("model", "model"), ("requests", "requests"), ("prompt_tokens", "prompt tok"),
    ("cached_tokens", "cached (reused) tok"), ("cache_creation_tokens", "cache write tok"), ("hit_rate", "hit rate"), ("cost_usd", "cost $"),
    ("saved_usd", "saved $"), ("ttft_p50_s", "TTFT p50 s"), ("ttft_p95_s", "TTFT p95 s"), ("priced_as", "priced as"),
)


def _fmt(key: str, v: Any) -> str:
    if v is None:
        return "-"
    if key in ("hit_rate", "request_hit_rate"):
        return f"{100 * v:.1f}%"
    if key in ("cost_usd", "saved_usd"):
        return f"{v:.6f}"
    if key.startswith("ttft"):
        return f"{v:.3f}"
    return str(v)


def render_table(rep: dict[str, Any]) -> str:
    rows = [[_fmt(k, r.get(k)) for k, _ in _COLUMNS] for r in rep["rows"]]
    rows.append([_fmt(k, rep["totals"].get(k)) if k not in ("tenant", "model") else ("TOTAL" if k == "tenant" else "")
                 for k, _ in _COLUMNS])
    head = [h for _, h in _COLUMNS]
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    numeric = [2 <= i < len(head) - 1 for i in range(len(head))]  # names and "priced as" are text

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(cells, widths, numeric)).rstrip()

    since = rep["since"] or "the beginning"
    out = [f"Usage from {since} to {rep['until']}", line(head), line(["-" * w for w in widths])]
    out += [line(r) for r in rows[:-1]]
    out += [line(["-" * w for w in widths]), line(rows[-1])]
    out += _breaks_table(rep.get("breaks") or [])
    return "\n".join(out) + "\n"


def _breaks_table(breaks: list[dict[str, Any]], top: int = 10) -> list[str]:
    """"Top cache-break reasons": what broke the prefix (promptlint rule codes), and what it cost."""
    if not breaks:
        return []
    head = ["tenant", "rule", "requests", "tokens lost", "$ lost"]
    rows = [[b["tenant"], b["rule"], str(b["requests"]), str(b["tokens_lost"]), f"{b['usd_lost']:.6f}"]
            for b in breaks[:top]]
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if i >= 2 else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    out = ["", "Top cache-break reasons (`promptlint rule CODE` explains each; "
           "`promptlint check --from-usage` finds the template line)", line(head), line(["-" * w for w in widths])]
    return out + [line(r) for r in rows]


CSV_FIELDS: tuple[str, ...] = (
    "tenant_id", "tenant", "model", "requests", "ok", "errors", "aborted", "prompt_tokens", "cached_tokens",
    "completion_tokens", "hit_rate", "request_hit_rate", "cost_usd", "saved_usd", "ttft_p50_s", "ttft_p95_s",
    "priced_as", "cache_creation_tokens",  # appended: existing columns keep their positions
)


def _csv_cell(value: Any) -> Any:
    # A client names the model: "=HYPERLINK(...)" must stay text in a spreadsheet, not run as a formula.
    if isinstance(value, str) and value[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + value
    return value


def render_csv(rep: dict[str, Any]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rep["rows"]:
        w.writerow({k: _csv_cell(v) for k, v in r.items()})
    return buf.getvalue()


def render_json(rep: dict[str, Any]) -> str:
    return json.dumps(rep, indent=2, sort_keys=False) + "\n"


# -- HTML: one self-contained file, inline SVG, no script, no network -----------------------------

_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf")
_W, _H, _PAD_L, _PAD_R, _PAD_T, _PAD_B = 720, 260, 56, 150, 16, 40


def _svg_hit_rate(rep: dict[str, Any]) -> str:
    series: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for p in rep["timeline"]:
        ts = datetime.fromisoformat(p["bucket_start"].replace("Z", "+00:00")).timestamp()
        series[p["tenant"]].append((ts, p["hit_rate"]))
    if not series:
        return "<p class=empty>No requests in this period.</p>"
    xs = [x for pts in series.values() for x, _ in pts]
    x0, x1 = min(xs), max(xs)
    x1 = x1 if x1 > x0 else x0 + rep["bucket_s"]
    pw, ph = _W - _PAD_L - _PAD_R, _H - _PAD_T - _PAD_B

    def sx(x: float) -> float:
        return _PAD_L + (x - x0) / (x1 - x0) * pw

    def sy(y: float) -> float:
        return _PAD_T + (1 - y) * ph

    parts = [f'<svg role="img" aria-label="Cache hit rate over time" '
             f'viewBox="0 0 {_W} {_H}" width="{_W}" height="{_H}" id="chart-hit-rate">']
    for frac in (0, 0.25, 0.5, 0.75, 1.0):
        y = sy(frac)
        parts.append(f'<line x1="{_PAD_L}" x2="{_PAD_L + pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="#ddd"/>'
                     f'<text x="{_PAD_L - 6}" y="{y + 4:.1f}" text-anchor="end">{int(frac * 100)}%</text>')
    fmt = "%m-%d %H:%M" if rep["bucket_s"] < 86400 else "%Y-%m-%d"
    for x, anchor in ((x0, "start"), (x1, "end")):
        label = datetime.fromtimestamp(x, UTC).strftime(fmt)
        parts.append(f'<text x="{sx(x):.1f}" y="{_H - 12}" text-anchor="{anchor}">{label} UTC</text>')
    for i, (name, pts) in enumerate(sorted(series.items())):
        color = _PALETTE[i % len(_PALETTE)]
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{coords}"/>')
        for x, y in pts:
            parts.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{color}">'
                         f'<title>{html.escape(name)}: {100 * y:.1f}%</title></circle>')
        ly = _PAD_T + 14 + 18 * i
        parts.append(f'<rect x="{_W - _PAD_R + 12}" y="{ly - 9}" width="10" height="10" fill="{color}"/>'
                     f'<text x="{_W - _PAD_R + 26}" y="{ly}">{html.escape(name[:20])}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _svg_cost_saved(rep: dict[str, Any]) -> str:
    tenants = rep["tenants"]
    if not tenants:
        return "<p class=empty>No requests in this period.</p>"
    top = max(max(t["cost_usd"] or 0.0, t["saved_usd"] or 0.0) for t in tenants) or 1.0
    pw, ph = _W - _PAD_L - _PAD_R, _H - _PAD_T - _PAD_B
    group = pw / len(tenants)
    bar = min(40.0, group / 3)
    parts = [f'<svg role="img" aria-label="Cost against saved per tenant" '
             f'viewBox="0 0 {_W} {_H}" width="{_W}" height="{_H}" id="chart-cost-saved">']
    for frac in (0, 0.5, 1.0):
        y = _PAD_T + (1 - frac) * ph
        parts.append(f'<line x1="{_PAD_L}" x2="{_PAD_L + pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="#ddd"/>'
                     f'<text x="{_PAD_L - 6}" y="{y + 4:.1f}" text-anchor="end">${top * frac:.2g}</text>')
    for i, t in enumerate(tenants):
        gx = _PAD_L + i * group + group / 2
        for j, (key, color) in enumerate((("cost_usd", "#d62728"), ("saved_usd", "#2ca02c"))):
            if t[key] is None:  # an unpriced tenant: tokens only, no bar
                continue
            h = t[key] / top * ph
            x = gx - bar + j * bar
            parts.append(f'<rect x="{x:.1f}" y="{_PAD_T + ph - h:.1f}" width="{bar:.1f}" height="{h:.1f}" '
                         f'fill="{color}"><title>{html.escape(t["tenant"])} {key[:-4]}: ${t[key]:.6f}</title></rect>')
        parts.append(f'<text x="{gx:.1f}" y="{_H - 20}" text-anchor="middle">{html.escape(t["tenant"][:16])}</text>')
    for j, (label, color) in enumerate((("cost", "#d62728"), ("saved by cache", "#2ca02c"))):
        ly = _PAD_T + 14 + 18 * j
        parts.append(f'<rect x="{_W - _PAD_R + 12}" y="{ly - 9}" width="10" height="10" fill="{color}"/>'
                     f'<text x="{_W - _PAD_R + 26}" y="{ly}">{label}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _html_breaks(breaks: list[dict[str, Any]], top: int = 10) -> str:
    if not breaks:
        return ""
    rows = "".join(
        f"<tr><td>{html.escape(b['tenant'])}</td><td>{html.escape(b['rule'])}</td><td>{b['requests']}</td>"
        f"<td>{b['tokens_lost']}</td><td>{b['usd_lost']:.6f}</td></tr>" for b in breaks[:top])
    return ("<h2>Top cache-break reasons</h2><table id=\"breaks\"><thead><tr><th>tenant</th><th>rule</th>"
            f"<th>requests</th><th>tokens lost</th><th>$ lost</th></tr></thead><tbody>{rows}</tbody></table>")


def render_html(rep: dict[str, Any]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for _, h in _COLUMNS)
    body = "".join(
        "<tr>" + "".join(f'<td class="{k}">{html.escape(_fmt(k, r.get(k)))}</td>' for k, _ in _COLUMNS) + "</tr>"
        for r in rep["rows"]
    )
    tot = rep["totals"]
    foot = "<tr><td>TOTAL</td><td></td>" + "".join(
        f'<td class="{k}">{html.escape(_fmt(k, tot.get(k)))}</td>' for k, _ in _COLUMNS[2:]) + "</tr>"
    since = html.escape(rep["since"] or "the beginning")
    # "<" as \u003c: the data island can then never close the script element or open a comment.
    data_json = json.dumps(rep).replace("<", "\\u003c")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'; img-src data:">
<title>PrefixGate usage report</title>
<style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; margin: 1em 0; }}
th, td {{ padding: 4px 10px; border-bottom: 1px solid #ddd; text-align: right; }}
th:nth-child(-n+2), td:nth-child(-n+2) {{ text-align: left; }}
tfoot td {{ font-weight: bold; border-top: 2px solid #888; }}
svg text {{ font: 11px system-ui, sans-serif; fill: #444; }}
.empty {{ color: #888; }}
</style></head>
<body>
<h1>PrefixGate usage report</h1>
<p>From {since} to {html.escape(rep["until"])}. Generated {html.escape(rep["generated_at"])}.
Hit rate = cached (reused) prompt tokens / prompt tokens.</p>
<h2>Per tenant and model</h2>
<table id="usage"><thead><tr>{head}</tr></thead><tbody>{body}</tbody><tfoot>{foot}</tfoot></table>
{_html_breaks(rep.get("breaks") or [])}
<h2>Cache hit rate over time</h2>
{_svg_hit_rate(rep)}
<h2>Cost against saved</h2>
{_svg_cost_saved(rep)}
<script type="application/json" id="report-data">{data_json}</script>
</body></html>
"""


RENDERERS = {"table": render_table, "csv": render_csv, "json": render_json, "html": render_html}
