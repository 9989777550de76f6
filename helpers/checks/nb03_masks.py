"""Checks for notebook 03_masks: exercises 3.1-3.6."""

from __future__ import annotations

import math
from numbers import Integral

import torch

from .. import nb01_qkv_shapes as att
from .. import nb03_masks as ref
from .core import Trial, describe, describe_case, draw, exercise, seeded
from .feedback import Mistake
from .probes import ToyAttention

__all__ = ["causal_mask", "padding_mask", "masked_softmax", "prefix_lm_mask", "packed_causal_mask", "find_mask_leaks"]

NB = "03_masks"

POLARITY = ("the mask is inverted: True means *may attend* (the convention of "
            "torch.nn.functional.scaled_dot_product_attention), False means blocked.")
_ADDITIVE_MASK = Mistake(
    "additive-mask",
    "this exercise asks for the boolean form (True = may attend). The additive form is derived "
    "from it when you need it: torch.zeros(shape).masked_fill(~allowed, float('-inf')).",
    "returned an additive (0 / -inf) mask instead of a bool one")
_NUMBER_MASK = Mistake(
    "number-mask",
    "return a bool tensor, not 0/1 numbers: comparisons (`j <= i`, `j < L`) already give bool, and "
    "torch.ones(..., dtype=torch.bool).tril() builds a bool triangle.",
    "returned a 0/1 number mask instead of a bool one")



def _tril(T: int, diagonal: int = 0, cols: int | None = None) -> torch.Tensor:
    return torch.ones(T, T if cols is None else cols, dtype=torch.bool).tril(diagonal)



def _mask(t: Trial, got, expected: torch.Tensor, mistakes: dict, hint: str) -> None:
    """Compare a boolean mask, naming float 0/1 and additive 0/-inf masks and inverted polarity."""
    __tracebackhide__ = True
    if isinstance(got, torch.Tensor) and got.dtype != torch.bool:
        if got.is_floating_point() and bool((got < 0).any()):
            t.fail(f"mask: expected dtype torch.bool, got {got.dtype} with negative entries: an additive (0 / -inf) mask.",
                   _ADDITIVE_MASK)
        t.fail(f"mask: expected dtype torch.bool, got {got.dtype}.", _NUMBER_MASK)
    mistakes = {**mistakes, Mistake("inverted-mask", POLARITY): lambda: ~expected}
    t.tensor(got, expected, what="mask", mistakes=mistakes, hint=hint)


# --------------------------------------------------------------------------- 3.1


@exercise("3.1", "causal mask", points=1, stars=1, notebook=NB, section="1. A mask is a yes/no table")
def causal_mask(t: Trial) -> None:
    g = seeded(350)
    cases = [(T, ref.causal_mask(T)) for T in (5, 1, 8, draw(g, 2, 65))]  # the last T (2-64) drawn from a seed
    for T, expected in cases:
        got = t.call(T, case=describe_case(T=T))
        mistakes = {
            Mistake("upper-triangle",
                    "you built the upper triangle: row i is query i, so it must allow keys j <= i "
                    "(the lower triangle with the diagonal); the upper one lets every token read "
                    "the future."): lambda: _tril(T).T,
            Mistake("missing-diagonal",
                    "the diagonal is missing: a token may attend to itself (j <= i, not j < i); "
                    "without it row 0 has nothing allowed."): lambda: _tril(T, -1),
            Mistake("mask-off-by-one",
                    "your mask lets query i see key i + 1, one step into the future: the rule is "
                    "j <= i."): lambda: _tril(T, 1),
            Mistake("added-batch-and-head-axes",
                    "return the [T, T] mask itself; broadcasting adds the batch and head axes "
                    "later.",
                    "returned a [1, 1, T, T] mask instead of the [T, T] one"):
                lambda: _tril(T)[None, None],
        }
        _mask(t, got, expected, mistakes, hint="torch.ones(T, T, dtype=torch.bool).tril(): True on and below the diagonal.")


# --------------------------------------------------------------------------- 3.2


