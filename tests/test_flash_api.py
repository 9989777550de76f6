"""The FlashAttention functions as other people's code calls them, and where learners run them.

* Call forms: ``FlashAttentionFunction.apply(q, k, v, causal)`` (``sm_scale`` defaults to 1/sqrt(d)),
  the same for the PyTorch tiled version (``FlashAttentionTiledFunction``), inputs with any
  leading dims (``[T, d]``, ``[B, T, d]``, ``[B, H, T, d]``, ``[B1, B2, H, T, d]``, grouped-query
  k and v), the saved log-sum-exp in the caller's shape ``q.shape[:-1]``.
* Gradients against autograd of plain attention (explicit scores): the tiled version in float64
  (and ``gradcheck``), the Triton kernels in float32 and fp16 (in the interpreter without a GPU:
  small shapes). The tiled backward never forms a ``[T, T]`` tensor (aten ops logged).
* Import order: the course's helpers switch Triton's interpreter on before anything imports
  Triton, so checks imported first, or the learner's own ``import triton``, cannot leave Triton's
  library compiled-only (subprocesses: a fresh interpreter each).
* Triton 3.6 (what torch 2.11 pins) with NumPy >= 2.4: Triton's interpreter < 3.7 cannot convert
  a loop bound (triton-lang/triton#9171); the helpers apply Triton 3.7's fix. A slow test installs
  triton==3.6.0 from the package index into a cached folder and runs the interpreter kernel tests
  with it in a subprocess (torch stays the CPU build: it does not depend on Triton).
"""

from __future__ import annotations

import math
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
from torch.utils._python_dispatch import TorchDispatchMode

from helpers.nb09_flash_attention import (
    FlashAttentionTiledFunction,
    flash_attention_tiled,
    flash_attention_tiled_backward,
    flatten_batch,
)

try:
    from helpers import nb09_triton_flash as tf
except ImportError:  # macOS / Windows: no Triton
    tf = None

ROOT = Path(__file__).resolve().parent.parent
needs_triton = pytest.mark.skipif(tf is None, reason="Triton is Linux-only")
needs_interpreter_machine = pytest.mark.skipif(
    torch.cuda.is_available(), reason="tests the interpreter's set-up, which a machine with a CUDA GPU does not use"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


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


# --------------------------------------------------------------------------------------------
# The PyTorch tiled version: an autograd function with a tiled backward
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# The Triton kernels (Triton's interpreter without a CUDA GPU: small shapes)
# --------------------------------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("causal", [False, True])
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
    torch.testing.assert_close(out.detach().float(), ref, atol=2e-3, rtol=2e-3)  # tolerances: test_flash_kernel.py
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


# --------------------------------------------------------------------------------------------
# Import order: the interpreter is on before Triton is imported, whoever imports it
# --------------------------------------------------------------------------------------------

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
@pytest.mark.parametrize("first", ["from helpers import checks", "import helpers.checks.nb09_flash_attention"])
def test_checks_imported_first_then_the_learners_triton_kernel_runs(first, tmp_path):
    run = run_python(LEARNER_ORDER.format(first=first), tmp_path)
    assert run.returncode == 0 and "ran" in run.stdout, run.stderr[-3000:]


@needs_triton
@needs_interpreter_machine
def test_the_import_order_test_fails_without_the_import_hook(tmp_path):
    """Without the hook that helpers.runtime installs, the same script meets the reported error."""
    unhook = "sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != '_CourseImportHook']"
    run = run_python(LEARNER_ORDER.format(first=f"import sys, helpers\n{unhook}\nfrom helpers import checks"), tmp_path)
    assert run.returncode != 0 and "Cannot call @triton.jit'd outside of the scope of a kernel" in run.stderr, run.stderr


@needs_triton
@needs_interpreter_machine
def test_triton_imported_before_the_helpers_gets_a_clear_warning(tmp_path):
    run = run_python("import torch, triton\nimport helpers", tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Triton was imported before the course's helpers" in run.stderr and "setup()" in run.stderr


# --------------------------------------------------------------------------------------------
# Triton 3.6 with NumPy >= 2.4 (triton-lang/triton#9171)
# --------------------------------------------------------------------------------------------

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
    "tests/test_flash_kernel.py::test_triton_forward_backward_match_sdpa",
    "tests/test_flash_kernel.py::test_triton_autograd_function",
    "tests/test_flash_kernel.py::test_triton_non_contiguous_and_cross_attention",
    "tests/test_flash_kernel.py::test_triton_rejects_bad_inputs",
    "tests/test_flash_api.py",
]
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
         "-m", "not slow", "-k", " and ".join(f"not {word}" for word in OLD_TRITON_DESELECT), *OLD_TRITON_TESTS],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, **env}, timeout=900,
    )
    summary = tests.stdout.strip().splitlines()[-1] if tests.stdout.strip() else tests.stderr[-2000:]
    assert tests.returncode == 0, f"with Triton {OLD_TRITON}: {summary}\n{tests.stdout[-6000:]}"
    assert re.search(r"\b(\d{2,}) passed", summary) and "failed" not in summary, summary
