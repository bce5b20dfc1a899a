"""Small configs of every supported model family, built from ComfyUI's own classes,
with inputs whose token counts do not divide by the world size.

Each case returns (model, args, kwargs) for ``model._forward``; batch 2 stands for
ComfyUI's batched cond + uncond, so the cfg dimension has something to split.
"""
from __future__ import annotations

import importlib
import importlib.util

import torch

import comfy.ops

from tiny_models import TinyWan, build_wan_model, make

OPS = comfy.ops.disable_weight_init

CASES = {}


def available(module: str | None) -> bool:
    """Whether this ComfyUI has ``module`` (families newer than 0.3.75 are only registered where
    their classes exist: there is nothing to shard elsewhere)."""
    if module is None:
        return True
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing too
        return False


def case(name, needs: str | None = None):
    def register(fn):
        if available(needs):
            CASES[name] = fn
        return fn
    return register


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def seeded(model, seed=0, scale=0.05):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=gen) * scale)
    return model.eval()


def flux1(heads=2, **extra):
    from comfy.ldm.flux.model import Flux

    axes = [16, 56, 56] if heads == 2 else [16, 24, 24]
    return seeded(make(Flux, image_model="flux", in_channels=16, out_channels=16, vec_in_dim=32, context_in_dim=64,
                       hidden_size=256, mlp_ratio=4.0, num_heads=heads, depth=2, depth_single_blocks=2,
                       axes_dim=axes, theta=10000, patch_size=2, qkv_bias=True, guidance_embed=True,
                       dtype=torch.float32, device="cpu", operations=OPS, **extra), seed=20)


def flux_control(tokens, hidden=256, double=2, single=2, seed=30):
    """ControlNet residuals as ComfyUI's control_merge returns them: one per block, main image tokens."""
    return {"input": [randn(2, tokens, hidden, seed=seed + i) * 0.1 for i in range(double)],
            "output": [randn(2, tokens, hidden, seed=seed + 10 + i) * 0.1 for i in range(single)], "middle": []}


@case("wan21_t2v")
def wan_t2v():
    model = build_wan_model(TinyWan(dim=256, ffn_dim=512, num_layers=2), seed=0, text_dim=64)
    x = randn(2, 16, 3, 10, 14, seed=1)  # 3 x 5 x 7 = 105 tokens
    return model, (x, torch.tensor([700.0, 300.0]), randn(2, 7, 64, seed=2)), {}


@case("wan21_i2v")
def wan_i2v():
    model = build_wan_model(TinyWan(dim=256, ffn_dim=512, num_layers=2), seed=4, text_dim=64, model_type="i2v")
    x = randn(2, 16, 2, 6, 10, seed=5)  # 30 tokens
    return model, (x, torch.tensor([900.0, 100.0]), randn(2, 9, 64, seed=6)), {"clip_fea": randn(2, 257, 1280, seed=7)}


@case("wan22_ti2v_per_frame_t")
def wan_per_frame():
    """Wan 2.2 TI2V: one timestep per latent frame, repeated per token by the model."""
    model = build_wan_model(TinyWan(dim=256, ffn_dim=512, num_layers=2), seed=8, text_dim=64)
    x = randn(2, 16, 3, 6, 10, seed=9)  # 45 tokens
    t = torch.rand(2, 3, generator=torch.Generator().manual_seed(10)) * 1000
    return model, (x, t, randn(2, 5, 64, seed=11)), {}


def vace_case(heads, seed):
    """Wan VACE with two control streams over 45 video tokens."""
    from comfy.ldm.wan.model import VaceWanModel

    model = seeded(VaceWanModel(dim=256, ffn_dim=512, num_heads=heads, num_layers=2, text_dim=64, vace_layers=1,
                                vace_in_dim=32, operations=OPS), seed=seed)
    x = randn(2, 16, 3, 6, 10, seed=seed + 1)
    kwargs = {"vace_context": randn(2, 2, 32, 3, 6, 10, seed=seed + 2), "vace_strength": [1.0, 0.5]}
    return model, (x, torch.tensor([600.0, 200.0]), randn(2, 5, 64, seed=seed + 3)), kwargs


@case("wan_vace")
def wan_vace():
    return vace_case(2, seed=12)