@exercise("3.2", "padding mask", points=2, stars=2, notebook=NB, section="2.1 Padding: a mask on keys, shaped to broadcast")
def padding_mask(t: Trial) -> None:
    # B != T everywhere; a zero length (all keys padding) and a full length are included.
    cases = [(torch.tensor([3, 6, 1, 0]), 6), (torch.tensor([2, 5], dtype=torch.int32), 7), (torch.tensor([4, 4, 1]), 4)]
    g = seeded(351)  # then one drawn from a seed: B < 6 <= T, each length in 0..T
    T, B = draw(g, 6, 33), draw(g, 2, 6)
    cases.append((torch.randint(0, T + 1, (B,), generator=g), T))
    cases = [(lengths, T, ref.padding_mask(lengths, T)) for lengths, T in cases]
    for lengths, T, expected in cases:
        got = t.call(lengths, T, case=describe_case(lengths=lengths.tolist(), T=T))
        B = lengths.shape[0]
        j = torch.arange(T)
        L = lengths[:, None].long()
        keys = j < L  # [B, T]
        queries = keys[:, None, :, None]  # [B, 1, T, 1]
        mistakes = {
            Mistake("missing-singleton-axes",
                    "return [B, 1, 1, T], not [B, T]: the two singleton axes let it broadcast "
                    "over heads and queries (mask[:, None, None, :]).",
                    "returned a [B, T] mask instead of [B, 1, 1, T]"): lambda: keys,
            Mistake("masked-queries",
                    "you masked queries (rows) instead of keys (columns): padding is hidden by "
                    "blocking the padded *keys*, the last axis, so the mask is [B, 1, 1, T]."):
                lambda: queries,
            Mistake("masked-queries",
                    "you masked queries (rows) instead of keys (columns): padded positions must "
                    "be blocked as keys, the last axis."): lambda: queries.expand(B, 1, T, T),
            Mistake("expanded-over-queries",
                    "return [B, 1, 1, T] and let broadcasting expand it over the queries, instead "
                    "of a [B, 1, T, T] copy.",
                    "returned a [B, 1, T, T] copy instead of a broadcastable [B, 1, 1, T] mask"):
                lambda: keys[:, None, None, :].expand(B, 1, T, T),
            Mistake("off-by-one-allows-key-L",
                    "off by one: a sequence of length L occupies positions 0..L-1, so key j is "
                    "allowed iff j < L (not j <= L).",
                    "off by one: allowed key j = L (j <= L instead of j < L)"):
                lambda: (j <= L)[:, None, None, :],
            Mistake("off-by-one-blocks-key-L-1",
                    "off by one: a sequence of length L occupies positions 0..L-1, so key j is "
                    "allowed iff j < L (not j < L - 1).",
                    "off by one: blocked key j = L - 1 (j < L - 1 instead of j < L)"):
                lambda: (j < L - 1)[:, None, None, :],
            Mistake("left-padding",
                    "the real tokens are at the start (right padding): key j is allowed iff j < "
                    "lengths[b]; you allowed the last lengths[b] positions (left padding).",
                    "allowed the last lengths[b] positions (left padding) instead of the first"):
                lambda: (j >= T - L)[:, None, None, :],
            Mistake("inverted-mask",
                    POLARITY + " Careful: nn.MultiheadAttention's key_padding_mask uses the "
                    "opposite (True = ignore)."): lambda: ~keys[:, None, None, :],
        }
        _mask(t, got, expected, mistakes, hint="(torch.arange(T) < lengths[:, None])[:, None, None, :]")


# --------------------------------------------------------------------------- 3.3


OVERFLOW = ("exp overflowed: exp(1e4) is inf in float32 (so is anything above ~88.7), and inf/inf or inf*0 "
            "is NaN. Subtract each row's maximum over the allowed scores before exp (torch.softmax does this for you).")
NAN_ROWS = ("rows with nothing allowed came out NaN: softmax over a row of all -inf is 0/0. Those rows must be all "
            "zeros, e.g. torch.where(allowed.any(-1, keepdim=True), p, 0.0) (or compute exp/sum yourself and divide "
            "only where the sum is > 0).")
_SOFTMAX_RECIPE = ("p = torch.softmax(scores.masked_fill(~allowed, float('-inf')), dim=-1) (torch.softmax subtracts "
                   "each row's max), then torch.where(allowed.any(-1, keepdim=True), p, 0.0) for rows with nothing allowed.")


def _fill_text(fill: float) -> str:
    """-1e9 as "-1e9", the float32 minimum as "torch.finfo(dtype).min"."""
    if fill == torch.finfo(torch.float32).min:
        return "torch.finfo(dtype).min"
    exponent = round(math.log10(-fill))
    return f"-1e{exponent}" if fill == -(10.0 ** exponent) else f"{fill:g}"


