"""The pack and ComfyUI's model management, in this process: what the ranks receive is what
ComfyUI's forward uses, re-sends follow what ComfyUI changes, tensor parallelism keeps the full
weights out of ComfyUI's loading and tells it rank 0's real size, and an unload frees every rank."""
import pytest
import torch

from conftest import PACK  # the pack as ComfyUI imports it
from tiny_models import TinyWan, wan_state_dict

TOL = 1e-4


def tiny_patcher(seed=0, dim=256):
    import comfy.sd

    return comfy.sd.load_diffusion_model_state_dict(wan_state_dict(TinyWan(dim=dim, ffn_dim=2 * dim), seed=seed))


def lora_like(patcher, strength: float, seed: int = 0):
    """A clone with additive patches on a few weights (the shape of what a LoRA loader adds)."""
    gen = torch.Generator().manual_seed(seed)
    keys = ["diffusion_model.blocks.0.self_attn.v.weight", "diffusion_model.blocks.1.ffn.0.weight",
            "diffusion_model.blocks.1.norm3.weight", "diffusion_model.head.head.weight"]
    sd = patcher.model.state_dict()
    clone = patcher.clone()
    clone.add_patches({k: (torch.randn(sd[k].shape, generator=gen) * 0.05,) for k in keys if k in sd}, strength)
    return clone


def test_the_version_follows_what_comfyui_changes_and_never_compares_tensors(monkeypatch):
    from parallel_runtime.weights.sources import WeightSource

    base = tiny_patcher()
    v0 = WeightSource(base, "diffusion_model.").version()
    assert WeightSource(base.clone(), "diffusion_model.").version() == v0  # a clone: same patches
    lora = lora_like(base, 0.8)
    v1 = WeightSource(lora, "diffusion_model.").version()
    assert v1 != v0
    assert WeightSource(lora_like(base, 0.3), "diffusion_model.").version() not in (v0, v1)  # a strength change
    # What a partial unload changes on rank 0 (how much is loaded, the lowvram flag) leaves the values
    # alone: no new version, nothing sent again.
    model = lora.model
    saved = (model.model_lowvram, getattr(model, "model_loaded_weight_memory", 0), model.lowvram_patch_counter)
    model.model_lowvram, model.model_loaded_weight_memory, model.lowvram_patch_counter = True, 12345, 3
    try:
        assert WeightSource(lora, "diffusion_model.").version() == v1
        assert WeightSource(base, "diffusion_model.").version() == v0
        # A patched layer that ComfyUI now patches at every forward (lowvram): its rounding path changes.
        layer = model.diffusion_model.blocks[0].self_attn.v
        layer.weight_function = [lambda w: w]
        assert WeightSource(lora, "diffusion_model.").version() != v1
        assert WeightSource(base, "diffusion_model.").version() == v0  # no patches: nothing can differ
        del layer.weight_function
    finally:
        model.model_lowvram, model.model_loaded_weight_memory, model.lowvram_patch_counter = saved

    def refuse(*args, **kwargs):
        raise AssertionError("a tensor was compared")
    monkeypatch.setattr(torch.Tensor, "__eq__", refuse)
    monkeypatch.setattr(torch.Tensor, "__bool__", refuse)
    WeightSource(lora, "diffusion_model.").version()


