"""Notebook 02 (scaling): wrong answers written from the statements."""

import math

import torch

# ---- 2.1 scaled_scores(q, k) -> q k^T / sqrt(d_k) -----------------------------------------------


def scores_no_scale(q, k):
    return q @ k.transpose(-2, -1)


def scores_divide_by_dk(q, k):
    return q @ k.transpose(-2, -1) / q.shape[-1]


def scores_times_sqrt(q, k):
    return q @ k.transpose(-2, -1) * math.sqrt(q.shape[-1])


def scores_scale_by_tk(q, k):
    return q @ k.transpose(-2, -1) / math.sqrt(k.shape[-2])


def scores_transpose_1_2(q, k):
    return q @ k.transpose(1, 2) / math.sqrt(q.shape[-1])


def scores_float32(q, k):
    return q.float() @ k.float().transpose(-2, -1) / math.sqrt(q.shape[-1])


def scores_k_times_q(q, k):
    return k @ q.transpose(-2, -1) / math.sqrt(q.shape[-1])


def scores_shape_0(q, k):
    return q @ k.transpose(-2, -1) / math.sqrt(q.shape[0])


def scores_scale_by_tq(q, k):
    return q @ k.transpose(-2, -1) / math.sqrt(q.shape[-2])


def scores_int_sqrt(q, k):
    return torch.einsum("...id,...jd->...ij", q, k) / int(math.sqrt(q.shape[-1]))


def scores_scaled_twice(q, k):
    d = math.sqrt(q.shape[-1])
    return (q / d) @ k.transpose(-2, -1) / d


def scores_half_precision(q, k):
    s = q.half() @ k.half().transpose(-2, -1) / math.sqrt(q.shape[-1])
    return s.to(q.dtype)


# ---- 2.2 attention_entropy(p) -> -sum p ln p over the last axis ----------------------------------


def entropy_nan_at_zero(p):
    return -(p * p.log()).sum(-1)


def entropy_log2(p):
    return -torch.special.xlogy(p, p).sum(-1) / math.log(2)


def entropy_log10(p):
    return -(p * torch.where(p > 0, p.log10(), torch.zeros_like(p))).sum(-1)


def entropy_no_minus(p):
    return torch.special.xlogy(p, p).sum(-1)


def entropy_wrong_axis(p):
    return -torch.special.xlogy(p, p).sum(-2)


def entropy_mean(p):
    return -torch.special.xlogy(p, p).mean(-1)


def entropy_epsilon(p):
    return -(p * torch.log(p + 1e-4)).sum(-1)


def entropy_keepdim(p):
    return -torch.special.xlogy(p, p).sum(-1, keepdim=True)


def entropy_total(p):
    return torch.special.entr(p).sum()


def entropy_float32(p):
    p = p.float()
    return -torch.special.xlogy(p, p).sum(-1)


def entropy_as_logits(p):
    return torch.distributions.Categorical(logits=p).entropy()


def entropy_normalised(p):
    return -torch.special.xlogy(p, p).sum(-1) / math.log(p.shape[-1])


# ---- 2.3 dot_product_std(d_k, n_samples, generator) -> float ~ sqrt(d_k) ------------------------


def std_global_rng(d_k, n_samples, generator):
    q, k = torch.randn(n_samples, d_k), torch.randn(n_samples, d_k)
    return (q * k).sum(-1).std().item()


def std_reseeds(d_k, n_samples, generator):
    generator.manual_seed(1234)
    q = torch.randn(n_samples, d_k, generator=generator)
    k = torch.randn(n_samples, d_k, generator=generator)
    return (q * k).sum(-1).std().item()


def std_returns_variance(d_k, n_samples, generator):
    q = torch.randn(n_samples, d_k, generator=generator)
    k = torch.randn(n_samples, d_k, generator=generator)
    return (q * k).sum(-1).var().item()


def std_of_q_entries(d_k, n_samples, generator):
    q = torch.randn(n_samples, d_k, generator=generator)
    return q.std().item()


def std_q_dot_q(d_k, n_samples, generator):
    q = torch.randn(n_samples, d_k, generator=generator)
    return (q * q).sum(-1).std().item()


def std_returns_tensor(d_k, n_samples, generator):
    q = torch.randn(n_samples, d_k, generator=generator)
    k = torch.randn(n_samples, d_k, generator=generator)
    return (q * k).sum(-1).std()


def std_uniform(d_k, n_samples, generator):
    q = torch.rand(n_samples, d_k, generator=generator)
    k = torch.rand(n_samples, d_k, generator=generator)
    return (q * k).sum(-1).std().item()


