"""Tests of helpers/nb09_flash_attention.py (PyTorch teaching versions) and helpers/nb09_triton_flash.py (Triton kernels).

Without a CUDA GPU the kernels run in Triton's interpreter (importing helpers.nb09_triton_flash turns it
on), so sequences stay short and each axis (T, d, causal, dtype, GQA) is covered by a few cases
rather than by the full product. References: torch's scaled_dot_product_attention and autograd,
computed in float32 from the same (possibly fp16) inputs.

Tolerances (max |got - ref| <= atol + rtol * |ref|):
* fp32: the interpreter (and "ieee" dots on a GPU) compute in true fp32; only the summation order
  and exp2-vs-exp differ from torch, giving ~1e-6 here, so 1e-4 leaves margin without hiding bugs.
* fp16 forward: fp16 x fp16 products are exact in the fp32 accumulator, but P is rounded to fp16
  before P @ V (relative error 2^-11 ~ 5e-4 per weight) and the output is rounded to fp16 (half an
  ulp is 2^-11 * |out|, |out| <~ 2 here): atol = rtol = 2e-3 (measured max error ~1e-3).
* fp16 backward: dS is rounded to fp16 before dK = dS^T Q and dQ = dS K, and those sums run over
  up to T = 257 terms of size ~|q| or |k| ~ 1, so errors grow like sqrt(T) * 5e-4; the result is
  rounded to fp16 too: atol = rtol = 1e-2 (measured max error ~3e-3).
A mistake in masking, scaling or indexing gives errors of order 0.1-1, far above all of these.
"""

from __future__ import annotations

import importlib
import math
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from helpers.nb09_flash_attention import flash_attention_tiled, online_softmax

try:
    from helpers import nb09_triton_flash as tf  # turns on the interpreter when there is no CUDA GPU
except ImportError:  # macOS / Windows: no Triton; the PyTorch tests still run
    tf = None

needs_triton = pytest.mark.skipif(tf is None, reason="Triton is Linux-only")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {  # (atol, rtol), see the module docstring
    (torch.float32, "fwd"): (1e-4, 1e-4),
    (torch.float32, "bwd"): (1e-4, 1e-4),
    (torch.float16, "fwd"): (2e-3, 2e-3),
    (torch.float16, "bwd"): (1e-2, 1e-2),
    (torch.bfloat16, "fwd"): (1.6e-2, 1.6e-2),  # bf16 keeps 8 bits of mantissa: 2^-8 = 4e-3 per rounding
    (torch.bfloat16, "bwd"): (6e-2, 6e-2),
}


def make_qkv(B, H, H_kv, T_q, d, dtype=torch.float32, T_k=None, seed=0, device=DEVICE):
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


