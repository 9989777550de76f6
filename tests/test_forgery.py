"""Forgeries, denial of service and honest habits, graded as one class by ``make grade`` in its
sandbox (issue 30; README, "What make grade promises").

Each forgery is a blank notebook (the honest work earns nothing) with cells that try to earn marks
anyway, by kind: serving the judge itself, rewriting answers on the way out, patching the checks'
objects, looking for expected values, running the course's reference (imported, read from disk,
in a thread, a process, through TorchScript), probing the checks for a lookup table, editing the
course or the environment on disk, touching other students' work, and outliving the grader. None
may pass an exercise. Each denial-of-service notebook may end its own grading only: the other
students' rows and the gradebook stay whole. Honest habits (tqdm, thread pools, logging, prints,
plots, timing, checkpoints, DataLoader workers, comments after check calls, odd folder names) keep
full marks with an empty review. Slow: a class of ~25 notebooks, ~1 minute on 2 cores.
"""

from __future__ import annotations

import ast
import csv
import inspect
import os
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from helpers import reference
from helpers.tools import grading, sandbox
from helpers.tools.gradebook import format_table
from helpers.tools.grading import Submission, grade
from tests.test_grading import ROOT, _append, _by_name, _decopy, _notebook

pytestmark = pytest.mark.slow

MARKER = "attn-course-forgery-7f3a"  # in every file or process a forgery leaves, to look for it after
WRONG_MERGE = '''
def merge_heads(o):
    B, H, T, d_k = o.shape
    return o.reshape(B, T, H * d_k)
'''
# Code that finds every course file it can on this machine (from the repository's path, the
# environment's, the root) and execs the first definition of merge_heads it reads.
FROM_DISK = '''
import glob, os
found = None
for pattern in (REPO + "/helpers/*.py", "/**/helpers/reference.py", "/**/nb01_qkv_shapes.py", "/**/nb05_multihead.py"):
    for path in glob.glob(pattern, recursive=True):
        try:
            text = open(path).read()
        except OSError:
            continue
        if "def merge_heads" in text and "not in the grader's sandbox" not in text:
            scope = {}
            try:
                exec(compile(text, path, "exec"), scope)
            except Exception:
                continue
            found = scope.get("merge_heads")
            break
    if found:
        break
if found:
    merge_heads = found
'''.replace("REPO", repr(str(ROOT)))

