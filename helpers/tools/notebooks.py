"""Maintainer tools for the course's notebooks (``python -m helpers.tools.notebooks COMMAND``).

- ``execute DIR_OR_NB_OR_TOPIC ...``: run notebooks top to bottom in fresh kernels and store their
  outputs (``make execute``; ``make execute NB=03_masks``: a topic's teaching notebook and its
  solutions), so committed outputs are always what the code prints. The bootstrap cell is
  put in place first, and exercises/ regenerated when solutions/ were run.
- ``exercises``: write ``exercises/`` from ``solutions/`` (``make exercises``): solution bodies become
  ``raise NotImplementedError()``, model answers an empty answer cell, hidden tests and
  solution-only cells are removed, outputs are cleared. The model answers go to
  ``helpers/model_answers.json`` (package data), which a passing check shows.
- ``sync``: rewrite what is derived: the Colab bootstrap cell of every notebook, the Colab links cell
  after its title, and the README's notebook map from the repository URL in ``pyproject.toml`` (the
  one place it is configured); from ``helpers/registry.py`` the README's exercise table and the counts
  and ranges of exercises in the notebooks' prose; the new mistake ids; the README's test counts.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import nbformat

from helpers import registry

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK_DIRS = ("notebooks", "solutions", "exercises")

BEGIN_SOLUTION, END_SOLUTION = "### BEGIN SOLUTION", "### END SOLUTION"
BEGIN_HIDDEN, END_HIDDEN = "### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS"
MODEL_ANSWER_TAG = "model-answer"  # markdown cell: emptied in exercises/
SOLUTION_ONLY_TAG = "solution-only"  # any cell: dropped from exercises/
BOOTSTRAP_TAG = "colab-bootstrap"
EMPTY_ANSWER = "**Your answer:** _double-click this cell and write it here._"

# The branch the Colab badges open (README) and the bootstrap installs from: a notebook opened from
# a badge is that branch's, so its helpers are too, and the branch always exists (a tag may not yet).
BRANCH = "main"

BOOTSTRAP_TEMPLATE = '''\
# Colab bootstrap (identical in every notebook): on Colab, install the course's helpers package
# from the branch this notebook was opened from, keeping Colab's torch; elsewhere it does nothing.
import sys

if "google.colab" in sys.modules:
    import subprocess

    import torch

    REPO, BRANCH = "{repo}", "{branch}"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet",
                          f"attention-course @ git+{{REPO}}@{{BRANCH}}", f"torch=={{torch.__version__}}"],
                         capture_output=True, text=True)
    if pip.returncode:  # quote pip's (or git's) own error; blame the network only when it does
        lines = [x.strip() for x in pip.stderr.splitlines() if x.strip()] or ["pip gave no message"]
        causes = [x for x in lines if x.startswith(("fatal:", "error:", "ERROR:"))
                  and "subprocess-exited-with-error" not in x]
        said = " | ".join(causes[-2:] or lines[-1:]).rstrip(".")
        network = ("resolve host", "name resolution", "Network is unreachable", "new connection")
        offline = any(w in pip.stderr for w in network)
        then = ("This runtime looks offline: connect it and run this cell again." if offline else
                "Run this cell again; if it fails the same way, open the notebook from the README.")
        source = f"{{REPO}}@{{BRANCH}}"
        raise SystemExit(f"pip could not install the helpers from {{source}}: {{said}}. {{then}}")'''


def _project() -> dict:
    """The ``[project]`` table of ``pyproject.toml``."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


def repo_url() -> str:
    """The repository URL from ``pyproject.toml`` ([project.urls] Repository)."""
    return _project()["urls"]["Repository"]


def course_version() -> str:
    """The course's version from ``pyproject.toml`` (``helpers.__version__`` says the same)."""
    return _project()["version"]


def bootstrap_source(repo: str | None = None, branch: str = BRANCH) -> str:
    """The source of the Colab bootstrap cell."""
    return BOOTSTRAP_TEMPLATE.format(repo=repo or repo_url(), branch=branch)


def colab_url(path: str | Path, repo: str | None = None, branch: str = BRANCH) -> str:
    """The "Open in Colab" address of a notebook given its path relative to the repository root."""
    slug = re.sub(r"^https://github.com/", "", (repo or repo_url()).rstrip("/"))
    return f"https://colab.research.google.com/github/{slug}/blob/{branch}/{Path(path).as_posix()}"


