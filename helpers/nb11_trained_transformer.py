"""A tiny decoder-only transformer, trained on a CPU, in which induction heads appear (notebook 11).

Built from the course's own pieces: head split and merge, the causal mask and masked softmax
(:mod:`helpers.nb01_qkv_shapes`), RoPE (:mod:`helpers.nb10_positions`), and grouped-query attention's
``repeat_kv`` (:mod:`helpers.nb06_kv_sharing`) when there are fewer key/value heads than query heads.
Shapes: B batch, T sequence length, D = d_model, V vocabulary, H heads, d_k = D / H, L layers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .nb01_qkv_shapes import attention_weights, merge_heads, split_heads
from .nb03_masks import causal_mask
from .nb06_kv_sharing import repeat_kv
from .nb10_positions import apply_rope, rope_cos_sin

__all__ = ["swiglu", "causal_lm_loss", "induction_scores"]


# --------------------------------------------------------------------------- graded pieces


def swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """The LLaMA MLP (exercise 11.1): ``(silu(x @ w_gate) * (x @ w_up)) @ w_down``.

    x ``[..., D]``, w_gate and w_up ``[D, F]``, w_down ``[F, D]`` -> ``[..., D]``."""
    return (F.silu(x @ w_gate) * (x @ w_up)) @ w_down


def causal_lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy averaged over all B * T positions (exercise 11.2).

    logits ``[B, T, V]``, targets ``[B, T]`` (already shifted: ``targets[b, t]`` is the token
    that follows position t) -> a 0-dim tensor, in nats."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def induction_scores(attn: torch.Tensor) -> torch.Tensor:
    """Induction score of every head (exercise 11.3).

    attn ``[L, H, T, T]``: attention weights recorded on a sequence whose second half repeats
    its first (T = 2m). For each head, the mean over the queries ``i = m .. 2m-1`` of the weight
    on key ``i - m + 1``: the token right after the query's previous occurrence. -> ``[L, H]``."""
    T = attn.shape[-1]
    if T % 2:
        raise ValueError(f"T must be even (a sequence and its repeat), got T = {T}")
    m = T // 2
    queries = torch.arange(m, T, device=attn.device)
    return attn[..., queries, queries - m + 1].mean(dim=-1)


# --------------------------------------------------------------------------- other diagnostics


def previous_token_scores(attn: torch.Tensor) -> torch.Tensor:
    """attn ``[L, H, T, T]`` -> ``[L, H]``: mean weight on key ``i - 1`` over queries ``i >= 1``."""
    return attn.diagonal(offset=-1, dim1=-2, dim2=-1).mean(dim=-1)


