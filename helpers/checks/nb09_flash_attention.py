"""Checks for notebook 09_flash_attention, in PyTorch: exercises 9.1 (online softmax) and 9.2 (tiled
FlashAttention). The Triton exercises 9.3 and 9.4 are in :mod:`helpers.checks.nb09_triton_flash`.

These exercises ask for a *way* of computing, not only a result, so the checks also watch how the
learner's function works (:mod:`helpers.checks.instruments`): they log every aten op the function
runs, to see whether x is read block by block and whether a ``[T, T]`` tensor is ever formed; and
they follow where data goes, so work moved out of PyTorch's sight (NumPy, Python lists, one Python
number at a time) is refused with a message. What the instruments see (:mod:`helpers.checks.watchers`)
fails a check in a learner's session; in ``make grade`` it is a note for a grader
(``Trial.fail_observed``).

Every case's expected output is computed before the learner's function first runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from .. import nb09_flash_attention as ref
from ..registry import in_module
from .core import Trial, describe_case, eager_mistakes, exercise, seeded
from .diagnose import ranges_text
from .feedback import Mistake, wrong_signature
from .guard import _equal, _isclose, _isfinite
from .instruments import (
    MAX_LIKE,
    Watched,
    check_stays_in_torch,
    is_exp_like,
    is_reduction,
    op_name,
    warm_up,
)
from .nb04_backward import _weighed
from .watchers import logged

__all__ = in_module(__name__)  # its exercises' checks, as helpers/registry.py lists them

LOG2E = math.log2(math.e)
# The course's own solutions of notebook 09: calling any of them is refused (by the core's watch).
def call_logged(t: Trial, *args: Any, sources: dict[str, int], case: str) -> tuple[Any, Watched]:
    """``t.call(*args)`` with the learner's aten ops logged and the data of ``sources`` (name ->
    position among ``args``) followed."""
    __tracebackhide__ = True
    warm_up()
    got, seen = t.call_watched(logged, args, sources, case=case)
    return got, Watched(seen["ops"], seen["exported"], seen["scalar_reads"])


_COURSE_FUNCTIONS = {"online_softmax", "flash_attention_tiled", "flash_attention_triton",
                     "flash_attention_triton_forward", "flash_attention_triton_backward"}


# =========================================================================== 9.1 online softmax


def _online_model(x: torch.Tensor, bs: int, rescale: bool = True, drop_last: bool = False, subtract_max: bool = True,
                  guard_max: bool = True, guard_empty: bool = True, inverse: str = "", max_from_zero: bool = False,
                  accumulate: bool = True, normalise: bool = True, per_block: bool = False,
                  short_slices: bool = False, final_max: str = "last", sum_axis: int | None = None,
                  exp_old_max: bool = False, native: bool = False, old_guard: bool = False) -> torch.Tensor:
    """A learner's online softmax in float64, with one mistake switched off or on.

    ``inverse``: the rescale factor inverted, exp(m_new - m): "nan" with m starting at -inf (the
    first factor is exp(+inf)), "first" with m and l started from the first block (no -inf).
    ``max_from_zero``: the running max starts at 0, not -inf. ``accumulate=False``: l is the sum of
    the latest block only (``l = ...`` for ``l = l * alpha + ...``). ``per_block``: each block's
    output is written as it is read, divided by the sum so far. ``short_slices``: blocks
    ``x[..., s:s + bs - 1]``, one entry short. ``final_max="first"``: the output exp(x - m) / l takes m
    after the first block. ``sum_axis``: each block's sum runs over that axis too (rows summed
    together). ``exp_old_max``: each block's exp(block - m) uses the max from before the block (0 while
    it is -inf). The learner's ways with -inf and precision: ``native`` computes in x's dtype (where exp
    overflows at 88 in float32), ``old_guard`` rescales with exp(m - m_new) where m = 0 while it is -inf
    (l * alpha is then 0 * inf = NaN if m_new is far below 0), ``guard_empty="positive"`` returns 0
    wherever l > 0 fails (a NaN sum too)."""
    xf = x if native else x.double()
    n = xf.shape[-1]
    stop = n - n % bs if drop_last else n
    if drop_last == "always":  # range(0, n - bs, bs): the last block is left out, full or not
        stop = max(n - bs, 0)
    m = torch.full(xf.shape[:-1], 0.0 if max_from_zero else float("-inf"), dtype=xf.dtype)
    l = torch.zeros(xf.shape[:-1], dtype=xf.dtype)
    blocks = torch.zeros_like(xf)
    m_first = None
    for s in range(0, stop, bs):
        short = max(1, bs - 1) if short_slices == "min1" else bs - 1  # "min1": a guard against empty blocks
        block = xf[..., s : s + short] if short_slices else xf[..., s : s + bs]
        if block.shape[-1] == 0:
            continue
        m_new = torch.maximum(m, block.amax(dim=-1)) if subtract_max else torch.zeros_like(m)
        safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new)) if guard_max else m_new
        alpha = torch.exp(m - safe) if subtract_max else torch.ones_like(m)
        if old_guard and subtract_max:
            alpha = torch.exp(torch.where(torch.isfinite(m), m, torch.zeros_like(m)) - safe)
        if inverse:
            alpha = torch.exp(safe - m)  # exp(+inf) = inf while m is -inf
            if inverse == "first":
                alpha = torch.where(torch.isfinite(m), alpha, torch.ones_like(alpha))
        old = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        e = torch.exp(block - (old if exp_old_max else safe)[..., None])
        block_sum = e.sum(dim=-1)
        if sum_axis is not None:
            block_sum = block_sum.sum(dim=sum_axis, keepdim=True).expand_as(l)
        l = ((l * alpha if rescale else l) if accumulate else 0) + block_sum
        m = m_new
        m_first = m if m_first is None else m_first
        if per_block:
            part = e if per_block == "stale" else e / l[..., None]
            if guard_empty:  # a block whose sum so far is 0 is written as zeros
                part = torch.where(l[..., None] > 0, part, torch.zeros_like(part))
            blocks[..., s : s + bs] = part
    if final_max == "first" and m_first is not None:
        m = m_first
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    if per_block == "stale":  # each block's exp with the max of its time, divided by the final l
        out = blocks / l[..., None]
    elif per_block:
        out = blocks
    else:
        out = torch.exp(xf - m[..., None])
        if normalise:
            out = out / l[..., None]
    if guard_empty == "positive":
        out = torch.where(l[..., None] > 0, out, torch.zeros_like(out))
    elif guard_empty:
        out = torch.where(l[..., None] == 0, torch.zeros_like(out), out)  # a NaN sum stays NaN
    return out.to(x.dtype)


_ONLINE_HINT = ("one pass over blocks: m_new = max(m, block max); l = l * exp(m - m_new) + sum(exp(block - m_new)); "
                "m = m_new; at the end return exp(x - m) / l (0 where l = 0), in x's dtype.")


class _Variants(tuple):
    """One mistake's outputs however the learner treats fully masked blocks and rows (with or without
    the -inf guards): the check weighs the one that fits the learner's output."""


