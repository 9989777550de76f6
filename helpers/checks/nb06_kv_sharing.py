"""Checks for notebook 06_kv_sharing (its exercises: helpers/registry.py).

Every case and every output it is compared with is computed before the learner's function runs.
Shapes: no two of B, H, H_kv, T, d (and d_c, d_h) are equal, and H_kv > 1 where the tiled and the
grouped (consecutive) layouts of the key/value heads must be told apart.

6.4 also runs the learner's function under the op-logging ``TorchDispatchMode`` that notebook 09's
checks use (:class:`helpers.checks.instruments.OpLog`): its contract forbids forming the per-head keys
``c_kv @ w_uk[h]``, and the cases are chosen so that any tensor holding them is recognisable by
its sizes. The key length T is prime and d_h is a power of two, while every other size is odd
(B may be 2): then a tensor whose number of elements is a multiple of T * d_h, or a matrix
product whose result has a d_h- or H*d_h-wide axis, can only be per-head keys (or something
bigger built from them), whatever einsum, loops or reshapes produced it.
"""

from __future__ import annotations

import math

import torch

from .. import nb06_kv_sharing as ref
from ..configs import MODELS
from ..nb01_qkv_shapes import scaled_dot_product_attention
from ..nb03_masks import causal_mask
from ..registry import in_module
from . import watchers
from .core import Trial, describe_case, draw, eager_mistakes, exercise, flipped_causal, seeded
from .feedback import Mistake, wrong_signature
from .instruments import op_name, warm_up

__all__ = in_module(__name__)  # its exercises' checks, as helpers/registry.py lists them



# =========================================================================== 6.1


