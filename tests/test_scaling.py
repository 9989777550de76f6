"""Properties of the reference code of notebook 02_scaling, and the leniency of its checks:
every correct way of writing an exercise passes, not only the reference's."""

import math

import pytest
import torch
import torch.nn.functional as F

from helpers import checks
from helpers import nb01_qkv_shapes as attention
from helpers import nb02_scaling as scaling
from helpers.checks import CheckFailed
from helpers.checks import nb02_scaling as scaling_checks
from tests.wrong import scaling as wrong


def test_all_lists_exactly_the_graded_functions():
    assert scaling.__all__ == ["scaled_scores", "attention_entropy", "dot_product_std"]
    assert scaling.scaled_scores is attention.scaled_scores  # one definition, re-exported


# ----------------------------------------------------------------------------- scaled_scores


def test_scaled_scores_give_torch_sdpa():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, T, d, generator=g) for T, d in [(5, 8), (7, 8), (7, 4)])
    out = torch.softmax(scaling.scaled_scores(q, k), dim=-1) @ v
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v))


def test_scaled_scores_have_unit_variance_for_unit_inputs():
    g = torch.Generator().manual_seed(1)
    for d_k in (4, 64, 1024):
        q, k = torch.randn(2000, d_k, generator=g), torch.randn(2000, d_k, generator=g)
        s = scaling.scaled_scores(q, k)  # [2000, 2000] scores, 4e6 (dependent) samples
        assert abs(s.var().item() - 1) < 0.05, d_k


@pytest.mark.parametrize("alt", [
    lambda q, k: torch.einsum("...id,...jd->...ij", q, k) / math.sqrt(q.shape[-1]),
    lambda q, k: torch.matmul(q, k.mT) * q.shape[-1] ** -0.5,
    lambda q, k: (q / math.sqrt(q.size(-1))) @ k.transpose(-1, -2),
])
def test_scaled_scores_check_accepts_equivalent_forms(alt):
    checks.scaled_scores(alt)


# ----------------------------------------------------------------------------- attention_entropy


def test_entropy_matches_torch_categorical():
    g = torch.Generator().manual_seed(2)
    p = torch.softmax(3 * torch.randn(4, 6, 9, generator=g, dtype=torch.float64), dim=-1)
    torch.testing.assert_close(scaling.attention_entropy(p), torch.distributions.Categorical(probs=p).entropy())


def test_entropy_extremes_and_zeros():
    T = 8
    uniform = torch.full((T,), 1 / T, dtype=torch.float64)
    one_hot = torch.zeros(T, dtype=torch.float64).index_fill(0, torch.tensor([3]), 1.0)
    assert math.isclose(scaling.attention_entropy(uniform).item(), math.log(T), rel_tol=1e-12)
    h0 = scaling.attention_entropy(one_hot)
    assert h0.item() == 0.0 and not math.copysign(1, h0.item()) < 0  # +0, not -0 or NaN
    causal = attention.attention_weights(torch.randn(5, 5, 4), torch.randn(5, 5, 4), attention.causal_mask(5))
    h = scaling.attention_entropy(causal)
    assert h.shape == (5, 5) and torch.isfinite(h).all() and h[:, 0].abs().max() == 0
    assert (h <= torch.log(torch.arange(1, 6, dtype=h.dtype)) + 1e-6).all()  # row i sees i + 1 keys


def test_entropy_keeps_dtype():
    for dtype in (torch.float32, torch.float64):
        assert scaling.attention_entropy(torch.full((3, 4), 0.25, dtype=dtype)).dtype == dtype


@pytest.mark.parametrize("alt", [
    lambda p: torch.distributions.Categorical(probs=p).entropy(),
    lambda p: -(p * torch.log(p.clamp_min(1e-30))).sum(-1),
    lambda p: -torch.where(p > 0, p * p.log(), torch.zeros_like(p)).sum(-1),
    lambda p: -(p * torch.log(p + 1e-12)).sum(-1),
])
def test_entropy_check_accepts_equivalent_forms(alt):
    checks.attention_entropy(alt)


# ----------------------------------------------------------------------------- dot_product_std


