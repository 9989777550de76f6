"""Notebook 06, sharing keys and values (helpers/nb06_kv_sharing.py): properties of the lesson code,
then exercises 6.1-6.4: learner-style wrong implementations their checks must reject, with the hint
each must give (WRONG), and correct ones in other styles they must accept (RIGHT)."""

import math

import pytest
import torch
import torch.nn.functional as F

from helpers import nb06_kv_sharing as kv_sharing
from helpers.configs import MODELS
from tests.exercise_cases import assert_accepted, assert_rejected, right_cases, wrong_cases

# ============================================================ the lesson code

def _qkv(B, H, H_kv, T, d, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, T, d, generator=g, dtype=dtype), torch.randn(B, H_kv, T, d, generator=g, dtype=dtype),
            torch.randn(B, H_kv, T, d, generator=g, dtype=dtype))


def test_repeat_kv_groups_consecutive_heads_and_expand_is_a_view():
    x = torch.arange(3).view(1, 3, 1, 1).float()
    assert kv_sharing.repeat_kv(x, 2).flatten().tolist() == [0, 0, 1, 1, 2, 2]
    assert x.repeat(1, 2, 1, 1).flatten().tolist() == [0, 1, 2, 0, 1, 2]        # the tiling bug
    assert kv_sharing.repeat_kv(x, 1) is x
    assert x[:, :, None].expand(1, 3, 4, 1, 1).untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert kv_sharing.kv_group_of(6, 2) == [0, 0, 0, 1, 1, 1]


@pytest.mark.parametrize("H, H_kv", [(6, 2), (4, 1), (3, 3)])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_equals_sdpa_enable_gqa(H, H_kv, causal):
    q, k, v = _qkv(2, H, H_kv, 5, 4)
    torch.testing.assert_close(kv_sharing.grouped_query_attention(q, k, v, causal),
                               F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True))


def test_gqa_causal_with_fewer_queries_is_bottom_right():
    q, k, v = _qkv(1, 4, 2, 6, 3)
    full = kv_sharing.grouped_query_attention(q, k, v, causal=True)
    torch.testing.assert_close(kv_sharing.grouped_query_attention(q[:, :, -2:], k, v, causal=True), full[:, :, -2:])
    with pytest.raises(ValueError, match="multiple"):
        kv_sharing.grouped_query_attention(q, torch.cat([k, k[:, :1]], 1), torch.cat([v, v[:, :1]], 1))


def test_gqa_runs_through_the_course_triton_kernel():
    from helpers.nb09_triton_flash import flash_attention_triton

    q, k, v = _qkv(1, 4, 2, 20, 16, dtype=torch.float32)
    torch.testing.assert_close(flash_attention_triton(q, k, v, causal=True),
                               kv_sharing.grouped_query_attention(q, k, v, True), atol=1e-4, rtol=1e-4)


def test_values_per_token_of_the_dimensions_appendix():
    ds = MODELS["DeepSeek-V3"]
    mha = kv_sharing.kv_values_per_token("mha", ds.n_heads, ds.n_heads, ds.head_dim)
    mla = kv_sharing.config_values_per_token(ds)
    assert (mha, mla) == (32_768, 576) and round(mha / mla, 1) == 56.9
    assert kv_sharing.config_values_per_token(MODELS["Llama-4-Maverick"]) == 2 * 8 * 128
    assert kv_sharing.config_values_per_token(MODELS["Falcon-7B"]) == 128
    with pytest.raises(ValueError, match="kind must be one of"):
        kv_sharing.kv_values_per_token("mqa2", 8, 1, 64)


@pytest.mark.parametrize("causal", [False, True])
def test_mla_absorbed_layer_equals_the_naive_one(causal):
    g = torch.Generator().manual_seed(0)
    w = kv_sharing.mla_init(24, 3, 8, 6, 4, g, dtype=torch.float64)
    x = torch.randn(2, 7, 24, generator=g, dtype=torch.float64)
    torch.testing.assert_close(kv_sharing.mla_attention(x, w, causal, absorbed=True),
                               kv_sharing.mla_attention(x, w, causal, absorbed=False))


def test_mla_absorbed_scores_equal_per_head_keys():
    g = torch.Generator().manual_seed(1)
    q, c, w = torch.randn(2, 3, 5, 4, generator=g), torch.randn(2, 7, 6, generator=g), torch.randn(3, 6, 4, generator=g)
    k = torch.einsum("btc,hcd->bhtd", c, w)
    torch.testing.assert_close(kv_sharing.mla_absorbed_scores(q, c, w), q @ k.transpose(-2, -1))


