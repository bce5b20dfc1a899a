"""Exact patch-parallel VAE decode and encode: every rank computes one band of rows.

The input (latent rows for a decode, pixel rows for an encode) is cut into row
bands, one per rank, and every rank runs the model's own ``decode`` / ``encode``
on its band. For the duration of that call the layers that look beyond a row
are made exact on a band (the VAE's plan in ``plans/vaes/`` names them):

- convolutions exchange a halo with the neighbour ranks (the rows of the
  bands above and below that their kernel reads) and pad only at the top and
  bottom of the whole image, in the conv's own padding mode (zeros, replicate or
  reflect). Rows the model's code padded before the conv (``F.pad`` in
  ``Downsample``, ``CausalConv3d`` and HunyuanVideo's ``CarriedConv3d`` /
  ``VideoConv3d``, ``ZeroPad2d``) are removed first and count as the conv's
  global padding, in the mode the plan declares for them.
- GroupNorm combines its per-group count, mean and sum of squared deviations
  over all ranks (Chan's parallel variance, in float64), then normalises locally.
- attention blocks (mid block, lowest resolution) gather the keys and values of
  all rows; each rank attends its own query rows.
- up-sampling by nearest neighbour and per-pixel layers need nothing; band
  edges are aligned so that every strided conv and pooling window stays inside
  one band (an encode's bands start at multiples of the total down-sampling).

Video VAEs run their frame loop as usual on every rank: the causal time caches
hold the band's rows only, so they are per rank and stay consistent because
every rank processes the same frames in the same order.

Each rank holds its band's activations plus a halo of a row or two per conv
(about 1/N of a single-device run); only the attention blocks see all rows of
their (lowest-resolution) keys and values. At the end rank 0 gathers the output
bands. The result equals the untiled single-device decode up to floating-point
rounding, unlike tiled decoding.

The overrides are instance attributes (a conv's ``_conv_forward`` and
``padding``, a norm's ``forward``, an attention block's attention function) set
for one call and restored afterwards, so ComfyUI's module is left untouched; the
one exception is a module global a plan names in ``call_globals`` (LTX's time
chunk size, which would otherwise differ between bands of different heights).
A decode keyword the plan names in ``output_argument`` (LTX's ``output_buffer``)
is not passed to the bands: rank 0 copies the gathered output into it.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .scoped_hooks import Overrides
from .sequence import weighted_sizes
from ..distributed import comm
from ..plans.vocabulary.vae import VaePlan, matches_any

log = logging.getLogger("parallel")

ROWS = -2  # the row (height) dimension of every tensor these VAEs pass around: [B, C, (T,) H, W]

# Diagnostic: a module attribute naming parts whose communication is skipped
# ("halo", "norm", "attention"): every band then computes as if it were the whole
# image there, which is what naive tiling does. Tests use it to prove that each
# exchange matters. It travels to the workers with the module.
LOCAL_ONLY_ATTR = "parallel_vae_local_only"
PARTS = ("halo", "norm", "attention")

# What the last run_vae did on this rank (bands, fallback, largest conv input): for tests and status.
last_run: dict = {}

__all__ = ["run_vae", "band_convs", "Bands", "ConvRows", "LOCAL_ONLY_ATTR"]


# ---------------------------------------------------------------- geometry
@dataclass(frozen=True)
class Bands:
    """How ``total`` input rows are cut: whole units of ``unit`` rows spread as evenly
    as possible (the first ranks take one more when they do not divide); rows that do
    not fill a unit go to the last band.

    With ``weights`` (relative speed per rank) the units go in proportion instead, each
    band keeping at least ``least`` units (the tallest halo) where there are enough."""

    total: int
    unit: int
    parts: int
    weights: tuple[float, ...] = ()
    least: int = 1

    @property
    def units(self) -> int:
        return self.total // self.unit

    @property
    def min_units(self) -> int:
        return min(self._units())

    def _units(self) -> list[int]:
        if self.weights:
            return list(weighted_sizes(self.units, self.weights, self.least))
        base, extra = divmod(self.units, self.parts)
        return [base + (r < extra) for r in range(self.parts)]

    def sizes(self) -> list[int]:
        sizes = [u * self.unit for u in self._units()]
        sizes[-1] += self.total - self.units * self.unit
        return sizes

    def start(self, rank: int) -> int:
        return sum(self.sizes()[:rank])


@dataclass(frozen=True)
class ConvRows:
    """A conv along the rows.

    ``kernel`` rows are read per output row (dilation included), ``stride`` rows
    apart; ``top``/``bottom`` zero rows pad the whole image (the conv's own padding
    plus ``stripped``, the rows the code before it pads every input with). A band
    starting at a multiple of the stride needs ``above`` rows of the band above and
    ``below`` rows of the band below; the first and last bands take the image's
    padding instead, so every band computes exactly its own output rows. ``mode``:
    how the image is padded ("zeros", "replicate" or "reflect"); ``own_mode``: the
    conv pads that way itself (``padding_mode``), so its own row padding is switched off.
    """

    kernel: int
    stride: int
    top: int
    bottom: int
    stripped: tuple[int, int] = (0, 0)
    mode: str = "zeros"
    own_mode: bool = False

    @property
    def above(self) -> int:
        return self.top

    @property
    def below(self) -> int:
        return max(0, self.kernel - self.stride - self.top)

    @property
    def halo(self) -> int:
        return max(self.above, self.below)

    @property
    def row_local(self) -> bool:
        return self.above == 0 and self.below == 0 and self.bottom == 0 and self.stripped == (0, 0)


PAD_MODES = ("zeros", "replicate", "reflect")


def conv_rows(conv: torch.nn.Module, stripped: tuple[int, int], stripped_mode: str = "zeros") -> ConvRows:
    if isinstance(conv.padding, str):
        if conv.padding != "valid":
            raise ValueError(f"parallel VAE: {type(conv).__name__} with padding='{conv.padding}' is not supported")
        pad = 0
    else:
        pad = int(conv.padding[ROWS])
    own = conv.padding_mode != "zeros" and pad > 0
    if own and stripped != (0, 0):
        raise ValueError(f"parallel VAE: {type(conv).__name__} pads with '{conv.padding_mode}' after its input was "
                         "padded already; not supported")
    mode = conv.padding_mode if own else stripped_mode
    if mode not in PAD_MODES:
        raise ValueError(f"parallel VAE: {type(conv).__name__} pads with '{mode}'; only {', '.join(PAD_MODES)} "
                         "padding is supported")
    kernel = int(conv.dilation[ROWS]) * (int(conv.kernel_size[ROWS]) - 1) + 1
    return ConvRows(kernel=kernel, stride=int(conv.stride[ROWS]), top=stripped[0] + pad, bottom=stripped[1] + pad,
                    stripped=stripped, mode=mode, own_mode=own)


def _stripped_rows(root: torch.nn.Module, bands: VaePlan) -> dict[int, tuple[tuple[int, int], str]]:
    """id(conv) -> (rows, mode): the rows the code around it pads its input with, and how
    (from the plan's ``padded``; a spec that adds no rows to a conv leaves it to the others)."""
    out = {}
    for _, owner in root.named_modules():
        for spec in bands.padded:
            if not matches_any(owner, (spec.owner,), inherited=False):
                continue
            try:
                conv = owner.get_submodule(spec.conv) if spec.conv else owner
            except AttributeError:
                continue  # this variant has no such conv (a Resample in mode "none")
            rows = tuple(int(r) for r in spec.rows(owner))
            if rows != (0, 0):
                out[id(conv)] = rows, spec.mode(owner)
    return out


def band_convs(root: torch.nn.Module, bands: VaePlan) -> list[tuple[torch.nn.Module, ConvRows]]:
    """Every conv of the model with its geometry along the rows."""
    stripped = _stripped_rows(root, bands)
    return [(m, conv_rows(m, *stripped.get(id(m), ((0, 0), "zeros")))) for _, m in root.named_modules()
            if matches_any(m, bands.convs, inherited=True)]


# ---------------------------------------------------------------- one run on one rank
class _BandRun:
    """This rank's band and the exchanges with the other ranks during one call."""

    def __init__(self, group, parts: int, rank: int, local_only: frozenset[str]):
        self.group = group
        self.parts = parts
        self.rank = rank
        self.first = rank == 0
        self.last = rank == parts - 1
        self.local_only = local_only
        self.largest_conv_input = 0  # elements, halos included (memory diagnostics)
        self.exchanges = 0

    def _peer(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank) if self.group is not dist.group.WORLD else group_rank

    # ------------------------------------------------------------ halos
    def with_halo(self, x: torch.Tensor, rows: ConvRows) -> torch.Tensor:
        """``x`` (this band, without the padding its code added) with the rows the conv
        reads above and below it: the neighbours' rows, or the image's zero padding."""
        have = x.shape[ROWS]
        if not self.last and have % rows.stride:
            raise RuntimeError(f"parallel VAE: a band of {have} rows reaches a stride-{rows.stride} conv; the plan's "
                               "band alignment does not match this model")
        exchange = "halo" not in self.local_only
        send_up = rows.below if exchange and not self.first else 0  # the band above reads my first rows
        send_down = rows.above if exchange and not self.last else 0  # the band below reads my last rows
        if max(send_up, send_down) > have:
            raise RuntimeError(f"parallel VAE: a band of {have} rows cannot supply a halo of "
                               f"{max(send_up, send_down)} rows")
        recv_above = rows.above if exchange and not self.first else 0
        recv_below = rows.below if exchange and not self.last else 0
        ops, above, below = [], None, None
        if send_up:
            ops.append(("send", x.narrow(ROWS, 0, send_up).contiguous(), self._peer(self.rank - 1)))
        if send_down:
            ops.append(("send", x.narrow(ROWS, have - send_down, send_down).contiguous(), self._peer(self.rank + 1)))
        if recv_above:
            above = x.new_empty(_with_rows(x.shape, recv_above))
            ops.append(("recv", above, self._peer(self.rank - 1)))
        if recv_below:
            below = x.new_empty(_with_rows(x.shape, recv_below))
            ops.append(("recv", below, self._peer(self.rank + 1)))
        if ops:
            comm.p2p(ops, self.group).wait()  # staged through host buffers where gloo meets CUDA
            self.exchanges += 1
        # Image edges (and, with the halo exchange off, every band edge) get the conv's padding.
        if above is None:
            above = _edge_rows(x, rows.top if self.first else rows.above, rows.mode, top=True)
        if below is None:
            below = _edge_rows(x, rows.bottom if self.last else rows.below, rows.mode, top=False)
        parts = [t for t in (above, x, below) if t is not None]
        return torch.cat(parts, dim=ROWS) if len(parts) > 1 else x

    def conv(self, rows: ConvRows, original, input, weight, bias, *args, **kwargs):
        """Stands in for one conv's ``_conv_forward`` (after the model's own padding and
        ComfyUI's weight casting), whose row padding is zero for the duration."""
        x = input
        if rows.stripped != (0, 0):
            top, bottom = rows.stripped
            x = x.narrow(ROWS, top, x.shape[ROWS] - top - bottom)
        x = self.with_halo(x, rows)
        self.largest_conv_input = max(self.largest_conv_input, x.numel())
        return original(x, weight, bias, *args, **kwargs)

    # ------------------------------------------------------------ gathers
    def row_counts(self, rows: int, device) -> list[int]:
        counts = torch.zeros(self.parts, dtype=torch.int64, device=device)
        mine = torch.tensor([rows], dtype=torch.int64, device=device)
        comm.all_gather_into(counts, mine, self.group)
        return counts.tolist()

    def all_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's band of ``x`` joined along the rows (bands may differ in height)."""
        counts = self.row_counts(x.shape[ROWS], x.device)
        most = max(counts)
        moved = _pad_rows0(x.movedim(ROWS, 0), most).contiguous()
        out = moved.new_empty((self.parts * most, *moved.shape[1:]))
        comm.all_gather_into(out, moved, self.group)
        if all(c == most for c in counts):
            return out.movedim(0, ROWS)
        return torch.cat([out[r * most: r * most + c] for r, c in enumerate(counts)]).movedim(0, ROWS)

    def gather_output(self, out: torch.Tensor) -> torch.Tensor | None:
        """The whole output on rank 0 (None elsewhere: workers' results are not used, and
        a full copy per worker would undo the memory saving)."""
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"parallel VAE: the model returned a {type(out).__name__}, not a tensor")
        counts = self.row_counts(out.shape[ROWS], out.device)
        most = max(counts)
        moved = _pad_rows0(out.movedim(ROWS, 0), most).contiguous()
        if not self.first:
            comm.gather(moved, None, dst=self._peer(0), group=self.group)
            return None
        full = moved.new_empty((self.parts * most, *moved.shape[1:]))
        comm.gather(moved, list(full.split(most)), dst=self._peer(0), group=self.group)
        if any(c != most for c in counts):
            full = torch.cat([full[r * most: r * most + c] for r, c in enumerate(counts)])
        return full.movedim(0, ROWS)

    # ------------------------------------------------------------ norms
    def group_norm(self, norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``torch.nn.GroupNorm`` over the whole image: per (sample, group) count, mean
        and sum of squared deviations from every rank, combined in float64."""
        b, c = x.shape[:2]
        groups = norm.num_groups
        work = x.reshape(b, groups, -1)
        if work.dtype not in (torch.float32, torch.float64):
            work = work.float()
        var, mean = torch.var_mean(work, dim=-1, correction=0)
        if "norm" not in self.local_only:
            n = work.shape[-1]
            stats = torch.stack([torch.full_like(mean, n), mean, var * n], dim=-1).double()
            every = stats.new_empty((self.parts * stats.shape[0], *stats.shape[1:]))
            comm.all_gather_into(every, stats, self.group)
            counts, means, m2 = every.view(self.parts, *stats.shape).unbind(-1)
            total = counts.sum(0)
            mean64 = (counts * means).sum(0) / total
            var64 = (m2 + counts * (means - mean64) ** 2).sum(0) / total
            mean, var = mean64.to(work.dtype), var64.to(work.dtype)
        rstd = torch.rsqrt(var + norm.eps)
        y = ((work - mean[..., None]) * rstd[..., None]).reshape(x.shape)
        if norm.affine:
            weight, bias, release = _norm_weights(norm, x)
            shape = (1, c) + (1,) * (x.ndim - 2)
            y = torch.addcmul(bias.to(y.dtype).view(shape), y, weight.to(y.dtype).view(shape))
            release()
        return y.to(x.dtype)

    # ------------------------------------------------------------ attention
    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Single-head attention over all pixels, ``[B, C, H, W]`` in and out (the layout
        of ComfyUI's VAE attention functions): this band's queries, every band's keys."""
        if "attention" not in self.local_only:
            k, v = self.all_rows(k), self.all_rows(v)
        b, c = q.shape[:2]
        qs, ks, vs = (t.reshape(b, 1, c, -1).transpose(2, 3) for t in (q, k, v))
        out = F.scaled_dot_product_attention(qs, ks, vs)
        return out.transpose(2, 3).reshape(q.shape)


def _with_rows(shape, rows: int) -> tuple[int, ...]:
    shape = list(shape)
    shape[ROWS] = rows
    return tuple(shape)


def _edge_rows(x: torch.Tensor, n: int, mode: str, *, top: bool) -> torch.Tensor | None:
    """The ``n`` rows that ``F.pad(mode=...)`` would add above (``top``) or below ``x``."""
    if not n:
        return None
    have = x.shape[ROWS]
    if mode == "zeros":
        return x.new_zeros(_with_rows(x.shape, n))
    if mode == "replicate":
        return x.narrow(ROWS, 0 if top else have - 1, 1).expand(_with_rows(x.shape, n))
    if n >= have:
        raise RuntimeError(f"parallel VAE: a band of {have} rows cannot reflect {n} rows of padding")
    return x.narrow(ROWS, 1 if top else have - 1 - n, n).flip(ROWS)


def _pad_rows0(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])


