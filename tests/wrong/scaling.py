"""Learner-style wrong implementations for exercises 2.1-2.3, with the hint each check must give."""

import math
import warnings

import numpy as np
import torch


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


WRONG = {
    "scaled_scores": [
        (scores_no_scale, "did not divide by sqrt(d_k)"),
        (scores_scale_by_dk, "you divided by d_k"),
        (scores_scale_by_sqrt_T, "divided by sqrt(T_q)"),
        (scores_scale_by_sqrt_Tk, "divided by sqrt(T)"),
        (scores_multiply, "multiplied by sqrt(d_k)"),
        (scores_k_at_q, "not k @ q^T"),
        (scores_dot_T, "transpose only the last two axes"),
        (scores_loop_float32, "expected dtype torch.float64"),
        (scores_in_place, "modified one of its input tensors in place"),
    ],
    "attention_entropy": [
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
    ],
    "dot_product_std": [
        (std_returns_variance, "returned the variance"),
        (std_sqrt_of_std, "square root too many"),
        (std_of_products, "single products"),
        (std_of_mean, "averaged q_i * k_i"),
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
    ],
}
