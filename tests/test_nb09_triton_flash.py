"""Notebook 09, FlashAttention in Triton: the kernels of helpers.nb09_triton_flash (forward and
backward, their autotuning tables) and their API (FlashAttentionFunction, any leading dims), and where
learners run them (Triton's interpreter, the import order, Triton 3.6 with NumPy 2.4). The PyTorch
teaching versions and the checks of 9.1-9.4 are tested in tests/test_nb09_flash_attention.py.

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

The API as other people's code calls it:
* Call forms: ``FlashAttentionFunction.apply(q, k, v, causal)`` (``sm_scale`` defaults to 1/sqrt(d)),
  inputs with any leading dims (``[T, d]``, ``[B, T, d]``, ``[B, H, T, d]``, ``[B1, B2, H, T, d]``,
  grouped-query k and v), the saved log-sum-exp in the caller's shape ``q.shape[:-1]``; gradients
  against autograd of plain attention (explicit scores) in float32 and fp16.
* Import order: the course's helpers switch Triton's interpreter on before anything imports
  Triton, so checks imported first, or the learner's own ``import triton``, cannot leave Triton's
  library compiled-only (subprocesses: a fresh interpreter each).
* Triton 3.6 (what torch 2.11 pins) with NumPy >= 2.4: Triton's interpreter < 3.7 cannot convert
  a loop bound (triton-lang/triton#9171); the helpers apply Triton 3.7's fix. A slow test installs
  triton==3.6.0 from the package index into a cached folder and runs the interpreter kernel tests
  with it in a subprocess (torch stays the CPU build: it does not depend on Triton).
"""

from __future__ import annotations

import functools
import importlib
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers.nb09_flash_attention import flash_attention_tiled
from helpers.tools import kernel_gpu
from tests.test_nb09_flash_attention import make, reference_grads, saved_lse, sdpa_reference
from tests.test_nb09_flash_attention import make_qkv as make_qkv_on

try:
    from helpers import nb09_triton_flash as tf  # turns on the interpreter when there is no CUDA GPU
except ImportError:  # macOS / Windows: no Triton
    tf = None