def _guards(x: torch.Tensor) -> list[dict]:
    """The ways of handling -inf and large numbers that change the output on ``x`` (the first: the
    course's): the -inf guards only where x has -inf, precision and overflow only where |x| > 80."""
    neginf = bool(torch.isneginf(x).any())
    extreme = bool((x[torch.isfinite(x)].abs() > 80).any()) or x.dtype == torch.float16
    return [dict(guard_max=gm, guard_empty=ge, native=nat, old_guard=og)
            for nat in ((False, True) if extreme else (False,)) for og in ((False, True) if extreme else (False,))
            for gm in ((True, False) if neginf else (True,))
            for ge in (True, "positive", False)]


def _variants(x: torch.Tensor, bs: int, alts: tuple = ({},), **kw) -> _Variants:
    """``_online_model(x, bs, **kw)`` (or with ``kw`` updated by each of ``alts``: other ways of
    writing the same mistake), with and without each -inf guard, in float64 or in x's dtype."""
    guards = _guards(x)
    return _Variants(lambda g=g, a=a: _online_model(x, bs, **{**g, **kw, **a}) for a in alts for g in guards
                     if not set(g) & (set(kw) | set(a)) or g == guards[0])


def _eager_variants(models: dict) -> dict:
    """``eager_mistakes`` for models that may be :class:`_Variants`: the first variant is evaluated now,
    the others (kept as callables after it) only when the learner's output needs them."""
    out = {}
    for hint, model in models.items():
        if isinstance(model, _Variants):
            first = eager_mistakes({0: model[0]})
            if first:
                out[hint] = [first[0], *model[1:]]
        else:
            out.update(eager_mistakes({hint: model}))
    return out


def _pick(mistakes: dict, got: Any, atol: float, rtol: float) -> dict:
    """Each mistake's variant that fits ``got`` (at this comparison's tolerance), else its first."""
    def fits(w: Any) -> bool:
        return (isinstance(got, torch.Tensor) and isinstance(w, torch.Tensor) and w.shape == got.shape
                and w.dtype == got.dtype and bool(_isclose(got.detach().double(), w.double(), atol=atol,
                                                                rtol=rtol, equal_nan=True).all()))

    out = {}
    for hint, value in mistakes.items():
        if isinstance(value, list):
            chosen = value[0]
            if not fits(chosen):
                for variant in value[1:]:
                    try:
                        w = variant()
                    except Exception:  # noqa: BLE001 - a variant that cannot happen on this case
                        continue
                    if fits(w):
                        chosen = w
                        break
            value = chosen
        out[hint] = value
    return out


