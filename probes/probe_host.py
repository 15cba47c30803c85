"""Probe on the H200: how much of a chunked forward+backward is the GPU waiting for the host?

`probes/profile_ce.py` found 1.4–2.8 ms per step not covered by kernels (7 % at 4096 tokens), but
from two loops that may run at different clocks. Here, in one process:
  1. the benchmark's own loop (CUDA events per rep, no sync between reps) for the default and lean
     modes at 4096 tokens, as shipped (no device→host sync in a step: the target range check is read
     after the launches, the rescale by ∂L/∂loss is skipped on the device), and with each old sync put
     back in turn — the range check read at once, the `grad == 1` test in backward, both (the code
     before), and impl="auto"'s driver memory query on every call — so each one's cost is measured;
  2. one profiled step of the shipped default as a Chrome trace (gzip): gaps between kernels and the
     Python running during them.
Writes $OUT/probe_host.jsonl and $OUT/trace_*.json.gz.

    python probes/probe_host.py
"""
import gzip
import importlib
import os
import shutil

import torch
from torch.profiler import ProfilerActivity, profile

import fusedkern
from fusedkern import _validation
from fusedkern.study.workloads import make_ce_inputs

from probe_common import ms_quantiles_back_to_back, recorder

# the module, not the function that `fusedkern` re-exports under the same name
lce_module = importlib.import_module("fusedkern.linear_cross_entropy")

H, V, T = 4096, 128256, 4096
OUT = os.environ.get("OUT", "/tmp")
record = recorder("probe_host.jsonl")


def main():
    inp = make_ce_inputs(T, H, V, dtype=torch.bfloat16, device="cuda", seed=0)
    x, w, y = inp.x.detach(), inp.w.detach(), inp.target
    z = torch.empty(T, V, device="cuda", dtype=torch.bfloat16)
    dx, dw = torch.empty_like(x), torch.empty_like(w)

    def floor():
        torch.mm(x, w.t(), out=z)
        torch.mm(z, w, out=dx)
        torch.mm(z.t(), x, out=dw)

    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()

    def step(**options):
        def run():
            xl.grad = wl.grad = None
            fusedkern.linear_cross_entropy(xl, wl, y, **options).backward()
        return run

    def target_check_at_once(*args, **kwargs):  # the code before: sync right at validation
        check = shipped["check_target"](*args, **kwargs)
        check.raise_if_failed()
        return check

    def scale_after_sync(t, scale):  # the code before: `bool(grad == 1)` on the host, then maybe mul_
        return t if bool(scale.reshape(()) == 1) else t.mul_(scale)

    shipped = dict(check_target=_validation.check_target, scale=lce_module.scale_unless_one_,
                   cache_covers=lce_module._cached_bytes_cover)
    variants = {
        "shipped": {},
        "sync_target_check": {"check_target": target_check_at_once},
        "sync_grad_check": {"scale": scale_after_sync},
        "both_syncs": {"check_target": target_check_at_once, "scale": scale_after_sync},
        # before 'auto' looked at the caching allocator first: cudaMemGetInfo on every call
        "mem_query_every_call": {"cache_covers": lambda need, device: False},
    }

    def install(patch):
        _validation.check_target = lce_module.V_.check_target = patch.get("check_target", shipped["check_target"])
        lce_module.scale_unless_one_ = patch.get("scale", shipped["scale"])
        lce_module._cached_bytes_cover = patch.get("cache_covers", shipped["cache_covers"])

    p50, p20, p80 = ms_quantiles_back_to_back(floor)
    record(case="cublas_3gemm", ms_p50=p50, ms_p20=p20, ms_p80=p80)
    for mode, options in (("default", {}), ("lean", {"weight_grad_accum": "weight_dtype"})):
        for name, patch in variants.items():
            install(patch)
            p50b, p20b, p80b = ms_quantiles_back_to_back(step(**options))
            record(case=f"{mode}_{name}", ms_p50=p50b, ms_p20=p20b, ms_p80=p80b, ratio=p50b / p50)
        install({})
        p50, p20, p80 = ms_quantiles_back_to_back(floor)  # the floor again: drift between the start and the end
        record(case="cublas_3gemm_again", ms_p50=p50, ms_p20=p20, ms_p80=p80)
        if mode != "default":
            continue
        run = step(**options)
        run()
        torch.cuda.synchronize()
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
