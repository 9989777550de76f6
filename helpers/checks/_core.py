"""The machinery every exercise check shares.

A check is written as a function ``body(t)`` decorated with :func:`exercise`; ``t`` is a
:class:`Trial` bound to the learner's function. The body builds cases, calls the learner's function
through ``t.call`` (time limit, in-place detection, "not attempted"), and compares results with
``t.tensor`` / ``t.number`` / ``t.tuple``, passing the *mistakes* it can recognise: outputs that a
known wrong implementation would give, each with the hint to show when the learner's output
matches it. The first failure raises :class:`CheckFailed` (an ``AssertionError``) whose message
names the exercise, the case, expected vs got, and a hint. Every outcome is recorded for
``make grade``.
"""

from __future__ import annotations

import functools
import json
import math
import numbers
import os
import re
import signal
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

GRADE_LOG_ENV = "ATTN_COURSE_GRADE_LOG"
DEFAULT_TIME_LIMIT_S = 20.0


@dataclass(frozen=True)
class Exercise:
    """One graded exercise: id "1.1", function name, title, points, stars, notebook stem, and
    whether it is a bonus (its points are reported apart and never block a pass)."""

    id: str
    name: str
    title: str
    points: int
    stars: int
    notebook: str
    bonus: bool = False


EXERCISES: dict[str, Exercise] = {}  # function name -> Exercise


def seeded(seed: int) -> torch.Generator:
    """A CPU generator with a fixed seed: every case a check builds is reproducible."""
    return torch.Generator().manual_seed(seed)


class CheckFailed(AssertionError):
    """A check did not pass. ``status`` is what `make grade` reports."""

    status = "failed"

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.hint = hint


class NotAttempted(CheckFailed):
    status = "not attempted"


class TimedOut(CheckFailed):
    status = "timed out"


class LearnerError(CheckFailed):
    """The learner's function raised an exception."""

    status = "error"


# --------------------------------------------------------------------------- describing values


def describe(x: Any) -> str:
    """A compact description: ``float32[2, 3, 5, 4]``, ``int 7``, ``tuple(3)``, ``None``."""
    if isinstance(x, torch.Tensor):
        return f"{str(x.dtype).removeprefix('torch.')}{list(x.shape)}"
    if x is None:
        return "None"
    if isinstance(x, bool):
        return f"bool {x}"
    if isinstance(x, (int, float)):
        return f"{type(x).__name__} {x!r}"
    if isinstance(x, (tuple, list)):
        if len(x) <= 6 and all(isinstance(e, (int, float, bool)) for e in x):
            return repr(x)
        return f"{type(x).__name__} of {len(x)}: (" + ", ".join(describe(e) for e in x[:4]) + (", ..." if len(x) > 4 else "") + ")"
    if type(x).__module__ == "numpy":
        return f"numpy.{type(x).__name__}"
    return type(x).__name__


def describe_case(**kwargs: Any) -> str:
    """``x=float32[2, 5, 12], n_heads=3``: how a failing case is named in messages."""
    return ", ".join(f"{k}={describe(v)}" if isinstance(v, torch.Tensor) else f"{k}={v!r}" for k, v in kwargs.items())


def _fmt(v: float) -> str:
    return f"{v:.4g}" if math.isfinite(v) else str(v)


def _preview(t: torch.Tensor, n: int = 6) -> str:
    flat = t.detach().reshape(-1)[:n].tolist()
    body = ", ".join(_fmt(float(v)) for v in flat)
    return f"[{body}{', ...' if t.numel() > n else ''}]"


# --------------------------------------------------------------------------- calling safely


class _Alarm(BaseException):
    """Raised inside the learner's code when the time limit expires (BaseException: a bare
    ``except Exception`` in learner code cannot swallow it)."""


def _call_with_time_limit(fn: Callable, args: tuple, kwargs: dict, seconds: float) -> Any:
    use_signal = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    if use_signal:

        def on_alarm(signum, frame):
            raise _Alarm()

        previous = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            return fn(*args, **kwargs)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    # No SIGALRM (Windows) or not the main thread: run in a daemon thread and stop waiting.
    box: dict[str, Any] = {}

    def target():
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise _Alarm()
    if "error" in box:
        raise box["error"]
    return box["value"]


def _snapshot(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, (list, tuple)):
        return type(x)(_snapshot(e) for e in x)
    if isinstance(x, dict):
        return {k: _snapshot(v) for k, v in x.items()}
    return x


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype and torch.equal(
            torch.nan_to_num(a), torch.nan_to_num(b)
        )
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return True


# --------------------------------------------------------------------------- the trial


