"""The real ComfyUI front end in headless Chromium, at its default window (1600x1000) and sidebar
width: the pack's nodes in the node library, Parallel Config's inline validation (inside the node
whatever the message's length), tiny sharded prompts run from the page in worlds of 2, 4 and 8 CPU
ranks, and the Parallel sidebar tab while they run: every figure inside the panel, none cut off
or hidden, in the dark and the light theme; the memory bars and step-time sparklines drawn and
changing; the mesh drawn as its groups; layout auto's predictions beside the measured step; a
loading bar per rank while a real weight load, slowed, is under way. Leaves screenshots in
out/browser/."""
import json
import os
import re
import sys
import time
from urllib.parse import urlsplit

import pytest

from conftest import REPO

pytestmark = pytest.mark.comfy_server
SCREENSHOTS = REPO / "out" / "browser"
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
PANEL = "document.getElementById('hybrid-parallel-panel')"


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    assert os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER), \
        "Chromium is missing: tools/test.sh installs Debian's chromium and chromium-driver (needs root)"
    options = Options()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--window-size=1600,1000", f"--user-data-dir={tmp_path_factory.mktemp('chromium')}"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    yield driver
    driver.quit()


def wait_for(driver, script, timeout=60, what="condition", *args):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = driver.execute_script(script, *args)
        if value:
            return value
        time.sleep(0.25)
    raise TimeoutError(f"timed out waiting for {what}")


def click_button(driver, label):
    driver.execute_script("""
        const b = Array.from(document.querySelectorAll('button')).find(
            b => (b.getAttribute('aria-label') || b.innerText || '').trim().startsWith(arguments[0]));
        if (!b) throw new Error('no button ' + arguments[0]);
        b.click();""", label)


def close_dialogs(driver):
    driver.execute_script("document.querySelectorAll('.p-dialog [aria-label=Close], .p-dialog-close-button')"
                          ".forEach(b => b.click());")


def open_front_end(browser, server):
    # Already there: this server's page (the browser may have shown another server's) with the pack.
    if urlsplit(browser.current_url).netloc == urlsplit(server.url).netloc and browser.execute_script(
            "return !!(window.app && window.app.extensions && window.app.extensions.some("
            "e => e.name === 'hybrid_parallel.status_panel'))"):
        return
    # A first visit opens the template browser over the canvas; this user has seen it.
    server.post("/settings/Comfy.TutorialCompleted", True)
    browser.get(server.url)
    wait_for(browser, "return window.app && window.app.graph && window.LiteGraph && "
                      "window.app.extensions.some(e => e.name === 'hybrid_parallel.status_panel')",
             what="the front end and the pack's extensions")
    close_dialogs(browser)


def set_setting(browser, name, value):
    browser.execute_script("return app.extensionManager.setting.set(arguments[0], arguments[1])", name, value)


def set_theme(browser, palette):
    set_setting(browser, "Comfy.ColorPalette", palette)
    # The front end's own background colour says the palette is applied.
    wait_for(browser, """
        const bg = getComputedStyle(document.body).getPropertyValue('--comfy-menu-bg').trim()
            || getComputedStyle(document.body).backgroundColor;
        const c = document.createElement('div'); c.style.color = bg; document.body.append(c);
        const [r, g, b] = getComputedStyle(c).color.match(/\\d+/g).map(Number); c.remove();
        const light = (r + g + b) / 3 > 128;
        return light === (arguments[0] === 'light');""", 15, f"the {palette} theme", palette)


def open_panel(browser):
    if not browser.execute_script(f"return !!{PANEL}"):
        click_button(browser, "Parallel")
    wait_for(browser, f"return {PANEL} && {PANEL}.querySelector('.hp-rank')", what="the Parallel tab")


