"""FlashAttention in Triton (notebook 09): forward and backward kernels and an autograd wrapper.

Public API (q ``[B, H, T_q, d]``, k and v ``[B, H_kv, T_k, d]``, H % H_kv == 0; other leading
dims work too, ``[B, T, d]``, ``[T, d]``, ``[B1, B2, H, T, d]``: see ``helpers.nb09_flash_attention.flatten_batch``):

* ``flash_attention_triton(q, k, v, causal=False, sm_scale=None, deterministic=True)`` -> out
  ``[B, H, T_q, d]``, differentiable (``out.sum().backward()`` runs the backward kernels).
  ``sm_scale`` defaults to 1/sqrt(d) everywhere.
* ``FlashAttentionFunction.apply(q, k, v, causal=False, sm_scale=None, deterministic=True)``: the
  same autograd function.
* ``flash_attention_triton_forward(...)`` -> ``(out, lse)``, lse ``[B, H, T_q]`` float32, natural log.
* ``flash_attention_triton_backward(q, k, v, out, lse, grad_out, ...)`` -> ``(grad_q, grad_k, grad_v)``.

Two backward passes: ``deterministic=True`` (the default) runs a dK/dV kernel over query blocks and
a dQ kernel over key blocks (7 matrix products and 2 exponentials per score tile, bit-for-bit
repeatable); ``deterministic=False`` runs FlashAttention-2's fused one (the dK/dV kernel with
``FUSED_DQ``: 5 products and 1 exponential, dQ added in fp32 with atomics, whose order, and so
dQ's last bits, vary between runs on a GPU).

Any T (not only multiples of the block), d in {16, 32, 64, 128}, fp16 / fp32 (bf16 on a GPU only:
the interpreter's bf16 ``tl.dot`` is wrong), causal or not. Grouped-query attention (H_kv < H) reads
kv head ``h // (H // H_kv)`` through strides: K and V are never expanded. Without a CUDA GPU the
kernels run in Triton's interpreter (slow, for learning and tests); with one, they are autotuned.

On each GPU (proved ahead of time by ``make kernel-report`` and tests/test_kernel_report.py; the
tables are ``CONFIG_TABLES``): H100/H200 and newer (sm_90): wgmma and TMA loads, no configuration
spills (nor on the pointer path a tensor with unaligned rows falls back to, which has its own
tables); A100 (sm_80) and L4 (sm_89, 99 KiB of shared memory): mma.sync and cp.async, no spills;
T4 (sm_75, Colab's free GPU): it runs, with small tiles that fit 64 KiB, but Triton emits no
tensor-core instructions there (every dot is FMA) and the backward spills at d = 128, so SDPA is
faster. Refused with one line: bfloat16 below sm_80, dtypes other than fp16/bf16/fp32 (fp8
included), head dims outside SUPPORTED_HEAD_DIMS.

Loads: K and V (and the backward's streamed Q and dO) come through tensor descriptors
(``tl.make_tensor_descriptor``, the Hopper TMA copy engine) on sm_90 and newer, through pointer
grids and masks elsewhere (``USE_TMA``, ``_tma_for``: the one place that decides); both paths are
exact in the interpreter. For Triton 3.6 and later.
"""

from __future__ import annotations

from helpers.runtime import configure_triton

# Triton reads TRITON_INTERPRET when a function is decorated with @triton.jit, its own library
# (tl.zeros, tl.max, ...) included, which it decorates when `triton` is imported: decide first.
# (Importing `helpers` has already arranged that; see helpers/runtime.py.)
_INTERPRET = configure_triton()

import functools  # noqa: E402
import inspect  # noqa: E402
import math  # noqa: E402

import torch  # noqa: E402

from helpers.nb09_flash_attention import flatten_batch  # noqa: E402

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # macOS / Windows: no Triton wheels
    raise ImportError(
        "Triton is Linux-only; the Triton cells skip (on Linux: pip install triton)."
    ) from exc

LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x * LOG2E)
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)

# The interpreter runs one program at a time in NumPy: one fixed small tile (BLOCK_M, BLOCK_N) per
# kernel keeps it quick (32 runs ~3x faster than 16) while sequences of a few hundred tokens still
# span several query and key blocks. On a GPU the autotuner picks from the configs further down.
INTERPRETER_BLOCKS = {"fwd": (32, 32), "dkdv": (32, 32), "dq": (32, 32), "bwd": (32, 32)}


# --------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------


@triton.jit
def _tile_source(base, n_rows, stride_row, stride_col, offs_rows, offs_d,
                 BLOCK_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, TMA: tl.constexpr):
    """Where a kernel reads [BLOCK_ROWS, HEAD_DIM] tiles of one head's [n_rows, HEAD_DIM] rows at
    `base`: a tensor descriptor (TMA: the hardware computes the addresses; rows past n_rows read as
    zeros), or the grid of the first tile's addresses, held in registers and advanced by the caller."""
    if TMA:
        return tl.make_tensor_descriptor(base, [n_rows, HEAD_DIM], [stride_row, 1], [BLOCK_ROWS, HEAD_DIM])
    else:
        return base + offs_rows[:, None] * stride_row + offs_d[None, :] * stride_col


@triton.jit
def _fwd_inner(
    acc, l_i, m_i, q,  # running state of this query block, and the block itself
    k_src, v_src, stride_kn, stride_vn,  # K/V: tensor descriptors (TMA) or pointer grids
    offs_m, offs_n, lo, hi, N_K, qk_scale,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr,
):
    """Fold key blocks [lo, hi) into (acc, l_i, m_i). MASKED blocks mask keys j >= N_K and,
    if CAUSAL, keys j > i; unmasked blocks skip that work (and their loads need no bounds check)."""
    if not TMA:
        k_src += lo * stride_kn
        v_src += lo * stride_vn
    # lesson: inner-loop
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        # -- load one key/value block [BLOCK_N, HEAD_DIM]
        if TMA:  # one copy by the tensor memory accelerator; rows past N_K arrive as zeros
            k = k_src.load([start_n, 0])
            v = v_src.load([start_n, 0])
        elif MASKED:
            k = tl.load(k_src, mask=(cols < N_K)[:, None], other=0.0)
            v = tl.load(v_src, mask=(cols < N_K)[:, None], other=0.0)
        else:
            k = tl.load(k_src)
            v = tl.load(v_src)
        # -- scores in log2 units: s * log2(e), since qk_scale = sm_scale * log2(e)  [BLOCK_M, BLOCK_N]
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if MASKED:
            allowed = (cols < N_K)[None, :]
            if CAUSAL:
                allowed = allowed & (offs_m[:, None] >= cols[None, :])
            # -inf is safe: each row meets key 0 in its first block, so m_ij is finite.
            qk = tl.where(allowed, qk * qk_scale, float("-inf"))
            m_ij = tl.maximum(m_i, tl.max(qk, 1))
            qk = qk - m_ij[:, None]
        else:
            m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            qk = qk * qk_scale - m_ij[:, None]
        # -- online softmax: p relative to the new max; alpha rescales what was summed before
        p = tl.exp2(qk)
        alpha = tl.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_ij
        # lesson: end inner-loop
        if not TMA:
            k_src += BLOCK_N * stride_kn
            v_src += BLOCK_N * stride_vn
    return acc, l_i, m_i


