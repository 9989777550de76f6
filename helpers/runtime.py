"""Runtime set-up shared by every notebook: device, seeds, Triton interpreter, Colab detection."""

from __future__ import annotations

import os
import random
import sys

import numpy as np
import torch


def in_colab() -> bool:
    """True inside Google Colab (its kernel imports `google.colab` at start-up)."""
    return "google.colab" in sys.modules


def has_cuda() -> bool:
    """True when a CUDA GPU is usable by torch."""
    return torch.cuda.is_available()


def configure_triton() -> bool:
    """Turn on Triton's CPU interpreter when there is no CUDA GPU; return True if it is on.

    Triton reads TRITON_INTERPRET whenever a function is decorated with `@triton.jit`, its own
    library included (decorated while `triton` is imported), so this must run before `triton` is
    first imported. Importing `helpers` installs an import hook that calls it just before that
    (see `helpers/__init__.py`), and `setup()` calls it too, so the order in a notebook cannot go
    wrong. An explicit TRITON_INTERPRET set by the user is respected.
    """
    if not has_cuda():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def seed_everything(seed: int = 0) -> None:
    """Seed Python's, NumPy's and torch's generators (CPU and CUDA)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def setup(seed: int = 0, quiet: bool = False) -> torch.device:
    """Pick the device, seed everything and configure Triton; return the device.

    Prints one line, e.g. ``Runtime: cpu, Triton interpreter on, seed 0``. Printing options are
    fixed (4 decimals, no scientific notation) so that notebook outputs are stable.
    """
    interpreter = configure_triton()
    seed_everything(seed)
    torch.set_printoptions(precision=4, sci_mode=False, linewidth=100)
    np.set_printoptions(precision=4, suppress=True, linewidth=100)
    device = torch.device("cuda" if has_cuda() else "cpu")
    if not quiet:
        where = f"cuda ({torch.cuda.get_device_name()})" if device.type == "cuda" else "cpu"
        triton = "Triton interpreter on" if interpreter else "Triton compiled"
        colab = ", Colab" if in_colab() else ""
        print(f"Runtime: {where}{colab}, {triton}, seed {seed}")
    return device


def machine_name() -> str:
    """Where a measurement was taken, e.g. ``AMD EPYC, 2 cores, Linux-6.1-x86_64, torch 2.13.0+cpu``
    (the GPU's name first when CUDA is in use). Notebooks print it next to every timing."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor() or platform.machine()
    gpu = f"{torch.cuda.get_device_name()}, " if has_cuda() else ""
    return f"{gpu}{cpu}, {os.cpu_count()} cores, {platform.platform(terse=True)}, torch {torch.__version__}"
