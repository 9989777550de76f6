"""The KV cache: decoding one token at a time without recomputing the past (notebook 07).

Shapes: B batch, T_past tokens already cached, T = T_past + T_new, D = d_model, H heads, H_kv
key/value heads, d_k = D / H. Caches are ``[B, H_kv, T, d_k]`` (H_kv = H for the multi-head layer
of notebook 05). ``w_qkv`` ``[D, 3D]`` (columns Q, K, V) and ``w_o`` ``[D, D]`` as in notebook 05.
"""

from __future__ import annotations

import torch

from .nb01_qkv_shapes import merge_heads, qkv_projection, scaled_dot_product_attention
from .nb03_masks import causal_mask, finite_or_zero, padding_mask
from .nb09_flash_attention import flash_attention_tiled

__all__ = ["kv_cache_bytes", "decode_step", "prefill_decode_flops"]  # the exercises' functions


def kv_cache_bytes(batch: int, seq_len: int, n_layers: int, n_kv_heads: int, head_dim: int,
                   dtype_bytes: int) -> int:
    """Bytes of the K and V caches of a whole model (exercise 7.1): per token and layer, each of
    the H_kv key/value heads stores one key and one value of d_h numbers:
    ``2 * B * T * L * H_kv * d_h * dtype_bytes``."""
    return 2 * batch * seq_len * n_layers * n_kv_heads * head_dim * dtype_bytes