@triton.jit
def _attn_fwd(
    Q, K, V, Out, Lse, qk_scale,
    stride_qz, stride_qh, stride_qm, stride_qd,
    stride_kz, stride_kh, stride_kn, stride_kd,
    stride_vz, stride_vh, stride_vn, stride_vd,
    stride_oz, stride_oh, stride_om, stride_od,
    H, N_Q, N_K, GROUP,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr = False,
):
    """One program = BLOCK_M query rows of one (batch, head). Grid: (cdiv(N_Q, BLOCK_M), B * H).
    TMA: K and V arrive through tensor descriptors (Hopper's copy engine) instead of pointer grids."""
    # -- which tile: causal blocks lower down see more keys, so launch those first (better balance)
    # lesson: program-ids
    start_m = tl.program_id(0)
    if CAUSAL:
        start_m = tl.num_programs(0) - 1 - start_m
    off_hz = tl.program_id(1)
    off_z = (off_hz // H).to(tl.int64)
    off_h = (off_hz % H).to(tl.int64)
    off_hkv = off_h // GROUP  # grouped-query attention: several query heads share one kv head

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q_ptrs = Q + off_z * stride_qz + off_h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd
    # lesson: end program-ids
    # lesson: kv-sources
    # this (batch, kv head)'s [N_K, HEAD_DIM] keys and values: descriptors (TMA) or address grids
    k_src = _tile_source(K + off_z * stride_kz + off_hkv * stride_kh, N_K, stride_kn, stride_kd, offs_n, offs_d,
                         BLOCK_N, HEAD_DIM, TMA)
    v_src = _tile_source(V + off_z * stride_vz + off_hkv * stride_vh, N_K, stride_vn, stride_vd, offs_n, offs_d,
                         BLOCK_N, HEAD_DIM, TMA)
    # lesson: end kv-sources

    # -- load the query block once; it stays in registers for the whole loop
    # lesson: row-mask
    row_ok = offs_m < N_Q
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max (log2 units)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp2(s - m_i)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)  # running sum of p @ v
    # lesson: end row-mask

    if CAUSAL:
        tl.static_assert(BLOCK_M % BLOCK_N == 0, "causal: key blocks must tile the query block")
        # stage 1: key blocks left of the diagonal, all visible: no mask
        lo = start_m * BLOCK_M
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_src, v_src, stride_kn, stride_vn,
                                   offs_m, offs_n, 0, lo, N_K, qk_scale,
                                   BLOCK_N, False, CAUSAL, DOT_PRECISION, TMA)
        # stage 2: the diagonal block, masked; blocks right of it are never loaded
        hi = tl.minimum(lo + BLOCK_M, N_K)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_src, v_src, stride_kn, stride_vn,
                                   offs_m, offs_n, lo, hi, N_K, qk_scale,
                                   BLOCK_N, True, CAUSAL, DOT_PRECISION, TMA)
    else:
        # stage 1: full key blocks, no mask; stage 2: the ragged last block (if N_K % BLOCK_N)
        n_full = (N_K // BLOCK_N) * BLOCK_N
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_src, v_src, stride_kn, stride_vn,
                                   offs_m, offs_n, 0, n_full, N_K, qk_scale,
                                   BLOCK_N, False, CAUSAL, DOT_PRECISION, TMA)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_src, v_src, stride_kn, stride_vn,
                                   offs_m, offs_n, n_full, N_K, N_K, qk_scale,
                                   BLOCK_N, True, CAUSAL, DOT_PRECISION, TMA)

    # lesson: epilogue
    # -- epilogue: normalise, and save the natural-log logsumexp for the backward pass
    acc = acc / l_i[:, None]
    lse = (m_i + tl.log2(l_i)) * 0.6931471805599453  # ln(2): back from log2 units
    tl.store(Lse + off_hz.to(tl.int64) * N_Q + offs_m, lse, mask=row_ok)
    o_ptrs = Out + off_z * stride_oz + off_h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od
    tl.store(o_ptrs, acc.to(Out.dtype.element_ty), mask=row_ok[:, None])
    # lesson: end epilogue


# --------------------------------------------------------------------------------------------
# Backward: D = rowsum(dO * O), then dK/dV (loop over query blocks), then dQ (loop over key blocks)
# P is recomputed from the saved lse: P_ij = exp(s_ij - lse_i). With dS = P * (dP - D):
#   dV = P^T dO,   dP = dO V^T,   dQ = sm_scale * dS K,   dK = sm_scale * dS^T Q
# --------------------------------------------------------------------------------------------