def sdpa_grads(q, k, v, grad_out, causal):
    """(out, dq, dk, dv) of torch's SDPA in float32, by autograd."""
    q, k, v = (t.detach().float().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
    out.backward(grad_out.float())
    return out.detach(), q.grad, k.grad, v.grad


def assert_close(got, ref, dtype, kind, what):
    atol, rtol = TOL[(dtype, kind)]
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert not got.isnan().any(), f"{what}: NaN (an element never written?)"
    torch.testing.assert_close(got.float(), ref.float(), atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


# --------------------------------------------------------------------------------------------
# online_softmax
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# flash_attention_tiled (PyTorch)
# --------------------------------------------------------------------------------------------


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
    q, k, v = make_qkv(B, H, H_kv, T_q, d, T_k=T_k, device="cpu")
    out, lse = flash_attention_tiled(q, k, v, causal=causal, block_size=block)
    ref, ref_lse = sdpa_reference(q, k, v, causal)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    assert lse.dtype == torch.float32 and lse.shape == (B, H, T_q)


def test_tiled_scale_and_half_precision():
    q, k, v = make_qkv(1, 2, 2, 30, 16, dtype=torch.float16, device="cpu")
    out, lse = flash_attention_tiled(q, k, v, causal=True, block_size=8, sm_scale=0.3)
    ref, ref_lse = sdpa_reference(q, k, v, True, sm_scale=0.3)
    assert out.dtype == torch.float16
    assert_close(out, ref, torch.float16, "fwd", "out")
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
    q, k, v = make_qkv(1, 2, 2, T, d, device="cpu")
    with ShapeRecorder() as rec:
        flash_attention_tiled(q, k, v, causal=causal, block_size=block)
    big = [(op, s) for op, s in rec.ops if len(s) >= 2 and s[-1] > block and s[-2] > block]
    assert not big, f"tensors larger than a tile in both of the last two dims: {big[:3]}"
    # one row max per score tile: causal visits only tiles on or below the diagonal
    n = math.ceil(T / block)
    tiles = sum(op == "aten.amax" for op, _ in rec.ops)
    assert tiles == (n * (n + 1) // 2 if causal else n * n)


def test_tiled_rejects_bad_inputs():
    q, k, v = make_qkv(1, 4, 4, 8, 8, device="cpu")
    with pytest.raises(ValueError, match=r"leading \(batch\) dims"):  # [H, T, d] with [B, H, T, d]
        flash_attention_tiled(q[0], k, v)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        flash_attention_tiled(q, k[:, :3], v[:, :3])
    with pytest.raises(ValueError, match="T_q == T_k"):
        flash_attention_tiled(q, k[:, :, :5], v[:, :, :5], causal=True)
    with pytest.raises(ValueError, match="block_size"):
        flash_attention_tiled(q, k, v, block_size=0)


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------

# (B, H, H_kv, T, d, causal, dtype): each T, d, causal, dtype and GQA value appears, not the product.
KERNEL_CASES = [
    (1, 2, 2, 1, 16, False, torch.float32),
    (2, 1, 1, 1, 64, True, torch.float16),
    (2, 2, 2, 17, 32, True, torch.float32),
    (1, 2, 2, 17, 128, False, torch.float16),
    (1, 2, 2, 100, 64, False, torch.float16),
    (1, 2, 2, 100, 16, True, torch.float32),
    (1, 2, 2, 257, 64, True, torch.float16),
    (1, 2, 2, 257, 128, False, torch.float32),
    (1, 4, 2, 100, 32, True, torch.float16),  # GQA, 2 query heads per kv head
    (1, 4, 1, 257, 64, False, torch.float32),  # MQA
    (1, 4, 1, 100, 128, True, torch.float16),  # MQA, causal
]


@pytest.fixture
def nan_empty(monkeypatch):
    """Make torch.empty return NaN-filled float tensors, so an output element the kernel never
    writes shows up as NaN instead of whatever the memory held."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", empty)


@needs_triton
@pytest.mark.parametrize("B, H, H_kv, T, d, causal, dtype", KERNEL_CASES)
def test_triton_forward_backward_match_sdpa(B, H, H_kv, T, d, causal, dtype, nan_empty):
    q, k, v = make_qkv(B, H, H_kv, T, d, dtype=dtype)
    grad_out = torch.randn(B, H, T, d, generator=torch.Generator().manual_seed(5)).to(DEVICE, dtype)
    ref, ref_dq, ref_dk, ref_dv = sdpa_grads(q, k, v, grad_out, causal)
    _, ref_lse = sdpa_reference(q, k, v, causal)

    out, lse = tf.flash_attention_triton_forward(q, k, v, causal=causal)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_close(out, ref, dtype, "fwd", "out")
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)  # fp32 arithmetic even for fp16 inputs

    dq, dk, dv = tf.flash_attention_triton_backward(q, k, v, out, lse, grad_out, causal=causal)
    assert dk.shape == k.shape and dv.shape == v.shape  # GQA: gradients per kv head, not expanded
    for name, got, want in (("dq", dq, ref_dq), ("dk", dk, ref_dk), ("dv", dv, ref_dv)):
        assert got.dtype == dtype
        assert_close(got, want, dtype, "bwd", name)


@needs_triton
@pytest.mark.parametrize("causal", [False, True])
def test_triton_autograd_function(causal):
    q, k, v = make_qkv(1, 4, 2, 45, 32)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = tf.flash_attention_triton(q, k, v, causal=causal, sm_scale=0.2)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    qr, kr, vr = (t.detach().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qr, kr, vr, is_causal=causal, scale=0.2, enable_gqa=True)
    ref.backward(grad_out)
    for got, want in ((out, ref), (q.grad, qr.grad), (k.grad, kr.grad), (v.grad, vr.grad)):
        assert_close(got.detach(), want, torch.float32, "bwd", "autograd")


@needs_triton
def test_triton_non_contiguous_and_cross_attention():
    """q from a [B, T, H, d] layout (strided view), k/v longer than q, grad_out with stride 0."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 40, 4, 16, generator=g).to(DEVICE).transpose(1, 2)  # [B, H, T_q, d], not contiguous
    k = torch.randn(2, 2, 16, 70, generator=g).to(DEVICE).transpose(2, 3)  # [B, H_kv, T_k, d], d not last-contiguous
    v = torch.randn(2, 2, 70, 16, generator=g).to(DEVICE)
    out, lse = tf.flash_attention_triton_forward(q, k, v)
    ref, ref_lse = sdpa_reference(q, k, v, False)
    assert_close(out, ref, torch.float32, "fwd", "out")
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)
    grad_out = torch.ones(1, 1, 1, 1, device=DEVICE).expand_as(out)  # what out.sum().backward() sends
    got = tf.flash_attention_triton_backward(q, k, v, out, lse, grad_out)
    _, *want = sdpa_grads(q, k, v, grad_out, False)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert_close(a, b, torch.float32, "bwd", name)


@needs_triton
@pytest.mark.parametrize("causal", [False, True])
def test_triton_every_gpu_tile_shape(causal, monkeypatch):
    """Run each tile shape the GPU autotuner may pick (one per config table row, in turn) in the
    interpreter, on a ragged length, so the staged loops are right for every BLOCK_M/BLOCK_N ratio."""
    if not tf._INTERPRET:
        pytest.skip("the autotuner chooses tiles on a GPU (see test_autotuned_kernels_on_gpu)")
    shapes = {kind: sorted({(m, n) for m, n, _, _ in table if tf.valid_config(kind, m, n, causal, 4096, 4096)})
              for kind, table in (("fwd", tf.FWD_CONFIGS), ("dkdv", tf.DKDV_CONFIGS), ("dq", tf.DQ_CONFIGS))}
    q, k, v = make_qkv(1, 2, 1, 300, 16)
    grad_out = torch.randn(1, 2, 300, 16, generator=torch.Generator().manual_seed(6))
    ref, *ref_grads = sdpa_grads(q, k, v, grad_out, causal)
    for i in range(max(len(s) for s in shapes.values())):
        blocks = {kind: s[i % len(s)] for kind, s in shapes.items()}
        monkeypatch.setitem(tf.INTERPRETER_BLOCKS, "fwd", blocks["fwd"])
        monkeypatch.setitem(tf.INTERPRETER_BLOCKS, "dkdv", blocks["dkdv"])
        monkeypatch.setitem(tf.INTERPRETER_BLOCKS, "dq", blocks["dq"])
        out, lse = tf.flash_attention_triton_forward(q, k, v, causal=causal)
        assert_close(out, ref, torch.float32, "fwd", f"out with tiles {blocks}")
        grads = tf.flash_attention_triton_backward(q, k, v, out, lse, grad_out, causal=causal)
        for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
            assert_close(got, want, torch.float32, "bwd", f"{name} with tiles {blocks}")


@needs_triton
def test_triton_lse_matches_tiled():
    q, k, v = make_qkv(1, 2, 2, 70, 32, dtype=torch.float16)
    _, lse = tf.flash_attention_triton_forward(q, k, v, causal=True)
    _, lse_tiled = flash_attention_tiled(q.cpu(), k.cpu(), v.cpu(), causal=True, block_size=16)
    torch.testing.assert_close(lse.cpu(), lse_tiled, atol=1e-4, rtol=1e-4)


@needs_triton
def test_triton_rejects_bad_inputs(monkeypatch):
    q, k, v = make_qkv(1, 4, 4, 8, 16)
    cases = [
        ((q[0], k, v), {}, r"leading \(batch\) dims"),
        ((q[..., 0], k, v), {}, r"leading \(batch\) dims"),
        ((q, k.double(), v), {}, "share one dtype"),
        ((q.double(), k.double(), v.double()), {}, "not supported"),
        ((*make_qkv(1, 4, 4, 8, 48),), {}, "head dim d=48"),
        ((q, k[:, :3], v[:, :3]), {}, "multiple of key/value heads"),
        ((q, k[:, :, :5], v[:, :, :5]), {"causal": True}, "T_q == T_k"),
        ((q, k, v[:, :, :5]), {}, "same shape"),
        ((q[:, :, :0], k, v), {}, ">= 1"),
    ]
    if tf._INTERPRET:
        cases.append(((q.bfloat16(), k.bfloat16(), v.bfloat16()), {}, "bfloat16 needs a GPU"))
    for args, kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            tf.flash_attention_triton(*args, **kwargs)
    out, lse = tf.flash_attention_triton_forward(q, k, v)
    with pytest.raises(ValueError, match="lse must have shape"):
        tf.flash_attention_triton_backward(q, k, v, out, lse[:, :, :3], out)
    with pytest.raises(ValueError, match="must have q's shape"):
        tf.flash_attention_triton_backward(q, k, v, out[:, :2], lse, out)
    # a CPU tensor while Triton compiles for the GPU
    monkeypatch.setattr(tf, "_INTERPRET", False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        tf.flash_attention_triton(q.cpu(), k.cpu(), v.cpu())


def test_triton_missing_gives_clear_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises ImportError
    monkeypatch.delitem(sys.modules, "helpers.nb09_triton_flash", raising=False)
    with pytest.raises(ImportError, match="Triton is Linux-only"):
        importlib.import_module("helpers.nb09_triton_flash")


# --------------------------------------------------------------------------------------------
# GPU configuration logic (pure Python: runs everywhere) and GPU-only tests
# --------------------------------------------------------------------------------------------


@needs_triton
def test_config_tables_and_pruning():
    for kind, table in (("fwd", tf.FWD_CONFIGS), ("dkdv", tf.DKDV_CONFIGS), ("dq", tf.DQ_CONFIGS)):
        configs = tf.triton_configs(table)
        assert len(configs) == len(table) >= 4
        assert all({"BLOCK_M", "BLOCK_N"} <= set(c.kwargs) for c in configs)
        prune = tf._pruner(kind)
        for causal in (False, True):
            for T in (1, 100, 4096, 16384):
                kept = prune(configs, {"N_Q": T, "N_K": T}, CAUSAL=causal, HEAD_DIM=64)
                assert kept, (kind, causal, T)
                for c in kept:
                    m, n = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]
                    assert tf.valid_config(kind, m, n, causal, T, T), (kind, causal, T, m, n)
                    if causal:  # the staged causal loops need the smaller block to tile the larger
                        assert (m % n == 0) if kind in ("fwd", "dq") else (n % m == 0)
                if T >= 4096:
                    assert len(kept) >= 4, f"{kind}: only {len(kept)} configs left to tune at T={T}"
                if T < tf.TUNE_FROM_T:  # short sequences: one config, the smallest tile
                    assert [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) for c in kept] == [
                        {"fwd": (64, 32), "dkdv": (32, 64), "dq": (64, 32)}[kind]
                    ]
    assert not tf.valid_config("fwd", 64, 128, True, 4096, 4096)
    assert not tf.valid_config("dkdv", 128, 64, True, 4096, 4096)
    assert not tf.valid_config("fwd", 128, 128, False, 17, 17)  # far larger than the sequence


HOPPER_COMPILE = """
import os, sys
os.environ["TRITON_INTERPRET"] = "0"  # decorate the kernels for the GPU, not the interpreter
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import helpers.nb09_triton_flash as tf

def compile_for_hopper(fn, consts):
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in ("Lse", "Delta"):
            sig[name] = "*fp32"
        elif name in ("Q", "K", "V", "Out", "DO", "DK", "DV", "DQ"):
            sig[name] = "*fp16"
        else:
            sig[name] = "fp32" if name.endswith("scale") else "i32"
    kernel = triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": 4, "num_stages": 3})
    print(fn.__name__, "shared", kernel.metadata.shared, "wgmma", "warp_group_dot" in kernel.asm["ttgir"])

common = {"HEAD_DIM": 64, "CAUSAL": True, "DOT_PRECISION": "tf32"}
compile_for_hopper(tf._attn_fwd, {**common, "BLOCK_M": 64, "BLOCK_N": 32})
compile_for_hopper(tf._attn_bwd_dkdv, {**common, "BLOCK_M": 32, "BLOCK_N": 64})
compile_for_hopper(tf._attn_bwd_dq, {**common, "BLOCK_M": 64, "BLOCK_N": 32})
compile_for_hopper(tf._bwd_preprocess, {"HEAD_DIM": 64, "BLOCK_M": 128})
"""


@needs_triton
def test_kernels_compile_for_hopper_without_a_gpu():
    """The GPU path never runs here, but Triton can compile it ahead of time (to sm_90 PTX and a
    cubin, with the ptxas bundled in the wheel): this catches what the interpreter lets through
    (type mismatches in loops, unsupported ops) and checks that the dots become Hopper wgmma."""
    import os
    import subprocess
    from pathlib import Path

    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    root = Path(__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, "-c", HOPPER_COMPILE], capture_output=True, text=True, env=env, cwd=root,
                         timeout=300)
    if run.returncode and "ptxas" in run.stderr and ("not found" in run.stderr or "No such file" in run.stderr):
        pytest.skip("this Triton install has no ptxas to compile with")
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert len(lines) == 4 and all(line.split()[-1] == "True" for line in lines[:3]), run.stdout


