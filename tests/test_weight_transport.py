"""The accelerator paths, run on the CPU: weights over the process group (what NCCL worlds use)
or by IPC handles (one host without NCCL), forced with PARALLEL_WEIGHT_TRANSPORT; staged
point-to-point transfers (gloo on CUDA), forced with PARALLEL_FORCE_STAGING. Every rank runs
the code a GPU runs; each result is compared with one process in fp32."""

import os
import time

import pytest

import torch

from conftest import VersionedSource, counted_forwards
from parallel_runtime.config import HostDevices, build_config
from parallel_runtime.plans import find_plan
from parallel_runtime.weights.shards import build_shard, named_tensors, shard_nbytes
from parallel_runtime.weights.pickling import tensor_digest
from parallel_runtime.world.world import World
from tiny_models import TinyWan, build_wan_model

pytestmark = pytest.mark.multirank
TEXT_DIM = 64
CPU4 = HostDevices("cpu", cpu_count=4)


def start_world(comfyui_path, monkeypatch, env: dict, **sizes):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    n = 1
    for v in sizes.values():
        n *= v
    return World(build_config(**sizes, devices=",".join(["cpu"] * n), host=CPU4), comfyui_path=comfyui_path).start()


def wan_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 16, 3, 10, 14, generator=g), torch.tensor([700.0, 300.0]),
            torch.randn(2, 7, TEXT_DIM, generator=g))


def run(world, model, args, source=None):
    with torch.inference_mode():
        return world.forward(model, find_plan(model), model._forward, args, {"transformer_options": {}}, source=source)


def reference(model, args):
    with torch.inference_mode():
        return model(*args, transformer_options={})


@pytest.mark.parametrize("transport", ["process_group", "handles"])
def test_weights_resent_to_three_workers_when_their_version_changes(comfyui_path, monkeypatch, transport):
    """The first send and every re-send to a world of several workers (both crashed on a GPU
    when a tensor-keyed dict compared CUDA tensors), and exactly the sent bytes on every rank."""
    model = build_wan_model(TinyWan(dim=256, ffn_dim=512, num_layers=2), seed=3, text_dim=TEXT_DIM)
    args = wan_inputs()
    source = VersionedSource()
    world = start_world(comfyui_path, monkeypatch, {"PARALLEL_WEIGHT_TRANSPORT": transport}, ulysses_size=2,
                        ring_size=2)
    try:
        assert world.copies.transport == transport and len(world.workers) == 3
        first = run(world, model, args, source)
        assert (first - reference(model, args)).abs().max().item() <= 1e-5
        layer = model.blocks[1].cross_attn.o
        layer.weight = torch.nn.Parameter(layer.weight.detach() * 1.5, requires_grad=False)  # what a LoRA does
        source.number += 1
        again = run(world, model, args, source)
        err = (again - reference(model, args)).abs().max().item()
        print(f"\n{transport}: after the re-send max abs err {err:.2e}; "
              f"first send {world.copies.last_send['seconds']:.3f}s")
        assert err <= 1e-5 and (again - first).abs().max().item() > 1e-3
        held = world.holdings(model)
        expected = {name: tensor_digest(t) for name, t in named_tensors(model)}
        assert all(held[rank] == expected for rank in range(4))
        # Each rank's load says the bytes it received of the model's total, and the way they came.
        nbytes = sum(t.numel() * t.element_size() for _, t in named_tensors(model))
        time.sleep(0.2)  # the workers publish their figures every 50 ms
        loads = [r["load"] for r in world.status()["ranks"]]
        assert [{k: v for k, v in load.items() if k != "file_read_bytes"} for load in loads] == \
            [{"done_bytes": nbytes, "total_bytes": nbytes, "via": transport}] * 4, loads
    finally:
        world.shutdown("test done")


