"""Probe on the H200: can the row kernel (memory-bound) run under a cuBLAS GEMM (compute-bound) on a
second CUDA stream, and would the chunked strategy gain from it?

The chunked step runs its kernels one after the other: logits GEMM → row kernel → dX, dW GEMMs. The row
kernel streams the [C, V] chunk three times (≈ 3.5 TB/s, `probe_rows.jsonl`) and costs +5 % of a lean
chunk (0.23 ms of 4.75 ms at C = 1024) and +5 % of a default one (0.89 of 19.5 ms at C = 4096); the
loss-only tiles' statistics add +6–10 % (`probe_loss_tiles.jsonl`). Splitting a chunk into two halves
lets the row kernel of one half run beside a GEMM of the other:
    main:  logits A │ logits B │ dX A     │ dX B │ dW (whole chunk: one weight-gradient GEMM as before)
    side:           │ rows A   │ rows B   │
and the loss-only tiles, double-buffered (two 32 MiB tiles): the statistics of tile k beside the GEMM
of tile k + 1.

Prediction, written before the run: a large cuBLAS GEMM fills every SM's registers and shared memory
(one 384-thread CTA per SM), so a second kernel's CTAs only find room at the GEMM's wave tails;
expected overlap of the row kernel ≤ 30 %, i.e. ≤ 1.5 % of a chunk — and halving the GEMMs may cost
that much back. The probe measures, per piece: (1) a GEMM and a row kernel alone and launched together;
(2) the loss-only pass shipped vs double-buffered; (3) a lean (C = 1024) and a default (C = 4096)
chunk shipped vs split in halves. Back-to-back timing like the benchmark. JSON lines to
$OUT/probe_overlap.jsonl.

    python probes/probe_overlap.py [concurrency] [loss_only] [chunks]     (default: all three)
"""

import sys

import torch

import fusedkern  # noqa: F401
from fusedkern.chunked import LossOptions, accumulate_weight_grad, chunked_loss
from fusedkern.kernels.ce_rows import ce_rows, merge_row_stats, row_stats_tile, tile_partials

from probe_common import ms_quantiles_back_to_back, recorder

H, V = 4096, 128256
record = recorder("probe_overlap.jsonl")
ROWS = dict(class_weight=None, class_weight_sum=None, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None)


def rows(z, y, loss, stats, g):
    """The shipped row kernel on a [C, V] chunk: statistics, loss, and ∂L/∂z in place."""
    ce_rows(z, y, loss=loss, stats=stats, grad=g, compute_stats=True, **ROWS)


def concurrency(side):
    """(1): a 4096-token logits GEMM and a 1 GB row kernel, alone and on two streams at once."""
    x = torch.randn(4096, H, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(V, H, device="cuda") * (2.0 / H**0.5)).to(torch.bfloat16)
    z1 = torch.empty(4096, V, device="cuda", dtype=torch.bfloat16)
    z2 = torch.mm(x, w.t())  # overwritten by its gradient, then by the gradient's: finite all along
    y = torch.randint(0, V, (4096,), device="cuda")
    loss, stats, g = torch.empty(4096, device="cuda"), torch.empty(2, 4096, device="cuda"), torch.ones(1, device="cuda")

    def gemm():
        torch.mm(x, w.t(), out=z1)

    def row():
        rows(z2, y, loss, stats, g)

    def both():
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            row()
        gemm()
        main.wait_stream(side)

    for name, fn in (("gemm_alone", gemm), ("rows_alone", row), ("gemm_and_rows_two_streams", both)):
        p50, p20, p80 = ms_quantiles_back_to_back(fn, reps=15)
        record(what=name, ms_p50=p50, ms_p20=p20, ms_p80=p80)


def loss_only_double_buffered(x, w, y, side, C=2048, Vs=8192):
    """(2): the loss-only tiles with two C × Vs buffers; statistics on the side stream."""
    T = x.shape[0]
    bufs = [torch.empty(C * Vs, device="cuda", dtype=x.dtype) for _ in range(2)]
    loss_tok, stats = torch.empty(T, device="cuda"), torch.empty(2, T, device="cuda")
    main = torch.cuda.current_stream()
    done = [torch.cuda.Event(), torch.cuda.Event()]  # side finished reading buffer k
    for e in done:
        e.record(side)
    k = 0
    for c0 in range(0, T, C):
        c1 = min(c0 + C, T)
        x_c, y_c = x[c0:c1], y[c0:c1]
        parts, target_logit, split = tile_partials(c1 - c0, V, Vs, x.device)
        side.wait_stream(main)  # the partials' initialization
        for j, v0 in enumerate(range(0, V, Vs)):
            v1 = min(v0 + Vs, V)
            tile = bufs[k % 2][: (c1 - c0) * (v1 - v0)].view(c1 - c0, v1 - v0)
            main.wait_event(done[k % 2])
            torch.mm(x_c, w[v0:v1].t(), out=tile)
            ready = torch.cuda.Event()
            ready.record(main)
            side.wait_event(ready)
            with torch.cuda.stream(side):
                row_stats_tile(tile, y_c, parts, target_logit, tile_index=j, split=split, col_base=v0,
                               class_weight=None, softcap=None, label_smoothing=0.0)
                done[k % 2].record(side)
            k += 1
        main.wait_stream(side)
        merge_row_stats(parts, target_logit, y_c, V, loss=loss_tok[c0:c1], stats=stats[:, c0:c1], **ROWS)
    return loss_tok