# Every element of the panel (and the text in it) lies inside the panel's box, none is cut off
# (wider content than its box, an ellipsis) or hidden, and nothing around the panel scrolls
# sideways. Returns {problems, checked, panel: [left, right]}; figures in closed <details> are
# out of sight by design: the test opens them all and checks again.
FIT_CHECK = """
const panel = document.getElementById('hybrid-parallel-panel');
const box = panel.getBoundingClientRect();
const problems = [];
const name = (e) => e.tagName.toLowerCase() + (e.className && typeof e.className === 'string'
    ? '.' + e.className.split(' ').join('.') : '') + (e.dataset && e.dataset.rank ? `[rank ${e.dataset.rank}]` : '');
const inside = (r) => r.left >= box.left - 0.5 && r.right <= box.right + 0.5 && r.top >= box.top - 0.5
    && r.bottom <= box.bottom + 0.5;
let checked = 0;
if (box.width < 150) problems.push(`panel only ${box.width}px wide`);
if (box.left < 0 || box.right > window.innerWidth) problems.push('panel outside the window');
for (const e of [panel, ...panel.querySelectorAll('*')]) {
    if (e.closest('details:not([open])') && !e.closest('summary') && !e.matches('details')) continue;
    const style = getComputedStyle(e);
    const r = e.getBoundingClientRect();
    if (style.display === 'none' && !e.closest('svg')) { problems.push(`${name(e)} not displayed`); continue; }
    if (style.visibility === 'hidden' || parseFloat(style.opacity) === 0) problems.push(`${name(e)} hidden`);
    if (!e.closest('svg') || e.tagName === 'svg') {
        if (r.width === 0 && r.height === 0 && e.textContent.trim()) problems.push(`${name(e)} has no box`);
        if (!inside(r)) problems.push(`${name(e)} outside the panel: [${r.left},${r.right}]x[${r.top},${r.bottom}]`);
        if (style.textOverflow === 'ellipsis') problems.push(`${name(e)} may end in an ellipsis`);
        if (e.clientWidth && e.scrollWidth > e.clientWidth + 1) problems.push(`${name(e)} cut off: ${e.scrollWidth} > ${e.clientWidth}`);
        if (e.clientHeight && e.scrollHeight > e.clientHeight + 1 && style.overflowY !== 'visible'
            && !e.classList.contains('hp-track')) problems.push(`${name(e)} cut off below`);
        if (style.webkitLineClamp && style.webkitLineClamp !== 'none') problems.push(`${name(e)} clamped`);
    }
    // The text itself, line by line.
    for (const t of e.childNodes) {
        if (t.nodeType !== 3 || !t.textContent.trim()) continue;
        const range = document.createRange(); range.selectNodeContents(t);
        for (const line of range.getClientRects()) {
            if (!inside(line)) problems.push(`text '${t.textContent.slice(0, 30)}' outside the panel`);
        }
        checked += 1;
    }
}
// Nothing around the panel scrolls sideways or clips it.
for (let a = panel.parentElement; a && a !== document.body; a = a.parentElement) {
    const style = getComputedStyle(a);
    if (style.overflowX !== 'visible' && a.scrollWidth > a.clientWidth + 1) problems.push(`${name(a)} scrolls sideways`);
    const r = a.getBoundingClientRect();
    if (style.overflowX !== 'visible' && (box.left < r.left - 0.5 || box.right > r.right + 0.5)) problems.push(`${name(a)} clips the panel`);
}
return {problems, checked, panel: [box.left, box.right]};
"""


def assert_panel_fits(browser, label):
    """The fit check with the details closed and then all open (as the user left them after)."""
    for opened in (False, True):
        browser.execute_script(f"{PANEL}.querySelectorAll('details').forEach(d => d.open = arguments[0])", opened)
        result = browser.execute_script(FIT_CHECK)
        assert not result["problems"], (label, opened, result["problems"][:10])
        ranks = browser.execute_script(f"return {PANEL}.querySelectorAll('.hp-rank').length")
        # The texts really were looked at: each card's head and bar labels, with its figures when open.
        assert result["checked"] >= (25 if opened else 6) * ranks, (label, opened, result)
    browser.execute_script(f"{PANEL}.querySelectorAll('details').forEach(d => d.open = false)")


# Per rank: host fill and peak, GPU fill, and the sparkline's bars (count and heights).
PICTURES = f"""
return Array.from({PANEL}.querySelectorAll('.hp-rank')).map(card => {{
    const host = card.querySelector('.hp-mem[data-kind=host]');
    const fill = host && host.querySelector('.hp-fill');
    const peak = host && host.querySelector('.hp-peak');
    const spark = card.querySelector('svg.hp-spark');
    const bars = spark ? Array.from(spark.querySelectorAll('rect:not(.hp-spark-bg)')) : [];
    return {{rank: +card.dataset.rank, host: fill ? +fill.dataset.value : null,
             hostWidth: fill ? fill.getBoundingClientRect().width : 0, hostTotal: host ? host.dataset.total : null,
             peak: peak ? +peak.dataset.value : null, points: spark ? +spark.dataset.points : null,
             heights: bars.map(b => +b.getAttribute('height')),
             steps: parseInt(card.querySelector('.hp-forwards').textContent)}};
}});"""


