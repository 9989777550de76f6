"""Checks for notebook 13_across_devices: exercises 13.1 (zigzag positions), 13.2 (ring attention
forward, returning the log-sum-exp), 13.3 (Ulysses with GQA) and 13.4 (bytes each rank sends).

13.2 and 13.3 run the learner's function once per rank, on threads over the course's thread
communicator (:func:`~helpers.checks.watchers.ranks`): no process is spawned, so a function defined
in a notebook is graded as it is; a deadlock is reported at once, saying what each rank waits for.
Every case, its expected output and each mistake's output are computed before the learner's code
runs: the mistakes' outputs by running learner-style wrong implementations (written here) on the
same threads. Cases differ in N (2, 3, 4), in layout (contiguous, striped, zigzag: a mask from rank
indices is right for contiguous shards only), causal or not, and no two of B, H, T/N, d are equal.
13.3's cases have fewer kv heads than ranks (replication: ``repeat`` and ``repeat_interleave``
differ), as many, and more. 13.4's cases make each modelled mistake give another number.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from .. import nb13_across_devices as ref
from ..ranks import run_ranks
from ..registry import in_module
from .core import Trial, describe_case, draw, eager_mistakes, exercise, salted, seeded
from .feedback import Mistake, wrong_signature
from .watchers import ranks

__all__ = in_module(__name__)  # its exercises' checks, as helpers/registry.py lists them


_SHARED_MEMORY = Mistake(
    "ranks-share-memory", "your ranks got each other's tensors without sending them: the check runs them as "
    "threads of one process, but on devices they share no memory. Everything a rank uses of another's shard "
    "must arrive through comm (and be counted).")


# Notebook 13's helpers are stubs where make grade runs a notebook (they compute the answers): a
# function of 13.2 or 13.3 that calls one is refused in a learner's session too, not only when graded.
_LESSON_HELPERS = {"attend_block", "ring_attention_backward", "ring_attention_forward_backward", "seq_to_heads",
                   "heads_to_seq", "_ring_step", "tp_attention", "decode_across_ranks"}


# =========================================================================== 13.1 zigzag_positions

_ZZ_STRIPED = Mistake(
    "striped-not-zigzag", "you returned the striped layout (positions r, r + N, r + 2N, ...): zigzag cuts the "
    "sequence into 2N chunks of T / (2N) tokens and gives rank r chunks r and 2N - 1 - r.")
_ZZ_CONTIGUOUS = Mistake(
    "contiguous-not-zigzag", "you returned one contiguous shard (positions r T/N .. (r+1) T/N - 1): zigzag gives "
    "rank r two chunks of T / (2N), chunk r and chunk 2N - 1 - r, one early and one late.")
_ZZ_SHIFTED = Mistake(
    "halves-not-mirrored", "you gave rank r chunks r and N + r (the same place in each half): the second chunk "
    "must be mirrored, 2N - 1 - r, so that the rank with the earliest first chunk gets the latest second one.")
_ZZ_OFF_BY_ONE = Mistake(
    "mirror-off-by-one", "your second chunk is 2N - r: chunks are numbered 0 .. 2N - 1, so the mirror of chunk r "
    "is 2N - 1 - r.")
_ZZ_ORDER = Mistake(
    "positions-not-increasing", "the right positions, not in increasing order: return chunk r first, then chunk "
    "2N - 1 - r (torch.cat of the two aranges).")
_ZZ_RECIPE = ("size = T // (2 * world_size); chunks = torch.arange(T).view(2 * world_size, size); "
              "return torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]])")


@exercise()
def zigzag_positions(t: Trial) -> None:
    cases = []
    g = seeded(1301)
    for n in (2, 3, 4, 6):
        size = draw(g, 2, 6)                                   # tokens a chunk: T = 2 N size
        T = 2 * n * size
        chunks = torch.arange(T).view(2 * n, size)
        for r in range(n):
            expected = ref.zigzag_positions(T, n, r)
            mistakes = eager_mistakes({
                _ZZ_STRIPED: lambda T=T, n=n, r=r: torch.arange(r, T, n),
                _ZZ_CONTIGUOUS: lambda T=T, n=n, r=r: torch.arange(r * T // n, (r + 1) * T // n),
                _ZZ_SHIFTED: lambda chunks=chunks, n=n, r=r: torch.cat([chunks[r], chunks[n + r]]),
                _ZZ_OFF_BY_ONE: lambda chunks=chunks, n=n, r=r, s=size: torch.cat(
                    [chunks[r], torch.arange((2 * n - r) * s, (2 * n - r + 1) * s)]),
                _ZZ_ORDER: lambda chunks=chunks, n=n, r=r: torch.cat([chunks[2 * n - 1 - r], chunks[r]]),
            })
            cases.append(((T, n, r), describe_case(T=T, world_size=n, rank=r), expected, mistakes))
    for args, described, expected, mistakes in cases:
        got = t.call(*args, case=described)
        t.tensor(got, expected, what="positions", mistakes=mistakes, hint=_ZZ_RECIPE)


# =========================================================================== 13.2 ring_attention

_RING_AVERAGED = Mistake(
    "averaged-block-outputs", "you averaged the blocks' outputs: each is normalised over its own keys only, so "
    "they weigh by how much of the softmax's mass their block holds, exp(lse_block - lse), the merge of "
    "notebook 12.")
_RING_AVERAGED_STEPWISE = Mistake(
    "averaged-block-outputs", "you averaged the blocks' outputs, step by step: each is normalised over its own "
    "keys only, so they weigh by how much of the softmax's mass their block holds, exp(lse_block - lse), the "
    "merge of notebook 12.")
_RING_SUMMED = Mistake(
    "summed-block-outputs", "you added the blocks' outputs: each is normalised over its own block; weigh block b "
    "by exp(lse_b - lse), lse = logsumexp over the blocks' lses (notebook 12's merge).")
_RING_ADDED_LSE = Mistake(
    "added-lses", "you added the blocks' log-sum-exps: the sums of exponentials add, so the lse of the union is "
    "log(exp(lse_a) + exp(lse_b)) = torch.logaddexp(lse_a, lse_b), not lse_a + lse_b.")
_RING_ADDED_LSE_RUNNING = Mistake(
    "added-lses", "you added the log-sum-exps (lse + l) and merged with that sum: the sums of exponentials add, "
    "so the lse of the union is log(exp(lse_a) + exp(lse_b)) = torch.logaddexp(lse_a, lse_b), not lse_a + lse_b.")
_RING_MAX_LSE = Mistake(
    "max-not-logsumexp", "your lse is the largest of the blocks' lses: that is only the largest term; the lse "
    "of the union is log(exp(lse_a) + exp(lse_b)) (torch.logaddexp).")
_RING_LOCAL_CAUSAL = Mistake(
    "is-causal-every-step", "you masked every block as if it were the diagonal one (is_causal=True, a triangular "
    "mask of local indices, or the queries' own positions used for the keys): whether query i may see key j "
    "depends on their global positions. The keys' positions must travel with their K/V block; mask with "
    "k_positions[None, :] > q_positions[:, None], the received positions for k_positions.")
_RING_BY_RANK = Mistake(
    "block-mask-by-rank", "you masked whole blocks by the rank they came from (earlier rank: all visible, "
    "later: none): that is right only for contiguous shards; with striped or zigzag positions every block "
    "holds early and late tokens. Mask from the global positions that travel with the block.")
_RING_NO_SCALE = Mistake(
    "missing-scale", "the scores are not divided by sqrt(d): scale q @ k^T by 1 / sqrt(head_dim), as "
    "everywhere in the course.")
_RING_OWN_TWICE = Mistake(
    "own-block-twice", "your ranks attend to their own K/V block twice: after N - 1 hops each rank has seen every "
    "block; the N-th hop brings the rank's own block back.")
_RING_ONLY_OWN = Mistake(
    "never-rotated", "each rank attended to its own block only: pass the K/V block (and its positions) on to "
    "rank r + 1 and receive rank r - 1's, N - 1 times, attending to each block on the way.")
_RING_NAN = Mistake(
    "nan-on-fully-masked-block", "NaN where a block holds no key a query may see (all later positions): that "
    "block's lse is -inf and exp(-inf - (-inf)) is NaN. Give such a row output 0 and lse -inf (where the max "
    "is -inf, subtract 0 instead: torch.where(torch.isfinite(m), m, torch.zeros_like(m)), notebook 12's merge) "
    "so that its weight is 0.")
_RING_DEADLOCK = Mistake(
    "blocking-sends-deadlock", "every rank sent before receiving, and a send waits for its receive, so all ranks "
    "waited for each other: use comm.exchange(x, dst, src), which posts both at once (or let even ranks send "
    "first and odd ranks receive first).")
_RING_HOP = Mistake(
    "one-hop-too-many", "your ranks sent their K/V block N times: after N - 1 hops every rank has seen every "
    "block, and the last hop only carries each block back home.")
_RING_STRICT = Mistake(
    "diagonal-masked", "a query may see the key at its own position: hide keys with k_pos > q_pos, not >=.")
_RING_HOP_SHORT = Mistake(
    "one-hop-too-few", "your ranks attended to N - 1 of the N blocks: the ring needs N - 1 hops after the rank's "
    "own block, so that each rank sees its own block and every other one once.")
_RING_NOT_A_RING = Mistake(
    "not-a-ring", "your ranks gathered every K/V block at once (all_gather, all_to_all or all_reduce): right values, "
    "but not ring attention, whose point is that a rank holds two blocks at a time and each transfer overlaps "
    "the next block's compute. Pass the block to rank r + 1 with comm.exchange (or send/recv), N - 1 hops.")
_RING_EXTRA = Mistake(
    "sent-more-than-the-ring", "your ranks sent more than N - 1 hops of their K/V block: send only the block and "
    "its positions, once a hop, N - 1 hops in all (comm.exchange to rank r + 1, from rank r - 1).")
_RING_RECIPE = (
    "out, lse = attend(q, k, v, positions, positions); kv = (k, v, positions); for _ in range(N - 1): "
    "kv = [comm.exchange(x, (rank + 1) % N, (rank - 1) % N) for x in kv]; o, l = attend(q, *kv, ...) with "
    "the mask k_pos[None, :] > q_pos[:, None]; new = torch.logaddexp(lse, l); out = exp(lse - new) * out + "
    "exp(l - new) * o (rows where new is -inf: 0); lse = new")


def _attend(q, k, v, q_pos, k_pos, causal, how="global", rank=0, src=0, scale=True):
    """A block's (out, lse) as the mistake ``how`` computes it."""
    s = q @ k.transpose(-1, -2) / (math.sqrt(q.shape[-1]) if scale else 1.0)
    if causal:
        if how == "global":
            hidden = k_pos[None, :] > q_pos[:, None]
        elif how == "strict":
            hidden = k_pos[None, :] >= q_pos[:, None]
        elif how == "local":
            hidden = torch.ones(s.shape[-2:], dtype=torch.bool).triu(1)
        else:  # by rank
            hidden = torch.full(s.shape[-2:], src > rank) if src != rank else k_pos[None, :] > q_pos[:, None]
        s = s.masked_fill(hidden, -math.inf)
    lse = torch.logsumexp(s, -1)
    m = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return torch.exp(s - m[..., None]) @ v, lse


