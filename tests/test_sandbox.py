"""The grader's sandbox (helpers/tools/sandbox.py): what each notebook's copy of the course holds,
and each kind of sandbox where this machine can run it (namespaces with bubblewrap, a user of its
own as root, none). The forgeries, denial of service and honest habits graded in the default
sandbox are in tests/test_forgery.py."""

from __future__ import annotations

import ast
import csv
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

import nbformat
import pytest

from helpers.tools import sandbox
from helpers.tools.grading import course_notebooks
from helpers.tools.grading import main as grade_main
from tests.test_grading import ROOT, _append, _notebook
from tests.torch_index import cpu_index

STEMS = {stem: [e.name for e in exs] for stem, exs in course_notebooks().items()}


@pytest.fixture(scope="module")
def course(tmp_path_factory) -> Path:
    return sandbox.build_course(tmp_path_factory.mktemp("sandbox") / "course", STEMS)


def _defs(path: Path) -> dict[str, ast.AST]:
    return {n.name: n for n in ast.parse(path.read_text()).body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


def _is_stub(node: ast.AST) -> bool:
    return isinstance(node, ast.FunctionDef) and len(node.body) == 1 and isinstance(node.body[0], ast.Raise) \
        and "not in the grader's sandbox" in ast.unparse(node.body[0])


@pytest.mark.parametrize("stem", [s if s in ("01_qkv_shapes", "12_serving") else pytest.param(s, marks=pytest.mark.slow)
                                  for s in sorted(STEMS)])  # the first and the last in make test
def test_a_notebooks_copy_holds_no_check_no_reference_and_no_grader(course, stem):
    copy = course / "stems" / stem / "helpers"
    files = {str(p.relative_to(copy)) for p in copy.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    assert "reference.py" not in files and "model_answers.json" not in files
    assert not any(f.startswith("tools") for f in files), files
    assert {f for f in files if f.startswith("checks/")} == {f"checks/{m}" for m in sandbox.MACHINERY} | {
        "checks/__init__.py"}
    stub = (copy / "checks" / "__init__.py").read_text()
    assert "import" not in stub.split("MODULES")[0], "the checks' stub imports nothing of the checks"
    for path in copy.glob("*.py"):
        defs = _defs(path)
        for name in STEMS[stem]:  # every function named like one of this notebook's exercises
            if name in defs:
                assert _is_stub(defs[name]), f"{path.name}: {name} is in {stem}'s sandbox"
        if int(path.name[2:4] if path.name[2:4].isdigit() else 0) >= int(stem[:2]):  # its and later notebooks' modules
            kept = {n for n, node in defs.items() if isinstance(node, ast.FunctionDef) and not _is_stub(node)}
            at_import = sandbox.import_time(ast.parse((sandbox.HELPERS / path.name).read_text()))
            assert kept <= sandbox.LESSON_IMPORTS.get(stem, set()) | at_import, (path.name, kept)
            assert not at_import & set(STEMS[stem]), "an exercise's reference runs when its module is imported"


def test_lesson_imports_are_what_the_exercise_notebooks_import_from_their_own_modules():
    """LESSON_IMPORTS (the functions of a notebook's own modules left in its sandbox) is exactly what
    the course's exercise notebooks import from them."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / "exercises").glob("*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            for m in re.finditer(rf"from helpers\.nb{path.stem[:2]}_\w+ import ([\w, ]+)", cell.source):
                found.setdefault(path.stem, set()).update(n.strip() for n in m.group(1).split(","))
    assert found == sandbox.LESSON_IMPORTS


@pytest.mark.slow
def test_every_copy_imports_and_its_stubs_say_why(course):
    """Each notebook's copy imports (every module, as the notebook's process would, from the copy
    alone), and a stubbed function says why it is missing."""
    script = f'''
import importlib, json, pkgutil, sys
out = {{}}
for stem in {sorted(STEMS)!r}:
    for name in [m for m in sys.modules if m == "helpers" or m.startswith("helpers.")]:
        del sys.modules[name]
    sys.path[:1] = [{str(course / "stems")!r} + "/" + stem]
    import helpers
    assert helpers.__file__.startswith(sys.path[0]), helpers.__file__
    mods = [m.name for m in pkgutil.walk_packages(helpers.__path__, "helpers.")]
    for m in mods:
        importlib.import_module(m)
    try:
        getattr(importlib.import_module("helpers.nb" + stem[:2] + "_" + stem[3:]), {{stems}}[stem][0])()
        out[stem] = "no error"
    except RuntimeError as e:
        out[stem] = str(e)
    except Exception as e:
        out[stem] = type(e).__name__ + str(e)
print(json.dumps(out))
'''.replace("{stems}", repr(STEMS))
    done = subprocess.run([sys.executable, "-I", "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.strip().splitlines()[-1])
    for stem, text in said.items():
        if stem in ("10_positions", "12_serving"):  # their exercises live in more than one module
            continue
        assert "not in the grader's sandbox while it grades " + stem in text, (stem, text)


def test_asking_for_a_sandbox_this_machine_cannot_give_says_why(monkeypatch):
    with pytest.raises(ValueError, match="unknown sandbox"):
        sandbox.detect("docker")
    monkeypatch.setattr(sandbox, "_bwrap", lambda: None)
    with pytest.raises(OSError, match="bubblewrap is not installed"):
        sandbox.detect("namespaces")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(OSError, match="needs root"):
        sandbox.detect("user")
    found = sandbox.detect("auto")
    assert found.kind == "none" and "bubblewrap" in found.reason and "not root" in found.reason


def test_ci_and_gradescope_install_bubblewrap():
    """The README says make grade, CI and Gradescope get the namespaces sandbox where bubblewrap works:
    CI and Gradescope's set-up install it."""
    assert "apt-get install -y -qq bubblewrap" in (ROOT / ".ci" / "run").read_text()
    assert re.search(r"apt-get install[^\n]* bubblewrap", (ROOT / "gradescope" / "setup.sh").read_text())


@pytest.mark.slow
@pytest.mark.skipif(sandbox.detect().kind != "namespaces", reason="bubblewrap cannot create namespaces here")
def test_the_namespaces_sandbox_shows_a_notebook_nothing_of_the_grader(tmp_path, capsys):
    """What a notebook's process sees, reported through a graded function's error message."""
    probe = '''
import json, os, socket
def merge_heads(o):
    seen = {"course": sorted(os.listdir("/course")), "proc": len(os.listdir("/proc")), "uid": os.getuid(),
            "repo": sorted(os.listdir(REPO)) if os.path.isdir(REPO) else None}
    try:
        socket.create_connection(("1.1.1.1", 53), timeout=2)
        seen["net"] = True
    except OSError:
        seen["net"] = False
    libc = __import__("ctypes").CDLL(None, use_errno=True)
    seen["unshare"] = libc.unshare(0x10000000)  # a user namespace of its own: refused (-1)
    try:
        os.memfd_create("x")
        seen["memfd"] = True
    except OSError:
        seen["memfd"] = False
    try:
        open("/written-by-a-notebook", "w")
        seen["root_writable"] = True
    except OSError:
        seen["root_writable"] = False
    for name in ("helpers.reference", "helpers.checks.core", "helpers.tools.grading"):
        try:
            __import__(name)
            seen[name.split(".")[-1]] = True
        except ImportError:
            seen[name.split(".")[-1]] = False
    raise RuntimeError("SEEN" + json.dumps(seen, separators=(",", ":")))
'''.replace("REPO", repr(str(ROOT)))
    nbformat.write(_append(_notebook("01_qkv_shapes", "exercises"), probe), tmp_path / "01_qkv_shapes.ipynb")
    book = tmp_path / "gb.csv"
    grade_main([str(tmp_path / "01_qkv_shapes.ipynb"), "--no-progress", "--gradebook", str(book)])
    with open(book, newline="") as f:
        hint = next(r["hint"] for r in csv.DictReader(f) if r["function"] == "merge_heads")
    seen = json.loads(re.search(r"SEEN(\{.*?\})", hint).group(1))
    assert seen["repo"] in (None, [], [".venv"]), seen  # an environment inside the checkout is bound alone
    assert not seen["net"] and seen["proc"] == 0 and seen["uid"] != 0, seen
    assert not seen["reference"] and not seen["core"] and not seen["grading"], seen
    assert seen["course"] == ["active", "stems"], seen
    assert seen["unshare"] == -1 and not seen["memfd"] and not seen["root_writable"], seen


SYSTEM_PYTHON = Path("/usr/bin/python3.11")


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or not SYSTEM_PYTHON.exists(),
                    reason="the user sandbox needs root and a Python other users can read (Debian's python3.11)")
