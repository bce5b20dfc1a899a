"""Workflow files: from the UI format (what ComfyUI saves and its template browser
lists) to the API format that ``POST /prompt`` takes, using the server's
``/object_info`` to map widget values to input names.
"""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))  # after ComfyUI's root where a caller put it: its nodes.py must win over ours
from parallel_runtime.config import CONFIG_INPUTS  # noqa: E402  (pure Python: starts nothing)

WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
UI_ONLY_NODES = {"Note", "MarkdownNote"}
MODE_MUTED, MODE_BYPASSED = 2, 4


class WorkflowError(ValueError):
    pass


def parallel_config_node(**values) -> dict:
    """A Parallel Config node in API format: its required inputs at their defaults, from the node's
    own list (``config.CONFIG_INPUTS``), then ``values`` (any input, optional ones included)."""
    inputs = {spec.name: spec.default for spec in CONFIG_INPUTS if not spec.optional}
    unknown = set(values) - {spec.name for spec in CONFIG_INPUTS}
    if unknown:
        raise WorkflowError(f"Parallel Config has no input {sorted(unknown)}; its inputs: "
                            f"{[spec.name for spec in CONFIG_INPUTS]}")
    return {"class_type": "ParallelConfig", "inputs": {**inputs, **values}}


def load(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def is_api_format(workflow: dict) -> bool:
    return "nodes" not in workflow and all(isinstance(v, dict) and "class_type" in v for v in workflow.values())


def _is_widget(spec) -> bool:
    kind = spec[0]
    return isinstance(kind, list) or kind in WIDGET_TYPES


def _input_order(info: dict) -> list[tuple[str, list]]:
    order = info.get("input_order") or {k: list(v.keys()) for k, v in info.get("input", {}).items()}
    found = []
    for section in ("required", "optional"):
        specs = info.get("input", {}).get(section, {})
        for name in order.get(section, []):
            if name in specs:
                found.append((name, specs[name]))
    return found


def ui_to_api(workflow: dict, object_info: dict) -> dict:
    """Convert a UI-format workflow to an API-format prompt."""
    if is_api_format(workflow):
        return copy.deepcopy(workflow)
    links = {link[0]: link for link in workflow.get("links", [])}
    nodes = {node["id"]: node for node in workflow["nodes"]}
    prompt: dict[str, dict] = {}
    for node in workflow["nodes"]:
        kind = node["type"]
        if kind in UI_ONLY_NODES or node.get("mode", 0) in (MODE_MUTED, MODE_BYPASSED):
            continue
        info = object_info.get(kind)
        if info is None:
            raise WorkflowError(f"node #{node['id']} is a {kind}, which this ComfyUI does not know "
                                "(a custom node pack missing?)")
        values = node.get("widgets_values") or []
        inputs: dict = {}
        if isinstance(values, dict):
            inputs.update(values)
        else:
            i = 0
            for name, spec in _input_order(info):
                if not _is_widget(spec):
                    continue
                if i < len(values):
                    inputs[name] = values[i]
                i += 1
                if len(spec) > 1 and isinstance(spec[1], dict) and spec[1].get("control_after_generate"):
                    i += 1  # the "fixed / randomize" companion widget
        for socket in node.get("inputs", []):
            link_id = socket.get("link")
            if link_id is None:
                continue
            source = _resolve_source(links[link_id], nodes, links)
            if source is not None:
                inputs[socket["name"]] = source
        prompt[str(node["id"])] = {"class_type": kind, "inputs": inputs,
                                   "_meta": {"title": node.get("title") or kind}}
    return prompt


def _resolve_source(link, nodes, links):
    """The [node_id, slot] feeding a link, looking through bypassed nodes."""
    _, src_id, src_slot, _, _, link_type = link[:6]
    src = nodes[src_id]
    while src.get("mode", 0) == MODE_BYPASSED:
        # A bypassed node passes through its first input of the same type.
        candidates = [s for s in src.get("inputs", []) if s.get("link") is not None and s.get("type") == link_type]
        if not candidates:
            return None
        upstream = links[candidates[0]["link"]]
        src_id, src_slot = upstream[1], upstream[2]
        src = nodes[src_id]
    if src.get("mode", 0) == MODE_MUTED:
        return None
    return [str(src_id), src_slot]


def find_nodes(prompt: dict, class_type: str) -> list[str]:
    return [node_id for node_id, node in prompt.items() if node["class_type"] == class_type]


def remove_passthrough(prompt: dict, class_type: str, through_input: str) -> dict:
    """Drop every node of ``class_type``, connecting its consumers to what fed ``through_input``
    (for example running a workflow without Shard Transformer)."""
    out = copy.deepcopy(prompt)
    for node_id in find_nodes(out, class_type):
        source = out[node_id]["inputs"][through_input]
        del out[node_id]
        for node in out.values():
            for name, value in node["inputs"].items():
                if isinstance(value, list) and len(value) == 2 and value[0] == node_id:
                    node["inputs"][name] = list(source)
    # Drop nodes nothing consumes any more that are not outputs themselves (e.g. an orphaned Parallel Config).
    consumed = {v[0] for n in out.values() for v in n["inputs"].values() if isinstance(v, list) and len(v) == 2}
    for node_id in [k for k, n in out.items() if n["class_type"] == "ParallelConfig" and k not in consumed]:
        del out[node_id]
    return out


# ---------------------------------------------------------------- prompt builders (tests, GPU check)
def edited(prompt, **changes):
    """Copy of ``prompt`` with inputs changed: changes = {class_type: {input: value}} passed as kwargs."""
    out = copy.deepcopy(prompt)
    for class_type, inputs in changes.items():
        for node_id in find_nodes(out, class_type):
            out[node_id]["inputs"].update(inputs)
    return out


def two_model_prompt(base_prompt: dict, first: dict, second: dict) -> dict:
    """Wan 2.2 style: a high-noise model for the first steps, a low-noise one for the rest,
    each behind its own Shard Transformer."""
    p = copy.deepcopy(base_prompt)
    (ks,) = find_nodes(p, "KSampler")
    k = p.pop(ks)["inputs"]
    (pc,) = find_nodes(p, "ParallelConfig")
    (st,) = find_nodes(p, "ShardTransformer")
    p[pc]["inputs"].update(first)
    p["70"] = {"class_type": "UNETLoader", "inputs": {"unet_name": "tiny_wan21_t2v_4heads.safetensors",
                                                      "weight_dtype": "default"}}
    p["71"] = {"class_type": "ParallelConfig", "inputs": {**p[pc]["inputs"], **second}}
    p["72"] = {"class_type": "ShardTransformer", "inputs": {"model": ["70", 0], "parallel_config": ["71", 0]}}
    common = {"add_noise": "enable", "noise_seed": 81, "steps": 4, "cfg": 3.0, "sampler_name": "euler",
              "scheduler": "simple", "positive": k["positive"], "negative": k["negative"]}
    p["73"] = {"class_type": "KSamplerAdvanced", "inputs": {**common, "model": k["model"], "latent_image": k["latent_image"],
                                                            "start_at_step": 0, "end_at_step": 2,
                                                            "return_with_leftover_noise": "enable"}}
    p["74"] = {"class_type": "KSamplerAdvanced", "inputs": {**common, "add_noise": "disable", "model": ["72", 0],
                                                            "latent_image": ["73", 0], "start_at_step": 2,
                                                            "end_at_step": 4, "return_with_leftover_noise": "disable"}}
    for node in p.values():
        for name, value in node["inputs"].items():
            if value == [ks, 0]:
                node["inputs"][name] = ["74", 0]
    return p


def with_shard_vae(prompt: dict, parallel: dict) -> dict:
    """The tiny workflow unsharded except for the VAE, plus a round trip through VAEEncode."""
    p = remove_passthrough(prompt, "ShardTransformer", "model")
    (vae_loader,) = find_nodes(p, "VAELoader")
    (decode,) = find_nodes(p, "VAEDecode")
    p["60"] = parallel_config_node(**parallel)
    p["61"] = {"class_type": "ShardVAE", "inputs": {"vae": [vae_loader, 0], "parallel_config": ["60", 0]}}
    p[decode]["inputs"]["vae"] = ["61", 0]
    p["62"] = {"class_type": "VAEEncode", "inputs": {"pixels": [decode, 0], "vae": ["61", 0]}}
    p["63"] = {"class_type": "SaveLatent", "inputs": {"samples": ["62", 0], "filename_prefix": "latents/reencoded"}}
    for node_id in find_nodes(p, "SaveLatent"):
        if node_id != "63":
            del p[node_id]
    return p


def text_encoder_prompt(text: str, folder: str, parallel=None) -> dict:
    """CLIPLoader (the tiny T5-base) -> Shard Text Encoder -> CLIPTextEncode, the conditioning saved to ``folder``."""
    return {
        "1": {"class_type": "CLIPLoader", "inputs": {"clip_name": "tiny_t5_base.safetensors", "type": "stable_audio",
                                                     "device": "default"}},
        "2": parallel_config_node(**{"ulysses_size": 2, **(parallel or {})}),
        "3": {"class_type": "ShardTextEncoder", "inputs": {"clip": ["1", 0], "parallel_config": ["2", 0]}},
        "4": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["3", 0], "text": text}},
        "5": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "6": {"class_type": "SaveTrainingDataset", "inputs": {"latents": ["5", 0], "conditioning": ["4", 0],
                                                              "folder_name": folder, "shard_size": 1000}},
    }
