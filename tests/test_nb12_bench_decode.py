"""Notebook 12's decode benchmark (bench/bench_decode.py), as far as it runs without a GPU: the
paged and contiguous caches it times hold the same tokens (a wrong page layout would time a step
that computes something else), each SDPA row records the backend and the ops that ran, a backend
that refuses the shape says so and a step that fails otherwise is its row's error, the four timing
modes reach the CSV and the markdown with a split gain of their own, a run recorded before the new
columns existed still reports, and the passes stop at the time limit (a made-up clock).

The GPU-only paths (``do_bench``, the CUDA-graph replays, the profiler's kernel names) run on the
next lent GPU; here ``measure_shape(..., device="cpu")`` takes the same rows through the course
kernel in Triton's interpreter and SDPA on the CPU.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

try:
    import bench_decode as bd  # imports helpers.nb12_triton_decode: Triton's interpreter on a CPU
except ImportError:  # no Triton on this platform
    bd = None

pytestmark = pytest.mark.skipif(bd is None or bd.td is None, reason="Triton is Linux-only")
INFO = dict(gpu="Test GPU", torch="2.x", triton="3.x", commit="abc1234")


def test_paged_and_contiguous_caches_hold_the_same_tokens():
    gen = torch.Generator().manual_seed(0)
    k, v, k_pages, v_pages, table, lens = bd._caches(2, 64, 8, gen, device="cpu")
    q = torch.randn(2, bd.HEADS, bd.HEAD_DIM, generator=gen)
    assert sorted(table.flatten().tolist()) == list(range(2 * 64 // bd.PAGE))  # shuffled, all used
    assert table.flatten().tolist() != sorted(table.flatten().tolist())
    ks, vs = bd.td.gather_cache(k_pages, v_pages, table, lens)
    assert all(torch.equal(ks[b], k[b]) and torch.equal(vs[b], v[b]) for b in range(2))
    course = bd._step("course-1split", q, k, v, k_pages, v_pages, table, lens, 1)()
    for impl in ("sdpa-math", "sdpa-default"):
        sdpa = bd._step(impl, q, k, v, k_pages, v_pages, table, lens, None)()[:, :, 0]
        assert (course - sdpa).abs().max() < 1e-5, impl


@pytest.mark.slow  # make test-all: a few seconds
def test_measure_shape_on_cpu_records_backend_ops_and_refusals():
    impls = ("course", "sdpa-math", "sdpa-cudnn", "sdpa-default")
    rows = {r["impl"]: r for r in bd.measure_shape(1, 32, 8, impls, rep=1, device="cpu")}
    assert list(rows) == list(impls)
    assert rows["course"]["status"] == "ok" and rows["course"]["n_splits"] >= 1
    assert rows["course"]["kernels"] is None and rows["course"]["backend"] is None
    assert rows["sdpa-math"]["backend"] == "math"
    assert "math" in rows["sdpa-math"]["kernels"]
    assert rows["sdpa-cudnn"]["status"].startswith("unsupported: ")  # no cuDNN on a CPU
    assert rows["sdpa-cudnn"]["us_eager"] is None
    default = rows["sdpa-default"]
    assert default["backend"] == bd.sdpa_choice(torch.zeros(1, 32, 1, 128),
                                                torch.zeros(1, 8, 32, 128),
                                                torch.zeros(1, 8, 32, 128))
    assert default["backend"] in {"flash_attention", "efficient_attention", "cudnn_attention",
                                  "math"}
    assert default["kernels"] and "aten::scaled_dot_product_attention" not in default["kernels"]
    for name in ("course", "sdpa-math", "sdpa-default"):
        r = rows[name]
        assert r["us_eager"] > 0 and r["us"] is r["us_graph"] is r["us_graph_cold"] is None


def test_a_step_that_fails_otherwise_is_its_rows_error(monkeypatch):
    """Not a backend's refusal (RuntimeError) nor OOM: the row says error, the other rows are timed."""
    real = bd._step

    def step(impl, *args):
        if impl != "sdpa-efficient":
            return real(impl, *args)

        def fails():
            raise ValueError("a kernel that cannot take this shape")

        return fails

    monkeypatch.setattr(bd, "_step", step)
    rows = {r["impl"]: r for r in bd.measure_shape(1, 32, 8, ("sdpa-math", "sdpa-efficient"), rep=1, device="cpu",
                                                    profile=False)}
    assert rows["sdpa-math"]["status"] == "ok" and rows["sdpa-math"]["us_eager"] > 0
    assert rows["sdpa-efficient"]["status"] == "error: ValueError: a kernel that cannot take this shape"


class Clock:
    """A stand-in for the time module: perf_counter() reads ``now``, which the test moves."""

    def __init__(self):
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now


