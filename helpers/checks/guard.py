"""The integrity guard and the safe call: what a check trusts, and how it runs learner code.

- **Bound at import.** Every torch, ``math`` and builtin function a comparison, the guard or the
  call machinery uses is bound here, once, so that replacing ``torch.isclose`` (or
  ``sys.settrace``, or ``isinstance``) later changes nothing in a check.
- **The guard** (:class:`_Guard`) snapshots, at import, the course's own modules (every
  ``helpers.*`` module dict, the classes they define, the code of their functions) and the parts
  of torch, ``math`` and ``builtins`` a check relies on (``torch.Tensor``'s methods included).
  :func:`verify_integrity` names what changed and puts it back. Torch modes left open
  (``TorchFunctionMode``, ``torch.set_default_device``) are undone by :func:`_restore_torch_state`.
- **Refusing the reference.** :func:`is_course_reference` and :func:`_watched` recognise the
  course's own implementation of an exercise by code object, also when it is called from inside
  the learner's function (a trace hook, in every thread the function starts).
- **Time limits.** :func:`_call_with_time_limit` stops a call with ``_Alarm`` (SIGALRM, or a
  watchdog thread where there is none); a real interrupt is told apart from one the learner raised.
- **Plain data.** :func:`_plain` turns what the learner returned into exact tensors and plain
  numbers, or refuses it (:class:`_Refusal`): tensor and number subclasses, meta tensors, tensors
  on another device than the inputs, sparse and nested tensors, Mappings that are not dicts. Every
  diagnosis a check makes afterwards runs on that plain data only.
"""

from __future__ import annotations

import builtins
import collections.abc
import functools
import math
import operator
import os
import signal
import sys
import threading
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional  # noqa: F401  (watched by the integrity guard)

MUTABLE_NAMES: set[str] = {"helpers.checks.core.DEFAULT_TIME_LIMIT_S"}
"""``module.name`` entries the integrity guard lets change (tests shorten the time limit)."""

# --------------------------------------------------------------------------- bound at import
# Everything a comparison, the guard or the call machinery uses is bound here, once, so that
# replacing torch.isclose (or sys.settrace, or isinstance) later changes nothing in a check.

_Tensor = torch.Tensor
_TensorBase = torch._C.TensorBase  # an immutable type: its methods cannot be replaced
_Parameter = torch.nn.Parameter
_Size = torch.Size
_isclose, _allclose, _equal, _eq = torch.isclose, torch.allclose, torch.equal, torch.eq
_isfinite, _isnan, _nan_to_num, _ones_like = torch.isfinite, torch.isnan, torch.nan_to_num, torch.ones_like
_float64, _bool, _strided = torch.float64, torch.bool, torch.strided
_Mapping = collections.abc.Mapping
_get_default_dtype, _set_default_dtype = torch.get_default_dtype, torch.set_default_dtype
_DEVICE_CONTEXT = getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None)  # where torch.set_default_device keeps its mode
_set_default_device = torch.set_default_device
_is_grad_enabled, _set_grad_enabled = torch.is_grad_enabled, torch.set_grad_enabled
_len_tf = getattr(torch._C, "_len_torch_function_stack", lambda: 0)
_len_td = getattr(torch._C, "_len_torch_dispatch_stack", lambda: 0)
_pop_tf = getattr(torch._C, "_pop_torch_function_stack", None)
_pop_td = getattr(torch._C, "_pop_torch_dispatch_stack", None)
_tf_at = getattr(torch._C, "_get_function_stack_at", None)
_settrace, _gettrace = sys.settrace, sys.gettrace
_thread_settrace, _thread_gettrace = threading.settrace, getattr(threading, "gettrace", lambda: None)
_signal, _setitimer, _getsignal = signal.signal, getattr(signal, "setitimer", None), signal.getsignal
_isclose_num = math.isclose
_type, _isinstance, _issubclass, _len, _vars = type, isinstance, issubclass, len, vars
_FunctionType = types.FunctionType
_MISSING = object()


