"""The KV cache: decoding one token at a time without recomputing the past (notebook 07).

Shapes: B batch, T_past tokens already cached, T = T_past + T_new, D = d_model, H heads, H_kv
key/value heads, d_k = D / H. Caches are ``[B, H_kv, T, d_k]`` (H_kv = H for the multi-head layer
of notebook 05). ``w_qkv`` ``[D, 3D]`` (columns Q, K, V) and ``w_o`` ``[D, D]`` as in notebook 05.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .configs import ModelConfig
from .nb01_qkv_shapes import merge_heads, qkv_projection, scaled_dot_product_attention
from .nb03_masks import causal_mask, finite_or_zero, padding_mask
from .nb09_flash_attention import flash_attention_tiled

# the exercises' functions
__all__ = ["kv_cache_bytes", "decode_step", "prefill_decode_flops", "ring_buffer_decode_step"]


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


# --------------------------------------------------------------------------- sliding windows: a ring buffer


def ring_buffer_decode_step(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_buf: torch.Tensor,
                            v_buf: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decode step of sliding-window attention with a ring-buffer cache (exercise 7.4).

    q ``[B, H, 1, d]``: the query of the token at position ``t`` (0, 1, 2, ...); k_new, v_new
    ``[B, H_kv, 1, d]``: its key and value; k_buf, v_buf ``[B, H_kv, W, d]``: the ring buffers of
    a window of W tokens, token p in slot ``p % W`` (slots not written yet hold anything). Query
    head h reads key/value head ``h // (H / H_kv)`` (GQA, notebook 06; PyTorch's ``enable_gqa``
    arranges them so, and notebook 06 imports notebook 10, which imports this module, so its
    ``grouped_query_attention`` is not imported here). -> ``(o [B, H, 1, d],
    k_buf, v_buf)``: the new key and value written to slot ``t % W`` of copies of the buffers (the
    arguments are not modified), and the query attending, with scale ``1/sqrt(d)``, to the
    ``min(t + 1, W)`` written slots: the W tokens ``t - W + 1 .. t`` (fewer at the start). The
    order of the slots does not matter: attention sums over a set of (key, value) pairs."""
    B, H_kv, W, d = k_buf.shape
    try:
        position = -1 if isinstance(t, (bool, torch.Tensor)) else operator.index(t)  # numpy ints too
    except TypeError:
        position = -1
    if position < 0:
        raise ValueError(f"t is the new token's position, an int >= 0; got {t!r}")
    t = position
    if W < 1:
        raise ValueError(f"the buffers need at least one slot (W = k_buf.shape[2] >= 1); got W = {W}")
    if v_buf.shape != k_buf.shape or k_new.shape != (B, H_kv, 1, d) or v_new.shape != k_new.shape:
        raise ValueError(f"k_buf, v_buf must be [B, H_kv, W, d] and k_new, v_new [B, H_kv, 1, d]; got "
                         f"{list(k_buf.shape)}, {list(v_buf.shape)}, {list(k_new.shape)}, {list(v_new.shape)}")
    if q.shape[0] != B or q.shape[2:] != (1, d):
        raise ValueError(f"q must be [B={B}, H, 1, d={d}], got {list(q.shape)}")
    if q.shape[1] % H_kv:
        raise ValueError(f"query heads H={q.shape[1]} must be a multiple of key/value heads H_kv={H_kv}")
    k_buf, v_buf = k_buf.clone(), v_buf.clone()           # an engine writes in place; see the docstring
    k_buf[:, :, t % W] = k_new[:, :, 0]
    v_buf[:, :, t % W] = v_new[:, :, 0]
    n = min(t + 1, W)                                      # slots written so far: 0..n-1
    o = F.scaled_dot_product_attention(q, k_buf[:, :, :n], v_buf[:, :, :n], enable_gqa=True)
    return o, k_buf, v_buf


