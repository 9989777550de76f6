"""Decode-step benchmark: the course's split-KV kernel over a paged cache
(helpers/nb12_triton_decode.py) against SDPA on a contiguous cache of the same sequences. Run
through ``bench/bench_attention.py`` (``make bench``; ``--decode-only`` for these rows alone).

One decode step: q ``[B, H, 1, d]`` (one new token per sequence), every sequence ``T`` cached
tokens, fp16, d = 128, H = 32 query heads, H_kv = 8 (GQA) or 32 (MHA). Implementations:

* ``course``: ``paged_decode_triton`` with the default split count (``default_n_splits``), pages of
  ``PAGE`` tokens in shuffled order, ``check_values=False`` (no host sync, as a serving loop
  runs it);
* ``course-1split``: the same kernel with ``n_splits=1`` (one program per sequence and kv head,
  like notebook 09's kernel): what the split buys;
* ``sdpa-flash`` / ``sdpa-cudnn`` / ``sdpa-efficient`` / ``sdpa-math``:
  ``scaled_dot_product_attention(q, k, v, enable_gqa=True)`` on ``[B, H_kv, T, d]`` caches, forced
  onto one backend with ``torch.nn.attention.sdpa_kernel`` (a backend that refuses the shape is
  ``unsupported``, with torch's reason);
* ``sdpa-default``: the same call left to torch's choice; ``backend`` records the choice
  (``torch._fused_sdp_choice``) and ``kernels`` the GPU kernels one step launched (torch.profiler),
  for every SDPA row, so that the default can be named.

Four times per cell, in µs per step, each a median:

* ``us``: ``triton.testing.do_bench``: each step launched from Python after the L2 cache is
  cleared (the clear's own GPU time hides part of the launch overhead);
* ``us_eager``: steps launched back to back from Python, no sync between them, L2 not cleared:
  what a serving loop without CUDA graphs gets (launch overhead counts in full wherever the host
  takes longer to launch a step than the GPU takes to run it);
* ``us_graph``: ``do_bench_cudagraph``: replayed from a CUDA graph (no launch overhead), L2 not
  cleared, so a cache smaller than L2 is read from L2;
* ``us_graph_cold``: one step captured in a CUDA graph, replayed by ``do_bench`` (L2 cleared
  before each replay): the GPU's time reading the cache from memory, without launch overhead.

``us_eager`` against ``us_graph`` is the launch overhead alone; ``us_graph_cold`` against
``us_graph`` the L2 cache alone. Bandwidth is the K and V bytes one step must read,
``2 * B * T * H_kv * d * 2``, over ``us``, in GB/s (1e9 bytes). A shape whose caches (contiguous
and paged) do not fit in free memory is skipped. Before timing, the kernel is checked against
SDPA on ragged, poisoned caches, and every implementation runs once untimed (a warm-up: the first
timed cell is no outlier). Every cell is then timed in ``repeats`` passes over the whole grid
(default 3): each time is the median of the passes, ``<time>_spread`` their spread,
(max - min) / median in %, and the tables flag a spread over 5%. The summary checks the goal:
under CUDA graphs, the faster course kernel at >= 0.95x sdpa-default's speed in every cell.
Without CUDA, ``measure_shape(..., device="cpu")`` runs the same rows on the CPU (the course
kernel in Triton's interpreter): ``us_eager`` by the wall clock, the SDPA choice and the profiled
op names, no GPU columns; the tests use it.

The pieces bench/bench_attention.py shares are here too: :func:`summarize` and :func:`aggregate`
(the repeats), :func:`sdpa_choice` (the backend SDPA's default path takes), :func:`gpu_state`
(clocks, power, temperature), :func:`flag`, :func:`graph_rep` and :func:`command_output`.
"""

from __future__ import annotations

import csv
import datetime
import gc
import re
import statistics
import subprocess
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from helpers.checks.nb12_triton_decode import paged_case

try:
    from helpers import nb12_triton_decode as td
except ImportError:  # no Triton on this platform
    td = None

HEADS, HEAD_DIM, PAGE = 32, 128, 16
KV_HEADS = (8, 32)
CONTEXTS = (1024, 4096, 16384, 65536)
BATCHES = (1, 8, 32)
# name -> the SDPA backend it is forced onto (SDPBackend's attribute); sdpa-default: torch's choice
SDPA_FORCED = {"sdpa-flash": "FLASH_ATTENTION", "sdpa-cudnn": "CUDNN_ATTENTION",
               "sdpa-efficient": "EFFICIENT_ATTENTION", "sdpa-math": "MATH"}
