"""Notebook 10 (positions): the reference code of helpers.nb10_positions (RoPE, ALiBi, sinusoidal
embeddings, RoPE in a KV cache), and the checks of exercises 10.1-10.2: learner-style wrong
implementations each check must reject with its hint (WRONG) and correct ones in other styles than
the reference it must accept (RIGHT)."""

import math

import pytest
import torch

from helpers import nb10_positions as positions
from helpers.nb01_qkv_shapes import merge_heads, qkv_projection, scaled_dot_product_attention
from helpers.nb03_masks import causal_mask
from tests.exercise_cases import assert_accepted, assert_rejected, right_cases, wrong_cases

# =============================================================== lesson: helpers.nb10_positions


def gen(seed):
    return torch.Generator().manual_seed(seed)


def test_all_lists_exactly_the_graded_functions():
    assert positions.__all__ == ["rope", "alibi_bias"]


# ----------------------------------------------------------------- RoPE


def test_rope_preserves_norms_and_is_the_identity_at_position_0():
    x = torch.randn(2, 3, 7, 16, generator=gen(0), dtype=torch.float64)
    y = positions.rope(x, torch.arange(100, 107), 10000.0)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(positions.rope(x, torch.zeros(7, dtype=torch.long)), x)


def test_rope_scores_depend_only_on_relative_position():
    g = gen(1)
    q, k = torch.randn(6, 8, generator=g, dtype=torch.float64), torch.randn(6, 8, generator=g, dtype=torch.float64)
    pos = torch.tensor([0, 3, 4, 9, 10, 30])
    scores = positions.rope(q, pos, 500.0) @ positions.rope(k, pos, 500.0).T
    for shift in (1, 17, 1000):
        shifted = positions.rope(q, pos + shift, 500.0) @ positions.rope(k, pos + shift, 500.0).T
        torch.testing.assert_close(shifted, scores)
    # <R(m) q, R(n) k> = <q, R(n - m) k>
    m, n = 5, 12
    lhs = positions.rope(q[:1], torch.tensor([m])) @ positions.rope(k[:1], torch.tensor([n])).T
    rhs = q[:1] @ positions.rope(k[:1], torch.tensor([n - m])).T
    torch.testing.assert_close(lhs, rhs)


