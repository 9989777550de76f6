"""Where order comes from: sinusoidal embeddings, RoPE and ALiBi (notebook 10).

Shapes: T positions, d the width being rotated (a head's d_k), H heads. RoPE follows the
**rotate-half** convention of Hugging Face's ``apply_rotary_pos_emb``: feature ``i`` is paired
with feature ``i + d/2`` and the pair turns by the angle ``m * theta_i``, with
``theta_i = base^(-2i/d)`` for ``i = 0 .. d/2 - 1``. The original paper (RoFormer) pairs
neighbours ``(2i, 2i + 1)`` instead (:func:`rope_interleaved`); the two are the same rotation up
to a fixed permutation of the features (:func:`interleave_permutation`).

Context extension rescales the d/2 inverse frequencies ``inv_freq`` ``[d/2]`` (``theta_i``, radians
per position) of a model trained on ``original_max_len`` tokens so that it reads ``factor`` times
more: position interpolation (:func:`position_interpolation_frequencies`), NTK-aware scaling
(:func:`ntk_aware_base`), YaRN (:func:`yarn_frequencies`, :func:`yarn_attention_factor`) and Llama
3's scaling (:func:`llama3_rope_frequencies`). Each takes and returns inverse frequencies; a pair's
wavelength is ``2 pi / theta_i`` tokens (:func:`rope_wavelengths`).
"""

from __future__ import annotations

import math

import torch

from .nb01_qkv_shapes import merge_heads, qkv_projection, scaled_dot_product_attention
from .nb03_masks import causal_mask, masked_softmax
from .nb07_kv_cache import decode_step

__all__ = ["rope", "alibi_bias", "llama3_rope_frequencies"]


def _check_even(d: int) -> None:
    if d % 2:
        raise ValueError(f"RoPE rotates pairs of features: the last dimension must be even, got {d}")


def rope_frequencies(d: int, base: float = 10000.0) -> torch.Tensor:
    """``[d/2]`` float64: ``theta_i = base^(-2i/d)`` for ``i = 0 .. d/2 - 1`` (radians per position)."""
    _check_even(d)
    return base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)


def rope_angles(positions: torch.Tensor, d: int, base: float = 10000.0) -> torch.Tensor:
    """positions ``[T]`` -> ``[T, d/2]`` float64 angles ``m * theta_i`` (float64: exact enough
    for positions in the hundreds of thousands)."""
    return positions.to(torch.float64)[:, None] * rope_frequencies(d, base)[None, :]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[..., d]`` -> ``[..., d]``: ``(x1, x2) -> (-x2, x1)`` with ``x1, x2`` the two halves."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_cos_sin(positions: torch.Tensor, d: int, base: float = 10000.0, dtype: torch.dtype = torch.float32
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """positions ``[T]`` -> ``(cos, sin)``, each ``[T, d]`` in ``dtype``: the angle ``m * theta_i``
    laid out at feature i and at feature i + d/2 (what Hugging Face's ``rotary_emb`` returns)."""
    angles = rope_angles(positions, d, base).repeat(1, 2)  # [T, d]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[..., T, d]`` with tables ``[T, d]`` from :func:`rope_cos_sin` -> ``x cos + rotate_half(x) sin``
    (Hugging Face's ``apply_rotary_pos_emb``, for one tensor)."""
    return x * cos + rotate_half(x) * sin


def rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding, rotate-half convention (exercise 10.1).

    x ``[..., T, d]`` (d even), positions ``[T]`` (any integers, e.g. ``arange(p, p + T)`` in a
    KV cache) -> ``[..., T, d]`` in x's dtype: the pair ``(x[i], x[i + d/2])`` of the row at
    position ``m`` is rotated by ``m * base^(-2i/d)``. Then ``rope(q, m) . rope(k, n)`` depends
    on ``n - m`` only."""
    T, d = x.shape[-2:]
    if positions.shape != (T,):
        raise ValueError(f"positions must have shape [T] = [{T}], got {list(positions.shape)}")
    return apply_rope(x, *rope_cos_sin(positions.to(x.device), d, base, x.dtype))


def rope_interleaved(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """RoPE as the RoFormer paper writes it: the pair ``(x[2i], x[2i + 1])`` is rotated by
    ``m * theta_i``. x ``[..., T, d]``, positions ``[T]`` -> ``[..., T, d]``. Equals
    :func:`rope` up to :func:`interleave_permutation` of the features."""
    T, d = x.shape[-2:]
    angles = rope_angles(positions.to(x.device), d, base)  # [T, d/2]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


def interleave_permutation(d: int) -> torch.Tensor:
    """``[d]`` long: ``perm[2i] = i``, ``perm[2i + 1] = i + d/2``. ``x[..., perm]`` moves the
    rotate-half pair ``(i, i + d/2)`` to the neighbours ``(2i, 2i + 1)``, so that
    ``rope_interleaved(x[..., perm], m) == rope(x, m)[..., perm]``. Permuting the columns of each
    head of W_Q and W_K this way converts a checkpoint between the two conventions."""
    _check_even(d)
    half = torch.arange(d // 2)
    return torch.stack((half, half + d // 2), dim=-1).flatten()


def sinusoidal_embeddings(T: int, d: int, base: float = 10000.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[T, d]`` in ``dtype``, the absolute encodings of "Attention is all you need":
    ``PE[m, 2i] = sin(m * theta_i)``, ``PE[m, 2i + 1] = cos(m * theta_i)``, added once to the
    token embeddings at the bottom of the model."""
    angles = rope_angles(torch.arange(T), d, base)
    return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2).to(dtype)


