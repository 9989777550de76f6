"""Learner-style wrong implementations for exercises 10.1 (RoPE) and 10.2 (ALiBi), with the hint
each check must give."""

import math

import torch


# ----------------------------------------------------------------- 10.1 rope
def _halves(x):
    d = x.shape[-1]
    return x[..., : d // 2], x[..., d // 2:]


def rope_interleaved(x, positions, base):
    # The RoFormer paper's pairs (2i, 2i+1): right maths, wrong convention for this contract.
    d = x.shape[-1]
    theta = base ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = positions[:, None].float() * theta[None, :]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x_even, x_odd = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x_even * cos - x_odd * sin
    out[..., 1::2] = x_even * sin + x_odd * cos
    return out


def rope_exponent_i_over_d(x, positions, base):
    d = x.shape[-1]
    theta = base ** (-torch.arange(d // 2, dtype=torch.float64) / d)  # i/d: forgot the 2
    ang = positions[:, None].double() * theta
    ang = torch.cat([ang, ang], dim=-1)
    x1, x2 = _halves(x)
    return x * ang.cos().to(x.dtype) + torch.cat([-x2, x1], dim=-1) * ang.sin().to(x.dtype)


def rope_ignores_base(x, positions, base):
    d = x.shape[-1]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))  # the usual constant, hard-coded
    ang = positions[:, None].float() * inv_freq
    emb = torch.cat((ang, ang), dim=-1)
    x1, x2 = _halves(x)
    return x * emb.cos().to(x.dtype) + torch.cat((-x2, x1), dim=-1) * emb.sin().to(x.dtype)


def rope_ignores_positions(x, positions, base):
    T, d = x.shape[-2:]
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2).float() / d))
    ang = torch.arange(T).float()[:, None] * inv_freq  # row t at position t
    emb = torch.cat((ang, ang), dim=-1)
    x1, x2 = _halves(x)
    return x * emb.cos().to(x.dtype) + torch.cat((-x2, x1), dim=-1) * emb.sin().to(x.dtype)


def rope_negative_rotation(x, positions, base):
    d = x.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2).float() / d))
    emb = torch.cat([positions[:, None] * inv_freq] * 2, dim=-1)
    x1, x2 = _halves(x)
    return x * emb.cos().to(x.dtype) + torch.cat((x2, -x1), dim=-1) * emb.sin().to(x.dtype)  # (x2, -x1)


def rope_repeat_interleave(x, positions, base):
    d = x.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2).float() / d))
    emb = (positions[:, None] * inv_freq).repeat_interleave(2, dim=-1)  # laid out for neighbours
    x1, x2 = _halves(x)
    return x * emb.cos().to(x.dtype) + torch.cat((-x2, x1), dim=-1) * emb.sin().to(x.dtype)


def rope_exponent_from_one(x, positions, base):
    d = x.shape[-1]
    i = torch.arange(1, d // 2 + 1, dtype=torch.float64)  # i = 1 .. d/2, as in the paper's theta_1 ..
    ang = positions[:, None].double() * base ** (-2 * i / d)
    ang = torch.cat([ang, ang], dim=-1)
    x1, x2 = _halves(x)
    return x * ang.cos().to(x.dtype) + torch.cat([-x2, x1], dim=-1) * ang.sin().to(x.dtype)


def rope_float64_result(x, positions, base):
    d = x.shape[-1]
    ang = positions[:, None].double() * base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.cat([ang, ang], dim=-1)
    x1, x2 = _halves(x)
    return x * ang.cos() + torch.cat([-x2, x1], dim=-1) * ang.sin()  # float64 tables promote x


def rope_in_place(x, positions, base):
    d = x.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2).float() / d))
    emb = torch.cat([positions[:, None] * inv_freq] * 2, dim=-1)
    x1, x2 = _halves(x)
    rotated = torch.cat((-x2, x1), dim=-1) * emb.sin().to(x.dtype)
    x.mul_(emb.cos().to(x.dtype))
    return x + rotated


