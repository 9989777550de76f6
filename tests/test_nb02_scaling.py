"""Notebook 02 (scaling): the lesson code of helpers.nb02_scaling (scaled scores, attention entropy,
the spread of q . k) and the checks of exercises 2.1-2.3: learner-style wrong implementations each
check must reject with its hint (WRONG), correct ones in other styles than the reference it must
accept (RIGHT), the statistics behind check 2.3's tolerance and sample-count test, and its leniency
to other draw orders."""

import math
import time
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers import checks
from helpers import nb01_qkv_shapes as attention
from helpers import nb02_scaling as scaling
from helpers.checks import CheckFailed
from helpers.checks import nb02_scaling as scaling_checks
from tests.exercise_cases import assert_accepted, assert_rejected, first_fast, right_cases, wrong_cases

# =============================================================== lesson: helpers.nb02_scaling


def test_scaled_scores_is_one_definition_re_exported():
    assert scaling.scaled_scores is attention.scaled_scores


# ----------------------------------------------------------------- scaled_scores


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


# ----------------------------------------------------------------- attention_entropy


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


# ----------------------------------------------------------------- dot_product_std


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


# =============================================================== checks of 2.1-2.3


def _message(check, fn) -> str:
    with pytest.raises(CheckFailed) as info:
        check(fn)
    return str(info.value)


def test_std_nan_and_int_results_are_named_as_such():
    message = _message(checks.dot_product_std, std_returns_nan)
    assert "different results" not in message and "returned nan" in message
    message = _message(checks.dot_product_std, std_returns_int)
    assert "reseed" not in message and "returned int" in message


# make test draws in three other orders, make test-all in all twelve.
@pytest.mark.parametrize("skip", [*range(1, 4), *(pytest.param(s, marks=pytest.mark.slow) for s in range(4, 13))])
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
        checks.dot_product_std(std_reseeds_global)
    with pytest.raises(CheckFailed):
        checks.dot_product_std(std_global_rng)
    assert torch.equal(state, torch.get_rng_state())


# ----------------------------------------------------------------- 2.3: statistics of the tolerances


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


def _simulated_ratios(n_learners: int, n_samples: int, seed: int) -> np.ndarray:
    """C / C0 of check 2.3's spread test for simulated learners that draw n_samples pairs per call
    (q . k of iid N(0, 1) vectors is (U - V) / 2 with U, V independent chi-square(d_k))."""
    d, seeds = scaling_checks._SPREAD_D, len(scaling_checks._SPREAD_SEEDS)
    rng = np.random.default_rng(seed)
    x = (rng.chisquare(d, (n_learners, seeds, n_samples)) - rng.chisquare(d, (n_learners, seeds, n_samples))) / 2
    y = x.var(axis=-1, ddof=1)
    c = y.var(axis=-1, ddof=1) / y.mean(axis=-1) ** 2
    return c / scaling_checks._cv2(scaling_checks._SPREAD_N, d)


