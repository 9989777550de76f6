"""The class's mistake report (`make grade ... REPORT=dir`, helpers.tools.class_report): stable
mistake ids, mistakes.csv counts exactly what was planted in a generated class, report.html is
self-contained and accessible, feedback per student, pseudonyms, Gradescope's results format."""

from __future__ import annotations

import ast
import csv
import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from helpers import registry
from helpers.checks import EXERCISES, Mistake
from helpers.tools import class_report as cr
from helpers.tools import notebooks as nbtools
from helpers.tools.gradebook import Row, read_gradebook, write_gradebook
from helpers.tools.grading import main as grade_main
from tests import synthetic_class

ROOT = Path(__file__).resolve().parent.parent

# Gradescope's autograder results format (https://gradescope-autograders.readthedocs.io, "Output format").
GRADESCOPE_SCHEMA = {
    "type": "object",
    "required": ["tests"],
    "properties": {
        "score": {"type": "number"},
        "execution_time": {"type": "number"},
        "output": {"type": "string"},
        "visibility": {"enum": ["hidden", "after_due_date", "after_published", "visible"]},
        "stdout_visibility": {"enum": ["hidden", "after_due_date", "after_published", "visible"]},
        "tests": {"type": "array", "items": {
            "type": "object",
            "required": ["score", "max_score", "name"],
            "properties": {
                "score": {"type": "number"}, "max_score": {"type": "number"}, "name": {"type": "string"},
                "number": {"type": "string"}, "output": {"type": "string"},
                "status": {"enum": ["passed", "failed"]},
                "visibility": {"enum": ["hidden", "after_due_date", "after_published", "visible"]},
            },
            "additionalProperties": True,
        }},
    },
}


def _row(student: str, ex: str, status: str, mistake_id: str = "", hint: str = "", points: int = 1,
         notebook: str = "05_multihead", review: str = "", bonus: bool = False) -> Row:
    name = {"5.1": "multi_head_attention", "5.2": "mha_param_count", "5.3": "ablate_head"}.get(ex, "f" + ex)
    mistake = "W_O is missing" if mistake_id.endswith("missing-W_O") else ("not recognised: values" if mistake_id else "")
    return Row(notebook, ex, name, points, status, hint, bonus, student, review, mistake_id, mistake)


# --------------------------------------------------------------------------- mistake ids


def test_a_mistake_is_its_hint_with_a_stable_id():
    m = Mistake("missing-W_O", "W_O is missing: multi-head attention has four D x D matrices.")
    assert m == "W_O is missing: multi-head attention has four D x D matrices." and isinstance(m, str)
    assert m.slug == "missing-W_O" and m.description == "W_O is missing"
    assert {m: 1}["W_O is missing: multi-head attention has four D x D matrices."] == 1  # keys dicts as before
    for bad in ("has space", "", "a--b", "x" * 61, "ünï"):
        with pytest.raises(ValueError, match="slug"):
            Mistake(bad, "hint")


def test_a_recognised_failure_records_its_id_and_an_unrecognised_one_what_differed():
    from helpers import checks

    def without_w_o(d_model, n_heads, bias):
        return 3 * d_model * d_model + (3 * d_model if bias else 0)

    r = checks.mha_param_count.evaluate(without_w_o)
    assert (r.mistake_id, r.mistake) == ("5.2/missing-W_O", "W_O is missing")
    r = checks.mha_param_count.evaluate(lambda d_model, n_heads, bias: 7)
    assert r.mistake_id == "5.2/not-recognised-values" and r.mistake == "not recognised: values"
    r = checks.mha_param_count.evaluate(lambda d_model, n_heads, bias: 1 / 0)
    assert r.mistake_id == "5.2/not-recognised-crash"
    r = checks.mha_param_count.evaluate(lambda d_model, n_heads, bias: None)
    assert r.mistake_id == "5.2/returned-None"
    def blank(d_model, n_heads, bias):
        raise NotImplementedError()

    r = checks.mha_param_count.evaluate(blank)
    assert r.status == "not attempted" and r.mistake_id == ""

    def calls_blank(d_model, n_heads, bias):  # an earlier exercise not written yet is not this one
        return blank(d_model, n_heads, bias)

    r = checks.mha_param_count.evaluate(calls_blank)
    assert (r.status, r.mistake_id) == ("error", "5.2/calls-unfinished-function") and "`blank`" in r.message


