"""Notebook 13, attention across devices (helpers/nb13_across_devices.py): the layouts of a
sequence over ranks and the causal work they give each rank at each ring step; every scheme equal
to attention in one process (float64, to 1e-12) on 2, 3 and 4 ranks: ring attention forward in
every layout and its backward against autograd, DeepSpeed-Ulysses with fewer, as many and more
key/value heads than ranks, Megatron tensor parallelism, decoding over a cache split between ranks
(a rank may hold none of it); one run of ring and Ulysses on gloo processes; the cost model:
the bytes :func:`comm_bytes_per_rank` and :func:`decode_bytes_per_rank` predict are the bytes the
communicators count, forward and backward (the backwards of Ulysses and of tensor parallelism
written out here with the lesson's all-to-alls and all-reduce), and the block length at which a
ring step hides its transfer; then the notebook's demonstrations (what each collective leaves on
each rank, the blocking-send deadlock, PyTorch's own tensor parallelism on gloo). The schemes run
on threads (:func:`helpers.ranks.run_ranks`) unless a test says gloo."""

import math

import pytest
import torch
import torch.nn.functional as F

from helpers.nb06_kv_sharing import repeat_kv
from helpers.nb13_across_devices import (
    LAYOUTS,
    POSITION_BYTES,
    DeadlockError,
    RankError,
    TinyAttention,
    attend_block,
    causal_pairs,
    comm_bytes_per_rank,
    decode_across_ranks,
    decode_bytes_per_rank,
    dtensor_tensor_parallel,
    even_ranks_send_first,
    heads_to_seq,
    ring_attention,
    ring_attention_backward,
    ring_attention_forward_backward,
    ring_overlap_tokens,
    run_ranks,
    send_then_receive,
    seq_to_heads,
    shard_positions,
    tp_attention,
    ulysses_attention,
    watch_collective,
    zigzag_positions,
)
from tests.exercise_cases import assert_accepted, assert_rejected, right_cases, wrong_cases

ATOL = 1e-12
WORLD_SIZES = (2, 3, 4)


