"""What attention costs: FLOPs, bytes, and measurements of this machine (notebooks 07 and 08).

Conventions (the course's, and the dimensions appendix's): a multiply-add counts as 2 FLOPs, so
``[a x b] @ [b x c]`` costs ``2abc``; scale + softmax count ``6`` FLOPs per score; no causal
halving unless stated. Bytes are Python ints; GB = 1e9 bytes and GiB = 2**30 bytes, always labelled.
Shapes: n (or T) tokens, d = d_model, H query heads, H_kv key/value heads, d_h head width.
"""

from __future__ import annotations

import contextlib
import math
import time
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["attention_flops", "score_matrix_bytes", "max_seq_len_for_scores"]

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
