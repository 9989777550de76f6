"""Notebook 04 (backward): helpers.nb04_backward checked against torch.autograd in float64, and the
checks of exercises 4.1-4.3: learner-style wrong implementations each check must reject with its
hint (WRONG) and correct ones in other styles than the reference it must accept (RIGHT)."""

import math

import pytest
import torch

from helpers.nb01_qkv_shapes import scaled_dot_product_attention
from helpers.nb03_masks import causal_mask, masked_softmax
from helpers.nb04_backward import attention_backward, softmax_backward, softmax_jacobian
from tests.exercise_cases import assert_accepted, assert_rejected, first_fast, right_cases, wrong_cases

# =============================================================== lesson: helpers.nb04_backward


def _gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("n", [1, 2, 5, 9])
def test_jacobian_matches_autograd(n):
    z = torch.randn(n, generator=_gen(n), dtype=torch.float64)
    J = softmax_jacobian(torch.softmax(z, -1))
    J_auto = torch.autograd.functional.jacobian(lambda x: torch.softmax(x, -1), z)
    torch.testing.assert_close(J, J_auto, atol=1e-14, rtol=0)


def test_jacobian_of_the_dimensions_appendix_example():
    """s = [0.7, 0.2, 0.1], the dimensions appendix's example (README, Sources), whose J notebook 04
    works out by hand: s_i (1 - s_i) on the diagonal, -s_i s_j off it."""
    J = softmax_jacobian(torch.tensor([0.7, 0.2, 0.1], dtype=torch.float64))
    by_hand = torch.tensor([[0.21, -0.14, -0.07], [-0.14, 0.16, -0.02], [-0.07, -0.02, 0.09]], dtype=torch.float64)
    torch.testing.assert_close(J, by_hand, atol=1e-15, rtol=0)


def test_jacobian_properties():
    s = torch.softmax(torch.randn(6, generator=_gen(1), dtype=torch.float64), -1)
    J = softmax_jacobian(s)
    torch.testing.assert_close(J, J.T)
    torch.testing.assert_close(J.sum(0), torch.zeros(6, dtype=torch.float64))
    torch.testing.assert_close(J.sum(1), torch.zeros(6, dtype=torch.float64))
    eig = torch.linalg.eigvalsh(J)
    assert eig.min() > -1e-15 and abs(eig[0]) < 1e-15 and eig[1] > 0  # PSD, rank n - 1
    # batched input gives one Jacobian per row
    S = torch.softmax(torch.randn(3, 4, generator=_gen(2)), -1)
    torch.testing.assert_close(softmax_jacobian(S)[1], softmax_jacobian(S[1]))


def test_jacobian_keeps_dtype():
    assert softmax_jacobian(torch.tensor([0.5, 0.5])).dtype == torch.float32


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4)])
def test_softmax_backward_matches_autograd_and_jacobian(shape):
    g = _gen(10)
    z = torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)
    grad_p = torch.randn(*shape, generator=g, dtype=torch.float64)
    p = torch.softmax(z, -1)
    (auto,) = torch.autograd.grad(p, z, grad_p)
    got = softmax_backward(p.detach(), grad_p)
    torch.testing.assert_close(got, auto)
    via_jacobian = (softmax_jacobian(p.detach()) @ grad_p.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(got, via_jacobian)
    torch.testing.assert_close(got.sum(-1), torch.zeros(shape[:-1], dtype=torch.float64))


def test_softmax_backward_is_zero_where_masked():
    T = 5
    allowed = causal_mask(T)
    p = masked_softmax(torch.randn(T, T, generator=_gen(3)), allowed)
    got = softmax_backward(p, torch.randn(T, T, generator=_gen(4)))
    assert torch.all(got[~allowed] == 0)


CASES = [((2, 3), 5, 4, 6, False), ((2,), 7, 3, 5, True), ((), 6, 8, 2, True), ((1, 2), 9, 4, 4, False)]


def _inputs(lead, T, d_k, d_v, seed=0, dtype=torch.float64):
    g = _gen(seed)
    return (
        torch.randn(*lead, T, d_k, generator=g, dtype=dtype),
        torch.randn(*lead, T, d_k, generator=g, dtype=dtype),
        torch.randn(*lead, T, d_v, generator=g, dtype=dtype),
        torch.randn(*lead, T, d_v, generator=g, dtype=dtype),
    )


@pytest.mark.parametrize("lead, T, d_k, d_v, causal", CASES)
def test_attention_backward_matches_autograd(lead, T, d_k, d_v, causal):
    q, k, v, dO = _inputs(lead, T, d_k, d_v)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = scaled_dot_product_attention(*leaves, causal_mask(T) if causal else None)
    auto = torch.autograd.grad(out, leaves, dO)
    for got, exp in zip(attention_backward(q, k, v, dO, causal), auto):
        assert got.shape == exp.shape
        torch.testing.assert_close(got, exp, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_backward_matches_torch_sdpa(causal):
    q, k, v, dO = _inputs((2, 3), 6, 4, 4, seed=5)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)
    auto = torch.autograd.grad(out, leaves, dO)
    for got, exp in zip(attention_backward(q, k, v, dO, causal), auto):
        torch.testing.assert_close(got, exp)


class _HandAttention(torch.autograd.Function):
    """Forward by helpers.nb01_qkv_shapes, backward by attention_backward: gradcheck tests the latter."""

    @staticmethod
    def forward(ctx, q, k, v, causal):
        ctx.save_for_backward(q, k, v)
        ctx.causal = causal
        return scaled_dot_product_attention(q, k, v, causal_mask(q.shape[-2]) if causal else None)

    @staticmethod
    def backward(ctx, grad_out):
        return (*attention_backward(*ctx.saved_tensors, grad_out, ctx.causal), None)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_backward_gradcheck(causal):
    q, k, v, _ = _inputs((2,), 4, 3, 5, seed=6)
    assert torch.autograd.gradcheck(_HandAttention.apply, (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), causal))