def _online_mistakes(x: torch.Tensor, bs: int) -> dict:
    mistakes = {
        Mistake("sum-not-rescaled", "when a block raises the running max from m to m_new, the sum "
                "so far was taken relative to the old max: rescale it, l = l * exp(m - m_new) + "
                "sum(exp(block - m_new)).",
                "the running sum l is not rescaled when a block raises the max"):
            _variants(x, bs, rescale=False),
        Mistake("rescale-factor-inverted", "the rescale factor is inverted: when the max rises "
                "from m to m_new, multiply l by exp(m - m_new) (at most 1), not exp(m_new - m). "
                "(While m is still -inf, exp(m_new - m) is exp(+inf) = inf, and 0 * inf = NaN.)"):
            _variants(x, bs, inverse="nan"),
        Mistake("rescale-factor-inverted", "the rescale factor is inverted: when the max rises "
                "from m to m_new, multiply l by exp(m - m_new) (at most 1), not exp(m_new - m)."):
            _variants(x, bs, inverse="first"),
        Mistake("last-block-dropped", "the last, shorter block was left out of the running max and "
                "sum: loop `for s in range(0, n, block_size)` (the slice x[..., s:s + block_size] "
                "is shorter at the end)."):
            _variants(x, bs, drop_last=True, alts=({}, dict(drop_last="always"))),
        Mistake("block-slice-one-short", "each block misses its last entry: the block is x[..., "
                "s:s + block_size] (the end of a slice is excluded already), not x[..., s:s + "
                "block_size - 1]."):
            _variants(x, bs, short_slices=True, alts=({}, dict(short_slices="min1"))),
        Mistake("sum-not-accumulated", "l holds the sum of the last block only: accumulate over "
                "the blocks, l = l * exp(m - m_new) + sum(exp(block - m_new)), so that the final l "
                "sums the whole row."):
            _variants(x, bs, accumulate=False),
        Mistake("missing-final-division", "the final division is missing: return exp(x - m) / l "
                "(l[..., None]), so that each row sums to 1."):
            _variants(x, bs, normalise=False),
        Mistake("normalised-per-block", "each block was divided by the sum of the blocks read so "
                "far: the sum is only complete after the last block, so compute the output once, "
                "exp(x - m) / l with the final m and l, after the loop."):
            _variants(x, bs, per_block=True),
        # (On a row with nothing allowed both of the next two give NaN: the first names that case.)
        Mistake("block-exps-with-old-max", "each block's exp(block - m) was kept with the running max of "
                "its time, but the final l is relative to the final max: compute the output once at the "
                "end, exp(x - m) / l with the final m (or rescale every stored block by exp(m_then - m)).",
                "kept each block's exp with the max of its time, divided by the final l"):
            _variants(x, bs, per_block="stale"),
        Mistake("nan-on-empty-row", "a row that is entirely -inf (nothing allowed) gives all zeros "
                "in this course, never NaN: its sum l stays 0, so divide by l only where l > 0 "
                "(and subtract 0 instead of an infinite max).",
                "a row with nothing allowed gives NaN (0 / 0) instead of zeros"):
            lambda: _online_model(x, bs, guard_empty=False),
        Mistake("nan-on-masked-block", "a block that is entirely -inf leaves the running max at "
                "-inf, and exp(-inf - (-inf)) = exp(nan) = NaN: while m is still -inf, subtract 0 "
                "instead (torch.where(torch.isfinite(m), m, 0)).",
                "a fully masked block gives NaN: -inf minus a running max still at -inf"):
            lambda: _online_model(x, bs, guard_max=False),
    }
    if bool((x[torch.isfinite(x)].abs() > 88).any()):  # only here does exp(x) overflow (or underflow) in float32
        no_max = ("subtract the running max before exp: exp(x) overflows for x > 88 in float32 (here |x| ~ 1e4), "
                  "while exp(x - m) <= 1")
        no_max_description = "the running max is not subtracted before exp (exp overflows)"
        underflow = ("; and on a row whose entries are all far below 0, every exp(x) underflows "
                     "to 0, so l = 0 and 0 / 0 = NaN.")
        mistakes[Mistake("max-not-subtracted", no_max + ".", no_max_description)] = (
            _variants(x, bs, subtract_max=False))
        mistakes[Mistake("max-not-subtracted", no_max + underflow, no_max_description)] = (
            lambda: _online_model(x, bs, subtract_max=False, guard_empty=False))
    # A running max started at 0 rather than -inf is right until a whole row lies far below 0: there exp(x - 0)
    # underflows to 0 for every entry, so l = 0 (x_big has such a row).
    row_max = x.double().amax(dim=-1)
    far = torch.isfinite(row_max) & (row_max < -88)
    if bool(far.any()):
        start_at_zero = ("the running max starts at 0 instead of -inf: on a row whose entries are all far below 0 "
                         f"(here one row's largest entry is {float(row_max[far].max()):.4g}), exp(x - 0) underflows to "
                         "0, so l = 0 and the row comes out {}. Start with m = torch.full(x.shape[:-1], float('-inf')): "
                         "then the largest entry gives exp(m - m) = 1.")
        mistakes[Mistake("max-starts-at-0", start_at_zero.format("as zeros"))] = (
            _variants(x, bs, max_from_zero=True))
        mistakes[Mistake("max-starts-at-0", start_at_zero.format("as 0 / 0 = NaN"))] = (
            lambda: _online_model(x, bs, max_from_zero=True, guard_empty=False))
    mistakes[Mistake("output-uses-first-max", "the final exp(x - m) / l used the running max of the first "
                     "block: use the final m, the one l is relative to after the last block (keep m updated, "
                     "m = m_new, in every block).",
                     "normalised the output with the first block's max, not the final one")] = (
        _variants(x, bs, final_max="first"))
    mistakes[Mistake("exp-with-old-max", "each block's exp(block - m) used the max from before the block: "
                     "first m_new = max(m, block max), then l = l * exp(m - m_new) + sum(exp(block - m_new)), "
                     "with the new max.", "added exp(block - m_old) before updating the running max")] = (
        _variants(x, bs, exp_old_max=True))
    for axis in range(x.dim() - 1):
        mistakes[Mistake("block-sum-over-rows", f"each block's sum also ran over axis {axis} (size "
                         f"{x.shape[axis]}), adding up several rows: sum exp(block - m_new) over the last "
                         "axis only, .sum(dim=-1), one sum per row.",
                         "summed each block over another axis too (rows added together)")] = (
            _variants(x, bs, sum_axis=axis))
    for axis in range(x.dim() - 1):
        mistakes[Mistake("softmax-over-wrong-axis", f"your output is the softmax over axis {axis} "
                         f"(size {x.shape[axis]}), not over the last axis: read blocks x[..., s:s "
                         "+ block_size] and take every max and sum over dim=-1.",
                         "the softmax is taken over another axis than the last")] = (
            lambda axis=axis: torch.softmax(x.double(), dim=axis).to(x.dtype))
    return mistakes


