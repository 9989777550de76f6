"""Registers and spills of every configuration the autotuner can choose, compiled ahead of time for
named NVIDIA GPUs on a machine without one (`make kernel-report`).

Triton compiles for a GPU it cannot see: ``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90,
32))`` runs the whole pipeline to PTX and a cubin with the ptxas bundled in the wheel. Two things a
GPU run gives for free are rebuilt here:

* **Specialisation.** On a GPU, ``JITFunction.run`` (triton/runtime/jit.py) binds the launch
  arguments with the function ``create_function_from_signature`` builds, whose
  ``specialize_impl`` (Triton's native ``native_specialize_impl``, with the backend's
  ``get_int_specialization`` / ``get_tensor_specialization`` from triton/backends/compiler.py)
  turns an integer equal to 1 into a constant, marks integers and pointers divisible by 16 with
  "D", and ``JITFunction._pack_args`` turns that into ``constexprs`` and ``attrs``
  (``{(0,): [["tt.divisibility", 16]], ...}``, ``BaseBackend.parse_attr``). :func:`specialise`
  calls those same two functions on stand-in arguments (Triton's ``MockTensor``) for the shape
  :data:`SHAPE` (B=4, H=H_kv=32, T=4096, contiguous): the strides along d and GROUP become 1, the
  rest carry divisibility 16, exactly as a launch on the GPU would compile them.
* **The load path.** On sm_90 and newer the launchers load K, V (and the backward's Q, dO)
  through tensor descriptors (``TMA=True``, ``_tma_for``); :func:`uses_tma` makes the same
  decision for each target, so Hopper rows are the TMA kernels a launch there runs.
* **Registers and spills.** Without a GPU ``CompiledKernel.n_regs`` / ``n_spills`` stay unset
  (they are read when the cubin is loaded). ``ptxas -v`` says them while assembling the PTX:
  Triton's own ptxas run is captured when it compiles, and ptxas is run again with the same
  flags (``CUDABackend.make_cubin``, triton/backends/nvidia/compiler.py) when the kernel came from
  Triton's cache.

Each row of the report (``helpers/results/kernel_aot.json``, package data: notebook 09 reads it, a JSON list; ``kernel_aot.md`` beside it,
``kernel_aot.meta.json`` for where it came from) has the keys of :data:`ROW_KEYS`.

    python -m helpers.tools.kernel_report [--fast] [--targets sm_80,sm_90] [--out helpers/results] [--jobs N]

The compiles run in worker processes (spawned, with ``TRITON_INTERPRET=0`` set before Triton is
imported, so that the kernels are decorated for the GPU even from a notebook running the
interpreter). Finished rows go to ``<out>/kernel_aot.partial.jsonl`` as they come: an interrupted
run resumes where it stopped, as long as Triton and the kernels' source are unchanged.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import hashlib
import io
import json
import math
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

from helpers.package_data import RESULTS, RESULTS_DIR, package_file

ROOT = Path(__file__).resolve().parents[2]
KERNEL_SOURCE = ROOT / "helpers" / "nb09_triton_flash.py"

KERNELS = {"fwd": "_attn_fwd", "dkdv": "_attn_bwd_dkdv", "dq": "_attn_bwd_dq"}
TARGETS = {"sm_75": 75, "sm_80": 80, "sm_89": 89, "sm_90": 90}  # T4, A100, L4, H100/H200
REPORT_TARGETS = ("sm_80", "sm_90")
DTYPES = ("fp16", "bf16")  # the report's
TORCH_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}  # short name -> torch's
HEAD_DIMS = (64, 128)
SHAPE = {"B": 4, "H": 32, "H_KV": 32, "T": 4096}  # the benchmark's shape (bench/bench_attention.py)

# Shared memory one block may use (with the opt-in), per compute capability: the CUDA C++
# Programming Guide, "Compute Capabilities", table "Technical Specifications per Compute
# Capability" (maximum amount of shared memory per thread block).
SHARED_LIMIT = {
    "sm_75": 64 * 1024,  # 65,536
    "sm_80": 163 * 1024,  # 166,912
    "sm_89": 99 * 1024,  # 101,376
    "sm_90": 227 * 1024,  # 232,448
}

ROW_KEYS = ("kernel", "target", "tma", "dtype", "head_dim", "causal", "block_m", "block_n", "num_warps",
            "num_stages", "registers", "spill_bytes", "mma", "loads", "shared_bytes")

POINTERS = ("Q", "K", "V", "Out", "DO", "DK", "DV", "DQ")  # take the inputs' dtype
FP32_POINTERS = ("Lse", "Delta")
STRIDE_DIM = {"z": 0, "h": 1, "m": 2, "n": 2, "d": 3}  # last letter of stride_<tensor><dim>

# ----------------------------------------------------------------------------- what to compile


def _flash():
    """helpers.nb09_triton_flash (imports Triton, in whatever mode this process chose)."""
    from helpers import nb09_triton_flash

    return nb09_triton_flash


def config_table(kind: str, head_dim: int, table: str) -> list[tuple[int, int, int, int]]:
    """The (BLOCK_M, BLOCK_N, num_warps, num_stages) rows the autotuner starts from for kernel `kind`
    at this head dim, from the kernels' table named `table` ("sm_90", "sm_90-pointers", "sm_80", ...:
    ``table_name(target, tma)`` in helpers/nb09_triton_flash.py)."""
    return [tuple(row) for row in _flash().config_table(kind, head_dim, table)]


def choosable_configs(kind: str, head_dim: int, causal: bool, table: str) -> list[tuple[int, int, int, int]]:
    """The rows of table `table` the autotuner's pruner keeps at T = 4096 (``valid_config``), in table order."""
    tf = _flash()
    T = SHAPE["T"]
    return [row for row in config_table(kind, head_dim, table) if tf.valid_config(kind, row[0], row[1], causal, T, T)]