def _wrong_ring(comm, q, k, v, positions, causal, mistake):
    """A learner-style wrong ring attention (``mistake`` says which), run on the same ranks."""
    n, r = comm.world_size, comm.rank
    how = {"local": "local", "by-rank": "by-rank", "strict": "strict"}.get(mistake, "global")
    scale = mistake != "no-scale"
    blocks = [(k, v, positions, r)]
    kv = (k, v, positions, torch.tensor([r]))
    hops = {"own-twice": n, "only-own": 0, "hop-short": n - 2}.get(mistake, n - 1)
    for _ in range(hops):
        kv = tuple(comm.exchange(x, (r + 1) % n, (r - 1) % n) for x in kv)
        blocks.append((kv[0], kv[1], kv[2], int(kv[3])))
    outs, lses = [], []
    for kb, vb, pb, src in blocks:
        o, l = _attend(q, kb, vb, positions, pb, causal, how, r, src, scale)
        outs.append(o)
        lses.append(l)
    outs, lses = torch.stack(outs), torch.stack(lses)
    lse = torch.logsumexp(lses, 0)
    weights = torch.exp(lses - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)))
    out = (weights[..., None] * outs).sum(0)
    if mistake == "averaged":
        out = outs.mean(0)
    elif mistake == "averaged-stepwise":  # out = (out + o) / 2 at each step
        out = outs[0]
        for o in outs[1:]:
            out = (out + o) / 2
    elif mistake == "added-lse-running":  # the running lse a sum, used in the next merges too
        out, lse = outs[0], lses[0]
        for o, l in zip(outs[1:], lses[1:]):
            new = lse + l
            out, lse = torch.exp(lse - new)[..., None] * out + torch.exp(l - new)[..., None] * o, new
    elif mistake == "summed":
        out = outs.sum(0)
    elif mistake == "added-lse":
        lse = lses.sum(0)
    elif mistake == "max-lse":
        lse = lses.amax(0)
    return out, lse


