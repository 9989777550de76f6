"""The checks of notebook 09 beyond tests/test_checks.py: correct implementations written differently
from the reference still pass (so the structural rules do not reject honest work), and the
instruments the checks install (dispatch mode, profile hook, guarded allocations, launch recorder)
are always removed again."""

import math
import sys

import pytest
import torch

from helpers import checks
from helpers.checks import CheckFailed
from helpers.checks import flash as flash_checks
from tests.wrong import flash as wrong

needs_triton = pytest.mark.skipif(wrong.triton is None, reason="Triton is Linux-only")
_INF = float("-inf")


# ----------------------------------------------------------------- 9.1: other correct online softmaxes
def online_log_space(x, block_size):
    """Online in log space: a running log-sum-exp, combined with logaddexp (no max at all)."""
    lse = torch.full(x.shape[:-1], _INF, dtype=torch.float32)
    for s in range(0, x.shape[-1], block_size):
        lse = torch.logaddexp(lse, torch.logsumexp(x[..., s : s + block_size].float(), dim=-1))
    out = torch.exp(x.float() - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
    return torch.where(torch.isfinite(lse)[..., None], out, torch.zeros_like(out)).to(x.dtype)


def online_row_by_row(x, block_size):
    """Python loops over rows, with the running max initialised from the first block."""
    flat = x.float().reshape(-1, x.shape[-1])
    out = torch.zeros_like(flat)
    for r, row in enumerate(flat):
        m = row[:block_size].max()
        l = torch.exp(row[:block_size] - m).sum() if torch.isfinite(m) else torch.tensor(0.0)
        for s in range(block_size, row.shape[0], block_size):
            block = row[s : s + block_size]
            m_new = torch.maximum(m, block.max())
            if torch.isfinite(m_new):
                l = l * torch.exp(m - m_new) + torch.exp(block - m_new).sum()
                m = m_new
        if l > 0:
            out[r] = torch.exp(row - m) / l
    return out.reshape(x.shape).to(x.dtype)


def online_keepdim(x, block_size):
    """Running statistics kept as [..., 1], the block max via .max(dim, keepdim=True).values."""
    xf = x.float()
    m = torch.full(xf.shape[:-1] + (1,), _INF)
    l = torch.zeros_like(m)
    for s in range(0, xf.shape[-1], block_size):
        block = xf[..., s : s + block_size]
        m_new = torch.maximum(m, block.max(dim=-1, keepdim=True).values)
        shift = torch.where(m_new == _INF, 0.0, m_new)
        l = l * torch.exp(m - shift) + torch.exp(block - shift).sum(dim=-1, keepdim=True)
        m = m_new
    shift = torch.where(m == _INF, 0.0, m)
    return (torch.exp(xf - shift) / l.clamp_min(1e-30)).to(x.dtype)


@pytest.mark.parametrize("fn", [online_log_space, online_row_by_row, online_keepdim])
def test_online_softmax_accepts_other_correct_forms(fn, capsys):
    checks.online_softmax(fn)
    assert "✓ 9.1" in capsys.readouterr().out


# ----------------------------------------------------------------- 9.2: other correct tiled forwards
def tiled_masks_every_tile(q, k, v, causal, block_size):
    """Visits every tile (no causal skipping) and masks with a large negative number instead of -inf."""
    B, H, T, d = q.shape
    out, lse = torch.empty_like(q), torch.empty(B, H, T)
    for qs in range(0, T, block_size):
        qb = q[:, :, qs : qs + block_size] / math.sqrt(d)
        m = torch.full(qb.shape[:-1], -1e30)
        l = torch.zeros(qb.shape[:-1])
        acc = torch.zeros_like(qb)
        for ks in range(0, T, block_size):
            s = qb @ k[:, :, ks : ks + block_size].transpose(-2, -1)
            if causal:
                rows = torch.arange(qs, qs + qb.shape[-2])[:, None]
                s = torch.where(torch.arange(ks, ks + s.shape[-1])[None, :] <= rows, s, torch.tensor(-1e30))
            m_new = torch.maximum(m, s.amax(-1))
            p = torch.exp(s - m_new[..., None])
            alpha = torch.exp(m - m_new)
            l, acc, m = l * alpha + p.sum(-1), acc * alpha[..., None] + p @ v[:, :, ks : ks + block_size], m_new
        out[:, :, qs : qs + block_size] = acc / l[..., None]
        lse[:, :, qs : qs + block_size] = m + l.log()
    return out, lse


@pytest.mark.parametrize("fn", [wrong._learner_tiled, tiled_masks_every_tile], ids=["learner", "masks_every_tile"])
def test_tiled_accepts_other_correct_forms(fn, capsys):
    checks.flash_attention_tiled(lambda q, k, v, causal, block_size: fn(q, k, v, causal, block_size))
    assert "✓ 9.2" in capsys.readouterr().out


def test_logged_call_restores_the_profiler():
    assert sys.getprofile() is None
    with pytest.raises(CheckFailed):
        checks.flash_attention_tiled(wrong.tiled_calls_helper)
    assert sys.getprofile() is None


# ----------------------------------------------------------------- 9.3 / 9.4: correct Triton kernels
@needs_triton
@pytest.mark.parametrize("block, return_lse", [(32, True), (16, False), (64, True)])
def test_triton_forward_accepts_a_correct_learner_kernel(block, return_lse, capsys):
    checks.flash_attention_triton(wrong._forward("correct", block=block, return_lse=return_lse))
    assert "✓ 9.3" in capsys.readouterr().out


@needs_triton
def test_triton_backward_accepts_a_correct_learner_kernel(capsys):
    checks.flash_attention_triton_backward(wrong._backward("correct"))
    assert "✓ 9.4" in capsys.readouterr().out


@needs_triton
def test_triton_instruments_are_removed_after_a_failure():
    runners = {cls: cls.run for cls in flash_checks._runner_classes()}
    factories = {name: getattr(torch, name) for name in flash_checks._GuardAllocations.FUNCS}
    with pytest.raises(CheckFailed, match="wrote past the end"):
        checks.flash_attention_triton(wrong._forward("unmasked_store", MASK_STORE=False))
    assert all(cls.run is run for cls, run in runners.items())
    assert all(getattr(torch, name) is f for name, f in factories.items())
    assert "new_empty" not in torch.Tensor.__dict__ and "new_zeros" not in torch.Tensor.__dict__
    assert torch.empty(3).untyped_storage().nbytes() == 12


def test_guarded_allocations_catch_a_write_past_the_end():
    guard = flash_checks._GuardAllocations()
    with guard:
        x = torch.empty(2, 3)
        y = torch.zeros_like(x)
    assert x.shape == (2, 3) and bool((x == flash_checks._EMPTY_FILL).all()) and bool((y == 0).all())
    assert not guard.overrun()
    torch.as_strided(y, (7,), (1,)).fill_(1.0)  # one element past the end
    assert guard.overrun()


@needs_triton
@pytest.mark.parametrize("result, message", [
    ("oops", "expected the output tensor, or a tuple"),
    (("out", "lse"), "expected the output tensor, or a tuple"),
    (None, "forget the `return`"),
])
def test_triton_forward_explains_odd_return_values(result, message):
    def odd(q, k, v, causal=False):
        wrong._forward("correct")(q, k, v, causal)
        return result

    with pytest.raises(CheckFailed, match=message):
        checks.flash_attention_triton(odd)


@needs_triton
def test_triton_forward_explains_a_non_tensor_lse():
    def lse_as_list(q, k, v, causal=False):
        out, lse = wrong._forward("correct", return_lse=True)(q, k, v, causal)
        return out, lse.tolist()

    with pytest.raises(CheckFailed, match="lse: expected a torch.Tensor"):
        checks.flash_attention_triton(lse_as_list)
