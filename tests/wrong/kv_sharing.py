"""Learner-style wrong implementations for exercises 6.1-6.4, with the hint each check must give."""

import math

import torch


# ----------------------------------------------------------------- 6.1 repeat_kv
def repeat_kv_tiles(x, n_rep):
    return x.repeat(1, n_rep, 1, 1)  # the classic bug: heads 0, 1, 2, 0, 1, 2, ...


def repeat_kv_tiles_with_cat(x, n_rep):
    return torch.cat([x] * n_rep, dim=1)


def repeat_kv_sequence_axis(x, n_rep):
    return x.repeat_interleave(n_rep, dim=2)


def repeat_kv_no_reshape(x, n_rep):
    B, H_kv, T, d = x.shape
    return x[:, :, None].expand(B, H_kv, n_rep, T, d)


def repeat_kv_float32(x, n_rep):
    return x.float().repeat_interleave(n_rep, dim=1)


# ----------------------------------------------------------------- 6.2 grouped_query_attention
def _attend(q, k, v, causal):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        T = s.shape[-1]
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def gqa_tiled_heads(q, k, v, causal=False):
    n_rep = q.shape[1] // k.shape[1]
    return _attend(q, k.repeat(1, n_rep, 1, 1), v.repeat(1, n_rep, 1, 1), causal)


def gqa_one_kv_head(q, k, v, causal=False):
    return _attend(q, k[:, :1], v[:, :1], causal)  # broadcasts kv head 0 to every query head


def gqa_ignores_causal(q, k, v, causal=False):
    n_rep = q.shape[1] // k.shape[1]
    return _attend(q, k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1), False)


def gqa_always_causal(q, k, v, causal=False):
    n_rep = q.shape[1] // k.shape[1]
    return _attend(q, k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1), True)


def gqa_no_repeat(q, k, v, causal=False):
    return _attend(q, k, v, causal)  # fails to broadcast when 1 < H_kv < H


def gqa_no_scale(q, k, v, causal=False):
    n_rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1)
    s = q @ k.transpose(-2, -1)
    if causal:
        T = s.shape[-1]
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


# ----------------------------------------------------------------- 6.3 kv_values_per_token
def values_keys_only(kind, n_heads, n_kv_heads, head_dim, kv_lora_rank, rope_dim):
    if kind == "mla":
        return kv_lora_rank + rope_dim
    return {"mha": n_heads, "gqa": n_kv_heads, "mqa": 1}[kind] * head_dim


def values_mla_twice(kind, n_heads, n_kv_heads, head_dim, kv_lora_rank, rope_dim):
    if kind == "mla":
        return 2 * (kv_lora_rank + rope_dim)  # "K and V", as for the other kinds
    return 2 * {"mha": n_heads, "gqa": n_kv_heads, "mqa": 1}[kind] * head_dim


def values_mla_without_rope(kind, n_heads, n_kv_heads, head_dim, kv_lora_rank, rope_dim):
    if kind == "mla":
        return kv_lora_rank
    return 2 * {"mha": n_heads, "gqa": n_kv_heads, "mqa": 1}[kind] * head_dim


def values_mla_rope_per_head(kind, n_heads, n_kv_heads, head_dim, kv_lora_rank, rope_dim):
    if kind == "mla":
        return kv_lora_rank + n_heads * rope_dim
    return 2 * {"mha": n_heads, "gqa": n_kv_heads, "mqa": 1}[kind] * head_dim


def values_gqa_query_heads(kind, n_heads, n_kv_heads, head_dim, kv_lora_rank, rope_dim):
    if kind == "mla":
        return kv_lora_rank + rope_dim
    return 2 * {"mha": n_heads, "gqa": n_heads, "mqa": 1}[kind] * head_dim


def values_in_bytes(kind, n_heads, n_kv_heads, head_dim, kv_lora_rank, rope_dim):
    if kind == "mla":
        return 2 * (kv_lora_rank + rope_dim)
    return 2 * 2 * {"mha": n_heads, "gqa": n_kv_heads, "mqa": 1}[kind] * head_dim


def values_as_float(kind, n_heads, n_kv_heads, head_dim, kv_lora_rank, rope_dim):
    if kind == "mla":
        return float(kv_lora_rank + rope_dim)
    return 2.0 * {"mha": n_heads, "gqa": n_kv_heads, "mqa": 1}[kind] * head_dim


