"""Context parallelism for every supported family and mesh, against one process, in fp32.

Multi-rank: rank 0 is this process, the other ranks are real worker processes.
Meshes: Ulysses 2, Ring 2, USP 2x2 (4 ranks), cfg 2 x Ulysses 2 (4 ranks), Ulysses 3 (more ranks
than the cases' two heads: padded).

LTX-2 (ComfyUI 0.33 on) has two token streams of different lengths and attention between them
(queries from one split stream, keys and values from the other); its cases are here, also under
TP and Ulysses x TP, and it is called through ``forward`` (which takes the two timesteps as a
tuple), not ``_forward``.
"""
import pytest
import torch

from conftest import cpu_world, single_process_references
from families import CASES, OPS, available, randn, seeded
from parallel_runtime.plans import find_plan

pytestmark = pytest.mark.multirank
TOL = 1e-5
MESHES = {
    "ulysses2": dict(ulysses_size=2),
    "ring2": dict(ring_size=2),
    "usp2x2": dict(ring_size=2, ulysses_size=2),
    "cfg2_ulysses2": dict(cfg_size=2, ulysses_size=2),
    # A Ulysses size that does not divide the heads (two here): padded heads, one rank of padding only.
    "ulysses3": dict(ulysses_size=3),
}


@pytest.fixture(scope="module", params=list(MESHES))
def world(request, runtime):
    return cpu_world(runtime, MESHES[request.param])


@pytest.fixture(scope="module")
def built():
    return single_process_references(CASES)


def run(world, model, args, kwargs, **kw):
    with torch.inference_mode():
        return world.forward(model, find_plan(model), model._forward, args, {**kwargs, "transformer_options": {}},
                             **kw)


def refused_input(model, kwargs) -> str | None:
    """An input of this call that the plan, as it reads this model, declines (on some ComfyUI
    releases a model cuts absolute token ranges a chunk cannot follow): it must say so."""
    cp = find_plan(model).for_module(model).context_parallel
    return next((name for name in cp.unsupported if kwargs.get(name) is not None
                 and cp.unsupported_when.get(name, lambda value: True)(kwargs[name])), None)


@pytest.mark.parametrize("case", list(CASES))
def test_matches_single_process(world, built, case):
    model, args, kwargs, ref = built(case)
    refused = refused_input(model, kwargs)
    if refused:
        with pytest.raises(RuntimeError, match=f"'{refused}' is not supported with context parallelism"):
            run(world, model, args, kwargs)
        return
    out = run(world, model, args, kwargs)
    err = (out - ref).abs().max().item()
    rel = err / ref.abs().max().item()
    print(f"\n{case} on {world.config.describe()}: max abs err {err:.2e}, rel {rel:.2e}")
    assert out.shape == ref.shape
    assert err <= TOL


@pytest.mark.parametrize("case", list(CASES))
def test_attention_really_crosses_ranks(world, built, case):
    """With communication in attention switched off the result must be wrong."""
    model, args, kwargs, ref = built(case)
    refused = refused_input(model, kwargs)
    if refused:  # refused before any rank computes, communication or not
        with pytest.raises(RuntimeError, match=f"'{refused}' is not supported with context parallelism"):
            run(world, model, args, kwargs, distributed_attention=False)
        return
    out = run(world, model, args, kwargs, distributed_attention=False)
    rel = (out - ref).abs().max().item() / ref.abs().max().item()
    if world.config.ring_size == 1 and world.config.ulysses_size == 1:
        pytest.skip("no sequence parallelism in this mesh")
    assert rel > 1e-3


LTXAV_MESHES = {**MESHES, "tp2": dict(tp_size=2), "ulysses2_tp2": dict(ulysses_size=2, tp_size=2)}
LTXAV_CASES = {}


def ltxav_case(name):
    def register(fn):
        if available("comfy.ldm.lightricks.av_model"):
            LTXAV_CASES[name] = fn
        return fn
    return register


def ltxav_model(seed=160, **options):
    """Video four heads of 64 (width 256), audio four heads of 32 (width 128), two blocks."""
    from comfy.ldm.lightricks.av_model import LTXAVModel

    return seeded(LTXAVModel(**options, in_channels=128, audio_in_channels=128, cross_attention_dim=256,
                             audio_cross_attention_dim=128, attention_head_dim=64, audio_attention_head_dim=32,
                             num_attention_heads=4, audio_num_attention_heads=4, caption_channels=64, num_layers=2,
                             connector_attention_head_dim=32, connector_num_attention_heads=2, dtype=torch.float32,
                             device="cpu", operations=OPS), seed=seed)


