#!/usr/bin/env bash
# The measurements the code after the last H200 call still needs, in priority order, for one device
# call (about 8 minutes; each step capped so that a slow one cannot starve the rest):
#
#   scripts/next_device_call.sh OUTDIR
#
# 1. the GPU tests (the row kernel's statistics changed in f820271; compiled offline, never run)
# 2. scripts/probe_host.py: what the host-side syncs and impl="auto"'s memory query cost per step
# 3. scripts/profile_ce.py: kernel time per category and timeline gaps from the profiled run itself
# 4. cross-entropy and SimPO, full mode, with both floors (random G and the true ∂L/∂z)
# Needs the wheels of scripts/fetch_wheels.sh in .whl/ for Liger (step 4); set FUSEDKERN_GIT_COMMIT.
set -uo pipefail
out="${1:?usage: scripts/next_device_call.sh OUTDIR}"
mkdir -p "$out" && out="$(cd "$out" && pwd)"
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
site=/tmp/site_liger085
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/liger085/*.whl .whl/cce/*.whl \
    || echo "no competitor wheels: Liger and CCE will be skipped"
timeout 150 python3 -m pytest -m gpu -q -x -p no:xdist -o addopts="" 2>&1 | tail -15 | tee "$out/gpu_tests.log"
OUT="$out" timeout 60 python3 scripts/probe_host.py 2>&1 | tee "$out/probe_host.log" | grep -v -i warn
OUT="$out" timeout 80 python3 scripts/profile_ce.py 2>&1 | tee "$out/profile.log" | grep -v -i warn
timing="--warmup 2 --reps 20 --min-reps 5 --max-case-s 1.0 --no-progress --modes full"
PYTHONPATH="$site:$PYTHONPATH" timeout 120 python3 -m fusedkern.bench ce --tokens 4096 8192 16384 32768 $timing \
    --providers cublas_3gemm cublas_3gemm_real_grad huggingface_bf16 fusedkern_chunked fusedkern_chunked_lean liger \
    --out "$out/ce_floors.csv" 2>&1 | tee "$out/ce_floors.log" | grep -A9 "ms_p50 (×"
PYTHONPATH="$site:$PYTHONPATH" timeout 110 python3 -m fusedkern.bench simpo --batch 2 4 8 16 $timing \
    --providers cublas_3gemm cublas_3gemm_real_grad fusedkern_chunked fusedkern_chunked_lean liger \
    --out "$out/simpo_floors.csv" 2>&1 | tee "$out/simpo_floors.log" | grep -A8 "ms_p50 (×"
ls -l "$out"