def test_every_mistake_slug_is_written_out():
    """A slug built at run time (an f-string, a variable) escapes the list below: every Mistake(...)
    in the checks names its slug as a literal string (a family of mistakes shares one slug; its
    hint and description say which member it is)."""
    built = [f"{path.name}:{node.lineno}" for path, node in nbtools.mistake_calls()
             if isinstance(node, ast.Call) and not isinstance(node.args[0], ast.Constant) and path.stem != "core"]
    assert not built, f"Mistake slugs built at run time: {built}"


def test_mistake_ids_are_stable_across_releases():
    """helpers/checks/mistake_ids.txt lists every slug the checks can record; an id a class's report
    was built with must not disappear or change meaning. Adding a mistake: `make sync` adds its line.
    Removing one: only if no check can make it any more (its line then moves under "retired")."""
    _, current, retired = nbtools.read_mistake_ids()
    code = nbtools.mistake_slugs_in_code()
    assert not code - current, f"new mistake slugs: `make sync` adds them to helpers/checks/mistake_ids.txt: {sorted(code - current)}"
    assert not current - code, (f"mistake slugs gone from the checks: {sorted(current - code)}; ids are stable across "
                                "releases: put them back, or move them under 'retired:' if no check can make them")
    assert not retired & code, f"retired slugs reused: {sorted(retired & code)}"


def test_make_sync_adds_new_mistake_ids_and_keeps_the_rest(tmp_path, monkeypatch):
    listed = tmp_path / "mistake_ids.txt"
    listed.write_text("# header\n\nnb03_masks: b-slug\nnb03_masks: gone-slug\n\nretired:\nnb02_scaling: old\n")
    monkeypatch.setattr(nbtools, "MISTAKE_IDS", listed)
    monkeypatch.setattr(nbtools, "mistake_slugs_in_code",
                        lambda: {"nb03_masks: b-slug", "nb03_masks: a-slug", "core: new-one", "nb02_scaling: old"})
    assert nbtools.sync_mistake_ids() == ["core: new-one", "nb03_masks: a-slug"]  # a retired one is not brought back
    assert listed.read_text() == ("# header\n\ncore: new-one\n\nnb03_masks: a-slug\nnb03_masks: b-slug\n"
                                  "nb03_masks: gone-slug\n\nretired:\nnb02_scaling: old\n")
    before = listed.read_text()
    assert nbtools.sync_mistake_ids() == [] and listed.read_text() == before


# --------------------------------------------------------------------------- statistics and files


def test_the_discrimination_index_is_the_item_rest_correlation_and_ignores_names():
    rest = {"a": 0.0, "b": 0.0, "c": 10.0, "d": 10.0}
    assert cr.discrimination({"a": False, "b": False, "c": True, "d": True}, rest) == pytest.approx(1.0)
    assert cr.discrimination({"a": True, "b": True, "c": False, "d": False}, rest) == pytest.approx(-1.0)
    # by hand: x = 1, 0, 1, 0 against y = 1, 2, 3, 4: cov = -0.25, sd_x = 0.5, sd_y = sqrt(1.25): r = -0.447
    got = cr.discrimination({"a": True, "b": False, "c": True, "d": False}, {"a": 1, "b": 2, "c": 3, "d": 4})
    assert got == pytest.approx(-0.25 / (0.5 * 1.25 ** 0.5))
    assert cr.discrimination(dict.fromkeys(rest, True), rest) is None  # everyone passed: nothing to separate
    assert cr.discrimination({"a": True, "b": False, "c": True}, {"a": 1, "b": 2, "c": 3}) is None
    # Renaming students (ties on the rest included) changes nothing.
    passed, rest = {"b": True, "c": False, "d": True, "e": False}, {"b": 1, "c": 1, "d": 2, "e": 0}
    renamed = {"z" + k: v for k, v in passed.items()}
    assert cr.discrimination(passed, rest) == cr.discrimination(renamed, {"z" + k: v for k, v in rest.items()})


