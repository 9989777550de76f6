"""Fixtures every test gets: a check's time limit short enough for tests (a never-returning
function is stopped sooner than the real limit, but a correct one on a loaded 2-core machine is
not cut off), and a learner's first attempt (graduated hints count failures per kernel)."""

import pytest

from helpers.checks import core, feedback


@pytest.fixture(autouse=True)
def _first_attempt_with_test_time_limit(monkeypatch):
    monkeypatch.setattr(core, "DEFAULT_TIME_LIMIT_S", 10.0)
    feedback.reset_attempts()
