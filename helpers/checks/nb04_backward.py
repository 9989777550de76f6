"""Checks for notebook 04_backward (its exercises: helpers/registry.py)."""

from __future__ import annotations

import math

import torch

from .. import nb01_qkv_shapes as att
from .. import nb04_backward as ref
from ..registry import in_module
from . import watchers
from .core import Trial, describe_case, eager_mistakes, exercise, seeded
from .feedback import Mistake
from .guard import _allclose, _isclose, _isfinite
from .instruments import warm_up
from .watchers import FORWARD_PASSES

__all__ = in_module(__name__)  # its exercises' checks, as helpers/registry.py lists them


# --------------------------------------------------------------------------- 4.1


def _refuse_numpy(t: Trial, got, what: str) -> None:
    """Name a NumPy array returned where a tensor is expected (computing in NumPy is the mistake)."""
    __tracebackhide__ = True
    if type(got).__module__ == "numpy" and type(got).__name__ == "ndarray":
        t.fail(f"{what}: your function returned a NumPy array (numpy.ndarray), not a torch.Tensor.",
               Mistake("returned-numpy-array", "compute with torch on the input tensor (torch.diag, "
                       "torch.outer, *, .sum(...)), or convert the NumPy result back at the end with "
                       "torch.from_numpy(result) in the input's dtype.",
                       "computed in NumPy and returned an ndarray instead of a tensor"))


def _jacobian_mistakes(s: torch.Tensor) -> dict:
    n = s.shape[-1]
    outer = s[:, None] * s[None, :]
    eye = torch.eye(n, dtype=s.dtype)
    return {
        Mistake("diagonal-only",
                "you kept only the diagonal s_i (1 - s_i). The off-diagonal entries d s_i / d z_j "
                "= -s_i s_j are not zero: all outputs share one denominator, so every logit moves "
                "every output."): lambda: torch.diag(s * (1 - s)),
        Mistake("diagonal-as-vector",
                "you returned the diagonal s_i (1 - s_i) as a vector [n]: J is the [n, n] matrix "
                "diag(s) - s s^T, and its off-diagonal entries -s_i s_j are not zero."):
            lambda: s * (1 - s),
        Mistake("missing-outer-product",
                "you returned diag(s): subtract the outer product s s^T (torch.outer(s, s))."):
            lambda: torch.diag(s),
        Mistake("plus-outer-product",
                "wrong sign on the outer product: J = diag(s) - s s^T (off-diagonal entries -s_i "
                "s_j are negative)."): lambda: torch.diag(s) + outer,
        Mistake("flipped-sign",
                "the whole sign is flipped: J = diag(s) - s s^T, not s s^T - diag(s)."):
            lambda: outer - torch.diag(s),
        Mistake("missing-diag-s", "you dropped diag(s): J = diag(s) - s s^T."): lambda: -outer,
        Mistake("identity-not-diag-s",
                "the diagonal term is s_i delta_ij, diag(s), not the identity: J = diag(s) - s "
                "s^T (J[i, j] = s_i (delta_ij - s_j), and s_i multiplies the delta too).",
                "used the identity instead of diag(s) (eye - s s^T)"): lambda: eye - outer,
        Mistake("missing-factor-s_i",
                "the factor s_i is missing: J[i, j] = s_i (delta_ij - s_j), not delta_ij - s_j; "
                "in matrix form diag(s) - s s^T."): lambda: eye - s[None, :],
        Mistake("minus-s-not-outer",
                "the subtracted term is the outer product s_i s_j (torch.outer(s, s)), not s_j: "
                "diag(s) - s broadcasts the vector s into every row.",
                "subtracted the vector s (diag(s) - s) instead of the outer product"):
            lambda: torch.diag(s) - s[None, :],
        Mistake("one-minus-s_j-everywhere",
                "you used s_i (1 - s_j) for every entry: the 1 is delta_ij, 1 on the diagonal "
                "only, so J[i, j] = s_i (delta_ij - s_j) = diag(s) - s s^T."):
            lambda: s[:, None] * (1 - s[None, :]),
        Mistake("dot-not-outer",
                "s @ s.T on a 1-D tensor is the dot product sum(s_i^2), a number, not the outer "
                "product: use torch.outer(s, s) or s[:, None] * s[None, :].",
                "subtracted s @ s.T, the dot product of a 1-D s, instead of the outer product"):
            lambda: torch.diag(s) - s @ s,
        Mistake("s-times-s.T",
                "s * s.T on a 1-D tensor is s_j^2 elementwise (.T leaves a 1-D tensor as it is), "
                "broadcast into every row; the outer product is torch.outer(s, s) or s[:, None] * "
                "s[None, :].",
                "subtracted s * s.T (elementwise on a 1-D s) instead of the outer product"):
            lambda: torch.diag(s) - s * s,
        Mistake("outer-uses-s_i-twice",
                "the subtracted term uses s_i twice, s_i * s_i in every column of row i (s[:, None] "
                "* s[:, None]): the outer product pairs row i with column j, s_i * s_j = s[:, None] "
                "* s[None, :] (torch.outer(s, s)).",
                "subtracted s_i^2 (s[:, None] twice) instead of the outer product s_i s_j"):
            lambda: torch.diag(s) - (s * s)[:, None].expand(n, n),
        Mistake("subtracted-s_i-times-1-minus-s_j",
                "you subtracted s_i (1 - s_j) (torch.outer(s, 1 - s)) from diag(s): the term "
                "subtracted is s_i s_j, torch.outer(s, s), so that J[i, j] = s_i (delta_ij - s_j).",
                "subtracted torch.outer(s, 1 - s) instead of torch.outer(s, s)"):
            lambda: torch.diag(s) - torch.outer(s, 1 - s),
        Mistake("subtracted-s_i-times-1-minus-s_j",
                "you subtracted (1 - s_i) s_j (torch.outer(1 - s, s)) from diag(s): the term "
                "subtracted is s_i s_j, torch.outer(s, s), so that J[i, j] = s_i (delta_ij - s_j).",
                "subtracted torch.outer(1 - s, s) instead of torch.outer(s, s)"):
            lambda: torch.diag(s) - torch.outer(1 - s, s),
        Mistake("softmax-applied-again",
                "s is already the softmax output (probabilities): do not apply softmax to it "
                "again.",
                "applied softmax again to s, which is already the softmax output"):
            lambda: ref.softmax_jacobian(torch.softmax(s, -1)),
    }