def test_each_weight_is_what_comfyuis_forward_uses():
    """Unpatched, merged by ComfyUI, merged by another clone, and patched per forward (lowvram)."""
    import comfy.model_patcher

    from parallel_runtime.weights.sources import WeightSource, owners

    cpu = torch.device("cpu")
    base = tiny_patcher(seed=1)
    ours, theirs = lora_like(base, 0.8, seed=1), lora_like(base, -0.5, seed=2)
    module = base.model.diffusion_model
    names = [n for n, _ in module.named_parameters()]
    patched_names = [n for n in names if f"diffusion_model.{n}" in ours.patches]
    assert len(patched_names) == 4
    source = WeightSource(ours, "diffusion_model.")
    ahead = {n: source.weight(n, t, cpu).clone() for n, t in module.named_parameters()}  # before ComfyUI patched

    ours.patch_model(cpu)  # what ComfyUI's full load does: patches merged into the module
    merged = dict(module.named_parameters())
    for n in names:
        assert torch.equal(ahead[n], merged[n]), n
        assert source.weight(n, merged[n], cpu) is merged[n]  # merged by these patches: taken as it is
    for n in patched_names:  # the patches matter
        assert not torch.equal(ahead[n], ours.backup[f"diffusion_model.{n}"].weight), n
    ours.unpatch_model(cpu)

    theirs.patch_model(cpu)  # another clone's patches merged: ours come from ComfyUI's backup
    for n, t in module.named_parameters():
        assert torch.equal(source.weight(n, t, cpu), ahead[n]), n
    theirs.unpatch_model(cpu)

    layer_of = owners(module)
    name = patched_names[0]
    layer = layer_of[name]
    key = f"diffusion_model.{name}"
    layer.weight_function = [comfy.model_patcher.LowVramPatch(key, ours.patches)]  # ComfyUI's lowvram state
    try:
        expected = comfy.model_patcher.LowVramPatch(key, ours.patches)(module.get_parameter(name).detach().clone())
        assert torch.equal(source.weight(name, module.get_parameter(name), cpu, layer), expected)
    finally:
        layer.weight_function = []


def sample(model, seed=0):
    import comfy.sample

    g = torch.Generator().manual_seed(seed)
    latent = torch.zeros(1, 16, 2, 8, 10)
    noise = torch.randn(latent.shape, generator=g)
    positive = [[torch.randn(1, 6, 4096, generator=g), {}]]
    negative = [[torch.randn(1, 6, 4096, generator=g), {}]]
    return comfy.sample.sample(model, noise, 2, 3.0, "euler", "simple", positive, negative, latent, seed=seed,
                               disable_pbar=True)


