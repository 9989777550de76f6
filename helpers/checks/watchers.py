"""The watchers of ``Trial.call_watched``: each runs the learner's function in the notebook's process
with instruments on and returns ``(output, observations)``, the observations as plain data.

A watcher is called as ``watcher(fn, args, options)``. When ``make grade`` grades, the judge names it
by ``(module, qualname)`` (``helpers.checks.watchers``, ``kernel``) and the notebook's process runs
it, inside a sandbox that holds the checks' machinery but not the check modules (their expected
values and mistake models). So this module imports only torch, Triton (through the instruments),
the standard library and ``helpers.checks.{guard, feedback, instruments}``: never ``core``,
``diagnose``, a check module ``nbNN_*`` or ``helpers.reference``
(``tests/test_watchers.py`` holds it to that).

What a watcher observes comes from a process that the notebook controls: a check fails on it only
in a learner's own session (``Trial.fail_observed``); in ``make grade`` it is a note for a grader.

- :func:`rng`, :func:`seeds`: 2.3 (the generator and torch's global RNG).
- :func:`backward`: 4.3 (automatic differentiation, finite differences).
- :func:`ops`: 6.4 (the aten op log).
- :func:`logged`: 9.1, 9.2 (the op log, data leaving PyTorch).
- :func:`kernel`: 9.3, 9.4 (guarded memory, Triton launches, where the output's data comes from).
- :func:`decode`: 12.4 (the same, and the programs launched over the paged cache).
- :func:`ranks`: 13.2, 13.3 (the ranks as threads over a communicator: bytes sent, calls made).
"""

from __future__ import annotations

import inspect
import math
import warnings
from pathlib import Path
from typing import Any

import torch

from .guard import _equal
from .instruments import (
    KERNEL,
    Calls,
    GuardAllocations,
    KernelLaunches,
    OpLog,
    Provenance,
    disabled_modes,
    kernel_device,
    op_name,
    tensor_args,
)

_HELPERS = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- 2.3 the generator


def rng(fn: Any, args: tuple, global_state: torch.Tensor | None) -> tuple[Any, dict]:
    """``fn(d_k, n_samples, generator)`` with torch's global RNG set to ``global_state`` (uint8
    ``[state size]``, if given) and put back afterwards, so that a learner's function cannot shift
    the random numbers of the notebook around it. Observes ``{"changed": bool`` (it changed the
    global RNG), ``"used": bool`` (it drew from the generator), ``"after":`` the generator's state
    after the call (uint8 ``[state size]``)``}``."""
    g = args[2]
    g_before = g.get_state()
    saved = torch.get_rng_state()
    if global_state is not None:
        torch.set_rng_state(global_state)
    before = torch.get_rng_state()
    try:
        got = fn(*args)
        changed = not _equal(before, torch.get_rng_state())
    finally:
        torch.set_rng_state(saved)
    after = g.get_state()
    return got, {"changed": changed, "used": not _equal(g_before, after), "after": after}


def seeds(fn: Any, args: tuple, seed_list: list[int]) -> tuple[list, None]:
    """``fn(d_k, n_samples, torch.Generator().manual_seed(s))`` for each ``s`` in ``seed_list``,
    torch's global RNG put back after. Returns ``([output per seed], None)``: no observations."""
    saved = torch.get_rng_state()
    try:
        return [fn(*args, torch.Generator().manual_seed(s)) for s in seed_list], None
    finally:
        torch.set_rng_state(saved)


# --------------------------------------------------------------------------- 4.3 by hand, not by autograd

FORWARD_PASSES = 4  # 4.3: exp/softmax work allowed, in forward passes (one computes P once, a careful one twice)
_EXP_WORK = {"exp", "exp2", "expm1", "_softmax", "_log_softmax", "logsumexp", "sigmoid", "logaddexp"}


class _TooMuchWork(BaseException):
    """Stops a learner's function that has already run the forward pass many times (a BaseException,
    so that a bare ``except Exception`` in learner code cannot swallow it)."""