def notebook_paths(*dirs: str) -> list[Path]:
    """Sorted ``NN_topic.ipynb`` paths in the given folders (default: all three)."""
    return sorted(p for d in (dirs or NOTEBOOK_DIRS) for p in (ROOT / d).glob("[0-9][0-9]_*.ipynb"))


def read(path: Path) -> nbformat.NotebookNode:
    return nbformat.read(path, as_version=4)


def write(nb: nbformat.NotebookNode, path: Path) -> None:
    """Write deterministically (nbformat's JSON layout, trailing newline)."""
    path.write_text(dumps(nb), encoding="utf-8")


def dumps(nb: nbformat.NotebookNode) -> str:
    return nbformat.writes(nb) + "\n"


def _coalesce_streams(outputs: list) -> list:
    """Merge consecutive stdout (or stderr) chunks: how a kernel splits printed text varies from
    run to run, and the stored notebook should not."""
    merged: list = []
    for out in outputs:
        if merged and out.get("output_type") == "stream" and merged[-1].get("output_type") == "stream" \
                and merged[-1].get("name") == out.get("name"):
            merged[-1]["text"] += out["text"]
        else:
            merged.append(out)
    return merged


# What JupyterLab writes into a notebook when its kernel starts (the kernelspec of ipykernel's
# python3, and the kernel's language_info) less the Python version: nothing in a committed notebook
# depends on the Python that last ran it (the drift test passes on 3.10-3.13 alike).
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
LANGUAGE_INFO = {"codemirror_mode": {"name": "ipython", "version": 3}, "file_extension": ".py",
                 "mimetype": "text/x-python", "name": "python", "nbconvert_exporter": "python",
                 "pygments_lexer": "ipython3"}