def _randn(*shape, seed: int, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def _qkv(B, H, H_kv, T, d, seed=0, dtype=torch.float64):
    return _randn(B, H, T, d, seed=seed, dtype=dtype), _randn(B, H_kv, T, d, seed=seed + 1, dtype=dtype), \
        _randn(B, H_kv, T, d, seed=seed + 2, dtype=dtype)


def _reference(q, k, v, causal):
    """Attention in one process: ``(out, lse)``, out from torch's SDPA, lse from the full scores."""
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    k_all = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = q @ k_all.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        T = q.shape[2]
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
    return out, torch.logsumexp(scores, dim=-1)


def _divides(T, n, layout):
    return T % (2 * n if layout == "zigzag" else n) == 0


def _place(parts, positions, like):
    """The ranks' shards ``[B, h, T/N, ...]`` put back at their global positions."""
    full = torch.full_like(like, math.nan)
    for part, pos in zip(parts, positions):
        full[:, :, pos] = part
    return full


def _contiguous(T, n):
    return [shard_positions(T, n, r) for r in range(n)]


# ============================================================ rank functions (gloo imports them by name)


def ring_forward_backward(comm, q, k, v, positions, grad_out, causal):
    """Ring attention forward then backward: ``(out, lse, dq, dk, dv, forward bytes, backward bytes)``."""
    out, lse = ring_attention(comm, q, k, v, positions, causal)
    forward = comm.sent
    dq, dk, dv = ring_attention_backward(comm, q, k, v, positions, out, lse, grad_out, causal)
    return out, lse, dq, dk, dv, forward, comm.sent - forward


def ulysses_forward_backward(comm, q, k, v, grad_out, causal):
    """Ulysses forward as :func:`ulysses_attention` does it, keeping the rank's heads for the
    backward, then the backward's four all-to-alls: dO to heads, dq, dk, dv back to sequence
    shards (dk, dv of replicated kv heads summed over their copies):
    ``(out, dq, dk, dv, forward bytes, backward bytes)``."""
    n, (B, H_kv, t, d) = comm.world_size, k.shape
    rep = 1 if H_kv % n == 0 else n // H_kv
    q_h, k_h, v_h = (seq_to_heads(comm, x).requires_grad_() for x in (q, repeat_kv(k, rep), repeat_kv(v, rep)))
    o_h = F.scaled_dot_product_attention(q_h, k_h, v_h, is_causal=causal, enable_gqa=True)
    out = heads_to_seq(comm, o_h.detach())
    forward = comm.sent
    dq_h, dk_h, dv_h = torch.autograd.grad(o_h, (q_h, k_h, v_h), seq_to_heads(comm, grad_out))
    dq, dk, dv = (heads_to_seq(comm, g) for g in (dq_h, dk_h, dv_h))
    dk, dv = (g.reshape(B, H_kv, rep, t, d).sum(2) for g in (dk, dv))
    return out, dq, dk, dv, forward, comm.sent - forward


class _OwnShare:
    """A communicator whose all_reduce keeps the rank's own tensor (and its autograd graph)."""

    def __init__(self, comm):
        self.rank, self.world_size = comm.rank, comm.world_size

    def all_reduce(self, x, op="sum"):
        return x


def tp_forward_backward(comm, x, w_q, w_k, w_v, w_o, n_heads, n_kv_heads, grad_out, causal):
    """Megatron forward (:func:`tp_attention`), then its backward's one all-reduce: the sum of the
    ranks' gradients of the input through their own heads: ``(out, dx, forward bytes, backward bytes)``."""
    out = tp_attention(comm, x, w_q, w_k, w_v, w_o, n_heads, n_kv_heads, causal)
    forward = comm.sent
    x = x.detach().requires_grad_()
    partial = tp_attention(_OwnShare(comm), x, w_q, w_k, w_v, w_o, n_heads, n_kv_heads, causal)
    (dx_share,) = torch.autograd.grad(partial, x, grad_out)
    dx = comm.all_reduce(dx_share)
    return out, dx, forward, comm.sent - forward


# ============================================================ the lesson code: shards of a sequence


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_partitions_the_sequence_into_equal_shards(layout):
    for n in range(1, 6):
        for T in (2 * n, 4 * n, 6 * n):
            shards = [shard_positions(T, n, r, layout) for r in range(n)]
            assert all(s.dtype == torch.int64 and s.shape == (T // n,) for s in shards)
            assert torch.equal(torch.cat(shards).sort().values, torch.arange(T)), (layout, T, n)
            assert all(bool((s[1:] > s[:-1]).all()) for s in shards)        # increasing


def test_the_three_layouts_hold_the_positions_they_promise():
    assert [shard_positions(12, 3, r).tolist() for r in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert [shard_positions(12, 3, r, "striped").tolist() for r in range(3)] == [
        [0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8, 11]]
    zigzag = [[0, 1, 10, 11], [2, 3, 8, 9], [4, 5, 6, 7]]                  # chunks r and 2N-1-r of 2
    assert [zigzag_positions(12, 3, r).tolist() for r in range(3)] == zigzag
    assert [shard_positions(12, 3, r, "zigzag").tolist() for r in range(3)] == zigzag
    assert zigzag_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]


def test_shards_that_cannot_be_equal_and_unknown_layouts_are_refused():
    with pytest.raises(ValueError, match="T=12 tokens cannot be cut into 8 equal parts"):
        zigzag_positions(12, 4, 0)
    with pytest.raises(ValueError, match=r"shard_positions\('striped'\): T=10 tokens cannot be cut into 4"):
        shard_positions(10, 4, 0, "striped")
    with pytest.raises(ValueError, match="layout must be one of"):
        shard_positions(12, 3, 0, "diagonal")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_causal_pairs_over_all_steps_and_ranks_total_the_causal_triangle(layout, n):
    for T in (2 * n, 4 * n, 8 * n):
        pairs = causal_pairs(T, n, layout)
        assert pairs.shape == (n, n) and pairs.dtype == torch.int64
        assert int(pairs.sum()) == T * (T + 1) // 2


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_causal_pairs_per_step_match_their_closed_forms_and_only_zigzag_is_balanced(n):
    T = 4 * n
    t, c = T // n, T // (2 * n)
    contiguous, striped, zigzag = (causal_pairs(T, n, layout) for layout in ("contiguous", "striped", "zigzag"))
    for s in range(n):
        for r in range(n):
            assert contiguous[s, r] == (t * (t + 1) // 2 if s == 0 else t * t if r >= s else 0)
            assert striped[s, r] == (t * (t + 1) // 2 if r >= s else t * (t - 1) // 2)
            assert zigzag[s, r] == (c * (c + 1) + c * c if s == 0 else 2 * c * c)
    assert all(len(set(row.tolist())) == 1 for row in zigzag)              # every step: equal work
    assert not all(len(set(row.tolist())) == 1 for row in contiguous)
    assert not all(len(set(row.tolist())) == 1 for row in striped)


def test_a_block_with_no_allowed_key_gives_zero_and_minus_infinity_never_nan():
    q, k, v = _qkv(1, 2, 1, 3, 4)
    out, lse = attend_block(q, k, v, torch.tensor([0, 1, 2]), torch.tensor([5, 6, 7]), causal=True)
    assert torch.equal(out, torch.zeros_like(out)) and bool(torch.isneginf(lse).all())
    out, lse = attend_block(q, k, v, torch.tensor([0, 1, 2]), torch.tensor([5, 6, 7]), causal=False)
    ref_out, ref_lse = _reference(q, k, v, causal=False)
    assert torch.allclose(out, ref_out, atol=ATOL, rtol=0) and torch.allclose(lse, ref_lse, atol=ATOL, rtol=0)


# ============================================================ the schemes, exact against one process


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_ring_attention_forward_equals_one_process_in_every_layout(n, layout, causal, heads):
    T = 24
    assert _divides(T, n, layout)
    q, k, v = _qkv(2, *heads, T, 8, seed=n)
    positions = [shard_positions(T, n, r, layout) for r in range(n)]
    res = run_ranks(ring_attention, [(q[:, :, p], k[:, :, p], v[:, :, p], p, causal) for p in positions])
    ref_out, ref_lse = _reference(q, k, v, causal)
    out = _place([o for o, _ in res], positions, q)
    lse = _place([l[..., None] for _, l in res], positions, ref_lse[..., None])[..., 0]
    assert torch.allclose(out, ref_out, atol=ATOL, rtol=0)
    assert torch.allclose(lse, ref_lse, atol=ATOL, rtol=0)


@pytest.mark.parametrize("heads", [(4, 2), (2, 2)], ids=["gqa", "mha"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_ring_attention_backward_equals_autograd_in_every_layout(n, layout, causal, heads):
    T = 24
    q, k, v = (t.requires_grad_() for t in _qkv(2, *heads, T, 8, seed=10 + n))
    grad_out = _randn(*q.shape, seed=20 + n)
    F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True).backward(grad_out)
    positions = [shard_positions(T, n, r, layout) for r in range(n)]
    res = run_ranks(ring_attention_forward_backward, [(q.detach()[:, :, p], k.detach()[:, :, p], v.detach()[:, :, p],
                                                       p, grad_out[:, :, p], causal) for p in positions])
    for i, leaf in ((2, q), (3, k), (4, v)):
        got = _place([r[i] for r in res], positions, leaf.detach())
        assert torch.allclose(got, leaf.grad, atol=ATOL, rtol=0), ("dq", "dk", "dv")[i - 2]


ULYSSES_HEADS = [  # (N, H, H_kv): kv heads fewer than, as many as, more than the ranks
    (2, 4, 1), (2, 4, 2), (2, 4, 4),
    (3, 6, 1), (3, 6, 3), (3, 6, 6),
    (4, 8, 1), (4, 8, 2), (4, 8, 4), (4, 8, 8),
]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("n, H, H_kv", ULYSSES_HEADS)
def test_ulysses_equals_one_process_with_fewer_as_many_and_more_kv_heads_than_ranks(n, H, H_kv, causal):
    T = 24
    q, k, v = _qkv(2, H, H_kv, T, 4, seed=H_kv)
    positions = _contiguous(T, n)
    res = run_ranks(ulysses_attention, [(q[:, :, p], k[:, :, p], v[:, :, p], causal) for p in positions])
    ref, _ = _reference(q, k, v, causal)
    assert all(o.shape == (2, H, T // n, 4) for o in res)
    assert torch.allclose(torch.cat(list(res), dim=2), ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("n, H, H_kv", [(2, 4, 1), (3, 6, 3), (4, 8, 2), (2, 4, 4)])
def test_ulysses_all_to_alls_move_heads_and_sequence_and_back_and_their_backward_equals_autograd(n, H, H_kv):
    T = 12
    q, k, v = (t.requires_grad_() for t in _qkv(1, H, H_kv, T, 4, seed=30))
    grad_out = _randn(*q.shape, seed=31)
    F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(grad_out)
    positions = _contiguous(T, n)
    res = run_ranks(ulysses_forward_backward, [(q.detach()[:, :, p], k.detach()[:, :, p], v.detach()[:, :, p],
                                                grad_out[:, :, p], True) for p in positions])
    ref, _ = _reference(q.detach(), k.detach(), v.detach(), True)
    assert torch.allclose(torch.cat([r[0] for r in res], dim=2), ref, atol=ATOL, rtol=0)
    for i, leaf in ((1, q), (2, k), (3, v)):
        assert torch.allclose(torch.cat([r[i] for r in res], dim=2), leaf.grad, atol=ATOL, rtol=0)


def _tp_weights(H, H_kv, d, D, seed):
    return (_randn(D, H * d, seed=seed) / D ** 0.5, _randn(D, H_kv * d, seed=seed + 1) / D ** 0.5,
            _randn(D, H_kv * d, seed=seed + 2) / D ** 0.5, _randn(H * d, D, seed=seed + 3) / D ** 0.5)


def _one_process_layer(x, w_q, w_k, w_v, w_o, H, H_kv, causal):
    B, T, _ = x.shape

    def heads(t):
        return t.view(B, T, -1, w_q.shape[1] // H).transpose(1, 2)

    q, k, v = heads(x @ w_q), heads(x @ w_k), heads(x @ w_v)
    o, _ = _reference(q, k, v, causal)
    return o.transpose(1, 2).reshape(B, T, -1) @ w_o


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("n, H, H_kv", [(2, 4, 1), (2, 4, 2), (2, 4, 4), (3, 6, 1), (3, 6, 3), (3, 6, 6),
                                        (4, 4, 1), (4, 8, 2), (4, 8, 4), (4, 8, 8)])
def test_tensor_parallel_attention_equals_one_process_with_kv_heads_replicated_when_fewer(n, H, H_kv, causal):
    B, T, d, D = 2, 12, 4, 20
    x = _randn(B, T, D, seed=40)
    weights = _tp_weights(H, H_kv, d, D, seed=41)
    res = run_ranks(tp_attention, [(x, *weights, H, H_kv, causal)] * n)
    ref = _one_process_layer(x, *weights, H, H_kv, causal)
    for out in res:
        assert out.shape == (B, T, D) and torch.allclose(out, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("n, H, H_kv", [(2, 4, 1), (3, 6, 3), (4, 8, 2)])
def test_tensor_parallel_backward_is_one_all_reduce_of_the_input_gradient(n, H, H_kv):
    B, T, d = 1, 8, 4
    D = H * d
    x = _randn(B, T, D, seed=50).requires_grad_()
    weights = _tp_weights(H, H_kv, d, D, seed=51)
    grad_out = _randn(B, T, D, seed=55)
    _one_process_layer(x, *weights, H, H_kv, True).backward(grad_out)
    res = run_ranks(tp_forward_backward, [(x.detach(), *weights, H, H_kv, grad_out, True)] * n)
    for _, dx, _, _ in res:
        assert torch.allclose(dx, x.grad, atol=ATOL, rtol=0)


@pytest.mark.parametrize("split", [(0, 24), (10, 14), (7, 0, 17), (8, 8, 8), (5, 0, 0, 19), (6, 6, 6, 6)])
def test_decoding_over_a_split_cache_equals_one_process_even_when_a_rank_holds_none_of_it(split):
    B, H, H_kv, T, d = 2, 4, 2, sum(split), 8
    _, k, v = _qkv(B, H, H_kv, T, d, seed=60)
    q = _randn(B, H, 1, d, seed=63)
    parts = list(zip(k.split(list(split), dim=2), v.split(list(split), dim=2)))
    res = run_ranks(decode_across_ranks, [(q, kr, vr) for kr, vr in parts])
    ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    for out in res:                                                        # the same on every rank
        assert out.shape == (B, H, 1, d) and torch.allclose(out, ref, atol=ATOL, rtol=0)
    assert res.sent == pytest.approx([decode_bytes_per_rank(B, H, d, len(split), 8)] * len(split), rel=1e-12)


@pytest.mark.slow
def test_ring_and_ulysses_on_gloo_processes_equal_one_process_and_count_what_threads_count():
    T, n = 24, 3
    q, k, v = _qkv(2, 6, 3, T, 8, seed=70)
    ref_out, _ = _reference(q, k, v, True)
    positions = [zigzag_positions(T, n, r) for r in range(n)]
    ring_shards = [(q[:, :, p], k[:, :, p], v[:, :, p], p, True) for p in positions]
    gloo = run_ranks(ring_attention, ring_shards, backend="gloo")
    assert gloo.backend == "gloo"
    assert torch.allclose(_place([o for o, _ in gloo], positions, q), ref_out, atol=ATOL, rtol=0)
    assert gloo.sent == run_ranks(ring_attention, ring_shards).sent
    ulysses_shards = [(q[:, :, p], k[:, :, p], v[:, :, p], True) for p in _contiguous(T, n)]
    gloo = run_ranks(ulysses_attention, ulysses_shards, backend="gloo")
    assert torch.allclose(torch.cat(list(gloo), dim=2), ref_out, atol=ATOL, rtol=0)
    assert gloo.sent == run_ranks(ulysses_attention, ulysses_shards).sent


# ============================================================ the cost model against what is counted


COUNT_CASES = [  # (N, T, H, H_kv, batch, dtype)
    (2, 8, 2, 1, 1, torch.float64),
    (3, 12, 6, 3, 2, torch.float32),
    (4, 16, 8, 2, 1, torch.float64),
    (2, 48, 4, 4, 3, torch.bfloat16),
    (4, 24, 4, 4, 2, torch.float16),
    (3, 18, 3, 1, 1, torch.float32),
]
COUNT_IDS = [f"N{n}-T{T}-H{H}-kv{kv}-B{b}-{str(dt)[6:]}" for n, T, H, kv, b, dt in COUNT_CASES]


@pytest.mark.parametrize("n, T, H, H_kv, B, dtype", COUNT_CASES, ids=COUNT_IDS)
def test_ring_bytes_predicted_are_the_bytes_counted_forward_and_backward(n, T, H, H_kv, B, dtype):
    d = 4
    q, k, v = _qkv(B, H, H_kv, T, d, seed=80, dtype=dtype)
    positions = _contiguous(T, n)
    res = run_ranks(ring_forward_backward, [(q[:, :, p], k[:, :, p], v[:, :, p], p, q[:, :, p], True)
                                            for p in positions])
    size = q.element_size()
    forward = comm_bytes_per_rank("ring", T, H, H_kv, d, n, size, B)
    backward = comm_bytes_per_rank("ring", T, H, H_kv, d, n, size, B, backward=True)
    assert [r[5] for r in res] == [forward] * n and [r[6] for r in res] == [backward] * n
    assert res.sent == [forward + backward] * n
    t = T // n                                                             # by hand: K, V and positions
    assert forward == (n - 1) * (2 * B * H_kv * t * d * size + POSITION_BYTES * t)


def _ulysses_counted(n, T, H, H_kv, B, dtype, d=4):
    """What each rank counts: ``(ulysses_attention's bytes, [(forward, backward) bytes of
    ulysses_forward_backward]``)."""
    q, k, v = _qkv(B, H, H_kv, T, d, seed=90, dtype=dtype)
    positions = _contiguous(T, n)
    attention = run_ranks(ulysses_attention, [(q[:, :, p], k[:, :, p], v[:, :, p], True) for p in positions])
    both = run_ranks(ulysses_forward_backward, [(q[:, :, p], k[:, :, p], v[:, :, p], q[:, :, p], True)
                                                for p in positions])
    return attention.sent, [(r[4], r[5]) for r in both]


def _tp_counted(n, T, H, H_kv, B, dtype, d=4):
    """``[(forward, backward) bytes]`` each rank counts in :func:`tp_forward_backward`, D = H d."""
    D = H * d
    x = _randn(B, T, D, seed=100, dtype=dtype)
    weights = [w.to(dtype) for w in _tp_weights(H, H_kv, d, D, seed=101)]
    return [(r[2], r[3]) for r in run_ranks(tp_forward_backward, [(x, *weights, H, H_kv, x, True)] * n)]


@pytest.mark.parametrize("n, T, H, H_kv, B, dtype", COUNT_CASES, ids=COUNT_IDS)
def test_ulysses_forward_bytes_predicted_are_the_bytes_counted(n, T, H, H_kv, B, dtype):
    d, size = 4, dtype.itemsize
    attention, both = _ulysses_counted(n, T, H, H_kv, B, dtype, d)
    forward = comm_bytes_per_rank("ulysses", T, H, H_kv, d, n, size, B)
    assert attention == pytest.approx([forward] * n, rel=1e-12)
    assert [f for f, _ in both] == pytest.approx([forward] * n, rel=1e-12)
    kv = H_kv if H_kv % n == 0 else n                                      # by hand: replicated to N
    assert forward == pytest.approx((n - 1) / n * B * (T // n) * d * (2 * H + 2 * kv) * size, rel=1e-12)
    assert [b for _, b in both] == pytest.approx([forward] * n, rel=1e-12)   # dO, dq, dk, dv: the same four


@pytest.mark.parametrize("n, T, H, H_kv, B, dtype", COUNT_CASES, ids=COUNT_IDS)
def test_ulysses_backward_bytes_predicted_are_the_bytes_counted(n, T, H, H_kv, B, dtype):
    d = 4
    _, both = _ulysses_counted(n, T, H, H_kv, B, dtype, d)
    backward = comm_bytes_per_rank("ulysses", T, H, H_kv, d, n, dtype.itemsize, B, backward=True)
    assert [b for _, b in both] == pytest.approx([backward] * n, rel=1e-12)


@pytest.mark.parametrize("n, T, H, H_kv, B, dtype", COUNT_CASES, ids=COUNT_IDS)
def test_tensor_parallel_forward_bytes_predicted_are_the_bytes_counted(n, T, H, H_kv, B, dtype):
    d, size = 4, dtype.itemsize
    counted = _tp_counted(n, T, H, H_kv, B, dtype, d)
    forward = comm_bytes_per_rank("tensor", T, H, H_kv, d, n, size, B)
    assert [f for f, _ in counted] == pytest.approx([forward] * n, rel=1e-12)
    assert forward == pytest.approx(2 * (n - 1) / n * B * T * H * d * size, rel=1e-12)   # by hand
    assert [b for _, b in counted] == pytest.approx([forward] * n, rel=1e-12)   # dx: the same size


@pytest.mark.parametrize("n, T, H, H_kv, B, dtype", COUNT_CASES, ids=COUNT_IDS)
def test_tensor_parallel_backward_bytes_predicted_are_the_bytes_counted(n, T, H, H_kv, B, dtype):
    d = 4
    counted = _tp_counted(n, T, H, H_kv, B, dtype, d)
    backward = comm_bytes_per_rank("tensor", T, H, H_kv, d, n, dtype.itemsize, B, backward=True)
    assert [b for _, b in counted] == pytest.approx([backward] * n, rel=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_decode_bytes_predicted_are_the_bytes_counted_and_do_not_grow_with_the_cache(n, dtype):
    B, H, H_kv, d = 2, 4, 2, 8
    q = _randn(B, H, 1, d, seed=110, dtype=dtype)
    counted = []
    for T in (n, 8 * n, 12 * n):
        _, k, v = _qkv(B, H, H_kv, T, d, seed=111, dtype=dtype)
        res = run_ranks(decode_across_ranks, [(q, kr, vr) for kr, vr in zip(k.chunk(n, 2), v.chunk(n, 2))])
        counted.append(res.sent)
    predicted = decode_bytes_per_rank(B, H, d, n, q.element_size())
    assert counted[0] == counted[1] == counted[2]                          # whatever the cache's length
    assert counted[0] == pytest.approx([predicted] * n, rel=1e-12)
    assert predicted == pytest.approx(2 * (n - 1) / n * B * H * (d + 2) * q.element_size(), rel=1e-12)


def test_ring_overlap_tokens_is_where_a_steps_compute_equals_its_transfer():
    H, H_kv, size, peak, bw = 32, 8, 2, 989e12, 450e9
    t = ring_overlap_tokens(H, H_kv, size, peak, bw)
    assert t == pytest.approx(8 * 2 / (2 * 32) * 989e12 / 450e9, rel=1e-12)
    assert t == pytest.approx(549.4444444444, rel=1e-9)                   # 0.25 x 2197.78
    B, d = 3, 128
    compute, transfer = 4 * B * H * t * t * d / peak, 2 * B * H_kv * t * d * size / bw
    assert compute == pytest.approx(transfer, rel=1e-12)
    compute_2t, transfer_2t = 4 * B * H * (2 * t) ** 2 * d / peak, 2 * B * H_kv * (2 * t) * d * size / bw
    assert compute_2t == pytest.approx(2 * transfer_2t, rel=1e-12)                 # longer blocks: hidden
    assert ring_overlap_tokens(16, 16, 4, 100e12, 50e9) == pytest.approx(4000.0, rel=1e-12)   # MHA: bytes/2 x F/BW


# ============================================================ the mistakes the lesson code refuses


def test_ulysses_refuses_heads_that_do_not_split_over_the_ranks_naming_the_sizes():
    with pytest.raises(ValueError, match="Ulysses splits the 6 query heads over 4 ranks: 6 is not a multiple of 4"):
        comm_bytes_per_rank("ulysses", 24, 6, 6, 8, 4)
    with pytest.raises(ValueError, match=r"3 key/value heads cannot be split over 2 ranks, nor replicated to 2 "
                                         r"\(2 is not a multiple of 3\)"):
        comm_bytes_per_rank("ulysses", 24, 6, 3, 8, 2)
    q, k, v = _qkv(1, 6, 3, 8, 4)
    with pytest.raises(RankError, match="ValueError: Ulysses splits the 6 query heads over 4 ranks") as info:
        run_ranks(ulysses_attention, [(q[:, :, 2 * r:2 * r + 2], k[:, :, 2 * r:2 * r + 2], v[:, :, 2 * r:2 * r + 2])
                                      for r in range(4)])
    assert isinstance(info.value.__cause__, ValueError)
    with pytest.raises(RankError, match="ValueError: 3 key/value heads cannot be split over 2 ranks"):
        run_ranks(ulysses_attention, [(q[:, :, :4], k[:, :, :4], v[:, :, :4]), (q[:, :, 4:], k[:, :, 4:], v[:, :, 4:])])


def test_tensor_parallelism_refuses_heads_that_do_not_split_and_the_cost_model_unknown_schemes():
    x = _randn(1, 4, 8, seed=120)
    weights = _tp_weights(6, 2, 4, 8, seed=121)
    with pytest.raises(RankError, match="6 heads cannot be split over 4 ranks"):
        run_ranks(tp_attention, [(x, *weights, 6, 2)] * 4)
    with pytest.raises(RankError, match="2 kv heads over 3 ranks: neither divides the other"):
        run_ranks(tp_attention, [(x, *weights, 6, 2)] * 3)
    with pytest.raises(ValueError, match="scheme must be 'ring', 'ulysses' or 'tensor', got 'pipeline'"):
        comm_bytes_per_rank("pipeline", 24, 4, 4, 8, 2)


# ============================================================ the notebook's demonstrations


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_watch_collective_shows_what_each_rank_holds_after_each_communication(n):
    xs = [torch.arange(2 * n, dtype=torch.float64) + 100 * r for r in range(n)]
    held = {op: run_ranks(watch_collective, [(op, x) for x in xs])
            for op in ("ring", "all_reduce", "all_gather", "all_to_all")}
    for r in range(n):
        assert torch.equal(held["ring"][r], xs[(r - 1) % n])
        assert torch.equal(held["all_reduce"][r], sum(xs))
        assert torch.equal(held["all_gather"][r], torch.stack(xs))
        assert torch.equal(held["all_to_all"][r], torch.cat([x[2 * r:2 * r + 2] for x in xs]))
    with pytest.raises(RankError, match="op must be 'ring', 'all_reduce', 'all_gather' or 'all_to_all', got 'scatter'"):
        run_ranks(watch_collective, [("scatter", x) for x in xs])


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_send_then_receive_deadlocks_and_even_ranks_sending_first_passes_the_ring(n):
    xs = [torch.full((3,), float(r)) for r in range(n)]
    with pytest.raises(DeadlockError, match="rank 0 waits to send to rank 1"):
        run_ranks(send_then_receive, [(x,) for x in xs])
    got = run_ranks(even_ranks_send_first, [(x,) for x in xs])
    assert all(torch.equal(got[r], xs[(r - 1) % n]) for r in range(n))


@pytest.mark.slow
def test_pytorch_tensor_parallelism_on_gloo_equals_the_module_in_one_process_and_halves_its_weights():
    torch.manual_seed(0)
    model = TinyAttention(16, 4, 2, 4).double()
    x = _randn(2, 6, 16, seed=130)
    with torch.no_grad():
        ref = model(x)
    res = run_ranks(dtensor_tensor_parallel, [(model, x)] * 2, backend="gloo")
    for out, shapes in res:
        assert torch.allclose(out, ref, atol=ATOL, rtol=0)
        assert shapes == {"q.weight": [8, 16], "k.weight": [4, 16], "v.weight": [4, 16], "o.weight": [16, 8]}


def test_pytorch_tensor_parallelism_refuses_heads_it_would_cut_in_two_before_any_communication():
    model = TinyAttention(16, 4, 2, 4).double()
    with pytest.raises(RankError, match="rank 0 raised ValueError: ColwiseParallel cuts k's 2 heads into 4"):
        run_ranks(dtensor_tensor_parallel, [(model, _randn(1, 4, 16, seed=131))] * 4)


# ============================================================ the exercises: wrong answers written as learners
# write them (WRONG: each with words its check's hint must contain), right ones in other styles (RIGHT)


# --------------------------------------------------------------------------- 13.1 zigzag_positions, as learners write it


def zz_loop(T, world_size, rank):
    size = T // (2 * world_size)
    first = [rank * size + i for i in range(size)]
    second = [(2 * world_size - 1 - rank) * size + i for i in range(size)]
    return torch.tensor(first + second)


def zz_arange_pair(T, world_size, rank):
    size = T // (2 * world_size)
    late = 2 * world_size - 1 - rank
    return torch.cat((torch.arange(rank * size, (rank + 1) * size), torch.arange(late * size, (late + 1) * size)))


def zz_chunk(T, world_size, rank):
    parts = torch.arange(T).chunk(2 * world_size)
    return torch.cat([parts[rank], parts[-1 - rank]])


def zz_striped(T, world_size, rank):
    return torch.arange(rank, T, world_size)


def zz_contiguous(T, world_size, rank):
    size = T // world_size
    return torch.arange(rank * size, (rank + 1) * size)


def zz_same_place_in_each_half(T, world_size, rank):
    parts = torch.arange(T).chunk(2 * world_size)
    return torch.cat([parts[rank], parts[world_size + rank]])


def zz_mirror_off_by_one(T, world_size, rank):
    size = T // (2 * world_size)
    late = 2 * world_size - rank
    return torch.cat([torch.arange(rank * size, (rank + 1) * size), torch.arange(late * size, (late + 1) * size)])


def zz_late_first(T, world_size, rank):
    parts = torch.arange(T).chunk(2 * world_size)
    return torch.cat([parts[-1 - rank], parts[rank]])


# --------------------------------------------------------------------------- 13.2 ring_attention, as learners write it


def _attend(q, k, v, q_pos, k_pos, causal, mask_value=-math.inf):
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(k_pos[None, :] > q_pos[:, None], mask_value)
    lse = torch.logsumexp(s, dim=-1)
    m = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return torch.einsum("bhqk,bhkd->bhqd", torch.exp(s - m[..., None]), v), lse


def _merge(out, lse, o, l):
    new = torch.logaddexp(lse, l)
    safe = torch.where(torch.isfinite(new), new, torch.zeros_like(new))
    return torch.exp(lse - safe)[..., None] * out + torch.exp(l - safe)[..., None] * o, new


def ring_online_softmax(comm, q, k, v, positions, causal=True):
    """A running max and sum, as in notebook 09's kernel, instead of merging lses."""
    n, r = comm.world_size, comm.rank
    m = torch.full(q.shape[:-1], -math.inf, dtype=q.dtype)
    l = torch.zeros(q.shape[:-1], dtype=q.dtype)
    acc = torch.zeros_like(q)
    kb, vb, pb = k, v, positions
    for step in range(n):
        if step:
            kb, vb, pb = (comm.exchange(x, (r + 1) % n, (r - 1) % n) for x in (kb, vb, pb))
        s = q @ kb.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if causal:
            s = s.masked_fill(pb[None, :] > positions[:, None], -math.inf)
        m_new = torch.maximum(m, s.amax(-1))
        safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        p = torch.exp(s - safe[..., None])
        alpha = torch.exp(m - safe)
        l = alpha * l + p.sum(-1)
        acc = alpha[..., None] * acc + p @ vb
        m = m_new
    return acc / l[..., None], m + torch.log(l)


def ring_even_odd_blocking(comm, q, k, v, positions, causal=True):
    """Blocking send/recv, even ranks sending first: no deadlock; -1e9 for masked scores."""
    n, r = comm.world_size, comm.rank
    out, lse = _attend(q, k, v, positions, positions, causal, mask_value=-1e9)
    block = [k, v, positions]
    for _ in range(n - 1):
        got = []
        for x in block:
            if r % 2 == 0:
                comm.send(x, (r + 1) % n)
                got.append(comm.recv(x, (r - 1) % n))
            else:
                y = comm.recv(x, (r - 1) % n)
                comm.send(x, (r + 1) % n)
                got.append(y)
        block = got
        o, l = _attend(q, *block[:2], positions, block[2], causal, mask_value=-1e9)
        out, lse = _merge(out, lse, o, l)
    return out, lse


def ring_stacked_blocks(comm, q, k, v, positions, causal=True):
    """K and V sent as one tensor; blocks kept, merged once at the end with logsumexp."""
    n, r = comm.world_size, comm.rank
    kv, pos = torch.stack([k, v]), positions
    outs, lses = [], []
    for step in range(n):
        if step:
            kv = comm.exchange(kv, (r + 1) % n, (r - 1) % n)
            pos = comm.exchange(pos, (r + 1) % n, (r - 1) % n)
        o, l = _attend(q, kv[0], kv[1], positions, pos, causal)
        outs.append(o)
        lses.append(l)
    lses = torch.stack(lses)
    lse = torch.logsumexp(lses, 0)
    return (torch.exp(lses - lse)[..., None] * torch.stack(outs)).sum(0), lse


def ring_send_then_receive(comm, q, k, v, positions, causal=True):
    n, r = comm.world_size, comm.rank
    out, lse = _attend(q, k, v, positions, positions, causal)
    block = [k, v, positions]
    for _ in range(n - 1):
        for x in block:
            comm.send(x, (r + 1) % n)
        block = [comm.recv(x, (r - 1) % n) for x in block]
        out, lse = _merge(out, lse, *_attend(q, block[0], block[1], positions, block[2], causal))
    return out, lse


def _ring_with(comm, q, k, v, positions, causal, attend):
    n, r = comm.world_size, comm.rank
    out, lse = attend(q, k, v, positions, positions, causal, r, r)
    block = [k, v, positions, torch.tensor(r)]
    for _ in range(n - 1):
        block = [comm.exchange(x, (r + 1) % n, (r - 1) % n) for x in block]
        out, lse = _merge(out, lse, *attend(q, block[0], block[1], positions, block[2], causal, r, int(block[3])))
    return out, lse


def ring_is_causal_every_step(comm, q, k, v, positions, causal=True):
    def attend(q, k, v, q_pos, k_pos, causal, me, src):
        local = torch.arange(q.shape[2])
        return _attend(q, k, v, local, local, causal)
    return _ring_with(comm, q, k, v, positions, causal, attend)


def ring_own_positions_for_keys(comm, q, k, v, positions, causal=True):
    def attend(q, k, v, q_pos, k_pos, causal, me, src):
        return _attend(q, k, v, q_pos, q_pos, causal)
    return _ring_with(comm, q, k, v, positions, causal, attend)


def ring_block_mask_by_rank(comm, q, k, v, positions, causal=True):
    def attend(q, k, v, q_pos, k_pos, causal, me, src):
        if src == me or not causal:
            return _attend(q, k, v, q_pos, k_pos, causal)
        if src < me:
            return _attend(q, k, v, q_pos, k_pos, False)
        return torch.zeros_like(q), torch.full(q.shape[:-1], -math.inf, dtype=q.dtype)
    return _ring_with(comm, q, k, v, positions, causal, attend)


def ring_average_outputs(comm, q, k, v, positions, causal=True):
    n, r = comm.world_size, comm.rank
    out, lse = _attend(q, k, v, positions, positions, causal)
    block, total = [k, v, positions], out
    for _ in range(n - 1):
        block = [comm.exchange(x, (r + 1) % n, (r - 1) % n) for x in block]
        o, l = _attend(q, block[0], block[1], positions, block[2], causal)
        total, lse = total + o, torch.logaddexp(lse, l)
    return total / n, lse


def ring_add_lses(comm, q, k, v, positions, causal=True):
    n, r = comm.world_size, comm.rank
    out, lse = _attend(q, k, v, positions, positions, causal)
    block, lse_sum = [k, v, positions], lse
    for _ in range(n - 1):
        block = [comm.exchange(x, (r + 1) % n, (r - 1) % n) for x in block]
        o, l = _attend(q, block[0], block[1], positions, block[2], causal)
        out, lse = _merge(out, lse, o, l)
        lse_sum = lse_sum + l
    return out, lse_sum


def ring_softmax_per_block(comm, q, k, v, positions, causal=True):
    """torch.softmax over each block: a block with no visible key gives NaN."""
    n, r = comm.world_size, comm.rank

    def attend(kb, vb, pb):
        s = q @ kb.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if causal:
            s = s.masked_fill(pb[None, :] > positions[:, None], -math.inf)
        return torch.softmax(s, -1) @ vb, torch.logsumexp(s, -1)

    out, lse = attend(k, v, positions)
    block = [k, v, positions]
    for _ in range(n - 1):
        block = [comm.exchange(x, (r + 1) % n, (r - 1) % n) for x in block]
        o, l = attend(*block)
        new = torch.logaddexp(lse, l)
        out, lse = torch.exp(lse - new)[..., None] * out + torch.exp(l - new)[..., None] * o, new
    return out, lse


def ring_unscaled(comm, q, k, v, positions, causal=True):
    return ring_online_softmax(comm, q * math.sqrt(q.shape[-1]), k, v, positions, causal)


def ring_one_hop_too_many(comm, q, k, v, positions, causal=True):
    """The right output, with a last hop that carries every block back home."""
    n, r = comm.world_size, comm.rank
    out, lse = _attend(q, k, v, positions, positions, causal)
    block = [k, v, positions]
    for step in range(n):
        block = [comm.exchange(x, (r + 1) % n, (r - 1) % n) for x in block]
        if step < n - 1:
            out, lse = _merge(out, lse, *_attend(q, block[0], block[1], positions, block[2], causal))
    return out, lse


def ring_own_block_twice(comm, q, k, v, positions, causal=True):
    n, r = comm.world_size, comm.rank
    out, lse = _attend(q, k, v, positions, positions, causal)
    block = [k, v, positions]
    for _ in range(n):
        block = [comm.exchange(x, (r + 1) % n, (r - 1) % n) for x in block]
        out, lse = _merge(out, lse, *_attend(q, block[0], block[1], positions, block[2], causal))
    return out, lse


# --------------------------------------------------------------------------- 13.3 ulysses_attention, as learners write it


def _a2a_heads(comm, x):
    n = comm.world_size
    B, h, t, d = x.shape
    y = comm.all_to_all(x.movedim(1, 0).contiguous()).unflatten(0, (n, h // n))   # [n, h/n, B, t, d]
    return y.movedim(2, 0).movedim(1, 2).flatten(2, 3)                            # [B, h/n, n t, d]


def _a2a_seq(comm, x):
    n = comm.world_size
    B, h, T, d = x.shape
    y = x.unflatten(2, (n, T // n)).movedim(2, 0).movedim(1, 2).flatten(0, 1)    # [n h, B, t, d]
    return comm.all_to_all(y.contiguous()).movedim(0, 1)


def ul_movedim_einsum(comm, q, k, v, causal=True):
    n, H_kv = comm.world_size, k.shape[1]
    if H_kv < n:
        k, v = (torch.repeat_interleave(x, n // H_kv, dim=1) for x in (k, v))
    q, k, v = (_a2a_heads(comm, x) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.shape[-1])
    if causal:
        T = s.shape[-1]
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -1e9)
    return _a2a_seq(comm, torch.einsum("bhqk,bhkd->bhqd", s.softmax(-1), v))


def ul_gather_everything(comm, q, k, v, causal=True):
    """all_gather of every rank's shard: the same answer, not Ulysses."""
    r = comm.rank
    full = [comm.all_gather(x).movedim(0, 2).flatten(2, 3) for x in (q, k, v)]   # [B, h, T, d]
    out = F.scaled_dot_product_attention(*full, is_causal=causal, enable_gqa=True)
    t = q.shape[2]
    return out[:, :, r * t:(r + 1) * t]


def ul_tiled_kv(comm, q, k, v, causal=True):
    n, H_kv = comm.world_size, k.shape[1]
    if H_kv < n:
        k, v = k.repeat(1, n // H_kv, 1, 1), v.repeat(1, n // H_kv, 1, 1)
    q, k, v = (_a2a_heads(comm, x) for x in (q, k, v))
    return _a2a_seq(comm, F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True))


def ul_no_all_to_all(comm, q, k, v, causal=True):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


def ul_all_to_all_as_given(comm, q, k, v, causal=True):
    """The all-to-all on [B, H, T/N, d] as it comes: dim 0 is the batch."""
    n, H_kv = comm.world_size, k.shape[1]
    if H_kv < n:
        k, v = (x.repeat_interleave(n // H_kv, 1) for x in (k, v))

    def heads(x):
        B, h, t, d = x.shape
        y = comm.all_to_all(x).view(n, B // n, h, t, d)
        return y.permute(1, 2, 0, 3, 4).reshape(B // n, h, n * t, d)

    out = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=causal, enable_gqa=True)
    b, h, T, d = out.shape
    return comm.all_to_all(out.view(b, h, n, T // n, d).permute(2, 0, 1, 3, 4).reshape(n * b, h, T // n, d))


def ul_ignores_causal(comm, q, k, v, causal=True):
    return ul_movedim_einsum(comm, q, k, v, causal=False)


# --------------------------------------------------------------------------- 13.4 comm_bytes_per_rank, as learners write it


def bytes_integers(scheme, T, n_heads, n_kv_heads, head_dim, world_size, dtype_bytes=2, batch=1):
    n, t = world_size, T // world_size
    if scheme == "ring":
        return (n - 1) * (2 * batch * n_kv_heads * t * head_dim * dtype_bytes + 8 * t)
    if scheme == "ulysses":
        kv = n_kv_heads if n_kv_heads >= n else n
        return (n - 1) * batch * t * head_dim * (2 * n_heads + 2 * kv) * dtype_bytes // n
    return 2 * (n - 1) * batch * T * n_heads * head_dim * dtype_bytes // n


def bytes_by_tensors(scheme, T, n_heads, n_kv_heads, head_dim, world_size, dtype_bytes=2, batch=1):
    n = world_size
    size = {"q": batch * n_heads * T / n * head_dim * dtype_bytes,
            "kv": batch * max(n_kv_heads, n) * T / n * head_dim * dtype_bytes}
    if scheme == "ring":
        return sum(batch * n_kv_heads * T / n * head_dim * dtype_bytes + 4 * T / n for _ in range(2 * (n - 1)))
    if scheme == "ulysses":
        return sum((n - 1) / n * s for s in (size["q"], size["kv"], size["kv"], size["q"]))
    return (n - 1) / n * batch * T * n_heads * head_dim * dtype_bytes * 2


def bytes_no_fraction(scheme, T, n_heads, n_kv_heads, head_dim, world_size, dtype_bytes=2, batch=1):
    n, t = world_size, T / world_size
    if scheme == "ring":
        return (n - 1) * (2 * batch * n_kv_heads * t * head_dim * dtype_bytes + 8 * t)
    if scheme == "ulysses":
        kv = n_kv_heads if n_kv_heads % n == 0 else n
        return batch * t * head_dim * (2 * n_heads + 2 * kv) * dtype_bytes
    return 2 * batch * T * n_heads * head_dim * dtype_bytes


def bytes_n_hops(scheme, T, n_heads, n_kv_heads, head_dim, world_size, dtype_bytes=2, batch=1):
    n, t = world_size, T / world_size
    if scheme == "ring":
        return n * (2 * batch * n_kv_heads * t * head_dim * dtype_bytes + 8 * t)
    return bytes_integers(scheme, T, n_heads, n_kv_heads, head_dim, world_size, dtype_bytes, batch)


def bytes_no_positions(scheme, T, n_heads, n_kv_heads, head_dim, world_size, dtype_bytes=2, batch=1):
    n, t = world_size, T / world_size
    if scheme == "ring":
        return (n - 1) * 2 * batch * n_kv_heads * t * head_dim * dtype_bytes
    return bytes_integers(scheme, T, n_heads, n_kv_heads, head_dim, world_size, dtype_bytes, batch)


def bytes_query_heads_for_kv(scheme, T, n_heads, n_kv_heads, head_dim, world_size, dtype_bytes=2, batch=1):
    n, t = world_size, T / world_size
    if scheme == "ring":
        return (n - 1) * (2 * batch * n_heads * t * head_dim * dtype_bytes + 8 * t)
    return bytes_integers(scheme, T, n_heads, n_kv_heads, head_dim, world_size, dtype_bytes, batch)


def bytes_forgot_output(scheme, T, n_heads, n_kv_heads, head_dim, world_size, dtype_bytes=2, batch=1):
    n, t = world_size, T / world_size
    if scheme == "ulysses":
        kv = n_kv_heads if n_kv_heads % n == 0 else n
        return (n - 1) / n * batch * t * head_dim * (n_heads + 2 * kv) * dtype_bytes
    return bytes_integers(scheme, T, n_heads, n_kv_heads, head_dim, world_size, dtype_bytes, batch)


def bytes_no_replication(scheme, T, n_heads, n_kv_heads, head_dim, world_size, dtype_bytes=2, batch=1):
    n, t = world_size, T / world_size
    if scheme == "ulysses":
        return (n - 1) / n * batch * t * head_dim * (2 * n_heads + 2 * n_kv_heads) * dtype_bytes
    return bytes_integers(scheme, T, n_heads, n_kv_heads, head_dim, world_size, dtype_bytes, batch)


def bytes_all_reduce_once(scheme, T, n_heads, n_kv_heads, head_dim, world_size, dtype_bytes=2, batch=1):
    n = world_size
    if scheme == "tensor":
        return (n - 1) / n * batch * T * n_heads * head_dim * dtype_bytes
    return bytes_integers(scheme, T, n_heads, n_kv_heads, head_dim, world_size, dtype_bytes, batch)


_SHARED = {}


def ring_through_shared_memory(comm, q, k, v, positions, causal=True):
    """Every rank reads the others' shards from a dict (one per run): right values, nothing sent."""
    import time
    mine = _SHARED.setdefault(comm._hub, {})                 # the ranks of this run share one hub
    mine[comm.rank] = (k, v, positions)
    while len(mine) < comm.world_size:
        time.sleep(0.001)
    ks, vs, ps = zip(*(mine[r] for r in range(comm.world_size)))
    return _attend(q, torch.cat(ks, 2), torch.cat(vs, 2), positions, torch.cat(ps), causal)


def ring_all_gather(comm, q, k, v, positions, causal=True):
    """Every block at once: the right values, not a ring."""
    K, V, P = (comm.all_gather(x) for x in (k, v, positions))
    return _attend(q, K.movedim(0, 2).flatten(2, 3), V.movedim(0, 2).flatten(2, 3), positions, P.flatten(), causal)


def ring_diagonal_masked(comm, q, k, v, positions, causal=True):
    def attend(q, k, v, q_pos, k_pos, causal, me, src):
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if causal:
            s = s.masked_fill(k_pos[None, :] >= q_pos[:, None], -math.inf)
        lse = torch.logsumexp(s, -1)
        m = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        return torch.exp(s - m[..., None]) @ v, lse
    return _ring_with(comm, q, k, v, positions, causal, attend)


def ring_one_hop_short(comm, q, k, v, positions, causal=True):
    n, r = comm.world_size, comm.rank
    out, lse = _attend(q, k, v, positions, positions, causal)
    block = [k, v, positions]
    for _ in range(n - 2):
        block = [comm.exchange(x, (r + 1) % n, (r - 1) % n) for x in block]
        out, lse = _merge(out, lse, *_attend(q, block[0], block[1], positions, block[2], causal))
    return out, lse


def ring_running_sum_of_lses(comm, q, k, v, positions, causal=True):
    """Merges with the new lse = lse + l (notebook 13's common mistake 1)."""
    n, r = comm.world_size, comm.rank
    out, lse = _attend(q, k, v, positions, positions, causal)
    block = [k, v, positions]
    for _ in range(n - 1):
        block = [comm.exchange(x, (r + 1) % n, (r - 1) % n) for x in block]
        o, l = _attend(q, block[0], block[1], positions, block[2], causal)
        new = lse + l
        out, lse = torch.exp(lse - new)[..., None] * out + torch.exp(l - new)[..., None] * o, new
    return out, lse


def ring_scales_q_in_place(comm, q, k, v, positions, causal=True):
    """Scales its own q in place first: a rank's tensors are its own."""
    q *= 1 / math.sqrt(q.shape[-1])
    return ring_online_softmax(comm, q * math.sqrt(q.shape[-1]), k, v, positions, causal)


def ring_positions_as_float(comm, q, k, v, positions, causal=True):
    n, r = comm.world_size, comm.rank
    out, lse = _attend(q, k, v, positions, positions, causal)
    block = [k, v, positions.double()]
    for _ in range(n - 1):
        block = [comm.exchange(x, (r + 1) % n, (r - 1) % n) for x in block]
        out, lse = _merge(out, lse, *_attend(q, block[0], block[1], positions.double(), block[2], causal))
    return out, lse


def ul_no_replication(comm, q, k, v, causal=True):
    q, k, v = (_a2a_heads(comm, x) for x in (q, k, v))
    return _a2a_seq(comm, F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True))


def ul_replicated_to_h(comm, q, k, v, causal=True):
    H, H_kv = q.shape[1], k.shape[1]
    k, v = (x.repeat_interleave(H // H_kv, dim=1) for x in (k, v))
    q, k, v = (_a2a_heads(comm, x) for x in (q, k, v))
    return _a2a_seq(comm, F.scaled_dot_product_attention(q, k, v, is_causal=causal))


def ul_without_enable_gqa(comm, q, k, v, causal=True):
    n, H_kv = comm.world_size, k.shape[1]
    if H_kv < n:
        k, v = (x.repeat_interleave(n // H_kv, dim=1) for x in (k, v))
    q, k, v = (_a2a_heads(comm, x) for x in (q, k, v))
    return _a2a_seq(comm, F.scaled_dot_product_attention(q, k, v, is_causal=causal))


def ul_scales_q_in_place(comm, q, k, v, causal=True):
    q.mul_(q.shape[-1] ** -0.5)
    n, H_kv = comm.world_size, k.shape[1]
    if H_kv < n:
        k, v = (x.repeat_interleave(n // H_kv, dim=1) for x in (k, v))
    q, k, v = (_a2a_heads(comm, x) for x in (q, k, v))
    return _a2a_seq(comm, F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=1.0, enable_gqa=True))


WRONG = {
    "zigzag_positions": [
        (zz_striped, "striped layout"), (zz_contiguous, "one contiguous shard"),
        (zz_same_place_in_each_half, "must be mirrored"), (zz_mirror_off_by_one, "2N - 1 - r"),
        (zz_late_first, "not in increasing order"),
    ],
    "ring_attention": [
        (ring_send_then_receive, "comm.exchange"), (ring_is_causal_every_step, "global positions"),
        (ring_own_positions_for_keys, "must travel with their K/V block"),
        (ring_block_mask_by_rank, "right only for contiguous shards"),
        (ring_average_outputs, "you averaged the blocks' outputs"), (ring_add_lses, "torch.logaddexp"),
        (ring_softmax_per_block, "exp(-inf - (-inf)) is NaN"), (ring_unscaled, "sqrt(d)"),
        (ring_one_hop_too_many, "sent their K/V block N times"), (ring_own_block_twice, "own K/V block twice"),
        (ring_through_shared_memory, "share no memory"), (ring_all_gather, "not ring attention"),
        (ring_diagonal_masked, "not >="), (ring_one_hop_short, "N - 1 of the N blocks"),
        (ring_running_sum_of_lses, "torch.logaddexp"),
    ],
    "ulysses_attention": [
        (ul_tiled_kv, "repeat_interleave"), (ul_no_all_to_all, "own T/N tokens only"),
        (ul_all_to_all_as_given, "Put the heads first"), (ul_ignores_causal, "causal"),
        (ul_gather_everything, "comm.all_to_all, four times"), (ul_no_replication, "replicate them to N heads"),
        (ul_replicated_to_h, "not up to H"), (ul_without_enable_gqa, "enable_gqa=True"),
    ],
    "comm_bytes_per_rank": [
        (bytes_no_fraction, "(N - 1)/N"), (bytes_n_hops, "N hops"), (bytes_no_positions, "positions"),
        (bytes_query_heads_for_kv, "H_kv heads"), (bytes_forgot_output, "second all-to-all"),
        (bytes_no_replication, "replicates them to N heads"), (bytes_all_reduce_once, "2 (N - 1)/N"),
    ],
}

RIGHT = {
    "zigzag_positions": [zz_loop, zz_arange_pair, zz_chunk],
    "ring_attention": [ring_online_softmax, ring_even_odd_blocking, ring_stacked_blocks, ring_scales_q_in_place,
                       ring_positions_as_float],
    "ulysses_attention": [ul_movedim_einsum, ul_scales_q_in_place],
    "comm_bytes_per_rank": [bytes_integers, bytes_by_tensors],
}


@pytest.mark.parametrize(("name", "wrong", "hint"), wrong_cases(WRONG))
def test_check_rejects_wrong(name, wrong, hint):
    assert_rejected(name, wrong, hint)


@pytest.mark.parametrize(("name", "right"), right_cases(RIGHT))
def test_check_accepts_right(name, right):
    assert_accepted(name, right)
