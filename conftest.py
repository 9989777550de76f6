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
  and 11's trained models: a third of all notebook time) run under nbval in `make test-all` only
  (``SLOW_NOTEBOOKS``); `make test` keeps their solutions notebooks under nbval and their lessons'
  unit tests (tests/test_nb09_*.py, test_nb10_*.py, test_nb11_*.py), and CI runs them all.
- Triton's interpreter is switched on (when there is no CUDA GPU) before any test module can
  import Triton, as ``setup()`` does in a notebook: Triton reads ``TRITON_INTERPRET`` when a kernel
  is decorated, so otherwise the outcome would depend on which test a worker happens to run first.
"""

import os

import pytest

RAISE_NOT_ATTEMPTED_ENV = "ATTN_COURSE_RAISE_NOT_ATTEMPTED"
SLOW_NOTEBOOKS = ("notebooks/09_flash_attention.ipynb", "notebooks/10_positions.ipynb",
                  "notebooks/11_trained_transformer.ipynb")


@pytest.hookimpl(tryfirst=True)  # before `-m "not slow"` deselects by mark
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.split("::")[0] in SLOW_NOTEBOOKS:
            item.add_marker(pytest.mark.slow)


def pytest_configure(config):
    os.environ[RAISE_NOT_ATTEMPTED_ENV] = "1"
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the kernels nbval and JupyterLab start
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # this process, whether or not torch was imported yet
    from helpers.runtime import configure_triton

    configure_triton()
