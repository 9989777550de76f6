"""Round 2: a second set of learner-style wrong answers for all 45 exercises.

Written from the exercise statements only (not the checks, tests or solutions), avoiding the
mistakes already listed in nb01..nb12. Same format: `WRONG = {"<function>": [(mistake, fn), ...]}`.
Run with `.venv/bin/python -m tests.learner_wrong.baseline --print --only round2`.
"""

import math

import numpy as np
import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - Triton is Linux-only
    triton = tl = None


def _attend(q, k, v, causal=False, scale=None):
    s = q @ k.transpose(-2, -1) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if causal:
        Tq, Tk = s.shape[-2:]
        keep = torch.ones(Tq, Tk, dtype=torch.bool, device=s.device).tril(Tk - Tq)
        s = s.masked_fill(~keep, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def _heads(t, H):
    B, T, D = t.shape
    return t.view(B, T, H, D // H).transpose(1, 2)


def _merge(o):
    B, H, T, dk = o.shape
    return o.transpose(1, 2).reshape(B, T, H * dk)


# ---- 1.1 qkv_projection(x, w_qkv, n_heads) -----------------------------------------------------


def r2_qkv_w_rows(x, w_qkv, n_heads):
    D = x.shape[-1]
    wq, wk, wv = w_qkv.reshape(3, D, D)  # "three D x D matrices stacked"
    return tuple(_heads(x @ w, n_heads) for w in (wq, wk, wv))


def r2_qkv_blocks_transposed(x, w_qkv, n_heads):
    D = x.shape[-1]
    wq, wk, wv = w_qkv.split(D, dim=1)
    return tuple(_heads(x @ w.T, n_heads) for w in (wq, wk, wv))  # nn.Linear habit: x @ W.T


def r2_qkv_qvk(x, w_qkv, n_heads):
    D = x.shape[-1]
    q, v, k = (x @ w_qkv).split(D, dim=-1)
    return _heads(q, n_heads), _heads(k, n_heads), _heads(v, n_heads)


def r2_qkv_flat_bh(x, w_qkv, n_heads):
    B, T, D = x.shape
    q, k, v = (x @ w_qkv).split(D, dim=-1)
    return tuple(_heads(t, n_heads).reshape(B * n_heads, T, D // n_heads) for t in (q, k, v))


# ---- 1.2 merge_heads(o) ------------------------------------------------------------------------


def r2_merge_cat_list(o):
    return torch.cat(list(o), dim=-1)  # list(o) unbinds the batch axis, not the heads


def r2_merge_flatten_1(o):
    return o.transpose(1, 2).flatten(1)


def r2_merge_transpose_0_1(o):
    B, H, T, dk = o.shape
    return o.transpose(0, 1).reshape(B, T, H * dk)


def r2_merge_float(o):
    return _merge(o).float()


# ---- 1.3 scaled_dot_product_attention(q, k, v) -------------------------------------------------


def r2_sdpa_softmax_dim1(q, k, v):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    return torch.softmax(s, dim=1) @ v  # "dim=1 is the key axis of a [T_q, T_k] matrix"


def r2_sdpa_scale_tq(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-2]), dim=-1) @ v


def r2_sdpa_float32(q, k, v):
    s = q.float() @ k.float().transpose(-2, -1) / math.sqrt(q.shape[-1])
    return torch.softmax(s, dim=-1) @ v.float()


def r2_sdpa_global_max(q, k, v):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    e = torch.exp(s - s.max())  # one max for the whole tensor
    return (e / e.sum(-1, keepdim=True)) @ v


# ---- 2.1 scaled_scores(q, k) -------------------------------------------------------------------


def r2_scores_tensordot(q, k):
    return torch.tensordot(q, k, dims=([-1], [-1])) / math.sqrt(q.shape[-1])


def r2_scores_d_model(q, k):
    d = q.shape[-1] * (q.shape[-3] if q.dim() >= 3 else 1)  # H * d_k
    return q @ k.transpose(-2, -1) / math.sqrt(d)


def r2_scores_elementwise(q, k):
    return (q * k).sum(-1, keepdim=True) / math.sqrt(q.shape[-1])


# ---- 2.2 attention_entropy(p) ------------------------------------------------------------------


def r2_entropy_perplexity(p):
    h = -torch.where(p > 0, p * torch.log(p), torch.zeros_like(p)).sum(-1)
    return torch.exp(h)


def r2_entropy_renyi2(p):
    return -torch.log((p * p).sum(-1))


def r2_entropy_mean_log(p):
    return -torch.log(p).mean(-1)


def r2_entropy_clamp_both(p):
    p = p.clamp(min=1e-4)
    return -(p * p.log()).sum(-1)


# ---- 2.3 dot_product_std(d_k, n_samples, generator) --------------------------------------------


def r2_std_mean_over_dk(d_k, n_samples, generator):
    q = torch.randn(n_samples, d_k, generator=generator)
    k = torch.randn(n_samples, d_k, generator=generator)
    return float((q * k).mean(-1).std())


def r2_std_of_products(d_k, n_samples, generator):
    q = torch.randn(n_samples, d_k, generator=generator)
    k = torch.randn(n_samples, d_k, generator=generator)
    return float((q * k).std())


def r2_std_generator_seed(d_k, n_samples, generator):
    generator.seed()  # "read the seed" (it draws a fresh random seed)
    q = torch.randn(n_samples, d_k, generator=generator)
    k = torch.randn(n_samples, d_k, generator=generator)
    return float((q * k).sum(-1).std())


def r2_std_standard_error(d_k, n_samples, generator):
    q = torch.randn(n_samples, d_k, generator=generator)
    k = torch.randn(n_samples, d_k, generator=generator)
    return float((q * k).sum(-1).std() / math.sqrt(n_samples))


# ---- 3.1 causal_mask(T) ------------------------------------------------------------------------


def r2_causal_uint8(T):
    return torch.ones(T, T).tril().to(torch.uint8)


def r2_causal_numpy(T):
    return np.tril(np.ones((T, T), dtype=bool))


_BIG = torch.ones(1024, 1024, dtype=torch.bool).tril()


def r2_causal_fixed_buffer(T):
    return _BIG[:T, :T]  # a precomputed max-size buffer, as in nanoGPT


# ---- 3.2 padding_mask(lengths, T) --------------------------------------------------------------


def r2_pad_lengths_as_padding(lengths, T):
    j = torch.arange(T)
    return (j[None, :] < (T - lengths)[:, None])[:, None, None, :]


def r2_pad_unsqueeze_0(lengths, T):
    B = lengths.shape[0]
    return (torch.arange(T).expand(B, T) < lengths.unsqueeze(0))[:, None, None, :]


def r2_pad_expanded(lengths, T):
    m = torch.arange(T)[None, :] < lengths[:, None]
    return m[:, None, None, :].expand(-1, 1, T, T)


def r2_pad_queries_too(lengths, T):
    m = torch.arange(T)[None, :] < lengths[:, None]
    return m[:, None, :, None] & m[:, None, None, :]


# ---- 3.3 masked_softmax(scores, allowed) -------------------------------------------------------


def r2_msm_any_without_keepdim(scores, allowed):
    p = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.where(allowed.any(-1), p, torch.zeros_like(p))


def r2_msm_scores_times_mask(scores, allowed):
    p = torch.softmax(scores * allowed, dim=-1)
    return p * allowed


def r2_msm_mask_transposed(scores, allowed):
    a = allowed.transpose(-2, -1)
    s = scores.masked_fill(~a, float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    e = torch.exp(s - m)
    d = e.sum(-1, keepdim=True)
    return e / torch.where(d > 0, d, torch.ones_like(d))


def r2_msm_fill_min_minus_one(scores, allowed):
    s = scores.masked_fill(~allowed, float(scores.min()) - 1)  # "smaller than any real score"
    p = torch.softmax(s, dim=-1)
    return p * allowed.any(-1, keepdim=True)


# ---- 3.4 prefix_lm_mask(T, prefix_len) ---------------------------------------------------------


def r2_prefix_and(T, prefix_len):
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    return (j <= i) & (j < prefix_len)


def r2_prefix_tril_offset(T, prefix_len):
    return torch.ones(T, T, dtype=torch.bool).tril(prefix_len)


def r2_prefix_loop_from_one(T, prefix_len):
    m = torch.ones(T, T, dtype=torch.bool).tril()
    for i in range(1, prefix_len):
        m[i, :prefix_len] = True
    return m


# ---- 3.5 packed_causal_mask(seq_lens) ----------------------------------------------------------


def r2_packed_equal_lengths(seq_lens):
    N = sum(seq_lens)
    pos = torch.arange(N)
    sid = pos // seq_lens[0]
    return (sid[:, None] == sid[None, :]) & (pos[None, :] <= pos[:, None])


def _sid_local(seq_lens):
    sid = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(seq_lens))
    cu = torch.tensor([0] + list(seq_lens)).cumsum(0)
    local = torch.arange(sum(seq_lens)) - cu[sid]
    return sid, local


def r2_packed_or(seq_lens):
    sid, _ = _sid_local(seq_lens)
    pos = torch.arange(sum(seq_lens))
    return (sid[:, None] == sid[None, :]) | (pos[None, :] <= pos[:, None])


def r2_packed_local_causal_only(seq_lens):
    _, local = _sid_local(seq_lens)
    return local[None, :] <= local[:, None]


def r2_packed_insert_zero(seq_lens):
    cu = seq_lens
    cu.insert(0, 0)  # build cu_seqlens in the list (modifies the caller's list)
    cu = torch.tensor(cu).cumsum(0)
    N = int(cu[-1])
    m = torch.zeros(N, N, dtype=torch.bool)
    for s in range(len(cu) - 1):
        a, b = int(cu[s]), int(cu[s + 1])
        m[a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
    return m


# ---- 3.6 find_mask_leaks(attention_fn, allowed, d_model) ---------------------------------------


def _leaks(attention_fn, allowed, d_model, *, base="randn", pert="randn", dtype=torch.float64,
           as_tensors=False, all_at_once=False):
    T = allowed.shape[0]
    g = torch.Generator().manual_seed(0)
    if base == "zeros":
        x = torch.zeros(1, T, d_model, dtype=dtype)
    else:
        x = torch.randn(1, T, d_model, generator=g, dtype=dtype)
    y = attention_fn(x)
    tol = 1e-6 * (1 + float(x.abs().max()))
    out = []
    if all_at_once:
        for i in range(T):
            blocked = [j for j in range(T) if not allowed[i, j]]
            if not blocked:
                continue
            x2 = x.clone()
            for j in blocked:
                x2[0, j] += torch.randn(d_model, generator=g, dtype=dtype)
            if (attention_fn(x2)[0, i] - y[0, i]).abs().max() > tol:
                out += [(i, j) for j in blocked]
        return sorted(out)
    for j in range(T):
        x2 = x.clone()
        if pert == "ones":
            x2[0, j] += 1.0
        else:
            x2[0, j] += torch.randn(d_model, generator=g, dtype=dtype)
        y2 = attention_fn(x2)
        diff = (y2[0] - y[0]).abs().amax(-1)
        for i in range(T):
            if not allowed[i, j] and diff[i] > tol:
                out.append((i, j))
    out = sorted(out)
    if as_tensors:
        nz = torch.tensor(out, dtype=torch.long).reshape(-1, 2)
        return [tuple(r) for r in nz]  # tuples of 0-d tensors
    return out


def r2_leaks_constant_perturbation(attention_fn, allowed, d_model):
    return _leaks(attention_fn, allowed, d_model, pert="ones")


def r2_leaks_zero_base(attention_fn, allowed, d_model):
    return _leaks(attention_fn, allowed, d_model, base="zeros")


def r2_leaks_tensor_tuples(attention_fn, allowed, d_model):
    return _leaks(attention_fn, allowed, d_model, as_tensors=True)


def r2_leaks_float32(attention_fn, allowed, d_model):
    return _leaks(attention_fn, allowed, d_model, dtype=torch.float32)


def r2_leaks_all_blocked_at_once(attention_fn, allowed, d_model):
    return _leaks(attention_fn, allowed, d_model, all_at_once=True)


# ---- 4.1 softmax_jacobian(s) -------------------------------------------------------------------


def r2_jac_eye_float32(s):
    n = s.shape[0]
    return torch.eye(n) * s - torch.outer(s, s)  # eye is float32: promotes half inputs


def r2_jac_log_softmax(s):
    n = s.shape[0]
    return torch.eye(n, dtype=s.dtype) - s[None, :].expand(n, n)


def r2_jac_s_i_squared(s):
    return torch.diag(s) - s[:, None] * s[:, None]


# ---- 4.2 softmax_backward(p, grad_p) -----------------------------------------------------------


def r2_sb_p_on_first_term_only(p, grad_p):
    return p * grad_p - (p * grad_p).sum(-1, keepdim=True)


def r2_sb_log_softmax_backward(p, grad_p):
    return grad_p - p * grad_p.sum(-1, keepdim=True)


def r2_sb_in_place(p, grad_p):
    dot = (p * grad_p).sum(-1, keepdim=True)
    return grad_p.sub_(dot).mul_(p)


# ---- 4.3 attention_backward(q, k, v, grad_out, causal) -----------------------------------------


def _ab(q, k, v, g, causal, *, dq_ds_t=False, delta_v=False, mask_inverted=False,
        p_unscaled=False, dk_with_k=False, mask_ds_only=False):
    d = q.shape[-1]
    sc = 1 / math.sqrt(d)
    s = q @ k.transpose(-2, -1) * (1.0 if p_unscaled else sc)
    T = q.shape[-2]
    keep = torch.ones(T, T, dtype=torch.bool).tril()
    if causal and not mask_ds_only:
        s = s.masked_fill(keep if mask_inverted else ~keep, float("-inf"))
    p = torch.softmax(s, dim=-1)
    out = p @ v
    dv = p.transpose(-2, -1) @ g
    dp = g @ v.transpose(-2, -1)
    if delta_v:
        delta = (g * v).sum(-1, keepdim=True)
    else:
        delta = (g * out).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    if causal and mask_ds_only:
        ds = ds.masked_fill(~keep, 0.0)
    dq = (ds.transpose(-2, -1) if dq_ds_t else ds) @ k * sc
    dk = ds.transpose(-2, -1) @ (k if dk_with_k else q) * sc
    return dq, dk, dv


def r2_ab_dq_from_ds_t(q, k, v, grad_out, causal):
    return _ab(q, k, v, grad_out, causal, dq_ds_t=True)


def r2_ab_delta_with_v(q, k, v, grad_out, causal):
    return _ab(q, k, v, grad_out, causal, delta_v=True)


def r2_ab_mask_not_inverted(q, k, v, grad_out, causal):
    return _ab(q, k, v, grad_out, causal, mask_inverted=True)


def r2_ab_p_unscaled(q, k, v, grad_out, causal):
    return _ab(q, k, v, grad_out, causal, p_unscaled=True)


def r2_ab_dk_times_k(q, k, v, grad_out, causal):
    return _ab(q, k, v, grad_out, causal, dk_with_k=True)


def r2_ab_mask_on_ds_only(q, k, v, grad_out, causal):
    return _ab(q, k, v, grad_out, causal, mask_ds_only=True)


# ---- 5.1 multi_head_attention(x, w_qkv, w_o, n_heads, causal) ----------------------------------


def _mha(x, w_qkv, w_o, n_heads, causal, *, scale_d=False, wo_t=False, merge_no_t=False,
         always_causal=False, no_wo=False, ablate=None, ablate_after=False, ablate_q=False,
         rescale=False):
    B, T, D = x.shape
    q, k, v = (_heads(t, n_heads) for t in (x @ w_qkv).split(D, dim=-1))
    if ablate_q:
        q = q.clone()
        q[:, ablate] = 0
    sc = 1 / math.sqrt(D) if scale_d else None
    o = _attend(q, k, v, causal or always_causal, sc)
    if ablate is not None and not ablate_after and not ablate_q:
        o = o.clone()
        o[:, ablate] = 0
        if rescale:
            o = o * n_heads / (n_heads - 1)
    merged = o.reshape(B, T, D) if merge_no_t else _merge(o)
    if no_wo:
        return merged
    y = merged @ (w_o.T if wo_t else w_o)
    if ablate is not None and ablate_after:
        dk = D // n_heads
        y = y.clone()
        y[..., ablate * dk:(ablate + 1) * dk] = 0
    return y


def r2_mha_scale_d_model(x, w_qkv, w_o, n_heads, causal=False):
    return _mha(x, w_qkv, w_o, n_heads, causal, scale_d=True)


def r2_mha_wo_transposed(x, w_qkv, w_o, n_heads, causal=False):
    return _mha(x, w_qkv, w_o, n_heads, causal, wo_t=True)


def r2_mha_merge_without_transpose(x, w_qkv, w_o, n_heads, causal=False):
    return _mha(x, w_qkv, w_o, n_heads, causal, merge_no_t=True)


def r2_mha_always_causal(x, w_qkv, w_o, n_heads, causal=False):
    return _mha(x, w_qkv, w_o, n_heads, causal, always_causal=True)


def r2_mha_no_wo(x, w_qkv, w_o, n_heads, causal=False):
    return _mha(x, w_qkv, w_o, n_heads, causal, no_wo=True)


# ---- 5.2 mha_param_count(d_model, n_heads, bias) -----------------------------------------------


def r2_params_full_matrices_per_head(d_model, n_heads, bias=False):
    return 4 * n_heads * d_model * d_model + (4 * d_model if bias else 0)


def r2_params_bias_head_wide(d_model, n_heads, bias=False):
    return 4 * d_model * d_model + (4 * (d_model // n_heads) if bias else 0)


def r2_params_float(d_model, n_heads, bias=False):
    d_k = d_model / n_heads
    return 4 * d_model * n_heads * d_k + (4 * d_model if bias else 0)


def r2_params_no_wo_bias(d_model, n_heads, bias=False):
    return 4 * d_model * d_model + (3 * d_model if bias else 0)


# ---- 5.3 ablate_head(x, w_qkv, w_o, n_heads, head, causal) -------------------------------------


def r2_ablate_after_wo(x, w_qkv, w_o, n_heads, head, causal=False):
    return _mha(x, w_qkv, w_o, n_heads, causal, ablate=head, ablate_after=True)


def r2_ablate_query(x, w_qkv, w_o, n_heads, head, causal=False):
    return _mha(x, w_qkv, w_o, n_heads, causal, ablate=head, ablate_q=True)


def r2_ablate_value_weights_in_place(x, w_qkv, w_o, n_heads, head, causal=False):
    D = x.shape[-1]
    dk = D // n_heads
    w_qkv[:, 2 * D + head * dk:2 * D + (head + 1) * dk] = 0  # zero the head's W_V columns
    return _mha(x, w_qkv, w_o, n_heads, causal)


def r2_ablate_one_based(x, w_qkv, w_o, n_heads, head, causal=False):
    return _mha(x, w_qkv, w_o, n_heads, causal, ablate=head - 1)


def r2_ablate_rescaled(x, w_qkv, w_o, n_heads, head, causal=False):
    return _mha(x, w_qkv, w_o, n_heads, causal, ablate=head, rescale=True)


# ---- 6.1 repeat_kv(x, n_rep) -------------------------------------------------------------------


def r2_rkv_tiled(x, n_rep):
    return x.repeat(1, n_rep, 1, 1)


def r2_rkv_tokens(x, n_rep):
    B, H, T, d = x.shape
    return x.repeat_interleave(n_rep, dim=2).reshape(B, H * n_rep, T, d)


def r2_rkv_batch(x, n_rep):
    B, H, T, d = x.shape
    return x.repeat_interleave(n_rep, dim=0).reshape(B, H * n_rep, T, d)


def r2_rkv_expand_token_axis(x, n_rep):
    B, H, T, d = x.shape
    return x[:, :, :, None].expand(B, H, T, n_rep, d).reshape(B, H * n_rep, T, d)


# ---- 6.2 grouped_query_attention(q, k, v, causal) ----------------------------------------------


def r2_gqa_tiled(q, k, v, causal=False):
    rep = q.shape[1] // k.shape[1]
    return _attend(q, k.repeat(1, rep, 1, 1), v.repeat(1, rep, 1, 1), causal)


def r2_gqa_fold_group_into_tokens(q, k, v, causal=False):
    B, H, T, d = q.shape
    Hkv = k.shape[1]
    rep = H // Hkv
    qf = q.reshape(B, Hkv, rep * T, d)  # each group's heads stacked along the token axis
    s = qf @ k.transpose(-2, -1) / math.sqrt(d)
    if causal:
        keep = torch.ones(rep * T, T, dtype=torch.bool).tril()
        s = s.masked_fill(~keep, float("-inf"))
    return (torch.softmax(s, dim=-1) @ v).reshape(B, H, T, d)


def r2_gqa_mean_queries(q, k, v, causal=False):
    B, H, T, d = q.shape
    Hkv = k.shape[1]
    qm = q.reshape(B, Hkv, H // Hkv, T, d).mean(2)  # one query per group
    o = _attend(qm, k, v, causal)
    return o.repeat_interleave(H // Hkv, dim=1)


# ---- 6.3 kv_values_per_token(kind, ...) --------------------------------------------------------


def r2_kvpt_no_two(kind, n_heads, n_kv_heads, head_dim, kv_lora_rank, rope_dim):
    if kind == "mla":
        return kv_lora_rank + rope_dim
    h = {"mha": n_heads, "gqa": n_kv_heads, "mqa": 1}[kind]
    return h * head_dim


def r2_kvpt_mqa_uses_n_kv_heads(kind, n_heads, n_kv_heads, head_dim, kv_lora_rank, rope_dim):
    if kind == "mla":
        return kv_lora_rank + rope_dim
    h = n_heads if kind == "mha" else n_kv_heads
    return 2 * h * head_dim


def r2_kvpt_mla_rope_per_head(kind, n_heads, n_kv_heads, head_dim, kv_lora_rank, rope_dim):
    if kind == "mla":
        return kv_lora_rank + n_heads * rope_dim
    h = {"mha": n_heads, "gqa": n_kv_heads, "mqa": 1}[kind]
    return 2 * h * head_dim


def r2_kvpt_mla_doubled(kind, n_heads, n_kv_heads, head_dim, kv_lora_rank, rope_dim):
    if kind == "mla":
        return 2 * (kv_lora_rank + rope_dim)  # "a key latent and a value latent"
    h = {"mha": n_heads, "gqa": n_kv_heads, "mqa": 1}[kind]
    return 2 * h * head_dim


def r2_kvpt_mha_uses_n_kv_heads(kind, n_heads, n_kv_heads, head_dim, kv_lora_rank, rope_dim):
    if kind == "mla":
        return kv_lora_rank + rope_dim
    h = 1 if kind == "mqa" else n_kv_heads
    return 2 * h * head_dim


# ---- 6.4 mla_absorbed_scores(q, c_kv, w_uk) ----------------------------------------------------


def r2_mla_per_head_keys(q, c_kv, w_uk):
    out = []
    for h in range(w_uk.shape[0]):
        k_h = c_kv @ w_uk[h]  # [B, T, d_h]: one head's keys
        out.append(q[:, h] @ k_h.transpose(-2, -1))
    return torch.stack(out, dim=1)


def r2_mla_no_transpose(q, c_kv, w_uk):
    q_lat = q @ w_uk  # needs d_h == d_c to run; then silently W_UK instead of W_UK^T
    return q_lat @ c_kv[:, None].transpose(-2, -1)


def r2_mla_scaled(q, c_kv, w_uk):
    q_lat = q @ w_uk.transpose(-2, -1)
    return q_lat @ c_kv[:, None].transpose(-2, -1) / math.sqrt(q.shape[-1])


def r2_mla_batch_against_heads(q, c_kv, w_uk):
    q_lat = q @ w_uk.transpose(-2, -1)
    return q_lat @ c_kv.transpose(-2, -1)  # [B, d_c, T] broadcasts its B against the heads


def r2_mla_transposed_result(q, c_kv, w_uk):
    q_lat = q @ w_uk.transpose(-2, -1)
    return c_kv[:, None] @ q_lat.transpose(-2, -1)  # [B, H, T, T_q]


# ---- 7.1 kv_cache_bytes(...) -------------------------------------------------------------------


def r2_kvb_no_two(batch, seq_len, n_layers, n_kv_heads, head_dim, dtype_bytes):
    return batch * seq_len * n_layers * n_kv_heads * head_dim * dtype_bytes


def r2_kvb_bf16_hardcoded(batch, seq_len, n_layers, n_kv_heads, head_dim, dtype_bytes):
    return 2 * batch * seq_len * n_layers * n_kv_heads * head_dim * 2


def r2_kvb_gib(batch, seq_len, n_layers, n_kv_heads, head_dim, dtype_bytes):
    return 2 * batch * seq_len * n_layers * n_kv_heads * head_dim * dtype_bytes / 2**30


def r2_kvb_no_batch(batch, seq_len, n_layers, n_kv_heads, head_dim, dtype_bytes):
    return 2 * seq_len * n_layers * n_kv_heads * head_dim * dtype_bytes


# ---- 7.2 decode_step(x_t, k_cache, v_cache, w_qkv, w_o, n_heads) -------------------------------


def _decode(x_t, k_cache, v_cache, w_qkv, w_o, n_heads, *, attend_first=False, is_causal=False,
            prepend=False, return_old=False, scale_d=False, wo_t=False):
    B, _, D = x_t.shape
    q, k, v = (_heads(t, n_heads) for t in (x_t @ w_qkv).split(D, dim=-1))
    if prepend:
        kc, vc = torch.cat([k, k_cache], dim=2), torch.cat([v, v_cache], dim=2)
    else:
        kc, vc = torch.cat([k_cache, k], dim=2), torch.cat([v_cache, v], dim=2)
    K, V = (k_cache, v_cache) if attend_first else (kc, vc)
    if is_causal:
        o = F.scaled_dot_product_attention(q, K, V, is_causal=True)
    else:
        o = _attend(q, K, V, scale=1 / math.sqrt(D) if scale_d else None)
    y = _merge(o) @ (w_o.T if wo_t else w_o)
    return (y, k_cache, v_cache) if return_old else (y, kc, vc)


def r2_decode_attend_before_append(x_t, k_cache, v_cache, w_qkv, w_o, n_heads):
    return _decode(x_t, k_cache, v_cache, w_qkv, w_o, n_heads, attend_first=True)


def r2_decode_is_causal(x_t, k_cache, v_cache, w_qkv, w_o, n_heads):
    return _decode(x_t, k_cache, v_cache, w_qkv, w_o, n_heads, is_causal=True)


def r2_decode_prepend(x_t, k_cache, v_cache, w_qkv, w_o, n_heads):
    return _decode(x_t, k_cache, v_cache, w_qkv, w_o, n_heads, prepend=True)


def r2_decode_returns_given_caches(x_t, k_cache, v_cache, w_qkv, w_o, n_heads):
    return _decode(x_t, k_cache, v_cache, w_qkv, w_o, n_heads, return_old=True)


def r2_decode_scale_d_model(x_t, k_cache, v_cache, w_qkv, w_o, n_heads):
    return _decode(x_t, k_cache, v_cache, w_qkv, w_o, n_heads, scale_d=True)


def r2_decode_wo_transposed(x_t, k_cache, v_cache, w_qkv, w_o, n_heads):
    return _decode(x_t, k_cache, v_cache, w_qkv, w_o, n_heads, wo_t=True)


# ---- 7.3 prefill_decode_flops(prompt_len, new_tokens, d_model, n_layers, use_cache) -------------


def r2_pdf_step_off_by_one(prompt_len, new_tokens, d_model, n_layers, use_cache):
    P, d = prompt_len, d_model
    total = 8 * d * d * P + 4 * d * P * P
    for t in range(new_tokens):  # L = P + t for t = 0 .. n - 1
        L = P + t
        total += (8 * d * d + 4 * d * L) if use_cache else (8 * d * d * L + 4 * d * L * L)
    return total * n_layers


def r2_pdf_cache_no_projections(prompt_len, new_tokens, d_model, n_layers, use_cache):
    P, d = prompt_len, d_model
    total = 8 * d * d * P + 4 * d * P * P
    for t in range(1, new_tokens + 1):
        L = P + t
        total += (4 * d * L) if use_cache else (8 * d * d * L + 4 * d * L * L)
    return total * n_layers


def r2_pdf_layers_on_prefill_only(prompt_len, new_tokens, d_model, n_layers, use_cache):
    P, d = prompt_len, d_model
    total = (8 * d * d * P + 4 * d * P * P) * n_layers
    for t in range(1, new_tokens + 1):
        L = P + t
        total += (8 * d * d + 4 * d * L) if use_cache else (8 * d * d * L + 4 * d * L * L)
    return total


def r2_pdf_prefill_only_with_cache(prompt_len, new_tokens, d_model, n_layers, use_cache):
    P, d = prompt_len, d_model
    total = (8 * d * d * P + 4 * d * P * P) if use_cache else 0  # "no cache: nothing to prefill"
    for t in range(1, new_tokens + 1):
        L = P + t
        total += (8 * d * d + 4 * d * L) if use_cache else (8 * d * d * L + 4 * d * L * L)
    return total * n_layers


def r2_pdf_closed_form_n_squared(prompt_len, new_tokens, d_model, n_layers, use_cache):
    P, d, n = prompt_len, d_model, new_tokens
    total = 8 * d * d * P + 4 * d * P * P
    if use_cache:
        total += 8 * d * d * n + 4 * d * (n * P + n * n // 2)  # sum of t taken as n^2 / 2
    else:
        for t in range(1, n + 1):
            L = P + t
            total += 8 * d * d * L + 4 * d * L * L
    return total * n_layers


# ---- 7.4 ring_buffer_decode_step(q, k_new, v_new, k_buf, v_buf, t) ----------------------------


def _rb(q, k_new, v_new, k_buf, v_buf, t, *, n_mod=False, k_into_v=False, scale_tq=False,
        rolled=False, window_slice=False):
    W = k_buf.shape[2]
    kb, vb = k_buf.clone(), v_buf.clone()
    slot = t % W
    kb[:, :, slot] = k_new[:, :, 0]
    vb[:, :, slot] = (k_new if k_into_v else v_new)[:, :, 0]
    n = (t % W + 1) if n_mod else min(t + 1, W)
    if window_slice:
        K, V = kb[:, :, slot - n + 1:slot + 1], vb[:, :, slot - n + 1:slot + 1]
    else:
        K, V = kb[:, :, :n], vb[:, :, :n]
    rep = q.shape[1] // k_buf.shape[1]
    K, V = K.repeat_interleave(rep, dim=1), V.repeat_interleave(rep, dim=1)
    sc = 1 / math.sqrt(q.shape[-2] if scale_tq else q.shape[-1])
    o = torch.softmax(q @ K.transpose(-2, -1) * sc, dim=-1) @ V
    if rolled:
        kb = torch.roll(kb, -(slot + 1), dims=2)
        vb = torch.roll(vb, -(slot + 1), dims=2)
    return o, kb, vb


def r2_rb_n_from_slot(q, k_new, v_new, k_buf, v_buf, t):
    return _rb(q, k_new, v_new, k_buf, v_buf, t, n_mod=True)


def r2_rb_k_into_v(q, k_new, v_new, k_buf, v_buf, t):
    return _rb(q, k_new, v_new, k_buf, v_buf, t, k_into_v=True)


def r2_rb_scale_from_query_len(q, k_new, v_new, k_buf, v_buf, t):
    return _rb(q, k_new, v_new, k_buf, v_buf, t, scale_tq=True)


def r2_rb_returned_rolled(q, k_new, v_new, k_buf, v_buf, t):
    return _rb(q, k_new, v_new, k_buf, v_buf, t, rolled=True)


def r2_rb_window_slice_no_wrap(q, k_new, v_new, k_buf, v_buf, t):
    return _rb(q, k_new, v_new, k_buf, v_buf, t, window_slice=True)


# ---- 8.1 attention_flops(n, d_model, n_heads, n_kv_heads, head_dim) ----------------------------


def _af(n, d, H, Hkv, dh, *, scores_kv=False, mac1_proj=False, o_dd=False, ignore_dh=False,
        total_no_softmax=False):
    if ignore_dh:
        dh = d // H
    m = 1 if mac1_proj else 2
    r = {
        "q_proj": m * n * d * H * dh,
        "k_proj": m * n * d * Hkv * dh,
        "v_proj": m * n * d * Hkv * dh,
        "o_proj": m * n * (d if o_dd else H * dh) * d,
        "scores": 2 * n * n * dh * (Hkv if scores_kv else H),
        "softmax": 6 * n * n * H,
        "weighted_values": 2 * n * n * dh * (Hkv if scores_kv else H),
    }
    r["total"] = sum(v for key, v in r.items() if not (total_no_softmax and key == "softmax"))
    return r


def r2_af_core_per_kv_head(n, d_model, n_heads, n_kv_heads, head_dim):
    return _af(n, d_model, n_heads, n_kv_heads, head_dim, scores_kv=True)


def r2_af_projection_mac_as_one(n, d_model, n_heads, n_kv_heads, head_dim):
    return _af(n, d_model, n_heads, n_kv_heads, head_dim, mac1_proj=True)


def r2_af_o_proj_d_by_d(n, d_model, n_heads, n_kv_heads, head_dim):
    return _af(n, d_model, n_heads, n_kv_heads, head_dim, o_dd=True)


def r2_af_head_dim_from_d(n, d_model, n_heads, n_kv_heads, head_dim):
    return _af(n, d_model, n_heads, n_kv_heads, head_dim, ignore_dh=True)


def r2_af_total_without_softmax(n, d_model, n_heads, n_kv_heads, head_dim):
    return _af(n, d_model, n_heads, n_kv_heads, head_dim, total_no_softmax=True)


# ---- 8.2 score_matrix_bytes(batch, n_heads, seq_len, dtype_bytes) ------------------------------


def r2_smb_linear_in_t(batch, n_heads, seq_len, dtype_bytes):
    return batch * n_heads * seq_len * dtype_bytes


def r2_smb_gb(batch, n_heads, seq_len, dtype_bytes):
    return batch * n_heads * seq_len * seq_len * dtype_bytes / 1e9


def r2_smb_no_heads(batch, n_heads, seq_len, dtype_bytes):
    return batch * seq_len * seq_len * dtype_bytes


def r2_smb_fp32_always(batch, n_heads, seq_len, dtype_bytes):
    return batch * n_heads * seq_len * seq_len * 4


# ---- 8.3 max_seq_len_for_scores(budget_bytes, batch, n_heads, dtype_bytes) ---------------------


def r2_msl_float_sqrt(budget_bytes, batch, n_heads, dtype_bytes):
    return int(math.sqrt(budget_bytes / (batch * n_heads * dtype_bytes)))


def r2_msl_round(budget_bytes, batch, n_heads, dtype_bytes):
    return round(math.sqrt(budget_bytes / (batch * n_heads * dtype_bytes)))


def r2_msl_strict(budget_bytes, batch, n_heads, dtype_bytes):
    T = math.isqrt(budget_bytes // (batch * n_heads * dtype_bytes))
    while T > 0 and batch * n_heads * T * T * dtype_bytes >= budget_bytes:
        T -= 1
    return T


def r2_msl_ceil(budget_bytes, batch, n_heads, dtype_bytes):
    return math.ceil(math.sqrt(budget_bytes / (batch * n_heads * dtype_bytes)))


def r2_msl_no_dtype(budget_bytes, batch, n_heads, dtype_bytes):
    return math.isqrt(budget_bytes // (batch * n_heads))


# ---- 8.4 training_memory(cfg, batch, seq_len, attention) ---------------------------------------


def _tm(cfg, batch, seq_len, attention, *, grads_fp32=False, dff3=False, tied=False,
        head_per_layer=False, k_only=False):
    from helpers.nb08_flops_memory import dense_param_count

    N = dense_param_count(cfg, tied_embeddings=tied)
    d, L, H, Hkv, dh, dff, V = (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads,
                                cfg.head_dim, cfg.d_ff, cfg.vocab)
    flash = 4 * d + 2 * H * dh + (1 if k_only else 2) * Hkv * dh + (3 if dff3 else 4) * dff
    head = 2 * d + V
    if attention == "flash":
        per_layer = flash
    elif attention == "naive":
        per_layer = flash + H * seq_len
    else:
        per_layer = d
    per_tok = L * (per_layer + (head if head_per_layer else 0)) + (0 if head_per_layer else head)
    if attention == "recompute":
        per_tok += flash - d
    r = {"weights": 2 * N, "gradients": (4 if grads_fp32 else 2) * N, "optimizer": 12 * N,
         "activations": 2 * batch * seq_len * per_tok}
    r["total"] = sum(r.values())
    return r


def r2_tm_gradients_fp32(cfg, batch, seq_len, attention):
    return _tm(cfg, batch, seq_len, attention, grads_fp32=True)


def r2_tm_mlp_three_dff(cfg, batch, seq_len, attention):
    return _tm(cfg, batch, seq_len, attention, dff3=True)


def r2_tm_tied_embeddings(cfg, batch, seq_len, attention):
    return _tm(cfg, batch, seq_len, attention, tied=True)


def r2_tm_head_in_every_layer(cfg, batch, seq_len, attention):
    return _tm(cfg, batch, seq_len, attention, head_per_layer=True)


def r2_tm_kv_width_once(cfg, batch, seq_len, attention):
    return _tm(cfg, batch, seq_len, attention, k_only=True)


# ---- 9.1 online_softmax(x, block_size) ---------------------------------------------------------


def _os(x, block_size, *, stale_exp=False, chunks=False, l0=0.0):
    n = x.shape[-1]
    m = torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype)
    l = torch.full(x.shape[:-1], l0, dtype=x.dtype)
    if chunks:
        blocks = list(x.chunk(block_size, dim=-1))  # block_size read as the number of blocks
    else:
        blocks = [x[..., s:s + block_size] for s in range(0, n, block_size)]
    pieces = []
    for blk in blocks:
        m_new = torch.maximum(m, blk.amax(-1))
        ms = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
        old = torch.where(m == float("-inf"), ms, m)
        fac = torch.exp(old - ms)
        e = torch.exp(blk - ms[..., None])
        l = l * fac + e.sum(-1)
        m = m_new
        if stale_exp:
            pieces.append(e)  # kept with the max of its time, never rescaled
    ms = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    ls = torch.where(l > 0, l, torch.ones_like(l))
    if stale_exp:
        return torch.cat(pieces, dim=-1) / ls[..., None]
    return torch.exp(x - ms[..., None]) / ls[..., None]


def r2_os_stale_block_exps(x, block_size):
    return _os(x, block_size, stale_exp=True)


def r2_os_chunk_count(x, block_size):
    return _os(x, block_size, chunks=True)


def r2_os_l_starts_at_one(x, block_size):
    return _os(x, block_size, l0=1.0)


def r2_os_split_leading_axis(x, block_size):
    # x.split(block_size) cuts along dim 0; each "block" is then a whole group of rows
    outs = []
    for blk in x.split(block_size):
        bm = blk.amax(-1)
        bms = torch.where(bm == float("-inf"), torch.zeros_like(bm), bm)
        e = torch.exp(blk - bms[..., None])
        s = e.sum(-1, keepdim=True)
        outs.append(e / torch.where(s > 0, s, torch.ones_like(s)))
    return torch.cat(outs, dim=0)


# ---- 9.2 flash_attention_tiled(q, k, v, causal, block_size) ------------------------------------


def _ft(q, k, v, causal, bs, *, normalise_each=False, tile_max=False, mixed_index=False,
        rescale_after=False, p_at_k=False):
    B, H, T, d = q.shape
    sc = 1 / math.sqrt(d)
    out = torch.empty_like(q)
    lse = torch.empty(B, H, T, dtype=torch.float32)
    for qs in range(0, T, bs):
        qe = min(qs + bs, T)
        qb = q[:, :, qs:qe]
        m = torch.full((B, H, qe - qs), float("-inf"))
        l = torch.zeros(B, H, qe - qs)
        acc = torch.zeros(B, H, qe - qs, d)
        for ks in range(0, T, bs):
            if causal and ks >= qe:
                break
            ke = min(ks + bs, T)
            s = qb @ k[:, :, ks:ke].transpose(-2, -1) * sc
            if causal and ke - 1 > qs:
                i = torch.arange(qs, qe)[:, None]
                j = torch.arange(ks, ke)[None, :] - (ks if mixed_index else 0)
                s = s.masked_fill(j > i, float("-inf"))
            if tile_max:
                bm = s.amax(dim=(0, 1, 2, 3)).expand(B, H, qe - qs)
            else:
                bm = s.amax(-1)
            m_new = torch.maximum(m, bm)
            alpha = torch.exp(m - m_new)
            p = torch.exp(s - m_new[..., None])
            tile = p @ (k if p_at_k else v)[:, :, ks:ke]
            l = l * alpha + p.sum(-1)
            if rescale_after:
                acc = (acc + tile) * alpha[..., None]
            else:
                acc = acc * alpha[..., None] + tile
            if normalise_each:
                acc = acc / l[..., None]
            m = m_new
        out[:, :, qs:qe] = acc if normalise_each else acc / l[..., None]
        lse[:, :, qs:qe] = m + torch.log(l)
    return out, lse


def r2_ft_normalise_each_tile(q, k, v, causal=False, block_size=64):
    return _ft(q, k, v, causal, block_size, normalise_each=True)


def r2_ft_one_max_per_tile(q, k, v, causal=False, block_size=64):
    return _ft(q, k, v, causal, block_size, tile_max=True)


def r2_ft_mixed_index_mask(q, k, v, causal=False, block_size=64):
    return _ft(q, k, v, causal, block_size, mixed_index=True)


def r2_ft_rescale_after_adding(q, k, v, causal=False, block_size=64):
    return _ft(q, k, v, causal, block_size, rescale_after=True)


def r2_ft_p_times_k(q, k, v, causal=False, block_size=64):
    return _ft(q, k, v, causal, block_size, p_at_k=True)


# ---- 10.1 rope(x, positions, base) -------------------------------------------------------------


def _rope(x, positions, base, *, interleaved=False, no_two=False, sign=False, arange=False,
          fp32_tables=False):
    d = x.shape[-1]
    half = d // 2
    i = torch.arange(half, dtype=torch.float64)
    theta = base ** (-(i if no_two else 2 * i) / d)
    pos = torch.arange(x.shape[-2]) if arange else positions
    ang = pos.to(torch.float64)[:, None] * theta[None, :]
    dt = torch.float32 if fp32_tables else x.dtype
    cos, sin = ang.cos().to(dt), ang.sin().to(dt)
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
    else:
        a, b = x[..., :half], x[..., half:]
    if sign:
        ra, rb = a * cos + b * sin, -a * sin + b * cos
    else:
        ra, rb = a * cos - b * sin, a * sin + b * cos
    if interleaved:
        return torch.stack([ra, rb], dim=-1).flatten(-2)
    return torch.cat([ra, rb], dim=-1)


def r2_rope_interleaved_pairs(x, positions, base=10000.0):
    return _rope(x, positions, base, interleaved=True)


def r2_rope_theta_i_over_d(x, positions, base=10000.0):
    return _rope(x, positions, base, no_two=True)


def r2_rope_rotates_backwards(x, positions, base=10000.0):
    return _rope(x, positions, base, sign=True)


def r2_rope_ignores_positions(x, positions, base=10000.0):
    return _rope(x, positions, base, arange=True)


def r2_rope_float32_tables(x, positions, base=10000.0):
    return _rope(x, positions, base, fp32_tables=True)


# ---- 10.2 alibi_bias(n_heads, T) ---------------------------------------------------------------


def _alibi(H, T, *, h0=False, plus=False, no_abs=False, reversed_=False):
    h = torch.arange(H, dtype=torch.float64)
    slopes = 2.0 ** (-8 * (h if h0 else h + 1) / H)
    if reversed_:
        slopes = slopes.flip(0)
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    dist = (j - i) if no_abs else (i - j).abs()
    b = slopes[:, None, None] * dist if plus else -slopes[:, None, None] * dist
    return b.to(torch.float32)


def r2_alibi_slope_from_h(n_heads, T):
    return _alibi(n_heads, T, h0=True)


def r2_alibi_positive(n_heads, T):
    return _alibi(n_heads, T, plus=True)


def r2_alibi_signed_distance(n_heads, T):
    return _alibi(n_heads, T, no_abs=True)


def r2_alibi_slopes_reversed(n_heads, T):
    return _alibi(n_heads, T, reversed_=True)


# ---- 10.3 llama3_rope_frequencies(...) ---------------------------------------------------------


def _l3(inv, s, low, high, L, *, sort=False, swap_branches=False, new_len=False, wl_times=False):
    if sort:
        inv = inv.sort(descending=True).values  # sorted to find the bands, returned sorted
    if new_len:
        L = L * s
    lam = 2 * math.pi * inv if wl_times else 2 * math.pi / inv
    smooth = (L / lam - low) / (high - low)
    blend = (1 - smooth) * inv / s + smooth * inv
    short, long_ = lam < L / high, lam > L / low
    if swap_branches:
        return torch.where(short, inv / s, torch.where(long_, inv, blend))
    return torch.where(short, inv, torch.where(long_, inv / s, blend))


def r2_l3_returned_sorted(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len):
    return _l3(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len, sort=True)


def r2_l3_branches_swapped(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len):
    return _l3(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len,
               swap_branches=True)


def r2_l3_new_context_as_l(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len):
    return _l3(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len,
               new_len=True)


def r2_l3_wavelength_times_theta(inv_freq, factor, low_freq_factor, high_freq_factor,
                                 original_max_len):
    return _l3(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len,
               wl_times=True)


# ---- 11.1 swiglu(x, w_gate, w_up, w_down) ------------------------------------------------------


def r2_swiglu_silu_on_up(x, w_gate, w_up, w_down):
    return ((x @ w_gate) * F.silu(x @ w_up)) @ w_down


def r2_swiglu_sigmoid(x, w_gate, w_up, w_down):
    return (torch.sigmoid(x @ w_gate) * (x @ w_up)) @ w_down


def r2_swiglu_silu_of_product(x, w_gate, w_up, w_down):
    return F.silu((x @ w_gate) * (x @ w_up)) @ w_down


def r2_swiglu_gelu(x, w_gate, w_up, w_down):
    return (F.gelu(x @ w_gate) * (x @ w_up)) @ w_down


# ---- 11.2 causal_lm_loss(logits, targets) ------------------------------------------------------


def r2_lm_shifted_again(logits, targets):
    V = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].reshape(-1, V), targets[:, 1:].reshape(-1))


def r2_lm_nll_on_logits(logits, targets):
    V = logits.shape[-1]
    return F.nll_loss(logits.reshape(-1, V), targets.reshape(-1))


def r2_lm_item(logits, targets):
    V = logits.shape[-1]
    return F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1)).item()


def r2_lm_log_of_softmax(logits, targets):
    p = torch.softmax(logits, dim=-1)
    return -torch.log(p.gather(-1, targets[..., None])).mean()


# ---- 11.3 induction_scores(attn) ---------------------------------------------------------------


def _ind(attn, *, key_off=1, swap=False, reduce="mean"):
    T = attn.shape[-1]
    m = T // 2
    i = torch.arange(m, 2 * m)
    j = i - m + key_off
    w = attn[..., j, i] if swap else attn[..., i, j]
    return w.sum(-1) if reduce == "sum" else w.mean(-1)


def r2_ind_previous_occurrence(attn):
    return _ind(attn, key_off=0)


def r2_ind_diagonal_includes_m_minus_1(attn):
    m = attn.shape[-1] // 2
    return torch.diagonal(attn, offset=-(m - 1), dim1=-2, dim2=-1).mean(-1)


def r2_ind_query_key_swapped(attn):
    return _ind(attn, swap=True)


def r2_ind_sum(attn):
    return _ind(attn, reduce="sum")


def r2_ind_positive_offset(attn):
    m = attn.shape[-1] // 2
    return torch.diagonal(attn, offset=m - 1, dim1=-2, dim2=-1).mean(-1)


# ---- 11.4 k_composition_score(w_qk, w_ov) ------------------------------------------------------


def r2_kc_precedence(w_qk, w_ov):
    return float(torch.linalg.norm(w_qk @ w_ov.T) / torch.linalg.norm(w_qk) * torch.linalg.norm(w_ov))


def r2_kc_hadamard(w_qk, w_ov):
    return float(torch.linalg.norm(w_qk * w_ov.T) / (torch.linalg.norm(w_qk) * torch.linalg.norm(w_ov)))


def r2_kc_sum_of_column_norms(w_qk, w_ov):
    def nrm(m):
        return torch.linalg.norm(m, dim=0).sum()
    return float(nrm(w_qk @ w_ov.T) / (nrm(w_qk) * nrm(w_ov)))


# ---- 12.1 gather_paged_kv(pages, block_table, seq_len) -----------------------------------------


def r2_gp_slot_major(pages, block_table, seq_len):
    bs, H, d = pages.shape[1:]
    nb = math.ceil(seq_len / bs)
    g = pages[block_table[:nb].long()]  # [nb, bs, H, d]
    return g.transpose(0, 1).reshape(-1, H, d)[:seq_len].transpose(0, 1)


def r2_gp_block_size_from_shape0(pages, block_table, seq_len):
    bs = pages.shape[0]  # took the pool size for the block size
    nb = math.ceil(seq_len / bs)
    g = pages[block_table[:nb].long()]
    return g.reshape(-1, *pages.shape[2:])[:seq_len].transpose(0, 1)


def r2_gp_cut_after_transpose(pages, block_table, seq_len):
    bs = pages.shape[1]
    nb = math.ceil(seq_len / bs)
    g = pages[block_table[:nb].long()].reshape(-1, *pages.shape[2:])
    return g.transpose(0, 1)[:seq_len]  # cuts the head axis


# ---- 12.2 merge_partials(outs, lses) -----------------------------------------------------------


def r2_mp_weight_sign(outs, lses):
    mx = lses.max(0).values
    mxs = torch.where(torch.isinf(mx), torch.zeros_like(mx), mx)
    den = torch.exp(lses - mxs).sum(0)
    lse = mxs + torch.log(den)
    w = torch.exp(lse - lses)  # e^(l - l_c)
    out = (w[..., None] * outs).sum(0)
    return out, lse


def r2_mp_lse_is_max(outs, lses):
    mx = lses.max(0).values
    mxs = torch.where(torch.isinf(mx), torch.zeros_like(mx), mx)
    w = torch.exp(lses - mxs)
    den = w.sum(0)
    out = (w[..., None] * outs).sum(0) / torch.where(den > 0, den, torch.ones_like(den))[..., None]
    return out, mx


def r2_mp_in_place(outs, lses):
    mx = lses.max(0).values
    mxs = torch.where(torch.isinf(mx), torch.zeros_like(mx), mx)
    w = torch.exp(lses - mxs)
    den = w.sum(0)
    outs.mul_(w[..., None])  # weights applied in the caller's tensor
    out = outs.sum(0) / torch.where(den > 0, den, torch.ones_like(den))[..., None]
    return out, mxs + torch.log(den)


# ---- 12.3 blocks_in_use(events, block_size) ----------------------------------------------------


def _bu(events, bs, *, full_has_room=False, fork_no_ref=False, copy_as_empty=False,
        keep_zero=False, unpack3=False):
    ref, tables, lens = {}, {}, {}
    counter = [0]

    def fresh():
        b = counter[0]
        counter[0] += 1
        ref[b] = 1
        return b

    def drop(b):
        if b not in ref:
            return
        ref[b] -= 1
        if ref[b] == 0 and not keep_zero:
            del ref[b]

    for ev in events:
        if unpack3:
            kind, s, n = ev
        kind = ev[0]
        if kind == "new":
            _, s, n = ev
            tables[s] = [fresh() for _ in range(-(-n // bs))]
            lens[s] = n
        elif kind == "fork":
            _, s, c = ev
            tables[c] = list(tables[s])
            lens[c] = lens[s]
            if not fork_no_ref:
                for b in tables[c]:
                    ref[b] += 1
        elif kind == "append":
            _, s, n = ev
            tab, L = tables[s], lens[s]
            free = bs - L % bs if full_has_room else (bs - L % bs) % bs
            rest = n
            if free > 0 and tab:
                last = tab[-1]
                if ref.get(last, 0) > 1:
                    drop(last)
                    tab[-1] = fresh()
                    if copy_as_empty:
                        free = bs
                rest -= min(free, n)
            tab += [fresh() for _ in range(-(-rest // bs))]
            lens[s] = L + n
        elif kind == "free":
            _, s = ev
            for b in tables.pop(s):
                drop(b)
            lens.pop(s)
    return len(ref)


def r2_bu_full_block_has_room(events, block_size):
    return _bu(events, block_size, full_has_room=True)


def r2_bu_fork_adds_no_reference(events, block_size):
    return _bu(events, block_size, fork_no_ref=True)


def r2_bu_copy_treated_as_empty(events, block_size):
    return _bu(events, block_size, copy_as_empty=True)


def r2_bu_counts_zero_ref_blocks(events, block_size):
    return _bu(events, block_size, keep_zero=True)


def r2_bu_unpacks_three(events, block_size):
    return _bu(events, block_size, unpack3=True)


# ---- Triton: 9.3, 9.4, 12.4 -------------------------------------------------------------------
# One kernel per exercise with a `BUG` constexpr; each wrong answer launches it with one mistake.

if triton is not None:

    @triton.jit
    def _r2_fwd_kernel(Q, K, V, Out, Lse, sm_scale, stride_b, stride_h, stride_t, H, T,
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
        qk_scale = sm_scale * 1.4426950408889634
        hi = T
        if CAUSAL:
            hi = tl.minimum((start_m + 1) * BLOCK_M, T)
        for start_n in range(0, hi, BLOCK_N):
            cols = start_n + offs_n
            kv_ptrs = base + cols[:, None] * stride_t + offs_d[None, :]
            k = tl.load(K + kv_ptrs, mask=cols[:, None] < T, other=0.0)
            v = tl.load(V + kv_ptrs, mask=cols[:, None] < T, other=0.0)
            s = tl.dot(q, tl.trans(k)) * qk_scale
            if BUG == 2:  # key mask with the block-relative index
                s = tl.where(offs_n[None, :] < T, s, float("-inf"))
            else:
                s = tl.where(cols[None, :] < T, s, float("-inf"))
            if CAUSAL:
                s = tl.where(offs_m[:, None] >= cols[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            if BUG == 1:  # row sums over the wrong axis (BLOCK_M == BLOCK_N, so it runs)
                l_i = l_i * alpha + tl.sum(p, 0)
            else:
                l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        acc = acc / l_i[:, None]
        o_ptrs = Out + base + offs_m[:, None] * stride_t + offs_d[None, :]
        tl.store(o_ptrs, acc.to(Out.dtype.element_ty), mask=offs_m[:, None] < T)
        lse = (m_i + tl.log2(l_i)) * 0.6931471805599453
        tl.store(Lse + off_bh * T + offs_m, lse, mask=offs_m < T)


def _r2_blocks():
    import os

    return (32, 32) if os.environ.get("TRITON_INTERPRET") == "1" else (64, 64)


def _r2_fwd(q, k, v, causal, bug, lse_dtype=torch.float32):
    B, H, T, d = q.shape
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    BM, BN = _r2_blocks()
    out = torch.empty_like(q)
    lse = torch.empty(B, H, T, dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(T, BM), B * H)
    _r2_fwd_kernel[grid](q, k, v, out, lse, 1 / math.sqrt(d), q.stride(0), q.stride(1),
                         q.stride(2), H, T, HEAD_DIM=d, CAUSAL=bool(causal), BLOCK_M=BM,
                         BLOCK_N=BN, BUG=bug)
    return out, lse.to(lse_dtype)


def r2_fa_row_sum_axis_0(q, k, v, causal=False):
    return _r2_fwd(q, k, v, causal, 1)


def r2_fa_key_mask_block_relative(q, k, v, causal=False):
    return _r2_fwd(q, k, v, causal, 2)


def r2_fa_lse_in_input_dtype(q, k, v, causal=False):
    return _r2_fwd(q, k, v, causal, 0, lse_dtype=q.dtype)


if triton is not None:

    @triton.jit
    def _r2_bwd_dkdv_kernel(Q, K, V, DO, DK, DV, Lse, Delta, sm_scale, stride_b, stride_h,
                            stride_t, H, T, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BUG: tl.constexpr):
        start_n = tl.program_id(0)
        off_bh = tl.program_id(1)
        base = (off_bh // H) * stride_b + (off_bh % H) * stride_h
        offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        kv_offs = base + offs_n[:, None] * stride_t + offs_d[None, :]
        k = tl.load(K + kv_offs, mask=offs_n[:, None] < T, other=0.0)
        v = tl.load(V + kv_offs, mask=offs_n[:, None] < T, other=0.0)
        dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
        dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
        lo = 0
        if CAUSAL:
            lo = (start_n * BLOCK_N // BLOCK_M) * BLOCK_M
        for start_m in range(lo, T, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            q_offs = base + offs_m[:, None] * stride_t + offs_d[None, :]
            q = tl.load(Q + q_offs, mask=offs_m[:, None] < T, other=0.0)
            do = tl.load(DO + q_offs, mask=offs_m[:, None] < T, other=0.0)
            if BUG == 1:  # lse read at the program's key positions
                lse = tl.load(Lse + off_bh * T + offs_n, mask=offs_n < T, other=0.0)
            else:
                lse = tl.load(Lse + off_bh * T + offs_m, mask=offs_m < T, other=0.0)
            delta = tl.load(Delta + off_bh * T + offs_m, mask=offs_m < T, other=0.0)
            s = tl.dot(q, tl.trans(k)) * sm_scale
            p = tl.exp(s - lse[:, None])
            valid = (offs_m[:, None] < T) & (offs_n[None, :] < T)
            if CAUSAL:
                valid = valid & (offs_m[:, None] >= offs_n[None, :])
            p = tl.where(valid, p, 0.0)
            dp = tl.dot(do, tl.trans(v)).to(tl.float32)
            ds = p * (dp - delta[:, None])
            if BUG == 2:  # dV from dS instead of P
                dv += tl.dot(tl.trans(ds).to(do.dtype), do)
            else:
                dv += tl.dot(tl.trans(p).to(do.dtype), do)
            dk += tl.dot(tl.trans(ds).to(q.dtype), q)
        dk = dk * sm_scale
        tl.store(DK + kv_offs, dk.to(DK.dtype.element_ty), mask=offs_n[:, None] < T)
        tl.store(DV + kv_offs, dv.to(DV.dtype.element_ty), mask=offs_n[:, None] < T)

    @triton.jit
    def _r2_bwd_dq_kernel(Q, K, V, DO, DQ, Lse, Delta, sm_scale, stride_b, stride_h, stride_t,
                          H, T, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        start_m = tl.program_id(0)
        off_bh = tl.program_id(1)
        base = (off_bh // H) * stride_b + (off_bh % H) * stride_h
        offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        q_offs = base + offs_m[:, None] * stride_t + offs_d[None, :]
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
            k = tl.load(K + kv_offs, mask=offs_n[:, None] < T, other=0.0)
            v = tl.load(V + kv_offs, mask=offs_n[:, None] < T, other=0.0)
            s = tl.dot(q, tl.trans(k)) * sm_scale
            p = tl.exp(s - lse[:, None])
            valid = (offs_m[:, None] < T) & (offs_n[None, :] < T)
            if CAUSAL:
                valid = valid & (offs_m[:, None] >= offs_n[None, :])
            p = tl.where(valid, p, 0.0)
            dp = tl.dot(do, tl.trans(v)).to(tl.float32)
            ds = p * (dp - delta[:, None])
            dq += tl.dot(ds.to(k.dtype), k)
        dq = dq * sm_scale
        tl.store(DQ + q_offs, dq.to(DQ.dtype.element_ty), mask=offs_m[:, None] < T)


def _r2_bwd(q, k, v, out, lse, grad_out, causal, bug):
    B, H, T, d = q.shape
    q, k, v, out, grad_out, lse = (t.contiguous() for t in (q, k, v, out, grad_out, lse))
    BM, BN = _r2_blocks()
    delta = (grad_out.float() * out.float()).sum(-1).contiguous()
    lse = lse.float().contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    sc = 1 / math.sqrt(d)
    args = (q.stride(0), q.stride(1), q.stride(2), H, T)
    _r2_bwd_dkdv_kernel[(triton.cdiv(T, BN), B * H)](
        q, k, v, grad_out, dk, dv, lse, delta, sc, *args, HEAD_DIM=d, CAUSAL=bool(causal),
        BLOCK_M=BM, BLOCK_N=BN, BUG=bug)
    _r2_bwd_dq_kernel[(triton.cdiv(T, BM), B * H)](
        q, k, v, grad_out, dq, lse, delta, sc, *args, HEAD_DIM=d, CAUSAL=bool(causal),
        BLOCK_M=BM, BLOCK_N=BN)
    return dq, dk, dv


def r2_fb_lse_at_key_positions(q, k, v, out, lse, grad_out, causal=False):
    return _r2_bwd(q, k, v, out, lse, grad_out, causal, 1)


def r2_fb_dv_from_ds(q, k, v, out, lse, grad_out, causal=False):
    return _r2_bwd(q, k, v, out, lse, grad_out, causal, 2)


if triton is not None:

    @triton.jit
    def _r2_split_kernel(Q, K, V, Tables, Lens, Parts, Lse, sm_scale, n_splits, n_heads, group,
                         n_seqs, stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_tb,
                         HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BUG: tl.constexpr):
        split = tl.program_id(0)
        b = tl.program_id(1)
        h = tl.program_id(2)
        kvh = h // group
        seq_len = tl.load(Lens + b)
        n_pages = (seq_len + PAGE - 1) // PAGE
        per = (n_pages + n_splits - 1) // n_splits
        start = split * per
        end = tl.minimum(start + per, n_pages)
        offs_d = tl.arange(0, HEAD_DIM)
        offs_s = tl.arange(0, PAGE)
        q = tl.load(Q + b * stride_qb + h * stride_qh + offs_d).to(tl.float32)
        m = tl.max(tl.full([PAGE], float("-inf"), tl.float32), 0)
        l = tl.sum(tl.zeros([PAGE], tl.float32), 0)
        acc = tl.zeros([HEAD_DIM], tl.float32)
        for pg in range(start, end):
            if BUG == 2:  # the table read from the split's own first entry
                blk = tl.load(Tables + b * stride_tb + (pg - start))
            else:
                blk = tl.load(Tables + b * stride_tb + pg)
            tok = pg * PAGE + offs_s
            valid = tok < seq_len
            ptr = blk * stride_kb + offs_s[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :]
            k = tl.load(K + ptr, mask=valid[:, None], other=0.0).to(tl.float32)
            v = tl.load(V + ptr, mask=valid[:, None], other=0.0).to(tl.float32)
            s = tl.sum(k * q[None, :], 1) * sm_scale
            s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 0))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new)
            l = l * alpha + tl.sum(p, 0)
            acc = acc * alpha + tl.sum(p[:, None] * v, 0)
            m = m_new
        has = l > 0
        safe_l = tl.where(has, l, 1.0)
        if BUG == 1:  # stored the unnormalised accumulator
            part = acc
        else:
            part = acc / safe_l
        lse = tl.where(has, m + tl.log(safe_l), float("-inf"))
        row = (split * n_seqs + b) * n_heads + h
        tl.store(Parts + row * HEAD_DIM + offs_d, part)
        tl.store(Lse + row, lse)


def _r2_paged(q, k_pages, v_pages, block_tables, seq_lens, n_splits, sm_scale, bug):
    B, H, d = q.shape
    Hkv = k_pages.shape[2]
    PAGE = k_pages.shape[1]
    S = 4 if n_splits is None else int(n_splits)
    sc = 1 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    q = q.contiguous()
    k_pages, v_pages = k_pages.contiguous(), v_pages.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    parts = torch.empty(S, B, H, d, dtype=torch.float32, device=q.device)
    lses = torch.empty(S, B, H, dtype=torch.float32, device=q.device)
    _r2_split_kernel[(S, B, H)](
        q, k_pages, v_pages, tables, lens, parts, lses, sc, S, H, H // Hkv, B,
        q.stride(0), q.stride(1), k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        tables.stride(0), HEAD_DIM=d, PAGE=PAGE, BUG=bug)
    mx = lses.max(0).values
    mxs = torch.where(torch.isinf(mx), torch.zeros_like(mx), mx)
    w = torch.exp(lses - mxs)
    den = w.sum(0)
    out = (w[..., None] * parts).sum(0) / torch.where(den > 0, den, torch.ones_like(den))[..., None]
    return out.to(q.dtype)


def r2_pd_unnormalised_parts(q, k_pages, v_pages, block_tables, seq_lens, n_splits=None,
                             sm_scale=None):
    return _r2_paged(q, k_pages, v_pages, block_tables, seq_lens, n_splits, sm_scale, 1)


def r2_pd_table_from_split_start(q, k_pages, v_pages, block_tables, seq_lens, n_splits=None,
                                 sm_scale=None):
    return _r2_paged(q, k_pages, v_pages, block_tables, seq_lens, n_splits, sm_scale, 2)


WRONG = {
    "qkv_projection": [
        ("read w_qkv as three stacked D x D matrices (w_qkv.reshape(3, D, D))", r2_qkv_w_rows),
        ("transposed each D x D block (x @ W.T, the nn.Linear habit)", r2_qkv_blocks_transposed),
        ("split the projection as (q, v, k)", r2_qkv_qvk),
        ("flattened batch and heads: each [B*H, T, d_k]", r2_qkv_flat_bh),
    ],
    "merge_heads": [
        ("torch.cat(list(o), dim=-1): list() unbinds the batch axis, not the heads",
         r2_merge_cat_list),
        ("transpose(1, 2) then flatten(1): [B, T*D]", r2_merge_flatten_1),
        ("transpose(0, 1) instead of (1, 2), then reshape", r2_merge_transpose_0_1),
        ("returned float32 (.float()) whatever o's dtype", r2_merge_float),
    ],
    "scaled_dot_product_attention": [
        ("softmax(dim=1): the key axis only for 2-D scores", r2_sdpa_softmax_dim1),
        ("scaled by sqrt(T_q) (q.shape[-2]) instead of sqrt(d_k)", r2_sdpa_scale_tq),
        ("computed in float32 (dtype of the inputs not kept)", r2_sdpa_float32),
        ("hand-written softmax subtracting one max for the whole tensor", r2_sdpa_global_max),
    ],
    "scaled_scores": [
        ("torch.tensordot over the last axis: every batch pairs with every batch",
         r2_scores_tensordot),
        ("scaled by 1/sqrt(H * d_k) (d_model) instead of 1/sqrt(d_k)", r2_scores_d_model),
        ("(q * k).sum(-1): only the matching (i, i) pairs", r2_scores_elementwise),
    ],
    "attention_entropy": [
        ("returned the perplexity exp(H)", r2_entropy_perplexity),
        ("Renyi-2 entropy -log(sum p^2)", r2_entropy_renyi2),
        ("-mean(log p) (cross-entropy against uniform; log 0 = -inf)", r2_entropy_mean_log),
        ("p.clamp(min=1e-4) in both factors: zero weights contribute", r2_entropy_clamp_both),
    ],
    "dot_product_std": [
        ("mean over d_k instead of the sum (std 1/sqrt(d_k))", r2_std_mean_over_dk),
        ("std of the elementwise products q_i k_i, not of the dot products", r2_std_of_products),
        ("called generator.seed() (it reseeds at random)", r2_std_generator_seed),
        ("returned the standard error std / sqrt(n_samples)", r2_std_standard_error),
    ],
    "causal_mask": [
        ("returned a uint8 mask (.to(torch.uint8))", r2_causal_uint8),
        ("built it with NumPy (np.tril): an ndarray", r2_causal_numpy),
        ("sliced a precomputed 1024 x 1024 buffer (wrong for T > 1024)", r2_causal_fixed_buffer),
    ],
    "padding_mask": [
        ("read lengths as the number of padded positions: j < T - lengths[b]",
         r2_pad_lengths_as_padding),
        ("lengths.unsqueeze(0) instead of unsqueeze(1) (compares j with lengths[j])",
         r2_pad_unsqueeze_0),
        ("expanded to [B, 1, T, T]", r2_pad_expanded),
        ("masked padded queries too: [B, 1, T, T] = key mask & query mask", r2_pad_queries_too),
    ],
    "masked_softmax": [
        ("guard allowed.any(-1) without keepdim (broadcasts along the keys)",
         r2_msm_any_without_keepdim),
        ("multiplied scores by the mask before the softmax, and the weights after",
         r2_msm_scores_times_mask),
        ("transposed allowed before using it", r2_msm_mask_transposed),
        ("filled blocked scores with scores.min() - 1 (not -inf)", r2_msm_fill_min_minus_one),
    ],
    "prefix_lm_mask": [
        ("causal & (j < prefix_len): & instead of |", r2_prefix_and),
        ("tril(diagonal=prefix_len)", r2_prefix_tril_offset),
        ("loop over prefix rows from 1: row 0 stays causal", r2_prefix_loop_from_one),
    ],
    "packed_causal_mask": [
        ("sequence ids pos // seq_lens[0]: assumed equal lengths", r2_packed_equal_lengths),
        ("same sequence | causal: | instead of &", r2_packed_or),
        ("causal on positions within each sequence, no same-sequence test",
         r2_packed_local_causal_only),
        ("seq_lens.insert(0, 0) to build cu_seqlens (modifies the caller's list)",
         r2_packed_insert_zero),
    ],
    "find_mask_leaks": [
        ("perturbed by a constant vector of ones instead of a random one",
         r2_leaks_constant_perturbation),
        ("base input all zeros", r2_leaks_zero_base),
        ("pairs as tuples of 0-d tensors (from a tensor of indices)", r2_leaks_tensor_tuples),
        ("worked in float32 (randn's default), same tolerance", r2_leaks_float32),
        ("perturbed all blocked keys of a row at once and blamed all of them",
         r2_leaks_all_blocked_at_once),
    ],
    "softmax_jacobian": [
        ("torch.eye(n) * s: the float32 identity promotes half inputs", r2_jac_eye_float32),
        ("the log-softmax Jacobian I - 1 s^T", r2_jac_log_softmax),
        ("s[:, None] * s[:, None]: s_i^2 instead of s_i s_j", r2_jac_s_i_squared),
    ],
    "softmax_backward": [
        ("p only on the first term: p*g - sum(p*g)", r2_sb_p_on_first_term_only),
        ("the log-softmax backward g - p * sum(g)", r2_sb_log_softmax_backward),
        ("computed in place in grad_p (sub_ then mul_)", r2_sb_in_place),
    ],
    "attention_backward": [
        ("grad_q = dS^T @ k (dS transposed)", r2_ab_dq_from_ds_t),
        ("row sum D = rowsum(grad_out * v) instead of rowsum(grad_out * out)", r2_ab_delta_with_v),
        ("masked_fill(mask, -inf) with the allowed mask (blocked the allowed keys)",
         r2_ab_mask_not_inverted),
        ("recomputed P from unscaled scores q k^T", r2_ab_p_unscaled),
        ("grad_k = dS^T @ k (k instead of q)", r2_ab_dk_times_k),
        ("causal mask applied to dS only (P recomputed unmasked)", r2_ab_mask_on_ds_only),
    ],
    "multi_head_attention": [
        ("scaled by 1/sqrt(D) instead of 1/sqrt(d_k)", r2_mha_scale_d_model),
        ("merged @ w_o.T (nn.Linear habit)", r2_mha_wo_transposed),
        ("merged the heads with reshape(B, T, D) without the transpose",
         r2_mha_merge_without_transpose),
        ("always causal (ignored causal=False)", r2_mha_always_causal),
        ("forgot the output projection w_o", r2_mha_no_wo),
    ],
    "mha_param_count": [
        ("a full D x D matrix per head for each projection", r2_params_full_matrices_per_head),
        ("biases as wide as a head (4 d_k)", r2_params_bias_head_wide),
        ("d_k = D / H (float): returns a float", r2_params_float),
        ("biases for Q, K, V only (3 D)", r2_params_no_wo_bias),
    ],
    "ablate_head": [
        ("zeroed the head's columns after W_O", r2_ablate_after_wo),
        ("zeroed the head's query (uniform attention, not zero output)", r2_ablate_query),
        ("zeroed the head's W_V columns in w_qkv, in place", r2_ablate_value_weights_in_place),
        ("head counted from 1: zeroed head - 1", r2_ablate_one_based),
        ("rescaled the other heads by H / (H - 1) (dropout habit)", r2_ablate_rescaled),
    ],
    "repeat_kv": [
        ("x.repeat(1, n_rep, 1, 1): tiled [k0, k1, k0, k1]", r2_rkv_tiled),
        ("repeat_interleave on the token axis, then reshape", r2_rkv_tokens),
        ("repeat_interleave on the batch axis, then reshape", r2_rkv_batch),
        ("x[:, :, :, None].expand(...) (new axis after T), then reshape",
         r2_rkv_expand_token_axis),
    ],
    "grouped_query_attention": [
        ("k.repeat(1, H // H_kv, 1, 1): tiled heads", r2_gqa_tiled),
        ("folded each group's heads into the token axis; causal mask tril on [rep*T, T]",
         r2_gqa_fold_group_into_tokens),
        ("averaged each group's query heads, attended once, repeated the result",
         r2_gqa_mean_queries),
    ],
    "kv_values_per_token": [
        ("forgot the factor 2 (keys and values)", r2_kvpt_no_two),
        ("MQA used n_kv_heads instead of 1", r2_kvpt_mqa_uses_n_kv_heads),
        ("MLA: one RoPE key per head (n_heads * rope_dim)", r2_kvpt_mla_rope_per_head),
        ("MLA counted twice (a key latent and a value latent)", r2_kvpt_mla_doubled),
        ("MHA used n_kv_heads instead of n_heads", r2_kvpt_mha_uses_n_kv_heads),
    ],
    "mla_absorbed_scores": [
        ("formed one head's keys at a time in a loop (c_kv @ w_uk[h])", r2_mla_per_head_keys),
        ("q @ w_uk without the transpose", r2_mla_no_transpose),
        ("scaled the scores by 1/sqrt(d_h)", r2_mla_scaled),
        ("c_kv.mT without the head axis: batch broadcast against heads",
         r2_mla_batch_against_heads),
        ("returned [B, H, T, T_q] (c_kv @ q_lat^T)", r2_mla_transposed_result),
    ],
    "kv_cache_bytes": [
        ("forgot the factor 2 (keys and values)", r2_kvb_no_two),
        ("hard-coded 2 bytes (bf16), ignored dtype_bytes", r2_kvb_bf16_hardcoded),
        ("returned GiB (a float) instead of bytes", r2_kvb_gib),
        ("forgot the batch", r2_kvb_no_batch),
    ],
    "decode_step": [
        ("attended over the old caches, then appended (the new key left out)",
         r2_decode_attend_before_append),
        ("F.scaled_dot_product_attention(..., is_causal=True) with T_q = 1",
         r2_decode_is_causal),
        ("prepended the new key and value to the caches", r2_decode_prepend),
        ("returned the caches it was given", r2_decode_returns_given_caches),
        ("scaled by 1/sqrt(D) instead of 1/sqrt(d_k)", r2_decode_scale_d_model),
        ("applied w_o.T", r2_decode_wo_transposed),
    ],
    "prefill_decode_flops": [
        ("decode steps t = 0 .. n-1 (L = P + t - 1 off by one)", r2_pdf_step_off_by_one),
        ("with a cache, forgot the 8 d^2 projections per step", r2_pdf_cache_no_projections),
        ("n_layers applied to the prefill only", r2_pdf_layers_on_prefill_only),
        ("without a cache, left out the prefill", r2_pdf_prefill_only_with_cache),
        ("closed form with sum_t t = n^2 / 2", r2_pdf_closed_form_n_squared),
    ],
    "ring_buffer_decode_step": [
        ("attended to slots 0 .. t % W (the window shrinks after a wrap)", r2_rb_n_from_slot),
        ("copy-paste: wrote k_new into the value buffer", r2_rb_k_into_v),
        ("scale 1/sqrt(q.shape[-2]) (= 1) instead of 1/sqrt(d)", r2_rb_scale_from_query_len),
        ("returned the buffers rolled into chronological order", r2_rb_returned_rolled),
        ("attended to slots [t % W - n + 1, t % W] (negative start after a wrap)",
         r2_rb_window_slice_no_wrap),
    ],
    "attention_flops": [
        ("scores and weighted values per key/value head (H_kv)", r2_af_core_per_kv_head),
        ("projections counted a multiply-add as 1 FLOP", r2_af_projection_mac_as_one),
        ("o_proj as [n x d] . [d x d]", r2_af_o_proj_d_by_d),
        ("head_dim taken as d_model // n_heads", r2_af_head_dim_from_d),
        ("total leaves out the softmax", r2_af_total_without_softmax),
    ],
    "score_matrix_bytes": [
        ("B * H * T * bytes: T instead of T^2", r2_smb_linear_in_t),
        ("returned GB (a float, / 1e9)", r2_smb_gb),
        ("forgot the heads", r2_smb_no_heads),
        ("always 4 bytes (fp32 scores)", r2_smb_fp32_always),
    ],
    "max_seq_len_for_scores": [
        ("int(math.sqrt(budget / (B H bytes))) in floating point", r2_msl_float_sqrt),
        ("round() instead of floor", r2_msl_round),
        ("strict: largest T with bytes < budget (an exact fit excluded)", r2_msl_strict),
        ("math.ceil of the square root", r2_msl_ceil),
        ("forgot dtype_bytes", r2_msl_no_dtype),
    ],
    "training_memory": [
        ("gradients in fp32 (4N)", r2_tm_gradients_fp32),
        ("MLP saves 3 d_ff per token instead of 4 d_ff", r2_tm_mlp_three_dff),
        ("dense_param_count(cfg, tied_embeddings=True)", r2_tm_tied_embeddings),
        ("the head's 2d + V counted in every layer", r2_tm_head_in_every_layer),
        ("K/V width counted once: H_kv d_h instead of 2 H_kv d_h", r2_tm_kv_width_once),
    ],
    "online_softmax": [
        ("kept each block's exp(x - m) with the max of its time, divided by the final l",
         r2_os_stale_block_exps),
        ("x.chunk(block_size): block_size read as the number of blocks", r2_os_chunk_count),
        ("running sum started at 1", r2_os_l_starts_at_one),
        ("x.split(block_size): splits the leading axis, softmax of whole rows",
         r2_os_split_leading_axis),
    ],
    "flash_attention_tiled": [
        ("divided acc by l after every key block (normalised too early)",
         r2_ft_normalise_each_tile),
        ("one max per tile over all batch, heads and rows", r2_ft_one_max_per_tile),
        ("causal mask with global i and tile-local j", r2_ft_mixed_index_mask),
        ("rescaled acc by alpha after adding the new tile's P V", r2_ft_rescale_after_adding),
        ("copy-paste: P @ k_tile instead of P @ v_tile", r2_ft_p_times_k),
    ],
    "flash_attention_triton": [
        ("l_i updated with tl.sum(p, 0) (sums over the queries)", r2_fa_row_sum_axis_0),
        ("keys past T masked with the block-relative offs_n < T", r2_fa_key_mask_block_relative),
        ("returned lse in the inputs' dtype", r2_fa_lse_in_input_dtype),
    ],
    "flash_attention_triton_backward": [
        ("dK/dV kernel loaded lse at the program's key positions (offs_n)",
         r2_fb_lse_at_key_positions),
        ("dV accumulated from dS^T dO instead of P^T dO", r2_fb_dv_from_ds),
    ],
    "rope": [
        ("rotated interleaved pairs (x_2i, x_2i+1) (GPT-J convention)",
         r2_rope_interleaved_pairs),
        ("theta_i = base^(-i/d) (forgot the 2)", r2_rope_theta_i_over_d),
        ("rotated by -m theta (sign of sin flipped)", r2_rope_rotates_backwards),
        ("ignored positions: used arange(T)", r2_rope_ignores_positions),
        ("cos/sin tables in float32: other dtypes come back float32", r2_rope_float32_tables),
    ],
    "alibi_bias": [
        ("slope 2^(-8h/H) (h from 0: the first head gets slope 1)", r2_alibi_slope_from_h),
        ("+slope |i - j| (sign)", r2_alibi_positive),
        ("-slope (j - i): no abs", r2_alibi_signed_distance),
        ("slopes in reverse order (the first head the gentlest)", r2_alibi_slopes_reversed),
    ],
    "llama3_rope_frequencies": [
        ("sorted inv_freq to find the bands and returned it sorted", r2_l3_returned_sorted),
        ("short wavelengths slowed, long ones kept (branches swapped)", r2_l3_branches_swapped),
        ("L = original_max_len * factor (the new context)", r2_l3_new_context_as_l),
        ("wavelength 2 pi theta instead of 2 pi / theta", r2_l3_wavelength_times_theta),
    ],
    "swiglu": [
        ("SiLU on the up projection instead of the gate", r2_swiglu_silu_on_up),
        ("sigmoid instead of SiLU", r2_swiglu_sigmoid),
        ("SiLU of the product (x W_gate) * (x W_up)", r2_swiglu_silu_of_product),
        ("GELU instead of SiLU", r2_swiglu_gelu),
    ],
    "causal_lm_loss": [
        ("shifted again: logits[:, :-1] against targets[:, 1:]", r2_lm_shifted_again),
        ("F.nll_loss on the raw logits (no log_softmax)", r2_lm_nll_on_logits),
        ("returned .item() (a Python float)", r2_lm_item),
        ("-log(softmax(logits)) gathered: log 0 for very negative logits",
         r2_lm_log_of_softmax),
    ],
    "induction_scores": [
        ("weight on key i - m (the previous occurrence) instead of i - m + 1",
         r2_ind_previous_occurrence),
        ("mean of the whole diagonal offset -(m - 1): includes query m - 1",
         r2_ind_diagonal_includes_m_minus_1),
        ("attn[..., i - m + 1, i]: query and key swapped", r2_ind_query_key_swapped),
        ("sum over the queries instead of the mean", r2_ind_sum),
        ("diagonal offset +(m - 1) (upper diagonal)", r2_ind_positive_offset),
    ],
    "k_composition_score": [
        ("norm(W_QK W_OV^T) / norm(W_QK) * norm(W_OV): operator precedence", r2_kc_precedence),
        ("elementwise product W_QK * W_OV^T instead of the matrix product", r2_kc_hadamard),
        ("sum of column norms instead of the Frobenius norm", r2_kc_sum_of_column_norms),
    ],
    "gather_paged_kv": [
        ("transpose(0, 1) of the gathered [n, bs, H, d] before the reshape (slot-major order)",
         r2_gp_slot_major),
        ("block size from pages.shape[0] (the pool size)", r2_gp_block_size_from_shape0),
        ("cut [:seq_len] after the transpose (cuts the head axis)", r2_gp_cut_after_transpose),
    ],
    "merge_partials": [
        ("weights e^(l - l_c) (sign flipped)", r2_mp_weight_sign),
        ("lse = max of the chunk lses (forgot the log-sum)", r2_mp_lse_is_max),
        ("weighted outs in place (outs.mul_)", r2_mp_in_place),
    ],
    "blocks_in_use": [
        ("free slots block_size - n % block_size: a full last block looks empty",
         r2_bu_full_block_has_room),
        ("fork adds no reference to the shared blocks", r2_bu_fork_adds_no_reference),
        ("after a copy-on-write, treated the copy as empty", r2_bu_copy_treated_as_empty),
        ("kept blocks with zero references in the count", r2_bu_counts_zero_ref_blocks),
        ("unpacked every event as (kind, s, n): a ('free', s) event raises", r2_bu_unpacks_three),
    ],
    "paged_decode_triton": [
        ("stored each split's accumulator without dividing by its own sum",
         r2_pd_unnormalised_parts),
        ("each split read the block table from entry 0 (page index not offset by its start)",
         r2_pd_table_from_split_start),
    ],
}
