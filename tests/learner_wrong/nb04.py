"""Notebook 04 (backward): wrong answers written from the statements."""

import math

import numpy as np
import torch

# ---- 4.1 softmax_jacobian(s) -> diag(s) - s s^T --------------------------------------------------


def jac_no_diag(s):
    return -torch.outer(s, s)


def jac_plus_outer(s):
    return torch.diag(s) + torch.outer(s, s)


def jac_diagonal_only(s):
    return torch.diag(s * (1 - s))


def jac_sign_flipped(s):
    return torch.outer(s, s) - torch.diag(s)


def jac_dot_instead_of_outer(s):
    return torch.diag(s) - s @ s


def jac_identity(s):
    return torch.eye(s.shape[0], dtype=s.dtype) - torch.outer(s, s)


def jac_float32(s):
    s = s.float()
    return torch.diag(s) - torch.outer(s, s)


def jac_of_s_as_logits(s):
    return torch.autograd.functional.jacobian(lambda z: torch.softmax(z, -1), s)


def jac_broadcast_wrong_axis(s):
    n = s.shape[0]
    return s[:, None] * (torch.eye(n, dtype=s.dtype) - s[:, None])


def jac_numpy(s):
    a = s.detach().cpu().numpy()
    return np.diag(a) - np.outer(a, a)


def jac_fp16(s):
    h = s.half()
    return (torch.diag(h) - torch.outer(h, h)).to(s.dtype)


def jac_one_minus_s_outer(s):
    return torch.diag(s) - torch.outer(s, 1 - s)


# ---- 4.2 softmax_backward(p, grad_p) -------------------------------------------------------------


def sb_sum_all(p, g):
    return p * (g - (p * g).sum())


def sb_no_keepdim(p, g):
    return p * (g - (p * g).sum(-1))


def sb_no_sum(p, g):
    return p * g - p * p * g


def sb_no_leading_p(p, g):
    return g - (p * g).sum(-1, keepdim=True)


def sb_sum_of_g(p, g):
    return p * (g - g.sum(-1, keepdim=True))


def sb_sum_dim0(p, g):
    return p * (g - (p * g).sum(0, keepdim=True))


def sb_sign(p, g):
    return p * ((p * g).sum(-1, keepdim=True) - g)


def sb_diagonal_only(p, g):
    return p * (1 - p) * g


def sb_float32(p, g):
    p, g = p.float(), g.float()
    return p * (g - (p * g).sum(-1, keepdim=True))


def sb_mean(p, g):
    return p * (g - (p * g).mean(-1, keepdim=True))


def sb_matmul_all_pairs(p, g):
    return p * (g - (g @ p.transpose(-2, -1)).sum(-1, keepdim=True) / g.shape[-2])


def sb_unnormalised_sum(p, g):
    return p * (g - (p * g).sum(-1, keepdim=True) / p.sum(-1, keepdim=True).clamp_min(1e-30) * 2)


# ---- 4.3 attention_backward(q, k, v, grad_out, causal) -------------------------------------------


def _bwd(q, k, v, g, causal, *, scale_in_grads=True, dk_no_t=False, dv_no_t=False, dp_t=False,
         mask=True, sub_rowsum=True, rowsum_dim=-1, double_scale=False, shift=0, swap=False,
         t12=False, scale_dim=None):
    d = q.shape[-1] if scale_dim is None else scale_dim
    sc = 1 / math.sqrt(d)
    kt = k.transpose(1, 2) if t12 else k.transpose(-2, -1)
    s = q @ kt * sc
    T = q.shape[-2]
    if causal and mask:
        keep = torch.ones(T, T, dtype=torch.bool, device=q.device).tril(shift)
        s = s.masked_fill(~keep, float("-inf"))
    p = torch.softmax(s, dim=-1)
    dv = p @ g if dv_no_t else p.transpose(-2, -1) @ g
    dp = (v @ g.transpose(-2, -1)) if dp_t else g @ v.transpose(-2, -1)
    ds = p * (dp - (p * dp).sum(rowsum_dim, keepdim=True)) if sub_rowsum else p * dp
    f = (sc * sc if double_scale else sc) if scale_in_grads else 1.0
    dq = ds @ k * f
    dk = (ds @ q if dk_no_t else ds.transpose(-2, -1) @ q) * f
    return (dk, dq, dv) if swap else (dq, dk, dv)


def ab_no_scale(q, k, v, g, causal):
    return _bwd(q, k, v, g, causal, scale_in_grads=False)


def ab_dk_no_transpose(q, k, v, g, causal):
    return _bwd(q, k, v, g, causal, dk_no_t=True)


def ab_dv_no_transpose(q, k, v, g, causal):
    return _bwd(q, k, v, g, causal, dv_no_t=True)


