"""The course's machinery: exercises drift, notebook structure, README map, environment files,
the Colab bootstrap. (`make grade`: tests/test_grading.py.)"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from helpers.tools import notebooks as nbtools

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
    assert nb.cells[1].source == nbtools.colab_links_source(path), "the Colab links cell differs: run `make sync`"
    assert "setup(" in code[1].source, "the cell after the bootstrap calls helpers.runtime.setup()"


@pytest.mark.parametrize("path", nbtools.notebook_paths("notebooks", "solutions"), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_notebook_is_normalized_and_executed(path):
    nb = nbtools.read(path)
    assert nbtools.dumps(nb) == nbtools.dumps(nbtools.normalize(nbtools.read(path))), "run `make execute`"
    counts = [c.execution_count for c in nb.cells if c.cell_type == "code"]
    assert counts == list(range(1, len(counts) + 1)), f"{path.name} was not executed top to bottom: run `make execute`"


def test_no_committed_notebook_depends_on_the_python_that_ran_it():
    """The drift test must pass on every Python the course supports (3.10-3.13; Colab runs 3.12):
    a committed notebook records no Python version, and normalising is the same on all of them."""
    for path in nbtools.notebook_paths():
        info = nbtools.read(path).metadata.get("language_info", {})
        assert "version" not in info, f"{path.name} records Python {info['version']}: run `make execute`"
    nb = nbformat.v4.new_notebook(metadata={"language_info": {"name": "python", "version": "3.12.1"}})
    assert "version" not in nbtools.normalize(nb).metadata.language_info


@pytest.mark.parametrize("path", nbtools.notebook_paths(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_code_lines_fit_the_editor(path):
    """JupyterLab and Colab clip code lines much longer than 100 characters at a usual width."""
    long = [(i, line) for i, cell in enumerate(nbtools.read(path).cells) if cell.cell_type == "code"
            for line in cell.source.splitlines() if len(line) > 100]
    assert not long, f"{path.name}: code lines over 100 characters: " + "; ".join(f"cell {i}: {line[:60]}..." for i, line in long[:5])


@pytest.mark.parametrize("path", nbtools.notebook_paths("notebooks", "solutions"), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_committed_outputs_hold_no_warnings(path):
    """`make execute` runs without pytest's environment, as a learner's kernel does: a warning it
    stored (for example "Triton was imported before the course's helpers", when a notebook imports
    a torch module that pulls in Triton before `helpers`) is something every learner would see."""
    for i, cell in enumerate(nbtools.read(path).cells):
        for out in cell.get("outputs", []):
            assert not (out.get("output_type") == "stream" and out.get("name") == "stderr"), (
                f"{path.name}, cell {i} printed to stderr:\n{out['text'][:300]}"
            )


# fig(?!ures): a figure object, not the word "figures" (which a training cell prints)
_MACHINE_OUTPUT = re.compile(r"plt\.|interact|widgets|time|perf_counter|bench|display\(|fig(?!ures)|imshow|plot|allocation_peak",
                             re.I)


def _may_ignore_output(source: str, notebook_trains: bool) -> bool:
    """Plots, timings, widgets and measurements of the machine (an allocator's peak) differ from run
    to run. So do the figures of a model the notebook trains, on a CPU with other vector
    instructions (CONTRIBUTING.md, "Outputs that hold on every machine"): such a cell may skip the
    comparison only if it says its figures are this run's and asserts its claims."""
    if _MACHINE_OUTPUT.search(source):
        return True
    return notebook_trains and "this run's" in source and re.search(r"^assert ", source, re.M) is not None


def test_ignore_output_tags_only_on_plot_widget_timing_or_training_cells():
    # the rule refuses: a plain figure; a trained model's figure without an assert, or not called
    # this run's; this run's figure in a notebook that trains nothing
    assert not _may_ignore_output('print(f"{x:.3f}")\nassert x > 0', notebook_trains=True)
    assert not _may_ignore_output('print(f"this run\'s loss: {x:.3f}")', notebook_trains=True)
    assert not _may_ignore_output('print(f"loss: {x:.3f}")\nassert x > 0', notebook_trains=True)
    assert not _may_ignore_output('print(f"this run\'s loss: {x:.3f}")\nassert x > 0', notebook_trains=False)
    for path in nbtools.notebook_paths("notebooks", "solutions"):
        cells = nbtools.read(path).cells
        # notebook 11's train(), or notebook 10's ablation_runs(), which calls it in worker processes
        trains = any(re.search(r"(?<![.\w])(train|ablation_runs?)\(", c.source) for c in cells
                     if c.cell_type == "code")
        for cell in cells:
            if "nbval-ignore-output" in cell.metadata.get("tags", []):
                assert _may_ignore_output(cell.source, trains), (
                    f"{path.name}: nbval-ignore-output on a cell that neither plots, times, shows a widget nor "
                    f"prints this run's figures of a trained model with asserts:\n{cell.source[:200]}"
                )


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


NUMBER_WORDS = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen".split()


def test_readme_topic_count_is_the_number_of_teaching_notebooks():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    said = re.search(r"The course is complete: (\w+) topics", readme)
    assert said, "the README's sentence 'The course is complete: N topics' is gone"
    assert said.group(1) == NUMBER_WORDS[len(_stems("notebooks"))], (
        f"README says {said.group(1)} topics; notebooks/ has {len(_stems('notebooks'))}")


def test_readme_counts_the_tests_of_both_commands(request):
    """The README's test counts are this suite's: a run of `make test` or `make test-all` (the
    Makefile's paths, no -k) checks its own figure against the tests it collected; other runs skip."""
    config = request.config
    args = sorted(Path(config.rootpath, a).resolve() for a in config.args)
    mark = config.getoption("markexpr") or ""
    if args != [ROOT / "notebooks", ROOT / "solutions", ROOT / "tests"] or config.getoption("keyword") or mark not in ("", "not slow"):
        pytest.skip("not a run of make test or make test-all")
    command = "make test" if mark else "make test-all"
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    said = re.search(rf"`{command}` runs ([\d,]+) tests", readme)
    assert said, f"the README no longer says how many tests `{command}` runs"
    n = len(request.session.items)
    assert int(said.group(1).replace(",", "")) == n, (f"README: `{command}` runs {said.group(1)} tests; it ran {n:,} "
                                                      "(`make sync` writes both figures)")


def test_make_sync_writes_the_test_counts():
    text = "`make test` runs 1,982 tests and `make test-all` runs 3,273 tests (both figures"
    assert nbtools.readme_with_test_counts(text, 2012, 10312) == (
        "`make test` runs 2,012 tests and `make test-all` runs 10,312 tests (both figures")


def test_the_notebooks_left_to_make_test_all_exist_and_keep_their_solutions_in_make_test():
    """conftest.SLOW_NOTEBOOKS (nbval in `make test-all` only) names teaching notebooks that exist,
    never a solutions notebook: `make test` still runs every solutions notebook under nbval."""
    from conftest import SLOW_NOTEBOOKS

    for name in SLOW_NOTEBOOKS:
        assert (ROOT / name).is_file() and name.startswith("notebooks/"), name


def test_readme_test_command_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test-all" in readme and re.search(r"^make test-all$", ci, re.M)
    assert re.search(r"`make test`", readme), "the README gives the fast suite too"


# --------------------------------------------------------------------------- Colab bootstrap


def test_bootstrap_does_nothing_outside_colab(monkeypatch):
    calls = []
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: calls.append(a))
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    exec(nbtools.bootstrap_source(), {})
    assert calls == []