def normalize(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Keep only what the course uses: cell tags (no execution timestamps or editor metadata),
    the kernel's metadata as the kernel itself writes it, no trailing blank lines in cells, printed
    text in one piece."""
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = _coalesce_streams(cell.outputs)
        tags = cell.metadata.get("tags")
        cell.metadata = nbformat.NotebookNode({"tags": tags} if tags else {})
        cell.source = cell.source.rstrip("\n")
    widgets = nb.metadata.get("widgets")
    nb.metadata = nbformat.from_dict({"kernelspec": KERNELSPEC, "language_info": LANGUAGE_INFO})
    if widgets:
        nb.metadata["widgets"] = widgets
    return nb


def title(nb: nbformat.NotebookNode) -> str:
    """The first markdown heading of a notebook, without the leading '#'."""
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            m = re.search(r"^#\s+(.+)$", cell.source, re.M)
            if m:
                return m.group(1).strip()
    return ""


# --------------------------------------------------------------------------- exercises from solutions


def _replace_block(source: str, begin: str, end: str, replacement: str | None) -> str:
    """Replace every ``begin ... end`` block (marker lines included) by ``replacement`` lines
    indented like the ``begin`` line; ``None`` removes the block."""
    out: list[str] = []
    inside = False
    for line in source.split("\n"):
        stripped = line.strip()
        if stripped == begin:
            if inside:
                raise ValueError(f"nested {begin!r}")
            inside = True
            if replacement is not None:
                indent = line[: len(line) - len(line.lstrip())]
                out.extend(indent + r for r in replacement.split("\n"))
        elif stripped == end:
            if not inside:
                raise ValueError(f"{end!r} without {begin!r}")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{begin!r} without {end!r}")
    return "\n".join(out)


EXERCISE_HEADING = re.compile(r"^##\s+Exercise\s+(\d+)\.(\d+)\b.*?\((?:bonus,\s*)?(\d+)\s+points?\)", re.M)
CHECK_CALL = re.compile(r"^checks\.(?!summary\()(\w+)\(", re.M)  # a check call (not the summary)


def nbgrader_cells(nb: nbformat.NotebookNode) -> dict[int, dict]:
    """nbgrader's metadata (schema 3) for the exercise cells of a solutions notebook, by cell index.

    Under each ``## Exercise N.M ... (P points)`` heading: the code cells with a solution block are
    solution cells (grade id: the checked function's name), the ``checks.<name>(...)`` cell is an
    autograded test cell worth P points (``check_<name>``), and the ``model-answer`` cell is a
    manually graded answer worth 0 points (``answer_<name>``): the course's points are the checks'.
    """
    sections: list[tuple[int, list[int]]] = []  # (points, cell indices) per exercise section
    for i, cell in enumerate(nb.cells):
        heading = EXERCISE_HEADING.search(cell.source) if cell.cell_type == "markdown" else None
        if heading:
            sections.append((int(heading.group(3)), []))
        elif cell.cell_type == "markdown" and cell.source.startswith("## "):
            sections.append((0, []))  # another section ("## Where you stand"): no exercise's cells
        elif sections:
            sections[-1][1].append(i)
    meta: dict[int, dict] = {}
    for points, indices in sections:
        calls = [m.group(1) for i in indices if nb.cells[i].cell_type == "code"
                 for m in CHECK_CALL.finditer(nb.cells[i].source)]
        if not calls:
            continue
        name, n_solution = calls[0], 0
        for i in indices:
            cell = nb.cells[i]
            tags = cell.get("metadata", {}).get("tags", [])
            if cell.cell_type == "code" and any(line.strip() == BEGIN_SOLUTION for line in cell.source.split("\n")):
                n_solution += 1
                part = f"_part{n_solution}" if n_solution > 1 else ""
                grade_id, grade, solution, cell_points = name + part, False, True, None
            elif cell.cell_type == "code" and CHECK_CALL.search(cell.source):
                grade_id, grade, solution, cell_points = f"check_{name}", True, False, points
            elif cell.cell_type == "markdown" and MODEL_ANSWER_TAG in tags:
                grade_id, grade, solution, cell_points = f"answer_{name}", True, True, 0
            else:
                continue
            m = {"grade": grade, "grade_id": grade_id, "locked": grade and not solution, "schema_version": 3,
                 "solution": solution, "task": False}
            if cell_points is not None:
                m["points"] = cell_points
            meta[i] = m
    return meta


def nbgrader_source(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """A copy of a solutions notebook with nbgrader's cell metadata: the ``source/`` version that
    ``nbgrader generate_assignment`` turns into the student version (``exercises/`` is that version)."""
    src = nbformat.from_dict(nb)  # deep copy
    for i, m in nbgrader_cells(nb).items():
        src.cells[i].metadata["nbgrader"] = m
    return src


def make_exercise(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """The exercise notebook generated from a solutions notebook (the input is not modified).

    Exercise cells carry nbgrader's metadata, locked as ``nbgrader generate_assignment`` locks them
    (a check cell cannot be edited or deleted in Jupyter; a solution or answer cell cannot be deleted)."""
    ex = nbgrader_source(nb)
    cells = []
    for cell in ex.cells:
        tags = cell.get("metadata", {}).get("tags", [])
        if SOLUTION_ONLY_TAG in tags:
            continue
        grader = cell.metadata.get("nbgrader")
        if grader:
            cell.metadata["deletable"] = False
            if grader["grade"] and not grader["solution"]:
                cell.metadata["editable"] = False
        if cell.cell_type == "code":
            src = _replace_block(cell.source, BEGIN_SOLUTION, END_SOLUTION, "# YOUR CODE HERE\nraise NotImplementedError()")
            cell.source = _replace_block(src, BEGIN_HIDDEN, END_HIDDEN, None).rstrip("\n")
            cell.outputs = []
            cell.execution_count = None
            cell.metadata.pop("execution", None)
        elif cell.cell_type == "markdown" and MODEL_ANSWER_TAG in tags:
            cell.source = EMPTY_ANSWER
        cells.append(cell)
    ex.cells = cells
    ex.metadata.pop("widgets", None)
    return ex


def exercises_in_sync() -> list[str]:
    """Names of exercise notebooks that differ from what ``make exercises`` would write."""
    stale = []
    solutions = {p.name: p for p in notebook_paths("solutions")}
    committed = {p.name: p for p in notebook_paths("exercises")}
    for name in sorted(solutions.keys() | committed.keys()):
        if name not in solutions or name not in committed:
            stale.append(name)
        elif dumps(make_exercise(read(solutions[name]))) != committed[name].read_text(encoding="utf-8"):
            stale.append(name)
    return stale


MODEL_ANSWERS_PATH = ROOT / "helpers" / "model_answers.json"
_WHY_IT_MATTERS = re.compile(r"\*\*Why it matters[^*]*\*\*:?\s*(.+?)(?:\n\s*\n|\Z)", re.S)


def as_sentence(text: str) -> str:
    """A "Why it matters" question as a sentence of its own: its first letter capitalised.
    Statements write it as the continuation of "**Why it matters for LLMs:**", in lower case. A
    question that opens with a code span or mathematics (`` `x.view` ``, ``$T$``) keeps it as it
    is: capitalising code would change it."""
    return text[:1].upper() + text[1:] if text[:1].islower() else text


def model_answers() -> dict[str, dict[str, str]]:
    """``name -> {exercise, notebook, question, answer}`` for every markdown cell tagged
    ``model-answer`` in ``solutions/``: the exercise is the last ``## Exercise N.M`` heading above
    it, the name that of the last ``checks.<name>(...)`` call, the question the statement's "Why it
    matters" paragraph."""
    answers: dict[str, dict[str, str]] = {}
    for path in notebook_paths("solutions"):
        ex_id = question = name = ""
        for cell in read(path).cells:
            source = cell.source
            if cell.cell_type == "code":
                calls = CHECK_CALL.findall(source)
                name = calls[-1] if calls else name
                continue
            heading = EXERCISE_HEADING.search(source)
            if heading:
                ex_id, name = f"{heading.group(1)}.{heading.group(2)}", ""
                why = _WHY_IT_MATTERS.search(source)
                question = as_sentence(" ".join(why.group(1).split())) if why else ""
            if MODEL_ANSWER_TAG in cell.get("metadata", {}).get("tags", []) and name:
                answers[name] = {"exercise": ex_id, "notebook": path.stem, "question": question,
                                 "answer": source.strip()}
    return answers


def model_answers_json() -> str:
    return json.dumps(model_answers(), indent=1, ensure_ascii=False, sort_keys=True) + "\n"


def model_answers_in_sync() -> bool:
    """Is ``helpers/model_answers.json`` what ``make exercises`` would write?"""
    return MODEL_ANSWERS_PATH.exists() and MODEL_ANSWERS_PATH.read_text(encoding="utf-8") == model_answers_json()


def write_model_answers() -> None:
    text = model_answers_json()
    if not MODEL_ANSWERS_PATH.exists() or MODEL_ANSWERS_PATH.read_text(encoding="utf-8") != text:
        MODEL_ANSWERS_PATH.write_text(text, encoding="utf-8")
        print(f"{MODEL_ANSWERS_PATH.relative_to(ROOT)} <- model answers of solutions/")


def write_exercises() -> None:
    (ROOT / "exercises").mkdir(exist_ok=True)
    solutions = notebook_paths("solutions")
    for old in notebook_paths("exercises"):
        if not (ROOT / "solutions" / old.name).exists():
            old.unlink()
    for path in solutions:
        write(make_exercise(read(path)), ROOT / "exercises" / path.name)
        print(f"exercises/{path.name} <- solutions/{path.name}")
    write_model_answers()


# --------------------------------------------------------------------------- sync: counts and mistake ids

NUMBER_WORDS = ("no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
                "twelve")
_COUNT = re.compile(r"\b(" + "|".join(NUMBER_WORDS) + r")( graded exercises?)\b", re.IGNORECASE)


def prose_with_counts(text: str, stem: str) -> str:
    """``text`` (a markdown cell of notebook ``stem``) with its counts and ranges of the notebook's
    own exercises made to agree with the registry: "three graded exercises" counts those that are
    not a bonus, and a range from the first, "3.1-3.6", ends at the last one (bonus included)."""
    exercises = registry.by_notebook().get(stem, [])
    if not exercises:
        return text
    graded = sum(not e.bonus for e in exercises)

    def count(m: re.Match) -> str:
        word = NUMBER_WORDS[graded] if graded < len(NUMBER_WORDS) else str(graded)
        word = word.capitalize() if m.group(1)[0].isupper() else word
        return word + (" graded exercise" if graded == 1 else " graded exercises")

    text = _COUNT.sub(count, text)
    n, last = int(stem[:2]), exercises[-1].id
    return re.sub(rf"\b{n}\.1([-–]){n}\.\d+\b", lambda m: f"{n}.1{m.group(1)}{last}", text)


def set_prose_counts(nb: nbformat.NotebookNode, stem: str) -> list[int]:
    """Rewrite the counts and ranges of ``nb``'s markdown cells; return the indices of the cells changed."""
    changed = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown" and (fixed := prose_with_counts(cell.source, stem)) != cell.source:
            cell.source = fixed
            changed.append(i)
    return changed


MISTAKE_IDS = ROOT / "helpers" / "checks" / "mistake_ids.txt"


def mistake_calls():
    """``(path, node)`` for every ``Mistake(...)`` call with arguments in helpers/checks/, and for the
    ``CALL_MISTAKES = {...}`` assignment (the call guard's slugs, sent by name)."""
    import ast

    for path in sorted((ROOT / "helpers" / "checks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if ((isinstance(node, ast.Call) and node.args
                 and getattr(node.func, "id", getattr(node.func, "attr", "")) == "Mistake")
                    or (isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "CALL_MISTAKES")):
                yield path, node


def mistake_slugs_in_code() -> set[str]:
    """Every ``"<check module>: <slug>"`` the checks can record: the literal first argument of each
    ``Mistake(...)`` in helpers/checks/, and the call guard's (``CALL_MISTAKES``)."""
    found = set()
    for path, node in mistake_calls():
        values = [k.value for k in node.value.keys] if hasattr(node, "targets") else [getattr(node.args[0], "value", None)]
        found |= {f"{path.stem}: {v}" for v in values if isinstance(v, str)}
    return found


def read_mistake_ids() -> tuple[list[str], set[str], set[str]]:
    """(the header lines, the current ids, the retired ids) of helpers/checks/mistake_ids.txt."""
    lines = MISTAKE_IDS.read_text(encoding="utf-8").splitlines()
    cut = lines.index("retired:")
    header = [ln for ln in lines[:cut] if ln.startswith("#")]
    current = {ln.split("#")[0].strip() for ln in lines[len(header):cut]} - {""}
    return header, current, {ln.strip() for ln in lines[cut + 1:] if ln.strip()}


def sync_mistake_ids() -> list[str]:
    """Add the slugs the checks can now record to mistake_ids.txt (grouped by module, sorted);
    return them. Slugs gone from the code stay: removing one is a decision (move it under
    "retired:", tests/test_class_report.py says so)."""
    header, current, retired = read_mistake_ids()
    new = sorted(mistake_slugs_in_code() - current - retired)
    if new:
        blocks: dict[str, list[str]] = {}
        for slug in sorted(current | set(new)):
            blocks.setdefault(slug.split(":")[0], []).append(slug)
        body = "\n\n".join("\n".join(b) for b in blocks.values())
        MISTAKE_IDS.write_text("\n".join([*header, "", body, "", "retired:", *sorted(retired)]) + "\n", encoding="utf-8")
    return new


def collected_tests() -> tuple[int, int]:
    """(tests `make test` runs, tests `make test-all` runs), from one collection of the Makefile's paths."""
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "not slow",
                          "--nbval", "--nbval-current-env", "--nbval-sanitize-with", "tests/nbval_sanitize.cfg",
                          "tests", "notebooks", "solutions"], cwd=ROOT, capture_output=True, text=True)
    summary = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""  # after the tests' ids
    found = re.search(r"(\d+)/(\d+) tests? collected", summary)  # "N tests collected" when none is slow
    every = found or re.search(r"(\d+) tests? collected", summary)
    if not every:
        raise SystemExit(f"sync: could not count the tests (pytest --collect-only said: {out.stdout[-500:]}{out.stderr[-500:]})")
    return (int(found.group(1)), int(found.group(2))) if found else (int(every.group(1)),) * 2


