"""make bench (bench/bench_attention.py) as far as it runs without a GPU: the repeats (medians and
spreads of given per-pass timings), the report on made-up passes (flags, the CUDA-graph and profiler
columns, the machine's record, the plot), the goals (a run that passes every one, and one failing
each, named in the summary), the name of SDPA's default backend on the CPU, the fused backward's
check (a fused backward that fails refuses course-fused alone), the passes against a made-up clock
(--time-limit mid-pass, a cell that raises), which ahead-of-time report the autotuner's choices are
compared with, the compile workers' start under a script that imported Triton, the run-time model
behind bench/README.md's estimates, and `make bench`'s no-GPU path.

The CUDA glue (do_bench, do_bench_cudagraph, torch.profiler on the GPU, nvidia-smi) runs on the next
lent GPU (bench/gpu_session.sh); its arithmetic is factored out and tested here.
"""

from __future__ import annotations

import ast
import csv
import os
import re
import shlex
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import bench_attention as ba  # noqa: E402
import bench_decode as bd  # noqa: E402

pytestmark = pytest.mark.skipif(ba.tf is None, reason="Triton is Linux-only")
# speed of each impl relative to sdpa-flash; sdpa-flash runs at 400 TFLOPS
SPEED = {"naive": 0.1, "sdpa-flash": 1.0, "sdpa-cudnn": 1.2, "sdpa-efficient": 0.8, "sdpa-math": 0.1,
         "course": 1.25, "course-pointers": 1.15, "course-fused": 1.3}
SEQS = (1024, 4096)
INFO = {"gpu": "Fake GPU", "driver": "580.1", "torch": "2.x", "triton": "3.x", "cuda": "13.0", "cudnn": "91002",
        "commit": "abc1234", "rep": 25, "sms": 132, "l2_mib": 60,
        "states": [("before the run", {"clocks.sm": 345.0, "clocks.max.sm": 1980.0, "clocks.mem": 3201.0,
                                       "power.draw": 75.5, "power.limit": 700.0, "temperature.gpu": 31.0,
                                       "pstate": "P0", "clocks_event_reasons.active": "0x0000000000000001"}),
                   ("after pass 1", {"clocks.sm": 1980.0, "temperature.gpu": 48.0})]}


def synthetic_runs(seqs=SEQS, passes: int = 3, jitter: float = 0.01) -> list[dict]:
    """Passes over the grid with made-up timings: ms from SPEED, each pass `jitter` apart (a spread
    of 2 * jitter), graph 10% faster, first-pass memory linear (quadratic for naive and math)."""
    runs = []
    for p in range(1, passes + 1):
        for T in seqs:
            for d in ba.HEAD_DIMS:
                for c in (False, True):
                    for mode in ba.MODES:
                        for impl, speed in SPEED.items():
                            row = ba.new_row(impl, mode, T, d, c)
                            if mode == "fwd" and impl in ba.FWD_OF:
                                row["status"] = "skipped: the same forward kernel as course"
                            else:
                                ms = ba.model_flops(T, d, c, mode) / (400e12 * speed) * 1e3 * (1 + jitter * (p - 2))
                                row.update(ms=ms, ms_graph=0.9 * ms, graph_status="ok", host_ms=0.04)
                            if p == 1 and row["ms"]:
                                quadratic = impl in ("naive", "sdpa-math")
                                row.update(peak_extra_gib=0.1 * (T / 1024) ** (2 if quadratic else 1),
                                           sdpa_default="cudnn_attention" if impl.startswith("sdpa") else None)
                                if T <= ba.SHORT_T:
                                    row.update(gpu_ms=0.8 * ms, launches=4.0)
                            runs.append(dict(row, run=p))
    return runs


def verdicts(lines: list[str]) -> dict[str, str]:
    """goal_checks' lines -> {what: PASS/FAIL/n/a}."""
    return {m[2]: m[1] for line in lines if (m := re.match(r"- (PASS|FAIL|n/a): (.+?): ", line))}


# ------------------------------------------------------------------------------------- the repeats


