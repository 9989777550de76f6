"""A synthetic class for the mistake report: students built from the wrong implementations kept in
``tests/`` (each topic file's ``WRONG``), so that an instructor can see the report before grading a
real class, and a test can plant known mistakes and find exactly those counts.

    python -m tests.synthetic_class OUT [--students 30] [--seed 0] [--notebooks 05_multihead,...]

writes ``OUT/<student>/<notebook>.ipynb`` for every course notebook with exercises, and
``OUT/planted.json``: for each student, notebook and exercise, what was planted ("right", "blank",
or the wrong implementation's test module, index and the mistake its check names on fixed seeds).

Each student starts from ``solutions/`` and gets, per exercise, the solution (with a probability that
is the student's skill, drawn once per student), a wrong implementation from ``WRONG`` (common
mistakes more often: the first listed are weighted up), or nothing (``raise NotImplementedError()``).
A planted function is a code cell after the solution's that defines it by itself (its source, with
what it uses from its test module: the notebook runs in the grader's sandbox, without tests/).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import pkgutil
import random
import shutil
import textwrap
import types
from collections.abc import Callable
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent


def planted(module: str, name: str, index: int) -> Callable:
    """The ``index``-th wrong implementation of ``name`` in ``tests.<module>``'s ``WRONG``."""
    return importlib.import_module(f"tests.{module}").WRONG[name][index][0]


def planted_source(module: str, name: str, index: int) -> str | None:
    """The source of a cell that defines the planted function as ``name`` by itself: the function,
    the test module's functions and constants it uses, and its imports (the notebook runs in the
    grader's sandbox, which holds no tests/). None when it cannot be written out that way (a lambda,
    a closure, or a use of the course's own functions of that notebook)."""
    mod = importlib.import_module(f"tests.{module}")
    fn = mod.WRONG[name][index][0]
    imports: dict[str, str] = {}
    sources: dict[str, str] = {}

    def add(f) -> bool:
        code = getattr(f, "__code__", None)
        if code is None or f.__name__ == "<lambda>" or code.co_freevars or getattr(f, "__module__", "") != mod.__name__:
            return False
        if f.__name__ in sources:
            return True
        sources[f.__name__] = textwrap.dedent(inspect.getsource(f))
        names = set(code.co_names) | {n for c in code.co_consts if isinstance(c, types.CodeType) for n in c.co_names}
        for n in sorted(names):
            if n not in mod.__dict__ or n in sources:
                continue
            value = mod.__dict__[n]
            if isinstance(value, types.ModuleType):
                imports[n] = f"import {value.__name__}" + (f" as {n}" if value.__name__ != n else "")
            elif isinstance(value, types.FunctionType):
                if value.__module__ != mod.__name__:
                    if value.__module__.startswith(("helpers", "tests")):
                        return False
                    imports[n] = f"from {value.__module__} import {value.__name__} as {n}"
                elif not add(value):
                    return False
            elif isinstance(value, (int, float, str, bool)):
                sources[n] = f"{n} = {value!r}\n"
            elif not (isinstance(value, type) and value.__module__ in ("builtins", "typing")):
                return False
        return True

    if not add(fn):
        return None
    body = "\n\n".join(sorted(set(imports.values()))) + "\n\n\n" + "\n\n".join(reversed(list(sources.values())))
    return body.strip() + f"\n\n\n{name} = {fn.__name__}\n"


def wrong_implementations() -> dict[str, list[tuple[str, int]]]:
    """Exercise function name -> [(test module, index in its WRONG list)], over every topic file:
    those that a notebook can define by itself (:func:`planted_source`)."""
    import tests

    out: dict[str, list[tuple[str, int]]] = {}
    for info in sorted(pkgutil.iter_modules(tests.__path__), key=lambda i: i.name):
        if info.name.startswith("test_nb"):
            module = importlib.import_module(f"tests.{info.name}")
            for name, impls in getattr(module, "WRONG", {}).items():
                out.setdefault(name, []).extend((info.name, i) for i in range(len(impls))
                                                if planted_source(info.name, name, i) is not None)
    return out


SALTS = (0, 20251126, 7)  # the course's fixed seeds and two salted draws, as `make grade` salts them


