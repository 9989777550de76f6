"""Facts about a wrong answer, found by comparing it with the expected one.

When no known mistake matches, a check still says *what* is wrong, as a fact about the output and
never as a guessed cause: "every entry is 0.125 times the expected one", "your rows sum to 0.73 to
1.41, not 1", "only entries with key j > query i differ", "the right values in the wrong places
along axis 1". Each test is cheap (the checks' cases are small) and runs only on plain data: dense
float64 tensors of the expected shape, or plain numbers, after the core has turned what the learner
returned into that. The first fact that holds is reported.
"""

from __future__ import annotations

from fractions import Fraction

import torch

from .guard import _float64, _isclose

_MAX_PERMUTED = 64  # longest axis searched for a permutation


def _close(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float) -> bool:
    return a.shape == b.shape and bool(_isclose(a, b, atol=atol, rtol=rtol, equal_nan=True).all())


def _g(x: float) -> str:
    return f"{x + 0.0:.4g}"


def ranges_text(idx: list[int]) -> str:
    """[0, 1, 2, 5] -> '0..2, 5'."""
    out, start = [], None
    for i, v in enumerate(idx):
        if start is None:
            start = v
        if i + 1 == len(idx) or idx[i + 1] != v + 1:
            out.append(f"{start}" if start == v else f"{start}..{v}")
            start = None
    return ", ".join(out)


def _is_weights(e: torch.Tensor, atol: float) -> bool:
    """Rows (last axis) of non-negative numbers summing to 1 (or 0: nothing allowed)."""
    if e.dim() < 1 or e.shape[-1] < 2 or bool((e < -atol).any()):
        return False
    sums = e.sum(-1)
    return bool(((sums - 1).abs() < 1e-3).logical_or(sums.abs() < 1e-6).all()) and bool(((sums - 1).abs() < 1e-3).any())


def _permutation(g: torch.Tensor, e: torch.Tensor, atol: float, rtol: float) -> str:
    for axis in range(e.dim()):
        n = e.shape[axis]
        if not 1 < n <= _MAX_PERMUTED:
            continue
        source = []
        for i in range(n):
            gi = g.select(axis, i)
            js = [j for j in range(n) if _close(gi, e.select(axis, j), atol, rtol)]
            if len(js) != 1:
                break
            source.append(js[0])
        if len(source) == n and sorted(source) == list(range(n)) and source != list(range(n)):
            name = f"axis {axis - e.dim()} (size {n})"
            if source == list(range(n))[::-1]:
                return f"the right values in the wrong places: {name} is reversed."
            moved = ", ".join(f"{i} holds {j}" for i, j in enumerate(source) if i != j)
            return f"the right values in the wrong places along {name}: position {moved}."
    return ""


def _where_on_the_diagonal(bad: torch.Tensor) -> str:
    """Where the wrong entries of a [..., T_q, T_k] output sit relative to the diagonal."""
    if bad.dim() < 2 or bad.shape[-2] < 2 or bad.shape[-1] < 2:
        return ""
    T_q, T_k = bad.shape[-2:]
    i = torch.arange(T_q)[:, None]
    j = torch.arange(T_k)[None, :]
    offset = T_k - T_q  # a bottom-right aligned causal mask keeps j <= i + offset
    regions = {"above the diagonal (key j > query i)": j > i + offset, "on the diagonal (key j = query i)": j == i + offset,
               "below the diagonal (key j < query i)": j < i + offset}
    where = bad.reshape(-1, T_q, T_k).any(0)
    hit = [name for name, region in regions.items() if bool((where & region).any())]
    if len(hit) == 1:
        return f"every wrong entry lies {hit[0]}."
    return ""


