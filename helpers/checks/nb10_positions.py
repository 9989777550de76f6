"""Checks for notebook 10_positions (its exercises: helpers/registry.py).

Every case, its expected output and the outputs of the recognised mistakes are computed before
the learner's function runs. RoPE is checked with bases other than 10000 and positions that do
not start at 0 (a KV cache continues at position T_past; packed sequences restart at 0), so that
ignoring ``base`` or ``positions`` shows, and with a float16 x last (cos and sin kept in float32
would return float32). ALiBi is checked for powers of two H only, where the
contract's ``2^(-8(h+1)/H)`` and the paper's recipe agree. Llama 3's scaling is checked on
frequency tables whose three bands (kept, smoothed, divided) are all populated, with factors and
thresholds other than Llama 3's, and one table in shuffled order; Llama 3.1's own comes last, since
its smallest frequencies (~1e-6) are too small for a mistake to be told apart by value.
"""

from __future__ import annotations

import math

import torch

from .. import nb10_positions as ref
from ..registry import in_module
from .core import Trial, describe_case, draw, eager_mistakes, exercise, seeded
from .feedback import Mistake, wrong_signature
from .guard import _isclose, _isfinite

__all__ = in_module(__name__)  # its exercises' checks, as helpers/registry.py lists them


# =========================================================================== 10.1 rope


def _rope_model(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, layout: str = "half",
                sign: float = 1.0, swap: bool = False) -> torch.Tensor:
    """A learner's RoPE in float64 with given frequencies ``[d/2]``: ``layout`` "half" (the
    contract), "interleaved" (pairs 2i, 2i+1) or "repeat_interleave" (rotate-half pairs with
    cos/sin laid out for neighbours)."""
    x64 = x.double()
    angles = sign * positions.double()[:, None] * freqs.double()[None, :]  # [T, d/2]
    if layout == "interleaved":
        cos, sin = angles.cos(), angles.sin()
        even, odd = x64[..., 0::2], x64[..., 1::2]
        out = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
    else:
        full = angles.repeat_interleave(2, dim=-1) if layout == "repeat_interleave" else angles.repeat(1, 2)
        cos, sin = (full.sin(), full.cos()) if swap else (full.cos(), full.sin())
        out = x64 * cos + ref.rotate_half(x64) * sin
    return out.to(x.dtype)


