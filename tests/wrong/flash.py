"""Learner-style wrong implementations for exercises 9.1-9.4, with the hint each check must give.

9.1 and 9.2 are plain PyTorch. The Triton ones (9.3, 9.4) are real ``@triton.jit`` kernels: one
learner-style forward kernel and one backward pair, each with ``tl.constexpr`` switches that turn
on one mistake at a time, so every wrong version is compiled (or interpreted) like a learner's.
Without a CUDA GPU they run in Triton's interpreter, which must be switched on before the first
kernel is decorated.
"""

import math

import torch
import torch.nn.functional as F

from helpers.runtime import configure_triton

configure_triton()  # before any @triton.jit below

try:
    import triton
    import triton.language as tl
except ImportError:  # macOS / Windows: no Triton; only the PyTorch exercises get wrong versions
    triton = None

_INF = float("-inf")


# ----------------------------------------------------------------- 9.1 online_softmax
def online_no_rescale(x, block_size):
    m = torch.full(x.shape[:-1], _INF)
    l = torch.zeros(x.shape[:-1])
    for s in range(0, x.shape[-1], block_size):
        block = x[..., s : s + block_size]
        m = torch.maximum(m, block.amax(dim=-1))
        l = l + torch.exp(block - m[..., None]).sum(dim=-1)  # the old sum keeps its old max
    return torch.exp(x - m[..., None]) / l[..., None]


def online_nan_on_masked_blocks(x, block_size):
    m = torch.full(x.shape[:-1], _INF, dtype=x.dtype)
    l = torch.zeros(x.shape[:-1], dtype=x.dtype)
    for s in range(0, x.shape[-1], block_size):
        block = x[..., s : s + block_size]
        m_new = torch.maximum(m, block.amax(dim=-1))
        l = l * torch.exp(m - m_new) + torch.exp(block - m_new[..., None]).sum(dim=-1)  # -inf - -inf
        m = m_new
    return torch.exp(x - m[..., None]) / l[..., None]


def online_nan_on_empty_rows(x, block_size):
    m = torch.full(x.shape[:-1], _INF, dtype=x.dtype)
    l = torch.zeros(x.shape[:-1], dtype=x.dtype)
    for s in range(0, x.shape[-1], block_size):
        block = x[..., s : s + block_size]
        m_new = torch.maximum(m, block.amax(dim=-1))
        safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        l = l * torch.exp(m - safe) + torch.exp(block - safe[..., None]).sum(dim=-1)
        m = m_new
    safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    return torch.exp(x - safe[..., None]) / l[..., None]  # 0 / 0 on a row with nothing allowed


def online_ignores_block_size(x, block_size):
    return torch.softmax(x, dim=-1)


def online_two_pass(x, block_size):
    n = x.shape[-1]
    m = torch.full(x.shape[:-1], _INF, dtype=x.dtype)
    for s in range(0, n, block_size):  # pass 1: the max
        m = torch.maximum(m, x[..., s : s + block_size].amax(dim=-1))
    l = torch.zeros(x.shape[:-1], dtype=x.dtype)
    for s in range(0, n, block_size):  # pass 2: the sum
        l = l + torch.exp(x[..., s : s + block_size] - m[..., None]).sum(dim=-1)
    return torch.exp(x - m[..., None]) / l[..., None]


def online_drops_last_block(x, block_size):
    n = x.shape[-1]
    m = torch.full(x.shape[:-1], _INF, dtype=x.dtype)
    l = torch.zeros(x.shape[:-1], dtype=x.dtype)
    for s in range(0, n - block_size + 1, block_size):  # full blocks only
        block = x[..., s : s + block_size]
        m_new = torch.maximum(m, block.amax(dim=-1))
        l = l * torch.exp(m - m_new) + torch.exp(block - m_new[..., None]).sum(dim=-1)
        m = m_new
    return torch.exp(x - m[..., None]) / l[..., None]


def online_no_max(x, block_size):
    l = torch.zeros(x.shape[:-1], dtype=x.dtype)
    for s in range(0, x.shape[-1], block_size):
        l = l + torch.exp(x[..., s : s + block_size]).sum(dim=-1)
    return torch.exp(x) / l[..., None]


