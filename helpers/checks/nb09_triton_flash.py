"""Checks for notebook 09_flash_attention, in Triton: exercises 9.3 (forward kernel) and 9.4 (bonus:
backward kernels).

The checks run the learner's kernels on the GPU, or in Triton's interpreter on a CPU, on *guarded*
tensors (:mod:`helpers.checks.instruments`): each input sits inside a larger buffer padded with
NaN, and each float tensor the learner allocates with ``torch.empty / zeros / *_like`` (or
``Tensor.new_empty / new_zeros``) gets a padding of sentinel values and, for ``empty``, a marker
value in its body. A load past the end then turns into NaN, a store past the end changes the
padding, and an entry the kernel never writes keeps the marker, so each is named instead of reading
or corrupting memory. The checks also follow which inputs every tensor's data comes from: PyTorch
may prepare and allocate, but combining q, k and v (scores, softmax, weighted sums) must happen in a
Triton kernel, and the returned output must be written by a kernel that read them. Kernels written
with pointer arithmetic, ``tl.make_block_ptr`` (where the installed Triton has it), tensor
descriptors, ``@triton.autotune`` (in the interpreter the first config is taken, without
benchmarking) or any grid layout are all accepted. The cases go from friendly to awkward (a sequence
length that every block size divides, then ragged lengths, then several batches and heads), and a
``v`` made of one-hot rows turns the output into the attention weights themselves, so a wrong weight
pattern (scale, causal condition, normalisation, skipped key blocks) is diagnosed from it. How the
output was computed (:func:`helpers.checks.watchers.kernel`) fails a check in a learner's session;
in ``make grade`` it is a note for a grader (``Trial.fail_observed``).

Every case's expected output is computed before the learner's function first runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from .. import nb01_qkv_shapes as att
from ..registry import in_module
from . import watchers
from .core import _RETURNED_NONE, Trial, describe, describe_case, exercise, seeded
from .diagnose import ranges_text
from .feedback import Mistake
from .guard import _allclose, _isclose, _isfinite, _isnan, _len, _type
from .instruments import (
    EMPTY_FILL,
    KERNEL,
    guarded,
    kernel_device,
    triton_version,
    warm_up,
)
from .nb04_backward import _weighed
from .nb09_flash_attention import _COURSE_FUNCTIONS, LOG2E, _qkv, _tiled_model

__all__ = in_module(__name__)  # its exercises' checks, as helpers/registry.py lists them

TRITON_TIME_LIMIT_S = 120.0  # per call: the interpreter is slow, and a GPU compiles on first use


_TRITON_ERRORS = {
    r"Block pointers have been removed": Mistake(
        "used-make_block_ptr", "tl.make_block_ptr and tl.advance were removed from recent Triton "
        f"versions (this machine has Triton {triton_version()}), on a GPU as in the interpreter: "
        "load tiles with pointer arithmetic and masks, tl.load(K + offsets, mask=offs_n[:, None] < "
        "T, other=0.0) (section 4), or with tl.make_tensor_descriptor.",
        "used tl.make_block_ptr / tl.advance, removed from this Triton version"),
    r"not supported in interpreter mode": Mistake(
        "op-not-in-interpreter", "Triton's interpreter cannot run this operation (the message "
        "names it): it runs only compiled, on a GPU. Write the kernel with tl.load, tl.store, "
        "tl.dot and elementwise operations.", "used an operation Triton's interpreter cannot run"),
    r"decorated with @triton\.jit before": Mistake(
        "kernel-defined-before-setup", "run `setup()` (helpers.runtime) before the cell that "
        "defines your kernel, then run that cell again: Triton decides between compiling and "
        "interpreting when a kernel is decorated.", "defined the kernel before running setup()"),
    r"active drivers|no GPU|Found no NVIDIA driver|not compiled with CUDA": Mistake(
        "launcher-asks-for-gpu", "your launcher asked Triton or torch for a GPU, and there is "
        "none: in Triton's interpreter only the kernel launch itself runs. Remove GPU queries from "
        "the launcher (triton.runtime.driver.active..., device properties, "
        "triton.testing.do_bench, torch.cuda...).",
        "the launcher queries a GPU, and there is none (Triton's interpreter)"),
    r"arange.*power of 2|power of two": Mistake(
        "arange-not-power-of-2", "tl.arange needs a power of 2: use block sizes like 16, 32, 64 "
        "and pass the head dim d as a tl.constexpr (HEAD_DIM).",
        "tl.arange over a size that is not a power of 2"),
    r"constexpr": Mistake(
        "size-not-constexpr", "sizes used in tl.arange, tl.zeros and tile shapes must be "
        "tl.constexpr arguments (BLOCK_M, BLOCK_N, HEAD_DIM).",
        "a size in tl.arange, tl.zeros or a tile shape is not a tl.constexpr"),
    r"out of resource|shared memory": Mistake(
        "tiles-exceed-shared-memory", "the tiles do not fit in this GPU's shared memory: use "
        "smaller BLOCK_M / BLOCK_N (or fewer num_stages)."),
    r"[Ii]nput shapes should have M >= 16|K >= 16|N >= 16": Mistake(
        "dot-tile-under-16", "tl.dot needs both tiles at least 16 x 16: use BLOCK_M, BLOCK_N and "
        "HEAD_DIM of 16 or more.", "tl.dot on a tile smaller than 16 x 16"),
    r"[Bb]oth operands must be same dtype|dtype mismatch.*dot": Mistake(
        "dot-dtype-mismatch", "tl.dot needs both tiles in the same dtype: convert p to v's dtype "
        "first, tl.dot(p.to(v.dtype), v).", "tl.dot on tiles of different dtypes"),
}

# What watchers.kernel can observe, by slug: the watcher runs in the notebook's process and hands
# back plain data (the message and the slug), and the check names the mistake from this table.
_WATCHED = {m.slug: m for m in (
    Mistake("store-past-end", "mask every tl.store with the rows (or keys) that exist, e.g. "
            "mask=offs_m[:, None] < T for a [BLOCK_M, HEAD_DIM] tile and mask=offs_m < T for lse.",
            "a tl.store without a mask wrote past the end of a tensor"),
    Mistake("no-kernel-launched", "launch your kernel, `_kernel[grid](...)`, and return what it "
            "wrote.", "no Triton kernel ran during the function"),
    Mistake("launched-course-kernel", "write the kernel in the notebook: the point of the exercise "
            "is to build it.", "launched the course's kernel instead of their own"),
    Mistake("attention-in-pytorch", "pass q, k, v and the output tensors to the kernel and do the "
            "arithmetic on them inside it; in PyTorch only allocate outputs, compute launch "
            "parameters (and, in the backward, D = rowsum(dO * O)).",
            "computed with q, k and v in PyTorch instead of in the kernel"),
    Mistake("data-left-torch", "pass q, k, v themselves to the kernel and do the arithmetic inside "
            "it.", "took q, k or v out of PyTorch (NumPy, Python lists)"),
    Mistake("read-numbers-one-at-a-time", "pass q, k, v themselves to the kernel and do the "
            "arithmetic inside it.", "read q, k or v one Python number at a time"),
)}


def _call_kernel(t: Trial, *args: Any, sources: dict[str, int], case: str) -> tuple[Any, dict]:
    """``t.call(*args)`` through :func:`helpers.checks.watchers.kernel`. Fails (``t.fail_observed``)
    on a store past the end, on no Triton launch at all, on a launch of the course's own kernel, and
    when the attention was computed outside the learner's kernels. Returns (output, what each output
    tensor was written from)."""
    __tracebackhide__ = True
    try:
        import triton  # noqa: F401
    except ImportError:
        t.fail("Triton is not installed here (it is Linux-only), so this exercise cannot run on this machine.",
               Mistake("triton-not-installed", "run this notebook on Linux or in Colab (Runtime > "
                       "Change runtime type > GPU).",
                       "Triton is not installed where the notebook ran"))
    warm_up()
    got, seen = t.call_watched(watchers.kernel, args, {"sources": sources, "is_reference": t.is_reference}, case=case)
    _fail_watched(t, seen["failures"], _WATCHED)
    return got, {id(x): set(w) for x, w in zip(watchers.flat_tensors(got), seen["written"])}


def _fail_watched(t: Trial, failures: Any, table: dict[str, Mistake]) -> None:
    """``t.fail_observed`` on the first of the watcher's ``failures`` ((message, slug) pairs; the
    mistake is ``table[slug]``). They come from the notebook's process: plain data of any form."""
    __tracebackhide__ = True
    if _type(failures) in (list, tuple) and failures:
        first = failures[0]
        message, slug = first if _type(first) in (list, tuple) and _len(first) == 2 else ("", "")
        t.fail_observed(str(message)[:500] or "your kernel was not run as the check expects.",
                        table.get(slug, "") if _type(slug) is str else "")