def test_tp2_x_ulysses2_rank0_holds_its_shard_and_workers_exactly_their_slices(comfyui_path, monkeypatch):
    model = build_wan_model(TinyWan(dim=512, ffn_dim=1024, num_layers=2), seed=5, text_dim=TEXT_DIM)
    args = wan_inputs(seed=1)
    plan = find_plan(model)
    world = start_world(comfyui_path, monkeypatch, {"PARALLEL_WEIGHT_TRANSPORT": "process_group"}, ulysses_size=2,
                        tp_size=2)
    try:
        out = run(world, model, args)
        err = (out - reference(model, args)).abs().max().item()
        full = sum(t.numel() * t.element_size() for _, t in named_tensors(model))
        rank0 = world.copies.run_module(model)
        held0 = sum(t.numel() * t.element_size() for _, t in named_tensors(rank0))
        print(f"\nulysses 2 x tp 2 by process group: max abs err {err:.2e}; rank 0 holds {held0 / full:.3f} of "
              "the weights")
        assert err <= 1e-4
        assert rank0 is not model and held0 == shard_nbytes(model, plan.tensor_parallel, 2) <= 0.55 * full
        held = world.holdings(model)
        for rank in range(4):
            coord = world.layout.coords(rank)["tp"]
            expected = {name: tensor_digest(t)
                        for name, t in named_tensors(build_shard(model, plan.tensor_parallel, coord, 2))}
            assert held[rank] == expected, f"rank {rank} (tp {coord}) does not hold build_shard's slices"
    finally:
        world.shutdown("test done")


def test_staged_point_to_point_equals_the_direct_path(comfyui_path, monkeypatch):
    """Ring attention's K/V blocks and the VAE's halo rows through host buffers (gloo on CUDA)
    give bit for bit what the direct transfers give."""
    from parallel_runtime.plans import check_vae
    from vae_cases import VAES

    model = build_wan_model(TinyWan(dim=256, ffn_dim=512, num_layers=2), seed=6, text_dim=TEXT_DIM)
    args = wan_inputs(seed=2)
    vae, latent, _ = VAES["kl_sd"]()
    results = {}
    for staged in ("0", "1"):
        world = start_world(comfyui_path, monkeypatch, {"PARALLEL_FORCE_STAGING": staged}, ring_size=2)
        try:
            ring = run(world, model, args)
            with torch.inference_mode():
                decoded = world.forward(vae, check_vae(vae), type(vae).decode.__get__(vae), (latent,), {})
            results[staged] = (ring, decoded)
        finally:
            world.shutdown("test done")
    (ring_direct, vae_direct), (ring_staged, vae_staged) = results["0"], results["1"]
    assert (ring_direct - reference(model, args)).abs().max().item() <= 1e-5
    assert torch.equal(ring_staged, ring_direct) and torch.equal(vae_staged, vae_direct)


def test_no_staging_buffer_stays_pinned_after_a_weight_send_or_the_world(comfyui_path, monkeypatch):
    """Gloo on CUDA stages every collective through pinned host buffers (here: staging forced on CPU
    tensors, pinning faked): a weight send used to leave its buckets pinned on every rank for good.
    After each send, and after the world, no rank holds any; a forward's working set may stay."""
    from parallel_runtime.distributed import comm

    monkeypatch.setattr(comm, "HOST", comm._HostBuffers(pin=comm.plain_host, pin_cpu=True))
    model = build_wan_model(TinyWan(dim=256, ffn_dim=512, num_layers=2), seed=4, text_dim=TEXT_DIM)
    plan = find_plan(model).for_module(model)
    source = VersionedSource()
    world = start_world(comfyui_path, monkeypatch, {"PARALLEL_WEIGHT_TRANSPORT": "process_group",
                                                    "PARALLEL_FORCE_STAGING": "1", "PARALLEL_TEST_FAKE_PIN": "1",
                                                    "PARALLEL_HOST_BUFFER_CAP_MB": "64"}, ulysses_size=2)

    def pools():
        return [(r["host_pinned_bytes"], r["host_kept_bytes"]) for r in world.status()["ranks"]]

    try:
        world.copies.ensure(model, plan, source)
        assert comm.HOST.pinned_total > 0, "the send did not go through the pinned staging buffers"
        assert pools() == [(0, 0), (0, 0)]
        run(world, model, wan_inputs(), source)  # Ulysses' all-to-alls, staged: a working set stays
        counted_forwards(world, [1, 1])  # rank 1 publishes its row after its own forward ends
        after_forward = pools()
        assert all(0 < kept <= 64 * 2**20 and pinned >= kept for pinned, kept in after_forward), after_forward
        source.number += 1  # a new version: sent again
        world.copies.ensure(model, plan, source)
        assert pools() == [(0, 0), (0, 0)]
        run(world, model, wan_inputs(), source)
        assert comm.HOST.kept_bytes > 0
    finally:
        world.shutdown("test done")
    assert comm.HOST.pinned_bytes == 0 and comm.HOST.kept_bytes == 0


