"""One protected call of a learner's function, and the same call made from another process.

:func:`protected_call` runs the learner's function with everything the guard watches (time limit,
in-place changes, the course's reference, the integrity of torch and the course) and returns an
*outcome*: plain data that says what happened. A check turns it into a pass or a failure
(``Trial._settle``); the outcome itself decides nothing.

When ``make grade`` grades a notebook, the check runs in the grader's own process (the *judge*)
and the learner's function in the notebook's process: the check's function argument is then a
:class:`Remote`, whose calls travel to the notebook's process and come back as outcomes. What
comes back is encoded with :func:`encode` and read with ``torch.load(weights_only=True)``, which
builds tensors, numbers, strings and containers and nothing else (:func:`decode`).
"""

from __future__ import annotations

import inspect
import io
import pickle
import secrets
import time
import zipfile
from collections.abc import Callable
from typing import Any

import torch

from .feedback import CheckFailed, _exception_summary, _short
from .guard import (
    _Alarm,
    _call_with_time_limit,
    _input_device,
    _isinstance,
    _issubclass,
    _len,
    _plain,
    _reference_codes,
    _Refusal,
    _restore_torch_state,
    _same,
    _snapshot,
    _Tensor,
    _torch_state,
    _type,
    _watched,
    verify_integrity,
)

MAX_REPLY_BYTES = 1 << 28  # 256 MiB: the largest outcome the judge reads


# The mistakes a call itself can fail with: slug (of the failure's feedback.Mistake) -> its one line.
CALL_MISTAKES = {
    "changed-course-functions": "replaced functions of torch or of the course's helpers",
    "changed-trace-function": "changed Python's trace function (a debugger or sys.settrace)",
    "called-the-reference": "called the course's own solution of the exercise",
    "modified-input-in-place": "modified an input tensor in place",
    "modified-argument-in-place": "modified an argument (a list, a dict) in place",
    "meta-device": "returned a tensor on the meta device",
    "wrong-device": "returned a tensor on another device than the inputs'",
    "not-dense": "returned a sparse or nested tensor",
    "tensor-subclass": "returned a subclass of torch.Tensor",
    "number-subclass": "returned a subclass of a Python number",
    "mapping-not-dict": "returned a Mapping that is not a dict",
}


def _fail(message: str, hint: str, kind: str = "CheckFailed", *, slug: str) -> dict:
    return {"status": "fail", "message": message, "hint": hint, "kind": kind, "mistake": slug}


def exception_outcome(e: BaseException, learner: Any = None) -> dict:
    """What a learner's exception means to a check, as plain data. A bare NotImplementedError
    means "not attempted" when the checked function (``learner``, if known) raised it itself; raised
    in another function it calls (an earlier exercise not written yet), it is an error that says so."""
    raiser = _raiser(e)
    own = {getattr(f, "__code__", None) for f in (learner, getattr(learner, "__wrapped__", None))}
    if (_type(e) is NotImplementedError and not e.args and learner is not None and raiser is not None
            and raiser not in own and raiser.co_name != getattr(learner, "__name__", None)):
        return {"status": "raised", "kind": "error", "code": "",
                "summary": f"NotImplementedError (from `{raiser.co_name}`, which it calls)"}
    if _type(e) is NotImplementedError and not e.args:
        kind = "not attempted"
    elif _isinstance(e, _Alarm):
        kind = "timed out"
    elif _isinstance(e, SystemExit):
        kind = "exit"
    elif _isinstance(e, KeyboardInterrupt):
        kind = "interrupt"
    else:
        kind = "error"
    code = _short(e.code) if kind == "exit" else ""
    return {"status": "raised", "kind": kind, "summary": _exception_summary(e), "code": code}


def _raiser(e: BaseException) -> Any:
    """The code object of the frame that raised ``e`` (the innermost of its traceback), or None."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_code if tb is not None else None


def argument_name(fn: Any, args: tuple, kwargs: dict, index: int) -> str:
    """The learner's name for argument ``index`` of the flattened (args + kwargs)."""
    names = [*(f"argument {i + 1}" for i in range(_len(args))), *kwargs]
    try:
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        params = [p.name for p in inspect.signature(fn).parameters.values() if p.kind in positional]
        for i in range(min(_len(args), _len(params))):
            names[i] = f"`{params[i]}`"
        for j, key in enumerate(kwargs):
            names[_len(args) + j] = f"`{key}`"
    except (TypeError, ValueError):
        pass
    return names[index] if index < _len(names) else f"argument {index + 1}"


