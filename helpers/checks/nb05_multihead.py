"""Checks for notebook 05_multihead (its exercises: helpers/registry.py).

Every case and every output it is compared with (the reference's and those of the recognised
mistakes) is computed before the learner's function runs. Shapes: no two of B, T, H, d_k equal,
so that a split or merge without its transpose changes values, and W_O is not symmetric, so that
applying it transposed shows.
"""

from __future__ import annotations

import math

import torch

from .. import nb05_multihead as ref
from ..nb01_qkv_shapes import merge_heads, split_heads
from ..nb03_masks import causal_mask, masked_softmax
from ..registry import in_module
from .core import Trial, describe_case, draw, eager_mistakes, exercise, flipped_causal, seeded
from .feedback import Mistake, wrong_signature

__all__ = in_module(__name__)  # its exercises' checks, as helpers/registry.py lists them


# (B, T, D, H): d_k = D / H; no two of B, T, H, d_k equal.
_MHA_CASES = [(2, 5, 12, 3), (1, 7, 24, 4), (3, 6, 20, 5)]



def _weights(B: int, T: int, D: int, seed: int, dtype=torch.float32):
    g = seeded(seed)
    x = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    w_qkv = torch.randn(D, 3 * D, generator=g, dtype=torch.float64) * (1.5 / math.sqrt(D))
    w_o = torch.randn(D, D, generator=g, dtype=torch.float64) / math.sqrt(D)
    return x.to(dtype), w_qkv.to(dtype), w_o.to(dtype)


def _mha_model(x, w_qkv, w_o, H: int, causal: bool, split: str = "ok", merge: str = "ok",
               scale: str = "d_k", w_o_mode: str = "ok", mask: str = "ok", softmax_dim: int = -1) -> torch.Tensor:
    """A learner's multi-head attention in float64 with one mistake switched on."""
    B, T, D = x.shape
    d_k = D // H
    x64, w64, o64 = x.double(), w_qkv.double(), w_o.double()
    parts = (x64 @ w64).split(D, dim=-1)
    if split == "reshape":                       # [B, T, D] -> [B, H, T, d_k] by reshape alone
        q, k, v = (p.reshape(B, H, T, d_k) for p in parts)
    elif split == "per_head_qkv":                # columns read as [q_h, k_h, v_h] for each head h
        q, k, v = (x64 @ w64).view(B, T, H, 3, d_k).permute(3, 0, 2, 1, 4).unbind(0)
    elif split == "dk_major":                    # each head as .view(B, T, d_k, H)
        q, k, v = (p.view(B, T, d_k, H).permute(0, 3, 1, 2) for p in parts)
    else:
        q, k, v = (split_heads(p, H) for p in parts)
    s = q @ k.transpose(-2, -1) / {"d_k": math.sqrt(d_k), "D": math.sqrt(D), "none": 1.0}[scale]
    ones = torch.ones(T, T, dtype=torch.bool)
    allowed = {"ok": causal_mask(T), "off_by_one": ones.tril(1), "inverted": ones.triu()}[mask] if causal else None
    if softmax_dim == -1:
        p = masked_softmax(s, allowed)
    else:
        p = torch.softmax(s if allowed is None else s.masked_fill(~allowed, float("-inf")), dim=softmax_dim)
    o = p @ v                                    # [B, H, T, d_k]
    merged = o.reshape(B, T, D) if merge == "reshape" else merge_heads(o)
    y = {"ok": lambda m: m @ o64, "T": lambda m: m @ o64.T, "none": lambda m: m}[w_o_mode](merged)
    return y.to(x.dtype)