class _ExpLog(OpLog):
    """Counts the numbers that go through exp or softmax; stops the function past ``budget``."""

    def __init__(self, budget: int):
        super().__init__()
        self.budget, self.work = budget, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        op, _, _, numels = self.ops.pop()  # only the count is kept
        if numels and (op_name(op) in _EXP_WORK or op == "aten.pow.Scalar"):
            self.work += numels[0]
            if self.work > self.budget:
                raise _TooMuchWork()
        return out


def backward(fn: Any, args: tuple, options: None) -> tuple[Any, dict]:
    """``fn(q [..., T, d_k], k [..., T, d_k], v [..., T, d_v], grad_out [..., T, d_v], causal)``.
    Observes tensors saved for an autograd backward (the check's inputs do not require grad, so a
    by-hand computation saves none; .backward(), torch.autograd.grad and torch.func.vjp always do),
    calls of automatic differentiation in either mode (torch.autograd, torch.autograd.forward_ad,
    torch.func), and how many numbers went through exp or softmax: ``{"p_numel": int`` (the
    entries of P, ``q[..., 0].numel() * T``), ``"autograd": [str]`` (what was seen, at most one),
    ``"exp_work": int}``. Finite differences run the forward pass many times: the function is
    stopped once it has done the work of ``FORWARD_PASSES + 1`` forward passes, and None stands for
    its output."""
    q, k = args[0], args[1]
    seen: dict = {"p_numel": q[..., 0].numel() * k.shape[-2]}
    saved: list = []
    log = _ExpLog((FORWARD_PASSES + 1) * seen["p_numel"])

    def pack(x):
        saved.append(True)
        return x

    calls = Calls()
    out = None
    try:
        with calls, log, torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            out = fn(*args)
    except _TooMuchWork:
        out = None
    finally:
        seen["autograd"] = calls.autograd[:1] or (["a tensor saved for the backward pass"] if saved else [])
        seen["exp_work"] = log.work
    return out, seen


# --------------------------------------------------------------------------- 6.4, 9.1, 9.2 the op log


def ops(fn: Any, args: tuple, options: None) -> tuple[Any, list]:
    """``fn(*args)`` with every aten op it runs logged. Observes the log: ``[(op, first input
    shape, [output shapes], [input numels])]``."""
    log = OpLog()
    with log:
        out = fn(*args)
    return out, log.ops


def logged(fn: Any, args: tuple, sources: dict[str, int]) -> tuple[Any, dict]:
    """``fn(*args)`` with its aten ops logged and the data of the arguments named in ``sources``
    (name -> position) followed. Observes ``{"ops":`` the log as :func:`ops` gives it, ``"exported":
    str`` (how the sources' data left PyTorch, "" if it did not), ``"scalar_reads": int`` (Python
    numbers read from them one at a time)``}``."""
    named = {name: args[i] for name, i in sources.items()}
    log, prov, calls = OpLog(), Provenance(named), Calls()
    with calls, prov, log:
        out = fn(*args)
    exported = next((how for how, x in calls.exported if x.numel() > 1 and prov.sources(x) & set(named)), "")
    return out, {"ops": log.ops, "exported": exported, "scalar_reads": prov.scalar_reads}


# --------------------------------------------------------------------------- 9.3, 9.4 Triton kernels

_KERNEL_FILES = {str(_HELPERS / "nb09_triton_flash.py")}  # the course's own FlashAttention kernels


def flat_tensors(x: Any, depth: int = 0) -> list:
    """The tensors in an output, in order (tuples, lists and dict values looked into)."""
    if isinstance(x, torch.Tensor):
        return [x]
    if depth > 5:
        return []
    items = x.values() if type(x) is dict else x if type(x) in (tuple, list) else ()
    return [t for item in items for t in flat_tensors(item, depth + 1)]


