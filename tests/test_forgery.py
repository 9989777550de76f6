"""Forgeries of a graded notebook, one test per kind (issue 18): the result channel, the check's own
objects, the expected values, the reference run elsewhere (renamed, in a thread, in another
process), probing the checks for a lookup table, and rewriting the gradebook after the grader.

Each forgery is a blank notebook 01 (the honest work earns 0/3) with cells appended that try to
earn the marks anyway. ``make grade`` must fail them or mark them for review (``Row.review``),
and a notebook with honest habits (a checkpoint saved with torch.save and pickle) must keep full
marks with an empty review. See the README's "What make grade promises" for the threat model.
"""

from __future__ import annotations

import ast
import csv
import inspect
import subprocess
import sys
import time

import nbformat
import pytest

from helpers import reference
from helpers.checks import EXERCISES
from helpers.checks.core import run_check
from helpers.tools.gradebook import format_table
from helpers.tools.grading import Submission, grade
from tests.test_grading import ROOT, _append, _by_name, _notebook

pytestmark = pytest.mark.slow

WRONG_MERGE = '''
def merge_heads(o):
    B, H, T, d_k = o.shape
    return o.reshape(B, T, H * d_k)
'''
FORGERIES = {
    # -- the result channel
    "channel_flooded": '''
import gc, json
from multiprocessing.connection import Connection
for o in gc.get_objects():
    if isinstance(o, Connection) and not o.closed:
        for name in ("qkv_projection", "merge_heads", "scaled_dot_product_attention"):
            o.send_bytes(json.dumps({"type": "result", "name": name, "status": "passed", "hint": ""}).encode())
''',
    "channel_rewritten": '''
import io, torch
import multiprocessing.connection as mc
_send = mc.Connection.send_bytes
def send_bytes(self, buf, *args, **kwargs):
    try:
        msg = torch.load(io.BytesIO(bytes(buf)), weights_only=True)
        if isinstance(msg, dict) and "status" in msg:
            msg.update(status="ok", out=None, obs=None, review=[])
            b = io.BytesIO(); torch.save(msg, b); buf = b.getvalue()
    except Exception:
        pass
    return _send(self, buf, *args, **kwargs)
mc.Connection.send_bytes = send_bytes
''' + WRONG_MERGE,
    # -- the check's own objects
    "check_objects": '''
import torch, helpers.checks
from helpers.checks import feedback, guard, CheckFailed
feedback.add_recorder(lambda result: setattr(result, "status", "passed"))
for snapshots in (guard._GUARD.modules, guard._GUARD.classes, guard._GUARD.functions):
    snapshots.clear()
torch.allclose = lambda *a, **k: True
_lib = torch.library.Library("aten", "IMPL")
_lib.impl("isclose", lambda a, b, rtol=1e-05, atol=1e-08, equal_nan=False: torch.ones(torch.broadcast_shapes(a.shape, b.shape), dtype=torch.bool), "CPU")
class Passed(CheckFailed):
    status = "passed"
def scaled_dot_product_attention(q, k, v):
    e = Passed("passed", "passed")
    e.exercise = helpers.checks.EXERCISES["scaled_dot_product_attention"]
    raise e
''' + WRONG_MERGE,
    # -- the expected values
    "expected_values": '''
import gc, sys, torch
def merge_heads(o):
    B, H, T, d_k = o.shape
    frame = sys._getframe()
    while frame is not None:
        for value in list(frame.f_locals.values()):
            for v in (value if isinstance(value, (list, tuple)) else [value]):
                if isinstance(v, torch.Tensor) and tuple(v.shape) == (B, T, H * d_k):
                    return v.clone()
        frame = frame.f_back
    for holder in gc.get_referrers(o):
        pass
    return o.reshape(B, T, H * d_k)
''',
    # -- the reference, run elsewhere
    "reference_renamed": '''
import types, helpers.reference as R
merge_heads = types.FunctionType(R.merge_heads.__code__.replace(co_name="mine"), R.merge_heads.__globals__, "merge_heads")
''',
    "reference_in_a_thread": '''
import queue, threading, helpers.reference as R
jobs, answers = queue.Queue(), queue.Queue()
def worker():
    while True:
        answers.put(R.merge_heads(jobs.get()))
threading.Thread(target=worker, daemon=True).start()
def merge_heads(o):
    jobs.put(o)
    return answers.get()
''',
    "reference_in_a_raw_thread": '''
import _thread, queue, helpers.reference as R
jobs, answers = queue.Queue(), queue.Queue()
def worker():
    while True:
        answers.put(R.merge_heads(jobs.get()))
_thread.start_new_thread(worker, ())
def merge_heads(o):
    jobs.put(o)
    return answers.get()
''',
    "reference_in_a_process": '''
import os, socket, pickle, helpers.reference as R
mine, theirs = socket.socketpair()
if os.fork() == 0:
    while True:
        o = pickle.loads(theirs.recv(1 << 20))
        theirs.sendall(pickle.dumps(R.merge_heads(o)))
def merge_heads(o):
    mine.sendall(pickle.dumps(o))
    return pickle.loads(mine.recv(1 << 20))
''',
    # -- probing the check for its inputs
    "lookup_table": '''
import helpers.reference as R
table = {}
def probe(o):
    out = R.merge_heads(o)
    table[o.numpy().tobytes()] = out
    return out
try:
    checks.merge_heads(probe)
except Exception:
    pass
def merge_heads(o):
    key = o.numpy().tobytes()
    B, H, T, d_k = o.shape
    return table[key].clone() if key in table else o.reshape(B, T, H * d_k)
''',
}


