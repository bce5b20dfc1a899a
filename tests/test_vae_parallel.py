"""Patch-parallel VAE decode and encode over 2 and 4 ranks against the untiled decode and
encode on one process (fp32), for every supported family (KL, HunyuanVideo, HunyuanImage 2.1,
HunyuanVideo 1.5 and the HunyuanImage 2.1 refiner (0.33 only), Wan 2.1 / 2.2, LTX-2), with heights
that no world size divides. Rank 0 is this process; the
others are worker processes."""
import copy
import sys

import pytest
import torch

from conftest import cpu_world
from parallel_runtime.parallel import vae_bands as vae_parallel
from parallel_runtime.plans import find_vae_plan, plan_for_family
from parallel_runtime.plans import check_vae
from parallel_runtime.parallel.vae_bands import Bands, ConvRows
from vae_cases import LTX2_CONFIG, VAES, randomize, refiner_vae

pytestmark = pytest.mark.multirank
TOL = 1e-5


def world_of(runtime, n):
    return cpu_world(runtime, dict(tp_size=n))


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def world(request, runtime):
    return world_of(runtime, request.param)


@pytest.fixture(scope="module")
def built():
    """Each case once per session, with its single-process results and the largest conv
    input (elements) the untiled run sees."""
    cache = {}

    def get(name):
        if name not in cache:
            vae, z, x = VAES[name]()
            largest = {}
            with torch.inference_mode():
                for method, inp in (("decode", z), ("encode", x)):
                    sizes = []
                    convs = [m for m in vae.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Conv3d))]
                    for m in convs:  # where the parallel run measures: the input the convolution itself sees
                        m._conv_forward = (lambda orig: lambda t, *a, **k: sizes.append(t.numel()) or orig(t, *a, **k))(
                            m._conv_forward)
                    try:
                        ref = getattr(vae, method)(inp)
                    finally:
                        for m in convs:
                            del m._conv_forward
                    largest[method] = (ref, max(sizes))
            cache[name] = (vae, z, x, largest)
        return cache[name]
    return get


def parallel(world, vae, method, inp):
    """What the Shard VAE node's dispatch does for ``first_stage_model.<method>(inp)``."""
    bound = getattr(type(vae), method).__get__(vae)
    with torch.inference_mode():
        return world.forward(vae, check_vae(vae), bound, (inp,), {})


