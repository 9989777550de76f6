"""Learner-style wrong implementations for exercises 4.1-4.3, with the hint each check must give."""

import math

import torch


# ----------------------------------------------------------------- 4.1 softmax_jacobian
def jac_diagonal_only(s):
    return torch.diag(s * (1 - s))


def jac_plus_outer(s):
    return torch.diag(s) + torch.outer(s, s)


def jac_flipped(s):
    return torch.outer(s, s) - torch.diag(s)


def jac_dot_not_outer(s):
    return torch.diag(s) - s @ s.T  # on a 1-D tensor this is a number


def jac_softmax_again(s):
    p = torch.softmax(s, dim=-1)
    return torch.diag(p) - torch.outer(p, p)


def jac_loops_float64(s):
    n = s.shape[0]
    J = torch.zeros(n, n, dtype=torch.float64)
    for i in range(n):
        for j in range(n):
            J[i, j] = s[i] * (float(i == j) - s[j])
    return J


def jac_returns_list(s):
    return (torch.diag(s) - torch.outer(s, s)).tolist()


# ----------------------------------------------------------------- 4.2 softmax_backward
def sb_no_subtraction(p, grad_p):
    return p * grad_p


def sb_sum_wrong_axis(p, grad_p):
    return p * (grad_p - (p * grad_p).sum(dim=0, keepdim=True))


def sb_sum_everything(p, grad_p):
    return p * (grad_p - (p * grad_p).sum())


def sb_no_keepdim(p, grad_p):
    return p * (grad_p - (p * grad_p).sum(dim=-1))


def sb_unweighted_sum(p, grad_p):
    return p * (grad_p - grad_p.sum(dim=-1, keepdim=True))


def sb_forgot_outer_p(p, grad_p):
    return grad_p - (p * grad_p).sum(dim=-1, keepdim=True)


def sb_in_place(p, grad_p):
    grad_p -= (p * grad_p).sum(dim=-1, keepdim=True)
    return p * grad_p


def sb_not_attempted(p, grad_p):
    raise NotImplementedError()


# ----------------------------------------------------------------- 4.3 attention_backward
def _forward(q, k, causal):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        T = q.shape[-2]
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(s, dim=-1)


def ab_no_scale(q, k, v, grad_out, causal):
    p = _forward(q, k, causal)
    dp = grad_out @ v.transpose(-2, -1)
    ds = p * (dp - (p * dp).sum(-1, keepdim=True))
    return ds @ k, ds.transpose(-2, -1) @ q, p.transpose(-2, -1) @ grad_out


def ab_dk_no_transpose(q, k, v, grad_out, causal):
    p = _forward(q, k, causal)
    dp = grad_out @ v.transpose(-2, -1)
    ds = p * (dp - (p * dp).sum(-1, keepdim=True)) / math.sqrt(q.shape[-1])
    return ds @ k, ds @ q, p.transpose(-2, -1) @ grad_out


def ab_dv_no_transpose(q, k, v, grad_out, causal):
    p = _forward(q, k, causal)
    dp = grad_out @ v.transpose(-2, -1)
    ds = p * (dp - (p * dp).sum(-1, keepdim=True)) / math.sqrt(q.shape[-1])
    return ds @ k, ds.transpose(-2, -1) @ q, p @ grad_out


def ab_dp_no_transpose(q, k, v, grad_out, causal):
    p = _forward(q, k, causal)
    dp = grad_out @ v  # [T, d_v] @ [T, d_v]: fails unless d_v == T
    ds = p * (dp - (p * dp).sum(-1, keepdim=True)) / math.sqrt(q.shape[-1])
    return ds @ k, ds.transpose(-2, -1) @ q, p.transpose(-2, -1) @ grad_out


def ab_dot_T(q, k, v, grad_out, causal):
    p = _forward(q, k, causal)
    dp = grad_out @ v.T  # .T reverses every axis of a batched tensor
    ds = p * (dp - (p * dp).sum(-1, keepdim=True)) / math.sqrt(q.shape[-1])
    return ds @ k, ds.T @ q, p.T @ grad_out


def ab_wrong_order(q, k, v, grad_out, causal):
    p = _forward(q, k, causal)
    dp = grad_out @ v.transpose(-2, -1)
    ds = p * (dp - (p * dp).sum(-1, keepdim=True)) / math.sqrt(q.shape[-1])
    return ds.transpose(-2, -1) @ q, ds @ k, p.transpose(-2, -1) @ grad_out  # (k, q, v)


def ab_v_first(q, k, v, grad_out, causal):
    p = _forward(q, k, causal)
    dp = grad_out @ v.transpose(-2, -1)
    ds = p * (dp - (p * dp).sum(-1, keepdim=True)) / math.sqrt(q.shape[-1])
    return p.transpose(-2, -1) @ grad_out, ds.transpose(-2, -1) @ q, ds @ k  # (v, k, q)


def ab_ignores_mask(q, k, v, grad_out, causal):
    p = _forward(q, k, causal=False)  # the mask is forgotten in the backward
    dp = grad_out @ v.transpose(-2, -1)
    ds = p * (dp - (p * dp).sum(-1, keepdim=True)) / math.sqrt(q.shape[-1])
    return ds @ k, ds.transpose(-2, -1) @ q, p.transpose(-2, -1) @ grad_out


