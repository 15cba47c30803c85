"""Row kernels of the chunked strategy: per-token LSE, loss and logits-gradient over a logits chunk.

The chunked strategy lets cuBLAS form a bounded chunk of logits [C, V] (C tokens) and then runs one
program per row here: pass 1 streams the row once for an online max / sum-exp (and the label-smoothing
sum), pass 2 streams it again and overwrites it *in place* with the gradient ∂L/∂z, so that the same
buffer feeds the dX and dW GEMMs. Trade-off: the logits chunk is read twice and written once
(3·C·V·elt bytes, ~4 % of the three GEMMs at V = 128256), in exchange for cuBLAS-speed GEMMs and a
buffer whose size does not grow with the number of tokens. Math: docs/design.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from fusedkern._runtime import autotune_configs, interpreting


@triton.jit
def _tanh(u, USE_LIBDEVICE: tl.constexpr):
    """tanh in fp32. libdevice on the GPU; in the interpreter (no libdevice there) a series near 0
    and the exp form elsewhere, both accurate to a few ulp of fp32."""
    if USE_LIBDEVICE:
        return libdevice.tanh(u)
    else:
        a = tl.abs(u)
        t = tl.exp(-2.0 * a)
        big = (1.0 - t) / (1.0 + t)
        a2 = a * a
        # Taylor series up to u^9: error < 1e-9 relative for |u| < 0.125, where 1 - t would cancel
        small = a * (1.0 + a2 * (-1.0 / 3.0 + a2 * (2.0 / 15.0 + a2 * (-17.0 / 315.0 + a2 * (62.0 / 2835.0)))))
        r = tl.where(a < 0.125, small, big)
        return tl.where(u < 0, -r, r)


_ROW_CONFIGS = [
    triton.Config({"BLOCK_V": 4096}, num_warps=8),
    triton.Config({"BLOCK_V": 2048}, num_warps=8),
    triton.Config({"BLOCK_V": 8192}, num_warps=16),
    triton.Config({"BLOCK_V": 4096}, num_warps=16),
    triton.Config({"BLOCK_V": 2048}, num_warps=4),
]
if interpreting():  # tiny shapes on CPU: a small block keeps the masked tail paths exercised
    _ROW_CONFIGS = [triton.Config({"BLOCK_V": 64}, num_warps=1)]


@triton.autotune(
    configs=autotune_configs(_ROW_CONFIGS),
    key=["V", "HAS_WEIGHT", "HAS_SOFTCAP", "COMPUTE_STATS", "WRITE_GRAD"],
    # the kernel overwrites the logits with the gradient: each autotune trial must start from them
    restore_value=["logits_ptr"],
)
@triton.jit
def _ce_rows_kernel(
    # pointers
    logits_ptr,  # (C, V) input dtype. In: logits z. Out (WRITE_GRAD): ∂L/∂z, in place
    loss_ptr,  # (C,) fp32 out: per-token loss ℓ_t, 0 where ignored (COMPUTE_STATS)
    lse_ptr,  # (C,) fp32: out when COMPUTE_STATS, else in (saved by the forward)
    target_ptr,  # (C,) int32/int64 class indices or ignore_index
    class_weight_ptr,  # (V,) fp32 class weights w_v (HAS_WEIGHT)
    class_weight_sum_ptr,  # (1,) fp32 Σ_v w_v (HAS_WEIGHT)
    grad_ptr,  # fp32 upstream ∂L/∂ℓ_t: (C,) if PER_TOKEN_GRAD else (1,) shared by all tokens
    # shapes and strides
    V,  # vocabulary size (row length)
    stride_row,  # elements between rows of logits
    # options
    ignore_index,
    label_smoothing,  # ε
    z_loss,  # coefficient of lse²
    softcap,  # c in s = c·tanh(z/c) (HAS_SOFTCAP)
    # meta-parameters
    HAS_WEIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    COMPUTE_STATS: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    PER_TOKEN_GRAD: tl.constexpr,
    USE_LIBDEVICE: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    # int64 row offset: row · stride reaches 32768 · 128256 > 2^31 when a caller passes a big chunk
    row_ptr = logits_ptr + row * stride_row
    offs = tl.arange(0, BLOCK_V)  # (BLOCK_V,)
    target = tl.load(target_ptr + row).to(tl.int64)
    is_valid = target != ignore_index
    safe_target = tl.where(is_valid, target, 0)

    # 1. Statistics: online max / sum-exp over the (softcapped) row, and Σ_v w_v·s_v for smoothing.
    if COMPUTE_STATS:
        m = -float("inf")
        d = 0.0
        ws = 0.0
        for start in range(0, V, BLOCK_V):
            cols = start + offs
            mask = cols < V
            s = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_SOFTCAP:
                s = softcap * _tanh(s / softcap, USE_LIBDEVICE)
            s_masked = tl.where(mask, s, -float("inf"))
            m_new = tl.maximum(m, tl.max(s_masked, axis=0))
            d = d * tl.exp(m - m_new) + tl.sum(tl.exp(s_masked - m_new), axis=0)
            m = m_new
            if HAS_WEIGHT:
                w = tl.load(class_weight_ptr + cols, mask=mask, other=0.0)
                ws += tl.sum(w * s, axis=0)
            else:
                ws += tl.sum(tl.where(mask, s, 0.0), axis=0)
        lse = m + tl.log(d)
        tl.store(lse_ptr + row, lse)
    else:
        lse = tl.load(lse_ptr + row)

    # 2. The target's logit and class weight (ignored rows read index 0 and are masked below).
    s_y = tl.load(row_ptr + safe_target).to(tl.float32)
    if HAS_SOFTCAP:
        s_y = softcap * _tanh(s_y / softcap, USE_LIBDEVICE)
    if HAS_WEIGHT:
        w_y = tl.load(class_weight_ptr + safe_target)
        w_sum = tl.load(class_weight_sum_ptr)
    else:
        w_y = 1.0
        w_sum = V * 1.0

    if COMPUTE_STATS:
        # ℓ = (1−ε)·w_y·(lse − s_y) + (ε/V)·Σ_v w_v (lse − s_v) + z_loss·lse²
        loss = (1.0 - label_smoothing) * w_y * (lse - s_y)
        loss += (label_smoothing / V) * (w_sum * lse - ws)
        loss += z_loss * lse * lse
        tl.store(loss_ptr + row, tl.where(is_valid, loss, 0.0))

    # 3. Gradient, in place: g·{[(1−ε)w_y + ε·W/V + 2·z_loss·lse]·p − (1−ε)w_y·1[v=y] − (ε/V)·w_v}·tanh'
    if WRITE_GRAD:
        if PER_TOKEN_GRAD:
            g = tl.load(grad_ptr + row)
        else:
            g = tl.load(grad_ptr)
        g = tl.where(is_valid, g, 0.0)
        coef_p = g * ((1.0 - label_smoothing) * w_y + label_smoothing * w_sum / V + 2.0 * z_loss * lse)
        coef_y = g * (1.0 - label_smoothing) * w_y
        coef_w = g * label_smoothing / V
        for start in range(0, V, BLOCK_V):
            cols = start + offs
            mask = cols < V
            z = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_SOFTCAP:
                t = _tanh(z / softcap, USE_LIBDEVICE)
                s = softcap * t
            else:
                s = z
            grad = coef_p * tl.exp(s - lse)
            grad -= tl.where(cols == target, coef_y, 0.0)
            if HAS_WEIGHT:
                grad -= coef_w * tl.load(class_weight_ptr + cols, mask=mask, other=0.0)
            else:
                grad -= coef_w
            if HAS_SOFTCAP:
                grad *= 1.0 - t * t
            tl.store(row_ptr + cols, grad.to(logits_ptr.dtype.element_ty), mask=mask)


def ce_rows(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    loss: torch.Tensor | None,
    lse: torch.Tensor,
    class_weight: torch.Tensor | None,
    class_weight_sum: torch.Tensor | None,
    grad: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float | None,
    compute_stats: bool,
    per_token_grad: bool = False,
) -> None:
    """Launch `_ce_rows_kernel` over a logits chunk, in place.

    logits [C, V] (unit column stride) · target [C] · loss [C] fp32 (written when compute_stats) ·
    lse [C] fp32 (written when compute_stats, else read) · grad: None (no gradient), or fp32 upstream
    ∂L/∂ℓ: [C] when per_token_grad, else a [1] scalar shared by all tokens. When grad is given the
    logits are overwritten with ∂L/∂z.
    """
    C, V = logits.shape
    if C == 0:
        return
    assert logits.stride(1) == 1
    dummy = lse  # any fp32 tensor: never read when its flag is off
    _ce_rows_kernel[(C,)](
        logits, loss if loss is not None else dummy, lse, target,
        class_weight if class_weight is not None else dummy,
        class_weight_sum if class_weight_sum is not None else dummy,
        grad if grad is not None else dummy,
        V, logits.stride(0),
        ignore_index, float(label_smoothing), float(z_loss), float(softcap or 1.0),
        HAS_WEIGHT=class_weight is not None,
        HAS_SOFTCAP=softcap is not None,
        COMPUTE_STATS=compute_stats,
        WRITE_GRAD=grad is not None,
        PER_TOKEN_GRAD=per_token_grad,
        USE_LIBDEVICE=not interpreting(),
    )