@dataclass(frozen=True)
class WindowedModel:
    """A model whose layers attend within a sliding window of ``window`` tokens, except every
    ``global_every``-th layer (1-based), which attends to the whole context (0: no such layer).
    ``cfg`` holds the sizes, ``context`` its configuration's ``max_position_embeddings`` (the longest
    position it accepts: for Mistral-7B-v0.1 32,768, where its paper's Table 1 gives a ``context_len``
    of 8,192). The window counts keys, the query's own included (Hugging Face's ``sliding_window``;
    the Mistral paper's window W covers W + 1 positions, i - W .. i). These models are
    not in :data:`helpers.configs.MODELS` (which has no sliding-window fields yet)."""

    cfg: ModelConfig
    window: int
    global_every: int
    context: int
    source: str

    @property
    def name(self) -> str:
        return self.cfg.name

    def layer_windows(self) -> list[int]:
        """Per layer, its window in tokens, 0 for a layer that attends to the whole context (the
        layout of Hugging Face's ``layer_types``: layer i is global iff ``(i + 1) % global_every == 0``)."""
        every = self.global_every
        return [0 if every and (i + 1) % every == 0 else self.window for i in range(self.cfg.n_layers)]


def _sizes(name: str, d_model: int, n_layers: int, n_heads: int, n_kv_heads: int, head_dim: int, d_ff: int,
           vocab: int, source: str) -> ModelConfig:
    return ModelConfig(name, "gqa", d_model, n_layers, n_heads, n_kv_heads, head_dim, d_ff, vocab, source)


WINDOWED: dict[str, WindowedModel] = {m.name: m for m in [
    WindowedModel(_sizes("Mistral-7B-v0.1", 4096, 32, 32, 8, 128, 14336, 32000, "Mistral-7B-v0.1 config.json"),
                  4096, 0, 32768, "config.json: sliding_window 4096 in every layer, max_position_embeddings "
                  "32768; Jiang et al. 2023 (arXiv:2310.06825), the rolling buffer cache"),
    WindowedModel(_sizes("Gemma-2-9B", 3584, 42, 16, 8, 256, 14336, 256000, "gemma-2-9b config.json"),
                  4096, 2, 8192, "config.json: sliding_window 4096, max_position_embeddings 8192; Gemma 2 "
                  "report (arXiv:2408.00118): local and global layers alternate"),
    WindowedModel(_sizes("Gemma-3-27B", 5376, 62, 32, 16, 128, 21504, 262208, "gemma-3-27b text_config"),
                  1024, 6, 131072, "text_config: sliding_window 1024, sliding_window_pattern 6, "
                  "max_position_embeddings 131072; Gemma 3 report (arXiv:2503.19786): 5 local layers per global one"),
]}


def layered_cache_bytes(cfg: ModelConfig, seq_len: int, windows: list[int], batch: int = 1, dtype_bytes: int = 2,
                        layers_per_kv: int = 1) -> int:
    """Bytes of the K/V cache of a model whose layer i attends within ``windows[i]`` tokens (0: the
    whole context), holding ``batch`` sequences of ``seq_len`` tokens: each cached layer is
    :func:`kv_cache_bytes` (exercise 7.1) of its own number of tokens, ``min(T, W)`` for a windowed
    layer's ring buffer, T for a full one (GQA, MQA, MHA models; not MLA). ``layers_per_kv`` = s > 1:
    cross-layer attention (CLA), each group of s adjacent layers uses the K/V of its first layer,
    which alone is cached (the layers of a group must have the same window)."""
    if not isinstance(seq_len, int) or seq_len < 0 or any(not isinstance(w, int) or w < 0 for w in windows):
        raise ValueError(f"seq_len and the windows count tokens (ints >= 0; a window of 0: the whole context); "
                         f"got {seq_len!r} and {sorted(set(windows))[:4]}")
    if len(windows) != cfg.n_layers:
        raise ValueError(f"windows must give one window per layer ({cfg.n_layers}), got {len(windows)}")
    if cfg.kind == "mla":
        raise ValueError("layered_cache_bytes counts key/value heads; an MLA model caches a latent")
    if layers_per_kv < 1:
        raise ValueError(f"layers_per_kv must be at least 1, got {layers_per_kv}")
    groups = [windows[i:i + layers_per_kv] for i in range(0, len(windows), layers_per_kv)]
    if any(len(set(group)) > 1 for group in groups):
        raise ValueError("layers that share one K/V must have the same window")
    return sum(kv_cache_bytes(batch, min(seq_len, group[0]) if group[0] else seq_len, 1, cfg.n_kv_heads,
                              cfg.head_dim, dtype_bytes) for group in groups)
