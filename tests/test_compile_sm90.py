"""The Triton kernels (row kernels, the fused strategy, the row-count and statistics-epilogue GEMMs, the
folded row pass, the scale kernel) lower to H200 (sm_90) machine code: what the interpreter runs on CPU is
never compiled, so an op the GPU backend rejects would otherwise first fail on a GPU machine."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_kernels_compile_for_sm90():
    # a fresh process: Triton picks interpreter or compiler when a kernel is decorated, and this one
    # already imported the kernels for the interpreter
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "compile_sm90.py")], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("sm_90 ok")]
    # 24 row-kernel variants + the scale kernel + 8 of the fused strategy + 18 row-count GEMMs (+ 5 scaling their
    # operand) + 8 statistics-epilogue GEMMs (+ 4 writing probabilities) + 2 of prob_scales
    assert len(lines) == 70
    # the row kernels keep everything in registers, every variant
    rows = [line for line in lines if line.startswith(("sm_90 ok: stats ", "sm_90 ok: finish "))]
    assert len(rows) == 24 and all(" stack=0 " in line for line in rows), rows
    gemms = {line.split()[2]: [] for line in lines if line.startswith("sm_90 ok: gemm_")}
    for line in lines:
        if line.startswith("sm_90 ok: gemm_"):
            gemms[line.split()[2]].append(line)
    gemm_lines = [line for group in gemms.values() for line in group]
    # every row-count GEMM fits sm_90's 227 KiB of shared memory per block; the opt-in candidates (names
    # ending in _ws) are warp-specialized (a TMA producer and two consumer warpgroups), the others not
    assert all(int(line.split(" smem=")[1].split()[0]) <= 232448 for line in gemm_lines), gemm_lines
    assert all((" ws=yes " in line) == line.split()[2].endswith("_ws") for line in gemm_lines), gemm_lines
    # the TMA kernels at the H200's tiles, and every warp-specialized one, keep their accumulators in
    # registers: a spill (stack > 0) would cost the speed they were measured at
    fast = [line for line in gemm_lines if "'USE_TMA': True" in line]
    assert len(fast) == 17
    assert all(" stack=0 " in line for line in fast), fast
    # the row pass folded into the GEMMs: the probabilities' epilogue at its first candidate (4 stages) and the
    # per-row scale kernel spill nothing either
    folded = [line for line in lines if line.startswith(("sm_90 ok: stats_gemm_probs", "sm_90 ok: prob_scales"))
              and ("stages=4" in line or "prob_scales" in line) and "'USE_TMA': False" not in line]
    assert len(folded) == 3 and all(" stack=0 " in line for line in folded), folded
    # the statistics-epilogue GEMM's first candidates (128 × 128 tiles, 8 warps) hold their epilogue in
    # registers; with every option at once (entropy and temperature included) they spill at most a few words
    first = [line for line in lines if line.startswith("sm_90 ok: stats_gemm BLOCK_M=128 BLOCK_N=128")
             and "warps=8" in line]
    assert len(first) == 4, first
    assert all(" stack=0 " in line for line in first if "'HAS_BIAS': False" in line), first
    assert all(int(line.split(" stack=")[1].split()[0]) <= 64 for line in first), first
    # so do the fused strategy's kernels with every option off (docs/design.md, its roofline)
    plain_fused = [line for line in lines if line.startswith("sm_90 ok: fused_") and "'HAS_BIAS': False" in line]
    assert len(plain_fused) == 4
    assert all(" stack=0 " in line for line in plain_fused), plain_fused
