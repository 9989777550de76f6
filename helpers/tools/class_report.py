"""What the class got wrong: the report ``make grade ... REPORT=dir`` writes (``--report DIR``).

Built from gradebook rows alone (:class:`~helpers.tools.gradebook.Row`), so the report of a class
graded in shards is the report of their gradebooks concatenated::

    python -m helpers.tools.class_report shard-*/gradebook.csv --out report [--anonymise] [--gradescope]

It writes, in DIR:

- ``mistakes.csv``: one row per (notebook, exercise, mistake) that someone made: ``notebook``,
  ``exercise``, ``mistake_id`` (``5.2/missing-W_O``; ``<id>/not-recognised-<what>`` for a failure
  no check named), ``mistake`` (one line), ``students`` (how many made it on their graded attempt),
  ``attempted`` (how many attempted the exercise), then ``hint`` (what most of them were shown);
- ``report.html``: one self-contained page (inline SVG charts with text alternatives, tables with
  headers, no script, no network): per notebook, passed / failed / not attempted per exercise, each
  exercise's mean points, share passed and discrimination index, its most common mistakes with the
  hint shown and the section that teaches it; the notebooks marked for review;
- ``feedback/<student>/<notebook>.md``: what each student gets back: per exercise the points, the
  named mistake and its hint, where to revisit, and the model answer of what they passed;
- with ``gradescope=True``: ``gradescope/<student>/results.json`` in Gradescope's autograder format.

``anonymise=True`` replaces student names by stable pseudonyms (``learner-3f9a2c``: an HMAC of the
name under a key kept in ``DIR/pseudonym.key``, created on first use and reused, so that a student
keeps their pseudonym from one report to the next) in report.html; feedback/ and gradescope/ go back
to each student and keep their names, so share report.html and mistakes.csv only.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import hmac
import html
import json
import math
import secrets
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from .gradebook import Row, flagged, read_gradebook

NOT_ATTEMPTED = ("not attempted", "missing", "not run")  # statuses that count as no attempt
MISTAKES_FIELDS = ("notebook", "exercise", "mistake_id", "mistake", "students", "attempted", "hint")
TOP_MISTAKES = 5  # mistakes listed per exercise in report.html (mistakes.csv has them all)
# Okabe-Ito colours, told apart with every common colour-vision deficiency; every bar is labelled too.
COLOURS = {"passed": "#0072B2", "failed": "#E69F00", "not attempted": "#BBBBBB"}
MODEL_ANSWERS = Path(__file__).resolve().parent.parent / "model_answers.json"


@dataclass
class Info:
    """What the report says about one exercise beyond its rows: title and teaching section."""

    title: str = ""
    section: str = ""


@dataclass
class ExerciseStats:
    """One exercise of the class: counts, statistics and mistakes (most common first)."""

    notebook: str
    id: str
    name: str
    points: int
    bonus: bool
    students: int
    passed: int
    failed: int
    not_attempted: int
    mean_points: float
    discrimination: float | None  # upper 27% minus lower 27% share passed, by score on the rest
    mistakes: list[tuple[str, str, int, str]] = field(default_factory=list)  # id, description, count, hint
    info: Info = field(default_factory=Info)

    @property
    def attempted(self) -> int:
        return self.students - self.not_attempted

    @property
    def share_passed(self) -> float:
        return self.passed / self.students if self.students else 0.0


def order(exercise_id: str) -> tuple:
    """``"10.3"`` -> (10, 3): exercises in course order."""
    return tuple(int(p) if p.isdigit() else p for p in exercise_id.split("."))


def discrimination(passed: dict[str, bool], rest: dict[str, float], share: float = 0.27) -> float | None:
    """Share passed among the top ``share`` of students by ``rest`` (their points on the other
    exercises) minus among the bottom ``share``; None for fewer than 4 students. Near 1: the
    exercise separates strong from weak students; near 0 or below: it does not (or misleads)."""
    if len(passed) < 4:
        return None
    ranked = sorted(passed, key=lambda s: (rest[s], s))
    n = max(1, math.ceil(share * len(ranked)))
    low, high = ranked[:n], ranked[-n:]
    return sum(passed[s] for s in high) / n - sum(passed[s] for s in low) / n


def exercise_stats(rows: list[Row], info: dict[str, Info] | None = None) -> list[ExerciseStats]:
    """The statistics of every exercise in ``rows`` (one row per student and exercise)."""
    info = info or {}
    students = sorted({r.student for r in rows})
    totals = {s: 0 for s in students}
    for r in rows:
        if not r.bonus:
            totals[r.student] += r.earned
    by_exercise: dict[tuple[str, str], list[Row]] = {}
    for r in rows:
        by_exercise.setdefault((r.notebook, r.id), []).append(r)
    out = []
    for (notebook, ex_id), mine in sorted(by_exercise.items(), key=lambda kv: order(kv[0][1])):
        first = mine[0]
        count = Counter(r.status for r in mine)
        n_not = sum(count[s] for s in NOT_ATTEMPTED)
        passed = {r.student: r.status == "passed" for r in mine}
        rest = {r.student: totals[r.student] - (0 if r.bonus else r.earned) for r in mine}
        made: Counter = Counter()
        described: dict[str, str] = {}
        hints: dict[str, Counter] = {}
        for r in mine:
            if r.status == "passed" or r.status in NOT_ATTEMPTED:
                continue
            mid = r.mistake_id or f"{ex_id}/not-recognised-other"
            made[mid] += 1
            described.setdefault(mid, r.mistake or "not recognised")
            hints.setdefault(mid, Counter())[" ".join(r.hint.split())] += 1
        mistakes = [(mid, described[mid], n, hints[mid].most_common(1)[0][0])
                    for mid, n in sorted(made.items(), key=lambda kv: (-kv[1], kv[0]))]
        out.append(ExerciseStats(
            notebook, ex_id, first.name, first.points, first.bonus, len(mine), count["passed"],
            len(mine) - count["passed"] - n_not, n_not, sum(r.earned for r in mine) / len(mine),
            discrimination(passed, rest), mistakes, info.get(first.name, Info())))
    return out


def write_mistakes_csv(stats: list[ExerciseStats], path: Path) -> None:
    """``mistakes.csv``: one row per (notebook, exercise, mistake) made by at least one student."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(MISTAKES_FIELDS)
        for e in stats:
            for mid, description, n, hint in e.mistakes:
                w.writerow([e.notebook, e.id, mid, description, n, e.attempted, hint])