# --------------------------------------------------------------------------- the integrity guard


def _is_dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def _torch_wrapper_of(new: Any, old: Any) -> bool:
    """Is ``new`` a wrapper that torch itself made around ``old`` (``torch._disable_dynamo``)?"""
    code = getattr(new, "__code__", None) if _type(new) is _FunctionType else None
    return code is not None and getattr(new, "__wrapped__", None) is old and code.co_filename.startswith(_TORCH_DIR)


# __slotnames__: copyreg caches it on a class the first time an instance is pickled (torch.save).
_CLASS_ADDITIONS_ALLOWED = {"__annotations__", "__annotate__", "__abstractmethods__", "__slotnames__"}


class _Guard:
    """Snapshots of what checks rely on; ``problems()`` names what changed and puts it back."""

    def __init__(self):
        self.modules: dict[str, tuple[types.ModuleType, dict[str, Any]]] = {}
        self.classes: dict[str, tuple[type, dict[str, Any]]] = {}
        self.functions: dict[str, tuple[Any, Any, Any, Any]] = {}
        self.seen_modules = 0

    # -- taking snapshots

    def _watch_function(self, qualname: str, fn: Any) -> None:
        if _type(fn) in (staticmethod, classmethod):
            fn = fn.__func__
        if _type(fn) is _FunctionType and qualname not in self.functions:
            self.functions[qualname] = (fn, fn.__code__, fn.__defaults__, fn.__kwdefaults__)

    def watch_class(self, qualname: str, cls: type) -> None:
        if qualname in self.classes:
            return
        snap = dict(_vars(cls))
        self.classes[qualname] = (cls, snap)
        for key, value in snap.items():
            self._watch_function(f"{qualname}.{key}", value)

    def watch_module(self, name: str, module: types.ModuleType) -> None:
        """Snapshot a module's entries (new names since a previous snapshot are added)."""
        d = _vars(module)
        if name == "builtins":
            keep = {k: v for k, v in d.items()
                    if not k.startswith("_") and _type(v) in (types.BuiltinFunctionType, type)}
        elif name == "helpers" or name.startswith("helpers."):
            keep = {k: v for k, v in d.items() if not _is_dunder(k)}
        else:
            keep = {k: v for k, v in d.items() if not k.startswith("_")}
        _, entries = self.modules.setdefault(name, (module, {}))
        for key, value in keep.items():
            if key in entries:
                continue
            entries[key] = value
            if name.startswith("helpers"):
                self._watch_function(f"{name}.{key}", value)
                if _isinstance(value, type) and getattr(value, "__module__", None) == name:
                    self.watch_class(f"{name}.{key}", value)
            elif name.startswith("torch"):
                self._watch_function(f"{name}.{key}", value)

    def take(self) -> None:
        for module in (builtins, math, operator, torch, torch.nn.functional, torch.linalg, torch.special,
                       torch.autograd, torch.fft):
            self.watch_module(module.__name__, module)
        self.watch_class("torch.Tensor", _Tensor)
        self.watch_class("torch.nn.Parameter", _Parameter)
        self.extend()

    def extend(self) -> None:
        """Watch every ``helpers.*`` module loaded since the last look (and names they added)."""
        if _len(sys.modules) == self.seen_modules:
            return
        self.seen_modules = _len(sys.modules)
        for name, module in list(sys.modules.items()):
            if (name == "helpers" or name.startswith("helpers.")) and _isinstance(module, types.ModuleType):
                self.watch_module(name, module)

    # -- comparing

    def problems(self, restore: bool = True) -> list[str]:
        """What changed since the snapshot, as ``torch.isclose was replaced``; put back if ``restore``."""
        found: list[str] = []
        for name, (module, entries) in self.modules.items():
            d = _vars(module)
            for key, value in list(entries.items()):
                current = d.get(key, _MISSING)
                if current is not value and _torch_wrapper_of(current, value):
                    entries[key] = current  # torch wrapped its own function (torch._dynamo does at import)
                    self.functions.pop(f"{name}.{key}", None)
                    self._watch_function(f"{name}.{key}", current)
                elif current is not value and f"{name}.{key}" not in MUTABLE_NAMES:
                    found.append(f"{name}.{key} was {'deleted' if current is _MISSING else 'replaced'}")
                    if restore:
                        d[key] = value
        for qualname, (cls, snap) in self.classes.items():
            current = cls.__dict__
            for key, value in snap.items():
                now = current.get(key, _MISSING)
                if now is not value:
                    found.append(f"{qualname}.{key} was {'deleted' if now is _MISSING else 'replaced'}")
                    if restore:
                        type.__setattr__(cls, key, value)
            for key in [k for k in current if k not in snap and k not in _CLASS_ADDITIONS_ALLOWED]:
                found.append(f"{qualname}.{key} was added")
                if restore:
                    type.__delattr__(cls, key)
        for qualname, (fn, code, defaults, kwdefaults) in self.functions.items():
            if fn.__code__ is not code or fn.__defaults__ is not defaults or fn.__kwdefaults__ is not kwdefaults:
                found.append(f"the code of {qualname} was replaced")
                if restore:
                    fn.__code__, fn.__defaults__, fn.__kwdefaults__ = code, defaults, kwdefaults
        return found


