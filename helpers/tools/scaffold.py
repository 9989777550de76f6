"""One exercise at a time: its stubs in every place an exercise lives (``make new-exercise``), and
every test about it (``make check-exercise``).

    python -m helpers.tools.scaffold new NB NAME [--args "T, window"] [--stars 2] [--title ...] [--section ...]
    python -m helpers.tools.scaffold check EX [pytest options]

``NB`` is a notebook's number or stem (``03`` or ``03_masks``), ``NAME`` the function the learner
writes. The exercise gets the notebook's next id (3.7 after 3.6). Written, in order:

1. ``helpers/registry.py``: its line, after the notebook's last one;
2. ``helpers/<module>.py``: the reference, a stub that raises (or the lesson function of that name,
   if the module has one), added to the module's ``__all__``;
3. ``helpers/checks/<module>.py``: the check, a stub that raises, with the usual shape in comments;
4. ``tests/test_<module>.py``: its entries in ``WRONG`` and ``RIGHT``, empty;
5. ``solutions/<notebook>.ipynb``: the statement, solution, check and model-answer cells, after the
   notebook's last exercise;
6. ``notebooks/<notebook>.ipynb``, only where its "Exercises" section lists each exercise as a
   bullet (02, 05, 06, 10, 11): the new exercise's bullet, its title;
7. ``CHANGELOG.md``: a line under the unreleased version.

``<module>`` is ``nb<notebook>`` unless ``--module`` names another (``nb09_triton_flash``). Every stub
says what to write in it; until they are written, ``make check-exercise EX=<id>`` fails and says
where. Nothing is overwritten: a name or id already in the registry stops it before any file changes.

``check EX`` (an id or a function name) runs pytest with ``--exercise EX`` (the root conftest.py) on
the files that hold the exercise's tests: its check against its wrong and right answers, its salted
cases, its recipe and hostile-call tests, its notebook's solutions under nbval, the grading of that
notebook blank and solved, and the registry against everything derived from it.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat

from helpers import registry
from helpers.tools import notebooks as nbtools

ROOT = nbtools.ROOT
TODO = "TODO"


def _stem(nb: str) -> str:
    """The notebook stem from ``03``, ``3`` or ``03_masks``."""
    found = nbtools.topic(nb)
    if found is None:
        known = ", ".join(p.stem for p in nbtools.notebook_paths("notebooks"))
        raise SystemExit(f"new-exercise: NB={nb!r} is not one of the course's notebooks ({known})")
    return found


def next_id(stem: str) -> str:
    """The id after the notebook's last exercise ("3.7" after "3.6"; "13.1" for a notebook without any)."""
    mine = registry.by_notebook().get(stem, [])
    return f"{int(stem[:2])}.{mine[-1].order[1] + 1 if mine else 1}"


def registry_line(ex: registry.Exercise) -> str:
    """``ex`` as a line of ``helpers/registry.py``'s table."""
    q = lambda s: json.dumps(s, ensure_ascii=False)  # noqa: E731 - a Python string literal in double quotes
    extra = (", bonus=True" if ex.bonus else "") + (f", module={q(ex.module)}" if ex.module else "")
    return (f"    Exercise({q(ex.id)}, {q(ex.name)}, {q(ex.title)}, {ex.stars}, {q(ex.notebook)},\n"
            f"             {q(ex.section)}{extra}),\n")


def add_to_registry(text: str, ex: registry.Exercise) -> str:
    """``helpers/registry.py``'s text with ``ex``'s line after the last line of an earlier exercise."""
    tree = ast.parse(text)
    table = next(n for n in tree.body if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "EXERCISES")
    before = [c for c in table.value.elts if tuple(int(p) for p in c.args[0].value.split(".")) < ex.order]
    lines = text.splitlines(keepends=True)
    at = before[-1].end_lineno if before else table.value.lineno
    return "".join(lines[:at] + [registry_line(ex)] + lines[at:])