def _run_watcher(watcher: Callable, fn: Callable, options: Any) -> Callable:
    """The function a protected call runs for ``Trial.call_watched``."""

    def watched(*args):
        return watcher(fn, args, options)

    return watched


def protected_call(fn: Callable, args: tuple, kwargs: dict, *, learner: Callable, time_limit: float,
                   forbidden: list[str], is_reference: bool, watched: bool = False) -> dict:
    """Run ``fn(*args, **kwargs)`` (the learner's function, or a watcher around it) in this process.

    Returns an outcome: ``{"status": "ok", "out": plain output, "obs": observations or None,
    "review": []}``, ``{"status": "fail", "message", "hint", "kind"}`` or ``{"status":
    "raised", "kind", "summary", "code"}``. ``review`` names what a grader should look at by hand
    (code that matches the course's reference after renaming). ``watched``: ``fn`` is a watcher
    (see ``Trial.call_watched``) and returns ``(output, observations)``. A real interrupt propagates.
    """
    before = _snapshot((args, kwargs))
    codes = frozenset() if is_reference else _reference_codes(forbidden)
    hits: list[str] = []
    state: dict[str, bool] = {}
    runner = _watched(fn, codes, hits, state) if codes else fn
    torch_before = _torch_state()
    raised: BaseException | None = None
    out = None
    try:
        out = _call_with_time_limit(runner, args, kwargs, time_limit)
    except BaseException as e:  # noqa: BLE001 - sorted out below, after the guard has run
        raised = e
    changed = _restore_torch_state(torch_before) + verify_integrity(restore=True)
    if raised is not None and getattr(raised, "_attn_course_real_interrupt", False):
        raise raised
    if changed:
        return _fail(f"your code changed what the check relies on: {'; '.join(changed[:4])}"
                     f"{' (and more)' if _len(changed) > 4 else ''}. The check put the originals back.",
                     "do not replace functions of torch or of the course's helpers (in your function or earlier "
                     "in the notebook). If anything still behaves oddly, restart the kernel (Kernel > Restart).",
                     "Refused", slug="changed-course-functions")
    if raised is not None:
        return exception_outcome(raised, learner)
    if state.get("trace_changed"):
        return _fail("your function changed Python's trace function (sys.settrace, or a debugger such as "
                     "breakpoint()), so the check could not watch it.",
                     "run the check without a debugger or trace hook inside your function.", "Refused",
                     slug="changed-trace-function")
    if hits:
        return _fail(f"your function called the course's own solution of this exercise, the reference {hits[0]}"
                     " (or a helper of the notebook that computes the same answer).",
                     "write your own implementation: the check compares against that reference, so calling it "
                     "proves nothing. Helpers that do not compute the answer stay allowed.", "Refused",
                     slug="called-the-reference")
    flat_before = [*before[0], *before[1].values()]
    flat_after = [*args, *kwargs.values()]
    for i, (a, b) in enumerate(zip(flat_before, flat_after)):
        if not _same(a, b):
            name = argument_name(learner, args, kwargs, i)
            if _issubclass(_type(b), _Tensor):
                return _fail(f"your function modified one of its input tensors in place: {name}.",
                             "in-place operations (`x += ...`, `masked_fill_`, `x[...] = ...`) change the caller's "
                             "tensor; work on a new tensor (for example `masked_fill` without the underscore, or "
                             "`x.clone()`).", slug="modified-input-in-place")
            return _fail(f"your function modified its argument {name} ({_type(b).__name__}) in place: it was "
                         f"{_short(a)}, now {_short(b)}.",
                         "work on a copy: `list(x)`, `x[::-1]`, `sorted(x)` and `dict(x)` make new objects; "
                         "`.reverse()`, `.sort()`, `.append()`, `.pop()` and item assignment change the caller's.",
                         slug="modified-argument-in-place")
    obs = None
    if watched:
        out, obs = out
    try:
        out = _plain(out, "the output", _input_device(args, kwargs))
    except _Refusal as r:
        return _fail(f"{r.message[0].upper()}{r.message[1:]}", r.hint, "Refused", slug=r.slug)
    return {"status": "ok", "out": out, "obs": obs, "review": []}


# --------------------------------------------------------------------------- between two processes

