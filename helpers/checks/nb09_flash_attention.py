"""Checks for notebook 09_flash_attention: exercises 9.1-9.4.

These exercises ask for a *way* of computing, not only a result, so the checks also watch how the
learner's function works (the instruments are in :mod:`helpers.checks.instruments`):

- 9.1 and 9.2 (PyTorch) log every aten op the function runs, to see whether x is read block by block
  and whether a ``[T, T]`` tensor is ever formed; and they follow where data goes, so work moved out
  of PyTorch's sight (NumPy, Python lists, one Python number at a time) is refused with a message.
- 9.3 and 9.4 (Triton) run the learner's kernels on the GPU, or in Triton's interpreter on a CPU, on
  *guarded* tensors: each input sits inside a larger buffer padded with NaN, and each float tensor the
  learner allocates with ``torch.empty / zeros / *_like`` (or ``Tensor.new_empty / new_zeros``) gets
  a padding of sentinel values and, for ``empty``, a marker value in its body. A load past the end
  then turns into NaN, a store past the end changes the padding, and an entry the kernel never
  writes keeps the marker, so each is named instead of reading or corrupting memory. The checks
  also follow which inputs every tensor's data comes from: PyTorch may prepare and allocate, but
  combining q, k and v (scores, softmax, weighted sums) must happen in a Triton kernel, and the
  returned output must be written by a kernel that read them. Kernels written with pointer
  arithmetic, ``tl.make_block_ptr`` (where the installed Triton has it), tensor descriptors,
  ``@triton.autotune`` (in the interpreter the first config is taken, without benchmarking) or any
  grid layout are all accepted. The cases go from friendly to awkward (a sequence length that every
  block size divides, then ragged lengths, then several batches and heads), and a ``v`` made of
  one-hot rows turns the output into the attention weights themselves, so a wrong weight pattern
  (scale, causal condition, normalisation, skipped key blocks) is diagnosed from it.

Every case's expected output is computed before the learner's function first runs.
"""

from __future__ import annotations

import importlib.metadata
import math
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .. import nb01_qkv_shapes as att
from .. import nb09_flash_attention as ref
from . import guard as _guard
from .core import Trial, describe, describe_case, exercise, seeded
from .instruments import KERNEL, Calls, OpLog, Provenance, disabled_modes, op_name, warm_up

__all__ = ["online_softmax", "flash_attention_tiled", "flash_attention_triton", "flash_attention_triton_backward"]

NB = "09_flash_attention"
LOG2E = math.log2(math.e)
TRITON_TIME_LIMIT_S = 120.0  # per call: the interpreter is slow, and a GPU compiles on first use

_HELPERS = Path(__file__).resolve().parent.parent
_KERNEL_FILES = {str(_HELPERS / "nb09_triton_flash.py")}
# The course's own solutions of notebook 09: calling any of them is refused (by the core's watch).
_COURSE_FUNCTIONS = {"online_softmax", "flash_attention_tiled", "flash_attention_triton",
                     "flash_attention_triton_forward", "flash_attention_triton_backward"}


# =========================================================================== instruments (9.1, 9.2)

_REDUCTIONS = {"amax", "sum", "logsumexp", "_softmax", "_log_softmax", "mean", "cumsum", "cummax",
               "logcumsumexp", "sort", "topk", "prod", "aminmax", "nansum", "var", "std"}
_MAX_REDUCTIONS = {"aten.amax.default", "aten.max.dim", "aten.max.default"}
_MAX_LIKE = {"amax", "max", "maximum", "fmax", "cummax", "aminmax", "sort", "topk", "kthvalue",
             "max_pool1d", "max_pool2d", "max_pool1d_with_indices", "max_pool2d_with_indices",
             "adaptive_max_pool1d", "adaptive_max_pool2d", "clamp_min"}
_EXP_LIKE = {"exp", "exp2", "expm1", "_softmax", "logsumexp", "logaddexp", "logaddexp2", "sigmoid"}


class _OpLog(OpLog):
    """Logs ``(op, first input shape, output shapes)`` (the three-field form that
    helpers.checks.nb06_kv_sharing imports; new code uses helpers.checks.instruments.OpLog)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.ops[-1] = self.ops[-1][:3]
        return out


def _is_reduction(op: str) -> bool:
    return op_name(op) in _REDUCTIONS or op in _MAX_REDUCTIONS or op in {"aten.min.dim", "aten.min.default"}


def _is_exp_like(op: str) -> bool:
    return op_name(op) in _EXP_LIKE or op == "aten.pow.Scalar"  # pow.Scalar: base ** tensor


class _Watched:
    """What the instruments saw during one call: aten ops, provenance, conversions."""

    def __init__(self, ops: list, prov: Provenance, calls: Calls):
        self.ops, self.prov, self.calls = ops, prov, calls

    def exported(self, names: set[str]) -> str:
        """How sourced data left PyTorch (".numpy()", "NumPy", ...), or ''."""
        return next((how for how, x in self.calls.exported if x.numel() > 1 and self.prov.sources(x) & names), "")


def _call_logged(t: Trial, *args: Any, sources: dict[str, torch.Tensor], case: str) -> tuple[Any, _Watched]:
    """``t.call(*args)`` with the learner's aten ops logged and its data followed."""
    __tracebackhide__ = True
    warm_up()
    log, prov, calls, fn = OpLog(), Provenance(sources), Calls(), t.fn

    def run(*a):
        with calls, prov, log:
            return fn(*a)

    t.fn = run
    try:
        got = t.call(*args, case=case)
    finally:
        t.fn = fn
    return got, _Watched(log.ops, prov, calls)


def _check_stays_in_torch(t: Trial, seen: _Watched, names: set[str], what: str, reads_limit: int | None) -> None:
    """Fail if the inputs' data left PyTorch, where the op log cannot follow the work."""
    __tracebackhide__ = True
    how = seen.exported(names)
    if how:
        t.fail(f"your function took {what} out of PyTorch ({how}): the check follows your computation through "
               "PyTorch's operations to see how it reads the data, and cannot follow work done in NumPy or on "
               "Python lists.", "keep the data in torch tensors (torch.exp, .amax, @ ...) from start to end.")
    if reads_limit is not None and seen.prov.scalar_reads >= reads_limit:
        t.fail(f"your function read {what} into {seen.prov.scalar_reads} Python numbers one at a time (.item(), "
               "float(), a loop over elements): the check follows your computation through PyTorch's operations "
               "and cannot follow arithmetic on Python numbers.",
               "work on blocks as tensors: x[..., s:s + block_size] and torch operations on it.")


