#!/usr/bin/env bash
# Gradescope runs this once, as root, when it builds the autograder's image (Ubuntu, with network).
# The autograder zip (`make gradescope`) holds this file, run_autograder and the course in course/.
set -euo pipefail
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3 python3-venv python3-pip >/dev/null
python3 -m venv /autograder/venv
/autograder/venv/bin/python -m pip install --quiet --upgrade pip
# torch's CPU build (Gradescope has no GPU); the version is the Makefile's TORCH_PIN, filled in by `make gradescope`.
/autograder/venv/bin/python -m pip install --quiet --extra-index-url https://download.pytorch.org/whl/cpu \
  "@TORCH_PIN@" -e /autograder/source/course
chmod +x /autograder/source/run_autograder