def _tiled(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    return x.repeat(1, n_rep, 1, 1)


@exercise()
def repeat_kv(t: Trial) -> None:
    t.error_hints = {
        r"takes \d+ positional argument": wrong_signature("repeat_kv(x, n_rep)."),
        r"expanded size|must match the existing size": Mistake(
            "expand-without-new-axis", "insert a new axis for the copies first: "
            "x[:, :, None] is [B, H_kv, 1, T, d], which expands to [B, H_kv, n_rep, T, d].",
            "expanded x without first inserting a new axis for the copies"),
    }
    # (B, H_kv, T, d, n_rep): H_kv > 1 first, so that the tiled and grouped layouts differ.
    shapes = [(2, 3, 5, 4, 2), (1, 2, 7, 6, 4), (3, 4, 2, 5, 6), (2, 3, 5, 4, 1), (1, 1, 6, 3, 5)]
    cases = []
    for i, (B, H_kv, T, d, n_rep) in enumerate(shapes):
        x = torch.randn(B, H_kv, T, d, generator=seeded(600 + i))
        cases.append((x, n_rep))
    x64 = torch.randn(2, 3, 4, 5, generator=seeded(610), dtype=torch.float64)
    cases.append((x64, 2))
    planned = []
    for x, n_rep in cases:
        B, H_kv, T, d = x.shape
        mistakes = eager_mistakes({
            Mistake("tiled-heads",
                    "you tiled the heads (x.repeat(1, n_rep, 1, 1) gives kv heads 0, 1, ..., 0, 1, "
                    "...), so query head h reads kv head h % H_kv. Each kv head must appear n_rep "
                    "times in a row, so that head h reads h // n_rep: expand a new axis after "
                    "H_kv, or repeat_interleave on dim 1.",
                    "tiled the kv heads (x.repeat: query head h reads h % H_kv, not h // n_rep)"):
                lambda: _tiled(x, n_rep),
            Mistake("repeated-on-sequence-axis",
                    "you repeated along the sequence axis (dim 2): the copies go on the heads "
                    "axis, dim 1."):
                lambda: x.repeat_interleave(n_rep, dim=2),
            Mistake("returned-5-D-view",
                    "you returned the expanded 5-D view [B, H_kv, n_rep, T, d]: reshape it to "
                    "[B, H_kv * n_rep, T, d]."): lambda: x[:, :, None].expand(B, H_kv, n_rep, T, d),
            Mistake("n_rep-minus-1-copies",
                    "you made n_rep - 1 copies of each kv head: n_rep is how many times each "
                    "appears in the result (H_kv * n_rep heads in all)."):
                lambda: x.repeat_interleave(n_rep - 1, dim=1),
            Mistake("repeated-on-last-axis",
                    "you repeated along the last axis (d) and then reshaped: that spreads one "
                    "head's numbers over several heads. Put the copies on a new axis after H_kv, "
                    "x[:, :, None].expand(...), then reshape."):
                lambda: x.repeat_interleave(n_rep, dim=-1).reshape(B, H_kv * n_rep, T, d),
            Mistake("tiled-last-axis",
                    "your output repeats each token's row n_rep times in a row (tokens 0, 0, 1, 1, ... "
                    "for n_rep = 2), and a kv head's copies run on into the next heads: the copies "
                    "must be whole heads, each [T, d] kv head n_rep times in a row. Put the copies "
                    "on a new axis right after H_kv, x[:, :, None].expand(...), then reshape.",
                    "repeated each token's row n_rep times, then reshaped (the copies run across heads)"):
                lambda: x.repeat(1, 1, 1, n_rep).reshape(B, H_kv * n_rep, T, d),
        })
        planned.append((x, n_rep, ref.repeat_kv(x, n_rep).contiguous(), mistakes))
    for x, n_rep, expected, mistakes in planned:
        got = t.call(x, n_rep, case=describe_case(x=x, n_rep=n_rep))
        t.tensor(got, expected, what="repeated", mistakes=mistakes,
                 hint="x[:, :, None].expand(B, H_kv, n_rep, T, d).reshape(B, H_kv * n_rep, T, d), or "
                      "x.repeat_interleave(n_rep, dim=1).")


# =========================================================================== 6.2


def _gqa_model(q, k, v, causal: bool, heads: str = "grouped", scale: str = "d", mask: str = "ok") -> torch.Tensor:
    """A learner's grouped-query attention in float64 with one mistake switched on."""
    H, H_kv, T, d = q.shape[1], k.shape[1], k.shape[2], q.shape[-1]
    if heads == "tiled":
        idx = torch.arange(H) % H_kv
    elif heads == "first":
        idx = torch.zeros(H, dtype=torch.long)
    elif heads == "last":
        idx = torch.full((H,), H_kv - 1, dtype=torch.long)
    else:
        idx = torch.arange(H) // (H // H_kv)
    if heads == "mean":  # one query per group, its mean, attended once and copied to the group's heads
        n_rep = H // H_kv
        qm = q.reshape(q.shape[0], H_kv, n_rep, *q.shape[2:]).mean(2).repeat_interleave(n_rep, dim=1)
        return _gqa_model(qm, k, v, causal, scale=scale, mask=mask)
    if heads == "first_masked":  # in each group only the first query head masked, the others read every key
        n_rep = H // H_kv
        masked, open_ = _gqa_model(q, k, v, causal), _gqa_model(q, k, v, False)
        first = (torch.arange(H) % n_rep == 0).view(1, H, 1, 1)
        return torch.where(first, masked, open_)
    q64, k64, v64 = q.double(), k.double()[:, idx], v.double()[:, idx]
    if scale == "none":
        q64 = q64 * math.sqrt(d)
    elif scale == "H_kv d":
        q64 = q64 / math.sqrt(H_kv)
    if causal and mask == "no_diagonal":  # as a learner writes it: the first query's row is all -inf, NaN
        s = (q64 @ k64.transpose(-2, -1) / math.sqrt(d)).masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(-1),
                                                                      float("-inf"))
        return (torch.softmax(s, dim=-1) @ v64).to(q.dtype)
    out = scaled_dot_product_attention(q64, k64, v64, causal_mask(T) if causal else None)
    return out.to(q.dtype)


