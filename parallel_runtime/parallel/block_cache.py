"""Block Cache: DBCache-style step caching of the middle blocks, under every layout and unsharded.

At every step the first ``front_blocks`` blocks of the plan's block stacks (``TransformerPlan.cached_blocks``,
in the order the model runs them) are computed. Their residual (what they added to each stream they
return) is compared with the one of the last fully computed step: relative L1,
``sum |r - r_last| / sum |r_last|``. Under the threshold (after the warm-up steps, and no more than
``max_cached_steps`` cached steps in a row) the middle blocks are skipped and the residual they added
at the last full step is added instead (extrapolated by TaylorSeer when ``taylor_order`` > 0); the
last ``back_blocks`` blocks always run.

Under a sharded layout every rank runs this on its own part of the forward:

- the two sums of the change measure are summed over the whole world (CFG ranks hold part of the
  batch, sequence ranks part of the tokens, TP ranks a slice of the channels here), so the measure is
  the unsharded one up to rounding; the padding of a context-parallel chunk is left out;
- rank 0 decides and broadcasts its decision (one byte), so the ranks can never disagree: a rank that
  skipped the blocks while another computed them would leave that one waiting in a collective;
- each rank keeps only its own tokens of the cached residuals, and under TP only its slice of the
  channels (the residual stream is whole on every TP rank; a cached step all-gathers the slices), so a
  rank holds 1/N of the unsharded cache.

Whether a step is measured at all, its index, and when a sampling run starts afresh follow from the
forward's inputs (``sigmas`` within ``sample_sigmas``), which every rank receives alike.

Test switches (never for use): ``PARALLEL_TEST_BLOCK_CACHE_SKEW=x`` scales each rank's own measure
by ``1 + x`` on even ranks and ``1 - x`` on odd ones (a rounding difference near the threshold,
exaggerated) and counts the steps where the ranks' own wishes differed; with
``PARALLEL_TEST_BLOCK_CACHE_LOCAL=1`` each rank follows its own wish instead of rank 0's decision.
"""
from __future__ import annotations

import contextlib
import inspect
import math
import os
import weakref
from dataclasses import asdict, dataclass, fields
from typing import Callable

import torch

from ..distributed import comm
from ..plans.vocabulary.context_parallel import CachedBlocks
from ..plans.vocabulary.matching import matching_modules
from ..plans.vocabulary.transformer import TransformerPlan

OPTION = "hybrid_block_cache"  # transformer_options entry: the settings, plain data (travels to the workers)
SKEW_ENV = "PARALLEL_TEST_BLOCK_CACHE_SKEW"
LOCAL_ENV = "PARALLEL_TEST_BLOCK_CACHE_LOCAL"

# name -> (low, high) accepted; None: unbounded.
LIMITS = {"front_blocks": (1, None), "back_blocks": (0, None), "threshold": (0.0, 10.0),
          "warmup_steps": (0, 10_000), "max_cached_steps": (0, 10_000), "taylor_order": (0, 3)}


@dataclass(frozen=True)
class BlockCacheSettings:
    front_blocks: int = 1       # Fn: computed at every step; their residual is the change measure
    back_blocks: int = 0        # Bn: computed at every step, after the cached middle
    threshold: float = 0.08     # relative L1 change of the Fn residual under which the middle is reused
    warmup_steps: int = 2       # the first steps of a run are computed fully
    max_cached_steps: int = 3   # cached steps in a row at most (0: no limit)
    taylor_order: int = 0       # TaylorSeer order of the reused residual (0: reused as it was)

    def refusal(self, node: str, blocks: int | None = None) -> str | None:
        """Why these settings cannot run (a message naming the node, the value and the valid range),
        or None. ``blocks``: the model's count of cached blocks, when known."""
        for f in fields(self):
            value = getattr(self, f.name)
            low, high = LIMITS[f.name]
            bad = not isinstance(value, (int, float)) or isinstance(value, bool) or (
                isinstance(value, float) and not math.isfinite(value))
            if bad or value < low or (high is not None and value > high):
                shown = f"{low} to {high}" if high is not None else f"{low} or more"
                return f"{node}: {f.name}={value!r} is out of range; valid: {shown}"
        if blocks is not None and self.front_blocks + self.back_blocks >= blocks:
            return (f"{node}: front_blocks={self.front_blocks} + back_blocks={self.back_blocks} leave none of the "
                    f"model's {blocks} blocks to cache; valid: front_blocks >= 1 and front_blocks + back_blocks "
                    f"<= {blocks - 1}")
        return None

    def as_option(self) -> dict:
        return asdict(self)

    @classmethod
    def from_option(cls, value) -> "BlockCacheSettings | None":
        if not value:
            return None
        return cls(**{f.name: value[f.name] for f in fields(cls) if f.name in value})


