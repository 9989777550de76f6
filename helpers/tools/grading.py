"""Grade exercise notebooks: ``python -m helpers.tools.grading [PATH ...]`` (``make grade``).

PATH is a notebook, a folder of one student's notebooks, or a folder of student folders (a class).
What a notebook must contain comes from the course, not from the notebook: its ``NN_topic`` name
selects the exercises (``EXERCISES[name].notebook``). Every submission is read once, before any
notebook runs. Each notebook runs in the grader's sandbox (``sandbox``: a process of its own, forked
by the sandbox's zygote and isolated by the operating system), its code cells in order with a
per-cell time limit and a deadline for the whole notebook (its own check cells are skipped). Then a
judge process, forked from a fork server that has imported torch and the checks once, runs each
exercise's check and calls the learner's functions in the notebook's process (``judging``):
passed / failed / not attempted / error / timed out / missing, with the check's hint, and a
``review`` note for what a grader should look at by hand (a copy of a reference, ``copies``). A
table (per notebook and per student), a gradebook CSV for a class, exit code 0 only when every
exercise that is not a bonus passed (2 when a notebook is flagged for review).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import multiprocessing
import os
import re
import secrets
import socket
import struct
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path

import nbformat

from . import DEFAULT_CELL_TIMEOUT_S, judging, sandbox
from .copies import find_copies
from .gradebook import Row, flagged, format_table, passed, write_gradebook
from .nbgrader import write_nbgrader_course

STATUSES = ("passed", "failed", "not attempted", "error", "timed out", "missing", "not run")
START_TIMEOUT_S = 60.0  # a notebook's process setting itself up (before its first cell)
GRACE_S = 10.0  # after an interrupt, how long a notebook has to stop before it is killed
MAX_MESSAGE_BYTES = 1 << 16  # a message from the notebook's process to the grader (progress only)
MAX_MESSAGES = 10_000  # from one notebook (an honest one sends two a cell): more is a flood, and ends it
NOTEBOOK_TIMEOUT_S = 1800.0  # however many cells it has, a notebook is ended after this long
SEND_TIMEOUT_S = 30.0  # a notebook that does not read what the grader or the judge sends
RECEIVE_TIMEOUT_S = 5.0  # the rest of a message the notebook's process started to send
# Imported once by the fork server; every judge starts with them loaded (the notebooks run in the
# sandbox's zygote, sandbox_zygote.preload). The grading
# process itself does not import torch: it learns the course's exercises from a forked process.
# torch._dynamo is imported by torch on first use of a dispatch mode (the checks' op log): seconds.
PRELOAD = ["helpers.tools.grading", "helpers.checks", "helpers.reference", "helpers.runtime", "helpers.nb09_triton_flash",
           "torch._dynamo", "helpers.tools.preload"]
# A code cell that only calls an exercise's check: the grader runs that check itself.
CHECK_CELL = re.compile(r"^\s*checks\.(\w+)\(\s*(\w+)\s*\)\s*;?\s*$")


class UnreadableNotebook(Exception):
    """The file could not be read as a Jupyter notebook."""


class NotACourseNotebook(Exception):
    """The file's name does not say which of the course's notebooks it answers."""




@dataclass
class Submission:
    """One notebook to grade: ``path`` None means the student did not hand it in."""

    student: str
    stem: str
    path: Path | None
    note: str = ""
    cells: dict[int, str] | None = None  # its code cells, read once before any notebook runs
    unreadable: str = ""  # why it could not be read


# --------------------------------------------------------------------------- what the course expects


@dataclass(frozen=True)
class Ex:
    """What the grader needs of one of the course's exercises (``helpers.checks.EXERCISES``)."""

    id: str
    name: str
    points: int
    notebook: str
    bonus: bool = False
    title: str = ""
    section: str = ""  # the section of notebooks/<notebook>.ipynb that teaches it


_COURSE: list[Ex] = []


def _describe(conn: Connection | None = None) -> list[Ex]:
    """The course's exercises from the checks' registry (sent as JSON through ``conn`` if given)."""
    try:
        from ..checks import EXERCISES
    except Exception as e:  # noqa: BLE001 - say why, in the grading process
        if conn is None:
            raise
        conn.send_bytes(json.dumps({"error": _summary(e)}).encode())
        return []
    found = [Ex(e.id, e.name, int(e.points), e.notebook, bool(e.bonus), e.title, e.section or "")
             for e in EXERCISES.values()]
    if conn is not None:
        conn.send_bytes(json.dumps([vars(e) for e in found]).encode())
    return found