def _norm_weights(norm: torch.nn.Module, x: torch.Tensor):
    """The norm's weight and bias as its own forward would use them: ComfyUI's layers may
    cast them (to the input's dtype and device, with LoRA-style weight functions applied)."""
    casts = (getattr(norm, "comfy_cast_weights", False) or len(getattr(norm, "weight_function", ()))
             or len(getattr(norm, "bias_function", ())))
    if casts:
        import comfy.ops

        try:
            weight, bias, stream = comfy.ops.cast_bias_weight(norm, x, offloadable=True)
        except TypeError:  # ComfyUI before offloadable casts
            weight, bias = comfy.ops.cast_bias_weight(norm, x)
            return weight, bias, lambda: None
        release = getattr(comfy.ops, "uncast_bias_weight", None)
        return weight, bias, (lambda: release(norm, weight, bias, stream)) if release else (lambda: None)
    return norm.weight, norm.bias, lambda: None


# ---------------------------------------------------------------- installing the overrides
@contextlib.contextmanager
def _banded(root: torch.nn.Module, bands: VaePlan, convs, run: _BandRun):
    overrides = Overrides()
    try:
        for conv, rows in convs:
            if rows.row_local:
                continue
            padding = conv.padding
            if not isinstance(padding, str):
                padding = tuple(0 if i == len(padding) + ROWS else p for i, p in enumerate(padding))
                overrides.set(conv, "padding", padding)  # the halo supplies the rows now
            if rows.own_mode:  # torch pads with F.pad((w, w, h, h, ...)) itself: not along the rows now
                pads = list(conv._reversed_padding_repeated_twice)
                pads[2] = pads[3] = 0
                overrides.set(conv, "_reversed_padding_repeated_twice", pads)
            original = conv._conv_forward  # a bound method, or an override already in place
            overrides.set(conv, "_conv_forward", functools.partial(run.conv, rows, original))
        for _, m in root.named_modules():
            if matches_any(m, bands.group_norms, inherited=True):
                overrides.set(m, "forward", functools.partial(run.group_norm, m))
            for site in bands.attention:
                if matches_any(m, (site.owner,), inherited=False):
                    overrides.set(m, site.function, run.attention)
        for spec in bands.call_globals:
            module = sys.modules.get(spec.module)
            if module is not None:  # not imported: the model cannot be reading it
                overrides.set(module, spec.name, spec.value)
        yield
    finally:
        overrides.restore()


