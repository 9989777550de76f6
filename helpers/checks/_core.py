"""The machinery every exercise check shares.

A check is written as a function ``body(t)`` decorated with :func:`exercise`; ``t`` is a
:class:`Trial` bound to the learner's function. The body builds its cases and **computes every
expected value first** (``t.cases(reference, inputs)`` does both), then calls the learner's
function through ``t.call`` and compares with ``t.tensor`` / ``t.number`` / ``t.tuple``.

What the machinery guarantees, so that a check body does not have to:

- **It cannot be fooled from inside the learner's code.** Comparisons use torch functions bound
  when this module is imported. An integrity guard snapshots, at import, the course's own modules
  (every ``helpers.*`` module dict, the classes they define, the code of their functions) and the
  parts of torch, ``math`` and ``builtins`` a check relies on (``torch.Tensor``'s methods
  included). Before a check runs, after every call of the learner's function and before a pass is
  declared, the guard compares; anything replaced is put back and the check fails, naming it.
  Torch modes left open (``TorchFunctionMode``, ``torch.set_default_device``) are treated alike.
  What the learner returns becomes plain data first: a ``torch.Tensor`` subclass, an ``int`` /
  ``float`` subclass, an output on the ``meta`` device or on another device than the inputs is
  refused with a message. A function that calls the course's own reference for the same exercise
  (``helpers.reference.<name>`` or the topic module's function, matched by code object, so that
  aliases and wrappers are caught) is refused too.
- **It cannot be crashed.** ``NotImplementedError`` ("not attempted"), any exception,
  ``SystemExit``, a ``KeyboardInterrupt`` the learner raised, a time-out, an input modified in
  place (tensors, lists, dicts) all become a failed check with a clear message, recorded.
- **Hints are graduated.** ``mistakes={hint: wrong output}`` (matched by output), ``error_hints``
  (matched by exception text) and ``diagnosis=`` are *recognised* mistakes, named at the first
  failure. Otherwise the first failure says what differs and points at the teaching section
  (``exercise(section=...)``). ``hint=`` of ``t.tensor`` / ``t.number`` is the full recipe, shown
  only when the same check fails again in the same kernel.
- **It reads as feedback.** In IPython a :class:`CheckFailed` renders as its message alone,
  wrapped at word boundaries, without the check machinery's traceback (the exception still
  propagates). An unattempted exercise shows a notice and does not stop "Run All", unless
  ``RAISE_NOT_ATTEMPTED_ENV`` is set (pytest, nbval and grading set it) or the code runs outside
  IPython. A pass prints one line and, in IPython, the model answer of the exercise's "why it
  matters" question (from ``helpers/model_answers.json``, written by ``make exercises``).
- **Every outcome is recorded** as a :class:`CheckResult`, handed to each callable registered with
  :func:`add_recorder`.
  :func:`run_check` runs a check without printing or raising and returns the result.
"""

from __future__ import annotations

import builtins
import functools
import inspect
import json
import math
import numbers
import operator
import os
import re
import signal
import sys
import textwrap
import threading
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional  # noqa: F401  (watched by the integrity guard)

# --------------------------------------------------------------------------- constants for the course

RAISE_NOT_ATTEMPTED_ENV = "ATTN_COURSE_RAISE_NOT_ATTEMPTED"
"""When this environment variable is ``"1"``, an unattempted exercise raises :class:`NotAttempted`
even in an interactive session. The repository's ``conftest.py`` sets it for pytest (and so for
the notebook kernels nbval starts) and the grader sets it in its kernels. Outside IPython an
unattempted exercise always raises."""

DEFAULT_TIME_LIMIT_S = 20.0
WRAP_WIDTH = 92  # columns at which messages shown in a notebook are wrapped (at word boundaries)
MODEL_ANSWERS_FILE = "model_answers.json"  # package data of `helpers`, written by `make exercises`

MUTABLE_NAMES: set[str] = {"helpers.checks._core.DEFAULT_TIME_LIMIT_S"}
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
_float64, _bool, _strided, _meta = torch.float64, torch.bool, torch.strided, torch.device("meta")
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
_type, _isinstance, _issubclass, _len, _vars, _id = type, isinstance, issubclass, len, vars, id
_FunctionType = types.FunctionType
_MISSING = object()


# --------------------------------------------------------------------------- exercises and results


@dataclass(frozen=True)
class Exercise:
    """One graded exercise: id "1.1", function name, title, points, stars, notebook stem, whether
    it is a bonus (its points are reported apart and never block a pass), and the section of the
    teaching notebook it builds on (named in first-failure pointers)."""

    id: str
    name: str
    title: str
    points: int
    stars: int
    notebook: str
    bonus: bool = False
    section: str | None = None

    @property
    def pointer(self) -> str:
        """Where to revisit: ``notebooks/05_multihead.ipynb, section 3. Why W_O exists``."""
        where = f"notebooks/{self.notebook}.ipynb"
        return f"{where}, section {self.section}" if self.section else where


EXERCISES: dict[str, Exercise] = {}  # function name -> Exercise


def seeded(seed: int) -> torch.Generator:
    """A CPU generator with a fixed seed: every case a check builds is reproducible."""
    return torch.Generator().manual_seed(seed)


