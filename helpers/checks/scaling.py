"""Checks for notebook 02_scaling: exercises 2.1-2.3."""

from __future__ import annotations

import math

import torch

from .. import attention, scaling
from ._core import Trial, describe_case, exercise, seeded

__all__ = ["scaled_scores", "attention_entropy", "dot_product_std"]

NB = "02_scaling"



# --------------------------------------------------------------------------- 2.1 scaled_scores

_SCALE_HINT = "q @ k.transpose(-2, -1) / math.sqrt(d_k), with d_k = q.shape[-1]"


@exercise("2.1", "scaled scores", points=1, stars=1, notebook=NB)
def scaled_scores(t: Trial) -> None:
    t.error_hints = {
        r"cannot be multiplied|must match the size|size of tensor a|Expected size for first two dimensions|"
        r"expected .* batch": "transpose only the last two axes of k: q @ k.transpose(-2, -1) "
        "(k.T reverses every axis of a batched tensor).",
    }
    # (leading dims, T_q, T_k, d_k, dtype). No two of T_q, T_k, d_k are equal, and sqrt(d_k), d_k,
    # sqrt(T_q), sqrt(T_k) all differ, so each wrong scale gives its own numbers. The float64 case
    # catches a result built in a fresh (default float32) tensor.
    cases = [((2, 3), 5, 7, 4, torch.float32), ((), 6, 3, 16, torch.float32), ((2,), 3, 6, 9, torch.float64)]
    for seed, (lead, T_q, T_k, d_k, dtype) in enumerate(cases):
        g = seeded(300 + seed)
        q = torch.randn(*lead, T_q, d_k, generator=g, dtype=dtype)
        k = torch.randn(*lead, T_k, d_k, generator=g, dtype=dtype)
        got = t.call(q, k, case=describe_case(q=q, k=k))
        raw = q @ k.transpose(-2, -1)
        mistakes = {
            "you did not divide by sqrt(d_k): the raw dot products have variance d_k.": lambda raw=raw: raw,
            "you divided by d_k; divide by sqrt(d_k) (dividing by d_k leaves variance 1/d_k, "
            "and the softmax turns nearly uniform).": lambda raw=raw, d_k=d_k: raw / d_k,
            "you divided by sqrt(T), a sequence length; the scale is sqrt(d_k), the query/key width "
            "q.shape[-1].": lambda raw=raw, T_k=T_k: raw / math.sqrt(T_k),
            "you divided by sqrt(T_q), the number of queries; the scale is sqrt(d_k), the query/key "
            "width q.shape[-1].": lambda raw=raw, T_q=T_q: raw / math.sqrt(T_q),
            "you multiplied by sqrt(d_k); divide by it.": lambda raw=raw, d_k=d_k: raw * math.sqrt(d_k),
            "rows are queries: compute q @ k^T ([..., T_q, T_k]), not k @ q^T.": lambda q=q, k=k: attention.scaled_scores(k, q),
        }
        t.tensor(got, scaling.scaled_scores(q, k), what="scores", mistakes=mistakes, hint=_SCALE_HINT)


# --------------------------------------------------------------------------- 2.2 attention_entropy


def _entropy_mistakes(p: torch.Tensor) -> dict:
    plogp = torch.special.xlogy(p, p)
    T = p.shape[-1]
    return {
        "0·log 0 gave NaN (0 * -inf): a zero weight contributes 0 (the limit of p log p), so use "
        "torch.special.entr(p) (which is -p log p, and 0 at p = 0) or torch.where(p > 0, p * p.log(), 0).": lambda: -(p * p.log()).sum(-1),
        "you used log base 2 (bits); the course measures entropy in nats: use the natural log "
        "(torch.log, torch.special.entr).": lambda: -plogp.sum(-1) / math.log(2),
        "you used log base 10; entropy here is in nats: use the natural log.": lambda: -plogp.sum(-1) / math.log(10),
        "entropy is -sum p log p: you forgot the minus sign (entropy is never negative).": lambda: plogp.sum(-1),
        "you kept the reduced axis: sum over dim=-1 without keepdim, so the result is [...], one "
        "number per row.": lambda: -plogp.sum(-1, keepdim=True),
        "you averaged over the keys; entropy is the sum of -p log p over the row.": lambda: -plogp.mean(-1),
        "you divided by log(T_k) (a normalised entropy); return the entropy itself, in nats.": lambda: -plogp.sum(-1) / math.log(T),
    } | {
        f"entropy is over each row's keys, the last axis: sum over dim=-1, not dim={dim}.": lambda dim=dim: -plogp.sum(dim)
        for dim in range(p.ndim - 1)
    }