def _mha_mistakes(x, w_qkv, w_o, H: int, causal: bool) -> dict[str, torch.Tensor]:
    m = lambda **kw: lambda: _mha_model(x, w_qkv, w_o, H, **{"causal": causal, **kw})  # noqa: E731
    models = {
        Mistake("split-without-transpose",
                "you reshaped [B, T, D] straight to [B, H, T, d_k] when splitting into heads: that "
                "mixes the numbers of different tokens. View as [B, T, H, d_k] first, then "
                "transpose(1, 2)."):
            m(split="reshape"),
        Mistake("merge-without-transpose",
                "you merged [B, H, T, d_k] straight back to [B, T, D] without transpose(1, 2): "
                "head h's rows land on the wrong tokens. Transpose to [B, T, H, d_k] first, then "
                "reshape."):
            m(merge="reshape"),
        Mistake("split-and-merge-without-transpose",
                "you split and merged without transposing (reshape both ways): each token's "
                "numbers are scrambled across positions. View as [B, T, H, d_k], then "
                "transpose(1, 2)."):
            m(split="reshape", merge="reshape"),
        Mistake("scaled-by-sqrt-D",
                "you scaled the scores by 1/sqrt(D) (d_model); each head's scores are scaled by "
                "1/sqrt(d_k), d_k = D / H, the width of one head's queries and keys."):
            m(scale="D"),
        Mistake("unscaled-scores",
                "the scores are not scaled: divide q @ k^T by sqrt(d_k), d_k = D / H."):
            m(scale="none"),
        Mistake("w_o-transposed",
                "you applied w_o transposed: the contract is y = merged @ w_o (row r of w_o reads "
                "column r of the merged heads), not merged @ w_o.T."): m(w_o_mode="T"),
        Mistake("missing-output-projection",
                "the output projection is missing: return merged @ w_o, not the merged heads."):
            m(w_o_mode="none"),
        Mistake("softmax-over-queries",
                "you took the softmax over the queries (dim=-2): each query's weights over the "
                "keys must sum to 1, softmax(scores, dim=-1)."): m(softmax_dim=-2),
        Mistake("qkv-columns-grouped-per-head",
                "you split w_qkv's columns as if they were grouped per head (q, k, v of head 0, "
                "then of head 1, ...): the contract's columns are all of Q, then all of K, then "
                "all of V, (x @ w_qkv).split(D, dim=-1).",
                "split w_qkv's columns as if grouped per head (q, k, v of head 0, then head 1...)"):
            m(split="per_head_qkv"),
        Mistake("heads-viewed-as-d_k-by-H",
                "you split the heads as .view(B, T, d_k, H): the D columns are H blocks of d_k "
                "(head h is columns h*d_k:(h+1)*d_k), so .view(B, T, H, d_k).transpose(1, 2)."):
            m(split="dk_major"),
    }
    if causal:
        models[Mistake("mask-off-by-one",
                       "your causal mask lets each query read one key ahead (tril with "
                       "diagonal=1): keep keys j <= i, torch.ones(T, T).tril() with "
                       "diagonal 0.")] = m(mask="off_by_one")
        models[Mistake("inverted-mask",
                       "your causal mask is inverted (triu): it lets query i read keys j >= i, the "
                       "future, and hides the past; causal attention keeps j <= i "
                       "(tril).")] = m(mask="inverted")
    models.update(flipped_causal(causal, m))
    return eager_mistakes(models)


_MHA_RECIPE = ("q, k, v = (x @ w_qkv).split(D, dim=-1); each .view(B, T, H, d_k).transpose(1, 2); "
               "p = softmax(q @ k^T / sqrt(d_k)) (with the causal mask if causal); "
               "o = (p @ v).transpose(1, 2).reshape(B, T, D); return o @ w_o.")

_SHAPE_ERRORS = {
    r"shape '\[.*\]' is invalid|view size is not compatible": Mistake(
        "invalid-view", "split with .view(B, T, H, D // H).transpose(1, 2); "
        "after a transpose use .reshape (not .view) to merge.",
        "split or merged the heads with an invalid .view (e.g. .view after a transpose)"),
    r"cannot be multiplied|must match the size|size of tensor": Mistake(
        "per-head-shape-mismatch", "per-head tensors are [B, H, T, d_k]: scores are q @ "
        "k.transpose(-2, -1), [B, H, T, T], and the [T, T] causal mask broadcasts against them.",
        "combined per-head tensors (scores, mask) of mismatched shapes"),
    r"takes \d+ positional argument": wrong_signature(
        "multi_head_attention(x, w_qkv, w_o, n_heads, causal)."),
}


@exercise()
def multi_head_attention(t: Trial) -> None:
    t.error_hints = dict(_SHAPE_ERRORS)
    cases = []
    for i, (B, T, D, H) in enumerate(_MHA_CASES):
        for causal in (False, True):
            x, w_qkv, w_o = _weights(B, T, D, seed=500 + i)
            cases.append((x, w_qkv, w_o, H, causal))
    x, w_qkv, w_o = _weights(2, 4, 15, seed=510, dtype=torch.float64)  # float64 in, float64 out
    cases.append((x, w_qkv, w_o, 5, True))
    planned = [(c, ref.multi_head_attention(*c), _mha_mistakes(*c)) for c in cases]
    for (x, w_qkv, w_o, H, causal), expected, mistakes in planned:
        got = t.call(x, w_qkv, w_o, H, causal,
                     case=describe_case(x=x, w_qkv=w_qkv, w_o=w_o, n_heads=H, causal=causal))
        t.tensor(got, expected, what="y", mistakes=mistakes, hint=_MHA_RECIPE)


# =========================================================================== 5.2


