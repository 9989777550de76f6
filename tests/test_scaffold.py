"""`make new-exercise` (helpers/tools/scaffold.py new) writes a new exercise's stubs in the five places
an exercise lives, and nothing else; `make check-exercise` runs that exercise's tests. The whole path
(scaffold, fill in, sync, execute, check) was walked by hand from a fresh clone (CONTRIBUTING.md)."""

from __future__ import annotations

import ast
import importlib.util
import shutil
import subprocess
import sys
from dataclasses import astuple

import pytest

from helpers import registry
from helpers.tools import notebooks as nbtools
from helpers.tools import scaffold

ROOT = nbtools.ROOT
FILES = ["helpers/registry.py", "helpers/nb03_masks.py", "helpers/checks/nb03_masks.py", "tests/test_nb03_masks.py",
         "solutions/03_masks.ipynb", "CHANGELOG.md"]


@pytest.fixture
def course(tmp_path, monkeypatch):
    """A copy of the files the scaffold edits (and the teaching notebooks it finds topics by)."""
    five = [f.replace("03_masks", "05_multihead") for f in FILES[1:-1]]
    for rel in FILES + five + [f"notebooks/{p.name}" for p in nbtools.notebook_paths("notebooks")]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / rel, tmp_path / rel)
    monkeypatch.setattr(scaffold, "ROOT", tmp_path)
    monkeypatch.setattr(nbtools, "ROOT", tmp_path)
    return tmp_path


def _registry_of(path) -> tuple:
    spec = importlib.util.spec_from_file_location("copied_registry", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["copied_registry"] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules["copied_registry"]
    return module.EXERCISES


def _functions(path) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)}


def test_new_exercise_writes_its_stubs_in_the_five_places(course):
    before = {rel: (course / rel).read_text() for rel in FILES}
    ex, written = scaffold.new_exercise("03", "windowed_mask", args="T, window", stars=2, title="a windowed mask",
                                        section="2.4 Sliding window: local attention")
    assert sorted(p.relative_to(course).as_posix() for p in written) == sorted(FILES)
    assert (ex.id, ex.notebook, ex.module_name) == ("3.7", "03_masks", "nb03_masks")

    listed = _registry_of(course / "helpers/registry.py")
    assert astuple([e for e in listed if e.notebook == "03_masks"][-1]) == astuple(ex)  # with what was asked
    assert [e.id for e in listed].index("3.7") == [e.id for e in listed].index("3.6") + 1
    assert len(listed) == len(registry.EXERCISES) + 1

    lesson = course / "helpers/nb03_masks.py"
    stub = _functions(lesson)["windowed_mask"]
    assert [a.arg for a in stub.args.args] == ["T", "window"]
    assert "TODO" in ast.get_docstring(stub) and isinstance(stub.body[-1], ast.Raise)
    assert "windowed_mask" in ast.literal_eval(next(n.value for n in ast.parse(lesson.read_text()).body
                                                    if isinstance(n, ast.Assign) and n.targets[0].id == "__all__"))

    check = _functions(course / "helpers/checks/nb03_masks.py")["windowed_mask"]
    assert ast.unparse(check.decorator_list[0]) == "exercise()" and isinstance(check.body[-1], ast.Raise)
    assert "ref.windowed_mask(T, window)" in (course / "helpers/checks/nb03_masks.py").read_text()  # the module's alias

    tests = ast.parse((course / "tests/test_nb03_masks.py").read_text())
    for table in ("WRONG", "RIGHT"):
        node = next(n for n in tests.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == table)
        assert [k.value for k in node.value.keys][-1] == "windowed_mask"

    nb = nbtools.read(course / "solutions/03_masks.ipynb")
    old = nbtools.read(ROOT / "solutions/03_masks.ipynb")
    at = max(i for i, c in enumerate(old.cells) if nbtools.MODEL_ANSWER_TAG in c.metadata.get("tags", [])) + 1
    added = nb.cells[at:at + 4]
    assert added[0].source.startswith("## Exercise 3.7 ★★ (2 points): a windowed mask")
    assert "#2.4-Sliding-window:-local-attention" in added[0].source
    assert added[1].source.startswith("def windowed_mask(T, window):") and nbtools.BEGIN_SOLUTION in added[1].source
    assert added[2].source == "checks.windowed_mask(windowed_mask)"
    assert nbtools.MODEL_ANSWER_TAG in added[3].metadata["tags"]
    assert [c.source for c in nb.cells[at + 4:]] == [c.source for c in old.cells[at:]]  # "What next", the summary
    blank = nbtools.make_exercise(nb)  # the exercises/ notebook make exercises writes from it
    assert any(c.source.startswith("def windowed_mask(T, window):") and "raise NotImplementedError()" in c.source
               for c in blank.cells)

    changelog = (course / "CHANGELOG.md").read_text().split("\n")
    assert changelog[2].endswith("(unreleased)") and changelog[4] == (
        "- New exercise 3.7 ★★ `windowed_mask(T, window)`: a windowed mask (notebook 03_masks, "
        "section 2.4 Sliding window: local attention).")
    unchanged = {rel: (course / rel).read_text() for rel in FILES}
    with pytest.raises(SystemExit, match="already has a function windowed_mask"):
        scaffold.new_exercise("03", "windowed_mask")
    assert {rel: (course / rel).read_text() for rel in FILES} == unchanged != before  # a refusal writes nothing