def chunk_shipped(z, x_c, w, y_c, loss, stats, g, dx, dw):
    torch.mm(x_c, w.t(), out=z)
    rows(z, y_c, loss, stats, g)
    torch.mm(z, w, out=dx)
    accumulate_weight_grad(dw, z, x_c, first=False)


def chunk_halves(z, x_c, w, y_c, loss, stats, g, dx, dw, side):
    """(3): one chunk in two halves, each half's row kernel beside the other half's GEMM."""
    main = torch.cuda.current_stream()
    h = z.shape[0] // 2
    halves = (slice(0, h), slice(h, z.shape[0]))
    side.wait_stream(main)
    rows_done = []
    for half in halves:
        torch.mm(x_c[half], w.t(), out=z[half])
        ready = torch.cuda.Event()
        ready.record(main)
        side.wait_event(ready)
        with torch.cuda.stream(side):
            rows(z[half], y_c[half], loss[half], stats[:, half], g)
            done = torch.cuda.Event()
            done.record(side)
        rows_done.append(done)
    for half, done in zip(halves, rows_done):
        main.wait_event(done)
        torch.mm(z[half], w, out=dx[half])
    accumulate_weight_grad(dw, z, x_c, first=False)


def chunks(side):
    w = (torch.randn(V, H, device="cuda") * (2.0 / H**0.5)).to(torch.bfloat16)
    g = torch.full((1,), 1e-4, device="cuda")
    for C, accum_dtype in ((1024, torch.bfloat16), (4096, torch.float32)):
        x_c = torch.randn(C, H, device="cuda", dtype=torch.bfloat16)
        y_c = torch.randint(0, V, (C,), device="cuda")
        z = torch.empty(C, V, device="cuda", dtype=torch.bfloat16)
        loss, stats, dx = torch.empty(C, device="cuda"), torch.empty(2, C, device="cuda"), torch.empty_like(x_c)
        dw = torch.zeros(V, H, device="cuda", dtype=accum_dtype)
        out = {}
        for name, fn in (("shipped", lambda: chunk_shipped(z, x_c, w, y_c, loss, stats, g, dx, dw)),
                         ("halves_two_streams", lambda: chunk_halves(z, x_c, w, y_c, loss, stats, g, dx, dw, side))):
            dw.zero_()
            fn()
            torch.cuda.synchronize()
            out[name] = (loss.clone(), dx.clone(), dw.clone())
            p50, p20, p80 = ms_quantiles_back_to_back(fn, reps=15)
            record(what=f"chunk_{name}", C=C, dw_dtype=str(accum_dtype), ms_p50=p50, ms_p20=p20, ms_p80=p80)
        a, b = out["shipped"], out["halves_two_streams"]
        record(what="chunk_check", C=C, max_loss_diff=(a[0] - b[0]).abs().max().item(),
               max_dx_diff=(a[1].float() - b[1].float()).abs().max().item(),
               max_dw_diff=(a[2].float() - b[2].float()).abs().max().item())


def loss_only(side):
    w = (torch.randn(V, H, device="cuda") * (2.0 / H**0.5)).to(torch.bfloat16)
    opts = LossOptions()
    for T in (4096, 8192, 32768):
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        y = torch.randint(0, V, (T,), device="cuda")
        reps = 15 if T <= 8192 else 8
        floor = ms_quantiles_back_to_back(lambda: torch.mm(x, w.t()), reps=reps)
        record(what="loss_cublas_1gemm", T=T, ms_p50=floor[0], ms_p20=floor[1], ms_p80=floor[2])
        reference = chunked_loss(x, w, None, y, None, opts)[0]
        cases = (("loss_shipped_2048x16384", lambda: chunked_loss(x, w, None, y, None, opts)),
                 ("loss_sequential_2048x8192", lambda: chunked_loss(x, w, None, y, None, opts, tile=(2048, 8192))),
                 ("loss_double_buffered_2048x8192", lambda: loss_only_double_buffered(x, w, y, side)),
                 ("loss_double_buffered_4096x4096", lambda: loss_only_double_buffered(x, w, y, side, 4096, 4096)))
        for name, fn in cases:
            result = fn()
            diff = (result[0] if isinstance(result, tuple) else result) - reference
            p50, p20, p80 = ms_quantiles_back_to_back(fn, reps=reps)
            record(what=name, T=T, ms_p50=p50, ms_p20=p20, ms_p80=p80, ratio=p50 / floor[0],
                   max_abs_loss_diff=diff.abs().max().item())


def main(parts):
    torch.manual_seed(0)
    # the side stream gets the higher priority: its CTAs are dispatched first when a GEMM's retire
    side = torch.cuda.Stream(priority=-1)
    for name, part in (("concurrency", concurrency), ("loss_only", loss_only), ("chunks", chunks)):
        if not parts or name in parts:
            part(side)


if __name__ == "__main__":
    main(sys.argv[1:])
