"""What a learner sees and what an instructor records: exercises, results, messages, hints.

- :class:`Exercise` and the failures a check raises (:class:`CheckFailed` and its kinds), with
  ``status`` as ``make grade`` reports it. In IPython a failure renders as its message alone,
  wrapped at word boundaries (:func:`wrap`), without the check machinery's traceback.
- **Graduated hints**: :data:`_FAILURES` counts failures per exercise in this kernel; the full
  recipe is shown only on a repeated failure (``Trial.fail`` in ``core``).
- **Every outcome is recorded** as a :class:`CheckResult`, handed to each callable registered
  with :func:`add_recorder` (the grader registers one).
- :func:`_present` prints a pass (with the model answer of the exercise's "why it matters"
  question, from ``helpers/model_answers.json``), shows an unattempted exercise as a notice in
  an interactive session, or raises the failure.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional  # noqa: F401  (watched by the integrity guard)

from ..registry import Exercise  # noqa: F401  (re-exported: checks and tests name it here)
from .guard import _isinstance, _issubclass, _len, _Parameter, _Tensor, _type

# --------------------------------------------------------------------------- constants for the course

RAISE_NOT_ATTEMPTED_ENV = "ATTN_COURSE_RAISE_NOT_ATTEMPTED"
"""When this environment variable is ``"1"``, an unattempted exercise raises :class:`NotAttempted`
even in an interactive session. The repository's ``conftest.py`` sets it for pytest (and so for
the notebook kernels nbval starts) and the grader sets it in its kernels. Outside IPython an
unattempted exercise always raises."""


RECIPE_AFTER = 3  # the full recipe is shown from this failed attempt of an exercise on (graduated hints)
WRAP_WIDTH = 92  # columns at which messages shown in a notebook are wrapped (at word boundaries)
MODEL_ANSWERS_FILE = "model_answers.json"  # package data of `helpers`, written by `make exercises`

# --------------------------------------------------------------------------- exercises and results


_SLUG = re.compile(r"[A-Za-z0-9_.]+(?:-[A-Za-z0-9_.]+)*")


class Mistake(str):
    """A hint that names a recognised mistake, with an identifier that stays the same across
    releases: ``Mistake("missing-W_O", "W_O is missing: ...")``. It is the hint string itself
    (a ``str``: it can key ``mistakes=`` dicts and be passed as ``hint``); the failure records
    ``<exercise id>/<slug>`` as its :attr:`CheckFailed.mistake_id` (``5.2/missing-W_O``).
    ``description`` is the one line a class report shows (default: the hint's first clause)."""

    def __new__(cls, slug: str, hint: str, description: str = "") -> Mistake:
        if not _SLUG.fullmatch(slug) or _len(slug) > 60:
            raise ValueError(f"a mistake's slug is words joined by '-' (letters, digits, _ and .), got {slug!r}")
        self = super().__new__(cls, hint)
        self.slug = slug
        self.description = description or first_clause(hint)
        return self

    def __reduce__(self):
        return (Mistake, (self.slug, str(self), self.description))


_CLAUSE_END = re.compile(r"(?<=\S): |(?<=\S); |(?<!\.)(?<!\be\.g)(?<!\bi\.e)\. ")


def first_clause(hint: str) -> str:
    """The hint up to its first ``": "`` (or ``"; "``, or its first sentence): the mistake in a line
    (of at most 110 characters)."""
    limit = 110
    text = " ".join(str(hint).split())
    m = _CLAUSE_END.search(text)  # ": ", "; " or the end of a sentence (not "...", "e.g.", "i.e.")
    cut = m.start() if m else _len(text)
    line = text[:cut].rstrip(".")
    return line if _len(line) <= limit else line[: limit - 3].rstrip() + "..."


def wrong_signature(contract: str) -> Mistake:
    """The mistake of a function defined with other parameters than its contract (matched by a
    check's ``error_hints``); ``contract`` is what follows "the signature is ", its full stop included."""
    return Mistake("wrong-signature", f"the signature is {contract}",
                   "defined the function with other parameters than the contract's")


# What an unrecognised failure is counted as in a class report (``<exercise id>/not-recognised-<what>``).
NOT_RECOGNISED = ("shape", "values", "dtype", "nan-inf", "type", "crash", "time-limit", "other")


def mistake_id(ex: Exercise, hint: str, recognised: bool, what: str = "other") -> str:
    """The identifier a failure is recorded under: the :class:`Mistake`'s, else
    ``not-recognised-<what>`` (``what`` from :data:`NOT_RECOGNISED`), else, for a recognised
    hint written without an identifier, ``unnamed-<hash>`` (the course's tests reject those)."""
    if _isinstance(hint, Mistake) and recognised:
        return f"{ex.id}/{hint.slug}"
    if not recognised or not hint:
        return f"{ex.id}/not-recognised-{what if what in NOT_RECOGNISED else 'other'}"
    return f"{ex.id}/unnamed-{hashlib.blake2b(str(hint).encode(), digest_size=3).hexdigest()}"


class CheckFailed(AssertionError):
    """A check did not pass. ``status`` is what `make grade` reports.

    Attributes: ``hint`` (the hint line the learner was shown, "" if none), ``instructor_hint``
    (what an instructor's table should show: the recognised mistake, else what differed),
    ``recognised`` (a mistake was named), ``recipe`` (the full recipe, shown on a repeated
    failure), ``summary`` (the first line of what differed), ``case``, ``exercise``,
    ``mistake_id`` (what a class report counts it as, :func:`mistake_id`) and ``mistake`` (its
    one-line description).
    """

    status = "failed"

    def __init__(self, message: str, hint: str = "", *, instructor_hint: str | None = None, recognised: bool = False,
                 recipe: str = "", summary: str = "", case: str = "", exercise: Exercise | None = None,
                 mistake_id: str = "", mistake: str = ""):
        super().__init__(message)
        self.mistake_id = mistake_id
        self.mistake = mistake
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
    differed). ``mistake_id`` / ``mistake``: the failure's identifier in a class report and its
    one-line description ("" for a pass or an unattempted exercise). ``is_reference``: the function checked was the course's own reference. ``review``:
    what the learner's function did that a grader should look at by hand (never decides the status)."""

    exercise: Exercise
    status: str
    message: str = ""
    hint: str = ""
    recognised: bool = False
    is_reference: bool = False
    error: CheckFailed | None = field(default=None, repr=False)
    review: list[str] = field(default_factory=list)  # what a grader should look at by hand (see calling.py)
    mistake_id: str = ""
    mistake: str = ""

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


