"""Notebook 11 (trained_transformer): the reference code of helpers.nb11_trained_transformer
(SwiGLU, the LM loss, induction scores, the tiny transformer, its training loop and hooks, its
circuits: composition scores and direct logit attribution), and the checks of exercises 11.1-11.4: learner-style wrong implementations each check must reject with its
hint (WRONG) and correct ones in other styles than the reference it must accept (RIGHT)."""

import math

import pytest
import torch
import torch.nn.functional as F

from helpers import nb11_trained_transformer as model
from helpers.nb01_qkv_shapes import merge_heads, qkv_projection, scaled_dot_product_attention
from helpers.nb03_masks import causal_mask, find_mask_leaks
from helpers.nb06_kv_sharing import grouped_query_attention
from helpers.nb10_positions import rope, rope_attention, rope_cos_sin
from tests.exercise_cases import assert_accepted, assert_rejected, right_cases, wrong_cases

# =============================================================== lesson: helpers.nb11_trained_transformer


def gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.fixture(autouse=True)
def _one_thread():
    # Small tensors: threads only add overhead (and contend on a shared 2-core machine).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ----------------------------------------------------------------- graded pieces


def test_swiglu_matches_linear_layers_and_keeps_dtype():
    g = gen(0)
    x = torch.randn(2, 3, 8, generator=g, dtype=torch.float64)
    lin = [torch.nn.Linear(8, 24, bias=False).double(), torch.nn.Linear(8, 24, bias=False).double(),
           torch.nn.Linear(24, 8, bias=False).double()]
    with torch.no_grad():
        expected = lin[2](F.silu(lin[0](x)) * lin[1](x))
        got = model.swiglu(x, lin[0].weight.T, lin[1].weight.T, lin[2].weight.T)
    torch.testing.assert_close(got, expected)
    assert got.dtype == torch.float64


@pytest.mark.parametrize("D, F_expected", [(4096, 11008), (5120, 13824), (6656, 17920), (8192, 22016)])
def test_mlp_width_is_llamas(D, F_expected):
    assert model.mlp_width(D) == F_expected
    assert 1.0 < 3 * D * F_expected / (8 * D * D) < 1.013


def test_causal_lm_loss_is_the_mean_over_positions_and_ignores_padding():
    g = gen(1)
    logits = torch.randn(3, 4, 5, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(5, (3, 4), generator=g)
    loss = model.causal_lm_loss(logits, targets)
    manual = -torch.log_softmax(logits, -1).gather(-1, targets[..., None]).mean()
    torch.testing.assert_close(loss, manual)
    assert loss.dim() == 0 and loss.requires_grad
    uniform = model.causal_lm_loss(torch.zeros(2, 3, 7), torch.zeros(2, 3, dtype=torch.long))
    assert math.isclose(uniform.item(), math.log(7), rel_tol=1e-6)
    padded = targets.clone()
    padded[0, 2:] = -100
    keep = padded != -100
    per = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    torch.testing.assert_close(model.causal_lm_loss(logits, padded), per[keep].mean())


def test_induction_scores_on_planted_heads():
    T, m = 12, 6
    attn = torch.zeros(2, 3, T, T)
    for i in range(T):
        attn[0, 0, i, i - m + 1 if i >= m else 0] = 1.0
        attn[0, 1, i, max(i - 1, 0)] = 1.0
        attn[0, 2, i, i - m if i >= m else 0] = 1.0
        attn[1, :, i, : i + 1] = 1.0 / (i + 1)
    s = model.induction_scores(attn)
    assert s.shape == (2, 3)
    assert s[0].tolist() == [1.0, 0.0, 0.0]
    expected_uniform = sum(1 / (i + 1) for i in range(m, T)) / m
    assert torch.allclose(s[1], torch.full((3,), expected_uniform))
    assert model.previous_token_scores(attn)[0, 1] == 1.0
    with pytest.raises(ValueError, match="even"):
        model.induction_scores(torch.zeros(1, 1, 5, 5))


# ----------------------------------------------------------------- data and model


def test_repeated_sequences():
    x = model.repeated_sequences(50, 7, 16, gen(2))
    assert x.shape == (50, 14) and x.dtype == torch.long
    assert torch.equal(x[:, :7], x[:, 7:])
    assert all(len(set(row[:7].tolist())) == 7 for row in x)  # distinct tokens in the first half
    with pytest.raises(ValueError, match="m <= vocab"):
        model.repeated_sequences(1, 17, 16, gen(0))


def _tiny(n_kv_heads=None, d_ff=0, seed=0):
    cfg = model.TinyConfig(vocab=11, d_model=24, n_layers=2, n_heads=4, n_kv_heads=n_kv_heads, d_ff=d_ff)
    return model.TinyTransformer(cfg, generator=gen(seed)).double()


def test_attention_block_is_rope_attention_for_mha():
    m = _tiny()
    layer = m.layers[0]
    x = torch.randn(2, 7, 24, generator=gen(3), dtype=torch.float64)
    cos, sin = rope_cos_sin(torch.arange(7), 6, 10000.0, torch.float64)
    y, w = model.attention_block(x, layer.w_qkv, layer.w_o, 4, 4, cos, sin, causal_mask(7))
    torch.testing.assert_close(y, rope_attention(x, layer.w_qkv, layer.w_o, 4))
    assert w.shape == (2, 4, 7, 7)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 7, dtype=torch.float64))
    assert (w.masked_select(~causal_mask(7)) == 0).all()


def test_attention_block_with_gqa_is_grouped_query_attention_on_rotated_q_and_k():
    m = _tiny(n_kv_heads=2)
    layer = m.layers[1]
    x = torch.randn(2, 6, 24, generator=gen(4), dtype=torch.float64)
    pos = torch.arange(6)
    cos, sin = rope_cos_sin(pos, 6, 10000.0, torch.float64)
    y, _ = model.attention_block(x, layer.w_qkv, layer.w_o, 4, 2, cos, sin, causal_mask(6))
    q, k, v = (x @ layer.w_qkv).split([24, 12, 12], dim=-1)
    q = q.view(2, 6, 4, 6).transpose(1, 2)
    k, v = (t.view(2, 6, 2, 6).transpose(1, 2) for t in (k, v))
    o = grouped_query_attention(rope(q, pos), rope(k, pos), v, causal=True)
    torch.testing.assert_close(y, merge_heads(o) @ layer.w_o)