def _gqa_mistakes(q, k, v, causal: bool) -> dict[str, torch.Tensor]:
    m = lambda **kw: lambda: _gqa_model(q, k, v, **{"causal": causal, **kw})  # noqa: E731
    models = {
        Mistake("tiled-kv-heads",
                "the key/value heads are tiled (x.repeat on the heads axis): query head h read kv "
                "head h % H_kv. It must read kv head h // (H / H_kv): each kv head serves a block "
                "of consecutive query heads (repeat_interleave, or expand + reshape)."):
            m(heads="tiled"),
        Mistake("all-read-kv-head-0",
                "every query head read kv head 0: each group of H / H_kv consecutive query heads "
                "has its own kv head, h // (H / H_kv)."): m(heads="first"),
        Mistake("unscaled-scores", "the scores are not scaled: divide q @ k^T by sqrt(d)."):
            m(scale="none"),
        Mistake("all-read-last-kv-head",
                "every query head read the last kv head: each group of H / H_kv consecutive query "
                "heads has its own kv head, h // (H / H_kv)."): m(heads="last"),
        Mistake("scaled-by-sqrt-H_kv-d",
                "you scaled the scores by 1/sqrt(H_kv * d): each head's scores are scaled by "
                "1/sqrt(d), d the width of one head's queries and keys."): m(scale="H_kv d"),
    }
    models[Mistake("group-mean-query",
                   "every query head of a group has the same output, the attention of the group's mean "
                   "query: only the keys and values are shared; each query head attends with its own "
                   "query (repeat the kv heads, not average the queries).",
                   "attended with each group's mean query (the same output for the group's heads)")] = (
        m(heads="mean"))
    if causal:
        models[Mistake("group-heads-after-first-unmasked",
                       "in each group of H / H_kv query heads only the first is causally masked: the "
                       "others read every key, the later ones too. Every query head's query i reads "
                       "keys j <= i (if you folded a group's heads into the token axis, query i of "
                       "head r is row r * T + i there, and its mask is still j <= i).",
                       "causally masked only the first query head of each group")] = m(heads="first_masked")
        models[Mistake("mask-hides-diagonal",
                       "your causal mask also hides the diagonal (tril with diagonal=-1): a query "
                       "may read its own key, j <= i; the first query then has no key at all.")] = (
            m(mask="no_diagonal"))
    models.update(flipped_causal(causal, m))
    return eager_mistakes(models)


@exercise()
def grouped_query_attention(t: Trial) -> None:
    t.error_hints = {
        r"must match the size|size of tensor|cannot be multiplied|Expected size": Mistake(
            "kv-heads-not-repeated", "q has H heads and k, v have H_kv: repeat each kv head H // "
            "H_kv times on dim 1 (repeat_kv) before q @ k.transpose(-2, -1).",
            "multiplied q (H heads) by k, v (H_kv heads) without repeating the kv heads"),
        r"takes \d+ positional argument": wrong_signature(
            "grouped_query_attention(q, k, v, causal)."),
    }
    # (B, H, H_kv, T, d): GQA with H_kv > 1, MQA (H_kv = 1), MHA (H_kv = H); no two sizes equal.
    shapes = [(2, 6, 2, 5, 4), (1, 4, 1, 7, 3), (3, 2, 2, 5, 8), (1, 9, 3, 4, 6)]
    cases = []
    for i, (B, H, H_kv, T, d) in enumerate(shapes):
        g = seeded(620 + i)
        q = torch.randn(B, H, T, d, generator=g) * 1.5
        k = torch.randn(B, H_kv, T, d, generator=g) * 1.5
        v = torch.randn(B, H_kv, T, d, generator=g)
        for causal in (False, True):
            cases.append((q, k, v, causal))
    g = seeded(630)
    q64, k64, v64 = (torch.randn(2, 6, 5, 4, generator=g, dtype=torch.float64) for _ in range(3))
    cases.append((q64, k64[:, :3], v64[:, :3], True))
    planned = [(c, ref.grouped_query_attention(*c), _gqa_mistakes(*c)) for c in cases]
    for (q, k, v, causal), expected, mistakes in planned:
        got = t.call(q, k, v, causal, case=describe_case(q=q, k=k, v=v, causal=causal))
        t.tensor(got, expected, what="out", mistakes=mistakes,
                 hint="n_rep = H // H_kv; k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep); then "
                      "softmax(q @ k^T / sqrt(d), masked causally if causal) @ v.")


# =========================================================================== 6.3



