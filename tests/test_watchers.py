"""The watchers (helpers/checks/watchers.py) and what their observations may decide.

- The module imports only the checks' machinery: in a fresh interpreter that has ``helpers.checks``
  without its ``__init__`` (as ``make grade``'s sandbox has it: no check modules), importing and
  running every watcher loads no ``core``, ``diagnose``, check module ``nbNN_*`` or
  ``helpers.reference``.
- Every watcher a check hands to ``Trial.call_watched`` is one of its functions (the notebook's
  process looks watchers up there by name).
- Observations advise, values decide: for every watched exercise, a wrong implementation that the
  check fails from observations (autograd used, an op log, no kernel launched, ...) fails with its
  mistake id in a learner's session, and through a Remote (``make grade``'s judge; here a stand-in
  that runs the protected call in this process and sends its outcome through the same encoding)
  gets the verdict of its returned values plus a review note; failures decided from values are the
  same both ways.
"""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import checks
from helpers.checks import EXERCISES, Mistake, core, feedback, guard
from helpers.checks.calling import Remote, _run_watcher, decode, dumps, encode, loads, protected_call
from helpers.runtime import configure_triton

configure_triton()  # as setup() does in a notebook: Triton's interpreter on before any kernel exists

import tests.test_nb02_scaling as t02  # noqa: E402
import tests.test_nb04_backward as t04  # noqa: E402
import tests.test_nb06_kv_sharing as t06  # noqa: E402
import tests.test_nb09_flash_attention as t09  # noqa: E402
import tests.test_nb12_triton_decode as t12  # noqa: E402
from tests.exercise_cases import first_fast  # noqa: E402
from tests.test_machinery import WATCHED  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CHECKS_DIR = ROOT / "helpers" / "checks"


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(core, "DEFAULT_TIME_LIMIT_S", 120.0)  # the Triton interpreter is slow
    feedback.reset_attempts()
    yield
    assert guard.verify_integrity(restore=True) == [], "a test left something replaced"


# =========================================================================== what the module imports

_SANDBOXED = r'''
import json, re, sys, types
root = sys.argv[1]
sys.path.insert(0, root)
import helpers
from helpers.runtime import configure_triton
configure_triton()
FORBIDDEN = re.compile(r"helpers\.(reference|checks\.(core|diagnose|nb\d\d_\w+))$")

class Refuse:
    """Makes an import of a forbidden module fail loudly, wherever it is tried."""
    def find_spec(self, name, path=None, target=None):
        if FORBIDDEN.match(name):
            raise ImportError(f"watchers imported {name}")
        return None

sys.meta_path.insert(0, Refuse())
package = types.ModuleType("helpers.checks")  # the package without its __init__, as in the sandbox
package.__path__ = [root + "/helpers/checks"]
sys.modules["helpers.checks"] = package
import torch
from helpers.checks import watchers as w

def std(d_k, n, g):
    return float((torch.randn(n, d_k, generator=g) * torch.randn(n, d_k, generator=g)).sum(-1).std())

def backward(q, k, v, dO, causal):
    p = torch.softmax(q @ k.mT / q.shape[-1] ** 0.5, -1)
    ds = p * (dO @ v.mT - (p * (dO @ v.mT)).sum(-1, keepdim=True)) / q.shape[-1] ** 0.5
    return ds @ k, ds.mT @ q, p.mT @ dO

x = torch.randn(2, 3, 4, 8)
w.rng(std, (4, 10, torch.Generator().manual_seed(0)), None)
w.seeds(std, (4, 10), [1, 2])
w.backward(backward, (x, x, x, x, False), None)
w.ops(torch.add, (x, x), None)
w.logged(torch.add, (x, x), {"x": 0})
w.kernel(lambda q, k, v, causal: q + k + v, (x, x, x, False), {"sources": {"q": 0, "k": 1, "v": 2}, "is_reference": False})
pages = torch.randn(3, 4, 2, 8)
w.decode(lambda *a: a[0] * 2, (torch.randn(2, 4, 8), pages, pages, torch.zeros(2, 2, dtype=torch.int32),
                               torch.ones(2, dtype=torch.int32), 1, None), {"is_reference": False})
print(json.dumps(sorted(m for m in sys.modules if m == "helpers" or m.startswith("helpers."))))
'''