class CheckFailed(AssertionError):
    """A check did not pass. ``status`` is what `make grade` reports.

    Attributes: ``hint`` (the hint line the learner was shown, "" if none), ``instructor_hint``
    (what an instructor's table should show: the recognised mistake, else what differed),
    ``recognised`` (a mistake was named), ``recipe`` (the full recipe, shown on a repeated
    failure), ``summary`` (the first line of what differed), ``case``, ``exercise``.
    """

    status = "failed"

    def __init__(self, message: str, hint: str = "", *, instructor_hint: str | None = None, recognised: bool = False,
                 recipe: str = "", summary: str = "", case: str = "", exercise: Exercise | None = None):
        super().__init__(message)
        self.hint = hint
        self.instructor_hint = hint if instructor_hint is None else instructor_hint
        self.recognised = recognised
        self.recipe = recipe
        self.summary = summary
        self.case = case
        self.exercise = exercise

    def _render_traceback_(self) -> list[str]:
        """IPython shows these lines instead of a traceback: the message alone, marked."""
        mark = "◻" if _isinstance(self, NotAttempted) else "✗"
        lines = wrap(str(self)).split("\n")
        return [f"\x1b[1;31m{mark} {lines[0]}\x1b[0m", *lines[1:]]


class NotAttempted(CheckFailed):
    status = "not attempted"


class TimedOut(CheckFailed):
    status = "timed out"


class LearnerError(CheckFailed):
    """The learner's function raised an exception."""

    status = "error"


class Refused(CheckFailed):
    """The learner's code changed the course's or torch's functions, called the course's
    reference, or returned something that cannot be trusted (a subclass, a lying number)."""


@dataclass
class CheckResult:
    """The outcome of one run of a check, handed to every recorder.

    ``status``: passed / failed / not attempted / error / timed out. ``message``: what the learner
    saw. ``hint``: the hint an instructor should see (the recognised mistake, else what
    differed). ``is_reference``: the function checked was the course's own reference."""

    exercise: Exercise
    status: str
    message: str = ""
    hint: str = ""
    recognised: bool = False
    is_reference: bool = False
    error: CheckFailed | None = field(default=None, repr=False)

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    @property
    def name(self) -> str:
        return self.exercise.name


RECORDERS: list[Callable[[CheckResult], None]] = []


def add_recorder(recorder: Callable[[CheckResult], None]) -> Callable[[CheckResult], None]:
    """Call ``recorder(result)`` after every check from now on; returns it (for remove_recorder)."""
    RECORDERS.append(recorder)
    return recorder


def remove_recorder(recorder: Callable[[CheckResult], None]) -> None:
    if recorder in RECORDERS:
        RECORDERS.remove(recorder)


def _record(result: CheckResult) -> None:
    for recorder in list(RECORDERS):
        recorder(result)


# --------------------------------------------------------------------------- describing values


def describe(x: Any) -> str:
    """A compact description: ``float32[2, 3, 5, 4]``, ``int 7``, ``tuple(3)``, ``None``."""
    t = _type(x)
    if t is _Tensor or t is _Parameter:
        return f"{str(x.dtype).removeprefix('torch.')}{list(x.shape)}"
    if _issubclass(t, _Tensor):
        return f"{t.__name__} (a torch.Tensor subclass)"
    if x is None:
        return "None"
    if t is bool:
        return f"bool {x}"
    if t in (int, float):
        return f"{t.__name__} {x!r}"
    if t in (tuple, list):
        if _len(x) <= 6 and all(_type(e) in (int, float, bool) for e in x):
            return repr(x)
        return f"{t.__name__} of {_len(x)}: (" + ", ".join(describe(e) for e in x[:4]) + (", ..." if _len(x) > 4 else "") + ")"
    if t.__module__ == "numpy":
        return f"numpy.{t.__name__}"
    return t.__name__


def describe_case(**kwargs: Any) -> str:
    """``x=float32[2, 5, 12], n_heads=3``: how a failing case is named in messages."""
    return ", ".join(f"{k}={describe(v)}" if _issubclass(_type(v), _Tensor) else f"{k}={v!r}" for k, v in kwargs.items())


def _fmt(v: float) -> str:
    return f"{v:.4g}" if math.isfinite(v) else str(v)


def _preview(t: torch.Tensor, n: int = 6) -> str:
    flat = t.detach().reshape(-1)[:n].tolist()
    body = ", ".join(_fmt(float(v)) for v in flat)
    return f"[{body}{', ...' if t.numel() > n else ''}]"


def wrap(text: str, width: int = WRAP_WIDTH) -> str:
    """Wrap each line of a message at word boundaries, keeping its indentation; a ``hint:`` (or
    ``recipe:``, ``see:``) line continues under its first word."""
    out = []
    for line in text.split("\n"):
        if _len(line) <= width:
            out.append(line)
            continue
        indent = line[: _len(line) - _len(line.lstrip())]
        m = re.match(r"\s*(hint|recipe|see|on case): ", line)
        hang = " " * (m.end() - _len(indent)) if m else "  "
        out.append(textwrap.fill(line.strip(), width=width, initial_indent=indent, subsequent_indent=indent + hang,
                                 break_long_words=False, break_on_hyphens=False))
    return "\n".join(out)