def _written_by_kernel(t: Trial, written: dict, got: torch.Tensor, what: str, needs: set[str]) -> None:
    """Fail unless the data of ``got`` comes from a kernel launch that read the inputs in ``needs``
    (``written``, from the watcher's observations: ``t.fail_observed``)."""
    __tracebackhide__ = True
    have = written.get(id(got), set())
    if not needs | {KERNEL} <= have:
        read = ", ".join(sorted(have - {KERNEL})) or "none of the inputs"
        t.fail_observed(f"{what} was not written by a Triton kernel that read {' and '.join(sorted(needs))} (its "
                        f"data comes from: {read}).",
                        Mistake("output-not-written-by-kernel", "launch your kernel with "
                                f"{', '.join(sorted(needs))} and {what} among its arguments, let it store "
                                f"the result into {what}, and return that tensor.",
                                "the returned tensor was not written by a kernel that read the inputs"))


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
    return _isclose(got.detach().double().cpu(), expected.detach().double().cpu(), atol=atol, rtol=rtol)


def _close(got: Any, expected: torch.Tensor, atol: float, rtol: float) -> bool:
    return (isinstance(got, torch.Tensor) and got.shape == expected.shape and got.dtype == expected.dtype
            and bool(_closeness(got, expected, atol, rtol).all()))


def _unwritten(got: torch.Tensor, what: str) -> tuple[str, str]:
    """(diagnosis, where) when some entries still hold torch.empty's marker; ('', '') otherwise."""
    marker = (got.detach().cpu() == EMPTY_FILL)
    if not bool(marker.any()):
        return "", ""
    B, H, T = got.shape[:3]
    per_row = marker.reshape(B, H, T, -1).all(-1)  # [B, H, T]: a row never written at all
    slices_all, slices_any = per_row.all(-1), marker.reshape(B, H, -1).any(-1)
    if bool(slices_all.any()) and bool((slices_all == slices_any).all()):
        missing = [tuple(x) for x in slices_all.nonzero().tolist()]
        return (Mistake("missing-batch-head-programs", f"{what}[b, h] was never written for "
                        f"{len(missing)} of the B * H = {B * H} (batch, head) slices (first "
                        f"{missing[0]}): the grid's second axis must launch B * H programs, one "
                        "per batch and head (program_id(1) = b * H + h).",
                        "the grid does not launch B * H programs, one per batch and head"), "")
    rows = per_row.all(0).all(0)
    if bool(rows.any()) and bool((per_row == rows).all()):
        r0 = int(rows.nonzero()[0])
        if bool(rows[r0:].all()):
            return (Mistake("partial-block-not-launched", f"rows {r0}..{T - 1} of {what} were "
                            f"never written (in every batch and head), rows before were: T = {T} "
                            "ends in a partial block. Launch triton.cdiv(T, BLOCK_M) programs "
                            "along the query axis, not T // BLOCK_M, and store the partial block "
                            "with mask offs_m < T.",
                            "no program for the last, partial block (T // BLOCK_M programs)"), "")
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
        return (Mistake("wrong-batch-head-offset", f"{what}[{b}, {h}] holds the result of (batch, "
                        f"head) ({b2}, {h2}): {what_offset} of a program {verb} wrong. With "
                        "program_id(1) = b * H + h, offset q, k, v and the output by b * stride_b "
                        "+ h * stride_h (b = program_id(1) // H, h = program_id(1) % H).",
                        "a program works on another (batch, head) slice: wrong offsets"), "")
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
    wrong_type = Mistake("wrong-return-type", "return out (or out, lse).",
                         "returned neither a tensor nor a tuple (out, lse)")
    t.fail(f"expected the output tensor, or a tuple (out, lse), got {describe(got)}.",
           _RETURNED_NONE if got is None else wrong_type)
    return None, None