def _jacobian_terms_diagnosis(got, s: torch.Tensor) -> str:
    """The mistake of a ``got`` that is a diag(s) + b s s^T + c I with other coefficients than (1, -1, 0)
    (its hint names them), else ""."""
    n = s.shape[-1]
    if not (isinstance(got, torch.Tensor) and got.shape == (n, n) and got.is_floating_point() and n >= 3):
        return ""
    s64 = s.double()
    terms = {"diag(s)": torch.diag(s64), "s s^T": torch.outer(s64, s64), "I": torch.eye(n, dtype=torch.float64)}
    a = torch.stack([t.flatten() for t in terms.values()], dim=1)
    y = got.detach().double().flatten()
    if not bool(_isfinite(y).all()):
        return ""
    coef = torch.linalg.lstsq(a, y[:, None]).solution.flatten()
    if not bool(_allclose(a @ coef, y, atol=1e-5, rtol=1e-4)):
        return ""
    c = [round(float(x), 3) for x in coef]
    if c == [1.0, -1.0, 0.0]:
        return ""
    parts = " ".join(f"{'+' if x >= 0 else '-'} {abs(x):g} {name}" for x, name in zip(c, terms) if x != 0)
    return Mistake("jacobian-term-coefficients", f"your J is {parts.lstrip('+ ')}: J = diag(s) - s s^T, "
                   "exactly one diag(s) and minus one outer product (no identity, no other factor).",
                   "J is a combination of diag(s), s s^T and I with the wrong coefficients")


@exercise()
def softmax_jacobian(t: Trial) -> None:
    t.error_hints = {
        r"cannot be multiplied|size of tensor|mismatch": Mistake(
            "outer-product-shapes",
            "for a vector s of length n, the outer product is torch.outer(s, s) ([n, n]).",
            "formed the outer product from shapes that do not fit"),
    }
    # the dimensions appendix's worked example (README, Sources), whose J notebook 04 works out by hand
    cases = [torch.tensor([0.7, 0.2, 0.1])]
    # float64 and float16 too: J keeps s's dtype (a float32 torch.eye(n) or torch.zeros(n, n) would turn
    # a float16 s into float32; float64 wins over a float32 factor, so float64 alone does not show it)
    for seed, (n, dtype) in enumerate([(5, torch.float64), (7, torch.float32), (4, torch.float32), (6, torch.float16)]):
        made = torch.float32 if dtype == torch.float16 else dtype
        cases.append(torch.softmax(1.5 * torch.randn(n, generator=seeded(400 + seed), dtype=made), dim=-1).to(dtype))
    # the expected J in float64, rounded to s's dtype once; float16 rounds s_i s_j (|J| <= 1/4) to 2^-13 or so
    cases = [(s, ref.softmax_jacobian(s.double()).to(s.dtype), eager_mistakes(_jacobian_mistakes(s)),
              dict(atol=1e-3, rtol=1e-2) if s.dtype == torch.float16 else {}) for s in cases]
    for s, expected, mistakes, tol in cases:
        got = t.call(s, case=describe_case(s=s) + f" = {[round(x, 4) for x in s.tolist()]}")
        _refuse_numpy(t, got, "J")
        t.tensor(got, expected, what="J", mistakes=mistakes, diagnosis=_jacobian_terms_diagnosis(got, s),
                 hint="J = torch.diag(s) - torch.outer(s, s): J[i, j] = s_i (delta_ij - s_j).", **tol)


