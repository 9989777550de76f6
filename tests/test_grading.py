"""`make grade`: what a notebook must contain comes from the course, the grader runs the checks,
results cannot be forged from the notebook, reports per notebook and per student, a class in
parallel with a gradebook CSV."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from helpers import registry
from helpers.tools import notebooks as nbtools
from helpers.tools import sandbox
from helpers.tools.grading import (
    Row,
    Submission,
    collect,
    course_notebooks,
    format_table,
    grade,
    grade_notebook,
    identify,
    passed,
    write_gradebook,
)
from helpers.tools.grading import main as grade_main

ROOT = nbtools.ROOT
GRADED_STEMS = sorted(p.stem for p in nbtools.notebook_paths("solutions") if p.stem in course_notebooks())


def _notebook(stem: str, folder: str = "solutions") -> nbformat.NotebookNode:
    return nbtools.read(ROOT / folder / f"{stem}.ipynb")


def _edit(nb: nbformat.NotebookNode, old: str, new: str) -> nbformat.NotebookNode:
    """Replace `old` by `new` in the one code cell that contains it (`new` None deletes the cell)."""
    hits = [c for c in nb.cells if c.cell_type == "code" and old in c.source]
    assert len(hits) == 1, f"{old!r} found in {len(hits)} cells"
    if new is None:
        nb.cells.remove(hits[0])
    else:
        hits[0].source = hits[0].source.replace(old, new)
    return nb


def _insert_after_setup(nb: nbformat.NotebookNode, source: str) -> nbformat.NotebookNode:
    index = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code" and "setup(" in c.source)
    nb.cells.insert(index + 1, nbformat.v4.new_code_cell(source))
    return nb


def _by_name(rows: list[Row]) -> dict[str, Row]:
    return {r.name: r for r in rows}


# --------------------------------------------------------------------------- fast: no notebook runs


def test_every_graded_notebook_is_known_to_the_grader():
    """The exercises a notebook must contain come from the checks' registry, by notebook stem."""
    with_exercises = {p.stem for p in nbtools.notebook_paths("solutions") if "checks." in p.read_text()}
    assert with_exercises <= set(course_notebooks())
    for stem in GRADED_STEMS:
        nb = _notebook(stem)
        checked = {name for c in nb.cells if c.cell_type == "code" for name in nbtools.CHECK_CALL.findall(c.source)}
        assert checked == {ex.name for ex in course_notebooks()[stem]}, stem


def test_identify_by_name_or_number(tmp_path):
    assert identify(Path("01_qkv_shapes.ipynb")) == ("01_qkv_shapes", "")
    stem, note = identify(Path("Copy of 01_qkv_shapes (2).ipynb"))
    assert stem == "01_qkv_shapes" and "graded as 01_qkv_shapes" in note
    with pytest.raises(Exception, match="not one of the course's exercise notebooks .*01_qkv_shapes.ipynb"):
        identify(Path("homework.ipynb"))
    (tmp_path / "homework.ipynb").write_text("{}")
    with pytest.raises(SystemExit, match="homework.ipynb is not one of the course's exercise notebooks"):
        collect([str(tmp_path / "homework.ipynb")])