def test_head_ablation_zeroes_that_heads_output():
    m = _tiny()
    layer = m.layers[0]
    x = torch.randn(1, 5, 24, generator=gen(5), dtype=torch.float64)
    zeros = torch.zeros(5, 6, dtype=torch.float64)
    ones = torch.ones(5, 6, dtype=torch.float64)  # RoPE at position 0 everywhere: no rotation
    keep = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    y, _ = model.attention_block(x, layer.w_qkv, layer.w_o, 4, 4, ones, zeros, causal_mask(5), keep)
    q, k, v = qkv_projection(x, layer.w_qkv, 4)
    heads = scaled_dot_product_attention(q, k, v, causal_mask(5))
    heads[:, 1] = 0
    torch.testing.assert_close(y, merge_heads(heads) @ layer.w_o)
    try:
        from helpers.nb05_multihead import ablate_head
    except ImportError:
        return
    torch.testing.assert_close(y, ablate_head(x, layer.w_qkv, layer.w_o, 4, 1, True))


@pytest.mark.parametrize("kw", [{}, {"n_kv_heads": 2}, {"n_kv_heads": 1, "d_ff": 16}])
def test_model_is_causal_records_and_ablates(kw):
    m = _tiny(**kw)
    tokens = model.repeated_sequences(3, 5, 11, gen(6))
    rec = []
    with torch.no_grad():
        logits = m(tokens, record=rec)
        other = tokens.clone()
        other[:, 6:] = (other[:, 6:] + 1) % 11
        logits_other = m(other)
    assert logits.shape == (3, 10, 11) and len(rec) == 2 and rec[0].shape == (3, 4, 10, 10)
    assert torch.equal(logits[:, :6], logits_other[:, :6]) and not torch.equal(logits, logits_other)
    assert find_mask_leaks(lambda x: m.from_embeddings(x), causal_mask(10), 24) == []
    leaky = torch.ones(10, 10, dtype=torch.bool).tril(diagonal=1)
    leaks = find_mask_leaks(lambda x: m.from_embeddings(x, allowed=leaky), causal_mask(10), 24)
    assert {j - i for i, j in leaks} == {1, 2}  # one token per layer, two layers
    with torch.no_grad():
        all_heads_off = m(tokens, ablate=[(0, h) for h in range(4)])
        layer_0_w_o = m.layers[0].w_o.clone()
        m.layers[0].w_o.zero_()
        no_w_o = m(tokens)
        m.layers[0].w_o.copy_(layer_0_w_o)
    torch.testing.assert_close(all_heads_off, no_w_o)


def test_repeat_chance_is_the_posterior_of_a_repeat():
    lo, hi, m = 4, 10, 8
    got = model.repeat_chance(m, (lo, hi))
    for t in range(m - 1):  # t + 1 distinct tokens seen: m is uniform over the lengths >= t + 1
        possible = [n for n in range(lo, hi + 1) if n >= t + 1]
        assert math.isclose(got[t].item(), (t + 1 in possible) / len(possible))
    with pytest.raises(ValueError, match="outside"):
        model.repeat_chance(11, (lo, hi))


def test_first_half_floor_is_the_bayes_optimal_loss():
    V, m, m_range = 5, 3, (2, 3)
    torch.testing.assert_close(model.first_half_floor(V, m),
                               torch.log(torch.tensor([4.0, 3.0], dtype=torch.float64)))
    # Enumerate the training distribution: m' uniform over m_range, then m' distinct tokens.
    from itertools import permutations

    train_set = [(first + first, 1 / len(firsts))  # (sequence, probability given its length)
                 for n in range(m_range[0], m_range[1] + 1) for firsts in [list(permutations(range(V), n))]
                 for first in firsts]

    def predictive(prefix):  # p(next token | prefix) under the training distribution
        p = torch.zeros(V, dtype=torch.float64)
        for seq, prob in train_set:
            if seq[:len(prefix)] == prefix:
                p[seq[len(prefix)]] += prob
        return p / p.sum()

    losses = torch.zeros(m - 1, dtype=torch.float64)
    evals = list(permutations(range(V), m))
    for first in evals:  # the evaluation set: m fixed
        for t in range(m - 1):
            losses[t] -= predictive(first[:t + 1])[first[t + 1]].log() / len(evals)
    torch.testing.assert_close(model.first_half_floor(V, m, m_range), losses)


def test_seen_token_mass():
    tokens = torch.tensor([[2, 0, 2]])
    probs = torch.tensor([[[0.1, 0.2, 0.3, 0.4], [0.5, 0.1, 0.2, 0.2], [0.25, 0.25, 0.25, 0.25]]])
    torch.testing.assert_close(model.seen_token_mass(probs, tokens), torch.tensor([[0.3, 0.7, 0.5]]))


def test_attention_block_reads_keys_and_values_from_their_own_inputs():
    m = _tiny(n_kv_heads=2)
    layer = m.layers[0]
    x, other = torch.randn(2, 2, 6, 24, generator=gen(9), dtype=torch.float64)
    cos, sin = rope_cos_sin(torch.arange(6), 6, 10000.0, torch.float64)
    args = (layer.w_qkv, layer.w_o, 4, 2, cos, sin, causal_mask(6))
    y, w = model.attention_block(x, *args)
    y_same, w_same = model.attention_block(x, *args, x_k=x, x_v=x)
    torch.testing.assert_close((y_same, w_same), (y, w))
    y_v, w_v = model.attention_block(x, *args, x_v=other)  # other values: same weights, other output
    torch.testing.assert_close(w_v, w)
    assert not torch.allclose(y_v, y)
    _, w_k = model.attention_block(x, *args, x_k=other)  # other keys: other weights
    assert not torch.allclose(w_k, w)


