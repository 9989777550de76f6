"""Gradescope as its own setup.sh builds it: the autograder zip from the Makefile's `gradescope`
recipe, unzipped into a temporary Gradescope root; setup.sh itself run there (AUTOGRADER_ROOT),
with apt-get stubbed on PATH and the course's runtime dependencies only (no dev extras); then
run_autograder, copied to the root as Gradescope does, on a solved, a blank and an empty submission.

The zip holds the working tree's tracked files (a tree object written with a private index, named
by GRADESCOPE_REV), not HEAD: the test checks the code it is run on, as every other test does, and
an uncommitted change to pyproject.toml's dependencies or to setup.sh is graded before its commit
(on CI the two are the same). Untracked files are left out, as `make gradescope` would leave them.

setup.sh takes torch from PyTorch's CPU index on Gradescope; here too when that index can be reached
(not several GB of CUDA packages from PyPI), else AUTOGRADER_TORCH_INDEX is empty and pip's own
configuration (this project's wheels, a CI mirror) provides it, as for `make setup`.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import jsonschema
import pytest

from helpers.checks import EXERCISES
from helpers.tools import sandbox
from tests.test_class_report import GRADESCOPE_SCHEMA
from tests.torch_index import cpu_index

ROOT = Path(__file__).resolve().parent.parent
HANDED_IN = ("01_qkv_shapes", "03_masks")  # two short notebooks
NOT_HANDED_IN = "02_scaling"  # named in NOTEBOOKS, never handed in: graded missing
DEV_ONLY = ("pytest", "nbclient", "nbval", "nbgrader", "jupyterlab", "playwright", "ruff")

pytestmark = pytest.mark.slow


def _run(cmd: list[str], what: str, timeout: float, **kw) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    assert done.returncode == 0, f"{what} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def _working_tree(tmp: Path) -> str:
    """A tree object of the working tree's tracked files (what `git commit -a` would commit), made with
    a copy of the index: the checkout's own index is neither locked nor changed."""
    git_dir = _run(["git", "rev-parse", "--absolute-git-dir"], "git rev-parse", 60, cwd=ROOT).stdout.strip()
    index = tmp / "index"
    shutil.copy(Path(git_dir) / "index", index)
    env = {**os.environ, "GIT_INDEX_FILE": str(index)}
    _run(["git", "add", "--update", "--", "."], "git add -u (private index)", 300, cwd=ROOT, env=env)
    return _run(["git", "write-tree"], "git write-tree", 60, cwd=ROOT, env=env).stdout.strip()


def _unzip(zip_path: Path, dest: Path) -> None:
    """As `unzip` does on Gradescope: the files with their permission bits."""
    with zipfile.ZipFile(zip_path) as z:
        for info in z.infolist():
            z.extract(info, dest)
            mode = info.external_attr >> 16
            if mode and not info.is_dir():
                os.chmod(dest / info.filename, stat.S_IMODE(mode))


@pytest.fixture(scope="module")
def gradescope(tmp_path_factory) -> dict:
    """The Gradescope root after setup.sh, and the environment its scripts run with."""
    if shutil.which("make") is None or shutil.which("git") is None:
        pytest.fail("make and git are needed to build the autograder zip as instructors do")
    tmp = tmp_path_factory.mktemp("gradescope")
    notebooks = ",".join([*HANDED_IN, NOT_HANDED_IN])
    _run(["make", "--no-print-directory", "gradescope", f"PY={sys.executable}", f"NOTEBOOKS={notebooks}",
          f"GRADESCOPE_REV={_working_tree(tmp)}", f"GRADESCOPE_OUT={tmp / 'build'}"],
         "make gradescope", 600, cwd=ROOT)
    root = tmp / "autograder"
    _unzip(tmp / "build" / "gradescope-autograder.zip", root / "source")

    # Gradescope's image is Ubuntu, run as root: apt-get installs Python there. Here a stub records
    # what setup.sh asks of it, and python3 is the Python that runs the tests (its base, not its venv).
    stubs = tmp / "stubs"
    stubs.mkdir()
    apt_log = tmp / "apt-get.log"
    (stubs / "apt-get").write_text(f'#!/bin/sh\necho "$*" >> "{apt_log}"\n')
    base = getattr(sys, "_base_executable", sys.executable)
    (stubs / "python3").write_text(f'#!/bin/sh\nexec "{base}" "$@"\n')
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env.update(PATH=f"{stubs}{os.pathsep}{env.get('PATH', '')}", AUTOGRADER_ROOT=str(root), AUTOGRADER_TORCH_INDEX=cpu_index())
    _run(["bash", "setup.sh"], "setup.sh", 1500, cwd=root / "source", env=env)
    assert "python3-venv" in apt_log.read_text(), "setup.sh did not install Python's venv with apt-get"
    assert "bubblewrap" in apt_log.read_text(), "setup.sh did not install bubblewrap (the grader's sandbox)"
    assert not (root / "source" / "course" / "solutions").exists(), "the autograder zip ships solutions/"
    assert (root / "source" / "course" / "exercises").is_dir()
    shutil.copy2(root / "source" / "run_autograder", root / "run_autograder")  # where Gradescope runs it
    return {"root": root, "env": env}


