"""One tiny diffusion model file per family of the support matrix, for the server-level tests.

Each is built from ComfyUI's own class at a tiny size (width 256, four or eight heads of 64
or 32, so Ulysses 2 and TP 2 both divide) and states that size in its safetensors metadata
(``config`` -> ``transformer``), which the tests' server applies after ComfyUI's own detection
(tests/comfy_extensions/tiny_config_from_metadata). The stock UNETLoader, model_base and
samplers then run them as they run the real models. Blocks make up most of the weights, as in
the real models, so TP's share per rank can be measured. Text widths are 64, the width of the
prompt embeddings written next to them.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from tiny_models import (_random_state_dict, _seeded_, ltx2_video_vae_state_dict, make, siglip_tiny_state_dict,
                         stating_config, taehv_hv15_state_dict, write_conditioning_dataset)
from workflows import parallel_config_node

TEXT_DIM = 64
TEXT_TOKENS = 7
# The prompt datasets: one 7-token text embedding, with what some families' conditioning adds.
PROMPT = "tiny_family_prompt"                # text embedding only
PROMPT_POOLED = "tiny_family_prompt_pooled"  # with a pooled vector (Flux.1, HunyuanVideo, Chroma)
PROMPT_MASKED = "tiny_family_prompt_masked"  # with the attention mask LTXV's encoder gives (0.33 requires it)
# With the byt5 glyph embedding (5 tokens, ByT5-small's width 1472) that HunyuanImage 2.1's and
# HunyuanVideo 1.5's text encoder adds for quoted text.
PROMPT_BYT5 = "tiny_family_prompt_byt5"
BYT5_TOKENS, BYT5_DIM = 5, 1472
# HunyuanVideo 1.5 I2V's image inputs: a SigLIP-width vision encoder (CLIPVisionLoader, through the
# test server's extension) and the light 1.5 autoencoder (VAELoader), see tools/tiny_models.py.
CLIP_VISION_FILE = "tiny_siglip_1152.safetensors"
HV15_VAE_FILE = "tiny_lighttaehy1_5.safetensors"
# LTX-2 image-to-video and keyframes: the tiny LTX-2 video VAE (32x, 8x) that encodes the images.
LTX2_VAE_FILE = "tiny_ltx2_video_vae.safetensors"
# A Flux ControlNet (XLabs' file layout, which ControlNetLoader detects as Flux from its blocks): the
# tiny Flux's width 256 (its residuals add to the transformer's tokens), so detection gives 2 heads
# of 128; one double and one single block.
FLUX_CONTROLNET_FILE = "tiny_flux_controlnet.safetensors"


def flux_controlnet_state_dict(seed: int = 41) -> dict:
    import comfy.ldm.flux.controlnet
    import comfy.ldm.flux.model
    import comfy.ops

    config = dict(in_channels=16, out_channels=16, vec_in_dim=TEXT_DIM, context_in_dim=TEXT_DIM, hidden_size=256,
                  mlp_ratio=4.0, num_heads=2, depth=1, depth_single_blocks=1, axes_dim=[16, 56, 56], theta=10000,
                  qkv_bias=True, guidance_embed=True, patch_size=2)
    if "txt_ids_dims" in {f.name for f in dataclasses.fields(comfy.ldm.flux.model.FluxParams)}:  # 0.33 on
        config["txt_ids_dims"] = []
    sd = _random_state_dict(lambda: make(comfy.ldm.flux.controlnet.ControlNetFlux, image_model="flux",
                                         dtype=torch.float32, operations=comfy.ops.disable_weight_init, **config), seed)
    # BFL's names for the q/k norms, as in the released files (ComfyUI renames them when it loads).
    return {re.sub(r"(query_norm|key_norm)\.weight$", r"\1.scale", k): v.contiguous() for k, v in sd.items()}


# (folder, file) -> (builder, the module a file newer than ComfyUI 0.3.75 needs, or None)
SIDE_FILES = {("controlnet", FLUX_CONTROLNET_FILE): (flux_controlnet_state_dict, None),
              ("clip_vision", CLIP_VISION_FILE): (siglip_tiny_state_dict, None),
              ("vae", HV15_VAE_FILE): (taehv_hv15_state_dict, None),
              ("vae", LTX2_VAE_FILE): (ltx2_video_vae_state_dict, "comfy.ldm.lightricks.av_model")}

IMAGE_LATENT = {"class_type": "EmptySD3LatentImage", "inputs": {"width": 80, "height": 112, "batch_size": 1}}
VIDEO_LATENT = {"class_type": "EmptyHunyuanLatentVideo",
                "inputs": {"width": 80, "height": 48, "length": 9, "batch_size": 1}}
LTXV_LATENT = {"class_type": "EmptyLTXVLatentVideo",
               "inputs": {"width": 224, "height": 160, "length": 17, "batch_size": 1}}
# LTX-2's audio + video latent as ComfyUI's LTXVConcatAVLatent joins it: LTXV's video (105 tokens)
# and an audio latent of 8 channels x 16 frames x 16 bins, LTX-2's audio layout. ComfyUI's own LTX
# audio latent node sizes it from an audio VAE; Ace-Step's empty audio latent has that very shape
# (1.5 s) with no VAE to load.
LTXAV_LATENT = {"class_type": "LTXVConcatAVLatent", "inputs": {"video_latent": ["9", 0], "audio_latent": ["10", 0]}}
LTXAV_LATENT_NODES = {"9": LTXV_LATENT,
                      "10": {"class_type": "EmptyAceStepLatentAudio", "inputs": {"seconds": 1.5, "batch_size": 1}}}
# ComfyUI 0.33 on. Text 64 wide through one connector layer of two heads of 32 (the connectors stay
# whole under TP: ComfyUI runs them when it builds the conditioning); audio four heads of 32.
LTXAV_CONFIG = dict(in_channels=128, audio_in_channels=128, cross_attention_dim=256, audio_cross_attention_dim=128,
                    attention_head_dim=64, audio_attention_head_dim=32, num_attention_heads=4,
                    audio_num_attention_heads=4, caption_channels=TEXT_DIM, num_layers=6,
                    connector_attention_head_dim=32, connector_num_attention_heads=2, connector_num_layers=1)
# LTX-2 inpainting: SetLatentNoiseMask on the video latent (a 224 x 160 mask with its top-left
# 96 x 64 kept) before LTXVConcatAVLatent, which gives the audio an all-ones mask: per-token video
# timesteps (a spatial mask: one per token, not per frame) and per-token audio timesteps.
LTXAV_MASKED_LATENT = {"class_type": "LTXVConcatAVLatent", "inputs": {"video_latent": ["33", 0],
                                                                      "audio_latent": ["10", 0]}}
LTXAV_MASKED_NODES = {**LTXAV_LATENT_NODES,
                      "30": {"class_type": "SolidMask", "inputs": {"value": 1.0, "width": 224, "height": 160}},
                      "31": {"class_type": "SolidMask", "inputs": {"value": 0.0, "width": 96, "height": 64}},
                      "32": {"class_type": "MaskComposite", "inputs": {"destination": ["30", 0], "source": ["31", 0],
                                                                       "x": 0, "y": 0, "operation": "multiply"}},
                      "33": {"class_type": "SetLatentNoiseMask", "inputs": {"samples": ["9", 0], "mask": ["32", 0]}}}
# LTX-2 image-to-video with a keyframe, as ComfyUI's LTX-2 I2V template builds it: the start image
# encoded into the first latent frame (LTXVImgToVideoInplace, kept: mask 0) and a last-frame keyframe
# appended as guide tokens (LTXVAddGuide: keyframe_idxs and a full-strength guide attention entry on
# both conditionings, its latent frame kept too), then joined with the audio latent.
LTXAV_I2V_LATENT = {"class_type": "LTXVConcatAVLatent", "inputs": {"video_latent": ["44", 2],
                                                                   "audio_latent": ["10", 0]}}
LTXAV_I2V_NODES = {**LTXAV_LATENT_NODES,
                   "40": {"class_type": "VAELoader", "inputs": {"vae_name": LTX2_VAE_FILE}},
                   "41": {"class_type": "EmptyImage", "inputs": {"width": 224, "height": 160, "batch_size": 1,
                                                                 "color": 0x3C8CD2}},
                   "42": {"class_type": "LTXVImgToVideoInplace", "inputs": {
                       "vae": ["40", 0], "image": ["41", 0], "latent": ["9", 0], "strength": 1.0, "bypass": False}},
                   "43": {"class_type": "EmptyImage", "inputs": {"width": 224, "height": 160, "batch_size": 1,
                                                                 "color": 0xD2823C}},
                   "44": {"class_type": "LTXVAddGuide", "inputs": {
                       "positive": ["4", 1], "negative": ["5", 0], "vae": ["40", 0], "latent": ["42", 0],
                       "image": ["43", 0], "frame_idx": -1, "strength": 1.0}}}
LTXAV_I2V_CONDITIONING = {"positive": ["44", 0], "negative": ["44", 1]}
# HunyuanImage 2.1: 64 channels at 1/32 of the image, 9 x 11 = 99 tokens.
HUNYUAN_IMAGE_LATENT = {"class_type": "EmptyHunyuanImageLatent", "inputs": {"width": 288, "height": 352, "batch_size": 1}}
# HunyuanVideo 1.5: 32 channels at 1/16 in space and 1/4 in time, 3 x 5 x 7 = 105 tokens.
HV15_SIZE = {"width": 112, "height": 80, "length": 9, "batch_size": 1}
HV15_LATENT = {"class_type": "EmptyHunyuanVideo15Latent", "inputs": HV15_SIZE}
# 1.5 I2V as ComfyUI's template builds it: the start image encoded into the concatenated latent
# (first frame unmasked) and its SigLIP features as vision tokens (3 x 3 patches), both set on the
# conditioning by HunyuanVideo15ImageToVideo, whose outputs KSampler samples.
HV15_I2V_LATENT = {"class_type": "HunyuanVideo15ImageToVideo", "inputs": {
    "positive": ["4", 1], "negative": ["5", 0], "vae": ["23", 0], "start_image": ["21", 0],
    "clip_vision_output": ["22", 0], **HV15_SIZE}}
HV15_I2V_NODES = {
    "20": {"class_type": "CLIPVisionLoader", "inputs": {"clip_name": CLIP_VISION_FILE}},
    "21": {"class_type": "EmptyImage", "inputs": {"width": 112, "height": 80, "batch_size": 1, "color": 0x3C8CD2}},
    "22": {"class_type": "CLIPVisionEncode", "inputs": {"clip_vision": ["20", 0], "image": ["21", 0], "crop": "center"}},
    "23": {"class_type": "VAELoader", "inputs": {"vae_name": HV15_VAE_FILE}},
}
# The refiner and 1.5's SR model sample a latent given to them, concatenated to the noise (with
# seeded noise augmentation) by the stock node that sets it on the conditioning; a 1.5-sized empty
# latent stands in for the one to refine or upscale (the refiner: one frame of 9 x 11 = 99 tokens).
CONDITIONED_LATENT = {"positive": ["6", 0], "negative": ["6", 1], "latent_image": ["6", 2]}
REFINER_LATENT = {"class_type": "HunyuanRefinerLatent", "inputs": {
    "positive": ["4", 1], "negative": ["5", 0], "latent": ["24", 0], "noise_augmentation": 0.1}}
REFINER_NODES = {"24": {"class_type": "EmptyHunyuanVideo15Latent",
                        "inputs": {"width": 176, "height": 144, "length": 1, "batch_size": 1}}}
HV15_SR_LATENT = {"class_type": "HunyuanVideo15SuperResolution", "inputs": {
    "positive": ["4", 1], "negative": ["5", 0], "latent": ["24", 0], "noise_augmentation": 0.7}}
HV15_SR_NODES = {"24": HV15_LATENT}
# MiniMax-H3's video + audio latent from ComfyUI's own node: 24 channels at 1/16 (3 x 2 tokens a
# frame after the 2 x 2 patches) over 7 latent frames (22 frames at 24 fps), and 37 audio frames
# of 2 stereo rows (74 tokens); with the 7 text tokens one packed sequence of 123.
MINIMAX_H3_LATENT = {"class_type": "EmptyMiniMaxH3LatentAV", "inputs": {"width": 96, "height": 64, "length": 22}}
# Four heads of 64, a 1-block token refiner, a 64-wide time embedding (the modulation projections
# of the blocks are most of the weights, as in the real model); RoPE over 3 x 8 frequencies (48 of
# each head's 64 dimensions, the real model's 96 of 128 rotate).
MINIMAX_H3_CONFIG = dict(hidden_size=256, num_layers=6, token_refiner_num_layers=1, num_attention_heads=4,
                         attention_head_dim=64, ffn_hidden_size=512, text_dim=TEXT_DIM, timestep_input_dim=64,
                         time_embed_hidden_size=256, time_embed_dim=64, rope_inv_freq_len=8)


def minimax_h3_prepare(model: torch.nn.Module) -> None:
    """The RoPE frequencies are a buffer, not a seeded parameter: the usual inverse powers. The
    modulation projections ten times the seeded scale: each segment's own modulation rows (text,
    audio, video) then move the result as a trained model's do, so a rank that modulated its tokens
    with another segment's rows would show."""
    n = model.rope.inv_freq.shape[0]
    model.rope.inv_freq.copy_(1.0 / 10000.0 ** (torch.arange(n, dtype=torch.float32) / n))
    for name, p in model.named_parameters():
        if ".adaln_proj." in f".{name}":
            p.mul_(10.0)


