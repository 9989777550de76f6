"""The comparison core every exercise check shares: cases, the trial, registering checks.

A check is written as a function ``body(t)`` decorated with :func:`exercise`; ``t`` is a
:class:`Trial` bound to the learner's function. The body builds its cases and **computes every
expected value first** (``t.cases(reference, inputs)`` does both), then calls the learner's
function through ``t.call`` and compares with ``t.tensor`` / ``t.number`` / ``t.tuple``.

What the machinery guarantees, so that a check body does not have to:

- **It cannot be fooled from inside the learner's code** (``guard``): comparisons use functions
  bound at import, the course's and torch's functions are snapshotted and checked before a check
  runs, after every call of the learner's function and before a pass; what the learner returns
  becomes plain data first; calling the course's reference for the same exercise is refused.
- **It cannot be crashed.** ``NotImplementedError`` ("not attempted"), any exception,
  ``SystemExit``, a ``KeyboardInterrupt`` the learner raised, a time-out, an input modified in
  place (tensors, lists, dicts) all become a failed check with a clear message, recorded.
- **Hints are graduated** (``feedback``). ``mistakes={hint: wrong output}`` (matched by output),
  ``error_hints`` (matched by exception text) and ``diagnosis=`` are *recognised* mistakes, named
  at the first failure. Otherwise the first failure says what differs, states a fact about the
  output when one holds (``diagnose``: a ``found:`` line) and points at the teaching section
  (``exercise(section=...)``). ``hint=`` of ``t.tensor`` / ``t.number`` is the full recipe, shown
  from the ``RECIPE_AFTER``-th failed attempt of the exercise in the same kernel.

:func:`run_check` runs a check without printing or raising and returns the result.

When ``make grade`` grades, the same check runs in a judge process and ``fn`` is a
:class:`~helpers.checks.calling.Remote`: each ``t.call`` travels to the notebook's process, which
runs the learner's function there with the same guard (``calling.protected_call``) and sends back
what it returned; the cases come from salted seeds (:func:`seeded`), and the expected values and
the verdict never leave the judge. What a watcher (:mod:`helpers.checks.watchers`) observes there
comes from the notebook's process as well, so it only advises: a failure decided from it
(:meth:`Trial.fail_observed`) becomes a note in the result's ``review``, and the verdict rests on
the returned values.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import io
import math
import numbers
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional  # noqa: F401  (watched by the integrity guard)

from .. import registry
from .calling import CALL_MISTAKES, Remote, _run_watcher, protected_call
from .diagnose import factor_facts, nonfinite_facts, number_facts, shape_value_facts, tensor_facts
from .feedback import (
    _FAILURES,
    _LATEST,
    CORE_ERROR_HINTS,
    RECIPE_AFTER,
    CheckFailed,
    CheckResult,
    Exercise,
    LearnerError,
    Mistake,
    NotAttempted,
    Refused,
    TimedOut,
    _exception_summary,
    _fmt,
    _present,
    _preview,
    _record,
    describe,
    describe_case,
    first_clause,
    mistake_id,
    number_text,
    wrap,
)
from .guard import (
    _DEVICE_HINT,
    _META_HINT,
    _Alarm,
    _allclose,
    _bool,
    _eq,
    _equal,
    _float64,
    _isclose,
    _isclose_num,
    _isfinite,
    _isinstance,
    _isnan,
    _issubclass,
    _len,
    _len_td,
    _len_tf,
    _ones_like,
    _Parameter,
    _strided,
    _Tensor,
    _TensorBase,
    _type,
    is_course_reference,
    verify_integrity,
)

DEFAULT_TIME_LIMIT_S = 20.0
_monotonic = time.monotonic  # bound now: the learner's code cannot stretch the time below
COLLECT_S = (2.0, 10.0)  # after a first failure, the remaining cases run for the time that took, within these


class _StopCollecting(Exception):
    """The remaining cases ran past their time: conclude from what they showed."""
_RETURNED_NONE = Mistake("returned-None", "did you forget the `return` statement?", "returned None (no return)")
_FAIL_KINDS = {"CheckFailed": CheckFailed, "Refused": Refused}  # the failures an outcome may name

EXERCISES: dict[str, Exercise] = {}  # function name -> Exercise


_SALT: list[int] = [0]  # 0 in a learner's session and in tests; drawn afresh by `make grade` (its judge)


def seeded(seed: int) -> torch.Generator:
    """A CPU generator with a fixed seed: every case a check builds is reproducible. When
    ``make grade`` grades, every seed is mixed with a secret drawn after the notebook's cells ran
    (:func:`salt_cases`), so the graded inputs cannot be known in advance."""
    return torch.Generator().manual_seed(salted(seed))


def draw(g: torch.Generator, lo: int, hi: int) -> int:
    """A Python int in [lo, hi) from ``g``: a size or count of a case drawn from a (salted) seed."""
    return int(torch.randint(lo, hi, (1,), generator=g).item())


def salted(seed: int) -> int:
    """``seed`` itself, or mixed with the grader's secret (a 63-bit seed) while grading."""
    if not _SALT[0]:
        return seed
    return int.from_bytes(hashlib.blake2b(f"{_SALT[0]}:{seed}".encode(), digest_size=8).digest(), "big") >> 1


