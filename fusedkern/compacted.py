"""The chunked strategy over the valid tokens only, counted on the device: no work on ignored rows and
no host synchronization.

The caller sorts the rows so that every non-ignored target comes first (`valid_rows_first`) and
passes their count n as a device tensor. Each chunk of C rows then holds clamp(n − c0, 0, C) valid
rows at its front; the three GEMMs (`kernels/rowcount_gemm.py`) and the row kernels (`ce_rows`,
`row_count=`) read that count on the device and skip the rest, so a chunk past n costs a few
launches and a half-valid chunk half its FLOPs. Given the row order, the pass sorts x into dX's own
storage and returns dX in x's order, zero at ignored rows (no sorted copy of x beside dX: the dense
path's peak memory); without it, x comes sorted and dX of the rows past n stays zero.

Trade-off against the cuBLAS path of `chunked.py`: Triton GEMMs instead of cuBLAS (close to cuBLAS for
the logits and dX GEMMs on the rows they do, behind it for the dW accumulation into fp32: docs/design.md,
"The row-count GEMMs against cuBLAS"), in exchange for skipping the ignored rows when
only the device knows how many there are. With the count on the host, `linear_cross_entropy`'s
`num_valid_tokens=int` gathers exactly those rows and keeps cuBLAS instead.
"""

from __future__ import annotations

import torch

from fusedkern import engine
from fusedkern.engine import Chunk, CrossEntropyRows, Grads, LossOptions, logits_buffer, plan_for_grads, row_kernel_args
from fusedkern.kernels.rowcount_gemm import dw_rows, dx_rows, logits_rows


class RowCountGemms:
    """The engine's GEMM strategy over the valid rows at the front of each chunk: `counts[i]` of chunk i (a
    device tensor), the rest skipped by the kernels. No bias gradient."""

    def __init__(self, counts: torch.Tensor):
        self.counts = counts

    def logits(self, buf, x_c, w, b, chunk: Chunk) -> torch.Tensor:
        z = buf[: x_c.shape[0]]
        logits_rows(x_c, w, b, self.counts[chunk.index:chunk.index + 1], z)
        return z

    def grads(self, grads: Grads, g, x_c, w, chunk: Chunk, first: bool) -> None:
        n_i = self.counts[chunk.index:chunk.index + 1]
        if grads.dw is not None:  # before dX: with `rows`, dX's GEMM writes over the chunk's x
            dw_rows(g, x_c, n_i, grads.dw, accumulate=not first)
        if grads.dx is not None:
            dx_rows(g, w, n_i, grads.dx[chunk.rows])


def chunk_row_counts(count: torch.Tensor, n_tokens: int, chunk: int) -> torch.Tensor:
    """[n_chunks] int32 on the device: the valid rows of each chunk, clamp(count − c0, 0, chunk)."""
    starts = torch.arange(0, n_tokens, chunk, device=count.device, dtype=torch.int64)
    return (count.reshape(()).to(torch.int64) - starts).clamp_(0, chunk).to(torch.int32)


def counted_loss_and_grads(x, w, b, target, class_weight, opts: LossOptions, grad_scale: torch.Tensor,
                           count: torch.Tensor, *, need_dx: bool, need_dw: bool, weight_grad_accum: str,
                           chunk_tokens: int | None = None, rows: torch.Tensor | None = None):
    """`chunked.chunked_loss_and_grads` for rows sorted valid-first, `count` of them valid; no bias gradient.

    x [T, H] · w [V, H] · b [V] | None · target [T] (ignore_index from row `count` on) · count: 0-d / [1] int tensor on
    x's device. Returns (loss_tok [T] fp32, 0 past count; dx [T, H] | None, 0 past count; dw; dw_out)
    with dw and dw_out as in `chunked.grad_buffers`. (count = T with rows in any order computes every row.)

    rows [T] int64 (`valid_rows_first`), or None when x already is in that order: x is then in the caller's
    order, target sorted, and dx comes back in x's order (0 at ignored rows). The sorted copy of x lives in
    dX's own storage — each chunk's dW GEMM reads its rows before its dX GEMM overwrites them — and storage
    idle after the last chunk (dW's own, or the logits buffer) holds dX while it is put back in order: the
    pass needs no T×H buffer beyond dX when either holds T·H elements (docs/design.md, "The counted paths' memory")."""
    T, V = x.shape[0], w.shape[0]
    plan = plan_for_grads(T, w, need_dw, weight_grad_accum, chunk_tokens)
    C = plan.chunk_tokens
    loss_tok = torch.zeros(T, device=x.device, dtype=torch.float32)
    stats = torch.zeros((2, T), device=x.device, dtype=torch.float32)
    grads = Grads.allocate(x, w, None, False, need_dw, False, plan)
    if rows is None:
        dx = torch.zeros_like(x) if need_dx else None
    else:
        x = x.index_select(0, rows)
        dx = x if need_dx else None  # rows past the count are zeroed after the last chunk
    grads.dx = dx
    buf = logits_buffer(min(C, T), V, x, grads.scratch)
    counts = chunk_row_counts(count, T, C)
    row_pass = CrossEntropyRows(target, row_kernel_args(class_weight, opts), loss_tok, stats, grad=grad_scale,
                                row_counts=counts)
    engine.run(x, w, b, engine.token_chunks(T, C), row_pass, grads=grads, gemms=RowCountGemms(counts), buffer=buf)
    dw, dw_out = grads.dw, grads.dw_out
    if rows is not None and dx is not None:
        # idle now: dW's own storage (until the backward writes dW there) or else the logits buffer
        scratch = next((s for s in (dw_out, buf) if s is not None and s.numel() >= dx.numel()), None)
        del buf  # a buffer too small to serve is freed before dX's copy is made
        dx = _in_caller_order(dx, rows, count, scratch)
    return loss_tok, dx, dw, dw_out


def _in_caller_order(dx_sorted: torch.Tensor, rows: torch.Tensor, count: torch.Tensor,
                     scratch: torch.Tensor | None) -> torch.Tensor:
    """dx_sorted (row i of the sorted order; rows from `count` on still hold x) put back in place, in its own
    storage: row rows[i] of the result is row i, ignored rows 0. The sorted rows wait in `scratch` (idle
    storage of dX's dtype, at least T·H elements), or in a copy when it is None."""
    T, H = dx_sorted.shape
    past_count = torch.arange(T, device=dx_sorted.device) >= count.reshape(())
    dx_sorted.masked_fill_(past_count[:, None], 0)
    if scratch is None:
        held = dx_sorted.clone()
    else:
        held = scratch.view(-1)[: T * H].view(T, H).copy_(dx_sorted)
    return dx_sorted.index_copy_(0, rows, held)