def readme_with_test_counts(text: str, fast: int, every: int) -> str:
    """The README with the figures of "`make test` runs N tests and `make test-all` runs M tests"."""
    text = re.sub(r"(`make test` runs )[\d,]+( tests)", rf"\g<1>{fast:,}\2", text)
    return re.sub(r"(`make test-all` runs )[\d,]+( tests)", rf"\g<1>{every:,}\2", text)


# --------------------------------------------------------------------------- sync: bootstrap + README


def set_bootstrap(nb: nbformat.NotebookNode, source: str) -> None:
    """Make the first code cell the bootstrap cell (inserting one if it is missing)."""
    first_code = next((c for c in nb.cells if c.cell_type == "code"), None)
    if first_code is not None and BOOTSTRAP_TAG in first_code.metadata.get("tags", []):
        first_code.source = source
        return
    index = nb.cells.index(first_code) if first_code is not None else len(nb.cells)
    nb.cells.insert(index, nbformat.v4.new_code_cell(source, metadata={"tags": [BOOTSTRAP_TAG]}))


COLAB_LINKS_TAG = "colab-links"
COLAB_BADGE = "https://colab.research.google.com/assets/colab-badge.svg"


def colab_links_source(path: Path, repo: str | None = None) -> str:
    """The markdown cell after a notebook's title: on Colab the links between the course's
    notebooks (``../notebooks/...``, ``../exercises/...``) do not open, so it gives their "Open in
    Colab" links (for the exercises: the teaching notebook; for a teaching notebook: its exercises),
    the next topic's, and the README's notebook map."""
    teaching = [p.name for p in notebook_paths("notebooks")]
    here = ("notebooks" if path.parent.name == "notebooks" else "exercises", path.name)
    other = ("exercises", path.name) if here[0] == "notebooks" else ("notebooks", path.name)
    links = []
    if (ROOT / "solutions" / path.name).exists() and path.name in teaching:
        label = "its exercises" if here[0] == "notebooks" else f"notebook {path.stem[:2]}, which they build on"
        links.append(f"[{label}]({colab_url(f'{other[0]}/{other[1]}', repo)})")
    later = teaching[teaching.index(path.name) + 1:] if path.name in teaching else []
    if later:
        links.append(f"[next: notebook {later[0][:2]}]({colab_url(f'notebooks/{later[0]}', repo)})")
    links.append(f"[every notebook]({(repo or repo_url()).rstrip('/')}#notebooks)")
    return (f"[![Open In Colab]({COLAB_BADGE})]({colab_url(f'{here[0]}/{here[1]}', repo)}) "
            "On Colab, the links between the course's notebooks (`../notebooks/`, `../exercises/`) do not "
            "open (they do in JupyterLab and on GitHub); these do: " + " · ".join(links) + ".")