def test_a_decode_pass_stops_at_the_time_limit_and_a_shape_that_raises_is_rows(monkeypatch, tmp_path, capsys):
    """run's passes against a made-up clock (each shape 10 s, the warm-up one): the first pass stops
    before the shape that would start past the deadline; a shape whose caches raised gives error
    rows; the CSV and the markdown are written."""
    clock = Clock()
    monkeypatch.setattr(bd, "time", clock)
    monkeypatch.setattr(bd, "check_decode", lambda: [])
    monkeypatch.setattr(bd, "gpu_state", lambda: {})

    def measure_shape(B, T, H_kv, impls, rep, device="cuda", profile=True):
        clock.now += 10
        if T == 4096:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (the caches)")
        return [dict(r, us=10.0, us_graph=5.0) for r in bd.blank_rows(B, T, H_kv, impls, "ok")]

    monkeypatch.setattr(bd, "measure_shape", measure_shape)
    assert bd.run(dict(INFO), tmp_path, rep=1, batches=(1,), contexts=(1024, 4096, 16384), kv_heads=(8,),
                  impls=("course", "sdpa-default"), repeats=3, deadline=clock.now + 25) == 0
    assert "Decode: stopping in pass 1: the time limit reached" in capsys.readouterr().out
    rows = list(csv.DictReader((tmp_path / "test-gpu-decode.csv").open()))
    assert [(r["T"], r["status"]) for r in rows] == [
        ("1024", "ok"), ("1024", "ok"), ("4096", "error: OutOfMemoryError: CUDA out of memory (the caches)"),
        ("4096", "error: OutOfMemoryError: CUDA out of memory (the caches)")]
    assert "| 1 | 1024 | 10.0 / 419 " in (tmp_path / "test-gpu-decode.md").read_text()  # GB/s from the median


def test_short_kernel_names():
    assert bd.short_kernel_name("void pytorch_flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel"
                                "_traits<128, 64>, true>(Flash_fwd_params)") == (
        "pytorch_flash::flash_fwd_splitkv_kernel")
    assert bd.short_kernel_name("fmha_cutlassF_f16_aligned_64x128_rf_sm80(Params)") == (
        "fmha_cutlassF_f16_aligned_64x128_rf_sm80")
    assert bd.short_kernel_name("cudnn_generated_fort_native_sdpa_sm90_knob_7") == (
        "cudnn_generated_fort_native_sdpa_sm90_knob_7")


def _row(impl, T, us, eager, graph, cold, **extra):
    return dict(impl=impl, B=1, T=T, H=32, H_kv=8, d=128, page=16, n_splits=extra.pop("n", None),
                us=us, us_eager=eager, us_graph=graph, us_graph_cold=cold,
                gb_per_s=None if us is None else 1.0, backend=extra.pop("backend", None),
                kernels=extra.pop("kernels", None), status="ok")


def test_report_has_each_timing_mode_with_its_own_split_gain(tmp_path):
    rows = [_row("course", 1024, 180.0, 150.0, 10.0, 20.0, n=4),
            _row("course-1split", 1024, 54.0, 45.0, 20.0, 30.0, n=1),
            _row("sdpa-flash", 1024, 40.0, 30.0, 9.0, 15.0, backend="flash_attention",
                 kernels="pytorch_flash::flash_fwd_splitkv_kernel;pytorch_flash::combine"),
            _row("sdpa-default", 1024, 12.0, 11.0, 6.5, 9.0, backend="cudnn_attention",
                 kernels="cudnn_generated_fort_native_sdpa_sm90")]
    bd.write_markdown(rows, INFO, tmp_path / "x.md")
    md = (tmp_path / "x.md").read_text()
    for title in ("Launched back to back from Python", "Replayed from a CUDA graph, µs",
                  "L2 cleared before each replay", "Which kernels SDPA ran"):
        assert title in md
    assert "| 8 | 1 | 1024 | 150.0 | 45.0 | 30.0 | 11.0 | 0.30x |" in md      # eager: a loss
    assert "| 8 | 1 | 1024 | 10.0 | 20.0 | 9.0 | 6.5 | 2.00x |" in md         # graph: a gain
    assert "| 8 | 1 | 1024 | 20.0 | 30.0 | 15.0 | 9.0 | 1.50x |" in md        # graph, L2 cold
    assert "| sdpa-default | cudnn_attention | `cudnn_generated_fort_native_sdpa_sm90` | all |" in md
    bd.write_csv(rows, INFO, tmp_path / "x.csv")
    back = list(csv.DictReader((tmp_path / "x.csv").open()))
    assert list(back[0]) == bd.FIELDS
    assert back[3]["backend"] == "cudnn_attention" and float(back[0]["us_eager"]) == 150.0


