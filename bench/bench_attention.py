"""Attention benchmarks: naive PyTorch, each SDPA backend, and the course's Triton kernel (`make bench`).

On a CUDA GPU: forward and forward+backward, fp16, B=4, H=32, T in {1k..16k}, d in {64, 128},
causal and not. Reports TFLOPS (forward FLOPs = 4*B*H*T^2*d, half when causal; backward = 2.5x
forward, so forward+backward = 3.5x) and the peak extra memory of one call, and writes
``<out>/<gpu>.csv``, ``.md`` (tables and a summary that checks the course's performance goals) and
``.png``. On Hopper (sm_90) the course kernel is timed twice: "course" (K/V through TMA tensor
descriptors, the default there) and "course-pointers" (pointer grids, as on older GPUs).

Before timing, the course kernel is checked against SDPA over many cases, both load paths, with its
outputs poisoned (helpers/tools/kernel_gpu.py); a wrong kernel is not timed. Every configuration
the autotuner will try is compiled first, in parallel processes. After timing, the autotuner's
choices, with the registers and spills of each on this GPU and in the ahead-of-time report
(kernel_aot.json), go to ``<out>/<gpu>-kernels.md`` and ``.json``.

Then the decode rows (bench/bench_decode.py): one decode step of the course's split-KV kernel
over a paged cache (helpers/nb12_triton_decode.py) against SDPA on a contiguous cache, in µs and
GB/s, into ``<out>/<gpu>-decode.csv`` and ``.md``; ``--decode-only`` runs those alone,
``--no-decode`` skips them.

Without CUDA: prints that there is nothing to time, runs a few-second correctness check of the
kernels (FlashAttention and the decode kernel) in Triton's interpreter, and exits 0.

    python bench/bench_attention.py [--quick] [--out DIR] [--seqs 1024,4096] [--impls course,sdpa-flash]
        [--decode-only | --no-decode] [--decode-batches 1,8] [--decode-ctx 1024]
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
import subprocess
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `helpers` when run as a script

from helpers.nb03_masks import causal_mask  # noqa: E402
from helpers.package_data import RESULTS_DIR  # noqa: E402

try:
    from helpers import nb09_triton_flash as tf  # noqa: E402  (turns on the interpreter without CUDA)
except ImportError as exc:  # no Triton on this platform
    tf, TRITON_MISSING = None, str(exc)
if tf is not None:  # the decode rows, beside this file
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_decode  # noqa: E402

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
}
# Rough peak extra bytes of the T x T implementations, in units of one fp16 [B, H, T, T] tensor
# (naive: scores, masked scores, probabilities; backward adds their gradients; the math backend
# works in fp32). Used to skip runs that cannot fit instead of thrashing the allocator.
TXT_TENSORS = {("naive", "fwd"): 3, ("naive", "fwd+bwd"): 6, ("sdpa-math", "fwd"): 6, ("sdpa-math", "fwd+bwd"): 12}


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
    """4*B*H*T^2*d for the forward (half if causal); fwd+bwd = 3.5x the forward."""
    fwd = 4 * BATCH * HEADS * T * T * d / (2 if causal else 1)
    return fwd * (3.5 if mode == "fwd+bwd" else 1.0)


# --------------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------------


def _free_cuda() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _reason(exc: BaseException, caught: list) -> str:
    """A one-line reason from an exception and the warnings SDPA emitted while refusing."""
    texts = [str(w.message) for w in caught] + [str(exc)]
    text = " ".join(t.strip().splitlines()[0] for t in texts if t.strip())
    return re.sub(r"\s+", " ", text)[:160]


def measure(impl: str, mode: str, T: int, d: int, causal: bool, rep: int) -> dict:
    """Time one (implementation, mode, shape) with triton.testing.do_bench and measure its peak
    extra memory. Returns a row: ms, tflops, peak_extra_gib, status ("ok" or why not)."""
    import triton.testing

    row = {"impl": impl, "mode": mode, "T": T, "d": d, "causal": causal, "ms": None, "tflops": None,
           "peak_extra_gib": None, "status": "ok"}
    units = TXT_TENSORS.get((impl, mode))
    if units:
        need = units * BATCH * HEADS * T * T * 2
        free, _ = torch.cuda.mem_get_info()
        if need > 0.9 * free:
            row["status"] = f"skipped: needs ~{need / GiB:.0f} GiB of T x T tensors, {free / GiB:.0f} GiB free"
            return row
    _free_cuda()
    fn = attention_fn(impl, causal)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = {name: torch.randn(BATCH, HEADS, T, d, device="cuda", dtype=torch.float16, generator=g)
         for name in ("q", "k", "v", "grad_out")}  # cleared at the end so the memory is freed
    backward = mode == "fwd+bwd"
    for name in "qkv":
        x[name].requires_grad_(backward)

    def step():
        if backward:
            fn(x["q"], x["k"], x["v"]).backward(x["grad_out"])
        else:
            with torch.no_grad():
                fn(x["q"], x["k"], x["v"])

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
            qkv = [x["q"], x["k"], x["v"]]
            row["ms"] = triton.testing.do_bench(step, warmup=max(5, rep // 4), rep=rep, grad_to_none=qkv,
                                                return_mode="median")
            row["tflops"] = model_flops(T, d, causal, mode) / (row["ms"] * 1e-3) / 1e12
            for t in qkv:
                t.grad = None
            _free_cuda()
            base = torch.cuda.memory_allocated()  # the inputs (and grad_out)
            torch.cuda.reset_peak_memory_stats()
            step()
            torch.cuda.synchronize()
            row["peak_extra_gib"] = (torch.cuda.max_memory_allocated() - base) / GiB
        except torch.cuda.OutOfMemoryError:
            row.update(ms=None, tflops=None, status="OOM")
        finally:
            x.clear()
            _free_cuda()
    return row


def interpreter_check() -> bool:
    """A few-second CPU check of the kernels in Triton's interpreter against SDPA; True if all agree."""
    ok = True
    for T, d, H_kv, causal, dtype, tol in ((37, 32, 2, True, torch.float32, 1e-4), (70, 64, 1, False, torch.float16, 1e-2)):
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, 2, T, d, generator=g).to(dtype).requires_grad_()
        k, v = (torch.randn(1, H_kv, T, d, generator=g).to(dtype).requires_grad_() for _ in range(2))
        out = tf.flash_attention_triton(q, k, v, causal=causal)
        grad_out = torch.randn_like(out)
        out.backward(grad_out)
        q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
        ref = F.scaled_dot_product_attention(q32, k32, v32, is_causal=causal, enable_gqa=True)
        ref.backward(grad_out.float())
        err = max((a.float() - b).abs().max().item()
                  for a, b in ((out, ref), (q.grad, q32.grad), (k.grad, k32.grad), (v.grad, v32.grad)))
        good = err <= tol
        ok &= good
        print(f"  T={T} d={d} H=2 H_kv={H_kv} causal={causal} {str(dtype)[6:]}: forward+backward max |err| "
              f"{err:.1e} (tol {tol:.0e}) {'OK' if good else 'FAIL'}")
    return ok