def _online_diagnosis(got: Any, x: torch.Tensor, expected: torch.Tensor) -> str:
    """What an online softmax's output shows by property, or '': rows with nothing allowed (all -inf)
    that come out uniform; rows exactly proportional to the right ones that do not sum to 1."""
    if not (isinstance(got, torch.Tensor) and got.shape == x.shape and got.is_floating_point()):
        return ""
    g, e = got.detach().double().reshape(-1, x.shape[-1]), expected.detach().double().reshape(-1, x.shape[-1])
    empty = torch.isneginf(x.detach().reshape(-1, x.shape[-1])).all(-1)
    n = x.shape[-1]
    if bool(empty.any()) and bool(_isclose(g[empty], torch.full_like(g[empty], 1 / n), rtol=1e-3).all()):
        return Mistake("empty-row-uniform", f"a row that is entirely -inf (nothing allowed) must come out as "
                       f"zeros; yours is uniform, 1/{n} everywhere, as if -inf had been replaced by a finite "
                       "number (such as -1e9): keep -inf, subtract 0 while the max is -inf, and return 0 where "
                       "l = 0.", "a row with nothing allowed comes out uniform instead of zeros")
    if not bool(_isfinite(g).all()):
        return ""
    live = e > 1e-12
    if bool((g[~live].abs() > 1e-6).any()) or not bool(live.any(-1)[~empty].all()):
        return ""
    r = torch.where(live, g / e.clamp_min(1e-300), torch.nan)
    lo = r.nan_to_num(float("inf")).amin(-1)[~empty]
    hi = r.nan_to_num(float("-inf")).amax(-1)[~empty]
    if not bool(((hi - lo) <= 2e-3 * hi.abs()).all()) or bool(((lo - 1).abs() < 1e-3).all()) or not bool((lo > 0).all()):
        return ""
    return Mistake("sum-does-not-match-max", "every row of your output is proportional to the right one (the "
                   f"exponentials are right) but sums to {float(lo.min()):.4g} to {float(hi.max()):.4g}, not 1: "
                   "the l you divide by is not the sum of exp(x - m) for the m in the numerator. Each block: "
                   "m_new = max(m, block max), l = l * exp(m - m_new) + sum(exp(block - m_new)), m = m_new; at the "
                   "end exp(x - m) / l with that final m and l.",
                   "rows proportional to the softmax but not summing to 1 (l does not match m)")


def _online_cases() -> list[tuple[torch.Tensor, int, bool]]:
    """(x, block_size, whether to check how x is read)."""
    g = seeded(900)
    # A rising trend makes later blocks raise the running max, so a missing rescale shows.
    x_main = torch.randn(2, 5, 14, generator=g) * 2 + torch.linspace(0, 4, 14)  # blocks 4 + 4 + 4 + 2
    x_1d = torch.randn(7, generator=g) * 2 + torch.linspace(0, 3, 7)  # blocks 3 + 3 + 1
    x_small = torch.randn(3, 6, generator=g) * 2
    x_big = torch.randn(2, 3, 9, generator=g) * 1e4  # exp overflows unless the max is subtracted
    x_big[1, 2] = -x_big[1, 2].abs() - 1e3  # and a row far below 0: a running max started at 0 underflows
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
        if is_reduction(op) and n in first:
            t.fail_observed(f"your function reduced whole rows of x at once ({op} on a {list(first)} tensor, "
                            f"rows of {n}): block_size={bs} is not used.",
                            Mistake("whole-rows-reduced", "read x in blocks x[..., s:s + block_size] and "
                                    "fold each block into a running max m and a running sum l; only the "
                                    "final exp(x - m) / l touches the whole row, elementwise.",
                                    "reduced whole rows at once instead of reading x in blocks"))
            return
    covered = 0  # how many numbers went through a max before the first exp
    for op, _, _, numels in ops:
        if is_exp_like(op):
            break
        if op_name(op) in MAX_LIKE:
            covered += sum(numels)
    if covered >= x.numel():
        t.fail_observed(f"your function took the maximum over all of x ({covered} numbers through max operations, "
                        f"x has {x.numel()}) before its first exp: that is the two-pass safe softmax (a pass for the "
                        "max, a pass for the sum), not the online one.",
                        Mistake("two-pass-softmax", "fold each block in as it arrives: exp(block - m_new) "
                                "right away, and rescale the sum so far by exp(m_old - m_new) when a block "
                                "raises the max. In attention the scores are never stored, so a second pass "
                                "would mean computing q @ k^T twice.",
                                "two-pass softmax: took the max over all of x before any exp"))


