"""Helpers for the course "Attention, from the math to a Triton kernel".

Import what you need from the submodules::

    from helpers.runtime import setup          # device, seeds, Triton interpreter
    from helpers import reference, checks      # reference solutions and exercise checks

Nothing here imports Triton kernels at import time, so `setup()` can still switch on the
interpreter on machines without a CUDA GPU.
"""

__version__ = "0.1.0"
