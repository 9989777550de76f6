"""Ranks and what they say to each other: one small communicator interface, on processes or threads.

Every scheme of notebook 13 is a function ``fn(comm, *shard)`` run once per rank; ``comm`` has
one interface (:class:`Comm`): ``exchange`` (send to one rank while receiving from another),
``send``/``recv`` (blocking), ``all_reduce``, ``all_gather``, ``all_to_all``, and it counts the
bytes its rank sends. :func:`run_ranks` runs ``fn``

- on real processes over ``torch.distributed`` with the gloo backend (:class:`DistComm`), started
  once per number of ranks by a forkserver (spawn on Windows) and reused, each run in a process
  group of its own whose keys live in a store the parent owns on a port the system picks; ``fn``
  must be importable from a module, since the processes receive it by name;
- or on threads of this process over :class:`ThreadComm`, which behaves like gloo (a ``send``
  waits for its receive) and reports a deadlock the moment every rank waits, saying who waits for
  whom. Threads run any function, a notebook's included: exercises are graded this way.

A script (not a notebook) that runs gloo ranks must start them under ``if __name__ ==
"__main__":``: forkserver and spawn import the script again in every new process.

Standard library and torch only (the grader's sandbox runs it in a notebook's process).
"""

from __future__ import annotations

import datetime
import operator
import pickle
import threading
import traceback
from collections import deque
from collections.abc import Callable, Sequence

import torch


class DeadlockError(RuntimeError):
    """Every rank that has not returned waits for something no other rank will do."""


class RankError(RuntimeError):
    """A rank raised: the message names the rank and carries its error."""


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def _describe(x: torch.Tensor) -> str:
    return f"{list(x.shape)} {str(x.dtype).replace('torch.', '')}"


class Comm:
    """What a rank can do, identical for processes (:class:`DistComm`) and threads
    (:class:`ThreadComm`). ``sent`` is the bytes this rank has sent, counted as the
    bandwidth-optimal algorithm sends them (what NCCL does for large messages):

    - ``send``/``exchange`` of x: x's bytes;
    - ``all_reduce`` of x: ``2 (N-1)/N`` x its bytes (a ring reduce-scatter, then an all-gather);
    - ``all_gather`` of x: ``(N-1)`` x its bytes (every other rank needs it);
    - ``all_to_all`` of x: ``(N-1)/N`` x its bytes (the part kept at home does not travel).

    ``calls`` lists ``(operation, shape, bytes sent)`` in order."""

    rank: int
    world_size: int

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self._sent = 0.0
        self.calls: list[tuple[str, tuple[int, ...], float]] = []

    @property
    def sent(self) -> float:
        """Bytes this rank has sent so far (read-only)."""
        return self._sent

    def _count(self, op: str, x: torch.Tensor, nbytes: float) -> None:
        self._sent += nbytes
        self.calls.append((op, tuple(x.shape), nbytes))

    def _peer(self, other, what: str) -> int:
        try:  # a Python int, or anything that is one (numpy and 0-d integer torch scalars)
            other = operator.index(other) if not isinstance(other, bool) else other
        except TypeError:
            pass
        if not isinstance(other, int) or isinstance(other, bool) or not 0 <= other < self.world_size:
            raise ValueError(f"rank {self.rank}: {what} must be a rank in 0..{self.world_size - 1}, got {other!r}")
        if other == self.rank:
            raise ValueError(f"rank {self.rank}: {what} is the rank itself (a rank does not send to itself)")
        return other

    def _tensor(self, x, what: str) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"rank {self.rank}: {what} takes a tensor, got {type(x).__name__}")
        return x

    def _split(self, x: torch.Tensor) -> None:
        if x.ndim == 0 or x.shape[0] % self.world_size:
            raise ValueError(f"rank {self.rank}: all_to_all splits dim 0 into {self.world_size} equal parts, "
                             f"one per rank; the tensor is {_describe(x)}, and dim 0 is not a multiple of "
                             f"{self.world_size}")

    # the interface, implemented by the two communicators
    def send(self, x: torch.Tensor, dst: int) -> None:
        """Send x to rank ``dst``; blocks until ``dst`` has received it (as gloo's send does)."""
        raise NotImplementedError

    def recv(self, like: torch.Tensor, src: int) -> torch.Tensor:
        """A tensor shaped and typed like ``like``, received from rank ``src`` (blocks). Threads
        raise when the sender sent another shape or dtype; gloo cannot tell (a shorter message
        leaves the rest of the buffer as it was, a longer one ends the receiving process)."""
        raise NotImplementedError

    def exchange(self, x: torch.Tensor, dst: int, src: int) -> torch.Tensor:
        """Send x to ``dst`` while receiving a tensor like x from ``src``, both posted before
        either waits (``batch_isend_irecv``): the step of a ring, which cannot deadlock."""
        raise NotImplementedError

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """The elementwise sum (or ``op="max"``) of every rank's x, on every rank (a new tensor)."""
        raise NotImplementedError

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, *x.shape]``: every rank's x, in rank order, on every rank."""
        raise NotImplementedError

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """x's dim 0 cut into N equal parts, part j sent to rank j; returns the parts received,
        joined along dim 0 in the order of the ranks that sent them (``all_to_all_single``)."""
        raise NotImplementedError


