"""Test-only ComfyUI extension: tiny model patches (ControlNets that ComfyUI's ModelPatchLoader
loads into a MODEL_PATCH) for the tiny transformers of tools/tiny_families.py, and a tiny image VAE.

The real patch files are hundreds of megabytes to gigabytes, and ModelPatchLoader builds each class
at the real model's width (3072 for Qwen-Image, 3840 for Z-Image, 5120 for Wan), so no small file
loads through it. ``TinyModelPatchLoader`` builds ComfyUI's own patch classes at the tiny models'
sizes, fills them with seeded weights and wraps them as ModelPatchLoader does, so the stock apply
nodes (QwenImageDiffsynthControlnet, ZImageFunControlnet, WanUni3CControlnetApply) and their stock
patch objects run them unchanged:

- ``qwen_diffsynth``: ``QwenImageBlockWiseControlNet`` (DiffSynth blockwise ControlNet), width 256,
  one control block per block of the tiny Qwen-Image (2).
- ``z_image_fun_2_1``: ``ZImage_Control`` as ModelPatchLoader configures a Fun ControlNet 2.1 file
  (15 control layers, 17 inpaint channels, control noise refiner) at the tiny Z-Image's width,
  heads, FFN and norms (it runs on the model's rope ``pe``, ``adaln_input`` and image tokens).
- ``z_image_fun_2_1_lite``: the same as ModelPatchLoader configures a Fun ControlNet 2.1 lite file
  (3 control layers): with fewer than 21 main layers its patch keeps its control stream from one
  forward to the next (tests/test_patch_state.py).
- ``wan_uni3c``: ``WanUni3CControlnet`` over the tiny Wan's width (its conditioning is Wan's time
  embedding, 256 wide, which WanUni3CControlnetApply compares with the model's ``dim``), on 20 +
  16 channels (latent and I2V mask, then the render video's 16-channel latent).

``TinyImageVAE``: Z-Image's control image needs a 2D autoencoder with 16 latent channels and 8x
compression; ComfyUI's (Flux's) is some 84M parameters, and the tests' tiny Wan VAE returns 5D video
latents, which ZImage_Control cannot take. It offers only what the patches call (``encode`` and
``spacial_compression_encode``); it stays on rank 0. The DiffSynth and Uni3C patches take the tiny
Wan VAE instead (Qwen-Image's VAE is Wan 2.1's): their Wan 2.1 latent format wants 5D latents.
Never shipped with the pack.
"""
import importlib
import sys

import torch

import comfy.model_management
import comfy.model_patcher
import comfy.ops

KINDS = ("qwen_diffsynth", "z_image_fun_2_1", "wan_uni3c", "z_image_fun_2_1_lite")

# The tiny transformers' sizes (tools/tiny_families.py: "qwen_image", "z_image", "wan").
WIDTH = 256
HEADS = 4
QWEN_BLOCKS = 2
QWEN_IN = 64               # 16 latent channels x 2 x 2 patches
Z_IMAGE_FFN_MULTIPLIER = 8.0 / 3.0
WAN_FFN = 1024
WAN_LATENT_CHANNELS = 16


def _stock_patch_nodes():
    """ComfyUI's nodes_model_patch as the server loaded it (under its file path, like any extra
    node file), so the patch model is of the very class ModelPatchLoader builds; imported by name
    outside a server."""
    import nodes

    loader = getattr(nodes, "NODE_CLASS_MAPPINGS", {}).get("ModelPatchLoader")
    if loader is not None and loader.__module__ in sys.modules:
        return sys.modules[loader.__module__]
    import comfy_extras.nodes_model_patch

    return comfy_extras.nodes_model_patch


def build_patch_model(kind: str, device=None) -> torch.nn.Module:
    """ComfyUI's own patch class for ``kind`` at the tiny sizes, fp32, weights not yet set."""
    common = dict(device=device, dtype=torch.float32, operations=comfy.ops.manual_cast)
    if kind == "qwen_diffsynth":
        return _stock_patch_nodes().QwenImageBlockWiseControlNet(num_layers=QWEN_BLOCKS, in_dim=QWEN_IN,
                                                                 additional_in_dim=0, dim=WIDTH, **common)
    if kind in ("z_image_fun_2_1", "z_image_fun_2_1_lite"):
        # ModelPatchLoader's Fun ControlNet 2.1 branch: n_control_layers 15 (the lite file: 3),
        # additional_in_dim 17, refiner_control; the rest as the tiny NextDiT (multiple_of 256, norm_eps
        # 1e-5: its defaults).
        return importlib.import_module("comfy.ldm.lumina.controlnet").ZImage_Control(  # newer than ComfyUI 0.3.75
            dim=WIDTH, n_heads=HEADS, n_kv_heads=HEADS, multiple_of=256, ffn_dim_multiplier=Z_IMAGE_FFN_MULTIPLIER,
            norm_eps=1e-5, qk_norm=True, n_control_layers=3 if kind.endswith("_lite") else 15, control_in_dim=16,
            additional_in_dim=17,
            refiner_control=True, broken=False, **common)
    if kind == "wan_uni3c":
        return importlib.import_module("comfy.ldm.wan.uni3c").WanUni3CControlnet(  # newer than ComfyUI 0.3.75
            in_channels=20 + WAN_LATENT_CHANNELS, conv_out_dim=WIDTH, dim=WIDTH, ffn_dim=WAN_FFN, num_heads=HEADS,
            num_layers=2, time_embed_dim=WIDTH, out_proj_dim=WIDTH, add_channels=7, mid_channels=16, **common)
    raise ValueError(f"unknown tiny model patch kind {kind!r}; one of {', '.join(KINDS)}")


