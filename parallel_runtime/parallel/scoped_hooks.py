"""Forward hooks for the length of one sharded forward, behind one permanent hook per module.

The plans cut inputs, gather outputs and run collectives from forward hooks that live for
one forward. Registered and removed per forward, they would be new objects at every step,
and a compiled region (compile_regions.py) that calls such a module would then compile
again at every step, or, where torch skips its hook guards, replay the first step's hooks.
So each hooked module carries one dispatcher per kind, registered the first time and never
changed, which torch runs outside any compiled graph and which calls the hooks active for
this forward, in the order they were added. Outside a sharded forward none is active and
the dispatchers pass everything through.
"""
from __future__ import annotations

import torch

_ACTIVE: dict[tuple[int, str], list] = {}  # (id(module), kind) -> [(hook, with_kwargs)]


@torch._dynamo.disable
def dispatch_pre(module, args, kwargs):
    for hook, with_kwargs in tuple(_ACTIVE.get((id(module), "pre"), ())):
        if with_kwargs:
            result = hook(module, args, kwargs)
            if result is not None:
                args, kwargs = result
        else:
            result = hook(module, args)
            if result is not None:
                args = result if isinstance(result, tuple) else (result,)
    return args, kwargs


@torch._dynamo.disable
def dispatch_post(module, args, output):
    for hook, _ in tuple(_ACTIVE.get((id(module), "post"), ())):
        result = hook(module, args, output)
        if result is not None:
            output = result
    return output


class ScopedHandle:
    def __init__(self, key: tuple[int, str], entry):
        self.key = key
        self.entry = entry

    def remove(self) -> None:
        hooks = _ACTIVE.get(self.key)
        if hooks is None:
            return
        hooks[:] = [e for e in hooks if e is not self.entry]
        if not hooks:
            del _ACTIVE[self.key]


def install(module: torch.nn.Module) -> None:
    """Both dispatchers on ``module``, once, and last: the plan's hooks see what hooks added
    since (another node's, a newer ComfyUI's) did to the arguments, as they did when they were
    registered per forward. Looked up in the module itself: a copy pickled to a worker (or
    deep-copied) brings its dispatchers along."""
    for hooks, dispatcher in ((module._forward_pre_hooks, dispatch_pre), (module._forward_hooks, dispatch_post)):
        key = next((k for k, h in hooks.items() if h is dispatcher), None)
        if key is None:
            if dispatcher is dispatch_pre:
                module.register_forward_pre_hook(dispatch_pre, with_kwargs=True)
            else:
                module.register_forward_hook(dispatch_post)
        elif next(reversed(hooks)) != key:
            hooks.move_to_end(key)


def _add(module: torch.nn.Module, kind: str, hook, with_kwargs: bool) -> ScopedHandle:
    install(module)
    key = (id(module), kind)
    entry = (hook, with_kwargs)
    _ACTIVE.setdefault(key, []).append(entry)
    return ScopedHandle(key, entry)


def pre_hook(module: torch.nn.Module, hook, *, with_kwargs: bool = False) -> ScopedHandle:
    """Like ``register_forward_pre_hook``, until the handle is removed."""
    return _add(module, "pre", hook, with_kwargs)


def post_hook(module: torch.nn.Module, hook) -> ScopedHandle:
    """Like ``register_forward_hook`` (without kwargs), until the handle is removed."""
    return _add(module, "post", hook, False)


class Overrides:
    """Attributes set for one call and put back as they were: instance attributes of modules (the
    VAE bands' convs and norms) and module globals (a Python module's ``__dict__`` is its globals:
    a plan's ``call_globals`` and ``attention_globals``)."""

    def __init__(self):
        self._saved = []

    def set(self, obj, name: str, value) -> None:
        had = name in obj.__dict__
        self._saved.append((obj, name, had, obj.__dict__.get(name)))
        obj.__dict__[name] = value

    def restore(self) -> None:
        while self._saved:
            obj, name, had, old = self._saved.pop()
            if had:
                obj.__dict__[name] = old
            else:
                obj.__dict__.pop(name, None)
