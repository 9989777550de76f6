"""What grading reports: the table ``make grade`` prints (per notebook and per student), the
gradebook CSV of a class, and whether everything that counts passed."""

from __future__ import annotations

import contextlib
import csv
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Row:
    """One exercise of one notebook of one student, as the table and the gradebook show it."""

    notebook: str
    id: str
    name: str
    points: int
    status: str
    hint: str = ""
    bonus: bool = False
    student: str = ""
    review: str = ""  # why the notebook needs a look by hand ("" for a trusted notebook)
    mistake_id: str = ""  # the failure as a class report counts it: "5.2/missing-W_O", "5.1/not-recognised-values"
    mistake: str = ""  # its one-line description
    sandbox: str = ""  # where the notebook ran (helpers.tools.sandbox: namespaces, user, none)

    @property
    def earned(self) -> int:
        return self.points if self.status == "passed" else 0


def score_text(rows: list[Row], unit: str = "") -> str:
    """``5/8``, or ``5/8 + 0/3 bonus`` (bonus points apart); ``unit`` goes after the first part."""
    core = [r for r in rows if not r.bonus]
    bonus = [r for r in rows if r.bonus]
    text = f"{sum(r.earned for r in core)}/{sum(r.points for r in core)}{unit}"
    if bonus:
        text += f" + {sum(r.earned for r in bonus)}/{sum(r.points for r in bonus)} bonus"
    return text


def _columns(header: tuple[str, ...], body: list[tuple[str, ...]]) -> list[str]:
    """Left-aligned columns; the last one is not padded."""
    widths = [max(len(x[i]) for x in [header, *body]) for i in range(len(header) - 1)]
    lines = []
    for row in [header, tuple("-" * max(len(h), 4) for h in header), *body]:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row[:-1], widths)) + "  " + row[-1])
    return [ln.rstrip() for ln in lines]


def format_table(rows: list[Row]) -> str:
    """Rows (student, notebook, exercise, points, status, hint), then scores per notebook and per
    student, then the total (bonus points apart). The student column appears for a class."""
    students = sorted({r.student for r in rows})
    with_student = len(students) > 1
    header = (("student",) if with_student else ()) + ("notebook", "exercise", "points", "status", "hint")
    body = [(((r.student,) if with_student else ())
             + (r.notebook, f"{r.id} {r.name}", f"{r.earned}/{r.points}" + (" bonus" if r.bonus else ""), r.status,
                " ".join(r.hint.split()))) for r in rows]
    lines = _columns(header, body)
    stems = sorted({r.notebook for r in rows})
    lines.append("")
    if with_student:  # one line per student, one column per notebook
        scores = [(s, *(score_text([r for r in rows if r.student == s and r.notebook == n]) + _mark(rows, s, n)
                        for n in stems), score_text([r for r in rows if r.student == s])) for s in students]
        lines += _columns(("student", *stems, "total"), scores)
    else:
        lines += _columns(("notebook", "score"), [(n, score_text([r for r in rows if r.notebook == n]) + _mark(rows, "", n))
                                                  for n in stems])
    reviews = flagged(rows)
    if reviews:
        lines.append("")
        lines.append("review by hand (the score is what the evidence earned; the instructor decides):")
        lines += [f"  {(s + ' ') if with_student else ''}{n}: {why}" for (s, n), why in reviews.items()]
    core = [r for r in rows if not r.bonus]
    n_passed = sum(r.status == "passed" for r in core)
    lines.append("")
    lines.append(f"score: {score_text(rows, ' points')}, {n_passed}/{len(core)} exercises passed"
                 + (f" ({len(students)} students)" if with_student else ""))
    return "\n".join(lines)


GRADEBOOK_FIELDS = ("student", "notebook", "exercise", "function", "points", "max_points", "bonus", "status", "hint",
                   "review", "mistake_id", "mistake", "sandbox")


def write_gradebook(rows: list[Row], path: Path) -> None:
    """One CSV row per student and exercise: student, notebook, exercise, function, points earned,
    max_points, bonus, status, hint, review, mistake_id, mistake (the format an LMS or a spreadsheet
    imports). ``review`` is empty for a trusted notebook and names what a grader should look at
    otherwise; ``mistake_id`` is the failure's stable identifier (``5.2/missing-W_O``, or
    ``<exercise>/not-recognised-<what>``) and ``mistake`` its one-line description, both empty for a
    pass, an unattempted exercise and a notebook not handed in; ``sandbox`` says where the notebook
    ran. Written to a temporary file beside ``path``, then renamed over it: a reader sees the old
    gradebook or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(GRADEBOOK_FIELDS)
            for r in rows:
                w.writerow([csv_cell(r.student), r.notebook, r.id, r.name, r.earned, r.points, int(r.bonus), r.status,
                            csv_cell(" ".join(r.hint.split())), csv_cell(" ".join(r.review.split())), r.mistake_id,
                            csv_cell(r.mistake), r.sandbox])
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # as open() would have made it (mkstemp makes it private)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


_FORMULA = ("=", "+", "-", "@", "\t", "\r")


def csv_cell(text: object) -> str:
    """A CSV cell a spreadsheet will not run as a formula: a leading ' where it could be one
    (a student folder named ``=HYPERLINK(...)``); :func:`read_gradebook` takes it off again."""
    text = str(text)
    return "'" + text if text.startswith(_FORMULA) else text


def _uncell(text: str) -> str:
    """:func:`csv_cell` undone: the leading ' it added taken off."""
    return text[1:] if text.startswith("'") and text[1:].startswith(_FORMULA) else text


def read_gradebook(path: Path) -> list[Row]:
    """The rows of a gradebook CSV that :func:`write_gradebook` wrote (older ones, without the
    mistake columns, read too). Gradebooks of shards concatenate: pass each and add the lists."""
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        missing = {"student", "notebook", "exercise", "function", "max_points", "status"} - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{path} is not a gradebook of `make grade`: no column {', '.join(sorted(missing))}")
        rows = []
        for i, rec in enumerate(reader, start=2):
            try:
                points = int(rec["max_points"])
            except (TypeError, ValueError):
                raise ValueError(f"{path}, line {i}: max_points is {rec['max_points']!r}, not a whole number") from None
            if not rec.get("status") or not rec.get("exercise") or rec.get("student") is None:
                raise ValueError(f"{path}, line {i}: a row without its student, exercise or status")
            rows.append(Row(rec["notebook"], rec["exercise"], rec["function"], points, rec["status"],
                            _uncell(rec.get("hint") or ""), rec.get("bonus") in ("1", "True", "true"),
                            _uncell(rec["student"]), _uncell(rec.get("review") or ""), rec.get("mistake_id") or "",
                            _uncell(rec.get("mistake") or ""), rec.get("sandbox") or ""))
    return rows


def _mark(rows: list[Row], student: str, notebook: str) -> str:
    """" (review)" after the score of a notebook marked for review (``student`` "": anyone's)."""
    return " (review)" if any(r.review for r in rows if r.notebook == notebook and (r.student == student or not student)) else ""


def flagged(rows: list[Row]) -> dict[tuple[str, str], str]:
    """(student, notebook) -> why it is marked for review, for every notebook that is."""
    out: dict[tuple[str, str], str] = {}
    for r in rows:
        if r.review:
            out.setdefault((r.student, r.notebook), r.review)
    return out


def passed(rows: list[Row]) -> bool:
    """True when there is something to grade and every exercise that is not a bonus passed."""
    return bool(rows) and all(r.status == "passed" for r in rows if not r.bonus)