def tensor_facts(got: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float) -> str:
    """One fact that explains how ``got`` differs from ``expected`` (same shape), or ''."""
    g, e = got.detach().to(_float64), expected.detach().to(_float64)
    finite = torch.isfinite(e)
    if not bool(finite.all()) or not bool(torch.isfinite(g).all()):
        return ""
    if not bool(g.any()) and bool(e.any()):
        return "your output is all zeros."
    if _close(g, -e, atol, rtol):
        return "your output is the expected one with its sign flipped."
    scale = float((g * e).sum() / (e * e).sum()) if bool(e.any()) else 0.0
    if bool(e.any()) and abs(scale - 1) > 1e-3 and _close(g, scale * e, atol, rtol):
        return f"every entry is {_g(scale)} times the expected one (one factor for the whole output)."
    if e.dim() >= 2 and e.shape[-1] == e.shape[-2] and _close(g, e.transpose(-2, -1), atol, rtol):
        return "your output is the expected one with its last two axes swapped (transposed)."
    if g.numel() > 1:
        shift = float((g - e).mean())
        if abs(shift) > atol and _close(g, e + shift, atol, rtol):
            return f"every entry is off by the same amount, {_g(shift)}."
    if _is_weights(e, atol):
        sums = g.sum(-1)
        if not bool(((sums - 1).abs() < 1e-3).logical_or(sums.abs() < 1e-6).all()):
            if e.dim() >= 2 and bool(((g.sum(-2) - 1).abs() < 1e-3).all()):
                return "your weights sum to 1 over the second-to-last axis (the queries), not over the last (the keys)."
            return (f"your rows sum to {_g(float(sums.min()))} to {_g(float(sums.max()))}, not 1: the weights are not "
                    "normalised over the last axis (the keys).")
        if bool((g < -atol).any()):
            return "some of your weights are negative: each row should be a probability distribution."
    if e.dim() >= 1 and e.shape[-1] > 1 and bool(e.any(-1).all()):
        ratio = g / torch.where(e == 0, torch.ones_like(e), e)
        per_row = ratio[..., :1]
        if _close(g, per_row * e, atol, rtol) and not _close(per_row, torch.ones_like(per_row), 1e-3, 0):
            return (f"each row (last axis) is the expected row times a factor of its own, from "
                    f"{_g(float(per_row.min()))} to {_g(float(per_row.max()))}.")
    permuted = _permutation(g, e, atol, rtol)
    if permuted:
        return permuted
    bad = ~_isclose(g, e, atol=atol, rtol=rtol)
    for wrong, text in ((bad & (e == 0), "nonzero at {n} entries where 0 is expected"),
                        (bad & (g == 0), "0 at {n} entries where a nonzero value is expected")):
        if bool(wrong.any()):
            where = _where_on_the_diagonal(wrong)
            rest = "" if bool((wrong == bad).all()) else f" (and {int(bad.sum()) - int(wrong.sum())} more entries differ)"
            return f"your output is {text.format(n=int(wrong.sum()))}{rest}" + (f"; {where}" if where else ".")
    diagonal = _where_on_the_diagonal(bad)
    if diagonal:
        return diagonal
    for axis in range(e.dim() - 1):
        n = e.shape[axis]
        right = [i for i in range(n) if not bool(bad.select(axis, i).any())]
        if 0 < len(right) < n:
            wrong = [i for i in range(n) if i not in right]
            return (f"along axis {axis} (size {n}), positions {ranges_text(right)} are right and {ranges_text(wrong)} "
                    "differ.")
    return ""


def shape_facts(got: tuple[int, ...], expected: tuple[int, ...]) -> str:
    """A fact about a wrong shape: the same axes in another order, or the right number of entries."""
    got, expected = tuple(got), tuple(expected)
    if sorted(got) == sorted(expected) and len(set(expected)) == len(expected):
        order = [expected.index(n) for n in got]
        return f"your output has the expected axes in another order: axis {order} of the expected shape."
    if torch.Size(got).numel() == torch.Size(expected).numel():
        return "your output has the right number of entries, arranged in another shape."
    return ""


def number_facts(got: float | int, expected: float | int) -> str:
    """A fact about a wrong number: a simple ratio to the expected one, or its sign."""
    if expected == 0 or got == 0:
        return ""
    if (got < 0) != (expected < 0) and abs(got) == abs(expected):
        return "your number has the wrong sign."
    try:
        ratio = Fraction(got) / Fraction(expected) if isinstance(got, int) and isinstance(expected, int) else \
            Fraction(float(got) / float(expected)).limit_denominator(64)
    except (OverflowError, ValueError, ZeroDivisionError):
        return ""
    if ratio.denominator <= 64 and ratio.numerator <= 64 and ratio != 1 and \
            abs(float(ratio) * float(expected) - float(got)) <= 1e-9 * abs(float(got)):
        text = f"{ratio.numerator}" if ratio.denominator == 1 else f"{ratio.numerator}/{ratio.denominator}"
        return f"your number is exactly {text} times the expected one."
    return ""