def seen_token_mass(probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """probs ``[B, T, V]`` (the model's next-token probabilities at each position), tokens ``[B, T]``
    -> ``[B, T]``: the probability position t gives to the tokens among ``tokens[:, :t+1]``."""
    seen = F.one_hot(tokens, probs.shape[-1]).cumsum(dim=1) > 0  # [B, T, V]
    return (probs * seen).sum(dim=-1)


def mlp_width(d_model: int, multiple_of: int = 256) -> int:
    """The LLaMA-style SwiGLU width: ``2/3 * 4D``, rounded up to a multiple of ``multiple_of``, so
    that three ``D x F`` matrices hold about as many weights as a plain MLP's two ``D x 4D``."""
    return multiple_of * math.ceil(int(2 * 4 * d_model / 3) / multiple_of)


# --------------------------------------------------------------------------- data


def repeated_sequences(n: int, m: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """``[n, 2m]`` long: m distinct random tokens, then the same m again (m <= vocab). The first
    half cannot be predicted (beyond "not a token seen already"); the second half can, by copying
    from the first, and each token has exactly one earlier occurrence to copy from."""
    if not 1 <= m <= vocab:
        raise ValueError(f"need 1 <= m <= vocab for m distinct tokens, got m = {m}, vocab = {vocab}")
    first = torch.rand(n, vocab, generator=generator).argsort(dim=-1)[:, :m]
    return torch.cat((first, first), dim=1)


def repeat_chance(m: int, m_range: tuple[int, int]) -> torch.Tensor:
    """``[m - 1]``: at each position t = 0 .. m-2 of a first half (t + 1 distinct tokens seen, no
    repeat yet), the probability that the next token starts the repeat when the half length is
    drawn uniformly from ``m_range``: ``1 / (hi - t)`` once ``t + 1 >= lo``, else 0."""
    lo, hi = m_range
    if not lo <= m <= hi:
        raise ValueError(f"m = {m} is outside m_range = {m_range}")
    t = torch.arange(m - 1, dtype=torch.float64)
    return torch.where(t + 1 >= lo, 1 / (hi - t), 0.0)


def first_half_floor(vocab: int, m: int, m_range: tuple[int, int] | None = None) -> torch.Tensor:
    """``[m - 1]``: the lowest expected loss (nats) at the positions t = 0 .. m-2 predicting a first
    half's tokens 1 .. m-1. The t + 1 tokens seen cannot come next, so the best bet spreads evenly
    over the other V - t - 1: ``ln(V - t - 1)``. A model that knows only that m was drawn from
    ``m_range`` must also bet ``repeat_chance`` on the first token: ``- ln(1 - repeat_chance)`` more."""
    t = torch.arange(m - 1, dtype=torch.float64)
    floor = torch.log(vocab - t - 1)
    return floor if m_range is None else floor - torch.log1p(-repeat_chance(m, m_range))


# --------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class TinyConfig:
    """Sizes of the tiny model. ``n_kv_heads`` < ``n_heads`` gives grouped-query attention;
    ``d_ff = 0`` leaves out the MLPs (an attention-only transformer)."""

    vocab: int = 32
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None
    d_ff: int = 0
    rope_base: float = 10000.0

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def attention_block(x: torch.Tensor, w_qkv: torch.Tensor, w_o: torch.Tensor, n_heads: int, n_kv_heads: int,
                    cos: torch.Tensor, sin: torch.Tensor, allowed: torch.Tensor,
                    keep: torch.Tensor | None = None, x_k: torch.Tensor | None = None,
                    x_v: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One self-attention layer with RoPE and grouped-query attention.

    x ``[B, T, D]``, w_qkv ``[D, (H + 2 H_kv) d_k]`` (columns Q, K, V), w_o ``[H d_k, D]``, RoPE
    tables cos, sin ``[T, d_k]`` (:func:`helpers.nb10_positions.rope_cos_sin`), allowed ``[T, T]`` bool
    (the causal mask); keep ``[H]`` multiplies each head's output before W_O (0 ablates a head);
    x_k, x_v ``[B, T, D]``, when given, replace x as the input of the keys, the values (path ablation).
    Returns ``(y [B, T, D], weights [B, H, T, T])``."""
    d_k = w_o.shape[0] // n_heads
    sizes = [n_heads * d_k, n_kv_heads * d_k, n_kv_heads * d_k]
    q, k, v = (x @ w_qkv).split(sizes, dim=-1)
    if x_k is not None:  # path ablation: the keys read another input
        k = (x_k @ w_qkv).split(sizes, dim=-1)[1]
    if x_v is not None:
        v = (x_v @ w_qkv).split(sizes, dim=-1)[2]
    q, k, v = split_heads(q, n_heads), split_heads(k, n_kv_heads), split_heads(v, n_kv_heads)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    n_rep = n_heads // n_kv_heads  # GQA (notebook 06): query head h reads key/value head h // n_rep
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    weights = attention_weights(q, k, allowed)  # [B, H, T, T]
    heads = weights @ v
    if keep is not None:
        heads = heads * keep[:, None, None]
    return merge_heads(heads) @ w_o, weights


class TinyTransformer(nn.Module):
    """Token embedding -> L x (RMSNorm, attention with RoPE, residual; RMSNorm, SwiGLU MLP,
    residual) -> RMSNorm -> unembedding. No position embedding: RoPE carries order.

    ``forward(tokens, record=None, ablate=(), allowed=None, paths=())``: tokens ``[B, T]`` -> logits
    ``[B, T, V]``. A list passed as ``record`` receives each layer's attention weights
    ``[B, H, T, T]`` (the hook that notebook 11 reads heads with); ``ablate`` is a collection of
    ``(layer, head)`` pairs whose output is zeroed before W_O; ``allowed`` ``[T, T]`` replaces the
    causal mask (to test what a broken mask does); ``paths`` is a collection of
    ``(kind, layer, head)``, kind one of ``"q", "k", "v"``: that head's output is left out of the
    residual stream from which every later layer computes its queries, keys or values, and only
    those (a path ablation: the rest of the model still sees it). :meth:`from_embeddings` starts
    from x ``[B, T, D]``.
    """

    def __init__(self, cfg: TinyConfig, generator: torch.Generator | None = None):
        super().__init__()
        self.cfg = cfg
        D, d_k, H, H_kv = cfg.d_model, cfg.head_dim, cfg.n_heads, cfg.kv_heads
        if D % H or H % H_kv:
            raise ValueError(f"need d_model % n_heads == 0 and n_heads % n_kv_heads == 0, got {D}, {H}, {H_kv}")
        g = generator

        def param(*shape, std):
            return nn.Parameter(torch.randn(*shape, generator=g) * std)

        self.embed = param(cfg.vocab, D, std=1.0)
        self.layers = nn.ModuleList()
        for _ in range(cfg.n_layers):
            layer = nn.Module()
            layer.attn_norm = nn.Parameter(torch.ones(D))
            layer.w_qkv = param(D, (H + 2 * H_kv) * d_k, std=D**-0.5)
            layer.w_o = param(H * d_k, D, std=(H * d_k) ** -0.5 / math.sqrt(2 * cfg.n_layers))
            if cfg.d_ff:
                layer.mlp_norm = nn.Parameter(torch.ones(D))
                layer.w_gate = param(D, cfg.d_ff, std=D**-0.5)
                layer.w_up = param(D, cfg.d_ff, std=D**-0.5)
                layer.w_down = param(cfg.d_ff, D, std=cfg.d_ff**-0.5 / math.sqrt(2 * cfg.n_layers))
            self.layers.append(layer)
        self.final_norm = nn.Parameter(torch.ones(D))
        self.unembed = param(D, cfg.vocab, std=D**-0.5)

    def forward(self, tokens: torch.Tensor, record: list | None = None, ablate: Iterable[tuple[int, int]] = (),
                allowed: torch.Tensor | None = None, paths: Iterable[tuple[str, int, int]] = ()) -> torch.Tensor:
        return self.from_embeddings(self.embed[tokens], record, ablate, allowed, paths)

    def from_embeddings(self, x: torch.Tensor, record: list | None = None, ablate: Iterable[tuple[int, int]] = (),
                        allowed: torch.Tensor | None = None,
                        paths: Iterable[tuple[str, int, int]] = ()) -> torch.Tensor:
        """x ``[B, T, D]`` (token embeddings) -> logits ``[B, T, V]``; arguments as :meth:`forward`."""
        cfg = self.cfg
        T = x.shape[1]
        cos, sin = rope_cos_sin(torch.arange(T, device=x.device), cfg.head_dim, cfg.rope_base, x.dtype)
        allowed = causal_mask(T, device=x.device) if allowed is None else allowed
        ablate, paths = set(ablate), set(paths)
        if not {kind for kind, _, _ in paths} <= {"q", "k", "v"}:
            raise ValueError(f"path kinds are 'q', 'k', 'v', got {paths}")
        missing: dict[str, torch.Tensor] = {}  # "q", "k" or "v" -> what that stream lacks [B, T, D]

        def heads(li: int, chosen) -> torch.Tensor:  # [H]: 1.0 on the chosen heads of layer li
            return torch.tensor([1.0 if chosen(h) else 0.0 for h in range(cfg.n_heads)],
                                dtype=x.dtype, device=x.device)

        for li, layer in enumerate(self.layers):
            keep = heads(li, lambda j: (li, j) not in ablate) if any(a[0] == li for a in ablate) else None
            h = F.rms_norm(x, (cfg.d_model,), layer.attn_norm)
            h_q, h_k, h_v = (F.rms_norm(x - missing[kind], (cfg.d_model,), layer.attn_norm)
                             if kind in missing else h for kind in "qkv")
            args = (layer.w_qkv, layer.w_o, cfg.n_heads, cfg.kv_heads, cos, sin, allowed)
            k_v = (None if h_k is h_q else h_k, None if h_v is h_q else h_v)  # None: read h_q
            y, weights = attention_block(h_q, *args, keep, *k_v)
            for kind in "qkv" if paths else ():  # the output of the heads cut from this kind's path
                cut = heads(li, lambda j: (kind, li, j) in paths)
                if cut.any():
                    y_cut, _ = attention_block(h_q, *args, cut if keep is None else cut * keep, *k_v)
                    missing[kind] = (missing[kind] + y_cut) if kind in missing else y_cut
            if record is not None:
                record.append(weights.detach())
            x = x + y
            if cfg.d_ff:
                h = F.rms_norm(x, (cfg.d_model,), layer.mlp_norm)
                x = x + swiglu(h, layer.w_gate, layer.w_up, layer.w_down)
        return F.rms_norm(x, (cfg.d_model,), self.final_norm) @ self.unembed


def per_position_loss(model: TinyTransformer, tokens: torch.Tensor, **kwargs) -> torch.Tensor:
    """tokens ``[B, T]`` -> ``[B, T-1]``: the loss of position t predicting token t + 1 (nats)."""
    logits = model(tokens, **kwargs)
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), tokens[:, 1:], reduction="none")


def lm_loss(model: TinyTransformer, tokens: torch.Tensor, **kwargs) -> torch.Tensor:
    """Next-token loss of ``model`` on ``tokens`` ``[B, T]``: positions 0..T-2 predict 1..T-1."""
    logits = model(tokens, **kwargs)
    return causal_lm_loss(logits[:, :-1], tokens[:, 1:])


def train(model: TinyTransformer, steps: int = 250, batch: int = 64, m_range: tuple[int, int] = (4, 10),
          lr: float = 1e-2, seed: int = 0, warmup: int = 20, final_lr: float = 0.3,
          eval_tokens: torch.Tensor | None = None, eval_every: int = 5) -> dict[str, list]:
    """Train ``model`` on fresh repeated sequences every step: AdamW (no weight decay), ``warmup``
    steps of linear warm-up, then a cosine from ``lr`` down to ``final_lr * lr``. Each step draws
    m uniformly from ``m_range`` (so that only copying by content, not a fixed offset, predicts the
    second half) and ``batch`` sequences of length 2m, from a generator seeded with ``seed``.

    Returns ``{"loss": [...]}`` (the training loss of every step) and, when ``eval_tokens``
    ``[B, 2m]`` is given, every ``eval_every`` steps its mean loss over the positions predicting the
    first half, the second half and all: ``"eval_step", "eval_first", "eval_second", "eval_all"``."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)

    def schedule(s: int) -> float:
        cosine = 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
        return min(1.0, (s + 1) / warmup) * (final_lr + (1 - final_lr) * cosine)

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    hist: dict[str, list] = {"loss": [], "eval_step": [], "eval_first": [], "eval_second": [], "eval_all": []}

    def evaluate(step: int) -> None:
        m = eval_tokens.shape[1] // 2
        with torch.no_grad():
            per = per_position_loss(model, eval_tokens)  # [B, 2m - 1]: position t predicts token t + 1
        hist["eval_step"].append(step)
        hist["eval_first"].append(per[:, : m - 1].mean().item())
        hist["eval_second"].append(per[:, m:].mean().item())
        hist["eval_all"].append(per.mean().item())

    for step in range(steps):
        if eval_tokens is not None and step % eval_every == 0:
            evaluate(step)
        m = int(torch.randint(m_range[0], m_range[1] + 1, (), generator=g))
        loss = lm_loss(model, repeated_sequences(batch, m, model.cfg.vocab, g).to(model.embed.device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        hist["loss"].append(loss.item())
    if eval_tokens is not None:
        evaluate(steps)
    return hist
