"""What attention costs: FLOPs, bytes, and measurements of this machine (notebooks 07 and 08).

Conventions (the course's, and the dimensions appendix's): a multiply-add counts as 2 FLOPs, so
``[a x b] @ [b x c]`` costs ``2abc``; scale + softmax count ``6`` FLOPs per score; no causal
halving unless stated. Bytes are Python ints; GB = 1e9 bytes and GiB = 2**30 bytes, always labelled.
Shapes: n (or T) tokens, d = d_model, H query heads, H_kv key/value heads, d_h head width.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .nb03_masks import causal_mask

__all__ = ["attention_flops", "score_matrix_bytes", "max_seq_len_for_scores", "training_memory"]

GB, GiB = 10**9, 2**30
TB, TiB = 10**12, 2**40
SOFTMAX_FLOPS_PER_SCORE = 6  # scale 1 + softmax ~5 (max, subtract, exp, sum, divide), per score


def matmul_flops(a: int, b: int, c: int) -> int:
    """FLOPs of ``[a x b] @ [b x c]``: ``2abc`` (b multiply-adds for each of the a*c outputs)."""
    return 2 * a * b * c


def attention_flops(n: int, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int) -> dict[str, int]:
    """FLOPs of one attention layer on n tokens (exercise 8.1), batch 1, no causal halving.

    Projections ``2 n d (H d_h)`` (Q, O) and ``2 n d (H_kv d_h)`` (K, V: grouped-query attention
    projects only H_kv heads); per query head ``2 n^2 d_h`` for the scores, ``6 n^2`` for scale +
    softmax, ``2 n^2 d_h`` for the weighted values. Returns the dict
    ``q_proj, k_proj, v_proj, o_proj, scores, softmax, weighted_values, total`` of ints."""
    if n_heads % n_kv_heads:
        raise ValueError(f"n_heads={n_heads} is not divisible by n_kv_heads={n_kv_heads}")
    f = {
        "q_proj": matmul_flops(n, d_model, n_heads * head_dim),
        "k_proj": matmul_flops(n, d_model, n_kv_heads * head_dim),
        "v_proj": matmul_flops(n, d_model, n_kv_heads * head_dim),
        "o_proj": matmul_flops(n, n_heads * head_dim, d_model),
        "scores": n_heads * matmul_flops(n, head_dim, n),
        "softmax": n_heads * SOFTMAX_FLOPS_PER_SCORE * n * n,
        "weighted_values": n_heads * matmul_flops(n, n, head_dim),
    }
    f["total"] = sum(f.values())
    return f


def ffn_flops(n: int, d_model: int, d_ff: int, gated: bool = True) -> int:
    """FLOPs of the MLP on n tokens: SwiGLU (gate, up, down: ``3 * 2 n d d_ff``) or, with
    ``gated=False``, a plain two-matrix MLP (``2 * 2 n d d_ff``). Activations not counted."""
    return (3 if gated else 2) * matmul_flops(n, d_model, d_ff)


# Models of helpers.configs whose MLP has two matrices (ReLU or GELU), not three (SwiGLU).
PLAIN_MLP = frozenset({"Transformer (base)", "GPT-2 small", "Falcon-7B", "Falcon-40B"})


def chunked_attention_flops(n: int, chunk: int, d_model: int, n_heads: int, n_kv_heads: int,
                            head_dim: int) -> dict[str, int]:
    """FLOPs of one *chunked* attention layer on n tokens (Llama 4's local layers): every token
    attends only to the tokens of its own chunk of ``chunk`` tokens, so the layer is
    :func:`attention_flops` applied to each chunk, summed: ``n // chunk`` full chunks and one of
    ``n % chunk``. Same keys; the projections equal the full layer's, the core grows as
    ``n * chunk`` instead of ``n^2`` once n passes the chunk."""
    full, rest = divmod(n, chunk)
    one = attention_flops(chunk, d_model, n_heads, n_kv_heads, head_dim)
    last = attention_flops(rest, d_model, n_heads, n_kv_heads, head_dim)
    return {k: full * one[k] + last[k] for k in one}


def layer_flops(n: int, cfg, chunked: bool = False) -> dict[str, int]:
    """One transformer layer of a :class:`helpers.configs.ModelConfig` (its dense MLP of width
    d_ff: SwiGLU, or a plain two-matrix MLP for the models in ``PLAIN_MLP``) on n tokens, by part:
    ``projections`` (Q, K, V, O), ``core`` (scores, scale + softmax, weighted values), ``ffn``,
    ``total``. Full attention, or with ``chunked=True`` one of cfg's chunked layers (attention
    within chunks of ``cfg.attention_chunk_size`` tokens; a model without them has none: error).
    Counted as GQA/MQA/MHA: not for MLA, whose projections are low-rank."""
    dims = (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
    if chunked and not cfg.attention_chunk_size:
        raise ValueError(f"{cfg.name} has no chunked attention layers (attention_chunk_size is 0)")
    a = chunked_attention_flops(n, cfg.attention_chunk_size, *dims) if chunked else attention_flops(n, *dims)
    parts = {
        "projections": a["q_proj"] + a["k_proj"] + a["v_proj"] + a["o_proj"],
        "core": a["scores"] + a["softmax"] + a["weighted_values"],
        "ffn": ffn_flops(n, cfg.d_model, cfg.d_ff, gated=cfg.name not in PLAIN_MLP),
    }
    parts["total"] = sum(parts.values())
    return parts


def crossover(linear_per_token: int, quadratic_per_token2: int, chunk: int = 0) -> int | None:
    """The smallest n at which ``quadratic_per_token2 * n^2`` reaches ``linear_per_token * n``:
    ``ceil(linear / quadratic)``, in integers (no float rounding). With ``chunk`` > 0 the quadratic
    term is a chunked layer's, which stops growing faster than n at the chunk length (per token it
    never exceeds ``quadratic * chunk``): the same n if it is at most ``chunk``, else None (never)."""
    n = -(-linear_per_token // quadratic_per_token2)
    return None if chunk and n > chunk else n


# --------------------------------------------------------------------------- memory


def score_matrix_bytes(batch: int, n_heads: int, seq_len: int, dtype_bytes: int) -> int:
    """Bytes of one layer's scores ``[B, H, T, T]`` (exercise 8.2): ``B H T^2`` numbers of
    ``dtype_bytes`` each, the full square (a causal kernel that stores S stores it all)."""
    return batch * n_heads * seq_len * seq_len * dtype_bytes


def max_seq_len_for_scores(budget_bytes: int, batch: int, n_heads: int, dtype_bytes: int) -> int:
    """The largest T with ``score_matrix_bytes(batch, n_heads, T, dtype_bytes) <= budget_bytes``
    (exercise 8.3). ``T^2 <= budget // (B H bytes)`` exactly, so T is the integer square root of
    that quotient: ``math.isqrt``, never a float square root (off by one above ~2^52)."""
    return math.isqrt(budget_bytes // (batch * n_heads * dtype_bytes))


def both_units(nbytes: int, digits: int = 2) -> str:
    """``17,179,869,184`` -> ``"17.18 GB (16.00 GiB)"``: decimal and binary units side by side
    (GB/GiB below 1 TB, TB/TiB from there)."""
    if nbytes >= TB:
        return f"{nbytes / TB:,.{digits}f} TB ({nbytes / TiB:,.{digits}f} TiB)"
    return f"{nbytes / GB:,.{digits}f} GB ({nbytes / GiB:,.{digits}f} GiB)"


def dense_param_count(cfg, tied_embeddings: bool = False) -> int:
    """Parameters of a dense Llama-style decoder from its config: embeddings (and an untied output
    matrix), per layer W_Q, W_K, W_V, W_O, the SwiGLU MLP (3 d d_ff) and two RMSNorm weights, and
    the final norm. Ignores the small per-head norms some models add (Qwen3's q/k norms: 256 per
    layer). Not for mixture-of-experts or MLA models."""
    d, hd = cfg.d_model, cfg.head_dim
    attn = d * (cfg.n_heads * hd) * 2 + d * (cfg.n_kv_heads * hd) * 2
    per_layer = attn + 3 * d * cfg.d_ff + 2 * d
    return cfg.vocab * d * (1 if tied_embeddings else 2) + cfg.n_layers * per_layer + d


# --------------------------------------------------------------------------- arithmetic intensity


def attention_step_costs(new_tokens: int, context: int, d_model: int, n_heads: int, n_kv_heads: int,
                         head_dim: int, batch: int = 1, dtype_bytes: int = 2) -> dict[str, int]:
    """FLOPs and the fewest bytes moved for one attention layer processing ``new_tokens`` per
    sequence against ``context`` keys (those new tokens included), for ``batch`` sequences.
    Prefill: ``new_tokens = context = P``; one decode step: ``new_tokens = 1``, ``context = L``.

    FLOPs: the four projections of the new tokens and ``4 H n T d_h`` for scores and weighted
    values (softmax and causal halving not counted). Bytes: the weights once for the whole
    batch, x read and y written, the new keys and values written, every key and value read once;
    scores, queries and head outputs are assumed to stay on chip (a fused kernel): the least
    traffic any implementation can have."""
    B, n, T, d, H, H_kv, d_h = batch, new_tokens, context, d_model, n_heads, n_kv_heads, head_dim
    proj = matmul_flops(B * n, d, 2 * H * d_h + 2 * H_kv * d_h)
    core = 4 * B * H * n * T * d_h
    weights = d * (2 * H * d_h + 2 * H_kv * d_h)
    numbers = weights + 2 * B * n * d + 2 * B * H_kv * n * d_h + 2 * B * H_kv * T * d_h
    return {"flops": proj + core, "bytes": numbers * dtype_bytes}


def roofline(intensity: float, peak_flops: float, bandwidth: float) -> float:
    """Attainable FLOP/s at an arithmetic intensity (FLOPs per byte): ``min(peak, intensity * bandwidth)``."""
    return min(peak_flops, intensity * bandwidth)


# --------------------------------------------------------------------------- measuring this machine


@contextlib.contextmanager
def torch_threads(n: int):
    """Run the ``with`` block on ``n`` intra-op threads, then restore the previous count. Timings
    of small operations on a shared machine are steadier on one thread: with several, each
    operation waits for the slowest thread to be scheduled."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def best_seconds(fn, repeats: int = 5, clock=time.perf_counter) -> float:
    """Seconds of the fastest of ``repeats`` calls of ``fn()``, after one untimed warm-up call
    (allocations, thread pool): the least disturbed run on a shared machine. ``clock`` is
    wall-clock time by default; ``time.thread_time`` counts only the CPU time of this thread, which
    leaves out the time other programs hold the core (right only for work done on this thread:
    inside ``torch_threads(1)``)."""
    fn()
    best = math.inf
    for _ in range(repeats):
        start = clock()
        fn()
        best = min(best, clock() - start)
    return best


