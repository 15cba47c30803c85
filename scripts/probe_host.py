"""Probe on the H200: how much of a chunked forward+backward is the GPU waiting for the host?

`scripts/profile_ce.py` found 1.4–2.8 ms per step not covered by kernels (7 % at 4096 tokens), but
from two loops that may run at different clocks. Here, in one process:
  1. the benchmark's own loop (CUDA events per rep, no sync between reps) for the default and lean
     modes at 4096 tokens, as shipped, with impl="auto"'s driver memory query on every call (as
     before `_cached_bytes_cover`), and with each sync switched off in turn: the target range check
     (one device→host sync), the upstream-gradient check in backward (one sync) — so each one's
     cost is measured, not guessed;
  2. one profiled step of each as a Chrome trace (gzip) for the timeline: gaps between kernels and
     the Python running during them.
Writes $OUT/probe_host.jsonl and $OUT/trace_*.json.gz.

    python scripts/probe_host.py
"""
import gzip
import os
import shutil

import torch
from torch.profiler import ProfilerActivity, profile

import fusedkern
from fusedkern import _validation
from fusedkern import linear_cross_entropy as lce_module
from fusedkern.bench import make_ce_inputs

from _probe_common import recorder

H, V, T = 4096, 128256, 4096
OUT = os.environ.get("OUT", "/tmp")
record = recorder("probe_host.jsonl")


def bench_loop(fn, reps=20, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for begin, end in events:
        begin.record(); fn(); end.record()
    torch.cuda.synchronize()
    times = sorted(b.elapsed_time(e) for b, e in events)
    return times[len(times) // 2], times[len(times) // 5], times[(4 * len(times)) // 5]


def main():
    inp = make_ce_inputs(T, H, V, dtype=torch.bfloat16, device="cuda", seed=0)
    x, w, y = inp.x.detach(), inp.w.detach(), inp.target
    z = torch.empty(T, V, device="cuda", dtype=torch.bfloat16)
    dx, dw = torch.empty_like(x), torch.empty_like(w)

    def floor():
        torch.mm(x, w.t(), out=z); torch.mm(z, w, out=dx); torch.mm(z.t(), x, out=dw)

    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()

    def step(**options):
        def run():
            xl.grad = wl.grad = None
            fusedkern.linear_cross_entropy(xl, wl, y, **options).backward()
        return run

    shipped = dict(check_target=_validation.check_target, is_one=lce_module._is_exactly_one)
    shipped["cache_covers"] = lce_module._cached_bytes_cover
    variants = {
        "shipped": {},
        # before 'auto' looked at the caching allocator first: cudaMemGetInfo on every call
        "mem_query_every_call": {"cache_covers": lambda need, device: False},
        "no_target_check": {"check_target": lambda *a, **k: None},
        "no_grad_check": {"is_one": lambda t: True},  # skips the rescale without a sync (grad is 1 here)
    }
    p50, p20, p80 = bench_loop(floor)
    record(case="cublas_3gemm", ms_p50=p50, ms_p20=p20, ms_p80=p80)
    for mode, options in (("default", {}), ("lean", {"weight_grad_accum": "weight_dtype"})):
        for name, patch in variants.items():
            _validation.check_target = patch.get("check_target", shipped["check_target"])
            lce_module.V_.check_target = _validation.check_target
            lce_module._is_exactly_one = patch.get("is_one", shipped["is_one"])
            lce_module._cached_bytes_cover = patch.get("cache_covers", shipped["cache_covers"])
            p50b, p20b, p80b = bench_loop(step(**options))
            record(case=f"{mode}_{name}", ms_p50=p50b, ms_p20=p20b, ms_p80=p80b, ratio=p50b / p50)
        _validation.check_target = lce_module.V_.check_target = shipped["check_target"]
        lce_module._is_exactly_one = shipped["is_one"]
        lce_module._cached_bytes_cover = shipped["cache_covers"]
        p50, p20, p80 = bench_loop(floor)  # the floor again: drift between the start and the end
        record(case="cublas_3gemm_again", ms_p50=p50, ms_p20=p20, ms_p80=p80)
        if mode != "default":
            continue
        run = step(**options)
        run(); torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
            for _ in range(2):
                run()
            torch.cuda.synchronize()
        path = os.path.join(OUT, f"trace_{mode}.json")
        prof.export_chrome_trace(path)
        with open(path, "rb") as src, gzip.open(path + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(path)


if __name__ == "__main__":
    main()