@pytest.mark.parametrize("kw", [{}, {"n_kv_heads": 2}])
def test_path_ablation(kw):
    m = _tiny(**kw)
    tokens = model.repeated_sequences(3, 5, 11, gen(10))
    with torch.no_grad():
        rec, rec_ablated, rec_qk = [], [], []
        logits = m(tokens, record=rec)
        m(tokens, record=rec_ablated, ablate=[(0, 1)])
        qk = m(tokens, record=rec_qk, paths=[("q", 0, 1), ("k", 0, 1)])
        # no later layer reads the last layer: cutting its paths changes nothing
        assert torch.equal(m(tokens, paths=[(kind, 1, h) for kind in "qkv" for h in range(4)]), logits)
        assert torch.equal(m(tokens, paths=()), logits)
    # layer 2's weights depend on its queries and keys only: cutting both = ablating the head for them
    torch.testing.assert_close(rec_qk[1], rec_ablated[1])
    torch.testing.assert_close(rec_qk[0], rec[0])
    assert not torch.allclose(qk, logits)
    # the values' path, by hand: layer 2's values come from the stream without head 1 of layer 0
    L0, L1 = m.layers
    cos, sin = rope_cos_sin(torch.arange(10), 6, 10000.0, torch.float64)
    H_kv = m.cfg.kv_heads
    norm = torch.nn.functional.rms_norm
    with torch.no_grad():
        x = m.embed[tokens]
        args0 = (L0.w_qkv, L0.w_o, 4, H_kv, cos, sin, causal_mask(10))
        y0, _ = model.attention_block(norm(x, (24,), L0.attn_norm), *args0)
        y0_head1, _ = model.attention_block(norm(x, (24,), L0.attn_norm), *args0,
                                            torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=torch.float64))
        x1 = x + y0
        y1, _ = model.attention_block(norm(x1, (24,), L1.attn_norm), L1.w_qkv, L1.w_o, 4, H_kv, cos, sin,
                                      causal_mask(10), x_v=norm(x1 - y0_head1, (24,), L1.attn_norm))
        expected = norm(x1 + y1, (24,), m.final_norm) @ m.unembed
        torch.testing.assert_close(m(tokens, paths=[("v", 0, 1)]), expected)
        # the queries' path alone: the keys still read the whole stream
        _, w_q = model.attention_block(norm(x1 - y0_head1, (24,), L1.attn_norm), L1.w_qkv, L1.w_o, 4, H_kv,
                                       cos, sin, causal_mask(10), x_k=norm(x1, (24,), L1.attn_norm),
                                       x_v=norm(x1, (24,), L1.attn_norm))
        rec_q = []
        m(tokens, record=rec_q, paths=[("q", 0, 1)])
        torch.testing.assert_close(rec_q[1], w_q)
    with pytest.raises(ValueError, match="path kinds"):
        m(tokens, paths=[("o", 0, 1)])


# ----------------------------------------------------------------- circuits


def test_k_composition_score_on_planted_circuits():
    g = gen(20)
    u, v, w, z = torch.randn(4, 6, 1, generator=g, dtype=torch.float64)
    z = z - (z.T @ v) / (v.T @ v) * v  # orthogonal to v
    w_qk = u @ v.T  # the keys read direction v
    assert math.isclose(model.k_composition_score(w_qk, w @ v.T), 1.0)  # the head writes along v
    assert abs(model.k_composition_score(w_qk, w @ z.T)) < 1e-12  # it writes orthogonally to v
    assert math.isclose(model.k_composition_score(torch.eye(9), torch.eye(9)), 1 / 3, rel_tol=1e-6)
    a, b = torch.randn(2, 5, 5, generator=g, dtype=torch.float64)
    score = model.k_composition_score(a, b)
    assert type(score) is float and 0 < score < 1
    assert math.isclose(model.k_composition_score(7 * a, b / 3), score)  # scale-free
    assert math.isclose(model.k_composition_score(a, b), model.composition_score(b, a.T).item())


@pytest.mark.parametrize(("w_qk", "w_ov", "message"), [
    (torch.zeros(4, 5), torch.zeros(4, 4), r"w_qk must be a square \[D, D\] tensor, got shape \[4, 5\]"),
    (torch.zeros(4, 4), torch.zeros(2, 4, 4), r"w_ov must be a square .* got shape \[2, 4, 4\]"),
    (torch.zeros(4, 4), torch.zeros(3, 3), r"the same shape \[D, D\], got \[4, 4\] and \[3, 3\]"),
    ([[1.0]], torch.zeros(1, 1), r"w_qk must be a square .* got a list"),
])
def test_k_composition_score_rejects_bad_input(w_qk, w_ov, message):
    with pytest.raises(ValueError, match=message):
        model.k_composition_score(w_qk, w_ov)


