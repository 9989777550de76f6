"""The shared check machinery (helpers/checks/core.py, feedback.py, guard.py, instruments.py) and the
exercise registry, tested once per mechanism.

- The registry: every exercise of the contract is registered, passes its own reference, has at
  least two wrong implementations and one right variant in its topic's test file
  (``tests/test_nbNN_topic.py``, gathered by :func:`tests.exercise_cases.all_cases`), and shows the
  full recipe only from the third failed attempt on.
- The machinery's units: graduated hints, the integrity guard, plain outputs, the call's safety
  net, recording, the interactive "not attempted" notice, model answers, and how a failure looks
  in a real Jupyter kernel.
- Hostile submissions, one test per mechanism (monkeypatched comparisons, a replaced reference,
  tensor and number subclasses, ``sys.exit``, a raised ``KeyboardInterrupt``, meta outputs, a mutated
  list argument) on a few exercises that cover every kind of output (``SAMPLE``: tensors, tuples,
  ints, floats, dicts, lists of pairs, decode caches, Triton kernels). Calling the course's reference
  is tried on every exercise, since each has its own reference. The wrong answer each hostile
  submission returns is built from the reference's output on the check's first case (recorded by a
  function that is not attempted yet), then perturbed. Exercise-specific cheats (NumPy in 9.1/9.2,
  copy-only Triton kernels, finite differences in 4.3, a Mapping in 8.1, ...) are tested in each
  topic's file.
"""

from __future__ import annotations

import collections
import functools
import json
import os
import re
import signal
import sys
import threading
import types
from pathlib import Path

import nbformat
import numpy as np
import pytest
import torch

import helpers.nb01_qkv_shapes as att
from helpers import checks, reference, registry
from helpers.checks import EXERCISES, CheckFailed, core, feedback, guard
from helpers.ranks import Comm
from helpers.runtime import configure_triton
from helpers.tools import notebooks as nbtools
from tests.exercise_cases import all_cases

ROOT = Path(__file__).resolve().parents[1]

configure_triton()  # as setup() does in a notebook: Triton's interpreter on before any kernel exists

WRONG, RIGHT = all_cases()
NAMES = sorted(EXERCISES)
SAMPLE = ["scaled_scores", "qkv_projection", "dot_product_std", "find_mask_leaks", "packed_causal_mask",
          "mha_param_count", "kv_cache_bytes", "decode_step", "attention_flops", "flash_attention_tiled",
          "flash_attention_triton", "alibi_bias", "induction_scores"]
_SAVED = {name: getattr(torch, name) for name in ("isclose", "allclose", "equal")}
# The grids over every exercise (the reference passes, its recipe comes on the third failure, calling
# or untracing the reference is refused) run in make test on the first exercise of each notebook and on
# every exercise whose check watches the learner's function run (Trial.call_watched: 2.3's generator,
# 4.3's autograd, 6.4's and 9.1-9.2's op log, 9.3-9.4's and 12.4's kernel launches); make test-all runs
# them on all. The other exercises share the first ones' machinery (Trial.call and the guard).
WATCHED = {"dot_product_std", "attention_backward", "mla_absorbed_scores", "online_softmax", "flash_attention_tiled",
           "flash_attention_triton", "flash_attention_triton_backward", "paged_decode_triton"}
assert WATCHED <= set(EXERCISES), WATCHED - set(EXERCISES)
FAST_NAMES = WATCHED | {min((ex for ex in EXERCISES.values() if ex.notebook == nb), key=lambda ex: ex.order).name
                        for nb in {ex.notebook for ex in EXERCISES.values()}}


def fast_names(names) -> list:
    """``names`` as parameters, those not in FAST_NAMES marked slow (same ids)."""
    return [pytest.param(name, marks=[] if name in FAST_NAMES else [pytest.mark.slow]) for name in names]


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(core, "DEFAULT_TIME_LIMIT_S", 120.0)  # the Triton interpreter is slow
    feedback.reset_attempts()
    yield
    for name, fn in _SAVED.items():  # whatever happened, leave torch as it was for other tests
        setattr(torch, name, fn)
    assert guard.verify_integrity(restore=True) == [], "a test left something replaced"


# =========================================================================== the registry


@pytest.mark.parametrize("name", fast_names(sorted(EXERCISES)))
def test_reference_passes(name, capsys):
    getattr(checks, name)(getattr(reference, name))
    out = capsys.readouterr().out
    assert out.startswith(f"✓ {EXERCISES[name].id} {name}"), out


@pytest.mark.parametrize("name", sorted(EXERCISES))
def test_every_check_has_wrong_and_right_implementations(name):
    assert len(WRONG.get(name, [])) >= 2, f"fewer than two wrong implementations for {name} in its tests/test_nb*.py"
    assert len(RIGHT.get(name, [])) >= 1, f"no right variant of {name} in its tests/test_nb*.py"


# Three failed attempts of a Triton kernel in the interpreter, or of the tiled loops, take seconds: in
# make test-all. The recipe logic is the feedback module's, the same for every check, and make test
# runs it on the other exercises of FAST_NAMES (and these checks' first failures in their topic's test file).
SLOW_RECIPE = {"flash_attention_tiled", "flash_attention_triton", "flash_attention_triton_backward",
               "paged_decode_triton"}


@pytest.mark.parametrize("name, wrong", [pytest.param(name, impls[0][0], marks=[pytest.mark.slow]
                                                      if name in SLOW_RECIPE or name not in FAST_NAMES else [])
                                         for name, impls in sorted(WRONG.items())],
                         ids=lambda v: getattr(v, "__name__", None) if callable(v) else None)
def test_a_first_failure_hides_the_recipe_and_a_repeated_one_shows_it(name, wrong):
    """Graduated hints: the full recipe (``hint=`` of t.tensor / t.number) comes only from the
    ``RECIPE_AFTER``-th failed attempt of an exercise in a kernel, and the attempts before say how
    many are left."""
    check = getattr(checks, name)
    for attempt in range(1, feedback.RECIPE_AFTER):
        with pytest.raises(CheckFailed) as early:
            check(wrong)
        recipe = early.value.recipe
        assert not recipe or recipe == early.value.hint or recipe not in str(early.value), str(early.value)
        left = feedback.RECIPE_AFTER - attempt
        assert not recipe or recipe == early.value.hint or f"after {left} more failed attempt" in str(early.value)
    with pytest.raises(CheckFailed) as last:
        check(wrong)
    assert not recipe or recipe in str(last.value), str(last.value)


@pytest.mark.parametrize("bad", [None, 42, "qkv_projection"])
def test_check_explains_a_non_function(bad):
    with pytest.raises(CheckFailed, match="pass your function itself"):
        checks.qkv_projection(bad)