def test_median_and_spread_of_given_per_pass_timings():
    assert bd.summarize([1.0, 1.2, 0.9]) == {"median": 1.0, "min": 0.9, "max": 1.2, "spread": pytest.approx(30.0),
                                             "runs": 3}
    assert bd.summarize([2.0, None])["spread"] is None  # one run: no spread
    assert bd.summarize([None]) is None
    cell = dict(impl="course", mode="fwd+bwd", T=1024, d=64, causal=True)
    runs = [dict(ba.new_row(**cell), ms=1.0, ms_graph=0.80, host_ms=0.05, gpu_ms=0.7, launches=4.0, run=1),
            dict(ba.new_row(**cell), ms=1.2, ms_graph=None, host_ms=0.07, run=2),
            dict(ba.new_row(**cell), ms=0.9, ms_graph=0.82, host_ms=0.06, run=3),
            dict(ba.new_row(**cell), status="OOM", run=4)]
    (row,) = ba.aggregate(runs)
    assert (row["ms"], row["ms_min"], row["ms_max"], row["runs"]) == (1.0, 0.9, 1.2, 3)
    assert row["ms_spread"] == pytest.approx(30.0) and row["ms_runs"] == "1;1.2;0.9"
    assert row["ms_graph"] == pytest.approx(0.81) and row["ms_graph_spread"] == pytest.approx(0.02 / 0.81 * 100)
    assert row["host_ms"] == pytest.approx(0.06)
    assert (row["gpu_ms"], row["launches"]) == (0.7, 4.0)  # the first pass's, though later ones lack them
    assert row["tflops"] == pytest.approx(ba.model_flops(1024, 64, True, "fwd+bwd") / 1e-3 / 1e12)
    assert row["status"] == "ok (run 4: OOM)" and "run" not in row


def test_a_pass_starts_only_if_it_ends_in_time():
    assert bd.another_pass(100.0, 10.0, None)
    assert bd.another_pass(100.0, 10.0, 111.0) and not bd.another_pass(100.0, 10.0, 110.9)
    assert bd.another_pass(5.0, 0.0, 6.0)  # the first pass always starts


# ------------------------------------------------------------------------------------- the report


def test_report_of_synthetic_passes(tmp_path):
    runs = synthetic_runs()
    for r in runs:  # one cell that moves 20% between passes, one that could not be captured
        if (r["impl"], r["mode"], r["T"], r["d"], r["causal"]) == ("course", "fwd+bwd", 1024, 128, True):
            r["ms"] *= 1 + 0.1 * (r["run"] - 2)
        if (r["impl"], r["mode"], r["T"]) == ("sdpa-math", "fwd+bwd", 4096):
            r.update(ms_graph=None, graph_status="not captured: operation not permitted when stream is capturing")
        if (r["impl"], r["mode"], r["T"], r["causal"]) == ("course", "fwd", 1024, False):
            r["host_ms"] = 1.0  # issuing a call takes longer than its kernels: launch-bound
        if r["impl"].startswith("sdpa") and r["mode"] == "fwd+bwd" and r["d"] == 64 and r.get("sdpa_default"):
            r["sdpa_default"] = "flash_attention"
    rows = ba.aggregate(runs)
    ba.write_csv(rows, INFO, tmp_path / "fake.csv")
    ba.write_markdown(rows, INFO, SEQS, tmp_path / "fake.md")
    ba.plot(rows, INFO, SEQS, tmp_path / "fake.png")
    back = list(csv.DictReader((tmp_path / "fake.csv").open()))
    assert list(back[0]) == ba.FIELDS and len(back) == len(rows)
    flash = next(r for r in back if (r["impl"], r["mode"], r["T"], r["d"]) == ("sdpa-flash", "fwd", "1024", "64"))
    assert flash["runs"] == "3" and len(flash["ms_runs"].split(";")) == 3 and float(flash["ms_spread"]) == pytest.approx(2, abs=0.01)
    assert flash["cudnn"] == "91002" and flash["sdpa_default"] == "cudnn_attention"
    md = (tmp_path / "fake.md").read_text()
    assert "median of 3 passes" in md and "cuDNN 91002" in md and "132 SMs, 60 MiB of L2" in md
    assert "| before the run | 345 | 1980 | 3201 | 76 | 700 | 31 | P0 | 0x0000000000000001 |  |" in md
    assert "| after pass 1 | 1980 |" in md
    assert "- `cudnn_attention`: fwd d=64 T=1024" in md and "- `flash_attention`: fwd+bwd d=64 T=1024" in md
    moved = ba._lookup(rows)[("course", "fwd+bwd", 1024, 128, True)]
    assert moved["ms_spread"] > 20 and f"{moved['tflops']:.0f} [{moved['ms_spread']:.0f}%]" in md  # flagged
    assert "[2%]" not in md  # a 2% spread is not
    assert "## Forward + backward, replayed from a CUDA graph, TFLOPS" in md and "| n/c |" in md
    assert "sdpa-math (fwd+bwd): CUDA graph not captured: operation not permitted" in md
    assert re.search(r"\| fwd \| False \| 64 \| 1024 \| course \| [0-9.]+ \| [0-9.]+ \| 4 \| [0-9.]+ \| host \|", md)
    assert re.search(r"\| fwd\+bwd \| True \| 128 \| 1024 \| course-fused \| [0-9.]+ \| [0-9.]+ \| 4 \| 0.040 \| GPU \|", md)
    assert "| 4096 | course" not in md  # the profiler's table holds short cells only
    assert "course-fused (fwd, T=1024): skipped: the same forward kernel as course" in md
    assert "## Summary: the course's goals" in md and "goals pass" in md
    assert (tmp_path / "fake.png").stat().st_size > 10_000