_GUARD = _Guard()


def protect() -> None:
    """Snapshot every course module loaded so far (``helpers.checks`` calls it once all check
    modules are imported; modules loaded later are added the first time a check runs)."""
    from .. import reference  # noqa: F401  (every topic module, before any learner code runs)

    _GUARD.extend()


def verify_integrity(restore: bool = True) -> list[str]:
    """What the learner's code replaced among the course's and torch's functions (empty: nothing);
    with ``restore`` the originals are put back."""
    _GUARD.extend()
    return _GUARD.problems(restore)


def _default_device_context() -> Any:
    """The mode torch.set_default_device entered (None: the default, CPU). Read without calling
    torch, so that a mode left open cannot intercept it."""
    return getattr(_DEVICE_CONTEXT, "device_context", None)


def _torch_state() -> tuple:
    return _len_tf(), _len_td(), _default_device_context(), _get_default_dtype(), _is_grad_enabled()


def _restore_torch_state(before: tuple) -> list[str]:
    """Undo what a learner's call left behind in torch's global state; name what mattered."""
    tf0, td0, context0, dtype0, grad0 = before
    found = []
    while _len_tf() > tf0:
        top = _tf_at(_len_tf() - 1) if _tf_at is not None else None
        if top is not None and top is _default_device_context() and top is not context0:
            found.append("torch's default device was changed (torch.set_default_device)")
            _set_default_device(None)  # exits that mode properly
        else:
            found.append(f"a TorchFunctionMode was left active ({_type(top).__name__})")
            _pop_tf()
    if _default_device_context() is not context0:  # a context that is no longer on the stack
        found.append("torch's default device was changed (torch.set_default_device)")
        _DEVICE_CONTEXT.device_context = context0
    while _len_td() > td0:
        found.append("a TorchDispatchMode was left active")
        _pop_td()
    if _get_default_dtype() != dtype0:
        found.append(f"torch's default dtype was changed to {_get_default_dtype()}")
        _set_default_dtype(dtype0)
    if _is_grad_enabled() != grad0:
        _set_grad_enabled(grad0)  # harmless, so put back silently
    return list(dict.fromkeys(found))


# --------------------------------------------------------------------------- the course's references