@pytest.mark.slow  # a fresh interpreter (~4 s); make grade's own run of them is tests/test_forgery.py
def test_watchers_import_and_run_with_the_machinery_alone():
    """In a fresh interpreter, with ``helpers.checks`` as the sandbox has it (no check modules):
    importing watchers.py and running every watcher loads only the machinery and lesson modules."""
    done = subprocess.run([sys.executable, "-c", _SANDBOXED, str(ROOT)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert "helpers.checks.watchers" in loaded
    forbidden = [m for m in loaded if m == "helpers.reference" or m in ("helpers.checks.core", "helpers.checks.diagnose")
                 or m.startswith("helpers.checks.nb")]
    assert not forbidden, forbidden
    machinery = {"helpers.checks", "helpers.checks.guard", "helpers.checks.feedback", "helpers.checks.instruments",
                 "helpers.checks.watchers"}
    assert {m for m in loaded if m.startswith("helpers.checks")} <= machinery, loaded


def _watcher_arguments() -> list[tuple[str, str, set[str]]]:
    """(file, the first argument of each ``call_watched(...)`` in it, names it imports from .watchers)."""
    found = []
    for path in sorted(CHECKS_DIR.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        imported = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                    and node.module == "watchers" for a in node.names}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "call_watched":
                found.append((path.name, ast.unparse(node.args[0]), imported))
    return found


def test_every_watcher_a_check_uses_is_in_the_watchers_module():
    uses = _watcher_arguments()
    assert len(uses) >= 7, uses  # 2.3 (two), 4.3, 6.4, 9.1-9.2, 9.3-9.4, 12.4
    for file, arg, imported in uses:
        assert arg.startswith("watchers.") or arg in imported, f"{file}: call_watched({arg}, ...)"
    from helpers.checks import watchers

    for file, arg, _ in uses:
        fn = getattr(watchers, arg.removeprefix("watchers."))
        assert fn.__module__ == "helpers.checks.watchers" and fn.__doc__, (file, arg)


# =========================================================================== observations advise in make grade


def local_remote(name: str, fn) -> Remote:
    """A :class:`Remote` whose calls run here: the protected call the notebook's process makes (the
    watcher looked up by module and name, as the notebook's side does), and its output and
    observations sent through the encoding of the real channel. (``Trial`` tells a Remote by its
    exact type, so this is a Remote whose ``call`` is replaced, not a subclass.)"""
    remote = Remote(None, name, {"callable": True, "describe": "a function",
                                 "is_reference": bool(guard.is_course_reference(fn, name))}, 1.0)

    def call(args, kwargs, watcher, options, spec):
        target = fn
        if watcher is not None:
            assert watcher.__module__ == "helpers.checks.watchers", watcher.__module__
            resolved = importlib.import_module(watcher.__module__)
            for part in watcher.__qualname__.split("."):
                resolved = getattr(resolved, part)
            target = _run_watcher(resolved, fn, options)
        outcome = protected_call(target, args, kwargs, learner=fn, watched=watcher is not None, **spec)
        if outcome["status"] == "ok":
            crossed = lambda x: decode(loads(dumps(encode(x))))  # noqa: E731
            outcome = {**outcome, "out": crossed(outcome["out"]), "obs": crossed(outcome["obs"])}
        return outcome

    remote.call = call  # an instance attribute: Trial._call calls self.fn.call
    return remote


def _case(name: str, module, wrong: str, observed: str, graded: str):
    """One wrong implementation: its mistake id in a learner's session (decided from observations)
    and what ``make grade`` makes of it ("passed", or the mistake id its values give)."""
    fn = getattr(module, wrong, None)
    marks = [pytest.mark.skipif(fn is None, reason="Triton is Linux-only"),
             pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]  # NumPy on -inf rows
    return pytest.param(name, fn, f"{EXERCISES[name].id}/{observed}", graded, id=f"{name}-{wrong}", marks=marks)


OBSERVED = [
    _case("dot_product_std", t02, "std_partly_global", "used-global-rng", "passed"),
    _case("dot_product_std", t02, "std_global_rng", "used-global-rng", "2.3/not-recognised-other"),
    _case("dot_product_std", t02, "std_reseeds_given_generator", "reseeded-generator", "2.3/not-recognised-other"),
    _case("attention_backward", t04, "ab_autograd", "used-autograd", "passed"),
    _case("attention_backward", t04, "ab_finite_differences", "finite-differences", "4.3/not-recognised-type"),
    _case("mla_absorbed_scores", t06, "mla_forms_keys", "formed-per-head-keys", "passed"),
    _case("online_softmax", t09, "online_numpy_whole_row", "data-left-torch", "passed"),
    _case("online_softmax", t09, "online_max_of_whole_row_first", "whole-rows-reduced", "passed"),
    _case("flash_attention_tiled", t09, "tiled_calls_sdpa", "called-fused-attention", "passed"),
    _case("flash_attention_triton", t09, "triton_forward_in_pytorch", "no-kernel-launched", "passed"),
    _case("flash_attention_triton_backward", t09, "triton_backward_in_pytorch", "no-kernel-launched", "passed"),
    _case("paged_decode_triton", t12, "decode_in_pytorch", "no-kernel", "passed"),
]


def test_every_watched_exercise_has_a_case():
    assert {p.values[0] for p in OBSERVED} == WATCHED


@pytest.mark.parametrize(("name", "wrong", "observed", "graded"), first_fast(OBSERVED, {n: 1 for n in WATCHED}))
def test_an_observed_mistake_fails_in_session_and_is_a_review_note_in_make_grade(name, wrong, observed, graded):
    check, ex = getattr(checks, name), EXERCISES[name]
    mine = check.evaluate(wrong)
    assert (mine.status, mine.mistake_id) == ("failed", observed), mine.message
    assert not mine.review, mine.review
    feedback.reset_attempts()
    judged = check.evaluate(local_remote(name, wrong))
    assert (judged.status if graded == "passed" else judged.mistake_id) == graded, judged.message
    assert judged.mistake_id != observed
    notes = [r for r in judged.review if f"[{observed}]" in r]
    assert len(notes) == 1, judged.review
    assert notes[0].startswith(f"{ex.id} {name}: ") and "advisory" in notes[0] and "notebook's own process" in notes[0]
    assert len(notes[0]) < 300, notes[0]


VALUES = [
    pytest.param("dot_product_std", t02.std_returns_variance, id="dot_product_std-std_returns_variance"),
    pytest.param("attention_backward", t04.ab_wrong_order, id="attention_backward-ab_wrong_order"),
    pytest.param("mla_absorbed_scores", t06.mla_scaled, id="mla_absorbed_scores-mla_scaled"),
    pytest.param("online_softmax", t09.online_no_rescale, id="online_softmax-online_no_rescale"),
]


@pytest.mark.parametrize(("name", "wrong"), VALUES)
def test_a_mistake_decided_from_values_is_the_same_in_both_modes(name, wrong):
    check = getattr(checks, name)
    mine = check.evaluate(wrong)
    feedback.reset_attempts()
    judged = check.evaluate(local_remote(name, wrong))
    assert mine.status == judged.status == "failed"
    assert (mine.mistake_id, mine.message) == (judged.mistake_id, judged.message)
    assert not mine.review and not judged.review, (mine.review, judged.review)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dot_product_std", "attention_backward", "mla_absorbed_scores", "online_softmax"])
def test_the_reference_through_a_remote_passes_without_notes(name):
    from helpers import reference

    judged = getattr(checks, name).evaluate(local_remote(name, getattr(reference, name)))
    assert judged.passed and not judged.review, (judged.message, judged.review)


def test_fail_observed_is_fail_in_a_session_and_one_note_per_mistake_in_make_grade():
    ex = EXERCISES["merge_heads"]
    mistake = Mistake("toy-observed", "do it the other way.", "did it the watched way")
    session = core.Trial(ex, lambda o: o)
    with pytest.raises(checks.CheckFailed) as failed:
        session.fail("your function did it the watched way.", mistake)
    with pytest.raises(checks.CheckFailed) as observed:
        session.fail_observed("your function did it the watched way.", mistake)
    assert str(observed.value) == str(failed.value)
    assert observed.value.mistake_id == failed.value.mistake_id == f"{ex.id}/toy-observed"
    assert session.review == []
    graded = core.Trial(ex, Remote(None, ex.name, {"callable": True}, 1.0))
    assert graded.fail_observed("your function did it the watched way.", mistake) is None
    graded.fail_observed("Your function did it the watched way again.", mistake)  # the same mistake: no second note
    graded.fail_observed("your output was looked at.")  # no mistake named: noted as not recognised
    assert graded.review == [
        f"{ex.id} merge_heads: the function did it the watched way [{ex.id}/toy-observed]; advisory, as it was "
        "observed in the notebook's own process",
        f"{ex.id} merge_heads: the output was looked at [{ex.id}/not-recognised-other]; advisory, as it was "
        "observed in the notebook's own process"]
