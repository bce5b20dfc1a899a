"""The test server's tiny model patches (tests/comfy_extensions/tiny_model_patches): each kind is
ComfyUI's own patch class, deterministic from its seed, and the stock patch object that its apply
node sets (DiffSynthCnetPatch, ZImageControlPatch, WanUni3CCnetPatch) runs it inside the tiny
transformer of its family (tools/tiny_families.py), changing the output visibly, finitely and
differently for another seed. In process, no server."""
import importlib.util

import pytest
import torch

from conftest import REPO
from families import available

EXTENSION = REPO / "tests" / "comfy_extensions" / "tiny_model_patches" / "__init__.py"
# The latent the apply nodes find: 10 x 14 (an 80 x 112 image, the families' IMAGE_LATENT), and for
# Wan 3 latent frames (9 video frames).
H, W = 10, 14


@pytest.fixture(scope="module")
def extension():
    spec = importlib.util.spec_from_file_location("tiny_model_patches", EXTENSION)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def rand(*shape, seed):
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed))


def tiny_transformer(family):
    from tiny_families import FAMILIES, family_state_dict

    model = FAMILIES[family].build()
    model.load_state_dict(family_state_dict(family)[0])
    return model.eval()


def tiny_wan_vae():
    import comfy.sd
    from tiny_models import wan_vae_state_dict

    return comfy.sd.VAE(sd=wan_vae_state_dict())


def qwen_case(extension, patcher):
    import comfy_extras.nodes_model_patch as stock

    # Qwen-Image's VAE is Wan 2.1's: the patch's Wan21 latent format takes its 5D latents only.
    image = rand(1, 8 * H, 8 * W, 3, seed=3)
    patch = stock.DiffSynthCnetPatch(patcher, tiny_wan_vae(), image, 1.0)
    args = (randn(1, 16, 1, H, W, seed=1), torch.tensor([0.6]), randn(1, 7, 64, seed=2))
    return "qwen_image", args, {}, {"double_block": [patch]}


def z_image_case(extension, patcher):
    import comfy.ldm.lumina.controlnet
    import comfy_extras.nodes_model_patch as stock

    assert isinstance(patcher.model, comfy.ldm.lumina.controlnet.ZImage_Control)  # what ZImageFunControlnet asks
    image = rand(1, 8 * H, 8 * W, 3, seed=3)
    patch = stock.ZImageControlPatch(patcher, extension.TinyImageAutoencoder(), image, 1.0)
    args = (randn(1, 16, H, W, seed=1), torch.tensor([0.6]), randn(1, 7, 64, seed=2), 7)
    return "z_image", args, {}, {"double_block": [patch], "noise_refiner": [patch]}


def uni3c_case(extension, patcher):
    import comfy.latent_formats
    import comfy_extras.nodes_model_patch as stock

    render = rand(9, 8 * H, 8 * W, 3, seed=3)
    patch = stock.WanUni3CCnetPatch(patcher, render, tiny_wan_vae(), comfy.latent_formats.Wan21(), 1.0,
                                    sigma_start=float("inf"), sigma_end=0.0)
    args = (randn(1, 16, 3, H, W, seed=1), torch.tensor([700.0]), randn(1, 7, 64, seed=2))
    return "wan", args, {}, {"double_block": [patch]}


CASES = {"qwen_diffsynth": (qwen_case, None),
         "z_image_fun_2_1": (z_image_case, "comfy.ldm.lumina.controlnet"),
         "wan_uni3c": (uni3c_case, "comfy.ldm.wan.uni3c")}


def sample(model, args, kwargs, patches):
    with torch.inference_mode():
        return model(*args, **kwargs, transformer_options={"patches": patches})


@pytest.mark.parametrize("kind", list(CASES))
def test_tiny_patch_runs_in_its_family(extension, kind):
    case, needs = CASES[kind]
    if not available(needs):
        pytest.skip(f"{needs} is newer than ComfyUI 0.3.75")
    loader = extension.TinyModelPatchLoader()
    patcher = loader.load_model_patch(kind, 1)[0]
    again = loader.load_model_patch(kind, 1)[0].model.state_dict()
    other = loader.load_model_patch(kind, 2)[0]
    assert type(patcher).__name__ in ("ModelPatcher", "CoreModelPatcher")
    assert all(torch.equal(v, again[k]) for k, v in patcher.model.state_dict().items())  # deterministic
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in patcher.model.parameters())

    family, args, kwargs, patches = case(extension, patcher)
    model = tiny_transformer(family)
    if kind == "wan_uni3c":  # WanUni3CControlnetApply's check
        assert patcher.model.controlnet_blocks[0].norm1.linear.in_features == model.dim
    plain = sample(model, args, kwargs, {})
    patched = sample(model, args, kwargs, patches)
    _, _, _, other_patches = case(extension, other)
    patched_other = sample(model, args, kwargs, other_patches)

    change = ((patched - plain).norm() / plain.norm()).item()
    seed_change = ((patched_other - patched).norm() / plain.norm()).item()
    print(f"\n{kind}: the patch changes the output by {change:.1%} (L2), another seed by {seed_change:.1%} "
          f"(output max {plain.abs().max().item():.3g}, patched {patched.abs().max().item():.3g})")
    assert patched.shape == plain.shape
    assert torch.isfinite(patched).all() and torch.isfinite(patched_other).all()
    assert 0.05 < change < 0.6  # visible, without drowning the model's own output
    assert seed_change > 0.02


def test_tiny_image_vae(extension):
    vae = extension.TinyImageVAE().load_vae()[0]
    pixels = rand(2, 8 * H, 8 * W, 3, seed=4)
    latent = vae.encode(pixels)
    assert latent.shape == (2, 16, H, W) and latent.dtype == torch.float32
    assert vae.spacial_compression_encode() == 8
    assert torch.equal(latent, extension.TinyImageVAE().load_vae()[0].encode(pixels))
    assert torch.isfinite(latent).all() and 0.1 < latent.std().item() < 10
    assert not torch.allclose(latent, vae.encode(1.0 - pixels))
