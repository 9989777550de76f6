"""A tiny decoder-only transformer, trained on a CPU, in which induction heads appear (notebook 11).

Built from the course's own pieces: head split and merge, the causal mask and masked softmax
(:mod:`helpers.nb01_qkv_shapes`), RoPE (:mod:`helpers.nb10_positions`), and grouped-query attention's
``repeat_kv`` (:mod:`helpers.nb06_kv_sharing`) when there are fewer key/value heads than query heads.
The circuits section reads it: each head's direct logit attribution, and the Q-, K- and
V-composition scores of its heads' weights (Elhage et al., 2021) against random matrices.
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

__all__ = ["swiglu", "causal_lm_loss", "induction_scores", "k_composition_score"]


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


def composition_score(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``||a @ b||_F / (||a||_F ||b||_F)`` over the last two axes (the others broadcast):
    a ``[..., D, D]``, b ``[..., D, D]`` -> ``[...]``. Between 0 and 1 (Cauchy-Schwarz)."""
    norm = torch.linalg.matrix_norm  # Frobenius by default
    return norm(a @ b) / (norm(a) * norm(b))


def k_composition_score(w_qk: torch.Tensor, w_ov: torch.Tensor) -> float:
    """K-composition score of an earlier head's OV circuit into a later head's QK circuit
    (Elhage et al., 2021), in row-vector form (exercise 11.4).

    w_qk ``[D, D]``: the later head's query-key circuit, ``score(i, j) = x_i @ w_qk @ x_j.T`` for
    residual rows x_i (query) and x_j (key), i.e. ``W_Q @ W_K.T``; w_ov ``[D, D]``: the earlier
    head's output-value circuit, the head writes ``x @ w_ov`` (``W_V @ W_O``) into the residual.
    The keys read ``x_j + x_src @ w_ov``, so the part of the score that goes through the earlier
    head is ``x_i @ w_qk @ w_ov.T @ x_src.T``: returns ``||w_qk @ w_ov.T||_F / (||w_qk||_F
    ||w_ov||_F)`` as a Python float in [0, 1]."""
    for name, w in (("w_qk", w_qk), ("w_ov", w_ov)):
        if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.shape[0] != w.shape[1]:
            raise ValueError(f"{name} must be a square [D, D] tensor, got {_shape_of(w)}")
    if w_qk.shape != w_ov.shape:
        raise ValueError(f"w_qk and w_ov must have the same shape [D, D], got {list(w_qk.shape)} "
                         f"and {list(w_ov.shape)}")
    if not (w_qk.norm() > 0 and w_ov.norm() > 0):
        raise ValueError("the score divides by ||w_qk||_F ||w_ov||_F: neither matrix may be all zeros")
    return composition_score(w_qk, w_ov.T).item()


def _shape_of(w) -> str:
    return f"shape {list(w.shape)}" if isinstance(w, torch.Tensor) else f"a {type(w).__name__}"


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

    ``forward(tokens, record=None, ablate=(), allowed=None, paths=(), record_heads=None)``: tokens ``[B, T]`` -> logits
    ``[B, T, V]``. A list passed as ``record`` receives each layer's attention weights
    ``[B, H, T, T]`` (the hook that notebook 11 reads heads with); ``ablate`` is a collection of
    ``(layer, head)`` pairs whose output is zeroed before W_O; ``allowed`` ``[T, T]`` replaces the
    causal mask (to test what a broken mask does); ``paths`` is a collection of
    ``(kind, layer, head)``, kind one of ``"q", "k", "v"``: that head's output is left out of the
    residual stream from which every later layer computes its queries, keys or values, and only
    those (a path ablation: the rest of the model still sees it). A list passed as ``record_heads``
    receives each layer's head outputs ``[B, H, T, D]``: head h's output through its rows of W_O
    (the H of them sum to what the layer adds to the residual stream). :meth:`from_embeddings`
    starts from x ``[B, T, D]``.
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
                allowed: torch.Tensor | None = None, paths: Iterable[tuple[str, int, int]] = (),
                record_heads: list | None = None) -> torch.Tensor:
        return self.from_embeddings(self.embed[tokens], record, ablate, allowed, paths, record_heads)

    def from_embeddings(self, x: torch.Tensor, record: list | None = None, ablate: Iterable[tuple[int, int]] = (),
                        allowed: torch.Tensor | None = None,
                        paths: Iterable[tuple[str, int, int]] = (),
                        record_heads: list | None = None) -> torch.Tensor:
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
            if record_heads is not None:  # one head at a time: the others' keep set to 0
                ones = torch.ones(cfg.n_heads, dtype=x.dtype, device=x.device) if keep is None else keep
                one_hot = torch.eye(cfg.n_heads, dtype=x.dtype, device=x.device) * ones
                record_heads.append(torch.stack([attention_block(h_q, *args, one_hot[j], *k_v)[0]
                                                 for j in range(cfg.n_heads)], dim=1).detach())
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


# --------------------------------------------------------------------------- circuits


