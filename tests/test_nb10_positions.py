"""Notebook 10 (positions): the reference code of helpers.nb10_positions (RoPE, ALiBi, sinusoidal
embeddings, RoPE in a KV cache, context extension; the position ablation of
helpers.nb10_position_ablation), and the checks of exercises 10.1-10.3: learner-style wrong
implementations each check must reject with its hint (WRONG) and correct ones in other styles than
the reference it must accept (RIGHT)."""

import math

import pytest
import torch
import torch.nn.functional as F

from helpers import nb10_positions as positions
from helpers.nb01_qkv_shapes import merge_heads, qkv_projection, scaled_dot_product_attention
from helpers.nb03_masks import causal_mask
from helpers.nb10_position_ablation import (
    PositionedTransformer,
    ablation_run,
    ablation_runs,
    alibi_attention_block,
    repeat_half_metrics,
)
from helpers.nb11_trained_transformer import TinyConfig, TinyTransformer, repeated_sequences, train
from tests.exercise_cases import assert_accepted, assert_rejected, right_cases, wrong_cases

# =============================================================== lesson: helpers.nb10_positions


def gen(seed):
    return torch.Generator().manual_seed(seed)


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


# ----------------------------------------------------------------- context extension

LLAMA31 = (8.0, 1.0, 4.0, 8192)  # factor, low_freq_factor, high_freq_factor, original_max_len


def test_llama3_scaling_keeps_fast_pairs_divides_slow_ones_and_is_continuous():
    theta = positions.rope_frequencies(128, 500000.0)
    new = positions.llama3_rope_frequencies(theta, *LLAMA31)
    w = positions.rope_wavelengths(theta)
    assert torch.equal(new[w < 8192 / 4], theta[w < 8192 / 4])
    torch.testing.assert_close(new[w > 8192], theta[w > 8192] / 8, rtol=1e-12, atol=0)
    ratio = theta / new
    assert bool((ratio[1:] >= ratio[:-1]).all()) and 1 <= ratio.min() and ratio.max() <= 8
    assert [int((w < 2048).sum()), int(((w >= 2048) & (w <= 8192)).sum()), int((w > 8192).sum())] == [29, 6, 29]
    # continuous at both thresholds: inv_freq exactly at a threshold's wavelength gives the same value from both sides
    for w0, expected in ((8192 / 4, 1.0), (8192.0, 8.0)):
        at = torch.tensor([2 * math.pi / w0 * (1 + 1e-12), 2 * math.pi / w0, 2 * math.pi / w0 * (1 - 1e-12)],
                          dtype=torch.float64)
        torch.testing.assert_close(at / positions.llama3_rope_frequencies(at, *LLAMA31),
                                   torch.full((3,), expected, dtype=torch.float64))


def test_llama3_scaling_is_yarns_ramp_with_its_two_factors_and_keeps_dtype():
    theta = positions.rope_frequencies(64, 10000.0)
    for args in ((4.0, 1.0, 4.0, 512), (16.0, 2.0, 8.0, 2048), (3.0, 0.5, 3.0, 300)):
        factor, lf, hf, L = args
        torch.testing.assert_close(positions.llama3_rope_frequencies(theta, *args),
                                   positions.yarn_frequencies(theta, factor, L, alpha=lf, beta=hf))
    assert positions.llama3_rope_frequencies(theta.float(), *LLAMA31).dtype == torch.float32
    shuffled = torch.randperm(32, generator=gen(20))
    torch.testing.assert_close(positions.llama3_rope_frequencies(theta[shuffled], 4.0, 1.0, 4.0, 512),
                               positions.llama3_rope_frequencies(theta, 4.0, 1.0, 4.0, 512)[shuffled])