def _run_bootstrap(monkeypatch, run) -> str:
    """Run the bootstrap cell as on Colab, with ``run`` standing in for subprocess.run; return the
    message it stops with."""
    import types

    monkeypatch.setattr(subprocess, "run", run)
    monkeypatch.setitem(sys.modules, "google", types.ModuleType("google"))
    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    with pytest.raises(SystemExit) as stop:
        exec(nbtools.bootstrap_source(), {})
    return str(stop.value)


def _pip_says(stderr: str):
    return lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", stderr)


def test_bootstrap_failure_quotes_the_real_cause_in_one_line(monkeypatch, tmp_path):
    """When pip fails, the cell stops with one line that quotes the cause pip (or git, under pip)
    gave, not a CalledProcessError traceback, and blames the network only when that cause is a
    network one. The first case is real: pip installing from a git repository that lacks the branch."""
    real_run = subprocess.run
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "pyproject.toml").write_text('[project]\nname = "x"\nversion = "0"\n')
    git = ["git", "-c", "user.email=a@b", "-c", "user.name=a", "-c", "init.defaultBranch=other"]
    for args in (["init", "-q"], ["add", "."], ["commit", "-qm", "x"]):
        real_run([*git, *args], cwd=repo, check=True, capture_output=True)

    def pip_from_local_repo(cmd, **kw):  # the bootstrap's own pip command, aimed at the local repository
        cmd = [f"x @ git+file://{repo}@{nbtools.BRANCH}" if c.startswith("attention-course @") else c
               for c in cmd if not c.startswith("torch==")]
        return real_run([*cmd, "--no-deps", "--no-build-isolation"], **kw)

    message = _run_bootstrap(monkeypatch, pip_from_local_repo)
    assert "\n" not in message and f"pathspec '{nbtools.BRANCH}' did not match" in message, message
    assert nbtools.repo_url() in message and "offline" not in message and ".." not in message, message
    offline = ("WARNING: Retrying ... NewConnectionError: Failed to establish a new connection: [Errno -3] "
               "Temporary failure in name resolution\nERROR: Could not find a version that satisfies the requirement\n")
    assert "offline" in _run_bootstrap(monkeypatch, _pip_says(offline))
    git_offline = "  fatal: unable to access 'https://github.com/a/b/': Could not resolve host: github.com\n"
    said = _run_bootstrap(monkeypatch, _pip_says(git_offline))
    assert "offline" in said and "Could not resolve host" in said, said
    assert "pip gave no message" in _run_bootstrap(monkeypatch, _pip_says(""))


