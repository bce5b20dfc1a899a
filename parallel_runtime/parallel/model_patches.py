"""Model patches on every rank: applying their declarations (``plans/model_patches.py``) to one sharded forward.

Rank 0 turns each patch object in ``transformer_options["patches"]`` into plain data (``encode``):
its class, the attributes that travel with the forward, the answers of what stays on rank 0, and
the index of each model it holds in the call's list of patch models (which the workers receive
once, like the transformer). Every rank, rank 0 included, then rebuilds the same patch from that
data for the forward (``running``) and calls it through a stand-in that applies its declaration:
``local`` patches get their token-covering tensors cut like the stream they cover; ``whole`` patches
see the whole sequence (the streams the model plan's ``PatchSite`` names, gathered), and each rank
keeps its own chunk of what they change. Under tensor parallelism alone every rank holds the whole
tokens and runs the patch as it is.

A patch may keep state from one forward to the next (ComfyUI keeps the object across steps and
prompts): after each forward rank 0's own object receives the state its declaration lists, as the
forward left it (``_carry``), so the next forward starts where the unsharded one would; any other
change of the patch during a forward, or state that no rank holds whole, refuses it by name.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging

import torch

from .cfg import BatchSplit, map_tensors
from .sequence import gather_chunks, take_chunk
from ..distributed import comm
from ..comfyui_modules import import_module
from ..plans import declared_patches_text, patch_plan_named
from ..plans.vocabulary import user
from ..plans.vocabulary.context_parallel import PatchSite
from ..plans.vocabulary.patches import PatchPlan, PatchRefused, class_name
from ..plans.vocabulary.transformer import TransformerPlan

log = logging.getLogger("parallel")

PATCHES = "patches"
REPLACES = "patches_replace"
MARK = "__model_patch__"  # a dict with this key is an encoded patch (plain data, every rank reads it)
# Rank 0's options only (world/protocol.py keeps it from the workers): object number -> ComfyUI's
# patch object, which receives the state each forward leaves.
ORIGINS = "model_patch_origins"


class HeldModel:
    """Stands in for a patch's ComfyUI ModelPatcher on the ranks: the patch reads ``.model``."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def models(self):
        return []


class LeftOnRankZero:
    """Stands in for what a patch keeps on rank 0 (its VAE): the zero-argument queries declared for
    it answer as rank 0's object did; anything else says why it is not here."""

    def __init__(self, title: str, name: str, answers: dict):
        self._title, self._name, self._answers = title, name, answers

    def __getattr__(self, attr):
        if attr.startswith("_"):
            raise AttributeError(attr)
        if attr in self._answers:
            return lambda: self._answers[attr]
        raise PatchRefused(f"{self._title}: its '{self._name}' stays on rank 0, and the patch asked it for '{attr}' "
                           "inside the sharded forward; run this patch without Shard Transformer")


def _qualified(obj) -> str:
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _describe(obj) -> str:
    """A patch's class, or a function's own name (a node may set a plain function as a patch)."""
    if hasattr(obj, "__code__") or isinstance(obj, type(len)):
        return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', '?')}"
    return _qualified(obj)


def declaration(name: str) -> PatchPlan | None:
    """The declaration for the patch class of qualified name ``name``: the pack's, or a user plan
    file's (``PATCH_PLANS``, plans/vocabulary/user.py)."""
    return patch_plan_named(name) or user.patch_plan(name)


def _where(kind: str, hook: str) -> str:
    return f"transformer_options['{kind}']['{hook}']"


def _slots(options: dict | None):
    """(kind, hook, key, patch) for every patch of ``options``: ``patches[hook][key]`` (a list) and
    ``patches_replace[hook][key]`` (a dict keyed by ``(block kind, index)``)."""
    for kind in (PATCHES, REPLACES):
        for hook, entries in ((options or {}).get(kind) or {}).items():
            for key, patch in (entries.items() if isinstance(entries, dict) else enumerate(entries)):
                yield kind, hook, key, patch


