"""Exercise checks: ``checks.<function name>(your_function)``.

Each check runs your function on fixed and random cases against ``helpers.reference`` and either
prints one line (exercise, title, points) or raises an ``AssertionError`` that names the failing
case, expected vs got, and a hint at the likely mistake. See ``_core`` for the machinery; each
topic module lists its checks in ``__all__``.
"""

from ._core import EXERCISES, CheckFailed, LearnerError, NotAttempted, TimedOut
from ._core import protect as _protect
from .backward import *  # noqa: F403  (04_backward)
from .flash import *  # noqa: F403  (09_flash_attention)
from .flops import *  # noqa: F403  (08_flops_memory)
from .kv_cache import *  # noqa: F403  (07_kv_cache)
from .kv_sharing import *  # noqa: F403  (06_kv_sharing)
from .masks import *  # noqa: F403  (03_masks)
from .model import *  # noqa: F403  (11_trained_transformer)
from .multihead import *  # noqa: F403  (05_multihead)
from .positions import *  # noqa: F403  (10_positions)
from .qkv_shapes import merge_heads, qkv_projection, scaled_dot_product_attention
from .scaling import *  # noqa: F403  (02_scaling)

_protect()  # the integrity guard's snapshot of the course's modules: keep this last
