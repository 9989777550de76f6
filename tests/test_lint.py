"""ruff over the package, tests, bench and notebooks (settings in pyproject.toml)."""

import subprocess
import sys

from helpers.tools.notebooks import ROOT


def test_ruff_clean():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_checks_compare_with_the_functions_bound_at_import():
    """A check compares with the guard's bound comparisons (``guard._allclose`` and the like), never
    with ``torch.allclose`` looked up when it runs: a learner's function may have replaced it (the
    guard undoes that after each call, but a comparison should not depend on when it runs)."""
    import ast

    direct = []
    for path in sorted((ROOT / "helpers" / "checks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            func = getattr(node, "func", None)
            if (isinstance(node, ast.Call) and isinstance(func, ast.Attribute) and getattr(func.value, "id", "") == "torch"
                    and func.attr in ("allclose", "isclose", "equal")):
                direct.append(f"{path.relative_to(ROOT)}:{node.lineno} torch.{func.attr}")
    assert not direct, f"use the guard's bound comparison instead: {direct}"
