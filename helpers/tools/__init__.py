"""The course's machinery, apart from the lessons: grading (``make grade``), the gradebook, nbgrader
support, and notebook tooling (``make exercises``, ``make execute``, ``make sync``). Learners never
need it."""

DEFAULT_CELL_TIMEOUT_S = 300
"""Seconds per cell, in ``make grade`` and in the kernels of nbgrader's autograde."""