@triton.jit
def _bwd_preprocess(
    Out, DO, Delta, DQ_ACC,
    stride_oz, stride_oh, stride_om, stride_od,
    stride_dz, stride_dh, stride_dm, stride_dd,
    H, N_Q,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, ZERO_DQ: tl.constexpr = False,
):
    """Delta[b, h, i] = sum_d dO[b, h, i, d] * O[b, h, i, d]. Grid: (cdiv(N_Q, BLOCK_M), B * H).
    ZERO_DQ: also zero the fused backward's fp32 dQ accumulator, contiguous [B, H, N_Q, HEAD_DIM]
    (one launch instead of two)."""
    off_hz = tl.program_id(1)
    off_z = (off_hz // H).to(tl.int64)
    off_h = (off_hz % H).to(tl.int64)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = (offs_m < N_Q)[:, None]
    o = tl.load(Out + off_z * stride_oz + off_h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od,
                mask=row_ok, other=0.0)
    do = tl.load(DO + off_z * stride_dz + off_h * stride_dh + offs_m[:, None] * stride_dm + offs_d[None, :] * stride_dd,
                 mask=row_ok, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(Delta + off_hz.to(tl.int64) * N_Q + offs_m, delta, mask=offs_m < N_Q)
    if ZERO_DQ:
        zeros = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        tl.store(DQ_ACC + (off_hz.to(tl.int64) * N_Q + offs_m[:, None]) * HEAD_DIM + offs_d[None, :], zeros, mask=row_ok)


@triton.jit
def _bwd_dkdv_inner(
    dk, dv, k, v,  # accumulators [BLOCK_N, HEAD_DIM] (fp32) and this program's key/value block
    q_src, do_src, lse_ptr, delta_ptr, stride_qm, stride_dm,  # Q/dO: descriptors (TMA) or pointers
    dq_ptrs, stride_aqm, sm_scale,  # FUSED_DQ: this head's fp32 dQ accumulator: pointers to rows 0..BLOCK_M
    offs_n, offs_m, lo, hi, N_Q, qk_scale,
    BLOCK_M: tl.constexpr, DIAGONAL: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr,
    FUSED_DQ: tl.constexpr,
):
    """Add the contributions of query blocks [lo, hi) to dk, dv, working on transposed tiles
    [BLOCK_N keys, BLOCK_M queries]. DIAGONAL blocks mask keys j > i (causal). Rows i >= N_Q load
    as zeros (q, dO, lse, Delta), which makes their contribution exactly zero: no mask needed.
    FUSED_DQ: also add dS K (this key block's share of dQ) to the query rows' accumulator with
    atomic adds; keys j >= N_K load as zeros, so they add nothing."""
    if not TMA:
        q_src += lo * stride_qm
        do_src += lo * stride_dm
    dq_ptrs += lo * stride_aqm
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m
        row_ok = rows < N_Q
        # -- load one query block, its dO, lse and Delta
        if TMA:
            q = q_src.load([start_m, 0])
            do = do_src.load([start_m, 0])
        else:
            q = tl.load(q_src, mask=row_ok[:, None], other=0.0)
            do = tl.load(do_src, mask=row_ok[:, None], other=0.0)
        lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
        delta = tl.load(delta_ptr + rows, mask=row_ok, other=0.0)
        # -- recompute P^T = exp(S^T - lse) in log2 units  [BLOCK_N, BLOCK_M]
        # lesson: dkdv-step
        qkT = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
        pT = tl.exp2(qkT * qk_scale - (lse * 1.4426950408889634)[None, :])  # log2(e)
        if DIAGONAL:
            pT = tl.where(rows[None, :] >= offs_n[:, None], pT, 0.0)
        # -- dV += P^T dO ;  dS^T = P^T * (dP^T - Delta) ;  dK += dS^T Q
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        dsT = (pT * (dpT - delta[None, :])).to(q.dtype)
        dk = tl.dot(dsT, q, dk, input_precision=DOT_PRECISION)
        # lesson: end dkdv-step
        # lesson: fused-dq
        if FUSED_DQ:  # the fifth product: dQ += sm_scale * dS K, summed over key blocks by atomics
            dq = tl.dot(tl.trans(dsT), k, input_precision=DOT_PRECISION)  # [BLOCK_M, HEAD_DIM]
            tl.atomic_add(dq_ptrs, dq * sm_scale, mask=row_ok[:, None], sem="relaxed")
        # lesson: end fused-dq
        if not TMA:
            q_src += BLOCK_M * stride_qm
            do_src += BLOCK_M * stride_dm
        dq_ptrs += BLOCK_M * stride_aqm
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(
    Q, K, V, DO, DK, DV, DQ_ACC, Lse, Delta, qk_scale, sm_scale,
    stride_qz, stride_qh, stride_qm, stride_qd,
    stride_kz, stride_kh, stride_kn, stride_kd,
    stride_vz, stride_vh, stride_vn, stride_vd,
    stride_dz, stride_dh, stride_dm, stride_dd,
    stride_dkz, stride_dkh, stride_dkn, stride_dkd,
    stride_dvz, stride_dvh, stride_dvn, stride_dvd,
    H, H_KV, N_Q, N_K, GROUP,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr = False, FUSED_DQ: tl.constexpr = False,
):
    """One program = BLOCK_N keys of one (batch, kv head); it loops over the GROUP query heads
    that share this kv head, so GQA needs no atomics for dK, dV. Grid: (cdiv(N_K, BLOCK_N), B * H_kv).
    FUSED_DQ (the fused backward): dQ too, added with atomics into DQ_ACC, fp32, contiguous
    [B, H, N_Q, HEAD_DIM] and zeroed beforehand; without it DQ_ACC is not touched."""
    start_n = tl.program_id(0)
    off_zh = tl.program_id(1)
    off_z = (off_zh // H_KV).to(tl.int64)
    off_hkv = (off_zh % H_KV).to(tl.int64)

    offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    key_ok = (offs_n < N_K)[:, None]
    # -- this program's keys and values stay on chip; dK, dV accumulate in fp32
    k = tl.load(K + off_z * stride_kz + off_hkv * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                mask=key_ok, other=0.0)
    v = tl.load(V + off_z * stride_vz + off_hkv * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                mask=key_ok, other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)

    for g in range(GROUP):
        off_h = off_hkv * GROUP + g
        q_src = _tile_source(Q + off_z * stride_qz + off_h * stride_qh, N_Q, stride_qm, stride_qd, offs_m, offs_d,
                             BLOCK_M, HEAD_DIM, TMA)
        do_src = _tile_source(DO + off_z * stride_dz + off_h * stride_dh, N_Q, stride_dm, stride_dd, offs_m, offs_d,
                              BLOCK_M, HEAD_DIM, TMA)
        lse_ptr = Lse + (off_z * H + off_h) * N_Q
        delta_ptr = Delta + (off_z * H + off_h) * N_Q
        dq_ptrs = DQ_ACC + (off_z * H + off_h) * N_Q * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
        if CAUSAL:
            tl.static_assert(BLOCK_N % BLOCK_M == 0, "causal: query blocks must tile the key block")
            # stage 1: the diagonal: queries in the same rows as these keys, masked j <= i.
            # Queries above it (i < start_n * BLOCK_N) see none of these keys: skipped.
            lo = start_n * BLOCK_N
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_src, do_src, lse_ptr, delta_ptr, stride_qm, stride_dm,
                                     dq_ptrs, HEAD_DIM, sm_scale, offs_n, offs_m, lo, tl.minimum(lo + BLOCK_N, N_Q), N_Q, qk_scale,
                                     BLOCK_M, True, DOT_PRECISION, TMA, FUSED_DQ)
            # stage 2: query blocks below the diagonal see all these keys: no mask
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_src, do_src, lse_ptr, delta_ptr, stride_qm, stride_dm,
                                     dq_ptrs, HEAD_DIM, sm_scale, offs_n, offs_m, lo + BLOCK_N, N_Q, N_Q, qk_scale,
                                     BLOCK_M, False, DOT_PRECISION, TMA, FUSED_DQ)
        else:
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_src, do_src, lse_ptr, delta_ptr, stride_qm, stride_dm,
                                     dq_ptrs, HEAD_DIM, sm_scale, offs_n, offs_m, 0, N_Q, N_Q, qk_scale,
                                     BLOCK_M, False, DOT_PRECISION, TMA, FUSED_DQ)

    dk = dk * sm_scale  # dS was taken w.r.t. the scaled scores
    dk_ptrs = DK + off_z * stride_dkz + off_hkv * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd
    dv_ptrs = DV + off_z * stride_dvz + off_hkv * stride_dvh + offs_n[:, None] * stride_dvn + offs_d[None, :] * stride_dvd
    tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=key_ok)
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=key_ok)