def _softmax_mistakes(s: torch.Tensor, allowed: torch.Tensor) -> dict:
    a = allowed.expand_as(s)
    filled = s.masked_fill(~a, float("-inf"))
    any_row = a.any(-1, keepdim=True)
    empty_rows = int((~any_row).sum())
    lowest = float(s[a].min()) if bool(a.any()) else 0.0

    def renormalised(floor=0.0):  # floor: a denominator clamped from below (clamp_min(1e-30))
        p = torch.softmax(s, -1) * a
        d = p.sum(-1, keepdim=True)
        return p / (d.clamp_min(floor) if floor else torch.where(d > 0, d, torch.ones_like(d)))

    def no_max():
        e = torch.exp(s) * a
        return e / e.sum(-1, keepdim=True).clamp_min(1e-30)

    def no_max_filled():
        e = torch.exp(filled)
        return e / e.sum(-1, keepdim=True)

    overflow = "exp overflowed: did not subtract each row's max before exp"
    mistakes = {
        Mistake("nan-in-empty-rows", NAN_ROWS): lambda: torch.softmax(filled, -1),
        Mistake("masked-after-softmax-renormalised",
                "you masked after the softmax and renormalised: exact on paper, but when a "
                "blocked score is far larger than the allowed ones (logits of 1e4) the allowed "
                "probabilities underflow to 0 before you renormalise. Fill blocked scores with "
                "-inf before the softmax."): renormalised,
        # the same mistake with the denominator clamped (where allowed probabilities underflowed to
        # below the clamp, the row comes out unnormalised): named alike on every draw
        Mistake("masked-after-softmax-renormalised",
                "you masked after the softmax and renormalised: exact on paper, but when a "
                "blocked score is far larger than the allowed ones (logits of 1e4) the allowed "
                "probabilities underflow (to 0, or below your clamp of the denominator) before you "
                "renormalise. Fill blocked scores with -inf before the softmax.",
                "masked after the softmax and renormalised"): lambda: renormalised(1e-30),
        Mistake("masked-after-softmax",
                "you masked after the softmax: the zeroed weights no longer sum to 1, and the "
                "kept ones are divided by a denominator that still contains the blocked keys (so "
                "blocked tokens still move the output). Fill blocked scores with -inf *before* "
                "the softmax."): lambda: torch.softmax(s, -1) * a,
        Mistake("exp-overflow", OVERFLOW, overflow): no_max,
        Mistake("exp-overflow",
                OVERFLOW.replace("exp overflowed:", "exp overflowed (after the -inf fill):"),
                overflow): no_max_filled,
        Mistake("inverted-mask", POLARITY + " You blocked the allowed keys and kept the others."):
            lambda: att.masked_softmax(s, ~allowed),
        Mistake("softmax-over-queries",
                "the softmax runs over the keys, the last dim (dim=-1): each query's row sums to "
                "1.",
                "softmax over the queries (dim=-2) instead of over the keys"):
            lambda: torch.softmax(filled, -2).nan_to_num(0.0),
        Mistake("multiplied-scores-by-mask",
                "you multiplied the scores by the mask: a blocked score becomes 0, and exp(0) = 1 "
                "still gives it weight. Hide blocked scores with -inf "
                "(scores.masked_fill(~allowed, float('-inf'))) before the softmax."):
            lambda: torch.softmax(s * a, -1),
        Mistake("sigmoid-not-softmax",
                "you used a sigmoid: each weight is then squashed on its own, and a row does not "
                "sum to 1. The softmax normalises over the allowed keys: exp(s - max) / sum of "
                "exp over the row."): lambda: torch.sigmoid(s).masked_fill(~a, 0.0),
    }
    # A finite fill instead of -inf: right where it is far below every allowed score and rows with
    # nothing allowed are set to zero (a -1e9 fill that does both passes); wrong otherwise.
    if empty_rows:
        finite = Mistake(
            "finite-fill-uniform-empty-rows",
            f"you filled blocked scores with a finite number instead of -inf: a row with "
            f"nothing allowed (here {empty_rows}) then becomes uniform over all keys (1/T_k each) "
            "instead of all zeros.",
            "filled with a finite number: rows with nothing allowed became uniform, not zeros")
        mistakes[finite] = lambda: torch.softmax(s.masked_fill(~a, -1e9), -1)
    for fill in (-1e4, -1e5, -1e6):
        too_high = Mistake(
            "fill-above-allowed-scores",
            f"you filled blocked scores with {_fill_text(fill)}, but here allowed scores go "
            f"down to {lowest:.3g}: a blocked key can then outweigh an allowed one. Fill with "
            "-inf, which is below every score.",
            "filled blocked scores with a finite number that some allowed scores are below")
        mistakes[too_high] = (
            lambda fill=fill: torch.where(any_row, torch.softmax(s.masked_fill(~a, fill), -1), 0.0))
    return mistakes


