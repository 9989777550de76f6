"""Sharing keys and values between heads: MQA, GQA and MLA (notebook 06).

Shapes: B batch, T sequence length, H query heads, H_kv key/value heads (H divisible by H_kv),
n_rep = g = H / H_kv query heads per key/value head, d = d_h the head width. Query head h reads
key/value head ``h // n_rep``: the *grouped (consecutive)* layout, each key/value head serving a
block of g consecutive query heads; ``x.repeat`` gives the *tiled* layout, ``h % H_kv``. For MLA (DeepSeek-V2/V3): a latent ``c_kv`` of width d_c
(``kv_lora_rank``) and one RoPE key of width d_r (``rope_dim``) shared by all heads are what the
cache holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .nb01_qkv_shapes import merge_heads, scaled_dot_product_attention, split_heads
from .nb03_masks import causal_mask, masked_softmax

__all__ = ["repeat_kv", "grouped_query_attention", "kv_values_per_token", "mla_absorbed_scores"]

KINDS = ("mha", "gqa", "mqa", "mla")


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """``[B, H_kv, T, d]`` -> ``[B, H_kv * n_rep, T, d]`` where head h is kv head ``h // n_rep``
    (exercise 6.1). The expand is a view (no copy); the reshape copies only because the result
    must be one tensor of H heads: the grouped (consecutive) layout ``[k0, k0, k1, k1]``.
    ``x.repeat(1, n_rep, 1, 1)`` would give the tiled layout instead (h -> h % H_kv)."""
    if n_rep < 1:
        raise ValueError(f"n_rep must be a positive integer, got {n_rep}")
    B, H_kv, T, d = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None].expand(B, H_kv, n_rep, T, d).reshape(B, H_kv * n_rep, T, d)


def grouped_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            causal: bool = False) -> torch.Tensor:
    """q ``[B, H, T_q, d]``, k, v ``[B, H_kv, T_k, d]`` -> ``[B, H, T_q, d]`` (exercise 6.2).

    MHA is H_kv = H, MQA is H_kv = 1. With ``causal`` the last query sits at the last key (the
    queries are the newest T_q positions, as when decoding with a cache); for T_q = T_k that is the
    usual lower-triangular mask. Equal to ``F.scaled_dot_product_attention(..., enable_gqa=True)``."""
    H, H_kv = q.shape[1], k.shape[1]
    if H % H_kv:
        raise ValueError(f"query heads H={H} must be a multiple of key/value heads H_kv={H_kv}")
    T_q, T_k = q.shape[-2], k.shape[-2]
    if causal and T_q > T_k:
        raise ValueError(f"causal attention with more queries (T_q={T_q}) than keys (T_k={T_k})")
    allowed = causal_mask(T_k, device=q.device)[T_k - T_q:] if causal else None
    return scaled_dot_product_attention(q, repeat_kv(k, H // H_kv), repeat_kv(v, H // H_kv), allowed)


def kv_values_per_token(kind: str, n_heads: int, n_kv_heads: int | None = None, head_dim: int = 0,
                        kv_lora_rank: int = 0, rope_dim: int = 0) -> int:
    """Numbers cached per token per layer (exercise 6.3), not bytes (times the dtype's size for
    bytes): MHA ``2 H d_h``, GQA ``2 H_kv d_h``, MQA ``2 d_h``, MLA ``d_c + d_r``. Arguments a
    kind does not use are ignored."""
    kind = kind.lower() if isinstance(kind, str) else kind
    if kind == "mha":
        return 2 * n_heads * head_dim
    if kind == "gqa":
        return 2 * n_kv_heads * head_dim
    if kind == "mqa":
        return 2 * head_dim
    if kind == "mla":
        return kv_lora_rank + rope_dim
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def config_values_per_token(cfg) -> int:
    """:func:`kv_values_per_token` for a :class:`helpers.configs.ModelConfig`."""
    return kv_values_per_token(cfg.kind, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.kv_lora_rank, cfg.rope_dim)


def model_cache_bytes(cfg, seq_len: int, batch: int = 1, dtype_bytes: int = 2,
                      values_per_token: int | None = None) -> int:
    """Bytes of the K/V cache of a whole model (a :class:`helpers.configs.ModelConfig`) holding
    ``batch`` sequences of ``seq_len`` tokens: ``B * cfg.cached_tokens(T) * values * dtype_bytes``,
    where ``values`` is what one token caches per layer (default the model's own,
    :func:`config_values_per_token`; pass another to price a variant). ``cached_tokens`` sums the
    tokens each layer holds: T for a full-attention layer, at most one chunk for a chunked one
    (Llama 4). With full attention everywhere it equals notebook 07's ``kv_cache_bytes``."""
    values = config_values_per_token(cfg) if values_per_token is None else values_per_token
    return batch * cfg.cached_tokens(seq_len) * values * dtype_bytes