def _count_mistakes(D: int, H: int, bias: bool) -> dict[str, int]:
    d_k = D // H
    m = {
        Mistake("missing-W_O",
                "W_O is missing: multi-head attention has four D x D matrices, W_Q, W_K, W_V and "
                "the output projection W_O."): 3 * D * D + (3 * D if bias else 0),
    }
    per_head = ("you counted per-head widths: H heads of d_k x d_k (which is D x d_k, one head's worth). Each "
                "head's projection reads the whole D-wide input, so it is D x d_k, and the H heads together "
                "are D x D per matrix: 4 D^2.")
    m[Mistake("per-head-widths", per_head)] = 4 * D * d_k + (4 * D if bias else 0)
    if bias:
        m[Mistake("per-head-widths-and-d_k-biases",
                  per_head + " (And the biases are four D-wide vectors, 4 D, not 4 d_k.)",
                  "counted per-head widths, for the matrices and the biases (d_k wide)")] = (
            4 * D * d_k + 4 * d_k)
        m[Mistake("per-head-widths-and-no-biases", per_head + " (Biases: 4 D.)",
                  "counted per-head widths and left out the biases")] = 4 * D * d_k
    per_matrix = ("you counted a D x D matrix per head: a head's projection is D x d_k, and the H heads of one "
                  "projection together make one D x D matrix, so 4 D^2 in all, whatever H.")
    m[Mistake("matrix-per-head", per_matrix)] = 4 * H * D * D + (4 * D if bias else 0)
    if bias:
        m[Mistake("matrix-and-biases-per-head", per_matrix + " (Biases: 4 D.)",
                  "counted a D x D matrix and a D-wide bias per head")] = 4 * H * D * D + 4 * H * D
        m[Mistake("d_k-wide-biases",
                  "the biases are miscounted: each bias is D wide (one number per output column of "
                  "its D x D matrix), not d_k wide: 4 D in all.",
                  "counted each bias d_k wide instead of D wide")] = 4 * D * D + 4 * d_k
        m.update({
            Mistake("missing-biases",
                    "bias=True, but the biases are missing: add one D-wide bias for each of W_Q, "
                    "W_K, W_V and W_O, 4 D more.",
                    "left out the biases although bias=True"): 4 * D * D,
            Mistake("one-bias-in-all",
                    "the biases are miscounted: there are four, one D-wide vector per projection "
                    "(Q, K, V and O), 4 D in all, not D.",
                    "counted one D-wide bias in all instead of four"): 4 * D * D + D,
            Mistake("three-biases",
                    "the biases are miscounted: W_O has a bias too, so there are four D-wide "
                    "vectors (4 D), not three.",
                    "counted three biases, leaving out W_O's"): 4 * D * D + 3 * D,
            Mistake("bias-per-head",
                    "the biases are miscounted: each projection has one D-wide bias (4 D in all), "
                    "not one per head per projection.",
                    "counted a D-wide bias per head per projection"): 4 * D * D + 4 * H * D,
            Mistake("biases-as-matrices",
                    "the biases are miscounted: 4 D, one D-wide vector per projection, not a D x D "
                    "matrix each.",
                    "counted each bias as a D x D matrix"): 8 * D * D,
        })
    else:
        m[Mistake("biases-counted-without-bias",
                  "bias=False: count the weights only, 4 D^2, without the 4 D biases.",
                  "counted the 4 D biases although bias=False")] = 4 * D * D + 4 * D
    return m


@exercise()
def mha_param_count(t: Trial) -> None:
    t.error_hints = {r"takes \d+ positional argument": wrong_signature(
        "mha_param_count(d_model, n_heads, bias).")}
    # The original Transformer (base), GPT-2 small, and small widths where every formula differs.
    cases = [(512, 8, False), (768, 12, True), (60, 4, True), (96, 3, False), (768, 12, False), (40, 5, True)]
    g = seeded(550)  # then one drawn from a seed: 2 to 8 heads of 2 to 16 dimensions, with or without bias
    H = draw(g, 2, 9)
    cases.append((H * draw(g, 2, 17), H, bool(draw(g, 0, 2))))
    planned = [(c, ref.mha_param_count(*c), _count_mistakes(*c)) for c in cases]
    for (D, H, bias), expected, mistakes in planned:
        got = t.call(D, H, bias, case=describe_case(d_model=D, n_heads=H, bias=bias))
        t.number(got, expected, what="parameters", integer=True, mistakes=mistakes,
                 hint="four D x D matrices (W_Q, W_K, W_V, W_O): 4 * d_model**2, plus 4 * d_model "
                      "if bias. The number of heads only decides how the columns are grouped.")


# =========================================================================== 5.3