def registry_problems() -> list[str]:
    """What differs between helpers/registry.py and the code, each as what to change."""
    import importlib

    problems = []
    listed = registry.by_name()
    ids = [e.id for e in registry.EXERCISES]
    problems += [f"exercise id {i} is on two lines of helpers/registry.py" for i in sorted({i for i in ids if ids.count(i) > 1})]
    for name, ex in listed.items():
        where = f"helpers/registry.py, the line of {ex.id} {name}"
        if not re.fullmatch(r"[1-9][0-9]?\.[1-9][0-9]?", ex.id) or int(ex.id.split(".")[0]) != int(ex.notebook[:2]):
            problems.append(f"{where}: the id must be <notebook number>.<n> (notebook {ex.notebook})")
        if ex.stars not in (1, 2, 3):
            problems.append(f"{where}: stars must be 1, 2 or 3 (★ warm-up, ★★ core, ★★★ hard)")
        teaching = ROOT / "notebooks" / f"{ex.notebook}.ipynb"
        if not teaching.exists():
            problems.append(f"{where}: there is no notebooks/{ex.notebook}.ipynb")
            continue
        headings = [line.lstrip("#").strip().replace("`", "") for cell in nbformat.read(teaching, as_version=4).cells
                    if cell.cell_type == "markdown" for line in cell.source.split("\n") if line.startswith("#")]
        if ex.section not in headings:
            problems.append(f"{where}: the section {ex.section!r} is not a heading of notebooks/{ex.notebook}.ipynb "
                            f"(without its #s and backticks); its headings: {headings[1:]}")
        try:
            lesson = importlib.import_module(f"helpers.{ex.module_name}")
        except ImportError:
            problems.append(f"{where}: there is no module helpers/{ex.module_name}.py")
            continue
        if not callable(getattr(lesson, name, None)):
            problems.append(f"helpers/{ex.module_name}.py has no function {name} (the exercise's reference)")
        elif name not in getattr(lesson, "__all__", [name]):
            problems.append(f"add {name!r} to __all__ in helpers/{ex.module_name}.py (its reference)")
        elif getattr(reference, name, None) is not getattr(lesson, name) and \
                getattr(getattr(reference, name, None), "__module__", "") != "helpers.reference":  # a lazy import
            problems.append(f"helpers.reference.{name} is not helpers.{ex.module_name}.{name}: one definition, re-exported")
        check = getattr(checks, name, None)
        if getattr(check, "exercise", None) != ex:
            problems.append(f"no check for {name}: write `@exercise() def {name}(t: Trial)` in helpers/checks/{ex.module_name}.py")
        elif check.__module__ != f"helpers.checks.{ex.module_name}":
            problems.append(f"the check of {name} is in {check.__module__}; the registry says helpers.checks.{ex.module_name}")
    problems += [f"the check {name} ({ex.id}) is not in helpers/registry.py: add its line there"
                 for name, ex in EXERCISES.items() if name not in listed]
    return problems


def test_the_registry_and_the_code_agree():
    """helpers/registry.py is the one hand-kept list of exercises: every line has its check (in the
    check module it names, exported), its reference (in the lesson module's ``__all__`` and in
    ``helpers.reference``), a section that is a heading of its teaching notebook, and every check is
    on a line. Each problem says what to change."""
    problems = registry_problems()
    assert not problems, "\n".join(problems)


def test_the_registry_test_says_what_to_change(monkeypatch, toy):
    Ex = registry.Exercise
    with monkeypatch.context() as m:  # undone before the integrity guard looks (it watches the registry too)
        m.setattr(registry, "EXERCISES", (
            *registry.EXERCISES,
            Ex("3.9", "not_written", "t", 2, "03_masks", "2.4 Sliding window: local attention"),
            Ex("3.9", "sliding_window_mask", "t", 4, "03_masks", "9. No such section"),
            Ex("5.7", "elsewhere", "t", 1, "03_masks", "1. A mask is a yes/no table")))
        problems = "\n".join(registry_problems())
    for words in ("exercise id 3.9 is on two lines", "helpers/nb03_masks.py has no function not_written",
                  "no check for not_written: write `@exercise() def not_written(t: Trial)` in helpers/checks/nb03_masks.py",
                  "stars must be 1, 2 or 3", "'9. No such section' is not a heading of notebooks/03_masks.ipynb",
                  "add 'sliding_window_mask' to __all__ in helpers/nb03_masks.py",
                  "the line of 5.7 elsewhere: the id must be <notebook number>.<n>",
                  "the check toy_double (0.1) is not in helpers/registry.py: add its line there"):
        assert words in problems, words


# =========================================================================== the machinery's units


@pytest.fixture
def toy():
    """A registered toy check (removed again afterwards): 2 * x, with one recognised mistake."""

    @core.exercise(entry=feedback.Exercise("0.1", "toy_double", "double a tensor", 1, "01_qkv_shapes", "2. Shapes"))
    def toy_double(t):
        x = torch.arange(6.0).reshape(2, 3)
        expected = 2 * x
        got = t.call(x, case="x=float32[2, 3]")
        t.tensor(got, expected, mistakes={"you added 2 instead of multiplying by 2.": lambda: x + 2},
                 hint="return 2 * x")

    yield toy_double
    EXERCISES.pop("toy_double", None)
    core._CHECKS.pop("toy_double", None)
    feedback.reset_attempts()


def _trial(fn, name="merge_heads"):
    return core.Trial(EXERCISES[name], fn, 30.0)


def _fails(check, fn) -> CheckFailed:
    with pytest.raises(CheckFailed) as info:
        check(fn)
    return info.value


# --------------------------------------------------------------------------- graduated hints


def test_a_recognised_mistake_is_named_at_once_without_the_recipe(toy):
    e = _fails(toy, lambda x: x + 2)
    message = str(e)
    assert "hint: you added 2 instead of multiplying by 2." in message
    assert "return 2 * x" not in message and "see:" not in message
    assert "after 2 more failed attempts, this check shows a step-by-step recipe" in message
    assert e.recognised and e.instructor_hint == "you added 2 instead of multiplying by 2."


def test_an_unrecognised_failure_says_what_differs_and_where_to_look_then_the_recipe(toy):
    first = _fails(toy, lambda x: 3 * x)
    assert "values differ at 5 of 6 entries" in str(first)
    assert "see: notebooks/01_qkv_shapes.ipynb, section 2. Shapes" in str(first)
    assert "return 2 * x" not in str(first) and "hint:" not in str(first)
    assert not first.recognised and first.recipe == "return 2 * x"
    assert "found: every entry is 1.5 times the expected one" in str(first)
    assert first.instructor_hint.startswith("every entry is 1.5 times the expected one")
    second = _fails(toy, lambda x: 3 * x)
    assert "recipe:" not in str(second) and "after 1 more failed attempt," in str(second)
    third = _fails(toy, lambda x: 3 * x)
    assert "recipe: return 2 * x" in str(third)


def test_repeats_are_counted_per_exercise(toy):
    _fails(checks.merge_heads, lambda o: o.reshape(o.shape[0], o.shape[2], -1) * 3)
    assert "recipe:" not in str(_fails(toy, lambda x: 3 * x))


def test_exercise_pointer_without_a_section():
    ex = feedback.Exercise("9.9", "x", "t", 1, "09_flash_attention")
    assert ex.pointer == "notebooks/09_flash_attention.ipynb"


# --------------------------------------------------------------------------- presentation


def test_messages_wrap_at_word_boundaries():
    long = "  hint: " + " ".join(f"word{i}" for i in range(60)) + " torch.softmax(q @ k.transpose(-2, -1))"
    wrapped = feedback.wrap("1.1 x failed\n" + long)
    lines = wrapped.split("\n")
    assert max(len(line) for line in lines) <= feedback.WRAP_WIDTH
    assert " ".join(wrapped.split()) == " ".join(("1.1 x failed\n" + long).split())  # no word was cut
    assert all(line.startswith("        ") for line in lines[2:])  # continues under the hint's text


