"""Learner-style wrong implementations for exercises 7.1-7.3, with the hint each check must give."""

import torch
import torch.nn.functional as F


# ----------------------------------------------------------------- 7.1 kv_cache_bytes
def cache_keys_only(batch, seq_len, n_layers, n_kv_heads, head_dim, dtype_bytes):
    return batch * seq_len * n_layers * n_kv_heads * head_dim * dtype_bytes


def cache_bits(batch, seq_len, n_layers, n_kv_heads, head_dim, dtype_bytes):
    bits = dtype_bytes * 8
    return 2 * batch * seq_len * n_layers * n_kv_heads * head_dim * bits


def cache_one_layer(batch, seq_len, n_layers, n_kv_heads, head_dim, dtype_bytes):
    return 2 * batch * seq_len * n_kv_heads * head_dim * dtype_bytes


def cache_in_gb(batch, seq_len, n_layers, n_kv_heads, head_dim, dtype_bytes):
    return 2 * batch * seq_len * n_layers * n_kv_heads * head_dim * dtype_bytes / 1e9


def cache_in_gib(batch, seq_len, n_layers, n_kv_heads, head_dim, dtype_bytes):
    return 2 * batch * seq_len * n_layers * n_kv_heads * head_dim * dtype_bytes / 2**30


def cache_no_batch(batch, seq_len, n_layers, n_kv_heads, head_dim, dtype_bytes):
    return 2 * seq_len * n_layers * n_kv_heads * head_dim * dtype_bytes


def cache_float_bytes(batch, seq_len, n_layers, n_kv_heads, head_dim, dtype_bytes):
    per_token = 2.0 * n_layers * n_kv_heads * head_dim * dtype_bytes  # a float creeps in
    return per_token * batch * seq_len


def cache_string(batch, seq_len, n_layers, n_kv_heads, head_dim, dtype_bytes):
    return f"{2 * batch * seq_len * n_layers * n_kv_heads * head_dim * dtype_bytes:,}"


def cache_tensor(batch, seq_len, n_layers, n_kv_heads, head_dim, dtype_bytes):
    return torch.tensor(2 * batch * seq_len * n_layers * n_kv_heads * head_dim * dtype_bytes)