@pytest.mark.parametrize("method", ["decode", "encode"])
@pytest.mark.parametrize("case", list(VAES))
def test_matches_single_process(world, built, case, method):
    vae, z, x, largest = built(case)
    ref, full_largest = largest[method]
    out = parallel(world, vae, method, z if method == "decode" else x)
    assert out.shape == ref.shape
    err = (out - ref).abs().max().item()
    rel = err / ref.abs().max().item()
    run = vae_parallel.last_run
    n = world.world_size
    share = run["largest_conv_input"] / full_largest
    units = run["rows"] // run["unit"]
    print(f"\n{case} {method} over {n} ranks: bands {run['sizes']} rows, max abs err {err:.2e}, relative {rel:.2e} "
          f"(output scale {ref.abs().max().item():.2f}); rank 0's largest conv input is {share:.3f} of the untiled one")
    assert not run["fallback"]
    assert err <= TOL
    # Activations: rank 0's band (the widest) plus a halo, not the whole image.
    assert share <= (-(-units // n) + 1) / units


@pytest.mark.parametrize("part", vae_parallel.PARTS)
def test_each_exchange_matters(runtime, built, part):
    """Without the halo exchange (or the shared GroupNorm statistics, or the gathered
    attention keys) the bands compute what naive tiling would: visibly different."""
    world = world_of(runtime, 2)
    vae, z, _, largest = built("kl_flux1")
    ref = largest["decode"][0]
    local = copy.deepcopy(vae)
    setattr(local, vae_parallel.LOCAL_ONLY_ATTR, (part,))
    out = parallel(world, local, "decode", z)
    err = (out - ref).abs().max().item()
    print(f"\nwithout the {part} exchange: max abs err {err:.2e}")
    assert err > 1e-3
    again = parallel(world, vae, "decode", z)  # and the real path is still exact
    assert (again - ref).abs().max().item() <= TOL


def test_video_frames_and_time_caches(runtime, built):
    """More latent frames than the cases above: the per-rank causal caches stay consistent."""
    world = world_of(runtime, 2)
    vae = built("wan21")[0]
    z = torch.randn((1, 16, 5, 9, 4), generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():
        ref = vae.decode(z)
    out = parallel(world, vae, "decode", z)
    assert out.shape == ref.shape == (1, 3, 17, 72, 32)
    assert (out - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("case", ["kl_sd", "wan21"])
def test_encode_rows_that_do_not_fill_a_latent_row(runtime, built, case):
    """ComfyUI crops pixels to whole latent rows, but ``encode`` also takes 108 rows
    (13.5 latent rows): the leftover rows join the last band, as the untiled encode sees them."""
    world = world_of(runtime, 4)
    vae, _, x = built(case)[:3]
    x = torch.cat([x, x[..., :4, :]], dim=-2)
    with torch.inference_mode():
        ref = vae.encode(x)
    out = parallel(world, vae, "encode", x)
    assert vae_parallel.last_run["sizes"][-1] == 28
    assert out.shape == ref.shape
    assert (out - ref).abs().max().item() <= TOL


def test_ltx_output_buffer_and_time_chunks(runtime, built, monkeypatch):
    """ComfyUI 0.33 hands LTX's decode a preallocated ``output_buffer`` of the whole video: the
    bands decode without it and rank 0 fills it. And the bands run as one time chunk each (a
    band's own chunking would depend on its height): equal to a single-process decode chunked
    as finely as it goes, the global put back afterwards."""
    vae, z = built("ltx2")[:2]
    ltx = sys.modules[type(vae).__module__]
    if not hasattr(ltx, "get_max_chunk_size"):
        pytest.skip("ComfyUI before 0.33 decodes LTX without time chunks or an output buffer")
    original = ltx.get_max_chunk_size
    monkeypatch.setattr(ltx, "get_max_chunk_size", lambda device: 1)  # every up block in one-frame chunks
    with torch.inference_mode():
        ref = vae.decode(z)
    monkeypatch.setattr(ltx, "get_max_chunk_size", original)
    buffer = torch.full(vae.decode_output_shape(z.shape), float("nan"))
    with torch.inference_mode():
        out = world_of(runtime, 2).forward(vae, check_vae(vae), type(vae).decode.__get__(vae), (z,),
                                           {"output_buffer": buffer})
    assert out is buffer
    err = (buffer - ref).abs().max().item()
    print(f"\nltx2 decode into the output buffer, 2 ranks, against a chunked decode: max abs err {err:.2e}")
    assert err <= TOL
    assert ltx.get_max_chunk_size is original


def test_too_few_rows_runs_whole_on_every_rank(runtime, built):
    """3 latent rows over 4 ranks: a band per rank is impossible; every rank computes the
    whole decode (exact, no collective that a rank could miss)."""
    world = world_of(runtime, 4)
    vae = built("kl_sd")[0]
    z = torch.randn((1, 4, 3, 4), generator=torch.Generator().manual_seed(8))
    with torch.inference_mode():
        ref = vae.decode(z)
    out = parallel(world, vae, "decode", z)
    assert vae_parallel.last_run["fallback"]
    assert (out - ref).abs().max().item() <= TOL
    # And the next call splits again.
    z = torch.randn((1, 4, 9, 4), generator=torch.Generator().manual_seed(9))
    with torch.inference_mode():
        ref = vae.decode(z)
    out = parallel(world, vae, "decode", z)
    assert not vae_parallel.last_run["fallback"]
    assert (out - ref).abs().max().item() <= TOL


def test_comfy_vae_decode_and_encode(runtime):
    """ComfyUI's VAE object (loader detection, batching, process_input/output) with its
    first_stage_model's decode / encode dispatched to the world, as the node does it."""
    import comfy.sd
    from comfy.ldm.wan.vae import WanVAE

    sd = randomize(WanVAE(dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                          temperal_downsample=[False, True, True]), 21).state_dict()
    vae = comfy.sd.VAE(sd=sd)
    model = vae.first_stage_model
    assert find_vae_plan(model) is plan_for_family("vae_wan21")
    gen = torch.Generator().manual_seed(22)
    latent = torch.randn((1, 16, 2, 11, 6), generator=gen)
    image = torch.rand((5, 88, 48, 3), generator=gen)
    with torch.inference_mode():
        ref_pixels, ref_latent = vae.decode(latent), vae.encode(image)

    world = world_of(runtime, 2)

    class Dispatch:  # stands in for the node's object patch of decode / encode
        def decode(self, z, **kwargs):
            return world.forward(model, check_vae(model), type(model).decode.__get__(model), (z,), kwargs)

        def encode(self, x):
            return world.forward(model, check_vae(model), type(model).encode.__get__(model), (x,), {})

    vae.first_stage_model = Dispatch()
    try:
        with torch.inference_mode():
            pixels, encoded = vae.decode(latent), vae.encode(image)
    finally:
        vae.first_stage_model = model
    assert pixels.shape == ref_pixels.shape and encoded.shape == ref_latent.shape
    assert (pixels - ref_pixels).abs().max().item() <= TOL
    assert (encoded - ref_latent).abs().max().item() <= TOL


def test_unsupported_vaes_are_refused():
    import comfy.taesd.taesd

    taesd = comfy.taesd.taesd.TAESD(latent_channels=4)
    assert find_vae_plan(taesd) is None
    with pytest.raises(ValueError, match=r"comfy\.taesd\.taesd\.TAESD is not supported\. Supported VAEs: .*Wan 2\.1"):
        check_vae(taesd)
    # A covered class with a layer the plan does not know (an average pool that would
    # straddle band edges): refused by name, not decoded silently wrong.
    vae = VAES["kl_sd"]()[0]
    vae.decoder.blur = torch.nn.AvgPool2d(3, stride=1, padding=1)
    with pytest.raises(ValueError, match=r"torch\.nn\.modules\.pooling\.AvgPool2d"):
        check_vae(vae)
    # The same for a class that has several plans (the HunyuanVideo VAE is an AutoencoderKL).
    vae = VAES["hunyuan_video"]()[0]
    assert check_vae(vae) is plan_for_family("vae_hunyuan_video")
    vae.decoder.blur = torch.nn.AvgPool2d(3, stride=1, padding=1)
    with pytest.raises(ValueError, match=r"AvgPool2d"):
        check_vae(vae)


def test_hunyuan_video15_plan_and_older_layout():
    """0.33's HunyuanVideo 1.5 VAE (an AutoencodingEngine like the KL and HunyuanImage 2.1 VAEs) gets
    its own plan; 0.3.75's vae_refiner (NoPadConv3d, HunyuanRefinerResnetBlock, padding in its
    own conv_carry_causal_3d) is refused by layer name."""
    import comfy.ldm.hunyuan_video.vae_refiner as refiner

    config = {"block_out_channels": [8, 16, 32, 32, 32], "in_channels": 3, "out_channels": 3, "num_res_blocks": 1,
              "ffactor_spatial": 16, "ffactor_temporal": 4, "z_channels": 8}
    vae = refiner_vae(config, "EmptyRegularizer", 1)
    if hasattr(refiner, "NoPadConv3d"):
        with pytest.raises(ValueError, match=r"HunyuanVideo 1\.5 VAE .*plan does not cover .*NoPadConv3d"):
            check_vae(vae)
    else:
        assert check_vae(vae) is plan_for_family("vae_hunyuan_video15")


def test_noisy_ltx_decoders_are_refused():
    """LTXV 0.9.1 to 0.9.8's decoders add fresh noise to every decode: no band can equal it."""
    from comfy.ldm.lightricks.vae.causal_video_autoencoder import VideoVAE

    assert check_vae(VideoVAE(config=LTX2_CONFIG)) is plan_for_family("vae_ltx2")
    noisy = VideoVAE(config=dict(LTX2_CONFIG, timestep_conditioning=True))
    with pytest.raises(ValueError, match="random noise"):
        check_vae(noisy)


def test_band_geometry():
    # 13 units over 4 ranks: 4, 3, 3, 3; rows that do not fill a unit go to the last band.
    assert Bands(13, 1, 4).sizes() == [4, 3, 3, 3]
    assert Bands(108, 8, 2).sizes() == [56, 52]
    assert Bands(108, 8, 2).start(1) == 56
    assert Bands(3, 1, 4).min_units == 0
    # A 3x3 stride-1 conv reads one row on each side; ComfyUI's Downsample (F.pad (0, 1) and
    # a stride-2 3x3 conv) reads one row below only.
    same = ConvRows(kernel=3, stride=1, top=1, bottom=1)
    assert (same.above, same.below) == (1, 1)
    down = ConvRows(kernel=3, stride=2, top=0, bottom=1, stripped=(0, 1))
    assert (down.above, down.below) == (0, 1)
    assert ConvRows(kernel=1, stride=1, top=0, bottom=0).row_local
