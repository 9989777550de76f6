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
  exercise's mean points, share of the class passed and discrimination index, its most common mistakes with the
  hint shown and the section that teaches it; the notebooks marked for review;
- ``feedback/<student>/<notebook>.md``: what each student gets back: per exercise the points, the
  named mistake and its hint, where to revisit, and the model answer of what they passed;
- with ``gradescope=True``: ``gradescope/<student>/results.json`` in Gradescope's autograder format.

``anonymise=True`` replaces student names by stable pseudonyms (``learner-3f9a2c81d0``: an HMAC of
the name under a secret key, :func:`key_path`, kept outside the report and created on first use, so
that a student keeps their pseudonym from one report to the next) in report.html; feedback/ and
gradescope/ go back to each student and keep their names, so share report.html and mistakes.csv only.
Student folders under feedback/ and gradescope/ are the names made safe for a file system (distinct
even where two names differ only in case or in characters a file name cannot hold); ``feedback/
index.csv`` lists which folder is whose.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import hmac
import html
import json
import math
import os
import secrets
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from .gradebook import Row, csv_cell, flagged, read_gradebook, score_text

NOT_HANDED_IN = ("missing", "not run")  # statuses of a notebook not handed in (or that never ran)
NOT_ATTEMPTED = ("not attempted", *NOT_HANDED_IN)  # statuses that count as no attempt
MISTAKES_FIELDS = ("notebook", "exercise", "mistake_id", "mistake", "students", "attempted", "hint")
TOP_MISTAKES = 5  # mistakes listed per exercise in report.html (mistakes.csv has them all)
# Okabe-Ito colours, told apart with every common colour-vision deficiency; every bar is labelled too.
COLOURS = {"passed": "#0072B2", "failed": "#E69F00", "not attempted": "#BBBBBB"}
MODEL_ANSWERS = Path(__file__).resolve().parent.parent / "model_answers.json"
TITLE = "What the class got wrong"  # report.html's
HISTOGRAM_BARS = 12  # at most, in the chart of total points


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
    discrimination: float | None  # item-rest correlation among those who handed the notebook in
    mistakes: list[tuple[str, str, int, str]] = field(default_factory=list)  # id, description, count, hint
    info: Info = field(default_factory=Info)
    no_discrimination: str = ""  # why discrimination is None (no_discrimination_reason)

    @property
    def attempted(self) -> int:
        return self.students - self.not_attempted

    @property
    def share_passed(self) -> float:
        return self.passed / self.students if self.students else 0.0


def order(exercise_id: str) -> tuple:
    """``"10.3"`` -> ((0, 10, ""), (0, 3, "")): exercises in course order (an id that is not numbers sorts
    after, by its text, and never fails to compare)."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in str(exercise_id).split("."))


MIN_STUDENTS_FOR_DISCRIMINATION = 4  # fewer handed in: a correlation over so few says nothing


def no_discrimination_reason(passed: dict[str, bool], rest: dict[str, float]) -> str:
    """Why :func:`discrimination` has no value for these results ("" when it has one), in the
    words the report prints after "n/a"."""
    n = len(passed)
    if n < MIN_STUDENTS_FOR_DISCRIMINATION:
        return (f"{n} handed in, fewer than the {MIN_STUDENTS_FOR_DISCRIMINATION} a correlation "
                "needs")
    if all(passed.values()) or not any(passed.values()):
        return f"{'all' if all(passed.values()) else 'none'} of the {n} who handed in passed"
    if len({float(rest[s]) for s in passed}) == 1:
        return "everyone has the same points on the other exercises"
    return ""


def discrimination(passed: dict[str, bool], rest: dict[str, float]) -> float | None:
    """The item-rest correlation: Pearson's correlation, over students, between passing the exercise
    (1 or 0) and their points on the other exercises (``rest``). Near +1 the exercise separates
    stronger from weaker students; near 0 it does not; below 0 the weaker pass it more often. None
    for fewer than ``MIN_STUDENTS_FOR_DISCRIMINATION`` students or when everyone (or no one) passed
    or everyone has the same rest: nothing to separate (:func:`no_discrimination_reason` says
    which). It depends on the students' results only, never on their names or order."""
    if len(passed) < MIN_STUDENTS_FOR_DISCRIMINATION:
        return None
    xs = [1.0 if passed[s] else 0.0 for s in sorted(passed)]
    ys = [float(rest[s]) for s in sorted(passed)]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    if sxx == 0 or syy == 0:
        return None
    return sxy / math.sqrt(sxx * syy)


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
        handed_in = [r for r in mine if r.status not in NOT_HANDED_IN]
        passed = {r.student: r.status == "passed" for r in handed_in}
        rest = {r.student: totals[r.student] - (0 if r.bonus else r.earned) for r in handed_in}
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
            discrimination(passed, rest), mistakes, info.get(first.name, Info()),
            no_discrimination_reason(passed, rest)))
    return out