# --------------------------------------------------------------------------- 4.2


def _softmax_backward_mistakes(p: torch.Tensor, g: torch.Tensor) -> dict:
    pg = p * g
    return {
        Mistake("missing-subtraction",
                "you dropped the subtraction: J @ g = p * g - p * sum(p * g). The second term "
                "comes from the off-diagonal -p_i p_j of the Jacobian."): lambda: pg,
        Mistake("sum-over-wrong-axis",
                "you summed over the wrong axis: the sum runs over the softmax axis, the last one "
                "(dim=-1, keepdim=True), one sum per row.",
                "summed p * grad_p over the wrong axis (not dim=-1)"):
            lambda: p * (g - pg.sum(dim=-2, keepdim=True)),
        Mistake("sum-over-wrong-axis",
                "you summed over the wrong axis (dim=0): the sum runs over the softmax axis, the "
                "last one (dim=-1, keepdim=True), one sum per row.",
                "summed p * grad_p over the wrong axis (not dim=-1)"):
            lambda: p * (g - pg.sum(dim=0, keepdim=True)),
        Mistake("summed-all-entries",
                "you summed over every entry: the sum is per row, over the last axis only "
                "(dim=-1, keepdim=True)."): lambda: p * (g - pg.sum()),
        Mistake("missing-keepdim",
                "add keepdim=True to the row sum: without it the [..., n] -> [...] sums broadcast "
                "along the wrong axis.",
                "row sum without keepdim=True, so it broadcasts along the wrong axis"):
            lambda: p * (g - pg.sum(dim=-1)),
        Mistake("unweighted-sum",
                "the sum is weighted by p: sum(p * grad_p), the average of grad_p under the "
                "distribution p.",
                "summed grad_p without weighting it by p"):
            lambda: p * (g - g.sum(dim=-1, keepdim=True)),
        Mistake("missing-factor-p", "multiply by p: the result is p * (grad_p - sum(p * grad_p)).",
                "forgot the factor p in front: grad_p - sum(p * grad_p)"):
            lambda: g - pg.sum(dim=-1, keepdim=True),
        Mistake("mean-not-sum", "use the sum of p * grad_p over the row, not its mean.",
                "used the mean of p * grad_p over the row instead of its sum"):
            lambda: p * (g - pg.mean(dim=-1, keepdim=True)),
        Mistake("flipped-sign",
                "the sign is flipped: p * (grad_p - sum(p * grad_p)), not p * (sum(p * grad_p) - "
                "grad_p)."): lambda: p * (pg.sum(dim=-1, keepdim=True) - g),
        Mistake("rowsum-not-times-p",
                "the subtracted row sum must be multiplied by p too: p * grad_p - p * sum(p * "
                "grad_p), i.e. p * (grad_p - sum(p * grad_p))."):
            lambda: pg - pg.sum(dim=-1, keepdim=True),
        Mistake("centred-on-plain-mean",
                "centre grad_p on its p-weighted mean, sum(p * grad_p) over the row, not on its "
                "plain mean: p * (grad_p - (p * grad_p).sum(dim=-1, keepdim=True)).",
                "centred grad_p on its plain mean instead of its p-weighted mean"):
            lambda: p * (g - g.mean(dim=-1, keepdim=True)),
        Mistake("log-softmax-backward",
                "grad_p - p * sum(grad_p) is the backward of log-softmax: for softmax the result is "
                "p * (grad_p - sum(p * grad_p)), weighted by p twice (in front, and inside the row sum).",
                "used the log-softmax backward, grad_p - p * sum(grad_p)"):
            lambda: g - p * g.sum(dim=-1, keepdim=True),
        Mistake("jacobian-diagonal-only",
                "you used only the diagonal of the Jacobian, p_i (1 - p_i): the off-diagonal -p_i "
                "p_j terms give p * (grad_p - sum(p * grad_p)), a sum over the whole row."):
            lambda: p * (1 - p) * g,
    }


