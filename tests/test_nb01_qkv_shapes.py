"""Notebook 01 (qkv_shapes): the lesson code of helpers.nb01_qkv_shapes against torch's own
implementations, helpers.runtime, and the checks of exercises 1.1-1.3: learner-style wrong
implementations each check must reject with its hint (WRONG), correct ones in other styles than the
reference it must accept (RIGHT), what a first and a repeated failure say, and the notebook
sections the checks of notebooks 01-04 and 09 point at."""

import json
import math
import os
import pathlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers import checks, runtime
from helpers import nb01_qkv_shapes as A
from helpers.checks import EXERCISES, CheckFailed, feedback
from tests.exercise_cases import assert_accepted, assert_rejected, first_fast, right_cases, wrong_cases

# =============================================================== lesson: helpers.nb01_qkv_shapes


def test_split_is_a_view_and_merge_inverts_it():
    x = torch.randn(2, 5, 12)
    h = A.split_heads(x, 3)
    assert h.shape == (2, 3, 5, 4) and h.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert torch.equal(A.merge_heads(h), x)
    with pytest.raises(ValueError, match="not divisible"):
        A.split_heads(x, 5)


def test_layer_costs_table_1_by_hand_and_the_crossover_at_n_equals_d():
    """n = 4, d = 2, k = 2: attention 2 products of n*n*d = 64 multiply-adds, 128 FLOPs; recurrence
    2 products of d*d per step, 4 steps = 32 multiply-adds, 64 FLOPs; convolution k*d*d per token,
    32 multiply-adds. Paths: dilated 2 (2**2 = 4 >= n), contiguous 3 (receptive field 1 + 3*(k-1))."""
    c = A.layer_costs(4, 2, k=2, r=2)
    assert c["self-attention"] == {"flops": 128, "sequential": 1, "path": 1}
    # restricted, r = 2: each query against 2 keys, 4 * 2 * 2 = 16 multiply-adds twice, 64 FLOPs;
    # a window of itself and the key before it moves a signal 1 position a layer: 3 layers
    assert c["restricted"] == {"flops": 64, "sequential": 1, "path": 3}
    assert c["recurrent"] == {"flops": 64, "sequential": 4, "path": 4}
    assert c["convolutional"] == {"flops": 64, "sequential": 1, "path": 2, "path_contiguous": 3}
    big = A.layer_costs(512, 512, 3)
    assert big["convolutional"]["path"] == 6 and big["convolutional"]["path_contiguous"] == 256
    for d in (16, 64, 100):
        att = [A.layer_costs(n, d)["self-attention"]["flops"] for n in range(1, 3 * d)]
        rec = [A.layer_costs(n, d)["recurrent"]["flops"] for n in range(1, 3 * d)]
        assert next(n for n, (a, r) in enumerate(zip(att, rec), start=1) if a >= r) == d
        assert att[d - 1] == rec[d - 1] == 4 * d**3
    with pytest.raises(ValueError):
        A.layer_costs(8, 4, k=1)
    with pytest.raises(ValueError):
        A.layer_costs(8, 4, r=1)


def test_layer_costs_sequential_operations_and_paths_by_brute_force():
    """The recurrence's n sequential updates, and the paths, found by following a signal: the
    fewest hops from token 0's input to token n - 1's output, where a hop is one layer (attention,
    restricted, convolution) or one state update (the recurrence's h_{t-1} -> h_t, after x_0 -> h_0)."""
    def layers_to_reach(n, reach):  # reach: how far one layer moves a signal forward
        at, layers = 0, 0
        while at < n - 1:
            at, layers = min(n - 1, at + reach), layers + 1
        return max(layers, 1)

    for n, r, k in ((2, 2, 2), (10, 4, 3), (64, 8, 3), (100, 100, 5), (5, 64, 2), (512, 64, 3)):
        c = A.layer_costs(n, 8, k, r)
        assert c["recurrent"]["sequential"] == n and c["recurrent"]["path"] == 1 + (n - 1)
        assert c["restricted"]["path"] == layers_to_reach(n, r - 1)
        assert c["convolutional"]["path_contiguous"] == (layers_to_reach(n, k - 1) if n > 1 else 0)
        assert c["restricted"]["flops"] == 4 * n * min(r, n) * 8
    full = A.layer_costs(300, 16, r=300)
    assert full["restricted"] == full["self-attention"]  # a window as long as the sequence
    assert A.layer_costs(512, 512, r=64)["restricted"]["path"] == 9  # 8 * 63 = 504 < 511 <= 9 * 63


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


