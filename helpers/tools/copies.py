"""Copies of the course's references in a notebook, judged from its source (for ``make grade``).

A notebook is graded in a sandbox without the course's references, so it cannot call them; it can
still hold a pasted copy, renamed and reformatted. :func:`find_copies` compares each graded
function of a notebook (and the helpers and ``@triton.jit`` kernels it calls, defined in the
notebook) with the reference of its exercise (and the course functions that reference calls, and
the check's ``forbidden_references``), read as text from the lesson modules ``helpers/nbXX_*.py``
and ``helpers/checks/nbXX_*.py`` with :mod:`ast`: nothing is imported, torch is not needed.

Normalisation (:func:`statements`): docstrings, comments, layout and annotations go; the function's
own arguments become ``a0, a1, ...`` by position; every other name bound inside it (locals, loop
variables, nested functions and their arguments) becomes ``_``; a global name becomes ``g`` unless
it is a builtin or a library's usual alias (``torch``, ``F``, ``math``, ``np``, ``tl``, ...).
Attribute names (``.transpose``, ``torch.softmax``), keyword names, operators and constants stay.
Each statement is then one unit (a compound statement by its header: ``for _ in range(a0)``),
weighed by its number of AST nodes. Two functions are compared as multisets of units, so the
order of statements does not count: a copy with independent lines reordered, statements added
(dead code, a print, an assert), names or arguments renamed, comments or layout changed keeps
every unit of the reference.

Thresholds (``SMALL``, ``CLOSE``, ``MIN_SAME``, ``SEED``, ``NEAR``, ``EXTRA``):

- a reference of at least ``SMALL`` (60) nodes is matched when ``CLOSE`` (70 %) of its weight is
  in the learner's function, with at least 3 of its statements unchanged. Once ``SEED`` (30 %) is
  found unchanged, a statement that is only nearly equal (difflib's ratio of their tokens at least
  ``NEAR``, 0.7: a default argument written as its value, ``8`` made ``6``) counts its similarity.
  The correct variants in other styles kept in tests/ reach at most 52 %;
- a smaller reference (23 of the 45: one to three lines) only when the learner's function holds
  *all* of it, unchanged, and at most ``EXTRA`` (2) more statements: reported as "identical to
  the reference after renaming". Course functions under ``SMALL`` other than the exercise's own
  reference (helpers it calls, forbidden helpers) are not compared.

Limits: a short reference can be written token for token by someone who never saw it (there are
few ways to write ``q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])``; 10 of the course's own
solution notebooks' answers are identical to their small references), so a flag on a small
function says "look", never "copied"; the instructor decides, and a flag keeps the score. A
formula exercise (7.3) written the natural way can also come close to a larger reference. A copy
whose statements were each rewritten (helpers inlined, another loop, an expression split in two)
is not found: units are statements, and the comparison is not a data-flow one. Code that is not a
``def`` reachable by name from a graded function (a lambda stored in a variable, ``exec``) is not
seen, and a module imported under an unusual alias reads as a global (``g``).
"""

from __future__ import annotations

import ast
import builtins
import difflib
import functools
import pickle
import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

HELPERS = Path(__file__).resolve().parent.parent
SMALL = 60  # AST nodes: below this a reference is "small" (notebook 01's weigh 14 to 60)
CLOSE = 0.7  # share of a reference's weight that makes a larger function a close copy...
MIN_SAME = 3  # ...with at least this many of its statements unchanged (all of them, when it has fewer)
SEED = 0.3  # share found unchanged before nearly equal statements are looked for
NEAR = 0.7  # token similarity (difflib's ratio) of a nearly equal statement
EXTRA = 2  # statements a small copy may add (a print, an assert) and still count as identical
LIBRARIES = frozenset({"torch", "F", "nn", "math", "np", "numpy", "tl", "triton", "functools", "itertools",
                       "collections", "operator", "einops"})
KEPT = frozenset(dir(builtins)) | LIBRARIES
_MAGIC = re.compile(r"^\s*(%%?\w|!(?!=))")  # %time, %%capture, !pip (not a line that starts with != or % x)
_TOKEN = re.compile(r"\w+|[^\w\s]")


