"""The Triton kernels (row kernels and the fused strategy) lower to H200 (sm_90) machine code: what the
interpreter runs on CPU is never compiled, so an op the GPU backend rejects would otherwise first fail
on a GPU machine."""

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
    assert done.stdout.count("sm_90 ok") == 24  # 16 row-kernel variants + 8 of the fused strategy