@triton.jit
def _bwd_dq_inner(
    dq, q, do, m2, delta,  # accumulator [BLOCK_M, HEAD_DIM] and this program's query-side tiles
    k_src, v_src, stride_kn, stride_vn,  # K/V: descriptors (TMA) or pointer grids
    offs_m, offs_n, lo, hi, N_K, qk_scale,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr,
):
    """Add the contributions of key blocks [lo, hi) to dq. MASKED blocks mask keys j >= N_K and,
    if CAUSAL, keys j > i."""
    if not TMA:
        k_src += lo * stride_kn
        v_src += lo * stride_vn
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        if TMA:
            k = k_src.load([start_n, 0])
            v = v_src.load([start_n, 0])
        elif MASKED:
            k = tl.load(k_src, mask=(cols < N_K)[:, None], other=0.0)
            v = tl.load(v_src, mask=(cols < N_K)[:, None], other=0.0)
        else:
            k = tl.load(k_src)
            v = tl.load(v_src)
        # -- recompute P = exp2(S * log2(e) - lse * log2(e))  [BLOCK_M, BLOCK_N]
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        p = tl.exp2(qk * qk_scale - m2[:, None])
        if MASKED:
            allowed = (cols < N_K)[None, :]
            if CAUSAL:
                allowed = allowed & (offs_m[:, None] >= cols[None, :])
            p = tl.where(allowed, p, 0.0)
        # -- dP = dO V^T ;  dS = P * (dP - Delta) ;  dQ += dS K
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
        if not TMA:
            k_src += BLOCK_N * stride_kn
            v_src += BLOCK_N * stride_vn
    return dq


@triton.jit
def _attn_bwd_dq(
    Q, K, V, DO, DQ, Lse, Delta, qk_scale, sm_scale,
    stride_qz, stride_qh, stride_qm, stride_qd,
    stride_kz, stride_kh, stride_kn, stride_kd,
    stride_vz, stride_vh, stride_vn, stride_vd,
    stride_dz, stride_dh, stride_dm, stride_dd,
    stride_dqz, stride_dqh, stride_dqm, stride_dqd,
    H, N_Q, N_K, GROUP,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr = False,
):
    """One program = BLOCK_M query rows of one (batch, head), like the forward. Grid: (cdiv(N_Q, BLOCK_M), B * H)."""
    start_m = tl.program_id(0)
    if CAUSAL:
        start_m = tl.num_programs(0) - 1 - start_m
    off_hz = tl.program_id(1)
    off_z = (off_hz // H).to(tl.int64)
    off_h = (off_hz % H).to(tl.int64)
    off_hkv = off_h // GROUP

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < N_Q
    # -- this program's q, dO, lse, Delta, loaded once
    q = tl.load(Q + off_z * stride_qz + off_h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + off_z * stride_dz + off_h * stride_dh + offs_m[:, None] * stride_dm + offs_d[None, :] * stride_dd,
                 mask=row_ok[:, None], other=0.0)
    m2 = tl.load(Lse + off_hz.to(tl.int64) * N_Q + offs_m, mask=row_ok, other=0.0) * 1.4426950408889634  # log2 units
    delta = tl.load(Delta + off_hz.to(tl.int64) * N_Q + offs_m, mask=row_ok, other=0.0)
    k_src = _tile_source(K + off_z * stride_kz + off_hkv * stride_kh, N_K, stride_kn, stride_kd, offs_n, offs_d,
                         BLOCK_N, HEAD_DIM, TMA)
    v_src = _tile_source(V + off_z * stride_vz + off_hkv * stride_vh, N_K, stride_vn, stride_vd, offs_n, offs_d,
                         BLOCK_N, HEAD_DIM, TMA)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    if CAUSAL:
        tl.static_assert(BLOCK_M % BLOCK_N == 0, "causal: key blocks must tile the query block")
        # stage 1: key blocks left of the diagonal, no mask; stage 2: the diagonal block, masked
        lo = start_m * BLOCK_M
        dq = _bwd_dq_inner(dq, q, do, m2, delta, k_src, v_src, stride_kn, stride_vn,
                           offs_m, offs_n, 0, lo, N_K, qk_scale, BLOCK_N, False, CAUSAL, DOT_PRECISION, TMA)
        dq = _bwd_dq_inner(dq, q, do, m2, delta, k_src, v_src, stride_kn, stride_vn,
                           offs_m, offs_n, lo, tl.minimum(lo + BLOCK_M, N_K), N_K, qk_scale,
                           BLOCK_N, True, CAUSAL, DOT_PRECISION, TMA)
    else:
        # stage 1: full key blocks, no mask; stage 2: the ragged last block
        n_full = (N_K // BLOCK_N) * BLOCK_N
        dq = _bwd_dq_inner(dq, q, do, m2, delta, k_src, v_src, stride_kn, stride_vn,
                           offs_m, offs_n, 0, n_full, N_K, qk_scale, BLOCK_N, False, CAUSAL, DOT_PRECISION, TMA)
        dq = _bwd_dq_inner(dq, q, do, m2, delta, k_src, v_src, stride_kn, stride_vn,
                           offs_m, offs_n, n_full, N_K, N_K, qk_scale, BLOCK_N, True, CAUSAL, DOT_PRECISION, TMA)

    dq = dq * sm_scale
    dq_ptrs = DQ + off_z * stride_dqz + off_h * stride_dqh + offs_m[:, None] * stride_dqm + offs_d[None, :] * stride_dqd
    tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])


# --------------------------------------------------------------------------------------------
# Launch configurations: one fixed small tile in the interpreter, autotuning on a GPU
# --------------------------------------------------------------------------------------------

