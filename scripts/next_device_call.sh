#!/usr/bin/env bash
# The GPU checks to repeat after any change to the kernels, in one device call (≤ 8 minutes):
#
#   scripts/next_device_call.sh OUTDIR
#
# 1. the fused strategy's GPU tests (`tests/test_fused_ce.py -m gpu`, 120–160 s: they autotune every
#    config on first use)
# 2. the rest of the GPU tests (75–150 s; the first run on a fresh machine compiles every kernel)
# 3. SimPO at batch 8 and 16 with the providers' reps interleaved (`simpo_interleaved_8_16.csv`)
# Last run: calls S–U at c6bd1ee, and call V (fused tests, confident-target test) at 4a7f9d1, the
# fused strategy's last change (data/measured/h200/README.md): nothing
# is pending. `scripts/h200_measure.sh` re-measures the tables.
# Open leads for the next device time, each a measured probe result not yet tried in a sweep:
# - loss only: 4096 × 8192 tiles ran 1.9 % faster than the shipped 2048 × 16384 at 8192 tokens (and
#   1.1 % at 4096; the shipped shape was fastest at 32768) in `probe_loss_tiles.jsonl`: a tile shape
#   per token count, re-measured side by side with `cublas_1gemm`
# - row kernel at C = 4096: one program per row with the second pass reversed ran 12 % faster than the
#   shipped split kernel (0.78 against 0.89 ms, `probe_rows.jsonl`), ~0.5 % of a default-mode chunk;
#   it would need the loss options ported into that layout
set -uo pipefail
out="${1:?usage: scripts/next_device_call.sh OUTDIR}"
mkdir -p "$out" && out="$(cd "$out" && pwd)"
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
timeout 300 python3 -m pytest -m gpu tests/test_fused_ce.py -q -p no:xdist -o addopts="" --durations=5 2>&1 \
    | tail -20 | tee "$out/gpu_tests_fused.log"
timeout 240 python3 -m pytest -m gpu -q -p no:xdist -o addopts="" --ignore=tests/test_fused_ce.py 2>&1 \
    | tail -20 | tee "$out/gpu_tests_rest.log"
site_liger="${TMPDIR:-/tmp}"/site_liger085  # the competitors travel as wheels (scripts/fetch_wheels.sh)
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site_liger" .whl/liger085/*.whl .whl/cce/*.whl
PYTHONPATH="$site_liger:$PYTHONPATH" timeout 120 python3 -m fusedkern.bench simpo --batch 8 16 --modes full --interleave --no-progress \
    --providers cublas_3gemm cublas_3gemm_real_grad fusedkern_chunked fusedkern_chunked_lean fusedkern_chunked_lean_c2048 \
    liger --out "$out/simpo_interleaved_8_16.csv" 2>&1 | tail -8
ls -l "$out"