def test_profiler_and_host_arithmetic():
    events = [("flash_fwd", True, 100.0), ("aten::sdpa", False, 50.0), ("Memset (Device)", True, 300.0)]
    assert ba.profile_summary(events, 2) == (pytest.approx(0.2), 1.0)
    assert ba.profile_summary(events[1:2], 2) == (None, None)  # no GPU activity seen: no number, not 0 ms
    assert ba.bound({"host_ms": 0.05, "gpu_ms": 0.03}) == "host"
    assert ba.bound({"host_ms": 0.05, "gpu_ms": 0.3}) == "GPU"
    assert ba.bound({"host_ms": 0.05, "gpu_ms": None}) == ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the glue runs for real (make bench)")
def test_the_cuda_glue_runs_its_python_on_the_cpu(monkeypatch):
    """host_ms, profile_calls and graph_ms around a CPU step (the GPU's syncs stubbed): the
    profiler's events are read without error and count no GPU work; a capture that fails is a status."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)
    x = torch.randn(32, 32, requires_grad=True)
    calls = []

    def step():
        calls.append(1)
        (x @ x).sum().backward()

    def reset():
        x.grad = None

    assert ba.host_ms(step, reset, n=3) > 0 and len(calls) == 3 and x.grad is not None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CUDA is not available, disabling CUDA profiling
        assert ba.profile_calls(step, reset) == (None, None)
    ms, status = ba.graph_ms(step, [x], 25)
    assert ms is None and status.startswith("not captured: ")


def test_the_gpus_state_from_nvidia_smi(monkeypatch):
    line = "1980, 1980, 3201, 3201, 250.51, 700.00, 41, P0"
    assert bd.parse_smi(bd.SMI_FIELDS, line) == {"clocks.sm": 1980.0, "clocks.max.sm": 1980.0, "clocks.mem": 3201.0,
                                                 "clocks.max.mem": 3201.0, "power.draw": 250.51,
                                                 "power.limit": 700.0, "temperature.gpu": 41.0, "pstate": "P0"}
    assert bd.parse_smi(("power.draw", "clocks.sm"), "[N/A]") == {"power.draw": None, "clocks.sm": None}
    answers = {bd.SMI_FIELDS: line, bd.SMI_REASONS: "0x0000000000000004"}
    monkeypatch.setattr(bd, "command_output",
                        lambda args: answers[tuple(args[1].split("=")[1].split(","))])
    state = bd.gpu_state()
    assert state["clocks.sm"] == 1980 and state["clocks_event_reasons.active"] == "0x0000000000000004"
    assert bd.clocks_text(state).startswith("SM 1980 of 1980 MHz, memory 3201 of 3201 MHz, 251 of 700 W, 41 C, "
                                            "P0, reasons 0x0000000000000004")
    monkeypatch.setattr(bd, "command_output", lambda args: "")  # no nvidia-smi
    assert bd.clocks_text({k: v for k, v in bd.gpu_state().items() if not k.startswith("torch")}) == "unknown"


def test_sdpa_defaults_backend_is_named_on_the_cpu(monkeypatch):
    from torch.nn.attention import SDPBackend

    q, k, v = (torch.randn(1, 4, 64, 32) for _ in range(3))
    name = bd.sdpa_choice(q, k, v, enable_gqa=False, is_causal=True)
    assert name == SDPBackend(torch._fused_sdp_choice(q, k, v, is_causal=True)).name.lower()
    assert name in {"flash_attention", "efficient_attention", "cudnn_attention", "math"}
    seen = []
    monkeypatch.setattr(torch, "_fused_sdp_choice",
                        lambda *a, **kw: seen.append(kw) or SDPBackend.CUDNN_ATTENTION.value)
    assert bd.sdpa_choice(q, k, v, enable_gqa=False, is_causal=True) == "cudnn_attention"
    assert seen == [{"is_causal": True, "enable_gqa": False}]  # the prefill rows' call, not decode's GQA one
    monkeypatch.setattr(torch, "_fused_sdp_choice", lambda *a, **kw: (_ for _ in ()).throw(TypeError("new API")))
    assert bd.sdpa_choice(q, k, v) == "unknown"


# ------------------------------------------------------------------------------------- the goals


def _set(rows: dict, key: tuple, **values) -> None:
    rows[key].update(values)


def test_goals_all_pass_then_each_fails_alone():
    base = ba.aggregate(synthetic_runs())
    lines = ba.goal_checks(base)
    assert set(verdicts(lines).values()) == {"PASS"} and len(verdicts(lines)) == 4 + 4 + 4 + 4, lines
    assert lines[-1].strip() == "16 of 16 goals pass, 0 fail, 0 not measured."
    assert "backward TFLOPS, d=128 T=4096 causal=True: course-fused at" in "\n".join(lines)  # the best one, named
    assert "forward vs sdpa-cudnn, d=128 T=4096 causal=False: course at 1.04x" in "\n".join(lines)

    def fwd_ms(t, impl, T, d, c):
        return t[(impl, "fwd", T, d, c)]["ms"]

    def bwd(t, impl, T, d, c):
        return ba.backward_ms(t, impl, T, d, c)

    def fails(edit) -> list[str]:
        rows = [dict(r) for r in base]
        t = ba._lookup(rows)
        edit(t)
        out = ba.goal_checks(rows)
        failed = [what for what, v in verdicts(out).items() if v == "FAIL"]
        assert out[-1].strip().endswith("Failed: " + "; ".join(failed) + "." if failed else "0 not measured."), out[-1]
        return failed

    # forward at d=128 must reach cuDNN (0.95x fails), at d=64 0.9x (0.95x passes, 0.85x fails)
    assert fails(lambda t: _set(t, ("sdpa-cudnn", "fwd", 4096, 128, False), ms=0.95 * fwd_ms(t, "course", 4096, 128, False))) \
        == ["forward vs sdpa-cudnn, d=128 T=4096 causal=False"]
    assert fails(lambda t: _set(t, ("sdpa-cudnn", "fwd", 4096, 64, True), ms=0.95 * fwd_ms(t, "course", 4096, 64, True))) == []
    assert fails(lambda t: _set(t, ("sdpa-cudnn", "fwd", 4096, 64, True), ms=0.85 * fwd_ms(t, "course", 4096, 64, True))) \
        == ["forward vs sdpa-cudnn, d=64 T=4096 causal=True"]

    def slow_backward(t):  # every implementation's backward at 450 TFLOPS: same speed as cuDNN, too slow
        bwd_ms = ba.model_flops(4096, 128, True, "bwd") / 450e12 * 1e3
        for impl in ("course", "course-pointers", "course-fused", "sdpa-cudnn"):
            _set(t, (impl, "fwd+bwd", 4096, 128, True), ms=fwd_ms(t, ba.FWD_OF.get(impl, impl), 4096, 128, True) + bwd_ms)
    assert fails(slow_backward) == ["backward TFLOPS, d=128 T=4096 causal=True"]
    assert fails(lambda t: _set(t, ("sdpa-cudnn", "fwd+bwd", 4096, 128, False),
                                ms=fwd_ms(t, "sdpa-cudnn", 4096, 128, False) + 0.85 * bwd(t, "course-fused", 4096, 128, False))) \
        == ["backward vs sdpa-cudnn, d=128 T=4096 causal=False"]
    assert fails(lambda t: _set(t, ("sdpa-flash", "fwd+bwd", 1024, 64, False),
                                ms=0.9 * t[("course-fused", "fwd+bwd", 1024, 64, False)]["ms"])) \
        == ["forward+backward vs sdpa-flash, T=1024 d=64 causal=False, spreads <= 5%"]
    assert fails(lambda t: _set(t, ("course-fused", "fwd+bwd", 1024, 128, True), ms_spread=8.0)) \
        == ["forward+backward vs sdpa-flash, T=1024 d=128 causal=True, spreads <= 5%"]
    assert fails(lambda t: _set(t, ("sdpa-flash", "fwd+bwd", 1024, 128, False), ms_spread=5.5)) \
        == ["forward+backward vs sdpa-flash, T=1024 d=128 causal=False, spreads <= 5%"]
    assert fails(lambda t: _set(t, ("course", "fwd", 4096, 64, True), peak_extra_gib=1.0)) \
        == ["course forward peak extra memory growth T=1024 -> 4096, d=64 causal"]
    assert fails(lambda t: _set(t, ("naive", "fwd", 4096, 128, True), peak_extra_gib=0.4)) \
        == ["naive forward peak extra memory growth T=1024 -> 4096, d=128 causal"]


def test_goals_name_the_best_course_implementation_and_what_was_not_measured():
    rows = ba.aggregate(synthetic_runs())
    t = ba._lookup(rows)
    t[("course-pointers", "fwd", 4096, 64, False)]["ms"] = 0.5 * t[("course", "fwd", 4096, 64, False)]["ms"]
    text = "\n".join(ba.goal_checks(rows))
    assert "forward vs sdpa-cudnn, d=64 T=4096 causal=False: course-pointers at" in text
    one_pass = ba.aggregate(synthetic_runs(seqs=(1024, 2048), passes=1))
    v = verdicts(ba.goal_checks(one_pass))
    assert v["forward vs sdpa-cudnn, d=128, T >= 4096"] == "n/a" and v["backward at d=128, T >= 4096"] == "n/a"
    assert v["forward+backward vs sdpa-flash, T=1024 d=64 causal=True, spreads <= 5%"] == "n/a"  # one pass: no spread


# ------------------------------------------------------------------------------------- the fused backward


def test_a_case_failing_only_in_the_fused_backward_refuses_course_fused_alone():
    """kernel_gpu.check_kernels's failures, as it words them: the fused backward's outputs alone keep
    course-fused from being timed; any other failure stops every course row."""
    case = "fp16 B=2 H=8 H_kv=2 T_q=1000 T_k=1000 d=64 causal=True tma"
    fused = [f"{case}: fused dq: Tensor-likes are not close!", f"{case}: fused dk: 3 NaN (elements never written?)"]
    other = [f"{case}: dq: Tensor-likes are not close!", f"{case}: out: 2 NaN (elements never written?)"]
    impls = ["sdpa-flash", "course", "course-fused"]
    assert ba.refusals([], impls) == ([], {})
    blocking, refused = ba.refusals(fused, impls)
    assert blocking == [] and refused["course-fused"].startswith("not timed: disagrees with SDPA (2 failures")
    assert ba.refusals(fused + other, impls)[0] == other
    assert ba.refusals(fused, ["course"]) == ([], {})


def test_a_fused_backward_that_fails_to_run_refuses_course_fused_alone(monkeypatch):
    """check_case runs the fused backward apart: its error is a "fused ..." failure of the case, which
    refusals turns into course-fused's refusal alone, the forward and two-kernel backward still checked."""
    from helpers.tools import kernel_gpu

    real = ba.tf.flash_attention_triton_backward

    def no_fused(*args, deterministic=True, **kwargs):
        if not deterministic:
            raise RuntimeError("the fused kernel does not compile here")
        return real(*args, deterministic=deterministic, **kwargs)

    monkeypatch.setattr(ba.tf, "flash_attention_triton_backward", no_fused)
    before = ba.tf.USE_TMA
    name, _, failures = kernel_gpu.check_case(("fp32", 1, 2, 1, 17, 17, 16, True), False)
    assert failures == ["fused dq, dk, dv: RuntimeError: the fused kernel does not compile here"]
    assert ba.tf.USE_TMA is before, "check_case must give back the load path it forced"
    blocking, refused = ba.refusals([f"{name}: {f}" for f in failures], ["sdpa-flash", "course", "course-fused"])
    assert blocking == [] and list(refused) == ["course-fused"]


