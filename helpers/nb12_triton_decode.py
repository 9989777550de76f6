"""Split-KV ("flash-decoding") attention over a paged KV cache, in Triton (notebook 12, serving).

One decode step: every sequence of the batch has one new query per head, and reads all of its
cached keys and values. Notebook 09's kernel gives each (sequence, head) one program, which is far
too few to fill a GPU when the batch is small and the context long; here each program takes one
*chunk* of a sequence's keys (a split), and a second, small kernel merges the chunks with the
log-sum-exp rule of notebook 07 (:func:`helpers.nb07_kv_cache.merge_partials`).

The cache is *paged* (vLLM's layout): ``k_pages, v_pages [n_blocks, block_size, H_kv, d]`` hold
blocks of ``block_size`` tokens, and ``block_tables [B, max_blocks]`` (int32) lists, for each
sequence, the blocks that hold its tokens 0..block_size-1, block_size..2*block_size-1, ... in
order; ``seq_lens [B]`` (int32) says how many tokens each sequence has (0 allowed: output 0).
Entries of a table past a sequence's last block are padding and are never read.

Public API:

* ``paged_decode_triton(q, k_pages, v_pages, block_tables, seq_lens, n_splits=None,
  sm_scale=None)`` -> out ``[B, H, d]`` in q's dtype, q ``[B, H, d]``. Query head h reads kv head
  ``h // (H // H_kv)`` (grouped-query attention, through strides: nothing is expanded).
* ``paged_decode_splits(...)`` -> ``(partials [n_splits, B, H, d], lse [n_splits, B, H])`` (float32,
  natural log; an empty chunk has partial 0 and lse -inf) and ``merge_splits_triton(partials, lse,
  dtype)``: the two steps on their own.
* ``default_n_splits``, ``sm_count``, ``flash_decode_programs``, ``split_kv_programs`` and
  ``GPU_SM_COUNTS``: how many programs each kernel launches, against how many SMs a GPU has;
  ``split_waves`` and ``split_cost``: the waves those programs run in, the model the default split
  count minimises.

fp16 / fp32 everywhere, bf16 on a GPU only (the interpreter's bf16 ``tl.dot`` is wrong); head dims
``SUPPORTED_HEAD_DIMS``. Each program loads ``BLOCK_N`` keys per iteration (several pages when
pages are small, part of one when they are large: keys are found one by one through the table).
The GQA group's queries, padded to 16 rows, meet the keys in one ``tl.dot`` (groups smaller than
``DOT_MIN_GROUP`` take a broadcast multiply and a sum instead: slower on an H200 even for MHA).
Without a CUDA GPU the kernels run in Triton's interpreter; on a GPU they are autotuned over a few
tile sizes (``GPU_CONFIGS``). For Triton 3.6 and later.
"""

from __future__ import annotations

from helpers.runtime import configure_triton

# Triton reads TRITON_INTERPRET when a function is decorated: decide first (see nb09_triton_flash).
_INTERPRET = configure_triton()

import functools  # noqa: E402
import math  # noqa: E402

import torch  # noqa: E402

from helpers.nb09_triton_flash import (  # noqa: E402
    LESSON_MARK,
    LOG2E,
    SUPPORTED_HEAD_DIMS,
    _dot_precision,
    _scale,
    lesson_part,
)

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # macOS / Windows: no Triton wheels
    raise ImportError(
        "Triton is Linux-only; the Triton cells skip (on Linux: pip install triton)."
    ) from exc

__all__ = [
    "GPU_SM_COUNTS", "LESSON_MARK", "default_n_splits", "flash_decode_programs", "lesson_part",
    "merge_splits_triton", "paged_decode_splits", "paged_decode_triton", "sm_count", "split_cost",
    "split_kv_programs", "split_waves",
]

LN2 = 0.6931471805599453  # ln(2): from log2 units back to natural logs

# ---------------------------------------------------------------------------------------------
# How many programs, on how many SMs
# ---------------------------------------------------------------------------------------------

# Streaming multiprocessors of common GPUs (what torch.cuda.get_device_properties reports).
GPU_SM_COUNTS = {"H100 SXM": 132, "H200": 132, "H100 PCIe": 114, "A100": 108, "L4": 58, "T4": 40}

