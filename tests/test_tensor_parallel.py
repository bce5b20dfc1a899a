"""Tensor parallelism and hybrid meshes (TP innermost) against one process, in fp32.

Rank 0 is this process; the other ranks are worker processes that receive only
their own shard of the weights.
"""
import pytest
import torch

from conftest import cpu_world, single_process_references
from families import TP_CASES
from parallel_runtime.plans import find_plan
from parallel_runtime.weights.shards import TensorParallelError, build_shard

pytestmark = pytest.mark.multirank
TOL = 1e-4
MESHES = {
    "tp2": dict(tp_size=2),
    "tp4": dict(tp_size=4),
    "ulysses2_tp2": dict(ulysses_size=2, tp_size=2),
    "ring2_tp2": dict(ring_size=2, tp_size=2),
    "cfg2_tp2": dict(cfg_size=2, tp_size=2),
    # Ulysses sizes that do not divide the heads (parallel/heads.py pads them): four heads on three
    # ranks (2, 1, 1 real heads), two per TP rank on three (1, 1 and a rank of padding only), and USP.
    "ulysses3": dict(ulysses_size=3),
    "ulysses3_tp2": dict(ulysses_size=3, tp_size=2),
    "ring2_ulysses3": dict(ring_size=2, ulysses_size=3),
}
UNEVEN_QUICK = ("wan21_t2v_4heads", "flux1_4heads_kontext_controlnet", "lumina2_8heads_gqa")


def QUICK_TIER(test: str, params: dict) -> bool:
    """The default run: every TP mesh on every case, Ulysses 3 on every case; Ulysses 3 x TP 2 and
    Ring 2 x Ulysses 3 (six ranks) on Wan, Flux and Lumina 2 (grouped-query attention); ``--full``
    runs the six-rank meshes on every case."""
    if test == "test_matches_single_process" and params.get("world") in ("ulysses3_tp2", "ring2_ulysses3"):
        return params["case"] in UNEVEN_QUICK
    return True
# Largest rank's weights over the whole model, where the sharded layers dominate.
BYTES_LIMIT = {2: 0.55, 4: 0.30}
BYTES_CHECKED = {"wan21_t2v_4heads", "wan22_per_frame_t_4heads", "flux1_4heads_kontext_controlnet", "flux2_4heads",
                 "qwen_image_4heads_controlnet", "wan_vace_4heads", "chroma_4heads_controlnet",
                 "ltxv_4heads_per_token_timestep", "lumina2_8heads_gqa", "z_image_4heads", "cogvideox_4heads",
                 "cogvideox15_i2v_ofs_4heads", "kandinsky5_4heads", "krea2_4heads", "joyimage_4heads",
                 "chroma_radiance_4heads"}


@pytest.fixture(scope="module", params=list(MESHES))
def world(request, runtime):
    return cpu_world(runtime, MESHES[request.param])


@pytest.fixture(scope="module")
def built():
    return single_process_references(TP_CASES)


@pytest.mark.parametrize("case", list(TP_CASES))
def test_matches_single_process(world, built, case):
    model, args, kwargs, ref = built(case)
    with torch.inference_mode():
        out = world.forward(model, find_plan(model), model._forward, args, {**kwargs, "transformer_options": {}})
    err = (out - ref).abs().max().item()
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = world.copies._copies[model].param_bytes / full  # rank 0's shard; every TP rank's is the same size
    print(f"\n{case} on {world.config.describe()}: max abs err {err:.2e}; largest rank holds {largest:.3f} "
          "of the weights")
    assert out.shape == ref.shape
    assert err <= TOL
    tp = world.config.tp_size
    # Layers that stay whole are a large share of these tiny configs only: Wan I2V's CLIP image
    # projection (1280 wide) and HunyuanVideo's text token refiner and pooled-text embedding.
    if case in BYTES_CHECKED and tp > 1:
        assert largest <= BYTES_LIMIT[tp]