def sequences_that_fit(memory: int, per_sequence: int, reserved: int = 0) -> int:
    """How many caches of ``per_sequence`` bytes fit in ``memory`` bytes once ``reserved`` bytes
    (the weights, say) are taken: ``(memory - reserved) // per_sequence``, 0 if nothing is left."""
    return max(0, (memory - reserved) // per_sequence)


def empty_kv(batch: int, n_heads: int, head_dim: int, dtype: torch.dtype = torch.float32,
             device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Two empty caches ``[B, H, 0, d_k]``: what :func:`decode_step` starts from."""
    return tuple(torch.zeros(batch, n_heads, 0, head_dim, dtype=dtype, device=device) for _ in range(2))


def decode_step(x_t: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, w_qkv: torch.Tensor,
                w_o: torch.Tensor, n_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One causal self-attention step with a cache (exercise 7.2).

    x_t ``[B, T_new, D]`` (T_new = 1 when decoding), caches ``[B, H, T_past, d_k]`` ->
    ``(y_t [B, T_new, D], k_cache, v_cache [B, H, T_past + T_new, d_k])``. The new tokens' keys
    and values are appended (``torch.cat``: new tensors, the arguments are not modified), then
    the new queries attend to every cached key. They are the *last* T_new positions, so the
    causal mask is aligned bottom-right; for one new token that row allows every key."""
    q, k, v = qkv_projection(x_t, w_qkv, n_heads)                   # [B, H, T_new, d_k] each
    k_cache, v_cache = torch.cat([k_cache, k], dim=2), torch.cat([v_cache, v], dim=2)
    T_new, T = q.shape[2], k_cache.shape[2]
    allowed = causal_mask(T, device=x_t.device)[T - T_new:]         # [T_new, T], bottom-right
    y_t = merge_heads(scaled_dot_product_attention(q, k_cache, v_cache, allowed)) @ w_o
    return y_t, k_cache, v_cache


def prefill_decode_flops(prompt_len: int, new_tokens: int, d_model: int, n_layers: int,
                         use_cache: bool) -> int:
    """FLOPs of the MHA attention layers while a sequence grows from P = prompt_len to
    P + new_tokens tokens (exercise 7.3; softmax and causal halving not counted).

    Prefill: ``8 d^2 P + 4 d P^2`` per layer (Q, K, V, O projections of P tokens, P x P scores and
    weighted values). Step t = 1..new_tokens brings the sequence to L = P + t tokens: with a
    cache only the new token is projected and attends to L keys, ``8 d^2 + 4 d L``; without one
    all L tokens are recomputed, ``8 d^2 L + 4 d L^2``. Times n_layers."""
    d, P = d_model, prompt_len
    total = 8 * d * d * P + 4 * d * P * P
    for t in range(1, new_tokens + 1):
        L = P + t
        total += 8 * d * d + 4 * d * L if use_cache else 8 * d * d * L + 4 * d * L * L
    return n_layers * total


# --------------------------------------------------------------------------- a cache done properly


class KVCache:
    """Preallocated keys and values of one layer, for B sequences of possibly different lengths.

    ``k``, ``v`` ``[B, H_kv, T_max, d]`` are allocated once; ``lengths`` ``[B]`` (int64) says how
    many positions of each sequence are filled. Appending writes in place at each sequence's own
    pointer (no copy of the past, unlike ``torch.cat``); :meth:`reset` sets the pointers back to 0
    for the next batch of sequences. Entries at or past a pointer are stale and must never be
    attended: :meth:`allowed` masks them (a padding mask, notebook 03)."""

    def __init__(self, batch: int, n_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        self.k = torch.zeros(batch, n_kv_heads, max_len, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.shared_length: int | None = 0  # the length of every sequence while they are equal

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def reset(self) -> None:
        """Start new sequences: every pointer back to 0 (old entries become stale, not erased)."""
        self.lengths.zero_()
        self.shared_length = 0

    def append(self, k_new: torch.Tensor, v_new: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Write k_new, v_new ``[B, H_kv, T_new, d]`` at positions ``lengths[b] ..`` of each
        sequence b, then advance each pointer by ``valid[b]`` (default T_new: right-padded prompts
        advance by their true length, so their padding is overwritten by the next token)."""
        B, _, T_new, _ = k_new.shape
        longest = self.shared_length if self.shared_length is not None else int(self.lengths.max())
        if longest + T_new > self.max_len:
            raise ValueError(f"the cache holds {self.max_len} positions; appending {T_new} to "
                             f"{longest} would overflow it")
        if self.shared_length is not None:  # all sequences equally long: one slice write each
            self.k[:, :, longest:longest + T_new] = k_new
            self.v[:, :, longest:longest + T_new] = v_new
        else:  # each sequence at its own position
            rows = torch.arange(B, device=self.k.device)[:, None]                   # [B, 1]
            pos = self.lengths[:, None] + torch.arange(T_new, device=self.k.device)  # [B, T_new]
            self.k[rows, :, pos] = k_new.transpose(1, 2)   # indexed slots are [B, T_new, H_kv, d]
            self.v[rows, :, pos] = v_new.transpose(1, 2)
        self.lengths += T_new if valid is None else valid.to(self.lengths)
        if valid is not None:
            self.shared_length = None
        elif self.shared_length is not None:
            self.shared_length += T_new

    def allowed(self, T_new: int, T_keys: int, before: torch.Tensor) -> torch.Tensor:
        """``[B, 1, T_new, T_keys]`` bool: new query i of sequence b (position ``before[b] + i``)
        may attend key j iff j is at or before it (causal) and j < lengths[b] (filled)."""
        j = torch.arange(T_keys, device=self.k.device)
        query_pos = before[:, None] + torch.arange(T_new, device=self.k.device)   # [B, T_new]
        causal = j[None, None, :] <= query_pos[:, :, None]                        # [B, T_new, T_keys]
        return causal[:, None] & padding_mask(self.lengths, T_keys)               # & [B, 1, 1, T_keys]


def cached_attention(x: torch.Tensor, cache: KVCache, w_qkv: torch.Tensor, w_o: torch.Tensor, n_heads: int,
                     valid: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`decode_step` with a preallocated :class:`KVCache` (multi-head, H_kv = H): x ``[B,
    T_new, D]`` -> ``[B, T_new, D]``; the cache is updated in place. ``valid`` ``[B]``: how many of
    the T_new tokens of each sequence are real (right-padded prompts)."""
    q, k, v = qkv_projection(x, w_qkv, n_heads)
    before = cache.lengths.clone()
    cache.append(k, v, valid)
    T_keys = int(before.max()) + q.shape[2]                      # every key a new query may see
    allowed = cache.allowed(q.shape[2], T_keys, before)
    o = scaled_dot_product_attention(q, cache.k[:, :, :T_keys], cache.v[:, :, :T_keys], allowed)
    return merge_heads(o) @ w_o


# --------------------------------------------------------------------------- split-K decoding


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge attention computed over separate chunks of the keys (the log-sum-exp rule).

    outs ``[n_chunks, ..., d]``: each chunk's softmax-weighted values (normalised within the
    chunk), lses ``[n_chunks, ...]``: each chunk's log-sum-exp of scores. Then
    ``lse = logsumexp_c(lse_c)`` and ``out = sum_c exp(lse_c - lse) out_c``. A chunk with no
    allowed key (lse = -inf) gets weight 0; if every chunk is empty the output is 0."""
    lse = torch.logsumexp(lses, dim=0)                                 # [...]
    weights = torch.exp(lses - finite_or_zero(lse))                    # [n_chunks, ...], sum 1
    return (weights[..., None] * outs).sum(dim=0), lse


def split_k_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   n_splits: int) -> torch.Tensor:
    """FlashDecoding: q ``[B, H, T_q, d]`` (new queries that see every cached key), caches
    ``[B, H_kv, T, d]`` -> ``[B, H, T_q, d]``. The cache is cut into ``n_splits`` chunks along T,
    each attended on its own (on a GPU: in parallel, by different programs) with notebook 09's
    tiled attention, which also returns each row's log-sum-exp; :func:`merge_partials` combines
    them. Equal to attention over the whole cache."""
    chunks = [(k, v) for k, v in zip(k_cache.tensor_split(n_splits, dim=2), v_cache.tensor_split(n_splits, dim=2))
              if k.shape[2] > 0]
    parts = [flash_attention_tiled(q, k, v, block_size=max(k.shape[2], 1)) for k, v in chunks]
    out, _ = merge_partials(torch.stack([o.float() for o, _ in parts]), torch.stack([lse for _, lse in parts]))
    return out.to(q.dtype)