@dataclass(frozen=True)
class TinyFamily:
    cls: str                  # ComfyUI class, module.Class
    config: dict              # constructor arguments that ComfyUI's unet config carries
    latent: dict              # the empty-latent node of the workflow
    prompt: str = PROMPT      # which prompt dataset
    constructor_only: dict = field(default_factory=dict)  # arguments the detection sets itself (not stated)
    needs: str | None = None  # the module a family newer than ComfyUI 0.3.75 needs
    denoise: float = 1.0      # KSampler's denoise
    latent_nodes: dict = field(default_factory=dict)  # nodes the latent node takes its inputs from
    # The sampled latent holds several streams (LTX-2's video and audio): separated and each saved.
    streams: tuple[str, ...] = ()
    # KSampler inputs taken from elsewhere: an I2V node's conditioning and latent outputs.
    sampler_inputs: dict = field(default_factory=dict)
    # After the seeded weights: sets what they leave unset (buffers the state dict holds) or rescales them.
    prepare: "Callable[[torch.nn.Module], None] | None" = None

    def build(self) -> torch.nn.Module:
        import comfy.ops

        module, name = self.cls.rsplit(".", 1)
        cls = getattr(importlib.import_module(module), name)
        model = make(cls, **self.config, **self.constructor_only, dtype=torch.float32, device="cpu",
                     operations=comfy.ops.disable_weight_init)
        return model


