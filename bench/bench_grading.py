"""Grading throughput: how many notebooks per second `make grade` grades a class at.

    python bench/bench_grading.py [--students 4] [-j JOBS] [--baseline] [--out helpers/results]

Builds classes in a temporary folder: every student hands in every course notebook that has
exercises, solved (solutions/: every check runs all its cases) or blank (exercises/: every check
stops at "not attempted"); one class half solved and half blank, one all solved. Then it times,
on this machine:

1. each notebook alone (solved and blank), graded through the API with the fork server already
   up: what one notebook costs;
2. each whole class through the command line (`python -m helpers.tools.grading CLASS -j JOBS`), from the
   start of the process to its exit: the figure to compare with the goal (>= 1 notebook/s on 2
   cores);
3. the class mistake report: a synthetic class of ``--report-students`` students (built from the
   wrong implementations kept in tests/, ``tests/synthetic_class.py``) graded with ``--report``:
   the grading's wall time, the report's own time (mistakes.csv, report.html, feedback and
   Gradescope files, as the grader prints it) and their ratio (goal: the report adds at most 10%);
   ``--keep-report DIR`` keeps that report (the README's demonstration is made this way);
4. with ``--baseline``, the old way for comparison: each solved notebook in a fresh Jupyter kernel
   (nbclient), one after the other.

Writes ``<out>/grading.md`` (machine, load, mix, figures). A benchmark, not a test: the machine's
other work shows in the figures, so the load average is recorded with them.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from helpers.package_data import RESULTS_DIR  # noqa: E402
from helpers.tools import notebooks as nbtools  # noqa: E402
from helpers.tools.grading import Submission, course_notebooks, grade  # noqa: E402

KEPT = "<!-- kept: what follows is kept when bench_grading.py rewrites this file -->"  # hand-written history


def graded_stems() -> list[str]:
    """Course notebooks that have exercises and a solutions notebook."""
    course = course_notebooks()
    return [p.stem for p in nbtools.notebook_paths("solutions") if p.stem in course]


def build_class(folder: Path, stems: list[str], students: int, solved: int) -> None:
    """``students`` folders of every notebook: the first ``solved`` solved, the others blank."""
    for s in range(students):
        source = "solutions" if s < solved else "exercises"
        student = folder / f"student{s:03d}_{source}"
        student.mkdir(parents=True)
        for stem in stems:
            shutil.copy(ROOT / source / f"{stem}.ipynb", student / f"{stem}.ipynb")


def per_notebook(stems: list[str]) -> dict[tuple[str, str], tuple[float, float]]:
    """(notebook, kind) -> (wall seconds, CPU seconds) of each notebook graded alone, fork server warm."""
    grade([Submission("warm-up", stems[0], ROOT / "exercises" / f"{stems[0]}.ipynb")], jobs=1, progress=False)
    out = {}
    for stem in stems:
        for kind in ("solutions", "exercises"):
            start, stats = time.perf_counter(), {}
            rows = grade([Submission(kind, stem, ROOT / kind / f"{stem}.ipynb")], jobs=1, progress=False, stats=stats)
            out[stem, kind] = (time.perf_counter() - start, stats["cpu_s"])
            statuses = ",".join(sorted({r.status for r in rows}))
            print(f"  {stem:22s} {kind:10s} {out[stem, kind][0]:6.2f} s wall {out[stem, kind][1]:6.2f} s CPU  {statuses}",
                  flush=True)
    return out


def whole_class(folder: Path, jobs: int) -> tuple[float, float, str]:
    """(wall seconds from process start to exit, CPU seconds of the notebooks' processes, score line)."""
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "helpers.tools.grading", str(folder), "-j", str(jobs), "--no-progress",
                             "--gradebook", str(folder.parent / "gradebook.csv")], cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    score = next((ln for ln in result.stdout.splitlines() if ln.startswith("score:")), result.stdout[-500:])
    cpu = re.search(r"processes used ([\d.]+) CPU-s", result.stdout)
    return seconds, float(cpu.group(1)) if cpu else float("nan"), score