# (BLOCK_M, BLOCK_N, num_warps, num_stages). Causal two-stage loops need the key block to tile
# the query block (forward, dQ: BLOCK_M % BLOCK_N == 0; dK/dV: BLOCK_N % BLOCK_M == 0).
FWD_CONFIGS = [
    (128, 64, 4, 3), (128, 64, 4, 4), (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3),
    (128, 128, 8, 2), (128, 32, 4, 4), (64, 64, 4, 3), (64, 32, 4, 4),
]
DKDV_CONFIGS = [  # few queries x many keys: the kv block stays put, query blocks stream by
    (32, 128, 8, 3), (16, 128, 8, 3), (64, 128, 8, 2), (64, 128, 8, 3),
    (32, 64, 4, 3), (32, 64, 4, 4), (32, 64, 8, 3), (64, 64, 8, 3),
]
DQ_CONFIGS = [  # many queries x few keys
    (128, 32, 4, 3), (128, 32, 8, 3), (128, 64, 8, 2), (128, 64, 8, 3),
    (64, 32, 4, 3), (64, 32, 4, 4), (64, 64, 4, 3),
]
BWD_CONFIGS = [  # the fused backward (dK/dV's loop, plus dQ by atomics): the kv block stays put
    (64, 128, 8, 2), (64, 128, 8, 3), (32, 128, 8, 3), (16, 128, 8, 3),
    (64, 64, 4, 3), (32, 64, 4, 3), (32, 64, 8, 3), (64, 64, 8, 3),
]


# Per head dim and GPU generation, the rows of the tables above that compile without spilling
# registers (`make kernel-report`: helpers/results/kernel_aot.md; tests/test_kernel_report.py keeps
# them clean). A table missing here falls back to the generic one.
# Ampere (A100): pointer grids. The Hopper pointer path and Ada start from these rows.
_AMPERE = {
    ("fwd", 64): [(128, 64, 4, 4), (128, 64, 8, 3), (128, 64, 8, 4), (128, 32, 4, 4), (64, 64, 4, 3),
                  (64, 32, 4, 4)],
    ("fwd", 128): [(64, 32, 4, 4), (64, 32, 4, 3), (64, 32, 8, 3), (64, 64, 8, 3), (64, 64, 8, 2),
                   (32, 32, 4, 3)],
    ("dkdv", 64): [(32, 128, 8, 3), (16, 128, 8, 3), (32, 64, 4, 3), (32, 64, 4, 4), (32, 64, 8, 3)],
    ("dkdv", 128): [(16, 128, 8, 3), (32, 64, 4, 4), (32, 64, 8, 3), (64, 64, 8, 3)],
    ("dq", 64): DQ_CONFIGS,
    ("dq", 128): [(128, 32, 8, 3), (64, 32, 4, 3), (64, 32, 4, 4)],
}


def _ampere_less(kind: str, head_dim: int, *dropped: tuple[int, ...]) -> list[tuple[int, int, int, int]]:
    """Ampere's rows for (kind, head_dim) without ``dropped``, in their order."""
    return [row for row in _AMPERE[kind, head_dim] if row not in dropped]


CONFIG_TABLES: dict[tuple[str, int, str], list[tuple[int, int, int, int]]] = {
    # Hopper: K/V through TMA
    ("fwd", 64, "sm_90"): FWD_CONFIGS,
    ("fwd", 128, "sm_90"): [row for row in FWD_CONFIGS if row[:3] != (128, 64, 4)],
    ("dkdv", 64, "sm_90"): DKDV_CONFIGS,
    ("dkdv", 128, "sm_90"): [row for row in DKDV_CONFIGS if row[:2] != (64, 128)],
    ("dq", 64, "sm_90"): DQ_CONFIGS,
    ("dq", 128, "sm_90"): [row for row in DQ_CONFIGS if row != (128, 32, 4, 3)],
    # Hopper without descriptors (a tensor whose rows are not 16-byte aligned, or a Triton without
    # tl.make_tensor_descriptor): pointer grids, Ampere's rows less those that spill with wgmma
    # (or, 32x32 with 4 warps, have too few rows for it)
    ("fwd", 64, "sm_90-pointers"): _ampere_less("fwd", 64, (128, 64, 4, 4)),
    ("fwd", 128, "sm_90-pointers"): _ampere_less("fwd", 128, (32, 32, 4, 3)),
    ("dkdv", 64, "sm_90-pointers"): _ampere_less("dkdv", 64),
    ("dkdv", 128, "sm_90-pointers"): _ampere_less("dkdv", 128, (32, 64, 4, 4), (64, 64, 8, 3)),
    ("dq", 64, "sm_90-pointers"): _ampere_less("dq", 64),
    ("dq", 128, "sm_90-pointers"): _ampere_less("dq", 128),
    **{(kind, head_dim, "sm_80"): rows for (kind, head_dim), rows in _AMPERE.items()},
    # The fused backward (dK/dV's loop with dQ's atomics: k, v, dK and dV all stay in registers). At
    # d = 128 every tile with 64 x 128 or more spills, 16 warps included (their 128-register ceiling);
    # Hopper's pointer path keeps fewer rows than its TMA path. Spill-free with Triton 3.9 and 3.6
    # (kernel_aot.json, kernel_aot_triton36.json: 3.6 spills 32 x 64 with 4 warps at d = 128 and
    # 64 x 64 with 4 warps on the pointer path at d = 64, both causal, which 3.9 does not).
    ("bwd", 64, "sm_90"): [(64, 128, 8, 3), (32, 128, 8, 3), (32, 128, 8, 2), (16, 128, 8, 3), (64, 64, 8, 2),
                           (64, 64, 8, 3), (64, 64, 4, 3), (32, 64, 4, 3), (32, 64, 8, 3)],
    ("bwd", 128, "sm_90"): [(32, 128, 8, 3), (32, 128, 8, 2), (16, 128, 8, 3), (32, 64, 8, 3)],
    ("bwd", 64, "sm_90-pointers"): [(64, 128, 8, 3), (32, 128, 8, 3), (32, 128, 8, 2), (16, 128, 8, 3),
                                    (64, 64, 8, 2), (64, 64, 8, 3), (32, 64, 4, 3), (32, 64, 8, 3)],
    ("bwd", 128, "sm_90-pointers"): [(16, 128, 8, 3), (32, 64, 8, 3)],
    ("bwd", 64, "sm_80"): [(32, 128, 8, 3), (16, 128, 8, 3), (64, 64, 8, 3), (32, 64, 8, 3)],
    ("bwd", 128, "sm_80"): [(16, 128, 8, 3), (64, 64, 8, 3), (32, 64, 8, 3)],
    ("bwd", 64, "sm_89"): [(32, 128, 8, 3), (16, 128, 8, 3), (32, 64, 8, 3), (32, 64, 4, 3), (32, 64, 4, 4)],
    ("bwd", 128, "sm_89"): [(16, 128, 8, 3), (32, 64, 8, 3)],
    ("bwd", 64, "sm_75"): [(16, 32, 4, 1)],
    ("bwd", 128, "sm_75"): [(16, 32, 4, 1)],
    # Turing (T4): Triton emits no tensor-core instructions (every dot is FMA) and a block has 64 KiB of
    # shared memory: the tiles with the fewest spills that fit. The backward still spills at d = 128.
    ("fwd", 64, "sm_75"): [(32, 32, 4, 1)],
    ("fwd", 128, "sm_75"): [(32, 16, 4, 1)],
    ("dkdv", 64, "sm_75"): [(16, 32, 4, 1)],
    ("dkdv", 128, "sm_75"): [(16, 32, 4, 1)],
    ("dq", 64, "sm_75"): [(32, 16, 4, 1)],
    ("dq", 128, "sm_75"): [(16, 16, 4, 1)],
    # Ada (L4): Ampere's rows that fit its 99 KiB of shared memory per block
    ("fwd", 64, "sm_89"): _ampere_less("fwd", 64, (128, 32, 4, 4)),
    ("fwd", 128, "sm_89"): _ampere_less("fwd", 128),
    ("dkdv", 64, "sm_89"): _ampere_less("dkdv", 64),
    ("dkdv", 128, "sm_89"): _ampere_less("dkdv", 128, (64, 64, 8, 3)),
    ("dq", 64, "sm_89"): _ampere_less("dq", 64),
    ("dq", 128, "sm_89"): _ampere_less("dq", 128),
}


