"""Grade exercise notebooks: ``python -m helpers.grading [NOTEBOOK_OR_FOLDER ...]`` (``make grade``).

Each notebook runs top to bottom in a fresh kernel with a per-cell time limit; every
``checks.<name>(...)`` call records its outcome, and the table lists each exercise the notebook
contains with its points, status (passed / failed / not attempted / error / timed out / not run)
and hint. The exit code is 0 only when every exercise passed (bonus exercises are scored apart and
never block a pass).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import nbformat

from .checks import EXERCISES
from .checks._core import GRADE_LOG_ENV

DEFAULT_CELL_TIMEOUT_S = 300


class UnreadableNotebook(Exception):
    """The file could not be read as a Jupyter notebook."""


@dataclass
class Row:
    notebook: str
    id: str
    name: str
    points: int
    status: str
    hint: str = ""
    bonus: bool = False

    @property
    def earned(self) -> int:
        return self.points if self.status == "passed" else 0


def _check_calls(source: str) -> list[str]:
    return [n for n in re.findall(r"\bchecks\.(\w+)\s*\(", source) if n in EXERCISES]


def _cell_error(cell) -> str:
    for out in cell.get("outputs", []):
        if out.get("output_type") == "error":
            return f"{out.get('ename', 'Error')}: {out.get('evalue', '')}".strip()
    return ""


def grade_notebook(path: Path, cell_timeout: int = DEFAULT_CELL_TIMEOUT_S) -> list[Row]:
    """Execute one notebook in a fresh kernel and return one row per exercise it checks."""
    from nbclient import NotebookClient

    try:
        nb = nbformat.read(path, as_version=4)
    except Exception as e:  # noqa: BLE001 - not JSON, not a notebook, a newer format...
        raise UnreadableNotebook(f"{path} is not a readable notebook ({type(e).__name__}: {str(e).strip()[:200]})") from None
    expected: list[tuple[str, int]] = []  # (exercise name, index of the cell that checks it)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            expected += [(name, i) for name in _check_calls(cell.source) if name not in {n for n, _ in expected}]
    if not expected:
        return []
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "grade.jsonl"
        log.touch()
        client = NotebookClient(
            nb, timeout=cell_timeout, kernel_name="python3", allow_errors=True, interrupt_on_timeout=True,
            resources={"metadata": {"path": str(path.parent)}},
        )
        startup_error = ""
        try:
            # The kernel's environment tells the checks where to record; its own log lines are noise here.
            client.execute(env={**os.environ, GRADE_LOG_ENV: str(log)}, stderr=subprocess.DEVNULL)
        except Exception as e:  # noqa: BLE001 - the kernel died or could not start: grade what was recorded
            startup_error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
        records: dict[str, dict] = {}
        for line in log.read_text(encoding="utf-8").splitlines():
            rec = json.loads(line)
            records[rec["name"]] = rec  # the last call of a check counts
    timed_out = {i for i, c in enumerate(nb.cells) if c.cell_type == "code" and _cell_error(c).startswith(("KeyboardInterrupt", "CellTimeoutError"))}
    rows = []
    previous_check_cell = -1
    for name, cell_index in expected:
        ex = EXERCISES[name]
        if name in records:
            status, hint = records[name]["status"], records[name]["hint"]
        elif any(previous_check_cell < i <= cell_index for i in timed_out):
            status, hint = "timed out", f"a cell ran longer than the {cell_timeout} s limit and was interrupted."
        elif _cell_error(nb.cells[cell_index]):
            status, hint = "error", f"the check cell raised {_cell_error(nb.cells[cell_index])}"
        else:
            status, hint = "not run", startup_error or "the check cell did not run."
        previous_check_cell = cell_index
        rows.append(Row(path.name, ex.id, name, ex.points, status, hint, ex.bonus))
    return rows


def format_table(rows: list[Row]) -> str:
    """A plain-text table: exercise, points, status, hint; then the score (bonus points apart)."""
    header = ("exercise", "points", "status", "hint")
    body = [(f"{r.id} {r.name}", f"{r.earned}/{r.points}" + (" bonus" if r.bonus else ""), r.status,
             r.hint.replace("\n", " ")) for r in rows]
    widths = [max(len(x[i]) for x in [header, *body]) for i in range(3)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header[:3], widths)) + "  " + header[3]]
    lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 4)
    lines += ["  ".join(c.ljust(w) for c, w in zip(row[:3], widths)) + "  " + row[3] for row in body]
    core = [r for r in rows if not r.bonus]
    bonus = [r for r in rows if r.bonus]
    score = f"score: {sum(r.earned for r in core)}/{sum(r.points for r in core)} points"
    if bonus:
        score += f" + {sum(r.earned for r in bonus)}/{sum(r.points for r in bonus)} bonus"
    passed = sum(r.status == "passed" for r in core)
    lines.append(f"{score}, {passed}/{len(core)} exercises passed")
    return "\n".join(lines)


def passed(rows: list[Row]) -> bool:
    """True when there is something to grade and every exercise that is not a bonus passed."""
    return bool(rows) and all(r.status == "passed" for r in rows if not r.bonus)


def _collect(targets: list[str]) -> list[Path]:
    paths: list[Path] = []
    for t in targets:
        p = Path(t)
        if p.is_dir():
            paths += sorted(p.glob("[0-9][0-9]_*.ipynb"))
        elif p.suffix == ".ipynb" and p.exists():
            paths.append(p)
        else:
            raise SystemExit(f"make grade: {t!r} is neither a notebook (.ipynb) nor a folder of notebooks.")
    if not paths:
        raise SystemExit(f"make grade: no NN_topic.ipynb notebooks found in {', '.join(targets)}.")
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make grade", description=__doc__.splitlines()[0])
    parser.add_argument("targets", nargs="*", default=["exercises"], help="notebooks or folders (default: exercises)")
    parser.add_argument("--cell-timeout", type=int, default=DEFAULT_CELL_TIMEOUT_S, help="seconds per cell")
    args = parser.parse_args(argv)
    rows: list[Row] = []
    unreadable = []
    for path in _collect(args.targets):
        print(f"grading {path} ...", flush=True)
        try:
            got = grade_notebook(path, args.cell_timeout)
        except UnreadableNotebook as e:
            print(f"  error: {e}")
            unreadable.append(path)
            continue
        if not got:
            print(f"  (no graded exercises in {path.name})")
        rows += got
    print(format_table(rows))
    if unreadable:
        print(f"not graded (unreadable): {', '.join(str(p) for p in unreadable)}")
    return 0 if passed(rows) and not unreadable else 1


if __name__ == "__main__":
    sys.exit(main())