# =============================================================== runtime: helpers.runtime


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


# =============================================================== checks of 1.1-1.3


def _message(check, fn) -> str:
    with pytest.raises(CheckFailed) as info:
        check(fn)
    return str(info.value)


def test_first_failure_points_at_the_section_and_a_repeat_shows_the_recipe():
    """An unrecognised mistake (a right answer scaled by 1.01) is described, not explained: the first
    failure names no cause and no solution, only the section and what was found (the factor); the
    third failed attempt shows the recipe."""
    feedback.reset_attempts()
    wrong = lambda q, k, v: sdpa_einsum(q, k, v) * 1.01  # noqa: E731
    first, second, third = (_message(checks.scaled_dot_product_attention, wrong) for _ in range(3))
    assert "hint:" not in first and "softmax(q @ k" not in first
    assert "see: notebooks/01_qkv_shapes.ipynb, section" in first
    assert "found: every entry is 1.01 times the expected one" in first
    assert "recipe:" not in second
    assert "recipe: torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(d_k), dim=-1) @ v" in third
    feedback.reset_attempts()


@pytest.mark.parametrize("notebook", ["01_qkv_shapes", "02_scaling", "03_masks", "04_backward", "09_flash_attention"])
def test_every_check_points_at_a_section_of_its_teaching_notebook(notebook):
    """First failures say "see: notebooks/NN_x.ipynb, section ...": that heading must exist."""
    cells = json.loads((pathlib.Path(__file__).parent.parent / "notebooks" / f"{notebook}.ipynb").read_text())["cells"]
    headings = {line.lstrip("#").strip() for c in cells if c["cell_type"] == "markdown"
                for line in "".join(c["source"]).splitlines() if line.startswith("#")}
    exercises = [ex for ex in EXERCISES.values() if ex.notebook == notebook]
    assert exercises
    for ex in exercises:
        assert ex.section in headings, f"{ex.id}: section {ex.section!r} is not a heading of {notebook}"


# --------------------------------------------------------------- wrong implementations


# ----------------------------------------------------------------- 1.1 qkv_projection


