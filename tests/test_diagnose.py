"""Diagnosis by property (issue 32): the facts a check states when no mistake is named, and the rule
that a mistake is named only when its model explains every comparison of the check.

The facts are tried on outputs made wrong on purpose in each kind the issue lists (axes moved,
reshapes of a transpose, shifts, factors, powers, normalisation over another axis, precision, NaN),
and on right ones, where nothing may be said."""

from __future__ import annotations

import pytest
import torch

from helpers.checks import EXERCISES, CheckFailed, core
from helpers.checks.diagnose import factor_facts, nonfinite_facts, shape_value_facts, tensor_facts
from helpers.checks.feedback import Mistake

B, H, T, D_K = 2, 3, 5, 4


def _o() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(B, H, T, D_K, generator=g, dtype=torch.float64)


def _merged(o):
    return o.transpose(1, 2).reshape(B, T, H * D_K)


def _weights():
    g = torch.Generator().manual_seed(1)
    return torch.softmax(torch.randn(B, H, T, T, generator=g, dtype=torch.float64), -1)


def _fact(got, expected, **kw):
    if got.shape != expected.shape:
        return shape_value_facts(got, expected, 1e-5, 1e-4)
    return tensor_facts(got, expected, 1e-5, 1e-4, **kw)


CASES = [  # (what the wrong answer did, got, expected, words the fact must contain)
    ("heads and batch swapped", lambda: _o().transpose(0, 1), _o, "axes 0 and 1 (sizes 2 and 3) exchanged"),
    ("tokens and width swapped, same sizes", lambda: _weights().transpose(-2, -1), _weights,
     "axes 2 and 3 exchanged"),
    ("heads permuted to the end, then reshaped", lambda: _o().permute(0, 2, 3, 1).reshape(B, T, H * D_K),
     lambda: _merged(_o()), "split as 3 x 4, with axes 2 and 3 (sizes 3 and 4) exchanged"),
    ("reshaped without the transpose", lambda: _o().reshape(B, T, H * D_K), lambda: _merged(_o()),
     "A view or reshape never moves an axis"),
    ("batch and tokens mixed by a permute", lambda: _o().permute(2, 0, 1, 3).reshape(B, T, H * D_K),
     lambda: _merged(_o()), "axes 0 and 1 (sizes 2 and 5) exchanged, then reshaped"),
    ("right values, flattened", lambda: _merged(_o()).reshape(B, -1), lambda: _merged(_o()),
     "in the expected order, in the shape [2, 60]"),
    ("one token too few", lambda: _merged(_o())[:, :-1], lambda: _merged(_o()), "without its last 1 position"),
    ("one token too many", lambda: torch.cat([_merged(_o()), _merged(_o())[:, :1]], 1), lambda: _merged(_o()),
     "1 extra position at the end of axis 1"),
    ("shifted by one token", lambda: torch.cat([_o()[:, :, :1], _o()[:, :, :-1]], 2), _o,
     "position i holds the expected position i - 1"),
    ("reversed tokens", lambda: _o().flip(2), _o, "axis -2 (size 5) is reversed"),
    ("squared", lambda: _o() ** 2, _o, "the square of the expected one"),
    ("a constant factor named by the exercise's quantities", lambda: _o() / 2, _o, "= 1/sqrt(d_k)"),
    ("one factor per head", lambda: _o() * torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64)[:, None, None], _o,
     "along axis 1 (size 3), each position is the expected one times a factor of its own"),
    ("softmax over the queries", lambda: torch.softmax(_weights().log(), -2), _weights,
     "sum to 1 over axis 2 (size 5) (the queries)"),
    ("softmax over the heads", lambda: torch.softmax(_weights().log(), 1), _weights, "sum to 1 over axis 1 (size 3)"),
    ("computed in float16", lambda: _o().to(torch.float16).to(torch.float64), _o,
     "the size of float16 or bfloat16 rounding"),
    ("sign flipped", lambda: -_o(), _o, "sign flipped"),
    ("a constant added", lambda: _o() + 0.5, _o, "off by the same amount, 0.5"),
]