def salt_cases(salt: int) -> None:
    """Mix ``salt`` into every seed the checks use from now on (0: the fixed seeds again)."""
    _SALT[0] = int(salt)


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
        return {Mistake("ignored-causal", "causal=True was ignored: mask the scores so that query i reads keys "
                        "j <= i only."): model(causal=False)}
    return {Mistake("masked-when-not-causal", "causal=False here, but your output is causally masked: mask only "
                    "when causal is True."): model(causal=True)}



def _to_float(x: Any) -> float:
    """``float(x)``, with an int beyond float's range (``10**400``) as +-inf instead of an error."""
    try:
        return float(x)
    except OverflowError:
        return math.inf if x > 0 else -math.inf


class Trial:
    """Runs one learner function against the cases of one check.

    ``error_hints`` maps a regular expression (searched in ``"ExceptionName: message"``) to the
    hint shown when the learner's function raises a matching exception. ``forbidden_references``
    names the course functions the learner may not call (default: the exercise's own name).
    """

    def __init__(self, ex: Exercise, fn: Callable, time_limit: float = DEFAULT_TIME_LIMIT_S):
        self.ex = ex
        self.fn = fn
        self.time_limit = time_limit
        self.case = ""
        self.error_hints: dict[str, str] = {}
        self.forbidden_references: set[str] = {ex.name}
        self.is_reference = bool(fn.info.get("is_reference")) if _type(fn) is Remote else is_course_reference(fn, ex.name)
        self.attempts = _FAILURES.get(ex.name, 0)  # failed attempts of this exercise before this one
        self.repeat = self.attempts + 1 >= RECIPE_AFTER
        self.passed_cases: list[str] = []  # cases whose output compared equal (named in a later failure)
        self.review: list[str] = []  # what the calls reported for a grader to look at (CheckResult.review)
        # After the first failing comparison the check goes on through its remaining cases, quietly,
        # so that a mistake is named only when it explains every comparison (see :meth:`_weigh`).
        self._started = _monotonic()
        self._pending: dict | None = None  # the first failure, reported when the cases have run
        self._collect_until = 0.0
        self._longest_call = 0.0  # seconds: the slowest call of the learner's function so far
        self._returned: list[Any] = []  # what the learner's function returned (kept, so that ids stay unique)
        self._weighing = True  # False for a call fed with what the function returned after a failure
        self._refuted: set[str] = set()  # mistakes whose model differed from the output in some comparison
        self._number_failures: dict[str, list] = {}  # what -> [(got, expected, factors)] of failing numbers

    # -- failing

    def fail(self, message: str, hint: str = "", kind: type[CheckFailed] = CheckFailed, *, recipe: str = "",
             generic: bool = False, found: str = "", what: str = "") -> None:
        """Fail with ``message`` (what differs). ``hint`` names the mistake and is always shown;
        ``generic=True`` marks it as a general tip rather than a recognised cause (the message
        then also points at the teaching section). ``recipe`` is the full recipe: shown only when
        this check has failed before in this kernel. ``found`` is a fact about the wrong output
        (:mod:`helpers.checks.diagnose`), shown when no mistake was recognised. A recognised
        ``hint`` is a :class:`~helpers.checks.feedback.Mistake` (its identifier is recorded); an
        unrecognised failure is recorded as ``not-recognised-<what>`` (shape, values, dtype, ...)."""
        __tracebackhide__ = True
        ex = self.ex
        earlier = [c for c in self.passed_cases if c != self.case]
        if not (hint and not generic) and earlier and not found and kind is CheckFailed:
            found = (f"your function gave the right output on the earlier case{'s' if len(earlier) > 1 else ''} "
                     f"{'; '.join(earlier[:3])}, and not on this one.")
        verdict = "not attempted" if kind is NotAttempted else "failed"
        where = f" on case: {self.case}" if self.case else ""
        lines = [f"{ex.id} {ex.name} {verdict}{where}", f"  {message}"]
        recognised = bool(hint) and not generic
        if found and not recognised:
            lines.append(f"  found: {found}")
        if hint:
            lines.append(f"  hint: {hint}")
        if not recognised and kind is not NotAttempted:
            lines.append(f"  see: {ex.pointer}")
        if recipe and recipe != hint:
            if self.repeat:
                lines.append(f"  recipe: {recipe}")
            else:
                left = RECIPE_AFTER - 1 - self.attempts
                lines.append(f"  (stuck? after {left} more failed attempt{'s' if left > 1 else ''}, this check shows a "
                             "step-by-step recipe)")
        summary = message.split("\n")[0].strip()
        instructor = hint if recognised else found or f"{summary}{where}"
        named = _isinstance(hint, Mistake) and not generic
        counted = named or (recognised and not what)  # a mistake the check names (else: what differed)
        mid = "" if kind is NotAttempted else mistake_id(ex, hint, counted, what or "other")
        description = ("" if kind is NotAttempted else hint.description if named else first_clause(hint) if counted
                       else f"not recognised: {(what or 'other').replace('-', ' ')}")
        raise kind("\n".join(lines), hint, instructor_hint=instructor, recognised=recognised, recipe=recipe,
                   summary=summary, case=self.case, exercise=ex, mistake_id=mid, mistake=description)

    def fail_observed(self, message: str, hint: str = "", *, recipe: str = "") -> None:
        """A failure decided from what a watcher observed (the observations of :meth:`call_watched`),
        not from the values the function returned. In a learner's session it is :meth:`fail` (same
        message, hint, recipe and mistake id). When ``make grade`` grades (``fn`` is a
        :class:`~helpers.checks.calling.Remote`), the observations come from the notebook's own
        process, which the notebook controls: nothing fails, a note for a grader is added to
        :attr:`review` (once per mistake), and this returns, so the check goes on and decides from
        the returned values alone. A caller that would have stopped here continues as if nothing
        had been observed."""
        __tracebackhide__ = True
        if _type(self.fn) is not Remote:
            self.fail(message, hint, recipe=recipe)
        mid = mistake_id(self.ex, hint, bool(hint))  # the mistake id as fail records it
        tag = f"[{mid}]"
        if any(tag in note for note in self.review):
            return
        seen = re.sub(r"\byour\b", "the", re.sub(r"\bYour\b", "The", message.split("\n")[0].strip())).rstrip(".")
        seen = seen if _len(seen) <= 160 else seen[:157] + "..."
        self.review.append(f"{self.ex.id} {self.ex.name}: {seen} {tag}; advisory, as it was observed in the "
                           "notebook's own process")

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

    def call(self, *args: Any, case: str | None = None, **kwargs: Any) -> Any:
        """Call the learner's function on one case; return its output as plain data.

        Fails (with a clear message) when the function is not attempted, raises (SystemExit and a
        KeyboardInterrupt it raised itself included), runs past the time limit, modifies an
        argument in place, changes the course's or torch's functions, calls the course's reference
        for this exercise, or returns a tensor subclass, a number subclass, a meta tensor or a
        tensor on another device than the inputs.
        """
        __tracebackhide__ = True
        return self._call(None, None, args, kwargs, case)[0]

    def call_watched(self, watcher: Callable, args: tuple, options: Any = None, case: str | None = None) -> tuple[Any, Any]:
        """Like :meth:`call`, with the learner's function run by ``watcher(fn, args, options)``,
        a function of :mod:`helpers.checks.watchers` that returns ``(output, observations)``: what
        instruments saw, as plain data (lists, dicts, strings, numbers). When ``make grade``
        grades, the watcher runs in the notebook's process and the check in the grader's, so
        everything the check learns about the call has to be in those two; and since that process
        is the notebook's, a failure decided from the observations is :meth:`fail_observed`
        (advisory there), never :meth:`fail`."""
        __tracebackhide__ = True
        return self._call(watcher, options, args, {}, case)

    def _call(self, watcher: Callable | None, options: Any, args: tuple, kwargs: dict, case: str | None) -> tuple:
        __tracebackhide__ = True
        if case is not None:
            self.case = case
        if self._pending is not None and _monotonic() + self._longest_call > self._collect_until:
            raise _StopCollecting()  # the next call would end past the budget of the remaining cases
        began = _monotonic()
        spec = dict(time_limit=self.time_limit, forbidden=sorted(self.forbidden_references),
                    is_reference=self.is_reference)
        if _type(self.fn) is Remote:
            outcome = self.fn.call(args, kwargs, watcher, options, spec)
        else:
            fn = self.fn if watcher is None else _run_watcher(watcher, self.fn, options)
            quiet = contextlib.ExitStack()
            if self._pending is not None:  # the cases after a failure: the learner's prints are not shown
                quiet.enter_context(contextlib.redirect_stdout(io.StringIO()))
                quiet.enter_context(contextlib.redirect_stderr(io.StringIO()))
            with quiet:
                outcome = protected_call(fn, args, kwargs, learner=self.fn, watched=watcher is not None, **spec)
        self._longest_call = max(self._longest_call, _monotonic() - began)
        # A call fed with what the function returned before (a cache, the state of an allocator)
        # after a failure starts from the learner's wrong state: what it returns weighs no mistake.
        mine = {id(x) for x in self._returned}
        fed = [a for a in (*args, *kwargs.values()) for a in ((a, *a) if _type(a) in (tuple, list) else (a,))]
        self._weighing = self._pending is None or not any(id(a) in mine for a in fed)
        out = self._settle(outcome)  # (output, observations)
        self._returned += [out[0], *(out[0] if _type(out[0]) in (tuple, list) else ())]
        return out

    def _settle(self, outcome: dict) -> tuple[Any, Any]:
        """Fail as ``outcome`` (from :func:`protected_call`) says, or return (output, observations)."""
        __tracebackhide__ = True
        status = outcome["status"]
        self.review += [r for r in outcome.get("review", []) if r not in self.review]
        if status == "fail":
            slug = outcome.get("mistake")
            hint = Mistake(slug, outcome["hint"], CALL_MISTAKES.get(slug, "")) if slug else outcome["hint"]
            self.fail(outcome["message"], hint, _FAIL_KINDS.get(outcome["kind"], CheckFailed), what="other")
        if status == "raised":
            self._fail_on_exception(outcome["kind"], outcome["summary"], outcome.get("code", ""))
        return outcome["out"], outcome.get("obs")

    def _fail_on_exception(self, kind: str, summary: str, code: str = "") -> None:
        __tracebackhide__ = True
        if kind == "not attempted":
            self.case = ""
            self.fail("not attempted yet: your function still raises NotImplementedError.",
                      "replace `raise NotImplementedError()` with your implementation, then run this cell again.",
                      NotAttempted)
        if kind == "timed out":
            self.fail(f"your function did not return within {self.time_limit:g} s.",
                      "look for a loop that never ends, or work that grows much faster than the inputs.", TimedOut,
                      what="time-limit")
        if kind == "exit":
            self.fail(f"your function called sys.exit() (or exit(), quit()): SystemExit({code}).",
                      Mistake("called-sys.exit", "a function hands back its result with `return`; sys.exit() "
                              "stops the whole program.", "called sys.exit() instead of returning"), LearnerError)
        if kind == "interrupt":
            self.fail("your function raised KeyboardInterrupt itself.",
                      Mistake("raised-KeyboardInterrupt", "return the result instead of raising; KeyboardInterrupt "
                              "is for the stop button.", "raised KeyboardInterrupt itself"), LearnerError)
        hint = next((h for pat, h in {**self.error_hints, **CORE_ERROR_HINTS}.items() if re.search(pat, summary)), "")
        self.fail(f"your function raised {summary}", hint or "run it on the case above to see where it fails.",
                  LearnerError, generic=not hint, what="crash")

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
        factors: Mapping[str, float] | None = None,
    ) -> torch.Tensor:
        """Fail unless ``got`` is a plain tensor on ``expected``'s device, of its dtype and shape,
        finite where it is, and close to it.

        ``mistakes`` maps a hint to the output a known wrong implementation gives (a tensor, or a
        zero-argument callable returning one, evaluated lazily); when ``got`` matches one, that
        hint is shown. ``diagnosis`` is a mistake the check recognised by other means. Both are
        named at the first failure; ``hint`` is the full recipe, shown on a repeated failure.
        ``factors`` (words -> this case's value, e.g. ``{"d_k": 16}``) name the exercise's quantities,
        so that a wrong constant factor is said in them.

        A failing comparison does not stop the check at once: it records the failure and the check
        runs its remaining cases (see :meth:`_hold`); the first failure is reported at the end, naming
        a mistake only if its model matched the output in every comparison where it has one."""
        __tracebackhide__ = True
        recipe = hint
        t = _type(got)
        if got is None:
            self.fail(f"{what}: expected a tensor, got None.", _RETURNED_NONE)
        if t is _Parameter:
            got, t = _TensorBase.as_subclass(got, _Tensor), _Tensor
        if t is not _Tensor:
            if _issubclass(t, _Tensor):
                self.fail(f"{what}: got a {t.__name__}, a subclass of torch.Tensor; checks accept plain tensors only.",
                          Mistake("tensor-subclass", "return a plain torch.Tensor (subclasses can change how "
                                  "comparisons behave).", "returned a subclass of torch.Tensor"), Refused)
            if t.__module__ == "numpy":
                self.fail(f"{what}: expected a torch.Tensor {describe(expected)}, got {describe(got)} (convert with "
                          "torch.from_numpy / torch.as_tensor).",
                          "compute with torch on the input tensors; a NumPy result must be converted back.", recipe=recipe,
                          what="type")
            self.fail(f"{what}: expected a torch.Tensor {describe(expected)}, got {describe(got)}.", recipe=recipe,
                      what="type")
        if got.layout != _strided or got.is_nested:
            self.fail(f"{what}: expected a dense tensor, got a {str(got.layout).removeprefix('torch.')} one.",
                      "convert it with .to_dense().", what="type")
        if got.device != expected.device:
            if got.device.type == "meta":
                self.fail(f"{what}: expected a tensor on {expected.device}, got one on the meta device.",
                          Mistake("meta-device", _META_HINT, "returned a tensor on the meta device"))
            self.fail(f"{what}: expected a tensor on {expected.device}, got one on {got.device}.",
                      Mistake("wrong-device", _DEVICE_HINT, "created tensors on a fixed device, not the inputs'"))
        if got.dtype != expected.dtype:
            self.fail(
                f"{what}: expected dtype {expected.dtype}, got {got.dtype}.",
                Mistake("dtype-not-kept", f"your {what} is {str(got.dtype).removeprefix('torch.')}, where the inputs' "
                        f"dtype, {str(expected.dtype).removeprefix('torch.')}, is expected: keep the input's dtype "
                        "(avoid torch.tensor(...) defaults, NumPy round trips and `.double()`/`.float()`; a result "
                        "computed in another dtype goes back with `.to(x.dtype)`).",
                        "returned another dtype than the inputs'"),
            )
        e64, g64 = expected.detach().to(_float64), got.detach().to(_float64)
        if got.shape != expected.shape:
            self._hold(got, mistakes, diagnosis, f"{what}: expected shape {list(expected.shape)}, got {list(got.shape)}.",
                       "print the shape after each step and compare it with the contract.", recipe, "shape",
                       lambda: shape_value_facts(g64, e64, atol, rtol), tol=(atol, rtol), expected=expected)
            return got
        exp_finite = _isfinite(expected) if expected.is_floating_point() else _ones_like(expected, dtype=_bool)
        got_finite = _isfinite(got)
        if got.is_floating_point() and not _equal(got_finite, exp_finite):
            bad = (got_finite != exp_finite).nonzero()[0].tolist()
            kind = "NaN" if bool(_isnan(got[tuple(bad)])) else "Inf" if not bool(got_finite[tuple(bad)]) else _fmt(float(g64[tuple(bad)]))
            self._hold(got, mistakes, diagnosis,
                       f"{what}: got {kind} at index {bad} where {_fmt(float(e64[tuple(bad)]))} was expected.",
                       "NaN usually comes from 0 * inf, inf - inf or log(0); Inf from exp of a large number.", recipe,
                       "nan-inf", lambda: nonfinite_facts(g64, e64, atol, rtol), tol=(atol, rtol), expected=expected)
            return got
        close = _isclose(g64, e64, atol=atol, rtol=rtol, equal_nan=True) if got.is_floating_point() else _eq(g64, e64)
        if not bool(close.all()):
            n_bad = int((~close).sum())
            idx = (~close).nonzero()[0].tolist()
            diff = (g64 - e64).abs().nan_to_num(0).max().item()
            self._hold(got, mistakes, diagnosis,
                       f"{what}: values differ at {n_bad} of {close.numel()} entries (max abs diff {_fmt(diff)}); "
                       f"first at index {idx}: expected {_fmt(float(e64[tuple(idx)]))}, got {_fmt(float(g64[tuple(idx)]))}.\n"
                       f"  expected starts {_preview(expected)}\n  got      starts {_preview(got)}",
                       "", recipe, "values",
                       lambda: tensor_facts(g64, e64, atol, rtol, factors, expected.dtype), tol=(atol, rtol),
                       expected=expected)
            return got
        self._weigh(got, mistakes, failing=False, tol=(atol, rtol))
        if self.case and self.case not in self.passed_cases and self._pending is None:
            self.passed_cases.append(self.case)
        return got

    def number(self, got: Any, expected: float | int, what: str = "result", mistakes: Mapping[str, Any] | None = None,
               hint: str = "", rel: float = 0.0, abs_tol: float = 0.0, integer: bool = False, diagnosis: str = "",
               factors: Mapping[str, float] | None = None) -> Any:
        """Fail unless ``got`` is a plain Python number (an ``int`` when ``integer``) close to
        ``expected``. ``mistakes`` maps a hint to the number a known wrong implementation gives;
        ``diagnosis`` and ``hint`` work as in :meth:`tensor`. ``factors`` (words -> this case's value:
        ``{"the number of layers L": 4}``) name the exercise's quantities: when no mistake is named,
        a quantity that explains every failing case at once (got = expected x L, or + L) is reported
        (:func:`~helpers.checks.diagnose.factor_facts`)."""
        __tracebackhide__ = True
        recipe = hint
        t = _type(got)
        if got is None:
            self.fail(f"{what}: expected a number, got None.", _RETURNED_NONE)
        if t is _Tensor and got.numel() == 1:
            self.fail(f"{what}: expected a Python number, got a tensor {describe(got)}.",
                      Mistake("tensor-not-number", "return `.item()` of it.", "returned a tensor, not a number"))
        numpy_scalar = t.__module__ == "numpy" and _issubclass(t, numbers.Real) and t is not bool
        if t is bool or (t not in (int, float) and not numpy_scalar):
            if _issubclass(t, (int, float)) and t is not bool:
                self.fail(f"{what}: got a {t.__name__}, a subclass of {'int' if _issubclass(t, int) else 'float'}; "
                          "checks accept plain Python numbers only.",
                          Mistake("number-subclass", "return a plain int or float: the number itself, not an "
                                  "object that behaves like one.", "returned a subclass of a Python number"), Refused)
            self.fail(f"{what}: expected a number, got {describe(got)}.", recipe=recipe, what="type")
        value = _to_float(got)  # +-inf for an int beyond float's range: compared exactly below, never crashes
        if integer and not (t is int or value.is_integer()):
            self.fail(f"{what}: expected a whole number, got {got!r}.",
                      "counts (of bytes, FLOPs, heads, positions) are integers: use // and int().", what="values")
        if integer and t is not int:
            self.fail(f"{what}: expected an int, got {describe(got)} {got!r}.",
                      "return int(...): counts (of bytes, FLOPs, heads, positions) are ints.", what="type")
        exact = t is int and _type(expected) is int and rel == 0 and abs_tol == 0
        ok = got == expected if exact else _isclose_num(value, _to_float(expected), rel_tol=rel, abs_tol=abs_tol)
        if not ok:
            if math.isfinite(value):
                self._number_failures.setdefault(what, []).append((value, _to_float(expected), dict(factors or {})))
            failures = self._number_failures.get(what, [])
            self._hold(got, mistakes, diagnosis,
                       f"{what}: expected {number_text(expected)}, got {number_text(got)}." if integer else
                       f"{what}: expected {_fmt(_to_float(expected))}, got {_fmt(value)}.", "", recipe, "values",
                       lambda: "" if not math.isfinite(value) else factor_facts(failures) or number_facts(got, expected),
                       number=(exact, rel, abs_tol))
            return got
        self._weigh(got, mistakes, failing=False, number=(exact, rel, abs_tol))
        if self.case and self.case not in self.passed_cases and self._pending is None:
            self.passed_cases.append(self.case)
        return got

    def tuple(self, got: Any, n: int, names: Sequence[str]) -> tuple:
        """Fail unless ``got`` is a tuple (or list) of ``n`` items; ``names`` name them."""
        __tracebackhide__ = True
        if _type(got) not in (tuple, list) or _len(got) != n:
            self.fail(f"expected a tuple of {n} ({', '.join(names)}), got {describe(got)}.",
                      f"return {', '.join(names)} together: `return {', '.join(names)}`.", what="type")
        return tuple(got)

    def _weigh(self, got: Any, mistakes: Mapping[str, Any] | None, failing: bool,
               number: tuple | None = None, tol: tuple[float, float] = (1e-5, 1e-4), expected: Any = None) -> list[str]:
        """The mistakes whose model gives ``got``, in order; every model that gives something else is
        refuted for the rest of this check (a case the learner passed refutes a model that differs
        from the expected output there). Lazy models (callables) are evaluated on failures only.
        Models are matched at the comparison's tolerance or the default (1e-5, 1e-4), whichever is
        looser; on a failure, a model that gives the ``expected`` output explains nothing and is skipped."""
        cmp_tol, tol = tol, (max(tol[0], 1e-5), max(tol[1], 1e-4))
        hits, missed = [], []
        if not self._weighing:
            return hits
        for hint, wrong in (mistakes or {}).items():
            if callable(wrong) and not failing:
                continue
            try:
                w = wrong() if callable(wrong) else wrong
                same = self._same(got, w, number, tol)
            except Exception:  # noqa: BLE001 - a mistake model that does not apply to this case
                continue
            if same and failing and expected is not None and number is None and self._same(expected, w, None, cmp_tol):
                continue  # this mistake changes nothing on this case
            if same is not None:
                (hits if same else missed).append(hint)
        # A mistake whose slug extends another's ("per-head-widths-and-no-biases" extends
        # "per-head-widths") is that mistake made together with another: where it matches, the
        # mistake it extends is not refuted.
        extended = {getattr(h, "slug", None) for h in hits}
        for hint in missed:
            slug = getattr(hint, "slug", None)
            if not (slug and any(x and x.startswith(slug + "-") for x in extended)):
                self._refuted.add(str(hint))
        return hits

    def _match_mistake(self, got: Any, mistakes: Mapping[str, Any]) -> str:
        """The first mistake whose model gives ``got`` (a tensor), weighing nothing: for a check that
        tests a part of the output (returned buffers, say) before it compares the output itself."""
        for hint, wrong in mistakes.items():
            try:
                if self._same(got, wrong() if callable(wrong) else wrong, None):
                    return hint
            except Exception:  # noqa: BLE001 - a mistake model that does not apply to this case
                continue
        return ""

    @staticmethod
    def _same(got: Any, w: Any, number: tuple | None, tol: tuple[float, float] = (1e-5, 1e-4)) -> bool | None:
        """Does the model's output ``w`` equal ``got`` (within the comparison's tolerance ``tol``, (atol,
        rtol): a model is matched as the expected output is)? None when they cannot be compared."""
        if number is not None:
            exact, rel, abs_tol = number
            if _type(w) not in (int, float) and not (_type(w) is _Tensor and w.numel() == 1):
                return None
            wv = _to_float(w.item() if _type(w) is _Tensor else w)
            if exact and _type(w) is int:
                return got == w
            return _isclose_num(_to_float(got), wv, rel_tol=max(rel, 1e-9), abs_tol=abs_tol)
        if _type(w) is not _Tensor or _type(got) is not _Tensor:
            return None
        if w.device != got.device:
            return None
        if w.shape != got.shape:
            return False
        if got.is_floating_point() and w.is_floating_point():
            return bool(_allclose(got.detach().to(_float64), w.detach().to(_float64), atol=tol[0], rtol=tol[1],
                                  equal_nan=True))
        if got.dtype != w.dtype:
            return None
        return bool(_equal(got, w))

    def _hold(self, got: Any, mistakes: Mapping[str, Any] | None, diagnosis: str, message: str, tip: str,
              recipe: str, what: str, found: Callable[[], str], number: tuple | None = None,
              tol: tuple[float, float] = (1e-5, 1e-4), expected: Any = None) -> None:
        """A failing comparison. The first one is kept (with the mistakes that match it) and the check
        goes on with its remaining cases, quietly and within :data:`COLLECT_S`; a later one only
        weighs the mistakes. :meth:`_conclude` reports the first."""
        __tracebackhide__ = True
        hits = self._weigh(got, mistakes, failing=True, number=number, tol=tol, expected=expected)
        if self._pending is not None:
            return
        elapsed = _monotonic() - self._started
        self._collect_until = _monotonic() + min(max(elapsed, COLLECT_S[0]), COLLECT_S[1])
        self._pending = dict(message=message, hits=hits, diagnosis=diagnosis, tip=tip, recipe=recipe, what=what,
                             found=found, case=self.case, passed=list(self.passed_cases))

    def _conclude(self) -> None:
        """Fail with the first failure held by :meth:`_hold`, naming the first of its mistakes that no
        comparison refuted (or ``diagnosis``), else stating a fact about it."""
        __tracebackhide__ = True
        p, self._pending = self._pending, None
        if p is None:
            return
        self.case, self.passed_cases = p["case"], p["passed"]
        named = next((h for h in p["hits"] if str(h) not in self._refuted), "") or p["diagnosis"]
        found = ""
        if not named:
            try:
                found = p["found"]()
            except Exception:  # noqa: BLE001 - a fact that cannot be computed is not stated
                found = ""
        generic = not named
        self.fail(p["message"], named or (p["tip"] if p["what"] != "values" else ""), recipe=p["recipe"],
                  generic=generic, found=found, what="" if named else p["what"])


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
                   recognised=True, summary=changed[0], exercise=ex, mistake_id=f"{ex.id}/changed-course-functions",
                   mistake="changed the course's or torch's functions")


