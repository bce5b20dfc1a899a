// A "Parallel" tab in ComfyUI's sidebar, read at a glance at the sidebar's default width: the
// world and its state; the mesh drawn as its groups (cfg × ring × ulysses × tp: which ranks talk
// to which); for "layout: auto" the predicted step time of each layout beside the measured one;
// and a compact card per rank: liveness, last step, memory bars against the device's capacity
// (host and GPU, current and peak), a step-time sparkline (all ranks on one scale, so a slow rank
// stands out), a progress bar while weights load (the rank's `load` field, where the runtime sends
// one), the rest of its figures on expand. From GET /parallel/status (capacities from ComfyUI's
// own /system_stats), refreshed every second while the tab is open, at once when a prompt starts
// or finishes, and at most four times a second while it steps. Nothing here is wider than the
// panel: long texts wrap, figures that need room go one per line.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const MB = 1024 * 1024;
const GB = 1e9;
const HISTORY = 30; // steps kept per rank for the sparklines
const fmtMB = (bytes) => (bytes == null ? "–" : `${(bytes / MB).toFixed(0)} MB`);
const fmtBytes = (bytes) => (bytes == null ? "–" : bytes >= 1024 * MB ? `${(bytes / (1024 * MB)).toFixed(1)} GB`
  : bytes >= 10 * MB ? `${(bytes / MB).toFixed(0)} MB` : `${(bytes / MB).toFixed(1)} MB`);
const fmtMs = (ms) => (ms == null ? "–" : `${ms.toFixed(ms < 100 ? 1 : 0)} ms`);
const DIMS = ["cfg", "ring", "ulysses", "tp"];
const dims = (sizes) => Object.entries(sizes || {}).filter(([, n]) => n > 1).map(([d, n]) => `${d} ${n}`).join(" × ")
  || "single rank";
// A link's speed as the probe could resolve it: where the larger message took no clearly longer
// than the smaller one (layout/probe.py's "resolved"), only a lower bound is known.
const linkSpeed = (link) => link.resolved === false
  ? `too fast to measure (over ${(link.bytes_per_s / GB).toFixed(1)} GB/s)`
  : `${(link.bytes_per_s / GB).toFixed(1)} GB/s`;
const SVG = "http://www.w3.org/2000/svg";

function el(tag, attrs = {}, children = []) {
  const node = document.createElement(tag);
  const { dataset, ...rest } = attrs;
  Object.assign(node, rest);
  Object.assign(node.dataset, dataset ?? {});
  for (const child of children) node.append(child);
  return node;
}

function svg(tag, attrs = {}, children = []) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  for (const child of children) node.append(child);
  return node;
}

// ---- client-side state kept across polls ----------------------------------------------------

// Per rank: the process and step count seen last, and the last HISTORY step times.
const history = new Map();
const openDetails = new Set(); // ranks whose details the user opened
let capacity = { ramTotal: null, devices: [], read: 0, key: "" };

function remember(status) {
  const ranks = status.ranks || [];
  for (const key of [...history.keys()]) if (key >= ranks.length) history.delete(key);
  for (const r of ranks) {
    let h = history.get(r.rank);
    const forwards = r.forwards ?? 0;
    if (!h || h.pid !== r.pid || forwards < h.forwards) {
      h = { pid: r.pid, forwards: 0, points: [] }; // a new world (or rank process): a new history
      history.set(r.rank, h);
    }
    if (forwards > h.forwards && r.last_forward_ms != null) {
      h.points.push(r.last_forward_ms);
      if (h.points.length > HISTORY) h.points.shift();
    }
    h.forwards = forwards;
  }
}

// Read again every 30 s, and at once for a world on other devices.
async function readCapacity(status) {
  const key = (status.ranks || []).map((r) => r.device).join(",");
  if (Date.now() - capacity.read < 30000 && key === capacity.key) return;
  capacity.read = Date.now();
  capacity.key = key;
  try {
    const stats = await (await api.fetchApi("/system_stats")).json();
    Object.assign(capacity, { ramTotal: stats.system?.ram_total ?? null, devices: stats.devices || [] });
  } catch {
    // keep what was known
  }
}

