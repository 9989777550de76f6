"""Notebook 03 (masks): the mask references of helpers.nb03_masks against torch's own attention, and
the checks of exercises 3.1-3.6: learner-style wrong implementations each check must reject with
its hint (WRONG), correct ones in other styles than the reference it must accept (RIGHT), the
attention functions check 3.6 probes, and hints that name only what they recognise."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from helpers import checks
from helpers import nb03_masks as masks
from helpers.checks import EXERCISES, CheckFailed
from helpers.checks import nb03_masks as c3
from helpers.checks.nb03_masks import _leak_cases, toy_attention
from helpers.nb01_qkv_shapes import scaled_dot_product_attention
from tests.exercise_cases import assert_accepted, assert_rejected, first_fast, right_cases, wrong_cases

# =============================================================== lesson: helpers.nb03_masks


def _qkv(B, H, T, d, seed=0, T_k=None, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    T_k = T if T_k is None else T_k
    return (torch.randn(B, H, T, d, generator=g, dtype=dtype), torch.randn(B, H, T_k, d, generator=g, dtype=dtype),
            torch.randn(B, H, T_k, d, generator=g, dtype=dtype))


def test_causal_mask_matches_sdpa_is_causal():
    q, k, v = _qkv(2, 3, 7, 5)
    ours = scaled_dot_product_attention(q, k, v, masks.causal_mask(7))
    torch.testing.assert_close(ours, F.scaled_dot_product_attention(q, k, v, is_causal=True))
    torch.testing.assert_close(ours, F.scaled_dot_product_attention(q, k, v, attn_mask=masks.causal_mask(7)))


def test_padding_mask_shape_and_sdpa():
    lengths = torch.tensor([3, 7, 1])
    m = masks.padding_mask(lengths, 7)
    assert m.shape == (3, 1, 1, 7) and m.dtype == torch.bool
    assert m.sum(-1).flatten().tolist() == lengths.tolist()
    q, k, v = _qkv(3, 2, 7, 4, seed=1)
    additive = torch.zeros(m.shape, dtype=q.dtype).masked_fill(~m, float("-inf"))
    ours = scaled_dot_product_attention(q, k, v, m)
    torch.testing.assert_close(ours, F.scaled_dot_product_attention(q, k, v, attn_mask=m))
    torch.testing.assert_close(ours, F.scaled_dot_product_attention(q, k, v, attn_mask=additive))


def test_masked_softmax_rows_are_distributions_or_zero():
    g = torch.Generator().manual_seed(2)
    s = torch.randn(4, 5, 6, generator=g) * 1e4
    a = torch.rand(5, 6, generator=g) < 0.4
    a[1] = False
    p = masks.masked_softmax(s, a)
    assert torch.isfinite(p).all()
    sums = p.sum(-1)
    torch.testing.assert_close(sums, a.any(-1).float().expand_as(sums))
    assert (p[..., ~a] == 0).all()


def test_masked_softmax_gradient_is_finite_on_empty_rows():
    s = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    a = torch.tensor([[True, True, False, False], [False] * 4, [True] * 4])
    masks.masked_softmax(s, a).pow(2).sum().backward()
    assert torch.isfinite(s.grad).all() and (s.grad[1] == 0).all()


def test_prefix_lm_mask_edges():
    for T in (1, 4, 7):
        assert torch.equal(masks.prefix_lm_mask(T, 0), masks.causal_mask(T))
        assert torch.equal(masks.prefix_lm_mask(T, 1), masks.causal_mask(T))
        assert masks.prefix_lm_mask(T, T).all()
    m = masks.prefix_lm_mask(7, 3)
    assert m[:3, :3].all() and not m[:3, 3:].any() and torch.equal(m[3:], masks.causal_mask(7)[3:])


def test_packed_mask_equals_separate_sequences():
    seq_lens = [3, 1, 4, 2]
    N = sum(seq_lens)
    q, k, v = _qkv(1, 2, N, 4, seed=3)
    packed = scaled_dot_product_attention(q, k, v, masks.packed_causal_mask(seq_lens))
    separate = [F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
                for qs, ks, vs in zip(*(t.split(seq_lens, dim=2) for t in (q, k, v)))]
    torch.testing.assert_close(packed, torch.cat(separate, dim=2))


def test_sliding_window_mask():
    T = 9
    assert torch.equal(masks.sliding_window_mask(T, T), masks.causal_mask(T))
    assert torch.equal(masks.sliding_window_mask(T, 1), torch.eye(T, dtype=torch.bool))
    assert masks.sliding_window_mask(T, 3).sum(-1).tolist() == [min(i + 1, 3) for i in range(T)]


def test_chunked_causal_mask_is_causal_within_chunks():
    T = 12
    assert torch.equal(masks.chunked_causal_mask(T, T), masks.causal_mask(T))
    assert torch.equal(masks.chunked_causal_mask(T, 100), masks.causal_mask(T))
    assert torch.equal(masks.chunked_causal_mask(T, 1), torch.eye(T, dtype=torch.bool))
    for chunk in (2, 4, 5):
        m = masks.chunked_causal_mask(T, chunk)
        assert m.shape == (T, T) and m.dtype == torch.bool
        assert m.sum(-1).tolist() == [i % chunk + 1 for i in range(T)]  # resets at each boundary
        lens = [chunk] * (T // chunk) + ([T % chunk] if T % chunk else [])
        assert torch.equal(m, masks.packed_causal_mask(lens))
        blocks = torch.block_diag(*[torch.ones(n, n, dtype=torch.bool) for n in lens])
        assert torch.equal(m, masks.causal_mask(T) & blocks)  # causal AND block-diagonal
        window = masks.sliding_window_mask(T, chunk)
        assert not (m & ~window).any() and (window & ~m).any()  # inside the window, never equal


def test_chunked_causal_mask_matches_attention_chunk_by_chunk():
    T, chunk = 10, 4
    q, k, v = _qkv(1, 2, T, 4, seed=5)
    ours = scaled_dot_product_attention(q, k, v, masks.chunked_causal_mask(T, chunk))
    pieces = [F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
              for qs, ks, vs in zip(*(t.split(chunk, dim=2) for t in (q, k, v)))]
    torch.testing.assert_close(ours, torch.cat(pieces, dim=2))
    with pytest.raises(ValueError, match="at least 1"):
        masks.chunked_causal_mask(T, 0)


def test_find_mask_leaks_on_torch_attention():
    T, D = 6, 8
    allowed = masks.causal_mask(T)
    mha = torch.nn.MultiheadAttention(D, 2, batch_first=True, dtype=torch.float64)

    def correct(x):
        return mha(x, x, x, attn_mask=~allowed, need_weights=False)[0]  # nn.MultiheadAttention: True = blocked

    def inverted(x):
        return mha(x, x, x, attn_mask=allowed, need_weights=False)[0]  # the polarity mistake

    with torch.no_grad():
        assert masks.find_mask_leaks(correct, allowed, D) == []
        leaks = masks.find_mask_leaks(inverted, allowed, D)
    assert leaks == [(i, j) for i in range(T) for j in range(T) if j > i]


def test_find_mask_leaks_sees_denominator_leaks_with_zero_weights():
    """Softmax over all keys, then future weights zeroed (no renormalisation): the weight on every
    future key is exactly 0, yet every future key moves the output through the denominator."""
    T, D = 5, 6
    allowed = masks.causal_mask(T)
    fn = toy_attention(torch.ones(T, T, dtype=torch.bool), D, seed=0, zero_after_softmax=allowed)
    assert masks.find_mask_leaks(fn, allowed, D) == [(i, j) for i in range(T) for j in range(i + 1, T)]


# =============================================================== checks of 3.1-3.6


def _message(check, fn) -> str:
    with pytest.raises(CheckFailed) as info:
        check(fn)
    return str(info.value)


def test_leak_cases_of_the_check():
    """The attention_fns the check of 3.6 uses leak exactly where they are designed to."""
    found = {name: masks.find_mask_leaks(fn, allowed, d) for name, fn, allowed, d, _, _ in _leak_cases()}
    assert found["a leak-free causal attention"] == []
    assert found["a leak-free attention with float round-off"] == []
    assert found["an off-by-one causal mask"] == [(i, i + 1) for i in range(5)]
    assert found["an attention that ignores padding"] == [(i, j) for i in range(5, 8) for j in range(5, i + 1)]
    tool = found["a tool block hidden after the softmax, plus an off-by-one causal mask"]
    assert tool == sorted([(i, i + 1) for i in range(8)] + [(i, j) for i in range(5, 9) for j in range(2, 5)])
    assert found["two correctly masked layers"] == [(i, j) for i in range(6, 9) for j in (2, 3)]
    assert found["a padded encoder whose real positions read the padding"] == [(i, j) for i in range(4) for j in range(4, 7)]
    assert found["three leaks of graded strength (about 1e-1, 1e-2 and 1e-4 of the output)"] == [(1, 3), (2, 6), (5, 0)]
    assert found["an off-by-one causal mask after each position's feature mean is removed"] == [(i, i + 1) for i in range(6)]
    assert found["leaks on top of a large offset (1e7) removed again"] == [(1, 4), (3, 5)]


def test_a_finite_fill_is_not_told_that_exp_overflowed():
    for fn in (softmax_fill_minus_1e4, softmax_fill_minus_1e4_empty_rows_zeroed):
        message = _message(checks.masked_softmax, fn)
        assert "overflow" not in message and ("-1e4" in message or "finite number" in message)


def test_list_argument_mutation_is_seen_in_check_3_5():
    """3.5 relies on the core's in-place detection for its list argument."""
    message = _message(checks.packed_causal_mask, packed_reverses_seq_lens)
    assert "in place" in message and "seq_lens" in message