def test_the_autotuners_choices_compare_with_the_report_of_the_same_triton(tmp_path):
    from helpers.tools import kernel_gpu

    assert kernel_gpu.aot_report(ba.RESULTS_DIR, "3.6.0").name == "kernel_aot_triton36.json"  # the GPU's Triton
    for name, version in (("kernel_aot", "3.9.0"), ("kernel_aot_triton36", "3.6.0")):
        (tmp_path / f"{name}.json").write_text("[]")
        (tmp_path / f"{name}.meta.json").write_text(f'{{"triton": "{version}"}}')
    assert kernel_gpu.aot_report(tmp_path, "3.6.1").name == "kernel_aot_triton36.json"
    assert kernel_gpu.aot_report(tmp_path, "3.9.0").name == "kernel_aot.json"
    assert kernel_gpu.aot_report(tmp_path, "3.7.0").name == "kernel_aot.json"  # none of its own: the default


@pytest.mark.slow  # make test-all: two fresh interpreters import torch and Triton (several seconds)
def test_compile_workers_start_under_a_script_that_imported_triton(tmp_path):
    """On a GPU, kernel_gpu's pools run under bench_attention.py, a main script that imports Triton:
    each spawned worker re-imports it, then kernel_report's start-up refuses a Triton imported without
    TRITON_INTERPRET=0. Played on the CPU: kernels decorated for the GPU, the variable then unset, as
    on a GPU host."""
    script = tmp_path / "bench_like.py"
    script.write_text(textwrap.dedent(f"""
        import os
        import sys

        os.environ["TRITON_INTERPRET"] = "0"  # decorated for the GPU, as on a GPU host
        sys.path.insert(0, {str(ROOT / "bench")!r})
        import bench_attention  # noqa: F401, E402  (the benchmark's main script imports Triton)
        from helpers.tools import kernel_gpu  # noqa: E402

        if __name__ == "__main__":
            del os.environ["TRITON_INTERPRET"]  # a GPU host sets none
            with kernel_gpu._gpu_pool(1) as pool:
                print(list(pool.map(abs, [-3])))
        """))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0 and "[3]" in run.stdout, run.stderr[-3000:]


