"""Gluon (Triton 3.6's `triton.experimental.gluon`, Hopper sm_90a): the LM-head logits GEMM X[T, H]·W[V, H]ᵀ (bf16,
fp32 accumulation) whose epilogue reduces each 128 × 256 tile to per-row partial statistics in `ce_rows`' format
(tile max, Σ exp(s − max) − 1, the target's logit), so the loss-only pass never writes the [T, V] logits.

Design: the cooperative kernel of `probes/gluon_logits_stats.py`. Persistent grid in grouped tile
order; a one-warp TMA producer fills a 4-stage shared-memory ring (mbarriers ready / empty); two consumer warpgroups
split each 128 × 256 tile by rows (64 × 256 accumulators, async wgmma from shared memory) and reduce it in registers.
Trade-off: cuBLAS's tile shape and L2 feed, but the epilogue is not hidden behind the other warpgroup's main loop
(only the producer keeps prefetching through it); Gluon 3.6 has no TMA multicast across a 2-CTA cluster. Its speed
against cuBLAS and against the tile pass: docs/design.md ("The logits GEMM in Gluon") and docs/results.md.

`loss_only` (the `gluon` strategy of `fusedkern/dispatch.py`: every statistics-only pass under impl="auto" that it
supports, cross-entropy and log-probs at a temperature with the entropy, with or without a backward to follow) merges
the partials
with `ce_rows.merge_row_stats`, the tile pass's own merge, so its loss and statistics mean exactly what the tile
pass's do. This module
imports Gluon at import time: import it only where `is_supported` can hold (the dispatch imports it lazily, on
CUDA tensors).
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from fusedkern._runtime import interpreting, sm_count
from fusedkern.chunk_plan import LOSS_CHUNK_BUDGET_BYTES
from fusedkern.kernels.ce_rows import merge_row_stats

LOG2E = gl.constexpr(1.4426950408889634)
# the probe's "128x256x64s4coop": the tile two consumer warpgroups share, K step, ring depth (4 × 48 KiB of sm_90's
# 227 KiB of shared memory per block)
BLOCK_M, BLOCK_N, BLOCK_K, STAGES = 128, 256, 64, 4
#: tile rows per group of the grouped order (docs/design.md: the choice between 16 and 8)
GROUP_M = 16
# registers: 3 warpgroups (the producer's warp padded to 4) start at 168 (3 × 168 × 128 = 64.5K); setmaxnreg then
# gives the producer 40 and each consumer 232 (accumulator 128 + the epilogue's temporaries): 0 spills on sm_90a
MAXNREG, CONSUMER_REGS, PRODUCER_REGS, NUM_WARPS = 168, 232, 40, 4
#: the Triton this kernel was written and compiled for (Gluon's API moves between releases)
TRITON_TESTED = "3.6."
#: partial slots per row: max, rest, and the label-smoothing sum `merge_row_stats` reads (0 here), fp32; the
#: entropy's statistic adds one
PART_BYTES, ENTROPY_PART_BYTES = 3 * 4, 4


# --------------------------------------------------------------------------------------------------- kernel


@gluon.jit
def tile_coords(t, num_m, num_n, GROUP_M: gl.constexpr):
    """Grouped order: GROUP_M row tiles per group, row index fastest inside the group."""
    per_group = GROUP_M * num_n
    group = t // per_group
    first_m = group * GROUP_M
    size_m = gl.minimum(num_m - first_m, GROUP_M)
    inner = t % per_group
    return first_m + inner % size_m, inner // size_m


@gluon.constexpr_function
def accumulator_layout(block_n):
    """The register layout of one consumer warpgroup's async-wgmma accumulator [64 · k, block_n] (4 warps stacked
    on rows, m64nNk16 instructions)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, block_n, 16])


@gluon.jit
def operand_ring(x_desc, w_desc, STAGES: gl.constexpr, EMPTY_ARRIVALS: gl.constexpr):
    """The producer-consumer ring in shared memory: STAGES X and W boxes (the descriptors' block shapes and layouts)
    and their mbarriers, `ready` (the producer's TMA arrival) and `empty` (EMPTY_ARRIVALS consumer releases free a
    slot). The caller fences after its own barriers' inits."""
    a_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    b_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=EMPTY_ARRIVALS)
    return a_bufs, b_bufs, ready, empty