def _run(ex: Exercise, body: Callable[[Trial], None], fn: Any, time_limit: float | None) -> CheckResult:
    """Run one check; never raises except for a real interrupt or a bug in the check itself."""
    if _type(fn) is Remote and not fn.info.get("callable"):
        message = (f"{ex.id} {ex.name}: pass your function itself, e.g. `checks.{ex.name}({ex.name})`; "
                   f"got {str(fn.info.get('describe', 'something else'))[:80]}.")
        error = CheckFailed(message, message, exercise=ex)
        error.status = "error"
        return CheckResult(ex, "error", message, message, False, False, error, mistake_id=f"{ex.id}/not-a-function",
                           mistake="passed something other than a function to the check")
    if not callable(fn):
        message = f"{ex.id} {ex.name}: pass your function itself, e.g. `checks.{ex.name}({ex.name})`; got {describe(fn)}."
        error = CheckFailed(message, message, exercise=ex)
        error.status = "error"
        return CheckResult(ex, "error", message, message, False, False, error, mistake_id=f"{ex.id}/not-a-function",
                           mistake="passed something other than a function to the check")
    trial = Trial(ex, fn, time_limit or DEFAULT_TIME_LIMIT_S)
    remote = _type(fn) is Remote  # in the judge, where no learner code runs: nothing to guard here
    error = None if remote else _guard_before(ex)
    if error is None:
        try:
            body(trial)
        except (CheckFailed, _StopCollecting) as e:
            error = e if _isinstance(e, CheckFailed) else None
        except Exception:  # noqa: BLE001 - after a failure, the remaining cases may trip the check on the output
            if trial._pending is None:
                raise
        if error is None or (trial._pending is not None and not _isinstance(error, Refused)):
            try:
                trial._conclude()  # the first failing comparison, now that every case has been weighed
                changed = [] if remote else verify_integrity(restore=True)
                if changed:
                    trial.case = ""
                    trial.fail(f"your code changed what the check relies on: {'; '.join(changed[:4])}. The check "
                               "put the originals back.", Mistake("changed-course-functions", "do not replace "
                                                                  "functions of torch or of the course's helpers.",
                                                                  CALL_MISTAKES["changed-course-functions"]), Refused)
            except CheckFailed as e:
                error = e
    if error is None:
        return CheckResult(ex, "passed", "", "", False, trial.is_reference, review=trial.review)
    if not _isinstance(error, NotAttempted):
        _FAILURES[ex.name] = _FAILURES.get(ex.name, 0) + 1
    hint = error.instructor_hint if _isinstance(error, CheckFailed) else ""
    return CheckResult(ex, error.status, str(error), hint, getattr(error, "recognised", False), trial.is_reference, error,
                       review=trial.review, mistake_id=getattr(error, "mistake_id", ""),
                       mistake=getattr(error, "mistake", ""))