def online_returns_float32(x, block_size):
    xf = x.float()
    m = torch.full(x.shape[:-1], _INF)
    l = torch.zeros(x.shape[:-1])
    for s in range(0, x.shape[-1], block_size):
        block = xf[..., s : s + block_size]
        m_new = torch.maximum(m, block.amax(dim=-1))
        safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        l = l * torch.exp(m - safe) + torch.exp(block - safe[..., None]).sum(dim=-1)
        m = m_new
    safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    return torch.exp(xf - safe[..., None]) / torch.where(l > 0, l, 1.0)[..., None]


def online_calls_helper(x, block_size):
    from helpers.nb09_flash_attention import online_softmax

    return online_softmax(x, block_size)


def online_numpy_whole_row(x, block_size):
    import numpy as np

    a = x.numpy()  # the whole-row softmax, where the op log cannot see it
    e = np.exp(a - a.max(-1, keepdims=True))
    return torch.from_numpy(np.nan_to_num(e / e.sum(-1, keepdims=True)))


def online_two_pass_vectorised(x, block_size):
    n = x.shape[-1]
    n_blocks = -(-n // block_size)
    padded = F.pad(x, (0, n_blocks * block_size - n), value=_INF)
    m = padded.unflatten(-1, (n_blocks, block_size)).amax(-1).amax(-1)  # every block's max in one step
    safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    l = torch.zeros(x.shape[:-1], dtype=x.dtype)
    for s in range(0, n, block_size):  # then a second pass for the sum
        l = l + torch.exp(x[..., s : s + block_size] - safe[..., None]).sum(dim=-1)
    out = torch.exp(x - safe[..., None]) / l[..., None]
    return torch.where(l[..., None] > 0, out, torch.zeros_like(out))


def online_python_numbers(x, block_size):
    flat = x.reshape(-1, x.shape[-1])
    out = torch.zeros_like(flat)
    for r in range(flat.shape[0]):
        row = [float(v) for v in flat[r]]  # one Python number at a time
        m = max(row)
        if m == _INF:
            continue
        e = [math.exp(v - m) for v in row]
        out[r] = torch.tensor([v / sum(e) for v in e], dtype=x.dtype)
    return out.reshape(x.shape)


# ----------------------------------------------------------------- 9.2 flash_attention_tiled
def _learner_tiled(q, k, v, causal, block_size, rescale_acc=True, normalise=True, lse_log2=False, skip_diag=False,
                   full_blocks_only=False, strict_mask=False, scale=True, lse_m_only=False):
    """A learner's tiled forward; each keyword turns one mistake on (all off: correct)."""
    B, H, T, d = q.shape
    sm_scale = 1 / math.sqrt(d) if scale else 1.0
    stop = T - T % block_size if full_blocks_only else T
    out = torch.zeros_like(q)
    lse = torch.zeros(B, H, T)
    for qs in range(0, stop, block_size):
        qe = min(qs + block_size, T)
        m = torch.full((B, H, qe - qs), _INF)
        l = torch.zeros(B, H, qe - qs)
        acc = torch.zeros(B, H, qe - qs, d)
        k_end = (qs if skip_diag else qe) if causal else stop
        for ks in range(0, k_end, block_size):
            ke = min(ks + block_size, k_end)
            s = q[:, :, qs:qe] @ k[:, :, ks:ke].transpose(-2, -1) * sm_scale
            if causal:
                i = torch.arange(qs, qe)[:, None]
                j = torch.arange(ks, ke)[None, :]
                s = s.masked_fill(j >= i if strict_mask else j > i, _INF)
            m_new = torch.maximum(m, s.amax(dim=-1))
            alpha = torch.exp(m - m_new)
            p = torch.exp(s - m_new[..., None])
            l = l * alpha + p.sum(dim=-1)
            acc = (acc * alpha[..., None] if rescale_acc else acc) + p @ v[:, :, ks:ke]
            m = m_new
        out[:, :, qs:qe] = acc / l[..., None] if normalise else acc
        lse[:, :, qs:qe] = m if lse_m_only else m + torch.log(l)
    return out, (lse * math.log2(math.e) if lse_log2 else lse)


def tiled_no_acc_rescale(q, k, v, causal, block_size):
    return _learner_tiled(q, k, v, causal, block_size, rescale_acc=False)


def tiled_no_normalisation(q, k, v, causal, block_size):
    return _learner_tiled(q, k, v, causal, block_size, normalise=False)


def tiled_lse_log2(q, k, v, causal, block_size):
    return _learner_tiled(q, k, v, causal, block_size, lse_log2=True)


def tiled_lse_only_max(q, k, v, causal, block_size):
    return _learner_tiled(q, k, v, causal, block_size, lse_m_only=True)


def tiled_causal_skips_diagonal(q, k, v, causal, block_size):
    return _learner_tiled(q, k, v, causal, block_size, skip_diag=True)


def tiled_causal_hides_diagonal(q, k, v, causal, block_size):
    return _learner_tiled(q, k, v, causal, block_size, strict_mask=True)


def tiled_drops_last_block(q, k, v, causal, block_size):
    return _learner_tiled(q, k, v, causal, block_size, full_blocks_only=True)


def tiled_no_scale(q, k, v, causal, block_size):
    return _learner_tiled(q, k, v, causal, block_size, scale=False)


def tiled_full_scores(q, k, v, causal, block_size):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # [B, H, T, T]
    if causal:
        T = q.shape[-2]
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), _INF)
    return torch.softmax(s, dim=-1) @ v, torch.logsumexp(s, dim=-1)