def test_attention_backward_float32_and_no_graph():
    q, k, v, dO = _inputs((2,), 5, 4, 3, dtype=torch.float32)
    grads = attention_backward(q, k, v, dO, True)
    assert all(g.dtype == torch.float32 and g.grad_fn is None for g in grads)


def test_causal_gradient_structure():
    # With a causal mask the last key is seen only by the last query, so grad_k[-1] depends on
    # grad_out[-1] alone, and the first query sees only key 0, so grad_q[0] = 0 (dS row 0 is 0).
    q, k, v, dO = _inputs((), 6, 3, 4, seed=7)
    dq, dk, dv = attention_backward(q, k, v, dO, causal=True)
    assert torch.all(dq[0] == 0)
    dO2 = dO.clone()
    dO2[:-1] = 0
    torch.testing.assert_close(attention_backward(q, k, v, dO2, causal=True)[1][-1], dk[-1])
    torch.testing.assert_close(dv[-1], dO[-1] * masked_softmax(q @ k.T / math.sqrt(3), causal_mask(6))[-1, -1])


# =============================================================== checks of 4.1-4.3


# --------------------------------------------------------------- wrong implementations


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


def jac_identity_minus_outer(s):
    return torch.eye(s.shape[0], dtype=s.dtype) - torch.outer(s, s)


def jac_missing_diagonal_term(s):
    return -torch.outer(s, s)


def jac_s_times_s_T(s):
    return torch.diag(s) - s * s.T  # .T does nothing to a 1-D tensor: s_j^2 in every row


def jac_diagonal_as_vector(s):
    return s * (1 - s)


def jac_one_minus_everywhere(s):
    return torch.outer(s, 1 - s)  # s_i (1 - s_j) for every entry


def jac_minus_s(s):
    return torch.diag(s) - s


def jac_s_i_squared_rows(s):
    n = s.numel()
    return torch.diag_embed(s) - (s ** 2).unsqueeze(1).repeat(1, n)  # s_i^2 across row i


def jac_minus_s_times_one_minus_s(s):
    return torch.diag(s) - s.unsqueeze(1) * (1 - s).unsqueeze(0)


def jac_identity_plus_half_outer(s):
    return torch.diag_embed(s) + torch.eye(len(s), dtype=s.dtype) - 0.5 * s[:, None] * s[None, :]


def jac_times_float32_ones(s):
    n = s.shape[0]
    return (torch.diag(s) - torch.outer(s, s)) * torch.ones(n, n)  # float32 ones: float16 s comes back float32


def jac_numpy_array(s):
    import numpy as np

    a = s.numpy()
    return np.diag(a) - a[:, None] * a[None, :]


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


def sb_rowsum_not_times_p(p, grad_p):
    return p * grad_p - (p * grad_p).sum(dim=-1, keepdim=True)


