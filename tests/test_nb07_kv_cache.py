"""Notebook 07, the KV cache (helpers/nb07_kv_cache.py): decoding with a cache equals attention over
the whole sequence; the preallocated cache, its reset and mixed lengths; split-K decoding; then
the ring-buffer cache of a sliding window and the memory of windowed and layer-sharing models; then
exercises 7.1-7.4: learner-style wrong implementations their checks must reject, with the hint each
must give (WRONG), and correct ones in other styles they must accept (RIGHT)."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from helpers.configs import H100_SXM, MODELS
from helpers.nb01_qkv_shapes import scaled_dot_product_attention
from helpers.nb03_masks import causal_mask, sliding_window_mask
from helpers.nb05_multihead import multi_head_attention
from helpers.nb06_kv_sharing import (
    config_values_per_token,
    grouped_query_attention,
    model_cache_bytes,
    repeat_kv,
)
from helpers.nb07_kv_cache import (
    WINDOWED,
    KVCache,
    cached_attention,
    decode_step,
    empty_kv,
    kv_cache_bytes,
    layered_cache_bytes,
    merge_partials,
    prefill_decode_flops,
    ring_buffer_decode_step,
    sequences_that_fit,
    split_k_decode,
)
from helpers.nb08_flops_memory import dense_param_count
from helpers.nb10_positions import rope
from tests.exercise_cases import assert_accepted, assert_rejected, first_fast, right_cases, wrong_cases

# ============================================================ the lesson code

def _layer(B=2, T=9, H=3, d_k=4, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    D = H * d_k
    x = torch.randn(B, T, D, generator=g, dtype=dtype)
    w_qkv = torch.randn(D, 3 * D, generator=g, dtype=dtype) / math.sqrt(D)
    w_o = torch.randn(D, D, generator=g, dtype=dtype) / math.sqrt(D)
    return x, w_qkv, w_o, H


# --------------------------------------------------------------------------- 7.1


def test_kv_cache_bytes_of_real_models():
    llama = MODELS["Llama-3-8B"]
    assert kv_cache_bytes(1, 8192, llama.n_layers, llama.n_kv_heads, llama.head_dim, 2) == 2**30
    for cfg in MODELS.values():
        if cfg.kind in ("mha", "gqa", "mqa"):
            assert kv_cache_bytes(3, 100, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 2) == (
                3 * 100 * cfg.n_layers * config_values_per_token(cfg) * 2)


def test_model_cache_bytes_equals_exercise_formula_with_full_attention():
    for cfg in MODELS.values():
        if cfg.kind in ("mha", "gqa", "mqa") and not cfg.attention_chunk_size:
            assert model_cache_bytes(cfg, 1000, batch=3) == kv_cache_bytes(
                3, 1000, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 2)
    ds = MODELS["DeepSeek-V3"]
    assert model_cache_bytes(ds, 100, dtype_bytes=1) == 100 * ds.n_layers * (512 + 64)
    llama = MODELS["Llama-3-8B"]
    assert model_cache_bytes(llama, 10, values_per_token=7, dtype_bytes=4) == 10 * llama.n_layers * 7 * 4


def test_model_cache_bytes_of_chunked_attention():
    # Llama-4-Maverick: 12 full-attention layers hold every token, 36 chunked ones at most 8,192.
    mav = MODELS["Llama-4-Maverick"]
    per_token_layer = 2 * mav.n_kv_heads * mav.head_dim * 2                  # bf16 K and V
    assert model_cache_bytes(mav, 8192) == 48 * 8192 * per_token_layer       # within one chunk: all equal
    assert model_cache_bytes(mav, 131072) == (12 * 131072 + 36 * 8192) * per_token_layer
    assert round(model_cache_bytes(mav, 131072) / 1e9, 2) == 7.65
    full = kv_cache_bytes(1, 131072, mav.n_layers, mav.n_kv_heads, mav.head_dim, 2)
    assert round(full / 1e9, 2) == 25.77
    assert model_cache_bytes(mav, 131072, batch=2) == 2 * model_cache_bytes(mav, 131072)


def test_sequences_that_fit():
    assert sequences_that_fit(100, 30) == 3 and sequences_that_fit(100, 30, reserved=20) == 2
    assert sequences_that_fit(100, 30, reserved=100) == 0 and sequences_that_fit(100, 30, reserved=150) == 0
    # An H100 80GB as the device reports it, Llama-3-8B at 8k tokens (1 GiB each), bf16 weights.
    weights = 2 * dense_param_count(MODELS["Llama-3-8B"])
    assert sequences_that_fit(H100_SXM.memory, 2**30) == 79
    assert sequences_that_fit(H100_SXM.memory, 2**30, weights) == 64
    assert sequences_that_fit(80 * 10**9, 2**30, weights) == 59   # the "80 GB" label: a lower bound


# --------------------------------------------------------------------------- 7.2


def test_decoding_token_by_token_equals_causal_multi_head_attention():
    x, w_qkv, w_o, H = _layer()
    full = multi_head_attention(x, w_qkv, w_o, H, causal=True)
    k, v = empty_kv(x.shape[0], H, x.shape[-1] // H, dtype=x.dtype)
    for t in range(x.shape[1]):
        y, k, v = decode_step(x[:, t:t + 1], k, v, w_qkv, w_o, H)
        assert torch.allclose(y, full[:, t:t + 1], atol=1e-12)
        assert k.shape == v.shape == (x.shape[0], H, t + 1, x.shape[-1] // H)


def test_prefill_then_decode_equals_the_whole_sequence():
    x, w_qkv, w_o, H = _layer(T=11)
    full = multi_head_attention(x, w_qkv, w_o, H, causal=True)
    y, k, v = decode_step(x[:, :7], *empty_kv(2, H, 4, dtype=x.dtype), w_qkv, w_o, H)  # prefill 7 tokens
    assert torch.allclose(y, full[:, :7], atol=1e-12)
    y, k, v = decode_step(x[:, 7:], k, v, w_qkv, w_o, H)  # 4 tokens at once: bottom-right causal
    assert torch.allclose(y, full[:, 7:], atol=1e-12)


def test_decode_step_does_not_modify_its_arguments():
    x, w_qkv, w_o, H = _layer()
    _, k, v = decode_step(x[:, :5], *empty_kv(2, H, 4, dtype=x.dtype), w_qkv, w_o, H)
    k0, v0 = k.clone(), v.clone()
    _, k2, _ = decode_step(x[:, 5:6], k, v, w_qkv, w_o, H)
    assert torch.equal(k, k0) and torch.equal(v, v0) and k2.shape[2] == 6


def test_is_causal_with_one_query_attends_to_the_first_key_only():
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(1, 2, 1, 8, generator=g), torch.randn(1, 2, 6, 8, generator=g), torch.randn(1, 2, 6, 8, generator=g)
    top_left = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.allclose(top_left, v[:, :, :1])
    right = F.scaled_dot_product_attention(q, k, v)
    assert torch.allclose(F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(1, 6)), right)
    assert torch.allclose(scaled_dot_product_attention(q, k, v, causal_mask(6)[-1:]), right, atol=1e-6)


# --------------------------------------------------------------------------- 7.3


def test_prefill_decode_flops_closed_form():
    for P, N, d, L in [(5, 3, 16, 2), (128, 64, 24, 3), (7, 0, 8, 4), (1, 1, 1, 1)]:
        s1 = N * P + N * (N + 1) // 2                               # sum of L = P + t
        s2 = sum((P + t) ** 2 for t in range(1, N + 1))
        prefill = 8 * d * d * P + 4 * d * P * P
        assert prefill_decode_flops(P, N, d, L, True) == L * (prefill + 8 * d * d * N + 4 * d * s1)
        assert prefill_decode_flops(P, N, d, L, False) == L * (prefill + 8 * d * d * s1 + 4 * d * s2)
        assert prefill_decode_flops(P, N, d, L, True) <= prefill_decode_flops(P, N, d, L, False)


# --------------------------------------------------------------------------- the preallocated cache


def test_preallocated_cache_equals_decode_step():
    x, w_qkv, w_o, H = _layer(T=9)
    full = multi_head_attention(x, w_qkv, w_o, H, causal=True)
    cache = KVCache(2, H, 16, 4, dtype=x.dtype)
    ys = [cached_attention(x[:, :4], cache, w_qkv, w_o, H)]
    ys += [cached_attention(x[:, t:t + 1], cache, w_qkv, w_o, H) for t in range(4, 9)]
    assert torch.allclose(torch.cat(ys, dim=1), full, atol=1e-12)
    assert cache.lengths.tolist() == [9, 9]


def test_reset_starts_a_new_sequence_and_a_stale_pointer_does_not():
    x, w_qkv, w_o, H = _layer(T=6)
    cache = KVCache(2, H, 16, 4, dtype=x.dtype)
    cached_attention(x[:, :6], cache, w_qkv, w_o, H)
    x2, _, _, _ = _layer(T=5, seed=1)
    stale = cached_attention(x2, cache, w_qkv, w_o, H)        # forgot reset: sees the old sequence
    cache.reset()
    fresh = cached_attention(x2, cache, w_qkv, w_o, H)
    expected = multi_head_attention(x2, w_qkv, w_o, H, causal=True)
    assert torch.allclose(fresh, expected, atol=1e-12) and not torch.allclose(stale, expected, atol=1e-3)


def test_sequences_of_different_lengths_in_one_cache():
    x, w_qkv, w_o, H = _layer(B=3, T=6)
    lengths = torch.tensor([6, 2, 4])
    cache = KVCache(3, H, 12, 4, dtype=x.dtype)
    y = cached_attention(x, cache, w_qkv, w_o, H, valid=lengths)   # right-padded prompts
    new = _layer(B=3, T=2, seed=2)[0]
    y_next = [cached_attention(new[:, i:i + 1], cache, w_qkv, w_o, H) for i in range(2)]
    for b, n in enumerate(lengths.tolist()):
        seq = torch.cat([x[b:b + 1, :n], new[b:b + 1]], dim=1)
        ref = multi_head_attention(seq, w_qkv, w_o, H, causal=True)
        assert torch.allclose(y[b:b + 1, :n], ref[:, :n], atol=1e-12)
        assert torch.allclose(torch.cat(y_next, dim=1)[b:b + 1], ref[:, n:], atol=1e-12)
    assert cache.lengths.tolist() == [8, 4, 6]


def test_cache_overflow_is_an_error():
    cache = KVCache(1, 2, 3, 4)
    cache.append(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))
    with pytest.raises(ValueError, match="overflow"):
        cache.append(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))


# --------------------------------------------------------------------------- split-K decoding


@pytest.mark.parametrize("n_splits", [1, 2, 3, 7, 37, 100])
def test_split_k_decode_equals_attention_over_the_whole_cache(n_splits):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 6, 1, 16, generator=g)
    k, v = torch.randn(2, 2, 37, 16, generator=g), torch.randn(2, 2, 37, 16, generator=g)
    assert torch.allclose(split_k_decode(q, k, v, n_splits), grouped_query_attention(q, k, v), atol=1e-5)


def test_merge_partials_gives_empty_chunks_no_weight():
    outs = torch.tensor([[1.0, 2.0], [5.0, 7.0]])[:, None, :]    # [2 chunks, 1 row, d=2]
    lses = torch.tensor([[0.0], [-math.inf]])
    out, lse = merge_partials(outs, lses)
    assert torch.equal(out, torch.tensor([[1.0, 2.0]])) and lse.item() == 0.0


# --------------------------------------------------------------------------- sliding windows: the ring buffer


def _window_reference(q, k, v, W):
    """Attention over the whole sequence with notebook 03's sliding-window mask, GQA: [B, H, T, d]."""
    g = q.shape[1] // k.shape[1]
    return scaled_dot_product_attention(q, repeat_kv(k, g), repeat_kv(v, g), sliding_window_mask(q.shape[2], W))


