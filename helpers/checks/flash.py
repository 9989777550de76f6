"""Checks for notebook 09_flash_attention: exercises 9.1-9.4.

9.1 and 9.2 (PyTorch) run the learner's function under two instruments: a ``TorchDispatchMode``
that logs every aten op it runs (to see whether x is read block by block, and whether a ``[T, T]``
tensor is ever formed) and a profile hook that notices calls into the course's own solution
(``helpers/flash.py``).

9.3 and 9.4 (Triton) run the learner's kernels on the GPU, or in Triton's interpreter on a CPU, on
*guarded* tensors: each input sits inside a larger buffer padded with NaN, and each float tensor the
learner allocates with ``torch.empty / zeros / *_like`` (or ``Tensor.new_empty / new_zeros``) gets
a padding of sentinel values and, for ``empty``, a marker value in its body. A load past the end
then turns into NaN, a store past the end changes the padding, and an entry the kernel never
writes keeps the marker, so each is named instead of reading or corrupting memory. The cases go
from friendly to awkward (a sequence length that every block size divides, then ragged lengths,
then several batches and heads), and a ``v`` made of one-hot rows turns the output into the
attention weights themselves, so a wrong weight pattern (scale, causal condition, normalisation)
can be diagnosed from it.
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .. import attention as att
from .. import flash as ref
from .. import reference
from ._core import Trial, describe, describe_case, exercise, seeded

__all__ = ["online_softmax", "flash_attention_tiled", "flash_attention_triton", "flash_attention_triton_backward"]

NB = "09_flash_attention"
LOG2E = math.log2(math.e)
TRITON_TIME_LIMIT_S = 120.0  # per call: the interpreter is slow, and a GPU compiles on first use

_HELPERS = Path(__file__).resolve().parent.parent
_SOLUTION_FILES = {str(_HELPERS / "flash.py"), str(_HELPERS / "triton_flash.py"), ref.__file__}



def _is_reference(fn: Callable) -> bool:
    """The course's own functions may of course use the course's code (tests check the reference)."""
    return any(fn is getattr(module, name, None) for module in (reference, ref) for name in __all__)


# =========================================================================== instruments (9.1, 9.2)

_REDUCTIONS = {"amax", "sum", "logsumexp", "_softmax", "_log_softmax", "mean", "cumsum", "cummax",
               "logcumsumexp", "sort", "topk", "prod", "aminmax", "nansum", "var", "std"}
_MAX_REDUCTIONS = {"aten.amax.default", "aten.max.dim", "aten.max.default"}
_EXP_LIKE = {"exp", "exp2", "expm1", "_softmax", "logsumexp", "logaddexp", "logaddexp2", "sigmoid"}


class _OpLog(TorchDispatchMode):
    """Logs ``(op, first input shape, output shapes)`` for every aten op run inside it."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, tuple, list[tuple]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        first = next((tuple(a.shape) for a in tree_flatten(args)[0] if isinstance(a, torch.Tensor)), ())
        outs = [tuple(o.shape) for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        self.ops.append((str(func), first, outs))
        return out


def _packet(op: str) -> str:
    """'aten.amax.default' -> 'amax'."""
    return op.split(".")[1] if op.count(".") >= 1 else op


def _is_reduction(op: str) -> bool:
    return _packet(op) in _REDUCTIONS or op in _MAX_REDUCTIONS or op in {"aten.min.dim", "aten.min.default"}


def _is_exp_like(op: str) -> bool:
    return _packet(op) in _EXP_LIKE or op == "aten.pow.Scalar"  # pow.Scalar: base ** tensor


def _call_logged(t: Trial, *args: Any, case: str) -> tuple[Any, list]:
    """``t.call(*args)`` with the learner's aten ops logged; fails if it ran the course's solution."""
    __tracebackhide__ = True
    with _OpLog():  # the first dispatch mode of a process imports torch._dynamo (seconds): not the learner's time
        torch.zeros(1).add_(1)
    log, helper_calls, fn = _OpLog(), [], t.fn

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename in _SOLUTION_FILES:
            helper_calls.append(frame.f_code.co_name)

    def run(*a):
        if sys.getprofile() is not None:  # a profiler or debugger is active: leave it alone
            with log:
                return fn(*a)
        sys.setprofile(profile)
        try:
            with log:
                return fn(*a)
        finally:
            sys.setprofile(None)

    t.fn = run
    try:
        got = t.call(*args, case=case)
    finally:
        t.fn = fn
    if helper_calls and not _is_reference(fn):
        t.fail(f"your function called the course's own solution (helpers: {helper_calls[0]}).",
               "write it yourself here: the point of the exercise is to build it, block by block.")
    return got, log.ops


# =========================================================================== 9.1 online softmax


def _online_model(x: torch.Tensor, bs: int, rescale: bool = True, drop_last: bool = False) -> torch.Tensor:
    """A learner's online softmax in float64, optionally without the rescale or the last short block."""
    xf = x.double()
    n = xf.shape[-1]
    stop = n - n % bs if drop_last else n
    m = torch.full(xf.shape[:-1], float("-inf"), dtype=torch.float64)
    l = torch.zeros(xf.shape[:-1], dtype=torch.float64)
    for s in range(0, stop, bs):
        block = xf[..., s : s + bs]
        m_new = torch.maximum(m, block.amax(dim=-1))
        safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        l = (l * torch.exp(m - safe) if rescale else l) + torch.exp(block - safe[..., None]).sum(dim=-1)
        m = m_new
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    return (torch.exp(xf - m[..., None]) / l[..., None]).to(x.dtype)


_ONLINE_HINT = ("one pass over blocks: m_new = max(m, block max); l = l * exp(m - m_new) + sum(exp(block - m_new)); "
                "m = m_new; at the end return exp(x - m) / l.")


def _online_cases() -> list[tuple[torch.Tensor, int, str, bool]]:
    """(x, block_size, hint for this case, whether to check the block structure)."""
    g = seeded(900)
    # A rising trend makes later blocks raise the running max, so a missing rescale shows.
    x_main = torch.randn(2, 5, 14, generator=g) * 2 + torch.linspace(0, 4, 14)  # blocks 4 + 4 + 4 + 2
    x_1d = torch.randn(7, generator=g) * 2 + torch.linspace(0, 3, 7)  # blocks 3 + 3 + 1
    x_small = torch.randn(3, 6, generator=g) * 2
    x_big = torch.randn(2, 3, 9, generator=g) * 1e4  # exp overflows unless the max is subtracted
    x_inf = torch.randn(3, 10, generator=g) * 2
    x_inf[0, :7] = float("-inf")  # the first two blocks of 3 are entirely -inf (masked keys)
    x_inf[1, ::2] = float("-inf")
    x_inf[2, 3:] = float("-inf")
    x_row = torch.randn(3, 8, generator=g)
    x_row[1] = float("-inf")  # nothing allowed at all
    x_half = (torch.randn(3, 13, generator=g) * 2).half()
    x_double = torch.randn(2, 9, generator=g, dtype=torch.float64) * 3
    blocks = "the last block may be shorter: loop `for s in range(0, n, block_size)` and slice x[..., s:s + block_size]."
    stable = ("subtract the running max before exp: exp(x) overflows for x > 88 in float32 (here |x| ~ 1e4), "
              "while exp(x - m) <= 1.")
    minf = ("a block that is entirely -inf leaves the running max at -inf, and exp(-inf - (-inf)) = exp(nan) = NaN: "
            "while m is still -inf, subtract 0 instead (torch.where(torch.isfinite(m), m, 0)).")
    empty = ("a row that is entirely -inf (nothing allowed) gives all zeros in this course, never NaN: its sum l "
             "stays 0, so divide by l only where l > 0 (and subtract 0 instead of an infinite max).")
    return [
        (x_main, 4, blocks, True),
        (x_1d, 3, blocks, False),
        (x_small, 1, _ONLINE_HINT, False),
        (x_small, 10, "a block_size larger than the row is one block: the slice x[..., 0:10] is simply shorter.", False),
        (x_big, 4, stable, False),
        (x_inf, 3, minf, False),
        (x_row, 3, empty, False),
        (x_half, 5, "compute in float32 if you like, but return x's dtype: .to(x.dtype).", False),
        (x_double, 2, _ONLINE_HINT, False),
    ]


def _check_reads_blocks(t: Trial, ops: list, n: int, bs: int) -> None:
    """Fail if a whole row was reduced at once, or if every block's max came before any exp."""
    __tracebackhide__ = True
    for op, first, _ in ops:
        if _is_reduction(op) and n in first:
            t.fail(f"your function reduced whole rows of x at once ({op} on a {list(first)} tensor, rows of "
                   f"{n}): block_size={bs} is not used.",
                   "read x in blocks x[..., s:s + block_size] and fold each block into a running max m and a "
                   "running sum l; only the final exp(x - m) / l touches the whole row, elementwise.")
    n_blocks = math.ceil(n / bs)
    maxes = 0
    for op, first, _ in ops:
        if _is_exp_like(op):
            break
        if op in _MAX_REDUCTIONS and first and first[-1] <= bs:
            maxes += 1
    if maxes >= n_blocks:
        t.fail(f"your function took the max of all {n_blocks} blocks before its first exp: that is the two-pass "
               "safe softmax (a pass for the max, a pass for the sum), not the online one.",
               "fold each block in as it arrives: exp(block - m_new) right away, and rescale the sum so far by "
               "exp(m_old - m_new) when a block raises the max. In attention the scores are never stored, so a "
               "second pass would mean computing q @ k^T twice.")


@exercise("9.1", "online softmax", points=2, stars=2, notebook=NB)
def online_softmax(t: Trial) -> None:
    t.error_hints = {
        r"must match the size|size of tensor": "keep the running max and sum one per row (shape x.shape[:-1]) and "
        "add [..., None] when you subtract them from a block.",
        r"takes \d+ positional argument": "the signature is online_softmax(x, block_size).",
    }
    for x, bs, hint, structural in _online_cases():
        got, ops = _call_logged(t, x, bs, case=describe_case(x=x, block_size=bs))
        tol = dict(atol=1e-3, rtol=1e-2) if x.dtype == torch.float16 else {}
        t.tensor(got, ref.online_softmax(x, bs), what="softmax", hint=hint, **tol, mistakes={
            "when a block raises the running max from m to m_new, the sum so far was taken relative to the old max: "
            "rescale it, l = l * exp(m - m_new) + sum(exp(block - m_new)).": lambda: _online_model(x, bs, rescale=False),
            "the last, shorter block was left out of the running max and sum: loop "
            "`for s in range(0, n, block_size)` (the slice x[..., s:s + block_size] is shorter at the end).": lambda: _online_model(x, bs, drop_last=True),
        })
        if structural:
            _check_reads_blocks(t, ops, x.shape[-1], bs)


# =========================================================================== 9.2 tiled attention


def _qkv(B: int, H: int, T: int, d: int, seed: int, dtype=torch.float32, spread: float = 1.5):
    """q, k, v ``[B, H, T, d]``; q and k scaled by ``spread`` so the softmax is neither flat nor one-hot."""
    g = seeded(seed)
    q = torch.randn(B, H, T, d, generator=g) * spread
    k = torch.randn(B, H, T, d, generator=g) * spread
    v = torch.randn(B, H, T, d, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _tiled_model(q, k, v, causal: bool, bs: int, scale: float | None = None, rescale_acc: bool = True,
                 rescale_l: bool = True, normalise: bool = True, skip_diag: bool = False, drop_keys: bool = False,
                 strict: bool = False, local_mask: bool = False):
    """A learner's tiled forward in float64 with one mistake switched on -> (out, m, l)."""
    q, k, v = (x.double() for x in (q, k, v))
    T, d = q.shape[-2:]
    scale = 1 / math.sqrt(d) if scale is None else scale
    t_keys = T - T % bs if drop_keys else T
    out = torch.zeros_like(q)
    m_all = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float64)
    l_all = torch.zeros(q.shape[:-1], dtype=torch.float64)
    for qs in range(0, T, bs):
        qe = min(qs + bs, T)
        m = torch.full(q.shape[:-2] + (qe - qs,), float("-inf"), dtype=torch.float64)
        l = torch.zeros_like(m)
        acc = torch.zeros(q.shape[:-2] + (qe - qs, d), dtype=torch.float64)
        k_end = min(qs if skip_diag else qe, t_keys) if causal else t_keys
        for ks in range(0, k_end, bs):
            ke = min(ks + bs, k_end)
            s = q[..., qs:qe, :] @ k[..., ks:ke, :].transpose(-2, -1) * scale
            if causal:
                rows, cols = torch.arange(qs, qe)[:, None], torch.arange(ks, ke)[None, :]
                if local_mask:
                    rows, cols = rows - qs, cols - ks
                s = s.masked_fill(cols >= rows if strict else cols > rows, float("-inf"))
            m_new = torch.maximum(m, s.amax(dim=-1))
            safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
            alpha = torch.exp(m - safe)
            p = torch.exp(s - safe[..., None])
            l = (l * alpha if rescale_l else l) + p.sum(dim=-1)
            acc = (acc * alpha[..., None] if rescale_acc else acc) + p @ v[..., ks:ke, :]
            m = m_new
        out[..., qs:qe, :] = acc / l[..., None] if normalise else acc
        m_all[..., qs:qe], l_all[..., qs:qe] = m, l
    return out, m_all, l_all


def _tiled_out_mistakes(q, k, v, causal: bool, bs: int, got: torch.Tensor) -> dict[str, Callable]:
    T = q.shape[-2]
    out = lambda **kw: _tiled_model(q, k, v, causal, bs, **kw)[0].to(q.dtype)
    mistakes = {
        "the accumulator was not rescaled: when the running max grows, multiply acc by alpha = exp(m - m_new) "
        "before adding p @ v_block (l gets the same factor).": lambda: out(rescale_acc=False),
        "the running sum l was not rescaled: when the running max grows, l = l * alpha + rowsum(p), with "
        "alpha = exp(m - m_new), just like acc.": lambda: out(rescale_l=False),
        "neither acc nor l was rescaled when the running max grew: multiply both by alpha = exp(m - m_new).": lambda: out(rescale_acc=False, rescale_l=False),
        "the final normalisation is missing: out = acc / l (l[..., None]) once all key blocks are done.": lambda: out(normalise=False),
        "the scores are not scaled: multiply q @ k^T by 1 / sqrt(d).": lambda: out(scale=1.0),
        "you divided the scores by d; the scale is 1 / sqrt(d).": lambda: out(scale=1 / q.shape[-1]),
    }
    if causal:
        mistakes.update({
            "the diagonal block was skipped: with causal=True, query block [qs, qe) needs every key block up to "
            "and including its own, i.e. keys 0..qe-1 (range(0, qe, block_size)); only blocks to the right of "
            "the diagonal are skipped.": lambda: out(skip_diag=True),
            "the causal mask also hides the diagonal: query i may attend to key i (mask keys j > i, not j >= i).": lambda: out(strict=True),
            "the causal mask uses positions inside the tile: compare the global positions qs + row and ks + col "
            "(torch.arange(qs, qe)[:, None] < torch.arange(ks, ke)[None, :]).": lambda: out(local_mask=True),
            "causal=True was ignored: mask keys j > i (and skip the key blocks right of the diagonal).": lambda: _tiled_model(q, k, v, False, bs)[0].to(q.dtype),
        })
    else:
        mistakes["causal=False here, but the output is causally masked: only mask when causal is True."] = lambda: _tiled_model(q, k, v, True, bs)[0].to(q.dtype)
    if T % bs:
        t_full = T - T % bs
        mistakes.update({
            "the last, shorter key block was dropped (and perhaps the last query block too): loop "
            "`for ks in range(0, T, block_size)` and slice k[..., ks:ks + block_size, :], shorter at the end; the "
            "same for the query blocks.": lambda: torch.cat([out(drop_keys=True)[..., :t_full, :], got[..., t_full:, :]], dim=-2),
            f"rows {t_full}..{T - 1} are wrong: the last, shorter query block was dropped or mishandled. Loop "
            "`for qs in range(0, T, block_size)`; the slice q[..., qs:qs + block_size, :] is shorter at the end.": lambda: torch.cat(
                [ref.flash_attention_tiled(q, k, v, causal, bs)[0][..., :t_full, :], got[..., t_full:, :]], dim=-2),
        })
    return mistakes


def _tiled_lse_mistakes(q, k, v, causal: bool, bs: int) -> dict[str, Callable]:
    def stats():
        _, m, l = _tiled_model(q, k, v, causal, bs)
        return m, l

    return {
        "lse is in log2 units: the contract is the natural log, lse = m + log(l) (divide a log2 value by log2(e)).": lambda: (
            ref.flash_attention_tiled(q, k, v, causal, bs)[1] * LOG2E),
        "lse is only the running max m: add log(l), lse = m + log(l).": lambda: stats()[0].float(),
        "lse is only log(l): add the running max, lse = m + log(l).": lambda: stats()[1].log().float(),
    }


def _check_tiles(t: Trial, ops: list, T: int, bs: int) -> None:
    """Fail if torch's fused attention ran, a [T, T] tensor was formed, or a softmax spanned all T keys."""
    __tracebackhide__ = True
    for op, _, _ in ops:
        if "scaled_dot_product" in op or "flash_attention" in op or "efficient_attention" in op:
            t.fail(f"your function called torch's fused attention ({op}).",
                   "compute the scores of each [block_size, block_size] tile yourself (q_block @ k_block^T) and "
                   "combine the tiles with the running max, sum and accumulator.")
    for op, _, outs in ops:
        for shape in outs:
            if len(shape) >= 2 and shape[-1] >= T and shape[-2] >= T:
                t.fail(f"your function created a {list(shape)} tensor ({op}): with T = {T} and block_size = {bs} "
                       "that is a full [T, T] matrix, the memory FlashAttention exists to avoid.",
                       "hold one [block_size, block_size] tile of scores at a time; build the causal mask of a tile "
                       "from torch.arange(qs, qe)[:, None] and torch.arange(ks, ke)[None, :], not from a [T, T] mask.")
    for op, first, _ in ops:
        if _is_reduction(op) and len(first) >= 2 and first[-1] >= T:
            t.fail(f"your function reduced over all {T} keys at once ({op} on a {list(first)} tensor): a strip of "
                   "scores against every key is not a tile.",
                   "split the keys into blocks too: loop over key blocks inside the query-block loop and combine "
                   "them with the running max m, sum l and accumulator acc.")


_TILED_HINT = ("for each key block: s = q_blk @ k_blk^T / sqrt(d); m_new = max(m, rowmax(s)); alpha = exp(m - m_new); "
               "p = exp(s - m_new); l = alpha * l + rowsum(p); acc = alpha * acc + p @ v_blk; m = m_new. "
               "At the end out = acc / l and lse = m + log(l).")

# (B, H, T, d, causal, block_size): no two of B, H, T, d equal; T a multiple of the block first, then ragged.
_TILED_CASES = [
    (2, 3, 48, 8, False, 16),
    (2, 3, 48, 8, True, 16),
    (1, 2, 37, 12, False, 16),
    (1, 2, 37, 12, True, 16),
    (1, 3, 30, 16, True, 7),
    (3, 1, 1, 4, True, 8),
    (1, 2, 5, 6, False, 16),
]


@exercise("9.2", "tiled FlashAttention in PyTorch", points=3, stars=3, notebook=NB)
def flash_attention_tiled(t: Trial) -> None:
    t.error_hints = {
        r"must match the size|size of tensor|cannot be multiplied": "tile shapes: s = q_blk @ k_blk.transpose(-2, -1) is "
        "[B, H, bq, bk]; m and l are [B, H, bq] (use [..., None] to broadcast them against s and acc).",
        r"takes \d+ positional argument": "the signature is flash_attention_tiled(q, k, v, causal, block_size).",
    }
    for i, (B, H, T, d, causal, bs) in enumerate(_TILED_CASES):
        q, k, v = _qkv(B, H, T, d, seed=910 + i)
        got, ops = _call_logged(t, q, k, v, causal, bs, case=describe_case(q=q, k=k, v=v, causal=causal, block_size=bs))
        out, lse = t.tuple(got, 2, ("out", "lse"))
        ref_out, ref_lse = ref.flash_attention_tiled(q, k, v, causal, bs)
        t.tensor(out, ref_out, what="out", hint=_TILED_HINT, mistakes=_tiled_out_mistakes(q, k, v, causal, bs, out))
        if isinstance(lse, torch.Tensor) and lse.shape != ref_lse.shape:
            t.fail(f"lse: expected shape {list(ref_lse.shape)} (one number per query row), got {list(lse.shape)}.",
                   "lse = m + log(l) has the shape of the running max: [B, H, T] (squeeze a trailing 1).")
        t.tensor(lse, ref_lse, what="lse", hint="lse = m + log(l), the natural-log log-sum-exp of each row of scaled "
                 "(and masked) scores.", mistakes=_tiled_lse_mistakes(q, k, v, causal, bs))
        if T > bs:
            _check_tiles(t, ops, T, bs)


# =========================================================================== instruments (9.3, 9.4)

_PAD_BEFORE, _PAD_AFTER = 1024, 128 * 128  # elements; a tile of 128 rows x 128 columns fits in the padding
_SENTINEL = -5555.0  # the padding of tensors the learner allocates
_EMPTY_FILL = 7777.0  # the body of torch.empty(...) tensors: an entry still equal to it was never written


def _guarded(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """x's values, contiguous on ``device``, inside a buffer padded with NaN on both sides."""
    n = x.numel()
    buf = torch.full((_PAD_BEFORE + n + _PAD_AFTER,), float("nan"), dtype=x.dtype, device=device)
    view = buf[_PAD_BEFORE : _PAD_BEFORE + n].view(x.shape)
    view.copy_(x)
    return view


class _GuardAllocations:
    """While active, float tensors from torch.empty / empty_like / zeros / zeros_like and
    Tensor.new_empty / new_zeros live inside buffers padded with ``_SENTINEL``; ``empty`` ones are
    filled with ``_EMPTY_FILL``."""

    FUNCS = ("empty", "empty_like", "zeros", "zeros_like")
    METHODS = ("new_empty", "new_zeros")

    def __init__(self):
        self.buffers: list[tuple[torch.Tensor, int]] = []
        self.saved: dict[str, Any] = {}

    def _guard(self, t: torch.Tensor, fill: float) -> torch.Tensor:
        if not t.is_floating_point() or not t.is_contiguous() or t.requires_grad:
            return t
        n = t.numel()
        buf = self.saved["full"]((_PAD_BEFORE + n + _PAD_AFTER,), _SENTINEL, dtype=t.dtype, device=t.device)
        view = buf[_PAD_BEFORE : _PAD_BEFORE + n].view(t.shape)
        view.fill_(fill)
        self.buffers.append((buf, n))
        return view

    def _wrap(self, real: Callable, fill: float) -> Callable:
        def alloc(*args, **kwargs):
            return self._guard(real(*args, **kwargs), fill)

        return alloc

    def __enter__(self):
        self.saved["full"] = torch.full
        for name in self.FUNCS:
            self.saved[name] = getattr(torch, name)
            setattr(torch, name, self._wrap(self.saved[name], _EMPTY_FILL if "empty" in name else 0.0))
        for name in self.METHODS:
            self.saved["Tensor." + name] = torch.Tensor.__dict__.get(name)  # None: inherited from TensorBase
            real = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._wrap(real, _EMPTY_FILL if "empty" in name else 0.0))
        return self

    def __exit__(self, *exc):
        for name in self.FUNCS:
            setattr(torch, name, self.saved[name])
        for name in self.METHODS:
            if self.saved["Tensor." + name] is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, self.saved["Tensor." + name])
        return False

    def overrun(self) -> bool:
        """True if anything was written into the padding of a guarded allocation."""
        for buf, n in self.buffers:
            pad = torch.cat([buf[:_PAD_BEFORE], buf[_PAD_BEFORE + n :]])
            if not bool((pad == torch.tensor(_SENTINEL, dtype=buf.dtype, device=buf.device)).all()):
                return True
        return False


