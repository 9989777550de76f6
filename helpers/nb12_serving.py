"""Serving attention: paged KV caches, prefix sharing and split-KV decoding (notebook 12).

- **Waste.** :func:`request_mix` draws a seeded mix of chat and document requests;
  :func:`contiguous_slots` and :func:`paged_slots` count the token slots that a cache reserving the
  maximum context per sequence, or one handing out fixed-size blocks, sets aside for them.
- **A paged cache.** :class:`BlockAllocator` keeps the bookkeeping (a free list, a reference count
  per block, a block table and a length per sequence, copy-on-write of a shared, partly filled last
  block); :class:`PagedKVCache` holds the pages of every layer, ``[L, n_blocks, block_size, H_kv,
  d]``; layer l's ``[n_blocks, block_size, H_kv, d]`` is what a paged kernel reads.
  :func:`gather_paged_kv` (exercise 12.1) reads one sequence's keys back in order and
  :func:`blocks_in_use` (exercise 12.3) replays a stream of events on the allocator.
- **The trained model of notebook 11, decoded with a cache.** :func:`cached_logits` runs a
  :class:`~helpers.nb11_trained_transformer.TinyTransformer` on new tokens only, reading and
  writing the past through either cache: :class:`ContiguousCache` (notebook 07's
  :class:`~helpers.nb07_kv_cache.KVCache`, one per layer) or :class:`PagedKVCache`.
- **Split-KV decoding.** :func:`partial_attention` attends over one chunk of keys and returns its
  log-sum-exp; :func:`paged_decode_split` cuts every sequence's cache into ``n_splits`` chunks and
  merges them with notebook 07's :func:`~helpers.nb07_kv_cache.merge_partials` (exercise 12.2,
  one definition of the merge).

Shapes: B sequences, H query heads, H_kv key/value heads, d = head dim, block_size tokens a block.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence

import torch

from .nb01_qkv_shapes import merge_heads, scaled_dot_product_attention, split_heads
from .nb06_kv_sharing import repeat_kv
from .nb07_kv_cache import KVCache, merge_partials
from .nb10_positions import apply_rope, rope_cos_sin
from .nb11_trained_transformer import TinyTransformer, swiglu

# the exercises' functions (merge_partials is notebook 07's, exercise 12.2 asks for it)
__all__ = ["gather_paged_kv", "merge_partials", "blocks_in_use"]


# --------------------------------------------------------------------------- how much is wasted


def request_mix(n: int, generator: torch.Generator, max_len: int = 4096, doc_share: float = 0.2,
                chat_median: float = 300.0, chat_sigma: float = 1.0, doc_median: float = 2500.0,
                doc_sigma: float = 0.6) -> torch.Tensor:
    """``[n]`` int64 token counts (prompt + output) of a mix of requests: a share ``doc_share`` of
    long-document requests, log-normal around ``doc_median`` tokens, the rest short chat turns,
    log-normal around ``chat_median``; each capped at ``max_len`` (the longest context) and at
    least 1. A stand-in for a real trace: the figures it gives depend on these choices."""
    is_doc = torch.rand(n, generator=generator, dtype=torch.float64) < doc_share
    z = torch.randn(n, generator=generator, dtype=torch.float64)
    log_len = torch.where(is_doc, math.log(doc_median) + doc_sigma * z, math.log(chat_median) + chat_sigma * z)
    return log_len.exp().round().clamp(1, max_len).long()


def contiguous_slots(lengths: torch.Tensor, max_len: int) -> int:
    """Token slots a cache reserves when every sequence gets ``max_len`` contiguous positions up
    front (its final length is not known when it starts): ``n * max_len``."""
    return int(lengths.numel()) * max_len


def blocks_for(n_tokens: int | torch.Tensor, block_size: int):
    """Blocks that hold ``n_tokens`` tokens: ``ceil(n_tokens / block_size)`` (the last one may be
    partly filled)."""
    return -(-n_tokens // block_size)


def paged_slots(lengths: torch.Tensor, block_size: int) -> int:
    """Token slots a paged cache sets aside: each sequence holds ``ceil(length / block_size)``
    blocks, so only its last block can be partly empty (internal fragmentation)."""
    return int(blocks_for(lengths, block_size).sum()) * block_size


# --------------------------------------------------------------------------- exercise 12.1


def gather_paged_kv(pages: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One sequence's keys (or values) read back in order from a paged cache (exercise 12.1).

    pages ``[n_blocks, block_size, H_kv, d]``; block_table 1-D integer tensor: entry i is the id of
    the block holding positions ``i * block_size .. (i + 1) * block_size - 1``; only the first
    ``ceil(seq_len / block_size)`` entries count (the rest is padding and may hold anything, -1
    included); the last counted block is filled up to ``seq_len``. -> ``[H_kv, seq_len, d]``, the
    layout of notebook 07's cache (one sequence of it)."""
    n = blocks_for(seq_len, pages.shape[1])
    blocks = pages[block_table[:n].long()]                      # [n, block_size, H_kv, d]
    return blocks.flatten(0, 1)[:seq_len].transpose(0, 1)       # [H_kv, seq_len, d]