def test_dot_product_std_is_reproducible_and_leaves_the_global_rng_alone():
    state = torch.get_rng_state()
    a = scaling.dot_product_std(64, 5000, torch.Generator().manual_seed(7))
    b = scaling.dot_product_std(64, 5000, torch.Generator().manual_seed(7))
    c = scaling.dot_product_std(64, 5000, torch.Generator().manual_seed(8))
    assert isinstance(a, float) and a == b and a != c
    assert torch.equal(state, torch.get_rng_state())


@pytest.mark.parametrize("d_k", [4, 16, 64, 256, 1024])
def test_dot_product_std_is_close_to_sqrt_dk(d_k):
    n = 20_000
    got = scaling.dot_product_std(d_k, n, torch.Generator().manual_seed(d_k))
    assert abs(got / math.sqrt(d_k) - 1) < scaling_checks._rel_tol(d_k, n)


def test_standard_error_formula_of_the_check():
    """The check's tolerance rests on SE(std) ~ sqrt(d_k) * sqrt((1 + 3/d_k) / (2n)) (the excess
    kurtosis of q . k is 6 / d_k). Measure it."""
    g = torch.Generator().manual_seed(3)
    for d_k, n in [(4, 400), (36, 400)]:
        q = torch.randn(1500, n, d_k, generator=g, dtype=torch.float64)
        k = torch.randn(1500, n, d_k, generator=g, dtype=torch.float64)
        stds = (q * k).sum(-1).std(dim=-1)
        predicted = scaling_checks._rel_tol(d_k, n) / scaling_checks._N_SE * math.sqrt(d_k)
        assert abs(stds.std().item() / predicted - 1) < 0.08, (d_k, stds.std().item(), predicted)


def _layout_dn(d_k, n_samples, generator):
    q = torch.randn(d_k, n_samples, generator=generator)
    k = torch.randn(d_k, n_samples, generator=generator)
    return (q * k).sum(0).std().item()


def _one_draw(d_k, n_samples, generator):
    q, k = torch.randn(2, n_samples, d_k, generator=generator, dtype=torch.float64)
    return float(torch.einsum("nd,nd->n", q, k).std(unbiased=False))


def _k_first_normal(d_k, n_samples, generator):
    k = torch.normal(0.0, 1.0, size=(n_samples, d_k), generator=generator)
    q = torch.normal(0.0, 1.0, size=(n_samples, d_k), generator=generator)
    return math.sqrt(((q * k).sum(-1) ** 2).mean().item())  # E[q.k] = 0 is known: a valid estimator


def _python_loop(d_k, n_samples, generator):
    dots = []
    for _ in range(n_samples):
        q = torch.randn(d_k, generator=generator)
        k = torch.randn(d_k, generator=generator)
        dots.append(torch.dot(q, k).item())
    mean = sum(dots) / len(dots)
    return math.sqrt(sum((x - mean) ** 2 for x in dots) / (len(dots) - 1))


@pytest.mark.parametrize("alt", [_layout_dn, _one_draw, _k_first_normal, _python_loop])
def test_std_check_accepts_other_correct_implementations(alt):
    checks.dot_product_std(alt)


@pytest.mark.parametrize("skip", range(1, 13))
def test_std_check_accepts_other_draw_orders(skip):
    """A correct function that draws in another order sees other random numbers than the
    reference; the check must accept it anyway (12 different draws here)."""

    def shifted(d_k, n_samples, generator):
        torch.randn(skip, generator=generator)  # consume some numbers first
        q = torch.randn(n_samples, d_k, generator=generator)
        k = torch.randn(n_samples, d_k, generator=generator)
        return (q * k).sum(-1).std().item()

    checks.dot_product_std(shifted)


def test_std_check_restores_the_global_rng():
    torch.manual_seed(123)
    state = torch.get_rng_state()
    with pytest.raises(CheckFailed):
        checks.dot_product_std(wrong.std_reseeds_global)
    with pytest.raises(CheckFailed):
        checks.dot_product_std(wrong.std_global_rng)
    assert torch.equal(state, torch.get_rng_state())
