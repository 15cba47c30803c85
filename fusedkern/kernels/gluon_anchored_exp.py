"""Gluon (Triton 3.6, Hopper sm_90a): the LM-head logits GEMM whose epilogue writes *anchored exponentials*.

Each row t comes with an anchor a_t, known before the GEMM: a_t = log2(e)·s_t,y + A2 in log2 units, where s = k·X·Wᵀ
(k = 1/τ) and s_t,y is the target's logit (a gather-dot, `kernels/anchored_rows.py`). The epilogue of each 128 × 256
tile computes, from the fp32 accumulator,

    arg = min(log2(e)·s − a_t, CLAMP2)          e = 2^arg          (fp32)

and writes (EPILOGUE = SUMS_AND_E) E = bf16(e) into a [C, V] buffer through shared memory and TMA, plus one fp32 partial
per (row, column tile): Σ e (plane 0), with ENTROPY Σ e·arg (plane 1), and with ROW_MAX the tile's max of the
accumulator x·w_v over its columns below V (the last plane: the row max TRL's is_top1 reads, taken before the anchor
is subtracted so that it keeps the logits' own fp32 rounding). Rows whose anchor is IGNORED (a huge value) get e = 0:
zero rows of E and zero sums.

Why an anchor: bf16 has fp32's exponent range, so exp(s − s_y) / 2^A2 never needs a per-tile offset (QuACK's scheme)
as long as the row's log-sum-exp stays under s_y + (A2 + CLAMP2)·ln 2 (about 86 nats): no max is reduced, no offset is
stored and dX / dW read E through cuBLAS with no operand transform. Rows past that (a clamped element makes
Σ e ≥ 2^CLAMP2, so the test is exact) are detected after the GEMM and recomputed exactly (`fusedkern/anchored.py`).
Elements more than (126 − A2)·ln 2 − (lse − s_y) nats below the row's log-sum-exp flush to 0 (ex2.approx.ftz): below
e^-43 of the row's mass.

The pipeline, the persistent grouped tile order, the TMA producer and the cooperative split of each 128 × 256 tile
between two consumer warpgroups are `gluon_logits_stats`' (whose epilogue reduces a tile max instead). Trade-off: the
epilogue is not overlapped with the tensor cores (a cooperative kernel); its cost is one FFMA, one min, one MUFU ex2,
one add (and the bf16 pack and shared-memory store) per element, against ~15 instructions for the max-based
statistics. EPILOGUE = NONE keeps only a row sum of the accumulator under a predicate that is never true (the main
loop's own time, for the probe). Measured: docs/design.md ("Anchored exponentials").
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, tma

from fusedkern._runtime import sm_count
from fusedkern.kernels.anchored_rows import (  # noqa: F401  (the producer's constants, named here for its callers)
    A2,
    CLAMP2,
    IGNORED,
    LOG2E,
    NONE,
    SUMS,
    SUMS_AND_E,
    TILE_N,
    column_tiles,
    e_row_stride,
    entropy_plane,
)
from fusedkern.kernels.gluon_logits_stats import (
    BLOCK_K,
    BLOCK_M,
    BLOCK_N,
    GROUP_M,
    MAXNREG,
    NUM_WARPS,
    PRODUCER_REGS,
    accumulator_layout,
    cooperative_mainloop,
    device_reason,
    operand_ring,
    shared_layouts,
    tile_coords,
    tma_producer,
)

#: ring stages: 4 × 48 KiB without E; with E the four [64, 128] bf16 staging boxes (64 KiB) leave room for 3
STAGES_SUMS, STAGES_E = 4, 3
#: E's TMA box: one consumer's rows, half the tile's columns (the accumulator's column halves split for free)
E_BOX = (BLOCK_M // 2, BLOCK_N // 2)
CONSUMER_REGS = 232
#: fp32 partial planes: Σ e, and Σ e·arg with the entropy (the row max's plane comes after: `part_planes`)
PLANES_SUMS, PLANES_ENTROPY = 1, 2

assert TILE_N == BLOCK_N, "the row kernels merge one partial per column tile of this kernel"
_CLAMP2 = gl.constexpr(CLAMP2)
_IGNORED = gl.constexpr(IGNORED)
_NEG_INF = gl.constexpr(float("-inf"))


@gluon.jit
def _exp2_ftz(x):
    """2^x on the MUFU, denormal results flushed to 0 (one instruction; gl.exp2's non-ftz form adds a fix-up)."""
    return gl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True,
                                     pack=1)