def kernel(fn: Any, args: tuple, options: dict) -> tuple[Any, dict]:
    """``fn(*args)`` (9.3: ``q, k, v [B, H, T, d], causal``; 9.4: ``q, k, v, out [B, H, T, d], lse
    [B, H, T], grad_out [B, H, T, d], causal``) with guarded allocations, kernel launches recorded
    and the data of the arguments named in ``options["sources"]`` (name -> position) followed;
    ``options["is_reference"]``: the course's own kernel may run. Observes, in order, what is wrong
    with how the output was computed (``"failures": [(message, slug)]``, the slugs those of
    ``helpers.checks.nb09_triton_flash._WATCHED``) and which sources each output tensor's data
    comes from (``"written": [[source name]]``, one list per tensor of :func:`flat_tensors`)."""
    sources = {name: args[i] for name, i in options["sources"].items()}
    watched = {"q", "k", "v"}
    prov, calls, guard = Provenance(sources, watched), Calls(), GuardAllocations()
    launches = KernelLaunches(prov, calls, interpreter=kernel_device().type == "cpu")
    with calls, prov, launches, guard, warnings.catch_warnings():
        # NumPy's "invalid value" warnings from a kernel making NaN in the interpreter: the check names it.
        warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton\.")
        out = fn(*args)
    failures = []
    if guard.overrun():
        failures.append(("your kernel wrote past the end of a tensor it stores into (the memory just after out, lse or a "
                         "gradient changed).", "store-past-end"))
    if not launches.launches:
        failures.append(("no Triton kernel ran during your function.", "no-kernel-launched"))
    if any(f in _KERNEL_FILES for _, f, _ in launches.launches) and not options["is_reference"]:
        failures.append(("your function launched the course's kernel (helpers/nb09_triton_flash.py) instead of your own.",
                         "launched-course-kernel"))
    where = "your kernels" if len({name for name, _, _ in launches.launches}) > 1 else "your kernel"
    if prov.mixed:
        failures.append((f"your function computed with q, k and v in PyTorch ({prov.mixed[0]}): in this exercise the "
                         f"attention is computed in {where}, not in PyTorch around it.",
                         "attention-in-pytorch"))
    how = next((how for how, x in calls.exported
                if x.numel() > 1 and prov.sources(x) & watched and KERNEL not in prov.sources(x)), "")
    if how:
        failures.append((f"your function took q, k or v out of PyTorch ({how}): in this exercise the attention is "
                         f"computed in {where}.", "data-left-torch"))
    if prov.scalar_reads >= sources["q"].numel() // 2:
        failures.append((f"your function read q, k or v into {prov.scalar_reads} Python numbers one at a time: in this "
                         f"exercise the attention is computed in {where}.",
                         "read-numbers-one-at-a-time"))
    return out, {"failures": failures, "written": [sorted(prov.sources(x)) for x in flat_tensors(out)]}


# --------------------------------------------------------------------------- 12.4 split-KV decoding

_COURSE_KERNEL_FILES = {str(_HELPERS / "nb12_triton_decode.py"),  # the course's own decoding and
                        str(_HELPERS / "nb09_triton_flash.py")}   # FlashAttention kernels


class _ProgramCount(KernelLaunches):
    """:class:`KernelLaunches` that also adds up the programs of the launches that read the cache
    (a tensor argument holding k's or v's data that no kernel computed): ``programs``, or None
    once a launch's grid could not be read."""

    def __init__(self, prov: Provenance, calls: Calls, interpreter: bool):
        super().__init__(prov, calls, interpreter)
        self.programs: int | None = 0

    def _launch(self, cls: type, original: Any) -> Any:
        inner = super()._launch(cls, original)
        counter = self

        def run(this, *args, **kwargs):
            if not kwargs.get("warmup") and counter.programs is not None:
                with disabled_modes():
                    reads = any(counter.prov.sources(x) & {"k", "v"}
                                and KERNEL not in counter.prov.sources(x)
                                for x in tensor_args(args, kwargs))
                if reads:
                    n = _grid_size(this, args, kwargs)
                    counter.programs = None if n is None else counter.programs + n
            return inner(this, *args, **kwargs)

        return run


def _grid_size(launched: Any, args: tuple, kwargs: dict) -> int | None:
    """How many programs a launch ``launched.run(*args, grid=..., **kwargs)`` starts, or None."""
    grid = kwargs.get("grid")
    try:
        if callable(grid):
            names = list(inspect.signature(launched.fn).parameters)
            meta = {**{k: v for k, v in kwargs.items() if k in names}, **dict(zip(names, args))}
            grid = grid(meta)
        grid = tuple(grid) if isinstance(grid, (tuple, list)) else (grid,)
        return math.prod(int(g) for g in grid)
    except Exception:  # noqa: BLE001 - a grid this cannot read: no count, no complaint
        return None