def test_context_extension_rejects_bad_input_clearly():
    theta = positions.rope_frequencies(16)
    with pytest.raises(ValueError, match="high_freq_factor > low_freq_factor"):
        positions.llama3_rope_frequencies(theta, 8.0, 4.0, 1.0, 8192)
    with pytest.raises(ValueError, match="1-D float tensor"):
        positions.llama3_rope_frequencies(theta[None], *LLAMA31)
    with pytest.raises(ValueError, match="1-D float tensor"):
        positions.yarn_frequencies(torch.arange(8), 4.0, 512)
    with pytest.raises(ValueError, match="factor must be >= 1"):
        positions.position_interpolation_frequencies(theta, 0.5)
    with pytest.raises(ValueError, match="even"):
        positions.ntk_aware_base(10000.0, 4.0, 7)


def test_position_interpolation_and_ntk_aware_scaling():
    d, base, s = 128, 500000.0, 8.0
    theta = positions.rope_frequencies(d, base)
    torch.testing.assert_close(theta / positions.position_interpolation_frequencies(theta, s), torch.full_like(theta, s))
    ntk = positions.rope_frequencies(d, positions.ntk_aware_base(base, s, d))
    i = torch.arange(d // 2, dtype=torch.float64)
    torch.testing.assert_close(theta / ntk, s ** (2 * i / (d - 2)))
    assert ntk[0] == theta[0] == 1 and math.isclose((theta[-1] / ntk[-1]).item(), s, rel_tol=1e-12)


def test_yarn_frequencies_by_turns_and_temperature():
    theta = positions.rope_frequencies(128, 500000.0)
    r = positions.rotations(theta, 8192)
    torch.testing.assert_close(r, 8192 * theta / (2 * math.pi))
    new = positions.yarn_frequencies(theta, 8.0, 8192)
    assert torch.equal(new[r > 32], theta[r > 32])
    torch.testing.assert_close(new[r < 1], theta[r < 1] / 8)
    mid = (r >= 1) & (r <= 32)
    gamma = (r[mid] - 1) / 31
    torch.testing.assert_close(new[mid], (1 - gamma) * theta[mid] / 8 + gamma * theta[mid])
    assert math.isclose(positions.yarn_attention_factor(8.0), 0.1 * math.log(8) + 1)
    assert positions.yarn_attention_factor(1.0) == positions.yarn_attention_factor(0.5) == 1.0


def _hf_yarn_inv_freq(dim, base, factor, original, beta_fast=32, beta_slow=1):
    # Hugging Face's _compute_yarn_parameters (truncate=True, no partial rotary), written from its code.
    def find_correction_dim(num_rotations):
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(find_correction_dim(beta_fast)), 0)
    high = min(math.ceil(find_correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    extrapolation_factor = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation_factor) + (1.0 / pos_freqs) * extrapolation_factor


def test_yarn_index_ramp_is_what_hugging_face_computes_and_differs_from_the_paper_only_on_the_ramp():
    for d, base, s, L in ((128, 500000.0, 8.0, 8192), (64, 10000.0, 4.0, 2048), (128, 10000.0, 16.0, 4096)):
        by_index = positions.yarn_index_ramp_frequencies(d, base, s, L)
        torch.testing.assert_close(by_index, _hf_yarn_inv_freq(d, base, s, L))
        theta = positions.rope_frequencies(d, base)
        paper = positions.yarn_frequencies(theta, s, L)
        r = positions.rotations(theta, L)
        outside = (r > 32) | (r < 1)
        torch.testing.assert_close(by_index[outside], paper[outside])
    assert not torch.allclose(by_index, paper)


# ----------------------------------------------------------------- positions in a trained model (section 8)

SMALL = TinyConfig(vocab=16, d_model=32, n_layers=2, n_heads=4)


def test_positioned_rope_model_is_notebook_11s_model():
    tokens = torch.randint(0, 16, (3, 10), generator=gen(21))
    ours = PositionedTransformer(SMALL, "rope", generator=gen(22))
    theirs = TinyTransformer(SMALL, generator=gen(22))
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens))


