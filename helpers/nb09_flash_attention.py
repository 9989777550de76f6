"""FlashAttention in plain PyTorch (notebook 09): the online softmax and a tiled, exact attention.

These are the teaching versions of what ``helpers.nb09_triton_flash`` does in a Triton kernel. They
run anywhere (CPU or GPU) and are written for reading, not for speed.

Shapes: B batch, H query heads, H_kv key/value heads (H % H_kv == 0), T_q / T_k query / key
lengths (T when equal), d head dim. Per-head tensors are ``[B, H, T, d]``; any other number of
leading dims works too (``[B, T, d]``, ``[T, d]``, ...: :func:`flatten_batch`).

* ``online_softmax(x, block_size)``: the softmax of notebook 09, section 2 (exercise 9.1).
* ``flash_attention_tiled(q, k, v, causal, block_size, sm_scale=None) -> (out, lse)``: the tiled
  forward (exercise 9.2); ``flash_attention_tiled_backward(...)``: its tiled backward (section 5).
* ``FlashAttentionTiledFunction.apply(q, k, v, causal=False, sm_scale=None, block_size=64)`` -> out:
  both as one autograd function, so ``out.sum().backward()`` runs the tiled backward.
"""

from __future__ import annotations

import math

import torch

from .nb03_masks import finite_or_zero


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


def flatten_batch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q ``[*batch, H, T_q, d]``, k, v ``[*batch, H_kv, T_k, d]`` -> the same data as 4-D tensors
    ``[B, H, T_q, d]`` and ``[B, H_kv, T_k, d]``, B the product of the leading (batch) dims.

    Any number of leading dims is accepted, none included: ``[T, d]`` is one head of one sequence,
    ``[B, T, d]`` a batch of single-head sequences. Dim -3 is the head axis, as in torch's SDPA (a
    ``[B, T, H, d]`` layout must be transposed first). A 4-D tensor comes back as it is, with its
    strides; results go back to the caller's shape with ``x.reshape(original.shape)``.
    Raises ValueError unless q, k, v are tensors of at least 2 dims with the same leading dims."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim < 2:
            raise ValueError(f"{name} must be [..., T, d] (at least 2-D); got shape {tuple(t.shape)}")
    if not (q.ndim == k.ndim == v.ndim and q.shape[:-3] == k.shape[:-3] == v.shape[:-3]):
        raise ValueError(f"q, k, v must share their leading (batch) dims before [H, T, d]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")

    def as_4d(t: torch.Tensor) -> torch.Tensor:
        if t.ndim > 3:
            return t.reshape(math.prod(t.shape[:-3]), *t.shape[-3:])
        return t.reshape((1,) * (4 - t.ndim) + tuple(t.shape))  # [T, d] -> [1, 1, T, d]; [H, T, d] -> [1, H, T, d]

    return as_4d(q), as_4d(k), as_4d(v)


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> None:
    """Raise ValueError unless q ``[B,H,T_q,d]``, k and v ``[B,H_kv,T_k,d]`` fit together."""
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on d (the last dim)")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads H={q.shape[1]} must be a multiple of key/value heads H_kv={k.shape[1]}")
    if k.shape[2] < 1:
        raise ValueError("there must be at least one key (T_k >= 1)")
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"causal attention here needs T_q == T_k; got {q.shape[2]} and {k.shape[2]}")