FLUX_LIKE = dict(mlp_ratio=4.0, num_heads=4, depth=2, depth_single_blocks=2, axes_dim=[16, 24, 24], theta=10000,
                 qkv_bias=True, hidden_size=256)
HV15_CONFIG = dict(FLUX_LIKE, in_channels=65, out_channels=32, vec_in_dim=None, context_in_dim=TEXT_DIM, theta=256,
                   patch_size=[1, 1, 1], guidance_embed=False)
HV15_DETECTED = dict(image_model="hunyuan_video", byt5=True, meanflow=False, use_cond_type_embedding=True,
                     vision_in_dim=1152)

ALL_FAMILIES = {
    "flux": TinyFamily("comfy.ldm.flux.model.Flux",
                       dict(FLUX_LIKE, in_channels=16, out_channels=16, vec_in_dim=TEXT_DIM, context_in_dim=TEXT_DIM,
                            patch_size=2, guidance_embed=True),
                       IMAGE_LATENT, prompt=PROMPT_POOLED, constructor_only={"image_model": "flux"}),
    "chroma": TinyFamily("comfy.ldm.chroma.model.Chroma",
                         dict(FLUX_LIKE, in_channels=64, out_channels=64, context_in_dim=TEXT_DIM, patch_size=2,
                              in_dim=64, out_dim=256, hidden_dim=256, n_layers=2),
                         IMAGE_LATENT, prompt=PROMPT_POOLED,  # 0.3.75's Chroma reads the key (and ignores it)
                         constructor_only={"image_model": "chroma"}),
    "wan": TinyFamily("comfy.ldm.wan.model.WanModel",
                      dict(patch_size=(1, 2, 2), dim=256, ffn_dim=1024, num_heads=4, num_layers=2, in_dim=16,
                           out_dim=16, text_dim=TEXT_DIM),
                      VIDEO_LATENT, constructor_only={"model_type": "t2v"}),
    "wan_vace": TinyFamily("comfy.ldm.wan.model.VaceWanModel",
                           dict(patch_size=(1, 2, 2), dim=256, ffn_dim=1024, num_heads=4, num_layers=6, in_dim=16,
                                out_dim=16, text_dim=TEXT_DIM, vace_layers=1, vace_in_dim=96),
                           VIDEO_LATENT, constructor_only={"model_type": "t2v"}),
    "qwen_image": TinyFamily("comfy.ldm.qwen_image.model.QwenImageTransformer2DModel",
                             dict(patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=64,
                                  num_attention_heads=4, joint_attention_dim=TEXT_DIM, axes_dims_rope=[16, 24, 24]),
                             IMAGE_LATENT),
    "hunyuan_video": TinyFamily("comfy.ldm.hunyuan_video.model.HunyuanVideo",
                                dict(FLUX_LIKE, in_channels=16, out_channels=16, vec_in_dim=TEXT_DIM,
                                     context_in_dim=TEXT_DIM, depth_single_blocks=4, theta=256, patch_size=[1, 2, 2],
                                     guidance_embed=True),
                                VIDEO_LATENT, prompt=PROMPT_POOLED,
                                constructor_only=dict(image_model="hunyuan_video", byt5=False, meanflow=False,
                                                      use_cond_type_embedding=False, vision_in_dim=None)),
    # HunyuanImage 2.1 (distilled: guidance and meanflow's second timestep), 2D, no pooled vector; the
    # byt5 glyph tokens join the text after it. Four heads of 64 (detection says width // 128).
    "hunyuan_image21": TinyFamily("comfy.ldm.hunyuan_video.model.HunyuanVideo",
                                  dict(FLUX_LIKE, in_channels=64, out_channels=64, vec_in_dim=None,
                                       context_in_dim=TEXT_DIM, axes_dim=[32, 32], theta=256, patch_size=[1, 1],
                                       guidance_embed=True),
                                  HUNYUAN_IMAGE_LATENT, prompt=PROMPT_BYT5,
                                  constructor_only=dict(image_model="hunyuan_video", byt5=True, meanflow=True,
                                                        use_cond_type_embedding=False, vision_in_dim=None)),
    # HunyuanVideo 1.5: latent + concatenated image latent + mask in (65 channels), byt5 and vision
    # tokens before the text, each with its cond-type embedding. The vision projection is 1152 wide:
    # that width is how ComfyUI tells 1.5 apart.
    "hunyuan_video15": TinyFamily("comfy.ldm.hunyuan_video.model.HunyuanVideo",
                                  HV15_CONFIG, HV15_LATENT, prompt=PROMPT_BYT5, constructor_only=HV15_DETECTED),
    # The same architecture through ComfyUI's I2V graph (0.3.75's light 1.5 autoencoder cannot encode).
    "hunyuan_video15_i2v": TinyFamily("comfy.ldm.hunyuan_video.model.HunyuanVideo",
                                      HV15_CONFIG, HV15_I2V_LATENT, prompt=PROMPT_BYT5, constructor_only=HV15_DETECTED,
                                      needs="comfy.image_encoders.naf", latent_nodes=HV15_I2V_NODES,
                                      sampler_inputs=CONDITIONED_LATENT),
    # The HunyuanImage 2.1 refiner: 3D patches over its latent (two 32-channel frames packed into 64
    # channels), the latent to refine concatenated (128 in); meanflow's time_r_in is present but
    # ComfyUI disables it for the refiner. No byt5.
    "hunyuan_image21_refiner": TinyFamily("comfy.ldm.hunyuan_video.model.HunyuanVideo",
                                          dict(HV15_CONFIG, in_channels=128, out_channels=64, guidance_embed=True),
                                          REFINER_LATENT, latent_nodes=REFINER_NODES, sampler_inputs=CONDITIONED_LATENT,
                                          constructor_only=dict(HV15_DETECTED, byt5=False, meanflow=True,
                                                                use_cond_type_embedding=False, vision_in_dim=None)),
    # 1.5's SR-distilled model: latent + 66 conditioning channels (98 in, how ComfyUI tells it apart),
    # meanflow's second timestep enabled (summed, as detection sets for 1.5).
    "hunyuan_video15_sr": TinyFamily("comfy.ldm.hunyuan_video.model.HunyuanVideo",
                                     dict(HV15_CONFIG, in_channels=98), HV15_SR_LATENT, prompt=PROMPT_BYT5,
                                     latent_nodes=HV15_SR_NODES, sampler_inputs=CONDITIONED_LATENT,
                                     constructor_only=dict(HV15_DETECTED, meanflow=True)),
    "ltxv": TinyFamily("comfy.ldm.lightricks.model.LTXVModel",
                       dict(in_channels=128, cross_attention_dim=256, attention_head_dim=64, num_attention_heads=4,
                            caption_channels=TEXT_DIM, num_layers=4),
                       LTXV_LATENT, prompt=PROMPT_MASKED),
    "ltxav": TinyFamily("comfy.ldm.lightricks.av_model.LTXAVModel", LTXAV_CONFIG, LTXAV_LATENT,
                        needs="comfy.ldm.lightricks.av_model", latent_nodes=LTXAV_LATENT_NODES,
                        streams=("video", "audio")),
    "ltxav_inpaint": TinyFamily("comfy.ldm.lightricks.av_model.LTXAVModel", LTXAV_CONFIG, LTXAV_MASKED_LATENT,
                                needs="comfy.ldm.lightricks.av_model", latent_nodes=LTXAV_MASKED_NODES,
                                streams=("video", "audio")),
    "ltxav_i2v": TinyFamily("comfy.ldm.lightricks.av_model.LTXAVModel", LTXAV_CONFIG, LTXAV_I2V_LATENT,
                            needs="comfy.ldm.lightricks.av_model", latent_nodes=LTXAV_I2V_NODES,
                            sampler_inputs=LTXAV_I2V_CONDITIONING, streams=("video", "audio")),
    "lumina2": TinyFamily("comfy.ldm.lumina.model.NextDiT",
                          dict(patch_size=2, in_channels=16, dim=256, n_layers=3, n_refiner_layers=1, n_heads=8,
                               n_kv_heads=4, qk_norm=True, cap_feat_dim=TEXT_DIM, axes_dims=[8, 12, 12],
                               axes_lens=[300, 512, 512], rope_theta=10000.0, ffn_dim_multiplier=4.0),
                          IMAGE_LATENT),
    "z_image": TinyFamily("comfy.ldm.lumina.model.NextDiT",
                          dict(patch_size=2, in_channels=16, dim=256, n_layers=3, n_refiner_layers=1, n_heads=4,
                               n_kv_heads=4, qk_norm=True, cap_feat_dim=TEXT_DIM, axes_dims=[16, 24, 24],
                               axes_lens=[1536, 512, 512], rope_theta=256.0, ffn_dim_multiplier=8.0 / 3.0,
                               z_image_modulation=True, time_scale=1000.0, pad_tokens_multiple=32),
                          IMAGE_LATENT),
    # ComfyUI 0.33 on:
    "cogvideox": TinyFamily("comfy.ldm.cogvideo.model.CogVideoXTransformer3DModel",
                            dict(num_attention_heads=4, attention_head_dim=64, in_channels=16, out_channels=16,
                                 time_embed_dim=128, text_embed_dim=TEXT_DIM, num_layers=3, patch_size=2,
                                 use_rotary_positional_embeddings=True),
                            # Its zero-terminal-SNR schedule starts at sigma ~4500, where the latent is that
                            # large and fp32 resolves 5e-4: one rounding flip in the first step stays as an
                            # absolute 5e-4. Denoise 0.6 (5 steps' schedule, the last 3) starts lower.
                            VIDEO_LATENT, needs="comfy.ldm.cogvideo.model", denoise=0.6),
    "kandinsky5": TinyFamily("comfy.ldm.kandinsky5.model.Kandinsky5",
                             dict(out_visual_dim=16, in_visual_dim=16, visual_embed_dim=33 * 4, in_text_dim=TEXT_DIM,
                                  in_text_dim2=TEXT_DIM, time_dim=128, model_dim=256, ff_dim=1024,
                                  patch_size=[1, 2, 2], num_text_blocks=1, num_visual_blocks=3,
                                  axes_dims=[16, 24, 24]),
                             VIDEO_LATENT, prompt=PROMPT_POOLED, needs="comfy.ldm.kandinsky5.model"),
    "krea2": TinyFamily("comfy.ldm.krea2.model.SingleStreamDiT",
                        dict(features=256, tdim=256, txtdim=TEXT_DIM, heads=4, kvheads=2, multiplier=4, layers=3,
                             patch=2, channels=16, txtlayers=1, txtheads=4, txtkvheads=4),
                        dict(VIDEO_LATENT, inputs=dict(VIDEO_LATENT["inputs"], length=1)),
                        needs="comfy.ldm.krea2.model"),
    "joyimage": TinyFamily("comfy.ldm.joyimage.model.JoyImageTransformer3DModel",
                           # Two heads of 128: ComfyUI fixes the RoPE axes (16, 56, 56) after detection.
                           dict(patch_size=[1, 2, 2], in_channels=16, hidden_size=256, num_attention_heads=2,
                                text_dim=TEXT_DIM, mlp_width_ratio=4.0, num_layers=3, rope_dim_list=[16, 56, 56],
                                theta=10000),
                           dict(VIDEO_LATENT, inputs=dict(VIDEO_LATENT["inputs"], length=1)),
                           needs="comfy.ldm.joyimage.model"),
    # Image tokens then text tokens, one joint sequence (35 + 7 = 42: USP 2x2 pads it). Its attention
    # takes no transformer_options (the plan names the module global). Four heads of 64, RoPE axes
    # 16 + 24 + 24; 128 latent channels at 1/16 (FLUX.2's latent format).
    "ernie_image": TinyFamily("comfy.ldm.ernie.model.ErnieImageModel",
                              dict(hidden_size=256, num_attention_heads=4, num_layers=3, ffn_hidden_size=1024,
                                   in_channels=128, out_channels=128, patch_size=1, text_in_dim=TEXT_DIM,
                                   rope_theta=256, rope_axes_dim=[16, 24, 24]),
                              {"class_type": "EmptyFlux2LatentImage",
                               "inputs": {"width": 80, "height": 112, "batch_size": 1}},
                              needs="comfy.ldm.ernie.model"),
    # Pixel space: 8 x 8 patches of an 80 x 112 image, 35 tokens.
    "chroma_radiance": TinyFamily("comfy.ldm.chroma_radiance.model.ChromaRadiance",
                                  dict(FLUX_LIKE, in_channels=3, out_channels=3, context_in_dim=TEXT_DIM, patch_size=8,
                                       in_dim=64, out_dim=256, hidden_dim=256, n_layers=2, nerf_hidden_size=32,
                                       nerf_mlp_ratio=2, nerf_depth=2, nerf_max_freqs=4, nerf_tile_size=0,
                                       nerf_final_head_type="linear"),
                                  {"class_type": "EmptyChromaRadianceLatentImage",
                                   "inputs": {"width": 80, "height": 112, "batch_size": 1}},
                                  prompt=PROMPT_POOLED,
                                  constructor_only={"image_model": "chroma_radiance",
                                                    "nerf_embedder_dtype": torch.float32}),
    # Video with audio in one packed sequence; the sampled latent saved per stream.
    "minimax_h3": TinyFamily("comfy.ldm.minimax.model.MiniMaxH3Model", MINIMAX_H3_CONFIG, MINIMAX_H3_LATENT,
                             needs="comfy.ldm.minimax.model", streams=("video", "audio"),
                             prepare=minimax_h3_prepare),
}


