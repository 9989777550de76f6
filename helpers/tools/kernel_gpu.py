"""The course kernel on a CUDA GPU: what `make bench` checks and records before and after timing.

* :func:`check_kernels` runs forward and backward against SDPA (float32 reference) over cases that
  cover fp16, bf16 and fp32, every supported head dim, causal and not, GQA and MQA, ragged and
  unequal lengths, autotuned lengths, and both load paths (TMA descriptors and pointer grids).
  Every buffer the kernels allocate is filled with NaN first, so an element never written fails.
  The cases run in parallel processes (compiling dominates, and Triton compiles on one core).
* :func:`precompile` compiles every configuration the autotuner will try for the benchmark's
  shapes in parallel processes; Triton's disk cache then serves the autotuner, which only times.
* :func:`compiled_kernels` reads registers, spills, shared memory and the instructions (wgmma,
  TMA copies) of each kernel this process compiled; :func:`autotune_choices` joins the
  autotuner's pick for each shape with those figures and with the ahead-of-time report's
  (helpers/results/kernel_aot.json), so the report's predictions are checked on the GPU.

Needs a CUDA GPU; ``python -m helpers.tools.kernel_gpu`` runs the checks alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import zlib
from pathlib import Path

from helpers.tools.kernel_report import (
    KERNELS,
    TORCH_DTYPES,
    _pool,
    config_key,
    load_kind,
    mma_kind,
    read_report,
)

KINDS = tuple(KERNELS)  # "fwd", "dkdv", "dq", "bwd" (the fused backward): nb09_triton_flash.KINDS's order
DTYPES = TORCH_DTYPES  # the cases' dtypes, short name -> torch's (tests/test_nb09_triton_flash.py reads them here)
# (atol, rtol) against a float32 reference (tests/test_nb09_triton_flash.py uses these too)
TOL = {("fp32", "fwd"): (1e-4, 1e-4), ("fp32", "bwd"): (1e-4, 1e-4),
       ("fp16", "fwd"): (2e-3, 2e-3), ("fp16", "bwd"): (1e-2, 1e-2),
       ("bf16", "fwd"): (1.6e-2, 1.6e-2), ("bf16", "bwd"): (6e-2, 6e-2)}
# (dtype, B, H, H_kv, T_q, T_k, d, causal): each value of each field appears, not the product
CASES = [
    ("fp16", 2, 8, 2, 1000, 1000, 64, False), ("fp16", 2, 8, 2, 1000, 1000, 64, True),
    ("fp16", 2, 8, 2, 1000, 1000, 128, False), ("fp16", 2, 8, 2, 1000, 1000, 128, True),
    ("fp16", 1, 4, 1, 300, 1100, 64, False), ("fp16", 1, 4, 4, 1, 1, 64, True),
    ("fp16", 1, 4, 2, 17, 17, 16, True), ("fp16", 1, 4, 4, 257, 257, 32, False),
    ("bf16", 2, 8, 2, 1000, 1000, 128, True), ("bf16", 1, 4, 4, 333, 333, 64, False),
    ("fp32", 1, 4, 2, 500, 500, 64, True), ("fp32", 1, 4, 4, 129, 129, 128, False),
    # autotuned lengths; H = 16 and H_kv = H specialise as the benchmark's shapes do (precompiled)
    ("fp16", 1, 16, 16, 4096, 4096, 64, True), ("fp16", 1, 16, 16, 4096, 4096, 128, False),
    ("fp16", 1, 32, 8, 2048, 2048, 128, True), ("bf16", 1, 16, 16, 4096, 4096, 64, False),
]


def _workers() -> int:
    """Processes for the parallel checks and compiles: all cores but one, at most 16."""
    return max(1, min(16, (os.cpu_count() or 2) - 1))


@contextlib.contextmanager
def _gpu_pool(jobs: int):
    """kernel_report's spawned workers, for a process that compiles for the GPU. A spawned worker
    first re-imports the parent's main script (bench/bench_attention.py imports Triton), and
    kernel_report's initializer refuses a Triton imported without TRITON_INTERPRET=0: on a GPU,
    where the variable is unset, every worker would die and the pool break. So the workers inherit
    TRITON_INTERPRET=0, what this process already runs under."""
    from helpers import nb09_triton_flash as tf

    if not tf._INTERPRET:
        os.environ["TRITON_INTERPRET"] = "0"
    with _pool(jobs) as pool:
        yield pool


@contextlib.contextmanager
def nan_filled_empty():
    """Within it, torch.empty fills floating-point tensors with NaN, so an output element a kernel
    never writes shows as NaN instead of whatever the memory held."""
    import torch

    real = torch.empty

    def empty(*args, **kwargs):
        t = real(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    torch.empty = empty
    try:
        yield
    finally:
        torch.empty = real


def check_case(case: tuple, tma: bool) -> tuple[str, float, list[str]]:
    """One case on the GPU: (its name, seconds, failures; empty when it passes). The load path is
    forced for the case (``USE_TMA``) and given back after it."""
    from helpers import nb09_triton_flash as tf

    previous, tf.USE_TMA = tf.USE_TMA, tma
    try:
        return _check_case(case, tma)
    finally:
        tf.USE_TMA = previous


def _check_case(case: tuple, tma: bool) -> tuple[str, float, list[str]]:
    import torch
    import torch.nn.functional as F

    from helpers import nb09_triton_flash as tf

    dtype_name, B, H, H_kv, T_q, T_k, d, causal = case
    name = (f"{dtype_name} B={B} H={H} H_kv={H_kv} T_q={T_q} T_k={T_k} d={d} causal={causal} "
            f"{'tma' if tma else 'pointers'}")
    start = time.perf_counter()
    dtype = getattr(torch, DTYPES[dtype_name])
    device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: the interpreter (small cases only)
    g = torch.Generator(device=device).manual_seed(zlib.crc32(repr(case).encode()))
    q = torch.randn(B, H, T_q, d, device=device, generator=g).to(dtype)
    k, v = (torch.randn(B, H_kv, T_k, d, device=device, generator=g).to(dtype) for _ in range(2))
    grad_out = torch.randn(B, H, T_q, d, device=device, generator=g).to(dtype)
    failures = []
    if tma and not tf._tma_for(k, v):
        failures.append("the TMA path was asked for but _tma_for refused these tensors")
    try:
        with nan_filled_empty():
            out, lse = tf.flash_attention_triton_forward(q, k, v, causal=causal)
            grads = tf.flash_attention_triton_backward(q, k, v, out, lse, grad_out, causal=causal)
        _sync(device)
    except Exception as exc:  # a compile or launch error is a failure of this case, not of the run
        return name, time.perf_counter() - start, [_error(exc)]
    try:  # the fused backward apart: its error refuses course-fused alone ("fused ..."; bench's refusals)
        with nan_filled_empty():
            fused = tf.flash_attention_triton_backward(q, k, v, out, lse, grad_out, causal=causal, deterministic=False)
        _sync(device)
    except Exception as exc:
        fused = None
        failures.append(f"fused dq, dk, dv: {_error(exc)}")
    q32, k32, v32 = (t.float().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q32, k32, v32, is_causal=causal, enable_gqa=H_kv != H)
    ref.backward(grad_out.float())
    checks = [("out", out, ref.detach(), "fwd")] + [
        (f"{prefix}{what}", got, want, "bwd") for prefix, three in (("", grads), ("fused ", fused)) if three is not None
        for what, got, want in zip(("dq", "dk", "dv"), three, (q32.grad, k32.grad, v32.grad))]
    for what, got, want, kind in checks:
        atol, rtol = TOL[(dtype_name, kind)]
        if got.isnan().any():
            failures.append(f"{what}: {int(got.isnan().sum())} NaN (elements never written?)")
            continue
        try:
            torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)
        except AssertionError as exc:
            failures.append(f"{what}: " + " ".join(str(exc).split())[:300])
    return name, time.perf_counter() - start, failures


def _sync(device: str) -> None:
    """Wait for the GPU (a launch error shows here); nothing on the CPU."""
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _error(exc: BaseException) -> str:
    """'TypeError: first line of the message' (300 characters at most)."""
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"


def _check_job(job):
    """check_case for a (case, tma) job (what the pool's map hands over)."""
    return check_case(*job)


def check_kernels(tma_paths: tuple[bool, ...] = (True, False)) -> list[str]:
    """Every case of CASES on each load path, in parallel; prints one line per case, returns
    the failures ("case: what"). The TMA path is only tried where the GPU has TMA (sm_90+)."""
    import torch

    if torch.cuda.get_device_capability() < (9, 0):
        tma_paths = tuple(p for p in tma_paths if not p) or (False,)
    jobs = [(case, tma) for tma in tma_paths for case in CASES
            if not (case[0] == "bf16" and torch.cuda.get_device_capability() < (8, 0))]
    failures = []
    with _gpu_pool(_workers()) as pool:
        for name, seconds, bad in pool.map(_check_job, jobs):
            print(f"  {'FAIL' if bad else 'ok  '} {name} ({seconds:.1f} s)", flush=True)
            failures += [f"{name}: {b}" for b in bad]
    return failures


# --------------------------------------------------------------------------------------------
# Compiling ahead of the autotuner
# --------------------------------------------------------------------------------------------


class _WarmOnly:
    """Stands in for an autotuned launcher: compiles the given configs (warmup), launches nothing."""

    def __init__(self, tuner, configs):
        self.tuner, self.configs = tuner, configs

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            for config in self.configs:
                self.tuner.fn.run(*args, grid=grid, warmup=True, **kwargs, **config.all_kwargs())

        return launch


def precompile_one(job: tuple) -> tuple[tuple, str]:
    """Compile one configuration for one benchmark shape, as the autotuner would launch it:
    job = (B, H, T, d, causal, tma, kind, (block_m, block_n, warps, stages)) -> (job, "" or error)."""
    import torch

    from helpers import nb09_triton_flash as tf

    B, H, T, d, causal, tma, kind, row = job
    q, k, v, grad_out = (torch.randn(B, H, T, d, device="cuda", dtype=torch.float16) for _ in range(4))
    tuners = tf._launchers(q, tma)
    configs = tf.triton_configs([row])
    warm = tuple(_WarmOnly(t, configs if name == kind else []) for name, t in zip(KINDS, tuners))
    real, previous = tf._launchers, tf.USE_TMA
    tf._launchers, tf.USE_TMA = (lambda _q, _tma: warm), tma
    try:
        out, lse = tf.flash_attention_triton_forward(q, k, v, causal=causal)
        if kind != "fwd":  # "bwd": the fused backward's launcher; "dkdv", "dq": the two-kernel one's
            tf.flash_attention_triton_backward(q, k, v, out, lse, grad_out, causal=causal,
                                               deterministic=kind != "bwd")
        torch.cuda.synchronize()
        return job, ""
    except Exception as exc:  # a config that does not compile: the autotuner skips it too
        return job, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    finally:
        tf._launchers, tf.USE_TMA = real, previous


def precompile(B: int, H: int, seqs, head_dims, tma_paths) -> int:
    """Compile, in parallel, every config the autotuner will try for fp16 [B, H, T, d] inputs
    (T in seqs, d in head_dims, causal and not, each load path). Returns the number compiled."""
    import torch

    from helpers import nb09_triton_flash as tf

    target = tf.gpu_target(torch.cuda.get_device_capability())
    # the JIT specialises integers on divisibility by 16 (and == 1): one T per class is enough
    classes = {(T % 16 == 0, T == 1): T for T in seqs}
    jobs = []
    for T in classes.values():
        for d in head_dims:
            for causal in (False, True):
                for tma in tma_paths:
                    for kind in KINDS:
                        for row in tf.config_table(kind, d, tf.table_name(target, tma)):
                            if tf.valid_config(kind, row[0], row[1], causal, T, T):
                                jobs.append((B, H, T, d, causal, tma, kind, row))
    start = time.perf_counter()
    with _gpu_pool(_workers()) as pool:
        errors = [(job, err) for job, err in pool.map(precompile_one, jobs) if err]
    for job, err in errors:
        print(f"  precompile {job}: {err}")
    print(f"Compiled {len(jobs) - len(errors)} of {len(jobs)} configurations in "
          f"{time.perf_counter() - start:.0f} s ({_workers()} processes)", flush=True)
    return len(jobs) - len(errors)


# --------------------------------------------------------------------------------------------
# What was compiled, and what the autotuner chose
# --------------------------------------------------------------------------------------------


def compiled_kernels() -> list[dict]:
    """One row per kernel this process compiled: kernel, dtype, head_dim, causal, tma, block_m,
    block_n, num_warps, num_stages, registers, spill_bytes, shared_bytes, wgmma, tma_copies."""
    from helpers import nb09_triton_flash as tf

    rows = []
    for function_name in dict.fromkeys(KERNELS.values()):  # the dK/dV kernel serves "dkdv" and "bwd"
        fn = getattr(tf, function_name)
        for entry in getattr(fn, "device_caches", {}).values():
            for kernel in entry[0].values():
                kind = next(k for k, name in KERNELS.items() if name == function_name)
                try:
                    kernel._init_handles()
                    consts = {(fn.arg_names[key[0]] if isinstance(key, tuple) else key): value
                              for key, value in kernel.src.constants.items()}
                    if consts.get("FUSED_DQ"):
                        kind = "bwd"
                    ptx = kernel.asm.get("ptx", "")
                    signature = getattr(kernel.src, "signature", {})
                    rows.append({
                        "kernel": kind, "dtype": str(signature.get("Q", "?")).lstrip("*"),
                        "head_dim": consts.get("HEAD_DIM"), "causal": bool(consts.get("CAUSAL")),
                        "tma": bool(consts.get("TMA")), "block_m": consts.get("BLOCK_M"),
                        "block_n": consts.get("BLOCK_N"), "num_warps": kernel.metadata.num_warps,
                        "num_stages": kernel.metadata.num_stages, "registers": kernel.n_regs,
                        "spill_bytes": kernel.n_spills, "shared_bytes": kernel.metadata.shared,
                        "wgmma": mma_kind(ptx) == "wgmma", "tma_copies": load_kind(ptx) == "tma",
                    })
                except Exception as exc:  # a Triton whose internals differ: say so, keep going
                    rows.append({"kernel": kind, "error": f"{type(exc).__name__}: {exc}"[:200]})
    return rows


def aot_report(results_dir: Path, version: str) -> Path:
    """The ahead-of-time report compiled with this Triton ``version`` (its major.minor, as the
    report's .meta.json names it): kernel_aot_triton36.json on the GPU's Triton 3.6, so that a
    difference in registers is the GPU's and not Triton's; else kernel_aot.json."""
    major_minor = version.split(".")[:2]
    for path in (results_dir / f"kernel_aot_triton{''.join(major_minor)}.json", results_dir / "kernel_aot.json"):
        meta = path.with_suffix(".meta.json")
        if path.exists() and meta.exists() and \
                str(json.loads(meta.read_text()).get("triton", "")).split(".")[:2] == major_minor:
            return path
    return results_dir / "kernel_aot.json"


def _report_rows(path: Path) -> dict:
    """The ahead-of-time report's rows at ``path`` by configuration (``config_key``); {} without one."""
    return {config_key(row): row for row in read_report(path)} if path.exists() else {}


def autotune_choices(head_dims, report: Path) -> list[dict]:
    """For each shape the autotuner has seen: its pick, the registers and spills the GPU's
    compile gave, and the ahead-of-time report's figures for the same configuration."""
    import torch

    from helpers import nb09_triton_flash as tf

    target = tf.gpu_target(torch.cuda.get_device_capability())
    predicted = _report_rows(report)
    compiled = {(r["kernel"], r["dtype"], r["head_dim"], r["causal"], r["tma"], r["block_m"], r["block_n"],
                 r["num_warps"], r["num_stages"]): r for r in compiled_kernels() if "error" not in r}
    short_name = {f"torch.{name}": short for short, name in DTYPES.items()}  # "torch.float16" -> "fp16"
    rows = []
    tuners = [(kind, tuner) for d in head_dims for table in dict.fromkeys([tf.table_name(target, True),
                                                                           tf.table_name(target, False)])
              for kind, tuner in zip(KINDS, tf._kernels(False, d, table))]
    for kind, tuner in tuners:
        for key, config in getattr(tuner, "cache", {}).items():
            n_q, n_k, head_dim, causal, tma = key[:5]
            dtype = next((str(x) for x in key[5:] if "float" in str(x)), "torch.float16")
            short = short_name.get(dtype, dtype)
            bm, bn = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]
            w, s = config.num_warps, config.num_stages
            gpu = compiled.get((kind, short, head_dim, bool(causal), bool(tma), bm, bn, w, s), {})
            aot = predicted.get(config_key(dict(kernel=kind, target=target, tma=bool(tma), dtype=short, head_dim=head_dim,
                                                causal=bool(causal), block_m=bm, block_n=bn, num_warps=w,
                                                num_stages=s)), {})
            rows.append({"kernel": kind, "T_q": n_q, "T_k": n_k, "head_dim": head_dim, "causal": bool(causal),
                         "dtype": short, "tma": bool(tma), "block_m": bm, "block_n": bn, "num_warps": w,
                         "num_stages": s, "registers": gpu.get("registers"), "spill_bytes": gpu.get("spill_bytes"),
                         "aot_registers": aot.get("registers"), "aot_spill_bytes": aot.get("spill_bytes"),
                         "wgmma": gpu.get("wgmma"), "tma_copies": gpu.get("tma_copies")})
    return rows


def choices_markdown(rows: list[dict]) -> list[str]:
    """The autotuner's choices as a markdown table."""
    cols = ["kernel", "T_q", "head_dim", "causal", "dtype", "tma", "block_m", "block_n", "num_warps", "num_stages",
            "registers", "spill_bytes", "aot_registers", "aot_spill_bytes", "wgmma", "tma_copies"]
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in sorted(rows, key=lambda r: (r["tma"], r["kernel"], r["head_dim"], r["causal"], r["T_q"])):
        out.append("| " + " | ".join("" if r.get(c) is None else str(r[c]) for c in cols) + " |")
    return out


def main() -> int:
    """``python -m helpers.tools.kernel_gpu``: check_kernels on this machine's GPU (exit 1 on a failure)."""
    import torch

    if not torch.cuda.is_available():
        print("No CUDA GPU: nothing to check here (the interpreter tests run in make test).")
        return 0
    failures = check_kernels()
    print("\n".join(failures) if failures else "All cases agree with SDPA.")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
