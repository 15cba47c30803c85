"""The backward's rescale-and-cast of Llama-3's fp32 dW accumulator ([128256, 4096]) into bf16: torch's
`mul(fp32, s, out=bf16)` (its generic elementwise path) against `kernels/scale.py`'s `scale_into`, timed with the
study's shuffled protocol (`fusedkern.study.timing`). Prints a CSV (ms p20/p50/p80 and the bandwidth at p50: 4
bytes read and 2 written an element).

    python probes/probe_scale_into.py > scale_into_timing.csv
"""
import random

import torch

from fusedkern.kernels.scale import scale_into
from fusedkern.study.providers import Step
from fusedkern.study.timing import time_steps_interleaved
from fusedkern.study.workloads import Inputs

ROUNDS = 30


def main() -> None:
    n = 128256 * 4096
    src = torch.randn(n, device="cuda")
    out = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    s = torch.tensor(0.37, device="cuda")
    steps = {"torch_mul": Step(run=lambda _: torch.mul(src, s, out=out)),
             "scale_into": Step(run=lambda _: scale_into(src, s, out))}
    # the timer needs only the inputs' device: no step reads them
    dummy = Inputs(op="ce", x=src[:1], w=src[:1], target=torch.zeros(1, dtype=torch.long, device="cuda"))
    timings = time_steps_interleaved(steps, dummy, warmup=3, reps=ROUNDS, min_reps=ROUNDS, max_case_s=1e9,
                                     rng=random.Random(0))
    print("impl,ms_p20,ms_p50,ms_p80,gb_s_p50,protocol,workload")
    for name, t in timings.items():
        if isinstance(t, BaseException):
            raise t
        print(f"{name},{t['ms_p20']:.4f},{t['ms_p50']:.4f},{t['ms_p80']:.4f},{n * 6 / t['ms_p50'] / 1e6:.0f},"
              "shuffled,llama3_dw_cast")


if __name__ == "__main__":
    main()