def sb_plain_mean(p, grad_p):
    return p * (grad_p - grad_p.mean(dim=-1, keepdim=True))


def sb_jacobian_diagonal_only(p, grad_p):
    return p * (1 - p) * grad_p


def sb_half_the_row_sum(p, grad_p):
    return p * (grad_p - 0.5 * torch.einsum("...i,...i->...", p, grad_p)[..., None])


def sb_log_softmax_rule(p, grad_p):
    return grad_p - p * torch.einsum("...i->...", grad_p)[..., None]


def sb_row_sum_from_another_row(p, grad_p):
    dots = (p * grad_p).sum(-1, keepdim=True)
    return p * (grad_p - dots.roll(1, dims=-2 if p.dim() > 1 else -1))  # each row gets its neighbour's sum


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


def _ds(p, grad_out, v):
    dp = grad_out @ v.transpose(-2, -1)
    return p * (dp - (p * dp).sum(-1, keepdim=True))


def ab_no_scale_on_dq(q, k, v, grad_out, causal):
    p = _forward(q, k, causal)
    ds = _ds(p, grad_out, v)
    return ds @ k, ds.transpose(-2, -1) @ q / math.sqrt(q.shape[-1]), p.transpose(-2, -1) @ grad_out


def ab_no_scale_on_dk(q, k, v, grad_out, causal):
    p = _forward(q, k, causal)
    ds = _ds(p, grad_out, v)
    return ds @ k / math.sqrt(q.shape[-1]), ds.transpose(-2, -1) @ q, p.transpose(-2, -1) @ grad_out


def ab_scale_by_sqrt_dv(q, k, v, grad_out, causal):
    p = _forward(q, k, causal)
    ds = _ds(p, grad_out, v) / math.sqrt(v.shape[-1])
    return ds @ k, ds.transpose(-2, -1) @ q, p.transpose(-2, -1) @ grad_out


def ab_mask_after_softmax(q, k, v, grad_out, causal):
    p = _forward(q, k, causal=False)
    if causal:
        T = q.shape[-2]
        p = p * torch.ones(T, T, dtype=p.dtype).tril()  # zeroed, but not renormalised
    ds = _ds(p, grad_out, v) / math.sqrt(q.shape[-1])
    return ds @ k, ds.transpose(-2, -1) @ q, p.transpose(-2, -1) @ grad_out


def ab_mask_fills_zero(q, k, v, grad_out, causal):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        T = q.shape[-2]
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), 0.0)
    p = torch.softmax(s, dim=-1)
    ds = _ds(p, grad_out, v) / math.sqrt(q.shape[-1])
    return ds @ k, ds.transpose(-2, -1) @ q, p.transpose(-2, -1) @ grad_out


def ab_unweighted_rowsum(q, k, v, grad_out, causal):
    p = _forward(q, k, causal)
    dp = grad_out @ v.transpose(-2, -1)
    ds = p * (dp - dp.sum(-1, keepdim=True)) / math.sqrt(q.shape[-1])
    return ds @ k, ds.transpose(-2, -1) @ q, p.transpose(-2, -1) @ grad_out


def ab_dv_from_unmasked_p(q, k, v, grad_out, causal):
    p = _forward(q, k, causal)
    ds = _ds(p, grad_out, v) / math.sqrt(q.shape[-1])
    return ds @ k, ds.transpose(-2, -1) @ q, _forward(q, k, False).transpose(-2, -1) @ grad_out


def ab_dp_transposed(q, k, v, grad_out, causal):
    p = _forward(q, k, causal)
    dp = (grad_out @ v.mT).mT
    ds = p * (dp - (p * dp).sum(-1, keepdim=True)) / math.sqrt(q.shape[-1])
    return ds @ k, ds.mT @ q, p.mT @ grad_out


def ab_scale_from_v_everywhere(q, k, v, grad_out, causal):
    c = v.shape[-1] ** -0.5
    s = q @ k.mT * c
    if causal:
        T = q.shape[-2]
        s = s.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
    p = s.softmax(-1)
    ds = _ds(p, grad_out, v) * c
    return ds @ k, ds.mT @ q, p.mT @ grad_out


def ab_scores_unscaled_grads_scaled(q, k, v, grad_out, causal):
    s = q @ k.mT
    if causal:
        T = q.shape[-2]
        s = s.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
    p = s.softmax(-1)
    ds = _ds(p, grad_out, v) / math.sqrt(q.shape[-1])
    return ds @ k, ds.mT @ q, p.mT @ grad_out