@pytest.fixture(scope="module")
def forged(tmp_path_factory) -> dict:
    """Every forgery and the honest notebook graded once, together: {name: {exercise: row}}."""
    root = tmp_path_factory.mktemp("forgeries")
    notebooks = {name: _append(_notebook("01_qkv_shapes", "exercises"), code) for name, code in FORGERIES.items()}
    notebooks["honest_checkpoint"] = _append(_notebook("01_qkv_shapes"), (
        "import pickle, torch\ntorch.save({'w': torch.randn(3, 3)}, 'checkpoint.pt')\n"
        "blob = pickle.dumps(torch.randn(2))\nreloaded = torch.load('checkpoint.pt')"))
    subs = []
    for name, nb in notebooks.items():
        (root / name).mkdir()
        nbformat.write(nb, root / name / "01_qkv_shapes.ipynb")
        subs.append(Submission(name, "01_qkv_shapes", root / name / "01_qkv_shapes.ipynb"))
    rows = grade(subs, jobs=2, cell_timeout=120, progress=False)
    return {name: _by_name([r for r in rows if r.student == name]) for name in notebooks}


def _table(rows: dict) -> str:
    return format_table(list(rows.values())) + "\nreview: " + next(iter(rows.values())).review


def test_an_honest_notebook_that_saves_a_checkpoint_keeps_full_marks_and_no_review(forged):
    rows = forged["honest_checkpoint"]
    assert {r.status for r in rows.values()} == {"passed"}, _table(rows)
    assert all(r.review == "" for r in rows.values()), _table(rows)


@pytest.mark.parametrize("name", ["channel_flooded", "channel_rewritten"])
def test_rewriting_what_the_notebook_sends_earns_nothing(forged, name):
    rows = forged[name]
    assert not any(r.status == "passed" for r in rows.values()), _table(rows)
    if name == "channel_flooded":  # forged messages on the grader's channel are named
        assert "forged" in rows["merge_heads"].review and "gc.get_objects" in rows["merge_heads"].review, _table(rows)


def test_patching_the_checks_objects_in_the_notebook_changes_no_verdict(forged):
    rows = forged["check_objects"]
    assert rows["merge_heads"].status == "failed" and "transpose" in rows["merge_heads"].hint, _table(rows)
    assert rows["scaled_dot_product_attention"].status != "passed", _table(rows)
    assert rows["qkv_projection"].status == "not attempted", _table(rows)
    review = rows["merge_heads"].review
    assert "snapshots" in review and "torch.allclose" in review and "isclose" in review, _table(rows)


