"""Building blocks of the persistent Triton GEMMs (`rowcount_gemm`): on the device, an
operand as a TMA descriptor or a pointer, the grouped tile order, the K loop on either load path, and
the epilogue that stores (or adds) an output tile; on the host, which tensors a descriptor can address,
the choice of load path, the scratch allocator that device-side descriptors need, the row-count check
and the persistent launch.

Both load paths compute the same fp32 tile. TMA (sm_90+, 16-bit operands, 16-byte aligned rows): the
descriptor's extents zero-fill loads and clip stores beyond the matrix, so the K loop has no masks, and
the output leaves in EPI_SLICES column slices so that one slice of shared memory stages it. Pointers
(everything else, and Triton's interpreter): masked loads with int64 row offsets (row × stride passes
2^31 at LM sizes: 32768 × 128256).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedkern._runtime import interpreting, sm_count
from fusedkern.kernels.dot import dot_fp32_acc

__all__ = ["valid_rows", "operand", "product_tile", "linear_tile", "epilogue", "STORE", "LOAD_ADD_STORE",
           "REDUCE_ADD", "tma_addressable", "ensure_allocator", "tma_eligible", "use_tma", "check_count",
           "launch_persistent"]


@triton.jit
def valid_rows(count_ptr, C):
    """n = clamp(count, 0, C) as int32, read from device memory (count may be int32 or int64)."""
    n = tl.load(count_ptr)
    n = tl.minimum(tl.maximum(n, 0), C)
    return n.to(tl.int32)


@triton.jit
def operand(ptr, rows, cols, row_stride, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
            USE_TMA: tl.constexpr):
    """A row-major (rows, cols) matrix as the load path addresses it: a TMA descriptor of (BLOCK_ROWS,
    BLOCK_COLS) blocks (its extents zero-fill loads and clip stores beyond them), or the pointer itself."""
    if USE_TMA:
        return tl.make_tensor_descriptor(ptr, shape=[rows, cols], strides=[row_stride, 1],
                                         block_shape=[BLOCK_ROWS, BLOCK_COLS])
    else:
        return ptr


@triton.jit
def _tile(tile_id, num_pid_m, num_pid_n, M, N,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Output tile `tile_id` in grouped order (GROUP_M row blocks side by side, row block fastest within
    a group): its corner (off_m, off_n), its row and column indices, and their masks (< M, < N)."""
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = tile_id // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (tile_id % group_size_m)
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    return off_m, off_n, offs_m, offs_n, offs_m < M, offs_n < N


@triton.jit
def _operand_ptrs(ptr, offs_outer, offs_k, stride_outer, stride_k, K_ROWS: tl.constexpr):
    """Pointers of an operand block: (BLOCK_K, outer) when k runs along the stored rows, else (outer,
    BLOCK_K). The row index is int64: row × stride can exceed 2^31 at LM sizes."""
    if K_ROWS:
        return ptr + offs_k.to(tl.int64)[:, None] * stride_k + offs_outer[None, :] * stride_outer
    else:
        return ptr + offs_outer.to(tl.int64)[:, None] * stride_outer + offs_k[None, :] * stride_k


@triton.jit
def _operand_mask(mask_outer, mask_k, K_ROWS: tl.constexpr):
    if K_ROWS:
        return mask_k[:, None] & mask_outer[None, :]
    else:
        return mask_outer[:, None] & mask_k[None, :]