def test_mla_decode_costs_count_what_flop_counter_counts():
    from torch.utils.flop_counter import FlopCounterMode

    H, d_h, d_c, d_r, T = 3, 8, 6, 4, 11
    g = torch.Generator().manual_seed(2)
    q, q_r = torch.randn(1, H, 1, d_h, generator=g), torch.randn(1, H, 1, d_r, generator=g)
    c, k_r = torch.randn(1, T, d_c, generator=g), torch.randn(1, T, d_r, generator=g)
    w_uk, w_uv = torch.randn(H, d_c, d_h, generator=g), torch.randn(H, d_c, d_h, generator=g)
    p = torch.softmax(torch.randn(1, H, 1, T, generator=g), -1)
    with FlopCounterMode(display=False) as naive:
        k, v = c.unsqueeze(1) @ w_uk, c.unsqueeze(1) @ w_uv
        q @ k.transpose(-2, -1), q_r @ k_r.unsqueeze(1).transpose(-2, -1), p @ v
    with FlopCounterMode(display=False) as absorbed:
        q_lat = q @ w_uk.transpose(-2, -1)
        q_lat @ c.unsqueeze(1).transpose(-2, -1), q_r @ k_r.unsqueeze(1).transpose(-2, -1)
        (p @ c.unsqueeze(1)) @ w_uv
    assert naive.get_total_flops() == kv_sharing.mla_decode_costs(H, d_h, d_c, d_r, T, absorbed=False)["flops"]
    assert absorbed.get_total_flops() == kv_sharing.mla_decode_costs(H, d_h, d_c, d_r, T, absorbed=True)["flops"]


def test_mla_decode_costs_batch_shares_the_weights_and_tends_to_the_limit():
    H, d_h, d_c, d_r = 128, 128, 512, 64                                 # DeepSeek-V3
    one = kv_sharing.mla_decode_costs(H, d_h, d_c, d_r, 4096, absorbed=True)
    four = kv_sharing.mla_decode_costs(H, d_h, d_c, d_r, 4096, absorbed=True, batch=4)
    weights = 2 * (2 * H * d_c * d_h)
    assert four["flops"] == 4 * one["flops"] and four["bytes"] - weights == 4 * (one["bytes"] - weights)
    limit = kv_sharing.mla_decode_intensity_limit(H, d_c, d_r)
    assert limit == H * (2 * d_c + d_r) / (d_c + d_r) and round(limit) == 242
    assert kv_sharing.mla_decode_intensity_limit(H, d_c, d_r, n_queries=2) == 2 * limit
    costs = {T: kv_sharing.mla_decode_costs(H, d_h, d_c, d_r, T, absorbed=True) for T in (2**15, 2**17, 2**22)}
    ratios = [c["flops"] / c["bytes"] for c in costs.values()]
    assert ratios == sorted(ratios) and round(ratios[1]) == 198 and 0.99 * limit < ratios[-1] < limit
    two = kv_sharing.mla_decode_costs(H, d_h, d_c, d_r, 2**17, absorbed=True, n_queries=2)
    assert two["flops"] == 2 * costs[2**17]["flops"] and two["bytes"] == costs[2**17]["bytes"]

# ============================================================ 6.1 repeat_kv

# wrong: what a learner might write
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


# right: other styles than the reference
def repeat_kv_repeat_interleave(x, n_rep):
    return torch.repeat_interleave(x, n_rep, dim=1)


