"""Checks for notebook 02_scaling (its exercises: helpers/registry.py).

Every case and its expected output are built before the learner's function first runs; the
mistakes each check recognises are outputs of known wrong implementations, named at the first
failure; the ``hint=`` of a comparison is the full recipe, shown only when the check fails again.
"""

from __future__ import annotations

import math

import torch

from .. import nb01_qkv_shapes as attention
from .. import nb02_scaling as scaling
from ..registry import in_module
from . import watchers
from .core import Trial, describe, describe_case, eager_mistakes, exercise, salted, seeded
from .feedback import Mistake
from .guard import _allclose, _equal, _isclose_num, _isfinite

__all__ = in_module(__name__)  # its exercises' checks, as helpers/registry.py lists them



# --------------------------------------------------------------------------- 2.1 scaled_scores

_SCALE_HINT = "q @ k.transpose(-2, -1) / math.sqrt(d_k), with d_k = q.shape[-1]"


def _scale_mistakes(q: torch.Tensor, k: torch.Tensor) -> dict:
    T_q, T_k, d_k = q.shape[-2], k.shape[-2], q.shape[-1]
    raw = lambda: q @ k.transpose(-2, -1)  # noqa: E731
    mistakes = {
        Mistake("missing-scale",
                "you did not divide by sqrt(d_k): the raw dot products have variance d_k."): raw,
        Mistake("scaled-by-d_k",
                "you divided by d_k; divide by sqrt(d_k) (dividing by d_k leaves variance 1/d_k, and the softmax "
                "turns nearly uniform). Scaling q by 1/sqrt(d_k) and the scores again also divides by d_k."):
            lambda: raw() / d_k,
        Mistake("scaled-by-sqrt-T_k",
                "you divided by sqrt(T), a sequence length; the scale is sqrt(d_k), the query/key "
                "width q.shape[-1]."): lambda: raw() / math.sqrt(T_k),
        Mistake("scaled-by-sqrt-T_q",
                "you divided by sqrt(T_q), the number of queries; the scale is sqrt(d_k), the "
                "query/key width q.shape[-1]."): lambda: raw() / math.sqrt(T_q),
        Mistake("multiplied-by-sqrt-d_k", "you multiplied by sqrt(d_k); divide by it."):
            lambda: raw() * math.sqrt(d_k),
        Mistake("scaled-by-d_k-pow-minus-2",
                "you scaled by d_k ** -2 (1 / d_k squared); the scale is d_k ** -0.5 = 1 / "
                "sqrt(d_k)."): lambda: raw() / d_k**2,
        Mistake("multiplied-by-d_k",
                "you multiplied by d_k; divide by sqrt(d_k) (multiply by d_k ** -0.5)."):
            lambda: raw() * d_k,
        Mistake("pow-precedence-divides-by-2d_k",
                "d_k ** -1/2 (or / d_k ** 1/2) is (d_k ** -1) / 2 in Python: ** binds tighter than "
                "/, so you divided by 2 d_k. Write d_k ** -0.5 or / math.sqrt(d_k)."):
            lambda: raw() / (2 * d_k),
        Mistake("pow-precedence-divides-by-half-d_k",
                "d_k ** 1/2 is d_k / 2 in Python (** binds tighter than /), so you divided by "
                "d_k / 2. Write d_k ** 0.5 or math.sqrt(d_k)."): lambda: raw() / (d_k / 2),
        Mistake("paired-across-batches",
                "your scores pair every query with every key of every batch element and head: shape "
                "[*q.shape[:-1], *k.shape[:-1]] (what torch.tensordot or torch.inner over the last axis give). "
                "Pair within the same batch element and head only: q @ k.transpose(-2, -1) -> [..., T_q, T_k].",
                "paired queries and keys across batch elements and heads (tensordot over d_k)"):
            lambda: torch.tensordot(q, k, dims=([-1], [-1])) / math.sqrt(d_k),
        Mistake("k-times-q-transposed",
                "rows are queries: compute q @ k^T ([..., T_q, T_k]), not k @ q^T.",
                "computed k @ q^T ([..., T_k, T_q]) instead of q @ k^T"):
            lambda: attention.scaled_scores(k, q),
        Mistake("floored-sqrt-d_k",
                "you rounded sqrt(d_k) down to a whole number (int(), math.isqrt, // or math.floor): when d_k is "
                "not a perfect square that changes the scale. Divide by math.sqrt(d_k) itself.",
                "divided by int(sqrt(d_k)), sqrt(d_k) rounded down"):
            lambda: raw() / math.floor(math.sqrt(d_k)),
        Mistake("rounded-sqrt-d_k",
                "you rounded sqrt(d_k) to the nearest whole number (round()): when d_k is not a perfect square "
                "that changes the scale. Divide by math.sqrt(d_k) itself.",
                "divided by round(sqrt(d_k))"):
            lambda: raw() / round(math.sqrt(d_k)),
    }
    if q.dim() >= 4 and q.shape[-3] > 1:  # [B, H, T, d_k]: d_model = H * d_k
        mistakes[Mistake("scaled-by-sqrt-d_model",
                         "you divided by sqrt(d_model) = sqrt(H * d_k), the model width; the scale is sqrt(d_k), "
                         "one head's query/key width, q.shape[-1].",
                         "divided by sqrt(d_model) instead of sqrt(d_k)")] = (
            lambda: raw() / math.sqrt(q.shape[-3] * d_k))
    for axis in range(q.dim() - 2):  # d_k taken from a leading (batch or head) axis, e.g. q.shape[0]
        n = q.shape[axis]
        if n not in (1, d_k, T_q, T_k):
            mistakes[Mistake("scaled-by-sqrt-of-leading-axis",
                             f"you divided by the square root of q.shape[{axis}], a leading (batch or head) axis; "
                             "d_k is the query/key width, the last axis: q.shape[-1].",
                             "divided by the square root of a batch or head axis instead of sqrt(d_k)")] = (
                lambda n=n: raw() / math.sqrt(n))
    return mistakes


