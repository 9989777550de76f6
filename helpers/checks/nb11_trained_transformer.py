"""Checks for notebook 11_trained_transformer (its exercises: helpers/registry.py).

Every case, its expected output and the outputs of the recognised mistakes are computed before
the learner's function runs. Shapes: D != F everywhere (a forgotten projection changes the shape);
B != T != V (a wrong reduction axis changes the value); L != H and T = 2m with m > 2 (the three
diagonals an induction score could be read from are distinct); non-symmetric [D, D] circuits with
Frobenius norms far from 1 (every product order, transpose and normalisation gives another score).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import nb11_trained_transformer as ref
from ..nb01_qkv_shapes import attention_weights
from ..nb03_masks import causal_mask
from ..registry import in_module
from .core import Trial, describe_case, eager_mistakes, exercise, seeded
from .feedback import Mistake, wrong_signature
from .guard import _isclose_num

__all__ = in_module(__name__)  # its exercises' checks, as helpers/registry.py lists them



# =========================================================================== 11.1 swiglu


def _swiglu_mistakes(x, w_gate, w_up, w_down) -> dict[str, torch.Tensor]:
    gate, up = x @ w_gate, x @ w_up
    gelu = "gated with GELU instead of SiLU"
    return eager_mistakes({
        Mistake("used-GELU", "you used GELU; SwiGLU gates with SiLU (Swish_1), silu(z) = z * "
                "sigmoid(z): F.silu. (GELU gives GeGLU.)", gelu):
            lambda: (F.gelu(gate) * up) @ w_down,
        Mistake("used-GELU", "you used GELU (tanh approximation); SwiGLU gates with SiLU, silu(z) "
                "= z * sigmoid(z): F.silu.", gelu):
            lambda: (F.gelu(gate, approximate="tanh") * up) @ w_down,
        Mistake("used-sigmoid", "you used a sigmoid: that is the original GLU. SwiGLU uses SiLU, "
                "silu(z) = z * sigmoid(z).", "gated with a sigmoid (GLU) instead of SiLU"):
            lambda: (torch.sigmoid(gate) * up) @ w_down,
        Mistake("used-ReLU", "you used ReLU (that is ReGLU); SwiGLU uses SiLU, silu(z) = z * "
                "sigmoid(z).", "gated with ReLU (ReGLU) instead of SiLU"):
            lambda: (F.relu(gate) * up) @ w_down,
        Mistake("SiLU-on-up-branch", "SiLU went on the wrong branch: it belongs on x @ w_gate (the "
                "gate), and x @ w_up stays linear."):
            lambda: (F.silu(up) * gate) @ w_down,
        Mistake("SiLU-on-product", "you applied SiLU to the product; apply it to the gate only, "
                "then multiply: silu(x @ w_gate) * (x @ w_up)."):
            lambda: F.silu(gate * up) @ w_down,
        Mistake("SiLU-on-both-branches", "you applied SiLU to both branches; only the gate x @ "
                "w_gate goes through SiLU."):
            lambda: (F.silu(gate) * F.silu(up)) @ w_down,
        Mistake("added-branches", "you added the branches; SwiGLU multiplies them elementwise: "
                "silu(x @ w_gate) * (x @ w_up)."):
            lambda: (F.silu(gate) + up) @ w_down,
        Mistake("missing-w_down", "the down projection is missing: multiply the gated hidden [..., "
                "F] by w_down to come back to [..., D]."):
            lambda: F.silu(gate) * up,
        Mistake("used-Mish", "you used Mish, z * tanh(softplus(z)); SwiGLU gates with SiLU, "
                "silu(z) = z * sigmoid(z): F.silu.", "gated with Mish instead of SiLU"):
            lambda: (F.mish(gate) * up) @ w_down,
        Mistake("swish-beta-2", "you used Swish with beta = 2, z * sigmoid(2z); SwiGLU's SiLU is "
                "Swish with beta = 1, z * sigmoid(z).",
                "gated with Swish beta = 2, z * sigmoid(2z), instead of SiLU"):
            lambda: (gate * torch.sigmoid(2 * gate) * up) @ w_down,
    })


_SWIGLU_RECIPE = "return (F.silu(x @ w_gate) * (x @ w_up)) @ w_down   (F = torch.nn.functional)"


def _swiglu_inputs():
    """(x, w_gate, w_up, w_down) with D != F; one case with F < D; one float64 case."""
    out = []
    for seed, (lead, D, F_, dtype) in enumerate([((2, 5), 6, 10, torch.float32), ((7,), 4, 12, torch.float32),
                                                 ((3,), 8, 5, torch.float64)]):
        g = seeded(1100 + seed)
        x = torch.randn(*lead, D, generator=g, dtype=dtype)
        w_gate = torch.randn(D, F_, generator=g, dtype=dtype) / math.sqrt(D)
        w_up = torch.randn(D, F_, generator=g, dtype=dtype) / math.sqrt(D)
        w_down = torch.randn(F_, D, generator=g, dtype=dtype) / math.sqrt(F_)
        out.append((x, w_gate, w_up, w_down))
    return out


@exercise()
def swiglu(t: Trial) -> None:
    t.error_hints = {
        r"cannot be multiplied|must match the size|size of tensor": Mistake(
            "weight-shapes-mismatch", "x is [..., D], w_gate and w_up are [D, F], w_down is [F, "
            "D]: x @ w_gate and x @ w_up are [..., F], and the gated product @ w_down is [..., D].",
            "multiplied by the weights in an order or layout whose shapes do not match"),
    }
    planned = [(c, ref.swiglu(*c), _swiglu_mistakes(*c)) for c in _swiglu_inputs()]
    for (x, w_gate, w_up, w_down), expected, mistakes in planned:
        got = t.call(x, w_gate, w_up, w_down, case=describe_case(x=x, w_gate=w_gate, w_up=w_up, w_down=w_down))
        t.tensor(got, expected, what="output", mistakes=mistakes, hint=_SWIGLU_RECIPE)


# =========================================================================== 11.2 causal_lm_loss


def _loss_mistakes(logits, targets) -> dict[str, torch.Tensor]:
    B, T, V = logits.shape
    flat, tgt = logits.detach().reshape(-1, V), targets.reshape(-1)
    per = F.cross_entropy(flat, tgt, reduction="none").reshape(B, T)
    log_p = torch.log_softmax(flat, dim=-1)
    return eager_mistakes({
        Mistake("summed-losses", "you summed the losses; the pretraining loss is their mean over "
                "all B·T positions (reduction='mean', the default), so that it does not grow with "
                "the batch or the length."):
            lambda: per.sum(),
        Mistake("mean-of-sequence-sums", "you averaged per-sequence sums (a sum over T, then a "
                "mean over B); average over all B·T positions: per-position losses .mean() over "
                "both axes."):
            lambda: per.sum(dim=1).mean(),
        Mistake("mean-of-batch-sums", "you averaged per-position sums over the batch (a sum over "
                "B, then a mean over T); average over all B·T positions."):
            lambda: per.sum(dim=0).mean(),
        Mistake("shifted-targets-again", "you shifted the targets again: targets[b, t] is already "
                "the token that follows position t, so compare logits[:, t] with targets[:, t] (no "
                "[:, :-1] / [:, 1:] inside)."):
            lambda: F.cross_entropy(logits.detach()[:, :-1].reshape(-1, V), targets[:, 1:].reshape(-1)),
        Mistake("nll-of-probabilities", "you took the NLL of probabilities (F.nll_loss on softmax "
                "outputs, which gives -mean p); cross-entropy is the negative mean of "
                "log-probabilities: F.cross_entropy on the logits, or F.nll_loss on log_softmax."):
            lambda: F.nll_loss(torch.softmax(flat, dim=-1), tgt),
        Mistake("nll-of-logits", "you took F.nll_loss of the raw logits; it expects "
                "log-probabilities: F.cross_entropy on the logits (it applies log_softmax itself), "
                "or F.nll_loss on log_softmax(logits)."):
            lambda: F.nll_loss(flat, tgt),
        Mistake("loss-in-bits", "your loss is in bits (log base 2); cross-entropy here is in nats "
                "(natural log)."):
            lambda: -log_p.gather(1, tgt[:, None]).mean() / math.log(2),
        Mistake("softmax-before-cross_entropy", "you applied softmax before F.cross_entropy, which "
                "applies log_softmax itself: pass the raw logits."):
            lambda: F.cross_entropy(torch.softmax(flat, dim=-1), tgt),
        Mistake("loss-per-position", "you returned one loss per position (reduction='none'); "
                "return their mean, a single number."):
            lambda: per,
        Mistake("label-smoothing", "you smoothed the labels (label_smoothing=0.1): the pretraining "
                "loss is the plain cross-entropy of the target tokens, label_smoothing=0."):
            lambda: F.cross_entropy(flat, tgt, label_smoothing=0.1),
        Mistake("loss-per-sequence", "you returned one loss per sequence; return the mean over all "
                "B·T positions, a single number."):
            lambda: per.mean(dim=1),
        Mistake("log-of-softmax", "your loss is inf where a target's logit lies far below the others "
                "(about 200 below, in one case): softmax rounds that probability to 0 and log(0) = -inf. "
                "Take log_softmax(logits) (or F.cross_entropy), which computes logits - "
                "logsumexp(logits) without forming the tiny probability.",
                "took log(softmax(logits)), which is -inf where a probability rounds to 0"):
            lambda: -torch.log(torch.softmax(flat, dim=-1).gather(1, tgt[:, None])).mean(),
    })


_LOSS_RECIPE = ("B, T, V = logits.shape; return F.cross_entropy(logits.reshape(B * T, V), targets.reshape(B * T)) "
                "(classes on the last axis after the reshape; the default reduction is the mean).")


def _loss_inputs():
    """(logits, targets): B, T, V all different; one case with targets whose logits lie 200 below
    the others (float32); the last case has float64 logits that require grad."""
    out = []
    for seed, (B, T, V, dtype) in enumerate([(3, 5, 7, torch.float32), (2, 9, 4, torch.float32),
                                            (4, 3, 11, torch.float64)]):
        g = seeded(1200 + seed)
        logits = 2 * torch.randn(B, T, V, generator=g, dtype=dtype)
        targets = torch.randint(V, (B, T), generator=g)
        out.append((logits, targets))
    # float32 logits where some targets' logits lie 200 below the row's others: their probability rounds
    # to 0 in softmax, while log_softmax (and the loss, 200 there) stays finite.
    g = seeded(1210)
    logits = 2 * torch.randn(2, 4, 6, generator=g)
    targets = torch.randint(6, (2, 4), generator=g)
    far = torch.rand(2, 4, generator=g) < 0.5
    far[0, 0] = True
    logits.scatter_add_(-1, targets[..., None], torch.where(far, -200.0, 0.0)[..., None])
    out.insert(len(out) - 1, (logits, targets))
    out[-1] = (out[-1][0].requires_grad_(), out[-1][1])
    return out


@exercise()
def causal_lm_loss(t: Trial) -> None:
    t.error_hints = {
        r"Expected target size|Expected input batch_size": Mistake(
            "classes-not-on-axis-1", "F.cross_entropy wants the classes on axis 1: flatten to "
            "logits.reshape(B * T, V) and targets.reshape(B * T) (or pass logits.transpose(1, 2)).",
            "passed [B, T, V] logits to F.cross_entropy unflattened"),
        r"expected scalar type Long|must be Long|not implemented for 'Float'": Mistake(
            "targets-not-int64", "targets are class indices (int64); keep them as they are, do not "
            "convert them to float or one-hot.",
            "converted the targets (class indices) to float or one-hot"),
    }
    planned = []
    for logits, targets in _loss_inputs():
        with torch.no_grad():
            expected = ref.causal_lm_loss(logits, targets)
        planned.append((logits, targets, expected, _loss_mistakes(logits, targets)))
    for logits, targets, expected, mistakes in planned:
        got = t.call(logits, targets, case=describe_case(logits=logits, targets=targets))
        if type(got) in (float, int):
            t.fail(f"loss: expected a 0-dim tensor, got the Python number {got!r}.",
                   Mistake("returned-number", "return the loss as a tensor (no .item()): training "
                           "calls loss.backward() on it.",
                           "returned the loss as a Python number, not a tensor"))
        if isinstance(got, torch.Tensor) and got.dim() == 1 and got.numel() == 1 and expected.dim() == 0:
            t.fail(f"loss: expected a 0-dim tensor (shape []), got shape {list(got.shape)}.",
                   Mistake("loss-shape-1", "reduce to a single number: .mean() over every position "
                           "gives shape [].", "returned a loss of shape [1], not a 0-dim tensor"))
        t.tensor(got.detach() if isinstance(got, torch.Tensor) else got, expected, what="loss", mistakes=mistakes,
                 hint=_LOSS_RECIPE)
        if logits.requires_grad and not got.requires_grad:
            t.fail("loss: the value is right but it is detached from the logits (requires_grad is False), so "
                   "loss.backward() cannot train the model.",
                   Mistake("loss-detached", "compute the loss with torch operations on the logits "
                           "themselves: no .item(), .tolist(), NumPy, torch.tensor(...) of "
                           "numbers, or .detach() on the way.",
                           "the loss is detached from the logits (no gradient)"))


# =========================================================================== 11.3 induction_scores


def _diag_mean(attn: torch.Tensor, offset: int, first_query: int) -> torch.Tensor:
    """Mean over queries i >= first_query of attn[..., i, i - offset]."""
    T = attn.shape[-1]
    q = torch.arange(first_query, T)
    return attn[..., q, q - offset].mean(dim=-1)


def _induction_mistakes(attn: torch.Tensor) -> dict[str, torch.Tensor]:
    T = attn.shape[-1]
    m = T // 2
    second = torch.arange(m, T)
    return eager_mistakes({
        Mistake("duplicate-token-offset", "you read the weight on key i - m, the query's previous "
                "occurrence itself (a duplicate-token head); an induction head looks one further, "
                "at key i - m + 1, the token that came *after* it.",
                "read key i - m (a duplicate-token head), not i - m + 1"):
            lambda: _diag_mean(attn, m, m),
        Mistake("previous-token-offset", "you read the weight on key i - 1 (a previous-token "
                "head); an induction head's query i attends to key i - m + 1, the token after the "
                "previous occurrence of its own token.",
                "read key i - 1 (a previous-token head), not i - m + 1"):
            lambda: _diag_mean(attn, 1, m),
        Mistake("offset-one-too-far", "you read the weight on key i - m + 2, two after the "
                "previous occurrence; an induction head attends to key i - m + 1, the token right "
                "after it.", "read key i - m + 2, not i - m + 1"):
            lambda: _diag_mean(attn, m - 2, m),
        Mistake("averaged-from-query-m-1", "you averaged over every query that has a key i - m + 1 "
                "(from query m - 1 on); only the second half repeats, so average over the queries "
                "i = m .. 2m-1."):
            lambda: _diag_mean(attn, m - 1, m - 1),
        Mistake("averaged-over-all-queries", "you averaged over all T queries (with 0 where there "
                "is no key i - m + 1); average over the m queries of the second half, i = m .. "
                "2m-1."):
            lambda: attn.diagonal(offset=-(m - 1), dim1=-2, dim2=-1).sum(dim=-1) / T,
        Mistake("summed-over-queries", "you summed over the queries; the score is their mean (so "
                "that it is a weight between 0 and 1)."):
            lambda: attn[..., second, second - m + 1].sum(dim=-1),
        Mistake("transposed-attn", "rows are queries and columns are keys: you read attn[..., i - "
                "m + 1, i] (above the diagonal, where a causal model has zeros); read attn[..., i, "
                "i - m + 1].",
                "read attn[..., key, query] (transposed), not attn[..., query, key]"):
            lambda: attn[..., second - m + 1, second].mean(dim=-1),
        Mistake("averaged-over-heads", "you averaged over the layers or heads too; return one "
                "score per head, shape [L, H]."):
            lambda: _diag_mean(attn, m - 1, m).mean(),
    })


_INDUCTION_RECIPE = ("T = attn.shape[-1]; m = T // 2; i = torch.arange(m, T); "
                     "return attn[..., i, i - m + 1].mean(dim=-1)   # [L, H]")


def _induction_inputs() -> list[torch.Tensor]:
    """attn [L, H, T, T] causal attention weights (rows sum to 1), L != H, T = 2m. The last case has
    planted heads: an exact induction head (score 1), a duplicate-token head and a previous-token head."""
    out = []
    for seed, (L, H, T, dtype) in enumerate([(2, 3, 8, torch.float32), (3, 2, 12, torch.float32),
                                            (1, 4, 6, torch.float32), (2, 5, 10, torch.float64)]):
        g = seeded(1300 + seed)
        q = torch.randn(L, H, T, 8, generator=g, dtype=dtype)
        k = torch.randn(L, H, T, 8, generator=g, dtype=dtype)
        out.append(attention_weights(2 * q, k, causal_mask(T)))
    planted = out[1].clone()
    T, m = 12, 6
    for head, offset in [(0, m - 1), (1, m), ]:  # layer 0: induction head 0, duplicate-token head 1
        w = torch.zeros(T, T)
        for i in range(T):
            w[i, i - offset if i >= offset else 0] = 1.0
        planted[0, head] = w
    w = torch.zeros(T, T)
    w[0, 0] = 1.0
    for i in range(1, T):
        w[i, i - 1] = 1.0
    planted[2, 1] = w  # layer 2, head 1: previous-token head
    out.append(planted)
    return out


@exercise()
def induction_scores(t: Trial) -> None:
    t.error_hints = {
        r"index .* is out of bounds|out of range": Mistake(
            "index-out-of-range", "with T = 2m, the queries of the second half are i = m .. 2m-1 "
            "and their keys i - m + 1 = 1 .. m: all inside 0 .. T-1.",
            "indexed queries or keys outside 0 .. T-1"),
    }
    planned = [(a, ref.induction_scores(a), _induction_mistakes(a)) for a in _induction_inputs()]
    for attn, expected, mistakes in planned:
        got = t.call(attn, case=describe_case(attn=attn))
        t.tensor(got, expected, what="induction scores", mistakes=mistakes, hint=_INDUCTION_RECIPE)


# =========================================================================== 11.4 k_composition_score


def _fro(m: torch.Tensor) -> torch.Tensor:
    return torch.linalg.matrix_norm(m)


# The score is a choice of four parts: the product (w_qk @ w_ov.T), the norm (Frobenius, in the
# numerator and the denominator), the denominator (the product of the two norms) and nothing done
# afterwards. A learner's number is explained by the family of scores with one or two of these
# parts changed: each part's option has the clause that says what the learner did, in their terms.
_FRO = "Frobenius"
_KC_PRODUCTS = {  # option -> (its mistake, the clause for two-part mistakes, numerator from (q, o, norm))
    "w_qk @ w_ov.T": None,
    "w_ov @ w_qk": (Mistake("Q-composition", "you computed Q-composition, ||w_ov @ w_qk||: the earlier head "
                    "feeding the later head's *queries*. K-composition puts it on the keys' side: the "
                    "score is x_i @ w_qk @ (x_src @ w_ov).T, so the product is w_qk @ w_ov.T."),
                    "your product is w_ov @ w_qk (Q-composition), not w_qk @ w_ov.T",
                    lambda q, o, n: n(o @ q)),
    "w_qk @ w_ov": (Mistake("w_ov-not-transposed", "w_ov is missing its transpose (you used ||w_qk @ w_ov||): "
                    "the keys read x_src @ w_ov, which enters the score x_i @ w_qk @ x_j.T as (x_src @ "
                    "w_ov).T = w_ov.T @ x_src.T, so the product is w_qk @ w_ov.T."),
                    "your product is w_qk @ w_ov, without w_ov's transpose (w_qk @ w_ov.T)",
                    lambda q, o, n: n(q @ o)),
    "w_qk.T @ w_ov": (Mistake("column-vector-formula", "you computed ||w_qk.T @ w_ov||, the formula W_QK^T W_OV "
                      "of column-vector notation (where it is Q-composition), on this exercise's "
                      "row-vector matrices; with score = x_i @ w_qk @ x_j.T and output x @ w_ov, "
                      "K-composition is ||w_qk @ w_ov.T||."),
                      "your product is w_qk.T @ w_ov (the column-vector formula), not w_qk @ w_ov.T",
                      lambda q, o, n: n(q.T @ o)),
    "w_qk * w_ov.T": (Mistake("elementwise-product", "you multiplied elementwise (*); composition is the matrix "
                      "product w_qk @ w_ov.T (@)."),
                      "you multiplied elementwise (w_qk * w_ov.T), not with the matrix product @",
                      lambda q, o, n: n(q * o.T)),
    "w_qk * w_ov": (Mistake("elementwise-product-no-transpose", "you multiplied elementwise (w_qk * w_ov); "
                    "composition is the matrix product w_qk @ w_ov.T (@, and w_ov transposed)."),
                    "you multiplied elementwise (w_qk * w_ov), not w_qk @ w_ov.T",
                    lambda q, o, n: n(q * o)),
    "|trace|": (Mistake("trace-not-norm", "your numerator is |trace(w_qk @ w_ov.T)| = |(w_qk * w_ov).sum()|, "
                "the inner product of the two matrices (divided by their norms, their cosine): the "
                "score takes the Frobenius norm of the whole product matrix, ||w_qk @ w_ov.T||_F."),
                "your numerator is |trace(w_qk @ w_ov.T)| (the two matrices' inner product), not "
                "the norm ||w_qk @ w_ov.T||_F",
                lambda q, o, n: torch.trace(q @ o.T).abs()),
    "|sum|": (Mistake("sum-of-entries-not-norm", "your numerator is |(w_qk @ w_ov.T).sum()|, the sum of the "
              "product's entries: the score takes its Frobenius norm, the square root of the sum of "
              "their squares, torch.linalg.matrix_norm(w_qk @ w_ov.T)."),
              "your numerator is the sum of the entries of w_qk @ w_ov.T, not its Frobenius norm",
              lambda q, o, n: (q @ o.T).sum().abs()),
    "trace": (Mistake("trace-not-norm-signed", "your numerator is trace(w_qk @ w_ov.T) = (w_qk * w_ov).sum(), "
              "the inner product of the two matrices (divided by their norms, their cosine): the score "
              "takes the Frobenius norm of the whole product matrix, ||w_qk @ w_ov.T||_F."),
              "your numerator is trace(w_qk @ w_ov.T) (the two matrices' inner product), not the norm "
              "||w_qk @ w_ov.T||_F",
              lambda q, o, n: torch.trace(q @ o.T)),
}
_KC_NORMS = {  # option -> (its mistake, clause, norm of a matrix)
    _FRO: None,
    "spectral": (Mistake("spectral-norm", "you used the spectral norm (the largest singular value, ord=2); "
                 "the score uses the Frobenius norm (the square root of the sum of squares), "
                 "torch.linalg.matrix_norm(m) with its default ord='fro'."),
                 "you used the spectral norm (ord=2, the largest singular value), not the Frobenius norm",
                 lambda m: torch.linalg.matrix_norm(m, ord=2)),
    "nuclear": (Mistake("nuclear-norm", "you used the nuclear norm (the sum of singular values); the score "
                "uses the Frobenius norm."),
                "you used the nuclear norm (the sum of the singular values), not the Frobenius norm",
                lambda m: torch.linalg.matrix_norm(m, ord="nuc")),
    "l1": (Mistake("entrywise-l1-norm", "you used the sum of the absolute values (an entrywise L1 norm); the "
           "score uses the Frobenius norm, the square root of the sum of squares: "
           "torch.linalg.matrix_norm(m)."),
           "you used the sum of the absolute values (entrywise L1), not the Frobenius norm (sqrt of the "
           "sum of squares)",
           lambda m: m.abs().sum()),
    "max-abs": (Mistake("max-abs-entry", "you used the largest absolute entry (an entrywise max norm); the "
                "score uses the Frobenius norm of the whole matrix, the square root of the sum of "
                "squares: torch.linalg.matrix_norm(m)."),
                "you used the largest absolute entry, not the Frobenius norm of the whole matrix",
                lambda m: m.abs().max()),
    "max-row": (Mistake("max-row-norm", "you used the largest row norm (a norm over one axis, then its max); "
                "the score uses the Frobenius norm of the whole matrix: torch.linalg.matrix_norm(m) "
                "(or m.norm()), over both axes."),
                "you used the largest row norm (a norm over dim=-1, then max), not the Frobenius norm "
                "of the whole matrix",
                lambda m: m.norm(dim=-1).max()),
    "max-column": (Mistake("max-column-norm", "you used the largest column norm (a norm over dim=0, then its "
                   "max); the score uses the Frobenius norm of the whole matrix: "
                   "torch.linalg.matrix_norm(m) (or m.norm()), over both axes."),
                   "you used the largest column norm (a norm over dim=0, then max), not the Frobenius "
                   "norm of the whole matrix",
                   lambda m: m.norm(dim=0).max()),
    "sum-of-columns": (Mistake("sum-of-column-norms", "you summed the norms of the columns (a norm over dim=0, "
                       "then a sum); the score uses the Frobenius norm of the whole matrix, the square root of "
                       "the sum of all the squares: torch.linalg.matrix_norm(m) (or m.norm())."),
                       "you summed the column norms (a norm over dim=0, then a sum), not the Frobenius norm",
                       lambda m: m.norm(dim=0).sum()),
    "sum-of-rows": (Mistake("sum-of-row-norms", "you summed the norms of the rows (a norm over dim=-1, then a "
                    "sum); the score uses the Frobenius norm of the whole matrix, the square root of the sum "
                    "of all the squares: torch.linalg.matrix_norm(m) (or m.norm())."),
                    "you summed the row norms (a norm over dim=-1, then a sum), not the Frobenius norm",
                    lambda m: m.norm(dim=-1).sum()),
    "inf": (Mistake("max-row-sum-norm", "you used the largest row sum of absolute values (ord=inf); the score "
            "uses the Frobenius norm, torch.linalg.matrix_norm(m) with its default ord='fro'."),
            "you used the infinity norm (ord=inf, the largest row sum of |entries|), not the Frobenius norm",
            lambda m: torch.linalg.matrix_norm(m, ord=math.inf)),
    "one": (Mistake("max-column-sum-norm", "you used the largest column sum of absolute values (ord=1); the "
            "score uses the Frobenius norm, torch.linalg.matrix_norm(m) with its default ord='fro'."),
            "you used the 1-norm (ord=1, the largest column sum of |entries|), not the Frobenius norm",
            lambda m: torch.linalg.matrix_norm(m, ord=1)),
}
_KC_DENOMINATORS = {  # option -> (its mistake, clause, denominator from the two norms)
    "product": None,
    "sum": (Mistake("divided-by-sum-of-norms", "you divided by the sum of the norms, ||w_qk|| + ||w_ov||; "
            "divide by their product, ||w_qk||_F * ||w_ov||_F."),
            "you divided by the sum of the norms ||w_qk|| + ||w_ov||, not their product",
            lambda a, b: a + b),
    "w_qk only": (Mistake("divided-by-w_qk-norm-only", "you divided by ||w_qk||_F only; divide by the "
                  "product of both norms, ||w_qk||_F * ||w_ov||_F."),
                  "you divided by ||w_qk|| only, not by ||w_qk|| * ||w_ov||",
                  lambda a, b: a),
    "w_ov only": (Mistake("divided-by-w_ov-norm-only", "you divided by ||w_ov||_F only; divide by the "
                  "product of both norms, ||w_qk||_F * ||w_ov||_F."),
                  "you divided by ||w_ov|| only, not by ||w_qk|| * ||w_ov||",
                  lambda a, b: b),
    "a / b * c": (Mistake("multiplied-by-w_ov-norm", "your score is ||w_qk @ w_ov.T|| / ||w_qk|| * ||w_ov||: "
                  "Python reads a / b * c as (a / b) * c, so ||w_ov|| multiplies instead of dividing. Put the "
                  "denominator in parentheses: / (||w_qk||_F * ||w_ov||_F)."),
                  "you divided by ||w_qk|| and multiplied by ||w_ov|| (a / b * c without parentheses)",
                  lambda a, b: a / b),
    "none": (Mistake("not-normalised", "you did not normalise: divide ||w_qk @ w_ov.T||_F by ||w_qk||_F "
             "* ||w_ov||_F, so that the score does not depend on the matrices' scale."),
             "you did not divide by the norms ||w_qk|| * ||w_ov||",
             lambda a, b: torch.ones_like(a)),
    "squared": (Mistake("divided-by-squared-norms", "you divided by the squared norms; divide by "
                "||w_qk||_F * ||w_ov||_F (each the square root of a sum of squares)."),
                "you divided by the squared norms (||w_qk|| * ||w_ov||)^2",
                lambda a, b: (a * b) ** 2),
    "sqrt": (Mistake("divided-by-sqrt-of-norms", "you divided by the square root of ||w_qk|| * ||w_ov||; "
             "divide by the product of the norms itself, ||w_qk||_F * ||w_ov||_F."),
             "you divided by sqrt(||w_qk|| * ||w_ov||), not by ||w_qk|| * ||w_ov||",
             lambda a, b: (a * b).sqrt()),
}
_KC_AFTER = {  # option -> (its mistake, clause, what was done to the score with D)
    "nothing": None,
    "squared": (Mistake("squared-score", "you squared the score (sums of squares without the square "
                "roots): the Frobenius norm is sqrt((m ** 2).sum()), in the numerator and in both "
                "norms of the denominator."),
                "your score is squared (sums of squares without their square roots)",
                lambda s, D: s ** 2),
    "sqrt": (Mistake("square-root-of-score", "your number is the square root of the score: the score is "
             "||w_qk @ w_ov.T||_F / (||w_qk||_F * ||w_ov||_F) itself, with no further square root."),
             "you took the square root of the score",
             lambda s, D: s.sqrt()),
    "/ sqrt(D)": (Mistake("divided-by-sqrt-D", "you divided the score by sqrt(D) as well: the score is "
                  "||w_qk @ w_ov.T||_F / (||w_qk||_F * ||w_ov||_F), with no 1/sqrt(D) (that scale "
                  "belongs to attention's scores, not to this ratio)."),
                  "you divided the score by sqrt(D) as well",
                  lambda s, D: s / math.sqrt(D)),
    "/ D": (Mistake("divided-by-D", "you divided the score by D as well: the score is ||w_qk @ w_ov.T||_F / "
            "(||w_qk||_F * ||w_ov||_F), already scale-free, with no 1/D."),
            "you divided the score by D as well",
            lambda s, D: s / D),
    "* D": (Mistake("multiplied-by-D", "your score is D times ||w_qk @ w_ov.T||_F / (||w_qk||_F * "
            "||w_ov||_F): a root mean square (the square root of the mean of the squares) in place of "
            "each Frobenius norm gives this. The Frobenius norm is the square root of the sum of the "
            "squares, torch.linalg.matrix_norm(m)."),
            "your score is D times the right one (root mean squares instead of Frobenius norms?)",
            lambda s, D: s * D),
    "* sqrt(D)": (Mistake("multiplied-by-sqrt-D", "you multiplied the score by sqrt(D): the score is "
                  "||w_qk @ w_ov.T||_F / (||w_qk||_F * ||w_ov||_F), with no sqrt(D)."),
                  "you multiplied the score by sqrt(D)",
                  lambda s, D: s * math.sqrt(D)),
}
# Mistakes of one part that cannot be written as a change of the four parts above.
_KC_FRO_NUMERATOR_SPECTRAL_DENOMINATOR = Mistake(
    "spectral-norms-in-denominator", "you divided by the spectral norms (ord=2) of w_qk and w_ov; use "
    "their Frobenius norms, like the numerator's.")
_KC_SPECTRAL_NUMERATOR = Mistake(
    "spectral-norm-in-numerator", "you took the spectral norm (ord=2) of w_qk @ w_ov.T but the "
    "Frobenius norms of w_qk and w_ov: use the Frobenius norm throughout, torch.linalg.matrix_norm(m).",
    "used the spectral norm for the product only")
_KC_SINGLES = {name: {opt: (s[0] if s else None) for opt, s in part.items()}
               for name, part in (("product", _KC_PRODUCTS), ("norm", _KC_NORMS), ("denominator", _KC_DENOMINATORS),
                                  ("after", _KC_AFTER))}


def _kc_score(q: torch.Tensor, o: torch.Tensor, product: str, norm: str, denominator: str, after: str) -> float:
    n = (lambda m: torch.linalg.matrix_norm(m)) if norm == _FRO else _KC_NORMS[norm][2]
    num = (lambda q_, o_, n_: n_(q_ @ o_.T)) if product == "w_qk @ w_ov.T" else _KC_PRODUCTS[product][2]
    den = (lambda a, b: a * b) if denominator == "product" else _KC_DENOMINATORS[denominator][2]
    post = (lambda s, D: s) if after == "nothing" else _KC_AFTER[after][2]
    return float(post(num(q, o, n) / den(n(q), n(o)), q.shape[0]))


def _kc_double(a: tuple[str, str], b: tuple[str, str]) -> Mistake:
    """The mistake of two parts changed at once: both clauses, in the learner's terms."""
    parts = {"product": _KC_PRODUCTS, "norm": _KC_NORMS, "denominator": _KC_DENOMINATORS, "after": _KC_AFTER}
    (_, ca, _), (_, cb, _) = parts[a[0]][a[1]], parts[b[0]][b[1]]
    return Mistake("two-parts-changed", f"two things differ from ||w_qk @ w_ov.T||_F / (||w_qk||_F * "
                   f"||w_ov||_F): {ca}; and {cb}.", f"{ca}; and {cb}")


