"""Exercise checks: ``checks.<function name>(your_function)``.

Each check runs your function on fixed and random cases against ``helpers.reference`` and either
prints one line (exercise, title, points) or raises an ``AssertionError`` that names the failing
case, expected vs got, and a hint at the likely mistake.

The machinery, one job a module: ``core`` (cases, the trial, comparisons, registering checks),
``feedback`` (failures, messages, graduated hints, model answers, recorders), ``guard`` (the
integrity guard, refusing the reference, time limits, plain data), ``diagnose`` (facts about a wrong
output that no known mistake explains), ``instruments`` (the op log, provenance of values,
guarded allocations, kernel launches: what a check observes while the learner's function runs) and
``watchers`` (the learner's function run under the instruments, in the notebook's process when
``make grade`` grades; ``calling`` makes that call).
The checks themselves: one module a notebook, ``nbNN_topic``, each listing its checks in ``__all__``.
"""

from .core import EXERCISES, summary
from .feedback import CheckFailed, LearnerError, Mistake, NotAttempted, TimedOut
from .guard import protect as _protect
from .nb01_qkv_shapes import *  # noqa: F403
from .nb02_scaling import *  # noqa: F403
from .nb03_masks import *  # noqa: F403
from .nb04_backward import *  # noqa: F403
from .nb05_multihead import *  # noqa: F403
from .nb06_kv_sharing import *  # noqa: F403
from .nb07_kv_cache import *  # noqa: F403
from .nb08_flops_memory import *  # noqa: F403
from .nb09_flash_attention import *  # noqa: F403
from .nb09_triton_flash import *  # noqa: F403
from .nb10_positions import *  # noqa: F403
from .nb11_trained_transformer import *  # noqa: F403
from .nb12_serving import *  # noqa: F403
from .nb12_triton_decode import *  # noqa: F403
from .nb13_across_devices import *  # noqa: F403

_protect()  # the integrity guard's snapshot of the course's modules: keep this last