# =========================================================================== 9.1 online softmax


def _online_model(x: torch.Tensor, bs: int, rescale: bool = True, drop_last: bool = False, subtract_max: bool = True,
                  guard_max: bool = True, guard_empty: bool = True) -> torch.Tensor:
    """A learner's online softmax in float64, with one mistake switched off or on."""
    xf = x.double()
    n = xf.shape[-1]
    stop = n - n % bs if drop_last else n
    m = torch.full(xf.shape[:-1], float("-inf"), dtype=torch.float64)
    l = torch.zeros(xf.shape[:-1], dtype=torch.float64)
    for s in range(0, stop, bs):
        block = xf[..., s : s + bs]
        m_new = torch.maximum(m, block.amax(dim=-1)) if subtract_max else torch.zeros_like(m)
        safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new)) if guard_max else m_new
        alpha = torch.exp(m - safe) if subtract_max else torch.ones_like(m)
        l = (l * alpha if rescale else l) + torch.exp(block - safe[..., None]).sum(dim=-1)
        m = m_new
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    out = torch.exp(xf - m[..., None]) / l[..., None]
    if guard_empty:
        out = torch.where(l[..., None] == 0, torch.zeros_like(out), out)  # a NaN sum stays NaN
    return out.to(x.dtype)


_ONLINE_HINT = ("one pass over blocks: m_new = max(m, block max); l = l * exp(m - m_new) + sum(exp(block - m_new)); "
                "m = m_new; at the end return exp(x - m) / l (0 where l = 0), in x's dtype.")


def _online_mistakes(x: torch.Tensor, bs: int) -> dict:
    return {
        "when a block raises the running max from m to m_new, the sum so far was taken relative to the old max: "
        "rescale it, l = l * exp(m - m_new) + sum(exp(block - m_new)).": lambda: _online_model(x, bs, rescale=False),
        "the last, shorter block was left out of the running max and sum: loop "
        "`for s in range(0, n, block_size)` (the slice x[..., s:s + block_size] is shorter at the end).": lambda: _online_model(x, bs, drop_last=True),
        "subtract the running max before exp: exp(x) overflows for x > 88 in float32 (here |x| ~ 1e4), "
        "while exp(x - m) <= 1.": lambda: _online_model(x, bs, subtract_max=False),
        # (On a row with nothing allowed both of the next two give NaN: the first names that case.)
        "a row that is entirely -inf (nothing allowed) gives all zeros in this course, never NaN: its sum l "
        "stays 0, so divide by l only where l > 0 (and subtract 0 instead of an infinite max).": lambda: _online_model(
            x, bs, guard_empty=False),
        "a block that is entirely -inf leaves the running max at -inf, and exp(-inf - (-inf)) = exp(nan) = NaN: "
        "while m is still -inf, subtract 0 instead (torch.where(torch.isfinite(m), m, 0)).": lambda: _online_model(
            x, bs, guard_max=False),
    }


def _online_cases() -> list[tuple[torch.Tensor, int, bool]]:
    """(x, block_size, whether to check how x is read)."""
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
    x_long = torch.randn(3, 64, generator=g) * 2 + torch.linspace(0, 6, 64)  # 4 blocks of 16
    return [
        (x_main, 4, True),
        (x_1d, 3, False),
        (x_small, 1, False),
        (x_small, 10, False),
        (x_big, 4, False),
        (x_inf, 3, False),
        (x_row, 3, False),
        (x_half, 5, False),
        (x_double, 2, False),
        (x_long, 16, True),
    ]


def _check_reads_blocks(t: Trial, ops: list, x: torch.Tensor, bs: int) -> None:
    """Fail if a whole row was reduced at once, or if the maxima of all of x came before any exp."""
    __tracebackhide__ = True
    n = x.shape[-1]
    for op, first, _, _ in ops:
        if _is_reduction(op) and n in first:
            t.fail(f"your function reduced whole rows of x at once ({op} on a {list(first)} tensor, rows of "
                   f"{n}): block_size={bs} is not used.",
                   "read x in blocks x[..., s:s + block_size] and fold each block into a running max m and a "
                   "running sum l; only the final exp(x - m) / l touches the whole row, elementwise.")
    covered = 0  # how many numbers went through a max before the first exp
    for op, _, _, numels in ops:
        if _is_exp_like(op):
            break
        if op_name(op) in _MAX_LIKE:
            covered += sum(numels)
    if covered >= x.numel():
        t.fail(f"your function took the maximum over all of x ({covered} numbers through max operations, x has "
               f"{x.numel()}) before its first exp: that is the two-pass safe softmax (a pass for the max, a pass "
               "for the sum), not the online one.",
               "fold each block in as it arrives: exp(block - m_new) right away, and rescale the sum so far by "
               "exp(m_old - m_new) when a block raises the max. In attention the scores are never stored, so a "
               "second pass would mean computing q @ k^T twice.")


@exercise("9.1", "online softmax", points=2, stars=2, notebook=NB, section="2. The online softmax")
def online_softmax(t: Trial) -> None:
    t.error_hints = {
        r"must match the size|size of tensor": "keep the running max and sum one per row (shape x.shape[:-1]) and "
        "add [..., None] when you subtract them from a block.",
        r"takes \d+ positional argument": "the signature is online_softmax(x, block_size).",
    }
    t.forbidden_references = set(_COURSE_FUNCTIONS)
    cases = [(x, bs, structural, ref.online_softmax(x, bs)) for x, bs, structural in _online_cases()]
    for x, bs, structural, expected in cases:
        got, seen = _call_logged(t, x, bs, sources={"x": x}, case=describe_case(x=x, block_size=bs))
        # An honest function reads a few Python numbers per block and row at most (a max, a sum, a test);
        # reading every number of x is more than twice that where the rule applies (x_long: 192 vs <= 72).
        rows, n_blocks = x[..., 0].numel(), math.ceil(x.shape[-1] / bs)
        reads_limit = x.numel() if structural and 2 * 3 * rows * n_blocks <= x.numel() else None
        _check_stays_in_torch(t, seen, {"x"}, "x", reads_limit)
        tol = dict(atol=1e-3, rtol=1e-2) if x.dtype == torch.float16 else {}
        t.tensor(got, expected, what="softmax", hint=_ONLINE_HINT, mistakes=_online_mistakes(x, bs), **tol)
        if structural:
            _check_reads_blocks(t, seen.ops, x, bs)


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
    q, k, v = (x.detach().to("cpu", torch.float64) for x in (q, k, v))
    T, d = q.shape[-2:]
    scale = 1 / math.sqrt(d) if scale is None else scale
    t_keys = T - T % bs if drop_keys else T
    out = torch.zeros(q.shape[:-1] + v.shape[-1:], dtype=torch.float64)
    m_all = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float64)
    l_all = torch.zeros(q.shape[:-1], dtype=torch.float64)
    for qs in range(0, T, bs):
        qe = min(qs + bs, T)
        m = torch.full(q.shape[:-2] + (qe - qs,), float("-inf"), dtype=torch.float64)
        l = torch.zeros_like(m)
        acc = torch.zeros(q.shape[:-2] + (qe - qs, v.shape[-1]), dtype=torch.float64)
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