# The split count's model (default_n_splits): P programs run in ceil(P / (sms * RESIDENT)) waves,
# each as long as one chunk. RESIDENT is how many programs of this kernel an SM is counted on to run
# at once. What the registers and shared memory of each configuration the autotuner can choose allow
# is in helpers/results/kernel_aot_decode.md (programs per SM): 3 to 5 programs of 4 warps on sm_90
# at d = 128, 2 to 7 on sm_80, more at d = 64. A memory-bound kernel needs no more than about 2: on
# the H200 a lone program streams K and V at about 24 GB/s (132 of them: ~3.2 TB/s), and at 65,536
# tokens 256 programs (one per sequence and kv head, B * H_kv = 256) read at 94-98% of SDPA's rate
# (helpers/results/nvidia-h200-decode.csv; notebook 12 computes both). Counted at 2 per SM, a
# launch that fills its waves runs at once under every configuration (all hold 2 or more, on the
# tl.dot path) and keeps the memory bus busy; counting more would pay a whole chunk's time for a
# tail wherever the autotuner picks a configuration that holds fewer.
RESIDENT = 2
MODEL_TILE = 64  # keys per tile the model cuts chunks in (the kernel's BLOCK_N in most GPU_CONFIGS)
# A wave's start, in keys: each program reads its sequence's length, its queries and its first
# block-table entries before its first tile can load (a few memory latencies, ~1.5 us, about as
# long as a tile takes to stream); without it, 20 waves 99% full would beat one wave 97% full.
WAVE_START_KEYS = MODEL_TILE
MIN_KEYS_PER_SPLIT = 256  # a chunk shorter than this costs more to merge than it saves
# The model's price of one more split, in keys: small next to a chunk, it breaks ties toward fewer
# splits and outweighs a gain of a few keys per wave. Its partials are of that order: d floats per
# query head written and read back by the merge, the bytes of 2 keys of K and V per query head.
MERGE_KEYS_PER_SPLIT = 16
MAX_SPLITS = 128
INTERPRETER_SMS = 2  # the interpreter runs one program at a time: pretend a tiny GPU


def flash_decode_programs(batch: int, heads: int, block_m: int = 64) -> int:
    """Programs notebook 09's forward kernel launches for one decode step (one query per sequence
    and head): one query block per (sequence, head), ``cdiv(1, BLOCK_M) * B * H = B * H``."""
    return math.ceil(1 / block_m) * batch * heads


def split_kv_programs(batch: int, kv_heads: int, n_splits: int) -> int:
    """Programs this module's split kernel launches: one per (sequence, kv head, split); the GQA
    group of query heads that share a kv head is handled by one program."""
    return batch * kv_heads * n_splits


def sm_count(device: torch.device | str | None = None) -> int:
    """The GPU's number of SMs, or ``INTERPRETER_SMS`` without one."""
    if _INTERPRET or not torch.cuda.is_available():
        return INTERPRETER_SMS
    return _cuda_sms(torch.device(device if device is not None else "cuda").index or 0)


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def split_waves(batch: int, kv_heads: int, max_seq_len: int, n_splits: int, sms: int,
                resident: int = RESIDENT) -> tuple[int, int, int]:
    """(chunk, programs, waves) of a launch with ``n_splits`` splits, in default_n_splits's model:
    a chunk is ``ceil(T / n_splits)`` keys rounded up to whole MODEL_TILE tiles (the kernel's
    ``per_split``), ``programs`` the ``B * H_kv * ceil(T / chunk)`` programs whose chunk is not
    empty (rounding can leave the last splits empty: they return at once), and they run in
    ``waves = ceil(programs / (sms * resident))`` waves."""
    keys = max(1, max_seq_len)
    chunk = math.ceil(math.ceil(keys / n_splits) / MODEL_TILE) * MODEL_TILE
    programs = split_kv_programs(batch, kv_heads, math.ceil(keys / chunk))
    return chunk, programs, math.ceil(programs / (sms * resident))