class Ref(NamedTuple):
    """One course function a notebook may not copy: ``label`` says where it is (``nb01_qkv_shapes.merge_heads``),
    ``main`` whether it is the exercise's own reference (rather than a function it calls or a forbidden helper)."""

    label: str
    node: ast.FunctionDef
    main: bool


# --------------------------------------------------------------------------- the course's side


@functools.cache
def _module(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def _lesson_paths() -> list[Path]:
    return sorted(HELPERS.glob("nb[0-9][0-9]_*.py"))


def _top_defs(tree: ast.Module) -> dict[str, ast.AST]:
    """Functions and classes defined at the top of a module or notebook, also inside top-level
    ``if``/``try``/``with`` blocks (``if triton is not None:``); a later definition wins."""
    found: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found[node.name] = node
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            found.update(_top_defs(ast.Module(body=[s for part in _blocks(node) for s in part], type_ignores=[])))
    return found


def _blocks(node: ast.AST) -> list[list[ast.stmt]]:
    """The statement lists directly inside a compound statement."""
    parts = [getattr(node, f, []) for f in ("body", "orelse", "finalbody")]
    parts += [h.body for h in getattr(node, "handlers", [])]
    return [p for p in parts if isinstance(p, list)]


def _functions(node: ast.AST) -> list[ast.FunctionDef]:
    """A function itself, or the methods of a class."""
    if isinstance(node, ast.ClassDef):
        return [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return [node]


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


@functools.cache
def _lesson_defs(stem: str) -> dict[str, ast.AST]:
    return _top_defs(_module(HELPERS / f"{stem}.py"))


@functools.cache
def _course_defs() -> dict[str, list[tuple[str, ast.AST]]]:
    """Every lesson module's top-level functions and classes, and the classes by the names of their
    methods, by name: ``[(module stem, node)]``."""
    out: dict[str, list[tuple[str, ast.AST]]] = {}
    for path in _lesson_paths():
        for name, node in _lesson_defs(path.stem).items():
            out.setdefault(name, []).append((path.stem, node))
        for node in _lesson_defs(path.stem).values():
            if isinstance(node, ast.ClassDef):
                for method in _functions(node):
                    out.setdefault(method.name, []).append((path.stem, node))
    return out


@functools.cache
def _imported(stem: str) -> dict[str, str]:
    """Names a lesson module imports from its sibling lesson modules: ``{local name: name there}``."""
    return {(a.asname or a.name): a.name for n in _module(HELPERS / f"{stem}.py").body
            if isinstance(n, ast.ImportFrom) and n.level == 1 and (n.module or "").startswith("nb")
            for a in n.names}


def _closure(stem: str, node: ast.AST) -> list[tuple[str, ast.AST]]:
    """``node`` and the course functions and classes it uses by name, transitively: defined in its
    module or imported there from another lesson module (``_launchers`` -> ``_kernels`` -> the kernels)."""
    seen: dict[int, tuple[str, ast.AST]] = {}
    todo = [(stem, node)]
    while todo:
        stem, node = todo.pop()
        if id(node) in seen:
            continue
        seen[id(node)] = (stem, node)
        local, imports = _lesson_defs(stem), _imported(stem)
        for name in sorted(_names(node)):
            if name in local:
                todo.append((stem, local[name]))
            elif name in imports:
                todo += [(s, n) for s, n in _course_defs().get(imports[name], [])]
    return list(seen.values())


@functools.cache
def forbidden_references() -> dict[str, frozenset[str]]:
    """The ``t.forbidden_references`` each check of ``helpers/checks/nbXX_*.py`` sets, read from its
    source (a set literal, or ``set(NAME)`` of a module-level one): ``{exercise name: names}``."""
    out: dict[str, frozenset[str]] = {}
    for path in sorted((HELPERS / "checks").glob("nb[0-9][0-9]_*.py")):
        tree = _module(path)
        sets = {t.id: n.value for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
                if isinstance(t, ast.Name) and isinstance(n.value, ast.Set)}
        for fn in tree.body:
            if not isinstance(fn, ast.FunctionDef) or not any(
                    isinstance(d, ast.Call) and isinstance(d.func, ast.Name) and d.func.id == "exercise"
                    for d in fn.decorator_list):
                continue
            for n in ast.walk(fn):
                if isinstance(n, ast.Assign) and any(isinstance(t, ast.Attribute) and t.attr == "forbidden_references"
                                                     for t in n.targets):
                    value = n.value
                    if isinstance(value, ast.Call) and value.args and isinstance(value.args[0], ast.Name):
                        value = sets.get(value.args[0].id, value)
                    try:
                        out[fn.name] = frozenset(ast.literal_eval(value))
                    except ValueError:
                        pass
    return out


def reference_sources(names: Iterable[str]) -> dict[str, list[Ref]]:
    """For each exercise name, the course functions a notebook may not copy: its reference (the
    function of that name in the lesson modules), the course functions and classes it uses,
    transitively (for a thin wrapper such as 9.3's: the autograd class, the launchers, the
    ``@triton.jit`` kernels), and the check's forbidden helpers (a method: its whole class)."""
    out: dict[str, list[Ref]] = {}
    for name in names:
        refs: dict[int, Ref] = {}
        starts = [(s, n, n.name == name) for s, n in _course_defs().get(name, [])]
        for other in sorted(forbidden_references().get(name, frozenset()) - {name}):
            starts += [(s, n, False) for s, n in _course_defs().get(other, [])]
        for stem, start, main in starts:
            for where, node in _closure(stem, start):
                for fn in _functions(node):
                    is_main = main and fn is start
                    label = f"{where}.{node.name}" + (f".{fn.name}" if fn is not node else "")
                    if id(fn) not in refs or is_main:
                        refs[id(fn)] = Ref(label, fn, is_main)
        out[name] = sorted(refs.values(), key=lambda r: not r.main)
    return out


# --------------------------------------------------------------------------- normalisation


class _Normaliser(ast.NodeTransformer):
    """Renames as the module docstring says; drops docstrings and annotations."""

    def __init__(self, args: dict[str, str], local: set[str]):
        self.args, self.local = args, local

    def _name(self, name: str) -> str:
        if name in self.args:
            return self.args[name]
        return "_" if name in self.local else name if name in KEPT else "g"

    def visit_Name(self, node: ast.Name) -> ast.Name:
        return ast.copy_location(ast.Name(self._name(node.id), node.ctx), node)

    def visit_arg(self, node: ast.arg) -> ast.arg:
        return ast.copy_location(ast.arg(self.args.get(node.arg, "_")), node)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.FunctionDef:
        node.name, node.returns = "_", None
        node.body = _without_docstring(node.body) or [ast.Pass()]
        return self.generic_visit(node)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node: ast.ClassDef) -> ast.ClassDef:
        node.name, node.body = "_", _without_docstring(node.body) or [ast.Pass()]
        return self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> ast.AST:
        if node.value is None:
            return None
        return self.visit(ast.copy_location(ast.Assign([node.target], node.value), node))

    def visit_Global(self, node: ast.Global) -> None:
        return None

    visit_Nonlocal = visit_Global


def _without_docstring(body: list[ast.stmt]) -> list[ast.stmt]:
    """The statements, less bare string expressions (docstrings, strings used as comments)."""
    return [s for s in body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)
                                    and isinstance(s.value.value, str))]


