"""Notebook 12 (serving): wrong answers written from the statements.

12.4 is a Triton kernel: one kernel takes a `BUG` constexpr and each wrong answer is a launcher
that builds it with one mistake switched on (or a launcher/merge mistake in PyTorch).
"""

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - Triton is Linux-only
    triton = tl = None

# ---- 12.1 gather_paged_kv(pages, block_table, seq_len) -> [H_kv, seq_len, d] --------------------


def _gather(pages, table, seq_len, n_blocks=None):
    bs = pages.shape[1]
    nb = math.ceil(seq_len / bs) if n_blocks is None else n_blocks
    ids = table[:nb].long()
    return pages[ids].reshape(-1, *pages.shape[2:])[:seq_len].transpose(0, 1)


def gp_floor_plus_one(pages, block_table, seq_len):
    return _gather(pages, block_table, seq_len, seq_len // pages.shape[1] + 1)


def gp_whole_table(pages, block_table, seq_len):
    return _gather(pages, block_table, seq_len, block_table.shape[0])


def gp_no_transpose(pages, block_table, seq_len):
    return _gather(pages, block_table, seq_len).transpose(0, 1)


def gp_reshape_not_transpose(pages, block_table, seq_len):
    x = _gather(pages, block_table, seq_len).transpose(0, 1)
    return x.reshape(pages.shape[2], seq_len, pages.shape[3])


def gp_block_id_not_times_block_size(pages, block_table, seq_len):
    bs = pages.shape[1]
    flat = pages.reshape(-1, *pages.shape[2:])
    idx = [int(block_table[i // bs]) + i % bs for i in range(seq_len)]
    return flat[idx].transpose(0, 1)


def gp_block_and_slot_swapped(pages, block_table, seq_len):
    bs = pages.shape[1]
    idx = [(int(block_table[i // bs]), i % bs) for i in range(seq_len)]
    flat = pages.reshape(-1, *pages.shape[2:])
    return flat[[(s * bs + b) % flat.shape[0] for b, s in idx]].transpose(0, 1)


def gp_assumes_contiguous(pages, block_table, seq_len):
    bs = pages.shape[1]
    nb = math.ceil(seq_len / bs)
    start = int(block_table[0])
    blocks = pages[start:start + nb]
    if blocks.shape[0] < nb:
        blocks = torch.cat([blocks, pages[: nb - blocks.shape[0]]])
    return blocks.reshape(-1, *pages.shape[2:])[:seq_len].transpose(0, 1)


def gp_floor_blocks(pages, block_table, seq_len):
    return _gather(pages, block_table, seq_len, max(1, seq_len // pages.shape[1]))


def gp_float32(pages, block_table, seq_len):
    return _gather(pages, block_table, seq_len).float()


def gp_no_truncation(pages, block_table, seq_len):
    bs = pages.shape[1]
    nb = math.ceil(seq_len / bs)
    return pages[block_table[:nb].long()].reshape(-1, *pages.shape[2:]).transpose(0, 1)


def gp_sorted_ids(pages, block_table, seq_len):
    bs = pages.shape[1]
    nb = math.ceil(seq_len / bs)
    ids = block_table[:nb].long().sort().values
    return pages[ids].reshape(-1, *pages.shape[2:])[:seq_len].transpose(0, 1)


def gp_table_from_one(pages, block_table, seq_len):
    bs = pages.shape[1]
    nb = math.ceil(seq_len / bs)
    ids = block_table[1:nb + 1].long()
    return pages[ids].reshape(-1, *pages.shape[2:])[:seq_len].transpose(0, 1)


def gp_heads_and_dim_swapped(pages, block_table, seq_len):
    x = _gather(pages, block_table, seq_len)  # [H_kv, seq_len, d]
    return x.permute(2, 1, 0).reshape(x.shape)


# ---- 12.2 merge_partials(outs, lses) -------------------------------------------------------------


def _merge(outs, lses, *, sub_max=True, guard=True, lse_no_max=False, normalise=True,
           nan_to_zero=False, global_max=False, base2=False, lse_zero_empty=False, dim=0,
           out_fp64=False):
    if nan_to_zero:
        lses = torch.nan_to_num(lses, neginf=0.0)
    if global_max:
        m = lses.max()
        m = m.expand(lses.shape[1:])
    else:
        m = lses.amax(dim=dim)
    m0 = torch.where(torch.isinf(m), torch.zeros_like(m), m) if guard else m
    if not sub_max:
        m0 = torch.zeros_like(m0)
    if dim != 0:
        w = torch.exp(lses - m0.unsqueeze(dim))
    elif base2:
        w = torch.exp2(lses - m0)
    else:
        w = torch.exp(lses - m0)
    s = w.sum(0)
    num = (w[..., None] * outs).sum(0)
    if normalise:
        safe = num / s[..., None].clamp_min(1e-30)
        zero = torch.zeros_like(num)
        out = torch.where(s[..., None] > 0, safe, zero) if guard else num / s[..., None]
    else:
        out = num
    lse = torch.log2(s) + m0 if base2 else (torch.log(s) if lse_no_max else m0 + torch.log(s))
    if lse_zero_empty:
        lse = torch.where(s > 0, lse, torch.zeros_like(lse))
    if out_fp64:
        out, lse = out.double(), lse.double()
    return out, lse


def mp_no_max(outs, lses):
    return _merge(outs, lses, sub_max=False)


def mp_softmax_wrong_axis(outs, lses):
    return _merge(outs, lses, dim=-1)


def mp_exp2_log2(outs, lses):
    return _merge(outs, lses, base2=True)


def mp_no_empty_guard(outs, lses):
    return _merge(outs, lses, guard=False)


def mp_lse_without_max(outs, lses):
    return _merge(outs, lses, lse_no_max=True)


def mp_not_normalised(outs, lses):
    return _merge(outs, lses, normalise=False)


def mp_weights_broadcast_wrong(outs, lses):
    m = lses.amax(0)
    m0 = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp(lses - m0)
    s = w.sum(0)
    out = (w[:, None] * outs).sum(0) / s[..., None]  # w[:, None], not w[..., None]
    return torch.nan_to_num(out), m0 + torch.log(s)


def mp_plain_average(outs, lses):
    _, lse = _merge(outs, lses)
    return outs.mean(0), lse


def mp_empty_lse_zero(outs, lses):
    return _merge(outs, lses, lse_zero_empty=True)


def mp_neg_inf_to_zero(outs, lses):
    return _merge(outs, lses, nan_to_zero=True)


def mp_float64(outs, lses):
    return _merge(outs.double(), lses.double())


def mp_one_max_for_all_rows(outs, lses):
    return _merge(outs, lses, global_max=True)


def mp_logsumexp_then_divide(outs, lses):
    lse = torch.logsumexp(lses, dim=0)
    out = (torch.exp(lses - lse)[..., None] * outs).sum(0)
    return out, lse


# ---- 12.3 blocks_in_use(events, block_size) ------------------------------------------------------


def _blocks(events, bs, *, peak=False, cow=True, cow_full=False, fork_copies=False,
            free_all=False, no_fill=False, new_blocks=None, alias=False, cow_leak=False,
            fork_len0=False, count_refs=False, pop_events=False, full_after_copy=False):
    ref = {}
    tables, lens = {}, {}
    nxt = [0]
    best = 0

    def fresh():
        nxt[0] += 1
        ref[nxt[0]] = 1
        return nxt[0]

    def need(n):
        return new_blocks(n, bs) if new_blocks else -(-n // bs)

    seq = events
    while seq:
        if pop_events:
            ev = seq.pop(0)
        else:
            ev, seq = seq[0], seq[1:]
        kind = ev[0]
        if kind == "new":
            _, s, n = ev
            tables[s] = [fresh() for _ in range(need(n))]
            lens[s] = n
        elif kind == "fork":
            _, s, c = ev
            if fork_copies:
                tables[c] = [fresh() for _ in tables[s]]
            else:
                tables[c] = tables[s] if alias else list(tables[s])
                for b in tables[c]:
                    ref[b] += 1
            lens[c] = 0 if fork_len0 else lens[s]
        elif kind == "append":
            _, s, n = ev
            t = tables[s]
            used = lens[s] % bs
            copied = False
            if t and (used or cow_full) and ref[t[-1]] > 1 and cow:
                old = t[-1]
                if not cow_leak:
                    ref[old] -= 1
                t[-1] = fresh()
                copied = True
            free_slots = 0 if (no_fill or (copied and full_after_copy)) else (bs - used) % bs
            rest = max(0, n - free_slots)
            t.extend(fresh() for _ in range(need(rest) if rest else 0))
            lens[s] += n
        elif kind == "free":
            _, s = ev
            for b in tables.pop(s):
                if free_all:
                    ref[b] = 0
                else:
                    ref[b] -= 1
            lens.pop(s)
        live = [b for b, r in ref.items() if r > 0]
        best = max(best, len(live))
    if count_refs:
        return sum(r for r in ref.values() if r > 0)
    return best if peak else sum(1 for r in ref.values() if r > 0)


def bu_peak(events, block_size):
    return _blocks(events, block_size, peak=True)


def bu_no_copy_on_write(events, block_size):
    return _blocks(events, block_size, cow=False)


def bu_copies_full_shared_block(events, block_size):
    return _blocks(events, block_size, cow_full=True)


def bu_fork_copies_blocks(events, block_size):
    return _blocks(events, block_size, fork_copies=True)


def bu_free_ignores_refcounts(events, block_size):
    return _blocks(events, block_size, free_all=True)


def bu_append_never_fills(events, block_size):
    return _blocks(events, block_size, no_fill=True)


def bu_floor_blocks(events, block_size):
    return _blocks(events, block_size, new_blocks=lambda n, bs: max(1, n // bs))


def bu_floor_plus_one(events, block_size):
    return _blocks(events, block_size, new_blocks=lambda n, bs: n // bs + 1)


def bu_fork_aliases_table(events, block_size):
    return _blocks(events, block_size, alias=True)


def bu_copy_keeps_reference(events, block_size):
    return _blocks(events, block_size, cow_leak=True)


def bu_fork_length_zero(events, block_size):
    return _blocks(events, block_size, fork_len0=True)


def bu_counts_references(events, block_size):
    return _blocks(events, block_size, count_refs=True)


def bu_pops_events(events, block_size):
    return _blocks(events, block_size, pop_events=True)


def bu_fresh_blocks_after_copy(events, block_size):
    return _blocks(events, block_size, full_after_copy=True)


# ---- 12.4 paged_decode_triton: one kernel, one mistake per BUG -----------------------------------

P_GQA_MODULO, P_NO_SLOT_MASK, P_NO_EMPTY_GUARD, P_EXP2_NATURAL, P_NO_RESCALE = 1, 2, 3, 4, 5
P_FLOOR_PAGES, P_LSE_WITHOUT_LOG_L = 6, 7

if triton is not None:

    @triton.jit
    def _split_kernel(Q, K, V, Tables, Lens, Parts, Lse, sm_scale, n_splits, B, n_heads, group,
                      stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_tb,
                      HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BUG: tl.constexpr):
        split = tl.program_id(0)
        b = tl.program_id(1)
        h = tl.program_id(2)
        if BUG == 1:
            kvh = h % (n_heads // group)
        else:
            kvh = h // group
        L = tl.load(Lens + b)
        if BUG == 6:
            n_pages = L // PAGE
        else:
            n_pages = (L + PAGE - 1) // PAGE
        per = (n_pages + n_splits - 1) // n_splits
        lo = split * per
        hi = tl.minimum(lo + per, n_pages)
        offs_d = tl.arange(0, HEAD_DIM)
        offs_s = tl.arange(0, PAGE)
        q = tl.load(Q + b * stride_qb + h * stride_qh + offs_d).to(tl.float32)
        m = tl.max(tl.full([PAGE], float("-inf"), tl.float32), 0)
        l = tl.sum(tl.zeros([PAGE], tl.float32), 0)
        acc = tl.zeros([HEAD_DIM], tl.float32)
        for pg in range(lo, hi):
            blk = tl.load(Tables + b * stride_tb + pg).to(tl.int64)
            tok = pg * PAGE + offs_s
            valid = tok < L
            ptr = blk * stride_kb + offs_s[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :]
            if BUG == 2:
                k = tl.load(K + ptr).to(tl.float32)
                v = tl.load(V + ptr).to(tl.float32)
            else:
                k = tl.load(K + ptr, mask=valid[:, None], other=0.0).to(tl.float32)
                v = tl.load(V + ptr, mask=valid[:, None], other=0.0).to(tl.float32)
            s = tl.sum(k * q[None, :], 1) * sm_scale
            if BUG != 2:
                s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 0))
            if BUG == 4:
                alpha = tl.exp2(m - m_new)
                p = tl.exp2(s - m_new)
            else:
                alpha = tl.exp(m - m_new)
                p = tl.exp(s - m_new)
            if BUG == 5:
                alpha = alpha * 0.0 + 1.0
            l = l * alpha + tl.sum(p, 0)
            acc = acc * alpha + tl.sum(p[:, None] * v, 0)
            m = m_new
        row = (split * B + b) * n_heads + h
        if BUG == 3:
            out = acc / l
            lse = m + tl.log(l)
        else:
            out = tl.where(l > 0, acc / tl.maximum(l, 1e-30), 0.0)
            lse = tl.where(l > 0, m + tl.log(tl.maximum(l, 1e-30)), float("-inf"))
        if BUG == 7:
            lse = m
        tl.store(Parts + row * HEAD_DIM + offs_d, out)
        tl.store(Lse + row, lse)


def _right_merge(outs, lses):
    return _merge(outs, lses)


def _paged(q, k_pages, v_pages, block_tables, seq_lens, n_splits=None, sm_scale=None, bug=0, *,
           merge=_right_merge, one_split=False, out_fp32=False, scale_fn=None):
    B, H, d = q.shape
    n_blocks, page, H_kv, _ = k_pages.shape
    n_splits = (n_splits or 2) if not one_split else 1
    if sm_scale is None:
        sm_scale = 1 / math.sqrt(d)
    if scale_fn is not None:
        sm_scale = scale_fn(d)
    q = q.contiguous()
    k_pages, v_pages = k_pages.contiguous(), v_pages.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    parts = torch.empty(n_splits, B, H, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(n_splits, B, H, dtype=torch.float32, device=q.device)
    _split_kernel[(n_splits, B, H)](
        q, k_pages, v_pages, tables, lens, parts, lse, sm_scale, n_splits, B, H, H // H_kv,
        q.stride(0), q.stride(1), k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        tables.stride(0), HEAD_DIM=d, PAGE=page, BUG=bug)
    out, _ = merge(parts, lse)
    return out if out_fp32 else out.to(q.dtype)


def pd_gqa_modulo(q, k_pages, v_pages, block_tables, seq_lens, n_splits=None, sm_scale=None):
    return _paged(q, k_pages, v_pages, block_tables, seq_lens, n_splits, sm_scale, P_GQA_MODULO)


def pd_no_slot_mask(q, k_pages, v_pages, block_tables, seq_lens, n_splits=None, sm_scale=None):
    return _paged(q, k_pages, v_pages, block_tables, seq_lens, n_splits, sm_scale, P_NO_SLOT_MASK)


def pd_no_empty_guard(q, k_pages, v_pages, block_tables, seq_lens, n_splits=None, sm_scale=None):
    return _paged(q, k_pages, v_pages, block_tables, seq_lens, n_splits, sm_scale,
                  P_NO_EMPTY_GUARD)


def pd_exp2_natural(q, k_pages, v_pages, block_tables, seq_lens, n_splits=None, sm_scale=None):
    return _paged(q, k_pages, v_pages, block_tables, seq_lens, n_splits, sm_scale, P_EXP2_NATURAL)


def pd_no_rescale(q, k_pages, v_pages, block_tables, seq_lens, n_splits=None, sm_scale=None):
    return _paged(q, k_pages, v_pages, block_tables, seq_lens, n_splits, sm_scale, P_NO_RESCALE)


def pd_floor_pages(q, k_pages, v_pages, block_tables, seq_lens, n_splits=None, sm_scale=None):
    return _paged(q, k_pages, v_pages, block_tables, seq_lens, n_splits, sm_scale, P_FLOOR_PAGES)


def pd_lse_without_log_l(q, k_pages, v_pages, block_tables, seq_lens, n_splits=None,
                         sm_scale=None):
    return _paged(q, k_pages, v_pages, block_tables, seq_lens, n_splits, sm_scale,
                  P_LSE_WITHOUT_LOG_L)


def pd_merge_plain_average(q, k_pages, v_pages, block_tables, seq_lens, n_splits=None,
                           sm_scale=None):
    return _paged(q, k_pages, v_pages, block_tables, seq_lens, n_splits, sm_scale,
                  merge=mp_plain_average)


def pd_merge_without_empty_guard(q, k_pages, v_pages, block_tables, seq_lens, n_splits=None,
                                 sm_scale=None):
    return _paged(q, k_pages, v_pages, block_tables, seq_lens, n_splits, sm_scale,
                  merge=mp_no_empty_guard)


def pd_one_split(q, k_pages, v_pages, block_tables, seq_lens, n_splits=None, sm_scale=None):
    return _paged(q, k_pages, v_pages, block_tables, seq_lens, n_splits, sm_scale, one_split=True)


def pd_out_float32(q, k_pages, v_pages, block_tables, seq_lens, n_splits=None, sm_scale=None):
    return _paged(q, k_pages, v_pages, block_tables, seq_lens, n_splits, sm_scale, out_fp32=True)


def pd_ignores_sm_scale(q, k_pages, v_pages, block_tables, seq_lens, n_splits=None,
                        sm_scale=None):
    return _paged(q, k_pages, v_pages, block_tables, seq_lens, n_splits, None,
                  scale_fn=lambda d: 1 / math.sqrt(d))


def pd_scale_one_over_d(q, k_pages, v_pages, block_tables, seq_lens, n_splits=None,
                        sm_scale=None):
    return _paged(q, k_pages, v_pages, block_tables, seq_lens, n_splits, sm_scale,
                  scale_fn=lambda d: 1 / d)


def pd_reference_right(q, k_pages, v_pages, block_tables, seq_lens, n_splits=None, sm_scale=None):
    return _paged(q, k_pages, v_pages, block_tables, seq_lens, n_splits, sm_scale)


WRONG = {
    "gather_paged_kv": [
        ("read seq_len // block_size + 1 blocks (one padding entry at exact multiples)",
         gp_floor_plus_one),
        ("read every entry of the table, padding included, then cut to seq_len", gp_whole_table),
        ("forgot the transpose: returned [seq_len, H_kv, d]", gp_no_transpose),
        ("reshaped [seq_len, H_kv, d] to [H_kv, seq_len, d] instead of transposing",
         gp_reshape_not_transpose),
        ("flat index block_id + slot: the block id not multiplied by the block size",
         gp_block_id_not_times_block_size),
        ("flat index slot * block_size + block_id: block and slot swapped",
         gp_block_and_slot_swapped),
        ("assumed the blocks contiguous from the table's first id", gp_assumes_contiguous),
        ("seq_len // block_size blocks (floor): the partly filled last block is dropped",
         gp_floor_blocks),
        ("returned float32 whatever pages' dtype", gp_float32),
        ("kept the stale slots of the last block (no cut to seq_len)", gp_no_truncation),
        ("sorted the block ids first", gp_sorted_ids),
        ("read the table from entry 1 (off by one)", gp_table_from_one),
        ("permuted to [d, seq_len, H_kv] and reshaped back to [H_kv, seq_len, d]",
         gp_heads_and_dim_swapped),
    ],
    "merge_partials": [
        ("no max subtracted: exp(lse) overflows near 200 in float32", mp_no_max),
        ("took the max and the weights over the last axis instead of the chunk axis",
         mp_softmax_wrong_axis),
        ("exp2/log2 mixed with natural-log lses", mp_exp2_log2),
        ("no guard for all-empty rows: -inf - (-inf) gives NaN", mp_no_empty_guard),
        ("lse = log(sum of weights), forgot to add the max back", mp_lse_without_max),
        ("weighted sum without dividing by the sum of weights", mp_not_normalised),
        ("w[:, None] instead of w[..., None]: broadcasts against the wrong axis",
         mp_weights_broadcast_wrong),
        ("plain average of the chunk outputs", mp_plain_average),
        ("all-empty rows get lse 0 instead of -inf", mp_empty_lse_zero),
        ("nan_to_num(lses, neginf=0): empty chunks get weight", mp_neg_inf_to_zero),
        ("computed in float64 and returned float64", mp_float64),
        ("one max over the whole tensor, not per row", mp_one_max_for_all_rows),
        ("logsumexp first, then exp(lses - lse): NaN on all-empty rows",
         mp_logsumexp_then_divide),
    ],
    "blocks_in_use": [
        ("returned the peak number of blocks, not the final one", bu_peak),
        ("no copy-on-write: appended into the shared last block", bu_no_copy_on_write),
        ("copied a shared last block even when it is full", bu_copies_full_shared_block),
        ("fork copies the parent's blocks into fresh ones", bu_fork_copies_blocks),
        ("free returns every block of s, even those still shared", bu_free_ignores_refcounts),
        ("append always takes fresh blocks (ignores the last block's free slots)",
         bu_append_never_fills),
        ("new takes n // block_size blocks (floor)", bu_floor_blocks),
        ("new takes n // block_size + 1 blocks (one too many at exact multiples)",
         bu_floor_plus_one),
        ("fork shares the parent's table list object (appends to one change both)",
         bu_fork_aliases_table),
        ("copy-on-write without dropping the original's reference", bu_copy_keeps_reference),
        ("fork starts the child with length 0", bu_fork_length_zero),
        ("counted references instead of distinct blocks", bu_counts_references),
        ("consumed events with events.pop(0) (modifies the caller's list)", bu_pops_events),
        ("after a copy, treated the copied block as full and took fresh blocks",
         bu_fresh_blocks_after_copy),
    ],
    "paged_decode_triton": [
        ("GQA: query head h reads kv head h % H_kv", pd_gqa_modulo),
        ("slots past seq_len in the last page neither masked on load nor set to -inf",
         pd_no_slot_mask),
        ("empty chunk: stored acc / l and m + log l without a guard (NaN)", pd_no_empty_guard),
        ("tl.exp2 on natural-log scores", pd_exp2_natural),
        ("online softmax without rescaling by exp(m - m_new)", pd_no_rescale),
        ("pages per sequence seq_len // PAGE (floor): the partly filled last page is skipped",
         pd_floor_pages),
        ("stored lse = m (forgot + log l)", pd_lse_without_log_l),
        ("merged the splits by a plain average", pd_merge_plain_average),
        ("merge without an all-empty guard: seq_len 0 gives NaN", pd_merge_without_empty_guard),
        ("ignored n_splits: one program per (sequence, head)", pd_one_split),
        ("returned float32 whatever q's dtype", pd_out_float32),
        ("ignored the sm_scale argument (always 1/sqrt(d))", pd_ignores_sm_scale),
        ("sm_scale = 1 / d instead of 1 / sqrt(d)", pd_scale_one_over_d),
    ],
}
