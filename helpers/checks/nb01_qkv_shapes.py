"""Checks for notebook 01_qkv_shapes (its exercises: helpers/registry.py).

Every case and its expected output are built before the learner's function first runs; the
mistakes each check recognises are outputs of known wrong implementations, named at the first
failure; the ``hint=`` of a comparison is the full recipe, shown only when the check fails again.
"""

from __future__ import annotations

import itertools
import math

import torch

from .. import nb01_qkv_shapes as ref
from ..registry import in_module
from .core import Trial, describe_case, eager_mistakes, exercise, seeded
from .feedback import Mistake
from .guard import _allclose, _isfinite

__all__ = in_module(__name__)  # its exercises' checks, as helpers/registry.py lists them

# Shapes are chosen so that no two of B, T, H, d_k are equal: a transposed or swapped axis
# then shows up as a wrong shape or wrong values, never as a lucky pass.
_QKV_CASES = [(2, 5, 12, 3), (1, 7, 8, 2), (3, 4, 30, 5)]  # (B, T, D, H)


# --------------------------------------------------------------------------- 1.1


_AXES = ("B", "H", "T", "d_k")


def _close(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """What the comparison accepts (a passing output needs no diagnosis)."""
    return (got.shape == expected.shape and got.dtype == expected.dtype
            and _allclose(got.detach().double(), expected.double(), atol=1e-5, rtol=1e-4))


def _qkv_mistakes(x: torch.Tensor, w: torch.Tensor, H: int, expected: tuple, i: int) -> dict:
    """hint -> output i (0: q, 1: k, 2: v) of a known wrong projection or head split (for eager_mistakes).
    Every hint is the same text on every case, so that a case the learner passed refutes it."""
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
        Mistake("d_k-major-head-split",
                "you viewed the projection as [B, T, d_k, H] (D // H before H) and transposed: the head axis "
                "comes first, view(B, T, H, D // H), then transpose(1, 2) to [B, H, T, d_k]."):
            lambda: proj().view(B, T, d_k, H).transpose(1, 2),
        Mistake("transposed-before-split",
                "you transposed the projection to [B, D, T] before splitting it into heads: a head's numbers "
                "are columns of one token's row, so split [B, T, D] as it is, view(B, T, H, d_k), then "
                "transpose(1, 2)."):
            lambda: proj().transpose(1, 2).reshape(B, H, T, d_k),
        Mistake("did-not-split-heads",
                "you returned the projection without splitting it into heads ([B, T, D]): view it as [B, T, H, "
                "D // H], then transpose(1, 2) to [B, H, T, d_k]."):
            lambda: proj(),
        Mistake("forgot-the-projection",
                f"your {name} is x itself, split into heads: project first, x @ w_qkv ([B, T, 3D]), then take "
                f"{name}'s block of D columns and split that into heads.",
                "split x into heads without projecting it by w_qkv"):
            lambda: ref.split_heads(x, H),
        Mistake("transposed-w_qkv",
                "the projection is x @ w_qkv (w_qkv is [D, 3D]); x @ w_qkv.T or w_qkv @ x mixes "
                "the wrong axes.",
                "projected with w_qkv transposed (x @ w_qkv.T or w_qkv @ x)"):
            lambda: ref.split_heads((x @ w.T.reshape(D, 3 * D)).split(D, dim=-1)[i], H),
        Mistake("w_qkv-as-stacked-matrices",
                f"your {name} is x @ w_qkv.reshape(3, D, D)[{i}], split into heads: that cuts w_qkv's numbers, in "
                "memory order, into three D x D matrices (the first is the first third of w_qkv's rows, across "
                "Q's, K's and V's columns alike). w_qkv is [D, 3D] with "
                f"Q, K, V side by side: {name}'s weights are the columns w_qkv[:, {('0:D', 'D:2D', '2D:3D')[i]}] "
                "(q = 0:D, k = D:2D, v = 2D:3D).",
                "read w_qkv as three stacked D x D matrices (w_qkv.reshape(3, D, D))"):
            lambda: ref.split_heads(x @ w.reshape(3, D, D)[i], H),
        Mistake("w_qkv-as-transposed-stacked-matrices",
                f"your {name} is x @ w_qkv.reshape(3, D, D)[{i}].T, split into heads: that cuts w_qkv's numbers, "
                "in memory order, into three D x D matrices (and transposes each). w_qkv is [D, 3D] with Q, K, V "
                "side by side, used as it is: q = x @ w_qkv[:, :D], k = x @ w_qkv[:, D:2D], v = x @ w_qkv[:, 2D:].",
                "read w_qkv as three stacked D x D matrices and transposed each"):
            lambda: ref.split_heads(x @ w.reshape(3, D, D)[i].T, H),
        Mistake("transposed-each-w_qkv-block",
                f"your {name} is x @ W.T with W = {name}'s D x D block of w_qkv (the nn.Linear habit, x @ W.T): "
                "here w_qkv is [D, 3D] and multiplies x as it is, so each block is used untransposed: "
                "q = x @ w_qkv[:, :D], k = x @ w_qkv[:, D:2D], v = x @ w_qkv[:, 2D:] (or (x @ w_qkv).split(D, -1)).",
                "transposed each D x D block of w_qkv (x @ W.T per block)"):
            lambda: ref.split_heads(x @ w.split(D, dim=1)[i].T, H),
    }
    for words, factor in (("sqrt(d_k)", math.sqrt(d_k)), ("sqrt(D)", math.sqrt(D)), ("d_k", d_k)):
        mistakes[Mistake("scaled-the-projection",
                         f"your {name} is the projection divided by {words}: qkv_projection only projects and splits "
                         "into heads, with no scale; the 1/sqrt(d_k) belongs to the scores, q @ k^T / sqrt(d_k).",
                         "scaled q, k or v in the projection")] = lambda factor=factor: expected[i] / factor
    for perm in itertools.permutations(range(4)):
        if perm not in ((0, 1, 2, 3), (0, 2, 1, 3)):  # (0, 2, 1, 3): split-without-transpose, above
            order = ", ".join(_AXES[a] for a in perm)
            mistakes[Mistake("axes-in-wrong-order",
                             f"your {name} has the right numbers with its axes in the order [{order}]; the contract "
                             "is [B, H, T, d_k]: view the projection as [B, T, H, d_k], then transpose(1, 2) only.",
                             "returned q, k, v with their axes in another order than [B, H, T, d_k]")] = (
                lambda perm=perm: expected[i].permute(*perm))
    for j, other in enumerate("qkv"):
        if j != i:
            mistakes[Mistake("wrong-qkv-columns",
                             f"your {name} holds the {other} columns: w_qkv's columns are Q, K, V "
                             "in that order (q = columns 0:D, k = D:2D, v = 2D:3D).",
                             "took q, k or v from the wrong columns of x @ w_qkv")] = lambda j=j: expected[j]
    return mistakes