def _tiled_out_mistakes(q, k, v, causal: bool, bs: int, got: Any) -> dict[str, Callable]:
    T = q.shape[-2]
    out = lambda **kw: _tiled_model(q, k, v, causal, bs, **kw)[0].to(q.dtype)  # noqa: E731
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
    if T % bs and isinstance(got, torch.Tensor) and got.shape == q.shape:
        t_full = T - T % bs
        mistakes.update({
            "the last, shorter key block was dropped (and perhaps the last query block too): loop "
            "`for ks in range(0, T, block_size)` and slice k[..., ks:ks + block_size, :], shorter at the end; the "
            "same for the query blocks.": lambda: torch.cat([out(drop_keys=True)[..., :t_full, :], got[..., t_full:, :]], dim=-2),
            f"rows {t_full}..{T - 1} are wrong, rows before are right: the last, shorter query block was dropped or "
            "mishandled. Loop `for qs in range(0, T, block_size)`; the slice q[..., qs:qs + block_size, :] is "
            "shorter at the end.": lambda: torch.cat([out()[..., :t_full, :], got[..., t_full:, :]], dim=-2),
        })
    return mistakes


def _tiled_lse_mistakes(q, k, v, causal: bool, bs: int) -> dict[str, Callable]:
    def stats():
        out, m, l = _tiled_model(q, k, v, causal, bs)
        return m, l

    return {
        "lse is in log2 units: the contract is the natural log, lse = m + log(l) (divide a log2 value by log2(e)).": lambda: (
            (stats()[0] + stats()[1].log()) * LOG2E).float(),
        "lse is only the running max m: add log(l), lse = m + log(l).": lambda: stats()[0].float(),
        "lse is only log(l): add the running max, lse = m + log(l).": lambda: stats()[1].log().float(),
    }


def _check_tiles(t: Trial, ops: list, T: int, bs: int) -> None:
    """Fail if torch's fused attention ran, a [T, T] tensor was formed, or a softmax spanned all T keys."""
    __tracebackhide__ = True
    for op, _, _, _ in ops:
        if "scaled_dot_product" in op or "flash_attention" in op or "efficient_attention" in op:
            t.fail(f"your function called torch's fused attention ({op}).",
                   "compute the scores of each [block_size, block_size] tile yourself (q_block @ k_block^T) and "
                   "combine the tiles with the running max, sum and accumulator.")
    for op, _, outs, _ in ops:
        for shape in outs:
            if len(shape) >= 2 and shape[-1] >= T and shape[-2] >= T:
                t.fail(f"your function created a {list(shape)} tensor ({op}): with T = {T} and block_size = {bs} "
                       "that is a full [T, T] matrix, the memory FlashAttention exists to avoid.",
                       "hold one [block_size, block_size] tile of scores at a time; build the causal mask of a tile "
                       "from torch.arange(qs, qe)[:, None] and torch.arange(ks, ke)[None, :], not from a [T, T] mask.")
    for op, first, _, _ in ops:
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


@exercise("9.2", "tiled FlashAttention in PyTorch", points=3, stars=3, notebook=NB, section="3. Tiled attention in PyTorch")
def flash_attention_tiled(t: Trial) -> None:
    t.error_hints = {
        r"must match the size|size of tensor|cannot be multiplied": "tile shapes: s = q_blk @ k_blk.transpose(-2, -1) is "
        "[B, H, bq, bk]; m and l are [B, H, bq] (use [..., None] to broadcast them against s and acc).",
        r"takes \d+ positional argument": "the signature is flash_attention_tiled(q, k, v, causal, block_size).",
    }
    t.forbidden_references = set(_COURSE_FUNCTIONS)
    cases = []
    for i, (B, H, T, d, causal, bs) in enumerate(_TILED_CASES):
        q, k, v = _qkv(B, H, T, d, seed=910 + i)
        cases.append((q, k, v, causal, bs, *ref.flash_attention_tiled(q, k, v, causal, bs)))
    for q, k, v, causal, bs, ref_out, ref_lse in cases:
        B, H, T, d = q.shape
        got, seen = _call_logged(t, q, k, v, causal, bs, sources={"q": q, "k": k, "v": v},
                                 case=describe_case(q=q, k=k, v=v, causal=causal, block_size=bs))
        tiles = B * H * math.ceil(T / bs) ** 2
        _check_stays_in_torch(t, seen, {"q", "k", "v"}, "q, k or v", q.numel() if 6 * tiles <= q.numel() else None)
        out, lse = t.tuple(got, 2, ("out", "lse"))
        t.tensor(out, ref_out, what="out", hint=_TILED_HINT, mistakes=_tiled_out_mistakes(q, k, v, causal, bs, out))
        if isinstance(lse, torch.Tensor) and lse.shape != ref_lse.shape:
            t.fail(f"lse: expected shape {list(ref_lse.shape)} (one number per query row), got {list(lse.shape)}.",
                   "lse = m + log(l) has the shape of the running max: [B, H, T] (squeeze a trailing 1).")
        t.tensor(lse, ref_lse, what="lse", hint="lse = m + log(l), the natural-log log-sum-exp of each row of scaled "
                 "(and masked) scores.", mistakes=_tiled_lse_mistakes(q, k, v, causal, bs))
        if T > bs:
            _check_tiles(t, seen.ops, T, bs)


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
    Tensor.new_empty / new_zeros on the CPU or a GPU live inside buffers padded with ``_SENTINEL``;
    ``empty`` ones are filled with ``_EMPTY_FILL``. (Tensors on other devices, such as ``meta``, and
    allocations made while a guarded one is being built are left alone.)"""

    FUNCS = ("empty", "empty_like", "zeros", "zeros_like")
    METHODS = ("new_empty", "new_zeros")

    def __init__(self):
        self.buffers: list[tuple[torch.Tensor, int]] = []
        self.saved: dict[str, Any] = {}
        self.busy = False

    def _guard(self, t: torch.Tensor, fill: float) -> torch.Tensor:
        if (not isinstance(t, torch.Tensor) or t.device.type not in ("cpu", "cuda") or not t.is_floating_point()
                or not t.is_contiguous() or t.requires_grad):
            return t
        self.busy = True
        try:
            n = t.numel()
            buf = self.saved["full"]((_PAD_BEFORE + n + _PAD_AFTER,), _SENTINEL, dtype=t.dtype, device=t.device)
            view = buf[_PAD_BEFORE : _PAD_BEFORE + n].view(t.shape)
            view.fill_(fill)
        finally:
            self.busy = False
        self.buffers.append((buf, n))
        return view

    def _wrap(self, real: Callable, fill: float) -> Callable:
        def alloc(*args, **kwargs):
            t = real(*args, **kwargs)
            return t if self.busy else self._guard(t, fill)

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


def _tensor_args(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors a kernel launch received: tensors, and the tensors inside tensor descriptors."""
    found = []
    for a in (*args, *kwargs.values()):
        for x in (a if isinstance(a, (list, tuple)) else (a,)):
            base = x if isinstance(x, torch.Tensor) else getattr(x, "base", None)
            if isinstance(base, torch.Tensor):
                found.append(base)
    return found