def measure_matmul_flops(n: int = 1024, repeats: int = 3, dtype: torch.dtype = torch.float32,
                         clock=time.perf_counter) -> float:
    """FLOP/s of an ``[n x n] @ [n x n]`` matmul on the CPU (best of ``repeats``, timed by
    ``clock``: see :func:`best_seconds`)."""
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=g, dtype=dtype) for _ in range(2))
    out = torch.empty(n, n, dtype=dtype)
    return matmul_flops(n, n, n) / best_seconds(lambda: torch.mm(a, b, out=out), repeats, clock)


def measure_copy_bandwidth(nbytes: int = 64 * 2**20, repeats: int = 3, clock=time.perf_counter) -> float:
    """Bytes/s moved by copying a large float32 buffer into another (read + write both counted;
    best of ``repeats``, timed by ``clock``: see :func:`best_seconds`). The destination is
    allocated first, so page faults are not timed."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / best_seconds(lambda: dst.copy_(src), repeats, clock)


LLC_SYSFS = "/sys/devices/system/cpu/cpu0/cache/index3/size"  # Linux: CPU 0's level-3 cache


def last_level_cache_bytes(path: str = LLC_SYSFS) -> int | None:
    """Bytes of the last-level (L3) cache from Linux's sysfs, where the size reads like ``"32768K"``
    (K, M or G: binary units); None where the file is missing (not Linux, or no L3)."""
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:].upper(), 1)
    return int(text.rstrip("KMGkmg")) * scale


class PeakMemory(TorchDispatchMode):
    """Counts the bytes of tensors created inside the ``with`` block and keeps the peak.

    A CPU has no ``torch.cuda.max_memory_allocated``; this does the same accounting by hand: every
    operation's outputs are seen here (``__torch_dispatch__``); a storage's bytes are added when it
    first appears and subtracted when its last tensor is garbage-collected (a ``weakref``
    finalizer). Tensors passed as ``inputs`` (and views of them) are not counted. ``peak`` is the
    most bytes alive at once, ``now`` what is still alive at the end (the outputs)."""

    def __init__(self, *inputs: torch.Tensor):
        super().__init__()
        self.skip = {t.untyped_storage().data_ptr() for t in inputs}
        self.live: dict[int, list[int]] = {}  # storage address -> [tensors alive, bytes]
        self.now = self.peak = 0

    def _release(self, key: int) -> None:
        entry = self.live[key]
        entry[0] -= 1
        if entry[0] == 0:
            del self.live[key]
            self.now -= entry[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                key = t.untyped_storage().data_ptr()
                if key in self.skip:
                    continue
                if key not in self.live:
                    self.live[key] = [0, t.untyped_storage().nbytes()]
                    self.now += self.live[key][1]
                    self.peak = max(self.peak, self.now)
                self.live[key][0] += 1
                weakref.finalize(t, self._release, key)
        return out


# --------------------------------------------------------------------------- a training step's memory

# ZeRO's convention for mixed-precision Adam (Rajbhandari et al. 2020, section 3.1): weights and
# gradients in 16 bits (2 + 2 bytes per parameter); the optimizer keeps an fp32 master copy of the
# weights and the two fp32 moments (4 + 4 + 4). 16 bytes per parameter, as fp32 throughout
# (4 + 4 + 4 + 4). A floor: Megatron-Core accumulates gradients in fp32, 18 bytes with bf16 weights.
STATE_BYTES = {"weights": 2, "gradients": 2, "optimizer": 12}
ACTIVATION_BYTES = 2  # bf16 activations
STRATEGIES = ("naive", "flash", "recompute")


def layer_activation_numbers(cfg, seq_len: int, attention: str) -> dict[str, int]:
    """Numbers one layer of a Llama-style decoder (RMSNorm, GQA attention, SwiGLU MLP) saves for
    backward, **per token**, by tensor: each operation's saved inputs, counted once per tensor.

    ``attn_norm_in`` x (d; the norm saves it), ``attn_norm_out`` (d; the input of W_Q, W_K, W_V),
    ``q`` (H d_h), ``k``, ``v`` (H_kv d_h each), ``attn_out`` (H d_h; the input of W_O),
    ``probs`` P (H * seq_len: one row of T per query head; only with ``attention="naive"``),
    ``mlp_norm_in``, ``mlp_norm_out`` (d each), ``gate`` (d_ff; the input of SiLU), ``silu_gate``,
    ``up`` (d_ff each; the inputs of the product), ``gated`` (d_ff; the input of W_down).
    ``attention="recompute"``: only ``layer_in`` (d), the layer's input; the rest is recomputed.
    Left out: one number per token per norm (1/rms), FlashAttention's log-sum-exp (H per token)."""
    if attention not in STRATEGIES:
        raise ValueError(f"attention must be one of {STRATEGIES}, got {attention!r}")
    d, dh, f = cfg.d_model, cfg.head_dim, cfg.d_ff
    if attention == "recompute":
        return {"layer_in": d}
    return {"attn_norm_in": d, "attn_norm_out": d, "q": cfg.n_heads * dh, "k": cfg.n_kv_heads * dh,
            "v": cfg.n_kv_heads * dh, "attn_out": cfg.n_heads * dh,
            "probs": cfg.n_heads * seq_len if attention == "naive" else 0,
            "mlp_norm_in": d, "mlp_norm_out": d, "gate": f, "silu_gate": f, "up": f, "gated": f}


