"""Grade exercise notebooks: ``python -m helpers.tools.grading [PATH ...]`` (``make grade``).

PATH is a notebook, a folder of one student's notebooks, or a folder of student folders (a class).
What a notebook must contain comes from the course, not from the notebook: its ``NN_topic`` name
selects the exercises (``helpers.registry``). Every submission is read once, before any
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
import dataclasses
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
from typing import NamedTuple

import nbformat

from .. import registry
from . import DEFAULT_CELL_TIMEOUT_S, judging, sandbox
from .copies import find_copies
from .gradebook import Row, flagged, format_table, passed, write_gradebook
from .nbgrader import write_nbgrader_course  # noqa: F401 - importable from here since 0.2 (CHANGELOG)

STATUSES = ("passed", "failed", "not attempted", "error", "timed out", "missing", "not run")
START_TIMEOUT_S = 60.0  # a notebook's process setting itself up (before its first cell)
GRACE_S = 10.0  # after an interrupt, how long a notebook has to stop before it is killed
MAX_MESSAGE_BYTES = 1 << 16  # a message from the notebook's process to the grader (progress only)
MAX_MESSAGES = 10_000  # from one notebook (an honest one sends two a cell): more is a flood, and ends it
NOTEBOOK_TIMEOUT_S = 1800.0  # however many cells it has, a notebook is ended after this long
SEND_TIMEOUT_S = 30.0  # a notebook that does not read what the grader or the judge sends
RECEIVE_TIMEOUT_S = 5.0  # the rest of a message the notebook's process started to send
# Imported once by the fork server; every judge starts with them loaded (the notebooks run in the
# sandbox's zygote, sandbox_zygote.preload). The grading process itself does not import torch (the
# fork server and the zygote import it meanwhile): it reads the course's exercises from
# helpers.registry, and a process forked from the fork server says whether the checks import.
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


def course_notebooks() -> dict[str, list[registry.Exercise]]:
    """Course notebook stem -> its exercises, in course order (``helpers.registry``: no torch)."""
    return registry.by_notebook()


def _import_checks(conn: Connection) -> None:
    """In a process forked from the fork server: import the checks as every judge does; send back
    an empty message, or why they could not be imported."""
    try:
        from .. import checks  # noqa: F401
    except Exception as e:  # noqa: BLE001 - said by the grading process
        conn.send_bytes(_summary(e).encode())
    else:
        conn.send_bytes(b"")


def _require_checks() -> None:
    """Stop with one clear line, before any notebook runs, when the course's checks cannot be
    imported (every judge would fail). A process forked from the fork server, which imports them
    for the judges anyway, tries: this process stays without torch."""
    ctx = _context()
    reply, child_end = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_import_checks, args=(child_end,), daemon=True)
    try:
        with _anonymous_main():
            process.start()
    except (EOFError, OSError):  # the fork server ended while it imported them
        error = "the fork server ended while importing them"
    else:
        child_end.close()
        try:
            error = reply.recv_bytes().decode()
        except EOFError:
            error = "the process that imports them ended"
        process.join()
    finally:
        child_end.close()
        reply.close()
    if error:
        raise SystemExit(f"make grade: the course's checks could not be imported ({error}); "
                         "`python -c 'import helpers.checks'` shows the traceback.")


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
    """The notebooks directly in ``folder``, sorted."""
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
    """``Type: first line of the message``, for a one-line report."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}".strip().rstrip(":")


# --------------------------------------------------------------------------- one notebook, in the sandbox


def _context():
    """The fork server's context: the judges (and the checks' import test) are forked from it."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _read_cells(path: Path) -> dict[int, str]:
    """The notebook's code cells (index -> source), or :class:`UnreadableNotebook` saying why not."""
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


class _Result(NamedTuple):
    """What one exercise of a notebook came to: the judge's verdict, or why there is none."""

    status: str
    hint: str
    mistake_id: str = ""  # the failure as a class report counts it (the judge's, when it named one)
    mistake: str = ""