def _row_term_diagnosis(got, p: torch.Tensor, g: torch.Tensor) -> str:
    """The mistake of a ``got`` of the right form p * (grad_p - c), one number c per row, with a wrong c
    (a multiple of sum(p * grad_p), or another number), else ""."""
    if not (isinstance(got, torch.Tensor) and got.shape == p.shape and got.is_floating_point()):
        return ""
    got, p64, g64 = got.detach().double(), p.double(), g.double()
    if not bool(_isfinite(got).all()):
        return ""
    kept = p64 > 1e-4
    if bool((got[~kept].abs() > 1e-5).any()):  # where p is 0 the form gives 0
        return ""
    rows_p, rows_g, rows_got, rows_kept = (x.reshape(-1, p.shape[-1]) for x in (p64, g64, got, kept))
    if int((rows_kept.sum(-1) >= 2).sum()) * 2 < rows_p.shape[0] or not bool(rows_kept.any(-1).all()):
        return ""
    c = torch.where(rows_kept, rows_g - rows_got / rows_p.clamp_min(1e-300), torch.nan)
    lo, hi = c.nan_to_num(float("inf")).amin(-1), c.nan_to_num(float("-inf")).amax(-1)
    if not bool(((hi - lo) <= 1e-4 * (1 + lo.abs())).all()):
        return ""  # not one number per row
    c_row = torch.nanmean(c, dim=-1)
    right = (rows_p * rows_g).sum(-1)
    if bool(_isclose(c_row, right, atol=1e-5, rtol=1e-4).all()):
        return ""
    ratio = c_row / right
    usable = right.abs() > 1e-3
    if bool(usable.sum() >= 2) and bool(((ratio[usable] - ratio[usable][0]).abs() < 1e-3 * (1 + ratio[usable][0].abs())).all()):
        k = float(ratio[usable][0])
        return Mistake("row-term-scaled", f"your result has the right form p * (grad_p - c), one number c "
                       f"per row, but your c is {k:.4g} times sum(p * grad_p): c is exactly the row's "
                       "(p * grad_p).sum(dim=-1, keepdim=True), with no extra factor or division.",
                       "the row sum subtracted in p * (grad_p - c) is a multiple of sum(p * grad_p)")
    return Mistake("wrong-row-term", "your result has the right form p * (grad_p - c), one number c per "
                   f"row, but c is not sum(p * grad_p) over that row (row 0: your c = {float(c_row[0]):.4g}, "
                   f"sum(p * grad_p) = {float(right[0]):.4g}): c is the dot product of the same row of p and "
                   "of grad_p, (p * grad_p).sum(dim=-1, keepdim=True).",
                   "the number subtracted per row in p * (grad_p - c) is not sum(p * grad_p)")


@exercise()
def softmax_backward(t: Trial) -> None:
    t.error_hints = {
        r"must match the size|size of tensor": Mistake(
            "missing-keepdim",
            "the row sum needs keepdim=True, so that the [..., 1] sums broadcast against [..., n].",
            "row sum without keepdim=True, so it broadcasts along the wrong axis"),
    }
    # (shape, dtype, causal-masked p): leading dims differ from n; a square [6, 6] case makes a
    # missing keepdim broadcast silently (and wrongly) instead of raising; masked rows hold zeros.
    cases = []
    for seed, (shape, dtype, masked) in enumerate([((2, 3, 5), torch.float32, False), ((4, 7), torch.float64, False),
                                                   ((6, 6), torch.float32, True), ((8,), torch.float64, False)]):
        g = seeded(420 + seed)
        scores = 2.0 * torch.randn(*shape, generator=g, dtype=dtype)
        p = att.masked_softmax(scores, att.causal_mask(shape[-1]) if masked else None)
        grad_p = torch.randn(*shape, generator=g, dtype=dtype)
        cases.append((p, grad_p, masked, ref.softmax_backward(p, grad_p), eager_mistakes(_softmax_backward_mistakes(p, grad_p))))
    for p, grad_p, masked, expected, mistakes in cases:
        got = t.call(p, grad_p, case=describe_case(p=p, grad_p=grad_p) + (" (p causally masked: zeros above the diagonal)" if masked else ""))
        _refuse_numpy(t, got, "grad of the scores")
        t.tensor(got, expected, what="grad of the scores", mistakes=mistakes,
                 diagnosis=_row_term_diagnosis(got, p, grad_p),
                 hint="p * (grad_p - (p * grad_p).sum(dim=-1, keepdim=True))")


# --------------------------------------------------------------------------- 4.3

_FORMULAS = ("P = softmax(q k^T / sqrt(d_k)) with the causal mask when causal, dV = P^T dO, dP = dO v^T, "
             "dS = P * (dP - rowsum(P * dP)), dQ = dS k / sqrt(d_k), dK = dS^T q / sqrt(d_k)")
_BY_HAND = f"this exercise asks for the gradients by hand ({_FORMULAS}); autograd is what the check compares against."
_USED_AUTOGRAD = Mistake("used-autograd", _BY_HAND,
                         "used automatic differentiation instead of the backward formulas")
_FINITE_DIFFERENCES = Mistake(
    "finite-differences", _BY_HAND,
    "took numerical gradients from many forward passes (finite differences)")
_WRONG_ORDER = Mistake(
    "grads-in-wrong-order",
    "the gradients are returned in the wrong order: return (grad_q, grad_k, grad_v), the order of "
    "the inputs q, k, v.")