@pytest.mark.parametrize("W", [1, 3, 5])
def test_ring_buffer_generation_equals_sliding_window_attention_with_rope(W):
    g = torch.Generator().manual_seed(5)
    B, H, H_kv, T, d = 2, 6, 2, 17, 8                      # T > 3 W: the buffer wraps several times
    pos = torch.arange(T)
    q = rope(torch.randn(B, H, T, d, generator=g, dtype=torch.float64), pos)
    k = rope(torch.randn(B, H_kv, T, d, generator=g, dtype=torch.float64), pos)   # cached already rotated
    v = torch.randn(B, H_kv, T, d, generator=g, dtype=torch.float64)
    full = _window_reference(q, k, v, W)
    k_buf = torch.full((B, H_kv, W, d), 7.0, dtype=torch.float64)               # leftovers, never read
    v_buf = k_buf.clone()
    for t in range(T):
        o, k_buf, v_buf = ring_buffer_decode_step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], k_buf, v_buf, t)
        assert (o - full[:, :, t:t + 1]).abs().max() < 1e-12
        assert torch.equal(k_buf[:, :, t % W], k[:, :, t])
    assert torch.equal(k_buf, k[:, :, [T - W + ((s - (T - W)) % W) for s in range(W)]])  # slot s: last p = s mod W


