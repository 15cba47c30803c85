"""The logits GEMM with its row statistics in the epilogue: a loss without writing the logits.

    logits_stats_rows(x, w, b, target, count, parts, target_logit, ...)
        for the first n = clamp(count, 0, C) rows of x [C, H] and every column tile j of Z = x wᵀ (+ b):
        parts[0, t, j] = max_v s_tv, parts[1, t, j] = Σ_v exp(s_tv − max) − 1 ("rest": the max's own 1
        left out), parts[2, t, j] = Σ_v w_v·s_tv (label smoothing), with parts of 4 rows also
        parts[3, t, j] = Σ_v exp(s_tv − max)·(s_tv − max) (the entropy's), over the tile's columns v, and
        target_logit[t] = s_{t, y_t} from the tile that holds the target;  s = softcap(z)·scale

`ce_rows.merge_row_stats` then reduces each row's partials to its lse and loss, exactly as it merges the
vocabulary-sliced tiles of the loss-only pass. The chunked strategy's loss-only pass writes each [C, Vs]
logits tile to memory and reads it back for its statistics: 2·T·V·2 bytes (17 GB at T = 32768,
V = 128256, ~4 ms on the H200 against one GEMM's ~49 ms). Here the tile never leaves registers: what is
left beside the GEMM is the epilogue's T·V exponentials (one per logit, as the statistics pass does) and
3·P·4 bytes of partials per row. The statistics see the fp32 accumulator, not logits rounded to the
inputs' dtype, so the loss is also more exact than the tile pass's.

Every autotune candidate of one operand width has the same BLOCK_N (`TILE_N`): a partial slot is one
column tile, so a config of another width would fill another set of slots. The autotuner runs every
candidate on the real `parts` before the winner's run; with mixed widths (as once: 128 and 256), a
256-wide winner left the slots 501–1001 that a 128-wide candidate had written, and `merge_row_stats` added
that stale mass to the row — +log 1.5 ≈ 0.41 nat on the rows of every chunk that autotuned (the GPU test's
failure, softcap or not, when a 256-wide config won). With one width every candidate writes the same
slots and overwrites them entirely, so tuning on the real buffers is harmless.

Trade-off: the epilogue's exponentials and row reductions run between tiles (the tile loop is not warp
specialized), so they add to the GEMM's time instead of hiding behind it: ~16 384 exponentials per
128 × 128 tile at 16 per clock per SM against ~32 000 clocks of its main loop (docs/design.md).
`chunked.chunked_loss(stats_in_epilogue=True)` is opt-in (docs/design.md: the rule and the measurements).

Inputs: x [C, H] and w [V, H] fp32/fp16/bf16 (same dtype), b [V] or None, target [C] int64 (ignored rows:
any value outside [0, V)), count one-element int32/int64 on x's device, parts [3, C, P] fp32 with
P ≥ `column_tiles(V)` (pre-filled by `stats_partials`: unused slots hold max = −inf, no mass),
target_logit [C] fp32. Rows ≥ n are not written. parts [4, C, P] adds the entropy's statistic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedkern._runtime import autotune_configs, interpreting
from fusedkern.kernels.device_math import softcapped
from fusedkern.kernels.dot import dot_precision
from fusedkern.kernels.gemm_tiles import (check_count, launch_persistent, linear_tile, operand,
                                          use_tma, valid_rows)

__all__ = ["logits_stats_rows", "stats_partials", "column_tiles", "tile_n"]


def _cfg(bm: int, bn: int, bk: int, warps: int, stages: int, group: int = 8) -> triton.Config:
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group}, num_warps=warps,
                         num_stages=stages)


# No output tile is staged in shared memory, so the operand pipeline has it all. The epilogue holds a few
# (BLOCK_M, BLOCK_N) fp32 temporaries beside the accumulator: on sm_90, 128 × 128 with 8 warps keeps them in
# registers (16 bytes of spill with every option at once, the entropy included); 128 × 256 spills 56–664
# bytes a thread, and 4 warps more (scripts/compile_sm90.py). One BLOCK_N per list (module docstring).
_CONFIGS = [_cfg(128, 128, 64, 8, 4), _cfg(128, 128, 64, 8, 5), _cfg(64, 128, 64, 4, 4), _cfg(128, 128, 64, 8, 3)]
_FP32_CONFIGS = [_cfg(64, 64, 32, 4, 3), _cfg(128, 64, 32, 8, 2)]  # ieee fp32 dots run on the FMA units
# the interpreter runs one small config: the tiny test shapes span several tiles and masked tails
_INTERP_CONFIG = _cfg(16, 32, 16, 4, 1, group=2)


def _config_list(fp32: bool) -> list:
    return autotune_configs([_INTERP_CONFIG] if interpreting() else (_FP32_CONFIGS if fp32 else _CONFIGS))


def tile_n(dtype: torch.dtype = torch.bfloat16) -> int:
    """The column tile (BLOCK_N) of every candidate for this operand dtype: one partial slot per tile."""
    widths = {c.kwargs["BLOCK_N"] for c in _config_list(dtype == torch.float32)}
    if len(widths) != 1:  # mixed widths leave stale slots behind the autotuner's trial runs
        raise RuntimeError(f"the statistics epilogue's candidates must share one BLOCK_N, got {sorted(widths)}")
    return widths.pop()


def column_tiles(vocab: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Partial slots a row needs: its column tiles of `tile_n(dtype)` columns."""
    return triton.cdiv(vocab, tile_n(dtype))