_RING_MODELS = {"averaged": _RING_AVERAGED, "averaged-stepwise": _RING_AVERAGED_STEPWISE, "summed": _RING_SUMMED,
                "added-lse": _RING_ADDED_LSE, "added-lse-running": _RING_ADDED_LSE_RUNNING, "strict": _RING_STRICT,
                "hop-short": _RING_HOP_SHORT,
                "max-lse": _RING_MAX_LSE, "local": _RING_LOCAL_CAUSAL,
                "by-rank": _RING_BY_RANK, "no-scale": _RING_NO_SCALE, "own-twice": _RING_OWN_TWICE,
                "only-own": _RING_ONLY_OWN}


def _ring_model(shards, mistake):
    """``[N, ...]`` outs and lses of the wrong ring ``mistake`` on these shards."""
    results = run_ranks(_wrong_ring, [(*s, mistake) for s in shards], backend="threads")
    return torch.stack([o for o, _ in results]), torch.stack([l for _, l in results])


def _ring_cases(base: int):
    # (N, layout, causal, B, H, T/N, d): no two of B, H, T/N, d equal; zigzag needs T / (2N) whole
    for i, (n, layout, causal, B, H, t, d) in enumerate((
            (2, "contiguous", True, 1, 2, 5, 3), (4, "zigzag", True, 2, 3, 4, 5),
            (3, "striped", True, 1, 3, 4, 2), (3, "contiguous", False, 2, 1, 3, 4),
            (4, "contiguous", True, 1, 2, 3, 4))):
        g = seeded(base + i)
        T = n * t
        q, k, v = (torch.randn(B, H, T, d, generator=g, dtype=torch.float64) for _ in range(3))
        pos = [ref.shard_positions(T, n, r, layout) for r in range(n)]
        shards = [(q[:, :, p].clone(), k[:, :, p].clone(), v[:, :, p].clone(), p.clone(), causal) for p in pos]
        full = ref.attend_block(q, k, v, torch.arange(T), torch.arange(T), causal)
        expected = (torch.stack([full[0][:, :, p] for p in pos]), torch.stack([full[1][:, :, p] for p in pos]))
        described = describe_case(N=n, layout=layout, causal=causal, B=B, H=H, T=T, d=d)
        block_bytes = 2 * k[:, :, :t].numel() * 8                           # K and V, float64
        yield shards, described, expected, n, (block_bytes + 8 * t) * (n - 1), block_bytes


