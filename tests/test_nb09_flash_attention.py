"""Notebook 09, FlashAttention in PyTorch: the lesson code of helpers.nb09_flash_attention (online
softmax, the tiled forward, its autograd Function with a tiled backward, flatten_batch), and the
checks of exercises 9.1-9.4 (helpers/checks/nb09_flash_attention.py): the instruments they install
(op log, profile hook, provenance, guarded allocations, launch recorder, autotuner patch) are always
removed again, hints name only the causes they recognise, learner-style wrong implementations are
rejected with their hint (WRONG), and correct ones written differently from the reference pass
(RIGHT: other loops, Python numbers per block, other tile sizes and grid layouts).

The wrong and right kernels of 9.3 and 9.4 are real ``@triton.jit`` kernels: one learner-style
forward kernel and one backward pair, each with ``tl.constexpr`` switches that turn on one mistake at
a time, so every version is compiled (or interpreted) like a learner's. Without a CUDA GPU they run
in Triton's interpreter, switched on before the first kernel is decorated. The course's own Triton
kernels are tested in tests/test_nb09_triton_flash.py.
"""

import math
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import checks
from helpers.checks import CheckFailed, instruments
from helpers.nb09_flash_attention import (
    FlashAttentionTiledFunction,
    flash_attention_tiled,
    flash_attention_tiled_backward,
    flatten_batch,
    online_softmax,
)
from helpers.runtime import configure_triton
from tests.exercise_cases import assert_accepted, assert_rejected, first_fast, right_cases, wrong_cases

configure_triton()  # before any @triton.jit below

try:
    import triton
    import triton.language as tl
except ImportError:  # macOS / Windows: no Triton; only the PyTorch exercises get cases
    triton = None

needs_triton = pytest.mark.skipif(triton is None, reason="Triton is Linux-only")
_INF = float("-inf")

# =============================================================== lesson: helpers.nb09_flash_attention


def make_qkv(B, H, H_kv, T_q, d, dtype=torch.float32, T_k=None, seed=0, device="cpu"):
    """Random q ``[B, H, T_q, d]``, k and v ``[B, H_kv, T_k, d]`` (T_k defaults to T_q)."""
    g = torch.Generator().manual_seed(seed)
    T_k = T_q if T_k is None else T_k
    q = torch.randn(B, H, T_q, d, generator=g)
    k = torch.randn(B, H_kv, T_k, d, generator=g)
    v = torch.randn(B, H_kv, T_k, d, generator=g)
    return (t.to(device=device, dtype=dtype) for t in (q, k, v))


def sdpa_reference(q, k, v, causal, sm_scale=None):
    """Forward and ``lse`` [B, H, T_q] in float32 from explicit scores (small T only)."""
    q, k, v = q.float(), k.float(), v.float()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = 1 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    s = q @ k.transpose(-2, -1) * scale
    if causal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1) @ v, torch.logsumexp(s, dim=-1)


def plain_attention(q, k, v, causal=False, sm_scale=None):
    """softmax(q k^T * scale, causal mask) v from explicit scores, any leading dims; k and v with
    fewer heads (dim -3) are repeated for grouped-query attention."""
    if q.ndim >= 3 and k.shape[-3] != q.shape[-3]:
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scale = 1 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    s = q @ k.transpose(-2, -1) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def make(shape_q, shape_kv, dtype, seed=0, device="cpu"):
    """q, k, v (leaf tensors that require grad) and a grad_out, from a fixed generator."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(s, generator=g) for s in (shape_q, shape_kv, shape_kv))
    grad_out = torch.randn(shape_q, generator=g)
    q, k, v = (t.to(device, dtype).requires_grad_() for t in (q, k, v))
    return q, k, v, grad_out.to(device, dtype)


def reference_grads(q, k, v, grad_out, causal, sm_scale=None, dtype=None):
    """(out, dq, dk, dv) by autograd through :func:`plain_attention`, in ``dtype`` (default: q's)."""
    leaves = [t.detach().to(dtype or q.dtype).requires_grad_() for t in (q, k, v)]
    out = plain_attention(*leaves, causal, sm_scale)
    out.backward(grad_out.to(out.dtype))
    return out.detach(), *(t.grad for t in leaves)


def saved_lse(out, q):
    """The saved tensors of out's autograd node that have lse's shape ``q.shape[:-1]``."""
    return [t for t in out.grad_fn.saved_tensors if t.shape == q.shape[:-1]]


# (q shape, k/v shape, causal): each leading-dims form, GQA, MQA, T_q != T_k, ragged blocks
SHAPES = [
    ((29, 16), (29, 16), True),  # [T, d]: one head of one sequence
    ((3, 29, 16), (3, 41, 16), False),  # [B, T, d], cross-attention
    ((2, 4, 29, 16), (2, 2, 29, 16), True),  # [B, H, T, d] with GQA
    ((2, 3, 4, 20, 16), (2, 3, 1, 20, 16), True),  # [B1, B2, H, T, d] with MQA
]


# ----------------------------------------------------------------- online_softmax


@pytest.mark.parametrize("block_size", [1, 3, 16, 50, 64])
def test_online_softmax_equals_softmax(block_size):
    x = torch.randn(4, 3, 50, generator=torch.Generator().manual_seed(1)) * 5
    torch.testing.assert_close(online_softmax(x, block_size), torch.softmax(x, dim=-1), atol=1e-6, rtol=1e-5)


def test_online_softmax_large_scores_and_dtype():
    x = torch.tensor([[1e4, -1e4, 0.0, 1e4 - 1.0], [-1e4, -1e4 + 2, -1e4, -1e4]])
    torch.testing.assert_close(online_softmax(x, 2), torch.softmax(x, dim=-1))
    xh = x.half() / 1000
    assert online_softmax(xh, 3).dtype == torch.float16


def test_online_softmax_minus_inf_entries_and_rows():
    x = torch.randn(3, 10, generator=torch.Generator().manual_seed(2))
    x[0, :7] = float("-inf")  # the first two blocks of 3 are entirely -inf
    x[1, ::2] = float("-inf")
    x[2] = float("-inf")  # nothing allowed: all zeros, never NaN
    got = online_softmax(x, 3)
    assert not got.isnan().any()
    torch.testing.assert_close(got[:2], torch.softmax(x[:2], dim=-1))
    assert torch.equal(got[2], torch.zeros(10))


def test_online_softmax_rejects_bad_block():
    with pytest.raises(ValueError, match="block_size"):
        online_softmax(torch.randn(4), 0)


# ----------------------------------------------------------------- flash_attention_tiled


@pytest.mark.parametrize(
    "B, H, H_kv, T_q, T_k, d, causal, block",
    [
        (2, 3, 3, 1, 1, 8, True, 4),
        (2, 3, 3, 17, 17, 8, False, 4),
        (1, 2, 2, 37, 37, 16, True, 8),
        (1, 4, 2, 50, 50, 16, True, 16),  # GQA
        (1, 4, 1, 23, 41, 8, False, 16),  # MQA, T_q != T_k
        (1, 2, 2, 64, 64, 32, True, 64),  # a single block
    ],
)
def test_tiled_matches_sdpa(B, H, H_kv, T_q, T_k, d, causal, block):
    q, k, v = make_qkv(B, H, H_kv, T_q, d, T_k=T_k)
    out, lse = flash_attention_tiled(q, k, v, causal=causal, block_size=block)
    ref, ref_lse = sdpa_reference(q, k, v, causal)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    assert lse.dtype == torch.float32 and lse.shape == (B, H, T_q)


def test_tiled_scale_and_half_precision():
    q, k, v = make_qkv(1, 2, 2, 30, 16, dtype=torch.float16)
    out, lse = flash_attention_tiled(q, k, v, causal=True, block_size=8, sm_scale=0.3)
    ref, ref_lse = sdpa_reference(q, k, v, True, sm_scale=0.3)
    assert out.dtype == torch.float16
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)  # fp16 tolerances: test_nb09_triton_flash.py
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)


class ShapeRecorder(TorchDispatchMode):
    """Records the op name and output shape of every aten op run inside it."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.ops.append((str(func.overloadpacket), tuple(t.shape)))
        return out


@pytest.mark.parametrize("causal", [False, True])
def test_tiled_never_forms_a_TxT_tensor(causal):
    T, block, d = 100, 16, 8
    q, k, v = make_qkv(1, 2, 2, T, d)
    with ShapeRecorder() as rec:
        flash_attention_tiled(q, k, v, causal=causal, block_size=block)
    big = [(op, s) for op, s in rec.ops if len(s) >= 2 and s[-1] > block and s[-2] > block]
    assert not big, f"tensors larger than a tile in both of the last two dims: {big[:3]}"
    # one row max per score tile: causal visits only tiles on or below the diagonal
    n = math.ceil(T / block)
    tiles = sum(op == "aten.amax" for op, _ in rec.ops)
    assert tiles == (n * (n + 1) // 2 if causal else n * n)


def test_tiled_rejects_bad_inputs():
    q, k, v = make_qkv(1, 4, 4, 8, 8)
    with pytest.raises(ValueError, match=r"leading \(batch\) dims"):  # [H, T, d] with [B, H, T, d]
        flash_attention_tiled(q[0], k, v)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        flash_attention_tiled(q, k[:, :3], v[:, :3])
    with pytest.raises(ValueError, match="T_q == T_k"):
        flash_attention_tiled(q, k[:, :, :5], v[:, :, :5], causal=True)
    with pytest.raises(ValueError, match="block_size"):
        flash_attention_tiled(q, k, v, block_size=0)


# ----------------------------------------------------------------- FlashAttentionTiledFunction: a tiled backward, any leading dims


@pytest.mark.parametrize("shape_q, shape_kv, causal", SHAPES)
def test_tiled_function_matches_autograd_of_plain_attention_in_float64(shape_q, shape_kv, causal):
    q, k, v, grad_out = make(shape_q, shape_kv, torch.float64)
    ref, *ref_grads = reference_grads(q, k, v, grad_out, causal)
    for args in ((q, k, v, causal), (q, k, v, causal, None, 8)):  # one tile per block of 64; tiles of 8
        for t in (q, k, v):
            t.grad = None
        out = FlashAttentionTiledFunction.apply(*args)
        assert out.shape == q.shape and out.dtype == torch.float64
        assert len(saved_lse(out, q)) == 1, "lse, saved for the backward, in the caller's shape q.shape[:-1]"
        out.backward(grad_out)
        torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
        for name, t, want in zip(("dq", "dk", "dv"), (q, k, v), ref_grads):
            assert t.grad.shape == t.shape, name
            torch.testing.assert_close(t.grad, want, atol=1e-12, rtol=1e-10, msg=lambda m, n=name: f"{n}: {m}")


def test_tiled_function_gradcheck():
    """Finite differences in float64 agree with the tiled backward (GQA, causal, ragged tiles, sm_scale)."""
    q, k, v, _ = make((1, 2, 7, 4), (1, 1, 7, 4), torch.float64, seed=1)
    assert torch.autograd.gradcheck(lambda q, k, v: FlashAttentionTiledFunction.apply(q, k, v, True, 0.7, 3), (q, k, v))


def test_tiled_function_in_float32_and_half():
    q, k, v, grad_out = make((2, 30, 16), (2, 30, 16), torch.float32, seed=2)
    ref, *ref_grads = reference_grads(q, k, v, grad_out, True, dtype=torch.float64)
    out = FlashAttentionTiledFunction.apply(q, k, v, True)
    out.backward(grad_out)
    for got, want in zip((out, q.grad, k.grad, v.grad), (ref, *ref_grads)):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    qh, kh, vh = (t.detach().half().requires_grad_() for t in (q, k, v))
    out = FlashAttentionTiledFunction.apply(qh, kh, vh, True, None, 8)
    out.backward(grad_out.half())
    assert out.dtype == qh.grad.dtype == torch.float16
    torch.testing.assert_close(qh.grad.double(), ref_grads[0], atol=1e-2, rtol=1e-2)


def test_sm_scale_defaults_to_one_over_sqrt_d():
    q, k, v, _ = make((2, 3, 20, 16), (2, 3, 20, 16), torch.float64)
    with torch.no_grad():
        assert torch.equal(FlashAttentionTiledFunction.apply(q, k, v, True),
                           FlashAttentionTiledFunction.apply(q, k, v, True, 1 / math.sqrt(16)))
        torch.testing.assert_close(FlashAttentionTiledFunction.apply(q, k, v, False, 0.3),
                                   plain_attention(q, k, v, False, 0.3))


class ShapeLog(TorchDispatchMode):
    """Records (op name, shapes of its tensor inputs and outputs) for every aten op run inside it."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = [*args, *(kwargs or {}).values(), *(out if isinstance(out, (tuple, list)) else [out])]
        self.ops.append((str(func.overloadpacket), [tuple(t.shape) for t in flat if isinstance(t, torch.Tensor)]))
        return out


