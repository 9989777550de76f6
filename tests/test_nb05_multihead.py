"""Notebook 05, multi-head attention (helpers/nb05_multihead.py): properties of the lesson code,
then exercises 5.1-5.3: learner-style wrong implementations their checks must reject, with the hint
each must give (WRONG), and correct ones in other styles they must accept (RIGHT)."""

import math

import pytest
import torch
import torch.nn.functional as F

from helpers import nb05_multihead as multihead
from helpers.configs import MODELS
from helpers.nb01_qkv_shapes import merge_heads, qkv_projection, scaled_dot_product_attention
from tests.exercise_cases import assert_accepted, assert_rejected, right_cases, wrong_cases

# ============================================================ the lesson code

def _layer(B=2, T=5, D=12, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, T, D, generator=g, dtype=dtype), torch.randn(D, 3 * D, generator=g, dtype=dtype) / math.sqrt(D),
            torch.randn(D, D, generator=g, dtype=dtype) / math.sqrt(D))


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


# ============================================================ 5.1 multi_head_attention

# wrong: what a learner might write
def _heads(x, w_qkv, n_heads):
    B, T, D = x.shape
    q, k, v = (x @ w_qkv).split(D, dim=-1)
    return tuple(t.view(B, T, n_heads, D // n_heads).transpose(1, 2) for t in (q, k, v))


def _attend(q, k, v, causal, scale):
    s = q @ k.transpose(-2, -1) / scale
    if causal:
        T = s.shape[-1]
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def mha_split_without_transpose(x, w_qkv, w_o, n_heads, causal=False):
    B, T, D = x.shape
    q, k, v = (t.reshape(B, n_heads, T, D // n_heads) for t in (x @ w_qkv).split(D, dim=-1))
    o = _attend(q, k, v, causal, math.sqrt(D // n_heads))
    return o.transpose(1, 2).reshape(B, T, D) @ w_o


def mha_merge_without_transpose(x, w_qkv, w_o, n_heads, causal=False):
    B, T, D = x.shape
    q, k, v = _heads(x, w_qkv, n_heads)
    o = _attend(q, k, v, causal, math.sqrt(D // n_heads))
    return o.reshape(B, T, D) @ w_o


def mha_scale_by_d_model(x, w_qkv, w_o, n_heads, causal=False):
    B, T, D = x.shape
    q, k, v = _heads(x, w_qkv, n_heads)
    o = _attend(q, k, v, causal, math.sqrt(D))
    return o.transpose(1, 2).reshape(B, T, D) @ w_o


def mha_w_o_transposed(x, w_qkv, w_o, n_heads, causal=False):
    B, T, D = x.shape
    q, k, v = _heads(x, w_qkv, n_heads)
    o = _attend(q, k, v, causal, math.sqrt(D // n_heads))
    return o.transpose(1, 2).reshape(B, T, D) @ w_o.T


def mha_linear_style_w_o(x, w_qkv, w_o, n_heads, causal=False):
    # F.linear(input, weight) computes input @ weight.T: the nn.Linear convention, not this contract.
    B, T, D = x.shape
    q, k, v = _heads(x, w_qkv, n_heads)
    o = _attend(q, k, v, causal, math.sqrt(D // n_heads))
    return torch.nn.functional.linear(o.transpose(1, 2).reshape(B, T, D), w_o)


def mha_ignores_causal(x, w_qkv, w_o, n_heads, causal=False):
    B, T, D = x.shape
    q, k, v = _heads(x, w_qkv, n_heads)
    o = _attend(q, k, v, False, math.sqrt(D // n_heads))
    return o.transpose(1, 2).reshape(B, T, D) @ w_o


def mha_always_causal(x, w_qkv, w_o, n_heads, causal=False):
    B, T, D = x.shape
    q, k, v = _heads(x, w_qkv, n_heads)
    o = _attend(q, k, v, True, math.sqrt(D // n_heads))
    return o.transpose(1, 2).reshape(B, T, D) @ w_o


def mha_no_w_o(x, w_qkv, w_o, n_heads, causal=False):
    B, T, D = x.shape
    q, k, v = _heads(x, w_qkv, n_heads)
    return _attend(q, k, v, causal, math.sqrt(D // n_heads)).transpose(1, 2).reshape(B, T, D)


def mha_returns_heads(x, w_qkv, w_o, n_heads, causal=False):
    B, T, D = x.shape
    q, k, v = _heads(x, w_qkv, n_heads)
    return _attend(q, k, v, causal, math.sqrt(D // n_heads))  # [B, H, T, d_k]: merge and W_O missing


def mha_float32_inside(x, w_qkv, w_o, n_heads, causal=False):
    B, T, D = x.shape
    x, w_qkv, w_o = x.float(), w_qkv.float(), w_o.float()  # float64 inputs come back as float32
    q, k, v = _heads(x, w_qkv, n_heads)
    return _attend(q, k, v, causal, math.sqrt(D // n_heads)).transpose(1, 2).reshape(B, T, D) @ w_o


# right: other styles than the reference
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


def mha_causal_off_by_one(x, w_qkv, w_o, n_heads, causal=False):
    B, T, D = x.shape
    q, k, v = _heads(x, w_qkv, n_heads)
    s = q @ k.transpose(-2, -1) / math.sqrt(D // n_heads)
    if causal:
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(diagonal=1), float("-inf"))
    return (torch.softmax(s, dim=-1) @ v).transpose(1, 2).reshape(B, T, D) @ w_o


def mha_mask_inverted(x, w_qkv, w_o, n_heads, causal=False):
    B, T, D = x.shape
    q, k, v = _heads(x, w_qkv, n_heads)
    s = q @ k.transpose(-2, -1) / math.sqrt(D // n_heads)
    if causal:
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).triu(), float("-inf"))
    return (torch.softmax(s, dim=-1) @ v).transpose(1, 2).reshape(B, T, D) @ w_o


def mha_softmax_over_queries(x, w_qkv, w_o, n_heads, causal=False):
    B, T, D = x.shape
    q, k, v = _heads(x, w_qkv, n_heads)
    s = q @ k.transpose(-2, -1) / math.sqrt(D // n_heads)
    if causal:
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return (torch.softmax(s, dim=-2) @ v).transpose(1, 2).reshape(B, T, D) @ w_o


def mha_qkv_grouped_per_head(x, w_qkv, w_o, n_heads, causal=False):
    B, T, D = x.shape
    qkv = (x @ w_qkv).view(B, T, n_heads, 3, D // n_heads)  # as if the columns were [q_h, k_h, v_h] per head
    q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))
    o = _attend(q, k, v, causal, math.sqrt(D // n_heads))
    return o.transpose(1, 2).reshape(B, T, D) @ w_o


def mha_heads_split_dk_first(x, w_qkv, w_o, n_heads, causal=False):
    B, T, D = x.shape
    q, k, v = (t.view(B, T, D // n_heads, n_heads).permute(0, 3, 1, 2) for t in (x @ w_qkv).split(D, dim=-1))
    o = _attend(q, k, v, causal, math.sqrt(D // n_heads))
    return o.transpose(1, 2).reshape(B, T, D) @ w_o


# ============================================================ 5.2 mha_param_count

# wrong: what a learner might write
def count_bias_head_wide(d_model, n_heads, bias=False):
    return 4 * d_model**2 + (4 * (d_model // n_heads) if bias else 0)  # a bias as wide as one head


def count_square_per_head(d_model, n_heads, bias=False):
    return n_heads * 4 * d_model**2 + (4 * d_model if bias else 0)  # a D x D matrix for every head


def count_without_w_o(d_model, n_heads, bias=False):
    return 3 * d_model**2 + (3 * d_model if bias else 0)


def count_ignores_bias(d_model, n_heads, bias=False):
    return 4 * d_model**2


def count_one_bias(d_model, n_heads, bias=False):
    return 4 * d_model**2 + (d_model if bias else 0)


def count_three_biases(d_model, n_heads, bias=False):
    return 4 * d_model**2 + (3 * d_model if bias else 0)


def count_bias_per_head(d_model, n_heads, bias=False):
    return 4 * d_model**2 + (4 * n_heads * d_model if bias else 0)


def count_bias_always(d_model, n_heads, bias=False):
    return 4 * d_model**2 + 4 * d_model


def count_per_head_square(d_model, n_heads, bias=False):
    d_k = d_model // n_heads
    return 4 * n_heads * d_k * d_k + (4 * d_model if bias else 0)


def count_one_head(d_model, n_heads, bias=False):
    d_k = d_model // n_heads
    return 4 * d_model * d_k + (4 * d_k if bias else 0)


def count_as_float(d_model, n_heads, bias=False):
    return 4.0 * d_model**2 + (4.0 * d_model if bias else 0.0)


# right: other styles than the reference
def count_by_modules(d_model, n_heads, bias=False):
    return sum(p.numel() for p in torch.nn.MultiheadAttention(d_model, n_heads, bias=bias).parameters())


def count_per_head(d_model, n_heads, bias=False):
    d_k = d_model // n_heads
    per_head = 3 * (d_model * d_k + (d_k if bias else 0))        # one head's W_Q, W_K, W_V columns
    return n_heads * per_head + d_model * d_model + (d_model if bias else 0)


# ============================================================ 5.3 ablate_head

# wrong: what a learner might write
def _outputs(x, w_qkv, n_heads, causal):
    B, T, D = x.shape
    q, k, v = _heads(x, w_qkv, n_heads)
    return _attend(q, k, v, causal, math.sqrt(D // n_heads))


def _merge(o):
    B, H, T, d_k = o.shape
    return o.transpose(1, 2).reshape(B, T, H * d_k)


def ablate_one_based(x, w_qkv, w_o, n_heads, head, causal=False):
    o = _outputs(x, w_qkv, n_heads, causal).clone()
    o[:, head - 1] = 0  # treats head as 1-based
    return _merge(o) @ w_o


def ablate_next_head(x, w_qkv, w_o, n_heads, head, causal=False):
    o = _outputs(x, w_qkv, n_heads, causal).clone()
    o[:, (head + 1) % n_heads] = 0
    return _merge(o) @ w_o


def ablate_query(x, w_qkv, w_o, n_heads, head, causal=False):
    B, T, D = x.shape
    q, k, v = _heads(x, w_qkv, n_heads)
    q = q.clone()
    q[:, head] = 0
    return _merge(_attend(q, k, v, causal, math.sqrt(D // n_heads))) @ w_o


def ablate_w_o_columns(x, w_qkv, w_o, n_heads, head, causal=False):
    d_k = x.shape[-1] // n_heads
    w = w_o.clone()
    w[:, head * d_k:(head + 1) * d_k] = 0
    return _merge(_outputs(x, w_qkv, n_heads, causal)) @ w


def ablate_rescale_others(x, w_qkv, w_o, n_heads, head, causal=False):
    o = _outputs(x, w_qkv, n_heads, causal).clone()
    o[:, head] = 0
    return _merge(o * n_heads / (n_heads - 1)) @ w_o


def ablate_keep_only(x, w_qkv, w_o, n_heads, head, causal=False):
    o = _outputs(x, w_qkv, n_heads, causal)
    keep = torch.zeros(n_heads, 1, 1, dtype=o.dtype)
    keep[head] = 1
    return _merge(o * keep) @ w_o


def ablate_strided_columns(x, w_qkv, w_o, n_heads, head, causal=False):
    merged = _merge(_outputs(x, w_qkv, n_heads, causal)).clone()
    merged[..., head::n_heads] = 0
    return merged @ w_o


def ablate_nothing(x, w_qkv, w_o, n_heads, head, causal=False):
    return _merge(_outputs(x, w_qkv, n_heads, causal)) @ w_o


def ablate_ignores_causal(x, w_qkv, w_o, n_heads, head, causal=False):
    o = _outputs(x, w_qkv, n_heads, False).clone()
    o[:, head] = 0
    return _merge(o) @ w_o


def ablate_in_place_on_w_o(x, w_qkv, w_o, n_heads, head, causal=False):
    d_k = x.shape[-1] // n_heads
    w_o[head * d_k:(head + 1) * d_k] = 0  # right idea, but it destroys the caller's weights
    return _merge(_outputs(x, w_qkv, n_heads, causal)) @ w_o


# right: other styles than the reference
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


# ============================================================ the exercises' cases

WRONG = {
    "multi_head_attention": [
        (mha_split_without_transpose, "straight to [B, H, T, d_k] when splitting"),
        (mha_merge_without_transpose, "without transpose(1, 2)"),
        (mha_scale_by_d_model, "1/sqrt(D)"),
        (mha_w_o_transposed, "w_o transposed"),
        (mha_linear_style_w_o, "w_o transposed"),
        (mha_ignores_causal, "causal=True was ignored"),
        (mha_always_causal, "causal=False here"),
        (mha_no_w_o, "output projection is missing"),
        (mha_returns_heads, "expected shape [2, 5, 12]"),
        (mha_float32_inside, "expected dtype torch.float64"),
        (mha_causal_off_by_one, "one key ahead"),
        (mha_mask_inverted, "your causal mask is inverted"),
        (mha_softmax_over_queries, "softmax over the queries"),
        (mha_qkv_grouped_per_head, "grouped per head"),
        (mha_heads_split_dk_first, ".view(B, T, d_k, H)"),
    ],
    "mha_param_count": [
        (count_without_w_o, "W_O is missing"),
        (count_ignores_bias, "the biases are missing"),
        (count_one_bias, "not D."),
        (count_three_biases, "not three"),
        (count_bias_per_head, "not one per head"),
        (count_bias_always, "bias=False"),
        (count_per_head_square, "per-head widths"),
        (count_one_head, "per-head widths"),
        (count_as_float, "expected an int"),
        (count_bias_head_wide, "not d_k wide"),
        (count_square_per_head, "a D x D matrix per head"),
    ],
    "ablate_head": [
        (ablate_one_based, "you zeroed head 0, not head 1"),
        (ablate_next_head, "you zeroed head 2, not head 1"),
        (ablate_query, "zeroed the head's query"),
        (ablate_w_o_columns, "columns of W_O"),
        (ablate_rescale_others, "rescaled"),
        (ablate_keep_only, "kept only head h"),
        (ablate_strided_columns, "every H-th column"),
        (ablate_nothing, "nothing was ablated"),
        (ablate_ignores_causal, "causal=True was ignored"),
        (ablate_in_place_on_w_o, "modified one of its input tensors in place"),
    ],
}


RIGHT = {
    "multi_head_attention": [mha_einsum, mha_sdpa, mha_loop_float64, mha_torch_module],
    "mha_param_count": [count_by_modules, count_per_head],
    "ablate_head": [ablate_by_w_o_rows, ablate_by_subtraction, ablate_by_value_zero],
}


@pytest.mark.parametrize(("name", "wrong", "hint"), wrong_cases(WRONG))
def test_check_rejects_wrong(name, wrong, hint):
    assert_rejected(name, wrong, hint)


@pytest.mark.parametrize(("name", "right"), right_cases(RIGHT))
def test_check_accepts_right(name, right):
    assert_accepted(name, right)
