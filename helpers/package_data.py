"""The files the course ships inside its package, read the same way from a clone and from an
installed wheel (Colab installs the package and has no clone).

``helpers/results/`` holds what ``make bench`` measured on GPUs and what ``make kernel-report``
compiled ahead of time; ``helpers/model_answers.json`` the model answers a passing check shows.
pyproject.toml's ``[tool.setuptools.package-data]`` lists them (a test keeps the two in step).
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

RESULTS = "results"  # the folder of recorded results
# where `make bench` and `make kernel-report` write them: this package's folder (in a clone, helpers/results)
RESULTS_DIR = Path(__file__).resolve().parent / RESULTS


def package_file(*parts: str) -> Path:
    """The file or folder ``helpers/<parts>`` of the course's package, where the package is
    installed (or the clone, for an editable install), e.g. ``package_file("results", "kernel_aot.json")``.
    pip installs a package unpacked, so it is a plain path. A name the package does not carry is
    an error that says so."""
    path = Path(str(files("helpers").joinpath(*parts)))
    if not path.exists():
        raise FileNotFoundError(f"the course's package has no {'/'.join(parts)} (looked in {path.parent}); "
                                "package data is listed in pyproject.toml [tool.setuptools.package-data]")
    return path