def test_ring_buffer_slot_order_does_not_matter():
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 4, n, 8, generator=g, dtype=torch.float64) for n in (1, 5, 5))
    perm = torch.randperm(5, generator=g)
    assert torch.allclose(grouped_query_attention(q, k, v), grouped_query_attention(q, k[:, :, perm], v[:, :, perm]),
                          atol=1e-14)
    assert not torch.allclose(grouped_query_attention(q, k, v), grouped_query_attention(q, k[:, :, perm], v), atol=1e-3)


def test_ring_buffer_decode_step_keeps_its_arguments_and_refuses_bad_input():
    g = torch.Generator().manual_seed(7)
    q, k_new, v_new = torch.randn(1, 4, 1, 3, generator=g), torch.randn(1, 2, 1, 3, generator=g), torch.zeros(1, 2, 1, 3)
    k_buf, v_buf = torch.randn(1, 2, 4, 3, generator=g), torch.randn(1, 2, 4, 3, generator=g)
    k0 = k_buf.clone()
    _, k2, _ = ring_buffer_decode_step(q, k_new, v_new, k_buf, v_buf, 6)
    assert torch.equal(k_buf, k0) and torch.equal(k2[:, :, 2], k_new[:, :, 0]) and torch.equal(k2[:, :, [0, 1, 3]], k0[:, :, [0, 1, 3]])
    with pytest.raises(ValueError, match="position, an int >= 0"):
        ring_buffer_decode_step(q, k_new, v_new, k_buf, v_buf, -1)
    with pytest.raises(ValueError, match="position, an int >= 0"):
        ring_buffer_decode_step(q, k_new, v_new, k_buf, v_buf, torch.tensor(3))
    with pytest.raises(ValueError, match=r"k_new, v_new \[B, H_kv, 1, d\]"):
        ring_buffer_decode_step(q, k_new[:, :1], v_new, k_buf, v_buf, 0)
    with pytest.raises(ValueError, match="q must be"):
        ring_buffer_decode_step(q[..., :2], k_new, v_new, k_buf, v_buf, 0)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        ring_buffer_decode_step(torch.randn(1, 3, 1, 3), k_new, v_new, k_buf, v_buf, 0)


def test_windowed_models_layers():
    counts = {name: (m.layer_windows().count(0), m.cfg.n_layers) for name, m in WINDOWED.items()}
    assert counts == {"Mistral-7B-v0.1": (0, 32), "Gemma-2-9B": (21, 42), "Gemma-3-27B": (10, 62)}
    gemma3 = WINDOWED["Gemma-3-27B"].layer_windows()
    assert gemma3[:6] == [1024] * 5 + [0] and gemma3[-2:] == [1024, 1024]   # starts local; 62 = 10 x 6 + 2
    assert WINDOWED["Gemma-2-9B"].layer_windows()[:2] == [4096, 0]


def test_layered_cache_bytes():
    llama = MODELS["Llama-3-8B"]
    full = [0] * llama.n_layers
    for T in (1, 100, 5000):
        assert layered_cache_bytes(llama, T, full, batch=3, dtype_bytes=4) == kv_cache_bytes(
            3, T, llama.n_layers, llama.n_kv_heads, llama.head_dim, 4)
        assert 2 * layered_cache_bytes(llama, T, full, layers_per_kv=2) == layered_cache_bytes(llama, T, full)
    assert layered_cache_bytes(llama, 10, full, layers_per_kv=3) * 32 == layered_cache_bytes(llama, 10, full) * 11
    mav = MODELS["Llama-4-Maverick"]                  # a chunked layer holds at most one chunk, as a window
    windows = [0 if (i + 1) % 4 == 0 else mav.attention_chunk_size for i in range(mav.n_layers)]
    for T in (100, 8192, 131072):
        assert layered_cache_bytes(mav, T, windows) == model_cache_bytes(mav, T)
    mistral = WINDOWED["Mistral-7B-v0.1"]
    w = mistral.layer_windows()
    assert layered_cache_bytes(mistral.cfg, 32768, [0] * 32) == 8 * layered_cache_bytes(mistral.cfg, 32768, w)
    assert layered_cache_bytes(mistral.cfg, 4096, w) == layered_cache_bytes(mistral.cfg, 10**6, w) == 2**29  # 0.5 GiB
    gemma = WINDOWED["Gemma-3-27B"]
    per_token_layer = 2 * 16 * 128 * 2
    assert layered_cache_bytes(gemma.cfg, 131072, gemma.layer_windows()) == (
        10 * 131072 + 52 * 1024) * per_token_layer
    with pytest.raises(ValueError, match="same window"):
        layered_cache_bytes(gemma.cfg, 10, gemma.layer_windows(), layers_per_kv=2)
    with pytest.raises(ValueError, match="one window per layer"):
        layered_cache_bytes(gemma.cfg, 10, [0] * 3)
    with pytest.raises(ValueError, match="MLA"):
        layered_cache_bytes(MODELS["DeepSeek-V3"], 10, [0] * 61)


# ============================================================ 7.1 kv_cache_bytes

# wrong: what a learner might write
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


# right: other styles than the reference
def cache_bytes_prod(batch, seq_len, n_layers, n_kv_heads, head_dim, dtype_bytes):
    return math.prod([2, batch, seq_len, n_layers, n_kv_heads, head_dim, dtype_bytes])


def cache_bytes_per_token(batch, seq_len, n_layers, n_kv_heads, head_dim, dtype_bytes):
    per_token_per_layer = 2 * n_kv_heads * head_dim * dtype_bytes   # K and V
    return int(per_token_per_layer * n_layers * seq_len * batch)


# ============================================================ 7.2 decode_step

# wrong: what a learner might write
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