def write_mistakes_csv(stats: list[ExerciseStats], path: Path) -> None:
    """``mistakes.csv``: one row per (notebook, exercise, mistake) made by at least one student."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(MISTAKES_FIELDS)
        for e in stats:
            for mid, description, n, hint in e.mistakes:
                w.writerow([e.notebook, e.id, mid, csv_cell(description), n, e.attempted, csv_cell(hint)])


# --------------------------------------------------------------------------- pseudonyms


KEY_ENV = "ATTN_COURSE_PSEUDONYM_KEY"  # where the pseudonyms' key lives, if not the default


def key_path() -> Path:
    """The pseudonyms' key file: $ATTN_COURSE_PSEUDONYM_KEY, else
    ``~/.config/attention-course/pseudonym.key``: outside any report folder, so that sharing a
    report never shares the key (with it and a class list, pseudonyms could be reversed)."""
    return Path(os.environ.get(KEY_ENV) or Path.home() / ".config" / "attention-course" / "pseudonym.key")


def pseudonym_key(path: Path) -> bytes:
    """The key of the pseudonyms, from ``path`` (created with a random 32-byte key on first use).
    Raises ValueError, naming the file, for a key that is not at least 16 bytes of hex."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(secrets.token_hex(32) + "\n", encoding="utf-8")
        path.chmod(0o600)
    try:
        key = bytes.fromhex(path.read_text(encoding="utf-8").strip())
    except (ValueError, UnicodeDecodeError):
        key = b""
    if len(key) < 16:
        raise ValueError(f"{path} is not a pseudonym key (at least 32 hex digits); delete it to make a new "
                         "one (the pseudonyms will change)")
    return key


def pseudonym(name: str, key: bytes) -> str:
    """``learner-3f9a2c81d0``: the same for the same name and key, unguessable without the key."""
    return "learner-" + hmac.new(key, name.encode(), hashlib.sha256).hexdigest()[:10]


