"""Probe on the H200: the loss-only forward's statistics kernel on its [2048, 16384] logits tiles,
with the row split that `ce_rows._split_for` picks (4 slices of 4096 columns) against fewer, longer
slices. Prediction: with one 4096-wide block per program the cross-lane reductions cost as much as
the loop; split 1 (one program per tile row, 4 blocks each) should lift the pass from ~1.9 TB/s
toward the ~3.5 TB/s of the whole-row kernel, i.e. ~1.5 ms less of ~57 ms at 32768 tokens.
Prints one line per case; JSON lines to $OUT/probe_loss_split.jsonl.

    python scripts/probe_loss_split.py
"""

import torch

import fusedkern  # noqa: F401
from fusedkern.chunked import LossOptions, chunked_loss
from fusedkern.kernels import ce_rows as rows_mod

from _probe_common import ms_quantiles, recorder

H, V, T = 4096, 128256, 32768


def main():
    torch.manual_seed(0)
    w = (torch.randn(V, H, device="cuda") * (2.0 / H**0.5)).to(torch.bfloat16)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    y = torch.randint(0, V, (T,), device="cuda")
    gemm = ms_quantiles(lambda: torch.mm(x, w.t()), reps=11)[0]
    shipped = rows_mod._split_for
    results = [dict(case="cublas_1gemm", ms_p50=gemm)]
    reference = chunked_loss(x, w, None, y, None, LossOptions())[0]
    for split in (None, 1, 2, 4, 8):
        rows_mod._split_for = shipped if split is None else (lambda c, v, s=split: s)
        loss = chunked_loss(x, w, None, y, None, LossOptions())[0]
        ms = ms_quantiles(lambda: chunked_loss(x, w, None, y, None, LossOptions()), reps=11)[0]
        results.append(dict(case=f"loss_only_tiles_split_{split or 'shipped'}", ms_p50=ms, ratio=ms / gemm,
                            max_abs_loss_diff=(loss - reference).abs().max().item()))
    rows_mod._split_for = shipped
    record = recorder("probe_loss_split.jsonl")
    for r in results:
        record(**r)


if __name__ == "__main__":
    main()
