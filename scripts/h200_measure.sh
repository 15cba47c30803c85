#!/usr/bin/env bash
# Every measurement of the project on the GPU machine, in one call that fits its 10-minute limit.
#
#   scripts/h200_measure.sh OUTDIR [full|quick] [all|ce|simpo]
#
# Needs the wheels of scripts/fetch_wheels.sh in .whl/ (carried with the working tree: the GPU
# machine has no package index). Installs them into throwaway --target folders, one per Liger
# version (two versions cannot share one site), then runs, all with `python -m fusedkern.bench`:
#   1. ce        tokens 4096..32768, every provider, modes loss_only forward backward full
#   2. ce        liger-kernel 0.4.2 (the seed page's version), appended to the same ce.csv
#   3. simpo     batch 2..16 (rows = chosen + rejected) at seq 1024
#   4. accuracy  tokens 4096 and 32768 against the chunked fp64 truth (+ Liger 0.4.2, appended)
# Each writes OUTDIR/<sweep>.csv + .json (rewritten after every provider, so a sweep cut short by
# its time cap keeps what it finished) and OUTDIR/<sweep>.log. `quick`: fewer sizes and reps.
# The third argument splits the work over two device calls when one call has less time left:
# `ce` runs 1–2 and the chunk study (everything a cross-entropy ratio is divided by stays in one
# call), `simpo` runs 3–4.
#
# Time budget (the H200 anchors of data/reference/h200_anchors_2026-12-02.csv; fusedkern's own
# times are guesses): a case costs (warmup + reps + 1 memory run) × its wall time, reps sized to ~1 s per
# case. ce ≈ 130 s of timed work (CCE's 622 ms full at 32768 tokens is the largest single cost,
# HF bf16 170 ms, three GEMMs 154 ms), Liger 0.4.2 ≈ 25 s, simpo ≈ 50 s + Liger's torch.compile,
# accuracy ≈ 20 s, plus ~10 s start-up per process: about 6 minutes in all. The caps below
# (sum 520 s) keep the whole script under the 600 s limit even if an estimate is wrong.
set -uo pipefail

outdir="${1:?usage: scripts/h200_measure.sh OUTDIR [quick]}"
profile="${2:-full}"
parts="${3:-all}"
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"
mkdir -p "$outdir"
outdir="$(cd "$outdir" && pwd)"
cd "$repo"
export PYTHONUNBUFFERED=1

if [ "$profile" = quick ]; then
    ce_tokens="4096 8192"; simpo_batch="2 4"; accuracy_tokens="4096"
    timing="--warmup 1 --reps 5 --min-reps 3 --max-case-s 0.5"
else
    ce_tokens="4096 8192 16384 32768"; simpo_batch="2 4 8 16"; accuracy_tokens="4096 32768"
    timing="--warmup 2 --reps 20 --min-reps 5 --max-case-s 1.0"
fi
# Overrides, for a smoke test of this script on CPU (e.g. CE_TOKENS="8 16" SIMPO_SEQ=8
# BENCH_ARGS="--hidden 32 --vocab 97 --dtype float32 --device cpu"); unset on the GPU.
ce_tokens="${CE_TOKENS:-$ce_tokens}"
simpo_batch="${SIMPO_BATCH:-$simpo_batch}"
simpo_seq="${SIMPO_SEQ:-1024}"
accuracy_tokens="${ACCURACY_TOKENS:-$accuracy_tokens}"
extra="${BENCH_ARGS:-}"
# INTERLEAVE=1: the timing sweeps alternate the providers' reps (`--interleave`, so the GPU's thermal
# drift hits all alike) instead of timing one provider after the other (notebook 04, last section)
[ "${INTERLEAVE:-0}" = 1 ] && timing="$timing --interleave"

script_start=$SECONDS
{
    echo "h200_measure.sh profile=$profile repo=$repo $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    nvidia-smi || echo "(no nvidia-smi)"
    "$python" -c "import sys, torch, triton; print(sys.version, 'torch', torch.__version__,
        'cuda', torch.version.cuda, 'triton', triton.__version__)"
} 2>&1 | tee "$outdir/environment.log"

# Pure-Python wheels, no dependency resolution (torch, triton, transformers are already here).
site085="${TMPDIR:-/tmp}"/site_liger085
site042="${TMPDIR:-/tmp}"/site_liger042
rm -rf "$site085" "$site042"
"$python" -m pip install -q --no-index --no-deps --no-compile --target "$site085" \
    .whl/liger085/*.whl .whl/cce/*.whl || exit 1
"$python" -m pip install -q --no-index --no-deps --no-compile --target "$site042" \
    .whl/liger042/*.whl || exit 1

failures=()
# run NAME CAP_S SITE ARGS...: one sweep under a time cap, logged; a failure does not stop the rest.
# shellcheck disable=SC2086  # $extra is a list of flags, meant to split into words
run() {
    local name="$1" cap="$2" site="$3"
    shift 3
    local start=$SECONDS
    echo "== $name (cap ${cap} s): python -m fusedkern.bench $*" | tee -a "$outdir/$name.log"
    PYTHONPATH="$site:$repo${PYTHONPATH:+:$PYTHONPATH}" \
        timeout -k 10 "$cap" "$python" -m fusedkern.bench "$@" $extra --no-progress 2>&1 | tee -a "$outdir/$name.log"
    local status=$?
    echo "== $name: exit $status after $((SECONDS - start)) s (total $((SECONDS - script_start)) s)" \
        | tee -a "$outdir/$name.log"
    [ "$status" -eq 0 ] || failures+=("$name:$status")
}

# shellcheck disable=SC2086  # the size and timing lists are meant to split into words
{
    study="fusedkern_chunked_c512 fusedkern_chunked_c2048 fusedkern_chunked_c4096 fusedkern_chunked_c8192"
    study="$study fusedkern_chunked_lean_c512 fusedkern_chunked_lean_c2048 fusedkern_chunked_lean_c4096 fusedkern_chunked_lean_c8192"
    main_ce="cublas_1gemm cublas_3gemm cublas_3gemm_real_grad huggingface_bf16 torch_fp32_upcast fusedkern_chunked fusedkern_chunked_lean"
    main_ce="$main_ce fusedkern_fused liger cut_cross_entropy torch_linear_cross_entropy"
    if [ "$parts" != simpo ]; then
        run ce 230 "$site085" ce --tokens $ce_tokens $timing --providers $main_ce --out "$outdir/ce.csv"
        # the chunk-size / accumulation trade-off (full mode only), its own file
        run chunk_study 60 "$site085" ce --tokens $ce_tokens $timing --providers $study --modes full \
            --out "$outdir/chunk_study.csv"
        run ce_liger042 45 "$site042" ce --tokens $ce_tokens $timing --providers liger \
            --append --out "$outdir/ce.csv"
    fi
    if [ "$parts" != ce ]; then
        run simpo 130 "$site085" simpo --batch $simpo_batch --seq "$simpo_seq" $timing --out "$outdir/simpo.csv"
        run accuracy 90 "$site085" accuracy --tokens $accuracy_tokens --out "$outdir/accuracy.csv"
        run accuracy_liger042 25 "$site042" accuracy --tokens $accuracy_tokens --providers liger \
            --append --out "$outdir/accuracy.csv"
    fi
}

echo "h200_measure.sh done in $((SECONDS - script_start)) s; failures: ${failures[*]:-none}"
ls -l "$outdir"
[ "${#failures[@]}" -eq 0 ]