def _scores_by_hand(m, layer, x):
    """x [B, T, D] -> layer's pre-softmax scores times sqrt(d_k) [B, H, T, T], from the model's own parts."""
    lay, cfg = m.layers[layer], m.cfg
    T = x.shape[1]
    h = F.rms_norm(x, (cfg.d_model,), lay.attn_norm)
    sizes = [cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim]
    q, k, _ = (h @ lay.w_qkv).split(sizes, dim=-1)
    q = rope(q.view(*x.shape[:2], cfg.n_heads, -1).transpose(1, 2), torch.arange(T))
    k = rope(k.view(*x.shape[:2], cfg.kv_heads, -1).transpose(1, 2), torch.arange(T))
    k = k.repeat_interleave(cfg.n_heads // cfg.kv_heads, dim=1)
    return q @ k.transpose(-1, -2)


@pytest.mark.parametrize("kw", [{}, {"n_kv_heads": 2}])
def test_circuit_matrices_give_the_models_scores(kw):
    m = _tiny(**kw)
    with torch.no_grad():
        m.layers[1].attn_norm.copy_(torch.rand(24, generator=gen(21), dtype=torch.float64) + 0.5)
        x = torch.randn(2, 7, 24, generator=gen(22), dtype=torch.float64)
        scores = _scores_by_hand(m, 1, x)
    unit = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + torch.finfo(x.dtype).eps)  # the norm, no scale
    for offset in (0, 3):
        w_qk, w_ov = model.circuit_matrices(m, 1, offset)
        assert w_qk.shape == w_ov.shape == (4, 24, 24)
        i = torch.arange(offset, 7)
        by_matrix = torch.einsum("bid,hde,bie->bhi", unit[:, i], w_qk, unit[:, i - offset])
        torch.testing.assert_close(by_matrix, scores[:, :, i, i - offset])
    # w_ov: what head h writes when it attends to one position only is x_normed @ w_ov
    _, w_ov = model.circuit_matrices(m, 1)
    lay = m.layers[1]
    w_v = lay.w_qkv[:, 24 + 6 * m.cfg.kv_heads:]
    head = 3
    kv = head // (4 // m.cfg.kv_heads)
    expected = lay.attn_norm[:, None] * w_v[:, 6 * kv:6 * kv + 6] @ lay.w_o[6 * head:6 * head + 6]
    torch.testing.assert_close(w_ov[head], expected.detach())


def test_rope_rotation_is_relative():
    q, k = torch.randn(2, 1, 8, generator=gen(23), dtype=torch.float64)
    for i, j in [(5, 5), (9, 2), (4, 0)]:
        rotated = rope(q, torch.tensor([i])) @ rope(k, torch.tensor([j])).T
        torch.testing.assert_close(rotated, q @ model.rope_rotation(i - j, 8, dtype=torch.float64) @ k.T)
    torch.testing.assert_close(model.rope_rotation(0, 8, dtype=torch.float64), torch.eye(8, dtype=torch.float64))


def test_composition_scores_are_the_pairwise_scores():
    m = _tiny(n_kv_heads=2)
    scores = model.composition_scores(m, offsets=(0, 2))
    w_qk = [model.circuit_matrices(m, 1, o)[0] for o in (0, 2)]
    _, w_ov = model.circuit_matrices(m, 0)
    _, w_ov_1 = model.circuit_matrices(m, 1)
    for i in range(4):
        for j in range(4):
            k = sum(model.k_composition_score(w[j], w_ov[i]) for w in w_qk) / 2
            q = sum(model.composition_score(w_ov[i], w[j]).item() for w in w_qk) / 2
            assert math.isclose(scores["k"][i, j].item(), k, rel_tol=1e-9)
            assert math.isclose(scores["q"][i, j].item(), q, rel_tol=1e-9)
            assert math.isclose(scores["v"][i, j].item(), model.composition_score(w_ov[i], w_ov_1[j]).item(),
                                rel_tol=1e-9)


def test_random_composition_scores():
    a = model.random_composition_scores(16, 4, 50, gen(24))
    assert a.shape == (50,) and ((a > 0) & (a < 1)).all()
    torch.testing.assert_close(a, model.random_composition_scores(16, 4, 50, gen(24)))


def test_record_heads_sum_to_the_layers_output_and_respect_ablation():
    m = _tiny(n_kv_heads=2)
    tokens = model.repeated_sequences(2, 4, 11, gen(25))
    heads, heads_ablated = [], []
    with torch.no_grad():
        m(tokens, record_heads=heads)
        m(tokens, record_heads=heads_ablated, ablate=[(1, 2)])
        x = m.embed[tokens]
        y0 = heads[0].sum(dim=1)
        cos, sin = rope_cos_sin(torch.arange(8), 6, 10000.0, torch.float64)
        L0 = m.layers[0]
        expected, _ = model.attention_block(F.rms_norm(x, (24,), L0.attn_norm), L0.w_qkv, L0.w_o, 4, 2, cos, sin,
                                            causal_mask(8))
    assert len(heads) == 2 and heads[0].shape == (2, 4, 8, 24)
    torch.testing.assert_close(y0, expected)
    assert (heads_ablated[1][:, 2] == 0).all() and torch.equal(heads_ablated[0], heads[0])
    final = F.rms_norm(x + heads[0].sum(1) + heads[1].sum(1), (24,), m.final_norm) @ m.unembed
    torch.testing.assert_close(final, m(tokens).detach())


def test_direct_logit_attribution_adds_up_to_the_centred_logit():
    m = _tiny(n_kv_heads=2)
    with torch.no_grad():
        m.final_norm.copy_(torch.rand(24, generator=gen(26), dtype=torch.float64) + 0.5)
    tokens = model.repeated_sequences(3, 5, 11, gen(27))
    embedding, heads = model.direct_logit_attribution(m, tokens)
    assert embedding.shape == (3, 9) and heads.shape == (2, 4, 3, 9)
    with torch.no_grad():
        logits = m(tokens)[:, :-1]
    centred = logits.gather(-1, tokens[:, 1:, None])[..., 0] - logits.mean(-1)
    torch.testing.assert_close(embedding + heads.sum(dim=(0, 1)), centred)
    with pytest.raises(ValueError, match="attention-only"):
        model.direct_logit_attribution(_tiny(d_ff=8), tokens)


def test_model_rejects_bad_sizes():
    with pytest.raises(ValueError, match="divisible|n_kv_heads"):
        model.TinyTransformer(model.TinyConfig(d_model=24, n_heads=4, n_kv_heads=3))


def test_training_is_reproducible_and_lowers_the_loss():
    def run():
        m = model.TinyTransformer(model.TinyConfig(vocab=8, d_model=16, n_heads=2), generator=gen(7))
        ev = model.repeated_sequences(16, 4, 8, gen(8))
        return model.train(m, steps=30, batch=8, m_range=(3, 5), lr=1e-2, seed=7, eval_tokens=ev, eval_every=10)

    a, b = run(), run()
    assert a == b
    assert a["eval_step"] == [0, 10, 20, 30] and len(a["loss"]) == 30
    assert a["eval_all"][-1] < a["eval_all"][0]