def test_a_failure_printed_in_a_learners_session_breaks_between_words(monkeypatch, capsys):
    """In a learner's own session a failure goes to stderr, which JupyterLab shows with
    `word-break: break-all`: a line longer than the output area is cut anywhere, mid-word too.
    So the message is wrapped at word boundaries before it is written (it once was not)."""
    ex = feedback.Exercise("0.1", "toy_double", "double a tensor", 1, "01_qkv_shapes")
    hint = "you added 2 instead of multiplying by 2: " + " ".join(f"multiplication{i}" for i in range(30))
    error = CheckFailed(f"0.1 toy_double failed\n  hint: {hint}", hint, exercise=ex)
    with monkeypatch.context() as m:  # undone before the integrity guard looks
        m.setattr(feedback, "_interactive", lambda: True)
        feedback._present(ex, feedback.CheckResult(ex, "failed", str(error), hint, error=error))
    printed = capsys.readouterr().err
    lines = printed.rstrip("\n").split("\n")
    assert len(lines) > 4 and max(len(line) for line in lines) <= feedback.WRAP_WIDTH, lines
    assert " ".join(printed.split()).startswith(" ".join(f"✗ {error}".split()))  # every word whole
    assert all(w in printed.split() for w in (f"multiplication{i}" for i in range(30)))


def test_in_ipython_a_failure_renders_as_its_message_alone(toy):
    e = _fails(toy, lambda x: 3 * x)
    lines = e._render_traceback_()
    assert "✗ 0.1 toy_double failed" in lines[0]
    assert not any("Traceback" in line or "File " in line for line in lines)
    assert all(len(line) <= feedback.WRAP_WIDTH for line in lines[1:])


def test_a_pass_prints_one_line_and_is_recorded(toy, capsys):
    results = []
    recorder = feedback.add_recorder(results.append)
    try:
        toy(lambda x: x * 2)
    finally:
        feedback.remove_recorder(recorder)
    assert capsys.readouterr().out == "✓ 0.1 toy_double: double a tensor (1 pt) passed\n"
    assert [(r.name, r.status, r.passed) for r in results] == [("toy_double", "passed", True)]


def test_run_check_returns_the_result_without_raising_or_printing(toy, capsys):
    result = core.run_check("toy_double", lambda x: x + 2)
    assert result.status == "failed" and result.hint == "you added 2 instead of multiplying by 2."
    assert isinstance(result.error, CheckFailed) and capsys.readouterr().out == ""
    assert core.run_check("toy_double", "not a function").status == "error"


def _fake_ipython(monkeypatch):
    shown = []
    ipython = types.ModuleType("IPython")
    ipython.get_ipython = lambda: object()
    display = types.ModuleType("IPython.display")
    display.display = lambda data, raw=False: shown.append(data)
    ipython.display = display
    monkeypatch.setitem(sys.modules, "IPython", ipython)
    monkeypatch.setitem(sys.modules, "IPython.display", display)
    return shown


def test_not_attempted_shows_a_notice_interactively_and_raises_under_pytest(toy, monkeypatch, capsys):
    def stub(x):
        raise NotImplementedError()

    assert os.environ.get(feedback.RAISE_NOT_ATTEMPTED_ENV) == "1", "conftest.py must set it for pytest"
    with pytest.raises(checks.NotAttempted, match="not attempted yet"):
        toy(stub)
    _fake_ipython(monkeypatch)
    with pytest.raises(checks.NotAttempted):
        toy(stub)  # the variable is set: grading and nbval count it as not attempted
    monkeypatch.delenv(feedback.RAISE_NOT_ATTEMPTED_ENV)
    results = []
    recorder = feedback.add_recorder(results.append)
    try:
        assert toy(stub) is None  # Run All goes on
    finally:
        feedback.remove_recorder(recorder)
    assert "◻ 0.1 toy_double: not attempted yet" in capsys.readouterr().out
    assert [r.status for r in results] == ["not attempted"]


def test_conftest_sets_the_variable_the_core_reads():
    import conftest

    assert conftest.RAISE_NOT_ATTEMPTED_ENV == feedback.RAISE_NOT_ATTEMPTED_ENV


def test_a_pass_in_ipython_offers_the_model_answer(monkeypatch, capsys):
    shown = _fake_ipython(monkeypatch)
    checks.merge_heads(reference.merge_heads)
    assert capsys.readouterr().out.startswith("✓ 1.2 merge_heads")
    (data,) = shown
    answer = feedback.model_answer("merge_heads")
    assert data["text/markdown"].startswith("<details>") and answer["answer"] in data["text/markdown"]
    assert answer["question"] in data["text/plain"]


def test_model_answers_file_is_what_make_exercises_writes():
    assert nbtools.model_answers_in_sync(), "helpers/model_answers.json is stale: run `make exercises`"
    answers = json.loads(nbtools.MODEL_ANSWERS_PATH.read_text(encoding="utf-8"))
    for name, entry in answers.items():
        assert entry["answer"].startswith("**Model answer.**"), name
        assert entry["question"], f"no 'Why it matters' question found for {name}"
        if name in EXERCISES:
            assert entry["exercise"] == EXERCISES[name].id and entry["notebook"] == EXERCISES[name].notebook


def test_a_why_it_matters_question_is_a_sentence_and_its_code_stays_as_written(tmp_path, monkeypatch):
    """The statements write the question as the continuation of "**Why it matters for LLMs:**", in
    lower case (38 of 45 did); shown on its own after a pass it must start as a sentence, unless it
    opens with code or mathematics, which capitalising would change."""
    assert nbtools.as_sentence("why is the merge a copy?") == "Why is the merge a copy?"
    assert nbtools.as_sentence("`x.view` fails. Why?") == "`x.view` fails. Why?"
    assert nbtools.as_sentence("$T_q = 1$ in decoding. Why?") == "$T_q = 1$ in decoding. Why?"
    assert nbtools.as_sentence("GPT-2 small has biases.") == "GPT-2 small has biases."
    statement = ("## Exercise 1.1 ★ (1 point): toy\n\n**Why it matters for LLMs:** in decoding,\n"
                 "`T_q = 1`. Why?\n\nMore text.")
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell(statement),
        nbformat.v4.new_code_cell("checks.toy(toy)"),
        nbformat.v4.new_markdown_cell("**Model answer.** Because.", metadata={"tags": ["model-answer"]}),
    ])
    for name, entry in nbtools.model_answers().items():  # the course's own, as extracted now
        assert not entry["question"][:1].islower(), (name, entry["question"][:60])
    (tmp_path / "solutions").mkdir()
    nbformat.write(nb, tmp_path / "solutions" / "01_toy.ipynb")
    with monkeypatch.context() as m:
        m.setattr(nbtools, "notebook_paths", lambda *dirs: [tmp_path / "solutions" / "01_toy.ipynb"])
        answers = nbtools.model_answers()
    assert answers["toy"]["question"] == "In decoding, `T_q = 1`. Why?", answers


def test_every_exercise_with_a_solution_has_a_model_answer():
    answers = nbtools.model_answers()
    solved = {path.stem for path in nbtools.notebook_paths("solutions")}
    missing = [n for n, ex in EXERCISES.items() if ex.notebook in solved and n not in answers]
    assert not missing, f"no model-answer cell after the check of {missing}"


