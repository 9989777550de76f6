"""The ranks of notebook 13 (helpers/ranks.py): what every rank holds after an exchange around a
ring, blocking sends, all_reduce (sum, max), all_gather and all_to_all on 2, 3 and 4 ranks, on
threads and on gloo processes alike, with the bytes each rank counts equal to the documented
formulas and the same on both backends; then what goes wrong: deadlocks reported at once on
threads (and by gloo's timeout on processes, after which the processes still serve), collectives
that differ between ranks, a receive of the wrong shape, a send to no other rank, a rank that
raises, an all_to_all that cannot be split; and what gloo needs (a function it can import), what
it cannot tell (a receive longer than the send) and a rank process that dies.

The rank functions are defined at the top level of this module, so that the gloo processes can
import them by name (``tests.test_ranks.<name>``). Data are integer-valued float64, so that sums
are exact whatever order a backend adds in, and the two backends can be compared with equality."""

import os
import time

import numpy as np
import pytest
import torch

from helpers.ranks import DeadlockError, RankError, RankResults, run_ranks, stop_rank_processes

BACKENDS = ("threads", "gloo")
WORLD_SIZES = (2, 3, 4)


def _shard(rank: int, shape=(4, 3)) -> torch.Tensor:
    """Rank's tensor: integer values in float64, different on every rank, none ordered by rank."""
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randint(-50, 50, shape, generator=g).double()


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


# ============================================================ the rank functions (gloo imports them)


def _all_here(comm):
    """A collective first, in functions in which a rank may finish without communicating. On gloo a
    rank that returned (or raised) and tore its group down while another was still connecting used
    to fail that rank's ``init_process_group`` and break the rank processes for every later run;
    helpers.ranks now starts and ends every run on a barrier
    (:func:`test_gloo_ranks_that_all_raise_at_once_leave_the_processes_working` holds it to that),
    and these tests do not depend on it either."""
    comm.all_reduce(torch.zeros(1))


def ring_exchange(comm, x):
    """Each rank passes x on to the next rank and receives the previous rank's."""
    n = comm.world_size
    return comm.exchange(x, (comm.rank + 1) % n, (comm.rank - 1) % n)


def ring_send_recv(comm, x):
    """The same ring with blocking send/recv, ordered so that it cannot deadlock: rank 0 sends
    first, every other rank receives first, then passes its own tensor on."""
    n, r = comm.world_size, comm.rank
    if r == 0:
        comm.send(x, 1)
        return comm.recv(x, n - 1)
    got = comm.recv(x, r - 1)
    comm.send(x, (r + 1) % n)
    return got


def reduce_sum_and_max(comm, x):
    return comm.all_reduce(x), comm.all_reduce(x, op="max")


def gather(comm, x):
    return comm.all_gather(x)


def to_all(comm, x):
    return comm.all_to_all(x)


def mixed(comm, x):
    """Every operation once, the result of one feeding the next."""
    n, r = comm.world_size, comm.rank
    a = comm.exchange(x, (r + 1) % n, (r - 1) % n)
    b = comm.all_reduce(a * (r + 1))
    c = comm.all_reduce(x - a, op="max")
    d = comm.all_gather(b[:2])
    e = comm.all_to_all(torch.cat([x] * n))
    return a, b, c, d, e


def send_then_recv(comm, x):
    """Everyone sends, then receives: a deadlock with blocking sends."""
    n = comm.world_size
    comm.send(x, (comm.rank + 1) % n)
    return comm.recv(x, (comm.rank - 1) % n)


def recv_from_rank_one(comm, x):
    """Rank 0 waits to receive from rank 1, which returns without sending."""
    return comm.recv(x, 1) if comm.rank == 0 else None


def send_to_rank_one(comm, x):
    """Rank 0 waits for rank 1 to receive its send; rank 1 returns."""
    if comm.rank == 0:
        comm.send(x, 1)


def all_reduce_on_rank_zero(comm, x):
    """Rank 0 waits in a collective that rank 1 never makes."""
    return comm.all_reduce(x) if comm.rank == 0 else None


def reduce_or_gather(comm, x):
    """Rank 0 all-reduces while the others all-gather: collective number 1 differs."""
    return comm.all_reduce(x) if comm.rank == 0 else comm.all_gather(x)


