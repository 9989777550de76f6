"""How ``make grade`` decides: the check runs in a judge process, the learner's function in the notebook's.

Two processes take part in grading one notebook after its cells have run:

- **The notebook's process**, in the grader's sandbox (``helpers.tools.sandbox``), only *serves*
  calls (``helpers.checks.serving``): the judge sends inputs, it runs the learner's function on
  them and sends back what it returned, as plain data. The sandbox holds no reference, no check
  and no expected value, and the notebook never sees the seed the inputs came from.
- **The judge** (:func:`judge`), forked from the grader's fork server outside the sandbox, runs
  no code of the notebook's. It draws the cases from a secret salt (``helpers.checks.core.salt_cases``),
  computes the expected values, runs each exercise's check with a
  :class:`~helpers.checks.calling.Remote` in place of the learner's function, and reports verdicts.

What the notebook's process sends is read as data (``torch.load(weights_only=True)``, size-capped):
a notebook that rewrites its own process can at most send wrong answers. What a check observes of
how a function computes (watchers) comes from that process too, so in ``make grade`` it is advisory:
it adds review notes, it never turns a failure into a pass.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
from typing import Any

FIRST_ASK_S = 60.0  # how long the judge waits for the notebook's first answer


def judge(nb_conn: Any, out_conn: Any, names: list[str], salt: int, wait_s: float, threads: int = 1,
          memory: int | None = None) -> None:
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
    if memory:  # what it reads from the notebook is data, but data can be large: the notebook's limit
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    core.salt_cases(salt)
    feedback.reset_attempts()
    review: list[str] = []
    broken: RemoteBroken | None = None
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
            ask({"op": "end"})
        except RemoteBroken as e:
            if e.channel:
                review.append(e.reason)
    if STRAYS:
        review.append(f"the notebook's process sent {len(STRAYS)} message{'s' if len(STRAYS) > 1 else ''} that "
                      "answered no question of the grader's")
    send({"type": "review", "reasons": list(dict.fromkeys(review))[:10]})
    send({"type": "done"})