def _rope_mistakes(x: torch.Tensor, positions: torch.Tensor, base: float) -> dict[str, torch.Tensor]:
    d, T = x.shape[-1], x.shape[-2]
    i = torch.arange(d // 2, dtype=torch.float64)
    freqs = base ** (-2 * i / d)
    m = lambda **kw: lambda: _rope_model(x, **{"positions": positions, "freqs": freqs, **kw})  # noqa: E731
    shifted = "your positions are shifted by one"
    return eager_mistakes({
        Mistake("interleaved-pairs", "you rotated neighbouring pairs (x[2i], x[2i+1]): that is the "
                "interleaved convention of the RoFormer paper. The course (and Hugging Face's "
                "apply_rotary_pos_emb) pairs x[i] with x[i + d/2]: rotate_half(x) = cat(-x2, x1) "
                "for the two halves x1, x2."):
            m(layout="interleaved"),
        Mistake("angles-repeat_interleave", "your cos and sin are laid out for neighbouring pairs "
                "(repeat_interleave: theta_0, theta_0, theta_1, ...) but rotate_half pairs x[i] "
                "with x[i + d/2]: lay the d/2 angles out twice, cat((angles, angles), -1) (or "
                ".repeat(1, 2)), so that feature i and feature i + d/2 turn by the same angle.",
                "cos and sin laid out for neighbouring pairs (repeat_interleave) with rotate_half"):
            m(layout="repeat_interleave"),
        Mistake("exponent-i-over-d", "your frequencies use the exponent i/d; RoPE's is 2i/d: "
                "theta_i = base^(-2i/d) for i = 0 .. d/2 - 1 (torch.arange(0, d, 2) / d)."):
            m(freqs=base ** (-i / d)),
        Mistake("frequencies-start-at-1", "your frequencies start at i = 1: theta_i = base^(-2i/d) "
                "for i = 0 .. d/2 - 1, so the first pair turns by one radian per position."):
            m(freqs=base ** (-2 * (i + 1) / d)),
        Mistake("ignored-base", "you ignored `base` (your result is RoPE with base 10000): use the "
                "base you are given, theta_i = base^(-2i/d)."):
            m(freqs=10000.0 ** (-2 * i / d)),
        Mistake("ignored-positions", "you ignored `positions` and rotated row t by t (0, 1, 2, "
                "...): rotate row t by positions[t]. In a KV cache the new token sits at position "
                "T_past, not 0."):
            m(positions=torch.arange(T)),
        Mistake("rotated-by-minus-m", "you rotated by -m instead of +m (the sine has the wrong "
                "sign, or rotate_half is cat(x2, -x1)): the pair (a, b) at angle φ becomes (a cos "
                "φ - b sin φ, a sin φ + b cos φ).", "rotated by -m instead of +m"):
            m(sign=-1.0),
        Mistake("positions-off-by-one", "your positions are shifted by one (row t rotated by "
                "positions[t] + 1, as if counting from 1): rotate row t by exactly positions[t].",
                shifted):
            m(positions=positions + 1),
        Mistake("positions-off-by-one", "your positions are shifted by one (row t rotated by "
                "positions[t] - 1): rotate row t by exactly positions[t].", shifted):
            m(positions=positions - 1),
        Mistake("swapped-cos-sin", "you swapped cos and sin: x * cos + rotate_half(x) * sin, with "
                "cos and sin of the same angles."):
            m(swap=True),
    })


_ROPE_RECIPE = ("d = x.shape[-1]; theta = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d); "
                "angles = positions[:, None] * theta[None, :] ([T, d/2]); angles = torch.cat((angles, angles), -1); "
                "x1, x2 = x.chunk(2, -1); return x * angles.cos().to(x.dtype) + "
                "torch.cat((-x2, x1), -1) * angles.sin().to(x.dtype).")


def _rope_inputs() -> list[tuple[torch.Tensor, torch.Tensor, float]]:
    """(x, positions, base). No two of B, H, T, d equal; bases other than 10000; positions that do not
    start at 0 (a KV cache's continuation; packed sequences that restart)."""
    cases = []
    g = seeded(1000)
    cases.append((torch.randn(2, 3, 5, 8, generator=g), torch.arange(7, 12), 500.0))
    cases.append((torch.randn(6, 12, generator=g), torch.tensor([0, 1, 2, 0, 1, 2]), 10000.0))
    cases.append((torch.randn(2, 7, 4, generator=g, dtype=torch.float64), torch.arange(3, 10), 100.0))
    cases.append((torch.randn(1, 4, 9, 16, generator=g), torch.arange(30, 39), 10000.0))
    # float16 x (as a model runs): cos/sin tables kept in float32 promote the result to float32.
    # Small positions, so that angles computed in float16 too stay within the tolerance.
    cases.append((torch.randn(3, 5, 6, generator=g).half(), torch.tensor([4, 5, 6, 0, 1]), 50.0))
    return cases


@exercise()
def rope(t: Trial) -> None:
    t.error_hints = {
        r"must match the size of tensor b|size of tensor a .* must match": Mistake(
            "angles-shape-mismatch", "positions is [T]: positions[:, None] * theta[None, :] gives "
            "the [T, d/2] angles, which broadcast over x's leading dimensions once laid out to [T, "
            "d].", "the angles do not broadcast against x (not laid out as [T, d])"),
        r"chunk expects|split_size": Mistake(
            "wrong-halves-split", "x's last dimension is d (even): x.chunk(2, dim=-1) gives the "
            "two halves.", "split x into its two halves along the wrong axis or size"),
    }
    planned = [((x, pos, base), ref.rope(x, pos, base), _rope_mistakes(x, pos, base)) for x, pos, base in _rope_inputs()]
    for (x, pos, base), expected, mistakes in planned:
        got = t.call(x, pos, base, case=describe_case(x=x, positions=pos.tolist(), base=base))
        # float32 angles (as in Hugging Face's code) are right too: they are off by ~1e-7 * position.
        # float16: a result rounded once (computed in float32 or float64) or after every step differs by a few ulps.
        tol, rtol = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-2, 1e-2)}.get(x.dtype, (1e-5, 1e-4))
        t.tensor(got, expected, what="rotated x", mistakes=mistakes, hint=_ROPE_RECIPE, atol=tol, rtol=rtol)