def rope_score_bound(distances: torch.Tensor, d: int, base: float = 10000.0) -> torch.Tensor:
    """The long-range decay of RoPE (RoFormer, section 3.4.3): for relative distance ``r``,
    ``(2/d) * sum_{j=1..d/2} |S_j|`` with ``S_j = sum_{i<j} exp(1j * r * theta_i)``. It bounds the
    score ``|q . R(r) k|`` (up to the factor ``max_i |h_i - h_{i+1}|`` of the query and key
    entries). It is not monotone in ``r``: it oscillates, and its mean over a range of distances
    falls until it levels off. distances ``[N]`` -> ``[N]`` float64."""
    angles = distances.to(torch.float64)[:, None] * rope_frequencies(d, base)[None, :]  # [N, d/2]
    partial = torch.polar(torch.ones_like(angles), angles).cumsum(dim=-1)  # S_1 .. S_{d/2}
    return partial.abs().mean(dim=-1)


def rope_attention(x: torch.Tensor, w_qkv: torch.Tensor, w_o: torch.Tensor, n_heads: int,
                   positions: torch.Tensor | None = None, base: float = 10000.0) -> torch.Tensor:
    """Causal multi-head self-attention with RoPE on queries and keys: x ``[B, T, D]``, w_qkv
    ``[D, 3D]``, w_o ``[D, D]`` as in notebook 05 -> ``[B, T, D]``. positions ``[T]`` default
    ``0 .. T-1``."""
    T = x.shape[1]
    positions = torch.arange(T, device=x.device) if positions is None else positions
    q, k, v = qkv_projection(x, w_qkv, n_heads)  # [B, H, T, d_k] each
    q, k = rope(q, positions, base), rope(k, positions, base)
    return merge_heads(scaled_dot_product_attention(q, k, v, causal_mask(T, device=x.device))) @ w_o


def rope_weights(w_qkv: torch.Tensor, n_heads: int, position: int, base: float = 10000.0) -> torch.Tensor:
    """RoPE at one known position is a linear map, so it folds into the projection: returns
    ``w_qkv`` ``[D, 3D]`` with each head's Q and K columns rotated by ``position``, so that
    ``x_t @ result`` gives the rotated q and k of a token at that position (V unchanged)."""
    D = w_qkv.shape[0]
    d_k = D // n_heads
    w_q, w_k, w_v = w_qkv.split(D, dim=-1)
    at = torch.full((D,), position, device=w_qkv.device)

    def turn(w):  # [D, D] -> rotate each row's d_k-wide slice of each head
        heads = w.reshape(D, n_heads, d_k).transpose(0, 1)  # [H, D, d_k]: D plays the role of T
        return rope(heads, at, base).transpose(0, 1).reshape(D, D)

    return torch.cat((turn(w_q), turn(w_k), w_v), dim=-1)