def ab_dp_transposed(q, k, v, g, causal):
    return _bwd(q, k, v, g, causal, dp_t=True)


def ab_ignores_causal(q, k, v, g, causal):
    return _bwd(q, k, v, g, causal, mask=False)


def ab_no_rowsum(q, k, v, g, causal):
    return _bwd(q, k, v, g, causal, sub_rowsum=False)


def ab_rowsum_over_queries(q, k, v, g, causal):
    return _bwd(q, k, v, g, causal, rowsum_dim=-2)


def ab_scale_twice(q, k, v, g, causal):
    return _bwd(q, k, v, g, causal, double_scale=True)


def ab_mask_one_ahead(q, k, v, g, causal):
    return _bwd(q, k, v, g, causal, shift=1)


def ab_returns_k_first(q, k, v, g, causal):
    return _bwd(q, k, v, g, causal, swap=True)


def ab_transpose_1_2(q, k, v, g, causal):
    return _bwd(q, k, v, g, causal, t12=True)


def ab_scale_by_dv(q, k, v, g, causal):
    return _bwd(q, k, v, g, causal, scale_dim=v.shape[-1])


def ab_autograd(q, k, v, g, causal):
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        T = q.shape[-2]
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    out = torch.softmax(s, dim=-1) @ v
    return torch.autograd.grad(out, (q, k, v), g)


WRONG = {
    "softmax_jacobian": [
        ("forgot diag(s): returned -s s^T", jac_no_diag),
        ("diag(s) + s s^T (sign of the outer product)", jac_plus_outer),
        ("kept only the diagonal s_i (1 - s_i)", jac_diagonal_only),
        ("s s^T - diag(s) (overall sign flipped)", jac_sign_flipped),
        ("s @ s (a scalar) instead of the outer product", jac_dot_instead_of_outer),
        ("I - s s^T (identity instead of diag(s))", jac_identity),
        ("cast to float32 (dtype of s not kept)", jac_float32),
        ("autograd Jacobian of softmax taken at s, treating s as the logits", jac_of_s_as_logits),
        ("s[:, None] * (I - s[:, None]): broadcast along the wrong axis", jac_broadcast_wrong_axis),
        ("computed in NumPy and returned an ndarray", jac_numpy),
        ("computed in float16", jac_fp16),
        ("diag(s) - outer(s, 1 - s)", jac_one_minus_s_outer),
    ],
    "softmax_backward": [
        ("summed p * grad_p over the whole tensor, not per row", sb_sum_all),
        ("row sum without keepdim (broadcasts along the wrong axis)", sb_no_keepdim),
        ("forgot the sum: p*g - p*p*g (diagonal of the Jacobian only)", sb_no_sum),
        ("forgot the leading p", sb_no_leading_p),
        ("subtracted the row sum of grad_p instead of sum(p * grad_p)", sb_sum_of_g),
        ("summed over dim 0 instead of the last axis", sb_sum_dim0),
        ("sign flipped", sb_sign),
        ("p (1 - p) grad_p (diagonal Jacobian)", sb_diagonal_only),
        ("cast to float32 (dtype not kept)", sb_float32),
        ("mean over the row instead of the sum", sb_mean),
        ("row dot products via grad_p @ p^T summed over all rows", sb_matmul_all_pairs),
        ("divided the row sum by sum(p) and doubled it", sb_unnormalised_sum),
    ],
    "attention_backward": [
        ("forgot the 1/sqrt(d_k) factor in grad_q and grad_k", ab_no_scale),
        ("grad_k = dS @ q (no transpose of dS)", ab_dk_no_transpose),
        ("grad_v = P @ grad_out (no transpose of P)", ab_dv_no_transpose),
        ("dP = v @ grad_out^T (the transpose of dO V^T)", ab_dp_transposed),
        ("ignored causal when recomputing P", ab_ignores_causal),
        ("dS = P * dP (forgot to subtract the row sum)", ab_no_rowsum),
        ("row sum of P * dP over the query axis (dim -2)", ab_rowsum_over_queries),
        ("applied 1/sqrt(d_k) twice in grad_q and grad_k (1/d_k)", ab_scale_twice),
        ("causal mask tril(1): each query sees the next key", ab_mask_one_ahead),
        ("returned (grad_k, grad_q, grad_v)", ab_returns_k_first),
        ("k.transpose(1, 2): right for 3-D inputs, wrong with a head axis", ab_transpose_1_2),
        ("scaled by 1/sqrt(d_v) instead of 1/sqrt(d_k)", ab_scale_by_dv),
        ("used torch.autograd.grad inside the function", ab_autograd),
    ],
}