# right: other styles than the reference
def _proj(x_t, w_qkv, n_heads):
    B, T, D = x_t.shape
    q, k, v = torch.chunk(x_t @ w_qkv, 3, dim=-1)
    return [m.reshape(B, T, n_heads, D // n_heads).permute(0, 2, 1, 3) for m in (q, k, v)]


def decode_einsum(x_t, k_cache, v_cache, w_qkv, w_o, n_heads):
    q, k, v = _proj(x_t, w_qkv, n_heads)
    K, V = torch.cat((k_cache, k), dim=-2), torch.cat((v_cache, v), dim=-2)
    s = torch.einsum("bhqd,bhkd->bhqk", q, K) / math.sqrt(q.shape[-1])
    o = torch.einsum("bhqk,bhkd->bqhd", s.softmax(-1), V)
    return o.flatten(2) @ w_o, K, V


def decode_loops_over_heads(x_t, k_cache, v_cache, w_qkv, w_o, n_heads):
    B, _, D = x_t.shape
    d_k = D // n_heads
    qkv = x_t @ w_qkv
    heads, ks, vs = [], [], []
    for h in range(n_heads):
        q = qkv[:, :, h * d_k:(h + 1) * d_k]
        k = torch.cat([k_cache[:, h], qkv[:, :, D + h * d_k:D + (h + 1) * d_k]], dim=1)
        v = torch.cat([v_cache[:, h], qkv[:, :, 2 * D + h * d_k:2 * D + (h + 1) * d_k]], dim=1)
        w = torch.softmax(q @ k.transpose(1, 2) / d_k**0.5, dim=-1)
        heads.append(w @ v)
        ks.append(k)
        vs.append(v)
    return torch.cat(heads, dim=-1) @ w_o, torch.stack(ks, dim=1), torch.stack(vs, dim=1)


def decode_sdpa_bottom_right(x_t, k_cache, v_cache, w_qkv, w_o, n_heads):
    q, k, v = _proj(x_t, w_qkv, n_heads)
    K, V = torch.cat([k_cache, k], dim=2), torch.cat([v_cache, v], dim=2)
    mask = causal_lower_right(q.shape[2], K.shape[2])
    o = F.scaled_dot_product_attention(q, K, V, attn_mask=mask)
    B, H, T, d = o.shape
    return o.transpose(1, 2).reshape(B, T, H * d) @ w_o, K, V


def decode_explicit_mask_minus_1e9(x_t, k_cache, v_cache, w_qkv, w_o, n_heads):
    q, k, v = _proj(x_t, w_qkv, n_heads)
    K, V = torch.cat([k_cache, k], dim=2), torch.cat([v_cache, v], dim=2)
    T_new, T = q.shape[2], K.shape[2]
    allowed = torch.ones(T, T, dtype=torch.bool).tril()[T - T_new:]
    s = (q @ K.transpose(-2, -1) / math.sqrt(q.shape[-1])).masked_fill(~allowed, -1e9)
    o = torch.softmax(s, -1) @ V
    B, H, _, d = o.shape
    return o.transpose(1, 2).reshape(B, T_new, H * d) @ w_o, K, V


def decode_float64_inside(x_t, k_cache, v_cache, w_qkv, w_o, n_heads):
    dtype = x_t.dtype
    q, k, v = _proj(x_t.double(), w_qkv.double(), n_heads)
    K, V = torch.cat([k_cache.double(), k], dim=2), torch.cat([v_cache.double(), v], dim=2)
    o = torch.softmax(q @ K.mT / math.sqrt(q.shape[-1]), dim=-1) @ V
    B, H, T, d = o.shape
    y = o.transpose(1, 2).reshape(B, T, H * d) @ w_o.double()
    return y.to(dtype), K.to(dtype), V.to(dtype)


def decode_preallocated(x_t, k_cache, v_cache, w_qkv, w_o, n_heads):
    q, k, v = _proj(x_t, w_qkv, n_heads)
    B, H, T_past, d = k_cache.shape
    K = torch.empty(B, H, T_past + 1, d, dtype=k_cache.dtype)
    V = torch.empty_like(K)
    K[:, :, :T_past], K[:, :, T_past:] = k_cache, k
    V[:, :, :T_past], V[:, :, T_past:] = v_cache, v
    o = F.scaled_dot_product_attention(q, K, V)
    return o.transpose(1, 2).flatten(2) @ w_o, K, V


# ============================================================ 7.3 prefill_decode_flops

# wrong: what a learner might write
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


# right: other styles than the reference
def flops_closed_form(prompt_len, new_tokens, d_model, n_layers, use_cache):
    P, N, d = prompt_len, new_tokens, d_model
    s1 = N * P + N * (N + 1) // 2
    s2 = N * P * P + P * N * (N + 1) + N * (N + 1) * (2 * N + 1) // 6   # sum of (P + t)^2
    steps = 8 * d * d * N + 4 * d * s1 if use_cache else 8 * d * d * s1 + 4 * d * s2
    return n_layers * (8 * d * d * P + 4 * d * P * P + steps)


def flops_layer_by_layer(prompt_len, new_tokens, d_model, n_layers, use_cache):
    total = 0
    for _ in range(n_layers):
        total += 8 * d_model**2 * prompt_len + 4 * d_model * prompt_len**2
        for L in range(prompt_len + 1, prompt_len + new_tokens + 1):
            if use_cache:
                total += 8 * d_model**2 + 4 * d_model * L
            else:
                total += 8 * d_model**2 * L + 4 * d_model * L**2
    return total


# ============================================================ 7.4 ring_buffer_decode_step

# wrong: what a learner might write
def _heads(q, k, v):  # repeat the H_kv heads of k, v for the H query heads (grouped)
    g = q.shape[1] // k.shape[1]
    return k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)


def _softmax_attend(q, k, v):
    k, v = _heads(q, k, v)
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1) @ v


def _write(k_buf, v_buf, k_new, v_new, slot):
    k_buf, v_buf = k_buf.clone(), v_buf.clone()
    k_buf[:, :, slot], v_buf[:, :, slot] = k_new[:, :, 0], v_new[:, :, 0]
    return k_buf, v_buf


def ring_slot_t(q, k_new, v_new, k_buf, v_buf, t):
    k_buf, v_buf = _write(k_buf, v_buf, k_new, v_new, t)  # forgot the modulo
    n = min(t + 1, k_buf.shape[2])
    return _softmax_attend(q, k_buf[:, :, :n], v_buf[:, :, :n]), k_buf, v_buf


