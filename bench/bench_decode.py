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
* ``sdpa-flash`` / ``sdpa-default``: ``scaled_dot_product_attention(q, k, v, enable_gqa=True)`` on
  ``[B, H_kv, T, d]`` caches, forced onto the flash backend or left to torch's choice.

Times are medians of ``triton.testing.do_bench`` (which clears the L2 cache before each run), in
µs per step, and of ``do_bench_cudagraph`` (replayed from a CUDA graph, as serving engines run
decode: no CPU launch overhead, L2 not cleared); bandwidth is the K and V bytes one step must
read, ``2 * B * T * H_kv * d * 2``, over the first time, in GB/s (1e9 bytes). A shape whose caches (contiguous and paged) do not fit in free
memory is skipped. Before timing, the kernel is checked against SDPA on ragged, poisoned caches.
"""

from __future__ import annotations

import csv
import datetime
import gc
import re
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
IMPLS = ("course", "course-1split", "sdpa-flash", "sdpa-default")
FIELDS = ["gpu", "torch", "triton", "commit", "impl", "B", "T", "H", "H_kv", "d", "page",
          "n_splits", "us", "gb_per_s", "us_graph", "status"]


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


def _caches(B: int, T: int, H_kv: int, gen: torch.Generator):
    """Contiguous caches [B, H_kv, T, d] and the same tokens in shuffled pages."""
    k = torch.randn(B, H_kv, T, HEAD_DIM, device="cuda", dtype=torch.float16, generator=gen)
    v = torch.randn(B, H_kv, T, HEAD_DIM, device="cuda", dtype=torch.float16, generator=gen)
    n_pages = T // PAGE
    order = torch.randperm(B * n_pages, device="cuda", generator=gen)
    pages = []
    for x in (k, v):
        paged = torch.empty(B * n_pages, PAGE, H_kv, HEAD_DIM, device="cuda", dtype=torch.float16)
        paged[order] = x.view(B, H_kv, n_pages, PAGE, HEAD_DIM).permute(0, 2, 3, 1, 4).reshape(
            B * n_pages, PAGE, H_kv, HEAD_DIM)
        pages.append(paged)
    table = order.view(B, n_pages).int()
    lens = torch.full((B,), T, dtype=torch.int32, device="cuda")
    return k, v, pages[0], pages[1], table, lens


def _step(impl: str, q, k, v, k_pages, v_pages, table, lens, n_splits):
    if impl.startswith("course"):
        return lambda: td.paged_decode_triton(q, k_pages, v_pages, table, lens, n_splits=n_splits,
                                              check_values=False)
    q4 = q[:, :, None]
    if impl == "sdpa-default":
        return lambda: F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)

    return run


def _graph_us(step, rep: int) -> float | None:
    """µs per step replayed from a CUDA graph (no launch overhead; L2 not cleared), or None."""
    import triton.testing

    try:
        return triton.testing.do_bench_cudagraph(step, rep=rep, return_mode="median") * 1e3
    except Exception:  # noqa: BLE001 - a step that cannot be captured: the column stays empty
        torch.cuda.synchronize()
        return None


def measure_shape(B: int, T: int, H_kv: int, impls, rep: int) -> list[dict]:
    """Every implementation on one (B, T, H_kv): rows of µs, GB/s, status."""
    import triton.testing

    base = dict(B=B, T=T, H=HEADS, H_kv=H_kv, d=HEAD_DIM, page=PAGE)
    kv_bytes = 2 * B * T * H_kv * HEAD_DIM * 2
    free, _ = torch.cuda.mem_get_info()
    if 2.6 * kv_bytes > 0.9 * free:  # contiguous + paged caches, and one page-sized copy in flight
        why = f"skipped: needs ~{2.6 * kv_bytes / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free"
        return [dict(base, impl=i, n_splits=None, us=None, gb_per_s=None, us_graph=None, status=why)
                for i in impls]
    gen = torch.Generator(device="cuda").manual_seed(B * T + H_kv)
    k, v, k_pages, v_pages, table, lens = _caches(B, T, H_kv, gen)
    q = torch.randn(B, HEADS, HEAD_DIM, device="cuda", dtype=torch.float16, generator=gen)
    rows = []
    for impl in impls:
        n_splits = {"course": td.default_n_splits(B, H_kv, T, td.sm_count()),
                    "course-1split": 1}.get(impl)
        row = dict(base, impl=impl, n_splits=n_splits, us=None, gb_per_s=None, us_graph=None,
                   status="ok")
        step = _step(impl, q, k, v, k_pages, v_pages, table, lens, n_splits)
        try:
            step()  # compiles / autotunes, or tells us the backend refuses
            ms = triton.testing.do_bench(step, warmup=max(5, rep // 4), rep=rep,
                                         return_mode="median")
            row.update(us=ms * 1e3, gb_per_s=kv_bytes / (ms * 1e-3) / 1e9)
            row["us_graph"] = _graph_us(step, rep)
        except torch.cuda.OutOfMemoryError:
            row["status"] = "OOM"
        except RuntimeError as exc:  # an SDPA backend that refuses this shape
            row["status"] = "unsupported: " + re.sub(r"\s+", " ", str(exc))[:120]
        rows.append(row)
    del k, v, k_pages, v_pages, table, lens, q
    gc.collect()
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


def write_markdown(rows: list[dict], info: dict, path: Path) -> None:
    impls = [i for i in IMPLS if any(r["impl"] == i for r in rows)]
    t = {(r["impl"], r["B"], r["T"], r["H_kv"]): r for r in rows}
    out = [f"# Decode-step benchmark: {info['gpu']}", "",
           f"torch {info['torch']}, triton {info['triton']}, commit {info.get('commit', '?')}, "
           f"{datetime.date.today().isoformat()}. One decode step: H={HEADS}, d={HEAD_DIM}, fp16, "
           f"every sequence T cached tokens; the course kernel reads pages of {PAGE} tokens in "
           "shuffled order, SDPA a contiguous `[B, H_kv, T, d]` cache. Each cell: µs per step "
           "(median of `triton.testing.do_bench`, L2 cleared) / GB/s of K and V read "
           "(2·B·T·H_kv·d·2 bytes). `course` uses the default split count (n_splits in "
           "brackets), `course-1split` one program per (sequence, kv head). Generated by "
           "`bench/bench_attention.py --decode-only`.", ""]
    for H_kv in sorted({r["H_kv"] for r in rows}):
        kind = "MHA" if H_kv == HEADS else f"GQA, {HEADS // H_kv} per kv head"
        out += [f"## H_kv = {H_kv} ({kind})",
                "", "| B | T | " + " | ".join(impls) + " | split speedup |",
                "|---|---|" + "---|" * (len(impls) + 1)]
        for B in sorted({r["B"] for r in rows}):
            for T in sorted({r["T"] for r in rows}):
                cells = []
                for i in impls:
                    r = t.get((i, B, T, H_kv))
                    if r is None or r["us"] is None:
                        cells.append("" if r is None else r["status"].split(":")[0])
                        continue
                    splits = f" [{r['n_splits']}]" if i == "course" else ""
                    cells.append(f"{r['us']:.1f} / {r['gb_per_s']:.0f}{splits}")
                one, many = t.get(("course-1split", B, T, H_kv)), t.get(("course", B, T, H_kv))
                gain = (f"{one['us'] / many['us']:.2f}x" if one and many and one["us"]
                        and many["us"] else "")
                out.append(f"| {B} | {T} | " + " | ".join(cells) + f" | {gain} |")
        out.append("")
    out += ["## Replayed from a CUDA graph, µs per step", "",
            "As serving engines run decode steps: no CPU launch overhead (which the times above "
            "include wherever a step's GPU work is shorter than its launch: small B and T); the "
            "L2 cache is not cleared between replays, so caches smaller than L2 read faster.", "",
            "| H_kv | B | T | " + " | ".join(impls) + " |", "|---|---|---|" + "---|" * len(impls)]
    for H_kv in sorted({r["H_kv"] for r in rows}):
        for B in sorted({r["B"] for r in rows}):
            for T in sorted({r["T"] for r in rows}):
                cells = [(lambda r: f"{r['us_graph']:.1f}" if r and r.get("us_graph") else "")(
                    t.get((i, B, T, H_kv))) for i in impls]
                out.append(f"| {H_kv} | {B} | {T} | " + " | ".join(cells) + " |")
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
                    f"{r['us']:.1f} us {r['gb_per_s']:.0f} GB/s" if r["us"] else r["status"])
                    for r in rows[-len(impls):]), flush=True)
                write_csv(rows, info, stem.with_suffix(".csv"))
    write_markdown(rows, info, stem.with_suffix(".md"))
    print(f"Wrote {stem}.csv and .md")
    return 0