# --------------------------------------------------------------- wrong implementations


# ----------------------------------------------------------------- 3.1 causal_mask


def causal_inverted(T):
    return torch.ones(T, T, dtype=torch.bool).triu(1)  # True where blocked


def causal_upper(T):
    return torch.ones(T, T, dtype=torch.bool).triu()


def causal_no_diagonal(T):
    return torch.ones(T, T, dtype=torch.bool).tril(-1)


def causal_one_ahead(T):
    i = torch.arange(T)
    return i[None, :] <= i[:, None] + 1


def causal_float(T):
    return torch.tril(torch.ones(T, T))


def causal_additive(T):
    return torch.zeros(T, T).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))


def causal_with_batch_axes(T):
    return torch.ones(T, T, dtype=torch.bool).tril()[None, None]


def causal_numpy(T):
    import numpy as np

    return np.tril(np.ones((T, T), dtype=bool))


# ----------------------------------------------------------------- 3.2 padding_mask


def padding_flat(lengths, T):
    return torch.arange(T)[None, :] < lengths[:, None]  # [B, T]


def padding_queries(lengths, T):
    return (torch.arange(T)[None, :] < lengths[:, None])[:, None, :, None]  # [B, 1, T, 1]


def padding_queries_full(lengths, T):
    rows = torch.arange(T)[None, :] < lengths[:, None]
    return rows[:, None, :, None].expand(-1, 1, T, T)


def padding_inclusive(lengths, T):
    return (torch.arange(T)[None, :] <= lengths[:, None])[:, None, None, :]


def padding_inverted(lengths, T):
    return (torch.arange(T)[None, :] >= lengths[:, None])[:, None, None, :]  # key_padding_mask style


def padding_left(lengths, T):
    return (torch.arange(T)[None, :] >= T - lengths[:, None])[:, None, None, :]


def padding_float(lengths, T):
    return (torch.arange(T)[None, :] < lengths[:, None]).float()[:, None, None, :]


def padding_additive(lengths, T):
    pad = torch.arange(T)[None, :] >= lengths[:, None]
    return torch.zeros(pad.shape).masked_fill(pad, float("-inf"))[:, None, None, :]


def padding_last_index_in_place(lengths, T):
    last = lengths  # not a copy: the next line changes the caller's tensor
    last -= 1  # index of the last real token
    return (torch.arange(T)[None, :] <= last[:, None])[:, None, None, :]


# ----------------------------------------------------------------- 3.3 masked_softmax


def softmax_nan_rows(scores, allowed):
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)


def softmax_mask_after(scores, allowed):
    return torch.softmax(scores, dim=-1) * allowed


def softmax_mask_after_renormalised(scores, allowed):
    p = torch.softmax(scores, dim=-1) * allowed
    return p / p.sum(dim=-1, keepdim=True).clamp_min(1e-30)


def softmax_no_max_subtraction(scores, allowed):
    e = torch.exp(scores) * allowed
    return e / e.sum(dim=-1, keepdim=True).clamp_min(1e-30)


def softmax_big_negative(scores, allowed):
    return torch.softmax(scores.masked_fill(~allowed, -1e9), dim=-1)


def softmax_fill_minus_1e4(scores, allowed):
    return torch.softmax(scores.masked_fill(~allowed, -1e4), dim=-1)


def softmax_fill_minus_1e4_empty_rows_zeroed(scores, allowed):
    p = torch.softmax(scores.masked_fill(~allowed, -1e4), dim=-1)
    return torch.where(allowed.any(-1, keepdim=True), p, torch.zeros_like(p))


def softmax_in_place(scores, allowed):
    scores.masked_fill_(~allowed, float("-inf"))
    p = torch.softmax(scores, dim=-1)
    return torch.where(allowed.any(-1, keepdim=True), p, torch.zeros_like(p))


def softmax_inverted(scores, allowed):
    s = scores.masked_fill(allowed, float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.where((~allowed).any(-1, keepdim=True), p, torch.zeros_like(p))


def softmax_boolean_index(scores, allowed):
    s = scores.clone()
    s[~allowed] = float("-inf")
    return torch.softmax(s, dim=-1).nan_to_num(0.0)


def softmax_float64(scores, allowed):
    s = scores.double().masked_fill(~allowed, float("-inf"))
    return torch.softmax(s, dim=-1).nan_to_num(0.0)


# ----------------------------------------------------------------- 3.4 prefix_lm_mask


def prefix_sees_future(T, prefix_len):
    i = torch.arange(T)[:, None]
    j = torch.arange(T)[None, :]
    return (j <= i) | (i < prefix_len)


def prefix_one_too_many(T, prefix_len):
    m = torch.ones(T, T, dtype=torch.bool).tril()
    m[: prefix_len + 1, : prefix_len + 1] = True
    return m


def prefix_suffix_blind(T, prefix_len):
    return torch.block_diag(torch.ones(prefix_len, prefix_len, dtype=torch.bool),
                            torch.ones(T - prefix_len, T - prefix_len, dtype=torch.bool).tril())


def prefix_plain_causal(T, prefix_len):
    return torch.ones(T, T, dtype=torch.bool).tril()


def prefix_inverted(T, prefix_len):
    m = torch.ones(T, T, dtype=torch.bool).tril()
    m[:prefix_len, :prefix_len] = True
    return ~m


def prefix_float(T, prefix_len):
    m = torch.ones(T, T).tril()
    m[:prefix_len, :prefix_len] = 1.0
    return m


# ----------------------------------------------------------------- 3.5 packed_causal_mask


def packed_plain_causal(seq_lens):
    N = sum(seq_lens)
    return torch.ones(N, N, dtype=torch.bool).tril()


def packed_bidirectional_blocks(seq_lens):
    return torch.block_diag(*[torch.ones(n, n, dtype=torch.bool) for n in seq_lens])


def packed_boundary_off_by_one(seq_lens):
    cu = torch.tensor([0, *seq_lens]).cumsum(0)
    pos = torch.arange(int(cu[-1]))
    seq = torch.bucketize(pos, cu[1:-1])  # right=False: a boundary position joins the previous sequence
    return (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])


