"""ruff over the package, tests, bench and notebooks (settings in pyproject.toml)."""

import subprocess
import sys

from helpers.tools.notebooks import ROOT


def test_ruff_clean():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
