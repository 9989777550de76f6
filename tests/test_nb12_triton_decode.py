"""Notebook 12, split-KV decoding over a paged KV cache in Triton (helpers/nb12_triton_decode.py):
the split and merge kernels against SDPA on the same sequences gathered into a contiguous cache,
their input checks, the program-count helpers, the lesson parts the notebook prints; then exercise
12.4 (helpers/checks/nb12_triton_decode.py): learner-style wrong kernels its check must reject,
with the hint each must give (WRONG), and correct ones in other styles it must accept (RIGHT).

Without a CUDA GPU everything runs in Triton's interpreter, so sequences are short and each axis
(d, dtype, GQA / MQA / MHA, ragged lengths, empty chunks, shuffled blocks, both score paths) is
covered by a few cases rather than by the full product; the slow marker holds the rest.

The caches come from :func:`helpers.checks.nb12_triton_decode.paged_case`: shuffled block ids, a
spare block or two, and NaN wherever a correct kernel never reads (the block the tables' padding
entries point to, the slots after each sequence's last key), so a stray read shows as NaN.
Tolerances against SDPA in float32: fp32 1e-5 (true fp32 arithmetic, only the summation order
differs); fp16 2e-3 (the weights are rounded to fp16 before P @ V, and the output too).
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

from helpers.checks.nb12_triton_decode import decode64, paged_case
from helpers.nb07_kv_cache import merge_partials
from tests.exercise_cases import assert_accepted, assert_rejected, right_cases, wrong_cases

try:
    from helpers import nb12_triton_decode as td  # turns on the interpreter without a CUDA GPU

    triton, tl = td.triton, td.tl  # imported there, after the interpreter switch
except ImportError:  # macOS / Windows: no Triton
    td = triton = tl = None

needs_triton = pytest.mark.skipif(td is None, reason="Triton is Linux-only")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def cache(B, H, H_kv, d, lens, page, dtype=torch.float32, seed=0, shuffle=True):
    """A poisoned paged cache on DEVICE (see the module docstring)."""
    c = paged_case(B, H, H_kv, d, lens, page, seed=seed, shuffle=shuffle, dtype=dtype)
    return [c[n].to(DEVICE) for n in ("q", "k_pages", "v_pages", "block_tables", "seq_lens")]


def sdpa_reference(q, k_pages, v_pages, block_tables, seq_lens, sm_scale=None):
    """torch's SDPA per sequence on its gathered, contiguous cache, in float32 -> [B, H, d]."""
    ks, vs = td.gather_cache(k_pages, v_pages, block_tables, seq_lens)
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b, (k, v) in enumerate(zip(ks, vs)):
        if k.shape[1]:
            o = F.scaled_dot_product_attention(q[b, :, None].float(), k.float(), v.float(),
                                               scale=sm_scale, enable_gqa=True)
            out[b] = o[:, 0]
    return out


def assert_matches_sdpa(out, args, dtype, sm_scale=None):
    ref = sdpa_reference(*args, sm_scale=sm_scale)
    assert out.dtype == dtype and out.shape == ref.shape
    assert not out.isnan().any(), "NaN: a stray read of the poisoned cache, or an empty chunk"
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


# =============================================================== the kernels

# (B, H, H_kv, d, lens, page, n_splits, dtype): lengths 1, multiples of the block size and not,
# 0; chunks empty where n_splits exceeds the blocks; GQA (dot path), MQA, MHA (broadcast path).
KERNEL_CASES = [
    (3, 8, 2, 64, [37, 16, 1], 8, 3, torch.float16),  # GQA 4
    (2, 4, 4, 32, [50, 0], 16, 2, torch.float32),  # MHA, a length 0
    (2, 4, 1, 128, [33, 3], 16, 8, torch.float32),  # MQA, empty chunks
    (1, 2, 2, 16, [5], 4, None, torch.float16),  # the default split count
    (2, 2, 1, 16, [64, 17], 16, 1, torch.float32),  # one chunk: no merge
]
SLOW_KERNEL_CASES = [
    (2, 8, 8, 16, [40, 7], 8, 5, torch.float16),
    (4, 4, 2, 32, [1, 2, 31, 32], 4, 2, torch.float16),
    (1, 16, 2, 64, [130], 32, 4, torch.float32),
    (2, 6, 3, 64, [48, 49], 16, 3, torch.float32),  # a group of 2
    (2, 8, 2, 128, [0, 0], 16, 4, torch.float16),  # nothing at all to read
    (1, 4, 1, 32, [200], 64, 16, torch.float16),  # pages larger than a tile
]


