"""Gradients through softmax and attention, by hand (notebook 04).

Forward pieces come from :mod:`helpers.nb01_qkv_shapes`; this module holds only their backward. Shapes:
T sequence length, d_k query/key width, d_v value width, any leading batch/head dims ``...``.
Per-head tensors are ``[B, H, T, d_k]``. Masks are boolean with True = may attend.
"""

from __future__ import annotations

import math

import torch

from .nb01_qkv_shapes import attention_weights
from .nb03_masks import causal_mask

__all__ = ["softmax_jacobian", "softmax_backward", "attention_backward"]


def softmax_jacobian(s: torch.Tensor) -> torch.Tensor:
    """Jacobian of softmax at the point whose output is ``s``: ``J = diag(s) - s s^T``.

    s ``[n]`` (or ``[..., n]``), a softmax output -> ``[n, n]`` (or ``[..., n, n]``) with
    ``J[i, j] = d s_i / d z_j = s_i (delta_ij - s_j)``. Symmetric; rows and columns sum to 0.
    """
    return torch.diag_embed(s) - s.unsqueeze(-1) * s.unsqueeze(-2)


def softmax_backward(p: torch.Tensor, grad_p: torch.Tensor) -> torch.Tensor:
    """Gradient of the pre-softmax scores, given the softmax output and the gradient of the output.

    p, grad_p ``[..., n]`` (softmax over the last dim) -> ``[..., n]``:
    ``J @ grad_p = p * (grad_p - sum(p * grad_p))``, the sum over the last dim, one per row.
    O(n) per row: the ``[n, n]`` Jacobian is never formed. Entries with p = 0 (masked) get 0.
    """
    return p * (grad_p - (p * grad_p).sum(dim=-1, keepdim=True))


def attention_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor, causal: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``out = softmax(q k^T / sqrt(d_k) [+ causal mask]) v`` given ``grad_out``.

    q ``[..., T, d_k]``, k ``[..., T, d_k]``, v ``[..., T, d_v]``, grad_out ``[..., T, d_v]``
    -> ``(grad_q, grad_k, grad_v)`` with the shapes of q, k, v. P is recomputed from q and k::

        P  = softmax(q k^T / sqrt(d_k), masked)    [..., T, T]
        dV = P^T @ dO                              [..., T, d_v]
        dP = dO @ v^T                              [..., T, T]
        dS = P * (dP - rowsum(P * dP))             [..., T, T]   (0 where masked: P is 0 there)
        dQ = dS @ k / sqrt(d_k)                    [..., T, d_k]
        dK = dS^T @ q / sqrt(d_k)                  [..., T, d_k]
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    allowed = causal_mask(q.shape[-2], device=q.device) if causal else None
    p = attention_weights(q, k, allowed)
    grad_v = p.transpose(-2, -1) @ grad_out
    grad_s = softmax_backward(p, grad_out @ v.transpose(-2, -1)) * scale
    grad_q = grad_s @ k
    grad_k = grad_s.transpose(-2, -1) @ q
    return grad_q, grad_k, grad_v