_TENSOR, _TUPLE, _LIST, _DICT, _OTHER = "tensor", "tuple", "list", "dict", "other"


def encode(x: Any, depth: int = 0) -> Any:
    """Plain data (what :func:`protected_call` returns) as a tree that ``torch.load(weights_only=True)``
    reads back: containers are tagged lists, tensors detached, any other object is replaced by its
    type's module and name (and its value, for a NumPy number)."""
    t = _type(x)
    if t is _Tensor:
        data = x.detach()
        if data.untyped_storage().nbytes() > data.numel() * data.element_size():  # a view: send its values only
            data = data.clone()
        return [_TENSOR, data, bool(x.requires_grad)]
    if t in (int, float, bool, complex, str, bytes) or x is None:
        return x
    if depth > 20:
        return [_OTHER, "builtins", "object", None, None]
    if t is torch.Size:
        return [_TUPLE, [int(v) for v in x]]
    if t is tuple or t is list:
        return [_TUPLE if t is tuple else _LIST, [encode(v, depth + 1) for v in x]]
    if t is dict:
        return [_DICT, [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in dict.items(x)]]
    module = str(getattr(t, "__module__", "builtins")).split(".")[0]
    base = next((b.__name__ for b in (bool, int, float, complex) if _issubclass(t, b)), None)
    value = None
    if module == "numpy" and base is not None:
        try:
            value = {"bool": bool, "int": int, "float": float, "complex": complex}[base](x)
        except Exception:  # noqa: BLE001
            value = None
    return [_OTHER, module, str(getattr(t, "__name__", "object")), base, value]


_CLASSES: dict[tuple, type] = {}


def _stand_in(module: str, name: str, base: str | None) -> type:
    """A class named like the learner's object's class (``numpy.ndarray``), so that a check's
    message names it; a NumPy number keeps its value (as a subclass of float, int...)."""
    key = (module, name, base)
    if key not in _CLASSES:
        bases = ({"bool": int, "int": int, "float": float, "complex": complex}[base],) if base else ()
        _CLASSES[key] = type(name, bases, {"__module__": module, "__slots__": ()} if bases else {"__module__": module})
    return _CLASSES[key]


def decode(x: Any, depth: int = 0) -> Any:
    """The inverse of :func:`encode`; raises ValueError on anything :func:`encode` does not make."""
    if _type(x) is not list:
        if _type(x) in (int, float, bool, complex, str, bytes) or x is None:
            return x
        raise ValueError(f"unexpected {type(x).__name__}")
    if depth > 25 or not x or _type(x[0]) is not str:
        raise ValueError("malformed")
    tag = x[0]
    if tag == _TENSOR and _len(x) == 3 and _type(x[1]) is _Tensor and _type(x[2]) is bool:
        return x[1].requires_grad_() if x[2] and x[1].is_floating_point() else x[1]
    if tag in (_TUPLE, _LIST) and _len(x) == 2 and _type(x[1]) is list:
        items = [decode(v, depth + 1) for v in x[1]]
        return tuple(items) if tag == _TUPLE else items
    if tag == _DICT and _len(x) == 2 and _type(x[1]) is list:
        out = {}
        for pair in x[1]:
            if _type(pair) is not list or _len(pair) != 2:
                raise ValueError("malformed dict")
            key = decode(pair[0], depth + 1)
            out[key if _type(key) is not list else tuple(key)] = decode(pair[1], depth + 1)
        return out
    if tag == _OTHER and _len(x) == 5 and all(_type(v) is str for v in x[1:3]):
        module, name, base, value = x[1], x[2], x[3], x[4]
        if base not in (None, "bool", "int", "float", "complex"):
            raise ValueError("malformed object")
        cls = _stand_in(module[:40], name[:80], base)
        return cls(value) if base and value is not None else cls() if not base else cls(0)
    raise ValueError(f"unknown tag {tag!r}")


