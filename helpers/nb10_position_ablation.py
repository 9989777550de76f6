"""Position encodings compared on a trained model (notebook 10, section 8).

Notebook 11's tiny transformer (:mod:`helpers.nb11_trained_transformer`) with its RoPE swapped for
ALiBi's bias (:func:`helpers.nb10_positions.alibi_bias`) or for nothing at all (NoPE: the causal
mask is then the only source of order). Trained on the same repeated sequences with the same
seeds, and tested on sequences longer than any seen in training. This module imports both topic
modules; :mod:`helpers.nb11_trained_transformer` imports :mod:`helpers.nb10_positions`, which
therefore cannot hold it. Shapes as in notebook 11: B batch, T sequence length, D = d_model,
V vocabulary, H heads, d_k = D / H.
"""

from __future__ import annotations

import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from functools import partial

import torch
import torch.nn.functional as F

from .nb01_qkv_shapes import merge_heads, scaled_scores, split_heads
from .nb03_masks import causal_mask
from .nb06_kv_sharing import repeat_kv
from .nb10_positions import alibi_attention_weights, rope_cos_sin
from .nb11_trained_transformer import (
    TinyConfig,
    TinyTransformer,
    attention_block,
    induction_scores,
    repeated_sequences,
    swiglu,
    train,
)

__all__: list[str] = []  # no graded function here: see helpers.nb10_positions

POSITIONS = ("rope", "alibi", "nope")


