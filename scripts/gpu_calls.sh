#!/usr/bin/env bash
# The GPU calls of issues 31 and 32, priority-ordered, each step capped and its results packed as it ends
# (a call cut short still brings back what finished). A device call returns at most 8 files, so every log,
# CSV and JUnit report goes into one results_<part>.tgz under OUTDIR, beside the Triton cache.
#
#   scripts/gpu_calls.sh OUTDIR cold    # carry .whl/qa .whl/liger085: the Gluon probe against cuBLAS; the whole
#                                       # GPU suite from an empty Triton cache (wall time, passed/failed), the quick
#                                       # selection on its cache, then from an empty one; the suite's cache packed
#                                       # into OUTDIR/triton_cache.tar.xz
#   scripts/gpu_calls.sh OUTDIR table   # carry .whl/qb .whl/liger085, on the machine cold or probe left warm: the
#                                       # honest table at 8192 tokens, dense and masked 50 (QuACK, Liger CuTe and
#                                       # Triton, Transformers' loss, the seed baseline, peers +gather, both
#                                       # floors), the loss-only and log-prob pass, masked 30/70; one size and
#                                       # workload a process
#   scripts/gpu_calls.sh OUTDIR rest    # carry .whl/liger085 .whl/trl, right after table (QuACK still unpacked): the
#                                       # same at 32768, then 16384 (TABLE_SIZES overrides), with TRL's fused LM
#                                       # head (its wheels do not fit beside QuACK's halves in one call's 64 MiB)
#   scripts/gpu_calls.sh OUTDIR warm    # carry .triton_cache: the suite and the quick selection with the cache
#   scripts/gpu_calls.sh OUTDIR check   # carry .triton_cache .whl/liger085 .whl/trl: the suite on the cache, then the
#                                       # dense table alone at TABLE_SIZES (default 16384) without QuACK: one short
#                                       # call that checks a change's correctness and its speed
#   scripts/gpu_calls.sh OUTDIR logprobs  # carry .triton_cache .whl/liger085 .whl/trl: the Gluon log-prob pass's GPU
#                                       # tests, the loss-only table at 8192, 32768, 4096, 16384 tokens (TRL's head
#                                       # beside it), the whole suite
#   scripts/gpu_calls.sh OUTDIR profile   # carry as logprobs: the chunked step's kernel profile, chunk_tokens=8192
#                                       # and TRL's head beside the default at 16384 tokens (run as part `protocol`
#                                       # with the retired primed protocol's comparison: data/measured/h100/README.md)
#   scripts/gpu_calls.sh OUTDIR probe   # carry .whl/qa .whl/liger085 .triton_cache (instead of cold, once the
#                                       # cold suite is measured): the whole suite on the carried cache, Gemma-2's
#                                       # counted memory, the loss-only pass at 4096 tokens (and the Gluon probe's
#                                       # GLUON_CONFIGS when set); table follows it on the same warm machine
#   scripts/gpu_calls.sh OUTDIR preference  # carry .whl/liger085: every loss type of linear_preference_loss against
#                                       # TRL's materialized fp32 computation and Liger 0.8.5's chunked losses, the
#                                       # cuBLAS floors in the same shuffled rounds (Llama 3's head, bf16, seq 1024,
#                                       # dense; PREF_BATCHES, default "2 4 8 16"; PREF_MODES, default "full";
#                                       # PREF_LIGER_REF_MODEL=1 adds Liger's DPO/KTO with a reference model)
#   scripts/gpu_calls.sh OUTDIR anchored  # carry .triton_cache .whl/liger085 .whl/trl: issue 47's first call after
#                                       # 2026-12-08: the GPU tests of what changed without a GPU (every kernel
#                                       # compiled once across token counts, the Gluon producer's included; the
#                                       # anchored pass, GRPO, the row-count GEMMs tuned per token class, the fused
#                                       # strategy), the in-line overlap probes (`probes/gluon_epilogue_wg.py`,
#                                       # overlap128 and packed256: checked against the library producer, timed
#                                       # beside cuBLAS), then the whole suite
#
# QuACK's CUDA library travels in two halves (scripts/fetch_wheels.sh --quack): call cold leaves .whl/qa's part
# in $TMPDIR/quack_parts, call table adds .whl/qb's and installs QuACK (the wheels into an empty target first,
# then the cu13 files: the other order loses them), so table must land on the machine cold left warm.
# CALL_BUDGET_S (default 585) is the call's wall-time limit: a step's cap shrinks to what is left of it.
set -uo pipefail
usage="usage: scripts/gpu_calls.sh OUTDIR cold|probe|table|rest|warm|check|logprobs|profile|preference|anchored"
part="${2:?$usage}"
source "$(dirname "${BASH_SOURCE[0]}")/device_common.sh"
device_setup "${1:?$usage}"
budget=${CALL_BUDGET_S:-585}
# QuACK's and Liger's CuTe DSL kernels compiled once per machine, not once per bench process
export CUTE_DSL_CACHE_DIR="${TMPDIR:-/tmp}/cute_dsl_cache"
res="${TMPDIR:-/tmp}/gpu_results_$part"
rm -rf "$res" && mkdir -p "$res"
site="${TMPDIR:-/tmp}"/site_gpu
install_wheels "$site" .whl/liger085 .whl/trl  # TRL's fused LM head (trl 1.16, transformers 5.25) where carried
install_quack

