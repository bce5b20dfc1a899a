"""Test-only ComfyUI extension: a model file may state its own config in its metadata.

ComfyUI 0.3.75 reads ``metadata["config"]["transformer"]`` from LTXV safetensors files only, and
builds text encoders at their full, fixed sizes. FLUX.2's detection fixes 48 heads of 128 (width
6144), and T5-XXL, UMT5-XXL or Qwen2.5-VL 7B are billions of parameters, so no small file of
those families loads through the stock UNETLoader, CLIPLoader or DualCLIPLoader. The tests'
server loads this extension, so that tools/tiny_models.py can write small ones that the stock
loaders, model classes, tokenizers and samplers then run unchanged:

- diffusion models: ``config`` -> ``transformer`` is applied after detection, for every family;
- text encoders: ``config`` -> ``text_encoder`` names the encoder (``te_model``, a
  ``comfy.sd.TEModel`` member, for one-file loads) and the ``model_options`` to build it with
  (``<name>_model_config``, which ComfyUI's text encoders already read).
- vision encoders: ``config`` -> ``clip_vision`` is the encoder's config (ComfyUI's own json
  configs fix SigLIP at 27 layers of 1152; HunyuanVideo 1.5 needs its 1152-wide features).

Files without that metadata (all real checkpoints but LTXV's) load exactly as before. Never
shipped with the pack.
"""
import json
import logging

import comfy.clip_vision
import comfy.model_detection
import comfy.sd
import comfy.utils

_stock_detect_unet_config = comfy.model_detection.detect_unet_config
_stock_load_clip = comfy.sd.load_clip
_stock_detect_te_model = comfy.sd.detect_te_model
_stock_load_clip_vision = comfy.clip_vision.load


def _stated(metadata, part):
    if not metadata or "config" not in metadata:
        return {}
    return json.loads(metadata["config"]).get(part, {})


def detect_unet_config(state_dict, key_prefix, metadata=None):
    config = _stock_detect_unet_config(state_dict, key_prefix, metadata=metadata)
    override = _stated(metadata, "transformer")
    if config is not None and override:
        logging.info("tiny_config_from_metadata: %s config from the file's metadata: %s",
                     config.get("image_model"), override)
        config.update(override)
    return config


def _file_metadata(path):
    if not str(path).endswith(".safetensors"):
        return None
    import safetensors

    with safetensors.safe_open(path, framework="pt") as f:
        return f.metadata()


def load_clip(ckpt_paths, embedding_directory=None, clip_type=comfy.sd.CLIPType.STABLE_DIFFUSION, model_options={},
              *more, **named):
    """The stock loader with the files' stated config. ``more`` / ``named``: what a later ComfyUI
    passes on (0.33's ``disable_dynamic``, which its non-dynamic delegate of a CLIP patcher sets)."""
    stated = [s for s in (_stated(_file_metadata(p), "text_encoder") for p in ckpt_paths) if s]
    if not stated:
        return _stock_load_clip(ckpt_paths, embedding_directory, clip_type, model_options, *more, **named)
    options = dict(model_options)
    for s in stated:
        options.update(s.get("model_options", {}))
    logging.info("tiny_config_from_metadata: text encoder config from the files' metadata: %s", stated)
    if len(ckpt_paths) == 1 and "te_model" in stated[0]:  # one-file loads detect the encoder from shapes
        comfy.sd.detect_te_model = lambda sd: comfy.sd.TEModel[stated[0]["te_model"]]
    try:
        return _stock_load_clip(ckpt_paths, embedding_directory, clip_type, options, *more, **named)
    finally:
        comfy.sd.detect_te_model = _stock_detect_te_model


def load_clip_vision(ckpt_path):
    stated = _stated(_file_metadata(ckpt_path), "clip_vision")
    if not stated:
        return _stock_load_clip_vision(ckpt_path)
    logging.info("tiny_config_from_metadata: vision encoder config from the file's metadata: %s", stated)
    model = comfy.clip_vision.ClipVisionModel(stated)
    model.load_sd(comfy.utils.load_torch_file(ckpt_path))
    return model


comfy.model_detection.detect_unet_config = detect_unet_config
comfy.sd.load_clip = load_clip
comfy.clip_vision.load = load_clip_vision

NODE_CLASS_MAPPINGS = {}
