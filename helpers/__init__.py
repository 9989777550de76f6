"""Helpers for the course "Attention, from the math to a Triton kernel".

Import what you need from the submodules::

    from helpers.runtime import setup          # device, seeds, Triton interpreter
    from helpers import reference, checks      # reference solutions and exercise checks
    from helpers.nb03_masks import causal_mask # a topic module: one per notebook, by its number

Importing the package imports neither torch nor Triton; it installs the course's import hook,
which makes ``import triton`` safe on a CPU in any order (``helpers.runtime``).
"""

from .runtime import install_import_hook

__version__ = "0.3.0"

install_import_hook()