@pytest.mark.parametrize("causal", [False, True])
def test_tiled_backward_works_tile_by_tile(causal):
    """No tensor larger than a tile in both of its last two dims, forward or backward, and the
    backward rebuilds P once per visited tile (one exp each): n^2 tiles, n(n+1)/2 when causal."""
    T, block, d = 100, 16, 8
    q, k, v, grad_out = make((1, 2, T, d), (1, 2, T, d), torch.float32)
    with ShapeLog() as fwd:
        out = FlashAttentionTiledFunction.apply(q, k, v, causal, None, block)
    with ShapeLog() as bwd:
        out.backward(grad_out)
    for log in (fwd, bwd):
        big = [(op, s) for op, shapes in log.ops for s in shapes if len(s) >= 2 and s[-1] > block and s[-2] > block]
        assert not big, f"tensors larger than a tile: {big[:3]}"
    n = math.ceil(T / block)
    assert sum(op == "aten.exp" for op, _ in bwd.ops) == (n * (n + 1) // 2 if causal else n * n)
    assert sum(op == "aten.mm" or op == "aten.bmm" for op, _ in bwd.ops) > 0  # the log saw the backward
    torch.testing.assert_close(q.grad, reference_grads(q, k, v, grad_out, causal)[1], atol=1e-5, rtol=1e-5)


def test_tiled_backward_function_and_its_errors():
    q, k, v, grad_out = make((2, 3, 17, 8), (2, 1, 17, 8), torch.float64)
    with torch.no_grad():
        out, lse = flash_attention_tiled(q, k, v, causal=True, block_size=5)
        grads = flash_attention_tiled_backward(q, k, v, out, lse, grad_out, causal=True, block_size=7)
    for got, want in zip(grads, reference_grads(q, k, v, grad_out, True)[1:]):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)
    with pytest.raises(ValueError, match=r"lse must have shape \(2, 3, 17\)"):
        flash_attention_tiled_backward(q, k, v, out, lse[..., :5], grad_out)
    with pytest.raises(ValueError, match="grad_out must have shape"):
        flash_attention_tiled_backward(q, k, v, out, lse, grad_out[0])


def test_leading_dims_must_agree():
    q = torch.zeros(2, 3, 4, 8, 16)
    flat = flatten_batch(q, q[:, :, :2], q[:, :, :2])  # [B1, B2, H, T, d] with H_kv = 2
    assert [tuple(t.shape) for t in flat] == [(6, 4, 8, 16), (6, 2, 8, 16), (6, 2, 8, 16)]
    assert [tuple(t.shape) for t in flatten_batch(q[0, 0, 0], q[0, 0, 0], q[0, 0, 0])] == [(1, 1, 8, 16)] * 3
    x = torch.zeros(3, 4, 8, 16)
    assert flatten_batch(x.transpose(2, 3), x, x)[0].stride() == x.transpose(2, 3).stride()  # 4-D: untouched
    with pytest.raises(ValueError, match=r"leading \(batch\) dims.*\(2, 3, 4, 8, 16\), \(3, 4, 8, 16\)"):
        flatten_batch(q, q[0], q[0])
    with pytest.raises(ValueError, match=r"leading \(batch\) dims"):
        flash_attention_tiled(q, q[:1], q[:1])
    with pytest.raises(ValueError, match="at least 2-D"):
        flash_attention_tiled(torch.zeros(16), torch.zeros(16), torch.zeros(16))


# =============================================================== checks of 9.1-9.4

# ----------------------------------------------------------------- the op log and profile hook (9.1, 9.2)
def test_logged_call_restores_the_profiler():
    assert sys.getprofile() is None
    with pytest.raises(CheckFailed):
        checks.flash_attention_tiled(tiled_calls_helper)
    with pytest.raises(CheckFailed):
        checks.online_softmax(online_numpy_whole_row)
    assert sys.getprofile() is None


def test_logged_call_chains_an_active_profiler():
    events = []
    sys.setprofile(lambda frame, event, arg: events.append(event))
    try:
        checks.online_softmax(online_keepdim)
    finally:
        sys.setprofile(None)
    assert "call" in events  # the profiler that was active saw the learner's calls too


# ----------------------------------------------------------------- guarded allocations and kernel launches (9.3, 9.4)
@needs_triton
def test_triton_instruments_are_removed_after_a_failure():
    runners = {cls: cls.run for cls in instruments.runner_classes()}
    factories = {name: getattr(torch, name) for name in instruments.GuardAllocations.FUNCS}
    with pytest.raises(CheckFailed, match="wrote past the end"):
        checks.flash_attention_triton(_forward("unmasked_store", MASK_STORE=False))
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
    guard = instruments.GuardAllocations()
    with guard:
        m = torch.empty(2, 3, device="meta")  # this recursed before: meta torch.full calls torch.empty
        z = torch.zeros_like(torch.ones(4), device="meta")
        x = torch.empty(5)
    assert m.device.type == "meta" and z.device.type == "meta" and bool((x == instruments.EMPTY_FILL).all())
    assert not guard.overrun()


def test_guarded_allocations_catch_a_write_past_the_end():
    guard = instruments.GuardAllocations()
    with guard:
        x = torch.empty(2, 3)
        y = torch.zeros_like(x)
    assert x.shape == (2, 3) and bool((x == instruments.EMPTY_FILL).all()) and bool((y == 0).all())
    assert not guard.overrun()
    torch.as_strided(y, (7,), (1,)).fill_(1.0)  # one element past the end
    assert guard.overrun()


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
        checks.online_softmax(lambda x, block_size: online_keepdim(x, block_size) + 0.001)
    message = str(info.value)
    assert "shorter" not in message and "hint:" not in message
    assert "see: notebooks/09_flash_attention.ipynb, section" in message
    feedback.reset_attempts()
    # Rows scaled by a factor are a fact the check states (proportional rows, their sums), not a guess.
    with pytest.raises(CheckFailed) as info:
        checks.online_softmax(lambda x, block_size: online_keepdim(x, block_size) * 1.01)
    assert "proportional to the right one" in str(info.value) and "sums to 1.01 to 1.01" in str(info.value)
    feedback.reset_attempts()


@needs_triton
@pytest.mark.parametrize("learner, right, wrong_cause", [
    ("fwd_skips_last_key_block", "the loop over key blocks stops before the last", "got weight"),
    ("fwd_grid_forgets_heads", "one per batch and head", "T // BLOCK"),
])
def test_triton_forward_names_the_right_cause(learner, right, wrong_cause):
    fn = next(f for f, _ in WRONG["flash_attention_triton"] if f.__name__ == learner)
    with pytest.raises(CheckFailed) as info:
        checks.flash_attention_triton(fn)
    assert right in str(info.value) and wrong_cause not in str(info.value)


# =============================================================== wrong implementations


# ----------------------------------------------------------------- 9.1 online_softmax
def online_no_rescale(x, block_size):
    m = torch.full(x.shape[:-1], _INF)
    l = torch.zeros(x.shape[:-1])
    for s in range(0, x.shape[-1], block_size):
        block = x[..., s : s + block_size]
        m = torch.maximum(m, block.amax(dim=-1))
        l = l + torch.exp(block - m[..., None]).sum(dim=-1)  # the old sum keeps its old max
    return torch.exp(x - m[..., None]) / l[..., None]


def online_nan_on_masked_blocks(x, block_size):
    m = torch.full(x.shape[:-1], _INF, dtype=x.dtype)
    l = torch.zeros(x.shape[:-1], dtype=x.dtype)
    for s in range(0, x.shape[-1], block_size):
        block = x[..., s : s + block_size]
        m_new = torch.maximum(m, block.amax(dim=-1))
        l = l * torch.exp(m - m_new) + torch.exp(block - m_new[..., None]).sum(dim=-1)  # -inf - -inf
        m = m_new
    return torch.exp(x - m[..., None]) / l[..., None]


def online_nan_on_empty_rows(x, block_size):
    m = torch.full(x.shape[:-1], _INF, dtype=x.dtype)
    l = torch.zeros(x.shape[:-1], dtype=x.dtype)
    for s in range(0, x.shape[-1], block_size):
        block = x[..., s : s + block_size]
        m_new = torch.maximum(m, block.amax(dim=-1))
        safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        l = l * torch.exp(m - safe) + torch.exp(block - safe[..., None]).sum(dim=-1)
        m = m_new
    safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    return torch.exp(x - safe[..., None]) / l[..., None]  # 0 / 0 on a row with nothing allowed


def online_ignores_block_size(x, block_size):
    return torch.softmax(x, dim=-1)


def online_two_pass(x, block_size):
    n = x.shape[-1]
    m = torch.full(x.shape[:-1], _INF, dtype=x.dtype)
    for s in range(0, n, block_size):  # pass 1: the max
        m = torch.maximum(m, x[..., s : s + block_size].amax(dim=-1))
    l = torch.zeros(x.shape[:-1], dtype=x.dtype)
    for s in range(0, n, block_size):  # pass 2: the sum
        l = l + torch.exp(x[..., s : s + block_size] - m[..., None]).sum(dim=-1)
    return torch.exp(x - m[..., None]) / l[..., None]


def online_drops_last_block(x, block_size):
    n = x.shape[-1]
    m = torch.full(x.shape[:-1], _INF, dtype=x.dtype)
    l = torch.zeros(x.shape[:-1], dtype=x.dtype)
    for s in range(0, n - block_size + 1, block_size):  # full blocks only
        block = x[..., s : s + block_size]
        m_new = torch.maximum(m, block.amax(dim=-1))
        l = l * torch.exp(m - m_new) + torch.exp(block - m_new[..., None]).sum(dim=-1)
        m = m_new
    return torch.exp(x - m[..., None]) / l[..., None]


def online_no_max(x, block_size):
    l = torch.zeros(x.shape[:-1], dtype=x.dtype)
    for s in range(0, x.shape[-1], block_size):
        l = l + torch.exp(x[..., s : s + block_size]).sum(dim=-1)
    return torch.exp(x) / l[..., None]


def online_returns_float32(x, block_size):
    xf = x.float()
    m = torch.full(x.shape[:-1], _INF)
    l = torch.zeros(x.shape[:-1])
    for s in range(0, x.shape[-1], block_size):
        block = xf[..., s : s + block_size]
        m_new = torch.maximum(m, block.amax(dim=-1))
        safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        l = l * torch.exp(m - safe) + torch.exp(block - safe[..., None]).sum(dim=-1)
        m = m_new
    safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    return torch.exp(xf - safe[..., None]) / torch.where(l > 0, l, 1.0)[..., None]


def online_calls_helper(x, block_size):
    from helpers.nb09_flash_attention import online_softmax

    return online_softmax(x, block_size)