def _values_mistakes(kind: str, H: int, H_kv: int, d_h: int, d_c: int, d_r: int) -> dict[str, int]:
    right = ref.kv_values_per_token(kind, H, H_kv, d_h, d_c, d_r)
    m = {}
    if kind in ("mha", "gqa", "mqa"):
        m[Mistake("counted-bytes",
                  "you counted bytes (2 per number, as in bf16): the question is how many numbers "
                  "are cached; bytes come later, times the dtype's size.")] = 2 * right
        m[Mistake("keys-only",
                  "you counted the keys only: the cache holds a key and a value per kv head, "
                  "2 * H_kv * d_h numbers.")] = right // 2
    if kind == "gqa":
        m[Mistake("gqa-with-query-heads",
                  "you counted GQA with the query heads: only the H_kv key/value heads are cached, "
                  "2 * H_kv * d_h.")] = 2 * H * d_h
        m[Mistake("gqa-keys-only-with-query-heads",
                  "you counted GQA's keys with the query heads and forgot the values: "
                  "2 * H_kv * d_h.")] = H * d_h
    if kind == "mha":
        m[Mistake("mha-used-n_kv_heads",
                  "your MHA count is 2 * n_kv_heads * head_dim: MHA caches a key and a value head for "
                  "every query head, 2 * n_heads * head_dim; n_kv_heads is used by 'gqa' only (the "
                  "arguments a kind does not use are ignored).")] = 2 * H_kv * d_h
    if kind == "mqa":
        m[Mistake("mqa-used-n_kv_heads",
                  "your MQA count is 2 * n_kv_heads * head_dim: MQA caches one key head and one value "
                  "head, 2 * head_dim; n_kv_heads is used by 'gqa' only (the arguments a kind does not "
                  "use are ignored).")] = 2 * H_kv * d_h
    if kind == "mqa":
        m[Mistake("mqa-with-query-heads",
                  "MQA caches one key head and one value head, whatever H: 2 * d_h.",
                  "counted MQA's key/value heads as H instead of one")] = 2 * H * d_h
    if kind == "mla":
        m[Mistake("mla-counted-twice",
                  "MLA counted twice: the latent c_kv is one vector from which both keys and "
                  "values are rebuilt, so it is cached once, with the RoPE key: d_c + d_r.",
                  "counted MLA's latent and RoPE key twice (once for keys, once for values)")] = (
            2 * (d_c + d_r))
        m[Mistake("mla-missing-rope-key",
                  "MLA's decoupled RoPE key is missing: the cache holds the latent and the RoPE "
                  "key, d_c + d_r.")] = d_c
        m[Mistake("mla-rope-key-per-head",
                  "MLA's RoPE key is one d_r-wide key shared by all heads: d_c + d_r, not "
                  "d_c + H * d_r.",
                  "counted MLA's RoPE key once per head")] = d_c + H * d_r
        m[Mistake("mla-latent-twice-no-rope-key",
                  "you counted MLA's latent twice and left out the RoPE key: d_c + d_r.")] = 2 * d_c
        m[Mistake("mla-as-per-head-cache",
                  "that is the per-head cache MLA avoids (2 * H * d_h): MLA caches "
                  "d_c + d_r numbers.",
                  "counted MLA as a per-head key/value cache, 2 * H * d_h")] = 2 * H * d_h
        m[Mistake("mla-latent-per-head",
                  "you cached a latent per head: MLA's latent c_kv is one d_c-wide vector shared "
                  "by all heads (the heads' keys and values are rebuilt from it), so "
                  "d_c + d_r.")] = H * d_c + d_r
    return m  # a model that gives the right count on a case refutes the mistake where the learner was wrong


