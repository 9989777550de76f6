"""Checks for notebook 01_qkv_shapes: exercises 1.1-1.3.

Every case and its expected output are built before the learner's function first runs; the
mistakes each check recognises are outputs of known wrong implementations, named at the first
failure; the ``hint=`` of a comparison is the full recipe, shown only when the check fails again.
"""

from __future__ import annotations

import math

import torch

from .. import nb01_qkv_shapes as ref
from .core import Trial, describe_case, eager_mistakes, exercise, seeded
from .feedback import Mistake

NB = "01_qkv_shapes"

# Shapes are chosen so that no two of B, T, H, d_k are equal: a transposed or swapped axis
# then shows up as a wrong shape or wrong values, never as a lucky pass.
_QKV_CASES = [(2, 5, 12, 3), (1, 7, 8, 2), (3, 4, 30, 5)]  # (B, T, D, H)


# --------------------------------------------------------------------------- 1.1


def _qkv_mistakes(x: torch.Tensor, w: torch.Tensor, H: int, expected: tuple, i: int) -> dict:
    """hint -> output i (0: q, 1: k, 2: v) of a known wrong projection or head split."""
    B, T, D = x.shape
    d_k = D // H
    proj = lambda: (x @ w).split(D, dim=-1)[i]  # noqa: E731
    name = "qkv"[i]
    mistakes = {
        Mistake("reshaped-straight-to-B-H-T-d_k",
                "you reshaped straight to [B, H, T, d_k]: that regroups the numbers of different "
                "tokens. View as [B, T, H, d_k] first, then transpose(1, 2)."):
            lambda: proj().reshape(B, H, T, d_k),
        Mistake("split-without-transpose",
                "you split into heads but did not transpose: after .view(B, T, H, d_k) call "
                ".transpose(1, 2) to get [B, H, T, d_k]."):
            lambda: proj().view(B, T, H, d_k),
        Mistake("d_k-major-head-split",
                "the head split is d_k-major: view as [B, T, H, d_k] (head h = columns "
                "h*d_k:(h+1)*d_k), not [B, T, d_k, H]."):
            lambda: proj().view(B, T, d_k, H).permute(0, 3, 1, 2),
        Mistake("transposed-w_qkv",
                "the projection is x @ w_qkv (w_qkv is [D, 3D]); x @ w_qkv.T or w_qkv @ x mixes "
                "the wrong axes.",
                "projected with w_qkv transposed (x @ w_qkv.T or w_qkv @ x)"):
            lambda: ref.split_heads((x @ w.T.reshape(D, 3 * D)).split(D, dim=-1)[i], H),
    }
    for j, other in enumerate("qkv"):
        if j != i:
            mistakes[Mistake("wrong-qkv-columns",
                             f"your {name} holds the {other} columns: w_qkv's columns are Q, K, V "
                             "in that order (q = columns 0:D, k = D:2D, v = 2D:3D).",
                             "took q, k or v from the wrong columns of x @ w_qkv")] = expected[j]
    return mistakes


@exercise("1.1", "Q/K/V projection and head split", points=1, stars=1, notebook=NB,
          section="2. The seven steps, with every shape")
def qkv_projection(t: Trial) -> None:
    t.error_hints = {
        r"shape '\[.*\]' is invalid|view size is not compatible": Mistake(
            "view-size-does-not-fit",
            "a view/reshape asked for a shape whose size does not fit: the projected tensor is "
            "[B, T, D] per part; view it as [B, T, H, D // H], then transpose(1, 2)."),
        r"cannot be multiplied": Mistake(
            "projection-shapes-do-not-fit",
            "the projection is x @ w_qkv: x is [B, T, D] and w_qkv is [D, 3D].",
            "multiplied x and w_qkv in an order whose shapes do not fit"),
    }
    cases = []
    for seed, (B, T, D, H) in enumerate(_QKV_CASES):
        g = seeded(seed)
        x = torch.randn(B, T, D, generator=g)
        w = torch.randn(D, 3 * D, generator=g) / math.sqrt(D)
        cases.append((x, w, H, ref.qkv_projection(x, w, H)))
    for x, w, H, expected in cases:
        got = t.tuple(t.call(x, w, H, case=describe_case(x=x, w_qkv=w, n_heads=H)), 3, ("q", "k", "v"))
        for i, name in enumerate("qkv"):
            t.tensor(got[i], expected[i], what=name, mistakes=_qkv_mistakes(x, w, H, expected, i),
                     hint="q, k, v = (x @ w_qkv).split(D, dim=-1), then each .view(B, T, H, D // H).transpose(1, 2).")