def _check(plan: TransformerPlan, spec: PatchPlan | None, kind: str, hook: str, key, patch) -> PatchPlan:
    if spec is None:
        raise PatchRefused(
            f"{plan.title}: a node set a model patch of class {_describe(patch)} on {_where(kind, hook)}; the pack "
            "does not know how to run that class on every rank, and it would change rank 0's part only. Remove that "
            f"node (or run without Shard Transformer), or declare it in a plan file (docs/model_patches.md). Model "
            f"patches the pack runs sharded: {declared_patches_text()}")
    if kind == PATCHES and (hook not in spec.hooks or hook not in plan.context_parallel.patch_sites):
        raise PatchRefused(f"{spec.title} is set on {_where(kind, hook)} of {plan.title}, where the pack does not "
                           "know how the model hands it its tokens; run without Shard Transformer")
    if kind == REPLACES and (hook != "dit" or not isinstance(key, tuple) or key[0] not in spec.replaces):
        raise PatchRefused(f"{spec.title} replaces {key!r} in {_where(kind, hook)} of {plan.title}; its declaration "
                           f"replaces {', '.join(spec.replaces) or 'no blocks'} of 'dit'")
    return spec


def refuse_unknown(options: dict | None, plan: TransformerPlan) -> None:
    """Refuse, naming its class, a model patch in ``options["patches"]`` or ``["patches_replace"]``
    that the pack cannot run on every rank: the one check Shard Transformer makes on the model it is
    given and every forward makes."""
    for kind, hook, key, patch in _slots(options):
        _check(plan, declaration(class_name(patch)), kind, hook, key, patch)


def encode(options: dict | None, plan: TransformerPlan, x) -> tuple[dict | None, list[torch.nn.Module]]:
    """Rank 0, before a forward: ``options`` with each patch replaced by its plain-data form (a new
    dict; ComfyUI's stays as it is), and the patch models the call needs. ``x``: the model's input
    latent (a patch's ``prepare`` reads its size). Refuses, naming the class, a patch with no
    declaration, or one where its declaration or the model plan does not say how it runs."""
    slots = list(_slots(options))
    if not slots:
        return options, []
    refuse_unknown(options, plan)
    models: list[torch.nn.Module] = []
    objects: dict[int, int] = {}  # id(patch) -> its number: one object set on several hooks stays one
    origins: dict[int, object] = {}
    encoded = {kind: {hook: ({} if isinstance(entries, dict) else [None] * len(entries))
                      for hook, entries in (options.get(kind) or {}).items()} for kind in (PATCHES, REPLACES)}
    for kind, hook, key, patch in slots:
        number = objects.get(id(patch))
        if number is None:
            number = objects[id(patch)] = len(objects)
            origins[number] = patch
            data = {**_encode_one(patch, x, models), "object": number}
        else:  # the same object again (Z-Image's patch: on the noise refiner and the main layers)
            data = {MARK: class_name(patch), "object": number}
        encoded[kind][hook][key] = data
    return {**options, **{kind: value for kind, value in encoded.items() if kind in options}, ORIGINS: origins}, models


def _encode_one(patch, x, models: list) -> dict:
    spec = declaration(class_name(patch))
    if spec.prepare is not None and x is not None:
        spec.prepare(patch, x)
    state = dict(vars(patch))
    held = {}
    for attr in spec.models:
        module = getattr(state.pop(attr, None), "model", None)
        if not isinstance(module, torch.nn.Module):
            raise PatchRefused(f"{spec.title}: its '{attr}' holds no model")
        if not any(module is m for m in models):
            models.append(module)
        held[attr] = next(i for i, m in enumerate(models) if m is module)
    left = {}
    for attr, queries in spec.left.items():
        value = state.pop(attr, None)
        left[attr] = {q: getattr(value, q)() for q in queries} if value is not None else {}
    cls = type(patch)
    # The class by the name its declaration matches (every rank looks the declaration up) and by the
    # module name this process imported it under (a path, for ComfyUI's extras and custom packs).
    return {MARK: class_name(patch), "class": (cls.__module__, cls.__qualname__), "plan": spec.source,
            "state": state, "models": held, "left": left}


def _rebuild(data: dict, spec: PatchPlan, models: list[torch.nn.Module], split: BatchSplit | None):
    module_name, qualname = data["class"]
    cls = import_module(module_name)
    for part in qualname.split("."):
        cls = getattr(cls, part)
    obj = cls.__new__(cls)  # as rank 0's object is, without running the constructor (it encodes images)
    obj.__dict__.update(data["state"])
    if split is not None and split.parts > 1:  # this CFG group's rows of the state kept for the whole batch
        for attr in spec.state:
            if attr in data["state"]:
                setattr(obj, attr, map_tensors(data["state"][attr], lambda t: t[split.rows]
                                                if t.ndim and t.shape[0] == split.size else t))
    for attr, index in data["models"].items():
        setattr(obj, attr, HeldModel(models[index]))
    for attr, answers in data["left"].items():
        setattr(obj, attr, LeftOnRankZero(spec.title, attr, answers))
    return obj