pack() { tar czf "$outdir/results_$part.tgz" -C "$res" . ; }
{
    echo "gpu_calls.sh part=$part commit=$(git rev-parse --short HEAD 2>/dev/null) $(date -u +%FT%TZ)"
    echo "quack installed: ${quack_path:-no}"
    nvidia-smi --query-gpu=name,clocks.max.sm,power.limit,memory.total --format=csv
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    python3 -m pip list 2>/dev/null | grep -iE "^(liger|quack|nvidia-cutlass|transformers|pytest-xdist|trl|peft) "
} > "$res/environment.log" 2>&1
cat "$res/environment.log"

# step NAME CAP_S COMMAND...: one step, capped at CAP_S or what is left of the call's budget; logged, timed
step() {
    local name="$1" cap="$2"
    shift 2
    local left=$((budget - (SECONDS - start) - 20))
    [ "$left" -lt "$cap" ] && cap=$left
    if [ "$cap" -lt 20 ]; then
        echo "== $name: skipped, $left s left" | tee -a "$res/steps.log"
        return
    fi
    local t0=$SECONDS
    echo "== $name (cap $cap s): $*" | tee -a "$res/$name.log"
    timeout -k 10 "$cap" "$@" >> "$res/$name.log" 2>&1
    local status=$?
    echo "== $name: exit $status after $((SECONDS - t0)) s (total $((SECONDS - start)) s)" | tee -a "$res/$name.log" \
        "$res/steps.log"
    tail -n 3 "$res/$name.log" | head -n 2
    [ "$status" -eq 0 ] || failures+=("$name:$status")
    pack
}

# the GPU suite: three workers share the GPU (compilation, most of a cold run, is CPU work: 16 cores)
suite() {  # suite NAME [pytest args]
    local name="$1"
    shift
    step "$name" "${SUITE_CAP_S:-480}" python3 -m pytest -m gpu -o addopts="" -p no:cacheprovider \
        -W ignore::DeprecationWarning -n 3 --dist loadfile -q -rfE --durations=30 --continue-on-collection-errors \
        --junitxml="$res/$name.xml" "$@"
}

timing="--warmup 2 --reps 12 --min-reps 5 --max-case-s 1.0 --protocol shuffled --no-progress"
peers="huggingface_bf16 transformers_loss liger liger_cute_sm90 quack trl_fused_lm_head"
gathered="huggingface_bf16_gather transformers_loss_gather liger_gather liger_cute_sm90_gather quack_gather"
fk_masked="fusedkern_chunked fusedkern_chunked_counted fusedkern_chunked_device_count"
# the loss-only pass and the RL log-prob pass (temperature 0.7, entropy) under no_grad, against one GEMM over all
# rows and over the valid rows (issue 31 item 3)
loss_only="cublas_1gemm cublas_1gemm_valid fusedkern_chunked fusedkern_chunked_counted fusedkern_tile_pass
    fusedkern_tile_pass_counted fusedkern_logprobs fusedkern_logprobs_counted fusedkern_logprobs_tile_pass
    fusedkern_logprobs_tile_pass_counted liger_cute_sm90_logprobs trl_logprobs huggingface_bf16 transformers_loss"
gluon_configs=${GLUON_CONFIGS:-}

# loss_only_step TOKENS CAP_S: the loss-only table at one size, dense and half-ignored, appended to one CSV
loss_only_step() {
    # shellcheck disable=SC2086
    step "ce_loss_only_$1" "$2" python3 -m fusedkern.bench ce --head llama3 --tokens "$1" $timing --modes loss_only \
        --workload dense masked_50 --providers $loss_only --append --out "$res/ce_llama3_loss_only.csv"
}

