"""Gluon probe (issue 31 item 5, "the moonshot", first kernel): the LM-head GEMM with a row-statistics epilogue.

What it computes
    logits[T, V] = X[T, H] @ W[V, H]^T   (bf16 in, fp32 accumulation), and for every row r and column tile j
    (BLOCK_N wide) the tile's max m[r, j] and s[r, j] = sum_c exp(logit[r, c] - m[r, j]) into fp32 partial
    buffers [T, n_col_tiles]; the row's target logit (int64 targets, -100 ignored) into target_logit[T] by the
    one tile that holds the target column. `reduce_partials` folds the partials into logsumexp per row.
    WRITE_LOGITS=True also stores the bf16 logits tile (TMA store), so the kernel is "cuBLAS's GEMM + epilogue".
    Ragged edges: TMA zero-fills out-of-bounds rows/columns of X and W on load and clips the logits store;
    the epilogue masks columns >= V to -inf and rows >= T out of the stores. (V = 128256 happens to be
    501 * 256, so the study shape is not ragged in V at BLOCK_N in {128, 256}; the small test shape V = 5000 is.)

Design (explicit Hopper: TMA, mbarriers, async wgmma, warp specialization)
    Persistent grid: min(#SMs, #tiles) CTAs; CTA p takes tiles p, p+G, p+2G, ... of a grouped order (GROUP_M
    row tiles per group, the row index fastest inside a group: an X panel of GROUP_M*BLOCK_M rows and a W panel
    of ~G/GROUP_M column tiles stay hot in the 50 MB L2).  Partitions (gl.warp_specialize):
      * producer: 1 warp (40 regs) walks the CTA's tiles and K blocks and issues TMA loads of X[BM, BK] and
        W[BN, BK] into a STAGES-deep shared ring; `ready[s]` (expect-tx) / `empty[s]` mbarriers per slot.
      * two consumer warpgroups (default partition = consumer 0, a 4-warp worker = consumer 1), in one of two
        modes (constexpr COOP):
        - ping-pong (c2): the CTA's i-th tile belongs to consumer i % 2.  The ring is one FIFO, so tile i+1's
          loads start once tile i's are issued: consumer 1's main loop starts while consumer 0 finishes its last
          K blocks and runs while consumer 0 does its epilogue, and vice versa (CUTLASS's "Pingpong").  The main
          loops take turns through two `order` mbarriers (CUTLASS's math_wg_order_barrier): consumer c starts
          tile i once the other consumer has passed all ready-waits of tile i-1 (see PING-PONG FIX below).
        - cooperative (coop): both consumers work on every tile, consumer c on rows [c*BM/2, (c+1)*BM/2) of the
          X slot (a shared-memory row slice) against the whole W slot; `empty[s]` counts 2 arrivals.
        Main loop (both modes): wait ready[s], async wgmma from shared memory (B = W tile permuted to K-major
        [BK, BN]), keep one wgmma group in flight (warpgroup_mma_wait(1)), release the previous slot (arrive).
      * epilogue (in each consumer): target pick from the accumulator registers (NVMMA v3 layout), optional bf16
        tile (two column halves through shared memory, TMA stores, store_wait before reuse), then the masked
        row max and exp2-based sum, masked stores of the partials.
    Trade-off.  A consumer's accumulator is at most 128 fp32 regs/thread (128x128 or 64x256; 128x256 would need
    256).  Ping-pong hides the epilogue (per 128x128 tile ~2-3K clks of exp/reduce/stores vs ~33K clks of MMA)
    behind the other warpgroup's MMAs, but each CTA tile is only 128x128: it moves (BM+BN)*BK*2 B from L2 per
    2*BM*BN*BK flop, 0.0156 B/flop, i.e. 12.4 TB/s of L2->SM traffic at cuBLAS's 795 TFLOP/s.  Cooperative
    128x256 needs 0.0117 B/flop (9.3 TB/s; what cuBLAS's own 128x256 tile needs without multicast) and uses the
    m64n256k16 wgmma (fewest shared-memory operand reads per flop), but its epilogue (~3-4% of a tile) stalls
    the tensor cores; only the producer keeps prefetching the next tile during it.  The GPU run decides.

Configs (BMxBNxBK, stages, mode; H100: 227 KiB shared memory per block, 64K regs/SM); `--compile` output:
    Registers: 3 warpgroups (the producer's warp padded to 4): maxnreg 168 at launch (3 x 168 x 128 = 64.5K),
    then setmaxnreg: producer 40, both consumers 232 (accumulator 128 + epilogue temporaries; 240/24 spills
    the producer).  Stages are capped to what fits next to the logits buffers (2 per consumer: the tile is
    stored in two column halves, so only half of it is held in bf16 at once - storing it whole spilled).
    "128x256x64s4coop" (first) 4 x 48 KiB stages (3 with logits); smem 196824 / 213232 B; 0 spills.
    "128x128x64s6c2"   ping-pong, 6 x 32 KiB (5 with logits); smem 196888 / 229688 B; 0 spills.
    "128x128x64s6c1"   one consumer (maxnreg 136 -> 232/40), the fallback without a second warpgroup;
                       smem 196820 / 229588 B; 0 spills.
    "64x256x64s6c2"    (optional) ping-pong with m64n256 wgmma; 5 (4) x 40 KiB; smem 205080 / 229656 B; 0 spills.
    A trailing "gN" sets GROUP_M (default 16), e.g. "128x256x64s4coopg8": same kernel, other tile order.
    Stats / logits variants: regs = the launch cap (168, 136 for c1); stack 0; ptxas spill stores/loads 0.

GPU OUTCOME 2026-12-06 (H100, data/measured/h100/gluon_logits_stats.log; p50 ratio to cuBLAS torch.mm)
    coop 128x256x64s4coop: correct (T=300 and the study shape); stats 0.997x at T=4096, 1.035x at T=8192
    (logits 1.020x / 1.051x).  c1 128x128x64s6c1: correct; 1.42-1.48x.  c2 128x128x64s6c2: correct at T=300,
    then "CUDA error: unspecified launch failure" at T=4096 V=128256, which killed the process.
    Next: the 8192 gap may be L2 (GROUP_M=16 x 128 rows = a 16 MiB X panel): try coop g8 and g4 at 8192.

PING-PONG FIX (found by reading the code; not yet run on a GPU)
    The ring's waits are parity waits: mbarrier.wait(ready[s], p) passes as soon as the barrier's completed-phase
    count has parity != p, so it also passes when the waiter is an ODD number of fills ahead of the slot.  c2's
    consumers skip the other consumer's K blocks (base = i * k_tiles, correct), which puts consumer 1's first
    waits STAGES+ fills ahead: study shape, k_tiles = 64, STAGES 6 -> consumer 1's first K block is ring count
    64 = slot 4, fill 10, parity 0, and that wait passed on fill 0 (count 4, consumer 0's data).  Consumer 1 then
    ran on wrong/unlanded slots and released them (empty[s] counts 1 arrival: it freed slots consumer 0 was
    still reading), so the producer overran the ring; the phases desynchronize for good (double arrivals on
    ready/empty, TMA writes into slots being read, consumers exiting with TMA loads still in flight into the
    CTA's shared memory - the likely source of the launch failure; the desync itself is certain, the exact
    fault is not).  Consumer 0 had the same hazard from its second tile on.  At T=300 (120 tiles, 120 CTAs)
    consumer 1 never ran, so the check passed.  Fix: consumer c waits order[c] before tile i's main loop and
    arrives on order[1-c] after its last ready-wait of the tile, so no ready-wait runs ahead of its slot.  A
    Python model of the protocol (random interleavings) fails in every run with k_tiles >= STAGES without the
    turns and in none with them.

CORRECTNESS CHECK (--bench; each config in a child process so a context-killing fault costs only that config)
    T=300 H=512 V=5000 (ragged in T and V) at the full grid, the same with the grid capped to CHECK_CTAS = 7
    (each CTA owns 17-18 tiles of 128x128 / 8-9 of 128x256, both ping-pong consumers take 8-9 each, every ring
    slot's phase wraps 16-27 times, odd and even tile counts per CTA), then T=4096 H=4096 V=128256; each with and
    without the logits store, NaN-poisoned outputs, 30 s hang deadline per launch.

PREDICTION (written before any GPU run)
    FLOPs = 2*T*H*V = 4.30e12 at T = 4096 (8.61e12 at 8192).  Bytes (compulsory): W 1.05 GB + X 33.6 MB
    (+ logits 1.05 GB bf16 when written; partials 2 x 4 B x T x n_col_tiles = 16-33 MB).  Roofline at 989
    TFLOP/s: 4.35 ms (T=4096), 8.70 ms (T=8192); memory (2.1 GB at 3.35 TB/s = 0.63 ms) is far below, so it
    is compute bound.  cuBLAS measured 5.41 ms (795 TFLOP/s, 80% of peak) at T=4096.
    Expected p50 time ratio to cuBLAS:
      coop 128x256, stats only   1.05x (1.00-1.10): cuBLAS-like L2 feed, plus the ~3-4% epilogue stall and a
                                 named barrier + mbarrier round trip per K block per warpgroup.
      coop 128x256, with logits  1.07x: 3 stages instead of 4, +1.05 GB of TMA stores (overlapped).
      ping-pong 128x128          1.08x (1.00-1.15): epilogue hidden, but L2-feed bound if H100's L2 gives
                                 less than ~12 TB/s to the SMs; logits +1-2%.
      one consumer               1.12-1.20x.
    Same ratios at T=8192 (X no longer fits L2; GROUP_M=16 keeps a 16 MB X panel hot).  So the 1.02x goal is
    not the expected outcome of this first kernel; it needs the epilogue overlapped AND a 128x256 CTA tile
    (e.g. cooperative with the accumulator handed to a separate epilogue warpgroup through shared memory, or
    2-CTA clusters with TMA multicast, which Gluon 3.6's Hopper TMA copy does not expose).

Usage
    TRITON_INTERPRET=0 python probes/gluon_logits_stats.py --compile [--configs 128x128x64s6c2,...]
    NEXT GPU RUN (priority order: coop g16, coop g8, c2 fixed, c1; coop g4 last, cheap; ~2-3 min in all):
    TRITON_INTERPRET=0 python3 probes/gluon_logits_stats.py --bench --tokens 4096,8192 \
        --configs 128x256x64s4coop,128x256x64s4coopg8,128x128x64s6c2,128x128x64s6c1,128x256x64s4coopg4 \
        --out $OUT/gluon_logits_stats.csv
    --bench: (1) the correctness checks above per config; (2) timing of cuBLAS and the configs that passed,
    --reps (25) shuffled rounds, beside the two loss-only passes: fusedkern's (`fusedkern_loss_only`, the tile
    pass under no_grad) and each config's kernel + the merge of its partials into the mean loss (`_loss`; its
    loss is printed beside fusedkern's).  --max-ctas N caps the persistent grid (timing and full-grid checks; default
    #SMs); --check-only runs only the checks in-process; --no-isolate checks in the bench process.
    A check child that hangs exits 3 with "HANG" (a pipeline deadlock); the config is then left out.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "0"  # GPU compile (--compile on CPU too), never the interpreter

import triton  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # fusedkern, without an install
# the grouped tile order and the TMA producer are the library's (fusedkern/kernels/gluon_logits_stats.py holds the
# cooperative kernel alone); ping-pong, one consumer and the logits store stay here
from fusedkern.kernels.gluon_logits_stats import (accumulator_layout, operand_ring, tile_coords,  # noqa: E402
                                                   tma_producer)

LOG2E = gl.constexpr(1.4426950408889634)
SMEM_LIMIT = 232448  # sm_90: 227 KiB of dynamic shared memory per block
#: priority order of the next GPU run: cooperative at GROUP_M 16 and 8, ping-pong (fixed), one consumer
DEFAULT_CONFIGS = "128x256x64s4coop,128x256x64s4coopg8,128x128x64s6c2,128x128x64s6c1"
DEVICE = "cuda"
#: (T, H, V, grid cap) of --bench's correctness checks; cap 0 = the launch's own grid (#SMs or --max-ctas).
#: The small ragged shape has 120 (c1/c2) or 60 (coop) tiles: at the full grid every CTA owns one tile, so
#: ping-pong's consumer 1 never runs and no ring phase wraps; with 7 CTAs each CTA owns 17-18 (8-9) tiles
#: (odd and even counts), both ping-pong consumers take 8-9 tiles each, and with 8 K blocks per tile every
#: ring slot's phase wraps 16-27 times.  The study shape (64 K blocks per tile) is checked last.
CHECK_CTAS = 7
CHECK_SHAPES = ((300, 512, 5000, 0), (300, 512, 5000, CHECK_CTAS), (4096, 4096, 128256, 0))


# --------------------------------------------------------------------------------------------------- kernel


@gluon.jit
def _consumer(x_desc, w_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty, order,
              part_max_ptr, part_sum_ptr, target_ptr, target_logit_ptr, T, V, n_col_tiles, num_m, num_n, k_tiles,
              GROUP_M: gl.constexpr, STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr, CONSUMER: gl.constexpr,
              WRITE_LOGITS: gl.constexpr, COOP: gl.constexpr):
    # COOP=0 (ping-pong): consumers alternate whole tiles.  COOP=1 (cooperative): every tile is split by rows
    # between the consumers, which share the W tile in shared memory (less L2 traffic, no epilogue overlap).
    TILE_M: gl.constexpr = x_desc.block_type.shape[0]  # rows the producer loads per tile
    BLOCK_M: gl.constexpr = TILE_M // (1 + (NUM_CONSUMERS - 1) * COOP)  # this warpgroup's rows
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    FIRST: gl.constexpr = CONSUMER * (1 - COOP)  # the CTA-local index of this consumer's first tile
    STEP: gl.constexpr = NUM_CONSUMERS - (NUM_CONSUMERS - 1) * COOP
    PINGPONG: gl.constexpr = (NUM_CONSUMERS == 2) and (COOP == 0)
    acc_layout: gl.constexpr = accumulator_layout(BLOCK_N)
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
    pid = gl.program_id(0)
    grid = gl.num_programs(0)
    i = FIRST  # the CTA-local index of this consumer's tile
    for t in range(pid + FIRST * grid, num_m * num_n, STEP * grid):
        pid_m, pid_n = tile_coords(t, num_m, num_n, GROUP_M)
        off_m = pid_m * TILE_M + CONSUMER * BLOCK_M * COOP
        off_n = pid_n * BLOCK_N
        base = i * k_tiles  # ring position of this tile's first K block (the producer's count)
        if PINGPONG:
            # The ring's waits are parity waits: wait(ready[s], p) passes as soon as the barrier's current
            # phase parity differs from p, so a waiter must never be an odd number of fills AHEAD of the slot
            # (it would pass on an older fill: the other consumer's K block, or a fill not yet landed).
            # Skipping the other consumer's k_tiles K blocks puts this consumer's first STAGES waits exactly
            # there unless the other consumer has already waited on all of its previous tile's K blocks.
            # So the main loops take turns (CUTLASS Pingpong's math_wg_order_barrier): consumer c starts its
            # n-th tile once the other consumer arrived on order[c] after its previous tile's K loop.
            # Consumer 0's first tile passes at once (a fresh barrier has completed the phase before 0).
            mbarrier.wait(order.index(CONSUMER), ((i // 2) & 1) ^ (1 - CONSUMER))
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
        prev = 0
        for k in range(k_tiles):
            count = base + k
            slot = count % STAGES
            mbarrier.wait(ready.index(slot), (count // STAGES) & 1)
            a = a_bufs.index(slot)
            if COOP:
                a = a.slice(CONSUMER * BLOCK_M, BLOCK_M)
            b = b_bufs.index(slot)
            acc = warpgroup_mma(a, b.permute((1, 0)), acc, is_async=True)
            # keep this wgmma in flight; the previous one is done, so its slot goes back to the producer
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a, b))[0]
            mbarrier.arrive(empty.index(prev), pred=k > 0)
            prev = slot
        if PINGPONG:  # all of this tile's ready waits are done: the other consumer's main loop may start
            mbarrier.arrive(order.index(1 - CONSUMER))
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty.index(prev))
        i += STEP

        # epilogue, ordered so that at most the accumulator and one tile-sized temporary are live
        rows = off_m + gl.arange(0, BLOCK_M, layout=row_layout)
        row_ok = rows < T
        local_col = gl.arange(0, BLOCK_N, layout=col_layout)
        target = gl.load(target_ptr + rows, mask=row_ok, other=-1)
        local_target = gl.where((target >= off_n) & (target < off_n + BLOCK_N), target - off_n, -1).to(gl.int32)
        match = gl.expand_dims(local_col, 0) == gl.expand_dims(local_target, 1)
        picked = gl.sum(gl.where(match, acc, 0.0), axis=1)
        gl.store(target_logit_ptr + rows, picked, mask=row_ok & (local_target >= 0))
        if WRITE_LOGITS:
            # two column halves (the N bit 6 of the accumulator is a register bit: the split is free), so
            # that only half the tile is held in bf16 at once
            HALF: gl.constexpr = BLOCK_N // 2
            lo, hi = acc.reshape(BLOCK_M, 2, HALF).permute(0, 2, 1).split()
            c_lo = c_bufs.index(2 * CONSUMER)
            c_hi = c_bufs.index(2 * CONSUMER + 1)
            tma.store_wait(pendings=0)  # this consumer's previous tile has left the buffers
            c_lo.store(lo.to(gl.bfloat16))
            c_hi.store(hi.to(gl.bfloat16))
            fence_async_shared()
            tma.async_copy_shared_to_global(c_desc, [off_m, off_n], c_lo)
            if off_n + HALF < V:  # the ragged last tile's right half may lie wholly past V: no empty box
                tma.async_copy_shared_to_global(c_desc, [off_m, off_n + HALF], c_hi)
        # columns past V (the ragged last tile; TMA zero-filled W there) must not count
        acc = gl.where(gl.expand_dims(local_col < V - off_n, 0), acc, float("-inf"))
        tile_max = gl.max(acc, axis=1)
        tile_sum = gl.sum(gl.exp2((acc - gl.expand_dims(tile_max, 1)) * LOG2E), axis=1)
        part = rows.to(gl.int64) * n_col_tiles + pid_n
        gl.store(part_max_ptr + part, tile_max, mask=row_ok)
        gl.store(part_sum_ptr + part, tile_sum, mask=row_ok)
    if WRITE_LOGITS:
        tma.store_wait(pendings=0)


@gluon.jit
def _consumer_worker(x_desc, w_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty, order,
                     part_max_ptr, part_sum_ptr, target_ptr, target_logit_ptr, T, V, n_col_tiles, num_m, num_n,
                     k_tiles, GROUP_M: gl.constexpr, STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr,
                     WRITE_LOGITS: gl.constexpr, COOP: gl.constexpr):
    _consumer(x_desc, w_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty, order, part_max_ptr, part_sum_ptr,
              target_ptr, target_logit_ptr, T, V, n_col_tiles, num_m, num_n, k_tiles, GROUP_M, STAGES, NUM_CONSUMERS,
              1, WRITE_LOGITS, COOP)


@gluon.jit
def _logits_stats_kernel(x_desc, w_desc, c_desc, part_max_ptr, part_sum_ptr, target_ptr, target_logit_ptr,
                         T, V, H, n_col_tiles,
                         GROUP_M: gl.constexpr, STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr,
                         WRITE_LOGITS: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                         COOP: gl.constexpr):
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    # cooperative: both consumers release a slot
    a_bufs, b_bufs, ready, empty = operand_ring(x_desc, w_desc, STAGES, 1 + (NUM_CONSUMERS - 1) * COOP)
    if WRITE_LOGITS:
        c_bufs = gl.allocate_shared_memory(c_desc.dtype, [2 * NUM_CONSUMERS] + c_desc.block_type.shape, c_desc.layout)
    else:  # unused: a token allocation keeps the partitions' signature one shape
        c_bufs = gl.allocate_shared_memory(c_desc.dtype, [1, 8, 64], c_desc.layout)
    order = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # ping-pong main-loop turns
    for c in gl.static_range(2):
        mbarrier.init(order.index(c), count=1)
    fence_async_shared()

    num_m = gl.cdiv(T, BLOCK_M)
    num_n = gl.cdiv(V, BLOCK_N)
    k_tiles = gl.cdiv(H, BLOCK_K)
    if NUM_CONSUMERS == 2:
        gl.warp_specialize([
            (_consumer, (x_desc, w_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty, order, part_max_ptr,
                         part_sum_ptr, target_ptr, target_logit_ptr, T, V, n_col_tiles, num_m, num_n, k_tiles, GROUP_M,
                         STAGES, NUM_CONSUMERS, 0, WRITE_LOGITS, COOP)),
            (_consumer_worker, (x_desc, w_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty, order, part_max_ptr,
                                part_sum_ptr, target_ptr, target_logit_ptr, T, V, n_col_tiles, num_m, num_n, k_tiles,
                                GROUP_M, STAGES, NUM_CONSUMERS, WRITE_LOGITS, COOP)),
            (tma_producer, (x_desc, w_desc, a_bufs, b_bufs, ready, empty, num_m, num_n, k_tiles, GROUP_M, STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (x_desc, w_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty, order, part_max_ptr,
                         part_sum_ptr, target_ptr, target_logit_ptr, T, V, n_col_tiles, num_m, num_n, k_tiles, GROUP_M,
                         STAGES, NUM_CONSUMERS, 0, WRITE_LOGITS, COOP)),
            (tma_producer, (x_desc, w_desc, a_bufs, b_bufs, ready, empty, num_m, num_n, k_tiles, GROUP_M, STAGES)),
        ], [1], [PRODUCER_REGS])


# ---------------------------------------------------------------------------------------------------- host


def parse_config(text: str) -> dict:
    """'128x128x64s6c2' -> BLOCK_M/N/K (the tile the producer loads), STAGES (requested; capped to fit shared
    memory), c1/c2 = one consumer / two ping-pong consumers, coop = two consumers splitting each tile by rows;
    optional gN = GROUP_M."""
    m = re.fullmatch(r"(\d+)x(\d+)x(\d+)s(\d+)(c1|c2|coop)(?:g(\d+))?", text.strip())
    if not m:
        raise ValueError(f"bad config {text!r}: want BMxBNxBKsSTAGES(c1|c2|coop)[gGROUP_M], e.g. 128x128x64s6c2")
    bm, bn, bk, stages, mode, group = m.groups()
    return dict(name=text.strip(), BLOCK_M=int(bm), BLOCK_N=int(bn), BLOCK_K=int(bk), STAGES=int(stages),
                NUM_CONSUMERS=1 if mode == "c1" else 2, COOP=int(mode == "coop"), GROUP_M=int(group or 16))


def warpgroup_m(config: dict) -> int:
    """Rows of one consumer's accumulator: the tile's, or half of it when the consumers cooperate."""
    return config["BLOCK_M"] // (2 if config["COOP"] else 1)


def launch_params(config: dict, write_logits: bool) -> dict:
    """Stages capped to the shared memory left after the logits buffers; warps and register split."""
    bm, bn, bk, nc = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"], config["NUM_CONSUMERS"]
    wg_m = warpgroup_m(config)
    assert wg_m in (64, 128) and wg_m * bn // 128 <= 128, "accumulator over 128 fp32 regs/thread would spill"
    assert bn <= 256 and bm <= 256, "a TMA box is at most 256 rows"
    stage = (bm + bn) * bk * 2
    epilogue = nc * wg_m * bn * 2 if write_logits else 8 * 64 * 2
    stages = min(config["STAGES"], (SMEM_LIMIT - epilogue - 1024) // stage)
    # warps at launch: consumers 4 each + the producer's warp padded to a warpgroup. Registers at launch must
    # fit 64K (maxnreg * threads); setmaxnreg then moves them between partitions: the producer drops to 40,
    # the worker consumer takes CONSUMER_REGS and the default partition (consumer 0) what is left. 232 for
    # both consumers: 3 x 168 = 2 x 232 + 40 (two consumers), 2 x 136 = 232 + 40 (one). With one consumer
    # at 256 (maxnreg 256), ptxas schedules the epilogue wider and spills; 232 does not.
    warpgroups = nc + 1
    producer_regs, consumer_regs = 40, 232
    maxnreg = -(-(consumer_regs * nc + producer_regs) // warpgroups)
    maxnreg = -(-maxnreg // 8) * 8
    assert maxnreg * warpgroups * 128 <= 65536
    return dict(STAGES=stages, GROUP_M=config["GROUP_M"], NUM_CONSUMERS=nc, WRITE_LOGITS=write_logits,
                CONSUMER_REGS=consumer_regs, PRODUCER_REGS=producer_regs, COOP=config["COOP"], num_warps=4,
                maxnreg=maxnreg)


def layouts(config: dict):
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    a = gl.NVMMASharedLayout.get_default_for([bm, bk], gl.bfloat16)
    b = gl.NVMMASharedLayout.get_default_for([bn, bk], gl.bfloat16)
    c = gl.NVMMASharedLayout.get_default_for([warpgroup_m(config), bn // 2], gl.bfloat16)
    return a, b, c


def compile_variant(config: dict, write_logits: bool):
    """Lower one variant to an sm_90a cubin on the CPU (GluonASTSource + GPUTarget('cuda', 90, 32))."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    params = launch_params(config, write_logits)
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    a, b, c = layouts(config)
    c_block = [warpgroup_m(config), bn // 2]  # each consumer stores its tile in two column halves
    signature = {
        "x_desc": f"tensordesc<bf16[{bm}, {bk}],{a!r}>", "w_desc": f"tensordesc<bf16[{bn}, {bk}],{b!r}>",
        "c_desc": f"tensordesc<bf16[{c_block[0]}, {c_block[1]}],{c!r}>",
        "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32", "target_ptr": "*i64", "target_logit_ptr": "*fp32",
        "T": "i32", "V": "i32", "H": "i32", "n_col_tiles": "i32",
    }
    constexprs = {k: params[k] for k in ("GROUP_M", "STAGES", "NUM_CONSUMERS", "WRITE_LOGITS", "CONSUMER_REGS",
                                         "PRODUCER_REGS", "COOP")}
    signature.update({k: "constexpr" for k in constexprs})
    names = _logits_stats_kernel.arg_names
    attrs = {(names.index(n), ): [["tt.divisibility", 16]] for n in ("part_max_ptr", "part_sum_ptr", "target_ptr",
                                                                       "target_logit_ptr", "H")}
    source = GluonASTSource(fn=_logits_stats_kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": params["num_warps"], "maxnreg": params["maxnreg"]})
    return compiled, params


def resources(compiled) -> dict:
    """Registers per thread, stack bytes (spills) from cuobjdump; shared memory from the metadata; ptxas -v."""
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as scratch:
        cubin, ptx = os.path.join(scratch, "k.cubin"), os.path.join(scratch, "k.ptx")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        report = subprocess.run([os.path.join(bindir, "cuobjdump"), "-res-usage", cubin], capture_output=True,
                                text=True).stdout
        ptxas = subprocess.run([os.path.join(bindir, "ptxas"), "-v", "--gpu-name=sm_90a", ptx, "-o",
                                os.path.join(scratch, "again.cubin")], capture_output=True, text=True).stderr
    regs, stack = re.search(r"REG:(\d+)", report), re.search(r"STACK:(\d+)", report)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", ptxas)
    return dict(regs=int(regs.group(1)) if regs else -1, stack=int(stack.group(1)) if stack else -1,
                spill=sum(int(st) + int(ld) for st, ld in spills), smem=compiled.metadata.shared,
                setmaxnreg=sorted(set(re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)",
                                                 compiled.asm["ptx"]))))