def _column_diagnosis(got, x: torch.Tensor, w: torch.Tensor, H: int, i: int) -> str:
    """Where the numbers of output i come from, when each (head, feature) of it is, for every token, one
    column of x @ w_qkv, but not the right one: a fused layout read another way, or heads taken from
    other columns. '' when that does not hold."""
    try:
        B, T, D = x.shape
        d_k = D // H
        want = ref.qkv_projection(x, w, H)[i]
        if type(got) is not torch.Tensor or not got.is_floating_point() or _close(got, want):
            return ""
        if tuple(got.shape) != (B, H, T, d_k):  # the core states a reshape of the right numbers
            return ""
        P = (x.double() @ w.double()).reshape(B * T, 3 * D)
        G = got.detach().double().permute(0, 2, 1, 3).reshape(B * T, D)  # column h * d_k + d: head h, feature d
        if not bool(_isfinite(G).all()):
            return ""
        gap = (G[:, :, None] - P[:, None, :]).abs().amax(0)  # [D, 3D]: how far column j is from column c
        tol = 1e-4 * (1 + P.abs().amax())
        src = []
        for j in range(D):
            found = (gap[j] <= tol).nonzero().flatten().tolist()
            if len(found) != 1:
                return ""
            src.append(found[0])
        right = [i * D + j for j in range(D)]
        if src == right:
            return ""
        name = "qkv"[i]
        if src == [3 * j + i for j in range(D)]:
            return Mistake("fused-columns-interleaved",
                           f"your {name} takes every third column of x @ w_qkv (column 3j + {i}): you read w_qkv's "
                           "columns as (q, k, v) interleaved per feature, e.g. view(D, D, 3). They are three blocks: "
                           "q = columns 0:D, k = D:2D, v = 2D:3D; then head h is columns h*d_k:(h+1)*d_k of its block.",
                           "read w_qkv's columns as q, k, v interleaved instead of three blocks")
        if src == [h * 3 * d_k + i * d_k + d for h in range(H) for d in range(d_k)]:
            return Mistake("per-head-qkv-layout",
                           "you read x @ w_qkv as a per-head [q, k, v] layout (view(B, T, H, 3, d_k), GPT-NeoX "
                           "style): here its columns are three blocks, Q, K, V, each D wide. Split into q, k, v "
                           "first (split(D, dim=-1)), then each into heads.",
                           "read the fused projection as per-head [q, k, v] blocks")
        bad = [j for j in range(D) if src[j] != right[j]]
        h, d = divmod(bad[0], d_k)
        head = [src[h * d_k + e] for e in range(d_k)]
        want = f"{right[h * d_k]}..{right[h * d_k] + d_k - 1}"
        return Mistake("heads-from-wrong-columns",
                       f"the numbers are columns of x @ w_qkv, but not the right ones: head {h} of your {name} is "
                       f"columns {head} of x @ w_qkv, where it should be columns {want} ({name} is the block of "
                       f"columns {i * D}..{i * D + D - 1}, and head h its columns h*d_k:(h+1)*d_k).",
                       "took the heads from the wrong columns of x @ w_qkv")
    except Exception:  # noqa: BLE001 - a diagnosis never breaks a check
        return ""