@case("flux1")
def flux1_plain():
    x = randn(2, 16, 10, 14, seed=21)  # 5 x 7 = 35 image + 7 text tokens
    return flux1(), (x, torch.tensor([0.7, 0.3]), randn(2, 7, 64, seed=22)), \
        {"y": randn(2, 32, seed=23), "guidance": torch.tensor([3.5, 3.5])}


@case("flux1_kontext_controlnet")
def flux1_kontext():
    """A Kontext reference appended after the image, and ControlNet residuals over the main image only."""
    x = randn(2, 16, 10, 14, seed=24)
    kwargs = {"y": randn(2, 32, seed=25), "guidance": torch.tensor([2.5, 2.5]),
              "ref_latents": [randn(2, 16, 6, 6, seed=26)], "control": flux_control(35)}
    return flux1(), (x, torch.tensor([0.6, 0.4]), randn(2, 9, 64, seed=27)), kwargs


def flux2_case(heads, axes_dim, seed):
    """A two-head or four-head Flux.2 with a 3 x 3 reference image after 35 image tokens."""
    from comfy.ldm.flux.model import Flux

    model = seeded(make(Flux, image_model="flux2", in_channels=128, out_channels=128, vec_in_dim=None, context_in_dim=64,
                        hidden_size=256, mlp_ratio=3.0, num_heads=heads, depth=1, depth_single_blocks=2,
                        axes_dim=axes_dim, theta=2000, patch_size=1, qkv_bias=False, guidance_embed=True,
                        global_modulation=True, mlp_silu_act=True, ops_bias=False, default_ref_method="index",
                        ref_index_scale=10.0, dtype=torch.float32, device="cpu", operations=OPS), seed=seed)
    x = randn(2, 128, 5, 7, seed=seed + 1)
    kwargs = {"guidance": torch.tensor([4.0, 4.0]), "ref_latents": [randn(2, 128, 3, 3, seed=seed + 2)]}
    return model, (x, torch.tensor([0.8, 0.2]), randn(2, 11, 64, seed=seed + 3)), kwargs


@case("flux2")
def flux2():
    return flux2_case(2, [32, 32, 32, 32], seed=40)


def chroma_case(heads, axes_dim, seed):
    """Chroma with ControlNet residuals over its 35 image tokens."""
    from comfy.ldm.chroma.model import Chroma

    model = seeded(make(Chroma, image_model="chroma", in_channels=64, out_channels=64, context_in_dim=64, hidden_size=256,
                        mlp_ratio=4.0, num_heads=heads, depth=2, depth_single_blocks=2, axes_dim=axes_dim,
                        theta=10000, patch_size=2, qkv_bias=True, in_dim=64, out_dim=256, hidden_dim=128,
                        n_layers=2, dtype=torch.float32, device="cpu", operations=OPS), seed=seed)
    x = randn(2, 16, 10, 14, seed=seed + 1)
    return model, (x, torch.tensor([0.5, 0.9]), randn(2, 7, 64, seed=seed + 2), torch.zeros(2)), \
        {"control": flux_control(35, seed=seed + 3)}


@case("chroma_controlnet")
def chroma():
    return chroma_case(2, [16, 56, 56], seed=50)


def qwen_model():
    from comfy.ldm.qwen_image.model import QwenImageTransformer2DModel

    return seeded(QwenImageTransformer2DModel(patch_size=2, in_channels=64, out_channels=16, num_layers=2,
                                              attention_head_dim=128, num_attention_heads=2, joint_attention_dim=64,
                                              axes_dims_rope=(16, 56, 56), dtype=torch.float32, operations=OPS),
                  seed=60)


@case("qwen_image_controlnet")
def qwen_image():
    x = randn(2, 16, 1, 10, 14, seed=61)  # 35 image tokens
    control = {"input": [randn(2, 35, 256, seed=62) * 0.1, randn(2, 35, 256, seed=63) * 0.1]}
    return qwen_model(), (x, torch.tensor([0.5, 0.25]), randn(2, 7, 64, seed=64)), {"control": control}


@case("qwen_image_edit")
def qwen_image_edit():
    x = randn(2, 16, 1, 10, 14, seed=65)
    kwargs = {"ref_latents": [randn(2, 16, 1, 8, 6, seed=66)], "ref_latents_method": "index"}
    return qwen_model(), (x, torch.tensor([0.5, 0.75]), randn(2, 9, 64, seed=67)), kwargs


