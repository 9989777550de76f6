"""The checks of notebook 09 beyond tests/test_checks.py: correct implementations written differently
from the reference still pass (so the structural rules do not reject honest work: other loops, Python
numbers per block, autotuned kernels, other grid layouts, tl.make_block_ptr where Triton still has it),
and the instruments the checks install (dispatch modes, profile hook, guarded allocations, launch
recorder, autotuner patch) are always removed again."""

import math
import sys

import pytest
import torch

from helpers import checks
from helpers.checks import CheckFailed
from helpers.checks import nb09_flash_attention as flash_checks
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


def online_python_stats_per_block(x, block_size):
    """Running max and sum as Python floats (a few .item() per block and row), block starts from a list."""
    flat = x.double().reshape(-1, x.shape[-1])
    out = torch.zeros_like(flat)
    starts = torch.arange(0, flat.shape[1], block_size).tolist()  # a list of ints is no data of x
    for r, row in enumerate(flat):
        m, l = -math.inf, 0.0
        for s in starts:
            block = row[s : s + block_size]
            m_new = max(m, block.max().item())
            if m_new == -math.inf:
                continue
            l = l * math.exp(m - m_new) + torch.exp(block - m_new).sum().item()
            m = m_new
        if l > 0:
            out[r] = torch.exp(row - m) / l
    return out.reshape(x.shape).to(x.dtype)


@pytest.mark.parametrize("fn", [online_log_space, online_row_by_row, online_keepdim, online_python_stats_per_block])
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
    with pytest.raises(CheckFailed):
        checks.online_softmax(wrong.online_numpy_whole_row)
    assert sys.getprofile() is None


def test_logged_call_chains_an_active_profiler():
    events = []
    sys.setprofile(lambda frame, event, arg: events.append(event))
    try:
        checks.online_softmax(online_keepdim)
    finally:
        sys.setprofile(None)
    assert "call" in events  # the profiler that was active saw the learner's calls too


def test_two_pass_is_seen_whatever_computes_the_block_maxima():
    with pytest.raises(CheckFailed, match="two-pass safe softmax"):
        checks.online_softmax(wrong.online_two_pass)
    with pytest.raises(CheckFailed, match="two-pass safe softmax"):
        checks.online_softmax(wrong.online_two_pass_vectorised)


# ----------------------------------------------------------------- 9.3 / 9.4: correct Triton kernels
@needs_triton
@pytest.mark.parametrize("block, return_lse", [(32, True), (16, False), (64, True)])
def test_triton_forward_accepts_a_correct_learner_kernel(block, return_lse, capsys):
    checks.flash_attention_triton(wrong._forward("correct", block=block, return_lse=return_lse))
    assert "✓ 9.3" in capsys.readouterr().out


@needs_triton
@pytest.mark.parametrize("grid", [1, 2], ids=["grid_bh_first", "grid_3d"])
def test_triton_forward_accepts_other_grid_layouts(grid, capsys):
    checks.flash_attention_triton(wrong._forward("correct", GRID=grid))
    assert "✓ 9.3" in capsys.readouterr().out