def packed_float(seq_lens):
    return torch.block_diag(*[torch.ones(n, n).tril() for n in seq_lens])


def packed_additive(seq_lens):
    allowed = torch.block_diag(*[torch.ones(n, n).tril() for n in seq_lens]).bool()
    return torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))


def packed_reverses_seq_lens(seq_lens):
    mask = torch.block_diag(*[torch.ones(n, n, dtype=torch.bool).tril() for n in seq_lens])
    seq_lens.reverse()  # changes the caller's list
    return mask


# ----------------------------------------------------------------- 3.6 find_mask_leaks


def _perturbation_matrix(attention_fn, allowed, d_model, dtype=torch.float64, tol=1e-6):
    T = allowed.shape[-1]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, T, d_model, generator=g, dtype=dtype)
    base = attention_fn(x)
    moved = torch.zeros(T, T, dtype=torch.bool)
    for j in range(T):
        x2 = x.clone()
        x2[0, j] += torch.randn(d_model, generator=g, dtype=dtype)
        moved[:, j] = (attention_fn(x2) - base).abs().amax(-1)[0] > tol * (1 + base.abs().max())
    return moved & ~allowed


def leaks_report_everything(attention_fn, allowed, d_model):
    return [tuple(p) for p in (~allowed).nonzero().tolist()]


def leaks_report_nothing(attention_fn, allowed, d_model):
    return []


def leaks_zero_probe(attention_fn, allowed, d_model):
    """Start from zeros and light up one position at a time: misses denominator leaks."""
    T = allowed.shape[-1]
    found = []
    for j in range(T):
        x = torch.zeros(1, T, d_model, dtype=torch.float64)
        x[0, j] = 1.0 + torch.arange(d_model, dtype=torch.float64) / d_model
        out = attention_fn(x)
        for i in range(T):
            if not allowed[i, j] and out[0, i].abs().max() > 1e-9:
                found.append((i, j))
    return sorted(found)


def leaks_no_tolerance(attention_fn, allowed, d_model):
    return [tuple(p) for p in _perturbation_matrix(attention_fn, allowed, d_model, tol=0.0).nonzero().tolist()]


def leaks_key_major(attention_fn, allowed, d_model):
    moved = _perturbation_matrix(attention_fn, allowed, d_model)
    return [(i, j) for j in range(moved.shape[1]) for i in range(moved.shape[0]) if moved[i, j]]


def leaks_duplicated(attention_fn, allowed, d_model):
    pairs = []
    for _ in range(2):  # two trials, appended without merging
        pairs += [tuple(p) for p in _perturbation_matrix(attention_fn, allowed, d_model).nonzero().tolist()]
    return sorted(pairs)


def leaks_swapped(attention_fn, allowed, d_model):
    return sorted((j, i) for i, j in _perturbation_matrix(attention_fn, allowed, d_model).nonzero().tolist())


def leaks_as_lists(attention_fn, allowed, d_model):
    return _perturbation_matrix(attention_fn, allowed, d_model).nonzero().tolist()


def leaks_as_tensor(attention_fn, allowed, d_model):
    return _perturbation_matrix(attention_fn, allowed, d_model).nonzero()


def leaks_unbatched_input(attention_fn, allowed, d_model):
    T = allowed.shape[-1]
    attention_fn(torch.randn(T, d_model))  # forgot the batch axis
    return []


