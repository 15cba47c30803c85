"""The backward's rescale-and-cast of Llama-3's fp32 dW accumulator ([128256, 4096]) into bf16: torch's
`mul(fp32, s, out=bf16)` (its generic elementwise path) against `kernels/scale.py`'s `scale_into`, each call
timed with CUDA events after warm-up, the two in a new random order every round. Prints a CSV
(ms p20/p50/p80 and the bandwidth at p50: 4 bytes read and 2 written an element).

    python probes/probe_scale_into.py > scale_into_timing.csv
"""
import random

import torch

from fusedkern.kernels.scale import scale_into

ROUNDS = 30


def main() -> None:
    n = 128256 * 4096
    src = torch.randn(n, device="cuda")
    out = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    s = torch.tensor(0.37, device="cuda")
    impls = {"torch_mul": lambda: torch.mul(src, s, out=out), "scale_into": lambda: scale_into(src, s, out)}
    for f in impls.values():
        for _ in range(3):
            f()
    torch.cuda.synchronize()
    times = {k: [] for k in impls}
    for _ in range(ROUNDS):
        order = list(impls)
        random.shuffle(order)
        for k in order:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            impls[k]()
            b.record()
            torch.cuda.synchronize()
            times[k].append(a.elapsed_time(b))
    print("impl,ms_p20,ms_p50,ms_p80,gb_s_p50,protocol,workload")
    for k, t in times.items():
        q = torch.tensor(t).quantile(torch.tensor([0.2, 0.5, 0.8])).tolist()
        print(f"{k},{q[0]:.4f},{q[1]:.4f},{q[2]:.4f},{n * 6 / q[1] / 1e6:.0f},shuffled,llama3_dw_cast")


if __name__ == "__main__":
    main()
