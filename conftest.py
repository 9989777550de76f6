"""pytest set-up for the whole repository (tests/, and notebooks run by nbval).

- Under pytest an exercise that is not attempted must raise and count as not attempted, also
  inside the notebook kernels nbval starts (they inherit this process's environment), while a
  learner's interactive session only shows a notice and lets "Run All" reach every exercise. The
  variable's name is ``helpers.checks.feedback.RAISE_NOT_ATTEMPTED_ENV`` (a test checks that they
  agree).
- One thread per process: `make test` runs two workers on two cores, and each starts notebook
  kernels (nbval, the browser test); torch would start a thread per core in every one of them, and
  oversubscribed small-tensor work runs several times slower. Outputs do not depend on it (they
  are rounded; nbval passes with 1 thread or 2). Set OMP_NUM_THREADS to choose otherwise.
- The teaching notebooks that train or launch the most (09's Triton kernel in the interpreter, 10's
  and 11's trained models: a third of all notebook time; 13's rank processes, started and timed
  out on purpose) run under nbval in `make test-all` only (``SLOW_NOTEBOOKS``); `make test` keeps
  their solutions notebooks under nbval and their lessons' unit tests (tests/test_nb09_*.py,
  test_nb10_*.py, test_nb11_*.py, test_nb13_*.py, test_ranks.py), and CI runs them all.
- ``--exercise 3.7`` (``make check-exercise EX=3.7``) keeps the tests of one exercise, slow ones
  included: those whose id names its function, its notebook's solutions under nbval, the grading of
  its notebook blank and solved, and the tests that compare the registry with what derives from it
  (``EXERCISE_WIDE``).
- Triton's interpreter is switched on (when there is no CUDA GPU) before any test module can
  import Triton, as ``setup()`` does in a notebook: Triton reads ``TRITON_INTERPRET`` when a kernel
  is decorated, so otherwise the outcome would depend on which test a worker happens to run first.
"""

import os
import re

import pytest

RAISE_NOT_ATTEMPTED_ENV = "ATTN_COURSE_RAISE_NOT_ATTEMPTED"
SLOW_NOTEBOOKS = ("notebooks/09_flash_attention.ipynb", "notebooks/10_positions.ipynb",
                  "notebooks/11_trained_transformer.ipynb", "notebooks/13_across_devices.ipynb")


# What every exercise's tests include (--exercise): the registry against the code and what derives from it.
EXERCISE_WIDE = ("tests/test_machinery.py::test_the_registry_and_the_code_agree",
                 "tests/test_class_report.py::test_mistake_ids_are_stable_across_releases",
                 "tests/test_class_report.py::test_every_mistake_slug_is_written_out",
                 "tests/test_pipeline.py::test_exercises_are_generated_from_solutions",
                 "tests/test_pipeline.py::test_counts_and_ranges_in_the_prose_agree_with_the_registry",
                 "tests/test_pipeline.py::test_a_notebook_that_lists_its_exercises_lists_them_all",
                 "tests/test_scaffold.py::test_no_todo_of_the_scaffold_is_left",
                 "tests/test_pipeline.py::test_readme_lists_every_notebook_with_colab_badges",
                 "tests/test_grading.py::test_blank_exercises_grade_zero_and_solutions_full_marks")


def pytest_addoption(parser):
    parser.addoption("--exercise", default=None, metavar="ID",
                     help="only the tests of one exercise (its id, 3.7, or its function's name)")


def exercise_option(config):
    """The exercise ``--exercise`` names (a ``helpers.registry.Exercise``), or None."""
    wanted = config.getoption("exercise", None)
    if not wanted:
        return None
    from helpers import registry

    found = registry.find(wanted)
    if found is None:
        raise pytest.UsageError(f"--exercise {wanted}: no such exercise in helpers/registry.py")
    return found


def _of_exercise(nodeid: str, ex) -> bool:
    path = nodeid.split("::")[0]
    if path == f"solutions/{ex.notebook}.ipynb" or nodeid.split("[")[0] in EXERCISE_WIDE:
        return True
    test = nodeid.split("::", 1)[-1]
    if path in ("tests/test_pipeline.py", "tests/test_nbgrader.py") and ex.notebook in test:
        return True  # the notebook's own structure tests (line length, outputs, nbgrader's metadata, ...)
    named = re.search(rf"(?<![A-Za-z0-9]){re.escape(ex.name)}(?![A-Za-z0-9])", test)
    return bool(named) and path in (f"tests/test_{ex.module_name}.py", "tests/test_machinery.py")


@pytest.hookimpl(tryfirst=True)  # before `-m "not slow"` deselects by mark
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.split("::")[0] in SLOW_NOTEBOOKS:
            item.add_marker(pytest.mark.slow)
    ex = exercise_option(config)
    if ex is not None:
        kept = [item for item in items if _of_exercise(item.nodeid, ex)]
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept


def pytest_configure(config):
    os.environ[RAISE_NOT_ATTEMPTED_ENV] = "1"
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the kernels nbval and JupyterLab start
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # this process, whether or not torch was imported yet
    from helpers.runtime import configure_triton

    configure_triton()