def course_notebooks() -> dict[str, list[Ex]]:
    """Course notebook stem -> its exercises, in exercise order (``EXERCISES[name].notebook``)."""
    if not _COURSE:
        if "helpers.checks" in sys.modules:
            _COURSE[:] = _describe()
        else:  # without importing torch here: a process forked from the fork server tells
            parent, child = multiprocessing.Pipe()
            with _anonymous_main():
                process = _context().Process(target=_describe, args=(child,), daemon=True)
                process.start()
            child.close()
            try:
                described = json.loads(parent.recv_bytes().decode())
            except EOFError:
                described = {"error": "the process that imports them ended"}
            process.join()
            if isinstance(described, dict):
                raise SystemExit(f"make grade: the course's checks could not be imported ({described['error']}); "
                                 "`python -c 'import helpers.checks'` shows the traceback.")
            _COURSE[:] = [Ex(**e) for e in described]
    out: dict[str, list[Ex]] = {}
    for ex in sorted(_COURSE, key=lambda e: tuple(int(p) for p in e.id.split("."))):
        out.setdefault(ex.notebook, []).append(ex)
    return dict(sorted(out.items()))


@contextlib.contextmanager
def _anonymous_main():
    """Start processes without multiprocessing re-running the main script in each of them (it
    would, for a script without an ``if __name__ == "__main__"`` guard); they need nothing from it."""
    main = sys.modules["__main__"]
    saved = {k: main.__dict__[k] for k in ("__spec__", "__file__") if k in main.__dict__}
    main.__spec__ = None
    main.__dict__.pop("__file__", None)
    try:
        yield
    finally:
        main.__dict__.update(saved)


def identify(path: Path) -> tuple[str, str]:
    """(course notebook stem, note) for a submitted file, from its name: the exact stem, or its
    ``NN_`` number when only one course notebook has it (``Copy of 01_qkv_shapes (2).ipynb``)."""
    stems = course_notebooks()
    if path.stem in stems:
        return path.stem, ""
    numbers = re.findall(r"(?<!\d)(\d\d)_", path.stem)
    matches = sorted({s for s in stems for n in numbers if s.startswith(n + "_")})
    if len(matches) == 1:
        return matches[0], f"{path.name} graded as {matches[0]}"
    raise NotACourseNotebook(
        f"{path} is not one of the course's exercise notebooks ({', '.join(f'{s}.ipynb' for s in stems)}): "
        "name the file after the notebook it answers."
    )


