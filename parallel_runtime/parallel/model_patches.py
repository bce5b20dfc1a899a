"""Model patches on every rank: applying ``plans/patches.py`` to one sharded forward.

Rank 0 turns each patch object in ``transformer_options["patches"]`` into plain data (``encode``):
its class, the attributes that travel with the forward, the answers of what stays on rank 0, and
the index of each model it holds in the call's list of patch models (which the workers receive
once, like the transformer). Every rank, rank 0 included, then rebuilds the same patch from that
data for the forward (``running``) and calls it through a stand-in that applies its declaration:
``local`` patches get their token-covering tensors cut like the stream they cover; ``whole`` patches
see the whole sequence (the streams the model plan's ``PatchSite`` names, gathered), and each rank
keeps its own chunk of what they change. Under tensor parallelism alone every rank holds the whole
tokens and runs the patch as it is.
"""
from __future__ import annotations

import contextlib
import logging

import torch

from .sequence import gather_chunks, take_chunk
from ..comfyui_modules import import_module
from ..plans import user
from ..plans.base import ModelPlan, PatchSite
from ..plans.patches import PatchPlan, PatchRefused, class_name, declared_text, patch_plan_named

log = logging.getLogger("parallel")

PATCHES = "patches"
REPLACES = "patches_replace"
MARK = "__model_patch__"  # a dict with this key is an encoded patch (plain data, every rank reads it)


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
    file's (``PATCH_PLANS``, plans/user.py)."""
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


def _check(plan: ModelPlan, spec: PatchPlan | None, kind: str, hook: str, key, patch) -> PatchPlan:
    if spec is None:
        raise PatchRefused(
            f"{plan.title}: a node set a model patch of class {_describe(patch)} on {_where(kind, hook)}; the pack "
            "does not know how to run that class on every rank, and it would change rank 0's part only. Remove that "
            f"node (or run without Shard Transformer), or declare it in a plan file (docs/model_patches.md). Model "
            f"patches the pack runs sharded: {declared_text()}")
    if kind == PATCHES and (hook not in spec.hooks or hook not in plan.context_parallel.patch_sites):
        raise PatchRefused(f"{spec.title} is set on {_where(kind, hook)} of {plan.title}, where the pack does not "
                           "know how the model hands it its tokens; run without Shard Transformer")
    if kind == REPLACES and (hook != "dit" or not isinstance(key, tuple) or key[0] not in spec.replaces):
        raise PatchRefused(f"{spec.title} replaces {key!r} in {_where(kind, hook)} of {plan.title}; its declaration "
                           f"replaces {', '.join(spec.replaces) or 'no blocks'} of 'dit'")
    return spec


def refuse_unknown(options: dict | None, plan: ModelPlan) -> None:
    """Refuse, naming its class, a model patch in ``options["patches"]`` or ``["patches_replace"]``
    that the pack cannot run on every rank: the one check Shard Transformer makes on the model it is
    given and every forward makes."""
    for kind, hook, key, patch in _slots(options):
        _check(plan, declaration(class_name(patch)), kind, hook, key, patch)


def encode(options: dict | None, plan: ModelPlan, x) -> tuple[dict | None, list[torch.nn.Module]]:
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
    encoded = {kind: {hook: ({} if isinstance(entries, dict) else [None] * len(entries))
                      for hook, entries in (options.get(kind) or {}).items()} for kind in (PATCHES, REPLACES)}
    for kind, hook, key, patch in slots:
        number = objects.get(id(patch))
        if number is None:
            number = objects[id(patch)] = len(objects)
            data = {**_encode_one(patch, x, models), "object": number}
        else:  # the same object again (Z-Image's patch: on the noise refiner and the main layers)
            data = {MARK: class_name(patch), "object": number}
        encoded[kind][hook][key] = data
    return {**options, **{kind: value for kind, value in encoded.items() if kind in options}}, models


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


def _rebuild(data: dict, spec: PatchPlan, models: list[torch.nn.Module]):
    module_name, qualname = data["class"]
    cls = import_module(module_name)
    for part in qualname.split("."):
        cls = getattr(cls, part)
    obj = cls.__new__(cls)  # as rank 0's object is, without running the constructor (it encodes images)
    obj.__dict__.update(data["state"])
    for attr, index in data["models"].items():
        setattr(obj, attr, HeldModel(models[index]))
    for attr, answers in data["left"].items():
        setattr(obj, attr, LeftOnRankZero(spec.title, attr, answers))
    return obj


@contextlib.contextmanager
def running(plan: ModelPlan, options: dict | None, models: list[torch.nn.Module], ctx):
    """For one forward on this rank: the encoded patches in ``options`` become callables that run
    the patch under its declaration (``ctx``: the context-parallel forward, its streams and group)."""
    slots = list(_slots(options))
    if not slots:
        yield
        return
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
            rebuilt[number] = (Rebuilt(_rebuild(whole, spec, models)), spec)
        done, spec = rebuilt[number]
        if kind == PATCHES:
            live[kind][hook][key] = ShardedPatch(done, spec, plan.context_parallel.patch_sites[hook], ctx)
        else:
            live[kind][hook][key] = ShardedReplace(done)
    options.update(live)
    try:
        yield
    finally:
        options.update(original)


class ShardedReplace:
    """A block replacement (``patches_replace``) during one forward: called as ComfyUI calls it, with
    the block's arguments and ``original_block``; the block's own hooks cut and gather the tokens."""

    def __init__(self, rebuilt: "Rebuilt"):
        self.rebuilt = rebuilt

    def __call__(self, args, extra):
        return self.rebuilt.patch(args, extra)


class Rebuilt:
    """A patch object as this rank runs it for one forward (shared by the hooks it is set on)."""

    def __init__(self, patch):
        self.patch = patch
        self.cut = False


class ShardedPatch:
    """One patch's calls on one hook during one forward on one rank."""

    def __init__(self, rebuilt: Rebuilt, spec: PatchPlan, site: PatchSite, ctx):
        self.rebuilt, self.spec, self.site, self.ctx = rebuilt, spec, site, ctx

    @property
    def patch(self):
        return self.rebuilt.patch

    def __call__(self, kwargs: dict):
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
