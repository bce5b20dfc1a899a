"""The test server's extension that lets a tiny FLUX.2 file state its heads: needed (the stock
loader refuses the file), effective (the model gets the stated config) and inert for files
without that metadata."""
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

    stock = comfy.model_detection.detect_unet_config
    spec = importlib.util.spec_from_file_location("tiny_config_from_metadata", EXTENSION)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    comfy.model_detection.detect_unet_config = stock


def test_stock_comfyui_refuses_the_tiny_flux2(tiny_flux2):
    import comfy.sd

    with pytest.raises(ValueError, match="divisible by num_heads 48"):
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
