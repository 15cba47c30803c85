"""The gradient of cross-entropy as scaled probabilities: what lets dX and dW skip the row kernel's passes.

The logits GEMM with `logits_stats_rows(..., probs=buf)` writes, for each row t and column tile j of
`PROB_TILE` columns, P̃[t, v] = exp(s_tv − m_tj) with m_tj the tile's max (so P̃ ∈ [0, 1]), beside the
row statistics. Once the statistics are merged into each row's lse, the gradient is

    G[t, v] = ∂L/∂z_tv = c_t · (exp(s_tv − lse_t) − [v = y_t]) = S[t, j] · P̃'[t, v],

with S[t, j] = c_t · exp(m_tj − lse_t) and c_t the row's weight in the loss (the mean's 1/D, times its
class weight; 0 for an ignored row). `prob_scales` computes S for every tile of a row and rewrites the one
tile that holds the target in the reference of lse (S = c_t there): P̃'[t, v] = P̃[t, v]·exp(m − lse), and
at the target exp(s_ty − lse) − 1 from the fp32 target logit by expm1, so a confident target's gradient
keeps its digits and no value ever exceeds 1 in magnitude. `rowcount_gemm.dx_rows` / `dw_rows` with
`scales=S` then multiply each operand block by its scale in registers on its way to the tensor cores.

What this saves per chunk of C tokens (bf16, V columns): the row kernel's statistics pass (read the
logits, C·V·2 bytes) and its finish pass (read them and write G, 2·C·V·2 bytes). What it costs: the
epilogue's exponentials (the logits GEMM's `stats_in_epilogue` work plus a bf16 store it does anyway), a
multiply per operand element in dX and dW, and this kernel's C·PROB_TILE elements. The trade-off is the
operand path: a scaled A block goes through registers (wgmma with A in registers on sm_90) instead of
straight from shared memory. Plain cross-entropy only (ignore_index, class weights, mean/sum): a softcap,
label smoothing or z-loss makes G something other than a scaled probability.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedkern.kernels.device_math import expm1
from fusedkern.kernels.gemm_tiles import check_count, valid_rows

__all__ = ["prob_scales"]


@triton.jit
def _prob_scales_kernel(
    probs_ptr,  # (C, V) P̃ from the logits GEMM's epilogue; the target's tile is rewritten in place
    scale_ptr,  # (C, P) fp32 out: S per (row, tile)
    part_max_ptr,  # (C, P) fp32: m per (row, tile), −inf for slots no tile wrote
    stats_ptr,  # (2, C) fp32: max and log Σ exp(s − max) of each row (lse = their sum)
    target_ptr,  # (C,) int64
    target_logit_ptr,  # (C,) fp32: s at the target (the epilogue's fp32 value)
    grad_scale_ptr,  # (1,) fp32: ∂L/∂ℓ_t of every counted token (1/D for the mean)
    class_weight_ptr,  # (V,) fp32 (HAS_WEIGHT)
    count_ptr,  # (1,) int32/int64: rows ≥ count are skipped
    C, V, P, stride_pc, stride_sc, stride_mc, stride_stats, ignore_index,
    HAS_WEIGHT: tl.constexpr, TILE: tl.constexpr, BLOCK_P: tl.constexpr,
):
    row = tl.program_id(0)
    if row < valid_rows(count_ptr, C):
        row64 = row.to(tl.int64)
        y = tl.load(target_ptr + row)
        valid = (y != ignore_index) & (y >= 0) & (y < V)
        y_safe = tl.where(valid, y, 0)
        coef = tl.load(grad_scale_ptr)
        if HAS_WEIGHT:
            coef *= tl.load(class_weight_ptr + y_safe)
        # lse = row_max + log_sum is never formed: in fp32 its rounding (an ulp of the row max) would be the
        # error of every exponent below, where s − row_max is exact for the values that matter
        row_max = tl.load(stats_ptr + row)
        log_sum = tl.load(stats_ptr + stride_stats + row)
        slots = tl.arange(0, BLOCK_P)
        m = tl.load(part_max_ptr + row64 * stride_mc + slots, mask=slots < P, other=-float("inf"))
        # an empty slot (m = −inf) and an ignored row scale by exactly 0
        s = tl.where(valid & (m > -float("inf")), coef * tl.exp((m - row_max) - log_sum), 0.0)
        if valid:
            j = y_safe // TILE
            cols = j * TILE + tl.arange(0, TILE)
            ptrs = probs_ptr + row64 * stride_pc + cols
            m_y = tl.load(part_max_ptr + row64 * stride_mc + j)
            p = tl.load(ptrs, mask=cols < V, other=0.0).to(tl.float32) * tl.exp((m_y - row_max) - log_sum)
            p = tl.where(cols == y_safe, expm1((tl.load(target_logit_ptr + row) - row_max) - log_sum), p)
            tl.store(ptrs, p.to(probs_ptr.dtype.element_ty), mask=cols < V)
            s = tl.where(slots == j, coef, s)
        tl.store(scale_ptr + row64 * stride_sc + slots, s, mask=slots < P)


def prob_scales(probs: torch.Tensor, part_max: torch.Tensor, stats: torch.Tensor, target: torch.Tensor,
                target_logit: torch.Tensor, grad_scale: torch.Tensor, count: torch.Tensor, out: torch.Tensor, *,
                tile: int, ignore_index: int = -100, class_weight: torch.Tensor | None = None) -> torch.Tensor:
    """S [C, P] into out, and the target's tile of each counted row of probs rewritten (module docstring).

    probs [C, V] (P̃ of `logits_stats_rows(..., probs=)`) · part_max [C, P] fp32 (its parts[0]) · stats [2, C]
    fp32 (merged by `ce_rows.merge_row_stats`) · target [C] int64 · target_logit [C] fp32 · grad_scale [1] fp32
    · count: one-element int tensor, rows ≥ count untouched · out [C, P] fp32, may be parts[1] (the merge has
    read it) · tile: the epilogue's column tile (`logits_stats.PROB_TILE`). Returns out."""
    C, V = probs.shape
    P = part_max.shape[1]
    for name, t in (("part_max", part_max), ("out", out)):
        if t.shape != (C, P) or t.dtype != torch.float32 or t.stride(1) != 1:
            raise ValueError(f"{name} must be an fp32 [{C}, {P}] tensor with unit inner stride")
    if P < triton.cdiv(V, tile) or tile & (tile - 1):
        raise ValueError(f"tile must be a power of two with {P} ≥ cdiv({V}, tile), got {tile}")
    if stats.shape != (2, C) or stats.stride(1) != 1 or target.shape != (C,) or target_logit.shape != (C,):
        raise ValueError(f"stats [2, {C}] (unit inner stride), target [{C}] and target_logit [{C}] expected")
    if probs.stride(1) != 1:
        raise ValueError("probs must have unit inner stride")
    count = check_count(count, probs.device)
    if C == 0:
        return out
    cw = class_weight if class_weight is not None else grad_scale
    _prob_scales_kernel[(C,)](probs, out, part_max, stats, target, target_logit, grad_scale, cw, count, C, V, P,
                              probs.stride(0), out.stride(0), part_max.stride(0), stats.stride(0), ignore_index,
                              HAS_WEIGHT=class_weight is not None, TILE=tile,
                              BLOCK_P=triton.next_power_of_2(P), num_warps=4)
    return out