def add_to_all(text: str, name: str) -> str:
    """A module's text with ``name`` appended to its literal ``__all__`` list (unchanged without one)."""
    node = next((n for n in ast.parse(text).body if isinstance(n, ast.Assign | ast.AnnAssign)
                 and getattr(n.targets[0] if isinstance(n, ast.Assign) else n.target, "id", "") == "__all__"), None)
    if node is None or not isinstance(node.value, ast.List):
        return text
    names = [*ast.literal_eval(node.value), name]
    lines = text.splitlines(keepends=True)
    head = lines[node.lineno - 1][: node.value.col_offset]
    listed = head + "[" + ", ".join(f'"{n}"' for n in names) + "]\n"
    one_a_line = node.end_lineno - node.lineno == len(names)  # "[", a name a line, "]"
    if one_a_line:
        listed = head + "[\n" + "".join(f'    "{n}",\n' for n in names) + "]\n"
    elif len(listed) > 110:  # packed, as the module had it
        rows, row = [], "   "
        for n in names:
            if len(row) + len(n) + 4 > 110:
                rows.append(row.rstrip() + "\n")
                row = "   "
            row += f' "{n}",'
        listed = head + "[\n" + "".join(rows) + row.rstrip(",") + ",\n]\n"
    return "".join(lines[: node.lineno - 1] + [listed] + lines[node.end_lineno:])


def reference_stub(ex: registry.Exercise, args: str) -> str:
    """The reference's stub, appended to the lesson module."""
    return f'''

def {ex.name}({args}):
    """{TODO} (exercise {ex.id}, {ex.title}): what it computes, each argument and the result with its
    shape and dtype (``x [B, T, D] -> [B, T, D]``). This signature and docstring are the exercise's
    contract: the statement in solutions/{ex.notebook}.ipynb and the check follow them."""
    raise NotImplementedError("exercise {ex.id}: write its reference in helpers/{ex.module_name}.py")
'''


def check_stub(ex: registry.Exercise, args: str, seed: int, ref: str) -> str:
    """The check's stub, appended to the check module: its cases drawn from ``seeded(seed)`` on, the
    reference called through the module's alias ``ref``."""
    names = [a.strip().split("=")[0].split(":")[0].strip() for a in args.split(",") if a.strip()]
    call = ", ".join(names)
    packed = f"({call},)" if len(names) == 1 else f"({call})"
    described = ", ".join(f"{n}={n}" for n in names)
    return f'''

@exercise()
def {ex.name}(t: Trial) -> None:
    # {TODO}: the check of {ex.id}, in two steps (CONTRIBUTING.md, "Writing a check"):
    # 1. every case, its expected output and each mistake's model, before the learner's code runs;
    #    every input drawn from seeded(n) (make grade salts n; use seeds nothing else in this module
    #    uses), sizes that differ from each other (a transposed axis then shows);
    # 2. each case through t.call, its output compared by t.tensor / t.number / t.tuple.
    #
    # cases = []
    # for seed in ({seed}, {seed + 1}):
    #     g = seeded(seed)
    #     {call} = ...  # drawn with g: torch.randn(..., generator=g), draw(g, low, high) for an int
    #     expected = {ref}.{ex.name}({call})
    #     mistakes = eager_mistakes({{
    #         Mistake("a-slug", "the hint the learner sees", "what the instructor's report says"):
    #             lambda: ...,  # the output that mistake gives on this case
    #     }})
    #     cases.append(({packed}, describe_case({described}), expected, mistakes))
    # for args, described, expected, mistakes in cases:
    #     got = t.call(*args, case=described)
    #     t.tensor(got, expected, what="...", mistakes=mistakes, hint="the full recipe, shown on a repeat")
    #     # (a count: t.number(got, expected, what="...", integer=True, ...); a tuple: t.tuple)
    raise NotImplementedError("exercise {ex.id}: write its check in helpers/checks/{ex.module_name}.py")
'''