def test_model_answers_are_package_data():
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    with open(nbtools.ROOT / "pyproject.toml", "rb") as f:
        data = tomllib.load(f)["tool"]["setuptools"]["package-data"]
    assert nbtools.MODEL_ANSWERS_PATH.name in data["helpers"]


def test_a_method_added_to_torch_tensor_is_found_and_removed():
    torch.Tensor.__eq__ = lambda self, other: True
    assert "torch.Tensor.__eq__ was added" in guard.verify_integrity(restore=True)
    assert "__eq__" not in vars(torch.Tensor)


def test_replaced_function_code_is_found_and_put_back():
    code = att.merge_heads.__code__
    att.merge_heads.__code__ = (lambda o: o).__code__
    assert "the code of helpers.nb01_qkv_shapes.merge_heads was replaced" in guard.verify_integrity(restore=True)
    assert att.merge_heads.__code__ is code


def test_a_patched_check_machinery_method_is_found(toy):
    original = core.Trial.tensor
    core.Trial.tensor = lambda self, got, *a, **k: got
    e = _fails(toy, lambda x: x * 3)
    assert "helpers.checks.core.Trial.tensor was replaced" in str(e)
    assert core.Trial.tensor is original


def test_a_torch_wrapper_made_by_torch_itself_is_accepted():
    import torch._dynamo  # noqa: F401  (wraps torch.manual_seed when imported)

    assert guard.verify_integrity(restore=False) == []


def test_a_torch_mode_left_open_or_a_changed_default_is_refused(toy):
    from torch.overrides import TorchFunctionMode

    def leaves_a_mode(x):
        TorchFunctionMode().__enter__()
        return 2 * x

    assert "TorchFunctionMode was left active" in str(_fails(toy, leaves_a_mode))
    assert torch._C._len_torch_function_stack() == 0

    def changes_defaults(x):
        torch.set_default_dtype(torch.float64)
        torch.set_default_device("meta")
        return 2 * x

    message = str(_fails(toy, changes_defaults))
    assert "default device" in message and "default dtype" in message
    assert torch.get_default_dtype() == torch.float32 and torch.get_default_device() == torch.device("cpu")


def test_a_mode_active_before_the_check_is_refused(toy):
    torch.set_default_device("cpu")
    try:
        assert "a torch mode is active" in str(_fails(toy, lambda x: 2 * x))
    finally:
        torch.set_default_device(None)


# --------------------------------------------------------------------------- what the learner returns


def test_outputs_become_plain_data():
    Pair = collections.namedtuple("Pair", "a b")
    t = _trial(lambda: Pair(torch.nn.Parameter(torch.ones(2)), [1, 2.5]))
    out = t.call()
    assert type(out) is tuple and type(out[0]) is torch.Tensor and out[1] == [1, 2.5]


@pytest.mark.parametrize("value, message", [
    (type("MyFloat", (float,), {})(1.0), "a subclass of float"),
    (type("MyInt", (int,), {})(3), "a subclass of int"),
    (torch.ones(2).as_subclass(type("MyTensor", (torch.Tensor,), {})), "subclass of torch.Tensor"),
    (torch.ones(2, device="meta"), "meta device"),
    ({"x": [torch.ones(1, device="meta")]}, "of the output['x'] is a tensor on the meta device"),
])
def test_untrustworthy_outputs_are_refused(value, message):
    with pytest.raises(checks.feedback.Refused, match=message.replace("[", r"\[").replace("]", r"\]")):
        _trial(lambda x: value).call(torch.ones(2))


def test_number_accepts_plain_and_numpy_numbers_and_refuses_the_rest():
    t = _trial(None)
    assert t.number(2.0, 2.0) == 2.0 and t.number(np.float64(2.0), 2.0) == 2.0
    assert t.number(7, 7, integer=True) == 7
    for bad, match in [(True, "expected a number, got bool"), (torch.tensor(2.0), r"\.item\(\)"),
                       (type("F", (float,), {})(2.0), "subclass of float"), ("2", "expected a number")]:
        with pytest.raises(CheckFailed, match=match):
            t.number(bad, 2.0)
    with pytest.raises(CheckFailed, match="expected an int"):
        t.number(np.int64(7), 7, integer=True)


def test_large_integers_are_compared_exactly():
    t = _trial(None)
    t.number(2**53, 2**53 + 1, integer=True)  # held: a failing comparison is reported when the cases have run
    with pytest.raises(CheckFailed, match="expected 9,007,199,254,740,993"):
        t._conclude()


def test_device_and_dtype_are_checked_before_any_mistake_is_matched():
    called = []
    mistakes = {"never": lambda: called.append(1) or torch.zeros(2)}
    with pytest.raises(CheckFailed, match="got one on the meta device"):
        _trial(None).tensor(torch.zeros(2, device="meta"), torch.zeros(2), mistakes=mistakes)
    with pytest.raises(CheckFailed, match="expected dtype torch.float32"):
        _trial(None).tensor(torch.zeros(2, dtype=torch.float64), torch.zeros(2), mistakes=mistakes)
    assert not called


def test_a_mistake_model_that_crashes_is_skipped():
    t = _trial(None)
    t.tensor(torch.ones(2), torch.zeros(2), mistakes={"boom": lambda: 1 / 0})
    with pytest.raises(CheckFailed, match="values differ"):
        t._conclude()


# --------------------------------------------------------------------------- the call's safety net


def test_in_place_changes_of_lists_dicts_and_tensors_are_found():
    def reverses(xs):
        xs.reverse()
        return 0

    with pytest.raises(CheckFailed, match=r"modified its argument `xs` \(list\) in place: it was \[3, 2, 4\], now "
                       r"\[4, 2, 3\]"):
        _trial(reverses).call([3, 2, 4])

    def edits(config):
        config["n"] += 1

    with pytest.raises(CheckFailed, match="modified its argument `config`"):
        _trial(edits).call({"n": 1})

    def scales(x):
        x *= 2

    with pytest.raises(CheckFailed, match="modified one of its input tensors in place: `x`"):
        _trial(scales).call(torch.ones(3))


def test_system_exit_and_a_raised_keyboard_interrupt_are_failed_checks():
    with pytest.raises(checks.LearnerError, match=r"sys.exit\(\)"):
        _trial(lambda: sys.exit(2)).call()

    def interrupts():
        raise KeyboardInterrupt

    with pytest.raises(checks.LearnerError, match="raised KeyboardInterrupt itself"):
        _trial(interrupts).call()


def test_a_real_interrupt_still_stops_the_check():
    import time

    def long_running():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)

    # Python's own handler for the test (a process started in the background ignores SIGINT).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            _trial(long_running).call()
    finally:
        signal.signal(signal.SIGINT, previous)


def test_only_a_bare_not_implemented_error_means_not_attempted():
    def blank():
        raise NotImplementedError()

    with pytest.raises(checks.NotAttempted):
        _trial(blank).call()

    def calls_blank():  # an earlier exercise, not written yet: an error that names it
        return blank()

    with pytest.raises(checks.LearnerError, match="NotImplementedError \\(from `blank`, which it calls\\)"):
        _trial(calls_blank).call()

    def torch_says_not_implemented():
        raise NotImplementedError("Could not run 'aten::foo' with arguments from the 'Meta' backend")

    with pytest.raises(checks.LearnerError, match="raised NotImplementedError: Could not run"):
        _trial(torch_says_not_implemented).call()