FORGERIES = {
    # -- serving the judge itself and rewriting what goes out
    "channel_flooded": '''
import gc, json, socket
from multiprocessing.connection import Connection
for o in gc.get_objects():
    if isinstance(o, Connection) and not o.closed:
        for name in ("qkv_projection", "merge_heads", "scaled_dot_product_attention"):
            try:
                o.send_bytes(json.dumps({"type": "result", "name": name, "status": "passed", "hint": ""}).encode())
                o.send_bytes(json.dumps({"type": "cells_done"}).encode())
            except OSError:
                pass
''',
    "channel_rewritten": '''
import io, torch
import multiprocessing.connection as mc
_send = mc.Connection.send_bytes
def send_bytes(self, buf, *args, **kwargs):
    try:
        msg = torch.load(io.BytesIO(bytes(buf)), weights_only=True)
        if isinstance(msg, dict) and "status" in msg:
            msg.update(status="ok", review=[])
            b = io.BytesIO(); torch.save(msg, b); buf = b.getvalue()
    except Exception:
        pass
    return _send(self, buf, *args, **kwargs)
mc.Connection.send_bytes = send_bytes
''' + WRONG_MERGE,
    "serving_loop_replaced": '''
import helpers.checks.serving as serving
def serve(conn, namespace):
    import pickle
    from helpers.checks.calling import dumps, encode
    while conn.poll(60):
        request = pickle.loads(conn.recv_bytes())
        reply = {"nonce": request.get("nonce")}
        if request.get("op") == "begin":
            reply.update(present=True, callable=True, describe="a function")
        elif request.get("op") == "call":
            args = request["args"]
            reply.update(status="ok", out=encode(args[0] if args else None), obs=encode(None), review=[])
        elif request.get("op") == "end":
            conn.send_bytes(dumps(reply)); return
        conn.send_bytes(dumps(reply))
serving.serve = serve
''',
    # -- the checks' own objects, and torch, patched in the notebook's process
    "check_objects": '''
import torch
torch.allclose = lambda *a, **k: True
torch.equal = lambda *a, **k: True
_lib = torch.library.Library("aten", "IMPL")
_lib.impl("isclose", lambda a, b, rtol=1e-05, atol=1e-08, equal_nan=False: torch.ones(torch.broadcast_shapes(a.shape, b.shape), dtype=torch.bool), "CPU")
import helpers.checks
helpers.checks.merge_heads = lambda fn: print("passed")
''' + WRONG_MERGE,
    # -- the expected values (never in this process) and the judge's inputs probed in advance
    "expected_values": '''
import gc, sys, torch
def merge_heads(o):
    B, H, T, d_k = o.shape
    frame = sys._getframe()
    while frame is not None:
        for value in list(frame.f_locals.values()):
            for v in (value if isinstance(value, (list, tuple)) else [value]):
                if isinstance(v, torch.Tensor) and tuple(v.shape) == (B, T, H * d_k) and v is not o:
                    return v.clone()
        frame = frame.f_back
    for v in gc.get_objects():
        if isinstance(v, torch.Tensor) and tuple(v.shape) == (B, T, H * d_k):
            return v.clone()
    return o.reshape(B, T, H * d_k)
''',
    "lookup_table": '''
table = {}
def probe(o):
    table[o.numpy().tobytes()] = o
    return o
try:
    checks.merge_heads(probe)
except Exception:
    pass
def merge_heads(o):
    B, H, T, d_k = o.shape
    key = o.numpy().tobytes()
    return table[key].clone() if key in table else o.reshape(B, T, H * d_k)
''',
    # -- the course's reference: imported, aliased, run elsewhere, read from disk, scripted
    "reference_imported": '''
try:
    import helpers.reference as R
    merge_heads = R.merge_heads
except ImportError:
    pass
from helpers.nb01_qkv_shapes import merge_heads as course_merge
merge_heads = course_merge
''',
    "reference_in_a_thread": '''
import queue, threading
from helpers.nb05_multihead import merge_heads as course_merge
jobs, answers = queue.Queue(), queue.Queue()
def worker():
    while True:
        o = jobs.get()
        try:
            answers.put(course_merge(o))
        except Exception as e:
            answers.put(e)
threading.Thread(target=worker, daemon=True).start()
def merge_heads(o):
    jobs.put(o)
    out = answers.get()
    if isinstance(out, Exception):
        raise out
    return out
''',
    "reference_in_a_process": '''
import os, socket, pickle
from helpers.nb01_qkv_shapes import merge_heads as course_merge
mine, theirs = socket.socketpair()
if os.fork() == 0:
    while True:
        o = pickle.loads(theirs.recv(1 << 20))
        try:
            theirs.sendall(pickle.dumps(course_merge(o)))
        except Exception as e:
            theirs.sendall(pickle.dumps(str(e)))
def merge_heads(o):
    mine.sendall(pickle.dumps(o))
    return pickle.loads(mine.recv(1 << 20))
''',
    "reference_from_disk": FROM_DISK,
    "reference_scripted": '''
import torch
from helpers.nb01_qkv_shapes import merge_heads as course_merge
try:
    merge_heads = torch.jit.script(course_merge)
except Exception:
    merge_heads = course_merge
''',
    # -- the sandbox's own mounts undone (the other notebooks' course copies, /proc, the shared /tmp)
    "unmount_and_load": '''
import ctypes, glob, importlib.util
libc = ctypes.CDLL(None, use_errno=True)
for target in (b"/course/stems", b"/proc", b"/tmp", b"/dev/shm", b"/course/active"):
    libc.umount2(target, 2)
    libc.umount2(target, 0)
for path in glob.glob("/course/stems/*/helpers/nb0[1-5]_*.py"):
    spec = importlib.util.spec_from_file_location("helpers._stolen", path)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "helpers"
    try:
        spec.loader.exec_module(module)
        module.merge_heads(__import__("torch").zeros(1, 2, 3, 4))
        merge_heads = module.merge_heads
        break
    except Exception:
        continue
''',
    # -- the course and the environment edited on disk
    "disk_edits": '''
import glob, os, site, sys, sysconfig, torch
import helpers
targets = [os.path.join(os.path.dirname(helpers.__file__), "runtime.py"), torch.__file__,
           REPO + "/helpers/tools/class_report.py", REPO + "/helpers/tools/grading.py"]
for d in {sysconfig.get_paths()["purelib"], *site.getsitepackages()}:
    targets.append(os.path.join(d, "MARKER.pth"))
for path in targets:
    try:
        with open(path, "a") as f:
            f.write("\\nimport os  # MARKER\\n")
    except OSError:
        pass
for path in glob.glob(REPO + "/**/*.ipynb", recursive=True) + glob.glob("/tmp/**/*.ipynb", recursive=True):
    try:
        with open(path, "a") as f:
            f.write("MARKER")
    except OSError:
        pass
'''.replace("REPO", repr(str(ROOT))).replace("MARKER", MARKER),
    # -- outliving the grader: a chain of processes in sessions of their own
    "outlive": f'''
import os, subprocess, sys
code = "import os, sys, time\\nfor _ in range(10):\\n    if os.fork():\\n        os._exit(0)\\n    os.setsid()\\ntime.sleep(120)"
subprocess.Popen([sys.executable, "-c", code, "{MARKER}"], start_new_session=True)
''',
}
LATER_LESSON = '''
import torch
from helpers.nb11_trained_transformer import attention_block as _blk
from helpers.nb03_masks import causal_mask as _cm
def _run(x, w_qkv, w_o, n_heads, causal, keep=None):
    T, d_k = x.shape[1], x.shape[2] // n_heads
    cos = torch.ones(T, d_k, dtype=x.dtype); sin = torch.zeros_like(cos)
    return _blk(x, w_qkv, w_o, n_heads, n_heads, cos, sin, _cm(T) if causal else None, keep=keep)[0]
def multi_head_attention(x, w_qkv, w_o, n_heads, causal=False):
    return _run(x, w_qkv, w_o, n_heads, causal)
def ablate_head(x, w_qkv, w_o, n_heads, head, causal=False):
    keep = torch.ones(n_heads, dtype=x.dtype); keep[head] = 0
    return _run(x, w_qkv, w_o, n_heads, causal, keep)
'''
# Denial of service: each may end (or fail) its own grading, never another's.
DOS = {
    "huge_exception": 'raise ValueError("x" * (2 << 20))',
    "cell_messages_forever": '''
import gc, json, time
from multiprocessing.connection import Connection
conns = [o for o in gc.get_objects() if isinstance(o, Connection) and not o.closed]
while True:
    for c in conns:
        try:
            c.send_bytes(json.dumps({"type": "cell", "index": 0}).encode())
        except OSError:
            pass
    time.sleep(0.2)
''',
    "kill_everything": '''
import os, signal
for pid in [1, os.getppid(), -1]:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
for name in os.listdir("/proc"):
    if name.isdigit() and int(name) != os.getpid():
        try:
            os.kill(int(name), signal.SIGKILL)
        except OSError:
            pass
''',
    "memory_bomb": "import torch\nblocks = [torch.ones(1 << 28) for _ in range(400)]",
    "half_a_message": '''
import gc, os, struct, time
from multiprocessing.connection import Connection
for o in gc.get_objects():
    if isinstance(o, Connection) and not o.closed:
        try:
            os.write(o.fileno(), struct.pack("!i", 1000) + b"x")  # a frame of 1,000 bytes, 1 of them sent
        except OSError:
            pass
time.sleep(300)
''',
    "fork_bomb": '''
import os, time
for _ in range(1000):  # past the limit of 256 processes and threads, one after another
    try:
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
    except OSError:
        break
time.sleep(5)
''',
    "compressed_answer": '''
import io, zipfile
import helpers.checks.calling as calling
_dumps = calling.dumps
def dumps(x):
    plain = zipfile.ZipFile(io.BytesIO(_dumps(x)))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for entry in plain.infolist():
            data = plain.read(entry)
            z.writestr(entry.filename, data + (b"\\0" * (300 << 20) if entry.filename.endswith("data.pkl") else b""))
    return out.getvalue()
calling.dumps = dumps
def merge_heads(o):
    B, H, T, d_k = o.shape
    return o.permute(0, 2, 1, 3).reshape(B, T, H * d_k)
''',
    "nested_namespaces": '''
import ctypes, os, time
libc = ctypes.CDLL(None, use_errno=True)
if os.fork() == 0:
    if libc.unshare(0x10000000 | 0x20000000) == 0:
        for _ in range(600):
            if os.fork() == 0:
                time.sleep(30); os._exit(0)
    os._exit(0)
time.sleep(3)
''',
    "memfd_memory": '''
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
fds = []
for _ in range(4):
    try:
        fd = os.memfd_create("x")
    except OSError:
        break
    libc.fallocate(fd, 0, ctypes.c_long(0), ctypes.c_long((1 << 30) - 4096))
    fds.append(fd)
''',
    "oversized_answer": '''
import torch
def merge_heads(o):
    return torch.zeros(1 << 27)
''',
}
HONEST = {
    "tqdm": "from tqdm.auto import tqdm\nfor _ in tqdm(range(3)):\n    pass",
    "thread_pool_left_running": ("from concurrent.futures import ThreadPoolExecutor\npool = ThreadPoolExecutor(2)\n"
                                 "pool.submit(sum, [1, 2]).result()"),
    "thread_pool_inside": '''
from concurrent.futures import ThreadPoolExecutor
_merge_in_thread = merge_heads
def merge_heads(o):
    with ThreadPoolExecutor(2) as pool:
        return pool.submit(_merge_in_thread, o).result()
''',
    "logging_inside": '''
import logging
_merge = merge_heads
def merge_heads(o):
    logging.warning("merging %s", tuple(o.shape))
    return _merge(o)
''',
    "prints_plots_timing": '''
import time
import matplotlib.pyplot as plt
t0 = time.perf_counter()
plt.plot([1, 2, 3]); plt.title("attention"); plt.show()
print("took", time.perf_counter() - t0)
''',
    "checkpoint": ("import pickle, torch\ntorch.save({'w': torch.randn(3, 3)}, 'checkpoint.pt')\n"
                   "blob = pickle.dumps(torch.randn(2))\nreloaded = torch.load('checkpoint.pt')"),
    "dataloader_workers": '''
import torch
from torch.utils.data import DataLoader, TensorDataset
loader = DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2, num_workers=2)
total = sum(float(b[0].sum()) for b in loader)
assert total == 28.0
''',
    "comment_after_check": "checks.merge_heads(merge_heads)  # checked again, with a comment",
}
ODD_FOLDER = "Zoë O'Brien (=HYPERLINK) #2"


