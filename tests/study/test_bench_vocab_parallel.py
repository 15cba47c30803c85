"""scripts/bench_vocab_parallel.py runs end to end: a world of one and of two (gloo, CPU) at tiny sizes, and a
world of one on a GPU (NCCL). The script itself checks that fusedkern's loss equals the Megatron-style baseline's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench_vocab_parallel.py"
TINY = ["--tokens", "16", "--hidden", "8", "--vocab", "37", "--rounds", "2", "--warmup", "1"]


def run(cmd: list[str], out: Path) -> pd.DataFrame:
    env = {**os.environ, "MASTER_PORT": str(29600 + os.getpid() % 300)}
    proc = subprocess.run([*cmd, "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    df = pd.read_csv(out)
    assert {"fusedkern", "megatron_torch", "gemm3_shard"} <= set(df.provider)
    assert {"protocol", "workload", "world_size", "ms_p20", "ms_p50", "ms_p80"} <= set(df.columns)
    assert (df.ms_p20 <= df.ms_p50).all() and (df.ms_p50 <= df.ms_p80).all() and (df.ms_p20 > 0).all()
    assert out.with_suffix(".json").exists()
    return df


def test_world_of_one_on_cpu(tmp_path):
    df = run([sys.executable, str(SCRIPT), "--device", "cpu", *TINY], tmp_path / "vp.csv")
    assert (df.world_size == 1).all() and (df.shard_rows == 37).all()


def test_world_of_two_on_cpu(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--master-port", str(29900 + os.getpid() % 90)]
    df = run([*torchrun, str(SCRIPT), "--device", "cpu", *TINY], tmp_path / "vp.csv")
    assert (df.world_size == 2).all() and set(df.shard_rows) == {19}


@pytest.mark.gpu
def test_world_of_one_on_the_gpu(tmp_path):
    df = run([sys.executable, str(SCRIPT), "--tokens", "1024", "--hidden", "512", "--vocab", "32000", "--rounds", "3"],
             tmp_path / "vp.csv")
    assert df.peak_extra_mib.notna().all()