def alibi_attention_block(x: torch.Tensor, w_qkv: torch.Tensor, w_o: torch.Tensor, n_heads: int,
                          n_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One causal self-attention layer with ALiBi instead of RoPE: notebook 11's
    ``attention_block`` with ``-slope_h |i - j|`` added to head h's scaled scores and q, k left
    unrotated. x ``[B, T, D]``, w_qkv ``[D, (H + 2 H_kv) d_k]``, w_o ``[H d_k, D]`` ->
    ``(y [B, T, D], weights [B, H, T, T])``."""
    d_k = w_o.shape[0] // n_heads
    q, k, v = (x @ w_qkv).split([n_heads * d_k, n_kv_heads * d_k, n_kv_heads * d_k], dim=-1)
    q, k, v = split_heads(q, n_heads), split_heads(k, n_kv_heads), split_heads(v, n_kv_heads)
    n_rep = n_heads // n_kv_heads
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    weights = alibi_attention_weights(scaled_scores(q, k), n_heads)  # causal softmax(s + bias)
    return merge_heads(weights @ v) @ w_o, weights


class PositionedTransformer(TinyTransformer):
    """:class:`~helpers.nb11_trained_transformer.TinyTransformer` with a choice of position
    signal: ``position`` is ``"rope"`` (notebook 11's model), ``"alibi"`` (no rotation; ALiBi's
    bias on every layer's scores) or ``"nope"`` (no position signal: RoPE's tables set to the
    identity, cos = 1 and sin = 0). The same parameters, initialised the same way for a given
    generator. ``forward(tokens, record=None)``: tokens ``[B, T]`` -> logits ``[B, T, V]``; a list
    passed as ``record`` receives each layer's attention weights ``[B, H, T, T]``. (Notebook 11's
    head and path ablations are not offered here.)"""

    def __init__(self, cfg: TinyConfig, position: str = "rope", generator: torch.Generator | None = None):
        if position not in POSITIONS:
            raise ValueError(f"position must be one of {POSITIONS}, got {position!r}")
        super().__init__(cfg, generator)
        self.position = position

    def forward(self, tokens: torch.Tensor, record: list | None = None) -> torch.Tensor:
        cfg = self.cfg
        x = self.embed[tokens]  # [B, T, D]
        T = x.shape[1]
        if self.position == "rope":
            cos, sin = rope_cos_sin(torch.arange(T, device=x.device), cfg.head_dim, cfg.rope_base, x.dtype)
        else:  # the identity rotation: cos = 1, sin = 0 (ALiBi's layers do not read them)
            cos = torch.ones(T, cfg.head_dim, dtype=x.dtype, device=x.device)
            sin = torch.zeros_like(cos)
        mask = causal_mask(T, device=x.device)
        for layer in self.layers:
            h = F.rms_norm(x, (cfg.d_model,), layer.attn_norm)
            if self.position == "alibi":
                y, weights = alibi_attention_block(h, layer.w_qkv, layer.w_o, cfg.n_heads, cfg.kv_heads)
            else:
                y, weights = attention_block(h, layer.w_qkv, layer.w_o, cfg.n_heads, cfg.kv_heads, cos, sin, mask)
            if record is not None:
                record.append(weights.detach())
            x = x + y
            if cfg.d_ff:
                x = x + swiglu(F.rms_norm(x, (cfg.d_model,), layer.mlp_norm), layer.w_gate, layer.w_up, layer.w_down)
        return F.rms_norm(x, (cfg.d_model,), self.final_norm) @ self.unembed


@torch.no_grad()
def repeat_half_metrics(model: TinyTransformer, tokens: torch.Tensor) -> dict[str, object]:
    """tokens ``[B, 2m]`` (m random tokens, then the same m again) -> ``{"loss", "accuracy",
    "induction", "per_position"}``: the mean loss (nats) and the share of right argmax predictions
    over the positions ``m .. 2m-2`` (each predicts a token it can copy from the first half); the
    highest induction score (notebook 11's ``induction_scores``) among the last layer's heads, on
    the batch-averaged weights; and the loss at every position, ``[2m - 1]`` averaged over the batch."""
    m = tokens.shape[1] // 2
    record: list[torch.Tensor] = []
    logits = model(tokens, record=record)[:, :-1]  # [B, 2m - 1, V]: position t predicts token t + 1
    per = F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none")  # [B, 2m - 1]
    right = logits[:, m:].argmax(dim=-1) == tokens[:, m + 1:]
    attn = torch.stack([w.mean(dim=0) for w in record])  # [L, H, T, T]
    return {"loss": per[:, m:].mean().item(), "accuracy": right.float().mean().item(),
            "induction": induction_scores(attn)[-1].max().item(), "per_position": per.mean(dim=0)}


def ablation_run(position: str, seed: int, cfg: TinyConfig, steps: int = 400, batch: int = 64,
                 m_range: tuple[int, int] = (4, 8), lr: float = 1e-2, factors: tuple[int, ...] = (1, 2, 4),
                 n_eval: int = 256, eval_seed: int = 99) -> dict[str, object]:
    """Train ``PositionedTransformer(cfg, position)``, initialised and fed (notebook 11's ``train``)
    from ``seed``, then measure it with :func:`repeat_half_metrics` on ``n_eval`` fresh sequences of
    length T = 2 k m_range[1] for each k in ``factors`` (drawn from ``eval_seed``: the same for every
    run). Returns ``{"position", "seed", "state"`` (the trained state_dict)``, "final_loss"`` (mean
    training loss of the last 20 steps, nats)``, "seconds"`` (training time)``, "metrics": {k: ...}}``."""
    model = PositionedTransformer(cfg, position, generator=torch.Generator().manual_seed(seed))
    start = time.perf_counter()
    hist = train(model, steps=steps, batch=batch, m_range=m_range, lr=lr, seed=seed)
    seconds = time.perf_counter() - start
    metrics = {k: repeat_half_metrics(model, repeated_sequences(
        n_eval, k * m_range[1], cfg.vocab, torch.Generator().manual_seed(eval_seed))) for k in factors}
    return {"position": position, "seed": seed, "state": model.state_dict(),
            "final_loss": sum(hist["loss"][-20:]) / 20, "seconds": seconds, "metrics": metrics}


def _one_thread() -> None:
    torch.set_num_threads(1)


def _run(job: tuple[str, int], **kwargs) -> dict[str, object]:
    return ablation_run(*job, **kwargs)


def ablation_runs(jobs: list[tuple[str, int]], cfg: TinyConfig, workers: int = 2, **kwargs) -> list[dict]:
    """:func:`ablation_run` for every ``(position, seed)`` in ``jobs``, in ``workers`` fresh
    processes of one thread each (so that a run gives the same numbers whichever process ran it
    and whatever ran beside it); keyword arguments go to :func:`ablation_run`. -> results in the
    order of ``jobs``."""
    spawn = multiprocessing.get_context("spawn")  # a fresh interpreter: no state forked from this one
    with ProcessPoolExecutor(workers, mp_context=spawn, initializer=_one_thread) as pool:
        return list(pool.map(partial(_run, cfg=cfg, **kwargs), jobs))