def ring_all_slots(q, k_new, v_new, k_buf, v_buf, t):
    k_buf, v_buf = _write(k_buf, v_buf, k_new, v_new, t % k_buf.shape[2])
    return _softmax_attend(q, k_buf, v_buf), k_buf, v_buf  # the whole buffer, even before it is full


def ring_w_plus_1(q, k_new, v_new, k_buf, v_buf, t):
    W = k_buf.shape[2]
    n_old = min(t, W)  # attend first, to the old buffer and the new key, then store
    o = _softmax_attend(q, torch.cat([k_buf[:, :, :n_old], k_new], 2), torch.cat([v_buf[:, :, :n_old], v_new], 2))
    return (o, *_write(k_buf, v_buf, k_new, v_new, t % W))


def ring_w_minus_1(q, k_new, v_new, k_buf, v_buf, t):
    W = k_buf.shape[2]
    k_buf, v_buf = _write(k_buf, v_buf, k_new, v_new, t % W)
    slot_pos = t - (t - torch.arange(W)) % W                  # the position each slot holds
    allowed = (slot_pos > t - W + 1) & (slot_pos >= 0)        # should be >= t - W + 1
    k, v = _heads(q, k_buf, v_buf)
    s = (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).masked_fill(~allowed, float("-inf"))
    return torch.softmax(s, dim=-1) @ v, k_buf, v_buf


def ring_new_not_seen(q, k_new, v_new, k_buf, v_buf, t):
    W = k_buf.shape[2]
    n = min(t, W)  # "the tokens so far"
    o = _softmax_attend(q, k_buf[:, :, :n], v_buf[:, :, :n])
    return (o, *_write(k_buf, v_buf, k_new, v_new, t % W))


def ring_attend_then_write(q, k_new, v_new, k_buf, v_buf, t):
    W = k_buf.shape[2]
    n = min(t + 1, W)
    o = _softmax_attend(q, k_buf[:, :, :n], v_buf[:, :, :n])  # the old buffers: slot t % W not yet written
    return (o, *_write(k_buf, v_buf, k_new, v_new, t % W))


def _ring_scores(q, k_new, v_new, k_buf, v_buf, t):
    """The written buffers and the scores over the written slots, as a learner builds them."""
    W = k_buf.shape[2]
    k_buf, v_buf = _write(k_buf, v_buf, k_new, v_new, t % W)
    k, v = _heads(q, k_buf[:, :, :min(t + 1, W)], v_buf[:, :, :min(t + 1, W)])
    return torch.einsum("bhqd,bhkd->bhqk", q, k), v, k_buf, v_buf


def ring_softmax_over_heads(q, k_new, v_new, k_buf, v_buf, t):
    s, v, k_buf, v_buf = _ring_scores(q, k_new, v_new, k_buf, v_buf, t)
    return (s / math.sqrt(q.shape[-1])).softmax(dim=1) @ v, k_buf, v_buf


def ring_softmax_dim_2(q, k_new, v_new, k_buf, v_buf, t):
    s, v, k_buf, v_buf = _ring_scores(q, k_new, v_new, k_buf, v_buf, t)
    return torch.einsum("bhqk,bhkd->bhqd", F.softmax(s / q.shape[-1] ** 0.5, dim=2), v), k_buf, v_buf


def ring_no_softmax(q, k_new, v_new, k_buf, v_buf, t):
    s, v, k_buf, v_buf = _ring_scores(q, k_new, v_new, k_buf, v_buf, t)
    return s / math.sqrt(q.shape[-1]) @ v, k_buf, v_buf


def ring_scale_by_slots(q, k_new, v_new, k_buf, v_buf, t):
    s, v, k_buf, v_buf = _ring_scores(q, k_new, v_new, k_buf, v_buf, t)
    return torch.softmax(s / math.sqrt(s.shape[-1]), dim=-1) @ v, k_buf, v_buf  # the keys' count, not d


def ring_scale_by_d(q, k_new, v_new, k_buf, v_buf, t):
    s, v, k_buf, v_buf = _ring_scores(q, k_new, v_new, k_buf, v_buf, t)
    return torch.softmax(s / q.shape[-1], dim=-1) @ v, k_buf, v_buf


def ring_value_kept(q, k_new, v_new, k_buf, v_buf, t):
    W = k_buf.shape[2]
    k_buf = k_buf.clone()
    k_buf[:, :, t % W] = k_new[:, :, 0]  # v_buf: "the values stay"
    n = min(t + 1, W)
    return _softmax_attend(q, k_buf[:, :, :n], v_buf[:, :, :n]), k_buf, v_buf


def ring_key_kept(q, k_new, v_new, k_buf, v_buf, t):
    W = k_buf.shape[2]
    v_buf = v_buf.index_copy(2, torch.tensor([t % W]), v_new)
    n = min(t + 1, W)
    return _softmax_attend(q, k_buf[:, :, :n], v_buf[:, :, :n]), k_buf, v_buf


def ring_window_w_minus_1_slots(q, k_new, v_new, k_buf, v_buf, t):
    W = k_buf.shape[2]
    k_buf, v_buf = _write(k_buf, v_buf, k_new, v_new, t % W)
    n = min(t + 1, W - 1)  # "the window excludes the current token's slot"... by count
    return _softmax_attend(q, k_buf[:, :, :n], v_buf[:, :, :n]), k_buf, v_buf


def ring_slot_from_the_end(q, k_new, v_new, k_buf, v_buf, t):
    W = k_buf.shape[2]
    k_buf, v_buf = _write(k_buf, v_buf, k_new, v_new, W - 1 - t % W)  # filled from the last slot
    return _softmax_attend(q, k_buf, v_buf), k_buf, v_buf


def ring_mask_one_ahead(q, k_new, v_new, k_buf, v_buf, t):
    W = k_buf.shape[2]
    k_buf, v_buf = _write(k_buf, v_buf, k_new, v_new, t % W)
    k, v = _heads(q, k_buf, v_buf)
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    s = s.masked_fill(torch.arange(W) > t + 1, float("-inf"))  # should be > t
    return torch.softmax(s, dim=-1) @ v, k_buf, v_buf