@exercise("3.3", "masked softmax", points=2, stars=2, notebook=NB,
          section="4.4 A row with nothing allowed: NaN, and how it spreads")
def masked_softmax(t: Trial) -> None:
    t.error_hints = {
        r"shape of the mask|must match the size|does not match": Mistake(
            "indexed-with-broadcast-mask",
            "allowed only *broadcasts* to scores (it may be [T_q, T_k] or [B, 1, 1, T_k]): use "
            "scores.masked_fill(~allowed, float('-inf')) or torch.where, which broadcast, instead "
            "of boolean indexing.",
            "indexed the scores with a mask that only broadcasts to them"),
    }
    g = seeded(300)
    B, H, T_q, T_k = 2, 3, 4, 6
    # 1. moderate scores, a [T_q, T_k] mask that broadcasts over B and H (every row has a key).
    s1 = torch.randn(B, H, T_q, T_k, generator=g) * 2
    a1 = _tril(T_q, 2, T_k)
    # 2. a padding-style mask [B, 1, 1, T_k] with an empty sequence: whole rows with nothing allowed.
    s2 = torch.randn(B + 1, H, T_q, T_k, generator=g)
    a2 = ref.padding_mask(torch.tensor([4, 0, 6]), T_k)
    # 3. logits of +-1e4: overflow without the max subtraction, underflow when masking after softmax.
    s3 = torch.randn(B, H, T_q, T_k, generator=g) * 1e4
    a3 = torch.rand(T_q, T_k, generator=g) < 0.5
    a3[:, 0] = True
    a3[0, -1] = False  # row 0 (below) always has a blocked key for a finite fill to favour
    # ... and one row whose allowed scores all lie far below any finite fill (-1e4 .. -1e6), on every
    # draw: a finite fill then gives the blocked keys the weight.
    s3[0, 0, 0] = torch.where(a3[0], s3[0, 0, 0] - 5e6, s3[0, 0, 0])
    # and one whose allowed scores are all negative but above the fills: multiplying the scores by the
    # mask (blocked scores 0) then differs from a finite fill, so each mistake keeps its own name.
    s3[0, 0, 1] = torch.where(a3[1], -100 - s3[0, 0, 1].abs() * 0.01, s3[0, 0, 1])
    # 4. a full-shape mask, no leading dims broadcast, and another empty row.
    s4 = torch.randn(5, 7, generator=g) * 3
    a4 = torch.rand(5, 7, generator=g) < 0.6
    a4[2] = False
    cases = [(s, a, ref.masked_softmax(s, a)) for s, a in [(s1, a1), (s2, a2), (s3, a3), (s4, a4)]]
    for s, a, expected in cases:
        got = t.call(s, a, case=describe_case(scores=s, allowed=a))
        t.tensor(got, expected, what="weights", mistakes=_softmax_mistakes(s, a), atol=1e-6, hint=_SOFTMAX_RECIPE)


# --------------------------------------------------------------------------- 3.4