def test_a_tensor_on_another_device_gets_the_device_message():
    with pytest.raises(CheckFailed, match="device=x.device"):
        _trial(None).tensor(torch.zeros(2, device="meta"), torch.zeros(2))
    hint = next(h for pattern, h in feedback.CORE_ERROR_HINTS.items() if "same device" in pattern)
    assert "device=x.device" in hint


# --------------------------------------------------------------------------- the course's reference


@pytest.mark.parametrize("make", [
    lambda: (lambda o: att.merge_heads(o)),
    lambda: functools.partial(lambda f, o: f(o), reference.merge_heads),
    lambda: (lambda copy: lambda o: copy(o))(types.FunctionType(att.merge_heads.__code__, dict(vars(att)))),
    lambda: (lambda o: __import__("threading").Thread(target=att.merge_heads, args=(o,)).run() or o),
], ids=["wrapper", "partial", "code_copy", "thread_run"])
def test_calling_the_reference_for_the_same_exercise_is_refused(make):
    with pytest.raises(checks.feedback.Refused, match="course's own solution of this exercise, the reference "
                       "helpers.nb01_qkv_shapes.merge_heads"):
        checks.merge_heads(make())


def test_other_helpers_stay_allowed(capsys):
    checks.scaled_dot_product_attention(lambda q, k, v: att.attention_weights(q, k) @ v)
    assert capsys.readouterr().out.startswith("✓ 1.3")


def test_the_reference_itself_is_recognised():
    """Checking the course's own function passes (the tests rely on it); the result says so, for
    the grader to score it 0."""
    assert guard.is_course_reference(reference.merge_heads, "merge_heads")
    assert guard.is_course_reference(types.FunctionType(att.merge_heads.__code__, {}), "merge_heads")
    assert guard.is_course_reference(functools.partial(reference.merge_heads), "merge_heads")
    assert not guard.is_course_reference(lambda o: o, "merge_heads")
    assert core.run_check("merge_heads", reference.merge_heads).is_reference


def test_a_debugger_or_trace_hook_inside_the_function_is_reported():
    def untraced(o):
        sys.settrace(None)
        return att.merge_heads(o)

    with pytest.raises(checks.feedback.Refused, match="trace function"):
        checks.merge_heads(untraced)
    assert sys.gettrace() is None


def test_threads_a_function_starts_are_watched_and_not_reported():
    """A thread started inside the learner's function installs the watcher's own hook as it boots
    (threading.settrace): not a change of the trace function. A thread that removes it, or a
    calling of the reference from a thread, is still caught."""
    def in_a_thread(o, body=att.merge_heads):
        out = []
        worker = threading.Thread(target=lambda: out.append(body(o)))
        worker.start()
        worker.join()
        return out[0]

    def hand_written(o):
        B, H, T, d = o.shape
        return o.transpose(1, 2).reshape(B, T, H * d)

    assert checks.merge_heads.evaluate(lambda o: in_a_thread(o, hand_written)).passed

    def untraced_in_a_thread(o):
        def body(x):
            sys.settrace(None)
            return hand_written(x)
        return in_a_thread(o, body)

    with pytest.raises(checks.feedback.Refused, match="trace function"):
        checks.merge_heads(untraced_in_a_thread)
    with pytest.raises(checks.feedback.Refused, match="course's own solution"):
        checks.merge_heads(lambda o: in_a_thread(o, reference.merge_heads))


# --------------------------------------------------------------------------- a real Jupyter kernel


def test_in_a_kernel_failures_are_short_and_run_all_reaches_every_exercise(tmp_path):
    """Run All in an exercise-like notebook of a learner's session: a stub shows a notice, a wrong
    function prints its message (stderr, no machinery traceback) and the notebook goes on, a pass
    shows the model answer, the summary says where each exercise stands; with the grading variable
    set (a machine judges), a stub and a wrong function raise."""
    from nbclient import NotebookClient

    cells = [
        "import os\nos.environ.pop('ATTN_COURSE_RAISE_NOT_ATTEMPTED', None)\nfrom helpers import checks",
        "def merge_heads(o):\n    raise NotImplementedError()\n\nchecks.merge_heads(merge_heads)",
        "def merge_heads(o):\n    return o.reshape(o.shape[0], o.shape[2], -1)\n\nchecks.merge_heads(merge_heads)",
        "def qkv_projection(x, w_qkv, n_heads):\n    return x\n\nchecks.qkv_projection(qkv_projection)\n"
        "checks.summary('01_qkv_shapes')",
        "def merge_heads(o):\n    return o.transpose(1, 2).flatten(2)\n\nchecks.merge_heads(merge_heads)",
        "os.environ['ATTN_COURSE_RAISE_NOT_ATTEMPTED'] = '1'\n"
        "def merge_heads(o):\n    raise NotImplementedError()\n\nchecks.merge_heads(merge_heads)",
        "def merge_heads(o):\n    return o.reshape(o.shape[0], o.shape[2], -1)\n\nchecks.merge_heads(merge_heads)",
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    env = {k: v for k, v in os.environ.items() if k != feedback.RAISE_NOT_ATTEMPTED_ENV}
    env["PYTHONPATH"] = str(nbtools.ROOT)
    NotebookClient(nb, timeout=120, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(tmp_path)}}).execute(env=env)
    outs = [c.outputs for c in nb.cells]
    assert outs[1][0]["output_type"] == "stream" and "◻ 1.2 merge_heads: not attempted yet" in outs[1][0]["text"]
    assert not [o for o in outs[2] if o["output_type"] == "error"], outs[2]
    (printed,) = [o for o in outs[2] if o["output_type"] == "stream" and o["name"] == "stderr"]
    assert "✗ 1.2 merge_heads failed" in printed["text"] and "transpose(1, 2) first" in printed["text"]
    assert "File " not in printed["text"] and "core.py" not in printed["text"] and "Traceback" not in printed["text"]
    text = "".join(o.get("text", "") for o in outs[3] if o["output_type"] == "stream" and o["name"] == "stdout")
    assert "✗ 1.1 qkv_projection (1 pt): failed: " in text, text
    assert "✗ 1.2 merge_heads (1 pt): failed: merged:" in text, text
    total = sum(e.points for e in registry.by_notebook()["01_qkv_shapes"])
    assert "· 1.3 scaled_dot_product_attention (1 pt): not checked yet" in text and f"score: 0/{total} points" in text
    assert outs[4][0]["text"].startswith("✓ 1.2 merge_heads")
    assert "<details>" in outs[4][1]["data"]["text/markdown"]
    assert [o for o in outs[5] if o["output_type"] == "error"][0]["ename"] == "NotAttempted"
    (error,) = [o for o in outs[6] if o["output_type"] == "error"]
    assert error["ename"] == "CheckFailed"
    tb = "\n".join(error["traceback"])
    assert "✗ 1.2 merge_heads failed" in tb and "File " not in tb and "core.py" not in tb and "Traceback" not in tb


def test_the_summary_names_an_unknown_notebook(capsys):
    checks.summary("05_multi")
    assert "no exercises in a notebook named '05_multi'" in capsys.readouterr().out


@pytest.mark.parametrize("path", [pytest.param(p, id=p.stem, marks=[] if p.stem == "01_qkv_shapes" else [pytest.mark.slow])
                                  for p in nbtools.notebook_paths("exercises")])