def leaks_include_allowed(attention_fn, allowed, d_model):
    T = allowed.shape[-1]
    x = torch.randn(1, T, d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    base = attention_fn(x)
    pairs = []
    for j in range(T):
        x2 = x.clone()
        x2[0, j] += torch.randn(d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(50 + j))
        moved = (attention_fn(x2) - base).abs().amax(-1)[0] > 1e-6
        pairs += [(i, j) for i in range(T) if moved[i]]  # forgot to keep only disallowed pairs
    return sorted(pairs)


def masked_softmax_times_mask(scores, allowed):
    return torch.softmax(scores * allowed, dim=-1)  # "the mask is 0/1: multiply"


def masked_softmax_sigmoid(scores, allowed):
    return torch.sigmoid(scores).masked_fill(~allowed, 0.0)


# ----------------------------------------------------------------- issue 32: more mistakes, named by property


def causal_two_ahead(T):
    i = torch.arange(T)
    return i[None, :] <= i[:, None] + 2


def causal_nothing_blocked(T):
    return torch.full((T, T), True)


def causal_nothing_allowed(T):
    return torch.zeros(T, T, dtype=torch.bool)


def causal_eye(T):
    return torch.eye(T) > 0


def causal_fliplr(T):
    return torch.fliplr(torch.ones(T, T, dtype=torch.bool).tril())


def causal_flipud(T):
    return torch.flipud(torch.ones(T, T, dtype=torch.bool).tril())


def causal_while_last_row(T):
    m = torch.zeros(T, T, dtype=torch.bool)
    i = 0
    while i < T - 1:
        m[i, : i + 1] = True
        i += 1
    return m


def causal_first_row_skipped(T):
    m = torch.zeros(T, T, dtype=torch.bool)
    for i in range(1, T):
        m[i, : i + 1] = True
    return m


def causal_one_too_big(T):
    return torch.ones(T + 1, T + 1, dtype=torch.bool).tril()


def padding_three_axes(lengths, T):
    return (torch.arange(T) < lengths.unsqueeze(-1)).unsqueeze(1)  # [B, 1, T]


def padding_keys_second(lengths, T):
    return (torch.arange(T) < lengths.unsqueeze(-1))[..., None, None]  # [B, T, 1, 1]


def padding_axes_in_front(lengths, T):
    return (torch.arange(T) < lengths.unsqueeze(-1)).view(1, 1, len(lengths), T)


def padding_slice_minus_one(lengths, T):
    rows = [torch.zeros(T, dtype=torch.bool) for _ in lengths]
    for row, n in zip(rows, lengths.tolist()):
        row[: n - 1] = True
    return torch.stack(rows)[:, None, None, :]


def padding_first_length_for_all(lengths, T):
    return (torch.arange(T) < lengths[0]).repeat(len(lengths), 1)[:, None, None, :]


def padding_view_of_transpose(lengths, T):
    table = torch.arange(T).unsqueeze(1) < lengths.unsqueeze(0)  # [T, B]
    return table.contiguous().view(len(lengths), 1, 1, T)


def padding_width_of_longest(lengths, T):
    width = int(lengths.max())
    return (torch.arange(width)[None, :] < lengths[:, None])[:, None, None, :]


def softmax_no_max_nan_to_num(scores, allowed):
    e = torch.exp(scores).masked_fill(~allowed, 0.0)
    return (e / e.sum(-1, keepdim=True)).nan_to_num(0.0)


def softmax_in_float32(scores, allowed):
    s = scores.to(torch.float32).masked_fill(~allowed, float("-inf"))
    return torch.softmax(s, dim=-1).nan_to_num(0.0)


def softmax_float32_cast_back(scores, allowed):
    s = scores.to(torch.float32).masked_fill(~allowed, float("-inf"))
    return torch.softmax(s, dim=-1).nan_to_num(0.0).to(scores.dtype)


def softmax_reshaped_mask(scores, allowed):
    a = allowed.reshape(scores.shape)
    return torch.softmax(scores.masked_fill(~a, float("-inf")), dim=-1).nan_to_num(0.0)


def softmax_fill_minus_5e4(scores, allowed):
    return torch.softmax(torch.where(allowed, scores, torch.full_like(scores, -5e4)), dim=-1)


def softmax_fill_zero_rows_zeroed(scores, allowed):
    p = torch.softmax(torch.where(allowed, scores, torch.zeros_like(scores)), dim=-1)
    return torch.where(allowed.any(-1, keepdim=True), p, torch.zeros_like(p))


def softmax_global_max(scores, allowed):
    e = torch.exp(scores - scores.max()) * allowed
    total = e.sum(-1, keepdim=True)
    return torch.where(total > 0, e / total, torch.zeros_like(e))


def softmax_max_over_queries(scores, allowed):
    s = scores.masked_fill(~allowed, float("-inf"))
    m = s.amax(-2, keepdim=True)
    e = torch.exp(s - torch.where(torch.isfinite(m), m, torch.zeros_like(m)))
    total = e.sum(-1, keepdim=True)
    return torch.where(total > 0, e / total, torch.zeros_like(e))


def prefix_suffix_rows_open(T, prefix_len):
    m = torch.ones(T, T, dtype=torch.bool).tril()
    m[:prefix_len, :prefix_len] = True
    m[prefix_len:] = True
    return m


def prefix_strict_after(T, prefix_len):
    m = torch.ones(T, T, dtype=torch.bool).tril(-1)
    m[:prefix_len, :prefix_len] = True
    return m


def prefix_no_self(T, prefix_len):
    m = torch.ones(T, T, dtype=torch.bool).tril()
    m[:prefix_len, :prefix_len] = True
    return m & ~torch.eye(T, dtype=torch.bool)


def prefix_rows_are_keys(T, prefix_len):
    m = torch.ones(T, T, dtype=torch.bool).triu()
    m[:prefix_len, :prefix_len] = True
    return m


def prefix_block_last(T, prefix_len):
    m = torch.ones(T, T, dtype=torch.bool).tril()
    m[T - prefix_len:, T - prefix_len:] = True
    return m


def prefix_block_and_self(T, prefix_len):
    m = torch.eye(T, dtype=torch.bool)
    m[:prefix_len, :prefix_len] = True
    return m


def prefix_tril_offset(T, prefix_len):
    return torch.ones(T, T, dtype=torch.bool).tril(prefix_len)


def prefix_with_batch_axes(T, prefix_len):
    return prefix_block_assign(T, prefix_len).unsqueeze(0).unsqueeze(0)


def prefix_slice_one_short(T, prefix_len):
    m = torch.ones(T, T, dtype=torch.bool).tril()
    m[: prefix_len - 1, : prefix_len - 1] = True
    return m


def _ids(seq_lens):
    return torch.cat([torch.full((n,), s) for s, n in enumerate(seq_lens)])


def packed_last_token_joins_next(seq_lens):
    ids = _ids(seq_lens)
    ids = torch.cat([ids[1:], ids[-1:]])  # each position takes the id of the next one
    pos = torch.arange(len(ids))
    return (ids[:, None] == ids[None, :]) & (pos[None, :] <= pos[:, None])


def packed_upper_blocks(seq_lens):
    return torch.block_diag(*[torch.ones(n, n, dtype=torch.bool).triu() for n in seq_lens])


def packed_no_self(seq_lens):
    ids = _ids(seq_lens)
    pos = torch.arange(len(ids))
    return (ids[:, None] == ids[None, :]) & (pos[None, :] < pos[:, None])


def packed_singletons_dropped(seq_lens):
    return torch.block_diag(*[torch.ones(n, n, dtype=torch.bool).tril() & (n > 1) for n in seq_lens])


def packed_from_ends(seq_lens):
    ends = list(itertools.accumulate(seq_lens))  # no leading 0
    N = ends[-1]
    m = torch.zeros(N, N, dtype=torch.bool)
    for a, b in zip(ends[:-1], ends[1:]):
        m[a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
    return m


def packed_last_dropped(seq_lens):
    N = sum(seq_lens)
    m = torch.zeros(N, N, dtype=torch.bool)
    start = 0
    for n in seq_lens[:-1]:
        m[start:start + n, start:start + n] = torch.ones(n, n, dtype=torch.bool).tril()
        start += n
    return m


def packed_every_other_sequence(seq_lens):
    blocks = [torch.ones(n, n, dtype=torch.bool).tril() & (s % 2 == 0) for s, n in enumerate(seq_lens)]
    return torch.block_diag(*blocks)


def packed_all_at_origin(seq_lens):
    N = sum(seq_lens)
    m = torch.zeros(N, N, dtype=torch.bool)
    for n in seq_lens:
        m[:n, :n] |= torch.ones(n, n, dtype=torch.bool).tril()
    return m


def packed_offset_first(seq_lens):
    N = sum(seq_lens)
    m = torch.zeros(N, N, dtype=torch.bool)
    offset = 0
    for n in seq_lens:
        offset += n
        end = min(offset + n, N)
        m[offset:end, offset:end] = torch.ones(end - offset, end - offset, dtype=torch.bool).tril()
    return m


def packed_reversed(seq_lens):
    return torch.block_diag(*[torch.ones(n, n, dtype=torch.bool).tril() for n in reversed(seq_lens)])


def packed_longest_first(seq_lens):
    return torch.block_diag(*[torch.ones(n, n, dtype=torch.bool).tril() for n in sorted(seq_lens, reverse=True)])


def packed_shortest_first(seq_lens):
    lens = sorted(seq_lens)
    return torch.block_diag(*[torch.ones(n, n, dtype=torch.bool).tril() for n in lens])


def prefix_last_row_left(T, prefix_len):
    m = prefix_block_assign(T, prefix_len)
    m[-1] = False
    return m


def leaks_last_query_skipped(attention_fn, allowed, d_model):
    moved = _perturbation_matrix(attention_fn, allowed, d_model)
    T = allowed.shape[-1]
    return [(i, j) for i, j in moved.nonzero().tolist() if i < T - 1]


def padding_keys_by_batch(lengths, T):
    return torch.arange(T)[:, None] < lengths  # [T, B]


def padding_padded_keys_strictly_after(lengths, T):
    return (torch.arange(T)[None, :] > lengths[:, None])[:, None, None, :]


def softmax_scaled_by_sqrt_keys(scores, allowed):
    s = scores / scores.shape[-1] ** 0.5
    return torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)


def softmax_log_weights(scores, allowed):
    return torch.log_softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)