@exercise("3.4", "prefix-LM mask", points=2, stars=2, notebook=NB, section="2.2 Prefix-LM: a bidirectional prefix, then causal")
def prefix_lm_mask(t: Trial) -> None:
    g = seeded(352)  # the last case drawn from a seed: T 2-32, 0 <= prefix_len <= T
    T_drawn = draw(g, 2, 33)
    drawn = (T_drawn, draw(g, 0, T_drawn + 1))
    cases = [(T, p, ref.prefix_lm_mask(T, p)) for T, p in [(7, 3), (6, 0), (5, 5), (9, 4), drawn]]
    for T, p, expected in cases:
        got = t.call(T, p, case=describe_case(T=T, prefix_len=p))
        i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
        causal = j <= i
        mistakes = {
            Mistake("prefix-sees-suffix",
                    "the prefix sees the future: prefix positions may see the whole prefix, but "
                    "not the suffix (the tokens being generated). Only the [prefix_len, "
                    "prefix_len] block becomes all True."): lambda: causal | (i < p),
            Mistake("prefix-block-one-too-large",
                    "the prefix is positions 0..prefix_len-1: your bidirectional block is one too "
                    "large.",
                    "the bidirectional prefix block is one position too large"):
                lambda: causal | ((i <= p) & (j <= p)),
            Mistake("prefix-block-one-too-small",
                    "the prefix is positions 0..prefix_len-1: your bidirectional block is one too "
                    "small.",
                    "the bidirectional prefix block is one position too small"):
                lambda: causal | ((i < p - 1) & (j < p - 1)),
            Mistake("suffix-cannot-see-prefix",
                    "suffix positions must still see the whole prefix (and their own past): only "
                    "the prefix's own block changes from causal to full.",
                    "suffix positions cannot see the prefix"):
                lambda: ((i < p) & (j < p)) | ((i >= p) & (j >= p) & causal),
            Mistake("plain-causal",
                    "the prefix positions must see each other in both directions; you returned a "
                    "plain causal mask.",
                    "returned a plain causal mask (the prefix is not bidirectional)"):
                lambda: causal,
            Mistake("suffix-not-causal",
                    "after the prefix, attention is causal: suffix tokens must not see later "
                    "suffix tokens.",
                    "suffix tokens see later suffix tokens (all True)"):
                lambda: torch.ones(T, T, dtype=torch.bool),
        }
        _mask(t, got, expected, mistakes,
              hint="start from the causal mask and set the [prefix_len, prefix_len] top-left block to True.")


# --------------------------------------------------------------------------- 3.5


@exercise("3.5", "packed (block-diagonal causal) mask", points=2, stars=2, notebook=NB,
          section="2.3 Packed sequences: block-diagonal causal (varlen)")
def packed_causal_mask(t: Trial) -> None:
    # The learner gets a list of its own; the machinery of t.call notices if it is changed in place.
    g = seeded(353)  # the last case drawn from a seed: 1 to 4 sequences of 1 to 5 tokens
    drawn = tuple(draw(g, 1, 6) for _ in range(draw(g, 1, 5)))
    cases = [(seq_lens, ref.packed_causal_mask(seq_lens))
             for seq_lens in ((3, 2, 4), (5,), (1, 4, 2, 3), (2, 1, 1), drawn)]
    for seq_lens, expected in cases:
        got = t.call(list(seq_lens), case=describe_case(seq_lens=list(seq_lens)))
        N = sum(seq_lens)
        cu = torch.tensor([0, *seq_lens]).cumsum(0)
        pos = torch.arange(N)
        seq = torch.bucketize(pos, cu[1:], right=True)  # sequence id of each position
        shifted = torch.bucketize(pos, cu[1:-1], right=False)  # boundaries one position late
        causal = _tril(N)
        mistakes = {
            Mistake("attends-across-sequences",
                    "tokens attend across sequence boundaries: packing must hide every other "
                    "sequence, so the mask is block-diagonal (same sequence) AND causal."):
                lambda: causal,
            Mistake("bidirectional-blocks",
                    "within each sequence attention must be causal; your blocks are full "
                    "(bidirectional).",
                    "the blocks are full (bidirectional), not causal"):
                lambda: seq[:, None] == seq[None, :],
            Mistake("boundary-off-by-one",
                    "the sequence boundaries are off by one: sequence s occupies positions "
                    "cu_seqlens[s] .. cu_seqlens[s+1]-1, with cu_seqlens = [0, "
                    "cumsum(seq_lens)]."): lambda: (shifted[:, None] == shifted[None, :]) & causal,
            Mistake("diagonal-only",
                    "each sequence may see its own past, not only itself: you kept the diagonal "
                    "only.",
                    "kept the diagonal only (each token sees only itself)"):
                lambda: torch.eye(N, dtype=torch.bool),
        }
        _mask(t, got, expected, mistakes,
              hint="torch.block_diag(*[causal_mask(n) for n in seq_lens]), or (seq_id[:, None] == seq_id[None, :]) & causal.")


# --------------------------------------------------------------------------- 3.6


toy_attention = ToyAttention