// GPU figures, where the rank has them. Never on a CPU rank: a worker's status row holds zeros there
// until its first report (during its first weight load, say), and ComfyUI lists the CPU among its
// devices with the machine's RAM, which would draw a "GPU" bar against it.
const hasGpu = (r) => r.gpu_allocated_bytes != null && !/^cpu(:|$)/.test(r.device || "");

// The memory a rank's device holds, where ComfyUI's /system_stats lists that device.
function gpuCapacity(r) {
  const m = /^([a-z]+)(?::(\d+))?$/.exec(r.device || "");
  if (!m || (r.host && r.host !== "local")) return null;
  const index = m[2] == null ? 0 : Number(m[2]);
  const d = capacity.devices.find((d) => d.type === m[1] && (d.index ?? 0) === index);
  return d?.vram_total || null;
}

// ---- pictures -------------------------------------------------------------------------------

// A bar of `parts` ({value, cls}) against `total`, with a peak mark. Where the capacity is unknown
// (a rank on another host), against `fallback` (the largest figure of any rank), and said so.
function memoryBar(kind, label, parts, peak, total, fallback) {
  const scale = total || fallback || 1;
  const pct = (v) => `${Math.min(100, Math.max(0, (100 * v) / scale)).toFixed(3)}%`;
  const track = el("div", { className: "hp-track" }, parts.filter((p) => p.value != null).map((p) =>
    el("div", { className: `hp-fill ${p.cls}`, style: `width:${pct(p.value)}`, dataset: { value: p.value } })));
  if (peak != null) track.append(el("div", { className: "hp-peak", style: `left:${pct(peak)}`, dataset: { value: peak } }));
  const of = total ? ` of ${fmtBytes(total)}` : " (scale: the fullest rank)";
  return el("div", { className: "hp-mem", dataset: { kind, total: total || "" } }, [
    el("div", { className: "hp-label", textContent: `${label}${of}` }), track]);
}

function sparkline(points, max) {
  const width = 100, height = 22, slot = width / HISTORY;
  const bars = points.map((v, i) => {
    const h = Math.max(1, (height * v) / max);
    const x = (HISTORY - points.length + i) * slot;
    return svg("rect", { x: (x + slot * 0.1).toFixed(2), y: (height - h).toFixed(2),
      width: (slot * 0.8).toFixed(2), height: h.toFixed(2) });
  });
  return svg("svg", { class: "hp-spark", viewBox: `0 0 ${width} ${height}`, preserveAspectRatio: "none",
    "data-points": points.length, role: "img",
    "aria-label": `last ${points.length} step times: ${points.map((v) => v.toFixed(1)).join(", ")} ms` }, [
    svg("rect", { class: "hp-spark-bg", x: 0, y: 0, width, height }), ...bars]);
}

function loadBar(load) {
  if (!load || !(load.total_bytes > 0) || !(load.done_bytes < load.total_bytes)) return [];
  const pct = Math.max(0, Math.min(100, (100 * load.done_bytes) / load.total_bytes));
  return [el("div", { className: "hp-load", dataset: { done: load.done_bytes, total: load.total_bytes } }, [
    el("div", { className: "hp-label",
      textContent: `loading weights${load.via ? ` via ${load.via}` : ""}: ${fmtBytes(load.done_bytes)} / `
        + `${fmtBytes(load.total_bytes)} (${pct.toFixed(0)}%)` }),
    el("div", { className: "hp-track" }, [el("div", { className: "hp-fill hp-fill-load", style: `width:${pct.toFixed(2)}%` })]),
  ])];
}

