#!/usr/bin/env bash
# What the shipped code has not yet had on the H200, for the next device call (≤ 8 minutes):
#
#   scripts/next_device_call.sh OUTDIR
#
# 1. the fused strategy's GPU tests (`tests/test_fused_ce.py -m gpu`, ~120 s: they autotune every
#    config on first use) at the final commit; they last passed at 98aebe3 (call M), and the fused
#    kernels are unchanged since, but the row kernels they share a module with are not
# 2. the rest of the GPU tests, whole (call P ran them at 5192267, call Q the race guard added after);
#    since then `ce_rows` leaves its copy of the target logits uninitialized (no zero fill): the race
#    guard and the bf16 checks have not run on that
# 3. SimPO at batch 8 and 16 with the providers' reps interleaved: `simpo_interleaved.csv` (call L)
#    stopped after batch 4
# The tables of README.md come from ce_final.csv / simpo_final.csv (call O), which measured the
# package code as shipped; `scripts/h200_measure.sh` re-measures everything.
set -uo pipefail
out="${1:?usage: scripts/next_device_call.sh OUTDIR}"
mkdir -p "$out" && out="$(cd "$out" && pwd)"
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
timeout 300 python3 -m pytest -m gpu tests/test_fused_ce.py -q -p no:xdist -o addopts="" --durations=5 2>&1 \
    | tail -20 | tee "$out/gpu_tests_fused.log"
timeout 180 python3 -m pytest -m gpu -q -p no:xdist -o addopts="" --ignore=tests/test_fused_ce.py 2>&1 \
    | tail -20 | tee "$out/gpu_tests_rest.log"
site_liger=/tmp/site_liger085  # the competitors travel as wheels (scripts/fetch_wheels.sh)
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site_liger" .whl/liger085/*.whl .whl/cce/*.whl
PYTHONPATH="$site_liger:$PYTHONPATH" timeout 120 python3 -m fusedkern.bench simpo --batch 8 16 --modes full --interleave --no-progress \
    --providers cublas_3gemm cublas_3gemm_real_grad fusedkern_chunked fusedkern_chunked_lean fusedkern_chunked_lean_c2048 \
    liger --out "$out/simpo_interleaved_8_16.csv" 2>&1 | tail -8
ls -l "$out"