@needs_triton
@pytest.mark.parametrize("B, H, H_kv, d, lens, page, n_splits, dtype", [
    *KERNEL_CASES, *(pytest.param(*c, marks=pytest.mark.slow) for c in SLOW_KERNEL_CASES)])
def test_paged_decode_matches_sdpa(B, H, H_kv, d, lens, page, n_splits, dtype):
    args = cache(B, H, H_kv, d, lens, page, dtype, seed=len(lens) + d)
    out = td.paged_decode_triton(*args, n_splits=n_splits)
    assert_matches_sdpa(out, args, dtype)


# make test keeps min_group=64, the broadcast product for groups of 2 and 1 (test_paged_decode_matches_sdpa
# takes tl.dot, the default for every group).
@needs_triton
@pytest.mark.parametrize("min_group", [pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow),
                                       64])
def test_both_score_paths_and_an_explicit_scale(min_group, monkeypatch):
    """tl.dot (the group padded to 16 rows) and the broadcast product (a group of 2 rows, or of
    1 under min_group=2) give the same answer."""
    monkeypatch.setattr(td, "DOT_MIN_GROUP", min_group)
    for H_kv in (2, 4):
        args = cache(2, 4, H_kv, 32, [21, 40], 8, seed=3)
        out = td.paged_decode_triton(*args, n_splits=2, sm_scale=0.3)
        assert_matches_sdpa(out, args, torch.float32, sm_scale=0.3)


