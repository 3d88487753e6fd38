// The dashboard: reads the API with the token kept in this tab's session storage (given once as
// #token=… in the URL, or typed into the sign-in box), and follows the ledger's event stream to
// redraw what changed. Everything from the server is written as text, never as markup.
"use strict";

const TOKEN_KEY = "fairledger-token";
const UNALLOCATED = "(unallocated)";
const view = {
  lastSeq: 0,
  leaves: [], // leaf allocation paths, in tree order
  colours: new Map(),
  hourly: [], // [{from, to, held: {path: gpus}}]
  samples: [], // [{t, held: {path: gpus}}] while the page is open
  capacity: 0,
  nodes: [], // every node, as /v1/nodes answers them
  layout: [], // where each node is drawn on the canvas: {x, y, w, h, node}
  period: null,
  budget: null, // the allocation whose budget is open: its path
  usageCache: null, // the hours last read for it: {span, at, v}
  allocations: [], // the rows of /v1/allocations, and what its key means
  keyMeaning: null,
  started: false,
  following: false,
  // Paged lists: the cursor of each page shown before the current one, and the current one.
  waiting: { cursors: [], cursor: null, next: null, allocation: null },
  running: { cursors: [], cursor: null, next: null },
  nodePage: 0,
  // Live updates: what the events since the last refresh touched, and when it ran.
  dirty: new Set(),
  refreshing: false,
  lastRefresh: 0,
  timer: null,
};

/// Rows a paged table shows.
const PAGE = 50;
/// The least time between two refreshes while events pour in, in ms.
const REFRESH_EVERY = 1000;

// ---- the token ------------------------------------------------------------------------------

/// A token as the API makes them: printable ASCII, no spaces (anything else could not be sent).
function plausible(token) {
  return /^[\x21-\x7e]{1,256}$/.test(token);
}

(function tokenFromFragment() {
  const m = location.hash.match(/(?:^#|&)token=([^&]+)/);
  if (m) {
    let token = "";
    try {
      token = decodeURIComponent(m[1]);
    } catch (e) {
      token = "";
    }
    if (plausible(token)) sessionStorage.setItem(TOKEN_KEY, token);
    history.replaceState(null, "", location.pathname + location.search);
  }
})();

class SignInNeeded extends Error {}

function headers() {
  const t = sessionStorage.getItem(TOKEN_KEY);
  return t ? { Authorization: "Bearer " + t } : {};
}

async function api(path) {
  const res = await fetch(path, { headers: headers() });
  if (res.status === 401 || res.status === 403) {
    const problem = await res.json().catch(() => ({}));
    throw new SignInNeeded(problem.detail || "sign in with a token that may read the cluster");
  }
  if (!res.ok) {
    const problem = await res.json().catch(() => ({}));
    throw new Error(problem.detail || `${path}: HTTP ${res.status}`);
  }
  return res.json();
}

/// Sends `body` with `method` to `path`; answers the JSON, or throws the problem's detail.
async function send(method, path, body) {
  const res = await fetch(path, {
    method,
    headers: { ...headers(), "Content-Type": "application/json" },
    body: JSON.stringify(body),
  });
  const answer = await res.json().catch(() => ({}));
  if (res.status === 401) throw new SignInNeeded(answer.detail || "sign in again");
  if (!res.ok) throw new Error(answer.detail || `${path}: HTTP ${res.status}`);
  return answer;
}

function showSignIn(message) {
  document.getElementById("login").hidden = false;
  document.getElementById("logout").hidden = true;
  document.getElementById("login-error").textContent = message || "";
  setStatus("signed out", "");
}

document.getElementById("login").addEventListener("submit", (e) => {
  e.preventDefault();
  const input = document.getElementById("token");
  const token = input.value.trim();
  input.value = "";
  if (!plausible(token)) {
    showSignIn("that is not a token: it is printable characters without spaces");
    return;
  }
  sessionStorage.setItem(TOKEN_KEY, token);
  start();
});

document.getElementById("logout").addEventListener("click", () => {
  sessionStorage.removeItem(TOKEN_KEY);
  location.reload();
});

// ---- formatting -----------------------------------------------------------------------------

function utc(ms) {
  if (ms === null || ms === undefined) return "-";
  return new Date(ms).toISOString().slice(0, 19).replace("T", " ");
}

function span(seconds) {
  const s = Math.max(0, Math.floor(seconds));
  const d = Math.floor(s / 86400), h = Math.floor(s / 3600) % 24, m = Math.floor(s / 60) % 60;
  if (d > 0) return `${d}d ${h}h`;
  if (h > 0) return `${h}h ${m}m`;
  if (m > 0) return `${m}m`;
  return `${s}s`;
}

function relative(ms) {
  if (ms === null || ms === undefined) return "-";
  const delta = (ms - Date.now()) / 1000;
  return delta >= 0 ? `in ${span(delta)}` : `${span(-delta)} ago`;
}

function when(ms) {
  return ms === null || ms === undefined ? "-" : `${utc(ms)} (${relative(ms)})`;
}

function num(x, digits = 1) {
  return typeof x === "number" ? x.toFixed(digits) : "-";
}

function shortId(id) {
  return typeof id === "string" ? id.slice(-12) : "-";
}

function colour(path) {
  if (!path) return "#8d8d8d";
  if (!view.colours.has(path)) {
    const i = view.colours.size;
    view.colours.set(path, `hsl(${(i * 137.508) % 360}, 58%, 47%)`);
  }
  return view.colours.get(path);
}

function setStatus(text, kind) {
  const el = document.getElementById("status");
  el.textContent = text;
  el.className = "status " + (kind || "");
}

/// Replaces the rows of the table `id` with `rows`: arrays of cells, each a string or
/// {text, num, colour}.
function fill(id, rows) {
  const body = document.querySelector(`#${id} tbody`);
  const out = document.createDocumentFragment();
  for (const row of rows) {
    const tr = document.createElement("tr");
    for (const cell of row) {
      const td = document.createElement("td");
      const c = typeof cell === "object" && cell !== null ? cell : { text: cell };
      if (c.colour) {
        const sw = document.createElement("span");
        sw.className = "swatch";
        sw.style.background = c.colour;
        td.appendChild(sw);
      }
      td.appendChild(document.createTextNode(c.text === undefined || c.text === null ? "-" : String(c.text)));
      if (c.num) td.className = "num";
      if (c.indent) td.style.paddingLeft = `${0.5 + 1.2 * c.indent}rem`;
      tr.appendChild(td);
    }
    out.appendChild(tr);
  }
  body.replaceChildren(out);
}

// ---- the views ------------------------------------------------------------------------------

async function refreshAllocations() {
  let path = "/v1/allocations";
  if (view.period) path += `?from=${view.period.from}&to=${view.period.to}`;
  const v = await api(path);
  const leaves = v.allocations.filter((a) => a.leaf).map((a) => a.path);
  view.leaves = leaves;
  leaves.forEach(colour);
  const held = {};
  for (const a of v.allocations) if (a.leaf && a.held_gpus > 0) held[a.path] = a.held_gpus;
  view.samples.push({ t: Date.now(), held });
  if (view.samples.length > 5000) view.samples.splice(0, view.samples.length - 5000);
  view.allocations = v.allocations;
  view.keyMeaning = v.key_meaning;
  const arrow = (a) => {
    if (typeof a.key !== "number" || typeof a.key_in_24h !== "number") return "-";
    const d = a.key_in_24h - a.key;
    return `${num(a.key_in_24h, 3)} ${d > 1e-9 ? "↑" : d < -1e-9 ? "↓" : "="}`;
  };
  fill(
    "allocations",
    v.allocations.map((a) => {
      const ratio = a.window_owed_gpu_hours > 0 ? num(a.window_delivered_gpu_hours / a.window_owed_gpu_hours, 2) : "-";
      return [
        { text: a.path, colour: a.leaf ? colour(a.path) : null, indent: a.path.split("/").length - 1 },
        { text: a.weight, num: true },
        { text: `${num(100 * a.share)}%`, num: true },
        { text: num(a.owed_gpus_now), num: true },
        { text: a.held_gpus, num: true },
        { text: a.demand_gpus, num: true },
        { text: num(a.window_owed_gpu_hours, 2), num: true },
        { text: num(a.window_delivered_gpu_hours, 2), num: true },
        { text: ratio, num: true },
        { text: num(a.owed_not_delivered_gpu_hours, 2), num: true },
        { text: num(a.key, 3), num: true },
        { text: arrow(a), num: true },
        { text: num(a.owed_gpu_hours, 2), num: true },
        { text: num(a.delivered_gpu_hours, 2), num: true },
        { text: num(a.period_owed_gpu_hours, 2), num: true },
        { text: num(a.period_delivered_gpu_hours, 2), num: true },
      ];
    }),
  );
  const rows = document.querySelectorAll("#allocations tbody tr");
  v.allocations.forEach((a, i) => {
    rows[i].dataset.path = a.path;
    if (a.path === view.budget) rows[i].classList.add("chosen");
  });
  if (view.budget) await refreshBudget();
  // Running work by allocation: the leaves holding GPUs, the most first.
  const holding = v.allocations.filter((a) => a.leaf && (a.held_gpus > 0 || a.demand_gpus > a.held_gpus)).sort((a, b) => b.held_gpus - a.held_gpus);
  const heldAll = holding.reduce((s, a) => s + a.held_gpus, 0);
  document.getElementById("running-total").textContent = `${heldAll} GPUs held by ${holding.filter((a) => a.held_gpus > 0).length} allocation(s)`;
  fill(
    "running-summary",
    holding.map((a) => [
      { text: a.path, colour: colour(a.path) },
      { text: a.held_gpus, num: true },
      { text: num(a.owed_gpus_now), num: true },
      { text: Math.max(0, a.demand_gpus - a.held_gpus), num: true },
    ]),
  );
  // The change form offers every allocation, keeping the one chosen.
  const select = document.getElementById("change-path");
  const chosen = select.value;
  select.replaceChildren(
    ...v.allocations.map((a) => {
      const o = document.createElement("option");
      o.value = a.path;
      o.textContent = a.path;
      o.dataset.weight = a.weight;
      o.dataset.cap = a.max_gpus === null || a.max_gpus === undefined ? "" : a.max_gpus;
      return o;
    }),
  );
  if (chosen) select.value = chosen;
  else pickAllocation();
  const legend = document.getElementById("legend");
  legend.replaceChildren(
    ...[...leaves, UNALLOCATED].map((p) => {
      const s = document.createElement("span");
      s.style.setProperty("--c", colour(p === UNALLOCATED ? null : p));
      s.textContent = p;
      return s;
    }),
  );
  document.getElementById("asof").textContent = `as of event ${v.as_of_seq}`;
}

async function refreshWaiting() {
  const w = view.waiting;
  let path = `/v1/queue?limit=${PAGE}`;
  if (w.cursor !== null) path += `&after=${w.cursor}`;
  if (w.allocation) path += `&allocation=${encodeURIComponent(w.allocation)}`;
  const [page, whole] = await Promise.all([api(path), w.allocation ? api("/v1/queue?limit=0") : null]);
  const s = (whole || page).summary;
  w.next = page.next_after;
  document.getElementById("waiting-total").textContent =
    `${s.pending} waiting for ${s.gpus} GPUs in ${s.by_allocation.length} allocation${s.by_allocation.length === 1 ? "" : "s"}`;
  fill(
    "waiting-summary",
    s.by_allocation.map((a) => [
      { text: a.allocation || UNALLOCATED, colour: colour(a.allocation) },
      { text: a.pending, num: true },
      { text: a.gpus, num: true },
      shortId(a.head.id),
      { text: a.head.position, num: true },
      a.head.reason.replaceAll("_", " "),
    ]),
  );
  document.querySelectorAll("#waiting-summary tbody tr").forEach((tr, i) => {
    const path = s.by_allocation[i].allocation;
    tr.dataset.allocation = path || "";
    if (path && path === w.allocation) tr.classList.add("chosen");
  });
  document.getElementById("waiting-reasons").textContent = s.by_reason.length
    ? "By reason: " + s.by_reason.map((r) => `${r.code.replaceAll("_", " ")} ${r.pending} (${r.gpus} GPUs)`).join(" · ")
    : "";
  document.getElementById("waiting-filter").textContent = w.allocation ? `${w.allocation} only (click it again for all)` : "";
  const first = page.pending.length ? page.pending[0].position : 0;
  const last = page.pending.length ? page.pending[page.pending.length - 1].position : 0;
  document.getElementById("waiting-page").textContent = page.pending.length ? `positions ${first}–${last}` : "none";
  document.getElementById("waiting-prev").disabled = w.cursors.length === 0;
  document.getElementById("waiting-next").disabled = w.next === null || w.next === undefined;
  fill(
    "waiting",
    page.pending.map((p) => {
      const start = p.reason && (p.reason.start_at_ms || p.reason.until_ms);
      return [
        { text: p.position, num: true },
        shortId(p.id),
        { text: p.allocation || UNALLOCATED, colour: colour(p.allocation) },
        p.user,
        { text: `${p.nodes}×${p.gpus_per_node}`, num: true },
        span((Date.now() - p.submitted_at_ms) / 1000),
        p.reason ? p.reason.code.replaceAll("_", " ") : "-",
        start ? when(start) : "-",
      ];
    }),
  );
  const chosen = document.getElementById("waiting-detail").dataset.id;
  document.querySelectorAll("#waiting tbody tr").forEach((tr, i) => {
    tr.dataset.id = page.pending[i].id;
    if (tr.dataset.id === chosen) tr.classList.add("chosen");
  });
}

async function refreshRunning() {
  const r = view.running;
  let path = `/v1/workloads?phase=running&limit=${PAGE}`;
  if (r.cursor) path += `&before=${r.cursor}`;
  const page = await api(path);
  r.next = page.next_before;
  const from = r.cursors.length * PAGE;
  document.getElementById("running-page").textContent = page.workloads.length
    ? `${from + 1}–${from + page.workloads.length}, newest first`
    : "none";
  document.getElementById("running-prev").disabled = r.cursors.length === 0;
  document.getElementById("running-next").disabled = !r.next;
  fill(
    "running",
    page.workloads.map((w) => [
      { text: w.name || "-", colour: colour(w.allocation) },
      shortId(w.id),
      w.allocation || UNALLOCATED,
      w.user,
      { text: `${w.nodes}×${w.gpus_per_node}`, num: true },
      when(w.started_at_ms),
      when(w.protected_until_ms),
      w.state,
    ]),
  );
}

/// Every node, page after page (5,000 a page).
async function allNodes() {
  const nodes = [];
  let after = null, summary = null;
  for (;;) {
    const v = await api(`/v1/nodes?limit=5000${after ? `&after=${encodeURIComponent(after)}` : ""}`);
    summary = summary || v.summary;
    nodes.push(...v.nodes);
    after = v.next_after;
    if (!after) return { nodes, summary };
  }
}

async function refreshNodes() {
  const { nodes, summary } = await allNodes();
  view.nodes = nodes;
  view.capacity = summary.gpus;
  const held = summary.by_model.reduce((s, m) => s + m.held_gpus, 0);
  const free = summary.by_model.reduce((s, m) => s + m.free_gpus, 0);
  const healthy = summary.by_model.reduce((s, m) => s + m.healthy_gpus, 0);
  document.getElementById("cluster-summary").textContent =
    `${summary.nodes} nodes, ${summary.gpus} GPUs: ${held} held, ${free} free, ${summary.gpus - healthy} unhealthy` +
    (summary.by_state.length ? " · nodes " + summary.by_state.map((s) => `${s.state} ${s.nodes}`).join(", ") : "");
  fill(
    "nodes-summary",
    summary.by_model.map((m) => [
      m.model,
      { text: m.nodes, num: true },
      { text: m.gpus, num: true },
      { text: m.healthy_gpus, num: true },
      { text: m.held_gpus, num: true },
      { text: m.free_gpus, num: true },
    ]),
  );
  drawGpus();
  showNodePage();
}

function showNodePage() {
  const pages = Math.max(1, Math.ceil(view.nodes.length / PAGE));
  view.nodePage = Math.min(view.nodePage, pages - 1);
  const from = view.nodePage * PAGE;
  const shown = view.nodes.slice(from, from + PAGE);
  document.getElementById("nodes-page").textContent = shown.length ? `${from + 1}–${from + shown.length} of ${view.nodes.length}` : "none";
  document.getElementById("nodes-prev").disabled = view.nodePage === 0;
  document.getElementById("nodes-next").disabled = view.nodePage >= pages - 1;
  fill(
    "nodes",
    shown.map((n) => {
      const held = n.gpu.filter((g) => g.workload && typeof g.utilization_pct === "number");
      const util = held.length ? `${Math.round(held.reduce((s, g) => s + g.utilization_pct, 0) / held.length)}%` : "-";
      const down = n.gpu.filter((g) => g.healthy === false).map((g) => g.gpu);
      return [n.node, n.model, { text: n.gpus, num: true }, { text: n.free_gpus, num: true }, n.state, util, down.length ? down.join(",") : "-"];
    }),
  );
}

/// The GPUs on the canvas: one block per node, its GPUs side by side, grouped by model; the
/// cells as large as lets every node fit in about 480 pixels of height.
function drawGpus() {
  const canvas = document.getElementById("gpus");
  const width = 1100;
  const models = [];
  for (const n of view.nodes) {
    let group = models.find((m) => m.model === n.model);
    if (!group) models.push((group = { model: n.model, nodes: [] }));
    group.nodes.push(n);
  }
  const widest = Math.max(1, ...view.nodes.map((n) => n.gpus));
  const named = view.nodes.length <= 64;
  const label = 16;
  const fits = (cell) => {
    const gap = Math.max(3, cell / 2);
    const block = widest * (cell + 1) + gap + (named ? 0 : 0);
    const perRow = Math.max(1, Math.floor(width / block));
    const rowH = cell + gap + (named ? 14 : 0);
    let h = 0;
    for (const m of models) h += label + Math.ceil(m.nodes.length / perRow) * rowH;
    return { cell, gap, block, perRow, rowH, h };
  };
  let geometry = null;
  for (const cell of [22, 16, 12, 9, 7, 5, 4, 3]) {
    geometry = fits(cell);
    if (geometry.h <= 480) break;
  }
  const { cell, block, perRow, rowH, h } = geometry;
  const ratio = window.devicePixelRatio || 1;
  canvas.width = width * ratio;
  canvas.height = Math.max(40, h) * ratio;
  canvas.style.height = `${Math.max(40, h)}px`;
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, h);
  ctx.font = "11px system-ui, sans-serif";
  view.layout = [];
  let y = 0;
  for (const m of models) {
    ctx.fillStyle = "#555";
    ctx.fillText(`${m.model}: ${m.nodes.length} node${m.nodes.length === 1 ? "" : "s"}`, 0, y + 11);
    y += label;
    m.nodes.forEach((n, i) => {
      const x0 = (i % perRow) * block, y0 = y + Math.floor(i / perRow) * rowH;
      n.gpu.forEach((g, k) => {
        ctx.fillStyle = g.healthy === false ? "#ffffff" : g.workload ? colour(g.allocation) : "#e4e6ea";
        ctx.fillRect(x0 + k * (cell + 1), y0, cell, cell);
        if (g.healthy === false) {
          ctx.strokeStyle = "#b71c1c";
          ctx.strokeRect(x0 + k * (cell + 1) + 0.5, y0 + 0.5, cell - 1, cell - 1);
        }
      });
      if (n.draining) {
        ctx.fillStyle = "rgba(0,0,0,0.25)";
        for (let k = 0; k < n.gpu.length; k += 2) ctx.fillRect(x0 + k * (cell + 1), y0 + cell / 2, cell, 2);
      }
      if (named) {
        ctx.fillStyle = "#1d232b";
        ctx.fillText(n.node, x0, y0 + cell + 12);
      }
      view.layout.push({ x: x0, y: y0, w: n.gpu.length * (cell + 1), h: cell, node: n, cell });
    });
    y += Math.ceil(m.nodes.length / perRow) * rowH;
  }
  canvas.dataset.gpus = String(view.nodes.reduce((s, n) => s + n.gpu.length, 0));
  canvas.dataset.nodes = String(view.nodes.length);
}

/// What the tooltip says about node `n`.
function describeNode(n) {
  const lines = [`${n.node} (${n.model}, ${n.state}${n.draining ? ", draining" : ""}): ${n.free_gpus} of ${n.gpus} GPUs free`];
  for (const g of n.gpu) {
    const what = g.workload ? `${g.allocation || UNALLOCATED} (${shortId(g.workload)})` : "free";
    lines.push(`GPU ${g.gpu}: ${what}${g.healthy === false ? ", unhealthy" : ""}`);
  }
  return lines.join("\n");
}

/// The colour drawn for GPU `gpu` of node `name` (for checking what the canvas shows).
function pixelAt(name, gpu) {
  const at = view.layout.find((l) => l.node.node === name);
  if (!at) return null;
  const ratio = window.devicePixelRatio || 1;
  const x = Math.floor((at.x + gpu * (at.cell + 1) + at.cell / 2) * ratio);
  const y = Math.floor((at.y + at.cell / 2) * ratio);
  const [r, g, b] = document.getElementById("gpus").getContext("2d").getImageData(x, y, 1, 1).data;
  return "#" + [r, g, b].map((c) => c.toString(16).padStart(2, "0")).join("");
}

/// An allocation's colour as the canvas writes it (#rrggbb).
function colourOf(path) {
  const ctx = document.createElement("canvas").getContext("2d");
  ctx.fillStyle = colour(path);
  return ctx.fillStyle;
}

window.fairledger = { pixelAt, colourOf, view };

(function tooltips() {
  const canvas = document.getElementById("gpus");
  const tip = document.getElementById("gpu-tip");
  canvas.addEventListener("mousemove", (e) => {
    const box = canvas.getBoundingClientRect();
    const scale = 1100 / box.width;
    const x = (e.clientX - box.left) * scale, y = (e.clientY - box.top) * scale;
    const at = view.layout.find((l) => x >= l.x && x < l.x + l.w && y >= l.y && y < l.y + l.h);
    if (!at) {
      tip.hidden = true;
      return;
    }
    tip.textContent = describeNode(at.node);
    tip.style.left = `${e.clientX + 12}px`;
    tip.style.top = `${e.clientY + 12}px`;
    tip.hidden = false;
  });
  canvas.addEventListener("mouseleave", () => (tip.hidden = true));
})();

function pager(prefix, list, refresh) {
  document.getElementById(`${prefix}-next`).addEventListener("click", () => {
    if (list.next === null || list.next === undefined) return;
    list.cursors.push(list.cursor);
    list.cursor = list.next;
    refresh().catch(report);
  });
  document.getElementById(`${prefix}-prev`).addEventListener("click", () => {
    if (!list.cursors.length) return;
    list.cursor = list.cursors.pop();
    refresh().catch(report);
  });
}
pager("waiting", view.waiting, refreshWaiting);
pager("running", view.running, refreshRunning);
document.getElementById("nodes-next").addEventListener("click", () => {
  view.nodePage += 1;
  showNodePage();
});
document.getElementById("nodes-prev").addEventListener("click", () => {
  view.nodePage = Math.max(0, view.nodePage - 1);
  showNodePage();
});
/// Why waiting workload `id` waits, and what would start it sooner, under the waiting table.
async function showWhy(id) {
  const box = document.getElementById("waiting-detail");
  const v = await api(`/v1/workloads/${encodeURIComponent(id)}/explain`);
  const lines = [];
  if (v.phase !== "pending") {
    lines.push(`${shortId(id)} is ${v.phase}: ${v.detail || ""}`);
  } else {
    lines.push(`${shortId(id)} is ${v.position} of ${v.of} in the queue: ${v.reason.detail}`);
    const e = v.estimate || {};
    if (e.start_at_ms) lines.push(`Estimated start ${when(e.start_at_ms)}: ${e.how}`);
    else if (e.not_before_ms) lines.push(`Not before ${when(e.not_before_ms)}: ${e.how}`);
    else lines.push("No start in sight: no running work it waits for has an estimate or a contract ending.");
    const alternatives = v.alternatives || [];
    if (alternatives.length) {
      lines.push("It would start sooner, submitted again with:");
      for (const a of alternatives) {
        const at = a.would === "start" ? "at once" : a.exact ? when(a.estimated_start_ms) : `not before ${when(a.estimated_start_ms)}`;
        lines.push(`  • ${a.what}: ${at}`);
      }
    } else {
      lines.push("No change within its submitter's rights would start it sooner.");
    }
  }
  box.textContent = lines.join("\n");
  box.dataset.id = id;
  box.hidden = false;
}

document.querySelector("#waiting tbody").addEventListener("click", (e) => {
  const tr = e.target.closest("tr");
  if (!tr || !tr.dataset.id) return;
  document.querySelectorAll("#waiting tbody tr.chosen").forEach((r) => r.classList.remove("chosen"));
  tr.classList.add("chosen");
  showWhy(tr.dataset.id).catch(report);
});

// ---- a change with its preview ----------------------------------------------------------------

/// The change the form asks for, as the what-if and the allocation route take it.
function asked() {
  const path = document.getElementById("change-path").value;
  const weight = Number(document.getElementById("change-weight").value);
  const cap = document.getElementById("change-cap").value;
  const change = { allocation: path, weight };
  if (cap !== "") change.max_gpus = Number(cap);
  return change;
}

function pickAllocation() {
  const o = document.getElementById("change-path").selectedOptions[0];
  if (!o) return;
  document.getElementById("change-weight").value = o.dataset.weight;
  document.getElementById("change-cap").value = o.dataset.cap;
  document.getElementById("change-apply").disabled = true;
}

document.getElementById("change-path").addEventListener("change", pickAllocation);
for (const id of ["change-weight", "change-cap"]) {
  // A changed form must be previewed again before it is applied.
  document.getElementById(id).addEventListener("input", () => (document.getElementById("change-apply").disabled = true));
}

document.getElementById("change").addEventListener("submit", async (e) => {
  e.preventDefault();
  const said = document.getElementById("change-said");
  const change = asked();
  said.textContent = "working out the next 24 hours with and without it…";
  try {
    const v = await send("POST", "/v1/whatif", { changes: [change], horizon_s: 86400 });
    const find = (side, path) => (side.allocations || []).find((a) => a.path === path) || {};
    const paths = [...new Set([...v.baseline.allocations, ...v.changed.allocations].map((a) => a.path))];
    const both = (x, y, f) => `${f(x)} → ${f(y)}`;
    const wait = (s) => (typeof s === "number" ? span(s) : "-");
    fill(
      "preview",
      paths.map((p) => {
        const [x, y] = [find(v.baseline, p), find(v.changed, p)];
        return [
          { text: p, colour: colour(p) },
          both(x.weight, y.weight, (n) => (n === undefined ? "-" : n)),
          both(x.owed_gpu_hours, y.owed_gpu_hours, (n) => num(n, 2)),
          both(x.delivered_gpu_hours, y.delivered_gpu_hours, (n) => num(n, 2)),
          both(x.delivered_over_owed, y.delivered_over_owed, (n) => num(n, 2)),
          both(x.wait_p50_s, y.wait_p50_s, wait),
          both(x.preemptions, y.preemptions, (n) => (n === undefined ? "-" : n)),
        ];
      }),
    );
    document.getElementById("preview").hidden = false;
    said.textContent = "the next 24 hours without → with the change; nothing is changed until you apply it";
    document.getElementById("change-apply").disabled = false;
  } catch (err) {
    if (err instanceof SignInNeeded) return showSignIn(err.message);
    said.textContent = err.message;
  }
});

document.getElementById("change-apply").addEventListener("click", async () => {
  const said = document.getElementById("change-said");
  const change = asked();
  const body = { weight: change.weight };
  if (change.max_gpus !== undefined) body.max_gpus = change.max_gpus;
  try {
    const v = await send("PUT", `/v1/allocations/${change.allocation.split("/").map(encodeURIComponent).join("/")}`, body);
    said.textContent = `applied: ${v.path} (event ${v.seq})`;
    document.getElementById("change-apply").disabled = true;
    await refreshAllocations();
  } catch (err) {
    if (err instanceof SignInNeeded) return showSignIn(err.message);
    said.textContent = err.message;
  }
});

document.querySelector("#waiting-summary tbody").addEventListener("click", (e) => {
  const tr = e.target.closest("tr");
  if (!tr) return;
  const w = view.waiting;
  w.allocation = tr.dataset.allocation && tr.dataset.allocation !== w.allocation ? tr.dataset.allocation : null;
  w.cursors = [];
  w.cursor = null;
  refreshWaiting().catch(report);
});

/// One allocation's budget over time: GPU-hours owed against delivered, summed hour by hour over
/// the period chosen (the last 7 days without one), for its whole subtree.
async function refreshBudget() {
  const path = view.budget;
  const a = view.allocations.find((r) => r.path === path);
  const box = document.getElementById("budget");
  if (!a) {
    box.hidden = true;
    return;
  }
  const to = view.period ? Date.parse(`${view.period.to}T00:00:00Z`) : Date.now();
  // The hours of at most 31 days, the most /v1/usage answers at a time.
  const from = Math.max(view.period ? Date.parse(`${view.period.from}T00:00:00Z`) : to - 7 * 86_400_000, to - 31 * 86_400_000);
  // The hours change slowly: read them again at most once a minute for the same period.
  const span = view.period ? `${view.period.from}/${view.period.to}` : "week";
  const cached = view.usageCache;
  const v = cached && cached.span === span && Date.now() - cached.at < 60_000
    ? cached.v
    : await api(`/v1/usage?from=${from}&to=${to}`);
  if (v !== (cached && cached.v)) view.usageCache = { span, at: Date.now(), v };
  const under = (leaf) => leaf === path || leaf.startsWith(`${path}/`);
  const sum = (m) => Object.entries(m || {}).reduce((s, [leaf, g]) => s + (under(leaf) ? g : 0), 0);
  let owed = 0, delivered = 0;
  const points = [{ t: from, owed, delivered }];
  for (const h of v.hours) {
    const span = (h.to_ms - h.from_ms) / 3600_000;
    owed += sum(h.owed_gpus) * span;
    delivered += sum(h.held_gpus) * span;
    points.push({ t: h.to_ms, owed, delivered });
  }
  box.hidden = false;
  const canvas = document.getElementById("budget-chart");
  canvas.dataset.owed = owed.toFixed(2);
  canvas.dataset.delivered = delivered.toFixed(2);
  const shown = view.period ? `${new Date(from).toISOString().slice(0, 10)} to ${view.period.to}` : "the last 7 days";
  document.getElementById("budget-title").textContent = `${path}, ${shown}:`;
  const key = typeof a.key === "number"
    ? ` Its key: ${num(a.key, 3)} now, ${num(a.key_in_1h, 3)} in an hour, ${num(a.key_in_24h, 3)} in a day if nothing changes (${view.keyMeaning}).`
    : "";
  const gap = owed - delivered;
  document.getElementById("budget-said").textContent =
    `owed ${num(owed, 2)} GPU-h, delivered ${num(delivered, 2)} GPU-h` +
    (owed > 0 ? ` (${num(delivered / owed, 2)} of owed)` : "") +
    (gap > 0.005 ? `; ${num(gap, 2)} GPU-h owed and not yet delivered, so its work ranks ahead of allocations delivered more of what they are owed.` : "; it has had what it was owed.") +
    key;
  drawBudget(canvas, points, from, to, colour(path));
}

/// Cumulative owed (dashed) and delivered (solid, in the allocation's colour) over time.
function drawBudget(canvas, points, start, end, fill) {
  const ctx = canvas.getContext("2d");
  const W = canvas.width, H = canvas.height, left = 56, bottom = 24, top = 8, right = 8;
  ctx.clearRect(0, 0, W, H);
  const ymax = Math.max(1, ...points.map((p) => Math.max(p.owed, p.delivered)));
  const x = (t) => left + ((t - start) / Math.max(1, end - start)) * (W - left - right);
  const y = (g) => H - bottom - (g / ymax) * (H - bottom - top);
  ctx.strokeStyle = "#ccc";
  ctx.fillStyle = "#555";
  ctx.font = "11px system-ui, sans-serif";
  for (let i = 0; i <= 4; i++) {
    const g = (ymax * i) / 4;
    ctx.beginPath();
    ctx.moveTo(left, y(g));
    ctx.lineTo(W - right, y(g));
    ctx.stroke();
    ctx.fillText(`${num(g, g < 10 ? 1 : 0)} GPU-h`, 2, y(g) + 4);
  }
  for (let t = Math.ceil(start / 86_400_000) * 86_400_000; t <= end; t += 86_400_000) {
    ctx.fillText(new Date(t).toISOString().slice(5, 10), x(t) - 14, H - 6);
  }
  const line = (pick, colourOf, dash) => {
    ctx.setLineDash(dash);
    ctx.strokeStyle = colourOf;
    ctx.lineWidth = 2;
    ctx.beginPath();
    points.forEach((p, i) => (i ? ctx.lineTo(x(p.t), y(pick(p))) : ctx.moveTo(x(p.t), y(pick(p)))));
    ctx.stroke();
    ctx.setLineDash([]);
    ctx.lineWidth = 1;
  };
  line((p) => p.owed, "#1d232b", [5, 4]);
  line((p) => p.delivered, fill, []);
  ctx.fillStyle = "#1d232b";
  ctx.fillText("owed (dashed), delivered (solid)", W - right - 190, top + 12);
}

document.querySelector("#allocations tbody").addEventListener("click", (e) => {
  const tr = e.target.closest("tr");
  if (!tr || !tr.dataset.path) return;
  view.budget = view.budget === tr.dataset.path ? null : tr.dataset.path;
  document.querySelectorAll("#allocations tbody tr").forEach((r) => r.classList.toggle("chosen", r.dataset.path === view.budget));
  if (!view.budget) document.getElementById("budget").hidden = true;
  else refreshBudget().catch(report);
});

async function refreshHistory() {
  const hours = Number(document.getElementById("span").value);
  const from = Date.now() - hours * 3600_000;
  const v = await api(`/v1/usage?from=${from}`);
  view.hourly = v.hours.map((h) => ({ from: h.from_ms, to: h.to_ms, held: h.held_gpus }));
  drawChart();
}

function drawChart() {
  const canvas = document.getElementById("chart");
  const ctx = canvas.getContext("2d");
  const W = canvas.width, H = canvas.height, left = 48, bottom = 24, top = 8, right = 8;
  ctx.clearRect(0, 0, W, H);
  const hours = Number(document.getElementById("span").value);
  const end = Date.now(), start = end - hours * 3600_000;
  // Steps: hourly averages until the first live sample, then the samples.
  const firstSample = view.samples.length ? view.samples[0].t : end;
  const steps = [];
  for (const h of view.hourly) {
    const to = Math.min(h.to, firstSample);
    if (to > h.from) steps.push({ from: Math.max(h.from, start), to, held: h.held });
  }
  view.samples.forEach((s, i) => {
    const to = i + 1 < view.samples.length ? view.samples[i + 1].t : end;
    if (to > start) steps.push({ from: Math.max(s.t, start), to, held: s.held });
  });
  const total = (held) => view.leaves.reduce((sum, p) => sum + (held[p] || 0), 0);
  const ymax = Math.max(1, view.capacity, ...steps.map((s) => total(s.held)));
  const x = (t) => left + ((t - start) / (end - start)) * (W - left - right);
  const y = (g) => H - bottom - (g / ymax) * (H - bottom - top);
  // Axes: whole GPUs, and times in UTC.
  ctx.strokeStyle = "#ccc";
  ctx.fillStyle = "#555";
  ctx.font = "11px system-ui, sans-serif";
  const tick = Math.max(1, Math.ceil(ymax / 6));
  for (let g = 0; g <= ymax; g += tick) {
    ctx.beginPath();
    ctx.moveTo(left, y(g));
    ctx.lineTo(W - right, y(g));
    ctx.stroke();
    ctx.fillText(String(g), 4, y(g) + 4);
  }
  const every = hours <= 6 ? 1 : hours <= 24 ? 3 : 24;
  const firstTick = Math.ceil(start / (every * 3600_000)) * every * 3600_000;
  for (let t = firstTick; t <= end; t += every * 3600_000) {
    const label = hours > 24 ? new Date(t).toISOString().slice(5, 10) : new Date(t).toISOString().slice(11, 16);
    ctx.fillText(label, x(t) - 14, H - 6);
  }
  // Stacked by allocation, in tree order.
  for (const s of steps) {
    let base = 0;
    for (const p of view.leaves) {
      const g = s.held[p] || 0;
      if (g <= 0) continue;
      ctx.fillStyle = colour(p);
      ctx.fillRect(x(s.from), y(base + g), Math.max(1, x(s.to) - x(s.from)), y(base) - y(base + g));
      base += g;
    }
  }
  if (view.capacity > 0) {
    ctx.setLineDash([4, 4]);
    ctx.strokeStyle = "#1d232b";
    ctx.beginPath();
    ctx.moveTo(left, y(view.capacity));
    ctx.lineTo(W - right, y(view.capacity));
    ctx.stroke();
    ctx.setLineDash([]);
    ctx.fillStyle = "#1d232b";
    ctx.fillText(`${view.capacity} GPUs`, W - right - 60, y(view.capacity) + 12);
  }
}

// ---- events ---------------------------------------------------------------------------------

const events = [];

function about(e) {
  const p = e.payload || {};
  if (p.workload) return p.name || shortId(p.workload);
  return p.node || p.path || p.name || "-";
}

/// What an event of `type` may change on the page.
function touches(type) {
  if (type.startsWith("workload_") || type.startsWith("preemption_")) return ["waiting", "running", "nodes", "allocations"];
  if (type.startsWith("node_") || type.startsWith("gpu_")) return ["nodes", "waiting"];
  if (type.startsWith("allocation_") || type === "settings_set") return ["allocations", "waiting"];
  return [];
}

function addEvent(seq, e) {
  events.unshift([{ text: seq, num: true }, utc(e.occurred_at_ms), e.type, about(e), e.actor]);
  if (events.length > 50) events.length = 50;
}

async function loadEvents() {
  const head = await api("/v1/events?limit=1");
  const last = head.last_seq || 0;
  const page = await api(`/v1/events?after=${Math.max(0, last - 30)}&limit=30`);
  for (const e of page.events) addEvent(e.seq, e.event);
  view.lastSeq = Math.max(last, ...page.events.map((e) => e.seq));
  fill("events", events);
}

async function follow() {
  for (;;) {
    let reader = null;
    try {
      const res = await fetch(`/v1/events/stream?after=${view.lastSeq}`, { headers: headers() });
      if (res.status === 401 || res.status === 403) {
        // The token expired or was revoked: asking again would only be refused again.
        const problem = await res.json().catch(() => ({}));
        showSignIn(problem.detail || "sign in again");
        view.following = false;
        return;
      }
      if (!res.ok) throw new Error(`HTTP ${res.status}`);
      setStatus("live", "live");
      reader = res.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let end;
        while ((end = buffer.indexOf("\n\n")) >= 0) {
          const block = buffer.slice(0, end);
          buffer = buffer.slice(end + 2);
          let id = null, data = "";
          for (const line of block.split("\n")) {
            if (line.startsWith("id:")) id = Number(line.slice(3).trim());
            else if (line.startsWith("data:")) data += line.slice(5).trim();
          }
          if (id === null || !data) continue;
          view.lastSeq = Math.max(view.lastSeq, id);
          let envelope = null;
          try {
            envelope = JSON.parse(data);
          } catch (e) {
            // An event that is not JSON (the ledger keeps what it could not decode): skip it.
          }
          if (envelope) {
            addEvent(id, envelope);
            touches(envelope.type || "").forEach((what) => view.dirty.add(what));
          } else {
            ["waiting", "running", "nodes", "allocations"].forEach((what) => view.dirty.add(what));
          }
          view.dirty.add("events");
          refreshSoon();
        }
      }
    } catch (e) {
      // The stream broke (the server restarted, the network dropped): try again shortly.
    } finally {
      if (reader) reader.cancel().catch(() => {});
    }
    setStatus("reconnecting…", "down");
    await new Promise((r) => setTimeout(r, 2000));
  }
}

/// Refreshes what the events touched: at once when the last refresh is a second old, else a
/// second after it, never two at a time. Each refresh reads pages and summaries, never whole
/// lists, so the page keeps up however fast events come.
function refreshSoon() {
  if (view.timer || view.refreshing) return;
  const wait = Math.max(0, view.lastRefresh + REFRESH_EVERY - Date.now());
  view.timer = setTimeout(async () => {
    view.timer = null;
    view.refreshing = true;
    view.lastRefresh = Date.now();
    const dirty = view.dirty;
    view.dirty = new Set();
    if (dirty.has("events")) fill("events", events);
    const work = [];
    if (dirty.has("waiting")) work.push(refreshWaiting());
    if (dirty.has("running")) work.push(refreshRunning());
    if (dirty.has("nodes")) work.push(refreshNodes());
    if (dirty.has("allocations")) work.push(refreshAllocations().then(drawChart));
    await Promise.all(work).catch(report);
    view.refreshing = false;
    if (view.dirty.size) refreshSoon();
  }, wait);
}

async function refreshAll() {
  await Promise.all([refreshWaiting(), refreshRunning(), refreshAllocations(), refreshNodes()]);
}

function report(e) {
  if (e instanceof SignInNeeded) showSignIn(e.message);
  else setStatus(e.message, "down");
}

// ---- start ----------------------------------------------------------------------------------

document.getElementById("span").addEventListener("change", () => refreshHistory().catch(report));
document.getElementById("period-apply").addEventListener("click", () => {
  const from = document.getElementById("period-from").value;
  let to = document.getElementById("period-to").value;
  // Days are whole: "to" includes its day.
  if (to) to = new Date(Date.parse(`${to}T00:00:00Z`) + 86_400_000).toISOString().slice(0, 10);
  view.period = from && to && to > from ? { from, to } : null;
  refreshAllocations().catch(report);
});

async function start() {
  if (view.started) {
    // Signed in again: the loops already run; read everything with the new token.
    document.getElementById("login").hidden = true;
    await refreshAll().then(drawChart).catch(report);
    if (!view.following) {
      view.following = true;
      follow();
    }
    return;
  }
  try {
    document.getElementById("login").hidden = true;
    await refreshAll();
    document.getElementById("logout").hidden = !sessionStorage.getItem(TOKEN_KEY);
    await Promise.all([refreshHistory(), loadEvents()]);
  } catch (e) {
    report(e);
    return;
  }
  view.started = true;
  view.following = true;
  setInterval(() => refreshHistory().catch(report), 300_000);
  setInterval(() => refreshAll().then(drawChart).catch(report), 30_000);
  follow();
}

start();