@pytest.fixture(scope="module")
def gguf_nodes(comfyui_path):
    from tiny_gguf import import_gguf_nodes

    return import_gguf_nodes(comfyui_path)


class PatchedSource(VersionedSource):
    """Patches of packed tensors as ComfyUI-GGUF's patcher holds them, by tensor name."""

    def __init__(self, patches):
        super().__init__()
        self.patches = patches

    def packed_patches(self, name):
        return self.patches.get(name, [])


def gguf_wan(gguf_nodes, seed: int):
    """The tiny Wan with every block Linear in ComfyUI-GGUF's layer class holding Q8_0 blocks (one
    with a LoRA-style patch it applies when it dequantizes), as UnetLoaderGGUF loads a file."""
    from tiny_gguf import quantize_linears

    model = build_wan_model(TinyWan(dim=512, ffn_dim=1024, num_layers=2), seed=seed, text_dim=TEXT_DIM)
    assert quantize_linears(model, "Q8_0", gguf_nodes, prefix="blocks.") == 2 * (8 + 2)
    key = "blocks.0.self_attn.o.weight"
    diff = torch.randn(512, 512, generator=torch.Generator().manual_seed(seed + 1)) * 0.01
    patches = {key: [([(0.7, ("diff", (diff,)), 1.0, None, None)], key)]}
    model.get_parameter(key).patches = patches[key]  # what ComfyUI-GGUF's patcher does on rank 0
    return model, patches


# Each layout on one channel here, on the other in the quantized-layout test below; TP through
# shared memory (CPU ranks' own transport) as well.
STREAM_CASES = [("process_group", dict(tp_size=2)), ("handles", dict(ulysses_size=2)), ("shared", dict(tp_size=2))]


@pytest.mark.parametrize("transport,sizes", STREAM_CASES, ids=["tp2-process_group", "ulysses2-handles", "tp2-shared"])
def test_gguf_blocks_over_the_weight_stream(comfyui_path, monkeypatch, gguf_nodes, transport, sizes):
    """The accelerator weight stream with GGUF tensors: stored blocks travel (and TP cuts them) as
    raw bytes, the patched layer travels with its patch (CP) or with its patch cut alike (TP)."""
    model, patches = gguf_wan(gguf_nodes, seed=7)
    args = wan_inputs(seed=2)
    ref = reference(model, args)
    world = start_world(comfyui_path, monkeypatch, {"PARALLEL_WEIGHT_TRANSPORT": transport}, **sizes)
    try:
        out = run(world, model, args, PatchedSource(patches))
        err = (out - ref).abs().max().item()
        print(f"\nGGUF Q8_0 Wan, {sizes} by {transport}: max abs err {err:.2e}")
        assert err <= 1e-4
        if "tp_size" in sizes:  # rank 0's own shard: blocks cut as stored, the patched layer too
            shard = world.copies.run_module(model).blocks[0]
            assert type(shard.self_attn.q.weight).__name__ == "GGMLTensor" and shard.self_attn.q.weight.shape[0] == 256
            o = shard.self_attn.o.weight  # row-parallel: half the input features, Q8_0 blocks and all
            assert type(o).__name__ == "GGMLTensor" and tuple(o.tensor_shape) == (512, 256)
            (patch_list, key), = o.patches
            assert key == "blocks.0.self_attn.o.weight" and patch_list[0][1][1][0].shape == (512, 256)
    finally:
        world.shutdown("test done")