# =============================================================== checks of 11.1-11.4


# --------------------------------------------------------------- wrong implementations


# ----------------------------------------------------------------- 11.1 swiglu


def swiglu_gelu(x, w_gate, w_up, w_down):
    return (F.gelu(x @ w_gate) * (x @ w_up)) @ w_down


def swiglu_gelu_tanh(x, w_gate, w_up, w_down):
    return (F.gelu(x @ w_gate, approximate="tanh") * (x @ w_up)) @ w_down


def swiglu_sigmoid(x, w_gate, w_up, w_down):
    return (torch.sigmoid(x @ w_gate) * (x @ w_up)) @ w_down


def swiglu_relu(x, w_gate, w_up, w_down):
    return (torch.relu(x @ w_gate) * (x @ w_up)) @ w_down


def swiglu_wrong_branch(x, w_gate, w_up, w_down):
    return ((x @ w_gate) * F.silu(x @ w_up)) @ w_down


def swiglu_on_product(x, w_gate, w_up, w_down):
    return F.silu((x @ w_gate) * (x @ w_up)) @ w_down


def swiglu_both_branches(x, w_gate, w_up, w_down):
    return (F.silu(x @ w_gate) * F.silu(x @ w_up)) @ w_down


def swiglu_added(x, w_gate, w_up, w_down):
    return (F.silu(x @ w_gate) + x @ w_up) @ w_down


def swiglu_no_down(x, w_gate, w_up, w_down):
    return F.silu(x @ w_gate) * (x @ w_up)


def swiglu_transposed_down(x, w_gate, w_up, w_down):
    return (F.silu(x @ w_gate) * (x @ w_up)) @ w_down.T


# ----------------------------------------------------------------- 11.2 causal_lm_loss


def _flat(logits, targets):
    return logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)


def loss_sum(logits, targets):
    return F.cross_entropy(*_flat(logits, targets), reduction="sum")


def loss_mean_of_sequence_sums(logits, targets):
    per = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")  # [B, T]
    return per.sum(dim=1).mean()


def loss_shifted_again(logits, targets):
    # "next-token prediction": shifts a second time, although targets are already the next tokens.
    return F.cross_entropy(*_flat(logits[:, :-1], targets[:, 1:]))


def loss_nll_of_probabilities(logits, targets):
    probs = torch.softmax(logits, dim=-1)
    return F.nll_loss(*_flat(probs, targets))


def loss_nll_of_logits(logits, targets):
    return F.nll_loss(*_flat(logits, targets))


def loss_softmax_then_ce(logits, targets):
    return F.cross_entropy(*_flat(torch.softmax(logits, -1), targets))


def loss_bits(logits, targets):
    logp = torch.log_softmax(logits, -1)
    return -(logp.gather(-1, targets[..., None]) / math.log(2)).mean()


def loss_per_position(logits, targets):
    return F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")


def loss_classes_on_wrong_axis(logits, targets):
    return F.cross_entropy(logits, targets)  # classes are expected on axis 1


def loss_item(logits, targets):
    return F.cross_entropy(*_flat(logits, targets)).item()


def loss_rebuilt_from_numbers(logits, targets):
    # A loop over Python floats: right value, but no gradient reaches the logits.
    B, T, V = logits.shape
    total = 0.0
    for b in range(B):
        for t in range(T):
            row = logits[b, t].tolist()
            top = max(row)
            lse = top + math.log(sum(math.exp(v - top) for v in row))
            total += lse - row[int(targets[b, t])]
    return torch.tensor(total / (B * T), dtype=logits.dtype)


# ----------------------------------------------------------------- 11.3 induction_scores


def induction_duplicate_token(attn):
    T = attn.shape[-1]
    m = T // 2
    i = torch.arange(m, T)
    return attn[..., i, i - m].mean(-1)


def induction_previous_token(attn):
    T = attn.shape[-1]
    i = torch.arange(T // 2, T)
    return attn[..., i, i - 1].mean(-1)


def induction_all_queries(attn):
    m = attn.shape[-1] // 2
    return attn.diagonal(offset=-(m - 1), dim1=-2, dim2=-1).mean(-1)


def induction_all_queries_padded(attn):
    T = attn.shape[-1]
    m = T // 2
    scores = torch.zeros(attn.shape[:2], dtype=attn.dtype)
    for i in range(T):
        j = i - m + 1
        if j >= 0:
            scores += attn[..., i, j]
    return scores / T


def induction_sum(attn):
    T = attn.shape[-1]
    m = T // 2
    i = torch.arange(m, T)
    return attn[..., i, i - m + 1].sum(-1)


def induction_transposed(attn):
    T = attn.shape[-1]
    m = T // 2
    i = torch.arange(m, T)
    return attn[..., i - m + 1, i].mean(-1)


def induction_one_number(attn):
    T = attn.shape[-1]
    m = T // 2
    i = torch.arange(m, T)
    return attn[..., i, i - m + 1].mean()


def induction_float32_loop(attn):
    L, H, T, _ = attn.shape
    m = T // 2
    out = torch.zeros(L, H)  # float32 whatever attn's dtype
    for layer in range(L):
        for head in range(H):
            out[layer, head] = sum(attn[layer, head, i, i - m + 1] for i in range(m, T)) / m
    return out


def swiglu_mish(x, w_gate, w_up, w_down):
    gate = x @ w_gate
    return (gate * torch.tanh(torch.nn.functional.softplus(gate)) * (x @ w_up)) @ w_down


def swiglu_swish_beta_2(x, w_gate, w_up, w_down):
    gate = x @ w_gate
    return (gate * torch.sigmoid(2 * gate) * (x @ w_up)) @ w_down


def loss_label_smoothing(logits, targets):
    V = logits.shape[-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, V), targets.reshape(-1), label_smoothing=0.1)


def induction_two_after(attn):
    T = attn.shape[-1]
    m = T // 2
    i = torch.arange(m, T)
    return attn[..., i, i - m + 2].mean(-1)  # two after the previous occurrence