_KC_RIGHT = {"product": "w_qk @ w_ov.T", "norm": _FRO, "denominator": "product", "after": "nothing"}
_KC_DOUBLE_NORMS = ("spectral", "nuclear", "l1", "max-row", "max-column")  # norms combined with another change


def _kc_family() -> list[tuple[Mistake, dict[str, str]]]:
    """Every score with one part changed, then every one with two parts changed, each with its mistake."""
    out = [(m, {**_KC_RIGHT, part: opt}) for part, options in _KC_SINGLES.items() for opt, m in options.items() if m]
    names = list(_KC_SINGLES)
    for i, p1 in enumerate(names):
        for p2 in names[i + 1:]:
            for o1 in _KC_SINGLES[p1]:
                for o2 in _KC_SINGLES[p2]:
                    if o1 == _KC_RIGHT[p1] or o2 == _KC_RIGHT[p2]:
                        continue
                    if (p1 == "norm" and o1 not in _KC_DOUBLE_NORMS) or (p2 == "norm" and o2 not in _KC_DOUBLE_NORMS):
                        continue
                    if p1 == "product" and o1 == "trace":
                        continue  # as |trace| but for its sign: that one's pairs cover it
                    if p1 == "product" and o1 in ("|trace|", "|sum|") and p2 == "norm":
                        continue  # a trace has no norm in its numerator: that pair is the denominator's norm alone
                    out.append((_kc_double((p1, o1), (p2, o2)), {**_KC_RIGHT, p1: o1, p2: o2}))
    return out