@dataclass
class CacheRanks:
    """The ranks one decision spans and this rank's place among them (None / 1: unsharded)."""

    world_group: object = None
    world_size: int = 1
    rank: int = 0
    tp_group: object = None
    tp_size: int = 1
    tp_rank: int = 0
    stream_shard: Callable[[str], object] = lambda name: None  # stream name -> SeqShard of this forward


UNSHARDED = CacheRanks()


def stacks_of(plan: TransformerPlan) -> tuple[CachedBlocks, ...]:
    return plan.cached_blocks


def block_count(root: torch.nn.Module, plan: TransformerPlan) -> int:
    return sum(len(matching_modules(root, s.pattern)) for s in stacks_of(plan))


class _Run:
    """What one rank keeps of one sampling run (per model and per batch of conds)."""

    def __init__(self, schedule):
        self.schedule = schedule
        self.last_step = -1
        self.front: dict | None = None   # (stack, output) -> this rank's part of the last full step's Fn residual
        self.terms: dict = {}            # (stack, output) -> TaylorSeer terms of the middle residual (parts)
        self.terms_width: dict = {}      # (stack, output) -> the residual's whole width (channels)
        self.full_step = -1
        self.in_a_row = 0
        self.computed = 0
        self.cached = 0
        self.disagreements = 0


# module -> {batch key -> _Run}
_RUNS: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()
_SIGNATURES: dict[type, inspect.Signature] = {}
_last: dict = {}  # this process's last forward under Block Cache: {"cached": bool, "step": int}


def last_outcome() -> dict:
    """The last forward's outcome in this process (rank 0 reads it for the status), then cleared."""
    out = dict(_last)
    _last.clear()
    return out


def _step_of(options: dict, run: "_Run | None") -> tuple[int, object]:
    """(index of this step in its run, the run's schedule) from the forward's sigmas."""
    sigmas, schedule = options.get("sigmas"), options.get("sample_sigmas")
    if isinstance(sigmas, torch.Tensor) and isinstance(schedule, torch.Tensor) and sigmas.numel():
        sigma = float(sigmas.reshape(-1)[0])
        key = tuple(round(float(s), 6) for s in schedule.reshape(-1).tolist())
        return int((schedule.reshape(-1).float() > sigma * (1 + 1e-6) + 1e-9).sum()), key
    return (run.last_step + 1 if run is not None else 0), None


def _batch_key(options: dict, shapes) -> tuple:
    return tuple(options.get("cond_or_uncond") or ()), shapes