def load_paths(target: str, dtype: str, head_dim: int) -> tuple[bool, ...]:
    """The load paths a launch on `target` can take: descriptors (True) where ``uses_tma`` says a
    contiguous launch takes them, and then also pointer grids (the fallback for unaligned rows)."""
    return (True, False) if uses_tma(target, dtype, head_dim) else (False,)


def report_specs(targets=REPORT_TARGETS, dtypes=DTYPES) -> list[dict]:
    """Every (kernel, target, tma, dtype, head_dim, causal, config) the report compiles, for each
    kernel of KERNELS and head dim of HEAD_DIMS, as compile_row's kwargs; each load path tunes over
    its own table (``table_name``)."""
    specs = []
    for kernel in KERNELS:
        for target in targets:
            for dtype in dtypes:
                for head_dim in HEAD_DIMS:
                    for tma in load_paths(target, dtype, head_dim):
                        table = _flash().table_name(target, tma)
                        for causal in (False, True):
                            for bm, bn, w, s in choosable_configs(kernel, head_dim, causal, table):
                                specs.append(dict(kernel=kernel, target=target, tma=tma, dtype=dtype,
                                                  head_dim=head_dim, causal=causal, block_m=bm, block_n=bn,
                                                  num_warps=w, num_stages=s))
    return specs


# ----------------------------------------------------------------------------- specialise and compile (worker side)


def _init_worker() -> None:
    """Decorate kernels for the GPU in this process: TRITON_INTERPRET=0 before Triton is imported."""
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "0":
        raise RuntimeError("Triton was imported with its interpreter on: compile in a fresh process")
    os.environ["TRITON_INTERPRET"] = "0"


def _compiles_here() -> bool:
    """Whether this process can compile for a GPU itself: it asked for TRITON_INTERPRET=0 and the
    kernels (if already imported) were decorated for the GPU."""
    if os.environ.get("TRITON_INTERPRET") != "0":
        return False
    module = sys.modules.get("helpers.nb09_triton_flash")
    return module is None or not module._INTERPRET