def _leak_cases():
    """(name, attention_fn, allowed, d_model, denominator-only pairs, round-off only) for the check of 3.6."""
    causal7 = _tril(7)
    cases = [("a leak-free causal attention", toy_attention(causal7, 12, seed=1), causal7, 12, set(), False)]
    cases.append(("a leak-free attention with float round-off", toy_attention(causal7, 12, seed=2, roundoff=True), causal7, 12, set(), True))
    causal6 = _tril(6)
    cases.append(("an off-by-one causal mask", toy_attention(_tril(6, 1), 10, seed=3), causal6, 10, set(), False))
    pad = _tril(8) & (torch.arange(8) < 5)  # keys 5..7 are padding
    cases.append(("an attention that ignores padding", toy_attention(_tril(8), 9, seed=4), pad, 9, set(), False))
    # A prompt [system 0-1 | tool 2-4 | user 5-8]: user positions must not read the tool block.
    T = 9
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    protected = (i >= 5) & (j >= 2) & (j <= 4)
    policy = _tril(T) & ~protected
    denominator = {(a, b) for a, b in protected.nonzero().tolist()}
    cases.append(("a tool block hidden after the softmax, plus an off-by-one causal mask",
                  toy_attention(_tril(T, 1), 11, seed=5, zero_after_softmax=~protected), policy, 11, denominator, False))
    # [system 0-1 | tool 2-3 | assistant 4-5 | user 6-8]: user may not read the tool block, but the
    # assistant may, and the user reads the assistant: a second layer carries the tool block across.
    protected2 = (i >= 6) & (j >= 2) & (j <= 3)
    policy2 = _tril(T) & ~protected2
    cases.append(("two correctly masked layers", toy_attention(policy2, 8, seed=6, layers=2), policy2, 8, set(), False))
    return cases


ROUNDOFF = ("these outputs move only by float round-off (about 1e-16 relative in float64, 1e-7 in float32), "
            "not through a leak: compare with a tolerance well above that, e.g. changed = (new - base).abs().max() "
            "> 1e-6 * (1 + base.abs().max()), and work in float64.")


def _pairs_text(pairs) -> str:
    pairs = list(pairs)
    return "[" + ", ".join(map(str, pairs[:6])) + (", ..." if len(pairs) > 6 else "") + f"] ({len(pairs)})"

# The mistakes find_mask_leaks names when it fails.
_WRONG_PROBE = Mistake(
    "probe-not-1-T-d_model",
    "build x with shape [1, T, d_model] (T = allowed.shape[-1]), as a float tensor: "
    "torch.randn(1, T, d_model, dtype=torch.float64).",
    "called attention_fn with an x that is not a float [1, T, d_model] tensor")
_RETURNED_NONE = Mistake("returned-None", "did you forget the `return` statement?")
_RETURNED_TENSOR = Mistake(
    "returned-tensor", "convert it: [tuple(p) for p in idx.tolist()] gives tuples of Python ints.",
    "returned a tensor instead of a list of (i, j) tuples")
_NOT_A_LIST = Mistake("not-a-list", "return sorted(pairs): a sorted list.",
                      "returned something other than a list of pairs")
_NOT_INT_TUPLES = Mistake(
    "items-not-int-tuples",
    "append tuple(int(i), int(j)) (a list [i, j] or a tensor element is not a tuple of ints).",
    "the items are not tuples of two ints (lists or tensor elements)")
_KEY_QUERY = Mistake(
    "pairs-as-key-query",
    "your pairs are (key, query): each pair is (i, j) = (query, key), the row and column of "
    "allowed[i, j].")
_ALLOWED_PAIRS = Mistake(
    "reported-allowed-pairs",
    "report only pairs with allowed[i, j] False: allowed pairs are supposed to change the output.",
    "reported pairs that the mask allows")
_DUPLICATES = Mistake(
    "duplicate-pairs",
    "each pair should appear once: collect the pairs in a set (or a boolean [T, T] matrix) across "
    "perturbations, then sort.",
    "reported the same pair more than once")
_UNSORTED = Mistake(
    "unsorted-pairs", "return the pairs sorted, by query i then key j: sorted(pairs).",
    "returned the right pairs, unsorted")
_NO_TOLERANCE = Mistake("round-off-counted-as-leak", ROUNDOFF,
                        "counted float round-off as a leak (no tolerance, or one too small)")