def folders(students: list[str]) -> dict[str, str]:
    """Student -> a folder name that is safe on every file system and distinct from the others'
    even where file systems ignore case: the name's safe form, with a short hash of the name added
    where two would collide, the name had to change a lot, or is empty."""
    base = {s: _safe(s) for s in students}
    seen = Counter(b.casefold() for b in base.values())
    out = {}
    for s in students:
        b = base[s]
        if seen[b.casefold()] > 1 or b != s or b == "student" or len(b) > 60:
            b = f"{b[:60]}-{hashlib.sha256(s.encode()).hexdigest()[:6]}"
        out[s] = b
    return out


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
a{color:#0b57a4}svg{max-width:100%;height:auto}.scroll{overflow-x:auto}
"""


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _n(count: int, noun: str) -> str:
    """``1 student``, ``2 students``."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _md(text: object) -> str:
    """Text for Markdown that stays text (no HTML, links or images: their characters are
    backslash-escaped, which reads well unrendered too; one line); code spans in
    backticks, where Markdown renders nothing, are kept as they are."""
    parts = " ".join(str(text).split()).split("`")
    paired = len(parts) % 2 == 1
    for i in range(0, len(parts), 2 if paired else 1):
        for ch, esc in (("\\", "\\\\"), ("<", "\\<"), (">", "\\>"), ("[", "\\["), ("]", "\\]"), ("!", "\\!")):
            parts[i] = parts[i].replace(ch, esc)
    return ("`" if paired else "\\`").join(parts)


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
    """The distribution of total points in at most ``HISTOGRAM_BARS`` equal ranges, as inline SVG whose
    description says each range's count in words; every bar is labelled with its count."""
    width = max(1, math.ceil((max_total + 1) / HISTOGRAM_BARS))  # points per bar
    ranges = [(lo, min(lo + width - 1, max_total)) for lo in range(0, max_total + 1, width)]
    counts = [sum(lo <= t <= hi for t in totals) for lo, hi in ranges]
    label = [f"{lo}" if lo == hi else f"{lo}-{hi}" for lo, hi in ranges]
    svg_w, height, base = 560, 190, 150
    top = max(counts, default=1) or 1
    step = svg_w / len(ranges)
    words = ", ".join(f"{_n(n, 'student')} with {lab} point{'s' if lab != '1' else ''}"
                      for n, lab in zip(counts, label) if n)
    parts = [f'<svg role="img" aria-labelledby="histt histd" width="{svg_w}" height="{height}" '
             f'viewBox="0 0 {svg_w} {height}" xmlns="http://www.w3.org/2000/svg">',
             f'<title id="histt">Total points of the class</title><desc id="histd">{_e(words)}.</desc>']
    for i, (n, lab) in enumerate(zip(counts, label)):
        x, h = i * step, 120 * n / top
        if n:
            parts.append(f'<rect x="{x + 2:.1f}" y="{base - h:.1f}" width="{step - 4:.1f}" height="{h:.1f}" '
                         f'fill="{COLOURS["passed"]}"><title>{lab} points: {n}</title></rect>'
                         f'<text x="{x + step / 2:.1f}" y="{base - h - 4:.1f}" text-anchor="middle" '
                         f'font-size="12">{n}</text>')
        parts.append(f'<text x="{x + step / 2:.1f}" y="{base + 16}" text-anchor="middle" font-size="11">'
                     f"{lab}</text>")
    parts.append(f'<text x="{svg_w / 2}" y="{base + 34}" text-anchor="middle" font-size="12">total points '
                 "(students per range)</text>")
    parts.append("</svg>")
    return "".join(parts)


def _stats_table(stats: list[ExerciseStats], notebook: str) -> str:
    head = ("exercise", "points", "passed", "failed", "not attempted", "mean points", "share of class passed",
            "discrimination")
    lines = [f'<div class="scroll"><table><caption>Exercises of {_e(notebook)}</caption><thead><tr>'
             + "".join(f'<th scope="col">{h}</th>' for h in head) + "</tr></thead><tbody>"]
    for e in stats:
        disc = (f'n/a <span class="note">({_e(e.no_discrimination)})</span>' if e.discrimination is None
                else f"{e.discrimination:+.2f}")
        lines.append(f'<tr><th scope="row">{_e(e.id)} <code>{_e(e.name)}</code>{" (bonus)" if e.bonus else ""}</th>'
                     f'<td class="num">{e.points}</td><td class="num">{e.passed}</td><td class="num">{e.failed}</td>'
                     f'<td class="num">{e.not_attempted}</td><td class="num">{e.mean_points:.2f}</td>'
                     f'<td class="num">{_pct(e.share_passed)}</td><td class="num">{disc}</td></tr>')
    lines.append("</tbody></table></div>")
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


def render_html(rows: list[Row], stats: list[ExerciseStats], names: dict[str, str], repo: str = "") -> str:
    """The self-contained report page. ``names`` maps each student to the name shown."""
    students = sorted({r.student for r in rows})
    core = [e for e in stats if not e.bonus]
    totals = [sum(r.earned for r in rows if r.student == s and not r.bonus) for s in students]
    max_total = sum(e.points for e in core)
    legend = "".join(f'<span><span class="swatch" style="background:{c}"></span>{s}</span>' for s, c in COLOURS.items())
    n_nb = len({e.notebook for e in stats})
    body = [f"<h1>{_e(TITLE)}</h1>",
            f"<p>{_n(len(students), 'student')}, {_n(n_nb, 'notebook')}, {_n(len(stats), 'exercise')}. "
            f"Median total {sorted(totals)[len(totals) // 2] if totals else 0} of {max_total} points "
            "(bonus points apart).</p>",
            "<p class=\"note\"><b>Discrimination</b> is the correlation, over the students who handed the "
            "notebook in, between passing the exercise and their points on the other exercises (item-rest "
            "correlation): near +1 an exercise separates stronger from weaker students, near 0 it does not, "
            "below 0 the weaker pass it more often; n/a, with the reason, when fewer than "
            f"{MIN_STUDENTS_FOR_DISCRIMINATION} students handed the notebook in (too few for a correlation), "
            "when everyone or no one passed, or when everyone has the same points on the other exercises. "
            "<b>Share of class "
            "passed</b> and <b>mean points</b> count every student (a notebook not handed in earns 0). "
            "<b>Mistakes</b> are what the checks named; <code>not-recognised-…</code> counts failures no check "
            "named, by what differed.</p>",
            f"<figure>{score_histogram(totals, max_total)}<figcaption>Total points per student.</figcaption></figure>",
            "<nav><h2>Notebooks</h2><ul>"
            + "".join(f'<li><a href="#nb-{_e(n)}">{_e(n)}</a></li>' for n in sorted({e.notebook for e in stats}))
            + '<li><a href="#review">marked for review</a></li></ul></nav>']
    for notebook in sorted({e.notebook for e in stats}):
        mine = [e for e in stats if e.notebook == notebook]
        body.append(f'<section><h2 id="nb-{_e(notebook)}">{_e(notebook)}</h2>')
        body.append(f'<figure>{status_chart(mine, f"Passed, failed and not attempted in {notebook}")}'
                    f'<figcaption class="legend">Students per exercise of {_e(notebook)}: {legend}</figcaption>'
                    "</figure>")
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
            f"<title>{_e(TITLE)}</title><style>{_CSS}</style></head><body><main>{''.join(body)}</main></body></html>\n")


