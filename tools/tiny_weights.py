"""What the tiny model files share: seeded random weights for a model built on the meta device,
ComfyUI's own JSON configs, and the metadata form that states a small config in a file.

Standard library and torch only: ``tiny_models`` and ``tiny_text_encoders`` both build on it.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch


def comfy_json_config(module, name: str, overrides: dict | None = None) -> dict:
    """ComfyUI's JSON model config ``name`` (next to ``module``), with ``overrides``."""
    return {**json.loads((Path(module.__file__).parent / name).read_text()), **(overrides or {})}


def _random_state_dict(module_factory, seed: int, dtype=torch.float16, device="cpu") -> dict[str, torch.Tensor]:
    """Seeded weights for a model built on the meta device (no memory but the result):
    norms near 1 (gamma/scale) or 0 (biases), matrices about 1/sqrt(fan-in). ``device``: where
    the random numbers are drawn (a GPU draws billions of them in seconds); the result is on the CPU."""
    with torch.device("meta"):
        model = module_factory()
    gen = torch.Generator(device=device).manual_seed(seed)
    sd = {}
    for key, meta in sorted(model.state_dict().items()):
        if not meta.dtype.is_floating_point:  # counters such as BatchNorm's num_batches_tracked
            sd[key] = torch.zeros(meta.shape, dtype=meta.dtype)
            continue
        if meta.ndim <= 1:
            ones = (key.endswith(("scale", "gamma", "norm.weight", "running_var")) or ".norm" in key
                    or re.search(r"norm\d\.weight$", key) is not None)  # CLIP's layer_norm1/2
            value = (1.0 if ones else 0.0) + 0.02 * torch.randn(meta.shape, generator=gen, device=device)
        else:
            value = torch.randn(meta.shape, generator=gen, device=device) * (0.5 / meta[0].numel() ** 0.5)
        sd[key] = value.to(dtype).cpu()
    return sd


def stating_config(sd: dict, part: str, config: dict) -> tuple[dict, dict]:
    """(state dict, safetensors metadata stating ``config`` under ``config`` -> ``part``): the form
    ComfyUI reads from LTXV files and the test server's extension applies to any family
    (tests/comfy_extensions)."""
    return sd, {"config": json.dumps({part: config})}