@exercise()
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
        expected = ref.qkv_projection(x, w, H)
        cases.append((x, w, H, expected, [eager_mistakes(_qkv_mistakes(x, w, H, expected, i)) for i in range(3)]))
    for x, w, H, expected, mistakes in cases:
        got = t.tuple(t.call(x, w, H, case=describe_case(x=x, w_qkv=w, n_heads=H)), 3, ("q", "k", "v"))
        for i, name in enumerate("qkv"):
            t.tensor(got[i], expected[i], what=name, mistakes=mistakes[i],
                     diagnosis=_column_diagnosis(got[i], x, w, H, i),
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
                "your columns are d_k-major: column d*H + h holds head h's feature d, because the head axis ended "
                "up after d_k ([B, T, d_k, H]). Head h must occupy columns h*d_k:(h+1)*d_k: order the axes [B, T, "
                "H, d_k] (transpose(1, 2), or einsum 'bhtd->bthd') before merging the last two.",
                "merged the heads d_k-major (column d*H + h) instead of head by head"):
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
        Mistake("averaged-heads",
                "every block of d_k columns of your result holds the average of the heads: merging places head h "
                "itself, unchanged, in columns h*d_k:(h+1)*d_k (a concatenation, not a mean repeated H times).",
                "averaged the heads (and repeated the mean H times)"):
            lambda: o.mean(dim=1).repeat(1, 1, H),
        Mistake("summed-heads",
                "every block of d_k columns of your result holds the sum of the heads: merging places head h "
                "itself, unchanged, in columns h*d_k:(h+1)*d_k (a concatenation, not a sum repeated H times).",
                "summed the heads (and repeated the sum H times)"):
            lambda: o.sum(dim=1).repeat(1, 1, H),
        Mistake("kept-one-head",
                "your result is one head's output ([B, T, d_k]): merging keeps all H heads, head h in columns "
                "h*d_k:(h+1)*d_k of a [B, T, H * d_k] result.",
                "kept only one head instead of merging all of them"):
            lambda: o[:, 0],
        Mistake("kept-one-head",
                "your result is the last head's output ([B, T, d_k]): merging keeps all H heads, head h in "
                "columns h*d_k:(h+1)*d_k of a [B, T, H * d_k] result.",
                "kept only one head instead of merging all of them"):
            lambda: o[:, -1],
        Mistake("transposed-T-and-d_k",
                "you swapped axes 2 and 3 (T and d_k); the axes to swap are 1 and 2 (H and T): "
                "o.transpose(1, 2).reshape(B, T, H * d_k)."):
            lambda: o.transpose(2, 3).reshape(B, T, H * d_k),
    }