def ring_temperature(q, k_new, v_new, k_buf, v_buf, t):
    s, v, k_buf, v_buf = _ring_scores(q, k_new, v_new, k_buf, v_buf, t)
    return torch.softmax(s / (2 * math.sqrt(q.shape[-1])), dim=-1) @ v, k_buf, v_buf  # a "temperature" of 2


def ring_clears_next_slot(q, k_new, v_new, k_buf, v_buf, t):
    W = k_buf.shape[2]
    k_buf, v_buf = _write(k_buf, v_buf, k_new, v_new, t % W)
    n = min(t + 1, W)
    o = _softmax_attend(q, k_buf[:, :, :n], v_buf[:, :, :n])
    if W > 1:  # "free the slot the next token will use"
        k_buf[:, :, (t + 1) % W], v_buf[:, :, (t + 1) % W] = 0.0, 0.0
    return o, k_buf, v_buf


def ring_no_scale(q, k_new, v_new, k_buf, v_buf, t):
    W = k_buf.shape[2]
    k_buf, v_buf = _write(k_buf, v_buf, k_new, v_new, t % W)
    k, v = _heads(q, k_buf[:, :, :min(t + 1, W)], v_buf[:, :, :min(t + 1, W)])
    return torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v, k_buf, v_buf


def ring_sdpa_is_causal(q, k_new, v_new, k_buf, v_buf, t):
    W = k_buf.shape[2]
    k_buf, v_buf = _write(k_buf, v_buf, k_new, v_new, t % W)
    n = min(t + 1, W)
    o = F.scaled_dot_product_attention(q, k_buf[:, :, :n], v_buf[:, :, :n], is_causal=True, enable_gqa=True)
    return o, k_buf, v_buf


def ring_last_n_slots(q, k_new, v_new, k_buf, v_buf, t):
    W = k_buf.shape[2]
    k_buf, v_buf = _write(k_buf, v_buf, k_new, v_new, t % W)
    n = min(t + 1, W)
    k, v = _heads(q, k_buf[:, :, W - n:], v_buf[:, :, W - n:])
    return torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-1) @ v, k_buf, v_buf


def ring_tiled_heads(q, k_new, v_new, k_buf, v_buf, t):
    W = k_buf.shape[2]
    k_buf, v_buf = _write(k_buf, v_buf, k_new, v_new, t % W)
    g, n = q.shape[1] // k_buf.shape[1], min(t + 1, W)
    k, v = k_buf[:, :, :n].repeat(1, g, 1, 1), v_buf[:, :, :n].repeat(1, g, 1, 1)
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1) @ v, k_buf, v_buf


def ring_heads_not_repeated(q, k_new, v_new, k_buf, v_buf, t):
    W = k_buf.shape[2]
    k_buf, v_buf = _write(k_buf, v_buf, k_new, v_new, t % W)
    k, v = k_buf[:, :, :min(t + 1, W)], v_buf[:, :, :min(t + 1, W)]
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1) @ v, k_buf, v_buf


def ring_in_place(q, k_new, v_new, k_buf, v_buf, t):
    W = k_buf.shape[2]
    k_buf[:, :, t % W], v_buf[:, :, t % W] = k_new[:, :, 0], v_new[:, :, 0]  # as an engine would
    n = min(t + 1, W)
    return _softmax_attend(q, k_buf[:, :, :n], v_buf[:, :, :n]), k_buf, v_buf


def ring_slot_t_minus_1(q, k_new, v_new, k_buf, v_buf, t):
    W = k_buf.shape[2]
    k_buf, v_buf = _write(k_buf, v_buf, k_new, v_new, (t - 1) % W)  # "the t-th token"
    n = min(t + 1, W)
    return _softmax_attend(q, k_buf[:, :, :n], v_buf[:, :, :n]), k_buf, v_buf


def ring_last_slot_when_full(q, k_new, v_new, k_buf, v_buf, t):
    W = k_buf.shape[2]
    k_buf, v_buf = _write(k_buf, v_buf, k_new, v_new, min(t, W - 1))
    n = min(t + 1, W)
    return _softmax_attend(q, k_buf[:, :, :n], v_buf[:, :, :n]), k_buf, v_buf


def ring_shifted(q, k_new, v_new, k_buf, v_buf, t):
    W = k_buf.shape[2]
    k_buf, v_buf = torch.roll(k_buf, -1, dims=2), torch.roll(v_buf, -1, dims=2)  # oldest out, newest at the end
    k_buf[:, :, -1], v_buf[:, :, -1] = k_new[:, :, 0], v_new[:, :, 0]
    n = min(t + 1, W)
    return _softmax_attend(q, k_buf[:, :, W - n:], v_buf[:, :, W - n:]), k_buf, v_buf


def ring_returns_given_buffers(q, k_new, v_new, k_buf, v_buf, t):
    W = k_buf.shape[2]
    k2, v2 = _write(k_buf, v_buf, k_new, v_new, t % W)
    n = min(t + 1, W)
    return _softmax_attend(q, k2[:, :, :n], v2[:, :, :n]), k_buf, v_buf


def ring_appends(q, k_new, v_new, k_buf, v_buf, t):
    k_buf, v_buf = torch.cat([k_buf, k_new], dim=2), torch.cat([v_buf, v_new], dim=2)  # as in 7.2
    n = min(t + 1, k_buf.shape[2] - 1)
    return _softmax_attend(q, k_buf[:, :, -n:], v_buf[:, :, -n:]), k_buf, v_buf


def ring_swapped(q, k_new, v_new, k_buf, v_buf, t):
    W = k_buf.shape[2]
    k_buf, v_buf = _write(k_buf, v_buf, k_new, v_new, t % W)
    n = min(t + 1, W)
    return _softmax_attend(q, k_buf[:, :, :n], v_buf[:, :, :n]), v_buf, k_buf


def ring_float32(q, k_new, v_new, k_buf, v_buf, t):
    W = k_buf.shape[2]
    k_buf, v_buf = _write(k_buf.float(), v_buf.float(), k_new.float(), v_new.float(), t % W)
    n = min(t + 1, W)
    return _softmax_attend(q.float(), k_buf[:, :, :n], v_buf[:, :, :n]), k_buf, v_buf


def ring_with_window_argument(q, k_new, v_new, k_buf, v_buf, t, window):
    k_buf, v_buf = _write(k_buf, v_buf, k_new, v_new, t % window)
    n = min(t + 1, window)
    return _softmax_attend(q, k_buf[:, :, :n], v_buf[:, :, :n]), k_buf, v_buf