def _ablate_models(x, w_qkv, w_o, H: int, head: int, causal: bool) -> dict[str, torch.Tensor]:
    B, T, D = x.shape
    d_k = D // H
    o = ref.head_outputs(x, w_qkv, H, causal)                    # [B, H, T, d_k]

    def zero_heads(which, rescale: float = 1.0) -> torch.Tensor:
        keep = torch.full((H, 1, 1), rescale, dtype=o.dtype)
        keep[which] = 0
        return merge_heads(o * keep) @ w_o

    def zero_query() -> torch.Tensor:
        q, k, v = ref.qkv_projection(x, w_qkv, H)
        q = q.clone()
        q[:, head] = 0                                           # uniform (or causal-average) weights
        p = masked_softmax(q @ k.transpose(-2, -1) / math.sqrt(d_k), causal_mask(T) if causal else None)
        return merge_heads(p @ v) @ w_o

    def zero_w_o_cols() -> torch.Tensor:
        w = w_o.clone()
        w[:, head * d_k:(head + 1) * d_k] = 0
        return merge_heads(o) @ w

    def strided() -> torch.Tensor:
        merged = merge_heads(o).clone()
        merged[..., head::H] = 0
        return merged @ w_o

    models = {}
    for j in range(H):
        if j != head:
            models[Mistake("zeroed-wrong-head",
                           f"you zeroed head {j}, not head {head}: heads are counted from 0, and "
                           f"head h is columns h*d_k:(h+1)*d_k of the merged heads (rows of W_O).",
                           "zeroed another head than `head` (heads are counted from 0)")] = (
                lambda j=j: zero_heads([j]))
    models.update({
        Mistake("zeroed-query",
                "you zeroed the head's query, not its output: a zero query gives uniform attention "
                "weights, so the head still outputs an average of its values. Zero the head's "
                "output o[:, head] (its d_k columns of the merged heads) before W_O."): zero_query,
        Mistake("zeroed-w_o-columns",
                "you zeroed columns of W_O (output features) instead of the rows that read head h: "
                "w_o[head*d_k:(head+1)*d_k, :] is head h's block (y = merged @ w_o)."):
            zero_w_o_cols,
        Mistake("rescaled-other-heads",
                "the other heads were rescaled (by H / (H - 1), as dropout does at training time): "
                "ablation removes one head and leaves the others exactly as they were."):
            lambda: zero_heads([head], H / (H - 1)),
        Mistake("kept-only-head",
                "you kept only head h and zeroed all the others: ablation zeroes head h and keeps "
                "the rest."): lambda: zero_heads([j for j in range(H) if j != head]),
        Mistake("zeroed-strided-columns",
                "you zeroed every H-th column of the merged heads: head h owns the contiguous "
                "columns h*d_k:(h+1)*d_k, not columns h, h + H, h + 2H, ..."): strided,
        Mistake("nothing-ablated",
                "nothing was ablated: the output equals multi_head_attention's. Zero head h's "
                "output before W_O."): lambda: merge_heads(o) @ w_o,
    })
    if causal:
        models[Mistake("ignored-causal",
                       "causal=True was ignored: the heads must attend causally, as in 5.1.")] = (
            lambda: ref.ablate_head(x, w_qkv, w_o, H, head, False))
    return eager_mistakes(models)


@exercise()
def ablate_head(t: Trial) -> None:
    t.error_hints = dict(_SHAPE_ERRORS)
    t.error_hints[r"takes \d+ positional argument"] = wrong_signature(
        "ablate_head(x, w_qkv, w_o, n_heads, head, causal).")
    t.error_hints[r"index .* out of bounds|out of range"] = Mistake(
        "head-out-of-range", "head is 0-based: 0 <= head < n_heads.",
        "indexed a head outside 0 .. n_heads - 1 (heads are counted from 0)")
    cases = []
    for i, ((B, T, D, H), head, causal) in enumerate([
        ((2, 5, 12, 3), 1, False), ((2, 5, 12, 3), 0, True), ((1, 7, 24, 4), 3, True),
        ((3, 6, 20, 5), 2, False), ((3, 6, 20, 5), 4, True),
    ]):
        x, w_qkv, w_o = _weights(B, T, D, seed=530 + i)
        cases.append((x, w_qkv, w_o, H, head, causal))
    planned = [(c, ref.ablate_head(*c), _ablate_models(*c)) for c in cases]
    for (x, w_qkv, w_o, H, head, causal), expected, mistakes in planned:
        got = t.call(x, w_qkv, w_o, H, head, causal,
                     case=describe_case(x=x, w_qkv=w_qkv, w_o=w_o, n_heads=H, head=head, causal=causal))
        t.tensor(got, expected, what="y", mistakes=mistakes,
                 hint="compute the heads' outputs o [B, H, T, d_k] as in 5.1, set o[:, head] = 0 (on a "
                      "copy, or multiply by a 0/1 mask over heads), then merge and apply w_o.")