// The mesh as its groups: a box per cfg branch, in it a row per ring position (the ranks of a row
// swap heads: Ulysses all-to-all) and a column per Ulysses position (the ranks of a column pass
// keys and values round the ring), a pill per tensor-parallel group (they split the weights).
function meshPicture(status, slow) {
  const ranks = status.ranks || [];
  const mesh = status.mesh || {};
  if (ranks.length < 2 || !ranks.every((r) => r.coords)) return [];
  const size = (d) => mesh[d] || 1;
  const chip = (r) => el("span", { className: `hp-chip${r.alive ? "" : " hp-dead"}${slow.has(r.rank) ? " hp-slow" : ""}`,
    textContent: r.rank, dataset: { rank: r.rank },
    title: `rank ${r.rank} (${r.device ?? "–"}): ` + DIMS.map((d) => `${d} ${r.coords[d]}`).join(", ") });
  const at = (c, g, u) => ranks.filter((r) => r.coords.cfg === c && r.coords.ring === g && r.coords.ulysses === u)
    .sort((a, b) => a.coords.tp - b.coords.tp);
  const boxes = [];
  for (let c = 0; c < size("cfg"); c++) {
    const rows = [];
    for (let g = 0; g < size("ring"); g++) {
      rows.push(el("div", { className: "hp-mesh-row" }, Array.from({ length: size("ulysses") }, (_, u) =>
        el("span", { className: size("tp") > 1 ? "hp-tp" : "hp-cell" }, at(c, g, u).map(chip)))));
    }
    boxes.push(el("div", { className: "hp-cfg", dataset: { cfg: c } }, [
      ...(size("cfg") > 1 ? [el("div", { className: "hp-label", textContent: c === 0 ? "cfg: cond" : "cfg: uncond" })] : []),
      ...rows]));
  }
  const legend = [
    size("ulysses") > 1 && "a row swaps heads (Ulysses)",
    size("ring") > 1 && "a column passes K/V (ring)",
    size("tp") > 1 && "a pill splits the weights (TP)",
    size("cfg") > 1 && "a box per CFG branch",
  ].filter(Boolean).join("; ");
  return [el("div", { className: "hp-section hp-mesh" }, [
    el("div", { className: "hp-heading", textContent: `mesh: ${dims(mesh)}` }),
    el("div", { className: "hp-mesh-boxes" }, boxes),
    ...(legend ? [el("div", { className: "hp-legend", textContent: legend })] : []),
  ])];
}

// layout: auto: each model's predicted step time per layout beside the one measured.
function layoutPicture(status) {
  if (!status.layouts?.length) return [];
  const current = dims(status.mesh);
  const measured = status.ranks?.[0]?.last_forward_ms;
  return [el("div", { className: "hp-section hp-layouts" }, status.layouts.map((c, index) => {
    const chosen = dims(c.layout);
    const rows = (c.alternatives || []).slice(0, 3).map((a) => ({ label: dims(a.sizes), ms: a.step_ms,
      cls: dims(a.sizes) === chosen ? "hp-fill-chosen" : "hp-fill-alt", kind: "predicted" }));
    if (index === status.layouts.length - 1 && chosen === current && measured != null) {
      rows.push({ label: `${chosen}, measured`, ms: measured, cls: "hp-fill-measured", kind: "measured" });
    }
    const max = Math.max(...rows.map((r) => r.ms), 1e-9);
    return el("div", { className: "hp-layout", dataset: { model: c.model } }, [
      el("div", { className: "hp-heading", textContent: `layout auto, ${c.model} (${c.tokens} tokens, batch ${c.batch}): `
        + `chose ${chosen}` + (c.weights?.length ? `; tokens by speed ${c.weights.map((w) => w.toFixed(2)).join(" : ")}` : "") }),
      ...rows.map((r) => el("div", { className: "hp-pred", dataset: { kind: r.kind } }, [
        el("div", { className: "hp-label", textContent: `${r.label}: ${fmtMs(r.ms)}${r.kind === "predicted" ? " predicted" : ""}` }),
        el("div", { className: "hp-track" }, [el("div", { className: `hp-fill ${r.cls}`,
          style: `width:${((100 * r.ms) / max).toFixed(2)}%` })]),
      ])),
    ]);
  }))];
}

// ---- the panel ------------------------------------------------------------------------------