def head_activation_numbers(cfg) -> dict[str, int]:
    """Numbers per token that the top of the model saves for backward: the final norm's input and
    output (d each; the output is the input of the unembedding) and the log-probabilities that
    the cross-entropy keeps (vocab). The embedding saves only the token ids."""
    return {"final_norm_in": cfg.d_model, "final_norm_out": cfg.d_model, "log_probs": cfg.vocab}


def activation_numbers(cfg, batch: int, seq_len: int, attention: str) -> int:
    """Numbers of the activations saved for backward, for ``batch`` sequences of ``seq_len``
    tokens: ``batch * seq_len * (L * one layer + the head)`` (:func:`layer_activation_numbers`,
    :func:`head_activation_numbers`). With ``"recompute"`` the backward pass recomputes one layer
    at a time (with FlashAttention), so one layer's activations less its input (already kept) come
    back on top: a bound, since the head's are freed before the first layer is recomputed."""
    recomputed = 0
    if attention == "recompute":
        recomputed = sum(layer_activation_numbers(cfg, seq_len, "flash").values()) - cfg.d_model
    return saved_numbers(cfg, batch, seq_len, attention) + batch * seq_len * recomputed


def saved_numbers(cfg, batch: int, seq_len: int, attention: str) -> int:
    """Numbers saved for backward when the forward pass ends: ``batch * seq_len * (L * one layer
    + the head)``, one layer's input per layer with ``"recompute"``."""
    per_token = cfg.n_layers * sum(layer_activation_numbers(cfg, seq_len, attention).values())
    return batch * seq_len * (per_token + sum(head_activation_numbers(cfg).values()))


