// Shows the world size (product of the sizes) on the Parallel Config node while it is edited.
import { app } from "../../scripts/app.js";

const SIZE_WIDGETS = ["ulysses_size", "ring_size", "tp_size", "cfg_size"];

function worldSize(node) {
  let size = 1;
  for (const name of SIZE_WIDGETS) {
    const widget = node.widgets?.find((w) => w.name === name);
    const value = Number(widget?.value ?? 1);
    if (!Number.isInteger(value) || value < 1) return null;
    size *= value;
  }
  return size;
}

app.registerExtension({
  name: "hybrid_parallel.parallel_config",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (nodeData.name !== "ParallelConfig") return;
    const onDrawForeground = nodeType.prototype.onDrawForeground;
    nodeType.prototype.onDrawForeground = function (ctx) {
      onDrawForeground?.apply(this, arguments);
      if (this.flags?.collapsed) return;
      const size = worldSize(this);
      const text = size === null ? "invalid size" : `world size ${size}`;
      ctx.save();
      ctx.font = "12px sans-serif";
      ctx.fillStyle = size === null ? "#f66" : "#9c9";
      ctx.textAlign = "right";
      ctx.fillText(text, this.size[0] - 8, -8);
      ctx.restore();
    };
  },
});
