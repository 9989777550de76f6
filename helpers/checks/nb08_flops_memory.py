"""Checks for notebook 08_flops_memory (its exercises: helpers/registry.py).

Every case, expected value and mistake model is computed before the learner's function runs.
Counts (FLOPs, bytes, a sequence length) must be Python ints: a float or a string gets a clear
message, and a float that is a recognised mistake (bytes in GiB) gets that mistake's hint.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from .. import nb08_flops_memory as ref
from ..configs import MODELS, ModelConfig
from ..registry import in_module
from .core import Trial, describe, describe_case, draw, exercise, seeded
from .feedback import Mistake, wrong_signature
from .guard import _isclose_num, key_text

__all__ = in_module(__name__)  # its exercises' checks, as helpers/registry.py lists them


_FLOAT_COUNT = Mistake("float-count",
                       "counts of bytes and FLOPs are Python ints: use integer arithmetic (*, "
                       "//, math.isqrt) and return the count itself, not a value scaled for "
                       "printing (GB, GiB, GFLOP).",
                       "returned a count as a float instead of an int")
_COUNT_AS_STRING = Mistake("count-as-string",
                           "return the number itself (an int), not text: no f-string, str() or "
                           "format().",
                           "returned a count as text (a string) instead of an int")
_RETURNED_GIB = Mistake("returned-GiB-float", "you returned GiB as a float: return the number of bytes, an int "
                        "(divide by 2**30 only to print).")
_RETURNED_GB = Mistake("returned-GB-float", "you returned GB as a float: return the number of bytes, an int "
                       "(divide by 1e9 only to print).")


def check_count(t: Trial, got, expected: int, what: str, mistakes: Mapping[str, float], hint: str,
                factors: Mapping[str, float] | None = None) -> None:
    """Fail unless ``got`` is the Python int ``expected``. A plain float fails, with the hint of the
    mistake it matches (bytes in GiB) if any; a string fails with a message saying an int is
    expected; the core's :meth:`Trial.number` does the rest (None, tensors, NumPy, subclasses,
    values). Shared by the checks of 07 and 08."""
    __tracebackhide__ = True
    if type(got) is float:
        matched = next((h for h, v in mistakes.items() if _isclose_num(got, v, rel_tol=1e-9)
                        and not _isclose_num(v, expected, rel_tol=1e-12)), "")
        t.fail(f"{what}: expected an int ({expected:,}), got the float {got!r}.",
               matched or _FLOAT_COUNT)
    if type(got) is str:
        t.fail(f"{what}: expected an int, got the string {got!r}.",
               _COUNT_AS_STRING)
    t.number(got, expected, what=what, integer=True, mistakes=mistakes, hint=hint, factors=factors)


# --------------------------------------------------------------------------- 8.1 attention_flops

KEYS = ("q_proj", "k_proj", "v_proj", "o_proj", "scores", "softmax", "weighted_values", "total")
_MULT_ONLY = Mistake("multiplies-only",
                     "you counted multiplies only (n*d*k for a matmul): the course counts a "
                     "multiply-add as 2 FLOPs, so [a x b] @ [b x c] costs 2*a*b*c.")
_HALVED = Mistake("halved-n-by-n-part",
                  "you halved this part: the convention counts the full n x n square (no causal "
                  "halving) and a multiply-add as 2 FLOPs (not multiplies only): H * 2*n*n*d_h.",
                  "halved the scores or weighted values (causal halving, or multiplies only)")
_CAUSAL_TRIANGLE = Mistake("causal-triangle",
                           "causal halving is not counted here (the convention counts the full n x n square).",
                           "counted only the causal triangle of the n x n square")
_RECIPE_81 = ("q_proj = 2*n*d*H*d_h, k_proj = v_proj = 2*n*d*H_kv*d_h, o_proj = 2*n*H*d_h*d, "
              "scores = weighted_values = H*2*n*n*d_h, softmax = 6*H*n*n, total = the sum of the seven.")


def _flops_mistakes(n: int, d: int, H: int, H_kv: int, d_h: int) -> dict[str, dict[str, float]]:
    """For each key, the values known wrong implementations give, with their hints."""
    right = ref.attention_flops(n, d, H, H_kv, d_h)
    split = ref.attention_flops(n, d, H, H_kv, d // H)  # every head d_model // n_heads wide
    head_dim_from_d = Mistake("head_dim-as-d_model-over-n_heads",
                              "your counts are those of heads d_model // n_heads wide: each head is "
                              "head_dim wide, as given (H * head_dim need not equal d_model), in the "
                              "projections, the scores and the weighted values.",
                              "took the head width as d_model // n_heads instead of head_dim")
    kv_with_h = {
        Mistake("kv_proj-with-query-heads",
                "you counted the K and V projections with the query heads: with grouped-query "
                "attention only H_kv key/value heads are projected, 2*n*d*H_kv*d_h each."):
            2 * n * d * H * d_h,
        Mistake("kv_proj-as-d-by-d",
                "you counted the K and V projections as d x d matrices: W_K and W_V are [d, "
                "H_kv*d_h] (grouped-query attention), 2*n*d*H_kv*d_h each."): 2 * n * d * d,
    }
    m: dict[str, dict[str, float]] = {
        "q_proj": {_MULT_ONLY: right["q_proj"] / 2,
                   Mistake("W_Q-as-d-by-d",
                           "W_Q is [d, H*d_h]: q_proj = 2*n*d*H*d_h (H*d_h need not equal d).",
                           "counted W_Q as d x d instead of [d, H*d_h]"): 2 * n * d * d},
        "k_proj": {**kv_with_h, _MULT_ONLY: right["k_proj"] / 2},
        "v_proj": {**kv_with_h, _MULT_ONLY: right["v_proj"] / 2},
        "o_proj": {_MULT_ONLY: right["o_proj"] / 2,
                   Mistake("W_O-as-d-by-d",
                           "W_O is [H*d_h, d]: o_proj = 2*n*H*d_h*d (H*d_h need not equal d).",
                           "counted W_O as d x d instead of [H*d_h, d]"): 2 * n * d * d},
        "scores": {_HALVED: right["scores"] / 2,
                   Mistake("scores-for-one-head",
                           "the scores are computed for every query head: H * 2*n*n*d_h, not once.",
                           "counted the scores for one head instead of every query head"):
                       2 * n * n * d_h,
                   Mistake("scores-per-kv-head",
                           "the scores are computed for every query head (H of them), not per "
                           "key/value head: GQA shares K, not the score matrices.",
                           "counted the scores per key/value head instead of per query head"):
                       H_kv * 2 * n * n * d_h,
                   _CAUSAL_TRIANGLE: right["scores"] / 2 + H * n * d_h},
        "softmax": {Mistake("softmax-5-per-score",
                            "you counted 5*n^2 per head for the softmax: the convention counts "
                            "scale (1) + softmax (~5) = 6 FLOPs per score, 6*H*n*n."):
                        5 * H * n * n,
                    Mistake("softmax-for-one-head",
                            "the softmax runs on every head's n x n scores: 6*H*n*n, not 6*n*n.",
                            "counted the softmax for one head instead of every head"): 6 * n * n,
                    Mistake("missing-softmax",
                            "you left out the softmax: scale + softmax count 6 FLOPs per score, "
                            "6*H*n*n."): 0},
        "weighted_values": {_HALVED: right["weighted_values"] / 2,
                            _CAUSAL_TRIANGLE: right["weighted_values"] / 2 + H * n * d_h,
                            Mistake("weighted_values-for-one-head",
                                    "the weighted values are computed for every query head: "
                                    "H * 2*n*n*d_h.",
                                    "counted the weighted values for one head instead of every "
                                    "query head"): 2 * n * n * d_h,
                            Mistake("weighted_values-per-kv-head",
                                    "the weighted values are computed for every query head (H of "
                                    "them), not per key/value head.",
                                    "counted the weighted values per key/value head instead of per "
                                    "query head"): H_kv * 2 * n * n * d_h},
        "total": {Mistake("total-without-softmax",
                          "your total leaves out the softmax: total is the sum of all seven "
                          "parts."):
                      right["total"] - right["softmax"],
                  Mistake("total-projections-only",
                          "your total counts only the projections: add scores, softmax and "
                          "weighted values."):
                      right["q_proj"] + right["k_proj"] + right["v_proj"] + right["o_proj"],
                  Mistake("total-attention-core-only",
                          "your total counts only the attention core: add the four projections."):
                      right["scores"] + right["softmax"] + right["weighted_values"]},
    }
    for key in ("q_proj", "k_proj", "v_proj", "o_proj", "scores", "weighted_values", "total"):
        m[key][head_dim_from_d] = split[key]
    return m  # every model on every case: one that gives the right figure rules its mistake out


@exercise()
def attention_flops(t: Trial) -> None:
    t.error_hints = {
        r"takes \d+ positional argument": wrong_signature(
            "attention_flops(n, d_model, n_heads, n_kv_heads, head_dim)."),
    }
    mav, base = MODELS["Llama-4-Maverick"], MODELS["Transformer (base)"]
    # (n, d, H, H_kv, d_h): a small GQA layer whose H*d_h (24) differs from d (20) and where no two
    # sizes are equal; the dimensions appendix's Maverick layer at n = 4096 (GQA, H*d_h = d); the
    # original Transformer (MHA); multi-query attention.
    cases = [(7, 20, 6, 2, 4), (4096, mav.d_model, mav.n_heads, mav.n_kv_heads, mav.head_dim),
             (512, base.d_model, base.n_heads, base.n_kv_heads, base.head_dim), (11, 36, 9, 1, 4)]
    # Then one drawn from a seed: n 2 to 64, d 8 to 64, 1 to 4 kv heads of 1 to 4 query heads each,
    # head_dim 2 to 16 (H*d_h need not equal d).
    g = seeded(800)
    n, d, H_kv = draw(g, 2, 65), draw(g, 8, 65), draw(g, 1, 5)
    H = H_kv * draw(g, 1, 5)
    cases.append((n, d, H, H_kv, draw(g, 2, 17)))
    planned = [(c, ref.attention_flops(*c), _flops_mistakes(*c)) for c in cases]
    for (n, d, H, H_kv, d_h), expected, mistakes in planned:
        got = t.call(n, d, H, H_kv, d_h, case=describe_case(n=n, d_model=d, n_heads=H, n_kv_heads=H_kv, head_dim=d_h))
        if not isinstance(got, Mapping):
            t.fail(f"expected a dict with the keys {', '.join(KEYS)}; got {describe(got)}.",
                   Mistake("not-a-dict",
                           "return {'q_proj': ..., 'k_proj': ..., ..., 'total': ...}: one int "
                           "per part.",
                           "returned something other than a dict of the parts"))
        missing = [k for k in KEYS if k not in got]
        if missing:
            t.fail(f"your dict lacks the key(s) {', '.join(repr(k) for k in missing)} (it has {', '.join(sorted(key_text(k) for k in got))}).",
                   Mistake("missing-keys", f"use exactly these names: {', '.join(KEYS)}.",
                           "returned a dict that lacks some of the keys (or names them otherwise)"))
        values = {k: got[k] for k in KEYS}
        for key in KEYS:
            check_count(t, values[key], expected[key], f"[{key!r}]", mistakes[key], _RECIPE_81)


# --------------------------------------------------------------------------- 8.2 score_matrix_bytes


def _bytes_mistakes(B: int, H: int, T: int, b: int) -> dict[str, float]:
    right = ref.score_matrix_bytes(B, H, T, b)
    return {
        Mistake("missing-batch",
                "you left out the batch: every one of the B sequences has its own scores, "
                "B*H*T*T*dtype_bytes."): H * T * T * b,
        Mistake("missing-heads",
                "you left out the heads: every head has its own T x T scores, "
                "B*H*T*T*dtype_bytes."):
            B * T * T * b,
        Mistake("halved-for-causal",
                "you halved the square for the causal mask: a kernel that stores S stores all T*T "
                "entries (the masked ones are -inf, not absent)."): B * H * T * (T + 1) // 2 * b,
        Mistake("halved-for-causal",
                "you halved the square for the causal mask: a kernel that stores S stores all T*T "
                "entries."): right / 2,
        _RETURNED_GIB: right / 2**30,
        _RETURNED_GB: right / 1e9,
        Mistake("counted-entries", "you counted entries, not bytes: multiply by dtype_bytes."):
            B * H * T * T,
        Mistake("counted-bits",
                "you counted bits: bytes are B*H*T*T*dtype_bytes (dtype_bytes is already in "
                "bytes)."):
            right * 8,
        Mistake("linear-in-T",
                "you counted T entries per head, not T*T: the score matrix of one head is T x T "
                "(every query against every key)."): B * H * T * b,
        Mistake("dtype_bytes-hard-coded-2",
                "you ignored dtype_bytes (2 bytes, as for fp16, whatever the dtype): multiply by "
                "dtype_bytes."): B * H * T * T * 2,
        Mistake("dtype_bytes-hard-coded-4",
                "your count is that of 4 bytes per score whatever dtype_bytes is (fp32's size): "
                "multiply the B*H*T*T scores by dtype_bytes, the size the caller gives."): B * H * T * T * 4,
    }


@exercise()
def score_matrix_bytes(t: Trial) -> None:
    t.error_hints = {
        r"takes \d+ positional argument": wrong_signature(
            "score_matrix_bytes(batch, n_heads, seq_len, dtype_bytes)."),
    }
    # Only sizes a dtype has (1, 2, 4, 8 bytes): a right answer may ask torch for them (meta tensors,
    # element_size). First an 8-byte case whose sizes tell every listed mistake apart (B=3, H=5, T=7:
    # a missing batch, a missing head count, a halved square, a hard-coded 2 bytes and counted
    # entries give 1/3, 1/5, about 1/2, 1/4 and 1/8 of the bytes), then 4-byte numbers, the SDPA course
    # page's example (B=4, H=32, T=8192, fp16), the dimensions appendix's Maverick row (B=1, H=40,
    # T=4096) and 1-byte numbers.
    cases = [(3, 5, 7, 8), (3, 5, 7, 4), (4, 32, 8192, 2), (1, 40, 4096, 2), (2, 6, 11, 1)]
    g = seeded(801)  # then one drawn from a seed: B 1-4, H 1-16, T 1-64, 1, 2, 4 or 8 bytes
    cases.append((draw(g, 1, 5), draw(g, 1, 17), draw(g, 1, 65), (1, 2, 4, 8)[draw(g, 0, 4)]))
    planned = [(c, ref.score_matrix_bytes(*c), _bytes_mistakes(*c)) for c in cases]
    for (B, H, T, b), expected, mistakes in planned:
        got = t.call(B, H, T, b, case=describe_case(batch=B, n_heads=H, seq_len=T, dtype_bytes=b))
        check_count(t, got, expected, "bytes", mistakes, "batch * n_heads * seq_len * seq_len * dtype_bytes")


# --------------------------------------------------------------------------- 8.3 max_seq_len_for_scores

_ONE_PAST = Mistake("one-past-boundary",
                    "one past the boundary: the scores of the T you returned do not fit. Return "
                    "the largest T with B*H*T*T*dtype_bytes <= budget (an exact fit counts).",
                    "returned one more than the largest T whose scores fit")
_ROUNDED = Mistake("rounded-sqrt",
                   "you rounded the square root to the nearest integer (or up): the scores of that "
                   "T do not fit. Round down: math.isqrt(budget_bytes // (batch * n_heads * "
                   "dtype_bytes)).")
_ROUNDED_RATIO = Mistake("rounded-sqrt",  # the same mistake, on budget / (...) rather than budget // (...)
                         "you rounded the square root of budget_bytes / (batch * n_heads * dtype_bytes) "
                         "to the nearest integer: the scores of that T do not fit. Round down: "
                         "math.isqrt(budget_bytes // (batch * n_heads * dtype_bytes)).")
_FLOAT_SQRT = Mistake("float-sqrt",
                      "a float square root is off by one here: float64 has 53 bits, so above 2**52 "
                      "math.sqrt (and ** 0.5) round. Use the integer square root: "
                      "math.isqrt(budget_bytes // (batch * n_heads * dtype_bytes)).",
                      "took a float square root, which rounds for large budgets")


_EXACT_FIT = Mistake("exact-fit-excluded",
                     "an exact fit is left out: when T*T*batch*n_heads*dtype_bytes equals the "
                     "budget, T fits (<=, not <).",
                     "left out an exact fit (< instead of <=)")


def _seq_mistakes(budget: int, B: int, H: int, b: int, huge: bool) -> dict[str, float]:
    right = ref.max_seq_len_for_scores(budget, B, H, b)
    q = budget // (B * H * b)
    m = {_FLOAT_SQRT: int(math.sqrt(budget / (B * H * b)))} if huge else {}
    m |= {_ROUNDED: round(math.sqrt(q)), _ROUNDED_RATIO: round(math.sqrt(budget / (B * H * b))), _ONE_PAST: right + 1}
    if right > 0 and right * right == q:  # an exact fit
        m[_EXACT_FIT] = right - 1
    m |= {
        Mistake("ignored-batch",
                "you ignored the batch: the budget holds B score matrices, one per sequence."):
            math.isqrt(budget // (H * b)),
        Mistake("ignored-heads",
                "you ignored the heads: each of the H heads has its own T x T scores."):
            math.isqrt(budget // (B * b)),
        Mistake("ignored-dtype_bytes",
                "you ignored dtype_bytes: each score takes dtype_bytes bytes."):
            math.isqrt(budget // (B * H)),
    }
    return m


# (budget_bytes, batch, n_heads, dtype_bytes, huge). 80 GiB and Maverick's 40 heads in fp16 fit
# exactly T = 32,768 (the dimensions appendix's row): an exact fit, then one byte less. Then a
# budget whose quotient is k^2 + k + 1 (its square root rounds up), the SDPA course page's B=4,
# H=32, a budget too small for a single score (T = 0), and a quotient k^2 - 1 with k = 123,456,789
# (above 2**53, where float square roots round up to k).
_K = 123_456_789
_SEQ_CASES = [(80 * 2**30, 1, 40, 2, False), (80 * 2**30 - 1, 1, 40, 2, False),
              (24 * (1000**2 + 1000 + 1), 2, 3, 4, False), (80 * 2**30, 4, 32, 2, False),
              (2 * 3 * 2 - 1, 2, 3, 2, False), (12 * (_K**2 - 1) + 11, 2, 3, 2, True)]


def _drawn_seq_case() -> tuple[int, int, int, int, bool]:
    """A case of ``_SEQ_CASES``' form drawn from a seed: B 1-4, H 1-16, 1 to 4 bytes, and a budget
    from the scores of T (1 to 100,000) up to one byte short of those of T + 1, so the answer is T (an
    exact fit when nothing is added)."""
    g = seeded(802)
    B, H, b, T = draw(g, 1, 5), draw(g, 1, 17), draw(g, 1, 5), draw(g, 1, 100_001)
    per = B * H * b
    return per * T * T + draw(g, 0, per * (2 * T + 1)), B, H, b, False


@exercise()
def max_seq_len_for_scores(t: Trial) -> None:
    t.error_hints = {
        r"takes \d+ positional argument": wrong_signature(
            "max_seq_len_for_scores(budget_bytes, batch, n_heads, dtype_bytes)."),
    }
    planned = [(c, ref.max_seq_len_for_scores(*c[:4]), _seq_mistakes(*c)) for c in [*_SEQ_CASES, _drawn_seq_case()]]
    for (budget, B, H, b, _), expected, mistakes in planned:
        got = t.call(budget, B, H, b, case=describe_case(budget_bytes=budget, batch=B, n_heads=H, dtype_bytes=b))
        check_count(t, got, expected, "T", mistakes,
                    "T*T <= budget_bytes // (batch * n_heads * dtype_bytes): "
                    "T = math.isqrt(budget_bytes // (batch * n_heads * dtype_bytes)).")


# --------------------------------------------------------------------------- 8.4 training_memory

PARTS = ("weights", "gradients", "optimizer", "activations", "total")
_OPT_8N = Mistake("optimizer-8-bytes",
                  "the optimizer holds 12 bytes per parameter: the fp32 master weights (4) and "
                  "AdamW's two fp32 moments m and v (4 each). You have 8: you left out the master "
                  "weights or one of AdamW's two moments, or counted m and v in bf16 (2 bytes "
                  "each; they stay fp32).",
                  "counted the optimizer at 8 bytes per parameter instead of 12")
_OPT_4N = Mistake("optimizer-4-bytes",
                  "the optimizer holds 12 bytes per parameter: the fp32 master weights (4) and "
                  "AdamW's two fp32 moments m and v (4 each). You have 4: only one of the three, "
                  "or m and v in bf16 without the master weights.",
                  "counted the optimizer at 4 bytes per parameter instead of 12")
_TIED = Mistake("tied-embeddings",
                "the embeddings are untied: the input embedding and the output matrix are two "
                "[vocab, d] matrices, both counted in N = dense_param_count(cfg).",
                "counted the embeddings as tied (one [vocab, d] matrix instead of two)")
_RECIPE_84 = ("N = dense_param_count(cfg); weights 2N, gradients 2N, optimizer 12N; activations = 2 bytes * "
              "batch * seq_len * (n_layers * (one layer's numbers per token) + 2d + vocab), one layer = "
              "4d + 2*H*d_h + 2*H_kv*d_h + 4*d_ff (+ H*seq_len naive; only d with recompute, plus one "
              "flash layer less d); total = the sum of the four.")


def _training_mistakes(cfg, B: int, T: int, attention: str) -> dict[str, dict[str, float]]:
    """For each key, the values known wrong implementations give, with their hints."""
    right = ref.training_memory(cfg, B, T, attention)
    n = ref.dense_param_count(cfg)
    n_tied = n - cfg.vocab * cfg.d_model
    d, L, H, H_kv, d_h, f = cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
    acts = right["activations"]
    per_layer = sum(ref.layer_activation_numbers(cfg, T, attention).values())
    head = sum(ref.head_activation_numbers(cfg).values())
    flash_layer = sum(ref.layer_activation_numbers(cfg, T, "flash").values())
    recomputed = flash_layer - d if attention == "recompute" else 0
    full = attention != "recompute"  # every layer keeps its tensors: per-layer mistakes apply

    def with_layer(delta: int) -> int:  # activations if each stored layer saved delta more numbers
        return acts + 2 * B * T * (L * delta if full else delta)

    a: dict[str, float] = {
        Mistake("activations-one-layer",
                "your activations are not multiplied by the number of layers: every one of the L "
                "layers saves its own tensors."): 2 * B * T * (per_layer + head + recomputed),
        Mistake("missing-batch",
                "you left out the batch: every one of the batch's sequences saves its own "
                "activations."): acts / B,
        Mistake("missing-seq_len",
                "you left out seq_len: each of the seq_len tokens of a sequence saves its own "
                "activations."): acts / T,
        Mistake("activations-fp32",
                "activations are bf16 under this convention, 2 bytes per number, not 4 (fp32).",
                "counted the activations in fp32 (4 bytes) instead of bf16 (2)"): 2 * acts,
        Mistake("activations-as-numbers",
                "you counted numbers, not bytes: each activation takes 2 bytes (bf16)."): acts // 2,
        Mistake("missing-head",
                "you left out the head: the final norm's input and output (d each) and the "
                "log-probabilities (vocab) of every token."): acts - 2 * B * T * head,
        Mistake("kv-repeated",
                "K and V are saved with their H_kv key/value heads (grouped-query attention does "
                "not repeat them): 2*H_kv*d_h per token, not 2*H*d_h.",
                "saved K and V with H heads instead of the H_kv key/value heads"):
            with_layer(2 * (H - H_kv) * d_h),
        Mistake("mlp-three-d_ff-tensors",
                "the SwiGLU MLP saves four tensors of d_ff per token: the gate (SiLU's input), "
                "silu(gate) and up (the product's inputs) and their product (W_down's input).",
                "counted three d_ff-wide tensors for the SwiGLU MLP instead of four"):
            with_layer(-f),
        Mistake("norm-output-missing",
                "each norm saves its input and its output (the input of the next matrix products): "
                "2d per norm, 4d per layer.",
                "counted d per norm instead of 2d (its input and its output)"): with_layer(-2 * d),
    }
    if attention == "flash":
        a[Mistake("flash-keeps-P",
                  "you counted the T x T probabilities under FlashAttention: it never stores P, "
                  "only its output (and one log-sum-exp per row, not counted).")] = (
            with_layer(H * T))
    if attention == "naive":
        a[Mistake("naive-missing-P",
                  "naive attention saves the probabilities P for backward: H*seq_len numbers per "
                  "token per layer (B*H*T*T per layer).",
                  "left out the probabilities P that naive attention saves")] = with_layer(-H * T)
        a[Mistake("P-halved-for-causal",
                  "you halved P for the causal mask: the softmax writes all T x T probabilities "
                  "(the masked ones are 0, not absent).")] = acts - L * B * H * T * (T - 1)
        a[Mistake("P-halved-for-causal",
                  "you halved P for the causal mask: the softmax writes all T x T "
                  "probabilities.")] = (
            acts - L * B * H * T * T)
        a[Mistake("P-per-kv-head",
                  "P has one T x T matrix per query head (H of them), not per key/value head.",
                  "counted P per key/value head instead of per query head")] = (
            with_layer(-(H - H_kv) * T))
    if attention == "recompute":
        a[Mistake("recompute-layer-missing",
                  "the backward pass recomputes one layer at a time: add that layer's "
                  "FlashAttention activations less its input (already kept).",
                  "left out the one layer whose activations backward recomputes")] = (
            acts - 2 * B * T * recomputed)
        a[Mistake("recompute-layer-input-twice",
                  "the recomputed layer's input is the checkpoint already kept: add one layer's "
                  "activations less d.",
                  "counted the recomputed layer's input a second time")] = acts + 2 * B * T * d
        a[Mistake("recompute-keeps-all",
                  "with full recomputation each layer keeps only its input (d per token), not all "
                  "its activations.",
                  "kept every layer's activations under full recomputation")] = (
            acts + 2 * B * T * L * (flash_layer - d))
    if attention == "naive":
        a[Mistake("P-whole-matrix-per-token",
                  "you counted naive attention's whole T x T probability matrix for every token: "
                  "per token, P holds one row of seq_len numbers per query head, H*seq_len (so "
                  "B*H*T*T per layer in all).",
                  "counted the whole T x T matrix P for every token instead of one row")] = (
            with_layer(H * T * T - H * T))
        a[Mistake("P-once-not-per-layer",
                  "you added naive attention's probabilities P (H*seq_len numbers per token) once: "
                  "every one of the n_layers layers saves its own P.",
                  "counted P once instead of once per layer")] = acts - 2 * B * T * (L - 1) * H * T
    a[Mistake("head-norm-missing",
              "the head saves the final norm's input and output (d each) as well as the "
              "log-probabilities (vocab): 2d + vocab per token. You left out the 2d.",
              "left out the final norm's input and output (2d per token) in the head")] = (
        acts - 2 * B * T * 2 * d)
    a[Mistake("head-log-probs-missing",
              "the head saves the log-probabilities of every token (vocab numbers per token) as "
              "well as the final norm's input and output (d each): 2d + vocab per token. You left "
              "out the vocab.", "left out the log-probabilities (vocab per token) in the head")] = (
        acts - 2 * B * T * cfg.vocab)
    for sign, word in ((1, "+ 1"), (-1, "- 1")):
        a[Mistake("layers-off-by-one", f"you counted n_layers {word} layers: the model has n_layers "
                  "layers, each saving its own activations (the embedding saves no activations, "
                  "the head is counted once).", "counted one layer too many or too few")] = (
            acts + sign * 2 * B * T * (per_layer if full else d))
    if attention == "recompute":
        a[Mistake("recompute-as-flash",
                  "with recompute you counted every layer's activations, as with flash: under full "
                  "recomputation each layer keeps only its input (d per token), and backward "
                  "recomputes one layer at a time, adding that layer's flash activations less d.",
                  "counted recompute's activations as flash's")] = (
            2 * B * T * (L * flash_layer + head))
    head_each_layer = Mistake("head-in-every-layer",
                              "your activations count the head's 2d + vocab numbers per token in "
                              "every layer: the head (the final norm and the log-probabilities) "
                              "sits once on top of the n_layers layers, so it is counted once.",
                              "counted the head's activations in every layer instead of once")
    a[head_each_layer] = acts + 2 * B * T * (L - 1) * head
    a |= _per_token_family(cfg, B, T, attention, acts, full)
    total = right["total"]
    sum_of = "total is the sum of weights, gradients, optimizer and activations."
    left_out = {Mistake("total-without-weights-or-gradients", "your total leaves out the weights or the "
                        f"gradients (2N bytes each): {sum_of}"): total - 2 * n,
                Mistake("total-without-optimizer", f"your total leaves out the optimizer: {sum_of}"):
                    total - 12 * n,
                Mistake("total-without-activations", f"your total leaves out the activations: {sum_of}"):
                    total - acts}
    m = {
        "weights": {Mistake("weights-fp32",
                            "the weights are bf16 under this convention (2 bytes per parameter); "
                            "the fp32 copy is the optimizer's master weights.",
                            "counted the weights in fp32 (4 bytes) instead of bf16 (2)"): 4 * n,
                    Mistake("weights-as-parameters",
                            "you counted parameters, not bytes: bf16 weights take 2 bytes "
                            "each."): n,
                    _TIED: 2 * n_tied},
        "gradients": {Mistake("gradients-fp32",
                              "the gradients are bf16 (2 bytes per parameter), like the weights.",
                              "counted the gradients in fp32 (4 bytes) instead of bf16 (2)"): 4 * n,
                      Mistake("missing-gradients",
                              "you left out the gradients: one per parameter, 2 bytes (bf16)."): 0,
                      _TIED: 2 * n_tied},
        "optimizer": {_OPT_8N: 8 * n, _OPT_4N: 4 * n, _TIED: 12 * n_tied,
                      Mistake("optimizer-16-bytes",
                              "the optimizer's 12 bytes per parameter are the fp32 master weights "
                              "and m and v; the bf16 weights and gradients have keys of their own.",
                              "counted the bf16 weights and gradients in the optimizer too "
                              "(16 bytes)"):
                          16 * n},
        "activations": a,
        "total": left_out
        | {Mistake("total-counts-a-part-twice", f"your total counts the {part} twice: {sum_of}"):
           total + right[part] for part in ("weights", "gradients", "optimizer", "activations")}
        | {_RETURNED_GIB: total / 2**30, _RETURNED_GB: total / 1e9},
    }
    m["total"][head_each_layer] = total + 2 * B * T * (L - 1) * head
    for key, right_bytes in ref.STATE_BYTES.items():
        m[key] |= _parameter_family(cfg, key, right_bytes, n)
    return m


# What one layer saves per token, and the head (section 10), in the words a hint uses.
_LAYER_LIST = ("one layer saves per token: 4d (two norms, their input and output each), H*d_h (q), "
               "2*H_kv*d_h (k and v), H*d_h (the attention output, W_O's input), 4*d_ff (the SwiGLU "
               "MLP), and H*seq_len (P) with naive attention")

def _per_token_family(cfg, B: int, T: int, attention: str, acts: int, full: bool) -> dict[str, int]:
    """Activations off by c numbers of one width per token, in every layer or in the head once:
    each a mistake whose hint says which width and where (a tensor left out or counted too often)."""
    d, H, H_kv, d_h, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
    width = {"d_model": d, "n_heads*head_dim": H * d_h, "n_kv_heads*head_dim": H_kv * d_h, "head_dim": d_h,
             "d_ff": f, "n_heads*seq_len": H * T}
    out: dict[str, int] = {}
    for c in (1, 2, 3, 4):
        for sign, word in ((-1, "fewer"), (1, "more")):
            for name, w in width.items():
                tensors = f"a {name}-wide tensor" if c == 1 else f"{c} {name}-wide tensors"
                hint = (f"each layer of yours counts {c} x {name} {word} numbers per token than it "
                        f"saves: {tensors} {'left out' if sign < 0 else 'too many'} in every layer. "
                        f"Compare your list with section 10's: {_LAYER_LIST}.")
                # in every stored layer; with recomputation only the recomputed layer has them
                layers = cfg.n_layers if full else 1
                out[Mistake("each-layer-off-by-a-width", hint, f"each layer counted {c} x {name} {word} per token")] = (
                    acts + sign * 2 * B * T * layers * c * w)
            for name, w in (("d_model", d), ("vocab", cfg.vocab)):
                hint = (f"your head (the top of the model, counted once) has {c} x {name} {word} "
                        "numbers per token than it saves: the final norm's input and output (d "
                        "each) and the log-probabilities (vocab), 2d + vocab per token.")
                out[Mistake("head-off-by-a-width", hint, f"the head counted {c} x {name} {word} per token")] = (
                    acts + sign * 2 * B * T * c * w)
            if attention == "recompute":
                hint = (f"with full recomputation each layer keeps its input, d numbers per token; "
                        f"yours keeps {c} x d {word} per layer.")
                out[Mistake("recompute-keeps-another-width", hint, f"with recomputation, each layer kept {c} x d {word}")] = (
                    acts + sign * 2 * B * T * cfg.n_layers * c * d)
    return out


_WHY_BYTES = {"weights": "bf16 weights, 2 bytes each", "gradients": "bf16 gradients, 2 bytes each",
              "optimizer": "the fp32 master weights (4) and AdamW's fp32 m and v (4 each), 12 bytes"}


def _parameter_family(cfg, key: str, right_bytes: int, n: int) -> dict[str, int]:
    """``key`` at another number of bytes per parameter, or with a parameter count that left a part out."""
    d, L, f = cfg.d_model, cfg.n_layers, cfg.d_ff
    out: dict[str, int] = {}
    named = {"weights": (1, 4), "gradients": (0, 4), "optimizer": (4, 8, 16)}[key]  # these have mistakes of their own
    for c in range(0, 25):
        if c != right_bytes and c not in named:
            out[Mistake("other-bytes-per-parameter",
                        f"you counted the {key} at {c} bytes per parameter (N = dense_param_count(cfg)); "
                        f"under this convention they take {right_bytes}: {_WHY_BYTES[key]}.",
                        f"counted the {key} at {c} bytes per parameter")] = c * n
    attn_kv = 2 * L * d * (cfg.n_heads - cfg.n_kv_heads) * cfg.head_dim
    for _part, hint, count in (
            ("final-norm", "your parameter count leaves out the final norm's d weights", n - d),
            ("layer-norms", "your parameter count leaves out the two norms of each layer (2d weights "
             "per layer)", n - 2 * d * L),
            ("all-norms", "your parameter count leaves out the norms' weights (2d per layer and d for the "
             "final norm)", n - 2 * d * L - d),
            ("one-mlp-matrix", "your parameter count has two MLP matrices per layer; SwiGLU has three "
             "(gate, up, down: 3*d*d_ff)", n - L * d * f),
            ("kv-with-H-heads", "your parameter count gives W_K and W_V n_heads heads; they have "
             "n_kv_heads (grouped-query attention)", n + attn_kv)):
        if count != n:
            out[Mistake("parameter-count-off-by-a-part", f"{hint}: use N = dense_param_count(cfg), "
                        f"{right_bytes} bytes each for the {key}.", hint)] = right_bytes * count
    return out


def _training_factors(cfg, B: int, T: int) -> dict[str, int]:
    """The quantities an activation count can be off by (a factor, or a difference), in words."""
    L = cfg.n_layers
    return {"the batch": B, "seq_len": T, "n_layers": L, "n_heads": cfg.n_heads,
            "2 bytes x batch x seq_len (one number per token)": 2 * B * T,
            "2 bytes x batch x seq_len x n_layers (one number per token in each layer)": 2 * B * T * L,
            "2 bytes x batch x seq_len x seq_len (one number per token and key)": 2 * B * T * T,
            "2 bytes x batch x n_heads x seq_len x seq_len (one P of one layer)": 2 * B * cfg.n_heads * T * T}


def _config(name: str, d: int, L: int, H: int, H_kv: int, d_h: int, f: int, vocab: int) -> ModelConfig:
    return ModelConfig(name, "gqa" if H_kv < H else "mha", d, L, H, H_kv, d_h, f, vocab, "a check's case")


def _drawn_training_case() -> tuple[ModelConfig, int, int, str]:
    """A case drawn from a seed: d 8-64, 1-6 layers, 1-4 key/value heads of 1-4 query heads, d_h
    2-16, d_ff 8-128, vocab 16-300, batch 1-5, seq_len 1-64, one of the three strategies."""
    g = seeded(803)
    H_kv = draw(g, 1, 5)
    cfg = _config("drawn", draw(g, 8, 65), draw(g, 1, 7), H_kv * draw(g, 1, 5), H_kv, draw(g, 2, 17),
                  draw(g, 8, 129), draw(g, 16, 301))
    return cfg, draw(g, 1, 6), draw(g, 1, 65), ref.STRATEGIES[draw(g, 0, 3)]


@exercise()
def training_memory(t: Trial) -> None:
    # dense_param_count stays allowed; these count the activations, the heart of the exercise
    t.forbidden_references = {"training_memory", "activation_numbers", "saved_numbers", "layer_activation_numbers",
                              "head_activation_numbers", "max_batch"}
    t.error_hints = {
        r"takes \d+ positional argument": wrong_signature(
            "training_memory(cfg, batch, seq_len, attention)."),
    }
    # A small GQA model in which no two sizes are equal (H*d_h != d, T != B), under each strategy;
    # Llama-3-8B at its 8,192-token context; an MHA model; then one drawn from a seed.
    small = _config("small", 48, 3, 6, 2, 10, 136, 211)
    llama = MODELS["Llama-3-8B"]
    cases = [(small, 5, 17, "naive"), (small, 2, 23, "flash"), (small, 3, 29, "recompute"),
             (llama, 1, 8192, "flash"), (llama, 2, 4096, "naive"), (llama, 4, 8192, "recompute"),
             (_config("mha", 40, 2, 5, 5, 8, 96, 64), 3, 11, "naive"), _drawn_training_case()]
    planned = [(c, ref.training_memory(*c), _training_mistakes(*c)) for c in cases]
    # A mistake has a model on every case (the right count where it changes nothing): the core names
    # it only if it gives the learner's count on every case (one case alone cannot tell, say, P
    # counted per key/value head from P counted once).
    for (cfg, B, T, attention), expected, mistakes in planned:
        sizes = (f"ModelConfig(d_model={cfg.d_model}, n_layers={cfg.n_layers}, n_heads={cfg.n_heads}, "
                 f"n_kv_heads={cfg.n_kv_heads}, head_dim={cfg.head_dim}, d_ff={cfg.d_ff}, vocab={cfg.vocab})")
        given = dataclasses.replace(cfg)  # a copy: the course's MODELS stay as they are, whatever it does
        got = t.call(given, B, T, attention, case=f"cfg={cfg.name}: {sizes}, " +
                     describe_case(batch=B, seq_len=T, attention=attention))
        changed = [f"{f.name} {getattr(cfg, f.name)!r} -> {getattr(given, f.name)!r}"
                   for f in dataclasses.fields(cfg) if getattr(given, f.name) != getattr(cfg, f.name)]
        if changed:
            t.fail(f"your function changed the ModelConfig it was given ({'; '.join(changed)}). A count "
                   "reads its inputs and leaves them as they are: compute with local variables "
                   "(the config is frozen; object.__setattr__ gets around that, and the caller's "
                   "model would change with it).",
                   Mistake("changed-the-config", "leave cfg as it is: read its sizes into local "
                           "variables and compute with those.", "changed the ModelConfig it was given"))
        if not isinstance(got, Mapping):
            t.fail(f"expected a dict with the keys {', '.join(PARTS)}; got {describe(got)}.",
                   Mistake("not-a-dict", "return {'weights': ..., 'gradients': ..., 'optimizer': "
                           "..., 'activations': ..., 'total': ...}: one int of bytes per part.",
                           "returned something other than a dict of the parts"))
        missing = [k for k in PARTS if k not in got]
        if missing:
            t.fail(f"your dict lacks the key(s) {', '.join(repr(k) for k in missing)} (it has "
                   f"{', '.join(sorted(key_text(k) for k in got))}).",
                   Mistake("missing-keys", f"use exactly these names: {', '.join(PARTS)}.",
                           "returned a dict that lacks some of the keys (or names them otherwise)"))
        values = {k: got[k] for k in PARTS}
        for key in PARTS:
            check_count(t, values[key], expected[key], f"[{key!r}]", mistakes[key], _RECIPE_84,
                        factors=_training_factors(cfg, B, T) if key == "activations" else None)
