"""Properties of helpers.nb04_backward, checked against torch.autograd in float64."""

import math

import pytest
import torch

from helpers.nb01_qkv_shapes import scaled_dot_product_attention
from helpers.nb03_masks import causal_mask, masked_softmax
from helpers.nb04_backward import attention_backward, softmax_backward, softmax_jacobian


def _gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("n", [1, 2, 5, 9])
def test_jacobian_matches_autograd(n):
    z = torch.randn(n, generator=_gen(n), dtype=torch.float64)
    J = softmax_jacobian(torch.softmax(z, -1))
    J_auto = torch.autograd.functional.jacobian(lambda x: torch.softmax(x, -1), z)
    torch.testing.assert_close(J, J_auto, atol=1e-14, rtol=0)


def test_jacobian_seed_example():
    J = softmax_jacobian(torch.tensor([0.7, 0.2, 0.1], dtype=torch.float64))
    seed = torch.tensor([[0.21, -0.14, -0.07], [-0.14, 0.16, -0.02], [-0.07, -0.02, 0.09]], dtype=torch.float64)
    torch.testing.assert_close(J, seed, atol=1e-15, rtol=0)


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