# ---------------------------------------------------------------- entry point
def _method_name(call) -> str:
    target = getattr(call, "original", call)  # ComfyUI's WrapperExecutor
    target = getattr(target, "func", target)  # functools.partial
    return getattr(getattr(target, "__func__", target), "__name__", "")


def run_vae(module: torch.nn.Module, plan: VaePlan, group, world_size: int, rank: int, call, args: tuple,
            kwargs: dict, *, communicate: bool = True, weights: tuple[float, ...] | None = None):
    """Run ``call(*args, **kwargs)`` (the module's ``decode`` or ``encode``; the latent or
    the pixels are ``args[0]``, ``[B, C, (T,) H, W]``) over row bands on every rank.

    Returns the whole output on rank 0 and None on the other ranks. Every rank must
    call it with the same input. ``communicate=False`` (or the module attribute
    ``LOCAL_ONLY_ATTR``) skips the exchanges: a diagnostic that shows what naive
    tiling would compute. ``weights`` (relative speed per rank of ``group``): bands
    in proportion instead of even.
    """
    if group is None or world_size == 1:
        return call(*args, **kwargs)
    method = _method_name(call)
    if method not in ("decode", "encode"):
        raise ValueError(f"parallel VAE: cannot split '{method}' of {type(module).__name__} into bands (decode and "
                         "encode only)")
    x = args[0]
    if not isinstance(x, torch.Tensor) or x.ndim < 4:
        raise ValueError(f"parallel VAE: {method} expects a [B, C, (T,) H, W] tensor first, got "
                         f"{getattr(x, 'shape', type(x).__name__)}")
    local_only = frozenset(PARTS) if not communicate else frozenset(getattr(module, LOCAL_ONLY_ATTR, ()) or ())
    args, kwargs, buffer = _take_argument(call, args, kwargs, plan.output_argument)
    unit = 1 if method == "decode" else int(plan.encode_rows(module))
    convs = band_convs(module, plan)
    halo = max([1] + [rows.halo for _, rows in convs])
    bands = Bands(x.shape[ROWS], unit, world_size, tuple(weights or ()), halo)
    last_run.clear()
    last_run.update(method=method, rows=bands.total, unit=unit, sizes=bands.sizes(), halo=halo, fallback=False,
                    weights=bands.weights)
    if bands.min_units < halo:
        # Too few rows to give every rank a band at least as tall as any halo (at every
        # resolution). Tiny images only: every rank computes the whole thing, exactly and
        # without any collective, so no rank can wait for another.
        log.warning("parallel VAE: %d %s rows cannot be split over %d ranks (each needs at least %d x %d rows); "
                    "every rank computes the whole %s", bands.total, "latent" if method == "decode" else "pixel",
                    world_size, halo, unit, method)
        last_run["fallback"] = True
        out = call(*args, **kwargs)
        return _into(buffer, out) if rank == 0 else None
    start, size = bands.start(rank), bands.sizes()[rank]
    local = x.narrow(ROWS, start, size).contiguous()
    run = _BandRun(group, world_size, rank, local_only)
    with _banded(module, plan, convs, run):
        out = call(local, *args[1:], **kwargs)
    last_run.update(largest_conv_input=run.largest_conv_input, exchanges=run.exchanges, band=(start, size))
    return _into(buffer, run.gather_output(out))


def _take_argument(call, args: tuple, kwargs: dict, name: str | None):
    """``(args, kwargs, value)``: the call's arguments without ``name`` (passed by keyword, or by
    position as the dispatch binds it) and its value (None where absent or no name)."""
    kwargs = dict(kwargs)
    if not name:
        return args, kwargs, None
    try:
        bound = inspect.signature(call).bind(*args, **kwargs)
    except (TypeError, ValueError):  # not introspectable: by keyword only
        return args, kwargs, kwargs.pop(name, None)
    value = bound.arguments.pop(name, None)
    return bound.args, bound.kwargs, value


def _into(buffer: torch.Tensor | None, out: torch.Tensor | None):
    """The output, copied into the caller's output buffer where it passed one (rank 0)."""
    if buffer is None or out is None:
        return out
    buffer.copy_(out)
    return buffer