def leaks_absolute_tolerance(attention_fn, allowed, d_model):
    T = allowed.shape[-1]
    x = torch.randn(1, T, d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    base = attention_fn(x)
    found = []
    for j in range(T):
        x2 = x.clone()
        x2[0, j] += torch.randn(d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(100 + j))
        moved = (attention_fn(x2) - base)[0].abs().amax(-1) > 1e-3  # an absolute threshold, too loose here
        found += [(i, j) for i in range(T) if moved[i] and not allowed[i, j]]
    return sorted(found)


def packed_sees_previous(seq_lens):
    ids = _ids(seq_lens)
    pos = torch.arange(len(ids))
    own = (ids[:, None] == ids[None, :]) & (pos[None, :] <= pos[:, None])
    return own | (ids[None, :] + 1 == ids[:, None])


def packed_first_token_visible(seq_lens):
    m = torch.block_diag(*[torch.ones(n, n, dtype=torch.bool).tril() for n in seq_lens])
    m[:, 0] = True  # every token also reads position 0 (a BOS shared by the pack)
    return m


def _moved(attention_fn, x, j, base, bump=1.0, dtype=torch.float64):
    x2 = x.clone()
    x2[0, j] += bump * torch.randn(x.shape[-1], generator=torch.Generator().manual_seed(j), dtype=dtype)
    return (attention_fn(x2) - base).abs().amax(-1)[0]


def _base(allowed, d_model, dtype=torch.float64):
    x = torch.randn(1, allowed.shape[-1], d_model, dtype=dtype, generator=torch.Generator().manual_seed(3))
    return x


def leaks_mask_read_by_column(attention_fn, allowed, d_model):
    x = _base(allowed, d_model)
    base = attention_fn(x)
    T = allowed.shape[-1]
    found = []
    for j in range(T):
        moved = _moved(attention_fn, x, j, base) > 1e-7 * (1 + base.abs().max())
        found += [(i, j) for i in range(T) if moved[i] and not allowed.T[i, j]]
    return sorted(found)


def leaks_row_of_perturbed(attention_fn, allowed, d_model):
    x = _base(allowed, d_model)
    base = attention_fn(x)
    T = allowed.shape[-1]
    found = []
    for j in range(T):
        moved = _moved(attention_fn, x, j, base) > 1e-7 * (1 + base.abs().max())
        found += [(i, j) for i in range(T) if moved[j] and not allowed[i, j]]
    return sorted(found)


def leaks_never_reset(attention_fn, allowed, d_model):
    x = _base(allowed, d_model)
    base = attention_fn(x)
    T = allowed.shape[-1]
    found = []
    for j in range(T):
        x[0, j] += torch.randn(d_model, dtype=torch.float64)  # never restored
        moved = (attention_fn(x) - base).abs().amax(-1)[0] > 1e-7 * (1 + base.abs().max())
        found += [(i, j) for i in range(T) if moved[i] and not allowed[i, j]]
    return sorted(found)


def leaks_kept_unmoved(attention_fn, allowed, d_model):
    x = _base(allowed, d_model)
    base = attention_fn(x)
    T = allowed.shape[-1]
    found = []
    for j in range(T):
        still = _moved(attention_fn, x, j, base) <= 1e-7 * (1 + base.abs().max())
        found += [(i, j) for i in range(T) if still[i] and not allowed[i, j]]
    return sorted(found)


def _region_finder(keep):
    def finder(attention_fn, allowed, d_model):
        moved = _perturbation_matrix(attention_fn, allowed, d_model)
        return [(i, j) for i, j in moved.nonzero().tolist() if keep(i, j)]
    return finder


leaks_no_diagonal = _region_finder(lambda i, j: i != j)
leaks_no_diagonal.__name__ = "leaks_no_diagonal"
leaks_only_future = _region_finder(lambda i, j: j > i)
leaks_only_future.__name__ = "leaks_only_future"
leaks_not_past = _region_finder(lambda i, j: j >= i)
leaks_not_past.__name__ = "leaks_not_past"
leaks_key_0_skipped = _region_finder(lambda i, j: j > 0)
leaks_key_0_skipped.__name__ = "leaks_key_0_skipped"


def leaks_last_position_skipped(attention_fn, allowed, d_model):
    moved = _perturbation_matrix(attention_fn, allowed, d_model)
    T = allowed.shape[-1]
    return [(i, j) for i, j in moved.nonzero().tolist() if j < T - 1]


def leaks_query_0_skipped(attention_fn, allowed, d_model):
    moved = _perturbation_matrix(attention_fn, allowed, d_model)
    return [(i, j) for i, j in moved.nonzero().tolist() if i > 0]


def leaks_one_based(attention_fn, allowed, d_model):
    moved = _perturbation_matrix(attention_fn, allowed, d_model)
    return [(i + 1, j + 1) for i, j in moved.nonzero().tolist()]


def leaks_relative_tolerance_too_big(attention_fn, allowed, d_model):
    moved = _perturbation_matrix(attention_fn, allowed, d_model, tol=5e-3)
    return [tuple(p) for p in moved.nonzero().tolist()]


def leaks_step_too_small(attention_fn, allowed, d_model):
    x = _base(allowed, d_model, dtype=torch.float32)
    base = attention_fn(x)
    T = allowed.shape[-1]
    found = []
    for j in range(T):
        moved = _moved(attention_fn, x, j, base, bump=1e-10, dtype=torch.float32) > 1e-6 * (1 + base.abs().max())
        found += [(i, j) for i in range(T) if moved[i] and not allowed[i, j]]
    return sorted(found)


# ----------------------------------------------------------------- issue 32, round 2 of the outside review


_CACHED_512 = torch.tril(torch.ones(512, 512)).bool()


def causal_cached_buffer(T):
    return _CACHED_512[:T, :T].clone()  # a buffer made once for at most 512 positions


def padding_pad_count_loop(lengths, T):
    m = torch.zeros(len(lengths), 1, 1, T, dtype=torch.bool)
    for b, n in enumerate(lengths.tolist()):
        m[b, 0, 0, : T - n] = True  # lengths read as the number of padded positions
    return m


def padding_same_axis(lengths, T):
    return (torch.arange(T) < lengths).reshape(-1, 1, 1, T)  # T positions against B lengths: a broadcast error


def softmax_guard_on_last_axis(scores, allowed):
    p = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return p.masked_fill(~allowed.any(dim=-1), 0.0)  # [.., T_q] against [.., T_q, T_k]


def softmax_zero_fill_then_zeroed(scores, allowed):
    p = torch.softmax(scores.masked_fill(~allowed, 0.0), dim=-1)
    return p.masked_fill(~allowed, 0.0)


def softmax_fill_row_min_minus_5(scores, allowed):
    low = scores.amin(dim=-1, keepdim=True) - 5
    return torch.softmax(torch.where(allowed, scores, low), dim=-1)


def prefix_block_and_causal(T, prefix_len):
    m = torch.zeros(T, T, dtype=torch.bool)
    m[:prefix_len, :prefix_len] = True
    return m & torch.ones(T, T, dtype=torch.bool).tril()


def prefix_block_rows_from_one(T, prefix_len):
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    return (j <= i) | ((i >= 1) & (i < prefix_len) & (j < prefix_len))


def packed_same_or_causal(seq_lens):
    ids = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(list(seq_lens)))
    causal = torch.ones(len(ids), len(ids), dtype=torch.bool).tril()
    return torch.logical_or(ids[:, None] == ids[None, :], causal)


