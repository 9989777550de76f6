"""Properties of the multi-head references (helpers/nb05_multihead.py) and the checks of exercises
5.1-5.3 accepting correct solutions written in other styles."""

import math

import pytest
import torch
import torch.nn.functional as F

from helpers import checks, reference
from helpers import nb05_multihead as multihead
from helpers.configs import MODELS
from helpers.nb01_qkv_shapes import merge_heads, qkv_projection, scaled_dot_product_attention


def _layer(B=2, T=5, D=12, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, T, D, generator=g, dtype=dtype), torch.randn(D, 3 * D, generator=g, dtype=dtype) / math.sqrt(D),
            torch.randn(D, D, generator=g, dtype=dtype) / math.sqrt(D))


def test_all_lists_exactly_the_graded_functions():
    assert multihead.__all__ == ["multi_head_attention", "mha_param_count", "ablate_head"]
    for name in multihead.__all__:
        assert getattr(reference, name) is getattr(multihead, name)


@pytest.mark.parametrize("causal", [False, True])
def test_mha_equals_torch_multihead_attention(causal):
    x, w_qkv, w_o = _layer()
    D, H, T = 12, 3, 5
    mha = torch.nn.MultiheadAttention(D, H, bias=False, batch_first=True, dtype=torch.float64)
    with torch.no_grad():
        mha.in_proj_weight.copy_(w_qkv.T)      # nn.Linear layout: [3D, D], rows Q, K, V
        mha.out_proj.weight.copy_(w_o.T)
    blocked = ~torch.ones(T, T, dtype=torch.bool).tril() if causal else None  # True = may NOT attend
    ours = multihead.multi_head_attention(x, w_qkv, w_o, H, causal)
    theirs, _ = mha(x, x, x, attn_mask=blocked, need_weights=False)
    torch.testing.assert_close(ours, theirs)


def test_mha_equals_concatenated_single_heads():
    x, w_qkv, w_o = _layer()
    D, H = 12, 3
    d_k = D // H
    wq, wk, wv = w_qkv.split(D, dim=1)
    heads = [scaled_dot_product_attention(x @ wq[:, h * d_k:(h + 1) * d_k], x @ wk[:, h * d_k:(h + 1) * d_k],
                                          x @ wv[:, h * d_k:(h + 1) * d_k]) for h in range(H)]
    torch.testing.assert_close(torch.cat(heads, dim=-1) @ w_o, multihead.multi_head_attention(x, w_qkv, w_o, H))


def test_head_contributions_sum_to_the_output():
    x, w_qkv, w_o = _layer()
    parts = multihead.head_contributions(x, w_qkv, w_o, 3, causal=True)
    assert parts.shape == (2, 3, 5, 12)
    torch.testing.assert_close(parts.sum(dim=1), multihead.multi_head_attention(x, w_qkv, w_o, 3, True))
    # ablating head h removes exactly its contribution
    torch.testing.assert_close(multihead.ablate_head(x, w_qkv, w_o, 3, 1, True), parts.sum(1) - parts[:, 1])


def test_param_counts_of_real_models():
    assert multihead.mha_param_count(768, 12, bias=True) == 2_362_368          # GPT-2 small
    assert multihead.mha_param_count(512, 8) == 4 * 512**2 == 1_048_576         # the original Transformer
    m = torch.nn.MultiheadAttention(768, 12, bias=True)
    assert sum(p.numel() for p in m.parameters()) == 2_362_368
    cfg = MODELS["GPT-2 small"]
    assert multihead.mha_param_count(cfg.d_model, cfg.n_heads, True) == 2_362_368
    with pytest.raises(ValueError):
        multihead.mha_param_count(10, 3)


def test_ablate_rejects_a_head_out_of_range():
    x, w_qkv, w_o = _layer()
    with pytest.raises(ValueError, match="head must be in 0..2"):
        multihead.ablate_head(x, w_qkv, w_o, 3, 3)