# ----------------------------------------------------------------- 11.4 k_composition_score


def kcomp_q_composition(w_qk, w_ov):
    fro = torch.linalg.matrix_norm
    return (fro(w_ov @ w_qk) / (fro(w_qk) * fro(w_ov))).item()


def kcomp_no_transpose(w_qk, w_ov):
    return ((w_qk @ w_ov).norm() / (w_qk.norm() * w_ov.norm())).item()


def kcomp_column_vector_formula(w_qk, w_ov):
    # W_QK^T W_OV copied from a paper written for column vectors
    return (torch.linalg.norm(w_qk.T @ w_ov) / (torch.linalg.norm(w_qk) * torch.linalg.norm(w_ov))).item()


def kcomp_not_normalised(w_qk, w_ov):
    return torch.linalg.matrix_norm(w_qk @ w_ov.T).item()


def kcomp_divided_by_w_qk_only(w_qk, w_ov):
    return ((w_qk @ w_ov.T).norm() / w_qk.norm()).item()


def kcomp_squared_norms(w_qk, w_ov):
    num = (w_qk @ w_ov.T).norm()
    return (num / (w_qk.norm() ** 2 * w_ov.norm() ** 2)).item()


def kcomp_sum_of_squares(w_qk, w_ov):
    sq = lambda m: (m ** 2).sum()  # noqa: E731 - the square root forgotten
    return (sq(w_qk @ w_ov.T) / (sq(w_qk) * sq(w_ov))).item()


def kcomp_spectral(w_qk, w_ov):
    n = lambda m: torch.linalg.matrix_norm(m, ord=2)  # noqa: E731
    return (n(w_qk @ w_ov.T) / (n(w_qk) * n(w_ov))).item()


def kcomp_spectral_denominator(w_qk, w_ov):
    s_qk, s_ov = torch.linalg.svdvals(w_qk)[0], torch.linalg.svdvals(w_ov)[0]
    return ((w_qk @ w_ov.T).norm() / (s_qk * s_ov)).item()


def kcomp_nuclear(w_qk, w_ov):
    n = lambda m: torch.linalg.matrix_norm(m, ord="nuc")  # noqa: E731
    return (n(w_qk @ w_ov.T) / (n(w_qk) * n(w_ov))).item()


def kcomp_elementwise(w_qk, w_ov):
    return ((w_qk * w_ov.T).norm() / (w_qk.norm() * w_ov.norm())).item()


def kcomp_tensor(w_qk, w_ov):
    fro = torch.linalg.matrix_norm
    return fro(w_qk @ w_ov.T) / (fro(w_qk) * fro(w_ov))


def kcomp_row_norms(w_qk, w_ov):
    # torch.linalg.vector_norm over one axis: one norm per row, then float() of D numbers
    rows = torch.linalg.vector_norm
    return float(rows(w_qk @ w_ov.T, dim=-1) / (rows(w_qk, dim=-1) * rows(w_ov, dim=-1)))


def kcomp_returns_none(w_qk, w_ov):
    fro = torch.linalg.matrix_norm
    score = (fro(w_qk @ w_ov.T) / (fro(w_qk) * fro(w_ov))).item()  # noqa: F841 - no return


def kcomp_cosine(w_qk, w_ov):
    # the cosine of the two matrices as vectors: their inner product over their norms
    a, b = w_qk.flatten(), w_ov.flatten()
    return (torch.dot(a, b) / (a.norm() * b.norm())).abs().item()


def kcomp_sum_of_norms(w_qk, w_ov):
    return ((w_qk @ w_ov.T).norm() / (w_qk.norm() + w_ov.norm())).item()


def kcomp_abs_sum(w_qk, w_ov):
    n = lambda m: torch.linalg.vector_norm(m.flatten(), ord=1)  # noqa: E731
    return (n(w_qk @ w_ov.T) / (n(w_qk) * n(w_ov))).item()


def kcomp_over_sqrt_d(w_qk, w_ov):
    fro = torch.linalg.matrix_norm
    return (fro(w_qk @ w_ov.T) / (fro(w_qk) * fro(w_ov))).item() / math.sqrt(w_qk.shape[-1])


def kcomp_square_root(w_qk, w_ov):
    fro = torch.linalg.matrix_norm
    return math.sqrt((fro(w_qk @ w_ov.T) / (fro(w_qk) * fro(w_ov))).item())


def kcomp_column_norms(w_qk, w_ov):
    n = lambda m: torch.linalg.vector_norm(m, dim=0).amax()  # noqa: E731
    return (n(w_qk @ w_ov.T) / (n(w_qk) * n(w_ov))).item()


def kcomp_inf_norm(w_qk, w_ov):
    n = lambda m: m.abs().sum(dim=1).max()  # noqa: E731
    return (n(w_qk @ w_ov.T) / (n(w_qk) * n(w_ov))).item()


def kcomp_no_transpose_spectral(w_qk, w_ov):
    n = lambda m: torch.linalg.svdvals(m)[0]  # noqa: E731
    return (n(w_qk @ w_ov) / (n(w_qk) * n(w_ov))).item()


def kcomp_q_composition_unnormalised(w_qk, w_ov):
    return float(torch.linalg.norm(w_ov @ w_qk))


def kcomp_rms(w_qk, w_ov):
    rms = lambda m: m.pow(2).mean().sqrt()  # noqa: E731 - "the norm, per entry"
    return (rms(w_qk @ w_ov.T) / (rms(w_qk) * rms(w_ov))).item()


def kcomp_sum_of_entries(w_qk, w_ov):
    return abs(float((w_qk @ w_ov.T).sum())) / (w_qk.norm().item() * w_ov.norm().item())


def kcomp_spectral_product_only(w_qk, w_ov):
    return (torch.linalg.svdvals(w_qk @ w_ov.T).max() / (w_qk.norm() * w_ov.norm())).item()


def kcomp_via_course_helper(w_qk, w_ov):
    return model.composition_score(w_qk, w_ov.T).item()  # the notebook's batched helper