@pytest.mark.parametrize("transport", ["shared", "handles"])
def test_a_layer_class_setting_made_on_rank_0_reaches_the_workers(comfyui_path, monkeypatch, gguf_nodes, transport):
    """UnetLoaderGGUFAdvanced sets its dequantization dtype on ComfyUI-GGUF's layer class, not on
    the layers: the workers' classes must take rank 0's value, or they dequantize differently."""
    model, _ = gguf_wan(gguf_nodes, seed=3)
    args = wan_inputs(seed=4)
    default = reference(model, args)
    monkeypatch.setattr(gguf_nodes.ops.GGMLOps.Linear, "dequant_dtype", torch.float32, raising=False)
    ref = reference(model, args)
    assert (ref - default).abs().max().item() > 1e-4  # the setting changes the result
    world = start_world(comfyui_path, monkeypatch, {"PARALLEL_WEIGHT_TRANSPORT": transport}, ulysses_size=2)
    try:
        err = (run(world, model, args) - ref).abs().max().item()
        print(f"\nGGUF dequantized in fp32 on rank 0, Ulysses 2 by {transport}: max abs err {err:.2e}")
        assert err <= 1e-5
    finally:
        world.shutdown("test done")


@pytest.mark.parametrize("transport,sizes", [("handles", dict(tp_size=2)), ("process_group", dict(ulysses_size=2)),
                                             ("staged", dict(tp_size=2))],
                         ids=["tp2-handles", "ulysses2-process_group", "tp2-staged"])
def test_comfy_quantized_layouts_over_the_weight_stream(comfyui_path, monkeypatch, transport, sizes):
    """ComfyUI's QuantizedTensor (per-tensor fp8, as fp8 checkpoints load) over the accelerator
    weight stream: data and scale tensors travel as slots, and under TP each rank receives its
    part (fp8 data cut, scale kept), against one process. "staged": the process group staged
    through the stream's pinned ring (gloo on GPU tensors)."""
    if transport == "staged":
        monkeypatch.setenv("PARALLEL_FORCE_STAGING", "1")
        monkeypatch.setenv("PARALLEL_TEST_FAKE_PIN", "1")
        transport = "process_group"
    import comfy.quant_ops

    from parallel_runtime.weights import quantized as comfy_quantized

    model = build_wan_model(TinyWan(dim=512, ffn_dim=1024, num_layers=2), seed=9, text_dim=TEXT_DIM)
    for name, layer in model.named_modules():
        if name.startswith("blocks.") and isinstance(layer, torch.nn.Linear):
            scale = layer.weight.detach().abs().max().float() / 448.0
            layer.weight = torch.nn.Parameter(comfy.quant_ops.QuantizedTensor.from_float(
                layer.weight.detach(), "TensorCoreFP8Layout", scale=scale), requires_grad=False)
    args = wan_inputs(seed=3)
    ref = reference(model, args)
    world = start_world(comfyui_path, monkeypatch, {"PARALLEL_WEIGHT_TRANSPORT": transport}, **sizes)
    try:
        out = run(world, model, args, VersionedSource())
        err = (out - ref).abs().max().item()
        print(f"\nfp8 QuantizedTensor Wan, {sizes} by {transport}: max abs err {err:.2e}")
        assert err <= 1e-4
        if "tp_size" in sizes:
            q = world.copies.run_module(model).blocks[1].self_attn.q.weight
            assert comfy_quantized.layout_name(q) is not None and tuple(q.shape) == (256, 512)
    finally:
        world.shutdown("test done")


