"""Probe on the H200 for the chunk plans of fusedkern/chunk_plan.py: the loss-only tile shape
(C tokens × Vs vocabulary columns within 64 MiB) against one cuBLAS GEMM, and the row kernel's
bandwidth per chunk size. Prints one line per measurement; JSON lines to $OUT/probe_plan.jsonl.

    python scripts/probe_plan.py [TOKENS ...]
"""
import sys

import torch

import fusedkern  # noqa: F401  (sets up the runtime before the kernels import)
from fusedkern.chunked import LossOptions, chunked_loss
from fusedkern.kernels.ce_rows import ce_rows

from _probe_common import ms_quantiles, recorder

H, V = 4096, 128256
record = recorder("probe_plan.jsonl")


torch.manual_seed(0)
w = (torch.randn(V, H, device="cuda") / H**0.5).to(torch.bfloat16)
for T in [int(s) for s in sys.argv[1:]] or [4096, 32768]:
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    y = torch.randint(0, V, (T,), device="cuda")
    gemm = ms_quantiles(lambda: torch.mm(x, w.t()))[0]
    record(T=T, what="cublas_1gemm", ms=gemm)
    for C, Vs in [(256, V), (1024, 32768), (2048, 16384), (4096, 8192), (8192, 4096)]:
        ms = ms_quantiles(lambda: chunked_loss(x, w, None, y, None, LossOptions(), tile=(C, Vs)))[0]
        record(T=T, what=f"loss_tiles_{C}x{Vs}", ms=ms, ratio=ms / gemm)
        buf = torch.empty(C * Vs, device="cuda", dtype=torch.bfloat16)

        def gemms_only():  # the same tiles' GEMMs, no statistics: splits the overhead
            for c0 in range(0, T, C):
                for v0 in range(0, V, Vs):
                    v1 = min(v0 + Vs, V)
                    torch.mm(x[c0:c0 + C], w[v0:v1].t(), out=buf[: C * (v1 - v0)].view(C, v1 - v0))
        ms = ms_quantiles(gemms_only)[0]
        record(T=T, what=f"loss_tiles_{C}x{Vs}_gemms_only", ms=ms, ratio=ms / gemm)
        del buf
    del x
for C in (1024, 4096):
    z = torch.randn(C, V, device="cuda", dtype=torch.bfloat16) * 3
    stats = torch.empty(2, C, device="cuda"); loss = torch.empty(C, device="cuda")
    one = torch.ones(1, device="cuda")
    common = dict(class_weight=None, class_weight_sum=None, ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
                  softcap=None)
    y = torch.randint(0, V, (C,), device="cuda")
    ms = ms_quantiles(lambda: ce_rows(z, y, loss=loss, stats=stats, grad=one, compute_stats=True, **common))[0]
    record(C=C, what="row_kernel_stats_and_grad", ms=ms, GBps=3 * C * V * 2 / ms / 1e6)
    ms = ms_quantiles(lambda: ce_rows(z, y, loss=loss, stats=stats, grad=None, compute_stats=True, **common))[0]
    record(C=C, what="row_kernel_stats_only", ms=ms, GBps=C * V * 2 / ms / 1e6)
    ms = ms_quantiles(lambda: z.mul_(1.0))[0]
    record(C=C, what="torch_inplace_mul_reference", ms=ms, GBps=2 * C * V * 2 / ms / 1e6)
