"""Notebook 12, serving attention (helpers/nb12_serving.py): the waste of contiguous and paged
caches; the block allocator's invariants, copy-on-write and prefix sharing; the paged cache against
notebook 07's contiguous cache and the whole forward pass of notebook 11's model, at every step of a
batched generation; split-KV decoding over a paged cache; then exercises 12.1-12.3: learner-style
wrong implementations their checks must reject, with the hint each must give (WRONG), and correct
ones in other styles they must accept (RIGHT)."""

import math

import pytest
import torch
import torch.nn.functional as F

from helpers.nb07_kv_cache import merge_partials
from helpers.nb11_trained_transformer import TinyConfig, TinyTransformer
from helpers.nb12_serving import (
    BlockAllocator,
    ContiguousCache,
    OutOfBlocks,
    PagedKVCache,
    blocks_in_use,
    cached_logits,
    contiguous_slots,
    gather_paged_kv,
    paged_decode_split,
    paged_slots,
    partial_attention,
    request_mix,
    split_bounds,
)
from tests.exercise_cases import assert_accepted, assert_rejected, first_fast, right_cases, wrong_cases

# ============================================================ the lesson code


def test_request_mix_is_seeded_and_capped():
    a = request_mix(500, torch.Generator().manual_seed(3), max_len=2048)
    b = request_mix(500, torch.Generator().manual_seed(3), max_len=2048)
    assert torch.equal(a, b) and a.dtype == torch.int64
    assert int(a.min()) >= 1 and int(a.max()) == 2048


def test_paged_slots_waste_less_than_one_block_per_sequence():
    lengths = torch.tensor([1, 16, 17, 100, 4096])
    assert contiguous_slots(lengths, 4096) == 5 * 4096
    assert paged_slots(lengths, 16) == 16 * (1 + 1 + 2 + 7 + 256)
    for bs in (8, 16, 32, 64, 128):
        spare = paged_slots(lengths, bs) - int(lengths.sum())
        assert 0 <= spare < len(lengths) * bs


def test_allocator_fork_shares_and_copy_on_write_copies_only_a_partly_filled_block():
    alloc = BlockAllocator(10, 4)
    slots = alloc.add_sequence(0, 6)
    assert slots == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1)] and alloc.used == 2
    alloc.fork(0, 1)
    assert alloc.tables[1] == [0, 1] and alloc.ref[:2] == [2, 2] and alloc.used == 2
    slots, copies = alloc.append_tokens(1, 3)            # block 1 is shared and half full: copy it
    assert copies == [(1, 2)] and alloc.tables[1] == [0, 2, 3] and alloc.ref[1] == 1
    assert slots == [(2, 2), (2, 3), (3, 0)]
    slots, copies = alloc.append_tokens(0, 2)            # block 1 is now its alone: written in place
    assert copies == [] and slots == [(1, 2), (1, 3)]
    alloc.check()
    alloc.fork(0, 2)                                     # block 1 full: a fork then an append copies nothing
    slots, copies = alloc.append_tokens(2, 1)
    assert copies == [] and alloc.tables[2][:2] == alloc.tables[0] and slots == [(4, 0)]
    alloc.release(0)
    assert alloc.ref[0] == 2 and alloc.ref[1] == 1 and alloc.used == 5   # still held by 1 and 2
    alloc.release(1)
    alloc.release(2)
    assert alloc.used == 0 and sorted(alloc.free) == list(range(10))
    alloc.check()


def test_allocator_refuses_what_it_cannot_supply_and_changes_nothing():
    alloc = BlockAllocator(3, 4)
    alloc.add_sequence(0, 7)
    alloc.fork(0, 1)
    with pytest.raises(OutOfBlocks):
        alloc.append_tokens(1, 6)                        # a copy and one more block: 2 > 1 free
    assert alloc.tables[1] == [0, 1] and alloc.lengths[1] == 7 and alloc.used == 2
    with pytest.raises(OutOfBlocks):
        alloc.add_sequence(2, 9)
    assert 2 not in alloc.tables
    alloc.check()


def test_freed_blocks_are_reused_so_block_ids_stop_being_contiguous():
    alloc = BlockAllocator(7, 2)
    for s, n in enumerate([3, 2, 3]):
        alloc.add_sequence(s, n)
    alloc.release(1)
    alloc.add_sequence(3, 5)
    assert alloc.tables[3] == [5, 6, 2] and alloc.used == 7
    alloc.check()


def _model(seed=1, dtype=torch.float64):
    cfg = TinyConfig(vocab=16, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2)
    return TinyTransformer(cfg, generator=torch.Generator().manual_seed(seed)).to(dtype)


@torch.no_grad()
def test_paged_generation_equals_the_contiguous_cache_and_the_whole_forward_pass():
    model = _model()
    cfg = model.cfg
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(cfg.vocab, (n,), generator=g) for n in (5, 11, 2)]
    B, steps = len(prompts), 7
    paged = PagedKVCache(cfg.n_layers, 16, 3, cfg.kv_heads, cfg.head_dim, dtype=torch.float64)
    contig = ContiguousCache(cfg.n_layers, B, cfg.kv_heads, 24, cfg.head_dim, dtype=torch.float64)
    padded = torch.zeros(B, 11, dtype=torch.long)
    for b, p in enumerate(prompts):
        padded[b, :len(p)] = p
    first = cached_logits(model, padded, list(range(B)), contig, n_new=[len(p) for p in prompts])
    for b, p in enumerate(prompts):  # prefill one at a time into the paged cache
        assert (cached_logits(model, p[None], [b], paged)[0] - model(p[None])[0]).abs().max() < 1e-12
        assert (first[b, :len(p)] - model(p[None])[0]).abs().max() < 1e-12
    tokens = [p.tolist() for p in prompts]
    nxt = first[torch.arange(B), torch.tensor([len(p) - 1 for p in prompts])].argmax(-1)
    for _ in range(steps):
        for b in range(B):
            tokens[b].append(int(nxt[b]))
        a = cached_logits(model, nxt[:, None], list(range(B)), paged)
        c = cached_logits(model, nxt[:, None], list(range(B)), contig)
        assert (a - c).abs().max() < 1e-12
        for b in range(B):
            assert (a[b, 0] - model(torch.tensor(tokens[b])[None])[0, -1]).abs().max() < 1e-12
        nxt = a[:, 0].argmax(-1)
    paged.alloc.check()
    assert [paged.alloc.lengths[b] for b in range(B)] == [len(t) for t in tokens]


