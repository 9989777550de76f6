"""helpers/tools/kernel_report.py (`make kernel-report`): registers and spills of the autotuner's
configurations, compiled ahead of time for named GPUs without one.

* Reading ptxas -v and PTX, on sample text (no compiler): registers, spills (a spilling case and a
  log with two functions), the matrix instructions and the loads; fits_shared, spilling, the
  report's files.
* One subprocess (TRITON_INTERPRET=0, fresh Triton) that specialises the forward kernel as the JIT
  does on a GPU (unit strides and GROUP become constants 1, pointers and the other integers carry
  divisibility 16): a few seconds.
* Slow: the same subprocess also compiles the first entry of each kernel's table for sm_90 (Hopper:
  wgmma) and sm_80. A few seconds per compile, 20-40 s in all on 2 cores (less once Triton's cache
  holds them); make test reads the committed report's spills instead.
* Slow: compile_row for sm_80 from this process, whose Triton runs the interpreter: it compiles in
  a spawned worker, and the dots become Ampere's mma.sync.

* The committed report covers every configuration the tables can choose, none spilling; the
  T4/L4 figures match their tables.
* The decode kernels' report (kernel_aot_decode.json, notebook 12) covers every configuration of
  the split and merge kernels, none spilling; programs_per_sm counts registers, threads and shared
  memory. The Triton 3.6 reports (kernel_aot_triton36.json, kernel_aot_decode_triton36.json: the
  GPU machines' Triton) cover sm_90 at fp16 and spill nowhere a launch goes; --suffix names them.
* The GPU's record (make bench on an H200, helpers/results/nvidia-h200*): the autotuner chose only
  table rows, the TMA ones spill-free on the GPU as the report predicted, and the README states
  what the CSV holds.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from helpers.package_data import RESULTS, package_file
from helpers.tools import kernel_report as kr

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is Linux-only")

# ptxas -v as the wheel's ptxas prints it (Triton 3.9; the sm_90 forward, first FWD_CONFIGS entry at d=64)
PTXAS_SPILL = """\
ptxas-blackwell info    : 11 bytes gmem
ptxas-blackwell info    : Compiling entry function '_attn_fwd' for 'sm_90a'
ptxas-blackwell info    : Function properties for _attn_fwd
    16 bytes stack frame, 12 bytes spill stores, 12 bytes spill loads
ptxas-blackwell info    : Used 255 registers, used 1 barriers, 16 bytes cumulative stack size
ptxas-blackwell info    : Compile time = 1178.582 ms
"""
PTXAS_CLEAN = """\
ptxas info    : 11 bytes gmem, 8 bytes cmem[4]
ptxas info    : Compiling entry function '_attn_bwd_dq' for 'sm_80'
ptxas info    : Function properties for _attn_bwd_dq
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers, 472 bytes cmem[0]
"""
PTXAS_TWO_FUNCTIONS = """\
ptxas info    : Function properties for helper
    8 bytes stack frame, 4 bytes spill stores, 8 bytes spill loads
