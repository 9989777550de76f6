"""helpers.nb01_qkv_shapes and helpers.runtime: properties against torch's own implementations."""

import math
import os

import pytest
import torch
import torch.nn.functional as F

from helpers import nb01_qkv_shapes as A
from helpers import runtime


def test_split_is_a_view_and_merge_inverts_it():
    x = torch.randn(2, 5, 12)
    h = A.split_heads(x, 3)
    assert h.shape == (2, 3, 5, 4) and h.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert torch.equal(A.merge_heads(h), x)
    with pytest.raises(ValueError, match="not divisible"):
        A.split_heads(x, 5)


def test_sdpa_matches_torch_with_and_without_mask():
    q, k, v = torch.randn(2, 3, 6, 4), torch.randn(2, 3, 6, 4), torch.randn(2, 3, 6, 5)
    assert torch.allclose(A.scaled_dot_product_attention(q, k, v), F.scaled_dot_product_attention(q, k, v), atol=1e-6)
    causal = A.causal_mask(6)
    got = A.scaled_dot_product_attention(q, k, v, causal)
    assert torch.allclose(got, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-6)
    assert torch.allclose(got, F.scaled_dot_product_attention(q, k, v, attn_mask=causal), atol=1e-6)


def test_masked_softmax_is_stable_and_fully_masked_rows_are_zero():
    scores = torch.tensor([[1e4, -1e4, 0.0], [5.0, 6.0, 7.0]])
    allowed = torch.tensor([[True, True, False], [False, False, False]])
    p = A.masked_softmax(scores, allowed)
    assert torch.equal(p, torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    assert torch.allclose(A.masked_softmax(scores), torch.softmax(scores, -1))


def test_qkv_projection_columns_are_q_k_v():
    x, w = torch.randn(2, 5, 12), torch.randn(12, 36)
    q, k, v = A.qkv_projection(x, w, 3)
    for t, cols in ((q, slice(0, 12)), (k, slice(12, 24)), (v, slice(24, 36))):
        assert torch.allclose(A.merge_heads(t), x @ w[:, cols], atol=1e-5)


def test_data_flow_shapes_prefill_decode_and_gqa():
    rows = {name: shape for _, name, shape in A.data_flow_shapes(1, 4096, 5120, 40, 8, 128)}
    assert rows["W_K"] == (5120, 1024) and rows["scores"] == (1, 40, 4096, 4096)
    decode = {name: shape for _, name, shape in A.data_flow_shapes(2, 100, 64, 4, T_q=1)}
    assert decode["scores"] == (2, 4, 1, 100) and decode["K heads (all keys)"] == (2, 4, 100, 16)
    assert math.prod(rows["W_Q"]) + 2 * math.prod(rows["W_K"]) + math.prod(rows["W_O"]) == 62_914_560
    with pytest.raises(ValueError, match="n_kv_heads"):
        A.data_flow_shapes(1, 8, 64, 4, 3)


def test_setup_seeds_and_switches_on_the_interpreter_without_cuda(capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    device = runtime.setup(seed=3)
    a = torch.rand(3)
    runtime.setup(seed=3, quiet=True)
    assert torch.equal(a, torch.rand(3))
    out = capsys.readouterr().out
    assert out.startswith("Runtime: ") and "seed 3" in out
    if not torch.cuda.is_available():
        assert device.type == "cpu" and os.environ["TRITON_INTERPRET"] == "1" and "interpreter on" in out
    assert runtime.in_colab() is False


def test_machine_name_names_cpu_cores_and_torch():
    name = runtime.machine_name()
    assert f"{os.cpu_count()} cores" in name and f"torch {torch.__version__}" in name