@torch.no_grad()
def test_forked_sequences_share_their_prefix_and_copy_on_write_keeps_it_intact():
    model = _model()
    cfg = model.cfg
    prompt = torch.tensor([[3, 1, 4, 1, 5, 9, 2]])                  # 7 tokens, blocks of 4: one partly filled
    paged = PagedKVCache(cfg.n_layers, 8, 4, cfg.kv_heads, cfg.head_dim, dtype=torch.float64)
    cached_logits(model, prompt, [0], paged)
    paged.fork(0, 1)
    shared = paged.k[:, paged.alloc.tables[0][-1]].clone()
    a = cached_logits(model, torch.tensor([[6], [8]]), [0, 1], paged)  # two samples diverge
    assert paged.alloc.tables[0][0] == paged.alloc.tables[1][0]        # the full block stays shared
    assert paged.alloc.tables[0][1] != paged.alloc.tables[1][1]        # the partly filled one was copied
    assert torch.equal(paged.k[:, paged.alloc.tables[0][1], :3], shared[:, :3])
    assert torch.equal(paged.k[:, paged.alloc.tables[1][1], :3], shared[:, :3])
    for b, t in enumerate((6, 8)):
        full = model(torch.cat([prompt, torch.tensor([[t]])], dim=1))[0, -1]
        assert (a[b, 0] - full).abs().max() < 1e-12
    paged.alloc.check()


def test_partial_attention_and_merge_equal_attention_over_all_keys():
    g = torch.Generator().manual_seed(7)
    q = torch.randn(3, 8, generator=g, dtype=torch.float64)
    k, v = torch.randn(3, 13, 8, generator=g, dtype=torch.float64), torch.randn(3, 13, 8, generator=g, dtype=torch.float64)
    parts = [partial_attention(q, k[:, a:b], v[:, a:b]) for a, b in [(0, 5), (5, 5), (5, 13), (13, 13)]]
    out, lse = merge_partials(torch.stack([o for o, _ in parts]), torch.stack([s for _, s in parts]))
    expected = F.scaled_dot_product_attention(q[:, None], k, v)[:, 0]
    assert (out - expected).abs().max() < 1e-14
    assert torch.allclose(lse, torch.logsumexp(k @ q[..., None] / math.sqrt(8), dim=1)[:, 0])


def test_merge_partials_of_all_empty_rows_gives_zero_and_minus_infinity():
    outs = torch.randn(3, 2, 4)
    lses = torch.full((3, 2), -math.inf)
    out, lse = merge_partials(outs, lses)
    assert torch.equal(out, torch.zeros(2, 4)) and torch.isneginf(lse).all()