def gpu_target(capability: tuple[int, int]) -> str:
    """The generation whose tables a GPU uses: "sm_90" (Hopper and newer: TMA), "sm_89" (Ada:
    L4), "sm_80" (Ampere: A100), "sm_75" (Turing: T4), from ``torch.cuda.get_device_capability``."""
    if capability >= (9, 0):
        return "sm_90"
    if capability == (8, 9):
        return "sm_89"
    return "sm_80" if capability >= (8, 0) else "sm_75"


def table_name(target: str, tma: bool) -> str:
    """Which tables a launch tunes over: the generation's ("sm_90", "sm_80", ...), except on Hopper
    without descriptors, whose pointer path has its own ("sm_90-pointers")."""
    return "sm_90-pointers" if target == "sm_90" and not tma else target


def config_table(kind: str, head_dim: int, table: str) -> list[tuple[int, int, int, int]]:
    """The (BLOCK_M, BLOCK_N, num_warps, num_stages) rows the autotuner tries for kernel `kind` at
    this head dim in ``table``, the GPU generation's tables as :func:`table_name` names them ("sm_90",
    "sm_90-pointers"; head dims below 64 use the 64 tables)."""
    generic = {"fwd": FWD_CONFIGS, "dkdv": DKDV_CONFIGS, "dq": DQ_CONFIGS, "bwd": BWD_CONFIGS}[kind]
    return CONFIG_TABLES.get((kind, max(head_dim, 64), table), generic)


LESSON_MARK = "# lesson:"


def lesson_part(kernel, part: str) -> str:
    """The source lines of ``kernel`` between its ``# lesson: <part>`` and ``# lesson: end <part>``
    comments (not included): what notebook 09 prints of the kernel, part by part. A part that is
    not there raises ``LookupError`` naming the markers to restore (tests/test_pipeline.py checks
    every part the notebook shows)."""
    fn = getattr(kernel, "fn", kernel)
    lines = inspect.getsource(fn).splitlines()
    begin = [i for i, line in enumerate(lines) if line.strip() == f"{LESSON_MARK} {part}"]
    end = [i for i, line in enumerate(lines) if line.strip() == f"{LESSON_MARK} end {part}"]
    if len(begin) != 1 or len(end) != 1 or end[0] <= begin[0]:
        raise LookupError(
            f"helpers/nb09_triton_flash.py: {fn.__name__} has no part {part!r} (one '{LESSON_MARK} {part}' line, "
            f"then one '{LESSON_MARK} end {part}' line). Notebook 09 prints it with show_source(..., {part!r}): "
            "put the two comments back around that code, or change the part the notebook's cell names.")
    return "\n".join(lines[begin[0] + 1 : end[0]])


def valid_config(kind: str, block_m: int, block_n: int, causal: bool, n_q: int, n_k: int) -> bool:
    """Whether a tile (block_m query rows x block_n keys) suits kernel `kind` ("fwd", "dkdv", "dq",
    "bwd": the fused backward, whose loops are dK/dV's).

    Causal loops need one block size to divide the other; tiles much larger than the sequence
    only waste work (tiles up to 64 always pass, so short sequences keep several configs)."""
    if causal and kind in ("fwd", "dq") and block_m % block_n:
        return False
    if causal and kind in ("dkdv", "bwd") and block_n % block_m:
        return False
    too_big = block_m > max(64, triton.next_power_of_2(n_q)) or block_n > max(64, triton.next_power_of_2(n_k))
    return not too_big


TUNE_FROM_T = 1024  # shorter sequences take the smallest valid tile: tuning would cost more than it saves