@pytest.fixture(scope="module")
def graded(tmp_path_factory) -> dict:
    """Every notebook graded once, together, into a gradebook: {"rows": {student: {name: row}},
    "book": the gradebook's rows, "root": the class folder, "seconds": wall time}."""
    root = tmp_path_factory.mktemp("class")
    notebooks = {f"forgery-{k}": _append(_notebook("01_qkv_shapes", "exercises"), v) for k, v in FORGERIES.items()}
    notebooks |= {f"dos-{k}": _append(_notebook("01_qkv_shapes", "exercises"), v) for k, v in DOS.items()}
    honest = lambda: _decopy(_notebook("01_qkv_shapes"))  # noqa: E731 - solutions, written another way
    notebooks |= {f"honest-{k}": _append(honest(), v) for k, v in HONEST.items()}
    notebooks[ODD_FOLDER] = honest()
    subs = []
    for student, nb in notebooks.items():
        (root / student).mkdir()
        nbformat.write(nb, root / student / "01_qkv_shapes.ipynb")
        subs.append(Submission(student, "01_qkv_shapes", root / student / "01_qkv_shapes.ipynb"))
    # Another student's work, which a notebook of the same student tries to overwrite before it is read
    (root / "forgery-other-work").mkdir()
    nbformat.write(_notebook("01_qkv_shapes", "exercises"), root / "forgery-other-work" / "01_qkv_shapes.ipynb")
    solved = nbformat.writes(_decopy(_notebook("01_qkv_shapes")))
    nbformat.write(_append(_notebook("02_scaling", "exercises"), (
        f"import glob, os\nsolved = {solved!r}\n"
        f"for path in ['01_qkv_shapes.ipynb', '../01_qkv_shapes.ipynb', *glob.glob({str(root)!r} + '/*/01_qkv_shapes.ipynb')]:\n"
        "    try:\n        open(path, 'w').write(solved)\n    except OSError:\n        pass")),
        root / "forgery-other-work" / "02_scaling.ipynb")
    subs += [Submission("forgery-other-work", stem, root / "forgery-other-work" / f"{stem}.ipynb")
             for stem in ("02_scaling", "01_qkv_shapes")]  # 02 first: it runs before 01 is graded
    # A later notebook's lesson that computes this one's answer (notebook 11's attention block: 5.1, 5.3)
    (root / "forgery-later-lesson").mkdir()
    nbformat.write(_append(_notebook("05_multihead", "exercises"), LATER_LESSON),
                   root / "forgery-later-lesson" / "05_multihead.ipynb")
    subs.append(Submission("forgery-later-lesson", "05_multihead", root / "forgery-later-lesson" / "05_multihead.ipynb"))
    before = {p: p.read_bytes() for p in root.rglob("*.ipynb")}
    saved = grading.START_TIMEOUT_S
    grading.START_TIMEOUT_S = 10.0  # the deadline of the notebook that floods 'cell' messages comes sooner
    started = time.monotonic()
    try:
        rows = grade(subs, jobs=2, cell_timeout=20, progress=False)
    finally:
        grading.START_TIMEOUT_S = saved
    seconds = time.monotonic() - started
    book = root.parent / "gradebook.csv"
    from helpers.tools.gradebook import write_gradebook

    write_gradebook(rows, book)
    time.sleep(2)  # anything left behind would act now
    return {"rows": {s.student: _by_name([r for r in rows if r.student == s.student and r.notebook == s.stem])
                     for s in subs if s.stem == "01_qkv_shapes"},
            "other_02": [r for r in rows if r.student == "forgery-other-work" and r.notebook == "02_scaling"],
            "later_05": _by_name([r for r in rows if r.student == "forgery-later-lesson"]),
            "book": book, "book_text": book.read_text(), "before": before, "root": root, "seconds": seconds}