def test_grade_rejects_bad_targets(tmp_path, capsys):
    with pytest.raises(SystemExit, match="neither a notebook"):
        grade_main([str(tmp_path / "missing.txt")])
    with pytest.raises(SystemExit, match="no notebooks found"):
        grade_main([str(tmp_path)])
    broken = tmp_path / "01_qkv_shapes.ipynb"
    broken.write_text("{not json")
    assert grade_main([str(broken), "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert "is not a readable notebook (NotJSONError" in out and "1.1 qkv_projection" in out, out


def test_the_grader_writes_no_nbgrader_course(tmp_path, capsys):
    """The nbgrader course has its own command (tests/test_nbgrader.py): the grader's parser refuses
    the flag it had for it."""
    with pytest.raises(SystemExit) as stop:
        grade_main(["--nbgrader-course", str(tmp_path / "course")])
    assert stop.value.code == 2 and "unrecognized arguments: --nbgrader-course" in capsys.readouterr().err
    assert not (tmp_path / "course").exists()


@pytest.mark.parametrize("error", ["ImportError", pytest.param("RuntimeError", marks=pytest.mark.slow)])
def test_checks_that_cannot_be_imported_stop_the_grader_in_one_line(tmp_path, error):
    """The grader reads the course from helpers.registry and never imports torch itself; the checks
    that every judge runs are imported by a process forked from the fork server, before any notebook
    runs. With a broken torch (an ImportError, or an error that ends the fork server) the grader
    stops with one line that says so (its own process, without torch, is untouched)."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(f"raise {error}('torch is broken here')\n")
    path = os.pathsep.join([str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])
    done = subprocess.run([sys.executable, "-m", "helpers.tools.grading", "exercises/01_qkv_shapes.ipynb",
                           "--no-progress"], cwd=ROOT, env={**os.environ, "PYTHONPATH": path},
                          capture_output=True, text=True, timeout=300)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1, done.stderr[-3000:]
    assert last.startswith("make grade: the course's checks could not be imported ("), done.stderr[-3000:]
    assert last.endswith("`python -c 'import helpers.checks'` shows the traceback."), last
    why = {"ImportError": "(ImportError: torch is broken here)",
           "RuntimeError": "(the fork server ended while importing them)"}
    assert why[error] in last, last
    assert "qkv_projection" not in done.stdout, done.stdout  # no table: nothing was graded


def test_a_class_folder_lists_missing_notebooks_and_skips_strangers(tmp_path):
    for student, files in {"alice": ["01_qkv_shapes.ipynb", "02_scaling.ipynb", "scratch.ipynb"],
                           "bob": ["Copy of 01_qkv_shapes.ipynb"]}.items():
        (tmp_path / student).mkdir()
        for f in files:
            (tmp_path / student / f).write_text("{}")
    subs, notes = collect([str(tmp_path)])
    got = {(s.student, s.stem): s.path.name if s.path else None for s in subs}
    assert got == {("alice", "01_qkv_shapes"): "01_qkv_shapes.ipynb", ("alice", "02_scaling"): "02_scaling.ipynb",
                   ("bob", "01_qkv_shapes"): "Copy of 01_qkv_shapes.ipynb", ("bob", "02_scaling"): None}
    assert any("scratch.ipynb is not one of the course's" in n for n in notes), notes
    assert any("graded as 01_qkv_shapes" in n for n in notes), notes
    rows = grade([s for s in subs if s.path is None], progress=False)  # nothing to run
    assert {(r.student, r.status, r.hint) for r in rows} == {("bob", "missing", "notebook not handed in.")}


def test_bonus_points_are_scored_apart_and_never_block_a_pass():
    rows = [Row("nb", "9.3", "a", 3, "passed"), Row("nb", "9.4", "b", 3, "not attempted", bonus=True)]
    table = format_table(rows)
    assert "score: 3/3 points + 0/3 bonus, 1/1 exercises passed" in table and "0/3 bonus" in table
    assert passed(rows)
    assert not passed([Row("nb", "9.3", "a", 3, "failed"), Row("nb", "9.4", "b", 3, "passed", bonus=True)])
    assert not passed([])


def test_table_has_notebook_and_student_columns_and_scores(tmp_path):
    rows = [Row("01_qkv_shapes", "1.1", "qkv_projection", 1, "passed", student="alice"),
            Row("01_qkv_shapes", "1.2", "merge_heads", 1, "failed", "transpose first", student="alice",
                mistake_id="1.2/merged-without-transpose", mistake="merged without transposing"),
            Row("02_scaling", "2.3", "dot_product_std", 2, "passed", student="alice"),
            Row("01_qkv_shapes", "1.1", "qkv_projection", 1, "missing", "notebook not handed in.", student="bob"),
            Row("01_qkv_shapes", "1.2", "merge_heads", 1, "missing", "notebook not handed in.", student="bob"),
            Row("02_scaling", "2.3", "dot_product_std", 2, "passed", student="bob")]
    lines = format_table(rows).splitlines()
    assert lines[0].split() == ["student", "notebook", "exercise", "points", "status", "hint"]
    assert lines[3].split()[:6] == ["alice", "01_qkv_shapes", "1.2", "merge_heads", "0/1", "failed"]
    scores = {ln.split()[0]: ln.split()[1:] for ln in lines if ln.startswith(("alice ", "bob "))
              and "_" not in ln.split()[1]}
    assert scores == {"alice": ["1/2", "2/2", "3/4"], "bob": ["0/2", "2/2", "2/4"]}, lines
    assert lines[-1] == "score: 5/8 points, 3/6 exercises passed (2 students)"
    one = format_table([r for r in rows if r.student == "alice"]).splitlines()
    assert one[0].split()[0] == "notebook" and "student" not in one[0]
    assert one[one.index("notebook       score") + 2:][:2] == ["01_qkv_shapes  1/2", "02_scaling     2/2"], one
    write_gradebook(rows, tmp_path / "gb.csv")
    with open(tmp_path / "gb.csv", newline="") as f:
        book = list(csv.DictReader(f))
    assert list(book[0])[:5] == ["student", "notebook", "exercise", "function", "points"]
    assert book[1] == {"student": "alice", "notebook": "01_qkv_shapes", "exercise": "1.2", "function": "merge_heads",
                       "points": "0", "max_points": "1", "bonus": "0", "status": "failed", "hint": "transpose first",
                       "review": "", "mistake_id": "1.2/merged-without-transpose", "mistake": "merged without transposing",
                       "sandbox": ""}


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_grade_is_wired():
    def dry_run(*args):
        return subprocess.run(["make", "--no-print-directory", "-n", "grade", "PY=python", *args], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout.strip()

    assert dry_run() == "python -m helpers.tools.grading exercises"
    assert dry_run("NB=exercises/01_qkv_shapes.ipynb") == "python -m helpers.tools.grading exercises/01_qkv_shapes.ipynb"
    assert dry_run("NB=submissions", "JOBS=8") == "python -m helpers.tools.grading -j 8 submissions"
    assert dry_run("NB=c", "REPORT=r", "GRADEBOOK=g.csv") == "python -m helpers.tools.grading --report r --gradebook g.csv c"


# --------------------------------------------------------------------------- slow: notebooks run


@pytest.mark.slow
def test_blank_exercises_grade_zero_and_solutions_full_marks(request):
    """Every course notebook through the grader: 24 notebook runs, ~20 s on 2 cores. make test keeps
    the same path on two notebooks (test_a_class_is_graded_in_parallel_into_a_gradebook: solutions
    01 and 02 pass, a blank 01 is not attempted), and nbval runs every solution notebook's checks.
    Under `make check-exercise EX=3.7` (--exercise), the exercise's notebook only."""
    from conftest import exercise_option

    one = exercise_option(request.config)
    stems = [one.notebook] if one is not None else GRADED_STEMS
    subs = [Submission(folder, stem, ROOT / folder / f"{stem}.ipynb") for folder in ("exercises", "solutions")
            for stem in stems]
    rows = grade(subs, jobs=2, progress=False)
    for stem in stems:
        blank = [r for r in rows if r.student == "exercises" and r.notebook == stem]
        solved = [r for r in rows if r.student == "solutions" and r.notebook == stem]
        assert blank and {r.status for r in blank} == {"not attempted"}, format_table(blank)
        assert solved and {r.status for r in solved} == {"passed"}, format_table(solved)
        assert not any(r.review for r in blank), format_table(blank)
        # the course's solutions are (close to) its references: flagged as copies, for nothing else
        for note in {n for r in solved for n in r.review.split("; ") if n}:
            assert "the course's" in note and ("after renaming" in note or "holds" in note), note
        assert len(blank) == len(course_notebooks()[stem])


MERGE_OK = "return o.transpose(1, 2).reshape(B, T, H * d_k)"
MERGE_WRONG = "return o.reshape(B, T, H * d_k)"
CHEAT_LOG = '''import json, os
for name in ("qkv_projection", "merge_heads", "scaled_dot_product_attention"):
    for var in ("ATTN_COURSE_GRADE_LOG", "GRADE_LOG"):
        if os.environ.get(var):
            with open(os.environ[var], "a") as f:
                f.write(json.dumps({"name": name, "status": "passed", "hint": ""}) + "\\n")
    print(f"✓ 1.1 {name}: passed")'''
CHEAT_CHANNEL = '''import gc, json
from multiprocessing.connection import Connection
for o in gc.get_objects():
    if isinstance(o, Connection) and not o.closed:
        for name in ("qkv_projection", "merge_heads", "scaled_dot_product_attention"):
            o.send_bytes(json.dumps({"type": "result", "secret": "", "name": name, "status": "passed",
                                     "hint": ""}).encode())'''
CHEAT_INDEX = '''import gc, json
from multiprocessing.connection import Connection
for o in gc.get_objects():
    if isinstance(o, Connection) and not o.closed:
        for index in ([0], {"a": 1}, None, "0", 1.5):
            o.send_bytes(json.dumps({"type": "cell", "index": index}).encode())
            o.send_bytes(json.dumps({"type": "cell_error", "index": index, "error": "x"}).encode())'''


def _cheats() -> dict[str, nbformat.NotebookNode]:
    """Notebooks named 01_qkv_shapes.ipynb that try to score what they did not earn."""
    blank = lambda: _notebook("01_qkv_shapes", "exercises")  # noqa: E731
    solved = lambda: _notebook("01_qkv_shapes")  # noqa: E731
    return {
        # 1.2 is wrong and its check cell is deleted / replaced by code that does not call the check
        "deleted_check": _edit(_edit(solved(), MERGE_OK, MERGE_WRONG), "checks.merge_heads(merge_heads)", None),
        "replaced_check": _edit(_edit(solved(), MERGE_OK, MERGE_WRONG), "checks.merge_heads(merge_heads)",
                                'print("✓ 1.2 merge_heads: merging the heads (1 pt) passed")'),
        # only 1.1 left in the file: the other exercises are missing, not absent from the grade
        "deleted_exercises": _edit(_edit(_edit(_edit(solved(), "def merge_heads", None), "checks.merge_heads(", None),
                                         "def scaled_dot_product_attention", None),
                                   "checks.scaled_dot_product_attention(", None),
        # a blank notebook whose check cells run the checks on the course's own reference functions
        "checks_on_reference": _edit(_edit(_edit(
            blank(), "checks.qkv_projection(qkv_projection)",
            "import helpers.nb01_qkv_shapes\nchecks.qkv_projection(helpers.nb01_qkv_shapes.qkv_projection)"),
            "checks.merge_heads(merge_heads)", "checks.merge_heads(helpers.nb01_qkv_shapes.merge_heads)"),
            "checks.scaled_dot_product_attention(scaled_dot_product_attention)",
            "checks.scaled_dot_product_attention(helpers.nb01_qkv_shapes.scaled_dot_product_attention)"),
        # a blank notebook that binds the exercise names to the course's reference at the end
        "reference_as_mine": _append(blank(), (
            "import helpers.nb01_qkv_shapes, helpers.reference, functools\n"
            "qkv_projection = helpers.nb01_qkv_shapes.qkv_projection\n"
            "merge_heads = functools.partial(helpers.reference.merge_heads)\n"
            "scaled_dot_product_attention = lambda q, k, v: helpers.reference.scaled_dot_product_attention(q, k, v)")),
        # a blank notebook that binds the exercise names to what the sandbox has under the lesson's names
        "stub_as_mine": _append(blank(), (
            "from helpers.nb01_qkv_shapes import qkv_projection, merge_heads, scaled_dot_product_attention")),
        # a blank notebook that replaces the checks themselves, and torch's comparisons
        "patched_checks": _insert_after_setup(blank(), (
            "import helpers.checks, torch\n"
            "for name in ('qkv_projection', 'merge_heads', 'scaled_dot_product_attention'):\n"
            "    setattr(helpers.checks, name, lambda fn: print('passed'))\n"
            "checks.merge_heads = lambda fn: None\n"
            "torch.allclose = lambda *a, **k: True\n"
            "torch.isclose = lambda a, b, **k: torch.ones_like(a, dtype=torch.bool)")),
        # a blank notebook that appends "passed" lines to the grade log and prints pass lines
        "forged_log": _append(blank(), CHEAT_LOG),
        # a blank notebook that writes forged results to the grader's own channel
        "forged_channel": _append(blank(), CHEAT_CHANNEL),
        # ... and cell numbers that are no cell's (a list once ended the whole grading run)
        "forged_index": _append(blank(), CHEAT_INDEX),
    }


def _append(nb: nbformat.NotebookNode, source: str) -> nbformat.NotebookNode:
    nb.cells.append(nbformat.v4.new_code_cell(source))
    return nb


@pytest.fixture(scope="module")
def cheat_rows(tmp_path_factory) -> dict[str, dict[str, Row]]:
    """Every cheat graded once, in parallel: {cheat: {exercise name: row}}."""
    root = tmp_path_factory.mktemp("cheats")
    subs = []
    for cheat, nb in _cheats().items():
        (root / cheat).mkdir()
        nbformat.write(nb, root / cheat / "01_qkv_shapes.ipynb")
        subs.append(Submission(cheat, "01_qkv_shapes", root / cheat / "01_qkv_shapes.ipynb"))
    rows = grade(subs, jobs=2, cell_timeout=120, progress=False)
    return {cheat: _by_name([r for r in rows if r.student == cheat]) for cheat in _cheats()}


def test_a_deleted_or_replaced_check_cell_cannot_make_a_wrong_function_pass(cheat_rows):
    for cheat in ("deleted_check", "replaced_check"):
        rows = cheat_rows[cheat]
        assert rows["merge_heads"].status == "failed", format_table(list(rows.values()))
        assert "transpose(1, 2) first" in rows["merge_heads"].hint
        # the judge's mistake id reaches the row (what the class report counts; the slow
        # test_class_report.py::test_grading_a_class_writes_the_report_with_exactly_the_planted_mistakes)
        assert rows["merge_heads"].mistake_id == "1.2/reshape-without-transpose", rows["merge_heads"]
        assert rows["qkv_projection"].status == rows["scaled_dot_product_attention"].status == "passed"
        assert not passed(list(rows.values()))


def test_deleted_exercises_are_missing_not_absent(cheat_rows):
    rows = cheat_rows["deleted_exercises"]
    assert [r.status for r in rows.values()] == ["passed", "missing", "missing"], format_table(list(rows.values()))
    assert "no function named `merge_heads`" in rows["merge_heads"].hint
    assert not passed(list(rows.values()))


def test_checks_run_on_the_course_reference_do_not_count(cheat_rows):
    """The sandbox holds no reference of the notebook's exercises: `helpers.reference` is not there,
    and the lesson module's functions of this notebook are stubs that say why."""
    rows = cheat_rows["checks_on_reference"]
    assert {r.status for r in rows.values()} == {"not attempted"}, format_table(list(rows.values()))
    rows = cheat_rows["reference_as_mine"]
    assert "passed" not in {r.status for r in rows.values()}, format_table(list(rows.values()))
    rows = cheat_rows["stub_as_mine"]
    assert {r.status for r in rows.values()} == {"error"}, format_table(list(rows.values()))
    assert "not in the grader's sandbox while it grades 01_qkv_shapes" in rows["merge_heads"].hint


def test_patched_checks_and_torch_do_not_count(cheat_rows):
    """The checks are not in the sandbox (a stub stands in for `helpers.checks`); torch patched in
    the notebook's process changes only what that process answers, which the judge decides on."""
    rows = cheat_rows["patched_checks"]
    assert "passed" not in {r.status for r in rows.values()}, format_table(list(rows.values()))


def test_forged_log_lines_and_printed_passes_do_not_count(cheat_rows):
    rows = cheat_rows["forged_log"]
    assert {r.status for r in rows.values()} == {"not attempted"}, format_table(list(rows.values()))


def test_forged_messages_on_the_graders_channel_are_caught(cheat_rows):
    """The grader's channel only carries progress; verdicts come from the judge. Forged results
    change nothing and mark the notebook for review (more kinds of forgery: tests/test_forgery.py)."""
    rows = cheat_rows["forged_channel"]
    assert {r.status for r in rows.values()} == {"not attempted"}, format_table(list(rows.values()))
    assert "forged" in rows["merge_heads"].review, rows["merge_heads"].review
    rows = cheat_rows["forged_index"]
    assert {r.status for r in rows.values()} == {"not attempted"}, format_table(list(rows.values()))
    assert "a forged or out-of-order 'cell' message" in rows["merge_heads"].review, rows["merge_heads"].review
    assert "a forged or out-of-order 'cell_error' message" in rows["merge_heads"].review


def test_one_wrong_exercise_is_reported_alone_with_its_hint(tmp_path, capsys):
    path = tmp_path / "01_qkv_shapes.ipynb"
    nbformat.write(_edit(_notebook("01_qkv_shapes"), MERGE_OK, MERGE_WRONG), path)
    assert grade_main([str(path), "--no-progress"]) == 1
    out = capsys.readouterr().out
    rows = {line.split()[2]: line for line in out.splitlines() if re.match(r"01_qkv_shapes +1\.\d ", line)}
    assert "passed" in rows["qkv_projection"] and "passed" in rows["scaled_dot_product_attention"], out
    assert "failed" in rows["merge_heads"] and "transpose(1, 2) first" in rows["merge_heads"], out
    total = sum(e.points for e in registry.by_notebook()["01_qkv_shapes"])  # 3; 1.2 is worth 1
    assert f"01_qkv_shapes  {total - 1}/{total}" in out and f"score: {total - 1}/{total} points" in out


@pytest.mark.slow
def test_syntax_errors_timeouts_and_a_dying_notebook_are_reported_as_such(tmp_path):
    nb = _notebook("01_qkv_shapes")
    for cell in nb.cells:  # a cell that loops at top level before its def, and a syntax error
        if cell.source.startswith("def merge_heads"):
            cell.source = "while True:\n    pass\n" + cell.source
        if cell.source.startswith("def scaled_dot_product_attention"):
            cell.source = "import math\n\ndef scaled_dot_product_attention(q, k, v)\n    return q"
    nbformat.write(nb, tmp_path / "01_qkv_shapes.ipynb")
    # Graded from a process that ignores SIGINT, as a job started in the background (CI, `make grade &`)
    # does: Python then installs no KeyboardInterrupt handler, and each notebook's process must put it
    # back, or the grader's interrupt of the loop is lost and the notebook is killed.
    script = ("import json, signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
              "from helpers.tools.grading import grade_notebook\n"
              f"rows = grade_notebook({str(tmp_path / '01_qkv_shapes.ipynb')!r}, cell_timeout=3)\n"
              "print(json.dumps({r.name: [r.status, r.hint] for r in rows}))")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    table = json.dumps(rows, indent=1) + out.stderr[-2000:]
    assert rows["qkv_projection"][0] == "passed", table
    assert rows["merge_heads"][0] == "timed out" and "was interrupted" in rows["merge_heads"][1], table
    status, hint = rows["scaled_dot_product_attention"]
    assert status == "error" and "SyntaxError" in hint and "line 3" in hint, table
    assert "NameError" not in hint

    (tmp_path / "died").mkdir()
    nbformat.write(_insert_after_setup(_notebook("01_qkv_shapes"), "import os\nos._exit(0)"),
                   tmp_path / "died" / "01_qkv_shapes.ipynb")
    rows = grade_notebook(tmp_path / "died" / "01_qkv_shapes.ipynb")
    assert {r.status for r in rows} == {"error"} and "(`import os`) ended the process" in rows[0].hint, format_table(rows)


def test_a_class_is_graded_in_parallel_into_a_gradebook(tmp_path, capsys):
    cls = tmp_path / "class"
    for student, sources in {"ada": ("solutions", "solutions"), "bo": ("exercises", None)}.items():
        (cls / student).mkdir(parents=True)
        for stem, folder in zip(("01_qkv_shapes", "02_scaling"), sources):
            if folder:
                shutil.copy(ROOT / folder / f"{stem}.ipynb", cls / student / f"{stem}.ipynb")
    for nb in (cls / "ada").glob("*.ipynb"):  # the course's solutions, but not copies of its references
        nbformat.write(_decopy(nbformat.read(nb, as_version=4)), nb)
    book = tmp_path / "out" / "gradebook.csv"
    assert grade_main([str(cls), "-j", "2", "--gradebook", str(book), "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert "grading 4 notebooks of 2 students" in out
    with open(book, newline="") as f:
        records = list(csv.DictReader(f))
    got = {(r["student"], r["notebook"], r["status"]) for r in records}
    assert got == {("ada", "01_qkv_shapes", "passed"), ("ada", "02_scaling", "passed"),
                   ("bo", "01_qkv_shapes", "not attempted"), ("bo", "02_scaling", "missing")}, got
    assert {r["sandbox"] for r in records} == {"namespaces" if sandbox.detect().kind == "namespaces" else "user"}
    assert {r["review"] for r in records} == {""}, records
    mine = [e for stem in ("01_qkv_shapes", "02_scaling") for e in registry.by_notebook()[stem]]  # 6 exercises, 7 points
    n, points = len(mine), sum(e.points for e in mine)
    assert f"score: {points}/{2 * points} points, {n}/{2 * n} exercises passed (2 students)" in out, out
    assert out.rstrip().splitlines()[-1].startswith(f"verdict: {n} of {2 * n} exercises passed"), out[-500:]
    assert "exit status 1 only tells CI" in out
    assert grade_main([str(cls / "ada"), "--no-progress", "--gradebook", str(book)]) == 0
    assert capsys.readouterr().out.rstrip().splitlines()[-1] == f"verdict: all {n} exercises passed (exit status 0)"
    assert grade_main([str(cls), "--shard", "1/2", "--no-progress", "--gradebook", str(book)]) == 0  # ada only


def _decopy(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """The solutions of notebooks 01 and 02 written another way (the course's own solutions are
    copies of its references, which the grader flags for review): as a learner would write them."""
    swaps = {"return o.transpose(1, 2).reshape(B, T, H * d_k)": "return torch.einsum('bhtd->bthd', o).flatten(2)",
             "return q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])":
                 "scale = q.shape[-1] ** -0.5\n    return torch.einsum('...id,...jd->...ij', q, k) * scale",
             "return torch.special.entr(p).sum(dim=-1)": "return -torch.xlogy(p, p).sum(-1)",
             "return (q * k).sum(dim=-1).std().item()": "dots = torch.einsum('nd,nd->n', q, k)\n    return float(dots.std())"}
    for cell in nb.cells:
        for old, new in swaps.items():
            cell.source = cell.source.replace(old, new)
    return nb


def test_the_gradebook_goes_where_the_instructor_says(tmp_path, monkeypatch, capsys):
    """With --report DIR the gradebook goes into DIR, never into the folder `make grade` runs in;
    a class graded without either goes to gradebook.csv there (covered by .gitignore); a gradebook
    that cannot be written is refused in one line before anything is graded."""
    from helpers.tools.grading import gradebook_path

    cls = tmp_path / "class"
    for student in ("ada", "bo"):
        (cls / student).mkdir(parents=True)
        shutil.copy(ROOT / "exercises" / "02_scaling.ipynb", cls / student / "02_scaling.ipynb")
    monkeypatch.chdir(tmp_path)
    assert grade_main([str(cls), "--report", "rep", "--no-progress"]) == 1
    assert (tmp_path / "rep" / "gradebook.csv").is_file() and not (tmp_path / "gradebook.csv").exists()
    assert (tmp_path / "rep" / "mistakes.csv").is_file() and (tmp_path / "rep" / "report.html").is_file()
    rows = 2 * len(registry.by_notebook()["02_scaling"])  # a row per student and exercise
    assert f"gradebook: rep/gradebook.csv ({rows} rows)" in capsys.readouterr().out
    assert gradebook_path(None, None, 2) == Path("gradebook.csv") and gradebook_path(None, None, 1) is None
    assert gradebook_path(Path("a.csv"), Path("rep"), 2) == Path("a.csv")
    assert "gradebook.csv" in (ROOT / ".gitignore").read_text().split()
    (tmp_path / "afile").write_text("")
    for where, said in (("afile/gradebook.csv", "afile is a file"), ("rep", "rep is a folder")):
        with pytest.raises(SystemExit) as stop:
            grade_main([str(cls), "--no-progress", "--gradebook", where])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and said in err and "Traceback" not in err, err


@pytest.mark.slow
def test_nbval_lax_fails_blank_exercises(tmp_path):
    """Students run `pytest --nbval-lax exercises/`: a blank notebook fails (not attempted). (A filled
    one passes: solutions/ passes nbval in strict mode in every test run, which is stricter.)"""
    blank = tmp_path / "blank" / "01_qkv_shapes.ipynb"
    blank.parent.mkdir()
    shutil.copy(ROOT / "exercises" / "01_qkv_shapes.ipynb", blank)
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax",
                             "--nbval-current-env", str(blank)], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 1 and "not attempted yet" in result.stdout, result.stdout[-2000:]

