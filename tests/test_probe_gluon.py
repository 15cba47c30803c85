"""The Gluon probe (probes/gluon_logits_stats.py: warp-specialized, ping-pong LM-head GEMM with the row-statistics
epilogue) lowers to sm_90a on the CPU with zero spills and fits H100's shared memory, at its first two configs
(cooperative and ping-pong), with and without the bf16 logits store."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(importlib.util.find_spec("triton.experimental.gluon") is None,
                    reason="triton.experimental.gluon is not installed")
def test_gluon_probe_compiles_for_sm90_without_spills():
    # a fresh process: the compiler, not the interpreter the CPU suite switches on
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, str(ROOT / "probes" / "gluon_logits_stats.py"), "--compile",
               "--configs", "128x256x64s4coop,128x128x64s6c2"]  # cooperative and ping-pong
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("sm_90a ok")]
    assert len(lines) == 4, done.stdout
    assert all(" stack=0 spill=0 " in line for line in lines), lines
    assert all(int(line.split(" smem=")[1].split()[0]) <= 232448 for line in lines), lines
