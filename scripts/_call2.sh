export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 160 python3 -m pytest -m gpu -q -x -p no:xdist -o addopts="" tests/test_linear_cross_entropy.py::test_gpu_default_plan_bf16 tests/test_simpo.py tests/test_linear_cross_entropy.py::test_gpu_weight_grad_precision_many_tokens "tests/test_linear_cross_entropy.py::test_gpu_bf16_realistic" -k "not fused" 2>&1 | tail -8
timeout 100 python3 scripts/probe_plan.py 4096 32768 2>&1 | tail -20
T="--warmup 2 --reps 10 --min-reps 5 --max-case-s 0.6 --no-progress"
timeout 110 python3 -m fusedkern.bench ce --tokens 4096 32768 --providers cublas_1gemm cublas_3gemm fusedkern_chunked fusedkern_chunked_lean --modes full loss_only $T --out $OUT/ce_probe.csv 2>&1 | grep -A12 "^loss_only:"