class _KernelUnsupported(RuntimeError):
    """Triton could not run an operation of the learner's kernel (removed API, interpreter limits)."""


_GPU_KERNEL_ON_CPU = ("your kernel is a compiled (GPU) kernel, and this machine has no GPU: it was decorated with "
                      "@triton.jit before Triton's interpreter was switched on")


class _KernelLaunches:
    """While active, every Triton kernel launch is recorded (kernel name, source file, tensor
    arguments) and what it wrote is marked in ``prov``; it runs with the check's dispatch modes,
    profile hook and trace hook off (the interpreter runs kernels as Python: watching that would
    only slow it down, about 3x). In the interpreter, ``@triton.autotune`` takes its first config
    without benchmarking (benchmarks need a GPU)."""

    def __init__(self, prov: Provenance, calls: Calls, interpreter: bool):
        self.prov, self.calls, self.interpreter = prov, calls, interpreter
        self.launches: list[tuple[str, str, list[torch.Tensor]]] = []
        self.patched: list[tuple[type, str, Any]] = []

    def _launch(self, cls: type, original: Callable) -> Callable:
        launches = self

        def run(this, *args, **kwargs):
            fn = getattr(this, "fn", None)
            code = getattr(fn, "__code__", None)
            tensors = _tensor_args(args, kwargs)
            launches.launches.append((getattr(fn, "__name__", "?"), code.co_filename if code else "?", tensors))
            with disabled_modes():
                before = [x.detach().clone() for x in tensors]
            # The check machinery's trace hook watches for calls of the course's reference; a kernel body
            # is no place for one (a launch of the course's kernel is caught here), and traced, the
            # interpreter runs about 3x slower. It is paused through the machinery's own switch.
            trace, settrace = sys.gettrace(), getattr(_guard, "_own_settrace", None)
            try:
                with disabled_modes(), launches.calls.pause():
                    if settrace is not None and trace is not None:
                        settrace(None)
                    return original(this, *args, **kwargs)
            except NotImplementedError as e:
                if not e.args:
                    raise
                raise _KernelUnsupported(f"Triton {_triton_version()} cannot run this kernel: {e}") from None
            except Exception as e:
                text = str(e)
                if text == "NotImplementedError()":  # the interpreter wraps a kernel body's bare raise
                    raise NotImplementedError() from None
                if "active drivers" in text and cls.__name__ == "JITFunction" and not torch.cuda.is_available():
                    raise RuntimeError(_GPU_KERNEL_ON_CPU) from None
                raise
            finally:
                if settrace is not None and trace is not None:
                    settrace(trace)
                with disabled_modes():
                    launches.prov.kernel_launch(tensors, before)

        return run

    def _patch(self, cls: type, name: str, new: Any) -> None:
        self.patched.append((cls, name, cls.__dict__.get(name)))  # None: inherited
        setattr(cls, name, new)

    def __enter__(self):
        for cls in _runner_classes():
            self._patch(cls, "run", self._launch(cls, cls.run))
        if self.interpreter:
            try:
                from triton.runtime.autotuner import Autotuner
            except ImportError:
                Autotuner = None
            if Autotuner is not None and hasattr(Autotuner, "_bench"):
                self._patch(Autotuner, "_bench", lambda this, *args, config, **meta: [0.0, 0.0, 0.0])
        return self

    def __exit__(self, *exc):
        for cls, name, original in reversed(self.patched):
            if original is None:
                delattr(cls, name)
            else:
                setattr(cls, name, original)
        self.patched.clear()
        return False


def _triton_version() -> str:
    """The installed Triton's version, read without importing it (importing Triton before
    helpers.runtime.configure_triton() has run would leave its own library compiled-only)."""
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return "?"