def launch_arguments(fn, dtype: str, head_dim: int) -> list:
    """Stand-ins for the launch's non-constexpr arguments, by name, for the shape SHAPE: Triton's
    MockTensor for pointers (its data_ptr is 0: 16-byte aligned, as torch's allocations are),
    contiguous strides, floats for the scales, the sizes as ints."""
    import torch
    from triton.runtime.jit import MockTensor

    B, H, T = SHAPE["B"], SHAPE["H"], SHAPE["T"]
    torch_dtype = _torch_dtype(dtype)
    shape = [B, H, T, head_dim]
    strides = MockTensor(torch_dtype, shape).stride()
    sm_scale = 1.0 / math.sqrt(head_dim)
    ints = {"H": H, "H_KV": SHAPE["H_KV"], "N_Q": T, "N_K": T, "GROUP": H // SHAPE["H_KV"]}
    args = []
    for p in fn.params:
        name = p.name
        if p.is_constexpr:
            continue
        if name in POINTERS:
            args.append(MockTensor(torch_dtype, shape))
        elif name in FP32_POINTERS:
            args.append(MockTensor(torch.float32, shape[:3]))
        elif name == "qk_scale":
            args.append(sm_scale * 1.4426950408889634)
        elif name == "sm_scale":
            args.append(sm_scale)
        elif name.startswith("stride_") and name[-1] in STRIDE_DIM:
            args.append(strides[STRIDE_DIM[name[-1]]])
        elif name in ints:
            args.append(ints[name])
        else:
            raise ValueError(f"{fn.__name__}: no stand-in for argument {name!r}; add one to launch_arguments")
    return args


def specialise(fn, target, args: list, kwargs: dict):
    """(signature, constexprs, attrs, options) as ``JITFunction.run`` builds them on a GPU for these
    arguments: its binder (``create_function_from_signature``: ``specialize_impl`` per argument)
    and ``_pack_args``, with the backend of `target` instead of the active driver's."""
    from triton import knobs
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(target)
    kwargs = {**kwargs, "debug": kwargs.get("debug", fn.debug) or knobs.runtime.debug}
    for knob in ("instrumentation_mode", "fpsan_homomorphic_casts"):  # as JITFunction.run adds them
        if hasattr(knobs.compilation, knob):
            kwargs[knob] = getattr(knobs.compilation, knob)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound_args, specialization, options)
    return signature, constexprs, attrs, options


def ptxas_command(capability: int, options, ptx_path: str, out_path: str) -> list[str]:
    """ptxas's command line as ``CUDABackend.make_cubin`` builds it (Triton 3.9), with -v."""
    from triton import knobs
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    if knobs.compilation.disable_line_info:
        debug_info = ["-lineinfo", "-suppress-debug-info"]
    else:
        debug_info = ["-g"] if knobs.nvidia.disable_ptxas_opt else ["-lineinfo"]
    fmad = [] if options.enable_fp_fusion else ["--fmad=false"]
    extra = options.ptx_options.split(" ") if options.ptx_options else []
    return [get_ptxas(capability).path, *debug_info, *fmad, "-v", "--regAllocOptLevel=2", *extra,
            f"--gpu-name={sm_arch_from_capability(capability)}", ptx_path, "-o", out_path]


