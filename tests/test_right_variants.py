"""Correct solutions of exercises 1.1-4.3 written in other styles than the reference (einsum, loops,
float64 inside, SDPA, NumPy round trips, -1e9 fills where the maths allows, autograd where the
exercise allows it): every check must accept every one of them. Rejecting a right answer is the
worst thing a check can do. (Notebook 09's variants are in tests/test_flash_checks.py; more
variants of 2.1-2.3 in tests/test_scaling.py.)

Also here: the statistics behind check 2.3's test of the number of samples."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers import checks
from helpers.checks import nb02_scaling as scaling_checks

# ----------------------------------------------------------------- 1.1 qkv_projection


def qkv_einsum(x, w_qkv, n_heads):
    B, T, D = x.shape
    proj = torch.einsum("btd,de->bte", x, w_qkv)
    return tuple(p.reshape(B, T, n_heads, D // n_heads).permute(0, 2, 1, 3) for p in proj.chunk(3, dim=-1))


def qkv_per_head_loop(x, w_qkv, n_heads):
    D = x.shape[-1]
    d_k = D // n_heads
    out = []
    for part in range(3):
        heads = [x @ w_qkv[:, part * D + h * d_k: part * D + (h + 1) * d_k] for h in range(n_heads)]
        out.append(torch.stack(heads, dim=1))
    return out  # a list of three is fine


def qkv_float64_unflatten(x, w_qkv, n_heads):
    B, T, D = x.shape
    proj = (x.double() @ w_qkv.double()).to(x.dtype)
    q, k, v = proj.unflatten(-1, (3, n_heads, D // n_heads)).permute(2, 0, 3, 1, 4).unbind(0)
    return q, k, v


def qkv_linear_contiguous(x, w_qkv, n_heads):
    B, T, D = x.shape
    q, k, v = F.linear(x, w_qkv.T).split(D, dim=2)
    return tuple(t.contiguous().view(B, T, n_heads, -1).transpose(1, 2).contiguous() for t in (q, k, v))


# ----------------------------------------------------------------- 1.2 merge_heads


def merge_cat(o):
    return torch.cat(o.unbind(dim=1), dim=-1)


def merge_permute_flatten(o):
    return o.permute(0, 2, 1, 3).flatten(2)


def merge_contiguous_view(o):
    B, H, T, d_k = o.shape
    return o.transpose(1, 2).contiguous().view(B, T, -1)


def merge_einsum_loop(o):
    B, H, T, d_k = o.shape
    out = torch.empty(B, T, H * d_k, dtype=o.dtype)
    for h in range(H):
        out[:, :, h * d_k:(h + 1) * d_k] = torch.einsum("btd->btd", o[:, h])
    return out


# ----------------------------------------------------------------- 1.3 scaled_dot_product_attention


def sdpa_torch(q, k, v):
    return F.scaled_dot_product_attention(q, k, v)


def sdpa_einsum(q, k, v):
    s = torch.einsum("...qd,...kd->...qk", q, k) / q.shape[-1] ** 0.5
    return torch.einsum("...qk,...kd->...qd", s.softmax(-1), v)


def sdpa_float64_by_hand(q, k, v):
    s = q.double() @ k.double().mT / math.sqrt(q.shape[-1])
    e = torch.exp(s - s.amax(-1, keepdim=True))
    return ((e / e.sum(-1, keepdim=True)) @ v.double()).to(q.dtype)


def sdpa_query_loop(q, k, v):
    rows = [torch.softmax(q[..., i:i + 1, :] @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), -1) @ v
            for i in range(q.shape[-2])]
    return torch.cat(rows, dim=-2)


def sdpa_numpy(q, k, v):
    qn, kn, vn = q.numpy(), k.numpy(), v.numpy()
    s = qn @ np.swapaxes(kn, -1, -2) / math.sqrt(qn.shape[-1])  # a Python float keeps float32
    e = np.exp(s - s.max(-1, keepdims=True))
    return torch.from_numpy((e / e.sum(-1, keepdims=True)) @ vn)


# ----------------------------------------------------------------- 2.1 / 2.2 (more in test_scaling.py)


def scores_float64(q, k):
    return (q.double() @ k.double().transpose(-2, -1) / math.sqrt(q.shape[-1])).to(q.dtype)


def entropy_nan_to_num(p):
    return torch.nan_to_num(-(p * p.log())).sum(-1)


def entropy_log2_nansum(p):
    return -(p * torch.log2(p)).nansum(-1) * math.log(2)


def entropy_float64(p):
    return torch.special.entr(p.double()).sum(-1).to(p.dtype)


def entropy_numpy(p):
    a = p.numpy()
    return torch.from_numpy(-np.where(a > 0, a * np.log(np.where(a > 0, a, 1.0)), 0.0).sum(-1))


def entropy_finfo_tiny(p):
    return -(p * p.clamp_min(torch.finfo(p.dtype).tiny).log()).sum(-1)


# ----------------------------------------------------------------- 3.1 / 3.2 / 3.4 / 3.5 masks


def causal_arange(T):
    i = torch.arange(T)
    return i[None, :] <= i[:, None]


def causal_loops(T):
    m = torch.zeros(T, T, dtype=torch.bool)
    for i in range(T):
        m[i, : i + 1] = True
    return m


def causal_not_triu(T):
    return ~torch.ones(T, T, dtype=torch.bool).triu(1)


def padding_expand_view(lengths, T):
    B = lengths.shape[0]
    return (torch.arange(T).expand(B, T) < lengths.unsqueeze(1)).view(B, 1, 1, T)


def padding_loops(lengths, T):
    m = torch.zeros(len(lengths), 1, 1, T, dtype=torch.bool)
    for b, n in enumerate(lengths.tolist()):
        m[b, 0, 0, :n] = True
    return m


def prefix_block_assign(T, prefix_len):
    m = torch.ones(T, T, dtype=torch.bool).tril()
    m[:prefix_len, :prefix_len] = True
    return m


def prefix_arange(T, prefix_len):
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    return (j <= i) | ((i < prefix_len) & (j < prefix_len))


def packed_block_diag(seq_lens):
    return torch.block_diag(*[torch.ones(n, n, dtype=torch.bool).tril() for n in seq_lens])


def packed_repeat_interleave(seq_lens):
    lens = torch.tensor(list(seq_lens))
    ids = torch.repeat_interleave(torch.arange(len(lens)), lens)
    pos = torch.arange(ids.numel())
    return (ids[:, None] == ids[None, :]) & (pos[None, :] <= pos[:, None])


def packed_loops(seq_lens):
    N = sum(seq_lens)
    m = torch.zeros(N, N, dtype=torch.bool)
    start = 0
    for n in seq_lens:
        for i in range(n):
            m[start + i, start: start + i + 1] = True
        start += n
    return m


# ----------------------------------------------------------------- 3.3 masked_softmax


def softmax_big_negative_and_zero_rows(scores, allowed):
    # -1e9 is far below every score here (|scores| <= ~5e4): the maths allows a finite fill, as long
    # as rows with nothing allowed are set to zero.
    p = torch.softmax(scores.masked_fill(~allowed, -1e9), dim=-1)
    return torch.where(allowed.any(-1, keepdim=True), p, torch.zeros_like(p))


def softmax_finfo_min(scores, allowed):
    p = torch.softmax(scores.masked_fill(~allowed, torch.finfo(scores.dtype).min), dim=-1)
    return p * allowed.any(-1, keepdim=True)


def softmax_nan_to_num(scores, allowed):
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)


def softmax_by_hand(scores, allowed):
    a = allowed.expand_as(scores)
    m = torch.where(a, scores, torch.full_like(scores, float("-inf"))).amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.where(a, torch.exp(scores - m), torch.zeros_like(scores))
    total = e.sum(-1, keepdim=True)
    return e / torch.where(total > 0, total, torch.ones_like(total))


def softmax_float64_log_space(scores, allowed):
    s = scores.double().masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)))
    return p.to(scores.dtype)


# ----------------------------------------------------------------- 3.6 find_mask_leaks


def leaks_vector_perturbation(attention_fn, allowed, d_model):
    T = allowed.shape[-1]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, T, d_model, generator=g, dtype=torch.float64)
    base = attention_fn(x)
    pairs = set()
    for j in range(T):
        bumped = x.clone()
        bumped[0, j] += torch.randn(d_model, generator=g, dtype=torch.float64)
        moved = (attention_fn(bumped) - base)[0].abs().amax(-1) > 1e-7 * (1 + base.abs().max())
        pairs |= {(i, j) for i in range(T) if moved[i] and not allowed[i, j]}
    return sorted(pairs)


def leaks_jacobian(attention_fn, allowed, d_model):
    # The influence of every input position on every output row, from autograd: allowed here.
    T = allowed.shape[-1]
    x = torch.randn(1, T, d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    jac = torch.autograd.functional.jacobian(attention_fn, x)  # [1, T, D, 1, T, D]
    moved = jac[0, :, :, 0].abs().amax(dim=(1, 3)) > 1e-9
    return [(i, j) for i in range(T) for j in range(T) if moved[i, j] and not allowed[i, j]]


# ----------------------------------------------------------------- 4.1 / 4.2 / 4.3


def jacobian_diag_embed(s):
    return torch.diag_embed(s) - s[:, None] * s[None, :]


def jacobian_loops_float64(s):
    n = s.shape[0]
    J = torch.zeros(n, n, dtype=torch.float64)
    for i in range(n):
        for j in range(n):
            J[i, j] = float(s[i]) * ((i == j) - float(s[j]))
    return J.to(s.dtype)


def jacobian_autograd(s):
    # softmax(log s) = s: the Jacobian of softmax at logits log s, by autograd (allowed in 4.1).
    return torch.autograd.functional.jacobian(lambda z: torch.softmax(z, -1), s.log())


def softmax_backward_einsum(p, grad_p):
    return p * (grad_p - torch.einsum("...i,...i->...", p, grad_p)[..., None])


def softmax_backward_float64(p, grad_p):
    p64, g64 = p.double(), grad_p.double()
    return (p64 * g64 - p64 * (p64 * g64).sum(-1, keepdim=True)).to(p.dtype)


def attention_backward_einsum(q, k, v, grad_out, causal):
    scale = q.shape[-1] ** -0.5
    s = torch.einsum("...id,...jd->...ij", q, k) * scale
    if causal:
        T = q.shape[-2]
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -1e9)  # every row keeps its diagonal
    p = s.softmax(-1)
    dp = torch.einsum("...id,...jd->...ij", grad_out, v)
    ds = p * (dp - (p * dp).sum(-1, keepdim=True))
    return (torch.einsum("...ij,...jd->...id", ds, k) * scale, torch.einsum("...ij,...id->...jd", ds, q) * scale,
            torch.einsum("...ij,...id->...jd", p, grad_out))


def attention_backward_recomputes_p(q, k, v, grad_out, causal):
    """Computes P twice (once per use), with the course's own masked softmax helper: allowed."""
    from helpers.nb01_qkv_shapes import attention_weights
    from helpers.nb03_masks import causal_mask

    allowed = causal_mask(q.shape[-2]) if causal else None
    grad_v = attention_weights(q, k, allowed).mT @ grad_out
    p = attention_weights(q, k, allowed)
    dp = grad_out @ v.mT
    ds = p * (dp - (p * dp).sum(-1, keepdim=True)) / math.sqrt(q.shape[-1])
    return ds @ k, ds.mT @ q, grad_v