def online_numpy_whole_row(x, block_size):
    import numpy as np

    a = x.numpy()  # the whole-row softmax, where the op log cannot see it
    e = np.exp(a - a.max(-1, keepdims=True))
    return torch.from_numpy(np.nan_to_num(e / e.sum(-1, keepdims=True)))


def online_two_pass_vectorised(x, block_size):
    n = x.shape[-1]
    n_blocks = -(-n // block_size)
    padded = F.pad(x, (0, n_blocks * block_size - n), value=_INF)
    m = padded.unflatten(-1, (n_blocks, block_size)).amax(-1).amax(-1)  # every block's max in one step
    safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    l = torch.zeros(x.shape[:-1], dtype=x.dtype)
    for s in range(0, n, block_size):  # then a second pass for the sum
        l = l + torch.exp(x[..., s : s + block_size] - safe[..., None]).sum(dim=-1)
    out = torch.exp(x - safe[..., None]) / l[..., None]
    return torch.where(l[..., None] > 0, out, torch.zeros_like(out))


def online_python_numbers(x, block_size):
    flat = x.reshape(-1, x.shape[-1])
    out = torch.zeros_like(flat)
    for r in range(flat.shape[0]):
        row = [float(v) for v in flat[r]]  # one Python number at a time
        m = max(row)
        if m == _INF:
            continue
        e = [math.exp(v - m) for v in row]
        out[r] = torch.tensor([v / sum(e) for v in e], dtype=x.dtype)
    return out.reshape(x.shape)


# ----------------------------------------------------------------- 9.2 flash_attention_tiled
# Each one a whole tiled forward as a learner writes it, with one mistake.
def tiled_no_acc_rescale(q, k, v, causal, block_size):
    """Rescales the running sum when the max grows, but not the accumulator."""
    B, H, T, d = q.shape
    out, lse = torch.empty_like(q), torch.empty(B, H, T)
    for qs in range(0, T, block_size):
        qb = q[:, :, qs : qs + block_size]
        m = torch.full(qb.shape[:-1], _INF)
        l = torch.zeros(qb.shape[:-1])
        acc = torch.zeros_like(qb)
        for ks in range(0, qs + qb.shape[2] if causal else T, block_size):
            s = qb @ k[:, :, ks : ks + block_size].transpose(-2, -1) / math.sqrt(d)
            if causal:
                i = torch.arange(qs, qs + s.shape[-2])[:, None]
                j = torch.arange(ks, ks + s.shape[-1])[None, :]
                s = s.masked_fill(j > i, _INF)
            m_new = torch.maximum(m, s.amax(dim=-1))
            p = torch.exp(s - m_new[..., None])
            l = l * torch.exp(m - m_new) + p.sum(dim=-1)
            acc = acc + p @ v[:, :, ks : ks + block_size]  # the old terms keep their old max
            m = m_new
        out[:, :, qs : qs + block_size] = acc / l[..., None]
        lse[:, :, qs : qs + block_size] = m + torch.log(l)
    return out, lse


def tiled_no_normalisation(q, k, v, causal, block_size):
    """Keeps l up to date and uses it for lse, but returns the accumulator undivided."""
    B, H, T, d = q.shape
    scale = d**-0.5
    out, lse = torch.zeros_like(q), torch.zeros(B, H, T)
    for qs in range(0, T, block_size):
        qe = min(qs + block_size, T)
        m = torch.full((B, H, qe - qs), _INF)
        l = torch.zeros(B, H, qe - qs)
        acc = torch.zeros(B, H, qe - qs, d)
        for ks in range(0, qe if causal else T, block_size):
            ke = min(ks + block_size, T)
            s = torch.einsum("bhid,bhjd->bhij", q[:, :, qs:qe], k[:, :, ks:ke]) * scale
            if causal:
                s = s.masked_fill(torch.arange(ks, ke)[None, :] > torch.arange(qs, qe)[:, None], _INF)
            m_new = torch.maximum(m, s.amax(-1))
            alpha = torch.exp(m - m_new)
            p = torch.exp(s - m_new[..., None])
            l = alpha * l + p.sum(-1)
            acc = alpha[..., None] * acc + torch.einsum("bhij,bhjd->bhid", p, v[:, :, ks:ke])
            m = m_new
        out[:, :, qs:qe] = acc  # forgot acc / l
        lse[:, :, qs:qe] = m + l.log()
    return out, lse


def tiled_lse_log2(q, k, v, causal, block_size):
    """Works in base 2, as the Triton kernel will (scores times log2(e), exp2), and returns lse in log2 units."""
    B, H, T, d = q.shape
    qk_scale = 1.4426950408889634 / math.sqrt(d)
    out, lse = torch.empty_like(q), torch.empty(B, H, T)
    for qs in range(0, T, block_size):
        qe = min(qs + block_size, T)
        m = torch.full((B, H, qe - qs), _INF)
        l = torch.zeros(B, H, qe - qs)
        acc = torch.zeros(B, H, qe - qs, d)
        for ks in range(0, qe if causal else T, block_size):
            ke = min(ks + block_size, T)
            s = q[:, :, qs:qe] @ k[:, :, ks:ke].mT * qk_scale
            if causal:
                s = torch.where(torch.arange(ks, ke)[None, :] <= torch.arange(qs, qe)[:, None], s, _INF)
            m_new = torch.maximum(m, s.amax(-1))
            alpha = torch.exp2(m - m_new)
            p = torch.exp2(s - m_new[..., None])
            l = l * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + p @ v[:, :, ks:ke]
            m = m_new
        out[:, :, qs:qe] = acc / l[..., None]
        lse[:, :, qs:qe] = m + torch.log2(l)  # base 2, like the scores
    return out, lse


def tiled_lse_only_max(q, k, v, causal, block_size):
    """Returns the running max as lse, as if l were 1."""
    B, H, T, d = q.shape
    out, lse = torch.empty_like(q), torch.empty(B, H, T)
    for qs in range(0, T, block_size):
        qe = min(qs + block_size, T)
        qb = q[:, :, qs:qe] / math.sqrt(d)
        m = torch.full(qb.shape[:-1], _INF)
        l = torch.zeros(qb.shape[:-1])
        acc = torch.zeros_like(qb)
        for ks in range(0, qe if causal else T, block_size):
            ke = min(ks + block_size, T)
            s = qb @ k[:, :, ks:ke].transpose(-2, -1)
            if causal:
                s[..., torch.arange(ks, ke)[None, :] > torch.arange(qs, qe)[:, None]] = _INF
            m_new = torch.max(m, s.max(dim=-1).values)
            p = torch.exp(s - m_new.unsqueeze(-1))
            l = l * torch.exp(m - m_new) + p.sum(-1)
            acc = acc * torch.exp(m - m_new).unsqueeze(-1) + p @ v[:, :, ks:ke]
            m = m_new
        out[:, :, qs:qe] = acc / l.unsqueeze(-1)
        lse[:, :, qs:qe] = m
    return out, lse


def tiled_causal_skips_diagonal(q, k, v, causal, block_size):
    """With causal=True visits only the key blocks left of the query block ("below the diagonal,
    nothing to mask"), so the diagonal block is never seen."""
    B, H, T, d = q.shape
    out, lse = torch.empty_like(q), torch.empty(B, H, T)
    for qs in range(0, T, block_size):
        qb = q[:, :, qs : qs + block_size]
        m = torch.full(qb.shape[:-1], _INF)
        l = torch.zeros(qb.shape[:-1])
        acc = torch.zeros_like(qb)
        for ks in range(0, qs if causal else T, block_size):
            s = qb @ k[:, :, ks : ks + block_size].transpose(-2, -1) / math.sqrt(d)
            m_new = torch.maximum(m, s.amax(-1))
            alpha = torch.exp(m - m_new)
            p = torch.exp(s - m_new[..., None])
            l = l * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + p @ v[:, :, ks : ks + block_size]
            m = m_new
        out[:, :, qs : qs + block_size] = acc / l[..., None]
        lse[:, :, qs : qs + block_size] = m + torch.log(l)
    return out, lse


def tiled_causal_hides_diagonal(q, k, v, causal, block_size):
    """Masks keys j >= i: a query no longer sees its own key."""
    B, H, T, d = q.shape
    out, lse = torch.empty_like(q), torch.empty(B, H, T)
    for qs in range(0, T, block_size):
        qe = min(qs + block_size, T)
        m = torch.full((B, H, qe - qs), _INF)
        l = torch.zeros(B, H, qe - qs)
        acc = torch.zeros(B, H, qe - qs, d)
        for ks in range(0, qe if causal else T, block_size):
            ke = min(ks + block_size, T)
            s = q[:, :, qs:qe] @ k[:, :, ks:ke].transpose(-2, -1) / math.sqrt(d)
            if causal:
                future = torch.arange(ks, ke)[None, :] >= torch.arange(qs, qe)[:, None]
                s = s.masked_fill(future, _INF)
            m_new = torch.maximum(m, s.amax(-1))
            alpha = torch.exp(m - m_new)
            p = torch.exp(s - m_new[..., None])
            l = l * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + p @ v[:, :, ks:ke]
            m = m_new
        out[:, :, qs:qe] = acc / l[..., None]
        lse[:, :, qs:qe] = m + torch.log(l)
    return out, lse


def tiled_drops_last_block(q, k, v, causal, block_size):
    """Counts the blocks with T // block_size: the last, shorter block of queries and keys is left out."""
    B, H, T, d = q.shape
    n_blocks = T // block_size
    out, lse = torch.zeros_like(q), torch.zeros(B, H, T)
    for bi in range(n_blocks):
        rows = slice(bi * block_size, (bi + 1) * block_size)
        m = torch.full((B, H, block_size), _INF)
        l = torch.zeros(B, H, block_size)
        acc = torch.zeros(B, H, block_size, d)
        for bj in range(bi + 1 if causal else n_blocks):
            cols = slice(bj * block_size, (bj + 1) * block_size)
            s = q[:, :, rows] @ k[:, :, cols].transpose(-2, -1) / math.sqrt(d)
            if causal and bj == bi:
                s = s.masked_fill(torch.ones(block_size, block_size, dtype=torch.bool).triu(1), _INF)
            m_new = torch.maximum(m, s.amax(-1))
            alpha = torch.exp(m - m_new)
            p = torch.exp(s - m_new[..., None])
            l = l * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + p @ v[:, :, cols]
            m = m_new
        out[:, :, rows] = acc / l[..., None]
        lse[:, :, rows] = m + torch.log(l)
    return out, lse


def tiled_no_scale(q, k, v, causal, block_size):
    """Forgets the 1 / sqrt(d) on the scores."""
    B, H, T, d = q.shape
    out, lse = torch.empty_like(q), torch.empty(B, H, T)
    for qs in range(0, T, block_size):
        qe = min(qs + block_size, T)
        m = torch.full((B, H, qe - qs), _INF)
        l = torch.zeros(B, H, qe - qs)
        acc = torch.zeros(B, H, qe - qs, d)
        for ks in range(0, qe if causal else T, block_size):
            ke = min(ks + block_size, T)
            s = q[:, :, qs:qe] @ k[:, :, ks:ke].transpose(-2, -1)
            if causal:
                s = s.masked_fill(torch.arange(ks, ke)[None, :] > torch.arange(qs, qe)[:, None], _INF)
            m_new = torch.maximum(m, s.amax(-1))
            alpha = torch.exp(m - m_new)
            p = torch.exp(s - m_new[..., None])
            l = l * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + p @ v[:, :, ks:ke]
            m = m_new
        out[:, :, qs:qe] = acc / l[..., None]
        lse[:, :, qs:qe] = m + torch.log(l)
    return out, lse


def tiled_full_scores(q, k, v, causal, block_size):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # [B, H, T, T]
    if causal:
        T = q.shape[-2]
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), _INF)
    return torch.softmax(s, dim=-1) @ v, torch.logsumexp(s, dim=-1)