@functools.lru_cache(maxsize=4)
def _ring_setup(salt: int) -> list:
    """Every case of 13.2 with its expected output and each mistake's (ten wrong rings run on the
    case's ranks), for the seeds ``salt`` gives: computed once a session (or a grading run). The
    learner's ranks never touch these shards: the watcher ``ranks`` hands each rank copies."""
    cases = []
    for shards, described, expected, n, ring_bytes, block_bytes in _ring_cases(1300):
        models = {_RING_MODELS[m]: _ring_model(shards, m) for m in _RING_MODELS}
        out_mistakes = {h: o for h, (o, _) in models.items()}
        lse_mistakes = {h: l for h, (_, l) in models.items()}
        cases.append((shards, described, expected, n, ring_bytes, block_bytes, out_mistakes, lse_mistakes))
    return cases


@exercise(time_limit=30)
def ring_attention(t: Trial) -> None:
    t.forbidden_references |= _LESSON_HELPERS
    t.error_hints[r"DeadlockError"] = _RING_DEADLOCK
    t.error_hints[r"takes \d+ positional argument|unexpected keyword"] = wrong_signature(
        "ring_attention(comm, q, k, v, positions, causal=True)")
    cases = _ring_setup(salted(1300))
    sent = []
    for shards, described, expected, n, ring_bytes, block_bytes, out_mistakes, lse_mistakes in cases:
        results, seen = t.call_watched(ranks, (shards,), {"timeout": 20}, case=described)
        if not isinstance(results, list) or len(results) != n:
            t.fail(f"expected one result per rank ({n}), got {results!r:.200}", what="type")
        pairs = [t.tuple(r, 2, ("out", "lse")) for r in results]
        outs, lses = [p[0] for p in pairs], [p[1] for p in pairs]
        for name, got_list in (("out", outs), ("lse", lses)):
            bad = next((x for x in got_list if not isinstance(x, torch.Tensor)), None)
            if bad is not None:
                t.fail(f"{name}: expected a tensor from every rank, got {type(bad).__name__}", what="type")
        shapes = {tuple(o.shape) for o in outs} | {("lse",) + tuple(x.shape) for x in lses}
        if len(shapes) != 2:
            t.fail(f"the ranks returned tensors of different shapes: out {[list(o.shape) for o in outs]}, "
                   f"lse {[list(x.shape) for x in lses]}", "each rank returns out [B, H, T/N, d] and lse "
                   "[B, H, T/N] for its own queries.", what="shape")
        got_out, got_lse = torch.stack(outs), torch.stack(lses)
        nan = isinstance(got_out, torch.Tensor) and bool(torch.isnan(got_out).any())
        t.tensor(got_out, expected[0], what="out (every rank's, stacked: [N, B, H, T/N, d])",
                 mistakes=out_mistakes, hint=_RING_RECIPE, atol=1e-9, rtol=1e-7,
                 diagnosis=_RING_NAN if nan else "")
        t.tensor(got_lse, expected[1], what="lse (every rank's, stacked: [N, B, H, T/N])",
                 mistakes=lse_mistakes, hint=_RING_RECIPE, atol=1e-9, rtol=1e-7)
        sent.append((described, seen or {}, ring_bytes, block_bytes, n))
    # how the values were computed, once every output is right (observed: advisory when grading)
    for described, seen, ring_bytes, block_bytes, n in sent if t._pending is None else []:
        t.case = described
        per_rank, ops = seen.get("sent", []), {op for calls in seen.get("ops", []) for op in calls}
        if ops - {"exchange", "send"}:
            t.fail_observed(f"your ranks called {', '.join(sorted(ops - {'exchange', 'send'}))}", _RING_NOT_A_RING)
        if per_rank and min(per_rank) < (n - 1) * block_bytes * (1 - 1e-9):
            t.fail_observed(f"a rank of yours sent {min(per_rank):,.0f} bytes, where N - 1 = {n - 1} hops of its K "
                            f"and V block are {(n - 1) * block_bytes:,.0f}", _SHARED_MEMORY)
        if per_rank and max(per_rank) >= ring_bytes + block_bytes / 2:
            hops = max(per_rank) / (ring_bytes / (n - 1))
            t.fail_observed(f"your ranks sent up to {max(per_rank):,.0f} bytes each, where N - 1 = {n - 1} hops of "
                            f"a K/V block and its positions are {ring_bytes:,.0f} (about {hops:.3g} hops' worth)",
                            _RING_HOP if abs(hops - n) < 0.05 else _RING_EXTRA)


