"""The course as Colab runs it: the package installed from a wheel, no clone on the path.

On Colab the bootstrap cell pip-installs ``attention-course`` and the notebooks run with nothing
else of the repository. So whatever a notebook reads ships as package data and is read through
the package (``helpers.package_data.package_file``):

- fast: every file a notebook or the package reads through ``package_file`` is matched by
  pyproject's ``[tool.setuptools.package-data]`` (so the wheel carries it), and no notebook reads a
  path of the repository around it (``../bench``, ``Path("..")``);
- slow: a wheel built from the working tree, installed with its dependencies into a fresh venv
  outside the repository, runs every notebook of notebooks/ and exercises/ top to bottom in a
  folder that holds only those notebooks, as a learner's Run All does (blank exercises print
  "not attempted" and the notebook goes on), with the installed package imported.
"""

from __future__ import annotations

import ast
import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys
import time
import venv
from pathlib import Path

import pytest

from helpers.checks.feedback import RAISE_NOT_ATTEMPTED_ENV
from helpers.package_data import RESULTS, package_file
from helpers.tools import notebooks as nbtools
from tests.torch_index import running_torch_pip_args

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = nbtools.ROOT
PACKAGE = ROOT / "helpers"


# --------------------------------------------------------------------------- what the wheel carries


def _shipped() -> set[Path]:
    """The files of helpers/ that pyproject's package-data patterns match (setuptools globs them
    from the package's folder the same way)."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        patterns = tomllib.load(f)["tool"]["setuptools"]["package-data"]["helpers"]
    return {p for pattern in patterns for p in PACKAGE.glob(pattern) if p.is_file()}


def _tracked(folder: Path) -> set[Path]:
    """The files directly in `folder` that git tracks (what a clone, and so a git+ install, has)."""
    out = subprocess.run(["git", "ls-files", "--", str(folder.relative_to(ROOT))], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.split()
    return {ROOT / name for name in out if (ROOT / name).parent == folder}


def _code(path: Path) -> list[tuple[str, str]]:
    """(where, source) of every code cell of a notebook, or of a Python file; IPython's magics and
    shell lines are left out, so that the rest parses."""
    if path.suffix == ".py":
        return [(str(path.relative_to(ROOT)), path.read_text(encoding="utf-8"))]
    cells = nbtools.read(path).cells
    return [(f"{path.relative_to(ROOT)} cell {i}",
             "\n".join(line for line in c.source.splitlines() if not line.lstrip().startswith(("%", "!"))))
            for i, c in enumerate(cells) if c.cell_type == "code"]


def _package_file_calls(source: str) -> list[tuple[str, ...]]:
    """The arguments of every ``package_file(...)`` call in `source`: string literals, or names
    bound to one at the top of the same source (RESULTS is package_data's)."""
    tree = ast.parse(source)
    names = {"RESULTS": RESULTS} | {
        target.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
        for target in node.targets if isinstance(target, ast.Name)}
    calls = []
    for node in ast.walk(tree):
        func = getattr(node, "func", None)
        if isinstance(node, ast.Call) and getattr(func, "id", getattr(func, "attr", None)) == "package_file":
            parts = [arg.value if isinstance(arg, ast.Constant) else names.get(getattr(arg, "id", None))
                     for arg in node.args]
            assert all(isinstance(part, str) for part in parts), (
                f"package_file takes names this test can read (literals, or constants): {ast.unparse(node)}")
            calls.append(tuple(parts))
    return calls


def _sources() -> list[Path]:
    return nbtools.notebook_paths() + sorted(p for p in PACKAGE.rglob("*.py") if p.name != "package_data.py")


def test_every_file_read_through_the_package_is_package_data():
    shipped, reads = _shipped(), []
    for path in _sources():
        for where, source in _code(path):
            reads += [(where, parts) for parts in _package_file_calls(source)]
    assert any(parts[0] == RESULTS for _, parts in reads), "the notebooks read the recorded results"
    missing = []
    for where, parts in reads:
        target = PACKAGE.joinpath(*parts)
        assert target.exists(), f"{where}: helpers/{'/'.join(parts)} does not exist"
        # a folder is read with glob: every tracked file directly in it must ship
        wanted = _tracked(target) if target.is_dir() else {target}
        missing += [f"{where}: {p.relative_to(ROOT)}" for p in sorted(wanted - shipped)]
    assert not missing, "read through the package but not in pyproject's package-data:\n" + "\n".join(missing)


def test_no_notebook_reads_the_repository_around_it():
    """On Colab there is no clone: a notebook reads data through the package, never by a path
    relative to its own folder."""
    outside = re.compile(r"""Path\(\s*["']\.\.|["']\.\./|bench/results|kernel_report\.ROOT""")
    found = [where for path in nbtools.notebook_paths() for where, source in _code(path) if outside.search(source)]
    assert not found, f"these cells read files of the repository, absent on Colab: {found}"


def test_package_file_names_what_the_package_lacks():
    assert package_file(RESULTS, "kernel_aot.json").is_file()
    with pytest.raises(FileNotFoundError, match="no results/nothing.csv.*package-data"):
        package_file(RESULTS, "nothing.csv")


# --------------------------------------------------------------------------- every notebook, installed

# Runs one notebook in this (the fresh venv's) Python: its ipykernel is the kernel. A last cell asks
# the kernel which helpers it imported.
RUNNER = r'''
import json, sys
import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

path, report = sys.argv[1], sys.argv[2]
nb = nbformat.read(path, as_version=4)
nb.cells.append(nbformat.v4.new_code_cell("import helpers\nprint(helpers.__file__)"))
error = None
try:
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": "."}}).execute()
except CellExecutionError as exc:
    cell = next((i for i, c in enumerate(nb.cells) if c.cell_type == "code"
                 and any(o.output_type == "error" for o in c.get("outputs", []))), None)
    error = f"cell {cell}: {str(exc)[-1500:]}"
helpers_file = "".join(o.get("text", "") for o in nb.cells[-1].get("outputs", [])).strip()
json.dump({"error": error, "helpers": helpers_file}, open(report, "w"))
'''


def _installed_course(work: Path) -> Path:
    """A wheel of the working tree (tracked and new files, as a clone would have them, none of the
    build/ folder), installed with its dependencies into a fresh venv; returns its python."""
    tree = work / "tree"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, tree / name)
    pip = [sys.executable, "-m", "pip"]
    subprocess.run([*pip, "wheel", "--quiet", "--no-deps", str(tree), "-w", str(work / "wheel")], check=True)
    (wheel,) = (work / "wheel").glob("attention_course-*.whl")
    venv.create(work / "venv", with_pip=True)
    python = work / "venv" / "bin" / "python"
    same = running_torch_pip_args()  # the running torch and Triton, from where pip can find them
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", str(wheel), *same, "ipykernel", "nbclient"],
                   check=True)
    return python


