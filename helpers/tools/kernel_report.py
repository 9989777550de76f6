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
        [--kernels flash|decode|all] [--suffix _triton36]

Notebook 12's decode kernels (helpers/nb12_triton_decode.py: the split kernel on each score path,
writing partials or the output, and the merge) go into their own files,
``kernel_aot_decode.json/.md/.meta.json``, whose rows have the keys of :data:`DECODE_ROW_KEYS`,
``programs_per_sm`` among them (what the registers and shared memory let one SM hold at once).
``--kernels flash`` or ``--kernels decode`` writes one report; the default, ``all``, both.
``--suffix _triton36`` adds to the files' names (``kernel_aot_triton36.json``, ...): the reports
of another Triton, e.g. the GPU machines' Triton 3.6 run from a venv that has it
(helpers/results/README.md). The Triton internals used here differ between versions; where they
do, a shim says which (``_reg_alloc_flags``, ``_ptxas_version``).

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
import functools
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

# kind -> kernel function; "bwd", the fused backward, is the dK/dV kernel compiled with FUSED_DQ=True
KERNELS = {"fwd": "_attn_fwd", "dkdv": "_attn_bwd_dkdv", "dq": "_attn_bwd_dq", "bwd": "_attn_bwd_dkdv"}
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
        elif name == "DQ_ACC":  # the fused backward's fp32 dQ accumulator
            args.append(MockTensor(torch.float32, shape))
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


@functools.cache  # read once a process: Triton's source does not change under it
def _reg_alloc_flags() -> tuple[str, ...]:
    """``--regAllocOptLevel=2`` where this Triton's ``CUDABackend.make_cubin`` passes it to ptxas:
    Triton 3.9 does (around a ptxas 13 bug), Triton 3.6 does not; read from make_cubin's source."""
    import inspect

    from triton.backends.nvidia.compiler import CUDABackend

    return ("--regAllocOptLevel=2",) if "--regAllocOptLevel=2" in inspect.getsource(CUDABackend.make_cubin) else ()


def ptxas_command(capability: int, options, ptx_path: str, out_path: str) -> list[str]:
    """ptxas's command line as ``CUDABackend.make_cubin`` builds it (Triton 3.9; Triton 3.6's lacks
    --regAllocOptLevel=2, see _reg_alloc_flags), with -v."""
    from triton import knobs
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    if knobs.compilation.disable_line_info:
        debug_info = ["-lineinfo", "-suppress-debug-info"]
    else:
        debug_info = ["-g"] if knobs.nvidia.disable_ptxas_opt else ["-lineinfo"]
    fmad = [] if options.enable_fp_fusion else ["--fmad=false"]
    extra = options.ptx_options.split(" ") if options.ptx_options else []
    return [get_ptxas(capability).path, *debug_info, *fmad, "-v", *_reg_alloc_flags(), *extra,
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
    if "FUSED_DQ" in fn.arg_names:
        constexprs["FUSED_DQ"] = kernel == "bwd"
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


def compile_rows(specs: list[dict], jobs: int | None = None, on_row=None, worker=None) -> list[dict]:
    """compile_row for each spec (dicts of its arguments), `jobs` at a time (default: all cores), in
    the specs' order; ``on_row(row)`` is called as each one finishes. ``worker``: the function that
    compiles one spec (default _compile_row; _compile_decode_row for the decode kernels)."""
    worker = worker or _compile_row
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(specs) or 1))
    if jobs == 1 and _compiles_here():
        rows = []
        for spec in specs:
            rows.append(worker(spec))
            if on_row:
                on_row(rows[-1])
        return rows
    with _pool(jobs) as pool:
        futures = {pool.submit(worker, spec): i for i, spec in enumerate(specs)}
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


def _ptxas_version(targets=REPORT_TARGETS) -> str:
    """The release line of the ptxas that assembles `targets`, e.g. 'Cuda compilation tools, release
    12.9, V12.9.86', or 'sm_80: ...; sm_90: ...' when they differ. Asked of ``get_ptxas(capability)``
    as make_cubin does: Triton 3.9 assembles sm_90 with its wheel's ptxas-blackwell and older targets
    with ptxas; Triton 3.6 uses ptxas below sm_100."""
    from triton.backends.nvidia.compiler import get_ptxas

    lines = {}
    for target in targets:
        try:
            out = subprocess.run([get_ptxas(TARGETS[target]).path, "--version"], capture_output=True, text=True).stdout
        except (OSError, RuntimeError):
            out = "unknown"
        lines[target] = next((line for line in out.splitlines() if "release" in line), out.strip())
    if len(set(lines.values())) == 1:
        return next(iter(lines.values()))
    return "; ".join(f"{target}: {line}" for target, line in lines.items())


