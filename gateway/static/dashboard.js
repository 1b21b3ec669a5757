"use strict";
// PrefixGate operations panel: polls /dashboard/data every 2 s and draws it with the vendored uPlot.
// The API key comes from the URL fragment (#key=...), which the browser never sends to a server.
(function () {
  const key = new URLSearchParams(location.hash.slice(1)).get("key") || "";
  let windowName = "5m";
  const $ = (id) => document.getElementById(id);
  const fmtInt = (n) => (n === null || n === undefined ? "–" : Math.round(n).toLocaleString("en-US"));
  const fmtPct = (x) => (x === null || x === undefined ? "–" : (100 * x).toFixed(1) + "%");
  const fmtUsd = (x) => (x === null || x === undefined ? "–" : "$" + x.toFixed(x !== 0 && Math.abs(x) < 0.01 ? 6 : 4));
  const fmtSec = (x) => (x === null || x === undefined ? "–" : x < 1 ? (1000 * x).toFixed(x < 0.01 ? 1 : 0) + " ms" : x.toFixed(2) + " s");
  const fmtTime = (t) => (t ? new Date(t * 1000).toISOString().slice(0, 16).replace("T", " ") : "–");

  function cell(text, cls) {
    const td = document.createElement("td");
    td.textContent = text;
    if (cls) td.className = cls;
    return td;
  }
  function fillTable(id, rows, toCells, emptyText, span) {
    const body = $(id);
    body.replaceChildren();
    for (const r of rows) {
      const tr = document.createElement("tr");
      for (const c of toCells(r)) tr.appendChild(c);
      body.appendChild(tr);
    }
    if (!rows.length) {
      const tr = document.createElement("tr");
      const td = cell(emptyText, "empty");
      td.colSpan = span;
      tr.appendChild(td);
      body.appendChild(tr);
    }
  }

  // ---------------------------------------------------------------- charts
  const palette = ["#4fc3a1", "#e0a84f", "#e06c5f", "#6fa8dc", "#b48ead", "#a3be8c", "#d08770"];
  // outcomes keep one colour whatever set of them has occurred: ok is never red
  const OUTCOME_COLORS = { ok: "#4fc3a1", "4xx": "#e0a84f", "429_rate_limit": "#ebcb8b", "429_quota": "#d08770",
                           "5xx": "#e06c5f", aborted: "#8a96a3", "401": "#b48ead" };
  const ms = (v) => (v === null || v === undefined ? null : 1000 * v);
  const pct = (v) => (v === null || v === undefined ? null : 100 * v);
  const mib = (v) => (v === null || v === undefined ? null : v / 1048576);
  // id, title, unit, [series key or prefix, label, transform]; a key ending in "." takes every series with that prefix
  const CHARTS = [
    ["ttft", "Time to first token", "ms", [["ttft_p50", "p50", ms], ["ttft_p95", "p95", ms], ["ttft_p99", "p99", ms]]],
    ["tpot", "Time per output token (ITL)", "ms", [["tpot_p50", "p50", ms], ["tpot_p95", "p95", ms], ["tpot_p99", "p99", ms]]],
    ["tokens", "Tokens / s", "tok/s", [["prefill_tokens", "prefill"], ["decode_tokens", "decode"], ["cached_tokens", "reused"]]],
    ["outcomes", "Requests / s by outcome", "req/s", [["requests.", ""]]],
    ["hit", "Prefix-cache hit rate", "%", [["hit_rate", "hit rate", pct]]],
    ["kvshare", "KV usage (share of capacity)", "%", [["kv_share.hbm", "HBM", pct], ["kv_share.dram", "DRAM", pct], ["kv_share.nvme", "NVMe", pct]]],
    ["kvbytes", "KV bytes per tier", "MiB", [["kv_bytes.hbm", "HBM held", mib], ["kv_bytes.hbm_active", "HBM in use", mib],
                                             ["kv_bytes.dram", "DRAM", mib], ["kv_bytes.nvme", "NVMe", mib]]],
    ["evict", "Evictions and demotions / s", "blocks/s", [["evictions.hbm", "evict HBM"], ["demotions.dram", "demote→DRAM"], ["demotions.nvme", "demote→NVMe"], ["evictions.dram", "evict DRAM"], ["evictions.nvme", "evict NVMe"]]],
    ["restore", "Restore latency (mean)", "ms", [["restore_ms.dram", "DRAM"], ["restore_ms.nvme", "NVMe"]]],
    ["frag", "Fragmentation (unused slots in allocated blocks)", "%", [["fragmentation", "fragmentation", pct]]],
    ["bpt", "KV bytes per token", "bytes", [["kv_bytes_per_token", "bytes/token"]]],
    ["queue", "Queue depth by reason · running", "requests", [["queue.", ""], ["running", "running"]]],
  ];
  const plots = {};

  function chartSeries(spec, cols) {
    const out = [];
    for (const [k, label, f] of spec) {
      const keys = k.endsWith(".") ? Object.keys(cols).filter((n) => n.startsWith(k)).sort() : [k];
      for (const name of keys) {
        if (!(name in cols)) continue;
        out.push([label || name.slice(k.length), cols[name].map(f || ((v) => v))]);
      }
    }
    return out;
  }

  const view = { end: 0, span: 300 };
  function drawCharts(ts, now) {
    view.end = now;
    view.span = ts.span_s;
    const box = $("charts");
    for (const [id, title, unit, spec] of CHARTS) {
      const series = chartSeries(spec, ts.series);
      let holder = box.querySelector('[data-chart="' + id + '"]');
      if (!holder) {
        holder = document.createElement("div");
        holder.className = "chart";
        holder.dataset.chart = id;
        holder.innerHTML = '<div class="title"></div><div class="plot"></div>';
        holder.querySelector(".title").textContent = title + (unit ? " (" + unit + ")" : "");
        box.appendChild(holder);
      }
      const data = [ts.t, ...series.map((s) => s[1])];
      const labels = series.map((s) => s[0]).join("|");
      const plotEl = holder.querySelector(".plot");
      const width = Math.max(200, plotEl.clientWidth);
      let plot = plots[id];
      if (plot && plot._labels !== labels) {
        plot.destroy();
        plot = null;
      }
      if (!plot) {
        const opts = {
          width, height: 160,
          legend: { live: false },
          cursor: { drag: { x: false, y: false } },
          // the whole window on the x axis, whatever part of it has data
          scales: { x: { time: true, range: () => [view.end - view.span, view.end] }, y: { range: (u, lo, hi) => [Math.min(0, lo ?? 0), hi > 0 ? hi * 1.1 : 1] } },
          axes: [
            { stroke: "#8a96a3", grid: { stroke: "#222b35" }, ticks: { stroke: "#222b35" } },
            { stroke: "#8a96a3", grid: { stroke: "#222b35" }, ticks: { stroke: "#222b35" }, size: 50 },
          ],
          series: [{}, ...series.map((s, i) => ({ label: s[0], stroke: (id === "outcomes" && OUTCOME_COLORS[s[0]]) || palette[i % palette.length],
                                                   width: 1.5, spanGaps: true,
                                                   points: { show: false } }))],
        };
        plot = plots[id] = new uPlot(opts, data, plotEl);
        plot._labels = labels;
      } else {
        plot.setData(data);
      }
      holder.dataset.points = String(ts.t.length);
      holder.dataset.series = String(series.length);
    }
  }
  window.addEventListener("resize", () => {
    for (const id in plots) {
      const el = document.querySelector('[data-chart="' + id + '"] .plot');
      if (el) plots[id].setSize({ width: Math.max(200, el.clientWidth), height: 160 });
    }
  });

  // ---------------------------------------------------------------- tables
  function render(data) {
    const t = data.totals;
    $("t-requests").textContent = fmtInt(t.requests);
    $("t-errors").textContent = fmtInt(t.errors);
    $("t-errors").className = "value" + (t.errors ? " bad" : "");
    $("t-hit").textContent = fmtPct(t.hit_rate);
    $("t-cached").textContent = fmtInt(t.cached_tokens);
    $("t-cost").textContent = fmtUsd(t.cost_usd);
    $("t-saved").textContent = fmtUsd(t.saved_usd);

    fillTable("rows", data.tenants, (r) => {
      const outcomes = Object.entries(r.by_outcome).filter(([k]) => k !== "ok").map(([k, v]) => k + " " + v).join(", ");
      const hit = cell(fmtPct(r.hit_rate));
      const bar = document.createElement("span");
      bar.className = "bar";
      bar.style.width = Math.round(50 * r.hit_rate) + "px";
      hit.prepend(bar);
      return [cell(r.tenant), cell(fmtInt(r.requests) + (r.errors ? " (" + r.errors + " err)" : ""), r.errors ? "err" : ""),
              cell(outcomes || "all ok", outcomes ? "err" : ""), hit, cell(fmtInt(r.prompt_tokens)), cell(fmtInt(r.cached_tokens)),
              cell(fmtInt(r.completion_tokens)), cell(fmtUsd(r.cost_usd)), cell(fmtUsd(r.saved_usd)),
              cell(fmtSec(r.ttft_p50_s)), cell(fmtSec(r.ttft_p95_s)), cell(fmtSec(r.ttft_max_s))];
    }, "No requests yet.", 12);
    for (const [i, tr] of [...$("rows").children].entries()) if (data.tenants[i]) tr.dataset.tenant = data.tenants[i].tenant;
    $("empty").hidden = true;

    fillTable("models", data.ledger.models, (m) => [
      cell(m.tenant), cell(m.model, "text"), cell(fmtInt(m.requests)), cell(fmtInt(m.tokens)), cell(fmtPct(m.hit_rate)),
      cell(fmtUsd(m.cost_per_1m_usd)), cell(fmtUsd(m.saved_per_1m_usd)), cell(fmtUsd(m.cost_usd)), cell(fmtUsd(m.saved_usd)),
    ], "No ledger rows in this window.", 9);

    const c = data.cache;
    $("pays-cards").hidden = c.cache_seconds === undefined;
    if (c.cache_seconds !== undefined) {
      $("c-cost").textContent = fmtSec(c.cache_seconds);
      $("c-saved").textContent = fmtSec(c.prefill_seconds_saved);
      $("c-pays").textContent = c.pays === null ? "–" : c.pays ? "yes" : "no";
      $("c-pays").className = "value" + (c.pays === null ? "" : c.pays ? " good" : " bad");
    }
    fillTable("computed", c.most_computed, (r) => [cell(r.tenant), cell(r.family, "text"), cell(fmtInt(r.requests)),
                                                    cell(fmtInt(r.computed_tokens))], "Nothing computed yet.", 4);
    fillTable("breaks", data.ledger.breaks, (b) => [cell(b.tenant), cell(b.rule, "text"), cell(fmtInt(b.requests)),
                                                     cell(fmtInt(b.tokens_lost)), cell(fmtUsd(b.usd_lost))],
              "No explained cache breaks in this window.", 5);
    fillTable("prefixes", c.computed_prefixes || [], (r) => [
      cell(r.tenant), cell(r.hash, "text"), cell(fmtInt(r.count) + (r.error ? " (±" + fmtInt(r.error) + ")" : "")),
    ], "Nothing recomputed yet.", 3);
    const q = (v) => (v === null || v === undefined ? "∞" : fmtInt(v));
    // "used / quota" blocks per tier: use is what the tier's block quota counts, right now
    const useQuota = (r, tier) => fmtInt(r.kv_blocks_used[tier]) + " / " + q(r.quotas["kv_blocks_" + tier]);
    fillTable("isolation", data.isolation, (r) => [
      cell(r.tenant), cell(r.share_scope, "text"), cell(r.spill_encrypted === null ? "–" : r.spill_encrypted ? "yes" : "NO", "text"),
      cell(q(r.quotas.rpm)), cell(q(r.quotas.tpm)), cell(r.quotas.budget_usd === null ? "∞" : fmtUsd(r.quotas.budget_usd)),
      cell(useQuota(r, "hbm")), cell(useQuota(r, "dram")), cell(useQuota(r, "nvme")),
      cell(fmtTime(r.last_key_created_at), "text"),
    ], "–", 10);

    $("live").hidden = !data.series;
    if (data.series) drawCharts(data.series, data.generated_at);
    $("status").textContent = "updated " + new Date(data.generated_at * 1000).toLocaleTimeString() + " · " +
      (data.scope === "all" ? "all tenants" : "your tenant");
  }

  async function poll() {
    try {
      const resp = await fetch("dashboard/data?window=" + windowName, { headers: key ? { Authorization: "Bearer " + key } : {} });
      const data = await resp.json();
      if (!resp.ok) throw new Error(data.error ? data.error.message : resp.statusText);
      render(data);
      document.body.dataset.loaded = "1";
    } catch (e) {
      $("status").textContent = "error: " + e.message + (key ? "" : " (open /dashboard#key=YOUR_KEY)");
    }
  }
  for (const b of document.querySelectorAll("nav.windows button")) {
    b.addEventListener("click", () => {
      windowName = b.dataset.window;
      for (const o of document.querySelectorAll("nav.windows button")) o.setAttribute("aria-pressed", String(o === b));
      clearTimeout(timer);
      loop();
    });
  }
  // The 1 h and 24 h windows change slowly, and each poll reads the ledger for the whole window.
  const PERIOD_MS = { "5m": 2000, "1h": 10000, "24h": 60000 };
  let timer = null;
  async function loop() {
    await poll();
    timer = setTimeout(loop, PERIOD_MS[windowName]);
  }
  window.addEventListener("beforeunload", () => clearTimeout(timer));
  loop();
})();