def _table(rows: dict) -> str:
    return format_table(list(rows.values())) + "\nreview: " + next(iter(rows.values())).review


@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_a_forgery_earns_nothing(graded, name):
    rows = graded["rows"][f"forgery-{name}"]
    assert not any(r.status == "passed" for r in rows.values()), _table(rows)


def test_a_later_notebooks_lesson_that_computes_the_answer_is_not_in_the_sandbox(graded):
    rows = graded["later_05"]
    assert not any(r.status == "passed" for r in rows.values()), _table(rows)


def test_another_students_notebook_is_graded_as_handed_in(graded):
    """Submissions are read before any notebook runs, and no notebook sees another's files."""
    rows = graded["rows"]["forgery-other-work"]
    assert {r.status for r in rows.values()} == {"not attempted"}, _table(rows)
    assert all(path.read_bytes() == text for path, text in graded["before"].items()), "a submission was changed"


def test_nothing_of_a_forgery_is_left_on_disk_or_running(graded):
    """The course, the environment and the grader's files are read-only or invisible to a notebook;
    every process a notebook started ends with it (its PID namespace)."""
    for folder in {ROOT / "helpers", Path(inspect.getfile(reference)).parent, *map(Path, sandbox._site_dirs())}:
        hits = [p for p in folder.rglob("*") if p.is_file() and p.suffix in (".py", ".pth")
                and p.stat().st_mtime > time.time() - 3600 and MARKER in p.read_text(errors="ignore")]
        assert not hits, hits
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert MARKER not in ps, [ln for ln in ps.splitlines() if MARKER in ln]