# --------------------------------------------------------------------------- 1.2


def _merge_mistakes(o: torch.Tensor) -> dict:
    """hint -> the output of a known wrong head merge of o [B, H, T, d_k] (for eager_mistakes)."""
    B, H, T, d_k = o.shape
    along_t = ("you stacked the heads along the token axis ([B, H*T, d_k]{}): the heads of one token go side by "
               "side along the last axis, [B, T, H*d_k]. Transpose to [B, T, H, d_k], then reshape(B, T, H * d_k).")
    stacked = "stacked the heads along the token axis instead of side by side along the last axis"
    return {
        Mistake("reshape-without-transpose",
                "you reshaped [B, H, T, d_k] straight to [B, T, H*d_k]: transpose(1, 2) first so "
                "that the heads of one token sit side by side."):
            lambda: o.reshape(B, T, H * d_k),
        Mistake("d_k-major-columns",
                "the columns are d_k-major: head h must occupy columns h*d_k:(h+1)*d_k, so "
                "transpose to [B, T, H, d_k] (not [B, T, d_k, H]) before reshaping."):
            lambda: o.permute(0, 2, 3, 1).reshape(B, T, H * d_k),
        Mistake("transpose-without-reshape",
                "you transposed but did not merge: the result must be [B, T, H * d_k], one row "
                "of D numbers per token (reshape after the transpose)."):
            lambda: o.transpose(1, 2),
        Mistake("heads-stacked-along-T",
                along_t.format(", head by head: torch.cat over the heads on the T axis, or "
                               "o.reshape(B, H * T, d_k)"), stacked):
            lambda: o.reshape(B, H * T, d_k),
        Mistake("heads-stacked-along-T", along_t.format(", token by token"), stacked):
            lambda: o.transpose(1, 2).reshape(B, T * H, d_k),
        Mistake("summed-heads",
                "you added the heads up: merging concatenates them, head h in columns "
                "h*d_k:(h+1)*d_k of a [B, T, H * d_k] result, it does not sum them."):
            lambda: o.sum(dim=1),
        Mistake("averaged-heads",
                "you averaged the heads: merging concatenates them, head h in columns "
                "h*d_k:(h+1)*d_k of a [B, T, H * d_k] result."):
            lambda: o.mean(dim=1),
        Mistake("transposed-T-and-d_k",
                "you swapped axes 2 and 3 (T and d_k); the axes to swap are 1 and 2 (H and T): "
                "o.transpose(1, 2).reshape(B, T, H * d_k)."):
            lambda: o.transpose(2, 3).reshape(B, T, H * d_k),
    }


@exercise("1.2", "merge heads back to [B, T, D]", points=1, stars=1, notebook=NB,
          section="2. The seven steps, with every shape")
