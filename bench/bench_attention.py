"""Attention benchmarks: naive PyTorch, each SDPA backend, and the course's Triton kernel (`make bench`).

On a CUDA GPU: forward and forward+backward, fp16, B=4, H=32, T in {1k..16k}, d in {64, 128},
causal and not. Every implementation runs once untimed first (a warm-up); then every cell is timed
in ``--repeats`` passes over the whole grid (default 3), so that drift and heat spread over all
cells, and reported as the median of the passes with their spread, (max - min) / median. Per cell:
``ms`` (``triton.testing.do_bench``), ``ms_graph`` (replayed from a CUDA graph,
``do_bench_cudagraph``; forward+backward too where it can be captured, else ``graph_status`` says
why), ``host_ms`` (the host's time to issue one call), and once: the peak extra memory of one call,
which backend SDPA's default path takes (``sdpa_default``, SDPA rows), and for T <= 2048 the GPU
time of one call's kernels and their number (``gpu_ms``, ``launches``: torch.profiler). TFLOPS
count forward FLOPs = 4*B*H*T^2*d (half when causal); backward = 2.5x forward, so forward+backward
= 3.5x. Writes ``<out>/<gpu>.csv`` (after every cell), ``.md`` (after every pass: tables, the GPU's
clocks before and after, and a summary that checks the course's goals) and ``.png``. On Hopper
(sm_90) the course kernel is timed as "course" (K/V through TMA tensor descriptors, the default
there) and "course-pointers" (pointer grids, as on older GPUs); "course-fused" is its fused
backward (``deterministic=False``: dQ by atomic adds), forward+backward rows only.

Before timing, the course kernel is checked against SDPA over many cases, both load paths, with its
outputs poisoned (helpers/tools/kernel_gpu.py), and so is the fused backward; a wrong kernel is not
timed. Every configuration the autotuner will try is compiled first, in parallel processes. After
timing, the autotuner's choices, with the registers and spills of each on this GPU and in the
ahead-of-time report (kernel_aot.json), go to ``<out>/<gpu>-kernels.md`` and ``.json``.

Then the decode rows (bench/bench_decode.py): one decode step of the course's split-KV kernel
over a paged cache (helpers/nb12_triton_decode.py) against SDPA on a contiguous cache, in µs and
GB/s, into ``<out>/<gpu>-decode.csv`` and ``.md``; ``--decode-only`` runs those alone,
``--no-decode`` skips them.

Without CUDA: prints that there is nothing to time, runs a few-second correctness check of the
kernels (FlashAttention, its fused backward and the decode kernel) in Triton's interpreter, and
exits 0. ``--estimate`` prints how long a run with the given options should take (a model; no GPU
needed) and exits.

    python bench/bench_attention.py [--quick] [--out DIR] [--seqs 1024,4096] [--impls course,sdpa-flash]
        [--rep MS] [--repeats N] [--estimate] [--decode-only | --no-decode] [--decode-batches 1,8]
        [--decode-ctx 1024] [--decode-impls course,sdpa-default]
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import gc
import json
import math
import os
import re
import sys
import time
import warnings
from pathlib import Path

START = time.perf_counter()  # --time-limit counts from here: before torch's and Triton's imports, which take seconds

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `helpers` when run as a script
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_decode, beside this file

import bench_decode  # noqa: E402  (the decode rows, and the pieces both benchmarks share)
from bench_decode import aggregate as _aggregate  # noqa: E402
from bench_decode import command_output, flag, graph_rep, summarize  # noqa: E402, F401

from helpers.nb03_masks import causal_mask  # noqa: E402
from helpers.package_data import RESULTS_DIR  # noqa: E402

try:
    from helpers import nb09_triton_flash as tf  # noqa: E402  (turns on the interpreter without CUDA)
except ImportError as exc:  # no Triton on this platform
    tf, TRITON_MISSING = None, str(exc)

GiB = 2**30
BATCH, HEADS = 4, 32
FULL_T = (1024, 2048, 4096, 8192, 16384)
QUICK_T = (1024, 4096, 8192)
HEAD_DIMS = (64, 128)
MODES = ("fwd", "fwd+bwd")
# name -> SDPA backend attribute (None: not SDPA). Order = column order in the tables.
IMPLS = {
    "naive": None,
    "sdpa-flash": "FLASH_ATTENTION",
    "sdpa-cudnn": "CUDNN_ATTENTION",
    "sdpa-efficient": "EFFICIENT_ATTENTION",
    "sdpa-math": "MATH",
    "course": None,
    "course-pointers": None,  # sm_90 only: the course kernel with TMA off
    "course-fused": None,  # the fused backward (deterministic=False); its forward is course's
}
COURSE_IMPLS = ("course", "course-pointers", "course-fused")
FWD_OF = {"course-fused": "course"}  # an impl whose forward is another's kernel: its fwd rows are not timed
# Rough peak extra bytes of the T x T implementations, in units of one fp16 [B, H, T, T] tensor
# (naive: scores, masked scores, probabilities; backward adds their gradients; the math backend
# works in fp32). Used to skip runs that cannot fit instead of thrashing the allocator.
TXT_TENSORS = {("naive", "fwd"): 3, ("naive", "fwd+bwd"): 6, ("sdpa-math", "fwd"): 6, ("sdpa-math", "fwd+bwd"): 12}
KEY = ("impl", "mode", "T", "d", "causal")
TIMED = ("ms", "ms_graph", "host_ms")  # measured in every pass; the rest in the first only
SHORT_T = 2048  # T <= SHORT_T: the profiler's columns (gpu_ms, launches)
HOST_CALLS = 10  # calls issued back to back for host_ms
PROFILE_CALLS = 3  # calls profiled for gpu_ms and launches
# The goals (goal_checks)
FWD_VS_CUDNN = {128: 1.0, 64: 0.9}  # d -> forward speed / sdpa-cudnn's, T >= GOAL_LONG_T
BWD_VS_CUDNN, BWD_TFLOPS = 0.9, 470.0  # backward at d = 128, T >= GOAL_LONG_T
GOAL_LONG_T, GOAL_SHORT_T = 4096, 1024
SPREAD = bench_decode.SPREAD_FLAG  # %: the spread a goal at T = GOAL_SHORT_T allows, and the tables flag
FIELDS = ["gpu", "driver", "torch", "triton", "cuda", "cudnn", "commit", "clocks_before", "clocks_after",
          "impl", "mode", "T", "d", "causal", "ms", "ms_min", "ms_max", "ms_spread", "runs", "ms_runs", "tflops",
          "ms_graph", "ms_graph_spread", "graph_status", "host_ms", "host_ms_spread", "gpu_ms", "launches",
          "peak_extra_gib", "sdpa_default", "status"]


# --------------------------------------------------------------------------------------------
# Implementations
# --------------------------------------------------------------------------------------------


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v with the full ``[B, H, T, T]`` scores: q, k, v ``[B, H, T, d]``."""
    s = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        s = s.masked_fill(~causal_mask(q.shape[-2], device=q.device), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def attention_fn(impl: str, causal: bool):
    """A callable (q, k, v) -> out ``[B, H, T, d]`` for implementation ``impl``."""
    if impl == "naive":
        return lambda q, k, v: naive_attention(q, k, v, causal)
    if impl == "course-fused":
        return lambda q, k, v: tf.flash_attention_triton(q, k, v, causal=causal, deterministic=False)
    if impl.startswith("course"):
        return lambda q, k, v: tf.flash_attention_triton(q, k, v, causal=causal)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, IMPLS[impl])

    def run(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


@contextlib.contextmanager
def load_path(impl: str):
    """While timing "course-pointers", the course kernel loads K/V through pointer grids."""
    saved = tf.USE_TMA
    tf.USE_TMA = False if impl == "course-pointers" else saved
    try:
        yield
    finally:
        tf.USE_TMA = saved


def model_flops(T: int, d: int, causal: bool, mode: str) -> float:
    """4*B*H*T^2*d for the forward (half if causal); fwd+bwd = 3.5x the forward, "bwd" 2.5x."""
    fwd = 4 * BATCH * HEADS * T * T * d / (2 if causal else 1)
    return fwd * {"fwd": 1.0, "fwd+bwd": 3.5, "bwd": 2.5}[mode]


def interpreter_check() -> bool:
    """A few-second CPU check of the kernels in Triton's interpreter against SDPA, both backward
    passes (two kernels; fused); True if all agree."""
    ok = True
    for T, d, H_kv, causal, dtype, tol, deterministic in (
            (37, 32, 2, True, torch.float32, 1e-4, True), (70, 64, 1, False, torch.float16, 1e-2, True),
            (37, 32, 2, True, torch.float32, 1e-4, False), (70, 64, 1, False, torch.float16, 1e-2, False)):
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, 2, T, d, generator=g).to(dtype).requires_grad_()
        k, v = (torch.randn(1, H_kv, T, d, generator=g).to(dtype).requires_grad_() for _ in range(2))
        out = tf.flash_attention_triton(q, k, v, causal=causal, deterministic=deterministic)
        grad_out = torch.randn_like(out)
        out.backward(grad_out)
        q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
        ref = F.scaled_dot_product_attention(q32, k32, v32, is_causal=causal, enable_gqa=True)
        ref.backward(grad_out.float())
        err = max((a.float() - b).abs().max().item()
                  for a, b in ((out, ref), (q.grad, q32.grad), (k.grad, k32.grad), (v.grad, v32.grad)))
        good = err <= tol
        ok &= good
        print(f"  T={T} d={d} H=2 H_kv={H_kv} causal={causal} {str(dtype)[6:]}, "
              f"{'two-kernel' if deterministic else 'fused'} backward: forward+backward max |err| "
              f"{err:.1e} (tol {tol:.0e}) {'OK' if good else 'FAIL'}")
    return ok