def test_run_all_of_a_blank_exercise_notebook_reaches_every_exercise(path, tmp_path):
    """A learner's "Run All" on a blank notebook: no cell stops it, every check says "not
    attempted yet" (interactive session: the grading variable is not set)."""
    from nbclient import NotebookClient

    nb = nbtools.read(path)
    env = {k: v for k, v in os.environ.items() if k != feedback.RAISE_NOT_ATTEMPTED_ENV}
    env["PYTHONPATH"] = str(nbtools.ROOT)
    NotebookClient(nb, timeout=300, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(path.parent)}}).execute(env=env)
    errors = [(i, o["ename"], o["evalue"][:200]) for i, c in enumerate(nb.cells) if c.cell_type == "code"
              for o in c.outputs if o["output_type"] == "error"]
    assert not errors, f"Run All stops in {path.name}: {errors}"
    notices = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    names = {n for n, ex in EXERCISES.items() if ex.notebook == path.stem}
    assert all(f"{name}: not attempted yet" in notices for name in names), notices[-2000:]
    last = "".join(o.get("text", "") for o in nb.cells[-1].outputs)  # checks.summary(...): where each stands
    assert nb.cells[-1].source == f'checks.summary("{path.stem}")', nb.cells[-1].source
    assert all(f"◻ {EXERCISES[n].id} {n} (" in last and "not attempted" in last for n in names), last
    assert "score: 0/" in last, last


def test_a_failed_check_in_a_learners_session_does_not_stop_run_all(tmp_path):
    """An exercise notebook with a wrong answer to its first exercise: Run All reaches the summary,
    which names the failure and the state of the others."""
    from nbclient import NotebookClient

    nb = nbtools.read(nbtools.ROOT / "exercises" / "01_qkv_shapes.ipynb")
    (cell,) = [c for c in nb.cells if c.cell_type == "code" and c.source.startswith("def merge_heads")]
    cell.source = "def merge_heads(o):\n    return o.reshape(o.shape[0], o.shape[2], -1)"
    env = {k: v for k, v in os.environ.items() if k != feedback.RAISE_NOT_ATTEMPTED_ENV}
    env["PYTHONPATH"] = str(nbtools.ROOT)
    NotebookClient(nb, timeout=300, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(nbtools.ROOT / "exercises")}}).execute(env=env)
    assert not [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o["output_type"] == "error"]
    last = "".join(o.get("text", "") for o in nb.cells[-1].outputs)
    assert "✗ 1.2 merge_heads (1 pt): failed: merged: values differ" in last, last
    assert "◻ 1.1 qkv_projection" in last and "◻ 1.3 scaled_dot_product_attention" in last, last


def test_cases_compute_every_expected_value_before_the_learner_runs():
    calls = []

    def ref(x, n_heads):
        calls.append("reference")
        return x * n_heads

    def learner(x, n_heads):
        calls.append("learner")
        return x * n_heads

    t = _trial(learner)
    cases = t.cases(ref, [(torch.ones(2, 3), 2), {"x": torch.zeros(4), "n_heads": 3}])
    assert [c.name for c in cases] == ["x=float32[2, 3], n_heads=2", "x=float32[4], n_heads=3"]
    for case in cases:
        t.tensor(t.run(case), case.expected)
    assert calls == ["reference", "reference", "learner", "learner"]


def test_an_output_on_another_device_than_the_inputs_is_refused():
    # No GPU here: inputs on the meta device stand in for "the inputs' device" (on Colab: a CPU
    # input and a result on the `device` from setup(), cuda).
    with pytest.raises(checks.feedback.Refused, match=r"(?s)The output is on cpu, but the inputs are on meta.*device=x\.device"):
        _trial(lambda x: torch.zeros(2)).call(torch.zeros(2, device="meta"))


# =========================================================================== hostile submissions


_FIRST: dict[str, tuple] = {}


def first_case(name: str) -> tuple[tuple, dict, object]:
    """(args, kwargs, reference output) of the first call the check of ``name`` makes."""
    if name not in _FIRST:
        seen: dict = {}

        def not_attempted(*args, **kwargs):
            seen["call"] = (args, kwargs)
            raise NotImplementedError()

        result = getattr(checks, name).evaluate(not_attempted)
        assert result.status == "not attempted" and "call" in seen, result.message
        args, kwargs = seen["call"]
        _FIRST[name] = (args, kwargs, getattr(reference, name)(*args, **kwargs))
    return _FIRST[name]


def perturb(x):
    """A wrong answer of the same structure as the right one ``x``."""
    if isinstance(x, torch.Tensor):
        if x.dtype == torch.bool:
            return ~x
        if x.is_floating_point():
            return x + (x.detach().abs().nan_to_num(0, 0, 0).mean() + 1).to(x.dtype)
        return x + 1
    if isinstance(x, bool):
        return not x
    if isinstance(x, int):
        return x + 1
    if isinstance(x, float):
        return 1.5 * x + 1.0
    if isinstance(x, (list, tuple)):
        items = [perturb(e) for e in x] if x else [(0, 1)]
        return type(x)(items)
    if isinstance(x, dict):
        return {k: perturb(v) for k, v in x.items()}
    return x


def _map(x, on_tensor=None, on_number=None):
    if isinstance(x, torch.Tensor):
        return on_tensor(x) if on_tensor else x
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return on_number(x) if on_number else x
    if isinstance(x, (list, tuple)):
        return type(x)(_map(e, on_tensor, on_number) for e in x)
    if isinstance(x, dict):
        return {k: _map(v, on_tensor, on_number) for k, v in x.items()}
    return x


def _has(x, kind) -> bool:
    if isinstance(x, kind) and not isinstance(x, bool):
        return True
    if isinstance(x, (list, tuple)):
        return any(_has(e, kind) for e in x)
    if isinstance(x, dict):
        return any(_has(v, kind) for v in x.values())
    return False


def rejected(name: str, fn) -> CheckFailed:
    """Run the check as a learner would; it must raise CheckFailed (not pass, not crash)."""
    with pytest.raises(CheckFailed) as info:
        getattr(checks, name)(fn)
    message = str(info.value)
    assert message.startswith(f"{EXERCISES[name].id} {name}"), message
    return info.value


# ----------------------------------------------------------------------------- the submissions


@pytest.mark.parametrize("name", SAMPLE)
def test_monkeypatched_comparisons_are_refused(name):
    wrong = perturb(first_case(name)[2])

    def hostile(*args, **kwargs):
        torch.isclose = lambda a, b, *r, **k: torch.ones(torch.broadcast_shapes(a.shape, b.shape), dtype=torch.bool)
        torch.allclose = lambda *r, **k: True
        torch.equal = lambda *r, **k: True
        return wrong

    e = rejected(name, hostile)
    assert "torch.isclose was replaced" in str(e) and "put the originals back" in str(e), str(e)
    assert all(getattr(torch, n) is fn for n, fn in _SAVED.items())


@pytest.mark.parametrize("name", SAMPLE)
def test_comparisons_patched_earlier_in_the_notebook_are_refused(name):
    torch.allclose = lambda *r, **k: True  # a cell before the check
    e = rejected(name, getattr(reference, name))
    assert "torch.allclose was replaced" in str(e), str(e)
    assert torch.allclose is _SAVED["allclose"]


