"""Properties of the key/value sharing references (helpers/nb06_kv_sharing.py) and the checks of
exercises 6.1-6.4 accepting correct solutions written in other styles."""

import math

import pytest
import torch
import torch.nn.functional as F

from helpers import checks, reference
from helpers import nb06_kv_sharing as kv_sharing
from helpers.configs import MODELS


def _qkv(B, H, H_kv, T, d, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, T, d, generator=g, dtype=dtype), torch.randn(B, H_kv, T, d, generator=g, dtype=dtype),
            torch.randn(B, H_kv, T, d, generator=g, dtype=dtype))


def test_all_lists_exactly_the_graded_functions():
    assert kv_sharing.__all__ == ["repeat_kv", "grouped_query_attention", "kv_values_per_token", "mla_absorbed_scores"]
    for name in kv_sharing.__all__:
        assert getattr(reference, name) is getattr(kv_sharing, name)


def test_repeat_kv_interleaves_and_expand_is_a_view():
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


# ----------------------------------------------------------------- correct variants the checks accept
def repeat_kv_interleave(x, n_rep):
    return torch.repeat_interleave(x, n_rep, dim=1)


def repeat_kv_index(x, n_rep):
    return x[:, torch.arange(x.shape[1] * n_rep) // n_rep]


def repeat_kv_loop(x, n_rep):
    return torch.cat([x[:, h:h + 1] for h in range(x.shape[1]) for _ in range(n_rep)], dim=1)


def repeat_kv_stack(x, n_rep):
    return torch.stack([x] * n_rep, dim=2).flatten(1, 2)


@pytest.mark.parametrize("fn", [repeat_kv_interleave, repeat_kv_index, repeat_kv_loop, repeat_kv_stack])
def test_repeat_kv_check_accepts_other_correct_forms(fn, capsys):
    checks.repeat_kv(fn)
    assert "✓ 6.1" in capsys.readouterr().out


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


@pytest.mark.parametrize("fn", [gqa_sdpa, gqa_grouped_einsum, gqa_loop_float64])
def test_gqa_check_accepts_other_correct_forms(fn, capsys):
    checks.grouped_query_attention(fn)
    assert "✓ 6.2" in capsys.readouterr().out


def values_with_a_table(kind, n_heads, n_kv_heads, head_dim, kv_lora_rank, rope_dim):
    kv_heads = {"mha": n_heads, "gqa": n_kv_heads, "mqa": 1}
    return kv_lora_rank + rope_dim if kind == "mla" else 2 * kv_heads[kind] * head_dim


def values_upper_case_ok(kind, n_heads, n_kv_heads, head_dim, kv_lora_rank, rope_dim):
    kind = kind.upper()
    if kind == "MLA":
        return int(kv_lora_rank + rope_dim)
    h = n_heads if kind == "MHA" else (1 if kind == "MQA" else n_kv_heads)
    return int(2 * h * head_dim)


@pytest.mark.parametrize("fn", [values_with_a_table, values_upper_case_ok])
def test_values_check_accepts_other_correct_forms(fn, capsys):
    checks.kv_values_per_token(fn)
    assert "✓ 6.3" in capsys.readouterr().out


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


@pytest.mark.parametrize("fn", [mla_einsum, mla_three_operand_einsum_absorbed_order, mla_loop_over_heads_float64,
                                mla_matmul_broadcast])
def test_mla_check_accepts_other_correct_forms(fn, capsys):
    checks.mla_absorbed_scores(fn)
    assert "✓ 6.4" in capsys.readouterr().out