def test_report_of_a_run_without_the_new_columns(tmp_path):
    rows = [dict(impl=i, B=1, T=1024, H=32, H_kv=8, d=128, page=16, n_splits=n, us=us,
                 gb_per_s=1.0, us_graph=g, status="ok")
            for i, n, us, g in (("course", 4, 180.0, 9.2), ("course-1split", 1, 54.0, 21.0))]
    bd.write_markdown(rows, INFO, tmp_path / "old.md")
    md = (tmp_path / "old.md").read_text()
    assert "| 1 | 1024 | 180.0 / 1 [4] | 54.0 / 1 | 0.30x |" in md
    assert "| 8 | 1 | 1024 | 9.2 | 21.0 | 2.28x |" in md
    assert "back to back" not in md and "Which kernels" not in md


def test_the_recorded_h200_run_holds_what_notebook_12_reads():
    from helpers.package_data import package_file

    rows = list(csv.DictReader(package_file("results", "nvidia-h200-decode.csv").open()))
    ok = {(r["impl"], int(r["H_kv"]), int(r["B"]), int(r["T"])) for r in rows
          if r["status"] == "ok" and r["us"] and r["us_graph"]}
    for impl in ("course", "course-1split", "sdpa-flash", "sdpa-default"):
        for H_kv in (8, 32):
            for T in (1024, 4096, 16384, 65536):
                assert (impl, H_kv, 1, T) in ok
    assert ("sdpa-flash", 8, 32, 65536) in ok and ("sdpa-default", 8, 32, 65536) in ok


def _graph_row(impl, B, T, H_kv, graph, run=1, **extra):
    return dict(impl=impl, B=B, T=T, H=32, H_kv=H_kv, d=128, page=16, n_splits=extra.pop("n", None),
                us=2 * graph, us_eager=3 * graph, us_graph=graph, us_graph_cold=1.5 * graph, gb_per_s=None,
                backend=None, kernels=None, status="ok", run=run, **extra)


def test_decode_passes_give_medians_spreads_and_the_goal_per_cell(tmp_path):
    # two cells; pass 2 of course at B=1 is 20% slower (flagged); sdpa-default faster than course at B=8
    runs = []
    for run, slow in ((1, 1.0), (2, 1.2), (3, 1.0)):
        runs += [_graph_row("course", 1, 1024, 8, 10.0 * slow, run, n=4), _graph_row("course-1split", 1, 1024, 8, 12.0, run, n=1),
                 _graph_row("sdpa-default", 1, 1024, 8, 10.4, run),
                 _graph_row("course", 8, 1024, 8, 30.0, run, n=2), _graph_row("course-1split", 8, 1024, 8, 29.0, run, n=1),
                 _graph_row("sdpa-default", 8, 1024, 8, 25.0, run)]
    rows = bd.with_bandwidth(bd.aggregate(runs, bd.KEY, bd.TIMES))
    course = rows[0]
    assert (course["us_graph"], course["runs"], course["us_runs"]) == (10.0, 3, "20;24;20")
    assert course["us_graph_spread"] == pytest.approx(20.0) and course["us_spread"] == pytest.approx(20.0)
    assert course["gb_per_s"] == pytest.approx(2 * 1 * 1024 * 8 * 128 * 2 / 20e-6 / 1e9)
    lines = bd.goal_checks(rows)
    assert lines[0] == ("- PASS: decode H_kv=8 B=1 T=1024, CUDA graphs: course at 1.04x sdpa-default's speed "
                        "(10.0 against 10.4 us; goal >= 0.95x)")
    assert lines[1].startswith("- FAIL: decode H_kv=8 B=8 T=1024, CUDA graphs: course-1split at 0.86x")  # the faster one
    assert lines[-1].strip() == "1 of 2 cells pass, 1 fail, 0 not measured."
    info = dict(INFO, cudnn="91002", clocks_before="SM 345 of 1980 MHz", clocks_after="SM 1980 of 1980 MHz")
    bd.write_markdown(rows, info, tmp_path / "x.md")
    md = (tmp_path / "x.md").read_text()
    assert "median of 3 passes" in md and "- before the decode rows: SM 345 of 1980 MHz" in md and "cuDNN 91002" in md
    assert "| 8 | 1 | 1024 | 10.0 [20%] | 12.0 | 10.4 | 1.20x |" in md  # graph table: the moved cell flagged
    assert "## Summary: the decode goal" in md and "1 of 2 cells pass" in md
    bd.write_csv(rows, info, tmp_path / "x.csv")
    back = list(csv.DictReader((tmp_path / "x.csv").open()))
    assert back[0]["runs"] == "3" and float(back[0]["us_graph_spread"]) == pytest.approx(20.0)
    assert back[0]["clocks_after"] == "SM 1980 of 1980 MHz"