def _merge_diagnosis(got, o: torch.Tensor, expected: torch.Tensor) -> str:
    """What a wrong merge of the right shape did with o's numbers, when it returned them all, once each: mixed
    the batch elements, mixed the tokens, or put the heads' columns in another order. '' when that does not
    hold (a sum, a mean, another shape: the core states a reshape of the right numbers)."""
    try:
        B, H, T, d_k = o.shape
        if type(got) is not torch.Tensor or got.numel() != o.numel() or not got.is_floating_point() or _close(got, expected):
            return ""
        g = got.detach().double()
        if not bool(_isfinite(g).all()):
            return ""
        if tuple(got.shape) != tuple(expected.shape):  # the core states a reshape of the right numbers
            return ""
        # Where each entry of got comes from in o: its values are distinct (random normals).
        flat = o.detach().double().flatten()
        order = flat.argsort()
        values = flat[order]
        pos = torch.searchsorted(values, g.flatten()).clamp(max=values.numel() - 1)
        below = (pos - 1).clamp(min=0)
        pick = torch.where((values[below] - g.flatten()).abs() < (values[pos] - g.flatten()).abs(), below, pos)
        if not _allclose(values[pick], g.flatten(), atol=1e-7, rtol=1e-6) or pick.unique().numel() != flat.numel():
            return ""
        src = order[pick].reshape(B, T, H * d_k)
        b_src = src // (H * T * d_k)
        h_src = src // (T * d_k) % H
        t_src = src // d_k % T
        d_src = src % d_k
        b = torch.arange(B).view(B, 1, 1)
        t = torch.arange(T).view(1, T, 1)
        if bool((b_src != b).any()):
            return Mistake(
                "mixed-batch-elements",
                "your rows mix the batch elements: a row [b, t] of your result holds numbers of other batch "
                "elements than b. The batch axis must stay first, untouched: swap only H and T (transpose(1, 2)), "
                "then merge the last two axes.",
                "moved the batch axis (rows hold numbers of other batch elements)")
        if bool((t_src != t).any()):
            return Mistake(
                "mixed-tokens",
                "row t of your result holds numbers of other tokens: the token axis got mixed with the heads or "
                "the features. Order the axes [B, T, H, d_k] first (transpose(1, 2)), then merge the last two.",
                "mixed the tokens (row t holds numbers of other tokens)")
        blocks = h_src[0, 0].view(H, d_k)
        if bool((d_src[0, 0].view(H, d_k) == torch.arange(d_k)).all()) and bool((blocks == blocks[:, :1]).all()):
            heads = blocks[:, 0].tolist()
            if sorted(heads) == list(range(H)) and bool((h_src == h_src[:1, :1]).all()):
                where = ", ".join(f"block {i} holds head {h}" for i, h in enumerate(heads) if i != h)
                return Mistake(
                    "heads-in-wrong-order",
                    f"your column blocks hold the heads in another order ({where}): head h goes, unchanged, to "
                    "columns h*d_k:(h+1)*d_k, in the order 0, 1, ..., H - 1.",
                    "concatenated the heads in another order than 0..H-1")
        return ""
    except Exception:  # noqa: BLE001 - a diagnosis never breaks a check
        return ""