def reduce_anything(comm, x):
    """Every rank all-reduces its own x (which the test shapes differently per rank)."""
    return comm.all_reduce(x)


def recv_into(comm, x, like):
    """Rank 0 sends x to rank 1, which receives into a tensor like ``like``."""
    if comm.rank == 0:
        comm.send(x, 1)
        return None
    return comm.recv(like, 0)


def send_to(comm, x, dst):
    _all_here(comm)
    comm.send(x, dst)


def recv_from(comm, x, src):
    _all_here(comm)
    return comm.recv(x, src)


def rank_one_divides_by_zero(comm, x):
    _all_here(comm)
    if comm.rank == 1:
        raise ZeroDivisionError("rank one divided by zero on purpose")
    return x


def reduce_with(comm, x, op):
    _all_here(comm)
    return comm.all_reduce(x, op=op)


def all_to_all_after_the_others(comm, x):
    _all_here(comm)
    return comm.all_to_all(x)


def with_rank(comm, x):
    """``(rank, world size, x * rank, every rank's number)``."""
    ranks = comm.all_gather(torch.tensor([comm.rank]))
    return comm.rank, comm.world_size, x * comm.rank, ranks


# ============================================================ what every rank holds


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_exchange_around_a_ring_gives_each_rank_its_predecessors_tensor_and_counts_its_bytes(backend, n):
    xs = [_shard(r) for r in range(n)]
    res = run_ranks(ring_exchange, [(x,) for x in xs], backend=backend)
    assert isinstance(res, RankResults) and res.backend == backend and len(res) == n
    for r in range(n):
        assert torch.equal(res[r], xs[(r - 1) % n])
    assert res.sent == [96] * n                                  # 4 x 3 float64
    assert res.calls == [[("exchange", (4, 3), 96)]] * n


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_blocking_send_and_recv_in_a_safe_order_pass_a_ring_and_count_only_the_sends(backend, n):
    xs = [_shard(r, (2, 5)) for r in range(n)]
    res = run_ranks(ring_send_recv, [(x,) for x in xs], backend=backend)
    for r in range(n):
        assert torch.equal(res[r], xs[(r - 1) % n])
    assert res.sent == [80] * n                                  # a recv sends nothing
    assert res.calls == [[("send", (2, 5), 80)]] * n


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_all_reduce_sum_and_max_hold_on_every_rank_and_count_two_n_minus_one_over_n(backend, n):
    xs = [_shard(r) for r in range(n)]
    res = run_ranks(reduce_sum_and_max, [(x,) for x in xs], backend=backend)
    total, biggest = torch.stack(xs).sum(0), torch.stack(xs).amax(0)
    assert not torch.equal(total, biggest)
    for r in range(n):
        assert torch.equal(res[r][0], total) and torch.equal(res[r][1], biggest)
    per_call = 2 * (n - 1) * 96 // n                             # 96 bytes, divisible by 2, 3, 4
    assert res.sent == [2 * per_call] * n
    assert res.calls == [[("all_reduce", (4, 3), per_call)] * 2] * n


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_all_gather_stacks_every_ranks_tensor_in_rank_order_and_counts_n_minus_one_times(backend, n):
    xs = [_shard(r) for r in range(n)]
    res = run_ranks(gather, [(x,) for x in xs], backend=backend)
    for r in range(n):
        assert res[r].shape == (n, 4, 3) and torch.equal(res[r], torch.stack(xs))
    assert res.sent == [(n - 1) * 96] * n
    assert res.calls == [[("all_gather", (4, 3), (n - 1) * 96)]] * n


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_all_to_all_gives_rank_j_part_j_of_every_rank_in_sender_order_and_counts_what_travels(backend, n):
    xs = [_shard(r, (2 * n, 3)) for r in range(n)]               # two rows for each rank
    res = run_ranks(to_all, [(x,) for x in xs], backend=backend)
    for j in range(n):
        expected = torch.cat([xs[i][2 * j:2 * j + 2] for i in range(n)])
        assert torch.equal(res[j], expected)
    nbytes = 2 * n * 3 * 8
    assert res.sent == [(n - 1) * nbytes // n] * n                # the part kept at home stays
    assert res.calls == [[("all_to_all", (2 * n, 3), (n - 1) * nbytes // n)]] * n


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_threads_and_gloo_give_identical_results_and_identical_byte_counts(n):
    xs = [_shard(r) for r in range(n)]
    threads = run_ranks(mixed, [(x,) for x in xs], backend="threads")
    gloo = run_ranks(mixed, [(x,) for x in xs], backend="gloo")
    for r in range(n):
        assert len(threads[r]) == len(gloo[r]) == 5
        for a, b in zip(threads[r], gloo[r]):
            assert a.dtype == b.dtype and torch.equal(a, b)
    assert threads.sent == gloo.sent and threads.calls == gloo.calls
    assert [op for op, _, _ in threads.calls[0]] == ["exchange", "all_reduce", "all_reduce", "all_gather",
                                                      "all_to_all"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_rank_knows_its_rank_and_the_world_size_and_shards_need_not_be_tuples(backend):
    res = run_ranks(with_rank, [torch.ones(2)] * 3, backend=backend)    # a bare tensor per rank
    assert [(r, n) for r, n, _, _ in res] == [(0, 3), (1, 3), (2, 3)]
    assert [t.tolist() for _, _, t, _ in res] == [[0, 0], [1, 1], [2, 2]]
    assert [ranks.tolist() for _, _, _, ranks in res] == [[[0], [1], [2]]] * 3
    assert res.sent == [16, 16, 16] and res.calls == [[("all_gather", (1,), 16)]] * 3   # 2 x 8 bytes


def test_run_ranks_refuses_an_unknown_backend_no_ranks_and_arguments_the_wrong_way_round():
    with pytest.raises(ValueError, match="backend must be 'threads' or 'gloo', got 'nccl'"):
        run_ranks(ring_exchange, [(torch.ones(1),)] * 2, backend="nccl")
    with pytest.raises(ValueError, match="at least one shard"):
        run_ranks(ring_exchange, [])
    with pytest.raises(TypeError, match="fn must be a function fn\\(comm, \\*shard\\), got list"):
        run_ranks([(torch.ones(1),)] * 2, ring_exchange)
    with pytest.raises(TypeError, match="shards is a list with one entry per rank .* got Tensor"):
        run_ranks(ring_exchange, torch.ones(2, 3))


def test_threads_run_any_function_a_lambda_and_a_nested_one_included():
    def nested(comm, x):
        return comm.all_reduce(x)

    assert [t.item() for t in run_ranks(nested, [torch.tensor(1.0), torch.tensor(2.0)])] == [3.0, 3.0]
    got = run_ranks(lambda comm, x: comm.all_gather(x), [torch.tensor(1.0), torch.tensor(2.0)])
    assert [t.tolist() for t in got] == [[1.0, 2.0]] * 2


# ============================================================ deadlocks (threads)


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_threads_everyone_sends_then_receives_is_a_deadlock_reported_at_once_naming_every_rank(n):
    start = time.monotonic()
    with pytest.raises(DeadlockError) as info:
        run_ranks(send_then_recv, [(torch.ones(3),)] * n, backend="threads")
    assert time.monotonic() - start < 0.5
    message = str(info.value)
    for r in range(n):
        assert f"rank {r} waits to send to rank {(r + 1) % n}" in message


@pytest.mark.parametrize("fn, waits", [
    (recv_from_rank_one, "rank 0 waits to receive from rank 1"),
    (send_to_rank_one, "rank 0 waits to send to rank 1"),
    (all_reduce_on_rank_zero, "rank 0 waits to all_reduce(sum)"),
])
def test_threads_a_rank_waiting_on_a_rank_that_has_returned_is_a_deadlock_too(fn, waits):
    start = time.monotonic()
    with pytest.raises(DeadlockError) as info:
        run_ranks(fn, [(torch.ones(3),)] * 2, backend="threads")
    assert time.monotonic() - start < 0.5
    assert waits in str(info.value) and "rank 1 has returned" in str(info.value)


# ============================================================ mistakes that raise


def test_threads_collectives_that_differ_between_ranks_raise_a_value_error_naming_the_ranks():
    with pytest.raises(RankError) as info:
        run_ranks(reduce_or_gather, [(torch.ones(2, 3),)] * 3, backend="threads")
    assert isinstance(info.value.__cause__, ValueError)
    message = str(info.value)
    assert "collective number 1 differs between ranks" in message
    assert "rank 0: all_reduce(sum) of a [2, 3] float32" in message
    assert "rank 1: all_gather of a [2, 3] float32" in message and "rank 2: all_gather" in message


@pytest.mark.parametrize("second", [torch.ones(3, 2), torch.ones(2, 3, dtype=torch.float64)],
                         ids=["shape", "dtype"])
def test_threads_one_collective_on_tensors_of_different_shape_or_dtype_raises_naming_the_ranks(second):
    with pytest.raises(RankError) as info:
        run_ranks(reduce_anything, [(torch.ones(2, 3),), (second,)], backend="threads")
    assert isinstance(info.value.__cause__, ValueError)
    message = str(info.value)
    assert "rank 0: all_reduce(sum) of a [2, 3] float32" in message
    assert f"rank 1: all_reduce(sum) of a {list(second.shape)} {str(second.dtype)[6:]}" in message


@pytest.mark.parametrize("like", [torch.zeros(5), torch.zeros(2), torch.zeros(3, dtype=torch.float64)],
                         ids=["longer", "shorter", "dtype"])
def test_threads_a_recv_unlike_what_was_sent_raises_saying_both_sides(like):
    with pytest.raises(RankError) as info:
        run_ranks(recv_into, [(torch.ones(3), like)] * 2, backend="threads")
    assert isinstance(info.value.__cause__, ValueError)
    assert str(info.value).startswith("rank 1 raised ValueError")
    assert (f"rank 1 receives a {list(like.shape)} {str(like.dtype)[6:]} from rank 0, which sent a [3] float32"
            in str(info.value))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("peer, says", [
    ("itself", "is the rank itself"),
    (3, "must be a rank in 0..2, got 3"),
    (-1, "must be a rank in 0..2, got -1"),
    (True, "must be a rank in 0..2, got True"),
])
def test_a_send_or_recv_to_itself_or_to_no_rank_raises_a_value_error(backend, peer, says):
    for fn, what in ((send_to, "dst"), (recv_from, "src")):
        shards = [(torch.ones(2), r if peer == "itself" else peer) for r in range(3)]
        with pytest.raises(RankError, match=rf"^rank (\d) raised ValueError: rank \1: {what} {says}") as info:
            run_ranks(fn, shards, backend=backend)
        if backend == "threads":
            assert isinstance(info.value.__cause__, ValueError)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rank_that_raises_gives_a_rank_error_naming_the_rank_and_the_original_error(backend):
    with pytest.raises(RankError) as info:
        run_ranks(rank_one_divides_by_zero, [(torch.ones(2),)] * 2, backend=backend)
    assert str(info.value) == "rank 1 raised ZeroDivisionError: rank one divided by zero on purpose"
    if backend == "threads":
        assert isinstance(info.value.__cause__, ZeroDivisionError)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_all_to_all_whose_dim_0_is_not_a_multiple_of_the_ranks_raises_a_clear_value_error(backend, n):
    with pytest.raises(RankError, match=rf"ValueError: rank \d: all_to_all splits dim 0 into {n} equal parts") as info:
        run_ranks(all_to_all_after_the_others, [(torch.ones(n + 1, 2, dtype=torch.float64),)] * n, backend=backend)
    assert f"the tensor is [{n + 1}, 2] float64, and dim 0 is not a multiple of {n}" in str(info.value)
    with pytest.raises(RankError, match="all_to_all splits dim 0"):
        run_ranks(all_to_all_after_the_others, [(torch.tensor(1.0),)] * n, backend=backend)   # no dim 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_reduce_knows_only_sum_and_max(backend):
    with pytest.raises(RankError, match="all_reduce: op must be 'sum' or 'max', got 'mean'"):
        run_ranks(reduce_with, [(torch.ones(2), "mean")] * 2, backend=backend)


def exchange_after_the_others(comm, x):
    _all_here(comm)
    return ring_exchange(comm, x)


def gather_after_the_others(comm, x):
    _all_here(comm)
    return comm.all_gather(x)


@pytest.mark.parametrize("backend", BACKENDS)
def test_only_tensors_travel(backend):
    with pytest.raises(RankError, match=r"^rank (\d) raised TypeError: rank \1: .*tensors?, got list"):
        run_ranks(exchange_after_the_others, [([1, 2],)] * 2, backend=backend)
    with pytest.raises(RankError, match=r"^rank (\d) raised TypeError: rank \1: all_gather takes a tensor, got int"):
        run_ranks(gather_after_the_others, [(7,)] * 2, backend=backend)


# ============================================================ gloo: what it runs, and after a failure


def test_gloo_runs_a_function_of_this_module_which_its_processes_import_by_name():
    assert ring_exchange.__module__ == "tests.test_ranks"
    res = run_ranks(ring_exchange, [(torch.full((2,), float(r)),) for r in range(2)], backend="gloo")
    assert res.backend == "gloo" and [t.tolist() for t in res] == [[1.0, 1.0], [0.0, 0.0]]


def test_gloo_refuses_a_lambda_or_a_nested_function_and_points_to_threads():
    def nested(comm, x):
        return x

    for fn in (nested, lambda comm, x: x):
        with pytest.raises(ValueError, match="backend='threads'") as info:
            run_ranks(fn, [(torch.ones(1),)] * 2, backend="gloo")
        assert "cannot import a function defined in a notebook or inside another function" in str(info.value)


def test_gloo_results_are_plain_tensors_that_outlive_the_run_and_the_next_one():
    first = run_ranks(with_rank, [(torch.arange(4.0),)] * 2, backend="gloo")
    second = run_ranks(with_rank, [(torch.full((4,), -1.0),)] * 2, backend="gloo")   # the ranks move on
    for r, (rank, n, t, ranks) in enumerate(first):
        assert (rank, n) == (r, 2) and ranks.tolist() == [[0], [1]]
        assert type(t) is torch.Tensor and not t.is_shared()
        assert t.tolist() == [0.0, 1.0 * r, 2.0 * r, 3.0 * r]
    assert [t.tolist() for _, _, t, _ in second] == [[-0.0] * 4, [-1.0] * 4]


@pytest.mark.slow
def test_gloo_everyone_sends_then_receives_times_out_as_a_deadlock_and_the_processes_still_serve():
    start = time.monotonic()
    with pytest.raises(DeadlockError, match=r"gloo timed out after 2 s on rank\(s\) \[0, 1, 2\]"):
        run_ranks(send_then_recv, [(torch.ones(3),)] * 3, backend="gloo", timeout=2)
    assert time.monotonic() - start < 10
    xs = [_shard(r) for r in range(3)]
    res = run_ranks(ring_exchange, [(x,) for x in xs], backend="gloo")
    assert all(torch.equal(res[r], xs[(r - 1) % 3]) for r in range(3))


def test_gloo_a_recv_longer_than_the_send_cannot_tell_and_fills_only_the_start_as_documented():
    """Comm.recv: threads raise (above); gloo cannot tell, and a shorter message fills the start of
    the buffer only (the rest is whatever the empty buffer held)."""
    res = run_ranks(recv_into, [(torch.tensor([1.0, 2.0, 3.0]), torch.zeros(5))] * 2, backend="gloo", timeout=5)
    assert res[0] is None and res[1].shape == (5,) and res[1][:3].tolist() == [1.0, 2.0, 3.0]


def recv_shorter_than_sent(comm, x):
    """Rank 1 receives 2 values where rank 0 sends 3: gloo aborts rank 1's process."""
    return recv_into(comm, x, torch.zeros(2))


def rank_one_exits(comm, x):
    """Rank 1's process dies (as when gloo aborts it, or it runs out of memory)."""
    _all_here(comm)
    if comm.rank == 1:
        os._exit(3)
    return x


@pytest.mark.slow
@pytest.mark.parametrize("fn", [recv_shorter_than_sent, rank_one_exits])
def test_gloo_a_rank_process_that_dies_is_reported_as_that_rank_and_the_next_run_works(fn):
    try:
        with pytest.raises(RankError, match="^rank 1's process ended without replying"):
            run_ranks(fn, [(torch.ones(3),)] * 2, backend="gloo", timeout=5)
        res = run_ranks(ring_exchange, [(torch.full((2,), float(r)),) for r in range(2)], backend="gloo")
        assert [t.tolist() for t in res] == [[1.0, 1.0], [0.0, 0.0]]
    finally:
        stop_rank_processes()                                    # never leave a broken pool behind


@pytest.mark.slow  # two fresh interpreters importing torch (the Windows path), a few seconds
def test_gloo_ranks_started_by_spawn_run_the_same_and_are_replaced_by_the_next_method(monkeypatch):
    """Where there is no forkserver (Windows), rank processes start by spawn: fresh interpreters
    that import the function by name. The same ring, the same bytes."""
    import helpers.ranks as ranks

    stop_rank_processes()
    monkeypatch.setattr(ranks, "start_method", lambda: "spawn")
    try:
        xs = [torch.full((3,), float(r)) for r in range(2)]
        res = run_ranks(ring_exchange, [(x,) for x in xs], backend="gloo")
        assert ranks._POOLS[2].method == "spawn"
        assert [t.tolist() for t in res] == [[1.0] * 3, [0.0] * 3] and res.sent == [12.0, 12.0]
    finally:
        stop_rank_processes()
    monkeypatch.undo()
    res = run_ranks(ring_exchange, [(torch.ones(2),), (torch.zeros(2),)], backend="gloo")
    assert ranks._POOLS[2].method == ranks.start_method() and [t.tolist() for t in res] == [[0.0, 0.0], [1.0, 1.0]]


def overwrite_sent(comm, x):
    comm.sent = 0.0
    return x


def bool_sum(comm, x):
    return comm.all_reduce(x)


def to_an_index(comm, x, make):
    return comm.exchange(x, make((comm.rank + 1) % comm.world_size), make((comm.rank - 1) % comm.world_size))


def returns_a_generator(comm, x):
    return (y for y in x)


def test_the_bytes_a_rank_sent_cannot_be_overwritten_by_its_function():
    with pytest.raises(RankError, match="AttributeError"):
        run_ranks(overwrite_sent, [(torch.ones(1),)] * 2)


@pytest.mark.parametrize("make", [int, np.int64, lambda r: torch.tensor(r)], ids=["int", "numpy", "torch-0d"])
def test_a_rank_may_be_named_by_any_integer_scalar(make):
    res = run_ranks(to_an_index, [(torch.full((2,), float(r)), make) for r in range(3)])
    assert [t.tolist() for t in res] == [[2.0, 2.0], [0.0, 0.0], [1.0, 1.0]]
    with pytest.raises(RankError, match=r"dst must be a rank in 0\.\.1, got 1\.0"):
        run_ranks(to_an_index, [(torch.ones(1), float)] * 2)


@pytest.mark.parametrize("timeout", [0, -1, "20", None, True])
def test_a_timeout_that_is_not_a_positive_number_is_refused_before_anything_runs(timeout):
    with pytest.raises(ValueError, match="timeout is a number of seconds > 0"):
        run_ranks(ring_exchange, [(torch.ones(1),)] * 2, timeout=timeout)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_all_reduce_of_bools_keeps_their_dtype_on_both_backends(backend):
    res = run_ranks(bool_sum, [(torch.tensor([True, False]),), (torch.tensor([False, False]),)], backend=backend)
    assert all(t.dtype == torch.bool and t.tolist() == [True, False] for t in res)


def test_gloo_a_result_that_cannot_travel_back_is_named_and_the_processes_stay():
    with pytest.raises(RankError, match="what rank 0 returned cannot be sent back to the notebook"):
        run_ranks(returns_a_generator, [(torch.ones(2),)] * 2, backend="gloo")
    res = run_ranks(ring_exchange, [(torch.full((2,), float(r)),) for r in range(2)], backend="gloo")
    assert [t.tolist() for t in res] == [[1.0, 1.0], [0.0, 0.0]]


def raise_at_once(comm, x):
    raise ValueError(f"rank {comm.rank} refuses")


@pytest.mark.slow  # 30 gloo runs
def test_gloo_ranks_that_all_raise_at_once_leave_the_processes_working():
    for _ in range(30):
        with pytest.raises(RankError, match="rank 0 raised ValueError: rank 0 refuses"):
            run_ranks(raise_at_once, [(torch.ones(1),)] * 3, backend="gloo", timeout=5)
    res = run_ranks(ring_exchange, [(torch.full((1,), float(r)),) for r in range(3)], backend="gloo")
    assert [t.item() for t in res] == [2.0, 0.0, 1.0]