# --------------------------------------------------------------------------------------------
# Measuring: the arithmetic (testable on a CPU), then the CUDA glue
# --------------------------------------------------------------------------------------------


def new_row(impl: str, mode: str, T: int, d: int, causal: bool, status: str = "ok") -> dict:
    """One pass's row of one cell, nothing measured yet."""
    return {"impl": impl, "mode": mode, "T": T, "d": d, "causal": causal, "ms": None, "ms_graph": None,
            "graph_status": None, "host_ms": None, "gpu_ms": None, "launches": None, "peak_extra_gib": None,
            "sdpa_default": None, "status": status}


def aggregate(runs: list[dict]) -> list[dict]:
    """Rows of every pass -> one row per cell: ``ms`` the median of the passes (with ``ms_min``,
    ``ms_max``, ``ms_spread`` in %, ``runs`` and ``ms_runs``), ``ms_graph`` and ``host_ms`` their
    medians (with spreads), ``tflops`` from the median ``ms``; the rest from the first pass."""
    rows = _aggregate(runs, KEY, TIMED)
    for r in rows:
        r["tflops"] = model_flops(r["T"], r["d"], r["causal"], r["mode"]) / (r["ms"] * 1e-3) / 1e12 if r["ms"] else None
    return rows


def profile_summary(events, calls: int) -> tuple[float | None, float | None]:
    """(GPU ms per call, launches per call) from a profile of ``calls`` calls: ``events`` are
    (name, on_gpu, microseconds); every GPU activity (kernels, memsets, copies) counts. (None,
    None) where the profiler saw no GPU activity at all (no CUPTI): not a call of 0 ms."""
    gpu = [us for _, on_gpu, us in events if on_gpu]
    if not gpu:
        return None, None
    return sum(gpu) / 1e3 / calls, round(len(gpu) / calls, 2)


def bound(row: dict) -> str:
    """'host' where issuing a call takes the host at least as long as the GPU takes to run its
    kernels (``host_ms >= gpu_ms``: back to back, the GPU waits for launches), 'GPU' where the
    kernels take longer, '' where either was not measured."""
    if row.get("host_ms") is None or row.get("gpu_ms") is None:
        return ""
    return "host" if row["host_ms"] >= row["gpu_ms"] else "GPU"


def _free_cuda() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _reason(exc: BaseException, caught: list) -> str:
    """A one-line reason from an exception and the warnings SDPA emitted while refusing (160 characters)."""
    return bench_decode.refusal(exc, caught, limit=160)


def host_ms(step, reset, n: int = HOST_CALLS) -> float:
    """The host's ms per call: ``n`` calls issued back to back (``reset`` before each), timed by
    the host's clock before the GPU is waited for."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        reset()
        step()
    seconds = time.perf_counter() - start
    torch.cuda.synchronize()
    return seconds * 1e3 / n


def profile_calls(step, reset, n: int = PROFILE_CALLS) -> tuple[float, float]:
    """(GPU ms, launches) per call over ``n`` profiled calls (torch.profiler; profile_summary)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            reset()
            step()
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA  # kernels, memsets, copies; not record_function ranges drawn on the GPU
    events = [(e.name, e.device_type == cuda and not getattr(e, "is_user_annotation", False), e.time_range.elapsed_us())
              for e in prof.events()]
    return profile_summary(events, n)


def graph_ms(step, grad_to_none, rep: int) -> tuple[float | None, str]:
    """(ms per call replayed from a CUDA graph, "ok"), or (None, why it could not be captured)."""
    import triton.testing

    try:
        ms = triton.testing.do_bench_cudagraph(step, rep=graph_rep(rep), grad_to_none=grad_to_none,
                                               return_mode="median")
        return ms, "ok"
    except Exception as exc:  # noqa: BLE001 - whatever the capture refused
        with contextlib.suppress(Exception):
            torch.cuda.synchronize()
        return None, "not captured: " + _reason(exc, [])