def leaks_uniform_bump(attention_fn, allowed, d_model):
    T = allowed.shape[-1]
    x = torch.randn(1, T, d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    base = attention_fn(x)
    found = set()
    for j in range(T):
        x2 = x.clone()
        x2[0, j] = x2[0, j] + 0.5  # the same number on every feature
        moved = (attention_fn(x2) - base)[0].abs().amax(-1) > 1e-6 * (1 + base.abs().max())
        found |= {(i, j) for i in range(T) if moved[i] and not allowed[i, j]}
    return sorted(found)


def leaks_in_float32(attention_fn, allowed, d_model):
    T = allowed.shape[-1]
    g = torch.Generator().manual_seed(6)
    x = torch.randn(1, T, d_model, generator=g)  # float32
    base = attention_fn(x)
    found = []
    for j in range(T):
        x2 = x.clone()
        x2[0, j] += torch.randn(d_model, generator=g)
        moved = (attention_fn(x2) - base)[0].abs().amax(-1) > 1e-6 * (1 + base.abs().max())
        found += [(i, j) for i in range(T) if moved[i] and not allowed[i, j]]
    return sorted(found)


WRONG = {
    "causal_mask": [
        (causal_inverted, "the mask is inverted"),
        (causal_upper, "upper triangle"),
        (causal_no_diagonal, "the diagonal is missing"),
        (causal_one_ahead, "one step into the future"),
        (causal_float, "return a bool tensor"),
        (causal_additive, "an additive (0 / -inf) mask"),
        (causal_with_batch_axes, "return the [T, T] mask itself"),
        (causal_numpy, "expected a torch.Tensor"),
        (causal_two_ahead, "its edge is not on the diagonal"),
        (causal_nothing_blocked, "your mask is all True"),
        (causal_nothing_allowed, "your mask is all False"),
        (causal_eye, "allows only the diagonal"),
        (causal_fliplr, "mirrored left-right"),
        (causal_flipud, "mirrored top-bottom"),
        (causal_while_last_row, "the last row (query T-1) is all False"),
        (causal_first_row_skipped, "some rows of your mask are all False"),
        (causal_one_too_big, "[T + 1, T + 1]"),
        (causal_cached_buffer, "the causal triangle of a fixed largest size"),
    ],
    "padding_mask": [
        (padding_flat, "not [B, T]"),
        (padding_queries, "masked queries (rows) instead of keys"),
        (padding_queries_full, "masked queries (rows) instead of keys"),
        (padding_inclusive, "not j <= L"),
        (padding_inverted, "key_padding_mask uses the opposite"),
        (padding_left, "right padding"),
        (padding_float, "return a bool tensor"),
        (padding_additive, "additive (0 / -inf) mask"),
        (padding_last_index_in_place, "modified one of its input tensors in place"),
        (padding_three_axes, "not [B, 1, T]"),
        (padding_keys_second, "your key axis is the second one"),
        (padding_axes_in_front, "your singleton axes are in front"),
        (padding_slice_minus_one, "not [:L - 1]"),
        (padding_first_length_for_all, "every sequence got the same mask"),
        (padding_view_of_transpose, "a reshape does not transpose"),
        (padding_width_of_longest, "not lengths.max()"),
        (padding_keys_by_batch, "your mask is [T, B], keys first"),
        (padding_padded_keys_strictly_after, "your mask is inverted and off by one"),
        (padding_pad_count_loop, "allows the first T - lengths[b] keys"),
        (padding_same_axis, "met the axis of the B lengths"),
    ],
    "masked_softmax": [
        (softmax_nan_rows, "rows with nothing allowed came out NaN"),
        (softmax_mask_after, "you masked after the softmax:"),
        (softmax_mask_after_renormalised, "then masked and renormalised"),
        (softmax_no_max_subtraction, "exp overflowed"),
        (softmax_big_negative, "finite number instead of -inf: a row with nothing allowed"),
        (softmax_fill_minus_1e4, "finite number instead of -inf: a row with nothing allowed"),
        (softmax_fill_minus_1e4_empty_rows_zeroed, "some allowed scores here lie below it"),
        (softmax_in_place, "modified one of its input tensors in place"),
        (softmax_inverted, "the mask is inverted"),
        (softmax_boolean_index, "allowed only *broadcasts* to scores"),
        (softmax_float64, "expected dtype torch.float32"),
        (masked_softmax_times_mask, "the scores multiplied by the mask"),
        (masked_softmax_sigmoid, "you used a sigmoid"),
        (softmax_no_max_nan_to_num, "exp overflowed"),
        (softmax_in_float32, "expected dtype torch.float64 (the dtype of scores), got torch.float32"),
        (softmax_float32_cast_back, "your weights have only float32 precision"),
        (softmax_reshaped_mask, "reshape/view cannot make it the scores' shape"),
        (softmax_fill_minus_5e4, "finite number instead of -inf: a row with nothing allowed"),
        (softmax_fill_zero_rows_zeroed, "some allowed scores here lie below it"),
        (softmax_global_max, "one maximum for the whole tensor"),
        (softmax_max_over_queries, "the maximum you subtract is not each row's"),
        (softmax_scaled_by_sqrt_keys, "you scaled the scores"),
        (softmax_log_weights, "your weights are log-probabilities"),
        (softmax_guard_on_last_axis, "two tensors whose shapes do not broadcast"),
        (softmax_zero_fill_then_zeroed, "zeroing their weights afterwards leaves rows that sum to less than 1"),
        (softmax_fill_row_min_minus_5, "only a little below the scores"),
    ],
    "prefix_lm_mask": [
        (prefix_sees_future, "the prefix sees the future"),
        (prefix_one_too_many, "one too large"),
        (prefix_suffix_blind, "suffix positions must still see the whole prefix"),
        (prefix_plain_causal, "plain causal mask"),
        (prefix_inverted, "the mask is inverted"),
        (prefix_float, "return a bool tensor"),
        (prefix_suffix_rows_open, "your suffix rows are all True"),
        (prefix_strict_after, "suffix positions must see themselves too"),
        (prefix_no_self, "the diagonal is missing"),
        (prefix_rows_are_keys, "your mask is transposed"),
        (prefix_block_last, "your bidirectional block is at the end"),
        (prefix_block_and_self, "not only itself"),
        (prefix_tril_offset, "you shifted the causal diagonal"),
        (prefix_with_batch_axes, "return the [T, T] mask itself"),
        (prefix_slice_one_short, "one too small"),
        (prefix_last_row_left, "the whole prefix for a prefix row"),
        (prefix_block_and_causal, "combine the two with |, not &"),
        (prefix_block_rows_from_one, "some prefix rows (query i < prefix_len, the first here)"),
    ],
    "packed_causal_mask": [
        (packed_plain_causal, "across sequence boundaries"),
        (packed_bidirectional_blocks, "must be causal"),
        (packed_boundary_off_by_one, "boundaries are off by one"),
        (packed_float, "return a bool tensor"),
        (packed_additive, "additive (0 / -inf) mask"),
        (packed_reverses_seq_lens, "modified its argument `seq_lens` (list) in place"),
        (packed_last_token_joins_next, "the last token of each sequence is grouped with the next"),
        (packed_upper_blocks, "your blocks are upper triangles"),
        (packed_no_self, "the diagonal is missing"),
        (packed_singletons_dropped, "the sequences of length 1 have no block"),
        (packed_from_ends, "the first sequence has no block"),
        (packed_last_dropped, "the last sequence has no block"),
        (packed_every_other_sequence, "some sequences have no block"),
        (packed_all_at_origin, "every block starts at position 0"),
        (packed_offset_first, "each block is placed where the *next* sequence starts"),
        (packed_reversed, "reverse order of seq_lens"),
        (packed_longest_first, "its blocks do not have the sizes of seq_lens"),
        (packed_shortest_first, "your blocks are in order of size"),
        (packed_sees_previous, "also reads the whole previous sequence"),
        (packed_first_token_visible, "some tokens read keys of another sequence"),
        (packed_same_or_causal, "combine the two rules with &, not |"),
    ],
    "find_mask_leaks": [
        (leaks_report_everything, "you reported every disallowed pair, on every case"),
        (leaks_report_nothing, "reported no pair on any case"),
        (leaks_zero_probe, "softmax denominator"),
        (leaks_no_tolerance, "float round-off"),
        (leaks_key_major, "sorted(pairs)"),
        (leaks_duplicated, "each pair should appear once"),
        (leaks_swapped, "(key, query)"),
        (leaks_as_lists, "tuple (i, j) of two ints"),
        (leaks_as_tensor, "got a tensor"),
        (leaks_unbatched_input, "shape [1, T, d_model]"),
        (leaks_include_allowed, "every dependency, the allowed ones too"),
        (leaks_mask_read_by_column, "you read the mask as allowed[j, i]"),
        (leaks_row_of_perturbed, "you decide from output row j"),
        (leaks_never_reset, "your perturbations accumulate"),
        (leaks_kept_unmoved, "did NOT move"),
        (leaks_no_diagonal, "you never report a pair with i == j"),
        (leaks_only_future, "you only report future keys"),
        (leaks_not_past, "you never report a key before its query"),
        (leaks_key_0_skipped, "you never report key j = 0"),
        (leaks_last_position_skipped, "you never report key j = T - 1"),
        (leaks_query_0_skipped, "you never report query i = 0"),
        (leaks_last_query_skipped, "you never report query i = T - 1"),
        (leaks_one_based, "your pairs are off by one position"),
        (leaks_relative_tolerance_too_big, "missed only weak ones"),
        (leaks_step_too_small, "reported no pair on any case"),
        (leaks_absolute_tolerance, "your tolerance is too loose"),
        (leaks_uniform_bump, "adds the same number to every feature"),
        (leaks_in_float32, "float32 keeps about 7 significant digits"),
    ],
}


# --------------------------------------------------------------- right variants


# ----------------------------------------------------------------- 3.1 causal_mask


def causal_arange(T):
    i = torch.arange(T)
    return i[None, :] <= i[:, None]


def causal_loops(T):
    m = torch.zeros(T, T, dtype=torch.bool)
    for i in range(T):
        m[i, : i + 1] = True
    return m


def causal_not_triu(T):
    return ~torch.ones(T, T, dtype=torch.bool).triu(1)


_BUFFER = [torch.ones(0, 0, dtype=torch.bool)]


def causal_growing_buffer(T):
    if _BUFFER[0].shape[0] < T:  # a cached buffer, rebuilt larger when T exceeds it
        _BUFFER[0] = torch.ones(2 * T, 2 * T, dtype=torch.bool).tril()
    return _BUFFER[0][:T, :T].clone()


# ----------------------------------------------------------------- 3.2 padding_mask


def padding_expand_view(lengths, T):
    B = lengths.shape[0]
    return (torch.arange(T).expand(B, T) < lengths.unsqueeze(1)).view(B, 1, 1, T)


def padding_loops(lengths, T):
    m = torch.zeros(len(lengths), 1, 1, T, dtype=torch.bool)
    for b, n in enumerate(lengths.tolist()):
        m[b, 0, 0, :n] = True
    return m


# ----------------------------------------------------------------- 3.3 masked_softmax


def softmax_big_negative_and_zero_rows(scores, allowed):
    # -1e9 is far below every score here (|scores| <= ~5e4): the maths allows a finite fill, as long
    # as rows with nothing allowed are set to zero.
    p = torch.softmax(scores.masked_fill(~allowed, -1e9), dim=-1)
    return torch.where(allowed.any(-1, keepdim=True), p, torch.zeros_like(p))


def softmax_finfo_min(scores, allowed):
    p = torch.softmax(scores.masked_fill(~allowed, torch.finfo(scores.dtype).min), dim=-1)
    return p * allowed.any(-1, keepdim=True)


def softmax_nan_to_num(scores, allowed):
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)