_LOST_PRECISION = Mistake(
    "lost-precision",
    "your scores agree with the expected ones to only 2 or 3 significant digits: part of the computation ran in a "
    "lower precision (float16 or bfloat16: .half(), .bfloat16(), autocast) and was cast back. Compute in q's own "
    "dtype.",
    "computed the scores in float16/bfloat16 and cast back (precision lost)")


def _scale_diagnosis(got, q: torch.Tensor, k: torch.Tensor, expected: torch.Tensor) -> str:
    """What a wrong output of the expected shape and dtype does, when it is a property no listed
    mistake models: the right scores rounded (a lower precision), or divided by another number."""
    try:
        if type(got) is not torch.Tensor or got.shape != expected.shape or got.dtype != expected.dtype:
            return ""
        g, e = got.detach().double(), expected.detach().double()
        if not bool(_isfinite(g).all()) or _allclose(g, e, atol=1e-5, rtol=1e-4):
            return ""
        d_k = q.shape[-1]
        c = float((g * e).sum() / (e * e).sum())
        if c != 0 and _allclose(g, c * e, atol=1e-6, rtol=1e-5):  # one factor for every entry: a scale
            divisor = math.sqrt(d_k) / c
            return Mistake(
                "divided-by-another-number",
                f"your scores are q @ k^T divided by {divisor:.4g}, for every entry; the divisor is sqrt(d_k) = "
                f"{math.sqrt(d_k):.4g}, the square root of the query/key width q.shape[-1] = {d_k}.",
                "divided the scores by another number than sqrt(d_k)")
        # A rounding-size error that differs from entry to entry: a lower precision somewhere.
        size = (q.detach().double().abs() @ k.detach().double().abs().transpose(-2, -1)) / math.sqrt(d_k)
        diff = g - e
        rel = (diff.abs() / size.clamp_min(1e-12)).max().item()
        both_ways = diff.mean().abs().item() <= 0.3 * diff.abs().mean().item()  # not a bias (an offset)
        if rel < 2**-4 and both_ways:
            return _LOST_PRECISION
    except Exception:  # noqa: BLE001 - a diagnosis never breaks a check
        return ""
    return ""


@exercise()
def scaled_scores(t: Trial) -> None:
    t.error_hints = {
        r"cannot be multiplied|must match the size|size of tensor a|Expected size for first two dimensions|"
        r"expected .* batch": Mistake(
            "shapes-do-not-fit",
            "two tensors were combined whose shapes do not fit (the sizes are in the error above). The scores "
            "pair every query with every key of the same batch element and head: q @ k.transpose(-2, -1), "
            "[..., T_q, d_k] @ [..., d_k, T_k] -> [..., T_q, T_k], with the leading axes of q and k untouched.",
            "combined q and k in an operation whose shapes do not fit"),
    }
    # (leading dims, T_q, T_k, d_k, dtype). No two of T_q, T_k, d_k are equal, and sqrt(d_k), d_k,
    # sqrt(T_q), sqrt(T_k) all differ, so each wrong scale gives its own numbers. The float64 case
    # catches a result built in a fresh (default float32) tensor; d_k = 15, not a perfect square,
    # catches sqrt(d_k) rounded down (to 3) or to the nearest integer (to 4).
    cases = []
    for seed, (lead, T_q, T_k, d_k, dtype) in enumerate([((2, 3), 5, 7, 4, torch.float32), ((), 6, 3, 16, torch.float32),
                                                         ((2,), 3, 6, 9, torch.float64),
                                                         ((3,), 5, 2, 15, torch.float32)]):
        g = seeded(300 + seed)
        q = torch.randn(*lead, T_q, d_k, generator=g, dtype=dtype)
        k = torch.randn(*lead, T_k, d_k, generator=g, dtype=dtype)
        cases.append((q, k, scaling.scaled_scores(q, k), eager_mistakes(_scale_mistakes(q, k))))
    for q, k, expected, mistakes in cases:
        got = t.call(q, k, case=describe_case(q=q, k=k))
        t.tensor(got, expected, what="scores", mistakes=mistakes, hint=_SCALE_HINT,
                 diagnosis=_scale_diagnosis(got, q, k, expected))