# --------------------------------------------------------------------------- processes (gloo)


class DistComm(Comm):
    """:class:`Comm` over ``torch.distributed`` (the process group of this process)."""

    def send(self, x, dst):
        import torch.distributed as dist

        dst, x = self._peer(dst, "dst"), self._tensor(x, "send")
        self._count("send", x, _nbytes(x))
        dist.send(x.contiguous(), dst)

    def recv(self, like, src):
        import torch.distributed as dist

        out = torch.empty_like(self._tensor(like, "recv"), memory_format=torch.contiguous_format)
        dist.recv(out, self._peer(src, "src"))
        return out

    def exchange(self, x, dst, src):
        import torch.distributed as dist

        dst, src, x = self._peer(dst, "dst"), self._peer(src, "src"), self._tensor(x, "exchange")
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        self._count("exchange", x, _nbytes(x))
        ops = [dist.P2POp(dist.isend, x.contiguous(), dst), dist.P2POp(dist.irecv, out, src)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        return out

    def all_reduce(self, x, op="sum"):
        import torch.distributed as dist

        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[_reduce_op(op)]
        out = self._tensor(x, "all_reduce").clone(memory_format=torch.contiguous_format)
        self._count("all_reduce", x, 2 * (self.world_size - 1) * _nbytes(x) / self.world_size)
        dist.all_reduce(out, op=reduce_op)
        return out

    def all_gather(self, x):
        import torch.distributed as dist

        parts = [torch.empty_like(self._tensor(x, "all_gather"), memory_format=torch.contiguous_format)
                 for _ in range(self.world_size)]
        self._count("all_gather", x, (self.world_size - 1) * _nbytes(x))
        dist.all_gather(parts, x.contiguous())
        return torch.stack(parts)

    def all_to_all(self, x):
        import torch.distributed as dist

        self._split(self._tensor(x, "all_to_all"))
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        self._count("all_to_all", x, (self.world_size - 1) * _nbytes(x) / self.world_size)
        dist.all_to_all_single(out, x.contiguous())
        return out


def _reduce_op(op: str) -> str:
    if op not in ("sum", "max"):
        raise ValueError(f"all_reduce: op must be 'sum' or 'max', got {op!r}")
    return op


def _worker(rank: int, world_size: int, port: int, conn) -> None:
    """A rank's process: runs one job after another, each in a new gloo group whose keys live
    under their own prefix of the parent's store. Results go back pickled to bytes (not through
    torch's shared-memory queues, which fail when the rank has exited before they are read)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    while True:
        try:
            message = conn.recv_bytes()
        except EOFError:
            return
        comm = DistComm(rank, world_size)
        stage = "run"
        try:
            job, fn, shard, timeout = pickle.loads(message)  # fn by name: its module is imported here
            stage = "group"
            dist.init_process_group("gloo", store=dist.PrefixStore(f"job{job}", store), rank=rank,
                                    world_size=world_size, timeout=datetime.timedelta(seconds=timeout))
            dist.barrier()        # every rank connected before any can finish and tear its end down
            stage = "run"
            out = fn(comm, *shard)
            stage = "end"
            dist.barrier()        # and none leaves while another may still be talking to it
            reply = ("ok", out, comm.sent, comm.calls)
        except BaseException as error:  # noqa: BLE001  (reported to the parent, which raises)
            reply = ("error", f"{type(error).__name__}: {error}", traceback.format_exc(), stage)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        try:
            data = pickle.dumps(reply)
        except Exception as error:  # noqa: BLE001  (what fn returned cannot travel back)
            data = pickle.dumps(("error", f"what rank {rank} returned cannot be sent back to the notebook (pickle: "
                                 f"{type(error).__name__}: {error}); return tensors, numbers, lists, tuples or "
                                 "dicts", "", "run"))
        conn.send_bytes(data)


def start_method() -> str:
    """How rank processes start: ``forkserver`` where it exists (Linux, macOS: a clean,
    single-threaded server forks them; fork from a notebook's multi-threaded kernel can hang in the
    child), else ``spawn`` (Windows)."""
    import multiprocessing as mp

    return "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"


class _Pool:
    """``world_size`` rank processes, started once and reused (a new gloo group per job)."""

    def __init__(self, world_size: int):
        import multiprocessing as mp

        import torch.distributed as dist

        method = start_method()
        ctx = mp.get_context(method)
        if method == "forkserver":
            ctx.set_forkserver_preload([__name__])
        # the parent owns the store, on a port the system picks (port 0): no collisions
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.world_size, self.jobs, self.method = world_size, 0, method
        self.conns, self.procs = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(rank, world_size, self.store.port, child), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)

    def run(self, fn, shards, timeout: float):
        self.jobs += 1
        # every job pickled before any is sent: one that cannot be pickled raises here, no rank waiting
        jobs = [pickle.dumps((self.jobs, fn, tuple(shard), timeout)) for shard in shards]
        try:
            for conn, job in zip(self.conns, jobs):
                conn.send_bytes(job)
        except (BrokenPipeError, OSError) as error:
            self.close()
            raise RuntimeError("a rank process has ended; the rank processes were stopped (the next run starts "
                               "new ones)") from error
        replies = []
        try:
            for rank, conn in enumerate(self.conns):
                if not conn.poll(timeout + 30):
                    raise TimeoutError(f"rank {rank} did not finish within {timeout + 30:.0f} s; the rank "
                                       "processes were stopped (the next run starts new ones)")
                replies.append(pickle.loads(conn.recv_bytes()))
        except (EOFError, OSError) as error:  # a rank process died (killed, out of memory, ...)
            self.close()
            raise RankError(f"rank {len(replies)}'s process ended without replying ({type(error).__name__}): gloo "
                            "ends a process whose receive does not match what was sent (shapes and dtypes must "
                            "agree on both sides; backend='threads' says which), and so does running out of "
                            "memory. The rank processes were stopped (the next run starts new ones)") from error
        except TimeoutError:
            self.close()
            raise
        return replies

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.join()


_POOLS: dict[int, _Pool] = {}


def _importable(fn) -> None:
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if module in (None, "__main__") or "<" in name:
        raise ValueError(
            f"run_ranks(..., backend='gloo') sends `{getattr(fn, '__name__', fn)}` to the rank processes by "
            "name, and they cannot import a function defined in a notebook or inside another function "
            "(with spawn: \"Can't get attribute ... on <module '__main__'>\"). Put it in a module, "
            "or run it with backend='threads'.")


def stop_rank_processes() -> None:
    """Stop the rank processes :func:`run_ranks` started (they stop anyway when Python exits)."""
    while _POOLS:
        _POOLS.popitem()[1].close()


# --------------------------------------------------------------------------- threads


class _Hub:
    """What the rank threads of one run share: mailboxes, collectives, who waits for what."""

    def __init__(self, world_size: int, timeout: float):
        self.n, self.timeout = world_size, timeout
        self.cv = threading.Condition()
        self.boxes: dict[tuple[int, int], deque] = {}
        self.collectives: dict[int, dict[int, tuple]] = {}
        self.waiting: dict[int, tuple[str, Callable[[], bool]]] = {}
        self.done: set[int] = set()
        self.failure: BaseException | None = None

    def fail(self, error: BaseException) -> None:
        if self.failure is None:
            self.failure = error
        self.cv.notify_all()

    def wait(self, rank: int, what: str, ready: Callable[[], bool]) -> None:
        """Block rank until ``ready()``; raise as soon as every live rank is blocked."""
        import time

        deadline = time.monotonic() + self.timeout
        while True:
            if self.failure is not None:
                raise _Aborted()
            if ready():
                self.waiting.pop(rank, None)
                return
            self.waiting[rank] = (what, ready)
            live = [r for r in range(self.n) if r not in self.done]
            if all(r in self.waiting and not self.waiting[r][1]() for r in live):
                lines = [f"rank {r} waits to {self.waiting[r][0]}" for r in live]
                lines += [f"rank {r} has returned" for r in sorted(self.done)]
                self.fail(DeadlockError("deadlock: every rank is waiting and none can go on: "
                                        + "; ".join(lines)))
                raise _Aborted()
            if time.monotonic() > deadline:
                self.fail(TimeoutError(f"rank {rank} waited {self.timeout:g} s to {what}"))
                raise _Aborted()
            self.cv.wait(timeout=0.5)


class _Aborted(Exception):
    """Raised in a rank thread when another rank failed or the ranks deadlocked."""


class ThreadComm(Comm):
    """:class:`Comm` between threads of one process. A ``send`` waits until it is received, as
    gloo's does, so the deadlocks of real ranks happen here too, and are reported at once."""

    def __init__(self, rank: int, world_size: int, hub: _Hub):
        super().__init__(rank, world_size)
        self._hub = hub
        self._n_collectives = 0

    def _post(self, x: torch.Tensor, dst: int) -> dict:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"rank {self.rank}: can only send tensors, got {type(x).__name__}")
        item = {"tensor": x.detach().clone(), "taken": False}
        self._hub.boxes.setdefault((self.rank, dst), deque()).append(item)
        self._hub.cv.notify_all()
        return item

    def _take(self, like: torch.Tensor, src: int) -> torch.Tensor:
        box = self._hub.boxes.setdefault((src, self.rank), deque())
        self._hub.wait(self.rank, f"receive from rank {src}", lambda: bool(box))
        item = box.popleft()
        item["taken"] = True
        self._hub.cv.notify_all()
        got = item["tensor"]
        if got.shape != like.shape or got.dtype != like.dtype:
            raise ValueError(f"rank {self.rank} receives a {_describe(like)} from rank {src}, which "
                             f"sent a {_describe(got)}: the two sides must agree")
        return got

    def send(self, x, dst):
        with self._hub.cv:
            dst = self._peer(dst, "dst")
            item = self._post(x, dst)
            self._count("send", x, _nbytes(x))
            self._hub.wait(self.rank, f"send to rank {dst} (a send waits for its receive)", lambda: item["taken"])

    def recv(self, like, src):
        with self._hub.cv:
            return self._take(self._tensor(like, "recv"), self._peer(src, "src"))

    def exchange(self, x, dst, src):
        with self._hub.cv:
            dst, src = self._peer(dst, "dst"), self._peer(src, "src")
            item = self._post(x, dst)
            self._count("exchange", x, _nbytes(x))
            got = self._take(x, src)
            self._hub.wait(self.rank, f"finish its exchange (rank {dst} to receive)", lambda: item["taken"])
            return got

    def _collective(self, kind: str, x: torch.Tensor, combine) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"rank {self.rank}: {kind} takes a tensor, got {type(x).__name__}")
        hub = self._hub
        with hub.cv:
            number = self._n_collectives = self._n_collectives + 1
            slot = hub.collectives.setdefault(number, {})
            slot[self.rank] = (kind, x.detach().clone())
            hub.cv.notify_all()
            hub.wait(self.rank, f"{kind} (its collective number {number})", lambda: len(slot) == hub.n)
            calls = {r: (k, _describe(t)) for r, (k, t) in sorted(slot.items())}
            if len(set(calls.values())) > 1:
                listed = "; ".join(f"rank {r}: {k} of a {s}" for r, (k, s) in calls.items())
                raise ValueError(f"collective number {number} differs between ranks ({listed}): every "
                                 "rank must make the same collectives, in the same order, on tensors of "
                                 "one shape and dtype")
            return combine([slot[r][1] for r in range(hub.n)])

    def all_reduce(self, x, op="sum"):
        op = _reduce_op(op)
        combine = ((lambda xs: torch.stack(xs).sum(0).to(x.dtype)) if op == "sum"  # bool: or, as gloo's
                   else (lambda xs: torch.stack(xs).amax(0)))
        out = self._collective(f"all_reduce({op})", x, combine)
        self._count("all_reduce", x, 2 * (self.world_size - 1) * _nbytes(x) / self.world_size)
        return out

    def all_gather(self, x):
        out = self._collective("all_gather", x, torch.stack)
        self._count("all_gather", x, (self.world_size - 1) * _nbytes(x))
        return out

    def all_to_all(self, x):
        self._split(self._tensor(x, "all_to_all"))
        out = self._collective("all_to_all", x,
                               lambda xs: torch.cat([t.chunk(self.world_size)[self.rank] for t in xs]))
        self._count("all_to_all", x, (self.world_size - 1) * _nbytes(x) / self.world_size)
        return out