def test_spread_statistic_formula_and_band():
    """Var(s^2) / E[s^2]^2 = 2 / (n - 1) + 6 / (d_k n) for q . k; a correct learner stays well inside
    the band, and 2 * n_samples or n_samples / 2 pairs fall well outside it."""
    n = scaling_checks._SPREAD_N
    lo, hi = scaling_checks._SPREAD_BAND
    right = _simulated_ratios(300, n, seed=0)
    assert abs(right.mean() - 1) < 0.01
    assert abs(np.log(right).std() - 0.054) < 0.01  # the sd the band's false-rejection figure uses
    assert lo < 0.85 * right.min() and right.max() * 1.15 < hi
    assert _simulated_ratios(100, 2 * n, seed=1).max() < 0.85 * lo
    assert _simulated_ratios(100, n // 2, seed=2).min() > 1.15 * hi


def test_pairs_for_inverts_the_formula():
    for n in (3, 10, 57, 400):
        assert math.isclose(scaling_checks._pairs_for(scaling_checks._cv2(n, 16), 16), n, rel_tol=1e-9)


# --------------------------------------------------------------- wrong implementations


# ----------------------------------------------------------------- 2.1 scaled_scores


def scores_no_scale(q, k):
    return q @ k.transpose(-2, -1)


def scores_scale_by_dk(q, k):
    return q @ k.transpose(-2, -1) / q.shape[-1]


def scores_scale_by_sqrt_T(q, k):
    d_k = q.size(-2)  # thinks q is [..., d_k, T]
    return q @ k.transpose(-2, -1) / math.sqrt(d_k)


def scores_scale_by_sqrt_Tk(q, k):
    return q @ k.transpose(-2, -1) / math.sqrt(k.shape[-2])


def scores_multiply(q, k):
    return q @ k.transpose(-2, -1) * math.sqrt(q.shape[-1])


def scores_k_at_q(q, k):
    return k @ q.transpose(-2, -1) / math.sqrt(q.shape[-1])


def scores_dot_T(q, k):
    with warnings.catch_warnings():  # torch warns that .T on a batched tensor is deprecated
        warnings.simplefilter("ignore", UserWarning)
        return q @ k.T / math.sqrt(q.shape[-1])  # .T reverses every axis of a batched tensor


def scores_loop_float32(q, k):
    # Fills a fresh tensor: torch.empty defaults to float32, whatever q's dtype.
    flat_q = q.reshape(-1, *q.shape[-2:])
    flat_k = k.reshape(-1, *k.shape[-2:])
    out = torch.empty(flat_q.shape[0], q.shape[-2], k.shape[-2])
    for b in range(flat_q.shape[0]):
        for i in range(q.shape[-2]):
            for j in range(k.shape[-2]):
                out[b, i, j] = (flat_q[b, i] * flat_k[b, j]).sum() / math.sqrt(q.shape[-1])
    return out.reshape(*q.shape[:-1], k.shape[-2])


def scores_in_place(q, k):
    q /= math.sqrt(q.shape[-1])
    return q @ k.transpose(-2, -1)


def scores_dk_pow_minus2(q, k):
    return q @ k.transpose(-2, -1) * q.shape[-1] ** -2


def scores_multiply_by_dk(q, k):
    return q @ k.transpose(-2, -1) * q.shape[-1]


def scores_power_precedence(q, k):
    return q @ k.transpose(-2, -1) * q.shape[-1] ** -1/2  # (d_k ** -1) / 2


def scores_power_precedence_in_parentheses(q, k):
    return q @ k.transpose(-2, -1) / (q.shape[-1] ** 1/2)  # d_k / 2

def scores_isqrt(q, k):
    return torch.matmul(q, k.mT) / math.isqrt(q.size(-1))  # floors sqrt(d_k) when d_k is not a square


def scores_round_sqrt(q, k):
    return q @ k.transpose(-2, -1) / round(q.shape[-1] ** 0.5)


def scores_bfloat16(q, k):
    s = torch.einsum("...id,...jd->...ij", q.bfloat16(), k.bfloat16())
    return s.to(q.dtype) / math.sqrt(q.shape[-1])


def scores_head_axis_as_d_k(q, k):
    return q @ k.transpose(-2, -1) / math.sqrt(q.size(1))  # axis 1, a head axis in the 4-D case


def scores_d_model(q, k):
    width = q.shape[-1] * (q.shape[-3] if q.dim() > 3 else 1)  # H * d_k
    return q @ k.transpose(-2, -1) * width ** -0.5


def scores_sqrt_dk_plus_one(q, k):
    return q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1] + 1)


# ----------------------------------------------------------------- 2.2 attention_entropy


def entropy_nan(p):
    return -(p * torch.log(p)).sum(dim=-1)


def entropy_bits(p):
    return -torch.special.xlogy(p, p).sum(dim=-1) / math.log(2)


def entropy_log2_nan_safe(p):
    logp = torch.where(p > 0, torch.log2(p), torch.zeros_like(p))
    return -(p * logp).sum(dim=-1)


def entropy_no_minus(p):
    return torch.special.xlogy(p, p).sum(dim=-1)


def entropy_wrong_axis(p):
    return -torch.special.xlogy(p, p).sum(dim=0)


def entropy_wrong_axis_square(p):
    # Passes the shape of the dense case only by accident of squareness: sums down the columns.
    if p.shape[-1] == p.shape[-2]:
        return -torch.special.xlogy(p, p).sum(dim=-2)
    return -torch.special.xlogy(p, p).sum(dim=-1)