def _skip(impl: str, mode: str, T: int) -> str | None:
    """Why a cell is not run at all (its forward is another impl's; its T x T tensors would not fit), or None."""
    if mode == "fwd" and impl in FWD_OF:
        return f"skipped: the same forward kernel as {FWD_OF[impl]} (timed in its rows)"
    need = TXT_TENSORS.get((impl, mode), 0) * BATCH * HEADS * T * T * 2
    free = torch.cuda.mem_get_info()[0] if need else 0
    return f"skipped: needs ~{need / GiB:.0f} GiB of T x T tensors, {free / GiB:.0f} GiB free" if need > 0.9 * free else None


def _once(row: dict, step, reset, qkv: list, backward: bool) -> None:
    """The first pass's measurements of a cell, into ``row``: SDPA's default backend (SDPA rows),
    the profiler's columns (T <= SHORT_T) and the peak extra memory of one call."""
    if IMPLS[row["impl"]]:
        with torch.set_grad_enabled(backward):
            row["sdpa_default"] = bench_decode.sdpa_choice(*qkv, enable_gqa=False, is_causal=row["causal"])
    if row["T"] <= SHORT_T:
        try:
            row["gpu_ms"], row["launches"] = profile_calls(step, reset)
            if row["gpu_ms"] is None:
                print(f"  profiler, {row['impl']} {row['mode']} T={row['T']}: no GPU activity seen", flush=True)
        except Exception as exc:  # noqa: BLE001 - the profiler's columns stay empty
            print(f"  profiler, {row['impl']} {row['mode']} T={row['T']}: {type(exc).__name__}: {exc}", flush=True)
    reset()
    _free_cuda()
    base = torch.cuda.memory_allocated()  # the inputs (and grad_out)
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    row["peak_extra_gib"] = (torch.cuda.max_memory_allocated() - base) / GiB