# =========================================================================== 13.3 ulysses_attention

_UL_TILED = Mistake(
    "repeat-not-repeat-interleave", "you replicated the kv heads with .repeat (tiling: head h gets kv head "
    "h % H_kv): query head h belongs to kv head h // (H / H_kv), so replicate each kv head in place with "
    "repeat_interleave (notebook 06's repeat_kv) before the all-to-all.")
_UL_LOCAL = Mistake(
    "attended-own-shard-only", "each rank attended over its own T/N tokens only: first an all-to-all that gives "
    "every rank H/N heads over the whole sequence, then attention, then the all-to-all back.")
_UL_BATCH_SPLIT = Mistake(
    "all-to-all-over-batch", "your all-to-all cut the batch axis (dim 0 of [B, H, T/N, d]) into N parts: it cuts "
    "dim 0, so put the heads first (.permute(1, 0, 2, 3)) to send each rank its heads.")
_UL_ORDER = Mistake(
    "sequence-chunks-misordered", "after the all-to-all, the chunk received from rank i holds positions "
    "i T/N .. (i+1) T/N - 1: join the chunks along the sequence in rank order (and send the output back the "
    "same way).")
_UL_NOT_ULYSSES = Mistake(
    "not-ulysses", "your ranks gathered the whole sequence (all_gather or all_reduce, or point-to-point sends): "
    "right values, but not Ulysses, whose all-to-all gives each rank H/N heads of the sequence, so a rank never "
    "holds more than 1/N of the activations. Use comm.all_to_all, four times (q, k, v, the output).")
_UL_TOO_MUCH = Mistake(
    "sent-more-than-ulysses", "your ranks sent more than four all-to-alls of q, k, v and the output: replicate the "
    "kv heads only up to N (one per rank) when there are fewer than N, not up to H, and send each tensor once.")
_UL_DIM0 = Mistake(
    "all-to-all-dim-0-not-divisible", "dim 0 of what you passed to comm.all_to_all is not a multiple of N: the "
    "all-to-all cuts dim 0 into one part per rank. Put the heads first (.permute(1, 0, 2, 3)), and when there "
    "are fewer kv heads than ranks, replicate them to N heads first (repeat_interleave(N // H_kv, dim=1)).")