class _Forward:
    """One forward under Block Cache on this rank."""

    def __init__(self, root, plan: TransformerPlan, settings: BlockCacheSettings, options: dict, ranks: CacheRanks):
        self.plan, self.settings, self.ranks = plan, settings, ranks
        self.order: list[int] = []      # position -> stack index
        self.stack_of: dict[int, int] = {}
        self.modules = []
        for s, stack in enumerate(stacks_of(plan)):
            for _, mod in matching_modules(root, stack.pattern):
                self.order.append(s)
                self.stack_of[id(mod)] = s
                self.modules.append(mod)
        self.total = len(self.order)
        self.middle = range(settings.front_blocks, self.total - settings.back_blocks)
        # the last middle position of each stack: where a cached step adds that stack's residual
        self.last_middle = {}
        for pos in self.middle:
            self.last_middle[self.order[pos]] = pos
        self.options = options
        self.root = root
        self.calls = 0
        self.cache = None  # this step's decision, once taken
        self.measure = None  # this step's change measure (None: not measured)
        self.front: dict = {}
        self.acc: dict = {}
        self.run: _Run | None = None
        self.step = 0

    # ------------------------------------------------------------------ per block
    def call(self, mod, forward, args, kwargs):
        pos = self.calls
        self.calls += 1
        if pos >= self.total or self.order[pos] != self.stack_of[id(mod)]:
            raise RuntimeError(f"Block Cache: the {self.plan.title} plan lists its block stacks "
                               f"({', '.join(s.pattern for s in stacks_of(self.plan))}) in an order this model does "
                               f"not run them in (block call {pos + 1} of {self.total})")
        if pos == 0:
            self._begin(args)
        stack_index = self.order[pos]
        stack = stacks_of(self.plan)[stack_index]
        names, bound = self._streams_in(mod, stack, args, kwargs)
        if pos < self.settings.front_blocks:
            out = self._accumulated(self.front, stack_index, names, bound, forward, args, kwargs)
            if pos == self.settings.front_blocks - 1:
                self.cache = self._decide()
            return out
        if pos in self.middle and self.cache:
            ins = [_argument(bound, n) for n in names]
            if pos == self.last_middle[stack_index]:
                ins = [x + self._residual(stack_index, j).to(x.dtype) for j, x in enumerate(ins)]
            return tuple(ins) if stack.outputs else ins[0]
        if pos in self.middle:
            return self._accumulated(self.acc, stack_index, names, bound, forward, args, kwargs)
        return forward(*args, **kwargs)

    def _streams_in(self, mod, stack: CachedBlocks, args, kwargs):
        cls = type(mod)
        sig = _SIGNATURES.get(cls)
        if sig is None:
            sig = _SIGNATURES[cls] = inspect.signature(cls.forward)
        bound = sig.bind(mod, *args, **kwargs)
        names = list(stack.outputs) or [list(sig.parameters)[1]]
        return names, bound

    @staticmethod
    def _accumulated(into: dict, stack_index: int, names, bound, forward, args, kwargs):
        """Run the block and add what it added to each of its streams to ``into``: the sum of
        (output - input) over blocks, so that what the model adds between blocks is not counted."""
        for j, n in enumerate(names):
            x = _argument(bound, n)
            key = (stack_index, j)
            into[key] = -x if key not in into else into[key].sub_(x)
        out = forward(*args, **kwargs)
        outs = out if isinstance(out, tuple) else (out,)
        if len(outs) != len(names):
            raise RuntimeError(f"Block Cache: a block returned {len(outs)} outputs where its plan declares "
                               f"{len(names)} ({', '.join(map(_shown, names))})")
        for j, y in enumerate(outs):
            into[(stack_index, j)].add_(y)
        return out

    # ------------------------------------------------------------------ the decision
    def _begin(self, args) -> None:
        items = [b for a in args for b in (a if isinstance(a, (tuple, list)) else (a,))]  # LTX-2's (vx, ax)
        shapes = tuple(tuple(a.shape) for a in items if isinstance(a, torch.Tensor))
        runs = _RUNS.setdefault(self.root, {})
        key = _batch_key(self.options, shapes)
        run = runs.get(key)
        step, schedule = _step_of(self.options, run)
        if run is None or step == 0 or step <= run.last_step or schedule != run.schedule:
            run = runs[key] = _Run(schedule)
        run.last_step = step
        self.run, self.step = run, step

    def _mask(self, stack_index: int, j: int, t: torch.Tensor):
        """1 for this rank's real tokens of output ``j``, 0 for the padding of its chunk (None: all real)."""
        stack = stacks_of(self.plan)[stack_index]
        streams = stack.streams[j]
        shards = [self.ranks.stream_shard(s) for s in ((streams,) if isinstance(streams, str) else streams)]
        if any(s is None for s in shards):
            return None
        mask = torch.cat([torch.arange(s.local) < s.valid for s in shards])
        if mask.numel() != t.shape[stack.dim]:
            raise RuntimeError(f"Block Cache: the {self.plan.title} plan says a block output holds the streams "
                               f"{streams}: {mask.numel()} tokens here, the output has {t.shape[stack.dim]}")
        shape = [1] * t.ndim
        shape[stack.dim] = -1
        return None if bool(mask.all()) else mask.to(t.device).view(shape)

    def _part(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the channels under TP (the whole tensor otherwise)."""
        if self.ranks.tp_size == 1:
            return t
        width = -(-t.shape[-1] // self.ranks.tp_size)
        lo = min(self.ranks.tp_rank * width, t.shape[-1])
        return t[..., lo:min(lo + width, t.shape[-1])]

    def _whole(self, part: torch.Tensor, like_width: int) -> torch.Tensor:
        """The TP ranks' slices put back together (all-gather over the TP group)."""
        if self.ranks.tp_size == 1:
            return part
        n = self.ranks.tp_size
        width = -(-like_width // n)
        padded = torch.nn.functional.pad(part, (0, width - part.shape[-1])).contiguous()
        out = padded.new_empty((n * padded.numel(),))
        comm.all_gather_into(out, padded.reshape(-1), group=self.ranks.tp_group)
        whole = out.view(n, *padded.shape).movedim(0, -2).reshape(*padded.shape[:-1], n * width)
        return whole[..., :like_width]

    def _measure_sums(self) -> tuple[float, float, float]:
        """(sum |r - r_last|, sum |r_last|, 1 if this rank has no last residual) over its own part."""
        last = self.run.front
        if last is None or set(last) != set(self.front):
            return 0.0, 0.0, 1.0
        diff = ref = 0.0
        for key, r in self.front.items():
            mask = self._mask(*key, r)
            cur, prev = self._part(r).double(), last[key].double()
            if cur.shape != prev.shape:
                return 0.0, 0.0, 1.0
            d, p = (cur - prev).abs(), prev.abs()
            if mask is not None:
                d, p = d * mask, p * mask
            diff += float(d.sum())
            ref += float(p.sum())
        return diff, ref, 0.0

    def _decide(self) -> bool:
        s, run = self.settings, self.run
        if self.step < max(s.warmup_steps, 1):
            return False  # every rank knows it from the step alone: no collective
        sums = torch.tensor(self._measure_sums(), dtype=torch.float64)
        if self.ranks.world_size > 1:
            comm.all_reduce(sums, group=self.ranks.world_group)
        diff, ref, missing = sums.tolist()
        measure = diff / ref if ref > 0 else math.inf
        self.measure = measure
        skew = float(os.environ.get(SKEW_ENV, "0") or 0)
        if skew:
            measure *= (1 + skew) if self.ranks.rank % 2 == 0 else (1 - skew)
        capped = s.max_cached_steps and run.in_a_row >= s.max_cached_steps
        wish = bool(missing == 0 and not capped and measure < s.threshold)
        if self.ranks.world_size == 1:
            return wish
        if skew:  # the test counts the steps where the ranks' own wishes differed
            wishes = torch.tensor([float(wish)], dtype=torch.float64)
            comm.all_reduce(wishes, group=self.ranks.world_group)
            if 0 < wishes.item() < self.ranks.world_size:
                run.disagreements += 1
        if os.environ.get(LOCAL_ENV, "") not in ("", "0"):
            return wish
        decision = torch.tensor([int(wish)], dtype=torch.uint8)
        comm.broadcast(decision, src=0, group=self.ranks.world_group)
        return bool(decision.item())

    # ------------------------------------------------------------------ the cached residual
    def _residual(self, stack_index: int, j: int) -> torch.Tensor:
        terms = self.run.terms[(stack_index, j)]
        k = self.step - self.run.full_step
        part = terms[0]
        for i, d in enumerate(terms[1:], start=1):
            part = part + d * (k ** i / math.factorial(i))
        return self._whole(part, self.run.terms_width[(stack_index, j)])

    def finish(self) -> None:
        if self.calls == 0:
            return
        if self.calls != self.total:
            raise RuntimeError(f"Block Cache: the {self.plan.title} plan's stacks hold {self.total} blocks and this "
                               f"forward ran {self.calls} of them; Block Cache cannot tell which to skip")
        run = self.run
        if self.cache:
            run.in_a_row += 1
            run.cached += 1
        else:
            run.front = {key: self._part(r).clone() for key, r in self.front.items()}
            widths = {}
            terms = {}
            gap = self.step - run.full_step
            for key, r in self.acc.items():
                new = [self._part(r).clone()]
                old = run.terms.get(key)
                for i in range(self.settings.taylor_order):
                    if old is None or len(old) <= i or run.full_step < 0 or gap <= 0 or old[i].shape != new[i].shape:
                        break
                    new.append((new[i] - old[i]) / gap)
                terms[key] = new
                widths[key] = r.shape[-1]
            run.terms, run.terms_width = terms, widths
            run.full_step = self.step
            run.in_a_row = 0
            run.computed += 1
        _last.clear()
        _last.update(cached=bool(self.cache), step=self.step, measure=self.measure, computed_steps=run.computed, cached_steps=run.cached,
                     disagreements=run.disagreements)


@contextlib.contextmanager
def cached_blocks(root: torch.nn.Module, plan: TransformerPlan, options: dict | None,
                  ranks: CacheRanks = UNSHARDED):
    """For one forward of ``root``: Block Cache as ``options[OPTION]`` asks (nothing when absent)."""
    settings = BlockCacheSettings.from_option((options or {}).get(OPTION))
    if settings is None:
        yield
        return
    if not stacks_of(plan):
        raise RuntimeError(f"Block Cache: the {plan.title} plan declares no block stacks to cache")
    forward = _Forward(root, plan, settings, options, ranks)
    swapped = []
    try:
        for mod in forward.modules:
            had = mod.__dict__.get("forward")
            inner = mod.forward
            mod.__dict__["forward"] = _caller(forward, mod, inner)
            swapped.append((mod, had))
        yield
        forward.finish()
    finally:
        for mod, had in swapped:
            if had is None:
                mod.__dict__.pop("forward", None)
            else:
                mod.__dict__["forward"] = had


def _argument(bound: inspect.BoundArguments, name):
    """The block's input that an output updates: an argument, or ``(argument, index)``: an element of
    a tuple argument."""
    if isinstance(name, tuple):
        return bound.arguments[name[0]][name[1]]
    return bound.arguments[name]


def _shown(name) -> str:
    return f"{name[0]}[{name[1]}]" if isinstance(name, tuple) else name


def _caller(forward: _Forward, mod, inner):
    def call(*args, **kwargs):
        return forward.call(mod, inner, args, kwargs)
    return call