# --------------------------------------------------------------------------- 2.2 attention_entropy

_ENTR = "torch.special.entr(p) (which is -p log p, and 0 at p = 0) or torch.where(p > 0, p * p.log(), 0)"


def _entropy_mistakes(p: torch.Tensor) -> dict:
    plogp = lambda: torch.special.xlogy(p, p)  # noqa: E731
    T = p.shape[-1]
    mistakes = {
        Mistake("nan-from-0-log-0",
                f"0·log 0 gave NaN (0 * -inf): a zero weight contributes 0 (the limit of p log p), "
                f"so use {_ENTR}."): lambda: -(p * p.log()).sum(-1),
        Mistake("log-base-2",
                "you used log base 2 (bits); the course measures entropy in nats: use the natural "
                "log (torch.log, torch.special.entr)."): lambda: -plogp().sum(-1) / math.log(2),
        Mistake("log-base-10",
                "you used log base 10; entropy here is in nats: use the natural log."):
            lambda: -plogp().sum(-1) / math.log(10),
        Mistake("missing-minus-sign",
                "entropy is -sum p log p: you forgot the minus sign (entropy is never negative).",
                "forgot the minus sign of -sum p log p"): lambda: plogp().sum(-1),
        Mistake("kept-reduced-axis",
                "you kept the reduced axis: sum over dim=-1 without keepdim, so the result is "
                "[...], one number per row."): lambda: -plogp().sum(-1, keepdim=True),
        Mistake("mean-over-keys",
                "you averaged over the keys; entropy is the sum of -p log p over the row."):
            lambda: -plogp().mean(-1),
        Mistake("normalised-entropy",
                "you divided by log(T_k) (a normalised entropy); return the entropy itself, in "
                "nats."): lambda: -plogp().sum(-1) / math.log(T),
        Mistake("returned-perplexity",
                "you returned exp(entropy), the perplexity (the effective number of keys); return "
                "the entropy itself, -sum p log p, in nats."):
            lambda: torch.exp(-plogp().sum(-1)),
        Mistake("summed-all-entries",
                "you summed over every entry, one number for the whole tensor: sum over the last "
                "axis only (dim=-1), one entropy per row."): lambda: -plogp().sum(),
        Mistake("averaged-over-rows",
                "you averaged the rows' entropies into one number: return one entropy per row, shape [...] "
                "(p's shape without its last axis), with no mean over the rows.",
                "returned the mean entropy over the rows, not one per row"):
            lambda: -plogp().sum(-1).mean(),
        Mistake("p-as-logits",
                "you treated p as logits (Categorical(logits=p), or a softmax of p): p are already "
                "probabilities; use Categorical(probs=p), or -sum p log p directly."):
            lambda: torch.distributions.Categorical(logits=p).entropy(),
        Mistake("renyi-2-entropy",
                "your result is -log(sum p^2), the collision (Renyi-2) entropy: it weighs large weights more. "
                "The entropy here is Shannon's, -sum p log p over each row (in nats).",
                "returned the collision entropy -log(sum p^2), not -sum p log p"):
            lambda: -(p * p).sum(-1).log(),
        Mistake("min-entropy",
                "your result is -log(max p), the min-entropy: it reads the largest weight only. The entropy here "
                "is Shannon's, -sum p log p over each row (in nats).",
                "returned the min-entropy -log(max p), not -sum p log p"):
            lambda: -p.amax(-1).log(),
    }
    # log p without the weight p in front: each log counts the same (log 0 = -inf gives inf where a row has a 0).
    for words, model in (("-mean(log p)", lambda: -p.log().mean(-1)), ("-sum(log p)", lambda: -p.log().sum(-1))):
        mistakes[Mistake(
            "log-p-not-weighted-by-p",
            f"your result is {words} over each row: every log p counts alike, where entropy weighs each by its "
            f"probability, -sum p log p (and a zero weight contributes 0, not -log 0 = inf): {_ENTR}.",
            "left out the factor p of -sum p log p (a mean or sum of -log p)")] = model
    # p itself changed before p log p (clamped, or an epsilon added, in both factors): every zero weight then
    # contributes, and the small ones change.
    for eps in (1e-2, 1e-3, 1e-4, 1e-5, 1e-6, 1e-7, 1e-8):
        for how, changed in ((f"p.clamp(min={eps:g})", lambda eps=eps: p.clamp(min=eps)),
                             (f"p + {eps:g}", lambda eps=eps: p + eps)):
            mistakes[Mistake(
                "changed-p-in-both-factors",
                f"your result is -sum q log q with q = {how}: p changed in both factors, so every zero weight "
                f"contributes -{eps:g} log {eps:g} instead of 0, and the small weights change too. Keep p as it is "
                f"and guard only the log of p = 0: {_ENTR}.",
                "changed p (clamped, or added a small number) in both factors of p log p")] = (
                lambda changed=changed: -(changed() * changed().log()).sum(-1))
    for dim in range(p.ndim - 1):
        # Over the queries of a square matrix the shape comes out right: a mistake of its own (a case with
        # another shape, where this learner summed the right axis, must not refute it).
        square = dim == p.ndim - 2 and p.shape[-1] == p.shape[-2]
        text = ("you summed over dim=-2, the queries: in a square [T, T] matrix that gives the right shape but "
                "not the entropies. Entropy is over each row's keys, the last axis: sum over dim=-1." if square else
                f"entropy is over each row's keys, the last axis: sum over dim=-1, not dim={dim}.")
        mistakes[Mistake("sum-over-wrong-axis", text, "summed over another axis than the keys (dim=-1)")] = (
            lambda dim=dim: -plogp().sum(dim))
    # Guarding log(0) by clamping, or by adding a small number, changes small probabilities.
    for eps in (1e-2, 1e-3, 1e-4, 1e-5, 1e-6):
        small = int(((p > 0) & (p < eps)).sum())
        if small:
            mistakes[Mistake(
                "clamped-p-before-log",
                f"you clamped p at {eps:g} before the log: every probability below {eps:g} "
                f"(here {small} of {p.numel()}) then counts as log({eps:g}). A row over many keys "
                f"is made of such small weights. Only p = 0 needs care: {_ENTR}.",
                "clamped p at a small number before the log (p.clamp(min=eps).log())",
            )] = lambda eps=eps: -(p * p.clamp(min=eps).log()).sum(-1)
        mistakes[Mistake(
            "added-eps-inside-log",
            f"you added {eps:g} inside the log: log(p + {eps:g}) exceeds log p by about {eps:g} / "
            f"p, which adds up over the {T} weights of a row and is large for weights near "
            f"{eps:g}. Only p = 0 needs care: {_ENTR}.",
            "added a small number inside the log (log(p + eps))",
        )] = lambda eps=eps: -(p * (p + eps).log()).sum(-1)
    return mistakes