def rope_rotation(offset: int, d: int, base: float = 10000.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[d, d]``: the matrix R with ``rope(q, i) @ rope(k, j).T = q @ R @ k.T`` when i - j = offset
    (rows q, k ``[d]``): RoPE's rotation by the query's position times the inverse of the key's."""
    cos, sin = rope_cos_sin(torch.tensor([offset, 0]), d, base, torch.float64)
    eye = torch.eye(d, dtype=torch.float64)
    rot_q, rot_k = apply_rope(eye, cos[:1], sin[:1]), apply_rope(eye, cos[1:], sin[1:])
    return (rot_q @ rot_k.T).to(dtype)


def circuit_matrices(model: TinyTransformer, layer: int, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's circuits, in row-vector form, with the layer's RMSNorm scale g folded in:
    ``(w_qk [H, D, D], w_ov [H, D, D])``. Head h's ``w_qk = diag(g) W_Q^h R(offset) W_K^h.T diag(g)``
    (``score(i, j) = x_i @ w_qk @ x_j.T`` up to the 1/sqrt(d_k) and the norms' 1/rms, for i - j =
    offset), ``w_ov = diag(g) W_V^h W_O^h`` (the head writes ``x @ w_ov`` where it attends);
    W_Q^h, W_K^h, W_V^h ``[D, d_k]`` (GQA: query head h reads key/value head h // (H / H_kv)),
    W_O^h ``[d_k, D]``, R ``[d_k, d_k]`` from :func:`rope_rotation`."""
    cfg = model.cfg
    lay = model.layers[layer]
    H, H_kv, d_k = cfg.n_heads, cfg.kv_heads, cfg.head_dim
    with torch.no_grad():
        w = lay.attn_norm[:, None] * lay.w_qkv  # [D, (H + 2 H_kv) d_k]: the norm's scale folded in
        w_q, w_k, w_v = w.split([H * d_k, H_kv * d_k, H_kv * d_k], dim=1)
        kv = torch.arange(H) // (H // H_kv)  # [H]: the key/value head each query head reads
        w_q = w_q.view(-1, H, d_k).transpose(0, 1)  # [H, D, d_k]
        w_k, w_v = (m.view(-1, H_kv, d_k).transpose(0, 1)[kv] for m in (w_k, w_v))
        w_o = lay.w_o.view(H, d_k, -1)  # [H, d_k, D]
        rot = rope_rotation(offset, d_k, cfg.rope_base, w.dtype)
        return w_q @ rot @ w_k.transpose(1, 2), w_v @ w_o


def composition_scores(model: TinyTransformer, offsets: Iterable[int] = (0,), writer: int = 0,
                       reader: int = 1) -> dict[str, torch.Tensor]:
    """Q-, K- and V-composition scores of every head of layer ``writer`` (its OV circuit) into
    every head of layer ``reader``: ``{"q", "k", "v": [H, H]}``, entry [i, j] for writer head i
    and reader head j. K: ``||w_qk_j @ w_ov_i.T||`` (:func:`k_composition_score`), Q: ``||w_ov_i
    @ w_qk_j||``, V: ``||w_ov_i @ w_ov_j||``, each over the product of the two norms. Q and K are
    averaged over the relative ``offsets`` (query position - key position) of the reader's RoPE."""
    _, w_ov = circuit_matrices(model, writer)
    _, w_ov_reader = circuit_matrices(model, reader)
    a = w_ov[:, None]  # [H, 1, D, D]: writer heads along the rows
    q, k = [], []
    for offset in offsets:
        w_qk = circuit_matrices(model, reader, offset)[0][None]  # [1, H, D, D]
        q.append(composition_score(a, w_qk))
        k.append(composition_score(w_qk, a.transpose(-1, -2)))
    return {"q": torch.stack(q).mean(0), "k": torch.stack(k).mean(0),
            "v": composition_score(a, w_ov_reader[None])}


def random_composition_scores(d_model: int, d_head: int, n: int, generator: torch.Generator) -> torch.Tensor:
    """``[n]``: :func:`k_composition_score` of n pairs of random matrices shaped like one head's:
    ``w_qk = A @ B.T`` and ``w_ov = C @ E``, A, B, C ``[D, d_k]`` and E ``[d_k, D]`` standard
    Gaussian (rank d_k like a head's; the score does not depend on the matrices' scale)."""
    a, b, c = torch.randn(3, n, d_model, d_head, generator=generator, dtype=torch.float64)
    e = torch.randn(n, d_head, d_model, generator=generator, dtype=torch.float64)
    return composition_score(a @ b.transpose(1, 2), (c @ e).transpose(1, 2)).float()


def direct_logit_attribution(model: TinyTransformer, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each component's direct contribution to the logit of the right next token, at every
    position: tokens ``[B, T]`` -> ``(embedding [B, T-1], heads [L, H, B, T-1])``.

    The final residual stream is the embedding plus every head's output (no MLPs here). Its
    RMSNorm divides by the stream's rms at each position: that divisor is frozen at its value in the
    real forward pass, so the norm is linear and the logits split into one term per component:
    ``(component / rms * g) @ U_c[:, next token]``. ``U_c`` is the unembedding with its mean over the
    vocabulary removed from each row, so that the terms add up to the logit minus the mean logit
    (softmax cannot tell the two apart; TransformerLens's ``center_unembed``)."""
    if model.cfg.d_ff:
        raise ValueError("direct_logit_attribution handles attention-only models (d_ff = 0)")
    heads: list[torch.Tensor] = []
    with torch.no_grad():
        model(tokens, record_heads=heads)
        by_head = torch.stack(heads).transpose(1, 2).flatten(0, 1)  # [L H, B, T, D], layer-major
        parts = torch.cat([model.embed[tokens][None], by_head])  # [1 + L H, B, T, D]
        x = parts.sum(dim=0)  # [B, T, D]: the final residual stream
        eps = torch.finfo(x.dtype).eps  # F.rms_norm's default
        inv_rms = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)  # [B, T, 1], frozen
        u = model.unembed - model.unembed.mean(dim=1, keepdim=True)  # [D, V]
        direction = u.T[tokens[:, 1:]] * model.final_norm  # [B, T-1, D]: g * U_c[:, next token]
        dla = ((parts[:, :, :-1] * inv_rms[:, :-1]) * direction).sum(dim=-1)  # [C, B, T-1]
    L, H = model.cfg.n_layers, model.cfg.n_heads
    return dla[0], dla[1:].view(L, H, *dla.shape[1:])
