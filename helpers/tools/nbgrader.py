"""The course as an nbgrader course: ``python -m helpers.tools.grading --nbgrader-course DIR`` writes
``solutions/`` out with nbgrader's configuration and cell metadata, so that an instructor who runs
nbgrader (generate_assignment, autograde, export) gets exactly ``exercises/`` and the same scores
(tests/test_nbgrader.py runs nbgrader's own commands on it)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from . import DEFAULT_CELL_TIMEOUT_S

NBGRADER_CONFIG = """\
# nbgrader configuration for the course, written by `python -m helpers.tools.grading --nbgrader-course`.
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