_EVERY_BLOCKED = Mistake(
    "reported-every-blocked-pair",
    "you reported every disallowed pair without testing it: a pair leaks only if perturbing the "
    "input at j actually changes the output row i.")
_NO_LEAKS = Mistake(
    "found-no-leaks",
    "you found no leaks, but perturbing the input at these keys changes these outputs: compare "
    "the whole output row i before and after changing x[0, j], with a tolerance well above float "
    "noise.",
    "found no leaks where there are some")
_MISSED_DENOMINATOR = Mistake(
    "missed-denominator-leaks",
    "you missed leaks through the softmax denominator: zeroing a weight *after* the softmax leaves "
    "exp(score of j) in the denominator of row i. A change at j then rescales row i's output even "
    "though its weight on j is 0. Start from a random base input (not zeros), so every score and "
    "every output is non-trivial, and perturb with a random vector.")
_UNCHANGED_PAIRS = Mistake(
    "reported-unchanged-pairs",
    "report a pair only when the output row actually moved (by more than a small tolerance) after "
    "perturbing position j, never from the mask or the weights alone.",
    "reported pairs whose output row does not move")


@exercise("3.6", "find mask leaks by perturbation", points=3, stars=3, notebook=NB, section="5. Mask tests: perturb and watch")
def find_mask_leaks(t: Trial) -> None:
    t.error_hints = {
        r"attention_fn expects": _WRONG_PROBE,
    }
    cases = [(*case, ref.find_mask_leaks(case[1], case[2], case[3])) for case in _leak_cases()]
    for name, fn, allowed, d_model, denominator, roundoff, expected in cases:
        got = t.call(fn, allowed, d_model, case=f"{name}: allowed=bool{list(allowed.shape)}, d_model={d_model}")
        if got is None:
            t.fail("expected a list of (i, j) pairs, got None.", _RETURNED_NONE)
        if isinstance(got, torch.Tensor):
            t.fail(f"expected a list of (i, j) tuples, got a tensor {describe(got)}.",
                   _RETURNED_TENSOR)
        if not isinstance(got, list):
            t.fail(f"expected a list of (i, j) tuples, got {describe(got)}.", _NOT_A_LIST)
        for p in got:
            if not (isinstance(p, tuple) and len(p) == 2
                    and all(isinstance(e, Integral) and not isinstance(e, bool) for e in p)):
                t.fail(f"expected every item to be a tuple (i, j) of two ints, found {describe(p)}.",
                       _NOT_INT_TUPLES)
        got = [(int(a), int(b)) for a, b in got]
        if got == expected:
            continue
        T = allowed.shape[-1]
        blocked = {(a, b) for a, b in (~allowed).nonzero().tolist()}
        g, e = set(got), set(expected)
        head = f"expected {_pairs_text(expected)}, got {_pairs_text(got)}."
        if g and {(b, a) for a, b in g} == e:
            t.fail(head, _KEY_QUERY)
        if any(not (0 <= a < T and 0 <= b < T) for a, b in g):
            t.fail(head, Mistake("position-out-of-range", f"positions run from 0 to T-1 = {T - 1}.",
                                 "reported positions outside 0..T-1"))
        if g - blocked:
            t.fail(head + f" {_pairs_text(sorted(g - blocked))} are allowed pairs.",
                   _ALLOWED_PAIRS)
        if len(g) != len(got):
            t.fail(head, _DUPLICATES)
        if g == e:
            t.fail(head, _UNSORTED)
        if roundoff and g > e:
            t.fail(head + f" extra {_pairs_text(sorted(g - e))}.", _NO_TOLERANCE)
        if g == blocked:
            t.fail(head, _EVERY_BLOCKED)
        if not g:
            t.fail(head, _NO_LEAKS)
        if g < e and (e - g) <= denominator:
            t.fail(head + f" missing {_pairs_text(sorted(e - g))}.", _MISSED_DENOMINATOR)
        if g > e:
            t.fail(head + f" extra {_pairs_text(sorted(g - e))}: perturbing x[0, j] leaves output row i of these "
                   "pairs unchanged.", _UNCHANGED_PAIRS)
        t.fail(head + f" missing {_pairs_text(sorted(e - g))}, extra {_pairs_text(sorted(g - e))}.",
               recipe="perturb each position j in turn from a random float64 base input, and report (i, j) when "
               "output row i moves by more than a small tolerance and allowed[i, j] is False.")