ROOT = Path(__file__).resolve().parent.parent
needs_triton = pytest.mark.skipif(tf is None, reason="Triton is Linux-only")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_interpreter_machine = pytest.mark.skipif(
    torch.cuda.is_available(), reason="tests the interpreter's set-up, which a machine with a CUDA GPU does not use"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (atol, rtol), see the module docstring; make bench's GPU check uses the same (bf16 keeps 8 bits of
# mantissa: 2^-8 = 4e-3 per rounding)
TOL = {(getattr(torch, kernel_gpu.DTYPES[dtype]), kind): tol for (dtype, kind), tol in kernel_gpu.TOL.items()}


make_qkv = functools.partial(make_qkv_on, device=DEVICE)  # on the GPU when there is one


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



# =============================================================== the kernels


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
# The interpreter takes 3-7 s per case at T = 257 (several tiles in both axes, 2-4 heads): in make test-all
# only. make test keeps every other case but two, whose T = 100 and 17 are ragged too (T = 100: several
# query and key tiles, the last one partial), and every d, causal, dtype, GQA and MQA value.
SLOW_T = 257
# Also in make test-all only (0.1-0.4 s each): T = 17 causal and T = 100 non-causal, whose values the
# cases kept cover (T = 17 non-causal, T = 100 causal; ragged non-causal with several key tiles:
# test_triton_non_contiguous_and_cross_attention).
MORE_SLOW = [(2, 2, 2, 17, 32, True, torch.float32), (1, 2, 2, 100, 64, False, torch.float16)]


def _cases(cases: list[tuple]) -> list:
    """``cases`` with those at T = SLOW_T or in MORE_SLOW marked slow (same order, so the same test ids)."""
    return [pytest.param(*c, marks=pytest.mark.slow) if c[3] == SLOW_T or c in MORE_SLOW else c for c in cases]


@pytest.fixture
def nan_empty():
    """Make torch.empty return NaN-filled float tensors, so an output element the kernel never
    writes shows up as NaN instead of whatever the memory held."""
    with kernel_gpu.nan_filled_empty():
        yield


@needs_triton
@pytest.mark.parametrize("B, H, H_kv, T, d, causal, dtype", _cases(KERNEL_CASES))
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
    assert_fused_backward_agrees(q, k, v, out, lse, grad_out, causal, (dq, dk, dv), (ref_dq, ref_dk, ref_dv))


def assert_fused_backward_agrees(q, k, v, out, lse, grad_out, causal, two_kernel, ref):
    """The fused backward (deterministic=False) against SDPA, and against the two-kernel one: dK and
    dV come from the same loop and products (the same bits), dQ only in another order of summation
    (atomic adds of fp32 per key block instead of one accumulator)."""
    fused = tf.flash_attention_triton_backward(q, k, v, out, lse, grad_out, causal=causal, deterministic=False)
    for name, got, want, theirs in zip(("dq", "dk", "dv"), fused, ref, two_kernel):
        assert got.dtype == q.dtype and got.shape == theirs.shape
        assert_close(got, want, q.dtype, "bwd", f"fused {name}")
        if name == "dq":
            assert_close(got, theirs, q.dtype, "bwd", "fused dq against the two-kernel dq")
        else:
            assert torch.equal(got, theirs), f"fused {name} differs from the two-kernel backward's"


TMA_CASES = [  # GQA causal, MQA, ragged causal: the cases where loads run past the end
    (1, 4, 2, 100, 32, True, torch.float16), (1, 4, 1, 257, 64, False, torch.float32),
    (1, 2, 2, 257, 64, True, torch.float16),
]


@needs_triton
@pytest.mark.parametrize("B, H, H_kv, T, d, causal, dtype", _cases(TMA_CASES))
def test_tensor_descriptor_path_equals_the_pointer_path(B, H, H_kv, T, d, causal, dtype, monkeypatch):
    """The TMA path (K/V and the backward's Q/dO through tensor descriptors) run in the interpreter:
    rows past the end arrive as zeros instead of being masked, and the results are the same bits."""
    q, k, v = make_qkv(B, H, H_kv, T, d, dtype=dtype)
    grad_out = torch.randn(B, H, T, d, generator=torch.Generator().manual_seed(5)).to(DEVICE, dtype)
    results = {}
    for use in (False, True):
        monkeypatch.setattr(tf, "USE_TMA", use)
        assert tf._tma_for(k, v) is use
        out, lse = tf.flash_attention_triton_forward(q, k, v, causal=causal)
        results[use] = (out, lse, *tf.flash_attention_triton_backward(q, k, v, out, lse, grad_out, causal=causal),
                        *tf.flash_attention_triton_backward(q, k, v, out, lse, grad_out, causal, deterministic=False))
    names = ("out", "lse", "dq", "dk", "dv", "fused dq", "fused dk", "fused dv")
    for name, a, b in zip(names, results[False], results[True], strict=True):
        assert torch.equal(a, b), f"{name}: the descriptor path differs from the pointer path"


def test_tma_dispatch_needs_contiguous_rows_and_a_hopper(monkeypatch):
    x = torch.zeros(1, 2, 8, 16, device=DEVICE)
    monkeypatch.setattr(tf, "USE_TMA", None)
    if hasattr(tf.tl, "make_tensor_descriptor"):
        assert tf._tma_allowed((9, 0)) and tf._tma_allowed((10, 0)), "Hopper and newer take descriptors"
    assert not tf._tma_allowed((8, 0)) and not tf._tma_allowed((8, 9)) and not tf._tma_allowed(None)
    if tf._INTERPRET:
        assert not tf._tma_for(x), "the interpreter takes pointers unless told otherwise"
    monkeypatch.setattr(tf, "USE_TMA", True)
    assert tf._tma_for(x)
    assert not tf._tma_for(x.transpose(2, 3)), "a descriptor needs the last dim contiguous"
    assert not tf._tma_for(torch.zeros(1, 2, 8, 3, device=DEVICE)[..., :2]), "rows must start 16-byte aligned"
    monkeypatch.setattr(tf, "USE_TMA", False)
    assert not tf._tma_for(x)


# causal=True in make test-all only: test_triton_function_apply_with_four_arguments_on_B_T_d[True] and
# test_triton_leading_dims_and_gqa_in_half_precision take the causal kernels through autograd.
@needs_triton
@pytest.mark.parametrize("causal", [False, pytest.param(True, marks=pytest.mark.slow)])
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
    assert_fused_backward_agrees(q, k, v, out, lse, grad_out, False, got, want)


@needs_triton
def test_the_fused_backward_through_autograd_and_its_switches():
    """``flash_attention_triton(..., deterministic=False)`` takes the fused backward through autograd
    (GQA, causal, fp16); torch.use_deterministic_algorithms(True) overrules it (the two-kernel
    backward's bits); a deterministic that is not a bool is refused before any work."""
    q, k, v = make_qkv(1, 4, 2, 40, 16, dtype=torch.float16)
    grad_out = torch.randn(1, 4, 40, 16, generator=torch.Generator().manual_seed(8)).to(DEVICE, torch.float16)
    _, *ref = sdpa_grads(q, k, v, grad_out, True)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    tf.flash_attention_triton(*leaves, causal=True, deterministic=False).backward(grad_out)
    for name, leaf, want in zip(("dq", "dk", "dv"), leaves, ref):
        assert_close(leaf.grad, want, torch.float16, "bwd", f"fused {name} through autograd")
    out, lse = tf.flash_attention_triton_forward(q, k, v, causal=True)
    two_kernel = tf.flash_attention_triton_backward(q, k, v, out, lse, grad_out, True)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        overruled = tf.flash_attention_triton_backward(q, k, v, out, lse, grad_out, True, deterministic=False)
    finally:
        torch.use_deterministic_algorithms(was)
    assert all(torch.equal(a, b) for a, b in zip(overruled, two_kernel)), "deterministic algorithms were asked for"
    for bad in (None, "no", 0):
        with pytest.raises(ValueError, match="deterministic must be True or False"):
            tf.flash_attention_triton(q, k, v, False, None, bad)


@needs_triton
@pytest.mark.slow
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
@pytest.mark.parametrize("causal", [False, True])
def test_triton_every_gpu_tile_shape(causal, tma, monkeypatch):
    """Run each tile shape the GPU autotuner may pick (one per config table row, in turn) in the
    interpreter, on a ragged length, so the staged loops are right for every BLOCK_M/BLOCK_N ratio,
    through pointer grids and through tensor descriptors (TMA)."""
    if not tf._INTERPRET:
        pytest.skip("the autotuner chooses tiles on a GPU (see test_autotuned_kernels_on_gpu)")
    monkeypatch.setattr(tf, "USE_TMA", tma)
    tables = {kind: [row for (k, _, _), rows in tf.CONFIG_TABLES.items() if k == kind for row in rows]
              for kind in tf.KINDS}
    tables["bwd"] += tf.BWD_CONFIGS  # the generic table, for GPUs without their own
    shapes = {kind: sorted({(m, n) for m, n, _, _ in table if tf.valid_config(kind, m, n, causal, 4096, 4096)})
              for kind, table in tables.items()}
    q, k, v = make_qkv(1, 2, 1, 300, 16)
    grad_out = torch.randn(1, 2, 300, 16, generator=torch.Generator().manual_seed(6))
    ref, *ref_grads = sdpa_grads(q, k, v, grad_out, causal)
    for i in range(max(len(s) for s in shapes.values())):
        blocks = {kind: s[i % len(s)] for kind, s in shapes.items()}
        monkeypatch.setitem(tf.INTERPRETER_BLOCKS, "fwd", blocks["fwd"])
        monkeypatch.setitem(tf.INTERPRETER_BLOCKS, "dkdv", blocks["dkdv"])
        monkeypatch.setitem(tf.INTERPRETER_BLOCKS, "dq", blocks["dq"])
        monkeypatch.setitem(tf.INTERPRETER_BLOCKS, "bwd", blocks["bwd"])
        out, lse = tf.flash_attention_triton_forward(q, k, v, causal=causal)
        assert_close(out, ref, torch.float32, "fwd", f"out with tiles {blocks}")
        grads = tf.flash_attention_triton_backward(q, k, v, out, lse, grad_out, causal=causal)
        fused = tf.flash_attention_triton_backward(q, k, v, out, lse, grad_out, causal=causal, deterministic=False)
        for name, got, got_fused, want in zip(("dq", "dk", "dv"), grads, fused, ref_grads):
            assert_close(got, want, torch.float32, "bwd", f"{name} with tiles {blocks}")
            assert_close(got_fused, want, torch.float32, "bwd", f"fused {name} with tiles {blocks}")


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


# ----------------------------------------------------------------- GPU configuration (pure Python: runs everywhere), GPU-only tests


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
import os, re, sys
os.environ["TRITON_INTERPRET"] = "0"  # decorate the kernels for the GPU, not the interpreter
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import helpers.nb09_triton_flash as tf

def compile_for_hopper(fn, consts):
    # a constexpr not given takes its default, as at a launch (else it would compile as a runtime int)
    consts = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.name not in consts}, **consts}
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in ("Lse", "Delta", "DQ_ACC"):
            sig[name] = "*fp32"
        elif name in ("Q", "K", "V", "Out", "DO", "DK", "DV", "DQ"):
            sig[name] = "*fp16"
        else:
            sig[name] = "fp32" if name.endswith("scale") else "i32"
    kernel = triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": 4, "num_stages": 3})
    ptx = kernel.asm["ptx"]
    print(fn.__name__, consts.get("TMA"), "fused", bool(consts.get("FUSED_DQ")),
          "atomics", re.search(r"\\b(red|atom)\\.global", ptx) is not None, "shared", kernel.metadata.shared,
          "tma", "cp.async.bulk.tensor" in ptx, "wgmma", "warp_group_dot" in kernel.asm["ttgir"])

