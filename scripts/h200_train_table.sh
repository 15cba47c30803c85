#!/usr/bin/env bash
# The training-step table of issue 16 (item 5): examples/train_sft.py at the llama3-8b-2l preset
# (Llama-3-8B's head and 2 of its decoder layers, 8192 tokens a sequence, micro-batch 2, 2 micro-batches
# a step, bf16 autocast on fp32 weights, AdamW) with each head+loss implementation -- unpatched (hf),
# Liger-Kernel 0.8.5's fused linear cross entropy, cut-cross-entropy 25.1.1, fusedkern -- one process
# each (so each peak memory is its own), in a shuffled order, each under a timeout:
#
#   scripts/h200_train_table.sh OUTDIR        # carry .whl/liger085 .whl/cce (scripts/fetch_wheels.sh)
#
# Writes OUTDIR/train_table.csv (one row per implementation: step time p20/p50/p80 after the warm-up
# steps, tokens/s, peak MiB, first and final loss, versions, commit, fp32_dw), OUTDIR/train_<impl>.log
# and OUTDIR/train_table.log. Same seed, init and data in every process: the first losses must agree
# (bf16 autocast), checked at the end. Knobs (environment): STEPS (11), WARMUP (3), BATCH (preset's 2;
# 1 if hf runs out of memory), GRAD_ACCUM (2), LAYERS (2), CAP_S (75 s a run: the first step JIT-compiles
# and autotunes), IMPLS ("fusedkern hf liger cce").
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/device_common.sh"
device_setup "${1:?usage: scripts/h200_train_table.sh OUTDIR}"
install_wheels "${TMPDIR:-/tmp}"/site_train .whl/liger085 .whl/cce
log="$outdir/train_table.log"
{
    echo "h200_train_table.sh commit=$(git rev-parse --short HEAD 2>/dev/null) $(date -u +%FT%TZ)"
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv
    python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__)"
    python3 -c "import importlib.metadata as m; print(*(f'{d} {m.version(d)}' for d in ('liger-kernel', 'cut-cross-entropy')))" \
        || echo "liger-kernel / cut-cross-entropy missing: carry .whl/liger085 .whl/cce"
} 2>&1 | tee "$log"

csv="$outdir/train_table.csv"
cmd=(python3 examples/train_sft.py --device cuda --preset llama3-8b-2l --steps "${STEPS:-11}"
     --warmup-steps "${WARMUP:-3}" --grad-accum "${GRAD_ACCUM:-2}" --layers "${LAYERS:-2}" --csv "$csv")
[ -n "${BATCH:-}" ] && cmd+=(--batch-size "$BATCH")
run_shuffled "$log" train "${CAP_S:-75}" 5 "${IMPLS:-fusedkern hf liger cce}" "${cmd[@]}"

# loss sanity: same seed, init and data, so the first losses agree to ~1e-2 under bf16 autocast
python3 - "$csv" <<'EOF' 2>&1 | tee -a "$log"
import csv, sys
try:
    rows = list(csv.DictReader(open(sys.argv[1])))
except FileNotFoundError:
    sys.exit("no train_table.csv: every run failed")
for r in rows:
    print(f"{r['loss_impl']:>10}: first loss {r['first_loss']}, final {r['final_loss']}, p50 {r['step_ms_p50']} ms, "
          f"{float(r['tokens_per_s']):.0f} tokens/s, peak {r['peak_mib']} MiB, fp32 dW {r['fp32_dw']}")
first = [float(r["first_loss"]) for r in rows]
spread = max(first) - min(first) if first else 0.0
print(f"first-loss spread {spread:.2e}: " + ("OK" if spread <= 1e-2 else "MISMATCH (> 1e-2): the runs differ"))
EOF
echo "h200_train_table.sh done in $((SECONDS - start)) s; failures: ${failures[*]:-none}" | tee -a "$log"
ls -l "$outdir"