def screenshot(browser, name):
    close_dialogs(browser)
    browser.save_screenshot(str(SCREENSHOTS / name))


def node_box_check(browser):
    """Parallel Config's message box inside the node's box (canvas or Vue node), and readable whole."""
    return browser.execute_script("""
        const n = window.__pc, box = n.__parallelMessage;
        const b = box.getBoundingClientRect();
        let node;
        const vue = document.querySelector(`[data-node-id="${n.id}"]`);
        if (vue) node = vue.getBoundingClientRect();
        else {
            // The node as the canvas draws it (its title bar above pos), in the page's coordinates.
            const tl = app.canvasPosToClientPos([n.pos[0], n.pos[1] - LiteGraph.NODE_TITLE_HEIGHT]);
            const br = app.canvasPosToClientPos([n.pos[0] + n.size[0], n.pos[1] + n.size[1]]);
            node = {left: tl[0], top: tl[1], right: br[0], bottom: br[1]};
        }
        const style = getComputedStyle(box);
        return {box: [b.left, b.top, b.right, b.bottom], node: [node.left, node.top, node.right, node.bottom],
                shown: b.width > 0 && b.height > 0 && style.visibility !== 'hidden' && style.display !== 'none',
                whole: box.scrollHeight <= box.clientHeight + 1, scrolls: ['auto', 'scroll'].includes(style.overflowY),
                title: box.title, text: box.textContent};""")


def assert_message_inside(browser, message):
    for _ in range(20):  # the node grows to the message on the next frames
        check = node_box_check(browser)
        (l, t, r, b), (nl, nt, nr, nb) = check["box"], check["node"]
        if l >= nl - 1 and r <= nr + 1 and t >= nt - 1 and b <= nb + 1:
            break
        time.sleep(0.1)
    if not (l >= nl - 1 and r <= nr + 1 and t >= nt - 1 and b <= nb + 1):
        browser.save_screenshot(str(SCREENSHOTS / "parallel_config_message_outside.png"))
    assert check["shown"] and check["text"] == message, check
    assert l >= nl - 1 and r <= nr + 1 and t >= nt - 1 and b <= nb + 1, check
    # All of it readable: shown whole, or in a box that scrolls and with the whole text on hover.
    assert check["whole"] or (check["scrolls"] and check["title"] == message), check
    return check


def sharded_workflow(seed, steps, **config):
    workflow = json.loads((REPO / "example_workflows" / "tiny_wan_ulysses2_demo.json").read_text())
    for node in workflow["nodes"]:
        if node["type"] == "KSampler":
            node["widgets_values"][0] = seed  # a seed no other test used: the sampler really runs
            node["widgets_values"][2] = steps
    return workflow, config


def load_and_configure(browser, workflow, config):
    browser.execute_script("return app.loadGraphData(arguments[0])", workflow)
    browser.execute_script("""
        const pc = app.graph._nodes.find(n => n.type === 'ParallelConfig');
        for (const [name, value] of arguments[0]) pc.widgets.find(w => w.name === name).value = value;""",
                           list(config.items()))


def run_and_watch(browser, world, timeout=300):
    """Queue the graph from the page and sample the panel's pictures until every one of ``world``
    ranks has stepped and the queue is empty. The samples, oldest first."""
    browser.execute_script("app.queuePrompt(0)")
    samples, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        pictures = browser.execute_script(PICTURES)
        samples.append(pictures)
        queue = browser.execute_script(
            "return fetch('/queue').then(r => r.json()).then(q => q.queue_running.length + q.queue_pending.length)")
        if len(pictures) == world and all(p["steps"] > 0 for p in pictures) and queue == 0:
            time.sleep(1.5)  # the poll after the prompt
            samples.append(browser.execute_script(PICTURES))
            return samples
        time.sleep(0.2)
    raise TimeoutError(f"{world} ranks did not all step: {samples[-1] if samples else None}")


