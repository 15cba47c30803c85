#!/usr/bin/env bash
# Where an SFT step's time goes (issue 48 item 2): scripts/gpu_step_profile.py on the GPU, both small models, the
# training table's four rows, one process, then the Triton cache packed for the next call.
#
#   scripts/gpu_step_profile.sh OUTDIR
#
# Carry what scripts/gpu_train_table.sh carries: .whl/trl and .whl/liger085 (scripts/fetch_wheels.sh --trl), and
# .triton_cache when an earlier call brought one back. One call, about 4-6 minutes (checkpoints ~20 s, then 8 runs of
# 2 warm-up steps and one profiled step, ~20-40 s each, the first ones compiling; the floor per model):
#
#   run(command="scripts/gpu_step_profile.sh $OUT", carry=[".whl/trl", ".whl/liger085"])
#
# Writes OUTDIR/step_time_breakdown.csv (copy it to data/measured/h100/, which notebook 10 reads),
# OUTDIR/step_profile.log (environment, each run's categories and biggest kernels) and OUTDIR/triton_cache.tar.xz.
# Knobs (environment): MODELS ("qwen3-0.6b llama-3.2-1b"), ROWS (all four), WARMUP (2), PHASE (the CSV's phase
# column, default after), BUDGET_S (540: no run starts after it), TINY (set: --tiny's shapes on CPU; how a CPU checks
# this driver: PATH=.venv/bin:$PATH TINY=1 ROWS=fusedkern scripts/gpu_step_profile.sh OUT_DIR).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/device_common.sh"
device_setup "${1:?usage: scripts/gpu_step_profile.sh OUTDIR}"
install_wheels "${TMPDIR:-/tmp}"/site_train_table .whl/trl .whl/liger085
triton_cache_restore "${TMPDIR:-/tmp}"/triton_step_profile
log="$outdir/step_profile.log"
{
    echo "gpu_step_profile.sh $(date -u +%FT%TZ)"
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv
} 2>&1 | tee "$log"
read -r -a models <<< "${MODELS:-qwen3-0.6b llama-3.2-1b}"
read -r -a rows <<< "${ROWS:-trl trl_liger fusedkern fusedkern_liger}"
python3 scripts/gpu_step_profile.py --checkpoints "${TMPDIR:-/tmp}"/train_table_checkpoints${TINY:+_tiny} ${TINY:+--tiny} \
    --model "${models[@]}" \
    --row "${rows[@]}" --warmup "${WARMUP:-2}" --phase "${PHASE:-after}" --budget-s "${BUDGET_S:-540}" \
    --out "$outdir/step_time_breakdown.csv" 2>&1 | grep -vE "^\{'|it/s\]|examples/s\]|Warning|warnings.warn" \
    | tee -a "$log"
[ "${PIPESTATUS[0]}" -eq 0 ] || failures+=("gpu_step_profile.py")
triton_cache_save "$TRITON_CACHE_DIR" "$outdir/triton_cache.tar.xz" | tee -a "$log"
echo "gpu_step_profile.sh done in $((SECONDS - start)) s; failures: ${failures[*]:-none}" | tee -a "$log"