@pytest.mark.parametrize("name", SAMPLE)
def test_replacing_the_course_reference_is_refused(name):
    wrong = perturb(first_case(name)[2])
    holders = [m for n, m in sys.modules.items() if n.startswith("helpers.") and not n.startswith("helpers.checks")
               and callable(getattr(m, name, None))]
    originals = {m: getattr(m, name) for m in holders}

    def hostile(*args, **kwargs):
        fake = lambda *a, **k: wrong
        for module in holders:
            setattr(module, name, fake)
        return getattr(reference, name)(*args, **kwargs)

    e = rejected(name, hostile)
    assert f".{name} was replaced" in str(e), str(e)
    assert all(getattr(m, name) is fn for m, fn in originals.items())


class Liar(torch.Tensor):
    """A tensor whose comparisons always agree."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in {"allclose", "equal"}:
            return True
        if name in {"isclose", "eq", "__eq__"}:
            return torch.ones(args[0].shape, dtype=torch.bool)
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("name", SAMPLE)
def test_tensor_subclass_is_refused(name):
    wrong = perturb(first_case(name)[2])
    out = _map(wrong, on_tensor=lambda t: t.as_subclass(Liar)) if _has(wrong, torch.Tensor) \
        else torch.zeros(1).as_subclass(Liar)

    e = rejected(name, lambda *a, **k: out)
    assert "subclass of torch.Tensor" in str(e), str(e)


def _lying(value, truth):
    base = int if isinstance(value, int) else float

    class Lying(base):
        def __eq__(self, other):
            return True

        __hash__ = base.__hash__

        def __float__(self):
            return float(truth)

        def __int__(self):
            return int(truth)

    return Lying(value)


@pytest.mark.parametrize("name", SAMPLE)
def test_lying_number_is_refused(name):
    expected = first_case(name)[2]
    if not _has(expected, (int, float)):
        pytest.skip("no Python number in this exercise's output")
    truths = []
    _map(expected, on_number=truths.append)
    it = iter(truths)
    out = _map(perturb(expected), on_number=lambda v: _lying(v, next(it)))

    e = rejected(name, lambda *a, **k: out)
    assert "a subclass of int" in str(e) or "a subclass of float" in str(e), str(e)


@pytest.mark.parametrize("name", SAMPLE)
def test_sys_exit_is_a_failed_check_and_recorded(name):
    import sys as system

    results = []
    recorder = feedback.add_recorder(results.append)
    try:
        e = rejected(name, lambda *a, **k: system.exit(3))
    finally:
        feedback.remove_recorder(recorder)
    assert "sys.exit()" in str(e) and e.status == "error", str(e)
    assert [r.status for r in results] == ["error"]


@pytest.mark.parametrize("name", SAMPLE)
def test_keyboard_interrupt_raised_by_the_learner_is_a_failed_check(name):
    def hostile(*args, **kwargs):
        raise KeyboardInterrupt

    e = rejected(name, hostile)
    assert "raised KeyboardInterrupt" in str(e), str(e)


@pytest.mark.parametrize("name", SAMPLE)
def test_meta_output_is_refused(name):
    wrong = perturb(first_case(name)[2])
    out = _map(wrong, on_tensor=lambda t: t.to("meta")) if _has(wrong, torch.Tensor) \
        else torch.empty(3, device="meta")

    e = rejected(name, lambda *a, **k: out)
    assert "meta device" in str(e), str(e)


def _via_reference_module(name):
    return lambda *a, **k: getattr(reference, name)(*a, **k)


def _via_alias(name):
    alias = getattr(reference, name)
    return lambda *a, **k: alias(*a, **k)


def _via_partial(name):
    return functools.partial(lambda f, *a, **k: f(*a, **k), getattr(reference, name))


def _via_topic_module(name):
    module = next(m for n, m in sorted(sys.modules.items()) if n.startswith("helpers.") and n != "helpers.reference"
                  and not n.startswith("helpers.checks") and callable(getattr(m, name, None)))
    return lambda *a, **k: getattr(module, name)(*a, **k)


HOWS = {"reference": _via_reference_module, "alias": _via_alias, "partial": _via_partial,
        "topic_module": _via_topic_module}


# make test: every way on the plain exercises of FAST_NAMES; on the watched ones (0.1-0.2 s a call) the
# way a notebook imports it, through the topic module (the ways are the guard's, the same for all).
@pytest.mark.parametrize("name, how", [
    pytest.param(name, how, id=f"{name}-{way}",
                 marks=[] if name in FAST_NAMES and (name not in WATCHED or way == "topic_module") else [pytest.mark.slow])
    for name in NAMES for way, how in HOWS.items()])
def test_calling_the_course_reference_is_refused(name, how):
    if how is _via_topic_module and not any(
            n.startswith("helpers.") and n != "helpers.reference" and not n.startswith("helpers.checks")
            and callable(getattr(m, name, None)) for n, m in sys.modules.items()):
        pytest.skip("the reference is defined in helpers.reference itself")
    e = rejected(name, how(name))
    assert "called the course's own solution" in str(e), str(e)


@pytest.mark.parametrize("name", fast_names(NAMES))
def test_turning_off_the_watch_to_call_the_reference_is_refused(name):
    ref = getattr(reference, name)

    def hostile(*args, **kwargs):
        tracer = sys.gettrace()
        sys.settrace(None)
        try:
            return ref(*args, **kwargs)
        finally:
            sys.settrace(tracer)

    e = rejected(name, hostile)
    assert "trace function" in str(e), str(e)


@pytest.mark.parametrize("name", SAMPLE)
def test_mutated_list_argument_is_refused(name):
    args, kwargs, expected = first_case(name)
    if not any(isinstance(a, list) and len(a) > 1 for a in (*args, *kwargs.values())):
        pytest.skip("no list argument in this exercise's first case")
    wrong = perturb(expected)

    def hostile(*a, **k):
        for x in (*a, *k.values()):
            if isinstance(x, list):
                x.reverse()
        return wrong

    e = rejected(name, hostile)
    assert "in place" in str(e), str(e)


# =========================================================================== outputs no check may crash on


COUNTS = ["mha_param_count", "kv_values_per_token", "kv_cache_bytes", "prefill_decode_flops", "score_matrix_bytes",
          "max_seq_len_for_scores"]


@pytest.mark.parametrize("value", [10**400, -(10**400), 10**5000], ids=["1e400", "-1e400", "1e5000"])
@pytest.mark.parametrize("name", COUNTS)
def test_an_int_too_large_for_a_float_is_a_clear_failure(name, value):
    """float(10**400) overflows, and Python refuses to print an int of more than 4,300 digits: a
    count is compared exactly as an int and described by its number of digits."""
    e = rejected(name, lambda *a, **k: value)
    assert "digits" in str(e) and "crashed" not in str(e), str(e)


def test_negative_zero_is_shown_as_zero():
    assert feedback._fmt(-0.0) == "0" and feedback._fmt(0.0) == "0" and feedback._fmt(-1e-30) == "-1e-30"


@pytest.mark.parametrize("make", [lambda x: x.to_sparse(), lambda x: x.to_sparse_csr(),
                                  lambda x: torch.nested.nested_tensor(list(x))], ids=["coo", "csr", "nested"])
def test_sparse_and_nested_outputs_are_refused_before_any_diagnosis(make):
    """Every diagnosis runs on what the learner returned after it became a plain, dense tensor: a
    sparse or nested output is refused as soon as the function returns."""
    def merge(o):
        B, H, T, d = o.shape
        return make(o.transpose(1, 2).reshape(B, T, H * d)[0])

    e = rejected("merge_heads", merge)
    assert "checks compare dense tensors" in str(e) and ".to_dense()" in str(e), str(e)


def test_a_mapping_that_is_not_a_dict_is_refused_without_running_its_code():
    """The check never reads a learner's Mapping (its __getitem__ could raise anything, or exit)."""
    from collections.abc import Mapping

    class Exits(Mapping):
        def __getitem__(self, key):
            raise SystemExit(3)

        def __iter__(self):
            raise SystemExit(4)

        def __len__(self):
            raise SystemExit(5)

        def __repr__(self):
            raise SystemExit(6)

    for name in ("attention_flops", "qkv_projection"):
        e = rejected(name, lambda *a, **k: Exits())
        assert "a Mapping that is not a dict" in str(e), str(e)