def loss_log_of_probabilities(logits, targets):  # log of softmax: inf where a probability rounds to 0
    p = F.softmax(logits, dim=-1)
    b, t = torch.meshgrid(torch.arange(logits.shape[0]), torch.arange(logits.shape[1]), indexing="ij")
    return -p[b, t, targets].log().mean()


def kcomp_precedence(w_qk, w_ov):  # a / b * c
    return torch.norm(w_qk @ w_ov.T).item() / torch.norm(w_qk).item() * torch.norm(w_ov).item()


def kcomp_sum_of_row_norms(w_qk, w_ov):
    def n(m):
        return sum(float(row.norm()) for row in m)
    return n(w_qk @ w_ov.T) / (n(w_qk) * n(w_ov))

WRONG = {
    "swiglu": [
        (swiglu_gelu, "you used GELU"),
        (swiglu_gelu_tanh, "you used GELU"),
        (swiglu_sigmoid, "original GLU"),
        (swiglu_relu, "ReGLU"),
        (swiglu_wrong_branch, "wrong branch"),
        (swiglu_on_product, "SiLU to the product"),
        (swiglu_both_branches, "both branches"),
        (swiglu_added, "you added the branches"),
        (swiglu_no_down, "down projection is missing"),
        (swiglu_transposed_down, "w_down is [F, D]"),
        (swiglu_mish, "you used Mish"),
        (swiglu_swish_beta_2, "beta = 2"),
    ],
    "causal_lm_loss": [
        (loss_sum, "you summed the losses"),
        (loss_mean_of_sequence_sums, "per-sequence sums"),
        (loss_shifted_again, "shifted the targets again"),
        (loss_nll_of_probabilities, "NLL of probabilities"),
        (loss_nll_of_logits, "nll_loss of the raw logits"),
        (loss_softmax_then_ce, "softmax before F.cross_entropy"),
        (loss_bits, "in bits"),
        (loss_per_position, "one loss per position"),
        (loss_classes_on_wrong_axis, "classes on axis 1"),
        (loss_item, "no .item()"),
        (loss_rebuilt_from_numbers, "detached from the logits"),
        (loss_label_smoothing, "label_smoothing=0.1"),
        (loss_log_of_probabilities, "softmax rounds that probability to 0 and log(0) = -inf"),
    ],
    "induction_scores": [
        (induction_duplicate_token, "key i - m, the query's previous occurrence"),
        (induction_previous_token, "key i - 1"),
        (induction_all_queries, "from query m - 1 on"),
        (induction_all_queries_padded, "over all T queries"),
        (induction_sum, "summed over the queries"),
        (induction_transposed, "rows are queries"),
        (induction_one_number, "one score per head"),
        (induction_float32_loop, "expected dtype torch.float64"),
        (induction_two_after, "key i - m + 2"),
    ],
    "k_composition_score": [
        (kcomp_via_course_helper, "write your own implementation"),
        (kcomp_q_composition, "you computed Q-composition"),
        (kcomp_no_transpose, "w_ov is missing its transpose"),
        (kcomp_column_vector_formula, "column-vector notation"),
        (kcomp_not_normalised, "you did not normalise"),
        (kcomp_divided_by_w_qk_only, "divided by ||w_qk||_F only"),
        (kcomp_squared_norms, "divided by the squared norms"),
        (kcomp_sum_of_squares, "you squared the score"),
        (kcomp_spectral, "spectral norm"),
        (kcomp_spectral_denominator, "divided by the spectral norms"),
        (kcomp_nuclear, "nuclear norm"),
        (kcomp_elementwise, "multiplied elementwise"),
        (kcomp_tensor, "return `.item()` of it"),
        (kcomp_row_norms, "Frobenius norm of the whole matrix"),
        (kcomp_returns_none, "forget the `return`"),
        (kcomp_cosine, "inner product of the two matrices"),
        (kcomp_sum_of_norms, "divided by the sum of the norms"),
        (kcomp_abs_sum, "sum of the absolute values"),
        (kcomp_over_sqrt_d, "divided the score by sqrt(D)"),
        (kcomp_square_root, "square root of the score"),
        (kcomp_column_norms, "largest column norm"),
        (kcomp_inf_norm, "ord=inf"),
        (kcomp_no_transpose_spectral, "two things differ"),
        (kcomp_no_transpose_spectral, "without w_ov's transpose"),
        (kcomp_no_transpose_spectral, "spectral norm"),
        (kcomp_q_composition_unnormalised, "your product is w_ov @ w_qk (Q-composition)"),
        (kcomp_q_composition_unnormalised, "you did not divide by the norms"),
        (kcomp_rms, "a root mean square"),
        (kcomp_sum_of_entries, "the sum of the product's entries"),
        (kcomp_spectral_product_only, "spectral norm (ord=2) of w_qk @ w_ov.T but the Frobenius norms"),
        (kcomp_precedence, "Python reads a / b * c as (a / b) * c"),
        (kcomp_sum_of_row_norms, "you summed the norms of the rows"),
    ],
}


# --------------------------------------------------------------- right variants


# ----------------------------------------------------------------- 11.1 swiglu


def swiglu_manual_sigmoid(x, w_gate, w_up, w_down):
    gate = x @ w_gate
    return ((gate * torch.sigmoid(gate)) * (x @ w_up)) @ w_down


def swiglu_einsum_float64(x, w_gate, w_up, w_down):
    xd = x.double()
    h = F.silu(torch.einsum("...d,df->...f", xd, w_gate.double())) * torch.einsum("...d,df->...f", xd, w_up.double())
    return torch.einsum("...f,fd->...d", h, w_down.double()).to(x.dtype)


def swiglu_linear(x, w_gate, w_up, w_down):
    return F.linear(F.silu(F.linear(x, w_gate.T)) * F.linear(x, w_up.T), w_down.T)


# ----------------------------------------------------------------- 11.2 causal_lm_loss


