"""The notebook's side of ``make grade``: run its cells, then answer the judge's calls.

Runs inside the grader's sandbox (``helpers.tools.sandbox``), in the notebook's own process, from
the course copy the sandbox holds (lessons and the checks' machinery, not the checks, the
references or the grader). Two channels, both plain data: to the grader, progress (``cell``,
``cell_error``, ``cells_done``, ``crash``, ``usage``: JSON); to the judge, the learner's returned
values for the inputs the judge chose (:func:`serve`). Nothing here is trusted by the grader: a
notebook that rewrites it can at most send wrong answers or end its own grading.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
from multiprocessing.connection import Connection
from typing import Any

MAX_CELLS_BYTES = 64 << 20  # the notebook's code, as the grader sends it
FIRST_ASK_S = 60.0  # how long the notebook's process waits for the judge's first question
IDLE_S = 900.0  # and for any later one


def _summary(e: BaseException) -> str:
    try:
        text = str(e).strip()
    except Exception:  # noqa: BLE001 - a hostile __str__
        text = ""
    if isinstance(e, SyntaxError):
        text = f"{e.msg} (line {e.lineno})" if e.lineno else str(e.msg)
    return f"{type(e).__name__}: {text.splitlines()[0][:300] if text else ''}".strip().rstrip(":")


def run(grader_fd: int, judge_fd: int, threads: int) -> None:
    """Run the notebook's code cells (sent by the grader as ``{"cells": [[index, source], ...]}``),
    reporting each; then serve the judge until it ends; then report this process's CPU time."""
    conn = Connection(grader_fd)
    send = conn.send_bytes
    try:
        cells = json.loads(conn.recv_bytes(MAX_CELLS_BYTES).decode())["cells"]
        from . import feedback

        # The grader stops a cell with SIGINT. A process started in the background (a CI job, `cmd &`)
        # inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler: put it back.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ[feedback.RAISE_NOT_ATTEMPTED_ENV] = "1"  # an unattempted exercise fails, not a notice
        import torch

        torch.set_num_threads(threads)
        from IPython.core.interactiveshell import InteractiveShell
        from traitlets.config import Config

        sys.path.insert(0, os.getcwd())
        config = Config()
        config.HistoryAccessor.enabled = False  # no sqlite history: nothing shared, nothing kept
        shell = InteractiveShell.instance(config=config)
        for index, source in cells:
            send(json.dumps({"type": "cell", "index": index}).encode())
            try:
                result = shell.run_cell(source, store_history=True)
                error = result.error_before_exec or result.error_in_exec
            except BaseException as e:  # noqa: BLE001 - run_cell itself should not raise; be sure
                error = e
            if error is not None:
                kind = "timed out" if isinstance(error, KeyboardInterrupt) else "error"
                send(json.dumps({"type": "cell_error", "index": index, "kind": kind, "error": _summary(error)}).encode())
        namespace = shell.user_ns
    except BaseException as e:  # noqa: BLE001 - the set-up failed: say so
        send(json.dumps({"type": "crash", "error": _summary(e)}).encode())
        os._exit(1)
    send(json.dumps({"type": "cells_done"}).encode())
    try:
        serve(Connection(judge_fd), namespace)
    except BaseException:  # noqa: BLE001 - the judge reports a process that stopped answering
        pass
    usage = resource.getrusage(resource.RUSAGE_SELF)
    try:
        send(json.dumps({"type": "usage", "cpu_s": usage.ru_utime + usage.ru_stime}).encode())
    finally:
        os._exit(0)


def _resolve(module: str, qualname: str) -> Any:
    """A check's watcher, by name: only functions of ``helpers.checks.watchers``."""
    import importlib

    if module != "helpers.checks.watchers":
        raise LookupError(f"not a watcher's module: {module}")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def serve(conn: Any, namespace: dict) -> None:
    """Answer the judge's questions about the learner's functions until it says ``end`` (or goes
    away): ``begin`` (is ``name`` defined, callable, what is it), ``call`` (run it on these inputs,
    under the check's watcher if any, with the guard's protected call; send back what it returned,
    encoded as plain data)."""
    import pickle

    from .calling import _run_watcher, dumps, encode, exception_outcome, protected_call
    from .feedback import describe, reset_attempts

    reset_attempts()
    send, recv, poll = conn.send_bytes, conn.recv_bytes, conn.poll
    functions: dict[str, Any] = {}
    wait = FIRST_ASK_S
    while poll(wait):
        wait = IDLE_S
        request = pickle.loads(recv())  # from the judge (trusted): inputs it chose
        op, nonce = request.get("op"), request.get("nonce")
        reply: dict = {"nonce": nonce}
        if op == "begin":
            name = request["name"]
            fn = namespace.get(name)
            functions[name] = fn
            if fn is None:
                reply.update(present=False)
            else:
                try:
                    reply.update(present=True, callable=callable(fn), describe=describe(fn)[:80])
                except BaseException:  # noqa: BLE001 - a hostile object; the check says it is not a function
                    reply.update(present=True, callable=False, describe="an object the check cannot inspect")
        elif op == "call":
            fn = functions.get(request["name"])
            try:
                watcher = request.get("watcher")
                target = fn if watcher is None else _run_watcher(_resolve(*watcher), fn, request.get("options"))
                outcome = protected_call(target, request["args"], request["kwargs"], learner=fn,
                                         time_limit=float(request["time_limit"]), forbidden=list(request["forbidden"]),
                                         is_reference=False, watched=watcher is not None)
            except BaseException as e:  # noqa: BLE001 - an interrupt that reached here: a stopped call
                outcome = exception_outcome(e)
            if outcome["status"] == "ok":
                outcome = {**outcome, "out": encode(outcome["out"]), "obs": encode(outcome["obs"])}
            reply.update(outcome)
        elif op == "end":
            send(dumps(reply))
            return
        try:
            send(dumps(reply))
        except Exception as e:  # noqa: BLE001 - what cannot be sent is an answer the judge cannot read
            send(dumps({"nonce": nonce, "status": "raised", "kind": "error", "code": "",
                        "summary": f"the output could not be sent to the grader ({type(e).__name__})"}))
