"""Exercise checks: ``checks.<function name>(your_function)``.

Each check runs your function on fixed and random cases against ``helpers.reference`` and either
prints one line (exercise, title, points) or raises an ``AssertionError`` that names the failing
case, expected vs got, and a hint at the likely mistake. See ``_core`` for the machinery.
"""

from ._core import EXERCISES, RESULTS, CheckFailed, LearnerError, NotAttempted, TimedOut
from .qkv_shapes import merge_heads, qkv_projection, scaled_dot_product_attention

__all__ = [
    "EXERCISES", "RESULTS", "CheckFailed", "LearnerError", "NotAttempted", "TimedOut",
    "qkv_projection", "merge_heads", "scaled_dot_product_attention",
]