def _runner_classes() -> list[type]:
    """Triton's kernel classes whose ``run`` launches a kernel (compiled, or in the interpreter)."""
    classes = []
    try:
        from triton.runtime.jit import JITFunction

        classes.append(JITFunction)
    except ImportError:
        pass
    try:
        from triton.runtime.interpreter import InterpretedFunction

        classes.append(InterpretedFunction)
    except ImportError:
        pass
    return [c for c in classes if callable(getattr(c, "run", None))]


class _KernelLaunches:
    """While active, records the source file of every Triton kernel launched."""

    def __init__(self):
        self.files: list[str] = []
        self.patched: list[tuple[type, Callable]] = []

    def __enter__(self):
        for cls in _runner_classes():
            original = cls.run

            def run(this, *args, _original=original, **kwargs):
                code = getattr(getattr(this, "fn", None), "__code__", None)
                self.files.append(code.co_filename if code else "?")
                return _original(this, *args, **kwargs)

            cls.run = run
            self.patched.append((cls, original))
        return self

    def __exit__(self, *exc):
        for cls, original in self.patched:
            cls.run = original
        return False


def _kernel_device() -> torch.device:
    """Where the learner's kernel runs: the CPU under Triton's interpreter, else the GPU."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda")


_TRITON_ERRORS = {
    r"NotImplementedError": "your kernel (or launcher) still raises NotImplementedError: fill in its body.",
    r"active drivers|no GPU|Found no NVIDIA driver": "Triton found no GPU, so it must run in its interpreter: run "
    "`setup()` (helpers.runtime) before the cell that defines your kernel, then run that cell again.",
    r"arange.*power of 2|power of two": "tl.arange needs a power of 2: use block sizes like 16, 32, 64 and pass the "
    "head dim d as a tl.constexpr (HEAD_DIM).",
    r"constexpr": "sizes used in tl.arange, tl.zeros and tile shapes must be tl.constexpr arguments (BLOCK_M, BLOCK_N, HEAD_DIM).",
    r"out of resource|shared memory": "the tiles do not fit in this GPU's shared memory: use smaller BLOCK_M / BLOCK_N "
    "(or fewer num_stages).",
    r"CompilationError": "Triton could not compile your kernel: the message names the line. tl.dot needs both tiles "
    "at least 16 x 16 and matching dtypes.",
    r"ValueError|TypeError|IndexError|RuntimeError": "run your launcher on the case above and read the traceback; "
    "in the interpreter the kernel runs as Python, so the line is shown.",
}


def _call_kernel(t: Trial, *args: Any, case: str) -> Any:
    """``t.call(*args)`` with guarded allocations and launch recording; fails on a store past the end,
    on no Triton launch at all, or on a launch of the course's own kernel."""
    __tracebackhide__ = True
    try:
        import triton  # noqa: F401
    except ImportError:
        t.fail("Triton is not installed here (it is Linux-only), so this exercise cannot run on this machine.",
               "run this notebook on Linux or in Colab (Runtime > Change runtime type > GPU).")
    launches, guard, fn = _KernelLaunches(), _GuardAllocations(), t.fn

    def run(*a):
        with launches, guard, warnings.catch_warnings():
            # NumPy's "invalid value" warnings from a kernel making NaN in the interpreter: the check names it.
            warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton\.")
            return fn(*a)

    t.fn = run
    try:
        got = t.call(*args, case=case)
    finally:
        t.fn = fn
    if guard.overrun():
        t.fail("your kernel wrote past the end of a tensor it stores into (the memory just after out, lse or a "
               "gradient changed).",
               "mask every tl.store with the rows (or keys) that exist, e.g. mask=offs_m[:, None] < T for a "
               "[BLOCK_M, HEAD_DIM] tile and mask=offs_m < T for lse.")
    if not launches.files:
        t.fail("no Triton kernel ran during your function.", "launch your kernel, `_kernel[grid](...)`, and return what it wrote.")
    if any(f in _SOLUTION_FILES for f in launches.files) and not _is_reference(fn):
        t.fail("your function launched the course's kernel (helpers/triton_flash.py) instead of your own.",
               "write the kernel in the notebook: the point of the exercise is to build it.")
    return got