# ----------------------------------------------------------------- 10.2 alibi_bias
def _distance(T):
    i = torch.arange(T)
    return (i[:, None] - i[None, :]).abs()


def alibi_slopes_from_zero(n_heads, T):
    slopes = torch.tensor([2 ** (-8 * h / n_heads) for h in range(n_heads)])  # first slope 1
    return -slopes[:, None, None] * _distance(T)


def alibi_slopes_one_too_far(n_heads, T):
    slopes = torch.tensor([2 ** (-8 * (h + 2) / n_heads) for h in range(n_heads)])
    return -slopes[:, None, None] * _distance(T)


def alibi_slopes_reversed(n_heads, T):
    slopes = 2.0 ** (-8 * torch.arange(n_heads, 0, -1) / n_heads)  # gentlest first
    return -slopes[:, None, None] * _distance(T)


def alibi_one_slope(n_heads, T):
    slope = 2 ** (-8 / n_heads)
    return (-slope * _distance(T).float()).expand(n_heads, T, T).clone()


def alibi_one_slope_last(n_heads, T):
    return torch.stack([-(2.0**-8) * _distance(T).float() for _ in range(n_heads)])


def alibi_h8_slopes(n_heads, T):
    slopes = torch.tensor([0.5 ** (h + 1) for h in range(n_heads)])  # the familiar 1/2, 1/4, ... (H = 8)
    return -slopes[:, None, None] * _distance(T)


def alibi_no_abs(n_heads, T):
    slopes = 2.0 ** (-8 * torch.arange(1, n_heads + 1) / n_heads)
    i = torch.arange(T)
    return -slopes[:, None, None] * (i[:, None] - i[None, :])


def alibi_wrong_sign(n_heads, T):
    slopes = 2.0 ** (-8 * torch.arange(1, n_heads + 1) / n_heads)
    return slopes[:, None, None] * _distance(T)


def alibi_bloom_style(n_heads, T):
    slopes = 2.0 ** (-8 * torch.arange(1, n_heads + 1) / n_heads)
    return (slopes[:, None, None] * torch.arange(T)[None, None, :]).expand(n_heads, T, T).clone()


def alibi_float64(n_heads, T):
    slopes = torch.tensor([math.pow(2, -8 * (h + 1) / n_heads) for h in range(n_heads)], dtype=torch.float64)
    return -slopes[:, None, None] * _distance(T)


def alibi_heads_last(n_heads, T):
    slopes = 2.0 ** (-8 * torch.arange(1, n_heads + 1) / n_heads)
    return -_distance(T)[:, :, None] * slopes  # [T, T, H]


WRONG = {
    "rope": [
        (rope_interleaved, "interleaved convention"),
        (rope_exponent_i_over_d, "exponent i/d"),
        (rope_ignores_base, "you ignored `base`"),
        (rope_ignores_positions, "you ignored `positions`"),
        (rope_negative_rotation, "rotated by -m"),
        (rope_repeat_interleave, "repeat_interleave"),
        (rope_exponent_from_one, "start at i = 1"),
        (rope_float64_result, "expected dtype torch.float32"),
        (rope_in_place, "in place"),
    ],
    "alibi_bias": [
        (alibi_slopes_from_zero, "off by one head"),
        (alibi_slopes_one_too_far, "off by one head"),
        (alibi_slopes_reversed, "reverse order"),
        (alibi_one_slope, "one slope for all heads"),
        (alibi_one_slope_last, "one slope for all heads"),
        (alibi_h8_slopes, "for H = 8 only"),
        (alibi_no_abs, "needs abs"),
        (alibi_wrong_sign, "wrong sign"),
        (alibi_bloom_style, "BLOOM"),
        (alibi_float64, "expected dtype torch.float32"),
        (alibi_heads_last, "expected shape [8, 5, 5]"),
    ],
}
