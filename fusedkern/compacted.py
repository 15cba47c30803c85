"""The chunked strategy over the valid tokens only, counted on the device: no work on ignored rows and
no host synchronization.

The caller sorts the rows so that every non-ignored target comes first (`valid_rows_first`) and
passes their count n as a device tensor. Each chunk of C rows then holds clamp(n − c0, 0, C) valid
rows at its front; the three GEMMs (`kernels/rowcount_gemm.py`) and the row kernels (`ce_rows`,
`row_count=`) read that count on the device and skip the rest, so a chunk past n costs a few
launches and a half-valid chunk half its FLOPs. dX of the rows past n stays zero (the buffer starts
zeroed), so the caller's scatter back to the original order gives ignored rows a zero gradient.

Trade-off against the cuBLAS path of `chunked.py`: Triton GEMMs instead of cuBLAS (on the H200:
within 1 % of cuBLAS for the logits and dX GEMMs on the rows they do, 4–25 % behind it for the dW
accumulation into fp32; `kernels/rowcount_gemm.py`), in exchange for skipping the ignored rows when
only the device knows how many there are. With the count on the host, `linear_cross_entropy`'s
`num_valid_tokens=int` gathers exactly those rows and keeps cuBLAS instead.
"""

from __future__ import annotations

import torch

from fusedkern.chunked import (LossOptions, chunk_row_counts, grad_buffers, logits_buffer, plan_for_grads,
                               row_kernel_args)
from fusedkern.kernels.ce_rows import ce_rows
from fusedkern.kernels.rowcount_gemm import dw_rows, dx_rows, logits_rows


def counted_loss_and_grads(x, w, b, target, class_weight, opts: LossOptions, grad_scale: torch.Tensor,
                           count: torch.Tensor, *, need_dx: bool, need_dw: bool, weight_grad_accum: str,
                           chunk_tokens: int | None = None):
    """`chunked.chunked_loss_and_grads` for rows sorted valid-first, `count` of them valid; no bias gradient.

    x [T, H] · w [V, H] · b [V] | None · target [T] (ignore_index from row `count` on) · count: 0-d / [1] int tensor on
    x's device. Returns (loss_tok [T] fp32, 0 past count; dx [T, H] | None, 0 past count; dw; dw_out)
    with dw and dw_out as in `chunked.grad_buffers`. (count = T with rows in any order computes every row.)"""
    T, V = x.shape[0], w.shape[0]
    plan = plan_for_grads(T, w, need_dw, weight_grad_accum, chunk_tokens)
    C = plan.chunk_tokens
    loss_tok = torch.zeros(T, device=x.device, dtype=torch.float32)
    stats = torch.zeros((2, T), device=x.device, dtype=torch.float32)
    _, dw, _, dw_out = grad_buffers(x, w, None, False, need_dw, False, plan)
    dx = torch.zeros_like(x) if need_dx else None
    buf = logits_buffer(min(C, T), V, x, dw_out if plan.buffer_in_dw_storage else None)
    counts = chunk_row_counts(count, T, C)
    kernel_args = row_kernel_args(class_weight, opts)
    for i, c0 in enumerate(range(0, T, C)):
        c1 = min(c0 + C, T)
        n_i = counts[i:i + 1]
        x_c, z = x[c0:c1], buf[: c1 - c0]
        logits_rows(x_c, w, b, n_i, z)
        ce_rows(z, target[c0:c1], loss=loss_tok[c0:c1], stats=stats[:, c0:c1], grad=grad_scale,
                compute_stats=True, row_count=n_i, **kernel_args)
        if dx is not None:
            dx_rows(z, w, n_i, dx[c0:c1])
        if dw is not None:
            dw_rows(z, x_c, n_i, dw, accumulate=i > 0)
    return loss_tok, dx, dw, dw_out