def _kernel_device() -> torch.device:
    """Where the learner's kernel runs: the CPU under Triton's interpreter, else the GPU."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda")


_TRITON_ERRORS = {
    r"Block pointers have been removed": "tl.make_block_ptr and tl.advance were removed from recent Triton versions "
    f"(this machine has Triton {_triton_version()}), on a GPU as in the interpreter: load tiles with pointer "
    "arithmetic and masks, tl.load(K + offsets, mask=offs_n[:, None] < T, other=0.0) (section 4), or with "
    "tl.make_tensor_descriptor.",
    r"not supported in interpreter mode": "Triton's interpreter cannot run this operation (the message names it): "
    "it runs only compiled, on a GPU. Write the kernel with tl.load, tl.store, tl.dot and elementwise operations.",
    r"decorated with @triton\.jit before": "run `setup()` "
    "(helpers.runtime) before the cell that defines your kernel, then run that cell again: Triton decides between "
    "compiling and interpreting when a kernel is decorated.",
    r"active drivers|no GPU|Found no NVIDIA driver|not compiled with CUDA": "your launcher asked Triton or torch for a GPU, and there is "
    "none: in Triton's interpreter only the kernel launch itself runs. Remove GPU queries from the launcher "
    "(triton.runtime.driver.active..., device properties, triton.testing.do_bench, torch.cuda...).",
    r"arange.*power of 2|power of two": "tl.arange needs a power of 2: use block sizes like 16, 32, 64 and pass the "
    "head dim d as a tl.constexpr (HEAD_DIM).",
    r"constexpr": "sizes used in tl.arange, tl.zeros and tile shapes must be tl.constexpr arguments (BLOCK_M, "
    "BLOCK_N, HEAD_DIM).",
    r"out of resource|shared memory": "the tiles do not fit in this GPU's shared memory: use smaller BLOCK_M / "
    "BLOCK_N (or fewer num_stages).",
    r"[Ii]nput shapes should have M >= 16|K >= 16|N >= 16": "tl.dot needs both tiles at least 16 x 16: use "
    "BLOCK_M, BLOCK_N and HEAD_DIM of 16 or more.",
    r"[Bb]oth operands must be same dtype|dtype mismatch.*dot": "tl.dot needs both tiles in the same dtype: convert "
    "p to v's dtype first, tl.dot(p.to(v.dtype), v).",
}


def _call_kernel(t: Trial, *args: Any, sources: dict[str, torch.Tensor], case: str) -> tuple[Any, Provenance]:
    """``t.call(*args)`` with guarded allocations, kernel launches recorded and the data of q, k, v
    followed. Fails on a store past the end, on no Triton launch at all, on a launch of the course's
    own kernel, and when the attention was computed outside the learner's kernels."""
    __tracebackhide__ = True
    try:
        import triton  # noqa: F401
    except ImportError:
        t.fail("Triton is not installed here (it is Linux-only), so this exercise cannot run on this machine.",
               "run this notebook on Linux or in Colab (Runtime > Change runtime type > GPU).")
    warm_up()
    watched = {"q", "k", "v"}
    prov, calls, guard, fn = Provenance(sources, watched), Calls(), _GuardAllocations(), t.fn
    launches = _KernelLaunches(prov, calls, interpreter=_kernel_device().type == "cpu")

    def run(*a):
        with calls, prov, launches, guard, warnings.catch_warnings():
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
    if not launches.launches:
        t.fail("no Triton kernel ran during your function.", "launch your kernel, `_kernel[grid](...)`, and return "
               "what it wrote.")
    if any(f in _KERNEL_FILES for _, f, _ in launches.launches) and not t.is_reference:
        t.fail("your function launched the course's kernel (helpers/nb09_triton_flash.py) instead of your own.",
               "write the kernel in the notebook: the point of the exercise is to build it.")
    where = "your kernels" if len({name for name, _, _ in launches.launches}) > 1 else "your kernel"
    if prov.mixed:
        t.fail(f"your function computed with q, k and v in PyTorch ({prov.mixed[0]}): in this exercise the "
               f"attention is computed in {where}, not in PyTorch around it.",
               "pass q, k, v and the output tensors to the kernel and do the arithmetic on them inside it; in "
               "PyTorch only allocate outputs, compute launch parameters (and, in the backward, D = rowsum(dO * O)).")
    how = next((how for how, x in calls.exported
                if x.numel() > 1 and prov.sources(x) & watched and KERNEL not in prov.sources(x)), "")
    if how:
        t.fail(f"your function took q, k or v out of PyTorch ({how}): in this exercise the attention is computed "
               f"in {where}.", "pass q, k, v themselves to the kernel and do the arithmetic inside it.")
    q = sources["q"]
    if prov.scalar_reads >= q.numel() // 2:
        t.fail(f"your function read q, k or v into {prov.scalar_reads} Python numbers one at a time: in this "
               f"exercise the attention is computed in {where}.",
               "pass q, k, v themselves to the kernel and do the arithmetic inside it.")
    return got, prov


def _written_by_kernel(t: Trial, prov: Provenance, got: torch.Tensor, what: str, needs: set[str]) -> None:
    """Fail unless the data of ``got`` comes from a kernel launch that read the inputs in ``needs``."""
    __tracebackhide__ = True
    have = prov.sources(got)
    if not needs | {KERNEL} <= have:
        read = ", ".join(sorted(have - {KERNEL})) or "none of the inputs"
        t.fail(f"{what} was not written by a Triton kernel that read {' and '.join(sorted(needs))} (its data comes "
               f"from: {read}).",
               f"launch your kernel with {', '.join(sorted(needs))} and {what} among its arguments, let it store the "
               f"result into {what}, and return that tensor.")


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


def _closeness(got: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float) -> torch.Tensor:
    """Elementwise closeness in float64 on the CPU (NaN where expected is finite counts as wrong)."""
    return torch.isclose(got.detach().double().cpu(), expected.detach().double().cpu(), atol=atol, rtol=rtol)


def _close(got: Any, expected: torch.Tensor, atol: float, rtol: float) -> bool:
    return (isinstance(got, torch.Tensor) and got.shape == expected.shape and got.dtype == expected.dtype
            and bool(_closeness(got, expected, atol, rtol).all()))


def _ranges(idx: list[int]) -> str:
    """[0, 1, 2, 5] -> '0..2, 5'."""
    out, start = [], None
    for i, x in enumerate(idx):
        if start is None:
            start = x
        if i + 1 == len(idx) or idx[i + 1] != x + 1:
            out.append(f"{start}" if start == x else f"{start}..{x}")
            start = None
    return ", ".join(out)


def _unwritten(got: torch.Tensor, what: str) -> tuple[str, str]:
    """(diagnosis, where) when some entries still hold torch.empty's marker; ('', '') otherwise."""
    marker = (got.detach().cpu() == _EMPTY_FILL)
    if not bool(marker.any()):
        return "", ""
    B, H, T = got.shape[:3]
    per_row = marker.reshape(B, H, T, -1).all(-1)  # [B, H, T]: a row never written at all
    slices_all, slices_any = per_row.all(-1), marker.reshape(B, H, -1).any(-1)
    if bool(slices_all.any()) and bool((slices_all == slices_any).all()):
        missing = [tuple(x) for x in slices_all.nonzero().tolist()]
        return (f"{what}[b, h] was never written for {len(missing)} of the B * H = {B * H} (batch, head) slices "
                f"(first {missing[0]}): the grid's second axis must launch B * H programs, one per batch and head "
                "(program_id(1) = b * H + h).", "")
    rows = per_row.all(0).all(0)
    if bool(rows.any()) and bool((per_row == rows).all()):
        r0 = int(rows.nonzero()[0])
        if bool(rows[r0:].all()):
            return (f"rows {r0}..{T - 1} of {what} were never written (in every batch and head), rows before were: "
                    f"T = {T} ends in a partial block. Launch triton.cdiv(T, BLOCK_M) programs along the query "
                    "axis, not T // BLOCK_M, and store the partial block with mask offs_m < T.", "")
    first = marker.nonzero()[0].tolist()
    return "", f"some entries were never written, first at index {first}"