@pytest.mark.smoke
def test_front_end(browser, tiny_server):
    open_front_end(browser, tiny_server)

    # The pack's nodes are in the node library.
    click_button(browser, "Node Library")
    search = wait_for(browser, "return document.querySelector('.side-bar-panel input, .sidebar-content-container "
                               "input, input[placeholder*=Search]')", what="the node library search box")
    search.send_keys("Parallel Config")
    wait_for(browser, "return document.body.innerText.includes('Parallel Config')", what="Parallel Config listed")
    for name in ("ShardTransformer", "ShardTextEncoder"):
        assert browser.execute_script(f"return !!LiteGraph.registered_node_types['{name}']")
    click_button(browser, "Node Library")  # closes the library again

    # Parallel Config with a size this machine cannot run: the node says so before anything is queued.
    browser.execute_script("""
        app.graph.clear();
        const node = LiteGraph.createNode('ParallelConfig');
        const [x, y] = app.clientPosToCanvasPos([600, 200]);  // mid-window, clear of the minimap
        node.pos = [x, y];
        app.graph.add(node);
        window.__pc = node;""")
    wait_for(browser, "return window.__pc.parallelValidation", what="the first validation")
    # Three ranks but two devices listed: wrong on any machine.
    browser.execute_script("""
        for (const [name, value] of [['devices', 'cpu,cpu'], ['ulysses_size', 3]]) {
            const w = window.__pc.widgets.find(w => w.name === name);
            w.value = value; w.callback && w.callback(value);
        }""")
    message = wait_for(browser, "const v = window.__pc.parallelValidation; "
                                "return v && v.ok === false && v.message", what="the inline error")
    assert message.startswith("Parallel Config: devices='cpu,cpu'") and "world size of 3" in message
    shown = browser.execute_script("return Array.from(document.querySelectorAll('.hybrid-parallel-validation'))"
                                   ".map(e => e.textContent).join(' | ')")
    assert message in shown  # in the DOM, on the node
    assert_message_inside(browser, message)
    close_dialogs(browser)
    browser.save_screenshot(str(SCREENSHOTS / "parallel_config_invalid.png"))

    # The canvas sends every input the node has (layout and weights too), so it refuses and
    # accepts exactly what the node does.
    def canvas_says(values, expect):
        browser.execute_script("""
            for (const [name, value] of arguments[0]) {
                const w = window.__pc.widgets.find(w => w.name === name);
                w.value = value; w.callback && w.callback(value);
            }""", list(values.items()))
        return wait_for(browser, "const v = window.__pc.parallelValidation; "
                                 f"return v && v.message.includes({json.dumps(expect)}) && v", what=expect)

    # A long message (the longest the config gives: a long input echoed, and what to give instead)
    # stays inside the node too.
    result = canvas_says({"ulysses_size": 2, "devices": "cpu,cpu", "weights": "1," * 100 + "x"}, "weights=")
    assert result["ok"] is False and len(result["message"]) > 200
    assert_message_inside(browser, result["message"])
    # And one of the 1,000 characters any message of the pack stays under (config.MESSAGE_MAX),
    # from a stand-in for the route.
    longest = "Parallel Config: " + " ".join(["a very long message that wraps"] * 32)
    browser.execute_script("""
        window.__realFetch = window.__realFetch || window.fetch;
        const message = arguments[0];
        window.fetch = (url, options) => String(url).includes('/parallel/validate')
            ? Promise.resolve(new Response(JSON.stringify({ok: false, world_size: null, message}),
                                           {headers: {'Content-Type': 'application/json'}}))
            : window.__realFetch(url, options);""", longest)
    try:
        canvas_says({"devices": "cpu,cpu,cpu"}, "very long message")
        check = assert_message_inside(browser, longest)
        assert check["scrolls"] and not check["whole"], check  # clamped: the node does not grow without end
        screenshot(browser, "parallel_config_long_message.png")
    finally:
        browser.execute_script("window.fetch = window.__realFetch")
    # With the front end's Vue node rendering ("Nodes 2.0") switched on, the node is a DOM element
    # and the message stays inside it too.
    set_setting(browser, "Comfy.VueNodes.Enabled", True)
    try:
        wait_for(browser, "return document.querySelector(`[data-node-id='${window.__pc.id}']`)", 20, "the Vue node")
        result = canvas_says({"devices": "cpu,cpu", "weights": "1," * 99 + "y"}, "weights=")
        assert_message_inside(browser, result["message"])
        screenshot(browser, "parallel_config_vue_nodes.png")
    finally:
        set_setting(browser, "Comfy.VueNodes.Enabled", False)
    wait_for(browser, "return !document.querySelector(`[data-node-id='${window.__pc.id}']`)", 20, "the canvas node")
    result = canvas_says({"weights": "", "devices": "cpu,cpu", "ulysses_size": 1, "layout": "auto"}, "layout auto")
    assert result["ok"] is True and result["world_size"] == 2, result
    assert_message_inside(browser, result["message"])

    # A tiny sharded prompt from the page; the Parallel tab shows both ranks stepping, with their
    # memory bars and step-time sparklines, inside the panel in both themes.
    before = tiny_server.get("/parallel/status")
    load_and_configure(browser, *sharded_workflow(4242, 6))
    open_panel(browser)
    set_theme(browser, "dark")
    # Before the prompt: a single rank where no world ran yet in this server, else the last world.
    assert_panel_fits(browser, f"before the prompt, world size {before['world_size']}")
    try:
        samples = run_and_watch(browser, 2)
    finally:
        screenshot(browser, "parallel_panel.png")
        print("panel:", browser.execute_script(f"return {PANEL}?.innerText"))
    first, last = samples[0], samples[-1]
    assert len(last) == 2 and all(p["steps"] > 0 for p in last), last
    panel = browser.execute_script(f"return {PANEL}.innerText")
    assert "World size 2" in panel and "ulysses 2" in panel
    # Drawn: a host bar against the machine's memory (ComfyUI's /system_stats) with its peak mark,
    # and a sparkline of the steps seen, on every rank.
    ram = tiny_server.get("/system_stats")["system"]["ram_total"]
    for p in last:
        assert p["host"] > 0 and p["hostWidth"] > 0 and int(p["hostTotal"]) == ram and p["peak"] >= p["host"], p
        assert p["points"] >= 1 and len(p["heights"]) == p["points"] and max(p["heights"]) > 0, p
    # Changed as the prompt ran: the bars' figures and the sparklines moved between the samples.
    assert any(a != b for a, b in zip(samples, samples[1:])), "the pictures never changed"
    assert sum(p["points"] for p in last) > sum(p["points"] or 0 for p in first), (first, last)
    after = tiny_server.get("/parallel/status")
    # Every rank stepped in this prompt: against its count before in the same world, or from none where
    # the prompt started a new one.
    same_world = [r["pid"] for r in before["ranks"][1:]] == [r["pid"] for r in after["ranks"][1:]]
    counted = [r.get("forwards", 0) for r in before["ranks"]] if same_world else [0] * len(after["ranks"])
    assert all(r["forwards"] > n for r, n in zip(after["ranks"], counted))
    assert_panel_fits(browser, "2 ranks, dark")

    # The light theme, and a second prompt: one more step time on every sparkline, same scale.
    set_theme(browser, "light")
    assert_panel_fits(browser, "2 ranks, light")
    load_and_configure(browser, *sharded_workflow(4243, 3))
    samples = run_and_watch(browser, 2)
    again = samples[-1]
    assert all(b["points"] > a["points"] for a, b in zip(last, again)), (last, again)
    assert_panel_fits(browser, "2 ranks, light, second prompt")
    screenshot(browser, "parallel_panel_light.png")

    # GPU ranks (a stand-in status: this machine has none; the loading bars come from a real load,
    # test_loading_progress): allocated and reserved against the card's memory as ComfyUI's
    # /system_stats gives it, with the peak marked.
    set_theme(browser, "dark")
    try:
        gib = 2**30
        gpus = [{"device": f"cuda:{i}", "gpu_allocated_bytes": (10 + 20 * i) * gib, "gpu_reserved_bytes": (16 + 20 * i) * gib,
                 "gpu_peak_allocated_bytes": (12 + 20 * i) * gib, "gpu_peak_reserved_bytes": (18 + 20 * i) * gib,
                 "load": None} for i in range(2)]
        stats = tiny_server.get("/system_stats")
        stats["devices"] = [{"name": f"cuda:{i} NVIDIA H100 80GB HBM3", "type": "cuda", "index": i,
                             "vram_total": 80 * gib, "vram_free": 40 * gib} for i in range(2)]
        stand_in(browser, gpus, stats)
        bars = browser.execute_script(f"""
            return Array.from({PANEL}.querySelectorAll('.hp-rank')).map(card => {{
                const bar = card.querySelector('.hp-mem[data-kind=gpu]');
                if (!bar) return null;
                const track = bar.querySelector('.hp-track').getBoundingClientRect().width;
                const width = (cls) => bar.querySelector(cls).getBoundingClientRect().width / track;
                return {{total: +bar.dataset.total, allocated: width('.hp-fill-gpu'), reserved: width('.hp-fill-reserved'),
                         peak: (bar.querySelector('.hp-peak').getBoundingClientRect().left + 1
                                - bar.querySelector('.hp-track').getBoundingClientRect().left) / track,
                         text: bar.innerText}};
            }});""")
        for bar, gpu in zip(bars, gpus):
            assert bar and bar["total"] == 80 * gib, bars
            assert abs(bar["allocated"] - gpu["gpu_allocated_bytes"] / (80 * gib)) < 0.02, bar
            assert abs(bar["reserved"] - gpu["gpu_reserved_bytes"] / (80 * gib)) < 0.02, bar
            assert abs(bar["peak"] - gpu["gpu_peak_reserved_bytes"] / (80 * gib)) < 0.02, bar
        assert_panel_fits(browser, "GPU ranks (stand-in), dark")
        screenshot(browser, "parallel_panel_gpu_stand_in.png")
    finally:
        browser.execute_script("window.fetch = window.__realFetch || window.fetch")
    print(f"\nscreenshots in {SCREENSHOTS}")


