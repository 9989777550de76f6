"""Scaled dot-product attention and the shape plumbing around it (notebook 01).

Shapes: B batch, T sequence length, D = d_model, H heads, d_k = D / H. Per-head tensors are
``[B, H, T, d_k]``. Masks are boolean with True = may attend (as in
``torch.nn.functional.scaled_dot_product_attention``).
"""

from __future__ import annotations

import math

import torch


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


def scaled_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``q @ k^T / sqrt(d_k)``: q ``[..., T_q, d_k]``, k ``[..., T_k, d_k]`` -> ``[..., T_q, T_k]``."""
    return q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])


def causal_mask(T: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``[T, T]`` bool, True on and below the diagonal: query i may attend to keys j <= i."""
    return torch.ones(T, T, dtype=torch.bool, device=device).tril()


def masked_softmax(scores: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax over the last dim of ``scores`` ``[..., T_k]`` where ``allowed`` (bool, broadcastable)
    is True. Stable for large scores (the row maximum is subtracted); a row with nothing allowed
    gives all zeros, never NaN."""
    if allowed is None:
        return torch.softmax(scores, dim=-1)
    allowed = allowed.expand_as(scores)
    masked = scores.masked_fill(~allowed, float("-inf"))
    row_max = masked.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    e = torch.exp(masked - row_max)  # exp(-inf) = 0 exactly, so disallowed keys get no mass
    denom = e.sum(dim=-1, keepdim=True)
    return e / torch.where(denom > 0, denom, torch.ones_like(denom))


def attention_weights(q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """``softmax(q k^T / sqrt(d_k))`` with an optional boolean mask -> ``[..., T_q, T_k]``."""
    return masked_softmax(scaled_scores(q, k), allowed)


def scaled_dot_product_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None = None
) -> torch.Tensor:
    """``softmax(q k^T / sqrt(d_k)) v``: q ``[..., T_q, d_k]``, k ``[..., T_k, d_k]``,
    v ``[..., T_k, d_v]`` -> ``[..., T_q, d_v]``. ``allowed`` (bool, True = may attend) is optional."""
    return attention_weights(q, k, allowed) @ v