def test_a_node_pack_module_loads_without_the_pack_init_until_something_needs_it(tmp_path):
    """Workers unpickle layer classes of other node packs by the module name ComfyUI gave them
    (the folder's path, dots as _x_). Only that module is imported: the pack's __init__ (its nodes,
    which import much of ComfyUI) runs only for a module or class that needs it."""
    from parallel_runtime.weights import pickling as transport

    marker = tmp_path / "inits"
    pack = tmp_path / "Some.Pack"
    pack.mkdir()
    (pack / "__init__.py").write_text(f"open({str(marker)!r}, 'a').write('x')\nVALUE = 7\nclass FromInit:\n    pass\n")
    (pack / "ops.py").write_text("class Layer:\n    pass\n")
    (pack / "needs_init.py").write_text("from . import VALUE\n")
    name = str(pack).replace(".", "_x_")

    assert transport.import_module(f"{name}.ops").Layer.__module__ == f"{name}.ops"
    assert not marker.exists()  # the pack's __init__ did not run
    assert transport.import_module(f"{name}.needs_init").VALUE == 7
    assert marker.read_text() == "x"  # run once, when a module needed it
    assert transport.import_module(name).FromInit and marker.read_text() == "x"

    other = tmp_path / "Other.Pack"
    other.mkdir()
    (other / "__init__.py").write_text(f"open({str(marker)!r}, 'a').write('y')\nclass FromInit:\n    pass\n")
    assert transport.import_module(str(other).replace(".", "_x_")).FromInit  # a class of the __init__ itself
    assert marker.read_text() == "xy"
    with pytest.raises(ModuleNotFoundError):
        transport.import_module(str(other).replace(".", "_x_") + ".missing")


def test_tp_cuts_each_tensor_where_comfyui_left_it_and_moves_it_off_one_at_a_time(comfyui_path, monkeypatch):
    """TP after an unsharded run of the same model (issue 29): ComfyUI left the full weights on
    rank 0's device. They are cut from there and each tensor leaves for the offload device right
    after its cut, during the send, not in one whole-model move through pageable memory before it.
    Here the offload device is ``meta`` (a stand-in: on the CPU there is no second device) so that
    every move is visible."""
    from parallel_runtime.weights import sources as comfy_weights, stream as weight_stream

    model = build_wan_model(TinyWan(dim=256, ffn_dim=512, num_layers=2), seed=9, text_dim=TEXT_DIM)
    args = wan_inputs(seed=2)
    ref = reference(model, args)
    plan = find_plan(model)
    expected = {c: {name: tensor_digest(t) for name, t in named_tensors(build_shard(model, plan.tensor_parallel, c, 2))}
                for c in range(2)}
    events = []
    offload_tensor = comfy_weights.offload_tensor
    monkeypatch.setattr(comfy_weights, "offload_tensor",
                        lambda owner, leaf, device: events.append("moved") or offload_tensor(owner, leaf, device))
    send_scatter = weight_stream.ProcessGroupChannel.send_scatter
    monkeypatch.setattr(weight_stream.ProcessGroupChannel, "send_scatter",
                        lambda self, payloads: events.append("bucket") or send_scatter(self, payloads))
    monkeypatch.setattr(weight_stream, "BUCKET_BYTES", 256 * 1024)  # several buckets for this small model
    world = start_world(comfyui_path, monkeypatch, {"PARALLEL_WEIGHT_TRANSPORT": "process_group"}, tp_size=2)
    try:
        comfy_weights.leave_device_after_cut(model, "meta")
        out = run(world, model, args)
        assert (out - ref).abs().max().item() <= 1e-4  # cut from the data before it moved
        assert all(t.device.type == "meta" for _, t in named_tensors(model))  # the full weights left
        assert comfy_weights.offload_target(model) is None
        # Moves happen between buckets, not all before the first or after the last.
        first_bucket, last_bucket = events.index("bucket"), len(events) - 1 - events[::-1].index("bucket")
        assert "moved" in events[first_bucket:last_bucket]
        held = world.holdings(model)
        assert held[0] == expected[0] and held[1] == expected[1]
        events.clear()
        again = run(world, model, args)  # held already: nothing sent, nothing left to move
        assert (again - ref).abs().max().item() <= 1e-4 and "bucket" not in events
    finally:
        world.shutdown("test done")