def _probe(T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k random ``[1, 1, T, d]`` (d = 128) and v with one-hot rows (v[j] = e_j), so that out[i, :T] =
    P[i, :]."""
    d = 128
    g = seeded(seed)
    q = torch.randn(1, 1, T, d, generator=g)
    k = torch.randn(1, 1, T, d, generator=g)
    return q, k, torch.eye(T, d).view(1, 1, T, d)


_HIDES_DIAGONAL = "the causal mask also hides the diagonal (query i may attend to key i)"
_SKIPPED_BLOCKS = "key blocks were skipped: some keys get no weight"
_NOT_SCALED = "the scores are not scaled by 1 / sqrt(d)"


def _weights_hint(P: torch.Tensor, P_ref: torch.Tensor, raw: torch.Tensor, causal: bool, d: int, ragged: bool) -> str:
    """Name the mistake from the attention weights P [T, T] a kernel produced (float64, CPU), or ''."""
    T = P.shape[-1]
    scale = 1 / math.sqrt(d)
    nan_rows = _isnan(P).any(dim=-1)
    if causal:
        future = torch.ones(T, T, dtype=torch.bool).triu(1)
        if (P.nan_to_num(0.0)[future].abs() > 1e-4).any():
            return Mistake("attends-to-future", "queries put weight on future keys (j > i): the "
                           "causal condition is reversed or on the wrong axis. Rows are queries, "
                           "columns keys: keep scores where offs_m[:, None] >= offs_n[None, :], "
                           "and do not loop past the diagonal block.")
        if nan_rows[0] and not nan_rows.all():
            first_ok = int((~nan_rows).nonzero()[0])
            if first_ok == 1:
                return Mistake("mask-hides-diagonal", "row 0 is NaN: with causal=True query 0 sees "
                               "only key 0, and your mask hid it. Query i may attend to keys j <= "
                               "i: keep scores where offs_m[:, None] >= offs_n[None, :].",
                               _HIDES_DIAGONAL)
            if not nan_rows[first_ok:].any():
                return Mistake("diagonal-block-skipped", f"rows 0..{first_ok - 1} are NaN: they "
                               "saw no key at all, so the diagonal block was skipped. With "
                               "causal=True, query block start_m needs key blocks up to and "
                               "including its own: loop `for start_n in range(0, min((start_m + 1) "
                               "* BLOCK_M, T), BLOCK_N)`.", "the diagonal key block was skipped")
    if nan_rows.any():
        return ""
    if causal and (P.diagonal()[1:].abs() < 1e-6).all():
        return Mistake("mask-hides-diagonal", "no query attends to itself: the mask hides the "
                       "diagonal. Query i may attend to keys j <= i (offs_m[:, None] >= "
                       "offs_n[None, :], not >).", _HIDES_DIAGONAL)
    dead = ((P.abs() < 1e-12) & (P_ref > 1e-9)).any(0) & ~(P.abs() >= 1e-12).any(0)  # keys nobody weighs
    if dead.any():
        keys = dead.nonzero().flatten().tolist()
        if keys[-1] == T - 1 and keys == list(range(keys[0], T)):
            return Mistake("last-key-block-skipped", f"keys {keys[0]}..{T - 1} got no weight from "
                           "any query: the loop over key blocks stops before the last, partial "
                           f"block (T = {T}). Loop `for start_n in range(0, hi, BLOCK_N)` with hi "
                           "= T (or the causal limit), and mask the keys >= T of that block "
                           "instead of skipping it.",
                           "the loop over key blocks stops before the last, partial block")
        return Mistake("key-blocks-skipped", f"keys {ranges_text(keys)} got no weight from any "
                       "query: those key blocks were skipped. Every query block must visit every "
                       "key block (with causal=True: up to and including its diagonal block).",
                       _SKIPPED_BLOCKS)
    if causal:
        past = ~future & (P_ref > 1e-6)
        if (P[past].abs() < 1e-9).any():
            return Mistake("key-blocks-skipped", "some keys j <= i got no weight at all: key "
                           "blocks were skipped. With causal=True the loop over key blocks runs up "
                           "to the end of this query block, (start_m + 1) * BLOCK_M, diagonal "
                           "block included.", _SKIPPED_BLOCKS)
    sums = P.sum(dim=-1)
    if not _allclose(sums, torch.ones_like(sums), atol=1e-3):
        if _allclose(P / sums[:, None], P_ref, atol=1e-4, rtol=1e-2):
            if bool((sums > 1).all()):
                return Mistake("missing-final-normalisation", "the weights are right up to a "
                               "factor per row, the row's sum l (> 1): divide the accumulator by l "
                               "at the end (acc / l_i[:, None]).",
                               "the accumulator is not divided by the running sum l at the end")
            if ragged and bool((sums < 1).all()):
                return Mistake("padded-keys-not-masked", f"T = {T} is not a multiple of the block "
                               "here, and keys at positions >= T got weight: the weights on the "
                               f"real keys sum to less than 1 (row 0: {float(sums[0]):.3f}). Set the "
                               "scores of those keys to -inf, by their position in the sequence (offs_n "
                               "counts from the key block's start): qk = tl.where((start_n + "
                               "offs_n)[None, :] < T, qk, float('-inf')), after loading k and v with "
                               "mask=(start_n + offs_n)[:, None] < T, other=0.0.",
                               "keys at positions >= T got weight (scores not set to -inf)")
            return Mistake("running-sum-not-row-sum", "each query row's weights are right up to a factor "
                           f"(rows sum to {float(sums.min()):.4g} to {float(sums.max()):.4g}, not 1): the running "
                           "sum l_i is not the sum of that row's p. Per key block l_i = l_i * alpha + tl.sum(p, 1) "
                           "(axis 1: the keys of each query row), and out = acc / l_i[:, None] once at the end.",
                           "rows right up to a factor: the running sum l_i is not each row's sum of p")
        return ""
    # Rows sum to 1: compare the effective softmax temperature with known mistakes.
    for factor, hint in (
        (math.sqrt(d), Mistake("scores-not-scaled", "the scores are not scaled by 1 / sqrt(d) "
                               "(sm_scale).", _NOT_SCALED)),
        (1 / math.sqrt(d), Mistake("scores-divided-by-d", "the scores were divided by d; the scale "
                                   "is 1 / sqrt(d).")),
        (math.log(2), Mistake("exp2-without-log2e", "you used exp2 on scores that were not "
                              "multiplied by log2(e): exp(x) = exp2(x * log2(e)), so scale the "
                              "scores by sm_scale * log2(e) (one multiply) before tl.exp2.",
                              "used tl.exp2 on scores not multiplied by log2(e)")),
        (LOG2E, Mistake("log2e-with-exp", "you multiplied the scores by log2(e) but then used "
                        "tl.exp; with the log2(e) factor use tl.exp2.",
                        "multiplied the scores by log2(e) but used tl.exp")),
        (math.sqrt(d) * LOG2E, Mistake("not-scaled-and-log2e-with-exp", "the scores are not scaled "
                                       "by 1 / sqrt(d), and log2(e) is applied with tl.exp.")),
        (math.sqrt(d) * math.log(2), Mistake("scores-not-scaled", "the scores are not scaled by 1 "
                                             "/ sqrt(d) (the log2(e) factor is right).",
                                             _NOT_SCALED)),
    ):
        allowed = att.causal_mask(T) if causal else None
        if _allclose(P, att.masked_softmax(raw * scale * factor, allowed), atol=1e-4, rtol=1e-2):
            return hint
    return ""


def _rescale_hint(out: torch.Tensor, q, k, v, causal: bool, tol: dict) -> str:
    """Is ``out`` a tiled forward without a rescale (for some power-of-2 key block size)? Name it, or ''."""
    variants = {
        Mistake("acc-not-rescaled", "the accumulator was not rescaled: when a key block raises the "
                "running max, multiply acc by alpha = exp2(m_i - m_new) before adding the new "
                "block (l_i gets the same factor)."): dict(rescale_acc=False),
        Mistake("l-not-rescaled", "the running sum l_i was not rescaled: when a key block raises "
                "the running max, l_i = l_i * alpha + rowsum(p) with alpha = exp2(m_i - m_new), "
                "just like acc."): dict(rescale_l=False),
        Mistake("acc-and-l-not-rescaled", "neither acc nor l_i was rescaled when a key block "
                "raised the running max: multiply both by alpha = exp2(m_i - m_new) before adding "
                "the new block."):
            dict(rescale_acc=False, rescale_l=False),
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


_SHORT_T = 12  # a sequence shorter than any key block: a block-relative key mask is right on it
# (B, H, T, d, causal, dtype) after the probes: several batches and heads, short and ragged T.
_FORWARD_CASES = [
    (2, 3, 17, 16, True, torch.float16),
    (2, 3, 33, 32, False, torch.float32),
    (1, 2, 1, 64, True, torch.float16),
    (3, 2, 70, 64, True, torch.float32),
]


def _forward_cases(dev: torch.device) -> list[dict]:
    """Every case of 9.3 with its expected values, built before the learner's code runs."""
    specs = []
    # 1-2: T = 128, a multiple of every block size, and v one-hot: out is the attention weights.
    for causal in (False, True):
        specs.append((*_probe(128, seed=930 + causal), causal, torch.float32, "probe"))
    # 3 and 5: T = 100 is ragged for every block size from 8 to 64 (and shorter than 128). 4: T = 12 is
    # shorter than any key block (tl.dot needs 16): a key mask relative to the block is right on it only.
    for causal in (False, True):
        specs.append((*_probe(100, seed=932 + causal), causal, torch.float32, "ragged-probe"))
        if not causal:
            specs.append((*_probe(_SHORT_T, seed=936), False, torch.float32, "short-probe"))
    # then several batches and heads, short and ragged T.
    for i, (B, H, T, d, causal, dtype) in enumerate(_FORWARD_CASES):
        specs.append((*_qkv(B, H, T, d, seed=940 + i, spread=1.0), causal, dtype, "full"))
    cases = []
    for q, k, v, causal, dtype, kind in specs:
        q, k, v = (x.to(dtype) for x in (q, k, v))
        out64, lse64, P64, raw = _attention64(q, k, v, causal)
        cases.append(dict(q=q, k=k, v=v, causal=causal, dtype=dtype, kind=kind, P64=P64, raw=raw,
                          out=out64.to(device=dev, dtype=dtype), lse=lse64.to(device=dev, dtype=torch.float32),
                          args=[guarded(x, dev) for x in (q, k, v)]))
    return cases


def _first_block_mask(T: int, row0: float) -> Mistake:
    return Mistake("key-mask-in-first-block-only", f"keys at positions >= T get weight at T = {T} (the weights on "
                   f"the real keys sum to {row0:.3f} in row 0), though they were hidden when T = {_SHORT_T} fit in "
                   "one key block: your key mask works in the first key block only. offs_n counts from the block's "
                   "start, so compare the key's position in the sequence: qk = tl.where((start_n + offs_n)[None, :] "
                   "< T, qk, float('-inf')).",
                   "masked the keys >= T with the block-relative offs_n (first key block only)")


def _forward_case(t: Trial, c: dict, passed: list[str], key_masks: list | None = None) -> None:
    """Run one forward case (see _forward_cases) and compare, naming what it can recognise. ``key_masks``:
    the two key-mask mistakes a ragged probe could not tell apart, for the short probe (kept across cases)."""
    __tracebackhide__ = True
    key_masks = [] if key_masks is None else key_masks
    dev = kernel_device()
    qg, kg, vg = c["args"]
    causal, dtype, kind, expected = c["causal"], c["dtype"], c["kind"], c["out"]
    B, H, T, d = qg.shape
    got, prov = _call_kernel(t, qg, kg, vg, causal, sources={"q": 0, "k": 1, "v": 2},
                             case=describe_case(q=qg, k=kg, v=vg, causal=causal) + f" on {dev.type}")
    out, lse = _split_forward(t, got)
    if isinstance(out, torch.Tensor) and out.shape == expected.shape:
        _dtype_check(t, out, dtype, "out")
    tol = _tol(dtype, dev, "probe" if "probe" in kind else "fwd")
    diagnosis, what, mistakes = "", "out", {}
    if isinstance(out, torch.Tensor) and out.shape == expected.shape and out.dtype == dtype and not _close(out, expected, **tol):
        diagnosis, where = _unwritten(out, "out")
        P = out.detach().double().cpu()[0, 0, :, :T]
        if not diagnosis and not where and "probe" in kind:
            if kind in ("ragged-probe", "short-probe") and _isnan(P).any() and "probe" in passed:
                diagnosis = Mistake("unmasked-loads", "NaN now that T is not a multiple of the "
                                    "block (the cases with T = 128 passed): your kernel read past "
                                    "the end of q, k or v (the memory after them holds NaN here). "
                                    "Mask the loads: tl.load(k_ptrs, mask=offs_n[:, None] < T, "
                                    "other=0.0), and the same for q (offs_m) and v.",
                                    "loads past the end of q, k or v are not masked (ragged T)")
            diagnosis = diagnosis or _weights_hint(P, c["P64"][0, 0], c["raw"][0, 0], causal, d, kind != "probe")
        if getattr(diagnosis, "slug", "") == "padded-keys-not-masked" and kind == "ragged-probe":
            # Keys >= T weighed at T = 100: no key mask at all, or one that works in the first key block only
            # (offs_n, relative to the block, compared with T). The short probe that follows tells them apart:
            # a kernel right on it (T < every key block) refutes "no mask" and leaves the first-block-only mask.
            key_masks[:] = [diagnosis, _first_block_mask(T, float(P.sum(-1)[0]))]
            mistakes = {m: out for m in key_masks}
        if not diagnosis and not where:
            diagnosis, where = _slices(out, expected, tol, "out")
        if (not diagnosis or getattr(diagnosis, "slug", "") == "running-sum-not-row-sum") and not where:
            diagnosis = _rescale_hint(out, c["q"], c["k"], c["v"], causal, tol) or diagnosis
        if not diagnosis and not where:
            rows = _rows(out, expected, tol, T)
            if rows and T % 16:
                diagnosis = Mistake("partial-block-not-masked", f"{rows} of out (the last, partial "
                                    f"query block: T = {T}) are wrong, the rows before are right: "
                                    "mask that block's loads, scores and stores with offs < T.",
                                    "the last, partial query block is not masked (offs < T)")
            elif causal and "plain-" + str((B, H, T, d, dtype)) in passed:
                diagnosis = Mistake("causal-part-wrong", "the same shapes passed with "
                                    "causal=False, so look at the causal parts: keep scores where "
                                    "offs_m[:, None] >= offs_n[None, :], and loop over key blocks "
                                    "up to the end of this query block, (start_m + 1) * BLOCK_M.",
                                    "wrong with causal=True only (mask or loop bounds)")
        what = f"out ({where})" if where else "out"
    if kind == "short-probe" and key_masks and isinstance(out, torch.Tensor) and out.shape == expected.shape:
        right = out.dtype == dtype and _close(out, expected, **tol)
        P = out.detach().double().cpu()[0, 0, :, :T]
        sums = P.sum(-1)
        padded = (not right and bool(_isfinite(P).all()) and bool((sums < 1 - 1e-3).all())
                  and _allclose(P / sums[:, None], c["P64"][0, 0], atol=1e-4, rtol=1e-2))
        wrong = expected + 1  # a model no output of this case matches: the mistake is refuted
        mistakes = {key_masks[0]: out if padded else wrong, key_masks[1]: expected if right else wrong}
    t.tensor(out, expected, what=what, hint=_FWD_HINT, diagnosis=diagnosis, mistakes=mistakes, **tol)
    if T > 1:  # with one key, out = v: a kernel's output is then also a copy of an input
        _written_by_kernel(t, prov, out, "out", {"q", "k", "v"})
    if lse is not None:
        ref_lse = c["lse"]
        if isinstance(lse, torch.Tensor) and lse.shape != ref_lse.shape:
            t.fail(f"lse: expected shape {list(ref_lse.shape)} ([B, H, T]), got {list(lse.shape)}.",
                   Mistake("lse-wrong-shape", "allocate lse as torch.empty((B, H, T), "
                           "dtype=torch.float32, device=q.device), or return only out.",
                           "lse is not of shape [B, H, T]"))
        if isinstance(lse, torch.Tensor) and lse.dtype != torch.float32:
            t.fail(f"lse: expected float32, got {lse.dtype}.",
                   Mistake("lse-not-float32", "keep the running statistics m_i, l_i and lse in "
                           "float32.", "lse is not float32"))
        lse_diag = _unwritten(lse[..., None], "lse")[0] if isinstance(lse, torch.Tensor) else ""
        t.tensor(lse, ref_lse, what="lse", diagnosis=lse_diag, hint="lse = (m_i + tl.log2(l_i)) * ln(2) when m_i is in "
                 "log2 units (natural log: m + log(l)).", **_tol(dtype, dev, "lse"), mistakes={
                     Mistake("lse-in-log2", "lse is in log2 units: multiply m_i + log2(l_i) by "
                             "ln(2) to get the natural log."): lambda: ref_lse * LOG2E,
                     Mistake("lse-is-m", "lse is only the running max: add the log of the running "
                             "sum, lse = m + log(l)."): lambda: (
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
               Mistake("wrong-output-dtype", "allocate it like the inputs (torch.empty_like(q)) "
                       "and convert the float32 accumulator when you store it: tl.store(ptrs, "
                       "acc.to(Out.dtype.element_ty), mask=...).",
                       "the output is not in the inputs' dtype"))


@exercise(time_limit=TRITON_TIME_LIMIT_S)
def flash_attention_triton(t: Trial) -> None:
    t.error_hints = _TRITON_ERRORS
    t.forbidden_references = set(_COURSE_FUNCTIONS)
    passed: list[str] = []
    key_masks: list = []
    for case in _forward_cases(kernel_device()):
        _forward_case(t, case, passed, key_masks)


# =========================================================================== 9.4 Triton backward


_BWD_HINTS = {
    "dv": "dV = P^T dO, with P = exp(S * sm_scale - lse) recomputed from the saved lse (natural log: with exp2, "
          "multiply both by log2(e)).",
    "dk": "dK = sm_scale * dS^T Q with dS = P * (dP - D), dP = dO V^T and D = rowsum(dO * O).",
    "dq": "dQ = sm_scale * dS K with dS = P * (dP - D), dP = dO V^T and D = rowsum(dO * O).",
}


_TILES = (16, 32, 64, 128)  # the square block sizes (BLOCK_M = BLOCK_N) a learner's kernels may use


def _tile_product(a: torch.Tensor, x: torch.Tensor, b: int, pattern: str) -> torch.Tensor:
    """A tile-by-tile product with a forgotten transpose, on [..., T, T] ``a`` and [..., T, d] ``x``
    padded to a multiple of ``b``: "rows" gives out[kb, r] = sum_{mb, c} a[mb, r, kb, c] x[mb, c] (the
    dK/dV kernel's P @ dO instead of P^T @ dO), "cols" out[mb, r] = sum_{kb, c} a[mb, c, kb, r] x[kb, c]
    (the dQ kernel's dS^T @ K instead of dS @ K)."""
    T, d = x.shape[-2:]
    n = -(-T // b)
    pad = n * b - T
    a = torch.nn.functional.pad(a, (0, pad, 0, pad)).reshape(*a.shape[:-2], n, b, n, b)
    x = torch.nn.functional.pad(x, (0, 0, 0, pad)).reshape(*x.shape[:-2], n, b, d)
    out = (torch.einsum("...manc,...mcd->...nad", a, x) if pattern == "rows"
           else torch.einsum("...mcna,...ncd->...mad", a, x))
    return out.reshape(*x.shape[:-3], n * b, d)[..., :T, :]


def _bwd_model(q, k, v, lse, do, causal: bool, block: int | None = None, mask: str = "causal",
               skip_diag: bool = False, scale_dq: bool = True, scale_dk: bool = True, delta: str = "o",
               p_units: str = "ln", p_scaled: bool = True, dv_form: str = "ok", dk_form: str = "ok",
               dq_form: str = "ok", lse_at_keys: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in float64 of two backward kernels (dK/dV per key block, dQ per query block) with
    one mistake switched on. ``block``: the kernels' square tiles; with causal=True their loops visit
    the query blocks from the key block's own on (dK/dV; after it with ``skip_diag``) and the key
    blocks up to the query block's own (dQ), so a wrong mask acts inside those tiles only (None: the
    loops visit every tile). ``mask``: "causal" (keep j <= i), "none", "strict" (j < i), "reversed"
    (j >= i). ``delta``: D = rowsum(dO * O), "none" (0) or "do" (rowsum(dO)). ``p_units``: P = exp(S -
    lse), "exp2" (exp2(S - lse), natural-log S and lse) or "log2-missed" (exp2(S log2(e) - lse)).
    ``p_scaled=False``: S = Q K^T without sm_scale. ``dv_form`` / ``dk_form``: "tile-rows" (P @ dO / dS @
    Q per tile, the transpose forgotten), "full" (the whole P @ dO), "from-p" (dK from P, not dS);
    ``dq_form`` "tile-cols" (dS^T @ K per tile); ``dv_form="from-ds"``: dV = dS^T dO. ``lse_at_keys``: the
    dK/dV kernel reads lse at its key positions (row r of a tile gets lse[key block start + r])."""
    q, k, v, do = (x.detach().to("cpu", torch.float64) for x in (q, k, v, do))
    lse = lse.detach().to("cpu", torch.float64)
    T, d = q.shape[-2:]
    scale = 1 / math.sqrt(d)
    raw = q @ k.transpose(-2, -1)
    s = raw * scale if p_scaled else raw
    if p_units == "exp2":
        p = torch.exp2(s - lse[..., None])
    elif p_units == "log2-missed":
        p = torch.exp(s - lse[..., None]) * torch.exp(lse * (1 - math.log(2)))[..., None]
    else:
        p = torch.exp(s - lse[..., None])
    i = torch.arange(T)[:, None]
    j = torch.arange(T)[None, :]
    p_kv = p_q = p
    if lse_at_keys:
        rows = ((j // block) * block + i % block).clamp(max=T - 1).expand(T, T)  # the lse the tile row reads
        lse_kv = lse[..., None, :].expand(*lse.shape[:-1], T, T).gather(-1, rows.expand(*lse.shape[:-1], T, T))
        p_kv = torch.exp(s - lse_kv)
        p_kv = torch.where(((j // block) * block + i % block < T), p_kv, torch.zeros_like(p_kv))
    if causal:
        keep = {"causal": j <= i, "none": torch.ones(T, T, dtype=torch.bool), "strict": j < i,
                "reversed": j >= i}[mask]
        if block is None:
            seen_kv = seen_q = torch.ones(T, T, dtype=torch.bool)
        else:
            seen_q = (j // block) <= (i // block)
            seen_kv = (i // block) > (j // block) if skip_diag else seen_q
        p_kv, p_q = p * (keep & seen_kv), p * (keep & seen_q)
    p_true = torch.exp(raw * scale - lse[..., None]) * ((j <= i) if causal else 1)
    o = p_true @ v
    dd = {"o": (do * o).sum(-1, keepdim=True), "none": 0.0, "do": do.sum(-1, keepdim=True)}[delta]
    dp = do @ v.transpose(-2, -1)
    ds_kv, ds_q = p_kv * (dp - dd), p_q * (dp - dd)
    if dv_form == "from-ds":
        dv = ds_kv.transpose(-2, -1) @ do
    elif dv_form == "tile-rows":
        dv = _tile_product(p_kv, do, block, "rows")
    elif dv_form == "full":
        dv = p_kv @ do
    else:
        dv = p_kv.transpose(-2, -1) @ do
    if dk_form == "tile-rows":
        dk = _tile_product(ds_kv, q, block, "rows")
    elif dk_form == "from-p":
        dk = p_kv.transpose(-2, -1) @ q
    else:
        dk = ds_kv.transpose(-2, -1) @ q
    dq = _tile_product(ds_q, k, block, "cols") if dq_form == "tile-cols" else ds_q @ k
    return dq * (scale if scale_dq else 1.0), dk * (scale if scale_dk else 1.0), dv


def _backward_models(q, k, v, lse, do, causal: bool) -> list[tuple[str, Callable]]:
    """(mistake, zero-argument callable giving its (dq, dk, dv)) for the mistakes of 9.4; a mistake
    whose model depends on the kernels' block size comes once per block size in ``_TILES``."""
    def g(**kw):
        return lambda: _bwd_model(q, k, v, lse, do, causal, **kw)

    scale_hint = ("the gradients of q and k miss the softmax scale: S = sm_scale * Q K^T, so dQ = sm_scale * dS K "
                  "and dK = sm_scale * dS^T Q.")
    models: list[tuple[str, Callable]] = [
        (Mistake("grads-miss-sm_scale", scale_hint), g(scale_dq=False, scale_dk=False)),
        (Mistake("grads-miss-sm_scale", "dQ misses the softmax scale: S = sm_scale * Q K^T, so dQ = "
                 "sm_scale * dS K, as dK = sm_scale * dS^T Q."), g(scale_dq=False)),
        (Mistake("grads-miss-sm_scale", "dK misses the softmax scale: S = sm_scale * Q K^T, so dK = "
                 "sm_scale * dS^T Q, as dQ = sm_scale * dS K."), g(scale_dk=False)),
        (Mistake("missing-D", "D is missing: dS = P * (dP - D) with D = rowsum(dO * O) (one number "
                 "per query row), not P * dP."), g(delta="none")),
        (Mistake("D-without-O", "D is rowsum(dO * O), one number per query row: yours is rowsum(dO), "
                 "the O is missing: D = (grad_out.float() * out.float()).sum(-1).",
                 "computed D as rowsum(dO) instead of rowsum(dO * O)"), g(delta="do")),
        (Mistake("lse-wrong-units", "P was recomputed with lse in the wrong units: lse is a natural "
                 "log; with tl.exp2 use exp2(qk * sm_scale * log2(e) - lse * log2(e))."), g(p_units="log2-missed")),
        (Mistake("exp2-of-natural-log", "P = exp2(S - lse) with S and lse in natural-log units: exp2 "
                 "needs both multiplied by log2(e), p = tl.exp2((qk * sm_scale - lse) * log2(e)), or use "
                 "tl.exp(qk * sm_scale - lse).", "recomputed P with exp2 on natural-log S and lse"),
         g(p_units="exp2")),
        (Mistake("P-without-sm_scale", "P was recomputed from Q K^T without sm_scale: P = exp(sm_scale * "
                 "Q K^T - lse), the same scores the forward pass used.",
                 "recomputed P from unscaled scores"), g(p_scaled=False)),
        (Mistake("P-not-transposed-in-dV", "dV = P^T dO (keys x queries times queries x "
                 "d): transpose P.", "computed dV with P instead of P^T"), g(dv_form="full")),
        (Mistake("dV-from-dS", "dV was accumulated from dS: it is dV = P^T dO (the output is P V, so V's "
                 "gradient pairs P with dO); dS goes into dK and dQ.", "accumulated dV from dS instead of P"),
         g(dv_form="from-ds")),
        (Mistake("dK-from-P", "dK was accumulated from P: it is dK = sm_scale * dS^T Q, with dS = P * (dP - D) "
                 "(dV is the one built from P).", "accumulated dK from P instead of dS"), g(dk_form="from-p")),
    ]
    for b in _TILES:
        models += [
            (Mistake("P-not-transposed-in-dV", "dV = P^T dO: in the dK/dV kernel each tile adds "
                     "tl.dot(tl.trans(p), do) (keys x queries times queries x d); yours adds tl.dot(p, do): "
                     "transpose P.", "computed dV with P instead of P^T"), g(block=b, dv_form="tile-rows")),
            (Mistake("dS-not-transposed-in-dK", "dK = sm_scale * dS^T Q: in the dK/dV kernel each tile adds "
                     "tl.dot(tl.trans(ds), q); yours adds tl.dot(ds, q): transpose dS.",
                     "computed dK with dS instead of dS^T"), g(block=b, dk_form="tile-rows")),
            (Mistake("lse-at-key-positions", "the dK/dV kernel read lse at its key positions (offs_n): lse "
                     "belongs to the queries, one number per query row, so load it at offs_m, the rows of "
                     "the query block the loop is on.", "loaded lse at the key positions in the dK/dV kernel"),
             g(block=b, lse_at_keys=True)),
            (Mistake("dS-transposed-in-dQ", "dQ = sm_scale * dS K: in the dQ kernel each tile adds "
                     "tl.dot(ds, k), [BLOCK_M, BLOCK_N] x [BLOCK_N, d]; yours transposes dS.",
                     "computed dQ with dS^T instead of dS"), g(block=b, dq_form="tile-cols")),
        ]
    if causal:
        missing = Mistake("backward-mask-missing", "the causal mask is missing in the backward "
                          "pass: P recomputed from lse must be 0 for keys j > i (tl.where(offs_m[:, "
                          "None] >= offs_n[None, :], p, 0.0)).")
        reversed_ = Mistake("backward-mask-reversed", "the backward mask keeps keys j >= i, the "
                            "future: P must be 0 for keys j > i, so keep offs_m[:, None] >= offs_n[None, :] "
                            "(query i, key j), not <=.", "the backward causal mask keeps j >= i instead of j <= i")
        skipped = Mistake("dkdv-skips-diagonal-block", "dK and dV miss the diagonal block: in the dK/dV "
                          "kernel the loop over query blocks must start at the key block's own query block "
                          "(start_m from start_n * BLOCK_N, rounded down to a multiple of BLOCK_M), since "
                          "queries i >= j of that block see its keys; the mask does the rest.",
                          "the dK/dV loop starts after the key block's own query block")
        models += [(missing, g(mask="none")), (reversed_, g(mask="reversed")),
                   (Mistake("backward-mask-hides-diagonal", "the backward mask also hides the "
                            "diagonal: query i attends to key i (keep j <= i)."), g(mask="strict"))]
        for b in _TILES:
            models += [(missing, g(block=b, mask="none")), (reversed_, g(block=b, mask="reversed"))]
            if b < q.shape[-2]:  # with one block, skipping it leaves dK = dV = 0: a kernel that never ran
                models.append((skipped, g(block=b, skip_diag=True)))
    return models


def _evaluated(models: list, got: tuple, expected: list, tol: dict, dtype, dev) -> dict[str, tuple]:
    """mistake -> its (dq, dk, dv) on this case, in the case's dtype and device; a mistake whose model
    depends on the block size keeps the first block size that fits the learner's gradients (else the
    first block size)."""
    out: dict[str, tuple] = {}
    for hint, model in models:
        if hint in out and _fits(got, expected, out[hint], tol):
            continue
        try:
            grads = tuple(x.to(device=dev, dtype=dtype) for x in model())
        except Exception:  # noqa: BLE001 - a mistake that cannot happen on this case
            continue
        if hint not in out or _fits(got, expected, grads, tol):
            out[hint] = grads
    return out


def _fits(got: tuple, expected: list, grads: tuple, tol: dict) -> bool:
    """A model fits the learner's gradients: every gradient it gets wrong is the learner's, and none
    the learner got right is wrong in it."""
    differs = [not _close(m, e, **tol) for m, e in zip(grads, expected)]
    return any(differs) and all(not w or _close(g, m, **tol) for g, m, w in zip(got, grads, differs))


def _fitting_mistakes(got: tuple, expected: list, models: dict[str, tuple], tol: dict) -> dict[str, tuple]:
    """The mistakes of ``models`` (from :func:`_evaluated`) whose model fits this call."""
    return {h: m for h, m in models.items() if _fits(got, expected, m, tol)}


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
                          args=[guarded(x, dev) for x in (q, k, v, out64.to(dtype), lse, do)]))
    return cases


@exercise(time_limit=TRITON_TIME_LIMIT_S)
def flash_attention_triton_backward(t: Trial) -> None:
    t.error_hints = _TRITON_ERRORS
    t.forbidden_references = set(_COURSE_FUNCTIONS)
    dev = kernel_device()
    passed: list[tuple] = []
    for c in _backward_cases(dev):
        args, causal, dtype = c["args"], c["causal"], c["dtype"]
        B, H, T, d = args[0].shape
        case = describe_case(q=args[0], k=args[1], v=args[2], out=args[3], lse=args[4], grad_out=args[5],
                             causal=causal) + f" on {dev.type}"
        names = ("q", "k", "v", "out", "lse", "grad_out")
        got, prov = _call_kernel(t, *args, causal, sources={name: i for i, name in enumerate(names)}, case=case)
        got = t.tuple(got, 3, ("grad_q", "grad_k", "grad_v"))
        tol = _tol(dtype, dev, "bwd")
        grad_names = ("grad_q", "grad_k", "grad_v")
        for i, j in [(i, j) for i in range(3) for j in range(3) if i != j]:
            if _close(got[i], c["expected"][j], **tol) and not _close(got[i], c["expected"][i], **tol):
                t.fail(f"your {grad_names[i]} (item {i} of the tuple) holds {grad_names[j]}.",
                       Mistake("grads-in-wrong-order", "the gradients are returned in the wrong order: "
                               "return (grad_q, grad_k, grad_v), the order of the inputs q, k, v."))
        models = _evaluated(_backward_models(c["q"], c["k"], c["v"], c["lse"], c["do"], causal), got, c["expected"],
                            tol, dtype, dev)
        fits = _fitting_mistakes(got, c["expected"], models, tol)
        for which, name in ((2, "dv"), (1, "dk"), (0, "dq")):
            g, e = got[which], c["expected"][which]
            what = f"grad_{name[1]}"
            if isinstance(g, torch.Tensor) and g.shape == e.shape:
                _dtype_check(t, g, dtype, what)
            diagnosis = ""
            named = [h for h, m in fits.items() if not _close(m[which], e, **tol)]
            if isinstance(g, torch.Tensor) and g.shape == e.shape and g.dtype == e.dtype and not _close(g, e, **tol):
                diagnosis, where = _unwritten(g, what)
                if not diagnosis and not where and named:
                    diagnosis = named[0]
                if not diagnosis and not where and _isnan(g).any() and T % 16 and any(p[2] % 16 == 0 for p in passed):
                    diagnosis = Mistake("unmasked-loads", "NaN now that T is not a multiple of the "
                                        f"block here (T = {T}; the cases with T = 128 passed): "
                                        "your kernels read past the end of q, k, v, dO, lse or D "
                                        "(the memory after them holds NaN here). Mask those loads "
                                        "with offs < T (other=0), set P to 0 for positions >= T "
                                        "(tl.where), and mask the stores.",
                                        "loads past the end of the inputs are not masked")
                if not diagnosis and not where:
                    diagnosis, where = _slices(g, e, tol, what)
                if not diagnosis and not where:
                    rows = _rows(g, e, tol, T)
                    if rows and T % 16:
                        diagnosis = Mistake("partial-block-not-masked", f"{rows} of {what} (the "
                                            "last, partial block: T is not a multiple of the block "
                                            "here) are wrong, the rows before are right: mask the "
                                            "loads of that block with offs < T (other=0), set P to "
                                            "0 for positions >= T, and mask the stores.",
                                            "the last, partial block is not masked (offs < T)")
                    elif causal and (B, H, T, d, dtype, False) in passed:
                        diagnosis = Mistake("causal-part-wrong", "the same shapes passed with "
                                            "causal=False, so look at the causal parts: P must be "
                                            "0 for keys j > i (offs_m[:, None] >= offs_n[None, :]) "
                                            "in both kernels, and the loops must cover every pair "
                                            "j <= i: dK/dV from the key block's first query on, dQ "
                                            "up to the end of its query block.",
                                            "wrong with causal=True only (mask or loop bounds)")
                what = f"{what} ({where})" if where else what
            t.tensor(g, e, what=what, hint=_BWD_HINTS[name], diagnosis=diagnosis, **tol,
                     mistakes=_weighed({h: m[which] for h, m in models.items()}, g, **tol))
            if T > 1:  # with one key, grad_q = grad_k = 0 and grad_v = grad_out: nothing to compute
                _written_by_kernel(t, prov, g, f"grad_{name[1]}", {"q", "k"})
        passed.append((B, H, T, d, dtype, causal))