def compile_main(configs: list) -> int:
    failed = 0
    for config in configs:
        for write_logits in (False, True):
            label = f"gluon_logits_stats {config['name']} WRITE_LOGITS={write_logits}"
            try:
                compiled, params = compile_variant(config, write_logits)
            except Exception as error:  # noqa: BLE001  (report which variant, go on with the others)
                print(f"FAILED {label}: {type(error).__name__}: {str(error)[-2000:]}", flush=True)
                failed += 1
                continue
            r = resources(compiled)
            print(f"sm_90a ok: {label} stages={params['STAGES']} maxnreg={params['maxnreg']} "
                  f"consumer_regs={params['CONSUMER_REGS']} producer_regs={params['PRODUCER_REGS']} "
                  f"regs={r['regs']} stack={r['stack']} spill={r['spill']} smem={r['smem']} "
                  f"setmaxnreg={','.join(r['setmaxnreg'])}", flush=True)
            if r["stack"] != 0 or r["spill"] != 0 or r["smem"] > SMEM_LIMIT:
                failed += 1
    return 1 if failed else 0



# ---------------------------------------------------------------------------------------------------- GPU


class Launcher:
    """Buffers and descriptors for one (config, shape); `__call__` launches the kernel once."""

    def __init__(self, config: dict, write_logits: bool, x, w, targets, logits=None, max_ctas: int = 0):
        import torch
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        self.params = launch_params(config, write_logits)
        T, H = x.shape
        V = w.shape[0]
        bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
        a, b, c = layouts(config)
        self.n_col_tiles = triton.cdiv(V, bn)
        self.part_max = torch.empty(T, self.n_col_tiles, device=x.device, dtype=torch.float32)
        self.part_sum = torch.empty_like(self.part_max)
        self.target_logit = torch.empty(T, device=x.device, dtype=torch.float32)
        if write_logits:
            assert logits is not None and logits.shape == (T, V) and (V * 2) % 16 == 0
            self.logits = logits
        else:  # never written: a block-sized stand-in keeps one kernel signature
            self.logits = torch.empty(warpgroup_m(config), bn // 2, device=x.device, dtype=torch.bfloat16)
        self.x_desc = TensorDescriptor.from_tensor(x, [bm, bk], a)
        self.w_desc = TensorDescriptor.from_tensor(w, [bn, bk], b)
        self.c_desc = TensorDescriptor.from_tensor(self.logits, [warpgroup_m(config), bn // 2], c)
        self.targets = targets
        self.T, self.V, self.H = T, V, H
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        self.grid = (min(max_ctas if max_ctas > 0 else sms, triton.cdiv(T, bm) * self.n_col_tiles), )

    def poison(self):
        for buf in (self.part_max, self.part_sum, self.target_logit):
            buf.fill_(float("nan"))
        if self.params["WRITE_LOGITS"]:
            self.logits.fill_(float("nan"))

    def __call__(self):
        p = self.params
        _logits_stats_kernel[self.grid](
            self.x_desc, self.w_desc, self.c_desc, self.part_max, self.part_sum, self.targets, self.target_logit,
            self.T, self.V, self.H, self.n_col_tiles, GROUP_M=p["GROUP_M"], STAGES=p["STAGES"],
            NUM_CONSUMERS=p["NUM_CONSUMERS"], WRITE_LOGITS=p["WRITE_LOGITS"], CONSUMER_REGS=p["CONSUMER_REGS"],
            PRODUCER_REGS=p["PRODUCER_REGS"], COOP=p["COOP"], num_warps=p["num_warps"], maxnreg=p["maxnreg"])

    def reduce_partials(self):
        """logsumexp per row from the per-tile (max, sum of exp) partials."""
        import torch
        row_max = self.part_max.max(dim=1).values
        return row_max + torch.log((self.part_sum * torch.exp(self.part_max - row_max[:, None])).sum(dim=1))


def finish_or_die(what: str, seconds: float = 30.0):
    """Wait for the GPU with a deadline: a deadlocked pipeline must not eat the whole device call."""
    import time

    import torch
    done = torch.cuda.Event()
    done.record()
    deadline = time.time() + seconds
    while not done.query():
        if time.time() > deadline:
            print(f"HANG: {what} did not finish in {seconds:.0f} s; exiting", flush=True)
            os._exit(3)
        time.sleep(0.002)


def make_inputs(T: int, H: int, V: int, seed: int = 0):
    import torch
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(T, H, device=DEVICE, dtype=torch.bfloat16, generator=g)
    w = (torch.randn(V, H, device=DEVICE, dtype=torch.bfloat16, generator=g) * (1.5 / H ** 0.5)).to(torch.bfloat16)
    targets = torch.randint(0, V, (T, ), device=DEVICE, generator=g)
    targets[torch.rand(T, device=DEVICE, generator=g) < 0.1] = -100
    targets[0] = V - 1  # the ragged last column tile holds a target
    return x, w, targets


def check(config: dict, T: int, H: int, V: int, max_ctas: int = 0) -> bool:
    """Every output element written (NaN poison gone) and equal to torch fp32 from the same bf16 inputs;
    max_ctas > 0 caps the persistent grid (each CTA then walks many tiles)."""
    import torch
    x, w, targets = make_inputs(T, H, V)
    ref = x.float() @ w.float().t()
    ref_lse = torch.logsumexp(ref, dim=1)
    valid = targets != -100
    ref_tgt = ref.gather(1, targets.clamp(min=0)[:, None])[:, 0]
    ok = True
    for write_logits in (False, True):
        logits = torch.empty(T, V, device=DEVICE, dtype=torch.bfloat16) if write_logits else None
        run = Launcher(config, write_logits, x, w, targets, logits, max_ctas)
        run.poison()
        run()
        finish_or_die(f"{config['name']} WRITE_LOGITS={write_logits} T={T} grid={run.grid[0]}")
        problems = []
        for name, buf in (("part_max", run.part_max), ("part_sum", run.part_sum)):
            if not torch.isfinite(buf).all():
                problems.append(f"{name}: {int((~torch.isfinite(buf)).sum())} unwritten/non-finite")
        if torch.isnan(run.target_logit[valid]).any() or not torch.isnan(run.target_logit[~valid]).all():
            problems.append("target_logit: written rows != rows with a valid target")
        lse_err = (run.reduce_partials() - ref_lse).abs().max().item()
        tgt_err = (run.target_logit[valid] - ref_tgt[valid]).abs().max().item()
        tol = 1e-3 + 1e-4 * ref.abs().max().item()
        if not lse_err <= tol:
            problems.append(f"logsumexp max err {lse_err:.3g} > {tol:.3g}")
        if not tgt_err <= tol:
            problems.append(f"target logit max err {tgt_err:.3g} > {tol:.3g}")
        if write_logits:
            if torch.isnan(logits).any():
                problems.append(f"logits: {int(torch.isnan(logits).sum())} unwritten")
            logit_err = (logits.float() - ref).abs().max().item()
            if not logit_err <= 1e-2 * ref.abs().max().item() + 1e-3:
                problems.append(f"logits max err {logit_err:.3g}")
        status = "ok" if not problems else "FAIL " + "; ".join(problems)
        print(f"check {config['name']} WRITE_LOGITS={write_logits} T={T} H={H} V={V} grid={run.grid[0]}: "
              f"lse_err={lse_err:.2e} tgt_err={tgt_err:.2e} {status}", flush=True)
        ok &= not problems
        del run, logits
    del ref
    torch.cuda.empty_cache()
    return ok


def check_config(config: dict, max_ctas: int = 0) -> bool:
    """All of CHECK_SHAPES for one config (a shape's own grid cap, else max_ctas); stops at the first failure."""
    try:
        return all(check(config, T, H, V, cap or max_ctas) for T, H, V, cap in CHECK_SHAPES)
    except Exception as error:  # noqa: BLE001  (a config the device rejects: report, try the next)
        print(f"check {config['name']}: ERROR {type(error).__name__}: {str(error)[-800:]}", flush=True)
        return False


def check_isolated(config: dict, max_ctas: int, timeout: float = 150.0) -> bool:
    """check_config in a child process: a kernel that kills its CUDA context (e.g. 'unspecified launch
    failure', which took the whole process down on 2026-12-06) then costs only this config."""
    command = [sys.executable, os.path.abspath(__file__), "--check-only", "--configs", config["name"],
               "--max-ctas", str(max_ctas)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "TRITON_INTERPRET": "0"})
    except subprocess.TimeoutExpired as error:
        print((error.stdout or b"").decode(errors="replace") if isinstance(error.stdout, bytes) else
              (error.stdout or ""), end="", flush=True)
        print(f"check {config['name']}: TIMEOUT after {timeout:.0f} s (child killed)", flush=True)
        return False
    print(done.stdout, end="", flush=True)
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        print(f"check {config['name']}: child exit {done.returncode}" + (f"; stderr tail: {lines[-1][-300:]}"
                                                                           if lines else ""), flush=True)
    return done.returncode == 0


def check_main(args) -> int:
    import torch
    torch.backends.cuda.matmul.allow_tf32 = False
    ok = [check_config(parse_config(c), args.max_ctas) for c in args.configs.split(",")]
    return 0 if all(ok) else 1


def library_loss(x, w, targets):
    """fusedkern's mean cross-entropy without a gradient (its default loss-only path)."""
    import torch

    import fusedkern
    with torch.no_grad():
        return fusedkern.linear_cross_entropy(x, w, targets)


def gluon_loss(stats: "Launcher"):
    """Mean cross-entropy over the valid rows from one launch's partials: lse − target logit."""
    import torch
    stats()
    valid = stats.targets != -100
    per_row = torch.where(valid, stats.reduce_partials() - stats.target_logit, 0.0)
    return per_row.sum() / valid.sum()


def bench_main(args) -> int:
    import csv
    import random
    import time

    import torch

    from fusedkern.study.providers import Step
    from fusedkern.study.timing import time_steps_interleaved
    from fusedkern.study.workloads import Inputs
    torch.backends.cuda.matmul.allow_tf32 = False
    t0 = time.time()
    configs = [parse_config(c) for c in args.configs.split(",")]
    gpu = torch.cuda.get_device_name()
    good = []
    for config in configs:  # (1) correctness: CHECK_SHAPES, each config in its own process unless --no-isolate
        ok = check_config(config, args.max_ctas) if args.no_isolate else check_isolated(config, args.max_ctas)
        if ok:
            good.append(config)
    print(f"correctness done in {time.time() - t0:.0f} s; timing {[c['name'] for c in good]}", flush=True)
    rows = []
    H, V = args.hidden, args.vocab
    for T in [int(t) for t in args.tokens.split(",")]:
        x, w, targets = make_inputs(T, H, V)
        logits = torch.empty(T, V, device=DEVICE, dtype=torch.bfloat16)
        providers = {"cublas_mm": lambda x=x, w=w: torch.mm(x, w.t()),
                     # the library's loss-only pass (tile pass: logits to HBM and back), what a Gluon loss would replace
                     "fusedkern_loss_only": lambda x=x, w=w, t=targets: library_loss(x, w, t)}
        for config in good:
            for write_logits in (True, False):
                name = f"gluon_ws_{config['name']}_{'logits' if write_logits else 'stats'}"
                providers[name] = Launcher(config, write_logits, x, w, targets, logits if write_logits else None,
                                           args.max_ctas)
            # the whole loss-only pass on this kernel: statistics, then the merge into a mean loss
            stats = providers[f"gluon_ws_{config['name']}_stats"]
            providers[f"gluon_ws_{config['name']}_loss"] = lambda stats=stats: gluon_loss(stats)
        library = library_loss(x, w, targets).item()
        for name in [n for n in providers if n.endswith("_loss")]:
            value = providers[name]().item()
            print(f"T={T} loss: fusedkern {library:.6f}, {name} {value:.6f} (difference {value - library:+.2e})",
                  flush=True)
        # the study's shuffled protocol (fusedkern.study.timing): one rep of each provider per round, a new order
        # every round, CUDA events read after the round; three untimed reps first compile every variant
        steps = {name: Step(run=lambda _, fn=fn: fn()) for name, fn in providers.items()}
        timings = time_steps_interleaved(steps, Inputs(op="ce", x=x, w=w, target=targets), warmup=3,
                                         reps=args.reps, min_reps=args.reps, max_case_s=1e9,
                                         rng=random.Random(1234))
        failed = {name: error for name, error in timings.items() if isinstance(error, BaseException)}
        if failed:
            raise RuntimeError(f"providers failed in their warm-up: {failed}")
        flops = 2.0 * T * H * V
        base = timings["cublas_mm"]["ms_p50"]
        for name in providers:
            p20, p50, p80 = (timings[name][k] for k in ("ms_p20", "ms_p50", "ms_p80"))
            row = dict(op="lm_head_logits_stats", provider=name, tokens=T, hidden=H, vocab=V, ms_p20=round(p20, 4),
                       ms_p50=round(p50, 4), ms_p80=round(p80, 4), ratio_to_cublas_p50=round(p50 / base, 4),
                       tflops_p50=round(flops / p50 / 1e9, 1), gpu=gpu, protocol="shuffled", workload="dense")
            rows.append(row)
            print(f"T={T} {name:44s} p20={p20:.3f} p50={p50:.3f} p80={p80:.3f} ms  x{p50 / base:.3f} cuBLAS  "
                  f"{flops / p50 / 1e9:.0f} TFLOP/s", flush=True)
        del providers, logits, x, w
        torch.cuda.empty_cache()
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["op"])
            writer.writeheader()
            writer.writerows(rows)
    print(f"bench done in {time.time() - t0:.0f} s", flush=True)
    return 0 if len(good) == len(configs) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--compile", action="store_true", help="lower every variant to sm_90a on the CPU")
    parser.add_argument("--bench", action="store_true", help="correctness + timing on the GPU")
    parser.add_argument("--check-only", action="store_true", help="only the correctness checks (GPU), in-process")
    parser.add_argument("--no-isolate", action="store_true", help="--bench: check configs in this process")
    parser.add_argument("--configs", default=DEFAULT_CONFIGS,
                        help="comma list, best first, e.g. 128x128x64s6c2 or 128x256x64s4coopg8 (GROUP_M 8)")
    parser.add_argument("--max-ctas", type=int, default=0,
                        help="cap the persistent grid (default 0: #SMs) for the timing and the full-grid checks")
    parser.add_argument("--tokens", default="4096,8192")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--reps", type=int, default=25)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.compile:
        return compile_main([parse_config(c) for c in args.configs.split(",")])
    if args.check_only:
        return check_main(args)
    if args.bench:
        return bench_main(args)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