def run_ptxas(ptx: str, capability: int, options) -> str:
    """ptxas -v's report on `ptx` (its stderr)."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = ptxas_command(capability, options, src, src + ".o")
        run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"ptxas failed ({run.returncode}): {run.stderr[-2000:]}")
    return run.stdout + run.stderr


def compile_kernel(kernel: str, target: str, dtype: str, head_dim: int, causal: bool,
                   block_m: int, block_n: int, num_warps: int, num_stages: int, tma: bool):
    """(CompiledKernel, ptxas -v log) of one configuration, specialised as on the GPU; ``tma``: the
    load path (tensor descriptors or pointer grids), for the kernels that have both."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    tf = _flash()
    if tf._INTERPRET:
        raise RuntimeError("helpers.nb09_triton_flash runs in Triton's interpreter here: set TRITON_INTERPRET=0 "
                           "before importing helpers (or call compile_row, which compiles in a fresh process)")
    fn = getattr(tf, KERNELS[kernel])
    capability = TARGETS[target]
    gpu = GPUTarget("cuda", capability, 32)
    constexprs = dict(HEAD_DIM=head_dim, CAUSAL=bool(causal), DOT_PRECISION=tf._dot_precision(_torch_dtype(dtype)),
                      BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages)
    if "TMA" in fn.arg_names:
        constexprs["TMA"] = tma
    signature, consts, attrs, options = specialise(fn, gpu, launch_arguments(fn, dtype, head_dim), constexprs)
    log = io.StringIO()
    knobs.nvidia.dump_ptxas_log = True  # Triton prints its own ptxas -v log when it assembles
    with contextlib.redirect_stdout(log):
        compiled = triton.compile(ASTSource(fn, signature, consts, attrs), target=gpu, options=options.__dict__)
    ptxas_log = log.getvalue()
    if "Used" not in ptxas_log:  # from Triton's cache: no ptxas run this time
        ptxas_log = run_ptxas(compiled.asm["ptx"], capability, options)
    return compiled, ptxas_log


def uses_tma(target: str, dtype: str, head_dim: int) -> bool:
    """Whether a launch on `target` takes the tensor-descriptor (TMA) path for SHAPE's contiguous
    tensors: ``_tma_for``'s decision in helpers/nb09_triton_flash.py (its ``_tma_allowed`` for the
    target's capability in place of the current GPU's, then 16-byte aligned rows)."""
    capability = TARGETS[target]
    if not _flash()._tma_allowed((capability // 10, capability % 10)):
        return False
    element_size = _torch_dtype(dtype).itemsize
    return head_dim * element_size % 16 == 0  # data_ptr() and the other strides are multiples of this


def _torch_dtype(dtype: str):
    """'fp16' -> torch.float16 (a short name of TORCH_DTYPES)."""
    import torch

    return getattr(torch, TORCH_DTYPES[dtype])


def _compile_row(spec: dict) -> dict:
    """compile_row's work, in a process that compiles for the GPU (a worker, or the CLI itself)."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the JIT's default in Triton 3.9, said aloud
    compiled, ptxas_log = compile_kernel(**spec)
    usage = parse_ptxas(ptxas_log, entry=KERNELS[spec["kernel"]])
    ptx = compiled.asm["ptx"]
    return {**spec, "registers": usage["registers"], "spill_bytes": usage["spill_stores"],
            "mma": mma_kind(ptx), "loads": load_kind(ptx), "shared_bytes": int(compiled.metadata.shared)}


# ----------------------------------------------------------------------------- reading ptxas and PTX


_FUNCTION = re.compile(r"Compiling entry function '([^']+)'|Function properties for (\S+)")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_REGISTERS = re.compile(r"Used (\d+) registers")


def parse_ptxas(log: str, entry: str | None = None) -> dict:
    """``ptxas -v`` output -> {"registers", "spill_stores", "spill_loads"} of function `entry` (the
    first function reported when None or absent). Lines before a function's registers line belong
    to it: "Function properties for f" / "N bytes spill stores, M bytes spill loads" / "Used R registers"."""
    functions: dict[str, dict] = {}
    current = None
    for line in log.splitlines():
        if m := _FUNCTION.search(line):
            current = m[1] or m[2]
            functions.setdefault(current, {"registers": 0, "spill_stores": 0, "spill_loads": 0})
        elif current and (m := _SPILLS.search(line)):
            functions[current].update(spill_stores=int(m[1]), spill_loads=int(m[2]))
        if current and (m := _REGISTERS.search(line)):
            functions[current]["registers"] = int(m[1])
    if not functions:
        raise ValueError(f"no function in this ptxas output:\n{log[-1000:]}")
    return functions.get(entry) or next(iter(functions.values()))


def mma_kind(ptx: str) -> str:
    """The matrix instructions the dots became: "wgmma" (Hopper), "mma.sync" (Ampere/Turing/Ada), or "fma"."""
    if "wgmma" in ptx:
        return "wgmma"
    return "mma.sync" if "mma.sync" in ptx else "fma"


def load_kind(ptx: str) -> str:
    """How tiles reach shared memory: "tma" (cp.async.bulk.tensor), "cp.async", or "ld.global"
    (no asynchronous copies at all, e.g. sm_75, which has no cp.async)."""
    if "cp.async.bulk.tensor" in ptx:
        return "tma"
    return "cp.async" if "cp.async" in ptx else "ld.global"


# ----------------------------------------------------------------------------- the public API


def _pool(jobs: int) -> concurrent.futures.ProcessPoolExecutor:
    """Spawned workers (a fresh Triton each, decorated for the GPU by _init_worker)."""
    return concurrent.futures.ProcessPoolExecutor(
        max_workers=jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker)


def compile_rows(specs: list[dict], jobs: int | None = None, on_row=None) -> list[dict]:
    """compile_row for each spec (dicts of its arguments), `jobs` at a time (default: all cores), in
    the specs' order; ``on_row(row)`` is called as each one finishes."""
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(specs) or 1))
    if jobs == 1 and _compiles_here():
        rows = []
        for spec in specs:
            rows.append(_compile_row(spec))
            if on_row:
                on_row(rows[-1])
        return rows
    with _pool(jobs) as pool:
        futures = {pool.submit(_compile_row, spec): i for i, spec in enumerate(specs)}
        rows = [None] * len(specs)
        for future in concurrent.futures.as_completed(futures):
            rows[futures[future]] = future.result()
            if on_row:
                on_row(rows[futures[future]])
    return rows