def training_memory(cfg, batch: int, seq_len: int, attention: str) -> dict[str, int]:
    """Bytes of one training step of a dense Llama-style model (exercise 8.4), under the
    convention of ``STATE_BYTES``: ``weights`` 2N (bf16), ``gradients`` 2N (bf16), ``optimizer``
    12N (fp32 master weights, AdamW's m and v), with N = :func:`dense_param_count` (untied
    embeddings), and ``activations``: 2 bytes (bf16) per number saved for backward
    (:func:`activation_numbers`) for ``batch`` sequences of ``seq_len`` tokens; ``attention`` is
    ``"naive"``, ``"flash"`` or ``"recompute"``. ``total`` is the sum of the four, all alive at
    once when gradient buffers are kept between steps. Ints, bytes."""
    if batch < 0 or seq_len < 0:
        raise ValueError(f"batch and seq_len count sequences and tokens: got {batch} and {seq_len}")
    n = dense_param_count(cfg)
    out = {part: n * nbytes for part, nbytes in STATE_BYTES.items()}
    out["activations"] = ACTIVATION_BYTES * activation_numbers(cfg, batch, seq_len, attention)
    out["total"] = sum(out.values())
    return out


def max_batch(cfg, seq_len: int, attention: str, budget_bytes: int) -> int:
    """The most sequences of ``seq_len`` tokens whose :func:`training_memory` total fits
    ``budget_bytes`` (0 when the weights and optimizer alone do not fit): the activations are
    linear in the batch, so it is one integer division."""
    if not seq_len >= 1:
        raise ValueError(f"seq_len is the tokens per sequence, >= 1; got {seq_len}")
    fixed = training_memory(cfg, 0, seq_len, attention)["total"]
    per_sequence = training_memory(cfg, 1, seq_len, attention)["total"] - fixed
    return max(0, (budget_bytes - fixed) // per_sequence)


def training_flops_per_token(cfg, seq_len: int) -> dict[str, int]:
    """Training FLOPs per token (forward + backward = 3 x forward): ``dense`` 6N and
    ``attention``, 3 x the core (scores, softmax, weighted values) of :func:`layer_flops` at
    ``seq_len`` per token, over the L layers; no causal halving.

    N counts the weights that multiply: every matrix of the layers and the output projection
    (2 FLOPs forward, 4 backward), not the input embedding table, a lookup that does no
    arithmetic: :func:`dense_param_count` less ``vocab * d_model``. That equals
    ``dense_param_count(cfg, tied_embeddings=True)``: a tied table is the output projection,
    counted once, so tying changes the parameters, not the FLOPs. (The norms' ``2Ld + d`` weights
    stay in N: under 0.001% of it.)"""
    core = cfg.n_layers * layer_flops(seq_len, cfg)["core"] // seq_len
    multiplying = dense_param_count(cfg) - cfg.vocab * cfg.d_model
    return {"dense": 6 * multiplying, "attention": 3 * core}


# --------------------------------------------------------------------------- a model that matches the count


class RMSNormFunction(torch.autograd.Function):
    """RMSNorm ``x / rms(x) * w`` as a fused kernel does it: it saves its input x and 1/rms (one
    number per row), not ``x / rms(x)`` (PyTorch's composite ``F.rms_norm`` keeps that too).
    x ``[..., D]``, w ``[D]`` -> ``[..., D]``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, r, w)
        return x * r * w

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, r, w = ctx.saved_tensors
        x_hat = x * r
        grad_w = (grad * x_hat).reshape(-1, x.shape[-1]).sum(0)
        g = grad * w
        return r * (g - x_hat * (g * x_hat).mean(-1, keepdim=True)), grad_w, None


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """:class:`RMSNormFunction`: x ``[..., D]``, w ``[D]`` -> ``[..., D]``."""
    return RMSNormFunction.apply(x, w, eps)


def naive_gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention that forms P: q ``[B, T, H, d_h]``, k, v ``[B, T, H_kv, d_h]`` ->
    ``[B, T, H * d_h]``. The G = H / H_kv query heads of a group are stacked as G*T rows against
    their shared keys, so K and V are never repeated; it saves q, k, v, P ``[B, H_kv, G*T, T]``."""
    B, T, H, d_h = q.shape
    H_kv = k.shape[2]
    G = H // H_kv
    q = q.reshape(B, T, H_kv, G, d_h).permute(0, 2, 3, 1, 4).reshape(B, H_kv, G * T, d_h)
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, H_kv, T, d_h]
    bias = torch.zeros(T, T, dtype=q.dtype, device=q.device).masked_fill(~causal_mask(T, q.device), -math.inf)
    scores = q @ k.transpose(-2, -1) / math.sqrt(d_h) + bias.repeat(G, 1)  # adding saves nothing
    out = torch.softmax(scores, dim=-1) @ v  # [B, H_kv, G*T, d_h]
    return out.reshape(B, H_kv, G, T, d_h).permute(0, 3, 1, 2, 4).reshape(B, T, H * d_h)