def std_summed_wrong_axis(d_k, n_samples, generator):
    q = torch.randn(n_samples, d_k, generator=generator)
    k = torch.randn(n_samples, d_k, generator=generator)
    return (q * k).sum(0).std().item()


def std_scaled_dot(d_k, n_samples, generator):
    q = torch.randn(n_samples, d_k, generator=generator)
    k = torch.randn(n_samples, d_k, generator=generator)
    return ((q * k).sum(-1) / math.sqrt(d_k)).std().item()


def std_mean_abs(d_k, n_samples, generator):
    q = torch.randn(n_samples, d_k, generator=generator)
    k = torch.randn(n_samples, d_k, generator=generator)
    return (q * k).sum(-1).abs().mean().item()


def std_init_scaled_entries(d_k, n_samples, generator):
    q = torch.randn(n_samples, d_k, generator=generator) / math.sqrt(d_k)
    k = torch.randn(n_samples, d_k, generator=generator) / math.sqrt(d_k)
    return (q * k).sum(-1).std().item()


def std_one_pair(d_k, n_samples, generator):
    q = torch.randn(d_k, generator=generator)
    k = torch.randn(d_k, generator=generator)
    return ((q * k).std() * math.sqrt(d_k)).item()


def std_fresh_generator(d_k, n_samples, generator):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(n_samples, d_k, generator=g)
    k = torch.randn(n_samples, d_k, generator=g)
    return (q * k).sum(-1).std().item()


WRONG = {
    "scaled_scores": [
        ("forgot the 1/sqrt(d_k) scale", scores_no_scale),
        ("divided by d_k instead of sqrt(d_k)", scores_divide_by_dk),
        ("multiplied by sqrt(d_k) instead of dividing", scores_times_sqrt),
        ("scaled by sqrt(T_k) (k.shape[-2]) instead of sqrt(d_k)", scores_scale_by_tk),
        ("k.transpose(1, 2): right for 3-D inputs, wrong with a head axis", scores_transpose_1_2),
        ("cast to float32 (q's dtype not kept)", scores_float32),
        ("computed k q^T: the result is [..., T_k, T_q]", scores_k_times_q),
        ("took d_k from q.shape[0] instead of q.shape[-1]", scores_shape_0),
        ("scaled by sqrt(T_q) (q.shape[-2]) instead of sqrt(d_k)", scores_scale_by_tq),
        ("divided by int(sqrt(d_k)): floors the root when d_k is not a square", scores_int_sqrt),
        ("scaled q by 1/sqrt(d_k) and then the scores again", scores_scaled_twice),
        ("computed the product in float16 to save memory", scores_half_precision),
    ],
    "attention_entropy": [
        ("-(p * p.log()).sum(-1): 0 * log 0 gives NaN", entropy_nan_at_zero),
        ("entropy in bits (log2) instead of nats", entropy_log2),
        ("used log10", entropy_log10),
        ("forgot the minus sign", entropy_no_minus),
        ("summed over dim -2 instead of the last axis", entropy_wrong_axis),
        ("mean over the row instead of the sum", entropy_mean),
        ("log(p + 1e-4) to avoid log 0", entropy_epsilon),
        ("kept the reduced axis (keepdim=True)", entropy_keepdim),
        ("summed over every axis: one scalar", entropy_total),
        ("cast to float32 (p's dtype not kept)", entropy_float32),
        ("treated p as logits (Categorical(logits=p).entropy())", entropy_as_logits),
        ("divided by ln T (normalised entropy)", entropy_normalised),
    ],
    "dot_product_std": [
        ("used the global generator (torch.randn without generator=)", std_global_rng),
        ("reseeded the given generator with a fixed seed", std_reseeds),
        ("returned the variance instead of the std", std_returns_variance),
        ("returned the std of q's entries, not of the dot products", std_of_q_entries),
        ("dot product of q with itself", std_q_dot_q),
        ("returned a 0-d tensor instead of a Python float", std_returns_tensor),
        ("drew uniform numbers (torch.rand) instead of normal", std_uniform),
        ("summed over the samples axis instead of d_k", std_summed_wrong_axis),
        ("divided the dot products by sqrt(d_k) (the scaled score's std)", std_scaled_dot),
        ("returned mean |q.k| instead of the std", std_mean_abs),
        ("drew entries with std 1/sqrt(d_k) (initialisation habit)", std_init_scaled_entries),
        ("estimated from one pair's d_k products times sqrt(d_k), ignoring n_samples",
         std_one_pair),
        ("made a fresh torch.Generator().manual_seed(0) instead of using the given one",
         std_fresh_generator),
    ],
}