def _available(module: str | None) -> bool:
    if module is None:
        return True
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


# The families this ComfyUI has.
FAMILIES = {name: spec for name, spec in ALL_FAMILIES.items() if _available(spec.needs)}


def file_name(family: str) -> str:
    return f"tiny_family_{family}.safetensors"


def family_state_dict(family: str, seed: int = 200) -> tuple[dict, dict]:
    spec = FAMILIES[family]
    model = spec.build()
    _seeded_([p for _, p in sorted(model.named_parameters())], seed + sorted(ALL_FAMILIES).index(family), scale=0.03)
    if spec.prepare is not None:
        with torch.no_grad():
            spec.prepare(model)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    return stating_config(sd, "transformer", spec.config)


def write_family_files(base_dir: Path) -> dict[str, Path]:
    """Every family's tiny file under models/diffusion_models, and the two prompt datasets. Idempotent."""
    from safetensors.torch import save_file

    folder = Path(base_dir) / "models" / "diffusion_models"
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for family in FAMILIES:
        path = folder / file_name(family)
        if not path.exists():
            sd, metadata = family_state_dict(family)
            save_file(sd, str(path), metadata=metadata)
        paths[family] = path
    gen = torch.Generator().manual_seed(210)
    text = torch.randn(1, TEXT_TOKENS, TEXT_DIM, generator=gen)
    write_conditioning_dataset(base_dir, PROMPT, text)
    write_conditioning_dataset(base_dir, PROMPT_POOLED, text, {"pooled_output": torch.randn(1, TEXT_DIM, generator=gen)})
    write_conditioning_dataset(base_dir, PROMPT_MASKED, text, {"attention_mask": torch.ones(1, TEXT_TOKENS, dtype=torch.long)})
    byt5 = torch.randn(1, BYT5_TOKENS, BYT5_DIM, generator=gen)
    # pooled_output None, as ComfyUI's Qwen2.5-VL encoder gives it (1.5's model reads the key).
    write_conditioning_dataset(base_dir, PROMPT_BYT5, text, {"conditioning_byt5small": byt5, "pooled_output": None})
    for (folder_name, name), (state_dict, needs) in SIDE_FILES.items():
        path = Path(base_dir) / "models" / folder_name / name
        if not path.exists() and _available(needs):
            path.parent.mkdir(parents=True, exist_ok=True)
            made = state_dict()
            sd, metadata = made if isinstance(made, tuple) else (made, None)
            save_file(sd, str(path), metadata=metadata)
    return paths