def _p_masked(q, k, causal, blocked):
    s = q @ k.mT / math.sqrt(q.shape[-1])
    if causal:
        T = q.shape[-2]
        s = s.masked_fill(blocked(T), float("-inf"))
    return s.softmax(-1)


def ab_delta_from_v(q, k, v, grad_out, causal):
    p = _p_masked(q, k, causal, lambda T: torch.ones(T, T, dtype=torch.bool).triu(1))
    ds = p * (grad_out @ v.mT - torch.einsum("...td,...td->...t", grad_out, v)[..., None]) / math.sqrt(q.shape[-1])
    return ds @ k, ds.mT @ q, p.mT @ grad_out


def ab_grad_k_with_k(q, k, v, grad_out, causal):
    p = _p_masked(q, k, causal, lambda T: torch.ones(T, T, dtype=torch.bool).triu(1))
    ds = _ds(p, grad_out, v) / math.sqrt(q.shape[-1])
    return ds @ k, ds.mT @ k, p.mT @ grad_out


def ab_mask_fills_allowed(q, k, v, grad_out, causal):
    p = _p_masked(q, k, causal, lambda T: torch.tril(torch.ones(T, T)).bool())  # the allowed positions
    ds = _ds(p, grad_out, v) / math.sqrt(q.shape[-1])
    return ds @ k, ds.mT @ q, p.mT @ grad_out


def ab_mask_ds_afterwards(q, k, v, grad_out, causal):
    p = _p_masked(q, k, False, None)
    ds = _ds(p, grad_out, v) / math.sqrt(q.shape[-1])
    if causal:
        T = q.shape[-2]
        ds = ds * torch.ones(T, T, dtype=ds.dtype).tril()
    return ds @ k, ds.mT @ q, p.mT @ grad_out


def ab_rowsum_mean(q, k, v, grad_out, causal):
    p = _p_masked(q, k, causal, lambda T: torch.ones(T, T, dtype=torch.bool).triu(1))
    dp = torch.einsum("...id,...jd->...ij", grad_out, v)
    ds = p * (dp - torch.mean(p * dp, dim=-1, keepdim=True)) / math.sqrt(q.shape[-1])
    return ds @ k, ds.mT @ q, p.mT @ grad_out


def ab_mask_one_ahead(q, k, v, grad_out, causal):
    s = q @ k.mT / math.sqrt(q.shape[-1])
    if causal:
        T = q.shape[-2]
        s = s.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 2), float("-inf"))
    p = s.softmax(-1)
    ds = _ds(p, grad_out, v) / math.sqrt(q.shape[-1])
    return ds @ k, ds.mT @ q, p.mT @ grad_out