function rankCard(r, ctx) {
  const hostNow = r.pss_bytes ?? r.rss_bytes;
  const hostPeak = r.rss_peak_bytes ?? null;
  // Now: PSS (pages shared between ranks counted once), else RSS; the peak: the kernel's RSS high-water mark.
  const hostNowKind = r.pss_bytes != null ? "PSS" : "RSS";
  const bars = [memoryBar("host", `host ${fmtBytes(hostNow)} ${hostNowKind}`
    + `${hostPeak != null ? `, peak ${fmtBytes(hostPeak)} RSS` : ""}`,
    [{ value: hostNow, cls: "hp-fill-host" }], hostPeak,
    (r.host == null || r.host === "local") ? capacity.ramTotal : null, ctx.hostMax)];
  if (hasGpu(r)) {
    bars.push(memoryBar("gpu", `GPU ${fmtBytes(r.gpu_allocated_bytes)} / ${fmtBytes(r.gpu_reserved_bytes)} reserved`
      + (r.gpu_peak_reserved_bytes != null ? `, peak ${fmtBytes(r.gpu_peak_reserved_bytes)}` : ""),
    [{ value: r.gpu_reserved_bytes, cls: "hp-fill-reserved" }, { value: r.gpu_allocated_bytes, cls: "hp-fill-gpu" }],
    r.gpu_peak_reserved_bytes, gpuCapacity(r), ctx.gpuMax));
  }
  const points = history.get(r.rank)?.points || [];
  const compiled = r.compiling ? "compiling…" : `${r.compiles ?? 0}${r.recompiles ? ` (${r.recompiles} again)` : ""}`
    + (r.compile_cache?.hits ? `, ${r.compile_cache.hits} from cache` : "");
  const facts = [
    ["memory (PSS)", fmtMB(r.pss_bytes ?? r.rss_bytes)],
    ["peak RSS / USS", r.rss_peak_bytes == null && r.uss_peak_bytes == null ? "–"
      : `${fmtMB(r.rss_peak_bytes)} / ${fmtMB(r.uss_peak_bytes)}`],
    ["GPU alloc / reserved", !hasGpu(r) ? "–"
      : `${fmtMB(r.gpu_allocated_bytes)} / ${fmtMB(r.gpu_reserved_bytes)}`
        + (r.gpu_peak_allocated_bytes == null ? "" : ` (peak ${fmtMB(r.gpu_peak_allocated_bytes)} / ${fmtMB(r.gpu_peak_reserved_bytes)})`)],
    ["pinned / kept", `${fmtMB(r.host_pinned_bytes)} / ${fmtMB(r.host_kept_bytes)}`],
    ["weights", fmtMB(r.param_bytes)],
    ["steps", `${r.forwards ?? 0}`],
    ["compiled", compiled],
    ...(r.heads ? [["heads", `${r.heads.real} real, ${r.heads.attended} attended`]] : []),
    ["pid", `${r.pid ?? "–"}${r.host && r.host !== "local" ? ` on ${r.host}` : ""}`],
  ];
  // The card is a <details>: its summary is the glance (head, bars, sparkline), a click opens the
  // rest of the figures below it; hovering shows them all too.
  const slow = ctx.slow.has(r.rank);
  const card = el("details", { className: `hp-rank${slow ? " hp-slow" : ""}`, open: openDetails.has(r.rank),
    dataset: { rank: r.rank }, title: facts.map(([k, v]) => `${k}: ${v}`).join("\n") }, [
    el("summary", {}, [
      el("div", { className: "hp-rank-head" }, [
        el("span", { className: "hp-rank-id", textContent: `rank ${r.rank}` }),
      el("span", { className: "hp-device", textContent: r.device ?? "–" }),
      el("span", { className: `hp-alive${r.alive ? "" : " hp-dead"}`, textContent: r.alive ? "● alive" : "✕ down" }),
      el("span", { className: "hp-last-ms", textContent: fmtMs(r.last_forward_ms) }),
      el("span", { className: "hp-steps" }, [el("span", { className: "hp-forwards", textContent: `${r.forwards ?? 0}` }), " steps"]),
        ...(r.compiling ? [el("span", { className: "hp-compiling", textContent: "compiling…" })] : []),
      ]),
      ...loadBar(r.load),
      ...bars,
      el("div", { className: "hp-spark-box" }, [sparkline(points, ctx.stepMax)]),
    ]),
    el("dl", { className: "hp-details" }, facts.flatMap(([k, v]) => [el("dt", { textContent: k }), el("dd", { textContent: v })])),
  ]);
  card.addEventListener("toggle", () => (card.open ? openDetails.add(r.rank) : openDetails.delete(r.rank)));
  return card;
}