def stand_in(browser, ranks, system_stats=None):
    """From now on the page reads the real status with ``ranks[i]``'s fields put into rank i's
    (the ranks past the list's end as they are), and ``system_stats`` for /system_stats if given:
    figures a CPU run has not (a GPU) drawn by the real panel."""
    browser.execute_script("""
        window.__realFetch = window.__realFetch || window.fetch;
        const [ranks, stats] = arguments;
        const json = (value) => new Response(JSON.stringify(value), {headers: {'Content-Type': 'application/json'}});
        window.fetch = async (url, options) => {
            if (stats && String(url).includes('/system_stats')) return json(stats);
            const response = await window.__realFetch(url, options);
            if (!String(url).includes('/parallel/status')) return response;
            const status = await response.json();
            status.ranks.forEach((r, i) => Object.assign(r, ranks[i] || {}));
            return json(status);
        };""", ranks, system_stats)
    time.sleep(2.2)  # two polls


# Weights loading for real: a server whose worker ranks get their weights the way GPU ranks do
# (the stream over the world's process group, not CPU shared memory), each worker waiting this
# long after every bucket it receives (weights/stream.py's PARALLEL_TEST_SLOW_LOAD_MS). Under tensor
# parallelism 2 the tiny Wan streams as two buckets (the replicated tensors, then each rank's
# slices; on ComfyUI 0.33 only the LoRA-patched tensors stream and the workers read the rest from
# the checkpoint after): for about this long after the first bucket a worker holds part of its
# weights. Long enough for both themes' checks and screenshots on a busy 2-core machine (they take
# about a second on an idle one, the page reads the status every second); the load takes about
# twice this on ComfyUI 0.3.75 (two buckets), once on 0.33.
SLOW_LOAD_MS = 4000