def ab_no_subtraction(q, k, v, grad_out, causal):
    p = _forward(q, k, causal)
    ds = p * (grad_out @ v.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    return ds @ k, ds.transpose(-2, -1) @ q, p.transpose(-2, -1) @ grad_out


def ab_autograd(q, k, v, grad_out, causal):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    with torch.enable_grad():
        out = _forward(q, k, causal) @ v
        return torch.autograd.grad(out, (q, k, v), grad_out)


def ab_backward_call(q, k, v, grad_out, causal):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    (_forward(q, k, causal) @ v).backward(grad_out)
    return q.grad, k.grad, v.grad


def ab_torch_func(q, k, v, grad_out, causal):
    _, vjp = torch.func.vjp(lambda a, b, c: _forward(a, b, causal) @ c, q, k, v)
    return vjp(grad_out)


def _out(q, k, v, causal):
    return _forward(q, k, causal) @ v


def ab_finite_differences(q, k, v, grad_out, causal, eps=1e-6):
    """Central differences of <out, grad_out>, one input entry at a time: exact enough in float64."""
    grads = []
    for i, x in enumerate((q, k, v)):
        g = torch.zeros_like(x)
        for idx in range(x.numel()):
            hi, lo = [t.clone() for t in (q, k, v)], [t.clone() for t in (q, k, v)]
            hi[i].view(-1)[idx] += eps
            lo[i].view(-1)[idx] -= eps
            g.view(-1)[idx] = ((_out(*hi, causal) - _out(*lo, causal)) * grad_out).sum() / (2 * eps)
        grads.append(g)
    return tuple(grads)


def ab_forward_ad(q, k, v, grad_out, causal):
    import torch.autograd.forward_ad as fwAD

    grads = []
    for i, x in enumerate((q, k, v)):
        g = torch.zeros_like(x)
        for idx in range(x.numel()):
            tangent = torch.zeros_like(x)
            tangent.view(-1)[idx] = 1.0
            with fwAD.dual_level():
                inputs = [q, k, v]
                inputs[i] = fwAD.make_dual(x, tangent)
                g.view(-1)[idx] = (fwAD.unpack_dual(_out(*inputs, causal)).tangent * grad_out).sum()
        grads.append(g)
    return tuple(grads)


def ab_jacfwd(q, k, v, grad_out, causal):
    jac = torch.func.jacfwd(lambda a, b, c: _out(a, b, c, causal), argnums=(0, 1, 2))(q, k, v)
    dims = grad_out.ndim
    return tuple(torch.tensordot(grad_out, j, dims=dims) for j in jac)


def ab_jvp_per_entry(q, k, v, grad_out, causal):
    grads = []
    for i, x in enumerate((q, k, v)):
        g = torch.zeros_like(x)
        for idx in range(x.numel()):
            tangents = [torch.zeros_like(t) for t in (q, k, v)]
            tangents[i].view(-1)[idx] = 1.0
            _, dout = torch.func.jvp(lambda a, b, c: _out(a, b, c, causal), (q, k, v), tuple(tangents))
            g.view(-1)[idx] = (dout * grad_out).sum()
        grads.append(g)
    return tuple(grads)


def ab_float32(q, k, v, grad_out, causal):
    q, k, v, grad_out = (x.float() for x in (q, k, v, grad_out))
    p = _forward(q, k, causal)
    dp = grad_out @ v.transpose(-2, -1)
    ds = p * (dp - (p * dp).sum(-1, keepdim=True)) / math.sqrt(q.shape[-1])
    return ds @ k, ds.transpose(-2, -1) @ q, p.transpose(-2, -1) @ grad_out


def ab_returns_two(q, k, v, grad_out, causal):
    p = _forward(q, k, causal)
    dp = grad_out @ v.transpose(-2, -1)
    ds = p * (dp - (p * dp).sum(-1, keepdim=True)) / math.sqrt(q.shape[-1])
    return ds @ k, ds.transpose(-2, -1) @ q


WRONG = {
    "softmax_jacobian": [
        (jac_diagonal_only, "kept only the diagonal"),
        (jac_plus_outer, "wrong sign on the outer product"),
        (jac_flipped, "whole sign is flipped"),
        (jac_dot_not_outer, "not the outer product"),
        (jac_softmax_again, "do not apply softmax to it again"),
        (jac_loops_float64, "expected dtype torch.float32"),
        (jac_returns_list, "expected a torch.Tensor"),
    ],
    "softmax_backward": [
        (sb_no_subtraction, "dropped the subtraction"),
        (sb_sum_wrong_axis, "summed over the wrong axis"),
        (sb_sum_everything, "summed over every entry"),
        (sb_no_keepdim, "keepdim=True"),
        (sb_unweighted_sum, "weighted by p"),
        (sb_forgot_outer_p, "multiply by p"),
        (sb_in_place, "modified one of its input tensors in place"),
        (sb_not_attempted, "not attempted yet"),
    ],
    "attention_backward": [
        (ab_no_scale, "sqrt(d_k) times too large"),
        (ab_dk_no_transpose, "grad_k = dS^T @ q"),
        (ab_dv_no_transpose, "grad_v = P^T @ grad_out"),
        (ab_dp_no_transpose, "dP = grad_out @ v^T"),
        (ab_dot_T, ".T reverses every axis"),
        (ab_wrong_order, "wrong order"),
        (ab_v_first, "wrong order"),
        (ab_ignores_mask, "recompute P with the causal mask"),
        (ab_no_subtraction, "lost its subtraction"),
        (ab_autograd, "by hand"),
        (ab_backward_call, "by hand"),
        (ab_torch_func, "by hand"),
        (ab_float32, "expected dtype torch.float64"),
        (ab_finite_differences, "finite differences"),
        (ab_forward_ad, "used automatic differentiation (torch.autograd"),
        (ab_jacfwd, "used automatic differentiation (torch.func.jacfwd)"),
        (ab_jvp_per_entry, "used automatic differentiation (torch.func.jvp)"),
        (ab_returns_two, "expected a tuple of 3"),
    ],
}