def test_the_user_sandbox_grades_and_names_what_its_user_could_read(capsys):
    """As root where namespaces are not used: each notebook as a user of its own (the environment,
    as Gradescope's, in a folder every user can read: Debian's Python, the course installed as a
    package), every process of that user ended after it. The gradebook says `user`; a course file
    any user could read is named in every row. The same environment also grades as an ordinary
    user (nobody) in the namespaces sandbox."""
    base = Path(tempfile.mkdtemp(prefix="user-sandbox-"))
    try:
        os.chmod(base, 0o755)
        venv = base / "venv"
        subprocess.run([str(SYSTEM_PYTHON), "-m", "venv", str(venv)], check=True, timeout=300)
        index = ["--extra-index-url", cpu_index()] if cpu_index() else []
        pip = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", *index,
                              "torch==" + version("torch").split("+")[0], str(ROOT)],
                             capture_output=True, text=True, timeout=1200)
        assert pip.returncode == 0, pip.stderr[-3000:]
        leftover = "import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', 'import time; time.sleep(90)', 'user-left'])"
        (base / "class").mkdir()
        nbformat.write(_append(_notebook("01_qkv_shapes", "exercises"), leftover), base / "class" / "01_qkv_shapes.ipynb")

        def graded() -> list[dict]:
            done = subprocess.run([str(venv / "bin" / "python"), "-m", "helpers.tools.grading",
                                   str(base / "class" / "01_qkv_shapes.ipynb"), "--no-progress", "--sandbox", "user",
                                   "--gradebook", str(base / "gb.csv")], cwd=base, capture_output=True, text=True,
                                  timeout=600)
            assert "sandbox: user" in done.stdout, done.stdout + done.stderr
            with open(base / "gb.csv", newline="") as f:
                rows = list(csv.DictReader(f))
            assert [r["status"] for r in rows] == ["not attempted"] * 3, rows
            assert {r["sandbox"] for r in rows} == {"user"}, rows
            return rows

        assert all("the user sandbox could read" in r["review"] and "reference.py" in r["review"] for r in graded())
        # The namespaces sandbox for a grader that is an ordinary user (nobody), where bubblewrap works
        if sandbox.detect().kind == "namespaces" and shutil.which("setpriv"):
            os.chmod(base / "class", 0o777)
            done = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups",
                                   str(venv / "bin" / "python"), "-m", "helpers.tools.grading",
                                   str(base / "class" / "01_qkv_shapes.ipynb"), "--no-progress",
                                   "--gradebook", str(base / "class" / "nobody.csv")],
                                  cwd=base / "class", capture_output=True, text=True, timeout=600,
                                  env={**os.environ, "HOME": str(base / "class")})
            assert "sandbox: namespaces" in done.stdout, done.stdout + done.stderr[-2000:]
            with open(base / "class" / "nobody.csv", newline="") as f:
                rows = list(csv.DictReader(f))
            assert [r["status"] for r in rows] == ["not attempted"] * 3, rows
            assert {r["sandbox"] for r in rows} == {"namespaces"} and {r["review"] for r in rows} == {""}, rows
        site = next((venv / "lib").glob("python3*/site-packages/helpers"))
        subprocess.run(["chmod", "-R", "go-rwx", str(site)], check=True)  # as gradescope/setup.sh does
        assert {r["review"] for r in graded()} == {""}
        ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
        assert "user-left" not in ps
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.slow
def test_without_a_sandbox_every_row_is_marked_for_review(tmp_path, capsys):
    nbformat.write(_notebook("01_qkv_shapes", "exercises"), tmp_path / "01_qkv_shapes.ipynb")
    book = tmp_path / "gb.csv"
    assert grade_main([str(tmp_path / "01_qkv_shapes.ipynb"), "--no-progress", "--sandbox", "none",
                       "--gradebook", str(book)]) == 2
    rows = book.read_text().splitlines()[1:]
    assert len(rows) == 3 and all("graded without a sandbox" in r and r.endswith(",none") for r in rows), rows
    assert "not attempted" in rows[0]