_UL_GROUPS = Mistake(
    "kv-heads-not-matched-to-query-heads", "after the all-to-all a rank holds H/N query heads and fewer kv heads: "
    "attend with F.scaled_dot_product_attention(..., enable_gqa=True), or repeat_interleave the kv heads to H/N "
    "first (query head h reads kv head h // (H / H_kv)).")
_UL_DEADLOCK = Mistake(
    "blocking-sends-deadlock", "the ranks waited for each other: use comm.all_to_all, which every rank calls "
    "once with the same shape.")
_UL_RECIPE = (
    "rep = max(1, N // H_kv) when H_kv < N; k, v = (x.repeat_interleave(rep, dim=1) for x in (k, v)); "
    "to heads: y = comm.all_to_all(x.permute(1, 0, 2, 3).contiguous()) -> [N * h/N, B, T/N, d]; "
    "y.view(N, h // N, B, t, d).permute(2, 1, 0, 3, 4).reshape(B, h // N, N * t, d); "
    "F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True); then the inverse")


def _to_heads(comm, x, mistake=""):
    B, h, t, d = x.shape
    n = comm.world_size
    if mistake == "batch":
        got = comm.all_to_all(x.contiguous())                                 # dim 0 = batch
        return got.view(n, B // n, h, t, d).permute(1, 2, 0, 3, 4).reshape(B // n, h, n * t, d)
    got = comm.all_to_all(x.permute(1, 0, 2, 3).contiguous()).view(n, h // n, B, t, d)
    if mistake == "order":
        got = got.flip(0)
    return got.permute(2, 1, 0, 3, 4).reshape(B, h // n, n * t, d)


def _to_seq(comm, x, mistake=""):
    n = comm.world_size
    if mistake == "batch":
        b, h, T, d = x.shape
        chunks = x.view(b, h, n, T // n, d).permute(2, 0, 1, 3, 4).contiguous()
        return comm.all_to_all(chunks.view(n * b, h, T // n, d))
    B, h, T, d = x.shape
    chunks = x.view(B, h, n, T // n, d).permute(2, 1, 0, 3, 4)
    if mistake == "order":
        chunks = chunks.flip(0)
    got = comm.all_to_all(chunks.contiguous().view(n * h, B, T // n, d))
    return got.permute(1, 0, 2, 3)


def _wrong_ulysses(comm, q, k, v, causal, mistake):
    """A learner-style wrong Ulysses (``mistake`` says which), run on the same ranks."""
    n, H_kv = comm.world_size, k.shape[1]
    if mistake == "local":
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    if H_kv < n:
        rep = n // H_kv
        k, v = ((x.repeat(1, rep, 1, 1) if mistake == "tiled" else x.repeat_interleave(rep, dim=1)) for x in (k, v))
    q, k, v = (_to_heads(comm, x, mistake) for x in (q, k, v))
    return _to_seq(comm, F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True), mistake)


_UL_MODELS = {"tiled": _UL_TILED, "local": _UL_LOCAL, "batch": _UL_BATCH_SPLIT, "order": _UL_ORDER}


@exercise(time_limit=30)
def ulysses_attention(t: Trial) -> None:
    t.forbidden_references |= _LESSON_HELPERS
    t.error_hints[r"DeadlockError"] = _UL_DEADLOCK
    t.error_hints[r"all_to_all splits dim 0"] = _UL_DIM0
    t.error_hints[r"must match the size of tensor b .* at non-singleton dimension 1"] = _UL_GROUPS
    t.error_hints[r"takes \d+ positional argument|unexpected keyword"] = wrong_signature(
        "ulysses_attention(comm, q, k, v, causal=True)")
    cases = []
    # (N, causal, B, H, H_kv, T/N, d): kv heads fewer than, equal to and more than the ranks
    for i, (n, causal, B, H, H_kv, t_r, d) in enumerate((
            (4, True, 2, 8, 2, 3, 5), (2, True, 1, 4, 2, 5, 3), (2, False, 2, 6, 6, 3, 4),
            (4, True, 1, 4, 1, 2, 3), (2, True, 4, 2, 1, 3, 5), (2, True, 1, 8, 4, 3, 2))):
        g = seeded(1350 + i)
        T = n * t_r
        q = torch.randn(B, H, T, d, generator=g, dtype=torch.float64)
        k, v = (torch.randn(B, H_kv, T, d, generator=g, dtype=torch.float64) for _ in range(2))
        shards = [(q[:, :, r * t_r:(r + 1) * t_r].clone(), k[:, :, r * t_r:(r + 1) * t_r].clone(),
                   v[:, :, r * t_r:(r + 1) * t_r].clone(), causal) for r in range(n)]
        full = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        expected = torch.stack(list(full.split(t_r, dim=2)))
        models = {}
        for m, hint in _UL_MODELS.items():
            try:
                models[hint] = torch.stack(list(run_ranks(_wrong_ulysses, [(*s, m) for s in shards])))
            except Exception:  # noqa: BLE001 - a mistake that cannot happen on this case
                continue
        least = ref.comm_bytes_per_rank("ulysses", T, H, H_kv, d, n, 8, B)  # four all-to-alls, float64
        cases.append((shards, describe_case(N=n, causal=causal, B=B, H=H, H_kv=H_kv, T=T, d=d), expected, n, models,
                      least))
    sent = []
    for shards, described, expected, n, models, least in cases:
        results, seen = t.call_watched(ranks, (shards,), {"timeout": 20}, case=described)
        sent.append((described, seen or {}, least))
        if not isinstance(results, list) or len(results) != n:
            t.fail(f"expected one result per rank ({n}), got {results!r:.200}", what="type")
        bad = next((x for x in results if not isinstance(x, torch.Tensor)), None)
        if bad is not None:
            t.fail(f"expected a tensor [B, H, T/N, d] from every rank, got {type(bad).__name__}", what="type")
        if len({tuple(x.shape) for x in results}) != 1:
            t.fail(f"the ranks returned different shapes: {[list(x.shape) for x in results]}",
                   "every rank returns its own T/N positions, all heads: [B, H, T/N, d].", what="shape")
        t.tensor(torch.stack(results), expected, what="output (every rank's, stacked: [N, B, H, T/N, d])",
                 mistakes=models, hint=_UL_RECIPE, atol=1e-9, rtol=1e-7)
    # how the values were computed, once every output is right (observed: advisory when grading)
    for described, seen, least in sent if t._pending is None else []:
        t.case = described
        per_rank, ops = seen.get("sent", []), {op for calls in seen.get("ops", []) for op in calls}
        if ops - {"all_to_all"}:
            t.fail_observed(f"your ranks called {', '.join(sorted(ops - {'all_to_all'}))}", _UL_NOT_ULYSSES)
        if per_rank and min(per_rank) < least * (1 - 1e-9):
            t.fail_observed(f"a rank of yours sent {min(per_rank):,.0f} bytes, where Ulysses' four all-to-alls "
                            f"send {least:,.0f}", _SHARED_MEMORY)
        if per_rank and max(per_rank) > least * (1 + 1e-9):
            t.fail_observed(f"your ranks sent up to {max(per_rank):,.0f} bytes each, where Ulysses' four all-to-alls "
                            f"send {least:,.0f}", _UL_TOO_MUCH)


# =========================================================================== 13.4 comm_bytes_per_rank

_BYTES_NO_FRACTION = Mistake(
    "missing-n-minus-1-over-n", "you counted the whole tensor as sent: in an all-to-all (and in each half of a "
    "ring all-reduce) the part a rank keeps for itself does not travel, so a rank sends (N - 1)/N of it.")
_BYTES_N_HOPS = Mistake(
    "n-hops-not-n-minus-1", "you counted N hops of the K/V block: after N - 1 every rank has seen every block.")
_BYTES_NO_POSITIONS = Mistake(
    "positions-not-counted", "the ring's blocks travel with their global positions (8 bytes a token, int64): "
    "count them too.")
_BYTES_H_NOT_HKV = Mistake(
    "query-heads-for-kv", "you counted K and V with the H query heads: they have H_kv heads.")
_BYTES_WHOLE_T = Mistake(
    "whole-sequence-per-rank", "you counted T tokens where a rank holds T/N of them.")
_BYTES_ONE_OF_KV = Mistake(
    "k-or-v-only", "you counted one of K and V: both travel.")
_BYTES_NO_OUTPUT = Mistake(
    "output-all-to-all-forgotten", "Ulysses sends the attention output back with a second all-to-all (heads to "
    "sequence): count it with q, k and v.")
_BYTES_NO_REPLICATION = Mistake(
    "kv-replication-not-counted", "with fewer kv heads than ranks, Ulysses replicates them to N heads before the "
    "all-to-all (each rank needs one): count N kv heads there, not H_kv.")
_BYTES_NO_TWO = Mistake(
    "all-reduce-counted-once", "a ring all-reduce is a reduce-scatter then an all-gather: each sends (N - 1)/N of "
    "the tensor, 2 (N - 1)/N in all.")
_BYTES_TP_SHARD = Mistake(
    "tensor-parallel-output-sharded", "in tensor parallelism every rank holds the whole sequence: the all-reduce "
    "is of the full [B, T, H d] output, not of T/N tokens.")
_BYTES_RECIPE = ("t = T / N; ring: (N - 1) * (2 * batch * H_kv * t * d * dtype_bytes + 8 * t); ulysses: "
                 "(N - 1) / N * batch * t * d * (2 H + 2 H_kv') * dtype_bytes, H_kv' = H_kv if N divides it else N; "
                 "tensor: 2 (N - 1) / N * batch * T * H * d * dtype_bytes")


def _bytes_models(scheme, T, H, H_kv, d, n, b, batch):
    t = T / n
    block = 2 * batch * H_kv * t * d * b
    if scheme == "ring":
        return {_BYTES_N_HOPS: n * (block + 8 * t), _BYTES_NO_POSITIONS: (n - 1) * block,
                _BYTES_H_NOT_HKV: (n - 1) * (2 * batch * H * t * d * b + 8 * t),
                _BYTES_WHOLE_T: (n - 1) * (2 * batch * H_kv * T * d * b + 8 * T),
                _BYTES_ONE_OF_KV: (n - 1) * (block / 2 + 8 * t)}
    if scheme == "ulysses":
        kv = ref._ulysses_kv_heads(H, H_kv, n)
        return {_BYTES_NO_FRACTION: batch * t * d * (2 * H + 2 * kv) * b,
                _BYTES_NO_OUTPUT: (n - 1) / n * batch * t * d * (H + 2 * kv) * b,
                _BYTES_NO_REPLICATION: (n - 1) / n * batch * t * d * (2 * H + 2 * H_kv) * b,
                _BYTES_WHOLE_T: (n - 1) / n * batch * T * d * (2 * H + 2 * kv) * b}
    full = batch * T * H * d * b
    return {_BYTES_NO_FRACTION: 2 * full, _BYTES_NO_TWO: (n - 1) / n * full,
            _BYTES_TP_SHARD: 2 * (n - 1) / n * full / n}


@exercise()
def comm_bytes_per_rank(t: Trial) -> None:
    t.error_hints[r"takes \d+ positional argument|unexpected keyword"] = wrong_signature(
        "comm_bytes_per_rank(scheme, T, n_heads, n_kv_heads, head_dim, world_size, dtype_bytes=2, batch=1)")
    cases = []
    g = seeded(1361)
    for scheme, T, H, H_kv, d, n, b, batch in (  # T = 0: drawn, a multiple of N
            ("ring", 0, 8, 2, 16, 4, 2, 1), ("ring", 131072, 32, 8, 128, 8, 2, 1), ("ring", 0, 6, 3, 10, 3, 4, 2),
            ("ulysses", 0, 8, 2, 16, 4, 2, 1), ("ulysses", 131072, 32, 8, 128, 8, 2, 1),
            ("ulysses", 0, 6, 6, 10, 3, 4, 2), ("ulysses", 0, 16, 8, 8, 4, 2, 3),
            ("tensor", 0, 8, 2, 16, 4, 2, 1), ("tensor", 131072, 32, 8, 128, 8, 2, 1), ("tensor", 0, 6, 3, 10, 3, 4, 2)):
        T = T or n * draw(g, 5, 40)
        expected = ref.comm_bytes_per_rank(scheme, T, H, H_kv, d, n, b, batch)
        mistakes = eager_mistakes({h: (lambda v=v: v) for h, v in _bytes_models(scheme, T, H, H_kv, d, n, b, batch).items()})
        mistakes = {h: v for h, v in mistakes.items() if not math.isclose(v, expected, rel_tol=1e-9)}
        described = describe_case(scheme=scheme, T=T, n_heads=H, n_kv_heads=H_kv, head_dim=d, world_size=n,
                                  dtype_bytes=b, batch=batch)
        cases.append(((scheme, T, H, H_kv, d, n, b, batch), described, expected, mistakes,
                      {"N": n, "N - 1": n - 1, "T": T, "the batch": batch}))
    for args, described, expected, mistakes, factors in cases:
        got = t.call(*args, case=described)
        t.number(got, expected, what="bytes per rank", mistakes=mistakes, hint=_BYTES_RECIPE, rel=1e-9,
                 factors=factors)