@exercise("2.2", "attention entropy", points=1, stars=1, notebook=NB)
def attention_entropy(t: Trial) -> None:
    cases = []
    g = seeded(400)
    # Dense rows, leading dims (2, 3), 5 queries over 7 keys: a wrong axis shows in the shape.
    cases.append(torch.softmax(torch.randn(2, 3, 5, 7, generator=g), dim=-1))
    # Causal attention weights: exact zeros above the diagonal (0·log 0), and a square matrix,
    # so summing the wrong axis has the right shape but wrong values.
    q, k = torch.randn(4, 6, 8, generator=g), torch.randn(4, 6, 8, generator=g)
    cases.append(attention.attention_weights(q, k, attention.causal_mask(6)))
    # float64: one-hot rows (entropy 0), uniform rows (log T_k), a padded row, a random row.
    rows = torch.zeros(5, 8, dtype=torch.float64)
    rows[0, 3] = 1.0
    rows[1] = 1.0 / 8
    rows[2, :5] = 1.0 / 5
    rows[3] = torch.softmax(3 * torch.randn(8, generator=g, dtype=torch.float64), dim=-1)
    rows[4, -1] = 1.0
    cases.append(rows)
    for p in cases:
        got = t.call(p, case=describe_case(p=p))
        t.tensor(got, scaling.attention_entropy(p), what="entropy", mistakes=_entropy_mistakes(p),
                 hint="torch.special.entr(p).sum(dim=-1): natural log, 0·log 0 = 0, one number per row.")


# --------------------------------------------------------------------------- 2.3 dot_product_std

# Statistics of the estimator. For q, k with iid N(0, 1) entries, x = q . k has variance d_k and
# E[x^4] = 3 d_k^2 + 6 d_k (excess kurtosis 6 / d_k), so the sample std of n independent x has
# standard error ~ sqrt(d_k) * sqrt((1 + 3 / d_k) / (2 n)). A correct learner may draw q and k in
# another order or layout than the reference, so its value is not the reference's value, only
# statistically equal to it: values are accepted within _N_SE standard errors of sqrt(d_k).
_N_SE = 6.0
# (d_k, n_samples, generator seed). For these d_k the values of the known mistakes below are at
# least 20% apart from each other and from sqrt(d_k), so each is recognised within _MISTAKE_TOL.
_VALUE_CASES = [(1024, 4_000, 0), (36, 40_000, 2)]
_MISTAKE_TOL = 0.1
# The spread of the result over many seeds at small n shows whether n_samples pairs were used:
# fewer pairs spread more, more pairs (or all n * n pairs of q @ k.T) spread less.
_SPREAD_D, _SPREAD_N, _SPREAD_SEEDS = 16, 10, range(1000, 1100)
_SPREAD_BAND = (0.6, 1.5)  # accepted ratio to the reference spread; correct variants: 0.8-1.2


_EXACTLY_N = "use exactly n_samples independent (q, k) pairs"


def _rel_tol(d_k: int, n: int) -> float:
    return _N_SE * math.sqrt((1 + 3 / d_k) / (2 * n))


def _as_float(x) -> float | None:
    try:
        return float(x)
    except (TypeError, ValueError, RuntimeError):
        return None


def _call_watched(t: Trial, d_k: int, n: int, seed: int, global_state: torch.Tensor | None = None):
    """Call with a fresh generator seeded ``seed``. Returns (result, global RNG changed, generator
    used). The global RNG state is put back afterwards, so a learner's function cannot shift the
    random numbers of the notebook around it."""
    g = seeded(seed)
    g_before = g.get_state()
    saved = torch.get_rng_state()
    if global_state is not None:
        torch.set_rng_state(global_state)
    before = torch.get_rng_state()
    try:
        got = t.call(d_k, n, g, case=f"d_k={d_k}, n_samples={n}, generator=torch.Generator().manual_seed({seed})")
        changed = not torch.equal(before, torch.get_rng_state())
    finally:
        torch.set_rng_state(saved)
    return got, changed, not torch.equal(g_before, g.get_state())


def _std_mistakes(d_k: int, n: int) -> dict:
    return {
        "you returned the variance (about d_k); the standard deviation is its square root: "
        "use .std(), or .var() ** 0.5.": d_k,
        "you took a square root too many: .std() is already the square root of the variance.": d_k ** 0.25,
        "you took the std of the single products q_i * k_i; sum them over the d_k features first "
        "(one dot product per sample), then take the std across samples.": 1.0,
        "you averaged q_i * k_i over the features; a dot product is their sum (the mean is "
        "the dot product / d_k).": 1 / math.sqrt(d_k),
        "you summed over the samples axis: each dot product sums over the d_k features of one "
        "(q, k) pair, and the std is taken across the n_samples pairs.": math.sqrt(n),
        "q and k must be independent draws: q . q has std sqrt(2 d_k).": math.sqrt(2 * d_k),
        "the entries must be N(0, 1): torch.randn, not torch.rand (uniform on [0, 1)).": math.sqrt(7 * d_k / 144),
        "the entries must be N(0, 1): uniform on [-1, 1] has variance 1/3, not 1. Use torch.randn.": math.sqrt(d_k) / 3,
    }


