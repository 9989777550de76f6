"""Checks for notebook 12_serving: exercises 12.1 (reading a sequence from a paged cache), 12.2
(merging partial softmax results) and 12.3 (the block allocator's accounting).

Every case, its expected output and the outputs of the recognised mistakes are computed before
the learner's function runs. 12.1: no two of block_size, H_kv, d and seq_len are equal; seq_len is
not a multiple of block_size (except in one case, where floor and ceil agree and only the padding
can go wrong); block ids are neither contiguous nor sorted; tables carry padding (-1, a valid id
that must still be ignored, or ids beyond the pool: n_blocks + 5, and 2**31 - 1 in an int32 table);
two int32 tables. 12.2: chunks with lse -inf (their outs hold finite garbage), rows where every
chunk is empty, rows whose lses lie far apart (near 130, 0 and -130: exp overflows in some,
underflows in others, and one max for the whole tensor empties the rows far below it), lses near
200, one chunk only; mistakes that show in some rows only are recognised row by row. 12.3: streams
of events where each modelled mistake gives another count: forks of a partly filled and of a full
last block, appends that must copy and appends that must not, frees of shared blocks; the
learner's function runs on every prefix of every stream, and a mistake is named only when one of
its allocator models gives every one of those counts. (A needless copy of a block no other
sequence holds cannot change the count, so it is not detected: see :func:`blocks_in_use`.)
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from .. import nb12_serving as ref
from ..registry import in_module
from .core import Trial, _to_float, describe_case, draw, eager_mistakes, exercise, seeded
from .feedback import LearnerError, Mistake, describe
from .guard import _equal, _isclose, _isfinite, _isnan, _issubclass, _Tensor, _type

__all__ = in_module(__name__)  # its exercises' checks, as helpers/registry.py lists them


# =========================================================================== 12.1 gather_paged_kv

_IGNORED_TABLE = Mistake(
    "ignored-block-table", "you read blocks 0, 1, 2, ... in order: a sequence's blocks are wherever the "
    "allocator found free ones, so read block block_table[i] for positions i * block_size .. (i + 1) * "
    "block_size - 1.")
_SORTED_TABLE = Mistake(
    "sorted-block-table", "you sorted the block ids: the table's order is the sequence's order (entry i holds "
    "positions i * block_size ...), whatever the ids are; keep it as it is.")
_FLOOR = Mistake(
    "floor-not-ceil", "you read seq_len // block_size blocks and lost the partly filled last one: a sequence "
    "of seq_len tokens spans ceil(seq_len / block_size) blocks, (seq_len + block_size - 1) // block_size.")
_NOT_TRUNCATED = Mistake(
    "last-block-not-truncated", "you returned every slot of the last block: it is filled only up to "
    "seq_len, the slots after it hold stale data; keep the first seq_len positions.")
_ALL_ENTRIES = Mistake(
    "padding-entries-read", "you read every entry of block_table: only the first ceil(seq_len / block_size) "
    "entries belong to the sequence, the rest is padding (-1 indexes the last block in PyTorch, so no "
    "error warns you).")
_TOKEN_MAJOR = Mistake(
    "token-major-layout", "you returned [seq_len, H_kv, d]: the cache's layout is [H_kv, seq_len, d] (notebook "
    "07's, one sequence of it): transpose the first two axes.")
_RESHAPED = Mistake(
    "reshape-instead-of-transpose", "you reshaped [seq_len, H_kv, d] into [H_kv, seq_len, d], which keeps the "
    "numbers in memory order and mixes heads and positions: swap the axes with .transpose(0, 1).")
_SHIFTED = Mistake(
    "shifted-by-one-position", "you read positions 1 .. seq_len: a sequence's tokens are "
    "positions 0 .. seq_len - 1, position p in block block_table[p // block_size] at slot "
    "p % block_size (the first slot of the first block is position 0).",
    "read positions 1..seq_len instead of 0..seq_len-1")
_BEYOND_POOL = Mistake(
    "padding-beyond-the-pool", "index the pool with the first ceil(seq_len / block_size) entries "
    "of block_table only: the rest is padding, which may be -1 or beyond the pool.",
    "indexed the pool with padding entries of the block table")
_TABLE_OFF_BY_ONE = Mistake(
    "table-entry-off-by-one", "you read the positions of block i from entry i + 1 (or i - 1) of block_table: "
    "entry 0 holds positions 0 .. block_size - 1, so position p is in block block_table[p // block_size].",
    "read each block of positions from the next (or previous) entry of the block table")
_CONTIGUOUS = Mistake(
    "assumed-contiguous-blocks", "you read blocks block_table[0], block_table[0] + 1, block_table[0] + 2, ...: "
    "a sequence's blocks are wherever the allocator found free ones, not consecutive; read block "
    "block_table[i] for positions i * block_size .. (i + 1) * block_size - 1.",
    "read consecutive blocks from the table's first id instead of each entry of the table")
_CONTIGUOUS_SLICE = Mistake(
    "assumed-contiguous-blocks", "you sliced blocks block_table[0], block_table[0] + 1, ... out of the pool "
    "(pages[first:first + n]): a sequence's blocks are wherever the allocator found free ones, not "
    "consecutive (and the slice stops at the pool's end); read block block_table[i] for positions "
    "i * block_size .. (i + 1) * block_size - 1.",
    "read consecutive blocks from the table's first id instead of each entry of the table")
_REVERSED_TABLE = Mistake(
    "blocks-in-reverse-order", "you read the blocks of the table from the last one to the first: entry i of "
    "block_table holds positions i * block_size .. (i + 1) * block_size - 1, in the table's order.",
    "read the sequence's blocks in reverse order")
_FLAT_NOT_SCALED = Mistake(
    "flat-index-not-times-block-size", "in the flattened pool (pages.reshape(-1, H_kv, d), n_blocks * "
    "block_size rows) block b starts at row b * block_size: you used row block_id + slot. The row of "
    "position p is block_table[p // block_size] * block_size + p % block_size.",
    "indexed the flattened pool with block_id + slot (the block id not multiplied by block_size)")
_FLAT_SWAPPED = Mistake(
    "flat-index-block-and-slot-swapped", "you used row slot * block_size + block_id of the flattened pool: "
    "block and slot are swapped. The row of position p is block_table[p // block_size] * block_size + "
    "p % block_size.",
    "indexed the flattened pool with slot * block_size + block_id")
_FLAT_PAST_END = Mistake(
    "flat-index-past-the-pool", "your row index into the flattened pool (n_blocks * block_size rows) went "
    "past its end: the row of position p is block_table[p // block_size] * block_size + p % block_size, "
    "with p < seq_len.",
    "indexed the flattened pool past its end (a wrong row formula)")
_BS_FROM_POOL = Mistake(
    "block-size-from-pool-size", "your block size is pages.shape[0], the number of blocks in the pool: "
    "pages is [n_blocks, block_size, H_kv, d], so block_size = pages.shape[1].",
    "took the block size from pages.shape[0] (the pool's number of blocks)")
_GATHER_RECIPE = ("n = (seq_len + block_size - 1) // block_size with block_size = pages.shape[1]; "
                  "blocks = pages[block_table[:n].long()]   # [n, block_size, H_kv, d]; "
                  "return blocks.reshape(-1, H_kv, d)[:seq_len].transpose(0, 1)")
_AXES_H, _AXES_T = ("H_kv", "seq_len", "d"), ("seq_len", "H_kv", "d")


def _reshaped_mistake(order: tuple[str, ...]) -> Mistake:
    """The mistake of moving the axes to ``order`` and reshaping to [H_kv, seq_len, d]."""
    return Mistake("reshaped-to-the-wrong-axes", f"you had the axes in the order [{', '.join(order)}] and "
                   "reshaped them to [H_kv, seq_len, d]: reshape keeps the numbers in memory order and mixes "
                   "heads, positions and features. Move axes with .transpose / .permute only: the gathered "
                   "blocks are [seq_len, H_kv, d] after reshape(-1, H_kv, d), and .transpose(0, 1) makes them "
                   "[H_kv, seq_len, d].",
                   "reshaped an array with other axes into [H_kv, seq_len, d] instead of permuting")


def _axes_mistake(order: tuple[str, ...]) -> Mistake:
    """The mistake of returning the right numbers with the axes in ``order``."""
    return Mistake("axes-in-another-order", f"you returned [{', '.join(order)}]: the layout is [H_kv, seq_len, d] "
                   "(notebook 07's cache, one sequence of it). Move the axes with .permute / .transpose: the "
                   "gathered blocks are [seq_len, H_kv, d] after reshape(-1, H_kv, d), and .transpose(0, 1) "
                   "makes them [H_kv, seq_len, d].",
                   "returned the keys with their axes in another order")


def _unambiguous(models: dict[str, Any]) -> dict[str, Any]:
    """``models`` without those whose output another mistake's model also gives on this case (a
    match there could not say which mistake it was)."""
    keys = list(models)
    out = {}
    for i, h in enumerate(keys):
        w = models[h]
        slug = getattr(h, "slug", str(h))
        if any(_same(w, models[o]) for o in keys if getattr(o, "slug", str(o)) != slug):
            continue  # another mistake gives this output too
        if any(_same(w, models[o]) for o in keys[:i] if getattr(o, "slug", str(o)) == slug):
            continue  # the same mistake written another way, kept once
        out[h] = w
    return out


def _same(a: Any, b: Any) -> bool:
    if _type(a) is _Tensor and _type(b) is _Tensor:
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if not a.is_floating_point():
            return bool(_equal(a, b))
        return (a.shape == b.shape and a.dtype == b.dtype
                and bool(_isclose(a.double(), b.double(), atol=1e-5, rtol=1e-4, equal_nan=True).all()))
    return False


def _gather_mistakes(pages: torch.Tensor, table: torch.Tensor, seq_len: int) -> dict[str, torch.Tensor]:
    n_blocks, bs, H_kv, d = pages.shape
    n = -(-seq_len // bs)
    ids = table[:n].long()
    tbl = table.long()
    pos = torch.arange(seq_len)
    blk, slot = pos // bs, pos % bs
    flat = pages.reshape(-1, H_kv, d)

    def tokens(block_ids) -> torch.Tensor:  # [len * bs, H_kv, d]
        return pages[block_ids].reshape(-1, H_kv, d)

    def shifted() -> torch.Tensor:  # positions 1 .. seq_len, each through the table
        p = torch.arange(1, seq_len + 1)
        return pages[table[p // bs].long(), p % bs].transpose(0, 1)

    def at_blocks(block_of_pos: torch.Tensor) -> torch.Tensor:  # [H_kv, seq_len, d]
        if bool((block_of_pos >= n_blocks).any()) or bool((block_of_pos < -n_blocks).any()):
            raise IndexError("this mistake reads past the pool here")
        return pages[block_of_pos, slot].transpose(0, 1)

    def at_rows(rows: torch.Tensor) -> torch.Tensor:
        return flat[rows % flat.shape[0]].transpose(0, 1)

    right = tokens(ids)[:seq_len].transpose(0, 1)
    models = {
        _IGNORED_TABLE: lambda: tokens(torch.arange(n))[:seq_len].transpose(0, 1),
        _SORTED_TABLE: lambda: tokens(ids.sort().values)[:seq_len].transpose(0, 1),
        _FLOOR: [lambda: tokens(ids[:seq_len // bs])[:seq_len].transpose(0, 1),
                 lambda: tokens(ids[:max(1, seq_len // bs)])[:seq_len].transpose(0, 1)],
        _NOT_TRUNCATED: lambda: tokens(ids).transpose(0, 1),
        _ALL_ENTRIES: lambda: tokens(table.long()).transpose(0, 1),
        _TOKEN_MAJOR: lambda: tokens(ids)[:seq_len],
        _RESHAPED: lambda: tokens(ids)[:seq_len].reshape(H_kv, seq_len, d),
        _SHIFTED: lambda: shifted(),
        _TABLE_OFF_BY_ONE: lambda: at_blocks(tbl[blk + 1]),
        _CONTIGUOUS: lambda: at_blocks((tbl[0] + blk) % n_blocks),
        _CONTIGUOUS_SLICE: lambda: pages[int(tbl[0]) % n_blocks:int(tbl[0]) % n_blocks + n].reshape(
            -1, H_kv, d)[:seq_len].transpose(0, 1),
        _REVERSED_TABLE: lambda: at_blocks(ids.flip(0)[blk]),
        _FLAT_NOT_SCALED: lambda: at_rows(tbl[blk] + slot),
        _FLAT_SWAPPED: lambda: at_rows(slot * bs + tbl[blk]),
    }
    for perm in ((0, 2, 1), (2, 1, 0), (1, 2, 0), (2, 0, 1)):  # the right numbers, the axes in another order
        order = tuple(_AXES_H[i] for i in perm)
        models[_axes_mistake(order)] = lambda p=perm: right.permute(p)
    for source, names in ((right, _AXES_H), (right.transpose(0, 1), _AXES_T)):
        for perm in ((0, 2, 1), (1, 0, 2), (1, 2, 0), (2, 0, 1), (2, 1, 0), (0, 1, 2)):
            order = tuple(names[i] for i in perm)
            if order in (_AXES_H, _AXES_T):
                continue  # the right output, or notebook 07's reshape mistake (_RESHAPED)
            models.setdefault(_reshaped_mistake(order), (lambda x=source, p=perm: x.permute(p).reshape(H_kv, seq_len, d)))
    out = _unambiguous({h: w for h, w in _agreed(models).items() if not _same(w, right)})
    # Kept where another mistake gives the same output (floor-not-ceil, say): the cases where the two
    # differ refute the one the learner did not make.
    pool_bs = _agreed({_BS_FROM_POOL: lambda: pages[table[:-(-seq_len // n_blocks)].long()].reshape(
        -1, H_kv, d)[:seq_len].transpose(0, 1)})
    return out | {h: w for h, w in pool_bs.items() if not _same(w, right)}


def _agreed(models: dict[str, Any]) -> dict[str, Any]:
    """Each mistake's output on this case (:func:`eager_mistakes`); a mistake with several variants
    (a list of models: ways of writing it that differ on some cases) has one only where they agree."""
    out = {}
    for h, m in models.items():
        variants = list(eager_mistakes({f"v{i}": v for i, v in enumerate(m if isinstance(m, list) else [m])}).values())
        if variants and all(_same(variants[0], v) for v in variants[1:]):
            out[h] = variants[0]
    return out


def _gather_fact(got: Any, pages: torch.Tensor, table: torch.Tensor, seq_len: int,
                 expected: torch.Tensor) -> tuple[str, str] | None:
    """Where each position of ``got`` was read from, when every position is one slot of the pool:
    (what differs, the first wrong position and the blocks read, in the learner's terms); else None."""
    if not (_type(got) is _Tensor and got.shape == expected.shape and got.dtype == expected.dtype
            and got.device == expected.device):
        return None
    n_blocks, bs, H_kv, d = pages.shape
    rows = pages.reshape(-1, H_kv * d).double()
    cols = got.detach().transpose(0, 1).reshape(seq_len, H_kv * d).double()
    source = []
    for p in range(seq_len):
        hit = (rows == cols[p]).all(dim=1).nonzero().flatten().tolist()
        if len(hit) != 1:
            return None
        source.append(divmod(hit[0], bs))
    wrong = [p for p in range(seq_len) if source[p] != (int(table[p // bs]) % n_blocks, p % bs)]
    if not wrong:
        return None
    p = wrong[0]
    b, s = source[p]
    read = []
    for blk, _ in source:
        if not read or read[-1] != blk:
            read.append(blk)
    return (f"keys: {len(wrong)} of your {seq_len} positions (axis 1) hold other keys than expected, the first "
            f"at position {p}.", f"every position of your output is one slot of the pool, but position {p} holds "
            f"block {b}, slot {s}; "
            f"it is in block block_table[{p} // {bs}] = {int(table[p // bs])}, slot {p} % {bs} = {p % bs}. "
            f"Your positions 0..{seq_len - 1} read blocks {', '.join(map(str, read[:8]))}"
            f"{', ...' if len(read) > 8 else ''} in turn; the table's first {-(-seq_len // bs)} entries are "
            f"{', '.join(str(int(x)) for x in table[:-(-seq_len // bs)])}.")


def _gather_cases() -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """(pages, block_table, seq_len)."""
    out = []
    specs = [  # (n_blocks, block_size, H_kv, d, seq_len, table, dtype)
        (9, 4, 3, 5, 10, [7, 2, 5, -1, -1], torch.float32),          # -1 padding, last block half full
        (8, 3, 2, 6, 9, [4, 0, 6, 1], torch.float32),                # a multiple of 3; a valid id as padding
        (12, 5, 4, 3, 13, [11, 3, 8, 0, 0, 0], torch.float64),       # padding with block 0
        (6, 8, 2, 7, 1, [5, 2], torch.float32),                      # one token
        (7, 3, 2, 4, 8, [6, 1, 3, 12, 12], torch.float32),           # padding beyond the pool
        (7, 4, 2, 3, 8, [3, 6, 9], torch.float32),                   # a multiple of 4, then padding
    ]  # beyond the pool: seq_len // block_size + 1 blocks read one that is not in it (issue 32)
    for i, (n_blocks, bs, H_kv, d, seq_len, table, dtype) in enumerate(specs):
        g = seeded(1200 + i)
        pages = torch.randn(n_blocks, bs, H_kv, d, generator=g, dtype=dtype)
        out.append((pages, torch.tensor(table), seq_len))
    # an int32 table (what a kernel reads), then one drawn from a seed: the blocks a random
    # permutation of the pool, the table padded with -1
    g = seeded(1210)
    pages = torch.randn(10, 6, 3, 4, generator=g)
    out.append((pages, torch.tensor([9, 1, 4, 6, -1], dtype=torch.int32), 20))
    g = seeded(1212)  # int32 padding far beyond the pool (what a table of another pool may hold)
    pages = torch.randn(8, 4, 2, 3, generator=g)
    out.append((pages, torch.tensor([5, 0, 7, 2**31 - 1], dtype=torch.int32), 11))
    g = seeded(1211)
    bs, H_kv, d = draw(g, 2, 9), draw(g, 1, 5), draw(g, 2, 9)
    n_blocks = draw(g, 4, 16)
    seq_len = draw(g, 1, n_blocks * bs + 1)
    n = -(-seq_len // bs)
    table = torch.randperm(n_blocks, generator=g)[:n].tolist() + [-1] * draw(g, 0, 3)
    out.append((torch.randn(n_blocks, bs, H_kv, d, generator=g), torch.tensor(table), seq_len))
    return out


@exercise()
def gather_paged_kv(t: Trial) -> None:
    t.forbidden_references = {"gather_paged_kv", "read", "gather_cache"}
    hints = {
        r"takes \d+ positional argument|missing \d+ required positional argument": "the signature is "
        "gather_paged_kv(pages, block_table, seq_len).",
        r"tensors used as indices must be long|IndexError: tensors used as indices": "index with an integer "
        "tensor: block_table may be int32 (as a kernel reads it); .long() converts it.",
        r"shape '\[.*\]' is invalid for input of size": "count the blocks with a ceiling: ceil(seq_len / "
        "block_size) of them hold the sequence, and the last one is cut at seq_len.",
    }
    planned = [((pages, table, n), ref.gather_paged_kv(pages, table, n), _gather_mistakes(pages, table, n))
               for pages, table, n in _gather_cases()]
    for (pages, table, n), expected, mistakes in planned:
        case = (f"{describe_case(pages=pages)}, block_table={table.tolist()} "
                f"({str(table.dtype).removeprefix('torch.')}), seq_len={n}")
        t.error_hints = {**_index_hints(pages, table, n), **hints}
        got = t.call(pages, table, n, case=case)
        matched = t._match_mistake(got, mistakes) if _type(got) is _Tensor else ""
        fact = None if matched or t._pending is not None else _gather_fact(got, pages, table, n, expected)
        if fact:
            t.fail(fact[0], found=fact[1], recipe=_GATHER_RECIPE, what="values")
        t.tensor(got, expected, what="keys", mistakes=mistakes, hint=_GATHER_RECIPE, atol=0, rtol=0)


def _index_hints(pages: torch.Tensor, table: torch.Tensor, seq_len: int) -> dict[str, str]:
    """The IndexErrors of this case: an index that is a padding entry of the table (or the first row
    of a padding entry's block in the flattened pool), another index past the flattened pool."""
    n_blocks, bs = pages.shape[:2]
    n = -(-seq_len // bs)
    padding = sorted({int(x) for x in table[n:]} - set(range(-n_blocks, n_blocks)))
    rows = sorted({b * bs + s for b in padding for s in range(bs)})
    out = {}
    if padding:
        out[rf"index ({'|'.join(map(str, padding))}) is out of bounds for dimension 0 with size {n_blocks}\b"] = _BEYOND_POOL
    if rows:
        out[rf"index ({'|'.join(map(str, rows[:64]))}) is out of bounds for dimension 0 with size "
            rf"{n_blocks * bs}\b"] = _BEYOND_POOL
    out[rf"index -?\d+ is out of bounds for dimension 0 with size {n_blocks * bs}\b"] = _FLAT_PAST_END
    out[rf"index -?\d+ is out of bounds for dimension 0 with size {n_blocks}\b"] = (
        f"a block id past the pool: pages holds blocks 0..{n_blocks - 1}, and position p is in block "
        "block_table[p // block_size] (only the first ceil(seq_len / block_size) entries of the table are "
        "the sequence's).")
    return out


# =========================================================================== 12.2 merge_partials

_NAIVE = Mistake(
    "no-max-subtraction", "exp(lse) overflowed: a chunk's log-sum-exp can be in the hundreds (exp(89) is "
    "already inf in float32). Subtract the largest lse of the row first (the online softmax of notebook 09): "
    "weights exp(lse_c - m) / sum_c exp(lse_c - m).")
_EMPTY_NAN = Mistake(
    "nan-for-all-empty-rows", "a row whose chunks are all empty gave NaN: its max is -inf and -inf - (-inf) = "
    "NaN. Subtract a finite stand-in there (torch.where(torch.isfinite(m), m, 0), notebook 03's "
    "finite_or_zero); then every weight is exp(-inf) = 0, out is 0 and lse = log(0) = -inf.")
_EMPTY_LSE_ZERO = Mistake(
    "lse-zero-for-all-empty-rows", "a row whose chunks are all empty must keep lse = -inf (nothing was "
    "attended, the sum of exp is 0 and its log -inf); you returned 0 there. A later merge would then give "
    "this empty row all the weight.")
_FINITE_FILL = Mistake(
    "finite-fill-for-empty-chunks", "you replaced -inf by a large finite number: where every chunk is empty "
    "they then all get the same weight, out becomes their mean and lse a large negative number. An empty "
    "chunk has weight exactly 0, and a row with nothing attended has out 0 and lse -inf.")
_MEAN = Mistake(
    "mean-of-chunks", "you averaged the chunks' outputs: each chunk weighs by its share of the softmax's "
    "denominator, exp(lse_c - lse), not equally.")
_MEAN_NONEMPTY = Mistake(
    "mean-of-non-empty-chunks", "you averaged the outputs of the non-empty chunks: skipping the "
    "empty ones is right, but each chunk weighs by its share of the softmax's denominator, "
    "exp(lse_c - lse), not equally (a chunk of large scores outweighs the others).",
    "averaged the non-empty chunks' outputs instead of weighting them by exp(lse_c - lse)")
_UNNORMALISED = Mistake(
    "unnormalised-weights", "you weighted the chunks by exp(lse_c - m) without dividing by their sum: the "
    "weights exp(lse_c - lse) must sum to 1 (lse = m + log sum_c exp(lse_c - m)).")
_INVERTED_WEIGHTS = Mistake(
    "weights-inverted", "your weights are e^(lse - lse_c), upside down: chunk c's weight is its share of the "
    "softmax's denominator, e^(lse_c - lse) (at most 1, and 0 for an empty chunk, lse_c = -inf), so out = "
    "sum_c e^(lse_c - lse) * outs_c.", "weighted the chunks by e^(lse - lse_c) instead of e^(lse_c - lse)")
_INVERTED_WEIGHTS_MAX = Mistake(
    "weights-inverted", "your weights are e^(m - lse_c), upside down (m the row's largest lse): chunk c's "
    "weight is e^(lse_c - m) / sum_c' e^(lse_c' - m) = e^(lse_c - lse), at most 1, and 0 for an empty chunk.",
    "weighted the chunks by e^(lse - lse_c) instead of e^(lse_c - lse)")
_LSE_MAX = Mistake(
    "lse-is-the-max", "the merged lse is the log-sum-exp of the chunks' lses, logsumexp_c lse_c, not their "
    "max: it is the log of the sum of every chunk's denominators.")
_WRONG_AXIS = Mistake(
    "merged-over-the-wrong-axis", "the chunks are along axis 0 (outs [n_chunks, ..., d], lses [n_chunks, ...]): "
    "take the softmax and the log-sum-exp of the lses over dim=0.")
_SWAPPED_12 = Mistake("swapped-out-and-lse", "you returned (lse, out): the order is (out, lse).")

_GLOBAL_MAX = Mistake(
    "one-max-for-all-rows", "you subtracted one maximum for the whole tensor: in rows whose lses lie far below "
    "it (here 100 or more) every exp(lse_c - m) underflows to 0, so those rows lose their output and their "
    "lse. Take the max per row, over the chunk axis only: m = lses.amax(dim=0).",
    "subtracted one maximum over the whole tensor instead of each row's")
_EXP2 = Mistake(
    "exp2-of-natural-logs", "you weighted the chunks with exp2 (powers of 2) while the lses are natural "
    "logarithms: use torch.exp (and torch.log for the merged lse), or multiply by log2(e) = 1.4427 before "
    "exp2 and divide log2 by it.",
    "used exp2/log2 on natural-log lses")
_LSE_BASE2 = Mistake(
    "lse-in-base-2", "your merged lse is a base-2 log-sum-exp (log2 of a sum of powers of 2): the lses are "
    "natural logarithms, lse = m + log(sum_c exp(lse_c - m)) with torch.exp and torch.log.",
    "computed the merged lse with log2/exp2")
_LSE_NO_MAX = Mistake(
    "lse-without-the-max", "your lse is log(sum_c exp(lse_c - m)): the max m you subtracted must be added "
    "back, lse = m + log(sum_c exp(lse_c - m)) (torch.logsumexp(lses, dim=0) does both).",
    "forgot to add the max back to the merged lse")
_EMPTY_AS_ZERO = Mistake(
    "empty-chunks-given-lse-0", "you replaced the empty chunks' lse -inf by 0 (nan_to_num, or a fill with 0): "
    "an empty chunk has weight exp(-inf) = 0, but with lse 0 it gets weight exp(0 - m) and its garbage output "
    "enters the merge. Keep -inf in the lses and make only the max finite where a whole row is empty.",
    "gave the empty chunks lse 0 instead of -inf")

_MERGE_RECIPE = ("lse = torch.logsumexp(lses, dim=0); m = torch.where(torch.isfinite(lse), lse, 0); "
                 "w = torch.exp(lses - m)   # [n_chunks, ...], 0 for empty chunks; "
                 "return (w[..., None] * outs).sum(dim=0), lse")


def _right_merge(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    lse = torch.logsumexp(lses, dim=0)
    w = torch.exp(lses - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)))
    return (w[..., None] * outs).sum(0), lse


def _merge_mistakes(outs: torch.Tensor, lses: torch.Tensor) -> dict[str, dict[str, torch.Tensor]]:
    """The mistakes whose output does not depend on how the learner wrote the rest: models. Those
    that show only in some rows (all-empty rows, overflow, one max for all rows) are recognised by
    :func:`_merge_diagnosis`, row by row, whatever the other rows hold."""
    m = lses.max(dim=0).values
    m0 = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w0 = torch.exp(lses - m0)
    s0 = w0.sum(dim=0)
    right_out, right_lse = _right_merge(outs, lses)

    def normalised(w: torch.Tensor) -> torch.Tensor:
        s = w.sum(dim=0)[..., None]
        return torch.where(s > 0, (w[..., None] * outs).sum(dim=0) / torch.where(s > 0, s, 1), 0)

    zero_fill = lses.nan_to_num(neginf=0.0)
    out_models = eager_mistakes({
        _MEAN: lambda: outs.mean(dim=0),
        _UNNORMALISED: lambda: (w0[..., None] * outs).sum(dim=0),
        _WRONG_AXIS: lambda: normalised(torch.softmax(lses, dim=-1)),
        _SWAPPED_12: lambda: right_lse,
        _EXP2: lambda: normalised(torch.exp2(lses - m0)),
        _EMPTY_AS_ZERO: lambda: _right_merge(outs, zero_fill)[0],
        _INVERTED_WEIGHTS: lambda: (torch.exp(right_lse - lses)[..., None] * outs).sum(dim=0),
        _INVERTED_WEIGHTS_MAX: lambda: normalised(torch.exp(m0 - lses)),
    })
    lse_models = eager_mistakes({
        _LSE_MAX: lambda: m,
        _WRONG_AXIS: lambda: torch.logsumexp(lses, dim=-1),
        _SWAPPED_12: lambda: right_out,
        _LSE_BASE2: lambda: m0 + torch.log2(torch.exp2(lses - m0).sum(dim=0)),
        _LSE_NO_MAX: lambda: torch.log(s0),
        _EMPTY_AS_ZERO: lambda: torch.logsumexp(zero_fill, dim=0),
    })
    right = {"out": right_out, "lse": right_lse}
    return {k: _unambiguous({h: w for h, w in v.items() if not _same(w, right[k])})
            for k, v in (("out", out_models), ("lse", lse_models))}


_EMPTY_NAN_OUT = Mistake(
    "nan-out-for-all-empty-rows", "a row whose chunks are all empty gave NaN in out: there every lse is -inf, "
    "so subtracting the row's max (or its lse), -inf, gives -inf - (-inf) = NaN, and weights that are all 0 "
    "give 0 / 0 = NaN. Subtract a finite stand-in (torch.where(torch.isfinite(m), m, 0)) and divide by "
    "where(s > 0, s, 1): out is then 0 there, and lse = log(0) = -inf.",
    "out is NaN in rows where every chunk is empty")


def _merge_diagnosis(got: Any, expected: torch.Tensor, outs: torch.Tensor, lses: torch.Tensor,
                     what: str, lse_got: Any = None) -> str:
    """A mistake recognised row by row, or '': which rows are right and which are wrong says it.
    Rows (the positions of lses[0]) are: all-empty (every chunk's lse -inf); overflowing (exp of the
    row's largest lse is inf in this dtype) or underflowing (exp of every lse is 0); far below the
    largest lse of the whole tensor (exp(lse - global max) is 0); the others, ordinary."""
    if not (_type(got) is _Tensor and got.shape == expected.shape and got.dtype == expected.dtype
            and got.device == expected.device):
        return ""
    g, e = got.detach().to(torch.float64), expected.detach().to(torch.float64)
    lead = lses.shape[1:]
    rows_g = g.reshape(*lead, -1) if what == "out" else g.reshape(*lead, 1)
    rows_e = e.reshape(*lead, -1) if what == "out" else e.reshape(*lead, 1)
    ok = _isclose(rows_g, rows_e, atol=1e-5, rtol=1e-4, equal_nan=True).all(dim=-1)  # per row
    finite = _isfinite(lses)
    empty = ~finite.any(dim=0)
    row_max = lses.amax(dim=0)
    big, tiny = (88.0, -103.0) if lses.dtype != torch.float64 else (709.0, -744.0)
    top = float(lses[finite].max()) if bool(finite.any()) else 0.0
    naive = ~empty & ((row_max > big) | (row_max < tiny))             # exp(lse) inf, or 0 for every chunk
    far = ~empty & (row_max - top < tiny - 5)                           # exp(lse - global max) 0 for every chunk
    near = ~empty & (row_max - top > -60)
    rest = ~empty

    def only(wrong: torch.Tensor, right: torch.Tensor) -> bool:
        return bool(wrong.any()) and not bool(ok[wrong].any()) and bool(ok[right].all())

    if bool(empty.any()) and bool(ok[rest].all()):  # only the all-empty rows are wrong
        ge = rows_g[empty]
        if bool(_isnan(ge).all()):
            if what == "lse":
                return _EMPTY_NAN  # m + log(sum exp(lses - m)) with m = -inf
            lse_nan = (_type(lse_got) is _Tensor and lse_got.shape == lead
                       and bool(_isnan(lse_got.detach()[empty]).all()))
            return _EMPTY_NAN if lse_nan else _EMPTY_NAN_OUT
        if what == "lse" and bool((ge == 0).all()):
            return _EMPTY_LSE_ZERO
        if what == "lse" and bool(_isfinite(ge).all()) and bool((ge < -10).all()):
            return _FINITE_FILL
        if what == "out":
            uniform = outs.double().mean(dim=0).reshape(*lead, -1)[empty]
            if bool(_isclose(ge, uniform, atol=1e-5, rtol=1e-4).all()):
                return _FINITE_FILL
        return ""
    if only(naive, rest & ~naive):
        return _NAIVE
    if only(far, near):
        return _GLOBAL_MAX
    if what == "out":
        mean = (finite.to(torch.float64)[..., None] * outs.double()).sum(0) / finite.sum(0).clamp_min(1)[..., None]
        some = ~empty
        if (bool(some.any()) and _rows_close(g[some], mean[some])
                and not _rows_close(e[some], mean[some])):
            return _MEAN_NONEMPTY
    return ""


def _rows_close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return bool(_isclose(got, want, atol=1e-5, rtol=1e-4).all())


def _merge_cases() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(outs [n_chunks, ..., d], lses [n_chunks, ...]): empty chunks have lse -inf and finite
    garbage in their outs. The second case's rows lie far apart (lses near 130, near 0, near -130):
    exp(lse) overflows in some and underflows in others, and one max for the whole tensor leaves
    every weight 0 in the rows far below it."""
    out = []
    specs = [  # (seed, n_chunks, lead shape, d, lse scale, lse offset(s), dtype, a row with every chunk empty)
        (1220, 3, (2, 5), 4, 2.0, 0.0, torch.float32, False),     # ordinary lses, a few empty chunks
        (1231, 4, (6,), 5, 2.0, [130.0, 0.0, -130.0, 125.0, 10.0, -20.0], torch.float32, False),  # rows far apart
        (1221, 4, (3, 2), 6, 3.0, 200.0, torch.float32, True),    # lses near 200: exp overflows float32
        (1222, 5, (7,), 3, 4.0, -5.0, torch.float64, True),       # float64, many empty chunks
        (1223, 1, (2, 3), 5, 1.0, 0.0, torch.float32, False),     # one chunk: the merge changes nothing
    ]
    for seed, n, lead, d, scale, offset, dtype, all_empty in specs:
        g = seeded(seed)
        outs = torch.randn(n, *lead, d, generator=g, dtype=dtype)
        offset = torch.tensor(offset, dtype=dtype) if isinstance(offset, list) else offset
        lses = offset + scale * torch.randn(n, *lead, generator=g, dtype=dtype)
        empty = torch.rand(n, *lead, generator=g) < 0.3
        flat = empty.view(n, -1)
        if all_empty:
            flat[:, 0] = True                  # the first row: every chunk empty
        else:
            flat[0] = False                    # chunk 0 never empty: no row is all empty
        if n > 1:
            flat[1:, 1] = True                 # the second row: only chunk 0 attended
            flat[0, 1] = False
        out.append((outs, lses.masked_fill(empty, -math.inf)))
    g = seeded(1230)  # one drawn from a seed: 2-6 chunks of [B, H] rows
    n, B, H, d = draw(g, 2, 7), draw(g, 1, 4), draw(g, 1, 5), draw(g, 2, 9)
    lses = 5 * torch.randn(n, B, H, generator=g)
    lses = lses.masked_fill(torch.rand(n, B, H, generator=g) < 0.25, -math.inf)
    lses[:, 0, 0] = -math.inf
    out.append((torch.randn(n, B, H, d, generator=g), lses))
    return out


_NO_LAST_AXIS = Mistake(
    "weights-without-last-axis", "outs is [n_chunks, ..., d] and lses [n_chunks, ...]: the error pairs d with "
    "a size of lses, so the weights met outs without a last axis of size 1; multiply by w[..., None] (not "
    "w[:, None], which adds the axis after the chunks).",
    "multiplied outs by weights without a trailing axis of size 1")


def _merge_error_hints(outs: torch.Tensor, lses: torch.Tensor) -> dict[str, str]:
    """The broadcasting errors of this case, told apart by the sizes they name: d against a size of
    lses (the weights lack their last axis), or two sizes of lses' rows (tensors whose rows were
    reduced or indexed differently); anything else gets the shapes of the contract."""
    d, lead = outs.shape[-1], lses.shape[1:]
    sizes = sorted(set(lses.shape) - {d})
    rows = sorted(set(lead) - {d, lses.shape[0]})
    out = {}
    if sizes:
        one = "|".join(map(str, sizes))
        out[(rf"size of tensor a \(({one})\) must match the size of tensor b \({d}\)|size of tensor a "
             rf"\({d}\) must match the size of tensor b \(({one})\)")] = _NO_LAST_AXIS
    if len(rows) > 1:
        two = "|".join(map(str, rows))
        out[rf"size of tensor a \(({two})\) must match the size of tensor b \(({two})\)"] = Mistake(
            "reduced-over-another-axis", f"the two sizes in this error are both sizes of the rows of lses "
            f"[n_chunks, {', '.join(map(str, lead))}]: two of your tensors have their row axes in different "
            "places, as a max, sum or logsumexp over another axis than dim=0 leaves them. Reduce over dim=0 "
            f"(the chunks) every time: m, the sum of weights and lse are then all [{', '.join(map(str, lead))}].",
            "reduced over another axis than the chunks' (a shape error between row sizes)")
    out[r"must match the size of tensor b|The size of tensor a"] = (
        "the shapes do not line up: lses is [n_chunks, ...] and outs [n_chunks, ..., d]. Take the max, the sum "
        "and the logsumexp over dim=0 (the chunks), and give the weights a last axis (w[..., None]) to multiply "
        "outs.")
    return out


@exercise()
def merge_partials(t: Trial) -> None:
    t.forbidden_references = {"merge_partials", "split_k_decode", "paged_decode_split",
                              "merge_splits_triton"}
    signature = {r"takes \d+ positional argument|missing \d+ required positional argument": "the signature is "
                 "merge_partials(outs, lses), returning (out, lse)."}
    planned = []
    for outs, lses in _merge_cases():
        expected = ref.merge_partials(outs, lses)
        planned.append((outs, lses, expected, _merge_mistakes(outs, lses)))
    for outs, lses, (out, lse), mistakes in planned:
        t.error_hints = {**signature, **_merge_error_hints(outs, lses)}
        got = t.call(outs, lses, case=describe_case(outs=outs, lses=lses) + (
            ", some rows with every chunk empty" if bool(torch.isinf(lses).all(0).any()) else ""))
        got_out, got_lse = t.tuple(got, 2, ["out", "lse"])
        t.tensor(got_out, out, what="out", mistakes=mistakes["out"], hint=_MERGE_RECIPE,
                 diagnosis=_merge_diagnosis(got_out, out, outs, lses, "out", got_lse))
        t.tensor(got_lse, lse, what="lse", mistakes=mistakes["lse"], hint=_MERGE_RECIPE,
                 diagnosis=_merge_diagnosis(got_lse, lse, outs, lses, "lse"))


# =========================================================================== 12.3 blocks_in_use

_NO_PARTIAL = Mistake(
    "floor-not-ceil", "you counted full blocks only (n // block_size): a partly filled last block is a whole "
    "block taken from the free list; a sequence of n tokens holds ceil(n / block_size) blocks.")
_EXTRA_BLOCK = Mistake(
    "extra-block", "you gave a sequence n // block_size + 1 blocks: when n is a multiple of block_size the "
    "last block is exactly full and no extra one is needed; use ceil(n / block_size).")
_FRESH_APPEND = Mistake(
    "append-takes-fresh-blocks", "you gave every append ceil(n / block_size) fresh blocks: the new "
    "tokens first fill the free slots of the sequence's last block (copied first if it is shared), "
    "and a new block is taken only at a position p with p % block_size == 0.",
    "an append took ceil(n / block_size) fresh blocks, ignoring the last block's free slots")
_NOT_INT = Mistake(
    "count-not-an-int", "return int(...): the number of blocks is an int (a NumPy integer or a "
    "float that holds a whole number is not one).",
    "returned the count as a NumPy integer or a float, not an int")
_NO_SHARING = Mistake(
    "shared-prefix-counted-twice", "you counted a shared prefix once per sequence: a fork copies no block, "
    "the child's block table lists the parent's blocks (each gains a reference), and a block that several "
    "sequences hold is one physical block. Count the distinct blocks whose reference count is above 0, not "
    "the lengths of the block tables.")
_NO_COW = Mistake(
    "no-copy-on-write", "appending to a shared, partly filled last block must copy it first (copy-on-write): "
    "writing into it would change the other sequences' past. The copy is a new block.")
_COW_FULL = Mistake(
    "copy-of-a-full-block", "you copied a shared last block that was already full: nothing will be written "
    "into it again, so it stays shared and the new tokens simply start a fresh block. Copy only a partly "
    "filled shared block.")
_COW_LEAK = Mistake(
    "copy-keeps-the-reference", "after a copy-on-write the sequence no longer holds the original block: its "
    "reference count must drop by one, or it is never freed when the other sequences finish.")
_FREE_SHARED = Mistake(
    "freed-a-shared-block", "freeing a sequence returned blocks that other sequences still hold: decrement "
    "each block's reference count and free it only when the count reaches 0.")
_NEVER_FREED = Mistake(
    "free-ignored", "a finished sequence's blocks go back to the free list (those no other sequence holds): "
    "you kept counting them.")
_POOLED = Mistake(
    "pooled-tokens", "you divided the total number of tokens by block_size: every sequence has its own "
    "blocks, each with its own partly filled last block (and shared blocks count once).")

_PEAK = Mistake(
    "peak-not-final", "you returned the largest number of blocks held at any time: the count asked for is "
    "the one after the last event (frees give blocks back, so it can be lower than the peak).",
    "returned the peak count of blocks over the events, not the count after the last one")
_ALIASED_TABLE = Mistake(
    "fork-shares-the-list-object", "your fork gave the child the parent's list object itself (tables[c] = "
    "tables[s]): an append to one then changes the other's table too. The child's table is a new list with "
    "the same block ids, list(tables[s]) (each block's reference count + 1).",
    "the fork's child got the parent's table list object itself, not a copy")
_FORK_EMPTY = Mistake(
    "fork-child-length-0", "your fork started the child with length 0: the child holds the parent's tokens, "
    "so its length is the parent's, and its next token goes into the same (shared) last block, copied "
    "first if it is partly filled.",
    "the fork's child started with length 0 instead of the parent's length")
_COPY_AS_FULL = Mistake(
    "copy-treated-as-full", "after copying a shared, partly filled last block you took fresh blocks for all "
    "the new tokens: the copy holds the same tokens as the original, so its free slots (block_size - "
    "length % block_size) are still free; fill them first, then take a fresh block at each position p with "
    "p % block_size == 0.",
    "after a copy-on-write, treated the copied block as full")

_COPY_AT_FORK = Mistake(
    "copied-at-the-fork", "your fork copied the parent's partly filled last block at once: a fork takes no "
    "block (the child shares all of the parent's blocks); the copy is made only when one of them appends "
    "into that shared block (copy-on-write), and not at all if neither does.",
    "copied the partly filled last block at the fork instead of at the first append")

_FULL_HAS_ROOM = Mistake(
    "full-block-has-room", "your appends put tokens into a full last block: when length % block_size == 0 the "
    "last block has no free slot (block_size - length % block_size gives block_size there; (block_size - "
    "length % block_size) % block_size gives 0), so the next token starts a fresh block.",
    "an append treated a full last block as having block_size free slots")
_FORK_NO_REF = Mistake(
    "fork-adds-no-reference", "your fork gave the child the parent's blocks without adding a reference to "
    "each: a shared block then looks held by one sequence, so an append writes into it without a copy, and "
    "freeing either sequence returns blocks the other still holds. Each block in the child's table gains a "
    "reference (ref[b] += 1).", "a fork shared the parent's blocks without adding a reference to each")

_BLOCKS_RECIPE = ("keep tables {seq: [block ids]}, lengths {seq: n} and ref {block: count}; new: "
                  "ceil(n / block_size) fresh blocks; append: if length % block_size and ref[last] > 1, "
                  "replace the last block by a fresh copy (ref[last] -= 1), then a fresh block whenever a "
                  "position p % block_size == 0; fork: the child gets the parent's list, ref += 1 each; free: "
                  "ref -= 1 each; return how many blocks have ref > 0.")

_BLOCKS_FOR = {
    "ceil": lambda n, bs: -(-n // bs),
    "floor": lambda n, bs: n // bs,
    "floor-min-1": lambda n, bs: max(1, n // bs),
    "plus-one": lambda n, bs: n // bs + 1,
}


def _trace(events, bs: int, *, blocks: str = "ceil", append: str = "table", fork: str = "share",
           child_len: str = "parent", cow: str = "partial", cow_decref: bool = True, after_copy: str = "fill",
           free: str = "ref", count: str = "unique") -> list[int]:
    """The block count after each of ``events`` under a model of the allocator that may make one of
    the recognised mistakes (the defaults: the right one). ``blocks``: how many blocks n tokens take
    (:data:`_BLOCKS_FOR`); ``append``: "table" grows the table to blocks(length) entries, "slots"
    fills the last block's free slots and takes blocks(rest) for the rest, "room" the same with a full
    last block taken for an empty one, "fresh" takes blocks(n)
    fresh blocks (no copy), "fresh-cow" the same after a copy-on-write; ``fork``: "share", "copy"
    (fresh blocks for the child), "copy-last" (a partly filled last block copied at the fork, not at
    the first append), "no-ref" (the child shares the blocks, their counts unchanged) or "alias" (the child gets the parent's list object); ``child_len``
    "parent" or "zero"; ``cow``: "partial", "never" or "always" (a full shared block too);
    ``cow_decref``: the copied block loses the sequence's reference; ``after_copy`` "full": the copy
    counts as full; ``free``: "ref", "all" (every block of the sequence) or "never"; ``count``:
    "unique", "nonzero" (blocks whose count is not 0: negative counts too, where a mistake
    decrements a block twice), "per-seq" (sum of table lengths), "refs" (sum of reference counts),
    "pooled" (ceil of all tokens / bs) or "peak" (the largest unique count so far)."""
    per = _BLOCKS_FOR[blocks]
    ref_: dict[int, int] = {}
    tables: dict[int, list[int]] = {}
    lengths: dict[int, int] = {}
    fresh = iter(range(10**9))
    out: list[int] = []

    def take() -> int:
        b = next(fresh)
        ref_[b] = 1
        return b

    for kind, seq, *rest in events:
        if kind == "new":
            tables[seq], lengths[seq] = [take() for _ in range(per(rest[0], bs))], rest[0]
        elif kind == "append":
            table, length, n = tables[seq], lengths[seq], rest[0]
            copied = False
            if append != "fresh" and table and ref_[table[-1]] > 1 and (
                    cow == "always" or (cow == "partial" and length % bs)):
                old = table[-1]
                table[-1] = take()
                copied = True
                if cow_decref:
                    ref_[old] -= 1
            if append in ("fresh", "fresh-cow") or (copied and after_copy == "full"):
                table.extend(take() for _ in range(per(n, bs)))
            elif append == "room":  # a full last block taken for one with block_size free slots
                left = n - (bs - length % bs)
                table.extend(take() for _ in range(per(left, bs) if left > 0 else 0))
            elif append == "slots":
                left = n - (bs - length % bs) % bs
                table.extend(take() for _ in range(per(left, bs) if left > 0 else 0))
            else:
                table.extend(take() for _ in range(per(length + n, bs) - len(table)))
            lengths[seq] = length + n
        elif kind == "fork":
            child = rest[0]
            lengths[child] = lengths[seq] if child_len == "parent" else 0
            if fork == "copy":
                tables[child] = [take() for _ in tables[seq]]
            elif fork == "copy-last" and lengths[seq] % bs and tables[seq]:  # copies the partly filled block now
                tables[child] = [*tables[seq][:-1], take()]
                for b in tables[child][:-1]:
                    ref_[b] += 1
            elif fork == "no-ref":
                tables[child] = list(tables[seq])
            else:
                tables[child] = tables[seq] if fork == "alias" else list(tables[seq])
                for b in tables[child]:
                    ref_[b] += 1
        elif kind == "free":
            table = tables.pop(seq)
            del lengths[seq]
            for b in table:
                if free == "ref":
                    ref_[b] -= 1
                elif free == "all":
                    ref_[b] = 0
        unique = sum(1 for r in ref_.values() if r > 0)
        out.append({"unique": unique, "peak": max(unique, out[-1] if out else 0),
                    "nonzero": sum(1 for r in ref_.values() if r != 0),
                    "per-seq": sum(len(t) for t in tables.values()),
                    "refs": sum(r for r in ref_.values() if r > 0),
                    "pooled": -(-sum(lengths.values()) // bs)}[count])
    return out


def _simulate(events, bs: int, **model) -> int:
    """The block count after ``events`` under ``model`` (see :func:`_trace`); 0 for no events."""
    counts = _trace(events, bs, **model)
    return counts[-1] if counts else 0


# Each recognised mistake, as the models (keyword arguments of _trace) that make it: a learner's
# counts after every prefix of every case must equal one model's for the mistake to be named. Once a
# mistake has made a table disagree with its sequence's length, "grow the table to ceil(length /
# block_size)" and "fill the last block's free slots, then take blocks for the rest" part ways: each
# model comes in both styles.
def _both_appends(*models: dict) -> list[dict]:
    return [m if "append" in m else {**m, "append": a} for m in models
            for a in (("table", "slots") if "append" not in m else (m["append"],))]


_BLOCK_MODELS: dict[str, list[dict]] = {
    _NO_PARTIAL: _both_appends(dict(blocks="floor"), dict(blocks="floor-min-1")),
    _EXTRA_BLOCK: _both_appends(dict(blocks="plus-one")),
    _FRESH_APPEND: [dict(append="fresh"), dict(append="fresh-cow")],
    _NO_SHARING: _both_appends(dict(fork="copy"), dict(count="per-seq"), dict(count="refs")),
    _NO_COW: _both_appends(dict(cow="never")),
    _COW_FULL: _both_appends(dict(cow="always")),
    _COW_LEAK: _both_appends(dict(cow_decref=False)),
    _FREE_SHARED: _both_appends(dict(free="all"), dict(free="all", count="nonzero")),
    _NEVER_FREED: _both_appends(dict(free="never")),
    _POOLED: [dict(count="pooled")],
    _PEAK: [dict(count="peak")],
    _ALIASED_TABLE: _both_appends(dict(fork="alias"), dict(fork="alias", count="nonzero")),
    _FORK_EMPTY: _both_appends(dict(child_len="zero")),
    _COPY_AS_FULL: _both_appends(dict(after_copy="full")),
    _COPY_AT_FORK: _both_appends(dict(fork="copy-last")),
    _FULL_HAS_ROOM: [dict(append="room"), dict(append="room", cow="always")],
    _FORK_NO_REF: _both_appends(dict(fork="no-ref"), dict(fork="no-ref", count="nonzero")),
}


def random_events(g: torch.Generator, n_events: int, max_tokens: int) -> list[tuple]:
    """A valid stream of events from a generator: new sequences, appends, forks and frees."""
    live: list[int] = []
    events: list[tuple] = []
    next_id = 0
    for _ in range(n_events):
        kind = draw(g, 0, 10)
        if not live or kind < 2:
            events.append(("new", next_id, draw(g, 1, max_tokens)))
            live.append(next_id)
            next_id += 1
        elif kind < 6:
            events.append(("append", live[draw(g, 0, len(live))], draw(g, 1, max_tokens // 2 + 2)))
        elif kind < 8:
            events.append(("fork", live[draw(g, 0, len(live))], next_id))
            live.append(next_id)
            next_id += 1
        else:
            events.append(("free", live.pop(draw(g, 0, len(live)))))
    return events


# (events, block_size): requests that come and go without sharing (an append that fits in the last
# block's free slots); parallel sampling from a prompt whose last block is partly filled (each
# sample's first token copies it); a system prompt of full blocks whose owner finishes first
# (nothing to copy, the blocks stay); a copy-on-write followed by the finish of the sequence that
# kept the original; then two streams drawn from a seed. The learner's function runs on every
# prefix of every stream, so a wrong count is seen at the event that first makes it wrong.
_COME_AND_GO = [("new", 0, 10), ("new", 1, 8), ("new", 2, 3), ("free", 1), ("append", 0, 1),
                ("new", 3, 5)]
_SAMPLING = [("new", 0, 9), ("fork", 0, 1), ("fork", 0, 2), ("append", 1, 2), ("append", 2, 1)]
_SYSTEM_PROMPT = [("new", 0, 16), ("fork", 0, 1), ("fork", 0, 2), ("append", 1, 5), ("append", 2, 9),
                  ("free", 0), ("new", 3, 20)]
_COPY_THEN_FREE = [("new", 0, 6), ("fork", 0, 1), ("append", 1, 1), ("append", 0, 3), ("free", 0)]


def _blocks_cases() -> list[tuple[list[tuple], int]]:
    cases = [(_COME_AND_GO, 4), (_SAMPLING, 4), (_SYSTEM_PROMPT, 8), (_COPY_THEN_FREE, 4)]
    for i, (n_events, bs, max_tokens) in enumerate([(25, 4, 20), (40, 16, 60)]):
        g = seeded(1240 + i)
        cases.append((random_events(g, n_events, max_tokens), bs))
    return cases


def _event_fact(events: list[tuple], bs: int, before: int, expected: int, got: int) -> str:
    """What the last of ``events`` should do to the count, in the learner's terms (the allocator's
    state before it from the right model), and what the learner's count did."""
    *head, event = events
    kind, seq, *rest = event
    tables: dict[int, list[int]] = {}
    lengths: dict[int, int] = {}
    holders: dict[int, int] = {}
    fresh = iter(range(10**9))
    for k, s, *r in head:  # the right allocator's state before the last event
        if k == "new":
            tables[s], lengths[s] = [next(fresh) for _ in range(-(-r[0] // bs))], r[0]
        elif k == "fork":
            tables[r[0]], lengths[r[0]] = list(tables[s]), lengths[s]
        elif k == "append":
            t = tables[s]
            if lengths[s] % bs and sum(t[-1] in tt for tt in tables.values()) > 1:
                t[-1] = next(fresh)
            lengths[s] += r[0]
            t.extend(next(fresh) for _ in range(-(-lengths[s] // bs) - len(t)))
        else:
            del tables[s], lengths[s]
    for t in tables.values():
        for b in t:
            holders[b] = holders.get(b, 0) + 1
    yours = f"yours went from {before} to {got}" if got != before else f"yours stayed at {got}"
    if kind == "new":
        n = rest[0]
        why = (f"a new sequence of {n} tokens takes ceil({n} / {bs}) = {expected - before} block"
               f"{'s' if expected - before != 1 else ''}")
    elif kind == "fork":
        why = (f"a fork takes no block (the child shares sequence {seq}'s {len(tables[seq])} blocks, each "
               "gains a reference)")
    elif kind == "free":
        t = tables[seq]
        alone = sum(1 for b in t if holders[b] == 1)
        why = (f"sequence {seq} held {len(t)} block{'s' if len(t) != 1 else ''}, {alone} of them held by no "
               f"other sequence: those {alone} return to the free list")
    else:
        n, length, t = rest[0], lengths[seq], tables[seq]
        used = length % bs
        shared = bool(t) and holders[t[-1]] > 1
        copy = bool(used) and shared
        new = -(-(length + n) // bs) - len(t)
        state = (f"sequence {seq} had {length} tokens in {len(t)} block{'s' if len(t) != 1 else ''}, its last "
                 + ("full" if not used else f"holding {used} of {bs} slots")
                 + (", shared with another sequence" if shared else ""))
        parts = (["a copy of the shared, partly filled last block"] if copy else []) + (
            [f"{new} fresh block{'s' if new != 1 else ''} for positions past the last block"] if new else [])
        why = (f"{state}; {n} more token{'s take' if n != 1 else ' takes'} "
               + (" and ".join(parts) if parts else "no block (they fit in the last block's free slots)"))
    return (f"your count was right after every event before the last one, {event}, and wrong after it: "
            f"{why}, so the count goes from {before} to {expected}; {yours}.")


@exercise()
def blocks_in_use(t: Trial) -> None:
    """The count after every prefix of each stream of events, against the right allocator's: the
    first event after which the learner's count is wrong is the one shown. A mistake is named when
    one of its models (:data:`_BLOCK_MODELS`) gives the learner's count after every prefix of every
    stream, and no other mistake's does; otherwise the failure says what that event should have
    done to the count. Not detected (an honest limit of checking a count): copies of a block that no
    other sequence holds, made where no copy is needed. Such a copy replaces the block in the table
    and frees the original at once (its count drops to 0), so the number of blocks in use is the
    same as without it."""
    t.forbidden_references = {"blocks_in_use", "add_sequence", "append_tokens", "fork", "release",
                              "needs", "_simulate", "_trace"}
    t.error_hints = {
        r"takes \d+ positional argument|missing \d+ required positional argument": "the signature is "
        "blocks_in_use(events, block_size), returning an int.",
        r"KeyError": "a sequence appears in events only after its ('new', s, n) or as the child of a "
        "('fork', parent, s); keep every live sequence's block table, and remove it when it is freed.",
        r"not enough values to unpack|too many values to unpack": "the events have different lengths: "
        "('new', s, n), ('append', s, n), ('fork', s, child) have three items, ('free', s) two. Unpack "
        "with `kind, seq, *rest = event`.",
    }
    planned = []
    for events, bs in _blocks_cases():
        expected = [ref.blocks_in_use(events[:k], bs) for k in range(1, len(events) + 1)]
        models = {h: [_trace(events, bs, **kw) for kw in variants] for h, variants in _BLOCK_MODELS.items()}
        planned.append((events, bs, expected, models))
    got_all: list[list[int]] = []
    wrong = False  # has a count been wrong yet? Then a crash on a later stream only ends the collection
    for events, bs, expected, _ in planned:  # every prefix of every stream, before any comparison
        counts: list[int] = []
        got_all.append(counts)
        for k in range(1, len(events) + 1):
            try:
                got = t.call([tuple(e) for e in events[:k]], bs, case=_blocks_case_name(events[:k], bs))
            except LearnerError:
                if not wrong:
                    raise
                break
            if _type(got) is not int and wrong:
                break
            _require_int(t, got)
            if _type(got) is not int:
                t.number(got, expected[k - 1], what="blocks in use", hint=_BLOCKS_RECIPE, integer=True)
            counts.append(got)
            wrong = wrong or got != expected[k - 1]
        else:
            continue
        break
    # the mistakes one of whose models gives every count the learner gave
    consistent = [h for h in _BLOCK_MODELS
                  if any(all(planned[i][3][h][v][:len(counts)] == counts for i, counts in enumerate(got_all))
                         for v in range(len(_BLOCK_MODELS[h])))]
    named = consistent[0] if len(consistent) == 1 else ""
    for (events, bs, expected, _), counts in zip(planned, got_all):
        for k, (got, want) in enumerate(zip(counts, expected)):  # the first wrong count
            if got == want:
                continue
            t.case = _blocks_case_name(events[:k + 1], bs)
            if named:
                t.number(got, want, what="blocks in use", diagnosis=named, hint=_BLOCKS_RECIPE, integer=True)
                return
            before = expected[k - 1] if k else 0
            t.fail(f"blocks in use: expected {want}, got {got}.", found=_event_fact(events[:k + 1], bs, before,
                                                                                   want, got),
                   recipe=_BLOCKS_RECIPE, what="values")


def _blocks_case_name(events: list[tuple], bs: int) -> str:
    shown = (f"{events}" if len(events) <= 12 else
             f"{len(events)} events: {events[:2]} ... {events[-2:]}".replace("] ... [", ", ..., "))
    return f"events={shown}, block_size={bs}"


def _require_int(t: Trial, got: Any) -> None:
    """Fail, with this exercise's own hint, on a count returned as a NumPy number or a float (core's
    hint speaks of bytes and FLOPs); anything else is left to :meth:`Trial.number`."""
    kind = _type(got)
    if kind is float or (kind.__module__ == "numpy" and _issubclass(kind, numbers.Real)):
        value = _to_float(got)
        if math.isfinite(value) and value.is_integer():
            t.fail(f"blocks in use: expected an int, got {describe(got)} {got!r}.", _NOT_INT,
                   what="type")
        t.fail(f"blocks in use: expected an int, got {describe(got)} {got!r}.",
               "a block is taken whole: count blocks with a ceiling, (n + block_size - 1) // "
               "block_size, in ints (/ gives a float).", generic=True, what="values")