def test_shards_partition_the_planned_layers_and_share_the_rest():
    model, _, _ = TP_CASES["flux1_4heads_kontext_controlnet"]()
    plan = find_plan(model).tensor_parallel
    shards = [build_shard(model, plan, r, 2) for r in range(2)]
    qkv = [s.double_blocks[0].img_attn.qkv.weight for s in shards]
    full = model.double_blocks[0].img_attn.qkv.weight
    # q, k and v segments each cut in two: rank r holds rows r of every segment.
    third = full.shape[0] // 3
    for r in range(2):
        expected = torch.cat([full[i * third + r * third // 2: i * third + (r + 1) * third // 2] for i in range(3)])
        assert torch.equal(qkv[r], expected)
    assert shards[0].double_blocks[0].num_heads == 2 and model.double_blocks[0].num_heads == 4
    # Replicated weights are the same tensors, not copies.
    assert shards[1].final_layer.linear.weight is model.final_layer.linear.weight
    # Row-parallel biases are added once, on TP rank 0.
    assert torch.equal(shards[0].double_blocks[0].img_attn.proj.bias, model.double_blocks[0].img_attn.proj.bias)
    assert not shards[1].double_blocks[0].img_attn.proj.bias.any()


def test_sizes_that_do_not_divide_are_refused():
    model, _, _ = TP_CASES["wan21_t2v_4heads"]()
    with pytest.raises(TensorParallelError, match="does not divide by tp_size 3"):
        build_shard(model, find_plan(model).tensor_parallel, 0, 3)


def test_scaled_fp8_weights_shard_in_fp8_with_their_scales(runtime):
    """A scaled-fp8 checkpoint (fp8 weights, one fp32 scale per tensor) stays fp8 on every rank."""
    import comfy.ldm.wan.model
    import comfy.ops

    if not hasattr(comfy.ops, "scaled_fp8_ops"):
        pytest.skip("this ComfyUI (0.33 on) loads scaled fp8 files as QuantizedTensor, which TP refuses by name "
                    "(tests/test_node_refusals.py); its scaled_fp8_ops layer classes are gone")

    fp8 = torch.float8_e4m3fn
    ops = comfy.ops.scaled_fp8_ops(override_dtype=fp8)
    model = comfy.ldm.wan.model.WanModel(model_type="t2v", dim=256, ffn_dim=512, num_heads=4, num_layers=2,
                                         text_dim=64, dtype=torch.float32, operations=ops)
    gen = torch.Generator().manual_seed(130)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("scale_weight"):
                p.fill_(0.01)
            elif p.dtype == fp8:
                p.copy_((torch.randn(p.shape, generator=gen) * 0.05 / 0.01).to(fp8))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    model.eval()
    fp8_params = {n for n, p in model.named_parameters() if p.dtype == fp8}
    assert len(fp8_params) > 20
    x = torch.randn(2, 16, 3, 10, 14, generator=gen)
    args = (x, torch.tensor([700.0, 300.0]), torch.randn(2, 7, 64, generator=gen))
    with torch.inference_mode():
        ref = model(*args, transformer_options={})
    shard = build_shard(model, find_plan(model).tensor_parallel, 1, 2)
    q = shard.blocks[0].self_attn.q
    assert q.weight.dtype == fp8 and q.weight.shape[0] == 128
    assert q.scale_weight is model.blocks[0].self_attn.q.scale_weight
    assert all(p.dtype == fp8 for n, p in shard.named_parameters() if n in fp8_params)

    world = cpu_world(runtime, dict(tp_size=2))
    with torch.inference_mode():
        out = world.forward(model, find_plan(model), model._forward, args, {"transformer_options": {}})
    err = (out - ref).abs().max().item()
    print(f"\nscaled fp8 Wan, TP 2: max abs err {err:.2e}; rank 0 holds "
          f"{world.copies._copies[model].param_bytes / sum(p.numel() * p.element_size() for p in model.parameters()):.3f}")
    assert err <= TOL


@pytest.mark.parametrize("sizes", [dict(tp_size=2), dict(ulysses_size=2)], ids=["tp2", "ulysses2"])
def test_comfy_quantized_layout_weights_shard_with_their_scales(runtime, sizes):
    """A model whose layers hold ComfyUI's QuantizedTensor (per-tensor fp8, as fp8 checkpoints load;
    on 0.33 scaled fp8 files too): TP cuts the fp8 data and keeps each scale, Ulysses sends the
    tensors whole, and both equal one process."""
    import comfy.quant_ops

    from parallel_runtime.weights import quantized as comfy_quantized

    model, args, kwargs = TP_CASES["wan21_t2v_4heads"]()
    layers = [m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith("blocks.")]
    for i, layer in enumerate(layers):
        scale = layer.weight.detach().abs().max().float() / 448.0
        layer.weight = torch.nn.Parameter(comfy.quant_ops.QuantizedTensor.from_float(
            layer.weight.detach(), "TensorCoreFP8Layout", scale=scale), requires_grad=False)
    assert all(comfy_quantized.layout_name(layer.weight) for layer in layers) and len(layers) >= 16
    with torch.inference_mode():
        ref = model._forward(*args, **kwargs, transformer_options={})
    world = cpu_world(runtime, sizes)
    with torch.inference_mode():
        out = world.forward(model, find_plan(model), model._forward, args, {**kwargs, "transformer_options": {}})
    err = (out - ref).abs().max().item()
    held = world.copies._copies[model].param_bytes if world.config.tp_size > 1 else None
    print(f"\nper-tensor fp8 QuantizedTensor Wan on {world.config.describe()}: max abs err {err:.2e}; rank 0 holds "
          f"{held} bytes")
    assert out.shape == ref.shape and err <= TOL
    if world.config.tp_size > 1:  # rank 0 runs its shard: fp8 data, half the rows or columns
        q = world.copies._copies[model].run_module.blocks[0].self_attn.q.weight
        assert comfy_quantized.layout_name(q) is not None and tuple(q.shape) == (128, 256)