def add_to_cases(text: str, name: str, path: Path) -> str:
    """A topic test file's text with ``name``'s (empty) entries at the end of ``WRONG`` and ``RIGHT``."""
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    what = {"WRONG": "two or more learner-style wrong answers: (function, words its message must contain)",
            "RIGHT": "one or more right answers in other styles than the reference"}
    found = [n for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") in what]
    if {n.targets[0].id for n in found} != set(what):
        raise SystemExit(f"new-exercise: {path.relative_to(ROOT)} has no WRONG and RIGHT dicts to add {name} to")
    for node in sorted(found, key=lambda n: -n.lineno):
        last = node.end_lineno - 1  # the line of the closing brace
        entry = f'    "{name}": [],  # {TODO}: {what[node.targets[0].id]}\n'
        lines[last:last] = [entry]
    return "".join(lines)


def builds_on(ex: registry.Exercise, solutions_text: str) -> str:
    """The statement's link to the section it builds on, in the style the notebook's statements use."""
    number = (ex.section or "").split(" ")[0].rstrip(".")
    anchor = re.sub(r"\s+", "-", (ex.section or "").strip())
    link = f"../notebooks/{ex.notebook}.ipynb#{anchor}"
    if "It builds on [" in solutions_text:
        return f"It builds on [{ex.notebook[:2]} · section {number}]({link})."
    return f"Builds on [notebook {ex.notebook[:2]}, section {number}]({link})."


def solution_cells(ex: registry.Exercise, args: str, solutions_text: str = "") -> list[nbformat.NotebookNode]:
    """The statement, solution, check and model-answer cells of ``ex``."""
    stars = "★" * ex.stars
    points = f"{'bonus, ' if ex.bonus else ''}{ex.points} point{'s' if ex.points != 1 else ''}"
    return [
        nbformat.v4.new_markdown_cell(
            f"## Exercise {ex.id} {stars} ({points}): {ex.title}\n\n"
            f"Write `{ex.name}({args})`:\n"
            f"- {TODO}: each argument, with its shape and dtype;\n"
            f"- {TODO}: what to return, with its shape and dtype.\n\n"
            f"{builds_on(ex, solutions_text)}\n\n"
            f"**Why it matters for LLMs:** {TODO}: a question the model answer below answers."),
        nbformat.v4.new_code_cell(
            f'def {ex.name}({args}):\n    """{TODO}: its shapes, as in the reference\'s docstring."""\n'
            f"    {nbtools.BEGIN_SOLUTION}\n    raise NotImplementedError  # {TODO}: the model solution\n"
            f"    {nbtools.END_SOLUTION}"),
        nbformat.v4.new_code_cell(f"checks.{ex.name}({ex.name})"),
        nbformat.v4.new_markdown_cell(f"**Model answer.** {TODO}: the answer to the question above.",
                                      metadata={"tags": [nbtools.MODEL_ANSWER_TAG]}),
    ]


def add_to_exercise_list(nb: nbformat.NotebookNode, ex: registry.Exercise, args: str) -> bool:
    """In a teaching notebook whose "Exercises" section lists each exercise as a bullet
    (``- **6.1 ★ `repeat_kv(x, n_rep)`**: ...``), add ``ex``'s after the last; True if it did."""
    n = ex.id.split(".")[0]
    bullet = re.compile(rf"^- \*\*{n}\.\d+ ", re.MULTILINE)
    for cell in nb.cells:
        found = list(bullet.finditer(cell.source)) if cell.cell_type == "markdown" else []
        if found:
            rest = cell.source[found[-1].end():]
            end = found[-1].end() + (m.start() + 1 if (m := re.search(r"\n(?!  )", rest)) else len(rest))
            line = f"- **{ex.id} {'★' * ex.stars} `{ex.name}({args})`**: {ex.title}.\n"
            cell.source = cell.source[:end] + line + cell.source[end:]
            return True
    return False


def add_to_changelog(text: str, ex: registry.Exercise, args: str) -> str:
    """CHANGELOG.md with ``ex``'s line at the top of the unreleased version's notes."""
    head = re.search(r"^## .*\(unreleased\)\n\n", text, re.MULTILINE)
    if head is None:
        raise SystemExit("new-exercise: CHANGELOG.md has no '## <version> (unreleased)' heading to add the exercise under")
    line = (f"- New exercise {ex.id} {'★' * ex.stars} `{ex.name}({args})`: {ex.title} (notebook {ex.notebook}, "
            f"section {ex.section}).\n\n")
    return text[:head.end()] + line + text[head.end():]


def add_to_solutions(nb: nbformat.NotebookNode, cells: list) -> nbformat.NotebookNode:
    """``nb`` with ``cells`` after its last model-answer cell (before "What next" and the summary)."""
    answers = [i for i, c in enumerate(nb.cells) if nbtools.MODEL_ANSWER_TAG in c.metadata.get("tags", [])]
    at = answers[-1] + 1 if answers else len(nb.cells)
    nb.cells[at:at] = cells
    return nb


def _plain_signature(function: ast.FunctionDef) -> str:
    """A function's parameters as a learner writes them: names and defaults, no annotations."""
    plain = ast.parse(f"def f({ast.unparse(function.args)}): pass").body[0].args
    for a in [*plain.posonlyargs, *plain.args, *plain.kwonlyargs, plain.vararg, plain.kwarg]:
        if a is not None:
            a.annotation = None
    return ast.unparse(plain)


def _function(text: str, name: str) -> ast.FunctionDef | None:
    """The module-level function ``name`` of a module's source, or None."""
    return next((n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name == name), None)


def _alias(text: str, module: str) -> str:
    """The name the check module imports the lesson module under (``from .. import nb03_masks as ref``)."""
    found = re.search(rf"^from \.\. import {module} as (\w+)", text, re.MULTILINE)
    return found.group(1) if found else f"helpers.{module}"


def _seed_base(text: str, stem: str) -> int:
    """The first multiple of ten above every literal ``seeded(n)`` of the check module."""
    used = [int(s) for s in re.findall(r"seeded\((\d+)", text)]
    return (max(used) // 10 + 1) * 10 if used else int(stem[:2]) * 100


def new_exercise(nb: str, name: str, args: str = "", stars: int = 2, title: str = "", section: str = "",
                 module: str = "", bonus: bool = False) -> tuple[registry.Exercise, list[Path]]:
    """Write the stubs of a new exercise (see the module's docstring); return it and the files written."""
    stem = _stem(nb)
    if not re.fullmatch(r"[a-z_][a-z0-9_]*", name):
        raise SystemExit(f"new-exercise: NAME={name!r} is not a function name (lower case, digits, _)")
    if name in registry.by_name():
        raise SystemExit(f"new-exercise: {name} is already exercise {registry.by_name()[name].id}")
    if stars not in (1, 2, 3):
        raise SystemExit("new-exercise: STARS is 1, 2 or 3 (★ warm-up, ★★ core, ★★★ hard)")
    ex = registry.Exercise(next_id(stem), name, title or name.replace("_", " "), stars, stem,
                           section or f"{TODO}: a section heading of notebooks/{stem}.ipynb", bonus,
                           module if module and module != f"nb{stem}" else "")
    paths = {"registry": ROOT / "helpers" / "registry.py", "lesson": ROOT / "helpers" / f"{ex.module_name}.py",
             "check": ROOT / "helpers" / "checks" / f"{ex.module_name}.py",
             "tests": ROOT / "tests" / f"test_{ex.module_name}.py", "solutions": ROOT / "solutions" / f"{stem}.ipynb"}
    missing = [str(p.relative_to(ROOT)) for p in paths.values() if not p.exists()]
    if missing:
        raise SystemExit(f"new-exercise: {', '.join(missing)} missing (a new notebook's files come first)")
    text = {k: p.read_text(encoding="utf-8") for k, p in paths.items() if k != "solutions"}
    if re.search(rf"^def {name}\(", text["check"], re.MULTILINE):
        raise SystemExit(f"new-exercise: helpers/checks/{ex.module_name}.py already has a function {name}")
    lesson = _function(text["lesson"], name)
    if lesson is not None:  # a lesson function becomes the exercise's reference: its signature is the contract
        args = args or _plain_signature(lesson)
    args = args or "x"
    changelog = ROOT / "CHANGELOG.md"
    written = {  # everything computed before anything is written
        "changelog": add_to_changelog(changelog.read_text(encoding="utf-8"), ex, args),
        "registry": add_to_registry(text["registry"], ex),
        "lesson": add_to_all(text["lesson"] if lesson is not None else
                             text["lesson"].rstrip("\n") + "\n" + reference_stub(ex, args), name),
        "check": text["check"].rstrip("\n") + "\n" + check_stub(ex, args, _seed_base(text["check"], stem),
                                                               _alias(text["check"], ex.module_name)),
        "tests": add_to_cases(text["tests"], name, paths["tests"]),
    }
    solutions = nbtools.read(paths["solutions"])
    nb_new = add_to_solutions(solutions, solution_cells(ex, args, nbtools.dumps(solutions)))
    teaching = nbtools.read(ROOT / "notebooks" / f"{stem}.ipynb")
    listed = add_to_exercise_list(teaching, ex, args)
    paths["changelog"] = changelog
    for key, body in written.items():
        paths[key].write_text(body, encoding="utf-8")
    nbtools.write(nb_new, paths["solutions"])
    if listed:
        nbtools.write(teaching, ROOT / "notebooks" / f"{stem}.ipynb")
    return ex, list(paths.values()) + ([ROOT / "notebooks" / f"{stem}.ipynb"] if listed else [])


def check_command(wanted: str, jobs: int = 2, extra: tuple[str, ...] = ()) -> list[str]:
    """The pytest command line of ``check EX``."""
    ex = registry.find(wanted)
    if ex is None:
        raise SystemExit(f"check-exercise: EX={wanted!r} is not an exercise id or name in helpers/registry.py")
    files = [f"tests/test_{ex.module_name}.py", "tests/test_machinery.py", "tests/test_class_report.py",
             "tests/test_pipeline.py", "tests/test_grading.py", "tests/test_scaffold.py", "tests/test_nbgrader.py",
             f"solutions/{ex.notebook}.ipynb"]
    return [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", str(jobs), "--dist", "loadscope",
            "--nbval", "--nbval-current-env", "--nbval-sanitize-with", "tests/nbval_sanitize.cfg",
            "--exercise", ex.id, *extra, *files]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["check"] and len(argv) > 1:
        jobs = os.environ.get("JOBS", "2")
        command = check_command(argv[1], int(jobs) if jobs.isdigit() else 2, tuple(argv[2:]))
        print(" ".join(command[2:]), flush=True)
        return subprocess.call(command, cwd=ROOT)
    if argv[:1] != ["new"]:
        print(__doc__)
        return 2
    parser = argparse.ArgumentParser(prog="python -m helpers.tools.scaffold new", description=__doc__.split("\n\n")[0])
    parser.add_argument("nb", help="the notebook: 03 or 03_masks")
    parser.add_argument("name", help="the function the learner writes, e.g. sliding_window_mask")
    parser.add_argument("--args", default="", help='its parameters, e.g. "T, window" (default: those of the '
                        "lesson module's function of that name, if there is one, else x)")
    parser.add_argument("--stars", type=int, default=2, help="1, 2 or 3 (default 2); points = stars")
    parser.add_argument("--title", default="", help="a few words (default: the name in words)")
    parser.add_argument("--section", default="", help="the heading of the teaching notebook's section it builds on")
    parser.add_argument("--module", default="", help="the lesson and check module, if not nb<notebook>")
    parser.add_argument("--bonus", action="store_true", help="scored apart, never blocks a pass")
    a = parser.parse_args(argv[1:])
    ex, paths = new_exercise(a.nb, a.name, a.args, a.stars, a.title, a.section, a.module, a.bonus)
    print(f"exercise {ex.id} {ex.name} added; write what each {TODO} asks for in:")
    for p in paths:
        print(f"  {p.relative_to(ROOT)}")
    print(f"then: make sync; make execute NB=solutions/{ex.notebook}.ipynb; make check-exercise EX={ex.id}; "
          "make test (CONTRIBUTING.md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