def test_tp_keeps_the_full_weights_out_of_comfyuis_loading_and_an_unload_frees_every_rank():
    import comfy.model_management as mm

    runtime = PACK.parallel_runtime.world.runtime.RUNTIME
    config = PACK.parallel_runtime.config.build_config(tp_size=2, devices="cpu,cpu",
                                                       host=PACK.parallel_runtime.config.HostDevices("cpu"))
    base = tiny_patcher(seed=2, dim=512)
    lora = lora_like(base, 0.7, seed=3)
    try:
        reference = sample(lora)
        mm.unload_all_models()
        sharded = PACK.nodes.ShardTransformerNode.execute(lora, config).result[0]
        out = sample(sharded)
        err = (out - reference).abs().max().item()

        (loaded,) = [m for m in mm.current_loaded_models if m.model is sharded]
        full = mm.module_size(base.model)
        dm_full = mm.module_size(base.model.diffusion_model)
        world = runtime.world
        rank0 = world.copies.run_module(base.model.diffusion_model)
        rank0_bytes = sum(t.numel() * t.element_size() for t in (*rank0.parameters(), *rank0.buffers()))
        print(f"\nTP 2 in ComfyUI: max abs err {err:.2e}; ComfyUI counts {loaded.model_memory() / full:.3f} of the "
              f"model on rank 0's device; rank 0's shard {rank0_bytes / dm_full:.3f} of the transformer")
        assert err <= TOL
        assert loaded.model_memory() == sharded.model_size() <= 0.55 * full  # what ComfyUI frees room for
        assert sharded.model.model_loaded_weight_memory <= 0.55 * full
        # ComfyUI never merged the LoRA into the full weights (the pack patched them per layer).
        assert not [k for k in sharded.backup if k.startswith("diffusion_model.")]
        assert rank0_bytes <= 0.55 * dm_full

        mm.unload_all_models()  # what /free and model switches do
        assert not world.copies.holds(base.model.diffusion_model)
        world.status()  # the workers report what they hold after dropping it
        import time
        deadline = time.monotonic() + 10
        while world.status()["ranks"][1]["param_bytes"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [r["param_bytes"] for r in world.status()["ranks"]] == [0, 0]

        again = sample(sharded)  # loaded and sent again
        assert (again - reference).abs().max().item() <= TOL

        # The unsharded twin loads the whole model onto the device (same patches: ComfyUI keeps it
        # merged when the TP clone comes back); the TP clone must still leave it out.
        assert (sample(lora) - reference).abs().max().item() == 0
        assert lora.model.model_loaded_weight_memory == full
        after_twin = sample(sharded)
        assert (after_twin - reference).abs().max().item() <= TOL
        assert sharded.model.model_loaded_weight_memory == sharded.model_size() <= 0.55 * full
    finally:
        mm.unload_all_models()
        runtime.shutdown("test done")


def test_a_dynamic_vram_patcher_is_sharded_through_comfyuis_non_dynamic_delegate():
    """ComfyUI 0.33's dynamic VRAM (NVIDIA only, so never on this machine) keeps memory-mapped
    weights and per-op LoRA that cannot travel: sharded models ask for the plain delegate."""
    from parallel_runtime.comfyui_glue.patcher import plain_clone

    calls = []

    class Dynamic:
        def is_dynamic(self):
            return True

        def clone(self, disable_dynamic=False):
            calls.append(disable_dynamic)
            return "delegate" if disable_dynamic else "dynamic clone"

    class Plain:  # 0.3.75: no is_dynamic, clone takes no argument
        def clone(self):
            return "plain clone"

    assert plain_clone(Dynamic()) == "delegate" and calls == [True]
    assert plain_clone(Plain()) == "plain clone"


def test_the_dynamic_vram_delegate_loads_as_comfyui_does_without_dynamic_vram(tmp_path, monkeypatch):
    """ComfyUI 0.33 on NVIDIA switches two globals on (``aimdo_enabled`` and ``CoreModelPatcher =
    ModelPatcherDynamic``) and its non-dynamic delegate is reloaded with both still on: the
    layers' lazy loader keeps the file's float32 in a float16 model, the VAE loader assigns
    float32 biases into a bfloat16 VAE (an H100 run failed on every rank: "mat1 and mat2 must
    have the same dtype"). Here the two switches are set as ``main.py`` sets them, with a
    patcher that reports dynamic in place of comfy-aimdo's (which needs a GPU)."""
    import importlib.util

    if importlib.util.find_spec("comfy.memory_management") is None:
        pytest.skip("this ComfyUI has no dynamic VRAM (before 0.33)")
    import comfy.memory_management
    import comfy.model_patcher
    import comfy.sd
    import comfy.utils
    from safetensors.torch import load_file, save_file

    from parallel_runtime.comfyui_glue.patcher import plain_clone
    from tiny_models import wan_vae_state_dict

    class ReportsDynamic(comfy.model_patcher.ModelPatcher):
        def is_dynamic(self):  # what ModelPatcherDynamic answers: loaders assign the file's tensors
            return True

    model_file, vae_file = tmp_path / "wan.safetensors", tmp_path / "wan_vae.safetensors"
    save_file(wan_state_dict(TinyWan(dim=256, ffn_dim=512), seed=3), str(model_file))
    save_file({k: v.float().contiguous() for k, v in wan_vae_state_dict().items()}, str(vae_file))

    def classic_model():
        return comfy.sd.load_diffusion_model(str(model_file), model_options={"dtype": torch.float16})

    def classic_vae():  # the patcher of VAELoader's VAE, with the reload VAELoader registers
        patcher = comfy.sd.load_vae_patcher(str(vae_file))
        patcher.cached_patcher_init = (comfy.sd.load_vae_patcher, (str(vae_file), None, None))
        return patcher

    expected_model, expected_vae = classic_model().model.state_dict(), classic_vae().model.state_dict()
    half = {k for k, v in expected_model.items() if v.dtype == torch.float16}
    assert len(half) > 20  # the classic load: the transformer's weights in the model's dtype

    monkeypatch.setattr(comfy.memory_management, "aimdo_enabled", True)
    monkeypatch.setattr(comfy.model_patcher, "CoreModelPatcher", ReportsDynamic)
    # comfy-aimdo's memory-mapped reader needs its GPU library; the plain reader stands in.
    monkeypatch.setattr(comfy.utils, "load_safetensors", lambda path: (load_file(path), {}))
    dynamic_model, dynamic_vae = classic_model(), classic_vae()
    assert dynamic_model.is_dynamic() and dynamic_vae.is_dynamic()
    # ComfyUI's own delegate, as built under the switches: the file's float32 survives.
    naive = dynamic_model.clone(disable_dynamic=True).model.state_dict()
    assert any(naive[k].dtype == torch.float32 for k in half)

    for dynamic, expected in ((dynamic_model, expected_model), (dynamic_vae, expected_vae)):
        delegate = plain_clone(dynamic)
        assert type(delegate) is comfy.model_patcher.ModelPatcher and not delegate.is_dynamic()
        got = delegate.model.state_dict()
        assert got.keys() == expected.keys()
        for key, value in expected.items():
            assert got[key].dtype == value.dtype, key
            assert torch.equal(got[key], value), key
    # The switches are ComfyUI's again afterwards.
    assert comfy.memory_management.aimdo_enabled is True
    assert comfy.model_patcher.CoreModelPatcher is ReportsDynamic


def test_a_dynamically_loaded_module_travels_without_comfy_aimdos_per_process_state():
    """ComfyUI 0.33's dynamic VRAM (NVIDIA) loads the stock ControlNet as it loads it there, with no
    non-dynamic delegate to take instead: each layer holds its slice of the model's virtual address
    range as raw pointers in a ctypes array (``_v``), device views, a residency signature, and the
    model its ranges (``dynamic_vbars``). An H100 run failed sending it ("Can't pickle
    c_uint_Array_2"). Here those attributes are set as ModelPatcherDynamic sets them (comfy-aimdo
    needs a GPU): the module travels without them and computes as rank 0's, casting per forward."""
    import ctypes

    import comfy.ops

    from parallel_runtime.weights import pickling
    from parallel_runtime.weights.sources import worker_module_state

    ops = comfy.ops.disable_weight_init
    torch.manual_seed(0)
    model = torch.nn.Sequential(ops.Linear(16, 32), torch.nn.GELU(), ops.Linear(32, 8)).float()
    with torch.no_grad():  # disable_weight_init leaves them as the allocator found them (NaN at times)
        for p in model.parameters():
            p.copy_(torch.randn(p.shape) * 0.2)
    model.dynamic_vbars = {torch.device("cpu"): (ctypes.c_uint * 4)()}
    for index, layer in enumerate((model[0], model[2])):
        layer.comfy_cast_weights = True  # as ModelPatcherDynamic.load sets it
        layer.seed_key = str(index)
        layer._v = ((ctypes.c_uint * 2)(), 4096 * index, 4096)  # a slice of the range: pointers
        layer._v_weight = torch.empty(0)
        layer._v_signature = None
        layer._pin_state = {"pinned": (ctypes.c_uint * 2)()}
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    with pytest.raises(Exception, match="c_uint_Array"):  # what the H100 run met: the state cannot travel
        pickling.pack_module(model, module_state=lambda module, state: state)

    data, tensors, _, _ = pickling.pack_skeleton(model, module_state=worker_module_state)
    copy = pickling.unpack_skeleton(data, [t.clone() for t in tensors])
    names = ("dynamic_vbars", "_v", "_v_weight", "_v_signature", "_pin_state")
    assert not any(hasattr(layer, name) for layer in copy.modules() for name in names)
    assert copy[0].comfy_cast_weights and copy[2].comfy_cast_weights  # bf16 input, fp32 weights: cast per op
    for layer in (model[0], model[2]):  # rank 0's layers, as ComfyUI's classic cast path runs them
        del layer._v, layer._v_weight
    expected = model(x)
    out = copy(x)
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)