@exercise()
def merge_heads(t: Trial) -> None:
    t.error_hints = {
        r"view size is not compatible|view\(\)": Mistake(
            "view-after-transpose",
            "after transpose(1, 2) the tensor is not contiguous, so .view fails: use "
            ".reshape(B, T, H * d_k) (or .contiguous().view(...))."),
    }
    cases = []
    # The last case is float64: a merge that returns another dtype (.float(), a fresh float32 tensor) shows.
    for seed, (B, H, T, d_k, dtype) in enumerate([(2, 3, 5, 4, torch.float32), (1, 4, 6, 2, torch.float32),
                                                  (3, 2, 7, 5, torch.float32), (2, 5, 3, 6, torch.float64)]):
        o = torch.randn(B, H, T, d_k, generator=seeded(100 + seed), dtype=dtype)
        cases.append((o, ref.merge_heads(o), eager_mistakes(_merge_mistakes(o))))
    for o, expected, mistakes in cases:
        got = t.call(o, case=describe_case(o=o))
        t.tensor(got, expected, what="merged", mistakes=mistakes, diagnosis=_merge_diagnosis(got, o, expected),
                 hint="o.transpose(1, 2).reshape(B, T, H * d_k)")


# --------------------------------------------------------------------------- 1.3


def _naive_softmax(s: torch.Tensor, shift: torch.Tensor | float = 0.0) -> torch.Tensor:
    e = torch.exp(s - shift)
    return e / e.sum(-1, keepdim=True)