IMPLS = ("course", "course-1split", *SDPA_FORCED, "sdpa-default")
COURSE = ("course", "course-1split")
TIMES = ("us", "us_eager", "us_graph", "us_graph_cold")
KEY = ("impl", "B", "T", "H_kv")
FIELDS = ["gpu", "driver", "torch", "triton", "cuda", "cudnn", "commit", "clocks_before", "clocks_after",
          "impl", "B", "T", "H", "H_kv", "d", "page", "n_splits", *TIMES, "us_min", "us_max", "runs",
          "us_runs", *(f"{t}_spread" for t in TIMES), "gb_per_s", "backend", "kernels", "status"]
GOAL = 0.95  # under CUDA graphs, the faster course kernel at >= this times sdpa-default's speed


# --------------------------------------------------------------------------------------------
# Shared with bench/bench_attention.py: repeats, the SDPA default's name, the GPU's state
# --------------------------------------------------------------------------------------------

REPEATS = 3  # passes over the grid (--repeats)
SPREAD_FLAG = 5.0  # %: a cell whose passes spread more is flagged in the tables


def summarize(values) -> dict | None:
    """Per-pass timings (None left out) -> ``{"median", "min", "max", "spread", "runs"}``, spread
    = (max - min) / median in % (None for a single run); None when there is no timing."""
    values = [float(v) for v in values if v is not None]
    if not values:
        return None
    median, low, high = statistics.median(values), min(values), max(values)
    spread = (high - low) / median * 100 if len(values) > 1 and median > 0 else None
    return {"median": median, "min": low, "max": high, "spread": spread, "runs": len(values)}


def aggregate(runs: list[dict], key: tuple[str, ...], timed: tuple[str, ...]) -> list[dict]:
    """Rows of several passes (one per cell and pass, each with ``run``, its pass number) -> one row
    per cell, in the order cells first appear. Each field of ``timed``: the median of the passes
    that have it, and ``<field>_spread``; the first of them also ``<field>_min``, ``<field>_max``,
    ``<field>_runs`` (the passes' values, ';'-joined) and ``runs`` (how many passes timed it).
    The other fields are the first pass's (the once-only measurements); a later pass's status,
    where it is of another kind (the words before its first colon), is appended to it."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault(tuple(r[k] for k in key), []).append(r)
    rows = []
    for group in groups.values():
        row = {k: v for k, v in group[0].items() if k != "run"}
        for i, field in enumerate(timed):
            s = summarize(r.get(field) for r in group)
            row[field], row[f"{field}_spread"] = (s["median"], s["spread"]) if s else (None, None)
            if i == 0:
                row[f"{field}_min"], row[f"{field}_max"] = (s["min"], s["max"]) if s else (None, None)
                row["runs"] = s["runs"] if s else 0
                row[f"{field}_runs"] = ";".join(f"{r[field]:.4g}" for r in group if r.get(field) is not None)
        kind = group[0]["status"].split(":")[0]
        later = [f"run {r.get('run', i + 2)}: {r['status']}" for i, r in enumerate(group[1:])
                 if r["status"].split(":")[0] != kind]
        if later:
            row["status"] = f"{row['status']} ({'; '.join(later)})"
        rows.append(row)
    return rows


def flag(spread: float | None) -> str:
    """' [7%]' after a table's number when its passes spread more than SPREAD_FLAG, else ''."""
    return f" [{spread:.0f}%]" if spread is not None and spread > SPREAD_FLAG else ""