def _slices(got: torch.Tensor, expected: torch.Tensor, tol: dict, what: str) -> tuple[str, str]:
    """(diagnosis, where) for an output whose (batch, head) slices are right in some places only."""
    B, H = got.shape[:2]
    ok = _closeness(got, expected, **tol).reshape(B, H, -1).all(-1)
    if bool(ok.all()) or B * H == 1:
        return "", ""
    wrong = [tuple(x) for x in (~ok).nonzero().tolist()]
    found = {}
    for b, h in wrong:
        for b2 in range(B):
            for h2 in range(H):
                if (b2, h2) != (b, h) and bool(_closeness(got[b, h], expected[b2, h2], **tol).all()):
                    found[(b, h)] = (b2, h2)
    if len(found) == len(wrong):
        b, h = wrong[0]
        b2, h2 = found[wrong[0]]
        what_offset = ("the batch offset" if all(f[1] == w[1] for w, f in found.items())
                       else "the head offset" if all(f[0] == w[0] for w, f in found.items()) else "the offsets")
        verb = "are" if what_offset == "the offsets" else "is"
        return (f"{what}[{b}, {h}] holds the result of (batch, head) ({b2}, {h2}): {what_offset} of a program {verb} "
                "wrong. With program_id(1) = b * H + h, offset q, k, v and the output by b * stride_b + h * stride_h "
                "(b = program_id(1) // H, h = program_id(1) % H).", "")
    right = [tuple(x) for x in ok.nonzero().tolist()]
    where = f"wrong in (batch, head) slices {wrong[:6]}{' ...' if len(wrong) > 6 else ''}"
    return "", where + (f", right in {right[:4]}{' ...' if len(right) > 4 else ''}" if right else "")


def _rows(got: torch.Tensor, expected: torch.Tensor, tol: dict, T: int) -> str:
    """'rows r0..T-1' when exactly the last rows (of every slice) are wrong, else ''."""
    bad = ~_closeness(got, expected, **tol).reshape(-1, T, got.shape[-1]).all(-1).all(0)  # [T]: a row wrong somewhere
    if not bool(bad.any()):
        return ""
    r0 = int(bad.nonzero()[0])
    return f"rows {r0}..{T - 1}" if r0 > 0 and bool(bad[r0:].all()) else ""


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