@gluon.jit
def _consumer(x_desc, w_desc, e_desc, a_bufs, b_bufs, c_bufs, ready, empty, anchor_ptr, part_ptr, T, V,
              part_stride, plane_stride, scale2, num_m, num_n, k_tiles, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
              EPILOGUE: gl.constexpr, ENTROPY: gl.constexpr, ROW_MAX: gl.constexpr, CONSUMER: gl.constexpr):
    """Consumer CONSUMER (0 or 1): rows [CONSUMER·BM/2, (CONSUMER+1)·BM/2) of each of the CTA's tiles, main loop then
    the anchored epilogue of those rows."""
    TILE_M: gl.constexpr = x_desc.block_type.shape[0]
    ROWS: gl.constexpr = TILE_M // 2
    BN: gl.constexpr = w_desc.block_type.shape[0]
    HALF: gl.constexpr = BN // 2
    acc_layout: gl.constexpr = accumulator_layout(BN)
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
    MAX_PLANE: gl.constexpr = 2 if ENTROPY else 1
    pid = gl.program_id(0)
    grid = gl.num_programs(0)
    i = 0
    for t in range(pid, num_m * num_n, grid):
        pid_m, pid_n = tile_coords(t, num_m, num_n, GROUP_M)
        off_m = pid_m * TILE_M + CONSUMER * ROWS
        off_n = pid_n * BN
        acc = cooperative_mainloop(a_bufs, b_bufs, ready, empty, i * k_tiles, k_tiles, ROWS, BN, STAGES, CONSUMER)
        i += 1

        rows = off_m + gl.arange(0, ROWS, layout=row_layout)
        row_ok = rows < T
        part = rows.to(gl.int64) * part_stride + pid_n
        if EPILOGUE == 0:
            # nothing but a row sum whose store never happens (T ≥ 0): the accumulator stays live
            gl.store(part_ptr + part, gl.sum(acc, axis=1), mask=row_ok & (T < 0))
        else:
            if ROW_MAX:
                # before arg: the accumulator and arg both live would not fit the consumer's registers (they spill)
                if off_n + BN > V:  # the ragged last column tile's columns past V: an accumulator of 0, not a logit
                    col_ok = gl.arange(0, BN, layout=col_layout) < V - off_n
                    tile_max = gl.max(gl.where(gl.expand_dims(col_ok, 0), acc, _NEG_INF), axis=1)
                else:
                    tile_max = gl.max(acc, axis=1)
                gl.store(part_ptr + MAX_PLANE * plane_stride + part, tile_max, mask=row_ok)
            anchor = gl.load(anchor_ptr + rows, mask=row_ok, other=_IGNORED)
            arg = gl.minimum(acc * scale2 - gl.expand_dims(anchor, 1), _CLAMP2)
            if off_n + BN > V:  # the ragged last column tile: TMA zero-filled W there, those columns carry nothing
                col_ok = gl.arange(0, BN, layout=col_layout) < V - off_n
                arg = gl.where(gl.expand_dims(col_ok, 0), arg, -_IGNORED)
            e = _exp2_ftz(arg)
            gl.store(part_ptr + part, gl.sum(e, axis=1), mask=row_ok)
            if ENTROPY:
                gl.store(part_ptr + plane_stride + part, gl.sum(e * arg, axis=1), mask=row_ok)
            if EPILOGUE == 2:
                # two column halves through this consumer's two staging boxes (the split is a register split)
                lo, hi = e.reshape(ROWS, 2, HALF).permute(0, 2, 1).split()
                c_lo = c_bufs.index(2 * CONSUMER)
                c_hi = c_bufs.index(2 * CONSUMER + 1)
                tma.store_wait(pendings=0)  # this consumer's previous tile has left the boxes
                c_lo.store(lo.to(gl.bfloat16))
                c_hi.store(hi.to(gl.bfloat16))
                fence_async_shared()
                tma.async_copy_shared_to_global(e_desc, [off_m, off_n], c_lo)
                if off_n + HALF < V:  # the ragged last tile's right half may lie wholly past V: no empty box
                    tma.async_copy_shared_to_global(e_desc, [off_m, off_n + HALF], c_hi)
    if EPILOGUE == 2:
        tma.store_wait(pendings=0)


