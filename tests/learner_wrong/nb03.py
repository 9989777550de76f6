"""Notebook 03 (masks): wrong answers written from the statements."""

import torch

# ---- 3.1 causal_mask(T) -> [T, T] bool, True where j <= i ---------------------------------------


def causal_triu(T):
    return torch.ones(T, T, dtype=torch.bool).triu()


def causal_strict(T):
    return torch.ones(T, T, dtype=torch.bool).tril(-1)


def causal_one_ahead(T):
    return torch.ones(T, T, dtype=torch.bool).tril(1)


def causal_float(T):
    return torch.ones(T, T).tril()


def causal_long(T):
    return torch.tril(torch.ones(T, T, dtype=torch.long))


def causal_blocked_convention(T):
    return ~torch.ones(T, T, dtype=torch.bool).tril()


def causal_4d(T):
    return torch.ones(T, T, dtype=torch.bool).tril()[None, None]


def causal_loop_last_row_missing(T):
    m = torch.zeros(T, T, dtype=torch.bool)
    for i in range(T - 1):
        m[i, : i + 1] = True
    return m


def causal_columns_flipped(T):
    return torch.ones(T, T, dtype=torch.bool).tril().flip(-1)


def causal_additive(T):
    return torch.full((T, T), float("-inf")).triu(1)


def causal_all_true(T):
    return torch.ones(T, T, dtype=torch.bool)


# ---- 3.2 padding_mask(lengths, T) -> [B, 1, 1, T] bool, j < lengths[b] --------------------------


def pad_le(lengths, T):
    return (torch.arange(T)[None, :] <= lengths[:, None])[:, None, None, :]


def pad_2d(lengths, T):
    return torch.arange(T)[None, :] < lengths[:, None]


def pad_query_axis(lengths, T):
    return (torch.arange(T)[None, :] < lengths[:, None])[:, None, :, None]


def pad_inverted(lengths, T):
    return (torch.arange(T)[None, :] >= lengths[:, None])[:, None, None, :]


def pad_one_based(lengths, T):
    return (torch.arange(1, T + 1)[None, :] < lengths[:, None])[:, None, None, :]


def pad_left(lengths, T):
    return (torch.arange(T)[None, :] >= T - lengths[:, None])[:, None, None, :]


def pad_max_length(lengths, T):
    B = lengths.shape[0]
    return (torch.arange(T) < lengths.max()).expand(B, T)[:, None, None, :]


def pad_reshape_of_transpose(lengths, T):
    B = lengths.shape[0]
    return (torch.arange(T)[:, None] < lengths[None, :]).reshape(B, 1, 1, T)


def pad_t_from_lengths(lengths, T):
    T = int(lengths.max())
    return (torch.arange(T)[None, :] < lengths[:, None])[:, None, None, :]


def pad_float_loop(lengths, T):
    m = torch.zeros(lengths.shape[0], 1, 1, T)
    for b, n in enumerate(lengths.tolist()):
        m[b, ..., :n] = 1
    return m


def pad_unsqueeze_order(lengths, T):
    return (torch.arange(T)[None, :] < lengths[:, None]).unsqueeze(0).unsqueeze(0)


def pad_loop_off_by_one(lengths, T):
    m = torch.zeros(lengths.shape[0], 1, 1, T, dtype=torch.bool)
    for b in range(lengths.shape[0]):
        m[b, 0, 0, : int(lengths[b]) - 1] = True
    return m


# ---- 3.3 masked_softmax(scores, allowed) ---------------------------------------------------------


def msm_neg_inf(scores, allowed):
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)


def msm_big_negative(scores, allowed):
    return torch.softmax(scores.masked_fill(~allowed, -1e9), dim=-1)


def msm_multiply_after(scores, allowed):
    return torch.softmax(scores, dim=-1) * allowed


def msm_renormalise(scores, allowed):
    p = torch.softmax(scores, dim=-1) * allowed
    return p / p.sum(-1, keepdim=True)