def set_colab_links(nb: nbformat.NotebookNode, source: str) -> None:
    """Make the cell after the title the Colab links cell (inserting one if it is missing)."""
    second = nb.cells[1] if len(nb.cells) > 1 else None
    if second is not None and COLAB_LINKS_TAG in second.metadata.get("tags", []):
        second.source = source
        return
    nb.cells.insert(1, nbformat.v4.new_markdown_cell(source, metadata={"tags": [COLAB_LINKS_TAG]}))


def readme_map(repo: str | None = None) -> str:
    """The README's notebook table: one row per topic, with Colab badges."""
    badge = COLAB_BADGE
    rows = ["| # | topic | teaching notebook | exercises |", "|---|---|---|---|"]
    for path in notebook_paths("notebooks"):
        stem = path.stem
        ex = ROOT / "exercises" / path.name
        nb_cell = f"[{stem}](notebooks/{path.name}) [![Open In Colab]({badge})]({colab_url(f'notebooks/{path.name}', repo)})"
        ex_cell = (
            f"[exercises](exercises/{path.name}) [![Open In Colab]({badge})]({colab_url(f'exercises/{path.name}', repo)})"
            if ex.exists() else "(none)"
        )
        topic = re.sub(r"^\d+\s*·\s*", "", title(read(path)))
        rows.append(f"| {stem[:2]} | {topic} | {nb_cell} | {ex_cell} |")
    return "\n".join(rows)


