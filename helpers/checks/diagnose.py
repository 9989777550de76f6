"""Facts about a wrong answer, found by comparing it with the expected one.

When no known mistake matches, a check still says *what* is wrong, as a fact about the output and
never as a guessed cause: "every entry is 0.125 times the expected one", "your rows sum to 0.73 to
1.41, not 1", "only entries with key j > query i differ", "the right values in the wrong places
along axis 1". Each test is cheap (the checks' cases are small) and runs only on plain data: dense
float64 tensors of the expected shape, or plain numbers, after the core has turned what the learner
returned into that. The first fact that holds is reported.

Facts found on one case are facts about that case. What the core concludes across cases (a factor
of the exercise that explains every failing count, :func:`factor_facts`) is said only when it holds
in all of them, so that a coincidence on one case names nothing.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from fractions import Fraction

import torch

from .guard import _float64, _isclose, _isfinite

_MAX_PERMUTED = 64  # longest axis searched for a permutation
_MAX_REARRANGE_TRIES = 4000  # views x permutations tried by _rearranged
_MAX_REARRANGE_NUMEL = 200_000


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
    regions = {"above the diagonal of the last two axes (column j > row i)": j > i + offset,
               "on the diagonal of the last two axes (column j = row i)": j == i + offset,
               "below the diagonal of the last two axes (column j < row i)": j < i + offset}
    where = bad.reshape(-1, T_q, T_k).any(0)
    hit = [name for name, region in regions.items() if bool((where & region).any())]
    if len(hit) == 1:
        return f"every wrong entry lies {hit[0]}."
    return ""


def _sizes(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(n) for n in shape) + "]"


def _order_text(perm: Sequence[int], shape: Sequence[int]) -> str:
    """How ``perm`` moves the axes of ``shape``: 'axes 0 and 1 (sizes 2 and 5) exchanged' or
    'the axes in the order [2, 0, 1, 3]'."""
    moved = [i for i, p in enumerate(perm) if p != i]
    if len(moved) == 2:
        i, j = moved
        if len({shape[i], shape[j]}) == 2:
            return f"axes {i} and {j} (sizes {shape[i]} and {shape[j]}) exchanged"
        return f"axes {i} and {j} exchanged"
    return f"the axes in the order {list(perm)}"


def _views(shape: tuple[int, ...]):
    """(description, view shape) of ``shape`` as it is, and with one axis split in two factors."""
    yield "", shape
    for axis, n in enumerate(shape):
        for a in range(2, n):
            if n % a == 0 and n <= 4096:
                yield (f"its axis {axis} (size {n}) split as {a} x {n // a}",
                       shape[:axis] + (a, n // a) + shape[axis + 1:])


def _rearranged(g: torch.Tensor, e: torch.Tensor, atol: float, rtol: float) -> str:
    """``g`` holds exactly ``e``'s values moved: ``e`` (one axis perhaps split in two) with its axes
    permuted, then reshaped to ``g``'s shape. Describes the first (simplest) such move found."""
    if g.numel() != e.numel() or g.numel() < 2 or g.numel() > _MAX_REARRANGE_NUMEL:
        return ""
    tries = 0
    for split, view in _views(tuple(e.shape)):
        if len(view) > 6:
            continue
        ev = e.reshape(view)
        for perm in itertools.permutations(range(len(view))):
            tries += 1
            if tries > _MAX_REARRANGE_TRIES:
                return ""
            identity = list(perm) == list(range(len(view)))
            if identity and (split or tuple(g.shape) == tuple(e.shape)):
                continue
            moved = ev.permute(perm)
            direct = tuple(moved.shape) == tuple(g.shape)
            if not _close(moved.reshape(g.shape), g, atol, rtol):
                continue
            if identity:
                return (f"your output holds the expected values in the expected order, in the shape "
                        f"{_sizes(g.shape)} instead of {_sizes(e.shape)}: reshape it (or fix the shape you "
                        "reshape to).")
            if direct and not split:
                return (f"your output is the expected one with {_order_text(perm, view)}: "
                        + ("transpose those two axes." if sum(p != i for i, p in enumerate(perm)) == 2
                           else "permute the axes into the expected order."))
            where = f"the expected output {_sizes(e.shape)}" + (f", {split}," if split else "")
            return (f"your output holds exactly the expected values in other places: {where} with "
                    f"{_order_text(perm, view)}, then reshaped to {_sizes(g.shape)}, is yours. A view or "
                    "reshape never moves an axis: exchange axes with transpose/permute (before a reshape), "
                    "and check which axes you exchanged.")
    return ""