class CountedDecoder(torch.nn.Module):
    """A Llama-style decoder (no RoPE, whose tables are shared by the batch) built so that what it
    saves for backward is exactly :func:`activation_numbers`' terms, plus the small ones that
    count leaves out. Its parameters are :func:`dense_param_count`'s (untied embeddings).
    ``forward(tokens [B, T], targets [B, T])`` -> the mean cross-entropy (0-dim). ``attention``:
    ``"naive"`` (:func:`naive_gqa_attention`), ``"flash"`` (``F.scaled_dot_product_attention``,
    which on a CPU saves q, k, v, the output and the log-sum-exp), ``"recompute"`` (flash inside
    ``torch.utils.checkpoint``: each layer keeps only its input)."""

    def __init__(self, cfg, attention: str = "flash", generator: torch.Generator | None = None):
        super().__init__()
        if attention not in STRATEGIES:
            raise ValueError(f"attention must be one of {STRATEGIES}, got {attention!r}")
        self.cfg, self.attention = cfg, attention
        d, f, q_width, kv_width = cfg.d_model, cfg.d_ff, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim

        def weight(rows: int, cols: int) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.randn(rows, cols, generator=generator) * rows**-0.5)

        self.embed = weight(cfg.vocab, d)
        self.layers = torch.nn.ModuleList()
        for _ in range(cfg.n_layers):
            layer = torch.nn.Module()
            layer.attn_norm, layer.mlp_norm = torch.nn.Parameter(torch.ones(d)), torch.nn.Parameter(torch.ones(d))
            layer.w_q, layer.w_k, layer.w_v = weight(d, q_width), weight(d, kv_width), weight(d, kv_width)
            layer.w_o = weight(q_width, d)
            layer.w_gate, layer.w_up, layer.w_down = weight(d, f), weight(d, f), weight(f, d)
            self.layers.append(layer)
        self.final_norm = torch.nn.Parameter(torch.ones(d))
        self.unembed = weight(d, cfg.vocab)

    def block(self, x: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor:
        """One layer: x ``[B, T, D]`` -> ``[B, T, D]``."""
        B, T, _ = x.shape
        cfg = self.cfg
        h = rms_norm(x, layer.attn_norm)
        q = (h @ layer.w_q).view(B, T, cfg.n_heads, cfg.head_dim)
        k = (h @ layer.w_k).view(B, T, cfg.n_kv_heads, cfg.head_dim)
        v = (h @ layer.w_v).view(B, T, cfg.n_kv_heads, cfg.head_dim)
        if self.attention == "naive":
            o = naive_gqa_attention(q, k, v)
        else:  # the output's memory is [B, T, H, d_h]: merging the heads is a view, not a copy
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True, enable_gqa=True)
            o = o.transpose(1, 2).reshape(B, T, -1)
        x = x + o @ layer.w_o
        h = rms_norm(x, layer.mlp_norm)
        gate = h @ layer.w_gate
        return x + (F.silu(gate) * (h @ layer.w_up)) @ layer.w_down

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = F.embedding(tokens, self.embed)
        for layer in self.layers:
            if self.attention == "recompute":
                x = torch.utils.checkpoint.checkpoint(self.block, x, layer, use_reentrant=False)
            else:
                x = self.block(x, layer)
        logits = rms_norm(x, self.final_norm) @ self.unembed
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def uncounted_saved_bytes(cfg, batch: int, seq_len: int, attention: str, dtype_bytes: int) -> int:
    """Bytes :class:`CountedDecoder` saves for backward beyond :func:`saved_numbers`: 1/rms of
    every norm (one number per token; 2L + 1 norms, the final one only with ``"recompute"``),
    FlashAttention's log-sum-exp (H fp32 numbers per token per layer, ``"flash"`` only), the token
    ids and the targets (int64, 8 bytes each per token), and the cross-entropy's 0-dim weight."""
    norms = 1 if attention == "recompute" else 2 * cfg.n_layers + 1
    lse = 4 * cfg.n_layers * cfg.n_heads if attention == "flash" else 0
    return batch * seq_len * (norms * dtype_bytes + lse + 2 * 8) + dtype_bytes