@exercise()
def attention_entropy(t: Trial) -> None:
    cases = []
    g = seeded(400)
    # Dense rows, leading dims (2, 3), 5 queries over 7 keys: a wrong axis shows in the shape.
    cases.append(torch.softmax(torch.randn(2, 3, 5, 7, generator=g), dim=-1))
    # Causal attention weights: exact zeros above the diagonal (0·log 0), and a square matrix,
    # so summing the wrong axis has the right shape but wrong values.
    q, k = torch.randn(4, 6, 8, generator=g), torch.randn(4, 6, 8, generator=g)
    cases.append(attention.attention_weights(q, k, attention.causal_mask(6)))
    # float64: one-hot rows (entropy 0), uniform rows (log T_k), a padded row, a random row, and a
    # row of a few tiny but non-zero weights (a log guarded by clamping or an epsilon changes it).
    rows = torch.zeros(6, 8, dtype=torch.float64)
    rows[0, 3] = 1.0
    rows[1] = 1.0 / 8
    rows[2, :5] = 1.0 / 5
    rows[3] = torch.softmax(3 * torch.randn(8, generator=g, dtype=torch.float64), dim=-1)
    rows[4, -1] = 1.0
    rows[5] = torch.tensor([0.6, 0.3, 0.0996, 3e-4, 6e-5, 3e-5, 1e-5, 0.0], dtype=torch.float64)
    cases.append(rows)
    # A long context: 4096 keys, so nearly every weight is below 1e-3 (uniform: 2.4e-4 each).
    long_rows = torch.softmax(torch.randn(2, 4096, generator=g), dim=-1)
    long_rows[1] = 1.0 / 4096
    cases.append(long_rows)
    cases = [(p, scaling.attention_entropy(p), eager_mistakes(_entropy_mistakes(p))) for p in cases]
    for p, expected, mistakes in cases:
        got = t.call(p, case=describe_case(p=p))
        t.tensor(got, expected, what="entropy", mistakes=mistakes,
                 hint="torch.special.entr(p).sum(dim=-1): natural log, 0·log 0 = 0, one number per row.")