# --------------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------------


def _command(args: list[str]) -> str:
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine(commit: str | None = None) -> dict:
    """The GPU, its driver, torch, Triton and CUDA versions, and the course's commit (from
    ``commit``, $COURSE_COMMIT or git: a copy of the tree without .git names it from outside)."""
    import triton

    driver = _command(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]).splitlines()
    commit = commit or os.environ.get("COURSE_COMMIT") or _command(["git", "rev-parse", "--short", "HEAD"])
    return {"gpu": torch.cuda.get_device_name(), "driver": driver[0] if driver else "unknown",
            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
            "commit": commit or "unknown"}


def slug(name: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def write_csv(rows: list[dict], info: dict, path: Path) -> None:
    fields = ["gpu", "driver", "torch", "triton", "cuda", "commit", "impl", "mode", "T", "d", "causal", "ms", "tflops",
              "peak_extra_gib", "status"]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow({**info, **{k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in r.items()}})


def _lookup(rows: list[dict]) -> dict:
    return {(r["impl"], r["mode"], r["T"], r["d"], r["causal"]): r for r in rows}


def _cell(r: dict | None, key: str, fmt: str) -> str:
    if r is None:
        return ""
    if r[key] is not None:
        return format(r[key], fmt)
    return "OOM" if r["status"] == "OOM" else ("skip" if r["status"].startswith("skipped") else "n/a")


def backward_ms(table: dict, impl: str, T: int, d: int, causal: bool) -> float | None:
    """Backward time = (forward+backward) - forward."""
    fb, f = table.get((impl, "fwd+bwd", T, d, causal)), table.get((impl, "fwd", T, d, causal))
    if fb and f and fb["ms"] is not None and f["ms"] is not None:
        return fb["ms"] - f["ms"]
    return None


def goal_checks(rows: list[dict]) -> list[str]:
    """The course's performance goals, each a line 'PASS/FAIL/n/a: what (numbers)'."""
    t = _lookup(rows)
    ms = lambda impl, mode, T, d, c: (t.get((impl, mode, T, d, c)) or {}).get("ms")  # noqa: E731
    lines = []

    def check(what: str, value: float | None, goal: float, unit: str = "x", higher: bool = True) -> None:
        if value is None:
            lines.append(f"- n/a: {what} (not measured)")
        else:
            ok = value >= goal if higher else value <= goal
            lines.append(f"- {'PASS' if ok else 'FAIL'}: {what}: {value:.2f}{unit} (goal {'>=' if higher else '<='} {goal}{unit})")

    ratio = lambda a, b: (a / b) if a is not None and b is not None else None  # noqa: E731
    for d in HEAD_DIMS:
        for c in (False, True):
            check(f"forward vs SDPA flash, T=4096 d={d} causal={c}", ratio(ms("sdpa-flash", "fwd", 4096, d, c),
                                                                           ms("course", "fwd", 4096, d, c)), 1.0)
    for d in HEAD_DIMS:
        for c in (False, True):
            check(f"backward vs SDPA flash, T=4096 d={d} causal={c}",
                  ratio(backward_ms(t, "sdpa-flash", 4096, d, c), backward_ms(t, "course", 4096, d, c)), 0.7)
    for d in HEAD_DIMS:
        check(f"causal forward vs naive, T=4096 d={d}", ratio(ms("naive", "fwd", 4096, d, True),
                                                              ms("course", "fwd", 4096, d, True)), 8.0)
    for impl, goal, higher in (("course", 2.2, False), ("naive", 3.5, True)):
        for d in HEAD_DIMS:
            a = (t.get((impl, "fwd", 4096, d, True)) or {}).get("peak_extra_gib")
            b = (t.get((impl, "fwd", 8192, d, True)) or {}).get("peak_extra_gib")
            check(f"{impl} forward peak extra memory growth T=4096 -> 8192, d={d} causal",
                  ratio(b, a), goal, higher=higher)
    lines.append("")
    lines.append("Course kernel vs cuDNN (time ratio, > 1 means the course kernel is faster), T=4096:")
    for d in HEAD_DIMS:
        for c in (False, True):
            f = ratio(ms("sdpa-cudnn", "fwd", 4096, d, c), ms("course", "fwd", 4096, d, c))
            b = ratio(backward_ms(t, "sdpa-cudnn", 4096, d, c), backward_ms(t, "course", 4096, d, c))
            fmt = lambda x: "n/a" if x is None else f"{x:.2f}x"  # noqa: E731
            lines.append(f"- d={d} causal={c}: forward {fmt(f)}, backward {fmt(b)}")
    return lines


def write_markdown(rows: list[dict], info: dict, seqs: tuple, path: Path) -> None:
    t = _lookup(rows)
    impls = [i for i in IMPLS if any(r["impl"] == i for r in rows)]
    out = [f"# Attention benchmark: {info['gpu']}", "",
           f"torch {info['torch']} (CUDA {info['cuda']}), triton {info['triton']}, driver "
           f"{info.get('driver', '?')}, commit {info.get('commit', '?')}, {datetime.date.today().isoformat()}. B={BATCH}, H={HEADS}, fp16, `[B, H, T, d]` inputs. "
           "TFLOPS use 4·B·H·T²·d forward FLOPs (half when causal), backward 2.5x forward. "
           "Peak extra memory: `torch.cuda.max_memory_allocated()` during one call minus what was allocated "
           "before it (the inputs). Generated by `bench/bench_attention.py`.", ""]
    sections = [("Forward, TFLOPS", "fwd", "tflops", ".0f"), ("Forward + backward, TFLOPS", "fwd+bwd", "tflops", ".0f"),
                ("Forward, peak extra memory (GiB)", "fwd", "peak_extra_gib", ".3g"),
                ("Forward + backward, peak extra memory (GiB)", "fwd+bwd", "peak_extra_gib", ".3g")]
    for title, mode, key, fmt in sections:
        out += [f"## {title}", "", "| causal | d | T | " + " | ".join(impls) + " |",
                "|---|---|---|" + "---|" * len(impls)]
        for c in (False, True):
            for d in HEAD_DIMS:
                for T in seqs:
                    cells = [_cell(t.get((i, mode, T, d, c)), key, fmt) for i in impls]
                    out.append(f"| {c} | {d} | {T} | " + " | ".join(cells) + " |")
        out.append("")
    notes = sorted({f"{r['impl']} ({r['mode']}, T={r['T']}): {r['status']}" for r in rows if r["status"] != "ok"})
    if notes:
        out += ["Cells without a number (skip: would not fit in memory; n/a: backend unsupported; OOM):", ""]
        out += [f"- {n}" for n in notes] + [""]
    out += ["## Summary: the course's goals", ""] + goal_checks(rows) + [""]
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
                    ax.plot(*zip(*pts), marker="o", label=impl, linewidth=2.5 if impl == "course" else 1.2)
            ax.set_xscale("log", base=2)
            if key == "peak_extra_gib":
                ax.set_yscale("log")
            ax.set_title(f"d={d}, {'causal' if c else 'full'}", fontsize=10)
            ax.set_xlabel("T")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"Attention on {info['gpu']} (B={BATCH}, H={HEADS}, fp16; torch {info['torch']}, triton {info['triton']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"T in {QUICK_T} and shorter timing runs")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR,
                        help="directory for <gpu>.csv/.md/.png (default: helpers/results, package data)")
    parser.add_argument("--seqs", help="comma-separated sequence lengths (default: by --quick)")
    parser.add_argument("--impls", help=f"comma-separated subset of {','.join(IMPLS)}")
    parser.add_argument("--rep", type=int, help="milliseconds of timed runs per measurement (default: by --quick)")
    parser.add_argument("--commit", help="the course's commit, for the results (default: git)")
    decode = parser.add_mutually_exclusive_group()
    decode.add_argument("--decode-only", action="store_true", help="only the decode-step rows")
    decode.add_argument("--no-decode", action="store_true", help="skip the decode-step rows")
    parser.add_argument("--decode-batches", help="comma-separated batch sizes of the decode rows")
    parser.add_argument("--decode-ctx", help="comma-separated context lengths of the decode rows")
    args = parser.parse_args(argv)

    if tf is None:
        print(f"{TRITON_MISSING} No benchmark here.")
        return 0
    if not torch.cuda.is_available():
        print("No CUDA GPU: no timings. Checking the Triton kernels in the interpreter instead:")
        ok = interpreter_check()
        ok &= not bench_decode.check_decode(bench_decode.INTERPRETER_CASES, device="cpu")
        print("Interpreter check passed." if ok else "Interpreter check FAILED.")
        return 0

    from tqdm import tqdm

    from helpers.tools import kernel_gpu

    info = machine(args.commit)
    print(", ".join(f"{k} {v}" for k, v in info.items()), flush=True)
    if args.decode_only:
        return run_decode(args, info)
    hopper = torch.cuda.get_device_capability() >= (9, 0)
    impls = [i for i in (args.impls.split(",") if args.impls else IMPLS) if hopper or i != "course-pointers"]
    unknown = set(impls) - set(IMPLS)
    if unknown:
        parser.error(f"unknown --impls {sorted(unknown)}; choose from {list(IMPLS)}")
    seqs = tuple(int(t) for t in args.seqs.split(",")) if args.seqs else (QUICK_T if args.quick else FULL_T)
    rep = args.rep or (30 if args.quick else 100)

    paths = [p for impl, p in (("course", None), ("course-pointers", False)) if impl in impls]
    if paths:  # every config the autotuner will try, compiled in parallel (the check reuses some)
        kernel_gpu.precompile(1, HEADS, seqs, HEAD_DIMS, [hopper if p is None else p for p in paths])
    print("Checking the course kernel against SDPA (outputs poisoned with NaN first):", flush=True)
    failures = kernel_gpu.check_kernels((True, False) if hopper else (False,))
    if failures:
        print("The course kernel disagrees with SDPA; not timing it:\n  " + "\n  ".join(failures))
        return 1

    per_length = [(d, c, mode, impl) for d in HEAD_DIMS for c in (False, True) for mode in MODES for impl in impls]
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / slug(info["gpu"])
    rows = []
    with tqdm(total=len(seqs) * len(per_length), desc="benchmark", unit="run", mininterval=10) as progress:
        for T in seqs:
            for d, c, mode, impl in per_length:
                rows.append(measure(impl, mode, T, d, c, rep))
                progress.update()
            write_csv(rows, info, stem.with_suffix(".csv"))  # each length's rows as soon as they exist
    write_markdown(rows, info, seqs, stem.with_suffix(".md"))
    plot(rows, info, seqs, stem.with_suffix(".png"))
    print("\n".join(goal_checks(rows)))
    if paths:
        choices = kernel_gpu.autotune_choices(HEAD_DIMS, RESULTS_DIR / "kernel_aot.json")
        (stem.parent / f"{stem.name}-kernels.json").write_text(json.dumps(choices, indent=1))
        table = kernel_gpu.choices_markdown(choices)
        (stem.parent / f"{stem.name}-kernels.md").write_text("\n".join(
            [f"# The autotuner's choices on {info['gpu']}", "",
             ", ".join(f"{k} {v}" for k, v in info.items()) + ". registers / spill_bytes: this GPU's compile; "
             "aot_*: helpers/results/kernel_aot.json (make kernel-report, Triton on a CPU).", ""] + table) + "\n")
        print("\n".join(table))
    print(f"Wrote {stem}.csv, .md and .png, and {stem.name}-kernels.md/.json")
    return 0 if args.no_decode else run_decode(args, info)


def run_decode(args: argparse.Namespace, info: dict) -> int:
    """The decode-step rows (bench/bench_decode.py) with this run's options."""
    def ints(text: str | None, default: tuple) -> tuple:
        return tuple(int(x) for x in text.split(",")) if text else default

    args.out.mkdir(parents=True, exist_ok=True)
    return bench_decode.run(info, args.out, rep=args.rep or 20,
                            batches=ints(args.decode_batches, bench_decode.BATCHES),
                            contexts=ints(args.decode_ctx, bench_decode.CONTEXTS))


if __name__ == "__main__":
    sys.exit(main())