def _pruner(kind: str):
    """An `early_config_prune` hook for triton.autotune that keeps the valid configs of `kind`.

    Below TUNE_FROM_T it keeps only the smallest tile, so tests and notebooks compile one config
    (small tiles also fit fp32 in shared memory and give short sequences more programs)."""

    def prune(configs, named_args, **kwargs):
        args = {**named_args, **kwargs}
        kept = [
            c for c in configs
            if valid_config(kind, c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], bool(args["CAUSAL"]), args["N_Q"], args["N_K"])
        ] or configs[-1:]
        if max(args["N_Q"], args["N_K"]) >= TUNE_FROM_T:
            return kept
        resident = "BLOCK_N" if kind in ("dkdv", "bwd") else "BLOCK_M"  # the block a program keeps on chip
        return [min(kept, key=lambda c: (c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"], c.kwargs[resident], c.num_stages))]

    return prune


def triton_configs(table: list[tuple[int, int, int, int]]) -> list[triton.Config]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) rows -> triton.Config objects (no GPU needed)."""
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s) for bm, bn, w, s in table]


KINDS = ("fwd", "dkdv", "dq", "bwd")  # the launchers' order; "bwd" is the dK/dV kernel with FUSED_DQ


@functools.cache
def _kernels(interpret: bool, head_dim: int = 64, table: str = "sm_90"):
    """(forward, dK/dV, dQ, fused backward) launchers: the plain kernels in the interpreter, autotuned
    ones on a GPU, each tuning over ``config_table(kind, head_dim, table)`` (the fused backward is the
    dK/dV kernel launched with FUSED_DQ=True, tuned over its own table).

    Built on first use, never at import, so importing this module touches no GPU driver."""
    if interpret:
        return _attn_fwd, _attn_bwd_dkdv, _attn_bwd_dq, _attn_bwd_dkdv
    key = ["N_Q", "N_K", "HEAD_DIM", "CAUSAL", "TMA"]
    tune = lambda kind, fn: triton.autotune(  # noqa: E731
        configs=triton_configs(config_table(kind, head_dim, table)), key=key,
        prune_configs_by={"early_config_prune": _pruner(kind)},
        # the fused kernel adds into dQ's accumulator: each timed run must start from zeros
        reset_to_zero=["DQ_ACC"] if kind == "bwd" else None,
    )(fn)
    return tune("fwd", _attn_fwd), tune("dkdv", _attn_bwd_dkdv), tune("dq", _attn_bwd_dq), tune("bwd", _attn_bwd_dkdv)


def _launchers(q: torch.Tensor, tma: bool):
    """The (forward, dK/dV, dQ, fused backward) launchers for q's head dim, GPU generation and load path."""
    if _INTERPRET:
        return _kernels(True)
    target = gpu_target(torch.cuda.get_device_capability(q.device))
    return _kernels(False, q.shape[-1], table_name(target, tma))


def _fixed_blocks(kind: str) -> dict:
    """Tile sizes passed explicitly in the interpreter; empty on a GPU, where the autotuner picks them."""
    if not _INTERPRET:
        return {}
    block_m, block_n = INTERPRETER_BLOCKS[kind]
    return {"BLOCK_M": block_m, "BLOCK_N": block_n}


# --------------------------------------------------------------------------------------------
# Input checks and launchers
# --------------------------------------------------------------------------------------------


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> None:
    """Raise ValueError (with the offending shapes/dtypes) unless q, k, v (4-D, from
    :func:`helpers.nb09_flash_attention.flatten_batch`) suit the kernels."""
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    allowed = (torch.float16, torch.float32) if _INTERPRET else (torch.float16, torch.bfloat16, torch.float32)
    if q.dtype not in allowed:
        extra = " (bfloat16 needs a GPU: the interpreter's bf16 tl.dot is wrong)" if q.dtype == torch.bfloat16 else ""
        raise ValueError(f"dtype {q.dtype} is not supported; use one of {[str(a) for a in allowed]}{extra}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    if _INTERPRET and q.device.type != "cpu":
        raise ValueError(f"the Triton interpreter is on (TRITON_INTERPRET=1): tensors must be on the CPU, not {q.device}")
    if not _INTERPRET and q.device.type == "cuda" and q.dtype == torch.bfloat16 \
            and torch.cuda.get_device_capability(q.device) < (8, 0):
        raise ValueError("bfloat16 needs an Ampere (sm_80) or newer GPU, whose tensor cores take it; "
                         f"this one is sm_{''.join(map(str, torch.cuda.get_device_capability(q.device)))}: use float16")
    if not _INTERPRET and q.device.type != "cuda":
        raise ValueError(
            f"tensors are on {q.device} but Triton is compiling for the GPU; move them to CUDA, or set "
            "TRITON_INTERPRET=1 before importing helpers.nb09_triton_flash to run on the CPU"
        )
    B, H, T_q, d = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[3] != d:
        raise ValueError(f"q {tuple(q.shape)} and k/v {tuple(k.shape)} must agree on d (the last dim)")
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim d={d} is not supported; use one of {SUPPORTED_HEAD_DIMS}")
    if H % k.shape[1]:
        raise ValueError(f"query heads H={H} must be a multiple of key/value heads H_kv={k.shape[1]}")
    if T_q < 1 or k.shape[2] < 1:
        raise ValueError(f"sequence lengths must be >= 1; got T_q={T_q}, T_k={k.shape[2]}")
    if causal and T_q != k.shape[2]:
        raise ValueError(f"causal=True needs T_q == T_k; got T_q={T_q}, T_k={k.shape[2]}")
    if B * H > 65535:
        raise ValueError(f"B * H = {B * H} exceeds 65535, the limit of the kernels' second grid axis")


# lesson: tma-dispatch
# K and V (and the backward's streamed Q and dO) reach the kernels through tensor descriptors
# where the GPU has a tensor memory accelerator (TMA: Hopper, sm_90, and newer) and the installed
# Triton builds descriptors inside kernels (tl.make_tensor_descriptor); elsewhere through pointer
# grids. USE_TMA = None decides per call; False forces pointers; True also takes descriptors in the
# interpreter (the tests run both paths there).
USE_TMA: bool | None = None


def _tma_allowed(capability: tuple[int, int] | None) -> bool:
    """Whether descriptors may be used on a GPU of this compute capability (None: the interpreter)."""
    if USE_TMA is False or not hasattr(tl, "make_tensor_descriptor"):
        return False
    return USE_TMA is True or (capability is not None and capability >= (9, 0))


def _tma_for(*tensors: torch.Tensor) -> bool:
    """Whether this call loads through tensor descriptors: the one place that decides."""
    if not _tma_allowed(None if _INTERPRET else torch.cuda.get_device_capability(tensors[0].device)):
        return False
    # a descriptor needs a contiguous last dim, and 16-byte aligned bases and row strides
    return all(t.stride(-1) == 1 and t.data_ptr() % 16 == 0
               and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1]) for t in tensors)
# lesson: end tma-dispatch


def _descriptor_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Global memory Triton asks for when a kernel builds tensor descriptors on the GPU."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _prepare(tma: bool) -> bool:
    """Before a launch with descriptors on a GPU: give Triton an allocator for their scratch."""
    if tma and not _INTERPRET:
        triton.set_allocator(_descriptor_scratch)
    return tma


def _scale(d: int, sm_scale: float | None) -> float:
    return 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)


def _dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs: exact fp32 products ("ieee"), like torch; fp16/bf16: tensor cores regardless."""
    return "ieee" if dtype == torch.float32 else "tf32"


def flash_attention_triton_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False, sm_scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward kernel, no autograd: q ``[B, H, T_q, d]``, k, v ``[B, H_kv, T_k, d]``
    -> ``(out [B, H, T_q, d] in q's dtype, lse [B, H, T_q] float32, natural log)``
    (other leading dims: out like q, lse ``q.shape[:-1]``)."""
    q_in = q
    q, k, v = flatten_batch(q, k, v)
    _check_inputs(q, k, v, causal)
    B, H, T_q, d = q.shape
    H_kv, T_k = k.shape[1], k.shape[2]
    scale = _scale(d, sm_scale)
    out = torch.empty((B, H, T_q, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, T_q), dtype=torch.float32, device=q.device)
    tma = _prepare(_tma_for(k, v))
    fwd = _launchers(q, tma)[0]
    grid = lambda meta: (triton.cdiv(T_q, meta["BLOCK_M"]), B * H)  # noqa: E731
    fwd[grid](
        q, k, v, out, lse, scale * LOG2E,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        H, T_q, T_k, H // H_kv,
        HEAD_DIM=d, CAUSAL=bool(causal), DOT_PRECISION=_dot_precision(q.dtype), TMA=tma,
        **_fixed_blocks("fwd"),
    )
    return out.reshape(q_in.shape), lse.reshape(q_in.shape[:-1])


