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

Opt-in (`row_pass_in_gemms=True`, plain cross-entropy): no row kernel over the logits at all. The logits
GEMM's epilogue writes the row statistics and each tile's probabilities, `kernels.prob_scales` turns the
merged lse into per-tile scales, and dX / dW scale their operand on the fly (docs/design.md: its roofline
and the rule that decides whether it becomes the default once a GPU has timed it).
"""

from __future__ import annotations

import torch

from fusedkern.chunked import (LossOptions, chunk_row_counts, grad_buffers, logits_buffer, plan_for_grads,
                               row_kernel_args)
from fusedkern.kernels.ce_rows import ce_rows, merge_row_stats
from fusedkern.kernels.logits_stats import PROB_TILE, logits_stats_rows, stats_partials
from fusedkern.kernels.prob_scales import prob_scales
from fusedkern.kernels.rowcount_gemm import dw_rows, dx_rows, logits_rows


def check_row_pass_in_gemms(b, opts: LossOptions) -> None:
    """The options `row_pass_in_gemms` computes: plain cross-entropy, no bias (`kernels.prob_scales`)."""
    if b is not None or opts.softcap is not None or opts.label_smoothing > 0.0 or opts.z_loss > 0.0 \
            or opts.logit_scale != 1.0:
        raise ValueError("row_pass_in_gemms=True computes plain cross-entropy: no linear_bias, softcap, "
                         "label_smoothing or z_loss")


def counted_loss_and_grads(x, w, b, target, class_weight, opts: LossOptions, grad_scale: torch.Tensor,
                           count: torch.Tensor, *, need_dx: bool, need_dw: bool, weight_grad_accum: str,
                           chunk_tokens: int | None = None, row_pass_in_gemms: bool = False):
    """`chunked.chunked_loss_and_grads` for rows sorted valid-first, `count` of them valid; no bias gradient.

    x [T, H] · w [V, H] · b [V] | None · target [T] (ignore_index from row `count` on) · count: 0-d / [1] int tensor on
    x's device. Returns (loss_tok [T] fp32, 0 past count; dx [T, H] | None, 0 past count; dw; dw_out)
    with dw and dw_out as in `chunked.grad_buffers`. (count = T with rows in any order computes every row.)

    row_pass_in_gemms: no row kernel over the logits: the logits GEMM's epilogue writes the row statistics
    and scaled probabilities, and dX / dW scale them on the fly (`kernels.prob_scales`); plain cross-entropy
    only (`check_row_pass_in_gemms`). Opt-in until timed on a GPU."""
    if row_pass_in_gemms:
        check_row_pass_in_gemms(b, opts)
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
        if row_pass_in_gemms:
            y_c = target[c0:c1]
            parts, target_logit = stats_partials(c1 - c0, V, x.device, x.dtype)
            logits_stats_rows(x_c, w, None, y_c, n_i, parts, target_logit, probs=z)
            merge_row_stats(parts, target_logit, y_c, V, loss=loss_tok[c0:c1], stats=stats[:, c0:c1], row_count=n_i,
                            **kernel_args)
            scales = prob_scales(z, parts[0], stats[:, c0:c1], y_c, target_logit, grad_scale, n_i, parts[1],
                                 tile=PROB_TILE, ignore_index=opts.ignore_index, class_weight=class_weight)
        else:
            logits_rows(x_c, w, b, n_i, z)
            ce_rows(z, target[c0:c1], loss=loss_tok[c0:c1], stats=stats[:, c0:c1], grad=grad_scale,
                    compute_stats=True, row_count=n_i, **kernel_args)
            scales = None
        if dx is not None:
            dx_rows(z, w, n_i, dx[c0:c1], scales=scales, scale_tile=PROB_TILE)
        if dw is not None:
            dw_rows(z, x_c, n_i, dw, accumulate=i > 0, scales=scales, scale_tile=PROB_TILE)
    return loss_tok, dx, dw, dw_out
