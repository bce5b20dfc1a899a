"""What a transformer plan says about context parallelism: what it splits, gathers and attends.

A plan names module paths (glob patterns per dotted segment over
``named_modules()``) and what happens there, in the style of diffusers' ``_cp_plan``:

- ``inputs``: inputs cut along a token dimension when the module is called. A
  model may have several token *streams* (text and image); for each stream one
  input ``starts_stream`` and fixes its length. Side inputs (RoPE tables,
  per-token modulation, masks) are cut the same way wherever they are passed; a
  side input that covers several streams back to back (RoPE for ``[txt, img]``)
  names them as ``segments``.
- ``outputs``: module outputs gathered back to full streams.
- ``attention``: modules whose attention calls are context-parallel, with the
  order in which the model concatenates the streams there (or, for a cross-stream
  site, the query streams and the key/value streams apart). Attention anywhere
  else (cross-attention to the text) stays local: each rank attends its query
  shard to the full keys.

Declarations only: ``matching`` finds what a plan names in a model, and
``parallel/context_parallel.py`` applies them to one forward.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch


MAIN_STREAM = "x"


@dataclass(frozen=True)
class Split:
    """Cut the input ``arg`` of a module along ``dim``.

    ``starts_stream``: this input is the token stream ``stream`` itself and fixes its
    length. Otherwise it is a side input of ``stream``: cut when its size along
    ``dim`` equals the stream's token count, passed unchanged when it is 1
    (broadcast), and first expanded with ``expand(t, total)`` when the model itself
    would expand it per token. ``segments``: the input covers these streams back to
    back along ``dim`` (each part is cut by its own stream). ``when_full_length``: pass
    the input through when it is not full length (it was cut already, e.g. a stream
    a block returns). ``prefix``: the input covers the first N <= total tokens of the
    stream (ControlNet residuals cover the main image, not reference tokens after
    it); each rank gets the part inside its chunk, unpadded when N < total. ``item``: the
    input is a tuple and its element ``item`` is cut (LTXV's RoPE became ``(matrix, split)`` in
    ComfyUI 0.33). A spec with ``item`` applies only to a tuple, one without only to a tensor,
    so a plan can name both forms where ComfyUI releases differ. ``convert``: the input may arrive
    as an object a token split cannot cut (LTX-2 keeps per-token timesteps per frame in a
    ``CompressedTimestep``); ``convert(value)`` returns the tensor the module accepts in its place,
    full length along ``dim``, which is then cut like any other (a value it returns unchanged is
    passed on as it came). ``spans``: the input is not a tensor but a table of spans over the
    stream's tokens at absolute positions, a list of ``(start, stop, *rest)`` (MiniMax-H3's
    per-segment modulation rows): each rank receives the parts of the spans that lie in its chunk,
    at its local positions (spans outside it dropped, padding covered by none); an item of
    ``rest`` that is a tensor with one entry per token of its span (a per-token row index) is cut
    alike, any other item passes unchanged.
    """

    arg: str
    dim: int = 1
    stream: str = MAIN_STREAM
    starts_stream: bool = False
    segments: tuple[str, ...] | None = None
    expand: Callable[[torch.Tensor, int], torch.Tensor] | None = None
    when_full_length: bool = False
    prefix: bool = False
    item: int | None = None
    convert: Callable[[object], object] | None = None
    spans: bool = False


@dataclass(frozen=True)
class Gather:
    """Gather a module's output back to the full stream along ``dim``
    (``segments``: the output holds these streams back to back; ``item``: element ``item`` of a
    tuple output). ``keep_local``: segments
    left as this rank's chunk, for a model that drops them itself by their local length
    (Chroma Radiance slices the text off the joint stream with the text chunk's length)."""

    dim: int = 1
    stream: str = MAIN_STREAM
    segments: tuple[str, ...] | None = None
    keep_local: tuple[str, ...] = ()
    item: int | None = None  # the output is a tuple (a block returning (img, txt)): gather this element


@dataclass(frozen=True)
class AttentionGlobal:
    """The module global ``module.name`` through which a model calls attention without passing
    ``transformer_options`` (ERNIE-Image's ``optimized_attention(q, k, v, heads, mask=...)``), so
    ComfyUI's ``optimized_attention_override`` never reaches it. For one sharded forward the engine
    replaces it, on every rank, with a function that routes the calls made inside the plan's
    attention sites to the distributed attention the other families get through the override, and
    puts the original back afterwards (also on error). ``TransformerPlan.check_matches`` refuses a
    model whose module no longer holds it."""

    module: str
    name: str = "optimized_attention"


@dataclass(frozen=True)
class CachedBlocks:
    """A stack of the model's repeated blocks (``double_blocks.*``) that Block Cache may skip
    (``parallel/block_cache.py``). The plan lists its stacks in the order the model runs them.
    ``outputs``: for a block returning a tuple, the argument each element updates (Flux's double
    blocks return ``(img, txt)``, Qwen-Image's ``(encoder_hidden_states, hidden_states)``), or an
    ``(argument, index)`` pair where the block takes its streams as one tuple and returns them
    alike (LTX-2's ``x = (vx, ax)``: ``(("x", 0), ("x", 1))``); empty: the block returns the
    update of its first argument. ``streams``: the token stream each output holds (a tuple of
    streams for a joint one, ``(txt, img)`` back to back), so that padding a context-parallel
    chunk carries is left out of the change measure. ``dim``: the outputs' token dimension
    (MiniMax-H3's packed ``[S, hidden]`` stream has no batch dimension: 0)."""

    pattern: str
    outputs: tuple["str | tuple[str, int]", ...] = ()
    streams: tuple["str | tuple[str, ...]", ...] = (MAIN_STREAM,)
    dim: int = 1


@dataclass(frozen=True)
class PatchSite:
    """How the model hands the token streams to the patches of one ``transformer_options["patches"]``
    hook (``"double_block"``: ComfyUI calls them after each main block with a dict of keyword
    arguments), for a patch that must see the whole sequence (``vocabulary/patches.py``: ``whole``).

    ``tokens``: keyword -> the stream whose local chunk it holds under context parallelism
    (Qwen-Image: ``{"img": "img", "txt": "txt"}``). ``joint``: keywords that are back-to-back parts
    of *one* stream's local chunk, cut by the model at a global position (Z-Image slices its joint
    ``[caption, image]`` stream at the caption length even when each rank holds a chunk of it), with
    ``joint_stream`` that stream and ``joint_at(kwargs, total)`` the global position of the cut.
    ``before_split``: the model calls this hook before it cuts any stream (Z-Image's noise refiner):
    the tensors are whole on every rank and the patch runs as it is."""

    tokens: dict[str, str] = field(default_factory=dict)
    joint: tuple[str, ...] = ()
    joint_stream: str = MAIN_STREAM
    joint_at: "Callable[[dict, int], int] | None" = None
    before_split: bool = False


@dataclass(frozen=True)
class ContextParallelPlan:
    inputs: dict[str, tuple[Split, ...]]
    outputs: dict[str, Gather]
    # Module pattern -> the streams in the order the model joins them (a joint self-attention), or
    # a pair ``((query streams), (key/value streams))``: queries from one split stream attending to
    # keys and values of another (LTX-2's audio-to-video and video-to-audio attention).
    attention: dict[str, "tuple[str, ...] | tuple[tuple[str, ...], tuple[str, ...]]"]
    # Arguments of the model's forward cut once their stream exists (tensors nested in
    # dicts and lists too, e.g. ControlNet residuals); the model reads them later.
    call_inputs: tuple[Split, ...] = ()
    # Arguments this plan cannot shard yet: forward argument -> why. Refused before any work.
    unsupported: dict[str, str] = field(default_factory=dict)
    # Where only some values of an unsupported argument are refused: argument -> whether this value
    # is (LTX-2's guide entries: only those that make the model build a guide attention mask).
    unsupported_when: dict[str, Callable[[object], bool]] = field(default_factory=dict)
    # Arguments the hooked modules (blocks, attention sites, gathered layers) receive that do not
    # depend on the token split and pass on unchanged. Any other argument that arrives with a value
    # means ComfyUI changed the model since the plan was written: refused, named (never computed).
    passed: frozenset[str] = frozenset()
    # Module globals through which the model calls attention without transformer_options
    # (``AttentionGlobal``): replaced for the duration of one sharded forward, so the plan's
    # attention sites reach the distributed attention all the same.
    attention_globals: tuple[AttentionGlobal, ...] = ()
    # ``transformer_options["patches"]`` hooks the model calls (``"double_block"``) -> how it hands
    # them the token streams (``PatchSite``); a model patch on a hook not named here is refused.
    patch_sites: dict[str, PatchSite] = field(default_factory=dict)
