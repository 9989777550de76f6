"""Learner-style wrong implementations for exercises 8.1-8.3, with the hint each check must give."""

import math


# ----------------------------------------------------------------- 8.1 attention_flops
def _flops(n, d, H, H_kv, d_h, kv_heads=None, softmax_per_score=6, mult=2, softmax_heads=None, with_softmax=True):
    kv = H_kv if kv_heads is None else kv_heads
    f = {
        "q_proj": mult * n * d * H * d_h,
        "k_proj": mult * n * d * kv * d_h,
        "v_proj": mult * n * d * kv * d_h,
        "o_proj": mult * n * H * d_h * d,
        "scores": H * mult * n * n * d_h,
        "softmax": (H if softmax_heads is None else softmax_heads) * softmax_per_score * n * n,
        "weighted_values": H * mult * n * n * d_h,
    }
    f["total"] = sum(v for k, v in f.items() if with_softmax or k != "softmax")
    return f


def flops_kv_with_query_heads(n, d_model, n_heads, n_kv_heads, head_dim):
    return _flops(n, d_model, n_heads, n_kv_heads, head_dim, kv_heads=n_heads)


def flops_softmax_5(n, d_model, n_heads, n_kv_heads, head_dim):
    return _flops(n, d_model, n_heads, n_kv_heads, head_dim, softmax_per_score=5)


def flops_multiplies_only(n, d_model, n_heads, n_kv_heads, head_dim):
    return _flops(n, d_model, n_heads, n_kv_heads, head_dim, mult=1)


def flops_total_without_softmax(n, d_model, n_heads, n_kv_heads, head_dim):
    return _flops(n, d_model, n_heads, n_kv_heads, head_dim, with_softmax=False)


def flops_softmax_one_head(n, d_model, n_heads, n_kv_heads, head_dim):
    return _flops(n, d_model, n_heads, n_kv_heads, head_dim, softmax_heads=1)


def flops_square_projections(n, d_model, n_heads, n_kv_heads, head_dim):
    # Every projection as a d x d matrix (true only for MHA with H * d_h = d).
    f = _flops(n, d_model, n_heads, n_kv_heads, head_dim)
    f["q_proj"] = f["k_proj"] = f["v_proj"] = f["o_proj"] = 2 * n * d_model * d_model
    f["total"] = sum(v for k, v in f.items() if k != "total")
    return f


def flops_causal_half(n, d_model, n_heads, n_kv_heads, head_dim):
    f = _flops(n, d_model, n_heads, n_kv_heads, head_dim)
    f["scores"] = n_heads * 2 * head_dim * n * (n + 1) // 2  # only the lower triangle
    f["weighted_values"] = n_heads * 2 * head_dim * n * (n + 1) // 2
    f["total"] = sum(v for k, v in f.items() if k != "total")
    return f


def flops_scores_per_kv_head(n, d_model, n_heads, n_kv_heads, head_dim):
    f = _flops(n, d_model, n_heads, n_kv_heads, head_dim)
    f["scores"] = n_kv_heads * 2 * n * n * head_dim
    f["total"] = sum(v for k, v in f.items() if k != "total")
    return f


def flops_gflops_floats(n, d_model, n_heads, n_kv_heads, head_dim):
    return {k: v / 1e9 for k, v in _flops(n, d_model, n_heads, n_kv_heads, head_dim).items()}


def flops_missing_key(n, d_model, n_heads, n_kv_heads, head_dim):
    f = _flops(n, d_model, n_heads, n_kv_heads, head_dim)
    f["attn_v"] = f.pop("weighted_values")
    return f


def flops_tuple(n, d_model, n_heads, n_kv_heads, head_dim):
    return tuple(_flops(n, d_model, n_heads, n_kv_heads, head_dim).values())


# ----------------------------------------------------------------- 8.2 score_matrix_bytes
def bytes_no_batch(batch, n_heads, seq_len, dtype_bytes):
    return n_heads * seq_len * seq_len * dtype_bytes


def bytes_causal_half(batch, n_heads, seq_len, dtype_bytes):
    return batch * n_heads * seq_len * (seq_len + 1) // 2 * dtype_bytes


