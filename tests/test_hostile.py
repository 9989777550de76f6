"""Hostile submissions against every registered exercise (new topics are included as soon as
their checks are registered): each is rejected with a clear message, never passes and never
crashes the check, and whatever it replaced is back afterwards.

The "wrong answer" each one returns is built from the reference's output on the check's first
case (recorded by a function that is not attempted yet, the reference run here, outside any
check): tensors, numbers, lists, tuples and dicts are perturbed. Every defence acts inside the
check's first call of the learner's function, so that case is the only one a hostile submission
needs to answer. Exercise-specific cheats (NumPy in 9.1/9.2, copy-only Triton kernels, finite
differences in 4.3, ...) are tested next to each topic's wrong implementations.
"""

from __future__ import annotations

import functools
import sys

import pytest
import torch

from helpers import checks, reference
from helpers.checks import EXERCISES, CheckFailed, core, feedback, guard
from helpers.runtime import configure_triton

configure_triton()  # as setup() does in a notebook: Triton's interpreter on before any kernel exists
NAMES = sorted(EXERCISES)
_SAVED = {name: getattr(torch, name) for name in ("isclose", "allclose", "equal")}


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(core, "DEFAULT_TIME_LIMIT_S", 120.0)  # the Triton interpreter is slow
    feedback.reset_attempts()
    yield
    for name, fn in _SAVED.items():  # whatever happened, leave torch as it was for other tests
        setattr(torch, name, fn)
    assert guard.verify_integrity(restore=True) == [], "something replaced was not put back"


_FIRST: dict[str, tuple] = {}


def first_case(name: str) -> tuple[tuple, dict, object]:
    """(args, kwargs, reference output) of the first call the check of ``name`` makes."""
    if name not in _FIRST:
        seen: dict = {}

        def not_attempted(*args, **kwargs):
            seen["call"] = (args, kwargs)
            raise NotImplementedError()

        result = getattr(checks, name).evaluate(not_attempted)
        assert result.status == "not attempted" and "call" in seen, result.message
        args, kwargs = seen["call"]
        _FIRST[name] = (args, kwargs, getattr(reference, name)(*args, **kwargs))
    return _FIRST[name]


def perturb(x):
    """A wrong answer of the same structure as the right one ``x``."""
    if isinstance(x, torch.Tensor):
        if x.dtype == torch.bool:
            return ~x
        if x.is_floating_point():
            return x + (x.detach().abs().nan_to_num(0, 0, 0).mean() + 1).to(x.dtype)
        return x + 1
    if isinstance(x, bool):
        return not x
    if isinstance(x, int):
        return x + 1
    if isinstance(x, float):
        return 1.5 * x + 1.0
    if isinstance(x, (list, tuple)):
        items = [perturb(e) for e in x] if x else [(0, 1)]
        return type(x)(items)
    if isinstance(x, dict):
        return {k: perturb(v) for k, v in x.items()}
    return x


def _map(x, on_tensor=None, on_number=None):
    if isinstance(x, torch.Tensor):
        return on_tensor(x) if on_tensor else x
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return on_number(x) if on_number else x
    if isinstance(x, (list, tuple)):
        return type(x)(_map(e, on_tensor, on_number) for e in x)
    if isinstance(x, dict):
        return {k: _map(v, on_tensor, on_number) for k, v in x.items()}
    return x


def _has(x, kind) -> bool:
    if isinstance(x, kind) and not isinstance(x, bool):
        return True
    if isinstance(x, (list, tuple)):
        return any(_has(e, kind) for e in x)
    if isinstance(x, dict):
        return any(_has(v, kind) for v in x.values())
    return False


def rejected(name: str, fn) -> CheckFailed:
    """Run the check as a learner would; it must raise CheckFailed (not pass, not crash)."""
    with pytest.raises(CheckFailed) as info:
        getattr(checks, name)(fn)
    message = str(info.value)
    assert message.startswith(f"{EXERCISES[name].id} {name}"), message
    return info.value


# ----------------------------------------------------------------------------- the submissions


@pytest.mark.parametrize("name", NAMES)
def test_monkeypatched_comparisons_are_refused(name):
    wrong = perturb(first_case(name)[2])

    def hostile(*args, **kwargs):
        torch.isclose = lambda a, b, *r, **k: torch.ones(torch.broadcast_shapes(a.shape, b.shape), dtype=torch.bool)
        torch.allclose = lambda *r, **k: True
        torch.equal = lambda *r, **k: True
        return wrong

    e = rejected(name, hostile)
    assert "torch.isclose was replaced" in str(e) and "put the originals back" in str(e), str(e)
    assert all(getattr(torch, n) is fn for n, fn in _SAVED.items())


@pytest.mark.parametrize("name", NAMES)
def test_comparisons_patched_earlier_in_the_notebook_are_refused(name):
    torch.allclose = lambda *r, **k: True  # a cell before the check
    e = rejected(name, getattr(reference, name))
    assert "torch.allclose was replaced" in str(e), str(e)
    assert torch.allclose is _SAVED["allclose"]


