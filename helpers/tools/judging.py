"""How ``make grade`` decides: the check runs in a judge process, the learner's function in the notebook's.

Two processes take part in grading one notebook after its cells have run:

- **The notebook's process** (which ran the learner's code) only *serves* calls (:func:`serve`):
  the judge sends inputs, the notebook's process runs the learner's function on them with the
  guard and the instruments (``helpers.checks.calling.protected_call``) and sends back what it
  returned, as plain data. It never sees an expected value or the seed the inputs came from.
- **The judge** (:func:`judge`), forked from the grader's fork server, never runs a line of the
  notebook. It draws the cases from a secret salt (``helpers.checks.core.salt_cases``), computes
  the expected values, runs each exercise's check with a :class:`~helpers.checks.calling.Remote`
  in place of the learner's function, and reports verdicts to the grader.

So rewriting what the notebook's process sends can at most send wrong evidence, which fails.
What only the notebook's process can observe (how a function computed, threads, processes,
audit events) is reported, and a notebook that did something a grader should look at is marked
for review (the gradebook's ``review`` column) with its score kept.
"""

from __future__ import annotations

import importlib
import json
import os
import pickle
import sys
import threading
from typing import Any

# Recorded whenever the notebook's own code does them (honest notebooks do not walk the garbage
# collector, build code objects or start processes), and ...
ALWAYS = {"gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys._current_frames", "marshal.loads",
          "code.__new__", "function.__new__", "ctypes.dlsym", "ctypes.cdata", "ctypes.addressof", "sys.addaudithook"}
# ... only while its functions are being graded (logging, warnings and tracebacks walk frames too).
AUDIT_FRAMES = ALWAYS | {"sys._getframe", "object.__getattr__", "sys.settrace", "sys.setprofile"}
FRAME_ATTRIBUTES = {"tb_frame", "gi_frame", "cr_frame", "ag_frame", "f_back"}  # object.__getattr__ that walks frames
AUDIT_PROCESSES = {"os.fork", "os.forkpty", "os.system", "subprocess.Popen", "os.posix_spawn", "os.exec",
                   "os.spawn", "os.kill", "os.killpg", "pty.spawn"}
FIRST_ASK_S = 60.0  # how long the notebook's process waits for the judge's first question
IDLE_S = 900.0  # and for any later one


def _library_dirs() -> tuple[str, ...]:
    """Where code that is not the learner's lives: Python's own library, installed packages, the course."""
    import sysconfig

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # helpers/
    dirs = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    dirs |= {os.path.abspath(p) for p in sys.path if "site-packages" in p or "dist-packages" in p}
    return tuple(sorted(d.rstrip(os.sep) + os.sep for d in dirs | {here}))


class Audit:
    """Python audit hooks (PEP 578), installed before the notebook runs and never removable from
    Python code. Whenever the notebook's own code (not a library's) walks the garbage collector or
    the threads, builds code or functions from parts, uses ctypes or starts a process, it is
    recorded (``ALWAYS``); while its functions are being graded (:meth:`arm`), frame walks and
    trace hooks too, and any new process but Triton's compiler. IPython's compiling of every cell
    and the frame walks of logging and tracebacks are not recorded."""

    def __init__(self):
        self.events: list[str] = []
        self._armed = False
        self._busy = False
        import sysconfig

        self._std = tuple(d.rstrip(os.sep) + os.sep for d in {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]})
        # Installed packages often lie inside the standard library's folder (lib/pythonX.Y/site-packages;
        # a venv's platstdlib is its own lib/pythonX.Y): their frames are not the standard library's.
        site = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
        site |= {p for p in sys.path if "site-packages" in p or "dist-packages" in p}
        self._site = tuple(os.path.abspath(d).rstrip(os.sep) + os.sep for d in site)
        self._libs = _library_dirs()
        triton_dirs = []
        try:
            import importlib.util

            spec = importlib.util.find_spec("triton")
            if spec and spec.submodule_search_locations:
                triton_dirs = [d.rstrip(os.sep) + os.sep for d in spec.submodule_search_locations]
        except Exception:  # noqa: BLE001
            pass
        self._triton = tuple(triton_dirs)
        getframe = sys._getframe
        append = self.events.append

        def hook(event: str, args: tuple) -> None:
            if self._busy or (event not in AUDIT_FRAMES and event not in AUDIT_PROCESSES) or (
                    not self._armed and event not in ALWAYS and event not in AUDIT_PROCESSES):
                return
            if event == "object.__getattr__" and (len(args) < 2 or args[1] not in FRAME_ATTRIBUTES):
                return
            self._busy = True
            try:
                frame = caller = getframe(1)
                when = "during a graded call" if self._armed else "in a cell"
                while frame is not None and frame.f_code.co_filename.startswith(self._std) \
                        and not frame.f_code.co_filename.startswith(self._site):
                    frame = frame.f_back
                if event in AUDIT_PROCESSES:
                    if not self._from(caller, self._triton) and len(self.events) < 50 and (
                            self._armed or self._learner(frame)):
                        append(f"{event} {when}")
                    return
                if self._learner(frame) and len(self.events) < 50:
                    what = f"{event}({args[1]!r})" if event == "object.__getattr__" and len(args) > 1 else event
                    where = os.path.basename(frame.f_code.co_filename)[:40]
                    append(f"{what} from the notebook's code ({where}) {when}")
            except Exception:  # noqa: BLE001 - an audit hook must never break the program it watches
                pass
            finally:
                self._busy = False

        sys.addaudithook(hook)

    def _learner(self, frame: Any) -> bool:
        """Is this the notebook's own code (not Python's library, a package, or the course)?"""
        name = frame.f_code.co_filename if frame is not None else ""
        return bool(name) and not name.startswith(self._libs) and not name.startswith("<frozen")

    @staticmethod
    def _from(frame: Any, dirs: tuple[str, ...]) -> bool:
        while frame is not None and dirs:
            if frame.f_code.co_filename.startswith(dirs):
                return True
            frame = frame.f_back
        return False

    def arm(self) -> None:
        self._armed = True

    def disarm(self) -> list[str]:
        """Stop watching closely; the events recorded since the last disarm (or since the start)."""
        self._armed = False
        return self.drain()

    def drain(self) -> list[str]:
        found, self.events[:] = list(dict.fromkeys(self.events)), []
        return found