def tiled_row_strips(q, k, v, causal, block_size):
    T = q.shape[-2]
    out, lse = torch.empty_like(q), torch.empty(q.shape[:-1])
    for qs in range(0, T, block_size):
        s = q[:, :, qs : qs + block_size] @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # [B, H, bq, T]
        if causal:
            i = torch.arange(qs, min(qs + block_size, T))[:, None]
            s = s.masked_fill(torch.arange(T)[None, :] > i, _INF)
        out[:, :, qs : qs + block_size] = torch.softmax(s, dim=-1) @ v
        lse[:, :, qs : qs + block_size] = torch.logsumexp(s, dim=-1)
    return out, lse


def tiled_calls_sdpa(q, k, v, causal, block_size):
    """Takes out from torch's fused attention and lse from the full scores."""
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), _INF)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal), torch.logsumexp(s, dim=-1)


def tiled_calls_helper(q, k, v, causal, block_size):
    from helpers import reference

    return reference.flash_attention_tiled(q, k, v, causal, block_size)


def tiled_numpy_full_attention(q, k, v, causal, block_size):
    import numpy as np

    s = q.numpy() @ np.swapaxes(k.numpy(), -1, -2) / math.sqrt(q.shape[-1])  # [B, H, T, T], unseen by torch
    if causal:
        T = q.shape[-2]
        s = np.where(np.tril(np.ones((T, T), dtype=bool)), s, -np.inf)
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    out = (e / e.sum(-1, keepdims=True)) @ v.numpy()
    return torch.from_numpy(out), torch.from_numpy((m[..., 0] + np.log(e.sum(-1))).astype(np.float32))


def tiled_no_lse(q, k, v, causal, block_size):
    """A correct tiled forward that returns only out."""
    B, H, T, d = q.shape
    out = torch.empty_like(q)
    for qs in range(0, T, block_size):
        qe = min(qs + block_size, T)
        m = torch.full((B, H, qe - qs), _INF)
        l = torch.zeros(B, H, qe - qs)
        acc = torch.zeros(B, H, qe - qs, d)
        for ks in range(0, qe if causal else T, block_size):
            ke = min(ks + block_size, T)
            s = q[:, :, qs:qe] @ k[:, :, ks:ke].transpose(-2, -1) / math.sqrt(d)
            if causal:
                s = s.masked_fill(torch.arange(ks, ke)[None, :] > torch.arange(qs, qe)[:, None], _INF)
            m_new = torch.maximum(m, s.amax(-1))
            alpha = torch.exp(m - m_new)
            p = torch.exp(s - m_new[..., None])
            l = l * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + p @ v[:, :, ks:ke]
            m = m_new
        out[:, :, qs:qe] = acc / l[..., None]
    return out


def tiled_lse_keepdim(q, k, v, causal, block_size):
    """A correct tiled forward with m and l kept as [..., 1] (keepdim=True), lse too."""
    B, H, T, d = q.shape
    out, lse = torch.empty_like(q), torch.empty(B, H, T, 1)
    for qs in range(0, T, block_size):
        qe = min(qs + block_size, T)
        m = torch.full((B, H, qe - qs, 1), _INF)
        l = torch.zeros(B, H, qe - qs, 1)
        acc = torch.zeros(B, H, qe - qs, d)
        for ks in range(0, qe if causal else T, block_size):
            ke = min(ks + block_size, T)
            s = q[:, :, qs:qe] @ k[:, :, ks:ke].transpose(-2, -1) / math.sqrt(d)
            if causal:
                s = s.masked_fill(torch.arange(ks, ke)[None, :] > torch.arange(qs, qe)[:, None], _INF)
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            alpha = torch.exp(m - m_new)
            p = torch.exp(s - m_new)
            l = l * alpha + p.sum(-1, keepdim=True)
            acc = acc * alpha + p @ v[:, :, ks:ke]
            m = m_new
        out[:, :, qs:qe] = acc / l
        lse[:, :, qs:qe] = m + torch.log(l)
    return out, lse


# More learner-style mistakes of 9.1, each a whole online softmax with one mistake.
def _online_with(x, block_size, *, step, start=_INF, finish=None):
    """The learner's loop: m and l per row, ``step(m, l, block) -> (m, l)`` per block, and
    ``finish(x, m, l)`` (default: exp(x - m) / l, 0 where l is 0) at the end."""
    m = torch.full(x.shape[:-1], start, dtype=x.dtype)
    l = torch.zeros(x.shape[:-1], dtype=x.dtype)
    for s in range(0, x.shape[-1], block_size):
        m, l = step(m, l, x[..., s : s + block_size])
    if finish is not None:
        return finish(x, m, l)
    safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    out = torch.exp(x - safe[..., None]) / l[..., None]
    return torch.where(l[..., None] > 0, out, torch.zeros_like(out))


def _safe(m):
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def online_inverse_rescale(x, block_size):
    """Rescales with exp(m_new - m): on the first block exp(+inf) = inf, and 0 * inf = NaN."""
    def step(m, l, block):
        m_new = torch.maximum(m, block.amax(dim=-1))
        return m_new, l * torch.exp(m_new - m) + torch.exp(block - m_new[..., None]).sum(dim=-1)

    return _online_with(x, block_size, step=step, finish=lambda x, m, l: torch.exp(x - m[..., None]) / l[..., None])


def online_inverse_rescale_guarded(x, block_size):
    """The inverted rescale with the l > 0 guard: the NaN sums come out as zeros."""
    def step(m, l, block):
        m_new = torch.maximum(m, block.amax(dim=-1))
        return m_new, l * torch.exp(_safe(m_new) - m) + torch.exp(block - _safe(m_new)[..., None]).sum(dim=-1)

    return _online_with(x, block_size, step=step)


def online_inverse_rescale_first_block(x, block_size):
    """Starts m and l from the first block (no -inf), then rescales with exp(m_new - m)."""
    xf = x.float()
    m = xf[..., :block_size].amax(-1)
    l = torch.exp(xf[..., :block_size] - m[..., None]).sum(-1)
    for s in range(block_size, x.shape[-1], block_size):
        block = xf[..., s : s + block_size]
        m_new = torch.maximum(m, block.amax(dim=-1))
        l = l * torch.exp(m_new - m) + torch.exp(block - m_new[..., None]).sum(dim=-1)
        m = m_new
    return (torch.exp(xf - m[..., None]) / l[..., None]).to(x.dtype)


def _right_step(m, l, block):
    m_new = torch.maximum(m, block.amax(dim=-1))
    return m_new, l * torch.exp(m - _safe(m_new)) + torch.exp(block - _safe(m_new)[..., None]).sum(dim=-1)


def online_output_with_first_block_max(x, block_size):
    """Keeps the max of the first block for the output: exp(x - m_first) / l."""
    m = torch.full(x.shape[:-1], _INF, dtype=x.dtype)
    l = torch.zeros(x.shape[:-1], dtype=x.dtype)
    first = None
    for s in range(0, x.shape[-1], block_size):
        m, l = _right_step(m, l, x[..., s : s + block_size])
        first = m.clone() if first is None else first
    out = torch.exp(x - _safe(first)[..., None]) / l[..., None]
    return torch.where(l[..., None] > 0, out, torch.zeros_like(out))


def online_exp_before_max_update(x, block_size):
    """Adds exp(block - m) with the previous max, then updates m."""
    def step(m, l, block):
        m_new = torch.maximum(m, block.amax(dim=-1))
        alpha = torch.where(torch.isfinite(m), torch.exp(m - _safe(m_new)), torch.zeros_like(m))
        return m_new, l * alpha + torch.exp(block - _safe(m)[..., None]).sum(dim=-1)

    return _online_with(x, block_size, step=step)


def online_block_sum_all_rows(x, block_size):
    """Each block's sum over every row at once (.sum() with no dim, then per row of the first axis)."""
    if x.dim() < 2:
        return _online_with(x, block_size, step=_right_step)

    def step(m, l, block):
        m_new = torch.maximum(m, block.amax(dim=-1))
        e = torch.exp(block - _safe(m_new)[..., None])
        return m_new, l * torch.exp(m - _safe(m_new)) + e.sum(dim=-1).sum(dim=0, keepdim=True)

    return _online_with(x, block_size, step=step)


def online_masked_as_minus_1e4(x, block_size):
    """Replaces -inf by -1e4 first: a row with nothing allowed comes out uniform."""
    return _online_with(torch.where(torch.isneginf(x), torch.full_like(x, -1e4), x), block_size, step=_right_step)


def online_sum_doubled(x, block_size):
    """Counts each block's sum twice: l = l * alpha + 2 * sum(...)."""
    def step(m, l, block):
        m_new = torch.maximum(m, block.amax(dim=-1))
        return m_new, l * torch.exp(m - _safe(m_new)) + 2 * torch.exp(block - _safe(m_new)[..., None]).sum(dim=-1)

    return _online_with(x, block_size, step=step)


def online_stale_block_exps(x, block_size):
    """Stores exp(block - m) as each block arrives, divides them all by the final l."""
    m = torch.full(x.shape[:-1], _INF, dtype=x.dtype)
    l = torch.zeros(x.shape[:-1], dtype=x.dtype)
    parts = []
    for s in range(0, x.shape[-1], block_size):
        m, l = _right_step(m, l, x[..., s : s + block_size])
        parts.append(torch.exp(x[..., s : s + block_size] - _safe(m)[..., None]))
    out = torch.cat(parts, dim=-1) / l[..., None]
    return torch.where(l[..., None] > 0, out, torch.zeros_like(out))


def online_max_starts_at_zero(x, block_size):
    """m = 0 at the start: right until a whole row lies far below 0 (exp(x - 0) underflows)."""
    return _online_with(x, block_size, step=_right_step, start=0.0)


def online_max_starts_at_zero_unguarded(x, block_size):
    return _online_with(x, block_size, step=_right_step, start=0.0,
                        finish=lambda x, m, l: torch.exp(x - m[..., None]) / l[..., None])


def online_max_of_whole_row_first(x, block_size):
    """The max of the whole row first, then one pass over the blocks for the sum."""
    m = x.amax(dim=-1)
    l = torch.zeros(x.shape[:-1], dtype=x.dtype)
    for s in range(0, x.shape[-1], block_size):
        l = l + torch.exp(x[..., s : s + block_size] - _safe(m)[..., None]).sum(-1)
    out = torch.exp(x - _safe(m)[..., None]) / l[..., None]
    return torch.where(l[..., None] > 0, out, torch.zeros_like(out))


def online_range_stops_a_block_early(x, block_size):
    """range(0, n - block_size, block_size): the last block is never read."""
    m = torch.full(x.shape[:-1], _INF, dtype=x.dtype)
    l = torch.zeros(x.shape[:-1], dtype=x.dtype)
    for s in range(0, x.shape[-1] - block_size, block_size):
        m, l = _right_step(m, l, x[..., s : s + block_size])
    out = torch.exp(x - _safe(m)[..., None]) / l[..., None]
    return torch.where(l[..., None] > 0, out, torch.zeros_like(out))


def online_slices_one_short(x, block_size):
    """x[..., s:s + block_size - 1]: every block misses its last entry (but the end of x)."""
    m = torch.full(x.shape[:-1], _INF, dtype=x.dtype)
    l = torch.zeros(x.shape[:-1], dtype=x.dtype)
    for s in range(0, x.shape[-1], block_size):
        block = x[..., s : s + block_size - 1]
        if block.shape[-1]:
            m, l = _right_step(m, l, block)
    out = torch.exp(x - _safe(m)[..., None]) / l[..., None]
    return torch.where(l[..., None] > 0, out, torch.zeros_like(out))


def online_sum_of_last_block(x, block_size):
    """l = ... instead of l = l * alpha + ...: the final l is the last block's sum."""
    def step(m, l, block):
        m_new = torch.maximum(m, block.amax(dim=-1))
        return m_new, torch.exp(block - _safe(m_new)[..., None]).sum(dim=-1)

    return _online_with(x, block_size, step=step)