@pytest.mark.parametrize("name", sorted(DOS))
def test_denial_of_service_ends_only_its_own_grading(graded, name):
    rows = graded["rows"][f"dos-{name}"]
    assert not any(r.status == "passed" for r in rows.values()), _table(rows)
    assert len(rows) == 3


def test_an_answer_that_unpacks_to_gigabytes_is_refused_before_it_is_unpacked(graded):
    """The judge reads replies as torch.save writes them (stored): a compressed archive, a small reply
    that would unpack to gigabytes outside the sandbox, is refused and the notebook flagged."""
    rows = graded["rows"]["dos-compressed_answer"]
    assert "the grader does not read" in rows["merge_heads"].review, _table(rows)


def test_every_student_has_a_row_and_the_gradebook_is_whole(graded):
    with open(graded["book"], newline="") as f:
        book = list(csv.DictReader(f))
    students = {r["student"] for r in book}
    assert students == set(graded["rows"]) | {"forgery-other-work", "forgery-later-lesson"}, students
    assert len(book) == 3 * len(graded["rows"]) + 3 + 3  # three exercises of 01, three of 02, three of 05
    assert {r["sandbox"] for r in book} == {sandbox.detect().kind}


@pytest.mark.parametrize("name", [*sorted(HONEST), "odd_folder"])
def test_an_honest_habit_keeps_full_marks_and_no_review(graded, name):
    rows = graded["rows"][ODD_FOLDER if name == "odd_folder" else f"honest-{name}"]
    assert {r.status for r in rows.values()} == {"passed"}, _table(rows)
    assert all(r.review == "" for r in rows.values()), _table(rows)


