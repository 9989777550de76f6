"""Scaled dot-product attention and the shape plumbing around it (notebook 01).

Shapes: B batch, T sequence length, D = d_model, H heads, d_k = D / H. Per-head tensors are
``[B, H, T, d_k]``. Masks are boolean with True = may attend (as in
``torch.nn.functional.scaled_dot_product_attention``).
"""

from __future__ import annotations

import torch

# Defined where their exercises are (2.1, 3.1, 3.3); importable from here too, as from release 0.1's
# helpers.attention.
from .nb02_scaling import scaled_scores  # noqa: F401
from .nb03_masks import causal_mask, finite_or_zero, masked_softmax  # noqa: F401


def split_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """``[B, T, D]`` -> ``[B, H, T, D/H]``: a view (no copy); head h is columns ``h*d_k:(h+1)*d_k``."""
    B, T, D = x.shape
    if D % n_heads:
        raise ValueError(f"d_model={D} is not divisible by n_heads={n_heads}")
    return x.view(B, T, n_heads, D // n_heads).transpose(1, 2)


def merge_heads(o: torch.Tensor) -> torch.Tensor:
    """``[B, H, T, d_k]`` -> ``[B, T, H*d_k]``, head h in columns ``h*d_k:(h+1)*d_k`` (a copy)."""
    B, H, T, d_k = o.shape
    return o.transpose(1, 2).reshape(B, T, H * d_k)


def qkv_projection(x: torch.Tensor, w_qkv: torch.Tensor, n_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused projection ``x @ w_qkv`` (columns Q, K, V), then split into heads.

    x ``[B, T, D]``, w_qkv ``[D, 3D]`` -> ``(q, k, v)``, each ``[B, H, T, D/H]``.
    """
    D = x.shape[-1]
    q, k, v = (x @ w_qkv).split(D, dim=-1)
    return split_heads(q, n_heads), split_heads(k, n_heads), split_heads(v, n_heads)


def layer_costs(n: int, d: int, k: int = 3, r: int = 64) -> dict[str, dict[str, int]]:
    """Vaswani et al. (2017), Table 1, as numbers: for one layer over ``n`` tokens of width ``d``
    (kernel width ``k`` for convolutions, window ``r`` for restricted self-attention), by layer
    type, ``flops`` (the layer's work, a multiply-add = 2 FLOPs), ``sequential`` (operations that
    must run one after another) and ``path`` (hops a signal takes from the first token's input to
    the last token's output; one hop per layer crossed, and per state update of a recurrence).

    Counted: self-attention, ``Q K^T`` and ``P V`` (2 n^2 d multiply-adds; projections and softmax
    left out, as in the table); restricted self-attention, each query against ``r`` keys (2 n r d;
    the first r - 1 queries of a causal window have fewer keys, left uncounted as in the table's
    O(r n d)); recurrent, ``x_t W`` and ``h_{t-1} U`` for each of the n steps (2 n d^2);
    convolutional, k taps of a ``d x d`` matrix at each position (k n d^2).

    The recurrence makes n state updates h_1 .. h_n, each waiting for the one before: n sequential
    operations; a signal from token 1 enters h_1 and then crosses the n - 1 updates to h_n: n hops,
    as attention's is 1. The restricted window is notebook 03's ``sliding_window_mask``: a query
    sees itself and the r - 1 keys before it, so each layer carries a signal r - 1 positions
    further: ceil((n - 1) / (r - 1)) layers (Table 1's O(n/r); a window of r keys centred on the
    query, as the paper describes it, moves (r - 1) / 2 each way: twice as many). The
    convolutional path is given twice: ``path`` for dilated kernels (dilation k^l, so the smallest
    L with k^L >= n, i.e. ceil(log_k n)) and ``path_contiguous`` for plain ones (each layer widens
    the receptive field by k - 1: ceil((n - 1) / (k - 1)), the table's O(n/k)).
    """
    if n < 1 or d < 1 or k < 2 or r < 2:
        raise ValueError(f"need n >= 1, d >= 1, k >= 2, r >= 2; got n={n}, d={d}, k={k}, r={r}")
    dilated = 0
    while k**dilated < n:
        dilated += 1
    return {
        "self-attention": {"flops": 2 * 2 * n * n * d, "sequential": 1, "path": 1},
        "restricted": {"flops": 2 * 2 * n * min(r, n) * d, "sequential": 1,
                       "path": max(1, -(-(n - 1) // (r - 1)))},
        "recurrent": {"flops": 2 * 2 * n * d * d, "sequential": n, "path": n},
        "convolutional": {
            "flops": 2 * k * n * d * d,
            "sequential": 1,
            "path": dilated,
            "path_contiguous": -(-(n - 1) // (k - 1)),
        },
    }


def attention_weights(q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """``softmax(q k^T / sqrt(d_k))`` with an optional boolean mask -> ``[..., T_q, T_k]``."""
    return masked_softmax(scaled_scores(q, k), allowed)


def scaled_dot_product_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None = None
) -> torch.Tensor:
    """``softmax(q k^T / sqrt(d_k)) v``: q ``[..., T_q, d_k]``, k ``[..., T_k, d_k]``,
    v ``[..., T_k, d_v]`` -> ``[..., T_q, d_v]``. ``allowed`` (bool, True = may attend) is optional."""
    return attention_weights(q, k, allowed) @ v


def data_flow_shapes(
    B: int, T: int, D: int, H: int, H_kv: int | None = None, d_k: int | None = None, T_q: int | None = None
) -> list[tuple[int, str, tuple[int, ...]]]:
    """Every tensor of one causal self-attention layer as ``(step, name, shape)``, steps 1-7 of
    nanoGPT's CausalSelfAttention, generalised to grouped-query attention (``H_kv`` key/value heads,
    default H) and to decode (``T_q`` new queries against ``T`` keys; default T_q = T, prefill).
    ``d_k`` defaults to D / H. Weights have no batch dimension."""
    H_kv = H if H_kv is None else H_kv
    T_q = T if T_q is None else T_q
    if d_k is None:
        if D % H:
            raise ValueError(f"d_model={D} is not divisible by n_heads={H}; pass d_k explicitly")
        d_k = D // H
    if H % H_kv:
        raise ValueError(f"n_heads={H} is not divisible by n_kv_heads={H_kv}")
    return [
        (1, "x", (B, T_q, D)),
        (1, "W_Q", (D, H * d_k)),
        (1, "W_K", (D, H_kv * d_k)),
        (1, "W_V", (D, H_kv * d_k)),
        (1, "Q = x W_Q", (B, T_q, H * d_k)),
        (1, "K = x W_K", (B, T_q, H_kv * d_k)),
        (1, "V = x W_V", (B, T_q, H_kv * d_k)),
        (2, "Q heads", (B, H, T_q, d_k)),
        (2, "K heads (all keys)", (B, H_kv, T, d_k)),
        (2, "V heads (all values)", (B, H_kv, T, d_k)),
        (3, "scores", (B, H, T_q, T)),
        (4, "weights", (B, H, T_q, T)),
        (5, "weighted values", (B, H, T_q, d_k)),
        (6, "merged", (B, T_q, H * d_k)),
        (7, "W_O", (H * d_k, D)),
        (7, "y", (B, T_q, D)),
    ]
