"""Notebook 08, FLOPs and memory (helpers/nb08_flops_memory.py): the FLOP and byte formulas against
a FLOP counter and the sources' figures, the memory meter, and the memory of a training step against
what a model saves and allocates; then exercises 8.1-8.4: learner-style
wrong implementations their checks must reject, with the hint each must give (WRONG), and correct
ones in other styles they must accept (RIGHT)."""

import dataclasses
import math
import random
import time

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from helpers.configs import H100_SXM, MODELS, ModelConfig
from helpers.nb01_qkv_shapes import merge_heads, scaled_dot_product_attention, split_heads
from helpers.nb06_kv_sharing import repeat_kv
from helpers.nb08_flops_memory import (
    GB,
    STRATEGIES,
    CountedDecoder,
    GiB,
    PeakMemory,
    activation_numbers,
    allocation_peak,
    attention_flops,
    attention_step_costs,
    best_seconds,
    both_units,
    chunked_attention_flops,
    crossover,
    dense_param_count,
    ffn_flops,
    head_activation_numbers,
    last_level_cache_bytes,
    layer_activation_numbers,
    layer_flops,
    matmul_flops,
    max_batch,
    max_seq_len_for_scores,
    rms_norm,
    saved_for_backward,
    saved_numbers,
    score_matrix_bytes,
    torch_threads,
    training_flops_per_token,
    training_memory,
    uncounted_saved_bytes,
)
from tests.exercise_cases import assert_accepted, assert_rejected, right_cases, wrong_cases

# ============================================================ the lesson code

MAVERICK = MODELS["Llama-4-Maverick"]


# --------------------------------------------------------------------------- the sources' figures


def test_maverick_dense_layer_at_4096_matches_the_dimensions_appendix():
    a = attention_flops(4096, MAVERICK.d_model, MAVERICK.n_heads, MAVERICK.n_kv_heads, MAVERICK.head_dim)
    assert [round(a[k] / 1e9, 1) for k in ("q_proj", "k_proj", "v_proj", "o_proj")] == [214.7, 42.9, 42.9, 214.7]
    assert round(a["scores"] / 1e9, 1) == round(a["weighted_values"] / 1e9, 1) == 171.8
    assert round(a["softmax"] / 1e9, 1) == 4.0
    parts = layer_flops(4096, MAVERICK)
    assert [round(parts[k] / 1e9, 1) for k in ("projections", "core", "ffn")] == [515.4, 347.6, 2061.6]
    assert round(parts["total"] / 1e9) == 2925
    shares = [round(100 * parts[k] / parts["total"], 1) for k in ("ffn", "projections", "core")]
    assert shares == [70.5, 17.6, 11.9]
    assert a["total"] == parts["projections"] + parts["core"]