# =========================================================================== 10.2 alibi_bias


def _alibi_model(slopes: torch.Tensor, T: int, distance: str = "abs") -> torch.Tensor:
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    dist = {"abs": -(i - j).abs(), "signed": -(i - j), "key": j + 0 * i, "neg_abs": (i - j).abs(),
            "lower_only": -(i - j).clamp(min=0), "signed_j_minus_i": i - j}[distance]
    return (slopes.double()[:, None, None] * dist.double()).float()


def _alibi_mistakes(H: int, T: int) -> dict[str, torch.Tensor]:
    h = torch.arange(H, dtype=torch.float64)
    right = 2.0 ** (-8 * (h + 1) / H)
    m = lambda slopes, distance="abs": lambda: _alibi_model(slopes, T, distance)  # noqa: E731
    return eager_mistakes({
        Mistake("slopes-off-by-one", "your slopes are off by one head: slope_h = 2^(-8(h+1)/H) for "
                "h = 0 .. H-1, from 2^(-8/H) for the first head down to exactly 2^-8 for the last "
                "(a slope of 1 means h started at 0 in the exponent)."):
            m(2.0 ** (-8 * h / H)),
        Mistake("slopes-off-by-one", "your slopes are off by one head: slope_h = 2^(-8(h+1)/H) for "
                "h = 0 .. H-1, so the last head's slope is exactly 2^-8 (yours goes one step "
                "further)."):
            m(2.0 ** (-8 * (h + 2) / H)),
        Mistake("slopes-reversed", "your slopes are in reverse order: head 0 has the steepest "
                "slope, 2^(-8/H), and head H-1 the gentlest, 2^-8."):
            m(right.flip(0)),
        Mistake("slopes-for-H-8-only", "you used 2^-(h+1), the slopes for H = 8 only; the exponent "
                "scales with H: 2^(-8(h+1)/H)."):
            m(2.0 ** -(h + 1)),
        Mistake("slopes-base-e", "your slopes use base e (exp(-8(h+1)/H)); ALiBi's are powers of "
                "two: 2^(-8(h+1)/H)."):
            m(torch.exp(-8 * (h + 1) / H)),
        Mistake("bias-zero-above-diagonal", "your bias is 0 above the diagonal (keys j > i): the "
                "contract's bias is -slope·|i - j| on both sides (the causal mask, applied "
                "separately, hides the future; the bias does not)."):
            m(right, "lower_only"),
        Mistake("distance-without-abs", "the distance needs abs: your bias is -slope·(i - j), "
                "which agrees below the diagonal but is positive above it (it would reward future "
                "keys wherever the mask is not applied). Use -slope·|i - j|.",
                "the bias uses the signed distance -slope·(i - j), without abs"):
            m(right, "signed"),
        Mistake("distance-without-abs", "the distance needs abs: your bias is -slope·(j - i), which "
                "agrees above the diagonal but is positive below it, so it rewards the keys furthest in "
                "the past. Use -slope·|i - j|.",
                "the bias uses the signed distance -slope·(j - i), without abs"):
            m(right, "signed_j_minus_i"),
        Mistake("bias-wrong-sign", "your bias has the wrong sign: it must penalise distance, "
                "-slope·|i - j| (<= 0), not +slope·|i - j|."):
            m(right, "neg_abs"),
        Mistake("bias-slope-times-j", "you wrote the bias as slope·j (the form BLOOM uses). Under "
                "a causal softmax it gives the same weights, because it differs from -slope·(i - "
                "j) by slope·i, a constant per row; but the bias itself, as the contract asks, is "
                "-slope·|i - j|."):
            m(right, "key"),
    })


_ALIBI_RECIPE = ("slopes = 2.0 ** (-8 * torch.arange(1, H + 1) / H) ([H]); i = torch.arange(T); "
                 "distance = (i[:, None] - i[None, :]).abs() ([T, T]); return -slopes[:, None, None] * distance.")