def compile_row(kernel: str, target: str, dtype: str, head_dim: int, causal: bool,
                block_m: int, block_n: int, num_warps: int, num_stages: int, tma: bool | None = None) -> dict:
    """One report row: compile `kernel` ("fwd", "dkdv", "dq") for `target` (a key of TARGETS) with
    this configuration, specialised for SHAPE, and read its registers, spills, matrix instructions,
    loads and shared memory. Compiles in this process when it runs with TRITON_INTERPRET=0, else in
    a fresh one (a notebook with the interpreter on, a test). Seconds per call."""
    if target not in TARGETS:
        raise ValueError(f"target {target!r}: use one of {sorted(TARGETS)}")
    tma = uses_tma(target, dtype, head_dim) if tma is None else bool(tma)
    spec = dict(kernel=kernel, target=target, tma=tma, dtype=dtype, head_dim=head_dim, causal=bool(causal),
                block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages)
    return compile_rows([spec], jobs=1)[0]


def fits_shared(row: dict) -> bool:
    """Whether the row's shared memory fits one block on its target (SHARED_LIMIT)."""
    return row["shared_bytes"] <= SHARED_LIMIT[row["target"]]


def spilling(rows: list[dict]) -> list[dict]:
    """The rows whose kernel spills registers to local memory (spill_bytes > 0)."""
    return [row for row in rows if row["spill_bytes"] > 0]


def read_report(path=None) -> list[dict]:
    """The rows of a report written by this module (a JSON list); by default the committed one
    (``helpers/results/kernel_aot.json``, read through the package)."""
    path = path or package_file(RESULTS, "kernel_aot.json")
    return json.loads(Path(path).read_text(encoding="utf-8"))


# ----------------------------------------------------------------------------- provenance and writing


def _source_hash() -> str:
    """sha256 (12 hex digits) of helpers/nb09_triton_flash.py: the kernels this report compiled."""
    return hashlib.sha256(KERNEL_SOURCE.read_bytes()).hexdigest()[:12]