def reported_class(folder: Path, jobs: int, report: Path) -> tuple[float, float, str]:
    """Grade ``folder`` with ``--report``: (wall seconds from process start to exit, seconds the
    report took inside it, score line)."""
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "helpers.tools.grading", str(folder), "-j", str(jobs), "--no-progress",
                             "--gradebook", str(report / "gradebook.csv"), "--report", str(report), "--gradescope",
                             "--anonymise"], cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    took = re.search(r"^report: .* in ([\d.]+) s$", result.stdout, re.M)
    if not took:
        raise SystemExit(f"the graded class wrote no report:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    score = next((ln for ln in result.stdout.splitlines() if ln.startswith("score:")), "")
    return seconds, float(took.group(1)), score


def baseline(stems: list[str]) -> float:
    """The previous grader's way: a fresh kernel per notebook, serially (solved notebooks)."""
    from nbclient import NotebookClient

    start = time.perf_counter()
    for stem in stems:
        nb = nbtools.read(ROOT / "solutions" / f"{stem}.ipynb")
        NotebookClient(nb, timeout=600, kernel_name="python3", allow_errors=True,
                       resources={"metadata": {"path": str(ROOT / "solutions")}}).execute(stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> int:
    from helpers.runtime import machine_name

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--students", type=int, default=4)
    parser.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--baseline", action="store_true", help="also time the fresh-kernel-per-notebook way")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--report-students", type=int, default=30, help="students of the synthetic class (0: skip)")
    parser.add_argument("--keep-report", type=Path, default=None, metavar="DIR",
                        help="keep the synthetic class's report (and gradebook) in DIR")
    args = parser.parse_args()
    stems = graded_stems()
    load = os.getloadavg()
    print(f"machine: {machine_name()}; load average {load[0]:.1f}; notebooks: {', '.join(stems)}", flush=True)
    print("each notebook alone (fork server warm):", flush=True)
    alone = per_notebook(stems)
    n = args.students * len(stems)
    mixes = {"half solved, half blank": (args.students + 1) // 2, "all solved": args.students}
    classes = {}
    for mix, solved in mixes.items():
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp) / "class"
            build_class(folder, stems, args.students, solved)
            print(f"a class of {args.students} students x {len(stems)} notebooks = {n} notebooks, {mix}, "
                  f"-j {args.jobs}:", flush=True)
            seconds, cpu, score = classes[mix] = whole_class(folder, args.jobs)
            print(f"  {seconds:.1f} s, {n / seconds:.2f} notebooks/s; {cpu / n:.2f} CPU-s per notebook ({score})",
                  flush=True)
    reported = None
    if args.report_students:
        from tests.synthetic_class import build

        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp) / "class"
            build(folder, args.report_students, seed=0)
            n_report = sum(1 for _ in folder.glob("*/*.ipynb"))
            report = args.keep_report or Path(tmp) / "report"
            if report.exists():
                shutil.rmtree(report)
            print(f"a synthetic class of {args.report_students} students ({n_report} notebooks) with --report:", flush=True)
            seconds, took, score = whole = reported_class(folder, args.jobs, report)
            reported = (n_report, *whole)
            print(f"  {seconds:.1f} s in all, the report {took:.2f} s of it: {100 * took / (seconds - took):.2f}% "
                  f"of the grading ({score})", flush=True)
            for leftover in ("pseudonym.key",):  # the demonstration's key is not kept
                (report / leftover).unlink(missing_ok=True)
    old = None
    if args.baseline:
        print("baseline: a fresh kernel per solved notebook, serially:", flush=True)
        old = baseline(stems)
        print(f"  {old:.1f} s for {len(stems)} notebooks, {len(stems) / old:.2f} notebooks/s", flush=True)
    load_after = os.getloadavg()

    args.out.mkdir(parents=True, exist_ok=True)
    lines = [
        "# Grading throughput (`python bench/bench_grading.py`)",
        "",
        f"- Machine: {machine_name()}",
        f"- Load average (1 min) before / after: {load[0]:.1f} / {load_after[0]:.1f} "
        f"(other work on the machine shows in the figures)",
        f"- Notebooks: {', '.join(stems)}",
        f"- Class: {args.students} students, each hands in all {len(stems)} notebooks ({n} notebooks): solved "
        "ones (from solutions/: every check runs all its cases) or blank ones (from exercises/: every check "
        "stops at \"not attempted\").",
        "- Timed: `python -m helpers.tools.grading CLASS -j "
        f"{args.jobs}`, from the start of the process to its exit (imports, the fork server's and the sandbox's start included).",
        "",
        "| what | notebooks | seconds | notebooks/s |",
        "|---|---|---|---|",
    ]
    tail = [""]
    for mix, (seconds, cpu, _) in classes.items():
        lines.append(f"| whole class, {mix} | {n} | {seconds:.1f} | **{n / seconds:.2f}** |")
        tail.append(f"- {mix}: the notebooks' processes used {cpu:.1f} CPU-seconds, {cpu / n:.2f} per notebook; "
                    f"on {os.cpu_count()} otherwise idle cores that bounds the rate at {os.cpu_count() * n / cpu:.2f} "
                    "notebooks/s, before the one-off start-up.")
    if reported is not None:
        n_r, seconds, took, _ = reported
        lines.append(f"| synthetic class with `--report` (mistakes.csv, report.html, feedback, Gradescope) | {n_r} | "
                     f"{seconds:.1f} | {n_r / seconds:.2f} |")
        tail.append(f"- the class report took {took:.2f} s of those {seconds:.1f} s: **{100 * took / (seconds - took):.2f}%** "
                    "of the grading's time (goal: at most 10%). The class: "
                    f"{args.report_students} students from `tests/synthetic_class.py` (seed 0), each handing in "
                    "every notebook with some exercises right, some wrong (the wrong implementations kept in "
                    "tests/) and some blank.")
    if old is not None:
        lines.append(f"| baseline: fresh Jupyter kernel per solved notebook, serially | {len(stems)} | {old:.1f} | "
                     f"{len(stems) / old:.2f} |")
    lines += tail
    lines += ["", "Each notebook alone, fork server and sandbox already up: wall seconds (CPU seconds of its process):", "",
              "| notebook | solved | blank |", "|---|---|---|"]
    for stem in stems:
        (ws, cs), (wb, cb) = alone[stem, "solutions"], alone[stem, "exercises"]
        lines.append(f"| {stem} | {ws:.2f} ({cs:.2f}) | {wb:.2f} ({cb:.2f}) |")
    path = args.out / "grading.md"
    kept = path.read_text(encoding="utf-8").partition(KEPT)[1:] if path.exists() else ("", "")
    path.write_text("\n".join(lines) + "\n" + ("\n" + "".join(kept) if kept[0] else ""), encoding="utf-8")
    print(f"wrote {args.out / 'grading.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