def test_dict_keys_are_named_without_running_the_learners_repr():
    class Key:
        def __repr__(self):
            raise SystemExit(7)

        def __hash__(self):
            return 1

    e = rejected("attention_flops", lambda *a, **k: {Key(): torch.ones(2)})
    assert "Key" in str(e) or "lacks the key" in str(e), str(e)


def test_pickling_a_tensor_leaves_the_session_trusted(tmp_path):
    """torch.save (or pickle) of a tensor makes copyreg cache ``torch.Tensor.__slotnames__``: an
    honest habit, never a reason to distrust the checks that follow."""
    import pickle

    torch.save({"w": torch.randn(3)}, tmp_path / "checkpoint.pt")
    pickle.dumps(torch.ones(2))
    assert guard.verify_integrity(restore=False) == []
    result = checks.merge_heads.evaluate(lambda o: o.transpose(1, 2).flatten(2))
    assert result.passed, result.message


# =========================================================================== facts when no mistake is recognised


def _sliding_window(T):
    i = torch.arange(T)
    return (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < 3)


def _scores_shifted(q, k):  # a constant added: no mistake model covers it
    return q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5 + 0.25


def _heads_flattened(o):  # every head and time step in one row: a shape no mistake model covers
    return o.transpose(1, 2).reshape(o.shape[0], -1)


def _weights_times_two(q, k, v):
    return 2 * torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-1) @ v


FACTS = [
    ("masked_softmax", lambda s, a: torch.sigmoid(s) * a / 2, "your rows sum to"),
    ("causal_mask", _sliding_window, "below the diagonal"),
    ("scaled_scores", _scores_shifted, "off by the same amount, 0.25"),
    ("merge_heads", _heads_flattened, "the expected values in the expected order, in the shape [2, 60]"),
    ("scaled_dot_product_attention", _weights_times_two, "every entry is 2 times the expected one"),
]


@pytest.mark.parametrize("name, wrong, fact", FACTS, ids=[f"{f[0]}-{f[2][:20]}" for f in FACTS])
def test_an_unrecognised_mistake_is_described_by_a_fact(name, wrong, fact):
    """When no known mistake matches, the failure states a property of the output (a scale, rows
    that do not sum to 1, where the wrong entries lie), never a guessed cause."""
    e = rejected(name, wrong)
    assert f"found: {fact}" in str(e).replace("\n", " ").replace("  ", " ") or fact in e.instructor_hint, str(e)


# Each case waits out the 1 s limit: make test-all adds an exercise that returns an int.
@pytest.mark.parametrize("name", ["scaled_dot_product_attention", pytest.param("kv_cache_bytes", marks=pytest.mark.slow)])
def test_a_function_that_never_returns_is_stopped_at_the_time_limit(name, monkeypatch):
    monkeypatch.setattr(core, "DEFAULT_TIME_LIMIT_S", 1.0)

    def never_returns(*args, **kwargs):
        while True:
            pass

    e = rejected(name, never_returns)
    assert "did not return within 1 s" in str(e) and e.status == "timed out", str(e)


def _renamed_copy(fn):
    """The reference's code under another name and first line: it computes the same thing but is
    not recognised as the reference (what a renamed copy in a notebook looks like to a check)."""
    code = fn.__code__.replace(co_name=f"copy_of_{fn.__name__}", co_firstlineno=fn.__code__.co_firstlineno + 1000)
    copy = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXERCISES))
def test_the_salted_cases_of_make_grade_are_new_and_right_answers_pass_them(name):
    """`make grade` draws every check's cases from a secret salt. A lookup table built by probing a
    check in an earlier cell must miss the graded inputs (with the salt, the inputs are not all
    the same as without), and every correct variant must pass whatever the salt."""
    import hashlib
    import io

    def inputs(salt: int) -> set[str]:
        core.salt_cases(salt)
        # a renamed copy of the reference; where the check also refuses the notebook's helpers that
        # the reference calls (8.4, 11.4), the copy is refused at its first call: a right variant then
        for ref in (_renamed_copy(getattr(reference, name)), RIGHT[name][0]):
            seen = set()

            def recording(*args, **kwargs):
                buffer = io.BytesIO()  # a rank's communicator (13.2, 13.3) is not an input: left out
                torch.save((tuple(a for a in args if not isinstance(a, Comm)), dict(kwargs)), buffer)
                seen.add(hashlib.sha256(buffer.getvalue()).hexdigest())
                return ref(*args, **kwargs)  # noqa: B023 - called before the loop moves on

            recording.__name__ = name
            result = getattr(checks, name).evaluate(recording)
            feedback.reset_attempts()
            if "own solution of this exercise" not in (result.message or ""):
                return seen
        return seen

    try:
        plain, salted = inputs(0), inputs(2**40 + 3)
        for right in RIGHT[name]:
            result = getattr(checks, name).evaluate(right)
            feedback.reset_attempts()
            assert result.passed, f"{getattr(right, '__name__', right)}, with the salt: {result.message}"
    finally:
        core.salt_cases(0)
    assert plain and salted - plain, f"{name}: the same inputs with and without the salt"


def test_the_summary_breaks_a_long_failure_between_words(capsys, monkeypatch):
    """A failure's line in ``checks.summary`` is clipped at a word and wrapped at WRAP_WIDTH
    between words (it used to be cut at 160 characters, mid-word, and a browser broke it again)."""
    exercise = EXERCISES["merge_heads"]
    words = " ".join(f"word{i:03d}" for i in range(40))
    result = feedback.CheckResult(exercise, "failed", message=f"✗ 1.2 merge_heads failed\n{words}")
    for other in ("qkv_projection", "scaled_dot_product_attention"):  # left by earlier tests
        monkeypatch.delitem(feedback._LATEST, other, raising=False)
    monkeypatch.setitem(feedback._LATEST, "merge_heads", result)
    checks.summary("01_qkv_shapes")
    lines = capsys.readouterr().out.splitlines()
    assert all(len(line) <= feedback.WRAP_WIDTH for line in lines), lines
    text = " ".join(line.strip() for line in lines)
    assert "1.2 merge_heads (1 pt): failed: word000 word001" in text and text.count("…") == 1
    kept = text.split("merge_heads (1 pt): failed: ")[1].split(" …")[0].split()
    assert kept == words.split()[: len(kept)] and len(kept) > 5  # whole words only, in order
