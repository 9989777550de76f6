"""FlashAttention in plain PyTorch (notebook 09): the online softmax and a tiled, exact attention.

These are the teaching versions of what ``helpers.triton_flash`` does in a Triton kernel. They
run anywhere (CPU or GPU) and are written for reading, not for speed.

Shapes: B batch, H query heads, H_kv key/value heads (H % H_kv == 0), T_q / T_k query / key
lengths (T when equal), d head dim. Per-head tensors are ``[B, H, T, d]``.
"""

from __future__ import annotations

import math

import torch

from .attention import finite_or_zero


def online_softmax(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Softmax over the last dim of x ``[..., n]`` -> ``[..., n]``, reading x block by block.

    The safe softmax ``exp(x - max) / sum(exp(x - max))`` needs the row max before it can sum.
    The online form gets both in ONE pass over the blocks: keep a running max ``m`` and a running
    sum ``l`` of ``exp(x - m)``; when a block raises the max from m to m_new, the sum so far is
    rescaled by ``exp(m - m_new)``. A last, elementwise step writes ``exp(x - m) / l``; inside
    FlashAttention even that step disappears, because the output is rescaled the same way.

    Entries equal to -inf get weight 0; a row that is entirely -inf gives all zeros, never NaN.
    Computed in float32, returned in x's dtype.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    xf = x.float()
    n = xf.shape[-1]
    m = torch.full(xf.shape[:-1], float("-inf"), device=x.device)  # running max   [...]
    l = torch.zeros(xf.shape[:-1], device=x.device)  # running sum of exp(x - m)    [...]
    for start in range(0, n, block_size):
        block = xf[..., start : start + block_size]  # [..., <= block_size]
        m_new = torch.maximum(m, block.amax(dim=-1))
        safe = finite_or_zero(m_new)
        l = l * torch.exp(m - safe) + torch.exp(block - safe[..., None]).sum(dim=-1)
        m = m_new
    p = torch.exp(xf - finite_or_zero(m)[..., None])
    l = torch.where(l > 0, l, torch.ones_like(l))  # an all -inf row: p is all 0, keep it so
    return (p / l[..., None]).to(x.dtype)


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> None:
    """Raise ValueError unless q ``[B,H,T_q,d]``, k and v ``[B,H_kv,T_k,d]`` fit together."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be [B, H, T, d]; got shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on B (dim 0) and d (dim 3)")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads H={q.shape[1]} must be a multiple of key/value heads H_kv={k.shape[1]}")
    if k.shape[2] < 1:
        raise ValueError("there must be at least one key (T_k >= 1)")
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"causal attention here needs T_q == T_k; got {q.shape[2]} and {k.shape[2]}")


def flash_attention_tiled(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    block_size: int = 64,
    sm_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention computed tile by tile, never forming a ``[T_q, T_k]`` scores tensor.

    q ``[B, H, T_q, d]``, k and v ``[B, H_kv, T_k, d]`` (H % H_kv == 0; query head h reads
    key/value head ``h // (H // H_kv)``, by broadcasting, without copying k or v)
    -> ``(out, lse)``: out ``[B, H, T_q, d]`` in q's dtype, lse ``[B, H, T_q]`` float32, the
    natural-log log-sum-exp of each row of the scaled (and causally masked) scores.

    For each query block (``block_size`` rows) we keep, in float32:
      m   ``[.., bq]``     running row max of the scores seen so far,
      l   ``[.., bq]``     running sum of exp(score - m),
      acc ``[.., bq, d]``  running sum of exp(score - m) * v.
    Each key block (``block_size`` keys) updates them with the online-softmax rescaling
    ``exp(m_old - m_new)``; at the end ``out = acc / l`` and ``lse = m + log(l)``. The largest
    temporary is one ``[bq, bk]`` score tile per head. With ``causal`` (query i sees keys j <= i),
    key blocks entirely above the diagonal are skipped and only blocks that cross it are masked.
    Any T works: the last block of each loop is simply shorter.
    """
    _check_qkv(q, k, v, causal)
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    B, H, T_q, d = q.shape
    H_kv, T_k = k.shape[1], k.shape[2]
    G = H // H_kv  # query heads per key/value head
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    # Group query heads under their kv head: q5 [B, H_kv, G, T_q, d]; k5, v5 [B, H_kv, 1, T_k, d]
    # broadcast over G in the matmuls (views only, nothing is copied).
    q5 = q.reshape(B, H_kv, G, T_q, d)
    k5, v5 = k[:, :, None], v[:, :, None]
    out = torch.empty(B, H_kv, G, T_q, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H_kv, G, T_q, dtype=torch.float32, device=q.device)
    for qs in range(0, T_q, block_size):
        qe = min(qs + block_size, T_q)
        qb = q5[..., qs:qe, :].float() * scale  # [B, H_kv, G, bq, d]
        m = torch.full(qb.shape[:-1], float("-inf"), device=q.device)  # [B, H_kv, G, bq]
        l = torch.zeros_like(m)
        acc = torch.zeros_like(qb)  # [B, H_kv, G, bq, d]
        k_end = qe if causal else T_k  # causal: keys >= qe are above the diagonal, skip them
        for ks in range(0, k_end, block_size):
            ke = min(ks + block_size, k_end)
            s = qb @ k5[..., ks:ke, :].float().transpose(-2, -1)  # [B, H_kv, G, bq, bk]
            if causal and ke - 1 > qs:  # this block crosses the diagonal: mask keys j > i
                rows = torch.arange(qs, qe, device=q.device)[:, None]
                cols = torch.arange(ks, ke, device=q.device)[None, :]
                s = s.masked_fill(cols > rows, float("-inf"))
            m_new = torch.maximum(m, s.amax(dim=-1))  # finite: every row sees key 0 first
            alpha = torch.exp(m - m_new)  # rescales what was summed under the old max
            p = torch.exp(s - m_new[..., None])  # [B, H_kv, G, bq, bk]
            l = l * alpha + p.sum(dim=-1)
            acc = acc * alpha[..., None] + p @ v5[..., ks:ke, :].float()
            m = m_new
        out[..., qs:qe, :] = (acc / l[..., None]).to(q.dtype)
        lse[..., qs:qe] = m + torch.log(l)
    return out.reshape(B, H, T_q, d), lse.reshape(B, H, T_q)
