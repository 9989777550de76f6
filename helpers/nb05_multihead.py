"""Multi-head attention from plain matrices (notebook 05).

Shapes: B batch, T sequence length, D = d_model, H heads, d_k = D / H. ``w_qkv`` is ``[D, 3D]``
with columns Q, K, V (as in notebook 01) and ``w_o`` is ``[D, D]`` with ``y = merged @ w_o``:
rows ``h*d_k:(h+1)*d_k`` of ``w_o`` read head h.
"""

from __future__ import annotations

import torch

from .nb01_qkv_shapes import attention_weights, merge_heads, qkv_projection
from .nb03_masks import causal_mask

__all__ = ["multi_head_attention", "mha_param_count", "ablate_head"]


def head_weights(x: torch.Tensor, w_qkv: torch.Tensor, n_heads: int, causal: bool = False) -> torch.Tensor:
    """The attention weights of every head: x ``[B, T, D]`` -> ``[B, H, T, T]`` (rows sum to 1)."""
    q, k, _ = qkv_projection(x, w_qkv, n_heads)
    allowed = causal_mask(x.shape[1], device=x.device) if causal else None
    return attention_weights(q, k, allowed)


def head_outputs(x: torch.Tensor, w_qkv: torch.Tensor, n_heads: int, causal: bool = False) -> torch.Tensor:
    """What each head produces before the merge: x ``[B, T, D]`` -> ``[B, H, T, d_k]``."""
    q, k, v = qkv_projection(x, w_qkv, n_heads)                       # [B, H, T, d_k] each
    allowed = causal_mask(x.shape[1], device=x.device) if causal else None
    return attention_weights(q, k, allowed) @ v


def multi_head_attention(x: torch.Tensor, w_qkv: torch.Tensor, w_o: torch.Tensor, n_heads: int,
                         causal: bool = False) -> torch.Tensor:
    """x ``[B, T, D]`` -> ``[B, T, D]``: project, split into H heads, attend (causally if asked),
    merge the heads and apply ``w_o`` (exercise 5.1)."""
    return merge_heads(head_outputs(x, w_qkv, n_heads, causal)) @ w_o


def head_contributions(x: torch.Tensor, w_qkv: torch.Tensor, w_o: torch.Tensor, n_heads: int,
                       causal: bool = False) -> torch.Tensor:
    """Each head's share of the output: ``[B, H, T, D]``, head h's output times its rows of ``w_o``.
    Summed over H it is :func:`multi_head_attention`: ``W_O`` is where the heads are added up."""
    o = head_outputs(x, w_qkv, n_heads, causal)                       # [B, H, T, d_k]
    d_k = o.shape[-1]
    return o @ w_o.view(n_heads, d_k, w_o.shape[-1]).unsqueeze(0)     # [B, H, T, D]


def mha_param_count(d_model: int, n_heads: int, bias: bool = False) -> int:
    """Parameters of W_Q, W_K, W_V and W_O (each ``[D, D]``), plus their four ``[D]`` biases if
    ``bias`` (exercise 5.2): ``4 D^2 (+ 4 D)``. The number of heads does not change it, only how
    the D columns are grouped; D must be divisible by H."""
    if d_model % n_heads:
        raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
    return 4 * d_model * d_model + (4 * d_model if bias else 0)


def ablate_head(x: torch.Tensor, w_qkv: torch.Tensor, w_o: torch.Tensor, n_heads: int, head: int,
                causal: bool = False) -> torch.Tensor:
    """:func:`multi_head_attention` with head ``head``'s output zeroed before ``W_O`` (exercise 5.3):
    x ``[B, T, D]`` -> ``[B, T, D]``. The other heads are left exactly as they were (no rescaling)."""
    if not 0 <= head < n_heads:
        raise ValueError(f"head must be in 0..{n_heads - 1}, got {head}")
    o = head_outputs(x, w_qkv, n_heads, causal)
    keep = torch.ones(n_heads, 1, 1, dtype=o.dtype, device=o.device)
    keep[head] = 0
    return merge_heads(o * keep) @ w_o