# ----------------------------------------------------------------- 7.2 decode_step
def _project(x_t, w_qkv, n_heads):
    B, T, D = x_t.shape
    q, k, v = (x_t @ w_qkv).split(D, dim=-1)
    return [m.view(B, T, n_heads, D // n_heads).transpose(1, 2) for m in (q, k, v)]


def _finish(o, w_o):
    B, H, T, d = o.shape
    return o.transpose(1, 2).reshape(B, T, H * d) @ w_o


def decode_not_attending_new(x_t, k_cache, v_cache, w_qkv, w_o, n_heads):
    q, k, v = _project(x_t, w_qkv, n_heads)
    o = F.scaled_dot_product_attention(q, k_cache, v_cache)  # attends to the past only
    return _finish(o, w_o), torch.cat([k_cache, k], dim=2), torch.cat([v_cache, v], dim=2)


def decode_prepended(x_t, k_cache, v_cache, w_qkv, w_o, n_heads):
    q, k, v = _project(x_t, w_qkv, n_heads)
    k_cache = torch.cat([k, k_cache], dim=2)
    v_cache = torch.cat([v, v_cache], dim=2)
    return _finish(F.scaled_dot_product_attention(q, k_cache, v_cache), w_o), k_cache, v_cache


def decode_is_causal(x_t, k_cache, v_cache, w_qkv, w_o, n_heads):
    q, k, v = _project(x_t, w_qkv, n_heads)
    k_cache = torch.cat([k_cache, k], dim=2)
    v_cache = torch.cat([v_cache, v], dim=2)
    o = F.scaled_dot_product_attention(q, k_cache, v_cache, is_causal=True)  # "it is a causal model"
    return _finish(o, w_o), k_cache, v_cache


def decode_top_left_mask(x_t, k_cache, v_cache, w_qkv, w_o, n_heads):
    q, k, v = _project(x_t, w_qkv, n_heads)
    K, V = torch.cat([k_cache, k], dim=2), torch.cat([v_cache, v], dim=2)
    T = K.shape[2]
    mask = torch.ones(T, T, dtype=torch.bool).tril()[: q.shape[2]]  # the first row, not the last
    return _finish(F.scaled_dot_product_attention(q, K, V, attn_mask=mask), w_o), K, V


def decode_returns_old_cache(x_t, k_cache, v_cache, w_qkv, w_o, n_heads):
    q, k, v = _project(x_t, w_qkv, n_heads)
    K, V = torch.cat([k_cache, k], dim=2), torch.cat([v_cache, v], dim=2)
    return _finish(F.scaled_dot_product_attention(q, K, V), w_o), k_cache, v_cache


def decode_returns_new_kv(x_t, k_cache, v_cache, w_qkv, w_o, n_heads):
    q, k, v = _project(x_t, w_qkv, n_heads)
    K, V = torch.cat([k_cache, k], dim=2), torch.cat([v_cache, v], dim=2)
    return _finish(F.scaled_dot_product_attention(q, K, V), w_o), k, v


def decode_swapped_caches(x_t, k_cache, v_cache, w_qkv, w_o, n_heads):
    q, k, v = _project(x_t, w_qkv, n_heads)
    K, V = torch.cat([k_cache, k], dim=2), torch.cat([v_cache, v], dim=2)
    return _finish(F.scaled_dot_product_attention(q, K, V), w_o), V, K


def decode_no_scale(x_t, k_cache, v_cache, w_qkv, w_o, n_heads):
    q, k, v = _project(x_t, w_qkv, n_heads)
    K, V = torch.cat([k_cache, k], dim=2), torch.cat([v_cache, v], dim=2)
    p = torch.softmax(q @ K.transpose(-2, -1), dim=-1)
    return _finish(p @ V, w_o), K, V


def decode_no_w_o(x_t, k_cache, v_cache, w_qkv, w_o, n_heads):
    q, k, v = _project(x_t, w_qkv, n_heads)
    K, V = torch.cat([k_cache, k], dim=2), torch.cat([v_cache, v], dim=2)
    o = F.scaled_dot_product_attention(q, K, V)
    B, H, T, d = o.shape
    return o.transpose(1, 2).reshape(B, T, H * d), K, V


def decode_cat_wrong_axis(x_t, k_cache, v_cache, w_qkv, w_o, n_heads):
    q, k, v = _project(x_t, w_qkv, n_heads)
    K, V = torch.cat([k_cache, k], dim=1), torch.cat([v_cache, v], dim=1)  # the heads axis
    return _finish(F.scaled_dot_product_attention(q, K, V), w_o), K, V


def decode_stale_query(x_t, k_cache, v_cache, w_qkv, w_o, n_heads):
    # Uses the first cached key as the query of the new token ("the query is in the cache").
    q, k, v = _project(x_t, w_qkv, n_heads)
    K, V = torch.cat([k_cache, k], dim=2), torch.cat([v_cache, v], dim=2)
    return _finish(F.scaled_dot_product_attention(K[:, :, :1], K, V), w_o), K, V


def decode_in_place(x_t, k_cache, v_cache, w_qkv, w_o, n_heads):
    q, k, v = _project(x_t, w_qkv, n_heads)
    K, V = torch.cat([k_cache, k], dim=2), torch.cat([v_cache, v], dim=2)
    x_t.zero_()  # "free" the input
    return _finish(F.scaled_dot_product_attention(q, K, V), w_o), K, V


def decode_global_cache(x_t, k_cache, v_cache, w_qkv, w_o, n_heads, _store={}):  # noqa: B006
    # Keeps its own cache between calls and ignores the one it is given.
    q, k, v = _project(x_t, w_qkv, n_heads)
    K = torch.cat([_store["k"], k], dim=2) if "k" in _store and _store["k"].shape[:2] == k.shape[:2] else k
    V = torch.cat([_store["v"], v], dim=2) if "v" in _store and _store["v"].shape[:2] == v.shape[:2] else v
    _store["k"], _store["v"] = K, V
    return _finish(F.scaled_dot_product_attention(q, K, V), w_o), K, V


def decode_float32_only(x_t, k_cache, v_cache, w_qkv, w_o, n_heads):
    q, k, v = (m.float() for m in _project(x_t, w_qkv, n_heads))
    K, V = torch.cat([k_cache.float(), k], dim=2), torch.cat([v_cache.float(), v], dim=2)
    return _finish(F.scaled_dot_product_attention(q, K, V), w_o.float()), K, V


# ----------------------------------------------------------------- 7.3 prefill_decode_flops
def _prefill(d, P):
    return 8 * d * d * P + 4 * d * P * P


def flops_off_by_one(prompt_len, new_tokens, d_model, n_layers, use_cache):
    d, total = d_model, _prefill(d_model, prompt_len)
    for t in range(new_tokens):  # L = P + t for t = 0..N-1
        L = prompt_len + t
        total += 8 * d * d + 4 * d * L if use_cache else 8 * d * d * L + 4 * d * L * L
    return n_layers * total


def flops_no_prefill(prompt_len, new_tokens, d_model, n_layers, use_cache):
    d, total = d_model, 0
    for t in range(1, new_tokens + 1):
        L = prompt_len + t
        total += 8 * d * d + 4 * d * L if use_cache else 8 * d * d * L + 4 * d * L * L
    return n_layers * total


def flops_cache_recomputes_projections(prompt_len, new_tokens, d_model, n_layers, use_cache):
    d, total = d_model, _prefill(d_model, prompt_len)
    for t in range(1, new_tokens + 1):
        L = prompt_len + t
        total += 8 * d * d * L + 4 * d * L if use_cache else 8 * d * d * L + 4 * d * L * L
    return n_layers * total


def flops_one_layer(prompt_len, new_tokens, d_model, n_layers, use_cache):
    d, total = d_model, _prefill(d_model, prompt_len)
    for t in range(1, new_tokens + 1):
        L = prompt_len + t
        total += 8 * d * d + 4 * d * L if use_cache else 8 * d * d * L + 4 * d * L * L
    return total


def flops_ignores_cache(prompt_len, new_tokens, d_model, n_layers, use_cache):
    d, total = d_model, _prefill(d_model, prompt_len)
    for t in range(1, new_tokens + 1):
        L = prompt_len + t
        total += 8 * d * d * L + 4 * d * L * L
    return n_layers * total


def flops_multiplies_only(prompt_len, new_tokens, d_model, n_layers, use_cache):
    d, P = d_model, prompt_len
    total = 4 * d * d * P + 2 * d * P * P
    for t in range(1, new_tokens + 1):
        L = P + t
        total += 4 * d * d + 2 * d * L if use_cache else 4 * d * d * L + 2 * d * L * L
    return n_layers * total


def flops_closed_form_float(prompt_len, new_tokens, d_model, n_layers, use_cache):
    # Closed form with true division: a float.
    P, N, d = prompt_len, new_tokens, d_model
    s1 = N * P + N * (N + 1) / 2
    s2 = sum((P + t) ** 2 for t in range(1, N + 1))
    steps = 8 * d * d * N + 4 * d * s1 if use_cache else 8 * d * d * s1 + 4 * d * s2
    return n_layers * (8 * d * d * P + 4 * d * P * P + steps)


def flops_cache_quadratic(prompt_len, new_tokens, d_model, n_layers, use_cache):
    d, total = d_model, _prefill(d_model, prompt_len)
    for t in range(1, new_tokens + 1):
        L = prompt_len + t
        total += 8 * d * d + 4 * d * L * L if use_cache else 8 * d * d * L + 4 * d * L * L
    return n_layers * total


WRONG = {
    "kv_cache_bytes": [
        (cache_keys_only, "keys only"),
        (cache_bits, "you counted bits"),
        (cache_one_layer, "left out the layers"),
        (cache_in_gb, "GB as a float"),
        (cache_in_gib, "GiB as a float"),
        (cache_no_batch, "left out the batch"),
        (cache_float_bytes, "expected an int"),
        (cache_string, "got the string"),
        (cache_tensor, "return `.item()`"),
    ],
    "decode_step": [
        (decode_not_attending_new, "new token's own key and value were not attended"),
        (decode_prepended, "at the start of the cache"),
        (decode_is_causal, "aligns the causal mask top-left"),
        (decode_top_left_mask, "aligns the causal mask top-left"),
        (decode_returns_old_cache, "returned the cache you were given"),
        (decode_returns_new_kv, "only the new token's key/value"),
        (decode_swapped_caches, "caches swapped"),
        (decode_no_scale, "sqrt(d_k)"),
        (decode_no_w_o, "output projection w_o"),
        (decode_cat_wrong_axis, "dim=2"),
        (decode_stale_query, "y_t: values differ"),
        (decode_in_place, "modified one of its input tensors in place"),
        (decode_global_cache, "y_t: values differ"),
        (decode_float32_only, "expected dtype torch.float64"),
    ],
    "prefill_decode_flops": [
        (flops_off_by_one, "off by one in the context length"),
        (flops_no_prefill, "forgot the prefill"),
        (flops_cache_recomputes_projections, "only the new token is projected"),
        (flops_one_layer, "one layer only"),
        (flops_ignores_cache, "ignored use_cache"),
        (flops_multiplies_only, "multiplies only"),
        (flops_closed_form_float, "expected an int"),
        (flops_cache_quadratic, "not 4*d*L^2"),
    ],
}
