// A "Parallel" tab in ComfyUI's sidebar: the mesh and, for every rank, its device, liveness,
// host memory, GPU memory (allocated / reserved, with their peaks during the last prompt), the
// peak RSS / USS of the last prompt, the staging buffers' pinned host memory, weights, last step time and what torch.compile
// did (frames compiled; "compiling…" while it does), the links and compute the probe measured,
// the layout "layout: auto" chose per model (with its predicted alternatives), from GET
// /parallel/status, refreshed every second while the tab is open and at once when a prompt
// starts or finishes.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const MB = 1024 * 1024;
const fmtMB = (bytes) => (bytes == null ? "–" : `${(bytes / MB).toFixed(0)} MB`);
const fmtMs = (ms) => (ms == null ? "–" : `${ms.toFixed(ms < 100 ? 1 : 0)} ms`);
const dims = (sizes) => Object.entries(sizes || {}).filter(([, n]) => n > 1).map(([d, n]) => `${d} ${n}`).join(" × ")
  || "single rank";
const GB = 1e9;
// A link's speed as the probe could resolve it: where the larger message took no clearly longer
// than the smaller one (layout/probe.py's "resolved"), only a lower bound is known.
const linkSpeed = (link) => link.resolved === false
  ? `too fast to measure (over ${(link.bytes_per_s / GB).toFixed(1)} GB/s)`
  : `${(link.bytes_per_s / GB).toFixed(1)} GB/s`;
const fmtGpu = (r) => (r.gpu_allocated_bytes == null ? "–"
  : `${(r.gpu_allocated_bytes / MB).toFixed(0)} / ${(r.gpu_reserved_bytes / MB).toFixed(0)} MB`
    + (r.gpu_peak_allocated_bytes == null ? ""
      : ` (peak ${(r.gpu_peak_allocated_bytes / MB).toFixed(0)} / ${(r.gpu_peak_reserved_bytes / MB).toFixed(0)} MB)`));
const fmtPeaks = (r) => (r.rss_peak_bytes == null && r.uss_peak_bytes == null ? "–"
  : `${fmtMB(r.rss_peak_bytes)} / ${fmtMB(r.uss_peak_bytes)}`);

function el(tag, attrs = {}, children = []) {
  const node = document.createElement(tag);
  const { dataset, ...rest } = attrs;
  Object.assign(node, rest);
  Object.assign(node.dataset, dataset ?? {});
  for (const child of children) node.append(child);
  return node;
}