def qkv_reshape_without_transpose(x, w_qkv, n_heads):
    B, T, D = x.shape
    q, k, v = (x @ w_qkv).split(D, dim=-1)
    return tuple(t.reshape(B, n_heads, T, D // n_heads) for t in (q, k, v))


def qkv_view_no_transpose(x, w_qkv, n_heads):
    B, T, D = x.shape
    q, k, v = (x @ w_qkv).split(D, dim=-1)
    return tuple(t.view(B, T, n_heads, D // n_heads) for t in (q, k, v))


def qkv_wrong_order(x, w_qkv, n_heads):
    B, T, D = x.shape
    k, q, v = (x @ w_qkv).split(D, dim=-1)  # K columns taken as Q
    return tuple(t.view(B, T, n_heads, D // n_heads).transpose(1, 2) for t in (q, k, v))


def qkv_dk_major(x, w_qkv, n_heads):
    B, T, D = x.shape
    q, k, v = (x @ w_qkv).split(D, dim=-1)
    return tuple(t.view(B, T, D // n_heads, n_heads).permute(0, 3, 1, 2) for t in (q, k, v))


def qkv_returns_numpy(x, w_qkv, n_heads):
    B, T, D = x.shape
    q, k, v = (x @ w_qkv).split(D, dim=-1)
    return tuple(t.view(B, T, n_heads, D // n_heads).transpose(1, 2).numpy() for t in (q, k, v))


def qkv_returns_two(x, w_qkv, n_heads):
    B, T, D = x.shape
    q, k, _ = (x @ w_qkv).split(D, dim=-1)
    return q, k


def qkv_strided_parts(x, w_qkv, n_heads):
    B, T, D = x.shape
    proj = x @ w_qkv
    parts = [proj[..., i::3] for i in range(3)]  # q, k, v taken as every third column
    return tuple(p.reshape(B, T, n_heads, -1).permute(0, 2, 1, 3) for p in parts)


def qkv_neox_unflatten(x, w_qkv, n_heads):
    B, T, D = x.shape
    y = torch.einsum("btd,de->bte", x, w_qkv).unflatten(-1, (n_heads, 3, D // n_heads))
    return tuple(y.select(3, i).transpose(1, 2) for i in range(3))


def qkv_permute_then_view(x, w_qkv, n_heads):
    B, T, D = x.shape
    q, k, v = (x @ w_qkv).chunk(3, dim=-1)
    return tuple(t.permute(0, 2, 1).contiguous().view(B, n_heads, T, D // n_heads) for t in (q, k, v))


def qkv_scaled_k(x, w_qkv, n_heads):
    B, T, D = x.shape
    q, k, v = (x @ w_qkv).split(D, dim=-1)
    k = k / math.sqrt(D)  # "scaled like the weights"
    return tuple(t.view(B, T, n_heads, D // n_heads).transpose(1, 2) for t in (q, k, v))


def qkv_tokens_first(x, w_qkv, n_heads):
    B, T, D = x.shape
    q, k, v = (x @ w_qkv).split(D, dim=-1)
    return tuple(t.view(B, T, n_heads, D // n_heads).permute(1, 0, 2, 3) for t in (q, k, v))  # [T, B, H, d_k]


def qkv_heads_reversed(x, w_qkv, n_heads):
    B, T, D = x.shape
    q, k, v = (x @ w_qkv).split(D, dim=-1)
    return tuple(t.view(B, T, n_heads, D // n_heads).transpose(1, 2).flip(1) for t in (q, k, v))


def qkv_batch_times_heads(x, w_qkv, n_heads):
    B, T, D = x.shape
    parts = (x @ w_qkv).split(D, dim=-1)
    return tuple(p.view(B, T, n_heads, -1).transpose(1, 2).reshape(B * n_heads, T, -1) for p in parts)


def qkv_no_projection(x, w_qkv, n_heads):
    B, T, D = x.shape
    heads = x.unflatten(-1, (n_heads, D // n_heads)).transpose(1, 2)
    return heads, heads, heads


def qkv_unsplit(x, w_qkv, n_heads):
    return (x @ w_qkv).tensor_split(3, dim=-1)


# ----------------------------------------------------------------- 1.2 merge_heads


def merge_without_transpose(o):
    B, H, T, d_k = o.shape
    return o.reshape(B, T, H * d_k)


def merge_with_view(o):
    B, H, T, d_k = o.shape
    return o.transpose(1, 2).view(B, T, H * d_k)


def merge_dk_major(o):
    B, H, T, d_k = o.shape
    return o.permute(0, 2, 3, 1).reshape(B, T, H * d_k)


def merge_forgot_return(o):
    o.transpose(1, 2).reshape(o.shape[0], o.shape[2], -1)


def merge_float64(o):
    B, H, T, d_k = o.shape
    return o.transpose(1, 2).reshape(B, T, H * d_k).double()


def merge_heads_along_T(o):
    B, H, T, d_k = o.shape
    return o.reshape(B, H * T, d_k)  # the heads one after the other along the token axis


def merge_cat_heads_on_T(o):
    return torch.cat([o[:, h] for h in range(o.shape[1])], dim=1)  # [B, H*T, d_k]


def merge_transpose_then_tokens(o):
    B, H, T, d_k = o.shape
    return o.transpose(1, 2).reshape(B, T * H, d_k)


def merge_sum_heads(o):
    return o.sum(dim=1)


def merge_swaps_T_and_dk(o):
    B, H, T, d_k = o.shape
    return o.transpose(2, 3).reshape(B, T, H * d_k)

def merge_batch_moved(o):
    B, H, T, d_k = o.shape
    return o.permute(1, 2, 0, 3).reshape(B, T, H * d_k)  # [H, T, B, d_k] read as [B, T, H * d_k]


def merge_heads_rolled(o):
    return torch.roll(o, shifts=1, dims=1).transpose(1, 2).flatten(2)


def merge_wrong_final_shape(o):
    B, H, T, d_k = o.shape
    return o.transpose(1, 2).reshape(B, -1, T)  # sizes from the wrong axes


def merge_first_head(o):
    return o.select(1, 0)


def merge_sum_tiled(o):
    return o.sum(1).tile(1, 1, o.shape[1])


# ----------------------------------------------------------------- 1.3 scaled_dot_product_attention


def sdpa_no_scale(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v


def sdpa_scale_by_dk(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1], dim=-1) @ v


def sdpa_scale_by_dv(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(v.shape[-1]), dim=-1) @ v


def sdpa_softmax_wrong_axis(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-2) @ v


def sdpa_transpose_q(q, k, v):
    return torch.softmax(q.transpose(-2, -1) @ k / math.sqrt(q.shape[-1]), dim=-1) @ v


def sdpa_causal_when_not_asked(q, k, v):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    T_q, T_k = s.shape[-2:]
    s = s.masked_fill(~torch.ones(T_q, T_k, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def sdpa_in_place(q, k, v):
    q /= math.sqrt(q.shape[-1])
    return torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v


def sdpa_sigmoid(q, k, v):
    return torch.sigmoid(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])) @ v


def sdpa_normalised_without_exp(q, k, v):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    return (s / s.sum(-1, keepdim=True)) @ v


def sdpa_not_attempted(q, k, v):
    raise NotImplementedError()


def sdpa_nan(q, k, v):
    out = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1) @ v
    return out.index_fill(-1, torch.tensor([0]), float("nan"))


def sdpa_returns_weights(q, k, v):
    # the Math-for-LLMs notes' mistake 3: the weights are not the output
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)


def sdpa_mixes_keys(q, k, v):
    weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)
    return weights @ k  # keys where the values belong


def sdpa_broadcast_shape(q, k, v):
    out = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1) @ v
    return out.unsqueeze(0)


def sdpa_multiply_by_sqrt(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) * math.sqrt(q.shape[-1]), dim=-1) @ v


def sdpa_power_precedence(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) * q.shape[-1] ** -1 / 2, dim=-1) @ v  # (d_k ** -1) / 2


def sdpa_scale_after_softmax(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1), dim=-1) / math.sqrt(q.shape[-1]) @ v


def sdpa_scale_from_first_axis(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(0)), dim=-1) @ v


def sdpa_softmax_dim1(q, k, v):
    return F.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=1) @ v  # dim=1 as for [T, T] scores


def sdpa_weights_transposed(q, k, v):
    weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)
    return weights.transpose(-2, -1) @ v


def sdpa_exp_overflows(q, k, v):
    scores = torch.einsum("...qd,...kd->...qk", q, k) * q.shape[-1] ** -0.5
    weights = scores.exp()
    return (weights / weights.sum(dim=-1, keepdim=True)) @ v


def sdpa_global_max(q, k, v):
    s = q @ k.mT / math.sqrt(q.shape[-1])
    e = torch.exp(s - s.max())  # one max for all rows
    return e / e.sum(-1, keepdim=True) @ v


def sdpa_scale_by_keys(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / k.size(-2) ** 0.5, dim=-1) @ v


def sdpa_softmax_over_matrix(q, k, v):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    shape = s.shape
    return torch.softmax(s.reshape(*shape[:-2], -1), dim=-1).reshape(shape) @ v


def sdpa_int_sqrt(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / int(math.sqrt(q.shape[-1])), dim=-1) @ v


def sdpa_log_softmax(q, k, v):
    return F.log_softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1) @ v


def sdpa_output_transposed(q, k, v):
    return (F.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1) @ v).transpose(-1, -2)


def sdpa_d_model(q, k, v):
    d_model = q.shape[-1] * (q.shape[1] if q.dim() == 4 else 1)  # "the model width"
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(d_model), dim=-1) @ v


def sdpa_column_max(q, k, v):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    e = (s - s.max(dim=-2, keepdim=True).values).exp()
    return e / e.sum(-1, keepdim=True) @ v


def sdpa_matrix_max(q, k, v):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    e = torch.exp(s - s.amax(dim=(-2, -1), keepdim=True))  # one max per score matrix
    return e / e.sum(-1, keepdim=True) @ v


def sdpa_round_sqrt(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / round(q.shape[-1] ** 0.5), dim=-1) @ v


def sdpa_bfloat16(q, k, v):
    s = (q.bfloat16() @ k.bfloat16().transpose(-2, -1)).float() / math.sqrt(q.shape[-1])
    return torch.softmax(s, dim=-1) @ v


def sdpa_fourth_root(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.25, dim=-1) @ v


def qkv_stacked_view_einsum(x, w_qkv, n_heads):
    """Reads w_qkv as three stacked D x D matrices (view(3, D, D)), in einsum."""
    B, T, D = x.shape
    mats = w_qkv.view(3, D, D)
    proj = torch.einsum("btd,pde->pbte", x, mats)
    return tuple(p.unflatten(-1, (n_heads, D // n_heads)).permute(0, 2, 1, 3) for p in proj)


def qkv_linear_per_block(x, w_qkv, n_heads):
    """F.linear on each D x D block: F.linear(x, W) is x @ W.T, each block transposed."""
    B, T, D = x.shape
    return tuple(F.linear(x, w_qkv[:, i * D:(i + 1) * D]).reshape(B, T, n_heads, -1).transpose(1, 2)
                 for i in range(3))


def merge_into_float32_buffer(o):
    """Fills a fresh tensor: torch.zeros defaults to float32, whatever o's dtype."""
    B, H, T, d_k = o.shape
    out = torch.zeros(B, T, H * d_k)
    for h in range(H):
        out[..., h * d_k:(h + 1) * d_k] = o[:, h]
    return out


def sdpa_through_tolist(q, k, v):
    """Right values, rebuilt with torch.tensor(...tolist()): float32, whatever the inputs' dtype."""
    out = torch.softmax(q @ k.mT / math.sqrt(q.shape[-1]), dim=-1) @ v
    return torch.tensor(out.tolist())


WRONG = {
    "qkv_projection": [
        (qkv_reshape_without_transpose, "reshaped straight to [B, H, T, d_k]"),
        (qkv_view_no_transpose, "did not transpose"),
        (qkv_wrong_order, "Q, K, V in that order"),
        (qkv_dk_major, "d_k-major"),
        (qkv_returns_numpy, "torch.from_numpy"),
        (qkv_returns_two, "expected a tuple of 3"),
        (qkv_strided_parts, "you read w_qkv's columns as (q, k, v) interleaved per feature"),
        (qkv_neox_unflatten, "per-head [q, k, v] layout"),
        (qkv_permute_then_view, "you transposed the projection to [B, D, T] before splitting"),
        (qkv_scaled_k, "your k is the projection divided by sqrt(D)"),
        (qkv_tokens_first, "axes in the order [T, B, H, d_k]"),
        (qkv_heads_reversed, "head 0 of your q is columns [8, 9, 10, 11] of x @ w_qkv, where it should be columns 0..3"),
        (qkv_unsplit, "without splitting it into heads"),
        (qkv_batch_times_heads, "the expected values in the expected order, in the shape [6, 5, 4]"),
        (qkv_no_projection, "your q is x itself, split into heads"),
        (qkv_stacked_view_einsum, "your q is x @ w_qkv.reshape(3, D, D)[0], split into heads"),
        (qkv_linear_per_block, "your q is x @ W.T with W = q's D x D block of w_qkv"),
    ],
    "merge_heads": [
        (merge_without_transpose, "transpose(1, 2) first"),
        (merge_with_view, "use .reshape"),
        (merge_dk_major, "d_k-major"),
        (merge_forgot_return, "forget the `return`"),
        (merge_float64, "expected dtype torch.float32"),
        (merge_heads_along_T, "you stacked the heads along the token axis"),
        (merge_cat_heads_on_T, "you stacked the heads along the token axis"),
        (merge_transpose_then_tokens, "you stacked the heads along the token axis"),
        (merge_sum_heads, "you added the heads up"),
        (merge_swaps_T_and_dk, "you swapped axes 2 and 3"),
        (merge_batch_moved, "your rows mix the batch elements"),
        (merge_heads_rolled, "block 0 holds head 2, block 1 holds head 0, block 2 holds head 1"),
        (merge_wrong_final_shape, "the expected values in the expected order, in the shape [2, 12, 5]"),
        (merge_sum_tiled, "holds the sum of the heads"),
        (merge_first_head, "your result is one head's output"),
        (merge_into_float32_buffer, "expected dtype torch.float64, got torch.float32"),
    ],
    "scaled_dot_product_attention": [
        (sdpa_no_scale, "forgot to divide the scores by sqrt(d_k)"),
        (sdpa_scale_by_dk, "divided by d_k"),
        (sdpa_scale_by_dv, "sqrt(d_v)"),
        (sdpa_softmax_wrong_axis, "wrong axis"),
        (sdpa_transpose_q, "Transpose the last two axes of k"),
        (sdpa_causal_when_not_asked, "no mask was asked for"),
        (sdpa_in_place, "modified one of its input tensors in place"),
        (sdpa_sigmoid, "you used a sigmoid"),
        (sdpa_normalised_without_exp, "without exp"),
        (sdpa_not_attempted, "not attempted yet"),
        (sdpa_nan, "got NaN"),
        (sdpa_broadcast_shape, "expected shape"),
        (sdpa_returns_weights, "you returned the attention weights"),
        (sdpa_mixes_keys, "you averaged the keys (weights @ k)"),
        (sdpa_multiply_by_sqrt, "you multiplied the scores by sqrt(d_k)"),
        (sdpa_power_precedence, "** binds tighter than /"),
        (sdpa_scale_after_softmax, "after the softmax"),
        (sdpa_scale_from_first_axis, "you divided by the square root of q.shape[0]"),
        (sdpa_softmax_dim1, "softmax runs over axis 1, a batch or head axis"),
        (sdpa_weights_transposed, "Transpose the last two axes of k only, not q, v or the weights"),
        (sdpa_exp_overflows, "your softmax overflows"),
        (sdpa_global_max, "you subtracted one maximum shared by many rows"),
        (sdpa_scale_by_keys, "the number of keys T_k"),
        (sdpa_softmax_over_matrix, "over the whole [T_q, T_k] score matrix"),
        (sdpa_int_sqrt, "you rounded sqrt(d_k) down"),
        (sdpa_fourth_root, "your output is softmax(q k^T / X) @ v with X = 1.414"),
        (sdpa_log_softmax, "you used log_softmax as the weights"),
        (sdpa_output_transposed, "your output is transposed"),
        (sdpa_d_model, "you divided by sqrt(d_model)"),
        (sdpa_column_max, "you subtracted the maximum over the queries"),
        (sdpa_matrix_max, "you subtracted one maximum shared by many rows"),
        (sdpa_round_sqrt, "you rounded sqrt(d_k) to the nearest whole number"),
        (sdpa_bfloat16, "ran in a lower precision"),
        (sdpa_through_tolist, "expected dtype torch.float64, got torch.float32"),
    ],
}


# --------------------------------------------------------------- right variants


# ----------------------------------------------------------------- 1.1 qkv_projection


def qkv_einsum(x, w_qkv, n_heads):
    B, T, D = x.shape
    proj = torch.einsum("btd,de->bte", x, w_qkv)
    return tuple(p.reshape(B, T, n_heads, D // n_heads).permute(0, 2, 1, 3) for p in proj.chunk(3, dim=-1))


def qkv_per_head_loop(x, w_qkv, n_heads):
    D = x.shape[-1]
    d_k = D // n_heads
    out = []
    for part in range(3):
        heads = [x @ w_qkv[:, part * D + h * d_k: part * D + (h + 1) * d_k] for h in range(n_heads)]
        out.append(torch.stack(heads, dim=1))
    return out  # a list of three is fine


def qkv_float64_unflatten(x, w_qkv, n_heads):
    B, T, D = x.shape
    proj = (x.double() @ w_qkv.double()).to(x.dtype)
    q, k, v = proj.unflatten(-1, (3, n_heads, D // n_heads)).permute(2, 0, 3, 1, 4).unbind(0)
    return q, k, v


def qkv_linear_contiguous(x, w_qkv, n_heads):
    B, T, D = x.shape
    q, k, v = F.linear(x, w_qkv.T).split(D, dim=2)
    return tuple(t.contiguous().view(B, T, n_heads, -1).transpose(1, 2).contiguous() for t in (q, k, v))


# ----------------------------------------------------------------- 1.2 merge_heads


def merge_cat(o):
    return torch.cat(o.unbind(dim=1), dim=-1)


def merge_permute_flatten(o):
    return o.permute(0, 2, 1, 3).flatten(2)


def merge_contiguous_view(o):
    B, H, T, d_k = o.shape
    return o.transpose(1, 2).contiguous().view(B, T, -1)


def merge_einsum_loop(o):
    B, H, T, d_k = o.shape
    out = torch.empty(B, T, H * d_k, dtype=o.dtype)
    for h in range(H):
        out[:, :, h * d_k:(h + 1) * d_k] = torch.einsum("btd->btd", o[:, h])
    return out


def merge_movedim_float64(o):
    """movedim and flatten, through float64 and back."""
    return o.double().movedim(1, 2).flatten(start_dim=-2).to(o.dtype)

# ----------------------------------------------------------------- 1.3 scaled_dot_product_attention


def sdpa_torch(q, k, v):
    return F.scaled_dot_product_attention(q, k, v)


def sdpa_einsum(q, k, v):
    s = torch.einsum("...qd,...kd->...qk", q, k) / q.shape[-1] ** 0.5
    return torch.einsum("...qk,...kd->...qd", s.softmax(-1), v)


def sdpa_float64_by_hand(q, k, v):
    s = q.double() @ k.double().mT / math.sqrt(q.shape[-1])
    e = torch.exp(s - s.amax(-1, keepdim=True))
    return ((e / e.sum(-1, keepdim=True)) @ v.double()).to(q.dtype)


def sdpa_query_loop(q, k, v):
    rows = [torch.softmax(q[..., i:i + 1, :] @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), -1) @ v
            for i in range(q.shape[-2])]
    return torch.cat(rows, dim=-2)


def sdpa_numpy(q, k, v):
    qn, kn, vn = q.numpy(), k.numpy(), v.numpy()
    s = qn @ np.swapaxes(kn, -1, -2) / math.sqrt(qn.shape[-1])  # a Python float keeps float32
    e = np.exp(s - s.max(-1, keepdims=True))
    return torch.from_numpy((e / e.sum(-1, keepdims=True)) @ vn)


def sdpa_log_softmax_rsqrt(q, k, v):
    scores = torch.matmul(q, k.transpose(-1, -2)) * torch.tensor(q.shape[-1], dtype=q.dtype).rsqrt()
    return torch.log_softmax(scores, dim=-1).exp() @ v


def sdpa_masked_fill_stable(q, k, v):
    """A hand-written softmax that subtracts each row's maximum, behind an all-True mask filled with -1e9."""
    s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool), -1e9)
    e = torch.exp(s - s.max(dim=-1, keepdim=True).values)
    return torch.matmul(e / e.sum(dim=-1, keepdim=True), v)


def sdpa_torch_explicit_scale(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, scale=1 / math.sqrt(q.size(-1)))


def sdpa_logsumexp(q, k, v):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    return torch.exp(s - torch.logsumexp(s, dim=-1, keepdim=True)) @ v


RIGHT = {
    "qkv_projection": [qkv_einsum, qkv_per_head_loop, qkv_float64_unflatten, qkv_linear_contiguous],
    "merge_heads": [merge_cat, merge_permute_flatten, merge_contiguous_view, merge_einsum_loop, merge_movedim_float64],
    "scaled_dot_product_attention": [sdpa_torch, sdpa_einsum, sdpa_float64_by_hand, sdpa_query_loop, sdpa_numpy,
                                     sdpa_log_softmax_rsqrt, sdpa_masked_fill_stable, sdpa_torch_explicit_scale,
                                     sdpa_logsumexp],
}


# make test runs the first 10 wrong answers of each exercise (the commonest); make test-all all of them
@pytest.mark.parametrize(("name", "wrong", "hint"), first_fast(wrong_cases(WRONG), dict.fromkeys(WRONG, 10)))
def test_check_rejects_wrong(name, wrong, hint):
    assert_rejected(name, wrong, hint)


@pytest.mark.parametrize(("name", "right"), right_cases(RIGHT))
def test_check_accepts_right(name, right):
    assert_accepted(name, right)