def measure(impl: str, mode: str, T: int, d: int, causal: bool, rep: int, first: bool = True) -> dict:
    """One pass over one (implementation, mode, shape): ``ms`` (triton.testing.do_bench, median),
    ``host_ms`` and ``ms_graph``; with ``first``, also what :func:`_once` measures. Returns
    new_row's dict; status "ok" or why not."""
    import triton.testing

    row = new_row(impl, mode, T, d, causal, _skip(impl, mode, T) or "ok")
    if row["status"] != "ok":
        return row
    _free_cuda()
    fn = attention_fn(impl, causal)
    g = torch.Generator(device="cuda").manual_seed(0)
    backward = mode == "fwd+bwd"
    qkv = [torch.randn(BATCH, HEADS, T, d, device="cuda", dtype=torch.float16, generator=g).requires_grad_(backward)
           for _ in range(3)]
    grad_out = [torch.randn(BATCH, HEADS, T, d, device="cuda", dtype=torch.float16, generator=g)]

    def step():
        if backward:
            fn(*qkv).backward(grad_out[0])
        else:
            with torch.no_grad():
                fn(*qkv)

    def reset():
        for t in qkv:
            t.grad = None

    with load_path(impl):
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    step()  # first call: compiles / autotunes, or tells us the backend cannot run
                except torch.cuda.OutOfMemoryError:
                    raise
                except Exception as exc:  # an SDPA backend that refuses this shape/GPU, or a kernel error
                    row["status"] = ("unsupported: " if IMPLS[impl] else "error: ") + _reason(exc, caught)
                    return row
            row["ms"] = triton.testing.do_bench(step, warmup=max(5, rep // 4), rep=rep, grad_to_none=qkv,
                                                return_mode="median")
            row["host_ms"] = host_ms(step, reset)
            if first:
                _once(row, step, reset, qkv, backward)
            reset()
            row["ms_graph"], row["graph_status"] = graph_ms(step, qkv if backward else None, rep)
        except torch.cuda.OutOfMemoryError:
            row.update(ms=None, ms_graph=None, host_ms=None, status="OOM")
        except Exception as exc:  # noqa: BLE001 - one cell's failure is its row's, not the run's
            row.update(ms=None, ms_graph=None, host_ms=None, status="error: " + _reason(exc, []))
        finally:
            qkv.clear()  # the inputs' memory is freed
            grad_out.clear()
            _free_cuda()
    return row


def warm_up(impls, T: int, rep: int) -> None:
    """One untimed pass of each implementation, both modes (first head dim, not causal, length T):
    lazy module loads, library handles, the profiler's start, graph capture and the GPU's clocks
    stay out of the first timed cell."""
    for impl in impls:
        for mode in MODES:
            measure(impl, mode, T, HEAD_DIMS[0], False, max(1, rep // 4), first=True)


def machine(commit: str | None = None) -> dict:
    """The GPU, its driver, torch, Triton, CUDA and cuDNN versions, the GPU's multiprocessors and
    L2 cache, and the course's commit (from ``commit``, $COURSE_COMMIT or git: a copy of the tree
    without .git names it from outside)."""
    import triton

    driver = command_output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]).splitlines()
    commit = commit or os.environ.get("COURSE_COMMIT") or command_output(["git", "rev-parse", "--short", "HEAD"])
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {"gpu": torch.cuda.get_device_name(), "driver": driver[0] if driver else "unknown",
            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
            "cudnn": str(torch.backends.cudnn.version()), "commit": commit or "unknown",
            "sms": props.multi_processor_count, "l2_mib": round(getattr(props, "L2_cache_size", 0) / 2**20)}


def slug(name: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def write_csv(rows: list[dict], info: dict, path: Path) -> None:
    """One line per row (FIELDS), the machine's fields from ``info``; floats to 4 digits."""
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({**info, **{k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in r.items()}})


def _lookup(rows: list[dict]) -> dict:
    return {(r["impl"], r["mode"], r["T"], r["d"], r["causal"]): r for r in rows}


def _cell(r: dict | None, key: str, fmt: str, spread: str | None = None) -> str:
    """A table's cell: ``r[key]`` formatted, its spread flagged; else why there is no number."""
    if r is None:
        return ""
    if r.get(key) is not None:
        return format(r[key], fmt) + (flag(r.get(spread)) if spread else "")
    status = r["status"]
    if status == "OOM":
        return "OOM"
    return "skip" if status.startswith("skipped") else ("n/c" if status == "not captured" else "n/a")


def _ms(t: dict, impl: str, mode: str, T: int, d: int, causal: bool) -> float | None:
    return (t.get((impl, mode, T, d, causal)) or {}).get("ms")


def backward_ms(t: dict, impl: str, T: int, d: int, causal: bool) -> float | None:
    """Backward time = (forward+backward) - forward (the forward of FWD_OF's impl where it has none)."""
    fb, f = _ms(t, impl, "fwd+bwd", T, d, causal), _ms(t, FWD_OF.get(impl, impl), "fwd", T, d, causal)
    return fb - f if fb is not None and f is not None else None


def best_course(time_of) -> tuple[float, str] | None:
    """(the lowest time, its impl) over the course's impls that have one, else None."""
    times = [(x, i) for i in COURSE_IMPLS if (x := time_of(i)) is not None]
    return min(times) if times else None


def goal_checks(rows: list[dict]) -> list[str]:
    """The course's goals, each a line 'PASS/FAIL/n/a: what: which course impl, numbers (goal)',
    each comparing the best course impl of the cell with SDPA in the same run; then one line
    counting them and naming the failures."""
    t = _lookup(rows)
    seqs = sorted({r["T"] for r in rows})
    lines: list[str] = []

    def check(what: str, ok: bool | None, detail: str = "not measured") -> None:
        lines.append(f"- {'n/a' if ok is None else ('PASS' if ok else 'FAIL')}: {what}: {detail}")

    long_goals(t, [T for T in seqs if T >= GOAL_LONG_T], check)
    short_goals(t, check)
    memory_goals(t, seqs, check)
    verdicts = [line.split(":")[0][2:] for line in lines]
    failed = [line.split(": ")[1] for line in lines if line.startswith("- FAIL")]
    lines.append(f"\n{verdicts.count('PASS')} of {len(verdicts)} goals pass, {verdicts.count('FAIL')} fail, "
                 f"{verdicts.count('n/a')} not measured." + (" Failed: " + "; ".join(failed) + "." if failed else ""))
    return lines


def long_goals(t: dict, long: list[int], check) -> None:
    """At every T >= GOAL_LONG_T: the forward against sdpa-cudnn (FWD_VS_CUDNN by head dim); the
    backward at d = 128 at >= BWD_TFLOPS and >= BWD_VS_CUDNN x sdpa-cudnn's."""
    fwd = lambda i, T, d, c: _ms(t, i, "fwd", T, d, c)  # noqa: E731
    bwd = lambda i, T, d, c: backward_ms(t, i, T, d, c)  # noqa: E731

    def versus(what, time_of, goal, T, d, c) -> None:
        best, ref = best_course(lambda i: time_of(i, T, d, c)), time_of("sdpa-cudnn", T, d, c)
        if best is None or ref is None:
            return check(what, None)
        check(what, ref / best[0] >= goal, f"{best[1]} at {ref / best[0]:.2f}x sdpa-cudnn's speed (goal >= {goal}x)")

    if not long:
        for what in [f"forward vs sdpa-cudnn, d={d}, T >= {GOAL_LONG_T}" for d in FWD_VS_CUDNN] + \
                [f"backward at d=128, T >= {GOAL_LONG_T}"]:
            check(what, None, f"no T >= {GOAL_LONG_T} measured")
    for d, goal in FWD_VS_CUDNN.items():
        for T in long:
            for c in (False, True):
                versus(f"forward vs sdpa-cudnn, d={d} T={T} causal={c}", fwd, goal, T, d, c)
    for T in long:
        for c in (False, True):
            best = best_course(lambda i: bwd(i, T, 128, c))
            tflops = best and model_flops(T, 128, c, "bwd") / (best[0] * 1e-3) / 1e12
            check(f"backward TFLOPS, d=128 T={T} causal={c}", best and tflops >= BWD_TFLOPS,
                  f"{best[1]} at {tflops:.0f} TFLOPS (goal >= {BWD_TFLOPS:.0f})" if best else "not measured")
            versus(f"backward vs sdpa-cudnn, d=128 T={T} causal={c}", bwd, BWD_VS_CUDNN, T, 128, c)


def short_goals(t: dict, check) -> None:
    """At T = GOAL_SHORT_T, in every (d, causal) cell: forward+backward at least sdpa-flash's speed,
    the spreads of both rows at most SPREAD (n/a with one pass: no spread)."""
    for d in HEAD_DIMS:
        for c in (False, True):
            what = f"forward+backward vs sdpa-flash, T={GOAL_SHORT_T} d={d} causal={c}, spreads <= {SPREAD:.0f}%"
            best = best_course(lambda i: _ms(t, i, "fwd+bwd", GOAL_SHORT_T, d, c))
            ref = t.get(("sdpa-flash", "fwd+bwd", GOAL_SHORT_T, d, c))
            if best is None or ref is None or ref.get("ms") is None:
                check(what, None)
                continue
            ratio, ours = ref["ms"] / best[0], t[(best[1], "fwd+bwd", GOAL_SHORT_T, d, c)]
            spreads = (ours.get("ms_spread"), ref.get("ms_spread"))
            detail = f"{best[1]} at {ratio:.2f}x sdpa-flash's speed, spreads " + " and ".join(
                f"{'one run' if s is None else f'{s:.0f}%'} ({i})" for s, i in zip(spreads, (best[1], "sdpa-flash"))
            ) + " (goal >= 1.0x)"
            check(what, None if None in spreads else ratio >= 1.0 and max(spreads) <= SPREAD, detail)


def memory_goals(t: dict, seqs: list[int], check) -> None:
    """The older goals that still say something: between the two longest lengths measured, the
    course's causal forward peak extra memory grows at most 1.1x as fast as T (linear), naive's
    at least 0.875x as fast as T^2 (its T x T tensors are really there)."""
    if len(seqs) < 2:
        return check("peak extra memory growth", None, "fewer than two lengths measured")
    a, b = seqs[-2], seqs[-1]
    for impl, power, factor, higher in (("course", 1, 1.1, False), ("naive", 2, 0.875, True)):
        goal = factor * (b / a) ** power
        for d in HEAD_DIMS:
            x, y = ((t.get((impl, "fwd", T, d, True)) or {}).get("peak_extra_gib") for T in (a, b))
            what = f"{impl} forward peak extra memory growth T={a} -> {b}, d={d} causal"
            if not x or not y:
                check(what, None)
            else:
                check(what, y / x >= goal if higher else y / x <= goal,
                      f"{y / x:.2f}x (goal {'>=' if higher else '<='} {goal:.2f}x)")



def _states_table(info: dict) -> list[str]:
    """The GPU's clocks, power and temperature at each moment ``info["states"]`` recorded."""
    states = info.get("states") or []
    if not states:
        return []
    cols = [("clocks.sm", "SM MHz"), ("clocks.max.sm", "max SM MHz"), ("clocks.mem", "memory MHz"),
            ("power.draw", "power W"), ("power.limit", "power limit W"), ("temperature.gpu", "temperature C"),
            ("pstate", "state"), ("clocks_event_reasons.active", "clock event reasons"), ("torch.clock_rate", "torch: SM MHz")]
    shown = lambda v: "" if v is None else (f"{v:.0f}" if isinstance(v, float) else str(v))  # noqa: E731
    return (["GPU clocks, power and temperature (nvidia-smi; the last column torch.cuda.clock_rate):", "",
             "| when | " + " | ".join(c for _, c in cols) + " |", "|---|" + "---|" * len(cols)]
            + [f"| {when} | " + " | ".join(shown(s.get(k)) for k, _ in cols) + " |" for when, s in states] + [""])


def _sdpa_defaults(rows: list[dict]) -> list[str]:
    """Which backend SDPA's default path takes, cell by cell (the CSV's ``sdpa_default``)."""
    cells = {(r["mode"], r["causal"], r["d"], r["T"]): r["sdpa_default"] for r in rows if r.get("sdpa_default")}
    picks: dict[str, list[str]] = {}
    for (mode, c, d, T), name in sorted(cells.items()):
        picks.setdefault(name, []).append(f"{mode} d={d} T={T}{' causal' if c else ''}")
    intro = "SDPA's default path (`torch._fused_sdp_choice`; each SDPA row's `sdpa_default` in the CSV)"
    if len(picks) == 1:
        return [f"{intro}: `{next(iter(picks))}` in every cell.", ""]
    return [f"{intro}:", ""] + [f"- `{name}`: {', '.join(where)}" for name, where in picks.items()] + [""] if picks else []


def _table(t: dict, impls: list[str], seqs, mode: str, key: str, fmt: str, spread: str | None) -> list[str]:
    out = ["| causal | d | T | " + " | ".join(impls) + " |", "|---|---|---|" + "---|" * len(impls)]
    for c in (False, True):
        for d in HEAD_DIMS:
            for T in seqs:
                cells = [_cell(t.get((i, mode, T, d, c)), key, fmt, spread) for i in impls]
                out.append(f"| {c} | {d} | {T} | " + " | ".join(cells) + " |")
    return out + [""]


def _short_section(rows: list[dict]) -> list[str]:
    """Per short cell (T <= SHORT_T): ms, the kernels' GPU time, launches, the host's time, and which bounds it."""
    short = [r for r in rows if r.get("gpu_ms") is not None and r["T"] <= SHORT_T]
    if not short:
        return []
    out = [f"## Short sequences (T <= {SHORT_T}): GPU time or launches?", "",
           f"`gpu_ms`: the GPU time of one call's kernels (their durations summed, torch.profiler over "
           f"{PROFILE_CALLS} calls); `launches`: GPU activities (kernels, memsets, copies) per call; `host_ms`: the host's "
           f"time to issue one call ({HOST_CALLS} calls issued back to back, before waiting for the GPU; median of "
           "the passes); `ms`: the timed median. `bound`: `host` where issuing a call takes at least as long as "
           "its kernels run (`host_ms >= gpu_ms`: back to back, the GPU waits for the launches), `GPU` where "
           "the kernels take longer.", "",
           "| mode | causal | d | T | impl | ms | gpu_ms | launches | host_ms | bound |", "|---|---|---|---|---|---|---|---|---|---|"]
    order = {i: n for n, i in enumerate(IMPLS)}
    for r in sorted(short, key=lambda r: (r["mode"], r["causal"], r["d"], r["T"], order.get(r["impl"], 99))):
        out.append(f"| {r['mode']} | {r['causal']} | {r['d']} | {r['T']} | {r['impl']} | "
                   f"{_cell(r, 'ms', '.3f', 'ms_spread')} | {r['gpu_ms']:.3f} | {r['launches']:g} | "
                   f"{_cell(r, 'host_ms', '.3f')} | {bound(r)} |")
    return out + [""]


def write_markdown(rows: list[dict], info: dict, seqs: tuple, path: Path) -> None:
    t = _lookup(rows)
    impls = [i for i in IMPLS if any(r["impl"] == i for r in rows)]
    runs = max((r.get("runs") or 0 for r in rows), default=0)
    gpu = f", {info['sms']} SMs, {info['l2_mib']} MiB of L2" if info.get("sms") else ""
    out = [f"# Attention benchmark: {info['gpu']}", "",
           f"torch {info['torch']} (CUDA {info['cuda']}, cuDNN {info.get('cudnn', '?')}), triton {info['triton']}, "
           f"driver {info.get('driver', '?')}{gpu}, commit {info.get('commit', '?')}, {datetime.date.today().isoformat()}. "
           f"B={BATCH}, H={HEADS}, fp16, `[B, H, T, d]` inputs. TFLOPS use 4·B·H·T²·d forward FLOPs (half when "
           "causal), backward 2.5x forward. Peak extra memory: `torch.cuda.max_memory_allocated()` during one call "
           "minus what was allocated before it (the inputs). Generated by `bench/bench_attention.py`.", "",
           f"Every number is the median of {runs} pass{'es' if runs != 1 else ''} over the whole grid "
           f"(`--repeats`; each pass's time is a median of `triton.testing.do_bench`, {info.get('rep', '?')} ms of "
           "runs), after one untimed pass of every implementation; "
           f"[n%] after a number: its passes spread more than {SPREAD:.0f}% ((max - min) / median; every "
           "cell's spread is in the CSV).", ""]
    out += _states_table(info) + _sdpa_defaults(rows)
    for title, mode in (("Forward, TFLOPS", "fwd"), ("Forward + backward, TFLOPS", "fwd+bwd")):
        out += [f"## {title}", ""] + _table(t, impls, seqs, mode, "tflops", ".0f", "ms_spread")
    if any(r.get("ms_graph") for r in rows):
        graphed = [dict(r, tflops=model_flops(r["T"], r["d"], r["causal"], r["mode"]) / (r["ms_graph"] * 1e-3) / 1e12,
                        ) if r.get("ms_graph") else dict(r, tflops=None, status="not captured" if r["status"] == "ok"
                                                         else r["status"]) for r in rows]
        g = _lookup(graphed)
        for title, mode in (("Forward, replayed from a CUDA graph, TFLOPS", "fwd"),
                            ("Forward + backward, replayed from a CUDA graph, TFLOPS", "fwd+bwd")):
            out += [f"## {title}", "", "`triton.testing.do_bench_cudagraph` (no launch gaps; L2 not cleared between "
                    "calls); n/c: not captured (why: below)."] + [""] + _table(g, impls, seqs, mode, "tflops", ".0f",
                                                                               "ms_graph_spread")
    out += _short_section(rows)
    for title, mode in (("Forward, peak extra memory (GiB)", "fwd"), ("Forward + backward, peak extra memory (GiB)", "fwd+bwd")):
        out += [f"## {title}", ""] + _table(t, impls, seqs, mode, "peak_extra_gib", ".3g", None)
    notes = sorted({f"{r['impl']} ({r['mode']}, T={r['T']}): {r['status']}" for r in rows if r["status"] != "ok"})
    notes += sorted({f"{r['impl']} ({r['mode']}): CUDA graph {r['graph_status']}" for r in rows
                     if r.get("graph_status") not in (None, "ok")})
    if notes:
        out += ["Cells without a number (skip: would not fit in memory or not run; n/a: backend unsupported or "
                "not available; n/c: no CUDA graph; OOM):", ""]
        out += [f"- {n}" for n in notes] + [""]
    out += ["## Summary: the course's goals", "",
            "Each goal compares the best course implementation of its cell (course, course-pointers or "
            "course-fused; named) with SDPA's backend in the same run.", ""] + goal_checks(rows) + [""]
    path.write_text("\n".join(out))


def plot(rows: list[dict], info: dict, seqs: tuple, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = _lookup(rows)
    combos = [(d, c) for d in HEAD_DIMS for c in (False, True)]
    fig, axes = plt.subplots(3, len(combos), figsize=(4.2 * len(combos), 10), squeeze=False)
    panels = [("fwd", "tflops", "forward TFLOPS"), ("fwd+bwd", "tflops", "fwd+bwd TFLOPS"),
              ("fwd", "peak_extra_gib", "forward peak extra GiB")]
    for row_i, (mode, key, label) in enumerate(panels):
        for col, (d, c) in enumerate(combos):
            ax = axes[row_i][col]
            for impl in IMPLS:
                pts = [(T, t[(impl, mode, T, d, c)][key]) for T in seqs
                       if (impl, mode, T, d, c) in t and t[(impl, mode, T, d, c)][key] is not None]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=impl, linewidth=2.5 if impl in COURSE_IMPLS else 1.2)
            ax.set_xscale("log", base=2)
            if key == "peak_extra_gib":
                ax.set_yscale("log")
            ax.set_title(f"d={d}, {'causal' if c else 'full'}", fontsize=10)
            ax.set_xlabel("T")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"Attention on {info['gpu']} (B={BATCH}, H={HEADS}, fp16; torch {info['torch']}, "
                 f"triton {info['triton']}; medians of the passes)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# How long a run takes (--estimate): a model, no GPU needed
# --------------------------------------------------------------------------------------------

# Each cell's call time comes from the recorded run (helpers/results/<gpu>.csv); the rest are
# guesses, never measured on the GPU: each run prints its stages' times, to correct them.
COMPILE_S = 3.0  # one Triton compile on one of the GPU host's cores (the decode-only run, 75 s with its compiles)
TUNE_S = 0.15  # the autotuner's do_bench of one configuration: 25 ms warm-up, 100 ms of runs, its estimate
PROFILE_S = 0.3  # torch.profiler's start and stop around a few calls
CELL_S = 0.05  # per cell and pass: inputs, gc.collect, empty_cache
START_S = 30.0  # imports, CUDA's start, the spawned compile workers' imports
WORKERS = 15  # kernel_gpu's processes on the H200's 16 cores
DECODE_CELL_MS = 5 + 3 + 5  # a decode cell beyond its rep-long timings: do_bench's and the captures' own calls
FREE_GIB = 137  # free memory on the H200 (the recorded run's skip notes): naive and math cells beyond it are skipped


def cell_seconds(ms: float, rep: int, first: bool, short: bool) -> float:
    """One cell's seconds in one pass from its call's ``ms``: do_bench (first call, its 5-call
    estimate, warm-up, ``rep`` ms of runs), host_ms's calls, do_bench_cudagraph (6 calls, 10
    replays of graph_rep(rep) ms); the first pass adds the memory call and, ``short``, the profiler."""
    bench = 7 * ms + max(max(5, rep // 4), ms) + max(rep, ms)
    graph = 6 * ms + 10 * max(graph_rep(rep), ms)
    extra = (ms + (PROFILE_S * 1e3 + PROFILE_CALLS * ms if short else 0)) if first else 0
    return CELL_S + (bench + HOST_CALLS * ms + graph + extra) / 1e3


def recorded_times(path: Path) -> dict:
    """{(impl, mode, T, d, causal): ms} of a recorded run's CSV."""
    with path.open() as f:
        return {(r["impl"], r["mode"], int(r["T"]), int(r["d"]), r["causal"] == "True"): float(r["ms"])
                for r in csv.DictReader(f) if r["ms"]}


def call_ms(rec: dict, impl: str, mode: str, T: int, d: int, c: bool) -> float:
    """A cell's recorded ms; course-fused's is course's; a length not recorded scales as T^2 from
    the nearest recorded one; an impl not recorded takes course's."""
    impl = FWD_OF.get(impl, impl)
    if (impl, mode, T, d, c) in rec:
        return rec[(impl, mode, T, d, c)]
    known = [x for (i, m, x, dd, cc) in rec if (i, m, dd, cc) == (impl, mode, d, c)]
    if known:
        near = min(known, key=lambda x: abs(math.log(x / T)))
        return rec[(impl, mode, near, d, c)] * (T / near) ** 2
    return call_ms(rec, "course", mode, T, d, c) if impl != "course" else 1.0


def _valid(kind: str, d: int, c: bool, T: int, table: str) -> int:
    """How many configurations of kernel ``kind`` the autotuner keeps at length T (0 if unknown)."""
    try:
        return sum(tf.valid_config(kind, r[0], r[1], c, T, T) for r in tf.config_table(kind, d, table))
    except KeyError:  # a kernel this helpers.nb09_triton_flash does not have
        return 0


def tuned_configs(impl: str, mode: str, T: int, d: int, c: bool, target: str = "sm_90") -> int:
    """Configurations the autotuner times at this cell's first call (the forward is tuned in the
    fwd rows, course-fused's is course's; below TUNE_FROM_T one configuration, untimed)."""
    if impl not in COURSE_IMPLS or T < tf.TUNE_FROM_T or (mode == "fwd" and impl in FWD_OF):
        return 0
    table = tf.table_name(target, impl != "course-pointers")
    kinds = ("fwd",) if mode == "fwd" else (("bwd",) if impl == "course-fused" else ("dkdv", "dq"))
    return sum(_valid(k, d, c, T, table) for k in kinds)


def estimate(seqs, impls, rep: int, repeats: int, rec: dict) -> dict[str, float]:
    """Seconds of each stage of the prefill rows with these options (a model: the constants above)."""
    from helpers.tools import kernel_gpu

    cells = [(T, d, c, m, i) for T in seqs for d in HEAD_DIMS for c in (False, True) for m in MODES for i in impls
             if not (m == "fwd" and i in FWD_OF)
             and TXT_TENSORS.get((i, m), 0) * BATCH * HEADS * T * T * 2 <= 0.9 * FREE_GIB * GiB]
    T0 = min(seqs)
    paths = [i != "course-pointers" for i in impls if i in ("course", "course-pointers")]
    if "course-fused" in impls and "course" not in impls:
        paths.append(True)
    jobs = sum(_valid(k, d, c, T0, tf.table_name("sm_90", p)) for p in paths for d in HEAD_DIMS
               for c in (False, True) for k in kernel_gpu.KINDS)
    parts = {
        "start": START_S,
        "precompile": jobs * COMPILE_S / WORKERS,
        "checks": len(kernel_gpu.CASES) * 2 * 5 / WORKERS * COMPILE_S,  # 2 paths; 5 kernels: 4 and the preprocess
        "warm-up": sum(cell_seconds(call_ms(rec, i, m, T0, HEAD_DIMS[0], False), max(1, rep // 4), True, True)
                       for i in impls for m in MODES),
        "autotune": TUNE_S * sum(tuned_configs(i, m, T, d, c) for T, d, c, m, i in cells),
    }
    for n in range(1, repeats + 1):
        parts[f"pass {n}"] = sum(cell_seconds(call_ms(rec, i, m, T, d, c), rep, n == 1, T <= SHORT_T)
                                 for T, d, c, m, i in cells)
    return parts


def decode_seconds(cells: int, rep: int, repeats: int) -> float:
    """Seconds of the decode rows: their check's compiles, then per cell and pass do_bench, the
    eager runs (3 of rep ms), the two graph timings, and the profiler in the first pass."""
    per_cell = CELL_S + (DECODE_CELL_MS + 6 * rep) / 1e3
    return START_S / 2 + 10 * COMPILE_S + cells * (repeats * per_cell + PROFILE_S)


def estimate_text(parts: dict[str, float], basis: Path) -> str:
    """'Estimated 220 s (start 30, ...): a model, ...' for :func:`estimate`'s parts."""
    total = sum(parts.values())
    source = f"{basis.name}'s call times and " if set(parts) - {"decode"} else ""
    return (f"Estimated {total:.0f} s (" + ", ".join(f"{k} {v:.0f}" for k, v in parts.items()) + "): a model, "
            f"from {source}the constants of bench_attention.py's estimate section")


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"T in {QUICK_T} and shorter timing runs")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR,
                        help="directory for <gpu>.csv/.md/.png (default: helpers/results, package data)")
    parser.add_argument("--seqs", help="comma-separated sequence lengths (default: by --quick)")
    parser.add_argument("--impls", help=f"comma-separated subset of {','.join(IMPLS)}")
    parser.add_argument("--rep", type=int, help="milliseconds of timed runs per measurement (default: by --quick)")
    parser.add_argument("--repeats", type=int, default=bench_decode.REPEATS,
                        help="passes over the grid; each cell reports the median and spread of its passes")
    parser.add_argument("--commit", help="the course's commit, for the results (default: git)")
    parser.add_argument("--estimate", action="store_true", help="print how long this run should take, and exit")
    parser.add_argument("--time-limit", type=float,
                        help="seconds from the start: no pass (prefill or decode) begins that would end later")
    decode = parser.add_mutually_exclusive_group()
    decode.add_argument("--decode-only", action="store_true", help="only the decode-step rows")
    decode.add_argument("--no-decode", action="store_true", help="skip the decode-step rows")
    parser.add_argument("--decode-batches", help="comma-separated batch sizes of the decode rows")
    parser.add_argument("--decode-ctx", help="comma-separated context lengths of the decode rows")
    parser.add_argument("--decode-impls", help=f"comma-separated subset of {','.join(bench_decode.IMPLS)}")
    return parser


def _ints(text: str | None, default: tuple) -> tuple:
    return tuple(int(x) for x in text.split(",")) if text else default


def _decode_grid(args) -> tuple[tuple, tuple, tuple]:
    """(batches, contexts, impls) of the decode rows from the options."""
    return (_ints(args.decode_batches, bench_decode.BATCHES), _ints(args.decode_ctx, bench_decode.CONTEXTS),
            tuple(args.decode_impls.split(",")) if args.decode_impls else bench_decode.IMPLS)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1; got {args.repeats}")
    if tf is None:
        print(f"{TRITON_MISSING} No benchmark here.")
        return 0
    impls = [i for i in (args.impls.split(",") if args.impls else IMPLS)]
    unknown = set(impls) - set(IMPLS)
    if unknown:
        parser.error(f"unknown --impls {sorted(unknown)}; choose from {list(IMPLS)}")
    unknown = set(_decode_grid(args)[2]) - set(bench_decode.IMPLS)
    if unknown:
        parser.error(f"unknown --decode-impls {sorted(unknown)}; choose from {list(bench_decode.IMPLS)}")
    seqs = _ints(args.seqs, QUICK_T if args.quick else FULL_T)
    rep = args.rep or (30 if args.quick else 100)
    if args.estimate:
        basis = RESULTS_DIR / "nvidia-h200.csv"
        batches, contexts, decode_impls = _decode_grid(args)
        decode_cells = 0 if args.no_decode else len(batches) * len(contexts) * len(bench_decode.KV_HEADS) * len(decode_impls)
        parts = {} if args.decode_only else estimate(seqs, impls, rep, args.repeats, recorded_times(basis))
        if decode_cells:
            parts["decode"] = decode_seconds(decode_cells, args.rep or 20, args.repeats)
        print(estimate_text(parts, basis))
        return 0
    if not torch.cuda.is_available():
        print("No CUDA GPU: no timings. Checking the Triton kernels in the interpreter instead:")
        ok = interpreter_check()
        ok &= not bench_decode.check_decode(bench_decode.INTERPRETER_CASES, device="cpu")
        print("Interpreter check passed." if ok else "Interpreter check FAILED.")
        return 0
    info = machine(args.commit)
    print(", ".join(f"{k} {v}" for k, v in info.items()), flush=True)
    if args.decode_only:
        return run_decode(args, info)
    hopper = torch.cuda.get_device_capability() >= (9, 0)
    impls = [i for i in impls if hopper or i != "course-pointers"]
    code = run_prefill(impls, seqs, rep, args.repeats, info, args.out, hopper, _deadline(args))
    return code if code or args.no_decode else run_decode(args, info)


def refusals(failures: list[str], impls) -> tuple[list[str], dict[str, str]]:
    """kernel_gpu.check_kernels's failures -> (those that stop every course row, {impl: why not timed}):
    a case whose only failures are the fused backward's outputs refuses course-fused alone."""
    fused = [f for f in failures if ": fused d" in f]
    blocking = [f for f in failures if f not in fused]
    if not fused or "course-fused" not in impls:
        return blocking, {}
    return blocking, {"course-fused": f"not timed: disagrees with SDPA ({len(fused)} failures: {fused[0][:120]})"}


def _deadline(args: argparse.Namespace) -> float | None:
    return None if args.time_limit is None else START + args.time_limit


def run_prefill(impls, seqs, rep: int, repeats: int, info: dict, out: Path, hopper: bool,
                deadline: float | None = None) -> int:
    """Compile, check, warm up, then time every cell in ``repeats`` passes over the grid (fewer
    where another pass would end after ``deadline``, a ``time.perf_counter()`` value; a pass stops
    at the first cell that would start after it, the cells never reached say so); write the CSV
    after every cell, the markdown after every pass, then the plot and the autotuner's choices.
    Returns 1 (nothing timed) when the course kernel disagrees with SDPA."""
    from helpers.tools import kernel_gpu

    start = time.perf_counter()
    info.update(rep=rep, states=[("before the run", bench_decode.gpu_state())])
    info["clocks_before"] = bench_decode.clocks_text(info["states"][0][1])
    paths = sorted({tma for impl, tma in (("course", hopper), ("course-fused", hopper), ("course-pointers", False))
                    if impl in impls})
    if paths:  # every config the autotuner will try, compiled in parallel (the check reuses some)
        try:
            kernel_gpu.precompile(1, HEADS, seqs, HEAD_DIMS, paths)
        except Exception as exc:  # noqa: BLE001 - a speed-up only: the autotuner compiles what is missing
            print(f"Precompile failed ({type(exc).__name__}: {exc}); the autotuner compiles instead", flush=True)
    print("Checking the course kernel against SDPA (outputs poisoned with NaN first):", flush=True)
    failures, refused = refusals(kernel_gpu.check_kernels((True, False) if hopper else (False,)), impls)
    if failures:
        print("The course kernel disagrees with SDPA; not timing it:\n  " + "\n  ".join(failures))
        return 1
    for impl, why in refused.items():
        print(f"{impl}: {why}")
    print(f"Compiles and checks: {time.perf_counter() - start:.0f} s", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / slug(info["gpu"])
    timed = [i for i in impls if i not in refused]
    cells = [(T, d, c, mode, impl) for T in seqs for d in HEAD_DIMS for c in (False, True) for mode in MODES
             for impl in impls]
    runs = [dict(new_row(i, m, T, d, c, refused[i]), run=1) for T, d, c, m, i in cells if i in refused]
    start = time.perf_counter()
    warm_up(timed, seqs[0], rep)
    print(f"Warm-up (every implementation once, untimed): {time.perf_counter() - start:.0f} s", flush=True)
    first_status: dict[tuple, str] = {}
    last, stopped = 0.0, None
    for run_no in range(1, repeats + 1):
        if not bench_decode.another_pass(time.perf_counter(), last, deadline):
            print(f"Stopping after {run_no - 1} passes: another would end past --time-limit", flush=True)
            break
        start = time.perf_counter()
        todo = [cell for cell in cells if cell[4] in timed and first_status.get(cell, "ok") == "ok"]
        done, stopped = time_pass(todo, run_no, repeats, rep, deadline, first_status, runs,
                                  lambda: write_csv(aggregate(runs), info, stem.with_suffix(".csv")))
        info["states"].append((f"after pass {run_no}", bench_decode.gpu_state()))
        write_markdown(aggregate(runs), info, seqs, stem.with_suffix(".md"))
        last = time.perf_counter() - start
        print(f"Pass {run_no} of {repeats}: {done} of {len(todo)} cells in {last:.0f} s", flush=True)
        if stopped:
            print(f"Stopping in pass {run_no}: {stopped}", flush=True)
            break
    reached = {(r["T"], r["d"], r["causal"], r["mode"], r["impl"]) for r in runs}
    runs += [dict(new_row(i, m, T, d, c, "skipped: not reached before --time-limit"), run=1)
             for T, d, c, m, i in cells if (T, d, c, m, i) not in reached]
    info["clocks_after"] = bench_decode.clocks_text(info["states"][-1][1])
    rows = aggregate(runs)
    write_csv(rows, info, stem.with_suffix(".csv"))
    write_markdown(rows, info, seqs, stem.with_suffix(".md"))
    plot(rows, info, seqs, stem.with_suffix(".png"))
    print("\n".join(goal_checks(rows)))
    if paths:
        write_choices(stem, info)
    print(f"Wrote {stem}.csv, .md and .png, and {stem.name}-kernels.md/.json")
    return 0


def time_pass(todo: list[tuple], run_no: int, repeats: int, rep: int, deadline: float | None,
              first_status: dict, runs: list[dict], save) -> tuple[int, str | None]:
    """One pass over the cells ``todo`` ((T, d, causal, mode, impl)): each row into ``runs`` (and
    its first status into ``first_status``), ``save()`` after each; a cell whose measurement raised
    outside measure's own handling (its inputs, a CUDA error that sticks) is an ``error`` row, not
    the end of the run. Stops before a cell that would start past ``deadline``: returns (cells
    measured, "--time-limit reached"), else (len(todo), None)."""
    from tqdm import tqdm

    for n, (T, d, c, mode, impl) in enumerate(tqdm(todo, desc=f"pass {run_no} of {repeats}", unit="cell",
                                                   mininterval=10)):
        if deadline is not None and time.perf_counter() > deadline:
            return n, "--time-limit reached"
        try:
            row = measure(impl, mode, T, d, c, rep, first=run_no == 1)
        except Exception as exc:  # noqa: BLE001 - keep every row measured so far, and the reports
            row = new_row(impl, mode, T, d, c, "error: " + _reason(exc, []))
            print(f"  {impl} {mode} T={T} d={d} causal={c}: {row['status']}", flush=True)
        first_status.setdefault((T, d, c, mode, impl), row["status"])
        runs.append(dict(row, run=run_no))
        save()  # every row as soon as it exists
    return len(todo), None


def write_choices(stem: Path, info: dict) -> None:
    """The autotuner's choices (kernel_gpu.autotune_choices, against the ahead-of-time report of this
    Triton) into ``<stem>-kernels.json`` and ``.md``; a failure is printed, not raised."""
    import triton

    from helpers.tools import kernel_gpu

    try:
        report = kernel_gpu.aot_report(RESULTS_DIR, triton.__version__)
        choices = kernel_gpu.autotune_choices(HEAD_DIMS, report)
    except Exception as exc:  # noqa: BLE001 - the timings are written already
        print(f"The autotuner's choices: not read: {type(exc).__name__}: {exc}", flush=True)
        return
    (stem.parent / f"{stem.name}-kernels.json").write_text(json.dumps(choices, indent=1))
    table = kernel_gpu.choices_markdown(choices)
    machine_line = ", ".join(f"{k} {v}" for k, v in info.items() if k not in ("states", "clocks_before", "clocks_after"))
    (stem.parent / f"{stem.name}-kernels.md").write_text("\n".join(
        [f"# The autotuner's choices on {info['gpu']}", "",
         machine_line + ". registers / spill_bytes: this GPU's compile; "
         f"aot_*: helpers/results/{report.name} (make kernel-report, Triton {triton.__version__} on a CPU).", ""]
        + table) + "\n")
    print("\n".join(table))


def run_decode(args: argparse.Namespace, info: dict) -> int:
    """The decode-step rows (bench/bench_decode.py) with this run's options."""
    batches, contexts, impls = _decode_grid(args)
    args.out.mkdir(parents=True, exist_ok=True)
    info = {k: v for k, v in info.items() if k not in ("states", "clocks_before", "clocks_after")}
    return bench_decode.run(info, args.out, rep=args.rep or 20, batches=batches, contexts=contexts,
                            impls=impls, repeats=args.repeats, deadline=_deadline(args))


if __name__ == "__main__":
    sys.exit(main())