def family_prompt(family: str, parallel: dict | None) -> dict:
    """UNETLoader -> (Shard Transformer) -> KSampler (CFG 3, 3 steps) -> SaveLatent, in API format."""
    spec = FAMILIES[family]
    model = ["1", 0]
    prompt = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": file_name(family), "weight_dtype": "default"}},
        "4": {"class_type": "LoadTrainingDataset", "inputs": {"folder_name": spec.prompt}},
        "5": {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["4", 1]}},
        "6": spec.latent,
        "8": {"class_type": "SaveLatent", "inputs": {"samples": ["7", 0], "filename_prefix": f"latents/{family}"}},
        **spec.latent_nodes,
    }
    if spec.streams:  # ComfyUI's SaveLatent takes one tensor: the streams apart, one file each
        prompt["11"] = {"class_type": "LTXVSeparateAVLatent", "inputs": {"av_latent": ["7", 0]}}
        for i, stream in enumerate(spec.streams):
            prompt[str(8 + 4 * i)] = {"class_type": "SaveLatent", "inputs": {
                "samples": ["11", i], "filename_prefix": f"latents/{family}_{stream}"}}
    if parallel is not None:
        prompt["2"] = parallel_config_node(**parallel)
        prompt["3"] = {"class_type": "ShardTransformer", "inputs": {"model": ["1", 0], "parallel_config": ["2", 0]}}
        model = ["3", 0]
    prompt["7"] = {"class_type": "KSampler", "inputs": {"model": model, "positive": ["4", 1], "negative": ["5", 0],
                                                        "latent_image": ["6", 0], "seed": 11, "steps": 3, "cfg": 3.0,
                                                        "sampler_name": "euler", "scheduler": "simple",
                                                        "denoise": spec.denoise, **spec.sampler_inputs}}
    return prompt


