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
SDPA on ragged, poisoned caches. Without CUDA, ``measure_shape(..., device="cpu")`` runs the same
rows on the CPU (the course kernel in Triton's interpreter): ``us_eager`` by the wall clock, the
SDPA choice and the profiled op names, no GPU columns; the tests use it.
"""

from __future__ import annotations

import csv
import datetime
import gc
import re
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
TIMES = ("us", "us_eager", "us_graph", "us_graph_cold")
FIELDS = ["gpu", "torch", "triton", "commit", "impl", "B", "T", "H", "H_kv", "d", "page",
          "n_splits", *TIMES, "gb_per_s", "backend", "kernels", "status"]


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


def sdpa_choice(q4, k, v) -> str:
    """The backend torch's dispatcher picks for ``scaled_dot_product_attention(q4, k, v,
    enable_gqa=True)`` on these tensors, lower case (``flash_attention``, ``cudnn_attention``,
    ``efficient_attention``, ``math``), from ``torch._fused_sdp_choice`` (a private function:
    ``unknown`` where it is missing or fails)."""
    from torch.nn.attention import SDPBackend

    try:
        return SDPBackend(torch._fused_sdp_choice(q4, k, v, enable_gqa=True)).name.lower()
    except Exception:  # noqa: BLE001 - a torch without it, or a signature that changed
        return "unknown"


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
    """µs per step replayed from a CUDA graph (no launch overhead; L2 not cleared), or None."""
    import triton.testing

    try:
        return triton.testing.do_bench_cudagraph(step, rep=rep, return_mode="median") * 1e3
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


def refusal(exc: BaseException, caught: list) -> str:
    """One line on why a step did not run: the warnings SDPA gave while refusing (its reasons),
    then the exception, at most 200 characters."""
    texts = [str(w.message) for w in caught] + [str(exc)]
    text = " ".join(t.strip().splitlines()[0] for t in texts if t.strip())
    return re.sub(r"\s+", " ", text)[:200]


def measure_shape(B: int, T: int, H_kv: int, impls, rep: int, device: str = "cuda") -> list[dict]:
    """Every implementation on one (B, T, H_kv): rows of the four times (µs), GB/s, the SDPA
    backend and kernels, status. ``device="cpu"``: fp32, the course kernel in Triton's
    interpreter, ``us_eager`` by the wall clock (2 steps), no GPU columns."""
    cuda = device == "cuda"
    base = dict(B=B, T=T, H=HEADS, H_kv=H_kv, d=HEAD_DIM, page=PAGE)
    empty = dict(n_splits=None, gb_per_s=None, backend=None, kernels=None,
                 **dict.fromkeys(TIMES))
    kv_bytes = 2 * B * T * H_kv * HEAD_DIM * 2
    if cuda:
        free, _ = torch.cuda.mem_get_info()
        if 2.6 * kv_bytes > 0.9 * free:  # contiguous + paged caches, a page-sized copy in flight
            why = f"skipped: needs ~{2.6 * kv_bytes / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free"
            return [dict(base, impl=i, **empty, status=why) for i in impls]
    gen = torch.Generator(device=device).manual_seed(B * T + H_kv)
    k, v, k_pages, v_pages, table, lens = _caches(B, T, H_kv, gen, device)
    q = torch.randn(B, HEADS, HEAD_DIM, device=device, dtype=k.dtype, generator=gen)
    sms = td.sm_count(device) if td is not None else None
    rows = []
    for impl in impls:
        n_splits = {"course": None if sms is None else td.default_n_splits(B, H_kv, T, sms),
                    "course-1split": 1}.get(impl)
        row = dict(base, impl=impl, **empty, status="ok")
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


def write_markdown(rows: list[dict], info: dict, path: Path) -> None:
    impls = [i for i in IMPLS if any(r["impl"] == i for r in rows)]
    t = {(r["impl"], r["B"], r["T"], r["H_kv"]): r for r in rows}
    shapes = [(H_kv, B, T) for H_kv in sorted({r["H_kv"] for r in rows})
              for B in sorted({r["B"] for r in rows}) for T in sorted({r["T"] for r in rows})]
    out = [f"# Decode-step benchmark: {info['gpu']}", "",
           f"torch {info['torch']}, triton {info['triton']}, commit {info.get('commit', '?')}, "
           f"{datetime.date.today().isoformat()}. One decode step: H={HEADS}, d={HEAD_DIM}, fp16, "
           f"every sequence T cached tokens; the course kernel reads pages of {PAGE} tokens in "
           "shuffled order, SDPA a contiguous `[B, H_kv, T, d]` cache. Each cell: µs per step "
           "(median of `triton.testing.do_bench`: launched from Python, L2 cleared before each "
           "step) / GB/s of K and V read (2·B·T·H_kv·d·2 bytes). `course` uses the default split "
           "count (n_splits in brackets), `course-1split` one program per (sequence, kv head); "
           "`sdpa-<backend>` is SDPA forced onto one backend, `sdpa-default` torch's own choice "
           "(named in the last section). Generated by `bench/bench_attention.py --decode-only`.",
           ""]
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
                cells.append(f"{r['us']:.1f} / {r['gb_per_s']:.0f}{splits}")
            out.append(f"| {B} | {T} | " + " | ".join(cells) + f" | {_gain(t, 'us', B, T, H_kv)} |")
        out.append("")
    for field, title, note in MODE_TABLES:
        if not any(r.get(field) for r in rows):
            continue
        out += [f"## {title}", "", note, "",
                "| H_kv | B | T | " + " | ".join(impls) + " | split speedup |",
                "|---|---|---|" + "---|" * (len(impls) + 1)]
        for H_kv, B, T in shapes:
            cells = [(lambda r: f"{r[field]:.1f}" if r and r.get(field) else "")(
                t.get((i, B, T, H_kv))) for i in impls]
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
    path.write_text("\n".join(out))


def run(info: dict, out_dir: Path, rep: int = 20, batches=BATCHES, contexts=CONTEXTS,
        kv_heads=KV_HEADS, impls=IMPLS) -> int:
    """Check, then time every shape; write ``<out_dir>/<gpu>-decode.csv`` and ``.md``. Returns 1
    (nothing timed) when the kernel disagrees with SDPA."""
    print("Checking the decode kernel against SDPA (caches poisoned with NaN):", flush=True)
    failures = check_decode()
    if failures:
        print("The decode kernel disagrees with SDPA; not timing it:\n  " + "\n  ".join(failures))
        return 1
    stem = out_dir / (re.sub(r"[^a-z0-9]+", "-", info["gpu"].lower()).strip("-") + "-decode")
    rows = []
    for H_kv in kv_heads:
        for B in batches:
            for T in contexts:
                rows += measure_shape(B, T, H_kv, impls, rep)
                print("  " + "; ".join(f"{r['impl']} B={B} T={T} H_kv={H_kv}: " + (
                    f"{r['us']:.1f} us (eager {r['us_eager'] or 0:.1f}, graph "
                    f"{r['us_graph'] or 0:.1f}, graph cold {r['us_graph_cold'] or 0:.1f})"
                    if r["us"] else r["status"]) for r in rows[-len(impls):]), flush=True)
                write_csv(rows, info, stem.with_suffix(".csv"))
    write_markdown(rows, info, stem.with_suffix(".md"))
    for r in rows:
        if r["impl"] == "sdpa-default" and r.get("kernels") is not None:
            print(f"  sdpa-default H_kv={r['H_kv']} B={r['B']} T={r['T']}: backend "
                  f"{r['backend']}, kernels {r['kernels']}")
    print(f"Wrote {stem}.csv and .md")
    return 0
