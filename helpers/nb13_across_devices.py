"""Attention across devices (notebook 13): ranks, collectives, and attention split over them.

- **Ranks.** Every scheme is a function ``fn(comm, *shard)`` run once per rank by
  :func:`~helpers.ranks.run_ranks`, on gloo processes or on threads (:mod:`helpers.ranks`).
- **Shards of a sequence.** :func:`shard_positions` (contiguous, striped, zigzag: exercise 13.1
  :func:`zigzag_positions`); :func:`causal_pairs` counts the (query, key) pairs each rank computes
  at each ring step.
- **The schemes.** :func:`tp_attention` (Megatron: heads split, one all-reduce);
  :func:`ulysses_attention` (exercise 13.3: all-to-all sequence -> heads and back);
  :func:`ring_attention` (exercise 13.2: K/V blocks travel, partial results merged by their
  log-sum-exp) and :func:`ring_attention_backward`; :func:`decode_across_ranks` (a cache split
  over ranks, two all-reduces).
- **The cost model.** :func:`comm_bytes_per_rank` (exercise 13.4), bytes each rank sends per
  layer for every scheme, equal to what the communicators count on real runs;
  :func:`ring_overlap_tokens`, the block length at which a ring step's compute hides its transfer.

Shapes: B batch, H query heads, H_kv key/value heads, T tokens of the whole sequence, N ranks,
T/N tokens a rank, d head dim. Per rank q ``[B, H, T/N, d]``, k, v ``[B, H_kv, T/N, d]``;
positions ``[T/N]`` int64, the global positions of the rank's tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .nb03_masks import finite_or_zero
from .nb06_kv_sharing import repeat_kv
from .nb07_kv_cache import merge_partials
from .ranks import Comm, DeadlockError, RankError, run_ranks  # noqa: F401  (the notebook imports them here)

__all__ = ["zigzag_positions", "ring_attention", "ulysses_attention", "comm_bytes_per_rank"]

POSITION_BYTES = 8
"""Bytes a global position takes when it travels with its key and value (int64)."""


# --------------------------------------------------------------------------- shards of a sequence


LAYOUTS = ("contiguous", "striped", "zigzag")


def _check_divides(T: int, parts: int, what: str) -> int:
    if T % parts:
        raise ValueError(f"{what}: T={T} tokens cannot be cut into {parts} equal parts")
    return T // parts


def zigzag_positions(T: int, world_size: int, rank: int) -> torch.Tensor:
    """``[T/N]`` int64, increasing: the global positions rank holds in the zigzag layout
    (exercise 13.1). The sequence is cut into 2N equal chunks; rank r holds chunks r and
    2N-1-r, one early and one late, so every rank has the same causal work."""
    size = _check_divides(T, 2 * world_size, "zigzag_positions")
    chunks = torch.arange(T).view(2 * world_size, size)
    return torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]])


def shard_positions(T: int, world_size: int, rank: int, layout: str = "contiguous") -> torch.Tensor:
    """``[T/N]`` int64: rank's global positions. contiguous: ``[r T/N, (r+1) T/N)``; striped:
    ``r, r+N, r+2N, ...`` (Brandon et al. 2023); zigzag: :func:`zigzag_positions`."""
    if layout == "zigzag":
        return zigzag_positions(T, world_size, rank)
    size = _check_divides(T, world_size, f"shard_positions({layout!r})")
    if layout == "contiguous":
        return torch.arange(rank * size, (rank + 1) * size)
    if layout == "striped":
        return torch.arange(rank, T, world_size)
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def causal_pairs(T: int, world_size: int, layout: str) -> torch.Tensor:
    """``[steps N, ranks N]`` int64: the (query, key) pairs a causal mask allows rank r to compute
    at ring step s, when it holds its own queries and the K/V block of rank ``(r - s) mod N``."""
    pos = [shard_positions(T, world_size, r, layout) for r in range(world_size)]
    return torch.tensor([[int((pos[(r - s) % world_size][None, :] <= pos[r][:, None]).sum())
                          for r in range(world_size)] for s in range(world_size)])


# --------------------------------------------------------------------------- attention over blocks


def _scores(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool,
            scale: float) -> torch.Tensor:
    """Scaled scores ``[B, H, Tq, Tk]`` of q ``[B, H, Tq, d]`` against k ``[B, H, Tk, d]``; with
    ``causal``, a key at a later global position than the query's is -inf."""
    scores = q @ k.transpose(-1, -2) * scale
    return scores.masked_fill(k_pos[None, :] > q_pos[:, None], -math.inf) if causal else scores