# The layers whose output is added to the model's image tokens (DiffSynth's ``output_proj``,
# Z-Image's ``after_proj``, Uni3C's ``proj_out``): drawn at a fifth of the usual scale, like a
# trained ControlNet's (zero at the start of its training), so the patch changes the tiny model's
# output by some 20 to 30 % (L2) rather than drowning it.
RESIDUAL_LAYERS = (".output_proj.", ".after_proj.", "proj_out.")
RESIDUAL_SCALE = 0.2


def classic_twin(kind: str) -> torch.nn.Module:
    """``kind`` built with ordinary parameters, to draw the weights from. Under ComfyUI 0.33's
    dynamic VRAM (NVIDIA) its layers are built without weights until a state dict is loaded into
    them, so they have no parameters to draw; the twin is built with that switch off."""
    memory_management = sys.modules.get("comfy.memory_management")  # absent before 0.33
    was = getattr(memory_management, "aimdo_enabled", False)
    if memory_management is not None:
        memory_management.aimdo_enabled = False
    try:
        return build_patch_model(kind, device="cpu")
    finally:
        if memory_management is not None:
            memory_management.aimdo_enabled = was


def seeded_state_dict(model: torch.nn.Module, seed: int) -> dict:
    """Weights drawn in the order of the sorted parameter names: norm weights 1, biases about 0
    (0.02 normal), matrices and convolutions normal of std 0.5 / sqrt(fan-in), the scale of
    tools/tiny_weights.py's ``_random_state_dict`` (whose name rules would miss DiffSynth's
    ``x_rms`` / ``y_rms`` norms and take Uni3C's ``norm1.linear`` for a norm), times
    ``RESIDUAL_SCALE`` for the ``RESIDUAL_LAYERS``."""
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    for name, p in sorted(model.named_parameters()):
        owner = model.get_submodule(name.rpartition(".")[0])
        if p.ndim <= 1 and name.endswith("weight") and "norm" in type(owner).__name__.lower():
            value = torch.ones(p.shape)
        elif p.ndim <= 1:
            value = 0.02 * torch.randn(p.shape, generator=gen)
        else:
            value = torch.randn(p.shape, generator=gen) * (0.5 / p[0].numel() ** 0.5)
            if any(layer in f".{name}" for layer in RESIDUAL_LAYERS):
                value = value * RESIDUAL_SCALE
        sd[name] = value.to(torch.float32)
    for name, b in model.named_buffers():
        sd.setdefault(name, b)
    return sd


class TinyModelPatchLoader:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"kind": (list(KINDS),),
                             "seed": ("INT", {"default": 1, "min": 0, "max": 2**31})}}

    RETURN_TYPES = ("MODEL_PATCH",)
    FUNCTION = "load_model_patch"
    CATEGORY = "testing"

    def load_model_patch(self, kind, seed):
        # As ModelPatchLoader.load_model_patch: built on the offload device, wrapped, then loaded.
        model = build_patch_model(kind, device=comfy.model_management.unet_offload_device())
        sd = seeded_state_dict(classic_twin(kind), seed)
        patcher_class = getattr(comfy.model_patcher, "CoreModelPatcher", comfy.model_patcher.ModelPatcher)
        model_patcher = patcher_class(model, load_device=comfy.model_management.get_torch_device(),
                                      offload_device=comfy.model_management.unet_offload_device())
        is_dynamic = getattr(model_patcher, "is_dynamic", lambda: False)
        model.load_state_dict(sd, assign=is_dynamic())
        return (model_patcher,)


