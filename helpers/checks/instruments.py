"""Instruments that let a check see *how* the learner's function computed its result, where the
exercise asks for a particular way (block by block, by hand, inside a Triton kernel).

- :class:`OpLog` logs every aten op run (its name, first input shape, output shapes).
- :class:`Provenance` follows which of the check's inputs the data of every tensor comes from,
  so a check can see PyTorch combining inputs that the exercise wants combined elsewhere (in a
  Triton kernel), data leaving PyTorch (NumPy, Python lists, one Python number at a time), and
  whether a returned tensor was written by a kernel that read the inputs.
- :class:`Calls` is a profile hook (chained with any profiler already active) that records
  conversions of tensors out of PyTorch and calls into automatic differentiation.

- ``nb09_flash_attention.call_logged`` runs the learner's function under all three (9.1, 9.2).
- :class:`GuardAllocations` puts the float tensors the learner allocates inside padded buffers,
  and :class:`KernelLaunches` records every Triton kernel launch and marks what it wrote (9.3, 9.4).

All are context managers, removed again on exit, and are entered *inside* the function that the
check's ``Trial.call`` runs, so they see the learner's thread whatever thread that is.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

from . import guard as _guard
from .feedback import Mistake

if TYPE_CHECKING:
    from .core import Trial

_TORCH_DIR = os.path.dirname(torch.__file__)


_WARM: list[bool] = []


def warm_up() -> None:
    """Enter a dispatch mode once: the first one of a process imports torch._dynamo (seconds, and far
    longer under a profile hook). Checks call this before the learner's function runs, so the time
    is not counted against it."""
    if not _WARM:
        with OpLog():
            torch.zeros(1).add_(1)
        _WARM.append(True)


def op_name(func: Any) -> str:
    """'aten.amax.default' -> 'amax'."""
    return str(func).split(".")[1] if str(func).count(".") >= 1 else str(func)


class OpLog(TorchDispatchMode):
    """Logs ``(op, first input shape, output shapes, input numels)`` for every aten op run inside it."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, tuple, list[tuple], list[int]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [a for a in tree_flatten(args)[0] if isinstance(a, torch.Tensor)]
        first = tuple(inputs[0].shape) if inputs else ()
        outs = [tuple(o.shape) for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        self.ops.append((str(func), first, outs, [a.numel() for a in inputs]))
        return out


# --------------------------------------------------------------------------- provenance

_FACTORIES = {"empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "randint_like",
              "new_empty", "new_zeros", "new_ones", "new_full", "new_empty_strided", "empty_strided", "empty"}
_MOVES = {"clone", "_to_copy", "copy_", "copy", "cat", "stack", "contiguous", "constant_pad_nd", "_unsafe_view",
          "lift_fresh", "lift_fresh_copy", "index_select", "gather", "repeat", "flip", "roll", "narrow",
          "split", "split_with_sizes", "unbind", "select_scatter", "slice_scatter", "fill_"}
_SCALAR_READS = {"_local_scalar_dense", "is_nonzero", "item"}

Tag = tuple[frozenset, bool]  # (sources the data comes from, whether it packs several sources side by side)
KERNEL = "a Triton kernel"  # the source name of data a kernel computed
_NONE: Tag = (frozenset(), False)


def _same_data(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape and values, NaN equal to NaN."""
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all()) if a.is_floating_point() else (
        a.shape == b.shape and bool((a == b).all()))


def _storage_key(t: torch.Tensor):
    """(key, storage) of a tensor's memory, or None where it has none we can follow (meta, sparse)."""
    if t.device.type not in ("cpu", "cuda") or t.layout != torch.strided:
        return None
    try:
        s = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return (t.device.type, s.data_ptr()), s


class Provenance(TorchDispatchMode):
    """Follows, per storage, which named sources each tensor's data was computed from.

    ``sources`` maps a name to an input tensor. A PyTorch op that *combines* data of a name in
    ``watched`` with data from another source (two inputs that carry different sources, or
    computing on a tensor that packs several side by side) is recorded in ``mixed``. Reading
    sourced data that no kernel computed into Python numbers is counted in ``scalar_reads``.
    :meth:`kernel_launch` marks what a Triton kernel wrote as combining the sources of all its
    arguments, plus :data:`KERNEL` (that is where the exercises of notebook 09 want the combining
    done); what a kernel merely copied keeps the sources of the original.

    Storages that carry a tag are kept alive while the mode exists, so an address is never reused
    for a different tensor during the learner's call.
    """

    def __init__(self, sources: dict[str, torch.Tensor], watched: Iterable[str] = ()):
        super().__init__()
        self.watched = frozenset(watched)
        self._tags: dict[Any, tuple[Any, Tag]] = {}
        self.mixed: list[str] = []
        self.scalar_reads = 0
        for name, t in sources.items():
            self._mark([t], (frozenset({name}), False))

    def tag(self, t: torch.Tensor) -> Tag:
        key = _storage_key(t) if isinstance(t, torch.Tensor) else None
        return self._tags[key[0]][1] if key and key[0] in self._tags else _NONE

    def sources(self, t: torch.Tensor) -> frozenset:
        return self.tag(t)[0]

    def _mark(self, tensors: Iterable[torch.Tensor], tag: Tag, merge: bool = False) -> None:
        for t in tensors:
            key = _storage_key(t)
            if key is None:
                continue
            if merge and key[0] in self._tags:
                old = self._tags[key[0]][1]
                tag = (old[0] | tag[0], old[1] or tag[1])
            self._tags[key[0]] = (key[1], tag)

    def kernel_launch(self, tensors: list[torch.Tensor], before: list[torch.Tensor]) -> None:
        """A Triton kernel ran with ``tensors`` as arguments (``before``: their contents before it ran).
        Each argument it changed now holds data combined from all the arguments' sources, plus
        ``KERNEL``, unless it is an exact copy of another argument (a copy kernel computes nothing:
        the copy keeps the original's sources)."""
        tags = [self.tag(t) for t in tensors]
        union = frozenset().union(*(s for s, _ in tags)) | {KERNEL}
        for i, (t, b) in enumerate(zip(tensors, before)):
            if _same_data(t, b):
                continue
            origin = next((tags[j] for j, a in enumerate(before)
                           if j != i and a.dtype == t.dtype and a.numel() == t.numel() and _same_data(t.reshape(-1), a.reshape(-1))), None)
            self._mark([t], origin or (union, False))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = op_name(func)
        if name in _FACTORIES:
            return out
        flat = tree_flatten((args, kwargs))[0]
        tags = [self.tag(a) for a in flat if isinstance(a, torch.Tensor)]
        union = frozenset().union(*(s for s, _ in tags))
        if not union:
            return out
        packed_in = any(p for s, p in tags if s)
        if name in _SCALAR_READS:
            if KERNEL not in union:  # reading what a kernel computed is fine; reading the inputs is not
                self.scalar_reads += 1
            return out
        moves = getattr(func, "is_view", False) or name in _MOVES
        if not moves and union & self.watched and len(union) > 1 and (packed_in or union not in {s for s, _ in tags}):
            self.mixed.append(f"{func} combined data from {', '.join(sorted(union))}")
        packed = packed_in or (moves and union not in {s for s, _ in tags})
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        self._mark(outs + _written(func, args, kwargs), (union, packed), merge=True)
        return out


def _written(func, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensor arguments an op writes into (``x.add_(...)``, ``out=``)."""
    schema = func._schema
    if not schema.is_mutable:
        return []
    found = []
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = args[i] if i < len(args) else kwargs.get(a.name)
            found += [t for t in tree_flatten(v)[0] if isinstance(t, torch.Tensor)]
    return found


def disabled_modes():
    """A context in which no dispatch mode is active (kernel launches run there)."""
    return _disable_current_modes()


# --------------------------------------------------------------------------- a profile hook

_AUTOGRAD_FILES = {os.path.join(_TORCH_DIR, "autograd", f) for f in ("functional.py", "forward_ad.py", "gradcheck.py")}
_AUTOGRAD_INIT = os.path.join(_TORCH_DIR, "autograd", "__init__.py")
_FUNCTORCH_DIR = os.path.join(_TORCH_DIR, "_functorch") + os.sep
_FUNCTORCH_AD = {"vjp", "jvp", "jacrev", "jacfwd", "grad", "grad_and_value", "hessian", "linearize"}
_TENSOR_PY = os.path.join(_TORCH_DIR, "_tensor.py")


class Calls:
    """A profile hook, chained with any profiler already active, that records conversions of
    tensors out of PyTorch (``.numpy()``, ``.tolist()``, ``__array__``, ``__dlpack__``: in
    ``exported``, as ``(how, tensor)``), calls into automatic differentiation (``torch.autograd``
    and ``torch.func`` transforms, reverse and forward mode: in ``autograd``), and calls of code in
    ``files`` (in ``file_calls``). ``pause()`` switches it off (for a kernel that runs as Python)."""

    def __init__(self, files: Iterable[str] = ()):
        self.files = set(files)
        self.exported: list[tuple[str, torch.Tensor]] = []
        self.autograd: list[str] = []
        self.file_calls: list[str] = []
        self._previous: Callable | None = None
        self._hook: Callable | None = None

    def _on(self, frame, event, arg) -> None:
        if event == "c_call":
            owner = getattr(arg, "__self__", None)
            if isinstance(owner, torch.Tensor) and getattr(arg, "__name__", "") in ("numpy", "tolist"):
                self.exported.append((f".{arg.__name__}()", owner))
            return
        if event != "call":
            return
        code = frame.f_code
        path = code.co_filename
        if path == _TENSOR_PY and code.co_name in ("__array__", "__dlpack__"):
            owner = frame.f_locals.get("self")
            if isinstance(owner, torch.Tensor):
                self.exported.append(("NumPy" if code.co_name == "__array__" else "DLPack", owner))
        elif path in _AUTOGRAD_FILES or (path == _AUTOGRAD_INIT and code.co_name in ("grad", "backward")):
            self.autograd.append(f"torch.autograd {code.co_name}")
        elif path.startswith(_FUNCTORCH_DIR) and code.co_name in _FUNCTORCH_AD:
            self.autograd.append(f"torch.func.{code.co_name}")
        elif path in self.files:
            self.file_calls.append(code.co_name)

    def __enter__(self) -> Calls:
        self._previous = previous = sys.getprofile()

        def hook(frame, event, arg):
            self._on(frame, event, arg)
            if previous is not None:
                previous(frame, event, arg)

        self._hook = hook
        sys.setprofile(hook)
        return self

    def __exit__(self, *exc) -> bool:
        sys.setprofile(self._previous)
        return False

    def pause(self):
        """A context in which this hook is off (the profiler that was active before it stays on);
        on exit, whatever was active on entry is active again."""
        calls = self

        class _Paused:
            def __enter__(self):
                self.current = sys.getprofile()
                if self.current is calls._hook:
                    sys.setprofile(calls._previous)

            def __exit__(self, *exc):
                sys.setprofile(self.current)
                return False

        return _Paused()


# --------------------------------------------------------------------------- how a function computes (9.1, 9.2)

REDUCTIONS = {"amax", "sum", "logsumexp", "_softmax", "_log_softmax", "mean", "cumsum", "cummax",
               "logcumsumexp", "sort", "topk", "prod", "aminmax", "nansum", "var", "std"}
MAX_REDUCTIONS = {"aten.amax.default", "aten.max.dim", "aten.max.default"}
MAX_LIKE = {"amax", "max", "maximum", "fmax", "cummax", "aminmax", "sort", "topk", "kthvalue",
             "max_pool1d", "max_pool2d", "max_pool1d_with_indices", "max_pool2d_with_indices",
             "adaptive_max_pool1d", "adaptive_max_pool2d", "clamp_min"}
EXP_LIKE = {"exp", "exp2", "expm1", "_softmax", "logsumexp", "logaddexp", "logaddexp2", "sigmoid"}


def is_reduction(op: str) -> bool:
    return op_name(op) in REDUCTIONS or op in MAX_REDUCTIONS or op in {"aten.min.dim", "aten.min.default"}


def is_exp_like(op: str) -> bool:
    return op_name(op) in EXP_LIKE or op == "aten.pow.Scalar"  # pow.Scalar: base ** tensor


class Watched:
    """What the instruments saw during one call, as plain data: the aten ops (``OpLog``), how the
    sources' data left PyTorch ("" if it did not), how many Python numbers were read from them."""

    def __init__(self, ops: list, exported: str, scalar_reads: int):
        self.ops, self.exported, self.scalar_reads = ops, exported, scalar_reads


def check_stays_in_torch(t: Trial, seen: Watched, what: str, reads_limit: int | None) -> None:
    """Fail if the sources' data left PyTorch, where the op log cannot follow the work (decided from
    observations: ``t.fail_observed``)."""
    __tracebackhide__ = True
    if seen.exported:
        t.fail_observed(f"your function took {what} out of PyTorch ({seen.exported}): the check follows your "
                        "computation through PyTorch's operations to see how it reads the data, and cannot follow "
                        "work done in NumPy or on Python lists.",
                        Mistake("data-left-torch", "keep the data in torch tensors (torch.exp, .amax, @ "
                                "...) from start to end.",
                                "took the data out of PyTorch (NumPy, Python lists)"))
        return
    if reads_limit is not None and seen.scalar_reads >= reads_limit:
        t.fail_observed(f"your function read {what} into {seen.scalar_reads} Python numbers one at a time "
                        "(.item(), float(), a loop over elements): the check follows your computation through "
                        "PyTorch's operations and cannot follow arithmetic on Python numbers.",
                        Mistake("read-numbers-one-at-a-time", "work on blocks as tensors: x[..., s:s + "
                                "block_size] and torch operations on it.",
                                "read the data one Python number at a time (.item(), float(), loops)"))


# --------------------------------------------------------------------------- kernel launches and guarded memory (9.3, 9.4)

PAD_BEFORE, PAD_AFTER = 1024, 128 * 128  # elements; a tile of 128 rows x 128 columns fits in the padding
SENTINEL = -5555.0  # the padding of tensors the learner allocates
EMPTY_FILL = 7777.0  # the body of torch.empty(...) tensors: an entry still equal to it was never written


def guarded(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """x's values, contiguous on ``device``, inside a buffer padded with NaN on both sides."""
    n = x.numel()
    buf = torch.full((PAD_BEFORE + n + PAD_AFTER,), float("nan"), dtype=x.dtype, device=device)
    view = buf[PAD_BEFORE : PAD_BEFORE + n].view(x.shape)
    view.copy_(x)
    return view


class GuardAllocations:
    """While active, float tensors from torch.empty / empty_like / zeros / zeros_like and
    Tensor.new_empty / new_zeros on the CPU or a GPU live inside buffers padded with ``SENTINEL``;
    ``empty`` ones are filled with ``EMPTY_FILL``. (Tensors on other devices, such as ``meta``, and
    allocations made while a guarded one is being built are left alone.)"""

    FUNCS = ("empty", "empty_like", "zeros", "zeros_like")
    METHODS = ("new_empty", "new_zeros")

    def __init__(self):
        self.buffers: list[tuple[torch.Tensor, int]] = []
        self.saved: dict[str, Any] = {}
        self.busy = False

    def _guard(self, t: torch.Tensor, fill: float) -> torch.Tensor:
        if (not isinstance(t, torch.Tensor) or t.device.type not in ("cpu", "cuda") or not t.is_floating_point()
                or not t.is_contiguous() or t.requires_grad):
            return t
        self.busy = True
        try:
            n = t.numel()
            buf = self.saved["full"]((PAD_BEFORE + n + PAD_AFTER,), SENTINEL, dtype=t.dtype, device=t.device)
            view = buf[PAD_BEFORE : PAD_BEFORE + n].view(t.shape)
            view.fill_(fill)
        finally:
            self.busy = False
        self.buffers.append((buf, n))
        return view

    def _wrap(self, real: Callable, fill: float) -> Callable:
        def alloc(*args, **kwargs):
            t = real(*args, **kwargs)
            return t if self.busy else self._guard(t, fill)

        return alloc

    def __enter__(self):
        self.saved["full"] = torch.full
        for name in self.FUNCS:
            self.saved[name] = getattr(torch, name)
            setattr(torch, name, self._wrap(self.saved[name], EMPTY_FILL if "empty" in name else 0.0))
        for name in self.METHODS:
            self.saved["Tensor." + name] = torch.Tensor.__dict__.get(name)  # None: inherited from TensorBase
            real = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._wrap(real, EMPTY_FILL if "empty" in name else 0.0))
        return self

    def __exit__(self, *exc):
        for name in self.FUNCS:
            setattr(torch, name, self.saved[name])
        for name in self.METHODS:
            if self.saved["Tensor." + name] is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, self.saved["Tensor." + name])
        return False

    def overrun(self) -> bool:
        """True if anything was written into the padding of a guarded allocation."""
        for buf, n in self.buffers:
            pad = torch.cat([buf[:PAD_BEFORE], buf[PAD_BEFORE + n :]])
            if not bool((pad == torch.tensor(SENTINEL, dtype=buf.dtype, device=buf.device)).all()):
                return True
        return False


def runner_classes() -> list[type]:
    """Triton's kernel classes whose ``run`` launches a kernel (compiled, or in the interpreter)."""
    classes = []
    try:
        from triton.runtime.jit import JITFunction

        classes.append(JITFunction)
    except ImportError:
        pass
    try:
        from triton.runtime.interpreter import InterpretedFunction

        classes.append(InterpretedFunction)
    except ImportError:
        pass
    return [c for c in classes if callable(getattr(c, "run", None))]


def tensor_args(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors a kernel launch received: tensors, and the tensors inside tensor descriptors."""
    found = []
    for a in (*args, *kwargs.values()):
        for x in (a if isinstance(a, (list, tuple)) else (a,)):
            base = x if isinstance(x, torch.Tensor) else getattr(x, "base", None)
            if isinstance(base, torch.Tensor):
                found.append(base)
    return found


class KernelUnsupported(RuntimeError):
    """Triton could not run an operation of the learner's kernel (removed API, interpreter limits)."""


GPU_KERNEL_ON_CPU = ("your kernel is a compiled (GPU) kernel, and this machine has no GPU: it was decorated with "
                      "@triton.jit before Triton's interpreter was switched on")


class KernelLaunches:
    """While active, every Triton kernel launch is recorded (kernel name, source file, tensor
    arguments) and what it wrote is marked in ``prov``; it runs with the check's dispatch modes,
    profile hook and trace hook off (the interpreter runs kernels as Python: watching that would
    only slow it down, about 3x). In the interpreter, ``@triton.autotune`` takes its first config
    without benchmarking (benchmarks need a GPU)."""

    def __init__(self, prov: Provenance, calls: Calls, interpreter: bool):
        self.prov, self.calls, self.interpreter = prov, calls, interpreter
        self.launches: list[tuple[str, str, list[torch.Tensor]]] = []
        self.patched: list[tuple[type, str, Any]] = []

    def _launch(self, cls: type, original: Callable) -> Callable:
        launches = self

        def run(this, *args, **kwargs):
            fn = getattr(this, "fn", None)
            code = getattr(fn, "__code__", None)
            tensors = tensor_args(args, kwargs)
            launches.launches.append((getattr(fn, "__name__", "?"), code.co_filename if code else "?", tensors))
            with disabled_modes():
                before = [x.detach().clone() for x in tensors]
            # The check machinery's trace hook watches for calls of the course's reference; a kernel body
            # is no place for one (a launch of the course's kernel is caught here), and traced, the
            # interpreter runs about 3x slower. It is paused through the machinery's own switch.
            trace, settrace = sys.gettrace(), getattr(_guard, "_own_settrace", None)
            try:
                with disabled_modes(), launches.calls.pause():
                    if settrace is not None and trace is not None:
                        settrace(None)
                    return original(this, *args, **kwargs)
            except NotImplementedError as e:
                if not e.args:
                    raise
                raise KernelUnsupported(f"Triton {triton_version()} cannot run this kernel: {e}") from None
            except Exception as e:
                text = str(e)
                if text == "NotImplementedError()":  # the interpreter wraps a kernel body's bare raise
                    raise NotImplementedError() from None
                if "active drivers" in text and cls.__name__ == "JITFunction" and not torch.cuda.is_available():
                    raise RuntimeError(GPU_KERNEL_ON_CPU) from None
                raise
            finally:
                if settrace is not None and trace is not None:
                    settrace(trace)
                with disabled_modes():
                    launches.prov.kernel_launch(tensors, before)

        return run

    def _patch(self, cls: type, name: str, new: Any) -> None:
        self.patched.append((cls, name, cls.__dict__.get(name)))  # None: inherited
        setattr(cls, name, new)

    def __enter__(self):
        for cls in runner_classes():
            self._patch(cls, "run", self._launch(cls, cls.run))
        if self.interpreter:
            try:
                from triton.runtime.autotuner import Autotuner
            except ImportError:
                Autotuner = None
            if Autotuner is not None and hasattr(Autotuner, "_bench"):
                self._patch(Autotuner, "_bench", lambda this, *args, config, **meta: [0.0, 0.0, 0.0])
        return self

    def __exit__(self, *exc):
        for cls, name, original in reversed(self.patched):
            if original is None:
                delattr(cls, name)
            else:
                setattr(cls, name, original)
        self.patched.clear()
        return False


def triton_version() -> str:
    """The installed Triton's version, read without importing it (importing Triton before
    helpers.runtime.configure_triton() has run would leave its own library compiled-only)."""
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return "?"


def kernel_device() -> torch.device:
    """Where the learner's kernel runs: the CPU under Triton's interpreter, else the GPU."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda")