LUMINA2 = dict(axes_lens=[300, 512, 512], rope_theta=10000.0, ffn_dim_multiplier=4.0)
Z_IMAGE = dict(axes_lens=[1536, 512, 512], rope_theta=256.0, ffn_dim_multiplier=8.0 / 3.0, z_image_modulation=True,
               time_scale=1000.0, pad_tokens_multiple=32)


def next_dit_case(heads, kv_heads, axes_dims, variant, seed):
    """A NextDiT (Lumina2 or Z-Image) over 35 image and 7 caption tokens."""
    from comfy.ldm.lumina.model import NextDiT

    model = seeded(NextDiT(patch_size=2, in_channels=16, dim=256, n_layers=2, n_refiner_layers=1, n_heads=heads,
                           n_kv_heads=kv_heads, qk_norm=True, cap_feat_dim=64, axes_dims=axes_dims,
                           dtype=torch.float32, operations=OPS, **variant), seed=seed)
    x = randn(2, 16, 10, 14, seed=seed + 1)
    return model, (x, torch.tensor([0.3, 0.6]), randn(2, 7, 64, seed=seed + 2), 7), {}


@case("lumina2")
def lumina2():
    return next_dit_case(4, 2, [16, 24, 24], LUMINA2, seed=70)


@case("z_image")
def z_image():
    return next_dit_case(2, 2, [32, 48, 48], Z_IMAGE, seed=73)


def hunyuan_case(heads, axes_dim, seed):
    """HunyuanVideo with 3 x 3 x 5 = 45 video tokens and 10 text tokens."""
    from comfy.ldm.hunyuan_video.model import HunyuanVideo

    model = seeded(make(HunyuanVideo, image_model="hunyuan_video", in_channels=16, out_channels=16, vec_in_dim=768,
                                context_in_dim=64, hidden_size=256, mlp_ratio=4.0, num_heads=heads, depth=1,
                                depth_single_blocks=2, axes_dim=axes_dim, theta=256, patch_size=[1, 2, 2],
                                qkv_bias=True, guidance_embed=True, byt5=False, meanflow=False,
                                use_cond_type_embedding=False, vision_in_dim=None, dtype=torch.float32,
                                device="cpu", operations=OPS), seed=seed)
    x = randn(2, 16, 3, 6, 10, seed=seed + 1)
    kwargs = {"y": randn(2, 768, seed=seed + 2), "guidance": torch.tensor([6.0, 6.0])}
    return model, (x, torch.tensor([500.0, 900.0]), randn(2, 10, 64, seed=seed + 3)), kwargs


@case("hunyuan_video")
def hunyuan_video():
    return hunyuan_case(2, [16, 56, 56], seed=80)


@case("hunyuan_video_ref_latent")
def hunyuan_video_ref():
    """A reference latent prepended to the video tokens (removed by the model after the blocks).
    Batch 1: the stock model cannot build reference ids for a larger batch."""
    model, (x, t, context), kwargs = CASES["hunyuan_video"]()
    kwargs = {"y": kwargs["y"][:1], "guidance": kwargs["guidance"][:1], "ref_latent": randn(1, 16, 1, 6, 10, seed=84)}
    return model, (x[:1], t[:1], context[:1]), kwargs


def ltxv_model(heads=2, seed=90):
    """LTXV of width 256: two heads of 128 or four of 64."""
    from comfy.ldm.lightricks.model import LTXVModel

    return seeded(LTXVModel(in_channels=128, cross_attention_dim=256, attention_head_dim=256 // heads,
                            num_attention_heads=heads, caption_channels=64, num_layers=2, dtype=torch.float32,
                            device="cpu", operations=OPS), seed=seed)


@case("ltxv")
def ltxv():
    x = randn(2, 128, 3, 5, 7, seed=91)  # 105 tokens
    return ltxv_model(), (x, torch.tensor([0.5, 0.7]), randn(2, 12, 64, seed=92), None), {"frame_rate": 25}


@case("ltxv_per_token_timestep")
def ltxv_per_token():
    """With a denoise mask (image-to-video, keyframes) LTXV gets one timestep per token."""
    x = randn(2, 128, 3, 5, 7, seed=93)
    t = torch.rand(2, 105, 1, generator=torch.Generator().manual_seed(94))
    return ltxv_model(), (x, t, randn(2, 12, 64, seed=95), None), {"frame_rate": 25}