def _sdpa_mistakes(q, k, v):
    """hint -> a zero-argument callable giving the output of a known wrong attention (for eager_mistakes).
    Every hint is the same text on every case, so that a case the learner passed refutes it."""
    d_k, d_v = q.shape[-1], v.shape[-1]
    T_q, T_k = q.shape[-2], k.shape[-2]
    s = q @ k.transpose(-2, -1)
    scaled = s / math.sqrt(d_k)
    weights = lambda: torch.softmax(scaled, -1)  # noqa: E731
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
        Mistake("scaled-by-sqrt-T_q",
                "you divided by the square root of q.shape[-2], the number of queries T_q; d_k is the query/key "
                "width, the last axis: q.shape[-1].",
                "divided by sqrt(T_q), the number of queries, instead of sqrt(d_k)"):
            lambda: torch.softmax(s / math.sqrt(T_q), -1) @ v,
        Mistake("scaled-by-sqrt-T_k",
                "you divided by the square root of k.shape[-2], the number of keys T_k; d_k is the query/key "
                "width, the last axis: q.shape[-1].",
                "divided by sqrt(T_k), the number of keys, instead of sqrt(d_k)"):
            lambda: torch.softmax(s / math.sqrt(T_k), -1) @ v,
        Mistake("floored-sqrt-d_k",
                "you rounded sqrt(d_k) down to a whole number (int(), math.isqrt or //): when d_k is not a "
                "perfect square that changes the scale. Divide by math.sqrt(d_k) itself.",
                "divided by int(sqrt(d_k)), sqrt(d_k) rounded down"):
            lambda: torch.softmax(s / math.floor(math.sqrt(d_k)), -1) @ v,
        Mistake("rounded-sqrt-d_k",
                "you rounded sqrt(d_k) to the nearest whole number (round()): when d_k is not a perfect square "
                "that changes the scale. Divide by math.sqrt(d_k) itself.",
                "divided by round(sqrt(d_k))"):
            lambda: torch.softmax(s / round(math.sqrt(d_k)), -1) @ v,
        Mistake("softmax-over-queries",
                "softmax runs over the wrong axis: normalise over the keys, dim=-1 (each query's "
                "row sums to 1).",
                "softmax over the queries (dim=-2) instead of over the keys"):
            lambda: torch.softmax(scaled, -2) @ v,
        Mistake("softmax-over-whole-matrix",
                "you normalised over the whole [T_q, T_k] score matrix at once: the softmax is over each query's "
                "row of keys, dim=-1, so that every row sums to 1.",
                "softmax over the whole score matrix instead of each row"):
            lambda: torch.softmax(scaled.flatten(-2), -1).view_as(scaled) @ v,
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
        Mistake("no-softmax",
                "you multiplied by the scores, not by softmax(scores): the weights must be a "
                "softmax."):
            lambda: scaled @ v,
        Mistake("sigmoid-not-softmax",
                "you used a sigmoid: each weight is squashed on its own and a row does not sum to "
                "1. The weights are softmax(scores) over the keys, dim=-1."):
            lambda: torch.sigmoid(scaled) @ v,
        Mistake("normalised-without-exp",
                "you divided the scores by their sum without exp: softmax exponentiates first, "
                "exp(s) / sum exp(s) (negative scores then still give positive weights)."):
            lambda: (scaled / scaled.sum(-1, keepdim=True)) @ v,
        Mistake("log-softmax-weights",
                "you used log_softmax as the weights: the weights are softmax(scores), positive and summing to 1 "
                "over the keys (log_softmax(s).exp() is the same thing).",
                "used log_softmax, not softmax, as the weights"):
            lambda: torch.log_softmax(scaled, -1) @ v,
        Mistake("transposed-output",
                "your output is transposed, [..., d_v, T_q]: weights @ v is already [..., T_q, d_v], one row per "
                "query; return it as it is.",
                "returned the output transposed ([..., d_v, T_q])"):
            lambda: (weights() @ v).transpose(-2, -1),
        Mistake("softmax-overflow",
                "your softmax overflows: exp of a large score (here above 88, in float32) is inf, and inf / inf "
                "is NaN. Subtract each row's maximum before exp (softmax does not change), or use torch.softmax.",
                "exponentiated the scores without subtracting the row's maximum (overflow to NaN)"):
            lambda: _naive_softmax(scaled) @ v,
        Mistake("subtracted-global-max",
                "you subtracted one maximum shared by many rows (of all the scores, or of each score matrix), not "
                "each row's own: in a row whose scores are all far below it, every exp underflows to 0, and 0 / 0 "
                "is NaN. Subtract the row's maximum, s.amax(dim=-1, keepdim=True), or use torch.softmax.",
                "subtracted a maximum shared by many rows, not each row's own, before exp"):
            # every score matrix of the case that shows it holds the largest score: one model for both
            lambda: _naive_softmax(scaled, scaled.max()) @ v,
        Mistake("subtracted-column-max",
                "you subtracted the maximum over the queries (dim=-2) before exp: softmax over the keys is "
                "unchanged only by subtracting a number per row, the row's maximum, s.amax(dim=-1, keepdim=True).",
                "subtracted the column maximum (over the queries) before exp"):
            lambda: _naive_softmax(scaled, scaled.amax(-2, keepdim=True)) @ v,
        Mistake("applied-causal-mask",
                "no mask was asked for here: this is plain (bidirectional) attention, every query reads every key.",
                "applied a causal mask in plain (unmasked) attention"):
            lambda: ref.scaled_dot_product_attention(q, k, v, torch.ones(T_q, T_k, dtype=torch.bool).tril()),
        Mistake("applied-causal-mask",
                "no mask was asked for here: this is plain (bidirectional) attention, every query reads every key "
                "(your output is masked as a causal mask aligned on the last key would).",
                "applied a causal mask in plain (unmasked) attention"):
            lambda: ref.scaled_dot_product_attention(
                q, k, v, torch.ones(T_q, T_k, dtype=torch.bool).tril(diagonal=T_k - T_q)),
    }
    for axis in range(s.dim() - 2):  # a leading (batch or head) axis, e.g. F.softmax(scores, dim=1) on 4-D scores
        if s.shape[axis] > 1:
            mistakes[Mistake("softmax-over-batch-axis",
                             f"softmax runs over axis {axis}, a batch or head axis: normalise over the keys, dim=-1 "
                             "(each query's row sums to 1).",
                             "softmax over a batch or head axis instead of over the keys")] = (
                lambda axis=axis: torch.softmax(scaled, axis) @ v)
    for axis in range(q.dim() - 2):  # d_k taken from a leading axis of q
        n = q.shape[axis]
        if n not in (1, d_k):
            mistakes[Mistake("scaled-by-sqrt-of-leading-axis",
                             f"you divided by the square root of q.shape[{axis}], a batch or head axis; d_k is the "
                             "query/key width, the last axis: q.shape[-1].",
                             "divided by the square root of a batch or head axis instead of sqrt(d_k)")] = (
                lambda n=n: torch.softmax(s / math.sqrt(n), -1) @ v)
    if q.dim() >= 4 and q.shape[-3] > 1:  # [B, H, T, d_k]: d_model = H * d_k
        mistakes[Mistake("scaled-by-sqrt-d_model",
                         "you divided by sqrt(d_model) = sqrt(H * d_k), the model width; the scale is sqrt(d_k), "
                         "one head's query/key width, q.shape[-1].",
                         "divided by sqrt(d_model) instead of sqrt(d_k)")] = (
            lambda: torch.softmax(s / math.sqrt(q.shape[-3] * d_k), -1) @ v)
    return mistakes