# The loading bars the panel draws: rank, text, the figures it drew from, and the fill's fraction.
LOAD_BARS = f"""
return Array.from({PANEL}.querySelectorAll('.hp-rank .hp-load')).map(l => {{
    const track = l.querySelector('.hp-track'), fill = l.querySelector('.hp-fill');
    return {{rank: +l.closest('.hp-rank').dataset.rank, text: l.innerText, done: +l.dataset.done,
             total: +l.dataset.total,
             fraction: fill.getBoundingClientRect().width / track.getBoundingClientRect().width}};
}});"""
QUEUED = "return fetch('/queue').then(r => r.json()).then(q => q.queue_running.length + q.queue_pending.length)"


@pytest.fixture(scope="module")
def slow_load_server(tiny_base, comfyui_path):
    from comfy_server import ComfyServer

    server = ComfyServer(comfyui_path, tiny_base, python=sys.executable, log_path=tiny_base / "comfyui_slow_load.log",
                         env={"PARALLEL_WEIGHT_TRANSPORT": "process_group",
                              "PARALLEL_TEST_SLOW_LOAD_MS": str(SLOW_LOAD_MS)}).start()
    yield server
    server.stop()


def loading_everywhere(bars, ranks) -> bool:
    """Every one of ``ranks`` shows a bar part-way: some bytes there, not all."""
    shown = {b["rank"]: b for b in bars}
    return all(r in shown and 0 < shown[r]["done"] < shown[r]["total"] for r in ranks)


