"""Module pickling for the two ways weights reach the other ranks.

- Shared memory (CPU ranks on one host): rank 0 moves a module's CPU parameters and buffers
  into shared memory in place (the module ComfyUI owns keeps working on the same values) and
  pickles the module with ``ForkingPickler``: the pickle holds the structure and small handles
  to the shared pages, a few KB for gigabytes of weights. Workers map the same pages, so N
  ranks on one host do not cost N copies.
- A skeleton (accelerators, other hosts): the structure alone, every tensor replaced by a
  numbered slot. The receiver allocates each slot on its own device (at its shard's shape
  with tensor parallelism) before unpickling, and ``stream`` fills the slots from GPU
  memory over the process group or by CUDA IPC. No host copy of the weights is made.

Tensors are never used as dictionary keys here: comparing accelerator tensors is ambiguous.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import inspect
import io
import marshal
import os
import pickle
import threading
import time
import types

import torch
import torch.multiprocessing
from multiprocessing.reduction import ForkingPickler

from . import packed, quantized
from ..comfyui_modules import import_module

SHARING_STRATEGY = "file_system"  # fds cannot be passed to processes started by subprocess


def use_shared_memory_strategy() -> None:
    if torch.multiprocessing.get_sharing_strategy() != SHARING_STRATEGY:
        torch.multiprocessing.set_sharing_strategy(SHARING_STRATEGY)


class _ModulePickler(ForkingPickler):
    """Pickles a module for another process: layer classes made by factories and lambdas are
    rebuilt there; ``module_state`` filters each module's attributes (the caller's say on
    what must not travel, such as ComfyUI's per-process lowvram state)."""

    def __init__(self, *args, module_state=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.module_state = module_state

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor) and quantized.layout_name(obj) is not None:
            return _quantized_reduction(obj)
        if isinstance(obj, type) and "<locals>" in obj.__qualname__:
            return _local_class_reduction(obj)
        if isinstance(obj, type) and _file_module(obj.__module__):
            return _class_in_file, (obj.__module__, obj.__qualname__)
        if isinstance(obj, types.FunctionType) and ("<lambda>" in obj.__qualname__ or "<locals>" in obj.__qualname__):
            return _function_by_code(obj)
        if isinstance(obj, torch.nn.Module) and ("forward" in obj.__dict__ or self.module_state is not None):
            return self._module_reduction(obj)
        return NotImplemented

    def _module_reduction(self, module: torch.nn.Module):
        """The module's own reduction with its state filtered: no instance-level ``forward``
        (rank 0's dispatch, installed by an object patch on a text encoder: the copy is the model)."""
        func, args, state, *rest = module.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        state = {k: v for k, v in state.items() if k != "forward"}
        if self.module_state is not None:
            state = self.module_state(module, state)
        return (func, args, state, *rest)


def _quantized_reduction(t: torch.Tensor):
    """ComfyUI's QuantizedTensor as its plain tensors (data, scales) and the context its class
    rebuilds it from: pickling the wrapper itself crashes the process (torch 2.14, 0.33's layouts),
    and its plain tensors travel like any other (shared pages, or skeleton slots)."""
    return _unflatten_reduction(t, *quantized.flatten(t))


def _unflatten_reduction(t: torch.Tensor, tensors: dict, ctx):
    """Rebuild QuantizedTensor ``t`` (a Parameter if it is one) around ``tensors`` (or their slots)."""
    rebuilt = (quantized.unflatten, (type(quantized.unwrapped(t)), tensors, ctx))
    if isinstance(t, torch.nn.Parameter):
        return (torch.nn.Parameter, (_Deferred(rebuilt), False))
    return rebuilt


def plain_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The ordinary tensors behind ``t``: a QuantizedTensor's data and scales, else ``t``."""
    if quantized.layout_name(t) is not None:
        return list(quantized.flatten(t)[0].values())
    return [t]


class SharedBytes:
    """Bytes this process moved into shared memory, ever: what a send to CPU ranks copied (a tensor
    already shared travels as a handle, nothing copied)."""

    def __init__(self):
        self.total = 0


SHARED_BYTES = SharedBytes()


def _shared_cpu(t: torch.Tensor) -> torch.Tensor:
    if t.device.type != "cpu":
        raise RuntimeError(f"shared-memory transport got a tensor on {t.device}; accelerator weights travel "
                           "through the weight stream (weights/stream.py)")
    if not t.is_shared():
        SHARED_BYTES.total += t.untyped_storage().nbytes()
        t.share_memory_()
    return t


def _file_module(name: str) -> bool:
    """A module ComfyUI imported under its file path (its ``comfy_extras`` node modules): pickle cannot
    name it when the path has a dot in it (``__import__`` reads the dots as packages)."""
    return os.path.isabs(name) and os.path.isfile(name + ".py")