def test_rope_equals_a_block_rotation_matrix():
    d, T, base = 8, 5, 100.0
    x = torch.randn(T, d, generator=gen(2), dtype=torch.float64)
    pos = torch.arange(2, 2 + T)
    theta = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    out = torch.empty_like(x)
    for t in range(T):
        R = torch.zeros(d, d, dtype=torch.float64)
        for i in range(d // 2):
            c, s = math.cos(pos[t] * theta[i]), math.sin(pos[t] * theta[i])
            a, b = i, i + d // 2  # the rotate-half pair
            R[a, a], R[a, b], R[b, a], R[b, b] = c, -s, s, c
        out[t] = R @ x[t]
    torch.testing.assert_close(positions.rope(x, pos, base), out)


def test_interleaved_form_is_the_same_rotation_up_to_a_permutation():
    d = 12
    x = torch.randn(3, 7, d, generator=gen(3), dtype=torch.float64)
    pos = torch.arange(4, 11)
    perm = positions.interleave_permutation(d)
    assert perm.tolist()[:4] == [0, 6, 1, 7]
    torch.testing.assert_close(positions.rope_interleaved(x[..., perm], pos), positions.rope(x, pos)[..., perm])
    # Permuting the columns of W_Q and W_K converts a checkpoint: the scores do not change.
    w_q, w_k = torch.randn(2, 10, d, generator=gen(4), dtype=torch.float64)
    h = torch.randn(7, 10, generator=gen(5), dtype=torch.float64)
    s_half = positions.rope(h @ w_q, pos) @ positions.rope(h @ w_k, pos).T
    s_inter = positions.rope_interleaved(h @ w_q[:, perm], pos) @ positions.rope_interleaved(h @ w_k[:, perm], pos).T
    torch.testing.assert_close(s_inter, s_half)
    assert not torch.allclose(positions.rope_interleaved(x, pos), positions.rope(x, pos))


def test_rope_keeps_dtype_and_device():
    for dtype in (torch.float32, torch.float64, torch.float16):
        x = torch.randn(4, 8).to(dtype)
        assert positions.rope(x, torch.arange(4)).dtype == dtype


def test_rope_rejects_odd_width_and_wrong_positions():
    with pytest.raises(ValueError, match="even"):
        positions.rope(torch.randn(3, 5), torch.arange(3))
    with pytest.raises(ValueError, match="positions must have shape"):
        positions.rope(torch.randn(3, 4), torch.arange(4))


def test_rope_score_bound_decays_and_starts_at_its_maximum():
    d = 128
    r = torch.arange(0, 2001)
    bound = positions.rope_score_bound(r, d)
    assert math.isclose(bound[0].item(), (d // 2 + 1) / 2)  # |S_j| = j at distance 0: mean of 1..d/2
    assert bound[1000:].max() < bound[:3].min() / 2 and bound[1000:].mean() < bound[0] / 4


def test_rope_score_bound_oscillates_and_falls_only_on_average():
    bound = positions.rope_score_bound(torch.arange(0, 10001), 128)
    assert (bound[1:] > bound[:-1]).sum() > 1000  # it goes up at many steps: not monotone
    decades = [bound[10**e:10 ** (e + 1)].mean() for e in range(4)]
    assert all(a > b for a, b in zip(decades, decades[1:]))


def test_sinusoidal_embeddings_layout_and_relative_shift_is_linear():
    pe = positions.sinusoidal_embeddings(50, 16)
    assert pe.shape == (50, 16) and pe.dtype == torch.float32
    assert torch.allclose(pe[:, 0], torch.sin(torch.arange(50.0))) and torch.allclose(pe[:, 1], torch.cos(torch.arange(50.0)))
    # PE(m + k) is a fixed linear map (a rotation per pair) of PE(m), the same for every m.
    k = 3
    A = torch.linalg.lstsq(pe[:40].double(), pe[k:40 + k].double()).solution
    torch.testing.assert_close((pe[10:20].double() @ A), pe[10 + k:20 + k].double(), atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------- RoPE in a KV cache


def _weights(D, seed):
    g = gen(seed)
    return (torch.randn(1, 7, D, generator=g, dtype=torch.float64),
            torch.randn(D, 3 * D, generator=g, dtype=torch.float64) / math.sqrt(D),
            torch.randn(D, D, generator=g, dtype=torch.float64) / math.sqrt(D))


def test_rope_weights_fold_the_rotation_into_the_projection():
    x, w_qkv, _ = _weights(12, 6)
    q, k, v = qkv_projection(x, w_qkv, 3)
    q2, k2, v2 = qkv_projection(x, positions.rope_weights(w_qkv, 3, position=5, base=100.0), 3)
    at5 = torch.full((7,), 5)
    torch.testing.assert_close(q2, positions.rope(q, at5, 100.0))
    torch.testing.assert_close(k2, positions.rope(k, at5, 100.0))
    torch.testing.assert_close(v2, v)


def test_cached_decoding_with_rope_equals_the_full_forward():
    x, w_qkv, w_o = _weights(12, 7)
    H, T = 3, x.shape[1]
    full = positions.rope_attention(x, w_qkv, w_o, H, base=100.0)
    k_cache = v_cache = torch.zeros(1, H, 0, 4, dtype=torch.float64)
    steps = []
    for t in range(T):
        y, k_cache, v_cache = positions.decode_step_rope(x[:, t:t + 1], t, k_cache, v_cache, w_qkv, w_o, H, 100.0)
        steps.append(y)
    torch.testing.assert_close(torch.cat(steps, dim=1), full)
    # The bug: every decoded token rotated as position 0 gives attention without positions.
    k_cache = v_cache = torch.zeros(1, H, 0, 4, dtype=torch.float64)
    wrong = []
    for t in range(T):
        y, k_cache, v_cache = positions.decode_step_rope(x[:, t:t + 1], 0, k_cache, v_cache, w_qkv, w_o, H, 100.0)
        wrong.append(y)
    wrong = torch.cat(wrong, dim=1)
    q, k, v = qkv_projection(x, w_qkv, H)
    no_positions = merge_heads(scaled_dot_product_attention(q, k, v, causal_mask(T))) @ w_o
    torch.testing.assert_close(wrong, no_positions)
    assert (wrong - full).abs().max() > 1e-3


def test_decode_step_rope_takes_one_token():
    x, w_qkv, w_o = _weights(12, 8)
    empty = torch.zeros(1, 3, 0, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="one new token"):
        positions.decode_step_rope(x[:, :2], 0, empty, empty, w_qkv, w_o, 3)


# ----------------------------------------------------------------- ALiBi


def test_alibi_slopes_and_bias():
    assert positions.alibi_slopes(8).tolist() == [2.0 ** -(h + 1) for h in range(8)]
    b = positions.alibi_bias(4, 6)
    assert b.shape == (4, 6, 6) and b.dtype == torch.float32
    assert (b.diagonal(dim1=-2, dim2=-1) == 0).all() and torch.equal(b, b.transpose(-2, -1)) and (b <= 0).all()
    assert b[1, 5, 2].item() == -(2.0 ** -4) * 3
    p = positions.alibi_attention_weights(torch.zeros(4, 6, 6), 4)
    torch.testing.assert_close(p.sum(-1), torch.ones(4, 6))
    assert (p.masked_select(~causal_mask(6)) == 0).all()


# =============================================================== checks of 10.1-10.2


# --------------------------------------------------------------- wrong implementations


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


def rope_positions_from_one(x, positions, base):
    d = x.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2).double() / d))
    emb = torch.cat([(positions.double()[:, None] + 1) * inv_freq] * 2, dim=-1)  # "positions start at 1"
    x1, x2 = _halves(x)
    return x * emb.cos().to(x.dtype) + torch.cat((-x2, x1), dim=-1) * emb.sin().to(x.dtype)


def rope_cos_sin_swapped(x, positions, base):
    d = x.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2).double() / d))
    emb = torch.cat([positions.double()[:, None] * inv_freq] * 2, dim=-1)
    x1, x2 = _halves(x)
    return x * emb.sin().to(x.dtype) + torch.cat((-x2, x1), dim=-1) * emb.cos().to(x.dtype)