# ---------------------------------------------------------------- graphs with a ControlNet, a model patch, Block Cache
# Shared by the server tests (tests/test_controlnets.py, test_model_patches.py, test_block_cache.py) and
# the GPU check (tools/gpu_check.py, part "features"). TinyPatternImage, TinyModelPatchLoader and
# TinyImageVAE are the test extension's nodes (tests/comfy_extensions/tiny_model_patches).
def controlnet_prompt(parallel: dict | None, strength: float = 0.8) -> dict:
    """The tiny Flux graph with the stock ControlNetLoader and ControlNetApplyAdvanced on both conditionings."""
    prompt = family_prompt("flux", parallel)
    latent = FAMILIES["flux"].latent["inputs"]
    prompt["70"] = {"class_type": "ControlNetLoader", "inputs": {"control_net_name": FLUX_CONTROLNET_FILE}}
    prompt["71"] = {"class_type": "TinyPatternImage",
                    "inputs": {"width": latent["width"], "height": latent["height"], "frames": 1, "seed": 4}}
    prompt["72"] = {"class_type": "ControlNetApplyAdvanced", "inputs": {
        "positive": ["4", 1], "negative": ["5", 0], "control_net": ["70", 0], "image": ["71", 0],
        "strength": strength, "start_percent": 0.0, "end_percent": 1.0}}
    prompt["7"]["inputs"].update(positive=["72", 0], negative=["72", 1])
    return prompt