def entropy_keepdim(p):
    return -torch.special.xlogy(p, p).sum(dim=-1, keepdim=True)


def entropy_mean(p):
    return -torch.special.xlogy(p, p).mean(dim=-1)


def entropy_normalised(p):
    return -torch.special.xlogy(p, p).sum(dim=-1) / math.log(p.shape[-1])


def entropy_python_floats(p):
    rows = p.reshape(-1, p.shape[-1])
    values = [-sum(x * math.log(x) for x in row.tolist() if x > 0) for row in rows]
    return torch.tensor(values).reshape(p.shape[:-1])  # torch.tensor of floats: float32


def entropy_clamp_in_place(p):
    p.clamp_(min=1e-12)
    return -(p * p.log()).sum(dim=-1)


def entropy_clamp(p):
    return -(p * p.clamp(min=1e-3).log()).sum(dim=-1)  # "avoids log(0)", changes every p < 1e-3


def entropy_eps_in_log(p):
    return -(p * torch.log(p + 1e-6)).sum(dim=-1)


# ----------------------------------------------------------------- 2.3 dot_product_std


def std_returns_variance(d_k, n_samples, generator):
    q = torch.randn(n_samples, d_k, generator=generator)
    k = torch.randn(n_samples, d_k, generator=generator)
    return (q * k).sum(-1).var().item()


def std_sqrt_of_std(d_k, n_samples, generator):
    q = torch.randn(n_samples, d_k, generator=generator)
    k = torch.randn(n_samples, d_k, generator=generator)
    return math.sqrt((q * k).sum(-1).std().item())


def std_of_products(d_k, n_samples, generator):
    q = torch.randn(n_samples, d_k, generator=generator)
    k = torch.randn(n_samples, d_k, generator=generator)
    return (q * k).std().item()


def std_of_mean(d_k, n_samples, generator):
    q = torch.randn(n_samples, d_k, generator=generator)
    k = torch.randn(n_samples, d_k, generator=generator)
    return (q * k).mean(-1).std().item()


def std_sum_over_samples(d_k, n_samples, generator):
    q = torch.randn(n_samples, d_k, generator=generator)
    k = torch.randn(n_samples, d_k, generator=generator)
    return (q * k).sum(0).std().item()


def std_q_dot_q(d_k, n_samples, generator):
    q = torch.randn(n_samples, d_k, generator=generator)
    return (q * q).sum(-1).std().item()


def std_uniform(d_k, n_samples, generator):
    q = torch.rand(n_samples, d_k, generator=generator)
    k = torch.rand(n_samples, d_k, generator=generator)
    return (q * k).sum(-1).std().item()


def std_uniform_symmetric(d_k, n_samples, generator):
    q = 2 * torch.rand(n_samples, d_k, generator=generator) - 1
    k = 2 * torch.rand(n_samples, d_k, generator=generator) - 1
    return (q * k).sum(-1).std().item()


def std_global_rng(d_k, n_samples, generator):
    q = torch.randn(n_samples, d_k)
    k = torch.randn(n_samples, d_k)
    return (q * k).sum(-1).std().item()


def std_partly_global(d_k, n_samples, generator):
    q = torch.randn(n_samples, d_k, generator=generator)
    k = torch.randn(n_samples, d_k)
    return (q * k).sum(-1).std().item()


def std_reseeds_global(d_k, n_samples, generator):
    torch.manual_seed(generator.initial_seed())
    q = torch.randn(n_samples, d_k)
    k = torch.randn(n_samples, d_k)
    return (q * k).sum(-1).std().item()


def std_own_generator(d_k, n_samples, generator):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(n_samples, d_k, generator=g)
    k = torch.randn(n_samples, d_k, generator=g)
    return (q * k).sum(-1).std().item()


def std_numpy(d_k, n_samples, generator):
    q = np.random.randn(n_samples, d_k)
    k = np.random.randn(n_samples, d_k)
    return float((q * k).sum(-1).std())


def std_reseeds_given_generator(d_k, n_samples, generator):
    generator.manual_seed(0)
    q = torch.randn(n_samples, d_k, generator=generator)
    k = torch.randn(n_samples, d_k, generator=generator)
    return (q * k).sum(-1).std().item()