def test_expected_values_are_not_in_the_notebooks_process_and_looking_for_them_is_flagged(forged):
    rows = forged["expected_values"]
    assert rows["merge_heads"].status == "failed", _table(rows)
    review = rows["merge_heads"].review
    assert "sys._getframe" in review and "gc.get_referrers" in review, _table(rows)


@pytest.mark.parametrize(("name", "reason"), [
    ("reference_renamed", "code.__new__"),
    ("reference_in_a_thread", "thread"),
    ("reference_in_a_raw_thread", "thread"),
    ("reference_in_a_process", "process"),
])
def test_the_reference_run_elsewhere_is_flagged_for_review(forged, name, reason):
    rows = forged[name]
    assert rows["merge_heads"].status in ("passed", "failed", "error", "timed out"), _table(rows)
    assert reason in rows["merge_heads"].review, _table(rows)


def test_a_lookup_table_built_by_probing_the_check_fails(forged):
    rows = forged["lookup_table"]
    assert rows["merge_heads"].status == "failed", _table(rows)


def test_a_renamed_copy_of_a_longer_reference_is_flagged():
    """Source of the reference, every local name and the function's own name rewritten: the
    values are right, so it passes, but the check's result says to look at it."""
    tree = ast.parse(inspect.getsource(reference.grouped_query_attention))
    fn = tree.body[0]
    local = {a.arg for a in fn.args.args} | {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)
                                              and isinstance(n.ctx, ast.Store)}

    class Rename(ast.NodeTransformer):
        def visit_Name(self, node):
            return ast.copy_location(ast.Name(f"my_{node.id}", node.ctx), node) if node.id in local else node

        def visit_arg(self, node):
            node.arg = f"my_{node.arg}" if node.arg in local else node.arg
            return node

    fn.name = "my_gqa"
    namespace = dict(vars(sys.modules[reference.grouped_query_attention.__module__]))
    exec(compile(ast.fix_missing_locations(Rename().visit(tree)), "<ipython-input-1-abc>", "exec"), namespace)
    result = run_check("grouped_query_attention", namespace["my_gqa"])
    assert result.passed, result.message
    assert result.review and "matches the course's reference" in result.review[0], result.review
    assert EXERCISES["grouped_query_attention"].id == "6.2"


def test_a_process_left_behind_cannot_rewrite_the_gradebook(tmp_path):
    """The notebook starts a process in a session of its own that waits for the gradebook to appear
    and then rewrites it: it is ended before the gradebook is written, and the notebook flagged."""
    book = tmp_path / "gradebook.csv"
    later = tmp_path / "later.py"
    later.write_text(f"import os, time\nfor _ in range(2400):\n    if os.path.exists({str(book)!r}):\n        break\n"
                     f"    time.sleep(0.05)\ntime.sleep(0.5)\nopen({str(book)!r}, 'w').write('alice,01_qkv_shapes,1.1,"
                     "qkv_projection,1,1,0,passed,,')\n")
    cheat = f"import subprocess, sys\nsubprocess.Popen([sys.executable, {str(later)!r}], start_new_session=True)"
    for student in ("alice", "bob"):
        (tmp_path / "class" / student).mkdir(parents=True)
        nb = _notebook("01_qkv_shapes", "exercises")
        nbformat.write(_append(nb, cheat) if student == "alice" else nb, tmp_path / "class" / student / "01_qkv_shapes.ipynb")
    done = subprocess.run([sys.executable, "-m", "helpers.tools.grading", str(tmp_path / "class"), "--gradebook",
                           str(book), "--no-progress"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "marked for review" in done.stdout.splitlines()[-1], done.stdout + done.stderr
    time.sleep(3)  # the left-over process, had it survived, rewrites the gradebook 0.5 s after it appears
    with open(book, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 6 and {r["status"] for r in rows} == {"not attempted"}, rows
    assert all(r["review"] for r in rows if r["student"] == "alice") and not any(r["review"] for r in rows if r["student"] == "bob")
