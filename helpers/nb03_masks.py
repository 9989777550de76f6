"""Attention masks: who may see whom (notebook 03).

Every mask is boolean with True = may attend (the convention of
``torch.nn.functional.scaled_dot_product_attention``). Rows are queries, columns are keys: a
``[T_q, T_k]`` mask broadcasts over batch and heads, a ``[B, 1, 1, T_k]`` one over heads and
queries. ``causal_mask`` and ``masked_softmax`` live in :mod:`helpers.nb01_qkv_shapes` (notebook 01 uses
them) and are re-exported here as the references for exercises 3.1 and 3.3.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = [
    "causal_mask",
    "padding_mask",
    "masked_softmax",
    "prefix_lm_mask",
    "packed_causal_mask",
    "find_mask_leaks",
]


def causal_mask(T: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``[T, T]`` bool, True on and below the diagonal: query i may attend to keys j <= i."""
    return torch.ones(T, T, dtype=torch.bool, device=device).tril()


def finite_or_zero(m: torch.Tensor) -> torch.Tensor:
    """Replace -inf (a row max when nothing is allowed, or nothing seen yet) by 0, so that
    ``x - m`` never computes ``-inf - -inf = NaN``."""
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def masked_softmax(scores: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax over the last dim of ``scores`` ``[..., T_k]`` where ``allowed`` (bool, broadcastable)
    is True. Stable for large scores (the row maximum is subtracted); a row with nothing allowed
    gives all zeros, never NaN."""
    if allowed is None:
        return torch.softmax(scores, dim=-1)
    allowed = allowed.expand_as(scores)
    masked = scores.masked_fill(~allowed, float("-inf"))
    # exp(-inf) = 0 exactly, so disallowed keys get no mass; an all-disallowed row gives e = 0.
    e = torch.exp(masked - finite_or_zero(masked.amax(dim=-1, keepdim=True)))
    denom = e.sum(dim=-1, keepdim=True)
    return e / torch.where(denom > 0, denom, torch.ones_like(denom))


def padding_mask(lengths: torch.Tensor, T: int) -> torch.Tensor:
    """lengths ``[B]`` int -> ``[B, 1, 1, T]`` bool: key j of sequence b is allowed iff
    ``j < lengths[b]`` (right padding). Broadcasts over heads and queries."""
    keys = torch.arange(T, device=lengths.device)
    return (keys < lengths[:, None])[:, None, None, :]


def prefix_lm_mask(T: int, prefix_len: int) -> torch.Tensor:
    """``[T, T]`` bool: positions ``0..prefix_len-1`` see each other freely (bidirectional
    prefix), every later position is causal (it sees the whole prefix and its own past)."""
    pos = torch.arange(T)
    in_prefix = pos < prefix_len
    return causal_mask(T) | (in_prefix[:, None] & in_prefix[None, :])


def packed_causal_mask(seq_lens: Sequence[int]) -> torch.Tensor:
    """seq_lens (list of ints) -> ``[N, N]`` bool, N = sum(seq_lens): the sequences are packed one
    after another (the varlen layout, boundaries ``cu_seqlens = [0, cumsum(seq_lens)]``) and
    each is causal within itself, with no attention across sequences: block-diagonal causal."""
    return torch.block_diag(*[causal_mask(n) for n in seq_lens]) if len(seq_lens) else torch.ones(0, 0, dtype=torch.bool)


def sliding_window_mask(T: int, window: int) -> torch.Tensor:
    """``[T, T]`` bool, causal and local: query i sees the ``window`` keys ``i-window+1..i``
    (itself included), the convention of Hugging Face's ``sliding_window`` (Mistral, Gemma 2)."""
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    return (j <= i) & (j > i - window)


def chunked_causal_mask(T: int, chunk: int) -> torch.Tensor:
    """``[T, T]`` bool, causal within fixed chunks: query i sees the keys ``j <= i`` of its own
    chunk, ``j // chunk == i // chunk`` (Llama 4's chunked layers, ``attention_chunk_size``). Unlike
    a sliding window, the view resets at each chunk boundary: the first token of a chunk sees only
    itself. The same as ``packed_causal_mask`` of sequences of ``chunk`` tokens (the last one shorter)."""
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1, got {chunk}")
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    return (j <= i) & (j // chunk == i // chunk)


def find_mask_leaks(
    attention_fn: Callable[[torch.Tensor], torch.Tensor],
    allowed: torch.Tensor,
    d_model: int,
    n_trials: int = 2,
    rtol: float = 1e-6,
    seed: int = 0,
) -> list[tuple[int, int]]:
    """Perturbation test of a claimed mask: attention_fn maps x ``[1, T, D]`` -> ``[1, T, D]`` and
    claims to respect ``allowed`` ``[T, T]``.

    From a random base input (float64, so that float noise is ~1e-16), each position j in turn
    gets a random perturbation; query i *depends on* j when its output row moves by more than
    ``rtol`` times the output's scale. Returns the sorted list of (query i, key j) pairs with
    ``allowed[i, j]`` False that depend: leaks through the weights and through the softmax
    denominator alike (both move the output)."""
    T = allowed.shape[-1]
    g = torch.Generator().manual_seed(seed)
    depends = torch.zeros(T, T, dtype=torch.bool)
    for _ in range(n_trials):
        x = torch.randn(1, T, d_model, generator=g, dtype=torch.float64)
        base = attention_fn(x)
        tol = rtol * (1.0 + base.abs().max())
        for j in range(T):
            x_j = x.clone()
            x_j[0, j] += torch.randn(d_model, generator=g, dtype=torch.float64)
            moved = (attention_fn(x_j) - base).abs().amax(dim=-1)[0]  # [T]: how far each row moved
            depends[:, j] |= moved > tol
    leaks = depends & ~allowed.to(torch.bool).cpu()
    return [(i, j) for i, j in leaks.nonzero().tolist()]