def _reference_codes(names: Iterable[str]) -> frozenset:
    """Code objects of every course function named like an exercise (or like a helper a check
    forbids), outside helpers.checks; a private name (``_simulate``: a check's own model of the
    answer) is looked up in helpers.checks too."""
    codes = set()
    for module_name, module in list(sys.modules.items()):
        if not (module_name == "helpers" or module_name.startswith("helpers.")):
            continue
        in_checks = module_name.startswith("helpers.checks")
        d = getattr(module, "__dict__", {})
        for name in names:
            if in_checks and not name.startswith("_"):
                continue
            fn, depth = d.get(name), 0
            while fn is not None and depth < 5:
                if _type(fn) is _FunctionType:
                    codes.add(fn.__code__)
                fn, depth = getattr(fn, "__wrapped__", None), depth + 1
    for qualname, (_, code, _, _) in _GUARD.functions.items():
        if qualname.startswith("helpers.") and not qualname.startswith("helpers.checks") and qualname.rsplit(".", 1)[-1] in names:
            codes.add(code)
    return frozenset(codes)


def is_course_reference(fn: Any, name: str) -> bool:
    """True when ``fn`` is the course's own implementation of exercise ``name`` (or an alias,
    ``functools.partial`` or ``functools.wraps`` wrapper of it)."""
    codes = _reference_codes((name,))
    for _ in range(5):
        if _type(fn) is functools.partial:
            fn = fn.func
            continue
        if getattr(fn, "__code__", None) in codes:
            return True
        fn = getattr(fn, "__wrapped__", None)
        if fn is None:
            return False
    return False


# --------------------------------------------------------------------------- calling safely


class _Alarm(BaseException):
    """Raised inside the learner's code when the time limit expires (BaseException: a bare
    ``except Exception`` in learner code cannot swallow it)."""


def _mark_real(e: BaseException) -> BaseException:
    e._attn_course_real_interrupt = True  # type: ignore[attr-defined]
    return e


def _call_with_time_limit(fn: Callable, args: tuple, kwargs: dict, seconds: float) -> Any:
    """``fn(*args, **kwargs)`` stopped by ``_Alarm`` after ``seconds``. A KeyboardInterrupt that
    comes from a real SIGINT (the stop button, a grader's cell time limit) is marked as real."""
    use_signal = _setitimer is not None and threading.current_thread() is threading.main_thread()
    if use_signal:
        interrupted: list[bool] = []

        def on_alarm(signum, frame):
            raise _Alarm()

        previous_int = _getsignal(signal.SIGINT)  # None: a handler not installed from Python

        def on_interrupt(signum, frame):
            interrupted.append(True)
            if callable(previous_int):
                previous_int(signum, frame)
            elif previous_int != signal.SIG_IGN:
                raise KeyboardInterrupt()

        previous = _signal(signal.SIGALRM, on_alarm)
        if previous_int is not None:
            _signal(signal.SIGINT, on_interrupt)
        _setitimer(signal.ITIMER_REAL, seconds)
        try:
            return fn(*args, **kwargs)
        except KeyboardInterrupt as e:
            raise (_mark_real(e) if interrupted else e) from None
        finally:
            _setitimer(signal.ITIMER_REAL, 0)
            _signal(signal.SIGALRM, previous)
            if previous_int is not None:
                _signal(signal.SIGINT, previous_int)
    # No SIGALRM (Windows) or not the main thread: run in a daemon thread and stop waiting.
    box: dict[str, Any] = {}

    def target():
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    try:
        worker.join(seconds)
    except KeyboardInterrupt as e:
        raise _mark_real(e) from None
    if worker.is_alive():
        raise _Alarm()
    if "error" in box:
        raise box["error"]
    return box["value"]


def _trace_audit() -> tuple[Callable, Callable, Callable]:
    """An audit hook (permanent once added) that notices ``sys.settrace`` calls made while a
    learner's function is watched, other than the watcher's own: (own_settrace, begin, end)."""
    cell = {"watching": 0, "own": False, "changed": False}

    bootstrap = threading.Thread._bootstrap_inner.__code__

    def hook(event, args):
        # a thread started while watched installs the watcher's hook (threading.settrace) itself
        if event == "sys.settrace" and cell["watching"] and not cell["own"] \
                and sys._getframe(1).f_code is not bootstrap:
            cell["changed"] = True

    def own_settrace(fn):
        cell["own"] = True
        try:
            _settrace(fn)
        finally:
            cell["own"] = False

    def begin():
        if not cell["watching"]:
            cell["changed"] = False
        cell["watching"] += 1

    def end() -> bool:
        cell["watching"] -= 1
        return cell["changed"]

    sys.addaudithook(hook)
    return own_settrace, begin, end


