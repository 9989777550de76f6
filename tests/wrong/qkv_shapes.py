"""Learner-style wrong implementations for exercises 1.1-1.3, with the hint each check must give."""

import math

import torch


# ----------------------------------------------------------------- 1.1 qkv_projection
def qkv_reshape_without_transpose(x, w_qkv, n_heads):
    B, T, D = x.shape
    q, k, v = (x @ w_qkv).split(D, dim=-1)
    return tuple(t.reshape(B, n_heads, T, D // n_heads) for t in (q, k, v))


def qkv_view_no_transpose(x, w_qkv, n_heads):
    B, T, D = x.shape
    q, k, v = (x @ w_qkv).split(D, dim=-1)
    return tuple(t.view(B, T, n_heads, D // n_heads) for t in (q, k, v))


def qkv_wrong_order(x, w_qkv, n_heads):
    B, T, D = x.shape
    k, q, v = (x @ w_qkv).split(D, dim=-1)  # K columns taken as Q
    return tuple(t.view(B, T, n_heads, D // n_heads).transpose(1, 2) for t in (q, k, v))


def qkv_dk_major(x, w_qkv, n_heads):
    B, T, D = x.shape
    q, k, v = (x @ w_qkv).split(D, dim=-1)
    return tuple(t.view(B, T, D // n_heads, n_heads).permute(0, 3, 1, 2) for t in (q, k, v))


def qkv_returns_numpy(x, w_qkv, n_heads):
    B, T, D = x.shape
    q, k, v = (x @ w_qkv).split(D, dim=-1)
    return tuple(t.view(B, T, n_heads, D // n_heads).transpose(1, 2).numpy() for t in (q, k, v))


def qkv_returns_two(x, w_qkv, n_heads):
    B, T, D = x.shape
    q, k, _ = (x @ w_qkv).split(D, dim=-1)
    return q, k


# ----------------------------------------------------------------- 1.2 merge_heads
def merge_without_transpose(o):
    B, H, T, d_k = o.shape
    return o.reshape(B, T, H * d_k)


def merge_with_view(o):
    B, H, T, d_k = o.shape
    return o.transpose(1, 2).view(B, T, H * d_k)


def merge_dk_major(o):
    B, H, T, d_k = o.shape
    return o.permute(0, 2, 3, 1).reshape(B, T, H * d_k)


def merge_forgot_return(o):
    o.transpose(1, 2).reshape(o.shape[0], o.shape[2], -1)


def merge_float64(o):
    B, H, T, d_k = o.shape
    return o.transpose(1, 2).reshape(B, T, H * d_k).double()


# ----------------------------------------------------------------- 1.3 scaled_dot_product_attention
def sdpa_no_scale(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v


def sdpa_scale_by_dk(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1], dim=-1) @ v


def sdpa_scale_by_dv(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(v.shape[-1]), dim=-1) @ v


def sdpa_softmax_wrong_axis(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-2) @ v


def sdpa_transpose_q(q, k, v):
    return torch.softmax(q.transpose(-2, -1) @ k / math.sqrt(q.shape[-1]), dim=-1) @ v


def sdpa_causal_when_not_asked(q, k, v):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    T_q, T_k = s.shape[-2:]
    s = s.masked_fill(~torch.ones(T_q, T_k, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def sdpa_in_place(q, k, v):
    q /= math.sqrt(q.shape[-1])
    return torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v


def sdpa_never_returns(q, k, v):
    while True:
        pass


def sdpa_not_attempted(q, k, v):
    raise NotImplementedError()


def sdpa_nan(q, k, v):
    out = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1) @ v
    return out.index_fill(-1, torch.tensor([0]), float("nan"))


def sdpa_returns_weights(q, k, v):
    # the Math-for-LLMs notes' mistake 3: the weights are not the output
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)


def sdpa_mixes_keys(q, k, v):
    weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)
    return weights @ k  # keys where the values belong


def sdpa_broadcast_shape(q, k, v):
    out = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1) @ v
    return out.unsqueeze(0)


WRONG = {
    "qkv_projection": [
        (qkv_reshape_without_transpose, "reshaped straight to [B, H, T, d_k]"),
        (qkv_view_no_transpose, "did not transpose"),
        (qkv_wrong_order, "Q, K, V in that order"),
        (qkv_dk_major, "d_k-major"),
        (qkv_returns_numpy, "torch.from_numpy"),
        (qkv_returns_two, "expected a tuple of 3"),
    ],
    "merge_heads": [
        (merge_without_transpose, "transpose(1, 2) first"),
        (merge_with_view, "use .reshape"),
        (merge_dk_major, "d_k-major"),
        (merge_forgot_return, "forget the `return`"),
        (merge_float64, "expected dtype torch.float32"),
    ],
    "scaled_dot_product_attention": [
        (sdpa_no_scale, "forgot to divide the scores by sqrt(d_k)"),
        (sdpa_scale_by_dk, "divided by d_k"),
        (sdpa_scale_by_dv, "sqrt(d_v)"),
        (sdpa_softmax_wrong_axis, "wrong axis"),
        (sdpa_transpose_q, "Transpose the last two axes of k"),
        (sdpa_causal_when_not_asked, "no mask was asked for"),
        (sdpa_in_place, "modified one of its input tensors in place"),
        (sdpa_never_returns, "did not return within"),
        (sdpa_not_attempted, "not attempted yet"),
        (sdpa_nan, "got NaN"),
        (sdpa_broadcast_shape, "expected shape"),
        (sdpa_returns_weights, "you returned the attention weights"),
        (sdpa_mixes_keys, "you averaged the keys (weights @ k)"),
    ],
}