def _autograd_grads(q, k, v, grad_out, causal):
    """The ground truth: autograd through helpers.nb01_qkv_shapes's forward."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    with torch.enable_grad():
        allowed = att.causal_mask(q.shape[-2]) if causal else None
        out = att.scaled_dot_product_attention(q, k, v, allowed)
        return torch.autograd.grad(out, (q, k, v), grad_out)


def _grads_from(q, k, dO, p, ds):
    """(grad_q, grad_k, grad_v) from P and dS, the rest of the derivation done right."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    return ds @ k * scale, ds.mT @ q * scale, p.mT @ dO


def _p_ds(q, k, v, dO, allowed, sum_dim=-1, subtract=True, weighted=True, p=None, dp_transposed=False):
    """P and dS, with the softmax backward's row sum over ``sum_dim`` (or no subtraction, or a row sum
    of dP not weighted by P); ``p`` replaces the attention weights (a wrongly masked P);
    ``dp_transposed``: dP = v @ dO^T, the transpose of dO v^T."""
    p = att.attention_weights(q, k, allowed) if p is None else p
    dp = v @ dO.mT if dp_transposed else dO @ v.mT
    if not subtract:
        return p, p * dp
    return p, p * (dp - ((p * dp) if weighted else dp).sum(dim=sum_dim, keepdim=True))