@needs_triton
@needs_cuda
def test_bf16_on_gpu():
    q, k, v = make_qkv(2, 4, 2, 300, 64, dtype=torch.bfloat16)
    grad_out = torch.randn(2, 4, 300, 64, device=DEVICE, dtype=torch.bfloat16)
    for causal in (False, True):
        ref, *ref_grads = sdpa_grads(q, k, v, grad_out, causal)
        out, lse = tf.flash_attention_triton_forward(q, k, v, causal=causal)
        assert_close(out, ref, torch.bfloat16, "fwd", "out")
        grads = tf.flash_attention_triton_backward(q, k, v, out, lse, grad_out, causal=causal)
        for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
            assert_close(got, want, torch.bfloat16, "bwd", name)


@needs_triton
@needs_cuda
def test_autotuned_kernels_on_gpu():
    fwd, dkdv, dq = tf._kernels(False)
    assert all(hasattr(kernel, "configs") for kernel in (fwd, dkdv, dq)), "expected triton Autotuner objects"
    q, k, v = make_qkv(1, 4, 4, 1024, 128, dtype=torch.float16)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = tf.flash_attention_triton(q, k, v, causal=True)
    out.backward(torch.ones_like(out))
    best = fwd.best_config.kwargs
    assert best["BLOCK_M"] % best["BLOCK_N"] == 0
    ref, *_ = sdpa_grads(q, k, v, torch.ones_like(out), True)
    assert_close(out.detach(), ref, torch.float16, "fwd", "out")