def dumps(x: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(x, buffer)
    return buffer.getvalue()


def loads(data: bytes) -> Any:
    """``torch.load(weights_only=True)``: tensors, numbers, strings and containers, never code; and
    only from an archive as :func:`dumps` writes it (stored, not compressed: a small reply that
    unpacks to gigabytes is refused before anything is unpacked)."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        for entry in archive.infolist():
            if entry.compress_type != zipfile.ZIP_STORED or entry.file_size > len(data):
                raise ValueError(f"a compressed or oversized entry in the reply ({entry.filename[:60]})")
    return torch.load(io.BytesIO(data), weights_only=True, map_location=None)


class RemoteBroken(BaseException):
    """The notebook's process stopped answering (``status`` "timed out"), ended ("error"), or
    answered with something that is not an answer (``channel`` True). A BaseException, so that no
    check body's ``except Exception`` takes it for a learner's mistake."""

    def __init__(self, status: str, reason: str, channel: bool = False):
        super().__init__(reason)
        self.status, self.reason, self.channel = status, reason, channel


STRAYS: list[str] = []  # in the judge: messages from the notebook's process that answered no question


class Remote:
    """The learner's function ``name``, living in another process (the notebook's), reached through
    ``conn``. ``info`` is what that process said about it when grading began (see
    ``helpers.tools.judging``): whether it is callable, its description, whether it is the course's
    reference. Every call returns an outcome, checked here for its form."""

    def __init__(self, conn: Any, name: str, info: dict, wait_s: float):
        self.conn, self.name, self.info, self.wait_s = conn, name, info, wait_s
        self.__name__ = name

    def call(self, args: tuple, kwargs: dict, watcher: Callable | None, options: Any, spec: dict) -> dict:
        nonce = secrets.token_hex(8)
        request = {"op": "call", "nonce": nonce, "name": self.name, "args": args, "kwargs": kwargs,
                   "watcher": None if watcher is None else (watcher.__module__, watcher.__qualname__),
                   "options": options, **spec}
        reply = ask(self.conn, request, spec["time_limit"] + self.wait_s)
        status = reply.get("status")
        review: list[str] = []  # the notebook's process says nothing that reaches the review column
        if status == "ok" and "out" in reply:
            try:
                return {"status": "ok", "out": decode(reply["out"]), "obs": decode(reply.get("obs")), "review": review}
            except ValueError as e:
                raise RemoteBroken("error", f"the notebook's process sent a malformed output ({e})", True) from None
        if status == "fail" and all(_type(reply.get(k)) is str for k in ("message", "hint", "kind")):
            slug = reply.get("mistake")
            slug = slug if _type(slug) is str and slug in CALL_MISTAKES else ""  # only the judge's own set
            return {"status": "fail", "message": reply["message"][:4000], "hint": reply["hint"][:2000],
                    "kind": reply["kind"], "review": review, "mistake": slug}
        if status == "raised" and all(_type(reply.get(k)) is str for k in ("kind", "summary", "code")):
            return {"status": "raised", "kind": reply["kind"], "summary": reply["summary"][:400],
                    "code": reply["code"][:100], "review": review}
        raise RemoteBroken("error", f"the notebook's process sent an answer of unknown form ({str(status)[:40]!r})", True)

    def ask(self, request: dict, wait_s: float) -> dict:
        return ask(self.conn, request, wait_s)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"`{self.name}` runs in the notebook's process: checks call it through Trial.call")


def ask(conn: Any, request: dict, wait_s: float) -> dict:
    """Send ``request`` (with its ``nonce``) through ``conn``; return the notebook's reply to it (its
    nonce echoed). Messages that answer nothing (unreadable, or with another nonce) are skipped and
    counted in ``STRAYS``."""
    deadline = time.monotonic() + wait_s
    try:
        conn.send_bytes(pickle.dumps(request))
        while True:
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                raise RemoteBroken("timed out", f"the notebook's process did not answer within {wait_s:g} s")
            data = conn.recv_bytes(MAX_REPLY_BYTES)
            try:
                reply = loads(data)
            except zipfile.BadZipFile:  # not something the serving code sends
                reply = None
            except Exception as e:  # noqa: BLE001 - an archive it does not send either: compressed, oversized
                raise RemoteBroken("error", f"the notebook's process sent an answer the grader does not read ({e})",
                                   True) from None
            if _type(reply) is dict and reply.get("nonce") == request["nonce"]:
                return reply
            STRAYS.append("unreadable" if reply is None else "out of turn")
            if _len(STRAYS) > 1000:
                raise RemoteBroken("error", "the notebook's process sent more than 1000 messages that answer "
                                   "nothing", True)
    except (EOFError, OSError):
        raise RemoteBroken("error", "the notebook's process ended") from None


__all__ = ["CheckFailed", "Remote", "RemoteBroken", "ask", "argument_name", "decode", "dumps", "encode",
           "exception_outcome", "loads", "protected_call"]
