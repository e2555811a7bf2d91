"""The monitor's web page: one self-contained HTML document (inline CSS, JS and SVG; no CDN).

The server embeds the current snapshot (see ``SwarmMonitor.snapshot``) so the first paint needs
no request; the script then refreshes from ``/api/swarm`` every 2 s. Every peer is a table row
``<tr class="peer" data-peer-id="...">``, which is what the browser test looks for.

What it shows at a glance (issue #68): the swarm's round is the median of the live peers' rounds
(one peer alone ahead does not move it; the maximum is beside it); every validation loss carries
the round of φ it was measured at (``2.4113 @ r12``), greyed (class ``stale``) when older than the
peer's round; the page fits a window 1,280 px wide (the long cells wrap, the table scrolls inside
its box at worst, never the page).
"""

from __future__ import annotations

import html

_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>__TITLE__ · swarm monitor</title>
<style>
  :root { --fg:#1d2330; --muted:#6b7280; --line:#e5e7eb; --bg:#f8fafc; --card:#fff; --ok:#15803d; --gone:#b91c1c; }
  * { box-sizing: border-box; }
  body { margin:0; font:14px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif; color:var(--fg); background:var(--bg); }
  header { padding:14px 24px; background:#111827; color:#f9fafb; display:flex; gap:24px; align-items:baseline; }
  header h1 { font-size:18px; margin:0; }
  header .meta { color:#9ca3af; font-size:12px; }
  main { padding:16px 24px; }
  .run { background:var(--card); border:1px solid var(--line); border-radius:8px; padding:16px; margin-bottom:16px; }
  .run h2 { font-size:16px; margin:0 0 4px; }
  .run .id { font-family:ui-monospace, monospace; color:var(--muted); font-size:12px; }
  .cards { display:flex; gap:12px; margin:12px 0; flex-wrap:wrap; }
  .card { border:1px solid var(--line); border-radius:6px; padding:8px 12px; min-width:130px; }
  .card .v { font-size:20px; font-weight:600; }
  .card .k { color:var(--muted); font-size:12px; }
  .charts { display:flex; gap:16px; flex-wrap:wrap; }
  .chart { border:1px solid var(--line); border-radius:6px; padding:8px; }
  .chart h3 { font-size:13px; margin:0 0 4px; }
  .tablebox { overflow-x:auto; max-width:100%; }
  table { border-collapse:collapse; width:100%; margin-top:12px; font-variant-numeric: tabular-nums; }
  th, td { text-align:right; padding:5px 6px; border-bottom:1px solid var(--line); white-space:nowrap; }
  th:first-child, td:first-child, th:nth-child(2), td:nth-child(2) { text-align:left; }
  th { color:var(--muted); font-weight:500; font-size:12px; white-space:normal; vertical-align:bottom; }
  td.wrap { white-space:normal; overflow-wrap:anywhere; text-align:left; min-width:7em; max-width:15em; }
  td.pid { font-family:ui-monospace, monospace; }
  .live { color:var(--ok); } .gone { color:var(--gone); }
  .stale { color:var(--muted); font-style:italic; }
  .legend { color:var(--muted); font-size:12px; margin-top:6px; }
  .swatch { display:inline-block; width:10px; height:10px; border-radius:2px; margin-right:6px; vertical-align:middle; }
  .empty { color:var(--muted); padding:24px; }
  #error { color:var(--gone); }
</style>
</head>
<body>
<header><h1>__TITLE__ · swarm monitor</h1>
  <span class="meta" id="status">loading…</span> <span class="meta" id="error"></span></header>
<main id="runs"><div class="empty">No run seen in the DHT yet.</div></main>
<script id="initial" type="application/json">__SNAPSHOT__</script>
<script>
"use strict";
const COLORS = ["#2563eb","#dc2626","#16a34a","#9333ea","#ea580c","#0891b2","#ca8a04","#db2777","#4b5563","#65a30d"];
const colorOf = {};
function color(pid) {
  if (!(pid in colorOf)) colorOf[pid] = COLORS[Object.keys(colorOf).length % COLORS.length];
  return colorOf[pid];
}
function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  for (const k of kids) e.append(k instanceof Node ? k : document.createTextNode(String(k)));
  return e;
}
function svg(tag, attrs, ...kids) {
  const e = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  for (const k of kids) e.append(k instanceof Node ? k : document.createTextNode(String(k)));
  return e;
}
function bytes(n) {
  const u = ["B","KiB","MiB","GiB"]; let i = 0;
  while (Math.abs(n) >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return i === 0 ? n.toFixed(0) + " B" : n.toFixed(1) + " " + u[i];
}
function ago(t, now) {
  const s = Math.max(0, now - t);
  return s < 90 ? s.toFixed(0) + " s ago" : s < 5400 ? (s / 60).toFixed(0) + " min ago" : (s / 3600).toFixed(1) + " h ago";
}
function fmt(x, d) { return x === null || x === undefined ? "–" : Number(x).toFixed(d); }
// a loss with the round of φ it was measured at: "2.4113 @ r12"
function lossAt(x, round, d) { return x === null || x === undefined ? "–" : `${Number(x).toFixed(d)} @ r${round}`; }
function short(pid) { return pid.length > 14 ? pid.slice(0, 6) + "…" + pid.slice(-6) : pid; }

// A line chart in inline SVG: series = [{name, color, points: [[x, y], ...]}].
function lineChart(title, xLabel, series, emptyText) {
  const W = 520, H = 240, L = 52, R = 12, T = 10, B = 34;
  const all = series.flatMap(s => s.points);
  const box = el("div", {class: "chart"}, el("h3", {}, title));
  const root = svg("svg", {width: W, height: H, viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": title});
  box.append(root);
  if (all.length === 0) {
    root.append(svg("text", {x: W / 2, y: H / 2, "text-anchor": "middle", fill: "#6b7280"}, emptyText || "no data yet"));
    return box;
  }
  let [x0, x1] = [Math.min(...all.map(p => p[0])), Math.max(...all.map(p => p[0]))];
  let [y0, y1] = [Math.min(...all.map(p => p[1])), Math.max(...all.map(p => p[1]))];
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  if (y1 === y0) { y0 -= 0.5; y1 += 0.5; }
  const pad = (y1 - y0) * 0.08; y0 -= pad; y1 += pad;
  const X = x => L + (x - x0) / (x1 - x0) * (W - L - R);
  const Y = y => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  for (let i = 0; i <= 4; i++) {
    const y = y0 + (y1 - y0) * i / 4;
    root.append(svg("line", {x1: L, x2: W - R, y1: Y(y), y2: Y(y), stroke: "#e5e7eb"}));
    root.append(svg("text", {x: L - 6, y: Y(y) + 4, "text-anchor": "end", "font-size": 11, fill: "#6b7280"}, y.toFixed(2)));
  }
  const xticks = [...new Set([0, 1, 2, 3, 4].map(i => Math.round(x0 + (x1 - x0) * i / 4)))];
  for (const x of xticks) {
    root.append(svg("text", {x: X(x), y: H - B + 16, "text-anchor": "middle", "font-size": 11, fill: "#6b7280"}, x));
  }
  root.append(svg("text", {x: (L + W - R) / 2, y: H - 4, "text-anchor": "middle", "font-size": 11, fill: "#6b7280"}, xLabel));
  for (const s of series) {
    if (s.points.length === 0) continue;
    const d = s.points.map((p, i) => (i ? "L" : "M") + X(p[0]).toFixed(1) + "," + Y(p[1]).toFixed(1)).join(" ");
    root.append(svg("path", {d, fill: "none", stroke: s.color, "stroke-width": 2}));
    for (const p of s.points) root.append(svg("circle", {cx: X(p[0]), cy: Y(p[1]), r: 2.5, fill: s.color},
                                              svg("title", {}, `${s.name}: ${p[1].toFixed(4)} at ${p[0]}`)));
  }
  return box;
}

function renderRun(run, now, t0) {
  const live = run.peers.filter(p => p.live);
  const box = el("section", {class: "run", "data-run-id": run.run_id});
  box.append(el("h2", {}, `run ${run.name}`), el("div", {class: "id"}, run.run_id));
  const tokps = run.tokens_per_s;  // the live peers' sum, as the monitor counts it
  const sync = p => p.last_sync || p;
  const sent = live.reduce((a, p) => a + sync(p).bytes_sent, 0);
  const evals = run.peers.flatMap(p => p.eval_history);
  // the evaluation of the latest round (one peer evaluates φ per cadence round), newest first on a tie
  const lastEval = evals.length ? evals.reduce((a, b) => (b.round > a.round || (b.round === a.round && b.t > a.t)
                                                          ? b : a)) : null;
  const median = run.median_round === null || run.median_round === undefined ? "–" : run.median_round;
  const cards = el("div", {class: "cards"});
  for (const [k, v] of [["live peers", run.live_peers], [`median round of live peers (max ${run.max_round})`, median],
                        ["swarm tok/s", Math.round(tokps).toLocaleString()],
                        ["validation loss of φ", lastEval ? lossAt(lastEval.loss, lastEval.round, 4) : "–"],
                        ["sent in last syncs", bytes(sent)],
                        ["live peers by last group size",
                         Object.entries(run.live_by_group_size).map(([g, n]) => `${n} in ${g}`).join(", ") || "–"]])
    cards.append(el("div", {class: "card"}, el("div", {class: "v"}, v), el("div", {class: "k"}, k)));
  box.append(cards);
  const evalSeries = run.peers.map(p => ({name: short(p.peer_id), color: color(p.peer_id),
                                         points: p.eval_history.map(e => [Math.round(e.t - t0), e.loss])}));
  const trainSeries = run.peers.map(p => ({name: short(p.peer_id), color: color(p.peer_id),
    points: (p.history || []).filter(h => h.train_loss > 0).map(h => [Math.round(h.t - t0), h.train_loss])}));
  box.append(el("div", {class: "charts"},
                lineChart("validation loss of φ (nats/token)", "seconds since the monitor started", evalSeries,
                          "no validation loss published yet"),
                lineChart("training loss (nats/token)", "seconds since the monitor started", trainSeries)));
  const table = el("table", {class: "peers"});
  const head = el("tr", {});
  for (const h of ["peer", "status", "device", "round", "inner step", "train loss", "val loss @ round", "tok/s",
                   "last group", "sent", "received", "caps (use/cap)", "rounds by group size", "last record"])
    head.append(el("th", {}, h));
  table.append(el("thead", {}, head));
  const body = el("tbody", {});
  for (const p of run.peers) {
    const groups = (Object.entries(p.rounds_by_group_size).map(([g, n]) => `${n}×${g}`).join(" ") || "–") +
                   (p.rounds_unseen ? ` (${p.rounds_unseen} not seen)` : "");
    const name = el("td", {class: "pid", title: p.peer_id},
                    el("span", {class: "swatch", style: `background:${color(p.peer_id)}`}), short(p.peer_id));
    const stale = p.eval_round !== null && p.eval_round !== undefined && p.eval_round < p.round;
    const val = el("td", stale ? {class: "stale", title: `measured at round ${p.eval_round}; the peer is at round ${p.round}`}
                               : {}, lossAt(p.eval_loss, p.eval_round, 4));
    body.append(el("tr", {class: "peer", "data-peer-id": p.peer_id},
      name, el("td", {class: p.live ? "live" : "gone"}, p.live ? "live" : "gone"),
      el("td", {class: "wrap"}, p.device || "–"),
      el("td", {}, p.round), el("td", {}, p.inner_step), el("td", {}, fmt(p.train_loss, 3)),
      val, el("td", {}, Math.round(p.tokens_per_s).toLocaleString()),
      el("td", {}, sync(p).group_size), el("td", {}, bytes(sync(p).bytes_sent)),
      el("td", {}, bytes(sync(p).bytes_received)), el("td", {class: "caps wrap"}, p.caps || "–"),
      el("td", {class: "wrap"}, groups), el("td", {}, ago(p.published_at === null ? p.last_seen : p.published_at, now))));
  }
  table.append(body);
  box.append(el("div", {class: "tablebox"}, table),
             el("div", {class: "legend"}, "train loss: the mean of the peer's last round (at its round). " +
                "val loss @ round: φ's validation loss and the round it was measured at (one peer evaluates per " +
                "cadence round), in grey when older than the peer's round."));
  return box;
}

function render(snap) {
  const main = document.getElementById("runs");
  main.replaceChildren();
  const now = snap.generated_at;
  if (snap.runs.length === 0) main.append(el("div", {class: "empty"}, "No run seen in the DHT yet."));
  for (const run of snap.runs) main.append(renderRun(run, now, snap.started_at));
  const polled = snap.last_poll ? `DHT read ${ago(snap.last_poll, now)}` : "waiting for the first DHT read";
  document.getElementById("status").textContent = `${polled} · updated ${new Date(now * 1000).toLocaleTimeString()}`;
  document.getElementById("error").textContent = snap.last_error ? `last poll failed: ${snap.last_error}` : "";
}

render(JSON.parse(document.getElementById("initial").textContent));
async function refresh() {
  try {
    const r = await fetch("api/swarm", {cache: "no-store"});
    if (r.ok) render(await r.json());
  } catch (e) {
    document.getElementById("error").textContent = "monitor unreachable: " + e;
  }
}
setInterval(refresh, 2000);
</script>
</body>
</html>
"""


_SCRIPT_SAFE = str.maketrans({"<": "\\u003c", ">": "\\u003e", "&": "\\u0026"})


def render_page(title: str, snapshot_json: str) -> str:
    """The page with ``snapshot_json`` embedded.

    Every ``<``, ``>`` and ``&`` of the JSON (they occur only inside its strings: run names and
    errors that peers chose) is written as a ``\\u`` escape, which ``JSON.parse`` reads back as the
    same character. So no string can close the script element, nor open a comment in it (``<!--``
    followed by ``<script>`` makes the HTML parser swallow the page's script: a blank monitor). The
    script renders every string with ``textContent``/``createTextNode`` only, never as HTML.
    """
    return _PAGE.replace("__TITLE__", html.escape(title)).replace("__SNAPSHOT__", snapshot_json.translate(_SCRIPT_SAFE))