def _attention_mistakes(q, k, v, dO, causal) -> dict:
    """hint -> (grad_q, grad_k, grad_v) of a known wrong derivation."""
    T, scale = q.shape[-2], 1.0 / math.sqrt(q.shape[-1])
    tril = att.causal_mask(T)
    allowed = tril if causal else None
    p, ds = _p_ds(q, k, v, dO, allowed)
    good = _grads_from(q, k, dO, p, ds)
    mistakes = {
        Mistake("missing-scale",
                "grad_q and grad_k are sqrt(d_k) times too large: the forward divided the scores "
                "by sqrt(d_k), so the chain rule multiplies dS by 1/sqrt(d_k) before forming "
                "grad_q and grad_k."): (ds @ k, ds.mT @ q, good[2]),
        Mistake("scaled-twice",
                "you divided by sqrt(d_k) twice (by d_k): the scale enters once, dS / sqrt(d_k)."):
            (good[0] * scale, good[1] * scale, good[2]),
        Mistake("grad_k-without-transpose",
                "grad_k = dS^T @ q / sqrt(d_k): k enters the scores transposed (q k^T), so its "
                "gradient uses dS transposed (dS.transpose(-2, -1)).",
                "computed grad_k from dS instead of dS transposed"):
            (good[0], ds @ q * scale, good[2]),
        Mistake("grad_q-with-transposed-dS",
                "grad_q = dS @ k / sqrt(d_k), without transposing dS (dS^T @ ... is the key's "
                "formula).",
                "computed grad_q from dS transposed instead of dS"):
            (ds.mT @ k * scale, good[1], good[2]),
        Mistake("grad_v-without-transpose",
                "grad_v = P^T @ grad_out: value j collects gradient from every query that "
                "attended to it, which is column j of P, so transpose P.",
                "computed grad_v as P @ grad_out instead of P^T @ grad_out"):
            (good[0], good[1], p @ dO),
        Mistake("missing-subtraction",
                "the softmax backward lost its subtraction: dS = P * (dP - rowsum(P * dP)), with "
                "the row sum over the keys (dim=-1, keepdim=True)."):
            _grads_from(q, k, dO, *_p_ds(q, k, v, dO, allowed, subtract=False)),
        Mistake("rowsum-over-queries",
                "the row sum in the softmax backward runs over the keys, dim=-1 (one sum per "
                "query row), not dim=-2.",
                "summed over the queries (dim=-2) in the softmax backward"):
            _grads_from(q, k, dO, *_p_ds(q, k, v, dO, allowed, sum_dim=-2)),
        Mistake("unweighted-rowsum",
                "the row sum in the softmax backward is weighted by P: dS = P * (dP - rowsum(P * "
                "dP)), not P * (dP - rowsum(dP)).",
                "the softmax backward's row sum of dP is not weighted by P"):
            _grads_from(q, k, dO, *_p_ds(q, k, v, dO, allowed, weighted=False)),
    }
    mistakes[Mistake("rowsum-is-a-mean",
                     "the row sum in dS = P * (dP - rowsum(P * dP)) is a sum over the keys, not a mean: "
                     "(P * dP).sum(dim=-1, keepdim=True).", "took the mean of P * dP over the keys instead of its sum")] = (
        _grads_from(q, k, dO, p, p * ((dO @ v.mT) - (p * (dO @ v.mT)).mean(-1, keepdim=True))))
    mistakes[Mistake("D-from-v",
                     "the row sum subtracted in dS is rowsum(P * dP) = rowsum(grad_out * out), with the "
                     "attention output out = P @ v: yours is rowsum(grad_out * v), v itself.",
                     "subtracted rowsum(grad_out * v) instead of rowsum(grad_out * out)")] = (
        _grads_from(q, k, dO, p, p * (dO @ v.mT - (dO * v).sum(-1, keepdim=True))))
    mistakes[Mistake("grad_k-from-k",
                     "grad_k = dS^T @ q / sqrt(d_k): the gradient of k pairs dS^T with the queries, "
                     "not with k itself.", "computed grad_k from k instead of q")] = (
        good[0], ds.mT @ k * scale, good[2])
    mistakes[Mistake("grad_q-from-q",
                     "grad_q = dS @ k / sqrt(d_k): the gradient of q pairs dS with the keys, not with q "
                     "itself.", "computed grad_q from q instead of k")] = (
        ds @ q * scale, good[1], good[2])
    mistakes[Mistake("dP-transposed",
                     "dP = grad_out @ v^T (dP[i, j] = dO_i . v_j, query i, key j); yours is its "
                     "transpose, v @ grad_out^T: transpose the other factor, not the product.",
                     "computed dP as v @ grad_out^T, the transpose of grad_out @ v^T")] = (
        _grads_from(q, k, dO, *_p_ds(q, k, v, dO, allowed, dp_transposed=True)))
    # One gradient without its 1/sqrt(d_k) (the other one right).
    mistakes[Mistake("missing-scale",
                     "grad_q is sqrt(d_k) times too large: the forward divided the "
                     "scores by sqrt(d_k), so grad_q = dS @ k / sqrt(d_k), like grad_k.")] = (
        ds @ k, good[1], good[2])
    mistakes[Mistake("missing-scale",
                     "grad_k is sqrt(d_k) times too large: the forward divided the "
                     "scores by sqrt(d_k), so grad_k = dS^T @ q / sqrt(d_k), like grad_q.")] = (
        good[0], ds.mT @ q, good[2])
    # The scale of the scores, by property: P recomputed with another scale, and/or grad_q and grad_k
    # multiplied by another factor than 1/sqrt(d_k) (d_k = q.shape[-1], d_v = v.shape[-1]).
    d_k, d_v = q.shape[-1], v.shape[-1]
    factors = {"1/sqrt(d_k)": scale, "1 (no scale)": 1.0, "1/d_k": 1.0 / d_k, "1/sqrt(d_v)": 1 / math.sqrt(d_v),
               "1/d_v": 1.0 / d_v, "sqrt(d_k)": math.sqrt(d_k)}
    for f_name, f in factors.items():
        for b_name, b in factors.items():
            if f_name == b_name == "1/sqrt(d_k)":
                continue
            if f_name == "1/sqrt(d_k)" and b_name in ("1 (no scale)", "1/d_k", "1/sqrt(d_v)"):
                continue  # missing-scale and scaled-twice above, scaled-by-sqrt-d_v below
            s_f = att.scaled_scores(q, k) * (f / scale)
            p_f = torch.softmax(s_f.masked_fill(~tril, float("-inf")) if causal else s_f, dim=-1)
            _, ds_f = _p_ds(q, k, v, dO, None, p=p_f)
            where_p = ("P is right" if f_name == "1/sqrt(d_k)" else
                       f"P was computed from q k^T times {f_name}")
            where_g = ("grad_q and grad_k carry the right factor" if b_name == "1/sqrt(d_k)" else
                       f"grad_q and grad_k were multiplied by {b_name}")
            hint = (f"the scale of the scores is wrong: {where_p}, and {where_g}. The scale is 1/sqrt(d_k), "
                    "d_k = q.shape[-1] (the query/key width, not v's): P = softmax(q k^T / sqrt(d_k)) and "
                    "grad_q = dS @ k / sqrt(d_k), grad_k = dS^T @ q / sqrt(d_k).")
            slug_hint = Mistake("scaled-by-sqrt-d_v", hint, "used another scale than 1/sqrt(d_k) (in P or in the "
                                "gradients)") if "d_v" in f_name + b_name else Mistake(
                "wrong-score-scale", hint, "used another scale than 1/sqrt(d_k) (in P or in the gradients)")
            mistakes[slug_hint] = (ds_f @ k * b, ds_f.mT @ q * b, p_f.mT @ dO)
    if q.shape[-1] != v.shape[-1]:
        c_v = math.sqrt(v.shape[-1]) * scale  # turns a 1/sqrt(d_k) into a 1/sqrt(d_v)
        by_d_v = Mistake(
            "scaled-by-sqrt-d_v",
            "the scale is 1/sqrt(d_k), the query/key width q.shape[-1], not 1/sqrt(d_v), the value "
            "width.",
            "scaled by 1/sqrt(d_v), the value width, instead of 1/sqrt(d_k)")
        mistakes[by_d_v] = (good[0] / c_v, good[1] / c_v, good[2])
    if causal:
        s = att.scaled_scores(q, k)
        zeroed = torch.softmax(s, dim=-1) * tril
        after = Mistake(
            "masked-after-softmax",
            "you zeroed the future weights after the softmax, so the rows of P no longer sum to 1: "
            "mask the scores before it (masked_fill with -inf where key j > query i), then "
            "softmax.")
        mistakes[after] = _grads_from(q, k, dO, *_p_ds(q, k, v, dO, None, p=zeroed))
        zero_fill = Mistake(
            "mask-fills-zero",
            "the future scores were set to 0, and exp(0) still gives them weight: fill them with "
            "-inf (or a very negative number) before the softmax.")
        filled = torch.softmax(s.masked_fill(~tril, 0.0), dim=-1)
        mistakes[zero_fill] = _grads_from(q, k, dO, *_p_ds(q, k, v, dO, None, p=filled))
        ignored = Mistake(
            "ignored-causal",
            "causal=True: recompute P with the causal mask (query i sees keys j <= i). Without it "
            "P puts weight on future keys, and the gradients are those of bidirectional attention.",
            "ignored causal=True: computed P without the causal mask")
        mistakes[ignored] = _grads_from(q, k, dO, *_p_ds(q, k, v, dO, None))
        mistakes[Mistake(
            "grad_v-from-unmasked-P",
            "grad_v used P without the causal mask: recompute P with the "
            "causal mask for grad_v = P^T @ grad_out too (the same P as in dS).",
            "grad_v computed from a P without the causal mask")] = (
            good[0], good[1], att.attention_weights(q, k, None).mT @ dO)
        for shift in (1, 2):
            ahead = torch.ones(T, T, dtype=torch.bool).tril(shift)
            mistakes[Mistake(
                "mask-lets-in-next-keys",
                f"your causal mask lets query i see key{'s' if shift > 1 else ''} "
                f"{'i + 1' if shift == 1 else 'i + 1 and i + 2'} too (like tril(diagonal={shift})): keep keys "
                "j <= i only, torch.ones(T, T, dtype=torch.bool).tril() (diagonal=0).",
                "the causal mask lets each query see keys after it")] = (
                _grads_from(q, k, dO, *_p_ds(q, k, v, dO, ahead)))
        mistakes[Mistake(
            "mask-inverted",
            "your mask hides the allowed keys and keeps the future ones (j > i): masked_fill puts -inf where "
            "its mask is True, so pass the blocked positions, ~allowed (key j > query i), not the allowed "
            "ones.", "masked the allowed keys instead of the blocked ones")] = (
            _grads_from(q, k, dO, *_p_ds(q, k, v, dO, None, p=torch.softmax(
                att.scaled_scores(q, k).masked_fill(tril, float("-inf")), dim=-1))))  # the last row: NaN
        p_open = att.attention_weights(q, k, None)
        dp_open = dO @ v.mT
        ds_masked = (p_open * (dp_open - (p_open * dp_open).sum(-1, keepdim=True))).masked_fill(~tril, 0.0)
        mistakes[Mistake(
            "mask-on-dS-only",
            "P was recomputed without the causal mask and only dS was masked afterwards: the mask belongs "
            "in P itself (scores -inf where key j > query i, then softmax), so that dV, dP's row sum and "
            "dS all use the causal P.", "masked dS afterwards instead of recomputing P with the mask")] = (
            ds_masked @ k * scale, ds_masked.mT @ q * scale, p_open.mT @ dO)
        triu = torch.ones(T, T, dtype=torch.bool).triu()
        upper = Mistake(
            "upper-triangle-mask",
            "your mask lets query i see keys j >= i (the future): True = may attend, on and below "
            "the diagonal (torch.ones(T, T, dtype=torch.bool).tril()).")
        mistakes[upper] = _grads_from(q, k, dO, *_p_ds(q, k, v, dO, triu))
    else:
        masked = Mistake("masked-when-not-causal",
                         "causal=False here: no mask; every query sees every key.",
                         "applied the causal mask although causal=False")
        mistakes[masked] = _grads_from(q, k, dO, *_p_ds(q, k, v, dO, tril))
    return mistakes