ptxas info    : Used 40 registers
ptxas info    : Compiling entry function 'kern' for 'sm_80'
ptxas info    : Function properties for kern
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 96 registers, used 1 barriers, 380 bytes cmem[0]
"""


def test_parse_ptxas_spill():
    assert kr.parse_ptxas(PTXAS_SPILL, entry="_attn_fwd") == {"registers": 255, "spill_stores": 12, "spill_loads": 12}


def test_parse_ptxas_clean():
    assert kr.parse_ptxas(PTXAS_CLEAN, entry="_attn_bwd_dq") == {"registers": 168, "spill_stores": 0, "spill_loads": 0}


def test_parse_ptxas_picks_the_entry_function():
    assert kr.parse_ptxas(PTXAS_TWO_FUNCTIONS, entry="kern")["registers"] == 96
    assert kr.parse_ptxas(PTXAS_TWO_FUNCTIONS, entry="helper") == {"registers": 40, "spill_stores": 4, "spill_loads": 8}
    assert kr.parse_ptxas(PTXAS_TWO_FUNCTIONS)["registers"] == 40  # no entry named: the first reported
    with pytest.raises(ValueError, match="no function"):
        kr.parse_ptxas("ptxas fatal   : Unresolved extern function 'f'")


def test_mma_and_load_kinds():
    assert kr.mma_kind("wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {...}") == "wgmma"
    assert kr.mma_kind("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {...}") == "mma.sync"
    assert kr.mma_kind("fma.rn.f32 %f1, %f2, %f3, %f4;") == "fma"
    assert kr.load_kind("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes") == "tma"
    assert kr.load_kind("cp.async.cg.shared.global [ %r1 + 0 ], [ %rd1 + 0 ], 0x10, %r2;") == "cp.async"
    assert kr.load_kind("ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];") == "ld.global"


def _row(**changes):
    row = dict(kernel="fwd", target="sm_90", tma=False, dtype="fp16", head_dim=64, causal=True, block_m=128, block_n=64,
               num_warps=4, num_stages=3, registers=255, spill_bytes=12, mma="wgmma", loads="cp.async",
               shared_bytes=65536)
    return {**row, **changes}


@needs_triton
def test_the_report_takes_the_kernels_own_tma_decision():
    """uses_tma asks helpers/nb09_triton_flash's _tma_allowed, with the target's capability."""
    import triton.language as tl

    has_descriptors = hasattr(tl, "make_tensor_descriptor")
    assert kr.uses_tma("sm_90", "fp16", 64) is has_descriptors
    assert not kr.uses_tma("sm_80", "fp16", 128) and not kr.uses_tma("sm_89", "bf16", 64)


def test_fits_shared_and_spilling():
    assert kr.fits_shared(_row(shared_bytes=232_448)) and not kr.fits_shared(_row(shared_bytes=232_449))
    assert kr.fits_shared(_row(target="sm_80", shared_bytes=166_912))
    assert not kr.fits_shared(_row(target="sm_89", shared_bytes=101_377))
    assert not kr.fits_shared(_row(target="sm_75", shared_bytes=65_537))
    rows = [_row(), _row(spill_bytes=0, registers=168)]
    assert kr.spilling(rows) == rows[:1]


def test_report_files_round_trip(tmp_path):
    rows = [_row(), _row(target="sm_80", mma="mma.sync", spill_bytes=0, registers=200)]
    meta = {"machine": "test machine", "triton": "3.9.0", "ptxas": "release 12.9", "commit": "abc1234",
            "kernel_source_sha256": "0123456789ab", "date": "2026-01-01", "shape": "B=4"}
    kr.write_report(rows, meta, tmp_path)
    assert kr.read_report(tmp_path / "kernel_aot.json") == rows
    assert set(rows[0]) == set(kr.ROW_KEYS)
    md = (tmp_path / "kernel_aot.md").read_text()
    assert "test machine" in md and "Triton 3.9.0" in md and "abc1234" in md
    assert "| fwd | sm_90 | cp.async | 64 | 1 | 255-255 | 1 | 12 |" in md and "## Spilling configurations" in md


def test_the_cli_names_an_unknown_dtype_before_compiling(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # as in a test process: nothing may compile here
    with pytest.raises(SystemExit) as stop:
        kr.main(["--dtypes", "fp16,fp8", "--out", str(tmp_path)])
    assert stop.value.code == 2 and "unknown dtype(s) ['fp8']; use ['fp16', 'bf16', 'fp32']" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


# The JIT's specialisation, without compiling: what the fast test checks, and the first half of the
# slow one's script.
SPEC_SCRIPT = """
import json
from helpers.tools import kernel_report as kr
import helpers.nb09_triton_flash as tf
from triton.backends.compiler import GPUTarget

fn = tf._attn_fwd
consts = dict(HEAD_DIM=64, CAUSAL=True, DOT_PRECISION="tf32", BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3)
signature, constexprs, attrs, options = kr.specialise(fn, GPUTarget("cuda", 90, 32),
                                                      kr.launch_arguments(fn, "fp16", 64), consts)
names = fn.arg_names
spec = {"signature": signature,
        "constexprs": {names[k[0]]: v for k, v in constexprs.items()},
        "divisible": sorted(names[k[0]] for k, v in attrs.items() if ["tt.divisibility", 16] in v)}
specs = [dict(kernel=kind, target=target, tma=tma, dtype="fp16", head_dim=128, causal=True,
              **dict(zip(("block_m", "block_n", "num_warps", "num_stages"),
                         kr.config_table(kind, 128, tf.table_name(target, tma))[0])))
         for target, tma in (("sm_90", True), ("sm_90", False), ("sm_80", False)) for kind in kr.KERNELS]