for tma in (False, True):
    common = {"HEAD_DIM": 64, "CAUSAL": True, "DOT_PRECISION": "tf32", "TMA": tma}
    compile_for_hopper(tf._attn_fwd, {**common, "BLOCK_M": 64, "BLOCK_N": 32})
    compile_for_hopper(tf._attn_bwd_dkdv, {**common, "BLOCK_M": 32, "BLOCK_N": 64})
    compile_for_hopper(tf._attn_bwd_dq, {**common, "BLOCK_M": 64, "BLOCK_N": 32})
    compile_for_hopper(tf._attn_bwd_dkdv, {**common, "BLOCK_M": 32, "BLOCK_N": 64, "FUSED_DQ": True})
compile_for_hopper(tf._bwd_preprocess, {"HEAD_DIM": 64, "BLOCK_M": 128})
"""


@needs_triton
@pytest.mark.slow
def test_kernels_compile_for_hopper_without_a_gpu():
    """The GPU path never runs here, but Triton can compile it ahead of time (to sm_90 PTX and a
    cubin, with the ptxas bundled in the wheel): this catches what the interpreter lets through
    (type mismatches in loops, unsupported ops) and checks that the dots become Hopper wgmma, that
    the descriptor path loads with TMA, and that only the fused backward has atomics."""
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
    kernels = [line.split() for line in run.stdout.splitlines()]
    assert len(kernels) == 9 and all(k[-1] == "True" for k in kernels[:8]), run.stdout  # wgmma
    assert [k[-3] for k in kernels[:8]] == ["False"] * 4 + ["True"] * 4, run.stdout  # TMA copies
    assert [k[5] for k in kernels] == [k[3] for k in kernels] == ["False"] * 3 + ["True"] + ["False"] * 3 + [
        "True", "False"], run.stdout  # atomics in the fused backward only


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
    q, k, v = make_qkv(1, 4, 4, 1024, 128, dtype=torch.float16)
    fwd, dkdv, dq = tf._launchers(q, tf._tma_for(k, v))  # this head dim's, GPU's and load path's tables
    assert all(hasattr(kernel, "configs") for kernel in (fwd, dkdv, dq)), "expected triton Autotuner objects"
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = tf.flash_attention_triton(q, k, v, causal=True)
    out.backward(torch.ones_like(out))
    best = fwd.best_config.kwargs
    assert best["BLOCK_M"] % best["BLOCK_N"] == 0
    ref, *_ = sdpa_grads(q, k, v, torch.ones_like(out), True)
    assert_close(out.detach(), ref, torch.float16, "fwd", "out")


# =============================================================== the API (Triton's interpreter without a CUDA GPU: small shapes)


# causal=False in make test-all only: test_triton_autograd_function[False] takes it through autograd.
@needs_triton
@pytest.mark.parametrize("causal", [pytest.param(False, marks=pytest.mark.slow), True])
def test_triton_function_apply_with_four_arguments_on_B_T_d(causal):
    """The call other courses' tests make: ``FlashAttentionFunction.apply(q, k, v, is_causal)``
    with q, k, v ``[B, T, d]``; the saved lse is ``[B, T]``."""
    q, k, v, grad_out = make((3, 20, 16), (3, 20, 16), torch.float32, seed=3, device=DEVICE)
    ref, *ref_grads = reference_grads(q, k, v, grad_out, causal)
    out = tf.FlashAttentionFunction.apply(q, k, v, causal)
    assert out.shape == q.shape and len(saved_lse(out, q)) == 1
    out.backward(grad_out)
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad), (ref, *ref_grads)):
        torch.testing.assert_close(got.detach(), want, atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    with torch.no_grad():
        assert torch.equal(tf.FlashAttentionFunction.apply(q, k, v), tf.flash_attention_triton(q, k, v, False, 0.25))


@needs_triton
def test_triton_leading_dims_and_gqa_in_half_precision():
    q, k, v, grad_out = make((2, 1, 4, 40, 16), (2, 1, 2, 40, 16), torch.float16, seed=4, device=DEVICE)
    ref, *ref_grads = reference_grads(q, k, v, grad_out, True, dtype=torch.float32)
    out = tf.flash_attention_triton(q, k, v, causal=True)
    out.backward(grad_out)
    assert out.dtype == torch.float16 and out.shape == q.shape and k.grad.shape == k.shape
    torch.testing.assert_close(out.detach().float(), ref, atol=2e-3, rtol=2e-3)  # tolerances: the module docstring
    for name, got, want in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), ref_grads):
        torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2, msg=lambda m, n=name: f"{n}: {m}")


@needs_triton
def test_triton_forward_and_backward_functions_keep_the_callers_shape():
    q, k, v, grad_out = make((24, 32), (24, 32), torch.float32, seed=5, device=DEVICE)
    with torch.no_grad():
        out, lse = tf.flash_attention_triton_forward(q, k, v, causal=True)
        assert out.shape == (24, 32) and lse.shape == (24,)
        grads = tf.flash_attention_triton_backward(q, k, v, out, lse, grad_out, causal=True)
        with pytest.raises(ValueError, match=r"lse must have shape \(24,\)"):
            tf.flash_attention_triton_backward(q, k, v, out, lse[None], grad_out)
    for got, want in zip(grads, reference_grads(q, k, v, grad_out, True)[1:]):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------- import order: the interpreter is on before anyone imports Triton

# The order of the solutions notebook (checks, then setup(), then the learner's `import triton`),
# where a helper imports Triton at import (as a version probe in the checks once did); then a
# learner's kernel with a loop bound known only at run time, and the course's kernel.
LEARNER_ORDER = """
import torch
{first}
import triton  # as a helper module might, at import
from helpers.runtime import setup
setup()
import triton.language as tl