def _notebooks_in(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*.ipynb") if p.is_file())


def collect(targets: Iterable[str]) -> tuple[list[Submission], list[str]]:
    """The submissions to grade and notes about files that were skipped or renamed.

    Each target is a notebook, a folder of one student's notebooks (the student is the folder's
    name), or a folder of student folders. When several students are graded, a notebook that some
    handed in and another did not is graded as missing for the latter.
    """
    found: dict[str, dict[str, Submission]] = {}  # student -> stem -> submission
    notes: list[str] = []

    def add(student: str, path: Path, explicit: bool) -> None:
        try:
            stem, note = identify(path)
        except NotACourseNotebook as e:
            if explicit:
                raise SystemExit(f"make grade: {e}") from None
            notes.append(f"skipped {e}")
            return
        mine = found.setdefault(student, {})
        if stem in mine and (mine[stem].path is None or mine[stem].path.stem == stem or path.stem != stem):
            notes.append(f"skipped {path}: {mine[stem].path} is graded as {stem}")
            return
        if stem in mine:
            notes.append(f"skipped {mine[stem].path}: {path} is graded as {stem}")
        mine[stem] = Submission(student, stem, path, note)

    for t in targets:
        p = Path(t)
        if p.is_file() and p.suffix == ".ipynb":
            add(p.resolve().parent.name, p, explicit=True)
        elif p.is_dir() and _notebooks_in(p):
            found.setdefault(p.resolve().name, {})
            for nb in _notebooks_in(p):
                add(p.resolve().name, nb, explicit=False)
        elif p.is_dir() and any(_notebooks_in(d) for d in p.iterdir() if d.is_dir()):
            for d in sorted(d for d in p.iterdir() if d.is_dir()):
                if d.name.startswith("."):
                    if _notebooks_in(d) and d.name != ".ipynb_checkpoints":
                        notes.append(f"skipped {d}: a hidden folder (its name starts with a dot)")
                    continue
                found.setdefault(d.name, {})
                for nb in _notebooks_in(d):
                    add(d.name, nb, explicit=False)
        elif p.is_dir():
            raise SystemExit(f"make grade: no notebooks found in {t} (nor in folders inside it).")
        else:
            raise SystemExit(f"make grade: {t!r} is neither a notebook (.ipynb) nor a folder of notebooks.")
    expected = sorted({stem for mine in found.values() for stem in mine})
    if not expected:
        raise SystemExit(f"make grade: no course notebooks found in {', '.join(targets)}." + "".join(f"\n  {n}" for n in notes))
    subs = []
    for student in sorted(found):
        for stem in expected if len(found) > 1 else sorted(found[student]):
            subs.append(found[student].get(stem) or Submission(student, stem, None))
    return subs, [n for s in subs if s.note for n in [s.note]] + notes


def _summary(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}".strip().rstrip(":")


# --------------------------------------------------------------------------- one notebook, in the sandbox


@dataclass
class _Running:
    sub: Submission
    conn: Connection  # from the notebook's process: its progress (untrusted)
    lifeline: int | None  # write end: a byte "i" interrupts the notebook, closing it ends the notebook
    judge_end: Connection | None  # the judge's end of the channel to the notebook, until the judge starts
    code_cells: dict[int, str]
    names: list[str]
    cell_timeout: float
    threads: int
    deadline: float  # when the notebook is ended whatever it says (no message moves it)
    memory: int | None = None  # its address-space limit, its judge's too
    started_at: float = field(default_factory=time.monotonic)
    current: tuple[str, object] = ("start", None)  # ("cell", index) or ("check", name)
    started: float = field(default_factory=time.monotonic)
    interrupted_at: float | None = None
    cells_done: bool = False
    judge: multiprocessing.process.BaseProcess | None = None
    judge_conn: Connection | None = None
    cell_errors: dict[int, tuple[str, str]] = field(default_factory=dict)
    timed_out_cells: set[int] = field(default_factory=set)
    results: dict[str, tuple[str, str, str, str]] = field(default_factory=dict)  # status, hint, mistake_id, mistake
    review: list[str] = field(default_factory=list)
    messages: int = 0
    cpu_s: float = 0.0
    crash: str = ""
    past_deadline: bool = False
    done: bool = False
    judged: bool = False


def _context():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _read_cells(path: Path) -> dict[int, str]:
    try:
        nb = nbformat.read(path, as_version=4)
        return {i: c.source for i, c in enumerate(nb.cells) if c.cell_type == "code" and isinstance(c.source, str)}
    except Exception as e:  # noqa: BLE001 - not JSON, not a notebook, a newer format...
        raise UnreadableNotebook(f"{path} is not a readable notebook ({type(e).__name__}: {str(e).strip()[:200]})") from None


def read_all(subs: list[Submission]) -> None:
    """Read every submission once, before any notebook runs (what is graded is what was handed in,
    whatever a notebook does to the files later)."""
    for sub in subs:
        if sub.path is None:
            continue
        try:
            sub.cells = _read_cells(sub.path)
        except UnreadableNotebook as e:
            sub.unreadable = str(e)


def _timeval(seconds: float) -> bytes:
    return struct.pack("ll", int(seconds), 0)


def _start(ctx, zygote: sandbox.Zygote, sub: Submission, cell_timeout: float, threads: int) -> _Running | list[Row]:
    exercises = course_notebooks()[sub.stem]
    names = [ex.name for ex in exercises]
    if sub.path is None:
        return [_row(sub, ex, "missing", "notebook not handed in.") for ex in exercises]
    if sub.unreadable:
        return [_row(sub, ex, "error", sub.unreadable) for ex in exercises]
    code = sub.cells or {}
    known = {ex.name for exs in course_notebooks().values() for ex in exs}
    run = [(i, s) for i, s in code.items() if not ((m := CHECK_CELL.match(s)) and m.group(1) in known)]
    ours, theirs = socket.socketpair()
    judge_end, notebook_end = socket.socketpair()
    for s in (ours, judge_end):  # a notebook that does not read cannot block the grader or its judge
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(SEND_TIMEOUT_S))
    # nor one that sends half a message: the grader and the judge read the rest within 5 s
    for s in (ours, judge_end):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(RECEIVE_TIMEOUT_S))
    life_r, life_w = os.pipe()
    try:
        zygote.spawn(sub.stem, threads, theirs.fileno(), notebook_end.fileno(), life_r,
                     cpu_s=int((START_TIMEOUT_S + cell_timeout * (len(run) + len(names))) * threads) + 60)
    except OSError as e:  # the sandbox's zygote ended: this notebook (and the next) cannot run
        for end in (ours, judge_end):
            end.close()
        os.close(life_w)
        return [_row(sub, ex, "error", f"the grader's sandbox stopped ({e.strerror or e}); nothing ran.")
                for ex in exercises]
    finally:
        for s in (theirs, notebook_end):
            s.close()
        os.close(life_r)
    deadline = time.monotonic() + min(START_TIMEOUT_S + cell_timeout * (len(run) + len(names)) + 2 * GRACE_S,
                                      max(NOTEBOOK_TIMEOUT_S, START_TIMEOUT_S + cell_timeout))
    r = _Running(sub, Connection(ours.detach()), life_w, Connection(judge_end.detach()), code, names, cell_timeout,
                 threads, deadline, zygote.limits.get("address_space"))
    try:
        r.conn.send_bytes(json.dumps({"cells": run}).encode())
    except OSError as e:
        r.crash = f"the notebook's process did not take its cells ({e.strerror or e})"
        _kill(r)
    return r


