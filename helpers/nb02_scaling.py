"""Why attention divides by sqrt(d_k): score scale, entropy, and the dot-product variance (notebook 02).

Entropy is in nats (natural log), the course's convention.
"""

from __future__ import annotations

import math

import torch

__all__ = ["scaled_scores", "attention_entropy", "dot_product_std"]


def scaled_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``q @ k^T / sqrt(d_k)``: q ``[..., T_q, d_k]``, k ``[..., T_k, d_k]`` -> ``[..., T_q, T_k]``."""
    return q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])


def attention_entropy(p: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of each attention row: ``-sum_j p_j log p_j`` over the last dim.

    p ``[..., T_k]`` (rows sum to 1) -> ``[...]``. ``0 log 0`` is taken as 0, its limit, so rows
    with masked (zero) weights give a finite entropy. Uniform rows give ``log T_k``, one-hot rows 0.
    """
    return torch.special.entr(p).sum(dim=-1)  # entr(x) = -x log x, and entr(0) = 0


def dot_product_std(d_k: int, n_samples: int, generator: torch.Generator) -> float:
    """Empirical standard deviation of ``q . k`` over ``n_samples`` independent pairs ``(q, k)``,
    each ``[d_k]`` with iid N(0, 1) entries drawn from ``generator``. Close to ``sqrt(d_k)``."""
    q = torch.randn(n_samples, d_k, generator=generator)
    k = torch.randn(n_samples, d_k, generator=generator)
    return (q * k).sum(dim=-1).std().item()