@exercise()
def alibi_bias(t: Trial) -> None:
    t.error_hints = {
        r"unsupported operand|not supported between|must be Number": Mistake(
            "ints-not-tensors", "n_heads and T are Python ints; build the slopes and distances as "
            "tensors (torch.arange) before combining them.",
            "combined Python ints where tensors are needed"),
    }
    cases = [(8, 5), (4, 9), (2, 3), (16, 6), (1, 4)]  # H a power of two; H != T
    g = seeded(1050)  # then one drawn from a seed: H 1 to 16, T 2 to 32 (one more if it equals H)
    H, T = 2 ** draw(g, 0, 5), draw(g, 2, 33)
    cases.append((H, T + (T == H)))
    planned = [((H, T), ref.alibi_bias(H, T), _alibi_mistakes(H, T)) for H, T in cases]
    for (H, T), expected, mistakes in planned:
        got = t.call(H, T, case=describe_case(n_heads=H, T=T))
        diagnosis = ""
        if (isinstance(got, torch.Tensor) and got.shape == expected.shape and H > 1 and got.is_floating_point()
                and bool((got == got[:1]).all()) and T > 1):
            diagnosis = Mistake("same-slope-every-head", "every head has the same bias: one slope "
                                "for all heads. Each head h has its own slope, 2^(-8(h+1)/H), so "
                                "that some heads look far and others near.")
        t.tensor(got, expected, what="bias", mistakes=mistakes, hint=_ALIBI_RECIPE, diagnosis=diagnosis, atol=1e-6)


# =========================================================================== 10.3 llama3_rope_frequencies


_REORDERED = "returned the right scaled frequencies in another order than inv_freq's"
_SWAPPED_BANDS = Mistake(
    "kept-and-divided-swapped",
    "you divided the fast pairs (wavelength shorter than original_max_len / high_freq_factor) by factor and kept "
    "the slow ones (longer than original_max_len / low_freq_factor) as they are: it is the other way round. A fast "
    "pair turns many times within the original context and stays as it is; a slow pair is divided by factor.",
    "divided the fast pairs and kept the slow ones (the two outer bands swapped)")


def _bands(w: torch.Tensor, short: float, long: float, below, above, between) -> torch.Tensor:
    """``below`` where the wavelength w < short, ``above`` where w > long, ``between`` elsewhere."""
    return torch.where(w < short, below, torch.where(w > long, above, between))


