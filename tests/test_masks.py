"""Properties of the mask references (helpers/nb03_masks.py) against torch's own attention."""

import torch
import torch.nn.functional as F

from helpers import nb03_masks as masks
from helpers import reference
from helpers.checks.nb03_masks import _leak_cases, toy_attention
from helpers.nb01_qkv_shapes import scaled_dot_product_attention


def _qkv(B, H, T, d, seed=0, T_k=None, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    T_k = T if T_k is None else T_k
    return (torch.randn(B, H, T, d, generator=g, dtype=dtype), torch.randn(B, H, T_k, d, generator=g, dtype=dtype),
            torch.randn(B, H, T_k, d, generator=g, dtype=dtype))


def test_all_lists_exactly_the_graded_functions():
    assert masks.__all__ == ["causal_mask", "padding_mask", "masked_softmax", "prefix_lm_mask", "packed_causal_mask",
                             "find_mask_leaks"]
    for name in masks.__all__:
        assert getattr(reference, name) is getattr(masks, name)


def test_causal_mask_matches_sdpa_is_causal():
    q, k, v = _qkv(2, 3, 7, 5)
    ours = scaled_dot_product_attention(q, k, v, masks.causal_mask(7))
    torch.testing.assert_close(ours, F.scaled_dot_product_attention(q, k, v, is_causal=True))
    torch.testing.assert_close(ours, F.scaled_dot_product_attention(q, k, v, attn_mask=masks.causal_mask(7)))


def test_padding_mask_shape_and_sdpa():
    lengths = torch.tensor([3, 7, 1])
    m = masks.padding_mask(lengths, 7)
    assert m.shape == (3, 1, 1, 7) and m.dtype == torch.bool
    assert m.sum(-1).flatten().tolist() == lengths.tolist()
    q, k, v = _qkv(3, 2, 7, 4, seed=1)
    additive = torch.zeros(m.shape, dtype=q.dtype).masked_fill(~m, float("-inf"))
    ours = scaled_dot_product_attention(q, k, v, m)
    torch.testing.assert_close(ours, F.scaled_dot_product_attention(q, k, v, attn_mask=m))
    torch.testing.assert_close(ours, F.scaled_dot_product_attention(q, k, v, attn_mask=additive))


def test_masked_softmax_rows_are_distributions_or_zero():
    g = torch.Generator().manual_seed(2)
    s = torch.randn(4, 5, 6, generator=g) * 1e4
    a = torch.rand(5, 6, generator=g) < 0.4
    a[1] = False
    p = masks.masked_softmax(s, a)
    assert torch.isfinite(p).all()
    sums = p.sum(-1)
    torch.testing.assert_close(sums, a.any(-1).float().expand_as(sums))
    assert (p[..., ~a] == 0).all()


def test_masked_softmax_gradient_is_finite_on_empty_rows():
    s = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    a = torch.tensor([[True, True, False, False], [False] * 4, [True] * 4])
    masks.masked_softmax(s, a).pow(2).sum().backward()
    assert torch.isfinite(s.grad).all() and (s.grad[1] == 0).all()


def test_prefix_lm_mask_edges():
    for T in (1, 4, 7):
        assert torch.equal(masks.prefix_lm_mask(T, 0), masks.causal_mask(T))
        assert torch.equal(masks.prefix_lm_mask(T, 1), masks.causal_mask(T))
        assert masks.prefix_lm_mask(T, T).all()
    m = masks.prefix_lm_mask(7, 3)
    assert m[:3, :3].all() and not m[:3, 3:].any() and torch.equal(m[3:], masks.causal_mask(7)[3:])


def test_packed_mask_equals_separate_sequences():
    seq_lens = [3, 1, 4, 2]
    N = sum(seq_lens)
    q, k, v = _qkv(1, 2, N, 4, seed=3)
    packed = scaled_dot_product_attention(q, k, v, masks.packed_causal_mask(seq_lens))
    separate = [F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
                for qs, ks, vs in zip(*(t.split(seq_lens, dim=2) for t in (q, k, v)))]
    torch.testing.assert_close(packed, torch.cat(separate, dim=2))


def test_sliding_window_mask():
    T = 9
    assert torch.equal(masks.sliding_window_mask(T, T), masks.causal_mask(T))
    assert torch.equal(masks.sliding_window_mask(T, 1), torch.eye(T, dtype=torch.bool))
    assert masks.sliding_window_mask(T, 3).sum(-1).tolist() == [min(i + 1, 3) for i in range(T)]


def test_find_mask_leaks_on_torch_attention():
    T, D = 6, 8
    allowed = masks.causal_mask(T)
    mha = torch.nn.MultiheadAttention(D, 2, batch_first=True, dtype=torch.float64)

    def correct(x):
        return mha(x, x, x, attn_mask=~allowed, need_weights=False)[0]  # nn.MultiheadAttention: True = blocked

    def inverted(x):
        return mha(x, x, x, attn_mask=allowed, need_weights=False)[0]  # the polarity mistake

    with torch.no_grad():
        assert masks.find_mask_leaks(correct, allowed, D) == []
        leaks = masks.find_mask_leaks(inverted, allowed, D)
    assert leaks == [(i, j) for i in range(T) for j in range(T) if j > i]


def test_leak_cases_of_the_check():
    """The attention_fns the check of 3.6 uses leak exactly where they are designed to."""
    found = {name: masks.find_mask_leaks(fn, allowed, d) for name, fn, allowed, d, _, _ in _leak_cases()}
    assert found["a leak-free causal attention"] == []
    assert found["a leak-free attention with float round-off"] == []
    assert found["an off-by-one causal mask"] == [(i, i + 1) for i in range(5)]
    assert found["an attention that ignores padding"] == [(i, j) for i in range(5, 8) for j in range(5, i + 1)]
    tool = found["a tool block hidden after the softmax, plus an off-by-one causal mask"]
    assert tool == sorted([(i, i + 1) for i in range(8)] + [(i, j) for i in range(5, 9) for j in range(2, 5)])
    assert found["two correctly masked layers"] == [(i, j) for i in range(6, 9) for j in (2, 3)]


def test_find_mask_leaks_sees_denominator_leaks_with_zero_weights():
    """Softmax over all keys, then future weights zeroed (no renormalisation): the weight on every
    future key is exactly 0, yet every future key moves the output through the denominator."""
    T, D = 5, 6
    allowed = masks.causal_mask(T)
    fn = toy_attention(torch.ones(T, T, dtype=torch.bool), D, seed=0, zero_after_softmax=allowed)
    assert masks.find_mask_leaks(fn, allowed, D) == [(i, j) for i in range(T) for j in range(i + 1, T)]