def _attention64(q, k, v, causal: bool):
    """Exact attention in float64 on the CPU -> (out, lse, P, raw scores q k^T)."""
    q, k, v = (x.detach().to("cpu", torch.float64) for x in (q, k, v))
    T = q.shape[-2]
    raw = q @ k.transpose(-2, -1)
    s = raw / math.sqrt(q.shape[-1])
    allowed = att.causal_mask(T) if causal else None
    p = att.masked_softmax(s, allowed)
    lse = torch.logsumexp(s.masked_fill(~allowed, float("-inf")) if causal else s, dim=-1)
    return p @ v, lse, p, raw


def _tol(dtype: torch.dtype, device: torch.device, kind: str) -> dict:
    """Tolerances. fp32 in the interpreter is true fp32; on a GPU tl.dot on fp32 may use TF32 (10-bit
    mantissa), so allow ~1e-3 relative per product. fp16: P and the output are rounded to fp16 (2^-11).
    A mistake in masking, scaling or indexing gives errors of order 0.1-1."""
    gpu = device.type == "cuda"
    if kind == "probe":  # attention weights P (entries ~1/T) read back through a one-hot v
        return dict(atol=1e-5, rtol=2e-2) if gpu else dict(atol=1e-6, rtol=1e-4)
    if kind == "lse":
        return dict(atol=1e-2, rtol=1e-3) if gpu and dtype == torch.float32 else dict(atol=2e-3, rtol=1e-3)
    if dtype == torch.float16:
        return dict(atol=5e-3, rtol=5e-3) if kind == "fwd" else dict(atol=1e-2, rtol=1e-2)
    if gpu:
        return dict(atol=1e-2, rtol=1e-2) if kind == "fwd" else dict(atol=3e-2, rtol=3e-2)
    return dict(atol=1e-4, rtol=1e-4) if kind == "fwd" else dict(atol=2e-4, rtol=2e-4)