@dataclass
class _Processes:
    """The notebook's process and its judge, as the grader reaches them."""

    progress: Connection  # from the notebook's process: the cell it runs, how cells ended (untrusted)
    lifeline: int | None  # write end: a byte "i" interrupts the running cell; closing it ends the notebook
    judge_end: Connection | None  # the judge's end of the channel to the notebook, until the judge starts
    judge: multiprocessing.process.BaseProcess | None = None
    reports: Connection | None = None  # from the judge: the check it runs, its verdicts (trusted)
    progress_messages: int = 0  # how many the notebook's process has sent

    def start_judge(self, names: list[str], threads: int, address_space: int | None) -> None:
        """Start the judge of exercises ``names``, with a salt drawn now; it takes over ``judge_end``."""
        ctx = _context()
        reports, theirs = ctx.Pipe(duplex=False)
        self.judge = ctx.Process(target=judging.judge, daemon=True, args=(
            self.judge_end, theirs, names, secrets.randbits(62) + 1, GRACE_S, threads, address_space))
        with _anonymous_main():
            self.judge.start()
        theirs.close()
        self.judge_end.close()
        self.judge_end, self.reports = None, reports

    def judge_ended(self) -> bool:
        """Whether no judge runs (none started yet, or it ended)."""
        return self.judge is None or not self.judge.is_alive()

    def interrupt(self) -> None:
        """Interrupt the cell the notebook's process runs (a KeyboardInterrupt there)."""
        if self.lifeline is not None:
            with contextlib.suppress(OSError):
                os.write(self.lifeline, b"i")

    def kill(self) -> None:
        """End the notebook's process and everything it started (the sandbox does, when its lifeline
        closes)."""
        if self.lifeline is not None:
            os.close(self.lifeline)
            self.lifeline = None

    def close(self, judge_wait_s: float) -> None:
        """End the notebook's process and every process it started, and the judge (killed if it has
        not ended within ``judge_wait_s``); close the channels."""
        self.kill()
        if self.judge is not None:
            self.judge.join(timeout=judge_wait_s)
            if self.judge.is_alive():
                self.judge.kill()
                self.judge.join()
        for channel in (self.progress, self.reports, self.judge_end):
            if channel is not None:
                channel.close()


@dataclass
class _Clock:
    """The notebook's time: its deadline, and the step it is at (setting up, a cell, a check) since when."""

    deadline: float  # when the notebook is ended whatever it says (no message moves it)
    began: float = field(default_factory=time.monotonic)
    step: tuple[str, object] = ("start", None)  # ("start", None), ("cell", index) or ("check", name or None)
    step_began: float = field(default_factory=time.monotonic)
    interrupted_at: float | None = None  # when the step ran past its limit (a cell is interrupted then)
    past_deadline: bool = False

    def enter(self, step: tuple[str, object]) -> None:
        """The notebook (or its judge) moved on to ``step``: its time limit starts now."""
        self.step, self.step_began, self.interrupted_at = step, time.monotonic(), None


@dataclass
class _Outcome:
    """What the grader learnt of the notebook: how its cells ended (from its process), the judge's
    verdicts, and what a grader should look at by hand."""

    cell_errors: dict[int, str] = field(default_factory=dict)  # cell index -> the exception it raised
    timed_out_cells: set[int] = field(default_factory=set)
    crash: str = ""  # why the notebook's process could not run the cells
    cpu_s: float = 0.0  # the CPU seconds the notebook's process said it used
    verdicts: dict[str, _Result] = field(default_factory=dict)  # exercise name -> the judge's verdict
    review: list[str] = field(default_factory=list)

    def flag(self, reason: str) -> None:
        """Mark the notebook for review (each reason once, ten at most)."""
        if reason not in self.review and len(self.review) < 10:
            self.review.append(reason)