# --------------------------------------------------------------------------- the integrity guard


def _is_dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def _torch_wrapper_of(new: Any, old: Any) -> bool:
    """Is ``new`` a wrapper that torch itself made around ``old`` (``torch._disable_dynamo``)?"""
    code = getattr(new, "__code__", None) if _type(new) is _FunctionType else None
    return code is not None and getattr(new, "__wrapped__", None) is old and code.co_filename.startswith(_TORCH_DIR)


_CLASS_ADDITIONS_ALLOWED = {"__annotations__", "__annotate__", "__abstractmethods__"}


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
    """Code objects of every course function (outside helpers.checks) named like an exercise."""
    codes = set()
    for module_name, module in list(sys.modules.items()):
        if not (module_name == "helpers" or module_name.startswith("helpers.")) or module_name.startswith("helpers.checks"):
            continue
        d = getattr(module, "__dict__", {})
        for name in names:
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

    def hook(event, args):
        if event == "sys.settrace" and cell["watching"] and not cell["own"]:
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
            if event == "call" and frame.f_code in codes and not hits:
                code = frame.f_code
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


def _short(x: Any, n: int = 60) -> str:
    try:
        text = repr(x)
    except Exception:  # noqa: BLE001 - a learner's object whose repr fails
        text = describe(x)
    return text if _len(text) <= n else text[: n - 3] + "..."


def _exception_summary(e: BaseException) -> str:
    try:
        text = str(e).strip()
    except Exception:  # noqa: BLE001 - an exception whose __str__ fails
        text = ""
    first = text.splitlines()[0] if text else ""
    if _len(first) > 300:
        first = first[:297] + "..."
    return f"{_type(e).__name__}: {first}".strip().rstrip(":")


# Recognised causes of exceptions, tried after a check's own error_hints.
CORE_ERROR_HINTS = {
    r"Expected all tensors to be on the same device|found at least two devices": "create new tensors on the "
    "inputs' device (device=x.device, torch.zeros_like(x)), not on a fixed device such as the `device` that "
    "setup() returns.",
    r"^RecursionError": "your function calls itself without end: a recursion without a base case, or a name that "
    "refers back to your own function.",
}


class _Refusal(Exception):
    def __init__(self, message: str, hint: str):
        super().__init__(message)
        self.message, self.hint = message, hint


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
            raise _Refusal(f"{where} is a tensor on the meta device.", _META_HINT)
        if device is not None and dev != device:
            raise _Refusal(f"{where} is on {dev}, but the inputs are on {device}.", _DEVICE_HINT)
        return x
    if _issubclass(t, _Tensor):
        raise _Refusal(f"{where} is a {t.__name__}, a subclass of torch.Tensor; checks accept plain tensors only.",
                       "return a plain torch.Tensor (subclasses can change how comparisons behave).")
    if t in (int, float, bool, complex, str, bytes) or x is None:
        return x
    if _issubclass(t, (int, float, complex, str)) and t.__module__ != "numpy":
        base = next(b for b in (bool, int, float, complex, str) if _issubclass(t, b))
        raise _Refusal(f"{where} is a {t.__name__}, a subclass of {base.__name__}; checks accept plain Python "
                       f"numbers only.", f"return a plain {base.__name__}: the number itself, not an object "
                       "that behaves like one.")
    if depth > 20:
        return x
    if t is _Size:
        return x
    if _issubclass(t, tuple):
        return tuple(_plain(e, f"item {i} of {where}", device, depth + 1) for i, e in enumerate(tuple.__iter__(x)))
    if _issubclass(t, list):
        return [_plain(e, f"item {i} of {where}", device, depth + 1) for i, e in enumerate(list.__iter__(x))]
    if _issubclass(t, dict):
        return {k: _plain(v, f"{where}[{k!r}]", device, depth + 1) for k, v in dict.items(x)}
    return x


def _input_device(args: tuple, kwargs: dict) -> torch.device | None:
    """The one device of the tensors among the arguments (looking one level into containers)."""
    devices = set()
    for a in (*args, *kwargs.values()):
        items = a if _type(a) in (list, tuple) else a.values() if _type(a) is dict else (a,)
        for x in items:
            if _issubclass(_type(x), _Tensor):
                devices.add(_TensorBase.device.__get__(x))
    return devices.pop() if _len(devices) == 1 else None


# --------------------------------------------------------------------------- model answers


_MODEL_ANSWERS: dict[str, Any] = {}