# --------------------------------------------------------------------------- what each student gets back


def _model_answers() -> dict:
    try:
        return json.loads(MODEL_ANSWERS.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def feedback_markdown(student: str, notebook: str, rows: list[Row], info: dict[str, Info], answers: dict) -> str:
    """One student's feedback on one notebook, in Markdown."""
    lines = [f"# {notebook}: feedback for {_md(student)}", "", f"Score: {score_text(rows, ' points')}.", ""]
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
                text = str(answer["answer"]).removeprefix("**Model answer.**").strip()
                lines += [f"> {ln}" if ln else ">" for ln in text.splitlines()] + [""]
            continue
        if r.mistake and not r.mistake_id.split("/")[-1].startswith("not-recognised"):
            lines += [f"**What went wrong:** {_md(r.mistake)} (`{r.mistake_id}`).", ""]
        if r.hint:
            lines += [f"**Hint:** {_md(r.hint)}", ""]
        section = info.get(r.name, Info()).section
        lines += [f"Revisit `notebooks/{notebook}.ipynb`" + (f", section {section}." if section else "."), ""]
    if any(r.review for r in rows):
        lines += ["---", "", f"Your notebook is marked for review by hand: {_md(rows[0].review)}", ""]
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
    """Function name -> title and teaching section, from the course's list of exercises
    (``helpers.registry``: no torch needed)."""
    from .. import registry

    return {e.name: Info(e.title, e.section or "") for e in registry.by_name().values()}


def _safe(name: str) -> str:
    """A student's name as a folder name."""
    cleaned = "".join(c if c.isalnum() or c in "-_. " else "_" for c in name).strip(". ")
    return cleaned or "student"


def write_report(rows: list[Row], out: Path, anonymise: bool = False, gradescope: bool = False,
                 info: dict[str, Info] | None = None, repo: str = "", key: Path | None = None) -> list[Path]:
    """Write the report of ``rows`` into ``out``; returns the files written. ``key``: the
    pseudonyms' key file (default :func:`key_path`). Raises ValueError for nothing to report or an
    unusable key, OSError for a folder that cannot be written."""
    if not rows:
        raise ValueError("nothing to report: no gradebook rows")
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file; the report needs a folder")
    info = course_info() if info is None else info
    students = sorted({r.student for r in rows})
    if anonymise:
        secret = pseudonym_key(key or key_path())
        names = {s: pseudonym(s, secret) for s in students}
    else:
        names = {s: s for s in students}
    out.mkdir(parents=True, exist_ok=True)
    stats = exercise_stats(rows, info)
    written = [out / "mistakes.csv", out / "report.html"]
    write_mistakes_csv(stats, written[0])
    written[1].write_text(render_html(rows, stats, names, repo), encoding="utf-8")
    answers = _model_answers()
    where = folders(students)
    (out / "feedback").mkdir(exist_ok=True)
    with open(out / "feedback" / "index.csv", "w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows([("student", "folder"), *((csv_cell(s), where[s]) for s in students)])
    written.append(out / "feedback" / "index.csv")
    for s in students:
        mine = [r for r in rows if r.student == s]
        for notebook in sorted({r.notebook for r in mine}):
            theirs = [r for r in mine if r.notebook == notebook]
            if all(r.status == "missing" for r in theirs):
                continue  # not handed in: nothing to give back
            path = out / "feedback" / where[s] / f"{notebook}.md"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(feedback_markdown(s, notebook, theirs, info, answers), encoding="utf-8")
            written.append(path)
        if gradescope:
            path = out / "gradescope" / where[s] / "results.json"
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
    latest: dict[tuple, Row] = {}
    repeated = set()
    for r in rows:  # a student graded in two shards: the later graded row (a "missing" one never wins)
        key = (r.student, r.notebook, r.id)
        if key in latest:
            repeated.add(r.student)
            if r.status == "missing" and latest[key].status != "missing":
                continue
        latest[key] = r
    if repeated:
        print(f"class_report: {', '.join(sorted(repeated)[:10])}{' and more' if len(repeated) > 10 else ''} "
              "appear in more than one gradebook; their later graded rows are kept", file=sys.stderr)
        rows = list(latest.values())
    try:
        written = write_report(rows, args.out, args.anonymise, args.gradescope, repo=repository())
    except (ValueError, OSError) as e:
        print(f"class_report: {e}", file=sys.stderr)
        return 2
    print(f"report: {args.out / 'report.html'}, {args.out / 'mistakes.csv'} and {len(written) - 2} more files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
