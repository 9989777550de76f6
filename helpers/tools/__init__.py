"""The course's machinery, apart from the lessons: grading (``make grade``), nbgrader support, and
notebook tooling (``make exercises``, ``make execute``, ``make sync``). Learners never need it."""
