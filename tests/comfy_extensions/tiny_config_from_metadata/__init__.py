"""Test-only ComfyUI extension: a diffusion-model file may state its own transformer config.

ComfyUI 0.3.75 reads ``metadata["config"]["transformer"]`` from LTXV safetensors files only.
FLUX.2's detection fixes 48 heads of 128 (width 6144), so no small FLUX.2 file loads through the
stock UNETLoader. The tests' server loads this extension, which applies the same metadata to
every family after detection, so that tools/tiny_models.py can write a small FLUX.2 that the
stock loader, model classes and samplers then run unchanged. Files without that metadata (all
real checkpoints but LTXV's) detect exactly as before. Never shipped with the pack.
"""
import json
import logging

import comfy.model_detection

_stock_detect_unet_config = comfy.model_detection.detect_unet_config


def detect_unet_config(state_dict, key_prefix, metadata=None):
    config = _stock_detect_unet_config(state_dict, key_prefix, metadata=metadata)
    if config is not None and metadata and "config" in metadata:
        override = json.loads(metadata["config"]).get("transformer", {})
        if override:
            logging.info("tiny_config_from_metadata: %s config from the file's metadata: %s",
                         config.get("image_model"), override)
            config.update(override)
    return config


comfy.model_detection.detect_unet_config = detect_unet_config

NODE_CLASS_MAPPINGS = {}
