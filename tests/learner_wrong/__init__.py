"""Wrong answers written as learners would, from the exercise statements only (issue 32).

Each module `nbNN.py` holds `WRONG = {"<exercise function>": [("<mistake>", fn), ...]}`;
`baseline.py` runs them through the current checks and writes BASELINE.md. The file names do not
start with `test_`, so pytest does not collect them.
"""