_LATEST: dict[str, CheckResult] = {}  # exercise name -> its latest result in this kernel (summary())


def _record(result: CheckResult) -> None:
    _LATEST[result.exercise.name] = result
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
    if t is int:
        return f"int {number_text(x)}"
    if t is float:
        return f"float {x!r}"
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
    """4 significant digits; -0 shown as 0 (the sign of a zero means nothing to a learner)."""
    return f"{v + 0.0:.4g}" if math.isfinite(v) else str(v)


def number_text(x: Any) -> str:
    """``1,234,567`` for an int (``an int of 401 digits`` past 40 digits, which Python may refuse to
    print at all), ``0.5`` for anything else."""
    if _type(x) is int and x.bit_length() > 132:
        return f"{'a negative' if x < 0 else 'an'} int of about {int(x.bit_length() * 0.30103) + 1} digits"
    return f"{x:,}" if _type(x) is int else _short(x)


def _preview(t: torch.Tensor) -> str:
    """The first 6 entries of ``t``, flattened: ``[0.1, 0.2, ...]``."""
    n = 6
    flat = t.detach().reshape(-1)[:n].tolist()
    body = ", ".join(_fmt(float(v)) for v in flat)
    return f"[{body}{', ...' if t.numel() > n else ''}]"


def wrap(text: str) -> str:
    """Wrap each line of a message at word boundaries (at :data:`WRAP_WIDTH` columns), keeping its
    indentation; a ``hint:`` (or ``recipe:``, ``see:``) line continues under its first word."""
    width = WRAP_WIDTH
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



def _short(x: Any) -> str:
    """``repr(x)`` cut to 60 characters (what :func:`describe` says of it when its repr fails)."""
    n = 60
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
    r"Expected all tensors to be on the same device|found at least two devices": Mistake(
        "wrong-device", "create new tensors on the inputs' device (device=x.device, torch.zeros_like(x)), not on a "
        "fixed device such as the `device` that setup() returns.", "created tensors on a fixed device, not the inputs'"),
    r"^NotImplementedError \(from `": Mistake(
        "calls-unfinished-function", "a function yours calls still raises NotImplementedError: write that one "
        "first (its exercise's cell), run its cell, then run this check again.",
        "called a function that is not written yet"),
    r"^RecursionError": Mistake("endless-recursion", "your function calls itself without end: a recursion without "
                                "a base case, or a name that refers back to your own function.",
                                "the function calls itself without end"),
}



# --------------------------------------------------------------------------- model answers


_MODEL_ANSWERS: dict[str, Any] = {}


def model_answer(name: str) -> dict | None:
    """``{"exercise", "notebook", "question", "answer"}`` for exercise ``name`` from the package's
    model answers (written by ``make exercises`` from ``solutions/``), or None."""
    if "answers" not in _MODEL_ANSWERS:
        try:
            from helpers.package_data import package_file

            _MODEL_ANSWERS["answers"] = json.loads(package_file(MODEL_ANSWERS_FILE).read_text(encoding="utf-8"))
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



_FAILURES: dict[str, int] = {}  # exercise name -> failures in this kernel (graduated hints)


def reset_attempts() -> None:
    """Forget every earlier failure: the next failure of each exercise counts as its first."""
    _FAILURES.clear()



def _present(ex: Exercise, result: CheckResult) -> None:
    """Show a check's result. In a learner's own session (IPython, no grading variable) nothing is
    raised: a failure is printed (to stderr, which Jupyter shows in red) and Run All goes on to the
    next exercise; wherever a machine judges the notebook, a failure raises."""
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
    if _interactive() and error is not None:
        # wrapped here too: a browser breaks an over-long output line anywhere, mid-word included
        sys.stderr.write(wrap(f"✗ {error}") + "\n  (the notebook goes on: fix this and run the cell again)\n")
        return
    raise error.with_traceback(None) from None