@pytest.mark.parametrize(("got", "expected", "words"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_wrong_output_is_described_by_what_it_does(got, expected, words):
    g, e = got(), expected()
    kw = {"factors": {"d_k": D_K, "T": T}, "dtype": torch.float32} if g.shape == e.shape else {}
    fact = _fact(g, e, **kw)
    assert words in fact, fact


def test_a_right_output_or_an_unrelated_one_gets_no_fact():
    e = _o()
    noise = torch.randn(e.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    assert tensor_facts(noise, e, 1e-5, 1e-4) == ""


def test_nan_is_located_and_the_rest_said_to_be_right():
    w = _weights()
    g = w.clone()
    g[1, 2, 3] = float("nan")
    fact = nonfinite_facts(g, w, 1e-5, 1e-4)
    assert "5 of 150 entries are NaN or inf" in fact and "position 1 of axis 0" in fact
    assert "All the other entries are right" in fact


def test_a_factor_is_named_only_when_it_explains_every_failing_case():
    both = [(8.0, 4.0, {"L": 2, "H": 2}), (12.0, 4.0, {"L": 3, "H": 2})]
    assert factor_facts(both) == "your number is the expected one times L (2, 3 in every failing case)."
    assert "times 2" not in factor_facts([(8.0, 4.0, {"L": 2}), (15.0, 4.0, {"L": 3})])  # no single explanation
    assert factor_facts([(8.0, 4.0, {"L": 2}), (15.0, 4.0, {"L": 3})]) == ""
    assert "or: the expected one times L" in factor_facts([(8.0, 4.0, {"L": 2, "H": 2})])  # both said, none chosen
    assert factor_facts([(9.0, 8.0, {"bs": 4}), (7.0, 6.0, {"bs": 4})]) == "your number is off by 1 in every failing case."


# --------------------------------------------------------------------------- naming across cases


def _trial():
    return core.Trial(EXERCISES["merge_heads"], None, 30.0)


A = Mistake("model-a", "you did A.")


def _concluded(t) -> CheckFailed:
    with pytest.raises(CheckFailed) as info:
        t._conclude()
    return info.value


def test_a_mistake_matching_every_failing_case_is_named():
    t = _trial()
    t.tensor(torch.ones(2), torch.zeros(2), mistakes={A: torch.ones(2)})
    t.tensor(torch.full((2,), 3.0), torch.zeros(2), mistakes={A: torch.full((2,), 3.0)})
    assert "you did A" in str(_concluded(t))


def test_a_mistake_that_coincides_on_one_case_only_is_not_named():
    t = _trial()
    t.tensor(torch.ones(2), torch.zeros(2), mistakes={A: torch.ones(2)})
    t.tensor(torch.full((2,), 3.0), torch.zeros(2), mistakes={A: torch.full((2,), 5.0)})
    error = _concluded(t)
    assert "you did A" not in str(error) and "model-a" not in error.mistake_id


def test_a_case_passed_refutes_a_mistake_whose_model_differs_there():
    t = _trial()
    t.tensor(torch.zeros(2), torch.zeros(2), mistakes={A: torch.ones(2)})  # right, where A would be wrong
    t.tensor(torch.ones(2), torch.zeros(2), mistakes={A: torch.ones(2)})
    assert "you did A" not in str(_concluded(t))


def test_a_mistake_made_with_another_is_not_refuted_where_the_pair_is_named():
    both = Mistake("model-a-and-b", "you did A and B.")
    t = _trial()
    t.tensor(torch.ones(2), torch.zeros(2), mistakes={A: torch.ones(2)})
    t.tensor(torch.full((2,), 3.0), torch.zeros(2), mistakes={A: torch.full((2,), 5.0), both: torch.full((2,), 3.0)})
    assert "you did A." in str(_concluded(t))


def test_counts_are_named_across_cases_too():
    t = _trial()
    t.number(9, 8, integer=True, mistakes={A: 9})
    t.number(6, 6, integer=True, mistakes={A: 7})  # passed where A gives 7
    assert "you did A" not in str(_concluded(t))
    t = _trial()
    t.number(8, 4, integer=True, factors={"the number of layers L": 2})
    t.number(12, 4, integer=True, factors={"the number of layers L": 3})
    assert "times the number of layers L (2, 3 in every failing case)" in str(_concluded(t))


def test_the_cases_after_a_failure_run_quietly_and_only_the_first_failure_is_reported(capsys):
    from helpers import checks

    calls = []

    def wrong(o):
        calls.append(o.shape)
        print("debug print", len(calls))
        return o.reshape(o.shape[0], o.shape[2], -1)  # no transpose: wrong on every case with H > 1

    with pytest.raises(CheckFailed) as info:
        checks.merge_heads(wrong)
    printed = capsys.readouterr().out
    assert len(calls) > 1 and printed.count("debug print") == 1, (len(calls), printed)
    assert info.value.case == str(info.value).split("on case: ")[1].split("\n")[0]


def test_the_remaining_cases_stop_at_their_time_budget():
    t = core.Trial(EXERCISES["merge_heads"], lambda o: o, 30.0)
    t.tensor(torch.ones(2), torch.zeros(2))  # the first failure: the remaining cases run within a budget
    assert t._collect_until - core._monotonic() <= core.COLLECT_S[1]
    t._collect_until = core._monotonic() - 1  # spent
    with pytest.raises(core._StopCollecting):
        t.call(torch.zeros(2))
    with pytest.raises(CheckFailed, match="values differ"):
        t._conclude()


def test_a_call_fed_with_a_wrong_returned_state_weighs_no_mistake():
    """A stateful check (a cache, an allocator) feeds the function what it returned: after a
    failure that state is the learner's wrong one, so the mistake models (computed from the right
    state) can neither name nor refute anything there."""
    t = core.Trial(EXERCISES["merge_heads"], lambda x: x + 1, 30.0)
    out = t.call(torch.zeros(2))
    t.tensor(out, torch.zeros(2), mistakes={A: torch.ones(2)})
    out2 = t.call(out)  # fed the wrong state back
    t.tensor(out2, torch.zeros(2), mistakes={A: torch.full((2,), 5.0)})
    assert "you did A" in str(_concluded(t))
    t = core.Trial(EXERCISES["merge_heads"], lambda x: x + 1, 30.0)
    t.tensor(t.call(torch.zeros(2)), torch.zeros(2), mistakes={A: torch.ones(2)})
    t.tensor(t.call(torch.ones(2)), torch.zeros(2), mistakes={A: torch.full((2,), 5.0)})  # a fresh input refutes
    assert "you did A" not in str(_concluded(t))


def test_a_small_bias_of_one_sign_is_not_called_precision():
    """An epsilon in a denominator moves every weight the same way: no rounding fact is stated."""
    w = _weights()
    logits = w.log()
    eps = torch.exp(logits) / (torch.exp(logits).sum(-1, keepdim=True) + 1e-3)
    fact = tensor_facts(eps, w, 1e-5, 1e-4, dtype=torch.float32)
    assert "rounding" not in fact and "float16" not in fact, fact


def test_a_model_that_changes_nothing_on_the_case_names_nothing():
    """A tight comparison (atol 1e-12) fails a nearly right answer; a mistake whose model is the
    expected output there (the mistake does not show on this case) must not be named."""
    t = _trial()
    e = torch.ones(2, dtype=torch.float64)
    t.tensor(e + 1e-9, e, mistakes={A: e.clone()}, atol=1e-12, rtol=1e-12)
    assert "you did A" not in str(_concluded(t))


def test_a_loose_comparison_matches_models_at_its_own_tolerance():
    """In float16 (tolerance 1e-2) a model computed in float64 still matches a learner whose output
    differs from it by rounding only."""
    t = _trial()
    e = torch.zeros(3, dtype=torch.float16)
    model = torch.tensor([0.5, 0.25, 0.125], dtype=torch.float64)
    got = (model + 3e-3).to(torch.float16)
    t.tensor(got, e, mistakes={A: model}, atol=1e-2, rtol=1e-2)
    assert "you did A" in str(_concluded(t))