function render(root, status) {
  remember(status);
  const ranks = status.ranks || [];
  const stepMax = Math.max(1e-9, ...ranks.flatMap((r) => history.get(r.rank)?.points || []));
  // A slow rank: its last step clearly above the others' middle one.
  const last = ranks.map((r) => r.last_forward_ms).filter((v) => v != null).sort((a, b) => a - b);
  const middle = last[Math.floor(last.length / 2)];
  const slow = new Set(ranks.length > 1 && middle ? ranks.filter((r) => r.last_forward_ms > 1.3 * middle).map((r) => r.rank) : []);
  const ctx = {
    stepMax, slow,
    hostMax: Math.max(0, ...ranks.map((r) => Math.max(r.pss_bytes ?? r.rss_bytes ?? 0, r.rss_peak_bytes ?? 0))),
    gpuMax: Math.max(0, ...ranks.filter(hasGpu).map((r) => Math.max(r.gpu_reserved_bytes ?? 0, r.gpu_peak_reserved_bytes ?? 0))),
  };
  const links = status.probe?.links;
  const line = (cls, text) => el("div", { className: cls, textContent: text });
  const header = el("div", { className: "hp-header" }, [
    line("hp-title", `World size ${status.world_size} — ${status.layout === "auto" ? `layout auto, now ${dims(status.mesh)}` : dims(status.mesh)}`),
    line("hp-state", `state: ${status.state}${status.backend ? ` · ${status.backend}` : ""}`
      + `${status.transport ? ` · weights by ${status.transport}` : ""}`),
    ...(links ? [line("hp-probe", `links: all-to-all ${linkSpeed(links.all_to_all)}, send/recv `
      + `${linkSpeed(links.send_recv)}, all-reduce ${linkSpeed(links.all_reduce)}`)] : []),
    ...(status.compiling ? [line("hp-compiling", "compiling (torch.compile): the first step of a new size is slow")] : []),
    ...(status.notes || []).map((n) => line("hp-note", n)),
    ...(status.block_cache || []).slice(-1).map((c) => line("hp-block-cache",
      `Block Cache, last prompt: ${c.computed} steps computed, ${c.cached} cached`)),
  ]);
  const scale = el("div", { className: "hp-legend hp-spark-scale",
    textContent: (stepMax > 1e-6 ? `step time, last ${HISTORY} steps seen, every rank on one scale: 0 to ${fmtMs(stepMax)}`
      : "step time: no step seen yet") + (slow.size ? `; slow: rank ${[...slow].join(", ")}` : "") });
  const failure = status.last_failure
    ? [line("hp-failure", `last failure: ${status.last_failure.message.split("\n")[0]}`)] : [];
  root.replaceChildren(header, ...meshPicture(status, slow), ...layoutPicture(status),
    el("div", { className: "hp-section hp-ranks" }, [scale, ...ranks.map((r) => rankCard(r, ctx))]), ...failure);
}

