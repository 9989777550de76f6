"""helpers/tools/copies.py: copies of the course's references are found from a notebook's source.

- every correct implementation kept in tests/ (``RIGHT`` of each tests/test_nb*.py, read with
  :mod:`ast`: the named functions, and the launcher a factory such as ``_forward(...)`` returns,
  with the helpers and kernels they call) is never flagged;
- copies made from each of the 45 references (the reference and the course functions it calls,
  e.g. 9.3's kernels) are all flagged: verbatim, names and arguments renamed, reformatted and
  recommented, one or two statements added, independent lines swapped, and all at once;
- what the normalisation keeps and drops, the notebook's cells (the last definition wins, magics,
  cells that do not parse), and that the module reads its sources without importing torch.
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.checks import EXERCISES
from helpers.tools import copies

ROOT = Path(__file__).resolve().parent.parent
NAMES = sorted(EXERCISES, key=lambda n: EXERCISES[n].order)


# --------------------------------------------------------------------------- honest work


def _right_entries(tree: ast.Module):
    """``(exercise name, expression)`` of every ``RIGHT = {...}`` and ``RIGHT[name] = [...]``."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            if isinstance(target, ast.Name) and target.id == "RIGHT" and isinstance(node.value, ast.Dict):
                yield from ((key.value, e) for key, value in zip(node.value.keys, node.value.values) for e in value.elts)
            elif isinstance(target, ast.Subscript) and getattr(target.value, "id", "") == "RIGHT":
                yield from ((target.slice.value, e) for e in node.value.elts)


def _with_helpers(fn: ast.FunctionDef, name: str, defined: dict[str, ast.AST]) -> dict[int, str]:
    """Notebook cells: ``fn`` renamed to the exercise's name, then each function of its test module it
    calls (its kernels, its helpers), transitively."""
    own, fn.name = fn.name, name
    cells, seen, todo = {0: ast.unparse(fn)}, {own}, sorted(copies._names(fn))
    fn.name = own
    while todo:
        other = todo.pop()
        if other in defined and other not in seen:
            seen.add(other)
            cells[len(cells)] = ast.unparse(defined[other])
            todo += sorted(copies._names(defined[other]))
    return cells


def right_variants() -> list[tuple[str, str, dict[int, str]]]:
    """``(exercise name, label, cells)`` for every correct variant kept in tests/test_nb*.py."""
    out = []
    for path in sorted((ROOT / "tests").glob("test_nb[0-9][0-9]_*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        defined = copies._top_defs(tree)
        for name, entry in _right_entries(tree):
            if isinstance(entry, ast.Name):
                fn = defined[entry.id]
            else:  # a factory's call: the function it returns
                factory = defined[entry.func.id]
                returned = [s for s in factory.body if isinstance(s, ast.Return)][-1].value.id
                fn = next(s for s in factory.body if isinstance(s, ast.FunctionDef) and s.name == returned)
            out.append((name, f"{path.stem}:{ast.unparse(entry)}", _with_helpers(fn, name, defined)))
    return out


def test_no_correct_variant_kept_in_tests_is_flagged():
    variants = right_variants()
    assert len(variants) >= 150 and {v[0] for v in variants} == set(NAMES), "RIGHT was not read in full"
    flagged = {label: copies.find_copies(cells, [name]) for name, label, cells in variants}
    flagged = {label: why for label, why in flagged.items() if why}
    assert not flagged, flagged


# --------------------------------------------------------------------------- copies


@functools.cache
def _lines(stem: str) -> list[str]:
    return (copies.HELPERS / f"{stem}.py").read_text(encoding="utf-8").splitlines()


def _source(stem: str, node: ast.AST) -> str:
    """The text of a course function or class as it stands in its module, decorators included."""
    lines = _lines(stem)
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    return "\n".join(lines[first - 1:node.end_lineno])


def _definition(name: str) -> tuple[str, ast.AST]:
    """The lesson module and the top-level definition of ``name``."""
    return next((s, n) for s, n in copies._course_defs()[name] if n.name == name)


class _Rename(ast.NodeTransformer):
    """Renames arguments, locals (``only_args=False``) and the pasted functions' own names."""

    def __init__(self, globals_: dict[str, str], only_args: bool):
        self.globals, self.only_args, self.names = globals_, only_args, {}

    def visit_FunctionDef(self, node):
        outer = self.names
        args = {a.arg for a in ast.walk(node.args) if isinstance(a, ast.arg)}
        bound = args if self.only_args else copies._bound(node) - {node.name}
        self.names = {**outer, **{n: f"renamed_{i}_{n.lower()}" for i, n in enumerate(sorted(bound))}}
        node.name = self.globals.get(node.name, node.name)
        self.generic_visit(node)
        self.names = outer
        return node

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node):
        node.name = self.globals.get(node.name, node.name)
        return self.generic_visit(node)

    def visit_arg(self, node):
        node.arg = self.names.get(node.arg, node.arg)
        return node

    def visit_Name(self, node):
        node.id = self.names.get(node.id, self.globals.get(node.id, node.id))
        return node


def _functions_of(tree: ast.AST):
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def renamed(name: str, trees: list[ast.AST], only_args: bool = False) -> list[ast.AST]:
    """Every local name and argument renamed, and the pasted helpers (not the graded function); or
    (``only_args``) the arguments alone."""
    pasted = {} if only_args else {t.name: f"my{t.name}" for t in trees if t.name != name}
    return [_Rename(pasted, only_args).visit(t) for t in trees]


def added(trees: list[ast.AST]) -> list[ast.AST]:
    """A print first, a dead assignment second, in every function."""
    for fn in (f for t in trees for f in _functions_of(t)):
        fn.body[1:1] = ast.parse("print('checking', 1)\nunused_value = 42").body
    return trees


def _independent(a: ast.stmt, b: ast.stmt) -> bool:
    simple = (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr)
    if not (isinstance(a, simple) and isinstance(b, simple)):
        return False
    stored = lambda s: {n.id for n in ast.walk(s) if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)}  # noqa: E731
    used = lambda s: {n.id for n in ast.walk(s) if isinstance(n, ast.Name)}  # noqa: E731
    return not (stored(a) & used(b) or stored(b) & used(a))