def _close(got: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float) -> bool:
    return (isinstance(got, torch.Tensor) and got.shape == expected.shape and got.dtype == expected.dtype
            and bool(torch.isclose(got.detach().double().cpu(), expected.double().cpu(), atol=atol, rtol=rtol).all()))


def _unwritten_hint(got: torch.Tensor, what: str) -> str:
    """A hint when some entries still hold torch.empty's marker, else ''."""
    marker = torch.tensor(_EMPTY_FILL, dtype=got.dtype, device=got.device)
    bad = (got == marker).nonzero()
    if not len(bad):
        return ""
    return (f"some entries of {what} were never written (first at index {bad[0].tolist()}): launch "
            "triton.cdiv(T, BLOCK) programs, not T // BLOCK, and store every row that exists (mask offs < T).")


def _dtype_check(t: Trial, got: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    __tracebackhide__ = True
    if isinstance(got, torch.Tensor) and got.dtype != dtype:
        t.fail(f"{what}: expected dtype {dtype} (the inputs' dtype), got {got.dtype}.",
               "allocate it like the inputs (torch.empty_like(q)) and convert the float32 accumulator when you "
               "store it: tl.store(ptrs, acc.to(Out.dtype.element_ty), mask=...).")


# =========================================================================== 9.3 Triton forward


def _split_forward(t: Trial, got: Any) -> tuple[Any, Any]:
    __tracebackhide__ = True
    if isinstance(got, torch.Tensor):
        return got, None
    if isinstance(got, (tuple, list)) and len(got) == 2 and isinstance(got[0], torch.Tensor):
        return got[0], got[1]
    t.fail(f"expected the output tensor, or a tuple (out, lse), got {describe(got)}.",
           "did you forget the `return` statement?" if got is None else "return out (or out, lse).")
    return None, None


def _weights_hint(P: torch.Tensor, P_ref: torch.Tensor, raw: torch.Tensor, causal: bool, d: int) -> str:
    """Name the mistake from the attention weights P [T, T] a kernel produced (float64, CPU)."""
    T = P.shape[-1]
    scale = 1 / math.sqrt(d)
    nan_rows = torch.isnan(P).any(dim=-1)
    if causal:
        future = torch.ones(T, T, dtype=torch.bool).triu(1)
        if (P.nan_to_num(0.0)[future].abs() > 1e-4).any():
            return ("queries put weight on future keys (j > i): the causal condition is reversed or on the wrong axis. "
                    "Rows are queries, columns keys: keep scores where offs_m[:, None] >= offs_n[None, :], and do not "
                    "loop past the diagonal block.")
        if nan_rows[0] and not nan_rows.all():
            first_ok = int((~nan_rows).nonzero()[0])
            if first_ok == 1:
                return ("row 0 is NaN: with causal=True query 0 sees only key 0, and your mask hid it. Query i may attend "
                        "to keys j <= i: keep scores where offs_m[:, None] >= offs_n[None, :].")
            if not nan_rows[first_ok:].any():
                return (f"rows 0..{first_ok - 1} are NaN: they saw no key at all, so the diagonal block was skipped. "
                        "With causal=True, query block start_m needs key blocks up to and including its own: loop "
                        "`for start_n in range(0, min((start_m + 1) * BLOCK_M, T), BLOCK_N)`.")
    if nan_rows.any():
        return ("NaN in the output: 0/0 (a row whose sum l stayed 0, e.g. every key masked), -inf - (-inf) (a fully "
                "masked block while m is still -inf), or loads past the end of q, k, v (mask them).")
    if causal:
        if (P.diagonal()[1:].abs() < 1e-6).all():
            return ("no query attends to itself: the mask hides the diagonal. Query i may attend to keys j <= i "
                    "(offs_m[:, None] >= offs_n[None, :], not >).")
        past = ~future & (P_ref > 1e-6)
        if (P[past].abs() < 1e-9).any():
            return ("some keys j <= i got no weight at all: key blocks were skipped. With causal=True the loop over key "
                    "blocks runs up to the end of this query block, (start_m + 1) * BLOCK_M, diagonal block included.")
    sums = P.sum(dim=-1)
    if not torch.allclose(sums, torch.ones_like(sums), atol=1e-3):
        if torch.allclose(P / sums[:, None], P_ref, atol=1e-4, rtol=1e-2):
            return ("the weights are right up to a factor per row: divide the accumulator by l at the end "
                    "(acc / l_i[:, None]), and rescale l by alpha whenever the running max grows.")
        return ("rows of weights do not sum to 1 and their shape is off: when a block raises the running max, rescale "
                "both acc and l by alpha = exp2(m_old - m_new) before adding the new block.")
    # Rows sum to 1: compare the effective softmax temperature with known mistakes.
    for factor, hint in (
        (math.sqrt(d), "the scores are not scaled by 1 / sqrt(d) (sm_scale)."),
        (1 / math.sqrt(d), "the scores were divided by d; the scale is 1 / sqrt(d)."),
        (math.log(2), "you used exp2 on scores that were not multiplied by log2(e): exp(x) = exp2(x * log2(e)), so "
                      "scale the scores by sm_scale * log2(e) (one multiply) before tl.exp2."),
        (LOG2E, "you multiplied the scores by log2(e) but then used tl.exp; with the log2(e) factor use tl.exp2."),
        (math.sqrt(d) * LOG2E, "the scores are not scaled by 1 / sqrt(d), and log2(e) is applied with tl.exp."),
        (math.sqrt(d) * math.log(2), "the scores are not scaled by 1 / sqrt(d) (the log2(e) factor is right)."),
    ):
        allowed = att.causal_mask(T) if causal else None
        if torch.allclose(P, att.masked_softmax(raw * scale * factor, allowed), atol=1e-4, rtol=1e-2):
            return hint
    return ""


def _probe(T: int, d: int = 128, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k random ``[1, 1, T, d]`` and v with one-hot rows (v[j] = e_j), so that out[i, :T] = P[i, :]."""
    g = seeded(seed)
    q = torch.randn(1, 1, T, d, generator=g)
    k = torch.randn(1, 1, T, d, generator=g)
    return q, k, torch.eye(T, d).view(1, 1, T, d)


def _forward_hint(kind: str, P: torch.Tensor, P_ref: torch.Tensor, raw: torch.Tensor, causal: bool, heads: int,
                  T: int, d: int) -> str:
    """The hint for a wrong forward output; P is out[0, 0, :, :T] (the weights when v is one-hot)."""
    if kind == "probe":
        return _weights_hint(P, P_ref, raw, causal, d) or _FWD_HINT
    if kind == "ragged-probe" and torch.isnan(P).any():  # the T = 128 probes passed: the ragged end is the problem
        return ("NaN when T is not a multiple of the block: your kernel read past the end of q, k or v (the memory "
                "after them holds NaN here). Mask the loads: tl.load(k_ptrs, mask=offs_n[:, None] < T, other=0.0), "
                "and the same for q (offs_m) and v.")
    if kind == "ragged-probe" and not causal:
        return ("T is not a multiple of the block here, and keys at positions >= T got weight: after loading k and v "
                "with mask=offs_n[:, None] < T, other=0.0, set the scores of those keys to -inf: "
                "qk = tl.where(offs_n[None, :] < T, qk, float('-inf')).")
    if kind == "ragged-probe":
        return ("T is not a multiple of the block here: check the masks of the last, partial blocks (loads, scores "
                "and stores all need offs < T) and the end of the key loop, min((start_m + 1) * BLOCK_M, T).")
    if T == 1:
        return "T = 1 is one short block: every load and store needs its mask (offs < T)."
    if heads > 1:
        return ("cases with B = H = 1 passed but this one has several batches and heads: program_id(1) is b * H + h, "
                "so offset q, k, v and out by b * stride_b + h * stride_h (and lse by (b * H + h) * T).")
    return _FWD_HINT


_FWD_HINT = ("per key block: qk = tl.dot(q, tl.trans(k)) * sm_scale * log2(e); m_new = max(m_i, rowmax(qk)); "
             "p = tl.exp2(qk - m_new[:, None]); alpha = tl.exp2(m_i - m_new); l_i = l_i * alpha + rowsum(p); "
             "acc = acc * alpha[:, None] + tl.dot(p, v); then out = acc / l_i[:, None].")


def _forward_case(t: Trial, q, k, v, causal: bool, dtype: torch.dtype, kind: str) -> None:
    """Run one forward case; ``kind``: "probe" (T = 128, B = H = 1, v one-hot), "ragged-probe" (T = 100,
    after the probes passed), or "full" (several heads, after both). Fails with a diagnosed hint."""
    __tracebackhide__ = True
    dev = _kernel_device()
    B, H, T, d = q.shape
    out64, lse64, P64, raw = _attention64(q.to(dtype), k.to(dtype), v.to(dtype), causal)
    qg, kg, vg = (_guarded(x.to(dtype), dev) for x in (q, k, v))
    got = _call_kernel(t, qg, kg, vg, causal, case=describe_case(q=qg, k=kg, v=vg, causal=causal) + f" on {dev.type}")
    out, lse = _split_forward(t, got)
    expected = out64.to(device=dev, dtype=dtype)
    if isinstance(out, torch.Tensor) and out.shape == expected.shape:
        _dtype_check(t, out, dtype, "out")
    tol = _tol(dtype, dev, "probe" if "probe" in kind else "fwd")
    hint = _FWD_HINT
    if isinstance(out, torch.Tensor) and out.shape == expected.shape and not _close(out, expected, **tol):
        P = out.detach().double().cpu()[0, 0, :, :T]
        hint = _unwritten_hint(out, "out") or _forward_hint(kind, P, P64[0, 0], raw[0, 0], causal, B * H, T, d)
    t.tensor(out, expected, what="out", hint=hint, **tol)
    if lse is not None:
        ref_lse = lse64.to(device=dev, dtype=torch.float32)
        if isinstance(lse, torch.Tensor) and lse.shape != ref_lse.shape:
            t.fail(f"lse: expected shape {list(ref_lse.shape)} ([B, H, T]), got {list(lse.shape)}.",
                   "allocate lse as torch.empty((B, H, T), dtype=torch.float32, device=q.device), or return only out.")
        if isinstance(lse, torch.Tensor) and lse.dtype != torch.float32:
            t.fail(f"lse: expected float32, got {lse.dtype}.", "keep the running statistics m_i, l_i and lse in float32.")
        lse_hint = _unwritten_hint(lse, "lse") if isinstance(lse, torch.Tensor) else ""
        t.tensor(lse, ref_lse, what="lse", hint=lse_hint or "lse = (m_i + tl.log2(l_i)) * ln(2) when m_i is in log2 "
                 "units (natural log: m + log(l)).", **_tol(dtype, dev, "lse"), mistakes={
                     "lse is in log2 units: multiply m_i + log2(l_i) by ln(2) to get the natural log.": lambda: ref_lse * LOG2E,
                     "lse is only the running max: add the log of the running sum, lse = m + log(l).": lambda: (
                         raw / math.sqrt(d)).masked_fill(causal & ~att.causal_mask(T), float("-inf")).amax(-1).to(
                         device=dev, dtype=torch.float32),
                 })


# (B, H, T, d, causal, dtype) after the probes: several batches and heads, short and ragged T.
_FORWARD_CASES = [
    (2, 3, 17, 16, True, torch.float16),
    (2, 3, 33, 32, False, torch.float32),
    (1, 2, 1, 64, True, torch.float16),
    (3, 2, 70, 64, True, torch.float32),
]


@exercise("9.3", "FlashAttention forward in Triton", points=3, stars=3, notebook=NB, time_limit=TRITON_TIME_LIMIT_S)
def flash_attention_triton(t: Trial) -> None:
    t.error_hints = _TRITON_ERRORS
    # 1-2: T = 128, a multiple of every block size, and v one-hot: out is the attention weights.
    for causal in (False, True):
        q, k, v = _probe(128, seed=930 + causal)
        _forward_case(t, q, k, v, causal, torch.float32, "probe")
    # 3-4: T = 100 is ragged for every block size from 8 to 64 (and shorter than 128).
    for causal in (False, True):
        q, k, v = _probe(100, seed=932 + causal)
        _forward_case(t, q, k, v, causal, torch.float32, "ragged-probe")
    for i, (B, H, T, d, causal, dtype) in enumerate(_FORWARD_CASES):
        q, k, v = _qkv(B, H, T, d, seed=940 + i, spread=1.0)
        _forward_case(t, q, k, v, causal, dtype, "full")


# =========================================================================== 9.4 Triton backward


def _backward64(q, k, v, lse, do, causal: bool, scale_grads: bool = True, use_delta: bool = True,
                mask: str = "causal", lse_units: str = "ln", dv_transposed: bool = True):
    """Gradients in float64 from P recomputed with the given lse, with one mistake switched on."""
    q, k, v, do = (x.detach().to("cpu", torch.float64) for x in (q, k, v, do))
    lse = lse.detach().to("cpu", torch.float64)
    T, d = q.shape[-2:]
    scale = 1 / math.sqrt(d)
    s = q @ k.transpose(-2, -1) * scale
    p = torch.exp(s - lse[..., None])
    if lse_units == "log2-missed":  # exp2(s * scale * log2e - lse): lse not converted to log2 units
        p = p * torch.exp(lse * (1 - math.log(2)))[..., None]
    if causal and mask != "none":
        keep = att.causal_mask(T)
        if mask == "strict":
            keep = keep & ~torch.eye(T, dtype=torch.bool)
        p = p.masked_fill(~keep, 0.0)
    o = p @ v
    dv = p.transpose(-2, -1) @ do if dv_transposed else p @ do
    dp = do @ v.transpose(-2, -1)
    delta = (do * o).sum(dim=-1, keepdim=True) if use_delta else 0.0
    ds = p * (dp - delta)
    g = scale if scale_grads else 1.0
    return ds @ k * g, ds.transpose(-2, -1) @ q * g, dv


_BWD_HINTS = {
    "dv": "dV = P^T dO, with P = exp(S * sm_scale - lse) recomputed from the saved lse (natural log: with exp2, "
          "multiply both by log2(e)).",
    "dk": "dK = sm_scale * dS^T Q with dS = P * (dP - D), dP = dO V^T and D = rowsum(dO * O).",
    "dq": "dQ = sm_scale * dS K with dS = P * (dP - D), dP = dO V^T and D = rowsum(dO * O).",
}


def _backward_mistakes(q, k, v, lse, do, causal: bool, which: int, dtype, dev) -> dict[str, Callable]:
    def g(**kw):
        return lambda: _backward64(q, k, v, lse, do, causal, **kw)[which].to(device=dev, dtype=dtype)

    mistakes = {
        "the gradients of q and k miss the softmax scale: S = sm_scale * Q K^T, so dQ = sm_scale * dS K and "
        "dK = sm_scale * dS^T Q.": g(scale_grads=False),
        "D is missing: dS = P * (dP - D) with D = rowsum(dO * O) (one number per query row), not P * dP.": g(use_delta=False),
        "P was recomputed with lse in the wrong units: lse is a natural log; with tl.exp2 use "
        "exp2(qk * sm_scale * log2(e) - lse * log2(e)).": g(lse_units="log2-missed"),
    }
    if which == 2:
        mistakes["dV = P^T dO (keys x queries times queries x d): transpose P."] = g(dv_transposed=False)
    if causal:
        mistakes["the causal mask is missing in the backward pass: P recomputed from lse must be 0 for keys j > i "
                 "(tl.where(offs_m[:, None] >= offs_n[None, :], p, 0.0))."] = g(mask="none")
        mistakes["the backward mask also hides the diagonal: query i attends to key i (keep j <= i)."] = g(mask="strict")
    return mistakes


_BACKWARD_CASES = [  # (B, H, T, d, causal, dtype): friendly T = 128 first, then ragged, then several heads
    (1, 1, 128, 64, False, torch.float32),
    (1, 1, 128, 64, True, torch.float32),
    (1, 1, 100, 32, True, torch.float32),
    (1, 1, 100, 16, False, torch.float16),
    (2, 3, 17, 128, True, torch.float16),
    (1, 2, 1, 64, False, torch.float32),
]


@exercise("9.4", "FlashAttention backward in Triton", points=3, stars=3, notebook=NB,
          time_limit=TRITON_TIME_LIMIT_S, bonus=True)
def flash_attention_triton_backward(t: Trial) -> None:
    t.error_hints = _TRITON_ERRORS
    dev = _kernel_device()
    ragged_passed = plain_passed = False
    for i, (B, H, T, d, causal, dtype) in enumerate(_BACKWARD_CASES):
        q, k, v = (x.to(dtype) for x in _qkv(B, H, T, d, seed=950 + i, spread=1.0))
        do = torch.randn(B, H, T, d, generator=seeded(960 + i)).to(dtype)
        out64, lse64, _, _ = _attention64(q, k, v, causal)
        lse = lse64.float()
        qr, kr, vr = (x.detach().double().requires_grad_() for x in (q, k, v))
        o = torch.nn.functional.scaled_dot_product_attention(qr, kr, vr, is_causal=causal)
        o.backward(do.double())
        expected = [x.grad.to(device=dev, dtype=dtype) for x in (qr, kr, vr)]
        args = [_guarded(x, dev) for x in (q, k, v, out64.to(dtype), lse, do)]
        case = describe_case(q=args[0], k=args[1], v=args[2], out=args[3], lse=args[4], grad_out=args[5],
                             causal=causal) + f" on {dev.type}"
        got = t.tuple(_call_kernel(t, *args, causal, case=case), 3, ("grad_q", "grad_k", "grad_v"))
        tol = _tol(dtype, dev, "bwd")
        for which, name in ((2, "dv"), (1, "dk"), (0, "dq")):
            g, e = got[which], expected[which]
            if isinstance(g, torch.Tensor) and g.shape == e.shape:
                _dtype_check(t, g, dtype, f"grad_{name[1]}")
            hint = _BWD_HINTS[name]
            if isinstance(g, torch.Tensor) and g.shape == e.shape and not _close(g, e, **tol):
                hint = _unwritten_hint(g, f"grad_{name[1]}")
                if not hint and T % 16 and not ragged_passed:
                    hint = ("T is not a multiple of the block here: mask the loads of q, k, v, dO, lse and D with offs < T "
                            "(other=0), set P to 0 for positions >= T (tl.where), and mask the stores.")
                elif not hint and B * H > 1 and ragged_passed:
                    hint = ("cases with B = H = 1 passed but this one has several batches and heads: program_id(1) is "
                            "b * H + h; offset every tensor by b * stride_b + h * stride_h (lse and D by (b * H + h) * T).")
                elif not hint and causal and plain_passed:
                    hint = ("the non-causal case passed, so look at the causal parts: P must be 0 for keys j > i "
                            "(offs_m[:, None] >= offs_n[None, :]) in both kernels, and the loops must cover every pair "
                            "j <= i: dK/dV from the key block's first query on, dQ up to the end of its query block.")
                hint = hint or _BWD_HINTS[name]
            t.tensor(g, e, what=f"grad_{name[1]}", hint=hint, **tol,
                     mistakes=_backward_mistakes(q, k, v, lse, do, causal, which, dtype, dev))
        ragged_passed = ragged_passed or bool(T % 16)
        plain_passed = plain_passed or not causal