def split_cost(batch: int, kv_heads: int, max_seq_len: int, n_splits: int, sms: int,
               resident: int = RESIDENT, merge_keys: int = MERGE_KEYS_PER_SPLIT) -> int:
    """The model's time of one decode step, in keys one program reads: ``waves * (chunk +
    WAVE_START_KEYS)`` (split_waves) plus ``merge_keys`` for each split past the first (1 split has
    no merge). A memory-bound kernel's real time also depends on the bytes in flight: this ranks
    split counts, it does not predict microseconds."""
    chunk, _, waves = split_waves(batch, kv_heads, max_seq_len, n_splits, sms, resident)
    return waves * (chunk + WAVE_START_KEYS) + merge_keys * (n_splits - 1)


def default_n_splits(batch: int, kv_heads: int, max_seq_len: int, sms: int,
                     resident: int = RESIDENT, min_keys: int = MIN_KEYS_PER_SPLIT, *,
                     merge_keys: int = MERGE_KEYS_PER_SPLIT) -> int:
    """Splits per sequence. 1 when ``B * H_kv`` programs already give every SM one (a memory-bound
    kernel then streams at nearly full speed: measured on an H200, splitting further only adds the
    merge). Otherwise the split count with the least :func:`split_cost`, the fewest on ties: the
    programs fill whole waves of ``sms * resident`` rather than spill a few into one more wave, no
    chunk is shorter than ``min_keys`` keys and there are at most ``MAX_SPLITS``.
    ``default_n_splits(1, 8, 65536, 132) == 32`` (256 programs: one wave of 264, 97% full)."""
    if sms < 1 or resident < 1:
        raise ValueError(f"sms and resident must be at least 1; got sms={sms}, resident={resident}")
    if max(1, batch * kv_heads) >= sms:
        return 1
    most = max(1, min(MAX_SPLITS, math.ceil(max(1, max_seq_len) / min_keys)))
    costs = [split_cost(batch, kv_heads, max_seq_len, n, sms, resident, merge_keys)
             for n in range(1, most + 1)]
    return 1 + costs.index(min(costs))  # the first of the cheapest: the fewest splits


# ---------------------------------------------------------------------------------------------
# The kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _paged_decode_split(
    Q, K, V, BlockTables, SeqLens, PartOut, PartLse, qk_scale,
    stride_qb, stride_qh, stride_qd,
    stride_kblk, stride_kslot, stride_kh, stride_kd,
    stride_vblk, stride_vslot, stride_vh, stride_vd,
    stride_tb, stride_tp,
    stride_os, stride_ob, stride_oh, stride_od,
    stride_ls, stride_lb, stride_lh,
    H_KV, GROUP, N_SPLITS, CHUNK_BUCKET,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, GROUP_PAD: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program = one chunk (split) of one sequence's keys, for the GROUP query heads that share
    one kv head. Grid: (N_SPLITS, B * H_KV). Writes the chunk's normalised output and its lse."""
    # lesson: program-ids
    split = tl.program_id(0)
    b = tl.program_id(1) // H_KV
    kv_head = tl.program_id(1) % H_KV
    offs_g = tl.arange(0, GROUP_PAD)  # the query heads kv_head * GROUP + g, padded to GROUP_PAD
    heads = kv_head * GROUP + offs_g
    head_ok = offs_g < GROUP
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    # lesson: end program-ids

    # lesson: chunk
    # -- this program's keys [lo, hi): whole tiles of BLOCK_N keys; lo >= hi is an empty chunk
    seq_len = tl.load(SeqLens + b)
    per_split = tl.cdiv(tl.cdiv(seq_len, N_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, seq_len)
    # lesson: end chunk

    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=head_ok[:, None], other=0.0)
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)  # running max (log2 units)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)  # running sum of exp2(s - m_i)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)  # running sum of p @ v

    for start in range(lo, hi, BLOCK_N):
        # lesson: page-lookup
        # -- key j lives in block block_tables[b, j // PAGE_SIZE], slot j % PAGE_SIZE
        cols = start + offs_n
        key_ok = cols < hi  # past the chunk's end: not loaded (padding entries are never read)
        block = tl.load(BlockTables + b * stride_tb + (cols // PAGE_SIZE) * stride_tp,
                        mask=key_ok, other=0).to(tl.int64)
        slot = cols % PAGE_SIZE
        k_rows = K + block * stride_kblk + slot * stride_kslot + kv_head * stride_kh
        v_rows = V + block * stride_vblk + slot * stride_vslot + kv_head * stride_vh
        k = tl.load(k_rows[:, None] + offs_d[None, :] * stride_kd, mask=key_ok[:, None], other=0.0)
        v = tl.load(v_rows[:, None] + offs_d[None, :] * stride_vd, mask=key_ok[:, None], other=0.0)
        # lesson: end page-lookup
        # lesson: scores
        # -- scores of the group's queries against these keys, in log2 units  [GROUP_PAD, BLOCK_N]
        if USE_DOT:  # a tensor-core product: the group is padded to 16 rows
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        else:  # one or two heads: multiply and sum over d
            qk = tl.sum(q[:, None, :].to(tl.float32) * k[None, :, :].to(tl.float32), axis=2)
        qk = tl.where(key_ok[None, :], qk * qk_scale, float("-inf"))
        # lesson: end scores
        # lesson: online-softmax
        m_new = tl.maximum(m_i, tl.max(qk, 1))  # finite: every tile holds at least one key
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if USE_DOT:
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        else:
            acc += tl.sum(p[:, :, None] * v[None, :, :].to(tl.float32), axis=1)
        m_i = m_new
        # lesson: end online-softmax

    # lesson: epilogue
    # -- normalise within the chunk; an empty chunk (l_i = 0) writes 0 and lse = -inf, never NaN
    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(seen, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))  # ln(2)
    o_ptrs = (PartOut + split * stride_os + b * stride_ob + heads[:, None] * stride_oh
              + offs_d[None, :] * stride_od)
    tl.store(o_ptrs, out.to(PartOut.dtype.element_ty), mask=head_ok[:, None])
    tl.store(PartLse + split * stride_ls + b * stride_lb + heads * stride_lh, lse, mask=head_ok)
    # lesson: end epilogue


