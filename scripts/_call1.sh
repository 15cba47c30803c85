set -x
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv
timeout 170 python3 -m pytest -m gpu -q -x -p no:xdist tests/test_linear_cross_entropy.py::test_gpu_default_plan_bf16 tests/test_simpo.py tests/test_linear_cross_entropy.py::test_gpu_weight_grad_precision_many_tokens 2>&1 | tail -15
timeout 90 python3 scripts/probe_plan.py 4096 32768 2>&1 | tail -20
T="--warmup 2 --reps 10 --min-reps 5 --max-case-s 0.6 --no-progress"
timeout 120 python3 -m fusedkern.bench ce --tokens 4096 8192 16384 32768 --providers cublas_1gemm cublas_3gemm fusedkern_chunked fusedkern_chunked_lean --modes full loss_only $T --out $OUT/ce_probe.csv 2>&1 | grep -v "^\s*$" | tail -40
timeout 90 python3 -m fusedkern.bench simpo --batch 2 4 8 16 --providers cublas_3gemm fusedkern_chunked fusedkern_chunked_lean --modes full $T --out $OUT/simpo_probe.csv 2>&1 | tail -20