def graph_rep(rep: int) -> int:
    """``do_bench_cudagraph``'s ``rep`` for ``rep`` ms of timing: it replays its graph 10 times,
    each about ``rep`` ms long, so a tenth keeps a cell's graph timing as long as its plain one."""
    return max(1, rep // 10)


def another_pass(now: float, last_pass_s: float, deadline: float | None) -> bool:
    """Whether a pass as long as the last one (and 10% more) still ends by ``deadline`` (a
    ``time.perf_counter()`` value; None: no limit)."""
    return deadline is None or now + 1.1 * last_pass_s <= deadline


def command_output(args: list[str]) -> str:
    """A command's stdout, stripped; '' when it fails, exits non-zero or is missing."""
    try:
        run = subprocess.run(args, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return run.stdout.strip() if run.returncode == 0 else ""


def sdpa_choice(q, k, v, *, enable_gqa: bool = True, is_causal: bool = False) -> str:
    """The backend torch's dispatcher picks for ``scaled_dot_product_attention(q, k, v,
    is_causal=is_causal, enable_gqa=enable_gqa)`` on these tensors (in the caller's grad mode),
    lower case (``flash_attention``, ``cudnn_attention``, ``efficient_attention``, ``math``),
    from ``torch._fused_sdp_choice`` (a private function: ``unknown`` where it is missing or fails)."""
    from torch.nn.attention import SDPBackend

    try:
        return SDPBackend(torch._fused_sdp_choice(q, k, v, is_causal=is_causal,
                                                  enable_gqa=enable_gqa)).name.lower()
    except Exception:  # noqa: BLE001 - a torch without it, or a signature that changed
        return "unknown"


# nvidia-smi's names; a name the driver does not know fails the whole query, so the reasons
# (a newer name) are asked apart
SMI_FIELDS = ("clocks.sm", "clocks.max.sm", "clocks.mem", "clocks.max.mem", "power.draw",
              "power.limit", "temperature.gpu", "pstate")
SMI_REASONS = ("clocks_event_reasons.active",)


def parse_smi(fields: tuple[str, ...], line: str) -> dict:
    """One line of ``nvidia-smi --query-gpu=<fields> --format=csv,noheader,nounits`` -> {field:
    number, or text such as 'P0'}; '[N/A]', 'N/A' and missing values -> None."""
    values = [v.strip() for v in line.split(",")]
    state = {}
    for i, field in enumerate(fields):
        value = values[i] if i < len(values) else ""
        if not value or value.strip("[]") in ("N/A", "Not Supported", "Unknown Error"):
            state[field] = None
            continue
        try:
            state[field] = float(value)
        except ValueError:
            state[field] = value
    return state


def gpu_state() -> dict:
    """The first GPU's clocks (MHz), power (W), temperature (C), performance state and clock
    event reasons now, from nvidia-smi, and what torch reads through NVML (``torch.cuda.clock_rate``
    and the rest; absent without pynvml). Empty where neither answers."""
    state = {}
    for fields in (SMI_FIELDS, SMI_REASONS):
        text = command_output(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"])
        if text:
            state.update(parse_smi(fields, text.splitlines()[0]))
    for name, read, scale in (("torch.clock_rate", "clock_rate", 1), ("torch.temperature", "temperature", 1),
                              ("torch.power_draw", "power_draw", 1e-3)):
        try:
            state[name] = getattr(torch.cuda, read)() * scale
        except Exception:  # noqa: BLE001 - no pynvml, or an older torch
            pass
    return state


def clocks_text(state: dict) -> str:
    """One line of a :func:`gpu_state`: 'SM 1980 of 1980 MHz, memory 3201 of 3201 MHz, 250 of
    700 W, 41 C, P0, reasons 0x0' (what is missing is left out)."""
    s = {k: (f"{v:.0f}" if isinstance(v, float) else v) for k, v in state.items() if v is not None}
    parts = []
    for now, top, what in (("clocks.sm", "clocks.max.sm", "SM {} MHz"), ("clocks.mem", "clocks.max.mem", "memory {} MHz"),
                           ("power.draw", "power.limit", "{} W")):
        if now in s or top in s:
            parts.append(what.format(f"{s.get(now, '?')} of {s.get(top, '?')}"))
    parts += [f"{s['temperature.gpu']} C"] if "temperature.gpu" in s else []
    parts += [s["pstate"]] if "pstate" in s else []
    parts += [f"reasons {s['clocks_event_reasons.active']}"] if "clocks_event_reasons.active" in s else []
    parts += [f"torch: SM {s['torch.clock_rate']} MHz"] if "torch.clock_rate" in s else []
    return ", ".join(parts) or "unknown"


# --------------------------------------------------------------------------------------------
# Correctness
# --------------------------------------------------------------------------------------------

# (B, H, H_kv, d, lens, page, n_splits, dtype): GQA, MQA, MHA, ragged and empty, fp16/bf16/fp32
CHECK_CASES = [
    (3, 8, 2, 64, [37, 16, 1], 8, 3, "float16"),
    (2, 4, 4, 32, [50, 0], 16, 2, "float32"),
    (2, 4, 1, 128, [33, 3], 16, 8, "float32"),
    (2, 32, 8, 128, [5000, 4097], 16, None, "float16"),
    (2, 32, 32, 128, [3000, 1], 16, None, "bfloat16"),
    (4, 32, 8, 128, [0, 700, 1024, 1500], 32, 1, "float16"),
    (1, 16, 16, 64, [9000], 16, 64, "float16"),
]
INTERPRETER_CASES = CHECK_CASES[:3]
TOL = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 1.6e-2}


def _reference(q, k_pages, v_pages, table, lens) -> torch.Tensor:
    ks, vs = td.gather_cache(k_pages, v_pages, table, lens)
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b, (k, v) in enumerate(zip(ks, vs)):
        if k.shape[1]:
            out[b] = F.scaled_dot_product_attention(q[b, :, None].float(), k.float(), v.float(),
                                                    enable_gqa=True)[:, 0]
    return out


def check_decode(cases=CHECK_CASES, device: str = "cuda") -> list[str]:
    """The kernel against SDPA (float32) on each case; returns one line per failure. The caches
    hold NaN wherever a correct kernel never reads, so a stray read fails."""
    failures = []
    for i, (B, H, H_kv, d, lens, page, n_splits, dtype) in enumerate(cases):
        if device == "cpu" and dtype == "bfloat16":
            continue
        c = paged_case(B, H, H_kv, d, lens, page, seed=700 + i, dtype=getattr(torch, dtype))
        args = [c[n].to(device) for n in ("q", "k_pages", "v_pages", "block_tables", "seq_lens")]
        out = td.paged_decode_triton(*args, n_splits=n_splits).float()
        err = (out - _reference(*args)).abs().max().item() if out.numel() else 0.0
        ok = err <= TOL[dtype]  # False for NaN too
        line = (f"decode B={B} H={H} H_kv={H_kv} d={d} lens={lens} page={page} "
                f"n_splits={n_splits} {dtype}: max |err| {err:.1e} (tol {TOL[dtype]:.0e})")
        print(f"  {line} {'OK' if ok else 'FAIL'}", flush=True)
        if not ok:
            failures.append(line)
    return failures


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------


def _caches(B: int, T: int, H_kv: int, gen: torch.Generator, device: str = "cuda"):
    """Contiguous caches [B, H_kv, T, d] and the same tokens in shuffled pages."""
    dtype = torch.float16 if device == "cuda" else torch.float32
    k = torch.randn(B, H_kv, T, HEAD_DIM, device=device, dtype=dtype, generator=gen)
    v = torch.randn(B, H_kv, T, HEAD_DIM, device=device, dtype=dtype, generator=gen)
    n_pages = T // PAGE
    order = torch.randperm(B * n_pages, device=device, generator=gen)
    pages = []
    for x in (k, v):
        paged = torch.empty(B * n_pages, PAGE, H_kv, HEAD_DIM, device=device, dtype=dtype)
        paged[order] = x.view(B, H_kv, n_pages, PAGE, HEAD_DIM).permute(0, 2, 3, 1, 4).reshape(
            B * n_pages, PAGE, H_kv, HEAD_DIM)
        pages.append(paged)
    table = order.view(B, n_pages).int()
    lens = torch.full((B,), T, dtype=torch.int32, device=device)
    return k, v, pages[0], pages[1], table, lens


def _step(impl: str, q, k, v, k_pages, v_pages, table, lens, n_splits):
    """A function of no arguments that runs one decode step of ``impl``."""
    if impl.startswith("course"):
        return lambda: td.paged_decode_triton(q, k_pages, v_pages, table, lens, n_splits=n_splits,
                                              check_values=False)
    q4 = q[:, :, None]
    if impl == "sdpa-default":
        return lambda: F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, SDPA_FORCED[impl])

    def run():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)

    return run