@contextlib.contextmanager
def running(plan: TransformerPlan, options: dict | None, models: list[torch.nn.Module], ctx,
            batch: tuple[BatchSplit, object] | None = None):
    """For one forward on this rank: the encoded patches in ``options`` become callables that run
    the patch under its declaration (``ctx``: the context-parallel forward, its streams and group;
    ``batch``: the CFG split of the forward and the CFG group). After the forward, the state the
    patches keep goes back to rank 0's objects (``_carry``)."""
    slots = list(_slots(options))
    if not slots:
        yield
        return
    split, cfg_group = batch or (None, None)
    origins = options.get(ORIGINS)  # rank 0 only
    original = {kind: options[kind] for kind in (PATCHES, REPLACES) if kind in options}
    live = {kind: {hook: ({} if isinstance(entries, dict) else [None] * len(entries))
                   for hook, entries in value.items()} for kind, value in original.items()}
    first = {data["object"]: data for _, _, _, data in slots if "state" in data}
    rebuilt: dict[int, tuple[Rebuilt, PatchPlan]] = {}
    for kind, hook, key, data in slots:
        number = data["object"]
        if number not in rebuilt:
            whole = first[number]
            spec = (user.patch_plan_from_wire(whole[MARK], whole["plan"]) if whole["plan"] is not None
                    else patch_plan_named(whole[MARK]))
            rebuilt[number] = (Rebuilt(_rebuild(whole, spec, models, split), number, whole[MARK], spec,
                                       judge=origins is not None), spec)
        done, spec = rebuilt[number]
        if kind == PATCHES:
            live[kind][hook][key] = ShardedPatch(done, spec, plan.context_parallel.patch_sites[hook], ctx)
        else:
            live[kind][hook][key] = ShardedReplace(done)
    options.update(live)
    try:
        yield
        _carry([done for done, _ in rebuilt.values()], origins, ctx, split, cfg_group)
    finally:
        options.update(original)


class ShardedReplace:
    """A block replacement (``patches_replace``) during one forward: called as ComfyUI calls it, with
    the block's arguments and ``original_block``; the block's own hooks cut and gather the tokens."""

    def __init__(self, rebuilt: "Rebuilt"):
        self.rebuilt = rebuilt

    def __call__(self, args, extra):
        self.rebuilt.called(args)
        return self.rebuilt.patch(args, extra)


class Rebuilt:
    """A patch object as this rank runs it for one forward (shared by the hooks it is set on), and
    what it was built with, to tell after the forward what the forward changed."""

    def __init__(self, patch, number: int, name: str, spec: PatchPlan, judge: bool):
        self.patch, self.number, self.name, self.spec = patch, number, name, spec
        self.cut = False
        self.device = None  # where its first call's tensors were (None: not called in this forward)
        # Rank 0 judges the changes: each attribute's value and form as the forward starts (not those
        # the pack itself sets in place of what stays on rank 0 or is cut).
        self.ours = set(spec.models) | set(spec.left) | {c.arg for c in spec.cut}
        self.before = {attr: (value, _fingerprint(value)) for attr, value in vars(patch).items()
                       if attr not in self.ours} if judge else {}

    def called(self, kwargs) -> None:
        if self.device is None:
            self.device = next((v.device for v in (kwargs.values() if isinstance(kwargs, dict) else ())
                                if isinstance(v, torch.Tensor)), None)

    def changed(self) -> list[str]:
        """The attributes this forward set, removed, added or changed in place (rank 0)."""
        now = {attr: value for attr, value in vars(self.patch).items() if attr not in self.ours}
        names = [attr for attr in now if attr not in self.before]
        for attr, (value, print_) in self.before.items():
            if attr not in now or now[attr] is not value or not _same_fingerprint(_fingerprint(value), print_):
                names.append(attr)
        return names