@gluon.jit
def _consumer_worker(x_desc, w_desc, e_desc, a_bufs, b_bufs, c_bufs, ready, empty, anchor_ptr, part_ptr, T, V,
                     part_stride, plane_stride, scale2, num_m, num_n, k_tiles, GROUP_M: gl.constexpr,
                     STAGES: gl.constexpr, EPILOGUE: gl.constexpr, ENTROPY: gl.constexpr, ROW_MAX: gl.constexpr):
    _consumer(x_desc, w_desc, e_desc, a_bufs, b_bufs, c_bufs, ready, empty, anchor_ptr, part_ptr, T, V, part_stride,
              plane_stride, scale2, num_m, num_n, k_tiles, GROUP_M, STAGES, EPILOGUE, ENTROPY, ROW_MAX, 1)


# Compiled once whatever the token count: T is a bound and a mask, the plane stride (T·P or C·P) a per-row scalar
# store's offset, and the anchors a slice at the chunk's first row; Triton's specialization on their divisibility by 16
# would compile a variant per residue of T, in the steps of a loop whose micro-batches vary in length.
@gluon.jit(do_not_specialize=["T", "plane_stride"], do_not_specialize_on_alignment=["anchor_ptr"])
def _anchored_exp_kernel(
    x_desc, w_desc,  # TMA descriptors: X [T, H] in [BLOCK_M, BLOCK_K] boxes, W [V, H] in [BLOCK_N, BLOCK_K]
    e_desc,  # TMA descriptor of E [T, V] bf16 (row stride a multiple of 8) in E_BOX boxes (EPILOGUE 2)
    anchor_ptr,  # (T,) fp32: a_t, log2 units (IGNORED for a row without target)
    part_ptr,  # (planes, T, part_stride) fp32 out: slot pid_n of row t = column tile pid_n
    T, V, H, part_stride, plane_stride,
    scale2,  # fp32: log2(e)·k, k = 1/τ
    GROUP_M: gl.constexpr, STAGES: gl.constexpr, EPILOGUE: gl.constexpr, ENTROPY: gl.constexpr,
    ROW_MAX: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
):
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    a_bufs, b_bufs, ready, empty = operand_ring(x_desc, w_desc, STAGES, 2)
    if EPILOGUE == 2:
        c_bufs = gl.allocate_shared_memory(e_desc.dtype, [4] + e_desc.block_type.shape, e_desc.layout)
    else:  # never used: a token allocation keeps one signature
        c_bufs = gl.allocate_shared_memory(e_desc.dtype, [1, 8, 64], e_desc.layout)
    fence_async_shared()
    num_m = gl.cdiv(T, BM)
    num_n = gl.cdiv(V, BN)
    k_tiles = gl.cdiv(H, BK)
    gl.warp_specialize([
        (_consumer, (x_desc, w_desc, e_desc, a_bufs, b_bufs, c_bufs, ready, empty, anchor_ptr, part_ptr, T, V,
                     part_stride, plane_stride, scale2, num_m, num_n, k_tiles, GROUP_M, STAGES, EPILOGUE, ENTROPY,
                     ROW_MAX, 0)),
        (_consumer_worker, (x_desc, w_desc, e_desc, a_bufs, b_bufs, c_bufs, ready, empty, anchor_ptr, part_ptr, T,
                            V, part_stride, plane_stride, scale2, num_m, num_n, k_tiles, GROUP_M, STAGES, EPILOGUE,
                            ENTROPY, ROW_MAX)),
        (tma_producer, (x_desc, w_desc, a_bufs, b_bufs, ready, empty, num_m, num_n, k_tiles, GROUP_M, STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ---------------------------------------------------------------------------------------------------- host


@functools.cache
def e_layout():
    """The NVMMA shared-memory layout of E's [64, 128] bf16 staging box."""
    return gl.NVMMASharedLayout.get_default_for(list(E_BOX), gl.bfloat16)


def stages_for(epilogue: int) -> int:
    return STAGES_E if epilogue == SUMS_AND_E else STAGES_SUMS


def unsupported_reason(x2d: torch.Tensor, w: torch.Tensor) -> str | None:
    """Why the producer cannot take these operands (None when it can): `gluon_logits_stats.unsupported_reason`'s
    conditions (bf16, contiguous, aligned, H a multiple of 64, an sm_90 device with Triton 3.6)."""
    from fusedkern.kernels.gluon_logits_stats import unsupported_reason as stats_reason

    return stats_reason(x2d, w)


def launch(x2d: torch.Tensor, w: torch.Tensor, anchor: torch.Tensor, parts: torch.Tensor, e: torch.Tensor | None, *,
           logit_scale: float = 1.0, epilogue: int = SUMS_AND_E, group_m: int = GROUP_M, max_ctas: int = 0,
           row_max: bool = False) -> None:
    """One launch over the C rows of x2d: parts[0][t, j] = Σ_{v in tile j} e[t, v], with the entropy's plane
    parts[1][t, j] = Σ e·arg, with row_max parts[-1][t, j] = max_{v in tile j} x_t·w_v (fp32, unscaled);
    e[t, v] = 2^min(log2(e)·k·(x_t·w_v) − anchor[t], CLAMP2) written to `e` ([C, V] bf16 view of a buffer whose row
    stride is `e_row_stride(V)`) when epilogue == SUMS_AND_E. parts: [`part_planes(entropy=, row_max=)`, C, P] fp32
    (the plane count says whether the entropy's is there), P ≥ `column_tiles(V)`, rows contiguous. Caller:
    `unsupported_reason(x2d, w)` is None."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    (T, H), V = x2d.shape, w.shape[0]
    entropy = entropy_plane(parts, row_max)
    assert parts.dtype == torch.float32 and parts.shape[1] == T
    assert parts.stride(2) == 1 and parts.shape[2] >= column_tiles(V)
    assert anchor.shape == (T, ) and anchor.dtype == torch.float32 and anchor.is_contiguous()
    assert logit_scale > 0
    a_layout, b_layout = shared_layouts()
    x_desc = TensorDescriptor.from_tensor(x2d, [BLOCK_M, BLOCK_K], a_layout)
    w_desc = TensorDescriptor.from_tensor(w, [BLOCK_N, BLOCK_K], b_layout)
    if epilogue == SUMS_AND_E:
        assert e is not None and e.shape == (T, V) and e.dtype == torch.bfloat16 and e.stride(1) == 1
        assert e.stride(0) % 8 == 0 and e.data_ptr() % 16 == 0
        e_desc = TensorDescriptor(e, list(e.shape), list(e.stride()), list(E_BOX), e_layout())
    else:  # a box-sized stand-in keeps the kernel's signature
        e_desc = TensorDescriptor.from_tensor(torch.empty(E_BOX, device=x2d.device, dtype=torch.bfloat16),
                                              list(E_BOX), e_layout())
    tiles = triton.cdiv(T, BLOCK_M) * column_tiles(V)
    grid = (min(max_ctas if max_ctas > 0 else sm_count(x2d.device), tiles), )
    _anchored_exp_kernel[grid](
        x_desc, w_desc, e_desc, anchor, parts, T, V, H, parts.stride(1), parts.stride(0), float(logit_scale) * LOG2E,
        GROUP_M=group_m, STAGES=stages_for(epilogue), EPILOGUE=epilogue, ENTROPY=entropy, ROW_MAX=bool(row_max),
        CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, num_warps=NUM_WARPS, maxnreg=MAXNREG)


def is_supported(x2d: torch.Tensor, w: torch.Tensor) -> bool:
    return unsupported_reason(x2d, w) is None


__all__ = ["A2", "CLAMP2", "IGNORED", "LOG2E", "NONE", "SUMS", "SUMS_AND_E", "column_tiles", "device_reason",
           "e_row_stride", "is_supported", "launch", "unsupported_reason"]
