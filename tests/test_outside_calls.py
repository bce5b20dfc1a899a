"""Layers a model runs outside its sharded forward, under tensor parallelism.

Under TP ComfyUI's full copy of the transformer stays where ComfyUI offloads it (rank 0 computes
with its shard, cut with the LoRA patches applied per layer). Some models still call part of that full copy outside the sampling forward: LTX-2's
``extra_conds`` runs the text connectors (``preprocess_text_embeds``), MiniMax-H3's its token
refiner. Those calls must see the patched weights, on the device of their inputs, as the unsharded
model does: here a LoRA on LTX-2's connectors under TP 2 equals the unsharded
run with the same LoRA (on the connectors only: dropped there, the sharded run would equal the
run without the LoRA)."""
from __future__ import annotations

import pytest
from safetensors.torch import save_file

from test_comfy_families import final_latents, max_error
from tiny_families import FAMILIES, family_prompt
from tiny_models import lora_state_dict

pytestmark = [pytest.mark.comfy_server, pytest.mark.skipif("ltxav" not in FAMILIES, reason="LTX-2 is ComfyUI 0.33's")]
TOL = 1e-4
LORA = "tiny_ltxav_connector_lora.safetensors"  # written by the test


def connector_lora(base) -> None:
    model = FAMILIES["ltxav"].build()
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    targets = [n for n, m in model.named_modules() if getattr(m, "weight", None) is not None and m.weight.ndim == 2
               and "embeddings_connector" in n]  # only layers the sampling forward never runs
    assert targets
    path = base / "models" / "loras" / LORA
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(lora_state_dict(shapes, targets, rank=4, seed=31), str(path))


def with_lora(prompt: dict, strength: float) -> dict:
    prompt["50"] = {"class_type": "LoraLoaderModelOnly", "inputs": {"model": ["1", 0], "lora_name": LORA,
                                                                    "strength_model": strength}}
    target = "3" if "3" in prompt else "7"
    prompt[target]["inputs"]["model"] = ["50", 0]
    return prompt


def test_a_lora_on_ltx2s_text_connectors_reaches_the_conditioning_under_tp(tiny_server):
    connector_lora(tiny_server.base_dir)
    plain = final_latents(tiny_server, family_prompt("ltxav", None))
    ref = final_latents(tiny_server, with_lora(family_prompt("ltxav", None), 1.0))
    assert max_error(ref, plain) > 1e-2  # the LoRA changes the result
    out = final_latents(tiny_server, with_lora(family_prompt("ltxav", {"tp_size": 2}), 1.0))
    err = max_error(out, ref)
    print(f"\nLTX-2 with a connector LoRA, TP 2: max abs err {err:.2e} (without the LoRA "
          f"{max_error(out, plain):.2e})")
    assert err <= TOL