def _llama3_mistakes(inv_freq: torch.Tensor, factor: float, lf: float, hf: float, L: int) -> dict[str, torch.Tensor]:
    th = inv_freq.double()
    w = 2 * math.pi / th
    smooth = (L / w - lf) / (hf - lf)
    mix = (1 - smooth) * th / factor + smooth * th
    out = lambda v: lambda: v.to(inv_freq.dtype)  # noqa: E731

    def right(th_, factor_, lf_, hf_, L_, w_=None):
        w_ = 2 * math.pi / th_ if w_ is None else w_
        s_ = (L_ / w_ - lf_) / (hf_ - lf_)
        return _bands(w_, L_ / hf_, L_ / lf_, th_, th_ / factor_, (1 - s_) * th_ / factor_ + s_ * th_)

    n = th.shape[0]
    i = torch.arange(n, dtype=torch.float64)

    def blend(sm: torch.Tensor) -> torch.Tensor:  # the right bands, another smooth in the middle
        return _bands(w, L / hf, L / lf, th, th / factor, (1 - sm) * th / factor + sm * th)

    n_keep, n_slow = int((w < L / hf).sum()), int((w > L / lf).sum())
    by_position = right(th, factor, lf, hf, L).clone()  # the right value, but the first n_keep kept, the last n_slow divided
    by_position[:n_keep], by_position[n - n_slow:] = th[:n_keep], th[n - n_slow:] / factor
    blended_by_position = torch.cat([th[:n_keep], mix[n_keep:n - n_slow], th[n - n_slow:] / factor])
    scaled = right(th, factor, lf, hf, L)
    return eager_mistakes({
        Mistake("output-reordered", "your output holds the right values sorted from the highest "
                "frequency to the lowest, not in inv_freq's order: pair k of the result is pair k of "
                "inv_freq, scaled. Decide each pair in place with torch.where (or put sorted results "
                "back where their pairs were).", _REORDERED):
            out(scaled[th.argsort(descending=True)]),
        Mistake("output-reordered", "your output holds the right values sorted from the lowest "
                "frequency to the highest, not in inv_freq's order: pair k of the result is pair k of "
                "inv_freq, scaled. Decide each pair in place with torch.where (or put sorted results "
                "back where their pairs were).", _REORDERED):
            out(scaled[th.argsort()]),
        _SWAPPED_BANDS: out(_bands(w, L / hf, L / lf, th / factor, th, mix)),
        Mistake("nothing-scaled", "nothing was scaled: your result is inv_freq unchanged. Did you "
                "compare the frequencies themselves with the thresholds? original_max_len / "
                "low_freq_factor and original_max_len / high_freq_factor are wavelengths, in "
                "tokens: compare wavelen = 2π / inv_freq with them."):
            out(th),
        Mistake("divided-all-by-factor", "you divided every frequency by factor: that is position "
                "interpolation (Chen et al.), not Llama 3's scaling. Pairs with a wavelength "
                "shorter than original_max_len / high_freq_factor stay as they are."):
            out(th / factor),
        Mistake("multiplied-by-factor", "you multiplied by factor: a longer context needs slower "
                "low frequencies, inv_freq / factor (their wavelengths grow factor times)."):
            out(_bands(w, L / hf, L / lf, th, th * factor,
                       (1 - smooth) * th * factor + smooth * th)),
        Mistake("smooth-reversed", "your smooth interpolation is reversed: smooth = "
                "(original_max_len / wavelen - low_freq_factor) / (high_freq_factor - "
                "low_freq_factor) is 0 at the long-wavelength end, where the result must be "
                "inv_freq / factor, and 1 at the short end (inv_freq): (1 - smooth) * inv_freq / "
                "factor + smooth * inv_freq."):
            out(_bands(w, L / hf, L / lf, th, th / factor,
                       smooth * th / factor + (1 - smooth) * th)),
        Mistake("scaled-high-frequencies", "you scaled the high frequencies too: pairs whose "
                "wavelength is shorter than original_max_len / high_freq_factor turn many times "
                "within the original context and stay as they are."):
            out(_bands(w, L / hf, L / lf, th / factor, th / factor, mix)),
        Mistake("divided-high-kept-low", "you divided the high frequencies (short wavelengths) and "
                "kept the low ones: a long wavelength is a low frequency. If you turned the "
                "thresholds into frequencies (2π · low_freq_factor / original_max_len), flip the "
                "comparisons too."):
            out(torch.where(w < L / lf, th / factor, th)),
        Mistake("middle-band-kept", "the wavelengths between the two thresholds were left as they "
                "are, not interpolated: between original_max_len / high_freq_factor and "
                "original_max_len / low_freq_factor the result is (1 - smooth) * inv_freq / factor "
                "+ smooth * inv_freq. (Swapped thresholds, or if/elif tests in the wrong order, do "
                "this too: wavelengths longer than original_max_len / low_freq_factor, the longer "
                "threshold, are divided.)"):
            out(_bands(w, L / hf, L / lf, th, th / factor, th)),
        Mistake("middle-band-divided", "the wavelengths between the two thresholds were divided by "
                "factor, not interpolated: between original_max_len / high_freq_factor and "
                "original_max_len / low_freq_factor the result is (1 - smooth) * inv_freq / factor "
                "+ smooth * inv_freq. (Swapped thresholds do this too: wavelengths shorter than "
                "original_max_len / high_freq_factor, the shorter threshold, stay as they are.)"):
            out(_bands(w, L / hf, L / lf, th, th / factor, th / factor)),
        Mistake("wavelength-missing-2pi", "your wavelengths miss 2π: a pair turns once in wavelen "
                "= 2π / inv_freq positions, not 1 / inv_freq."):
            out(right(th, factor, lf, hf, L, w_=1 / th)),
        Mistake("returned-wavelengths", "you returned wavelengths: return the scaled inverse "
                "frequencies (radians per position), as given."):
            out(2 * math.pi / right(th, factor, lf, hf, L)),
        Mistake("used-Llama-3.1-values", "you used Llama 3.1's values (factor 8, low_freq_factor "
                "1, high_freq_factor 4, original_max_len 8192) instead of the arguments.",
                "used Llama 3.1's constants instead of the arguments"):
            out(right(th, 8.0, 1.0, 4.0, 8192)),
        Mistake("thresholds-times-original_max_len", "your thresholds are original_max_len * "
                "low_freq_factor and original_max_len * high_freq_factor: the thresholds are "
                "wavelengths in tokens, original_max_len / high_freq_factor (shorter: kept as they "
                "are) and original_max_len / low_freq_factor (longer: divided by factor).",
                "computed the thresholds as original_max_len times the factors"):
            out(_bands(w, L * lf, L * hf, th, th / factor, mix)),
        Mistake("smooth-from-wavelen-over-original_max_len", "your smooth uses wavelen / "
                "original_max_len, upside down: smooth = (original_max_len / wavelen - "
                "low_freq_factor) / (high_freq_factor - low_freq_factor), the turns a pair makes "
                "within the original context, less low_freq_factor."):
            out(blend((w / L - lf) / (hf - lf))),
        Mistake("smooth-without-low_freq_factor", "your smooth does not subtract low_freq_factor: "
                "smooth = (original_max_len / wavelen - low_freq_factor) / (high_freq_factor - "
                "low_freq_factor), which is 0 at the longer threshold and 1 at the shorter."):
            out(blend((L / w) / (hf - lf))),
        Mistake("smooth-divided-by-factor", "your smooth is divided by factor: smooth = "
                "(original_max_len / wavelen - low_freq_factor) / (high_freq_factor - "
                "low_freq_factor), with no factor in it; factor appears only in inv_freq / factor."):
            out(blend(smooth / factor)),
        Mistake("smooth-by-pair-index", "your smooth follows the pair's index i, not its "
                "wavelength: smooth = (original_max_len / wavelen - low_freq_factor) / "
                "(high_freq_factor - low_freq_factor) for each pair, from its own wavelen = 2π / "
                "inv_freq (inv_freq need not be sorted).",
                "ramped smooth by the pair index instead of the wavelength"):
            out(blend(1 - i / max(1, n - 1))),
        Mistake("smooth-by-pair-index", "your smooth follows the pair's index i, not its "
                "wavelength (it grows with i): smooth = (original_max_len / wavelen - "
                "low_freq_factor) / (high_freq_factor - low_freq_factor) for each pair, from its own "
                "wavelen = 2π / inv_freq.", "ramped smooth by the pair index instead of the wavelength"):
            out(blend(i / max(1, n - 1))),
        Mistake("assumed-sorted", "you chose the pairs by their place in inv_freq (the first ones "
                "kept, the last ones divided), as if it were sorted from fast to slow: decide each "
                "pair by its own wavelength, wavelen = 2π / inv_freq, with torch.where (this "
                "inv_freq is not sorted).", "assumed inv_freq sorted and chose the pairs by position"):
            out(by_position),
        Mistake("assumed-sorted", "you chose the pairs by their place in inv_freq (the first ones "
                "kept, the last ones divided, the ones between blended), as if it were sorted from fast "
                "to slow: decide each pair by its own wavelength, wavelen = 2π / inv_freq, with "
                "torch.where (this inv_freq is not sorted).",
                "assumed inv_freq sorted and chose the pairs by position"):
            out(blended_by_position),
    })