# --------------------------------------------------------------------------- 2.3 dot_product_std

# The statistics behind this check. For q, k with iid N(0, 1) entries, x = q . k has mean 0,
# variance d_k and E[x^4] = 3 d_k^2 + 6 d_k (excess kurtosis 6 / d_k).
#
# The value. The sample std s of n independent x has standard error ~ sqrt(d_k) * sqrt((1 + 3 / d_k)
# / (2 n)). A correct learner may draw q and k in another order or layout than the reference, so its
# value is only statistically equal to the reference's: it is accepted within _N_SE = 6 standard
# errors of sqrt(d_k) (s is close to normal at these n: a false rejection has probability ~2e-9 per
# case).
#
# The number of samples. 2 * n_samples pairs give a value just as close to sqrt(d_k), so the check
# also measures how much the result varies from seed to seed. For y = s^2 (the sample variance, or
# the population one: the ratio below is scale-free) Var(y) / E[y]^2 = 2 / (n - 1) + kappa / n, with
# kappa = 6 / d_k. Over M = 1000 seeds at d_k = 16, n = 10, the estimate C of that ratio, divided by
# its exact value C0 = 0.2597, has sd(log(C / C0)) = 0.054 (100,000 simulated correct learners:
# min 0.808, max 1.269). The band exp(+-0.33) = 0.72 .. 1.39 is 6.1 sd wide on each side: a correct
# learner is rejected with probability ~1e-9 (normal tails; the simulated ones are lighter), while
# 2 * n_samples pairs give C / C0 ~ 0.48 (at most 0.57 in 2,000 simulations), n_samples / 2 give
# ~2.2 (at least 1.83), and all n^2 pairs of q @ k.T or a fixed count of 100 give far less.
_N_SE = 6.0
# (d_k, n_samples, generator seed). For these d_k the values of the known mistakes below are at
# least 20% apart from each other and from sqrt(d_k), so each is recognised within _MISTAKE_TOL.
_VALUE_CASES = [(1024, 4_000, 0), (36, 40_000, 2)]
_MISTAKE_TOL = 0.1
_SPREAD_D, _SPREAD_N, _SPREAD_SEEDS = 16, 10, range(10_000, 11_000)
_SPREAD_BAND = (math.exp(-0.33), math.exp(0.33))

_RECIPE = ("q = torch.randn(n_samples, d_k, generator=generator), the same for k, then (q * k).sum(-1).std().item(): "
           "n_samples independent pairs, one dot product each, and the std across the pairs.")
_USE_GEN = "draw every random number with torch.randn(..., generator=generator)"
_EXACTLY_N = "use exactly n_samples independent (q, k) pairs"

# The mistakes dot_product_std names when it fails (its known wrong values are in _std_mistakes).
_RETURNED_NONE = Mistake("returned-None", "did you forget the `return` statement?")
_RETURNED_TENSOR = Mistake(
    "tensor-not-number", "return `.item()` of the std (a 0-dim tensor) to get a float.",
    "returned a tensor, not a Python float")
_RETURNED_INT = Mistake(
    "rounded-to-int", "return the std as it comes, .item() of it, without rounding or int().",
    "returned an int: rounded the std or converted it with int()")
_TOO_MANY_PAIRS = Mistake(
    "too-many-pairs",
    f"{_EXACTLY_N}: not a fixed number of your own, not 2 * n_samples, and not all n_samples**2 "
    "pairs of q @ k.T.",
    "used more than n_samples (q, k) pairs (a fixed count, 2 * n, or all n^2)")
_TOO_FEW_PAIRS = Mistake(
    "too-few-pairs", f"{_EXACTLY_N}, and use all of them.",
    "used fewer than n_samples (q, k) pairs")
_RESEEDED_GLOBAL = Mistake(
    "reseeded-global-rng",
    "do not call torch.manual_seed inside: it changes every other random number in the program. "
    f"The caller seeds `generator`; {_USE_GEN}.",
    "called torch.manual_seed inside the function")
_USED_GLOBAL = Mistake(
    "used-global-rng",
    f"a torch.randn call without generator= uses the global generator: {_USE_GEN}.",
    "drew random numbers without generator= (from the global generator)")