def attention_backward_delta_form(q, k, v, grad_out, causal):
    """FlashAttention's form: D = rowsum(dO * O) instead of rowsum(P * dP)."""
    s = q @ k.mT / math.sqrt(q.shape[-1])
    if causal:
        T = q.shape[-2]
        s = torch.where(torch.ones(T, T, dtype=torch.bool).tril(), s, torch.tensor(float("-inf"), dtype=s.dtype))
    p = torch.softmax(s, -1)
    o = p @ v
    ds = p * (grad_out @ v.mT - (grad_out * o).sum(-1, keepdim=True))
    return ds @ k / math.sqrt(q.shape[-1]), ds.mT @ q / math.sqrt(q.shape[-1]), p.mT @ grad_out


RIGHT = {
    "qkv_projection": [qkv_einsum, qkv_per_head_loop, qkv_float64_unflatten, qkv_linear_contiguous],
    "merge_heads": [merge_cat, merge_permute_flatten, merge_contiguous_view, merge_einsum_loop],
    "scaled_dot_product_attention": [sdpa_torch, sdpa_einsum, sdpa_float64_by_hand, sdpa_query_loop, sdpa_numpy],
    "scaled_scores": [scores_float64],
    "attention_entropy": [entropy_nan_to_num, entropy_log2_nansum, entropy_float64, entropy_numpy, entropy_finfo_tiny],
    "causal_mask": [causal_arange, causal_loops, causal_not_triu],
    "padding_mask": [padding_expand_view, padding_loops],
    "masked_softmax": [softmax_big_negative_and_zero_rows, softmax_finfo_min, softmax_nan_to_num, softmax_by_hand,
                       softmax_float64_log_space],
    "prefix_lm_mask": [prefix_block_assign, prefix_arange],
    "packed_causal_mask": [packed_block_diag, packed_repeat_interleave, packed_loops],
    "find_mask_leaks": [leaks_vector_perturbation, leaks_jacobian],
    "softmax_jacobian": [jacobian_diag_embed, jacobian_loops_float64, jacobian_autograd],
    "softmax_backward": [softmax_backward_einsum, softmax_backward_float64],
    "attention_backward": [attention_backward_einsum, attention_backward_recomputes_p, attention_backward_delta_form],
}