class Clock:
    """A stand-in for the time module: perf_counter() reads ``now``, which the test moves."""

    def __init__(self):
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now


def test_a_pass_stops_at_the_time_limit_and_a_cell_that_raises_is_a_row(monkeypatch, tmp_path, capsys):
    """run_prefill's passes against a made-up clock (each cell 10 s): the first pass stops before the
    first cell that would start past the deadline, the cells never reached say so, a cell whose
    measurement raised (a CUDA error outside measure's own handling) is an error row, and the
    reports are written."""
    from helpers.tools import kernel_gpu

    clock = Clock()
    monkeypatch.setattr(ba, "time", clock)
    monkeypatch.setattr(kernel_gpu, "check_kernels", lambda paths: [])
    monkeypatch.setattr(bd, "gpu_state", lambda: {})
    monkeypatch.setattr(ba, "warm_up", lambda *args: None)
    monkeypatch.setattr(ba, "plot", lambda *args: None)
    measured = []

    def measure(impl, mode, T, d, c, rep, first=True):
        measured.append((mode, d, c))
        clock.now += 10
        if (mode, d, c) == ("fwd", 64, True):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return dict(ba.new_row(impl, mode, T, d, c), ms=1.0, host_ms=0.1)

    monkeypatch.setattr(ba, "measure", measure)
    info = {k: v for k, v in INFO.items() if k != "states"}
    assert ba.run_prefill(["sdpa-flash"], (1024,), 1, 3, info, tmp_path, False, deadline=clock.now + 55) == 0
    assert len(measured) == 6  # cells start at 0, 10, ..., 50 s; the 7th would start at 60 s > 55 s
    assert "Stopping in pass 1: --time-limit reached" in capsys.readouterr().out
    rows = {(r["mode"], r["d"], r["causal"]): r for r in csv.DictReader((tmp_path / "fake-gpu.csv").open())}
    assert len(rows) == 8 and rows[("fwd", "64", "False")]["ms"] == "1"
    assert rows[("fwd", "64", "True")]["status"] == "error: CUDA error: an illegal memory access was encountered"
    not_reached = [k for k, r in rows.items() if r["status"] == "skipped: not reached before --time-limit"]
    assert not_reached == [("fwd", "128", "True"), ("fwd+bwd", "128", "True")]
    assert "skipped: not reached before --time-limit" in (tmp_path / "fake-gpu.md").read_text()