@triton.jit
def double_rows(X, Y, N, BLOCK: tl.constexpr):
    for start in range(0, N, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(Y + offs, tl.load(X + offs, mask=offs < N) * 2 + tl.zeros([BLOCK], tl.float32), mask=offs < N)

x = torch.arange(37, dtype=torch.float32)
y = torch.empty_like(x)
double_rows[(1,)](x, y, 37, BLOCK=16)
assert torch.equal(y, 2 * x), y
from helpers.nb09_triton_flash import flash_attention_triton
q = torch.randn(1, 2, 20, 16)
assert torch.allclose(flash_attention_triton(q, q, q), torch.nn.functional.scaled_dot_product_attention(q, q, q),
                      atol=1e-5)
print("ran", triton.__version__)
"""


def run_python(code: str, folder: Path, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``code`` as a script (Triton wants kernels in a file) in a fresh Python, from the repository
    root, without TRITON_INTERPRET unless ``env`` sets it."""
    script = folder / "script.py"
    script.write_text(code)
    base = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    base["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), base.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=ROOT,
                          env={**base, **(env or {})}, timeout=timeout)


@needs_triton
@needs_interpreter_machine
@pytest.mark.parametrize("first", [
    "from helpers import checks",
    pytest.param("import helpers.checks.nb09_flash_attention", marks=pytest.mark.slow),
])
def test_checks_imported_first_then_the_learners_triton_kernel_runs(first, tmp_path):
    run = run_python(LEARNER_ORDER.format(first=first), tmp_path)
    assert run.returncode == 0 and "ran" in run.stdout, run.stderr[-3000:]


@needs_triton
@needs_interpreter_machine
@pytest.mark.slow
def test_the_import_order_test_fails_without_the_import_hook(tmp_path):
    """Without the hook that helpers.runtime installs, the same script meets the reported error."""
    unhook = "sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != '_CourseImportHook']"
    run = run_python(LEARNER_ORDER.format(first=f"import sys, helpers\n{unhook}\nfrom helpers import checks"), tmp_path)
    assert run.returncode != 0 and "Cannot call @triton.jit'd outside of the scope of a kernel" in run.stderr, run.stderr


@needs_triton
@needs_interpreter_machine
@pytest.mark.slow
def test_triton_imported_before_the_helpers_gets_a_clear_warning(tmp_path):
    run = run_python("import torch, triton\nimport helpers", tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Triton was imported before the course's helpers" in run.stderr and "setup()" in run.stderr


# ----------------------------------------------------------------- Triton 3.6 with NumPy >= 2.4 (triton-lang/triton#9171)

OLD_TRITON = "3.6.0"  # what torch 2.11 pins, and what GPU images carry

# Triton's own interpreter, without the course's helpers, then after `import helpers`.
BARE_KERNEL = """
import torch, triton, triton.language as tl

@triton.jit
def double_rows(X, Y, N, BLOCK: tl.constexpr):
    for start in range(0, N, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(Y + offs, tl.load(X + offs, mask=offs < N) * 2, mask=offs < N)

x = torch.arange(37, dtype=torch.float32)
y = torch.zeros_like(x)
try:
    double_rows[(1,)](x, y, 37, BLOCK=16)
    print("bare:", "ran" if torch.equal(y, 2 * x) else "wrong")
except Exception as e:
    print("bare:", repr(e))
import helpers
y = torch.zeros_like(x)
double_rows[(1,)](x, y, 37, BLOCK=16)
print("with helpers:", "ran" if torch.equal(y, 2 * x) else "wrong", triton.__version__)
"""

# The interpreter kernel tests run with Triton 3.6 (about a minute on 2 cores): every kernel, both
# directions, causal or not, fp16 and fp32, GQA and MQA, ragged T, strided inputs, leading dims.
OLD_TRITON_TESTS = [
    f"tests/test_nb09_triton_flash.py::{name}" for name in (
        "test_triton_forward_backward_match_sdpa",
        "test_triton_autograd_function",
        "test_triton_non_contiguous_and_cross_attention",
        "test_triton_rejects_bad_inputs",
        "test_triton_function_apply_with_four_arguments_on_B_T_d",
        "test_triton_leading_dims_and_gqa_in_half_precision",
        "test_triton_forward_and_backward_functions_keep_the_callers_shape",
        "test_checks_imported_first_then_the_learners_triton_kernel_runs",
        "test_the_import_order_test_fails_without_the_import_hook",
        "test_triton_imported_before_the_helpers_gets_a_clear_warning",
    )
]  # (the PyTorch tiled Function never imports Triton: its tests would prove nothing here)
# Deselected there: the longest cases, and the import-order scripts (the import hook is the same
# for every Triton; without it, Triton 3.6 stops at the NumPy bug before the error they look for).
OLD_TRITON_DESELECT = ["257", "imported_first", "import_order"]


def install_old_triton(request, tmp_path_factory) -> Path:
    """``pip install --no-deps --target DIR triton==OLD_TRITON``, kept in pytest's cache folder so
    that later runs reuse it (a fresh temporary folder with ``-p no:cacheprovider``)."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "aarch64"):
        pytest.skip(f"Triton wheels exist for Linux x86_64 / aarch64 only, not {sys.platform} {platform.machine()}")
    name = f"triton-{OLD_TRITON}-py{sys.version_info.major}{sys.version_info.minor}"
    cache = getattr(request.config, "cache", None)
    base = cache.mkdir(name) if cache is not None else tmp_path_factory.mktemp(name)
    site = base / "site"
    init = site / "triton" / "__init__.py"
    if init.exists() and f"__version__ = '{OLD_TRITON}'" in init.read_text(errors="replace"):
        return site
    partial = base / "partial"
    for folder in (partial, site):
        shutil.rmtree(folder, ignore_errors=True)
    # Not importlib.util.find_spec("pip"): on Python < 3.12 that call makes setuptools' distutils
    # shim stand down for the rest of the process, and a later `import setuptools` (nbgrader's,
    # in tests/test_nbgrader.py on the same worker) then fails its own distutils assertion.
    if subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode:
        pytest.skip(f"pip is not installed in this environment, so triton=={OLD_TRITON} cannot be installed")
    try:
        pip = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--disable-pip-version-check",
                              "--target", str(partial), f"triton=={OLD_TRITON}"], capture_output=True, text=True,
                             timeout=600)
    except subprocess.TimeoutExpired:
        pytest.skip(f"installing triton=={OLD_TRITON} (a ~200 MB wheel) took over 10 minutes")
    if pip.returncode:
        text = pip.stderr + pip.stdout
        unreachable = re.search(r"No matching distribution|Could not find a version|NewConnectionError|Max retries|"
                                r"Temporary failure in name resolution|Network is unreachable|timed out", text)
        if unreachable:
            pytest.skip(f"triton=={OLD_TRITON} could not be installed: the package index is unreachable or has no "
                        f"wheel for this Python (pip: {unreachable[0]})")
        pytest.fail(f"pip install triton=={OLD_TRITON} failed:\n{text[-3000:]}")
    partial.rename(site)
    return site


@needs_triton
@pytest.mark.slow
def test_triton_3_6_with_numpy_2_4(request, tmp_path_factory):
    """Triton 3.6's interpreter fails on NumPy >= 2.4 (shown, without the helpers); with the
    helpers imported, the course's interpreter kernel tests pass on it."""
    site = install_old_triton(request, tmp_path_factory)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(site), str(ROOT), os.environ.get("PYTHONPATH")])),
           "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}  # the interpreter path, even on a GPU machine
    bare = run_python(BARE_KERNEL, tmp_path_factory.mktemp("bare"), env)
    assert bare.returncode == 0, bare.stderr[-3000:]
    assert f"with helpers: ran {OLD_TRITON}" in bare.stdout, bare.stdout
    if np.lib.NumpyVersion(np.__version__) >= "2.4.0":  # the bug is there without the helpers' fix...
        assert "only 0-dimensional arrays can be converted to Python scalars" in bare.stdout, bare.stdout
    else:  # ...and only with NumPy >= 2.4
        assert "bare: ran" in bare.stdout, bare.stdout
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
         "-k", " and ".join(f"not {word}" for word in OLD_TRITON_DESELECT), *OLD_TRITON_TESTS],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, **env}, timeout=900,
    )
    summary = tests.stdout.strip().splitlines()[-1] if tests.stdout.strip() else tests.stderr[-2000:]
    assert tests.returncode == 0, f"with Triton {OLD_TRITON}: {summary}\n{tests.stdout[-6000:]}"
    assert re.search(r"\b(\d{2,}) passed", summary) and "failed" not in summary, summary