if wrong.triton is not None:
    triton, tl = wrong.triton, wrong.tl
    # The learner's kernel of tests/wrong/flash.py, autotuned over two tile sizes (in the interpreter
    # the check takes the first config without benchmarking: benchmarks need a GPU).
    _autotuned_fwd = triton.autotune(
        configs=[triton.Config({"BLOCK_M": 32, "BLOCK_N": 32}), triton.Config({"BLOCK_M": 16, "BLOCK_N": 16})],
        key=["T", "HEAD_DIM"],
    )(wrong._learner_fwd)

    def triton_autotuned(q, k, v, causal=False):
        B, H, T, d = q.shape
        out, lse = torch.empty_like(q), torch.empty((B, H, T), dtype=torch.float32, device=q.device)
        _autotuned_fwd[lambda meta: (triton.cdiv(T, meta["BLOCK_M"]), B * H)](
            q, k, v, out, lse, 1 / math.sqrt(d), q.stride(0), q.stride(1), q.stride(2), H, T,
            HEAD_DIM=d, CAUSAL=causal, MASK_LOADS=True, MASK_SCORES=True, MASK_STORE=True, CAUSAL_MODE=0,
            SKIP_DIAG=False, SCALE_MODE=0, RESCALE=True, NORMALISE=True, LSE_LOG2=False, LOADS_IGNORE_BATCH=False,
        )
        return out

    @triton.jit
    def _block_ptr_fwd(Q, K, V, Out, sm_scale, stride_b, stride_h, stride_t, H, T, HEAD_DIM: tl.constexpr,
                       CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """The forward of Triton's older fused-attention tutorial: block pointers instead of masks."""
        start_m = tl.program_id(0)
        off_bh = tl.program_id(1)
        base = (off_bh // H) * stride_b + (off_bh % H) * stride_h
        q_ptr = tl.make_block_ptr(Q + base, (T, HEAD_DIM), (stride_t, 1), (start_m * BLOCK_M, 0), (BLOCK_M, HEAD_DIM), (1, 0))
        kt_ptr = tl.make_block_ptr(K + base, (HEAD_DIM, T), (1, stride_t), (0, 0), (HEAD_DIM, BLOCK_N), (0, 1))
        v_ptr = tl.make_block_ptr(V + base, (T, HEAD_DIM), (stride_t, 1), (0, 0), (BLOCK_N, HEAD_DIM), (1, 0))
        q = tl.load(q_ptr, boundary_check=(0,), padding_option="zero")
        offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        hi = T
        if CAUSAL:
            hi = tl.minimum((start_m + 1) * BLOCK_M, T)
        for start_n in range(0, hi, BLOCK_N):
            kt = tl.load(kt_ptr, boundary_check=(1,), padding_option="zero")
            v = tl.load(v_ptr, boundary_check=(0,), padding_option="zero")
            qk = tl.dot(q, kt) * (sm_scale * 1.4426950408889634)
            cols = start_n + offs_n
            qk = tl.where(cols[None, :] < T, qk, float("-inf"))
            if CAUSAL:
                qk = tl.where(offs_m[:, None] >= cols[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.exp2(qk - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
            kt_ptr = tl.advance(kt_ptr, (0, BLOCK_N))
            v_ptr = tl.advance(v_ptr, (BLOCK_N, 0))
        o_ptr = tl.make_block_ptr(Out + base, (T, HEAD_DIM), (stride_t, 1), (start_m * BLOCK_M, 0), (BLOCK_M, HEAD_DIM), (1, 0))
        tl.store(o_ptr, (acc / l_i[:, None]).to(Out.dtype.element_ty), boundary_check=(0,))

    def triton_block_ptr(q, k, v, causal=False):
        B, H, T, d = q.shape
        out = torch.empty_like(q)
        _block_ptr_fwd[(triton.cdiv(T, 32), B * H)](q, k, v, out, 1 / math.sqrt(d), q.stride(0), q.stride(1),
                                                     q.stride(2), H, T, HEAD_DIM=d, CAUSAL=causal, BLOCK_M=32,
                                                     BLOCK_N=32)
        return out


def _block_pointers_supported() -> bool:
    """Recent Triton versions removed tl.make_block_ptr (on a GPU as in the interpreter)."""
    q = torch.randn(1, 1, 32, 16)
    try:
        out = triton_block_ptr(q, q, q)
    except Exception as e:  # noqa: BLE001
        if "Block pointers have been removed" in str(e):
            return False
        raise
    return bool(torch.allclose(out, torch.nn.functional.scaled_dot_product_attention(q, q, q), atol=1e-5))


@needs_triton
def test_triton_forward_accepts_an_autotuned_kernel(capsys):
    checks.flash_attention_triton(triton_autotuned)
    assert "✓ 9.3" in capsys.readouterr().out


@needs_triton
def test_triton_forward_on_block_pointers(capsys):
    """Accepted where this Triton has block pointers (3.6 has); elsewhere a clear message, not "fill in the body"."""
    if _block_pointers_supported():
        checks.flash_attention_triton(triton_block_ptr)
        assert "✓ 9.3" in capsys.readouterr().out
    else:
        with pytest.raises(CheckFailed, match="tl.make_block_ptr and tl.advance were removed") as info:
            checks.flash_attention_triton(triton_block_ptr)
        assert "not attempted" not in str(info.value) and "fill in" not in str(info.value)


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


@needs_triton
def test_triton_instruments_are_removed_after_an_autotuned_run():
    from triton.runtime.autotuner import Autotuner

    bench = Autotuner.__dict__["_bench"]
    checks.flash_attention_triton(triton_autotuned)
    assert Autotuner.__dict__["_bench"] is bench


def test_guarded_allocations_leave_meta_tensors_alone():
    guard = flash_checks._GuardAllocations()
    with guard:
        m = torch.empty(2, 3, device="meta")  # this recursed before: meta torch.full calls torch.empty
        z = torch.zeros_like(torch.ones(4), device="meta")
        x = torch.empty(5)
    assert m.device.type == "meta" and z.device.type == "meta" and bool((x == flash_checks._EMPTY_FILL).all())
    assert not guard.overrun()


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


# ----------------------------------------------------------------- the provenance instrument (9.3 / 9.4)
def _provenance_of(fn):
    from helpers.checks.instruments import Calls, Provenance

    q, k, v = (torch.randn(2, 3, 8, 4, generator=torch.Generator().manual_seed(i)) for i in range(3))
    prov, calls = Provenance({"q": q, "k": k, "v": v}, watched={"q", "k", "v"}), Calls()
    with calls, prov:
        out = fn(q, k, v)
    return prov, calls, out


@pytest.mark.parametrize("fn", [
    lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v),
    lambda q, k, v: torch.softmax(q @ k.mT, -1) @ v,
    lambda q, k, v: (q[..., :, None, :] * k[..., None, :, :]).sum(-1),  # broadcasting, no matmul
    lambda q, k, v: (lambda qkv: qkv[0] @ qkv[1].mT)(torch.stack([q, k, v])),  # packed first
], ids=["sdpa", "matmul", "broadcast", "packed"])
def test_provenance_sees_q_k_v_combined_in_pytorch(fn):
    prov, _, _ = _provenance_of(fn)
    assert prov.mixed


@pytest.mark.parametrize("fn", [
    lambda q, k, v: torch.empty_like(q),
    lambda q, k, v: q.reshape(6, 8, 4).contiguous().float().transpose(1, 2) * 0.125,
    lambda q, k, v: torch.stack([q, k, v]),  # packing alone is data movement
    lambda q, k, v: (torch.randn(2, 3, 8, 4) * torch.randn(2, 3, 8, 4)).sum(-1),  # D = rowsum(dO * O)-like
    lambda q, k, v: torch.tensor(torch.arange(0, 8, 2).tolist()),
], ids=["alloc", "views_and_scale", "stack", "other_data", "arange_list"])
def test_provenance_lets_preparation_pass(fn):
    prov, calls, _ = _provenance_of(fn)
    assert not prov.mixed
    assert not [how for how, x in calls.exported if prov.sources(x)]


def test_provenance_sees_data_leave_pytorch():
    import numpy as np

    prov, calls, _ = _provenance_of(lambda q, k, v: torch.from_numpy(np.asarray(q) @ k.numpy().swapaxes(-1, -2)))
    assert [how for how, x in calls.exported if prov.sources(x)] == ["NumPy", ".numpy()", ".numpy()"]
    prov, _, _ = _provenance_of(lambda q, k, v: torch.tensor([x.item() for x in q.flatten()]))
    assert prov.scalar_reads == 192


def test_provenance_follows_in_place_writes_into_a_view():
    def fill(q, k, v):
        out = torch.empty_like(q)
        out[:, :, :4] = q[:, :, :4] * 2
        return out

    prov, _, out = _provenance_of(fill)
    assert prov.sources(out) == {"q"}


# ----------------------------------------------------------------- hints name only what they recognise
def test_online_softmax_unrecognised_mistake_gets_no_guessed_cause():
    from helpers.checks import feedback

    feedback.reset_attempts()
    with pytest.raises(CheckFailed) as info:
        checks.online_softmax(lambda x, block_size: online_keepdim(x, block_size) * 1.01)
    message = str(info.value)
    assert "shorter" not in message and "hint:" not in message
    assert "see: notebooks/09_flash_attention.ipynb, section" in message
    feedback.reset_attempts()


@needs_triton
@pytest.mark.parametrize("learner, right, wrong_cause", [
    ("fwd_skips_last_key_block", "the loop over key blocks stops before the last", "got weight"),
    ("fwd_grid_forgets_heads", "one per batch and head", "T // BLOCK"),
])
def test_triton_forward_names_the_right_cause(learner, right, wrong_cause):
    fn = next(f for f, _ in wrong.WRONG["flash_attention_triton"] if f.__name__ == learner)
    with pytest.raises(CheckFailed) as info:
        checks.flash_attention_triton(fn)
    assert right in str(info.value) and wrong_cause not in str(info.value)