def merge_heads(t: Trial) -> None:
    t.error_hints = {
        r"view size is not compatible|view\(\)": Mistake(
            "view-after-transpose",
            "after transpose(1, 2) the tensor is not contiguous, so .view fails: use "
            ".reshape(B, T, H * d_k) (or .contiguous().view(...))."),
    }
    cases = []
    for seed, (B, H, T, d_k) in enumerate([(2, 3, 5, 4), (1, 4, 6, 2), (3, 2, 7, 5)]):
        o = torch.randn(B, H, T, d_k, generator=seeded(100 + seed))
        cases.append((o, ref.merge_heads(o), eager_mistakes(_merge_mistakes(o))))
    for o, expected, mistakes in cases:
        got = t.call(o, case=describe_case(o=o))
        t.tensor(got, expected, what="merged", mistakes=mistakes, hint="o.transpose(1, 2).reshape(B, T, H * d_k)")


# --------------------------------------------------------------------------- 1.3


def _sdpa_mistakes(q, k, v):
    d_k, d_v = q.shape[-1], v.shape[-1]
    s = q @ k.transpose(-2, -1)
    weights = lambda: torch.softmax(s / math.sqrt(d_k), -1)  # noqa: E731
    mistakes = {
        Mistake("returned-weights",
                "you returned the attention weights softmax(q k^T / sqrt(d_k)) ([..., T_q, T_k]): "
                "the output is weights @ v ([..., T_q, d_v]), each query's weighted average of the "
                "values."): weights,
        Mistake("weights-times-k",
                "you averaged the keys (weights @ k): the weights mix the values, weights @ v. "
                "Keys only decide where a query looks; values are what it reads."):
            lambda: weights() @ k,
        Mistake("missing-scale", "you forgot to divide the scores by sqrt(d_k)."):
            lambda: torch.softmax(s, -1) @ v,
        Mistake("scaled-by-d_k", "you divided by d_k; divide by sqrt(d_k)."):
            lambda: torch.softmax(s / d_k, -1) @ v,
        Mistake("multiplied-by-sqrt-d_k", "you multiplied the scores by sqrt(d_k); divide by it."):
            lambda: torch.softmax(s * math.sqrt(d_k), -1) @ v,
        Mistake("pow-precedence-divides-by-2d_k",
                "d_k ** -1/2 (or / d_k ** 1/2) is (d_k ** -1) / 2 in Python: ** binds tighter than "
                "/, so the scores were divided by 2 d_k. Write d_k ** -0.5 or / math.sqrt(d_k)."):
            lambda: torch.softmax(s / (2 * d_k), -1) @ v,
        Mistake("scaled-by-sqrt-d_v",
                "you scaled by sqrt(d_v) (the value width); the scale is 1/sqrt(d_k), the "
                "query/key width."):
            lambda: torch.softmax(s / math.sqrt(d_v), -1) @ v,
        Mistake("softmax-over-queries",
                "softmax runs over the wrong axis: normalise over the keys, dim=-1 (each query's "
                "row sums to 1).",
                "softmax over the queries (dim=-2) instead of over the keys"):
            lambda: torch.softmax(s / math.sqrt(d_k), -2) @ v,
        Mistake("scaled-after-softmax",
                "you divided the weights by sqrt(d_k) after the softmax: the scale goes on the "
                "scores, inside it, softmax(q k^T / sqrt(d_k)) (after the softmax the rows no "
                "longer sum to 1)."):
            lambda: torch.softmax(s, -1) / math.sqrt(d_k) @ v,
        Mistake("transposed-weights",
                "you multiplied the transposed weights by v: row i of weights = softmax(q k^T / "
                "sqrt(d_k)) is query i's distribution over the keys, so the output is weights @ "
                "v."):
            lambda: weights().transpose(-2, -1) @ v,
        Mistake("applied-causal-mask",
                "no mask was asked for here: this is plain (bidirectional) attention.",
                "applied a causal mask in plain (unmasked) attention"):
            lambda: ref.scaled_dot_product_attention(
                q, k, v, ref.causal_mask(s.shape[-1]) if s.shape[-1] == s.shape[-2] else None),
        Mistake("no-softmax",
                "you multiplied by the scores, not by softmax(scores): the weights must be a "
                "softmax."):
            lambda: (s / math.sqrt(d_k)) @ v,
        Mistake("sigmoid-not-softmax",
                "you used a sigmoid: each weight is squashed on its own and a row does not sum to "
                "1. The weights are softmax(scores) over the keys, dim=-1."):
            lambda: torch.sigmoid(s / math.sqrt(d_k)) @ v,
        Mistake("normalised-without-exp",
                "you divided the scores by their sum without exp: softmax exponentiates first, "
                "exp(s) / sum exp(s) (negative scores then still give positive weights)."):
            lambda: ((s / math.sqrt(d_k)) / (s / math.sqrt(d_k)).sum(-1, keepdim=True)) @ v,
    }
    for axis in range(s.dim() - 2):  # a leading (batch or head) axis, e.g. F.softmax(scores, dim=1) on 4-D scores
        if s.shape[axis] > 1:
            mistakes[Mistake("softmax-over-batch-axis",
                             f"softmax runs over axis {axis} (size {s.shape[axis]}), a batch or "
                             "head axis: normalise over the keys, dim=-1 (each query's row sums to "
                             "1).",
                             "softmax over a batch or head axis instead of over the keys")] = (
                lambda axis=axis: torch.softmax(s / math.sqrt(d_k), axis) @ v)
    for axis in range(q.dim() - 1):  # d_k taken from another axis of q
        n = q.shape[axis]
        if n not in (1, d_k):
            queries = axis == q.dim() - 2
            which = "q.shape[-2], the number of queries T_q" if queries else f"q.shape[{axis}]"
            hint = (f"you divided by the square root of {which} (here {n}); d_k is the query/key "
                    "width, the last axis: q.shape[-1].")
            if queries:
                mistake = Mistake("scaled-by-sqrt-T_q", hint, "divided by sqrt(T_q), the number of "
                                  "queries, instead of sqrt(d_k)")
            else:
                mistake = Mistake("scaled-by-sqrt-of-leading-axis", hint, "divided by the square "
                                  "root of a batch or head axis instead of sqrt(d_k)")
            mistakes[mistake] = lambda n=n: torch.softmax(s / math.sqrt(n), -1) @ v
    return mistakes


