"""Reference implementations of every graded exercise, by their names in helpers/registry.py.

Notebooks import from here (or from the topic modules it re-exports); checks compare against it.
Each topic module lists its graded functions in ``__all__``.
"""

from .nb01_qkv_shapes import merge_heads, qkv_projection, scaled_dot_product_attention
from .nb02_scaling import *  # noqa: F403  (02_scaling)
from .nb03_masks import *  # noqa: F403  (03_masks)
from .nb04_backward import *  # noqa: F403  (04_backward)
from .nb05_multihead import *  # noqa: F403  (05_multihead)
from .nb06_kv_sharing import *  # noqa: F403  (06_kv_sharing)
from .nb07_kv_cache import *  # noqa: F403  (07_kv_cache)
from .nb08_flops_memory import *  # noqa: F403  (08_flops_memory)
from .nb09_flash_attention import *  # noqa: F403  (09_flash_attention, PyTorch)
from .nb10_positions import *  # noqa: F403  (10_positions)
from .nb11_trained_transformer import *  # noqa: F403  (11_trained_transformer)
from .nb12_serving import *  # noqa: F403  (12_serving)
from .nb13_across_devices import *  # noqa: F403  (13_across_devices)


def flash_attention_triton(q, k, v, causal=False):
    """9.3: the course's Triton forward kernel (imported on first use, so that importing
    ``helpers.reference`` never decorates a kernel before ``setup()``)."""
    from .nb09_triton_flash import flash_attention_triton as kernel

    return kernel(q, k, v, causal=causal)


def flash_attention_triton_backward(q, k, v, out, lse, grad_out, causal=False):
    """9.4: gradients ``(grad_q, grad_k, grad_v)`` from the course's Triton backward kernels."""
    from .nb09_triton_flash import flash_attention_triton_backward as kernel

    return kernel(q, k, v, out, lse, grad_out, causal=causal)


def paged_decode_triton(q, k_pages, v_pages, block_tables, seq_lens, n_splits=None, sm_scale=None):
    """12.4: split-KV decoding over a paged cache, by the course's Triton kernels (imported on
    first use, like 9.3)."""
    from .nb12_triton_decode import paged_decode_triton as kernel

    return kernel(q, k_pages, v_pages, block_tables, seq_lens, n_splits=n_splits, sm_scale=sm_scale)