# --------------------------------------------------------------------------- running ranks


class RankResults(list):
    """What each rank returned, in rank order; ``sent[r]``: bytes rank r sent, ``calls[r]``: its
    communication calls ``(operation, shape, bytes)``; ``backend``: "threads" or "gloo"."""

    sent: list[float]
    calls: list[list]
    backend: str


def run_ranks(fn: Callable, shards: Sequence[Sequence], backend: str = "threads",
              timeout: float = 20.0) -> RankResults:
    """Run ``fn(comm, *shards[r])`` on every rank r, ``N = len(shards)`` ranks; return what each
    returned (a :class:`RankResults`).

    ``backend="gloo"``: N processes (started at the first run with N ranks and reused; each run
    gets a new process group whose operations time out after ``timeout`` s). ``fn`` must be
    importable from a module. ``backend="threads"``: N threads over a :class:`ThreadComm`; a
    deadlock raises :class:`DeadlockError` at once, saying what every rank waits for.
    A rank that raises makes the run raise :class:`RankError` naming the rank."""
    if not callable(fn):
        raise TypeError(f"run_ranks(fn, shards): fn must be a function fn(comm, *shard), got {type(fn).__name__}")
    if isinstance(shards, (str, bytes, torch.Tensor)) or not isinstance(shards, Sequence):
        raise TypeError("run_ranks(fn, shards): shards is a list with one entry per rank (a tuple of that "
                        f"rank's arguments), got {type(shards).__name__}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"run_ranks: timeout is a number of seconds > 0, got {timeout!r}")
    shards = [tuple(s) if isinstance(s, (tuple, list)) else (s,) for s in shards]
    n = len(shards)
    if n < 1:
        raise ValueError("run_ranks needs at least one shard (one per rank)")
    if backend == "threads":
        return _run_threads(fn, shards, timeout)
    if backend != "gloo":
        raise ValueError(f"backend must be 'threads' or 'gloo', got {backend!r}")
    _importable(fn)
    pool = _POOLS.get(n)
    if pool is None:
        pool = _POOLS[n] = _Pool(n)
    try:
        replies = pool.run(fn, shards, timeout)
    except (TimeoutError, RuntimeError):
        _POOLS.pop(n, None)
        raise
    errors = [(r, reply[1], reply[3]) for r, reply in enumerate(replies) if reply[0] == "error"]
    if any(stage == "group" for _, _, stage in errors):  # a group that could not form: the pool is suspect
        _POOLS.pop(n).close()
        message = next(m for _, m, stage in errors if stage == "group")
        raise RankError(f"the rank processes could not form a process group ({message}); they were stopped "
                        "(the next run starts new ones)")
    waiting = ("timed out", "connection closed by peer", "connection reset by peer")
    own = [(r, m) for r, m, stage in errors if stage == "run" and not any(w in m.lower() for w in waiting)]
    if own:  # the lowest rank that raised an error of its own; the others saw it leave
        raise RankError(f"rank {own[0][0]} raised {own[0][1]}")
    if any("timed out" in m.lower() for _, m, _ in errors):
        stuck = [r for r, m, _ in errors if any(w in m.lower() for w in waiting)]  # timed out, or saw one leave
        message = next(m for _, m, _ in errors if "timed out" in m.lower())
        raise DeadlockError(f"gloo timed out after {timeout:g} s on rank(s) {stuck}: the ranks were waiting "
                            f"for each other ({message})")
    if errors:
        raise RankError(f"rank {errors[0][0]} raised {errors[0][1]}")
    results = RankResults(reply[1] for reply in replies)
    results.sent = [reply[2] for reply in replies]
    results.calls = [reply[3] for reply in replies]
    results.backend = "gloo"
    return results


def _run_threads(fn, shards, timeout) -> RankResults:
    n = len(shards)
    hub = _Hub(n, timeout)
    comms = [ThreadComm(r, n, hub) for r in range(n)]
    results: list = [None] * n
    errors: dict[int, BaseException] = {}

    def rank_main(r):
        try:
            results[r] = fn(comms[r], *shards[r])
        except _Aborted:
            pass
        except BaseException as error:  # noqa: BLE001  (re-raised in the caller, naming the rank)
            errors[r] = error
            with hub.cv:
                hub.fail(error)
        finally:
            with hub.cv:
                hub.done.add(r)
                hub.waiting.pop(r, None)
                hub.cv.notify_all()

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5)
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"a rank did not finish within {timeout:g} s")
    if isinstance(hub.failure, (DeadlockError, TimeoutError)):
        raise hub.failure
    if errors:
        rank = min(errors)  # the lowest rank that raised an error of its own (the others were stopped)
        error = errors[rank]
        raise RankError(f"rank {rank} raised {type(error).__name__}: {error}") from error
    out = RankResults(results)
    out.sent = [c.sent for c in comms]
    out.calls = [c.calls for c in comms]
    out.backend = "threads"
    return out