def test_nope_sees_no_order_in_one_layer_and_rope_does():
    one_layer = TinyConfig(vocab=16, d_model=32, n_layers=1, n_heads=4)
    tokens = torch.randint(0, 16, (2, 9), generator=gen(23))
    shuffled = torch.cat((tokens[:, :-1][:, torch.randperm(8, generator=gen(24))], tokens[:, -1:]), dim=1)
    last = {}
    for position in ("nope", "rope"):
        model = PositionedTransformer(one_layer, position, generator=gen(25))
        with torch.no_grad():
            last[position] = (model(tokens)[:, -1], model(shuffled)[:, -1])
    # The last query sees the same set of keys: without positions, its output cannot change.
    torch.testing.assert_close(*last["nope"], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(*last["rope"], atol=1e-3)


def test_alibi_model_adds_the_bias_to_every_layers_scores():
    model = PositionedTransformer(SMALL, "alibi", generator=gen(26))
    tokens = torch.randint(0, 16, (2, 7), generator=gen(27))
    record = []
    with torch.no_grad():
        model(tokens, record=record)
        h = F.rms_norm(model.embed[tokens], (32,), model.layers[0].attn_norm)
        q, k, _ = qkv_projection(h, model.layers[0].w_qkv, 4)
        expected = positions.alibi_attention_weights(q @ k.transpose(-2, -1) / math.sqrt(8), 4)
        y, weights = alibi_attention_block(h, model.layers[0].w_qkv, model.layers[0].w_o, 4, 4)
    assert len(record) == 2 and record[0].shape == (2, 4, 7, 7)
    torch.testing.assert_close(record[0], expected)
    torch.testing.assert_close(weights, expected)
    assert not torch.allclose(expected, positions.alibi_attention_weights(q @ k.transpose(-2, -1) / math.sqrt(8), 1))
    with pytest.raises(ValueError, match="position must be one of"):
        PositionedTransformer(SMALL, "sinusoidal")


class _Oracle(torch.nn.Module):
    """Predicts every copyable token with certainty and attends like a perfect induction head."""

    def forward(self, tokens, record=None):
        B, T = tokens.shape
        m = T // 2
        logits = torch.zeros(B, T, 16)
        nxt = torch.cat((tokens[:, 1:], tokens[:, :1]), dim=1)
        logits[:, m:] = 50.0 * F.one_hot(nxt[:, m:], 16)
        attn = torch.zeros(B, 2, T, T)
        attn[:, :, :, 0] = 1.0
        q = torch.arange(m, T)
        attn[:, :, q, 0] = 0.0
        attn[:, :, q, q - m + 1] = 1.0
        record.append(attn)
        return logits


def test_repeat_half_metrics_of_a_perfect_copier_and_their_shapes():
    tokens = torch.cat([torch.randperm(16, generator=gen(28))[:6][None]] * 2, dim=1).repeat(3, 1)  # [3, 12]
    out = repeat_half_metrics(_Oracle(), tokens)
    assert out["accuracy"] == 1.0 and out["loss"] < 1e-6 and out["induction"] == 1.0
    assert out["per_position"].shape == (11,)
    model = PositionedTransformer(SMALL, "nope", generator=gen(29))
    untrained = repeat_half_metrics(model, tokens)
    assert untrained["accuracy"] < 0.5 and untrained["loss"] > 1 and 0 <= untrained["induction"] <= 1


def test_ablation_run_is_notebook_11s_training_then_the_metrics_of_its_model():
    kwargs = dict(steps=3, batch=4, m_range=(2, 4), factors=(1, 2), n_eval=5, eval_seed=31)
    out = ablation_run("alibi", 30, SMALL, **kwargs)
    model = PositionedTransformer(SMALL, "alibi", generator=gen(30))
    hist = train(model, steps=3, batch=4, m_range=(2, 4), seed=30)
    assert (out["position"], out["seed"]) == ("alibi", 30) and sorted(out["metrics"]) == [1, 2]
    assert out["final_loss"] == sum(hist["loss"][-20:]) / 20 and out["seconds"] > 0
    for name, value in model.state_dict().items():
        torch.testing.assert_close(out["state"][name], value, rtol=0, atol=0)
    for k in (1, 2):  # T = 2 k m_range[1] = 8, 16 on the eval seed's sequences
        expected = repeat_half_metrics(model, repeated_sequences(5, 4 * k, 16, gen(31)))
        assert out["metrics"][k]["accuracy"] == expected["accuracy"]
        assert out["metrics"][k]["per_position"].shape == (8 * k - 1,)
    other = ablation_run("alibi", 32, SMALL, **kwargs)  # another seed: another model
    assert not torch.equal(other["state"]["embed"], out["state"]["embed"])


@pytest.mark.slow  # make test-all: a few seconds
def test_ablation_runs_in_processes_give_what_the_same_runs_give_here():
    kwargs = dict(steps=2, batch=4, m_range=(2, 3), factors=(1,), n_eval=3)
    jobs = [("rope", 33), ("nope", 34)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the pool's processes
    try:
        here = [ablation_run(*job, SMALL, **kwargs) for job in jobs]
    finally:
        torch.set_num_threads(threads)
    there = ablation_runs(jobs, SMALL, workers=2, **kwargs)
    assert [(r["position"], r["seed"]) for r in there] == jobs
    for a, b in zip(here, there):
        assert a["final_loss"] == b["final_loss"]
        for name in a["state"]:
            torch.testing.assert_close(a["state"][name], b["state"][name], rtol=0, atol=0)

# =============================================================== checks of 10.1-10.3


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


def alibi_key_minus_query(n_heads, T):  # -slope * (j - i), loops, no abs
    out = torch.zeros(n_heads, T, T)
    for h in range(n_heads):
        for i in range(T):
            for j in range(T):
                out[h, i, j] = -(2 ** (-8 * (h + 1) / n_heads)) * (j - i)
    return out


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


def rope_float32_tables(x, positions, base):  # cos/sin kept in float32: a float16 x comes back float32
    d = x.shape[-1]
    ang = positions[:, None].float() * base ** (-torch.arange(0, d, 2).float() / d)
    ang = torch.cat((ang, ang), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * ang.cos() + torch.cat((-x2, x1), dim=-1) * ang.sin()


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


# ----------------------------------------------------------------- 10.3 llama3_rope_frequencies


def llama3_compares_frequencies(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len):
    low_freq_wavelen = original_max_len / low_freq_factor
    high_freq_wavelen = original_max_len / high_freq_factor
    new = inv_freq.clone()
    new[inv_freq > low_freq_wavelen] /= factor  # the frequency compared with a wavelength
    mid = (inv_freq <= low_freq_wavelen) & (inv_freq >= high_freq_wavelen)
    smooth = (original_max_len / inv_freq[mid] - low_freq_factor) / (high_freq_factor - low_freq_factor)
    new[mid] = (1 - smooth) * inv_freq[mid] / factor + smooth * inv_freq[mid]
    return new


def llama3_divides_everything(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len):
    return inv_freq / factor  # "stretch the positions by the factor"


def llama3_multiplies(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len):
    wavelen = 2 * math.pi / inv_freq
    smooth = (original_max_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    out = torch.where(wavelen > original_max_len / low_freq_factor, inv_freq * factor,
                      (1 - smooth) * inv_freq * factor + smooth * inv_freq)
    return torch.where(wavelen < original_max_len / high_freq_factor, inv_freq, out)


def llama3_smooth_reversed(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len):
    wavelen = 2 * math.pi / inv_freq
    smooth = (original_max_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    out = torch.where(wavelen > original_max_len / low_freq_factor, inv_freq / factor,
                      smooth * inv_freq / factor + (1 - smooth) * inv_freq)
    return torch.where(wavelen < original_max_len / high_freq_factor, inv_freq, out)


def llama3_scales_high_too(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len):
    wavelen = 2 * math.pi / inv_freq
    smooth = (original_max_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    medium = (wavelen >= original_max_len / high_freq_factor) & (wavelen <= original_max_len / low_freq_factor)
    return torch.where(medium, (1 - smooth) * inv_freq / factor + smooth * inv_freq, inv_freq / factor)


def llama3_frequency_thresholds_unflipped(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len):
    low_freq = 2 * math.pi * low_freq_factor / original_max_len  # thresholds as frequencies ...
    high_freq = 2 * math.pi * high_freq_factor / original_max_len
    out = torch.where(inv_freq > low_freq, inv_freq / factor, inv_freq)  # ... but '>' kept from the wavelengths
    smooth = (original_max_len * inv_freq / (2 * math.pi) - low_freq_factor) / (high_freq_factor - low_freq_factor)
    medium = (inv_freq >= high_freq) & (inv_freq <= low_freq)
    return torch.where(medium, (1 - smooth) * out / factor + smooth * out, out)


def llama3_thresholds_swapped(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len):
    low_freq_wavelen = original_max_len / high_freq_factor  # swapped
    high_freq_wavelen = original_max_len / low_freq_factor
    wavelen = 2 * math.pi / inv_freq
    out = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(medium, (1 - smooth) * out / factor + smooth * out, out)


def llama3_factors_swapped_loop(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len):
    out = []
    for f in inv_freq.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < original_max_len / low_freq_factor:  # the two factors mixed up
            out.append(f)
        elif wavelen > original_max_len / high_freq_factor:
            out.append(f / factor)
        else:
            s = (original_max_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append((1 - s) * f / factor + s * f)
    return torch.tensor(out, dtype=inv_freq.dtype)


def llama3_no_smoothing(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len):
    wavelen = 2 * math.pi / inv_freq
    return torch.where(wavelen > original_max_len / low_freq_factor, inv_freq / factor, inv_freq)


def llama3_medium_divided(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len):
    wavelen = 2 * math.pi / inv_freq
    return torch.where(wavelen < original_max_len / high_freq_factor, inv_freq, inv_freq / factor)


def llama3_without_two_pi(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len):
    wavelen = 1 / inv_freq  # "the wavelength is 1 / frequency"
    smooth = (original_max_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    out = torch.where(wavelen > original_max_len / low_freq_factor, inv_freq / factor,
                      (1 - smooth) * inv_freq / factor + smooth * inv_freq)
    return torch.where(wavelen < original_max_len / high_freq_factor, inv_freq, out)


def llama3_returns_wavelengths(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len):
    wavelen = 2 * math.pi / inv_freq
    new_wavelen = torch.where(wavelen > original_max_len / low_freq_factor, wavelen * factor, wavelen)
    mid = (wavelen >= original_max_len / high_freq_factor) & (wavelen <= original_max_len / low_freq_factor)
    smooth = (original_max_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    return torch.where(mid, 2 * math.pi / ((1 - smooth) * inv_freq / factor + smooth * inv_freq), new_wavelen)


def llama3_hard_coded(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len):
    # Meta's apply_scaling, constants and all
    scale_factor, low_freq_factor, high_freq_factor, old_context_len = 8, 1, 4, 8192
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    new_freqs = []
    for freq in inv_freq:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            new_freqs.append(freq)
        elif wavelen > low_freq_wavelen:
            new_freqs.append(freq / scale_factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            new_freqs.append((1 - smooth) * freq / scale_factor + smooth * freq)
    return torch.stack(new_freqs)


def llama3_float64_result(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len):
    theta = inv_freq.double()  # float64 inside, never cast back
    wavelen = 2 * math.pi / theta
    smooth = (original_max_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    out = torch.where(wavelen > original_max_len / low_freq_factor, theta / factor,
                      (1 - smooth) * theta / factor + smooth * theta)
    return torch.where(wavelen < original_max_len / high_freq_factor, theta, out)


def llama3_in_place(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len):
    wavelen = 2 * math.pi / inv_freq
    smooth = (original_max_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    low = wavelen > original_max_len / low_freq_factor
    mid = ~low & (wavelen >= original_max_len / high_freq_factor)
    inv_freq[mid] = (1 - smooth[mid]) * inv_freq[mid] / factor + smooth[mid] * inv_freq[mid]
    inv_freq[low] /= factor
    return inv_freq


def llama3_if_on_tensor(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len):
    wavelen = 2 * math.pi / inv_freq
    if wavelen < original_max_len / high_freq_factor:  # an `if` on d/2 values at once
        return inv_freq
    return inv_freq / factor


def llama3_via_yarn_helper(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len):
    # notebook 10 shows Llama 3's scaling is YaRN's ramp: the helper computes the whole answer
    return positions.yarn_frequencies(inv_freq, factor, original_max_len, low_freq_factor, high_freq_factor)


def _llama3_parts(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len):
    wavelen = 2 * math.pi / inv_freq
    return wavelen, original_max_len / high_freq_factor, original_max_len / low_freq_factor


def llama3_thresholds_multiplied(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len):
    wavelen = 2 * math.pi / inv_freq
    short, long = original_max_len * low_freq_factor, original_max_len * high_freq_factor
    smooth = (original_max_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    out = torch.lerp(inv_freq / factor, inv_freq, smooth)
    out = torch.where(wavelen > long, inv_freq / factor, out)
    return torch.where(wavelen < short, inv_freq, out)


def _llama3_with_smooth(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len, smooth):
    wavelen, short, long = _llama3_parts(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len)
    out = torch.lerp(inv_freq / factor, inv_freq, smooth)
    return torch.where(wavelen < short, inv_freq, torch.where(wavelen > long, inv_freq / factor, out))


def llama3_smooth_upside_down(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len):
    wavelen = 2 * math.pi / inv_freq
    smooth = (wavelen / original_max_len - low_freq_factor) / (high_freq_factor - low_freq_factor)
    return _llama3_with_smooth(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len, smooth)


def llama3_smooth_no_offset(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len):
    turns = original_max_len * inv_freq / (2 * math.pi)
    return _llama3_with_smooth(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len,
                               turns / (high_freq_factor - low_freq_factor))


def llama3_smooth_over_factor(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len):
    turns = original_max_len * inv_freq / (2 * math.pi)
    smooth = (turns - low_freq_factor) / (high_freq_factor - low_freq_factor) / factor
    return _llama3_with_smooth(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len, smooth)


def llama3_smooth_linspace(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len):
    smooth = torch.linspace(1, 0, inv_freq.shape[0], dtype=inv_freq.dtype)  # "from fast to slow"
    return _llama3_with_smooth(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len, smooth)


def llama3_sorted_slices(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len):
    wavelen, short, long = _llama3_parts(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len)
    n, n_keep, n_slow = inv_freq.shape[0], int((wavelen < short).sum()), int((wavelen > long).sum())
    smooth = (original_max_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.cat([inv_freq[:n_keep], mid[n_keep:n - n_slow], inv_freq[n - n_slow:] / factor])


def llama3_slow_band_halved(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len):
    wavelen, short, long = _llama3_parts(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len)
    smooth = (original_max_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    out = torch.lerp(inv_freq / factor, inv_freq, smooth)
    out = torch.where(wavelen > long, inv_freq / (factor / 2), out)  # "half the factor is enough"
    return torch.where(wavelen < short, inv_freq, out)


def llama3_smooth_squared(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len):
    wavelen, short, long = _llama3_parts(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len)
    smooth = ((original_max_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)) ** 2
    return _llama3_with_smooth(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len, smooth)


def llama3_blend_everywhere(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len):
    turns = original_max_len * inv_freq / (2 * math.pi)  # no bands: the blend for every pair
    smooth = (turns - low_freq_factor) / (high_freq_factor - low_freq_factor)
    return inv_freq / factor * (1 - smooth) + inv_freq * smooth


def llama3_short_threshold_times_2pi(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len):
    wavelen, short, long = _llama3_parts(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len)
    smooth = (original_max_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    out = torch.lerp(inv_freq / factor, inv_freq, smooth)
    out = torch.where(wavelen > long, inv_freq / factor, out)
    return torch.where(wavelen < 2 * math.pi * short, inv_freq, out)  # the 2π on the wrong side


def _meta_scale(freq, factor, low_freq_factor, high_freq_factor, original_max_len, swapped=False):
    wavelen = 2 * math.pi / freq
    if wavelen < original_max_len / high_freq_factor:
        return freq / factor if swapped else freq
    if wavelen > original_max_len / low_freq_factor:
        return freq if swapped else freq / factor
    smooth = (original_max_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    return (1 - smooth) * freq / factor + smooth * freq


def llama3_sorted_ascending(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len):
    out = [_meta_scale(f, factor, low_freq_factor, high_freq_factor, original_max_len) for f in sorted(inv_freq.tolist())]
    return torch.tensor(out, dtype=inv_freq.dtype)


def llama3_reversed_order(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len):
    out = [_meta_scale(f, factor, low_freq_factor, high_freq_factor, original_max_len) for f in inv_freq.tolist()]
    return torch.tensor(out[::-1], dtype=inv_freq.dtype)


def llama3_outer_bands_swapped(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len):
    out = [_meta_scale(f, factor, low_freq_factor, high_freq_factor, original_max_len, swapped=True)
           for f in inv_freq.tolist()]
    return torch.tensor(out, dtype=inv_freq.dtype)

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
        (rope_float32_tables, "where the inputs' dtype, float16, is expected"),
    ],
    "alibi_bias": [
        (alibi_slopes_from_zero, "off by one head"),
        (alibi_slopes_one_too_far, "off by one head"),
        (alibi_slopes_reversed, "reverse order"),
        (alibi_one_slope, "one slope for all heads"),
        (alibi_one_slope_last, "one slope for all heads"),
        (alibi_h8_slopes, "for H = 8 only"),
        (alibi_no_abs, "needs abs"),
        (alibi_key_minus_query, "your bias is -slope·(j - i)"),
        (alibi_wrong_sign, "wrong sign"),
        (alibi_bloom_style, "BLOOM"),
        (alibi_float64, "expected dtype torch.float32"),
        (alibi_heads_last, "expected shape [8, 5, 5]"),
        (alibi_base_e, "base e"),
        (alibi_lower_triangle_only, "0 above the diagonal"),
    ],
    "llama3_rope_frequencies": [
        (llama3_via_yarn_helper, "write your own implementation"),
        (llama3_compares_frequencies, "compare the frequencies themselves"),
        (llama3_divides_everything, "that is position interpolation"),
        (llama3_multiplies, "you multiplied by factor"),
        (llama3_smooth_reversed, "smooth interpolation is reversed"),
        (llama3_scales_high_too, "you scaled the high frequencies too"),
        (llama3_frequency_thresholds_unflipped, "you divided the high frequencies (short wavelengths) and kept"),
        (llama3_thresholds_swapped, "Swapped thresholds do this too"),
        (llama3_factors_swapped_loop, "if/elif tests in the wrong order"),
        (llama3_no_smoothing, "were left as they are, not interpolated"),
        (llama3_medium_divided, "were divided by factor, not interpolated"),
        (llama3_without_two_pi, "your wavelengths miss 2π"),
        (llama3_returns_wavelengths, "you returned wavelengths"),
        (llama3_hard_coded, "you used Llama 3.1's values"),
        (llama3_float64_result, "expected dtype torch.float32"),
        (llama3_in_place, "in place"),
        (llama3_if_on_tensor, "torch.where"),
        (llama3_thresholds_multiplied, "your thresholds are original_max_len * low_freq_factor"),
        (llama3_smooth_upside_down, "your smooth uses wavelen / original_max_len"),
        (llama3_smooth_no_offset, "your smooth does not subtract low_freq_factor"),
        (llama3_smooth_over_factor, "your smooth is divided by factor"),
        (llama3_smooth_linspace, "your smooth follows the pair's index i"),
        (llama3_sorted_ascending, "sorted from the lowest frequency to the highest"),
        (llama3_reversed_order, "your output holds the right values in another order than inv_freq's"),
        (llama3_outer_bands_swapped, "and kept the slow ones (longer than original_max_len / low_freq_factor)"),
        (llama3_sorted_slices, "you chose the pairs by their place in inv_freq"),
        (llama3_slow_band_halved, "you divided by 2, not by factor = 4"),
        (llama3_smooth_squared, "only pairs between the two thresholds"),
        (llama3_blend_everywhere, "you blended as if they lay between the thresholds"),
        (llama3_short_threshold_times_2pi, "you kept as they are. Check the thresholds"),
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


def rope_in_x_dtype(x, positions, base):  # every step in x's own dtype (float16 angles too)
    d = x.shape[-1]
    theta = base ** (-torch.arange(0, d, 2, dtype=x.dtype) / d)
    ang = positions.to(x.dtype)[:, None] * theta
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1), torch.cat((ang.sin(), ang.sin()), -1)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat((-x2, x1), -1) * sin


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


# ----------------------------------------------------------------- 10.3 llama3_rope_frequencies


def llama3_hf_style(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len):
    # Hugging Face's _compute_llama3_parameters, in the input's dtype.
    low_freq_wavelen = original_max_len / low_freq_factor
    high_freq_wavelen = original_max_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (original_max_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


def llama3_meta_loop(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len):
    # Meta's apply_scaling: a loop over the frequencies, with math and Python floats.
    new_freqs = []
    for freq in inv_freq.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < original_max_len / high_freq_factor:
            new_freqs.append(freq)
        elif wavelen > original_max_len / low_freq_factor:
            new_freqs.append(freq / factor)
        else:
            smooth = (original_max_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            new_freqs.append((1 - smooth) * freq / factor + smooth * freq)
    return torch.tensor(new_freqs, dtype=inv_freq.dtype)


def llama3_rotations_clamp(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len):
    # YaRN's form: the ramp over the number of turns in the original context, float64 inside.
    turns = original_max_len * inv_freq.double() / (2 * math.pi)
    gamma = ((turns - low_freq_factor) / (high_freq_factor - low_freq_factor)).clamp(0, 1)
    return (inv_freq.double() * (gamma + (1 - gamma) / factor)).to(inv_freq.dtype)


def llama3_masks_numpy(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len):
    import numpy as np

    f = inv_freq.numpy().astype(np.float64)
    wavelen = 2 * np.pi / f
    out = f.copy()
    low, high = wavelen > original_max_len / low_freq_factor, wavelen < original_max_len / high_freq_factor
    mid = ~low & ~high
    out[low] = f[low] / factor
    smooth = (original_max_len / wavelen[mid] - low_freq_factor) / (high_freq_factor - low_freq_factor)
    out[mid] = (1 - smooth) * f[mid] / factor + smooth * f[mid]
    return torch.from_numpy(out).to(inv_freq.dtype)


def llama3_wavelength_space(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_len):
    # Scale the wavelengths, then turn them back into frequencies.
    wavelen = 2 * math.pi / inv_freq.double()
    smooth = ((original_max_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)).clamp(0, 1)
    scale = 1 / ((1 - smooth) / factor + smooth)  # how many times longer each wavelength gets
    return (2 * math.pi / (wavelen * scale)).to(inv_freq.dtype)


RIGHT = {
    "rope": [rope_complex, rope_hf_style, rope_loops, rope_matrix, rope_in_x_dtype],
    "alibi_bias": [alibi_loops, alibi_logspace, alibi_float64_inside, alibi_ratio],
    "llama3_rope_frequencies": [llama3_hf_style, llama3_meta_loop, llama3_rotations_clamp, llama3_masks_numpy,
                                llama3_wavelength_space],
}


@pytest.mark.parametrize(("name", "wrong", "hint"), wrong_cases(WRONG))
def test_check_rejects_wrong(name, wrong, hint):
    assert_rejected(name, wrong, hint)


@pytest.mark.parametrize(("name", "right"), right_cases(RIGHT))
def test_check_accepts_right(name, right):
    assert_accepted(name, right)