def test_a_shared_memory_manager_timeout_is_tried_again_and_other_errors_are_not():
    """A worker's connection to torch's shared-memory manager timed out once in CI on an overloaded
    machine: the unpickling is tried again (it only reads its bytes); other errors surface at once."""
    from parallel_runtime.weights import pickling

    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise RuntimeError(f"{pickling.SHM_MANAGER_TIMEOUT}\nframe #0: ...")
        return "module"

    assert pickling._retried(flaky) == "module" and len(calls) == 3
    calls.clear()
    with pytest.raises(RuntimeError, match="timed out"):
        pickling._retried(lambda: calls.append(1) or (_ for _ in ()).throw(RuntimeError(pickling.SHM_MANAGER_TIMEOUT)))
    assert len(calls) == pickling.SHM_MANAGER_TRIES
    calls.clear()
    with pytest.raises(RuntimeError, match="something else"):
        pickling._retried(lambda: calls.append(1) or (_ for _ in ()).throw(RuntimeError("something else")))
    assert len(calls) == 1


@pytest.mark.parametrize("sizes", [{"ulysses_size": 2}, {"tp_size": 2}], ids=["ulysses2", "tp2"])
def test_workers_read_their_weights_from_the_checkpoint_and_the_rest_travels_with_its_reason(
        tmp_path, comfyui_path, monkeypatch, sizes):
    """The stream's path (what GPU ranks take), with the model's checkpoint on disk: every worker
    reads its unpatched tensors from the file (its slices under TP), a patched tensor and one changed
    in place since the save travel over the stream, each with its reason; every rank holds exactly
    what the unsharded model computes with. Switched off, everything travels, and the status says why."""
    from safetensors.torch import save_file

    model = build_wan_model(TinyWan(dim=256, ffn_dim=512, num_layers=2), seed=4, text_dim=TEXT_DIM)
    path = tmp_path / "tiny_wan.safetensors"
    save_file({f"model.diffusion_model.{k}": v.contiguous() for k, v in model.state_dict().items()}, str(path))
    with torch.no_grad():
        model.blocks[0].self_attn.q.weight[-1] += 0.5  # changed in place after the load: must not come from the file
    source = VersionedSource(str(path))
    source.patched_names = {"blocks.1.ffn.0.weight"}
    args = wan_inputs(seed=2)
    plan = find_plan(model)
    tp = sizes.get("tp_size", 1)
    world = start_world(comfyui_path, monkeypatch, {"PARALLEL_WEIGHT_TRANSPORT": "process_group"}, **sizes)
    try:
        out = run(world, model, args, source)
        err = (out - reference(model, args)).abs().max().item()
        reads = world.copies.last_send["file_reads"]
        count = len(list(named_tensors(model)))
        print(f"\n{sizes}: max abs err {err:.2e}; {reads}")
        assert err <= 1e-5
        assert reads["file"] == path.name and reads["tensors"] == count - 2 and reads["streamed_tensors"] == 2
        assert sorted(reads["why_streamed"]) == [
            "differs from the file (changed in place, or the file changed since the load)",
            "patched (a LoRA or another weight patch): sent merged"]
        full = sum(t.numel() * t.element_size() for _, t in named_tensors(model))
        assert 0.8 * full / tp < reads["bytes_per_worker"][0] < full / tp
        held = world.holdings(model)
        for rank in range(world.world_size):
            coord = world.layout.coords(rank)["tp"]
            shard = model if tp == 1 else build_shard(model, plan.tensor_parallel, coord, tp)
            assert held[rank] == {n: tensor_digest(t) for n, t in named_tensors(shard)}, rank
        time.sleep(0.2)
        load = world.status()["ranks"][1]["load"]
        assert load["done_bytes"] == load["total_bytes"] == world.status()["ranks"][1]["param_bytes"]
        read = [r["load"]["file_read_bytes"] for r in world.status()["ranks"][1:]]
        assert read == reads["bytes_per_worker"], read  # each worker read exactly its part, once

        # A new version with the same patched tensors (what a LoRA strength change is): the workers
        # keep what they read, only the patched tensor travels again.
        model.blocks[1].ffn[0].weight.data.mul_(1.25)  # the patch's new merged values (patched: streamed)
        source.number += 1
        changed = run(world, model, args, source)
        assert (changed - reference(model, args)).abs().max().item() <= 1e-5
        assert (changed - out).abs().max().item() > 1e-4
        time.sleep(0.2)
        assert [r["load"]["file_read_bytes"] for r in world.status()["ranks"][1:]] == read  # nothing read again
        held = world.holdings(model)
        for rank in range(world.world_size):
            coord = world.layout.coords(rank)["tp"]
            shard = model if tp == 1 else build_shard(model, plan.tensor_parallel, coord, tp)
            assert held[rank] == {n: tensor_digest(t) for n, t in named_tensors(shard)}, rank
        out = changed

        monkeypatch.setenv("PARALLEL_FILE_READS", "0")
        source.number += 1
        again = run(world, model, args, source)
        assert torch.equal(again, out)
        reads = world.copies.last_send["file_reads"]
        assert reads["tensors"] == 0 and reads["why_streamed"] == {"PARALLEL_FILE_READS=0": count}
    finally:
        world.shutdown("test done")


