"""Attention benchmarks: naive PyTorch, each SDPA backend, and the course's Triton kernel (`make bench`).

On a CUDA GPU: forward and forward+backward, fp16, B=4, H=32, T in {1k..16k}, d in {64, 128},
causal and not. Reports TFLOPS (forward FLOPs = 4*B*H*T^2*d, half when causal; backward = 2.5x
forward, so forward+backward = 3.5x) and the peak extra memory of one call, and writes
``<out>/<gpu>.csv``, ``.md`` (tables and a summary that checks the course's performance goals) and
``.png``. The course kernel is first checked against SDPA at one shape; a wrong kernel is not timed.

Without CUDA: prints that there is nothing to time, runs a few-second correctness check of the
kernels in Triton's interpreter, and exits 0.

    python bench/bench_attention.py [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import csv
import datetime
import gc
import math
import re
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `helpers` when run as a script

from helpers.nb03_masks import causal_mask  # noqa: E402

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
    if impl == "course":
        return lambda q, k, v: tf.flash_attention_triton(q, k, v, causal=causal)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, IMPLS[impl])

    def run(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


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


def check_course_kernel() -> None:
    """Compare the course kernel with SDPA (fp32 math reference) on a ragged shape, forward and
    backward, fp16, causal and not, d = 64 and 128. Exits 1 with the errors if it is wrong."""
    failures = []
    for d in HEAD_DIMS:
        for causal in (False, True):
            g = torch.Generator(device="cuda").manual_seed(1)
            q, k, v, grad_out = (torch.randn(2, 8, 1000, d, device="cuda", dtype=torch.float16, generator=g)
                                 for _ in range(4))
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            out = tf.flash_attention_triton(q, k, v, causal=causal)
            out.backward(grad_out)
            q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
            ref = F.scaled_dot_product_attention(q32, k32, v32, is_causal=causal)
            ref.backward(grad_out.float())
            # fp16 storage and fp16 P / dS against an fp32 reference (see tests/test_nb09_triton_flash.py)
            for name, got, want, tol in (("out", out, ref, 5e-3), ("dq", q.grad, q32.grad, 2e-2),
                                         ("dk", k.grad, k32.grad, 2e-2), ("dv", v.grad, v32.grad, 2e-2)):
                err = ((got.float() - want).abs() - tol * want.abs()).max().item()
                if not err <= tol:  # also catches NaN
                    failures.append(f"d={d} causal={causal} {name}: max |err| beyond tolerance by {err - tol:.3g}")
    if failures:
        print("The course kernel disagrees with SDPA; not timing it:\n  " + "\n  ".join(failures))
        sys.exit(1)
    print("Course kernel matches SDPA (B=2, H=8, T=1000, d=64/128, fp16, causal and not, forward and backward).")


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


def machine() -> dict:
    import triton

    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "cuda": torch.version.cuda}


def slug(name: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def write_csv(rows: list[dict], info: dict, path: Path) -> None:
    fields = ["gpu", "torch", "triton", "cuda", "impl", "mode", "T", "d", "causal", "ms", "tflops",
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
           f"torch {info['torch']} (CUDA {info['cuda']}), triton {info['triton']}, "
           f"{datetime.date.today().isoformat()}. B={BATCH}, H={HEADS}, fp16, `[B, H, T, d]` inputs. "
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
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results",
                        help="directory for <gpu>.csv/.md/.png (default: bench/results)")
    args = parser.parse_args(argv)

    if tf is None:
        print(f"{TRITON_MISSING} No benchmark here.")
        return 0
    if not torch.cuda.is_available():
        print("No CUDA GPU: no timings. Checking the Triton kernels in the interpreter instead:")
        ok = interpreter_check()
        print("Interpreter check passed." if ok else "Interpreter check FAILED.")
        return 0

    from tqdm import tqdm

    info = machine()
    print(f"{info['gpu']}, torch {info['torch']} (CUDA {info['cuda']}), triton {info['triton']}")
    check_course_kernel()
    seqs = QUICK_T if args.quick else FULL_T
    rep = 30 if args.quick else 100
    jobs = [(T, d, c, mode, impl) for T in seqs for d in HEAD_DIMS for c in (False, True) for mode in MODES
            for impl in IMPLS]
    rows = []
    for T, d, c, mode, impl in tqdm(jobs, desc="benchmark", unit="run"):
        rows.append(measure(impl, mode, T, d, c, rep))

    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / slug(info["gpu"])
    write_csv(rows, info, stem.with_suffix(".csv"))
    write_markdown(rows, info, seqs, stem.with_suffix(".md"))
    plot(rows, info, seqs, stem.with_suffix(".png"))
    print("\n".join(goal_checks(rows)))
    print(f"Wrote {stem}.csv, .md and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