"""
AOT_SCRIPT = SPEC_SCRIPT + """
print(json.dumps({"spec": spec, "rows": kr.compile_rows(specs, jobs=1)}))
"""


# Registers per thread of the first entry of each table (d = 128, causal: the hardest case) may not
# exceed these, per Triton version and target (what Triton 3.9 gives, plus a margin); an unknown
# Triton version is held to the hardware's 255 and to no spill.
REGISTER_CEILING = {"3.9": {"sm_90": 232, "sm_80": 255}}


def _run_aot(script: str) -> dict:
    """``script`` in a fresh Python whose Triton compiles (TRITON_INTERPRET=0); its last line, as JSON."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=kr.ROOT,
                         timeout=300)
    if run.returncode and "ptxas" in run.stderr and ("not found" in run.stderr or "No such file" in run.stderr):
        pytest.skip("this Triton install has no ptxas to compile with")
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


def _assert_the_jits_specialisation(spec: dict) -> None:
    # the JIT's specialisation for B=4, H=H_kv=32, T=4096, d=64, contiguous
    for name in ("stride_qd", "stride_kd", "stride_vd", "stride_od", "GROUP"):
        assert spec["signature"][name] == "constexpr" and spec["constexprs"][name] == 1, name
    assert spec["constexprs"]["BLOCK_M"] == 128 and spec["constexprs"]["HEAD_DIM"] == 64
    assert spec["signature"]["Q"] == "*fp16" and spec["signature"]["Lse"] == "*fp32"
    assert spec["signature"]["qk_scale"] == "fp32" and spec["signature"]["N_Q"] == "i32"
    assert {"Q", "K", "V", "Out", "Lse", "stride_qz", "stride_qh", "stride_qm", "H", "N_Q", "N_K"} <= set(spec["divisible"])
    assert "qk_scale" not in spec["divisible"]


@needs_triton
def test_the_forward_kernel_is_specialised_as_the_jit_does():
    """Fast stand-in for the slow compile below (make test): the same subprocess script up to the
    compiles, so a change in Triton's specialisation or in the kernel's arguments shows here;
    whether the compiled rows spill, make test reads from the committed report
    (test_the_committed_report_covers_every_choosable_config_and_none_spills)."""
    _assert_the_jits_specialisation(_run_aot(SPEC_SCRIPT + '\nprint(json.dumps({"spec": spec}))\n')["spec"])


@needs_triton
@pytest.mark.slow
def test_first_configs_compile_without_spilling():
    """The first entry of each table (the one a first launch tries) for sm_90 (both load paths) and
    sm_80 at d = 128, causal: no spill, Hopper's wgmma (and TMA loads on its descriptor path),
    registers under the ceiling."""
    import triton
    out = _run_aot(AOT_SCRIPT)
    _assert_the_jits_specialisation(out["spec"])
    rows = out["rows"]
    assert [(r["target"], r["tma"], r["kernel"]) for r in rows] == [
        (t, tma, k) for t, tma in (("sm_90", True), ("sm_90", False), ("sm_80", False)) for k in kr.KERNELS]
    ceiling = REGISTER_CEILING.get(".".join(triton.__version__.split(".")[:2]), {})
    for row in rows:
        assert set(row) == set(kr.ROW_KEYS), row
        assert row["spill_bytes"] == 0, f"the first entry spills: {row}"
        table = row["target"] if row["tma"] or row["target"] != "sm_90" else "sm_90-pointers"
        assert 0 < row["registers"] <= ceiling.get(table, 255), row
        assert row["mma"] == ("wgmma" if row["target"] == "sm_90" else "mma.sync"), row
        assert row["loads"] == ("tma" if row["tma"] else "cp.async"), row
        assert row["shared_bytes"] > 0 and kr.fits_shared(row), row