def stats_partials(n_tokens: int, vocab: int, device: torch.device, dtype: torch.dtype = torch.bfloat16,
                   entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(parts [3, C, P] fp32 ([4, C, P] with the entropy's statistic), target_logit [C] fp32) for
    `logits_stats_rows` and `ce_rows.merge_row_stats`: P = the next power of two ≥ `column_tiles` (the merge
    loads a row's partials as one vector); every slot starts as (max −inf, 0, 0[, 0]): no mass, so slots no
    tile writes change nothing."""
    P = triton.next_power_of_2(column_tiles(vocab, dtype))
    parts = torch.empty((4 if entropy else 3, n_tokens, P), device=device, dtype=torch.float32)
    parts[0].fill_(-float("inf"))
    parts[1:].zero_()
    return parts, torch.zeros(n_tokens, device=device, dtype=torch.float32)


@triton.jit
def _logits_stats_kernel(
    x_ptr,  # (C, H) input dtype
    w_ptr,  # (V, H)
    b_ptr,  # (V,) bias (HAS_BIAS)
    target_ptr,  # (C,) int64 class indices; outside [0, V) for ignored rows
    class_weight_ptr,  # (V,) fp32 (HAS_WEIGHT: weights the smoothing sum)
    part_ptr,  # (3 or 4, C, P) fp32 out: max, rest, Σ w·s (and the entropy's A) of (row, column tile)
    target_logit_ptr,  # (C,) fp32 out: s of the target column
    count_ptr,  # (1,) int32/int64 valid rows
    C, V, H,
    stride_xc, stride_xh, stride_wv, stride_wh, stride_b, stride_pk, stride_pc,
    softcap, logit_scale,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, HAS_ENTROPY: tl.constexpr, USE_LIBDEVICE: tl.constexpr, USE_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    n = valid_rows(count_ptr, C)
    num_pid_m = tl.cdiv(n, BLOCK_M)
    num_pid_n = tl.cdiv(V, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    # token extent n: the TMA unit zero-fills rows ≥ n; max(n, 1): a descriptor's extents must be positive
    x = operand(x_ptr, tl.maximum(n, 1), H, stride_xc, BLOCK_M, BLOCK_K, USE_TMA)
    w = operand(w_ptr, V, H, stride_wv, BLOCK_N, BLOCK_K, USE_TMA)
    cols = tl.arange(0, BLOCK_N)
    for tile_id in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=USE_TMA):
        off_m, off_n, offs_m, offs_n, mask_m, mask_n, z = linear_tile(
            x, w, b_ptr, tile_id, num_pid_m, num_pid_n, n, V, H, stride_xc, stride_xh, stride_wv, stride_wh, stride_b,
            HAS_BIAS, USE_TMA, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
        s = softcapped(z, softcap, logit_scale, HAS_SOFTCAP, HAS_SCALE, USE_LIBDEVICE)  # (BLOCK_M, BLOCK_N)
        # the tile's (max, rest) as `ce_rows` keeps them: rest = Σ exp(s − max) − 1 leaves the max's own
        # exp(0) = 1 out, so that a dominant class does not drown the others' mass in fp32. Columns equal
        # to the max contribute exactly 1 each: summed as a count (ties − 1) instead of an argmax
        s_m = tl.where(mask_n[None, :], s, -float("inf"))
        tile_max = tl.max(s_m, axis=1)  # (BLOCK_M,)
        is_max = s_m == tile_max[:, None]
        # all −inf (a −inf bias masking padded vocabulary): exponents against 0, no −inf − (−inf) = NaN,
        # and no mass at all
        empty = tile_max == -float("inf")
        shifted = s_m - tl.where(empty, 0.0, tile_max)[:, None]  # s − max, −inf on masked columns
        e = tl.exp(shifted)
        ties = tl.sum(is_max.to(tl.float32), axis=1)
        rest = tl.sum(tl.where(is_max, 0.0, e), axis=1) + tl.where(empty, 0.0, ties - 1.0)
        out = part_ptr + offs_m.to(tl.int64) * stride_pc + off_n // BLOCK_N  # (BLOCK_M,) slot of this tile
        tl.store(out, tile_max, mask=mask_m)
        tl.store(out + stride_pk, rest, mask=mask_m)
        if HAS_ENTROPY:  # A = Σ exp(s − max)·(s − max): the max's own term is 0, a masked one 0·(−inf) → 0
            tl.store(out + 3 * stride_pk, tl.sum(tl.where(e == 0.0, 0.0, e * shifted), axis=1), mask=mask_m)
        if HAS_SMOOTHING:
            if HAS_WEIGHT:
                s_w = s * tl.load(class_weight_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
            else:
                s_w = s
            tl.store(out + 2 * stride_pk, tl.sum(tl.where(mask_n[None, :], s_w, 0.0), axis=1), mask=mask_m)
        # the target's logit, from the one tile that holds its column (compared as a local column index:
        # a (BLOCK_M, BLOCK_N) broadcast of the targets would stay live across the main loop)
        y_col = tl.load(target_ptr + offs_m, mask=mask_m, other=-1) - off_n  # (BLOCK_M,)
        holds = mask_m & (y_col >= 0) & (y_col < BLOCK_N) & (y_col < V - off_n)
        s_y = tl.sum(tl.where(cols[None, :] == y_col[:, None], s, 0.0), axis=1)
        tl.store(target_logit_ptr + offs_m, s_y, mask=holds)


_AUTOTUNE_KEY = ["C", "V", "H", "HAS_BIAS", "HAS_SOFTCAP", "HAS_SMOOTHING", "HAS_ENTROPY", "USE_TMA"]
_TUNED = {fp32: triton.autotune(configs=_config_list(fp32), key=_AUTOTUNE_KEY)(_logits_stats_kernel)
          for fp32 in (False, True)}

def logits_stats_rows(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, target: torch.Tensor,
                      count: torch.Tensor, parts: torch.Tensor, target_logit: torch.Tensor, *,
                      class_weight: torch.Tensor | None = None, softcap: float | None = None,
                      label_smoothing: float = 0.0, logit_scale: float = 1.0, impl: str = "auto",
                      config: triton.Config | None = None) -> None:
    """Row statistics of Z[:n] = x[:n] wᵀ (+ b) per column tile, into parts and target_logit (module
    docstring). impl: 'auto' (TMA on sm_90+ for aligned 16-bit operands), 'tma' or 'pointer'
    (`gemm_tiles.use_tma`); config: a `triton.Config` to run instead of autotuning, with BLOCK_N =
    `tile_n(x.dtype)` (the slots `merge_row_stats` reads are that wide)."""
    for name, t in (("x", x), ("w", w)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"{name} must be a 2-D tensor")
    C, H = x.shape
    V = w.shape[0]
    dev = x.device
    if w.shape[1] != H or w.dtype != x.dtype or w.device != dev:
        raise ValueError(f"w must be [V, {H}] in x's dtype on {dev}, got {tuple(w.shape)} {w.dtype} on {w.device}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"x must be fp32, fp16 or bf16, got {x.dtype}")
    P = parts.shape[2] if parts.dim() == 3 else 0
    if (parts.dim() != 3 or parts.shape[0] not in (3, 4) or parts.shape[1] != C or parts.dtype != torch.float32
            or parts.device != dev or not parts.is_contiguous() or P < column_tiles(V, x.dtype)):
        raise ValueError(f"parts must be a contiguous fp32 [3 or 4, {C}, P] tensor on {dev} with P ≥ "
                         f"{column_tiles(V, x.dtype)} (stats_partials), got {tuple(parts.shape)}")
    if target.shape != (C,) or target_logit.shape != (C,) or target_logit.dtype != torch.float32:
        raise ValueError(f"target [{C}] and target_logit [{C}] fp32 expected")
    if class_weight is not None and (class_weight.shape != (V,) or class_weight.dtype != torch.float32
                                     or not class_weight.is_contiguous() or class_weight.device != dev):
        raise ValueError(f"class_weight must be a contiguous fp32 [{V}] tensor on {dev}, got "
                         f"{tuple(class_weight.shape)} {class_weight.dtype}")
    if config is not None and config.kwargs.get("BLOCK_N") != tile_n(x.dtype):
        raise ValueError(f"config must have BLOCK_N = tile_n({x.dtype}) = {tile_n(x.dtype)} (one partial slot per "
                         f"column tile), got {config.kwargs.get('BLOCK_N')}")
    count = check_count(count, dev)
    if C == 0 or V == 0:
        return
    tma = use_tma(impl, (x, w), ())
    smoothing = label_smoothing > 0.0
    cw = class_weight if (class_weight is not None and smoothing) else None
    args = (x, w, b if b is not None else x, target, cw if cw is not None else parts, parts, target_logit,
            count, C, V, H, x.stride(0), x.stride(1), w.stride(0), w.stride(1),
            b.stride(0) if b is not None else 0, parts.stride(0), parts.stride(1), float(softcap or 1.0),
            float(logit_scale))
    flags = dict(HAS_BIAS=b is not None, HAS_SOFTCAP=softcap is not None, HAS_SCALE=logit_scale != 1.0,
                 HAS_SMOOTHING=smoothing, HAS_WEIGHT=cw is not None, HAS_ENTROPY=parts.shape[0] == 4,
                 USE_LIBDEVICE=not interpreting(), USE_TMA=tma, DOT_PRECISION=dot_precision(x.dtype))
    launch_persistent(_TUNED[x.dtype == torch.float32], C, V, dev, args, flags, config)
