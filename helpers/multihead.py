"""Multi-head attention from plain matrices (notebook 05).

Shapes: B batch, T sequence length, D = d_model, H heads, d_k = D / H. ``w_qkv`` is ``[D, 3D]``
with columns Q, K, V (as in notebook 01) and ``w_o`` is ``[D, D]`` with ``y = merged @ w_o``.
"""

from __future__ import annotations

import torch

from .attention import causal_mask, merge_heads, qkv_projection, scaled_dot_product_attention

__all__ = ["multi_head_attention"]


def multi_head_attention(x: torch.Tensor, w_qkv: torch.Tensor, w_o: torch.Tensor, n_heads: int,
                         causal: bool = False) -> torch.Tensor:
    """x ``[B, T, D]`` -> ``[B, T, D]``: project, split into H heads, attend (causally if asked),
    merge the heads and apply ``w_o``."""
    q, k, v = qkv_projection(x, w_qkv, n_heads)                       # [B, H, T, d_k] each
    allowed = causal_mask(x.shape[1], device=x.device) if causal else None
    return merge_heads(scaled_dot_product_attention(q, k, v, allowed)) @ w_o