def _weighed(models: dict, got, atol: float, rtol: float) -> dict:
    """``models`` (mistake -> its output on this comparison) as the core should weigh them against
    ``got`` at this comparison's own tolerance (the core matches at the looser of it and atol 1e-5, rtol
    1e-4; 9.1, 9.2 and 9.4 use this too): a model that fits ``got`` at (atol, rtol) becomes ``got``
    itself; one that does not, but that the core's tolerance would take for ``got``, becomes NaN (it is
    not what the learner did)."""
    if not (isinstance(got, torch.Tensor) and got.is_floating_point()):
        return dict(models)
    g = got.detach().double().cpu()
    out = {}
    for hint, m in models.items():
        if not (isinstance(m, torch.Tensor) and m.shape == got.shape and m.device == got.device):
            out[hint] = m
            continue
        w = m.detach().double().cpu()
        if bool(_isclose(g, w, atol=atol, rtol=rtol, equal_nan=True).all()):
            out[hint] = got
        elif bool(_isclose(g, w, atol=1e-5, rtol=1e-4, equal_nan=True).all()):
            out[hint] = torch.full_like(m, float("nan"))
        else:
            out[hint] = m
    return out


def _near(a, b) -> bool:
    """``a`` matches a mistake's model ``b`` (the tolerance the core matches mistakes with)."""
    return (isinstance(a, torch.Tensor) and a.shape == b.shape and a.is_floating_point()
            and _allclose(a.detach().double(), b.double(), atol=1e-5, rtol=1e-4, equal_nan=True))