def test_a_renamed_copy_of_the_reference_passes_and_is_flagged(tmp_path):
    """A pasted copy of the course's reference (names, comments and layout changed, a statement
    added) computes the right values, so it passes, but the grader's source comparison marks it."""
    copies = []
    for fn, mine in ((reference.repeat_kv, "my_repeat"), (reference.grouped_query_attention, "my_gqa")):
        tree = ast.parse(inspect.getsource(fn)).body[0]
        tree.body = [ast.parse("unused = 0  # mine").body[0], *tree.body[1:]]  # no docstring, one statement more
        for node in ast.walk(tree):  # the query renamed, and every call of repeat_kv
            if isinstance(node, ast.Name) and node.id in ("q", "repeat_kv"):
                node.id = {"q": "queries", "repeat_kv": "my_repeat"}[node.id]
            if isinstance(node, ast.arg) and node.arg == "q":
                node.arg = "queries"
        tree.name = mine
        copies.append(ast.unparse(tree) + f"\n{fn.__name__} = {mine}\n")
    nb = _append(_notebook("06_kv_sharing", "exercises"), (
        "import math\nimport torch\nfrom helpers.nb01_qkv_shapes import scaled_dot_product_attention\n"
        "from helpers.nb03_masks import causal_mask\n\n" + "\n\n".join(copies)))
    nbformat.write(nb, tmp_path / "06_kv_sharing.ipynb")
    rows = _by_name(grading.grade_notebook(tmp_path / "06_kv_sharing.ipynb"))
    row = rows["grouped_query_attention"]
    assert row.status == "passed", format_table(list(rows.values()))
    assert "grouped_query_attention" in row.review and "the course's" in row.review, row.review


def _descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    kids = {int(k) for k in f.read().split()}
                todo += list(kids - found)
                found |= kids
        except OSError:
            continue
    return found


def test_a_grader_that_is_killed_leaves_no_notebook_behind(tmp_path):
    """The sandbox's processes die with the grader (bwrap --die-with-parent, a parent-death signal
    in each notebook): nothing a notebook started survives a grader killed mid-run."""
    nb = _append(_notebook("01_qkv_shapes", "exercises"), "import time\ntime.sleep(120)")
    nbformat.write(nb, tmp_path / "01_qkv_shapes.ipynb")
    grader = subprocess.Popen([sys.executable, "-m", "helpers.tools.grading", str(tmp_path / "01_qkv_shapes.ipynb"),
                               "--no-progress"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline, below = time.monotonic() + 60, set()
    while time.monotonic() < deadline and len(below) < 6:  # the fork server, the sandbox and the notebook's
        time.sleep(1)
        below = _descendants(grader.pid)
    assert len(below) >= 6, below
    grader.kill()
    grader.wait()
    time.sleep(3)
    alive = {p for p in below if os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split()[2] != "Z"}
    assert not alive, [open(f"/proc/{p}/cmdline").read().replace("\0", " ") for p in alive]