@case("ltxv_keyframe")
def ltxv_keyframe():
    """A guide frame appended after the video, its coordinates given by keyframe_idxs (ComfyUI's
    guide nodes give a denoise mask with it: 0.33 needs one; every token kept)."""
    from comfy.ldm.lightricks.symmetric_patchifier import latent_to_pixel_coords

    model = ltxv_model()
    x = randn(2, 128, 4, 5, 7, seed=96)  # 3 frames + 1 guide frame = 140 tokens
    # The guide's coordinates as ComfyUI's guide nodes compute them: the pixel coordinates of a
    # frame placed at latent frame 2 (their layout differs between ComfyUI releases).
    _, coords = model.patchifier.patchify(x[:, :, :1])
    idx = latent_to_pixel_coords(coords, model.vae_scale_factors, causal_fix=model.causal_temporal_positioning)
    idx = idx.clone()
    idx[:, 0] += 2 * model.vae_scale_factors[0]
    mask = torch.ones(2, 1, 4, 5, 7)
    t = torch.tensor([0.5, 0.7]).view(2, 1, 1).expand(2, 140, 1).contiguous()
    return model, (x, t, randn(2, 12, 64, seed=98), None), \
        {"frame_rate": 25, "keyframe_idxs": idx.float(), "denoise_mask": mask}


# Four attention heads, so that TP 2 x Ulysses 2 has a head per rank (tests/test_tensor_parallel.py).
TP_CASES = {}


def tp_case(name, needs: str | None = None):
    def register(fn):
        if available(needs):
            TP_CASES[name] = fn
        return fn
    return register


@tp_case("wan21_t2v_4heads")
def wan_t2v_4heads():
    import comfy.ldm.wan.model

    model = seeded(comfy.ldm.wan.model.WanModel(model_type="t2v", dim=256, ffn_dim=512, num_heads=4, num_layers=2,
                                                text_dim=64, operations=OPS), seed=100)
    x = randn(2, 16, 3, 10, 14, seed=101)  # 105 tokens
    return model, (x, torch.tensor([700.0, 300.0]), randn(2, 7, 64, seed=102)), {}


@tp_case("wan21_i2v_4heads")
def wan_i2v_4heads():
    import comfy.ldm.wan.model

    model = seeded(comfy.ldm.wan.model.WanModel(model_type="i2v", dim=256, ffn_dim=512, num_heads=4, num_layers=2,
                                                text_dim=64, operations=OPS), seed=103)
    x = randn(2, 16, 2, 6, 10, seed=104)
    return model, (x, torch.tensor([900.0, 100.0]), randn(2, 9, 64, seed=105)), \
        {"clip_fea": randn(2, 257, 1280, seed=106)}


@tp_case("wan22_per_frame_t_4heads")
def wan_per_frame_4heads():
    model, (x, _, context), _ = TP_CASES["wan21_t2v_4heads"]()
    return model, (x, torch.rand(2, 3, generator=torch.Generator().manual_seed(107)) * 1000, context), {}


@tp_case("flux1_4heads_kontext_controlnet")
def flux1_4heads():
    x = randn(2, 16, 10, 14, seed=110)
    kwargs = {"y": randn(2, 32, seed=111), "guidance": torch.tensor([2.5, 2.5]),
              "ref_latents": [randn(2, 16, 6, 6, seed=112)], "control": flux_control(35, seed=113)}
    return flux1(heads=4), (x, torch.tensor([0.6, 0.4]), randn(2, 9, 64, seed=114)), kwargs


@tp_case("flux2_4heads")
def flux2_4heads():
    return flux2_case(4, [16, 16, 16, 16], seed=115)


@tp_case("qwen_image_4heads_controlnet")
def qwen_4heads():
    from comfy.ldm.qwen_image.model import QwenImageTransformer2DModel

    model = seeded(QwenImageTransformer2DModel(patch_size=2, in_channels=64, out_channels=16, num_layers=2,
                                               attention_head_dim=64, num_attention_heads=4, joint_attention_dim=64,
                                               axes_dims_rope=(16, 24, 24), dtype=torch.float32, operations=OPS),
                   seed=120)
    x = randn(2, 16, 1, 10, 14, seed=121)
    control = {"input": [randn(2, 35, 256, seed=122) * 0.1, randn(2, 35, 256, seed=123) * 0.1]}
    return model, (x, torch.tensor([0.5, 0.25]), randn(2, 7, 64, seed=124)), {"control": control}