# right: other styles than the reference
def ring_einsum(q, k_new, v_new, k_buf, v_buf, t):
    B, H_kv, W, d = k_buf.shape
    k_buf, v_buf = k_buf.clone(), v_buf.clone()
    k_buf[:, :, t % W], v_buf[:, :, t % W] = k_new[:, :, 0], v_new[:, :, 0]
    n = min(t + 1, W)
    qg = q.reshape(B, H_kv, q.shape[1] // H_kv, d)                          # [B, H_kv, g, d]
    s = torch.einsum("bkgd,bknd->bkgn", qg, k_buf[:, :, :n]) / math.sqrt(d)
    o = torch.einsum("bkgn,bknd->bkgd", s.softmax(-1), v_buf[:, :, :n])
    return o.reshape(B, -1, 1, d), k_buf, v_buf


def ring_sdpa_mask(q, k_new, v_new, k_buf, v_buf, t):
    W = k_buf.shape[2]
    slot = torch.arange(W) == t % W
    k_buf = torch.where(slot[:, None], k_new, k_buf)                        # new tensors, no clone needed
    v_buf = torch.where(slot[:, None], v_new, v_buf)
    allowed = (torch.arange(W) <= t)[None, :]                               # [1, W]: the written slots
    o = F.scaled_dot_product_attention(q, k_buf, v_buf, attn_mask=allowed, enable_gqa=True)
    return o, k_buf, v_buf


def ring_float64_minus_1e9(q, k_new, v_new, k_buf, v_buf, t):
    W = k_buf.shape[2]
    k_buf = k_buf.index_copy(2, torch.tensor([t % W]), k_new)
    v_buf = v_buf.index_copy(2, torch.tensor([t % W]), v_new)
    k, v = _heads(q, k_buf.double(), v_buf.double())
    s = q.double() @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    s = s.masked_fill(torch.arange(W) > t, -1e9)
    return (torch.softmax(s, dim=-1) @ v).to(q.dtype), k_buf, v_buf


def ring_chronological_gather(q, k_new, v_new, k_buf, v_buf, t):
    W = k_buf.shape[2]
    k_buf, v_buf = k_buf.clone(), v_buf.clone()
    k_buf[:, :, t % W], v_buf[:, :, t % W] = k_new[:, :, 0], v_new[:, :, 0]
    slots = [p % W for p in range(max(0, t - W + 1), t + 1)]               # oldest to newest
    k = repeat_kv(k_buf[:, :, slots], q.shape[1] // k_buf.shape[1])
    v = repeat_kv(v_buf[:, :, slots], q.shape[1] // k_buf.shape[1])
    return scaled_dot_product_attention(q, k, v), k_buf, v_buf


# ============================================================ the exercises' cases

def cache_head_dim_for_heads(batch, seq_len, n_layers, n_kv_heads, head_dim, dtype_bytes):
    return 2 * batch * seq_len * n_layers * head_dim * head_dim * dtype_bytes  # head_dim twice


def cache_bf16_always(batch, seq_len, n_layers, n_kv_heads, head_dim, dtype_bytes):
    return 2 * batch * seq_len * n_layers * n_kv_heads * head_dim * 2  # "2 bytes per number"


def flops_without_w_o(prompt_len, new_tokens, d_model, n_layers, use_cache):
    d, P = d_model, prompt_len
    total = 6 * d * d * P + 4 * d * P * P  # Q, K, V only
    for t in range(1, new_tokens + 1):
        L = P + t
        total += 6 * d * d + 4 * d * L if use_cache else 6 * d * d * L + 4 * d * L * L
    return n_layers * total



def decode_scaled_by_model_width(x_t, k_cache, v_cache, w_qkv, w_o, n_heads):
    q, k, v = _proj(x_t, w_qkv, n_heads)
    K, V = torch.cat((k_cache, k), dim=-2), torch.cat((v_cache, v), dim=-2)
    s = torch.einsum("bhqd,bhkd->bhqk", q, K) / math.sqrt(x_t.shape[-1])  # the model's width D
    return torch.einsum("bhqk,bhkd->bqhd", s.softmax(-1), V).flatten(2) @ w_o, K, V


def decode_linear_w_o(x_t, k_cache, v_cache, w_qkv, w_o, n_heads):
    q, k, v = _proj(x_t, w_qkv, n_heads)
    K, V = torch.cat((k_cache, k), dim=-2), torch.cat((v_cache, v), dim=-2)
    o = F.scaled_dot_product_attention(q, K, V).transpose(1, 2).flatten(2)
    return F.linear(o, w_o), K, V  # nn.Linear's convention: o @ w_o.T


def flops_cached_step_attention_only(prompt_len, new_tokens, d_model, n_layers, use_cache):
    P, N, d = prompt_len, new_tokens, d_model
    pre = 8 * d * d * P + 4 * d * P * P
    if use_cache:
        steps = 4 * d * (N * P + N * (N + 1) // 2)  # only the attention of each step
    else:
        steps = sum(8 * d * d * L + 4 * d * L * L for L in range(P + 1, P + N + 1))
    return n_layers * (pre + steps)


def flops_layers_times_prefill(prompt_len, new_tokens, d_model, n_layers, use_cache):
    d = d_model
    steps = [8 * d * d + 4 * d * L if use_cache else 8 * d * d * L + 4 * d * L * L
             for L in range(prompt_len + 1, prompt_len + new_tokens + 1)]
    return n_layers * _prefill(d, prompt_len) + sum(steps)


def flops_no_cache_no_prefill(prompt_len, new_tokens, d_model, n_layers, use_cache):
    d, total = d_model, _prefill(d_model, prompt_len) if use_cache else 0
    for L in range(prompt_len + 1, prompt_len + new_tokens + 1):
        total += 8 * d * d + 4 * d * L if use_cache else 8 * d * d * L + 4 * d * L * L
    return n_layers * total


def flops_sum_as_half_square(prompt_len, new_tokens, d_model, n_layers, use_cache):
    P, N, d = prompt_len, new_tokens, d_model
    if not use_cache:
        return flops_closed_form(P, N, d, n_layers, use_cache)
    return n_layers * (_prefill(d, P) + 8 * d * d * N + 4 * d * (N * P + N**2 // 2))


def _ring_write(k_buf, v_buf, k_put, v_put, t):
    W = k_buf.shape[2]
    k_buf, v_buf = k_buf.clone(), v_buf.clone()
    k_buf[:, :, t % W], v_buf[:, :, t % W] = k_put[:, :, 0], v_put[:, :, 0]
    n = min(t + 1, W)
    return k_buf, v_buf, n


def _ring_attend(q, k, v):
    g = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1))


def ring_time_ordered(q, k_new, v_new, k_buf, v_buf, t):
    k_buf, v_buf, n = _ring_write(k_buf, v_buf, k_new, v_new, t)
    o = _ring_attend(q, k_buf[:, :, :n], v_buf[:, :, :n])
    order = [p % k_buf.shape[2] for p in range(t + 1 - k_buf.shape[2], t + 1)]  # oldest first, once full
    if t + 1 >= k_buf.shape[2]:
        k_buf, v_buf = k_buf[:, :, order], v_buf[:, :, order]
    return o, k_buf, v_buf


def ring_value_gets_key(q, k_new, v_new, k_buf, v_buf, t):
    k_buf, v_buf, n = _ring_write(k_buf, v_buf, k_new, k_new, t)  # copy-paste: k_new twice
    return _ring_attend(q, k_buf[:, :, :n], v_buf[:, :, :n]), k_buf, v_buf


def ring_window_slice(q, k_new, v_new, k_buf, v_buf, t):
    k_buf, v_buf, n = _ring_write(k_buf, v_buf, k_new, v_new, t)
    end = t % k_buf.shape[2] + 1
    window = slice(end - n, end)  # the last n slots up to the new one, not wrapped
    return _ring_attend(q, k_buf[:, :, window], v_buf[:, :, window]).nan_to_num(), k_buf, v_buf


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
        (cache_head_dim_for_heads, "head_dim where n_kv_heads belongs"),
        (cache_bf16_always, "ignored dtype_bytes (2 bytes"),
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
        (decode_scaled_by_model_width, "divided by sqrt(D), D = d_model"),
        (decode_linear_w_o, "times w_o transposed"),
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
        (flops_without_w_o, "you left out W_O"),
        (flops_cached_step_attention_only, "but not the projections"),
        (flops_layers_times_prefill, "multiplies the prefill by n_layers"),
        (flops_no_cache_no_prefill, "without a cache your count leaves out the prefill"),
        (flops_sum_as_half_square, "N*(N+1)/2, not N^2/2"),
    ],
    "ring_buffer_decode_step": [
        (ring_slot_t, "token t goes to slot t % W, which wraps around"),
        (ring_all_slots, "never written in this sequence"),
        (ring_w_plus_1, "W + 1 keys"),
        (ring_w_minus_1, "W - 1 keys"),
        (ring_new_not_seen, "new token's own key and value were not attended"),
        (ring_attend_then_write, "you attended before writing"),
        (ring_no_scale, "sqrt(d)"),
        (ring_sdpa_is_causal, "is_causal=True aligns the mask top-left"),
        (ring_last_n_slots, "the first min(t + 1, W)"),
        (ring_tiled_heads, "GQA heads in the wrong order"),
        (ring_heads_not_repeated, "repeat each key/value head"),
        (ring_in_place, "modified one of its input tensors in place"),
        (ring_slot_t_minus_1, "slot (t - 1) % W"),
        (ring_last_slot_when_full, "kept overwriting its last slot"),
        (ring_shifted, "your buffers are shifted"),
        (ring_returns_given_buffers, "returned the buffers you were given"),
        (ring_appends, "buffer grew by one slot"),
        (ring_swapped, "buffers swapped"),
        (ring_float32, "expected dtype torch.float64"),
        (ring_with_window_argument, "the window W is the buffers' length"),
        (ring_softmax_over_heads, "your softmax ran over the heads"),
        (ring_softmax_dim_2, "your softmax ran over the query axis"),
        (ring_no_softmax, "you used the scaled scores as the weights"),
        (ring_scale_by_slots, "square root of the number of slots attended"),
        (ring_scale_by_d, "divided by d, not by sqrt(d)"),
        (ring_value_kept, "you wrote k_new into slot t % W but not v_new"),
        (ring_key_kept, "you wrote v_new into slot t % W but not k_new"),
        (ring_window_w_minus_1_slots, "slots 0 .. W - 2 only"),
        (ring_slot_from_the_end, "you wrote the new token into slot 1 of k_buf"),
        (ring_mask_one_ahead, "your o attends to slots 0, 1, 2, 3 of the buffers with the new token written"),
        (ring_temperature, "your scores were multiplied by 0.2236"),
        (ring_clears_next_slot, "but slot 3 changed too"),
        (ring_time_ordered, "rolled into time order"),
        (ring_value_gets_key, "your v_buf holds k_new in slot t % W"),
        (ring_window_slice, "your o is all zeros: it attended to no slot"),
    ],
}


RIGHT = {
    "kv_cache_bytes": [cache_bytes_prod, cache_bytes_per_token],
    "decode_step": [decode_einsum, decode_loops_over_heads, decode_sdpa_bottom_right, decode_explicit_mask_minus_1e9,
                    decode_float64_inside, decode_preallocated],
    "prefill_decode_flops": [flops_closed_form, flops_layer_by_layer],
    "ring_buffer_decode_step": [ring_einsum, ring_sdpa_mask, ring_float64_minus_1e9, ring_chronological_gather],
}


# make test runs the first 10 wrong answers of each exercise (the commonest); make test-all all of them
@pytest.mark.parametrize(("name", "wrong", "hint"), first_fast(wrong_cases(WRONG), dict.fromkeys(WRONG, 10)))
def test_check_rejects_wrong(name, wrong, hint):
    assert_rejected(name, wrong, hint)


@pytest.mark.parametrize(("name", "right"), right_cases(RIGHT))
def test_check_accepts_right(name, right):
    assert_accepted(name, right)


def test_a_mistake_the_returned_buffers_rule_out_is_never_named():
    """Attending with the old buffers, then writing, gives the output that writing into slot
    (t + 1) % W would give before the buffer fills; its buffers are right, which rules that out
    (issue 32: it was named as that slot mistake)."""
    failure = assert_rejected("ring_buffer_decode_step", ring_attend_then_write, "you attended before writing")
    assert "(t + 1) % W" not in str(failure) and "slot-t-plus-1" not in failure.mistake_id