# ----------------------------------------------------------------- 6.4 mla_absorbed_scores
def mla_scaled(q, c_kv, w_uk):
    return (q @ w_uk.transpose(-2, -1)) @ c_kv.unsqueeze(1).transpose(-2, -1) / math.sqrt(q.shape[-1])


def mla_scaled_by_latent(q, c_kv, w_uk):
    return (q @ w_uk.transpose(-2, -1)) @ c_kv.unsqueeze(1).transpose(-2, -1) / math.sqrt(c_kv.shape[-1])


def mla_first_head_only(q, c_kv, w_uk):
    return (q @ w_uk[0].T) @ c_kv.unsqueeze(1).transpose(-2, -1)


def mla_forms_keys(q, c_kv, w_uk):
    k = c_kv.unsqueeze(1) @ w_uk  # [B, H, T, d_h]: exactly what the contract forbids
    return q @ k.transpose(-2, -1)


def mla_forms_keys_einsum(q, c_kv, w_uk):
    k = torch.einsum("btc,hcd->bhtd", c_kv, w_uk)
    return torch.einsum("bhqd,bhtd->bhqt", q, k)


def mla_forms_keys_per_head(q, c_kv, w_uk):
    scores = []
    for h in range(q.shape[1]):
        k_h = c_kv @ w_uk[h]  # [B, T, d_h], one head at a time: still the per-head keys
        scores.append(q[:, h] @ k_h.transpose(-2, -1))
    return torch.stack(scores, dim=1)


def mla_forms_keys_flat(q, c_kv, w_uk):
    B, H, T_q, d_h = q.shape
    T, d_c = c_kv.shape[1:]
    k = (c_kv @ w_uk.permute(1, 0, 2).reshape(d_c, H * d_h)).view(B, T, H, d_h).transpose(1, 2)
    return q @ k.transpose(-2, -1)


def mla_forms_keys_per_token(q, c_kv, w_uk):
    B, H, T_q, d_h = q.shape
    out = torch.empty(B, H, T_q, c_kv.shape[1], dtype=q.dtype)
    for t in range(c_kv.shape[1]):
        k_t = torch.einsum("bc,hcd->bhd", c_kv[:, t], w_uk)  # one token's per-head keys
        out[..., t] = (q * k_t[:, :, None]).sum(-1)
    return out


def mla_forms_keys_broadcast(q, c_kv, w_uk):
    k = (c_kv[:, None, :, :, None] * w_uk[None, :, None]).sum(-2)  # [B, H, T, d_h] by broadcasting
    return q @ k.transpose(-2, -1)


def mla_three_operand_einsum(q, c_kv, w_uk):
    return torch.einsum("btc,hcd,bhqd->bhqt", c_kv, w_uk, q)  # contracts c_kv with w_uk first


WRONG = {
    "repeat_kv": [
        (repeat_kv_tiles, "you tiled the heads"),
        (repeat_kv_tiles_with_cat, "you tiled the heads"),
        (repeat_kv_sequence_axis, "sequence axis"),
        (repeat_kv_no_reshape, "5-D view"),
        (repeat_kv_float32, "expected dtype torch.float64"),
    ],
    "grouped_query_attention": [
        (gqa_tiled_heads, "are tiled"),
        (gqa_one_kv_head, "read kv head 0"),
        (gqa_ignores_causal, "causal=True was ignored"),
        (gqa_always_causal, "causal=False here"),
        (gqa_no_repeat, "repeat each kv head"),
        (gqa_no_scale, "not scaled"),
    ],
    "kv_values_per_token": [
        (values_keys_only, "keys only"),
        (values_mla_twice, "MLA counted twice"),
        (values_mla_without_rope, "RoPE key is missing"),
        (values_mla_rope_per_head, "shared by all heads"),
        (values_gqa_query_heads, "GQA with the query heads"),
        (values_in_bytes, "you counted bytes"),
        (values_as_float, "expected an int"),
    ],
    "mla_absorbed_scores": [
        (mla_scaled, "divided by sqrt(d_h)"),
        (mla_scaled_by_latent, "divided by sqrt(d_c)"),
        (mla_first_head_only, "head 0's projection"),
        (mla_forms_keys, "formed the per-head keys"),
        (mla_forms_keys_einsum, "formed the per-head keys"),
        (mla_forms_keys_per_head, "formed the per-head keys"),
        (mla_forms_keys_flat, "formed the per-head keys"),
        (mla_forms_keys_per_token, "formed the per-head keys"),
        (mla_forms_keys_broadcast, "formed the per-head keys"),
        (mla_three_operand_einsum, "formed the per-head keys"),
    ],
}