def _bound(fn: ast.FunctionDef) -> set[str]:
    """Names bound inside ``fn`` (not by an import: ``import numpy as np`` keeps ``np``)."""
    out = set()
    for n in ast.walk(fn):
        if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load):
            out.add(n.id)
        elif isinstance(n, ast.arg):
            out.add(n.arg)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.ExceptHandler)) and n is not fn:
            out.add(n.name)
    return out - {None}


def normalise(fn: ast.FunctionDef) -> list[ast.stmt]:
    """``fn``'s body with names replaced by placeholders (arguments ``a0, a1, ...`` by position, other
    local names ``_``, globals ``g`` unless kept), without docstrings or annotations."""
    a = fn.args
    args = [*a.posonlyargs, *a.args, *([a.vararg] if a.vararg else []), *a.kwonlyargs, *([a.kwarg] if a.kwarg else [])]
    renamer = _Normaliser({x.arg: f"a{i}" for i, x in enumerate(args)}, _bound(fn))
    fresh = pickle.loads(pickle.dumps(fn))  # a copy (3 times faster than copy.deepcopy): fn is left as it was
    body = [renamer.visit(s) for s in _without_docstring(fresh.body)]
    return [s for s in body if s is not None]


_HEADERS = {ast.If: ("test",), ast.While: ("test",), ast.For: ("target", "iter"), ast.AsyncFor: ("target", "iter"),
            ast.With: ("items",), ast.AsyncWith: ("items",), ast.Try: (), ast.FunctionDef: ("args", "decorator_list"),
            ast.AsyncFunctionDef: ("args", "decorator_list"), ast.ClassDef: ("bases", "keywords")}