def msm_no_max(scores, allowed):
    e = torch.exp(scores) * allowed
    s = e.sum(-1, keepdim=True)
    return torch.where(s > 0, e / s.clamp_min(1e-30), torch.zeros_like(e))


def msm_max_over_all_keys(scores, allowed):
    e = torch.exp(scores - scores.amax(-1, keepdim=True)) * allowed
    s = e.sum(-1, keepdim=True)
    return torch.where(s > 0, e / s.clamp_min(1e-30), torch.zeros_like(e))


def msm_in_place(scores, allowed):
    scores.masked_fill_(~allowed, float("-inf"))
    return torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)


def msm_dim_minus_2(scores, allowed):
    p = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-2)
    return torch.nan_to_num(p, nan=0.0)


def msm_inverted(scores, allowed):
    p = torch.softmax(scores.masked_fill(allowed, float("-inf")), dim=-1)
    return torch.nan_to_num(p, nan=0.0)


def msm_float32(scores, allowed):
    p = torch.softmax(scores.float().masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.nan_to_num(p, nan=0.0)


def msm_fill_minus_1e4(scores, allowed):
    p = torch.softmax(scores.masked_fill(~allowed, -1e4), dim=-1)
    return p * allowed.any(-1, keepdim=True)


def msm_same_shape(scores, allowed):
    out = torch.zeros_like(scores)
    allowed = allowed.reshape(scores.shape)
    p = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    out[allowed] = p[allowed]
    return out


# ---- 3.4 prefix_lm_mask(T, prefix_len) -----------------------------------------------------------


def _ij(T):
    i = torch.arange(T)[:, None]
    j = torch.arange(T)[None, :]
    return i, j


def prefix_rows_see_all(T, prefix_len):
    i, j = _ij(T)
    return (j <= i) | (i < prefix_len)


def prefix_off_by_one(T, prefix_len):
    i, j = _ij(T)
    return (j <= i) | ((i <= prefix_len) & (j <= prefix_len))


def prefix_suffix_blind_to_prefix(T, prefix_len):
    i, j = _ij(T)
    square = (i < prefix_len) & (j < prefix_len)
    return square | ((i >= prefix_len) & (j >= prefix_len) & (j <= i))


def prefix_slice_minus_one(T, prefix_len):
    m = torch.ones(T, T, dtype=torch.bool).tril()
    m[: prefix_len - 1, : prefix_len - 1] = True
    return m


def prefix_transposed(T, prefix_len):
    i, j = _ij(T)
    return ((j <= i) | ((i < prefix_len) & (j < prefix_len))).T


def prefix_float(T, prefix_len):
    m = torch.ones(T, T).tril()
    m[:prefix_len, :prefix_len] = 1
    return m


def prefix_suffix_strict(T, prefix_len):
    i, j = _ij(T)
    return (j < i) | ((i < prefix_len) & (j < prefix_len)) | ((i == j) & (i < prefix_len))


def prefix_suffix_free(T, prefix_len):
    i, j = _ij(T)
    return (j < prefix_len) | (i >= prefix_len)


def prefix_4d(T, prefix_len):
    i, j = _ij(T)
    return ((j <= i) | ((i < prefix_len) & (j < prefix_len)))[None, None]


def prefix_at_the_end(T, prefix_len):
    i, j = _ij(T)
    start = T - prefix_len
    return (j <= i) | ((i >= start) & (j >= start))


def prefix_only_square(T, prefix_len):
    i, j = _ij(T)
    return (i < prefix_len) & (j < prefix_len) | (i == j)


# ---- 3.5 packed_causal_mask(seq_lens) ------------------------------------------------------------


def _seq_ids(seq_lens):
    return torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(seq_lens))


def packed_plain_causal(seq_lens):
    N = sum(seq_lens)
    return torch.ones(N, N, dtype=torch.bool).tril()


def packed_full_blocks(seq_lens):
    s = _seq_ids(seq_lens)
    return s[:, None] == s[None, :]