def _another_scale(got, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, expected: torch.Tensor) -> str:
    """When the output is attention with the scores divided by another number X than sqrt(d_k), that
    number, found by a search (softmax(s / X) @ v moves smoothly with X); '' when no X gives it."""
    try:
        if (type(got) is not torch.Tensor or got.shape != expected.shape or not bool(_isfinite(got).all())
                or _close(got, expected)):
            return ""
        s = (q.double() @ k.double().transpose(-2, -1))
        g = got.detach().double()
        vd = v.double()
        err = lambda log_x: (torch.softmax(s / math.exp(log_x), -1) @ vd - g).abs().max().item()  # noqa: E731
        grid = [i / 8 for i in range(-24, 81)]  # X from e^-3 to e^10
        best = min(grid, key=err)
        lo, hi = best - 1 / 8, best + 1 / 8
        for _ in range(40):  # golden-section search around the best grid point
            m1, m2 = lo + (hi - lo) * 0.382, lo + (hi - lo) * 0.618
            lo, hi = (lo, m2) if err(m1) < err(m2) else (m1, hi)
        log_x = (lo + hi) / 2
        x = math.exp(log_x)
        model = torch.softmax(s / x, -1) @ vd
        d_k = q.shape[-1]
        if abs(x / math.sqrt(d_k) - 1) < 1e-6 or not _allclose(g, model, atol=1e-5, rtol=1e-4):
            return _lost_precision(g, expected.double())
        return Mistake("divided-by-another-number",
                       f"your output is softmax(q k^T / X) @ v with X = {x:.4g}: the scores were divided by another "
                       f"number than sqrt(d_k) = {math.sqrt(d_k):.4g}, the square root of the query/key width "
                       f"q.shape[-1] = {d_k}.",
                       "divided the scores by another number than sqrt(d_k)")
    except Exception:  # noqa: BLE001 - a diagnosis never breaks a check
        return ""


_LOST_PRECISION = Mistake(
    "lost-precision",
    "your output agrees with the expected one to only 2 or 3 significant digits: part of the computation ran in a "
    "lower precision (float16 or bfloat16: .half(), .bfloat16(), autocast) and was cast back. Compute in the "
    "inputs' own dtype.",
    "computed in float16/bfloat16 and cast back (precision lost)")


def _lost_precision(g: torch.Tensor, e: torch.Tensor) -> str:
    """Rounding-size errors (at most 1/64 of the output's size) that go both ways and are not one factor per
    row (as a changed softmax denominator would give): precision lost somewhere."""
    diff = g - e
    big = diff.abs().max().item()
    if not 0 < big <= e.abs().max().item() / 64:
        return ""
    if diff.mean().abs().item() > 0.3 * diff.abs().mean().item():  # one-sided: a bias, not rounding
        return ""
    per_row = (g * e).sum(-1, keepdim=True) / (e * e).sum(-1, keepdim=True).clamp_min(1e-30)
    if _allclose(g, per_row * e, atol=1e-5, rtol=1e-4):
        return ""
    return _LOST_PRECISION