def std_theoretical(d_k, n_samples, generator):
    return math.sqrt(d_k)


def std_fixed_sample_count(d_k, n_samples, generator):
    q = torch.randn(100, d_k, generator=generator)
    k = torch.randn(100, d_k, generator=generator)
    return (q * k).sum(-1).std().item()


def std_too_few_samples(d_k, n_samples, generator):
    half = n_samples // 4  # "a quarter is plenty"
    q = torch.randn(half, d_k, generator=generator)
    k = torch.randn(half, d_k, generator=generator)
    return (q * k).sum(-1).std().item()


def std_all_pairs(d_k, n_samples, generator):
    n = min(n_samples, 2000)  # q @ k.T of all pairs; capped so the test stays small
    q = torch.randn(n, d_k, generator=generator)
    k = torch.randn(n, d_k, generator=generator)
    return (q @ k.T).std().item()


def std_twice_the_samples(d_k, n_samples, generator):
    q = torch.randn(2 * n_samples, d_k, generator=generator)  # "more samples, better estimate"
    k = torch.randn(2 * n_samples, d_k, generator=generator)
    return (q * k).sum(-1).std().item()


def std_half_the_samples(d_k, n_samples, generator):
    q = torch.randn(n_samples // 2, d_k, generator=generator)
    k = torch.randn(n_samples // 2, d_k, generator=generator)
    return (q * k).sum(-1).std().item()


def std_of_scaled_scores(d_k, n_samples, generator):
    q = torch.randn(n_samples, d_k, generator=generator)
    k = torch.randn(n_samples, d_k, generator=generator)
    return torch.einsum("nd,nd->n", q, k).div(d_k ** 0.5).std().item()  # the scaled score's std


def std_entries_scaled(d_k, n_samples, generator):
    q = torch.randn(n_samples, d_k, generator=generator) * d_k ** -0.5  # "initialised" entries
    k = torch.randn(n_samples, d_k, generator=generator) * d_k ** -0.5
    return torch.linalg.vecdot(q, k).std().item()


def std_mean_abs(d_k, n_samples, generator):
    q, k = torch.randn(2, n_samples, d_k, generator=generator)
    return float(torch.mean(torch.abs((q * k).sum(1))))


def std_standard_error(d_k, n_samples, generator):
    q = torch.randn(n_samples, d_k, generator=generator)
    k = torch.randn(n_samples, d_k, generator=generator)
    dots = (q * k).sum(-1)
    return (dots.std() / math.sqrt(n_samples)).item()


def std_returns_mean(d_k, n_samples, generator):
    q = torch.randn(n_samples, d_k, generator=generator)
    k = torch.randn(n_samples, d_k, generator=generator)
    return torch.einsum("nd,nd->n", q, k).mean().item()  # the mean, not the std


def std_returns_nan(d_k, n_samples, generator):
    q = torch.randn(n_samples, d_k, generator=generator)
    k = torch.randn(n_samples, d_k, generator=generator)
    return (q * k).sum().std().item()  # the std of one number: NaN


def std_returns_int(d_k, n_samples, generator):
    q = torch.randn(n_samples, d_k, generator=generator)
    k = torch.randn(n_samples, d_k, generator=generator)
    return round((q * k).sum(-1).std().item())


def std_returns_tensor(d_k, n_samples, generator):
    q = torch.randn(n_samples, d_k, generator=generator)
    k = torch.randn(n_samples, d_k, generator=generator)
    return (q * k).sum(-1).std()


def entropy_as_perplexity(p):
    return torch.exp(-(torch.special.xlogy(p, p)).sum(-1))  # exp(H): the "effective number of keys"


def entropy_perplexity_where(p):
    h = -torch.where(p > 0, p * torch.log(p), torch.zeros_like(p)).sum(dim=-1)
    return h.exp()


def entropy_log2_entr(p):
    return torch.special.entr(p).sum(-1) / math.log(2)  # bits


def entropy_sum_dim_minus2(p):
    return torch.special.entr(p).sum(dim=-2)


def entropy_sum_everything(p):
    return torch.special.entr(p).sum()


def entropy_mean_over_rows(p):
    return torch.distributions.Categorical(probs=p).entropy().mean()  # one number for the whole batch


def entropy_of_logits(p):
    return torch.distributions.Categorical(logits=p).entropy()  # p taken for logits


def scores_inner(q, k):
    """torch.inner pairs every row of q with every row of k, across the leading axes too."""
    return torch.inner(q, k) / math.sqrt(q.shape[-1])


def scores_matching_pairs(q, k):
    """Only the (i, i) query-key pairs: q and k multiplied entry by entry, which fails when T_q != T_k."""
    return torch.mul(q, k).sum(dim=-1, keepdim=True) * q.shape[-1] ** -0.5


def entropy_collision(p):
    return -torch.log(torch.einsum("...i,...i->...", p, p))


def entropy_unweighted_log(p):
    return -torch.log(p).sum(-1) / p.shape[-1]


def entropy_eps_both_factors(p):
    q = p + 1e-5
    return -(q * torch.log(q)).sum(-1)


def std_reseeds_from_the_clock(d_k, n_samples, generator):
    generator.manual_seed(time.time_ns())  # a new seed at every call
    q = torch.randn(n_samples, d_k, generator=generator)
    k = torch.randn(n_samples, d_k, generator=generator)
    return float(torch.einsum("nd,nd->n", q, k).std())


WRONG = {
    "scaled_scores": [
        (scores_no_scale, "did not divide by sqrt(d_k)"),
        (scores_scale_by_dk, "you divided by d_k"),
        (scores_scale_by_sqrt_T, "divided by sqrt(T_q)"),
        (scores_scale_by_sqrt_Tk, "divided by sqrt(T)"),
        (scores_multiply, "multiplied by sqrt(d_k)"),
        (scores_k_at_q, "not k @ q^T"),
        (scores_dot_T, "two tensors were combined whose shapes do not fit"),
        (scores_loop_float32, "expected dtype torch.float64"),
        (scores_in_place, "modified one of its input tensors in place"),
        (scores_dk_pow_minus2, "you scaled by d_k ** -2"),
        (scores_multiply_by_dk, "you multiplied by d_k"),
        (scores_power_precedence, "** binds tighter than /, so you divided by 2 d_k"),
        (scores_power_precedence_in_parentheses, "so you divided by d_k / 2"),
        (scores_isqrt, "you rounded sqrt(d_k) down to a whole number"),
        (scores_round_sqrt, "you rounded sqrt(d_k) to the nearest whole number"),
        (scores_bfloat16, "ran in a lower precision"),
        (scores_head_axis_as_d_k, "square root of q.shape[1], a leading (batch or head) axis"),
        (scores_d_model, "you divided by sqrt(d_model)"),
        (scores_sqrt_dk_plus_one, "your scores are q @ k^T divided by 2.236, for every entry; the divisor is sqrt(d_k) = 2"),
        (scores_inner, "your scores pair every query with every key of every batch element and head"),
        (scores_matching_pairs, "two tensors were combined whose shapes do not fit"),
    ],
    "attention_entropy": [
        (entropy_as_perplexity, "perplexity"),
        (entropy_nan, "0·log 0 gave NaN"),
        (entropy_bits, "log base 2"),
        (entropy_log2_nan_safe, "nats"),
        (entropy_no_minus, "forgot the minus sign"),
        (entropy_wrong_axis, "the last axis"),
        (entropy_wrong_axis_square, "the last axis"),
        (entropy_keepdim, "without keepdim"),
        (entropy_mean, "averaged over the keys"),
        (entropy_normalised, "normalised entropy"),
        (entropy_python_floats, "expected dtype torch.float64"),
        (entropy_clamp_in_place, "modified one of its input tensors in place"),
        (entropy_clamp, "you clamped p at 0.001 before the log"),
        (entropy_eps_in_log, "you added 1e-06 inside the log"),
        (entropy_perplexity_where, "perplexity"),
        (entropy_log2_entr, "log base 2"),
        (entropy_sum_dim_minus2, "sum over dim=-1, not dim=2"),
        (entropy_sum_everything, "you summed over every entry"),
        (entropy_of_logits, "you treated p as logits"),
        (entropy_mean_over_rows, "you averaged the rows' entropies into one number"),
        (entropy_collision, "the collision (Renyi-2) entropy"),
        (entropy_unweighted_log, "your result is -mean(log p) over each row"),
        (entropy_eps_both_factors, "q = p + 1e-05: p changed in both factors"),
    ],
    "dot_product_std": [
        (std_returns_variance, "the variance of q·k"),
        (std_sqrt_of_std, "square root too many"),
        (std_of_products, "a single product q_i * k_i"),
        (std_of_mean, "averaging q_i * k_i over the features"),
        (std_sum_over_samples, "summed over the samples axis"),
        (std_q_dot_q, "independent draws"),
        (std_uniform, "not torch.rand"),
        (std_uniform_symmetric, "variance 1/3"),
        (std_global_rng, "without generator="),
        (std_partly_global, "without generator="),
        (std_reseeds_global, "torch.manual_seed"),
        (std_own_generator, "never drew from the generator"),
        (std_numpy, "never drew from the generator"),
        (std_reseeds_given_generator, "your function reseeds the generator it is given"),
        (std_theoretical, "theoretical value"),
        (std_fixed_sample_count, "exactly n_samples"),
        (std_too_few_samples, "exactly n_samples"),
        (std_all_pairs, "n_samples**2 pairs"),
        (std_returns_tensor, "return `.item()`"),
        (std_twice_the_samples, "not 2 * n_samples"),
        (std_half_the_samples, "use all of them"),
        (std_returns_nan, "returned nan, not a finite number"),
        (std_returns_int, "returned int 32"),
        (std_of_scaled_scores, "sqrt(d_k) times smaller than the std of q·k"),
        (std_entries_scaled, "d_k times smaller than the std of q·k"),
        (std_mean_abs, "the mean of |q·k|"),
        (std_standard_error, "standard error"),
        (std_returns_mean, "a standard deviation is never negative"),
        (std_reseeds_from_the_clock, "reseeds the generator it is given, with a new seed at every call"),
    ],
}


# --------------------------------------------------------------- right variants


# ----------------------------------------------------------------- 2.1 scaled_scores


def scores_float64(q, k):
    return (q.double() @ k.double().transpose(-2, -1) / math.sqrt(q.shape[-1])).to(q.dtype)


def scores_einsum(q, k):
    return torch.einsum("...id,...jd->...ij", q, k) / math.sqrt(q.shape[-1])


def scores_matmul_rsqrt(q, k):
    return torch.matmul(q, k.mT) * q.shape[-1] ** -0.5


def scores_prescaled_q(q, k):
    return (q / math.sqrt(q.size(-1))) @ k.transpose(-1, -2)


def scores_flatten_bmm(q, k):
    """Leading dims flattened into one batch axis for torch.bmm, then restored."""
    qb, kb = q.reshape(-1, *q.shape[-2:]), k.reshape(-1, *k.shape[-2:])
    return torch.bmm(qb, kb.transpose(1, 2)).div(q.shape[-1] ** 0.5).reshape(*q.shape[:-1], k.shape[-2])

# ----------------------------------------------------------------- 2.2 attention_entropy


def entropy_nan_to_num(p):
    return torch.nan_to_num(-(p * p.log())).sum(-1)


def entropy_log2_nansum(p):
    return -(p * torch.log2(p)).nansum(-1) * math.log(2)


def entropy_float64(p):
    return torch.special.entr(p.double()).sum(-1).to(p.dtype)


def entropy_numpy(p):
    a = p.numpy()
    return torch.from_numpy(-np.where(a > 0, a * np.log(np.where(a > 0, a, 1.0)), 0.0).sum(-1))


def entropy_finfo_tiny(p):
    return -(p * p.clamp_min(torch.finfo(p.dtype).tiny).log()).sum(-1)


def entropy_categorical(p):
    return torch.distributions.Categorical(probs=p).entropy()


def entropy_clamp_min_1e30(p):
    return -(p * torch.log(p.clamp_min(1e-30))).sum(-1)


def entropy_where(p):
    return -torch.where(p > 0, p * p.log(), torch.zeros_like(p)).sum(-1)


def entropy_eps_1e12(p):
    return -(p * torch.log(p + 1e-12)).sum(-1)


def entropy_row_loop(p):
    """One row at a time, the zero weights left out of the log."""
    rows = p.reshape(-1, p.shape[-1])
    out = torch.empty(rows.shape[0], dtype=p.dtype)
    for i, row in enumerate(rows):
        nz = row[row > 0]
        out[i] = -(nz * nz.log()).sum()
    return out.reshape(p.shape[:-1])

# ----------------------------------------------------------------- 2.3 dot_product_std


def std_layout_d_by_n(d_k, n_samples, generator):
    q = torch.randn(d_k, n_samples, generator=generator)
    k = torch.randn(d_k, n_samples, generator=generator)
    return (q * k).sum(0).std().item()


def std_one_draw_float64(d_k, n_samples, generator):
    q, k = torch.randn(2, n_samples, d_k, generator=generator, dtype=torch.float64)
    return float(torch.einsum("nd,nd->n", q, k).std(unbiased=False))


def std_k_first_normal(d_k, n_samples, generator):
    k = torch.normal(0.0, 1.0, size=(n_samples, d_k), generator=generator)
    q = torch.normal(0.0, 1.0, size=(n_samples, d_k), generator=generator)
    return math.sqrt(((q * k).sum(-1) ** 2).mean().item())  # E[q.k] = 0 is known: a valid estimator


def std_python_loop(d_k, n_samples, generator):
    dots = []
    for _ in range(n_samples):
        q = torch.randn(d_k, generator=generator)
        k = torch.randn(d_k, generator=generator)
        dots.append(torch.dot(q, k).item())
    mean = sum(dots) / len(dots)
    return math.sqrt(sum((x - mean) ** 2 for x in dots) / (len(dots) - 1))


RIGHT = {
    "scaled_scores": [scores_float64, scores_einsum, scores_matmul_rsqrt, scores_prescaled_q, scores_flatten_bmm],
    "attention_entropy": [entropy_nan_to_num, entropy_log2_nansum, entropy_float64, entropy_numpy, entropy_finfo_tiny,
                          entropy_categorical, entropy_clamp_min_1e30, entropy_where, entropy_eps_1e12, entropy_row_loop],
    "dot_product_std": [std_layout_d_by_n, std_one_draw_float64, std_k_first_normal, std_python_loop],
}


# make test keeps the first (commonest) mistakes of each exercise, and of 2.3 one of each other kind
# (the generator misused, a constant, the sample count, the type of the result; nan and int have
# test_std_nan_and_int_results_are_named_as_such), and the first right variant of each; make test-all
# runs all of them (2.3's cases draw 10^5-10^6 numbers each).
FAST_WRONG = {"scaled_scores": 4, "attention_entropy": 4, "dot_product_std": 5}
FAST_WRONG_ALSO = {"dot_product_std-std_global_rng", "dot_product_std-std_own_generator",
                   "dot_product_std-std_theoretical", "dot_product_std-std_fixed_sample_count",
                   "dot_product_std-std_returns_tensor", "dot_product_std-std_of_scaled_scores",
                   "scaled_scores-scores_isqrt", "scaled_scores-scores_bfloat16", "scaled_scores-scores_inner",
                   "scaled_scores-scores_matching_pairs", "attention_entropy-entropy_collision",
                   "attention_entropy-entropy_unweighted_log", "attention_entropy-entropy_eps_both_factors",
                   "dot_product_std-std_reseeds_from_the_clock"}
FAST_RIGHT = {"scaled_scores": 1, "attention_entropy": 1, "dot_product_std": 1}


@pytest.mark.parametrize(("name", "wrong", "hint"), first_fast(wrong_cases(WRONG), FAST_WRONG, FAST_WRONG_ALSO))
def test_check_rejects_wrong(name, wrong, hint):
    assert_rejected(name, wrong, hint)


@pytest.mark.parametrize(("name", "right"), first_fast(right_cases(RIGHT), FAST_RIGHT))
def test_check_accepts_right(name, right):
    assert_accepted(name, right)


def test_a_shape_error_in_scaled_scores_states_the_fact_and_names_no_cause():
    """(q * k).sum(-1) never used k.T: the hint of a shape error says what did not fit, not which
    transpose was wrong."""
    for fn in (scores_matching_pairs, scores_dot_T):
        message = str(checks.scaled_scores.evaluate(fn).error)
        assert "shapes do not fit" in message and "k.T" not in message and "reverses" not in message