def _llama3_bands(got, inv_freq: torch.Tensor, factor: float, lf: float, hf: float, L: int) -> str:
    """Which band of pairs is wrong and what the output holds there, as a fact (when no mistake is
    named): the fast pairs (wavelen < original_max_len / high_freq_factor) stay as they are, the slow
    ones (wavelen > original_max_len / low_freq_factor) are divided by factor, the middle ones blend."""
    if not (type(got) is torch.Tensor and got.shape == inv_freq.shape and got.is_floating_point()
            and bool(_isfinite(got).all())):
        return ""
    th, g = inv_freq.double(), got.double()
    w = 2 * math.pi / th
    short, long = L / hf, L / lf
    expected = ref.llama3_rope_frequencies(inv_freq, factor, lf, hf, L).double()
    wrong = ~_isclose(g, expected, rtol=1e-5, atol=1e-12)
    kept = _isclose(g, th, rtol=1e-5, atol=1e-12)
    divided = _isclose(g, th / factor, rtol=1e-5, atol=1e-12)
    fast, slow = w < short, w > long
    middle = ~fast & ~slow

    def pairs(mask: torch.Tensor) -> str:
        idx = mask.nonzero().flatten().tolist()
        shown = ", ".join(f"{k} ({_fmt_w(float(w[k]))})" for k in idx[:4])
        return shown + (f" and {len(idx) - 4} more" if len(idx) > 4 else "")

    if (bool(wrong.any()) and bool(_isclose(g.sort().values, expected.sort().values, rtol=1e-5,
                                                  atol=1e-12).all())):
        return Mistake("output-reordered", "your output holds the right values in another order than "
                       "inv_freq's: pair k of the result is pair k of inv_freq, scaled. Keep each pair in its "
                       "place (torch.where decides pair by pair; a sort must be undone).", _REORDERED)
    only_divided = divided & ~kept
    only_kept = kept & ~divided
    if (bool(only_kept.any()) and bool(only_divided.any()) and bool((w[only_kept] > long).all())
            and bool((w[only_divided] < short).all())):
        return _SWAPPED_BANDS
    if bool(kept.any()) and bool(only_divided.any()) and float(w[kept].max()) > float(w[only_divided].min()):
        # a pair kept as it is turns more slowly than a pair divided by factor: not chosen by wavelength
        return Mistake("bands-not-by-wavelength", "some pairs you kept as they are turn more slowly than "
                       f"pairs you divided by factor (kept: pair {pairs(kept & (w > float(w[only_divided].min())))}; "
                       f"divided: pair {pairs(only_divided & (w < float(w[kept].max())))}; wavelengths in "
                       "tokens): decide each pair by its own wavelength, wavelen = 2π / inv_freq (inv_freq "
                       "need not be sorted).", "kept and divided pairs that are not ordered by wavelength")
    band_text = f"original_max_len / high_freq_factor = {_fmt_w(short)} and original_max_len / low_freq_factor = {_fmt_w(long)} tokens"
    def how(mask: torch.Tensor) -> str:  # what the output did to these pairs, in words
        if bool(kept[mask].all()):
            return "kept as they are"
        if bool(divided[mask].all()):
            return "divided by factor"
        by = th[mask] / g[mask]
        if bool(_isclose(by, by[:1], rtol=1e-5).all()):
            return f"divided by {_fmt_w(float(by[0]))}" if float(by[0]) > 1 else f"multiplied by {_fmt_w(1 / float(by[0]))}"
        sm = (L / w - lf) / (hf - lf)
        if bool(_isclose(g[mask], ((1 - sm) * th / factor + sm * th)[mask], rtol=1e-5, atol=1e-12).all()):
            return "blended as if they lay between the thresholds (with smooth outside 0 .. 1 there)"
        return "changed"

    if bool((wrong & fast).any()):
        did = how(wrong & fast)
        return Mistake("fast-pairs-changed", f"pairs whose wavelength is shorter than original_max_len / "
                       f"high_freq_factor = {_fmt_w(short)} tokens stay as they are; pair "
                       f"{pairs(wrong & fast)} (wavelengths in tokens) you {did}. Check that threshold, "
                       "its comparison and the order of your tests (wavelen = 2π / inv_freq, in tokens).",
                       "changed pairs shorter than the short threshold, which stay as they are")
    if bool((wrong & slow).any()):
        did = how(wrong & slow)
        return Mistake("slow-pairs-not-divided", f"pairs whose wavelength is longer than original_max_len / "
                       f"low_freq_factor = {_fmt_w(long)} tokens are divided by factor; pair "
                       f"{pairs(wrong & slow)} (wavelengths in tokens) you {did}" +
                       (f", not by factor = {factor:g}." if did.startswith(("divided by ", "multiplied")) else
                        ". Check the thresholds, their comparisons and the order of your tests (a pair is kept "
                        "only when wavelen < original_max_len / high_freq_factor; wavelen = 2π / inv_freq, in "
                        "tokens)."),
                       "did not divide the pairs longer than the long threshold by factor")
    if bool((wrong & middle).any()):
        sm_got = (g / th - 1 / factor) / (1 - 1 / factor)
        sm_right = (L / w - lf) / (hf - lf)
        idx = (wrong & middle).nonzero().flatten().tolist()[:4]
        return Mistake("middle-smooth-wrong", f"only pairs between the two thresholds ({band_text}) differ: "
                       "written as (1 - smooth) * inv_freq / factor + smooth * inv_freq, your smooth is "
                       f"{', '.join(_fmt_w(float(sm_got[k])) for k in idx)} at pair {', '.join(str(k) for k in idx)}, "
                       "where smooth = (original_max_len / wavelen - low_freq_factor) / (high_freq_factor - "
                       f"low_freq_factor) gives {', '.join(_fmt_w(float(sm_right[k])) for k in idx)}.",
                       "the blend of the middle band is wrong (another smooth)")
    return ""