WAN_VAE = {"class_type": "VAELoader", "inputs": {"vae_name": "tiny_wan21_vae.safetensors"}}
# family -> (patch node, patch model kind, VAE node, control image frames)
PATCH_CASES = {
    "qwen_image": ("QwenImageDiffsynthControlnet", "qwen_diffsynth", WAN_VAE, 1),
    "z_image": ("ZImageFunControlnet", "z_image_fun_2_1", {"class_type": "TinyImageVAE", "inputs": {}}, 1),
    "wan": ("WanUni3CControlnetApply", "wan_uni3c", WAN_VAE, 9),
}


def latent_pixels(family: str) -> tuple[int, int]:
    inputs = FAMILIES[family].latent["inputs"]
    return inputs["width"], inputs["height"]


def patched_prompt(family: str, parallel: dict | None, strength: float = 1.0, image_seed: int = 5,
                   size: tuple[int, int] | None = None) -> dict:
    """The family's tiny graph with its patch node between the loader and Shard Transformer."""
    node, kind, vae, frames = PATCH_CASES[family]
    width, height = size or latent_pixels(family)
    prompt = family_prompt(family, parallel)
    prompt["60"] = {"class_type": "TinyModelPatchLoader", "inputs": {"kind": kind, "seed": 3}}
    prompt["61"] = vae
    prompt["62"] = {"class_type": "TinyPatternImage",
                    "inputs": {"width": width, "height": height, "frames": frames, "seed": image_seed}}
    inputs = {"model": ["1", 0], "model_patch": ["60", 0], "vae": ["61", 0], "strength": strength}
    if node == "WanUni3CControlnetApply":
        inputs.update(render_video=["62", 0], start_percent=0.0, end_percent=1.0)
    else:
        inputs["image"] = ["62", 0]
    prompt["63"] = {"class_type": node, "inputs": inputs}
    prompt["3" if "3" in prompt else "7"]["inputs"]["model"] = ["63", 0]
    return prompt


def cached_prompt(family: str, parallel: dict | None, cache: dict | None, steps: int) -> dict:
    """The family's tiny graph with ``steps`` steps and the Block Cache node (``cache``: its inputs)
    after Shard Transformer (None: no cache)."""
    prompt = family_prompt(family, parallel)
    sampler = prompt["7"]["inputs"]
    sampler["steps"] = steps
    if cache is not None:
        prompt["30"] = {"class_type": "HybridBlockCache", "inputs": {"model": sampler["model"], **cache}}
        sampler["model"] = ["30", 0]
    return prompt
