"""Checks for notebook 07_kv_cache (its exercises: helpers/registry.py).

Every case, expected value and mistake model is computed before the learner's function runs.
7.2 compares the returned caches as well as the output, on single steps (a cache of 7 tokens, an
empty cache, float64) and on a whole sequence decoded token by token from an empty cache, each
step fed the caches the learner returned at the step before. Shapes: no two of B, H, T_past and
d_k are equal. 7.4 compares the output and both ring buffers, on single steps (before the buffer
fills with leftovers in its unwritten slots, after it wrapped, exactly full, MQA, one drawn) and
on a whole generation past two wraps against notebook 03's sliding-window mask.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import nb07_kv_cache as ref
from ..configs import MODELS
from ..nb01_qkv_shapes import merge_heads, qkv_projection, scaled_dot_product_attention
from ..nb03_masks import sliding_window_mask
from ..nb05_multihead import multi_head_attention
from ..nb06_kv_sharing import repeat_kv
from ..registry import in_module
from .core import Trial, describe_case, draw, exercise, seeded
from .feedback import Mistake, wrong_signature
from .guard import _allclose, _equal, _isfinite
from .nb08_flops_memory import check_count

__all__ = in_module(__name__)  # its exercises' checks, as helpers/registry.py lists them



# --------------------------------------------------------------------------- 7.1 kv_cache_bytes


def _cache_mistakes(B: int, T: int, L: int, H_kv: int, d: int, b: int) -> dict[str, float]:
    right = ref.kv_cache_bytes(B, T, L, H_kv, d, b)
    return {
        Mistake("keys-only",
                "you counted the keys only: the cache holds a key AND a value per token, layer and "
                "kv head (the 2)."): right / 2,
        Mistake("counted-bits", "you counted bits: dtype_bytes is already in bytes (bf16 = 2)."):
            right * 8,
        Mistake("missing-layers",
                "you left out the layers: every layer has its own K and V caches, times n_layers."):
            right / L,
        Mistake("returned-GB-float",
                "you returned GB as a float: return the number of bytes, an int (divide by 1e9 "
                "only to print)."): right / 1e9,
        Mistake("returned-GiB-float",
                "you returned GiB as a float: return the number of bytes, an int (divide by 2**30 "
                "only to print)."): right / 2**30,
        Mistake("missing-batch",
                "you left out the batch: each of the B sequences has its own cache."): right / B,
        Mistake("head_dim-for-n_kv_heads",
                "you used head_dim where n_kv_heads belongs: the cache holds n_kv_heads heads of "
                "head_dim numbers each, 2 * ... * n_kv_heads * head_dim * dtype_bytes."):
            right // H_kv * d,
        Mistake("dtype_bytes-hard-coded-2",
                "you ignored dtype_bytes (2 bytes, as for bf16, whatever the dtype): multiply by "
                "dtype_bytes."): right // b * 2,
        Mistake("ignored-dtype_bytes",
                "you ignored dtype_bytes: multiply by dtype_bytes, the size of one number."):
            right // b,
    }


@exercise()
def kv_cache_bytes(t: Trial) -> None:
    t.error_hints = {
        r"takes \d+ positional argument": wrong_signature(
            "kv_cache_bytes(batch, seq_len, n_layers, n_kv_heads, head_dim, dtype_bytes)."),
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
_NOT_ATTENDED = Mistake("new-token-not-attended",
                        "the new token's own key and value were not attended: append k and v to "
                        "the caches first, then attend over the whole updated cache (a token "
                        "attends to itself).")
_TOP_LEFT = Mistake("is_causal-top-left",
                    "is_causal=True with one query aligns the causal mask top-left: the query is "
                    "treated as position 0 and sees only the first key. A single new token may see "
                    "every cached key: use no mask (or a bottom-right mask, causal_mask(T)[-1:]).",
                    "used is_causal=True with one query (a top-left mask: only the first key seen)")
_PREPENDED = Mistake("prepended-to-cache",
                     "you put the new token at the start of the cache: append it at the end, "
                     "torch.cat([cache, new], dim=2), so that position t stays at index t.")
_OLD_CACHE = Mistake("returned-old-cache",
                     "you returned the cache you were given: return the updated caches (past + new "
                     "token), [B, H, T_past + 1, d_k].")
_NEW_ONLY = Mistake("returned-new-kv-only",
                    "you returned only the new token's key/value: return the whole updated cache, "
                    "past + new.")


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
    y[Mistake("unscaled-scores", "you did not divide the scores by sqrt(d_k).")] = merge_heads(
        scaled_dot_product_attention(q * math.sqrt(q.shape[-1]), K, V)) @ w_o
    D = q.shape[1] * q.shape[-1]
    y[Mistake("scaled-by-sqrt-d_model",
              "your scores are divided by sqrt(D), D = d_model (all heads together): each head's scores "
              "are divided by sqrt(d_k), d_k = D / n_heads, the width of one head's queries and keys.",
              "scaled the scores by 1/sqrt(d_model) instead of 1/sqrt(d_k)")] = merge_heads(
        scaled_dot_product_attention(q * math.sqrt(q.shape[-1] / D), K, V)) @ w_o
    y[Mistake("w_o-transposed",
              "your output is the merged heads times w_o transposed: the output projection is "
              "merged @ w_o, with w_o as given.",
              "multiplied the merged heads by w_o.T instead of w_o")] = merge_heads(
        scaled_dot_product_attention(q, K, V)) @ w_o.T
    y[Mistake("missing-output-projection",
              "you did not apply the output projection w_o to the merged heads.")] = merge_heads(
        scaled_dot_product_attention(q, K, V))
    caches = {_PREPENDED: (torch.cat([k, k_cache], dim=2), torch.cat([v, v_cache], dim=2)),
              _OLD_CACHE: (k_cache, v_cache), _NEW_ONLY: (k, v),
              Mistake("swapped-caches",
                      "you returned the caches swapped: the order is (y_t, k_cache, v_cache)."):
                  (V, K)}
    k_models = {h: pair[0] for h, pair in caches.items()}
    v_models = {h: pair[1] for h, pair in caches.items()}
    return {"y_t": y, "k_cache": k_models, "v_cache": v_models}


def _compare_step(t: Trial, got, expected: tuple, models: dict) -> tuple[torch.Tensor, torch.Tensor]:
    __tracebackhide__ = True
    y, k, v = t.tuple(got, 3, ["y_t", "k_cache", "v_cache"])
    for name, g, e in (("y_t", y, expected[0]), ("k_cache", k, expected[1]), ("v_cache", v, expected[2])):
        t.tensor(g, e, what=name, mistakes=models[name], hint=_RECIPE_72)
    return k, v


@exercise()
def decode_step(t: Trial) -> None:
    t.error_hints = {
        r"takes \d+ positional argument": wrong_signature(
            "decode_step(x_t, k_cache, v_cache, w_qkv, w_o, n_heads)."),
        r"Sizes of tensors must match|size of tensor a .* must match": Mistake(
            "cat-on-wrong-axis", "append along the sequence axis: the caches "
            "and the new k, v are [B, H, T, d_k], so torch.cat([k_cache, k], dim=2).",
            "appended to the caches along another axis than the sequence axis (dim 2)"),
        r"cannot be multiplied|mat1 and mat2": Mistake(
            "projection-shape-mismatch", "x_t is [B, 1, D]: x_t @ w_qkv is [B, 1, 3D]; split it "
            "into q, k, v ([B, 1, D] each) and each into H heads [B, H, 1, d_k].",
            "multiplied x_t, w_qkv or the heads with mismatched shapes"),
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
                 proj_per_token: int = 8, cached_proj: bool = True, layers_on_prefill_only: bool = False,
                 half_n_squared: bool = False) -> int:
    """prefill_decode_flops with one mistake switched on (``proj_per_token``: 8 d^2 for Q, K, V, O;
    ``cached_proj``: the cached steps' projections counted; ``half_n_squared``: the cached steps'
    attention in closed form with sum_t t taken as N^2 // 2)."""
    w = proj_per_token
    pre = w * d * d * P + 4 * d * P * P if prefill else 0
    total = 0
    for t in range(1, (N if steps is None else steps) + 1):
        ctx = P + t + shift
        if use_cache:
            proj = w * d * d * (ctx if cached_proj_over_context else 1) if cached_proj else 0
            total += proj + (0 if half_n_squared else 4 * d * (ctx * ctx if quadratic_cached else ctx))
        else:
            total += w * d * d * ctx + 4 * d * ctx * ctx
    if use_cache and half_n_squared:
        total += 4 * d * (N * P + N * N // 2)
    return L * pre + total if layers_on_prefill_only else L * (pre + total)


_OFF_BY_ONE = Mistake("context-one-short",
                      "off by one in the context length: you used L = prompt_len + t - 1. Step "
                      "t = 1..new_tokens brings the sequence to L = prompt_len + t tokens: the new "
                      "token attends to itself too.",
                      "used a context of prompt_len + t - 1 tokens at step t (one short)")
_OFF_BY_ONE_UP = Mistake("context-one-long",
                         "off by one in the context length: you used L = prompt_len + t + 1. Step "
                         "t = 1..new_tokens brings the sequence to L = prompt_len + t tokens.",
                         "used a context of prompt_len + t + 1 tokens at step t (one long)")


def _prefill_mistakes(P: int, N: int, d: int, L: int, use_cache: bool) -> dict[str, float]:
    right = ref.prefill_decode_flops(P, N, d, L, use_cache)
    other = ref.prefill_decode_flops(P, N, d, L, not use_cache)
    m = {
        _OFF_BY_ONE: _flops_model(P, N, d, L, use_cache, shift=-1),
        _OFF_BY_ONE_UP: _flops_model(P, N, d, L, use_cache, shift=+1),
        Mistake("one-step-short",
                "you did new_tokens - 1 decode steps: count one step per new token, "
                "t = 1..new_tokens."):
            _flops_model(P, N, d, L, use_cache, steps=max(N - 1, 0)),
        Mistake("missing-prefill",
                "you forgot the prefill: processing the P prompt tokens first costs 8*d^2*P + "
                "4*d*P^2 per layer."): _flops_model(P, N, d, L, use_cache, prefill=False),
        Mistake("one-layer-only", "you counted one layer only: multiply everything by n_layers."):
            right / L,
        Mistake("missing-W_O",
                "you left out W_O: the projections cost 8*d^2 per token (Q, K, V and the output "
                "projection O), not 6*d^2."): _flops_model(P, N, d, L, use_cache, proj_per_token=6),
        Mistake("multiplies-only",
                "you counted multiplies only: a multiply-add counts 2 FLOPs (8*d^2 and 4*d*L, not "
                "4*d^2 and 2*d*L)."): right / 2,
        Mistake("ignored-use_cache",
                "you ignored use_cache: with a cache a step costs 8*d^2 + 4*d*L, without one "
                "8*d^2*L + 4*d*L^2." if use_cache else
                "you ignored use_cache: without a cache every step recomputes all L tokens, "
                "8*d^2*L + 4*d*L^2."): other,
    }
    m[Mistake("layers-on-prefill-only",
              "your count multiplies the prefill by n_layers but counts the decode steps once: every "
              "layer does every step's work too, so the whole count (prefill and steps) is times "
              "n_layers.",
              "multiplied only the prefill by n_layers")] = _flops_model(P, N, d, L, use_cache,
                                                                          layers_on_prefill_only=True)
    if not use_cache:
        m[Mistake("no-prefill-without-cache",
                  "without a cache your count leaves out the prefill: the prompt's P tokens are "
                  "processed once first, 8*d^2*P + 4*d*P^2 per layer, with or without a cache; then "
                  "each step recomputes its L = P + t tokens.",
                  "left out the prefill when use_cache is False")] = (
            _flops_model(P, N, d, L, use_cache, prefill=False))
    if use_cache:
        m[Mistake("cached-steps-without-projections",
                  "your cached decode steps count the attention (4*d*L) but not the projections: the "
                  "new token is still projected to q, k, v and through W_O, 8*d^2 per step and layer.",
                  "left out the 8*d^2 projections of each cached decode step")] = (
            _flops_model(P, N, d, L, use_cache, cached_proj=False))
        m[Mistake("sum-of-t-as-half-n-squared",
                  "your cached steps' attention FLOPs are short by 4*d*(N/2 rounded up) per layer: the "
                  "steps t = 1..N attend over L = P + t keys, and the sum of t over 1..N is "
                  "N*(N+1)/2, not N^2/2 (or add 4*d*L step by step).",
                  "summed t = 1..N as N^2/2 instead of N(N+1)/2")] = (
            _flops_model(P, N, d, L, use_cache, half_n_squared=True))
        m[Mistake("cache-recomputes-projections",
                  "with a cache only the new token is projected (8*d^2 per step, per layer): the "
                  "past tokens' keys and values come from the cache, not from recomputing the "
                  "projections over the context.",
                  "projected the whole context at every cached step, not only the new token")] = (
            _flops_model(P, N, d, L, use_cache, cached_proj_over_context=True))
        m[Mistake("cache-quadratic-attention",
                  "with a cache the new token is one query against L keys: 4*d*L per step, not "
                  "4*d*L^2.",
                  "counted 4*d*L^2 attention FLOPs per cached step instead of 4*d*L")] = (
            _flops_model(P, N, d, L, use_cache, quadratic_cached=True))
    return m


@exercise()
def prefill_decode_flops(t: Trial) -> None:
    t.error_hints = {
        r"takes \d+ positional argument": wrong_signature(
            "prefill_decode_flops(prompt_len, new_tokens, d_model, n_layers, use_cache)."),
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


# --------------------------------------------------------------------------- 7.4 ring_buffer_decode_step

_RECIPE_74 = ("W = k_buf.shape[2]; copy the buffers (k_buf.clone(), v_buf.clone()) and write k_new[:, :, 0], "
              "v_new[:, :, 0] into slot t % W; n = min(t + 1, W) slots are written; repeat those n keys and "
              "values for the H / H_kv query heads of each group (repeat_interleave(H // H_kv, dim=1)); "
              "o = softmax(q K^T / sqrt(d)) V over the n slots; return o, k_buf, v_buf.")
_EMPTY_SLOTS = Mistake("attended-unwritten-slots",
                       "you attended over all W slots before the buffer was full: while t + 1 < W, "
                       "slots t + 1 .. W - 1 were never written in this sequence (they hold zeros "
                       "or an earlier sequence's leftovers). Attend over the min(t + 1, W) written "
                       "slots only.")
_W_PLUS_1 = Mistake("attended-W-plus-1-keys",
                    "off by one: you attended to W + 1 keys, the old buffer and the new key "
                    "together, so the token that falls out of the window (position t - W, in slot "
                    "t % W) was still seen. Write the new key into slot t % W first, then attend "
                    "over the buffer: W keys.",
                    "attended to W + 1 keys: the old buffer and the new key together")
_W_MINUS_1 = Mistake("attended-W-minus-1-keys",
                     "off by one: you attended to W - 1 keys. The window is the W tokens "
                     "t - W + 1 .. t, the new token and the oldest one (position t - W + 1, in "
                     "slot (t + 1) % W) included.",
                     "attended to W - 1 keys, leaving out the oldest token of the window")
_NEW_NOT_SEEN = Mistake("new-token-not-attended",
                        "the new token's own key and value were not attended: write them into slot "
                        "t % W first, then attend over the written slots (a token attends to "
                        "itself).")
_READ_BEFORE_WRITE = Mistake("attended-before-writing",
                             "you attended before writing: slot t % W still held what was there "
                             "before (zeros, or an earlier sequence's leftovers), not token t. Write "
                             "k_new and v_new into slot t % W first, then attend over the min(t + 1, W) "
                             "written slots.",
                             "attended over the slots before writing the new token into slot t % W")
_MIN_T_SLOTS = Mistake("attended-min-t-slots",
                       "the new token's own key and value were not attended before the buffer was "
                       "full: you attended to min(t, W) slots, 0 .. t - 1, which leaves out slot t "
                       "where token t was just written. Attend over min(t + 1, W) slots (a token "
                       "attends to itself).",
                       "attended to min(t, W) slots, leaving out the new token before the buffer is full")
_NO_SCALE_74 = Mistake("unscaled-scores",
                       "you did not divide the scores by sqrt(d), d = q.shape[-1].")
_IS_CAUSAL_74 = Mistake("is_causal-top-left",
                        "the query attended to slot 0 only: with one query and several keys, "
                        "SDPA's is_causal=True aligns the mask top-left (query 0 sees key 0 alone; "
                        "section 3's trap). The buffer holds only keys the new token may see: "
                        "attend to all written slots with no mask.",
                        "used is_causal=True with one query (a top-left mask: only slot 0 seen)")
_LAST_N = Mistake("attended-last-n-slots",
                  "before the buffer is full the written slots are the first min(t + 1, W), 0 .. t "
                  "(token p sits in slot p % W), not the last ones.",
                  "attended to the last slots before the buffer was full, not the first t + 1")
_TILED = Mistake("tiled-kv-heads",
                 "GQA heads in the wrong order: query head h reads key/value head h // (H / H_kv) "
                 "(consecutive groups: repeat_interleave(H // H_kv, dim=1), or notebook 06's "
                 "repeat_kv), not h % H_kv (what .repeat(1, H // H_kv, 1, 1) gives).",
                 "tiled the key/value heads (query head h read h % H_kv, not h // (H / H_kv))")
_SLOT_T_MINUS_1 = Mistake("slot-t-minus-1",
                          "you wrote the new token into slot (t - 1) % W: token t goes to "
                          "slot t % W (t counts from 0).")
_SLOT_T_PLUS_1 = Mistake("slot-t-plus-1",
                         "you wrote the new token into slot (t + 1) % W: token t goes to "
                         "slot t % W.")
_SLOT_LAST = Mistake("overwrote-last-slot",
                     "once the buffer was full you kept overwriting its last slot: token t goes to "
                     "slot t % W, which wraps around to slot 0 and overwrites the oldest token.")
_ROLLED = Mistake("shifted-buffers",
                  "your buffers are shifted (torch.roll, or dropping slot 0 and appending): token "
                  "t must go to slot t % W and every other slot stay where it is. A ring buffer "
                  "writes one slot per step; shifting copies the whole window every step.")
_UNCHANGED = Mistake("returned-given-buffers",
                     "you returned the buffers you were given: return the updated copies, with the "
                     "new key and value in slot t % W.")
_SWAPPED_74 = Mistake("swapped-buffers",
                      "you returned the buffers swapped: the order is (o, k_buf, v_buf).")
_APPENDED = Mistake("appended-to-buffer",
                    "your buffer grew by one slot: a ring buffer keeps its W slots and overwrites "
                    "slot t % W (torch.cat appends, as the unbounded cache of exercise 7.2 does).")


_SOFTMAX_AXES = {
    -2: Mistake("softmax-over-query-axis",
                "your softmax ran over the query axis (dim=-2), which has one query: every weight "
                "became 1 and o is the sum of the values. Normalise over the keys: softmax(..., dim=-1).",
                "took the softmax over the query axis (dim=-2) instead of the keys"),
    1: Mistake("softmax-over-heads",
               "your softmax ran over the heads (dim=1): each key's weights sum to 1 across the H "
               "heads. Normalise each head's scores over the keys: softmax(..., dim=-1).",
               "took the softmax over the heads instead of the keys"),
    0: Mistake("softmax-over-batch",
               "your softmax ran over the batch (dim=0): each key's weights sum to 1 across the "
               "sequences. Normalise each head's scores over the keys: softmax(..., dim=-1).",
               "took the softmax over the batch instead of the keys"),
}
_NO_SOFTMAX_74 = Mistake("no-softmax",
                         "you used the scaled scores as the weights: apply softmax over the keys "
                         "(dim=-1) first, o = softmax(q K^T / sqrt(d)) V.",
                         "used the scores as weights without a softmax")
_SCALES_74 = {  # the mistake of multiplying the scores by another factor than 1/sqrt(d): that factor from d, W, n, H
    Mistake("scale-sqrt-W", "your scores were divided by sqrt(W), the window (k_buf.shape[2]); divide by "
            "sqrt(d), d = q.shape[-1], the size of one head's query and key."):
        lambda d, W, n, H: 1 / math.sqrt(W),
    Mistake("scale-sqrt-n", "your scores were divided by the square root of the number of slots attended, "
            "min(t + 1, W); divide by sqrt(d), d = q.shape[-1], the size of one head's query and key."):
        lambda d, W, n, H: 1 / math.sqrt(n),
    Mistake("scale-d-not-sqrt", "your scores were divided by d, not by sqrt(d): the scale is 1 / sqrt(d), "
            "d = q.shape[-1]."):
        lambda d, W, n, H: 1 / d,
    Mistake("scale-sqrt-H-times-d", "your scores were divided by sqrt(H * d), the model width; divide by "
            "sqrt(d), d = q.shape[-1], one head's size."):
        lambda d, W, n, H: 1 / math.sqrt(H * d),
    Mistake("scale-multiplied", "your scores were multiplied by sqrt(d): divide by it, q @ K^T / sqrt(d)."):
        lambda d, W, n, H: math.sqrt(d),
}
_FIRST_W_MINUS_1 = Mistake("attended-at-most-W-minus-1-slots",
                           "once the buffer was full you attended to slots 0 .. W - 2 only (at most "
                           "W - 1 slots): the window is all W slots, the token in slot W - 1 "
                           "included. Attend over min(t + 1, W) slots.",
                           "attended to at most W - 1 slots (slot W - 1 left out once full)")
_V_NOT_WRITTEN = Mistake("value-not-written",
                         "you wrote k_new into slot t % W but not v_new: v_buf still holds the old "
                         "value there. Write both, k_buf[:, :, t % W] = k_new[:, :, 0] and "
                         "v_buf[:, :, t % W] = v_new[:, :, 0].",
                         "wrote the new key but not the new value")
_K_NOT_WRITTEN = Mistake("key-not-written",
                         "you wrote v_new into slot t % W but not k_new: k_buf still holds the old "
                         "key there. Write both, k_buf[:, :, t % W] = k_new[:, :, 0] and "
                         "v_buf[:, :, t % W] = v_new[:, :, 0].",
                         "wrote the new value but not the new key")
_TIME_ORDER = Mistake("buffers-in-time-order",
                      "your k_buf and v_buf come back rolled into time order (the oldest token first, "
                      "the new one last): a ring buffer stays in slot order, token t in slot t % W "
                      "for good. Write the new key and value into slot t % W of copies and return "
                      "those copies as they are (attention does not need the time order).",
                      "returned the buffers rolled into time order, not in slot order")
_TIME_ORDER_FULL = Mistake("time-ordered-buffers-once-full",
                           "once the buffer is full, your k_buf and v_buf come back rolled into time "
                           "order (the oldest token first, the new one last): a ring buffer stays in "
                           "slot order, token t in slot t % W for good. Write the new key and value "
                           "into slot t % W of copies and return those copies as they are (attention "
                           "does not need the time order).",
                           "returned the buffers rolled into time order once full, not in slot order")
_K_INTO_V = Mistake("k_new-in-value-buffer",
                    "your v_buf holds k_new in slot t % W: the value buffer gets v_new, "
                    "v_buf[:, :, t % W] = v_new[:, :, 0] (and the key buffer k_new).",
                    "wrote k_new into the value buffer")
_V_INTO_K = Mistake("v_new-in-key-buffer",
                    "your k_buf holds v_new in slot t % W: the key buffer gets k_new, "
                    "k_buf[:, :, t % W] = k_new[:, :, 0] (and the value buffer v_new).",
                    "wrote v_new into the key buffer")
_NO_SLOT_AFTER_WRAP = Mistake("attended-no-slot-after-wrap",
                              "once the buffer has wrapped, your o is all zeros: it attended to no "
                              "slot at all (an empty slice of the buffers gives that, such as a "
                              "start index below 0, which Python counts from the end). A full "
                              "buffer's window is all W slots, in any order: attention does not "
                              "need them in time order.",
                              "attended to an empty set of slots once the buffer wrapped")


def _buffer_diagnosis(name: str, got, given: torch.Tensor, new: torch.Tensor, pos: int) -> str:
    """How a returned buffer differs from the given one with the new token in slot t % W: the slots
    it changed and where the new token went, as a fact (a named mistake has been tried first)."""
    if not (type(got) is torch.Tensor and got.shape == given.shape and got.dtype == given.dtype):
        return ""
    W = given.shape[2]
    if _allclose(got.double(), _written(given, new, pos % W).double(), atol=1e-5, rtol=1e-4):
        return ""  # the right buffer
    same = [bool(_equal(got[:, :, s], given[:, :, s])) for s in range(W)]
    holds_new = [bool(_allclose(got[:, :, s], new[:, :, 0])) for s in range(W)]
    changed = [s for s in range(W) if not same[s]]
    right = pos % W
    where = f"at t = {pos} with W = {W}, token t goes to slot t % W = {right}"
    if not changed:
        return Mistake("buffer-not-written", f"your {name} is the one you were given, unchanged: {where}; "
                       "write the new token into that slot of a copy and return the copy.",
                       "returned a buffer without the new token written")
    if holds_new.count(True) == 1 and changed == [holds_new.index(True)] and changed != [right]:
        return Mistake("wrote-another-slot", f"you wrote the new token into slot {changed[0]} of {name}: "
                       f"{where}, and every other slot stays as it is.",
                       "wrote the new token into another slot than t % W")
    if holds_new[right] and right in changed and len(changed) > 1:
        others = [c for c in changed if c != right]
        return Mistake("changed-other-slots", f"your {name} has the new token in slot {right} (right), "
                       f"but slot{'s' if len(others) > 1 else ''} {_slots(others)} changed too: a ring "
                       "buffer writes one slot per step and leaves the others as they are.",
                       "changed other slots of the buffer than t % W")
    return ""


def _ring_output_diagnosis(o, args: tuple, expected: torch.Tensor) -> str:
    """When no mistake explains o: is it attention over other slots than the window (of the buffers
    with the new token written, or before), or attention with another scale of the scores? A fact
    about the output, found by trying every set of slots and fitting the scale."""
    q, k_new, v_new, k_buf, v_buf, pos = args
    if not (type(o) is torch.Tensor and o.shape == expected.shape and o.dtype == expected.dtype
            and bool(_isfinite(o).all())) or _allclose(o.double(), expected.double(), atol=1e-5, rtol=1e-4):
        return ""
    W, d = k_buf.shape[2], q.shape[-1]
    g = o.double()
    q64 = q.double()
    kw, vw = _written(k_buf, k_new, pos % W).double(), _written(v_buf, v_new, pos % W).double()
    close = lambda x: bool(_allclose(x, g, atol=1e-5, rtol=1e-4))  # noqa: E731 - as a mistake is matched
    n = min(pos + 1, W)
    window = f"at t = {pos} with W = {W}, the window is slot{'s' if n > 1 else ''} {_slots(list(range(n)) if pos < W else list(range(W)))}"
    group = q.shape[1] // k_buf.shape[1]
    if W <= 8:
        masks = torch.tensor([[m >> s_ & 1 for s_ in range(W)] for m in range(1, 2 ** W)], dtype=torch.bool)
        for written, (K, V) in (("with the new token written", (kw, vw)),
                                ("before the new token was written", (k_buf.double(), v_buf.double()))):
            Kr, Vr = K.repeat_interleave(group, dim=1), V.repeat_interleave(group, dim=1)
            sc = (q64 @ Kr.transpose(-2, -1)) / math.sqrt(d)  # [B, H, 1, W]
            every = torch.softmax(sc.unsqueeze(0).masked_fill(~masks[:, None, None, None, :], -math.inf), dim=-1) @ Vr
            fits = ((every - g).abs() <= 1e-5 + 1e-4 * g.abs()).flatten(1).all(1).nonzero().flatten().tolist()
            for m in fits:
                slots = [s_ for s_ in range(W) if masks[m, s_]]
                if written.startswith("with") and len(slots) == n and (pos >= W or slots == list(range(n))):
                    continue  # the right window
                return Mistake("attended-other-slots", f"your o attends to slot{'s' if len(slots) > 1 else ''} "
                               f"{_slots(slots)} of the buffers {written}: {window} (the min(t + 1, W) "
                               "written slots, tokens t - W + 1 .. t), after writing k_new, v_new into "
                               "slot t % W.", "attended to other slots than the window")
    K, V = kw[:, :, :n], vw[:, :, :n]
    s = (q64 @ K.repeat_interleave(group, dim=1).transpose(-2, -1))
    Vr = V.repeat_interleave(group, dim=1)
    err = lambda c: float((torch.softmax(s * c, dim=-1) @ Vr - g).abs().max())  # noqa: E731
    grid = torch.tensor([10 ** (k / 40) for k in range(-160, 121)], dtype=torch.float64)
    errs = (torch.softmax(s.unsqueeze(0) * grid[:, None, None, None, None], dim=-1) @ Vr - g).abs().flatten(1).amax(1)
    best = float(grid[int(errs.argmin())])
    lo, hi = best / 10 ** (1 / 40), best * 10 ** (1 / 40)
    for _ in range(40):  # golden-section search around the best point of the grid
        a, b = hi - (hi - lo) / 1.618, lo + (hi - lo) / 1.618
        lo, hi = (lo, b) if err(a) < err(b) else (a, hi)
    c = (lo + hi) / 2
    if close(torch.softmax(s * c, dim=-1) @ Vr) and abs(c * math.sqrt(d) - 1) > 1e-3:
        return Mistake("other-score-scale", f"your scores were multiplied by {c:.4g} (that is, divided by "
                       f"{1 / c:.4g}); the scale is 1 / sqrt(d) = {1 / math.sqrt(d):.4g}, with d = q.shape[-1] "
                       f"= {d}, the size of one head's query and key.", "scaled the scores by another factor")
    return ""


def _slots(slots: list[int]) -> str:
    return ", ".join(str(x) for x in slots)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: bool = True, tiled: bool = False,
            factor: float | None = None, dim: int = -1, weights: str = "softmax") -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v with the H_kv heads of k, v repeated for the H of q (``tiled``: the
    wrong order); ``factor`` multiplies the scores instead of 1/sqrt(d), ``dim`` is the softmax's axis
    and ``weights`` "scores" uses the scaled scores themselves as the weights (no softmax)."""
    g = q.shape[1] // k.shape[1]
    k, v = ((x.repeat(1, g, 1, 1) if tiled else x.repeat_interleave(g, dim=1)) for x in (k, v))
    s = q @ k.transpose(-2, -1)
    s = s * factor if factor is not None else s / math.sqrt(q.shape[-1]) if scale else s
    return (s if weights == "scores" else torch.softmax(s, dim=dim)) @ v


def _written(buf: torch.Tensor, new: torch.Tensor, slot: int) -> torch.Tensor:
    out = buf.clone()
    out[:, :, slot] = new[:, :, 0]
    return out


def _ring_models(q, k_new, v_new, k_buf, v_buf, pos: int) -> dict[str, dict[str, torch.Tensor]]:
    """Mistake models of one ring-buffer step, for the output and the two buffers, computed now."""
    W, g = k_buf.shape[2], q.shape[1] // k_buf.shape[1]
    n = min(pos + 1, W)
    kw, vw = _written(k_buf, k_new, pos % W), _written(v_buf, v_new, pos % W)
    o: dict[str, torch.Tensor] = {}
    if n < W:
        o[_EMPTY_SLOTS] = _attend(q, kw, vw)
    if pos >= W:
        o[_W_PLUS_1] = _attend(q, torch.cat([k_buf, k_new], dim=2), torch.cat([v_buf, v_new], dim=2))
    if pos >= W - 1 and W > 1:
        keep = [s for s in range(W) if s != (pos + 1) % W]
        o[_W_MINUS_1] = _attend(q, kw[:, :, keep], vw[:, :, keep])
    if pos >= 1:  # the old buffer's min(t, W) slots: before it is full, the slots before t
        o[_NEW_NOT_SEEN] = _attend(q, k_buf[:, :, :min(pos, W)], v_buf[:, :, :min(pos, W)])
        # min(t, W) slots of the written buffer: the same before it is full, the right output after
        o[_MIN_T_SLOTS] = _attend(q, kw[:, :, :min(pos, W)], vw[:, :, :min(pos, W)])
    o[_READ_BEFORE_WRITE] = _attend(q, k_buf[:, :, :n], v_buf[:, :, :n])
    o[_NO_SCALE_74] = _attend(q, kw[:, :, :n], vw[:, :, :n], scale=False)
    if n > 1:
        o[_IS_CAUSAL_74] = _attend(q, kw[:, :, :1], vw[:, :, :1])
    if n < W:
        o[_LAST_N] = _attend(q, kw[:, :, W - n:], vw[:, :, W - n:])
    if g > 1 and k_buf.shape[1] > 1:
        o[_TILED] = _attend(q, kw[:, :, :n], vw[:, :, :n], tiled=True)
    K, V = kw[:, :, :n], vw[:, :, :n]
    for dim, hint in _SOFTMAX_AXES.items():
        o[hint] = _attend(q, K, V, dim=dim)
    o[_NO_SOFTMAX_74] = _attend(q, K, V, weights="scores")
    d, H = q.shape[-1], q.shape[1]
    for hint, fn in _SCALES_74.items():
        o[hint] = _attend(q, K, V, factor=fn(d, W, n, H))
    m = min(pos + 1, W - 1) if W > 1 else n
    o[_FIRST_W_MINUS_1] = _attend(q, kw[:, :, :m], vw[:, :, :m])
    o[_V_NOT_WRITTEN] = _attend(q, K, v_buf[:, :, :n])
    o[_K_NOT_WRITTEN] = _attend(q, k_buf[:, :, :n], V)
    slot = pos % W
    if slot - n + 1 < 0:  # a window slice [slot - n + 1, slot] taken without wrapping: empty
        o[_NO_SLOT_AFTER_WRAP] = torch.zeros_like(q)
    o[_K_INTO_V] = _attend(q, K, _written(v_buf, k_new, slot)[:, :, :n])
    o[_V_INTO_K] = _attend(q, _written(k_buf, v_new, slot)[:, :, :n], V)
    right = _attend(q, K, V)
    for hint in (_EMPTY_SLOTS, _LAST_N, _IS_CAUSAL_74, _TILED):  # where they change nothing: the right output
        o.setdefault(hint, right)
    k_models = {_UNCHANGED: k_buf, _SWAPPED_74: vw, _K_NOT_WRITTEN: k_buf, _V_INTO_K: _written(k_buf, v_new, slot),
                _TIME_ORDER: torch.roll(kw, -(slot + 1), dims=2)}
    v_models = {_UNCHANGED: v_buf, _SWAPPED_74: kw, _V_NOT_WRITTEN: v_buf, _K_INTO_V: _written(v_buf, k_new, slot),
                _TIME_ORDER: torch.roll(vw, -(slot + 1), dims=2)}
    if pos >= W:  # rolled only once the buffer is full (before that, the slots are in time order already)
        k_models[_TIME_ORDER_FULL] = k_models[_TIME_ORDER]
        v_models[_TIME_ORDER_FULL] = v_models[_TIME_ORDER]
    o[_TIME_ORDER] = o[_TIME_ORDER_FULL] = right
    for hint, slot in ((_SLOT_T_MINUS_1, (pos - 1) % W), (_SLOT_T_PLUS_1, (pos + 1) % W), (_SLOT_LAST, min(pos, W - 1))):
        if slot != pos % W:
            ks, vs = _written(k_buf, k_new, slot), _written(v_buf, v_new, slot)
            o.setdefault(hint, _attend(q, ks[:, :, :n], vs[:, :, :n]))
            k_models.setdefault(hint, ks)
            v_models.setdefault(hint, vs)
    k_roll, v_roll = torch.cat([k_buf[:, :, 1:], k_new], dim=2), torch.cat([v_buf[:, :, 1:], v_new], dim=2)
    o.setdefault(_ROLLED, _attend(q, k_roll[:, :, W - n:], v_roll[:, :, W - n:]))
    k_models.setdefault(_ROLLED, k_roll)
    v_models.setdefault(_ROLLED, v_roll)
    return {"o": o, "k_buf": k_models, "v_buf": v_models}


def _ring_case(B: int, H: int, H_kv: int, d: int, W: int, pos: int, seed: int, dtype: torch.dtype,
               stale: bool) -> tuple:
    """Arguments of one step at position ``pos``: the buffers hold tokens 0 .. pos - 1, each in slot
    p % W (later ones overwrite earlier ones); unwritten slots hold zeros, or leftovers (``stale``)."""
    g = seeded(seed)
    q = torch.randn(B, H, 1, d, generator=g, dtype=torch.float64)
    k_seq = torch.randn(B, H_kv, pos + 1, d, generator=g, dtype=torch.float64)
    v_seq = torch.randn(B, H_kv, pos + 1, d, generator=g, dtype=torch.float64)
    k_buf, v_buf = (3 * torch.randn(B, H_kv, W, d, generator=g, dtype=torch.float64) if stale
                    else torch.zeros(B, H_kv, W, d, dtype=torch.float64) for _ in range(2))
    for p in range(pos):
        k_buf[:, :, p % W], v_buf[:, :, p % W] = k_seq[:, :, p], v_seq[:, :, p]
    return tuple(x.to(dtype) for x in (q, k_seq[:, :, pos:], v_seq[:, :, pos:], k_buf, v_buf)) + (pos,)


def _consistent_with_buffers(t: Trial, models: dict, k, v, expected: tuple) -> dict:
    """The output's mistake models that the returned buffers do not rule out: a mistake in where
    the new token goes shows in the buffers too (its buffer models), and every other one leaves
    them right, so a model is kept only if the buffers returned are the ones it predicts."""
    kept = {}
    for hint, model in models["o"].items():
        k_model = models["k_buf"].get(hint, expected[1])
        v_model = models["v_buf"].get(hint, expected[2])
        if not (isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)) or (  # the matching of t.tensor
                t._match_mistake(k, {hint: k_model}) and t._match_mistake(v, {hint: v_model})):
            kept[hint] = model
    return kept


def _compare_ring(t: Trial, got, expected: tuple, models: dict, W: int, args: tuple,
                  state: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Compare one step's output and buffers. ``state["failed"]``: an earlier step failed (its
    failure is the one reported, so the facts about this step's are not worked out)."""
    __tracebackhide__ = True
    o, k, v = t.tuple(got, 3, ["o", "k_buf", "v_buf"])
    _, k_new, v_new, k_given, v_given, pos = args
    found = {"k_buf": "", "v_buf": ""}
    buffers_right = _buffers_right(k, v, expected)
    if not state["failed"]:
        found = {"k_buf": _buffer_diagnosis("k_buf", k, k_given, k_new, pos),
                 "v_buf": _buffer_diagnosis("v_buf", v, v_given, v_new, pos)}
        if not any(found.values()) and buffers_right:
            found["o"] = _ring_output_diagnosis(o, args, expected[0])
    state["failed"] = state["failed"] or not buffers_right or not _buffers_right(o, o, (None, expected[0], expected[0]))
    models = {**models, "o": _consistent_with_buffers(t, models, k, v, expected)}
    compared = [("o", o, expected[0]), ("k_buf", k, expected[1]), ("v_buf", v, expected[2])]
    grew = [type(g) is torch.Tensor and g.dim() == 4 and g.shape[2] == W + 1 for _, g, _ in compared]
    if any(grew) or found["k_buf"] or found["v_buf"]:  # a buffer that grew, or was written wrong, explains the output too: first
        compared = compared[1:] + compared[:1]
        grew = grew[1:] + grew[:1]
    for (name, g, e), appended in zip(compared, grew):
        t.tensor(g, e, what=name, mistakes=models[name], hint=_RECIPE_74,
                 diagnosis=_APPENDED if appended else found.get(name, ""))
    return k, v


def _buffers_right(k, v, expected: tuple) -> bool:
    return all(type(g) is torch.Tensor and g.shape == e.shape and g.dtype == e.dtype
               and bool(_allclose(g.double(), e.double(), atol=1e-5, rtol=1e-4))
               for g, e in ((k, expected[1]), (v, expected[2])))


def _describe_ring(args: tuple) -> str:
    q, k_new, v_new, k_buf, v_buf, pos = args
    return describe_case(q=q, k_new=k_new, v_new=v_new, k_buf=k_buf, v_buf=v_buf, t=pos)


@exercise()
def ring_buffer_decode_step(t: Trial) -> None:
    t.error_hints = {
        r"takes \d+ positional argument|missing \d+ required positional argument": wrong_signature(
            "ring_buffer_decode_step(q, k_new, v_new, k_buf, v_buf, t); the window W is the "
            "buffers' length, k_buf.shape[2]."),
        r"out of bounds for dimension 2": Mistake(
            "slot-out-of-range", "the buffers have W slots, 0 .. W - 1: token t goes to "
            "slot t % W, which wraps around once t >= W.",
            "wrote to a slot past W - 1 (the slot index does not wrap around with t % W)"),
        r"must match the size of tensor b .* at non-singleton dimension 1|same (size|number of heads)|enable_gqa":
            Mistake("kv-heads-not-repeated",
                    "q has H heads and the buffers H_kv: repeat each key/value head for the H / "
                    "H_kv query heads of its group (repeat_interleave(H // H_kv, dim=1), or "
                    "notebook 06's repeat_kv) before the products.",
                    "multiplied q's H heads by the buffers' H_kv heads without repeating them"),
    }
    # (B, H, H_kv, d, W, t, dtype, stale, seed): no two of B, H, H_kv, d, W equal in the first two.
    # Before the buffer fills (leftovers in the unwritten slots), after it wrapped twice, exactly
    # full (float64), at the first wrap (MQA), then one drawn from a seed.
    steps = [(2, 6, 3, 5, 4, 2, torch.float32, True, 740), (3, 4, 2, 7, 5, 12, torch.float32, True, 741),
             (1, 8, 2, 3, 6, 5, torch.float64, False, 742), (2, 6, 1, 4, 3, 3, torch.float32, True, 743)]
    g = seeded(744)
    H_kv, W = draw(g, 1, 4), draw(g, 2, 9)
    steps.append((draw(g, 1, 4), H_kv * draw(g, 2, 4), H_kv, draw(g, 2, 9), W, draw(g, 0, 4 * W), torch.float32,
                  True, 745))
    planned = []
    for B, H, H_kv, d, W, pos, dtype, stale, seed in steps:
        args = _ring_case(B, H, H_kv, d, W, pos, seed, dtype, stale)
        planned.append((args, ref.ring_buffer_decode_step(*args), _ring_models(*args), W))
    # A whole generation from zeroed buffers, past two wraps, equals attention with notebook 03's
    # sliding-window mask at every step; each step is fed the buffers the learner returned.
    B, H, H_kv, d, W, T = 3, 4, 2, 5, 4, 11
    g = seeded(746)
    q_all = torch.randn(B, H, T, d, generator=g)
    k_all, v_all = torch.randn(B, H_kv, T, d, generator=g), torch.randn(B, H_kv, T, d, generator=g)
    o_full = scaled_dot_product_attention(q_all, repeat_kv(k_all, H // H_kv), repeat_kv(v_all, H // H_kv),
                                          sliding_window_mask(T, W))
    seq, k_b, v_b = [], torch.zeros(B, H_kv, W, d), torch.zeros(B, H_kv, W, d)
    for i in range(T):
        args = (q_all[:, :, i:i + 1], k_all[:, :, i:i + 1], v_all[:, :, i:i + 1], k_b, v_b, i)
        _, k_b, v_b = ref.ring_buffer_decode_step(*args)
        seq.append(((o_full[:, :, i:i + 1], k_b, v_b), _ring_models(*args)))

    state = {"failed": False}
    for args, expected, models, W_ in planned:
        got = t.call(*args, case=_describe_ring(args))
        _compare_ring(t, got, expected, models, W_, args, state)
    k_b, v_b = torch.zeros(B, H_kv, W, d), torch.zeros(B, H_kv, W, d)
    for i, (expected, models) in enumerate(seq):
        args = (q_all[:, :, i:i + 1].clone(), k_all[:, :, i:i + 1].clone(), v_all[:, :, i:i + 1].clone(), k_b, v_b, i)
        got = t.call(*args, case=f"a generation of {T} tokens with a window of W={W} from zeroed buffers [{B}, {H_kv}, "
                             f"{W}, {d}] (H={H} query heads), token t={i}, fed the buffers your function returned "
                             "at the step before")
        k_b, v_b = _compare_ring(t, got, expected, models, W, args, state)