def reordered(trees: list[ast.AST]) -> list[ast.AST]:
    """The first two adjacent independent statements of each function swapped (where there are any)."""
    for fn in (f for t in trees for f in _functions_of(t)):
        body = fn.body
        for i in range(len(body) - 1):
            if _independent(body[i], body[i + 1]):
                body[i], body[i + 1] = body[i + 1], body[i]
                break
    return trees


def recommented(trees: list[ast.AST]) -> list[str]:
    """Reformatted by ``ast.unparse`` (comments and layout gone), another docstring, a comment after
    every line."""
    out = []
    for t in trees:
        for fn in _functions_of(t):
            fn.body.insert(0, ast.Expr(ast.Constant("My own implementation.")))
        out.append("\n".join(f"{line}  # step {i}" if line.strip() and not line.rstrip().endswith((",", "(", "\\"))
                             else line for i, line in enumerate(ast.unparse(t).splitlines())))
    return out


def _cells(parts: list) -> dict[int, str]:
    return {i: p if isinstance(p, str) else ast.unparse(p) for i, p in enumerate(parts)}


KINDS = {
    "verbatim": lambda name, trees: trees,
    "renamed": renamed,
    "arguments renamed": lambda name, trees: renamed(name, trees, only_args=True),
    "recommented": lambda name, trees: recommented(trees),
    "statements added": lambda name, trees: added(trees),
    "reordered": lambda name, trees: reordered(trees),
    "all at once": lambda name, trees: recommented(reordered(added(renamed(name, trees)))),
}


def copies_of(name: str, kinds=tuple(KINDS)) -> dict[str, dict[int, str]]:
    """A notebook's cells for each kind of copy of ``name``'s reference, one cell per pasted function
    (each kind gets a freshly parsed copy, which it changes in place; "verbatim" keeps the text)."""
    stem, node = _definition(name)
    texts = [_source(s, n) for s, n in copies._closure(stem, node)]
    return {kind: _cells(texts if kind == "verbatim" else KINDS[kind](name, [ast.parse(t).body[0] for t in texts]))
            for kind in kinds}


BIG = ("flash_attention_triton", "flash_attention_triton_backward")  # ~30 course functions pasted: 1 s each


# make test: one exercise of each notebook (the same comparison runs for all); make test-all: all 45
FAST = {n for n in NAMES if n not in BIG and n == min((m for m in NAMES if m not in BIG and
                                                       EXERCISES[m].notebook == EXERCISES[n].notebook),
                                                      key=lambda m: EXERCISES[m].order)}