def _autograde(gradescope: dict, files: dict[str, Path]) -> dict:
    """Hand in ``files`` (path in the submission: notebook) and run /autograder/run_autograder."""
    root = gradescope["root"]
    shutil.rmtree(root / "submission", ignore_errors=True)
    shutil.rmtree(root / "results", ignore_errors=True)
    (root / "submission").mkdir()
    for name, source in files.items():
        (root / "submission" / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source, root / "submission" / name)
    _run([str(root / "run_autograder")], "run_autograder", 900, cwd=root, env=gradescope["env"])
    results = json.loads((root / "results" / "results.json").read_text(encoding="utf-8"))
    jsonschema.validate(results, GRADESCOPE_SCHEMA)
    return results


def _tests_of(results: dict, notebook: str) -> list[dict]:
    ids = {e.id for e in EXERCISES.values() if e.notebook == notebook}
    assert ids, notebook
    found = [t for t in results["tests"] if t.get("number") in ids]
    assert {t["number"] for t in found} == ids, f"{notebook}: not every exercise has a test: {results}"
    return found


def test_setup_installs_the_course_as_a_package_without_the_dev_extras(gradescope):
    root = gradescope["root"]
    probe = ("import importlib.util, json, helpers; print(json.dumps([helpers.__file__, "
             f"[m for m in {DEV_ONLY!r} if importlib.util.find_spec(m)]]))")
    where, dev = json.loads(_run([str(root / "venv" / "bin" / "python"), "-c", probe], "the venv's Python", 120,
                                 cwd=root, env=gradescope["env"]).stdout)
    assert Path(where).is_relative_to(root / "venv"), f"the grader's helpers are not the venv's own copy: {where}"
    assert not dev, f"setup.sh installed dev extras: {dev}"


def test_a_solved_submission_earns_full_marks_and_the_one_not_handed_in_is_missing(gradescope):
    results = _autograde(gradescope, {f"hw 1/solutions/{stem}.ipynb": ROOT / "solutions" / f"{stem}.ipynb"
                                      for stem in HANDED_IN})
    full = sum(e.points for e in EXERCISES.values() if e.notebook in HANDED_IN)
    assert results["score"] == full, results
    for stem in HANDED_IN:
        for t in _tests_of(results, stem):
            assert t["status"] == "passed" and t["score"] == next(
                e.points for e in EXERCISES.values() if e.id == t["number"]), t
            _only_copy_notes(t.get("output", ""))
    for t in _tests_of(results, NOT_HANDED_IN):
        assert t["score"] == 0 and t["status"] == "failed" and t["output"].startswith("missing"), t
    _only_copy_notes(results.get("output", ""))
    # run_autograder grades in the same sandbox as make grade, and says which
    assert f"sandbox: {sandbox.detect().kind}" in results["output"], results["output"]


def _only_copy_notes(text: str) -> None:
    """The course's solutions are (close to) its references: the grader flags them as copies, and
    for nothing else."""
    for line in text.splitlines():
        if "review" in line:
            for note in line.split(": ", 1)[-1].split("; "):
                assert "the course's" in note and ("after renaming" in note or "holds" in note), line


def test_a_blank_submission_scores_zero_with_every_exercise_not_attempted(gradescope):
    results = _autograde(gradescope, {f"{stem}.ipynb": ROOT / "exercises" / f"{stem}.ipynb" for stem in HANDED_IN})
    assert results["score"] == 0, results
    for stem in HANDED_IN:
        for t in _tests_of(results, stem):
            assert t["score"] == 0 and t["status"] == "failed" and t["output"].startswith("not attempted"), t
    for t in _tests_of(results, NOT_HANDED_IN):
        assert t["score"] == 0 and t["status"] == "failed" and t["output"].startswith("missing"), t


def test_a_submission_without_notebooks_scores_zero_and_says_why(gradescope):
    results = _autograde(gradescope, {})
    assert results["score"] == 0 and "could not grade" in results["output"], results
    assert "no notebooks found" in results["output"], results["output"]