def test_a_missing_discrimination_says_why_in_the_report(tmp_path):
    """"n/a" alone left a teacher of a small class guessing: the table gives the reason, and the
    legend names the minimum class size."""
    rest4 = {"a": 0.0, "b": 1.0, "c": 2.0, "d": 3.0}
    three = {"a": True, "b": False, "c": True}
    assert cr.MIN_STUDENTS_FOR_DISCRIMINATION == 4
    assert cr.no_discrimination_reason(three, rest4) == "3 handed in, fewer than the 4 a correlation needs"
    assert cr.no_discrimination_reason(dict.fromkeys(rest4, True), rest4) == "all of the 4 who handed in passed"
    assert cr.no_discrimination_reason(dict.fromkeys(rest4, False), rest4) == "none of the 4 who handed in passed"
    split = {"a": True, "b": False, "c": True, "d": False}
    assert cr.no_discrimination_reason(split, dict.fromkeys(rest4, 5.0)).startswith("everyone has the same")
    assert cr.no_discrimination_reason(split, rest4) == "" and cr.discrimination(split, rest4) is not None
    for passed, rest in ((three, rest4), (dict.fromkeys(rest4, True), rest4), (split, dict.fromkeys(rest4, 5.0))):
        assert cr.discrimination(passed, rest) is None and cr.no_discrimination_reason(passed, rest)
    rows = [_row(s, "5.2", "passed" if s != "bob" else "failed", "5.2/missing-W_O" if s == "bob" else "")
            for s in ("ann", "bob", "cy")] + [_row(s, "5.1", "passed", points=2) for s in ("ann", "bob", "cy")]
    (s51, s52) = cr.exercise_stats(rows)
    assert s52.discrimination is None and s52.no_discrimination.startswith("3 handed in, fewer than the 4")
    cr.write_report(rows, tmp_path, info={})
    page = (tmp_path / "report.html").read_text()
    assert "n/a <span class=\"note\">(3 handed in, fewer than the 4 a correlation needs)</span>" in page
    assert "n/a <span class=\"note\">(all of the 3 who handed in passed)</span>" not in page  # 5.1: too few first
    assert "fewer than 4 students handed the notebook in" in page  # the legend


def test_mistakes_csv_counts_students_per_mistake_and_attempts(tmp_path):
    rows = [_row("ann", "5.2", "failed", "5.2/missing-W_O", "W_O is missing: four."),
            _row("bob", "5.2", "failed", "5.2/missing-W_O", "W_O is missing: four."),
            _row("cy", "5.2", "failed", "5.2/not-recognised-values", "parameters: expected 10, got 7."),
            _row("dee", "5.2", "not attempted"), _row("eve", "5.2", "passed"), _row("fay", "5.2", "missing"),
            _row("ann", "5.1", "passed", points=2), _row("bob", "5.1", "error", "5.1/not-recognised-crash", points=2)]
    cr.write_report(rows, tmp_path, info={})
    with open(tmp_path / "mistakes.csv", newline="") as f:
        got = list(csv.DictReader(f))
    assert tuple(got[0]) == cr.MISTAKES_FIELDS
    assert [(g["exercise"], g["mistake_id"], g["students"], g["attempted"]) for g in got] == [
        ("5.1", "5.1/not-recognised-crash", "1", "2"),
        ("5.2", "5.2/missing-W_O", "2", "4"), ("5.2", "5.2/not-recognised-values", "1", "4")]
    assert got[1]["mistake"] == "W_O is missing" and got[1]["hint"] == "W_O is missing: four."
    (stats_51, stats_52) = cr.exercise_stats(rows)
    assert (stats_52.students, stats_52.passed, stats_52.failed, stats_52.not_attempted) == (6, 1, 3, 2)
    assert stats_52.mean_points == pytest.approx(1 / 6)