def _probe(T: int, d: int = 128, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k random ``[1, 1, T, d]`` and v with one-hot rows (v[j] = e_j), so that out[i, :T] = P[i, :]."""
    g = seeded(seed)
    q = torch.randn(1, 1, T, d, generator=g)
    k = torch.randn(1, 1, T, d, generator=g)
    return q, k, torch.eye(T, d).view(1, 1, T, d)


def _weights_hint(P: torch.Tensor, P_ref: torch.Tensor, raw: torch.Tensor, causal: bool, d: int, ragged: bool) -> str:
    """Name the mistake from the attention weights P [T, T] a kernel produced (float64, CPU), or ''."""
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
        return ""
    if causal and (P.diagonal()[1:].abs() < 1e-6).all():
        return ("no query attends to itself: the mask hides the diagonal. Query i may attend to keys j <= i "
                "(offs_m[:, None] >= offs_n[None, :], not >).")
    dead = ((P.abs() < 1e-12) & (P_ref > 1e-9)).any(0) & ~(P.abs() >= 1e-12).any(0)  # keys nobody weighs
    if dead.any():
        keys = dead.nonzero().flatten().tolist()
        if keys[-1] == T - 1 and keys == list(range(keys[0], T)):
            return (f"keys {keys[0]}..{T - 1} got no weight from any query: the loop over key blocks stops before the "
                    f"last, partial block (T = {T}). Loop `for start_n in range(0, hi, BLOCK_N)` with hi = T "
                    "(or the causal limit), and mask the keys >= T of that block instead of skipping it.")
        return (f"keys {_ranges(keys)} got no weight from any query: those key blocks were skipped. Every query "
                "block must visit every key block (with causal=True: up to and including its diagonal block).")
    if causal:
        past = ~future & (P_ref > 1e-6)
        if (P[past].abs() < 1e-9).any():
            return ("some keys j <= i got no weight at all: key blocks were skipped. With causal=True the loop over key "
                    "blocks runs up to the end of this query block, (start_m + 1) * BLOCK_M, diagonal block included.")
    sums = P.sum(dim=-1)
    if not torch.allclose(sums, torch.ones_like(sums), atol=1e-3):
        if torch.allclose(P / sums[:, None], P_ref, atol=1e-4, rtol=1e-2):
            if bool((sums > 1).all()):
                return ("the weights are right up to a factor per row, the row's sum l (> 1): divide the accumulator "
                        "by l at the end (acc / l_i[:, None]).")
            if ragged and bool((sums < 1).all()):
                return (f"T = {T} is not a multiple of the block here, and keys at positions >= T got weight: the "
                        "weights on the real keys sum to less than 1 (row 0: "
                        f"{float(sums[0]):.3f}). After loading k and v with mask=offs_n[:, None] < T, other=0.0, set "
                        "the scores of those keys to -inf: qk = tl.where(offs_n[None, :] < T, qk, float('-inf')).")
        return ""
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


def _rescale_hint(out: torch.Tensor, q, k, v, causal: bool, tol: dict) -> str:
    """Is ``out`` a tiled forward without a rescale (for some power-of-2 key block size)? Name it, or ''."""
    variants = {
        "the accumulator was not rescaled: when a key block raises the running max, multiply acc by alpha = "
        "exp2(m_i - m_new) before adding the new block (l_i gets the same factor).": dict(rescale_acc=False),
        "the running sum l_i was not rescaled: when a key block raises the running max, l_i = l_i * alpha + "
        "rowsum(p) with alpha = exp2(m_i - m_new), just like acc.": dict(rescale_l=False),
        "neither acc nor l_i was rescaled when a key block raised the running max: multiply both by alpha = "
        "exp2(m_i - m_new) before adding the new block.": dict(rescale_acc=False, rescale_l=False),
    }
    T = q.shape[-2]
    for hint, kw in variants.items():
        for bs in (16, 32, 64, 128):
            if bs < T and _close(out, _tiled_model(q, k, v, causal, bs, **kw)[0].to(out.dtype), **tol):
                return hint
    return ""


_FWD_HINT = ("per key block: qk = tl.dot(q, tl.trans(k)) * sm_scale * log2(e); m_new = max(m_i, rowmax(qk)); "
             "p = tl.exp2(qk - m_new[:, None]); alpha = tl.exp2(m_i - m_new); l_i = l_i * alpha + rowsum(p); "
             "acc = acc * alpha[:, None] + tl.dot(p, v); then out = acc / l_i[:, None].")


def _forward_cases(dev: torch.device) -> list[dict]:
    """Every case of 9.3 with its expected values, built before the learner's code runs."""
    specs = []
    # 1-2: T = 128, a multiple of every block size, and v one-hot: out is the attention weights.
    for causal in (False, True):
        specs.append((*_probe(128, seed=930 + causal), causal, torch.float32, "probe"))
    # 3-4: T = 100 is ragged for every block size from 8 to 64 (and shorter than 128).
    for causal in (False, True):
        specs.append((*_probe(100, seed=932 + causal), causal, torch.float32, "ragged-probe"))
    # then several batches and heads, short and ragged T.
    for i, (B, H, T, d, causal, dtype) in enumerate(_FORWARD_CASES):
        specs.append((*_qkv(B, H, T, d, seed=940 + i, spread=1.0), causal, dtype, "full"))
    cases = []
    for q, k, v, causal, dtype, kind in specs:
        q, k, v = (x.to(dtype) for x in (q, k, v))
        out64, lse64, P64, raw = _attention64(q, k, v, causal)
        cases.append(dict(q=q, k=k, v=v, causal=causal, dtype=dtype, kind=kind, P64=P64, raw=raw,
                          out=out64.to(device=dev, dtype=dtype), lse=lse64.to(device=dev, dtype=torch.float32),
                          args=[_guarded(x, dev) for x in (q, k, v)]))
    return cases


def _forward_case(t: Trial, c: dict, passed: list[str]) -> None:
    """Run one forward case (see _forward_cases) and compare, naming what it can recognise."""
    __tracebackhide__ = True
    dev = _kernel_device()
    qg, kg, vg = c["args"]
    causal, dtype, kind, expected = c["causal"], c["dtype"], c["kind"], c["out"]
    B, H, T, d = qg.shape
    got, prov = _call_kernel(t, qg, kg, vg, causal, sources={"q": qg, "k": kg, "v": vg},
                             case=describe_case(q=qg, k=kg, v=vg, causal=causal) + f" on {dev.type}")
    out, lse = _split_forward(t, got)
    if isinstance(out, torch.Tensor) and out.shape == expected.shape:
        _dtype_check(t, out, dtype, "out")
    tol = _tol(dtype, dev, "probe" if "probe" in kind else "fwd")
    diagnosis, what = "", "out"
    if isinstance(out, torch.Tensor) and out.shape == expected.shape and out.dtype == dtype and not _close(out, expected, **tol):
        diagnosis, where = _unwritten(out, "out")
        P = out.detach().double().cpu()[0, 0, :, :T]
        if not diagnosis and not where and "probe" in kind:
            if kind == "ragged-probe" and torch.isnan(P).any() and "probe" in passed:
                diagnosis = ("NaN now that T is not a multiple of the block (the cases with T = 128 passed): your kernel "
                             "read past the end of q, k or v (the memory after them holds NaN here). Mask the loads: "
                             "tl.load(k_ptrs, mask=offs_n[:, None] < T, other=0.0), and the same for q (offs_m) and v.")
            diagnosis = diagnosis or _weights_hint(P, c["P64"][0, 0], c["raw"][0, 0], causal, d, kind == "ragged-probe")
        if not diagnosis and not where:
            diagnosis, where = _slices(out, expected, tol, "out")
        if not diagnosis and not where:
            diagnosis = _rescale_hint(out, c["q"], c["k"], c["v"], causal, tol)
        if not diagnosis and not where:
            rows = _rows(out, expected, tol, T)
            if rows and T % 16:
                diagnosis = (f"{rows} of out (the last, partial query block: T = {T}) are wrong, the rows before are "
                             "right: mask that block's loads, scores and stores with offs < T.")
            elif causal and "plain-" + str((B, H, T, d, dtype)) in passed:
                diagnosis = ("the same shapes passed with causal=False, so look at the causal parts: keep scores where "
                             "offs_m[:, None] >= offs_n[None, :], and loop over key blocks up to the end of this query "
                             "block, (start_m + 1) * BLOCK_M.")
        what = f"out ({where})" if where else "out"
    t.tensor(out, expected, what=what, hint=_FWD_HINT, diagnosis=diagnosis, **tol)
    if T > 1:  # with one key, out = v: a kernel's output is then also a copy of an input
        _written_by_kernel(t, prov, out, "out", {"q", "k", "v"})
    if lse is not None:
        ref_lse = c["lse"]
        if isinstance(lse, torch.Tensor) and lse.shape != ref_lse.shape:
            t.fail(f"lse: expected shape {list(ref_lse.shape)} ([B, H, T]), got {list(lse.shape)}.",
                   "allocate lse as torch.empty((B, H, T), dtype=torch.float32, device=q.device), or return only out.")
        if isinstance(lse, torch.Tensor) and lse.dtype != torch.float32:
            t.fail(f"lse: expected float32, got {lse.dtype}.", "keep the running statistics m_i, l_i and lse in float32.")
        lse_diag = _unwritten(lse[..., None], "lse")[0] if isinstance(lse, torch.Tensor) else ""
        t.tensor(lse, ref_lse, what="lse", diagnosis=lse_diag, hint="lse = (m_i + tl.log2(l_i)) * ln(2) when m_i is in "
                 "log2 units (natural log: m + log(l)).", **_tol(dtype, dev, "lse"), mistakes={
                     "lse is in log2 units: multiply m_i + log2(l_i) by ln(2) to get the natural log.": lambda: ref_lse * LOG2E,
                     "lse is only the running max: add the log of the running sum, lse = m + log(l).": lambda: (
                         c["raw"] / math.sqrt(d)).masked_fill(causal & ~att.causal_mask(T), float("-inf")).amax(-1).to(
                         device=dev, dtype=torch.float32),
                 })
    passed.append(kind)
    if not causal:
        passed.append("plain-" + str((B, H, T, d, dtype)))


def _dtype_check(t: Trial, got: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    __tracebackhide__ = True
    if isinstance(got, torch.Tensor) and got.dtype != dtype:
        t.fail(f"{what}: expected dtype {dtype} (the inputs' dtype), got {got.dtype}.",
               "allocate it like the inputs (torch.empty_like(q)) and convert the float32 accumulator when you "
               "store it: tl.store(ptrs, acc.to(Out.dtype.element_ty), mask=...).")


# (B, H, T, d, causal, dtype) after the probes: several batches and heads, short and ragged T.
_FORWARD_CASES = [
    (2, 3, 17, 16, True, torch.float16),
    (2, 3, 33, 32, False, torch.float32),
    (1, 2, 1, 64, True, torch.float16),
    (3, 2, 70, 64, True, torch.float32),
]


@exercise("9.3", "FlashAttention forward in Triton", points=3, stars=3, notebook=NB, time_limit=TRITON_TIME_LIMIT_S,
          section="4. The Triton kernel, block by block")
def flash_attention_triton(t: Trial) -> None:
    t.error_hints = _TRITON_ERRORS
    t.forbidden_references = set(_COURSE_FUNCTIONS)
    passed: list[str] = []
    for case in _forward_cases(_kernel_device()):
        _forward_case(t, case, passed)


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


def _backward_cases(dev: torch.device) -> list[dict]:
    """Every case of 9.4 with its expected gradients (autograd through SDPA in float64), built first."""
    cases = []
    for i, (B, H, T, d, causal, dtype) in enumerate(_BACKWARD_CASES):
        q, k, v = (x.to(dtype) for x in _qkv(B, H, T, d, seed=950 + i, spread=1.0))
        do = torch.randn(B, H, T, d, generator=seeded(960 + i)).to(dtype)
        out64, lse64, _, _ = _attention64(q, k, v, causal)
        lse = lse64.float()
        qr, kr, vr = (x.detach().double().requires_grad_() for x in (q, k, v))
        with torch.enable_grad():
            o = torch.nn.functional.scaled_dot_product_attention(qr, kr, vr, is_causal=causal)
            o.backward(do.double())
        cases.append(dict(q=q, k=k, v=v, do=do, lse=lse, causal=causal, dtype=dtype,
                          expected=[x.grad.to(device=dev, dtype=dtype) for x in (qr, kr, vr)],
                          args=[_guarded(x, dev) for x in (q, k, v, out64.to(dtype), lse, do)]))
    return cases


@exercise("9.4", "FlashAttention backward in Triton", points=3, stars=3, notebook=NB,
          time_limit=TRITON_TIME_LIMIT_S, bonus=True, section="5. The backward pass")
def flash_attention_triton_backward(t: Trial) -> None:
    t.error_hints = _TRITON_ERRORS
    t.forbidden_references = set(_COURSE_FUNCTIONS)
    dev = _kernel_device()
    passed: list[tuple] = []
    for c in _backward_cases(dev):
        args, causal, dtype = c["args"], c["causal"], c["dtype"]
        B, H, T, d = args[0].shape
        case = describe_case(q=args[0], k=args[1], v=args[2], out=args[3], lse=args[4], grad_out=args[5],
                             causal=causal) + f" on {dev.type}"
        names = ("q", "k", "v", "out", "lse", "grad_out")
        got, prov = _call_kernel(t, *args, causal, sources=dict(zip(names, args)), case=case)
        got = t.tuple(got, 3, ("grad_q", "grad_k", "grad_v"))
        tol = _tol(dtype, dev, "bwd")
        for which, name in ((2, "dv"), (1, "dk"), (0, "dq")):
            g, e = got[which], c["expected"][which]
            what = f"grad_{name[1]}"
            if isinstance(g, torch.Tensor) and g.shape == e.shape:
                _dtype_check(t, g, dtype, what)
            diagnosis = ""
            if isinstance(g, torch.Tensor) and g.shape == e.shape and g.dtype == e.dtype and not _close(g, e, **tol):
                diagnosis, where = _unwritten(g, what)
                if not diagnosis and not where and torch.isnan(g).any() and T % 16 and any(p[2] % 16 == 0 for p in passed):
                    diagnosis = (f"NaN now that T is not a multiple of the block here (T = {T}; the cases with T = 128 "
                                 "passed): your kernels read past the end of q, k, v, dO, lse or D (the memory after them "
                                 "holds NaN here). Mask those loads with offs < T (other=0), set P to 0 for positions "
                                 ">= T (tl.where), and mask the stores.")
                if not diagnosis and not where:
                    diagnosis, where = _slices(g, e, tol, what)
                if not diagnosis and not where:
                    rows = _rows(g, e, tol, T)
                    if rows and T % 16:
                        diagnosis = (f"{rows} of {what} (the last, partial block: T is not a multiple of the block here) "
                                     "are wrong, the rows before are right: mask the loads of that block with offs < T "
                                     "(other=0), set P to 0 for positions >= T, and mask the stores.")
                    elif causal and (B, H, T, d, dtype, False) in passed:
                        diagnosis = ("the same shapes passed with causal=False, so look at the causal parts: P must be 0 "
                                     "for keys j > i (offs_m[:, None] >= offs_n[None, :]) in both kernels, and the loops "
                                     "must cover every pair j <= i: dK/dV from the key block's first query on, dQ up to "
                                     "the end of its query block.")
                what = f"{what} ({where})" if where else what
            t.tensor(g, e, what=what, hint=_BWD_HINTS[name], diagnosis=diagnosis, **tol,
                     mistakes=_backward_mistakes(c["q"], c["k"], c["v"], c["lse"], c["do"], causal, which, dtype, dev))
            if T > 1:  # with one key, grad_q = grad_k = 0 and grad_v = grad_out: nothing to compute
                _written_by_kernel(t, prov, g, f"grad_{name[1]}", {"q", "k"})
        passed.append((B, H, T, d, dtype, causal))