# ----------------------------------------------------------------- correct variants the checks accept
def mha_einsum(x, w_qkv, w_o, n_heads, causal=False):
    B, T, D = x.shape
    d_k = D // n_heads
    q, k, v = (t.reshape(B, T, n_heads, d_k) for t in torch.einsum("btd,de->bte", x, w_qkv).chunk(3, dim=-1))
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / d_k**0.5
    if causal:
        s = s + torch.triu(torch.full((T, T), -1e9, dtype=x.dtype), diagonal=1)  # -1e9: fine in fp32/fp64
    o = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v).reshape(B, T, D)
    return torch.einsum("btd,de->bte", o, w_o)


def mha_sdpa(x, w_qkv, w_o, n_heads, causal=False):
    q, k, v = qkv_projection(x, w_qkv, n_heads)
    return merge_heads(F.scaled_dot_product_attention(q, k, v, is_causal=causal)) @ w_o


def mha_loop_float64(x, w_qkv, w_o, n_heads, causal=False):
    B, T, D = x.shape
    d_k = D // n_heads
    x64, w64 = x.double(), w_qkv.double()
    outs = []
    for h in range(n_heads):
        cols = slice(h * d_k, (h + 1) * d_k)
        q, k, v = x64 @ w64[:, cols], x64 @ w64[:, D:][:, cols], x64 @ w64[:, 2 * D:][:, cols]
        s = q @ k.transpose(1, 2) / math.sqrt(d_k)
        if causal:
            s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        outs.append(torch.softmax(s, -1) @ v)
    return (torch.cat(outs, -1) @ w_o.double()).to(x.dtype)


def mha_torch_module(x, w_qkv, w_o, n_heads, causal=False):
    B, T, D = x.shape
    m = torch.nn.MultiheadAttention(D, n_heads, bias=False, batch_first=True, dtype=x.dtype)
    with torch.no_grad():
        m.in_proj_weight.copy_(w_qkv.T)
        m.out_proj.weight.copy_(w_o.T)
    mask = torch.ones(T, T, dtype=torch.bool).triu(1) if causal else None
    return m(x, x, x, attn_mask=mask, need_weights=False)[0].detach()


@pytest.mark.parametrize("fn", [mha_einsum, mha_sdpa, mha_loop_float64, mha_torch_module])
def test_mha_check_accepts_other_correct_forms(fn, capsys):
    checks.multi_head_attention(fn)
    assert "✓ 5.1" in capsys.readouterr().out


def count_by_modules(d_model, n_heads, bias=False):
    return sum(p.numel() for p in torch.nn.MultiheadAttention(d_model, n_heads, bias=bias).parameters())


def count_per_head(d_model, n_heads, bias=False):
    d_k = d_model // n_heads
    per_head = 3 * (d_model * d_k + (d_k if bias else 0))        # one head's W_Q, W_K, W_V columns
    return n_heads * per_head + d_model * d_model + (d_model if bias else 0)


@pytest.mark.parametrize("fn", [count_by_modules, count_per_head])
def test_param_count_check_accepts_other_correct_forms(fn, capsys):
    checks.mha_param_count(fn)
    assert "✓ 5.2" in capsys.readouterr().out


def ablate_by_w_o_rows(x, w_qkv, w_o, n_heads, head, causal=False):
    d_k = x.shape[-1] // n_heads
    w = w_o.clone()
    w[head * d_k:(head + 1) * d_k] = 0
    return multihead.multi_head_attention(x, w_qkv, w, n_heads, causal)


def ablate_by_subtraction(x, w_qkv, w_o, n_heads, head, causal=False):
    q, k, v = qkv_projection(x, w_qkv, n_heads)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    d_k = o.shape[-1]
    return merge_heads(o) @ w_o - o[:, head] @ w_o[head * d_k:(head + 1) * d_k]


def ablate_by_value_zero(x, w_qkv, w_o, n_heads, head, causal=False):
    q, k, v = qkv_projection(x, w_qkv, n_heads)
    v = v.clone()
    v[:, head] = 0                                               # zero values: the head outputs 0
    return merge_heads(F.scaled_dot_product_attention(q, k, v, is_causal=causal)) @ w_o


@pytest.mark.parametrize("fn", [ablate_by_w_o_rows, ablate_by_subtraction, ablate_by_value_zero])
def test_ablate_check_accepts_other_correct_forms(fn, capsys):
    checks.ablate_head(fn)
    assert "✓ 5.3" in capsys.readouterr().out