@triton.jit
def _merge_splits(
    PartOut, PartLse, Out,
    stride_ps, stride_pb, stride_ph, stride_pd,
    stride_ls, stride_lb, stride_lh,
    stride_ob, stride_oh, stride_od,
    H, N_SPLITS,
    HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    """out[b, h] = sum_c w_c * partial_c / sum_c w_c with w_c = exp(lse_c - max_c lse_c): the merge
    of notebook 07 (merge_partials). Grid: (B * H,)."""
    # lesson: merge
    b = tl.program_id(0) // H
    h = tl.program_id(0) % H
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    split_ok = offs_s < N_SPLITS
    lse = tl.load(PartLse + offs_s * stride_ls + b * stride_lb + h * stride_lh,
                  mask=split_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # every chunk empty (seq_len 0): out = 0
    w = tl.exp(lse - top)  # an empty chunk (lse = -inf) weighs 0
    parts = tl.load(PartOut + offs_s[:, None] * stride_ps + b * stride_pb + h * stride_ph
                    + offs_d[None, :] * stride_pd, mask=split_ok[:, None], other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * parts, 0) / tl.where(total > 0, total, 1.0)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_d * stride_od, out.to(Out.dtype.element_ty))
    # lesson: end merge


# ---------------------------------------------------------------------------------------------
# Launch configurations
# ---------------------------------------------------------------------------------------------

# Query heads per kv head from which the scores are a tl.dot (the group padded to 16 rows); below
# it, the broadcast product. Measured on an H200 (fp16, d = 128): even one head (MHA) padded to 16
# rows streams K/V 2-3x faster through tl.dot than through the broadcast product, so every group
# takes the dot; DOT_MIN_GROUP = 2 sends MHA down the broadcast path (the tests run both).
DOT_MIN_GROUP = 1
INTERPRETER_BLOCK_N = 16  # keys per iteration in the interpreter: short test sequences span tiles
# (BLOCK_N, num_warps, num_stages) the autotuner tries on a GPU, per path
GPU_CONFIGS = {
    "dot": [(64, 4, 2), (64, 4, 3), (128, 4, 2), (32, 4, 3)],
    "broadcast": [(32, 4, 2), (64, 4, 2), (16, 4, 3), (32, 8, 2)],
}


def _group_pad(group: int, use_dot: bool) -> int:
    return max(16, triton.next_power_of_2(group)) if use_dot else triton.next_power_of_2(group)


@functools.cache
def _split_kernel(interpret: bool, path: str = "dot"):
    """The split kernel: plain in the interpreter; autotuned over GPU_CONFIGS[path] on a GPU."""
    if interpret:
        return _paged_decode_split
    configs = [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=s)
               for n, w, s in GPU_CONFIGS[path]]
    key = ["HEAD_DIM", "PAGE_SIZE", "GROUP_PAD", "USE_DOT", "CHUNK_BUCKET"]
    return triton.autotune(configs=configs, key=key)(_paged_decode_split)