WRONG = {
    "softmax_jacobian": [
        (jac_diagonal_only, "kept only the diagonal"),
        (jac_plus_outer, "wrong sign on the outer product"),
        (jac_flipped, "whole sign is flipped"),
        (jac_dot_not_outer, "not the outer product"),
        (jac_softmax_again, "do not apply softmax to it again"),
        (jac_loops_float64, "expected dtype torch.float32"),
        (jac_returns_list, "expected a torch.Tensor"),
        (jac_identity_minus_outer, "not the identity"),
        (jac_missing_diagonal_term, "you dropped diag(s)"),
        (jac_s_times_s_T, "s * s.T on a 1-D tensor"),
        (jac_diagonal_as_vector, "as a vector [n]"),
        (jac_one_minus_everywhere, "the 1 is delta_ij"),
        (jac_minus_s, "not s_j: diag(s) - s broadcasts"),
        (jac_s_i_squared_rows, "uses s_i twice"),
        (jac_minus_s_times_one_minus_s, "you subtracted s_i (1 - s_j)"),
        (jac_numpy_array, "returned a NumPy array"),
        (jac_identity_plus_half_outer, "your J is 1 diag(s) - 0.5 s s^T + 1 I"),
        (jac_times_float32_ones, "your J is float32, where the inputs' dtype, float16, is expected"),
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
        (sb_rowsum_not_times_p, "the subtracted row sum must be multiplied by p too"),
        (sb_plain_mean, "not on its plain mean"),
        (sb_jacobian_diagonal_only, "only the diagonal of the Jacobian"),
        (sb_half_the_row_sum, "your c is 0.5 times sum(p * grad_p)"),
        (sb_row_sum_from_another_row, "c is not sum(p * grad_p) over that row"),
        (sb_log_softmax_rule, "is the backward of log-softmax"),
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
        (ab_no_scale_on_dq, "sqrt(d_k) times too large"),
        (ab_no_scale_on_dk, "sqrt(d_k) times too large"),
        (ab_scale_by_sqrt_dv, "not 1/sqrt(d_v)"),
        (ab_mask_after_softmax, "you zeroed the future weights after the softmax"),
        (ab_mask_fills_zero, "the future scores were set to 0"),
        (ab_unweighted_rowsum, "the row sum in the softmax backward is weighted by P"),
        (ab_dv_from_unmasked_p, "recompute P with the causal mask"),
        (ab_dp_transposed, "yours is its transpose"),
        (ab_scale_from_v_everywhere, "P was computed from q k^T times 1/sqrt(d_v), and grad_q and grad_k were "
                                     "multiplied by 1/sqrt(d_v)"),
        (ab_scores_unscaled_grads_scaled, "P was computed from q k^T times 1 (no scale), and grad_q and grad_k "
                                          "carry the right factor"),
        (ab_mask_one_ahead, "lets query i see key i + 1 too"),
        (ab_delta_from_v, "yours is rowsum(grad_out * v)"),
        (ab_grad_k_with_k, "not with k itself"),
        (ab_mask_fills_allowed, "your mask hides the allowed keys"),
        (ab_mask_ds_afterwards, "only dS was masked afterwards"),
        (ab_rowsum_mean, "is a sum over the keys, not a mean"),
    ],
}


# --------------------------------------------------------------- right variants


# ----------------------------------------------------------------- 4.1 softmax_jacobian


def jacobian_diag_embed(s):
    return torch.diag_embed(s) - s[:, None] * s[None, :]


def jacobian_loops_float64(s):
    n = s.shape[0]
    J = torch.zeros(n, n, dtype=torch.float64)
    for i in range(n):
        for j in range(n):
            J[i, j] = float(s[i]) * ((i == j) - float(s[j]))
    return J.to(s.dtype)


def jacobian_autograd(s):
    # softmax(log s) = s: the Jacobian of softmax at logits log s, by autograd (allowed in 4.1).
    return torch.autograd.functional.jacobian(lambda z: torch.softmax(z, -1), s.log())


def jacobian_eye_in_dtype(s):
    """I * s (the identity in s's dtype) minus the outer product by broadcasting."""
    return torch.eye(len(s), dtype=s.dtype) * s - s.unsqueeze(-1) * s


def jacobian_symmetric_transposed(s):
    """s_j (delta_ij - s_i): the transpose of the formula, the same matrix (J is symmetric)."""
    return (torch.diag(s) - torch.outer(s, s)).T


# ----------------------------------------------------------------- 4.2 softmax_backward


def softmax_backward_einsum(p, grad_p):
    return p * (grad_p - torch.einsum("...i,...i->...", p, grad_p)[..., None])


def softmax_backward_float64(p, grad_p):
    p64, g64 = p.double(), grad_p.double()
    return (p64 * g64 - p64 * (p64 * g64).sum(-1, keepdim=True)).to(p.dtype)


def softmax_backward_row_loop(p, grad_p):
    """One row at a time: centre the row's gradient on its p-weighted mean (a dot product), weight by p."""
    rows, grads = p.reshape(-1, p.shape[-1]), grad_p.reshape(-1, p.shape[-1])
    out = torch.stack([r * (g - torch.dot(r, g)) for r, g in zip(rows, grads)])
    return out.reshape(p.shape)


# ----------------------------------------------------------------- 4.3 attention_backward


def attention_backward_einsum(q, k, v, grad_out, causal):
    scale = q.shape[-1] ** -0.5
    s = torch.einsum("...id,...jd->...ij", q, k) * scale
    if causal:
        T = q.shape[-2]
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -1e9)  # every row keeps its diagonal
    p = s.softmax(-1)
    dp = torch.einsum("...id,...jd->...ij", grad_out, v)
    ds = p * (dp - (p * dp).sum(-1, keepdim=True))
    return (torch.einsum("...ij,...jd->...id", ds, k) * scale, torch.einsum("...ij,...id->...jd", ds, q) * scale,
            torch.einsum("...ij,...id->...jd", p, grad_out))