def _shifted(g: torch.Tensor, e: torch.Tensor, atol: float, rtol: float) -> str:
    """Along one axis, position i of ``g`` holds position i - 1 (or i + 1) of ``e``."""
    for axis in range(e.dim()):
        n = e.shape[axis]
        if n < 3:
            continue
        for k in (1, -1):
            src = e.narrow(axis, 0, n - 1) if k == 1 else e.narrow(axis, 1, n - 1)
            dst = g.narrow(axis, 1, n - 1) if k == 1 else g.narrow(axis, 0, n - 1)
            if _close(dst, src, atol, rtol):
                edge = 0 if k == 1 else n - 1
                edge_ok = _close(g.narrow(axis, edge, 1), e.narrow(axis, edge, 1), atol, rtol)
                return (f"along axis {axis} (size {n}), your position i holds the expected position "
                        f"i {'-' if k == 1 else '+'} 1 (everything moved by one place; position {edge} "
                        f"{'is right too' if edge_ok else 'differs'}).")
    return ""


def _power(g: torch.Tensor, e: torch.Tensor, atol: float, rtol: float) -> str:
    for text, f in (("the square of", lambda x: x * x), ("the square root of", lambda x: x.abs().sqrt()),
                    ("the reciprocal of", lambda x: 1 / x), ("the exponential of", torch.exp),
                    ("the logarithm of", lambda x: x.abs().log())):
        with torch.no_grad():
            m = f(e)
        if bool(_isfinite(m).all()) and not _close(m, e, atol, rtol) and _close(g, m, atol, rtol):
            return f"every entry is {text} the expected one."
    return ""


def name_factor(value: float, factors: Mapping[str, float] | None) -> str:
    """' (= 1/sqrt(d_k), d_k = 16 here)' when ``value`` is a simple function of one (or a ratio of
    two) of the exercise's named quantities; '' otherwise. Several matches are all listed."""
    if not factors:
        return ""
    named = [(k, float(v)) for k, v in factors.items() if v and float(v) > 0 and abs(float(v) - 1) > 1e-9]
    forms = []
    for k, v in named:
        forms += [(f"{k}", v), (f"1/{k}", 1 / v), (f"sqrt({k})", math.sqrt(v)), (f"1/sqrt({k})", 1 / math.sqrt(v))]
    for (k1, v1), (k2, v2) in itertools.permutations(named, 2):
        if abs(v1 - v2) > 1e-9:
            forms += [(f"{k1}/{k2}", v1 / v2), (f"sqrt({k1}/{k2})", math.sqrt(v1 / v2))]
    hits = [name for name, x in forms if abs(x - value) <= 1e-6 * abs(value)]
    if not hits:
        return ""
    values = ", ".join(f"{k} = {_g(v)}" for k, v in named if any(k in h for h in hits[:3]))
    return f" (= {' or '.join(hits[:3])}, with {values} here)"


