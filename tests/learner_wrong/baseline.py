"""Run every wrong answer of tests/learner_wrong through its check and write BASELINE.md.

    .venv/bin/python -m tests.learner_wrong.baseline [--only nb01,nb12] [--timeout 300]

Each check runs in-process, as a notebook's check cell would, after `setup(seed=0)` (the first
code cell of every exercise notebook). A check that fails raises with its feedback; one that
passes returns. Results are kept in baseline.json, so `--only` reruns some notebooks and keeps the
others; BASELINE.md is then written from all of them, with the judgement of judgement.py.
"""

import argparse
import contextlib
import importlib
import io
import json
import signal
import time
from pathlib import Path

HERE = Path(__file__).parent
MODULES = ["nb01", "nb02", "nb03", "nb04", "nb07", "nb08", "nb09", "nb10", "nb11", "nb12"]
CLASSES = ["named", "generic", "wrong-cause", "accepted"]


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def run_one(check, fn, timeout):
    """-> (passed, feedback text, seconds, mistake id or '')."""
    buf = io.StringIO()
    start = time.time()
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(timeout)
    passed, text, mid = False, "", ""
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            result = check(fn)
        passed = True
        text = buf.getvalue() + ("" if result is None else str(result))
    except _Timeout:
        text = buf.getvalue() + f"[baseline: the check ran past {timeout} s]"
    except BaseException as e:  # CheckFailed, or the learner's own error escaping the check
        if isinstance(e, KeyboardInterrupt):
            raise
        text = f"{str(e)}" if type(e).__name__ == "CheckFailed" else f"{type(e).__name__}: {e}"
        mid = getattr(e, "mistake_id", "")
        text = buf.getvalue() + text
    finally:
        signal.alarm(0)
    if passed and ("failed" in text.lower() and "✓" not in text):
        passed = False  # a check that printed its failure instead of raising
    return passed, text.strip(), round(time.time() - start, 1), mid


def run(modules, timeout, results=None, store=None):
    """Run the wrong answers of `modules`; merge into `results`, saved to `store` per module."""
    from helpers import checks
    from helpers.runtime import setup

    setup(seed=0)
    out = {} if results is None else results
    for name in modules:
        mod = importlib.import_module(f"tests.learner_wrong.{name}")
        for exercise, wrongs in mod.WRONG.items():
            rows = []
            for desc, fn in wrongs:
                passed, text, secs, mid = run_one(getattr(checks, exercise), fn, timeout)
                rows.append({"desc": desc, "passed": passed, "feedback": text, "seconds": secs, "mistake_id": mid})
                print(f"{name} {exercise}: {'PASSED' if passed else 'rejected'} ({secs} s) {desc}",
                      flush=True)
            out[exercise] = {"module": name, "rows": rows}
        if store is not None:
            store.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    return out


def first_lines(text, n=3):
    """The feedback's first n lines that say something, and its first hint or found line."""
    noise = ("expected starts", "got      starts", "(stuck", "recipe:")
    lines = [x.rstrip() for x in text.splitlines() if x.strip()]
    lines = [x for x in lines if not x.strip().startswith(noise)]
    keep = lines[:n]
    hints = [x for x in lines[n:] if x.strip().startswith(("hint", "found"))]
    return keep + hints[:1]