@gluon.jit
def tma_producer(x_desc, w_desc, a_bufs, b_bufs, ready, empty, num_m, num_n, k_tiles,
              GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    nbytes: gl.constexpr = x_desc.block_type.nbytes + w_desc.block_type.nbytes
    pid = gl.program_id(0)
    grid = gl.num_programs(0)
    count = 0
    for t in range(pid, num_m * num_n, grid):
        pid_m, pid_n = tile_coords(t, num_m, num_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        for k in range(k_tiles):
            slot = count % STAGES
            phase = (count // STAGES) & 1
            # a fresh mbarrier counts as having completed the phase before phase 0: the first lap passes
            mbarrier.wait(empty.index(slot), phase ^ 1)
            mbarrier.expect(ready.index(slot), nbytes)
            tma.async_copy_global_to_shared(x_desc, [off_m, k * BLOCK_K], ready.index(slot), a_bufs.index(slot))
            tma.async_copy_global_to_shared(w_desc, [off_n, k * BLOCK_K], ready.index(slot), b_bufs.index(slot))
            count += 1


@gluon.jit
def cooperative_mainloop(a_bufs, b_bufs, ready, empty, base, k_tiles, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                         STAGES: gl.constexpr, CONSUMER: gl.constexpr, acc=None, K_FIRST: gl.constexpr = 0):
    """One consumer's fp32 accumulator [BLOCK_M, BLOCK_N] of a tile: rows [CONSUMER·BLOCK_M, (CONSUMER+1)·BLOCK_M) of
    each X slot against the whole W slot over k_tiles K blocks from ring position `base` (the producer's count). Per
    block: wait for the slot, async wgmma from shared memory (W permuted to K-major [BK, BN]), one wgmma group in
    flight; the previous one is done, so its slot goes back to the producer (2 arrivals free it). With K_FIRST > 0
    the caller has issued blocks 0 … K_FIRST − 1 into `acc` itself, freed every slot but the last one's, and left
    that block's group in flight."""
    if acc is None:
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, accumulator_layout(BLOCK_N))
    if K_FIRST == 0:
        prev = 0
    else:
        prev = (base + K_FIRST - 1) % STAGES
    for k in range(K_FIRST, k_tiles):
        count = base + k
        slot = count % STAGES
        mbarrier.wait(ready.index(slot), (count // STAGES) & 1)
        a = a_bufs.index(slot).slice(CONSUMER * BLOCK_M, BLOCK_M)
        b = b_bufs.index(slot)
        acc = warpgroup_mma(a, b.permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a, b))[0]
        mbarrier.arrive(empty.index(prev), pred=k > 0)
        prev = slot
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    mbarrier.arrive(empty.index(prev))
    return acc


@gluon.jit
def _consumer(x_desc, w_desc, a_bufs, b_bufs, ready, empty, part_max_ptr, part_rest_ptr, part_ent_ptr, target_ptr,
              target_logit_ptr, T, V, partial_stride, logit_scale, num_m, num_n, k_tiles,
              GROUP_M: gl.constexpr, STAGES: gl.constexpr, HAS_ENTROPY: gl.constexpr, CONSUMER: gl.constexpr):
    """Consumer CONSUMER (0 or 1) of every tile of this CTA: rows [CONSUMER·BM/2, (CONSUMER+1)·BM/2) of the X slot
    (a shared-memory row slice) against the whole W slot, then the epilogue of those rows on s = logit_scale·acc."""
    TILE_M: gl.constexpr = x_desc.block_type.shape[0]  # rows the producer loads per tile
    BLOCK_M: gl.constexpr = TILE_M // 2  # this warpgroup's rows
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    acc_layout: gl.constexpr = accumulator_layout(BLOCK_N)
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
    pid = gl.program_id(0)
    grid = gl.num_programs(0)
    i = 0  # the CTA-local index of the tile
    for t in range(pid, num_m * num_n, grid):
        pid_m, pid_n = tile_coords(t, num_m, num_n, GROUP_M)
        off_m = pid_m * TILE_M + CONSUMER * BLOCK_M
        off_n = pid_n * BLOCK_N
        # 1. main loop
        acc = cooperative_mainloop(a_bufs, b_bufs, ready, empty, i * k_tiles, k_tiles, BLOCK_M, BLOCK_N, STAGES,
                                   CONSUMER)
        i += 1

        # 2. the target's logit, from the accumulator registers, by the one tile that holds its column (rows past
        # T, ignored and out-of-range targets match no column: nothing is stored for them)
        rows = off_m + gl.arange(0, BLOCK_M, layout=row_layout)  # (BLOCK_M,)
        row_ok = rows < T
        local_col = gl.arange(0, BLOCK_N, layout=col_layout)  # (BLOCK_N,)
        target = gl.load(target_ptr + rows, mask=row_ok, other=-1)
        local_target = gl.where((target >= off_n) & (target < off_n + BLOCK_N), target - off_n, -1).to(gl.int32)
        match = gl.expand_dims(local_col, 0) == gl.expand_dims(local_target, 1)  # (BLOCK_M, BLOCK_N)
        picked = gl.sum(gl.where(match, acc, 0.0), axis=1)
        gl.store(target_logit_ptr + rows, picked * logit_scale, mask=row_ok & (local_target >= 0))
        # 3. the tile's max and rest = Σ exp(s − max) − 1 (`ce_rows._merge_mass`'s format: the max's own 1 is never
        # added, so log Σ = log1p(rest) keeps its digits when one class dominates); ties with the max count exactly.
        # Columns past V (the ragged last tile; TMA zero-filled W there) carry no mass. The scale (1/τ > 0) keeps
        # the max where it is, so it multiplies per-row values only: s − max(s) = scale·(acc − max(acc)), and at
        # scale 1 every value is bitwise the unscaled pass's.
        col_ok = gl.expand_dims(local_col < V - off_n, 0)  # (1, BLOCK_N)
        acc = gl.where(col_ok, acc, float("-inf"))
        tile_max = gl.max(acc, axis=1)
        is_max = acc == gl.expand_dims(tile_max, 1)
        shifted = acc - gl.expand_dims(tile_max, 1)  # ≤ 0; −inf past V
        mass = gl.exp2(shifted * (logit_scale * LOG2E))
        tile_rest = gl.sum(gl.where(is_max, 0.0, mass), axis=1) + (gl.sum(is_max.to(gl.float32), axis=1) - 1.0)
        # int64: rows · partial_stride passes 2³¹ for a big chunk at a big vocabulary
        part = rows.to(gl.int64) * partial_stride + pid_n
        gl.store(part_max_ptr + part, tile_max * logit_scale, mask=row_ok)
        gl.store(part_rest_ptr + part, tile_rest, mask=row_ok)
        if HAS_ENTROPY:
            # the entropy's statistic in `ce_rows._merge_entropy`'s format, A = Σ exp(s − max)·(s − max); past V
            # mass·shifted is 0·(−inf): left out
            tile_ent = gl.sum(gl.where(col_ok, mass * shifted, 0.0), axis=1) * logit_scale
            gl.store(part_ent_ptr + part, tile_ent, mask=row_ok)


@gluon.jit
def _consumer_worker(x_desc, w_desc, a_bufs, b_bufs, ready, empty, part_max_ptr, part_rest_ptr, part_ent_ptr,
                     target_ptr, target_logit_ptr, T, V, partial_stride, logit_scale, num_m, num_n, k_tiles,
                     GROUP_M: gl.constexpr, STAGES: gl.constexpr, HAS_ENTROPY: gl.constexpr):
    _consumer(x_desc, w_desc, a_bufs, b_bufs, ready, empty, part_max_ptr, part_rest_ptr, part_ent_ptr, target_ptr,
              target_logit_ptr, T, V, partial_stride, logit_scale, num_m, num_n, k_tiles, GROUP_M, STAGES,
              HAS_ENTROPY, 1)


# Compiled once whatever the token count (as `gluon_anchored_exp`'s kernel): T is a bound and a mask, and a launch's
# targets and target logits are slices at its first row, read and written one element a row.
@gluon.jit(do_not_specialize=["T"], do_not_specialize_on_alignment=["target_ptr", "target_logit_ptr"])
def _logits_partials_kernel(
    x_desc, w_desc,  # TMA descriptors: X [T, H] in [BLOCK_M, BLOCK_K] boxes, W [V, H] in [BLOCK_N, BLOCK_K]
    part_max_ptr, part_rest_ptr,  # (T, partial_stride) fp32 out: slot pid_n of each row = column tile pid_n
    part_ent_ptr,  # (T, partial_stride) fp32 out: the entropy's statistic (HAS_ENTROPY)
    target_ptr,  # (T,) int32/int64 class indices
    target_logit_ptr,  # (T,) fp32 out: the target's logit s, where the target is a column in [0, V)
    T, V, H, partial_stride,  # shapes; partials per row (≥ the column tiles)
    logit_scale,  # fp32: s = logit_scale·(X·Wᵀ), 1/τ of a sampling temperature (1.0: the logits themselves)
    GROUP_M: gl.constexpr, STAGES: gl.constexpr, HAS_ENTROPY: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
):
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    a_bufs, b_bufs, ready, empty = operand_ring(x_desc, w_desc, STAGES, 2)  # both consumers release a slot
    fence_async_shared()

    num_m = gl.cdiv(T, BLOCK_M)
    num_n = gl.cdiv(V, BLOCK_N)
    k_tiles = gl.cdiv(H, BLOCK_K)
    gl.warp_specialize([
        (_consumer, (x_desc, w_desc, a_bufs, b_bufs, ready, empty, part_max_ptr, part_rest_ptr, part_ent_ptr,
                     target_ptr, target_logit_ptr, T, V, partial_stride, logit_scale, num_m, num_n, k_tiles, GROUP_M,
                     STAGES, HAS_ENTROPY, 0)),
        (_consumer_worker, (x_desc, w_desc, a_bufs, b_bufs, ready, empty, part_max_ptr, part_rest_ptr, part_ent_ptr,
                            target_ptr, target_logit_ptr, T, V, partial_stride, logit_scale, num_m, num_n, k_tiles,
                            GROUP_M, STAGES, HAS_ENTROPY)),
        (tma_producer, (x_desc, w_desc, a_bufs, b_bufs, ready, empty, num_m, num_n, k_tiles, GROUP_M, STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ---------------------------------------------------------------------------------------------------- host


@functools.cache
def shared_layouts():
    """The NVMMA shared-memory layouts of the X and W boxes (bf16, 128-byte swizzle at BLOCK_K = 64)."""
    return (gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.bfloat16),
            gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], gl.bfloat16))


@functools.lru_cache(maxsize=None)
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def device_reason(device: torch.device) -> str | None:
    """Why this kernel cannot run on `device` (None when it can): a CUDA device of compute capability 9.0 (the
    wgmma / setmaxnreg / TMA code is sm_90a's), compiled rather than interpreted, with the Triton it was tested on."""
    if device.type != "cuda":
        return f"needs a CUDA device, not {device.type}"
    if interpreting():
        return "Triton's interpreter cannot run Gluon kernels"
    if not triton.__version__.startswith(TRITON_TESTED):
        return f"written and measured with Triton {TRITON_TESTED}x, not {triton.__version__}"
    index = device.index if device.index is not None else torch.cuda.current_device()
    if _capability(index) != (9, 0):
        return f"needs compute capability 9.0 (sm_90a), not {_capability(index)}"
    return None


def unsupported_reason(x2d: torch.Tensor, w: torch.Tensor) -> str | None:
    """Why `loss_only` cannot take these operands (None when it can): bf16 X [T, H] and W [V, H], contiguous,
    16-byte aligned (TMA), H a multiple of BLOCK_K = 64 (the K loop is checked only there; ragged T and V are
    handled: TMA zero-fills and the epilogue masks), on one supported device (`device_reason`). fp16 would need
    its own GPU check, so it is refused."""
    if x2d.dim() != 2 or w.dim() != 2 or x2d.shape[1] != w.shape[1]:
        return "needs X [T, H] and W [V, H]"
    if x2d.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        return f"needs bf16 operands, not {x2d.dtype} and {w.dtype}"
    (T, H), V = x2d.shape, w.shape[0]
    if T == 0 or V == 0 or H % BLOCK_K:
        return f"needs T, V > 0 and H a multiple of {BLOCK_K}, not T={T}, V={V}, H={H}"
    if max(T, V) >= 2**31:
        return "T and V are 32-bit TMA coordinates"
    if not (x2d.is_contiguous() and w.is_contiguous()):
        return "needs contiguous X and W"
    if x2d.data_ptr() % 16 or w.data_ptr() % 16:
        return "TMA needs 16-byte aligned X and W"
    if w.device != x2d.device:
        return "X and W on different devices"
    return device_reason(x2d.device)


def is_supported(x2d: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `loss_only` can take these operands (see `unsupported_reason`)."""
    return unsupported_reason(x2d, w) is None


def partial_slots(vocab: int) -> int:
    """Partials per row: the column tiles, rounded up to a power of two (`merge_row_stats` loads a row's partials
    as one vector; the unused slots carry no mass)."""
    return triton.next_power_of_2(triton.cdiv(vocab, BLOCK_N))


def tokens_per_launch(n_tokens: int, vocab: int, chunk_tokens: int | None = None, *, with_entropy: bool = False) -> int:
    """Tokens per launch: the partials of one launch within the loss-only pass's 64 MiB (8192 tokens at
    V = 128256: 512 slots × 12 bytes a token, 16 with the entropy's), at most `chunk_tokens` when given, balanced
    over the launches."""
    bytes_per_slot = PART_BYTES + (ENTROPY_PART_BYTES if with_entropy else 0)
    most = max(BLOCK_M, LOSS_CHUNK_BUDGET_BYTES // (partial_slots(vocab) * bytes_per_slot) // BLOCK_M * BLOCK_M)
    if chunk_tokens:
        most = min(most, chunk_tokens)
    launches = triton.cdiv(n_tokens, most)
    return triton.cdiv(n_tokens, launches)


def empty_partials(n_tokens: int, vocab: int, device: torch.device, *, with_entropy: bool = False) -> torch.Tensor:
    """parts [3, C, P] fp32 (with_entropy: [4, C, P]) for `launch_partials` / `merge_row_stats`: the kernel writes
    parts[0] (max), parts[1] (rest) and parts[3] (the entropy's statistic) in the first ⌈V / BLOCK_N⌉ slots of every
    row; the others hold no mass (max −inf, rest 0, entropy 0), and parts[2] (Σ w·s of label smoothing, not
    computed here) is 0."""
    P, n_tiles = partial_slots(vocab), triton.cdiv(vocab, BLOCK_N)
    parts = torch.empty((4 if with_entropy else 3, n_tokens, P), device=device, dtype=torch.float32)
    parts[0, :, n_tiles:].fill_(float("-inf"))
    parts[1:, :, n_tiles:].zero_()
    parts[2].zero_()
    return parts


def launch_partials(x2d: torch.Tensor, w: torch.Tensor, target: torch.Tensor, parts: torch.Tensor,
                    target_logit: torch.Tensor, *, logit_scale: float = 1.0, group_m: int = GROUP_M,
                    max_ctas: int = 0) -> None:
    """One launch over s = logit_scale·X·Wᵀ (fp32): parts[0][t, j], parts[1][t, j] = the max and Σ exp(s − max) − 1
    of row t's column tile j, for t < T and j < ⌈V / BLOCK_N⌉, and when parts has 4 planes parts[3][t, j] =
    Σ exp(s − max)·(s − max) (the entropy's); target_logit[t] = s[t, target[t]] where 0 ≤ target[t] < V (left alone
    elsewhere). parts: [3 or 4, T, P] fp32, rows contiguous (`empty_partials`); max_ctas caps the grid."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    (T, H), V = x2d.shape, w.shape[0]
    assert parts.dtype == torch.float32 and parts.shape[0] in (3, 4) and parts.shape[1] == T and parts.stride(2) == 1
    assert parts.shape[2] >= triton.cdiv(V, BLOCK_N) and target.shape == (T, ) and target.is_contiguous()
    assert logit_scale > 0, "a positive scale keeps each row's max where it is"
    has_entropy = parts.shape[0] == 4
    a_layout, b_layout = shared_layouts()
    x_desc = TensorDescriptor.from_tensor(x2d, [BLOCK_M, BLOCK_K], a_layout)
    w_desc = TensorDescriptor.from_tensor(w, [BLOCK_N, BLOCK_K], b_layout)
    tiles = triton.cdiv(T, BLOCK_M) * triton.cdiv(V, BLOCK_N)
    grid = (min(max_ctas if max_ctas > 0 else sm_count(x2d.device), tiles), )
    _logits_partials_kernel[grid](
        x_desc, w_desc, parts[0], parts[1], parts[3] if has_entropy else parts[0], target, target_logit, T, V, H,
        parts.stride(1), float(logit_scale),
        GROUP_M=group_m, STAGES=STAGES, HAS_ENTROPY=has_entropy, CONSUMER_REGS=CONSUMER_REGS,
        PRODUCER_REGS=PRODUCER_REGS, num_warps=NUM_WARPS, maxnreg=MAXNREG)


def loss_only(x2d: torch.Tensor, w: torch.Tensor, target: torch.Tensor, ignore_index: int,
              chunk_tokens: int | None = None, *, logit_scale: float = 1.0, entropy: torch.Tensor | None = None,
              group_m: int = GROUP_M) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunked.chunked_loss` without bias, class weights, label smoothing, z-loss or softcap, on this kernel:
    x2d [T, H] · w [V, H] bf16 · target [T] → (loss_tok [T] fp32 = −log softmax(s)[target], 0 where ignored;
    stats [2, T] fp32 = (max, log Σ exp(s − max)) of s = logit_scale·X·Wᵀ, `chunked.lse_of`). entropy: a [T] fp32
    buffer that receives each row's entropy of softmax(s) (0 where ignored), as `chunked_loss`'s. Launches of
    `tokens_per_launch` tokens, each merged by the tile pass's `merge_row_stats`. Caller: `unsupported_reason(x2d, w)`
    is None."""
    (T, _), V = x2d.shape, w.shape[0]
    with_entropy = entropy is not None
    loss_tok = torch.empty(T, device=x2d.device, dtype=torch.float32)
    stats = torch.empty((2, T), device=x2d.device, dtype=torch.float32)
    C = tokens_per_launch(T, V, chunk_tokens, with_entropy=with_entropy)
    parts = empty_partials(C, V, x2d.device, with_entropy=with_entropy)
    target_logit = torch.empty(C, device=x2d.device, dtype=torch.float32)
    for c0 in range(0, T, C):
        c1 = min(c0 + C, T)
        part_c, target_logit_c = parts[:, : c1 - c0], target_logit[: c1 - c0]
        target_logit_c.zero_()  # as the tile pass: a row whose target matches no column merges a 0 (it raises later)
        launch_partials(x2d[c0:c1], w, target[c0:c1], part_c, target_logit_c, logit_scale=logit_scale,
                        group_m=group_m)
        merge_row_stats(part_c, target_logit_c, target[c0:c1], V, loss=loss_tok[c0:c1], stats=stats[:, c0:c1],
                        class_weight=None, class_weight_sum=None, ignore_index=ignore_index, label_smoothing=0.0,
                        z_loss=0.0, softcap=None, entropy=entropy[c0:c1] if with_entropy else None,
                        logit_scale=logit_scale)
    return loss_tok, stats
