"""Notebook 09 (FlashAttention): wrong answers written from the statements.

9.3 and 9.4 are Triton kernels: one kernel per exercise takes a `BUG` constexpr, and each wrong
answer is a launcher that builds it with one mistake switched on (what the kernel would be had the
learner written that line wrong). They run on a GPU or under TRITON_INTERPRET=1.
"""

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - Triton is Linux-only
    triton = tl = None

# ---- 9.1 online_softmax(x, block_size) -----------------------------------------------------------


def _online(x, bs, *, rescale=True, inverted=False, guard=True, two_pass=False, step=None,
            full_blocks_only=False, m0=float("-inf"), keep_first_max=False, sum_dim=-1,
            out_float32=False, order_bug=False, neg_inf_to=None):
    if neg_inf_to is not None:
        x = x.masked_fill(x == float("-inf"), neg_inf_to)
    n = x.shape[-1]
    m = torch.full(x.shape[:-1], m0, dtype=x.dtype)
    l = torch.zeros(x.shape[:-1], dtype=x.dtype)
    stop = (n // bs) * bs if full_blocks_only else n
    if two_pass:
        for s in range(0, stop, bs):
            m = torch.maximum(m, x[..., s:s + bs].amax(-1))
    first = None
    for s in range(0, stop, bs):
        blk = x[..., s:s + (step or bs)]
        m_new = m if two_pass else torch.maximum(m, blk.amax(-1))
        ms = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new) if guard else m_new
        old = torch.where(m == float("-inf"), torch.zeros_like(m), m) if guard else m
        if rescale:
            fac = torch.exp(ms - old) if inverted else torch.exp(old - ms)
            fac = torch.where(m == float("-inf"), torch.zeros_like(fac), fac) if guard else fac
        else:
            fac = torch.ones_like(l)
        ref = old if order_bug else ms
        e = torch.exp(blk - ref[..., None])
        l = l * fac + (e.sum(-1) if sum_dim == -1 else e.sum(sum_dim).expand_as(l))
        m = m_new
        first = m if first is None else first
    mm = first if keep_first_max else m
    mm = torch.where(mm == float("-inf"), torch.zeros_like(mm), mm) if guard else mm
    num = torch.exp(x - mm[..., None])
    out = torch.where(l[..., None] > 0, num / l[..., None], torch.zeros_like(num)) if guard \
        else num / l[..., None]
    return out.float() if out_float32 else out


def os_no_rescale(x, block_size):
    return _online(x, block_size, rescale=False)


def os_inverted_rescale(x, block_size):
    return _online(x, block_size, inverted=True)


def os_no_inf_guard(x, block_size):
    return _online(x, block_size, guard=False)


def os_two_pass(x, block_size):
    return _online(x, block_size, two_pass=True)


def os_torch_softmax(x, block_size):
    return torch.softmax(x, dim=-1)


def os_block_one_short(x, block_size):
    return _online(x, block_size, step=max(1, block_size - 1))


def os_full_blocks_only(x, block_size):
    return _online(x, block_size, full_blocks_only=True)


def os_m_starts_at_zero(x, block_size):
    return _online(x, block_size, m0=0.0)


def os_output_with_first_max(x, block_size):
    return _online(x, block_size, keep_first_max=True)


def os_block_sum_wrong_dim(x, block_size):
    if x.dim() < 2:
        return _online(x, block_size)
    return _online(x, block_size, sum_dim=0) if x.shape[0] == 1 else _online_dim0(x, block_size)


def _online_dim0(x, bs):
    m = torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype)
    l = torch.zeros(x.shape[:-1], dtype=x.dtype)
    for s in range(0, x.shape[-1], bs):
        blk = x[..., s:s + bs]
        m_new = torch.maximum(m, blk.amax(-1))
        ms = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
        old = torch.where(m == float("-inf"), torch.zeros_like(m), m)
        e = torch.exp(blk - ms[..., None])
        l = l * torch.exp(old - ms) + e.sum(0, keepdim=True).sum(-1)  # summed over rows too
        m = m_new
    ms = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    num = torch.exp(x - ms[..., None])
    return torch.where(l[..., None] > 0, num / l[..., None], torch.zeros_like(num))


def os_float32(x, block_size):
    return _online(x, block_size, out_float32=True)


def os_sum_with_old_max(x, block_size):
    return _online(x, block_size, order_bug=True)


