"""Probe on the H200: the loss-only forward's logits tile shape, within its 64 MiB budget.

The loss-only path (no grad) runs [C, Vs] logits tiles: per tile one cuBLAS GEMM and the partial
statistics kernel, then one merge per chunk (`engine.run` with `vocab_tile`). Shipped: C = 2048 tokens ×
Vs = 16384 columns (8 slices, the last 13568 wide). After the host syncs were removed it measured
1.02× `cublas_1gemm` at 4096 tokens but 1.11–1.12× at 8192–32768 (`ce_loss_only.csv`).

Counted first (T = 32768, V = 128256, H = 4096, bf16): the GEMM work is 34.4 TFLOP whatever the tile
(~49 ms at the measured floor); the statistics pass reads each logit once (8.4 GB ≈ 2.5 ms at
3.4 TB/s, +5 %) — so a tile shape can only win back the GEMMs' shape loss (prediction: tile GEMMs
alone 1.04–1.06×, as a probe of the row split measured, `probe_loss_split.jsonl`; squarer tiles with
whole waves of 132 SMs should shed 1–3 %) and the per-tile launch costs (8–16 tiles of ~6 ms: negligible).

Per tile shape and token count: the GEMMs alone (same tiles, no statistics) and the whole loss-only
pass, timed back to back like the benchmark, next to `cublas_1gemm` in the same process.
JSON lines to $OUT/probe_loss_tiles.jsonl.

    python probes/probe_loss_tiles.py
"""

import torch

import fusedkern  # noqa: F401
from fusedkern.chunked import LossOptions, chunked_loss

from probe_common import ms_quantiles_back_to_back, recorder

H, V = 4096, 128256
TOKENS = (4096, 8192, 32768)
# (C tokens, Vs columns), each C·Vs·2 bytes ≤ 64 MiB; Vs = V: whole rows (the chunk path)
TILES = [(2048, 16384), (2048, 16064), (4096, 8192), (1024, 32768), (512, 65536), (256, V), (8192, 4096)]


def tile_gemms(x, w, C, Vs):
    buf = torch.empty(C * Vs, device=x.device, dtype=x.dtype)

    def run():
        for c0 in range(0, x.shape[0], C):
            x_c = x[c0:c0 + C]
            for v0 in range(0, V, Vs):
                w_s = w[v0:v0 + Vs]
                torch.mm(x_c, w_s.t(), out=buf[: x_c.shape[0] * w_s.shape[0]].view(x_c.shape[0], w_s.shape[0]))
    return run


def main():
    torch.manual_seed(0)
    record = recorder("probe_loss_tiles.jsonl")
    w = (torch.randn(V, H, device="cuda") * (2.0 / H**0.5)).to(torch.bfloat16)
    opts = LossOptions()
    for T in TOKENS:
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        y = torch.randint(0, V, (T,), device="cuda")
        reps = 20 if T <= 8192 else 10
        floor = ms_quantiles_back_to_back(lambda: torch.mm(x, w.t()), reps=reps)
        record(tokens=T, case="cublas_1gemm", ms_p50=floor[0], ms_p20=floor[1], ms_p80=floor[2])
        reference = chunked_loss(x, w, None, y, None, opts)[0]
        for C, Vs in TILES:
            if C > T:
                continue
            gemms = ms_quantiles_back_to_back(tile_gemms(x, w, C, Vs), reps=reps)
            loss = chunked_loss(x, w, None, y, None, opts, tile=(C, Vs))[0]
            full = ms_quantiles_back_to_back(lambda: chunked_loss(x, w, None, y, None, opts, tile=(C, Vs)), reps=reps)
            record(tokens=T, case=f"tile_{C}x{Vs}", gemms_ms_p50=gemms[0], gemms_ratio=gemms[0] / floor[0],
                   ms_p50=full[0], ms_p20=full[1], ms_p80=full[2], ratio=full[0] / floor[0],
                   max_abs_loss_diff=(loss - reference).abs().max().item())
        floor = ms_quantiles_back_to_back(lambda: torch.mm(x, w.t()), reps=reps)
        record(tokens=T, case="cublas_1gemm_again", ms_p50=floor[0], ms_p20=floor[1], ms_p80=floor[2])


if __name__ == "__main__":
    main()
