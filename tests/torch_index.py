"""Where pip finds torch for the environments the slow tests build: the Makefile's TORCH_INDEX rule
in Python. PyTorch's index is used only when it can be reached; otherwise pip's own configuration
decides (this project's machines, which cannot reach it, find torch 2.13.0+cpu in a local folder)."""

from __future__ import annotations

import importlib.metadata
import socket

PYTORCH_INDEX = "https://download.pytorch.org/whl"


def pytorch_index_reachable() -> bool:
    try:
        socket.getaddrinfo("download.pytorch.org", 443)
    except OSError:
        return False
    return True


def cpu_index() -> str:
    """PyTorch's CPU index when it can be reached (Gradescope's setup.sh's default), else ''."""
    return f"{PYTORCH_INDEX}/cpu" if pytorch_index_reachable() else ""


def running_torch_pip_args() -> list[str]:
    """pip arguments that install the running torch and Triton again: ``torch==2.13.0+cpu`` has a
    local label that PyPI lacks, so its PyTorch index is added when it can be reached."""
    pins, extra = [], []
    for name in ("torch", "triton"):
        try:
            pins.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    label = importlib.metadata.version("torch").partition("+")[2]
    if label and pytorch_index_reachable():
        extra = ["--extra-index-url", f"{PYTORCH_INDEX}/{label}"]
    return [*pins, *extra]