def softmax_by_hand(scores, allowed):
    a = allowed.expand_as(scores)
    m = torch.where(a, scores, torch.full_like(scores, float("-inf"))).amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.where(a, torch.exp(scores - m), torch.zeros_like(scores))
    total = e.sum(-1, keepdim=True)
    return e / torch.where(total > 0, total, torch.ones_like(total))


def softmax_float64_log_space(scores, allowed):
    s = scores.double().masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)))
    return p.to(scores.dtype)


# ----------------------------------------------------------------- 3.4 prefix_lm_mask


def prefix_block_assign(T, prefix_len):
    m = torch.ones(T, T, dtype=torch.bool).tril()
    m[:prefix_len, :prefix_len] = True
    return m


def prefix_arange(T, prefix_len):
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    return (j <= i) | ((i < prefix_len) & (j < prefix_len))


# ----------------------------------------------------------------- 3.5 packed_causal_mask


def packed_block_diag(seq_lens):
    return torch.block_diag(*[torch.ones(n, n, dtype=torch.bool).tril() for n in seq_lens])


def packed_repeat_interleave(seq_lens):
    lens = torch.tensor(list(seq_lens))
    ids = torch.repeat_interleave(torch.arange(len(lens)), lens)
    pos = torch.arange(ids.numel())
    return (ids[:, None] == ids[None, :]) & (pos[None, :] <= pos[:, None])


def packed_loops(seq_lens):
    N = sum(seq_lens)
    m = torch.zeros(N, N, dtype=torch.bool)
    start = 0
    for n in seq_lens:
        for i in range(n):
            m[start + i, start: start + i + 1] = True
        start += n
    return m


# ----------------------------------------------------------------- 3.6 find_mask_leaks


def leaks_vector_perturbation(attention_fn, allowed, d_model):
    T = allowed.shape[-1]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, T, d_model, generator=g, dtype=torch.float64)
    base = attention_fn(x)
    pairs = set()
    for j in range(T):
        bumped = x.clone()
        bumped[0, j] += torch.randn(d_model, generator=g, dtype=torch.float64)
        moved = (attention_fn(bumped) - base)[0].abs().amax(-1) > 1e-7 * (1 + base.abs().max())
        pairs |= {(i, j) for i in range(T) if moved[i] and not allowed[i, j]}
    return sorted(pairs)


def leaks_jacobian(attention_fn, allowed, d_model):
    # The influence of every input position on every output row, from autograd: allowed here.
    T = allowed.shape[-1]
    x = torch.randn(1, T, d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    jac = torch.autograd.functional.jacobian(attention_fn, x)  # [1, T, D, 1, T, D]
    moved = jac[0, :, :, 0].abs().amax(dim=(1, 3)) > 1e-9
    return [(i, j) for i in range(T) for j in range(T) if moved[i, j] and not allowed[i, j]]


def leaks_small_bump_tight_tolerance(attention_fn, allowed, d_model):
    T = allowed.shape[-1]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, T, d_model, generator=g, dtype=torch.float64)
    base = attention_fn(x)
    pairs = set()
    for j in range(T):
        x_j = x.clone()
        x_j[0, j] += 1e-2 * torch.randn(d_model, generator=g, dtype=torch.float64)
        moved = (attention_fn(x_j) - base)[0].abs().amax(-1) > 1e-8 * (1 + base.abs().max())
        pairs |= {(i, j) for i in range(T) if moved[i] and not allowed[i, j]}
    return sorted(pairs)


RIGHT = {
    "causal_mask": [causal_arange, causal_loops, causal_not_triu, causal_growing_buffer],
    "padding_mask": [padding_expand_view, padding_loops],
    "masked_softmax": [softmax_big_negative_and_zero_rows, softmax_finfo_min, softmax_nan_to_num, softmax_by_hand,
                       softmax_float64_log_space],
    "prefix_lm_mask": [prefix_block_assign, prefix_arange],
    "packed_causal_mask": [packed_block_diag, packed_repeat_interleave, packed_loops],
    "find_mask_leaks": [leaks_vector_perturbation, leaks_jacobian, leaks_small_bump_tight_tolerance],
}