def attend_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                 k_pos: torch.Tensor, causal: bool, scale: float | None = None):
    """Attention of q ``[B, H, Tq, d]`` over one block k, v ``[B, H_kv, Tk, d]`` (GQA: H a
    multiple of H_kv), the causal mask taken from global positions ``[Tq]``, ``[Tk]``:
    ``(out [B, H, Tq, d], lse [B, H, Tq])``, out normalised within the block. A row with no
    allowed key gets out 0 and lse -inf (weight 0 in a merge), never NaN."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    group = q.shape[1] // k.shape[1]
    scores = _scores(q, repeat_kv(k, group), q_pos, k_pos, causal, scale)  # [B, H, Tq, Tk]
    lse = torch.logsumexp(scores, dim=-1)                                   # [B, H, Tq]
    p = torch.exp(scores - finite_or_zero(lse)[..., None])
    return p @ repeat_kv(v, group), lse


def _ring_step(comm: Comm, tensors):
    """Pass every tensor one rank on (rank r sends to r+1, receives from r-1)."""
    dst, src = (comm.rank + 1) % comm.world_size, (comm.rank - 1) % comm.world_size
    return [comm.exchange(t, dst, src) for t in tensors]


def ring_attention(comm: Comm, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   positions: torch.Tensor, causal: bool = True):
    """Ring attention forward (exercise 13.2), run on every rank: ``(out [B, H, T/N, d],
    lse [B, H, T/N])`` of this rank's queries over the whole sequence. The K/V block and its
    global positions travel N-1 hops around the ring; each block's partial result is merged into
    the running one by the log-sum-exp rule (notebook 12). Equal to attention over the whole
    sequence, with the mask from the global positions, for any layout of the positions."""
    out, lse = attend_block(q, k, v, positions, positions, causal)
    kv = (k, v, positions)
    for _ in range(comm.world_size - 1):
        kv = _ring_step(comm, kv)
        part_out, part_lse = attend_block(q, kv[0], kv[1], positions, kv[2], causal)
        out, lse = merge_partials(torch.stack([out, part_out]), torch.stack([lse, part_lse]))
    return out, lse


def ring_attention_backward(comm: Comm, q, k, v, positions, out, lse, grad_out, causal: bool = True):
    """Ring attention backward, run on every rank: ``(dq, dk, dv)`` for this rank's q, k, v.

    The forward's global log-sum-exp gives each block's probabilities on their own
    (``p = exp(s - lse)``), so no block needs another. K/V travel the ring again, each with the
    dK/dV accumulated for it so far; after N-1 hops every rank has added its queries' share, and
    one more hop brings dK/dV home to the rank that holds that block."""
    scale = 1 / math.sqrt(q.shape[-1])
    group = q.shape[1] // k.shape[1]
    delta = (grad_out * out).sum(-1, keepdim=True)                        # [B, H, T/N, 1]
    dq = torch.zeros_like(q)
    block = [k, v, positions, torch.zeros_like(k), torch.zeros_like(v)]
    for step in range(comm.world_size):
        if step:
            block = _ring_step(comm, block)
        kb, vb, pos_b, dk, dv = block
        k_rep, v_rep = repeat_kv(kb, group), repeat_kv(vb, group)
        s = _scores(q, k_rep, positions, pos_b, causal, scale)
        p = torch.exp(s - finite_or_zero(lse)[..., None])                 # [B, H, T/N, Tk]
        dp = grad_out @ v_rep.transpose(-1, -2)
        ds = p * (dp - delta) * scale
        dq = dq + ds @ k_rep
        B, H_kv, Tk, d = kb.shape
        dk = dk + (ds.transpose(-1, -2) @ q).view(B, H_kv, group, Tk, d).sum(2)
        dv = dv + (p.transpose(-1, -2) @ grad_out).view(B, H_kv, group, Tk, d).sum(2)
        block = [kb, vb, pos_b, dk, dv]
    dk, dv = _ring_step(comm, block[3:])                                  # the last hop: home
    return dq, dk, dv


# --------------------------------------------------------------------------- Ulysses


def _ulysses_kv_heads(n_heads: int, n_kv_heads: int, world_size: int) -> int:
    """K/V heads after replication so that they split over the ranks: H_kv if N divides it,
    else N (each kv head repeated N/H_kv times, so rank r gets the head of its query heads)."""
    if n_heads % world_size:
        raise ValueError(f"Ulysses splits the {n_heads} query heads over {world_size} ranks: {n_heads} is "
                         f"not a multiple of {world_size}. Use a number of ranks that divides the heads "
                         "(or ring attention, which splits the sequence only)")
    if n_kv_heads % world_size == 0:
        return n_kv_heads
    if world_size % n_kv_heads:
        raise ValueError(f"{n_kv_heads} key/value heads cannot be split over {world_size} ranks, nor "
                         f"replicated to {world_size} ({world_size} is not a multiple of {n_kv_heads})")
    return world_size


def seq_to_heads(comm: Comm, x: torch.Tensor) -> torch.Tensor:
    """``[B, h, T/N, d]`` (all heads, a sequence shard) -> ``[B, h/N, T, d]`` (a head shard, the
    whole sequence), in one all-to-all. The heads go first so that dim 0 is cut by heads."""
    B, h, t, d = x.shape
    got = comm.all_to_all(x.permute(1, 0, 2, 3).contiguous())            # [h, B, t, d]: from rank i, its
    got = got.view(comm.world_size, h // comm.world_size, B, t, d)       # tokens of our heads
    return got.permute(2, 1, 0, 3, 4).reshape(B, h // comm.world_size, comm.world_size * t, d)


def heads_to_seq(comm: Comm, x: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`seq_to_heads`: ``[B, h/N, T, d]`` -> ``[B, h, T/N, d]``."""
    B, h_local, T, d = x.shape
    n = comm.world_size
    chunks = x.view(B, h_local, n, T // n, d).permute(2, 1, 0, 3, 4).contiguous()  # [N, h/N, B, t, d]
    got = comm.all_to_all(chunks.view(n * h_local, B, T // n, d))                # [N * h/N, B, t, d]
    return got.permute(1, 0, 2, 3)


def ulysses_attention(comm: Comm, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      causal: bool = True) -> torch.Tensor:
    """DeepSpeed-Ulysses (exercise 13.3), run on every rank: q ``[B, H, T/N, d]``, k, v
    ``[B, H_kv, T/N, d]``, rank r holding positions ``[r T/N, (r+1) T/N)`` -> ``[B, H, T/N, d]``.
    An all-to-all gives each rank H/N heads over the whole sequence, it attends as one process
    would, and a second all-to-all gives the sequence shards back. K/V heads fewer than the ranks
    are replicated first (``repeat_interleave``: query head h keeps its own kv head)."""
    n = comm.world_size
    H, H_kv = q.shape[1], k.shape[1]
    kv_heads = _ulysses_kv_heads(H, H_kv, n)
    if kv_heads != H_kv:
        k, v = repeat_kv(k, kv_heads // H_kv), repeat_kv(v, kv_heads // H_kv)
    q, k, v = (seq_to_heads(comm, t) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    return heads_to_seq(comm, out)


# --------------------------------------------------------------------------- tensor parallelism


def head_columns(n_heads: int, head_dim: int, rank: int, world_size: int) -> torch.Tensor:
    """The columns of a ``[D, H d]`` projection that hold rank's heads (H/N consecutive heads)."""
    if n_heads % world_size:
        raise ValueError(f"{n_heads} heads cannot be split over {world_size} ranks")
    per = n_heads // world_size
    return torch.arange(rank * per * head_dim, (rank + 1) * per * head_dim)


def kv_head_of_rank(n_heads: int, n_kv_heads: int, rank: int, world_size: int) -> list[int]:
    """The kv heads rank needs for its H/N query heads: its share of the kv heads when N divides
    H_kv; the one kv head of its group, replicated on N/H_kv ranks, when H_kv divides N."""
    if n_kv_heads % world_size == 0:
        per = n_kv_heads // world_size
        return list(range(rank * per, (rank + 1) * per))
    if world_size % n_kv_heads:
        raise ValueError(f"{n_kv_heads} kv heads over {world_size} ranks: neither divides the other")
    return [rank * n_kv_heads // world_size]


def tp_attention(comm: Comm, x: torch.Tensor, w_q: torch.Tensor, w_k: torch.Tensor, w_v: torch.Tensor,
                 w_o: torch.Tensor, n_heads: int, n_kv_heads: int, causal: bool = True) -> torch.Tensor:
    """Megatron tensor parallelism over heads, run on every rank with the full input x
    ``[B, T, D]`` and full weights (w_q ``[D, H d]``, w_k, w_v ``[D, H_kv d]``, w_o ``[H d, D]``):
    each rank takes the columns of its heads (column-parallel), attends, multiplies by its rows
    of w_o (row-parallel), and one all-reduce sums the ranks' partial outputs -> ``[B, T, D]``."""
    n, r = comm.world_size, comm.rank
    d = w_q.shape[1] // n_heads
    cols = head_columns(n_heads, d, r, n)
    kv_cols = torch.cat([torch.arange(h * d, (h + 1) * d) for h in kv_head_of_rank(n_heads, n_kv_heads, r, n)])
    B, T, _ = x.shape

    def heads(t):                                                         # [B, T, h d] -> [B, h, T, d]
        return t.view(B, T, -1, d).transpose(1, 2)

    q, k, v = heads(x @ w_q[:, cols]), heads(x @ w_k[:, kv_cols]), heads(x @ w_v[:, kv_cols])
    o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    partial = o.transpose(1, 2).reshape(B, T, -1) @ w_o[cols, :]         # [B, T, D]: this rank's heads
    return comm.all_reduce(partial)


# --------------------------------------------------------------------------- decoding


def decode_across_ranks(comm: Comm, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """One decode step over a cache split along T between the ranks: q ``[B, H, 1, d]`` (the
    same on every rank), this rank's part of the cache ``[B, H_kv, T_r, d]`` -> ``[B, H, 1, d]``
    on every rank. Two all-reduces: the max of the ranks' log-sum-exps, then the sum of their
    rescaled outputs and weights (one tensor). Their size does not depend on T."""
    positions = torch.zeros(q.shape[2], dtype=torch.long)
    out, lse = attend_block(q, k_cache, v_cache, positions, positions, causal=False)
    m = finite_or_zero(comm.all_reduce(lse, op="max"))                  # [B, H, 1]
    w = torch.exp(lse - m)[..., None]                                   # this rank's weight
    both = comm.all_reduce(torch.cat([w * out, w], dim=-1))             # [B, H, 1, d + 1]
    total = both[..., -1:]
    return both[..., :-1] / torch.where(total > 0, total, torch.ones_like(total))


# --------------------------------------------------------------------------- the cost model


@dataclass(frozen=True)
class Link:
    """A link between GPUs: ``bandwidth`` bytes/s one way, per GPU; ``source`` says where from."""

    name: str
    bandwidth: float
    source: str


LINKS = {
    "NVLink 4 (H100/H200 SXM)": Link("NVLink 4 (H100/H200 SXM)", 450e9,
                                     "NVIDIA H100 datasheet: 900 GB/s NVLink per GPU, both directions "
                                     "together, so 450 GB/s each way"),
    "InfiniBand NDR (400 Gb/s a GPU)": Link("InfiniBand NDR (400 Gb/s a GPU)", 50e9,
                                            "NVIDIA ConnectX-7 / Quantum-2: 400 Gb/s a port, one port a "
                                            "GPU in a DGX H100 = 50 GB/s each way"),
}


def comm_bytes_per_rank(scheme: str, T: int, n_heads: int, n_kv_heads: int, head_dim: int,
                        world_size: int, dtype_bytes: int = 2, batch: int = 1,
                        backward: bool = False) -> float:
    """Bytes one rank sends for one attention layer's forward (exercise 13.4), or with
    ``backward=True`` for its backward alone, as the communicators count them (:class:`Comm`):

    - ``"ring"``: N-1 hops of this rank's K/V block (``2 B H_kv (T/N) d`` values) and its
      positions (8 bytes a token); backward: the same N-1 hops with dK/dV travelling too, and
      one more hop of dK/dV home.
    - ``"ulysses"``: all-to-alls of q, k, v (kv heads replicated to N when fewer) and of the
      output, each sending ``(N-1)/N`` of its ``[B, heads, T/N, d]``; backward: the same four
      (dO forth, dq, dk, dv back).
    - ``"tensor"``: one all-reduce of the ``[B, T, D]`` output (``2 (N-1)/N`` of it), taking
      ``D = H d`` (true of every model in :data:`~helpers.configs.MODELS`); backward: one
      all-reduce of the input's gradient, the same size.
    """
    n, t = world_size, T / world_size
    if scheme == "ring":
        block = 2 * batch * n_kv_heads * t * head_dim * dtype_bytes
        forward = (n - 1) * (block + POSITION_BYTES * t)
        # backward: K/V, their positions and their dK/dV for N-1 hops, then dK/dV one hop home
        return (n - 1) * (2 * block + POSITION_BYTES * t) + block if backward else forward
    if scheme == "ulysses":
        kv = _ulysses_kv_heads(n_heads, n_kv_heads, n)
        values = batch * t * head_dim * (2 * n_heads + 2 * kv)          # q, out; k, v (dO, dq; dk, dv)
        return (n - 1) / n * values * dtype_bytes
    if scheme == "tensor":                                              # the output (the input's gradient)
        return 2 * (n - 1) / n * batch * T * n_heads * head_dim * dtype_bytes
    raise ValueError(f"scheme must be 'ring', 'ulysses' or 'tensor', got {scheme!r}")


def decode_bytes_per_rank(batch: int, n_heads: int, head_dim: int, world_size: int, dtype_bytes: int = 4) -> float:
    """Bytes one rank sends for :func:`decode_across_ranks`: two all-reduces, of ``[B, H, 1]``
    and ``[B, H, 1, d + 1]``; no T in it."""
    n = world_size
    return 2 * (n - 1) / n * batch * n_heads * (1 + head_dim + 1) * dtype_bytes


def ring_overlap_tokens(n_heads: int, n_kv_heads: int, dtype_bytes: int, peak_flops: float,
                        bandwidth: float) -> float:
    """The block length T/N above which a ring step's attention compute (``4 B H (T/N)^2 d``
    FLOPs, unmasked) takes longer than sending the K/V block (``2 B H_kv (T/N) d`` values) to the
    next rank, so the transfer can hide behind it: ``T/N >= (H_kv bytes / 2H) F / BW``."""
    return n_kv_heads * dtype_bytes / (2 * n_heads) * peak_flops / bandwidth


# --------------------------------------------------------------------------- notebook 13's demonstrations
# Functions the notebook runs on gloo processes, which receive them by name (they must live in a module).


def watch_collective(comm: Comm, op: str, x: torch.Tensor) -> torch.Tensor:
    """What this rank holds after one communication of x ``[n]``: ``"ring"`` (send to rank+1,
    receive from rank-1) -> ``[n]``; ``"all_reduce"`` -> ``[n]``; ``"all_gather"`` -> ``[N, n]``;
    ``"all_to_all"`` (n a multiple of N) -> ``[n]``."""
    if op == "ring":
        return _ring_step(comm, [x])[0]
    if op == "all_reduce":
        return comm.all_reduce(x)
    if op == "all_gather":
        return comm.all_gather(x)
    if op == "all_to_all":
        return comm.all_to_all(x)
    raise ValueError(f"op must be 'ring', 'all_reduce', 'all_gather' or 'all_to_all', got {op!r}")


def send_then_receive(comm: Comm, x: torch.Tensor) -> torch.Tensor:
    """Every rank sends x to rank+1, then receives from rank-1: with a send that waits for its
    receive (gloo's), every rank waits in its send and none reaches its receive: a deadlock."""
    comm.send(x, (comm.rank + 1) % comm.world_size)
    return comm.recv(x, (comm.rank - 1) % comm.world_size)


def even_ranks_send_first(comm: Comm, x: torch.Tensor) -> torch.Tensor:
    """The same ring with blocking calls that cannot deadlock: even ranks send then receive, odd
    ranks receive then send -> the x of rank-1."""
    nxt, prev = (comm.rank + 1) % comm.world_size, (comm.rank - 1) % comm.world_size
    if comm.rank % 2 == 0:
        comm.send(x, nxt)
        return comm.recv(x, prev)
    got = comm.recv(x, prev)
    comm.send(x, nxt)
    return got


def list_form_collectives(comm: Comm, x: torch.Tensor) -> dict[str, str]:
    """Try the list forms of all-to-all and reduce-scatter on this process group (gloo lacked them
    in some torch versions), x ``[N m]``: ``{name: "works" | "wrong result" | the error}``."""
    import torch.distributed as dist

    parts, found = list(x.chunk(comm.world_size)), {}
    expected = {"all_to_all": comm.all_to_all(x).chunk(comm.world_size),
                "reduce_scatter": [comm.all_reduce(x).chunk(comm.world_size)[comm.rank]]}
    for name in expected:
        try:
            if name == "all_to_all":
                out = [torch.empty_like(p) for p in parts]
                dist.all_to_all(out, parts)
            else:
                out = [torch.empty_like(parts[0])]
                dist.reduce_scatter(out[0], parts)
            same = all(torch.equal(a, b) for a, b in zip(out, expected[name]))
            found[name] = "works" if same else "wrong result"
        except Exception as error:  # noqa: BLE001  (the error is the finding)
            found[name] = f"{type(error).__name__}: {str(error).splitlines()[0]}"
    return found


def ring_attention_forward_backward(comm: Comm, q, k, v, positions, grad_out, causal: bool = True):
    """:func:`ring_attention`, then :func:`ring_attention_backward` for ``grad_out``
    ``[B, H, T/N, d]``: ``(out, lse, dq, dk, dv)``, this rank's shards."""
    out, lse = ring_attention(comm, q, k, v, positions, causal)
    return (out, lse, *ring_attention_backward(comm, q, k, v, positions, out, lse, grad_out, causal))


class TinyAttention(torch.nn.Module):
    """Causal GQA attention as ``nn.Linear`` layers ``q, k, v, o`` (no bias), x ``[B, T, D]`` ->
    ``[B, T, D]``. The heads are counted from the projections' widths, so the same forward runs on
    a rank that holds only some of them (after ``parallelize_module``)."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int):
        super().__init__()
        self.head_dim = head_dim
        self.q = torch.nn.Linear(d_model, n_heads * head_dim, bias=False)
        self.k = torch.nn.Linear(d_model, n_kv_heads * head_dim, bias=False)
        self.v = torch.nn.Linear(d_model, n_kv_heads * head_dim, bias=False)
        self.o = torch.nn.Linear(n_heads * head_dim, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape

        def heads(t):                                                     # [B, T, h d] -> [B, h, T, d]
            return t.view(B, T, -1, self.head_dim).transpose(1, 2)

        o = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)),
                                           is_causal=True, enable_gqa=True)
        return self.o(o.transpose(1, 2).reshape(B, T, -1))


def dtensor_tensor_parallel(comm: Comm, model: TinyAttention, x: torch.Tensor):
    """PyTorch's own tensor parallelism on a CPU device mesh: ``parallelize_module`` with q, k, v
    column-parallel and o row-parallel -> ``(out [B, T, D], {parameter: local shape})``.
    The output of the row-parallel layer is waited for before it leaves the rank (an unfinished
    asynchronous all-reduce would send this rank's partial sum)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for name in ("q", "k"):
        heads = getattr(model, name).out_features // model.head_dim
        if heads % comm.world_size:
            raise ValueError(f"ColwiseParallel cuts {name}'s {heads} heads into {comm.world_size} equal column blocks, "
                             "which would cut through a head: use a number of ranks that divides the query and "
                             "the key/value heads (replicating key/value heads is not in PyTorch's plan)")
    mesh = init_device_mesh("cpu", (comm.world_size,))
    plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": RowwiseParallel()}
    parallelize_module(model, mesh, plan)
    with torch.no_grad():
        out = model(x)
    out = out.wait() if hasattr(out, "wait") else out                    # an AsyncCollectiveTensor
    shapes = {name: list(p.to_local().shape) for name, p in model.named_parameters()}
    return out.clone(), shapes


def try_context_parallel(comm: Comm, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """Run ``F.scaled_dot_product_attention`` under PyTorch's experimental ``context_parallel``
    (q, k, v ``[B, H, T, d]``, sharded along T by it) -> "ran" or the first line of its error."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (comm.world_size,))
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return "ran"
    except Exception as error:  # noqa: BLE001  (the error is the finding)
        return f"{type(error).__name__}: {str(error).splitlines()[0]}"