def packed_boundary_searchsorted(seq_lens):
    N = sum(seq_lens)
    cu = torch.tensor([0, *seq_lens]).cumsum(0)
    pos = torch.arange(N)
    s = torch.searchsorted(cu[1:], pos)  # a boundary position goes to the previous sequence
    i, j = pos[:, None], pos[None, :]
    return (s[:, None] == s[None, :]) & (j <= i)


def packed_triu_blocks(seq_lens):
    return torch.block_diag(*[torch.ones(n, n, dtype=torch.bool).triu() for n in seq_lens])


def packed_offset_not_moved(seq_lens):
    N = sum(seq_lens)
    m = torch.zeros(N, N, dtype=torch.bool)
    start = 0
    for n in seq_lens:
        m[start:start + n, start:start + n] = torch.ones(n, n, dtype=torch.bool).tril()
    return m


def packed_offset_moved_first(seq_lens):
    N = sum(seq_lens)
    m = torch.zeros(N, N, dtype=torch.bool)
    start = 0
    for n in seq_lens:
        start += n
        blk = torch.ones(n, n, dtype=torch.bool).tril()
        m[start:start + n, start:start + n] = blk[: max(0, N - start), : max(0, N - start)]
    return m


def packed_float(seq_lens):
    return torch.block_diag(*[torch.ones(n, n).tril() for n in seq_lens])


def packed_transposed_blocks(seq_lens):
    return torch.block_diag(*[torch.ones(n, n, dtype=torch.bool).tril().T for n in seq_lens])


def packed_sorted_lengths(seq_lens):
    return torch.block_diag(*[torch.ones(n, n, dtype=torch.bool).tril() for n in sorted(seq_lens)])


def packed_strict_blocks(seq_lens):
    return torch.block_diag(*[torch.ones(n, n, dtype=torch.bool).tril(-1) for n in seq_lens])


def packed_skip_length_one(seq_lens):
    N = sum(seq_lens)
    m = torch.zeros(N, N, dtype=torch.bool)
    start = 0
    for n in seq_lens:
        if n > 1:
            m[start:start + n, start:start + n] = torch.ones(n, n, dtype=torch.bool).tril()
        start += n
    return m