def _size(parts: Iterable[ast.AST]) -> int:
    return sum(1 for p in parts for _ in ast.walk(p))


def statements(fn: ast.FunctionDef) -> Counter[str]:
    """The units of ``fn`` (one per statement, a compound one by its header), each counted with its
    weight (its number of AST nodes): ``{unit text: total weight}``."""
    units: Counter[str] = Counter()
    todo = normalise(fn)
    while todo:
        s = todo.pop()
        fields = _HEADERS.get(type(s))
        if fields is None:
            if not isinstance(s, ast.Pass):
                units[ast.unparse(s)] += _size([s])
            continue
        parts = [x for f in fields for x in (getattr(s, f) if isinstance(getattr(s, f), list) else [getattr(s, f)])]
        units[f"{type(s).__name__} " + "; ".join(ast.unparse(p) for p in parts)] += 1 + _size(parts)
        todo += [x for part in _blocks(s) for x in part]
    return units


# --------------------------------------------------------------------------- comparing


class Match(NamedTuple):
    """How much of a reference's weight a learner's function holds, and the verdict."""

    share: float  # weight found (a nearly equal unit counts its similarity) / the reference's weight
    same: int  # units of the reference found unchanged
    near: int  # units of the reference found nearly equal
    total: int  # units of the reference
    extra: int  # units of the learner's function that are not in the reference
    small: bool  # the reference weighs under SMALL
    copy: bool


def _tokens(unit: str) -> list[str]:
    return _TOKEN.findall(unit)


def _near(left: dict[str, int], candidates: list[str]) -> tuple[float, int]:
    """Weight of the reference's units ``left`` (``{unit: weight}``, not found unchanged) that have a
    nearly equal unit among ``candidates`` (token similarity at least ``NEAR``, each candidate used
    once), each counted times its similarity; and how many such units there are."""
    pool = [_tokens(c) for c in candidates]
    credit, count = 0.0, 0
    for unit, weight in left.items():
        matcher = difflib.SequenceMatcher(None, [], _tokens(unit), autojunk=False)
        best, where = 0.0, None
        for i, tokens in enumerate(pool):
            matcher.set_seq1(tokens)
            if tokens and matcher.real_quick_ratio() >= NEAR and matcher.quick_ratio() >= NEAR and matcher.ratio() > best:
                best, where = matcher.ratio(), i
        if best >= NEAR:
            credit, count = credit + weight * best, count + 1
            pool[where] = []
    return credit, count


def compare(ref: Counter[str], mine: Counter[str]) -> Match:
    """Compare a reference's units with a learner's function's (from :func:`statements`): the share
    of the reference's weight found, unchanged, or (for a larger reference that already shares
    ``SEED`` of its weight unchanged) nearly so."""
    weight = sum(ref.values()) or 1
    common = sum(min(ref[u], mine[u]) for u in ref)
    same = sum(1 for u in ref if u in mine)
    extra = sum(1 for u in mine if u not in ref)
    small = weight < SMALL
    near = 0
    if not small and SEED * weight <= common < weight:
        credit, near = _near({u: w for u, w in ref.items() if u not in mine}, [u for u in mine if u not in ref])
        common += credit
    close = common == weight and extra <= EXTRA if small else common >= CLOSE * weight and same >= min(MIN_SAME, len(ref))
    return Match(common / weight, same, near, len(ref), extra, small, close)