# ---------------------------------------------------------------------------------------------
# Input checks and launchers
# ---------------------------------------------------------------------------------------------


def _check_inputs(q, k_pages, v_pages, block_tables, seq_lens) -> None:
    """Raise ValueError, in one line naming the offending shapes or dtypes, unless the inputs suit
    the kernels (shapes, dtypes, devices; not the values: see :func:`_check_values`)."""
    names = ("q", "k_pages", "v_pages", "block_tables", "seq_lens")
    for name, t in zip(names, (q, k_pages, v_pages, block_tables, seq_lens)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 3:
        raise ValueError(f"q must be [B, H, d] (one new query per sequence); got {tuple(q.shape)}")
    if k_pages.dim() != 4:
        raise ValueError("k_pages must be [n_blocks, block_size, H_kv, d]; "
                         f"got {tuple(k_pages.shape)}")
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages and v_pages must have the same shape; got "
                         f"{tuple(k_pages.shape)} and {tuple(v_pages.shape)}")
    if not (q.dtype == k_pages.dtype == v_pages.dtype):
        raise ValueError(f"q, k_pages, v_pages must share one dtype; got {q.dtype}, "
                         f"{k_pages.dtype}, {v_pages.dtype}")
    allowed = ((torch.float16, torch.float32) if _INTERPRET
               else (torch.float16, torch.bfloat16, torch.float32))
    if q.dtype not in allowed:
        extra = (" (bfloat16 needs a GPU: the interpreter's bf16 tl.dot is wrong)"
                 if q.dtype == torch.bfloat16 else "")
        raise ValueError(f"dtype {q.dtype} is not supported; use one of "
                         f"{[str(a) for a in allowed]}{extra}")
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must hold integers (torch.int32); got {t.dtype}")
    devices = {t.device for t in (q, k_pages, v_pages, block_tables, seq_lens)}
    if len(devices) > 1:
        raise ValueError(f"all inputs must be on one device; got {sorted(map(str, devices))}")
    if _INTERPRET and q.device.type != "cpu":
        raise ValueError("the Triton interpreter is on (TRITON_INTERPRET=1): tensors must be on "
                         f"the CPU, not {q.device}")
    if not _INTERPRET and q.device.type != "cuda":
        raise ValueError(f"tensors are on {q.device} but Triton is compiling for the GPU; move "
                         "them to CUDA, or set TRITON_INTERPRET=1 before importing helpers")
    if (not _INTERPRET and q.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(q.device) < (8, 0)):
        raise ValueError("bfloat16 needs an Ampere (sm_80) or newer GPU; use float16")
    B, H, d = q.shape
    H_kv = k_pages.shape[2]
    if k_pages.shape[3] != d:
        raise ValueError(f"q {tuple(q.shape)} and k_pages {tuple(k_pages.shape)} must agree on d "
                         "(the last dim)")
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim d={d} is not supported; use one of {SUPPORTED_HEAD_DIMS}")
    if H_kv < 1 or H % H_kv:
        raise ValueError(f"query heads H={H} must be a multiple of key/value heads H_kv={H_kv}")
    if block_tables.dim() != 2 or block_tables.shape[0] != B:
        raise ValueError(f"block_tables must be [B, max_blocks] with B={B}; "
                         f"got {tuple(block_tables.shape)}")
    if tuple(seq_lens.shape) != (B,):
        raise ValueError(f"seq_lens must be [B] with B={B}; got {tuple(seq_lens.shape)}")
    if B * H_kv > 65535:
        raise ValueError(f"B * H_kv = {B * H_kv} exceeds 65535, the limit of the grid's 2nd axis")