if [ "$part" = cold ]; then
    # issue 31 item 5 first: the Gluon logits GEMM with the row-statistics epilogue against cuBLAS; the probe checks
    # each config in its own process (a crashed pipeline loses only its config), then times the ones that passed
    export TRITON_CACHE_DIR="${TMPDIR:-/tmp}/tc_gluon"
    step gluon_logits_stats 180 env TRITON_INTERPRET=0 python3 probes/gluon_logits_stats.py --bench \
        --tokens 4096,8192 --out "$res/gluon_logits_stats.csv" \
        --configs 128x256x64s4coop,128x256x64s4coopg8,128x128x64s6c2,128x128x64s6c1,128x256x64s4coopg4
    triton_cache_restore "${TMPDIR:-/tmp}/tc_suite"
    SUITE_CAP_S=400 suite gpu_suite_cold tests/
    # the quick selection on the cache the suite filled: its time with a carried cache
    SUITE_CAP_S=80 suite gpu_quick_warm --gpu-quick tests/
    # fusedkern alone (no peer needs QuACK's second half): the counted paths' peak memory against the dense
    # path's on Gemma-2's head (issue 31 item 2)
    # shellcheck disable=SC2086
    step ce_gemma2_counted 80 python3 -m fusedkern.bench ce --head gemma2 --tokens 6144 $timing --modes full \
        --workload dense masked_50 --providers cublas_3gemm cublas_3gemm_valid $fk_masked \
        --out "$res/ce_gemma2_counted.csv"
    triton_cache_save "$TRITON_CACHE_DIR" "$outdir/triton_cache.tar.xz" | tee -a "$res/steps.log"
    triton_cache_restore "${TMPDIR:-/tmp}/tc_quick"
    SUITE_CAP_S=200 suite gpu_quick_cold --gpu-quick tests/
elif [ "$part" = probe ]; then
    export TRITON_CACHE_DIR="${TMPDIR:-/tmp}/tc_gluon"
    if [ -n "${GLUON_CONFIGS:-}" ]; then
        step gluon_logits_stats 170 env TRITON_INTERPRET=0 python3 probes/gluon_logits_stats.py --bench \
            --tokens 4096,8192 --out "$res/gluon_logits_stats.csv" --configs "$gluon_configs"
    fi
    triton_cache_restore "${TMPDIR:-/tmp}/tc_suite" >> "$res/steps.log"
    # the whole GPU suite on the carried cache (the Gluon loss-only pass is the default on sm_90), the counted
    # paths' peak memory on Gemma-2's head, then the loss-only table at 4096 tokens; table follows on this machine
    SUITE_CAP_S=330 suite gpu_suite_warm tests/
    # shellcheck disable=SC2086
    step ce_gemma2_counted 80 python3 -m fusedkern.bench ce --head gemma2 --tokens 6144 $timing --modes full \
        --workload dense masked_50 --providers cublas_3gemm cublas_3gemm_valid $fk_masked \
        --out "$res/ce_gemma2_counted.csv"
    loss_only_step 4096 100
    triton_cache_save "$TRITON_CACHE_DIR" "$outdir/triton_cache.tar.xz" | tee -a "$res/steps.log"
elif [ "$part" = logprobs ]; then
    # the Gluon log-prob pass (temperature, entropy): its GPU tests, the loss-only table at every size (Liger's CuTe
    # kernel only where QuACK's parts were carried), then the whole suite
    triton_cache_restore "${TMPDIR:-/tmp}/tc_suite" >> "$res/steps.log"
    SUITE_CAP_S=120 suite gpu_gluon_loss_only tests/test_gluon_loss_only.py
    for tokens in 8192 32768 4096 16384; do loss_only_step "$tokens" 60; done
    SUITE_CAP_S=300 suite gpu_suite_warm tests/
    triton_cache_save "$TRITON_CACHE_DIR" "$outdir/triton_cache.tar.xz" | tee -a "$res/steps.log"
elif [ "$part" = profile ]; then
    triton_cache_restore "${TMPDIR:-/tmp}/tc_suite" >> "$res/steps.log"
    # where the chunked step's time goes beside the floor's (kernel time per category, idle time)
    step profile_ce 90 python3 probes/profile_ce.py --tokens 8192 16384 --out "$res/profile_ce.csv"
    # chunk_tokens=8192 and TRL's fused head beside the default at 16384 tokens (dense)
    # shellcheck disable=SC2086
    step ce_dense_16384 150 python3 -m fusedkern.bench ce --head llama3 --tokens 16384 $timing --modes full \
        --workload dense --providers cublas_3gemm fusedkern_chunked fusedkern_chunked_c8192 $peers \
        --append --out "$res/ce_llama3_dense.csv"
elif [ "$part" = anchored ]; then
    triton_cache_restore "${TMPDIR:-/tmp}/tc_suite" >> "$res/steps.log"
    SUITE_CAP_S=180 suite gpu_changed tests/test_linear_cross_entropy.py tests/test_anchored_wiring.py \
        tests/test_anchored_exp.py tests/test_grpo.py tests/test_rowcount_gemm.py tests/test_num_valid_tokens.py \
        tests/test_fused_ce.py
    step overlap 150 python3 probes/gluon_epilogue_wg.py --gpu --out "$res" --heads qwen3,llama1b,llama8b \
        --tokens 8192,16384 --rounds 10 --kernels overlap128,packed256
    SUITE_CAP_S=300 suite gpu_suite_warm tests/
    triton_cache_save "$TRITON_CACHE_DIR" "$outdir/triton_cache.tar.xz" | tee -a "$res/steps.log"