def _overflow_case(g: torch.Generator) -> tuple:
    """q, k, v [2, 6, 4], [2, 5, 4], [2, 5, 3] in which rows 0 and 2 (batch 0), 1 and 4 (batch 1) of the
    scaled scores reach 120 on one key, 60 above the others, while the other rows stay near 0: a softmax
    without the row's maximum subtracted overflows there (exp(120) is inf in float32), one that
    subtracts a maximum shared by all rows underflows in the others. The large scores are exact in
    float32 (d_k = 4, sqrt(d_k) = 2), and their rows one-hot, so every correct way of computing agrees."""
    q = torch.randn(2, 6, 4, generator=g) * 0.5
    k = torch.randn(2, 5, 4, generator=g).clamp(-1.5, 1.5)
    v = torch.randn(2, 5, 3, generator=g)
    for b, rows, key, axis in ((0, (0, 2), 3, 1), (1, (1, 4), 0, 2)):
        k[b, key, axis] = 4.0
        for r in rows:
            q[b, r] = 0.0
            q[b, r, axis] = 60.0  # score 60 * 4 / 2 = 120 on `key`, at most 60 * 1.5 / 2 = 45 elsewhere
    return q, k, v


@exercise()
def scaled_dot_product_attention(t: Trial) -> None:
    t.error_hints = {
        r"cannot be multiplied|must match the size|size of tensor a|"
        r"Expected size for first two dimensions": Mistake(
            "matmul-shapes-do-not-fit",
            "a matrix product got shapes that do not fit: scores = q @ k.transpose(-2, -1) "
            "([..., T_q, d_k] @ [..., d_k, T_k]), then weights @ v ([..., T_q, T_k] @ "
            "[..., T_k, d_v]). Transpose the last two axes of k only, not q, v or the weights."),
    }
    # (leading dims, T_q, T_k, d_k, d_v). T_q, T_k and d_k differ in every case but the square one, so that a
    # scale by a length is told from another and from d_k; d_v != d_k; d_k = 8, 6 and 2 are not squares.
    # The square case is self-attention; the case after it has scores of 120 (exp overflows float32).
    cases = []
    shapes = [((2, 3), 5, 7, 4, 6), ((2,), 3, 6, 8, 5), ((1, 2), 7, 4, 6, 3), ((), 4, 9, 2, 7), ((2,), 5, 5, 3, 4)]
    for seed, (lead, T_q, T_k, d_k, d_v) in enumerate(shapes):
        g = seeded(200 + seed)
        q = torch.randn(*lead, T_q, d_k, generator=g) * 1.5
        k = torch.randn(*lead, T_k, d_k, generator=g) * 1.5
        v = torch.randn(*lead, T_k, d_v, generator=g)
        cases.append((q, k, v))
    cases.append(_overflow_case(seeded(200 + len(shapes))))
    # float64 inputs: an output computed in (or cast to) float32 shows as a dtype not kept.
    g = seeded(201 + len(shapes))
    cases.append((torch.randn(3, 6, 5, generator=g, dtype=torch.float64) * 1.5,
                  torch.randn(3, 4, 5, generator=g, dtype=torch.float64) * 1.5,
                  torch.randn(3, 4, 2, generator=g, dtype=torch.float64)))
    cases = [(q, k, v, ref.scaled_dot_product_attention(q, k, v), eager_mistakes(_sdpa_mistakes(q, k, v)))
             for q, k, v in cases]
    for q, k, v, expected, mistakes in cases:
        got = t.call(q, k, v, case=describe_case(q=q, k=k, v=v))
        t.tensor(got, expected, mistakes=mistakes, diagnosis=_another_scale(got, q, k, v, expected),
                 hint="torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(d_k), dim=-1) @ v")