def _threads() -> set[int]:
    """Every thread of this process that runs Python, raw ``_thread`` threads included."""
    return set(sys._current_frames()) - {threading.main_thread().ident}


def child_processes(pid: int | None = None) -> list[int]:
    """Processes that process ``pid`` (default: this one) started and that still run (Linux: read
    from /proc; elsewhere, none known)."""
    pid = os.getpid() if pid is None else pid
    found: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(p) for p in f.read().split()]
    except OSError:
        return found
    return found


def _resolve(module: str, qualname: str) -> Any:
    """A check's watcher, by name: only functions defined in ``helpers.checks``."""
    if not (module == "helpers.checks" or module.startswith("helpers.checks.")):
        raise LookupError(f"not a check's module: {module}")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def serve(conn: Any, namespace: dict, audit: Audit | None, snapshots: tuple | None = None) -> None:
    """The notebook's side: answer the judge's questions about the learner's functions until it says
    ``end`` (or goes away). Runs in the notebook's process after its cells."""
    from ..checks import feedback
    from ..checks.calling import _run_watcher, dumps, encode, exception_outcome, protected_call
    from ..checks.feedback import describe
    from ..checks.guard import is_course_reference, restore_guard, torch_canaries, verify_integrity

    send, recv, poll = conn.send_bytes, conn.recv_bytes, conn.poll
    review: list[str] = []
    try:
        if snapshots is not None and restore_guard(snapshots):
            review.append("the notebook changed the integrity guard's snapshots")
        changed = [str(c) for c in verify_integrity(restore=True)]
        wrong = torch_canaries()
        if wrong:
            review.append(f"torch's {', '.join(wrong)} give wrong answers in the notebook's process (an operator "
                          "overridden, e.g. with torch.library)")
        feedback.reset_attempts()
    except BaseException as e:  # noqa: BLE001
        changed = [f"the integrity check failed ({type(e).__name__})"]
    if changed:
        review.append(f"the notebook replaced {'; '.join(changed[:4])} (put back before grading)")
    threads = _threads()
    if threads:
        review.append(f"the notebook left {len(threads)} thread{'s' if len(threads) > 1 else ''} running after its cells")
    children = child_processes()
    if audit is not None:
        review += audit.drain()[:4]
    if children:
        review.append(f"the notebook left {len(children)} process{'es' if len(children) > 1 else ''} running "
                      "after its cells")
    functions: dict[str, Any] = {}
    wait = FIRST_ASK_S
    while poll(wait):
        wait = IDLE_S
        request = pickle.loads(recv())
        op, nonce = request.get("op"), request.get("nonce")
        reply: dict = {"nonce": nonce}
        if op == "hello":
            reply["review"] = review
        elif op == "begin":
            name = request["name"]
            fn = namespace.get(name) if type(namespace) is dict else None
            functions[name] = fn
            if fn is None:
                reply.update(present=False)
            else:
                try:
                    reply.update(present=True, callable=callable(fn), describe=describe(fn)[:80],
                                 is_reference=bool(is_course_reference(fn, name)))
                except BaseException:  # noqa: BLE001 - a hostile object; the check says it is not a function
                    reply.update(present=True, callable=False, describe="an object the check cannot inspect")
        elif op == "call":
            fn = functions.get(request["name"])
            before = _threads()
            if audit is not None:
                audit.arm()
            try:
                watcher = request.get("watcher")
                target = fn if watcher is None else _run_watcher(_resolve(*watcher), fn, request.get("options"))
                outcome = protected_call(target, request["args"], request["kwargs"], learner=fn,
                                         time_limit=float(request["time_limit"]), forbidden=list(request["forbidden"]),
                                         is_reference=bool(request["is_reference"]), watched=watcher is not None)
            except BaseException as e:  # noqa: BLE001 - an interrupt that reached here: a stopped call
                outcome = exception_outcome(e)
            events = audit.disarm() if audit is not None else []
            left = _threads() - before
            notes = list(outcome.get("review", [])) + events
            if left:
                notes.append(f"`{request['name']}` left {len(left)} thread{'s' if len(left) > 1 else ''} running")
            if outcome["status"] == "ok":
                outcome = {**outcome, "out": encode(outcome["out"]), "obs": encode(outcome["obs"])}
            reply.update(outcome, review=notes)
        elif op == "end":
            left = _threads() - threads
            reply["review"] = [f"the notebook's functions left {len(left)} threads running"] if left else []
            send(dumps(reply))
            return
        try:
            send(dumps(reply))
        except Exception as e:  # noqa: BLE001 - what cannot be sent is an answer the judge cannot read
            send(dumps({"nonce": nonce, "status": "raised", "kind": "error", "code": "",
                        "summary": f"the output could not be sent to the grader ({type(e).__name__})"}))