def decode(fn: Any, args: tuple, options: dict) -> tuple[Any, dict]:
    """``fn(q [B, H, d], k_pages [n_blocks, page, H_kv, d], v_pages [n_blocks, page, H_kv, d],
    block_tables [B, max_blocks] int32, seq_lens [B] int32, n_splits, sm_scale)`` with guarded
    allocations, kernel launches recorded and the data of q, k_pages, v_pages, block_tables and
    seq_lens followed; ``options["is_reference"]``: the course's own kernels may run. Observes what
    is wrong with how the output was computed (``"failures": [(message, slug)]``, the slugs those
    of ``helpers.checks.nb12_triton_decode._WATCHED``), which sources the output's data comes from
    (``"written": [[source name]]``, one list if the output is a tensor) and how many programs the
    launches that read the cache started (``"programs": int``, None if unknown)."""
    names = {"q": 0, "k": 1, "v": 2, "block_tables": 3, "seq_lens": 4}
    prov = Provenance({name: args[i] for name, i in names.items()}, {"q", "k", "v"})
    calls, guard = Calls(), GuardAllocations()
    launches = _ProgramCount(prov, calls, interpreter=kernel_device().type == "cpu")
    with calls, prov, launches, guard, warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton\.")
        out = fn(*args)
    failures = []
    if guard.overrun():
        failures.append(("your kernel wrote past the end of a tensor it stores into.",
                         "store-past-end"))
    if not launches.launches:
        failures.append(("no Triton kernel ran during your function.",
                         "no-kernel"))
    course = [f for _, f, _ in launches.launches if f in _COURSE_KERNEL_FILES]
    if course and not options["is_reference"]:
        failures.append(("your function launched the course's kernel instead of your own.",
                         "course-kernel"))
    gathered = next((m for m in prov.mixed if "block_tables" in m), "")
    if gathered:
        failures.append((f"your function gathered the cache through the block table in PyTorch "
                         f"({gathered}).", "gathered-in-pytorch"))
    elif prov.mixed:
        failures.append((f"your function computed with q, k and v in PyTorch ({prov.mixed[0]}): "
                         "the scores and weighted sums belong in your kernel.",
                         "computed-in-pytorch"))
    how = next((how for how, x in calls.exported
                if x.numel() > 1 and prov.sources(x) & {"q", "k", "v"}
                and KERNEL not in prov.sources(x)), "")
    if how:
        failures.append((f"your function took q, k or v out of PyTorch ({how}).",
                         "left-pytorch"))
    flat = [out] if isinstance(out, torch.Tensor) else []
    return out, {"failures": failures, "written": [sorted(prov.sources(x)) for x in flat],
                 "programs": launches.programs}


# --------------------------------------------------------------------------- 13.2, 13.3 ranks


def ranks(fn: Any, args: tuple, options: dict) -> tuple[list, dict]:
    """``fn(comm, *shards[r])`` on one thread per rank over the course's thread communicator
    (:mod:`helpers.ranks`: a send waits for its receive, as gloo's does, and a deadlock raises at
    once), ``args = (shards,)``; returns what each rank returned, in rank order. Observes
    ``{"sent": [bytes each rank sent], "ops": [[each rank's communication calls, in order]]}``."""
    from helpers.ranks import RankError, run_ranks

    (shards,) = args
    # each rank gets copies: what a rank does to its own tensors (q *= scale) is its business
    copies = [tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in shard) for shard in shards]
    try:
        results = run_ranks(fn, copies, backend="threads", timeout=float(options.get("timeout", 20.0)))
    except RankError as error:  # the stub's NotImplementedError, as its rank raised it: "not attempted"
        if type(error.__cause__) is NotImplementedError:
            raise error.__cause__ from None
        raise
    return list(results), {"sent": [float(s) for s in results.sent],
                           "ops": [[str(c[0]) for c in calls] for calls in results.calls]}
