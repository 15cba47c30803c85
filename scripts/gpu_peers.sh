#!/usr/bin/env bash
# The 2026 peers on every head of the head-floor targets (issues 47 and 48): fusedkern beside QuACK 0.6.5 and Liger
# 0.8.5's CuTe SM90 kernels, with the GEMM floors in the same bench process, on H 1024 / V 151936 (Qwen3-0.6B's head),
# H 2048 / V 128256 (Llama-3.2-1B's) and H 4096 / V 128256 (Llama-3-8B's), 8192 / 16384 / 32768 tokens; and the two
# harnesses' floors (probes/probe_floor_values.py). QuACK's CUDA library travels in two halves
# (scripts/fetch_wheels.sh --quack), so the work takes two calls on one warm machine:
#
#   scripts/gpu_peers.sh OUTDIR floors   # carry .whl/qa .whl/liger085 (~61 MiB with the tree): leaves part aa in
#                                        # $TMPDIR/quack_parts and Liger in $TMPDIR/site_peers, then runs
#                                        # probes/probe_floor_values.py (no QuACK needed), ~3-4 min
#   scripts/gpu_peers.sh OUTDIR table    # carry .whl/qb (~60 MiB with the tree), on the machine `floors` left warm:
#                                        # installs QuACK 0.6.5 and runs the bench, one process per head and size
#
# Each bench process: `python -m fusedkern.bench ce --head HEAD --tokens T --modes full loss_only --providers
# cublas_1gemm cublas_3gemm fusedkern_chunked fusedkern_logprobs quack liger_cute_sm90 liger_cute_sm90_logprobs
# huggingface_bf16` (shuffled protocol, dense), appended to OUTDIR/peers3_ce_<head>.csv: dense CE forward + backward
# (× cublas_3gemm) and loss only (× cublas_1gemm: QuACK's eval pass), per-token log-probs at τ 0.7 with the entropy
# with and without a gradient. A refusal is a row ("refused: ..."): Liger's CuTe kernel at V 151936, QuACK's gradient
# where a chunk has `hidden` rows. The CuTe DSL compiles QuACK's and Liger's kernels once per shape (CUTE_DSL_CACHE_DIR
# keeps them for the machine): the first process of a head is the slow one. HEADS (default "qwen3_0p6b llama32_1b
# llama3") and TOKENS ("8192 16384 32768") choose the cases, CAP_S (150) caps each process, CALL_BUDGET_S (570) the
# call; what is not reached is listed as skipped, to run in a next `table` call on the same warm machine (the parts
# and Liger stay in $TMPDIR: carry nothing then). Copy the CSVs (and their JSON) to data/measured/h100/ and list them in
# its README.
set -uo pipefail
part="${2:?usage: scripts/gpu_peers.sh OUTDIR floors|table}"
source "$(dirname "${BASH_SOURCE[0]}")/device_common.sh"
device_setup "${1:?usage: scripts/gpu_peers.sh OUTDIR floors|table}"
budget=${CALL_BUDGET_S:-570}
export CUTE_DSL_CACHE_DIR="${TMPDIR:-/tmp}/cute_dsl_cache"
install_wheels "${TMPDIR:-/tmp}"/site_peers .whl/liger085
install_quack  # both halves gathered in $TMPDIR/quack_parts (by this call or an earlier one): QuACK installed
log="$outdir/peers_$part.log"
{
    echo "gpu_peers.sh part=$part $(date -u +%FT%TZ); quack: ${quack_path:-not installed}"
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    python3 -m pip list 2>/dev/null | grep -iE "^(liger|quack|nvidia-cutlass|nvidia-cuda-nvdisasm|cuda-python) "
} 2>&1 | tee "$log"

case "$part" in
floors)
    timeout -k 10 $((budget - 30)) python3 probes/probe_floor_values.py --out "$outdir/floor_values.csv" 2>&1 \
        | tee -a "$log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || failures+=("probe_floor_values")
    ;;
table)
    [ -n "$quack_path" ] || echo "QuACK is not installed: carry .whl/qb after a floors call on this machine" \
        | tee -a "$log"
    skipped=()
    for head in ${HEADS:-qwen3_0p6b llama32_1b llama3}; do
        for tokens in ${TOKENS:-8192 16384 32768}; do
            left=$((budget - (SECONDS - start)))
            cap=$(( ${CAP_S:-150} < left - 15 ? ${CAP_S:-150} : left - 15 ))
            if [ "$cap" -lt 40 ]; then skipped+=("$head/$tokens"); continue; fi
            t0=$SECONDS
            echo "== $head $tokens tokens (cap $cap s)" | tee -a "$log"
            timeout -k 10 "$cap" python3 -m fusedkern.bench ce --head "$head" --tokens "$tokens" --modes full \
                loss_only --providers cublas_1gemm cublas_3gemm fusedkern_chunked fusedkern_logprobs quack \
                liger_cute_sm90 liger_cute_sm90_logprobs huggingface_bf16 --no-progress --append \
                --out "$outdir/peers3_ce_$head.csv" > "$outdir/peers3_${head}_$tokens.log" 2>&1
            status=$?
            grep -E "refus|skipping|Error|error" "$outdir/peers3_${head}_$tokens.log" | sort -u | head -n 12 \
                | tee -a "$log"
            tail -n 24 "$outdir/peers3_${head}_$tokens.log" | tee -a "$log"
            echo "== $head $tokens: exit $status after $((SECONDS - t0)) s (total $((SECONDS - start)) s)" \
                | tee -a "$log"
            [ "$status" -eq 0 ] || failures+=("$head/$tokens:$status")
        done
    done
    echo "skipped (budget): ${skipped[*]:-none}" | tee -a "$log"
    ;;
*)
    echo "unknown part $part: floors or table" | tee -a "$log"
    exit 2
    ;;
esac
echo "gpu_peers.sh $part done in $((SECONDS - start)) s; failures: ${failures[*]:-none}" | tee -a "$log"
