"""Unit tests of the check machinery (helpers/checks/core.py, feedback.py, guard.py): graduated hints, the integrity
guard, plain outputs, the call's safety net, recording, the interactive "not attempted" notice,
model answers, and how a failure looks in a real Jupyter kernel."""

from __future__ import annotations

import collections
import functools
import json
import os
import signal
import subprocess
import sys
import types
from pathlib import Path

import nbformat
import numpy as np
import pytest
import torch

import helpers.nb01_qkv_shapes as att
from helpers import checks, reference
from helpers.checks import EXERCISES, CheckFailed, core, feedback, guard
from helpers.tools import notebooks as nbtools

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(core, "DEFAULT_TIME_LIMIT_S", 30.0)
    feedback.reset_attempts()
    yield
    assert guard.verify_integrity(restore=True) == [], "a test left something replaced"


@pytest.fixture
def toy():
    """A registered toy check (removed again afterwards): 2 * x, with one recognised mistake."""

    @core.exercise("0.1", "double a tensor", points=1, stars=1, notebook="01_qkv_shapes", section="2. Shapes")
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
    assert "fails again, it shows a step-by-step recipe" in message
    assert e.recognised and e.instructor_hint == "you added 2 instead of multiplying by 2."


def test_an_unrecognised_failure_says_what_differs_and_where_to_look_then_the_recipe(toy):
    first = _fails(toy, lambda x: 3 * x)
    assert "values differ at 5 of 6 entries" in str(first)
    assert "see: notebooks/01_qkv_shapes.ipynb, section 2. Shapes" in str(first)
    assert "return 2 * x" not in str(first) and "hint:" not in str(first)
    assert not first.recognised and first.recipe == "return 2 * x"
    assert first.instructor_hint.startswith("output: values differ at 5 of 6 entries")
    second = _fails(toy, lambda x: 3 * x)
    assert "recipe: return 2 * x" in str(second)


def test_repeats_are_counted_per_exercise(toy):
    _fails(checks.merge_heads, lambda o: o.reshape(o.shape[0], o.shape[2], -1) * 3)
    assert "recipe:" not in str(_fails(toy, lambda x: 3 * x))


def test_exercise_pointer_without_a_section():
    ex = feedback.Exercise("9.9", "x", "t", 1, 1, "09_flash_attention")
    assert ex.pointer == "notebooks/09_flash_attention.ipynb"


# --------------------------------------------------------------------------- presentation


def test_messages_wrap_at_word_boundaries():
    long = "  hint: " + " ".join(f"word{i}" for i in range(60)) + " torch.softmax(q @ k.transpose(-2, -1))"
    wrapped = feedback.wrap("1.1 x failed\n" + long)
    lines = wrapped.split("\n")
    assert max(len(line) for line in lines) <= feedback.WRAP_WIDTH
    assert " ".join(wrapped.split()) == " ".join(("1.1 x failed\n" + long).split())  # no word was cut
    assert all(line.startswith("        ") for line in lines[2:])  # continues under the hint's text


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


def test_every_exercise_with_a_solution_has_a_model_answer():
    answers = nbtools.model_answers()
    solved = {path.stem for path in nbtools.notebook_paths("solutions")}
    missing = [n for n, ex in EXERCISES.items() if ex.notebook in solved and n not in answers]
    assert not missing, f"no model-answer cell after the check of {missing}"


def test_model_answers_are_package_data():
    import tomllib

    with open(ROOT / "pyproject.toml", "rb") as f:
        data = tomllib.load(f)["tool"]["setuptools"]["package-data"]
    assert nbtools.MODEL_ANSWERS_PATH.name in data["helpers"]


@pytest.mark.slow
def test_an_installed_package_carries_the_model_answers(tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), str(ROOT)],
                   check=True, capture_output=True)
    assert (target / "helpers" / nbtools.MODEL_ANSWERS_PATH.name).read_text(encoding="utf-8") == \
        nbtools.MODEL_ANSWERS_PATH.read_text(encoding="utf-8")


# --------------------------------------------------------------------------- the integrity guard


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
    with pytest.raises(CheckFailed, match="expected 9,007,199,254,740,993"):
        _trial(None).number(2**53, 2**53 + 1, integer=True)


