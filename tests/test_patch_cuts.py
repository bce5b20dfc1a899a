"""LoRA patches cut for tensor parallelism like the weight they patch (parallel_runtime/weights/patch_cuts.py):
ComfyUI's own calculate_weight on a rank's slice with its cut patches equals the slice of the
fully patched weight, for every rank, on row and column cuts, fused segments and offsets; the
patches that cannot be cut are named."""
import pytest
import torch

import comfy.lora
from comfy.weight_adapter.lora import LoRAAdapter
from parallel_runtime.weights.patch_cuts import cut_patches
from parallel_runtime.weights.shards import Cut

KEY = "diffusion_model.blocks.0.qkv.weight"


def lora(out_dim, in_dim, rank=4, seed=0, alpha=8.0):
    gen = torch.Generator().manual_seed(seed)
    up, down = torch.randn(out_dim, rank, generator=gen), torch.randn(rank, in_dim, generator=gen)
    return LoRAAdapter({"k"}, (up, down, torch.tensor(alpha), None, None, None))


def patched(weight, patch_list):
    return comfy.lora.calculate_weight(patch_list, weight.clone(), KEY)


def check_every_rank(weight, patch_list, cut, size):
    full = cut.apply(patched(weight, patch_list), 0, 1)  # the whole patched weight
    made = cut_patches([(patch_list, KEY)], cut, size)
    assert not isinstance(made, str), made
    for rank in range(size):
        (local, _), = made.for_rank(rank, size)
        out = patched(cut.apply(weight, rank, size), local)
        expected = cut.apply(full, rank, size)
        assert out.shape == expected.shape
        assert torch.allclose(out, expected, rtol=1e-6, atol=1e-6), (rank, (out - expected).abs().max())
    return made


@pytest.mark.parametrize("size", [2, 4])
def test_a_lora_on_a_fused_weight_cut_by_rows(size):
    """Flux's qkv: three segments of rows, each cut per rank; the LoRA's up rows follow."""
    weight = torch.randn(3 * 64, 96)
    patch_list = [(0.7, lora(3 * 64, 96), 1.0, None, None), (0.5, ("diff", (torch.randn(3 * 64, 96),)), 1.0, None, None)]
    made = check_every_rank(weight, patch_list, Cut("qkv", "segments", 0, (64, 64, 64)), size)
    assert len(made.cuts) == 2  # the LoRA's up, the diff


@pytest.mark.parametrize("size", [2, 4])
def test_a_lora_on_input_features(size):
    """A row-parallel layer (proj, ffn.2): the LoRA's down columns follow."""
    weight = torch.randn(64, 128)
    check_every_rank(weight, [(1.0, lora(64, 128, seed=1), 0.9, None, None)], Cut("proj", "segments", 1, (128,)), size)


def test_offset_patches_of_one_segment_each():
    """LoRAs of q, k and v separately, placed in the fused qkv by their offsets (how ComfyUI maps
    a diffusers-format Flux LoRA), and one on q|k together; the mlp segment of a single block's
    linear1 has none."""
    weight = torch.randn(3 * 64 + 128, 96)
    patch_list = [(1.0, lora(64, 96, seed=s), 1.0, (0, 64 * s, 64), None) for s in range(3)]
    patch_list.append((0.5, lora(128, 96, seed=7), 1.0, (0, 0, 128), None))
    check_every_rank(weight, patch_list, Cut("linear1", "segments", 0, (64, 64, 64, 128)), 2)


def test_an_offset_along_the_other_dimension_stays():
    weight = torch.randn(128, 96)
    check_every_rank(weight, [(1.0, lora(128, 32, seed=3), 1.0, (1, 32, 32), None)], Cut("x", "segments", 0, (128,)), 2)


def test_patches_that_cannot_be_cut_are_named():
    cut = Cut("qkv", "segments", 0, (64, 64, 64))
    up, down = torch.randn(192, 4), torch.randn(4, 96)
    cases = {
        "DoRA": (1.0, LoRAAdapter({"k"}, (up, down, None, None, torch.ones(192, 1), None)), 1.0, None, None),
        "function": (1.0, lora(192, 96), 1.0, None, lambda w: w),
        "offset": (1.0, lora(96, 96), 1.0, (0, 32, 96), None),  # half of two segments
        "set": (1.0, ("set", (torch.zeros(192, 96),)), 1.0, None, None),
    }
    reasons = {name: cut_patches([([p], KEY)], cut, 2) for name, p in cases.items()}
    assert all(isinstance(r, str) for r in reasons.values()), reasons
    assert "DoRA" in reasons["DoRA"] and "function" in reasons["function"]
    assert "not whole segments" in reasons["offset"] and "'set'" in reasons["set"]
    assert "does not apply" in cut_patches([([cases["set"]], KEY)], Cut("kv", "rows", kv=(4, 2, 16)), 2)
    # One adapter at q and at k (each one segment of 64: its up is cut the same way for both) is
    # fine; one at two places whose segments differ (64 + 64 against one of 128) cannot be one slice.
    shared = lora(64, 96)
    check_every_rank(torch.randn(192, 96), [(1.0, shared, 1.0, (0, 0, 64), None), (0.5, shared, 1.0, (0, 64, 64), None)],
                     cut, 2)
    wide = lora(128, 96)
    twice = [(1.0, wide, 1.0, (0, 0, 128), None), (1.0, wide, 1.0, (0, 128, 128), None)]
    assert "shared" in cut_patches([(twice, KEY)], Cut("linear1", "segments", 0, (64, 64, 128)), 2)