def _start_judge(ctx, r: _Running) -> None:
    """The notebook's cells have run: start its judge, with a salt drawn now."""
    mine, theirs = ctx.Pipe(duplex=False)
    r.judge = ctx.Process(target=judging.judge, daemon=True,
                          args=(r.judge_end, theirs, r.names, secrets.randbits(62) + 1, GRACE_S, r.threads, r.memory))
    with _anonymous_main():
        r.judge.start()
    theirs.close()
    r.judge_end.close()
    r.judge_end, r.judge_conn = None, mine
    r.current, r.started, r.interrupted_at = ("check", None), time.monotonic(), None


_SANDBOX: list[str] = []  # the kind of sandbox of this grading run (for the rows)
# The sandbox's zygote of each kind, kept for this process's next grading (as the fork server is):
# it runs no notebook code, and each notebook's process is isolated from it and from the others.
_ZYGOTES: dict[str, sandbox.Zygote] = {}

# What a failure the judge did not decide is counted as in a class report (``not-recognised-<what>``).
_UNJUDGED = {"timed out": "time-limit", "error": "crash"}


def _row(sub: Submission, ex, status: str, hint: str, review: str = "", mistake_id: str = "", mistake: str = "") -> Row:
    if not mistake_id and status in _UNJUDGED:
        what = _UNJUDGED[status]
        mistake_id, mistake = f"{ex.id}/not-recognised-{what}", f"not recognised: {what.replace('-', ' ')}"
    return Row(sub.stem, ex.id, ex.name, ex.points, status, hint, ex.bonus, sub.student, review, mistake_id, mistake,
               _SANDBOX[0] if _SANDBOX else "")


def _first_line(source: str) -> str:
    line = next((ln.strip() for ln in source.splitlines() if ln.strip() and not ln.strip().startswith("#")), "")
    return line if len(line) <= 50 else line[:47] + "..."


def _flag(r: _Running, reason: str) -> None:
    if reason not in r.review and len(r.review) < 10:
        r.review.append(reason)


def _receive(ctx, r: _Running) -> None:
    """Handle every message waiting from the notebook's process (untrusted: sizes and counts are
    capped, and no message moves its deadline); end of file means it ended."""
    while not r.conn.closed and r.conn.poll():
        r.messages += 1
        try:
            raw = r.conn.recv_bytes(MAX_MESSAGE_BYTES)
        except (EOFError, ConnectionResetError):
            r.conn.close()
            return
        except OSError:  # longer than MAX_MESSAGE_BYTES, or half sent: the stream cannot be read on
            _flag(r, "an oversized or unfinished message on the grader's channel")
            r.conn.close()
            _kill(r)
            return
        if r.messages > MAX_MESSAGES:
            _flag(r, f"more than {MAX_MESSAGES} messages on the grader's channel")
            r.conn.close()
            _kill(r)
            return
        try:
            msg = json.loads(raw.decode())
            kind = msg["type"]
        except Exception:  # noqa: BLE001 - a malformed message is not the grader's
            _flag(r, "an unreadable message on the grader's channel")
            continue
        if kind == "cell" and not r.cells_done and msg.get("index") in r.code_cells and (
                r.current[0] != "cell" or msg["index"] > r.current[1]):  # cells run in order: no clock reset
            r.current = ("cell", msg.get("index"))
            r.started, r.interrupted_at = time.monotonic(), None
        elif kind == "cell_error" and not r.cells_done and msg.get("index") in r.code_cells:
            index = msg.get("index")
            if msg.get("kind") == "timed out" or index in r.timed_out_cells:
                r.timed_out_cells.add(index)
            else:
                r.cell_errors[index] = (str(msg.get("error", ""))[:300], "")
        elif kind == "cells_done" and not r.cells_done:
            r.cells_done = True
            _start_judge(ctx, r)
        elif kind == "crash" and not r.cells_done:
            r.crash = str(msg.get("error", ""))[:300]
        elif kind == "usage" and r.cells_done:
            try:
                r.cpu_s = max(0.0, min(float(msg.get("cpu_s", 0.0)), 1e6))
            except (TypeError, ValueError):
                pass
        else:
            _flag(r, f"a forged or out-of-order '{str(kind)[:20]}' message on the grader's channel")