def readme_exercises() -> str:
    """The README's exercise table, from ``helpers/registry.py``."""
    exercises = sorted(registry.EXERCISES, key=lambda e: e.order)
    graded = [e for e in exercises if not e.bonus]
    rows = [f"{len(graded)} graded exercises worth {sum(e.points for e in graded)} points, and "
            f"{len(exercises) - len(graded)} bonus; ★ marks difficulty, one point per star.", "",
            "| # | exercise | your function | ★ | the teaching section it builds on |",
            "|---|---|---|---|---|"]
    for e in exercises:
        bonus = " (bonus)" if e.bonus else ""
        rows.append(f"| {e.id} | {e.title}{bonus} | `{e.name}` | {'★' * e.stars} | "
                    f"[{e.notebook}](notebooks/{e.notebook}.ipynb) § {e.section or ''} |")
    return "\n".join(rows)


MAP_START, MAP_END = "<!-- notebook-map:start -->", "<!-- notebook-map:end -->"
EXERCISES_START, EXERCISES_END = "<!-- exercise-map:start -->", "<!-- exercise-map:end -->"


def _between(text: str, start: str, end: str, body: str) -> str:
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{body}\n{end}{tail}"


def readme_with_map(text: str, repo: str | None = None) -> str:
    """The README with its notebook table and its exercise table made anew."""
    text = _between(text, MAP_START, MAP_END, readme_map(repo))
    return _between(text, EXERCISES_START, EXERCISES_END, readme_exercises())


