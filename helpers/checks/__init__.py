"""Exercise checks: ``checks.<function name>(your_function)``.

Each check runs your function on fixed and random cases against ``helpers.reference`` and either
prints one line (exercise, title, points) or raises an ``AssertionError`` that names the failing
case, expected vs got, and a hint at the likely mistake. See ``_core`` for the machinery; each
topic module lists its checks in ``__all__``.
"""

from ._core import EXERCISES, CheckFailed, LearnerError, NotAttempted, TimedOut
from .backward import *  # noqa: F403  (04_backward)
from .flash import *  # noqa: F403  (09_flash_attention)
from .masks import *  # noqa: F403  (03_masks)
from .qkv_shapes import merge_heads, qkv_projection, scaled_dot_product_attention
from .scaling import *  # noqa: F403  (02_scaling)