def packed_cumsum_without_zero(seq_lens):
    N = sum(seq_lens)
    cu = torch.tensor(seq_lens).cumsum(0).tolist()
    m = torch.zeros(N, N, dtype=torch.bool)
    for s in range(len(seq_lens) - 1):
        a, b = cu[s], cu[s + 1]
        m[a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
    return m


def packed_previous_docs_visible(seq_lens):
    s = _seq_ids(seq_lens)
    N = sum(seq_lens)
    i, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
    return ((s[:, None] == s[None, :]) & (j <= i)) | (s[None, :] == s[:, None] - 1)


# ---- 3.6 find_mask_leaks(attention_fn, allowed, d_model) -----------------------------------------


def _finder(attention_fn, allowed, d_model, *, swap=False, keep_allowed=False, transposed=False,
            eps=1.0, tol_abs=None, skip_past=False, accumulate=False, skip_diag=False,
            last_key=True, as_lists=False, unsorted=False, dtype=torch.float64,
            row_of_key=False):
    T = allowed.shape[0]
    g = torch.Generator().manual_seed(0)
    base = torch.randn(1, T, d_model, generator=g, dtype=torch.float64).to(dtype)
    out = attention_fn(base.clone())
    tol = tol_abs if tol_abs is not None else 1e-6 * (1 + float(base.abs().max()))
    x = base.clone()
    leaks = []
    for j in range(T if last_key else T - 1):
        if not accumulate:
            x = base.clone()
        x[0, j] += eps * torch.randn(d_model, generator=g, dtype=torch.float64).to(dtype)
        changed = (attention_fn(x) - out).abs().amax(-1)[0] > tol
        for i in range(T):
            ok = bool(allowed[j, i]) if transposed else bool(allowed[i, j])
            if skip_past and j < i:
                continue
            if skip_diag and i == j:
                continue
            hit = changed[j] if row_of_key else changed[i]
            if hit and (keep_allowed or not ok):
                pair = (j, i) if swap else (i, j)
                leaks.append(list(pair) if as_lists else pair)
    return leaks if unsorted else sorted(leaks)


def leaks_swapped(attention_fn, allowed, d_model):
    return _finder(attention_fn, allowed, d_model, swap=True)


def leaks_include_allowed(attention_fn, allowed, d_model):
    return _finder(attention_fn, allowed, d_model, keep_allowed=True)


def leaks_mask_transposed(attention_fn, allowed, d_model):
    return _finder(attention_fn, allowed, d_model, transposed=True)


def leaks_tiny_perturbation(attention_fn, allowed, d_model):
    return _finder(attention_fn, allowed, d_model, eps=1e-9, dtype=torch.float32)


def leaks_loose_tolerance(attention_fn, allowed, d_model):
    return _finder(attention_fn, allowed, d_model, tol_abs=1e-2)


def leaks_unsorted(attention_fn, allowed, d_model):
    return _finder(attention_fn, allowed, d_model, unsorted=True)


def leaks_as_lists(attention_fn, allowed, d_model):
    return _finder(attention_fn, allowed, d_model, as_lists=True)


def leaks_future_only(attention_fn, allowed, d_model):
    return _finder(attention_fn, allowed, d_model, skip_past=True)


def leaks_perturbations_accumulate(attention_fn, allowed, d_model):
    return _finder(attention_fn, allowed, d_model, accumulate=True)


def leaks_skip_diagonal(attention_fn, allowed, d_model):
    return _finder(attention_fn, allowed, d_model, skip_diag=True)


def leaks_last_key_missed(attention_fn, allowed, d_model):
    return _finder(attention_fn, allowed, d_model, last_key=False)


def leaks_watched_row_j(attention_fn, allowed, d_model):
    return _finder(attention_fn, allowed, d_model, row_of_key=True)


WRONG = {
    "causal_mask": [
        ("built the upper triangle (triu)", causal_triu),
        ("strict lower triangle tril(-1): the diagonal is blocked", causal_strict),
        ("tril(1): each query also sees the next key", causal_one_ahead),
        ("returned a float 0/1 mask instead of bool", causal_float),
        ("returned an integer (long) mask", causal_long),
        ("True marks the blocked entries (the opposite convention)", causal_blocked_convention),
        ("returned [1, 1, T, T] to broadcast against scores", causal_4d),
        ("loop range(T - 1): the last row stays all False", causal_loop_last_row_missing),
        ("flipped the columns (anti-diagonal triangle)", causal_columns_flipped),
        ("returned an additive float bias (0 / -inf) instead of a bool mask", causal_additive),
        ("forgot the tril: all True", causal_all_true),
    ],
    "padding_mask": [
        ("j <= lengths[b] (one padded key allowed)", pad_le),
        ("returned [B, T] without the singleton axes", pad_2d),
        ("put the singleton axes elsewhere: [B, 1, T, 1] (masks queries)", pad_query_axis),
        ("True marks the padded keys", pad_inverted),
        ("1-based positions: j + 1 < lengths[b]", pad_one_based),
        ("assumed left padding: j >= T - lengths[b]", pad_left),
        ("used lengths.max() for every sequence", pad_max_length),
        ("built [T, B] (arange[:, None] < lengths[None, :]) and reshaped to [B, 1, 1, T]",
         pad_reshape_of_transpose),
        ("ignored T and used lengths.max() as the width", pad_t_from_lengths),
        ("filled a float zeros tensor in a loop (float mask)", pad_float_loop),
        ("unsqueezed in front: [1, 1, B, T]", pad_unsqueeze_order),
        ("loop slice :lengths[b] - 1 (last real key blocked)", pad_loop_off_by_one),
    ],
    "masked_softmax": [
        ("masked_fill(-inf) then softmax: a fully blocked row is NaN", msm_neg_inf),
        ("masked_fill(-1e9): a fully blocked row is uniform, not zeros", msm_big_negative),
        ("softmax first, then multiplied by the mask (rows no longer sum to 1)",
         msm_multiply_after),
        ("softmax, mask, renormalise: 0/0 on a fully blocked row", msm_renormalise),
        ("exp without subtracting the max (overflows at 1e4)", msm_no_max),
        ("subtracted the max over all keys, blocked ones included (allowed ones underflow)",
         msm_max_over_all_keys),
        ("masked_fill_ in place: modifies scores", msm_in_place),
        ("softmax over dim -2", msm_dim_minus_2),
        ("used allowed as the blocked mask (inverted)", msm_inverted),
        ("computed in float32 (scores' dtype not kept)", msm_float32),
        ("filled blocked scores with -1e4, which real scores can reach", msm_fill_minus_1e4),
        ("assumed allowed has the scores' shape (reshape instead of broadcast)", msm_same_shape),
    ],
    "prefix_lm_mask": [
        ("prefix rows see every position, the suffix included", prefix_rows_see_all),
        ("prefix block one too large (<= prefix_len)", prefix_off_by_one),
        ("suffix positions do not see the prefix", prefix_suffix_blind_to_prefix),
        ("set m[:prefix_len - 1, :prefix_len - 1] (off by one; prefix_len = 0 opens almost all)",
         prefix_slice_minus_one),
        ("returned the transpose (rows are keys)", prefix_transposed),
        ("returned a float mask", prefix_float),
        ("suffix positions do not see themselves (strict causal after the prefix)",
         prefix_suffix_strict),
        ("suffix positions see everything (read 'free after the prefix')", prefix_suffix_free),
        ("returned [1, 1, T, T]", prefix_4d),
        ("put the bidirectional block at the end of the sequence", prefix_at_the_end),
        ("only the prefix square and the diagonal (forgot the causal part)", prefix_only_square),
    ],
    "packed_causal_mask": [
        ("plain causal mask over all N tokens (forgot the blocks)", packed_plain_causal),
        ("full blocks, not causal inside", packed_full_blocks),
        ("searchsorted on the ends: each sequence's first token joins the previous one",
         packed_boundary_searchsorted),
        ("blocks are upper triangles", packed_triu_blocks),
        ("forgot to advance the offset: every block placed at 0", packed_offset_not_moved),
        ("advanced the offset before placing the block", packed_offset_moved_first),
        ("returned a float mask", packed_float),
        ("transposed each block", packed_transposed_blocks),
        ("sorted seq_lens before building the blocks", packed_sorted_lengths),
        ("blocks are strict triangles (no diagonal)", packed_strict_blocks),
        ("skipped sequences of length 1 (nothing to mask)", packed_skip_length_one),
        ("cumsum without the leading 0: the first sequence is missing", packed_cumsum_without_zero),
        ("also lets each sequence read the whole previous one", packed_previous_docs_visible),
    ],
    "find_mask_leaks": [
        ("returned (key, query) pairs instead of (query, key)", leaks_swapped),
        ("forgot to keep only the blocked pairs (allowed dependencies listed too)",
         leaks_include_allowed),
        ("read the mask as allowed[j, i]", leaks_mask_transposed),
        ("perturbed by 1e-9 in float32: below the tolerance", leaks_tiny_perturbation),
        ("absolute tolerance 1e-2: misses small leaks", leaks_loose_tolerance),
        ("did not sort the list (ordered by key)", leaks_unsorted),
        ("returned pairs as lists instead of tuples", leaks_as_lists),
        ("only looked at future keys (j > i), assuming a causal mask", leaks_future_only),
        ("perturbed the same tensor again and again (perturbations accumulate)",
         leaks_perturbations_accumulate),
        ("skipped i == j, assuming a token may always see itself", leaks_skip_diagonal),
        ("loop over range(T - 1): the last key is never perturbed", leaks_last_key_missed),
        ("watched output row j (the perturbed position) instead of row i", leaks_watched_row_j),
    ],
}