def write_markdown(results, after=False):
    from tests.learner_wrong.judgement import JUDGED, JUDGED_AFTER

    JUDGED = JUDGED_AFTER if after else JUDGED  # noqa: N806
    order = {m: i for i, m in enumerate(MODULES)}
    exercises = sorted(results, key=lambda e: (order[results[e]["module"]],
                                               list(results).index(e)))
    table, body = [], []
    overall = dict.fromkeys(["written", "rejected", *CLASSES], 0)
    for ex in exercises:
        rows = results[ex]["rows"]
        counts = dict.fromkeys(["written", "rejected", *CLASSES], 0)
        body.append(f"\n## {ex} ({results[ex]['module']})\n")
        for i, row in enumerate(rows, 1):
            cls, note = JUDGED.get(ex, {}).get(row["desc"], ("unjudged", ""))
            if row["passed"]:
                cls = "accepted"
            counts["written"] += 1
            counts["rejected"] += not row["passed"]
            if cls in counts:
                counts[cls] += 1
            status = "PASSED" if row["passed"] else "rejected"
            extra = f" ({note})" if note else ""
            body.append(f"{i}. **{row['desc']}**: {status}, `{cls}`{extra}")
            for line in first_lines(row["feedback"]):
                body.append(f"    > {line}")
        table.append(f"| {ex} | " + " | ".join(str(counts[k]) for k in counts) + " |")
        for k in overall:
            overall[k] += counts[k]
    share = 100 * overall["named"] / max(1, overall["written"])
    head = [
        "# After: the same wrong answers against the checks with diagnosis by property",
        "",
        "The answers of BASELINE.md, run again after issue 32's changes to the checks. Regenerate with",
        "`.venv/bin/python -m tests.learner_wrong.baseline --after` (then `--record` for the test).",
    ] if after else [
        "# Baseline: learner-style wrong answers against the current checks",
        "",
        "Written from the exercise statements only (not the checks, tests or solutions), before",
        "any change to the checks (issue 32). Regenerate with",
        "`.venv/bin/python -m tests.learner_wrong.baseline`.",
        "Classes (judged by hand, judgement.py):",
        "`named` the feedback names this mistake or gives a fact that says exactly what to change;",
        "`generic` only shape/NaN/values-differ text; `wrong-cause` names a different mistake;",
        "`accepted` the check passed it. A check counts failed attempts in-process, so later",
        "answers may also show a `recipe:` line; the judgement reads the feedback before it.",
        "Each entry quotes the feedback's first lines (without the `expected/got starts` lines)",
        "and its first `hint`/`found` line.",
        "",
        f"**Overall: {overall['written']} written, {overall['rejected']} rejected, "
        f"{overall['named']} named ({share:.0f}%), {overall['generic']} generic, "
        f"{overall['wrong-cause']} wrong-cause, {overall['accepted']} accepted.**",
        "",
        "| exercise | written | rejected | named | generic | wrong-cause | accepted |",
        "|---|---|---|---|---|---|---|",
        *table,
        "| **all** | " + " | ".join(str(overall[k]) for k in overall) + " |",
    ]
    (HERE / ("AFTER.md" if after else "BASELINE.md")).write_text("\n".join(head + body) + "\n")
    return overall


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="", help="comma-separated modules, e.g. nb01,nb12")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per check")
    ap.add_argument("--report-only", action="store_true", help="rewrite BASELINE.md only")
    ap.add_argument("--print", action="store_true", help="print each answer's feedback; store nothing")
    ap.add_argument("--after", action="store_true", help="store after.json and write AFTER.md (judgement's CODES_AFTER)")
    ap.add_argument("--record", action="store_true",
                    help="write expected.json (tests/test_learner_wrong.py) from baseline.json")
    args = ap.parse_args()
    if args.record:
        results = json.loads((HERE / "after.json").read_text())
        expected = {ex: [r["mistake_id"] + ("+found" if "\n  found: " in r["feedback"] else "") for r in item["rows"]]
                    for ex, item in results.items() if item["module"] in MODULES}
        (HERE / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
        return
    if args.print:
        modules = args.only.split(",") if args.only else MODULES
        for exercise, item in run(modules, args.timeout).items():
            for i, row in enumerate(item["rows"], 1):
                print(f"\n### {exercise} #{i} {'PASSED' if row['passed'] else 'rejected'}: {row['desc']}")
                print("\n".join(first_lines(row["feedback"])))
        return
    store = HERE / ("after.json" if args.after else "baseline.json")
    results = json.loads(store.read_text()) if store.exists() else {}
    if not args.report_only:
        modules = args.only.split(",") if args.only else MODULES
        results = run(modules, args.timeout, results, store)
    print(write_markdown(results, after=args.after))


if __name__ == "__main__":
    main()