def sync() -> None:
    source = bootstrap_source()
    for path in notebook_paths("notebooks", "solutions"):
        nb = read(path)
        before = dumps(nb)
        set_bootstrap(normalize(nb), source)
        set_colab_links(nb, colab_links_source(path))
        counted = set_prose_counts(nb, path.stem)
        if dumps(nb) != before:
            write(nb, path)
            print(f"bootstrap, Colab links and exercise counts updated: {path.relative_to(ROOT)}"
                  + (f" (counts in cells {counted})" if counted else ""))
    write_exercises()
    readme = ROOT / "README.md"
    for slug in sync_mistake_ids():
        print(f"mistake id added to helpers/checks/mistake_ids.txt: {slug}")
    fast, every = collected_tests()
    readme.write_text(readme_with_test_counts(readme_with_map(readme.read_text(encoding="utf-8")), fast, every),
                      encoding="utf-8")
    print(f"README notebook and exercise tables updated; make test runs {fast:,} tests, make test-all {every:,}")


# --------------------------------------------------------------------------- execute


def execute(path: Path, timeout: int = 600) -> float:
    """Run one notebook top to bottom in a fresh kernel (cwd = its folder) and store the outputs;
    return the seconds it took."""
    from nbclient import NotebookClient

    nb = normalize(read(path))
    set_bootstrap(nb, bootstrap_source())
    set_colab_links(nb, colab_links_source(path))
    start = time.perf_counter()
    NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute(
        stderr=subprocess.DEVNULL  # the kernel's own start-up log lines are noise here
    )
    seconds = time.perf_counter() - start
    write(normalize(nb), path)
    return seconds


def topic(arg: str) -> str | None:
    """The stem of the teaching notebook ``arg`` names ("03_masks", "03" or "3"), or None."""
    found = [q.stem for q in notebook_paths("notebooks") if q.stem == arg or q.stem[:2] == arg.zfill(2)]
    return found[0] if len(found) == 1 else None


def topic_notebooks(arg: str) -> list[Path]:
    """The notebooks ``execute`` runs for ``arg``: a folder's, one file, or a topic ("03_masks" or "03":
    its teaching notebook and its solutions)."""
    p = Path(arg).resolve()
    if p.is_dir():
        return sorted(p.glob("[0-9][0-9]_*.ipynb"))
    if p.suffix == ".ipynb" or "/" in arg:
        if not p.exists():
            raise SystemExit(f"execute: {arg} does not exist")
        return [p]
    stem = topic(arg)
    if stem is None:
        raise SystemExit(f"execute: {arg!r} is not a topic; they are: {', '.join(q.stem for q in notebook_paths('notebooks'))}")
    teaching, solutions = ROOT / "notebooks" / f"{stem}.ipynb", ROOT / "solutions" / f"{stem}.ipynb"
    return [teaching, solutions] if solutions.exists() else [teaching]


def _main(argv: list[str]) -> int:
    if not argv or argv[0] not in {"execute", "exercises", "sync"}:
        print(__doc__)
        return 2
    command, args = argv[0], argv[1:]
    if command == "exercises":
        write_exercises()
    elif command == "sync":
        sync()
    else:
        targets = []
        for a in args or ["notebooks", "solutions"]:
            targets += topic_notebooks(a)
        if any(p.parent.name == "solutions" for p in targets):
            write_model_answers()  # a passing check shows them: current before the notebooks run
        for path in targets:
            seconds = execute(path)
            print(f"executed {path.relative_to(ROOT)} in {seconds:.1f} s")
        if any(p.parent.name == "solutions" for p in targets):
            write_exercises()
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