def short_kernel_name(name: str) -> str:
    """A kernel's name without ``void``, template arguments and parameters:
    ``void pytorch_flash::flash_fwd_kernel<Traits, true>(Params)`` -> ``pytorch_flash::flash_fwd_kernel``."""
    name = re.sub(r"^void\s+", "", name.strip())
    return re.split(r"[<(]", name, maxsplit=1)[0].strip()[:100]


def kernel_names(step, device: str = "cuda") -> list[str]:
    """The kernels one call of ``step`` launches on the GPU, in order, each once (torch.profiler;
    empty where the profiler sees no GPU activity). On the CPU: the attention ops it runs
    (``aten::`` names with ``attention`` in them, SDPA's own entry point left out)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    names = []
    for e in prof.events():
        if cuda:
            if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA:
                continue
            if e.name.startswith(("Memcpy", "Memset")):
                continue
        elif "attention" not in e.name or e.name == "aten::scaled_dot_product_attention":
            continue
        name = short_kernel_name(e.name)
        if name not in names:
            names.append(name)
    return names


def eager_us(step, n: int, device: str = "cuda", loops: int = 3) -> float:
    """µs per step of ``n`` steps launched back to back from Python (no sync between them, the L2
    cache not cleared), the median of ``loops`` such runs: launch overhead counts in full wherever
    the host takes longer to launch a step than the GPU takes to run it."""
    step()
    per_step = []
    for _ in range(loops):
        if device == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(n):
                step()
            end.record()
            end.synchronize()
            per_step.append(start.elapsed_time(end) * 1e3 / n)
        else:
            t0 = time.perf_counter()
            for _ in range(n):
                step()
            per_step.append((time.perf_counter() - t0) * 1e6 / n)
    return sorted(per_step)[len(per_step) // 2]


def _graph_us(step, rep: int) -> float | None:
    """µs per step replayed from a CUDA graph (no launch overhead; L2 not cleared), or None;
    about ``rep`` ms of replays (:func:`graph_rep`)."""
    import triton.testing

    try:
        return triton.testing.do_bench_cudagraph(step, rep=graph_rep(rep), return_mode="median") * 1e3
    except Exception:  # noqa: BLE001 - a step that cannot be captured: the column stays empty
        torch.cuda.synchronize()
        return None


def _graph_cold_us(step, rep: int) -> float | None:
    """µs per step of one step captured in a CUDA graph and replayed by ``do_bench``, which clears
    the L2 cache before each replay (the replay's launch, a few µs, runs while the clear does):
    the step's GPU time with its cache read from memory. None when the step cannot be captured."""
    import triton.testing

    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()  # allocations and autotuning happen outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        ms = triton.testing.do_bench(graph.replay, warmup=max(5, rep // 4), rep=rep,
                                     return_mode="median")
        del graph
        return ms * 1e3
    except Exception:  # noqa: BLE001
        torch.cuda.synchronize()
        return None