def model_answer(name: str) -> dict | None:
    """``{"exercise", "notebook", "question", "answer"}`` for exercise ``name`` from the package's
    model answers (written by ``make exercises`` from ``solutions/``), or None."""
    if "answers" not in _MODEL_ANSWERS:
        try:
            from importlib.resources import files

            _MODEL_ANSWERS["answers"] = json.loads((files("helpers") / MODEL_ANSWERS_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError, ModuleNotFoundError):
            _MODEL_ANSWERS["answers"] = {}
    return _MODEL_ANSWERS["answers"].get(name)


def _ipython():
    module = sys.modules.get("IPython")
    get = getattr(module, "get_ipython", None)
    try:
        return get() if get is not None else None
    except Exception:  # noqa: BLE001
        return None


def _interactive() -> bool:
    """An IPython session in which an unattempted exercise shows a notice instead of raising."""
    return _ipython() is not None and os.environ.get(RAISE_NOT_ATTEMPTED_ENV, "") != "1"


def _show_model_answer(ex: Exercise) -> None:
    answer = model_answer(ex.name)
    if not answer or _ipython() is None:
        return
    from IPython.display import display

    question = answer.get("question", "")
    md = "<details><summary><b>Why it matters</b>: the model answer (click to open)</summary>\n\n"
    if question:
        md += f"**Question.** {question}\n\n"
    md += f"{answer['answer']}\n\n</details>"
    plain = (f"Why it matters: {question}\n" if question else "") + answer["answer"]
    display({"text/markdown": md, "text/plain": plain}, raw=True)


# --------------------------------------------------------------------------- the trial


@dataclass
class Case:
    """One case of a check, with its expected output computed before any learner code runs."""

    args: tuple
    kwargs: dict
    expected: Any
    name: str


def eager_mistakes(models: Mapping[str, Callable[[], Any]]) -> dict[str, Any]:
    """Evaluate each mistake model (hint -> zero-argument callable giving the output that mistake
    produces) now, before the learner's code runs; drop the models that do not apply to this case
    (they raise). Pass the result as ``mistakes=`` to :meth:`Trial.tensor` / :meth:`Trial.number`."""
    out = {}
    for hint, model in models.items():
        try:
            out[hint] = model()
        except Exception:  # noqa: BLE001 - a mistake that cannot happen on this case
            continue
    return out


def flipped_causal(causal: bool, model: Callable[..., Callable[[], Any]]) -> dict[str, Callable[[], Any]]:
    """The mistake of a flipped ``causal`` flag, as one entry for :func:`eager_mistakes`;
    ``model(causal=...)`` returns the zero-argument callable of that output."""
    if causal:
        return {"causal=True was ignored: mask the scores so that query i reads keys j <= i only.":
                model(causal=False)}
    return {"causal=False here, but your output is causally masked: mask only when causal is True.":
            model(causal=True)}


_FAILURES: dict[str, int] = {}  # exercise name -> failures in this kernel (graduated hints)


def reset_attempts(name: str | None = None) -> None:
    """Forget earlier failures (of one exercise, or all): the next failure counts as the first."""
    if name is None:
        _FAILURES.clear()
    else:
        _FAILURES.pop(name, None)


class Trial:
    """Runs one learner function against the cases of one check.

    ``error_hints`` maps a regular expression (searched in ``"ExceptionName: message"``) to the
    hint shown when the learner's function raises a matching exception. ``forbidden_references``
    names the course functions the learner may not call (default: the exercise's own name).
    """

    def __init__(self, ex: Exercise, fn: Callable, time_limit: float = DEFAULT_TIME_LIMIT_S):
        self.ex = ex
        self.fn = fn
        self.learner_fn = fn
        self.time_limit = time_limit
        self.case = ""
        self.error_hints: dict[str, str] = {}
        self.forbidden_references: set[str] = {ex.name}
        self.is_reference = is_course_reference(fn, ex.name)
        self.repeat = _FAILURES.get(ex.name, 0) > 0

    # -- failing

    def fail(self, message: str, hint: str = "", kind: type[CheckFailed] = CheckFailed, *, recipe: str = "",
             generic: bool = False) -> None:
        """Fail with ``message`` (what differs). ``hint`` names the mistake and is always shown;
        ``generic=True`` marks it as a general tip rather than a recognised cause (the message
        then also points at the teaching section). ``recipe`` is the full recipe: shown only when
        this check has failed before in this kernel."""
        __tracebackhide__ = True
        ex = self.ex
        verdict = "not attempted" if kind is NotAttempted else "failed"
        where = f" on case: {self.case}" if self.case else ""
        lines = [f"{ex.id} {ex.name} {verdict}{where}", f"  {message}"]
        if hint:
            lines.append(f"  hint: {hint}")
        recognised = bool(hint) and not generic
        if not recognised and kind is not NotAttempted:
            lines.append(f"  see: {ex.pointer}")
        if recipe and recipe != hint:
            if self.repeat:
                lines.append(f"  recipe: {recipe}")
            else:
                lines.append("  (stuck? if this check fails again, it shows a step-by-step recipe)")
        summary = message.split("\n")[0].strip()
        instructor = hint if recognised else f"{summary}{where}"
        raise kind("\n".join(lines), hint, instructor_hint=instructor, recognised=recognised, recipe=recipe,
                   summary=summary, case=self.case, exercise=ex)

    # -- cases with expected values first

    def cases(self, reference: Callable, inputs: Iterable[Any]) -> list[Case]:
        """Build every case and compute its expected output now, before the learner's code runs.
        Each input is a tuple of arguments, a dict of keyword arguments, or a single argument;
        cases are named from the reference's parameter names (``describe_case``)."""
        try:
            signature = inspect.signature(reference)
        except (TypeError, ValueError):
            signature = None
        out = []
        for item in inputs:
            args, kwargs = ((), dict(item)) if _isinstance(item, Mapping) else (tuple(item), {}) if _type(item) is tuple else ((item,), {})
            try:
                named = signature.bind(*args, **kwargs).arguments if signature else {f"arg{i}": a for i, a in enumerate(args)} | kwargs
            except TypeError:
                named = {f"arg{i}": a for i, a in enumerate(args)} | kwargs
            out.append(Case(args, kwargs, reference(*args, **kwargs), describe_case(**named)))
        return out

    def run(self, case: Case) -> Any:
        """``t.call`` on one :class:`Case`."""
        __tracebackhide__ = True
        return self.call(*case.args, case=case.name, **case.kwargs)

    # -- calling

    def _argument_name(self, args: tuple, kwargs: dict, index: int) -> str:
        """The learner's name for argument ``index`` of the flattened (args + kwargs)."""
        names = [*(f"argument {i + 1}" for i in range(_len(args))), *kwargs]
        try:
            positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
            params = [p.name for p in inspect.signature(self.learner_fn).parameters.values() if p.kind in positional]
            for i in range(min(_len(args), _len(params))):
                names[i] = f"`{params[i]}`"
            for j, key in enumerate(kwargs):
                names[_len(args) + j] = f"`{key}`"
        except (TypeError, ValueError):
            pass
        return names[index] if index < _len(names) else f"argument {index + 1}"

    def call(self, *args: Any, case: str | None = None, **kwargs: Any) -> Any:
        """Call the learner's function on one case; return its output as plain data.

        Fails (with a clear message) when the function is not attempted, raises (SystemExit and a
        KeyboardInterrupt it raised itself included), runs past the time limit, modifies an
        argument in place, changes the course's or torch's functions, calls the course's reference
        for this exercise, or returns a tensor subclass, a number subclass, a meta tensor or a
        tensor on another device than the inputs.
        """
        __tracebackhide__ = True
        if case is not None:
            self.case = case
        before = _snapshot((args, kwargs))
        codes = frozenset() if self.is_reference else _reference_codes(self.forbidden_references)
        hits: list[str] = []
        state: dict[str, bool] = {}
        runner = _watched(self.fn, codes, hits, state) if codes else self.fn
        torch_before = _torch_state()
        raised: BaseException | None = None
        out = None
        try:
            out = _call_with_time_limit(runner, args, kwargs, self.time_limit)
        except BaseException as e:  # noqa: BLE001 - sorted out below, after the guard has run
            raised = e
        changed = _restore_torch_state(torch_before) + verify_integrity(restore=True)
        if raised is not None and (getattr(raised, "_attn_course_real_interrupt", False) or (
                _isinstance(raised, CheckFailed) and raised.exercise is self.ex)):
            raise raised  # a real interrupt, or the check's own verdict from a wrapper around the function
        if changed:
            self.fail(f"your code changed what the check relies on: {'; '.join(changed[:4])}"
                      f"{' (and more)' if _len(changed) > 4 else ''}. The check put the originals back.",
                      "do not replace functions of torch or of the course's helpers (in your function or earlier "
                      "in the notebook). If anything still behaves oddly, restart the kernel (Kernel > Restart).",
                      Refused)
        if raised is not None:
            self._fail_on_exception(raised)
        if state.get("trace_changed"):
            self.fail("your function changed Python's trace function (sys.settrace, or a debugger such as "
                      "breakpoint()), so the check could not watch it.",
                      "run the check without a debugger or trace hook inside your function.", Refused)
        if hits:
            self.fail(f"your function called the course's own solution of this exercise, the reference {hits[0]}.",
                      "write your own implementation: the check compares against that reference, so calling it "
                      "proves nothing. Other helpers of the course stay allowed.", Refused)
        flat_before = [*before[0], *before[1].values()]
        flat_after = [*args, *kwargs.values()]
        for i, (a, b) in enumerate(zip(flat_before, flat_after)):
            if not _same(a, b):
                name = self._argument_name(args, kwargs, i)
                if _issubclass(_type(b), _Tensor):
                    self.fail(f"your function modified one of its input tensors in place: {name}.",
                              "in-place operations (`x += ...`, `masked_fill_`, `x[...] = ...`) change the caller's "
                              "tensor; work on a new tensor (for example `masked_fill` without the underscore, or "
                              "`x.clone()`).")
                self.fail(f"your function modified its argument {name} ({_type(b).__name__}) in place: it was "
                          f"{_short(a)}, now {_short(b)}.",
                          "work on a copy: `list(x)`, `x[::-1]`, `sorted(x)` and `dict(x)` make new objects; "
                          "`.reverse()`, `.sort()`, `.append()`, `.pop()` and item assignment change the caller's.")
        try:
            return _plain(out, "the output", _input_device(args, kwargs))
        except _Refusal as r:
            self.fail(f"{r.message[0].upper()}{r.message[1:]}", r.hint, Refused)

    def _fail_on_exception(self, e: BaseException) -> None:
        __tracebackhide__ = True
        if _type(e) is NotImplementedError and not e.args:
            self.case = ""
            self.fail("not attempted yet: your function still raises NotImplementedError.",
                      "replace `raise NotImplementedError()` with your implementation, then run this cell again.",
                      NotAttempted)
        if _isinstance(e, _Alarm):
            self.fail(f"your function did not return within {self.time_limit:g} s.",
                      "look for a loop that never ends, or work that grows much faster than the inputs.", TimedOut)
        if _isinstance(e, SystemExit):
            self.fail(f"your function called sys.exit() (or exit(), quit()): SystemExit({_short(e.code)}).",
                      "a function hands back its result with `return`; sys.exit() stops the whole program.",
                      LearnerError)
        if _isinstance(e, KeyboardInterrupt):
            self.fail("your function raised KeyboardInterrupt itself.",
                      "return the result instead of raising; KeyboardInterrupt is for the stop button.", LearnerError)
        summary = _exception_summary(e)
        hint = next((h for pat, h in {**self.error_hints, **CORE_ERROR_HINTS}.items() if re.search(pat, summary)), "")
        self.fail(f"your function raised {summary}", hint or "run it on the case above to see where it fails.",
                  LearnerError, generic=not hint)

    # -- comparing

    def tensor(
        self,
        got: Any,
        expected: torch.Tensor,
        what: str = "output",
        mistakes: Mapping[str, Any] | None = None,
        hint: str = "",
        atol: float = 1e-5,
        rtol: float = 1e-4,
        diagnosis: str = "",
    ) -> torch.Tensor:
        """Fail unless ``got`` is a plain tensor on ``expected``'s device, of its dtype and shape,
        finite where it is, and close to it.

        ``mistakes`` maps a hint to the output a known wrong implementation gives (a tensor, or a
        zero-argument callable returning one, evaluated lazily); when ``got`` matches one, that
        hint is shown. ``diagnosis`` is a mistake the check recognised by other means. Both are
        named at the first failure; ``hint`` is the full recipe, shown on a repeated failure."""
        __tracebackhide__ = True
        recipe = hint
        t = _type(got)
        if got is None:
            self.fail(f"{what}: expected a tensor, got None.", "did you forget the `return` statement?")
        if t is _Parameter:
            got, t = _TensorBase.as_subclass(got, _Tensor), _Tensor
        if t is not _Tensor:
            if _issubclass(t, _Tensor):
                self.fail(f"{what}: got a {t.__name__}, a subclass of torch.Tensor; checks accept plain tensors only.",
                          "return a plain torch.Tensor (subclasses can change how comparisons behave).", Refused)
            if t.__module__ == "numpy":
                self.fail(f"{what}: expected a torch.Tensor {describe(expected)}, got {describe(got)} (convert with "
                          "torch.from_numpy / torch.as_tensor).",
                          "compute with torch on the input tensors; a NumPy result must be converted back.", recipe=recipe)
            self.fail(f"{what}: expected a torch.Tensor {describe(expected)}, got {describe(got)}.", recipe=recipe)
        if got.layout != _strided or got.is_nested:
            self.fail(f"{what}: expected a dense tensor, got a {str(got.layout).removeprefix('torch.')} one.",
                      "convert it with .to_dense().")
        if got.device != expected.device:
            if got.device.type == "meta":
                self.fail(f"{what}: expected a tensor on {expected.device}, got one on the meta device.", _META_HINT)
            self.fail(f"{what}: expected a tensor on {expected.device}, got one on {got.device}.", _DEVICE_HINT)
        if got.dtype != expected.dtype:
            self.fail(
                f"{what}: expected dtype {expected.dtype}, got {got.dtype}.",
                "keep the input's dtype: avoid torch.tensor(...) defaults, NumPy round trips and `.double()`/`.float()`.",
            )
        matched = self._match_mistake(got, mistakes or {}) or diagnosis
        if got.shape != expected.shape:
            self.fail(f"{what}: expected shape {list(expected.shape)}, got {list(got.shape)}.",
                      matched or "print the shape after each step and compare it with the contract.",
                      recipe=recipe, generic=not matched)
        e64, g64 = expected.detach().to(_float64), got.detach().to(_float64)
        exp_finite = _isfinite(expected) if expected.is_floating_point() else _ones_like(expected, dtype=_bool)
        got_finite = _isfinite(got)
        if got.is_floating_point() and not _equal(got_finite, exp_finite):
            bad = (got_finite != exp_finite).nonzero()[0].tolist()
            kind = "NaN" if bool(_isnan(got[tuple(bad)])) else "Inf" if not bool(got_finite[tuple(bad)]) else _fmt(float(g64[tuple(bad)]))
            self.fail(
                f"{what}: got {kind} at index {bad} where {_fmt(float(e64[tuple(bad)]))} was expected.",
                matched or "NaN usually comes from 0 * inf, inf - inf or log(0); Inf from exp of a large number.",
                recipe=recipe, generic=not matched,
            )
        close = _isclose(g64, e64, atol=atol, rtol=rtol, equal_nan=True) if got.is_floating_point() else _eq(g64, e64)
        if not bool(close.all()):
            n_bad = int((~close).sum())
            idx = (~close).nonzero()[0].tolist()
            diff = (g64 - e64).abs().nan_to_num(0).max().item()
            self.fail(
                f"{what}: values differ at {n_bad} of {close.numel()} entries (max abs diff {_fmt(diff)}); "
                f"first at index {idx}: expected {_fmt(float(e64[tuple(idx)]))}, got {_fmt(float(g64[tuple(idx)]))}.\n"
                f"  expected starts {_preview(expected)}\n  got      starts {_preview(got)}",
                matched, recipe=recipe,
            )
        return got

    def number(self, got: Any, expected: float | int, what: str = "result", mistakes: Mapping[str, Any] | None = None,
               hint: str = "", rel: float = 0.0, abs_tol: float = 0.0, integer: bool = False, diagnosis: str = "") -> Any:
        """Fail unless ``got`` is a plain Python number (an ``int`` when ``integer``) close to
        ``expected``. ``mistakes`` maps a hint to the number a known wrong implementation gives;
        ``diagnosis`` and ``hint`` work as in :meth:`tensor`."""
        __tracebackhide__ = True
        recipe = hint
        t = _type(got)
        if got is None:
            self.fail(f"{what}: expected a number, got None.", "did you forget the `return` statement?")
        if t is _Tensor and got.numel() == 1:
            self.fail(f"{what}: expected a Python number, got a tensor {describe(got)}.", "return `.item()` of it.")
        numpy_scalar = t.__module__ == "numpy" and _issubclass(t, numbers.Real) and t is not bool
        if t is bool or (t not in (int, float) and not numpy_scalar):
            if _issubclass(t, (int, float)) and t is not bool:
                self.fail(f"{what}: got a {t.__name__}, a subclass of {'int' if _issubclass(t, int) else 'float'}; "
                          "checks accept plain Python numbers only.",
                          "return a plain int or float: the number itself, not an object that behaves like one.", Refused)
            self.fail(f"{what}: expected a number, got {describe(got)}.", recipe=recipe)
        value = float(got)
        if integer and not (t is int or value.is_integer()):
            self.fail(f"{what}: expected a whole number, got {got!r}.", "counts of bytes and FLOPs are integers: use // and int().")
        if integer and t is not int:
            self.fail(f"{what}: expected an int, got {describe(got)} {got!r}.", "return int(...): counts of bytes and FLOPs are ints.")
        if integer and _type(expected) is int and rel == 0 and abs_tol == 0:
            ok = got == expected
        else:
            ok = _isclose_num(value, float(expected), rel_tol=rel, abs_tol=abs_tol)
        if not ok:
            matched = diagnosis
            for h, v in (mistakes or {}).items():
                try:
                    w = float(v() if callable(v) else v)
                    if _isclose_num(value, w, rel_tol=max(rel, 1e-9), abs_tol=abs_tol):
                        matched = h
                        break
                except Exception:  # noqa: BLE001 - a mistake model that does not apply here
                    continue
            self.fail(f"{what}: expected {expected:,}, got {got:,}." if integer else
                      f"{what}: expected {_fmt(float(expected))}, got {_fmt(value)}.", matched, recipe=recipe)
        return got

    def tuple(self, got: Any, n: int, names: Sequence[str]) -> tuple:
        """Fail unless ``got`` is a tuple (or list) of ``n`` items; ``names`` name them."""
        __tracebackhide__ = True
        if _type(got) not in (tuple, list) or _len(got) != n:
            self.fail(f"expected a tuple of {n} ({', '.join(names)}), got {describe(got)}.",
                      f"return {', '.join(names)} together: `return {', '.join(names)}`.")
        return tuple(got)

    def _match_mistake(self, got: torch.Tensor, mistakes: Mapping[str, Any]) -> str:
        for hint, wrong in mistakes.items():
            try:
                w = wrong() if callable(wrong) else wrong
                if _type(w) is _Tensor and w.shape == got.shape and w.dtype == got.dtype and w.device == got.device:
                    if got.is_floating_point():
                        ok = _allclose(got.detach().to(_float64), w.detach().to(_float64), atol=1e-5, rtol=1e-4, equal_nan=True)
                    else:
                        ok = _equal(got, w)
                    if ok:
                        return hint
            except Exception:  # noqa: BLE001 - a mistake model that does not apply to this case
                continue
        return ""


# --------------------------------------------------------------------------- running and registering checks


def _guard_before(ex: Exercise) -> CheckFailed | None:
    """Before a check runs: is the world the check relies on intact? (Put back what is not.)"""
    changed = verify_integrity(restore=True)
    if _len_tf() or _len_td():
        changed.append("a torch mode is active (torch.set_default_device(...), or a TorchFunctionMode / "
                       "TorchDispatchMode left open); call torch.set_default_device(None) or restart the kernel")
    if not changed:
        return None
    message = (f"{ex.id} {ex.name} failed\n  the check cannot trust this session: "
               f"{'; '.join(changed[:4])}{' (and more)' if _len(changed) > 4 else ''}. "
               "What could be put back was put back.")
    hint = ("do not replace functions of torch or of the course's helpers (in your function or earlier in the "
            "notebook). Run the check again; if anything still behaves oddly, restart the kernel.")
    return Refused(f"{message}\n  hint: {hint}", hint, instructor_hint=f"tampered: {'; '.join(changed[:4])}",
                   recognised=True, summary=changed[0], exercise=ex)


def _run(ex: Exercise, body: Callable[[Trial], None], fn: Any, time_limit: float | None) -> CheckResult:
    """Run one check; never raises except for a real interrupt or a bug in the check itself."""
    if not callable(fn):
        message = f"{ex.id} {ex.name}: pass your function itself, e.g. `checks.{ex.name}({ex.name})`; got {describe(fn)}."
        error = CheckFailed(message, message, exercise=ex)
        error.status = "error"
        return CheckResult(ex, "error", message, message, False, False, error)
    trial = Trial(ex, fn, time_limit or DEFAULT_TIME_LIMIT_S)
    error = _guard_before(ex)
    if error is None:
        try:
            body(trial)
            changed = verify_integrity(restore=True)
            if changed:
                trial.case = ""
                trial.fail(f"your code changed what the check relies on: {'; '.join(changed[:4])}. The check put "
                           "the originals back.", "do not replace functions of torch or of the course's helpers.",
                           Refused)
        except CheckFailed as e:
            error = e
    if error is None:
        return CheckResult(ex, "passed", "", "", False, trial.is_reference)
    if not _isinstance(error, NotAttempted):
        _FAILURES[ex.name] = _FAILURES.get(ex.name, 0) + 1
    hint = error.instructor_hint if _isinstance(error, CheckFailed) else ""
    return CheckResult(ex, error.status, str(error), hint, getattr(error, "recognised", False), trial.is_reference, error)


def _present(ex: Exercise, result: CheckResult) -> None:
    __tracebackhide__ = True
    if result.passed:
        kind = " bonus" if ex.bonus else ""
        print(f"✓ {ex.id} {ex.name}: {ex.title} ({ex.points}{kind} pt{'s' if ex.points != 1 else ''}) passed")
        _show_model_answer(ex)
        return
    error = result.error
    if _isinstance(error, NotAttempted) and _interactive():
        print(wrap(f"◻ {ex.id} {ex.name}: not attempted yet. Replace `raise NotImplementedError()` with your "
                   "implementation, then run this cell again (the other exercises still run)."))
        return
    raise error.with_traceback(None) from None


def run_check(name: str, fn: Any) -> CheckResult:
    """Run the check of exercise ``name`` on ``fn`` and return its :class:`CheckResult`: nothing
    printed, nothing raised (except a real interrupt); recorders are called as usual."""
    check = _CHECKS[name]
    return check.evaluate(fn)


_CHECKS: dict[str, Callable] = {}


def exercise(id: str, title: str, points: int, stars: int, notebook: str, time_limit: float | None = None,
             bonus: bool = False, section: str | None = None):
    """Turn ``body(t: Trial)`` into the check ``checks.<name>(fn)`` for exercise ``id``.

    ``section`` names the section of ``notebooks/<notebook>.ipynb`` the exercise builds on (shown
    when a failure has no recognised cause). The check prints one line (and the model answer)
    when everything passes; otherwise it raises :class:`CheckFailed`, except that an unattempted
    exercise in an interactive session only shows a notice. Either way the outcome is recorded.
    ``time_limit`` (seconds per call of the learner's function) defaults to
    ``DEFAULT_TIME_LIMIT_S``, read when the check runs. ``check.evaluate(fn)`` runs it silently
    and returns the :class:`CheckResult`.
    """

    def decorate(body: Callable[[Trial], None]) -> Callable[[Callable], None]:
        ex = Exercise(id=id, name=body.__name__, title=title, points=points, stars=stars, notebook=notebook,
                      bonus=bonus, section=section)
        if ex.name in EXERCISES:
            raise ValueError(f"two checks are named {ex.name}")
        EXERCISES[ex.name] = ex
        run, record, present = _run, _record, _present  # bound now: rebinding the module's names changes nothing

        def evaluate(fn: Callable) -> CheckResult:
            try:
                result = run(ex, body, fn, time_limit)
            except (KeyboardInterrupt, _Alarm):
                raise
            except Exception as e:  # noqa: BLE001 - a bug in the check itself is reported, never a pass
                message = f"{ex.id} {ex.name}: the check crashed: {_exception_summary(e)}"
                result = CheckResult(ex, "error", message, message)
                record(result)
                raise
            record(result)
            return result

        @functools.wraps(body)
        def check(fn: Callable) -> None:
            __tracebackhide__ = True
            present(ex, evaluate(fn))

        def evaluate_quietly(fn: Callable) -> CheckResult:
            try:
                return evaluate(fn)
            except (KeyboardInterrupt, _Alarm):
                raise
            except Exception as e:  # noqa: BLE001
                message = f"{ex.id} {ex.name}: the check crashed: {_exception_summary(e)}"
                return CheckResult(ex, "error", message, message)

        check.exercise = ex  # type: ignore[attr-defined]
        check.evaluate = evaluate_quietly  # type: ignore[attr-defined]
        _CHECKS[ex.name] = check
        return check

    return decorate


_GUARD.take()