def loss_transpose(logits, targets):
    return F.cross_entropy(logits.transpose(1, 2), targets)


def loss_log_softmax_gather(logits, targets):
    logp = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    return -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1).mean()


def loss_nll_float64(logits, targets):
    B, T, V = logits.shape
    out = F.nll_loss(torch.log_softmax(logits.double(), -1).view(B * T, V), targets.view(B * T))
    return out.to(logits.dtype)


def loss_mean_of_sequence_means(logits, targets):
    # Equal to the mean over all positions when every sequence has the same length (no padding).
    per = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    return per.mean(dim=1).mean()


def loss_exp_sum_log(logits, targets):  # log of the sum of exps, minus the target's logit
    return (logits.exp().sum(-1).log() - logits.gather(-1, targets[..., None])[..., 0]).mean()


def loss_distribution(logits, targets):
    return -torch.distributions.Categorical(logits=logits).log_prob(targets).mean()


# ----------------------------------------------------------------- 11.3 induction_scores


def induction_loops(attn):
    L, H, T, _ = attn.shape
    m = T // 2
    out = torch.zeros(L, H, dtype=attn.dtype)
    for layer in range(L):
        for h in range(H):
            out[layer, h] = sum(attn[layer, h, i, i - m + 1] for i in range(m, T)) / m
    return out


def induction_diagonal(attn):
    m = attn.shape[-1] // 2
    return attn.diagonal(offset=-(m - 1), dim1=-2, dim2=-1)[..., 1:].mean(-1)  # drop query m - 1


def induction_mask_einsum(attn):
    T = attn.shape[-1]
    m = T // 2
    sel = torch.zeros(T, T, dtype=attn.dtype)
    i = torch.arange(m, T)
    sel[i, i - m + 1] = 1.0 / m
    return torch.einsum("lhij,ij->lh", attn, sel)


def induction_gather(attn):
    T = attn.shape[-1]
    m = T // 2
    q = attn[..., m:, :]  # [L, H, m, T]
    idx = (torch.arange(m, T) - m + 1).view(1, 1, m, 1).expand(*q.shape[:2], m, 1)
    return q.gather(-1, idx).squeeze(-1).mean(-1)


# ----------------------------------------------------------------- 11.4 k_composition_score


def kcomp_einsum_float64(w_qk, w_ov):
    a, b = w_qk.double(), w_ov.double()
    prod = torch.einsum("ij,kj->ik", a, b)  # w_qk @ w_ov.T
    sq = lambda m: torch.einsum("ij,ij->", m, m)  # noqa: E731
    return float(torch.sqrt(sq(prod) / (sq(a) * sq(b))))


def kcomp_loops(w_qk, w_ov):
    D = w_qk.shape[0]
    num = 0.0
    for i in range(D):
        for k in range(D):
            num += float(sum(w_qk[i, j] * w_ov[k, j] for j in range(D))) ** 2
    return math.sqrt(num) / (math.sqrt(float((w_qk ** 2).sum())) * math.sqrt(float((w_ov ** 2).sum())))


def kcomp_trace(w_qk, w_ov):
    # ||M||_F^2 = tr(M M^T); with M = w_qk w_ov^T: tr(w_qk w_ov^T w_ov w_qk^T)
    num = torch.trace(w_qk @ w_ov.T @ w_ov @ w_qk.T)
    return math.sqrt(num.item() / (torch.trace(w_qk @ w_qk.T).item() * torch.trace(w_ov.T @ w_ov).item()))


def kcomp_transposed_product(w_qk, w_ov):
    # (w_qk @ w_ov.T).T = w_ov @ w_qk.T has the same Frobenius norm (TransformerLens writes it this way)
    return (torch.norm(w_ov @ w_qk.T, p="fro") / (torch.norm(w_qk, p="fro") * torch.norm(w_ov, p="fro"))).item()


def kcomp_singular_values(w_qk, w_ov):
    fro = lambda m: torch.linalg.svdvals(m.double()).pow(2).sum().sqrt()  # noqa: E731
    return float(fro(w_qk @ w_ov.T) / (fro(w_qk) * fro(w_ov)))


def kcomp_numpy(w_qk, w_ov):
    import numpy as np

    a, b = w_qk.numpy(), w_ov.numpy()
    return np.linalg.norm(a @ b.T) / (np.linalg.norm(a) * np.linalg.norm(b))  # a NumPy float64


RIGHT = {
    "swiglu": [swiglu_manual_sigmoid, swiglu_einsum_float64, swiglu_linear],
    "causal_lm_loss": [loss_transpose, loss_log_softmax_gather, loss_nll_float64, loss_mean_of_sequence_means,
                       loss_distribution, loss_exp_sum_log],
    "induction_scores": [induction_loops, induction_diagonal, induction_mask_einsum, induction_gather],
    "k_composition_score": [kcomp_einsum_float64, kcomp_loops, kcomp_trace, kcomp_transposed_product,
                            kcomp_singular_values, kcomp_numpy],
}


def test_every_check_points_at_a_section_of_notebook_11():
    from pathlib import Path

    from helpers.checks import EXERCISES
    from helpers.tools import notebooks as nbt

    cells = nbt.read(Path(__file__).parent.parent / "notebooks" / "11_trained_transformer.ipynb").cells
    headings = {line.lstrip("#").strip() for c in cells if c.cell_type == "markdown"
                for line in c.source.splitlines() if line.startswith("#")}
    exercises = [ex for ex in EXERCISES.values() if ex.notebook == "11_trained_transformer"]
    assert len(exercises) == 4
    for ex in exercises:
        assert ex.section in headings, f"{ex.id}: section {ex.section!r} is not a heading of notebook 11"


@pytest.mark.parametrize(("name", "wrong", "hint"), wrong_cases(WRONG))
def test_check_rejects_wrong(name, wrong, hint):
    assert_rejected(name, wrong, hint)


@pytest.mark.parametrize(("name", "right"), right_cases(RIGHT))
def test_check_accepts_right(name, right):
    assert_accepted(name, right)