function render(root, status) {
  const mesh = status.layout === "auto" ? "layout auto" : dims(status.mesh);
  const links = status.probe?.links;
  const probe = links
    ? [el("div", { className: "hp-probe", textContent: `links: all-to-all ${linkSpeed(links.all_to_all)}, `
        + `send/recv ${linkSpeed(links.send_recv)}, all-reduce ${linkSpeed(links.all_reduce)}` })]
    : [];
  const chosen = (status.layouts || []).map((c) => el("div", { className: "hp-layout",
    textContent: `${c.model} (${c.tokens} tokens, batch ${c.batch}): ${dims(c.layout)}, predicted `
      + `${fmtMs(c.predicted_step_ms)}` + c.alternatives.slice(1, 3).map((a) => `; ${dims(a.sizes)} ${fmtMs(a.step_ms)}`).join("")
      + (c.weights?.length ? `; tokens by measured speed ${c.weights.map((w) => w.toFixed(2)).join(" : ")}` : "") }));
  const notes = (status.notes || []).map((n) => el("div", { className: "hp-note", textContent: n }));
  const cache = (status.block_cache || []).slice(-1).map((c) => el("div", { className: "hp-block-cache",
    textContent: `Block Cache, last prompt: ${c.computed} steps computed, ${c.cached} cached` }));
  const header = el("div", { className: "hp-header" }, [
    el("div", { textContent: `World size ${status.world_size} — ${mesh}` }),
    ...probe, ...chosen, ...notes, ...cache,
    el("div", { textContent: `state: ${status.state}${status.backend ? ` · ${status.backend}` : ""}`
      + `${status.transport ? ` · weights by ${status.transport}` : ""}` }),
    ...(status.compiling
      ? [el("div", { className: "hp-compiling", textContent: "compiling (torch.compile): the first step of a new size is slow" })]
      : []),
  ]);
  const rows = (status.ranks || []).map((r) =>
    el("tr", { className: "hp-rank", dataset: { rank: r.rank } }, [
      el("td", { textContent: r.rank }),
      el("td", { textContent: r.device ?? "–" }),
      el("td", { textContent: r.alive ? "●" : "✕", style: `color:${r.alive ? "#6c6" : "#f66"}` }),
      el("td", { textContent: fmtMB(r.pss_bytes ?? r.rss_bytes) }),
      el("td", { textContent: fmtGpu(r), className: "hp-gpu" }),
      el("td", { textContent: fmtPeaks(r), className: "hp-peaks",
        title: "peak RSS / USS since this prompt's first sharded step (USS: CPU ranks, sampled after each step)" }),
      el("td", { textContent: fmtMB(r.host_pinned_bytes), className: "hp-pinned",
        title: `pinned host buffers of staged collectives (gloo on GPU tensors); kept for reuse: ${fmtMB(r.host_kept_bytes)}` }),
      el("td", { textContent: fmtMB(r.param_bytes) }),
      el("td", { textContent: fmtMs(r.last_forward_ms), className: "hp-last-ms" }),
      el("td", { textContent: r.forwards ?? 0, className: "hp-forwards" }),
      el("td", { className: "hp-compiles",
        title: "frames torch.compile compiled (again: for a size already run); from cache: graphs loaded from inductor's on-disk cache instead of built",
        textContent: r.compiling ? "compiling…" : `${r.compiles ?? 0}${r.recompiles ? ` (${r.recompiles} again)` : ""}`
          + (r.compile_cache?.hits ? `, ${r.compile_cache.hits} from cache` : "") }),
    ]),
  );
  const table = el("table", { className: "hp-ranks" }, [
    el("thead", {}, [el("tr", {}, ["rank", "device", "alive", "memory", "GPU alloc / reserved", "peak RSS / USS", "pinned", "weights",
      "last step", "steps", "compiled"]
      .map((h) => el("th", { textContent: h })))]),
    el("tbody", {}, rows),
  ]);
  const failure = status.last_failure
    ? [el("div", { className: "hp-failure", textContent: `last failure: ${status.last_failure.message.split("\n")[0]}` })]
    : [];
  root.replaceChildren(header, table, ...failure);
}

const style = `
.hp-panel { padding: 8px; font: 12px sans-serif; }
.hp-panel .hp-header { margin-bottom: 6px; line-height: 1.5; }
.hp-panel table { width: 100%; border-collapse: collapse; }
.hp-panel th, .hp-panel td { text-align: left; padding: 2px 4px; border-bottom: 1px solid #4444; }
.hp-panel .hp-failure { color: #f77; margin-top: 6px; white-space: pre-wrap; }
.hp-panel .hp-compiling { color: #fc6; }
.hp-panel .hp-note { color: #fc6; }
`;

app.registerExtension({
  name: "hybrid_parallel.status_panel",
  async setup() {
    document.head.append(el("style", { textContent: style }));
    let root = null;
    let timer = null;
    const refresh = async () => {
      if (!root?.isConnected) return;
      try {
        const response = await api.fetchApi("/parallel/status");
        render(root, await response.json());
      } catch (error) {
        root.textContent = `could not read /parallel/status: ${error}`;
      }
    };
    app.extensionManager.registerSidebarTab({
      id: "hybrid-parallel",
      icon: "pi pi-sitemap",
      title: "Parallel",
      tooltip: "Parallel ranks: mesh, devices, memory, step times",
      type: "custom",
      render: (container) => {
        root = el("div", { className: "hp-panel", id: "hybrid-parallel-panel", textContent: "…" });
        container.replaceChildren(root);
        refresh();
        clearInterval(timer);
        timer = setInterval(refresh, 1000);
      },
      destroy: () => {
        clearInterval(timer);
        root = null;
      },
    });
    for (const event of ["execution_start", "executed", "execution_success", "execution_error"]) {
      api.addEventListener(event, refresh);
    }
  },
});