@exercise()
def online_softmax(t: Trial) -> None:
    t.error_hints = {
        r"must match the size|size of tensor": Mistake(
            "state-shape-mismatch", "keep the running max and sum one per row (shape x.shape[:-1]) "
            "and add [..., None] when you subtract them from a block.",
            "the running max or sum does not broadcast against a block (shape mismatch)"),
        r"takes \d+ positional argument": wrong_signature("online_softmax(x, block_size)."),
    }
    t.forbidden_references = set(_COURSE_FUNCTIONS)
    cases = [(x, bs, structural, ref.online_softmax(x, bs), _eager_variants(_online_mistakes(x, bs)))
             for x, bs, structural in _online_cases()]
    for x, bs, structural, expected, mistakes in cases:
        got, seen = call_logged(t, x, bs, sources={"x": 0}, case=describe_case(x=x, block_size=bs))
        # An honest function reads a few Python numbers per block and row at most (a max, a sum, a test);
        # reading every number of x is more than twice that where the rule applies (x_long: 192 vs <= 72).
        rows, n_blocks = x[..., 0].numel(), math.ceil(x.shape[-1] / bs)
        reads_limit = x.numel() if structural and 2 * 3 * rows * n_blocks <= x.numel() else None
        check_stays_in_torch(t, seen, "x", reads_limit)
        tol = dict(atol=1e-3, rtol=1e-2) if x.dtype == torch.float16 else {}
        t.tensor(got, expected, what="softmax", hint=_ONLINE_HINT, **tol,
                 mistakes=_weighed(_pick(mistakes, got, **(tol or dict(atol=1e-5, rtol=1e-4))), got,
                                   **(tol or dict(atol=1e-5, rtol=1e-4))),
                 diagnosis=_online_diagnosis(got, x, expected))
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
                 strict: bool = False, local_rows: bool = False, local_cols: bool = False, swapped: bool = False,
                 carry_state: bool = False, guard_max: bool = True, tile_mask: bool = True, v_rows: str = "key",
                 rescale_after: bool = False, normalise_each: bool = False, values: str = "v"):
    """A learner's tiled forward in float64 with one mistake switched on -> (out, m, l).

    ``local_rows`` / ``local_cols``: the causal mask counts query / key positions from 0 in every
    tile instead of from qs / ks. ``swapped``: the mask hides keys j < i instead of j > i.
    ``carry_state``: m, l and acc are created once, before the loop over query blocks, so each
    query block starts from the previous one's (T must be a multiple of ``bs``). ``guard_max=False``:
    a row whose first tile is entirely masked gets exp(-inf - (-inf)) = NaN, as in a loop without
    a guard for it (a correct causal loop never needs one: key 0 comes first). ``tile_mask=False``:
    the tiles right of the diagonal are skipped, but nothing is masked inside the diagonal tile.
    ``v_rows="query"``: the value tile is taken at the query block's rows (where its size fits).
    ``rescale_after``: acc = (acc + p @ v_blk) * alpha. ``normalise_each``: acc divided by l after every
    key block (and not at the end). ``values="k"``: p multiplies the key tile."""
    q, k, v = (x.detach().to("cpu", torch.float64) for x in (q, k, v))
    T, d = q.shape[-2:]
    scale = 1 / math.sqrt(d) if scale is None else scale
    t_keys = T - T % bs if drop_keys else T
    if carry_state and T % bs:
        raise ValueError("the state of one query block does not fit the last, shorter one")
    out = torch.zeros(q.shape[:-1] + v.shape[-1:], dtype=torch.float64)
    m_all = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float64)
    l_all = torch.zeros(q.shape[:-1], dtype=torch.float64)
    for qs in range(0, T, bs):
        qe = min(qs + bs, T)
        if not carry_state or qs == 0:
            m = torch.full(q.shape[:-2] + (qe - qs,), float("-inf"), dtype=torch.float64)
            l = torch.zeros_like(m)
            acc = torch.zeros(q.shape[:-2] + (qe - qs, v.shape[-1]), dtype=torch.float64)
        k_end = min(qs if skip_diag else qe, t_keys) if causal else t_keys
        for ks in range(0, k_end, bs):
            ke = min(ks + bs, k_end)
            s = q[..., qs:qe, :] @ k[..., ks:ke, :].transpose(-2, -1) * scale
            if causal and tile_mask:
                rows = torch.arange(qe - qs)[:, None] + (0 if local_rows else qs)
                cols = torch.arange(ke - ks)[None, :] + (0 if local_cols else ks)
                hidden = cols < rows if swapped else cols >= rows if strict else cols > rows
                s = s.masked_fill(hidden, float("-inf"))
            m_new = torch.maximum(m, s.amax(dim=-1))
            safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new)) if guard_max else m_new
            alpha = torch.exp(m - safe)
            p = torch.exp(s - safe[..., None])
            l = (l * alpha if rescale_l else l) + p.sum(dim=-1)
            vals = k if values == "k" else v
            v_blk = vals[..., qs:qe, :] if v_rows == "query" and qe - qs == ke - ks else vals[..., ks:ke, :]
            if rescale_after:
                acc = (acc + p @ v_blk) * alpha[..., None]
            else:
                acc = (acc * alpha[..., None] if rescale_acc else acc) + p @ v_blk
            if normalise_each:
                acc = acc / l[..., None]
            m = m_new
        out[..., qs:qe, :] = acc / l[..., None] if normalise and not normalise_each else acc
        m_all[..., qs:qe], l_all[..., qs:qe] = m, l
    return out, m_all, l_all