def test_a_lesson_function_becomes_the_reference_with_its_signature(course):
    ex, _ = scaffold.new_exercise("03_masks", "sliding_window_mask", section="2.4 Sliding window: local attention")
    text = (course / "helpers/nb03_masks.py").read_text()
    assert text.count("def sliding_window_mask(") == 1  # no stub beside the lesson's function
    assert "def sliding_window_mask(T, window):" in nbtools.read(course / "solutions/03_masks.ipynb").cells[
        [c.source for c in nbtools.read(course / "solutions/03_masks.ipynb").cells].index(
            "checks.sliding_window_mask(sliding_window_mask)") - 1].source
    assert ex.title == "sliding window mask" and ex.stars == 2


@pytest.mark.parametrize(("nb", "name", "stars", "words"), [
    ("99", "f", 2, "NB='99' is not one of the course's notebooks"),
    ("03", "Bad-Name", 2, "is not a function name"),
    ("03", "causal_mask", 2, "causal_mask is already exercise 3.1"),
    ("03", "f", 4, "STARS is 1, 2 or 3"),
])
def test_new_exercise_refuses_bad_input_with_a_clear_message(course, nb, name, stars, words):
    before = {rel: (course / rel).read_text() for rel in FILES}
    with pytest.raises(SystemExit, match=words):
        scaffold.new_exercise(nb, name, stars=stars)
    assert {rel: (course / rel).read_text() for rel in FILES} == before


def test_a_section_left_out_is_a_todo_the_registry_test_names(course):
    ex, _ = scaffold.new_exercise("05", "head_norms")
    assert ex.id == "5.4" and ex.section.startswith("TODO") and "notebooks/05_multihead.ipynb" in ex.section


def test_check_exercise_runs_the_exercise_s_files_with_its_filter():
    command = scaffold.check_command("masked_softmax", jobs=2)
    assert command[command.index("--exercise") + 1] == "3.3"
    assert {"tests/test_nb03_masks.py", "solutions/03_masks.ipynb", "tests/test_machinery.py"} <= set(command)
    assert "tests/test_nb09_triton_flash.py" in scaffold.check_command("9.4")  # the module the registry names
    with pytest.raises(SystemExit, match="EX='3.99' is not an exercise"):
        scaffold.check_command("3.99")


def test_the_exercise_filter_keeps_one_exercise_s_tests():
    import conftest

    ex = registry.lookup("prefix_lm_mask")
    keep = [
        "tests/test_nb03_masks.py::test_check_rejects_wrong[prefix_lm_mask-prefix_off_by_one]",
        "tests/test_nb03_masks.py::test_prefix_lm_mask_matches_a_loop",
        "tests/test_machinery.py::test_the_salted_cases_of_make_grade_are_new_and_right_answers_pass_them[prefix_lm_mask]",
        "solutions/03_masks.ipynb::Cell 4",
        "tests/test_machinery.py::test_the_registry_and_the_code_agree",
        "tests/test_grading.py::test_blank_exercises_grade_zero_and_solutions_full_marks",
        "tests/test_pipeline.py::test_code_lines_fit_the_editor[solutions/03_masks.ipynb]",
        "tests/test_nbgrader.py::test_exercise_cells_carry_nbgraders_metadata[03_masks]",
    ]
    drop = [
        "tests/test_nb03_masks.py::test_check_rejects_wrong[causal_mask-causal_upper]",
        "tests/test_machinery.py::test_the_salted_cases_of_make_grade_are_new_and_right_answers_pass_them[causal_mask]",
        "solutions/05_multihead.ipynb::Cell 4",
        "notebooks/03_masks.ipynb::Cell 4",
        "tests/test_nb05_multihead.py::test_prefix_lm_mask_is_mentioned_elsewhere",
        "tests/test_pipeline.py::test_code_lines_fit_the_editor[solutions/05_multihead.ipynb]",
    ]
    assert [n for n in keep if not conftest._of_exercise(n, ex)] == []
    assert [n for n in drop if conftest._of_exercise(n, ex)] == []