# --------------------------------------------------------------------------- pseudonyms


def pseudonym_key(path: Path) -> bytes:
    """The key of the pseudonyms, from ``path`` (created with a random key on first use)."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(secrets.token_hex(32) + "\n", encoding="utf-8")
        path.chmod(0o600)
    return bytes.fromhex(path.read_text(encoding="utf-8").strip())


def pseudonym(name: str, key: bytes) -> str:
    """``learner-3f9a2c``: the same for the same name and key, unguessable without the key."""
    return "learner-" + hmac.new(key, name.encode(), hashlib.sha256).hexdigest()[:6]


# --------------------------------------------------------------------------- report.html

_CSS = """
body{font:16px/1.5 system-ui,-apple-system,"Segoe UI",sans-serif;max-width:72rem;margin:2rem auto;padding:0 1rem;
color:#1a1a1a;background:#fff}
h1,h2,h3{line-height:1.25}table{border-collapse:collapse;margin:.5rem 0 1.5rem;width:100%}
caption{text-align:left;font-weight:600;padding:.25rem 0}th,td{border:1px solid #999;padding:.3rem .5rem;
text-align:left;vertical-align:top}th{background:#f0f0f0}td.num{text-align:right;font-variant-numeric:tabular-nums}
code{font-size:.9em}.legend span{display:inline-block;margin-right:1.2rem}
.swatch{display:inline-block;width:1em;height:1em;vertical-align:-.15em;margin-right:.3em;border:1px solid #333}
figure{margin:1rem 0}figcaption{font-size:.95em;color:#333}.note{color:#333;font-size:.95em}
a{color:#0b57a4}
"""


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def status_chart(stats: list[ExerciseStats], title: str) -> str:
    """A stacked horizontal bar per exercise (passed / failed / not attempted), as inline SVG
    with a title and a description that say the same numbers in words."""
    bar_w, left, row_h = 520, 190, 28
    height = row_h * len(stats) + 40
    words = "; ".join(f"{e.id} {e.name}: {e.passed} passed, {e.failed} failed, {e.not_attempted} not attempted"
                      for e in stats)
    uid = "c" + hashlib.blake2b(title.encode(), digest_size=4).hexdigest()
    parts = [f'<svg role="img" aria-labelledby="{uid}t {uid}d" width="{left + bar_w + 20}" height="{height}" '
             f'viewBox="0 0 {left + bar_w + 20} {height}" xmlns="http://www.w3.org/2000/svg">',
             f'<title id="{uid}t">{_e(title)}</title><desc id="{uid}d">{_e(words)}.</desc>']
    for i, e in enumerate(stats):
        y = 10 + i * row_h
        label = e.name if len(e.name) <= 22 else e.name[:21] + "…"
        parts.append(f'<text x="{left - 8}" y="{y + 17}" text-anchor="end" font-size="13">{_e(e.id)} {_e(label)}</text>')
        x = float(left)
        for status, n in (("passed", e.passed), ("failed", e.failed), ("not attempted", e.not_attempted)):
            if not n:
                continue
            w = bar_w * n / max(e.students, 1)
            parts.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{row_h - 6}" fill="{COLOURS[status]}" '
                         f'stroke="#fff"><title>{_e(status)}: {n}</title></rect>')
            if w >= 22:
                ink = "#fff" if status == "passed" else "#000"
                parts.append(f'<text x="{x + w / 2:.1f}" y="{y + 16}" text-anchor="middle" font-size="12" '
                             f'fill="{ink}">{n}</text>')
            x += w
    parts.append("</svg>")
    return "".join(parts)


def score_histogram(totals: list[int], max_total: int) -> str:
    """The distribution of total points, as inline SVG with its numbers in words."""
    bins = Counter(totals)
    width, height, base = 560, 180, 150
    top = max(bins.values(), default=1)
    step = width / (max_total + 1)
    words = ", ".join(f"{n} student{'s' if n != 1 else ''} with {p} points" for p, n in sorted(bins.items()))
    parts = [f'<svg role="img" aria-labelledby="histt histd" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" xmlns="http://www.w3.org/2000/svg">',
             f'<title id="histt">Total points of the class</title><desc id="histd">{_e(words)}.</desc>']
    for p in range(max_total + 1):
        n = bins.get(p, 0)
        h = 120 * n / top
        if n:
            parts.append(f'<rect x="{p * step + 1:.1f}" y="{base - h:.1f}" width="{max(step - 2, 1):.1f}" '
                         f'height="{h:.1f}" fill="{COLOURS["passed"]}"><title>{p} points: {n}</title></rect>')
    for p in range(0, max_total + 1, max(1, max_total // 10)):
        parts.append(f'<text x="{p * step + step / 2:.1f}" y="{base + 16}" text-anchor="middle" '
                     f'font-size="11">{p}</text>')
    parts.append(f'<text x="{width / 2}" y="{base + 30}" text-anchor="middle" font-size="12">total points</text>')
    parts.append("</svg>")
    return "".join(parts)


def _stats_table(stats: list[ExerciseStats], notebook: str) -> str:
    head = ("exercise", "points", "passed", "failed", "not attempted", "mean points", "share passed",
            "discrimination")
    lines = [f"<table><caption>Exercises of {_e(notebook)}</caption><thead><tr>"
             + "".join(f'<th scope="col">{h}</th>' for h in head) + "</tr></thead><tbody>"]
    for e in stats:
        disc = "n/a" if e.discrimination is None else f"{e.discrimination:+.2f}"
        lines.append(f'<tr><th scope="row">{_e(e.id)} <code>{_e(e.name)}</code>{" (bonus)" if e.bonus else ""}</th>'
                     f'<td class="num">{e.points}</td><td class="num">{e.passed}</td><td class="num">{e.failed}</td>'
                     f'<td class="num">{e.not_attempted}</td><td class="num">{e.mean_points:.2f}</td>'
                     f'<td class="num">{_pct(e.share_passed)}</td><td class="num">{disc}</td></tr>')
    lines.append("</tbody></table>")
    return "".join(lines)


def _mistakes_section(e: ExerciseStats, repo: str) -> str:
    title = f"{e.id} {e.info.title or e.name}"
    where = f"notebooks/{e.notebook}.ipynb"
    teach = (f'<a href="{_e(repo)}/blob/main/{_e(where)}">{_e(where)}</a>'
             + (f", section {_e(e.info.section)}" if e.info.section else "")) if repo else _e(where)
    out = [f'<h3 id="ex-{_e(e.id)}">{_e(title)} (<code>{_e(e.name)}</code>)</h3>',
           f'<p class="note">{e.attempted} of {e.students} attempted, {e.passed} passed. Taught in {teach}.</p>']
    if not e.mistakes:
        out.append("<p>No failed attempts.</p>")
        return "".join(out)
    out.append(f'<table><caption>Most common mistakes in {_e(e.id)}</caption><thead><tr><th scope="col">mistake</th>'
               '<th scope="col">students</th><th scope="col">of attempted</th><th scope="col">hint shown</th>'
               "</tr></thead><tbody>")
    for mid, description, n, hint in e.mistakes[:TOP_MISTAKES]:
        out.append(f'<tr><th scope="row">{_e(description)}<br><code>{_e(mid)}</code></th><td class="num">{n}</td>'
                   f'<td class="num">{_pct(n / max(e.attempted, 1))}</td><td>{_e(hint)}</td></tr>')
    out.append("</tbody></table>")
    if len(e.mistakes) > TOP_MISTAKES:
        out.append(f'<p class="note">{len(e.mistakes) - TOP_MISTAKES} more in mistakes.csv.</p>')
    return "".join(out)


def render_html(rows: list[Row], stats: list[ExerciseStats], names: dict[str, str], repo: str = "",
                title: str = "What the class got wrong") -> str:
    """The self-contained report page. ``names`` maps each student to the name shown."""
    students = sorted({r.student for r in rows})
    core = [e for e in stats if not e.bonus]
    totals = [sum(r.earned for r in rows if r.student == s and not r.bonus) for s in students]
    max_total = sum(e.points for e in core)
    legend = "".join(f'<span><span class="swatch" style="background:{c}"></span>{s}</span>' for s, c in COLOURS.items())
    body = [f"<h1>{_e(title)}</h1>",
            f"<p>{len(students)} students, {len({e.notebook for e in stats})} notebooks, {len(stats)} exercises. "
            f"Median total {sorted(totals)[len(totals) // 2] if totals else 0} of {max_total} points "
            "(bonus points apart).</p>",
            "<p class=\"note\"><b>Discrimination</b> is the share passed among the top 27% of students (by their "
            "points on the other exercises) minus the share among the bottom 27%: near +1 an exercise separates "
            "stronger from weaker students, near 0 it does not. <b>Mistakes</b> are what the checks named; "
            "<code>not-recognised-…</code> counts failures no check named, by what differed.</p>",
            f"<figure>{score_histogram(totals, max_total)}<figcaption>Total points per student.</figcaption></figure>",
            "<nav><h2>Notebooks</h2><ul>"
            + "".join(f'<li><a href="#nb-{_e(n)}">{_e(n)}</a></li>' for n in sorted({e.notebook for e in stats}))
            + '<li><a href="#review">marked for review</a></li></ul></nav>']
    for notebook in sorted({e.notebook for e in stats}):
        mine = [e for e in stats if e.notebook == notebook]
        body.append(f'<section><h2 id="nb-{_e(notebook)}">{_e(notebook)}</h2>')
        body.append(f'<figure>{status_chart(mine, f"Passed, failed and not attempted in {notebook}")}'
                    f'<figcaption class="legend">{legend}</figcaption></figure>')
        body.append(_stats_table(mine, notebook))
        body += [_mistakes_section(e, repo) for e in mine]
        body.append("</section>")
    reviews = flagged(rows)
    body.append('<section><h2 id="review">Marked for review</h2>')
    if reviews:
        body.append('<table><caption>Notebooks a grader should look at by hand</caption><thead><tr>'
                    '<th scope="col">student</th><th scope="col">notebook</th><th scope="col">why</th></tr></thead>'
                    "<tbody>" + "".join(f'<tr><th scope="row">{_e(names.get(s, s))}</th><td>{_e(n)}</td>'
                                        f"<td>{_e(why)}</td></tr>" for (s, n), why in sorted(reviews.items()))
                    + "</tbody></table>")
    else:
        body.append("<p>None: every notebook was graded on evidence alone.</p>")
    body.append("</section>")
    return ('<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{_e(title)}</title><style>{_CSS}</style></head><body><main>{''.join(body)}</main></body></html>\n")


# --------------------------------------------------------------------------- what each student gets back


def _model_answers() -> dict:
    try:
        return json.loads(MODEL_ANSWERS.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def feedback_markdown(student: str, notebook: str, rows: list[Row], info: dict[str, Info], answers: dict) -> str:
    """One student's feedback on one notebook, in Markdown."""
    core = [r for r in rows if not r.bonus]
    bonus = [r for r in rows if r.bonus]
    score = f"{sum(r.earned for r in core)}/{sum(r.points for r in core)} points"
    if bonus:
        score += f" + {sum(r.earned for r in bonus)}/{sum(r.points for r in bonus)} bonus"
    lines = [f"# {notebook}: feedback for {student}", "", f"Score: {score}.", ""]
    for r in sorted(rows, key=lambda r: order(r.id)):
        title = info.get(r.name, Info()).title
        lines += [f"## {r.id} {title or r.name} (`{r.name}`): {r.earned}/{r.points}"
                  f"{' bonus' if r.bonus else ''}, {r.status}", ""]
        if r.status == "passed":
            answer = answers.get(r.name)
            if answer:
                lines += ["Passed. The model answer to the exercise's question:", ""]
                if answer.get("question"):
                    lines += [f"> **{answer['question']}**", ">"]
                lines += [f"> {ln}" if ln else ">" for ln in str(answer["answer"]).splitlines()] + [""]
            continue
        if r.mistake and not r.mistake_id.split("/")[-1].startswith("not-recognised"):
            lines += [f"**What went wrong:** {r.mistake} (`{r.mistake_id}`).", ""]
        if r.hint:
            lines += [f"**Hint:** {' '.join(r.hint.split())}", ""]
        section = info.get(r.name, Info()).section
        if r.status != "passed":
            lines += [f"Revisit `notebooks/{notebook}.ipynb`" + (f", section {section}." if section else "."), ""]
    if any(r.review for r in rows):
        lines += ["---", "", f"Your notebook is marked for review by hand: {rows[0].review}", ""]
    return "\n".join(lines)


def gradescope_results(rows: list[Row]) -> dict:
    """Gradescope's ``results.json`` for one student: ``score`` and one test per exercise (bonus
    exercises count with ``max_score`` 0, as extra credit)."""
    tests = []
    for r in sorted(rows, key=lambda r: (r.notebook, order(r.id))):
        output = r.status + (f": {r.mistake}" if r.mistake and r.status != "passed" else "")
        if r.hint and r.status != "passed":
            output += f"\nhint: {' '.join(r.hint.split())}"
        if r.review:
            output += f"\nmarked for review by hand: {r.review}"
        tests.append({"name": f"{r.id} {r.name}" + (" (bonus)" if r.bonus else ""), "number": r.id,
                      "score": float(r.earned), "max_score": float(0 if r.bonus else r.points),
                      "status": "passed" if r.status == "passed" else "failed", "output": output,
                      "visibility": "visible"})
    return {"score": float(sum(r.earned for r in rows)), "visibility": "visible", "stdout_visibility": "hidden",
            "output": f"{sum(r.status == 'passed' for r in rows)} of {len(rows)} exercises passed.", "tests": tests}


# --------------------------------------------------------------------------- all of it


def course_info() -> dict[str, Info]:
    """Function name -> title and teaching section, from the course's checks (``make grade``
    passes its own, read without importing torch), or {} when they cannot be read."""
    try:
        from ..checks import EXERCISES

        return {e.name: Info(e.title, e.section or "") for e in EXERCISES.values()}
    except Exception:  # noqa: BLE001 - the report still works from the gradebook alone
        return {}


def _safe(name: str) -> str:
    """A student's name as a folder name."""
    cleaned = "".join(c if c.isalnum() or c in "-_. " else "_" for c in name).strip(". ")
    return cleaned or "student"


def write_report(rows: list[Row], out: Path, anonymise: bool = False, gradescope: bool = False,
                 info: dict[str, Info] | None = None, repo: str = "") -> list[Path]:
    """Write the report of ``rows`` into ``out``; returns the files written."""
    if not rows:
        raise ValueError("nothing to report: no gradebook rows")
    out.mkdir(parents=True, exist_ok=True)
    info = course_info() if info is None else info
    stats = exercise_stats(rows, info)
    students = sorted({r.student for r in rows})
    key = pseudonym_key(out / "pseudonym.key") if anonymise else b""
    names = {s: pseudonym(s, key) if anonymise else s for s in students}
    written = [out / "mistakes.csv", out / "report.html"]
    write_mistakes_csv(stats, written[0])
    written[1].write_text(render_html(rows, stats, names, repo), encoding="utf-8")
    answers = _model_answers()
    for s in students:
        mine = [r for r in rows if r.student == s]
        for notebook in sorted({r.notebook for r in mine}):
            path = out / "feedback" / _safe(s) / f"{notebook}.md"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(feedback_markdown(s, notebook, [r for r in mine if r.notebook == notebook], info, answers),
                            encoding="utf-8")
            written.append(path)
        if gradescope:
            path = out / "gradescope" / _safe(s) / "results.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(gradescope_results(mine), indent=1) + "\n", encoding="utf-8")
            written.append(path)
    return written


def repository() -> str:
    """The course's repository address (pyproject.toml), for links to the teaching sections."""
    try:
        from .notebooks import repo_url

        return repo_url()
    except Exception:  # noqa: BLE001 - links are a convenience
        return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m helpers.tools.class_report", description=__doc__.split("\n\n")[0])
    parser.add_argument("gradebooks", nargs="+", type=Path, help="gradebook CSVs of `make grade` (shards concatenate)")
    parser.add_argument("--out", type=Path, required=True, help="folder to write the report into")
    parser.add_argument("--anonymise", action="store_true", help="pseudonyms instead of names in report.html")
    parser.add_argument("--gradescope", action="store_true", help="also write gradescope/<student>/results.json")
    args = parser.parse_args(argv)
    rows: list[Row] = []
    for path in args.gradebooks:
        try:
            rows += read_gradebook(path)
        except (OSError, ValueError, KeyError, csv.Error) as e:
            print(f"class_report: cannot read {path}: {e}", file=sys.stderr)
            return 2
    latest = {(r.student, r.notebook, r.id): r for r in rows}  # a student graded in two shards: the later one
    if len(latest) < len(rows):
        print(f"class_report: {len(rows) - len(latest)} rows repeat a (student, notebook, exercise); "
              "the last gradebook's are kept", file=sys.stderr)
        rows = list(latest.values())
    try:
        written = write_report(rows, args.out, args.anonymise, args.gradescope, repo=repository())
    except ValueError as e:
        print(f"class_report: {e}", file=sys.stderr)
        return 2
    print(f"report: {args.out / 'report.html'}, {args.out / 'mistakes.csv'} and {len(written) - 2} more files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