def _git(*args: str) -> str:
    """Output of a git command at the repository root ('' when git is missing)."""
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _ptxas_version() -> str:
    """The release line of the wheel's ptxas, e.g. 'Cuda compilation tools, release 12.9, V12.9.86'."""
    import importlib.util

    spec = importlib.util.find_spec("triton")
    for name in ("ptxas-blackwell", "ptxas"):
        path = Path(spec.submodule_search_locations[0]) / "backends" / "nvidia" / "bin" / name
        if path.exists():
            out = subprocess.run([str(path), "--version"], capture_output=True, text=True).stdout
            return next((line for line in out.splitlines() if "release" in line), out.strip())
    return "unknown"


def provenance() -> dict:
    """Where and from what the report was compiled: machine, Triton, ptxas, commit, kernel source."""
    from helpers.runtime import machine_name

    dirty = bool(_git("status", "--porcelain", "--", str(KERNEL_SOURCE.relative_to(ROOT))))
    return {
        "machine": machine_name(),
        "triton": metadata.version("triton"),
        "ptxas": _ptxas_version(),
        "commit": _git("rev-parse", "--short", "HEAD") + (" + uncommitted changes to the kernels" if dirty else ""),
        "kernel_source_sha256": _source_hash(),
        "date": datetime.date.today().isoformat(),
        "shape": f"B={SHAPE['B']}, H=H_kv={SHAPE['H']}, T={SHAPE['T']}, contiguous",
    }