def _class_in_file(module: str, qualname: str) -> type:
    value = import_module(module)
    for part in qualname.split("."):
        value = getattr(value, part)
    return value


def _local_class_reduction(cls: type):
    """Rebuild a class that a factory function defines (ComfyUI's ``scaled_fp8_ops(...)``,
    ``mixed_precision_ops(...)`` make the layer classes of fp8 checkpoints this way), which
    pickle cannot name: call the same factory with the same arguments in the worker and
    walk to the class. The arguments are read back from the closures and class attributes
    of the classes the factory made."""
    factory_name, _, path = cls.__qualname__.partition(".<locals>.")
    module = importlib.import_module(cls.__module__)
    factory = getattr(module, factory_name, None)
    if factory is None or "<locals>" in path:
        return _class_by_value(cls)
    found: dict = {}
    for klass in cls.__mro__:
        if not klass.__qualname__.startswith(factory_name + ".<locals>."):
            continue
        for name, attr in vars(klass).items():
            fn = getattr(attr, "__func__", attr)
            for var, cell in zip(getattr(getattr(fn, "__code__", None), "co_freevars", ()),
                                 getattr(fn, "__closure__", None) or ()):
                try:
                    found.setdefault(var, cell.cell_contents)
                except ValueError:  # empty cell
                    pass
            if name.startswith("_") and not name.startswith("__"):
                found.setdefault(name[1:], attr)
    # The outermost local class, then the path inside it.
    outer_name, _, inner = path.partition(".")
    outer = next((k for k in cls.__mro__ if k.__qualname__ == f"{factory_name}.<locals>.{outer_name}"), None)
    if outer is not None:
        for name, attr in vars(outer).items():
            if name.startswith("_") and not name.startswith("__"):
                found.setdefault(name[1:], attr)
    kwargs = {}
    for param in inspect.signature(factory).parameters.values():
        if param.name not in found:  # a factory that also makes the instance (Gemma's embedding in 0.33)
            return _class_by_value(cls)
        kwargs[param.name] = found[param.name]
    made = (functools.partial(factory, **kwargs), ())
    if not inner:
        return made
    # getattr chains rebuild the nested class from the factory's result.
    obj = made
    for part in inner.split("."):
        obj = (getattr, (_Deferred(obj), part))
    return obj


def _class_by_value(cls: type):
    """Rebuild a local class from its bases and namespace (methods by code, see below). The
    methods are set after the class exists: a method calling ``super()`` holds the class itself."""
    if type(cls) is not type and not issubclass(type(cls), type(torch.nn.Module)):
        raise pickle.PicklingError(f"cannot send the layer class {cls.__module__}.{cls.__qualname__} to the other "
                                   f"ranks: its metaclass {type(cls).__qualname__} cannot be rebuilt")
    skip = {"__dict__", "__weakref__", "__module__", "__qualname__"}
    members = {k: v for k, v in vars(cls).items() if k not in skip}
    return (type(cls), (cls.__name__, cls.__bases__, {"__module__": cls.__module__, "__qualname__": cls.__qualname__}),
            members, None, None, _set_members)


def _set_members(cls: type, members: dict) -> type:
    """Pickle's state setter for ``_class_by_value`` (its default would call a ``__setstate__``
    the class defines for its instances)."""
    for name, value in members.items():
        setattr(cls, name, value)
    return cls


def _function_by_code(fn: types.FunctionType):
    """Rebuild a lambda or local function (ComfyUI's layers keep activations such as
    ``lambda a: gelu(a, approximate="tanh")``) from its code, in its module's namespace;
    only builtins and the model's own modules are named in the pickle."""
    code = (marshal.loads, (marshal.dumps(fn.__code__),))
    namespace = (vars, (_Deferred((import_module, (fn.__module__,))),))
    closure = None
    if fn.__closure__:
        closure = tuple(_Deferred((_types_attr("CellType"), (cell.cell_contents,))) for cell in fn.__closure__)
    return (_types_attr("FunctionType"),
            (_Deferred(code), _Deferred(namespace), fn.__name__, fn.__defaults__, closure))


def _types_attr(name: str):
    """``types.<name>``, named so that pickle can find it (its builtins name cannot be imported)."""
    return _Deferred((getattr, (_Deferred((importlib.import_module, ("types",))), name)))


class _Deferred:
    """Placeholder so that a reduction tuple can nest another reduction (see __reduce__)."""

    def __init__(self, reduction):
        self.reduction = reduction

    def __reduce__(self):
        return self.reduction

    def __call__(self, *args, **kwargs):  # pickle checks that a reduction's function is callable
        raise TypeError("a pickling placeholder is not meant to be called")