@needs_triton
def test_splits_merge_like_notebook_07():
    """The split kernel's partials and lse, merged by merge_partials (notebook 07) or by the
    Triton merge kernel, give SDPA's answer; empty chunks are 0 with lse -inf, never NaN."""
    args = cache(2, 4, 2, 16, [9, 0], 4, seed=4)
    parts, lse = td.paged_decode_splits(*args, n_splits=4)
    assert parts.shape == (4, 2, 4, 16) and lse.shape == (4, 2, 4) and lse.dtype == torch.float32
    assert not parts.isnan().any() and not lse.isnan().any()
    assert (lse[:, 1] == float("-inf")).all() and (parts[:, 1] == 0).all()  # seq_len 0
    merged, _ = merge_partials(parts, lse)
    torch.testing.assert_close(merged, sdpa_reference(*args), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(td.merge_splits_triton(parts, lse), merged, atol=1e-6, rtol=1e-6)
    # each chunk's lse is the log-sum-exp of its own scores (here chunk 0: keys 0..15 -> 0..8)
    q, k_pages, _, table, lens = args
    keys = td.gather_cache(k_pages, args[2], table, lens)[0][0]  # [H_kv, 9, d]
    s = torch.einsum("hd,hnd->hn", q[0], keys.repeat_interleave(2, 0)) / 4
    torch.testing.assert_close(lse[0, 0], torch.logsumexp(s, -1), atol=1e-5, rtol=1e-5)


@needs_triton
def test_strided_inputs_and_int64_tables():
    """q a strided view, the pages a view of a larger tensor, the tables int64."""
    q, k, v, table, lens = cache(2, 4, 2, 32, [19, 30], 8, seed=5)
    wide_q = torch.randn(2, 4, 64, device=DEVICE)[..., :32]
    wide_q.copy_(q)
    k2 = torch.cat([k, torch.zeros_like(k)], dim=2)[:, :, :2]
    args = [wide_q, k2, v, table.long(), lens.long()]
    assert_matches_sdpa(td.paged_decode_triton(*args, n_splits=2), args, torch.float32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_and_long_sequences_on_gpu():
    for dtype, lens, n_splits in ((torch.bfloat16, [3000, 17], None), (torch.float16, [5000], 40)):
        args = cache(len(lens), 32, 8, 128, lens, 16, dtype, seed=6)
        assert_matches_sdpa(td.paged_decode_triton(*args, n_splits=n_splits), args, dtype)


# =============================================================== input checks


@needs_triton
def test_rejects_bad_inputs_with_one_line():
    q, k, v, table, lens = cache(2, 4, 2, 16, [9, 4], 4, seed=7)
    bad = {
        "q must be [B, H, d]": (q[:, :, None], k, v, table, lens),
        "k_pages and v_pages must have the same shape": (q, k, v[:, :2], table, lens),
        "must share one dtype": (q.half(), k, v, table, lens),
        "dtype torch.float64 is not supported": (q.double(), k.double(), v.double(), table, lens),
        "must agree on d": (q[..., :8], k, v, table, lens),
        "head dim d=8 is not supported": (q[..., :8], k[..., :8], v[..., :8], table, lens),
        "must be a multiple of key/value heads": (q[:, :3], k, v, table, lens),
        "block_tables must be [B, max_blocks]": (q, k, v, table[:1], lens),
        "seq_lens must be [B]": (q, k, v, table, lens[:1]),
        "block_tables must hold integers": (q, k, v, table.float(), lens),
        "q must be a torch.Tensor": (q.tolist(), k, v, table, lens),
        "needs 5 blocks of 4, but block_tables has 4": (q, k, v, table, torch.tensor(
            [17, 4], dtype=torch.int32, device=DEVICE)),
        "is negative": (q, k, v, table, torch.tensor([-1, 4], dtype=torch.int32, device=DEVICE)),
        "is not a block of k_pages": (q, k, v, torch.where(table == table[0, 0], 99, table), lens),
    }
    if td._INTERPRET:
        bad["bfloat16 needs a GPU"] = (q.bfloat16(), k.bfloat16(), v.bfloat16(), table, lens)
    for message, args in bad.items():
        with pytest.raises(ValueError, match=re.escape(message)) as info:
            td.paged_decode_triton(*args)
        assert "\n" not in str(info.value)
    for n_splits in (0, 2.0, True):
        with pytest.raises(ValueError, match="n_splits must be an int"):
            td.paged_decode_triton(q, k, v, table, lens, n_splits=n_splits)


@needs_triton
def test_padding_entries_may_hold_anything():
    """Entries past a sequence's blocks are never read, checked or not: -1 and huge ones too."""
    q, k, v, table, lens = cache(2, 4, 2, 16, [9, 4], 4, seed=8)
    junk = table.clone()
    junk[0, 3], junk[1, 1:] = -1, 2**30
    for check in (True, False):
        out = td.paged_decode_triton(q, k, v, junk, lens, n_splits=2, check_values=check)
        assert_matches_sdpa(out, (q, k, v, table, lens), torch.float32)


# =============================================================== counting programs


def test_program_counts_and_the_default_split():
    assert td.flash_decode_programs(1, 32) == 32 and td.split_kv_programs(1, 8, 16) == 128
    assert td.GPU_SM_COUNTS["H100 SXM"] == 132 and td.GPU_SM_COUNTS["A100"] == 108
    assert td.GPU_SM_COUNTS["L4"] == 58 and td.GPU_SM_COUNTS["T4"] == 40
    sms = 132
    # one sequence, 8 kv heads, long context: 32 splits of 2,048 keys, 256 programs in one wave
    assert td.default_n_splits(1, 8, 65536, sms) == 32
    assert td.split_waves(1, 8, 65536, 32, sms) == (2048, 256, 1)
    # a batch that fills the GPU on its own needs no split
    assert td.default_n_splits(64, 32, 65536, sms) == 1
    assert td.default_n_splits(1, 132, 65536, sms) == 1
    # short sequences: no chunk shorter than MIN_KEYS_PER_SPLIT
    assert td.default_n_splits(1, 8, 600, sms) == math.ceil(600 / td.MIN_KEYS_PER_SPLIT)
    assert td.default_n_splits(1, 1, 10**7, sms) == td.MAX_SPLITS
    assert td.default_n_splits(1, 8, 0, sms) == 1 and td.default_n_splits(0, 8, 4096, sms) == 1
    # the signature of before still works: positional (..., sms, resident, min_keys)
    assert td.default_n_splits(1, 8, 65536, sms, 2, 4096) == 16
    if td._INTERPRET:
        assert td.sm_count() == td.INTERPRETER_SMS


# ------------------------------------------------ the split count against whole waves of SMs

# The decode grid of bench/bench_decode.py (H = 32, d = 128) and the H200's SMs.
GRID = [(B, H_kv, T) for B in (1, 8, 32) for H_kv in (8, 32) for T in (1024, 4096, 16384, 65536)]
H200_SMS = 132


def rule_before_waves(batch, kv_heads, max_seq_len, sms):
    """default_n_splits before it counted waves: enough splits for 4 programs per SM, at least
    256 keys a chunk, at most 128 splits (what the recorded H200 run used)."""
    if batch * kv_heads >= sms:
        return 1
    return max(1, min(math.ceil(4 * sms / (batch * kv_heads)), math.ceil(max_seq_len / 256), 128))


def last_wave_fill(batch, kv_heads, max_seq_len, n_splits, sms=H200_SMS):
    """Programs over the slots of the waves they take, in the model (1.0: whole waves)."""
    _, programs, waves = td.split_waves(batch, kv_heads, max_seq_len, n_splits, sms)
    return programs / (waves * sms * td.RESIDENT)


@needs_triton
def test_the_recorded_split_counts_are_the_rule_before_waves():
    """The H200 run (helpers/results/nvidia-h200-decode.csv) used rule_before_waves: 9 splits at
    B = 8 / H_kv = 8 (576 programs), 17 at B = 1 / H_kv = 32 (544)."""
    import csv

    from helpers.package_data import RESULTS, package_file

    with package_file(RESULTS, "nvidia-h200-decode.csv").open() as f:
        recorded = {(int(r["B"]), int(r["H_kv"]), int(r["T"])): int(r["n_splits"])
                    for r in csv.DictReader(f) if r["impl"] == "course"}
    assert recorded == {cell: rule_before_waves(*cell, H200_SMS) for cell in GRID}
    assert recorded[8, 8, 65536] == 9 and recorded[1, 32, 65536] == 17


@needs_triton
@pytest.mark.parametrize("B, H_kv, T", [(8, 8, 16384), (8, 8, 65536), (1, 32, 65536)])
def test_the_h200_cells_no_longer_spill_into_one_more_wave(B, H_kv, T):
    """The cells at 0.85-0.90x SDPA in the recorded run: 576 and 544 programs on 132 SMs, just past
    4 per SM, a third wave of 2 per SM only 18% / 6% full. Now 256 programs, one wave 97% full."""
    before = rule_before_waves(B, H_kv, T, H200_SMS)
    assert td.split_kv_programs(B, H_kv, before) in (576, 544)
    assert last_wave_fill(B, H_kv, T, before) < 0.75
    n = td.default_n_splits(B, H_kv, T, H200_SMS)
    chunk, programs, waves = td.split_waves(B, H_kv, T, n, H200_SMS)
    assert (n, programs, waves) == ({8: 4, 32: 8}[H_kv], 256, 1) and chunk * n == T
    assert last_wave_fill(B, H_kv, T, n) > 0.95
    assert td.split_cost(B, H_kv, T, n, H200_SMS) < 0.8 * td.split_cost(B, H_kv, T, before, H200_SMS)


@needs_triton
def test_no_cell_of_the_decode_grid_gets_worse_waves():
    """Every (B, H_kv, T) the bench times, by the model: the new count costs no more than the one
    before, and its waves are at least as full; 1 split where B * H_kv fills the SMs, as before."""
    for B, H_kv, T in GRID:
        n, before = td.default_n_splits(B, H_kv, T, H200_SMS), rule_before_waves(B, H_kv, T, H200_SMS)
        assert td.split_cost(B, H_kv, T, n, H200_SMS) <= td.split_cost(B, H_kv, T, before, H200_SMS)
        assert last_wave_fill(B, H_kv, T, n) >= last_wave_fill(B, H_kv, T, before) - 1e-9, (B, H_kv, T)
        if B * H_kv >= H200_SMS:
            assert n == before == 1


@needs_triton
def test_the_split_model_prefers_fewer_splits_on_ties_and_rejects_bad_input():
    # 32 and 33 splits of 65,536 keys both make chunks of 2,048 (whole tiles), 256 programs with
    # work: the same cost without a merge price, and the fewer splits win
    assert td.split_cost(1, 8, 65536, 32, 132, merge_keys=0) == td.split_cost(1, 8, 65536, 33, 132, merge_keys=0)
    assert td.default_n_splits(1, 8, 65536, 132, merge_keys=0) == 32
    # a wave's start counts: at B * H_kv = 128, 2 splits (one wave 97% full), not 41 (20 waves 99%)
    assert td.split_waves(16, 8, 65536, 41, 132)[1:] == (5248, 20)
    assert td.default_n_splits(16, 8, 65536, 132) == 2
    # chunks in whole tiles: 66 splits of 65,536 keys are 64 chunks of 1,024 and 2 empty ones
    assert td.split_waves(1, 8, 65536, 66, 132) == (1024, 512, 2)
    # more resident programs per SM: more splits fit one wave
    assert td.default_n_splits(1, 8, 65536, 132, resident=4) == 64
    with pytest.raises(ValueError, match="sms and resident must be at least 1"):
        td.default_n_splits(1, 8, 4096, 0)
    with pytest.raises(ValueError, match="resident=0"):
        td.default_n_splits(1, 8, 4096, 132, resident=0)


@needs_triton
def test_resident_programs_are_what_every_dot_config_holds():
    """RESIDENT (programs per SM the model counts on) is at most what the registers and shared
    memory of every tl.dot configuration allow on sm_80 and sm_90, by the committed decode report
    (helpers/results/kernel_aot_decode.json), and is reached on sm_80 at d = 128 (BLOCK_N = 128)."""
    from helpers.package_data import RESULTS, package_file
    from helpers.tools.kernel_report import read_report

    rows = [r for r in read_report(package_file(RESULTS, "kernel_aot_decode.json"))
            if r["kernel"] == "split" and r["path"] == "dot"]
    assert {r["target"] for r in rows} == {"sm_80", "sm_90"}
    assert min(r["programs_per_sm"] for r in rows) == td.RESIDENT
    assert min(r["programs_per_sm"] for r in rows if r["target"] == "sm_90") > td.RESIDENT
    assert td.MODEL_TILE in {block_n for block_n, _, _ in td.GPU_CONFIGS["dot"]}


@needs_triton
@pytest.mark.parametrize("kernel, parts", [
    ("_paged_decode_split", ["program-ids", "chunk", "page-lookup", "scores", "online-softmax",
                             "epilogue"]),
    ("_merge_splits", ["merge"]),
])
def test_lesson_parts_exist(kernel, parts):
    for part in parts:
        text = td.lesson_part(getattr(td, kernel), part)
        assert text.strip() and td.LESSON_MARK not in text


# =============================================================== exercise 12.4

WRONG: dict[str, list] = {}
RIGHT: dict[str, list] = {}

if td is not None:

    @triton.jit
    def _learner_split(
        Q, K, V, BT, SL, PO, PL, sm_scale, stride_qb, stride_qh, stride_kb, stride_ks, stride_kh,
        stride_tb, H, GROUP, N_SPLITS, MAX_BLOCKS,
        HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, SCALE: tl.constexpr, TABLE: tl.constexpr,
        END_OFF: tl.constexpr, KV_MOD: tl.constexpr, NORMALISE: tl.constexpr,
        GUARD_EMPTY: tl.constexpr, GRID: tl.constexpr, EXP2: tl.constexpr = False,
        RESCALE: tl.constexpr = True, FLOOR: tl.constexpr = False, LSE_M: tl.constexpr = False,
        UNMASKED: tl.constexpr = False, SCORE_0: tl.constexpr = False, SPLIT_TABLE: tl.constexpr = False,
    ):
        """A learner's split kernel: one program per (split, query head), one page per
        iteration, exp (not exp2), a broadcast product; mistakes switched on by the flags."""
        if GRID == 0:
            split = tl.program_id(0)
            bh = tl.program_id(1)
        else:
            split = tl.program_id(1)
            bh = tl.program_id(0)
        b = bh // H
        h = bh % H
        kvh = h // GROUP
        if KV_MOD:
            kvh = h % (H // GROUP)
        offs_s = tl.arange(0, PAGE)
        offs_d = tl.arange(0, HEAD_DIM)
        seq_len = tl.load(SL + b)
        n_pages = seq_len // PAGE if FLOOR else tl.cdiv(seq_len, PAGE)
        per = tl.cdiv(n_pages, N_SPLITS)
        first = split * per
        last = tl.minimum(first + per, n_pages)
        q = tl.load(Q + b * stride_qb + h * stride_qh + offs_d).to(tl.float32)
        m = tl.full([1], float("-inf"), tl.float32)
        l_sum = tl.zeros([1], tl.float32)
        acc = tl.zeros([HEAD_DIM], tl.float32)
        for p in range(first, last):
            if SPLIT_TABLE:  # the split's pages read from the table's first entries
                blk = tl.load(BT + b * stride_tb + (p - first))
            elif TABLE:
                blk = tl.load(BT + b * stride_tb + p)
            else:
                blk = b * MAX_BLOCKS + p
            pos = p * PAGE + offs_s
            ok = pos < seq_len + END_OFF
            rows = blk * stride_kb + offs_s[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :]
            if UNMASKED:  # every slot of the page, its score kept
                k = tl.load(K + rows).to(tl.float32)
                v = tl.load(V + rows).to(tl.float32)
            else:
                k = tl.load(K + rows, mask=ok[:, None], other=0.0).to(tl.float32)
                v = tl.load(V + rows, mask=ok[:, None], other=0.0).to(tl.float32)
            s = tl.sum(q[None, :] * k, 1)
            if SCALE:
                s = s * sm_scale
            if not (UNMASKED or SCORE_0):
                s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 0))
            if EXP2:
                w = tl.exp2(s - m_new)
                alpha = tl.exp2(m - m_new)
            else:
                w = tl.exp(s - m_new)
                alpha = tl.exp(m - m_new)
            if not RESCALE:
                alpha = tl.full([1], 1.0, tl.float32)
            l_sum = l_sum * alpha + tl.sum(w, 0)
            acc = acc * alpha + tl.sum(w[:, None] * v, 0)
            m = m_new
        if UNMASKED:
            acc = tl.where(l_sum > 0, acc, 0.0)  # NaN > 0 is False too: the NaN read becomes 0
        if GUARD_EMPTY:
            lse = tl.where(l_sum > 0, m + tl.log(tl.where(l_sum > 0, l_sum, 1.0)), float("-inf"))
            l_sum = tl.where(l_sum > 0, l_sum, 1.0)
        else:
            lse = m + tl.log(l_sum)
        if LSE_M:
            lse = m
        if NORMALISE:
            acc = acc / l_sum
        out_at = (split * tl.num_programs(1 - GRID) + bh) * HEAD_DIM
        tl.store(PO + out_at + offs_d, acc)
        tl.store(PL + split * tl.num_programs(1 - GRID) + bh + tl.arange(0, 1), lse)

    @triton.jit
    def _learner_merge(PO, PL, Out, N_SPLITS, BH, HEAD_DIM: tl.constexpr):
        """A learner's merge kernel: one program per (sequence, head), a loop over the splits."""
        bh = tl.program_id(0)
        offs_d = tl.arange(0, HEAD_DIM)
        top = tl.full([1], float("-inf"), tl.float32)
        for c in range(0, N_SPLITS):
            top = tl.maximum(top, tl.load(PL + c * BH + bh + tl.arange(0, 1)))
        top = tl.where(top == float("-inf"), 0.0, top)
        total = tl.zeros([1], tl.float32)
        acc = tl.zeros([HEAD_DIM], tl.float32)
        for c in range(0, N_SPLITS):
            w = tl.exp(tl.load(PL + c * BH + bh + tl.arange(0, 1)) - top)
            total += w
            acc += w * tl.load(PO + (c * BH + bh) * HEAD_DIM + offs_d)
        acc = acc / tl.where(total > 0, total, 1.0)
        tl.store(Out + bh * HEAD_DIM + offs_d, acc.to(Out.dtype.element_ty))

    def _torch_merge(parts, lse, how):
        if how == "course":
            return merge_partials(parts, lse)[0]
        if how == "mean":
            return parts.sum(0) / parts.shape[0]
        top = lse.amax(0)
        if how == "hand":
            top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
        w = torch.exp(lse - top)
        return (w[..., None] * parts).sum(0) / w.sum(0).clamp_min(1e-30)[..., None]

    def _learner(name, merge="course", out_fp32=False, grid=0, ignore_splits=False, scale_of_d=None, **flags):
        """A learner's launcher: the split kernel, then a merge in PyTorch or in Triton
        (``ignore_splits``: always one chunk, one program per (sequence, query head); grid 1: the
        axes swapped, the grid given as a function of the launch's arguments)."""
        meta = dict(SCALE=True, TABLE=True, END_OFF=0, KV_MOD=False, NORMALISE=True,
                    GUARD_EMPTY=True, GRID=grid)
        meta.update(flags)

        def paged_decode_triton(q, k_pages, v_pages, block_tables, seq_lens, n_splits=None,
                                sm_scale=None):
            B, H, d = q.shape
            page, H_kv = k_pages.shape[1], k_pages.shape[2]
            n_splits = 1 if ignore_splits else n_splits or 2
            scale = sm_scale if sm_scale is not None else 1 / math.sqrt(d)
            if scale_of_d is not None:
                scale = scale_of_d(d, scale)
            parts = torch.empty((n_splits, B, H, d), dtype=torch.float32, device=q.device)
            lse = torch.empty((n_splits, B, H), dtype=torch.float32, device=q.device)
            k_pages, v_pages = k_pages.contiguous(), v_pages.contiguous()
            grid_ = (n_splits, B * H) if grid == 0 else lambda meta: (B * H, meta["N_SPLITS"])
            _learner_split[grid_](
                q.contiguous(), k_pages, v_pages, block_tables.contiguous(), seq_lens, parts, lse,
                scale, H * d, d, k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
                block_tables.shape[1], H, H // H_kv, n_splits, block_tables.shape[1],
                HEAD_DIM=d, PAGE=page, **meta)
            if merge == "triton":
                out = torch.empty_like(q)
                _learner_merge[(B * H,)](parts, lse, out, n_splits, B * H, HEAD_DIM=d)
                return out
            out = _torch_merge(parts, lse, merge)
            return out if out_fp32 else out.to(q.dtype)

        paged_decode_triton.__name__ = name
        return paged_decode_triton

    def decode_in_pytorch(q, k_pages, v_pages, block_tables, seq_lens, n_splits=None,
                          sm_scale=None):
        return decode64(q, k_pages, v_pages, block_tables, seq_lens, sm_scale).to(q.device, q.dtype)

    def decode_gathers_in_pytorch(q, k_pages, v_pages, block_tables, seq_lens, n_splits=None,
                                  sm_scale=None):
        """Gathers the pages in PyTorch, then runs the learner's kernel over an identity table."""
        B, max_blocks = block_tables.shape
        ident = torch.arange(B * max_blocks, dtype=torch.int32).view(B, max_blocks)
        k2 = k_pages[block_tables.long().clamp_max(k_pages.shape[0] - 1)].flatten(0, 1)
        v2 = v_pages[block_tables.long().clamp_max(k_pages.shape[0] - 1)].flatten(0, 1)
        return _learner("x")(q, k2.view(-1, *k_pages.shape[1:]), v2.view(-1, *k_pages.shape[1:]),
                             ident.to(q.device), seq_lens, n_splits, sm_scale)

    WRONG["paged_decode_triton"] = [
        (_learner("decode_no_sm_scale", SCALE=False), "the scores are not scaled"),
        (_learner("decode_ignores_block_table", TABLE=False), "instead of through its block table"),
        (_learner("decode_reads_key_seq_len", END_OFF=1), "not part of the sequence"),
        (_learner("decode_gqa_head_mod", KV_MOD=True), "reads the wrong kv head"),
        (_learner("decode_unnormalised", NORMALISE=False), "the output is not normalised"),
        (_learner("decode_merge_mean", merge="mean"), "without their log-sum-exp weights"),
        (_learner("decode_empty_chunk_nan", GUARD_EMPTY=False), "some chunks are empty here"),
        (_learner("decode_merge_nan_for_length_0", merge="unguarded"), "a sequence of length 0"),
        (_learner("decode_out_float32", out_fp32=True), "expected dtype torch.float16"),
        (_learner("decode_ignores_n_splits", ignore_splits=True),
         "must split each sequence's keys"),
        (_learner("decode_masked_keys_score_0", SCORE_0=True), "kept their score q . 0 = 0"),
        (_learner("decode_unmasked_last_page", UNMASKED=True), "your output is 0 for exactly the sequences"),
        (_learner("decode_scale_one_over_d", scale_of_d=lambda d, s: 1 / d), "your scores are scaled by 1 / d"),
        (_learner("decode_log2e_then_exp", scale_of_d=lambda d, s: s * 1.4426950408889634),
         "but took tl.exp"),
        (_learner("decode_exp2_natural", EXP2=True), "2^(s - m) is the softmax of s * ln 2"),
        (_learner("decode_no_rescale", RESCALE=False), "must be rescaled by alpha = exp(m - m_new)"),
        (_learner("decode_floor_pages", FLOOR=True), "skipped the partly filled last page"),
        (_learner("decode_lse_is_m", LSE_M=True), "you stored m (the chunk's max score)"),
        (_learner("decode_split_table_from_entry_0", merge="triton", SPLIT_TABLE=True),
         "each split read its pages from the block table's first entries"),
        (decode_in_pytorch, "no Triton kernel ran"),
        (decode_gathers_in_pytorch, "gathered the cache through the block table in PyTorch"),
    ]
    def gather_with_the_course_helper(pages, block_table, seq_len):
        table, lens = block_table[None], torch.tensor([seq_len])
        return td.gather_cache(pages, pages, table, lens)[0][0]

    def merge_with_the_course_kernel(outs, lses):
        n, lead, d = outs.shape[0], outs.shape[1:-1], outs.shape[-1]
        out = td.merge_splits_triton(outs.reshape(n, 1, -1, d).float(),
                                     lses.reshape(n, 1, -1).float())
        return out.reshape(*lead, d).to(outs.dtype), torch.logsumexp(lses, dim=0)

    WRONG["gather_paged_kv"] = [(gather_with_the_course_helper, "called the course's own solution")]
    WRONG["merge_partials"] = [(merge_with_the_course_kernel, "called the course's own solution")]
    RIGHT["paged_decode_triton"] = [
        _learner("decode_page_loop_merge_partials"),
        _learner("decode_grid_swapped_hand_merge", merge="hand", grid=1),
        _learner("decode_triton_merge", merge="triton"),
    ]

# make test keeps the first two wrong kernels (decode_reads_key_seq_len and decode_gqa_head_mod, the
# next two, run the same comparison and mistake models), one of each other kind (the launches counted,
# no kernel at all, the cache gathered in PyTorch, the course's helpers called) and the first right one.
_FAST_WRONG = {"decode_no_sm_scale", "decode_ignores_block_table", "decode_in_pytorch", "decode_gathers_in_pytorch",
               "decode_ignores_n_splits", "gather_with_the_course_helper", "merge_with_the_course_kernel"}


def _mark_slow(params, fast):
    return [p if p.id.split("-", 1)[1] in fast else pytest.param(*p.values, marks=pytest.mark.slow,
                                                                   id=p.id) for p in params]


@needs_triton
@pytest.mark.parametrize(("name", "wrong", "hint"), _mark_slow(wrong_cases(WRONG), _FAST_WRONG))
def test_check_rejects_wrong(name, wrong, hint):
    assert_rejected(name, wrong, hint)


@needs_triton
@pytest.mark.parametrize(("name", "right"), _mark_slow(right_cases(RIGHT),
                                                       {"decode_page_loop_merge_partials"}))
def test_check_accepts_right(name, right):
    assert_accepted(name, right)


@needs_triton
@pytest.mark.slow  # make test: test_machinery's test_reference_passes[paged_decode_triton] runs the same check
def test_check_accepts_the_course_kernel():
    from helpers import checks, reference

    assert checks.paged_decode_triton.evaluate(reference.paged_decode_triton).passed


def test_exercise_registered_as_a_bonus():
    from helpers.checks import EXERCISES

    ex = EXERCISES["paged_decode_triton"]
    assert (ex.id, ex.bonus, ex.points, ex.notebook) == ("12.4", True, 3, "12_serving")