def kv_group_of(n_heads: int, n_kv_heads: int) -> list[int]:
    """For each query head h, the key/value head it reads: ``h // (H / H_kv)``."""
    if n_heads % n_kv_heads:
        raise ValueError(f"n_heads={n_heads} is not divisible by n_kv_heads={n_kv_heads}")
    return [h // (n_heads // n_kv_heads) for h in range(n_heads)]


# =========================================================================== MLA


def mla_absorbed_scores(q: torch.Tensor, c_kv: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """Unscaled content scores of MLA computed against the latent (exercise 6.4).

    q ``[B, H, T_q, d_h]``, c_kv ``[B, T, d_c]``, w_uk ``[H, d_c, d_h]`` (head h's key is
    ``c_kv @ w_uk[h]``) -> ``[B, H, T_q, T]``. Since ``q_h . (c W_h) = (q_h W_h^T) . c``, the
    query is moved into the latent space (``[B, H, T_q, d_c]``) and the per-head keys
    ``[B, H, T, d_h]`` are never formed."""
    q_latent = q @ w_uk.transpose(-2, -1)                       # [B, H, T_q, d_h] @ [H, d_h, d_c]
    return q_latent @ c_kv.unsqueeze(1).transpose(-2, -1)       # [B, H, T_q, d_c] @ [B, 1, d_c, T]


@dataclass(frozen=True)
class MLAWeights:
    """One MLA layer (queries not compressed, no norms: only what the cache depends on).

    w_q ``[D, H d_h]`` content queries, w_qr ``[D, H d_r]`` per-head RoPE queries, w_dkv
    ``[D, d_c]`` the down-projection to the latent, w_kr ``[D, d_r]`` the RoPE key shared by all
    heads, w_uk ``[H, d_c, d_h]`` and w_uv ``[H, d_c, d_h]`` the per-head key and value
    up-projections, w_o ``[H d_h, D]``."""

    w_q: torch.Tensor
    w_qr: torch.Tensor
    w_dkv: torch.Tensor
    w_kr: torch.Tensor
    w_uk: torch.Tensor
    w_uv: torch.Tensor
    w_o: torch.Tensor

    @property
    def sizes(self) -> tuple[int, int, int, int, int]:
        """``(D, H, d_h, d_c, d_r)``."""
        H, d_c, d_h = self.w_uk.shape
        return self.w_q.shape[0], H, d_h, d_c, self.w_kr.shape[1]


def mla_init(d_model: int, n_heads: int, head_dim: int, kv_lora_rank: int, rope_dim: int,
             generator: torch.Generator, dtype: torch.dtype = torch.float32) -> MLAWeights:
    """Random MLA weights, each scaled by 1/sqrt(fan-in)."""
    D, H, d_h, d_c, d_r = d_model, n_heads, head_dim, kv_lora_rank, rope_dim

    def w(*shape: int, fan_in: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator, dtype=torch.float64) / math.sqrt(fan_in)).to(dtype)

    return MLAWeights(w(D, H * d_h, fan_in=D), w(D, H * d_r, fan_in=D), w(D, d_c, fan_in=D),
                      w(D, d_r, fan_in=D), w(H, d_c, d_h, fan_in=d_c), w(H, d_c, d_h, fan_in=d_c),
                      w(H * d_h, D, fan_in=H * d_h))


def mla_cache(x: torch.Tensor, w: MLAWeights, positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """What MLA caches for the tokens x ``[B, T, D]``: ``(c_kv [B, T, d_c], k_rope [B, T, d_r])``,
    the RoPE key already rotated to its position (``positions`` ``[T]``, default 0..T-1)."""
    from .nb10_positions import rope  # notebook 10's RoPE (rotate-half), imported when first needed

    positions = torch.arange(x.shape[1], device=x.device) if positions is None else positions
    return x @ w.w_dkv, rope(x @ w.w_kr, positions)


def mla_queries(x: torch.Tensor, w: MLAWeights, positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The queries of x ``[B, T, D]``: ``(q [B, H, T, d_h], q_rope [B, H, T, d_r])``."""
    from .nb10_positions import rope

    _, H, _, _, _ = w.sizes
    positions = torch.arange(x.shape[1], device=x.device) if positions is None else positions
    return split_heads(x @ w.w_q, H), rope(split_heads(x @ w.w_qr, H), positions)


def mla_attention(x: torch.Tensor, w: MLAWeights, causal: bool = True, absorbed: bool = False) -> torch.Tensor:
    """One MLA layer: x ``[B, T, D]`` -> ``[B, T, D]``.

    Head h scores ``(q_h . k_h + q_rope_h . k_rope) / sqrt(d_h + d_r)`` with ``k_h = c_kv @ w_uk[h]``
    and reads values ``c_kv @ w_uv[h]``. ``absorbed=False`` forms those per-head keys and values
    (``[B, H, T, d_h]``); ``absorbed=True`` never does: the content scores come from
    :func:`mla_absorbed_scores` and ``w_uv[h]`` is folded into head h's rows of ``w_o``."""
    _, H, d_h, d_c, d_r = w.sizes
    T = x.shape[1]
    c_kv, k_rope = mla_cache(x, w)                                 # [B, T, d_c], [B, T, d_r]
    q, q_rope = mla_queries(x, w)                                  # [B, H, T, d_h], [B, H, T, d_r]
    rope_scores = q_rope @ k_rope.unsqueeze(1).transpose(-2, -1)   # [B, H, T, T]: one key, all heads
    if absorbed:
        content = mla_absorbed_scores(q, c_kv, w.w_uk)
    else:
        k = c_kv.unsqueeze(1) @ w.w_uk                             # [B, H, T, d_h]: per-head keys
        content = q @ k.transpose(-2, -1)
    allowed = causal_mask(T, device=x.device) if causal else None
    p = masked_softmax((content + rope_scores) / math.sqrt(d_h + d_r), allowed)  # [B, H, T, T]
    if absorbed:
        w_ov = w.w_uv @ w.w_o.view(H, d_h, -1)                     # [H, d_c, D]: W_UV folded into W_O
        return ((p @ c_kv.unsqueeze(1)) @ w_ov).sum(dim=1)         # [B, H, T, d_c] -> [B, T, D]
    v = c_kv.unsqueeze(1) @ w.w_uv                                 # [B, H, T, d_h]: per-head values
    return merge_heads(p @ v) @ w.w_o


def mla_decode_costs(n_heads: int, head_dim: int, kv_lora_rank: int, rope_dim: int, context: int,
                     absorbed: bool, n_queries: int = 1, dtype_bytes: int = 2, batch: int = 1) -> dict[str, int]:
    """FLOPs and bytes of MLA's attention core for ``n_queries`` new queries per head against
    ``context`` cached tokens (decode: n_queries = 1, or 2 with one drafted token; prefill:
    n_queries = context), one layer, for ``batch`` sequences that each have their own cache.
    Projections that do not depend on the context (queries, the new token's latent, W_O) are
    left out; the multiply-add counts 2.

    Naive: up-project the whole cache to per-head keys and values (``4 T H d_c d_h``), then
    attend at width d_h (plus the shared RoPE key). Absorbed: move each query into the latent
    (``2 n_q H d_h d_c``), attend at width d_c + d_r, and bring the result back through W_UV
    (``2 n_q H d_c d_h``). Bytes read: each sequence's cache, the up-projection weights once for
    the whole batch, and (naive) the per-head keys and values written out and read back once.
    Absorbed, FLOPs per byte of cache tend to ``n_q H (2 d_c + d_r) / (d_c + d_r)`` (bf16) as
    the context or the batch grows: :func:`mla_decode_intensity_limit`."""
    H, d_h, d_c, d_r, T, n = n_heads, head_dim, kv_lora_rank, rope_dim, context, n_queries
    cache = T * (d_c + d_r)
    weights = 2 * H * d_c * d_h                                    # W_UK and W_UV
    if absorbed:
        flops = 2 * n * H * d_h * d_c + 2 * n * H * T * (d_c + d_r) + 2 * n * H * T * d_c + 2 * n * H * d_c * d_h
        per_sequence = cache
    else:
        flops = 4 * T * H * d_c * d_h + 2 * n * H * T * (d_h + d_r) + 2 * n * H * T * d_h
        per_sequence = cache + 2 * H * T * d_h                     # per-head K and V read back
    return {"flops": batch * flops, "bytes": (batch * per_sequence + weights) * dtype_bytes}


def mla_decode_intensity_limit(n_heads: int, kv_lora_rank: int, rope_dim: int, n_queries: int = 1,
                               dtype_bytes: int = 2) -> float:
    """FLOPs per byte of cache of absorbed MLA decoding, once the cache's bytes dominate (long
    context or large batch): each cached latent serves all H heads, ``2 (d_c + d_r)`` FLOPs per
    head and query for the scores and ``2 d_c`` for the values, against ``(d_c + d_r)`` numbers
    read: ``2 n_q H (2 d_c + d_r) / ((d_c + d_r) * dtype_bytes)``."""
    H, d_c, d_r = n_heads, kv_lora_rank, rope_dim
    return 2 * n_queries * H * (2 * d_c + d_r) / ((d_c + d_r) * dtype_bytes)