_RETURNED_THEORY = Mistake(
    "returned-theoretical-value",
    f"sample n_samples pairs (q, k) and return the std of their dot products; {_USE_GEN}.",
    "returned sqrt(d_k), the theoretical value, instead of measuring it")
_IGNORED_GENERATOR = Mistake(
    "ignored-generator", f"{_USE_GEN} (not your own torch.Generator, NumPy or Python's random).",
    "never drew from the generator it was given")
_NOT_REPRODUCIBLE = Mistake(
    "not-reproducible",
    f"the result must depend only on d_k, n_samples and the generator: {_USE_GEN}.",
    "gave different results for generators seeded alike")
_RESEEDED_GENERATOR = Mistake(
    "reseeded-generator",
    "do not call generator.manual_seed(...): the caller seeds it; " + _USE_GEN + ".",
    "called manual_seed on the generator it was given")
_RESEEDED_AT_RANDOM = Mistake(
    "reseeds-generator-randomly",
    "your function reseeds the generator it is given, with a new seed at every call (generator.seed() does that: "
    "it draws a fresh random seed; generator.initial_seed() is what reads the seed). The caller seeds `generator`: "
    f"{_USE_GEN}, without reseeding it.",
    "reseeded the generator it was given with a random seed (generator.seed())")


def _initial_seed(state: torch.Tensor) -> int | None:
    """The initial seed recorded in a CPU generator's state (``Generator.get_state()``), or None."""
    try:
        g = torch.Generator()
        g.set_state(state)
        return g.initial_seed()
    except Exception:  # noqa: BLE001 - not a CPU generator's state
        return None


def _rel_tol(d_k: int, n: int) -> float:
    return _N_SE * math.sqrt((1 + 3 / d_k) / (2 * n))


def _cv2(n: float, d_k: int) -> float:
    """Var(s^2) / E[s^2]^2 for the sample variance s^2 of n independent q . k (iid N(0, 1) entries)."""
    return 2 / (n - 1) + 6 / (d_k * n)


def _pairs_for(c: float, d_k: int) -> float:
    """The number of pairs n with _cv2(n, d_k) == c (the root above 1)."""
    kappa = 6 / d_k
    b = c + 2 + kappa
    return (b + math.sqrt(b * b - 4 * c * kappa)) / (2 * c)


def _call_watched(t: Trial, d_k: int, n: int, seed: int, global_state: torch.Tensor | None = None):
    """Call with a fresh generator seeded ``seed``. Returns (result, global RNG changed, generator
    used, generator state after)."""
    got, seen = t.call_watched(watchers.rng, (d_k, n, seeded(seed)), global_state,
                               case=f"d_k={d_k}, n_samples={n}, generator=torch.Generator().manual_seed({seed})")
    return got, seen["changed"], seen["used"], seen["after"]


def _value(t: Trial, got, what: str = "your function") -> float:
    """The learner's result as a finite float, or a failure that says what it is instead."""
    __tracebackhide__ = True
    if got is None:
        t.fail(f"{what} returned None.", _RETURNED_NONE)
    if isinstance(got, torch.Tensor):
        t.fail(f"{what} returned a tensor {describe(got)}, not a Python float.",
               _RETURNED_TENSOR)
    if isinstance(got, bool) or not isinstance(got, (int, float)) and type(got).__module__ != "numpy":
        t.fail(f"{what} returned {describe(got)}, not a float.", recipe=_RECIPE)
    if isinstance(got, int):
        t.fail(f"{what} returned int {got!r}: a measured std is a float, not a whole number.",
               _RETURNED_INT)
    try:
        value = float(got)
    except (TypeError, ValueError, OverflowError):
        t.fail(f"{what} returned {describe(got)}, not a float.", recipe=_RECIPE)
    if not math.isfinite(value):
        t.fail(f"{what} returned {value!r}, not a finite number.", recipe=_RECIPE)
    return value