elif [ "$part" = preference ]; then
    # (data/measured/h100/preference_shuffled.csv); warm-up 2: the last warm-up rep, which sets the rep count, runs
    # after Liger's torch.compile and Triton's JIT
    pref_providers="cublas_1gemm cublas_3gemm fusedkern_chunked fusedkern_chunked_lean trl_fp32 liger"
    [ "${PREF_LIGER_REF_MODEL:-0}" = 1 ] && pref_providers="$pref_providers liger_ref_model"
    # shellcheck disable=SC2086
    step preference 540 python3 -m fusedkern.bench preference --batch ${PREF_BATCHES:-2 4 8 16} --seq 1024 \
        --head llama3 --dtype bfloat16 --workload dense --loss-types sigmoid ipo hinge robust cpo simpo orpo kto \
        --providers $pref_providers --modes ${PREF_MODES:-full} --warmup 2 --reps 6 --min-reps 4 --max-case-s 0.6 \
        --protocol shuffled --no-progress --out "$res/preference_shuffled.csv"
    grep -h "CROSS-CHECK FAILED" "$res/preference.log" && echo "fusedkern and trl_fp32 losses disagree (above)"
elif [ "$part" != warm ] && [ -d "${TMPDIR:-/tmp}/tc_suite" ]; then
    # table and rest on the machine cold left warm: the suite's cache is still there
    export TRITON_CACHE_DIR="${TMPDIR:-/tmp}/tc_suite" TRITON_CACHE_AUTOTUNING=1
else
    triton_cache_restore "${TMPDIR:-/tmp}/tc_warm" >> "$res/steps.log"  # not in a pipe: it exports
    if [ "$part" = warm ]; then
        SUITE_CAP_S=300 suite gpu_suite_warm tests/
        SUITE_CAP_S=120 suite gpu_quick_warm --gpu-quick tests/
    elif [ "$part" = check ]; then
        SUITE_CAP_S=240 suite gpu_suite_warm tests/
        for tokens in ${TABLE_SIZES:-16384}; do
            # shellcheck disable=SC2086
            step "ce_dense_$tokens" 150 python3 -m fusedkern.bench ce --head llama3 --tokens "$tokens" $timing \
                --modes full --workload dense --providers cublas_3gemm fusedkern_chunked fusedkern_chunked_c8192 \
                $peers --append --out "$res/ce_llama3_dense.csv"
        done
    fi
fi
if [ "$part" = table ] || [ "$part" = rest ]; then
    # One size and workload per bench process, appended to one CSV per workload: the bench writes a size only
    # once all its providers warmed up and ran. On 2026-12-06 (H100) dense and masked_50 together at 8192 tokens
    # (16 providers) wrote nothing in 200 s; each alone had finished at 4096 tokens in 150-170 s. Each provider's
    # warm-up time is in the step's log. The CuTe DSL's compiled kernels are shared between the processes
    # (CUTE_DSL_CACHE_DIR, set at the top). table: 8192 tokens; rest (the next call): 32768, then 16384.
    sizes="8192"
    [ "$part" = rest ] && sizes="32768 16384"
    sizes="${TABLE_SIZES:-$sizes}"
    for tokens in $sizes; do
        # shellcheck disable=SC2086
        step "ce_dense_$tokens" 150 python3 -m fusedkern.bench ce --head llama3 --tokens "$tokens" $timing \
            --modes full --workload dense --providers cublas_3gemm fusedkern_chunked fusedkern_chunked_c8192 $peers \
            --append --out "$res/ce_llama3_dense.csv"
        # shellcheck disable=SC2086
        step "ce_masked_50_$tokens" 200 python3 -m fusedkern.bench ce --head llama3 --tokens "$tokens" $timing \
            --modes full --workload masked_50 --providers cublas_3gemm cublas_3gemm_valid $fk_masked $peers \
            $gathered --append --out "$res/ce_llama3_masked_50.csv"
        loss_only_step "$tokens" 110
    done
    if [ "$part" = table ]; then
        # shellcheck disable=SC2086
        step "ce_masked_30_70_8192" 150 python3 -m fusedkern.bench ce --head llama3 --tokens 8192 $timing \
            --modes full --workload masked_30 masked_70 --providers cublas_3gemm cublas_3gemm_valid $fk_masked \
            $peers $gathered --append --out "$res/ce_llama3_masked_30_70.csv"
    fi
fi
echo "gpu_calls.sh part $part done in $((SECONDS - start)) s; failures: ${failures[*]:-none}" | tee -a "$res/steps.log"
pack
ls -l "$outdir"