@dataclass
class _NotebookRun:
    """One notebook being graded: what it runs, its processes, its clock and what came of it; the
    methods are the grader's side (read the messages, watch the time, end it, write its rows)."""

    sub: Submission
    code_cells: dict[int, str]  # index -> source, as handed in
    exercise_names: list[str]  # the exercises its notebook must hold, in course order
    cell_timeout: float
    threads: int
    address_space: int | None  # its address-space limit, its judge's too
    processes: _Processes
    clock: _Clock
    outcome: _Outcome = field(default_factory=_Outcome)
    cells_done: bool = False  # the notebook's process said its cells had run, and the judge started
    judged: bool = False  # the judge said it was done, or it ended

    def advance(self) -> bool:
        """Handle what the notebook's process and the judge sent, and watch the time; True when
        the notebook is finished: judged, ended, or to be ended."""
        self._receive_progress()
        self._receive_reports()
        if self.judged or (self.processes.progress.closed and self.processes.judge_ended()):
            self._receive_reports()
            progress = self.processes.progress
            if not progress.closed and progress.poll(0.1):  # its last message: the CPU time it used
                self._receive_progress()
            return True
        return self._overdue()

    def _receive_progress(self) -> None:
        """Handle every message waiting from the notebook's process (untrusted: sizes and counts are
        capped, and no message moves its deadline); end of file means it ended."""
        processes, progress = self.processes, self.processes.progress
        while not progress.closed and progress.poll():
            processes.progress_messages += 1
            try:
                raw = progress.recv_bytes(MAX_MESSAGE_BYTES)
            except (EOFError, ConnectionResetError):
                progress.close()
                return
            except OSError:  # longer than MAX_MESSAGE_BYTES, or half sent: the stream cannot be read on
                self.outcome.flag("an oversized or unfinished message on the grader's channel")
                progress.close()
                processes.kill()
                return
            if processes.progress_messages > MAX_MESSAGES:
                self.outcome.flag(f"more than {MAX_MESSAGES} messages on the grader's channel")
                progress.close()
                processes.kill()
                return
            try:
                msg = json.loads(raw.decode())
                kind = msg["type"]
            except Exception:  # noqa: BLE001 - a malformed message is not the grader's
                self.outcome.flag("an unreadable message on the grader's channel")
                continue
            self._on_progress(kind, msg)

    def _on_progress(self, kind: object, msg: dict) -> None:
        """One message of the notebook's process: what it runs, how a cell ended, its CPU time;
        anything else, or out of order, marks it for review."""
        clock, outcome = self.clock, self.outcome
        index = msg.get("index")
        own_cell = isinstance(index, int) and index in self.code_cells  # a forged index may be any JSON value
        if kind == "cell" and not self.cells_done and own_cell and (
                clock.step[0] != "cell" or index > clock.step[1]):  # cells run in order: no clock reset
            clock.enter(("cell", index))
        elif kind == "cell_error" and not self.cells_done and own_cell:
            if msg.get("kind") == "timed out" or index in outcome.timed_out_cells:
                outcome.timed_out_cells.add(index)
            else:
                outcome.cell_errors[index] = str(msg.get("error", ""))[:300]
        elif kind == "cells_done" and not self.cells_done:
            self.cells_done = True
            self.processes.start_judge(self.exercise_names, self.threads, self.address_space)
            clock.enter(("check", None))
        elif kind == "crash" and not self.cells_done:
            outcome.crash = str(msg.get("error", ""))[:300]
        elif kind == "usage" and self.cells_done:
            try:
                outcome.cpu_s = max(0.0, min(float(msg.get("cpu_s", 0.0)), 1e6))
            except (TypeError, ValueError):
                pass
        else:
            outcome.flag(f"a forged or out-of-order '{str(kind)[:20]}' message on the grader's channel")

    def _receive_reports(self) -> None:
        """Handle every message from the judge (trusted: it never ran the notebook's code)."""
        reports = self.processes.reports
        while reports is not None and not self.judged and reports.poll():
            try:
                msg = json.loads(reports.recv_bytes().decode())
            except EOFError:
                self.judged = True
                return
            kind = msg["type"]
            if kind == "check":
                self.clock.enter(("check", msg["name"]))
            elif kind == "result":
                status = msg["status"] if msg["status"] in STATUSES else "error"
                self.outcome.verdicts[msg["name"]] = _Result(
                    status, str(msg.get("hint", ""))[:2000], str(msg.get("mistake_id", ""))[:120],
                    str(msg.get("mistake", ""))[:200])
            elif kind == "review":
                for reason in msg["reasons"]:
                    self.outcome.flag(reason)
            elif kind == "done":
                self.judged = True

    def _overdue(self) -> bool:
        """Interrupt a cell that runs past the limit; True for a notebook to end: one that does not
        stop after that (a check is ended at once), and any at its deadline, whatever it sent."""
        clock, now = self.clock, time.monotonic()
        if now > clock.deadline:
            clock.past_deadline = True
            return True
        limit = max(self.cell_timeout, START_TIMEOUT_S) if clock.step[0] == "start" else self.cell_timeout
        if clock.interrupted_at is None and now - clock.step_began > limit:
            clock.interrupted_at = now
            if clock.step[0] == "cell":
                self.outcome.timed_out_cells.add(clock.step[1])
                self.processes.interrupt()
            return False
        return clock.interrupted_at is not None and now - clock.interrupted_at > (
            GRACE_S if clock.step[0] == "cell" else 0)

    def end(self) -> None:
        """End the notebook's process and every process it started, and the judge."""
        stopped = self.clock.past_deadline or self.clock.interrupted_at is not None
        self.processes.close(judge_wait_s=0 if stopped else 2)

    def rows(self, unsafe: str = "") -> list[Row]:
        """The rows of the finished notebook; ``unsafe``: a review note every row gets (the sandbox
        could not isolate the notebook)."""
        copies = find_copies(self.code_cells, self.exercise_names)
        review = "; ".join([*([unsafe] if unsafe else []), *self.outcome.review, *copies.values()])
        return [_row(self.sub, ex, self._result(ex.name), review) for ex in course_notebooks()[self.sub.stem]]

    def _result(self, name: str) -> _Result:
        """What the judge decided of exercise ``name``, else why there is no verdict."""
        clock = self.clock
        if name in self.outcome.verdicts:
            verdict = self.outcome.verdicts[name]
            return verdict._replace(**self._why_missing(name)) if verdict.status == "missing" else verdict
        if clock.past_deadline:
            allowed = clock.deadline - clock.began
            return _Result("timed out", f"the notebook ran past its deadline ({allowed:.0f} s for its cells "
                                        "and checks) and was ended.")
        if clock.step == ("check", name) and clock.interrupted_at is not None:
            return _Result("timed out",
                           f"the check did not finish within {self.cell_timeout:g} s and was stopped.")
        if clock.step == ("check", name):
            return _Result("error", "the grading stopped while checking this function (a crash of the "
                                    "grader's process).")
        if self.outcome.crash:
            return _Result("error", f"the grader could not run the notebook: {self.outcome.crash}")
        if not self.cells_done and clock.step[0] == "cell":
            index = clock.step[1]
            timed_out = clock.interrupted_at is not None
            why = "ran past the time limit and did not stop" if timed_out else "ended the process"
            cell = f"cell {index + 1} (`{_first_line(self.code_cells.get(index, ''))}`)"
            return _Result("timed out" if timed_out else "error", f"{cell} {why}; nothing after it ran.")
        return _Result("not run", "the grading ended before this check ran.")

    def _why_missing(self, name: str) -> dict[str, str]:
        """The status and hint of exercise ``name``, which the notebook did not define when its cells
        had run: a cell that defines it timed out or raised, it was deleted, or it was never written."""
        pattern = re.compile(DEFINES.format(name=re.escape(name)), re.M)
        defining = [i for i, s in self.code_cells.items() if pattern.search(s)]
        for i in reversed(defining):
            where = f"cell {i + 1} (`{_first_line(self.code_cells[i])}`)"
            if i in self.outcome.timed_out_cells:
                return {"status": "timed out", "hint": f"{where} ran longer than the {self.cell_timeout:g} "
                                                       f"s limit and was interrupted, so `{name}` was never "
                                                       "defined."}
            if i in self.outcome.cell_errors:
                raised = self.outcome.cell_errors[i]
                return {"status": "error", "hint": f"{where} raised {raised}, so `{name}` was never defined."}
        if defining:
            return {"status": "missing",
                    "hint": f"`{name}` was not defined when the notebook ended (was it deleted with `del`?)."}
        return {"status": "missing",
                "hint": f"no function named `{name}`: its exercise cell was deleted or the function renamed."}