# --------------------------------------------------------------------------- the allocator


class OutOfBlocks(RuntimeError):
    """The free list cannot supply the blocks a request needs (a server would pre-empt a sequence)."""


class BlockAllocator:
    """The bookkeeping of a paged cache, without the tensors.

    ``n_blocks`` blocks of ``block_size`` token slots. ``free`` is the free list (a queue: freed
    blocks go to its end, so ids stop being contiguous once sequences come and go); ``ref[b]``
    counts the sequences whose block table holds block b; ``tables[s]`` is sequence s's block
    table and ``lengths[s]`` its number of tokens. A block is in use iff ``ref[b] > 0``.

    Writing into a block that another sequence also holds would change that sequence's past, so
    :meth:`append_tokens` first copies a shared, partly filled last block (copy-on-write) and returns the
    ``(source, copy)`` pairs for the caller to copy in its tensors. A shared *full* block is never
    written again: it stays shared, and the new tokens go to a fresh block. Every method checks
    first that the free list can supply what it needs, so a refused request changes nothing."""

    def __init__(self, n_blocks: int, block_size: int):
        if n_blocks < 0 or block_size < 1:
            raise ValueError(f"need n_blocks >= 0 and block_size >= 1, got {n_blocks}, {block_size}")
        self.n_blocks, self.block_size = n_blocks, block_size
        self.free: deque[int] = deque(range(n_blocks))
        self.ref = [0] * n_blocks
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    @property
    def used(self) -> int:
        """Blocks held by at least one sequence."""
        return self.n_blocks - len(self.free)

    def _take(self) -> int:
        block = self.free.popleft()
        self.ref[block] = 1
        return block

    def _release(self, block: int) -> None:
        self.ref[block] -= 1
        if self.ref[block] == 0:
            self.free.append(block)

    def needs(self, seq: int, n_tokens: int) -> int:
        """Fresh blocks that appending ``n_tokens`` to ``seq`` takes (a copy-on-write included)."""
        table, length = self.tables[seq], self.lengths[seq]
        cow = bool(length % self.block_size) and self.ref[table[-1]] > 1
        return int(cow) + blocks_for(length + n_tokens, self.block_size) - len(table)

    def add_sequence(self, seq: int, n_tokens: int) -> list[tuple[int, int]]:
        """A new sequence ``seq`` with ``n_tokens`` tokens (its prompt): its slots, as
        ``(block, offset)`` pairs, one per token in order."""
        if seq in self.tables:
            raise ValueError(f"sequence {seq} already exists")
        if blocks_for(n_tokens, self.block_size) > len(self.free):
            raise OutOfBlocks(f"{n_tokens} tokens need {blocks_for(n_tokens, self.block_size)} blocks, "
                              f"{len(self.free)} are free")
        self.tables[seq], self.lengths[seq] = [], 0
        return self.append_tokens(seq, n_tokens)[0]

    def append_tokens(self, seq: int, n_tokens: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """Grow ``seq`` by ``n_tokens`` tokens: ``(slots, copies)``, the ``(block, offset)`` of each
        new token and the ``(source, copy)`` blocks the caller must copy first (copy-on-write)."""
        need = self.needs(seq, n_tokens)
        if need > len(self.free):
            raise OutOfBlocks(f"sequence {seq} needs {need} more blocks, {len(self.free)} are free")
        table, length, size = self.tables[seq], self.lengths[seq], self.block_size
        copies = []
        if length % size and self.ref[table[-1]] > 1:  # a shared, partly filled last block
            copy = self._take()
            copies.append((table[-1], copy))
            self._release(table[-1])  # still held by the others: never freed here
            table[-1] = copy
        slots = []
        for p in range(length, length + n_tokens):
            if p % size == 0:
                table.append(self._take())
            slots.append((table[p // size], p % size))
        self.lengths[seq] = length + n_tokens
        return slots, copies

    def fork(self, parent: int, child: int) -> None:
        """``child`` starts as ``parent``: the same blocks (each gains a reference), no copy."""
        if child in self.tables:
            raise ValueError(f"sequence {child} already exists")
        self.tables[child] = list(self.tables[parent])
        self.lengths[child] = self.lengths[parent]
        for block in self.tables[child]:
            self.ref[block] += 1

    def release(self, seq: int) -> None:
        """``seq`` finished: each of its blocks loses a reference; unreferenced ones are free again."""
        for block in self.tables.pop(seq):
            self._release(block)
        del self.lengths[seq]

    def check(self) -> None:
        """Assert the invariants: every block is either free (ref 0, in the free list once) or held,
        and its reference count is the number of block tables that hold it."""
        held = [0] * self.n_blocks
        for table in self.tables.values():
            for block in table:
                held[block] += 1
        assert held == self.ref, "a reference count differs from the block tables"
        assert sorted(self.free) == [b for b in range(self.n_blocks) if self.ref[b] == 0], "free list"
        for seq, table in self.tables.items():
            assert len(table) == blocks_for(self.lengths[seq], self.block_size), f"sequence {seq}"


def event_block_bound(events: Iterable[Sequence], block_size: int) -> int:
    """Enough blocks for any run of ``events``: every token's block, plus one copy per append."""
    return sum(blocks_for(e[2], block_size) + (e[0] == "append") for e in events if e[0] in ("new", "append"))


def blocks_in_use(events: Sequence[Sequence], block_size: int) -> int:
    """Blocks of a paged cache in use after ``events`` (exercise 12.3), processed in order:

    - ``("new", s, n)``: sequence s starts with n >= 1 tokens: ``ceil(n / block_size)`` blocks;
    - ``("append", s, n)``: s grows by n >= 1 tokens, filling its last block first; a partly
      filled last block that another sequence also holds is copied first (copy-on-write);
    - ``("fork", s, c)``: sequence c starts as a copy of s sharing all of s's blocks (no new block);
    - ``("free", s)``: s finished: a block returns to the free list when no sequence holds it.

    Returns the number of distinct blocks held by at least one sequence (an int)."""
    events = list(events)
    alloc = BlockAllocator(event_block_bound(events, block_size), block_size)
    for kind, seq, *rest in events:
        if kind == "new":
            alloc.add_sequence(seq, rest[0])
        elif kind == "append":
            alloc.append_tokens(seq, rest[0])
        elif kind == "fork":
            alloc.fork(seq, rest[0])
        elif kind == "free":
            alloc.release(seq)
        else:
            raise ValueError(f"unknown event {kind!r}: 'new', 'append', 'fork' or 'free'")
    return alloc.used


# --------------------------------------------------------------------------- the paged cache


class PagedKVCache:
    """The keys and values of every layer of a model, in pages.

    ``k``, ``v`` ``[L, n_blocks, block_size, H_kv, d]``, allocated once; ``alloc`` (a
    :class:`BlockAllocator`) decides where each sequence's tokens go. All layers share the block
    tables: token p of sequence s sits at ``(tables[s][p // block_size], p % block_size)`` in every
    layer. ``pages(l)`` is layer l's ``[n_blocks, block_size, H_kv, d]`` (a view)."""

    def __init__(self, n_layers: int, n_blocks: int, block_size: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        self.alloc = BlockAllocator(n_blocks, block_size)
        shape = (n_layers, n_blocks, block_size, n_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self._slots: dict[int, torch.Tensor] = {}  # seq -> [T_new, 2] slots of the step under way

    @property
    def block_size(self) -> int:
        return self.alloc.block_size

    def pages(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer], self.v[layer]

    def reserve(self, seqs: Sequence[int], n_new: Sequence[int]) -> list[int]:
        """Make room for ``n_new[i]`` more tokens of ``seqs[i]`` (a sequence not seen before is
        added), copying shared partly filled blocks in every layer first. Returns each sequence's
        length before the step: the position of its first new token."""
        before = []
        for seq, n in zip(seqs, n_new):
            if seq in self.alloc.tables:
                before.append(self.alloc.lengths[seq])
                slots, copies = self.alloc.append_tokens(seq, n)
            else:
                before.append(0)
                slots, copies = self.alloc.add_sequence(seq, n), []
            for src, dst in copies:  # copy-on-write, in every layer
                self.k[:, dst], self.v[:, dst] = self.k[:, src], self.v[:, src]
            self._slots[seq] = torch.tensor(slots, dtype=torch.long, device=self.k.device).view(-1, 2)
        return before

    def fork(self, parent: int, child: int) -> None:
        self.alloc.fork(parent, child)

    def release(self, seq: int) -> None:
        self.alloc.release(seq)

    def write(self, layer: int, seq: int, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """k_new, v_new ``[H_kv, T_new, d]``: the new tokens of ``seq`` into the slots reserved."""
        slots = self._slots[seq]
        self.k[layer, slots[:, 0], slots[:, 1]] = k_new.transpose(0, 1)
        self.v[layer, slots[:, 0], slots[:, 1]] = v_new.transpose(0, 1)

    def read(self, layer: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``seq``'s keys and values in order, ``[H_kv, length, d]`` each (exercise 12.1)."""
        table = torch.tensor(self.alloc.tables[seq], dtype=torch.long, device=self.k.device)
        n = self.alloc.lengths[seq]
        return gather_paged_kv(self.k[layer], table, n), gather_paged_kv(self.v[layer], table, n)

    def block_tables(self, seqs: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(block_tables [B, max_blocks] int32, seq_lens [B] int32)`` of ``seqs``: what a paged
        kernel reads. Rows are padded with block 0 (never read: past each sequence's length)."""
        width = max(1, max(len(self.alloc.tables[s]) for s in seqs))
        tables = torch.zeros(len(seqs), width, dtype=torch.int32)
        for i, s in enumerate(seqs):
            tables[i, :len(self.alloc.tables[s])] = torch.tensor(self.alloc.tables[s], dtype=torch.int32)
        lens = torch.tensor([self.alloc.lengths[s] for s in seqs], dtype=torch.int32)
        return tables.to(self.k.device), lens.to(self.k.device)

    # the interface of cached_logits

    def attend(self, layer: int, seqs: Sequence[int], q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        """Store k, v ``[B, H_kv, T_new, d]`` of the new tokens, then let q ``[B, H, T_new, d]``
        attend to each sequence's whole cache (a loop over sequences: each has its own length)."""
        out = []
        for b, seq in enumerate(seqs):
            self.write(layer, seq, k[b], v[b])
            keys, values = self.read(layer, seq)
            out.append(_attend_one(q[b], keys, values))
        return torch.stack(out)


def _attend_one(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """q ``[H, T_new, d]``, the new tokens the last T_new of ``keys``, ``values`` ``[H_kv, T, d]``:
    causal attention (a bottom-right mask), GQA -> ``[H, T_new, d]``."""
    T_new, T = q.shape[1], keys.shape[1]
    g = q.shape[0] // keys.shape[0]
    allowed = torch.ones(T_new, T, dtype=torch.bool, device=q.device).tril(T - T_new)
    return scaled_dot_product_attention(q, repeat_kv(keys[None], g)[0], repeat_kv(values[None], g)[0], allowed)


class ContiguousCache:
    """Notebook 07's :class:`~helpers.nb07_kv_cache.KVCache`, one per layer, behind the interface
    of :func:`cached_logits`: ``[B, H_kv, max_len, d]`` per layer, a length pointer per sequence.
    Sequence ids are the rows 0 .. B-1."""

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        self.layers = [KVCache(batch, n_kv_heads, max_len, head_dim, dtype, device) for _ in range(n_layers)]
        self._valid: torch.Tensor | None = None

    def reserve(self, seqs: Sequence[int], n_new: Sequence[int]) -> list[int]:
        if list(seqs) != list(range(self.layers[0].lengths.numel())):
            raise ValueError("a contiguous cache steps all of its rows together: seqs = 0 .. B-1")
        self._valid = torch.tensor(list(n_new), dtype=torch.long, device=self.layers[0].k.device)
        return self.layers[0].lengths.tolist()

    def attend(self, layer: int, seqs: Sequence[int], q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        cache = self.layers[layer]
        before = cache.lengths.clone()
        cache.append(k, v, valid=self._valid)
        T_keys = int(before.max()) + q.shape[2]
        allowed = cache.allowed(q.shape[2], T_keys, before)                 # [B, 1, T_new, T_keys]
        g = q.shape[1] // k.shape[1]
        keys, values = (repeat_kv(c[:, :, :T_keys], g) for c in (cache.k, cache.v))
        return scaled_dot_product_attention(q, keys, values, allowed)


def cached_logits(model: TinyTransformer, tokens: torch.Tensor, seqs: Sequence[int], cache,
                  n_new: Sequence[int] | None = None) -> torch.Tensor:
    """Notebook 11's model on the new tokens only, the past read from ``cache``.

    tokens ``[B, T_new]``: the next tokens of sequences ``seqs`` (right-padded when ``n_new[b]``,
    the number of real ones, is less than T_new); ``cache``: a :class:`PagedKVCache` or a
    :class:`ContiguousCache`. Each sequence's new tokens sit at positions ``length, length + 1,
    ...`` (RoPE); every layer stores their keys and values and attends to the whole cache.
    -> logits ``[B, T_new, V]`` (rows past ``n_new[b]`` are padding)."""
    cfg = model.cfg
    B, T_new = tokens.shape
    n_new = [T_new] * B if n_new is None else list(n_new)
    before = torch.tensor(cache.reserve(seqs, n_new), device=tokens.device)
    positions = before[:, None] + torch.arange(T_new, device=tokens.device)    # [B, T_new]
    cos, sin = rope_cos_sin(positions.flatten(), cfg.head_dim, cfg.rope_base, model.embed.dtype)
    cos, sin = (t.view(B, 1, T_new, cfg.head_dim) for t in (cos, sin))
    H, H_kv, d_k = cfg.n_heads, cfg.kv_heads, cfg.head_dim
    x = model.embed[tokens]
    for li, layer in enumerate(model.layers):
        h = torch.nn.functional.rms_norm(x, (cfg.d_model,), layer.attn_norm)
        q, k, v = (h @ layer.w_qkv).split([H * d_k, H_kv * d_k, H_kv * d_k], dim=-1)
        q, k, v = split_heads(q, H), split_heads(k, H_kv), split_heads(v, H_kv)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        x = x + merge_heads(cache.attend(li, seqs, q, k, v)) @ layer.w_o
        if cfg.d_ff:
            x = x + swiglu(torch.nn.functional.rms_norm(x, (cfg.d_model,), layer.mlp_norm),
                           layer.w_gate, layer.w_up, layer.w_down)
    return torch.nn.functional.rms_norm(x, (cfg.d_model,), model.final_norm) @ model.unembed


# --------------------------------------------------------------------------- split-KV decoding


def partial_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q ``[..., d]`` over one chunk of keys, values ``[..., n, d]`` (n may be 0):
    ``(out [..., d], lse [...])``, out normalised within the chunk and lse the log-sum-exp of the
    chunk's scaled scores. An empty chunk gives out 0 and lse -inf (it has no weight to give)."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (keys @ q[..., None])[..., 0] * scale                     # [..., n]
    if scores.shape[-1] == 0:
        return torch.zeros_like(q), torch.full(q.shape[:-1], -math.inf, dtype=q.dtype, device=q.device)
    lse = torch.logsumexp(scores, dim=-1)
    out = (torch.exp(scores - lse[..., None])[..., None] * values).sum(dim=-2)
    return out, lse


def split_bounds(seq_len: int, n_splits: int, block_size: int, max_len: int) -> list[tuple[int, int]]:
    """The token ranges ``[start, end)`` of a sequence's ``n_splits`` chunks when every chunk of
    the batch covers ``ceil(ceil(max_len / n_splits) / block_size)`` whole blocks: a chunk that
    starts at or past ``seq_len`` is empty (start = end)."""
    per = blocks_for(blocks_for(max_len, n_splits), block_size) * block_size
    return [(min(s * per, seq_len), min((s + 1) * per, seq_len)) for s in range(n_splits)]


def paged_decode_split(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                       block_tables: torch.Tensor, seq_lens: torch.Tensor, n_splits: int,
                       return_partials: bool = False):
    """Split-KV ("FlashDecoding") decode over a paged cache, in PyTorch: q ``[B, H, d]`` (one new
    token per sequence, already in the cache), pages ``[n_blocks, block_size, H_kv, d]``,
    block_tables ``[B, max_blocks]``, seq_lens ``[B]`` -> ``[B, H, d]``. Each sequence's tokens
    are cut into ``n_splits`` chunks (:func:`split_bounds`; short sequences get empty ones), each
    attended alone (:func:`partial_attention`), then merged (:func:`merge_partials`). With
    ``return_partials`` also the ``[n_splits, B, H, d]`` outs and ``[n_splits, B, H]`` lses."""
    B, H, d = q.shape
    H_kv, block_size = k_pages.shape[2], k_pages.shape[1]
    max_len = int(seq_lens.max())
    outs = torch.zeros(n_splits, B, H, d, dtype=torch.float32, device=q.device)
    lses = torch.full((n_splits, B, H), -math.inf, dtype=torch.float32, device=q.device)
    for b in range(B):
        n = int(seq_lens[b])
        keys = repeat_kv(gather_paged_kv(k_pages, block_tables[b], n)[None].float(), H // H_kv)[0]
        values = repeat_kv(gather_paged_kv(v_pages, block_tables[b], n)[None].float(), H // H_kv)[0]
        for s, (start, end) in enumerate(split_bounds(n, n_splits, block_size, max_len)):
            outs[s, b], lses[s, b] = partial_attention(q[b].float(), keys[:, start:end], values[:, start:end])
    out, _ = merge_partials(outs, lses)
    out = out.to(q.dtype)
    return (out, outs, lses) if return_partials else out