def test_the_time_limit_counts_from_before_the_slow_imports():
    """--time-limit counts from START, as the session's `timeout` counts from the process's start:
    START is taken before torch's and Triton's imports (seconds on a GPU host), not after them."""
    body = ast.parse((ROOT / "bench" / "bench_attention.py").read_text()).body
    start = next(n.lineno for n in body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "START")
    torch_import = next(n.lineno for n in body if isinstance(n, ast.Import) and n.names[0].name == "torch")
    assert start < torch_import


def test_make_bench_without_cuda_checks_the_kernels_in_the_interpreter(monkeypatch, capsys):
    if torch.cuda.is_available():
        pytest.skip("on a GPU `make bench` runs the full benchmark")
    assert ba.main([]) == 0
    out = capsys.readouterr().out
    assert "No CUDA GPU" in out and "Interpreter check passed." in out
    assert out.count("fused backward: forward+backward max |err|") == 2 and "FAIL" not in out
    with pytest.raises(SystemExit):
        ba.main(["--repeats", "0"])
    assert "--repeats must be at least 1" in capsys.readouterr().err


# ------------------------------------------------------------------------------------- the run-time model


def _session_args(name: str) -> list[str]:
    script = (ROOT / "bench" / "gpu_session.sh").read_text()
    return shlex.split(re.search(rf"{name}=\$\{{{name}:-(.+?)\}}\n", script).group(1))