@tp_case("hunyuan_video_4heads")
def hunyuan_4heads():
    return hunyuan_case(4, [16, 24, 24], seed=125)


@tp_case("wan_vace_4heads")
def wan_vace_4heads():
    return vace_case(4, seed=130)


@tp_case("chroma_4heads_controlnet")
def chroma_4heads():
    return chroma_case(4, [16, 24, 24], seed=135)


@tp_case("ltxv_4heads_per_token_timestep")
def ltxv_4heads():
    x = randn(2, 128, 3, 5, 7, seed=141)
    t = torch.rand(2, 105, 1, generator=torch.Generator().manual_seed(142))
    return ltxv_model(heads=4, seed=140), (x, t, randn(2, 12, 64, seed=143), None), {"frame_rate": 25}


@tp_case("lumina2_8heads_gqa")
def lumina2_gqa():
    """Grouped-query attention: 8 query heads over 4 KV heads (Lumina2 has 24 over 8)."""
    return next_dit_case(8, 4, [8, 12, 12], LUMINA2, seed=145)


@tp_case("z_image_4heads")
def z_image_4heads():
    return next_dit_case(4, 4, [16, 24, 24], Z_IMAGE, seed=148)


# Families newer than ComfyUI 0.3.75, one module each beside this one, registered where their classes exist.
for _cases, _needs in (("families_cogvideo", "comfy.ldm.cogvideo.model"),
                       ("families_kandinsky5", "comfy.ldm.kandinsky5.model"),
                       ("families_krea2", "comfy.ldm.krea2.model"),
                       ("families_joyimage", "comfy.ldm.joyimage.model")):
    if available(_needs):
        _module = importlib.import_module(_cases)
        CASES.update(_module.CASES)
        TP_CASES.update(_module.TP_CASES)


def chroma_radiance_case(heads, axes_dim, seed, head_type, tile, newer, size, scale=0.05):
    """Chroma Radiance over pixels in 4 x 4 patches (35 patch tokens), its NeRF head per patch;
    ``newer``: 0.33's x0 output and sequential text ids, given where this ComfyUI has them."""
    import dataclasses

    from comfy.ldm.chroma_radiance.model import ChromaRadiance, ChromaRadianceParams

    fields = {f.name for f in dataclasses.fields(ChromaRadianceParams)}
    extra = {k: v for k, v in newer.items() if k in fields}
    model = seeded(make(ChromaRadiance, image_model="chroma_radiance", in_channels=3, out_channels=3,
                        context_in_dim=64, hidden_size=256, mlp_ratio=4.0, num_heads=heads, depth=2,
                        depth_single_blocks=2, axes_dim=axes_dim, theta=10000, patch_size=4, qkv_bias=True,
                        in_dim=64, out_dim=256, hidden_dim=128, n_layers=2, nerf_hidden_size=32, nerf_mlp_ratio=2,
                        nerf_depth=2, nerf_max_freqs=4, nerf_tile_size=tile, nerf_final_head_type=head_type,
                        nerf_embedder_dtype=torch.float32, dtype=torch.float32, device="cpu", operations=OPS,
                        **extra), seed=seed, scale=scale)
    x = randn(2, 3, *size, seed=seed + 1)
    return model, (x, torch.tensor([0.5, 0.9]), randn(2, 7 if heads == 2 else 9, 64, seed=seed + 2), torch.zeros(2)), {}


@case("chroma_radiance")
def chroma_radiance():
    """Conv final head, NeRF in tiles of 16 patches, 18 x 27 pixels padded to whole patches by the
    model. Weights at scale 0.1: at 0.05 the NeRF head's normalised weights hide most of what
    attention changes (local-only attention would move the output by only 0.15%)."""
    return chroma_radiance_case(2, [16, 56, 56], seed=150, head_type="conv", tile=16,
                                newer={"use_x0": False, "use_sequential_txt_ids": True}, size=(18, 27), scale=0.1)


@tp_case("chroma_radiance_4heads")
def chroma_radiance_4heads():
    """Linear final head, NeRF untiled, the x0 output (20 x 28 pixels: it needs whole patches)."""
    return chroma_radiance_case(4, [16, 24, 24], seed=155, head_type="linear", tile=0,
                                newer={"use_x0": True, "use_sequential_txt_ids": False}, size=(20, 28))