@triton.jit
def _mainloop(a, b, off_m, off_n, offs_m, offs_n, mask_m, mask_n, K, stride_am, stride_ak, stride_bk, stride_bn,
              A_K_ROWS: tl.constexpr, B_K_ROWS: tl.constexpr, USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The fp32 (BLOCK_M, BLOCK_N) tile of A @ B at (off_m, off_n), summed over k < K.

    a, b: `operand`s. X_K_ROWS: the operand is stored with k along its rows (blocks (BLOCK_K, outer)),
    else along its columns (blocks (outer, BLOCK_K)); a block is transposed in registers as the dot
    needs it. Pointer path: rows and columns outside the masks, and k ≥ K, load as 0 — both operands
    masked, since a token row beyond n may hold NaN and NaN × 0 is NaN."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if USE_TMA:
        for ki in range(tl.cdiv(K, BLOCK_K)):
            k = ki * BLOCK_K
            if A_K_ROWS:
                a_blk = a.load([k, off_m])
            else:
                a_blk = a.load([off_m, k])
            if B_K_ROWS:
                b_blk = b.load([k, off_n])
            else:
                b_blk = b.load([off_n, k])
            # transposed after both loads: the pipeliner then waits on one barrier for the pair
            if A_K_ROWS:
                a_blk = a_blk.T
            if not B_K_ROWS:
                b_blk = b_blk.T
            acc = dot_fp32_acc(a_blk, b_blk, acc, DOT_PRECISION)
    else:
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = _operand_ptrs(a, offs_m, offs_k, stride_am, stride_ak, A_K_ROWS)
        b_ptrs = _operand_ptrs(b, offs_n, offs_k, stride_bn, stride_bk, B_K_ROWS)
        for ki in range(tl.cdiv(K, BLOCK_K)):
            mask_k = offs_k < K - ki * BLOCK_K
            a_blk = tl.load(a_ptrs, mask=_operand_mask(mask_m, mask_k, A_K_ROWS), other=0.0)
            b_blk = tl.load(b_ptrs, mask=_operand_mask(mask_n, mask_k, B_K_ROWS), other=0.0)
            if A_K_ROWS:
                a_blk = tl.trans(a_blk)
            if not B_K_ROWS:
                b_blk = tl.trans(b_blk)
            acc = dot_fp32_acc(a_blk, b_blk, acc, DOT_PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
    return acc


@triton.jit
def product_tile(a, b, tile_id, num_pid_m, num_pid_n, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                 A_K_ROWS: tl.constexpr, B_K_ROWS: tl.constexpr, USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """Tile `tile_id` of A @ B (M × N, summed over k < K; a, b: `operand`s laid out as `_mainloop` says):
    (off_m, off_n, offs_m, offs_n, mask_m, mask_n, acc) with acc the fp32 (BLOCK_M, BLOCK_N) tile."""
    off_m, off_n, offs_m, offs_n, mask_m, mask_n = _tile(tile_id, num_pid_m, num_pid_n, M, N, BLOCK_M, BLOCK_N,
                                                         GROUP_M)
    acc = _mainloop(a, b, off_m, off_n, offs_m, offs_n, mask_m, mask_n, K, stride_am, stride_ak, stride_bk,
                    stride_bn, A_K_ROWS, B_K_ROWS, USE_TMA, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    return off_m, off_n, offs_m, offs_n, mask_m, mask_n, acc


@triton.jit
def linear_tile(x, w, b_ptr, tile_id, num_pid_m, num_pid_n, n, V, H,
                stride_xc, stride_xh, stride_wv, stride_wh, stride_b, HAS_BIAS: tl.constexpr, USE_TMA: tl.constexpr,
                DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                GROUP_M: tl.constexpr):
    """Tile `tile_id` of Z = X[:n] Wᵀ (+ b), X [C, H] and W [V, H] as `operand`s: `product_tile`'s tuple
    with z, the fp32 (BLOCK_M, BLOCK_N) tile, last."""
    off_m, off_n, offs_m, offs_n, mask_m, mask_n, acc = product_tile(
        x, w, tile_id, num_pid_m, num_pid_n, n, V, H, stride_xc, stride_xh, stride_wh, stride_wv, False, False,
        USE_TMA, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n * stride_b, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    return off_m, off_n, offs_m, offs_n, mask_m, mask_n, acc


@triton.jit
def _halves(t, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(BLOCK_M, BLOCK_N) → its left and right (BLOCK_M, BLOCK_N // 2) column halves."""
    t = tl.reshape(t, (BLOCK_M, 2, BLOCK_N // 2))
    return tl.split(tl.permute(t, (0, 2, 1)))


# epilogue modes of `epilogue` (MODE)
STORE, LOAD_ADD_STORE, REDUCE_ADD = 0, 1, 2


@triton.jit
def _store_slice(desc, acc, off_m, off_n, MODE: tl.constexpr):
    if MODE == 2:  # β = 1 by a TMA reduce-add (fp32 adds in L2, asynchronous: no load round trip)
        desc.atomic_add([off_m, off_n], acc)
    else:
        if MODE == 1:  # β = 1 through registers: the old tile comes in by a TMA load (one rounding)
            acc += desc.load([off_m, off_n]).to(tl.float32)
        desc.store([off_m, off_n], acc.to(desc.dtype))


@triton.jit
def epilogue(out, acc, off_m, off_n, offs_m, offs_n, mask_m, mask_n, stride_om, stride_on, MODE: tl.constexpr,
             USE_TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EPI_SLICES: tl.constexpr):
    """out[tile] = acc (MODE 0), or out[tile] += acc (MODE 1: load, add in fp32, one rounding; MODE 2: a
    TMA reduce-add, on the pointer path the same as 1). `out` is an `operand`: TMA stores go out in
    EPI_SLICES column slices (1, 2 or 4; the descriptor's block is (BLOCK_M, BLOCK_N // EPI_SLICES)), so
    the shared-memory staging buffer is one slice and leaves room for more pipeline stages."""
    if USE_TMA:
        if EPI_SLICES == 1:
            _store_slice(out, acc, off_m, off_n, MODE)
        elif EPI_SLICES == 2:
            a0, a1 = _halves(acc, BLOCK_M, BLOCK_N)
            _store_slice(out, a0, off_m, off_n, MODE)
            _store_slice(out, a1, off_m, off_n + BLOCK_N // 2, MODE)
        else:
            a0, a1 = _halves(acc, BLOCK_M, BLOCK_N)
            a00, a01 = _halves(a0, BLOCK_M, BLOCK_N // 2)
            _store_slice(out, a00, off_m, off_n, MODE)
            _store_slice(out, a01, off_m, off_n + BLOCK_N // 4, MODE)
            a10, a11 = _halves(a1, BLOCK_M, BLOCK_N // 2)
            _store_slice(out, a10, off_m, off_n + BLOCK_N // 2, MODE)
            _store_slice(out, a11, off_m, off_n + 3 * (BLOCK_N // 4), MODE)
    else:
        ptrs = out + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
        mask = mask_m[:, None] & mask_n[None, :]
        if MODE != 0:
            acc += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(ptrs, acc.to(out.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# host side


def tma_addressable(t: torch.Tensor) -> bool:
    """A 2-D tensor a TMA descriptor can address: unit inner stride, 16-byte aligned base and row stride."""
    return (t.dim() == 2 and t.stride(1) == 1 and t.data_ptr() % 16 == 0
            and (t.stride(0) * t.element_size()) % 16 == 0 and min(t.shape) > 0)


def _torch_scratch(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_allocator() -> None:
    """Device-side descriptors live in Triton's global scratch: install a torch-backed allocator
    unless one is already set (an allocator the user set is kept)."""
    try:
        from triton.runtime import _allocation
        unset = isinstance(_allocation._allocator.get(), _allocation.NullAllocator)
    except (ImportError, AttributeError):  # another Triton layout: set ours
        unset = True
    if unset:
        triton.set_allocator(_torch_scratch)


def tma_eligible(operands: tuple, outputs: tuple = ()) -> bool:
    """True when `impl="auto"` takes the TMA kernels: a CUDA device of sm_90 or newer, fp16/bf16
    operands, and every tensor (operands and outputs) addressable by a descriptor (unit inner stride,
    16-byte aligned base and row stride; e.g. a bf16 [C, V] buffer needs V % 8 == 0)."""
    if interpreting() or not hasattr(tl, "make_tensor_descriptor"):
        return False
    dev = operands[0].device
    if dev.type != "cuda" or torch.cuda.get_device_capability(dev)[0] < 9:
        return False
    return (all(t.dtype in (torch.float16, torch.bfloat16) for t in operands)
            and all(tma_addressable(t) for t in (*operands, *outputs)))


def use_tma(impl: str, operands: tuple, outputs: tuple) -> bool:
    """Whether a launch takes the TMA path. impl: 'auto' (where `tma_eligible`), 'tma' (forced; each
    tensor's addressability checked), 'pointer'. Installs the descriptors' scratch allocator when needed."""
    if impl == "pointer":
        return False
    if impl == "tma":
        for t in (*operands, *outputs):
            if not tma_addressable(t):
                raise ValueError(f"impl='tma' needs 2-D tensors with unit inner stride and 16-byte aligned "
                                 f"base and row stride; got shape {tuple(t.shape)}, strides {t.stride()}, "
                                 f"{t.dtype}")
        use = True
    elif impl == "auto":
        use = tma_eligible(operands, outputs)
    else:
        raise ValueError(f"impl must be 'auto', 'tma' or 'pointer', got {impl!r}")
    if use and not interpreting():
        ensure_allocator()
    return use


def check_count(count: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The row count a kernel reads on the device, checked; returned as a one-element tensor."""
    if not isinstance(count, torch.Tensor) or count.numel() != 1:
        raise ValueError("count must be a one-element int32/int64 tensor")
    if count.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"count must be int32 or int64, got {count.dtype}")
    if count.device != device:
        raise ValueError(f"count must live on {device} (the kernel reads it), got {count.device}")
    return count.reshape(1)


def launch_persistent(tuned, rows: int, cols: int, device: torch.device, args: tuple, flags: dict,
                      config: triton.Config | None) -> None:
    """Persistent launch: one program per SM, or fewer when the largest possible problem (all rows
    valid) has fewer tiles. `config` bypasses the autotuner (benchmarks, reproducibility)."""
    sms = sm_count(device)

    def grid(meta):
        return (max(1, min(sms, triton.cdiv(rows, meta["BLOCK_M"]) * triton.cdiv(cols, meta["BLOCK_N"]))),)

    if config is None:
        tuned[grid](*args, **flags)
    else:
        meta = {**flags, **config.kwargs}
        tuned.fn[grid(meta)](*args, **meta, num_warps=config.num_warps, num_stages=config.num_stages)
