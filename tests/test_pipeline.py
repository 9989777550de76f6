"""The course's machinery: exercises drift, notebook structure, README map, environment files,
the Colab bootstrap, and `make grade`."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from helpers import notebooks as nbtools
from helpers.grading import Row, format_table, grade_notebook, passed
from helpers.grading import main as grade_main

ROOT = nbtools.ROOT


def _stems(folder: str) -> set[str]:
    return {p.stem for p in nbtools.notebook_paths(folder)}


# --------------------------------------------------------------------------- single source


def test_exercises_are_generated_from_solutions():
    stale = nbtools.exercises_in_sync()
    assert not stale, f"exercises/ differ from what `make exercises` writes: {stale}. Run `make exercises`."


def test_every_solutions_notebook_has_a_teaching_notebook():
    assert _stems("solutions") <= _stems("notebooks")
    assert _stems("solutions"), "no solutions notebooks found"


def test_generated_exercise_has_no_solutions():
    for path in nbtools.notebook_paths("exercises"):
        nb = nbtools.read(path)
        text = "\n".join(c.source for c in nb.cells)
        assert "BEGIN SOLUTION" not in text and "HIDDEN TESTS" not in text and "**Model answer.**" not in text, path
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, f"{path.name} has outputs"


def test_make_exercise_transforms():
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("def f(x):\n    ### BEGIN SOLUTION\n    return x + 1\n    ### END SOLUTION"),
        nbformat.v4.new_code_cell("checks.f(f)\n### BEGIN HIDDEN TESTS\nassert f(1) == 2\n### END HIDDEN TESTS"),
        nbformat.v4.new_markdown_cell("**Model answer.** because", metadata={"tags": ["model-answer"]}),
        nbformat.v4.new_markdown_cell("instructor note", metadata={"tags": ["solution-only"]}),
    ]
    nb.cells[0].outputs = [nbformat.v4.new_output("stream", text="hi")]
    ex = nbtools.make_exercise(nb)
    assert ex.cells[0].source == "def f(x):\n    # YOUR CODE HERE\n    raise NotImplementedError()"
    assert ex.cells[0].outputs == []
    assert ex.cells[1].source == "checks.f(f)"
    assert ex.cells[2].source == nbtools.EMPTY_ANSWER
    assert len(ex.cells) == 3
    assert nb.cells[0].source.startswith("def f(x):\n    ### BEGIN"), "the solutions notebook must not be modified"
    with pytest.raises(ValueError, match="without"):
        nbtools._replace_block("### BEGIN SOLUTION\nx", nbtools.BEGIN_SOLUTION, nbtools.END_SOLUTION, "")


# --------------------------------------------------------------------------- notebook structure


@pytest.mark.parametrize("path", nbtools.notebook_paths(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_notebook_starts_with_title_bootstrap_and_setup(path):
    nb = nbtools.read(path)
    assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith(f"# {path.stem[:2]} · "), (
        "the first cell is the title '# NN · Title'"
    )
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code[0].source == nbtools.bootstrap_source(), "the Colab bootstrap cell differs: run `make sync`"
    assert "setup(" in code[1].source, "the cell after the bootstrap calls helpers.runtime.setup()"


@pytest.mark.parametrize("path", nbtools.notebook_paths("notebooks", "solutions"), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_notebook_is_normalized_and_executed(path):
    nb = nbtools.read(path)
    assert nbtools.dumps(nb) == nbtools.dumps(nbtools.normalize(nbtools.read(path))), "run `make execute`"
    counts = [c.execution_count for c in nb.cells if c.cell_type == "code"]
    assert counts == list(range(1, len(counts) + 1)), f"{path.name} was not executed top to bottom: run `make execute`"


def test_ignore_output_tags_only_on_plot_widget_or_timing_cells():
    allowed = re.compile(r"plt\.|interact|widgets|time|perf_counter|bench|display\(|fig|imshow|plot", re.I)
    for path in nbtools.notebook_paths("notebooks", "solutions"):
        for cell in nbtools.read(path).cells:
            if "nbval-ignore-output" in cell.metadata.get("tags", []):
                assert allowed.search(cell.source), f"{path.name}: nbval-ignore-output on a cell that neither plots, times nor shows a widget:\n{cell.source[:200]}"


def test_readme_lists_every_notebook_with_colab_badges():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert nbtools.readme_with_map(readme) == readme, "the README notebook map is stale: run `make sync`"
    for stem in _stems("notebooks"):
        assert nbtools.colab_url(f"notebooks/{stem}.ipynb") in readme


# --------------------------------------------------------------------------- environment


def _makefile_pip_spec() -> list[str]:
    text = (ROOT / "Makefile").read_text()
    pin = re.search(r"^TORCH_PIN := (\S+)", text, re.M).group(1)
    spec = re.search(r"^PIP_SPEC := (.+)$", text, re.M).group(1).replace("$(TORCH_PIN)", pin)
    return spec.split()


def test_environment_yml_installs_what_pip_installs():
    text = (ROOT / "environment.yml").read_text()
    pip_items = re.findall(r"^\s{6}- (.+)$", text, re.M)
    pip_spec = _makefile_pip_spec()  # e.g. ['torch==2.13.0', '-e', '.[dev]']
    assert [item.replace("-e ", "-e\0").split("\0") for item in pip_items] == [["torch==2.13.0"], ["-e", ".[dev]"]]
    assert pip_spec == ["torch==2.13.0", "-e", ".[dev]"]
    assert re.search(r"^\s+- python=3\.(1[0-9])$", text, re.M), "environment.yml pins a Python >= 3.10"


def test_readme_test_command_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in readme and re.search(r"^make test$", ci, re.M)


# --------------------------------------------------------------------------- Colab bootstrap


def test_bootstrap_does_nothing_outside_colab(monkeypatch):
    calls = []
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: calls.append(a))
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    exec(nbtools.bootstrap_source(), {})
    assert calls == []


@pytest.mark.slow
def test_bootstrap_on_colab_installs_helpers_and_keeps_torch(monkeypatch, tmp_path):
    """Simulate Colab: a fake google.colab module; the pip command the cell builds is run against
    the local checkout (dry run with a report, then a real install into a scratch folder)."""
    import types

    import torch

    calls = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: calls.append(cmd))
    monkeypatch.setitem(sys.modules, "google", types.ModuleType("google"))
    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    exec(nbtools.bootstrap_source(), {})
    assert len(calls) == 1
    cmd = calls[0]
    assert cmd[:4] == [sys.executable, "-m", "pip", "install"]
    assert f"git+{nbtools.repo_url()}" in cmd and f"torch=={torch.__version__}" in cmd
    monkeypatch.undo()

    local = [str(ROOT) if c == f"git+{nbtools.repo_url()}" else c for c in cmd]
    report = tmp_path / "report.json"
    subprocess.run([*local, "--dry-run", "--report", str(report)], check=True, capture_output=True)
    to_install = {item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]}
    assert "attention-course" in to_install
    assert not {"torch", "triton"} & to_install, f"the bootstrap would replace Colab's torch/triton: {to_install}"

    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), str(ROOT)],
                   check=True, capture_output=True)
    probe = "import helpers.checks, helpers.reference, helpers.runtime, helpers.grading; print(helpers.checks.__file__)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env={"PYTHONPATH": str(target), "PATH": ""},
                         check=True, capture_output=True, text=True).stdout
    assert str(target) in out, "the installed package, not the checkout, was imported"


# --------------------------------------------------------------------------- grading


def _graded(nb_dir: Path, stem: str, cell_timeout: int = 120):
    return {r.name: r for r in grade_notebook(nb_dir / f"{stem}.ipynb", cell_timeout)}


GRADED_STEMS = sorted(_stems("solutions"))


@pytest.mark.slow
@pytest.mark.parametrize("stem", GRADED_STEMS)
def test_blank_exercises_grade_zero_not_attempted(stem):
    rows = _graded(ROOT / "exercises", stem)
    assert rows, f"no graded exercises found in exercises/{stem}.ipynb"
    assert {r.status for r in rows.values()} == {"not attempted"}, format_table(list(rows.values()))


@pytest.mark.slow
@pytest.mark.parametrize("stem", GRADED_STEMS)
def test_solutions_grade_full_marks(stem):
    rows = _graded(ROOT / "solutions", stem)
    assert rows and all(r.status == "passed" for r in rows.values()), format_table(list(rows.values()))


def _copy_with(tmp_path: Path, stem: str, old: str, new: str) -> Path:
    """A copy of solutions/<stem>.ipynb with `old` replaced by `new` in exactly one cell."""
    nb = nbtools.read(ROOT / "solutions" / f"{stem}.ipynb")
    hits = [c for c in nb.cells if old in c.source]
    assert len(hits) == 1, f"{old!r} found in {len(hits)} cells"
    hits[0].source = hits[0].source.replace(old, new)
    path = tmp_path / f"{stem}.ipynb"
    nbformat.write(nb, path)
    return path


@pytest.mark.slow
def test_one_wrong_exercise_is_reported_alone_with_its_hint(tmp_path, capsys):
    # 1.2 merged without the transpose: only 1.2 fails, with the hint for that mistake.
    path = _copy_with(tmp_path, "01_qkv_shapes", "return o.transpose(1, 2).reshape(B, T, H * d_k)", "return o.reshape(B, T, H * d_k)")
    code = grade_main([str(path)])
    out = capsys.readouterr().out
    assert code == 1
    rows = {line.split()[1]: line for line in out.splitlines() if re.match(r"^\d+\.\d+ ", line)}
    assert "passed" in rows["qkv_projection"] and "passed" in rows["scaled_dot_product_attention"], out
    assert "failed" in rows["merge_heads"] and "transpose(1, 2) first" in rows["merge_heads"], out
    assert "score: 2/3 points" in out


@pytest.mark.slow
def test_grading_reports_timeouts_and_errors(tmp_path):
    nb = nbtools.read(ROOT / "solutions" / "01_qkv_shapes.ipynb")
    for cell in nb.cells:  # a cell that loops at top level before its def, and a syntax error
        if cell.source.startswith("def merge_heads"):
            cell.source = "while True:\n    pass\n" + cell.source
        if cell.source.startswith("def scaled_dot_product_attention"):
            cell.source = "def scaled_dot_product_attention(q, k, v)\n    return q"
    nbformat.write(nb, tmp_path / "01_qkv_shapes.ipynb")
    rows = _graded(tmp_path, "01_qkv_shapes", cell_timeout=3)
    assert rows["qkv_projection"].status == "passed"
    assert rows["merge_heads"].status == "timed out", format_table(list(rows.values()))
    assert rows["scaled_dot_product_attention"].status == "error"
    assert "NameError" in rows["scaled_dot_product_attention"].hint


def test_bonus_points_are_scored_apart_and_never_block_a_pass():
    rows = [Row("nb", "9.3", "a", 3, "passed"), Row("nb", "9.4", "b", 3, "not attempted", bonus=True)]
    table = format_table(rows)
    assert "score: 3/3 points + 0/3 bonus, 1/1 exercises passed" in table and "0/3 bonus" in table
    assert passed(rows)
    assert not passed([Row("nb", "9.3", "a", 3, "failed"), Row("nb", "9.4", "b", 3, "passed", bonus=True)])
    assert not passed([])


def test_grade_rejects_bad_targets(tmp_path, capsys):
    with pytest.raises(SystemExit, match="neither a notebook"):
        grade_main([str(tmp_path / "missing.txt")])
    with pytest.raises(SystemExit, match="no NN_topic.ipynb notebooks"):
        grade_main([str(tmp_path)])
    broken = tmp_path / "01_qkv_shapes.ipynb"
    broken.write_text("{not json")
    assert grade_main([str(broken)]) == 1
    assert "is not a readable notebook (NotJSONError" in capsys.readouterr().out


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_grade_is_wired():
    def dry_run(*args):
        return subprocess.run(["make", "--no-print-directory", "-n", "grade", "PY=python", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout

    assert dry_run().strip() == "python -m helpers.grading exercises"
    assert dry_run("NB=exercises/01_qkv_shapes.ipynb").strip() == "python -m helpers.grading exercises/01_qkv_shapes.ipynb"


@pytest.mark.slow
def test_nbval_lax_fails_blank_exercises_and_passes_filled_ones(tmp_path):
    """Students run `pytest --nbval-lax exercises/`: blank notebooks fail (not attempted), filled pass."""
    blank = tmp_path / "blank" / "01_qkv_shapes.ipynb"
    filled = tmp_path / "filled" / "01_qkv_shapes.ipynb"
    blank.parent.mkdir()
    filled.parent.mkdir()
    shutil.copy(ROOT / "exercises" / "01_qkv_shapes.ipynb", blank)
    shutil.copy(ROOT / "solutions" / "01_qkv_shapes.ipynb", filled)

    def nbval_lax(path):
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax",
                               "--nbval-current-env", str(path)], cwd=tmp_path, capture_output=True, text=True)

    result = nbval_lax(blank)
    assert result.returncode == 1 and "not attempted yet" in result.stdout, result.stdout[-2000:]
    result = nbval_lax(filled)
    assert result.returncode == 0, result.stdout[-2000:]