@exercise()
def kv_values_per_token(t: Trial) -> None:
    t.error_hints = {
        r"takes \d+ positional argument": wrong_signature(
            "kv_values_per_token(kind, n_heads, n_kv_heads, head_dim, kv_lora_rank, rope_dim)."),
        r"unsupported operand type.*NoneType": Mistake(
            "kind-not-handled", "return a number for every kind: 'mha', 'gqa', 'mqa' and 'mla'.",
            "returned nothing (None) for one of the kinds"),
    }
    cases = [(cfg.kind, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.kv_lora_rank, cfg.rope_dim)
             for cfg in MODELS.values()]
    ds = MODELS["DeepSeek-V3"]
    cases += [
        ("mha", ds.n_heads, ds.n_heads, ds.head_dim, ds.kv_lora_rank, ds.rope_dim),  # DeepSeek-V3 as if MHA
        ("gqa", 12, 3, 20, 0, 0), ("mqa", 10, 1, 24, 0, 0), ("mla", 6, 6, 16, 40, 8), ("mha", 5, 5, 14, 0, 0),
        # Arguments a kind does not use are ignored (the statement): here they disagree with the kind.
        ("mqa", 12, 4, 18, 0, 0), ("mha", 9, 3, 22, 0, 0), ("gqa", 8, 2, 12, 30, 6),
    ]
    # Then one drawn from a seed: a kind, 2 to 4 kv heads (GQA) of 3 or 4 query heads each, head_dim
    # 4 to 32; for MLA a latent of 8 to 64 and a RoPE key of 2 to 16 (0 for the other kinds).
    g = seeded(650)
    kind = ("mha", "gqa", "mqa", "mla")[draw(g, 0, 4)]
    H_kv = draw(g, 2, 5)
    H, d_h, d_c, d_r = H_kv * draw(g, 3, 5), draw(g, 4, 33), draw(g, 8, 65), draw(g, 2, 17)
    cases.append((kind, H, {"gqa": H_kv, "mqa": 1}.get(kind, H), d_h, *((d_c, d_r) if kind == "mla" else (0, 0))))
    planned = [(c, ref.kv_values_per_token(*c), _values_mistakes(*c)) for c in cases]
    for (kind, H, H_kv, d_h, d_c, d_r), expected, mistakes in planned:
        got = t.call(kind, H, H_kv, d_h, d_c, d_r, case=describe_case(
            kind=kind, n_heads=H, n_kv_heads=H_kv, head_dim=d_h, kv_lora_rank=d_c, rope_dim=d_r))
        t.number(got, expected, what=f"values per token per layer ({kind})", integer=True, mistakes=mistakes,
                 hint="mha: 2 * n_heads * head_dim; gqa: 2 * n_kv_heads * head_dim; mqa: 2 * head_dim; "
                      "mla: kv_lora_rank + rope_dim.")


# =========================================================================== 6.4

_MATMULS = {"mm", "bmm", "addmm", "baddbmm", "addbmm", "mv", "addmv", "matmul", "_addmm_activation"}


def _per_head_key_op(ops: list, H: int, T: int, d_h: int) -> str:
    """The first logged op whose result holds per-head keys (see the module docstring), or ''."""
    for op, _, outs, *_ in ops:
        name = op_name(op)
        for shape in outs:
            numel = math.prod(shape)
            if numel and numel % (T * d_h) == 0:
                return f"{list(shape)} ({op})"
            if name in _MATMULS and len(shape) >= 1 and set(shape[-2:]) & {d_h, H * d_h}:
                return f"{list(shape)} ({op})"
    return ""


def _mla_model(q, c_kv, w_uk, scale: float = 1.0, first_head: bool = False) -> torch.Tensor:
    w = w_uk[:1].expand_as(w_uk) if first_head else w_uk
    k = c_kv.double().unsqueeze(1) @ w.double()                  # [B, H, T, d_h]: fine in a mistake model
    return (q.double() @ k.transpose(-2, -1) * scale).to(q.dtype)


# (B, H, T_q, T, d_h, d_c): T prime; d_h a power of two; the other sizes odd (B may be 2), so no
# product of them is a multiple of d_h and no size equals another (d_c != d_h, T_q != T).
_MLA_CASES = [(2, 3, 5, 11, 8, 7), (1, 5, 1, 13, 4, 9), (3, 5, 11, 7, 8, 9), (1, 3, 7, 17, 16, 5)]