def _tiled_out_mistakes(q, k, v, causal: bool, bs: int) -> dict[str, Callable]:
    """hint -> a zero-argument callable giving out of a known wrong tiled forward (for eager_mistakes)."""
    out = lambda **kw: _tiled_model(q, k, v, causal, bs, **kw)[0].to(q.dtype)  # noqa: E731
    mistakes = {
        Mistake("acc-not-rescaled", "the accumulator was not rescaled: when the running max grows, "
                "multiply acc by alpha = exp(m - m_new) before adding p @ v_block (l gets the same "
                "factor)."):
            lambda: out(rescale_acc=False),
        Mistake("l-not-rescaled", "the running sum l was not rescaled: when the running max grows, "
                "l = l * alpha + rowsum(p), with alpha = exp(m - m_new), just like acc."):
            lambda: out(rescale_l=False),
        Mistake("acc-and-l-not-rescaled", "neither acc nor l was rescaled when the running max "
                "grew: multiply both by alpha = exp(m - m_new)."):
            lambda: out(rescale_acc=False, rescale_l=False),
        Mistake("missing-final-normalisation", "the final normalisation is missing: out = acc / l "
                "(l[..., None]) once all key blocks are done."):
            lambda: out(normalise=False),
        Mistake("scores-not-scaled", "the scores are not scaled: multiply q @ k^T by 1 / sqrt(d)."):
            lambda: out(scale=1.0),
        Mistake("scores-divided-by-d", "you divided the scores by d; the scale is 1 / sqrt(d)."):
            lambda: out(scale=1 / q.shape[-1]),
        Mistake("acc-rescaled-after-adding", "acc was rescaled after adding the new tile: alpha = exp(m - "
                "m_new) corrects what was summed with the old max, so acc = acc * alpha + p @ v_block, not "
                "(acc + p @ v_block) * alpha.", "rescaled acc after adding the new tile's p @ v"):
            lambda: out(rescale_after=True),
        Mistake("normalised-every-key-block", "acc was divided by l after every key block: l keeps "
                "growing, so earlier tiles get divided again and again. Divide once, out = acc / l, after "
                "the last key block.", "divided acc by l after every key block instead of once at the end"):
            lambda: out(normalise_each=True),
        Mistake("p-times-key-tile", "p was multiplied by the key tile: the weights average the values, "
                "acc += p @ v[..., ks:ke, :], not k.", "multiplied p by the key tile instead of the value tile"):
            lambda: out(values="k"),
        Mistake("value-tile-at-query-rows", "the value tile was taken at the query block's rows: p is "
                "[queries, keys of this key block], so it multiplies the value rows of the same keys, "
                "v[..., ks:ke, :], not v[..., qs:qe, :].", "multiplied p by the value rows of the query block"):
            lambda: out(v_rows="query"),
        Mistake("state-carried-across-query-blocks", "m, l and acc carry over from one query block "
                "to the next: create them afresh (m = -inf, l = 0, acc = 0) inside the loop over "
                "query blocks, before its loop over key blocks."):
            lambda: out(carry_state=True),
    }
    if causal:
        hides_past = ("the causal mask hides the past instead of the future: query i sees keys "
                      "j <= i, so mask j > i (torch.arange(ks, ke)[None, :] > "
                      "torch.arange(qs, qe)[:, None]), not j < i.")
        nan_later = (" (With j < i hidden, the first key block of a later query block is entirely "
                     "masked, and exp(-inf - (-inf)) gives NaN.)")
        mistakes.update({
            Mistake("diagonal-block-skipped", "the diagonal block was skipped: with causal=True, "
                    "query block [qs, qe) needs every key block up to and including its own, i.e. "
                    "keys 0..qe-1 (range(0, qe, block_size)); only blocks to the right of the "
                    "diagonal are skipped."):
                lambda: out(skip_diag=True),
            Mistake("mask-hides-diagonal", "the causal mask also hides the diagonal: query i may "
                    "attend to key i (mask keys j > i, not j >= i)."):
                lambda: out(strict=True),
            Mistake("diagonal-tile-not-masked", "you skip the key blocks right of the diagonal, but inside "
                    "the diagonal tile (ks == qs) queries still see later keys: mask that tile too, scores "
                    "-inf where torch.arange(ks, ke)[None, :] > torch.arange(qs, qe)[:, None].",
                    "skipped the future tiles but did not mask inside the diagonal tile"):
                lambda: out(tile_mask=False),
            Mistake("mask-hides-past", hides_past):
                lambda: out(swapped=True),
            Mistake("mask-hides-past", hides_past + nan_later):
                lambda: out(swapped=True, guard_max=False),
            Mistake("mask-uses-tile-positions", "the causal mask uses positions inside the tile: "
                    "compare the global positions qs + row and ks + col (torch.arange(qs, qe)[:, "
                    "None] < torch.arange(ks, ke)[None, :])."):
                lambda: out(local_rows=True, local_cols=True),
            Mistake("mask-keys-from-0-per-tile", "the causal mask counts the keys from 0 in every "
                    "tile: column c of the tile is key ks + c, so compare torch.arange(ks, "
                    "ke)[None, :] with torch.arange(qs, qe)[:, None]."):
                lambda: out(local_cols=True),
            Mistake("mask-queries-from-0-per-tile", "the causal mask counts the queries from 0 in "
                    "every tile: row r of the tile is query qs + r, so compare torch.arange(qs, "
                    "qe)[:, None] with torch.arange(ks, ke)[None, :]."):
                lambda: out(local_rows=True),
            Mistake("ignored-causal", "causal=True was ignored: mask keys j > i (and skip the key "
                    "blocks right of the diagonal)."):
                lambda: _tiled_model(q, k, v, False, bs)[0].to(q.dtype),
        })
    else:
        mistakes[Mistake("masked-when-not-causal", "causal=False here, but the output is causally "
                         "masked: only mask when causal is True.")] = (
            lambda: _tiled_model(q, k, v, True, bs)[0].to(q.dtype))
    return mistakes