class TinyImageAutoencoder:
    """8 x 8 average pooling of the pixels (in -1..1), then a fixed seeded 3 -> 16 linear map: a
    deterministic image encoder with 16 channels and 8x compression, about unit-scale latents."""
    LATENT_CHANNELS = 16
    COMPRESSION = 8

    def __init__(self, seed: int = 7):
        gen = torch.Generator().manual_seed(seed)
        self.weight = torch.randn(self.LATENT_CHANNELS, 3, generator=gen)
        self.bias = 0.1 * torch.randn(self.LATENT_CHANNELS, generator=gen)
        self.latent_channels = self.LATENT_CHANNELS

    def encode(self, pixel_samples):
        """[B, H, W, C] pixels in 0..1 -> [B, 16, H // 8, W // 8] latents (fp32, on the pixels' device)."""
        x = pixel_samples[..., :3].movedim(-1, 1).to(torch.float32) * 2.0 - 1.0
        pooled = torch.nn.functional.avg_pool2d(x, self.COMPRESSION)
        weight, bias = self.weight.to(x.device), self.bias.to(x.device)
        return torch.einsum("oc,bchw->bohw", weight, pooled) + bias[None, :, None, None]

    def spacial_compression_encode(self):
        return self.COMPRESSION

    def spacial_compression_decode(self):
        return self.COMPRESSION


class TinyImageVAE:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {}}

    RETURN_TYPES = ("VAE",)
    FUNCTION = "load_vae"
    CATEGORY = "testing"

    def load_vae(self):
        return (TinyImageAutoencoder(),)


class TinyPatternImage:
    """A seeded random image (or ``frames`` of video) as a control input: every pixel differs, so a
    control token given to the wrong image token changes the result (a flat image would hide it)."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"width": ("INT", {"default": 80, "min": 8, "max": 4096}),
                             "height": ("INT", {"default": 112, "min": 8, "max": 4096}),
                             "frames": ("INT", {"default": 1, "min": 1, "max": 256}),
                             "seed": ("INT", {"default": 5, "min": 0, "max": 2**31})}}

    RETURN_TYPES = ("IMAGE",)
    FUNCTION = "make"
    CATEGORY = "testing"

    def make(self, width, height, frames, seed):
        generator = torch.Generator().manual_seed(seed)
        return (torch.rand(frames, height, width, 3, generator=generator),)


NODE_CLASS_MAPPINGS = {"TinyModelPatchLoader": TinyModelPatchLoader, "TinyImageVAE": TinyImageVAE,
                       "TinyPatternImage": TinyPatternImage}


class TinyDoubleBlockBoost:
    """A block replacement in the style of custom packs that replace Flux double blocks through
    ``patches_replace`` (PuLID-like): the original block, then a per-token change of its image
    tokens, ``img + strength * tanh(img) * scale`` with a seeded per-channel ``scale``. The pack runs
    it on every rank only with a declaration (a user plan file's PATCH_PLANS, written by the test)."""

    def __init__(self, strength: float, hidden: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.scale = torch.randn(hidden, generator=generator)
        self.strength = strength

    def __call__(self, args, extra):
        out = extra["original_block"](args)
        out["img"] = out["img"] + self.strength * torch.tanh(out["img"]) * self.scale.to(out["img"])
        return out


class TinyBlockReplace:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",),
                             "strength": ("FLOAT", {"default": 0.5, "min": -10.0, "max": 10.0, "step": 0.01}),
                             "seed": ("INT", {"default": 2, "min": 0, "max": 2**31})}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"
    CATEGORY = "testing"

    def patch(self, model, strength, seed):
        hidden = model.get_model_object("diffusion_model").hidden_size
        patched = model.clone()
        patched.set_model_patch_replace(TinyDoubleBlockBoost(strength, hidden, seed), "dit", "double_block", 0)
        return (patched,)


NODE_CLASS_MAPPINGS["TinyBlockReplace"] = TinyBlockReplace


class TinyCountingBoost(TinyDoubleBlockBoost):
    """A block replacement that keeps state between forwards, as some patches do: it counts its
    calls, and the change it makes grows with the count, so a forward that starts from another count
    than ComfyUI's (a rank that rebuilt the patch from the count before) changes the result. Runs
    sharded only with a declaration that lists ``calls`` as its state (tests/test_patch_state.py)."""

    def __init__(self, strength: float, hidden: int, seed: int):
        super().__init__(strength, hidden, seed)
        self.calls = 0

    def __call__(self, args, extra):
        self.calls += 1
        out = extra["original_block"](args)
        out["img"] = out["img"] + self.strength * self.calls * torch.tanh(out["img"]) * self.scale.to(out["img"])
        return out


class TinyCountingBlockReplace(TinyBlockReplace):
    def patch(self, model, strength, seed):
        hidden = model.get_model_object("diffusion_model").hidden_size
        patched = model.clone()
        patched.set_model_patch_replace(TinyCountingBoost(strength, hidden, seed), "dit", "double_block", 0)
        return (patched,)


class TinyModelTag:
    """The model as it is, under a tag: a graph that changes the tag gets new objects from the nodes
    after it (ComfyUI caches a node's output by its inputs and its ancestors'), so a test starts a
    patch's state afresh without changing what is computed."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "tag": ("INT", {"default": 0, "min": 0, "max": 2**31})}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "tag"
    CATEGORY = "testing"

    def tag(self, model, tag):
        return (model,)


NODE_CLASS_MAPPINGS.update(TinyCountingBlockReplace=TinyCountingBlockReplace, TinyModelTag=TinyModelTag)