class Trial:
    """Runs one learner function against the cases of one check.

    ``error_hints`` maps a regular expression (searched in ``"ExceptionName: message"``) to the
    hint shown when the learner's function raises a matching exception.
    """

    def __init__(self, ex: Exercise, fn: Callable, time_limit: float = DEFAULT_TIME_LIMIT_S):
        self.ex = ex
        self.fn = fn
        self.time_limit = time_limit
        self.case = ""
        self.error_hints: dict[str, str] = {}

    # -- failing

    def fail(self, message: str, hint: str = "", kind: type[CheckFailed] = CheckFailed) -> None:
        __tracebackhide__ = True
        head = f"{self.ex.id} {self.ex.name}"
        verdict = "not attempted" if kind is NotAttempted else "failed"
        where = f" on case: {self.case}" if self.case else ""
        text = f"{head} {verdict}{where}\n  {message}"
        if hint:
            text += f"\n  hint: {hint}"
        raise kind(text, hint)

    # -- calling

    def call(self, *args: Any, case: str | None = None, **kwargs: Any) -> Any:
        """Call the learner's function on one case; return its output.

        Fails (with a clear message) when the function is not attempted, raises, runs past the
        time limit, or modifies a tensor argument in place.
        """
        __tracebackhide__ = True
        if case is not None:
            self.case = case
        before = _snapshot((args, kwargs))
        try:
            out = _call_with_time_limit(self.fn, args, kwargs, self.time_limit)
        except NotImplementedError:
            self.case = ""
            self.fail(
                "not attempted yet: the function still raises NotImplementedError.",
                "replace `raise NotImplementedError()` with your implementation, then run this cell again.",
                NotAttempted,
            )
        except _Alarm:
            self.fail(
                f"your function did not return within {self.time_limit:g} s.",
                "look for a loop that never ends, or work that grows much faster than the inputs.",
                TimedOut,
            )
        except Exception as e:  # noqa: BLE001 - any learner exception becomes a clear message
            summary = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}".strip()
            hint = next((h for pat, h in self.error_hints.items() if re.search(pat, summary)), "")
            self.fail(f"your function raised {summary}", hint or "run it on the case above to see where it fails.", LearnerError)
        if not _same(before, (args, kwargs)):
            self.fail(
                "your function modified one of its input tensors in place.",
                "in-place operations (`x += ...`, `masked_fill_`, `x[...] = ...`) change the caller's tensor; "
                "work on a new tensor (for example `masked_fill` without the underscore, or `x.clone()`).",
            )
        return out

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
    ) -> torch.Tensor:
        """Fail unless ``got`` is a tensor of ``expected``'s shape and dtype, finite where it is,
        and close to it. ``mistakes`` maps a hint to the output a known wrong implementation gives
        (a tensor, or a zero-argument callable returning one, evaluated lazily); when ``got``
        matches one, that hint is shown. ``hint`` is the fallback."""
        __tracebackhide__ = True
        mistakes = mistakes or {}
        if got is None:
            self.fail(f"{what}: expected a tensor, got None.", "did you forget the `return` statement?")
        if not isinstance(got, torch.Tensor):
            extra = " (convert with torch.from_numpy / torch.as_tensor)" if type(got).__module__ == "numpy" else ""
            self.fail(f"{what}: expected a torch.Tensor {describe(expected)}, got {describe(got)}{extra}.", hint)
        matched = self._match_mistake(got, mistakes)
        if got.shape != expected.shape:
            self.fail(
                f"{what}: expected shape {list(expected.shape)}, got {list(got.shape)}.",
                matched or hint or "print the shape after each step and compare with the contract.",
            )
        if got.dtype != expected.dtype:
            self.fail(
                f"{what}: expected dtype {expected.dtype}, got {got.dtype}.",
                "keep the input's dtype: avoid torch.tensor(...) defaults, NumPy round trips and `.double()`/`.float()`.",
            )
        if got.device != expected.device:
            self.fail(f"{what}: expected a tensor on {expected.device}, got one on {got.device}.", "create new tensors with device=x.device.")
        exp_finite = torch.isfinite(expected) if expected.is_floating_point() else torch.ones_like(expected, dtype=torch.bool)
        if got.is_floating_point() and not torch.equal(torch.isfinite(got), exp_finite):
            bad = (torch.isfinite(got) != exp_finite).nonzero()[0].tolist()
            self.fail(
                f"{what}: got {'NaN' if torch.isnan(got[tuple(bad)]) else 'Inf'} at index {bad} where "
                f"{_fmt(float(expected[tuple(bad)]))} was expected.",
                matched or hint or "NaN usually comes from 0 * inf, inf - inf or log(0); Inf from exp of a large number.",
            )
        e64, g64 = expected.detach().double(), got.detach().double()
        close = torch.isclose(g64, e64, atol=atol, rtol=rtol, equal_nan=True) if got.is_floating_point() else g64 == e64
        if not bool(close.all()):
            n_bad = int((~close).sum())
            idx = (~close).nonzero()[0].tolist()
            diff = (g64 - e64).abs().nan_to_num(0).max().item()
            self.fail(
                f"{what}: values differ at {n_bad} of {close.numel()} entries (max abs diff {_fmt(diff)}); "
                f"first at index {idx}: expected {_fmt(float(e64[tuple(idx)]))}, got {_fmt(float(g64[tuple(idx)]))}.\n"
                f"  expected starts {_preview(expected)}\n  got      starts {_preview(got)}",
                matched or hint,
            )
        return got

    def number(self, got: Any, expected: float | int, what: str = "result", mistakes: Mapping[str, Any] | None = None,
               hint: str = "", rel: float = 0.0, abs_tol: float = 0.0, integer: bool = False) -> Any:
        """Fail unless ``got`` is a Python number (an ``int`` when ``integer``) close to ``expected``.
        ``mistakes`` maps a hint to the number a known wrong implementation gives."""
        __tracebackhide__ = True
        if got is None:
            self.fail(f"{what}: expected a number, got None.", "did you forget the `return` statement?")
        if isinstance(got, torch.Tensor) and got.numel() == 1:
            self.fail(f"{what}: expected a Python number, got a tensor {describe(got)}.", "return `.item()` of it.")
        if isinstance(got, bool) or not isinstance(got, numbers.Real):  # numbers.Real includes NumPy scalars
            self.fail(f"{what}: expected a number, got {describe(got)}.", hint)
        if integer and not (isinstance(got, int) or float(got).is_integer()):
            self.fail(f"{what}: expected a whole number, got {got!r}.", "counts of bytes and FLOPs are integers: use // and int().")
        if integer and not isinstance(got, int):
            self.fail(f"{what}: expected an int, got {describe(got)} {got!r}.", "return int(...): counts of bytes and FLOPs are ints.")
        if not math.isclose(float(got), float(expected), rel_tol=rel, abs_tol=abs_tol):
            matched = next((h for h, v in (mistakes or {}).items() if math.isclose(float(got), float(v() if callable(v) else v), rel_tol=max(rel, 1e-9), abs_tol=abs_tol)), "")
            self.fail(f"{what}: expected {expected:,}, got {got:,}." if integer else f"{what}: expected {_fmt(float(expected))}, got {_fmt(float(got))}.",
                      matched or hint)
        return got

    def tuple(self, got: Any, n: int, names: Sequence[str]) -> tuple:
        """Fail unless ``got`` is a tuple (or list) of ``n`` items; ``names`` name them."""
        __tracebackhide__ = True
        if not isinstance(got, (tuple, list)) or len(got) != n:
            self.fail(f"expected a tuple of {n} ({', '.join(names)}), got {describe(got)}.", f"return {', '.join(names)} together: `return {', '.join(names)}`.")
        return tuple(got)

    def _match_mistake(self, got: torch.Tensor, mistakes: Mapping[str, Any]) -> str:
        for hint, wrong in mistakes.items():
            try:
                w = wrong() if callable(wrong) else wrong
            except Exception:  # noqa: BLE001 - a mistake model that does not apply to this case
                continue
            if isinstance(w, torch.Tensor) and w.shape == got.shape and w.dtype == got.dtype:
                if got.is_floating_point():
                    ok = torch.allclose(got.detach().double(), w.detach().double(), atol=1e-5, rtol=1e-4, equal_nan=True)
                else:
                    ok = torch.equal(got, w)
                if ok:
                    return hint
        return ""


