"""Learner-style wrong implementations for exercises 3.1-3.6, with the hint each check must give."""

import torch


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
        x2[0, j] += 1.0
        moved = (attention_fn(x2) - base).abs().amax(-1)[0] > 1e-6
        pairs += [(i, j) for i in range(T) if moved[i]]  # forgot to keep only disallowed pairs
    return sorted(pairs)


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
    ],
    "masked_softmax": [
        (softmax_nan_rows, "rows with nothing allowed came out NaN"),
        (softmax_mask_after, "you masked after the softmax:"),
        (softmax_mask_after_renormalised, "masked after the softmax and renormalised"),
        (softmax_no_max_subtraction, "exp overflowed"),
        (softmax_big_negative, "finite number instead of -inf: a row with nothing allowed"),
        (softmax_fill_minus_1e4, "finite number instead of -inf: a row with nothing allowed"),
        (softmax_fill_minus_1e4_empty_rows_zeroed, "you filled blocked scores with -1e4, but here allowed scores go down to"),
        (softmax_in_place, "modified one of its input tensors in place"),
        (softmax_inverted, "the mask is inverted"),
        (softmax_boolean_index, "allowed only *broadcasts* to scores"),
        (softmax_float64, "expected dtype torch.float32"),
    ],
    "prefix_lm_mask": [
        (prefix_sees_future, "the prefix sees the future"),
        (prefix_one_too_many, "one too large"),
        (prefix_suffix_blind, "suffix positions must still see the whole prefix"),
        (prefix_plain_causal, "plain causal mask"),
        (prefix_inverted, "the mask is inverted"),
        (prefix_float, "return a bool tensor"),
    ],
    "packed_causal_mask": [
        (packed_plain_causal, "across sequence boundaries"),
        (packed_bidirectional_blocks, "must be causal"),
        (packed_boundary_off_by_one, "boundaries are off by one"),
        (packed_float, "return a bool tensor"),
        (packed_additive, "additive (0 / -inf) mask"),
        (packed_reverses_seq_lens, "modified its argument `seq_lens` (list) in place"),
    ],
    "find_mask_leaks": [
        (leaks_report_everything, "every disallowed pair without testing"),
        (leaks_report_nothing, "you found no leaks"),
        (leaks_zero_probe, "softmax denominator"),
        (leaks_no_tolerance, "float round-off"),
        (leaks_key_major, "sorted(pairs)"),
        (leaks_duplicated, "each pair should appear once"),
        (leaks_swapped, "(key, query)"),
        (leaks_as_lists, "tuple (i, j) of two ints"),
        (leaks_as_tensor, "got a tensor"),
        (leaks_unbatched_input, "shape [1, T, d_model]"),
        (leaks_include_allowed, "are allowed pairs"),
    ],
}