def test_the_readme_says_whether_a_gpu_timed_the_fused_backward():
    """README: the fused backward is 'not yet timed on a GPU' exactly while no recorded benchmark
    (helpers/results/<gpu>.csv) has course-fused rows; once one has, the sentence must change."""
    import csv

    from helpers.package_data import RESULTS, package_file

    results = package_file(RESULTS, "README.md").parent
    timed = [path.name for path in results.glob("*.csv") if not path.name.endswith("-decode.csv")
             and any(row.get("impl") == "course-fused" and row.get("ms") for row in csv.DictReader(path.open()))]
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert ("not yet timed on a GPU" in readme) == (not timed), (
        f"{timed} timed the fused backward: say what it measured in the README" if timed
        else "the README should say the fused backward is not yet timed on a GPU")


def test_notebook_09_reads_a_run_of_todays_bench(tmp_path, monkeypatch, capsys):
    """The cells of notebook 09 that read recorded benchmarks (section 8's table and figure, the cost
    of determinism, the short-sequence columns) on a CSV written by today's bench/bench_attention.py
    (synthetic rows with every column): the committed run predates these columns, so without this
    the branches that print them would first run on a learner's machine after the next GPU run."""
    import csv

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from helpers.tools import notebooks as nbtools
    from tests import test_bench_attention as tba

    runs = tba.synthetic_runs()
    tba.ba.write_csv(tba.ba.aggregate(runs), tba.INFO, tmp_path / "fake-gpu.csv")
    cells = [c.source for c in nbtools.read(ROOT / "notebooks" / "09_flash_attention.ipynb").cells
             if c.cell_type == "code"]
    wanted = [next(s for s in cells if marker in s) for marker in ("def recorded_ms", "def fused_cost", "def short_rows")]
    namespace = {"csv": csv, "re": re, "torch": torch, "plt": plt, "has_cuda": lambda: False,
                 "package_file": lambda *parts: tmp_path}
    for source in wanted:
        exec(compile(source, "<notebook 09>", "exec"), namespace)
    plt.close("all")
    out = capsys.readouterr().out
    assert "Fake GPU (driver 580.1)" in out and "backward: vs flash" in out
    assert out.count("determinism costs") == 4, out
    short = [r for r in csv.DictReader((tmp_path / "fake-gpu.csv").open())
             if r["T"] == "1024" and r["impl"] in ("course", "sdpa-flash") and r["gpu_ms"]]
    assert "fake-gpu, T = 1,024:" in out and out.count(" fwd") >= len(short) == 16, out
    assert out.count("host-bound") == sum(float(r["host_ms"]) >= float(r["gpu_ms"]) for r in short) > 0, out