def _close(a, b) -> bool:
    """``a`` is the gradient ``b`` (shape and dtype included) at this check's tolerance."""
    return isinstance(a, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype and _allclose(a, b, atol=1e-8, rtol=1e-6)


@exercise()
def attention_backward(t: Trial) -> None:
    t.error_hints = {
        r"saved tensor hooks|does not require grad|grad_fn|torch\.func|forward AD|dual":
            _USED_AUTOGRAD,
        r"cannot be multiplied|Expected size|must match the size|size of tensor|mismatch": Mistake(
            "matmul-shapes-do-not-fit",
            "check each product's shapes: dP = grad_out @ v^T ([T, d_v] @ [d_v, T]), grad_v = "
            "P^T @ grad_out, grad_q = dS @ k, grad_k = dS^T @ q. Transpose the last two axes with "
            ".transpose(-2, -1) (or .mT); .T reverses every axis.",
            "a product in the backward got shapes that do not fit"),
    }
    warm_up()
    # (leading dims, T, d_k, d_v, causal): T, d_k, d_v all different, so a missing transpose shows.
    cases = []
    for seed, (lead, T, d_k, d_v, causal) in enumerate([((2, 3), 5, 4, 6, False), ((2,), 7, 3, 5, True),
                                                        ((), 6, 8, 2, True), ((3, 2), 4, 6, 3, False)]):
        g = seeded(440 + seed)
        q = 1.5 * torch.randn(*lead, T, d_k, generator=g, dtype=torch.float64)
        k = 1.5 * torch.randn(*lead, T, d_k, generator=g, dtype=torch.float64)
        v = torch.randn(*lead, T, d_v, generator=g, dtype=torch.float64)
        grad_out = torch.randn(*lead, T, d_v, generator=g, dtype=torch.float64)
        expected = _autograd_grads(q, k, v, grad_out, causal)
        mistakes = _attention_mistakes(q, k, v, grad_out, causal)  # computed before the learner's function runs
        cases.append((q, k, v, grad_out, causal, expected, mistakes))
    names = ("grad_q", "grad_k", "grad_v")
    for q, k, v, grad_out, causal, expected, mistakes in cases:
        case = describe_case(q=q, k=k, v=v, grad_out=grad_out, causal=causal)
        got, seen = t.call_watched(watchers.backward, (q, k, v, grad_out, causal), case=case)
        # What watchers.backward saw decides these two only in a learner's session (t.fail_observed).
        if seen.get("autograd"):
            t.fail_observed(f"your function used automatic differentiation ({seen['autograd'][0]}) to get "
                            "the gradients.", _USED_AUTOGRAD)
        if seen.get("exp_work", 0) > FORWARD_PASSES * seen["p_numel"]:
            t.fail_observed(f"your function put more than {FORWARD_PASSES} forward passes' worth of numbers through "
                            f"exp or softmax ({seen['exp_work']:,}; one pass computes P, {seen['p_numel']:,} numbers), "
                            "and was stopped: gradients from many forward passes are numerical differentiation "
                            "(finite differences), not the backward formulas.", _FINITE_DIFFERENCES)
        got = t.tuple(got, 3, names)
        for i, j in [(i, j) for i in range(3) for j in range(3) if i != j]:
            if _close(got[i], expected[j]) and not _close(got[i], expected[i]):
                t.fail(f"your {names[i]} (item {i} of the tuple) holds {names[j]}.",
                       _WRONG_ORDER)
        # The core names a mistake whose model gives every gradient (each weighed at this check's
        # tolerance); failing that, the first one whose model fits this call where it differs from the
        # right gradients: each one it gets wrong is the learner's, and none the learner got right is
        # wrong in it.
        fits = [h for h, m in mistakes.items() if all(
            _allclose(m[i], expected[i]) or _near(got[i], m[i]) for i in range(3))]
        for i, name in enumerate(names):
            t.tensor(got[i], expected[i], what=f"{name} (compared with autograd in float64)",
                     mistakes=_weighed({h: m[i] for h, m in mistakes.items()}, got[i], atol=1e-8, rtol=1e-6),
                     diagnosis=next((h for h in fits if not _allclose(mistakes[h][i], expected[i])), ""),
                     hint=f"go through the derivation step by step: {_FORMULAS}.", atol=1e-8, rtol=1e-6)