def test_the_committed_report_covers_every_choosable_config_and_none_spills():
    """helpers/results/kernel_aot.json (make kernel-report) holds one row per configuration the
    autotuner can choose on sm_80 and sm_90 (fp16, bf16; d = 64, 128; causal or not), and none of
    them spills; on sm_90 every one uses wgmma and TMA loads."""
    rows = kr.read_report()
    key = lambda r: (r["kernel"], r["target"], r["tma"], r["dtype"], r["head_dim"], r["causal"],  # noqa: E731
                     r["block_m"], r["block_n"], r["num_warps"], r["num_stages"])
    assert sorted(map(key, rows)) == sorted(map(key, kr.report_specs())), "make kernel-report: the tables changed"
    assert not kr.spilling(rows), kr.spilling(rows)[:3]
    assert all(r["mma"] == "wgmma" and r["loads"] == ("tma" if r["tma"] else "cp.async")
               for r in rows if r["target"] == "sm_90")
    assert {r["tma"] for r in rows if r["target"] == "sm_90"} == {True, False}, "both Hopper load paths"
    assert all(r["mma"] == "mma.sync" and kr.fits_shared(r) for r in rows if r["target"] == "sm_80")


def test_the_committed_decode_report_covers_every_choosable_config_and_none_spills():
    """helpers/results/kernel_aot_decode.json (make kernel-report, --kernels decode) holds one row
    per configuration of notebook 12's kernels: the split kernel's autotuner configs on each score
    path (tl.dot for both GQA groups of the bench, 4 and 1; the broadcast product for 1), writing
    float32 partials or the output directly, and the merge for 2 to MAX_SPLITS splits, on sm_80 and
    sm_90 (fp16, bf16; d = 64, 128). None spills, the dot path uses tensor cores (mma.sync: a group
    padded to 16 rows is too short for Hopper's wgmma) and copies tiles asynchronously, every row
    fits shared memory, and a spec of the split kernel is what the launcher would pass."""
    rows = kr.read_report(package_file(RESULTS, "kernel_aot_decode.json"))
    assert sorted(map(kr.decode_config_key, rows)) == sorted(map(kr.decode_config_key, kr.decode_report_specs())), \
        "python -m helpers.tools.kernel_report --kernels decode: the configurations changed"
    assert all(set(r) == set(kr.DECODE_ROW_KEYS) for r in rows)
    assert not kr.spilling(rows), kr.spilling(rows)[:3]
    assert all(kr.fits_shared(r) and r["programs_per_sm"] >= 1 for r in rows)
    dot = [r for r in rows if r["path"] == "dot"]
    assert {r["group"] for r in dot} == {4, 1} and {r["out"] for r in dot} == {"partials", "direct"}
    assert all(r["mma"] == "mma.sync" and r["loads"] == "cp.async" for r in dot)
    assert {r["n_splits"] for r in rows if r["kernel"] == "merge"} == {2, 4, 8, 16, 32, 64, 128}
    assert all(r["n_splits"] == 1 for r in rows if r["out"] == "direct")


def test_programs_per_sm_counts_registers_threads_and_shared_memory():
    assert kr.programs_per_sm("sm_90", 86, 4, 38912) == 5  # shared: 228 KiB / (38 + 1 KiB)
    assert kr.programs_per_sm("sm_90", 128, 4, 0) == 4  # registers: 64 K / (128 * 128 threads)
    assert kr.programs_per_sm("sm_90", 129, 4, 0) == 3  # 129 -> 136 a thread (256 a warp at a time)
    assert kr.programs_per_sm("sm_90", 16, 4, 0) == 16  # threads: 2,048 / 128
    assert kr.programs_per_sm("sm_90", 16, 1, 0) == 32  # block slots
    assert kr.programs_per_sm("sm_80", 128, 4, 73728) == 2  # 164 KiB / (72 + 1 KiB)
    assert kr.programs_per_sm("sm_75", 64, 4, 32768) == 2  # 64 KiB, nothing reserved