def online_divides_per_block(x, block_size):
    """Writes each block's output as it goes, divided by the partial sum so far."""
    out = torch.zeros_like(x)
    m = torch.full(x.shape[:-1], _INF, dtype=x.dtype)
    l = torch.zeros(x.shape[:-1], dtype=x.dtype)
    for s in range(0, x.shape[-1], block_size):
        m, l = _right_step(m, l, x[..., s : s + block_size])
        e = torch.exp(x[..., s : s + block_size] - _safe(m)[..., None]) / l[..., None]
        out[..., s : s + block_size] = torch.where(l[..., None] > 0, e, torch.zeros_like(e))
    return out


def online_no_division(x, block_size):
    return _online_with(x, block_size, step=_right_step, finish=lambda x, m, l: torch.exp(x - _safe(m)[..., None]))


def online_over_dim0(x, block_size):
    """Blocks, max and sum along dim 0."""
    m = torch.full(x.shape[1:], _INF, dtype=x.dtype)
    l = torch.zeros(x.shape[1:], dtype=x.dtype)
    for s in range(0, x.shape[0], block_size):
        block = x[s : s + block_size]
        m_new = torch.maximum(m, block.amax(dim=0))
        l = l * torch.exp(m - _safe(m_new)) + torch.exp(block - _safe(m_new)).sum(dim=0)
        m = m_new
    out = torch.exp(x - _safe(m)) / l
    return torch.where(l > 0, out, torch.zeros_like(out))


def online_no_max_in_float32(x, block_size):
    """exp(x) without subtracting a max, in float32: inf / inf = NaN once x > 88."""
    xf = x.float()
    l = torch.zeros(x.shape[:-1])
    for s in range(0, x.shape[-1], block_size):
        l = l + torch.exp(xf[..., s : s + block_size]).sum(dim=-1)
    out = torch.exp(xf) / l[..., None]
    return torch.where(l[..., None] > 0, out, torch.zeros_like(out)).to(x.dtype)


# More learner-style mistakes of 9.2: tiled_learner's loops with one change (its keyword options).
def tiled_scale_forgotten(q, k, v, causal, block_size):
    return tiled_learner(q, k, v, causal, block_size, scale=1.0)


def tiled_mask_keys_from_zero(q, k, v, causal, block_size):
    """Key positions counted from the tile's start, query positions global."""
    return tiled_learner(q, k, v, causal, block_size,
                         hidden=lambda qs, qe, ks, ke: torch.arange(ke - ks)[None, :] > torch.arange(qs, qe)[:, None])


def tiled_mask_queries_from_zero(q, k, v, causal, block_size):
    return tiled_learner(q, k, v, causal, block_size,
                         hidden=lambda qs, qe, ks, ke: torch.arange(ks, ke)[None, :] > torch.arange(qe - qs)[:, None])


def tiled_mask_triu_in_every_tile(q, k, v, causal, block_size):
    """The diagonal tile's triu(1) mask applied to every tile it visits."""
    return tiled_learner(q, k, v, causal, block_size,
                         hidden=lambda qs, qe, ks, ke: torch.ones(qe - qs, ke - ks, dtype=torch.bool).triu(1))


def tiled_mask_keys_offset_by_qs(q, k, v, causal, block_size):
    """Key positions from the query block's start: arange(qs, qs + bk)."""
    return tiled_learner(q, k, v, causal, block_size,
                         hidden=lambda qs, qe, ks, ke: torch.arange(qs, qs + ke - ks)[None, :] > torch.arange(qs, qe)[:, None])


def tiled_mask_swapped(q, k, v, causal, block_size):
    """Masks keys j < i: the past instead of the future."""
    return tiled_learner(q, k, v, causal, block_size,
                         hidden=lambda qs, qe, ks, ke: torch.arange(ks, ke)[None, :] < torch.arange(qs, qe)[:, None])


def tiled_diagonal_tile_unmasked(q, k, v, causal, block_size):
    """Skips the tiles right of the diagonal, but masks nothing inside the diagonal tile."""
    return tiled_learner(q, k, v, causal, block_size, hidden=lambda qs, qe, ks, ke: torch.zeros(qe - qs, ke - ks,
                                                                                                   dtype=torch.bool))


def tiled_hides_diagonal_but_query_0(q, k, v, causal, block_size):
    """Masks j >= i, and lets query 0 keep key 0 so that its row is not empty."""
    def hidden(qs, qe, ks, ke):
        i, j = torch.arange(qs, qe)[:, None], torch.arange(ks, ke)[None, :]
        return (j >= i) & ~((i == 0) & (j == 0))

    return tiled_learner(q, k, v, causal, block_size, hidden=hidden)


def tiled_lse_with_raw_max(q, k, v, causal, block_size):
    """lse from the max of the unscaled scores: m * sqrt(d) + log(l)."""
    root = math.sqrt(q.shape[-1])
    return tiled_learner(q, k, v, causal, block_size, lse_of=lambda m, l: m * root + torch.log(l))


def tiled_values_of_the_query_block(q, k, v, causal, block_size):
    """p @ v[:, :, qs:qe] where the tile is square, p @ v[:, :, ks:ke] where it is not."""
    B, H, T, d = q.shape
    out, lse = torch.zeros_like(q), torch.zeros(B, H, T)
    for qs in range(0, T, block_size):
        qe = min(qs + block_size, T)
        m, l, acc = torch.full((B, H, qe - qs), _INF), torch.zeros(B, H, qe - qs), torch.zeros(B, H, qe - qs, d)
        for ks in range(0, qe if causal else T, block_size):
            ke = min(ks + block_size, T)
            s = q[:, :, qs:qe] @ k[:, :, ks:ke].transpose(-2, -1) / math.sqrt(d)
            if causal:
                s = s.masked_fill(torch.arange(ks, ke)[None, :] > torch.arange(qs, qe)[:, None], _INF)
            m_new = torch.maximum(m, s.amax(dim=-1))
            p = torch.exp(s - m_new[..., None])
            vb = v[:, :, qs:qe] if qe - qs == ke - ks else v[:, :, ks:ke]
            l = l * torch.exp(m - m_new) + p.sum(dim=-1)
            acc = acc * torch.exp(m - m_new)[..., None] + p @ vb
            m = m_new
        out[:, :, qs:qe] = acc / l[..., None]
        lse[:, :, qs:qe] = m + torch.log(l)
    return out, lse


def _tiled_with(q, k, v, causal, block_size, combine):
    """The learner's loops with ``combine(acc, alpha, p, k_blk, v_blk, l) -> acc`` per tile; out = acc / l."""
    B, H, T, d = q.shape
    out, lse = torch.zeros_like(q), torch.zeros(B, H, T)
    for qs in range(0, T, block_size):
        qe = min(qs + block_size, T)
        m, l, acc = torch.full((B, H, qe - qs), _INF), torch.zeros(B, H, qe - qs), torch.zeros(B, H, qe - qs, d)
        for ks in range(0, qe if causal else T, block_size):
            ke = min(ks + block_size, T)
            s = q[:, :, qs:qe] @ k[:, :, ks:ke].transpose(-2, -1) / math.sqrt(d)
            if causal:
                s = s.masked_fill(torch.arange(ks, ke)[None, :] > torch.arange(qs, qe)[:, None], _INF)
            m_new = torch.maximum(m, s.amax(dim=-1))
            alpha, p = torch.exp(m - m_new), torch.exp(s - m_new[..., None])
            l = l * alpha + p.sum(dim=-1)
            acc, m = combine(acc, alpha, p, k[:, :, ks:ke], v[:, :, ks:ke], l), m_new
        out[:, :, qs:qe] = acc / l[..., None]
        lse[:, :, qs:qe] = m + torch.log(l)
    return out, lse


def tiled_rescale_after_add(q, k, v, causal, block_size):
    return _tiled_with(q, k, v, causal, block_size, lambda acc, a, p, kb, vb, l: (acc + p @ vb) * a[..., None])


def tiled_keys_as_values(q, k, v, causal, block_size):
    return _tiled_with(q, k, v, causal, block_size, lambda acc, a, p, kb, vb, l: acc * a[..., None] + p @ kb)


def tiled_state_outside_query_loop(q, k, v, causal, block_size):
    """m, l and acc created once: each query block starts from the previous one's."""
    return tiled_learner(q, k, v, causal, block_size, fresh_state=False)


def tiled_lse_m_plus_log2(q, k, v, causal, block_size):
    return tiled_learner(q, k, v, causal, block_size, lse_of=lambda m, l: m + torch.log2(l))


def tiled_lse_as_log2(q, k, v, causal, block_size):
    """Natural-log statistics, lse converted to bits at the end."""
    return tiled_learner(q, k, v, causal, block_size, lse_of=lambda m, l: (m + torch.log(l)) / math.log(2))


def tiled_lse_just_m(q, k, v, causal, block_size):
    return tiled_learner(q, k, v, causal, block_size, lse_of=lambda m, l: m)


def tiled_lse_is_l(q, k, v, causal, block_size):
    return tiled_learner(q, k, v, causal, block_size, lse_of=lambda m, l: l)


def tiled_one_max_per_tile(q, k, v, causal, block_size):
    """The tile's running max is one number per (batch, head), shared by its rows, in float64 and einsum:
    right unless a row's scores lie far below another row's of the tile (then exp underflows to 0)."""
    B, H, T, d = q.shape
    q64, k64, v64 = q.double(), k.double(), v.double()
    outs, lses = [], []
    for qs in range(0, T, block_size):
        qb = q64[:, :, qs:qs + block_size]
        m = torch.full((B, H, 1), _INF, dtype=torch.float64)
        l = torch.zeros(B, H, qb.shape[2], dtype=torch.float64)
        acc = torch.zeros_like(qb)
        for ks in range(0, T, block_size):
            s = torch.einsum("bhid,bhjd->bhij", qb, k64[:, :, ks:ks + block_size]) / math.sqrt(d)
            if causal:
                i = torch.arange(qs, qs + qb.shape[2])[:, None]
                s = s.masked_fill(torch.arange(ks, ks + s.shape[-1])[None, :] > i, _INF)
            m_new = torch.maximum(m, s.amax(dim=(-2, -1))[..., None])  # one max for the whole tile
            p = torch.exp(s - m_new[..., None])
            alpha = torch.exp(m - m_new)
            l = l * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + torch.einsum("bhij,bhjd->bhid", p, v64[:, :, ks:ks + block_size])
            m = m_new
        outs.append(acc / l[..., None])
        lses.append(m + l.log())
    return torch.cat(outs, dim=2).to(q.dtype), torch.cat(lses, dim=2).float()