_CHECKS: dict[str, Callable] = {}  # function name -> its check (registered by exercise())


def run_check(name: str, fn: Any) -> CheckResult:
    """Run the check of exercise ``name`` on ``fn`` and return its :class:`CheckResult`: nothing
    printed, nothing raised (except a real interrupt); recorders are called as usual."""
    check = _CHECKS[name]
    return check.evaluate(fn)


def exercise(time_limit: float | None = None, *, entry: Exercise | None = None):
    """Turn ``body(t: Trial)`` into the check ``checks.<name>(fn)`` of the exercise whose function
    is ``body``'s name, as ``helpers/registry.py`` lists it (id, title, stars, notebook, section,
    bonus); ``entry`` gives one that is not in the registry (the machinery's tests).

    The section named there is shown when a failure has no recognised cause. The check prints one
    line (and the model answer) when everything passes; otherwise it raises :class:`CheckFailed`,
    except that an unattempted exercise in an interactive session only shows a notice. Either way
    the outcome is recorded. ``time_limit`` (seconds per call of the learner's function) defaults
    to ``DEFAULT_TIME_LIMIT_S``, read when the check runs. ``check.evaluate(fn)`` runs it silently
    and returns the :class:`CheckResult`.
    """
    if callable(time_limit):
        raise TypeError("write @exercise() with its parentheses")

    def decorate(body: Callable[[Trial], None]) -> Callable[[Callable], None]:
        ex = entry if entry is not None else registry.lookup(body.__name__)
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