class _Recorder:
    """Stands in for a Triton kernel: ``kernel[grid](*args, **kwargs)`` records the call."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


@needs_triton
@pytest.mark.parametrize("group, n_splits", [(4, 8), (1, 1)])
def test_the_decode_stand_ins_are_what_the_launcher_passes(monkeypatch, group, n_splits):
    """decode_launch_arguments and decode_constexprs against the arguments paged_decode_triton
    really passes its two kernels (recorded, nothing runs), at the bench's shape with T = 256: the
    tensors' dtypes in order, every stride, size and scale."""
    import torch
    from triton.runtime.jit import JITFunction

    from helpers import nb12_triton_decode as td

    T, d = 256, 64
    monkeypatch.setitem(kr.DECODE_SHAPE, "T", T)
    H, page = kr.DECODE_SHAPE["H"], kr.DECODE_SHAPE["PAGE"]
    out = "partials" if n_splits > 1 else "direct"
    B, H_kv = kr.DECODE_OUTPUTS[out], H // group
    q = torch.zeros(B, H, d, dtype=torch.float16)
    pages = torch.zeros(B * T // page, page, H_kv, d, dtype=torch.float16)
    table = torch.arange(B * T // page, dtype=torch.int32).view(B, T // page)
    merge_fn, split, merge = td._merge_splits, _Recorder(), _Recorder()
    monkeypatch.setattr(td, "_split_kernel", lambda *_: split)
    monkeypatch.setattr(td, "_merge_splits", merge)
    td.paged_decode_triton(q, pages, pages, table, torch.full((B,), T, dtype=torch.int32), n_splits=n_splits)
    spec = dict(kernel="split", target="sm_90", path="dot", out=out, dtype="fp16", head_dim=d, group=group,
                n_splits=n_splits, block_n=16, num_warps=4, num_stages=2)
    calls = [(td._paged_decode_split, spec, split.calls)]
    if n_splits > 1:
        calls.append((merge_fn, {**spec, "kernel": "merge", "path": "merge"}, merge.calls))
    assert len(merge.calls) == (n_splits > 1)
    for fn, spec, ((args, kwargs),) in calls:
        stand_ins = kr.decode_launch_arguments(JITFunction(fn.fn), spec)  # the GPU's JITFunction
        assert len(stand_ins) == len(args)
        for real, mock in zip(args, stand_ins):
            assert (mock.dtype == real.dtype) if isinstance(real, torch.Tensor) else mock == pytest.approx(real)
        options = ("BLOCK_N", "num_warps", "num_stages")  # the autotuner's (the interpreter's fixed tile)
        want = {k: v for k, v in kr.decode_constexprs(spec).items() if k not in options}
        assert {k: v for k, v in kwargs.items() if k not in options} == want


TRITON36_COMMAND = ("TRITON_INTERPRET=0 .venv-triton36/bin/python -m helpers.tools.kernel_report --kernels all "
                    "--fast --targets sm_90 --suffix _triton36")


def test_the_triton36_report_covers_sm_90s_choosable_configs_and_none_spills():
    """helpers/results/kernel_aot_triton36.json: the FlashAttention kernels compiled by Triton 3.6
    (the GPU machines', ptxas 12.8) for sm_90 at fp16: one row per configuration the autotuner can
    choose (both load paths, d = 64 and 128, causal or not), none spilling, wgmma and the path's
    loads on every one, as in the Triton 3.9 report."""
    rows = kr.read_report(package_file(RESULTS, "kernel_aot_triton36.json"))
    meta = json.loads(package_file(RESULTS, "kernel_aot_triton36.meta.json").read_text())
    assert meta["triton"].startswith("3.6.") and "release 12.8" in meta["ptxas"]
    key = lambda r: (r["kernel"], r["target"], r["tma"], r["dtype"], r["head_dim"], r["causal"],  # noqa: E731
                     r["block_m"], r["block_n"], r["num_warps"], r["num_stages"])
    want = kr.report_specs(targets=("sm_90",), dtypes=("fp16",))
    assert sorted(map(key, rows)) == sorted(map(key, want)), f"the tables changed; rerun: {TRITON36_COMMAND}"
    assert not kr.spilling(rows), kr.spilling(rows)[:3]
    assert all(r["mma"] == "wgmma" and r["loads"] == ("tma" if r["tma"] else "cp.async") and kr.fits_shared(r)
               for r in rows)


def test_the_triton36_decode_report_spills_only_off_the_launch_path():
    """helpers/results/kernel_aot_decode_triton36.json: the decode kernels compiled by Triton 3.6
    (the GPU machines', whose ptxas is 12.8) for sm_90 at fp16, every configuration of the 3.9
    report's. What a launch compiles (the tl.dot path: every group reaches DOT_MIN_GROUP = 1, and
    the merge) spills nothing and holds at least RESIDENT programs per SM; the broadcast path, which
    only a raised DOT_MIN_GROUP takes, spills 4 bytes in one configuration (BLOCK_N = 32, 4 warps,
    d = 128, writing the output: 80 registers, a ptxas 12.8 choice; Triton 3.9's ptxas spills none)."""
    from helpers import nb12_triton_decode as td

    rows = kr.read_report(package_file(RESULTS, "kernel_aot_decode_triton36.json"))
    meta = json.loads(package_file(RESULTS, "kernel_aot_decode_triton36.meta.json").read_text())
    assert meta["triton"].startswith("3.6.") and "release 12.8" in meta["ptxas"]
    want = kr.decode_report_specs(targets=("sm_90",), dtypes=("fp16",))
    assert sorted(map(kr.decode_config_key, rows)) == sorted(map(kr.decode_config_key, want)), (
        f"rerun: {TRITON36_COMMAND}")
    launched = [r for r in rows if r["path"] in ("dot", "merge")]
    assert not kr.spilling(launched) and all(kr.fits_shared(r) for r in rows)
    assert min(r["programs_per_sm"] for r in launched if r["kernel"] == "split") > td.RESIDENT
    assert [(r["path"], r["out"], r["head_dim"], r["block_n"], r["num_warps"], r["spill_bytes"])
            for r in kr.spilling(rows)] == [("broadcast", "direct", 128, 32, 4, 4)]


def test_the_cli_suffix_names_the_files_and_refuses_a_path(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # as in a test process: nothing may compile here
    with pytest.raises(SystemExit) as stop:
        kr.main(["--suffix", "../x", "--out", str(tmp_path)])
    assert stop.value.code == 2 and "--suffix '../x': use letters, digits, _ and - only" in capsys.readouterr().err
    work = tmp_path / ".kernel_report_triton36"
    work.mkdir()
    for name in ("kernel_aot.json", "kernel_aot.meta.json", "kernel_aot_decode.md"):
        (work / name).write_text(name)
    kr._move_with_suffix(work, tmp_path, "_triton36")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "kernel_aot_decode_triton36.md", "kernel_aot_triton36.json", "kernel_aot_triton36.meta.json"]
    assert (tmp_path / "kernel_aot_triton36.meta.json").read_text() == "kernel_aot.meta.json"


def test_t4_and_l4_figures_match_their_tables():
    """helpers/results/kernel_aot_t4_l4.json: the T4 (sm_75) runs with tiles that fit its 64 KiB but
    no tensor cores (every dot is FMA in Triton 3.9); the L4 (sm_89) tables fit 99 KiB, spill-free."""
    rows = kr.read_report(package_file(RESULTS, "kernel_aot_t4_l4.json"))
    key = lambda r: (r["kernel"], r["target"], r["head_dim"], r["causal"], r["block_m"], r["block_n"],  # noqa: E731
                     r["num_warps"], r["num_stages"])
    want = kr.report_specs(targets=("sm_75", "sm_89"), dtypes=("fp16",))
    assert sorted(map(key, rows)) == sorted(map(key, want)), "rerun: python -m helpers.tools.kernel_report --kernels flash --targets sm_75,sm_89 --fast --out DIR"
    assert all(kr.fits_shared(r) for r in rows)
    assert all(r["mma"] == "fma" for r in rows if r["target"] == "sm_75")
    assert not kr.spilling([r for r in rows if r["target"] == "sm_89"])


@needs_triton
@pytest.mark.slow
def test_compile_row_for_ampere_from_an_interpreter_process():
    """This test process runs Triton's interpreter: compile_row compiles in a spawned worker."""
    try:
        row = kr.compile_row("dq", "sm_80", "fp16", 64, False, 64, 32, 4, 3)
    except RuntimeError as exc:
        if "ptxas" in str(exc) and ("not found" in str(exc) or "No such file" in str(exc)):
            pytest.skip("this Triton install has no ptxas to compile with")
        raise
    assert row["mma"] == "mma.sync" and row["loads"] == "cp.async", row
    assert 0 < row["registers"] <= 255 and row["shared_bytes"] > 0 and kr.fits_shared(row), row


@needs_triton
@pytest.mark.slow
def test_compile_decode_rows_from_an_interpreter_process():
    """The decode kernels compile in a spawned worker too: the split kernel's first tl.dot config for
    sm_90 at d = 128 (a group of 4 padded to 16 rows: mma.sync, not wgmma) and the merge."""
    from helpers import nb12_triton_decode as td

    specs = [s for s in kr.decode_report_specs(targets=("sm_90",), dtypes=("fp16",)) if s["head_dim"] == 128]
    specs = [specs[0], next(s for s in specs if s["kernel"] == "merge")]
    try:
        split, merge = kr.compile_decode_rows(specs, jobs=1)
    except RuntimeError as exc:
        if "ptxas" in str(exc) and ("not found" in str(exc) or "No such file" in str(exc)):
            pytest.skip("this Triton install has no ptxas to compile with")
        raise
    assert (split["path"], split["group"], split["mma"], split["loads"]) == ("dot", 4, "mma.sync", "cp.async"), split
    assert split["spill_bytes"] == 0 and split["programs_per_sm"] > td.RESIDENT, split
    assert merge["kernel"] == "merge" and merge["spill_bytes"] == 0 and merge["registers"] > 0, merge


@needs_triton
@pytest.mark.slow
def test_t4_backward_at_d128_compiles_to_fit_64_kib_without_tensor_cores():
    """Recompiled here (not read from the committed figures): the T4's dK/dV tile at d = 128 fits
    its 64 KiB of shared memory, and Triton makes its dots plain FMA on sm_75."""
    try:
        row = kr.compile_row("dkdv", "sm_75", "fp16", 128, True, *kr.config_table("dkdv", 128, "sm_75")[0])
    except RuntimeError as exc:
        if "ptxas" in str(exc) and ("not found" in str(exc) or "No such file" in str(exc)):
            pytest.skip("this Triton install has no ptxas to compile with")
        raise
    assert kr.fits_shared(row) and row["mma"] == "fma", row


# ---------------------------------------------------------------- the GPU's record (make bench on an H200)

H200 = package_file(RESULTS, "nvidia-h200.csv").with_suffix("")


def test_the_h200_autotuner_chose_table_rows_and_the_tma_ones_never_spilled():
    """nvidia-h200-kernels.json: each shape's pick is a row of the sm_90 table for its kernel and
    head dim (the record predates the pointer path's own tables: both paths tuned over these);
    with TMA, the GPU's own compile (Triton 3.6) spilled nothing, used wgmma and TMA copies, and
    the ahead-of-time report has the same row, spill-free."""
    from helpers import nb09_triton_flash as tf

    rows = json.loads(H200.with_name(H200.name + "-kernels.json").read_text())
    assert {(r["kernel"], r["head_dim"], r["causal"], r["tma"]) for r in rows} == {
        (k, d, c, t) for k in ("fwd", "dkdv", "dq") for d in (64, 128) for c in (False, True) for t in (False, True)}
    for r in rows:
        config = (r["block_m"], r["block_n"], r["num_warps"], r["num_stages"])
        assert config in tf.config_table(r["kernel"], r["head_dim"], "sm_90"), r
        assert r["wgmma"] and r["tma_copies"] == r["tma"], r
        if r["tma"]:
            assert r["spill_bytes"] == 0 and r["aot_spill_bytes"] == 0 and r["aot_registers"], r


def _h200_ms(T=4096):
    with H200.with_suffix(".csv").open() as f:
        return {(r["impl"], r["mode"], int(r["d"]), r["causal"] == "True"): float(r["ms"])
                for r in csv.DictReader(f) if r["ms"] and int(r["T"]) == T}


def test_the_readme_states_what_the_h200_measured():
    """The README's sentence on the H200 (beats SDPA's flash backend forward and backward at
    T = 4,096; a range of cuDNN's forward speed) is what helpers/results/nvidia-h200.csv holds."""
    ms = _h200_ms()
    cases = [(d, c) for d in (64, 128) for c in (False, True)]
    bwd = lambda impl, d, c: ms[(impl, "fwd+bwd", d, c)] - ms[(impl, "fwd", d, c)]  # noqa: E731
    assert all(ms[("sdpa-flash", "fwd", d, c)] > ms[("course", "fwd", d, c)] for d, c in cases)
    assert all(bwd("sdpa-flash", d, c) > bwd("course", d, c) for d, c in cases)
    cudnn = [ms[("sdpa-cudnn", "fwd", d, c)] / ms[("course", "fwd", d, c)] for d, c in cases]
    readme = " ".join((kr.ROOT / "README.md").read_text().split())
    claim = f"reaches {round(100 * min(cudnn))}-{round(100 * max(cudnn))}% of cuDNN's forward"
    assert claim in readme, f"README should say: {claim}"