def _make_n(*args) -> list[str]:
    out = subprocess.run(["make", "--no-print-directory", "-n", *args, "PY=python"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    return [line for line in out.splitlines() if not line.startswith("test -n")]


def test_the_make_targets_are_wired():
    assert _make_n("new-exercise", "NB=03", "NAME=f", "ARGS=T, w", "TITLE=a f", "SECTION=2.4 X") == [
        'python -m helpers.tools.scaffold new 03 f --args "T, w"  --title "a f" --section "2.4 X"']
    assert _make_n("check-exercise", "EX=3.7") == ["JOBS=2 python -m helpers.tools.scaffold check 3.7"]
    assert _make_n("execute", "NB=03_masks") == ["python -m helpers.tools.notebooks execute 03_masks"]
    assert _make_n("execute") == ["python -m helpers.tools.notebooks execute notebooks solutions"]
    usage = subprocess.run(["make", "--no-print-directory", "check-exercise", "PY=python"], cwd=ROOT,
                           capture_output=True, text=True)
    assert usage.returncode != 0 and "usage: make check-exercise EX=3.7" in usage.stdout


def test_execute_takes_a_topic_by_its_stem_or_number():
    assert nbtools.topic_notebooks("03") == nbtools.topic_notebooks("03_masks") == [
        ROOT / "notebooks/03_masks.ipynb", ROOT / "solutions/03_masks.ipynb"]
    assert nbtools.topic_notebooks("solutions/03_masks.ipynb") == [ROOT / "solutions/03_masks.ipynb"]
    with pytest.raises(SystemExit, match="'99' is not a topic; they are: 01_qkv_shapes"):
        nbtools.topic_notebooks("99")


def test_a_notebook_that_lists_its_exercises_gets_the_new_one_s_bullet(course):
    ex, written = scaffold.new_exercise("05", "head_norms", args="o", section="6. Heads as diagnostics")
    assert course / "notebooks/05_multihead.ipynb" in written
    cells = [c.source for c in nbtools.read(course / "notebooks/05_multihead.ipynb").cells]
    listed = next(c for c in cells if "- **5.3 " in c)
    lines = listed.split("\n")
    new = lines.index("- **5.4 ★★ `head_norms(o)`**: head norms.")  # its title, to reword if need be
    assert lines[new - 1].startswith(("- **5.3 ", "  ")) and not lines[new + 1].startswith("  ")
    solutions = nbtools.dumps(nbtools.read(course / "solutions/05_multihead.ipynb"))
    assert "It builds on [05 · section 6](../notebooks/05_multihead.ipynb#6.-Heads-as-diagnostics)." in solutions


def test_no_todo_of_the_scaffold_is_left():
    """`make new-exercise` marks with TODO what only its author can write; none may be committed."""
    files = [*ROOT.glob("helpers/**/*.py"), *ROOT.glob("tests/test_nb*.py"), *ROOT.glob("notebooks/*.ipynb"),
             *ROOT.glob("solutions/*.ipynb")]
    left = [f"{p.relative_to(ROOT)}:{i}: {line.strip()[:100]}" for p in files if p.name != "scaffold.py"
            for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if "TODO" in line]
    assert not left, "write what each TODO of make new-exercise asks for:\n" + "\n".join(left)


@pytest.mark.parametrize(("before", "after"), [
    ('__all__ = ["a", "b"]\n', '__all__ = ["a", "b", "new"]\n'),
    ('__all__ = [\n    "a",\n    "b",\n]\n', '__all__ = [\n    "a",\n    "b",\n    "new",\n]\n'),
    ('__all__ = ["' + "a" * 50 + '", "' + "b" * 50 + '"]\n',
     '__all__ = [\n    "' + "a" * 50 + '",\n    "' + "b" * 50 + '", "new",\n]\n'),  # rows of 110 at most
    ("x = 1\n", "x = 1\n"),
])
def test_the_name_joins_all_in_the_module_s_own_layout(before, after):
    assert scaffold.add_to_all(before, "new") == after


def test_a_lesson_signature_is_written_as_a_learner_would():
    function = ast.parse("def f(T: int, d: int, base: float = 1e4, *, dtype: 'torch.dtype' = None) -> int: ...").body[0]
    assert scaffold._plain_signature(function) == "T, d, base=10000.0, *, dtype=None"