@pytest.mark.smoke
def test_loading_progress(browser, slow_load_server):
    """A sharded prompt's first weight load, slowed, watched in the Parallel tab: while the worker
    ranks receive their weights, a bar per rank with bytes done of the total and the way they
    travel, drawn from the status route's real ``load`` figures, inside the panel in both themes
    (screenshots); gone once the load is done."""
    server = slow_load_server
    open_front_end(browser, server)
    set_theme(browser, "light")
    load_and_configure(browser, *sharded_workflow(4244, 1, ulysses_size=1, tp_size=2))
    open_panel(browser)
    assert browser.execute_script(LOAD_BARS) == [], "a loading bar before any load"
    workers = [1]
    started = time.monotonic()
    browser.execute_script("app.queuePrompt(0)")
    # The world starts (its worker processes import torch), ComfyUI loads the model, then the
    # weights travel: generous on a busy machine.
    while not loading_everywhere(bars := browser.execute_script(LOAD_BARS), workers):
        waited = time.monotonic() - started
        assert waited < 300, f"no loading bars after {waited:.0f}s: {bars}"
        if waited > 10 and browser.execute_script(QUEUED) == 0:
            raise AssertionError(f"the prompt ended and no rank showed a load part-way: {bars}, "
                                 f"{[r['load'] for r in server.get('/parallel/status')['ranks']]}")
        time.sleep(0.2)
    print(f"\nloading bars after {time.monotonic() - started:.1f}s: {[b['text'] for b in bars]}")
    status = {r["rank"]: r["load"] for r in server.get("/parallel/status")["ranks"]}
    for bar in bars:
        # What the rank reports: the same load (its total), as far or further by now.
        load = status[bar["rank"]]
        assert load and load["via"] == "process_group" and load["total_bytes"] == bar["total"], (bar, load)
        assert bar["done"] <= load["done_bytes"], (bar, load)
        shown = re.search(r"via (\w+): ([\d.]+) MB / ([\d.]+) MB \((\d+)%\)", bar["text"])
        assert shown and shown[1] == "process_group", bar
        assert abs(float(shown[2]) - bar["done"] / 2**20) <= 0.51, bar
        assert abs(float(shown[3]) - bar["total"] / 2**20) <= 0.51, bar
        assert abs(int(shown[4]) - 100 * bar["done"] / bar["total"]) <= 0.51, bar
        assert abs(bar["fraction"] - bar["done"] / bar["total"]) < 0.02, bar
    # No GPU bar on these CPU ranks, not even while a worker's status row holds zeros there (before
    # its first report, all through its first load).
    assert browser.execute_script(f"""return Array.from({PANEL}.querySelectorAll('.hp-rank')).filter(c =>
        c.querySelector('.hp-device').textContent === 'cpu'
        && c.querySelector('.hp-mem[data-kind=gpu]')).length""") == 0
    for theme in ("light", "dark"):
        set_theme(browser, theme)
        assert_panel_fits(browser, f"loading, {theme}")
        screenshot(browser, f"parallel_panel_loading_{theme}.png")
        # Still part-way after the screenshot: the picture shows the load.
        after = browser.execute_script(LOAD_BARS)
        assert loading_everywhere(after, workers), \
            (f"the load ended before the {theme} screenshot ({time.monotonic() - started:.1f}s after queueing; "
             f"SLOW_LOAD_MS too short for this machine?)", after)
    print(f"screenshots taken {time.monotonic() - started:.1f}s after queueing")

    # Done: no bar once the prompt ran (the figures stay at done = total).
    wait_for(browser, QUEUED.replace(".length)", ".length === 0)"), 300, "the prompt to finish")
    wait_for(browser, f"return {PANEL}.querySelectorAll('.hp-rank').length === 2 "
                      f"&& {PANEL}.querySelectorAll('.hp-load').length === 0", 30, "the loading bars to go")
    print(f"prompt done {time.monotonic() - started:.1f}s after queueing")
    ranks = server.get("/parallel/status")["ranks"]
    assert all(r["load"]["via"] == "process_group" and r["load"]["done_bytes"] == r["load"]["total_bytes"] > 0
               for r in ranks), ranks
    assert "loading weights" not in browser.execute_script(f"return {PANEL}.innerText")
    assert_panel_fits(browser, "loaded, dark")


