"""nbgrader accepts the course: the cell metadata `make exercises` writes is nbgrader's; nbgrader's
own `generate_assignment` turns solutions/ into exactly exercises/, and `autograde` gives a filled-in
notebook full marks and a blank one 0. Uses nbgrader from the dev dependencies (installs nothing)."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from helpers.checks import EXERCISES
from helpers.tools import grading, nbgrader
from helpers.tools import notebooks as nbtools
from helpers.tools.nbgrader import write_nbgrader_course

ROOT = nbtools.ROOT
STEMS = [p.stem for p in nbtools.notebook_paths("exercises")]
AUTOGRADED = "01_qkv_shapes"  # autograde runs its notebooks in kernels: one quick notebook is enough


def _nbgrader_meta(cell) -> dict:
    return {k: v for k, v in cell.metadata.get("nbgrader", {}).items() if k not in ("checksum", "cell_type")}


@pytest.mark.parametrize("stem", STEMS)
def test_exercise_cells_carry_nbgraders_metadata(stem):
    """Every exercise has a solution cell, an autograded check cell worth its points, and an answer
    cell; nbgrader's own validator accepts the notebook."""
    validator = pytest.importorskip("nbgrader.nbgraderformat", reason="nbgrader (a dev dependency) is not installed")
    nb = nbtools.read(ROOT / "exercises" / f"{stem}.ipynb")
    validator.MetadataValidator().validate_nb(nb)
    meta = {m["grade_id"]: m for m in map(_nbgrader_meta, nb.cells) if m}
    names = [e.name for e in EXERCISES.values() if e.notebook == stem]
    assert names
    for name in names:
        assert meta[name]["solution"] and not meta[name]["grade"], name
        assert meta[f"check_{name}"]["grade"] and meta[f"check_{name}"]["points"] == EXERCISES[name].points, name
        assert meta[f"answer_{name}"]["solution"] and meta[f"answer_{name}"]["points"] == 0, name
    for cell in nb.cells:
        if _nbgrader_meta(cell).get("grade") and cell.cell_type == "code":
            assert cell.metadata["editable"] is False and cell.metadata["deletable"] is False


def test_the_nbgrader_course_has_its_own_command(tmp_path, capsys):
    """`python -m helpers.tools.nbgrader DIR --cell-timeout S` writes the course (the grader's
    `--nbgrader-course` did, before 0.3) and says what to run next."""
    course = tmp_path / "course"
    assert nbgrader.main([str(course), "--cell-timeout", "7"]) == 0
    assert 'if __name__ == "__main__":\n    sys.exit(main())' in Path(nbgrader.__file__).read_text()
    lines = capsys.readouterr().out.splitlines()
    assert lines[:-1] == [f"wrote {course / 'source' / stem / f'{stem}.ipynb'}" for stem in STEMS], lines
    assert lines[-1] == f"next: cd {course} && nbgrader generate_assignment '*'"
    assert "c.Execute.timeout = 7.0  #" in (course / "nbgrader_config.py").read_text()
    source = nbtools.read(course / "source" / AUTOGRADED / f"{AUTOGRADED}.ipynb")
    assert source == nbtools.nbgrader_source(nbtools.read(ROOT / "solutions" / f"{AUTOGRADED}.ipynb"))
    assert grading.write_nbgrader_course is write_nbgrader_course  # importable from the grader since 0.2


def test_the_nbgrader_command_refuses_what_it_cannot_write(tmp_path, capsys):
    (tmp_path / "afile").write_text("")
    for args, said in (([str(tmp_path / "afile" / "course")], "afile is a file"),
                       ([str(tmp_path / "afile")], "afile is a file"),
                       ([str(tmp_path / "course"), "--cell-timeout", "0"], "above 0, got '0'"),
                       ([str(tmp_path / "course"), "--cell-timeout", "inf"], "above 0, got 'inf'")):
        with pytest.raises(SystemExit) as stop:
            nbgrader.main(args)
        err = capsys.readouterr().err
        assert stop.value.code == 2 and said in err and "Traceback" not in err, (args, err)
    assert not (tmp_path / "course").exists()


def _nbgrader(course: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    result = subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=course, env=env, capture_output=True, text=True)
    assert result.returncode == 0 and "ERROR" not in result.stderr, result.stderr[-3000:]
    return result


def _filled(stem: str) -> nbformat.NotebookNode:
    """The student version with every solution cell written as in solutions/ (matched by grade id)."""
    source = nbtools.nbgrader_source(nbtools.read(ROOT / "solutions" / f"{stem}.ipynb"))
    solutions = {c.metadata["nbgrader"]["grade_id"]: c.source for c in source.cells
                 if c.cell_type == "code" and c.metadata.get("nbgrader", {}).get("solution")}
    nb = nbtools.read(ROOT / "exercises" / f"{stem}.ipynb")
    for cell in nb.cells:
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
        if grade_id in solutions:
            cell.source = solutions[grade_id]
    return nb


@pytest.mark.slow
def test_nbgrader_generates_exercises_and_autogrades(tmp_path):
    pytest.importorskip("nbgrader", reason="nbgrader (a dev dependency) is not installed")
    course = tmp_path / "course"
    write_nbgrader_course(course, STEMS)
    _nbgrader(course, "generate_assignment", "*", "--force")
    for stem in STEMS:
        released = nbformat.read(course / "release" / stem / f"{stem}.ipynb", as_version=4)
        ours = nbtools.read(ROOT / "exercises" / f"{stem}.ipynb")
        assert len(released.cells) == len(ours.cells), stem
        for i, (a, b) in enumerate(zip(released.cells, ours.cells)):
            where = f"{stem} cell {i}"
            assert (a.cell_type, a.source) == (b.cell_type, b.source), where
            assert _nbgrader_meta(a) == _nbgrader_meta(b), where
            assert {k: v for k, v in a.metadata.items() if k != "nbgrader"} == \
                   {k: v for k, v in b.metadata.items() if k != "nbgrader"}, where
            assert not a.get("outputs"), where

    for student, nb in {"filled": _filled(AUTOGRADED),
                        "blank": nbtools.read(ROOT / "exercises" / f"{AUTOGRADED}.ipynb")}.items():
        (course / "submitted" / student / AUTOGRADED).mkdir(parents=True)
        nbformat.write(nb, course / "submitted" / student / AUTOGRADED / f"{AUTOGRADED}.ipynb")
    _nbgrader(course, "autograde", AUTOGRADED, "--force")
    _nbgrader(course, "export", "--to", str(course / "grades.csv"))
    with open(course / "grades.csv", newline="") as f:
        scores = {(r["student_id"], r["assignment"]): (float(r["score"]), float(r["max_score"])) for r in csv.DictReader(f)}
    total = float(sum(e.points for e in EXERCISES.values() if e.notebook == AUTOGRADED))
    assert scores[("filled", AUTOGRADED)] == (total, total), scores
    assert scores[("blank", AUTOGRADED)] == (0.0, total), scores
