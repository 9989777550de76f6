"""What every topic's test file uses to state its exercises' cases: ``WRONG`` (learner-style wrong
implementations with the words the check's hint must contain) and ``RIGHT`` (correct ones in other
styles than the reference), both ``{exercise function name: [...]}``.

A topic file turns them into tests with::

    @pytest.mark.parametrize(("name", "wrong", "hint"), wrong_cases(WRONG))
    def test_check_rejects_wrong(name, wrong, hint):
        assert_rejected(name, wrong, hint)

    @pytest.mark.parametrize(("name", "right"), right_cases(RIGHT))
    def test_check_accepts_right(name, right):
        assert_accepted(name, right)

``tests/test_machinery.py`` reads every topic's ``WRONG`` and ``RIGHT`` (:func:`all_cases`) to
prove that each exercise has at least two of the one and one of the other.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable

import pytest

from helpers import checks
from helpers.checks import EXERCISES, CheckFailed, NotAttempted


def _id(value) -> str | None:
    return getattr(value, "__name__", None) if callable(value) else None


def wrong_cases(wrong: dict[str, list[tuple[Callable, str]]]) -> list:
    """``(name, wrong function, hint)`` parameters, one per wrong implementation."""
    return [pytest.param(name, fn, hint, id=f"{name}-{_id(fn)}") for name, impls in wrong.items() for fn, hint in impls]


def right_cases(right: dict[str, list[Callable]]) -> list:
    """``(name, right function)`` parameters, one per correct variant."""
    return [pytest.param(name, fn, id=f"{name}-{_id(fn)}") for name, fns in right.items() for fn in fns]


def first_fast(params: list, keep: dict[str, int], also: frozenset[str] | set[str] = frozenset()) -> list:
    """``params`` (from :func:`wrong_cases` or :func:`right_cases`) with only the first ``keep[name]``
    cases of each exercise named in ``keep`` left in ``make test``, and those whose id is in ``also``
    (a mistake of another kind than the first ones, caught by another part of the check); the others
    are marked slow (``make test-all``), same ids. For exercises whose cases take a second or more (the
    Triton interpreter, tile loops) or that have dozens of them: the first listed are the commonest
    mistakes, and they run the same check, so a broken check still fails ``make test``."""
    unknown = set(also) - {p.id for p in params}
    assert not unknown, f"first_fast: no case has the id {sorted(unknown)}"
    seen: dict[str, int] = {}
    out = []
    for p in params:
        name = p.values[0]
        seen[name] = seen.get(name, 0) + 1
        slow = name in keep and seen[name] > keep[name] and p.id not in also
        out.append(pytest.param(*p.values, marks=[*p.marks, pytest.mark.slow], id=p.id) if slow else p)
    return out


def assert_rejected(name: str, wrong: Callable, hint: str) -> CheckFailed:
    """The check of ``name`` fails on ``wrong``, naming the exercise and giving ``hint``."""
    with pytest.raises(CheckFailed) as info:
        getattr(checks, name)(wrong)
    message = str(info.value)
    assert message.startswith(f"{EXERCISES[name].id} {name}"), message
    assert hint in message, f"expected the hint {hint!r} in:\n{message}"
    mid = info.value.mistake_id
    assert isinstance(info.value, NotAttempted) or mid.startswith(f"{EXERCISES[name].id}/") and "/unnamed-" not in mid, (
        f"a recognised mistake needs a stable id: write its hint as Mistake('slug', ...); got {mid!r} for:\n{message}")
    return info.value


def assert_accepted(name: str, right: Callable) -> None:
    """The check of ``name`` passes ``right``, and nothing in it would mark a graded notebook for review."""
    result = getattr(checks, name).evaluate(right)
    assert result.passed, result.message
    assert not result.review, result.review


def all_cases() -> tuple[dict[str, list], dict[str, list]]:
    """Every topic test file's WRONG and RIGHT, merged by exercise name."""
    import tests

    wrong: dict[str, list] = {}
    right: dict[str, list] = {}
    for info in pkgutil.iter_modules(tests.__path__):
        if info.name.startswith("test_nb"):
            module = importlib.import_module(f"tests.{info.name}")
            for name, impls in getattr(module, "WRONG", {}).items():
                wrong.setdefault(name, []).extend(impls)
            for name, fns in getattr(module, "RIGHT", {}).items():
                right.setdefault(name, []).extend(fns)
    return wrong, right