def test_device_and_dtype_are_checked_before_any_mistake_is_matched():
    called = []
    mistakes = {"never": lambda: called.append(1) or torch.zeros(2)}
    with pytest.raises(CheckFailed, match="got one on the meta device"):
        _trial(None).tensor(torch.zeros(2, device="meta"), torch.zeros(2), mistakes=mistakes)
    with pytest.raises(CheckFailed, match="expected dtype torch.float32"):
        _trial(None).tensor(torch.zeros(2, dtype=torch.float64), torch.zeros(2), mistakes=mistakes)
    assert not called


def test_a_mistake_model_that_crashes_is_skipped():
    with pytest.raises(CheckFailed, match="values differ"):
        _trial(None).tensor(torch.ones(2), torch.zeros(2), mistakes={"boom": lambda: 1 / 0})


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
    with pytest.raises(checks.NotAttempted):
        _trial(lambda: (_ for _ in ()).throw(NotImplementedError())).call()

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


# --------------------------------------------------------------------------- a real Jupyter kernel


@pytest.mark.slow
def test_in_a_kernel_failures_are_short_and_run_all_reaches_every_exercise(tmp_path):
    """Run All in an exercise-like notebook: a stub shows a notice and does not stop; a wrong
    function shows its message alone (error output, no machinery traceback); a pass shows the
    model answer; with the grading variable set a stub raises."""
    from nbclient import NotebookClient

    cells = [
        "import os\nos.environ.pop('ATTN_COURSE_RAISE_NOT_ATTEMPTED', None)\nfrom helpers import checks",
        "def merge_heads(o):\n    raise NotImplementedError()\n\nchecks.merge_heads(merge_heads)",
        "def merge_heads(o):\n    return o.reshape(o.shape[0], o.shape[2], -1)\n\nchecks.merge_heads(merge_heads)",
        "def merge_heads(o):\n    return o.transpose(1, 2).flatten(2)\n\nchecks.merge_heads(merge_heads)",
        "os.environ['ATTN_COURSE_RAISE_NOT_ATTEMPTED'] = '1'\n"
        "def merge_heads(o):\n    raise NotImplementedError()\n\nchecks.merge_heads(merge_heads)",
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    env = {k: v for k, v in os.environ.items() if k != feedback.RAISE_NOT_ATTEMPTED_ENV}
    env["PYTHONPATH"] = str(ROOT)
    NotebookClient(nb, timeout=120, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(tmp_path)}}).execute(env=env)
    outs = [c.outputs for c in nb.cells]
    assert outs[1][0]["output_type"] == "stream" and "◻ 1.2 merge_heads: not attempted yet" in outs[1][0]["text"]
    (error,) = [o for o in outs[2] if o["output_type"] == "error"]
    assert error["ename"] == "CheckFailed"
    tb = "\n".join(error["traceback"])
    assert "✗ 1.2 merge_heads failed" in tb and "transpose(1, 2) first" in tb
    assert "File " not in tb and "core.py" not in tb and "guard.py" not in tb and "Traceback" not in tb
    assert outs[3][0]["text"].startswith("✓ 1.2 merge_heads")
    assert "<details>" in outs[3][1]["data"]["text/markdown"]
    assert [o for o in outs[4] if o["output_type"] == "error"][0]["ename"] == "NotAttempted"


@pytest.mark.slow
@pytest.mark.parametrize("path", nbtools.notebook_paths("exercises"), ids=lambda p: p.stem)
def test_run_all_of_a_blank_exercise_notebook_reaches_every_exercise(path, tmp_path):
    """A learner's "Run All" on a blank notebook: no cell stops it, every check says "not
    attempted yet" (interactive session: the grading variable is not set)."""
    from nbclient import NotebookClient

    nb = nbtools.read(path)
    env = {k: v for k, v in os.environ.items() if k != feedback.RAISE_NOT_ATTEMPTED_ENV}
    env["PYTHONPATH"] = str(ROOT)
    NotebookClient(nb, timeout=300, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(path.parent)}}).execute(env=env)
    errors = [(i, o["ename"], o["evalue"][:200]) for i, c in enumerate(nb.cells) if c.cell_type == "code"
              for o in c.outputs if o["output_type"] == "error"]
    assert not errors, f"Run All stops in {path.name}: {errors}"
    notices = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    names = {n for n, ex in EXERCISES.items() if ex.notebook == path.stem}
    assert all(f"{name}: not attempted yet" in notices for name in names), notices[-2000:]


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
