// Parallel Config on the canvas: the resulting world size, and any problem with the inputs,
// shown on the node itself while it is edited (before the prompt is queued). The check is the
// server's own (POST /parallel/validate builds the config the node would, of the same values),
// and the canvas sends every input the node has, by name: no list of inputs here to drift from
// the node's (parallel_runtime/config.py CONFIG_INPUTS is the one list).
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const OWN_WIDGET = "validation"; // the message box below, not an input

function isInput(widget) {
  return widget.name && widget.name !== OWN_WIDGET && widget.options?.serialize !== false &&
    widget.serialize !== false;
}

function inputValues(node) {
  const values = {};
  for (const widget of node.widgets ?? []) {
    if (!isInput(widget)) continue;
    // An input fed by a link: its value is only known when the prompt runs (null, as the node
    // sees it while the prompt is validated).
    const slot = node.inputs?.find((input) => input.name === widget.name || input.widget?.name === widget.name);
    values[widget.name] = slot?.link != null ? null : widget.value;
  }
  return values;
}

async function validate(node) {
  const ticket = (node.__parallelTicket = (node.__parallelTicket || 0) + 1);
  let result;
  try {
    const response = await api.fetchApi("/parallel/validate", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(inputValues(node)),
    });
    result = await response.json();
  } catch (error) {
    result = { ok: false, message: `could not reach /parallel/validate: ${error}` };
  }
  if (ticket !== node.__parallelTicket) return; // a newer edit is being checked
  node.parallelValidation = result;
  const box = node.__parallelMessage;
  if (box) {
    box.textContent = result.message;
    box.title = result.message; // the whole message on hover, also where the box scrolls
    box.dataset.ok = result.ok ? "true" : "false";
    box.style.color = result.ok ? "#2aa876" : "#e0463c";
    fitMessage(node);
  }
  node.setDirtyCanvas?.(true, true);
}

// The message box asks for the height its text takes at the node's width, up to MESSAGE_LINES
// lines (a longer message scrolls inside the box, and shows whole on hover), and the node grows to
// hold it: the text never runs past the node's edge.
const MESSAGE_LINES = 6;
const LINE_PX = 16;
function messageHeight(node) {
  const box = node.__parallelMessage;
  if (!box) return LINE_PX + 8;
  // The text's height at the box's width (the box is sized by the canvas, not by its text).
  const width = box.clientWidth || Math.max(80, (node.size?.[0] ?? 300) - 20);
  const probe = box.cloneNode(true);
  probe.style.cssText += `;position:absolute;visibility:hidden;height:auto;max-height:none;width:${width}px;`;
  document.body.append(probe);
  const text = probe.scrollHeight;
  probe.remove();
  return Math.min(Math.max(text, LINE_PX) + 4, MESSAGE_LINES * LINE_PX + 8);
}

function fitMessage(node) {
  node.__parallelMessageHeight = messageHeight(node);
  const wanted = node.computeSize?.();
  // Set even where the size stays: the canvas lays the widgets out again (the box gets its height).
  if (wanted && node.size) node.setSize?.([node.size[0], Math.max(wanted[1], node.size[1])]);
}

app.registerExtension({
  name: "hybrid_parallel.parallel_config",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (nodeData.name !== "ParallelConfig") return;

    const onNodeCreated = nodeType.prototype.onNodeCreated;
    nodeType.prototype.onNodeCreated = function () {
      onNodeCreated?.apply(this, arguments);
      const box = document.createElement("div");
      box.className = "hybrid-parallel-validation";
      box.style.cssText = "font: 12px/16px sans-serif; padding: 2px 6px; white-space: normal; overflow-wrap: anywhere;"
        + "box-sizing: border-box; height: 100%; max-height: 100%; overflow-y: auto;";
      box.textContent = "…";
      this.__parallelMessage = box;
      this.__parallelMessageHeight = LINE_PX + 8;
      this.addDOMWidget?.("validation", "parallel_validation", box, {
        serialize: false,
        getMinHeight: () => this.__parallelMessageHeight,
        getMaxHeight: () => this.__parallelMessageHeight,
      });
      for (const widget of this.widgets ?? []) {
        if (!isInput(widget)) continue;
        const callback = widget.callback;
        const node = this;
        widget.callback = function () {
          const out = callback?.apply(this, arguments);
          clearTimeout(node.__parallelTimer);
          node.__parallelTimer = setTimeout(() => validate(node), 150);
          return out;
        };
      }
      setTimeout(() => validate(this), 0);
    };

    const onConnectionsChange = nodeType.prototype.onConnectionsChange;
    nodeType.prototype.onConnectionsChange = function () {
      const out = onConnectionsChange?.apply(this, arguments);
      clearTimeout(this.__parallelTimer);
      this.__parallelTimer = setTimeout(() => validate(this), 150); // an input linked or unlinked
      return out;
    };

    const onConfigure = nodeType.prototype.onConfigure;
    nodeType.prototype.onConfigure = function () {
      onConfigure?.apply(this, arguments);
      setTimeout(() => validate(this), 0); // values loaded from a workflow
    };
  },
});

// For tests and other extensions: re-check a node after setting widget values from code.
window.hybridParallelValidate = validate;