def tiled_row_strips(q, k, v, causal, block_size):
    T = q.shape[-2]
    out, lse = torch.empty_like(q), torch.empty(q.shape[:-1])
    for qs in range(0, T, block_size):
        s = q[:, :, qs : qs + block_size] @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # [B, H, bq, T]
        if causal:
            i = torch.arange(qs, min(qs + block_size, T))[:, None]
            s = s.masked_fill(torch.arange(T)[None, :] > i, _INF)
        out[:, :, qs : qs + block_size] = torch.softmax(s, dim=-1) @ v
        lse[:, :, qs : qs + block_size] = torch.logsumexp(s, dim=-1)
    return out, lse


def tiled_calls_sdpa(q, k, v, causal, block_size):
    _, lse = _learner_tiled(q, k, v, causal, block_size)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal), lse


def tiled_calls_helper(q, k, v, causal, block_size):
    from helpers import reference

    return reference.flash_attention_tiled(q, k, v, causal, block_size)


def tiled_numpy_full_attention(q, k, v, causal, block_size):
    import numpy as np

    s = q.numpy() @ np.swapaxes(k.numpy(), -1, -2) / math.sqrt(q.shape[-1])  # [B, H, T, T], unseen by torch
    if causal:
        T = q.shape[-2]
        s = np.where(np.tril(np.ones((T, T), dtype=bool)), s, -np.inf)
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    out = (e / e.sum(-1, keepdims=True)) @ v.numpy()
    return torch.from_numpy(out), torch.from_numpy((m[..., 0] + np.log(e.sum(-1))).astype(np.float32))


def tiled_no_lse(q, k, v, causal, block_size):
    return _learner_tiled(q, k, v, causal, block_size)[0]


def tiled_lse_keepdim(q, k, v, causal, block_size):
    out, lse = _learner_tiled(q, k, v, causal, block_size)
    return out, lse[..., None]


WRONG = {
    "online_softmax": [
        (online_no_rescale, "rescale it, l = l * exp(m - m_new)"),
        (online_nan_on_masked_blocks, "exp(-inf - (-inf))"),
        (online_nan_on_empty_rows, "gives all zeros in this course, never NaN"),
        (online_ignores_block_size, "block_size=4 is not used"),
        (online_two_pass, "two-pass safe softmax"),
        (online_drops_last_block, "the last, shorter block was left out"),
        (online_no_max, "subtract the running max before exp"),
        (online_returns_float32, "expected dtype torch.float16"),
        (online_calls_helper, "called the course's own solution"),
        (online_numpy_whole_row, "took x out of PyTorch (.numpy())"),
        (online_two_pass_vectorised, "two-pass safe softmax"),
        (online_python_numbers, "into 192 Python numbers one at a time"),
    ],
    "flash_attention_tiled": [
        (tiled_no_acc_rescale, "the accumulator was not rescaled"),
        (tiled_no_normalisation, "the final normalisation is missing"),
        (tiled_lse_log2, "lse is in log2 units"),
        (tiled_lse_only_max, "lse is only the running max"),
        (tiled_causal_skips_diagonal, "the diagonal block was skipped"),
        (tiled_causal_hides_diagonal, "also hides the diagonal"),
        (tiled_drops_last_block, "the last, shorter"),
        (tiled_no_scale, "the scores are not scaled"),
        (tiled_full_scores, "a full [T, T] matrix"),
        (tiled_row_strips, "a strip of scores against every key"),
        (tiled_calls_sdpa, "torch's fused attention"),
        (tiled_calls_helper, "called the course's own solution"),
        (tiled_no_lse, "expected a tuple of 2 (out, lse)"),
        (tiled_numpy_full_attention, "took q, k or v out of PyTorch"),
        (tiled_lse_keepdim, "lse: expected shape [2, 3, 48]"),
    ],
}