@exercise()
def mla_absorbed_scores(t: Trial) -> None:
    t.error_hints = {
        r"cannot be multiplied|must match the size|size of tensor|Expected size": Mistake(
            "absorption-shape-mismatch", "w_uk[h] is [d_c, d_h]: the query moves into the latent "
            "with q @ w_uk.transpose(-2, -1) ([B, H, T_q, d_c]); then multiply by c_kv transposed, "
            "with a heads axis: c_kv.unsqueeze(1).transpose(-2, -1).",
            "multiplied q, w_uk and c_kv with mismatched shapes"),
        r"takes \d+ positional argument": wrong_signature("mla_absorbed_scores(q, c_kv, w_uk)."),
    }
    cases = []
    for i, (B, H, T_q, T, d_h, d_c) in enumerate(_MLA_CASES):
        g = seeded(640 + i)
        dtype = torch.float64 if i == 2 else torch.float32
        q = torch.randn(B, H, T_q, d_h, generator=g, dtype=dtype)
        c_kv = torch.randn(B, T, d_c, generator=g, dtype=dtype)
        w_uk = torch.randn(H, d_c, d_h, generator=g, dtype=dtype) / math.sqrt(d_c)
        cases.append((q, c_kv, w_uk))
    planned = []
    for q, c_kv, w_uk in cases:
        d_h, d_c = q.shape[-1], c_kv.shape[-1]
        mistakes = eager_mistakes({
            Mistake("scaled-by-sqrt-d_h",
                    "your scores are divided by sqrt(d_h): this function returns the unscaled "
                    "scores (q . k); the layer scales them later, by 1/sqrt(d_h + d_r) in MLA."):
                lambda: _mla_model(q, c_kv, w_uk, 1 / math.sqrt(d_h)),
            Mistake("scaled-by-sqrt-d_c",
                    "your scores are divided by sqrt(d_c): the contract is unscaled scores, and "
                    "d_c is not the width the dot product is taken over in the model (that is d_h, "
                    "plus d_r for RoPE)."):
                lambda: _mla_model(q, c_kv, w_uk, 1 / math.sqrt(d_c)),
            Mistake("scaled-by-d_h",
                    "your scores are divided by d_h: this function returns unscaled scores."):
                lambda: _mla_model(q, c_kv, w_uk, 1 / d_h),
            Mistake("w_uk0-for-every-head",
                    "every head used head 0's projection w_uk[0]: head h's query is absorbed with "
                    "its own w_uk[h] (keep the heads axis: q @ w_uk.transpose(-2, -1) broadcasts "
                    "head by head)."):
                lambda: _mla_model(q, c_kv, w_uk, first_head=True),
            Mistake("w_uk-heads-flipped",
                    "head h used w_uk[H - 1 - h]: the heads of w_uk are in the order of q's heads "
                    "(w_uk[h] belongs to query head h), so no flip.",
                    "used w_uk's heads in reverse order"):
                lambda: _mla_model(q, c_kv, w_uk.flip(0)),
            Mistake("transposed-scores",
                    "your scores are [B, H, T, T_q], the transpose: rows are queries and columns "
                    "are the cached tokens, [B, H, T_q, T] = q_latent @ c_kv^T."):
                lambda: _mla_model(q, c_kv, w_uk).transpose(-2, -1),
        })
        planned.append((q, c_kv, w_uk, ref.mla_absorbed_scores(q, c_kv, w_uk), mistakes))
    warm_up()  # the first dispatch mode of a process imports torch._dynamo (seconds): not the learner's time
    for q, c_kv, w_uk, expected, mistakes in planned:
        B, H, T_q, d_h = q.shape
        T = c_kv.shape[1]
        got, ops = t.call_watched(watchers.ops, (q, c_kv, w_uk), case=describe_case(q=q, c_kv=c_kv, w_uk=w_uk))
        t.tensor(got, expected, what="scores", mistakes=mistakes,
                 hint="q_latent = q @ w_uk.transpose(-2, -1)  # [B, H, T_q, d_c]; then "
                      "q_latent @ c_kv.unsqueeze(1).transpose(-2, -1)  # [B, H, T_q, T]")
        formed = _per_head_key_op(ops, H, T, d_h)  # from the op log, an observation: t.fail_observed
        if formed:
            t.fail_observed(f"your scores are right, but your function formed the per-head keys: the {formed} tensor "
                            f"holds keys c_kv @ w_uk[h] (d_h = {d_h} numbers per head per cached token; T = {T}). The "
                            "contract forbids it: at decode, building them costs 2 T d_c d_h FLOPs per head and "
                            "per step, the very cost absorption removes.",
                            Mistake("formed-per-head-keys",
                                    "absorb w_uk into the queries instead: move each head's queries into "
                                    "latent space first (q times w_uk[h] transposed: [B, H, T_q, d_c], "
                                    "nothing of size T in it), then score them against the cached latents. "
                                    "A three-operand einsum may contract c_kv with w_uk first: write the "
                                    "two steps yourself.",
                                    "formed the per-head keys c_kv @ w_uk[h] instead of absorbing w_uk into "
                                    "the queries"),
                            recipe="q_latent = q @ w_uk.transpose(-2, -1)  # [B, H, T_q, d_c]; then "
                                   "q_latent @ c_kv.unsqueeze(1).transpose(-2, -1)  # [B, H, T_q, T]")