WRONG = {
    "online_softmax": [
        (online_no_rescale, "rescale it, l = l * exp(m - m_new)"),
        (online_nan_on_masked_blocks, "exp(-inf - (-inf))"),
        (online_nan_on_empty_rows, "gives all zeros in this course, never NaN"),
        (online_ignores_block_size, "block_size=4 is not used"),
        (online_two_pass, "two-pass safe softmax"),
        (online_drops_last_block, "the last, shorter block was left out"),
        (online_no_max, "subtract the running max before exp"),
        (online_returns_float32, "expected dtype torch.float16"),
        (online_calls_helper, "called the course's own solution"),
        (online_numpy_whole_row, "took x out of PyTorch (.numpy())"),
        (online_two_pass_vectorised, "two-pass safe softmax"),
        (online_python_numbers, "into 192 Python numbers one at a time"),
        (online_inverse_rescale, "the rescale factor is inverted"),
        (online_inverse_rescale_guarded, "the rescale factor is inverted"),
        (online_inverse_rescale_first_block, "the rescale factor is inverted"),
        (online_max_starts_at_zero, "the running max starts at 0 instead of -inf"),
        (online_max_starts_at_zero_unguarded, "the running max starts at 0 instead of -inf"),
        (online_max_of_whole_row_first, "reduced whole rows of x at once"),
        (online_range_stops_a_block_early, "the last, shorter block was left out"),
        (online_slices_one_short, "each block misses its last entry"),
        (online_sum_of_last_block, "l holds the sum of the last block only"),
        (online_divides_per_block, "each block was divided by the sum of the blocks read so far"),
        (online_no_division, "the final division is missing"),
        (online_over_dim0, "the softmax over axis 0 (size 2), not over the last axis"),
        (online_no_max_in_float32, "subtract the running max before exp"),
        (online_output_with_first_block_max, "used the running max of the first block"),
        (online_exp_before_max_update, "used the max from before the block"),
        (online_block_sum_all_rows, "each block's sum also ran over axis 0"),
        (online_masked_as_minus_1e4, "yours is uniform, 1/8 everywhere"),
        (online_sum_doubled, "every row of your output is proportional to the right one"),
        (online_stale_block_exps, "kept with the running max of its time"),
    ],
    "flash_attention_tiled": [
        (tiled_no_acc_rescale, "the accumulator was not rescaled"),
        (tiled_no_normalisation, "the final normalisation is missing"),
        (tiled_lse_log2, "lse is in log2 units"),
        (tiled_lse_only_max, "lse is only the running max"),
        (tiled_causal_skips_diagonal, "the diagonal block was skipped"),
        (tiled_causal_hides_diagonal, "also hides the diagonal"),
        (tiled_drops_last_block, "the last, shorter"),
        (tiled_no_scale, "the scores are not scaled"),
        (tiled_full_scores, "a full [T, T] matrix"),
        (tiled_row_strips, "a strip of scores against every key"),
        (tiled_calls_sdpa, "torch's fused attention"),
        (tiled_calls_helper, "called the course's own solution"),
        (tiled_no_lse, "expected a tuple of 2 (out, lse)"),
        (tiled_numpy_full_attention, "took q, k or v out of PyTorch"),
        (tiled_lse_keepdim, "lse: expected shape [2, 3, 48]"),
        (tiled_scale_forgotten, "the scores are not scaled"),
        (tiled_mask_keys_from_zero, "counts the keys from 0 in every tile"),
        (tiled_mask_queries_from_zero, "counts the queries from 0 in every tile"),
        (tiled_mask_triu_in_every_tile, "the causal mask uses positions inside the tile"),
        (tiled_mask_keys_offset_by_qs, "the causal mask uses positions inside the tile"),
        (tiled_mask_swapped, "hides the past instead of the future"),
        (tiled_state_outside_query_loop, "m, l and acc carry over from one query block to the next"),
        (tiled_lse_m_plus_log2, "lse = m + log2(l) mixes units"),
        (tiled_lse_as_log2, "lse is in log2 units"),
        (tiled_lse_just_m, "lse is only the running max"),
        (tiled_lse_is_l, "lse is the running sum l itself"),
        (tiled_diagonal_tile_unmasked, "inside the diagonal tile"),
        (tiled_hides_diagonal_but_query_0, "every query i >= 1 attends to keys j < i only"),
        (tiled_lse_with_raw_max, "lse adds the max of the unscaled scores"),
        (tiled_values_of_the_query_block, "the value tile was taken at the query block's rows"),
        (tiled_rescale_after_add, "acc was rescaled after adding the new tile"),
        (tiled_keys_as_values, "p was multiplied by the key tile"),
        (tiled_one_max_per_tile, "so the rows of a tile shared one max"),
    ],
}