def _check_values(k_pages, block_tables, seq_lens) -> int:
    """Raise ValueError unless every seq_len fits its table and every block a sequence uses exists;
    return the longest seq_len. Reads seq_lens and block_tables on the host (a GPU sync)."""
    n_blocks, page = k_pages.shape[:2]
    lens = seq_lens.to("cpu", torch.int64)
    table = block_tables.to("cpu", torch.int64)
    if lens.numel() and int(lens.min()) < 0:
        b = int(lens.argmin())
        raise ValueError(f"seq_lens[{b}] = {int(lens[b])} is negative")
    capacity = table.shape[1] * page
    if lens.numel() and int(lens.max()) > capacity:
        b = int(lens.argmax())
        raise ValueError(f"seq_lens[{b}] = {int(lens[b])} needs {math.ceil(int(lens[b]) / page)} "
                         f"blocks of {page}, but block_tables has {table.shape[1]} per sequence")
    used = torch.arange(table.shape[1])[None, :] < ((lens + page - 1) // page)[:, None]
    bad = used & ((table < 0) | (table >= n_blocks))
    if bool(bad.any()):
        b, j = bad.nonzero()[0].tolist()
        raise ValueError(f"block_tables[{b}, {j}] = {int(table[b, j])} is not a block of k_pages "
                         f"(n_blocks = {n_blocks}), and sequence {b} uses it")
    return int(lens.max()) if lens.numel() else 0


def _launch_split(q, k_pages, v_pages, block_tables, seq_lens, part_out, part_lse,
                  n_splits: int, scale: float, max_len: int) -> None:
    B, H, d = q.shape
    H_kv, page = k_pages.shape[2], k_pages.shape[1]
    group = H // H_kv
    use_dot = group >= DOT_MIN_GROUP
    kernel = _split_kernel(_INTERPRET, "dot" if use_dot else "broadcast")
    extra = {"BLOCK_N": INTERPRETER_BLOCK_N} if _INTERPRET else {}
    # the autotuner keeps one choice per bucket of chunk length (a power of 2, at most 8192)
    bucket = min(8192, triton.next_power_of_2(max(1, math.ceil(max_len / n_splits))))
    kernel[(n_splits, B * H_kv)](
        q, k_pages, v_pages, block_tables, seq_lens, part_out, part_lse, scale * LOG2E,
        *q.stride(), *k_pages.stride(), *v_pages.stride(), *block_tables.stride(),
        *part_out.stride(), *part_lse.stride(),
        H_kv, group, n_splits, bucket,
        HEAD_DIM=d, PAGE_SIZE=page, GROUP_PAD=_group_pad(group, use_dot), USE_DOT=use_dot,
        DOT_PRECISION=_dot_precision(q.dtype), **extra,
    )


def _prepare(q, k_pages, v_pages, block_tables, seq_lens, n_splits, check_values: bool):
    """Check the inputs; return (n_splits, longest sequence or the tables' capacity)."""
    _check_inputs(q, k_pages, v_pages, block_tables, seq_lens)
    if check_values:
        max_len = _check_values(k_pages, block_tables, seq_lens)
    else:
        max_len = block_tables.shape[1] * k_pages.shape[1]
    if n_splits is None:
        n_splits = default_n_splits(q.shape[0], k_pages.shape[2], max_len, sm_count(q.device))
    if isinstance(n_splits, bool) or not isinstance(n_splits, int) or not 1 <= n_splits <= 1024:
        raise ValueError(f"n_splits must be an int from 1 to 1024 (or None); got {n_splits!r}")
    return n_splits, max_len


def paged_decode_splits(q, k_pages, v_pages, block_tables, seq_lens, n_splits: int | None = None,
                        sm_scale: float | None = None, *, check_values: bool = True):
    """The split kernel alone -> ``(partials [n_splits, B, H, d], lse [n_splits, B, H])``, both
    float32: chunk c's output normalised within the chunk and its log-sum-exp (natural log);
    an empty chunk gives partial 0 and lse -inf. ``merge_partials(partials, lse)[0]`` (notebook
    07) or :func:`merge_splits_triton` combine them."""
    n_splits, max_len = _prepare(q, k_pages, v_pages, block_tables, seq_lens, n_splits,
                                 check_values)
    B, H, d = q.shape
    part_out = torch.empty((n_splits, B, H, d), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((n_splits, B, H), dtype=torch.float32, device=q.device)
    if B:
        _launch_split(q, k_pages, v_pages, block_tables, seq_lens, part_out, part_lse, n_splits,
                      _scale(d, sm_scale), max_len)
    return part_out, part_lse


def merge_splits_triton(partials: torch.Tensor, lse: torch.Tensor,
                        dtype: torch.dtype | None = None) -> torch.Tensor:
    """partials ``[n_splits, B, H, d]``, lse ``[n_splits, B, H]`` (float32) -> out ``[B, H, d]`` in
    ``dtype`` (default float32), by the Triton merge kernel: equal to ``merge_partials``."""
    n_splits, B, H, d = partials.shape
    if tuple(lse.shape) != (n_splits, B, H):
        raise ValueError(f"lse must be [n_splits, B, H] = {[n_splits, B, H]}; "
                         f"got {list(lse.shape)}")
    out = torch.empty((B, H, d), dtype=dtype or torch.float32, device=partials.device)
    if B * H:
        _merge_splits[(B * H,)](
            partials, lse, out, *partials.stride(), *lse.stride(), *out.stride(), H, n_splits,
            HEAD_DIM=d, SPLITS_PAD=triton.next_power_of_2(n_splits),
        )
    return out


def paged_decode_triton(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        n_splits: int | None = None, sm_scale: float | None = None, *,
                        check_values: bool = True) -> torch.Tensor:
    """One decode step over a paged cache: q ``[B, H, d]``, k_pages / v_pages ``[n_blocks,
    block_size, H_kv, d]``, block_tables ``[B, max_blocks]``, seq_lens ``[B]`` (int32) -> out
    ``[B, H, d]`` in q's dtype: sequence b's query head h attends, with scale ``sm_scale``
    (default 1/sqrt(d)), to keys 0..seq_lens[b]-1 of kv head ``h // (H // H_kv)``; 0 when
    seq_lens[b] = 0.

    ``n_splits`` chunks per sequence (default :func:`default_n_splits`); with 1 the split kernel
    writes ``out`` directly and no merge runs. ``check_values=False`` skips the checks that read
    seq_lens and block_tables on the host (a GPU sync per step, which a serving loop avoids); the
    default split count then assumes sequences as long as the tables allow."""
    n_splits, max_len = _prepare(q, k_pages, v_pages, block_tables, seq_lens, n_splits,
                                 check_values)
    B, H, d = q.shape
    out = torch.empty((B, H, d), dtype=q.dtype, device=q.device)
    if not B:
        return out
    scale = _scale(d, sm_scale)
    if n_splits == 1:  # one chunk: it is the answer, written in q's dtype
        lse = torch.empty((1, B, H), dtype=torch.float32, device=q.device)
        _launch_split(q, k_pages, v_pages, block_tables, seq_lens, out[None], lse, 1, scale,
                      max_len)
        return out
    part_out = torch.empty((n_splits, B, H, d), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((n_splits, B, H), dtype=torch.float32, device=q.device)
    _launch_split(q, k_pages, v_pages, block_tables, seq_lens, part_out, part_lse, n_splits,
                  scale, max_len)
    _merge_splits[(B * H,)](
        part_out, part_lse, out, *part_out.stride(), *part_lse.stride(), *out.stride(), H,
        n_splits, HEAD_DIM=d, SPLITS_PAD=triton.next_power_of_2(n_splits),
    )
    return out


def gather_cache(k_pages: torch.Tensor, v_pages: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each sequence's keys and values, contiguous: lists of ``[H_kv, seq_len, d]`` tensors (what
    SDPA reads; the tests' and the bench's reference)."""
    page = k_pages.shape[1]
    ks, vs = [], []
    for b, n in enumerate(seq_lens.tolist()):
        blocks = block_tables[b, : math.ceil(n / page)].long()
        ks.append(k_pages[blocks].flatten(0, 1)[:n].transpose(0, 1))
        vs.append(v_pages[blocks].flatten(0, 1)[:n].transpose(0, 1))
    return ks, vs
