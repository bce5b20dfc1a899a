"""Weights to the workers once, through shared memory.

Rank 0 moves a module's CPU parameters and buffers into shared memory in place
(the module ComfyUI owns keeps working on the same values) and pickles the
module with ``ForkingPickler``: the pickle holds the module structure and small
handles to the shared pages, a few KB for gigabytes of weights. Workers map the
same pages, so N ranks on one host do not cost N copies of the weights.

Tensors on an accelerator are first copied to a CPU shared-memory shadow; a CUDA
worker then copies its shadow onto its own device.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import io
import marshal
import pickle
import types
import weakref

import torch
import torch.multiprocessing
from multiprocessing.reduction import ForkingPickler

SHARING_STRATEGY = "file_system"  # fds cannot be passed to processes started by subprocess


def use_shared_memory_strategy() -> None:
    if torch.multiprocessing.get_sharing_strategy() != SHARING_STRATEGY:
        torch.multiprocessing.set_sharing_strategy(SHARING_STRATEGY)


_shadows: "weakref.WeakKeyDictionary[torch.Tensor, torch.Tensor]" = weakref.WeakKeyDictionary()


def _shared_cpu(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "cpu":
        if not t.is_shared():
            t.share_memory_()
        return t
    shadow = _shadows.get(t)
    if shadow is None or shadow.shape != t.shape or shadow.dtype != t.dtype:
        shadow = t.detach().to("cpu").share_memory_()
        _shadows[t] = shadow
    return shadow


class _ModulePickler(ForkingPickler):
    def reducer_override(self, obj):
        if isinstance(obj, type) and "<locals>" in obj.__qualname__:
            return _local_class_reduction(obj)
        if isinstance(obj, types.FunctionType) and ("<lambda>" in obj.__qualname__ or "<locals>" in obj.__qualname__):
            return _function_by_code(obj)
        if isinstance(obj, torch.Tensor) and obj.device.type != "cpu":
            shadow = _shared_cpu(obj)
            if isinstance(obj, torch.nn.Parameter):
                return (torch.nn.Parameter, (shadow, obj.requires_grad))
            return (_identity, (shadow,))
        return NotImplemented


def _identity(x):
    return x


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
        raise pickle.PicklingError(f"cannot send the layer class {cls.__module__}.{cls.__qualname__} to the other "
                                   "ranks: it is defined inside a function this runtime cannot call again")
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
        if param.name not in found:
            raise pickle.PicklingError(f"cannot send the layer class {cls.__qualname__} to the other ranks: the "
                                       f"argument '{param.name}' of {cls.__module__}.{factory_name} is not recoverable")
        kwargs[param.name] = found[param.name]
    made = (functools.partial(factory, **kwargs), ())
    if not inner:
        return made
    # getattr chains rebuild the nested class from the factory's result.
    obj = made
    for part in inner.split("."):
        obj = (getattr, (_Deferred(obj), part))
    return obj


def _function_by_code(fn: types.FunctionType):
    """Rebuild a lambda or local function (ComfyUI's layers keep activations such as
    ``lambda a: gelu(a, approximate="tanh")``) from its code, in its module's namespace;
    only builtins and the model's own modules are named in the pickle."""
    code = (marshal.loads, (marshal.dumps(fn.__code__),))
    namespace = (vars, (_Deferred((importlib.import_module, (fn.__module__,))),))
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


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference tensors (ComfyUI patches weights in inference mode) have no counter
        return -1


def weights_fingerprint(module: torch.nn.Module) -> tuple:
    """Changes when any weight is replaced (LoRA patch or unpatch) or, where torch tracks it,
    modified in place. On the CPU an in-place change needs no resend: workers map the same pages."""
    return tuple((t.data_ptr(), _version(t), tuple(t.shape), t.dtype) for t in module_tensors(module))


def param_bytes(module: torch.nn.Module) -> int:
    return param_bytes_all([module])


def param_bytes_all(modules) -> int:
    """Bytes of weights held, counting a tensor shared by several modules once."""
    seen = set()
    total = 0
    for module in modules:
        for t in module_tensors(module):
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


def pack_module(module: torch.nn.Module) -> bytes:
    """Share the module's CPU tensors in place and pickle it as shared-memory handles."""
    use_shared_memory_strategy()
    for t in module_tensors(module):
        if t.device.type == "cpu":
            _shared_cpu(t)
    buf = io.BytesIO()
    try:
        with without_forward_overrides(module):
            _ModulePickler(buf, pickle.HIGHEST_PROTOCOL).dump(module)
    except Exception as exc:
        raise RuntimeError(f"cannot send {type(module).__name__} to the other ranks: {exc}. Some node attached "
                           "an object to the model that cannot be shared between processes") from exc
    return buf.getvalue()


def shared_storages(module: torch.nn.Module) -> list:
    """The shared CPU storages behind a packed module (one entry per storage)."""
    seen, out = set(), []
    for t in module_tensors(module):
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


_RECEIVING: list = []  # tensors a remote unpickle created, in stream order, waiting for their data


def _remote_slot(shape, dtype):
    t = torch.empty(shape, dtype=dtype)
    _RECEIVING.append(t)
    return t


class _RemotePickler(_ModulePickler):
    """Like _ModulePickler, but tensors travel by value later (through the process group):
    the pickle holds an empty slot for each, in stream order."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tensors: list[torch.Tensor] = []

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor) and not (isinstance(obj, type) or type(obj).__name__ == "QuantizedTensor"):
            value = obj.detach().to("cpu")
            self.tensors.append(value)
            slot = (_remote_slot, (tuple(value.shape), value.dtype))
            if isinstance(obj, torch.nn.Parameter):
                return (torch.nn.Parameter, (_Deferred(slot), obj.requires_grad))
            return slot
        return super().reducer_override(obj)


def pack_module_remote(module: torch.nn.Module) -> tuple[bytes, list[torch.Tensor]]:
    """The module's structure as a pickle, and its tensors to send after it, in order."""
    buf = io.BytesIO()
    with without_forward_overrides(module):
        pickler = _RemotePickler(buf, pickle.HIGHEST_PROTOCOL)
        pickler.dump(module)
    return buf.getvalue(), pickler.tensors


def unpack_module_remote(data: bytes) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    """The module with empty tensors, and those tensors in the order their data will arrive."""
    _RECEIVING.clear()
    module = pickle.loads(data)
    slots = list(_RECEIVING)
    _RECEIVING.clear()
    return module, slots


def unpack_module(data: bytes, device: torch.device) -> torch.nn.Module:
    use_shared_memory_strategy()
    module = pickle.loads(data)
    if device.type != "cpu":
        module.to(device)
    module.eval()
    module.requires_grad_(False)
    return module