def ltxav_inputs(model, audio_frames: int, seed: int, **kwargs):
    """105 video tokens (3 x 5 x 7) and ``audio_frames`` audio tokens, batch 2 (cond + uncond). One
    timestep for both rows, as ComfyUI's samplers give: the audio-video gates take the largest
    timestep of the whole batch, so rows with different ones would not be independent."""
    x = [randn(2, 128, 3, 5, 7, seed=seed), randn(2, 8, audio_frames, 16, seed=seed + 1)]
    t = torch.tensor([0.6, 0.6])
    context = model.preprocess_text_embeds(randn(2, 12, 64, seed=seed + 2))
    return model, (x, (t, t), context, None), {"frame_rate": 25, **kwargs}


@ltxav_case("ltxav_t2v_audio")
def ltxav_t2v_audio():
    """13 audio tokens: odd, and fewer per rank than video tokens."""
    return ltxav_inputs(ltxav_model(), 13, seed=161)


def with_denoise_masks(model, args, kwargs, video_mask, audio_mask=None):
    """The call ComfyUI's LTXAV.process_timestep makes of a denoise mask: per-token timesteps for
    the video (per frame in the model's CompressedTimestep) and, with an audio mask, the audio."""
    x, (t, _), context, attention_mask = args
    v_t = model.patchifier.patchify((video_mask * t.view(-1, 1, 1, 1, 1))[:, :1])[0]
    a_t = t if audio_mask is None else model.a_patchifier.patchify(
        (audio_mask * t.view(-1, 1, 1, 1))[:, :1, :, :1])[0]
    extra = {"denoise_mask": video_mask} | ({} if audio_mask is None else {"audio_denoise_mask": audio_mask})
    return model, (x, (v_t, a_t), context, attention_mask), {**kwargs, **extra}


@ltxav_case("ltxav_image_to_video")
def ltxav_image_to_video():
    """LTXVImgToVideo(Inplace): the first latent frame kept (mask 0), the rest denoised (per frame,
    so the model compresses the video timesteps per frame, 35 tokens each)."""
    mask = torch.ones(2, 1, 3, 5, 7)
    mask[:, :, 0] = 0.0
    return with_denoise_masks(*ltxav_inputs(ltxav_model(), 9, seed=165), mask)


@ltxav_case("ltxav_inpaint_audio_mask")
def ltxav_inpaint_audio_mask():
    """A spatial video mask (per-token timesteps, not compressible per frame) and an audio mask
    keeping the first four audio frames."""
    video = (randn(2, 1, 3, 5, 7, seed=166) > 0).float()
    audio = torch.ones(2, 8, 11, 16)
    audio[:, :, :4] = 0.0
    return with_denoise_masks(*ltxav_inputs(ltxav_model(), 11, seed=167), video, audio)


def ltxav_keyframe(strength: float, seed: int):
    """What LTXVAddGuide builds: one guide latent frame appended to the video latent (kept where its
    mask is 1 - strength), its pixel coordinates as keyframe_idxs (frame 16), and its guide entry;
    with the learned keyframe marker, added to the first frame and to a generated keyframe slot."""
    from comfy.ldm.lightricks.symmetric_patchifier import latent_to_pixel_coords

    model = ltxav_model(use_keyframes_abs_pos_embedding=True)
    model, args, kwargs = ltxav_inputs(model, 9, seed=seed, generated_keyframes={
        "tokens_per_frame": 35, "first_latent_frame": 2, "num_keyframes": 1})
    (video, audio), t, context, attention_mask = args
    guide = randn(1, 128, 1, 5, 7, seed=seed + 3)
    _, coords = model.patchifier.patchify(guide)
    keyframe_idxs = latent_to_pixel_coords(coords, model.vae_scale_factors, causal_fix=True)
    keyframe_idxs[:, 0] += 16
    mask = torch.ones(2, 1, 4, 5, 7)
    mask[:, :, 3] = 1.0 - strength
    entry = {"pre_filter_count": 35, "strength": strength, "pixel_mask": None, "latent_shape": (1, 5, 7)}
    args = ([torch.cat([video, guide.expand(2, -1, -1, -1, -1)], dim=2), audio], t, context, attention_mask)
    kwargs = {**kwargs, "keyframe_idxs": keyframe_idxs.expand(2, -1, -1, -1), "guide_attention_entries": [entry]}
    return with_denoise_masks(model, args, kwargs, mask)