def expected_mistake(module: str, name: str, index: int) -> str:
    """The mistake id the check of ``name`` gives the planted function, the same on the fixed seeds
    and on salted ones (as the grader draws them); "" when it depends on the draw (not planted)."""
    from helpers import checks
    from helpers.checks import core

    ids = set()
    try:
        for salt in SALTS:
            core.salt_cases(salt)
            ids.add(getattr(checks, name).evaluate(planted(module, name, index)).mistake_id)
    finally:
        core.salt_cases(0)
    return ids.pop() if len(ids) == 1 else ""


def _cell(source: str) -> nbformat.NotebookNode:
    return nbformat.v4.new_code_cell(source)


def plant(notebook: nbformat.NotebookNode, plan: dict[str, dict]) -> nbformat.NotebookNode:
    """``notebook`` (a solutions notebook) with each exercise of ``plan`` replaced as planned:
    {"kind": "right"} leaves it, "blank" and "wrong" add a cell after the one defining it."""
    cells = []
    for cell in notebook.cells:
        cells.append(cell)
        if cell.cell_type != "code":
            continue
        for name, what in plan.items():
            if f"def {name}(" not in cell.source or "### BEGIN SOLUTION" not in cell.source:
                continue
            if what["kind"] == "blank":
                cells.append(_cell(f"def {name}(*args, **kwargs):\n    raise NotImplementedError()"))
            elif what["kind"] == "wrong":
                cells.append(_cell(planted_source(what["module"], name, what["index"])))
    notebook.cells = cells
    return notebook


def build(out: Path, students: int, seed: int = 0, notebooks: list[str] | None = None,
          skills: tuple[float, float] = (0.2, 0.9), blank_share: float = 0.25) -> dict:
    """Write the class into ``out`` and return (and write) the plan: student -> notebook -> name -> what."""
    from helpers.checks import EXERCISES

    rng = random.Random(seed)
    wrongs = wrong_implementations()
    stems = notebooks or sorted({e.notebook for e in EXERCISES.values()})
    exercises = {s: sorted((e for e in EXERCISES.values() if e.notebook == s), key=lambda e: e.order) for s in stems}
    expected: dict[tuple[str, str, int], str] = {}
    plan: dict[str, dict] = {}
    if out.exists():
        shutil.rmtree(out)
    for k in range(students):
        student = f"student-{k + 1:02d}"
        skill = rng.uniform(*skills)
        plan[student] = {}
        for stem in stems:
            mine: dict[str, dict] = {}
            for e in exercises[stem]:
                r = rng.random()
                options = wrongs.get(e.name, [])
                if r < skill or not options:
                    mine[e.name] = {"kind": "right"}
                elif r < skill + (1 - skill) * blank_share:
                    mine[e.name] = {"kind": "blank"}
                else:  # the first wrong implementations of a topic file are its commonest mistakes
                    module, index = rng.choices(options, weights=[1 / (1 + i) for i in range(len(options))])[0]
                    key = (module, e.name, index)
                    if key not in expected:
                        expected[key] = expected_mistake(*key)
                    mine[e.name] = ({"kind": "wrong", "module": module, "index": index, "mistake_id": expected[key]}
                                    if expected[key] else {"kind": "right"})  # a mistake that depends on the draw
            nb = nbformat.read(ROOT / "solutions" / f"{stem}.ipynb", as_version=4)
            path = out / student / f"{stem}.ipynb"
            path.parent.mkdir(parents=True, exist_ok=True)
            nbformat.write(plant(nb, mine), path)
            plan[student][stem] = mine
    (out / "planted.json").write_text(json.dumps(plan, indent=1) + "\n", encoding="utf-8")
    return plan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.synthetic_class", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--students", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--notebooks", default="", help="comma-separated notebook stems (default: all with exercises)")
    args = parser.parse_args(argv)
    plan = build(args.out, args.students, args.seed, [s for s in args.notebooks.split(",") if s] or None)
    n = sum(len(nbs) for nbs in plan.values())
    print(f"wrote {n} notebooks of {len(plan)} students into {args.out} (plan: {args.out / 'planted.json'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