def _receive_judge(r: _Running) -> None:
    """Handle every message from the judge (trusted: it never ran the notebook's code)."""
    while r.judge_conn is not None and not r.judged and r.judge_conn.poll():
        try:
            msg = json.loads(r.judge_conn.recv_bytes().decode())
        except EOFError:
            r.judged = True
            return
        kind = msg["type"]
        if kind == "check":
            r.current, r.started, r.interrupted_at = ("check", msg["name"]), time.monotonic(), None
        elif kind == "result":
            status = msg["status"] if msg["status"] in STATUSES else "error"
            r.results[msg["name"]] = (status, str(msg.get("hint", ""))[:2000], str(msg.get("mistake_id", ""))[:120],
                                      str(msg.get("mistake", ""))[:200])
        elif kind == "review":
            for reason in msg["reasons"]:
                _flag(r, reason)
        elif kind == "done":
            r.judged = True


def _kill(r: _Running) -> None:
    """End the notebook's process and everything it started (the sandbox does, when its lifeline closes)."""
    if r.lifeline is not None:
        os.close(r.lifeline)
        r.lifeline = None


def _watch(r: _Running) -> None:
    """Interrupt a cell that runs past the limit; end a notebook (and its judge) that does not stop,
    and any notebook at its deadline, whatever it sent."""
    now = time.monotonic()
    if now > r.deadline:
        r.past_deadline = r.done = True
        return
    limit = max(r.cell_timeout, START_TIMEOUT_S) if r.current[0] == "start" else r.cell_timeout
    if r.interrupted_at is None and now - r.started > limit:
        r.interrupted_at = now
        if r.current[0] == "cell":
            r.timed_out_cells.add(r.current[1])
            if r.lifeline is not None:
                with contextlib.suppress(OSError):
                    os.write(r.lifeline, b"i")
    elif r.interrupted_at is not None and now - r.interrupted_at > (GRACE_S if r.current[0] == "cell" else 0):
        r.done = True


def _end(r: _Running) -> None:
    """End the notebook's process and every process it started, and the judge."""
    _kill(r)
    if r.judge is not None:
        r.judge.join(timeout=0 if r.past_deadline or r.interrupted_at is not None else 2)
        if r.judge.is_alive():
            r.judge.kill()
            r.judge.join()
    for c in (r.conn, r.judge_conn, r.judge_end):
        if c is not None:
            c.close()


def _rows(r: _Running, unsafe: str = "") -> list[Row]:
    """The rows of a finished notebook: what the judge decided, else why there is no result;
    ``unsafe``: a review note every row gets (the sandbox could not isolate the notebook)."""
    exercises = course_notebooks()[r.sub.stem]
    copies = find_copies(r.code_cells, [ex.name for ex in exercises])
    review = "; ".join([*([unsafe] if unsafe else []), *r.review, *copies.values()])
    rows = []
    for ex in exercises:
        mistake_id = mistake = ""
        if ex.name in r.results:
            status, hint, mistake_id, mistake = r.results[ex.name]
            if status == "missing":
                status, hint = _why_missing(r, ex.name)
        elif r.past_deadline:
            status, hint = "timed out", (f"the notebook ran past its deadline ({r.deadline - r.started_at:.0f} s for its "
                                         "cells and checks) and was ended.")
        elif r.current == ("check", ex.name) and r.interrupted_at is not None:
            status, hint = "timed out", f"the check did not finish within {r.cell_timeout:g} s and was stopped."
        elif r.current == ("check", ex.name):
            status, hint = "error", "the grading stopped while checking this function (a crash of the grader's process)."
        elif r.crash:
            status, hint = "error", f"the grader could not run the notebook: {r.crash}"
        elif not r.cells_done and r.current[0] == "cell":
            index = r.current[1]
            why = "ran past the time limit and did not stop" if r.interrupted_at is not None else "ended the process"
            status, hint = ("timed out" if r.interrupted_at is not None else "error"), (
                f"cell {index + 1} (`{_first_line(r.code_cells.get(index, ''))}`) {why}; nothing after it ran.")
        else:
            status, hint = "not run", "the grading ended before this check ran."
        rows.append(_row(r.sub, ex, status, hint, review, mistake_id, mistake))
    return rows


DEF = r"^(?:\s*@.*\n)*\s*(?:async\s+)?def\s+{name}\s*\(|^\s*{name}\s*=(?!=)"