def _std_mistakes(d_k: int, n: int) -> dict:
    """hint -> the value a known wrong measurement gives (about), for d_k and n samples. A value shared by
    several ways of computing it is named by what it is, with those ways as examples."""
    return {
        Mistake("returned-variance",
                "your result is about d_k, the variance of q·k; the standard deviation is its square root: "
                "use .std(), or .var() ** 0.5.",
                "returned the variance (about d_k), not the std"): d_k,
        Mistake("sqrt-of-std",
                "you took a square root too many: .std() is already the square root of the "
                "variance."): d_k ** 0.25,
        Mistake("sqrt-d_k-times-too-small",
                "your result is about 1, sqrt(d_k) times smaller than the std of q·k: the spread of a number of "
                "size 1 (an entry of q, a single product q_i * k_i, or a scaled score q·k / sqrt(d_k)), not of the "
                "dot product. Measure the raw dot product: N(0, 1) entries, q_i * k_i summed over the d_k features "
                "(no scaling), then the std across the n_samples pairs.",
                "returned about 1 (the std of an entry, of single products q_i k_i, or of q·k / sqrt(d_k))"): 1.0,
        Mistake("d_k-times-too-small",
                "your result is about 1/sqrt(d_k), d_k times smaller than the std of q·k: what averaging q_i * k_i "
                "over the features (instead of summing) gives, or entries drawn with std 1/sqrt(d_k). Draw plain "
                "N(0, 1) entries (torch.randn, not rescaled) and sum q_i * k_i over the d_k features.",
                "returned about 1/sqrt(d_k) (the mean over features, or entries of std 1/sqrt(d_k))"):
            1 / math.sqrt(d_k),
        Mistake("summed-over-samples",
                "you summed over the samples axis: each dot product sums over the d_k features of "
                "one (q, k) pair, and the std is taken across the n_samples pairs."): math.sqrt(n),
        Mistake("q-dot-q",
                "your result is about sqrt(2 d_k), the std of q · q: q and k must be independent draws, each "
                "its own torch.randn(..., generator=generator).",
                "used the same draw for q and k (q . q)"): math.sqrt(2 * d_k),
        Mistake("uniform-0-1-entries",
                "the entries must be N(0, 1): torch.randn, not torch.rand (uniform on [0, 1)).",
                "drew the entries with torch.rand (uniform on [0, 1)), not torch.randn"):
            math.sqrt(7 * d_k / 144),
        Mistake("uniform-minus-1-1-entries",
                "the entries must be N(0, 1): uniform on [-1, 1] has variance 1/3, not 1. Use "
                "torch.randn.",
                "drew the entries uniform on [-1, 1], not N(0, 1)"): math.sqrt(d_k) / 3,
        Mistake("returned-standard-error",
                "you divided the std by sqrt(n_samples): that is the standard error of the mean of q·k, not the "
                "spread of the dot products. Return the std itself.",
                "returned the standard error std / sqrt(n_samples)"): math.sqrt(d_k / n),
        Mistake("returned-mean-abs",
                "your result is about 0.8 sqrt(d_k): the mean of |q·k| (sqrt(2/pi) times the std), not the standard "
                "deviation. Return .std() of the dot products.",
                "returned the mean of |q·k|, not its std"): math.sqrt(2 / math.pi) * math.sqrt(d_k),
    }


_NEGATIVE = Mistake(
    "negative-result",
    "a standard deviation is never negative, and your function returned a negative number: it returns something "
    "else than the std (the mean of the dot products, for one, is about 0 and often negative). Return "
    ".std() of the n_samples dot products.",
    "returned a negative number (not a standard deviation)")


def _value_mistake(values: dict[int, float]) -> str:
    """The known wrong value that every measured value (d_k -> value) agrees with, or ''."""
    found = {}
    for d_k, n, _ in _VALUE_CASES:
        v = values.get(d_k)
        if v is None or v <= 0:
            return ""
        for hint, w in _std_mistakes(d_k, n).items():
            # summing over the samples leaves d_k sums to take the std of: its own estimate is that noisy
            tol = max(_MISTAKE_TOL, 4 / math.sqrt(2 * d_k)) if hint.slug == "summed-over-samples" else _MISTAKE_TOL
            if abs(math.log(v / w)) < tol:
                found.setdefault(hint.slug, []).append(hint)
    for hits in found.values():
        if len(hits) == len(_VALUE_CASES):
            return hits[0]
    return ""


def _spread(t: Trial) -> None:
    """Fail unless the results over many seeds vary as much as n_samples pairs make them vary."""
    __tracebackhide__ = True
    seeds = list(_SPREAD_SEEDS)
    # Fixed seeds, not salted: a statistical test must not fail a right answer at random; the
    # graded values themselves come from salted seeds (_call_watched), so no table can pass.
    results, _ = t.call_watched(watchers.seeds, (_SPREAD_D, _SPREAD_N), seeds,
                                case=f"d_k={_SPREAD_D}, n_samples={_SPREAD_N}, generators seeded {seeds[0]}..{seeds[-1]}")
    if type(results) is not list or len(results) != len(seeds):
        t.fail(f"calling your function once per seed gave {describe(results)}.")
    values = [_value(t, r, f"with the generator seeded {s}, your function") for s, r in zip(seeds, results)]
    negative = [(s, v) for s, v in zip(seeds, values) if v < 0]
    if negative:
        t.fail(f"with the generator seeded {negative[0][0]}, your function returned {negative[0][1]:.4g} (and "
               f"{len(negative) - 1} more negative results over {len(seeds)} seeds): a standard deviation is never "
               "negative.", _NEGATIVE)
    y = torch.tensor(values, dtype=torch.float64) ** 2
    c = (y.var() / y.mean() ** 2).item()
    c0 = _cv2(_SPREAD_N, _SPREAD_D)
    ratio = c / c0
    if _SPREAD_BAND[0] <= ratio <= _SPREAD_BAND[1]:
        return
    pairs = _pairs_for(c, _SPREAD_D) if c > 0 else math.inf
    head = (f"over {len(seeds)} seeds your results vary from seed to seed as if each used about {pairs:.0f} (q, k) "
            f"pairs, not n_samples = {_SPREAD_N} (Var(result^2) / mean(result^2)^2 = {c:.3f}; {_SPREAD_N} pairs give "
            f"{c0:.3f}, accepted {c0 * _SPREAD_BAND[0]:.3f}..{c0 * _SPREAD_BAND[1]:.3f}).")
    if ratio < _SPREAD_BAND[0]:
        t.fail(head, _TOO_MANY_PAIRS)
    t.fail(head, _TOO_FEW_PAIRS)