STREAM_RANKS = r"""
import json, os, sys, time
import torch, torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
sys.path.insert(0, sys.argv[4])
sys.path.insert(0, os.path.join(sys.argv[4], "tests"))
from parallel_runtime.distributed import comm
from parallel_runtime.weights import stream
from parallel_runtime.weights.pickling import tensor_digest
from stream_cases import stream_case
rank, world, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
bucket_bytes = int(sys.argv[5])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
pins = []
comm.HOST = comm._HostBuffers(pin=lambda n: pins.append(n) or comm.plain_host(n), pin_cpu=True)


class Copies(TorchDispatchMode):
    # bytes written by the ops that copy data (what rank 0 moves besides the collectives)
    OPS = {"copy_", "cat", "clone", "_to_copy", "index", "contiguous"}

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in self.OPS:
            t = args[0] if func.overloadpacket.__name__ == "copy_" else out
            self.bytes += t.numel() * t.element_size()
        return out


tensors, entries, tp, coords = stream_case(world)
report = {"rank": rank}
if rank == 0:
    with Copies() as copies:
        kept = stream.send(entries, lambda i: tensors[i], stream.ProcessGroupChannel(), "cpu", tp, coords,
                           keep_coord=coords[0], bucket_bytes=bucket_bytes)
    report["copied"] = copies.bytes
    held = kept
else:
    held = stream.allocate(entries, tp, "cpu")
    started = time.perf_counter()
    stream.receive(entries, held, stream.ProcessGroupChannel(), "cpu", tp, bucket_bytes)
    report["receive_s"] = time.perf_counter() - started
report["held"] = [list(tensor_digest(t)) for t in held]
report["pins"] = len(pins)
report["buckets"] = len(stream.StreamLayout(entries, tp, bucket_bytes).ops)
report["pinned_after"] = comm.HOST.pinned_bytes
print("REPORT " + json.dumps(report), flush=True)
dist.destroy_process_group()
"""