def _precision(g: torch.Tensor, e: torch.Tensor, dtype: torch.dtype | None) -> str:
    """Right to a lower precision than the expected dtype's, with rounding-like errors: small, of
    both signs, and not one factor (for the whole output or per row); a fact, not a cause."""
    err = ((g - e).abs() / (e.abs() + 1e-3 * float(e.abs().max()))).max().item()
    if dtype not in (torch.float32, torch.float64) or not 0 < err < 1.5e-2 or (dtype is torch.float32 and err < 2e-5):
        return ""
    diff = g - e
    off = diff.abs() > 0.1 * diff.abs().max()
    up, down = int((off & (diff > 0)).sum()), int((off & (diff < 0)).sum())
    if min(up, down) < max(2, (up + down) // 5):  # errors of one sign: a bias (an epsilon, a factor), not rounding
        return ""
    digits = max(1, round(-math.log10(err)))
    if err > 2e-5:
        return (f"your values agree with the expected ones only to about {digits} significant digits, with errors of "
                f"both signs up to {_g(err)} (relative): the size of float16 or bfloat16 rounding. If you cast to a "
                f"smaller dtype anywhere, compute in the inputs' dtype ({str(dtype).removeprefix('torch.')}) instead.")
    if dtype is torch.float64 and err > 1e-13:
        return (f"your values agree with the expected ones to about {digits} significant digits, with errors of both "
                f"signs up to {_g(err)} (relative): the size of float32 rounding. If you cast to float32 anywhere, "
                "compute in float64, the inputs' dtype, instead.")
    return ""


def tensor_facts(got: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float,
                 factors: Mapping[str, float] | None = None, dtype: torch.dtype | None = None) -> str:
    """One fact that explains how ``got`` differs from ``expected`` (same shape), or ''.
    ``factors`` (words -> value) name the exercise's quantities, to say what a constant factor is;
    ``dtype`` is the dtype the answer should be computed in."""
    g, e = got.detach().to(_float64), expected.detach().to(_float64)
    finite = _isfinite(e)
    if not bool(finite.all()) or not bool(_isfinite(g).all()):
        return ""
    if not bool(g.any()) and bool(e.any()):
        return "your output is all zeros."
    if _close(g, -e, atol, rtol):
        return "your output is the expected one with its sign flipped."
    scale = float((g * e).sum() / (e * e).sum()) if bool(e.any()) else 0.0
    if bool(e.any()) and abs(scale - 1) > 1e-3 and _close(g, scale * e, atol, rtol):
        return (f"every entry is {_g(scale)}{name_factor(scale, factors)} times the expected one (one factor for "
                "the whole output).")
    rearranged = _rearranged(g, e, atol, rtol)
    if rearranged:
        return rearranged
    if g.numel() > 1:
        shift = float((g - e).mean())
        if abs(shift) > atol and _close(g, e + shift, atol, rtol):
            return f"every entry is off by the same amount, {_g(shift)}{name_factor(abs(shift), factors)}."
    power = _power(g, e, atol, rtol)
    if power:
        return power
    if _is_weights(e, atol):
        sums = g.sum(-1)
        if not bool(((sums - 1).abs() < 1e-3).logical_or(sums.abs() < 1e-6).all()):
            for axis in range(e.dim() - 1):
                if e.shape[axis] > 1 and bool(((g.sum(axis) - 1).abs() < 1e-3).all()):
                    what = " (the queries)" if axis == e.dim() - 2 else ""
                    return (f"your weights sum to 1 over axis {axis} (size {e.shape[axis]}){what}, not over the last "
                            "axis (the keys): normalise with dim=-1.")
            return (f"your rows sum to {_g(float(sums.min()))} to {_g(float(sums.max()))}, not 1: the weights are not "
                    "normalised over the last axis (the keys).")
        if bool((g < -atol).any()):
            return "some of your weights are negative: each row should be a probability distribution."
    for axis in range(e.dim() - 1, -1, -1):
        n = e.shape[axis]
        if n < 2 or not bool(e.any()):
            continue
        dims = [d for d in range(e.dim()) if d != axis]
        num = (g * e).sum(dims, keepdim=True) if dims else g * e
        den = (e * e).sum(dims, keepdim=True) if dims else e * e
        if not bool((den > 0).all()):
            continue
        per = num / den
        if _close(g, per * e, atol, rtol) and not _close(per, torch.ones_like(per), 1e-3, 0):
            ok = (per - 1).abs().flatten() < 1e-3
            right = [i for i in range(n) if bool(ok[i])]
            tail = f"; positions {ranges_text(right)} are right" if right else ""
            return (f"along axis {axis} (size {n}), each position is the expected one times a factor of its own, "
                    f"from {_g(float(per.min()))} to {_g(float(per.max()))}{tail}.")
    if e.dim() >= 1 and e.shape[-1] > 1 and bool(e.any(-1).all()):
        ratio = g / torch.where(e == 0, torch.ones_like(e), e)
        per_row = ratio[..., :1]
        zero_one = bool(((per_row.abs() < 1e-9) | ((per_row - 1).abs() < 1e-9)).all())
        if not zero_one and _close(g, per_row * e, atol, rtol) and not _close(per_row, torch.ones_like(per_row), 1e-3, 0):
            return (f"each row (last axis) is the expected row times a factor of its own, from "
                    f"{_g(float(per_row.min()))} to {_g(float(per_row.max()))}.")
    precision = _precision(g, e, dtype)
    if precision:
        return precision
    shifted = _shifted(g, e, atol, rtol)
    if shifted:
        return shifted
    permuted = _permutation(g, e, atol, rtol)
    if permuted:
        return permuted
    bad = ~_isclose(g, e, atol=atol, rtol=rtol)
    for wrong, text in ((bad & (e == 0), "nonzero at {n} entries where 0 is expected"),
                        (bad & (g == 0), "0 at {n} entries where a nonzero value is expected")):
        if bool(wrong.any()):
            where = _where_on_the_diagonal(wrong)
            rest = "" if bool((wrong == bad).all()) else f" (and {int(bad.sum()) - int(wrong.sum())} more entries differ)"
            where = where or _right_positions(bad, e.shape)
            return f"your output is {text.format(n=int(wrong.sum()))}{rest}" + (f"; {where}" if where else ".")
    diagonal = _where_on_the_diagonal(bad)
    if diagonal:
        return diagonal
    return _right_positions(bad, e.shape)


def _right_positions(bad: torch.Tensor, shape: Sequence[int]) -> str:
    """'along axis 1 (size 3), positions 0 are right and 1..2 differ', for the axes where that holds."""
    parts = []
    for axis in range(len(shape)):
        n = shape[axis]
        right = [i for i in range(n) if not bool(bad.select(axis, i).any())]
        if 0 < len(right) < n:
            wrong = [i for i in range(n) if i not in right]
            parts.append(f"along axis {axis} (size {n}), positions {ranges_text(right)} are right and "
                         f"{ranges_text(wrong)} differ")
    if not parts:
        return ""
    return "; ".join(parts[:2]) + "."


def nonfinite_facts(got: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float) -> str:
    """Where the NaN/inf of ``got`` are (``expected`` finite there), and whether the rest is right."""
    g, e = got.detach().to(_float64), expected.detach().to(_float64)
    bad = ~_isfinite(g) & _isfinite(e)
    if not bool(bad.any()) or bad.dim() == 0:
        return ""
    n = int(bad.sum())
    rest = ~bad
    rest_ok = bool(_isclose(g[rest], e[rest], atol=atol, rtol=rtol, equal_nan=True).all()) if bool(rest.any()) else False
    where = []
    for axis in range(bad.dim()):
        hit = [i for i in range(bad.shape[axis]) if bool(bad.select(axis, i).any())]
        if len(hit) < bad.shape[axis]:
            where.append(f"position{'s' * (len(hit) > 1)} {ranges_text(hit)} of axis {axis} (size {bad.shape[axis]})")
    text = f"{n} of {bad.numel()} entries are NaN or inf" + (f", all at {' and '.join(where[:3])}." if where else ".")
    if rest_ok:
        text += (" All the other entries are right: look for exp of a large number (subtract the row's maximum "
                 "first), 0 * inf, inf - inf or log(0) on those entries only.")
    return text


def shape_facts(got: tuple[int, ...], expected: tuple[int, ...]) -> str:
    """A fact about a wrong shape: the same axes in another order, or the right number of entries."""
    got, expected = tuple(got), tuple(expected)
    if sorted(got) == sorted(expected) and len(set(expected)) == len(expected):
        order = [expected.index(n) for n in got]
        return f"your output has the expected axes in another order: axis {order} of the expected shape."
    if torch.Size(got).numel() == torch.Size(expected).numel():
        return "your output has the right number of entries, arranged in another shape."
    return ""


def shape_value_facts(got: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float) -> str:
    """A fact about an output of the wrong shape, from its values: the expected values moved or
    reshaped, or the expected output with positions missing or added along one axis."""
    g, e = got.detach().to(_float64), expected.detach().to(_float64)
    if not bool(_isfinite(g).all()) or not bool(_isfinite(e).all()):
        return shape_facts(g.shape, e.shape)
    moved = _rearranged(g, e, atol, rtol)
    if moved:
        return moved
    if g.dim() == e.dim():
        diff = [a for a in range(e.dim()) if g.shape[a] != e.shape[a]]
        if len(diff) == 1:
            a = diff[0]
            m, n = g.shape[a], e.shape[a]
            small, big = (g, e) if m < n else (e, g)
            k = abs(n - m)
            for off, side in ((0, "last"), (big.shape[a] - small.shape[a], "first")):
                if _close(big.narrow(a, off, small.shape[a]), small, atol, rtol):
                    if m < n:
                        return (f"your output is the expected one without its {side} {k} position{'s' * (k > 1)} along "
                                f"axis {a} (size {m} instead of {n}).")
                    return (f"your output is the expected one with {k} extra position{'s' * (k > 1)} at the "
                            f"{'end' if side == 'last' else 'start'} of axis {a} (size {m} instead of {n}); the rest "
                            "is right.")
            return f"axis {a} has size {m} instead of {n}; the other axes are right."
    return shape_facts(g.shape, e.shape)


def factor_facts(failures: Sequence[tuple[float, float, Mapping[str, float]]]) -> str:
    """Over every failing case of a count or formula together: is got / expected (or got - expected)
    the same simple number, or the same named quantity of the exercise, in all of them? ``failures``
    holds (got, expected, {words: this case's value}). '' unless one explanation holds in every case."""
    if not failures or any(not (math.isfinite(g) and math.isfinite(e)) or e == 0 for g, e, _ in failures):
        return ""
    n = len(failures)
    cases = "in every failing case" if n > 1 else "here"

    def same(values: list[float], targets: list[float]) -> bool:
        return all(abs(v - t) <= 1e-9 * max(abs(t), 1e-300) for v, t in zip(values, targets))

    ratios = [g / e for g, e, _ in failures]
    diffs = [g - e for g, e, _ in failures]
    names = set.intersection(*(set(f) for _, _, f in failures)) if failures else set()
    hits = []
    for k in sorted(names):
        vals = [float(f[k]) for _, _, f in failures]
        if any(v in (0, 1) for v in vals):
            continue
        for text, targets, got_values in (
                (f"your number is the expected one times {k}", vals, ratios),
                (f"your number is the expected one divided by {k}", [1 / v for v in vals], ratios),
                (f"your number is {k} more than the expected one", vals, diffs),
                (f"your number is {k} less than the expected one", [-v for v in vals], diffs)):
            if same(got_values, targets):
                hits.append((text, vals))
    if hits:
        text, vals = hits[0]
        also = f" (or: {hits[1][0].removeprefix('your number is ')})" if len(hits) > 1 else ""
        shown = f"{_g(vals[0])}" if n == 1 else ", ".join(_g(v) for v in vals[:4])
        return f"{text} ({shown} {cases}){also}."
    if n > 1 and same(ratios, [ratios[0]] * n) and abs(ratios[0] - 1) > 1e-9:
        fr = Fraction(ratios[0]).limit_denominator(64)
        text = f"{fr.numerator}/{fr.denominator}" if abs(float(fr) - ratios[0]) < 1e-9 * abs(ratios[0]) and \
            fr.denominator > 1 else _g(ratios[0])
        return f"your number is {text} times the expected one {cases}."
    if n > 1 and same(diffs, [diffs[0]] * n):
        return f"your number is off by {_g(diffs[0])} {cases}."
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