def _estimate(capsys, argv: list[str]) -> str:
    assert ba.main(["--estimate", *argv]) == 0
    return capsys.readouterr().out.strip().split(": a model")[0]


def test_the_readme_states_what_the_model_estimates_for_the_session(capsys):
    readme = " ".join((ROOT / "bench" / "README.md").read_text().split())
    prefill = _estimate(capsys, ["--no-decode", *_session_args("PREFILL_ARGS")])
    decode = _estimate(capsys, ["--decode-only", *_session_args("DECODE_ARGS")])
    assert f"- prefill: `{prefill}`" in readme and f"- decode: `{decode}`" in readme
    old = _estimate(capsys, ["--seqs", "1024,2048,4096,8192", "--rep", "100", "--repeats", "1", "--no-decode",
                             "--impls", "naive,sdpa-flash,sdpa-cudnn,sdpa-efficient,sdpa-math,course,course-pointers"])
    assert f"the model gives those options, timed the new way, {old.split()[1]} s," in readme
    script = (ROOT / "bench" / "gpu_session.sh").read_text()
    limits = dict(re.findall(r"\b((?:ENV|AOT|PREFILL|DECODE|TEST)_S)=\$\{\1:-(\d+)\}", script))
    total = sum(int(x) for x in limits.values())
    assert len(limits) == 5 and total < 9 * 60 and f"= {total} s" in script
    assert f"their sum, {total} s (" + " + ".join(f"{k} {v}" for k, v in limits.items()) + ")" in readme


def test_the_models_pieces():
    assert ba.tuned_configs("course", "fwd", 512, 64, True) == 0  # below TUNE_FROM_T: one config, untimed
    assert ba.tuned_configs("course-fused", "fwd", 4096, 64, True) == 0  # course's forward, tuned already
    assert ba.tuned_configs("course", "fwd+bwd", 4096, 128, False) > ba.tuned_configs("course", "fwd", 4096, 128, False) > 0
    assert ba.tuned_configs("sdpa-flash", "fwd", 4096, 64, False) == 0
    rec = {("course", "fwd", 1024, 64, False): 0.1}
    assert ba.call_ms(rec, "course", "fwd", 4096, 64, False) == pytest.approx(1.6)  # T^2 from the nearest
    assert ba.call_ms(rec, "course-fused", "fwd", 1024, 64, False) == 0.1
    assert ba.cell_seconds(1.0, 20, True, True) > ba.cell_seconds(1.0, 20, False, False) > ba.cell_seconds(0.1, 20, False, False)