@ltxav_case("ltxav_keyframe_guide")
def ltxav_keyframe_guide():
    """A keyframe guide at full strength: 35 guide tokens after the 105 video tokens, placed and
    kept or dropped before the first block, so the split covers them like any video token."""
    return ltxav_keyframe(1.0, seed=168)


@pytest.fixture(scope="module", params=list(LTXAV_MESHES) if LTXAV_CASES else [])
def ltxav_world(request, runtime):
    return cpu_world(runtime, LTXAV_MESHES[request.param])


@pytest.fixture(scope="module")
def ltxav_built():
    return single_process_references(LTXAV_CASES)


def run_ltxav(world, model, args, kwargs, **kw):
    with torch.inference_mode():
        return world.forward(model, find_plan(model), model.forward, args,
                             {**kwargs, "transformer_options": {}}, **kw)


def max_errors(out, ref) -> tuple[float, float]:
    """Largest absolute error over the video and the audio output, and its size relative to them."""
    err = max((o - r).abs().max().item() for o, r in zip(out, ref))
    return err, err / max(r.abs().max().item() for r in ref)


@pytest.mark.parametrize("case", list(LTXAV_CASES))
def test_ltxav_matches_single_process(ltxav_world, ltxav_built, case):
    model, args, kwargs, ref = ltxav_built(case)
    refused = refused_input(model, kwargs)
    if refused:
        with pytest.raises(RuntimeError, match=f"'{refused}' is not supported with context parallelism"):
            run_ltxav(ltxav_world, model, args, kwargs)
        return
    out = run_ltxav(ltxav_world, model, args, kwargs)
    err, rel = max_errors(out, ref)
    print(f"\n{case} on {ltxav_world.config.describe()}: max abs err {err:.2e}, rel {rel:.2e}")
    assert [o.shape for o in out] == [r.shape for r in ref]
    assert err <= TOL


def test_ltxav_guide_attention_mask_refused(world):
    """A guide below full strength makes the model build a self-attention bias between absolute
    token ranges: refused by name before any rank works (the world stays usable), never computed."""
    if "ltxav_keyframe_guide" not in LTXAV_CASES:
        pytest.skip("this ComfyUI has no LTX-2")
    model, args, kwargs = ltxav_keyframe(0.5, seed=169)
    with pytest.raises(RuntimeError, match="'guide_attention_entries' is not supported with context parallelism"):
        run_ltxav(world, model, args, kwargs)
    model, args, kwargs = ltxav_keyframe(1.0, seed=169)
    assert run_ltxav(world, model, args, kwargs)[0].shape == (2, 128, 4, 5, 7)


def test_ltxav_attention_really_crosses_ranks(world, ltxav_built):
    """With communication in attention switched off the result must be wrong."""
    if "ltxav_t2v_audio" not in LTXAV_CASES:
        pytest.skip("this ComfyUI has no LTX-2")
    if world.config.ring_size == 1 and world.config.ulysses_size == 1:
        pytest.skip("no sequence parallelism in this mesh")
    model, args, kwargs, ref = ltxav_built("ltxav_t2v_audio")
    _, rel = max_errors(run_ltxav(world, model, args, kwargs, distributed_attention=False), ref)
    assert rel > 1e-3


def test_ltxav_weighted_split(world, ltxav_built):
    """Ranks of unequal speed hold unequal shares of both streams (every other rank three times
    the tokens): the cross-stream sites pad and cut each stream's shares by its own layout."""
    if "ltxav_t2v_audio" not in LTXAV_CASES:
        pytest.skip("this ComfyUI has no LTX-2")
    model, args, kwargs, ref = ltxav_built("ltxav_t2v_audio")
    weights = tuple(1.0 + 2.0 * (r % 2) for r in range(world.config.world_size))
    err, rel = max_errors(run_ltxav(world, model, args, kwargs, weights=weights), ref)
    print(f"\nltxav_t2v_audio weighted {weights} on {world.config.describe()}: max abs err {err:.2e}, rel {rel:.2e}")
    assert err <= TOL


