"""Checks for notebook 07_kv_cache: exercises 7.1-7.3.

Every case, expected value and mistake model is computed before the learner's function runs.
7.2 compares the returned caches as well as the output, on single steps (a cache of 7 tokens, an
empty cache, float64) and on a whole sequence decoded token by token from an empty cache, each
step fed the caches the learner returned at the step before. Shapes: no two of B, H, T_past and
d_k are equal.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import nb07_kv_cache as ref
from ..configs import MODELS
from ..nb01_qkv_shapes import merge_heads, qkv_projection, scaled_dot_product_attention
from ..nb05_multihead import multi_head_attention
from .core import Trial, describe_case, draw, exercise, seeded
from .nb08_flops_memory import _known, check_count

__all__ = ["kv_cache_bytes", "decode_step", "prefill_decode_flops"]

NB = "07_kv_cache"


# --------------------------------------------------------------------------- 7.1 kv_cache_bytes


def _cache_mistakes(B: int, T: int, L: int, H_kv: int, d: int, b: int) -> dict[str, float]:
    right = ref.kv_cache_bytes(B, T, L, H_kv, d, b)
    return _known({
        "you counted the keys only: the cache holds a key AND a value per token, layer and kv head (the 2).": right / 2,
        "you counted bits: dtype_bytes is already in bytes (bf16 = 2).": right * 8,
        "you left out the layers: every layer has its own K and V caches, times n_layers.": right / L,
        "you returned GB as a float: return the number of bytes, an int (divide by 1e9 only to print).": right / 1e9,
        "you returned GiB as a float: return the number of bytes, an int (divide by 2**30 only to print).": right / 2**30,
        "you left out the batch: each of the B sequences has its own cache.": right / B,
        "you used head_dim where n_kv_heads belongs: the cache holds n_kv_heads heads of head_dim numbers "
        "each, 2 * ... * n_kv_heads * head_dim * dtype_bytes.": right // H_kv * d,
        "you ignored dtype_bytes (2 bytes, as for bf16, whatever the dtype): multiply by dtype_bytes.": right // b * 2,
        "you ignored dtype_bytes: multiply by dtype_bytes, the size of one number.": right // b,
    }, right)


@exercise("7.1", "bytes of a KV cache", points=1, stars=1, notebook=NB, section="5. How big the cache gets")
def kv_cache_bytes(t: Trial) -> None:
    t.error_hints = {
        r"takes \d+ positional argument": "the signature is kv_cache_bytes(batch, seq_len, n_layers, n_kv_heads, "
        "head_dim, dtype_bytes).",
    }
    llama = MODELS["Llama-3-8B"]
    # Llama-3-8B at 8,192 tokens in bf16 (exactly 1 GiB), then cases where no two sizes are equal
    # (fp32, fp8 and a 3-byte dtype, so that bits, GB and GiB all give other numbers).
    # A 1-byte and a 3-byte case tell "dtype ignored" (2 bytes hard-coded) from "keys only" (both halve at 4 bytes).
    cases = [(1, 8192, llama.n_layers, llama.n_kv_heads, llama.head_dim, 2), (3, 1000, 4, 5, 16, 1),
             (3, 5, 7, 2, 11, 4), (4, 9, 6, 1, 10, 3)]
    # Then one drawn from a seed: B 1-4, T 1-2048, 1-8 layers, 1-8 kv heads of 2-32 numbers, 1 to 4 bytes.
    g = seeded(750)
    cases.append((draw(g, 1, 5), draw(g, 1, 2049), draw(g, 1, 9), draw(g, 1, 9), draw(g, 2, 33), draw(g, 1, 5)))
    planned = [(c, ref.kv_cache_bytes(*c), _cache_mistakes(*c)) for c in cases]
    for (B, T, L, H_kv, d, b), expected, mistakes in planned:
        got = t.call(B, T, L, H_kv, d, b, case=describe_case(batch=B, seq_len=T, n_layers=L, n_kv_heads=H_kv,
                                                             head_dim=d, dtype_bytes=b))
        check_count(t, got, expected, "bytes", mistakes,
                    "2 (K and V) * batch * seq_len * n_layers * n_kv_heads * head_dim * dtype_bytes.")


# --------------------------------------------------------------------------- 7.2 decode_step

_RECIPE_72 = ("q, k, v = the projection of x_t split into heads ([B, H, 1, d_k] each); "
              "k_cache = torch.cat([k_cache, k], dim=2), the same for v; y_t = the merged heads of "
              "softmax(q k_cache^T / sqrt(d_k)) v_cache, times w_o (no mask: the new token may see every "
              "cached key); return y_t, k_cache, v_cache.")
_NOT_ATTENDED = ("the new token's own key and value were not attended: append k and v to the caches "
                 "first, then attend over the whole updated cache (a token attends to itself).")
_TOP_LEFT = ("is_causal=True with one query aligns the causal mask top-left: the query is treated as "
             "position 0 and sees only the first key. A single new token may see every cached key: "
             "use no mask (or a bottom-right mask, causal_mask(T)[-1:]).")
_PREPENDED = ("you put the new token at the start of the cache: append it at the end, "
              "torch.cat([cache, new], dim=2), so that position t stays at index t.")
_OLD_CACHE = ("you returned the cache you were given: return the updated caches (past + new token), "
              "[B, H, T_past + 1, d_k].")
_NEW_ONLY = "you returned only the new token's key/value: return the whole updated cache, past + new."


def _mha_weights(B: int, H: int, d_k: int, T: int, seed: int, dtype: torch.dtype):
    """x [B, T, D] and weights scaled so that outputs are O(1)."""
    D = H * d_k
    g = seeded(seed)
    x = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    w_qkv = torch.randn(D, 3 * D, generator=g, dtype=torch.float64) * (1.5 / math.sqrt(D))
    w_o = torch.randn(D, D, generator=g, dtype=torch.float64) / math.sqrt(D)
    return x.to(dtype), w_qkv.to(dtype), w_o.to(dtype)


def _step_models(x_t, k_cache, v_cache, w_qkv, w_o, H) -> dict[str, dict[str, torch.Tensor]]:
    """Mistake models of one decode step, for the output and the two caches, computed now."""
    q, k, v = qkv_projection(x_t, w_qkv, H)
    K, V = torch.cat([k_cache, k], dim=2), torch.cat([v_cache, v], dim=2)
    y: dict[str, torch.Tensor] = {}
    if k_cache.shape[2] > 0:
        y[_NOT_ATTENDED] = merge_heads(scaled_dot_product_attention(q, k_cache, v_cache)) @ w_o
    y[_TOP_LEFT] = merge_heads(F.scaled_dot_product_attention(q, K, V, is_causal=True)) @ w_o
    y["you did not divide the scores by sqrt(d_k)."] = merge_heads(
        scaled_dot_product_attention(q * math.sqrt(q.shape[-1]), K, V)) @ w_o
    y["you did not apply the output projection w_o to the merged heads."] = merge_heads(
        scaled_dot_product_attention(q, K, V))
    caches = {_PREPENDED: (torch.cat([k, k_cache], dim=2), torch.cat([v, v_cache], dim=2)),
              _OLD_CACHE: (k_cache, v_cache), _NEW_ONLY: (k, v),
              "you returned the caches swapped: the order is (y_t, k_cache, v_cache).": (V, K)}
    k_models = {h: pair[0] for h, pair in caches.items()}
    v_models = {h: pair[1] for h, pair in caches.items()}
    return {"y_t": y, "k_cache": k_models, "v_cache": v_models}


def _compare_step(t: Trial, got, expected: tuple, models: dict) -> tuple[torch.Tensor, torch.Tensor]:
    __tracebackhide__ = True
    y, k, v = t.tuple(got, 3, ["y_t", "k_cache", "v_cache"])
    for name, g, e in (("y_t", y, expected[0]), ("k_cache", k, expected[1]), ("v_cache", v, expected[2])):
        t.tensor(g, e, what=name, mistakes=models[name], hint=_RECIPE_72)
    return k, v


@exercise("7.2", "one decode step with a KV cache", points=3, stars=3, notebook=NB, section="2. One decode step")
def decode_step(t: Trial) -> None:
    t.error_hints = {
        r"takes \d+ positional argument": "the signature is decode_step(x_t, k_cache, v_cache, w_qkv, w_o, n_heads).",
        r"Sizes of tensors must match|size of tensor a .* must match": "append along the sequence axis: the caches "
        "and the new k, v are [B, H, T, d_k], so torch.cat([k_cache, k], dim=2).",
        r"cannot be multiplied|mat1 and mat2": "x_t is [B, 1, D]: x_t @ w_qkv is [B, 1, 3D]; split it into q, k, v "
        "([B, 1, D] each) and each into H heads [B, H, 1, d_k].",
    }
    # Single steps: (B, H, d_k, T_past, dtype, seed). T_past = 0 is the first token after an empty prompt.
    steps = [(2, 3, 5, 7, torch.float32, 720), (1, 4, 3, 10, torch.float64, 721), (3, 2, 4, 0, torch.float32, 722)]
    planned = []
    for B, H, d_k, T_past, dtype, seed in steps:
        x, w_qkv, w_o = _mha_weights(B, H, d_k, T_past + 1, seed, dtype)
        _, k_all, v_all = qkv_projection(x, w_qkv, H)
        args = (x[:, -1:].clone(), k_all[:, :, :T_past].clone(), v_all[:, :, :T_past].clone(), w_qkv, w_o, H)
        planned.append((args, ref.decode_step(*args), _step_models(*args)))
    # A whole sequence decoded token by token from an empty cache equals causal multi-head attention.
    B, H, d_k, T = 2, 3, 4, 6
    x, w_qkv, w_o = _mha_weights(B, H, d_k, T, 723, torch.float32)
    y_full = multi_head_attention(x, w_qkv, w_o, H, causal=True)
    _, k_all, v_all = qkv_projection(x, w_qkv, H)
    seq_expected = [(y_full[:, i:i + 1], k_all[:, :, :i + 1], v_all[:, :, :i + 1]) for i in range(T)]
    seq_models = [_step_models(x[:, i:i + 1], k_all[:, :, :i], v_all[:, :, :i], w_qkv, w_o, H) for i in range(T)]

    for args, expected, models in planned:
        x_t, k_c, v_c, _, _, H_ = args
        got = t.call(*args, case=describe_case(x_t=x_t, k_cache=k_c, v_cache=v_c, w_qkv=args[3], w_o=args[4], n_heads=H_))
        _compare_step(t, got, expected, models)
    k_c = torch.zeros(B, H, 0, d_k)
    v_c = torch.zeros(B, H, 0, d_k)
    for i in range(T):
        got = t.call(x[:, i:i + 1].clone(), k_c, v_c, w_qkv, w_o, H,
                     case=f"decoding x [{B}, {T}, {H * d_k}] token by token from an empty cache (n_heads={H}), "
                          f"token {i}, fed the caches your function returned at the step before")
        k_c, v_c = _compare_step(t, got, seq_expected[i], seq_models[i])


# --------------------------------------------------------------------------- 7.3 prefill_decode_flops


def _flops_model(P: int, N: int, d: int, L: int, use_cache: bool, *, shift: int = 0, steps: int | None = None,
                 prefill: bool = True, cached_proj_over_context: bool = False, quadratic_cached: bool = False,
                 proj_per_token: int = 8) -> int:
    """prefill_decode_flops with one mistake switched on (``proj_per_token``: 8 d^2 for Q, K, V, O)."""
    w = proj_per_token
    total = w * d * d * P + 4 * d * P * P if prefill else 0
    for t in range(1, (N if steps is None else steps) + 1):
        ctx = P + t + shift
        if use_cache:
            proj = w * d * d * (ctx if cached_proj_over_context else 1)
            total += proj + 4 * d * (ctx * ctx if quadratic_cached else ctx)
        else:
            total += w * d * d * ctx + 4 * d * ctx * ctx
    return L * total


_OFF_BY_ONE = ("off by one in the context length: you used L = prompt_len + t - 1. Step t = 1..new_tokens "
               "brings the sequence to L = prompt_len + t tokens: the new token attends to itself too.")
_OFF_BY_ONE_UP = ("off by one in the context length: you used L = prompt_len + t + 1. Step t = 1..new_tokens "
                  "brings the sequence to L = prompt_len + t tokens.")


def _prefill_mistakes(P: int, N: int, d: int, L: int, use_cache: bool) -> dict[str, float]:
    right = ref.prefill_decode_flops(P, N, d, L, use_cache)
    other = ref.prefill_decode_flops(P, N, d, L, not use_cache)
    m = {
        _OFF_BY_ONE: _flops_model(P, N, d, L, use_cache, shift=-1),
        _OFF_BY_ONE_UP: _flops_model(P, N, d, L, use_cache, shift=+1),
        "you did new_tokens - 1 decode steps: count one step per new token, t = 1..new_tokens.":
            _flops_model(P, N, d, L, use_cache, steps=max(N - 1, 0)),
        "you forgot the prefill: processing the P prompt tokens first costs 8*d^2*P + 4*d*P^2 per layer.":
            _flops_model(P, N, d, L, use_cache, prefill=False),
        "you counted one layer only: multiply everything by n_layers.": right / L,
        "you left out W_O: the projections cost 8*d^2 per token (Q, K, V and the output projection O), "
        "not 6*d^2.": _flops_model(P, N, d, L, use_cache, proj_per_token=6),
        "you counted multiplies only: a multiply-add counts 2 FLOPs (8*d^2 and 4*d*L, not 4*d^2 and 2*d*L).": right / 2,
        ("you ignored use_cache: with a cache a step costs 8*d^2 + 4*d*L, without one 8*d^2*L + 4*d*L^2."
         if use_cache else
         "you ignored use_cache: without a cache every step recomputes all L tokens, 8*d^2*L + 4*d*L^2."): other,
    }
    if use_cache:
        m["with a cache only the new token is projected (8*d^2 per step, per layer): the past tokens' "
          "keys and values come from the cache, not from recomputing the projections over the context."] = (
            _flops_model(P, N, d, L, use_cache, cached_proj_over_context=True))
        m["with a cache the new token is one query against L keys: 4*d*L per step, not 4*d*L^2."] = (
            _flops_model(P, N, d, L, use_cache, quadratic_cached=True))
    return _known(m, right)


@exercise("7.3", "prefill and decode FLOPs", points=2, stars=2, notebook=NB,
          section="6. Prefill and decode, measured")
def prefill_decode_flops(t: Trial) -> None:
    t.error_hints = {
        r"takes \d+ positional argument": "the signature is prefill_decode_flops(prompt_len, new_tokens, d_model, "
        "n_layers, use_cache).",
    }
    llama = MODELS["Llama-3-8B"]
    # (P, N, d, L): small cases with every size different, a prompt with no new tokens, and a
    # Llama-3-8B-sized model (its d and layers counted as MHA, the contract's formula).
    cases = [(5, 3, 16, 7), (128, 64, 24, 3), (7, 0, 8, 4), (1000, 200, llama.d_model, llama.n_layers)]
    g = seeded(751)  # then one drawn from a seed: P 1-256, N 0-64, d 4-64, 1-8 layers
    cases.append((draw(g, 1, 257), draw(g, 0, 65), draw(g, 4, 65), draw(g, 1, 9)))
    planned = [((P, N, d, L, c), ref.prefill_decode_flops(P, N, d, L, c), _prefill_mistakes(P, N, d, L, c))
               for P, N, d, L in cases for c in (True, False)]
    for (P, N, d, L, use_cache), expected, mistakes in planned:
        got = t.call(P, N, d, L, use_cache, case=describe_case(prompt_len=P, new_tokens=N, d_model=d, n_layers=L,
                                                               use_cache=use_cache))
        check_count(t, got, expected, "FLOPs", mistakes,
                    "per layer: 8*d^2*P + 4*d*P^2, then for t = 1..new_tokens with L = P + t: "
                    "8*d^2 + 4*d*L with a cache, 8*d^2*L + 4*d*L^2 without; times n_layers.")