def attention_backward_recomputes_p(q, k, v, grad_out, causal):
    """Computes P twice (once per use), with the course's own masked softmax helper: allowed."""
    from helpers.nb01_qkv_shapes import attention_weights
    from helpers.nb03_masks import causal_mask

    allowed = causal_mask(q.shape[-2]) if causal else None
    grad_v = attention_weights(q, k, allowed).mT @ grad_out
    p = attention_weights(q, k, allowed)
    dp = grad_out @ v.mT
    ds = p * (dp - (p * dp).sum(-1, keepdim=True)) / math.sqrt(q.shape[-1])
    return ds @ k, ds.mT @ q, grad_v


def attention_backward_delta_form(q, k, v, grad_out, causal):
    """FlashAttention's form: D = rowsum(dO * O) instead of rowsum(P * dP)."""
    s = q @ k.mT / math.sqrt(q.shape[-1])
    if causal:
        T = q.shape[-2]
        s = torch.where(torch.ones(T, T, dtype=torch.bool).tril(), s, torch.tensor(float("-inf"), dtype=s.dtype))
    p = torch.softmax(s, -1)
    o = p @ v
    ds = p * (grad_out @ v.mT - (grad_out * o).sum(-1, keepdim=True))
    return ds @ k / math.sqrt(q.shape[-1]), ds.mT @ q / math.sqrt(q.shape[-1]), p.mT @ grad_out


def attention_backward_per_head(q, k, v, grad_out, causal):
    """Flattened leading dims, one head at a time, with P recomputed from a log-sum-exp."""
    T, d_k = q.shape[-2:]
    flat = [x.reshape(-1, *x.shape[-2:]) for x in (q, k, v, grad_out)]
    grads = [torch.empty_like(x) for x in flat[:3]]
    for h in range(flat[0].shape[0]):
        qh, kh, vh, gh = (x[h] for x in flat)
        s = qh @ kh.T / math.sqrt(d_k)
        if causal:
            s = s + torch.full((T, T), float("-inf"), dtype=s.dtype).triu(1)
        p = torch.exp(s - torch.logsumexp(s, dim=-1, keepdim=True))
        dp = gh @ vh.T
        ds = p * (dp - (p * dp).sum(-1, keepdim=True))
        grads[0][h], grads[1][h], grads[2][h] = ds @ kh / math.sqrt(d_k), ds.T @ qh / math.sqrt(d_k), p.T @ gh
    return tuple(g.reshape(x.shape) for g, x in zip(grads, (q, k, v)))


RIGHT = {
    "softmax_jacobian": [jacobian_diag_embed, jacobian_loops_float64, jacobian_autograd, jacobian_symmetric_transposed,
                         jacobian_eye_in_dtype],
    "softmax_backward": [softmax_backward_einsum, softmax_backward_float64, softmax_backward_row_loop],
    "attention_backward": [attention_backward_einsum, attention_backward_recomputes_p, attention_backward_delta_form,
                           attention_backward_per_head],
}


# make test runs the first 10 wrong answers of each exercise (the commonest); make test-all all of them
@pytest.mark.parametrize(("name", "wrong", "hint"), first_fast(wrong_cases(WRONG), dict.fromkeys(WRONG, 10)))
def test_check_rejects_wrong(name, wrong, hint):
    assert_rejected(name, wrong, hint)


@pytest.mark.parametrize(("name", "right"), right_cases(RIGHT))
def test_check_accepts_right(name, right):
    assert_accepted(name, right)


def test_each_order_of_the_outer_product_of_s_and_1_minus_s_is_recorded_as_written():
    """4.1's mistake subtracted-s_i-times-1-minus-s_j has two members, diag(s) - torch.outer(s, 1 - s) and
    diag(s) - torch.outer(1 - s, s); the line a class report shows for each names the one the learner
    wrote (the second member's once named the first's)."""
    for outer, written in [(lambda s: torch.outer(s, 1 - s), "torch.outer(s, 1 - s)"),
                           (lambda s: torch.outer(1 - s, s), "torch.outer(1 - s, s)")]:
        error = assert_rejected("softmax_jacobian", lambda s, outer=outer: torch.diag(s) - outer(s), "you subtracted")
        assert error.mistake_id == "4.1/subtracted-s_i-times-1-minus-s_j"
        assert error.mistake == f"subtracted {written} instead of torch.outer(s, s)", error.mistake