# --------------------------------------------------------------------------- where a learner stands


_MARKS = {"passed": "✓", "not attempted": "◻"}


def summary(notebook: str) -> None:
    """Print where you stand in ``notebook`` (``"05_multihead"``): each exercise's latest check in
    this kernel (passed, failed and why, not attempted, or not checked yet), and the points."""
    mine = sorted((e for e in EXERCISES.values() if e.notebook == notebook), key=lambda e: e.order)
    if not mine:
        names = sorted({e.notebook for e in EXERCISES.values()})
        print(f"no exercises in a notebook named {notebook!r}; the course's are: {', '.join(names)}")
        return
    lines, earned, total, bonus = [f"Exercises of {notebook}, as checked in this session:"], 0, 0, 0
    for e in mine:
        result = _LATEST.get(e.name)
        status = result.status if result is not None else "not checked yet"
        why = ""
        if result is not None and status not in ("passed", "not attempted"):
            first = str(result.error or result.message).split("\n")
            why = f": {first[1].strip()}" if len(first) > 1 else ""
        pts = f"{e.points} pt{'s' if e.points != 1 else ''}{' bonus' if e.bonus else ''}"
        line = f"  {_MARKS.get(status, '✗' if result is not None else '·')} {e.id} {e.name} ({pts}): {status}{why}"
        lines.append(line if len(line) <= 160 else line[:158].rsplit(" ", 1)[0] + " …")  # at a word
        if e.bonus:
            bonus += e.points if status == "passed" else 0
        else:
            total += e.points
            earned += e.points if status == "passed" else 0
    lines.append(f"  score: {earned}/{total} points" + (f" + {bonus} bonus" if any(e.bonus for e in mine) else "")
                 + ("" if earned == total else " (run an exercise's cell again after changing it)"))
    print(wrap("\n".join(lines)))  # between words: a browser would cut a long line mid-word