# A cell that defines ``name`` (a def, decorated or not, or an assignment): where a missing function went.
DEFINES = r"^(?:\s*@.*\n)*\s*(?:async\s+)?def\s+{name}\s*\(|^\s*{name}\s*=(?!=)"


def _timeval(seconds: float) -> bytes:
    """A socket option's ``struct timeval`` of whole ``seconds``."""
    return struct.pack("ll", int(seconds), 0)


def _socketpair() -> tuple[socket.socket, socket.socket]:
    """A channel to the notebook's process: the first end is the grader's (or the judge's), which a
    notebook that does not read, or sends half a message, cannot block for long."""
    ours, theirs = socket.socketpair()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(SEND_TIMEOUT_S))
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(RECEIVE_TIMEOUT_S))
    return ours, theirs


def _launch(zygote: sandbox.Zygote | None, sub: Submission, cell_timeout: float,
            threads: int) -> _NotebookRun | list[Row]:
    """Start grading one submission: its process, forked by the sandbox's zygote, gets its code cells
    (not the cells that only call an exercise's check: the judge runs those); or, when nothing can
    run (not handed in, unreadable, the sandbox stopped), its rows."""
    exercises = course_notebooks()[sub.stem]
    if sub.path is None:
        return [_row(sub, ex, _Result("missing", "notebook not handed in.")) for ex in exercises]
    if sub.unreadable:
        return [_row(sub, ex, _Result("error", sub.unreadable)) for ex in exercises]
    code_cells = sub.cells or {}
    checked = registry.by_name()
    to_run = [(i, s) for i, s in code_cells.items()
              if not ((m := CHECK_CELL.match(s)) and m.group(1) in checked)]
    steps = len(to_run) + len(exercises)  # its cells and its checks, each within cell_timeout
    ours, theirs = _socketpair()
    judge_end, notebook_end = _socketpair()
    life_r, life_w = os.pipe()
    try:
        zygote.spawn(sub.stem, threads, theirs.fileno(), notebook_end.fileno(), life_r,
                     cpu_s=int((START_TIMEOUT_S + cell_timeout * steps) * threads) + 60)
    except OSError as e:  # the sandbox's zygote ended: this notebook (and the next) cannot run
        for end in (ours, judge_end):
            end.close()
        os.close(life_w)
        stopped = _Result("error", f"the grader's sandbox stopped ({e.strerror or e}); nothing ran.")
        return [_row(sub, ex, stopped) for ex in exercises]
    finally:
        for s in (theirs, notebook_end):
            s.close()
        os.close(life_r)
    deadline = time.monotonic() + min(START_TIMEOUT_S + cell_timeout * steps + 2 * GRACE_S,
                                      max(NOTEBOOK_TIMEOUT_S, START_TIMEOUT_S + cell_timeout))
    processes = _Processes(Connection(ours.detach()), life_w, Connection(judge_end.detach()))
    run = _NotebookRun(sub, code_cells, [ex.name for ex in exercises], cell_timeout, threads,
                       zygote.limits.get("address_space"), processes, _Clock(deadline))
    try:
        run.processes.progress.send_bytes(json.dumps({"cells": to_run}).encode())
    except OSError as e:
        run.outcome.crash = f"the notebook's process did not take its cells ({e.strerror or e})"
        run.processes.kill()
    return run