@pytest.mark.parametrize("name, fn", [(n, f) for n, fs in RIGHT.items() for f in fs],
                         ids=lambda v: getattr(v, "__name__", v))
def test_check_accepts_a_correct_variant(name, fn, capsys):
    getattr(checks, name)(fn)
    assert "passed" in capsys.readouterr().out


# ----------------------------------------------------------------- 2.3: the statistics of the spread test


def _simulated_ratios(n_learners: int, n_samples: int, seed: int) -> np.ndarray:
    """C / C0 of check 2.3's spread test for simulated learners that draw n_samples pairs per call
    (q . k of iid N(0, 1) vectors is (U - V) / 2 with U, V independent chi-square(d_k))."""
    d, seeds = scaling_checks._SPREAD_D, len(scaling_checks._SPREAD_SEEDS)
    rng = np.random.default_rng(seed)
    x = (rng.chisquare(d, (n_learners, seeds, n_samples)) - rng.chisquare(d, (n_learners, seeds, n_samples))) / 2
    y = x.var(axis=-1, ddof=1)
    c = y.var(axis=-1, ddof=1) / y.mean(axis=-1) ** 2
    return c / scaling_checks._cv2(scaling_checks._SPREAD_N, d)


def test_spread_statistic_formula_and_band():
    """Var(s^2) / E[s^2]^2 = 2 / (n - 1) + 6 / (d_k n) for q . k; a correct learner stays well inside
    the band, and 2 * n_samples or n_samples / 2 pairs fall well outside it."""
    n = scaling_checks._SPREAD_N
    lo, hi = scaling_checks._SPREAD_BAND
    right = _simulated_ratios(300, n, seed=0)
    assert abs(right.mean() - 1) < 0.01
    assert abs(np.log(right).std() - 0.054) < 0.01  # the sd the band's false-rejection figure uses
    assert lo < 0.85 * right.min() and right.max() * 1.15 < hi
    assert _simulated_ratios(100, 2 * n, seed=1).max() < 0.85 * lo
    assert _simulated_ratios(100, n // 2, seed=2).min() > 1.15 * hi


def test_pairs_for_inverts_the_formula():
    for n in (3, 10, 57, 400):
        assert math.isclose(scaling_checks._pairs_for(scaling_checks._cv2(n, 16), 16), n, rel_tol=1e-9)


# ----------------------------------------------------------------- hints name only what they recognise

from helpers.checks import CheckFailed, feedback  # noqa: E402
from tests.wrong import masks as wrong_masks  # noqa: E402
from tests.wrong import scaling as wrong_scaling  # noqa: E402


def _message(check, fn) -> str:
    with pytest.raises(CheckFailed) as info:
        check(fn)
    return str(info.value)


def test_first_failure_points_at_the_section_and_a_repeat_shows_the_recipe():
    """An unrecognised mistake (a right answer scaled by 1.01) is described, not explained: the first
    failure names no cause and no solution, only the section; the second one shows the recipe."""
    feedback.reset_attempts()
    first = _message(checks.scaled_dot_product_attention, lambda q, k, v: sdpa_einsum(q, k, v) * 1.01)
    second = _message(checks.scaled_dot_product_attention, lambda q, k, v: sdpa_einsum(q, k, v) * 1.01)
    assert "hint:" not in first and "softmax(q @ k" not in first
    assert "see: notebooks/01_qkv_shapes.ipynb, section" in first
    assert "recipe: torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(d_k), dim=-1) @ v" in second
    feedback.reset_attempts()


def test_a_finite_fill_is_not_told_that_exp_overflowed():
    for fn in (wrong_masks.softmax_fill_minus_1e4, wrong_masks.softmax_fill_minus_1e4_empty_rows_zeroed):
        message = _message(checks.masked_softmax, fn)
        assert "overflow" not in message and ("-1e4" in message or "finite number" in message)


def test_std_nan_and_int_results_are_named_as_such():
    message = _message(checks.dot_product_std, wrong_scaling.std_returns_nan)
    assert "different results" not in message and "returned nan" in message
    message = _message(checks.dot_product_std, wrong_scaling.std_returns_int)
    assert "reseed" not in message and "returned int" in message


def test_list_argument_mutation_is_seen_in_check_3_5():
    """3.5 relies on the core's in-place detection for its list argument."""
    message = _message(checks.packed_causal_mask, wrong_masks.packed_reverses_seq_lens)
    assert "in place" in message and "seq_lens" in message


@pytest.mark.parametrize("notebook", ["01_qkv_shapes", "02_scaling", "03_masks", "04_backward", "09_flash_attention"])
def test_every_check_points_at_a_section_of_its_teaching_notebook(notebook):
    """First failures say "see: notebooks/NN_x.ipynb, section ...": that heading must exist."""
    import json
    import pathlib

    from helpers.checks import EXERCISES

    cells = json.loads((pathlib.Path(__file__).parent.parent / "notebooks" / f"{notebook}.ipynb").read_text())["cells"]
    headings = {line.lstrip("#").strip() for c in cells if c["cell_type"] == "markdown"
                for line in "".join(c["source"]).splitlines() if line.startswith("#")}
    exercises = [ex for ex in EXERCISES.values() if ex.notebook == notebook]
    assert exercises
    for ex in exercises:
        assert ex.section in headings, f"{ex.id}: section {ex.section!r} is not a heading of {notebook}"