def summary_markdown(rows: list[dict], meta: dict) -> str:
    """A short markdown report: per (kernel, target, head_dim) the number of configs, their
    registers, how many spill, the largest shared memory, then every spilling row."""
    lines = [
        "# Registers and spills, compiled ahead of time",
        "",
        f"Every configuration the autotuner can choose at {meta['shape']}, compiled on "
        f"{meta['machine']} with Triton {meta['triton']} ({meta['ptxas']}), commit {meta['commit']}, "
        f"kernels sha256 {meta['kernel_source_sha256']}, {meta['date']}. No GPU ran: registers and "
        "spills are ptxas -v's for the named architecture. `make kernel-report` writes this file.",
        "",
        "| kernel | target | loads | d | configs | registers | spilling | worst spill (bytes) | max shared (KiB) "
        "| all fit |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["kernel"], row["target"], row["loads"], row["head_dim"]), []).append(row)
    for (kernel, target, loads, d), group in groups.items():
        regs = [r["registers"] for r in group]
        spills = spilling(group)
        worst = max((r["spill_bytes"] for r in spills), default=0)
        shared = max(r["shared_bytes"] for r in group) / 1024
        fit = "yes" if all(fits_shared(r) for r in group) else "no"
        lines.append(f"| {kernel} | {target} | {loads} | {d} | {len(group)} | {min(regs)}-{max(regs)} | {len(spills)} | "
                     f"{worst} | {shared:.0f} | {fit} |")
    dtypes = ", ".join(sorted({row["dtype"] for row in rows}))
    lines += ["", f"Configurations are counted over dtypes ({dtypes}) and causal/non-causal.", ""]
    spills = spilling(rows)
    if spills:
        lines += ["## Spilling configurations", "",
                  "| kernel | target | dtype | d | causal | BLOCK_M x BLOCK_N, warps, stages | registers | spill bytes |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in spills:
            lines.append(f"| {r['kernel']} | {r['target']} | {r['dtype']} | {r['head_dim']} | {r['causal']} | "
                         f"{r['block_m']}x{r['block_n']}, {r['num_warps']}, {r['num_stages']} | "
                         f"{r['registers']} | {r['spill_bytes']} |")
    return "\n".join(lines) + "\n"


def write_report(rows: list[dict], meta: dict, out: Path) -> None:
    """kernel_aot.json (the rows), kernel_aot.meta.json (provenance) and kernel_aot.md under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernel_aot.json").write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    (out / "kernel_aot.meta.json").write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    (out / "kernel_aot.md").write_text(summary_markdown(rows, meta), encoding="utf-8")


# ----------------------------------------------------------------------------- resuming and the CLI


def config_key(spec: dict) -> tuple:
    """The configuration part of a row or spec (what identifies it): the first ten of ROW_KEYS."""
    return tuple(spec.get(k) for k in ROW_KEYS[:10])


def _load_partial(path: Path, stamp: dict) -> dict[tuple, dict]:
    """Rows already compiled by an interrupted run with the same Triton and kernel source."""
    if not path.exists():
        return {}
    lines = path.read_text(encoding="utf-8").splitlines()
    if not lines or json.loads(lines[0]) != stamp:
        return {}
    rows = [json.loads(line) for line in lines[1:] if line.strip()]
    return {config_key(row): row for row in rows}


def run_report(targets=REPORT_TARGETS, dtypes=DTYPES, out: Path = RESULTS_DIR,
               jobs: int | None = None) -> list[dict]:
    """Compile every spec of report_specs (skipping those a previous interrupted run finished),
    print progress on stderr, and write the report under `out`."""
    specs = report_specs(targets=targets, dtypes=dtypes)
    stamp = {"triton": metadata.version("triton"), "kernels": _source_hash()}
    partial = Path(out) / "kernel_aot.partial.jsonl"
    done = _load_partial(partial, stamp)
    todo = [s for s in specs if config_key(s) not in done]
    Path(out).mkdir(parents=True, exist_ok=True)
    if not done:
        partial.write_text(json.dumps(stamp) + "\n", encoding="utf-8")
    meta = provenance()  # before compiling: the commit and kernels the workers import now
    print(f"kernel report: {len(specs)} configurations, {len(specs) - len(todo)} from an earlier run, "
          f"{len(todo)} to compile with {jobs or os.cpu_count()} workers", file=sys.stderr)
    start = time.time()
    count = 0

    def progress(row):
        nonlocal count
        count += 1
        with partial.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        print(f"[{count}/{len(todo)} {time.time() - start:5.0f} s] {row['kernel']} {row['target']} {row['dtype']} "
              f"d={row['head_dim']} causal={row['causal']} {row['block_m']}x{row['block_n']} w{row['num_warps']} "
              f"s{row['num_stages']}: {row['registers']} registers, {row['spill_bytes']} bytes spilled",
              file=sys.stderr)

    for row in compile_rows(todo, jobs=jobs, on_row=progress):
        done[config_key(row)] = row
    rows = [done[config_key(s)] for s in specs]
    meta = {**meta, "seconds": round(time.time() - start), "rows": len(rows)}
    write_report(rows, meta, Path(out))
    partial.unlink()
    print(f"kernel report: {len(rows)} rows, {len(spilling(rows))} spill; wrote {Path(out) / 'kernel_aot.md'} "
          f"in {time.time() - start:.0f} s", file=sys.stderr)
    return rows


def main(argv: list[str] | None = None) -> int:
    """The CLI (module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m helpers.tools.kernel_report", description=__doc__.split("\n\n")[0])
    parser.add_argument("--fast", action="store_true", help="fp16 only (bf16 compiles the same tiles)")
    parser.add_argument("--targets", default=",".join(REPORT_TARGETS), help=f"comma-separated, of {sorted(TARGETS)}")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help=f"comma-separated, of {','.join(TORCH_DTYPES)}")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--jobs", type=int, default=os.cpu_count(), help="compiles at once (default: all cores)")
    args = parser.parse_args(argv)
    targets = tuple(t for t in args.targets.split(",") if t)
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        parser.error(f"unknown target(s) {unknown}; use {sorted(TARGETS)}")
    dtypes = ("fp16",) if args.fast else tuple(d for d in args.dtypes.split(",") if d)
    unknown = [d for d in dtypes if d not in TORCH_DTYPES]
    if unknown:
        parser.error(f"unknown dtype(s) {unknown}; use {list(TORCH_DTYPES)}")
    _init_worker()  # the parent decorates for the GPU too (it compiles itself with --jobs 1)
    run_report(targets=targets, dtypes=dtypes, out=args.out, jobs=args.jobs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
