"""Every check passes its reference and rejects every wrong implementation in tests/wrong/
with the hint aimed at that mistake."""

import importlib
import pkgutil

import pytest

import tests.wrong
from helpers import checks, reference
from helpers.checks import EXERCISES, CheckFailed

WRONG = {}
for info in pkgutil.iter_modules(tests.wrong.__path__):
    for name, impls in importlib.import_module(f"tests.wrong.{info.name}").WRONG.items():
        WRONG.setdefault(name, []).extend(impls)


@pytest.fixture(autouse=True)
def _short_time_limit(monkeypatch):
    # A never-returning function must be stopped sooner in tests than the real limit, but not so
    # soon that a correct function on a loaded 2-core machine is cut off.
    from helpers.checks import core, feedback

    monkeypatch.setattr(core, "DEFAULT_TIME_LIMIT_S", 10.0)
    feedback.reset_attempts()  # every test starts as a learner's first attempt (graduated hints)


@pytest.mark.parametrize("name", sorted(EXERCISES))
def test_reference_passes(name, capsys):
    getattr(checks, name)(getattr(reference, name))
    out = capsys.readouterr().out
    assert out.startswith(f"✓ {EXERCISES[name].id} {name}"), out


@pytest.mark.parametrize("name", sorted(EXERCISES))
def test_every_check_has_wrong_implementations(name):
    assert len(WRONG.get(name, [])) >= 2, f"tests/wrong/ has fewer than two wrong implementations for {name}"


@pytest.mark.parametrize(
    "name, wrong, hint",
    [(name, fn, hint) for name, impls in sorted(WRONG.items()) for fn, hint in impls],
    ids=lambda v: getattr(v, "__name__", None) if callable(v) else None,
)
def test_check_rejects_wrong_implementation(name, wrong, hint):
    check = getattr(checks, name)
    with pytest.raises(CheckFailed) as info:
        check(wrong)
    message = str(info.value)
    assert message.startswith(f"{EXERCISES[name].id} {name}"), message
    assert hint in message, f"expected the hint {hint!r} in:\n{message}"


@pytest.mark.parametrize("name, wrong", [(name, impls[0][0]) for name, impls in sorted(WRONG.items())],
                         ids=lambda v: getattr(v, "__name__", None) if callable(v) else None)
def test_a_first_failure_hides_the_recipe_and_a_repeated_one_shows_it(name, wrong):
    """Graduated hints: the full recipe (``hint=`` of t.tensor / t.number) never comes with the
    first failure of a check in a kernel, and always with the next one."""
    check = getattr(checks, name)
    with pytest.raises(CheckFailed) as first:
        check(wrong)
    recipe = first.value.recipe
    assert not recipe or recipe == first.value.hint or recipe not in str(first.value), str(first.value)
    with pytest.raises(CheckFailed) as second:
        check(wrong)
    assert not recipe or recipe in str(second.value), str(second.value)


@pytest.mark.parametrize("bad", [None, 42, "qkv_projection"])
def test_check_explains_a_non_function(bad):
    with pytest.raises(CheckFailed, match="pass your function itself"):
        checks.qkv_projection(bad)


# The graded exercises of the course contract (EXERCISES.md): id -> function name.
CONTRACT = {
    "1.1": "qkv_projection", "1.2": "merge_heads", "1.3": "scaled_dot_product_attention",
    "2.1": "scaled_scores", "2.2": "attention_entropy", "2.3": "dot_product_std",
    "3.1": "causal_mask", "3.2": "padding_mask", "3.3": "masked_softmax", "3.4": "prefix_lm_mask",
    "3.5": "packed_causal_mask", "3.6": "find_mask_leaks",
    "4.1": "softmax_jacobian", "4.2": "softmax_backward", "4.3": "attention_backward",
    "5.1": "multi_head_attention", "5.2": "mha_param_count", "5.3": "ablate_head",
    "6.1": "repeat_kv", "6.2": "grouped_query_attention", "6.3": "kv_values_per_token", "6.4": "mla_absorbed_scores",
    "7.1": "kv_cache_bytes", "7.2": "decode_step", "7.3": "prefill_decode_flops",
    "8.1": "attention_flops", "8.2": "score_matrix_bytes", "8.3": "max_seq_len_for_scores",
    "9.1": "online_softmax", "9.2": "flash_attention_tiled", "9.3": "flash_attention_triton",
    "9.4": "flash_attention_triton_backward",
    "10.1": "rope", "10.2": "alibi_bias",
    "11.1": "swiglu", "11.2": "causal_lm_loss", "11.3": "induction_scores",
}


def test_exercise_registry_matches_the_contract():
    for name, ex in EXERCISES.items():
        assert CONTRACT.get(ex.id) == name, f"check {name} has id {ex.id}; the contract says {CONTRACT.get(ex.id)}"
        assert ex.points == ex.stars, ex
        assert ex.bonus == (ex.id == "9.4"), f"{ex.id}: only 9.4 is a bonus exercise"
        assert hasattr(reference, name), f"helpers.reference.{name} is missing"
        assert hasattr(checks, name), f"helpers.checks.{name} is not exported"
