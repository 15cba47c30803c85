"""Row kernels of the chunked strategy: per-token LSE, loss and logits-gradient over a logits chunk.

The chunked strategy lets cuBLAS form a bounded chunk of logits [C, V] (C tokens); each row is then
split into SPLIT slices so that C·SPLIT programs keep enough loads in flight (one program per row was
latency-bound: docs/design.md). Kernel 1 (`_row_stats_kernel`) streams each slice
once for a partial online max / sum-exp (and the label-smoothing sum), and copies out the target's
logit. Kernel 2 (`_row_finish_kernel`) merges a row's partials into its lse and loss and, when a
gradient is wanted, streams its slice again and overwrites it *in place* with ∂L/∂z, so the same
buffer feeds the dX and dW GEMMs. A row's SPLIT programs of kernel 2 run concurrently, so none of
them may read the row outside its own slice: the loss takes s_y from kernel 1's copy, never from the
row (which may already hold another slice's gradient).
Trade-off: the chunk is read twice and written once (3·C·V·elt bytes, a few % of the three
GEMMs at V = 128256; measured: docs/design.md) in exchange for
cuBLAS-speed GEMMs and a buffer that does not grow with the number of tokens. Math: docs/design.md.

Precision where one class dominates (p_y → 1, common for easy tokens): the statistics carry
Σ exp(s − max) − 1 rather than Σ exp(s − max) ≈ 1, so log Σ = log1p(·) keeps fp32's relative
precision in the small mass of the other classes, and the target's p_y − 1 is formed with expm1.
Without both, 1 − p_y = 1e-5 keeps ~2 digits in fp32 (test_confident_prediction_gradient_keeps_its_digits).

Entropy (HAS_ENTROPY, compiled out otherwise): one more row statistic, A = Σ exp(s − m)·(s − m), merged
like the sum-exp, gives H = lse − Σ p s = log Σ − A/Σ; its gradient ∂H/∂s_v = −p_v·(log p_v + H) joins
the in-place gradient with the token's own upstream weight (`linear_logprobs(return_entropy=True)`).

The logits' sum (SUM_LOGITS, `logit_sum`): Σ_v s_v of a row, the mean logit's numerator (TRL's `mean_logits`,
which a softcap makes a function of every logit). It is label smoothing's Σ w·s with no class weight, so the
statistics kernel accumulates it under the same flag and it merges like the other partials; the finish kernel
stores it instead of adding it to the loss (ε = 0 there), which stays bit for bit what it is without it.

Size (> 400 lines): the statistics and finish kernels and their launchers share the split and merge rules,
which one file keeps in one place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedkern._runtime import autotune_configs, interpreting
from fusedkern.kernels.device_math import expm1, log1p, softcapped, tanh


@triton.jit
def _merge_mass(m_parts, rest_parts, idx):
    """Merge partial (max m_i, rest_i = Σ exp(s − m_i) over a part *without* its max element) into the
    row's (m, rest): rest = Σ_i rest_i·e_i + Σ_{i ≠ i*} e_i with e_i = exp(m_i − m) and i* the first
    part holding m. Keeping Σexp − 1 instead of Σexp is what makes log Σexp = log1p(rest) exact when
    one class dominates (Σexp = 1.0016 in fp32 keeps 4 digits of its 0.0016; rest keeps 7). Parts
    with m_i = −inf (empty) carry no mass."""
    m = tl.max(m_parts, axis=0)
    valid = m_parts != -float("inf")
    e = tl.where(valid, tl.exp(m_parts - m), 0.0)
    first = tl.argmax(m_parts, axis=0)
    rest = tl.sum(rest_parts * e, axis=0) + tl.sum(tl.where(idx != first, e, 0.0), axis=0)
    return m, rest


_CONFIGS = [
    triton.Config({"BLOCK_V": block}, num_warps=warps, num_stages=stages)
    for block, warps in ((1024, 4), (2048, 8), (4096, 8), (4096, 16)) for stages in (1, 3)
]
if interpreting():  # tiny shapes on CPU: a small block keeps the masked tail paths exercised
    _CONFIGS = [triton.Config({"BLOCK_V": 32}, num_warps=1)]


@triton.jit
def _merge_entropy(m_parts, rest_parts, a_parts, m):
    """Merge partial A_i = Σ exp(s − m_i)·(s − m_i) into the row's A = Σ exp(s − m)·(s − m), m the row's max:
    A = Σ_i e_i·(A_i + (m_i − m)·(rest_i + 1)), e_i = exp(m_i − m). Empty parts (m_i = −inf) carry nothing
    (and must not reach −inf·0)."""
    valid = m_parts != -float("inf")
    e = tl.where(valid, tl.exp(m_parts - m), 0.0)
    shift = tl.where(valid, m_parts - m, 0.0)
    return tl.sum(tl.where(valid, e * (a_parts + shift * (rest_parts + 1.0)), 0.0), axis=0)


@triton.jit
def _stats_block(row_ptr, cols, col1, class_weight_ptr, softcap, logit_scale, m_lane, d_lane, ws_lane, a_lane,
                 MASKED: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                 HAS_SCALE: tl.constexpr, HAS_ENTROPY: tl.constexpr, USE_LIBDEVICE: tl.constexpr):
    """One BLOCK_V step of the per-lane online (max m, rest = Σ exp(s − m) − 1, Σ w·s, and with HAS_ENTROPY
    A = Σ exp(s − m)·(s − m)). MASKED: the slice's tail. HAS_SMOOTHING compiles in Σ w·s: label smoothing's, or
    without class weights the logits' sum Σ s (`ce_rows`' logit_sum).
    Full blocks skip every mask and the label-smoothing sum is compiled in only when ε > 0: an earlier
    form of this loop ran well below the GPU's memory bandwidth (docs/design.md), so the instructions per
    element are what it costs."""
    if MASKED:
        mask = cols < col1
        z = tl.load(row_ptr + cols, mask=mask, other=0.0)
    else:
        z = tl.load(row_ptr + cols)
    s = softcapped(z.to(tl.float32), softcap, logit_scale, HAS_SOFTCAP, HAS_SCALE, USE_LIBDEVICE)  # 0 if masked out
    # One exp per element: with u = exp(−|s − m|), a new max gives rest' = (rest + 1)·u and m = s,
    # otherwise rest + u (rest = Σ exp(s − m) without the max's own 1, see `_merge_mass`). The lane
    # starts at m = −inf, so a finite first s gives u = exp(−inf) = 0; an s = −inf (a −inf bias masking
    # padded vocabulary) carries no mass, and must not meet m = −inf in −inf − (−inf) = NaN.
    u = tl.where(s == -float("inf"), 0.0, tl.exp(-tl.abs(s - m_lane)))
    is_new_max = s > m_lane
    if HAS_ENTROPY:
        # t = −|s − m|: a new max rescales the lane's terms by u and shifts each by t (A' = u·A + u·t·(rest + 1),
        # the new max's own term being 0), else the element adds u·t. u = 0 (first element, −inf, underflow)
        # adds nothing: u·t would be 0·(−inf) there.
        ut = u * tl.where(u == 0.0, 0.0, -tl.abs(s - m_lane))
        a_new = tl.where(is_new_max, u * a_lane + ut * (d_lane + 1.0), a_lane + ut)
        if MASKED:
            a_new = tl.where(mask, a_new, a_lane)
    else:
        a_new = a_lane
    d_new = tl.where(is_new_max, (d_lane + 1.0) * u, d_lane + u)
    m_new = tl.maximum(m_lane, s)
    if MASKED:  # masked-out lanes keep (m, d)
        d_new = tl.where(mask, d_new, d_lane)
        m_new = tl.where(mask, m_new, m_lane)
    if HAS_SMOOTHING:  # s = 0 on masked-out lanes, and so is the loaded weight
        if HAS_WEIGHT:
            ws_lane += tl.load(class_weight_ptr + cols, mask=cols < col1, other=0.0) * s
        else:
            ws_lane += s
    return m_new, d_new, ws_lane, a_new


@triton.jit
def _program_row(logits_ptr, stride_row):
    """(row, slice, row pointer) of this program: axis 0 walks the rows, axis 1 the row's slices. int64
    offsets: row · stride reaches 32768 · 128256 > 2^31 when a caller passes a big chunk."""
    row = tl.program_id(0).to(tl.int64)
    return row, tl.program_id(1), logits_ptr + row * stride_row


#: the row kernels' per-row vectors and partials, compiled without an assumption on their pointers' 16-byte
#: alignment: they are rows and slices of [2, T] and [planes, C, SPLIT] buffers (and the row count a slice of the
#: per-chunk counts), whose alignment changes with the token count, and a specialization on it recompiled both
#: kernels (0.2–0.5 s each) whenever a GRPO micro-batch's token count changed its residue mod 4. Each is touched once
#: a row (one element, or a row's SPLIT ≤ 64 partials in the merge) beside the row's V logits; what the merge's
#: partial loads lose without 16-byte alignment is not yet measured.
ROW_VECTORS = ["partial_max_ptr", "partial_sumexp_ptr", "partial_wsum_ptr", "partial_ent_ptr", "target_ptr",
               "target_logit_ptr", "loss_ptr", "row_max_ptr", "log_sumexp_ptr", "entropy_ptr", "grad_entropy_ptr",
               "logit_sum_ptr", "grad_ptr", "row_count_ptr"]


@triton.autotune(configs=autotune_configs(_CONFIGS),
                 key=["V", "SPLIT", "HAS_WEIGHT", "HAS_SMOOTHING", "HAS_SOFTCAP", "FIND_TARGET", "HAS_ROW_COUNT",
                      "HAS_ENTROPY", "HAS_SCALE"])
@triton.jit(do_not_specialize_on_alignment=ROW_VECTORS)  # (the names a kernel lacks are ignored)
def _row_stats_kernel(
    # pointers
    partial_max_ptr,  # (C, SPLIT) fp32 out: max of the slice's s
    partial_sumexp_ptr,  # (C, SPLIT) fp32 out: Σ exp(s − max) − 1 over the slice (0 if empty)
    partial_wsum_ptr,  # (C, SPLIT) fp32 out: Σ w_v·s_v over the slice (HAS_SMOOTHING: label smoothing, or Σ s_v
    #                     for the logits' sum; else 0)
    partial_ent_ptr,  # (C, SPLIT) fp32 out: Σ exp(s − max)·(s − max) over the slice (HAS_ENTROPY)
    logits_ptr,  # (C, V) input dtype, read only
    class_weight_ptr,  # (V,) fp32 (HAS_WEIGHT)
    target_ptr,  # (C,) class indices (FIND_TARGET)
    target_logit_ptr,  # (C,) fp32 out: s of the target column, where it falls in this tile (FIND_TARGET)
    row_count_ptr,  # (1,) int: rows at or past it are skipped (HAS_ROW_COUNT; see `ce_rows`)
    # shapes and strides
    V, stride_row, span,  # span = columns per slice (the last slice ends at V)
    partial_stride,  # partials per row in the output arrays (≥ SPLIT; a tile writes its SPLIT of them)
    col_base,  # vocabulary index of the tile's column 0 (a vocabulary-sliced loss-only tile; else 0)
    # options
    softcap,
    logit_scale,  # s = softcap(z)·logit_scale (HAS_SCALE): 1/τ of a sampling temperature
    # meta-parameters
    SPLIT: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    FIND_TARGET: tl.constexpr, HAS_ROW_COUNT: tl.constexpr, HAS_ENTROPY: tl.constexpr, HAS_SCALE: tl.constexpr,
    USE_LIBDEVICE: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row, split, row_ptr = _program_row(logits_ptr, stride_row)
    if HAS_ROW_COUNT:
        if row >= tl.load(row_count_ptr):
            return
    offs = tl.arange(0, BLOCK_V)  # (BLOCK_V,)
    col0 = split * span
    col1 = tl.minimum(col0 + span, V)
    width = tl.maximum(col1 - col0, 0)  # 0 for an empty slice (V < SPLIT·span)
    full_end = col0 + (width // BLOCK_V) * BLOCK_V
    # Per-lane running max / sum-exp, reduced across lanes once after the loop: a block-wide
    # reduction per iteration put two barriers between consecutive loads.
    m_lane = tl.full((BLOCK_V,), -float("inf"), tl.float32)  # (BLOCK_V,)
    d_lane = tl.zeros((BLOCK_V,), tl.float32)
    ws_lane = tl.zeros((BLOCK_V,), tl.float32)
    a_lane = tl.zeros((BLOCK_V,), tl.float32)
    for start in range(col0, full_end, BLOCK_V):
        m_lane, d_lane, ws_lane, a_lane = _stats_block(
            row_ptr, start + offs, col1, class_weight_ptr, softcap, logit_scale, m_lane, d_lane, ws_lane, a_lane, False,
            HAS_WEIGHT, HAS_SMOOTHING, HAS_SOFTCAP, HAS_SCALE, HAS_ENTROPY, USE_LIBDEVICE)
    if full_end < col0 + width:
        m_lane, d_lane, ws_lane, a_lane = _stats_block(
            row_ptr, full_end + offs, col1, class_weight_ptr, softcap, logit_scale, m_lane, d_lane, ws_lane, a_lane,
            True, HAS_WEIGHT, HAS_SMOOTHING, HAS_SOFTCAP, HAS_SCALE, HAS_ENTROPY, USE_LIBDEVICE)
    m, d = _merge_mass(m_lane, d_lane, offs)
    ws = tl.sum(ws_lane, axis=0)
    out = row * partial_stride + split
    tl.store(partial_max_ptr + out, m)  # -inf for an empty slice (V < SPLIT·span): merged as 0 mass
    tl.store(partial_sumexp_ptr + out, d)
    tl.store(partial_wsum_ptr + out, ws)
    if HAS_ENTROPY:
        tl.store(partial_ent_ptr + out, _merge_entropy(m_lane, d_lane, a_lane, m))
    if FIND_TARGET:
        col_y = tl.load(target_ptr + row).to(tl.int64) - col_base  # outside [col0, col1) when ignored
        if (col_y >= col0) & (col_y < col1):
            s_y = softcapped(tl.load(row_ptr + col_y).to(tl.float32), softcap, logit_scale, HAS_SOFTCAP, HAS_SCALE,
                             USE_LIBDEVICE)
            tl.store(target_logit_ptr + row, s_y)


@triton.autotune(configs=autotune_configs(_CONFIGS),
                 key=["V", "SPLIT", "HAS_WEIGHT", "HAS_SOFTCAP", "COMPUTE_STATS", "WRITE_GRAD", "HAS_ROW_COUNT",
                      "HAS_ENTROPY", "HAS_SCALE", "SUM_LOGITS"],
                 # the kernel overwrites the logits with the gradient: every autotune trial starts from them
                 restore_value=["logits_ptr"])
@triton.jit(do_not_specialize_on_alignment=ROW_VECTORS)
def _row_finish_kernel(
    # pointers
    logits_ptr,  # (C, V) input dtype. In: logits z. Out (WRITE_GRAD): ∂L/∂z, in place
    loss_ptr,  # (C,) fp32 out: per-token loss ℓ_t, 0 where ignored (COMPUTE_STATS)
    row_max_ptr,  # (C,) fp32 m = max_v s_v: out when COMPUTE_STATS, else in (saved by the forward)
    log_sumexp_ptr,  # (C,) fp32 log Σ_v exp(s_v − m), so lse = m + log_sumexp: out / in like row_max
    partial_max_ptr, partial_sumexp_ptr, partial_wsum_ptr, partial_ent_ptr,  # (C, SPLIT) fp32 in (COMPUTE_STATS)
    entropy_ptr,  # (C,) fp32 entropy H_t of softmax(s), 0 where ignored: out / in like row_max (HAS_ENTROPY)
    grad_entropy_ptr,  # (C,) fp32 upstream ∂L/∂H_t (HAS_ENTROPY and WRITE_GRAD; with PER_TOKEN_GRAD)
    logit_sum_ptr,  # (C,) fp32 out: Σ_v s_v, merged from partial_wsum (SUM_LOGITS, with COMPUTE_STATS)
    target_ptr,  # (C,) int32/int64 class indices or ignore_index
    target_logit_ptr,  # (C,) fp32 s_y, copied out by the stats kernel (COMPUTE_STATS; see `ce_rows`)
    class_weight_ptr,  # (vocab_total,) fp32 class weights w_v of the whole vocabulary (HAS_WEIGHT)
    class_weight_sum_ptr,  # (1,) fp32 Σ_v w_v (HAS_WEIGHT)
    grad_ptr,  # fp32 upstream ∂L/∂ℓ_t: (C,) if PER_TOKEN_GRAD else (1,) shared by all tokens
    row_count_ptr,  # (1,) int: rows at or past it are skipped (HAS_ROW_COUNT)
    # shapes and strides
    V, stride_row, span,  # V: the chunk's columns (a vocabulary shard's, under vocabulary parallelism)
    col_base,  # vocabulary index of the chunk's column 0 (0 unless the chunk is one rank's vocabulary shard)
    vocab_total,  # the whole vocabulary's size (= V unless sharded): the target's range, ε/V, Σ w
    # options
    ignore_index,
    label_smoothing,  # ε
    z_loss,  # coefficient of lse²
    softcap,  # c in s = c·tanh(z/c) (HAS_SOFTCAP)
    logit_scale,  # s = softcap(z)·logit_scale (HAS_SCALE): 1/τ of a sampling temperature
    # meta-parameters
    SPLIT: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, COMPUTE_STATS: tl.constexpr,
    WRITE_GRAD: tl.constexpr, PER_TOKEN_GRAD: tl.constexpr, HAS_ROW_COUNT: tl.constexpr, HAS_ENTROPY: tl.constexpr,
    HAS_SCALE: tl.constexpr, SUM_LOGITS: tl.constexpr, USE_LIBDEVICE: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row, split, row_ptr = _program_row(logits_ptr, stride_row)
    if HAS_ROW_COUNT:
        if row >= tl.load(row_count_ptr):
            return
    target = tl.load(target_ptr + row).to(tl.int64)
    is_valid = target != ignore_index
    # out-of-range targets read column 0: the host raises on them after the launch (TargetRangeCheck)
    safe_target = tl.where(is_valid & (target >= 0) & (target < vocab_total), target, 0)
    target_col = target - col_base  # the target's column in this chunk (outside [0, V) on other shards)

    # 1. lse from the row's partials (every program of the row merges them: SPLIT loads, no sync).
    if COMPUTE_STATS:
        parts = row * SPLIT + tl.arange(0, SPLIT)  # (SPLIT,)
        m_parts, rest_parts = tl.load(partial_max_ptr + parts), tl.load(partial_sumexp_ptr + parts)
        m, rest = _merge_mass(m_parts, rest_parts, tl.arange(0, SPLIT))
        log_d = log1p(rest)
        if HAS_ENTROPY:
            # H = lse − Σ p s = log Σ − A/Σ: two non-negative terms (A ≤ 0), no cancellation
            entropy = log_d - _merge_entropy(m_parts, rest_parts, tl.load(partial_ent_ptr + parts), m) / (1.0 + rest)
            entropy = tl.where(is_valid, entropy, 0.0)
    else:
        m = tl.load(row_max_ptr + row)
        log_d = tl.load(log_sumexp_ptr + row)
        if HAS_ENTROPY:
            entropy = tl.load(entropy_ptr + row)
    # lse is kept as m + log_d: with |s| ~ 1e3 a rounded fp32 lse would cost p = exp(s − lse) ~1e-4
    # relative error, while s − m is exact and log_d is small
    lse = m + log_d

    # 2. The target's class weight (ignored rows read index 0 and are masked below).
    if HAS_WEIGHT:
        w_y = tl.load(class_weight_ptr + safe_target)
        w_sum = tl.load(class_weight_sum_ptr)
    else:
        w_y = 1.0
        w_sum = vocab_total * 1.0

    if COMPUTE_STATS:
        if split == 0:
            # ℓ = (1−ε)·w_y·(lse − s_y) + (ε/V)·Σ_v w_v (lse − s_v) + z_loss·lse²; s_y from the stats kernel
            s_y = tl.load(target_logit_ptr + row)
            ws = tl.sum(tl.load(partial_wsum_ptr + parts), axis=0)
            loss = (1.0 - label_smoothing) * w_y * ((m - s_y) + log_d)
            if SUM_LOGITS:  # the partials hold the logits' sum Σ s (ε = 0, no class weight): stored, not a loss term
                tl.store(logit_sum_ptr + row, ws)
            else:
                loss += (label_smoothing / vocab_total) * (w_sum * lse - ws)
            loss += z_loss * lse * lse
            tl.store(loss_ptr + row, tl.where(is_valid, loss, 0.0))
            tl.store(row_max_ptr + row, m)
            tl.store(log_sumexp_ptr + row, log_d)
            if HAS_ENTROPY:
                tl.store(entropy_ptr + row, entropy)

    # 3. Gradient of the slice, in place: g·{[(1−ε)w_y + ε·W/V + 2·z_loss·lse]·p − (1−ε)w_y·1[v=y] − (ε/V)·w_v}·tanh'
    if WRITE_GRAD:
        if PER_TOKEN_GRAD:
            g = tl.load(grad_ptr + row)
        else:
            g = tl.load(grad_ptr)
        coef_y = g * (1.0 - label_smoothing) * w_y
        coef_extra = g * (label_smoothing * w_sum / vocab_total + 2.0 * z_loss * lse)  # coef_p − coef_y
        coef_p = coef_y + coef_extra
        coef_w = g * label_smoothing / vocab_total
        if HAS_ENTROPY:  # ∂H/∂s_v = −p_v·(log p_v + H), weighted by the token's upstream ∂L/∂H
            g_entropy = tl.load(grad_entropy_ptr + row)  # an ignored row's gradient is zeroed below
        offs = tl.arange(0, BLOCK_V)  # (BLOCK_V,)
        col0 = split * span
        col1 = tl.minimum(col0 + span, V)
        for start in range(col0, col1, BLOCK_V):
            cols = start + offs
            mask = cols < col1
            z = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_SOFTCAP:
                t = tanh(z / softcap, USE_LIBDEVICE)
                s = softcap * t
            else:
                s = z
            if HAS_SCALE:
                s = s * logit_scale
            log_p = (s - m) - log_d
            p = tl.exp(log_p)
            # at the target, coef_p·p − coef_y = coef_y·(p − 1) + coef_extra·p with p − 1 = expm1(log p):
            # exact where p_y → 1 (a confident prediction), where p − 1 in fp32 keeps few digits
            grad = tl.where(cols == target_col, coef_y * expm1(log_p) + coef_extra * p, coef_p * p)
            if HAS_ENTROPY:
                grad -= g_entropy * p * (log_p + entropy)
            if HAS_WEIGHT:
                grad -= coef_w * tl.load(class_weight_ptr + col_base + cols, mask=mask, other=0.0)
            else:
                grad -= coef_w
            if HAS_SOFTCAP:
                grad *= 1.0 - t * t
            if HAS_SCALE:
                grad *= logit_scale
            # an ignored row's gradient is exactly 0 whatever its logits and statistics hold (a forward may
            # skip ignored rows, leaving their statistics undefined), where 0·p with p = NaN would not be
            grad = tl.where(is_valid, grad, 0.0)
            tl.store(row_ptr + cols, grad.to(logits_ptr.dtype.element_ty), mask=mask)


def gpu_split(C: int, V: int) -> int:
    """Slices per row on a GPU: enough programs (≥ ~8k) to keep a GPU's memory system busy, slices of
    at least 4096 columns. A power of two (the merge loads the partials as one vector)."""
    split = 1
    while split < 64 and C * split < 8192 and V // (split * 2) >= 4096:
        split *= 2
    return split


def _split_for(C: int, V: int) -> int:
    """`gpu_split`, except under the interpreter: 2 slices (1 for tiny rows) exercise the merge on CPU."""
    if interpreting():
        return 2 if V > 64 else 1
    return gpu_split(C, V)


def ce_rows(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    loss: torch.Tensor | None,
    stats: torch.Tensor,
    class_weight: torch.Tensor | None,
    class_weight_sum: torch.Tensor | None,
    grad: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float | None,
    compute_stats: bool,
    per_token_grad: bool = False,
    row_count: torch.Tensor | None = None,
    col_base: int = 0,
    vocab_total: int | None = None,
    entropy: torch.Tensor | None = None,
    grad_entropy: torch.Tensor | None = None,
    logit_scale: float = 1.0,
    logit_sum: torch.Tensor | None = None,
) -> None:
    """Per-row statistics and (optionally) the in-place logits gradient of a logits chunk.

    logits [C, V] (unit column stride) · target [C] · loss [C] fp32 (written when compute_stats) ·
    stats [2, C] fp32 = (row max m, log Σ exp(s − m)); lse = m + log Σ; written when compute_stats,
    else read · grad: None (no gradient), or fp32 upstream
    ∂L/∂ℓ: [C] when per_token_grad, else a [1] scalar shared by all tokens. When grad is given the
    logits are overwritten with ∂L/∂z. row_count: a one-element int tensor on the device, or None: rows
    at or past it are not read and their loss, stats and gradient are not written (the valid rows
    compacted to the front of a chunk, counted on the device: `compacted.py`).
    col_base, vocab_total: the chunk holds columns col_base … col_base + V − 1 of a vocabulary of
    vocab_total (one rank's shard, `fusedkern.distributed`); then `stats` must be the whole vocabulary's
    (compute_stats=False) and class_weight covers the whole vocabulary.
    entropy: None, or [C] fp32 per-token entropy of softmax(s) (0 where ignored): written when
    compute_stats, else read (the forward's). grad_entropy: with a per-token grad, [C] fp32 ∂L/∂H_t;
    the written gradient is then g_t·∂ℓ_t/∂z + grad_entropy_t·∂H_t/∂z. Whole vocabulary only.
    logit_scale: s = softcap(z)·logit_scale in fp32 (1/τ of a sampling temperature; 1.0 compiles it out).
    logit_sum: None, or [C] fp32 written with Σ_v s_v of each row (compute_stats; no class weights, ε = 0;
    the loss and statistics are the same with and without it).
    """
    C, V = logits.shape
    assert logits.stride(1) == 1 and C > 0
    vocab_total = V if vocab_total is None else vocab_total
    assert not compute_stats or (col_base == 0 and vocab_total == V), "a shard's statistics are partial"
    assert entropy is None or (col_base == 0 and vocab_total == V), "the entropy needs the whole vocabulary"
    assert grad_entropy is None or (entropy is not None and per_token_grad and grad is not None)
    assert logit_sum is None or (compute_stats and class_weight is None and label_smoothing == 0), \
        "the logits' sum is label smoothing's sum with ε = 0 and no class weights, from a statistics pass"
    split = _split_for(C, V)
    dummy = stats  # any fp32 tensor: never read when its flag is off
    span = _span(V, split)
    if compute_stats:
        parts = torch.empty((3 if entropy is None else 4, C, split), device=logits.device, dtype=torch.float32)
        # s_y for the loss, copied out by the statistics kernel (see the module docstring). Rows whose target
        # lies in no slice (ignored; out of range, which the host raises on) are left unwritten: their loss
        # is masked to 0 by `is_valid`, so no fill is needed.
        target_logit = torch.empty(C, device=logits.device, dtype=torch.float32)
        _launch_stats(logits, parts, split, span, col_base=0, target=target, target_logit=target_logit,
                      class_weight=class_weight, softcap=softcap, label_smoothing=label_smoothing,
                      row_count=row_count, logit_scale=logit_scale, sum_logits=logit_sum is not None)
    else:  # no loss: s_y is not needed
        parts = (dummy, dummy, dummy, dummy)
        target_logit = None
    write_grad = grad is not None
    _launch_finish(logits, target, target_logit, parts, (C, split if write_grad else 1), split, span, loss=loss,
                   stats=stats, class_weight=class_weight, class_weight_sum=class_weight_sum, grad=grad,
                   ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
                   compute_stats=compute_stats, per_token_grad=per_token_grad, row_count=row_count,
                   col_base=col_base, vocab_total=vocab_total, entropy=entropy, grad_entropy=grad_entropy,
                   logit_scale=logit_scale, logit_sum=logit_sum)


# ----------------------------------------------------------------------------------------------
# Vocabulary-sliced statistics (loss-only forward): the logits of C tokens arrive as tiles [C, Vs]
# of a few vocabulary columns at a time, so that each tile's GEMM stays compute-bound within 64 MiB.
# Each tile's stats kernel writes its SPLIT partials into its own slots of one [3, C, P] array and
# records the target's logit when the target falls in the tile; `merge_row_stats` then reduces the
# P partials of each row to lse and loss, exactly like the whole-row path.


def tile_partials(n_tokens: int, vocab: int, slice_cols: int, device: torch.device,
                  entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(parts [3, C, P] fp32 ([4, C, P] with the entropy's statistic), target_logit [C] fp32, split per tile)
    for `row_stats_tile` / `merge_row_stats`.

    P = the next power of two ≥ tiles·split (the merge loads a row's partials as one vector); the
    unused slots hold max = −inf, i.e. zero probability mass."""
    split = _split_for(n_tokens, slice_cols)
    n_tiles = triton.cdiv(vocab, slice_cols)
    P = triton.next_power_of_2(n_tiles * split)
    parts = torch.empty((4 if entropy else 3, n_tokens, P), device=device, dtype=torch.float32)
    parts[0].fill_(-float("inf"))
    parts[1:].zero_()
    return parts, torch.zeros(n_tokens, device=device, dtype=torch.float32), split


def row_stats_tile(tile: torch.Tensor, target: torch.Tensor, parts: torch.Tensor, target_logit: torch.Tensor, *,
                   tile_index: int, split: int, col_base: int, class_weight: torch.Tensor | None,
                   softcap: float | None, label_smoothing: float, logit_scale: float = 1.0,
                   sum_logits: bool = False) -> None:
    """Partial statistics of a logits tile [C, Vs] = vocabulary columns col_base … col_base + Vs − 1.

    Writes parts[:, :, k·split : (k+1)·split] for k = tile_index, and target_logit[t] for the rows
    whose target lies in the tile. sum_logits: parts[2] gets the tile's Σ s (`merge_row_stats`' logit_sum)."""
    C, Vs = tile.shape
    assert tile.stride(1) == 1 and C > 0 and parts.shape[1] == C
    slot = tile_index * split
    cw = None if class_weight is None else class_weight[col_base:col_base + Vs]
    view = parts[:, :, slot:slot + split]  # strided: row stride P, passed to the kernel as partial_stride
    _launch_stats(tile, view, split, _span(Vs, split), col_base=col_base, target=target, target_logit=target_logit,
                  class_weight=cw, softcap=softcap, label_smoothing=label_smoothing, partial_stride=parts.shape[2],
                  logit_scale=logit_scale, sum_logits=sum_logits)


def merge_row_stats(parts: torch.Tensor, target_logit: torch.Tensor, target: torch.Tensor, vocab: int, *,
                    loss: torch.Tensor, stats: torch.Tensor, class_weight: torch.Tensor | None,
                    class_weight_sum: torch.Tensor | None, ignore_index: int, label_smoothing: float, z_loss: float,
                    softcap: float | None, entropy: torch.Tensor | None = None, logit_scale: float = 1.0,
                    logit_sum: torch.Tensor | None = None) -> None:
    """lse, loss and stats [2, C] of every row (and its entropy [C] when given: then `parts` has the
    entropy's statistic) from the partials of all its tiles (`row_stats_tile`). logit_sum: [C] fp32 written with
    each row's Σ s, from tiles whose statistics were taken with sum_logits (ε = 0, no class weights)."""
    C, P = parts.shape[1], parts.shape[2]
    assert (entropy is not None) == (parts.shape[0] == 4)
    assert logit_sum is None or (class_weight is None and label_smoothing == 0)
    _launch_finish(None, target, target_logit, parts, (C, 1), P, _span(vocab, P), loss=loss, stats=stats,
                   class_weight=class_weight, class_weight_sum=class_weight_sum, grad=None, ignore_index=ignore_index,
                   label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap, compute_stats=True,
                   per_token_grad=False, vocab=vocab, entropy=entropy, logit_scale=logit_scale, logit_sum=logit_sum)


# ----------------------------------------------------------------------------------------------
# launchers


def _span(V: int, split: int) -> int:
    """Columns per slice; 64-aligned keeps loads 16-byte aligned."""
    return triton.cdiv(triton.cdiv(V, split), 64) * 64


def _launch_stats(logits, parts, split, span, *, col_base, target, target_logit, class_weight, softcap,
                  label_smoothing, partial_stride=None, row_count=None, logit_scale=1.0, sum_logits=False) -> None:
    """sum_logits: the Σ w·s partials (label smoothing's) hold Σ s, the logits' sum (no class weights)."""
    assert not (sum_logits and class_weight is not None)
    C, V = logits.shape
    dummy = parts[0]
    find_target = target is not None
    has_entropy = parts.shape[0] == 4  # the entropy's statistic has its own partials
    _row_stats_kernel[(C, split)](
        parts[0], parts[1], parts[2], parts[3] if has_entropy else dummy, logits,
        dummy if class_weight is None else class_weight,
        target if find_target else dummy, target_logit if find_target else dummy,
        dummy if row_count is None else row_count,
        V, logits.stride(0), span, split if partial_stride is None else partial_stride, col_base,
        float(softcap or 1.0), float(logit_scale),
        SPLIT=split, HAS_WEIGHT=class_weight is not None, HAS_SMOOTHING=label_smoothing > 0 or sum_logits,
        HAS_SOFTCAP=softcap is not None, FIND_TARGET=find_target, HAS_ROW_COUNT=row_count is not None,
        HAS_ENTROPY=has_entropy, HAS_SCALE=logit_scale != 1.0, USE_LIBDEVICE=not interpreting())


def _launch_finish(logits, target, target_logit, parts, grid, split, span, *, loss, stats, class_weight,
                   class_weight_sum, grad, ignore_index, label_smoothing, z_loss, softcap, compute_stats,
                   per_token_grad, vocab=None, row_count=None, col_base=0, vocab_total=None, entropy=None,
                   grad_entropy=None, logit_scale=1.0, logit_sum=None) -> None:
    """logits: the [C, V] chunk, or None when merging tile partials (then `vocab` gives V).
    target_logit: s_y per row from the statistics kernel, needed when the loss is computed (never read
    from the logits: see `ce_rows`); None otherwise. entropy / grad_entropy: see `ce_rows`; with
    compute_stats, parts[3] holds the entropy's partials. logit_sum: [C] fp32 out, the merged parts[2] (Σ s)."""
    dummy = stats  # any fp32 tensor: never read when its flag is off
    write_grad = grad is not None
    has_entropy = entropy is not None
    assert target_logit is not None or not compute_stats
    assert not (has_entropy and compute_stats) or len(parts) == 4
    assert not (has_entropy and write_grad) or grad_entropy is not None
    assert logit_sum is None or compute_stats
    _row_finish_kernel[grid](
        dummy if logits is None else logits, loss if loss is not None else dummy, stats[0], stats[1], parts[0], parts[1],
        parts[2], parts[3] if has_entropy and compute_stats else dummy, entropy if has_entropy else dummy,
        grad_entropy if grad_entropy is not None else dummy, dummy if logit_sum is None else logit_sum, target,
        dummy if target_logit is None else target_logit, dummy if class_weight is None else class_weight,
        class_weight_sum if class_weight_sum is not None else dummy, grad if write_grad else dummy,
        dummy if row_count is None else row_count,
        vocab if logits is None else logits.shape[1], 0 if logits is None else logits.stride(0), span,
        col_base, (vocab if logits is None else logits.shape[1]) if vocab_total is None else vocab_total,
        ignore_index, float(label_smoothing), float(z_loss), float(softcap or 1.0), float(logit_scale),
        SPLIT=split, HAS_WEIGHT=class_weight is not None, HAS_SOFTCAP=softcap is not None,
        COMPUTE_STATS=compute_stats, WRITE_GRAD=write_grad, PER_TOKEN_GRAD=per_token_grad,
        HAS_ROW_COUNT=row_count is not None, HAS_ENTROPY=has_entropy, HAS_SCALE=logit_scale != 1.0,
        SUM_LOGITS=logit_sum is not None, USE_LIBDEVICE=not interpreting())