def judge(nb_conn: Any, out_conn: Any, names: list[str], salt: int, wait_s: float, threads: int = 1) -> None:
    """The grader's side: run each exercise's check against the notebook's process; report to the
    grader through ``out_conn`` (JSON messages: check, result, review, done). Runs in a process of
    its own, forked from the fork server: nothing of the notebook ever ran in it. ``threads``:
    torch's CPU threads (the notebook's process has as many)."""
    import torch

    from ..checks import core, feedback
    from ..checks.calling import STRAYS, Remote, RemoteBroken
    from ..checks.calling import ask as ask_notebook

    def send(msg: dict) -> None:
        out_conn.send_bytes(json.dumps(msg).encode())

    def ask(request: dict) -> dict:
        return ask_notebook(nb_conn, {**request, "nonce": os.urandom(8).hex()}, FIRST_ASK_S)

    torch.set_num_threads(threads)
    core.salt_cases(salt)
    feedback.reset_attempts()
    review: list[str] = []
    broken: RemoteBroken | None = None
    try:
        review += _texts(ask({"op": "hello"}).get("review"))
    except RemoteBroken as e:
        broken = e
    for name in names:
        send({"type": "check", "name": name})
        if broken is not None:
            send({"type": "result", "name": name, "status": "not run", "hint": f"not checked: {broken.reason}."})
            continue
        try:
            info = ask({"op": "begin", "name": name})
            if not info.get("present"):
                send({"type": "result", "name": name, "status": "missing", "hint": ""})
                continue
            remote = Remote(nb_conn, name, info, wait_s)
            result = core._CHECKS[name].evaluate(remote)
            review += result.review
            status, hint = str(result.status), str(result.hint or "")
            mistake = {"mistake_id": str(result.mistake_id or ""), "mistake": str(result.mistake or "")}
            if result.is_reference:
                status, hint = "failed", f"`{name}` is the course's own reference implementation, not yours."
                mistake = {"mistake_id": f"{core.EXERCISES[name].id}/called-the-reference",
                           "mistake": "handed in the course's own reference implementation"}
            send({"type": "result", "name": name, "status": status, "hint": hint, **mistake})
        except RemoteBroken as e:
            broken = e
            if e.channel:
                review.append(e.reason)
            send({"type": "result", "name": name, "status": e.status, "hint": f"{e.reason}."})
    if broken is None:
        try:
            review += _texts(ask({"op": "end"}).get("review"))
        except RemoteBroken as e:
            if e.channel:
                review.append(e.reason)
    if STRAYS:
        review.append(f"the notebook's process sent {len(STRAYS)} message{'s' if len(STRAYS) > 1 else ''} that "
                      "answered no question of the grader's")
    send({"type": "review", "reasons": list(dict.fromkeys(review))[:10]})
    send({"type": "done"})


def _texts(x: Any) -> list[str]:
    return [str(r)[:300] for r in x[:10]] if type(x) is list else []