class ShardedPatch:
    """One patch's calls on one hook during one forward on one rank."""

    def __init__(self, rebuilt: Rebuilt, spec: PatchPlan, site: PatchSite, ctx):
        self.rebuilt, self.spec, self.site, self.ctx = rebuilt, spec, site, ctx

    @property
    def patch(self):
        return self.rebuilt.patch

    def __call__(self, kwargs: dict):
        self.rebuilt.called(kwargs)
        ctx = self.ctx
        if ctx is None or ctx.parts == 1 or self.site.before_split:
            return self.patch(kwargs)
        if self.spec.tokens == "local":
            self._cut_once()
            return self.patch(kwargs)
        return self._whole(kwargs)

    def _cut_once(self) -> None:
        if self.rebuilt.cut:
            return
        for spec in self.spec.cut:
            value = getattr(self.patch, spec.arg, None)
            if isinstance(value, torch.Tensor):
                setattr(self.patch, spec.arg, self.ctx.split(value, spec, f"model patch {self.spec.title}"))
        self.rebuilt.cut = True

    def _whole(self, kwargs: dict):
        ctx, site = self.ctx, self.site
        group = ctx.sp_group
        full = dict(kwargs)
        mine: dict[str, tuple] = {}  # keyword -> (its local tensor, its stream)
        for key, stream in site.tokens.items():
            if isinstance(kwargs.get(key), torch.Tensor):
                shard = ctx.streams[stream]
                mine[key] = (kwargs[key], shard)
                full[key] = gather_chunks(kwargs[key], 1, shard, group)
        joint = None
        if site.joint:
            parts = [kwargs[k] for k in site.joint]
            shard = ctx.streams[site.joint_stream]
            whole = gather_chunks(torch.cat(parts, dim=1), 1, shard, group)
            cuts = _joint_cuts(site, kwargs, whole.shape[1])
            for key, (start, stop) in zip(site.joint, cuts):
                full[key] = whole[:, start:stop]
            joint = (parts, shard)
        sent = dict(full)  # a patch may pop what it changes in place (Z-Image's pops img and txt)
        out = self.patch(full)
        result = out if isinstance(out, dict) else full
        for key, (local, shard) in mine.items():
            local.copy_(take_chunk(result.get(key, sent[key]), 1, shard))
            if key in result:
                result[key] = local
        if joint is not None:
            parts, shard = joint
            changed = torch.cat([result.get(k, sent[k]) for k in site.joint], dim=1)
            chunk = take_chunk(changed, 1, shard)
            for key, part, piece in zip(site.joint, parts, torch.split(chunk, [p.shape[1] for p in parts], dim=1)):
                part.copy_(piece)
                if key in result:
                    result[key] = part
        return out


def _joint_cuts(site: PatchSite, kwargs: dict, total: int) -> list[tuple[int, int]]:
    """The global (start, stop) of each joint keyword along the whole stream (two keywords: cut at
    ``joint_at``)."""
    if len(site.joint) != 2 or site.joint_at is None:
        raise ValueError("PatchSite.joint takes two keywords and joint_at")
    at = site.joint_at(kwargs, total)
    return [(0, at), (at, total)]


# ---------------------------------------------------------------- state kept between forwards
def _carry(done: list[Rebuilt], origins: dict | None, ctx, split: BatchSplit | None, cfg_group) -> None:
    """After a forward, on every rank: the declared state of each patch the forward called, whole
    again under CFG (a collective of the CFG group, so every rank takes part alike); then rank 0
    refuses a patch whose change cannot be carried and gives the state to ComfyUI's object."""
    results = []
    for rebuilt in done:
        if rebuilt.device is None:  # not called: nothing changed
            continue
        state = {attr: rebuilt.patch.__dict__.get(attr) for attr in rebuilt.spec.state}
        agree = True
        if split is not None and split.parts > 1 and state:
            state, agree = _whole_batch(state, split, cfg_group, rebuilt.device)
        results.append((rebuilt, state, agree))
    if origins is None:  # a worker: rank 0 judges, and keeps the state
        return
    for rebuilt, state, agree in results:
        _judge(rebuilt, agree, ctx)
        for attr, value in state.items():
            setattr(origins[rebuilt.number], attr, value)


def _judge(rebuilt: Rebuilt, agree: bool, ctx) -> None:
    """Refuse, naming the class, a patch whose forward changed what the ranks cannot carry."""
    spec, changed = rebuilt.spec, rebuilt.changed()
    what = f"{spec.title} ({rebuilt.name})"
    undeclared = [attr for attr in changed if attr not in spec.state]
    if undeclared:
        raise PatchRefused(
            f"{what} changed its {_names(undeclared)} during a sharded forward, and its declaration does not list "
            f"{'it' if len(undeclared) == 1 else 'them'} among the state the class keeps between calls: ComfyUI would "
            "start the next forward from the changed value, the ranks from the value before. Add it to the patch "
            f"plan's state=(...) (docs/model_patches.md), or run this patch without Shard Transformer")
    kept = [attr for attr in changed if attr in spec.state]
    if kept and spec.tokens == "local" and ctx is not None and ctx.parts > 1:
        raise PatchRefused(
            f"{what} keeps its {_names(kept)} between forwards, and under a sequence split (Ulysses, Ring) each "
            "rank runs it on its own tokens only, so no rank holds the state ComfyUI would: it cannot be carried. "
            "Run it with CFG or tensor parallelism only, or without Shard Transformer")
    for attr in kept:
        odd = _unsendable(rebuilt.patch.__dict__.get(attr))
        if odd is not None:
            raise PatchRefused(
                f"{what}: its '{attr}' holds a {odd} after the forward, which cannot be sent to the other ranks with "
                "the next forward (tensors, numbers, strings and lists, tuples, dicts of them can); run this patch "
                "without Shard Transformer")
    if not agree:
        raise PatchRefused(
            f"{what}: the CFG groups ended the forward with its {_names(spec.state)} in different forms, which "
            "cannot be put together as ComfyUI would hold it; run it with cfg_size 1, or without Shard Transformer")