@exercise()
def dot_product_std(t: Trial) -> None:
    expected = {d_k: math.sqrt(d_k) for d_k, _, _ in _VALUE_CASES}
    values, cases = {}, {}
    for i, (d_k, n, seed) in enumerate(_VALUE_CASES):
        got, changed, used, g_after = _call_watched(t, d_k, n, seed)
        value = _value(t, got)
        # `changed`, `used` and the generators' states are observations (watchers.rng): failures decided
        # from them are t.fail_observed, notes for a grader when `make grade` grades.
        if changed:
            # Reseeding the global RNG makes the result independent of the global state before the call.
            again, _, _, _ = _call_watched(t, d_k, n, seed, global_state=seeded(12345).get_state())
            if _value(t, again) == value:
                t.fail_observed("your function reseeded torch's global random number generator.",
                                _RESEEDED_GLOBAL)
            else:
                t.fail_observed("your function drew from torch's global random number generator, so the seed the "
                                "caller put in `generator` does not control the result.",
                                _USED_GLOBAL)
        if not used:
            if value == expected[d_k]:
                t.fail_observed(f"you returned sqrt(d_k) = {expected[d_k]:g} exactly: the theoretical value, not a "
                                "measurement.", _RETURNED_THEORY)
            else:
                t.fail_observed("your function never drew from the generator it was given.", _IGNORED_GENERATOR)
        if i == 0:
            # Same seed -> same result; another seed -> another result.
            again, _, _, g_again = _call_watched(t, d_k, n, seed)
            if _value(t, again) != value:
                seeds = {_initial_seed(g_after), _initial_seed(g_again)}
                if len(seeds) == 2 and salted(seed) not in seeds:
                    t.fail_observed("two generators seeded alike gave different results, and your function left "
                                    "them with two other initial seeds than the one they were given: it reseeds "
                                    "the generator.", _RESEEDED_AT_RANDOM)
                t.fail(f"two generators seeded alike gave different results ({value!r} and {_value(t, again)!r}).",
                       _NOT_REPRODUCIBLE)
            other, _, _, g_other = _call_watched(t, d_k, n, seed + 1)
            if _value(t, other) == value:
                if _equal(g_after, g_other):
                    t.fail_observed("generators with different seeds gave the same result, and ended in the same "
                                    "state: your function reseeds the generator it is given.",
                                    _RESEEDED_GENERATOR)
                t.fail("generators with different seeds gave the same result: it does not depend on the numbers "
                       "drawn.", recipe=_RECIPE)
        values[d_k], cases[d_k] = value, t.case
    # A known wrong value is named only if every case gives it (one value can coincide by chance).
    matched = _value_mistake(values)
    spread = False
    for d_k, n, _ in _VALUE_CASES:
        t.case = cases[d_k]
        value, tol = values[d_k], _rel_tol(d_k, n)
        if value < 0:
            t.fail(f"your function returned {value:.4g}: a standard deviation is never negative.", _NEGATIVE)
        # An unrecognised value: is the number of samples the cause? A standard error: |mean of q·k| is
        # that size too, by chance, but the mean is negative for some seeds.
        unrecognised = not matched and not _isclose_num(value, expected[d_k], rel_tol=tol)
        if not spread and (unrecognised or matched and matched.slug == "returned-standard-error"):
            _spread(t)
            spread, t.case = True, cases[d_k]
        t.number(value, expected[d_k], rel=tol, diagnosis=matched, hint=_RECIPE,
                 what=f"std of q·k (accepted within ±{100 * tol:.1f}%, {_N_SE:g} standard errors)")
    if not spread:
        _spread(t)
