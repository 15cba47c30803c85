"""Fused LM head + cross-entropy ("fused" strategy): a Triton GEMM whose epilogue is an online
log-sum-exp, and a backward that recomputes the logit tiles. The [T, V] logits are never stored, not
even in chunks: the forward keeps per-token statistics only; the backward forms each gradient tile
G = ∂L/∂z (BLOCK_T × BLOCK_V) in registers and contracts it at once into dX = G·W and dW = Gᵀ·X with
fp32 atomics. Math (every option and its gradient): docs/design.md.

Inputs: x [T, H], w [V, H] (and bias [V]) in fp32/fp16/bf16, targets [T], optional class weights [V];
the forward (`fused_ce_forward`) returns per-token (max, log Σ exp) statistics and loss, the backward
(`fused_ce_backward`) dX, dW, db from the saved statistics and the per-token upstream gradient.

Trade-off: memory against FLOPs. Everything beyond inputs and gradients fits 16 MiB
(`chunk_plan.fused_accumulator_budget`), so bf16 gradients' fp32 accumulators ([T, H] + [V, H]: 2.5 GiB
at T = 32768) are cut into launches whose workspaces fit: one pass over V-chunks when all of dX fits,
else pass A over T-chunks (dX, db) and pass B over V-chunks (dW), which recomputes the logits once more.
That is ≥ 4–5 GEMMs of FLOPs plus 2.7e11 fp32 atomics at the study's largest shape, against the chunked
strategy's 3 GEMMs and a bounded logits buffer; the roofline is in docs/design.md ("The fused
strategy's roofline", with its measured time: several times the chunked strategy's). Atomic adds make
dX/dW non-deterministic in the last bits.

Based on the online softmax (Milakov & Gimelshein, 2018) as FlashAttention uses it, the Triton matmul
tutorial's tiling, and Cut Cross-Entropy's recompute-and-accumulate backward (Wijmans et al., 2024),
here with fp32 atomics into budget-sized workspaces. Row offsets are int64: a row index times a row
stride passes 2^31 at LM sizes (32768 × 128256).

Size (> 400 lines): the forward and backward kernels share the tile math, the budget rules and the
launch helpers.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from fusedkern._runtime import autotune_configs, interpreting, sm_count
from fusedkern.chunk_plan import fused_accumulator_budget  # the 16 MiB default, less the O(T + V) vectors
# shared with the row kernels: tanh in fp32 (libdevice on the GPU, exact forms in the interpreter), and
# exp(u) − 1 without cancellation near 0 (the target's p − 1 of a confident prediction)
from fusedkern.kernels.device_math import expm1, tanh
from fusedkern.kernels.dot import dot_fp32_acc, dot_precision

#: granularity (elements) of V-splits / chunks: a multiple of every BLOCK_V among the configs
_V_GRANULE = 256

__all__ = ["fused_ce_forward", "fused_ce_backward", "workspace_bytes"]


# ----------------------------------------------------------------------------------------------
# device helpers



@triton.jit
def _logit_tile(
    x_ptr, w_ptr, b_ptr,  # pointers
    offs_t, offs_v, mask_t, mask_v, H,  # rows, columns, shapes
    stride_xt, stride_xh, stride_wv, stride_wh, stride_b,  # strides
    HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,  # options
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,  # meta-parameters
):
    """z = x[offs_t] · W[offs_v]ᵀ (+ b): fp32 (BLOCK_T, BLOCK_V); 0 in masked rows/columns (+ bias)."""
    # int64 row offsets: row × stride can exceed 2^31 (see the module docstring)
    x_rows = x_ptr + offs_t.to(tl.int64)[:, None] * stride_xt  # (BLOCK_T, 1)
    w_rows = w_ptr + offs_v.to(tl.int64)[:, None] * stride_wv  # (BLOCK_V, 1)
    acc = tl.zeros((BLOCK_T, BLOCK_V), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask_h = offs_h < H
        x_tile = tl.load(x_rows + offs_h[None, :] * stride_xh, mask=mask_t[:, None] & mask_h[None, :], other=0.0)  # (BLOCK_T, BLOCK_H)
        w_tile = tl.load(w_rows + offs_h[None, :] * stride_wh, mask=mask_v[:, None] & mask_h[None, :], other=0.0)  # (BLOCK_V, BLOCK_H)
        acc = dot_fp32_acc(x_tile, tl.trans(w_tile), acc, DOT_PRECISION)  # (BLOCK_T, BLOCK_V)
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_v * stride_b, mask=mask_v, other=0.0).to(tl.float32)  # (BLOCK_V,)
        acc += bias[None, :]
    return acc


# ----------------------------------------------------------------------------------------------
# forward kernel


def _tile_configs(rows: list) -> list:
    """Autotune candidates from (BLOCK_T, BLOCK_V, BLOCK_H, warps, stages) rows."""
    return [triton.Config({"BLOCK_T": t, "BLOCK_V": v, "BLOCK_H": h}, num_warps=warps, num_stages=stages)
            for t, v, h, warps, stages in rows]


def _fwd_configs(fp32: bool):
    if fp32:  # ieee fp32 dots run on the FMA units: smaller tiles, or the operands spill
        return _tile_configs([(64, 128, 32, 8, 2), (128, 64, 32, 8, 2), (64, 64, 32, 4, 2), (64, 64, 32, 8, 3)])
    return _tile_configs([(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 128, 8, 3), (64, 128, 64, 4, 4),
                          (64, 256, 64, 8, 3), (64, 64, 64, 4, 4)])


# The interpreter runs only the first config: a small one, so that the tiny test shapes still span
# several tiles in T, V and H and the masked tails are exercised.
_INTERP_CONFIG = triton.Config({"BLOCK_T": 16, "BLOCK_V": 32, "BLOCK_H": 16}, num_warps=4, num_stages=1)


def _config_list(configs: list) -> list:
    return autotune_configs([_INTERP_CONFIG] if interpreting() else configs)


# Compiled once whatever the token count (T_BUCKET keys the autotuner): T and the launch's token range are bounds and
# masks, the partials' strides multiples of T, the statistics rows of [2, T] buffers; their specialization on 16 would
# compile a variant per residue of T. They address per-token vectors beside the kernels' GEMM work.
@triton.jit(do_not_specialize=["T", "stride_pk", "stride_ps"])
def _fused_ce_fwd_kernel(
    # outputs
    part_ptr,  # (4, N_SPLIT, T) fp32: running max m, rest = Σ exp(s − m) − 1 (see step 4), target logit s_y, Σ_v w_v·s_v
    # pointers
    x_ptr,  # (T, H) input
    w_ptr,  # (V, H) input dtype
    b_ptr,  # (V,) bias (HAS_BIAS)
    y_ptr,  # (T,) int64 targets
    cw_ptr,  # (V,) fp32 class weights (HAS_WEIGHT)
    # shapes
    T, V, H,
    N_SPLIT, SPLIT_V,  # number of V-splits, columns per split
    T_BUCKET,  # autotune key only (next power of two of T)
    # strides
    stride_xt, stride_xh, stride_wv, stride_wh, stride_b,
    stride_pk, stride_ps,  # partials: statistic, split (token stride 1)
    # options
    SOFTCAP,  # fp32 softcap c (HAS_SOFTCAP)
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr, USE_LIBDEVICE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    # meta-parameters
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # 1. which token block and which V-split (split fastest: the programs in flight share X rows)
    pid = tl.program_id(0)
    pid_s = pid % N_SPLIT
    pid_t = pid // N_SPLIT
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)  # (BLOCK_T,)
    mask_t = offs_t < T
    # targets as int32 (V < 2^31): an int64 compare over a (BLOCK_T, BLOCK_V) tile costs registers
    y = tl.load(y_ptr + offs_t, mask=mask_t, other=-1).to(tl.int32)  # (BLOCK_T,)
    v_lo = pid_s * SPLIT_V
    v_hi = tl.minimum(v_lo + SPLIT_V, V)

    m_i = tl.full((BLOCK_T,), float("-inf"), dtype=tl.float32)  # running max
    rest_i = tl.zeros((BLOCK_T,), dtype=tl.float32)  # running Σ exp(s − m_i) without the max's own 1
    sy_i = tl.zeros((BLOCK_T,), dtype=tl.float32)  # target logit (if it lies in this split)
    sws_i = tl.zeros((BLOCK_T,), dtype=tl.float32)  # Σ_v w_v·s_v over this split
    for v0 in range(v_lo, v_hi, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V)  # (BLOCK_V,)
        mask_v = offs_v < v_hi
        # 2. logit tile: K-loop over H, fp32 accumulation, + bias
        s = _logit_tile(x_ptr, w_ptr, b_ptr, offs_t, offs_v, mask_t, mask_v, H,
                        stride_xt, stride_xh, stride_wv, stride_wh, stride_b,
                        HAS_BIAS, DOT_PRECISION, BLOCK_T, BLOCK_V, BLOCK_H)  # (BLOCK_T, BLOCK_V)
        # 3. softcap s = c·tanh(z/c)
        if HAS_SOFTCAP:
            s = SOFTCAP * tanh(s / SOFTCAP, USE_LIBDEVICE)
        # 4. online max and rest = Σ exp(s − m) − 1, as the row kernel keeps it (`ce_rows._merge_mass`):
        #    when one class dominates, Σ exp ≈ 1 in fp32 keeps only the first digits of the other
        #    classes' mass, rest keeps all of them — and with them 1 − p_y, the confident target's
        #    gradient. The max's own exp(0) = 1 is never added: a tile that brings a new max leaves out
        #    its (first) arg-max column and adds the old max's 1 scaled; otherwise it adds its whole sum.
        s_m = tl.where(mask_v[None, :], s, float("-inf"))  # (BLOCK_T, BLOCK_V)
        tile_max = tl.max(s_m, axis=1)  # (BLOCK_T,)
        tile_arg = tl.argmax(s_m, axis=1)  # (BLOCK_T,)
        m_new = tl.maximum(m_i, tile_max)  # (BLOCK_T,)
        # m_new is −inf while every column so far is −inf (a −inf bias masking padded vocabulary):
        # exponents are taken against 0 then, so that −inf − (−inf) = NaN never arises; they are 0 anyway
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # (BLOCK_T,)
        e = tl.exp(s_m - m_ref[:, None])  # (BLOCK_T, BLOCK_V), 0 on masked columns
        tile_rest = tl.sum(tl.where(tl.arange(0, BLOCK_V)[None, :] == tile_arg[:, None], 0.0, e), axis=1)
        e_old = tl.exp(m_i - m_ref)  # 0 while m_i = −inf
        rest_i = tl.where(tile_max > m_i, rest_i * e_old + e_old + tile_rest,
                          rest_i + tile_rest + tl.exp(tile_max - m_ref))
        m_i = m_new
        # 5. target logit and the label-smoothing sum
        # (compared as a local column index: a loop-invariant (BLOCK_T, BLOCK_V) broadcast of y
        # would be hoisted out of the loop and pin 64 registers per thread)
        is_y = (tl.arange(0, BLOCK_V)[None, :] == (y - v0)[:, None]) & mask_v[None, :]  # (BLOCK_T, BLOCK_V)
        sy_i += tl.sum(tl.where(is_y, s, 0.0), axis=1)
        if HAS_SMOOTHING:
            if HAS_WEIGHT:
                wv = tl.load(cw_ptr + offs_v, mask=mask_v, other=0.0)  # (BLOCK_V,)
                sws_i += tl.sum(tl.where(mask_v[None, :], s * wv[None, :], 0.0), axis=1)
            else:
                sws_i += tl.sum(tl.where(mask_v[None, :], s, 0.0), axis=1)

    # 6. partials of this (T-block, split)
    out = part_ptr + pid_s * stride_ps + offs_t  # (BLOCK_T,)
    tl.store(out, m_i, mask=mask_t)
    tl.store(out + stride_pk, rest_i, mask=mask_t)
    tl.store(out + 2 * stride_pk, sy_i, mask=mask_t)
    if HAS_SMOOTHING:
        tl.store(out + 3 * stride_pk, sws_i, mask=mask_t)


# one autotuner per operand width (fp32: FMA-friendly tiles; fp16/bf16: tensor-core tiles)
_FWD_CONFIGS = {fp32: _config_list(_fwd_configs(fp32)) for fp32 in (False, True)}
_fused_ce_fwd_tuned = {fp32: triton.autotune(configs=cfgs, key=["V", "H", "T_BUCKET"])(_fused_ce_fwd_kernel)
                       for fp32, cfgs in _FWD_CONFIGS.items()}


# ----------------------------------------------------------------------------------------------
# backward kernel


def _bwd_configs(fp32: bool):
    if fp32:
        return _tile_configs([(64, 64, 32, 8, 3), (128, 64, 32, 8, 2), (64, 64, 16, 4, 3), (32, 64, 32, 4, 2)])
    # (128 × 256 would need ~280 KB of shared memory for the pipelined operands: over the 228 KB)
    return _tile_configs([(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (64, 256, 64, 8, 2), (128, 64, 64, 4, 4),
                          (64, 128, 64, 4, 4), (64, 64, 128, 4, 3)])


_BWD_CONFIGS = {fp32: _config_list(_bwd_configs(fp32)) for fp32 in (False, True)}
# mode keys (autotune key: each pass is tuned on its own)
_MODE_SINGLE, _MODE_DX, _MODE_DW = 0, 1, 2


@triton.jit(do_not_specialize=["T", "T_START", "T_END"],
            do_not_specialize_on_alignment=["row_max_ptr", "log_sumexp_ptr", "coef_ptr"])
def _fused_ce_bwd_kernel(
    # outputs
    dx_ptr,  # fp32 accumulator of dX rows T_START.. (row 0 = token T_START) (COMPUTE_DX)
    dw_ptr,  # dW rows V_START.. (row 0 = vocab row V_START): fp32 accumulator, or the weight's dtype if GRAD_W_STORE (COMPUTE_DW)
    db_ptr,  # (V,) fp32: accumulator, or stored if GRAD_W_STORE (COMPUTE_DB)
    # pointers
    x_ptr,  # (T, H) input
    w_ptr,  # (V, H) input dtype
    b_ptr,  # (V,) bias (HAS_BIAS)
    y_ptr,  # (T,) int64 targets
    cw_ptr,  # (V,) fp32 class weights (HAS_WEIGHT and HAS_SMOOTHING)
    row_max_ptr,  # (T,) fp32 m_t, and ...
    log_sumexp_ptr,  # (T,) fp32 log Σ_v exp(s_tv − m_t): lse = m + this, kept apart (see below)
    coef_ptr,  # (3, T) fp32 per-row coefficients a_t − b_t, b_t, c_t (0 for ignored rows): G = (a·p − b·[v=y] − c·w_v)·s'
    # shapes
    T, V, H,
    T_START, T_END, V_START, V_END,  # the rectangle of (token, vocab) this launch covers
    T_BUCKET, MODE,  # autotune keys only
    # strides
    stride_xt, stride_xh, stride_wv, stride_wh, stride_b,
    stride_dxt, stride_dwv,  # accumulators (unit last stride)
    # options
    IGNORE_INDEX, SOFTCAP,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
    COMPUTE_DX: tl.constexpr, COMPUTE_DW: tl.constexpr, COMPUTE_DB: tl.constexpr,
    GRAD_W_STORE: tl.constexpr,  # one token block covers all T: store dW/db instead of accumulating
    GROUP_T: tl.constexpr,  # token blocks per program group (launch order)
    USE_LIBDEVICE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    # meta-parameters
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # 1. which (token block, vocab tile): grouped order as in the matmul tutorial, GROUP_T token
    #    blocks × all vocab tiles of the launch, token blocks fastest, so that the programs in flight
    #    share X rows, W rows and the accumulator rows they add into while those sit in L2
    pid = tl.program_id(0)
    n_t = tl.cdiv(T_END - T_START, BLOCK_T)
    n_v = tl.cdiv(V_END - V_START, BLOCK_V)
    per_group = GROUP_T * n_v
    first_t = (pid // per_group) * GROUP_T
    group_size = tl.minimum(n_t - first_t, GROUP_T)
    pid_t = first_t + (pid % per_group) % group_size
    pid_v = (pid % per_group) // group_size
    offs_t = T_START + pid_t * BLOCK_T + tl.arange(0, BLOCK_T)  # (BLOCK_T,)
    offs_v = V_START + pid_v * BLOCK_V + tl.arange(0, BLOCK_V)  # (BLOCK_V,)
    mask_t = offs_t < T_END
    mask_v = offs_v < V_END
    y = tl.load(y_ptr + offs_t, mask=mask_t, other=IGNORE_INDEX)  # (BLOCK_T,) int64
    valid = mask_t & (y != IGNORE_INDEX)  # (BLOCK_T,)
    y = y.to(tl.int32)  # V < 2^31; int32 compares over the tile are cheaper
    if not GRAD_W_STORE:
        # a block of ignored tokens (padding) contributes nothing: skip the three GEMM tiles
        if tl.max(valid.to(tl.int32), axis=0) == 0:
            return

    # 2. recompute the logit tile
    z = _logit_tile(x_ptr, w_ptr, b_ptr, offs_t, offs_v, mask_t, mask_v, H,
                    stride_xt, stride_xh, stride_wv, stride_wh, stride_b,
                    HAS_BIAS, DOT_PRECISION, BLOCK_T, BLOCK_V, BLOCK_H)  # (BLOCK_T, BLOCK_V)
    if HAS_SOFTCAP:
        u = z / SOFTCAP
        s = SOFTCAP * tanh(u, USE_LIBDEVICE)
        # s' = 1 − tanh²(u) = 4e/(1 + e)², e = exp(−2|u|): no cancellation where |tanh| → 1
        e = tl.exp(-2.0 * tl.abs(u))
        ds_dz = 4.0 * e / ((1.0 + e) * (1.0 + e))  # (BLOCK_T, BLOCK_V)
    else:
        s = z

    # 3. G = g_t·∂ℓ_t/∂z_tv = (a_t·p_tv − b_t·[v = y_t] − c_t·w_v)·s'(z_tv)
    # p = exp((s − m) − log Σ): with |s| ~ 1e3 a single rounded fp32 lse would cost ~1e-4 relative error in p
    row_m = tl.load(row_max_ptr + offs_t, mask=mask_t, other=0.0)  # (BLOCK_T,)
    log_d = tl.load(log_sumexp_ptr + offs_t, mask=mask_t, other=0.0)  # (BLOCK_T,)
    c_extra = tl.load(coef_ptr + offs_t, mask=mask_t, other=0.0)  # (BLOCK_T,) a − b
    cb = tl.load(coef_ptr + T + offs_t, mask=mask_t, other=0.0)  # (BLOCK_T,)
    log_p = (s - row_m[:, None]) - log_d[:, None]  # (BLOCK_T, BLOCK_V)
    p = tl.exp(log_p)
    # at the target a·p − b = b·(p − 1) + (a − b)·p with p − 1 = expm1(log p): exact where p_y → 1
    # (a confident prediction), where p − 1 in fp32 keeps few digits or none
    # (per element: picking the target's log p out of the tile per row made the plain dX pass spill
    # registers on sm_90, this form none)
    is_y = offs_v[None, :] == y[:, None]
    g = tl.where(is_y, cb[:, None] * expm1(log_p) + c_extra[:, None] * p, (cb + c_extra)[:, None] * p)
    if HAS_SMOOTHING:
        cc = tl.load(coef_ptr + 2 * T + offs_t, mask=mask_t, other=0.0)  # (BLOCK_T,)
        if HAS_WEIGHT:
            wv = tl.load(cw_ptr + offs_v, mask=mask_v, other=0.0)  # (BLOCK_V,)
            g -= cc[:, None] * wv[None, :]
        else:
            g -= cc[:, None]
    if HAS_SOFTCAP:
        g *= ds_dz
    # ignored / out-of-range rows and out-of-range columns are exactly 0 (where, not a product:
    # p may be inf/NaN in padded rows)
    g = tl.where(valid[:, None] & mask_v[None, :], g, 0.0)  # (BLOCK_T, BLOCK_V) fp32

    # 4. db = Σ_t G
    if COMPUTE_DB:
        db_part = tl.sum(g, axis=0)  # (BLOCK_V,)
        if GRAD_W_STORE:
            tl.store(db_ptr + offs_v, db_part, mask=mask_v)
        else:
            tl.atomic_add(db_ptr + offs_v, db_part, mask=mask_v, sem="relaxed")

    # 5. dX[t, h] += G·W[v, h] and dW[v, h] += Gᵀ·X[t, h], BLOCK_H columns of H at a time; the
    #    GEMM operands are G rounded to the input dtype (as a same-dtype torch backward would),
    #    the products accumulate in fp32
    gc = g.to(x_ptr.dtype.element_ty)  # (BLOCK_T, BLOCK_V)
    x_rows = x_ptr + offs_t.to(tl.int64)[:, None] * stride_xt  # (BLOCK_T, 1)
    w_rows = w_ptr + offs_v.to(tl.int64)[:, None] * stride_wv  # (BLOCK_V, 1)
    dx_rows = dx_ptr + (offs_t - T_START).to(tl.int64)[:, None] * stride_dxt  # (BLOCK_T, 1)
    dw_rows = dw_ptr + (offs_v - V_START).to(tl.int64)[:, None] * stride_dwv  # (BLOCK_V, 1)
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)  # (BLOCK_H,)
        mask_h = offs_h < H
        if COMPUTE_DX:
            w_tile = tl.load(w_rows + offs_h[None, :] * stride_wh, mask=mask_v[:, None] & mask_h[None, :], other=0.0)  # (BLOCK_V, BLOCK_H)
            dx_part = dot_fp32_acc(gc, w_tile, None, DOT_PRECISION)  # (BLOCK_T, BLOCK_H) fp32
            tl.atomic_add(dx_rows + offs_h[None, :], dx_part, mask=valid[:, None] & mask_h[None, :], sem="relaxed")
        if COMPUTE_DW:
            x_tile = tl.load(x_rows + offs_h[None, :] * stride_xh, mask=mask_t[:, None] & mask_h[None, :], other=0.0)  # (BLOCK_T, BLOCK_H)
            dw_part = dot_fp32_acc(tl.trans(gc), x_tile, None, DOT_PRECISION)  # (BLOCK_V, BLOCK_H) fp32
            if GRAD_W_STORE:
                tl.store(dw_rows + offs_h[None, :], dw_part.to(dw_ptr.dtype.element_ty), mask=mask_v[:, None] & mask_h[None, :])
            else:
                tl.atomic_add(dw_rows + offs_h[None, :], dw_part, mask=mask_v[:, None] & mask_h[None, :], sem="relaxed")


# Autotuning runs the kernel several times on the real arguments: the accumulators are zeroed
# before each trial and after the last one. That is correct because a pass is tuned on its first
# launch (the key is constant within a pass), when every accumulator it adds into is still zero;
# accumulators a launch does not use are passed as a private dummy.
_fused_ce_bwd_tuned = {
    fp32: triton.autotune(configs=cfgs, key=["V", "H", "T_BUCKET", "MODE"],
                          reset_to_zero=["dx_ptr", "dw_ptr", "db_ptr"])(_fused_ce_bwd_kernel)
    for fp32, cfgs in _BWD_CONFIGS.items()}


# ----------------------------------------------------------------------------------------------
# host side: launch geometry


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _cdiv(a, b) * b


def _wave_efficiency(n_programs: int, n_sm: int) -> float:
    return n_programs / (_cdiv(n_programs, n_sm) * n_sm)


def _forward_splits(T: int, V: int, n_sm: int, granule: int, block_t: int) -> tuple[int, int]:
    """(n_split, split_v): enough programs for ≥ ~4 waves, few idle SMs in the last wave, partials
    within the accumulator budget. Splits are multiples of `granule` columns (whole tiles)."""
    n_tb = _cdiv(T, block_t)
    n_granules = _cdiv(V, granule)
    cap = max(1, min(n_granules, (fused_accumulator_budget(T, V) // (16 * max(T, 1)))))
    lo = max(1, min(cap, _cdiv(4 * n_sm, n_tb)))
    best = None
    for n in range(lo, min(cap, max(lo, 64)) + 1):
        split_v = _round_up(_cdiv(V, n), granule)
        n_split = _cdiv(V, split_v)
        eff = _wave_efficiency(n_tb * n_split, n_sm)
        if best is None or eff > best[0] + 0.005:
            best = (eff, n_split, split_v)
    return best[1], best[2]


def _chunk_rows(budget: int, H: int, granule: int, total: int) -> int:
    """Rows of an fp32 [rows, H] accumulator that fit `budget` bytes (a multiple of `granule`, at least
    one granule, at most `total` rounded up)."""
    rows = max(granule, (budget // (4 * H)) // granule * granule)
    return min(rows, _round_up(total, granule))


def _v_chunk_rows(budget: int, H: int, granule: int, V: int, T: int, n_sm: int | None, block_t: int) -> int:
    """`_chunk_rows` for a V-chunk, shortened where that fills the GPU's waves better: a V-chunk's
    launch runs cdiv(T, block_t) × rows/128 programs (128-wide V tiles, the tuned backward's), and at
    T = 4096 the 768 rows that a ~14.6 MiB budget allows give 192 programs on 132 SMs (1.45 waves,
    73 % busy) where 512 rows give 128 (one wave, 97 %). n_sm None: no wave rule (tests, model)."""
    most = _chunk_rows(budget, H, granule, V)
    if n_sm is None:
        return most
    n_tb = _cdiv(T, block_t)
    # the most rows among those within 2 % of the best wave efficiency
    options = [(_wave_efficiency(n_tb * _cdiv(rows, 128), n_sm), rows) for rows in range(granule, most + 1, granule)]
    best = max(eff for eff, _ in options)
    return max(rows for eff, rows in options if eff >= best - 0.02)


def _plan_backward(T, V, H, x_dtype, w_dtype, need_dx, need_dw, budget, granule_t, granule_v, min_block_t,
                   n_sm=None):
    """Launch plan: list of passes (mode, axis, chunk) and the workspace shapes. n_sm: size the
    V-chunks of a pass over all T for whole waves (`_v_chunk_rows`)."""
    dx_direct = x_dtype == torch.float32
    dw_store = T <= min_block_t
    dw_direct = w_dtype == torch.float32 or dw_store
    dx_scratch = need_dx and not dx_direct
    dw_scratch = need_dw and not dw_direct
    if not dw_scratch:
        # no V-chunking needed; chunk T only if a bf16/fp16 dX accumulator does not fit
        tc = T if (not dx_scratch or 4 * T * H <= budget) else _chunk_rows(budget, H, granule_t, T)
        return [(_MODE_SINGLE, "T", tc)], dw_store
    if not dx_scratch or 4 * T * H + 4 * granule_v * H <= budget:
        vc = _chunk_rows(budget - (4 * T * H if dx_scratch else 0), H, granule_v, V)
        return [(_MODE_SINGLE, "V", vc)], dw_store
    passes = []
    if need_dx:
        passes.append((_MODE_DX, "T", _chunk_rows(budget, H, granule_t, T)))
    passes.append((_MODE_DW, "V", _v_chunk_rows(budget, H, granule_v, V, T, n_sm, granule_t)))
    return passes, dw_store


def workspace_bytes(T: int, V: int, H: int, dtype: torch.dtype, *, need_dx: bool = True, need_dw: bool = True,
                    max_workspace_bytes: int | None = None) -> dict:
    """Extra device memory of the fused strategy beyond inputs and returned gradients (bytes, upper
    bounds): {'forward': partials + loss/lse, 'backward': fp32 accumulators + row coefficients}."""
    n_split, _ = _forward_splits(T, V, 132, _V_GRANULE, 128)
    fwd = 16 * n_split * T + 8 * T
    budget = fused_accumulator_budget(T, V) if max_workspace_bytes is None else max_workspace_bytes
    passes, _ = _plan_backward(T, V, H, dtype, dtype, need_dx, need_dw, budget, 128, _V_GRANULE, 64)
    ws = 0
    for mode, axis, chunk in passes:
        rows = 0
        if need_dx and dtype != torch.float32 and mode in (_MODE_SINGLE, _MODE_DX):
            rows += min(chunk, T) if axis == "T" else T
        if need_dw and dtype != torch.float32 and mode in (_MODE_SINGLE, _MODE_DW) and axis == "V":
            rows += min(chunk, V)
        ws = max(ws, 4 * rows * H)
    return {"forward": fwd, "backward": ws + 12 * T + 4 * V}


# ----------------------------------------------------------------------------------------------
# host side: entry points


def _meta(block_config, fp32: bool):
    """(launch kwargs for the raw kernel or None for the autotuned one, min BLOCK_T, T granule, V granule)."""
    if block_config is None:
        cfgs = _BWD_CONFIGS[fp32] + _FWD_CONFIGS[fp32]
        min_bt = min(c.kwargs["BLOCK_T"] for c in cfgs)
        max_bt = max(c.kwargs["BLOCK_T"] for c in cfgs)
        granule_v = max(_V_GRANULE if not interpreting() else 0, max(c.kwargs["BLOCK_V"] for c in cfgs))
        return None, min_bt, max_bt, granule_v
    kw = {k: block_config[k] for k in ("BLOCK_T", "BLOCK_V", "BLOCK_H")}
    kw["num_warps"] = block_config.get("num_warps", 4)
    kw["num_stages"] = block_config.get("num_stages", 1 if interpreting() else 3)
    return kw, kw["BLOCK_T"], kw["BLOCK_T"], kw["BLOCK_V"]


def _options(x, bias, class_weight, softcap, label_smoothing):
    """(option flags of both kernels, the softcap c (1.0 when off), class weights as fp32 or None)."""
    has_softcap = softcap is not None and float(softcap) != 0.0
    cw = class_weight.contiguous().to(torch.float32) if class_weight is not None else None
    flags = dict(
        HAS_BIAS=bias is not None,
        HAS_WEIGHT=cw is not None,
        HAS_SOFTCAP=has_softcap,
        HAS_SMOOTHING=float(label_smoothing) > 0.0,
        USE_LIBDEVICE=not interpreting(),
        DOT_PRECISION=dot_precision(x.dtype),
    )
    return flags, (float(softcap) if has_softcap else 1.0), cw


def fused_ce_forward(x, weight, bias, target, class_weight, *, ignore_index, label_smoothing, z_loss, softcap,
                     block_config=None, n_split=None, return_stats=False):
    """Per-token loss and lse without materializing the logits.

    x [T, H], weight [V, H] (same dtype: fp32, fp16 or bf16; unit last stride is fastest), bias [V] or
    None, target [T] int64, class_weight [V] fp32 or None. Returns (loss_tok [T] fp32, lse [T] fp32):
    ℓ_t of docs/design.md (0 for ignored tokens) and logsumexp_v s_tv (for every token); with
    `return_stats`, (loss_tok, stats [2, T] fp32 = (m_t, log Σ exp(s − m_t))) instead, the precise form
    that `fused_ce_backward` prefers.
    `block_config` / `n_split` (tests): fixed BLOCK_T/BLOCK_V/BLOCK_H (+ num_warps, num_stages, and
    GROUP_T for the backward's launch order) instead of autotuning, and a fixed number of V-splits.
    """
    T, H = x.shape
    V = weight.shape[0]
    dev = x.device
    if T == 0:
        return torch.zeros(0, device=dev, dtype=torch.float32), torch.zeros(0, device=dev, dtype=torch.float32)
    target = target.contiguous()
    eps = float(label_smoothing)
    opts, cap, cw = _options(x, bias, class_weight, softcap, eps)
    has_weight, fp32 = cw is not None, x.dtype == torch.float32
    kw, _, max_bt, granule_v = _meta(block_config, fp32)
    if n_split is None:
        n_split, split_v = _forward_splits(T, V, sm_count(dev), granule_v, max_bt)
    else:
        split_v = _round_up(_cdiv(V, n_split), granule_v)
        n_split = _cdiv(V, split_v)

    # 1. per-(split, token) partials; NaN-poisoned so that an unwritten element cannot go unnoticed
    part = torch.full((4, n_split, T), float("nan"), device=dev, dtype=torch.float32)
    args = (part, x, weight, bias if bias is not None else x, target, cw if has_weight else part,
            T, V, H, n_split, split_v, triton.next_power_of_2(T),
            x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), bias.stride(0) if bias is not None else 0,
            part.stride(0), part.stride(1), cap)
    if kw is None:
        grid = lambda META: (n_split * triton.cdiv(T, META["BLOCK_T"]),)  # noqa: E731
        _fused_ce_fwd_tuned[fp32][grid](*args, **opts)
    else:
        _fused_ce_fwd_kernel[(n_split * triton.cdiv(T, kw["BLOCK_T"]),)](*args, **opts, **kw)

    # 2. combine the splits: lse = M + log1p(rest) with rest = Σ_s rest_s·e_s + Σ_{s ≠ s*} e_s,
    #    e_s = exp(m_s − M), s* the first split holding M (its own 1 stays out of rest, see step 4).
    #    The same merge as `ce_rows._merge_mass`, in torch ops on purpose: the row kernels' merge reads a
    #    token's partials as one power-of-two vector, and that [3, T, next_pow2(n_split)] copy would
    #    add 12 MiB at 32768 tokens (n_split = 17) on top of these 8.5 MiB of partials: over 16 MiB.
    m, rest, sy = part[0], part[1], part[2]
    big_m = m.amax(dim=0)
    scale = torch.exp(m - big_m)  # (n_split, T)
    not_first = torch.ones_like(m, dtype=torch.bool).scatter_(0, m.argmax(dim=0, keepdim=True), False)
    log_d = torch.log1p((rest * scale).sum(dim=0) + torch.where(not_first, scale, 0.0).sum(dim=0))
    lse = big_m + log_d
    sy = sy.sum(dim=0)  # only the split holding y_t contributes

    # 3. ℓ_t = (1−ε)·w_y·(lse − s_y) + (ε/V)·(W_sum·lse − Σ_v w_v·s_v) + z_loss·lse²
    valid = target != ignore_index
    w_y = cw[target.clamp(0, V - 1)] if has_weight else 1.0
    loss = (1.0 - eps) * w_y * ((big_m - sy) + log_d)  # lse − s_y, exact when y is the max and p_y → 1
    if eps > 0.0:
        w_sum = cw.sum() if has_weight else float(V)
        loss = loss + (eps / V) * (w_sum * lse - part[3].sum(dim=0))
    if z_loss:
        loss = loss + float(z_loss) * lse * lse
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    return (loss, torch.stack([big_m, log_d])) if return_stats else (loss, lse)


def fused_ce_backward(x, weight, bias, target, class_weight, lse, grad_tok, *, ignore_index, label_smoothing,
                      z_loss, softcap, need_dx, need_dw, need_db, max_workspace_bytes=None, block_config=None):
    """Gradients of Σ_t grad_tok[t]·ℓ_t, recomputing the logits tile by tile.

    grad_tok [T] fp32 = ∂L/∂ℓ_t (ignored tokens are zeroed here too), lse [T] fp32 from the forward, or
    its precise form stats [2, T] (`fused_ce_forward(..., return_stats=True)`).
    Returns (dx [T, H] in x.dtype or None, dw [V, H] in weight.dtype or None, db [V] in bias.dtype or
    None). `max_workspace_bytes` bounds the fp32 accumulators (default: what 16 MiB leaves after the
    O(T + V) vectors, so that all extra memory stays within 16 MiB; larger allows one pass instead of
    two when x is bf16/fp16); `block_config` (tests): fixed block sizes, see forward.
    """
    T, H = x.shape
    V = weight.shape[0]
    dev = x.device
    need_db = bool(need_db) and bias is not None
    need_dx, need_dw = bool(need_dx), bool(need_dw)
    if not (need_dx or need_dw or need_db):
        return None, None, None
    if T == 0:
        return (torch.zeros_like(x) if need_dx else None, torch.zeros_like(weight) if need_dw else None,
                torch.zeros_like(bias) if need_db else None)
    budget = fused_accumulator_budget(T, V) if max_workspace_bytes is None else int(max_workspace_bytes)
    eps = float(label_smoothing)
    opts, cap, cw = _options(x, bias, class_weight, softcap, eps)
    has_weight, fp32 = cw is not None, x.dtype == torch.float32
    kw, min_bt, max_bt, granule_v = _meta(block_config, fp32)
    target = target.contiguous()
    if lse.dim() == 2:  # stats (m, log Σ): exact s − m in the kernel
        row_max, log_sumexp = lse[0].contiguous().float(), lse[1].contiguous().float()
    else:
        row_max, log_sumexp = lse.contiguous().float(), torch.zeros_like(lse, dtype=torch.float32)
    lse = row_max + log_sumexp

    # 1. per-row coefficients of G (0 for ignored rows):
    #    a = g·((1−ε)·w_y + ε·W_sum/V + 2·z_loss·lse), b = g·(1−ε)·w_y, c = g·ε/V; the kernel takes a − b
    #    rather than a (see its step 3)
    valid = target != ignore_index
    g = torch.where(valid, grad_tok.to(torch.float32), torch.zeros((), device=dev))
    w_y = cw[target.clamp(0, V - 1)] if has_weight else torch.ones((), device=dev)
    w_sum = cw.sum() if has_weight else float(V)
    coef = torch.empty((3, T), device=dev, dtype=torch.float32)
    coef[0] = torch.where(valid, g * (eps * w_sum / V + 2.0 * float(z_loss) * lse), 0.0)
    coef[1] = g * ((1.0 - eps) * w_y)
    coef[2] = g * (eps / V)

    # 2. outputs and fp32 accumulators (see the module docstring for the plan)
    passes, dw_store = _plan_backward(T, V, H, x.dtype, weight.dtype, need_dx, need_dw, budget,
                                      max_bt, granule_v, min_bt, n_sm=sm_count(dev) if kw is None else None)
    dummy = torch.zeros(1, device=dev, dtype=torch.float32)
    dx = dx_acc = None
    if need_dx:
        if x.dtype == torch.float32:
            dx = dx_acc = torch.zeros((T, H), device=dev, dtype=torch.float32)
        else:
            dx = torch.full((T, H), float("nan"), device=dev, dtype=x.dtype)  # poison: every row is flushed
    dw = None
    if need_dw:
        if dw_store:
            dw = torch.full_like(weight, float("nan"), memory_format=torch.contiguous_format)
        elif weight.dtype == torch.float32:
            dw = torch.zeros((V, H), device=dev, dtype=torch.float32)
        else:
            dw = torch.full((V, H), float("nan"), device=dev, dtype=weight.dtype)
    db_acc = (torch.full((V,), float("nan"), device=dev, dtype=torch.float32) if dw_store
              else torch.zeros(V, device=dev, dtype=torch.float32)) if need_db else None

    group_t = block_config.get("GROUP_T", 8) if block_config is not None else 8
    t_bucket = triton.next_power_of_2(T)
    for mode, axis, chunk in passes:
        do_dx = need_dx and mode in (_MODE_SINGLE, _MODE_DX)
        do_dw = need_dw and mode in (_MODE_SINGLE, _MODE_DW)
        do_db = need_db and mode in (_MODE_SINGLE, _MODE_DX if need_dx else _MODE_DW)
        # fp32 workspaces of this pass
        dx_ws = None
        if do_dx and dx_acc is None:
            dx_ws = torch.zeros((min(chunk, T) if axis == "T" else T, H), device=dev, dtype=torch.float32)
        dw_ws = None
        if do_dw and not dw_store and weight.dtype != torch.float32:
            dw_ws = torch.zeros((min(chunk, V), H), device=dev, dtype=torch.float32)
        n = T if axis == "T" else V
        for lo in range(0, n, chunk):
            hi = min(lo + chunk, n)
            t0, t1, v0, v1 = (lo, hi, 0, V) if axis == "T" else (0, T, lo, hi)
            dx_arg = (dx_ws if dx_ws is not None else dx_acc[t0:]) if do_dx else dummy
            dw_arg = (dw_ws if dw_ws is not None else dw[v0:]) if do_dw else dummy
            db_arg = db_acc if do_db else dummy
            args = (dx_arg, dw_arg, db_arg, x, weight, bias if bias is not None else x, target,
                    cw if has_weight else dummy, row_max, log_sumexp, coef,
                    T, V, H, t0, t1, v0, v1, t_bucket, mode,
                    x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
                    bias.stride(0) if bias is not None else 0, dx_arg.stride(0), dw_arg.stride(0),
                    ignore_index, cap)
            flags = dict(COMPUTE_DX=do_dx, COMPUTE_DW=do_dw, COMPUTE_DB=do_db, GRAD_W_STORE=dw_store,
                         GROUP_T=group_t, **opts)
            if kw is None:
                grid = lambda META: (triton.cdiv(t1 - t0, META["BLOCK_T"]) * triton.cdiv(v1 - v0, META["BLOCK_V"]),)  # noqa: E731
                _fused_ce_bwd_tuned[fp32][grid](*args, **flags)
            else:
                grid = (triton.cdiv(t1 - t0, kw["BLOCK_T"]) * triton.cdiv(v1 - v0, kw["BLOCK_V"]),)
                _fused_ce_bwd_kernel[grid](*args, **flags, **kw)
            # 3. flush the chunk's fp32 workspace into the output dtype
            if dx_ws is not None and axis == "T":
                dx[t0:t1].copy_(dx_ws[: t1 - t0])
                if hi < n:
                    dx_ws.zero_()
            if dw_ws is not None:
                dw[v0:v1].copy_(dw_ws[: v1 - v0])
                if hi < n:
                    dw_ws.zero_()
        if dx_ws is not None and axis == "V":
            dx.copy_(dx_ws)
        # drop *every* reference to this pass's workspace (the launch arguments hold it too) before the
        # next pass allocates its own: otherwise the dX and dW workspaces coexist, 2 × the budget
        del dx_ws, dw_ws
        dx_arg = dw_arg = args = None  # noqa: F841

    db = db_acc.to(bias.dtype) if need_db else None
    return dx, dw, db