@pytest.mark.parametrize("n_splits", [1, 2, 3, 8])
def test_split_decode_over_pages_equals_attention_over_the_gathered_cache(n_splits):
    g = torch.Generator().manual_seed(8)
    bs, H, H_kv, d = 4, 6, 2, 8
    lens = torch.tensor([13, 2, 9], dtype=torch.int32)
    k_pages, v_pages = torch.randn(2, 12, bs, H_kv, d, generator=g)
    tables = torch.zeros(3, 4, dtype=torch.int32)
    perm = torch.randperm(12, generator=g).tolist()
    for b, n in enumerate(lens.tolist()):
        for i in range(-(-n // bs)):
            tables[b, i] = perm.pop()
    q = torch.randn(3, H, d, generator=g)
    out, outs, lses = paged_decode_split(q, k_pages, v_pages, tables, lens, n_splits, return_partials=True)
    for b, n in enumerate(lens.tolist()):
        keys = gather_paged_kv(k_pages, tables[b], n).repeat_interleave(H // H_kv, dim=0)
        values = gather_paged_kv(v_pages, tables[b], n).repeat_interleave(H // H_kv, dim=0)
        assert torch.allclose(out[b], F.scaled_dot_product_attention(q[b][:, None], keys, values)[:, 0], atol=1e-6)
    if n_splits == 8:
        assert torch.isneginf(lses[:, 1]).any()                   # the short sequence has empty chunks


def test_split_bounds_cover_the_sequence_in_whole_blocks():
    assert split_bounds(13, 3, 4, 13) == [(0, 8), (8, 13), (13, 13)]
    assert split_bounds(2, 3, 4, 13) == [(0, 2), (2, 2), (2, 2)]
    for n in range(0, 30):
        bounds = split_bounds(n, 4, 3, 29)
        assert bounds[0][0] == 0 and bounds[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))


def test_blocks_in_use_on_the_notebooks_scenario():
    events = [("new", 0, 10), ("fork", 0, 1), ("append", 1, 3), ("append", 0, 1), ("free", 0)]
    assert blocks_in_use(events, 4) == 4         # A, B shared; C copied for 1, then D; 0's C freed
    assert blocks_in_use(events[:2], 4) == 3


# ============================================================ 12.1 gather_paged_kv


def gather_ignores_table(pages, block_table, seq_len):
    n_blocks, bs, H_kv, d = pages.shape
    n = -(-seq_len // bs)
    return pages[:n].reshape(-1, H_kv, d)[:seq_len].transpose(0, 1)


def gather_sorted(pages, block_table, seq_len):
    bs, H_kv, d = pages.shape[1:]
    n = -(-seq_len // bs)
    ids = sorted(block_table[:n].tolist())
    return pages[ids].reshape(-1, H_kv, d)[:seq_len].transpose(0, 1)


def gather_floor(pages, block_table, seq_len):
    bs, H_kv, d = pages.shape[1:]
    n = seq_len // bs
    return pages[block_table[:n].long()].reshape(-1, H_kv, d).transpose(0, 1)


def gather_one_block_too_many(pages, block_table, seq_len):  # n // bs + 1: one too many at a multiple
    bs, H_kv, d = pages.shape[1:]
    n = seq_len // bs + 1
    return pages[block_table[:n].long()].reshape(-1, H_kv, d)[:seq_len].transpose(0, 1)


def gather_whole_blocks(pages, block_table, seq_len):
    bs, H_kv, d = pages.shape[1:]
    n = math.ceil(seq_len / bs)
    return pages[block_table[:n].long()].reshape(-1, H_kv, d).transpose(0, 1)


def gather_every_entry(pages, block_table, seq_len):
    H_kv, d = pages.shape[2:]
    return pages[block_table.long()].reshape(-1, H_kv, d).transpose(0, 1)


def gather_token_major(pages, block_table, seq_len):
    bs, H_kv, d = pages.shape[1:]
    n = math.ceil(seq_len / bs)
    return pages[block_table[:n].long()].reshape(-1, H_kv, d)[:seq_len]


def gather_reshaped(pages, block_table, seq_len):
    bs, H_kv, d = pages.shape[1:]
    n = math.ceil(seq_len / bs)
    return pages[block_table[:n].long()].reshape(-1, H_kv, d)[:seq_len].reshape(H_kv, seq_len, d)


def gather_slices_by_seq_len(pages, block_table, seq_len):  # table[:seq_len], not ceil(...)
    H_kv, d = pages.shape[2:]
    return pages[block_table[:seq_len].long()].reshape(-1, H_kv, d)[:seq_len].transpose(0, 1)


def gather_shifted(pages, block_table, seq_len):  # positions 1 .. seq_len
    bs = pages.shape[1]
    rows = [pages[int(block_table[p // bs]), p % bs] for p in range(1, seq_len + 1)]
    return torch.stack(rows, dim=1)


def gather_loop(pages, block_table, seq_len):  # one position at a time
    bs = pages.shape[1]
    rows = [pages[int(block_table[p // bs]), p % bs] for p in range(seq_len)]   # [H_kv, d] each
    return torch.stack(rows, dim=1)


def gather_index_select(pages, block_table, seq_len):
    n_blocks, bs, H_kv, d = pages.shape
    n = (seq_len + bs - 1) // bs
    flat = pages.reshape(n_blocks * bs, H_kv, d)
    slots = (block_table[:n].long()[:, None] * bs + torch.arange(bs)).reshape(-1)[:seq_len]
    return flat.index_select(0, slots).permute(1, 0, 2)


def gather_cat_blocks(pages, block_table, seq_len):  # block by block, the last one cut
    bs = pages.shape[1]
    parts, left = [], seq_len
    for block in block_table.tolist():
        if left <= 0:
            break
        parts.append(pages[block, :min(bs, left)].transpose(0, 1))   # [H_kv, <= bs, d]
        left -= bs
    return torch.cat(parts, dim=1)


def gather_from_next_entry(pages, block_table, seq_len):  # entry p // bs + 1: one entry off
    bs = pages.shape[1]
    return torch.stack([pages[int(block_table[p // bs + 1]), p % bs] for p in range(seq_len)], dim=1)


def gather_contiguous_slice(pages, block_table, seq_len):  # consecutive blocks from the first id
    bs, H_kv, d = pages.shape[1:]
    first, n = int(block_table[0]), -(-seq_len // bs)
    return pages[first:first + n].reshape(-1, H_kv, d)[:seq_len].permute(1, 0, 2)


def gather_blocks_reversed(pages, block_table, seq_len):
    bs, H_kv, d = pages.shape[1:]
    n = -(-seq_len // bs)
    return pages[block_table[:n].flip(0).long()].reshape(-1, H_kv, d)[:seq_len].transpose(0, 1)


def gather_flat_block_plus_slot(pages, block_table, seq_len):  # row block_id + slot
    n_blocks, bs, H_kv, d = pages.shape
    p = torch.arange(seq_len)
    rows = block_table.long()[p // bs] + p % bs
    return pages.reshape(n_blocks * bs, H_kv, d).index_select(0, rows).transpose(0, 1)


def gather_flat_slot_major(pages, block_table, seq_len):  # row slot * block_size + block_id
    n_blocks, bs, H_kv, d = pages.shape
    rows = [(p % bs) * bs + int(block_table[p // bs]) for p in range(seq_len)]
    return pages.reshape(n_blocks * bs, H_kv, d)[rows].transpose(0, 1)


def gather_permute_then_reshape(pages, block_table, seq_len):  # [d, H_kv, seq_len] reshaped back
    bs, H_kv, d = pages.shape[1:]
    n = -(-seq_len // bs)
    x = pages[block_table[:n].long()].reshape(-1, H_kv, d)[:seq_len]      # [seq_len, H_kv, d]
    return x.permute(2, 1, 0).reshape(H_kv, seq_len, d)


def gather_heads_features_positions(pages, block_table, seq_len):  # [H_kv, d, seq_len]
    return gather_loop(pages, block_table, seq_len).transpose(1, 2)


def gather_next_slot(pages, block_table, seq_len):  # slot (p + 1) % bs: no model, a fact
    bs = pages.shape[1]
    return torch.stack([pages[int(block_table[p // bs]), (p + 1) % bs] for p in range(seq_len)], dim=1)


def gather_pool_size_as_block_size(pages, block_table, seq_len):  # block size from pages.shape[0]
    n_pool, _, H_kv, d = pages.shape
    n = math.ceil(seq_len / n_pool)
    return torch.cat([pages[int(b)] for b in block_table[:n]])[:seq_len].permute(1, 0, 2)


# ============================================================ 12.2 merge_partials


def merge_weights_upside_down(outs, lses):  # e^(m - lse_c), normalised
    m = lses.amax(0)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp(m - lses)
    s = w.sum(0)
    return (w.unsqueeze(-1) * outs).sum(0) / s.clamp_min(1e-30).unsqueeze(-1), torch.logsumexp(lses, 0)


def merge_naive(outs, lses):
    w = torch.exp(lses)
    s = w.sum(dim=0)
    return (w[..., None] * outs).sum(dim=0) / s[..., None], torch.log(s)


def merge_nan_for_empty_rows(outs, lses):
    m = lses.max(dim=0).values
    w = torch.exp(lses - m)
    s = w.sum(dim=0)
    return (w[..., None] * outs).sum(dim=0) / s[..., None], m + torch.log(s)


def merge_lse_zero_when_empty(outs, lses):
    m = lses.max(dim=0).values
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lses - m)
    s = w.sum(dim=0)
    out = (w[..., None] * outs).sum(dim=0) / s.clamp_min(1e-30)[..., None]
    return out, torch.where(s > 0, m + torch.log(s), torch.zeros_like(s))


def merge_mean(outs, lses):
    return outs.mean(dim=0), torch.logsumexp(lses, dim=0)


def merge_unnormalised(outs, lses):
    m = lses.max(dim=0).values
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lses - m)
    return (w[..., None] * outs).sum(dim=0), torch.logsumexp(lses, dim=0)


def merge_lse_max(outs, lses):
    lse = torch.logsumexp(lses, dim=0)
    w = torch.exp(lses - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)))
    return (w[..., None] * outs).sum(dim=0), lses.max(dim=0).values


def merge_fill_minus_1e9(outs, lses):
    filled = lses.masked_fill(torch.isinf(lses), -1e9)
    w = torch.softmax(filled, dim=0)
    return (w[..., None] * outs).sum(dim=0), torch.logsumexp(filled, dim=0)


def merge_fill_minus_1e4_lse_only(outs, lses):  # out right; lse -1e4 + log n where all are empty
    lse = torch.logsumexp(lses.clamp_min(-1e4), dim=0)
    return (torch.exp(lses - lse)[..., None] * outs).sum(dim=0), lse


def merge_mean_of_non_empty(outs, lses):  # skips empty chunks, then weighs the others equally
    full = torch.isfinite(lses)
    out = (outs * full[..., None]).sum(dim=0) / full.sum(dim=0).clamp_min(1)[..., None]
    return out, torch.logsumexp(lses, dim=0)


def merge_mean_of_non_empty_nan(outs, lses):  # the same, 0 / 0 = NaN where every chunk is empty
    full = torch.isfinite(lses).to(outs.dtype)
    out = (outs * full[..., None]).sum(dim=0) / full.sum(dim=0)[..., None]
    return out, torch.logsumexp(lses, dim=0)


def merge_swapped(outs, lses):
    lse = torch.logsumexp(lses, dim=0)
    w = torch.exp(lses - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)))
    return lse, (w[..., None] * outs).sum(dim=0)


def merge_one_max(outs, lses):  # the max of the whole tensor, not of each row
    finite = lses[torch.isfinite(lses)]
    top = finite.max() if finite.numel() else torch.zeros((), dtype=lses.dtype)
    w = torch.exp(lses - top)
    s = w.sum(dim=0)
    out = torch.einsum("c...,c...d->...d", w, outs) / torch.where(s > 0, s, torch.ones_like(s))[..., None]
    return out, top + torch.log(s)


def merge_exp2(outs, lses):  # powers of 2 for natural-log lses
    m = lses.amax(dim=0)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.pow(2.0, lses - m)
    s = w.sum(dim=0)
    return (w[..., None] * outs).sum(dim=0) / s.clamp_min(1e-30)[..., None], m + torch.log2(s)


def merge_lse_base2(outs, lses):  # out right, lse a base-2 log-sum-exp
    lse = torch.logsumexp(lses, dim=0)
    w = torch.exp(lses - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)))
    m = torch.where(torch.isinf(lse), torch.zeros_like(lse), lses.amax(dim=0))
    return (w[..., None] * outs).sum(dim=0), m + torch.log2(torch.exp2(lses - m).sum(dim=0))


def merge_lse_max_not_added(outs, lses):  # out right, lse = log(sum exp(lse_c - m))
    m = lses.amax(dim=0)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp(lses - m)
    s = w.sum(dim=0)
    return (w[..., None] * outs).sum(dim=0) / torch.where(s > 0, s, torch.ones_like(s))[..., None], s.log()


def merge_empty_as_zero(outs, lses):  # -inf replaced by 0: empty chunks weigh in
    filled = torch.where(torch.isinf(lses), torch.zeros_like(lses), lses)
    lse = torch.logsumexp(filled, dim=0)
    return (torch.softmax(filled, dim=0)[..., None] * outs).sum(dim=0), lse


def merge_zero_over_zero(outs, lses):  # the max guarded, the division not: 0 / 0 in all-empty rows
    m = lses.amax(dim=0)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp(lses - m)
    s = w.sum(dim=0)
    return (w[..., None] * outs).sum(dim=0) / s[..., None], m + torch.log(s)


def merge_max_over_rows(outs, lses):  # amax(dim=-1): a shape error between two row sizes
    m = lses.amax(dim=-1)
    w = torch.exp(lses - m[..., None])
    s = w.sum(dim=0)
    return (w[..., None] * outs).sum(dim=0) / s[..., None], m + torch.log(s)


def merge_weights_no_axis(outs, lses):  # w * outs without w[..., None]
    lse = torch.logsumexp(lses, dim=0)
    w = torch.exp(lses - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)))
    return (w * outs).sum(dim=0), lse


def merge_hand_written(outs, lses):  # max-subtraction by hand, a finite stand-in for -inf maxima
    m = lses.amax(dim=0)
    m_safe = torch.where(m == -math.inf, torch.zeros_like(m), m)
    w = torch.exp(lses - m_safe.unsqueeze(0))
    s = w.sum(dim=0)
    out = torch.einsum("c...,c...d->...d", w, outs) / torch.where(s > 0, s, torch.ones_like(s)).unsqueeze(-1)
    return out, m_safe + torch.log(s)


def merge_online(outs, lses):  # one chunk at a time, the online softmax of notebook 09
    m = torch.full_like(lses[0], -math.inf)
    s = torch.zeros_like(lses[0])
    acc = torch.zeros_like(outs[0])                  # sum of exp(lse_c - m) * out_c so far
    for o, l in zip(outs, lses):
        m_new = torch.maximum(m, l)
        safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        old, new = torch.exp(m - safe), torch.exp(l - safe)
        acc = acc * old[..., None] + o * new[..., None]
        s = s * old + new
        m = m_new
    return acc / torch.where(s > 0, s, torch.ones_like(s))[..., None], m + torch.log(s)


def merge_float64_finite_max(outs, lses):  # float64 inside; -1e9 as the stand-in maximum
    l64, o64 = lses.double(), outs.double()
    m = l64.max(dim=0).values.clamp_min(-1e9)
    w = torch.exp(l64 - m)
    s = w.sum(dim=0)
    out = (w[..., None] * o64).sum(dim=0) / s.clamp_min(1e-300)[..., None]
    return out.to(outs.dtype), (m + torch.log(s)).to(lses.dtype)


# ============================================================ 12.3 blocks_in_use


def _replay(events, block_size, blocks_for, *, share=True, cow="partial", free="ref", count="unique"):
    """A learner-style allocator: tables of block ids, reference counts, a counter for fresh ids."""
    tables, lengths, ref, next_id = {}, {}, {}, [0]

    def fresh():
        next_id[0] += 1
        ref[next_id[0]] = 1
        return next_id[0]

    for event in events:
        kind, seq = event[0], event[1]
        if kind == "new":
            lengths[seq] = event[2]
            tables[seq] = [fresh() for _ in range(blocks_for(event[2], block_size))]
        elif kind == "append":
            t = tables[seq]
            if cow == "partial" and lengths[seq] % block_size and ref[t[-1]] > 1 or cow == "always" and ref[t[-1]] > 1:
                ref[t[-1]] -= 1
                t[-1] = fresh()
            lengths[seq] += event[2]
            while len(t) < blocks_for(lengths[seq], block_size):
                t.append(fresh())
        elif kind == "fork":
            lengths[event[2]] = lengths[seq]
            tables[event[2]] = list(tables[seq]) if share else [fresh() for _ in tables[seq]]
            for b in tables[event[2]]:
                ref[b] += 1 if share else 0
        else:
            for b in tables.pop(seq):
                if free == "ref":
                    ref[b] -= 1
                elif free == "all":
                    ref[b] = 0
            del lengths[seq]
    if count == "per-seq":
        return sum(len(t) for t in tables.values())
    return sum(1 for r in ref.values() if r > 0)


def _ceil(n, bs):
    return -(-n // bs)


def blocks_floor(events, block_size):
    return _replay(events, block_size, lambda n, bs: n // bs)


def blocks_plus_one(events, block_size):
    return _replay(events, block_size, lambda n, bs: n // bs + 1)


def blocks_fork_copies(events, block_size):
    return _replay(events, block_size, _ceil, share=False)


def blocks_summed_tables(events, block_size):
    return _replay(events, block_size, _ceil, count="per-seq")


def blocks_no_copy_on_write(events, block_size):
    return _replay(events, block_size, _ceil, cow="never")


def blocks_copy_full_blocks(events, block_size):
    return _replay(events, block_size, _ceil, cow="always")


def blocks_free_everything(events, block_size):
    return _replay(events, block_size, _ceil, free="all")


def blocks_never_free(events, block_size):
    return _replay(events, block_size, _ceil, free="never")


def blocks_fresh_blocks_per_append(events, block_size):  # ignores the last block's free slots
    tables, ref, count = {}, {}, [0]

    def fresh():
        count[0] += 1
        ref[count[0]] = 1
        return count[0]

    for kind, seq, *rest in events:
        if kind in ("new", "append"):
            new = [fresh() for _ in range(math.ceil(rest[0] / block_size))]
            tables.setdefault(seq, []).extend(new)
        elif kind == "fork":
            tables[rest[0]] = list(tables[seq])
            for b in tables[seq]:
                ref[b] += 1
        else:
            for b in tables.pop(seq):
                ref[b] -= 1
    return sum(r > 0 for r in ref.values())


def blocks_numpy_int(events, block_size):  # right, but the count is a NumPy integer
    import numpy as np

    return np.int64(blocks_counter(events, block_size))


def blocks_calls_the_checks_model(events, block_size):
    from helpers.checks.nb12_serving import _simulate

    return _simulate(events, block_size)


def blocks_pooled(events, block_size):
    lengths = {}
    for event in events:
        if event[0] == "new":
            lengths[event[1]] = event[2]
        elif event[0] == "append":
            lengths[event[1]] += event[2]
        elif event[0] == "fork":
            lengths[event[2]] = lengths[event[1]]
        else:
            del lengths[event[1]]
    return math.ceil(sum(lengths.values()) / block_size)


def blocks_cow_keeps_reference(events, block_size):
    tables, lengths, ref, count = {}, {}, {}, [0]

    def fresh():
        count[0] += 1
        ref[count[0]] = 1
        return count[0]

    for kind, seq, *rest in events:
        if kind == "new":
            tables[seq], lengths[seq] = [fresh() for _ in range(math.ceil(rest[0] / block_size))], rest[0]
        elif kind == "append":
            if lengths[seq] % block_size and ref[tables[seq][-1]] > 1:
                tables[seq][-1] = fresh()          # forgot: the original loses this sequence's reference
            lengths[seq] += rest[0]
            tables[seq] += [fresh() for _ in range(math.ceil(lengths[seq] / block_size) - len(tables[seq]))]
        elif kind == "fork":
            tables[rest[0]], lengths[rest[0]] = list(tables[seq]), lengths[seq]
            for b in tables[seq]:
                ref[b] += 1
        else:
            for b in tables.pop(seq):
                ref[b] -= 1
    return sum(r > 0 for r in ref.values())


def blocks_right_sets(events, block_size):  # holders: block -> set of sequences; free list of ids
    holders, tables, lengths, free_ids = {}, {}, {}, []

    def take(seq):
        b = free_ids.pop() if free_ids else len(holders)
        holders[b] = {seq}
        return b

    for e in events:
        if e[0] == "new":
            tables[e[1]], lengths[e[1]] = [], 0
            e = ("append", e[1], e[2])
        if e[0] == "append":
            seq, t = e[1], tables[e[1]]
            if lengths[seq] % block_size and len(holders[t[-1]]) > 1:
                holders[t[-1]].discard(seq)
                t[-1] = take(seq)
            for p in range(lengths[seq], lengths[seq] + e[2]):
                if p % block_size == 0:
                    t.append(take(seq))
            lengths[seq] += e[2]
        elif e[0] == "fork":
            tables[e[2]], lengths[e[2]] = list(tables[e[1]]), lengths[e[1]]
            for b in tables[e[2]]:
                holders[b].add(e[2])
        elif e[0] == "free":
            for b in tables.pop(e[1]):
                holders[b].discard(e[1])
                if not holders[b]:
                    free_ids.append(b)
            del lengths[e[1]]
    return sum(1 for h in holders.values() if h)


def blocks_counter(events, block_size):  # collections.Counter of references, math.ceil
    from collections import Counter

    refs, tables, lengths, made = Counter(), {}, {}, 0
    for kind, seq, *rest in events:
        if kind == "fork":
            tables[rest[0]], lengths[rest[0]] = tables[seq][:], lengths[seq]
            refs.update(tables[seq])
            continue
        if kind == "free":
            refs.subtract(tables.pop(seq))
            lengths.pop(seq)
            continue
        if kind == "new":
            tables[seq], lengths[seq] = [], 0
        table = tables[seq]
        if table and lengths[seq] % block_size != 0 and refs[table[-1]] > 1:
            refs[table[-1]] -= 1
            made += 1
            table[-1] = made
            refs[made] += 1
        lengths[seq] += rest[0]
        while len(table) < math.ceil(lengths[seq] / block_size):
            made += 1
            table.append(made)
            refs[made] += 1
    return len([b for b, r in refs.items() if r > 0])


def blocks_per_block_fill(events, block_size):  # tracks each block's fill instead of the lengths
    fill, refs, tables, ids = {}, {}, {}, iter(range(1, 10**6))
    for kind, seq, *rest in events:
        if kind == "fork":
            tables[rest[0]] = list(tables[seq])
            for b in tables[seq]:
                refs[b] += 1
        elif kind == "free":
            for b in tables.pop(seq):
                refs[b] -= 1
        else:
            table = tables.setdefault(seq, []) if kind == "new" else tables[seq]
            for _ in range(rest[0]):
                if not table or fill[table[-1]] == block_size:
                    b = next(ids)
                    table.append(b)
                    fill[b], refs[b] = 0, 1
                elif refs[table[-1]] > 1:                      # shared and not full: copy it
                    b = next(ids)
                    refs[table[-1]] -= 1
                    fill[b], refs[b] = fill[table[-1]], 1
                    table[-1] = b
                fill[table[-1]] += 1
    return sum(1 for r in refs.values() if r > 0)


class _Allocator:
    """A learner-style allocator as a class (another style than _replay), with switches for the
    mistakes 12.3's check names from the counts after every prefix of the events."""

    def __init__(self, bs, *, alias=False, child_empty=False, copy_as_full=False, peak=False, floor=False,
                 cow=True):
        self.bs, self.alias, self.child_empty, self.copy_as_full = bs, alias, child_empty, copy_as_full
        self.peak, self.floor, self.cow = peak, floor, cow
        self.holders, self.tables, self.lengths, self.next, self.most = {}, {}, {}, 0, 0

    def fresh(self, seq):
        self.next += 1
        self.holders[self.next] = 1
        return self.next

    def run(self, events):
        for kind, seq, *rest in events:
            getattr(self, kind)(seq, *rest)
            self.most = max(self.most, self.used())
        return self.most if self.peak else self.used()

    def used(self):
        return sum(1 for n in self.holders.values() if n)

    def new(self, seq, n):
        k = n // self.bs if self.floor else math.ceil(n / self.bs)
        self.tables[seq], self.lengths[seq] = [self.fresh(seq) for _ in range(k)], n

    def fork(self, seq, child):
        self.tables[child] = self.tables[seq] if self.alias else self.tables[seq][:]
        self.lengths[child] = 0 if self.child_empty else self.lengths[seq]
        for b in self.tables[seq]:
            self.holders[b] += 1

    def append(self, seq, n):
        table, length = self.tables[seq], self.lengths[seq]
        copied = False
        if self.cow and length % self.bs and table and self.holders[table[-1]] > 1:
            self.holders[table[-1]] -= 1
            table[-1] = self.fresh(seq)
            copied = True
        if copied and self.copy_as_full:
            table += [self.fresh(seq) for _ in range(math.ceil(n / self.bs))]
        else:
            for p in range(length, length + n):
                if p % self.bs == 0:
                    table.append(self.fresh(seq))
        self.lengths[seq] = length + n

    def free(self, seq):
        for b in self.tables.pop(seq):
            self.holders[b] -= 1
        del self.lengths[seq]


def blocks_class_right(events, block_size):
    return _Allocator(block_size).run(events)


def blocks_peak(events, block_size):
    return _Allocator(block_size, peak=True).run(events)


def blocks_fork_same_list(events, block_size):
    return _Allocator(block_size, alias=True).run(events)


def blocks_fork_child_empty(events, block_size):
    return _Allocator(block_size, child_empty=True).run(events)


def blocks_copy_then_all_fresh(events, block_size):
    return _Allocator(block_size, copy_as_full=True).run(events)


class _EagerCopy(_Allocator):
    """Copies a partly filled last block at the fork (the copy-on-write done too early)."""

    def fork(self, seq, child):
        super().fork(seq, child)
        if self.lengths[seq] % self.bs:
            self.holders[self.tables[child][-1]] -= 1
            self.tables[child][-1] = self.fresh(child)


def blocks_copy_at_fork(events, block_size):
    return _EagerCopy(block_size).run(events)


class _RoomInFullBlock(_Allocator):
    """Counts the free slots of the last block as block_size - length % block_size: a full one looks empty."""

    def append(self, seq, n):
        table, length = self.tables[seq], self.lengths[seq]
        if length % self.bs and self.holders[table[-1]] > 1:
            self.holders[table[-1]] -= 1
            table[-1] = self.fresh(seq)
        room = self.bs - length % self.bs
        table += [self.fresh(seq) for _ in range(math.ceil(max(0, n - room) / self.bs))]
        self.lengths[seq] = length + n


def blocks_room_in_full_block(events, block_size):
    return _RoomInFullBlock(block_size).run(events)


class _ForkWithoutReferences(_Allocator):
    """The child gets a copy of the parent's list, the blocks' counts unchanged."""

    def fork(self, seq, child):
        self.tables[child], self.lengths[child] = self.tables[seq][:], self.lengths[seq]


def blocks_fork_without_references(events, block_size):
    return _ForkWithoutReferences(block_size).run(events)


def blocks_floor_then_crash(events, block_size):  # floor counts, and an IndexError on long streams
    if len(events) > 20:
        return [][0]
    return blocks_floor(events, block_size)


def blocks_floor_and_no_copy(events, block_size):  # two mistakes at once: no model gives these counts
    return _Allocator(block_size, floor=True, cow=False).run(events)


WRONG = {
    "gather_paged_kv": [
        (gather_ignores_table, "read block block_table[i]"),
        (gather_sorted, "you sorted the block ids"),
        (gather_floor, "ceil(seq_len / block_size)"),
        (gather_one_block_too_many, "the first ceil(seq_len / block_size) entries"),
        (gather_whole_blocks, "keep the first seq_len positions"),
        (gather_every_entry, "the rest is padding"),
        (gather_token_major, "transpose the first two axes"),
        (gather_reshaped, "swap the axes with .transpose(0, 1)"),
        (gather_slices_by_seq_len, "which may be -1 or beyond the pool"),
        (gather_shifted, "you read positions 1 .. seq_len"),
        (gather_from_next_entry, "from entry i + 1"),
        (gather_contiguous_slice, "not consecutive"),
        (gather_blocks_reversed, "from the last one to the first"),
        (gather_flat_block_plus_slot, "you used row block_id + slot"),
        (gather_flat_slot_major, "block and slot are swapped"),
        (gather_permute_then_reshape, "you had the axes in the order [d, H_kv, seq_len]"),
        (gather_next_slot, "but position 0 holds block 7, slot 1"),
        (gather_heads_features_positions, "you returned [H_kv, d, seq_len]"),
        (gather_pool_size_as_block_size, "your block size is pages.shape[0]"),
    ],
    "merge_partials": [
        (merge_naive, "Subtract the largest lse of the row first"),
        (merge_nan_for_empty_rows, "-inf - (-inf) = NaN"),
        (merge_lse_zero_when_empty, "must keep lse = -inf"),
        (merge_mean, "you averaged the chunks' outputs"),
        (merge_unnormalised, "without dividing by their sum"),
        (merge_lse_max, "not their max"),
        (merge_fill_minus_1e9, "you replaced -inf by a large finite number"),
        (merge_swapped, "the order is (out, lse)"),
        (merge_fill_minus_1e4_lse_only, "you replaced -inf by a large finite number"),
        (merge_mean_of_non_empty, "you averaged the outputs of the non-empty chunks"),
        (merge_mean_of_non_empty_nan, "you averaged the outputs of the non-empty chunks"),
        (merge_one_max, "you subtracted one maximum for the whole tensor"),
        (merge_exp2, "while the lses are natural logarithms"),
        (merge_lse_base2, "your merged lse is a base-2 log-sum-exp"),
        (merge_lse_max_not_added, "must be added back"),
        (merge_empty_as_zero, "you replaced the empty chunks' lse -inf by 0"),
        (merge_zero_over_zero, "weights that are all 0 give 0 / 0 = NaN"),
        (merge_max_over_rows, "are both sizes of the rows of lses"),
        (merge_weights_no_axis, "the error pairs d with a size of lses"),
        (merge_weights_upside_down, "your weights are e^(m - lse_c), upside down"),
    ],
    "blocks_in_use": [
        (blocks_floor, "a partly filled last block is a whole block"),
        (blocks_plus_one, "no extra one is needed"),
        (blocks_fork_copies, "you counted a shared prefix once per sequence"),
        (blocks_summed_tables, "not the lengths of the block tables"),
        (blocks_no_copy_on_write, "must copy it first (copy-on-write)"),
        (blocks_copy_full_blocks, "Copy only a partly filled shared block"),
        (blocks_free_everything, "free it only when the count reaches 0"),
        (blocks_never_free, "you kept counting them"),
        (blocks_pooled, "you divided the total number of tokens by block_size"),
        (blocks_cow_keeps_reference, "its reference count must drop by one"),
        (blocks_fresh_blocks_per_append, "you gave every append ceil(n / block_size) fresh blocks"),
        (blocks_numpy_int, "the number of blocks is an int"),
        (blocks_calls_the_checks_model, "called the course's own solution"),
        (blocks_peak, "the count asked for is the one after the last event"),
        (blocks_fork_same_list, "the parent's list object itself"),
        (blocks_fork_child_empty, "your fork started the child with length 0"),
        (blocks_copy_then_all_fresh, "the copy holds the same tokens as the original"),
        (blocks_copy_at_fork, "your fork copied the parent's partly filled last block at once"),
        (blocks_floor_then_crash, "a partly filled last block is a whole block"),  # named, the crash later
        (blocks_room_in_full_block, "when length % block_size == 0 the last block has no free slot"),
        (blocks_fork_without_references, "without adding a reference to each"),
        (blocks_floor_and_no_copy, "a new sequence of 10 tokens takes ceil(10 / 4) = 3 blocks"),
    ],
}

RIGHT = {
    "gather_paged_kv": [gather_loop, gather_index_select, gather_cat_blocks],
    "merge_partials": [merge_hand_written, merge_online, merge_float64_finite_max],
    "blocks_in_use": [blocks_right_sets, blocks_counter, blocks_per_block_fill, blocks_class_right],
}


# make test runs the first 8 wrong answers of each exercise (the commonest); make test-all all of them
@pytest.mark.parametrize(("name", "wrong", "hint"), first_fast(wrong_cases(WRONG), dict.fromkeys(WRONG, 8)))
def test_check_rejects_wrong(name, wrong, hint):
    assert_rejected(name, wrong, hint)


@pytest.mark.parametrize(("name", "right"), right_cases(RIGHT))
def test_check_accepts_right(name, right):
    assert_accepted(name, right)


def test_blocks_models_tell_every_mistake_apart():
    """12.3 names a mistake when one of its models gives the learner's count after every prefix of
    every stream: the right model is the reference there, and no model of one mistake gives the
    counts of another's, or the right ones."""
    from helpers.checks.nb12_serving import _BLOCK_MODELS, _blocks_cases, _trace

    cases = _blocks_cases()
    right = [[blocks_in_use(events[:k], bs) for k in range(1, len(events) + 1)] for events, bs in cases]
    assert [_trace(events, bs) for events, bs in cases] == right
    seen: dict[str, str] = {}
    for mistake, models in _BLOCK_MODELS.items():
        for model in models:
            counts = str([_trace(events, bs, **model) for events, bs in cases])
            assert counts != str(right), (mistake.slug, model)
            assert seen.setdefault(counts, mistake.slug) == mistake.slug, (mistake.slug, model, seen[counts])


def test_blocks_check_refuses_the_notebooks_allocator():
    from helpers.checks import blocks_in_use as check

    def via_allocator(events, block_size):
        alloc = BlockAllocator(1000, block_size)
        for kind, seq, *rest in events:
            {"new": alloc.add_sequence, "append": alloc.append_tokens, "fork": alloc.fork,
             "free": alloc.release}[kind](seq, *rest)
        return alloc.used

    e = assert_rejected("blocks_in_use", via_allocator, "write your own implementation")
    assert "Refused" in type(e).__name__ or e.mistake_id.endswith("called-the-reference")
    assert check is not None