_KC_FAMILY = _kc_family()


def _k_composition_mistakes(w_qk: torch.Tensor, w_ov: torch.Tensor) -> dict[str, float]:
    """Every mistake's score on this case (the right one's too where a change does not show here)."""
    q, o = w_qk.double(), w_ov.double()
    spec = torch.linalg.matrix_norm
    models = {m: _kc_score(q, o, **choice) for m, choice in _KC_FAMILY}
    models[_KC_FRO_NUMERATOR_SPECTRAL_DENOMINATOR] = float(_fro(q @ o.T) / (spec(q, ord=2) * spec(o, ord=2)))
    models[_KC_SPECTRAL_NUMERATOR] = float(spec(q @ o.T, ord=2) / (_fro(q) * _fro(o)))
    signed, absolute = _KC_SINGLES["product"]["trace"], _KC_SINGLES["product"]["|trace|"]
    if _isclose_num(models[signed], models[absolute], rel_tol=1e-9):
        del models[signed]  # a positive trace: one mistake, named once
    return models


_K_COMPOSITION_RECIPE = ("norm = torch.linalg.matrix_norm  # Frobenius by default; "
                         "return (norm(w_qk @ w_ov.T) / (norm(w_qk) * norm(w_ov))).item()")


def _k_composition_inputs() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(w_qk, w_ov) pairs ``[D, D]``, non-symmetric, norms far from 1. Head-like ones are rank r
    products (w_qk = A @ B.T, w_ov = C @ E); the third has a planted K-composition (the earlier
    head writes into the subspace the keys read: E = B.T), the fourth is full rank in float64."""
    out = []
    for seed, (D, r, scale, planted, dtype) in enumerate([(6, 2, 2.5, False, torch.float32),
                                                          (9, 3, 0.2, False, torch.float32),
                                                          (7, 2, 1.5, True, torch.float32),
                                                          (5, 5, 4.0, False, torch.float64)]):
        g = seeded(1400 + seed)
        a, b, c = torch.randn(3, D, r, generator=g, dtype=dtype)
        e = b.T.clone() if planted else torch.randn(r, D, generator=g, dtype=dtype)
        out.append((scale * a @ b.T, c @ e / scale))
    return out


@exercise()
def k_composition_score(t: Trial) -> None:
    t.forbidden_references = {"k_composition_score", "composition_score", "composition_scores",
                              "random_composition_scores"}  # plain torch: these compute the answer
    t.error_hints = {
        r"takes \d+ positional argument|missing \d+ required positional argument": wrong_signature(
            "k_composition_score(w_qk, w_ov), both [D, D], returning a float."),
        r"only one element tensors can be converted"
        r"|a Tensor with \d+ elements cannot be converted": Mistake(
            "norm-over-one-axis", "a norm over one axis gives one number per row or column: the "
            "score uses the Frobenius norm of the whole matrix, torch.linalg.matrix_norm(m) (or "
            "m.norm()).", "took a norm over one axis instead of the whole matrix"),
    }
    planned = [(describe_case(w_qk=w_qk, w_ov=w_ov), (w_qk, w_ov), ref.k_composition_score(w_qk.double(), w_ov.double()),
                _k_composition_mistakes(w_qk, w_ov)) for w_qk, w_ov in _k_composition_inputs()]
    # One number per case: two of the ~200 mistakes can give the same number on one case, never on
    # all of them; the core names a mistake only if its model gives the learner's number on every case.
    for name, args, expected, mistakes in planned:
        got = t.call(*args, case=name)
        t.number(got, expected, what="K-composition score", mistakes=mistakes, hint=_K_COMPOSITION_RECIPE, rel=1e-4, abs_tol=1e-7)