def saved_for_backward(fn, exclude=()) -> tuple[object, dict[int, tuple[list[int], torch.dtype, int]]]:
    """Run ``fn()`` and return ``(its result, what autograd saved for backward)``: storage address
    -> ``(shape, dtype, bytes of the storage)``, each storage once; storages of ``exclude`` (the
    parameters) left out. ``torch.autograd.graph.saved_tensors_hooks`` passes every saved tensor
    to its pack function: the exact list, however the tensors were made."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    saved: dict[int, tuple[list[int], torch.dtype, int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if key not in skip:
            saved.setdefault(key, (list(t.shape), t.dtype, t.untyped_storage().nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return result, saved


@contextlib.contextmanager
def _stderr_discarded():
    """Point file descriptor 2 at /dev/null for the block: Kineto, the profiler's back end, writes
    one line there when it starts and one when it stops, below Python's ``sys.stderr``."""
    sys.stderr.flush()
    kept, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(kept, 2)
        os.close(kept)
        os.close(null)


def allocation_peak(fn) -> int:
    """Peak bytes that ``fn()``'s allocations hold at once on the CPU, above what was alive
    before: ``torch.profiler`` with ``profile_memory=True`` records every allocation (+bytes) and
    free (-bytes) of the CPU allocator in time order (backward and optimizer included); the
    running sum's maximum is the peak."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _stderr_discarded():
        prof.start()
    try:
        fn()
    finally:
        with _stderr_discarded():
            prof.stop()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak
