// The dashboard: reads the API with the token kept in this tab's session storage (given once as
// #token=… in the URL, or typed into the sign-in box), and follows the ledger's event stream to
// redraw what changed. Everything from the server is written as text, never as markup.
"use strict";

const TOKEN_KEY = "fairledger-token";
const UNALLOCATED = "(unallocated)";
const view = {
  lastSeq: 0,
  work: new Map(), // workload id -> {allocation, name}
  leaves: [], // leaf allocation paths, in tree order
  colours: new Map(),
  hourly: [], // [{from, to, held: {path: gpus}}]
  samples: [], // [{t, held: {path: gpus}}] while the page is open
  capacity: 0,
  refreshing: null,
  period: null,
  started: false,
  following: false,
};

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
        { text: num(a.owed_gpu_hours, 2), num: true },
        { text: num(a.delivered_gpu_hours, 2), num: true },
        { text: num(a.period_owed_gpu_hours, 2), num: true },
        { text: num(a.period_delivered_gpu_hours, 2), num: true },
      ];
    }),
  );
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

async function refreshWork() {
  const [running, pending, queue] = await Promise.all([
    listed("phase=running"),
    listed("phase=pending,stopped"),
    api("/v1/queue"),
  ]);
  view.work.clear();
  for (const w of [...running.workloads, ...pending.workloads]) {
    view.work.set(w.id, { allocation: w.allocation, name: w.name });
  }
  fill(
    "running",
    running.workloads.map((w) => [
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
  fill(
    "waiting",
    queue.pending.map((p) => {
      const start = p.reason && (p.reason.start_at_ms || p.reason.until_ms);
      return [
        { text: p.position, num: true },
        (view.work.get(p.id) || {}).name || "-",
        shortId(p.id),
        p.allocation || UNALLOCATED,
        p.user,
        { text: `${p.nodes}×${p.gpus_per_node}`, num: true },
        span((Date.now() - p.submitted_at_ms) / 1000),
        p.reason ? p.reason.code.replaceAll("_", " ") : "-",
        start ? when(start) : "-",
      ];
    }),
  );
}

/// Every workload a listing's `query` selects, page after page (at most 20 pages).
async function listed(query) {
  const workloads = [];
  let before = null;
  for (let page = 0; page < 20; page++) {
    const v = await api(`/v1/workloads?${query}&limit=1000${before ? `&before=${before}` : ""}`);
    workloads.push(...v.workloads);
    before = v.next_before;
    if (!before) break;
  }
  return { workloads };
}

async function refreshNodes() {
  const v = await api("/v1/nodes");
  view.capacity = v.nodes.reduce((sum, n) => sum + n.gpus, 0);
  const grid = document.getElementById("gpus");
  grid.replaceChildren(
    ...v.nodes.map((n) => {
      const row = document.createElement("div");
      row.className = "node";
      const name = document.createElement("span");
      name.className = "name";
      name.textContent = n.node;
      row.appendChild(name);
      for (const g of n.gpu) {
        const cell = document.createElement("span");
        cell.className = "gpu";
        const holder = g.workload ? view.work.get(g.workload) : null;
        if (g.healthy === false) {
          cell.classList.add("unhealthy");
          cell.textContent = "✕";
        } else if (g.workload) {
          cell.style.background = colour(holder ? holder.allocation : null);
        } else {
          cell.classList.add("free");
        }
        if (n.draining) cell.classList.add("draining");
        cell.title = `${n.node} GPU ${g.gpu}: ${g.workload ? `${(holder && holder.allocation) || UNALLOCATED} (${(holder && holder.name) || g.workload})` : "free"}${g.healthy === false ? ", unhealthy" : ""}`;
        row.appendChild(cell);
      }
      if (n.draining) {
        const tag = document.createElement("span");
        tag.className = "tag";
        tag.textContent = "draining";
        row.appendChild(tag);
      }
      return row;
    }),
  );
  fill(
    "nodes",
    v.nodes.map((n) => {
      const held = n.gpu.filter((g) => g.workload && typeof g.utilization_pct === "number");
      const util = held.length ? `${Math.round(held.reduce((s, g) => s + g.utilization_pct, 0) / held.length)}%` : "-";
      const down = n.gpu.filter((g) => g.healthy === false).map((g) => g.gpu);
      return [n.node, n.model, { text: n.gpus, num: true }, { text: n.free_gpus, num: true }, n.state, util, down.length ? down.join(",") : "-"];
    }),
  );
}

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
  const id = p.workload;
  if (id) {
    const w = view.work.get(id);
    return (w && w.name) || p.name || shortId(id);
  }
  return p.node || p.path || p.name || "-";
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
          if (envelope) addEvent(id, envelope);
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

function refreshSoon() {
  if (view.refreshing) return;
  view.refreshing = setTimeout(async () => {
    view.refreshing = null;
    fill("events", events);
    await refreshAll().catch(report);
    drawChart();
  }, 250);
}

async function refreshAll() {
  await refreshWork();
  await Promise.all([refreshAllocations(), refreshNodes()]);
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