# --------------------------------------------------------------------------- registering checks


def _record(ex: Exercise, status: str, hint: str = "") -> None:
    path = os.environ.get(GRADE_LOG_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"name": ex.name, "status": status, "hint": hint}) + "\n")


def exercise(id: str, title: str, points: int, stars: int, notebook: str, time_limit: float | None = None,
             bonus: bool = False):
    """Turn ``body(t: Trial)`` into the check ``checks.<name>(fn)`` for exercise ``id``.

    The check prints one line when everything passes; otherwise it raises :class:`CheckFailed`.
    Either way the outcome is recorded for `make grade`. ``time_limit`` (seconds per call of the
    learner's function) defaults to ``DEFAULT_TIME_LIMIT_S``, read when the check runs.
    """

    def decorate(body: Callable[[Trial], None]) -> Callable[[Callable], None]:
        ex = Exercise(id=id, name=body.__name__, title=title, points=points, stars=stars, notebook=notebook, bonus=bonus)
        if ex.name in EXERCISES:
            raise ValueError(f"two checks are named {ex.name}")
        EXERCISES[ex.name] = ex

        @functools.wraps(body)
        def check(fn: Callable) -> None:
            __tracebackhide__ = True
            if not callable(fn):
                message = (
                    f"{ex.id} {ex.name}: pass your function itself, e.g. `checks.{ex.name}({ex.name})`; got {describe(fn)}."
                )
                _record(ex, "error", message)
                raise CheckFailed(message, message)
            try:
                body(Trial(ex, fn, time_limit or DEFAULT_TIME_LIMIT_S))
            except CheckFailed as e:
                _record(ex, e.status, e.hint)
                raise type(e)(str(e), e.hint) from None
            except Exception as e:
                # A bug in the check itself must still be reported as something, not a pass.
                _record(ex, "error", f"the check crashed: {type(e).__name__}: {e}")
                raise
            _record(ex, "passed")
            kind = " bonus" if ex.bonus else ""
            print(f"✓ {ex.id} {ex.name}: {ex.title} ({ex.points}{kind} pt{'s' if ex.points != 1 else ''}) passed")

        check.exercise = ex  # type: ignore[attr-defined]
        return check

    return decorate