def _hidden_diagonal(got: Any, q, k, v, causal: bool, bs: int) -> str:
    """The diagonal hidden by the causal mask, whatever the learner did with query 0 (which then sees no
    key at all): every row from 1 on equals attention over keys j < i."""
    T = q.shape[-2]
    if not (causal and T > 2 and isinstance(got, torch.Tensor) and got.shape == q.shape[:-1] + v.shape[-1:]):
        return ""
    strict = _tiled_model(q, k, v, True, bs, strict=True)[0]
    if not bool(_isclose(got.detach().double()[..., 1:, :], strict[..., 1:, :], atol=1e-5, rtol=1e-4).all()):
        return ""
    return Mistake("mask-hides-diagonal", "the causal mask also hides the diagonal: every query i >= 1 "
                   "attends to keys j < i only. Query i may attend to key i: mask keys j > i, not j >= i "
                   "(query 0 then sees key 0, no special case needed).")


def _shared_max(got: Any, expected: torch.Tensor, q, k, causal: bool, bs: int) -> str:
    """One max shared by the rows of a tile (or wider): on a case where some rows' scores lie far below
    another row's of the same query tile, exactly those rows come out NaN (or 0), the others right."""
    if not (isinstance(got, torch.Tensor) and got.shape == expected.shape and got.is_floating_point()):
        return ""
    T = q.shape[-2]
    s = q.detach().double() @ k.detach().double().transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    row_max = s.amax(dim=-1)  # [B, H, T]
    drowned = torch.zeros_like(row_max, dtype=torch.bool)
    for qs in range(0, T, bs):  # exp(x) underflows to 0 in float32 below x = -104; float64 below -745
        tile = row_max[..., qs:qs + bs]
        drowned[..., qs:qs + bs] = tile < tile.amax(dim=-1, keepdim=True) - 800
    g = got.detach().double()
    wrong = ~_isclose(g, expected.detach().double(), atol=1e-5, rtol=1e-4).all(dim=-1)
    if not bool(drowned.any()) or not _equal(wrong, drowned):
        return ""
    bad = g[drowned]
    if not bool((~_isfinite(bad) | (bad == 0)).all()):
        return ""
    rows = ranges_text(drowned.reshape(-1, T).any(0).nonzero().flatten().tolist())
    return Mistake("max-shared-by-tile-rows", f"rows {rows} came out NaN or 0, the other rows are right: their "
                   "scores lie far below another row's of the same query tile, and exp(s - m) underflowed to 0 for "
                   "every key, so the rows of a tile shared one max. Keep one running max per query row: m_new = "
                   "torch.maximum(m, s.amax(dim=-1)), of shape [B, H, rows of the tile].",
                   "one max shared by the rows of a tile: rows far below it underflow to NaN")


def _ragged_mistakes(q, k, v, causal: bool, bs: int, got: Any) -> dict[str, Callable]:
    """The mistakes of a ragged T (not a multiple of the block), modelled from the learner's own last rows."""
    T = q.shape[-2]
    if not (T % bs and isinstance(got, torch.Tensor) and got.shape == q.shape):
        return {}
    t_full = T - T % bs
    out = lambda **kw: _tiled_model(q, k, v, causal, bs, **kw)[0].to(q.dtype)  # noqa: E731
    return {
        Mistake("last-key-block-dropped", "the last, shorter key block was dropped (and perhaps "
                "the last query block too): loop `for ks in range(0, T, block_size)` and slice "
                "k[..., ks:ks + block_size, :], shorter at the end; the same for the query "
                "blocks."):
            lambda: torch.cat([out(drop_keys=True)[..., :t_full, :], got[..., t_full:, :]], dim=-2),
        Mistake("last-query-block-wrong", f"rows {t_full}..{T - 1} are wrong, rows before are "
                "right: the last, shorter query block was dropped or mishandled. Loop `for qs in "
                "range(0, T, block_size)`; the slice q[..., qs:qs + block_size, :] is shorter at "
                "the end.", "the last, shorter query block was dropped or mishandled"):
            lambda: torch.cat([out()[..., :t_full, :], got[..., t_full:, :]], dim=-2),
    }


def _tiled_lse_mistakes(q, k, v, causal: bool, bs: int) -> dict[str, Callable]:
    cache: list = []

    def stats():  # the right running statistics (m, l), computed once per case
        if not cache:
            cache.append(_tiled_model(q, k, v, causal, bs)[1:])
        return cache[0]

    return {
        Mistake("lse-in-log2", "lse is in log2 units: the contract is the natural log, lse = m + "
                "log(l) (divide a log2 value by log2(e))."):
            lambda: ((stats()[0] + stats()[1].log()) * LOG2E).float(),
        Mistake("lse-mixes-log-units", "lse = m + log2(l) mixes units: m is in natural-log units, "
                "so take the natural log of l, lse = m + log(l)."):
            lambda: (stats()[0] + stats()[1].log2()).float(),
        Mistake("lse-is-m", "lse is only the running max m: add log(l), lse = m + log(l)."):
            lambda: stats()[0].float(),
        Mistake("lse-is-log-l", "lse is only log(l): add the running max, lse = m + log(l)."):
            lambda: stats()[1].log().float(),
        Mistake("lse-is-l", "lse is the running sum l itself: the log-sum-exp is lse = m + "
                "log(l)."):
            lambda: stats()[1].float(),
        Mistake("lse-max-unscaled", "lse adds the max of the unscaled scores q @ k^T: m in lse = m + "
                "log(l) is the running max of the scaled scores (q @ k^T / sqrt(d)), the ones whose exp "
                "l sums.", "lse uses the max of the unscaled scores"):
            lambda: (stats()[0] * math.sqrt(q.shape[-1]) + stats()[1].log()).float(),
        Mistake("lse-max-scaled-twice", "lse adds the running max times 1 / sqrt(d) once more: m is "
                "already the max of the scaled scores, so lse = m + log(l).",
                "lse scales the running max twice"):
            lambda: (stats()[0] / math.sqrt(q.shape[-1]) + stats()[1].log()).float(),
    }