def os_neg_inf_to_minus_1e9(x, block_size):
    return _online(x, block_size, neg_inf_to=-1e9)


# ---- 9.2 flash_attention_tiled(q, k, v, causal, block_size) -------------------------------------


def _tiled(q, k, v, causal, bs, *, rescale_acc=True, rescale_l=True, local_mask=False,
           skip_diag=False, lse_no_m=False, scale=None, drop_tail=False, normalise=True,
           lse_keepdim=False, strict=False, scale_after_max=False, no_tile_mask=False,
           v_from_q_block=False, lse_log2=False, lse_raw_m=False):
    B, H, T, d = q.shape
    sc = 1 / math.sqrt(d) if scale is None else scale
    out = torch.zeros_like(q)
    lse = torch.zeros(B, H, T, dtype=torch.float32)
    stop = (T // bs) * bs if drop_tail else T
    for qs in range(0, stop, bs):
        qe = min(qs + bs, T)
        qb = q[:, :, qs:qe]
        m = torch.full((B, H, qe - qs), float("-inf"))
        l = torch.zeros(B, H, qe - qs)
        acc = torch.zeros(B, H, qe - qs, d)
        for ks in range(0, stop, bs):
            if causal and (ks >= qs if skip_diag else ks > qe - 1):
                continue
            ke = min(ks + bs, T)
            s = qb @ k[:, :, ks:ke].transpose(-2, -1)
            if not scale_after_max:
                s = s * sc
            if causal and not no_tile_mask:
                i = torch.arange(qs, qe)[:, None] - (qs if local_mask else 0)
                j = torch.arange(ks, ke)[None, :] - (ks if local_mask else 0)
                s = s.masked_fill((j >= i) if strict else (j > i), float("-inf"))
                if strict:
                    s = s.masked_fill((j == i) & (i == 0), 0.0)
            m_new = torch.maximum(m, s.amax(-1))
            ms = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
            p = torch.exp((s - ms[..., None]) * (sc if scale_after_max else 1.0))
            fac = torch.exp((torch.where(m == float("-inf"), ms, m) - ms)
                            * (sc if scale_after_max else 1.0))
            vb = v[:, :, qs:qe] if (v_from_q_block and qe - qs == ke - ks) else v[:, :, ks:ke]
            l = (l * fac if rescale_l else l) + p.sum(-1)
            acc = (acc * fac[..., None] if rescale_acc else acc) + p @ vb
            m = m_new
        out[:, :, qs:qe] = acc / l[..., None] if normalise else acc
        m_fac = sc if (scale_after_max and not lse_raw_m) else 1.0
        lse_blk = torch.log(l) if lse_no_m else m * m_fac + torch.log(l)
        lse[:, :, qs:qe] = lse_blk / math.log(2) if lse_log2 else lse_blk
    return out, (lse[..., None] if lse_keepdim else lse)


def ft_no_acc_rescale(q, k, v, causal=False, block_size=64):
    return _tiled(q, k, v, causal, block_size, rescale_acc=False)


def ft_no_l_rescale(q, k, v, causal=False, block_size=64):
    return _tiled(q, k, v, causal, block_size, rescale_l=False)


def ft_local_causal_indices(q, k, v, causal=False, block_size=64):
    return _tiled(q, k, v, causal, block_size, local_mask=True)


def ft_skips_diagonal_block(q, k, v, causal=False, block_size=64):
    return _tiled(q, k, v, causal, block_size, skip_diag=True)


def ft_lse_without_max(q, k, v, causal=False, block_size=64):
    return _tiled(q, k, v, causal, block_size, lse_no_m=True)


def ft_no_scale(q, k, v, causal=False, block_size=64):
    return _tiled(q, k, v, causal, block_size, scale=1.0)


def ft_drops_tail(q, k, v, causal=False, block_size=64):
    return _tiled(q, k, v, causal, block_size, drop_tail=True)


def ft_no_final_division(q, k, v, causal=False, block_size=64):
    return _tiled(q, k, v, causal, block_size, normalise=False)


def ft_lse_keepdim(q, k, v, causal=False, block_size=64):
    return _tiled(q, k, v, causal, block_size, lse_keepdim=True)


def ft_strict_causal(q, k, v, causal=False, block_size=64):
    return _tiled(q, k, v, causal, block_size, strict=True)


def ft_lse_unscaled_max(q, k, v, causal=False, block_size=64):
    return _tiled(q, k, v, causal, block_size, scale_after_max=True, lse_raw_m=True)


def ft_skip_only_no_tile_mask(q, k, v, causal=False, block_size=64):
    return _tiled(q, k, v, causal, block_size, no_tile_mask=True)


def ft_v_from_query_block(q, k, v, causal=False, block_size=64):
    return _tiled(q, k, v, causal, block_size, v_from_q_block=True)


def ft_lse_log2(q, k, v, causal=False, block_size=64):
    return _tiled(q, k, v, causal, block_size, lse_log2=True)


# ---- 9.3 flash_attention_triton(q, k, v, causal): one kernel, one mistake per BUG ---------------

LOG2E, LN2 = 1.4426950408889634, 0.6931471805599453
F_NO_LOG2E, F_EXP_NOT_EXP2, F_NO_ACC_RESCALE, F_STRICT_CAUSAL, F_NO_KEY_MASK = 1, 2, 3, 4, 5
F_LSE_LOG2, F_STORE_UNMASKED, F_CAUSAL_STOPS_EARLY, F_NO_L_RESCALE, F_LOAD_UNMASKED = 6, 7, 8, 9, 10


def _blocks():
    import os

    return (32, 32) if os.environ.get("TRITON_INTERPRET") == "1" else (64, 64)


if triton is not None:

    @triton.jit
    def _fwd_kernel(Q, K, V, Out, Lse, sm_scale, stride_b, stride_h, stride_t, H, T,
                    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BUG: tl.constexpr):
        start_m = tl.program_id(0)
        off_bh = tl.program_id(1)
        base = (off_bh // H) * stride_b + (off_bh % H) * stride_h
        offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        q_ptrs = Q + base + offs_m[:, None] * stride_t + offs_d[None, :]
        q = tl.load(q_ptrs, mask=offs_m[:, None] < T, other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        qk_scale = sm_scale if BUG == 1 else sm_scale * 1.4426950408889634
        hi = T
        if CAUSAL:
            if BUG == 8:
                hi = start_m * BLOCK_M
            else:
                hi = tl.minimum((start_m + 1) * BLOCK_M, T)
        for start_n in range(0, hi, BLOCK_N):
            cols = start_n + offs_n
            kv = base + cols[:, None] * stride_t + offs_d[None, :]
            if BUG == 10:
                k = tl.load(K + kv)
                v = tl.load(V + kv)
            else:
                k = tl.load(K + kv, mask=cols[:, None] < T, other=0.0)
                v = tl.load(V + kv, mask=cols[:, None] < T, other=0.0)
            s = tl.dot(q, tl.trans(k)) * qk_scale
            if BUG != 5:
                s = tl.where(cols[None, :] < T, s, float("-inf"))
            if CAUSAL:
                if BUG == 4:
                    s = tl.where(offs_m[:, None] > cols[None, :], s, float("-inf"))
                    s = tl.where((offs_m[:, None] == 0) & (cols[None, :] == 0), 0.0, s)
                else:
                    s = tl.where(offs_m[:, None] >= cols[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            if BUG == 2:
                alpha = tl.exp(m_i - m_new)
                p = tl.exp(s - m_new[:, None])
            else:
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(s - m_new[:, None])
            if BUG == 9:
                l_i = l_i + tl.sum(p, 1)
            else:
                l_i = l_i * alpha + tl.sum(p, 1)
            if BUG == 3:
                acc = acc + tl.dot(p.to(v.dtype), v)
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        acc = acc / l_i[:, None]
        o_ptrs = Out + base + offs_m[:, None] * stride_t + offs_d[None, :]
        if BUG == 7:
            tl.store(o_ptrs, acc.to(Out.dtype.element_ty))
        else:
            tl.store(o_ptrs, acc.to(Out.dtype.element_ty), mask=offs_m[:, None] < T)
        if BUG == 6:
            lse = m_i + tl.log2(l_i)
        else:
            lse = (m_i + tl.log2(l_i)) * 0.6931471805599453
        tl.store(Lse + off_bh * T + offs_m, lse, mask=offs_m < T)


def _fwd(q, k, v, causal, bug=0, *, out_fp32=False, heads_grid=True, scale=None):
    B, H, T, d = q.shape
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    bm, bn = _blocks()
    out = torch.empty(q.shape, dtype=torch.float32 if out_fp32 else q.dtype, device=q.device)
    lse = torch.empty(B, H, T, dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(T, bm), B * H if heads_grid else B)
    sm_scale = 1 / math.sqrt(d) if scale is None else scale(d)
    _fwd_kernel[grid](q, k, v, out, lse, sm_scale, q.stride(0), q.stride(1), q.stride(2), H, T,
                      HEAD_DIM=d, CAUSAL=causal, BLOCK_M=bm, BLOCK_N=bn, BUG=bug)
    return out, lse


def fa_no_log2e(q, k, v, causal=False):
    return _fwd(q, k, v, causal, F_NO_LOG2E)


def fa_exp_not_exp2(q, k, v, causal=False):
    return _fwd(q, k, v, causal, F_EXP_NOT_EXP2)


def fa_no_acc_rescale(q, k, v, causal=False):
    return _fwd(q, k, v, causal, F_NO_ACC_RESCALE)


def fa_strict_causal(q, k, v, causal=False):
    return _fwd(q, k, v, causal, F_STRICT_CAUSAL)


def fa_no_key_mask(q, k, v, causal=False):
    return _fwd(q, k, v, causal, F_NO_KEY_MASK)


def fa_lse_log2(q, k, v, causal=False):
    return _fwd(q, k, v, causal, F_LSE_LOG2)


def fa_store_unmasked(q, k, v, causal=False):
    return _fwd(q, k, v, causal, F_STORE_UNMASKED)


def fa_causal_stops_early(q, k, v, causal=False):
    return _fwd(q, k, v, causal, F_CAUSAL_STOPS_EARLY)


def fa_no_l_rescale(q, k, v, causal=False):
    return _fwd(q, k, v, causal, F_NO_L_RESCALE)


def fa_load_unmasked(q, k, v, causal=False):
    return _fwd(q, k, v, causal, F_LOAD_UNMASKED)


def fa_out_float32(q, k, v, causal=False):
    return _fwd(q, k, v, causal, out_fp32=True)


def fa_grid_batch_only(q, k, v, causal=False):
    return _fwd(q, k, v, causal, heads_grid=False)


def fa_scale_one_over_d(q, k, v, causal=False):
    return _fwd(q, k, v, causal, scale=lambda d: 1 / d)


def fa_reference_right(q, k, v, causal=False):  # not listed: the kernel with no mistake
    return _fwd(q, k, v, causal)


# ---- 9.4 flash_attention_triton_backward: two kernels, one mistake per BUG ----------------------

B_DQ_NO_SCALE, B_DK_NO_SCALE, B_NO_DELTA, B_NO_CAUSAL, B_EXP2_NATURAL_LSE = 1, 2, 3, 4, 5
B_SKIP_DIAGONAL_BLOCK, B_LOAD_UNMASKED, B_DV_NO_TRANSPOSE, B_CAUSAL_REVERSED, B_DK_FROM_P = (
    6, 7, 8, 9, 10)

if triton is not None:

    @triton.jit
    def _bwd_dkdv_kernel(Q, K, V, DO, DK, DV, Lse, Delta, sm_scale, stride_b, stride_h, stride_t,
                         H, T, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BUG: tl.constexpr):
        start_n = tl.program_id(0)
        off_bh = tl.program_id(1)
        base = (off_bh // H) * stride_b + (off_bh % H) * stride_h
        offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        kv_offs = base + offs_n[:, None] * stride_t + offs_d[None, :]
        if BUG == 7:
            k = tl.load(K + kv_offs)
            v = tl.load(V + kv_offs)
        else:
            k = tl.load(K + kv_offs, mask=offs_n[:, None] < T, other=0.0)
            v = tl.load(V + kv_offs, mask=offs_n[:, None] < T, other=0.0)
        dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
        dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
        lo = 0
        if CAUSAL:
            if BUG == 6:
                lo = (start_n + 1) * BLOCK_N
            else:
                lo = (start_n * BLOCK_N // BLOCK_M) * BLOCK_M
        for start_m in range(lo, T, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            q_offs = base + offs_m[:, None] * stride_t + offs_d[None, :]
            if BUG == 7:
                q = tl.load(Q + q_offs)
                do = tl.load(DO + q_offs)
            else:
                q = tl.load(Q + q_offs, mask=offs_m[:, None] < T, other=0.0)
                do = tl.load(DO + q_offs, mask=offs_m[:, None] < T, other=0.0)
            lse = tl.load(Lse + off_bh * T + offs_m, mask=offs_m < T, other=0.0)
            delta = tl.load(Delta + off_bh * T + offs_m, mask=offs_m < T, other=0.0)
            s = tl.dot(q, tl.trans(k)) * sm_scale
            if BUG == 5:
                p = tl.exp2(s - lse[:, None])
            else:
                p = tl.exp(s - lse[:, None])
            p = tl.where((offs_m[:, None] < T) & (offs_n[None, :] < T), p, 0.0)
            if CAUSAL:
                if BUG == 9:
                    p = tl.where(offs_m[:, None] <= offs_n[None, :], p, 0.0)
                elif BUG != 4:
                    p = tl.where(offs_m[:, None] >= offs_n[None, :], p, 0.0)
            if BUG == 8:
                dv += tl.dot(p.to(do.dtype), do)
            else:
                dv += tl.dot(tl.trans(p.to(do.dtype)), do)
            dp = tl.dot(do, tl.trans(v))
            if BUG == 3:
                ds = p * dp
            else:
                ds = p * (dp - delta[:, None])
            if BUG == 10:
                dk += tl.dot(tl.trans(p.to(q.dtype)), q)
            else:
                dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
        if BUG != 2:
            dk = dk * sm_scale
        tl.store(DK + kv_offs, dk.to(DK.dtype.element_ty), mask=offs_n[:, None] < T)
        tl.store(DV + kv_offs, dv.to(DV.dtype.element_ty), mask=offs_n[:, None] < T)

    @triton.jit
    def _bwd_dq_kernel(Q, K, V, DO, DQ, Lse, Delta, sm_scale, stride_b, stride_h, stride_t, H, T,
                       HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BUG: tl.constexpr):
        start_m = tl.program_id(0)
        off_bh = tl.program_id(1)
        base = (off_bh // H) * stride_b + (off_bh % H) * stride_h
        offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        q_offs = base + offs_m[:, None] * stride_t + offs_d[None, :]
        if BUG == 7:
            q = tl.load(Q + q_offs)
            do = tl.load(DO + q_offs)
        else:
            q = tl.load(Q + q_offs, mask=offs_m[:, None] < T, other=0.0)
            do = tl.load(DO + q_offs, mask=offs_m[:, None] < T, other=0.0)
        lse = tl.load(Lse + off_bh * T + offs_m, mask=offs_m < T, other=0.0)
        delta = tl.load(Delta + off_bh * T + offs_m, mask=offs_m < T, other=0.0)
        dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        hi = T
        if CAUSAL:
            hi = tl.minimum((start_m + 1) * BLOCK_M, T)
        for start_n in range(0, hi, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            kv_offs = base + offs_n[:, None] * stride_t + offs_d[None, :]
            if BUG == 7:
                k = tl.load(K + kv_offs)
                v = tl.load(V + kv_offs)
            else:
                k = tl.load(K + kv_offs, mask=offs_n[:, None] < T, other=0.0)
                v = tl.load(V + kv_offs, mask=offs_n[:, None] < T, other=0.0)
            s = tl.dot(q, tl.trans(k)) * sm_scale
            if BUG == 5:
                p = tl.exp2(s - lse[:, None])
            else:
                p = tl.exp(s - lse[:, None])
            p = tl.where((offs_m[:, None] < T) & (offs_n[None, :] < T), p, 0.0)
            if CAUSAL:
                if BUG == 9:
                    p = tl.where(offs_m[:, None] <= offs_n[None, :], p, 0.0)
                elif BUG != 4:
                    p = tl.where(offs_m[:, None] >= offs_n[None, :], p, 0.0)
            dp = tl.dot(do, tl.trans(v))
            if BUG == 3:
                ds = p * dp
            else:
                ds = p * (dp - delta[:, None])
            dq += tl.dot(ds.to(k.dtype), k)
        if BUG != 1:
            dq = dq * sm_scale
        tl.store(DQ + q_offs, dq.to(DQ.dtype.element_ty), mask=offs_m[:, None] < T)


def _bwd(q, k, v, out, lse, grad_out, causal, bug=0, *, delta_no_o=False, swap=False,
         grads_fp32=False):
    B, H, T, d = q.shape
    q, k, v, out, grad_out, lse = (t.contiguous() for t in (q, k, v, out, grad_out, lse))
    bm, bn = _blocks()
    if delta_no_o:
        delta = grad_out.float().sum(-1).contiguous()
    else:
        delta = (grad_out.float() * out.float()).sum(-1).contiguous()
    dt = torch.float32 if grads_fp32 else q.dtype
    dq, dk, dv = (torch.empty(q.shape, dtype=dt, device=q.device) for _ in range(3))
    sm = 1 / math.sqrt(d)
    strides = (q.stride(0), q.stride(1), q.stride(2))
    meta = dict(HEAD_DIM=d, CAUSAL=causal, BLOCK_M=bm, BLOCK_N=bn, BUG=bug)
    _bwd_dkdv_kernel[(triton.cdiv(T, bn), B * H)](q, k, v, grad_out, dk, dv, lse, delta, sm,
                                                   *strides, H, T, **meta)
    _bwd_dq_kernel[(triton.cdiv(T, bm), B * H)](q, k, v, grad_out, dq, lse, delta, sm, *strides,
                                                 H, T, **meta)
    return (dk, dq, dv) if swap else (dq, dk, dv)


def fb_dq_no_scale(q, k, v, out, lse, grad_out, causal=False):
    return _bwd(q, k, v, out, lse, grad_out, causal, B_DQ_NO_SCALE)


def fb_dk_no_scale(q, k, v, out, lse, grad_out, causal=False):
    return _bwd(q, k, v, out, lse, grad_out, causal, B_DK_NO_SCALE)


def fb_no_delta(q, k, v, out, lse, grad_out, causal=False):
    return _bwd(q, k, v, out, lse, grad_out, causal, B_NO_DELTA)


def fb_no_causal(q, k, v, out, lse, grad_out, causal=False):
    return _bwd(q, k, v, out, lse, grad_out, causal, B_NO_CAUSAL)


def fb_exp2_natural_lse(q, k, v, out, lse, grad_out, causal=False):
    return _bwd(q, k, v, out, lse, grad_out, causal, B_EXP2_NATURAL_LSE)


def fb_skip_diagonal_block(q, k, v, out, lse, grad_out, causal=False):
    return _bwd(q, k, v, out, lse, grad_out, causal, B_SKIP_DIAGONAL_BLOCK)


def fb_load_unmasked(q, k, v, out, lse, grad_out, causal=False):
    return _bwd(q, k, v, out, lse, grad_out, causal, B_LOAD_UNMASKED)


def fb_dv_no_transpose(q, k, v, out, lse, grad_out, causal=False):
    return _bwd(q, k, v, out, lse, grad_out, causal, B_DV_NO_TRANSPOSE)


def fb_causal_reversed(q, k, v, out, lse, grad_out, causal=False):
    return _bwd(q, k, v, out, lse, grad_out, causal, B_CAUSAL_REVERSED)


def fb_dk_from_p(q, k, v, out, lse, grad_out, causal=False):
    return _bwd(q, k, v, out, lse, grad_out, causal, B_DK_FROM_P)


def fb_delta_without_o(q, k, v, out, lse, grad_out, causal=False):
    return _bwd(q, k, v, out, lse, grad_out, causal, delta_no_o=True)


def fb_returns_k_first(q, k, v, out, lse, grad_out, causal=False):
    return _bwd(q, k, v, out, lse, grad_out, causal, swap=True)


def fb_grads_float32(q, k, v, out, lse, grad_out, causal=False):
    return _bwd(q, k, v, out, lse, grad_out, causal, grads_fp32=True)


def fb_reference_right(q, k, v, out, lse, grad_out, causal=False):  # not listed: no mistake
    return _bwd(q, k, v, out, lse, grad_out, causal)


WRONG = {
    "online_softmax": [
        ("forgot to rescale the running sum when the max grows", os_no_rescale),
        ("rescaled by exp(m_new - m) instead of exp(m - m_new)", os_inverted_rescale),
        ("no guard for -inf: exp(-inf - (-inf)) makes all -inf rows NaN", os_no_inf_guard),
        ("took the max of every block first, then the sums (two passes)", os_two_pass),
        ("called torch.softmax on the whole row", os_torch_softmax),
        ("sliced x[..., s:s + block_size - 1]: one entry per block skipped", os_block_one_short),
        ("looped over full blocks only: the shorter last block is dropped", os_full_blocks_only),
        ("started the running max at 0 instead of -inf (very negative rows underflow)",
         os_m_starts_at_zero),
        ("normalised the output with the first block's max", os_output_with_first_max),
        ("summed each block over dim 0 (all rows together)", os_block_sum_wrong_dim),
        ("returned float32 (x's dtype not kept)", os_float32),
        ("added the block's exp(x - m) with the old max, before updating it", os_sum_with_old_max),
        ("replaced -inf by -1e9 first: all -inf rows become uniform", os_neg_inf_to_minus_1e9),
    ],
    "flash_attention_tiled": [
        ("forgot to rescale acc when the running max grows", ft_no_acc_rescale),
        ("forgot to rescale l when the running max grows", ft_no_l_rescale),
        ("causal mask with tile-local indices (i, j counted from each tile's start)",
         ft_local_causal_indices),
        ("skipped key blocks with ks >= qs: the diagonal tile is skipped too",
         ft_skips_diagonal_block),
        ("lse = log(l), forgot to add the running max", ft_lse_without_max),
        ("forgot the 1/sqrt(d) scale", ft_no_scale),
        ("loops stop at the last full block: the tail of T is dropped", ft_drops_tail),
        ("forgot the final acc / l", ft_no_final_division),
        ("lse kept as [B, H, T, 1]", ft_lse_keepdim),
        ("causal mask j >= i blocked (strict), with row 0 patched to see itself",
         ft_strict_causal),
        ("scaled after the max and added the unscaled max to lse", ft_lse_unscaled_max),
        ("skipped future tiles but forgot to mask inside the diagonal tile",
         ft_skip_only_no_tile_mask),
        ("took the value tile at the query block's rows", ft_v_from_query_block),
        ("returned lse in log2 units", ft_lse_log2),
    ],
    "flash_attention_triton": [
        ("scores scaled by sm_scale only, then tl.exp2 (forgot log2(e))", fa_no_log2e),
        ("scores in log2 units but tl.exp instead of tl.exp2", fa_exp_not_exp2),
        ("forgot to rescale acc by alpha", fa_no_acc_rescale),
        ("causal condition i > j (diagonal blocked; row 0 patched)", fa_strict_causal),
        ("keys past T not set to -inf (loaded as 0, so they get weight)", fa_no_key_mask),
        ("stored lse = m_i + log2(l_i) without the ln 2 factor", fa_lse_log2),
        ("stored the output tile without a mask (rows past T written)", fa_store_unmasked),
        ("causal loop stops at start_m * BLOCK_M: the diagonal block is skipped",
         fa_causal_stops_early),
        ("forgot to rescale l_i by alpha", fa_no_l_rescale),
        ("loaded K and V tiles without a mask (reads past T)", fa_load_unmasked),
        ("allocated out as float32 whatever the inputs' dtype", fa_out_float32),
        ("grid (cdiv(T, BLOCK_M), B): one program per batch, heads missing", fa_grid_batch_only),
        ("sm_scale = 1 / d instead of 1 / sqrt(d)", fa_scale_one_over_d),
    ],
    "flash_attention_triton_backward": [
        ("forgot sm_scale in dQ", fb_dq_no_scale),
        ("forgot sm_scale in dK", fb_dk_no_scale),
        ("dS = P * dP (forgot to subtract D)", fb_no_delta),
        ("no causal mask on P in the backward kernels", fb_no_causal),
        ("P = exp2(S - lse) with S and lse in natural-log units", fb_exp2_natural_lse),
        ("dK/dV loop starts after the key block's own query block (diagonal skipped)",
         fb_skip_diagonal_block),
        ("loaded tiles without masks (reads past T)", fb_load_unmasked),
        ("dV += P dO (no transpose of P)", fb_dv_no_transpose),
        ("causal mask reversed (kept j >= i)", fb_causal_reversed),
        ("dK accumulated from P instead of dS", fb_dk_from_p),
        ("D = rowsum(dO), forgot the O", fb_delta_without_o),
        ("returned (grad_k, grad_q, grad_v)", fb_returns_k_first),
        ("allocated the gradients as float32 whatever the inputs' dtype", fb_grads_float32),
    ],
}