def module_tensors(module: torch.nn.Module):
    for _, p in module.named_parameters(recurse=True):
        yield p
    for _, b in module.named_buffers(recurse=True):
        yield b


def tensor_digest(t: torch.Tensor) -> tuple:
    """(shape, dtype, sha256 of the bytes): compares what two ranks hold without moving it."""
    data = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
    return (tuple(t.shape), str(t.dtype), hashlib.sha256(data.numpy().tobytes()).hexdigest())


def param_bytes(module: torch.nn.Module) -> int:
    return param_bytes_all([module])


def param_bytes_all(modules) -> int:
    """Bytes of weights held, counting a tensor shared by several modules once; a QuantizedTensor
    by the data and scales it stores (its ``element_size`` is its logical dtype's: fp8 counted as
    fp32 made a TP rank of an fp8 model look like it held twice the file)."""
    seen = set()
    total = 0
    for module in modules:
        for held in module_tensors(module):
            for t in plain_tensors(held):
                key = (t.data_ptr(), t.numel())
                if key in seen:
                    continue
                seen.add(key)
                total += t.numel() * t.element_size()
    return total


@contextlib.contextmanager
def without_forward_overrides(module: torch.nn.Module):
    """Hide instance-level ``forward`` attributes (rank 0's dispatch, installed by an object
    patch on a text encoder) while the module is copied or pickled: the copy is the model."""
    hidden = []
    for mod in module.modules():
        if "forward" in mod.__dict__:
            hidden.append((mod, mod.__dict__.pop("forward")))
    try:
        yield
    finally:
        for mod, fn in hidden:
            mod.__dict__["forward"] = fn


def pack_module(module: torch.nn.Module, module_state=None) -> bytes:
    """Share the module's CPU tensors in place and pickle it as shared-memory handles."""
    use_shared_memory_strategy()
    for t in module_tensors(module):
        for plain in plain_tensors(t):
            _shared_cpu(plain)
    buf = io.BytesIO()
    try:
        _ModulePickler(buf, pickle.HIGHEST_PROTOCOL, module_state=module_state).dump((class_settings(module), module))
    except Exception as exc:
        raise _cannot_send(module, exc) from exc
    return buf.getvalue()


def _cannot_send(module, exc) -> RuntimeError:
    return RuntimeError(f"cannot send {type(module).__name__} to the other ranks: {exc}. Some node attached "
                        "an object to the model that cannot be shared between processes")


def shared_storages(module: torch.nn.Module) -> list:
    """The shared CPU storages behind a packed module (one entry per storage)."""
    seen, out = set(), []
    for t in (plain for t in module_tensors(module) for plain in plain_tensors(t)):
        if t.device.type == "cpu":
            st = t.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                out.append(st)
    return out


def release_for_dead_receiver(storages) -> None:
    """Give back the reference a receiver held on each storage when it died without
    releasing it (SIGKILL, crash): otherwise the shared files would outlive the weights."""
    for st in storages:
        try:
            st._shared_decref()
        except RuntimeError:
            pass


# ---------------------------------------------------------------- skeletons
_filling = threading.local()


def _slot(index: int):
    return _filling.tensors[index]


class _SkeletonPickler(_ModulePickler):
    """Like _ModulePickler, but every tensor becomes a numbered slot (its data travels later).
    A packed tensor that ``forms`` says travels stored becomes a slot for its stored data,
    rebuilt around it on arrival (``packed``); ``packed[slot]`` is the tensor it came from."""

    def __init__(self, *args, forms=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.tensors: list[torch.Tensor] = []
        self.packed: dict[int, torch.Tensor] = {}
        self.parts: dict[int, str] = {}  # slot -> the name of a quantized part's plain tensor
        self._forms = forms or {}
        self._index: dict[int, int] = {}  # id(tensor) -> slot; keeps shared tensors shared

    def _packed_reduction(self, obj, form):
        index = len(self.tensors)
        self.tensors.append(packed.stored(obj))
        self.packed[index] = obj
        return (packed.rebuild, (type(obj), _Deferred((_slot, (index,))), obj.tensor_type,
                                         list(form.patches), isinstance(obj, torch.nn.Parameter)))

    def _quantized_part_reduction(self, obj, form):
        """A quantized tensor TP cuts: a slot per plain tensor of a rank's part (``form``:
        name -> (shape, dtype), and the part's context), rebuilt around them on arrival."""
        slots = {}
        for name in form.specs:
            index = len(self.tensors)
            self.tensors.append(obj)
            self.parts[index] = name
            slots[name] = _Deferred((_slot, (index,)))
        return _unflatten_reduction(obj, slots, form.ctx)

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor) and quantized.layout_name(obj) is not None:
            form = self._forms.get(id(obj))
            if form is not None:
                return self._quantized_part_reduction(obj, form)
        if isinstance(obj, torch.Tensor) and quantized.layout_name(obj) is None:
            form = self._forms.get(id(obj))
            if form is not None and form.stored:
                return self._packed_reduction(obj, form)
            index = self._index.get(id(obj))
            if index is None:
                index = self._index[id(obj)] = len(self.tensors)
                self.tensors.append(obj)
            slot = (_slot, (index,))
            if isinstance(obj, torch.nn.Parameter):
                return (torch.nn.Parameter, (_Deferred(slot), False))
            return slot
        return super().reducer_override(obj)