def _names(attrs) -> str:
    return ", ".join(f"'{a}'" for a in attrs)


def _whole_batch(state: dict, split: BatchSplit, group, device) -> tuple[dict, bool]:
    """The CFG groups' state put together (every rank of the CFG group calls this alike): a tensor
    whose first dimension is a group's share of the batch is concatenated in group order where the
    groups' values differ, and kept once where they agree (state the batch shares, such as an
    encoded control video). False: the groups' state differs in form, and stays as it is."""
    tensors: list[torch.Tensor] = []
    form = _form(state, tensors, ids=False)
    digest = torch.tensor([int.from_bytes(hashlib.sha256(form.encode()).digest()[:7], "big")], device=device)
    forms = digest.new_empty(split.parts)
    comm.all_gather_into(forms, digest, group=group)
    if not bool((forms == forms[0]).all()):
        return state, False
    rows = split.size // split.parts
    whole: dict[int, torch.Tensor] = {}
    for t in tensors:
        if t.ndim and t.shape[0] == rows and id(t) not in whole:
            full = torch.empty((split.size, *t.shape[1:]), dtype=t.dtype, device=device)
            comm.all_gather_into(full, t.to(device).contiguous(), group=group)
            parts = full.chunk(split.parts)
            whole[id(t)] = t if all(torch.equal(p, parts[0]) for p in parts[1:]) else full.to(t.device)
    return {attr: map_tensors(value, lambda t: whole.get(id(t), t)) for attr, value in state.items()}, True


def _form(value, tensors: list, ids: bool) -> str:
    """``value``'s form as text, its tensors collected in ``tensors``: containers and plain values as
    they are, tensors by shape and dtype, other objects by class; ``ids``: tensors and objects by
    identity too (within one process)."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return f"T{tuple(value.shape)}{value.dtype}" + (f"@{id(value)}" if ids else "")
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__}({','.join(_form(v, tensors, ids) for v in value)})"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k!r}:{_form(v, tensors, ids)}" for k, v in value.items()) + "}"
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return repr(value)
    return type(value).__qualname__ + (f"@{id(value)}" if ids else "")


def _unsendable(value) -> str | None:
    """The class of the first object in ``value`` that is no tensor, plain value or container."""
    if isinstance(value, (list, tuple)):
        return next((odd for odd in map(_unsendable, value) if odd is not None), None)
    if isinstance(value, dict):
        return next((odd for odd in map(_unsendable, (*value.keys(), *value.values())) if odd is not None), None)
    if value is None or isinstance(value, (torch.Tensor, bool, int, float, complex, str, bytes)):
        return None
    return f"{type(value).__module__}.{type(value).__qualname__}"


def _fingerprint(value) -> tuple[str, list]:
    """What tells whether ``value`` changed, in place too: its form with identities, and the sum and
    sum of squares of each tensor (on its device; compared once the forward is done)."""
    tensors: list[torch.Tensor] = []
    form = _form(value, tensors, ids=True)
    sums = []
    for t in tensors:
        data = t.detach()
        if data.is_complex() or data.dtype == torch.bool:
            data = torch.view_as_real(data) if data.is_complex() else data.to(torch.uint8)
        sums.append(torch.stack([data.sum(dtype=torch.float64), data.pow(2).sum(dtype=torch.float64)]))
    return form, sums


def _same_fingerprint(a: tuple[str, list], b: tuple[str, list]) -> bool:
    if a[0] != b[0] or len(a[1]) != len(b[1]):
        return False
    return all(bool(((x == y) | (x.isnan() & y.isnan())).all()) for x, y in zip(a[1], b[1]))
