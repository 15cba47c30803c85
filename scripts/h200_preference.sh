#!/usr/bin/env bash
# The preference losses on the H200 (issue 17, item 6): every loss type of fusedkern.linear_preference_loss
# (sigmoid ipo hinge robust cpo simpo orpo kto) against TRL's materialized fp32 computation and Liger-Kernel
# 0.8.5's chunked losses, with the cuBLAS floors timed once per batch in the same shuffled rounds:
#
#   scripts/h200_preference.sh OUTDIR            # carry .whl/liger085: batches 2 4 8 16, one device call (≤ 240 s)
#   scripts/h200_preference.sh OUTDIR --quick    # batches 2 and 8 only (or PREF_QUICK=1)
#
# Llama 3's head (H 4096, V 128256), bf16, seq 1024, workload dense, mode full (PREF_MODES="forward full" adds
# the forward). Writes OUTDIR/preference_shuffled.csv, its .json sidecar, preference.log and
# environment.log. Without .whl/liger085 (scripts/fetch_wheels.sh) the liger rows are skipped, as the log says.
# Liger's DPO and KTO run reference-free (it takes a reference model, not reference log-probs: see
# fusedkern/study/providers.py, _preference_liger); PREF_LIGER_REF_MODEL=1 adds `liger_ref_model` (slower run).
set -uo pipefail
quick="${PREF_QUICK:-0}"
[ "${2:-}" = "--quick" ] && quick=1
source "$(dirname "${BASH_SOURCE[0]}")/device_common.sh"
device_setup "${1:?usage: scripts/h200_preference.sh OUTDIR [--quick]}"
install_wheels "${TMPDIR:-/tmp}"/site_preference .whl/liger085
{
    echo "h200_preference.sh quick=$quick commit=$(git rev-parse --short HEAD 2>/dev/null)" \
         "dirty=$(git status --porcelain 2>/dev/null | grep -vc '^??') $(date -u +%FT%TZ)"
    nvidia-smi --query-gpu=name,clocks.max.sm,power.limit,memory.total --format=csv
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    python3 -c "import importlib.metadata as m; print('liger-kernel', m.version('liger-kernel'))" 2>&1 | tail -1
} 2>&1 | tee "$outdir/environment.log"

batches="2 4 8 16"
[ "$quick" = 1 ] && batches="2 8"
modes="${PREF_MODES:-full}"
loss_types="sigmoid ipo hinge robust cpo simpo orpo kto"
providers="cublas_1gemm cublas_3gemm fusedkern_chunked fusedkern_chunked_lean trl_fp32 liger"
[ "${PREF_LIGER_REF_MODEL:-0}" = 1 ] && providers="$providers liger_ref_model"
# warm-up 2: the last warm-up rep, which sets the rep count, runs after Liger's torch.compile and Triton's JIT
timing="--warmup 2 --reps 6 --min-reps 4 --max-case-s 0.6 --protocol shuffled --no-progress"

# The estimate: per row of the batch, H200 full-step ms (data/measured/h200/simpo_shuffled.csv: floor 4.75,
# fusedkern 5.2, lean 6.3, materialized fp32 7.4, Liger 6.4 per row), times warm-up + reps + the memory run,
# Liger on 7 of the 8 loss types; plus ~60-120 s of start-up, Triton JIT and Liger's torch.compile (5 classes).
python3 - "$batches" <<'EOF'
import sys
rows = sum(int(b) for b in sys.argv[1].split())
runs = 2 + 6 + 1
per_row_ms = 4.75 + 8 * (5.2 + 6.3 + 7.4) + 7 * 6.4
print(f"estimate: {runs} runs x {rows} rows x {per_row_ms:.0f} ms = {runs * rows * per_row_ms / 1000:.0f} s of "
      f"timed steps (mode full), + ~60-120 s start-up and compilation")
EOF

cap=$((235 - (SECONDS - start)))
echo "== preference (cap $cap s)" | tee -a "$outdir/preference.log"
# shellcheck disable=SC2086
timeout -k 10 "$cap" python3 -m fusedkern.bench preference --batch $batches --seq 1024 --head llama3 \
    --dtype bfloat16 --workload dense --loss-types $loss_types --providers $providers --modes $modes $timing \
    --out "$outdir/preference_shuffled.csv" --overwrite 2>&1 | tee -a "$outdir/preference.log"
status=${PIPESTATUS[0]}
grep -h "CROSS-CHECK FAILED" "$outdir/preference.log" && echo "fusedkern and trl_fp32 losses disagree (above)"
echo "h200_preference.sh: exit $status after $((SECONDS - start)) s" | tee -a "$outdir/preference.log"
ls -l "$outdir"
exit "$status"