def test_mha_formula_and_crossover_2d():
    d, H = 512, 8
    for n in (1, 17, 512, 4096):
        a = attention_flops(n, d, H, H, d // H)
        assert a["total"] - a["softmax"] == 8 * n * d * d + 4 * n * n * d
        assert a["softmax"] == 6 * H * n * n
    assert crossover(8 * d * d, 4 * d) == 2 * d            # matmul terms only: exactly n = 2d
    assert crossover(8 * d * d, 4 * d + 6 * H) < 2 * d     # the softmax term moves it a little earlier


def test_crossover_is_the_first_n_where_the_quadratic_term_wins():
    for lin, quad in [(125_829_120, 20_720), (10, 3), (9, 3), (1, 1), (7, 100)]:
        n = crossover(lin, quad)
        assert quad * n * n >= lin * n and (n == 1 or quad * (n - 1) ** 2 < lin * (n - 1))


def test_chunked_layer_is_the_full_layer_below_one_chunk_and_linear_past_it():
    dims = (64, 8, 2, 8)
    for n in (1, 15, 16):
        assert chunked_attention_flops(n, 16, *dims) == attention_flops(n, *dims)
    a, b = chunked_attention_flops(40, 16, *dims), attention_flops(40, *dims)  # 16 + 16 + 8 tokens
    core = ("scores", "softmax", "weighted_values")
    assert all(a[k] == b[k] for k in ("q_proj", "k_proj", "v_proj", "o_proj"))
    assert all(a[k] * 40**2 == b[k] * (16**2 + 16**2 + 8**2) for k in core)
    doubled = chunked_attention_flops(64, 16, *dims)  # whole chunks: the core grows as n * chunk
    assert all(doubled[k] == 2 * chunked_attention_flops(32, 16, *dims)[k] for k in doubled)


def test_chunked_formula_equals_flop_counter_on_attention_chunk_by_chunk():
    n, chunk, d, H, H_kv, d_h = 23, 8, 24, 4, 2, 6
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, n, d, generator=g)
    w_q, w_k, w_v = (torch.randn(d, h * d_h, generator=g) for h in (H, H_kv, H_kv))
    w_o = torch.randn(H * d_h, d, generator=g)
    with FlopCounterMode(display=False) as counter:
        for x_c in x.split(chunk, dim=1):  # each chunk attends only to itself
            q, k, v = split_heads(x_c @ w_q, H), split_heads(x_c @ w_k, H_kv), split_heads(x_c @ w_v, H_kv)
            merge_heads(scaled_dot_product_attention(q, repeat_kv(k, H // H_kv), repeat_kv(v, H // H_kv))) @ w_o
    f = chunked_attention_flops(n, chunk, d, H, H_kv, d_h)
    assert counter.get_total_flops() == f["total"] - f["softmax"]


def test_maverick_at_long_context_full_and_chunked_layers():
    full, local = layer_flops(131072, MAVERICK), layer_flops(131072, MAVERICK, chunked=True)
    assert round(100 * full["core"] / full["total"], 1) == 81.2
    assert round(100 * local["core"] / local["total"], 1) == 21.2
    assert local["core"] * 1024 == full["core"] * 64 and local["ffn"] == full["ffn"]
    assert layer_flops(8192, MAVERICK, chunked=True) == layer_flops(8192, MAVERICK)
    with pytest.raises(ValueError, match="no chunked attention"):
        layer_flops(10, MODELS["Llama-3-8B"], chunked=True)


def test_crossover_of_a_chunked_layer_is_the_full_one_within_a_chunk_else_never():
    for lin, quad, chunk in [(100, 3, 40), (100, 3, 34), (100, 3, 33), (125_829_120, 20_720, 8192),
                             (629_145_600, 20_720, 8192)]:
        full = crossover(lin, quad)
        cost = {n: quad * sum(len(c) ** 2 for c in torch.arange(n).split(chunk)) for n in range(1, 3 * chunk)} \
            if chunk < 100 else None
        expected = full if full <= chunk else None
        assert crossover(lin, quad, chunk) == expected
        if cost is not None:  # brute force: the first n where the chunked core reaches lin * n
            first = next((n for n, c in cost.items() if c >= lin * n), None)
            assert first == expected


def test_h100_fits_more_than_the_label_says():
    assert max_seq_len_for_scores(H100_SXM.memory, 1, 40, 2) == 32695
    assert max_seq_len_for_scores(80 * GB, 1, 40, 2) == 31622
    assert 80 * GB < H100_SXM.memory < score_matrix_bytes(1, 40, 32768, 2)


def test_thread_clock_counts_no_more_than_the_wall_clock():
    a = torch.randn(256, 256)
    with torch_threads(1):  # the work runs on this thread, so its CPU clock sees it
        start = time.perf_counter()
        cpu = best_seconds(lambda: a @ a, 3, time.thread_time)
        wall = time.perf_counter() - start  # a warm-up and 3 timed calls
    assert 0 < cpu <= wall / 3  # the fastest of 3 is at most their mean, and CPU time <= wall time


def test_last_level_cache_bytes_reads_sysfs_sizes(tmp_path):
    for text, expected in [("32768K\n", 32 * 2**20), ("8M", 8 * 2**20), ("1G", 2**30), ("512", 512)]:
        (tmp_path / "size").write_text(text)
        assert last_level_cache_bytes(str(tmp_path / "size")) == expected
    assert last_level_cache_bytes(str(tmp_path / "missing")) is None


def test_score_matrix_bytes_sources():
    assert score_matrix_bytes(4, 32, 8192, 2) == 17_179_869_184 == 16 * GiB
    assert both_units(17_179_869_184) == "17.18 GB (16.00 GiB)"
    assert score_matrix_bytes(1, 40, 4096, 2) == 1.25 * GiB
    assert score_matrix_bytes(1, 40, 32768, 2) == 80 * GiB
    assert score_matrix_bytes(1, 40, 131072, 2) == 1.25 * 2**40
    assert score_matrix_bytes(1, 40, 1048576, 2) == 80 * 2**40


def test_max_seq_len_is_exact_at_the_boundary():
    assert max_seq_len_for_scores(80 * GiB, 1, 40, 2) == 32768          # an exact fit
    assert max_seq_len_for_scores(80 * GiB - 1, 1, 40, 2) == 32767      # one byte short
    assert max_seq_len_for_scores(5, 2, 3, 1) == 0
    rng = random.Random(0)
    for _ in range(2000):
        B, H, b = rng.randint(1, 8), rng.randint(1, 128), rng.choice([1, 2, 4])
        budget = rng.randint(0, 10 ** rng.randint(1, 22))
        T = max_seq_len_for_scores(budget, B, H, b)
        assert score_matrix_bytes(B, H, T, b) <= budget < score_matrix_bytes(B, H, T + 1, b)
    k = 123_456_789  # above 2**53 a float square root rounds up; the integer one does not
    assert int(math.sqrt(k * k - 1)) == k and max_seq_len_for_scores(k * k - 1, 1, 1, 1) == k - 1


def test_dense_param_counts_match_the_published_sizes():
    assert round(dense_param_count(MODELS["Llama-3-8B"]) / 1e9, 2) == 8.03
    assert round(dense_param_count(MODELS["Llama-3-70B"]) / 1e9, 1) == 70.6
    assert round(dense_param_count(MODELS["Qwen3-8B"]) / 1e9, 1) == 8.2


def test_decode_step_intensity_of_mha_in_bf16_is_about_one():
    # One token, batch 1, MHA: every weight and cached number (2 bytes) is used for one multiply-add.
    c = attention_step_costs(1, 4096, 4096, 32, 32, 128, batch=1, dtype_bytes=2)
    assert 0.99 < c["flops"] / c["bytes"] < 1.0
    prefill = attention_step_costs(4096, 4096, 4096, 32, 32, 128, batch=1, dtype_bytes=2)
    assert prefill["flops"] / prefill["bytes"] > 1000


# --------------------------------------------------------------------------- a counter checks the formulas


@pytest.mark.parametrize("n, d, H, H_kv, d_h, d_ff", [(7, 20, 6, 2, 4, 36), (16, 32, 4, 4, 8, 48), (5, 24, 8, 1, 3, 10)])
def test_formulas_equal_flop_counter_mode(n, d, H, H_kv, d_h, d_ff):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, n, d, generator=g)
    w_q, w_k, w_v = (torch.randn(d, h * d_h, generator=g) for h in (H, H_kv, H_kv))
    w_o = torch.randn(H * d_h, d, generator=g)
    w_gate, w_up, w_down = torch.randn(d, d_ff, generator=g), torch.randn(d, d_ff, generator=g), torch.randn(d_ff, d, generator=g)
    with FlopCounterMode(display=False) as counter:
        q, k, v = split_heads(x @ w_q, H), split_heads(x @ w_k, H_kv), split_heads(x @ w_v, H_kv)
        o = scaled_dot_product_attention(q, repeat_kv(k, H // H_kv), repeat_kv(v, H // H_kv))
        y = merge_heads(o) @ w_o
        (F.silu(y @ w_gate) * (y @ w_up)) @ w_down
    f = attention_flops(n, d, H, H_kv, d_h)
    assert counter.get_total_flops() == f["total"] - f["softmax"] + ffn_flops(n, d, d_ff)
    assert matmul_flops(n, d, d_ff) == 2 * n * d * d_ff


# --------------------------------------------------------------------------- the memory meter


def test_peak_memory_of_plain_attention_is_two_score_matrices():
    for T in (64, 128):
        q, k, v = (torch.randn(1, 2, T, 16) for _ in range(3))
        with PeakMemory(q, k, v) as meter:
            out = scaled_dot_product_attention(q, k, v)
        scores = 1 * 2 * T * T * 4
        assert 2 * scores <= meter.peak <= 2 * scores + 4 * out.nbytes
        assert meter.now == out.untyped_storage().nbytes()  # only the output is still alive


def test_peak_memory_counts_nothing_for_views_of_inputs():
    x = torch.randn(100, 100)
    with PeakMemory(x) as meter:
        x.t()
        x[:10]
    assert meter.peak == 0


def test_gb_and_gib_are_what_they_say():
    assert GB == 10**9 and GiB == 2**30


@pytest.mark.slow
def test_peak_memory_agrees_with_the_profilers_allocation_events():
    # torch.profiler records every CPU allocation (+bytes) and free (-bytes) in time order; the
    # running sum's maximum is the peak (allocation_peak). PeakMemory must find the same for plain
    # attention.
    q, k, v = (torch.randn(1, 2, 96, 16) for _ in range(3))
    with PeakMemory(q, k, v) as meter:
        scaled_dot_product_attention(q, k, v)
    peak = allocation_peak(lambda: scaled_dot_product_attention(q, k, v))
    assert abs(peak - meter.peak) <= 64, (peak, meter.peak)  # a few bytes of 0-dim temporaries


# --------------------------------------------------------------------------- a training step's memory

SMALL = ModelConfig("small", "gqa", 32, 2, 4, 2, 8, 88, 64, "a test's model")


def _decoder_batch(attention, dtype=torch.float32, B=3, T=20, cfg=SMALL):
    g = torch.Generator().manual_seed(0)
    model = CountedDecoder(cfg, attention, g).to(dtype)
    tokens, targets = (torch.randint(0, cfg.vocab, (B, T), generator=g) for _ in range(2))
    return model, tokens, targets


@pytest.mark.parametrize("attention", STRATEGIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_counted_decoder_saves_exactly_the_counted_tensors(attention, dtype):
    model, tokens, targets = _decoder_batch(attention, dtype)
    assert sum(p.numel() for p in model.parameters()) == dense_param_count(SMALL)
    _, saved = saved_for_backward(lambda: model(tokens, targets), model.parameters())
    size = torch.finfo(dtype).bits // 8
    expected = size * saved_numbers(SMALL, 3, 20, attention) + uncounted_saved_bytes(SMALL, 3, 20, attention, size)
    assert sum(nbytes for _, _, nbytes in saved.values()) == expected


def test_naive_attention_saves_p_and_flash_does_not():
    sizes = {}
    for attention in ("naive", "flash"):
        model, tokens, targets = _decoder_batch(attention)
        _, saved = saved_for_backward(lambda m=model: m(tokens, targets), model.parameters())
        sizes[attention] = [shape for shape, _, _ in saved.values() if len(shape) == 4 and shape[-1] == 20]
    assert sizes["naive"] == [[3, 2, 2 * 20, 20]] * 2  # P of each layer: [B, H_kv, G*T, T]
    assert sizes["flash"] == []


def test_the_decoders_agree_and_rms_norm_has_the_right_gradient():
    losses, grads = [], []
    for attention in STRATEGIES:
        model, tokens, targets = _decoder_batch(attention)
        loss = model(tokens, targets)
        loss.backward()
        losses.append(loss.item())
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    assert max(losses) - min(losses) < 1e-5
    assert all(torch.allclose(g, grads[0], atol=1e-5) for g in grads[1:])
    x = torch.randn(3, 5, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, dtype=torch.float64, requires_grad=True)
    assert torch.allclose(rms_norm(x, w), torch.nn.functional.rms_norm(x, (6,), w, 1e-5))
    assert torch.autograd.gradcheck(lambda x_, w_: rms_norm(x_, w_), (x, w))


def test_activation_count_by_hand_for_llama_3_8b():
    llama = MODELS["Llama-3-8B"]
    flash = sum(layer_activation_numbers(llama, 8192, "flash").values())
    assert flash == 4 * 4096 + 2 * 32 * 128 + 2 * 8 * 128 + 4 * 14336 == 83968
    assert sum(layer_activation_numbers(llama, 8192, "naive").values()) == flash + 32 * 8192
    assert sum(head_activation_numbers(llama).values()) == 2 * 4096 + 128256
    per_token = 32 * 4096 + 2 * 4096 + 128256 + flash - 4096
    assert activation_numbers(llama, 3, 8192, "recompute") == 3 * 8192 * per_token
    m = training_memory(llama, 1, 8192, "flash")
    assert m["weights"] + m["gradients"] + m["optimizer"] == 16 * dense_param_count(llama)
    assert m["total"] == sum(v for k, v in m.items() if k != "total") == 174_743_158_784  # 8.4's statement
    with pytest.raises(ValueError, match="attention must be one of"):
        training_memory(llama, 1, 8192, "flashattention")
    with pytest.raises(ValueError, match="batch and seq_len"):
        training_memory(llama, -1, 8192, "flash")


def test_max_batch_is_the_boundary():
    for cfg, T in [(MODELS["Llama-3-8B"], 8192), (SMALL, 100), (MODELS["GPT-2 small"], 1024)]:
        for attention in STRATEGIES:
            for budget in (H100_SXM.memory, 10**9, 10**7):
                b = max_batch(cfg, T, attention, budget)
                if b:
                    assert training_memory(cfg, b, T, attention)["total"] <= budget
                assert b == 0 or training_memory(cfg, b + 1, T, attention)["total"] > budget
                if training_memory(cfg, 1, T, attention)["total"] <= budget:
                    assert b >= 1
    assert max_batch(MODELS["Llama-3-8B"], 8192, "recompute", H100_SXM.memory) == 0  # 16N > 80 GB


def test_training_flops_are_six_n_plus_three_times_the_attention_core():
    llama = MODELS["Llama-3-8B"]
    f = training_flops_per_token(llama, 8192)
    # N leaves out the input embedding table (a lookup) and keeps the output projection
    embedding = llama.vocab * llama.d_model
    assert f["dense"] == 6 * (dense_param_count(llama) - embedding) == 45_029_548_032
    assert f["dense"] != 6 * dense_param_count(llama)  # the embedding table does no multiply-add
    assert f["dense"] == 6 * dense_param_count(llama, tied_embeddings=True)  # one table, counted once
    core = attention_flops(8192, 4096, 32, 8, 128)
    per_layer = core["scores"] + core["softmax"] + core["weighted_values"]
    assert f["attention"] * 8192 == 3 * 32 * per_layer


def test_training_flops_do_not_depend_on_tied_embeddings():
    """A tied model multiplies by the same matrices as an untied one: the same FLOPs, and 6 x its
    parameter count (the one table is the output projection's)."""
    tied_params = dense_param_count(SMALL, tied_embeddings=True)
    f = training_flops_per_token(SMALL, 16)
    assert f["dense"] == 6 * tied_params
    matrices = SMALL.n_layers * (2 * SMALL.d_model * SMALL.n_heads * SMALL.head_dim
                                 + 2 * SMALL.d_model * SMALL.n_kv_heads * SMALL.head_dim
                                 + 3 * SMALL.d_model * SMALL.d_ff) + SMALL.vocab * SMALL.d_model
    norms = SMALL.d_model * (2 * SMALL.n_layers + 1)
    assert f["dense"] == 6 * (matrices + norms)


def test_allocation_peak_of_a_step_is_the_state_free_activations_and_some_temporaries():
    model, tokens, targets = _decoder_batch("flash")
    opt = torch.optim.AdamW(model.parameters())

    def step():
        opt.zero_grad(set_to_none=False)
        model(tokens, targets).backward()
        opt.step()

    step()  # creates the gradients and AdamW's states: the next step allocates only its working memory
    with torch_threads(1):
        peak = allocation_peak(step)
    saved = 4 * saved_numbers(SMALL, 3, 20, "flash") + uncounted_saved_bytes(SMALL, 3, 20, "flash", 4)
    assert saved <= peak <= 1.5 * saved
    assert allocation_peak(lambda: torch.empty(1000)) == 4000  # one allocation, freed at once


# ============================================================ 8.1 attention_flops

# wrong: what a learner might write
def _counts(n, d, H, H_kv, d_h):
    f = {
        "q_proj": 2 * n * d * H * d_h,
        "k_proj": 2 * n * d * H_kv * d_h,
        "v_proj": 2 * n * d * H_kv * d_h,
        "o_proj": 2 * n * H * d_h * d,
        "scores": H * 2 * n * n * d_h,
        "softmax": H * 6 * n * n,
        "weighted_values": H * 2 * n * n * d_h,
    }
    f["total"] = sum(f.values())
    return f


def flops_kv_with_query_heads(n, d_model, n_heads, n_kv_heads, head_dim):
    f = {
        "q_proj": 2 * n * d_model * n_heads * head_dim,
        "k_proj": 2 * n * d_model * n_heads * head_dim,  # as in MHA: one key head per query head
        "v_proj": 2 * n * d_model * n_heads * head_dim,
        "o_proj": 2 * n * n_heads * head_dim * d_model,
        "scores": n_heads * 2 * n * n * head_dim,
        "softmax": n_heads * 6 * n * n,
        "weighted_values": n_heads * 2 * n * n * head_dim,
    }
    f["total"] = sum(f.values())
    return f


def flops_softmax_5(n, d_model, n_heads, n_kv_heads, head_dim):
    f = _counts(n, d_model, n_heads, n_kv_heads, head_dim)
    f["softmax"] = n_heads * 5 * n * n  # exp, sum, divide... but forgot the max
    f["total"] = sum(v for k, v in f.items() if k != "total")
    return f


def flops_multiplies_only(n, d_model, n_heads, n_kv_heads, head_dim):
    d, H, H_kv, d_h = d_model, n_heads, n_kv_heads, head_dim
    f = {
        "q_proj": n * d * H * d_h,  # one per multiply-add
        "k_proj": n * d * H_kv * d_h,
        "v_proj": n * d * H_kv * d_h,
        "o_proj": n * H * d_h * d,
        "scores": H * n * n * d_h,
        "softmax": H * 6 * n * n,
        "weighted_values": H * n * n * d_h,
    }
    f["total"] = sum(f.values())
    return f


def flops_total_without_softmax(n, d_model, n_heads, n_kv_heads, head_dim):
    f = _counts(n, d_model, n_heads, n_kv_heads, head_dim)
    f["total"] = sum(v for k, v in f.items() if k not in ("total", "softmax"))  # "only matmuls count"
    return f


def flops_softmax_one_head(n, d_model, n_heads, n_kv_heads, head_dim):
    f = _counts(n, d_model, n_heads, n_kv_heads, head_dim)
    f["softmax"] = 6 * n * n  # one n x n matrix, not one per head
    f["total"] = sum(v for k, v in f.items() if k != "total")
    return f


def flops_square_projections(n, d_model, n_heads, n_kv_heads, head_dim):
    # Every projection as a d x d matrix (true only for MHA with H * d_h = d).
    f = _counts(n, d_model, n_heads, n_kv_heads, head_dim)
    f["q_proj"] = f["k_proj"] = f["v_proj"] = f["o_proj"] = 2 * n * d_model * d_model
    f["total"] = sum(v for k, v in f.items() if k != "total")
    return f


def flops_causal_half(n, d_model, n_heads, n_kv_heads, head_dim):
    f = _counts(n, d_model, n_heads, n_kv_heads, head_dim)
    f["scores"] = n_heads * 2 * head_dim * n * (n + 1) // 2  # only the lower triangle
    f["weighted_values"] = n_heads * 2 * head_dim * n * (n + 1) // 2
    f["total"] = sum(v for k, v in f.items() if k != "total")
    return f


def flops_scores_per_kv_head(n, d_model, n_heads, n_kv_heads, head_dim):
    f = _counts(n, d_model, n_heads, n_kv_heads, head_dim)
    f["scores"] = n_kv_heads * 2 * n * n * head_dim
    f["total"] = sum(v for k, v in f.items() if k != "total")
    return f


def flops_gflops_floats(n, d_model, n_heads, n_kv_heads, head_dim):
    return {k: v / 1e9 for k, v in _counts(n, d_model, n_heads, n_kv_heads, head_dim).items()}


def flops_missing_key(n, d_model, n_heads, n_kv_heads, head_dim):
    f = _counts(n, d_model, n_heads, n_kv_heads, head_dim)
    f["attn_v"] = f.pop("weighted_values")
    return f


def flops_tuple(n, d_model, n_heads, n_kv_heads, head_dim):
    return tuple(_counts(n, d_model, n_heads, n_kv_heads, head_dim).values())


# right: other styles than the reference
def flops_loop_over_heads(n, d_model, n_heads, n_kv_heads, head_dim):
    out = dict.fromkeys(["q_proj", "k_proj", "v_proj", "o_proj", "scores", "softmax", "weighted_values"], 0)
    for _ in range(n_heads):
        out["q_proj"] += 2 * n * d_model * head_dim
        out["o_proj"] += 2 * n * head_dim * d_model
        out["scores"] += 2 * n * n * head_dim
        out["softmax"] += n * n + 5 * n * n
        out["weighted_values"] += 2 * n * n * head_dim
    for _ in range(n_kv_heads):
        out["k_proj"] += 2 * n * d_model * head_dim
        out["v_proj"] += 2 * n * d_model * head_dim
    out["total"] = sum(out.values())
    return out


def flops_matmul_helper(n, d_model, n_heads, n_kv_heads, head_dim):
    def mm(a, b, c):
        return 2 * a * b * c

    parts = dict(q_proj=mm(n, d_model, n_heads * head_dim), k_proj=mm(n, d_model, n_kv_heads * head_dim),
                 v_proj=mm(n, d_model, n_kv_heads * head_dim), o_proj=mm(n, n_heads * head_dim, d_model),
                 scores=n_heads * mm(n, head_dim, n), softmax=6 * n_heads * n**2,
                 weighted_values=n_heads * mm(n, n, head_dim))
    return {**parts, "total": sum(parts.values()), "core": parts["scores"] + parts["softmax"]}  # an extra key is fine


def flops_torch_ints(n, d_model, n_heads, n_kv_heads, head_dim):
    t = torch.tensor([n, d_model, n_heads, n_kv_heads, head_dim], dtype=torch.int64)
    n_, d_, h, hkv, dh = t
    out = {"q_proj": 2 * n_ * d_ * h * dh, "k_proj": 2 * n_ * d_ * hkv * dh, "v_proj": 2 * n_ * d_ * hkv * dh,
           "o_proj": 2 * n_ * h * dh * d_, "scores": 2 * h * n_ * n_ * dh, "softmax": 6 * h * n_ * n_,
           "weighted_values": 2 * h * n_ * n_ * dh}
    out = {k: int(v) for k, v in out.items()}
    out["total"] = sum(out.values())
    return out


# ============================================================ 8.2 score_matrix_bytes

# wrong: what a learner might write
def bytes_no_batch(batch, n_heads, seq_len, dtype_bytes):
    return n_heads * seq_len * seq_len * dtype_bytes


def bytes_causal_half(batch, n_heads, seq_len, dtype_bytes):
    return batch * n_heads * seq_len * (seq_len + 1) // 2 * dtype_bytes


def bytes_causal_half_float(batch, n_heads, seq_len, dtype_bytes):
    return batch * n_heads * seq_len * seq_len * dtype_bytes / 2


def bytes_gib(batch, n_heads, seq_len, dtype_bytes):
    return batch * n_heads * seq_len**2 * dtype_bytes / 2**30


def bytes_gb(batch, n_heads, seq_len, dtype_bytes):
    return batch * n_heads * seq_len**2 * dtype_bytes / 1e9


def bytes_entries(batch, n_heads, seq_len, dtype_bytes):
    return batch * n_heads * seq_len * seq_len


def bytes_float_pow(batch, n_heads, seq_len, dtype_bytes):
    return batch * n_heads * math.pow(seq_len, 2) * dtype_bytes


# right: other styles than the reference
def bytes_meta_tensor(batch, n_heads, seq_len, dtype_bytes):
    # a dtype of that size, allocated nowhere (issue 32: a case with dtype_bytes = 3 refused this)
    dtype = {1: torch.int8, 2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[dtype_bytes]
    return torch.empty(batch, n_heads, seq_len, seq_len, dtype=dtype, device="meta").nbytes


def bytes_prod(batch, n_heads, seq_len, dtype_bytes):
    return math.prod([batch, n_heads, seq_len, seq_len, dtype_bytes])


def bytes_via_tensor(batch, n_heads, seq_len, dtype_bytes):
    dtype = {1: torch.int8, 2: torch.float16, 4: torch.float32}.get(dtype_bytes)
    if dtype is None:
        return batch * n_heads * seq_len**2 * dtype_bytes
    return batch * n_heads * seq_len**2 * torch.empty(0, dtype=dtype).element_size()


# ============================================================ 8.3 max_seq_len_for_scores

# wrong: what a learner might write
def seq_one_past(budget_bytes, batch, n_heads, dtype_bytes):
    return math.isqrt(budget_bytes // (batch * n_heads * dtype_bytes)) + 1


def seq_loop_one_past(budget_bytes, batch, n_heads, dtype_bytes):
    per = batch * n_heads * dtype_bytes
    T = max(math.isqrt(budget_bytes // per) - 2, 0)  # start near the answer, then step while it fits
    while per * T * T <= budget_bytes:
        T += 1
    return T  # the first T that does NOT fit


def seq_round_sqrt(budget_bytes, batch, n_heads, dtype_bytes):
    return round(math.sqrt(budget_bytes / (batch * n_heads * dtype_bytes)))


def seq_float_sqrt(budget_bytes, batch, n_heads, dtype_bytes):
    return int(math.sqrt(budget_bytes // (batch * n_heads * dtype_bytes)))


def seq_float_pow(budget_bytes, batch, n_heads, dtype_bytes):
    return int((budget_bytes / (batch * n_heads * dtype_bytes)) ** 0.5)


def seq_no_batch(budget_bytes, batch, n_heads, dtype_bytes):
    return math.isqrt(budget_bytes // (n_heads * dtype_bytes))


def seq_no_heads(budget_bytes, batch, n_heads, dtype_bytes):
    return math.isqrt(budget_bytes // (batch * dtype_bytes))


def seq_floor_float(budget_bytes, batch, n_heads, dtype_bytes):
    return math.sqrt(budget_bytes // (batch * n_heads * dtype_bytes)) // 1  # a float


# right: other styles than the reference
def seq_binary_search(budget_bytes, batch, n_heads, dtype_bytes):
    lo, hi = 0, 1
    while batch * n_heads * hi * hi * dtype_bytes <= budget_bytes:
        hi *= 2
    while hi - lo > 1:  # lo fits, hi does not
        mid = (lo + hi) // 2
        if batch * n_heads * mid * mid * dtype_bytes <= budget_bytes:
            lo = mid
        else:
            hi = mid
    return lo


def seq_float_then_correct(budget_bytes, batch, n_heads, dtype_bytes):
    q = budget_bytes // (batch * n_heads * dtype_bytes)
    T = int(math.sqrt(q))
    while T * T > q:
        T -= 1
    while (T + 1) * (T + 1) <= q:
        T += 1
    return T


def seq_newton(budget_bytes, batch, n_heads, dtype_bytes):
    q = budget_bytes // (batch * n_heads * dtype_bytes)
    if q < 2:
        return q
    x = q
    y = (x + 1) // 2
    while y < x:
        x, y = y, (y + q // y) // 2
    return x


# ============================================================ 8.4 training_memory

# wrong: what a learner might write
def _params(cfg):  # as the notebook counts them (untied embeddings)
    d, dh = cfg.d_model, cfg.head_dim
    per_layer = 2 * d * cfg.n_heads * dh + 2 * d * cfg.n_kv_heads * dh + 3 * d * cfg.d_ff + 2 * d
    return 2 * cfg.vocab * d + cfg.n_layers * per_layer + d


def _layer(cfg, seq_len, attention, kv_heads=None, mlp=4, p_heads=None):
    d, dh, H = cfg.d_model, cfg.head_dim, cfg.n_heads
    kv = cfg.n_kv_heads if kv_heads is None else kv_heads
    numbers = 4 * d + 2 * H * dh + 2 * kv * dh + mlp * cfg.d_ff
    if attention == "naive":
        numbers += (H if p_heads is None else p_heads) * seq_len
    return numbers


def _acts(cfg, batch, seq_len, attention, bytes_=2, layers=None, head=True, **layer_kw):
    L = cfg.n_layers if layers is None else layers
    top = 2 * cfg.d_model + cfg.vocab if head else 0
    if attention == "recompute":
        per_token = L * cfg.d_model + top + _layer(cfg, seq_len, "flash", **layer_kw) - cfg.d_model
    else:
        per_token = L * _layer(cfg, seq_len, attention, **layer_kw) + top
    return bytes_ * batch * seq_len * per_token


def _parts(n, acts, weights=2, grads=2, optimizer=12):
    out = {"weights": weights * n, "gradients": grads * n, "optimizer": optimizer * n, "activations": acts}
    out["total"] = sum(out.values())
    return out


def tm_total_without_gradients(cfg, batch, seq_len, attention):
    out = _parts(_params(cfg), _acts(cfg, batch, seq_len, attention))
    out["total"] = out["weights"] + out["optimizer"] + out["activations"]  # gradients: "transient"
    return out


def tm_one_moment(cfg, batch, seq_len, attention):
    n = _params(cfg)
    return _parts(n, _acts(cfg, batch, seq_len, attention), optimizer=4 + 4)  # master + m


def tm_no_master(cfg, batch, seq_len, attention):
    n = _params(cfg)
    return _parts(n, _acts(cfg, batch, seq_len, attention), optimizer=4 + 4)  # m + v, "weights are already stored"


def tm_moments_bf16(cfg, batch, seq_len, attention):
    n = _params(cfg)
    return _parts(n, _acts(cfg, batch, seq_len, attention), optimizer=4 + 2 + 2)  # m, v like the weights


def tm_weights_fp32(cfg, batch, seq_len, attention):
    return _parts(_params(cfg), _acts(cfg, batch, seq_len, attention), weights=4)


def tm_grads_fp32(cfg, batch, seq_len, attention):
    return _parts(_params(cfg), _acts(cfg, batch, seq_len, attention), grads=4)


def tm_tied_embeddings(cfg, batch, seq_len, attention):
    return _parts(_params(cfg) - cfg.vocab * cfg.d_model, _acts(cfg, batch, seq_len, attention))


def tm_one_layer(cfg, batch, seq_len, attention):
    return _parts(_params(cfg), _acts(cfg, batch, seq_len, attention, layers=1))


def tm_no_batch(cfg, batch, seq_len, attention):
    return _parts(_params(cfg), _acts(cfg, 1, seq_len, attention))


def tm_flash_keeps_p(cfg, batch, seq_len, attention):
    kind = "naive" if attention == "flash" else attention  # "the scores are still T x T"
    return _parts(_params(cfg), _acts(cfg, batch, seq_len, kind))


def tm_p_per_kv_head(cfg, batch, seq_len, attention):
    return _parts(_params(cfg), _acts(cfg, batch, seq_len, attention, p_heads=cfg.n_kv_heads))


def tm_activations_fp32(cfg, batch, seq_len, attention):
    return _parts(_params(cfg), _acts(cfg, batch, seq_len, attention, bytes_=4))


def tm_no_head(cfg, batch, seq_len, attention):
    return _parts(_params(cfg), _acts(cfg, batch, seq_len, attention, head=False))


def tm_kv_repeated(cfg, batch, seq_len, attention):
    return _parts(_params(cfg), _acts(cfg, batch, seq_len, attention, kv_heads=cfg.n_heads))


def tm_mlp_three(cfg, batch, seq_len, attention):
    return _parts(_params(cfg), _acts(cfg, batch, seq_len, attention, mlp=3))  # gate, up, product


def tm_recompute_inputs_only(cfg, batch, seq_len, attention):
    if attention != "recompute":
        return _parts(_params(cfg), _acts(cfg, batch, seq_len, attention))
    d = cfg.d_model
    acts = 2 * batch * seq_len * (cfg.n_layers * d + 2 * d + cfg.vocab)  # the recomputed layer forgotten
    return _parts(_params(cfg), acts)


def tm_p_rows_times_columns(cfg, batch, seq_len, attention):
    acts = _acts(cfg, batch, seq_len, attention)
    if attention == "naive":  # each token keeps "its scores", the whole T x T per head
        acts += 2 * batch * seq_len * cfg.n_layers * cfg.n_heads * seq_len * (seq_len - 1)
    return _parts(_params(cfg), acts)


def tm_p_counted_once(cfg, batch, seq_len, attention):
    acts = _acts(cfg, batch, seq_len, "flash" if attention == "naive" else attention)
    if attention == "naive":
        acts += 2 * batch * cfg.n_heads * seq_len * seq_len  # "the attention matrix", once
    return _parts(_params(cfg), acts)


def tm_head_logits_only(cfg, batch, seq_len, attention):
    acts = _acts(cfg, batch, seq_len, attention, head=False) + 2 * batch * seq_len * cfg.vocab
    return _parts(_params(cfg), acts)


def tm_head_norm_only(cfg, batch, seq_len, attention):
    acts = _acts(cfg, batch, seq_len, attention, head=False) + 2 * batch * seq_len * 2 * cfg.d_model
    return _parts(_params(cfg), acts)


def tm_no_attention_output(cfg, batch, seq_len, attention):
    # q, k, v saved; the attention output (W_O's input) forgotten, in every layer
    less = cfg.n_heads * cfg.head_dim * (cfg.n_layers if attention != "recompute" else 1)
    return _parts(_params(cfg), _acts(cfg, batch, seq_len, attention) - 2 * batch * seq_len * less)


def tm_optimizer_10_bytes(cfg, batch, seq_len, attention):
    return _parts(_params(cfg), _acts(cfg, batch, seq_len, attention), optimizer=4 + 4 + 2)  # master, m, v in bf16


def tm_params_without_norms(cfg, batch, seq_len, attention):
    d, dh = cfg.d_model, cfg.head_dim
    per_layer = 2 * d * cfg.n_heads * dh + 2 * d * cfg.n_kv_heads * dh + 3 * d * cfg.d_ff  # the matrices only
    return _parts(2 * cfg.vocab * d + cfg.n_layers * per_layer, _acts(cfg, batch, seq_len, attention))


def tm_total_counts_activations_twice(cfg, batch, seq_len, attention):
    out = _parts(_params(cfg), _acts(cfg, batch, seq_len, attention))
    out["total"] += out["activations"]  # "plus the activations" added after the sum
    return out


def tm_one_layer_too_many(cfg, batch, seq_len, attention):
    return _parts(_params(cfg), _acts(cfg, batch, seq_len, attention, layers=cfg.n_layers + 1))  # "+ the embedding"


def tm_recompute_like_flash(cfg, batch, seq_len, attention):
    kind = "flash" if attention == "recompute" else attention  # "recompute is flash attention"
    return _parts(_params(cfg), _acts(cfg, batch, seq_len, kind))


def tm_no_q(cfg, batch, seq_len, attention):
    per_layer_less = cfg.n_heads * cfg.head_dim  # q is "recomputed from x", not saved
    layers = 1 if attention == "recompute" else cfg.n_layers
    return _parts(_params(cfg), _acts(cfg, batch, seq_len, attention) - 2 * batch * seq_len * layers * per_layer_less)


def tm_total_gib(cfg, batch, seq_len, attention):
    out = _parts(_params(cfg), _acts(cfg, batch, seq_len, attention))
    out["total"] = out["total"] / 2**30
    return out


def tm_total_only(cfg, batch, seq_len, attention):
    return _parts(_params(cfg), _acts(cfg, batch, seq_len, attention))["total"]


def tm_missing_key(cfg, batch, seq_len, attention):
    out = _parts(_params(cfg), _acts(cfg, batch, seq_len, attention))
    out["adam"] = out.pop("optimizer")
    return out


def tm_changes_the_config(cfg, batch, seq_len, attention):
    # "fixes" the head width through the frozen dataclass, then counts right with it (issue 32)
    object.__setattr__(cfg, "head_dim", cfg.d_model // cfg.n_heads + 1)
    return _parts(_params(cfg), _acts(cfg, batch, seq_len, attention))


# right: other styles than the reference
def tm_loop_over_layers(cfg, batch, seq_len, attention):
    d, dh, H, H_kv, f = cfg.d_model, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, cfg.d_ff
    n = cfg.vocab * d * 2 + d
    saved = 0
    for _ in range(cfg.n_layers):
        n += d * H * dh + d * H_kv * dh * 2 + H * dh * d + 3 * d * f + 2 * d
        if attention == "recompute":
            saved += d
            continue
        for numbers in (d, d, H * dh, H_kv * dh, H_kv * dh, H * dh, d, d, f, f, f, f):
            saved += numbers
        if attention == "naive":
            saved += H * seq_len
    saved += d + d + cfg.vocab
    if attention == "recompute":
        saved += 3 * d + 2 * H * dh + 2 * H_kv * dh + 4 * f
    tokens = batch * seq_len
    parts = {"weights": 2 * n, "gradients": 2 * n, "optimizer": (4 + 4 + 4) * n, "activations": 2 * tokens * saved}
    parts["total"] = sum(parts.values())
    return parts


def tm_per_sequence(cfg, batch, seq_len, attention):
    from helpers.nb08_flops_memory import dense_param_count as count

    n = count(cfg)
    d, f = cfg.d_model, cfg.d_ff
    attn = cfg.head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
    layer = 4 * d + attn + 4 * f  # numbers per token
    per_seq = seq_len * layer * cfg.n_layers
    if attention == "naive":
        per_seq += cfg.n_layers * cfg.n_heads * seq_len**2  # P: H x T x T per layer
    elif attention == "recompute":
        per_seq = seq_len * (cfg.n_layers * d + layer - d)
    per_seq += seq_len * (2 * d + cfg.vocab)
    state = 16 * n
    acts = batch * per_seq * 2
    return {"weights": n * 2, "gradients": n * 2, "optimizer": state - 4 * n, "activations": acts,
            "total": state + acts, "per_parameter": 16}  # an extra key is fine


# ============================================================ the exercises' cases

def bytes_linear_in_t(batch, n_heads, seq_len, dtype_bytes):
    return batch * n_heads * seq_len * dtype_bytes  # one score per token


def bytes_fp16_always(batch, n_heads, seq_len, dtype_bytes):
    return batch * n_heads * seq_len * seq_len * 2  # "fp16: 2 bytes"


def seq_strictly_less(budget_bytes, batch, n_heads, dtype_bytes):
    per = batch * n_heads * dtype_bytes
    T = math.isqrt(budget_bytes // per)
    while T > 0 and per * T * T >= budget_bytes:  # ">=": an exact fit is treated as too big
        T -= 1
    return T


def tm_via_activation_numbers(cfg, batch, seq_len, attention):
    from helpers import nb08_flops_memory as nb08  # the helper that counts the activations

    n = nb08.dense_param_count(cfg)
    out = {"weights": 2 * n, "gradients": 2 * n, "optimizer": 12 * n,
           "activations": 2 * nb08.activation_numbers(cfg, batch, seq_len, attention)}
    return {**out, "total": sum(out.values())}



def flops_heads_split_from_d_model(n, d_model, n_heads, n_kv_heads, head_dim):
    d_h = d_model // n_heads  # "each head gets d_model / n_heads", ignoring head_dim
    return flops_matmul_helper(n, d_model, n_heads, n_kv_heads, d_h)


def bytes_fp32_scores(batch, n_heads, seq_len, dtype_bytes):
    return batch * n_heads * seq_len**2 * torch.empty(0, dtype=torch.float32).element_size()  # always fp32


def tm_head_inside_layer_loop(cfg, batch, seq_len, attention):
    out = tm_loop_over_layers(cfg, batch, seq_len, attention)
    extra = 2 * batch * seq_len * (cfg.n_layers - 1) * (2 * cfg.d_model + cfg.vocab)  # the head, once per layer
    out["activations"] += extra
    out["total"] += extra
    return out


WRONG = {
    "attention_flops": [
        (flops_kv_with_query_heads, "K and V projections with the query heads"),
        (flops_softmax_5, "5*n^2 per head"),
        (flops_multiplies_only, "multiplies only"),
        (flops_total_without_softmax, "total leaves out the softmax"),
        (flops_softmax_one_head, "every head's n x n scores"),
        (flops_square_projections, "W_Q is [d, H*d_h]"),
        (flops_causal_half, "causal halving is not counted"),
        (flops_scores_per_kv_head, "not per key/value head"),
        (flops_gflops_floats, "not a value scaled for printing"),
        (flops_missing_key, "lacks the key(s) 'weighted_values'"),
        (flops_tuple, "expected a dict"),
        (flops_heads_split_from_d_model, "heads d_model // n_heads wide"),
    ],
    "score_matrix_bytes": [
        (bytes_no_batch, "left out the batch"),
        (bytes_causal_half, "halved the square for the causal mask"),
        (bytes_causal_half_float, "halved the square for the causal mask"),
        (bytes_gib, "GiB as a float"),
        (bytes_gb, "GB as a float"),
        (bytes_entries, "counted entries, not bytes"),
        (bytes_float_pow, "expected an int"),
        (bytes_linear_in_t, "T entries per head, not T*T"),
        (bytes_fp16_always, "ignored dtype_bytes (2 bytes"),
        (bytes_fp32_scores, "4 bytes per score whatever dtype_bytes is"),
    ],
    "max_seq_len_for_scores": [
        (seq_one_past, "one past the boundary"),
        (seq_loop_one_past, "one past the boundary"),
        (seq_round_sqrt, "rounded the square root"),
        (seq_float_sqrt, "float square root is off by one"),
        (seq_float_pow, "float square root is off by one"),
        (seq_no_batch, "ignored the batch"),
        (seq_no_heads, "ignored the heads"),
        (seq_floor_float, "expected an int"),
        (seq_strictly_less, "an exact fit is left out"),
    ],
    "training_memory": [
        (tm_via_activation_numbers, "write your own implementation"),
        (tm_changes_the_config, "changed the ModelConfig it was given (head_dim"),
        (tm_total_without_gradients, "your total leaves out the weights or the gradients"),
        (tm_one_moment, "one of AdamW's two moments"),
        (tm_no_master, "left out the master weights"),
        (tm_moments_bf16, "counted m and v in bf16"),
        (tm_weights_fp32, "the weights are bf16"),
        (tm_grads_fp32, "the gradients are bf16"),
        (tm_tied_embeddings, "the embeddings are untied"),
        (tm_one_layer, "not multiplied by the number of layers"),
        (tm_no_batch, "left out the batch"),
        (tm_flash_keeps_p, "T x T probabilities under FlashAttention"),
        (tm_p_per_kv_head, "not per key/value head"),
        (tm_activations_fp32, "activations are bf16"),
        (tm_no_head, "left out the head"),
        (tm_kv_repeated, "does not repeat"),
        (tm_mlp_three, "four tensors of d_ff"),
        (tm_recompute_inputs_only, "recomputes one layer at a time"),
        (tm_total_gib, "GiB as a float"),
        (tm_total_only, "expected a dict"),
        (tm_missing_key, "lacks the key(s) 'optimizer'"),
        (tm_p_rows_times_columns, "whole T x T probability matrix for every token"),
        (tm_p_counted_once, "every one of the n_layers layers saves its own P"),
        (tm_head_logits_only, "You left out the 2d"),
        (tm_head_norm_only, "You left out the vocab"),
        (tm_no_attention_output, "each layer of yours counts 1 x n_heads*head_dim fewer"),
        (tm_optimizer_10_bytes, "you counted the optimizer at 10 bytes per parameter"),
        (tm_params_without_norms, "leaves out the norms' weights"),
        (tm_total_counts_activations_twice, "your total counts the activations twice"),
        (tm_one_layer_too_many, "you counted n_layers + 1 layers"),
        (tm_recompute_like_flash, "with recompute you counted every layer's activations, as with flash"),
        (tm_no_q, "a n_heads*head_dim-wide tensor left out in every layer"),
        (tm_head_inside_layer_loop, "head's 2d + vocab numbers per token in every layer"),
    ],
}


RIGHT = {
    "attention_flops": [flops_loop_over_heads, flops_matmul_helper, flops_torch_ints],
    "score_matrix_bytes": [bytes_prod, bytes_via_tensor, bytes_meta_tensor],
    "max_seq_len_for_scores": [seq_binary_search, seq_float_then_correct, seq_newton],
    "training_memory": [tm_loop_over_layers, tm_per_sequence],
}


@pytest.mark.parametrize(("name", "wrong", "hint"), wrong_cases(WRONG))
def test_check_rejects_wrong(name, wrong, hint):
    assert_rejected(name, wrong, hint)


@pytest.mark.parametrize(("name", "right"), right_cases(RIGHT))
def test_check_accepts_right(name, right):
    assert_accepted(name, right)


def test_a_config_changed_by_the_learner_leaves_the_courses_models_as_they_are():
    """8.4 hands the learner a copy: object.__setattr__ on it cannot change MODELS for the rest of
    the session (the next case, the reference, other exercises)."""
    def changes_llama_only(cfg, batch, seq_len, attention):  # right on the small models before it
        if cfg.name == "Llama-3-8B":
            object.__setattr__(cfg, "n_kv_heads", cfg.n_heads)
        return tm_loop_over_layers(cfg, batch, seq_len, attention)

    before = dataclasses.replace(MODELS["Llama-3-8B"])
    assert_rejected("training_memory", changes_llama_only, "changed the ModelConfig it was given (n_kv_heads")
    assert MODELS["Llama-3-8B"] == before
