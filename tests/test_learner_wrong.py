"""The learner-style wrong answers of ``tests/learner_wrong/`` (issue 32), written from the exercise
statements before the diagnosis that catches them: every one is still rejected, with the diagnosis
it got when it was last judged (``tests/learner_wrong/expected.json``: the recorded mistake id, and
whether a ``found:`` fact was given). A change that names a different mistake, loses a name or a
fact, or lets an answer pass fails here; after an intended change, rerun
``.venv/bin/python -m tests.learner_wrong.baseline --after`` and ``--record``, and judge the new feedback
(BASELINE.md, AFTER.md). Slow (all of them take several minutes): ``make test-all``."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from helpers import checks
from helpers.checks import CheckFailed
from tests.learner_wrong.baseline import MODULES

HERE = Path(__file__).parent / "learner_wrong"
EXPECTED = json.loads((HERE / "expected.json").read_text())


def _params():
    out = []
    for module in MODULES:
        for exercise, wrongs in importlib.import_module(f"tests.learner_wrong.{module}").WRONG.items():
            for i, (_desc, fn) in enumerate(wrongs):
                out.append(pytest.param(exercise, i, fn, id=f"{exercise}-{i + 1}", marks=pytest.mark.slow))
    return out


def diagnosis(error: CheckFailed) -> str:
    """What a failure told the learner, as recorded: the mistake id, plus '+found' for a fact."""
    return error.mistake_id + ("+found" if "\n  found: " in str(error) else "")


@pytest.mark.parametrize(("exercise", "i", "fn"), _params())
def test_a_learner_style_wrong_answer_keeps_its_diagnosis(exercise, i, fn):
    from helpers.runtime import setup

    setup(seed=0)
    with pytest.raises(CheckFailed) as info:
        getattr(checks, exercise)(fn)
    assert diagnosis(info.value) == EXPECTED[exercise][i], str(info.value)