def repeat_kv_index(x, n_rep):
    return x[:, torch.arange(x.shape[1] * n_rep) // n_rep]


def repeat_kv_loop(x, n_rep):
    return torch.cat([x[:, h:h + 1] for h in range(x.shape[1]) for _ in range(n_rep)], dim=1)


def repeat_kv_stack(x, n_rep):
    return torch.stack([x] * n_rep, dim=2).flatten(1, 2)


# ============================================================ 6.2 grouped_query_attention

# wrong: what a learner might write
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


# right: other styles than the reference
def gqa_sdpa(q, k, v, causal=False):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


def gqa_grouped_einsum(q, k, v, causal=False):
    B, H, T, d = q.shape
    H_kv = k.shape[1]
    qg = q.view(B, H_kv, H // H_kv, T, d)                      # group the query heads, no copy of k, v
    s = torch.einsum("bgrqd,bgkd->bgrqk", qg, k) / math.sqrt(d)
    if causal:
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -1e9)
    return torch.einsum("bgrqk,bgkd->bgrqd", s.softmax(-1), v).reshape(B, H, T, d)


def gqa_loop_float64(q, k, v, causal=False):
    H, H_kv, T = q.shape[1], k.shape[1], q.shape[2]
    outs = []
    for h in range(H):
        kh, vh = k[:, h * H_kv // H].double(), v[:, h * H_kv // H].double()
        s = q[:, h].double() @ kh.transpose(-2, -1) / math.sqrt(q.shape[-1])
        if causal:
            s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        outs.append(torch.softmax(s, -1) @ vh)
    return torch.stack(outs, 1).to(q.dtype)


# ============================================================ 6.3 kv_values_per_token

# wrong: what a learner might write
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


# right: other styles than the reference
def values_with_a_table(kind, n_heads, n_kv_heads, head_dim, kv_lora_rank, rope_dim):
    kv_heads = {"mha": n_heads, "gqa": n_kv_heads, "mqa": 1}
    return kv_lora_rank + rope_dim if kind == "mla" else 2 * kv_heads[kind] * head_dim


def values_upper_case_ok(kind, n_heads, n_kv_heads, head_dim, kv_lora_rank, rope_dim):
    kind = kind.upper()
    if kind == "MLA":
        return int(kv_lora_rank + rope_dim)
    h = n_heads if kind == "MHA" else (1 if kind == "MQA" else n_kv_heads)
    return int(2 * h * head_dim)


# ============================================================ 6.4 mla_absorbed_scores

# wrong: what a learner might write
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


# right: other styles than the reference
def mla_einsum(q, c_kv, w_uk):
    return torch.einsum("bhqc,btc->bhqt", torch.einsum("bhqd,hcd->bhqc", q, w_uk), c_kv)


def mla_three_operand_einsum_absorbed_order(q, c_kv, w_uk):
    return torch.einsum("bhqd,hcd,btc->bhqt", q, w_uk, c_kv)   # left to right: q with w_uk first


def mla_loop_over_heads_float64(q, c_kv, w_uk):
    out = []
    for h in range(q.shape[1]):
        q_lat = q[:, h].double() @ w_uk[h].double().T          # [B, T_q, d_c]
        out.append(q_lat @ c_kv.double().transpose(1, 2))
    return torch.stack(out, 1).to(q.dtype)


def mla_matmul_broadcast(q, c_kv, w_uk):
    return torch.matmul(torch.matmul(q, w_uk.mT), c_kv[:, None].mT)


# ============================================================ the exercises' cases

def repeat_kv_one_copy_short(x, n_rep):
    return x.repeat_interleave(n_rep - 1, dim=1)  # "n_rep more copies"


def repeat_kv_along_d(x, n_rep):
    B, H_kv, T, d = x.shape
    return x.repeat_interleave(n_rep, dim=-1).reshape(B, H_kv * n_rep, T, d)


def gqa_hides_diagonal(q, k, v, causal=False):
    n_rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        T = s.shape[-1]
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(-1), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def gqa_last_kv_head(q, k, v, causal=False):
    return _attend(q, k[:, -1:], v[:, -1:], causal)


def gqa_scale_all_kv_heads(q, k, v, causal=False):
    n_rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    s = q @ k.transpose(-2, -1) / math.sqrt(k.shape[1] // n_rep * q.shape[-1])
    if causal:
        T = s.shape[-1]
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def values_mla_latent_per_head(kind, n_heads, n_kv_heads, head_dim, kv_lora_rank, rope_dim):
    if kind == "mla":
        return n_heads * kv_lora_rank + rope_dim
    return 2 * {"mha": n_heads, "gqa": n_kv_heads, "mqa": 1}[kind] * head_dim


def mla_heads_reversed(q, c_kv, w_uk):
    return (q @ w_uk.flip(0).transpose(-2, -1)) @ c_kv.unsqueeze(1).transpose(-2, -1)


def mla_scores_transposed(q, c_kv, w_uk):
    return c_kv.unsqueeze(1) @ (q @ w_uk.transpose(-2, -1)).transpose(-2, -1)  # [B, H, T, T_q]


def repeat_kv_tokens_then_reshape(x, n_rep):
    B, H_kv, T, d = x.shape
    return torch.stack([x] * n_rep, dim=3).reshape(B, H_kv * n_rep, T, d)  # copies after T, not after H_kv


def gqa_heads_folded_into_tokens(q, k, v, causal=False):
    B, H, T, d = q.shape
    H_kv = k.shape[1]
    s = torch.einsum("bgqd,bgkd->bgqk", q.reshape(B, H_kv, H // H_kv * T, d), k) / math.sqrt(d)
    if causal:
        rows = torch.arange(s.shape[-2])[:, None]  # the folded row index, used as the query position
        s = s.masked_fill(torch.arange(T)[None, :] > rows, float("-inf"))
    return (s.softmax(-1) @ v).reshape(B, H, T, d)


def gqa_group_mean_query(q, k, v, causal=False):
    B, H, T, d = q.shape
    n_rep = H // k.shape[1]
    q_mean = torch.stack([q[:, g * n_rep:(g + 1) * n_rep].mean(1) for g in range(k.shape[1])], dim=1)
    out = F.scaled_dot_product_attention(q_mean, k, v, is_causal=causal)
    return torch.cat([out[:, g:g + 1].expand(B, n_rep, T, d) for g in range(k.shape[1])], dim=1)


def values_mqa_with_n_kv_heads(kind, n_heads, n_kv_heads, head_dim, kv_lora_rank, rope_dim):
    if kind == "mla":
        return kv_lora_rank + rope_dim
    return 2 * (n_heads if kind == "mha" else n_kv_heads) * head_dim  # MQA "has n_kv_heads = 1 anyway"


def values_mha_with_n_kv_heads(kind, n_heads, n_kv_heads, head_dim, kv_lora_rank, rope_dim):
    per_kind = {"mha": 2 * n_kv_heads * head_dim, "gqa": 2 * n_kv_heads * head_dim, "mqa": 2 * head_dim,
                "mla": kv_lora_rank + rope_dim}
    return per_kind[kind]


# right: another style, reading only the arguments each kind uses
def values_match_statement(kind, n_heads, n_kv_heads, head_dim, kv_lora_rank, rope_dim):
    match kind:
        case "mla":
            return kv_lora_rank + rope_dim
        case "mqa":
            return head_dim + head_dim
        case "gqa":
            return n_kv_heads * head_dim * 2
        case _:
            return n_heads * head_dim * 2


WRONG = {
    "repeat_kv": [
        (repeat_kv_tiles, "you tiled the heads"),
        (repeat_kv_tiles_with_cat, "you tiled the heads"),
        (repeat_kv_sequence_axis, "sequence axis"),
        (repeat_kv_no_reshape, "5-D view"),
        (repeat_kv_float32, "expected dtype torch.float64"),
        (repeat_kv_one_copy_short, "n_rep - 1 copies"),
        (repeat_kv_along_d, "along the last axis (d)"),
        (repeat_kv_tokens_then_reshape, "repeats each token's row n_rep times in a row"),
    ],
    "grouped_query_attention": [
        (gqa_tiled_heads, "are tiled"),
        (gqa_one_kv_head, "read kv head 0"),
        (gqa_ignores_causal, "causal=True was ignored"),
        (gqa_always_causal, "causal=False here"),
        (gqa_no_repeat, "repeat each kv head"),
        (gqa_no_scale, "not scaled"),
        (gqa_hides_diagonal, "also hides the diagonal"),
        (gqa_last_kv_head, "read the last kv head"),
        (gqa_scale_all_kv_heads, "1/sqrt(H_kv * d)"),
        (gqa_heads_folded_into_tokens, "only the first is causally masked"),
        (gqa_group_mean_query, "the attention of the group's mean query"),
    ],
    "kv_values_per_token": [
        (values_keys_only, "keys only"),
        (values_mla_twice, "MLA counted twice"),
        (values_mla_without_rope, "RoPE key is missing"),
        (values_mla_rope_per_head, "shared by all heads"),
        (values_gqa_query_heads, "GQA with the query heads"),
        (values_in_bytes, "you counted bytes"),
        (values_as_float, "expected an int"),
        (values_mla_latent_per_head, "a latent per head"),
        (values_mqa_with_n_kv_heads, "your MQA count is 2 * n_kv_heads * head_dim"),
        (values_mha_with_n_kv_heads, "your MHA count is 2 * n_kv_heads * head_dim"),
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
        (mla_heads_reversed, "w_uk[H - 1 - h]"),
        (mla_scores_transposed, "[B, H, T, T_q], the transpose"),
    ],
}


RIGHT = {
    "repeat_kv": [repeat_kv_repeat_interleave, repeat_kv_index, repeat_kv_loop, repeat_kv_stack],
    "grouped_query_attention": [gqa_sdpa, gqa_grouped_einsum, gqa_loop_float64],
    "kv_values_per_token": [values_with_a_table, values_upper_case_ok, values_match_statement],
    "mla_absorbed_scores": [mla_einsum, mla_three_operand_einsum_absorbed_order, mla_loop_over_heads_float64,
                            mla_matmul_broadcast],
}


@pytest.mark.parametrize(("name", "wrong", "hint"), wrong_cases(WRONG))
def test_check_rejects_wrong(name, wrong, hint):
    assert_rejected(name, wrong, hint)


@pytest.mark.parametrize(("name", "right"), right_cases(RIGHT))
def test_check_accepts_right(name, right):
    assert_accepted(name, right)