def refusal(exc: BaseException, caught: list, limit: int = 200) -> str:
    """One line on why a step did not run: the warnings SDPA gave while refusing (its reasons),
    then the exception, at most ``limit`` characters (bench_attention.py's rows take 160)."""
    texts = [str(w.message) for w in caught] + [str(exc)]
    text = " ".join(t.strip().splitlines()[0] for t in texts if t.strip())
    return re.sub(r"\s+", " ", text)[:limit]


def blank_rows(B: int, T: int, H_kv: int, impls, status: str) -> list[dict]:
    """One row per implementation of a shape, nothing measured, with ``status``."""
    return [dict(B=B, T=T, H=HEADS, H_kv=H_kv, d=HEAD_DIM, page=PAGE, impl=i, n_splits=None, gb_per_s=None,
                 backend=None, kernels=None, **dict.fromkeys(TIMES), status=status) for i in impls]


def measure_shape(B: int, T: int, H_kv: int, impls, rep: int, device: str = "cuda",
                  profile: bool = True) -> list[dict]:
    """Every implementation on one (B, T, H_kv): rows of the four times (µs), GB/s, the SDPA
    backend and (``profile``: the first pass) kernels, status. ``device="cpu"``: fp32, the course
    kernel in Triton's interpreter, ``us_eager`` by the wall clock (2 steps), no GPU columns."""
    cuda = device == "cuda"
    kv_bytes = 2 * B * T * H_kv * HEAD_DIM * 2
    if cuda:
        free, _ = torch.cuda.mem_get_info()
        if 2.6 * kv_bytes > 0.9 * free:  # contiguous + paged caches, a page-sized copy in flight
            why = f"skipped: needs ~{2.6 * kv_bytes / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free"
            return blank_rows(B, T, H_kv, impls, why)
    gen = torch.Generator(device=device).manual_seed(B * T + H_kv)
    k, v, k_pages, v_pages, table, lens = _caches(B, T, H_kv, gen, device)
    q = torch.randn(B, HEADS, HEAD_DIM, device=device, dtype=k.dtype, generator=gen)
    sms = td.sm_count(device) if td is not None else None
    rows = []
    for impl in impls:
        n_splits = {"course": None if sms is None else td.default_n_splits(B, H_kv, T, sms),
                    "course-1split": 1}.get(impl)
        (row,) = blank_rows(B, T, H_kv, [impl], "ok")
        row["n_splits"] = n_splits
        step = _step(impl, q, k, v, k_pages, v_pages, table, lens, n_splits)
        caught: list = []
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                step()  # compiles / autotunes, or tells us the backend refuses (and warns why)
            if impl.startswith("sdpa"):
                row["backend"] = (sdpa_choice(q[:, :, None], k, v) if impl == "sdpa-default"
                                  else SDPA_FORCED[impl].lower())
                if profile:
                    row["kernels"] = ";".join(kernel_names(step, device))
            if cuda:
                import triton.testing

                ms = triton.testing.do_bench(step, warmup=max(5, rep // 4), rep=rep,
                                             return_mode="median")
                row.update(us=ms * 1e3, gb_per_s=kv_bytes / (ms * 1e-3) / 1e9)
                n = max(10, min(1000, int(rep * 1e3 / max(row["us"], 5.0))))
                row["us_eager"] = eager_us(step, n, device)
                row["us_graph"] = _graph_us(step, rep)
                row["us_graph_cold"] = _graph_cold_us(step, rep)
            else:
                row["us_eager"] = eager_us(step, 2, device, loops=1)
        except torch.cuda.OutOfMemoryError:
            row["status"] = "OOM"
        except RuntimeError as exc:  # an SDPA backend that refuses this shape
            row["status"] = "unsupported: " + refusal(exc, caught)
        except Exception as exc:  # noqa: BLE001 - any other failure is this row's, not the run's
            row["status"] = f"error: {type(exc).__name__}: " + refusal(exc, [])
        rows.append(row)
    del k, v, k_pages, v_pages, table, lens, q
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return rows


# --------------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------------


def write_csv(rows: list[dict], info: dict, path: Path) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({**info, **{k: (f"{x:.4g}" if isinstance(x, float) else x)
                                   for k, x in r.items()}})


def _gain(t: dict, field: str, B: int, T: int, H_kv: int) -> str:
    """course-1split's time over course's in one column ("" where either is missing)."""
    one, many = t.get(("course-1split", B, T, H_kv)), t.get(("course", B, T, H_kv))
    if one and many and one.get(field) and many.get(field):
        return f"{one[field] / many[field]:.2f}x"
    return ""


MODE_TABLES = (
    ("us_eager", "Launched back to back from Python, µs per step",
     "Steps launched one after another with no sync between them and the L2 cache not cleared: "
     "what a serving loop without CUDA graphs gets. Wherever the host takes longer to launch a "
     "step (a Triton launch, the course's Python checks and allocations) than the GPU takes to "
     "run it, the launch overhead is the time."),
    ("us_graph", "Replayed from a CUDA graph, µs per step",
     "As serving engines run decode steps: no CPU launch overhead; the L2 cache is not cleared "
     "between replays, so a cache smaller than L2 is read from L2 (at B = 1, T = 1024, H_kv = 8 "
     "the K and V of a step are 4 MiB)."),
    ("us_graph_cold", "Replayed from a CUDA graph, L2 cleared before each replay, µs per step",
     "No launch overhead and every byte of the cache read from memory: against the table above, "
     "what the L2 cache did; against the first table, what the launches did."),
)


def _timed(r: dict | None, field: str) -> str:
    """A table's number: ``field`` (µs) with its spread flag, '' where it was not timed."""
    if not r or not r.get(field):
        return ""
    return f"{r[field]:.1f}{flag(r.get(f'{field}_spread'))}"


def goal_checks(rows: list[dict]) -> list[str]:
    """The decode goal, one line per (H_kv, B, T) cell: under CUDA graphs (``us_graph``), the
    faster of course and course-1split at >= GOAL x sdpa-default's speed, naming which; then a
    line counting the cells that pass, fail and were not measured."""
    t = {(r["impl"], r["B"], r["T"], r["H_kv"]): r for r in rows}
    counts = {"PASS": 0, "FAIL": 0, "n/a": 0}
    lines = []
    for H_kv, B, T in sorted({(r["H_kv"], r["B"], r["T"]) for r in rows}):
        what = f"decode H_kv={H_kv} B={B} T={T}, CUDA graphs"
        ref = (t.get(("sdpa-default", B, T, H_kv)) or {}).get("us_graph")
        ours = [(t[(i, B, T, H_kv)]["us_graph"], i) for i in COURSE if (t.get((i, B, T, H_kv)) or {}).get("us_graph")]
        if not ref or not ours:
            counts["n/a"] += 1
            lines.append(f"- n/a: {what} (not measured)")
            continue
        us, impl = min(ours)
        verdict = "PASS" if ref / us >= GOAL else "FAIL"
        counts[verdict] += 1
        lines.append(f"- {verdict}: {what}: {impl} at {ref / us:.2f}x sdpa-default's speed "
                     f"({us:.1f} against {ref:.1f} us; goal >= {GOAL}x)")
    lines.append(f"\n{counts['PASS']} of {sum(counts.values())} cells pass, {counts['FAIL']} fail, "
                 f"{counts['n/a']} not measured.")
    return lines


def _header(info: dict, rows: list[dict]) -> list[str]:
    """The lines under the title: the software, the GPU's clocks, what a cell holds."""
    runs = max((r.get("runs") or 0 for r in rows), default=0)
    clocks = [f"- {when}: {info[key]}" for key, when in (("clocks_before", "before the decode rows"),
                                                        ("clocks_after", "after them")) if info.get(key)]
    return [f"torch {info['torch']} (CUDA {info.get('cuda', '?')}, cuDNN {info.get('cudnn', '?')}), triton "
            f"{info['triton']}, driver {info.get('driver', '?')}, commit {info.get('commit', '?')}, "
            f"{datetime.date.today().isoformat()}. One decode step: H={HEADS}, d={HEAD_DIM}, fp16, "
            f"every sequence T cached tokens; the course kernel reads pages of {PAGE} tokens in "
            "shuffled order, SDPA a contiguous `[B, H_kv, T, d]` cache. Each cell: µs per step "
            "(median of `triton.testing.do_bench`: launched from Python, L2 cleared before each "
            "step) / GB/s of K and V read (2·B·T·H_kv·d·2 bytes). `course` uses the default split "
            "count (n_splits in brackets), `course-1split` one program per (sequence, kv head); "
            "`sdpa-<backend>` is SDPA forced onto one backend, `sdpa-default` torch's own choice "
            "(named in the last section). Generated by `bench/bench_attention.py --decode-only`.",
            ""] + ([f"Every time is the median of {runs} passes over the grid (after one untimed "
                    f"pass of every implementation); [n%] after a number: its passes spread more "
                    f"than {SPREAD_FLAG:.0f}% ((max - min) / median).", ""] if runs > 1 else []) + (
        ["GPU clocks, power and temperature (nvidia-smi):", ""] + clocks + [""] if clocks else [])


def write_markdown(rows: list[dict], info: dict, path: Path) -> None:
    impls = [i for i in IMPLS if any(r["impl"] == i for r in rows)]
    t = {(r["impl"], r["B"], r["T"], r["H_kv"]): r for r in rows}
    shapes = [(H_kv, B, T) for H_kv in sorted({r["H_kv"] for r in rows})
              for B in sorted({r["B"] for r in rows}) for T in sorted({r["T"] for r in rows})]
    out = [f"# Decode-step benchmark: {info['gpu']}", ""] + _header(info, rows)
    for H_kv in sorted({r["H_kv"] for r in rows}):
        kind = "MHA" if H_kv == HEADS else f"GQA, {HEADS // H_kv} per kv head"
        out += [f"## H_kv = {H_kv} ({kind})",
                "", "| B | T | " + " | ".join(impls) + " | split speedup |",
                "|---|---|" + "---|" * (len(impls) + 1)]
        for _, B, T in (s for s in shapes if s[0] == H_kv):
            cells = []
            for i in impls:
                r = t.get((i, B, T, H_kv))
                if r is None or r.get("us") is None:
                    cells.append("" if r is None else r["status"].split(":")[0])
                    continue
                splits = f" [{r['n_splits']}]" if i == "course" else ""
                cells.append(f"{r['us']:.1f} / {r['gb_per_s']:.0f}{splits}{flag(r.get('us_spread'))}")
            out.append(f"| {B} | {T} | " + " | ".join(cells) + f" | {_gain(t, 'us', B, T, H_kv)} |")
        out.append("")
    for field, title, note in MODE_TABLES:
        if not any(r.get(field) for r in rows):
            continue
        out += [f"## {title}", "", note, "",
                "| H_kv | B | T | " + " | ".join(impls) + " | split speedup |",
                "|---|---|---|" + "---|" * (len(impls) + 1)]
        for H_kv, B, T in shapes:
            cells = [_timed(t.get((i, B, T, H_kv)), field) for i in impls]
            out.append(f"| {H_kv} | {B} | {T} | " + " | ".join(cells)
                       + f" | {_gain(t, field, B, T, H_kv)} |")
        out.append("")
    sdpa = [i for i in impls if i.startswith("sdpa")]
    if any(r.get("kernels") is not None for r in rows):
        out += ["## Which kernels SDPA ran", "",
                "`backend`: for `sdpa-default`, the backend torch's dispatcher chose "
                "(`torch._fused_sdp_choice`), for the others the one forced; `kernels`: the GPU "
                "kernels one step launched (torch.profiler), with the shapes (H_kv, B, T) where "
                "each was seen.", "", "| impl | backend | kernels | shapes |", "|---|---|---|---|"]
        for i in sdpa:
            seen: dict[tuple, list] = {}
            for H_kv, B, T in shapes:
                r = t.get((i, B, T, H_kv))
                if r and r.get("kernels") is not None:
                    seen.setdefault((r.get("backend"), r["kernels"]), []).append(f"{H_kv}/{B}/{T}")
            for (backend, kernels), where in seen.items():
                listed = ", ".join(f"`{k}`" for k in kernels.split(";") if k) or "(none seen)"
                shown = "all" if len(where) == len(shapes) else ", ".join(where)
                out.append(f"| {i} | {backend} | {listed} | {shown} |")
        out.append("")
    if any(r.get("us_graph") for r in rows):
        out += ["## Summary: the decode goal", "",
                f"Under CUDA graphs (`us_graph`), the faster course kernel at >= {GOAL}x the speed "
                "of sdpa-default (torch's own choice) in every cell:", ""] + goal_checks(rows) + [""]
    path.write_text("\n".join(out))


def with_bandwidth(rows: list[dict]) -> list[dict]:
    """GB/s of each row from its (median) ``us``: the K and V bytes, 2·B·T·H_kv·d·2."""
    for r in rows:
        kv_bytes = 2 * r["B"] * r["T"] * r["H_kv"] * r["d"] * 2
        r["gb_per_s"] = kv_bytes / (r["us"] * 1e-6) / 1e9 if r.get("us") else None
    return rows


def _progress(rows: list[dict]) -> str:
    """One printed line for the rows of one shape."""
    return "  " + "; ".join(f"{r['impl']} B={r['B']} T={r['T']} H_kv={r['H_kv']}: " + (
        f"{r['us']:.1f} us (eager {r['us_eager'] or 0:.1f}, graph {r['us_graph'] or 0:.1f}, "
        f"graph cold {r['us_graph_cold'] or 0:.1f})" if r["us"] else r["status"]) for r in rows)


def time_pass(shapes, impls, rep: int, run_no: int, deadline: float | None, runs: list[dict], save) -> str | None:
    """One pass over ``shapes`` ((H_kv, B, T)): each shape's rows into ``runs``, ``save()`` after
    each; a shape that raised outside measure_shape's own handling (its caches) gives ``error``
    rows. Stops before a shape that would start past ``deadline`` (a ``time.perf_counter()``
    value) and says why; else returns None."""
    for H_kv, B, T in shapes:
        if deadline is not None and time.perf_counter() > deadline:
            return "the time limit reached"
        try:
            new = measure_shape(B, T, H_kv, impls, rep, profile=run_no == 1)
        except Exception as exc:  # noqa: BLE001 - keep every row measured so far, and the report
            new = blank_rows(B, T, H_kv, impls, f"error: {type(exc).__name__}: " + refusal(exc, []))
        runs.extend(dict(r, run=run_no) for r in new)
        print(_progress(new), flush=True)
        save()
    return None


def run(info: dict, out_dir: Path, rep: int = 20, batches=BATCHES, contexts=CONTEXTS,
        kv_heads=KV_HEADS, impls=IMPLS, repeats: int = REPEATS, deadline: float | None = None) -> int:
    """Check, warm every implementation up (one untimed shape), then time every shape in
    ``repeats`` passes over the grid (fewer where another pass would end after ``deadline``, a
    ``time.perf_counter()`` value; a pass stops at the first shape that would start after it);
    after each shape, ``<out_dir>/<gpu>-decode.csv`` holds every row so far (medians of the
    passes so far), after each pass ``.md`` too. Returns 1 (nothing timed) when the kernel
    disagrees with SDPA."""
    print("Checking the decode kernel against SDPA (caches poisoned with NaN):", flush=True)
    failures = check_decode()
    if failures:
        print("The decode kernel disagrees with SDPA; not timing it:\n  " + "\n  ".join(failures))
        return 1
    stem = out_dir / (re.sub(r"[^a-z0-9]+", "-", info["gpu"].lower()).strip("-") + "-decode")
    info = {**info, "clocks_before": clocks_text(gpu_state())}
    shapes = [(H_kv, B, T) for H_kv in kv_heads for B in batches for T in contexts]
    start = time.perf_counter()
    measure_shape(shapes[0][1], shapes[0][2], shapes[0][0], impls, max(1, rep // 4))  # warm-up, untimed
    print(f"Decode warm-up (every implementation once, untimed): {time.perf_counter() - start:.0f} s", flush=True)
    runs: list[dict] = []
    last = 0.0
    for run_no in range(1, repeats + 1):
        if not another_pass(time.perf_counter(), last, deadline):
            print(f"Decode: stopping after {run_no - 1} passes: another would end past the time limit", flush=True)
            break
        start = time.perf_counter()
        stopped = time_pass(shapes, impls, rep, run_no, deadline, runs,
                            lambda: write_csv(with_bandwidth(aggregate(runs, KEY, TIMES)), info, stem.with_suffix(".csv")))
        write_markdown(with_bandwidth(aggregate(runs, KEY, TIMES)), info, stem.with_suffix(".md"))
        last = time.perf_counter() - start
        print(f"Decode pass {run_no} of {repeats}: {last:.0f} s", flush=True)
        if stopped:
            print(f"Decode: stopping in pass {run_no}: {stopped}", flush=True)
            break
    info["clocks_after"] = clocks_text(gpu_state())
    rows = with_bandwidth(aggregate(runs, KEY, TIMES))
    write_csv(rows, info, stem.with_suffix(".csv"))
    write_markdown(rows, info, stem.with_suffix(".md"))
    for r in rows:
        if r["impl"] == "sdpa-default" and r.get("kernels") is not None:
            print(f"  sdpa-default H_kv={r['H_kv']} B={r['B']} T={r['T']}: backend "
                  f"{r['backend']}, kernels {r['kernels']}")
    print("\n".join(goal_checks(rows)))
    print(f"Wrote {stem}.csv and .md")
    return 0
