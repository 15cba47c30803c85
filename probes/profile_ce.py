"""Where a chunked forward+backward spends its time on the GPU: torch.profiler's kernel times, summed
per category, next to the wall time from CUDA events. Writes one row per case and category to --out
(default $OUT/profile_ce.csv) and prints it.

    python probes/profile_ce.py [--tokens 4096 16384] [--out PATH]

Categories: `gemm` (cuBLAS/CUTLASS kernels), `row_kernel` (fusedkern's Triton row statistics and
gradient), `elementwise` (every other kernel: fills, casts, rescales, reductions), `gpu_idle` =
wall (a separate, unprofiled loop) − the sum of all kernels, and, from the profiled run alone,
`timeline_gaps` = time between its first kernel's start and last kernel's end not covered by any
kernel (launch gaps and host syncs) out of `timeline_span`; all in ms per forward+backward.
"""
import argparse
import csv
import os

import torch
from torch.profiler import ProfilerActivity, profile

import fusedkern
from fusedkern.study.workloads import make_ce_inputs, make_simpo_inputs

H, V = 4096, 128256
ITERS = 3


def category(name: str) -> str:
    low = name.lower()
    if "_row_" in low or "row_stats" in low or "row_finish" in low:
        return "row_kernel"
    if any(k in low for k in ("gemm", "cutlass", "nvjet", "sm90_xmma", "cublas")):
        return "gemm"
    return "elementwise"


def run_case(label: str, fn) -> list[dict]:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(ITERS):
        fn()
    end.record()
    torch.cuda.synchronize()
    wall_ms = start.elapsed_time(end) / ITERS
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(ITERS):
            fn()
        torch.cuda.synchronize()
    per_cat: dict[str, float] = {}
    for evt in prof.key_averages():
        us = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0.0)
        if us and evt.device_type == torch.autograd.DeviceType.CUDA:
            per_cat[category(evt.key)] = per_cat.get(category(evt.key), 0.0) + us / 1e3 / ITERS
    busy = sum(per_cat.values())
    # each kernel's name and time: which cuBLAS kernel each GEMM got (fp32-output dW against the floor's bf16)
    print(f"-- {label}: kernels, device time over {ITERS} steps")
    print(prof.key_averages().table(sort_by="device_time_total", row_limit=12, max_name_column_width=90), flush=True)
    rows = [dict(case=label, category=c, ms_per_iter=round(ms, 4)) for c, ms in sorted(per_cat.items())]
    rows.append(dict(case=label, category="gpu_idle", ms_per_iter=round(max(wall_ms - busy, 0.0), 4)))
    rows.append(dict(case=label, category="wall", ms_per_iter=round(wall_ms, 4)))
    # the same quantity from the profiled run alone (no second loop, no clock drift between them):
    # the kernels' timeline from the first start to the last end, minus the time covered by a kernel
    intervals = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                       if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    covered, reach = 0.0, None
    for begin, end in intervals:
        if reach is None or begin >= reach:
            covered += end - begin
            reach = end
        elif end > reach:
            covered += end - reach
            reach = end
    if intervals:
        span_us = max(end for _, end in intervals) - intervals[0][0]
        rows.append(dict(case=label, category="timeline_gaps", ms_per_iter=round((span_us - covered) / 1e3 / ITERS, 4)))
        rows.append(dict(case=label, category="timeline_span", ms_per_iter=round(span_us / 1e3 / ITERS, 4)))
    for r in rows:
        print(f"{r['case']:<28} {r['category']:<12} {r['ms_per_iter']:9.3f} ms", flush=True)
    return rows


def ce_case(tokens: int, **options):
    inp = make_ce_inputs(tokens, H, V, dtype=torch.bfloat16, device="cuda", seed=0)
    x = inp.x.detach().requires_grad_()
    w = inp.w.detach().requires_grad_()

    def step():
        x.grad = w.grad = None
        fusedkern.linear_cross_entropy(x, w, inp.target, **options).backward()
    return step


def floor_case(tokens: int):
    inp = make_ce_inputs(tokens, H, V, dtype=torch.bfloat16, device="cuda", seed=0)
    x, w = inp.x.detach(), inp.w.detach()
    z = torch.empty(tokens, V, device="cuda", dtype=torch.bfloat16)
    dx, dw = torch.empty_like(x), torch.empty_like(w)

    def step():
        torch.mm(x, w.t(), out=z)
        torch.mm(z, w, out=dx)
        torch.mm(z.t(), x, out=dw)
    return step


def simpo_case(batch: int, **options):
    inp = make_simpo_inputs(batch, 1024, H, V, dtype=torch.bfloat16, device="cuda", seed=0)
    x = inp.x.detach().requires_grad_()
    w = inp.w.detach().requires_grad_()

    def step():
        x.grad = w.grad = None
        fusedkern.linear_simpo_loss(x, w, inp.target, **options)[0].backward()
    return step


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "profile_ce.csv"))
    args = parser.parse_args()
    rows = []
    for tokens in args.tokens:
        rows += run_case(f"cublas_3gemm T={tokens}", floor_case(tokens))
        rows += run_case(f"default T={tokens}", ce_case(tokens))
        rows += run_case(f"chunk_tokens=8192 T={tokens}", ce_case(tokens, chunk_tokens=8192))
        rows += run_case(f"lean T={tokens}", ce_case(tokens, weight_grad_accum="weight_dtype"))
    rows += run_case("simpo lean batch=4", simpo_case(4, weight_grad_accum="weight_dtype"))
    rows += run_case("simpo default batch=4", simpo_case(4))
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["case", "category", "ms_per_iter", "protocol", "workload"])
        writer.writeheader()
        writer.writerows(dict(row, protocol="sequential", workload="dense") for row in rows)
    print("->", args.out)


if __name__ == "__main__":
    main()