def bytes_causal_half_float(batch, n_heads, seq_len, dtype_bytes):
    return batch * n_heads * seq_len * seq_len * dtype_bytes / 2


def bytes_gib(batch, n_heads, seq_len, dtype_bytes):
    return batch * n_heads * seq_len**2 * dtype_bytes / 2**30


def bytes_gb(batch, n_heads, seq_len, dtype_bytes):
    return batch * n_heads * seq_len**2 * dtype_bytes / 1e9


def bytes_entries(batch, n_heads, seq_len, dtype_bytes):
    return batch * n_heads * seq_len * seq_len


def bytes_float_pow(batch, n_heads, seq_len, dtype_bytes):
    return batch * n_heads * math.pow(seq_len, 2) * dtype_bytes


# ----------------------------------------------------------------- 8.3 max_seq_len_for_scores
def seq_one_past(budget_bytes, batch, n_heads, dtype_bytes):
    return math.isqrt(budget_bytes // (batch * n_heads * dtype_bytes)) + 1


def seq_loop_one_past(budget_bytes, batch, n_heads, dtype_bytes):
    per = batch * n_heads * dtype_bytes
    T = math.isqrt(budget_bytes // per) - 2  # start near the answer, then step while it fits
    while per * T * T <= budget_bytes:
        T += 1
    return T  # the first T that does NOT fit


def seq_round_sqrt(budget_bytes, batch, n_heads, dtype_bytes):
    return round(math.sqrt(budget_bytes / (batch * n_heads * dtype_bytes)))


def seq_float_sqrt(budget_bytes, batch, n_heads, dtype_bytes):
    return int(math.sqrt(budget_bytes // (batch * n_heads * dtype_bytes)))


def seq_float_pow(budget_bytes, batch, n_heads, dtype_bytes):
    return int((budget_bytes / (batch * n_heads * dtype_bytes)) ** 0.5)


def seq_no_batch(budget_bytes, batch, n_heads, dtype_bytes):
    return math.isqrt(budget_bytes // (n_heads * dtype_bytes))


def seq_no_heads(budget_bytes, batch, n_heads, dtype_bytes):
    return math.isqrt(budget_bytes // (batch * dtype_bytes))


def seq_floor_float(budget_bytes, batch, n_heads, dtype_bytes):
    return math.sqrt(budget_bytes // (batch * n_heads * dtype_bytes)) // 1  # a float


WRONG = {
    "attention_flops": [
        (flops_kv_with_query_heads, "K and V projections with the query heads"),
        (flops_softmax_5, "5*n^2 per head"),
        (flops_multiplies_only, "multiplies only"),
        (flops_total_without_softmax, "total leaves out the softmax"),
        (flops_softmax_one_head, "every head's n x n scores"),
        (flops_square_projections, "W_Q is [d, H*d_h]"),
        (flops_causal_half, "causal halving is not counted"),
        (flops_scores_per_kv_head, "not per key/value head"),
        (flops_gflops_floats, "not a value scaled for printing"),
        (flops_missing_key, "lacks the key(s) 'weighted_values'"),
        (flops_tuple, "expected a dict"),
    ],
    "score_matrix_bytes": [
        (bytes_no_batch, "left out the batch"),
        (bytes_causal_half, "halved the square for the causal mask"),
        (bytes_causal_half_float, "halved the square for the causal mask"),
        (bytes_gib, "GiB as a float"),
        (bytes_gb, "GB as a float"),
        (bytes_entries, "counted entries, not bytes"),
        (bytes_float_pow, "expected an int"),
    ],
    "max_seq_len_for_scores": [
        (seq_one_past, "one past the boundary"),
        (seq_loop_one_past, "one past the boundary"),
        (seq_round_sqrt, "rounded the square root"),
        (seq_float_sqrt, "float square root is off by one"),
        (seq_float_pow, "float square root is off by one"),
        (seq_no_batch, "ignored the batch"),
        (seq_no_heads, "ignored the heads"),
        (seq_floor_float, "expected an int"),
    ],
}