@pytest.mark.parametrize("name", NAMES)
def test_replacing_the_course_reference_is_refused(name):
    wrong = perturb(first_case(name)[2])
    holders = [m for n, m in sys.modules.items() if n.startswith("helpers.") and not n.startswith("helpers.checks")
               and callable(getattr(m, name, None))]
    originals = {m: getattr(m, name) for m in holders}

    def hostile(*args, **kwargs):
        fake = lambda *a, **k: wrong
        for module in holders:
            setattr(module, name, fake)
        return getattr(reference, name)(*args, **kwargs)

    e = rejected(name, hostile)
    assert f".{name} was replaced" in str(e), str(e)
    assert all(getattr(m, name) is fn for m, fn in originals.items())


class Liar(torch.Tensor):
    """A tensor whose comparisons always agree."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in {"allclose", "equal"}:
            return True
        if name in {"isclose", "eq", "__eq__"}:
            return torch.ones(args[0].shape, dtype=torch.bool)
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("name", NAMES)
def test_tensor_subclass_is_refused(name):
    wrong = perturb(first_case(name)[2])
    out = _map(wrong, on_tensor=lambda t: t.as_subclass(Liar)) if _has(wrong, torch.Tensor) \
        else torch.zeros(1).as_subclass(Liar)

    e = rejected(name, lambda *a, **k: out)
    assert "subclass of torch.Tensor" in str(e), str(e)


def _lying(value, truth):
    base = int if isinstance(value, int) else float

    class Lying(base):
        def __eq__(self, other):
            return True

        __hash__ = base.__hash__

        def __float__(self):
            return float(truth)

        def __int__(self):
            return int(truth)

    return Lying(value)


@pytest.mark.parametrize("name", NAMES)
def test_lying_number_is_refused(name):
    expected = first_case(name)[2]
    if not _has(expected, (int, float)):
        pytest.skip("no Python number in this exercise's output")
    truths = []
    _map(expected, on_number=truths.append)
    it = iter(truths)
    out = _map(perturb(expected), on_number=lambda v: _lying(v, next(it)))

    e = rejected(name, lambda *a, **k: out)
    assert "a subclass of int" in str(e) or "a subclass of float" in str(e), str(e)


@pytest.mark.parametrize("name", NAMES)
def test_sys_exit_is_a_failed_check_and_recorded(name):
    import sys as system

    results = []
    recorder = feedback.add_recorder(results.append)
    try:
        e = rejected(name, lambda *a, **k: system.exit(3))
    finally:
        feedback.remove_recorder(recorder)
    assert "sys.exit()" in str(e) and e.status == "error", str(e)
    assert [r.status for r in results] == ["error"]


@pytest.mark.parametrize("name", NAMES)
def test_keyboard_interrupt_raised_by_the_learner_is_a_failed_check(name):
    def hostile(*args, **kwargs):
        raise KeyboardInterrupt

    e = rejected(name, hostile)
    assert "raised KeyboardInterrupt" in str(e), str(e)


@pytest.mark.parametrize("name", NAMES)
def test_meta_output_is_refused(name):
    wrong = perturb(first_case(name)[2])
    out = _map(wrong, on_tensor=lambda t: t.to("meta")) if _has(wrong, torch.Tensor) \
        else torch.empty(3, device="meta")

    e = rejected(name, lambda *a, **k: out)
    assert "meta device" in str(e), str(e)


def _via_reference_module(name):
    return lambda *a, **k: getattr(reference, name)(*a, **k)


def _via_alias(name):
    alias = getattr(reference, name)
    return lambda *a, **k: alias(*a, **k)


def _via_partial(name):
    return functools.partial(lambda f, *a, **k: f(*a, **k), getattr(reference, name))


def _via_topic_module(name):
    module = next(m for n, m in sorted(sys.modules.items()) if n.startswith("helpers.") and n != "helpers.reference"
                  and not n.startswith("helpers.checks") and callable(getattr(m, name, None)))
    return lambda *a, **k: getattr(module, name)(*a, **k)


@pytest.mark.parametrize("how", [_via_reference_module, _via_alias, _via_partial, _via_topic_module],
                         ids=["reference", "alias", "partial", "topic_module"])
@pytest.mark.parametrize("name", NAMES)
def test_calling_the_course_reference_is_refused(name, how):
    if how is _via_topic_module and not any(
            n.startswith("helpers.") and n != "helpers.reference" and not n.startswith("helpers.checks")
            and callable(getattr(m, name, None)) for n, m in sys.modules.items()):
        pytest.skip("the reference is defined in helpers.reference itself")
    e = rejected(name, how(name))
    assert "called the course's own solution" in str(e), str(e)


@pytest.mark.parametrize("name", NAMES)
def test_turning_off_the_watch_to_call_the_reference_is_refused(name):
    ref = getattr(reference, name)

    def hostile(*args, **kwargs):
        tracer = sys.gettrace()
        sys.settrace(None)
        try:
            return ref(*args, **kwargs)
        finally:
            sys.settrace(tracer)

    e = rejected(name, hostile)
    assert "trace function" in str(e), str(e)


@pytest.mark.parametrize("name", NAMES)
def test_mutated_list_argument_is_refused(name):
    args, kwargs, expected = first_case(name)
    if not any(isinstance(a, list) and len(a) > 1 for a in (*args, *kwargs.values())):
        pytest.skip("no list argument in this exercise's first case")
    wrong = perturb(expected)

    def hostile(*a, **k):
        for x in (*a, *k.values()):
            if isinstance(x, list):
                x.reverse()
        return wrong

    e = rejected(name, hostile)
    assert "in place" in str(e), str(e)