def decode_step_rope(x_t: torch.Tensor, position: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     w_qkv: torch.Tensor, w_o: torch.Tensor, n_heads: int, base: float = 10000.0):
    """Decoding with positions: notebook 07's ``decode_step`` for a token at ``position``.

    x_t ``[B, 1, D]``; caches ``[B, H, T_past, d_k]`` hold keys already rotated at their own
    positions. The new token's q and k are rotated by ``position`` (via :func:`rope_weights`),
    its k joins the cache rotated once and never again. Returns ``(y_t, k_cache, v_cache)``."""
    if x_t.shape[1] != 1:
        raise ValueError(f"decode_step_rope takes one new token per call (x_t [B, 1, D]), got {list(x_t.shape)}")
    return decode_step(x_t, k_cache, v_cache, rope_weights(w_qkv, n_heads, position, base), w_o, n_heads)


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """``[H]`` float32: ``slope_h = 2^(-8(h+1)/H)``, a geometric sequence from ``2^(-8/H)`` down to
    ``2^-8`` (ALiBi, for H a power of two; the paper interpolates for other H)."""
    return 2.0 ** (-8.0 * torch.arange(1, n_heads + 1, dtype=torch.float64) / n_heads).float()


def alibi_bias(n_heads: int, T: int) -> torch.Tensor:
    """``[H, T, T]`` float32 additive bias ``-slope_h * |i - j|`` for query i, key j (exercise
    10.2). Added to the scores before the (causal) softmax; no position embeddings are used."""
    pos = torch.arange(T)
    distance = (pos[:, None] - pos[None, :]).abs().float()  # [T, T]
    return 0.0 - alibi_slopes(n_heads)[:, None, None] * distance  # 0.0 - ...: +0 on the diagonal, not -0