# 4 ranks under layout auto (its predictions beside the measured step), 8 as cfg 2 x ring 2 x
# ulysses 2 (every group of the mesh drawn). Few steps: 8 CPU ranks share two cores here.
WORLDS = {
    4: {"ulysses_size": 4, "devices": "cpu,cpu,cpu,cpu", "layout": "auto"},
    8: {"cfg_size": 2, "ring_size": 2, "ulysses_size": 2, "devices": ",".join(["cpu"] * 8)},
}


@pytest.mark.smoke  # CI's tier on 0.3.75 too: every figure fits at 4 and 8 ranks on both front ends
@pytest.mark.parametrize("world", sorted(WORLDS))
def test_panel_in_larger_worlds(browser, tiny_server, world):
    open_front_end(browser, tiny_server)
    set_theme(browser, "dark")
    load_and_configure(browser, *sharded_workflow(5000 + world, 2, **WORLDS[world]))
    open_panel(browser)
    samples = run_and_watch(browser, world, timeout=400)
    last = samples[-1]
    assert sorted(p["rank"] for p in last) == list(range(world)), last
    for p in last:
        assert p["host"] > 0 and p["hostWidth"] > 0 and p["points"] >= 1 and max(p["heights"]) > 0, p
    status = tiny_server.get("/parallel/status")
    mesh = browser.execute_script(f"""
        const m = {PANEL}.querySelector('.hp-mesh');
        return m && {{chips: Array.from(m.querySelectorAll('.hp-chip')).map(c => +c.dataset.rank),
                     boxes: m.querySelectorAll('.hp-cfg').length,
                     rows: Array.from(m.querySelectorAll('.hp-cfg')).map(b => Array.from(b.querySelectorAll('.hp-mesh-row'))
                         .map(r => Array.from(r.querySelectorAll('.hp-chip')).map(c => +c.dataset.rank)))}};""")
    assert mesh and sorted(mesh["chips"]) == list(range(world)), mesh
    # Drawn as its groups: a box per cfg branch, a row per ring position; a row's ranks are the
    # ranks of one Ulysses group (they differ only in their ulysses coordinate).
    sizes = status["mesh"]
    assert mesh["boxes"] == sizes["cfg"] and all(len(rows) == sizes["ring"] for rows in mesh["rows"]), (mesh, sizes)
    coords = {r["rank"]: r["coords"] for r in status["ranks"]}
    for rows in mesh["rows"]:
        for row in rows:
            assert len(row) == sizes["ulysses"] * sizes["tp"], (row, sizes)
            assert len({tuple(v for d, v in coords[k].items() if d not in ("ulysses", "tp")) for k in row}) == 1, \
                (row, coords)
    if WORLDS[world].get("layout") == "auto":
        assert status["layouts"], status
        predicted = browser.execute_script(f"""
            return Array.from({PANEL}.querySelectorAll('.hp-layout .hp-pred')).map(p => ({{kind: p.dataset.kind,
                text: p.innerText, width: p.querySelector('.hp-fill').getBoundingClientRect().width}}));""")
        kinds = [p["kind"] for p in predicted]
        assert "predicted" in kinds and "measured" in kinds and all(p["width"] > 0 for p in predicted), predicted
        chosen = status["layouts"][-1]
        ms = chosen["predicted_step_ms"]
        assert any(f"{ms:.{1 if ms < 100 else 0}f} ms predicted" in p["text"] for p in predicted), (predicted, chosen)
    for theme in ("dark", "light"):
        set_theme(browser, theme)
        assert_panel_fits(browser, f"{world} ranks, {theme}")
        screenshot(browser, f"parallel_panel_{world}_ranks_{theme}.png")
    set_theme(browser, "dark")