# ----------------------------------------------------------------- 9.3 / 9.4: Triton kernels
if triton is not None:
    LOG2E = 1.4426950408889634
    LN2 = 0.6931471805599453
    BLOCK = 32  # BLOCK_M = BLOCK_N: T = 128 is four blocks, T = 100 and 17 end in a partial one

    @triton.jit
    def _learner_fwd(
        Q, K, V, Out, Lse, sm_scale, stride_b, stride_h, stride_t, H, T,
        HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        MASK_LOADS: tl.constexpr, MASK_SCORES: tl.constexpr, MASK_STORE: tl.constexpr,
        CAUSAL_MODE: tl.constexpr,  # 0: keep j <= i; 1: keep j < i; 2: keep j >= i (wrong axis)
        SKIP_DIAG: tl.constexpr, SCALE_MODE: tl.constexpr,  # 0: sm_scale * log2(e); 1: no sm_scale; 2: no log2(e)
        RESCALE: tl.constexpr, NORMALISE: tl.constexpr, LSE_LOG2: tl.constexpr, LOADS_IGNORE_BATCH: tl.constexpr,
        FULL_KEY_BLOCKS_ONLY: tl.constexpr = False,
        KEY_BIAS_IN_BLOCK: tl.constexpr = False,  # keys >= T hidden by an additive bias on offs_n (block-relative)
        GRID: tl.constexpr = 0,  # 0: (query blocks, B * H); 1: (B * H, query blocks); 2: (query blocks, H, B)
    ):
        if GRID == 0:
            start_m = tl.program_id(0)
            off_bh = tl.program_id(1)
        elif GRID == 1:
            start_m = tl.program_id(1)
            off_bh = tl.program_id(0)
        else:
            start_m = tl.program_id(0)
            off_bh = tl.program_id(2) * H + tl.program_id(1)
        base = (off_bh // H) * stride_b + (off_bh % H) * stride_h
        load_base = base
        if LOADS_IGNORE_BATCH:
            load_base = (off_bh % H) * stride_h
        offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        q_ptrs = Q + load_base + offs_m[:, None] * stride_t + offs_d[None, :]
        if MASK_LOADS:
            q = tl.load(q_ptrs, mask=offs_m[:, None] < T, other=0.0)
        else:
            q = tl.load(q_ptrs)
        qk_scale = sm_scale * 1.4426950408889634
        if SCALE_MODE == 1:
            qk_scale = 1.4426950408889634
        if SCALE_MODE == 2:
            qk_scale = sm_scale
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        hi = T
        if FULL_KEY_BLOCKS_ONLY:
            hi = (T // BLOCK_N) * BLOCK_N  # "the last block is partial, skip it"
        if CAUSAL:
            if SKIP_DIAG:
                hi = start_m * BLOCK_M
            else:
                hi = tl.minimum((start_m + 1) * BLOCK_M, T)
        for start_n in range(0, hi, BLOCK_N):
            cols = start_n + offs_n
            k_ptrs = K + load_base + cols[:, None] * stride_t + offs_d[None, :]
            v_ptrs = V + load_base + cols[:, None] * stride_t + offs_d[None, :]
            if MASK_LOADS:
                k = tl.load(k_ptrs, mask=cols[:, None] < T, other=0.0)
                v = tl.load(v_ptrs, mask=cols[:, None] < T, other=0.0)
            else:
                k = tl.load(k_ptrs)
                v = tl.load(v_ptrs)
            qk = tl.dot(q, tl.trans(k)) * qk_scale
            if KEY_BIAS_IN_BLOCK:
                qk += tl.where(offs_n < T, 0.0, float("-inf"))[None, :]
            elif MASK_SCORES:
                qk = tl.where(cols[None, :] < T, qk, float("-inf"))
            if CAUSAL:
                if CAUSAL_MODE == 0:
                    qk = tl.where(offs_m[:, None] >= cols[None, :], qk, float("-inf"))
                elif CAUSAL_MODE == 1:
                    qk = tl.where(offs_m[:, None] > cols[None, :], qk, float("-inf"))
                else:
                    qk = tl.where(offs_m[:, None] <= cols[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.exp2(qk - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            if RESCALE:
                acc = acc * alpha[:, None]
            acc = tl.dot(p.to(v.dtype), v, acc)
            m_i = m_new
        if NORMALISE:
            acc = acc / l_i[:, None]
        lse = m_i + tl.log2(l_i)  # log2 units
        if not LSE_LOG2:
            lse = lse * 0.6931471805599453
        o_ptrs = Out + base + offs_m[:, None] * stride_t + offs_d[None, :]
        if MASK_STORE:
            tl.store(o_ptrs, acc.to(Out.dtype.element_ty), mask=offs_m[:, None] < T)
            tl.store(Lse + off_bh * T + offs_m, lse, mask=offs_m < T)
        else:
            tl.store(o_ptrs, acc.to(Out.dtype.element_ty))
            tl.store(Lse + off_bh * T + offs_m, lse)

    def _forward(name, grid_floor=False, out_fp32=False, return_lse=False, block=BLOCK, grid_heads=True, **mistakes):
        """A learner's launcher around _learner_fwd with the given mistakes switched on (GRID=1 or 2: the
        same kernel on another, correct, grid layout)."""
        flags = dict(MASK_LOADS=True, MASK_SCORES=True, MASK_STORE=True, CAUSAL_MODE=0, SKIP_DIAG=False,
                     SCALE_MODE=0, RESCALE=True, NORMALISE=True, LSE_LOG2=False, LOADS_IGNORE_BATCH=False)
        flags.update(mistakes)

        def flash_attention_triton(q, k, v, causal=False):
            B, H, T, d = q.shape
            out = torch.empty(q.shape, dtype=torch.float32, device=q.device) if out_fp32 else torch.empty_like(q)
            lse = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
            n_blocks = T // block if grid_floor else triton.cdiv(T, block)
            grid = {0: (n_blocks, B * H if grid_heads else B), 1: (B * H, n_blocks), 2: (n_blocks, H, B)}[flags.get("GRID", 0)]
            _learner_fwd[grid](
                q, k, v, out, lse, 1 / math.sqrt(d), q.stride(0), q.stride(1), q.stride(2), H, T,
                HEAD_DIM=d, CAUSAL=causal, BLOCK_M=block, BLOCK_N=block, **flags,
            )
            return (out, lse) if return_lse else out

        flash_attention_triton.__name__ = name
        return flash_attention_triton

    @triton.jit
    def _learner_bwd_dkdv(
        Q, K, V, DO, DK, DV, Lse, Delta, sm_scale, stride_b, stride_h, stride_t, H, T,
        HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        MASK_LOADS: tl.constexpr, MASK_STORE: tl.constexpr,
        CAUSAL_MODE: tl.constexpr,  # 0: ok; 1: no mask, all blocks; 2: keep j < i; 3: blocks skipped, no mask;
        # 4: blocks skipped, keep j >= i
        SCALE_GRADS: tl.constexpr, USE_DELTA: tl.constexpr, LSE_CONVERT: tl.constexpr,
        DKDV_MISTAKE: tl.constexpr = 0,  # 1: dV from P (no transpose); 2: dK from P; 3: starts after the diagonal block;
        # 4: dV from dS; 5: lse read at the key positions
    ):
        start_n = tl.program_id(0)
        off_bh = tl.program_id(1)
        base = (off_bh // H) * stride_b + (off_bh % H) * stride_h
        offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        kv_offs = base + offs_n[:, None] * stride_t + offs_d[None, :]
        if MASK_LOADS:
            k = tl.load(K + kv_offs, mask=offs_n[:, None] < T, other=0.0)
            v = tl.load(V + kv_offs, mask=offs_n[:, None] < T, other=0.0)
        else:
            k = tl.load(K + kv_offs)
            v = tl.load(V + kv_offs)
        dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
        lo = 0
        if CAUSAL and CAUSAL_MODE != 1:
            lo = start_n * BLOCK_N  # queries before this key block never see it
            if DKDV_MISTAKE == 3:
                lo = (start_n + 1) * BLOCK_N
        for start_m in range(lo, T, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            q_offs = base + offs_m[:, None] * stride_t + offs_d[None, :]
            if MASK_LOADS:
                q = tl.load(Q + q_offs, mask=offs_m[:, None] < T, other=0.0)
                do = tl.load(DO + q_offs, mask=offs_m[:, None] < T, other=0.0)
                lse = tl.load(Lse + off_bh * T + offs_m, mask=offs_m < T, other=0.0)
                delta = tl.load(Delta + off_bh * T + offs_m, mask=offs_m < T, other=0.0)
            else:
                q = tl.load(Q + q_offs)
                do = tl.load(DO + q_offs)
                lse = tl.load(Lse + off_bh * T + offs_m)
                delta = tl.load(Delta + off_bh * T + offs_m)
            qkT = tl.dot(k, tl.trans(q))  # [BLOCK_N keys, BLOCK_M queries]
            if DKDV_MISTAKE == 5:  # lse read at this program's key positions
                lse = tl.load(Lse + off_bh * T + offs_n, mask=offs_n < T, other=0.0)
            if LSE_CONVERT:
                pT = tl.exp2(qkT * sm_scale * 1.4426950408889634 - lse[None, :] * 1.4426950408889634)
            else:
                pT = tl.exp2(qkT * sm_scale * 1.4426950408889634 - lse[None, :])
            if MASK_LOADS:
                pT = tl.where(offs_m[None, :] < T, pT, 0.0)
            if CAUSAL:
                if CAUSAL_MODE == 0:
                    pT = tl.where(offs_m[None, :] >= offs_n[:, None], pT, 0.0)
                elif CAUSAL_MODE == 2:
                    pT = tl.where(offs_m[None, :] > offs_n[:, None], pT, 0.0)
                elif CAUSAL_MODE == 4:
                    pT = tl.where(offs_m[None, :] <= offs_n[:, None], pT, 0.0)
            dpT = tl.dot(v, tl.trans(do))
            if USE_DELTA:
                dsT = pT * (dpT - delta[None, :])
            else:
                dsT = pT * dpT
            if DKDV_MISTAKE == 1:
                dv = tl.dot(tl.trans(pT).to(do.dtype), do, dv)
            elif DKDV_MISTAKE == 4:
                dv = tl.dot(dsT.to(do.dtype), do, dv)
            else:
                dv = tl.dot(pT.to(do.dtype), do, dv)
            if DKDV_MISTAKE == 2:
                dk = tl.dot(pT.to(q.dtype), q, dk)
            else:
                dk = tl.dot(dsT.to(q.dtype), q, dk)
        if SCALE_GRADS:
            dk = dk * sm_scale
        if MASK_STORE:
            tl.store(DK + kv_offs, dk.to(DK.dtype.element_ty), mask=offs_n[:, None] < T)
            tl.store(DV + kv_offs, dv.to(DV.dtype.element_ty), mask=offs_n[:, None] < T)
        else:
            tl.store(DK + kv_offs, dk.to(DK.dtype.element_ty))
            tl.store(DV + kv_offs, dv.to(DV.dtype.element_ty))

    @triton.jit
    def _learner_bwd_dq(
        Q, K, V, DO, DQ, Lse, Delta, sm_scale, stride_b, stride_h, stride_t, H, T,
        HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        MASK_LOADS: tl.constexpr, MASK_STORE: tl.constexpr, CAUSAL_MODE: tl.constexpr,
        SCALE_GRADS: tl.constexpr, USE_DELTA: tl.constexpr, LSE_CONVERT: tl.constexpr,
        DKDV_MISTAKE: tl.constexpr = 0,  # (the dK/dV kernel's)
    ):
        start_m = tl.program_id(0)
        off_bh = tl.program_id(1)
        base = (off_bh // H) * stride_b + (off_bh % H) * stride_h
        offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        q_offs = base + offs_m[:, None] * stride_t + offs_d[None, :]
        if MASK_LOADS:
            q = tl.load(Q + q_offs, mask=offs_m[:, None] < T, other=0.0)
            do = tl.load(DO + q_offs, mask=offs_m[:, None] < T, other=0.0)
            lse = tl.load(Lse + off_bh * T + offs_m, mask=offs_m < T, other=0.0)
            delta = tl.load(Delta + off_bh * T + offs_m, mask=offs_m < T, other=0.0)
        else:
            q = tl.load(Q + q_offs)
            do = tl.load(DO + q_offs)
            lse = tl.load(Lse + off_bh * T + offs_m)
            delta = tl.load(Delta + off_bh * T + offs_m)
        dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        hi = T
        if CAUSAL and CAUSAL_MODE != 1:
            hi = tl.minimum((start_m + 1) * BLOCK_M, T)
        for start_n in range(0, hi, BLOCK_N):
            cols = start_n + tl.arange(0, BLOCK_N)
            kv_offs = base + cols[:, None] * stride_t + offs_d[None, :]
            if MASK_LOADS:
                k = tl.load(K + kv_offs, mask=cols[:, None] < T, other=0.0)
                v = tl.load(V + kv_offs, mask=cols[:, None] < T, other=0.0)
            else:
                k = tl.load(K + kv_offs)
                v = tl.load(V + kv_offs)
            qk = tl.dot(q, tl.trans(k))
            if LSE_CONVERT:
                p = tl.exp2(qk * sm_scale * 1.4426950408889634 - lse[:, None] * 1.4426950408889634)
            else:
                p = tl.exp2(qk * sm_scale * 1.4426950408889634 - lse[:, None])
            if MASK_LOADS:
                p = tl.where(cols[None, :] < T, p, 0.0)
            if CAUSAL:
                if CAUSAL_MODE == 0:
                    p = tl.where(offs_m[:, None] >= cols[None, :], p, 0.0)
                elif CAUSAL_MODE == 2:
                    p = tl.where(offs_m[:, None] > cols[None, :], p, 0.0)
                elif CAUSAL_MODE == 4:
                    p = tl.where(offs_m[:, None] <= cols[None, :], p, 0.0)
            dp = tl.dot(do, tl.trans(v))
            if USE_DELTA:
                ds = p * (dp - delta[:, None])
            else:
                ds = p * dp
            dq = tl.dot(ds.to(k.dtype), k, dq)
        if SCALE_GRADS:
            dq = dq * sm_scale
        if MASK_STORE:
            tl.store(DQ + q_offs, dq.to(DQ.dtype.element_ty), mask=offs_m[:, None] < T)
        else:
            tl.store(DQ + q_offs, dq.to(DQ.dtype.element_ty))

    def _backward(name, grads_fp32=False, delta_without_o=False, k_first=False, block=BLOCK, **mistakes):
        """A learner's backward launcher (D in PyTorch, then the two kernels) with mistakes switched on."""
        flags = dict(MASK_LOADS=True, MASK_STORE=True, CAUSAL_MODE=0, SCALE_GRADS=True, USE_DELTA=True, LSE_CONVERT=True)
        flags.update(mistakes)

        def flash_attention_triton_backward(q, k, v, out, lse, grad_out, causal=False):
            B, H, T, d = q.shape
            if delta_without_o:
                delta = grad_out.float().sum(dim=-1).contiguous()
            else:
                delta = (out.float() * grad_out.float()).sum(dim=-1).contiguous()  # D = rowsum(dO * O)
            make = (lambda x: torch.empty(x.shape, dtype=torch.float32, device=x.device)) if grads_fp32 else torch.empty_like
            dq, dk, dv = make(q), make(k), make(v)
            args = (1 / math.sqrt(d), q.stride(0), q.stride(1), q.stride(2), H, T)
            meta = dict(HEAD_DIM=d, CAUSAL=causal, BLOCK_M=block, BLOCK_N=block, **flags)
            grid = (triton.cdiv(T, block), B * H)
            _learner_bwd_dkdv[grid](q, k, v, grad_out, dk, dv, lse, delta, *args, **meta)
            _learner_bwd_dq[grid](q, k, v, grad_out, dq, lse, delta, *args, **meta)
            return (dk, dq, dv) if k_first else (dq, dk, dv)

        flash_attention_triton_backward.__name__ = name
        return flash_attention_triton_backward

    def triton_forward_in_pytorch(q, k, v, causal=False):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def triton_forward_calls_course_kernel(q, k, v, causal=False):
        from helpers.nb09_triton_flash import flash_attention_triton_forward

        return flash_attention_triton_forward(q, k, v, causal=causal)

    def triton_backward_in_pytorch(q, k, v, out, lse, grad_out, causal=False):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(grad_out)
        return q.grad, k.grad, v.grad

    @triton.jit
    def _copy_kernel(Src, Dst, N, Q, K, V, BLOCK: tl.constexpr):
        """Copies Src into Dst; takes q, k and v too, without using them."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(Dst + offs, tl.load(Src + offs, mask=offs < N), mask=offs < N)

    def _copy_with_kernel(src, q, k, v):
        dst = torch.empty_like(src)
        _copy_kernel[(triton.cdiv(src.numel(), 256),)](src.contiguous(), dst, src.numel(), q, k, v, BLOCK=256)
        return dst

    def triton_forward_copies_sdpa(q, k, v, causal=False):
        return _copy_with_kernel(F.scaled_dot_product_attention(q, k, v, is_causal=causal), q, k, v)

    def triton_forward_copies_numpy(q, k, v, causal=False):
        import numpy as np

        s = q.numpy() @ np.swapaxes(k.numpy(), -1, -2) / math.sqrt(q.shape[-1])
        if causal:
            T = q.shape[-2]
            s = np.where(np.tril(np.ones((T, T), dtype=bool)), s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        out = torch.from_numpy((p / p.sum(-1, keepdims=True)) @ v.numpy()).to(q.dtype)
        return _copy_with_kernel(out, q, k, v)

    def triton_forward_laundered_through_copies(q, k, v, causal=False):
        """Copies q, k, v with a kernel first (so that their copies look kernel-made), computes the
        attention of the copies in PyTorch, and copies the result out with the kernel again."""
        q2, k2, v2 = (_copy_with_kernel(t, q, k, v) for t in (q, k, v))
        return _copy_with_kernel(F.scaled_dot_product_attention(q2, k2, v2, is_causal=causal), q, k, v)

    def triton_forward_returns_meta(q, k, v, causal=False):
        _forward("correct")(q, k, v, causal)
        return torch.empty_like(q, device="meta")

    def triton_backward_copies_autograd(q, k, v, out, lse, grad_out, causal=False):
        q2, k2, v2 = (t.detach().requires_grad_() for t in (q, k, v))
        F.scaled_dot_product_attention(q2, k2, v2, is_causal=causal).backward(grad_out)
        return tuple(_copy_with_kernel(t.grad, q, k, v) for t in (q2, k2, v2))

    WRONG["flash_attention_triton"] = [
        (_forward("fwd_unmasked_loads", MASK_LOADS=False), "read past the end of q, k or v"),
        (_forward("fwd_keys_past_T_not_masked", MASK_SCORES=False),
         "Set the scores of those keys to -inf, by their position in the sequence"),
        (_forward("fwd_unmasked_store", MASK_STORE=False), "wrote past the end"),
        (_forward("fwd_grid_floor", grid_floor=True), "never written"),
        (_forward("fwd_causal_strict", CAUSAL_MODE=1), "offs_m[:, None] >= offs_n[None, :]"),
        (_forward("fwd_causal_wrong_axis", CAUSAL_MODE=2), "future keys"),
        (_forward("fwd_causal_skips_diagonal", SKIP_DIAG=True), "diagonal block"),
        (_forward("fwd_no_sm_scale", SCALE_MODE=1), "not scaled by 1 / sqrt(d)"),
        (_forward("fwd_exp2_without_log2e", SCALE_MODE=2), "not multiplied by log2(e)"),
        (_forward("fwd_no_rescale", RESCALE=False), "the accumulator was not rescaled"),
        (_forward("fwd_no_normalisation", NORMALISE=False), "divide the accumulator by l"),
        (_forward("fwd_lse_log2", return_lse=True, LSE_LOG2=True), "lse is in log2 units"),
        (_forward("fwd_out_float32", out_fp32=True), "expected dtype torch.float16"),
        (_forward("fwd_loads_ignore_batch", LOADS_IGNORE_BATCH=True), "b * stride_b + h * stride_h"),
        (triton_forward_in_pytorch, "no Triton kernel ran"),
        # the call guard ("called the course's own solution") sees the reference only if its module was
        # imported before the call; else the watcher does ("launched the course's kernel"): both name it
        (triton_forward_calls_course_kernel, "the course's"),
        (_forward("fwd_grid_forgets_heads", grid_heads=False), "one per batch and head"),
        (_forward("fwd_skips_last_key_block", FULL_KEY_BLOCKS_ONLY=True),
         "got no weight from any query: the loop over key blocks stops before the last, partial block"),
        (triton_forward_copies_sdpa, "computed with q, k and v in PyTorch"),
        (triton_forward_copies_numpy, "took q, k or v out of PyTorch"),
        (triton_forward_laundered_through_copies, "computed with q, k and v in PyTorch"),
        (triton_forward_returns_meta, "meta device"),
        (_forward("fwd_key_bias_block_relative", KEY_BIAS_IN_BLOCK=True),
         "your key mask works in the first key block only"),
    ]
    WRONG["flash_attention_triton_backward"] = [
        (_backward("bwd_causal_blocks_but_no_mask", CAUSAL_MODE=3), "causal mask is missing in the backward pass"),
        (_backward("bwd_no_sm_scale", SCALE_GRADS=False), "miss the softmax scale"),
        (_backward("bwd_no_delta", USE_DELTA=False), "D is missing"),
        (_backward("bwd_lse_not_converted", LSE_CONVERT=False), "lse in the wrong units"),
        (_backward("bwd_no_causal_mask", CAUSAL_MODE=1), "causal mask is missing in the backward pass"),
        (_backward("bwd_causal_strict", CAUSAL_MODE=2), "also hides the diagonal"),
        (_backward("bwd_unmasked_loads", MASK_LOADS=False), "T is not a multiple of the block"),
        (_backward("bwd_unmasked_store", MASK_STORE=False), "wrote past the end"),
        (_backward("bwd_grads_float32", grads_fp32=True), "expected dtype torch.float16"),
        (triton_backward_in_pytorch, "no Triton kernel ran"),
        (triton_backward_copies_autograd, "computed with q, k and v in PyTorch"),
        (_backward("bwd_dv_from_p_untransposed", DKDV_MISTAKE=1), "yours adds tl.dot(p, do): transpose P"),
        (_backward("bwd_dk_from_p", DKDV_MISTAKE=2), "dK was accumulated from P"),
        (_backward("bwd_dkdv_after_diagonal_block", block=16, DKDV_MISTAKE=3), "dK and dV miss the diagonal block"),
        (_backward("bwd_causal_keeps_future", block=16, CAUSAL_MODE=4), "the backward mask keeps keys j >= i"),
        (_backward("bwd_delta_without_o", delta_without_o=True), "yours is rowsum(dO), the O is missing"),
        (_backward("bwd_k_first", k_first=True), "returned in the wrong order"),
        (_backward("bwd_dv_from_ds", DKDV_MISTAKE=4), "dV was accumulated from dS"),
        (_backward("bwd_lse_at_keys", DKDV_MISTAKE=5), "read lse at its key positions"),
    ]


# =============================================================== right variants


# ----------------------------------------------------------------- 9.1 online_softmax
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


def online_split_float64(x, block_size):
    """Blocks from x.split(block_size, dim=-1), statistics in float64, the guards as masks."""
    m = torch.full(x.shape[:-1], _INF, dtype=torch.float64)
    l = torch.zeros(x.shape[:-1], dtype=torch.float64)
    for block in x.double().split(block_size, dim=-1):
        m_new = torch.maximum(m, block.amax(dim=-1))
        shift = m_new.nan_to_num(neginf=0.0)
        l = l * torch.exp(m - shift) + torch.exp(block - shift[..., None]).sum(dim=-1)
        m = m_new
    p = torch.exp(x.double() - m.nan_to_num(neginf=0.0)[..., None])
    return (p / torch.where(l > 0, l, 1.0)[..., None]).to(x.dtype)

# ----------------------------------------------------------------- 9.2 flash_attention_tiled
def tiled_learner(q, k, v, causal, block_size, *, scale=None, hidden=None, lse_of=None, fresh_state=True):
    """The learner's loops as in the wrong versions, without a mistake: zeros to start, global
    positions for the causal mask, key blocks up to and including the diagonal. The wrong versions
    change one thing through the keywords: ``scale`` multiplies the scores instead of dividing by
    sqrt(d), ``hidden(qs, qe, ks, ke)`` is a tile's causal mask, ``lse_of(m, l)`` the lse, and
    ``fresh_state=False`` creates m, l, acc once, before the loop over query blocks."""
    B, H, T, d = q.shape
    hidden = hidden or (lambda qs, qe, ks, ke: torch.arange(ks, ke)[None, :] > torch.arange(qs, qe)[:, None])
    out, lse = torch.zeros_like(q), torch.zeros(B, H, T)
    m = torch.full((B, H, block_size), _INF)
    l = torch.zeros(B, H, block_size)
    acc = torch.zeros(B, H, block_size, d)
    for qs in range(0, T, block_size):
        qe = min(qs + block_size, T)
        if fresh_state:
            m = torch.full((B, H, qe - qs), _INF)
            l = torch.zeros(B, H, qe - qs)
            acc = torch.zeros(B, H, qe - qs, d)
        for ks in range(0, qe if causal else T, block_size):
            ke = min(ks + block_size, T)
            s = q[:, :, qs:qe] @ k[:, :, ks:ke].transpose(-2, -1)
            s = s / math.sqrt(d) if scale is None else s * scale
            if causal:
                s = s.masked_fill(hidden(qs, qe, ks, ke), _INF)
            m_new = torch.maximum(m, s.amax(dim=-1))
            alpha = torch.exp(m - m_new)
            p = torch.exp(s - m_new[..., None])
            l = l * alpha + p.sum(dim=-1)
            acc = acc * alpha[..., None] + p @ v[:, :, ks:ke]
            m = m_new
        out[:, :, qs:qe] = acc / l[..., None]
        lse[:, :, qs:qe] = lse_of(m, l) if lse_of else m + torch.log(l)
    return out, lse


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


def tiled_split_float64(q, k, v, causal, block_size):
    """Blocks from .split, q pre-scaled, einsum, statistics kept as [..., 1] in float64, the causal mask from
    global positions with torch.where; out back in q's dtype and lse in float32."""
    scale = q.shape[-1] ** -0.5
    outs, lses = [], []
    for qs, qb in zip(range(0, q.shape[2], block_size), (q.double() * scale).split(block_size, dim=2)):
        m = torch.full(qb.shape[:-1] + (1,), _INF, dtype=torch.float64)
        l = torch.zeros_like(m)
        acc = torch.zeros_like(qb)
        rows = torch.arange(qs, qs + qb.shape[2])[:, None]
        for ks, kb, vb in zip(range(0, k.shape[2], block_size), k.double().split(block_size, dim=2),
                              v.double().split(block_size, dim=2)):
            if causal and ks > rows[-1, 0]:
                break
            s = torch.einsum("bhid,bhjd->bhij", qb, kb)
            if causal:
                s = torch.where(torch.arange(ks, ks + kb.shape[2])[None, :] <= rows, s, _INF)
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            p = torch.exp(s - m_new)
            alpha = torch.exp(m - m_new)
            l = alpha * l + p.sum(-1, keepdim=True)
            acc = alpha * acc + torch.einsum("bhij,bhjd->bhid", p, vb)
            m = m_new
        outs.append(acc / l)
        lses.append((m + l.log())[..., 0])
    return torch.cat(outs, dim=2).to(q.dtype), torch.cat(lses, dim=2).float()


RIGHT = {
    "online_softmax": [online_log_space, online_row_by_row, online_keepdim, online_python_stats_per_block,
                       online_split_float64],
    "flash_attention_tiled": [tiled_learner, tiled_masks_every_tile, tiled_split_float64],
}


# ----------------------------------------------------------------- 9.3 / 9.4: Triton kernels
if triton is not None:
    # The learner's kernels of the wrong implementations above with no mistake switched on: other tile
    # sizes, with or without lse, and other (correct) grid layouts.
    RIGHT["flash_attention_triton"] = [
        _forward("fwd_block32_with_lse", block=32, return_lse=True),
        _forward("fwd_block16", block=16),
        _forward("fwd_block64_with_lse", block=64, return_lse=True),
        _forward("fwd_grid_bh_first", GRID=1),
        _forward("fwd_grid_3d", GRID=2),
    ]
    RIGHT["flash_attention_triton_backward"] = [_backward("bwd_learner")]

    # The learner's forward kernel, autotuned over two tile sizes (in the interpreter
    # the check takes the first config without benchmarking: benchmarks need a GPU).
    _autotuned_fwd = triton.autotune(
        configs=[triton.Config({"BLOCK_M": 32, "BLOCK_N": 32}), triton.Config({"BLOCK_M": 16, "BLOCK_N": 16})],
        key=["T", "HEAD_DIM"],
    )(_learner_fwd)

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


# ----------------------------------------------------------------- what the right variants do not show
def test_two_pass_is_seen_whatever_computes_the_block_maxima():
    with pytest.raises(CheckFailed, match="two-pass safe softmax"):
        checks.online_softmax(online_two_pass)
    with pytest.raises(CheckFailed, match="two-pass safe softmax"):
        checks.online_softmax(online_two_pass_vectorised)


@needs_triton
@pytest.mark.slow  # make test: test_triton_instruments_are_removed_after_an_autotuned_run runs the same check
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
@pytest.mark.parametrize("result, message", [
    ("oops", "expected the output tensor, or a tuple"),
    (("out", "lse"), "expected the output tensor, or a tuple"),
    (None, "forget the `return`"),
])
def test_triton_forward_explains_odd_return_values(result, message):
    def odd(q, k, v, causal=False):
        _forward("correct")(q, k, v, causal)
        return result

    with pytest.raises(CheckFailed, match=message):
        checks.flash_attention_triton(odd)



@needs_triton
def test_triton_forward_explains_a_non_tensor_lse():
    def lse_as_list(q, k, v, causal=False):
        out, lse = _forward("correct", return_lse=True)(q, k, v, causal)
        return out, lse.tolist()

    with pytest.raises(CheckFailed, match="lse: expected a torch.Tensor"):
        checks.flash_attention_triton(lse_as_list)


# The Triton kernels run in the interpreter and the tiled function loops over tiles in Python: a
# case of their checks takes 0.3-2 s, 70 of them ~30 s on 2 cores; 9.1 has 30 cases, some of 0.3-0.9 s.
# make test keeps the first (commonest) mistakes and the first right variant of each; make test-all
# runs all of them. (9.1's course-solution call, NumPy and op-log mistakes have stand-ins in make test:
# test_machinery's refusal of the reference on 9.1, test_provenance_sees_data_leave_pytorch and
# test_two_pass_is_seen_whatever_computes_the_block_maxima.)
FAST_WRONG = {"online_softmax": 7, "flash_attention_tiled": 3, "flash_attention_triton": 3,
              "flash_attention_triton_backward": 3}
FAST_RIGHT = {"online_softmax": 1, "flash_attention_tiled": 1, "flash_attention_triton": 1}


@pytest.mark.parametrize(("name", "wrong", "hint"), first_fast(wrong_cases(WRONG), FAST_WRONG))
def test_check_rejects_wrong(name, wrong, hint):
    assert_rejected(name, wrong, hint)


@pytest.mark.parametrize(("name", "right"), first_fast(right_cases(RIGHT), FAST_RIGHT))
def test_check_accepts_right(name, right):
    assert_accepted(name, right)