def test_course_info_is_the_registry_read_without_torch():
    """The report's titles and sections come from helpers/registry.py, in a process that imports no
    torch (the class report runs on a gradebook alone)."""
    code = ("import json, sys\nfrom helpers.tools import class_report as cr\ninfo = cr.course_info()\n"
            "print(json.dumps({'torch': 'torch' in sys.modules, 'info': {k: [v.title, v.section] for k, v in info.items()}}))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout)
    assert not out["torch"], "course_info imported torch"
    assert out["info"] == {e.name: [e.title, e.section or ""] for e in registry.by_name().values()}


def test_the_gradebook_round_trips_and_shards_merge(tmp_path, capsys):
    rows = [_row("ann", "5.2", "failed", "5.2/missing-W_O", "W_O is missing: four.", review="a forged message"),
            _row("bob", "5.2", "passed")]
    write_gradebook(rows[:1], tmp_path / "a.csv")
    write_gradebook(rows[1:], tmp_path / "b.csv")
    assert read_gradebook(tmp_path / "a.csv") + read_gradebook(tmp_path / "b.csv") == rows
    assert cr.main([str(tmp_path / "a.csv"), str(tmp_path / "b.csv"), "--out", str(tmp_path / "merged")]) == 0
    cr.write_report(rows, tmp_path / "whole", info={})
    assert (tmp_path / "merged" / "mistakes.csv").read_text() == (tmp_path / "whole" / "mistakes.csv").read_text()
    (tmp_path / "bad.csv").write_text("name,score\nann,3\n")
    assert cr.main([str(tmp_path / "bad.csv"), "--out", str(tmp_path / "x")]) == 2
    assert "not a gradebook of `make grade`" in capsys.readouterr().err


def test_report_html_is_self_contained_accessible_and_escapes_names(tmp_path):
    hostile = '<script>alert("x")</script>'
    rows = [_row(hostile, "5.2", "failed", "5.2/missing-W_O", "W_O is missing: <b>four</b>.", review="odd <i>"),
            _row("bob", "5.2", "passed"), _row("cy", "5.2", "not attempted")]
    cr.write_report(rows, tmp_path, info={"mha_param_count": cr.Info("parameters", "3. Parameters and FLOPs")},
                    repo="https://github.com/attention-course/attention-course")
    page = (tmp_path / "report.html").read_text()
    assert "<script" not in page and "&lt;script&gt;" in page and "<b>four" not in page
    assert not re.search(r'(src|href)="(?!#|https://github.com/attention-course/)', page)  # nothing loaded
    assert page.count('role="img"') == 2 and page.count("<desc") == 2  # histogram + one notebook chart
    assert "5.2 mha_param_count: 1 passed, 1 failed, 1 not attempted" in page
    assert '<th scope="col">' in page and "<caption>" in page and 'lang="en"' in page
    assert "section 3. Parameters and FLOPs" in page and "Marked for review" in page


def test_anonymised_reports_use_stable_pseudonyms_under_a_key_kept_elsewhere(tmp_path, monkeypatch):
    monkeypatch.setenv(cr.KEY_ENV, str(tmp_path / "secret" / "pseudonym.key"))
    rows = [_row("Ada Lovelace", "5.2", "failed", "5.2/missing-W_O", review="threads left running"),
            _row("bob", "5.2", "passed")]
    out = tmp_path / "report"
    cr.write_report(rows, out, anonymise=True, info={})
    first = (out / "report.html").read_text()
    assert "Ada Lovelace" not in first and re.search(r"learner-[0-9a-f]{10}", first)
    assert not list(out.rglob("*.key")) and (tmp_path / "secret" / "pseudonym.key").exists()  # not in the report
    cr.write_report(rows, out, anonymise=True, info={})
    assert (out / "report.html").read_text() == first  # same key, same pseudonyms
    cr.write_report(rows, tmp_path / "other", anonymise=True, info={}, key=tmp_path / "other.key")
    assert (tmp_path / "other" / "report.html").read_text() != first  # another key, other pseudonyms
    assert (out / "feedback" / "Ada Lovelace" / "05_multihead.md").exists()  # feedback goes back to Ada
    (tmp_path / "empty.key").write_text("\n")
    with pytest.raises(ValueError, match="empty.key is not a pseudonym key"):
        cr.write_report(rows, tmp_path / "third", anonymise=True, info={}, key=tmp_path / "empty.key")


def test_feedback_folders_are_distinct_and_safe_for_any_name(tmp_path):
    names = ["Ann?Lee", "Ann_Lee", "ann_lee", ".", "..", "student", "x" * 300, "=1+1", "bob"]
    where = cr.folders(names)
    assert len({w.casefold() for w in where.values()}) == len(names), where
    assert where["bob"] == "bob" and all(len(w) <= 80 and w not in (".", "..") for w in where.values())
    rows = [_row(n, "5.2", "failed", "5.2/missing-W_O", "W_O is missing: <img src=x> ![t](http://e/t.png)")
            for n in names]
    cr.write_report(rows, tmp_path, gradescope=True, info={})
    with open(tmp_path / "feedback" / "index.csv", newline="") as f:
        index = {r["student"].removeprefix("'"): r["folder"] for r in csv.DictReader(f)}
    assert index == where
    text = (tmp_path / "feedback" / where["Ann?Lee"] / "05_multihead.md").read_text()
    assert "feedback for Ann?Lee" in text and not re.search(r"(?<!\\)<img|(?<!\\)!(?!\\)\[t\]\(", text), text
    assert len(list((tmp_path / "gradescope").iterdir())) == len(names)


def test_feedback_and_gradescope_results(tmp_path):
    rows = [_row("ann", "5.1", "passed", points=2),
            _row("ann", "5.2", "failed", "5.2/missing-W_O", "W_O is missing: four D x D matrices."),
            _row("ann", "5.4", "not attempted", points=3, bonus=True)]
    cr.write_report(rows, tmp_path, gradescope=True,
                    info={"mha_param_count": cr.Info("parameters", "3. Parameters and FLOPs")})
    text = (tmp_path / "feedback" / "ann" / "05_multihead.md").read_text()
    assert "Score: 2/3 points + 0/3 bonus." in text
    assert "**What went wrong:** W_O is missing (`5.2/missing-W_O`)." in text and "four D x D" in text
    assert "section 3. Parameters and FLOPs" in text
    assert "Passed. The model answer" in text  # the model answer of 5.1, from helpers/model_answers.json
    results = json.loads((tmp_path / "gradescope" / "ann" / "results.json").read_text())
    jsonschema.validate(results, GRADESCOPE_SCHEMA)
    assert results["score"] == 2.0 and [t["max_score"] for t in results["tests"]] == [2.0, 1.0, 0.0]
    assert "W_O is missing" in results["tests"][1]["output"]
    assert "**Model answer.**" not in text  # the answer's own bold label is not repeated


@pytest.mark.slow
def test_grading_a_class_writes_the_report_with_exactly_the_planted_mistakes(tmp_path, capsys):
    """Students built from tests' wrong implementations: mistakes.csv counts exactly what was planted.
    Slow (a class of 5 graded, ~17 s on 2 cores): make test keeps each link cheaply: the grader's rows
    carry the judge's mistake id (tests/test_grading.py, the cheats' rows), mistakes.csv counts rows
    (test_mistakes_csv_counts_students_per_mistake_and_attempts), --report writes it
    (test_the_gradebook_goes_where_the_instructor_says), results.json (test_feedback_and_gradescope_results)."""
    plan = synthetic_class.build(tmp_path / "class", students=5, seed=3, notebooks=["03_masks"], skills=(0.0, 0.4))
    expected: dict[str, int] = {}
    attempted: dict[str, int] = {}
    for notebooks in plan.values():
        for name, what in notebooks["03_masks"].items():
            ex = EXERCISES[name].id
            attempted[ex] = attempted.get(ex, 0) + (what["kind"] != "blank")
            if what["kind"] == "wrong":
                expected[what["mistake_id"]] = expected.get(what["mistake_id"], 0) + 1
    assert len(expected) >= 4, expected  # enough different mistakes for the test to mean something
    report = tmp_path / "report"
    grade_main([str(tmp_path / "class"), "--report", str(report), "--gradescope", "--no-progress",
                "--gradebook", str(tmp_path / "gradebook.csv")])
    with open(report / "mistakes.csv", newline="") as f:
        got = list(csv.DictReader(f))
    assert {g["mistake_id"]: int(g["students"]) for g in got} == expected
    assert all(int(g["attempted"]) == attempted[g["exercise"]] for g in got)
    for student in plan:
        jsonschema.validate(json.loads((report / "gradescope" / student / "results.json").read_text()),
                            GRADESCOPE_SCHEMA)
    assert "report: " in capsys.readouterr().out


@pytest.mark.parametrize(("sent", "kept"), [
    ("modified-input-in-place", "modified-input-in-place"), ("missing-W_O", ""), (["x"], ""), ({"a": 1}, ""),
    ("5.2/called-the-reference", ""), (None, "")])
def test_a_mistake_sent_by_the_notebooks_process_is_kept_only_from_the_call_guards_own_set(monkeypatch, sent, kept):
    """The notebook's process says why a call failed in the call guard's words; anything else it
    sends as a mistake (another id, an unhashable object) is dropped, never a crash of the judge."""
    from helpers.checks import calling

    reply = {"status": "fail", "message": "m", "hint": "h", "kind": "CheckFailed", "mistake": sent}
    monkeypatch.setattr(calling, "ask", lambda conn, request, wait: reply)
    outcome = calling.Remote(None, "mha_param_count", {"callable": True}, 1.0).call(
        (), {}, None, None, {"time_limit": 1.0})
    assert outcome["mistake"] == kept
