"""The real ComfyUI front end in headless Chromium: the pack's nodes in the node library, Parallel
Config's inline validation, a tiny sharded prompt run from the page, and the Parallel sidebar tab
updating while it runs. Leaves a screenshot in out/browser/."""
import json
import os
import time

import pytest

from conftest import REPO

pytestmark = pytest.mark.comfy_server
SCREENSHOTS = REPO / "out" / "browser"
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


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
    yield driver
    driver.quit()


def wait_for(driver, script, timeout=60, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = driver.execute_script(script)
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


def test_front_end(browser, tiny_server):
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    # A first visit opens the template browser over the canvas; this user has seen it.
    tiny_server.post("/settings/Comfy.TutorialCompleted", True)
    browser.get(tiny_server.url)
    wait_for(browser, "return window.app && window.app.graph && window.LiteGraph && "
                      "window.app.extensions.some(e => e.name === 'hybrid_parallel.status_panel')",
             what="the front end and the pack's extensions")
    close_dialogs(browser)

    # The pack's nodes are in the node library.
    click_button(browser, "Node Library")
    search = wait_for(browser, "return document.querySelector('.side-bar-panel input, .sidebar-content-container "
                               "input, input[placeholder*=Search]')", what="the node library search box")
    search.send_keys("Parallel Config")
    wait_for(browser, "return document.body.innerText.includes('Parallel Config')", what="Parallel Config listed")
    for name in ("ShardTransformer", "ShardTextEncoder"):
        assert browser.execute_script(f"return !!LiteGraph.registered_node_types['{name}']")

    # Parallel Config with a size this machine cannot run: the node says so before anything is queued.
    browser.execute_script("""
        app.graph.clear();
        const node = LiteGraph.createNode('ParallelConfig');
        const [x, y] = app.canvas.convertOffsetToCanvas([700, 250]);
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
    click_button(browser, "Node Library")  # closes the library again
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

    result = canvas_says({"ulysses_size": 2, "devices": "cpu,cpu", "weights": "1,0.5,0.25"}, "weights=")
    assert result["ok"] is False and result["message"].startswith("Parallel Config: weights='1,0.5,0.25'")
    result = canvas_says({"weights": "", "ulysses_size": 1, "layout": "auto"}, "layout auto")
    assert result["ok"] is True and result["world_size"] == 2, result

    # A tiny sharded prompt from the page; the Parallel tab shows both ranks stepping.
    workflow = json.loads((REPO / "example_workflows" / "tiny_wan_ulysses2_demo.json").read_text())
    for node in workflow["nodes"]:
        if node["type"] == "KSampler":
            node["widgets_values"][0] = 4242  # a seed no other test used: the sampler really runs
            node["widgets_values"][2] = 12
    browser.execute_script("return app.loadGraphData(arguments[0])", workflow)
    click_button(browser, "Parallel")
    wait_for(browser, "return document.getElementById('hybrid-parallel-panel')", what="the Parallel tab")
    before = tiny_server.get("/parallel/status")
    browser.execute_script("app.queuePrompt(0)")
    try:
        rows = wait_for(browser, """
        const rows = Array.from(document.querySelectorAll('#hybrid-parallel-panel tr.hp-rank'));
        const steps = rows.map(r => parseInt(r.querySelector('.hp-forwards').textContent));
        return rows.length === 2 && steps.every(s => s > 0) ? steps : null;""", timeout=180,
                        what="two ranks stepping in the Parallel tab")
    finally:
        close_dialogs(browser)
        browser.save_screenshot(str(SCREENSHOTS / "parallel_panel.png"))
        print("panel:", browser.execute_script(
            "return document.getElementById('hybrid-parallel-panel')?.innerText"))
        print("history:", str(tiny_server.get("/history?max_items=2"))[:1500])
    assert len(rows) == 2
    panel = browser.execute_script("return document.getElementById('hybrid-parallel-panel').innerText")
    assert "World size 2" in panel and "ulysses 2" in panel
    time.sleep(1.5)
    close_dialogs(browser)
    browser.save_screenshot(str(SCREENSHOTS / "parallel_panel.png"))
    after = tiny_server.get("/parallel/status")
    # Every rank stepped in this prompt: against its count before in the same world, or from none where
    # the prompt started a new one (the workers differ: an earlier test ran another layout, whose
    # counts, rank 0's included, belonged to that world).
    same_world = [r["pid"] for r in before["ranks"][1:]] == [r["pid"] for r in after["ranks"][1:]]
    counted = [r.get("forwards", 0) for r in before["ranks"]] if same_world else [0] * len(after["ranks"])
    assert all(r["forwards"] > n for r, n in zip(after["ranks"], counted))
    print(f"\nscreenshots in {SCREENSHOTS}")