# make test runs the first 8 wrong answers of each exercise (the commonest); make test-all all of them
@pytest.mark.parametrize(("name", "wrong", "hint"), first_fast(wrong_cases(WRONG), dict.fromkeys(WRONG, 8)))
def test_check_rejects_wrong(name, wrong, hint):
    assert_rejected(name, wrong, hint)


@pytest.mark.parametrize(("name", "right"), right_cases(RIGHT))
def test_check_accepts_right(name, right):
    assert_accepted(name, right)


# --------------------------------------------------------------- every modelled mistake is named as itself

EXERCISES_BY_NAME = EXERCISES


def _mask_cases():
    from helpers.checks.core import draw, seeded

    g = seeded(350)
    causal = [(T,) for T in (5, 1, 8, draw(g, 2, 65), 1025 + draw(g, 0, 40))]
    pad = [(torch.tensor([3, 6, 1, 0]), 6), (torch.tensor([2, 5], dtype=torch.int32), 7), (torch.tensor([4, 4, 1]), 4)]
    g = seeded(351)
    T, B = draw(g, 6, 33), draw(g, 2, 6)
    pad.append((torch.randint(0, T + 1, (B,), generator=g), T))
    g = seeded(352)
    T = draw(g, 2, 33)
    prefix = [(7, 3), (6, 0), (5, 5), (9, 4), (T, draw(g, 0, T + 1))]
    g = seeded(353)
    packed = [((3, 2, 4),), ((5,),), ((1, 4, 2, 3),), ((2, 1, 1),), (tuple(draw(g, 1, 6) for _ in range(draw(g, 1, 5))),)]
    return {"causal_mask": (causal, lambda a, got: c3._causal_models(a[0], got)),
            "padding_mask": (pad, lambda a, got: c3._padding_models(a[0], a[1], got)),
            "prefix_lm_mask": (prefix, lambda a, got: c3._prefix_models(a[0], a[1], got)),
            "packed_causal_mask": (packed, lambda a, got: c3._packed_models(a[0], got))}


def _key(args):
    return tuple(tuple(a.tolist()) if isinstance(a, torch.Tensor) else tuple(a) if isinstance(a, list) else a for a in args)


# mistakes found by a property of the output: their plain model (what they give when the output is none of
# their family) is another mistake's, named first
_PROPERTY_SLUGS = {"rows-missing", "sequences-missing", "blocks-of-wrong-sizes"}


@pytest.mark.parametrize("name", ["causal_mask", *(pytest.param(n, marks=pytest.mark.slow)
                                                  for n in ("padding_mask", "prefix_lm_mask", "packed_causal_mask"))])
def test_every_mask_mistake_model_is_named_as_itself(name):
    """A learner whose mask is a mistake's model on every case is told that mistake, in its words: no two
    mistakes coincide on all the cases, and each one shows on some case."""
    cases, models = _mask_cases()[name]
    per_case = [c3.eager_mistakes(models(a, None)) for a in cases]
    for hint in per_case[0]:
        if hint.slug in _PROPERTY_SLUGS or (name == "packed_causal_mask" and hint.slug == "attends-across-sequences"
                                            and "every extra True" in hint):
            continue
        table = {_key(a): per_case[k][hint] for k, a in enumerate(cases)}

        def learner(*args, _table=table):
            return _table[_key(args)].clone()

        result = getattr(checks, name).evaluate(learner)
        assert not result.passed, f"{hint.slug} never shows"
        assert result.mistake_id == f"{EXERCISES_BY_NAME[name].id}/{hint.slug}", (hint.slug, result.message)
        assert str(hint) in result.message, (hint.slug, result.message)


@pytest.mark.slow
def test_every_softmax_mistake_model_is_named_as_itself():
    cases = c3._softmax_cases()
    per_case = [c3.eager_mistakes(c3._softmax_models(s, a, masks.masked_softmax(s, a), None)) for s, a in cases]
    for hint in per_case[0]:
        if hint.slug == "finite-fill-uniform-empty-rows":  # its plain model is a fill of 0: the scores times the mask
            continue
        table = [p[hint] for p in per_case]

        def learner(scores, allowed, _table=table):
            k = next(k for k, (s, a) in enumerate(cases) if s.shape == scores.shape and torch.equal(s, scores)
                     and torch.equal(a, allowed))
            return _table[k].clone()

        result = checks.masked_softmax.evaluate(learner)
        assert result.mistake_id == f"3.3/{hint.slug}", (hint.slug, result.message)


@pytest.mark.slow
def test_every_leak_mistake_is_named_as_itself():
    """3.6: a learner whose pairs are a mistake's prediction on every case is told that mistake."""
    cases = [(fn, allowed, d, masks.find_mask_leaks(fn, allowed, d), den, roundoff)
             for _, fn, allowed, d, den, roundoff in _leak_cases()]
    infos = [c3._leak_info(fn, allowed, d, den, roundoff) for fn, allowed, d, e, den, roundoff in cases]
    assert [info["leaks"] for info in infos] == [e for _, _, _, e, _, _ in cases]  # the reference's leaks
    seen = set()
    for mistake, _, prediction in c3._leak_hypotheses():
        if prediction is None:
            continue
        table = [sorted(prediction(info)) for info in infos]
        key = tuple(map(tuple, table))
        assert key not in seen, f"{mistake.slug} coincides with an earlier mistake on every case"
        seen.add(key)
        assert any(t != e for t, (_, _, _, e, _, _) in zip(table, cases)), f"{mistake.slug} never shows"

        def learner(attention_fn, allowed, d_model, _table=table):
            k = next(k for k, (fn, *_) in enumerate(cases) if len(fn.weights) == len(attention_fn.weights)
                     and all(torch.equal(w, v) for w, v in zip(fn.weights, attention_fn.weights)))
            return list(_table[k])

        result = checks.find_mask_leaks.evaluate(learner)
        assert result.mistake_id == f"3.6/{mistake.slug}", (mistake.slug, result.message)
        assert str(mistake) in result.message


def _one_trial_finder(seed):
    """A correct finder as the statement describes it: one random base input, one random unit
    perturbation per position, the statement's tolerance; its randomness from ``seed``."""

    def find(attention_fn, allowed, d_model):
        g = torch.Generator().manual_seed(seed)
        T = allowed.shape[-1]
        x = torch.randn(1, T, d_model, generator=g, dtype=torch.float64)
        base = attention_fn(x)
        tol = 1e-6 * (1 + base.abs().max())
        out = set()
        for j in range(T):
            x_j = x.clone()
            x_j[0, j] += torch.randn(d_model, generator=g, dtype=torch.float64)
            moved = (attention_fn(x_j) - base).abs().amax(-1)[0]
            out |= {(i, j) for i in range(T) if moved[i] > tol and not allowed[i, j]}
        return sorted(out)

    return find


@pytest.mark.parametrize("salt", [1, *(pytest.param(s, marks=pytest.mark.slow) for s in (23, 4, 54))])
def test_a_correct_one_trial_finder_passes_whatever_its_randomness_and_the_salt(salt):
    """Issue 32's review: under some grading salts a leak came out weak enough (through the softmax
    denominator or a second layer) for a correct one-trial finder to miss it. The check draws weights
    without such leaks where it can, and accepts a weak leak reported or not."""
    from helpers.checks import core

    try:
        core.salt_cases(salt)
        for seed in range(4):  # the old check rejected salt 1 seed 0 and salt 23 seed 1
            result = checks.find_mask_leaks.evaluate(_one_trial_finder(seed))
            assert result.passed, (salt, seed, result.message)
    finally:
        core.salt_cases(0)