def alibi_base_e(n_heads, T):
    slopes = torch.exp(-8 * torch.arange(1, n_heads + 1) / n_heads)
    return -slopes[:, None, None] * _distance(T)


def alibi_lower_triangle_only(n_heads, T):
    slopes = 2.0 ** (-8 * torch.arange(1, n_heads + 1) / n_heads)
    i = torch.arange(T)
    return -slopes[:, None, None] * (i[:, None] - i[None, :]).clamp(min=0)  # the future "is masked anyway"


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
        (rope_positions_from_one, "positions are shifted by one"),
        (rope_cos_sin_swapped, "swapped cos and sin"),
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
        (alibi_base_e, "base e"),
        (alibi_lower_triangle_only, "0 above the diagonal"),
    ],
}


# --------------------------------------------------------------- right variants


# ----------------------------------------------------------------- 10.1 rope


def rope_complex(x, positions, base):
    d = x.shape[-1]
    theta = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    z = torch.complex(x[..., : d // 2].double(), x[..., d // 2:].double())
    z = z * torch.polar(torch.ones(len(positions), d // 2, dtype=torch.float64), positions[:, None] * theta)
    return torch.cat([z.real, z.imag], dim=-1).to(x.dtype)


def rope_hf_style(x, positions, base):
    # Hugging Face's LlamaRotaryEmbedding + apply_rotary_pos_emb, in float32.
    dim = x.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    freqs = positions[:, None].float() @ inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    def rotate_half(t):
        t1, t2 = t[..., : t.shape[-1] // 2], t[..., t.shape[-1] // 2:]
        return torch.cat((-t2, t1), dim=-1)

    return (x * cos) + (rotate_half(x) * sin)


def rope_loops(x, positions, base):
    d = x.shape[-1]
    out = x.clone()
    flat, src = out.reshape(-1, *x.shape[-2:]), x.reshape(-1, *x.shape[-2:])
    for b in range(flat.shape[0]):
        for t, m in enumerate(positions.tolist()):
            for i in range(d // 2):
                a = m * base ** (-2 * i / d)
                u, v = src[b, t, i].item(), src[b, t, i + d // 2].item()
                flat[b, t, i] = u * math.cos(a) - v * math.sin(a)
                flat[b, t, i + d // 2] = u * math.sin(a) + v * math.cos(a)
    return flat.reshape(x.shape)


def rope_matrix(x, positions, base):
    d = x.shape[-1]
    theta = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = positions.double()[:, None] * theta  # [T, d/2]
    c, s = ang.cos(), ang.sin()
    R = torch.zeros(len(positions), d, d, dtype=torch.float64)
    idx = torch.arange(d // 2)
    R[:, idx, idx], R[:, idx, idx + d // 2] = c, -s
    R[:, idx + d // 2, idx], R[:, idx + d // 2, idx + d // 2] = s, c
    return torch.einsum("tij,...tj->...ti", R, x.double()).to(x.dtype)


# ----------------------------------------------------------------- 10.2 alibi_bias


def alibi_loops(n_heads, T):
    out = torch.zeros(n_heads, T, T)
    for h in range(n_heads):
        slope = 2 ** (-8 * (h + 1) / n_heads)
        for i in range(T):
            for j in range(T):
                out[h, i, j] = -slope * abs(i - j)
    return out


def alibi_logspace(n_heads, T):
    slopes = torch.logspace(-8 / n_heads, -8, n_heads, base=2)
    pos = torch.arange(T, dtype=torch.float32)
    return -slopes[:, None, None] * torch.cdist(pos[:, None], pos[:, None])


def alibi_float64_inside(n_heads, T):
    h = torch.arange(n_heads, dtype=torch.float64)
    slopes = torch.exp2(-8 * (h + 1) / n_heads)
    i = torch.arange(T, dtype=torch.float64)
    return torch.einsum("h,ij->hij", slopes, -(i[:, None] - i[None, :]).abs()).float()


def alibi_ratio(n_heads, T):
    # The paper's recipe: a geometric sequence whose first term and ratio are 2^(-8/H).
    start = 2 ** (-8 / n_heads)
    slopes = torch.tensor([start * start**h for h in range(n_heads)])
    i = torch.arange(T)
    return -(slopes.view(-1, 1, 1) * (i.view(1, -1, 1) - i.view(1, 1, -1)).abs())


RIGHT = {
    "rope": [rope_complex, rope_hf_style, rope_loops, rope_matrix],
    "alibi_bias": [alibi_loops, alibi_logspace, alibi_float64_inside, alibi_ratio],
}


@pytest.mark.parametrize(("name", "wrong", "hint"), wrong_cases(WRONG))
def test_check_rejects_wrong(name, wrong, hint):
    assert_rejected(name, wrong, hint)


@pytest.mark.parametrize(("name", "right"), right_cases(RIGHT))
def test_check_accepts_right(name, right):
    assert_accepted(name, right)
