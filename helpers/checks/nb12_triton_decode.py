"""Check for notebook 12_serving, in Triton: exercise 12.4 (bonus), split-KV decoding over a paged
KV cache.

The learner writes ``paged_decode_triton(q, k_pages, v_pages, block_tables, seq_lens, n_splits,
sm_scale)`` -> out ``[B, H, d]``: programs that each take one chunk of a sequence's keys, found
through its block table, and a merge of the chunks. It runs like 9.3's check (GPU, or Triton's
interpreter on a CPU; guarded inputs and allocations; the arithmetic on q, k and v must happen in
a Triton kernel; merging the kernel's partial results in PyTorch is fine). The cache is poisoned
where a correct kernel never looks: the block every table's padding entries point to, and the
slots after each sequence's last key, hold NaN. The cases go from friendly to awkward:

1. one chunk, MHA, each sequence's blocks in order, lengths a multiple of the block size;
2. one chunk, GQA, shuffled block ids (and spare blocks), a ragged length;
3. the same inputs in three chunks (only the split and the merge differ from case 2);
4. MQA, more chunks than blocks (empty chunks), lengths 0, 1 and ragged, fp16;
5. an explicit sm_scale, GQA groups of 2, d = 128, fp16;
6. n_splits=None: the learner's own choice (only the output is checked).

Where n_splits > 1 the kernels that read the cache must together launch at least n_splits * B *
H_kv programs (one per split, sequence and kv head: the fewest of any layout that really splits the
keys across programs). In case 4 (n_splits = 6 > H / H_kv = 2) a kernel that ignores n_splits and
gives each (sequence, query head) one program, B * H of them as notebook 09's layout does, falls
below that bound. Launches that read no part of the cache (a Triton merge of the partial results)
are not counted.

Every case's expected output (float64) and the outputs of the recognised mistakes are computed
before the learner's function first runs.
"""

from __future__ import annotations

import math

import torch

from ..registry import in_module
from . import watchers
from .core import Trial, describe_case, exercise, seeded
from .feedback import Mistake
from .guard import _allclose, _float64, _isclose, _isnan, _Tensor, _type
from .instruments import (
    guarded,
    kernel_device,
    warm_up,
)
from .nb09_triton_flash import _TRITON_ERRORS, _fail_watched, _tol, _written_by_kernel

__all__ = in_module(__name__)  # its exercises' checks, as helpers/registry.py lists them

TRITON_TIME_LIMIT_S = 120.0  # per call: the interpreter is slow, and a GPU compiles on first use
_COURSE_FUNCTIONS = {"paged_decode_triton", "paged_decode_splits", "merge_splits_triton",
                     "flash_attention_triton", "flash_attention_triton_forward"}
_ARGS = ("q", "k_pages", "v_pages", "block_tables", "seq_lens")


# --------------------------------------------------------------------------- the cases


def paged_case(B: int, H: int, H_kv: int, d: int, lens: list[int], page: int, seed: int,
               shuffle: bool = True, dtype: torch.dtype = torch.float32) -> dict:
    """A paged cache with NaN where a correct kernel never reads: q ``[B, H, d]``, k_pages and
    v_pages ``[n_blocks, page, H_kv, d]`` (sequence b's blocks in order, b * max_blocks + j, or
    shuffled among 2 extra blocks; the last block is all NaN and every table's padding
    entries point to it; the slots after a sequence's last key hold NaN), block_tables
    ``[B, max_blocks]`` int32, seq_lens ``[B]`` int32. (Also the tests' and the bench's cache.)"""
    g = seeded(seed)
    max_blocks = max(math.ceil(n / page) for n in lens) + 1  # at least one padding entry each
    poison = B * max_blocks + 2  # the blocks of every table, and 2 spare ones
    k = torch.randn(poison + 1, page, H_kv, d, generator=g)
    v = torch.randn(poison + 1, page, H_kv, d, generator=g)
    order = torch.randperm(poison, generator=g) if shuffle else torch.arange(poison)
    table = torch.full((B, max_blocks), poison, dtype=torch.int32)
    for b, n in enumerate(lens):
        used = math.ceil(n / page)
        table[b, :used] = (order[b * max_blocks: b * max_blocks + used] if shuffle
                           else torch.arange(b * max_blocks, b * max_blocks + used)).int()
        if n % page:
            k[table[b, used - 1], n % page:] = float("nan")
            v[table[b, used - 1], n % page:] = float("nan")
    k[poison] = float("nan")
    v[poison] = float("nan")
    q = torch.randn(B, H, d, generator=g)
    return dict(q=q.to(dtype), k_pages=k.to(dtype), v_pages=v.to(dtype), block_tables=table,
                seq_lens=torch.tensor(lens, dtype=torch.int32))