def _why_missing(r: _Running, name: str) -> tuple[str, str]:
    pattern = re.compile(DEF.format(name=re.escape(name)), re.M)
    defining = [i for i, s in r.code_cells.items() if pattern.search(s)]
    for i in reversed(defining):
        where = f"cell {i + 1} (`{_first_line(r.code_cells[i])}`)"
        if i in r.timed_out_cells:
            return "timed out", f"{where} ran longer than the {r.cell_timeout:g} s limit and was interrupted, so `{name}` was never defined."
        if i in r.cell_errors:
            return "error", f"{where} raised {r.cell_errors[i][0]}, so `{name}` was never defined."
    if defining:
        return "missing", f"`{name}` was not defined when the notebook ended (was it deleted with `del`?)."
    return "missing", f"no function named `{name}`: its exercise cell was deleted or the function renamed."


def grade(subs: list[Submission], jobs: int | None = None, cell_timeout: float = DEFAULT_CELL_TIMEOUT_S,
          progress: bool | None = None, stats: dict | None = None, isolation: str | sandbox.Isolation = "auto",
          limits: dict | None = None) -> list[Row]:
    """Grade submissions in parallel (``jobs`` notebooks at once; default: the number of cores), each
    in the sandbox ``isolation`` names (``sandbox.detect``). ``stats``, if given, receives ``cpu_s``
    (the CPU seconds the notebooks' processes said they used) and ``sandbox`` (the kind, and why
    not a better one)."""
    from tqdm import tqdm

    jobs = max(1, jobs or os.cpu_count() or 1)
    threads = max(1, (os.cpu_count() or 1) // min(jobs, max(1, len(subs))))
    read_all([s for s in subs if s.cells is None and not s.unreadable])
    where = isolation if isinstance(isolation, sandbox.Isolation) else sandbox.detect(isolation)
    zygote = _ZYGOTES.get(where.kind)
    if zygote is not None and zygote.process is not None and zygote.process.poll() is not None:
        zygote = None  # it ended: start another
    fresh = zygote is None and any(s.path is not None and not s.unreadable for s in subs)
    if fresh:
        zygote = sandbox.Zygote(where, limits or default_limits(jobs))
        try:
            zygote.launch()  # it imports torch while this process learns the course and copies it
        except OSError:
            zygote.close()
            raise
    elif zygote is not None:
        zygote.limits = limits or default_limits(jobs)
    ctx = _context()
    _SANDBOX[:] = [where.kind]
    unsafe = _unsafe(where)
    if stats is not None:
        stats["sandbox"] = where
    # Notebooks worth more points usually take longer: start them first, so that no core idles
    # at the end waiting for one long notebook (the rows keep the order of ``subs``).
    weight = {stem: sum(ex.points for ex in exs) for stem, exs in course_notebooks().items()}
    pending = sorted(subs, key=lambda s: (s.path is not None, weight.get(s.stem, 0)))
    running: list[_Running] = []
    by_sub: dict[int, list[Row]] = {}
    bar = tqdm(total=len(subs), unit="nb", desc="grading", disable=True if progress is False else None,
               file=sys.stderr, dynamic_ncols=True)
    try:
        if fresh:
            try:
                zygote.build({stem: [e.name for e in exs] for stem, exs in course_notebooks().items()})
                zygote.wait_ready()
            except BaseException:
                zygote.close()
                raise
            _ZYGOTES[where.kind] = zygote
            atexit.register(zygote.close)
        while pending or running:
            while pending and len(running) < jobs:
                sub = pending.pop()
                started = _start(ctx, zygote, sub, cell_timeout, threads)
                if isinstance(started, list):
                    by_sub[id(sub)] = started
                    bar.update()
                else:
                    running.append(started)
            if not running:
                continue
            waits = [r.conn for r in running if not r.conn.closed]
            waits += [c for r in running for c in (r.judge_conn,) if c is not None and not r.judged]
            wait(waits, timeout=0.5)
            for r in list(running):
                _receive(ctx, r)
                _receive_judge(r)
                if r.judged or (r.conn.closed and (r.judge is None or not r.judge.is_alive())):
                    _receive_judge(r)
                    if not r.conn.closed and r.conn.poll(0.1):  # its last message: the CPU time it used
                        _receive(ctx, r)
                    r.done = True
                if not r.done:
                    _watch(r)
                if r.done:
                    _end(r)
                    by_sub[id(r.sub)] = _rows(r, unsafe)
                    if stats is not None:
                        stats["cpu_s"] = stats.get("cpu_s", 0.0) + r.cpu_s
                    running.remove(r)
                    bar.update()
    finally:
        for r in running:
            _end(r)
        bar.close()
    return [row for sub in subs for row in by_sub[id(sub)]]


def _unsafe(where: sandbox.Isolation) -> str:
    """The review note every row gets where the sandbox cannot keep the notebook from what it must not see."""
    if where.kind == "none":
        return f"graded without a sandbox ({where.reason}): the notebook could reach the grader and the course"
    if where.kind == "user":
        readable = sandbox.readable_secrets()
        if readable:
            return (f"the user sandbox could read the course's {', '.join(readable[:3])} (make them unreadable to "
                    "other users, or grade where bubblewrap works)")
    return ""


def default_limits(jobs: int) -> dict:
    """Each notebook's limits: resident memory (all its processes, watched) a share of the machine's
    and the address space of each process 1 GiB more (none with an NVIDIA GPU), 256 processes and
    threads, files up to 1 GiB, a private /tmp of 1 GiB."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 16 << 30
    memory = int(total * 0.8 / max(1, jobs))
    gpu = any(Path("/dev").glob("nvidia[0-9]*"))  # CUDA reserves more address space than any such limit
    return {"memory": memory, "address_space": None if gpu else max(4 << 30, memory + (1 << 30)), "processes": 256,
            "file_size": 1 << 30, "scratch_bytes": 1 << 30}


def grade_notebook(path: Path, cell_timeout: float = DEFAULT_CELL_TIMEOUT_S) -> list[Row]:
    """Grade one notebook (named after a course notebook); one row per exercise it must contain."""
    stem, _ = identify(Path(path))
    return grade([Submission(Path(path).resolve().parent.name, stem, Path(path))], jobs=1,
                 cell_timeout=cell_timeout, progress=False)


def _shard(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)/(\d+)", text)
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
        raise argparse.ArgumentTypeError(f"expected K/N with 1 <= K <= N, got {text!r}")
    return int(m.group(1)), int(m.group(2))


def gradebook_path(asked: Path | None, report: Path | None, n_students: int) -> Path | None:
    """Where the gradebook goes: where the instructor said (``--gradebook``), else into the report's
    folder, else, for a class, ``gradebook.csv`` in the current folder (which .gitignore covers)."""
    if asked or report:
        return asked or report / "gradebook.csv"
    return Path("gradebook.csv") if n_students > 1 else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m helpers.tools.grading", description=__doc__.split("\n\n")[0])
    parser.add_argument("targets", nargs="*", default=["exercises"],
                        help="notebooks, a student's folder, or a folder of student folders (default: exercises)")
    parser.add_argument("-j", "--jobs", type=int, default=None, help="notebooks graded at once (default: the number of cores)")
    parser.add_argument("--cell-timeout", type=float, default=DEFAULT_CELL_TIMEOUT_S, help="seconds per cell and per check")
    parser.add_argument("--gradebook", type=Path, default=None,
                        help="CSV to write (default: DIR/gradebook.csv with --report DIR, else gradebook.csv "
                             "in the current folder when more than one student is graded)")
    parser.add_argument("--shard", type=_shard, default=None, metavar="K/N",
                        help="grade only the K-th of N equal shares of the students (for a CI matrix or a batch system)")
    parser.add_argument("--report", type=Path, default=None, metavar="DIR",
                        help="also write the class's mistake report into DIR: mistakes.csv, report.html, "
                             "feedback/<student>/<notebook>.md (helpers.tools.class_report)")
    parser.add_argument("--anonymise", action="store_true", help="with --report: pseudonyms instead of names in "
                        "report.html")
    parser.add_argument("--gradescope", action="store_true",
                        help="with --report: also DIR/gradescope/<student>/results.json in Gradescope's format")
    parser.add_argument("--expect", default="", metavar="STEMS",
                        help="comma-separated notebooks every student must hand in (e.g. 03_masks,05_multihead): "
                             "one not handed in is graded as missing")
    parser.add_argument("--sandbox", choices=("auto", *sandbox.KINDS), default="auto",
                        help="where each notebook runs (default: the best this machine gives: namespaces with "
                             "bubblewrap, else a user of its own when root, else none, which marks every row for review)")
    parser.add_argument("--memory-gb", type=float, default=None,
                        help="each notebook's memory (resident, all its processes), in GiB (default: a share of this "
                             "machine's memory)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--nbgrader-course", type=Path, default=None, metavar="DIR",
                        help="write solutions/ as an nbgrader course in DIR (then run nbgrader there) and exit")
    args = parser.parse_args(argv)
    if (args.anonymise or args.gradescope) and not args.report:
        parser.error("--anonymise and --gradescope go with --report DIR")
    start = time.perf_counter()
    if args.nbgrader_course:
        for path in write_nbgrader_course(args.nbgrader_course, cell_timeout=args.cell_timeout):
            print(f"wrote {path}")
        print(f"next: cd {args.nbgrader_course} && nbgrader generate_assignment '*'")
        return 0
    subs, notes = collect(args.targets)
    expected = [stem.strip() for stem in args.expect.split(",") if stem.strip()]
    unknown = sorted(set(expected) - set(course_notebooks()))
    if unknown:
        parser.error(f"--expect: not course notebooks: {', '.join(unknown)} (they are: {', '.join(course_notebooks())})")
    for student in sorted({s.student for s in subs}):
        handed = {s.stem for s in subs if s.student == student}
        subs += [Submission(student, stem, None) for stem in expected if stem not in handed]
    if args.shard:
        k, n = args.shard
        students = sorted({s.student for s in subs})[k - 1 :: n]
        subs = [s for s in subs if s.student in students]
    for note in notes:
        print(f"note: {note}")
    n_students = len({s.student for s in subs})
    gradebook = gradebook_path(args.gradebook, args.report, n_students)
    blocked = next((p for p in ([gradebook, *gradebook.parents] if gradebook else []) if p.exists()), None)
    if gradebook and blocked is not None and (blocked == gradebook) == blocked.is_dir():
        parser.error(f"cannot write the gradebook to {gradebook}: {blocked} is a "
                     f"{'folder' if blocked.is_dir() else 'file'}")
    if gradebook and blocked is not None and not os.access(blocked, os.W_OK):
        parser.error(f"cannot write the gradebook to {gradebook}: {blocked} is not writable")
    print(f"grading {len(subs)} notebook{'s' if len(subs) != 1 else ''}"
          + (f" of {n_students} students" if n_students > 1 else ""), flush=True)
    stats: dict = {}
    jobs = max(1, args.jobs or os.cpu_count() or 1)
    limits = default_limits(jobs)
    limits["debug"] = os.environ.get("ATTN_GRADE_DEBUG") == "1"  # the notebooks' stderr to the grader's
    if args.memory_gb:
        limits["memory"] = int(args.memory_gb * (1 << 30))
        if limits["address_space"]:
            limits["address_space"] = max(4 << 30, limits["memory"] + (1 << 30))
    try:
        where = sandbox.detect(args.sandbox)
    except OSError as e:
        parser.error(f"--sandbox {args.sandbox}: {e}")
    print(f"sandbox: {where.kind}" + (f" ({where.reason})" if where.reason else ""), flush=True)
    try:
        rows = grade(subs, jobs, args.cell_timeout, progress=False if args.no_progress else None, stats=stats,
                     isolation=where, limits=limits)
    except OSError as e:
        print(f"make grade: {e}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - start
    print(format_table(rows))
    print(f"graded in {seconds:.1f} s (start-up included): {len(subs) / seconds:.2f} notebooks/s; "
          f"the notebooks' processes used "
          f"{stats.get('cpu_s', 0.0):.1f} CPU-s")
    if gradebook:
        try:
            write_gradebook(rows, gradebook)
        except OSError as e:
            print(f"make grade: no gradebook: cannot write {gradebook} ({e.strerror or e})", file=sys.stderr)
            return 2
        print(f"gradebook: {gradebook} ({len(rows)} rows)")
    if args.report:
        from .class_report import Info, repository, write_report

        began = time.perf_counter()
        info = {e.name: Info(e.title, e.section) for exs in course_notebooks().values() for e in exs}
        try:
            written = write_report(rows, args.report, args.anonymise, args.gradescope, info, repository())
        except (ValueError, OSError) as e:
            print(f"make grade: no report: {e}", file=sys.stderr)
            return 2
        print(f"report: {args.report / 'report.html'}, {args.report / 'mistakes.csv'} and {len(written) - 2} "
              f"more files, in {time.perf_counter() - began:.2f} s")
    reviews = flagged(rows)
    if reviews:
        print(f"make grade: {len(reviews)} notebook{'s' if len(reviews) > 1 else ''} marked for review (see above); "
              "exit 2")
        return 2
    print(verdict(rows))
    return 0 if passed(rows) else 1


def verdict(rows: list[Row]) -> str:
    """The grader's last line: how many exercises passed, and that a non-zero exit is the verdict
    (for a student's CI), not a crash."""
    graded = [r for r in rows if not r.bonus]
    done = sum(r.status == "passed" for r in graded)
    if passed(rows):
        return f"verdict: all {done} exercises passed (exit status 0)"
    return (f"verdict: {done} of {len(graded)} exercises passed, the rest are listed above. Grading finished "
            "normally: exit status 1 only tells CI that not everything has passed yet.")


if __name__ == "__main__":
    # Run as `python -m helpers.tools.grading`: use the module by its name, so that the processes forked
    # from the fork server find this module's functions by name (not `__main__`'s).
    from helpers.tools import grading

    sys.exit(grading.main())
