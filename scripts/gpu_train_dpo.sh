#!/usr/bin/env bash
# The DPO training-table rows of issue 30 (item 4): examples/train_dpo.py at the llama3-8b-2l preset (Llama-3-8B's
# head and 2 of its decoder layers, 2048 tokens a sequence -- 1024 prompt, 1024 completion -- one pair, i.e. a
# chosen and a rejected row, a micro-batch, 2 micro-batches a step, a frozen reference copy, bf16 autocast on fp32
# weights, AdamW) with each log-prob implementation -- fusedkern's head (fusedkern.integrations.trl.patch()), TRL
# 1.16's own chunked fused head, and TRL with use_liger_kernel=True where Liger's wheel is carried (in TRL 1.16 that
# adds Liger's RoPE/RMSNorm/SwiGLU kernels; the log-probs stay TRL's head's) -- one process each (so each peak memory is its own), in a shuffled order, each under a timeout:
#
#   scripts/gpu_train_dpo.sh OUTDIR      # carry .whl/trl (scripts/fetch_wheels.sh --trl: trl 1.16.0, accelerate,
#                                        # datasets and the pure-Python dependencies the GPU machine lacks) and .whl/liger085
#
# Writes OUTDIR/train_dpo.csv (one row per implementation: step time p20/p50/p80 after the warm-up steps,
# tokens/s, peak MiB, first and final loss, protocol "sequential", workload "dpo_prompt_50", versions, commit),
# OUTDIR/dpo_<impl>.log and OUTDIR/train_dpo.log. Same seed, init and data in every process: the first losses
# must agree (log 2 at step 0, policy = reference), checked at the end. Knobs (environment): STEPS (11), WARMUP
# (3), GRAD_ACCUM (2), BATCH (1 pair), SEQ (2048), LAYERS (2), LOSS_TYPE (sigmoid), CAP_S (150 s a run),
# IMPLS ("fusedkern trl liger").
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/device_common.sh"
device_setup "${1:?usage: scripts/gpu_train_dpo.sh OUTDIR}"
install_wheels "${TMPDIR:-/tmp}"/site_dpo .whl/trl .whl/liger085
log="$outdir/train_dpo.log"
{
    echo "gpu_train_dpo.sh commit=$(git rev-parse --short HEAD 2>/dev/null) $(date -u +%FT%TZ)"
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv
    python3 -c "import torch, triton, transformers, trl, datasets; print('torch', torch.__version__, 'triton',
triton.__version__, 'transformers', transformers.__version__, 'trl', trl.__version__)" \
        || { echo "TRL / datasets missing: carry .whl/trl"; exit 1; }
    python3 -c "import importlib.metadata as m; print('liger-kernel', m.version('liger-kernel'))" \
        || echo "liger-kernel missing: its row is skipped (carry .whl/liger085)"
} 2>&1 | tee "$log"
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 1

read -r -a impls <<< "${IMPLS:-fusedkern trl liger}"
if ! python3 -c "import liger_kernel" 2>/dev/null; then
    impls=("${impls[@]/liger}")
fi
csv="$outdir/train_dpo.csv"
cmd=(python3 examples/train_dpo.py --device cuda --preset llama3-8b-2l --steps "${STEPS:-11}"
     --warmup-steps "${WARMUP:-3}" --grad-accum "${GRAD_ACCUM:-2}" --batch-size "${BATCH:-1}" --seq-len "${SEQ:-2048}"
     --layers "${LAYERS:-2}" --loss-type "${LOSS_TYPE:-sigmoid}" --csv "$csv")
run_shuffled "$log" dpo "${CAP_S:-150}" 8 "${impls[*]}" "${cmd[@]}"

python3 - "$csv" <<'EOF' 2>&1 | tee -a "$log"
import csv, math, sys
try:
    rows = list(csv.DictReader(open(sys.argv[1])))
except FileNotFoundError:
    sys.exit("no train_dpo.csv: every run failed")
for r in rows:
    print(f"{r['loss_impl']:>10}: first loss {r['first_loss']}, final {r['final_loss']}, p50 {r['step_ms_p50']} ms, "
          f"{float(r['tokens_per_s']):.0f} tokens/s, peak {r['peak_mib']} MiB")
bad = [r["loss_impl"] for r in rows if abs(float(r["first_loss"]) - math.log(2)) > 1e-3]
print("first losses " + ("all log 2: OK" if not bad else f"MISMATCH (not log 2): {bad}"))
EOF
echo "gpu_train_dpo.sh done in $((SECONDS - start)) s; failures: ${failures[*]:-none}" | tee -a "$log"
ls -l "$outdir"