def test_a_table_of_spans_is_cut_to_each_ranks_chunk():
    """``Split.spans`` (MiniMax-H3's per-segment modulation table): each rank gets the parts of the
    spans inside its chunk at local positions, per-token tensors cut alike, other items unchanged;
    the ranks' parts cover every token of every span exactly once, whatever the split."""
    from parallel_runtime.parallel.attention import SequenceParallel
    from parallel_runtime.parallel.context_parallel import ForwardContext
    from parallel_runtime.plans.vocabulary.context_parallel import Split

    total = 23
    rows = torch.arange(100, 112)
    spans = [(0, 7, 1), (7, 11, 5), (11, 23, rows)]
    spec = Split("mod_segments", spans=True)
    for parts, weights in ((2, None), (4, None), (3, (1.0, 3.0, 1.0))):
        owner = {}
        for index in range(parts):
            sp = SequenceParallel(None, parts, index, None, 1, 0)
            ctx = ForwardContext(sp, None, weights=weights)
            shard = ctx.start_stream("x", total)
            local = ctx.cut_spans(spans, spec, "blocks.0")
            assert ctx.cut_spans(spans, spec, "blocks.1") is local  # once per table
            for a, b, row in local:
                assert 0 <= a < b <= shard.valid
                for i in range(a, b):
                    token = shard.start + i
                    owner[token] = owner.get(token, []) + [row if isinstance(row, int) else int(row[i - a])]
        assert owner == {t: [1] if t < 7 else [5] if t < 11 else [100 + t - 11] for t in range(total)}
    ctx = ForwardContext(SequenceParallel(None, 2, 0, None, 1, 0), None)
    ctx.start_stream("x", total)
    with pytest.raises(RuntimeError, match="not one per token"):
        ctx.cut_spans([(11, 23, rows[:5])], spec, "blocks.0")
    with pytest.raises(RuntimeError, match="outside the 23 tokens"):
        ctx.cut_spans([(20, 30, 0)], spec, "blocks.0")


def minimax_h3_case(masks: bool):
    """A tiny MiniMax-H3 (four heads of 64, two blocks, a 1-block token refiner) on 5 latent frames of
    3 x 2 tokens and 9 stereo audio frames (18 rows) with 6 text tokens (54 packed tokens); the text
    enters unrefined, so the refiner runs in the forward. ``masks``: denoise masks on both streams
    that give every video patch row and every audio frame its own timestep (per-token modulation
    rows in the segment table and in the final layer)."""
    from comfy.ldm.minimax.model import MiniMaxH3Model

    model = seeded(MiniMaxH3Model(hidden_size=256, num_layers=2, token_refiner_num_layers=1, num_attention_heads=4,
                                  attention_head_dim=64, ffn_hidden_size=512, text_dim=64, timestep_input_dim=64,
                                  time_embed_hidden_size=256, time_embed_dim=64, rope_inv_freq_len=8,
                                  dtype=torch.float32, device="cpu", operations=OPS), seed=170).requires_grad_(False)
    with torch.no_grad():  # (its fused RoPE kernel refuses weights that require grad, as ComfyUI's never do)
        model.rope.inv_freq.copy_(1.0 / 10000.0 ** (torch.arange(8) / 8))
        for name, p in model.named_parameters():
            if "adaln_proj" in name:
                p.mul_(10.0)
    x = [randn(1, 24, 5, 4, 6, seed=171), randn(1, 32, 2, 9, seed=172)]
    kwargs = {"minimax_payload": {}}
    if masks:
        kwargs["denoise_mask"] = torch.linspace(0.1, 1.0, 5 * 4 * 6).reshape(1, 1, 5, 4, 6)
        kwargs["audio_denoise_mask"] = torch.linspace(0.2, 1.0, 18).reshape(1, 1, 2, 9)
    return model, (x, torch.tensor([700.0]), randn(1, 6, 64, seed=173)), kwargs


@pytest.mark.skipif(not available("comfy.ldm.minimax.model"), reason="MiniMax-H3 comes with ComfyUI 0.33; this ComfyUI has no comfy.ldm.minimax")
@pytest.mark.parametrize("masks", [False, True], ids=["t2va", "denoise_masks"])
def test_minimax_h3_matches_single_process(world, masks):
    model, args, kwargs = minimax_h3_case(masks)
    with torch.inference_mode():
        ref = model._forward(*args, **kwargs, transformer_options={})
    err, rel = max_errors(run(world, model, args, kwargs), ref)
    print(f"\nminimax_h3 {'masks' if masks else 't2va'} on {world.config.describe()}: max abs err {err:.2e}, "
          f"rel {rel:.2e}")
    assert err <= TOL
    if world.config.ring_size > 1 or world.config.ulysses_size > 1:  # with attention local only: wrong
        assert max_errors(run(world, model, args, kwargs, distributed_attention=False), ref)[1] > 1e-3