def provenance(targets=REPORT_TARGETS) -> dict:
    """Where and from what the report was compiled: machine, Triton, ptxas (of `targets`), commit,
    kernel source."""
    from helpers.runtime import machine_name

    dirty = bool(_git("status", "--porcelain", "--", str(KERNEL_SOURCE.relative_to(ROOT))))
    return {
        "machine": machine_name(),
        "triton": metadata.version("triton"),
        "ptxas": _ptxas_version(targets),
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
    meta = provenance(targets)  # before compiling: the commit and kernels the workers import now
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


# ----------------------------------------------------------------------------- the decode kernels (notebook 12)

# helpers/nb12_triton_decode.py's two kernels, in their own report (kernel_aot_decode.*), compiled at
# the shapes bench/bench_decode.py times: H = 32 query heads, pages of 16 tokens, T = 65,536 cached
# tokens, H_kv = 8 (GQA, 4 query heads per kv head) or 32 (MHA, 1).
DECODE_SOURCE = ROOT / "helpers" / "nb12_triton_decode.py"
DECODE_KERNELS = {"split": "_paged_decode_split", "merge": "_merge_splits"}
DECODE_SHAPE = {"H": 32, "PAGE": 16, "T": 65536}
DECODE_GROUPS = {4: 8, 1: 32}  # GQA group (query heads per kv head) -> H_kv
# How the split kernel writes, and the batch the bench launches it with: several splits per
# sequence at B = 1 (float32 partials, then the merge), or one split at B = 32 (q's dtype, no merge).
DECODE_OUTPUTS = {"partials": 1, "direct": 32}
DECODE_SMS = 132  # the split count of the partials rows: default_n_splits on an H100 / H200
DECODE_ROW_KEYS = ("kernel", "target", "path", "out", "dtype", "head_dim", "group", "n_splits", "block_n",
                   "num_warps", "num_stages", "registers", "spill_bytes", "mma", "loads", "shared_bytes",
                   "programs_per_sm")
DECODE_CONFIG_KEYS = DECODE_ROW_KEYS[:11]  # what identifies a row; the rest is what the compile gave

# What one SM holds, per compute capability: registers, threads, resident blocks, shared memory, and
# the shared memory the driver reserves per block (CUDA C++ Programming Guide, "Compute Capabilities",
# "Technical Specifications per Compute Capability"); registers are allocated per warp, 256 at a time.
SM_LIMITS = {
    "sm_75": dict(registers=65536, threads=1024, blocks=16, shared=64 * 1024, reserved=0),
    "sm_80": dict(registers=65536, threads=2048, blocks=32, shared=164 * 1024, reserved=1024),
    "sm_89": dict(registers=65536, threads=1536, blocks=24, shared=100 * 1024, reserved=1024),
    "sm_90": dict(registers=65536, threads=2048, blocks=32, shared=228 * 1024, reserved=1024),
}


def programs_per_sm(target: str, registers: int, num_warps: int, shared_bytes: int) -> int:
    """Programs (thread blocks) of this kernel one SM of `target` runs at once: the least of what its
    registers, threads, block slots and shared memory allow (the occupancy calculator's count)."""
    limits = SM_LIMITS[target]
    per_warp = math.ceil(max(registers, 1) * 32 / 256) * 256
    by_registers = limits["registers"] // (per_warp * num_warps)
    by_threads = limits["threads"] // (32 * num_warps)
    by_shared = limits["shared"] // (shared_bytes + limits["reserved"]) if shared_bytes else limits["blocks"]
    return min(by_registers, by_threads, limits["blocks"], by_shared)


def _decode():
    """helpers.nb12_triton_decode (imports Triton, in whatever mode this process chose)."""
    from helpers import nb12_triton_decode

    return nb12_triton_decode


def decode_paths(group: int) -> tuple[str, ...]:
    """The split kernel's score paths compiled for a GQA group: the tensor-core product ("dot", what
    a launch takes from DOT_MIN_GROUP heads up), and for one or two heads also the broadcast product
    ("broadcast", what a launch takes below DOT_MIN_GROUP; the kernel's comment: for one or two heads)."""
    paths = ("dot",) if group >= _decode().DOT_MIN_GROUP else ()
    return paths + (("broadcast",) if group <= 2 else ())


def decode_n_splits(out: str, group: int) -> int:
    """The split count of the bench's launch: default_n_splits at B = 1, T = 65,536 on DECODE_SMS SMs
    for the partials rows (at least 2: those rows are the merge's input), 1 for the direct ones."""
    if out == "direct":
        return 1
    batch, T = DECODE_OUTPUTS[out], DECODE_SHAPE["T"]
    return max(2, _decode().default_n_splits(batch, DECODE_GROUPS[group], T, DECODE_SMS))


def decode_report_specs(targets=REPORT_TARGETS, dtypes=DTYPES) -> list[dict]:
    """Every configuration the decode report compiles, as compile_decode_row's kwargs: the split
    kernel on each path of decode_paths, writing partials and writing the output directly, with
    each config of its autotuner (GPU_CONFIGS), for the groups of DECODE_GROUPS; the merge kernel
    (not autotuned: Triton's default warps and stages) for 2, 4, ..., MAX_SPLITS splits."""
    td = _decode()
    specs = []
    for target in targets:
        for dtype in dtypes:
            for head_dim in HEAD_DIMS:
                for group in DECODE_GROUPS:
                    for path in decode_paths(group):
                        for out in DECODE_OUTPUTS:
                            for block_n, warps, stages in td.GPU_CONFIGS[path]:
                                specs.append(dict(kernel="split", target=target, path=path, out=out, dtype=dtype,
                                                  head_dim=head_dim, group=group, n_splits=decode_n_splits(out, group),
                                                  block_n=block_n, num_warps=warps, num_stages=stages))
                warps, stages = _default_launch_options()
                n_splits = 2
                while n_splits <= td.MAX_SPLITS:
                    specs.append(dict(kernel="merge", target=target, path="merge", out=dtype, dtype=dtype,
                                      head_dim=head_dim, group=None, n_splits=n_splits, block_n=None,
                                      num_warps=warps, num_stages=stages))
                    n_splits *= 2
    return specs


def _default_launch_options() -> tuple[int, int]:
    """(num_warps, num_stages) of a launch that names neither: the NVIDIA backend's defaults."""
    from triton.backends.nvidia.compiler import CUDAOptions

    return CUDAOptions.num_warps, CUDAOptions.num_stages


def _contiguous_strides(shape: list[int]) -> list[int]:
    """Strides of a contiguous tensor of this shape (torch's)."""
    strides = [1]
    for size in reversed(shape[1:]):
        strides.insert(0, strides[0] * size)
    return strides


def decode_launch_arguments(fn, spec: dict) -> list:
    """Stand-ins for the non-constexpr arguments of a decode kernel, as paged_decode_triton passes
    them at the bench's shape (DECODE_SHAPE, spec's group and n_splits, B from DECODE_OUTPUTS):
    MockTensors for pointers, the contiguous tensors' strides (stride_<letter><dim>: the tensor by
    its letter, its dims in order), the scale and the sizes."""
    import torch
    from triton.runtime.jit import MockTensor

    H, page, T, d, n = DECODE_SHAPE["H"], DECODE_SHAPE["PAGE"], DECODE_SHAPE["T"], spec["head_dim"], spec["n_splits"]
    group = spec["group"] or 1
    B, H_kv = DECODE_OUTPUTS["direct" if n == 1 else "partials"], H // group
    dtype, f32 = _torch_dtype(spec["dtype"]), torch.float32
    tensors = {"Q": (dtype, [B, H, d]), "K": (dtype, [B * T // page, page, H_kv, d]),
               "V": (dtype, [B * T // page, page, H_kv, d]), "BlockTables": (torch.int32, [B, T // page]),
               "SeqLens": (torch.int32, [B]), "PartOut": (f32 if n > 1 else dtype, [n, B, H, d]),
               "PartLse": (f32, [n, B, H]), "Out": (dtype, [B, H, d])}
    letters = ({"q": "Q", "k": "K", "v": "V", "t": "BlockTables", "o": "PartOut", "l": "PartLse"}
               if spec["kernel"] == "split" else {"p": "PartOut", "l": "PartLse", "o": "Out"})
    ints = {"H": H, "H_KV": H_kv, "GROUP": group, "N_SPLITS": n,
            "CHUNK_BUCKET": min(8192, 1 << max(0, math.ceil(T / n) - 1).bit_length())}  # as _launch_split
    seen = {letter: 0 for letter in letters}
    args = []
    for p in fn.params:
        name = p.name
        if p.is_constexpr:
            continue
        if name in tensors:
            args.append(MockTensor(*tensors[name]))
        elif name == "qk_scale":
            args.append(1.4426950408889634 / math.sqrt(d))
        elif name.startswith("stride_") and name[7] in letters:
            shape = tensors[letters[name[7]]][1]
            args.append(_contiguous_strides(shape)[seen[name[7]]])
            seen[name[7]] += 1
        elif name in ints:
            args.append(ints[name])
        else:
            raise ValueError(f"{fn.__name__}: no stand-in for argument {name!r}; add one to decode_launch_arguments")
    return args


def decode_constexprs(spec: dict) -> dict:
    """The constexprs (and launch options) paged_decode_triton gives the kernel of `spec`."""
    td = _decode()
    if spec["kernel"] == "merge":
        return dict(HEAD_DIM=spec["head_dim"], SPLITS_PAD=spec["n_splits"])  # n_splits: a power of 2
    use_dot = spec["path"] == "dot"
    return dict(HEAD_DIM=spec["head_dim"], PAGE_SIZE=DECODE_SHAPE["PAGE"], GROUP_PAD=td._group_pad(spec["group"], use_dot),
                USE_DOT=use_dot, DOT_PRECISION=td._dot_precision(_torch_dtype(spec["dtype"])),
                BLOCK_N=spec["block_n"], num_warps=spec["num_warps"], num_stages=spec["num_stages"])


def compile_decode_kernel(spec: dict):
    """(CompiledKernel, ptxas -v log, options) of one decode configuration, specialised as on the GPU."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    td = _decode()
    if td._INTERPRET:
        raise RuntimeError("helpers.nb12_triton_decode runs in Triton's interpreter here: set TRITON_INTERPRET=0 "
                           "before importing helpers (or call compile_decode_rows, which compiles in fresh processes)")
    fn = getattr(td, DECODE_KERNELS[spec["kernel"]])
    capability = TARGETS[spec["target"]]
    gpu = GPUTarget("cuda", capability, 32)
    signature, consts, attrs, options = specialise(fn, gpu, decode_launch_arguments(fn, spec), decode_constexprs(spec))
    log = io.StringIO()
    knobs.nvidia.dump_ptxas_log = True
    with contextlib.redirect_stdout(log):
        compiled = triton.compile(ASTSource(fn, signature, consts, attrs), target=gpu, options=options.__dict__)
    ptxas_log = log.getvalue()
    if "Used" not in ptxas_log:  # from Triton's cache
        ptxas_log = run_ptxas(compiled.asm["ptx"], capability, options)
    return compiled, ptxas_log, options


def _compile_decode_row(spec: dict) -> dict:
    """compile_decode_row's work, in a process that compiles for the GPU."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    compiled, ptxas_log, options = compile_decode_kernel(spec)
    usage = parse_ptxas(ptxas_log, entry=DECODE_KERNELS[spec["kernel"]])
    ptx, shared = compiled.asm["ptx"], int(compiled.metadata.shared)
    warps = options.num_warps
    return {**spec, "registers": usage["registers"],
            "spill_bytes": usage["spill_stores"], "mma": mma_kind(ptx), "loads": load_kind(ptx),
            "shared_bytes": shared,
            "programs_per_sm": programs_per_sm(spec["target"], usage["registers"], warps, shared)}


def compile_decode_rows(specs: list[dict], jobs: int | None = None, on_row=None) -> list[dict]:
    """_compile_decode_row for each spec, `jobs` at a time, in spawned workers (or here, one at a
    time, when this process compiles for the GPU); ``on_row(row)`` as each one finishes."""
    return compile_rows(specs, jobs=jobs, on_row=on_row, worker=_compile_decode_row)


def decode_config_key(spec: dict) -> tuple:
    """The configuration part of a decode row or spec (DECODE_CONFIG_KEYS)."""
    return tuple(spec.get(k) for k in DECODE_CONFIG_KEYS)


def _decode_source_hash() -> str:
    """sha256 (12 hex digits) of helpers/nb12_triton_decode.py."""
    return hashlib.sha256(DECODE_SOURCE.read_bytes()).hexdigest()[:12]


def decode_provenance(targets=REPORT_TARGETS) -> dict:
    """provenance() for the decode report: its kernels' source and the bench's shapes."""
    dirty = bool(_git("status", "--porcelain", "--", str(DECODE_SOURCE.relative_to(ROOT))))
    commit = _git("rev-parse", "--short", "HEAD") + (" + uncommitted changes to the kernels" if dirty else "")
    shape = (f"H={DECODE_SHAPE['H']}, H_kv={' or '.join(map(str, DECODE_GROUPS.values()))}, "
             f"T={DECODE_SHAPE['T']}, pages of {DECODE_SHAPE['PAGE']}; partials: B={DECODE_OUTPUTS['partials']}, "
             f"default split count for {DECODE_SMS} SMs; direct: B={DECODE_OUTPUTS['direct']}, one split")
    return {**provenance(targets), "commit": commit, "kernel_source_sha256": _decode_source_hash(), "shape": shape}


def decode_summary_markdown(rows: list[dict], meta: dict) -> str:
    """The decode report in markdown: per (kernel, target, path, out, d, group) the configs, their
    registers, spills, shared memory and programs per SM, then every spilling row."""
    lines = [
        "# Registers and spills of the decode kernels, compiled ahead of time",
        "",
        f"helpers/nb12_triton_decode.py's split kernel (every config its autotuner can choose, on each "
        f"score path, writing float32 partials or the output directly) and merge kernel, at {meta['shape']}, "
        f"compiled on {meta['machine']} with Triton {meta['triton']} ({meta['ptxas']}), commit {meta['commit']}, "
        f"kernels sha256 {meta['kernel_source_sha256']}, {meta['date']}. No GPU ran: registers and spills are "
        "ptxas -v's for the named architecture; programs per SM is what those registers and that shared "
        "memory allow (the occupancy calculator's count). `make kernel-report` writes this file "
        "(`--suffix` names another Triton's: helpers/results/README.md).",
        "",
        "| kernel | target | path | out | d | group | n_splits | configs | registers | spilling | max shared (KiB) "
        "| programs per SM | mma | loads |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        out = "q's dtype" if row["kernel"] == "merge" else row["out"]
        key = (row["kernel"], row["target"], row["path"], out, row["head_dim"], row["group"],
               row["n_splits"] if row["kernel"] == "split" else "2-128")
        groups.setdefault(key, []).append(row)
    span = lambda values: f"{min(values)}-{max(values)}" if min(values) != max(values) else f"{min(values)}"  # noqa: E731
    for (kernel, target, path, out, d, group, n), group_rows in groups.items():
        lines.append(
            f"| {kernel} | {target} | {path} | {out} | {d} | {group if group is not None else '-'} | {n} | "
            f"{len(group_rows)} | {span([r['registers'] for r in group_rows])} | {len(spilling(group_rows))} | "
            f"{max(r['shared_bytes'] for r in group_rows) / 1024:.0f} | "
            f"{span([r['programs_per_sm'] for r in group_rows])} | "
            f"{'/'.join(sorted({r['mma'] for r in group_rows}))} | {'/'.join(sorted({r['loads'] for r in group_rows}))} |")
    dtypes = ", ".join(sorted({row["dtype"] for row in rows}))
    lines += ["", f"Configurations are counted over dtypes ({dtypes}).", ""]
    if spills := spilling(rows):
        lines += ["## Spilling configurations", "",
                  "| kernel | target | path | out | dtype | d | group | n_splits | BLOCK_N, warps, stages | registers "
                  "| spill bytes |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['kernel']} | {r['target']} | {r['path']} | {r['out']} | {r['dtype']} | {r['head_dim']} | "
                  f"{r['group']} | {r['n_splits']} | {r['block_n']}, {r['num_warps']}, {r['num_stages']} | "
                  f"{r['registers']} | {r['spill_bytes']} |" for r in spills]
    return "\n".join(lines) + "\n"


def write_decode_report(rows: list[dict], meta: dict, out: Path, name: str = "kernel_aot_decode") -> None:
    """<name>.json (the rows), <name>.meta.json (provenance) and <name>.md under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    (out / f"{name}.meta.json").write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    (out / f"{name}.md").write_text(decode_summary_markdown(rows, meta), encoding="utf-8")


def run_decode_report(targets=REPORT_TARGETS, dtypes=DTYPES, out: Path = RESULTS_DIR,
                      jobs: int | None = None) -> list[dict]:
    """Compile every spec of decode_report_specs (resuming an interrupted run from
    <out>/kernel_aot_decode.partial.jsonl), print progress on stderr, write the decode report."""
    specs = decode_report_specs(targets=targets, dtypes=dtypes)
    stamp = {"triton": metadata.version("triton"), "kernels": _decode_source_hash()}
    partial = Path(out) / "kernel_aot_decode.partial.jsonl"
    lines = partial.read_text(encoding="utf-8").splitlines() if partial.exists() else []
    done = ({decode_config_key(json.loads(line)): json.loads(line) for line in lines[1:] if line.strip()}
            if lines and json.loads(lines[0]) == stamp else {})
    todo = [s for s in specs if decode_config_key(s) not in done]
    Path(out).mkdir(parents=True, exist_ok=True)
    if not done:
        partial.write_text(json.dumps(stamp) + "\n", encoding="utf-8")
    meta = decode_provenance(targets)
    print(f"decode kernel report: {len(specs)} configurations, {len(specs) - len(todo)} from an earlier run, "
          f"{len(todo)} to compile with {jobs or os.cpu_count()} workers", file=sys.stderr)
    start = time.time()

    def progress(row):
        with partial.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        print(f"[{time.time() - start:5.0f} s] {row['kernel']} {row['target']} {row['path']} {row['out']} "
              f"{row['dtype']} d={row['head_dim']} group={row['group']} n_splits={row['n_splits']} "
              f"BLOCK_N={row['block_n']} w{row['num_warps']} s{row['num_stages']}: {row['registers']} registers, "
              f"{row['spill_bytes']} bytes spilled", file=sys.stderr)

    for row in compile_decode_rows(todo, jobs=jobs, on_row=progress):
        done[decode_config_key(row)] = row
    rows = [done[decode_config_key(s)] for s in specs]
    write_decode_report(rows, {**meta, "seconds": round(time.time() - start), "rows": len(rows)}, Path(out))
    partial.unlink()
    print(f"decode kernel report: {len(rows)} rows, {len(spilling(rows))} spill; wrote "
          f"{Path(out) / 'kernel_aot_decode.md'} in {time.time() - start:.0f} s", file=sys.stderr)
    return rows


def main(argv: list[str] | None = None) -> int:
    """The CLI (module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m helpers.tools.kernel_report", description=__doc__.split("\n\n")[0])
    parser.add_argument("--fast", action="store_true", help="fp16 only (bf16 compiles the same tiles)")
    parser.add_argument("--targets", default=",".join(REPORT_TARGETS), help=f"comma-separated, of {sorted(TARGETS)}")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help=f"comma-separated, of {','.join(TORCH_DTYPES)}")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--jobs", type=int, default=os.cpu_count(), help="compiles at once (default: all cores)")
    parser.add_argument("--kernels", choices=("flash", "decode", "all"), default="all",
                        help="flash: notebook 09's kernels (kernel_aot.*); decode: notebook 12's "
                             "(kernel_aot_decode.*); all (default): both")
    parser.add_argument("--suffix", default="", help="added to the files' names: --suffix _triton36 writes "
                        "kernel_aot_triton36.json (kernel_aot_decode_triton36.json, ...)")
    args = parser.parse_args(argv)
    if not re.fullmatch(r"[A-Za-z0-9_-]*", args.suffix):
        parser.error(f"--suffix {args.suffix!r}: use letters, digits, _ and - only")
    targets = tuple(t for t in args.targets.split(",") if t)
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        parser.error(f"unknown target(s) {unknown}; use {sorted(TARGETS)}")
    dtypes = ("fp16",) if args.fast else tuple(d for d in args.dtypes.split(",") if d)
    unknown = [d for d in dtypes if d not in TORCH_DTYPES]
    if unknown:
        parser.error(f"unknown dtype(s) {unknown}; use {list(TORCH_DTYPES)}")
    _init_worker()  # the parent decorates for the GPU too (it compiles itself with --jobs 1)
    out = args.out / f".kernel_report{args.suffix}" if args.suffix else args.out  # resumable there
    if args.kernels in ("flash", "all"):
        run_report(targets=targets, dtypes=dtypes, out=out, jobs=args.jobs)
    if args.kernels in ("decode", "all"):
        run_decode_report(targets=targets, dtypes=dtypes, out=out, jobs=args.jobs)
    if args.suffix:
        _move_with_suffix(out, args.out, args.suffix)
    return 0


def _move_with_suffix(work: Path, out: Path, suffix: str) -> None:
    """Move the reports written under `work` to `out`, `suffix` added before the extension
    (kernel_aot.meta.json -> kernel_aot<suffix>.meta.json), and remove `work`."""
    for path in sorted(work.glob("kernel_aot*")):
        base, ext = path.name.split(".", 1)
        path.replace(out / f"{base}{suffix}.{ext}")
    work.rmdir()


if __name__ == "__main__":
    sys.exit(main())
