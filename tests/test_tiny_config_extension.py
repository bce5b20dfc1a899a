"""The test server's extension that lets tiny files state their config (FLUX.2's heads, small text
encoders): needed (the stock loaders refuse the files), effective (the models get the stated
config and run) and inert for files without that metadata."""
import importlib.util

import pytest

from conftest import REPO

EXTENSION = REPO / "tests" / "comfy_extensions" / "tiny_config_from_metadata" / "__init__.py"


@pytest.fixture
def tiny_flux2(tmp_path):
    from tiny_models import write_tiny_wan_files

    return write_tiny_wan_files(tmp_path, only=("flux2",))["flux2"]


@pytest.fixture
def extension():
    import comfy.model_detection
    import comfy.sd

    stock = comfy.model_detection.detect_unet_config, comfy.sd.load_clip
    spec = importlib.util.spec_from_file_location("tiny_config_from_metadata", EXTENSION)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    comfy.model_detection.detect_unet_config, comfy.sd.load_clip = stock


def test_stock_comfyui_refuses_the_tiny_flux2(tiny_flux2):
    import comfy.sd

    # 0.3.75 stops at the head count it fixes, 0.33 at the first weight of the wrong size.
    with pytest.raises((ValueError, RuntimeError), match="divisible by num_heads 48|size mismatch for double_blocks"):
        comfy.sd.load_diffusion_model(str(tiny_flux2))


def test_extension_applies_the_files_config(tiny_flux2, extension):
    import comfy.sd
    from tiny_models import FLUX2_CONFIG

    patcher = comfy.sd.load_diffusion_model(str(tiny_flux2))
    params = patcher.model.diffusion_model.params
    assert type(patcher.model).__name__ == "Flux2"
    assert (params.num_heads, list(params.axes_dim)) == (FLUX2_CONFIG["num_heads"], FLUX2_CONFIG["axes_dim"])
    assert params.hidden_size == 256


def test_extension_is_inert_without_metadata(tiny_flux2, extension):
    import comfy.model_detection
    import comfy.utils

    sd, metadata = comfy.utils.load_torch_file(str(tiny_flux2), return_metadata=True)
    assert metadata and "config" in metadata
    assert extension.detect_unet_config(sd, "") == extension._stock_detect_unet_config(sd, "")
    assert comfy.model_detection.detect_unet_config(sd, "", metadata=metadata)["num_heads"] == 4


@pytest.fixture
def tiny_text_encoders(tmp_path):
    from tiny_models import write_tiny_wan_files

    return write_tiny_wan_files(tmp_path, only=("umt5_xxl", "t5_xxl", "clip_l"))


def _clip_type(name):
    import comfy.sd

    return getattr(comfy.sd.CLIPType, name)


def test_stock_comfyui_refuses_the_tiny_umt5(tiny_text_encoders):
    import comfy.sd

    with pytest.raises(RuntimeError, match="size mismatch"):
        comfy.sd.load_clip([str(tiny_text_encoders["umt5_xxl"])], clip_type=_clip_type("WAN"))


@pytest.mark.parametrize("files,clip_type,model,width,pooled", [
    (("umt5_xxl",), "WAN", "WanTEModel", 4096, False),
    (("clip_l", "t5_xxl"), "FLUX", "FluxClipModel_", 64, True),
])
def test_extension_builds_the_stated_text_encoder(tiny_text_encoders, extension, files, clip_type, model, width, pooled):
    import comfy.sd

    clip = comfy.sd.load_clip([str(tiny_text_encoders[f]) for f in files], clip_type=_clip_type(clip_type))
    assert type(clip.cond_stage_model).__name__ == model
    ((cond, extra),) = clip.encode_from_tokens_scheduled(clip.tokenize("a red fox running through fresh snow"))
    assert cond.shape[-1] == width and cond.abs().max().item() > 0 and cond.isfinite().all()
    assert (extra["pooled_output"] is not None) == pooled
    assert comfy.sd.load_clip is extension.load_clip and comfy.sd.detect_te_model is extension._stock_detect_te_model