def flash_attention_triton_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    grad_out: torch.Tensor, causal: bool = False, sm_scale: float | None = None, deterministic: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward kernels: recompute P from the saved ``lse`` ``[B, H, T_q]`` (natural log) and return
    ``(grad_q [B, H, T_q, d], grad_k [B, H_kv, T_k, d], grad_v [B, H_kv, T_k, d])`` in the inputs' dtype
    (other leading dims: as in the forward; the gradients take the shapes of q, k, v).

    ``deterministic=True``: two kernels (dK/dV over query blocks, then dQ over key blocks), 7 matrix
    products and 2 exponentials per score, every output written by one program: bit-for-bit
    repeatable. ``deterministic=False``: one fused kernel, 5 products and 1 exponential, dQ summed in
    fp32 by atomic adds whose order varies on a GPU from run to run (last bits of dQ); ignored, with
    the deterministic kernels run, while ``torch.use_deterministic_algorithms(True)`` is in force."""
    q_in, k_in, v_in = q, k, v
    q, k, v = flatten_batch(q, k, v)
    _check_inputs(q, k, v, causal)
    B, H, T_q, d = q.shape
    H_kv, T_k = k.shape[1], k.shape[2]
    for name, t in (("out", out), ("grad_out", grad_out), ("lse", lse)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if out.shape != q_in.shape or grad_out.shape != q_in.shape:
        raise ValueError(f"out {tuple(out.shape)} and grad_out {tuple(grad_out.shape)} must have q's shape {tuple(q_in.shape)}")
    if lse.shape != q_in.shape[:-1]:
        raise ValueError(f"lse must have shape {tuple(q_in.shape[:-1])}; got {tuple(lse.shape)}")
    if out.device != q.device or grad_out.device != q.device or lse.device != q.device:
        raise ValueError("out, lse and grad_out must be on q's device")
    if not isinstance(deterministic, bool):
        raise ValueError(f"deterministic must be True or False; got {deterministic!r}")
    out, grad_out, lse = out.reshape(q.shape), grad_out.reshape(q.shape), lse.reshape(B, H, T_q)
    scale = _scale(d, sm_scale)
    grad_out = grad_out.to(q.dtype)
    lse = lse.to(torch.float32).contiguous()
    fused = not deterministic and not torch.are_deterministic_algorithms_enabled()
    delta = torch.empty((B, H, T_q), dtype=torch.float32, device=q.device)
    # the fused kernel sums dQ in fp32 (zeroed by the preprocess); an fp32 call's accumulator is dQ
    dq = torch.empty((B, H, T_q, d), dtype=torch.float32 if fused else q.dtype, device=q.device)
    dk = torch.empty((B, H_kv, T_k, d), dtype=k.dtype, device=q.device)
    dv = torch.empty((B, H_kv, T_k, d), dtype=v.dtype, device=q.device)
    tma_dkdv, tma_dq = _prepare(_tma_for(q, grad_out)), _prepare(_tma_for(k, v))
    kind = "bwd" if fused else "dkdv"
    dkdv, dqk = _launchers(q, tma_dkdv)[KINDS.index(kind)], _launchers(q, tma_dq)[2]
    common = dict(HEAD_DIM=d, CAUSAL=bool(causal), DOT_PRECISION=_dot_precision(q.dtype))

    # 1) Delta = rowsum(dO * O)  [B, H, T_q]; fused: dQ's accumulator zeroed in the same launch
    pre_block = INTERPRETER_BLOCKS["fwd"][0] if _INTERPRET else 128
    _bwd_preprocess[(triton.cdiv(T_q, pre_block), B * H)](
        out, grad_out, delta, dq, *out.stride(), *grad_out.stride(), H, T_q, HEAD_DIM=d, BLOCK_M=pre_block,
        ZERO_DQ=fused,
    )
    # 2) dK, dV (fused: and dQ, by atomics): one program per key block and kv head
    dkdv[lambda meta: (triton.cdiv(T_k, meta["BLOCK_N"]), B * H_kv)](
        q, k, v, grad_out, dk, dv, dq, lse, delta, scale * LOG2E, scale,
        *q.stride(), *k.stride(), *v.stride(), *grad_out.stride(), *dk.stride(), *dv.stride(),
        H, H_kv, T_q, T_k, H // H_kv, **common, TMA=tma_dkdv, FUSED_DQ=fused, **_fixed_blocks(kind),
    )
    if fused:
        return dq.to(q.dtype).reshape(q_in.shape), dk.reshape(k_in.shape), dv.reshape(v_in.shape)
    # 3) dQ: one program per query block and query head
    dqk[lambda meta: (triton.cdiv(T_q, meta["BLOCK_M"]), B * H)](
        q, k, v, grad_out, dq, lse, delta, scale * LOG2E, scale,
        *q.stride(), *k.stride(), *v.stride(), *grad_out.stride(), *dq.stride(),
        H, T_q, T_k, H // H_kv, **common, TMA=tma_dq, **_fixed_blocks("dq"),
    )
    return dq.reshape(q_in.shape), dk.reshape(k_in.shape), dv.reshape(v_in.shape)


class FlashAttentionFunction(torch.autograd.Function):
    """Autograd glue: the forward saves (q, k, v, out, lse); the backward recomputes P from lse.

    ``FlashAttentionFunction.apply(q, k, v, causal=False, sm_scale=None, deterministic=True)`` -> out,
    arguments by position (``Function.apply`` takes no keywords); lse is saved in shape ``q.shape[:-1]``."""

    @staticmethod
    def forward(ctx, q, k, v, causal=False, sm_scale=None, deterministic=True):
        if not isinstance(deterministic, bool):  # before the forward's work, not at backward time
            raise ValueError(f"deterministic must be True or False; got {deterministic!r}")
        out, lse = flash_attention_triton_forward(q, k, v, causal, sm_scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.sm_scale, ctx.deterministic = causal, sm_scale, deterministic
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = flash_attention_triton_backward(q, k, v, out, lse, grad_out, ctx.causal, ctx.sm_scale,
                                                     ctx.deterministic)
        return dq, dk, dv, None, None, None


def flash_attention_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False, sm_scale: float | None = None,
    deterministic: bool = True,
) -> torch.Tensor:
    """FlashAttention: q ``[B, H, T_q, d]``, k, v ``[B, H_kv, T_k, d]`` -> out ``[B, H, T_q, d]``
    (or any other leading dims, as :func:`helpers.nb09_flash_attention.flatten_batch` describes).

    Equals ``torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
    scale=sm_scale, enable_gqa=H_kv < H)``; differentiable through the Triton backward kernels
    (``deterministic=False``: the fused backward, see :func:`flash_attention_triton_backward`)."""
    return FlashAttentionFunction.apply(q, k, v, causal, sm_scale, deterministic)