# The sandbox's zygote of each kind, kept for this process's next grading (as the fork server is):
# it runs no notebook code, and each notebook's process is isolated from it and from the others.
_ZYGOTES: dict[str, sandbox.Zygote] = {}

# What a failure the judge did not decide is counted as in a class report (``not-recognised-<what>``).
_UNJUDGED = {"timed out": "time-limit", "error": "crash"}


def _row(sub: Submission, ex: registry.Exercise, result: _Result, review: str = "") -> Row:
    """The gradebook's row of exercise ``ex`` of ``sub``."""
    mistake_id, mistake = result.mistake_id, result.mistake
    if not mistake_id and result.status in _UNJUDGED:
        what = _UNJUDGED[result.status]
        mistake_id, mistake = f"{ex.id}/not-recognised-{what}", f"not recognised: {what.replace('-', ' ')}"
    return Row(sub.stem, ex.id, ex.name, ex.points, result.status, result.hint, ex.bonus, sub.student, review,
               mistake_id, mistake)


def _first_line(source: str) -> str:
    """A cell's first line of code (not a comment), cut to 50 characters: how a hint names the cell."""
    line = next((ln.strip() for ln in source.splitlines() if ln.strip() and not ln.strip().startswith("#")), "")
    return line if len(line) <= 50 else line[:47] + "..."


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
            zygote.launch()  # it imports torch while the fork server imports the checks
        except OSError:
            zygote.close()
            raise
    elif zygote is not None:
        zygote.limits = limits or default_limits(jobs)
    unsafe = _unsafe_note(where)
    if stats is not None:
        stats["sandbox"] = where
    # Notebooks worth more points usually take longer: start them first, so that no core idles
    # at the end waiting for one long notebook (the rows keep the order of ``subs``).
    weight = {stem: sum(ex.points for ex in exs) for stem, exs in course_notebooks().items()}
    pending = sorted(subs, key=lambda s: (s.path is not None, weight.get(s.stem, 0)))
    running: list[_NotebookRun] = []
    by_sub: dict[int, list[Row]] = {}
    bar = tqdm(total=len(subs), unit="nb", desc="grading", disable=True if progress is False else None,
               file=sys.stderr, dynamic_ncols=True)
    try:
        if fresh:
            try:
                _require_checks()
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
                started = _launch(zygote, sub, cell_timeout, threads)
                if isinstance(started, list):
                    by_sub[id(sub)] = started
                    bar.update()
                else:
                    running.append(started)
            if not running:
                continue
            waits = [r.processes.progress for r in running if not r.processes.progress.closed]
            waits += [r.processes.reports for r in running
                      if r.processes.reports is not None and not r.judged]
            wait(waits, timeout=0.5)
            for r in list(running):
                if r.advance():
                    r.end()
                    by_sub[id(r.sub)] = r.rows(unsafe)
                    if stats is not None:
                        stats["cpu_s"] = stats.get("cpu_s", 0.0) + r.outcome.cpu_s
                    running.remove(r)
                    bar.update()
    finally:
        for r in running:
            r.end()
        bar.close()
    # every row says where its notebook was graded
    return [dataclasses.replace(row, sandbox=where.kind) for sub in subs for row in by_sub[id(sub)]]


def _unsafe_note(where: sandbox.Isolation) -> str:
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
    args = parser.parse_args(argv)
    if (args.anonymise or args.gradescope) and not args.report:
        parser.error("--anonymise and --gradescope go with --report DIR")
    start = time.perf_counter()
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
        from .class_report import repository, write_report

        began = time.perf_counter()
        try:  # titles and sections: class_report.course_info(), from the registry
            written = write_report(rows, args.report, args.anonymise, args.gradescope, repo=repository())
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