@pytest.mark.parametrize("name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in NAMES])
def test_every_kind_of_copy_is_flagged(name):
    kinds = copies_of(name)
    missed = [kind for kind, cells in kinds.items() if name not in copies.find_copies(cells, [name])]
    assert not missed, f"{name}: {missed} not flagged"


@pytest.mark.parametrize("name", BIG)
def test_a_copy_of_the_triton_kernels_changed_every_way_at_once_is_flagged(name):
    """make test's stand-in for the two slow cases above."""
    assert name in copies.find_copies(copies_of(name, kinds=("all at once",))["all at once"], [name])


def test_a_copy_is_reported_in_one_line_that_names_the_reference():
    why = copies.find_copies(copies_of("masked_softmax")["renamed"], ["masked_softmax"])["masked_softmax"]
    assert "\n" not in why and "holds 100% of the course's nb03_masks.masked_softmax after renaming (7 of its 7" in why
    why = copies.find_copies(copies_of("merge_heads")["statements added"], ["merge_heads"])["merge_heads"]
    assert why.startswith("merge_heads is identical to the course's nb01_qkv_shapes.merge_heads after renaming, plus 2")


def test_a_copied_triton_kernel_is_flagged_next_to_the_learners_own_launcher():
    kernel = _definition("_attn_fwd")[1]
    launcher = ("def flash_attention_triton(q, k, v, causal=False):\n"
                "    out = torch.empty_like(q)\n    my_kernel[(4, 4)](q, k, v, out)\n    return out\n")
    cells = {3: "%time\n" + launcher, 1: _source("nb09_triton_flash", kernel).replace("_attn_fwd", "my_kernel")}
    why = copies.find_copies(cells, ["flash_attention_triton", "flash_attention_triton_backward"])
    assert list(why) == ["flash_attention_triton"]
    assert "helper my_kernel (cell 1)" in why["flash_attention_triton"] and "_attn_fwd" in why["flash_attention_triton"]


# --------------------------------------------------------------------------- the parts


def test_normalisation_drops_names_comments_and_layout_and_keeps_the_library():
    a = "def f(x, n):\n    '''doc'''\n    y = torch.softmax(x, dim=-1)  # note\n    return y.transpose(1, 2) * n\n"
    b = "def g(inp, k):\n    out = torch.softmax(\n        inp, dim=-1)\n\n    return out.transpose(1, 2) * k\n"
    units = copies.statements(ast.parse(a).body[0])
    assert units == copies.statements(ast.parse(b).body[0])
    assert set(units) == {"_ = torch.softmax(a0, dim=-1)", "return _.transpose(1, 2) * a1"}
    for other in ("return y.transpose(2, 1) * n", "return y.mT * n", "return n * y.transpose(1, 2)"):
        c = a.replace("return y.transpose(1, 2) * n", other)
        assert copies.statements(ast.parse(c).body[0]) != units


def test_the_last_definition_wins_and_broken_cells_are_skipped():
    merge = _source("nb01_qkv_shapes", _definition("merge_heads")[1])
    own = "def merge_heads(o):\n    return torch.cat(o.unbind(1), dim=-1)\n"
    assert copies.find_copies({0: merge, 1: own}, ["merge_heads"]) == {}
    assert "merge_heads" in copies.find_copies({0: own, 1: merge}, ["merge_heads"])
    assert "merge_heads" in copies.find_copies({0: own, 1: "!pip list\n%%time\n" + merge, 2: "def ("}, ["merge_heads"])
    assert copies.find_copies({0: merge + "\nreturn (("}, ["merge_heads"]) == {}
    assert copies.find_copies({}, ["merge_heads"]) == {}
    continued = merge.replace("return o.transpose(1, 2)", "x = (1\n        != 2)\n    return o.transpose(1, 2)")
    assert continued != merge and "merge_heads" in copies.find_copies({0: continued}, ["merge_heads"])  # != starts code


def test_the_course_is_read_without_importing_it():
    code = ("import sys\nfrom helpers.tools import copies\nrefs = copies.reference_sources(['flash_attention_triton'])\n"
            "assert any(r.label == 'nb09_triton_flash._attn_fwd' for r in refs['flash_attention_triton'])\n"
            "assert 'torch' not in sys.modules and 'helpers.reference' not in sys.modules, sorted(sys.modules)\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_every_exercise_has_its_reference_and_the_checks_forbidden_helpers():
    refs = copies.reference_sources(NAMES)
    assert all(sum(r.main for r in refs[n]) == 1 for n in NAMES), [n for n in NAMES if sum(r.main for r in refs[n]) != 1]
    labels = {r.label for r in refs["training_memory"]}
    assert {"nb08_flops_memory.activation_numbers", "nb08_flops_memory.max_batch"} <= labels
    assert "nb12_serving.BlockAllocator.fork" in {r.label for r in refs["blocks_in_use"]}