@exercise("1.3", "scaled dot-product attention", points=1, stars=1, notebook=NB,
          section="1. What queries, keys and values are for")
def scaled_dot_product_attention(t: Trial) -> None:
    t.error_hints = {
        r"cannot be multiplied|must match the size|size of tensor a|"
        r"Expected size for first two dimensions": Mistake(
            "matmul-shapes-do-not-fit",
            "a matrix product got shapes that do not fit: scores = q @ k.transpose(-2, -1) "
            "([..., T_q, d_k] @ [..., d_k, T_k]), then weights @ v ([..., T_q, T_k] @ "
            "[..., T_k, d_v]). Transpose the last two axes of k, not of q or v."),
    }
    # (leading dims, T_q, T_k, d_k, d_v): T != d_k everywhere; cross-attention and d_v != d_k included.
    cases = []
    for seed, (lead, T_q, T_k, d_k, d_v) in enumerate([((2, 3), 5, 5, 4, 4), ((2,), 3, 6, 8, 5), ((1, 2), 7, 7, 6, 3),
                                                       ((), 4, 9, 2, 7)]):
        g = seeded(200 + seed)
        q = torch.randn(*lead, T_q, d_k, generator=g) * 1.5
        k = torch.randn(*lead, T_k, d_k, generator=g) * 1.5
        v = torch.randn(*lead, T_k, d_v, generator=g)
        cases.append((q, k, v, ref.scaled_dot_product_attention(q, k, v), eager_mistakes(_sdpa_mistakes(q, k, v))))
    for q, k, v, expected, mistakes in cases:
        got = t.call(q, k, v, case=describe_case(q=q, k=k, v=v))
        t.tensor(got, expected, mistakes=mistakes,
                 hint="torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(d_k), dim=-1) @ v")