# --------------------------------------------------------------------------------------------
# bench/bench_attention.py: the report code runs on synthetic timings (the timings need a GPU)
# --------------------------------------------------------------------------------------------


def _load_bench():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "bench" / "bench_attention.py"
    spec = importlib.util.spec_from_file_location("bench_attention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_triton
def test_bench_report_from_synthetic_rows(tmp_path):
    bench = _load_bench()
    assert bench.slug("NVIDIA H200") == "nvidia-h200"
    assert bench.model_flops(4096, 64, True, "fwd+bwd") == 3.5 * 4 * 4 * 32 * 4096**2 * 64 / 2
    seqs = bench.QUICK_T
    speed = {"naive": 0.1, "sdpa-flash": 1.0, "sdpa-cudnn": 1.2, "sdpa-efficient": 0.8, "sdpa-math": 0.1, "course": 1.1}
    rows = []
    for T in seqs:
        for d in bench.HEAD_DIMS:
            for causal in (False, True):
                for mode in bench.MODES:
                    for impl, s in speed.items():
                        ms = bench.model_flops(T, d, causal, mode) / 1e12 / (300 * s) * 1e3
                        quadratic = impl in ("naive", "sdpa-math")
                        row = {"impl": impl, "mode": mode, "T": T, "d": d, "causal": causal, "ms": ms,
                               "tflops": bench.model_flops(T, d, causal, mode) / (ms * 1e-3) / 1e12,
                               "peak_extra_gib": (T / 1024) ** (2 if quadratic else 1) * 0.1, "status": "ok"}
                        if impl == "sdpa-math" and T == seqs[-1]:
                            row.update(ms=None, tflops=None, peak_extra_gib=None, status="skipped: needs ~999 GiB")
                        rows.append(row)
    info = {"gpu": "Fake GPU", "torch": torch.__version__, "triton": "3.x", "cuda": "12.x"}
    bench.write_csv(rows, info, tmp_path / "fake.csv")
    bench.write_markdown(rows, info, seqs, tmp_path / "fake.md")
    bench.plot(rows, info, seqs, tmp_path / "fake.png")
    md = (tmp_path / "fake.md").read_text()
    assert "Fake GPU" in md and "| skip |" in md and "skipped: needs ~999 GiB" in md
    goals = bench.goal_checks(rows)
    assert sum(line.startswith("- PASS") for line in goals) == 14, goals  # 4 fwd, 4 bwd, 2 naive, 4 memory
    assert (tmp_path / "fake.png").stat().st_size > 10_000
    assert len((tmp_path / "fake.csv").read_text().splitlines()) == len(rows) + 1


@needs_triton
def test_bench_without_cuda_runs_interpreter_check(capsys):
    if torch.cuda.is_available():
        pytest.skip("on a GPU `make bench` runs the full benchmark")
    assert _load_bench().main([]) == 0
    out = capsys.readouterr().out
    assert "No CUDA GPU" in out and "Interpreter check passed." in out