def parse_cells(cells: dict[int, str]) -> dict[str, tuple[int, ast.AST]]:
    """The functions and classes a notebook's code cells define at top level, run in order (the last
    definition wins): ``{name: (cell, node)}``. IPython magic lines (``%time``, ``%%capture``,
    ``!pip``) are blanked; a cell that still does not parse is skipped."""
    found: dict[str, tuple[int, ast.AST]] = {}
    for index in sorted(cells):
        source = "\n".join("" if _MAGIC.match(line) else line for line in cells[index].splitlines())
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            continue
        found.update({name: (index, node) for name, node in _top_defs(tree).items()})
        for stmt in tree.body:  # `merge_heads = my_merge`: the graded name bound to another function
            if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Name) and stmt.value.id in found:
                found.update({t.id: found[stmt.value.id] for t in stmt.targets if isinstance(t, ast.Name)})
    return found


def _reachable(name: str, defined: dict[str, tuple[int, ast.AST]], graded: set[str]) -> list[tuple[str, int, ast.AST]]:
    """The graded function ``name`` and the notebook's functions (class methods included) it uses by
    name, transitively, other graded functions left out (they are judged on their own)."""
    out, seen, todo = [], set(), [name]
    while todo:
        current = todo.pop(0)
        if current in seen or current not in defined or (current in graded and current != name):
            continue
        seen.add(current)
        cell, node = defined[current]
        out += [(current if fn is node else f"{current}.{fn.name}", cell, fn) for fn in _functions(node)]
        todo += sorted(_names(node) & set(defined))
    return out


@functools.cache
def _course_units(node: ast.FunctionDef) -> Counter[str]:
    return statements(node)


@functools.cache
def _reference_units(name: str) -> list[tuple[Ref, Counter[str]]]:
    """The units of the course functions compared for exercise ``name``: its reference, and the
    others that weigh at least ``SMALL`` (a small helper is too easily written the same way)."""
    units = [(r, _course_units(r.node)) for r in reference_sources([name])[name]]
    return [(r, u) for r, u in units if r.main or sum(u.values()) >= SMALL]


def find_copies(cells: dict[int, str], names: list[str]) -> dict[str, str]:
    """For each graded function of ``names`` defined in the notebook's code cells ``{index: source}``,
    a one-line reason for review when it (or a helper or kernel of the notebook it calls) is a close
    copy of a course function (:func:`reference_sources`); exercises with nothing to report are left out."""
    defined = parse_cells(cells)
    reasons: dict[str, str] = {}
    learners: dict[int, Counter[str]] = {}  # id(function) -> its units, computed once per notebook
    for name in names:
        best: tuple[float, str] | None = None
        for label, cell, fn in _reachable(name, defined, set(names)):
            if id(fn) not in learners:
                try:
                    learners[id(fn)] = statements(fn)
                except RecursionError:  # nested past what ast.unparse can walk: nothing to compare
                    learners[id(fn)] = Counter()
            mine = learners[id(fn)]
            for ref, units in _reference_units(name):
                match = compare(units, mine)
                if not match.copy:
                    continue
                who = name if label == name else f"{name}'s helper {label} (cell {cell})"
                if match.small:
                    added = f", plus {match.extra} statement{'s' * (match.extra > 1)}" if match.extra else ""
                    why = f"{who} is identical to the course's {ref.label} after renaming{added} (a short function: look before deciding)"
                else:
                    nearly = f", {match.near} more nearly" if match.near else ""
                    why = (f"{who} holds {match.share:.0%} of the course's {ref.label} after renaming "
                           f"({match.same} of its {match.total} statements unchanged{nearly})")
                rank = (match.share + (not match.small), why)
                best = max(best, rank) if best else rank
        if best:
            reasons[name] = best[1]
    return reasons