def _fmt_w(x: float) -> str:
    return f"{x:.4g}"


_LLAMA3_RECIPE = ("wavelen = 2 * math.pi / inv_freq; smooth = (original_max_len / wavelen - low_freq_factor) / "
                  "(high_freq_factor - low_freq_factor); out = torch.where(wavelen > original_max_len / "
                  "low_freq_factor, inv_freq / factor, (1 - smooth) * inv_freq / factor + smooth * inv_freq); "
                  "return torch.where(wavelen < original_max_len / high_freq_factor, inv_freq, out).")


def _llama3_inputs() -> list[tuple[torch.Tensor, float, float, float, int]]:
    """(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len). Every table has pairs in
    all three bands, and wavelengths between t and 2π t of a threshold t (so that a missing 2π shows)."""
    g = seeded(1100)
    cases = [
        (ref.rope_frequencies(32, 1000.0).float(), 4.0, 1.0, 4.0, 256),
        (ref.rope_frequencies(24, 500.0), 16.0, 2.0, 8.0, 512),  # float64; low_freq_factor 2
        (ref.rope_frequencies(40, 2000.0).float()[torch.randperm(20, generator=g)], 6.0, 1.0, 3.0, 1000),
    ]
    d, base = 2 * draw(g, 10, 33), float(draw(g, 300, 3000))  # then one drawn: its bands move with the seed
    lf = float(draw(g, 1, 3))
    cases.append((ref.rope_frequencies(d, base).float(), float(draw(g, 2, 33)), lf, lf + draw(g, 1, 8),
                  draw(g, 200, 2000)))
    cases.append((ref.rope_frequencies(128, 500000.0).float(), 8.0, 1.0, 4.0, 8192))  # Llama 3.1 itself
    return cases


