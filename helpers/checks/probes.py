"""Objects a check hands to the learner's function as inputs (``make grade`` sends them to the
notebook's process, whose sandbox holds this module but not the checks or the references)."""

from __future__ import annotations

import math

import torch

from .feedback import describe


class ToyAttention:
    """An attention_fn for the check of 3.6: ``layers`` single-head attention layers with residual
    connections and random weights fixed by ``seed``, x ``[1, T, D]`` -> ``[1, T, D]`` (in x's dtype).

    Scores are masked with ``mask`` (bool ``[T, T]``) before the softmax; ``zero_after_softmax``
    (bool ``[T, T]``) additionally zeroes weights *after* it without renormalising (a denominator
    leak); ``roundoff`` adds a step that cancels exactly on paper but leaves float round-off that
    depends on every position; ``zero_rows`` (bool ``[T]``) sets those output rows to 0 (padded
    positions that depend on nothing); ``leaks`` (``[(i, j, strength), ...]``) adds ``strength *
    x[:, j]`` to output row i: leaks of a known size, added on top of ``offset`` that is removed again
    (``((row + offset) + leak) - offset``: with a large offset, float32 rounds such a leak away and float64
    keeps it); ``center`` first subtracts each position's mean over its features (a change that adds
    the same number to every feature of a position vanishes there). A class, not a closure, so that it travels as
    an argument; its softmax is written out here (the course's masked_softmax is the answer to 3.3)."""

    def __init__(self, mask: torch.Tensor, d_model: int, seed: int, layers: int = 1,
                 zero_after_softmax: torch.Tensor | None = None, roundoff: bool = False,
                 zero_rows: torch.Tensor | None = None, leaks: tuple = (), gain: float = 1.0,
                 center: bool = False, offset: float = 0.0):
        from .core import seeded  # built by the check (the judge), never in the notebook's process

        g = seeded(seed)
        self.seed = seed
        self.mask, self.d_model, self.zero_after_softmax, self.roundoff = mask, d_model, zero_after_softmax, roundoff
        self.zero_rows, self.leaks = zero_rows, tuple(leaks)
        self.center, self.offset = center, offset
        self.gain = gain  # < 1: flatter attention, so that no weight (and no leak through it) is tiny
        self.weights = [gain * torch.randn(d_model, 3 * d_model, generator=g, dtype=torch.float64) / math.sqrt(d_model)
                        for _ in range(layers)]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        T, d_model = self.mask.shape[-1], self.d_model
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != (1, T, d_model) or not x.is_floating_point():
            raise ValueError(f"attention_fn expects a float tensor x of shape [1, {T}, {d_model}], got {describe(x)}")
        if self.center:
            x = x - x.mean(dim=-1, keepdim=True)
        x0 = x
        if self.roundoff:
            c = x.mean(dim=1, keepdim=True)
            x = (x + c) - c
        for w in self.weights:
            q, k, v = (x @ w.to(x.dtype)).split(d_model, dim=-1)
            scores = (q @ k.transpose(-2, -1) / math.sqrt(d_model)).masked_fill(~self.mask, float("-inf"))
            p = torch.softmax(scores, dim=-1)  # every row of the checks' masks allows at least one key
            if self.zero_after_softmax is not None:
                p = p * self.zero_after_softmax
            x = x + p @ v
        if self.leaks:
            x = x.clone()
            for i, j, strength in self.leaks:
                x[:, i] = ((x[:, i] + self.offset) + strength * x0[:, j]) - self.offset
        if self.zero_rows is not None:
            x = x.masked_fill(self.zero_rows[None, :, None], 0.0)
        return x
