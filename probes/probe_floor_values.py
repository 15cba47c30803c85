"""Why two harnesses' one-GEMM floors differ: the logits GEMM X[T, H]·Wᵀ (bf16, H 4096, V 128256) timed in one process
of shuffled rounds (`fusedkern.study.timing`) with the weights drawn at the study's scale (σ = 2/√H, logits of std 2)
and at σ = 0.02 (another harness's), with zeros (the least switching), and with the output allocated per call (the
study's `reference.cublas_1gemm`) or written into a preallocated buffer. A GEMM's time depends on its operands'
values through power and clocks; this separates that from the allocation. Writes a CSV (ms p20/p50/p80, × the
study's floor) with `protocol` and `workload` columns.

    python probes/probe_floor_values.py --out floor_values.csv [--tokens 4096 16384]
"""
from __future__ import annotations

import argparse
import csv
import math
import random

import torch

from fusedkern.reference import cublas_1gemm
from fusedkern.study.providers import Step
from fusedkern.study.timing import time_steps_interleaved
from fusedkern.study.workloads import Inputs

H, V = 4096, 128256
ROUNDS = 30


def _none(_result) -> None:
    return None  # a floor step records no loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096])
    args = parser.parse_args()
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for tokens in args.tokens:
        x = torch.randn(tokens, H, generator=gen, device=device).to(torch.bfloat16)
        weights = {f"std{2 / math.sqrt(H):.4f}": 2 / math.sqrt(H), "std0.0200": 0.02, "zeros": 0.0}
        out = torch.empty(tokens, V, device=device, dtype=torch.bfloat16)
        steps = {}
        for name, std in weights.items():
            w = (torch.randn(V, H, generator=gen, device=device) * std).to(torch.bfloat16)
            steps[f"alloc_{name}"] = Step(run=lambda _, w=w: _none(cublas_1gemm(x, w)))
            steps[f"out_{name}"] = Step(run=lambda _, w=w: _none(torch.mm(x, w.t(), out=out)))
        dummy = Inputs(op="ce", x=x, w=x, target=torch.zeros(1, dtype=torch.long, device=device))
        timings = time_steps_interleaved(steps, dummy, warmup=3, reps=ROUNDS, min_reps=ROUNDS, max_case_s=1e9,
                                         rng=random.Random(tokens))
        study = timings[f"alloc_std{2 / math.sqrt(H):.4f}"]["ms_p50"]
        for impl, t in timings.items():
            rows.append(dict(impl=impl, tokens=tokens, ms_p20=round(t["ms_p20"], 4), ms_p50=round(t["ms_p50"], 4),
                             ms_p80=round(t["ms_p80"], 4), x_study_floor_p50=round(t["ms_p50"] / study, 4),
                             tflops_p50=round(2 * tokens * V * H / t["ms_p50"] / 1e9, 1), protocol="shuffled",
                             workload="logits_gemm"))
            print(rows[-1], flush=True)
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()
