"""Reference implementations of every graded exercise, by the names of EXERCISES.md.

Notebooks import from here (or from the topic modules it re-exports); checks compare against it.
Each topic module lists its graded functions in ``__all__``.
"""

from .attention import merge_heads, qkv_projection, scaled_dot_product_attention
from .backward import *  # noqa: F403  (04_backward)
from .flash import *  # noqa: F403  (09_flash_attention, PyTorch)
from .flops import *  # noqa: F403  (08_flops_memory)
from .kv_cache import *  # noqa: F403  (07_kv_cache)
from .kv_sharing import *  # noqa: F403  (06_kv_sharing)
from .masks import *  # noqa: F403  (03_masks)
from .model import *  # noqa: F403  (11_trained_transformer)
from .multihead import *  # noqa: F403  (05_multihead)
from .positions import *  # noqa: F403  (10_positions)
from .scaling import *  # noqa: F403  (02_scaling)


def flash_attention_triton(q, k, v, causal=False):
    """9.3: the course's Triton forward kernel (imported on first use, so that importing
    ``helpers.reference`` never decorates a kernel before ``setup()``)."""
    from .triton_flash import flash_attention_triton as kernel

    return kernel(q, k, v, causal=causal)


def flash_attention_triton_backward(q, k, v, out, lse, grad_out, causal=False):
    """9.4: gradients ``(grad_q, grad_k, grad_v)`` from the course's Triton backward kernels."""
    from .triton_flash import flash_attention_triton_backward as kernel

    return kernel(q, k, v, out, lse, grad_out, causal=causal)
