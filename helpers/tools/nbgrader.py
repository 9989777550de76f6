"""The course as an nbgrader course: ``python -m helpers.tools.nbgrader DIR [--cell-timeout S]`` writes
``solutions/`` out with nbgrader's configuration and cell metadata, so that an instructor who runs
nbgrader (generate_assignment, autograde, export) gets exactly ``exercises/`` and the same scores
(tests/test_nbgrader.py runs nbgrader's own commands on it)."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Iterable
from pathlib import Path

from . import DEFAULT_CELL_TIMEOUT_S

NBGRADER_CONFIG = """\
# nbgrader configuration for the course, written by `python -m helpers.tools.nbgrader`.
import os

from nbconvert.preprocessors import TagRemovePreprocessor
from nbgrader.converters import GenerateAssignment

c = get_config()  # noqa: F821
c.CourseDirectory.course_id = "attention-course"
# The student version is exactly exercises/: answer cells get the course's stub, and the cells
# tagged solution-only (numbers behind the model answers) are dropped.
c.ClearSolutions.text_stub = {text_stub!r}
c.TagRemovePreprocessor.enabled = True
c.TagRemovePreprocessor.remove_cell_tags = [{solution_only!r}]
c.GenerateAssignment.preprocessors = [
    TagRemovePreprocessor, *GenerateAssignment.class_traits()["preprocessors"].default()]
# Kernels started by nbgrader (validate, autograde) inherit this: an unattempted exercise's check
# raises (scored 0) instead of printing a notice.
os.environ[{env!r}] = "1"
c.Execute.timeout = {timeout}  # seconds per cell: the Triton checks run in the interpreter on a CPU
"""


def write_nbgrader_course(course: Path, stems: Iterable[str] | None = None, cell_timeout: float = DEFAULT_CELL_TIMEOUT_S) -> list[Path]:
    """Lay ``solutions/`` out as an nbgrader course in ``course``: ``nbgrader_config.py`` and
    ``source/NN_topic/NN_topic.ipynb`` (one assignment per notebook, with nbgrader's cell metadata
    from :func:`helpers.tools.notebooks.nbgrader_source`). Returns the notebooks written."""
    from ..checks import feedback
    from . import notebooks as nbtools

    course.mkdir(parents=True, exist_ok=True)
    (course / "nbgrader_config.py").write_text(NBGRADER_CONFIG.format(
        text_stub=nbtools.EMPTY_ANSWER, solution_only=nbtools.SOLUTION_ONLY_TAG, env=feedback.RAISE_NOT_ATTEMPTED_ENV,
        timeout=cell_timeout), encoding="utf-8")
    written = []
    for path in nbtools.notebook_paths("solutions"):
        if stems is not None and path.stem not in stems:
            continue
        target = course / "source" / path.stem / path.name
        target.parent.mkdir(parents=True, exist_ok=True)
        nbtools.write(nbtools.nbgrader_source(nbtools.read(path)), target)
        written.append(target)
    return written


def _seconds(text: str) -> float:
    """``--cell-timeout``: a finite number of seconds above 0 (the config file writes it as a number)."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not (seconds > 0 and math.isfinite(seconds)):
        raise argparse.ArgumentTypeError(f"expected a number of seconds above 0, got {text!r}")
    return seconds


def main(argv: list[str] | None = None) -> int:
    """Write the nbgrader course into the folder the command line names, and say what to run next."""
    parser = argparse.ArgumentParser(
        prog="python -m helpers.tools.nbgrader",
        description="Write solutions/ as an nbgrader course in DIR (then run nbgrader there).")
    parser.add_argument("course", type=Path, metavar="DIR",
                        help="the folder to write the course into (created if need be)")
    parser.add_argument("--cell-timeout", type=_seconds, default=DEFAULT_CELL_TIMEOUT_S, metavar="S",
                        help=f"seconds per cell in nbgrader's kernels (default: {DEFAULT_CELL_TIMEOUT_S})")
    args = parser.parse_args(argv)
    blocked = next((p for p in (args.course, *args.course.parents) if p.exists()), None)
    if blocked is not None and not blocked.is_dir():
        parser.error(f"cannot write the course into {args.course}: {blocked} is a file")
    try:
        written = write_nbgrader_course(args.course, cell_timeout=args.cell_timeout)
    except OSError as e:
        parser.error(f"cannot write the course into {args.course}: {e.strerror or e}")
    for path in written:
        print(f"wrote {path}")
    print(f"next: cd {args.course} && nbgrader generate_assignment '*'")
    return 0


if __name__ == "__main__":
    sys.exit(main())