_own_settrace, _begin_watch, _end_watch = _trace_audit()


def _watched(fn: Callable, codes: frozenset, hits: list, state: dict) -> Callable:
    """``fn`` run under a trace hook that records calls of the code objects in ``codes`` (the
    course's reference), in this thread and in threads it starts; a debugger's hook is chained."""
    def run(*args, **kwargs):
        previous, previous_thread = _gettrace(), _thread_gettrace()

        def tracer(frame, event, arg):
            if event == "call":
                code = frame.f_code
                if code in codes and not hits:
                    hits.append(f"{frame.f_globals.get('__name__', '?')}.{getattr(code, 'co_qualname', code.co_name)}")
            return previous(frame, event, arg) if previous is not None else None

        _begin_watch()
        _own_settrace(tracer)
        _thread_settrace(tracer)
        try:
            return fn(*args, **kwargs)
        finally:
            changed = _gettrace() is not tracer or _thread_gettrace() is not tracer
            _own_settrace(previous)
            _thread_settrace(previous_thread)
            state["trace_changed"] = _end_watch() or changed

    return run


def _snapshot(x: Any, depth: int = 0) -> Any:
    """A deep copy of the containers and tensors among a call's arguments."""
    t = _type(x)
    if _issubclass(t, _Tensor):
        return x.detach().clone()
    if depth > 20 or t is _Size:
        return x
    if _issubclass(t, list):
        return [_snapshot(e, depth + 1) for e in list.__iter__(x)]
    if _issubclass(t, tuple):
        return tuple(_snapshot(e, depth + 1) for e in tuple.__iter__(x))
    if _issubclass(t, dict):
        return {k: _snapshot(v, depth + 1) for k, v in dict.items(x)}
    if _issubclass(t, set):
        return set(set.__iter__(x))
    return x


def _same(a: Any, b: Any, depth: int = 0) -> bool:
    """Is ``b`` (an argument after the call) what ``a`` (its snapshot) recorded?"""
    if _issubclass(_type(a), _Tensor):
        return (_issubclass(_type(b), _Tensor) and a.shape == b.shape and a.dtype == b.dtype
                and (a.device.type == "meta" or bool(_equal(_nan_to_num(a), _nan_to_num(b.detach())))))
    if depth > 20:
        return True
    if _type(a) is list:
        return _issubclass(_type(b), list) and _len(a) == list.__len__(b) and all(
            _same(x, y, depth + 1) for x, y in zip(a, list.__iter__(b)))
    if _type(a) is tuple:
        return _issubclass(_type(b), tuple) and _len(a) == tuple.__len__(b) and all(
            _same(x, y, depth + 1) for x, y in zip(a, tuple.__iter__(b)))
    if _type(a) is dict:
        return _issubclass(_type(b), dict) and set(a) == set(dict.keys(b)) and all(
            _same(a[k], dict.__getitem__(b, k), depth + 1) for k in a)
    if _type(a) is set:
        return _issubclass(_type(b), set) and a == set(set.__iter__(b))
    if a is b:
        return True
    if _type(a) in (int, float, bool, complex, str, bytes):  # an item of a list or dict was replaced
        return _type(b) is _type(a) and (a == b or (a != a and b != b))
    return False  # another object in place of the one that was there



class _Refusal(Exception):
    def __init__(self, message: str, hint: str, slug: str):
        super().__init__(message)
        self.message, self.hint, self.slug = message, hint, slug