def alibi_attention_weights(scores: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Causal attention weights with ALiBi: scores ``[..., H, T, T]`` (already scaled) ->
    ``softmax(scores + bias)`` under the causal mask."""
    T = scores.shape[-1]
    return masked_softmax(scores + alibi_bias(n_heads, T).to(scores), causal_mask(T, device=scores.device))


# --------------------------------------------------------------------------- context extension


def rope_wavelengths(inv_freq: torch.Tensor) -> torch.Tensor:
    """inv_freq ``[d/2]`` (radians per position) -> ``[d/2]``: ``2 pi / theta_i``, the number of
    positions in which pair i turns once."""
    return 2 * math.pi / inv_freq


def rotations(inv_freq: torch.Tensor, original_max_len: int) -> torch.Tensor:
    """inv_freq ``[d/2]`` -> ``[d/2]``: ``r_i = original_max_len / wavelength_i``, the number of
    turns pair i makes over the original context (YaRN's r)."""
    return original_max_len / rope_wavelengths(inv_freq)


def _check_scaling(inv_freq: torch.Tensor, factor: float) -> None:
    if not isinstance(inv_freq, torch.Tensor):
        raise ValueError(f"inv_freq must be a 1-D float tensor [d/2], got a {type(inv_freq).__name__}")
    if inv_freq.dim() != 1 or not inv_freq.is_floating_point():
        raise ValueError(f"inv_freq must be a 1-D float tensor [d/2], got {inv_freq.dtype} {list(inv_freq.shape)}")
    if not factor >= 1:
        raise ValueError(f"factor must be >= 1 (the context grows factor times), got {factor}")


def position_interpolation_frequencies(inv_freq: torch.Tensor, factor: float) -> torch.Tensor:
    """Position interpolation (Chen et al. 2023): position m is read as m / factor, which is the
    same as dividing every inverse frequency by ``factor``. inv_freq ``[d/2]`` -> ``[d/2]``."""
    _check_scaling(inv_freq, factor)
    return inv_freq / factor


def ntk_aware_base(base: float, factor: float, d: int) -> float:
    """NTK-aware scaling: the RoPE base multiplied by ``factor^(d / (d - 2))``. Pair 0 keeps its
    frequency (``theta_0 = 1`` for any base) and the last pair's, ``base^(-(d-2)/d)``, is divided
    by exactly ``factor``; pair i's by ``factor^(2i / (d - 2))`` in between. Hugging Face's
    "dynamic" NTK applies this with the factor grown to the current length."""
    _check_even(d)
    if d < 4 or not factor >= 1:
        raise ValueError(f"need d >= 4 and factor >= 1, got d = {d}, factor = {factor}")
    return base * factor ** (d / (d - 2))


def llama3_rope_frequencies(inv_freq: torch.Tensor, factor: float, low_freq_factor: float,
                            high_freq_factor: float, original_max_len: int) -> torch.Tensor:
    """Llama 3's RoPE scaling (exercise 10.3), Meta's ``apply_scaling`` and Hugging Face's
    ``_compute_llama3_parameters``.

    inv_freq ``[d/2]`` -> ``[d/2]`` in inv_freq's dtype. With the wavelength
    ``w = 2 pi / inv_freq``: pairs with ``w < original_max_len / high_freq_factor`` (many turns
    within the original context) are left as they are; pairs with
    ``w > original_max_len / low_freq_factor`` (less than low_freq_factor turns) are divided by
    ``factor``; in between, with ``smooth = (original_max_len / w - low_freq_factor) /
    (high_freq_factor - low_freq_factor)`` (0 at the long end, 1 at the short end), the result is
    ``(1 - smooth) * inv_freq / factor + smooth * inv_freq``. Llama 3.1: factor 8,
    low_freq_factor 1, high_freq_factor 4, original_max_len 8192."""
    _check_scaling(inv_freq, factor)
    if not high_freq_factor > low_freq_factor > 0:
        raise ValueError(f"need high_freq_factor > low_freq_factor > 0, got {high_freq_factor}, {low_freq_factor}")
    if not original_max_len > 0:
        raise ValueError(f"original_max_len is the trained context in tokens, > 0; got {original_max_len}")
    theta = inv_freq.double()
    wavelength = rope_wavelengths(theta)
    smooth = (original_max_len / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * theta / factor + smooth * theta
    out = torch.where(wavelength > original_max_len / low_freq_factor, theta / factor, smoothed)
    out = torch.where(wavelength < original_max_len / high_freq_factor, theta, out)
    return out.to(inv_freq.dtype)


def yarn_ramp(r: torch.Tensor, alpha: float = 1.0, beta: float = 32.0) -> torch.Tensor:
    """YaRN's gamma: ``[d/2]`` turns r -> ``[d/2]`` in [0, 1], 0 below ``alpha`` turns, 1 above
    ``beta``, linear in r in between."""
    return ((r - alpha) / (beta - alpha)).clamp(0.0, 1.0)


def yarn_frequencies(inv_freq: torch.Tensor, factor: float, original_max_len: int, alpha: float = 1.0,
                     beta: float = 32.0) -> torch.Tensor:
    """YaRN's frequencies ("NTK-by-parts", Peng et al. 2023, section 3): with ``r_i`` the turns of
    pair i over the original context (:func:`rotations`) and ``gamma = yarn_ramp(r, alpha, beta)``,
    ``theta_i' = (1 - gamma) * theta_i / factor + gamma * theta_i``: untouched above ``beta``
    turns, divided by ``factor`` below ``alpha``. inv_freq ``[d/2]`` -> ``[d/2]``, its dtype. YaRN
    also sharpens the softmax: :func:`yarn_attention_factor`."""
    _check_scaling(inv_freq, factor)
    theta = inv_freq.double()
    gamma = yarn_ramp(rotations(theta, original_max_len), alpha, beta)
    return ((1 - gamma) * theta / factor + gamma * theta).to(inv_freq.dtype)


def yarn_index_ramp_frequencies(d: int, base: float, factor: float, original_max_len: int, alpha: float = 1.0,
                                beta: float = 32.0) -> torch.Tensor:
    """YaRN as its authors' code and Hugging Face's ``_compute_yarn_parameters`` (truncate on)
    compute it: the pair indices where r = beta and r = alpha, rounded outwards (floor, ceil), and
    a ramp *linear in the pair index* between them, instead of linear in r. ``[d/2]`` float64."""
    _check_even(d)

    def index_of(turns: float) -> float:  # the (fractional) pair i at which r_i = turns
        return d * math.log(original_max_len / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(index_of(beta)), 0), min(math.ceil(index_of(alpha)), d - 1)
    high = high + 0.001 if high == low else high
    keep = 1 - ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)  # 1: untouched
    theta = rope_frequencies(d, base)
    return theta / factor * (1 - keep) + theta * keep


def yarn_attention_factor(factor: float) -> float:
    """YaRN's ``sqrt(1/t) = 0.1 ln(factor) + 1`` (1 for factor <= 1): q and k are both multiplied
    by it (Hugging Face multiplies cos and sin), so the logits by its square, ``1/t``."""
    return 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