const style = `
.hp-panel { padding: 8px; font: 12px sans-serif; box-sizing: border-box; width: 100%; max-width: 100%;
  overflow-wrap: anywhere; color: var(--fg-color, inherit); }
.hp-panel * { box-sizing: border-box; min-width: 0; }
.hp-panel .hp-header { margin-bottom: 6px; line-height: 1.45; }
.hp-panel .hp-title { font-weight: bold; }
.hp-panel .hp-section { margin: 6px 0; }
.hp-panel .hp-heading { font-weight: bold; margin-bottom: 2px; }
.hp-panel .hp-label, .hp-panel .hp-legend { font-size: 11px; opacity: 0.85; line-height: 1.3; }
.hp-panel .hp-track { position: relative; height: 7px; border-radius: 3px; background: rgba(128,128,128,0.25);
  overflow: hidden; margin: 1px 0 3px; }
.hp-panel .hp-fill { position: absolute; left: 0; top: 0; bottom: 0; min-width: 2px; border-radius: 3px; }
.hp-panel .hp-fill-host { background: #3b8fd9; }
.hp-panel .hp-fill-gpu { background: #8a5cd6; }
.hp-panel .hp-fill-reserved { background: rgba(138,92,214,0.4); }
.hp-panel .hp-fill-load { background: #2aa876; }
.hp-panel .hp-fill-chosen, .hp-panel .hp-fill-alt { background: #7a8aa0; }
.hp-panel .hp-fill-chosen { background: #3b8fd9; }
.hp-panel .hp-fill-measured { background: #2aa876; }
.hp-panel .hp-peak { position: absolute; top: 0; bottom: 0; width: 2px; margin-left: -1px; background: #e0463c; }
.hp-panel .hp-rank { border: 1px solid rgba(128,128,128,0.35); border-radius: 4px; padding: 4px 6px; margin: 4px 0; }
.hp-panel .hp-rank.hp-slow { border-color: #e0a030; }
.hp-panel .hp-rank-head { display: flex; flex-wrap: wrap; gap: 0 8px; align-items: baseline; }
.hp-panel .hp-rank-id { font-weight: bold; }
.hp-panel .hp-last-ms { margin-left: auto; }
.hp-panel .hp-alive { color: #3a3; }
.hp-panel .hp-dead { color: #e0463c; }
.hp-panel .hp-spark { display: block; width: 100%; height: 18px; fill: #2aa876; }
.hp-panel .hp-slow .hp-spark { fill: #e0a030; }
.hp-panel .hp-spark-bg { fill: rgba(128,128,128,0.12); }
.hp-panel .hp-rank > summary { display: block; list-style: none; cursor: pointer; }
.hp-panel .hp-rank > summary::-webkit-details-marker { display: none; }
.hp-panel .hp-rank-id::before { content: "▸ "; opacity: 0.6; }
.hp-panel .hp-rank[open] .hp-rank-id::before { content: "▾ "; }
.hp-panel dl { display: grid; grid-template-columns: max-content 1fr; gap: 0 8px; margin: 2px 0; }
.hp-panel dd { margin: 0; }
.hp-panel .hp-mesh-boxes { display: flex; flex-wrap: wrap; gap: 6px; }
.hp-panel .hp-cfg { border: 1px dashed rgba(128,128,128,0.6); border-radius: 4px; padding: 3px; }
.hp-panel .hp-mesh-row { display: flex; gap: 3px; margin: 2px 0; }
.hp-panel .hp-cell, .hp-panel .hp-tp { display: inline-flex; gap: 2px; }
.hp-panel .hp-tp { border: 1px solid rgba(128,128,128,0.6); border-radius: 9px; padding: 1px; }
.hp-panel .hp-chip { display: inline-block; min-width: 20px; padding: 1px 4px; border-radius: 3px; text-align: center;
  background: #3b8fd9; color: #fff; font-size: 11px; }
.hp-panel .hp-chip.hp-slow { background: #e0a030; }
.hp-panel .hp-chip.hp-dead { background: #e0463c; }
.hp-panel .hp-failure { color: #e0463c; margin-top: 6px; white-space: pre-wrap; }
.hp-panel .hp-compiling, .hp-panel .hp-note { color: #d08a00; }
`;

let panelRoot = null; // the tab's root while it is open

async function refresh() {
  const root = panelRoot;
  if (!root?.isConnected) return;
  try {
    const response = await api.fetchApi("/parallel/status");
    const status = await response.json();
    await readCapacity(status);
    if (root.isConnected) render(root, status);
  } catch (error) {
    root.textContent = `could not read /parallel/status: ${error}`;
  }
}

app.registerExtension({
  name: "hybrid_parallel.status_panel",
  async setup() {
    document.head.append(el("style", { textContent: style }));
    let timer = null;
    let throttled = 0;
    app.extensionManager.registerSidebarTab({
      id: "hybrid-parallel",
      icon: "pi pi-sitemap",
      title: "Parallel",
      tooltip: "Parallel ranks: mesh, devices, memory, step times",
      type: "custom",
      render: (container) => {
        panelRoot = el("div", { className: "hp-panel", id: "hybrid-parallel-panel", textContent: "…" });
        container.replaceChildren(panelRoot);
        refresh();
        clearInterval(timer);
        timer = setInterval(refresh, 1000);
      },
      destroy: () => {
        clearInterval(timer);
        panelRoot = null;
      },
    });
    for (const event of ["execution_start", "executed", "execution_success", "execution_error"]) {
      api.addEventListener(event, refresh);
    }
    // Sampler steps: at most four reads a second (the figures are cached on the server anyway).
    api.addEventListener("progress", () => {
      if (Date.now() - throttled < 250) return;
      throttled = Date.now();
      refresh();
    });
  },
});