def test_the_staged_weight_stream_pins_two_buffers_for_the_whole_send_and_rank_0_copies_each_byte_once():
    """The weight stream over gloo with accelerator tensors (staging forced, pinning faked, as in the
    workers of a GPU world sharing one device): three ranks of one gloo group run stream.send /
    stream.receive on a model of many small buckets of changing sizes. Every rank pins exactly the
    ring's two buffers for the whole send (the staging pool pinned a buffer per new size, evicting
    and freeing as it went), none stays pinned after it, every rank holds exactly its cut of rank 0's
    tensors (computed here in one process), and rank 0 writes each byte it sends once into its
    buffers, plus its own TP slices once (it used to copy each broadcast bucket back into its own
    source and its own TP slice into a throwaway tensor, besides a concatenated bucket).
    PARALLEL_TEST_SLOW_LOAD_MS makes each worker's receive last that long per bucket."""
    from conftest import run_gloo_ranks
    from parallel_runtime.weights import stream
    from stream_cases import stream_case

    world, bucket_bytes = 3, 8192
    env = {**os.environ, "PARALLEL_FORCE_STAGING": "1", "PARALLEL_TEST_FAKE_PIN": "1",
           "PARALLEL_TEST_SLOW_LOAD_MS": "40"}
    reports = run_gloo_ranks(STREAM_RANKS, world, str(bucket_bytes), env=env)
    tensors, entries, tp, coords = stream_case(world)
    layout = stream.StreamLayout(entries, tp, bucket_bytes)
    for rank, report in enumerate(reports):
        expected = [tensor_digest(t if e.cut is None else e.cut.apply(t, coords[rank], tp))
                    for t, e in zip(tensors, entries)]
        assert [(tuple(shape), dtype, sha) for shape, dtype, sha in report["held"]] == expected, rank
    sent = sum(total if kind == "broadcast" else tp * total for kind, _, total in layout.ops)
    own = sum(e.local_nbytes(tp) for e in entries if e.cut is not None)
    print(f"\n{len(layout.ops)} buckets; pins per rank {[r['pins'] for r in reports]}; rank 0 copied "
          f"{reports[0]['copied']} bytes for {sent} sent and {own} of its own slices")
    assert len(layout.ops) >= 15
    assert [r["pins"] for r in reports] == [2] * world
    assert all(r["pinned_after"] == 0 for r in reports)
    assert reports[0]["copied"] <= sent + own
    assert all(r["receive_s"] >= 0.04 * len(layout.ops) for r in reports[1:])


def test_a_staged_tp_send_of_many_buckets_pins_two_buffers_on_rank_0_and_every_rank_holds_its_slices(
        comfyui_path, monkeypatch):
    """The world's path with the ring (TP 2 over the process group, staging forced and pinning faked,
    as gloo runs GPU tensors): a model of many small buckets pins rank 0's two ring buffers and
    nothing else, and every rank holds exactly build_shard's slices of the unsharded model."""
    from parallel_runtime.distributed import comm
    from parallel_runtime.weights import stream as weight_stream

    pins = []
    monkeypatch.setattr(comm, "HOST", comm._HostBuffers(pin=lambda n: pins.append(n) or comm.plain_host(n),
                                                        pin_cpu=True))
    monkeypatch.setattr(weight_stream, "BUCKET_BYTES", 64 * 1024)
    buckets = []
    buffer = comm.StagingRing.buffer
    monkeypatch.setattr(comm.StagingRing, "buffer", lambda ring, k, n: buckets.append(k) or buffer(ring, k, n))
    model = build_wan_model(TinyWan(dim=256, ffn_dim=512, num_layers=2), seed=8, text_dim=TEXT_DIM)
    plan = find_plan(model)
    args = wan_inputs(seed=3)
    world = start_world(comfyui_path, monkeypatch, {"PARALLEL_WEIGHT_TRANSPORT": "process_group",
                                                    "PARALLEL_FORCE_STAGING": "1", "PARALLEL_TEST_FAKE_PIN": "1"},
                        tp_size=2)
    try:
        pins.clear()  # the world's start (its probe's collectives) is not the send
        world.copies.ensure(model, plan.for_module(model), VersionedSource())
        print(f"\nTP 2 in buckets of 64 KiB: {len(set(buckets))} buckets, rank 0 pinned {len(pins)} buffers")
        assert len(set(buckets)) >= 20 and len(pins) == 2
        held = world.holdings(model)
        for rank in range(2):
            expected = {n: tensor_digest(t) for n, t in named_tensors(build_shard(model, plan.tensor_parallel, rank, 2))}
            assert held[rank] == expected, rank
        assert (run(world, model, args) - reference(model, args)).abs().max().item() <= 1e-4
    finally:
        world.shutdown("test done")