@pytest.mark.slow
def test_every_notebook_runs_from_the_installed_package(tmp_path_factory):
    work = tmp_path_factory.mktemp("colab")
    start = time.perf_counter()
    python = _installed_course(work)
    installed = time.perf_counter() - start
    course = work / "course"  # notebooks/ and exercises/ only: no clone around them
    for folder in ("notebooks", "exercises"):
        shutil.copytree(ROOT / folder, course / folder)
    (work / "runner.py").write_text(RUNNER, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in (RAISE_NOT_ATTEMPTED_ENV, "PYTHONPATH")}
    env["OMP_NUM_THREADS"] = "1"

    def run(nb: Path) -> tuple[str, dict]:
        report = work / f"{nb.parent.name}-{nb.stem}.json"
        subprocess.run([str(python), str(work / "runner.py"), nb.name, str(report)], cwd=nb.parent, env=env,
                       capture_output=True, timeout=900)
        name = f"{nb.parent.name}/{nb.name}"
        return name, (json.loads(report.read_text()) if report.exists() else {"error": "the runner died"})

    notebooks = sorted((course / "notebooks").glob("[0-9][0-9]_*.ipynb")) + \
        sorted((course / "exercises").glob("[0-9][0-9]_*.ipynb"))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # two notebooks at a time
        results = dict(pool.map(run, notebooks))
    print(f"installed in {installed:.0f} s; {len(notebooks)} notebooks in {time.perf_counter() - start - installed:.0f} s")
    failed = {name: r["error"] for name, r in results.items() if r["error"]}
    assert not failed, "\n\n".join(f"{name}: {error}" for name, error in failed.items())
    site = work / "venv"
    wrong = {name: r["helpers"] for name, r in results.items() if not Path(r["helpers"]).is_relative_to(site)}
    assert not wrong, f"these notebooks imported helpers from outside the installed package: {wrong}"