def _check_tiles(t: Trial, ops: list, T: int, bs: int) -> None:
    """Fail if torch's fused attention ran, a [T, T] tensor was formed, or a softmax spanned all T keys."""
    __tracebackhide__ = True
    for op, _, _, _ in ops:
        if "scaled_dot_product" in op or "flash_attention" in op or "efficient_attention" in op:
            t.fail_observed(f"your function called torch's fused attention ({op}).",
                            Mistake("called-fused-attention", "compute the scores of each [block_size, "
                                    "block_size] tile yourself (q_block @ k_block^T) and combine the tiles "
                                    "with the running max, sum and accumulator.",
                                    "called torch's fused attention instead of computing the tiles"))
            return
    for op, _, outs, _ in ops:
        for shape in outs:
            if len(shape) >= 2 and shape[-1] >= T and shape[-2] >= T:
                t.fail_observed(f"your function created a {list(shape)} tensor ({op}): with T = {T} and "
                                f"block_size = {bs} that is a full [T, T] matrix, the memory FlashAttention exists "
                                "to avoid.",
                                Mistake("formed-full-TxT-tensor", "hold one [block_size, block_size] tile "
                                        "of scores at a time; build the causal mask of a tile from "
                                        "torch.arange(qs, qe)[:, None] and torch.arange(ks, ke)[None, :], "
                                        "not from a [T, T] mask.",
                                        "formed a full [T, T] tensor (scores or mask) instead of tiles"))
                return
    for op, first, _, _ in ops:
        if is_reduction(op) and len(first) >= 2 and first[-1] >= T:
            t.fail_observed(f"your function reduced over all {T} keys at once ({op} on a {list(first)} tensor): a "
                            "strip of scores against every key is not a tile.",
                            Mistake("reduced-over-all-keys", "split the keys into blocks too: loop over key "
                                    "blocks inside the query-block loop and combine them with the running "
                                    "max m, sum l and accumulator acc.",
                                    "reduced over all keys at once instead of over key blocks"))


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
    (1, 1, 10, 8, False, 4),  # the last: query 0's scores (~1000) far above the other rows' (one max per row)
]


@exercise()
def flash_attention_tiled(t: Trial) -> None:
    t.error_hints = {
        r"must match the size|size of tensor|cannot be multiplied": Mistake(
            "tile-shape-mismatch", "tile shapes: s = q_blk @ k_blk.transpose(-2, -1) is [B, H, bq, "
            "bk]; m and l are [B, H, bq] (use [..., None] to broadcast them against s and acc).",
            "tile shapes do not match (m and l not broadcast with [..., None])"),
        r"takes \d+ positional argument": wrong_signature(
            "flash_attention_tiled(q, k, v, causal, block_size)."),
    }
    t.forbidden_references = set(_COURSE_FUNCTIONS)
    cases = []
    for i, (B, H, T, d, causal, bs) in enumerate(_TILED_CASES):
        q, k, v = _qkv(B, H, T, d, seed=910 + i)
        if i == len(_TILED_CASES) - 1:  # query 0 scores 1000 on key 3 (the others score ~5): rows in query 0's tile
            q[..., 0, :] = k[..., 3, :] * (1000 * math.sqrt(d) / k[..., 3, :].pow(2).sum(-1, keepdim=True))
        cases.append((q, k, v, causal, bs, *ref.flash_attention_tiled(q, k, v, causal, bs),
                      eager_mistakes(_tiled_out_mistakes(q, k, v, causal, bs)),
                      eager_mistakes(_tiled_lse_mistakes(q, k, v, causal, bs))))
    for q, k, v, causal, bs, ref_out, ref_lse, out_mistakes, lse_mistakes in cases:
        B, H, T, d = q.shape
        got, seen = call_logged(t, q, k, v, causal, bs, sources={"q": 0, "k": 1, "v": 2},
                                 case=describe_case(q=q, k=k, v=v, causal=causal, block_size=bs))
        tiles = B * H * math.ceil(T / bs) ** 2
        check_stays_in_torch(t, seen, "q, k or v", q.numel() if 6 * tiles <= q.numel() else None)
        out, lse = t.tuple(got, 2, ("out", "lse"))
        t.tensor(out, ref_out, what="out", hint=_TILED_HINT,
                 mistakes={**out_mistakes, **_ragged_mistakes(q, k, v, causal, bs, out)},
                 diagnosis=_hidden_diagonal(out, q, k, v, causal, bs) or _shared_max(out, ref_out, q, k, causal, bs))
        if isinstance(lse, torch.Tensor) and lse.shape != ref_lse.shape:
            t.fail(f"lse: expected shape {list(ref_lse.shape)} (one number per query row), got {list(lse.shape)}.",
                   Mistake("lse-wrong-shape", "lse = m + log(l) has the shape of the running max: "
                           "[B, H, T] (squeeze a trailing 1).", "lse is not of shape [B, H, T]"))
        t.tensor(lse, ref_lse, what="lse", hint="lse = m + log(l), the natural-log log-sum-exp of each row of scaled "
                 "(and masked) scores.", mistakes=lse_mistakes)
        if T > bs:
            _check_tiles(t, seen.ops, T, bs)