def test_bootstrap_installs_a_ref_that_exists():
    """The bootstrap installs from the branch the README's Colab badges open (a notebook opened there
    is that branch's, and so are its helpers), never from a tag that may not exist yet; the branch
    exists in this repository (a clone of it: CI's clean clone included)."""
    source = nbtools.bootstrap_source()
    assert f'REPO, BRANCH = "{nbtools.repo_url()}", "{nbtools.BRANCH}"' in source
    assert nbtools.colab_url("notebooks/01_qkv_shapes.ipynb").split("/blob/")[1].startswith(f"{nbtools.BRANCH}/")
    refs = subprocess.run(["git", "for-each-ref", "--format=%(refname:short)", "refs/heads", "refs/remotes"],
                          cwd=ROOT, capture_output=True, text=True)
    if refs.returncode:
        pytest.skip("not a git checkout")
    names = {r.split("/", 1)[-1] for r in refs.stdout.split()}
    assert nbtools.BRANCH in names, f"the bootstrap installs from {nbtools.BRANCH!r}, which this repository lacks"
    import helpers

    assert helpers.__version__ == nbtools.course_version(), "helpers.__version__ and pyproject.toml differ"


@pytest.fixture(scope="module")
def installed_package(tmp_path_factory) -> Path:
    """The course installed as a package (`pip install --no-deps --target`), once for the tests that
    need one."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), str(ROOT)],
                   check=True, capture_output=True)
    return target


@pytest.mark.slow
def test_an_installed_package_carries_the_model_answers(installed_package):
    assert (installed_package / "helpers" / nbtools.MODEL_ANSWERS_PATH.name).read_text(encoding="utf-8") == \
        nbtools.MODEL_ANSWERS_PATH.read_text(encoding="utf-8")


@pytest.mark.slow
def test_bootstrap_on_colab_installs_helpers_and_keeps_torch(monkeypatch, tmp_path, installed_package):
    """Simulate Colab: a fake google.colab module; the pip command the cell builds is run against
    the local checkout (dry run with a report, then a real install into a scratch folder)."""
    import types

    import torch

    calls = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: calls.append(cmd) or subprocess.CompletedProcess(cmd, 0))
    monkeypatch.setitem(sys.modules, "google", types.ModuleType("google"))
    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    exec(nbtools.bootstrap_source(), {})
    assert len(calls) == 1
    cmd = calls[0]
    assert cmd[:4] == [sys.executable, "-m", "pip", "install"]
    pinned = f"attention-course @ git+{nbtools.repo_url()}@{nbtools.BRANCH}"
    assert pinned in cmd and f"torch=={torch.__version__}" in cmd, cmd
    monkeypatch.undo()

    local = [str(ROOT) if c == pinned else c for c in cmd]
    report = tmp_path / "report.json"
    subprocess.run([*local, "--dry-run", "--report", str(report)], check=True, capture_output=True)
    to_install = {item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]}
    assert "attention-course" in to_install
    assert not {"torch", "triton"} & to_install, f"the bootstrap would replace Colab's torch/triton: {to_install}"

    target = installed_package
    probe = "import helpers.checks, helpers.reference, helpers.runtime, helpers.tools.grading; print(helpers.checks.__file__)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env={"PYTHONPATH": str(target), "PATH": ""},
                         check=True, capture_output=True, text=True).stdout
    assert str(target) in out, "the installed package, not the checkout, was imported"


# --------------------------------------------------------------------------- kernel parts shown in 09


def test_every_kernel_part_notebook_09_shows_is_marked_in_the_kernel():
    """Notebook 09 prints the kernel part by part (``show_source(tf._attn_fwd, "row-mask")``), from
    ``# lesson: <part>`` comments in helpers/nb09_triton_flash.py: renaming or moving code there
    must keep them, and this test names the notebook cell that depends on a missing part."""
    tf = pytest.importorskip("helpers.nb09_triton_flash", reason="Triton is Linux-only")
    nb = nbtools.read(ROOT / "notebooks" / "09_flash_attention.ipynb")
    shown = [(i, fn, part) for i, cell in enumerate(nb.cells) if cell.cell_type == "code"
             for fn, part in re.findall(r'show_source\(tf\.(\w+), "([^"]+)"\)', cell.source)]
    assert len(shown) >= 5, shown
    for i, fn, part in shown:
        kernel = getattr(tf, fn, None)
        assert kernel is not None, f"notebooks/09_flash_attention.ipynb cell {i} shows tf.{fn}, which no longer exists"
        try:
            text = tf.lesson_part(kernel, part)
        except LookupError as e:
            pytest.fail(f"notebooks/09_flash_attention.ipynb cell {i}: {e}")
        assert text.strip(), f"cell {i}: part {part!r} of {fn} is empty"
    with pytest.raises(LookupError, match="no part 'no-such-part'.*show_source"):
        tf.lesson_part(tf._attn_fwd, "no-such-part")


# --------------------------------------------------------------------------- the package's layers


def _imports() -> dict[str, set[str]]:
    """helpers module -> the helpers modules it imports (at top level or inside functions)."""
    import ast

    graph: dict[str, set[str]] = {}
    for path in sorted((ROOT / "helpers").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        package = name if parts[-1] == "__init__" else name.rsplit(".", 1)[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                found |= {base} | {f"{base}.{a.name}" for a in node.names}
        graph[name] = {m for m in found if m.startswith("helpers") and m != name}
    modules = set(graph)
    resolved = {k: {m if m in modules else m.rsplit(".", 1)[0] for m in v} & modules - {k} for k, v in graph.items()}
    # `from . import guard` inside helpers.checks names the package too; a package's own
    # submodules importing it (or each other through it) is how packages work, not a cycle.
    return {k: {m for m in v if not k.startswith(m + ".")} for k, v in resolved.items()}


def _layer(name: str) -> int:
    """0: runtime; 1: what the notebooks teach; 2: the checks; 3: the tools."""
    if name in ("helpers", "helpers.runtime"):
        return 0
    if name.startswith("helpers.tools"):
        return 3
    if name.startswith("helpers.checks"):
        return 2
    return 1


def test_no_import_runs_back_up_a_layer_and_there_is_no_cycle():
    """Lessons never import the checks or the tools, the checks never import the tools, and no
    module imports itself through others (the package has no cycle, counting imports inside
    functions)."""
    graph = _imports()
    up = [(a, b) for a, deps in graph.items() for b in deps if _layer(b) > _layer(a) and b != "helpers"]
    assert not up, f"imports running back up a layer: {up}"
    seen: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        seen[node] = 1
        for dep in sorted(graph.get(node, ())):
            if dep == "helpers":
                continue
            assert seen.get(dep) != 1, f"import cycle: {' -> '.join(path + [dep])}"
            if dep not in seen:
                visit(dep, path + [dep])
        seen[node] = 2

    for module in sorted(graph):
        if module not in seen:
            visit(module, [module])



def test_module_names_of_release_0_1_still_work():
    """A learner's notebook or an instructor's script written for 0.1 keeps working (CHANGELOG.md):
    the old module names import the new modules, and `python -m helpers.grading` still runs."""
    import importlib

    from helpers.runtime import MOVED

    for old, new in MOVED.items():
        assert importlib.import_module(old) is importlib.import_module(new), old
        assert importlib.import_module(new).__spec__.name == new, new
    from helpers.attention import causal_mask, masked_softmax, scaled_scores  # noqa: F401  (0.1's home of all three)

    out = subprocess.run([sys.executable, "-m", "helpers.grading", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and "usage:" in out.stdout, out.stderr[-2000:]


@pytest.mark.slow
def test_make_lab_starts_jupyterlab_without_the_news_pop_up(tmp_path):
    """`make lab`'s own command (read with `make -n`), started on a free port: JupyterLab's page
    config says news are disabled, so no pop-up covers the first notebook."""
    import os
    import socket
    import time
    import urllib.request

    printed = subprocess.run(["make", "--no-print-directory", "-n", "lab", f"PY={sys.executable}"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout  # also when run from make itself
    command = next(line for line in printed.splitlines() if " -m jupyter lab " in line)
    assert "--LabApp.news_url=None" in command, command
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(tmp_path), JUPYTERLAB_WORKSPACES_DIR=str(tmp_path))
    lab = subprocess.Popen(command.split() + ["--no-browser", f"--ServerApp.port={port}",
                                              "--IdentityProvider.token=t", "--ServerApp.ip=127.0.0.1"],
                           cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        page = ""
        for _ in range(120):
            try:
                page = urllib.request.urlopen(f"http://127.0.0.1:{port}/lab?token=t", timeout=5).read().decode()
                break
            except OSError:
                time.sleep(0.5)
        assert '"news": {"disabled": true}' in page, page[:500]
    finally:
        lab.kill()
        lab.wait()


def test_counts_and_ranges_in_the_prose_agree_with_the_registry():
    """"Six graded exercises" and "3.1-3.6" in a notebook's prose are written by `make sync` from
    helpers/registry.py; a notebook that says otherwise names the cell and the words to change."""
    stale = []
    for path in nbtools.notebook_paths("notebooks", "solutions"):
        for i, cell in enumerate(nbtools.read(path).cells):
            if cell.cell_type == "markdown" and (fixed := nbtools.prose_with_counts(cell.source, path.stem)) != cell.source:
                old = [w for w in cell.source.split("\n") if w not in fixed.split("\n")]
                stale.append(f"{path.relative_to(ROOT)} cell {i}: {old} (`make sync` rewrites it)")
    assert not stale, "\n".join(stale)


def test_make_sync_counts_the_notebooks_own_exercises(monkeypatch):
    from helpers import registry

    added = registry.Exercise("3.7", "sliding_window_mask", "a sliding-window mask", 2, "03_masks", "x")
    bonus = registry.Exercise("3.8", "bonus_mask", "a bonus", 3, "03_masks", "x", bonus=True)
    monkeypatch.setattr(registry, "EXERCISES", (*registry.EXERCISES, added, bonus))
    text = "Six graded exercises. The checks of exercises 3.1-3.6 and of 1.1–1.3 (six graded exercises)."
    assert nbtools.prose_with_counts(text, "03_masks") == (
        "Seven graded exercises. The checks of exercises 3.1-3.8 and of 1.1–1.3 (seven graded exercises).")
    assert nbtools.prose_with_counts("Three graded exercises: 1.1-1.3", "01_qkv_shapes") == "Three graded exercises: 1.1-1.3"
    assert nbtools.prose_with_counts("Six graded exercises", "13_unknown") == "Six graded exercises"
    monkeypatch.setattr(registry, "EXERCISES", (registry.Exercise("3.1", "causal_mask", "t", 1, "03_masks"),))
    assert nbtools.prose_with_counts("two graded exercises", "03_masks") == "one graded exercise"


def test_a_notebook_that_lists_its_exercises_lists_them_all():
    """Notebooks 02, 05, 06, 10 and 11 list each exercise as a bullet in their "Exercises" section
    (`make new-exercise` adds the new one's); a list that misses one says which."""
    from helpers import registry

    missing = []
    for path in nbtools.notebook_paths("notebooks"):
        mine = [e.id for e in registry.by_notebook().get(path.stem, [])]
        for i, cell in enumerate(nbtools.read(path).cells):
            listed = re.findall(rf"(?m)^- \*\*({int(path.stem[:2])}\.\d+) ", cell.source) if cell.cell_type == "markdown" else []
            if listed and listed != mine:
                missing.append(f"notebooks/{path.name} cell {i} lists {listed}; the registry has {mine}")
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize(("said", "counts"), [("2009/3301 tests collected (1292 deselected) in 5s", (2009, 3301)),
                                              ("12 tests collected in 0.1s", (12, 12))])
def test_make_sync_reads_both_test_counts_from_one_collection(monkeypatch, said, counts):
    listing = "tests/test_x.py::test_y[5/6 tests collected]\n\n" + said + "\n"  # an id may look like the summary
    monkeypatch.setattr(nbtools.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, listing, ""))
    assert nbtools.collected_tests() == counts