def _accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for fp16 / bf16 / fp32 inputs, float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


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
    -> ``(out, lse)``: out ``[B, H, T_q, d]`` in q's dtype, lse ``[B, H, T_q]`` float32 (float64
    for float64 inputs), the natural-log log-sum-exp of each row of the scaled (and causally
    masked) scores. ``sm_scale`` defaults to 1/sqrt(d). Other leading dims work too
    (:func:`flatten_batch`): ``[B, T, d]``, ``[T, d]``, ``[B1, B2, H, T, d]``.

    For each query block (``block_size`` rows) we keep, in float32 (float64 for float64 inputs):
      m   ``[.., bq]``     running row max of the scores seen so far,
      l   ``[.., bq]``     running sum of exp(score - m),
      acc ``[.., bq, d]``  running sum of exp(score - m) * v.
    Each key block (``block_size`` keys) updates them with the online-softmax rescaling
    ``exp(m_old - m_new)``; at the end ``out = acc / l`` and ``lse = m + log(l)``. The largest
    temporary is one ``[bq, bk]`` score tile per head. With ``causal`` (query i sees keys j <= i),
    key blocks entirely above the diagonal are skipped and only blocks that cross it are masked.
    Any T works: the last block of each loop is simply shorter.
    """
    q_in = q
    q, k, v = flatten_batch(q, k, v)
    _check_qkv(q, k, v, causal)
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    B, H, T_q, d = q.shape
    H_kv, T_k = k.shape[1], k.shape[2]
    G = H // H_kv  # query heads per key/value head
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    acc_dtype = _accumulator_dtype(q.dtype)
    # Group query heads under their kv head: q5 [B, H_kv, G, T_q, d]; k5, v5 [B, H_kv, 1, T_k, d]
    # broadcast over G in the matmuls (views only, nothing is copied).
    q5 = q.reshape(B, H_kv, G, T_q, d)
    k5, v5 = k[:, :, None], v[:, :, None]
    out = torch.empty(B, H_kv, G, T_q, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H_kv, G, T_q, dtype=acc_dtype, device=q.device)
    for qs in range(0, T_q, block_size):
        qe = min(qs + block_size, T_q)
        qb = q5[..., qs:qe, :].to(acc_dtype) * scale  # [B, H_kv, G, bq, d]
        m = torch.full(qb.shape[:-1], float("-inf"), dtype=acc_dtype, device=q.device)  # [B, H_kv, G, bq]
        l = torch.zeros_like(m)
        acc = torch.zeros_like(qb)  # [B, H_kv, G, bq, d]
        k_end = qe if causal else T_k  # causal: keys >= qe are above the diagonal, skip them
        for ks in range(0, k_end, block_size):
            ke = min(ks + block_size, k_end)
            s = qb @ k5[..., ks:ke, :].to(acc_dtype).transpose(-2, -1)  # [B, H_kv, G, bq, bk]
            if causal and ke - 1 > qs:  # this block crosses the diagonal: mask keys j > i
                s = s.masked_fill(_above_diagonal(qs, qe, ks, ke, q.device), float("-inf"))
            m_new = torch.maximum(m, s.amax(dim=-1))  # finite: every row sees key 0 first
            alpha = torch.exp(m - m_new)  # rescales what was summed under the old max
            p = torch.exp(s - m_new[..., None])  # [B, H_kv, G, bq, bk]
            l = l * alpha + p.sum(dim=-1)
            acc = acc * alpha[..., None] + p @ v5[..., ks:ke, :].to(acc_dtype)
            m = m_new
        out[..., qs:qe, :] = (acc / l[..., None]).to(q.dtype)
        lse[..., qs:qe] = m + torch.log(l)
    return out.reshape(q_in.shape), lse.reshape(q_in.shape[:-1])


def _above_diagonal(qs: int, qe: int, ks: int, ke: int, device: torch.device) -> torch.Tensor:
    """``[qe - qs, ke - ks]`` bool tile, True where key j > query i (what causal attention hides)."""
    rows = torch.arange(qs, qe, device=device)[:, None]
    cols = torch.arange(ks, ke, device=device)[None, :]
    return cols > rows


def flash_attention_tiled_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    causal: bool = False,
    block_size: int = 64,
    sm_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward pass of :func:`flash_attention_tiled`, tile by tile, from the saved ``lse``.

    q, out, grad_out ``[B, H, T_q, d]``, k, v ``[B, H_kv, T_k, d]``, lse ``[B, H, T_q]`` (the same
    leading dims as the forward) -> ``(grad_q, grad_k, grad_v)`` in the shapes and dtypes of q, k, v.

    Notebook 09, section 5 (FlashAttention-2's backward, one pass): D = rowsum(dO * O) needs no P;
    then for each key block j and each query block i that sees it (causal: from the diagonal
    down), P_ij = exp(S_ij - lse_i) is rebuilt from the tile's scores and
      dV_j += P_ij^T dO_i,   dP_ij = dO_i V_j^T,   dS_ij = P_ij * (dP_ij - D_i),
      dK_j += c dS_ij^T Q_i,   dQ_i += c dS_ij K_j          (c = sm_scale).
    The largest temporary is one ``[bq, bk]`` tile per head; with grouped-query attention the G
    query heads that share a kv head add into its dK, dV. Computed in float32 (float64 for float64
    inputs). On a GPU the key blocks would run in parallel and dQ_i would be added atomically;
    here the loops run one after the other, so a plain ``+=`` does it.
    """
    q_in, k_in, v_in = q, k, v
    q, k, v = flatten_batch(q, k, v)
    _check_qkv(q, k, v, causal)
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    for name, t, shape in (("out", out, q_in.shape), ("grad_out", grad_out, q_in.shape), ("lse", lse, q_in.shape[:-1])):
        if not isinstance(t, torch.Tensor) or t.shape != shape:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must have shape {tuple(shape)} (from q {tuple(q_in.shape)}); got {got}")
    B, H, T_q, d = q.shape
    H_kv, T_k = k.shape[1], k.shape[2]
    G = H // H_kv
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    acc_dtype = _accumulator_dtype(q.dtype)
    # Same grouping as the forward: query-side tensors [B, H_kv, G, T_q, ...], kv [B, H_kv, 1, T_k, d]
    q5 = q.reshape(B, H_kv, G, T_q, d)
    do5 = grad_out.reshape(B, H_kv, G, T_q, d)
    lse5 = lse.reshape(B, H_kv, G, T_q).to(acc_dtype)
    k5, v5 = k[:, :, None], v[:, :, None]
    D = (do5.to(acc_dtype) * out.reshape(B, H_kv, G, T_q, d).to(acc_dtype)).sum(dim=-1)  # [B, H_kv, G, T_q]
    dq = torch.zeros(B, H_kv, G, T_q, d, dtype=acc_dtype, device=q.device)
    dk = torch.zeros(B, H_kv, T_k, d, dtype=acc_dtype, device=q.device)
    dv = torch.zeros(B, H_kv, T_k, d, dtype=acc_dtype, device=q.device)
    for ks in range(0, T_k, block_size):
        ke = min(ks + block_size, T_k)
        kb = k5[..., ks:ke, :].to(acc_dtype)  # [B, H_kv, 1, bk, d]
        vb = v5[..., ks:ke, :].to(acc_dtype)
        # causal: query rows i < ks see none of these keys, so start at the diagonal block
        for qs in range(ks if causal else 0, T_q, block_size):
            qe = min(qs + block_size, T_q)
            qb = q5[..., qs:qe, :].to(acc_dtype) * scale  # c * Q_i, as in the forward  [B, H_kv, G, bq, d]
            dob = do5[..., qs:qe, :].to(acc_dtype)  # [B, H_kv, G, bq, d]
            s = qb @ kb.transpose(-2, -1)  # [B, H_kv, G, bq, bk]
            if causal and ke - 1 > qs:
                s = s.masked_fill(_above_diagonal(qs, qe, ks, ke, q.device), float("-inf"))
            p = torch.exp(s - lse5[..., qs:qe, None])  # P_ij, rebuilt from lse
            dv[..., ks:ke, :] += (p.transpose(-2, -1) @ dob).sum(dim=2)  # summed over the G heads
            dp = dob @ vb.transpose(-2, -1)  # [B, H_kv, G, bq, bk]
            ds = p * (dp - D[..., qs:qe, None])
            dk[..., ks:ke, :] += (ds.transpose(-2, -1) @ qb).sum(dim=2)  # c dS^T Q = dS^T (c Q)
            dq[..., qs:qe, :] += scale * (ds @ kb)
    return (dq.reshape(q_in.shape).to(q_in.dtype), dk.reshape(k_in.shape).to(k_in.dtype),
            dv.reshape(v_in.shape).to(v_in.dtype))


class FlashAttentionTiledFunction(torch.autograd.Function):
    """:func:`flash_attention_tiled` as an autograd function whose backward is
    :func:`flash_attention_tiled_backward` (tiles rebuilt from the saved lse, no ``[T, T]`` tensor).

    ``FlashAttentionTiledFunction.apply(q, k, v, causal=False, sm_scale=None, block_size=64)`` -> out,
    arguments by position (``Function.apply`` takes no keywords); q ``[..., H, T_q, d]``, k, v
    ``[..., H_kv, T_k, d]`` -> out like q. Saves q, k, v, out and lse (``q.shape[:-1]``)."""

    @staticmethod
    def forward(ctx, q, k, v, causal=False, sm_scale=None, block_size=64):
        out, lse = flash_attention_tiled(q, k, v, causal, block_size, sm_scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.sm_scale, ctx.block_size = causal, sm_scale, block_size
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        grads = flash_attention_tiled_backward(q, k, v, out, lse, grad_out, ctx.causal, ctx.block_size, ctx.sm_scale)
        return (*grads, None, None, None)