@exercise("2.3", "empirical std of q·k", points=2, stars=2, notebook=NB)
def dot_product_std(t: Trial) -> None:
    use_gen = "draw every random number with torch.randn(..., generator=generator)"
    for i, (d_k, n, seed) in enumerate(_VALUE_CASES):
        got, changed, used = _call_watched(t, d_k, n, seed)
        if changed:
            # Reseeding the global RNG makes the result independent of the global state before the call.
            again, _, _ = _call_watched(t, d_k, n, seed, global_state=torch.Generator().manual_seed(12345).get_state())
            if _as_float(again) is not None and _as_float(again) == _as_float(got):
                t.fail("your function reseeded torch's global random number generator.",
                       "do not call torch.manual_seed inside: it changes every other random number in the "
                       f"program. The caller seeds `generator`; {use_gen}.")
            t.fail("your function drew from torch's global random number generator, so the seed the caller "
                   "put in `generator` does not control the result.",
                   f"a torch.randn call without generator= uses the global generator: {use_gen}.")
        if not used:
            if _as_float(got) == math.sqrt(d_k):
                t.fail(f"you returned sqrt(d_k) = {math.sqrt(d_k):g} exactly: the theoretical value, not a measurement.",
                       f"sample n_samples pairs (q, k) and return the std of their dot products; {use_gen}.")
            t.fail("your function never drew from the generator it was given.",
                   f"{use_gen} (not your own torch.Generator, NumPy or Python's random).")
        if i == 0:
            # Same seed -> same result; another seed -> another result.
            again, _, _ = _call_watched(t, d_k, n, seed)
            if _as_float(again) != _as_float(got):
                t.fail(f"two generators seeded alike gave different results ({got!r} and {again!r}).",
                       f"the result must depend only on d_k, n_samples and the generator: {use_gen}.")
            other, _, _ = _call_watched(t, d_k, n, seed + 1)
            if _as_float(other) is not None and _as_float(other) == _as_float(got):
                t.fail("generators with different seeds gave the same result.",
                       "do not reseed the generator you were given (generator.manual_seed(...)): the caller "
                       f"seeds it; {use_gen}.")
        tol = _rel_tol(d_k, n)
        value = _as_float(got)
        t.case = f"d_k={d_k}, n_samples={n}, generator=torch.Generator().manual_seed({seed})"
        matched = [h for h, v in _std_mistakes(d_k, n).items()
                   if value is not None and value > 0 and abs(math.log(value / v)) < _MISTAKE_TOL]
        if matched:
            hint = matched[0]
        elif value is not None and abs(value / math.sqrt(d_k) - 1) < 0.3:
            hint = (f"your value is near sqrt(d_k) = {math.sqrt(d_k):g}, but further from it than {n} samples "
                    f"allow: {_EXACTLY_N}, a fresh q and a fresh k for every sample.")
        else:
            hint = ("q = torch.randn(n_samples, d_k, generator=generator), the same for k, then "
                    "(q * k).sum(-1).std().item().")
        t.number(got, math.sqrt(d_k), what=f"std of q·k (accepted within ±{100 * tol:.1f}%, {_N_SE:g} standard errors)",
                 rel=tol, hint=hint)

    # Does the result use n_samples pairs? Compare its spread over many seeds with the reference's.
    got = [_call_watched(t, _SPREAD_D, _SPREAD_N, s)[0] for s in _SPREAD_SEEDS]
    if any(_as_float(v) is None or not math.isfinite(_as_float(v)) for v in got):
        bad = next(v for v in got if _as_float(v) is None or not math.isfinite(_as_float(v)))
        t.fail(f"with n_samples={_SPREAD_N} your function returned {bad!r}.",
               "use all n_samples pairs, and return a finite float.")
    spread = torch.tensor([_as_float(v) for v in got], dtype=torch.float64).std().item()
    g = seeded(999)
    q = torch.randn(4000, _SPREAD_N, _SPREAD_D, generator=g, dtype=torch.float64)
    k = torch.randn(4000, _SPREAD_N, _SPREAD_D, generator=g, dtype=torch.float64)
    ref_spread = (q * k).sum(-1).std(dim=-1).std().item()
    ratio = spread / ref_spread
    t.case = f"d_k={_SPREAD_D}, n_samples={_SPREAD_N}, {len(_SPREAD_SEEDS)} generator seeds"
    if ratio < _SPREAD_BAND[0]:
        t.fail(f"over {len(_SPREAD_SEEDS)} seeds your results spread {ratio:.2f}x as much as a std of "
               f"{_SPREAD_N} samples should: your function uses more samples than n_samples.",
               f"{_EXACTLY_N}: not a fixed number of your own, and not all n_samples**2 pairs of q @ k.T.")
    if ratio > _SPREAD_BAND[1]:
        t.fail(f"over {len(_SPREAD_SEEDS)} seeds your results spread {ratio:.2f}x as much as a std of "
               f"{_SPREAD_N} samples should: your function uses fewer samples than n_samples.",
               f"{_EXACTLY_N}, and use all of them.")