@exercise()
def llama3_rope_frequencies(t: Trial) -> None:
    # plain torch: notebook 10's scaling helpers compute the answer (Llama 3's is YaRN's ramp)
    t.forbidden_references = {"llama3_rope_frequencies", "yarn_frequencies", "yarn_ramp", "rotations",
                              "yarn_index_ramp_frequencies", "position_interpolation_frequencies"}
    t.error_hints = {
        r"takes \d+ positional argument|missing \d+ required positional argument": wrong_signature(
            "llama3_rope_frequencies(inv_freq, factor, low_freq_factor, high_freq_factor, "
            "original_max_len)."),
        r"Boolean value of Tensor with more than one value is ambiguous": Mistake(
            "if-on-tensor", "inv_freq holds d/2 frequencies: an `if` on a comparison of tensors "
            "cannot choose per pair. Use torch.where (or boolean masks), or loop over "
            "inv_freq.tolist() and build the result with torch.tensor(..., dtype=inv_freq.dtype).",
            "an `if` on a comparison of whole tensors"),
        r"only one element tensors can be converted|must be real number, not Tensor": Mistake(
            "math-on-tensor", "math functions take Python numbers; on tensors use torch's (2 * "
            "math.pi / inv_freq is fine: math.pi is a number).",
            "applied a math function to a tensor"),
    }
    planned = [(args, ref.llama3_rope_frequencies(*args), _llama3_mistakes(*args)) for args in _llama3_inputs()]
    for (inv_freq, factor, lf, hf, L), expected, mistakes in planned:
        got = t.call(inv_freq, factor, lf, hf, L, case=describe_case(
            inv_freq=inv_freq, factor=factor, low_freq_factor=lf, high_freq_factor=hf, original_max_len=L))
        t.tensor(got, expected, what="scaled inverse frequencies", mistakes=mistakes, hint=_LLAMA3_RECIPE,
                 atol=1e-12, rtol=1e-5, diagnosis=_llama3_bands(got, inv_freq, factor, lf, hf, L))
