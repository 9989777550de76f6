#!/usr/bin/env bash
# Gradescope runs this once, as root, when it builds the autograder's image (Ubuntu, with network).
# The autograder zip (`make gradescope`) holds this file, run_autograder and the course in course/.
# AUTOGRADER_ROOT (default /autograder) and AUTOGRADER_TORCH_INDEX (default PyTorch's CPU index; set
# it empty for pip's own indexes) let the course's tests run it outside Gradescope
# (tests/test_gradescope.py, with apt-get stubbed).
set -euo pipefail
root="${AUTOGRADER_ROOT:-/autograder}"
torch_index="${AUTOGRADER_TORCH_INDEX-https://download.pytorch.org/whl/cpu}"
apt-get update -qq
# bubblewrap: the grader runs each notebook in its sandbox (helpers/tools/sandbox.py); where the
# container allows no namespaces, it runs each as a user of its own instead, and says so.
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3 python3-venv python3-pip bubblewrap >/dev/null
python3 -m venv "$root/venv"
"$root/venv/bin/python" -m pip install --quiet --upgrade pip
# torch's CPU build (Gradescope has no GPU); the version is the Makefile's TORCH_PIN, filled in by
# `make gradescope`. The course is installed as a package (not editable): the venv holds all that
# grading needs, the model answers included, and run_autograder grades with it from outside course/.
# Its runtime dependencies only: the dev extras are the course's own tests and tools.
"$root/venv/bin/python" -m pip install --quiet ${torch_index:+--extra-index-url "$torch_index"} \
  "@TORCH_PIN@" "$root/source/course"
# The grader imports: a failure here fails the image's build, not every submission.
(cd "$root" && "$root/venv/bin/python" -c "import helpers.tools.grading, helpers.checks")
chmod +x "$root/source/run_autograder"
# What a notebook must not read where it runs as a user of its own (no namespaces): the course's
# source and the installed package, whose lesson modules hold the references (each notebook gets
# its own copy, without them).
site="$(cd "$root" && "$root/venv/bin/python" -c 'import helpers, os; print(os.path.dirname(helpers.__file__))')"
chmod -R go-rwx "$root/source/course" "$site"