# ----------------------------------------------------------------- 9.3 / 9.4: Triton kernels
if triton is not None:
    LOG2E = 1.4426950408889634
    LN2 = 0.6931471805599453
    BLOCK = 32  # BLOCK_M = BLOCK_N: T = 128 is four blocks, T = 100 and 17 end in a partial one

    @triton.jit
    def _learner_fwd(
        Q, K, V, Out, Lse, sm_scale, stride_b, stride_h, stride_t, H, T,
        HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        MASK_LOADS: tl.constexpr, MASK_SCORES: tl.constexpr, MASK_STORE: tl.constexpr,
        CAUSAL_MODE: tl.constexpr,  # 0: keep j <= i; 1: keep j < i; 2: keep j >= i (wrong axis)
        SKIP_DIAG: tl.constexpr, SCALE_MODE: tl.constexpr,  # 0: sm_scale * log2(e); 1: no sm_scale; 2: no log2(e)
        RESCALE: tl.constexpr, NORMALISE: tl.constexpr, LSE_LOG2: tl.constexpr, LOADS_IGNORE_BATCH: tl.constexpr,
        FULL_KEY_BLOCKS_ONLY: tl.constexpr = False,
        GRID: tl.constexpr = 0,  # 0: (query blocks, B * H); 1: (B * H, query blocks); 2: (query blocks, H, B)
    ):
        if GRID == 0:
            start_m = tl.program_id(0)
            off_bh = tl.program_id(1)
        elif GRID == 1:
            start_m = tl.program_id(1)
            off_bh = tl.program_id(0)
        else:
            start_m = tl.program_id(0)
            off_bh = tl.program_id(2) * H + tl.program_id(1)
        base = (off_bh // H) * stride_b + (off_bh % H) * stride_h
        load_base = base
        if LOADS_IGNORE_BATCH:
            load_base = (off_bh % H) * stride_h
        offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        q_ptrs = Q + load_base + offs_m[:, None] * stride_t + offs_d[None, :]
        if MASK_LOADS:
            q = tl.load(q_ptrs, mask=offs_m[:, None] < T, other=0.0)
        else:
            q = tl.load(q_ptrs)
        qk_scale = sm_scale * 1.4426950408889634
        if SCALE_MODE == 1:
            qk_scale = 1.4426950408889634
        if SCALE_MODE == 2:
            qk_scale = sm_scale
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        hi = T
        if FULL_KEY_BLOCKS_ONLY:
            hi = (T // BLOCK_N) * BLOCK_N  # "the last block is partial, skip it"
        if CAUSAL:
            if SKIP_DIAG:
                hi = start_m * BLOCK_M
            else:
                hi = tl.minimum((start_m + 1) * BLOCK_M, T)
        for start_n in range(0, hi, BLOCK_N):
            cols = start_n + offs_n
            k_ptrs = K + load_base + cols[:, None] * stride_t + offs_d[None, :]
            v_ptrs = V + load_base + cols[:, None] * stride_t + offs_d[None, :]
            if MASK_LOADS:
                k = tl.load(k_ptrs, mask=cols[:, None] < T, other=0.0)
                v = tl.load(v_ptrs, mask=cols[:, None] < T, other=0.0)
            else:
                k = tl.load(k_ptrs)
                v = tl.load(v_ptrs)
            qk = tl.dot(q, tl.trans(k)) * qk_scale
            if MASK_SCORES:
                qk = tl.where(cols[None, :] < T, qk, float("-inf"))
            if CAUSAL:
                if CAUSAL_MODE == 0:
                    qk = tl.where(offs_m[:, None] >= cols[None, :], qk, float("-inf"))
                elif CAUSAL_MODE == 1:
                    qk = tl.where(offs_m[:, None] > cols[None, :], qk, float("-inf"))
                else:
                    qk = tl.where(offs_m[:, None] <= cols[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.exp2(qk - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            if RESCALE:
                acc = acc * alpha[:, None]
            acc = tl.dot(p.to(v.dtype), v, acc)
            m_i = m_new
        if NORMALISE:
            acc = acc / l_i[:, None]
        lse = m_i + tl.log2(l_i)  # log2 units
        if not LSE_LOG2:
            lse = lse * 0.6931471805599453
        o_ptrs = Out + base + offs_m[:, None] * stride_t + offs_d[None, :]
        if MASK_STORE:
            tl.store(o_ptrs, acc.to(Out.dtype.element_ty), mask=offs_m[:, None] < T)
            tl.store(Lse + off_bh * T + offs_m, lse, mask=offs_m < T)
        else:
            tl.store(o_ptrs, acc.to(Out.dtype.element_ty))
            tl.store(Lse + off_bh * T + offs_m, lse)

    def _forward(name, grid_floor=False, out_fp32=False, return_lse=False, block=BLOCK, grid_heads=True, **mistakes):
        """A learner's launcher around _learner_fwd with the given mistakes switched on (GRID=1 or 2: the
        same kernel on another, correct, grid layout)."""
        flags = dict(MASK_LOADS=True, MASK_SCORES=True, MASK_STORE=True, CAUSAL_MODE=0, SKIP_DIAG=False,
                     SCALE_MODE=0, RESCALE=True, NORMALISE=True, LSE_LOG2=False, LOADS_IGNORE_BATCH=False)
        flags.update(mistakes)

        def flash_attention_triton(q, k, v, causal=False):
            B, H, T, d = q.shape
            out = torch.empty(q.shape, dtype=torch.float32, device=q.device) if out_fp32 else torch.empty_like(q)
            lse = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
            n_blocks = T // block if grid_floor else triton.cdiv(T, block)
            grid = {0: (n_blocks, B * H if grid_heads else B), 1: (B * H, n_blocks), 2: (n_blocks, H, B)}[flags.get("GRID", 0)]
            _learner_fwd[grid](
                q, k, v, out, lse, 1 / math.sqrt(d), q.stride(0), q.stride(1), q.stride(2), H, T,
                HEAD_DIM=d, CAUSAL=causal, BLOCK_M=block, BLOCK_N=block, **flags,
            )
            return (out, lse) if return_lse else out

        flash_attention_triton.__name__ = name
        return flash_attention_triton

    @triton.jit
    def _learner_bwd_dkdv(
        Q, K, V, DO, DK, DV, Lse, Delta, sm_scale, stride_b, stride_h, stride_t, H, T,
        HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        MASK_LOADS: tl.constexpr, MASK_STORE: tl.constexpr,
        CAUSAL_MODE: tl.constexpr,  # 0: ok; 1: no mask, all blocks; 2: keep j < i; 3: blocks skipped, no mask
        SCALE_GRADS: tl.constexpr, USE_DELTA: tl.constexpr, LSE_CONVERT: tl.constexpr,
    ):
        start_n = tl.program_id(0)
        off_bh = tl.program_id(1)
        base = (off_bh // H) * stride_b + (off_bh % H) * stride_h
        offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        kv_offs = base + offs_n[:, None] * stride_t + offs_d[None, :]
        if MASK_LOADS:
            k = tl.load(K + kv_offs, mask=offs_n[:, None] < T, other=0.0)
            v = tl.load(V + kv_offs, mask=offs_n[:, None] < T, other=0.0)
        else:
            k = tl.load(K + kv_offs)
            v = tl.load(V + kv_offs)
        dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
        lo = 0
        if CAUSAL and CAUSAL_MODE != 1:
            lo = start_n * BLOCK_N  # queries before this key block never see it
        for start_m in range(lo, T, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            q_offs = base + offs_m[:, None] * stride_t + offs_d[None, :]
            if MASK_LOADS:
                q = tl.load(Q + q_offs, mask=offs_m[:, None] < T, other=0.0)
                do = tl.load(DO + q_offs, mask=offs_m[:, None] < T, other=0.0)
                lse = tl.load(Lse + off_bh * T + offs_m, mask=offs_m < T, other=0.0)
                delta = tl.load(Delta + off_bh * T + offs_m, mask=offs_m < T, other=0.0)
            else:
                q = tl.load(Q + q_offs)
                do = tl.load(DO + q_offs)
                lse = tl.load(Lse + off_bh * T + offs_m)
                delta = tl.load(Delta + off_bh * T + offs_m)
            qkT = tl.dot(k, tl.trans(q))  # [BLOCK_N keys, BLOCK_M queries]
            if LSE_CONVERT:
                pT = tl.exp2(qkT * sm_scale * 1.4426950408889634 - lse[None, :] * 1.4426950408889634)
            else:
                pT = tl.exp2(qkT * sm_scale * 1.4426950408889634 - lse[None, :])
            if MASK_LOADS:
                pT = tl.where(offs_m[None, :] < T, pT, 0.0)
            if CAUSAL:
                if CAUSAL_MODE == 0:
                    pT = tl.where(offs_m[None, :] >= offs_n[:, None], pT, 0.0)
                elif CAUSAL_MODE == 2:
                    pT = tl.where(offs_m[None, :] > offs_n[:, None], pT, 0.0)
            dv = tl.dot(pT.to(do.dtype), do, dv)
            dpT = tl.dot(v, tl.trans(do))
            if USE_DELTA:
                dsT = pT * (dpT - delta[None, :])
            else:
                dsT = pT * dpT
            dk = tl.dot(dsT.to(q.dtype), q, dk)
        if SCALE_GRADS:
            dk = dk * sm_scale
        if MASK_STORE:
            tl.store(DK + kv_offs, dk.to(DK.dtype.element_ty), mask=offs_n[:, None] < T)
            tl.store(DV + kv_offs, dv.to(DV.dtype.element_ty), mask=offs_n[:, None] < T)
        else:
            tl.store(DK + kv_offs, dk.to(DK.dtype.element_ty))
            tl.store(DV + kv_offs, dv.to(DV.dtype.element_ty))

    @triton.jit
    def _learner_bwd_dq(
        Q, K, V, DO, DQ, Lse, Delta, sm_scale, stride_b, stride_h, stride_t, H, T,
        HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        MASK_LOADS: tl.constexpr, MASK_STORE: tl.constexpr, CAUSAL_MODE: tl.constexpr,
        SCALE_GRADS: tl.constexpr, USE_DELTA: tl.constexpr, LSE_CONVERT: tl.constexpr,
    ):
        start_m = tl.program_id(0)
        off_bh = tl.program_id(1)
        base = (off_bh // H) * stride_b + (off_bh % H) * stride_h
        offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        q_offs = base + offs_m[:, None] * stride_t + offs_d[None, :]
        if MASK_LOADS:
            q = tl.load(Q + q_offs, mask=offs_m[:, None] < T, other=0.0)
            do = tl.load(DO + q_offs, mask=offs_m[:, None] < T, other=0.0)
            lse = tl.load(Lse + off_bh * T + offs_m, mask=offs_m < T, other=0.0)
            delta = tl.load(Delta + off_bh * T + offs_m, mask=offs_m < T, other=0.0)
        else:
            q = tl.load(Q + q_offs)
            do = tl.load(DO + q_offs)
            lse = tl.load(Lse + off_bh * T + offs_m)
            delta = tl.load(Delta + off_bh * T + offs_m)
        dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        hi = T
        if CAUSAL and CAUSAL_MODE != 1:
            hi = tl.minimum((start_m + 1) * BLOCK_M, T)
        for start_n in range(0, hi, BLOCK_N):
            cols = start_n + tl.arange(0, BLOCK_N)
            kv_offs = base + cols[:, None] * stride_t + offs_d[None, :]
            if MASK_LOADS:
                k = tl.load(K + kv_offs, mask=cols[:, None] < T, other=0.0)
                v = tl.load(V + kv_offs, mask=cols[:, None] < T, other=0.0)
            else:
                k = tl.load(K + kv_offs)
                v = tl.load(V + kv_offs)
            qk = tl.dot(q, tl.trans(k))
            if LSE_CONVERT:
                p = tl.exp2(qk * sm_scale * 1.4426950408889634 - lse[:, None] * 1.4426950408889634)
            else:
                p = tl.exp2(qk * sm_scale * 1.4426950408889634 - lse[:, None])
            if MASK_LOADS:
                p = tl.where(cols[None, :] < T, p, 0.0)
            if CAUSAL:
                if CAUSAL_MODE == 0:
                    p = tl.where(offs_m[:, None] >= cols[None, :], p, 0.0)
                elif CAUSAL_MODE == 2:
                    p = tl.where(offs_m[:, None] > cols[None, :], p, 0.0)
            dp = tl.dot(do, tl.trans(v))
            if USE_DELTA:
                ds = p * (dp - delta[:, None])
            else:
                ds = p * dp
            dq = tl.dot(ds.to(k.dtype), k, dq)
        if SCALE_GRADS:
            dq = dq * sm_scale
        if MASK_STORE:
            tl.store(DQ + q_offs, dq.to(DQ.dtype.element_ty), mask=offs_m[:, None] < T)
        else:
            tl.store(DQ + q_offs, dq.to(DQ.dtype.element_ty))

    def _backward(name, grads_fp32=False, **mistakes):
        """A learner's backward launcher (D in PyTorch, then the two kernels) with mistakes switched on."""
        flags = dict(MASK_LOADS=True, MASK_STORE=True, CAUSAL_MODE=0, SCALE_GRADS=True, USE_DELTA=True, LSE_CONVERT=True)
        flags.update(mistakes)

        def flash_attention_triton_backward(q, k, v, out, lse, grad_out, causal=False):
            B, H, T, d = q.shape
            delta = (out.float() * grad_out.float()).sum(dim=-1).contiguous()  # D = rowsum(dO * O)
            make = (lambda x: torch.empty(x.shape, dtype=torch.float32, device=x.device)) if grads_fp32 else torch.empty_like
            dq, dk, dv = make(q), make(k), make(v)
            args = (1 / math.sqrt(d), q.stride(0), q.stride(1), q.stride(2), H, T)
            meta = dict(HEAD_DIM=d, CAUSAL=causal, BLOCK_M=BLOCK, BLOCK_N=BLOCK, **flags)
            grid = (triton.cdiv(T, BLOCK), B * H)
            _learner_bwd_dkdv[grid](q, k, v, grad_out, dk, dv, lse, delta, *args, **meta)
            _learner_bwd_dq[grid](q, k, v, grad_out, dq, lse, delta, *args, **meta)
            return dq, dk, dv

        flash_attention_triton_backward.__name__ = name
        return flash_attention_triton_backward

    def triton_forward_in_pytorch(q, k, v, causal=False):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def triton_forward_calls_course_kernel(q, k, v, causal=False):
        from helpers.nb09_triton_flash import flash_attention_triton_forward

        return flash_attention_triton_forward(q, k, v, causal=causal)

    def triton_backward_in_pytorch(q, k, v, out, lse, grad_out, causal=False):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(grad_out)
        return q.grad, k.grad, v.grad

    @triton.jit
    def _copy_kernel(Src, Dst, N, Q, K, V, BLOCK: tl.constexpr):
        """Copies Src into Dst; takes q, k and v too, without using them."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(Dst + offs, tl.load(Src + offs, mask=offs < N), mask=offs < N)

    def _copy_with_kernel(src, q, k, v):
        dst = torch.empty_like(src)
        _copy_kernel[(triton.cdiv(src.numel(), 256),)](src.contiguous(), dst, src.numel(), q, k, v, BLOCK=256)
        return dst

    def triton_forward_copies_sdpa(q, k, v, causal=False):
        return _copy_with_kernel(F.scaled_dot_product_attention(q, k, v, is_causal=causal), q, k, v)

    def triton_forward_copies_numpy(q, k, v, causal=False):
        import numpy as np

        s = q.numpy() @ np.swapaxes(k.numpy(), -1, -2) / math.sqrt(q.shape[-1])
        if causal:
            T = q.shape[-2]
            s = np.where(np.tril(np.ones((T, T), dtype=bool)), s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        out = torch.from_numpy((p / p.sum(-1, keepdims=True)) @ v.numpy()).to(q.dtype)
        return _copy_with_kernel(out, q, k, v)

    def triton_forward_laundered_through_copies(q, k, v, causal=False):
        """Copies q, k, v with a kernel first (so that their copies look kernel-made), computes the
        attention of the copies in PyTorch, and copies the result out with the kernel again."""
        q2, k2, v2 = (_copy_with_kernel(t, q, k, v) for t in (q, k, v))
        return _copy_with_kernel(F.scaled_dot_product_attention(q2, k2, v2, is_causal=causal), q, k, v)

    def triton_forward_returns_meta(q, k, v, causal=False):
        _forward("correct")(q, k, v, causal)
        return torch.empty_like(q, device="meta")

    def triton_backward_copies_autograd(q, k, v, out, lse, grad_out, causal=False):
        q2, k2, v2 = (t.detach().requires_grad_() for t in (q, k, v))
        F.scaled_dot_product_attention(q2, k2, v2, is_causal=causal).backward(grad_out)
        return tuple(_copy_with_kernel(t.grad, q, k, v) for t in (q2, k2, v2))

    WRONG["flash_attention_triton"] = [
        (_forward("fwd_unmasked_loads", MASK_LOADS=False), "read past the end of q, k or v"),
        (_forward("fwd_keys_past_T_not_masked", MASK_SCORES=False), "set the scores of those keys to -inf"),
        (_forward("fwd_unmasked_store", MASK_STORE=False), "wrote past the end"),
        (_forward("fwd_grid_floor", grid_floor=True), "never written"),
        (_forward("fwd_causal_strict", CAUSAL_MODE=1), "offs_m[:, None] >= offs_n[None, :]"),
        (_forward("fwd_causal_wrong_axis", CAUSAL_MODE=2), "future keys"),
        (_forward("fwd_causal_skips_diagonal", SKIP_DIAG=True), "diagonal block"),
        (_forward("fwd_no_sm_scale", SCALE_MODE=1), "not scaled by 1 / sqrt(d)"),
        (_forward("fwd_exp2_without_log2e", SCALE_MODE=2), "not multiplied by log2(e)"),
        (_forward("fwd_no_rescale", RESCALE=False), "the accumulator was not rescaled"),
        (_forward("fwd_no_normalisation", NORMALISE=False), "divide the accumulator by l"),
        (_forward("fwd_lse_log2", return_lse=True, LSE_LOG2=True), "lse is in log2 units"),
        (_forward("fwd_out_float32", out_fp32=True), "expected dtype torch.float16"),
        (_forward("fwd_loads_ignore_batch", LOADS_IGNORE_BATCH=True), "b * stride_b + h * stride_h"),
        (triton_forward_in_pytorch, "no Triton kernel ran"),
        (triton_forward_calls_course_kernel, "the course's own solution"),
        (_forward("fwd_grid_forgets_heads", grid_heads=False), "one per batch and head"),
        (_forward("fwd_skips_last_key_block", FULL_KEY_BLOCKS_ONLY=True),
         "got no weight from any query: the loop over key blocks stops before the last, partial block"),
        (triton_forward_copies_sdpa, "computed with q, k and v in PyTorch"),
        (triton_forward_copies_numpy, "took q, k or v out of PyTorch"),
        (triton_forward_laundered_through_copies, "computed with q, k and v in PyTorch"),
        (triton_forward_returns_meta, "meta device"),
    ]
    WRONG["flash_attention_triton_backward"] = [
        (_backward("bwd_causal_blocks_but_no_mask", CAUSAL_MODE=3), "the same shapes passed with causal=False"),
        (_backward("bwd_no_sm_scale", SCALE_GRADS=False), "miss the softmax scale"),
        (_backward("bwd_no_delta", USE_DELTA=False), "D is missing"),
        (_backward("bwd_lse_not_converted", LSE_CONVERT=False), "lse in the wrong units"),
        (_backward("bwd_no_causal_mask", CAUSAL_MODE=1), "causal mask is missing in the backward pass"),
        (_backward("bwd_causal_strict", CAUSAL_MODE=2), "also hides the diagonal"),
        (_backward("bwd_unmasked_loads", MASK_LOADS=False), "T is not a multiple of the block"),
        (_backward("bwd_unmasked_store", MASK_STORE=False), "wrote past the end"),
        (_backward("bwd_grads_float32", grads_fp32=True), "expected dtype torch.float16"),
        (triton_backward_in_pytorch, "no Triton kernel ran"),
        (triton_backward_copies_autograd, "computed with q, k and v in PyTorch"),
    ]