def decode64(q, k_pages, v_pages, block_tables, seq_lens, scale: float | None = None, *,
             tables: str = "right", kv_map: str = "right", normalise: bool = True,
             chunks: tuple[int, int] | None = None, combine: str = "lse", base: str = "e",
             rescale: int | None = None, lse: str = "right", floor_pages: bool = False,
             zero_scores: int | None = None, split_tables: bool = False) -> torch.Tensor:
    """Paged decoding in float64 on the CPU -> ``[B, H, d]``, with one mistake switched on:
    ``tables`` "in-order" (block j for every sequence) or "flat" (block b * max_blocks + j);
    ``kv_map`` "mod" (kv head h % H_kv) or "div" (h // H_kv); ``normalise=False`` (out not divided
    by the sum of weights); ``chunks=(n_splits, tile)``: chunks of cdiv(cdiv(n, n_splits), tile) *
    tile keys, each normalised by its own sum and merged by ``combine``: "lse" (weights
    exp(lse_c - max lse), right), "mean", "mean-all" (the sum over n_splits) or "sum"; within a
    chunk ``base`` "2" (weights 2^(s - m), lse m + ln l), ``rescale=T`` (an online softmax over tiles
    of T keys that never rescales what it summed before the max grew), ``lse="m"`` (each chunk's
    lse is its max score; "log2": in base-2 units, lse / ln 2; "ln2": lse * ln 2, what a merge with
    exp2 of natural lses amounts to); ``floor_pages`` (only the seq_len // page full pages are read);
    ``zero_scores=T``: the slots from seq_len to the next multiple of T are loaded as 0 (masked) but
    keep their score 0 instead of -inf; ``split_tables`` (with ``chunks``): each chunk reads its keys
    through the block table from entry 0 (key p of the chunk that starts at key lo from block
    block_tables[b, (p - lo) // page], slot p % page), as a split that forgot its own offset."""
    q, k_pages, v_pages = (x.detach().to("cpu", torch.float64) for x in (q, k_pages, v_pages))
    block_tables, seq_lens = block_tables.cpu(), seq_lens.cpu()
    B, H, d = q.shape
    page, H_kv = k_pages.shape[1], k_pages.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    heads = torch.arange(H)
    kv = {"right": heads // (H // H_kv), "mod": heads % H_kv, "div": heads // H_kv}[kv_map]
    out = torch.zeros(B, H, d, dtype=torch.float64)
    exp = torch.exp2 if base == "2" else torch.exp
    for b, n in enumerate(seq_lens.tolist()):
        if floor_pages:
            n = n // page * page
        if n == 0:
            continue
        j = torch.arange(math.ceil(n / page))
        blocks = {"right": block_tables[b, j.tolist()].long(), "in-order": j,
                  "flat": b * block_tables.shape[1] + j}[tables]
        if int(blocks.max()) >= k_pages.shape[0]:
            raise IndexError("this mistake reads past the cache here")
        keys = k_pages[blocks].flatten(0, 1)[:n][:, kv]  # [n, H, d]
        vals = v_pages[blocks].flatten(0, 1)[:n][:, kv]
        if split_tables and chunks is not None:
            per_keys = math.ceil(math.ceil(n / chunks[0]) / chunks[1]) * chunks[1]
            pos = torch.arange(n)
            entry = block_tables[b, ((pos - pos // per_keys * per_keys) // page).tolist()].long()
            keys, vals = k_pages[entry, pos % page][:, kv], v_pages[entry, pos % page][:, kv]
        s = torch.einsum("hd,nhd->hn", q[b], keys) * scale  # [H, n]
        if zero_scores:
            extra = math.ceil(n / zero_scores) * zero_scores - n
            s = torch.cat([s, s.new_zeros(H, extra)], dim=1)
            vals = torch.cat([vals, vals.new_zeros(extra, H, d)])
        n_splits, tile = chunks if chunks is not None else (1, 1)
        per = math.ceil(math.ceil(n / n_splits) / tile) * tile
        parts, lses = [], []
        for lo in range(0, n, per):
            sc, vc = s[:, lo:lo + per], vals[lo:lo + per]
            if rescale:
                m = torch.full((H,), -math.inf, dtype=torch.float64)
                w = torch.empty_like(sc)
                for t0 in range(0, sc.shape[1], rescale):
                    m = torch.maximum(m, sc[:, t0:t0 + rescale].amax(-1))
                    w[:, t0:t0 + rescale] = exp(sc[:, t0:t0 + rescale] - m[:, None])
            else:
                m = sc.amax(-1)
                w = exp(sc - m[:, None])
            l = w.sum(-1)
            o = torch.einsum("hn,nhd->hd", w, vc)
            parts.append(o / l[:, None] if normalise else o)
            lses.append({"m": m, "log2": (m + torch.log(l)) / math.log(2), "ln2": (m + torch.log(l)) * math.log(2)}
                        .get(lse, m + torch.log(l)))
        total, lse_c = torch.stack(parts), torch.stack(lses)
        if combine == "lse":
            wc = torch.exp(lse_c - lse_c.amax(0))
            out[b] = (wc[..., None] * total).sum(0) / wc.sum(0)[:, None]
        else:
            out[b] = {"mean": total.sum(0) / len(parts), "mean-all": total.sum(0) / n_splits,
                      "sum": total.sum(0)}[combine]
    return out


_CASES = [  # (B, H, H_kv, d, lens, page, shuffle, n_splits, sm_scale, dtype)
    (2, 2, 2, 16, [32, 16], 8, False, 1, None, torch.float32),
    (2, 8, 2, 32, [24, 37], 8, True, 1, None, torch.float32),
    (2, 8, 2, 32, [24, 37], 8, True, 3, None, torch.float32),
    (4, 2, 1, 64, [5, 1, 0, 37], 16, True, 6, None, torch.float16),
    (1, 4, 2, 128, [70], 16, True, 2, 0.3, torch.float16),
    (2, 4, 2, 16, [9, 20], 4, True, None, None, torch.float32),
]


_M = {
    "no-sm-scale": Mistake("no-sm-scale", "the scores are not scaled: multiply q . k by sm_scale "
                           "(1 / sqrt(d) when sm_scale is None) before the softmax.",
                           "the scores are not scaled by sm_scale"),
    "ignored-sm-scale": Mistake("ignored-sm-scale", "sm_scale was given (0.3 here) and your scores "
                                "used 1 / sqrt(d): use sm_scale when it is not None.",
                                "the sm_scale argument is ignored"),
    "ignores-block-table": Mistake("ignores-block-table", "your kernel reads a sequence's blocks "
                                   "in "
                                   "order (block j, or b * max_blocks + j) instead of through its "
                                   "block table: key j of sequence b is in block "
                                   "block_tables[b, j // block_size], slot j % block_size.",
                                   "the pages are read in order, not through the block table"),
    "gqa-head-mapping": Mistake("gqa-head-mapping", "query head h reads the wrong kv head: with "
                                "H // H_kv query heads per kv head, query head h reads kv head "
                                "h // (H // H_kv), not h % H_kv or h // H_kv.",
                                "wrong kv head for a query head (GQA)"),
    "unnormalised-output": Mistake("unnormalised-output", "the output is not normalised: divide "
                                   "the accumulator by the running sum l of the weights (each "
                                   "chunk's partial output too, before the merge).",
                                   "the (partial) outputs are not divided by l"),
    "merge-without-rescale": Mistake("merge-without-rescale", "the chunks were combined without "
                                     "their log-sum-exp weights (averaged or added): out = sum_c "
                                     "exp(lse_c - lse) * out_c with lse = logsumexp_c(lse_c).",
                                     "the chunks are merged without the lse weights"),
    "scale-one-over-d": Mistake("scale-one-over-d", "your scores are scaled by 1 / d: the softmax's "
                                "scale is 1 / sqrt(d) (when sm_scale is None), sm_scale itself "
                                "otherwise.", "scaled the scores by 1/d instead of 1/sqrt(d)"),
    "exp2-of-natural-scores": Mistake("exp2-of-natural-scores", "you took tl.exp2 of scores in "
                                      "natural-log units: 2^(s - m) is the softmax of s * ln 2, too "
                                      "flat. Use tl.exp, or multiply the scores by log2(e) = 1.4427 "
                                      "(fold it into the scale) before tl.exp2, and then store the "
                                      "chunk's lse in natural units, (m + log2(l)) * ln 2.",
                                      "used exp2 on scores that are not multiplied by log2(e)"),
    "log2e-with-exp": Mistake("log2e-with-exp", "you multiplied the scores by log2(e) = 1.4427 (as "
                              "for tl.exp2) but took tl.exp: use tl.exp2 with that factor, or "
                              "tl.exp without it.",
                              "scaled the scores by log2(e) for exp2, then used exp"),
    "online-softmax-without-rescale": Mistake("online-softmax-without-rescale", "when the running "
                                              "max grows from m to m_new, what was summed before "
                                              "must be rescaled by alpha = exp(m - m_new): l = l * "
                                              "alpha + sum(p), acc = acc * alpha + p @ v. Without "
                                              "it, earlier tiles keep weights relative to the old "
                                              "max.", "the online softmax never rescales l and acc"),
    "floor-page-count": Mistake("floor-page-count", "your kernel read seq_len // PAGE pages and "
                                "skipped the partly filled last page: a sequence of seq_len keys "
                                "spans cdiv(seq_len, PAGE) pages; read the last one too, with the "
                                "slots past seq_len masked.",
                                "walked seq_len // PAGE pages (the last, partly filled page skipped)"),
    "masked-keys-keep-score-0": Mistake("masked-keys-keep-score-0", "the slots past seq_len were "
                                        "loaded as 0 (masked) but kept their score q . 0 = 0: each still "
                                        "takes a share exp(0 - m) of the softmax. Give them the score "
                                        "-inf: s = tl.where(offs < seq_len, s, float('-inf')).",
                                        "masked the loads past seq_len but left their scores at 0"),
    "lse-base-mismatch": Mistake("lse-base-mismatch", "your chunks' lse and your merge use different "
                                 "log bases: an lse in base 2 (m + log2(l), from exp2 scores) merged "
                                 "with exp, or a natural lse merged with exp2. Convert once: lse_natural "
                                 "= lse_base2 * ln 2, and merge with exp(lse_c - max lse).",
                                 "merged chunk lses in one log base with the exp of another"),
    "lse-without-log-l": Mistake("lse-without-log-l", "each chunk's lse must be m + log(l), the log of "
                                 "its softmax denominator: you stored m (the chunk's max score), so "
                                 "the merge weighs the chunks by their largest score only.",
                                 "stored lse = m for each chunk (forgot + log(l))"),
    "split-table-from-entry-0": Mistake("split-table-from-entry-0", "each split read its pages from the "
                                        "block table's first entries: the split whose keys start at page "
                                        "`start` reads its j-th page from block_tables[b, start + j] (the "
                                        "page's index in the whole sequence), not block_tables[b, j].",
                                        "each split read the block table from entry 0, not from its own "
                                        "first page"),
}


def _mistake_models(c: dict) -> list[tuple[Mistake, torch.Tensor]]:
    """(mistake, the output it gives on case ``c``) for every recognised mistake that applies."""
    args = [c[name] for name in _ARGS]
    n_splits, scale = c["n_splits"], c["sm_scale"]
    dev, dtype = kernel_device(), c["q"].dtype
    d, page = c["q"].shape[-1], c["k_pages"].shape[1]
    used = 1 / math.sqrt(d) if scale is None else scale  # the right scale
    tiles = sorted({1, page, 16, 32})
    variants = [("no-sm-scale", dict(scale=1.0))] if scale is None else [
        ("ignored-sm-scale", dict(scale=None))]
    if scale is None:
        variants.append(("scale-one-over-d", dict(scale=1 / d)))
    variants.append(("log2e-with-exp", dict(scale=used * math.log2(math.e))))
    variants += [("ignores-block-table", dict(tables=m)) for m in ("in-order", "flat")]
    variants += [("gqa-head-mapping", dict(kv_map=m)) for m in ("mod", "div")]
    variants.append(("floor-page-count", dict(floor_pages=True)))
    # the online softmax over tiles of T keys (T = one page, or a BLOCK of 16, 32 or 64 keys), in
    # chunks rounded to the same tiles: what the chunks are matters where a mistake is inside them
    splits = [(1, t) for t in sorted({page, 16, 32, 64})] if n_splits == 1 else (
        [(n_splits, t) for t in sorted({page, 16, 32, 64})] if n_splits is not None else [])
    variants += [("online-softmax-without-rescale", dict(chunks=ch, rescale=ch[1])) for ch in splits]
    variants += [("masked-keys-keep-score-0", dict(chunks=ch, zero_scores=ch[1])) for ch in splits]
    variants += [("exp2-of-natural-scores", dict(chunks=ch, base="2")) for ch in splits[:1 if n_splits == 1 else None]]
    if n_splits == 1:
        variants.append(("unnormalised-output", dict(normalise=False)))
    elif n_splits is not None:  # None: the learner's split count, unknown here
        variants += [("merge-without-rescale", dict(chunks=(n_splits, tile), combine=combine))
                     for tile in tiles for combine in ("mean", "mean-all", "sum")]
        variants += [("lse-without-log-l", dict(chunks=(n_splits, tile), lse="m")) for tile in tiles]
        variants += [("lse-base-mismatch", dict(chunks=(n_splits, tile), lse=unit))
                     for tile in tiles for unit in ("log2", "ln2")]
        variants += [("split-table-from-entry-0", dict(chunks=(n_splits, tile), split_tables=True))
                     for tile in sorted({page, 16, 32, 64})]
    models = []
    for slug, kw in variants:
        kw.setdefault("scale", scale)
        try:
            out = decode64(*args, **kw).to(device=dev, dtype=dtype)
        except IndexError:  # a mistake that would read past the cache on this case
            continue
        models.append((_M[slug], out))
    return models


def _matched(got: torch.Tensor, models: list, tol: dict, expected: torch.Tensor | None = None) -> str:
    """The mistake whose output ``got`` equals (within ``tol``, NaN equal to NaN), or '': none
    when models of two different mistakes both match, or a matching model equals ``expected``."""
    g = got.detach().to(_float64)
    hits = [mistake for mistake, out in models if _allclose(g, out.detach().to(_float64), equal_nan=True, **tol)]
    if expected is not None:
        e = expected.detach().to(_float64)
        hits = [h for h, out in models if h in hits and not _allclose(e, out.detach().to(_float64), equal_nan=True,
                                                                        **tol)]
    return hits[0] if hits and all(h.slug == hits[0].slug for h in hits) else ""


def _cases(dev: torch.device) -> list[dict]:
    cases = []
    for i, (B, H, H_kv, d, lens, page, shuffle, n_splits, scale, dtype) in enumerate(_CASES):
        c = paged_case(B, H, H_kv, d, lens, page, seed=1240 + (i if i != 2 else 1),
                       shuffle=shuffle, dtype=dtype)
        c.update(n_splits=n_splits, sm_scale=scale, dtype=dtype)
        c["expected"] = decode64(*(c[n] for n in _ARGS), scale).to(device=dev, dtype=dtype)
        c["models"] = _mistake_models(c)
        c["args"] = [guarded(c[n], dev) for n in _ARGS[:3]] + [c[n].to(dev) for n in _ARGS[3:]]
        cases.append(c)
    return cases


# --------------------------------------------------------------------------- calling the learner


# The mistakes watchers.decode (which runs in the notebook's process) reports, by slug: what crosses
# back is plain data, and the check looks the Mistake up here.
_WATCHED = {m.slug: m for m in (
    Mistake("store-past-end", "mask every tl.store with the rows that exist (e.g. the query heads "
            "of a padded GQA group: mask=offs_g < GROUP).",
            "stored past the end of a tensor (a tl.store without a mask)"),
    Mistake("no-kernel", "launch your kernel, `_kernel[grid](...)`, and return what it (or your "
            "merge of what it wrote) gives.",
            "did not launch a Triton kernel"),
    Mistake("course-kernel", "write the kernel in the notebook: the point of the exercise is to "
            "build it.",
            "launched the course's kernel instead of their own"),
    Mistake("gathered-in-pytorch", "read the pages through the block table inside the kernel "
            "(tl.load of block_tables, then of k_pages at that block); PyTorch only allocates and "
            "merges.",
            "gathered the pages through the block table in PyTorch, not in the kernel"),
    Mistake("computed-in-pytorch", "pass q, k_pages, v_pages to the kernel and compute there; in "
            "PyTorch only allocate, and merge the partial outputs the kernel wrote.",
            "computed the attention in PyTorch, not in the kernel"),
    Mistake("left-pytorch", "pass q, k_pages, v_pages themselves to the kernel and do the "
            "arithmetic inside it.",
            "took q, k or v out of PyTorch (NumPy, Python numbers)"),
)}


def _nan_hint(c: dict, got: torch.Tensor, expected: torch.Tensor, passed: list[int]) -> str:
    """Name the cause of NaN in ``got``, from where it is and which cases passed, or ''. With one
    chunk, sequences whose last page is partly filled that come out all 0 (a kernel that guards
    l > 0 turns the NaN it read into 0) while every other sequence is right are a read past seq_len
    too: the check's cache holds NaN there."""
    nan_b = [b for b in range(got.shape[0]) if bool(_isnan(got[b]).any())]
    lens = c["seq_lens"].tolist()
    page = c["k_pages"].shape[1]
    if not nan_b and c["n_splits"] == 1:
        tol = _tol(c["dtype"], torch.device("cpu"), "fwd")
        right = [bool(_isclose(got[b].double(), expected[b].double(), **tol).all()) for b in range(len(lens))]
        zero = [bool((got[b] == 0).all()) for b in range(len(lens))]
        ragged = [n % page != 0 for n in lens]
        if (any(ragged) and all(z for z, r in zip(zero, ragged) if r) and all(ok for ok, r in zip(right, ragged) if not r)
                and any(n > page for n, r in zip(lens, ragged) if r)):
            return Mistake("read-past-seq-len", "your output is 0 for exactly the sequences whose last page is "
                           "partly filled (lengths " + ", ".join(str(n) for n, r in zip(lens, ragged) if r) + "): "
                           "your kernel read keys or values that are not part of the sequence (past seq_len) there, "
                           "which hold NaN in this check's cache, and your guard on l > 0 turned the NaN into 0. Load only keys j < seq_len "
                           "(tl.load(..., mask=offs < seq_len, other=0.0)) and give the others the score -inf.",
                           "read keys or values past the sequence's end (padding slots)")
    if not nan_b:
        return ""
    if all(lens[b] == 0 for b in nan_b) and 1 in passed:
        return Mistake("nan-for-empty-sequence", "a sequence of length 0 gave NaN: every chunk "
                       "of it "
                       "is empty, so its output must be 0. Guard l = 0 (divide by 1 instead) and, "
                       "in the merge, a max lse of -inf (use 0): exp(-inf - -inf) is NaN.")
    if (c["n_splits"] or 1) > 1 and 1 in passed:
        return Mistake("nan-from-empty-chunk", f"NaN with n_splits={c['n_splits']}, none with one "
                       "chunk on such inputs: some chunks are empty here (fewer keys or tiles than "
                       "chunks). An empty "
                       "chunk has l = 0 and lse = -inf: store 0 for its output (divide by "
                       "where(l > 0, l, 1)), lse = -inf, and give it weight exp(-inf) = 0 in the "
                       "merge.")
    return Mistake("read-past-seq-len", "NaN: your kernel read keys or values that are not part of "
                   "the sequence (here the slots after a sequence's last key, and the block that "
                   "the tables' padding entries point to, hold NaN; a guard on l > 0 turns it into "
                   "0). Load only keys j < seq_len, and give the others the score -inf: "
                   "tl.load(..., mask=offs < seq_len, other=0.0), the block table entry too.",
                   "read keys or values past the sequence's end (padding slots)")


_IGNORED_SPLITS = Mistake(
    "ignored-n_splits", "n_splits must split each sequence's keys across programs: with n_splits "
    "chunks there is (at least) one program per (split, sequence, kv head), e.g. a grid "
    "(n_splits, B * H_kv) or (n_splits, B * H), each taking one chunk of the keys, and a merge "
    "after. One program per (sequence, head) that walks all the keys, as notebook 09's kernel "
    "does, ignores the split.",
    "the kernel ignores n_splits: too few programs for the chunks asked for")


def _check_programs(t: Trial, c: dict, programs: int | None) -> None:
    """Fail when the launches that read the cache started fewer programs than the split asks
    (``programs``, observed by the watcher: ``t.fail_observed``)."""
    n_splits = c["n_splits"]
    if not isinstance(n_splits, int) or n_splits < 2 or _type(programs) is not int:
        return  # programs comes from the notebook's process: anything but an int is not a count
    B, H_kv = c["q"].shape[0], c["k_pages"].shape[2]
    need = n_splits * B * H_kv
    if programs < need:
        t.fail_observed(f"the right output, but your kernels that read the cache launched {programs} "
                        f"program(s) in all; n_splits={n_splits} with B={B} sequences and H_kv={H_kv} kv "
                        f"heads needs at least n_splits * B * H_kv = {need}, one per (split, sequence, kv "
                        "head).", _IGNORED_SPLITS)


_RECIPE = ("program (split, b, kv head): seq_len = tl.load(SeqLens + b); chunk [lo, hi) of "
           "cdiv(seq_len, n_splits) keys; per tile: block = tl.load(BlockTables + b * stride + "
           "offs // PAGE, mask=offs < hi); k, v = tl.load(K + block * stride_blk + (offs % PAGE) * "
           "stride_slot + kv_head * stride_h + offs_d, mask=...); online softmax in m, l, acc; "
           "store acc / l and lse = m + log(l) (0 and -inf when empty); merge with weights "
           "exp(lse_c - logsumexp(lse)).")


@exercise(time_limit=TRITON_TIME_LIMIT_S)
def paged_decode_triton(t: Trial) -> None:
    t.error_hints = _TRITON_ERRORS
    t.forbidden_references = set(_COURSE_FUNCTIONS)
    dev = kernel_device()
    passed: list[int] = []
    for i, c in enumerate(_cases(dev)):
        args = c["args"]
        case = describe_case(**dict(zip(_ARGS, args)), n_splits=c["n_splits"],
                             sm_scale=c["sm_scale"]) + f" (lengths {c['seq_lens'].tolist()})"
        __tracebackhide__ = True
        warm_up()
        got, seen = t.call_watched(watchers.decode, (*args, c["n_splits"], c["sm_scale"]),
                                   {"is_reference": t.is_reference}, case=f"{case} on {dev.type}")
        _fail_watched(t, seen["failures"], _WATCHED)
        expected, dtype = c["expected"], c["dtype"]
        tol = _tol(dtype, dev, "fwd")
        diagnosis = ""
        if isinstance(got, torch.Tensor) and got.dtype != dtype and got.shape == expected.shape:
            t.fail(f"out: expected dtype {dtype} (q's dtype), got {got.dtype}.",
                   Mistake("wrong-dtype", "allocate out like q (torch.empty_like(q)) and convert "
                           "the float32 result when you store it (.to(Out.dtype.element_ty)).",
                           "returned the output in another dtype than q's"))
        if (_type(got) is _Tensor and got.shape == expected.shape and got.device.type == dev.type
                and got.dtype == dtype):
            diagnosis = (_matched(got, c["models"], tol, expected)
                         or _nan_hint(c, got.detach().cpu(), expected.detach().cpu(), passed))
            close = _isclose(got.detach().double().cpu(), expected.double().cpu(), **tol)
            if not diagnosis and not bool(close.all()) and i == 2 and 1 in passed:
                diagnosis = Mistake("split-or-merge", "the same inputs gave the right output with "
                                    "n_splits=1 (the case before): the chunks or their merge are "
                                    "wrong. The chunks must cover keys 0..seq_len-1 once, each "
                                    "normalised by its own l, and the merge weighs chunk c by "
                                    "exp(lse_c - logsumexp(lse)).",
                                    "wrong with several chunks, right with one")
        t.tensor(got, expected, what="out", hint=_RECIPE, diagnosis=diagnosis, **tol)
        _check_programs(t, c, seen.get("programs"))
        if max(c["seq_lens"].tolist()) > 1:
            written = {id(got): set(seen["written"][0])} if seen["written"] else {}
            _written_by_kernel(t, written, got, "out", {"q", "k", "v"})
        passed.append(i)