_DEVICE_HINT = ("create new tensors on the inputs' device (device=x.device, torch.zeros_like(x), x.new_zeros(...)), "
                "not on a fixed device such as the `device` that setup() returns.")
_META_HINT = ("a tensor on the meta device has a shape but no values: create tensors on the inputs' device, "
              "device=x.device (not device='meta').")


def _plain(x: Any, where: str, device: torch.device | None, depth: int = 0) -> Any:
    """What the learner returned as plain data: exact tensors on the right device, plain numbers,
    plain tuples/lists/dicts. Raises _Refusal for what cannot be trusted."""
    t = _type(x)
    if t is _Tensor or t is _Parameter:
        if t is _Parameter:
            x = _TensorBase.as_subclass(x, _Tensor)
        dev = _TensorBase.device.__get__(x)
        if dev.type == "meta":
            raise _Refusal(f"{where} is a tensor on the meta device.", _META_HINT, "meta-device")
        if device is not None and dev != device:
            raise _Refusal(f"{where} is on {dev}, but the inputs are on {device}.", _DEVICE_HINT, "wrong-device")
        layout = _TensorBase.layout.__get__(x)
        if layout != _strided or _TensorBase.is_nested.__get__(x):
            kind = "nested" if _TensorBase.is_nested.__get__(x) else str(layout).removeprefix("torch.")
            raise _Refusal(f"{where} is a {kind} tensor; checks compare dense tensors.",
                           "return a dense tensor: convert it with .to_dense() (or build it dense).", "not-dense")
        return x
    if _issubclass(t, _Tensor):
        raise _Refusal(f"{where} is a {t.__name__}, a subclass of torch.Tensor; checks accept plain tensors only.",
                       "return a plain torch.Tensor (subclasses can change how comparisons behave).", "tensor-subclass")
    if t in (int, float, bool, complex, str, bytes) or x is None:
        return x
    if _issubclass(t, (int, float, complex, str)) and t.__module__ != "numpy":
        base = next(b for b in (bool, int, float, complex, str) if _issubclass(t, b))
        raise _Refusal(f"{where} is a {t.__name__}, a subclass of {base.__name__}; checks accept plain Python "
                       f"numbers only.", f"return a plain {base.__name__}: the number itself, not an object "
                       "that behaves like one.", "number-subclass")
    if depth > 20:
        return x
    if t is _Size:
        return x
    if _issubclass(t, tuple):
        return tuple(_plain(e, f"item {i} of {where}", device, depth + 1) for i, e in enumerate(tuple.__iter__(x)))
    if _issubclass(t, list):
        return [_plain(e, f"item {i} of {where}", device, depth + 1) for i, e in enumerate(list.__iter__(x))]
    if _issubclass(t, dict):
        return {k: _plain(v, f"{where}[{key_text(k)}]", device, depth + 1) for k, v in dict.items(x)}
    if _Mapping in _type.__dict__["__mro__"].__get__(t):
        raise _Refusal(f"{where} is a {_type.__dict__['__name__'].__get__(t)}, a Mapping that is not a dict; "
                       "checks read plain dicts only.", "return a plain dict: {key: value, ...} or dict(...).", "mapping-not-dict")
    return x


def key_text(k: Any) -> str:
    """A dict key as a message shows it, without running a learner's ``__repr__``."""
    return repr(k) if _type(k) in (str, int, float, bool) else _type.__dict__["__name__"].__get__(_type(k))


def _input_device(args: tuple, kwargs: dict) -> torch.device | None:
    """The one device of the tensors among the arguments (looking one level into containers)."""
    devices = set()
    for a in (*args, *kwargs.values()):
        items = a if _type(a) in (list, tuple) else a.values() if _type(a) is dict else (a,)
        for x in items:
            if _issubclass(_type(x), _Tensor):
                devices.add(_TensorBase.device.__get__(x))
    return devices.pop() if _len(devices) == 1 else None




_GUARD.take()
