"""Learner-style wrong implementations for exercises 5.1-5.3, with the hint each check must give."""

import math

import torch


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


# ----------------------------------------------------------------- 5.1 multi_head_attention
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


# ----------------------------------------------------------------- 5.2 mha_param_count
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


# ----------------------------------------------------------------- 5.3 ablate_head
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
