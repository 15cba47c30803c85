"""The Triton kernels (row kernels, the fused strategy, the row-count GEMMs, the scale kernels, the
distillation row kernel) lower to H200 (sm_90) machine code: what the interpreter runs on CPU is
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
    # 24 row-kernel variants + the two scale kernels + 8 of the fused strategy + 12 row-count GEMMs + 7 of the
    # distillation row kernel
    assert len(lines) == 53
    # the scaled cast of the fp32 dW accumulator (`kernels/scale.py`) streams through registers alone
    assert any(line.startswith("sm_90 ok: scale_into ") and " stack=0 " in line for line in lines), lines
    # the row kernels keep everything in registers, every variant
    rows = [line for line in lines if line.startswith(("sm_90 ok: stats ", "sm_90 ok: finish "))]
    assert len(rows) == 24 and all(" stack=0 " in line for line in rows), rows
    distill = [line for line in lines if line.startswith("sm_90 ok: distill ")]
    assert len(distill) == 7 and all(" stack=0 " in line for line in distill), distill
    gemms = {line.split()[2]: [] for line in lines if line.startswith("sm_90 ok: gemm_")}
    for line in lines:
        if line.startswith("sm_90 ok: gemm_"):
            gemms[line.split()[2]].append(line)
    gemm_lines = [line for group in gemms.values() for line in group]
    # every row-count GEMM fits sm_90's 227 KiB of shared memory per block
    assert all(int(line.split(" smem=")[1].split()[0]) <= 232448 for line in gemm_lines), gemm_lines
    # the TMA kernels at the H200's tiles keep their accumulators in registers: a spill (stack > 0) would
    # cost the speed they were measured at
    fast = [line for line in gemm_lines if "'USE_TMA': True" in line]
    assert len(fast) == 6
    assert all(" stack=0 " in line for line in fast), fast
    # so do the fused strategy's kernels with every option off (docs/design.md, its roofline)
    plain_fused = [line for line in lines if line.startswith("sm_90 ok: fused_") and "'HAS_BIAS': False" in line]
    assert len(plain_fused) == 4
    assert all(" stack=0 " in line for line in plain_fused), plain_fused