def pack_skeleton(module: torch.nn.Module, module_state=None, forms=None
                  ) -> tuple[bytes, list[torch.Tensor], dict[int, torch.Tensor], dict[int, str]]:
    """The module's structure as a pickle without any tensor data, its tensors in slot order,
    slot -> packed tensor for the slots that hold a packed tensor's stored data, and slot -> name
    for the slots that hold a plain tensor of a quantized tensor's TP part (that slot's entry in
    the list is the whole quantized tensor). ``forms``: id(tensor) -> ``packed.StreamForm``
    or ``QuantizedPartForm``."""
    buf = io.BytesIO()
    try:
        pickler = _SkeletonPickler(buf, pickle.HIGHEST_PROTOCOL, module_state=module_state, forms=forms)
        pickler.dump((class_settings(module), module))
    except Exception as exc:
        raise _cannot_send(module, exc) from exc
    return buf.getvalue(), pickler.tensors, pickler.packed, pickler.parts


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        import_module(module)
        return super().find_class(module, name)


SHM_MANAGER_TIMEOUT = "Shared memory manager connection has timed out"
SHM_MANAGER_TRIES = 3


def _loads(data: bytes):
    settings, module = _retried(lambda: _Unpickler(io.BytesIO(data)).load())
    apply_class_settings(settings)
    return module


def _retried(load):
    """``load()``, tried again where torch's shared-memory manager did not answer in time: on an
    overloaded machine (many CPU ranks on 2 cores) a worker's first connection to it can time out
    (seen in CI, bench/results/ci_timings.md), and the unpickling only reads ``data``, so trying
    again is safe. Any other error, or the last try's, is raised as it is."""
    for attempt in range(SHM_MANAGER_TRIES):
        try:
            return load()
        except RuntimeError as exc:
            if SHM_MANAGER_TIMEOUT not in str(exc) or attempt == SHM_MANAGER_TRIES - 1:
                raise
            time.sleep(0.5 * (attempt + 1))


_SETTING_TYPES = (type(None), bool, int, float, str, torch.dtype)


def class_settings(module: torch.nn.Module) -> list[tuple[str, str, dict]]:
    """The plain class attributes (numbers, strings, dtypes, None) of every class the module's
    layers are made of, outside torch, as this process has them now. A loader may set them at
    run time, for every layer of the class at once (ComfyUI-GGUF's advanced loader sets its
    layer class's dequantization and patch dtypes): a worker's fresh import of the class would
    otherwise compute differently from rank 0, without a word."""
    out, seen = [], set()
    for layer in module.modules():
        for cls in type(layer).__mro__:
            if cls in seen or cls.__module__ in ("builtins",) or cls.__module__.split(".")[0] == "torch":
                continue
            seen.add(cls)
            if "<locals>" in cls.__qualname__:
                continue
            attrs = {k: v for k, v in vars(cls).items() if not k.startswith("__") and isinstance(v, _SETTING_TYPES)}
            if attrs:
                out.append((cls.__module__, cls.__qualname__, attrs))
    return out


def apply_class_settings(settings: list[tuple[str, str, dict]]) -> None:
    """Give this process's classes the attribute values rank 0's had when it sent the model."""
    for module_name, qualname, attrs in settings:
        cls = import_module(module_name)
        for part in qualname.split("."):
            cls = getattr(cls, part)
        for name, value in attrs.items():
            if name not in vars(cls) or vars(cls)[name] != value:
                setattr(cls, name, value)


def unpack_skeleton(data: bytes, tensors: list[torch.Tensor]) -> torch.nn.Module:
    """The module, its slots taken by ``tensors`` (allocated by the receiver, in slot order)."""
    _filling.tensors = tensors
    try:
        module = _loads(data)
    finally:
        _filling.tensors = None
    module.eval()
    return module


def unpack_module(data: bytes, device: torch.device) -> torch.nn.Module:
    use_shared_memory_strategy()
    module = _loads(data)
    if device.type != "cpu":
        module.to(device)
    module.eval()
    module.requires_grad_(False)
    return module
