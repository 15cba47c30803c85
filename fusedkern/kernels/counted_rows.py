"""Triton: move the first n rows of a gather or a scatter, n a device count, so that rows past it cost nothing.

    gather_rows(src, index, count, out)              out[i] = src[index[i]]                   for i < n
    scatter_rows(src, index, count, out, factor)     out[index[i]] = src[i] · factor[i]       for i < n

n = count[0], read on the device (no host sync). Rows from n on are neither read nor written: a program per row
and column block returns at once past the count. Why: the counted passes (`fusedkern/anticipated.py`) sort the
rows they recompute to the front and count them on the device; `index_select` / `index_copy_` would move all T rows
whatever the count, and a count of 0 (the common case there) should cost launches only. The scatter's product is
formed in fp32 and rounded once to out's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedkern._runtime import interpreting


# the index, factor and count are a chunk's slices of [T] vectors (and of the per-chunk counts), 16-byte aligned or
# not by where the chunk starts: compiled once for any, read one element a program
@triton.jit(do_not_specialize_on_alignment=["index_ptr", "factor_ptr", "count_ptr"])
def _counted_rows_kernel(
    src_ptr,  # (rows, H): read at row index[i] (gather) or i (scatter)
    out_ptr,  # (rows, H): written at row i (gather) or index[i] (scatter)
    index_ptr,  # (T,) int64 row indices
    factor_ptr,  # (T,) fp32 per-row factor (HAS_FACTOR)
    count_ptr,  # (1,) int: rows i ≥ count are skipped
    H, stride_src, stride_out,
    SCATTER: tl.constexpr, HAS_FACTOR: tl.constexpr, BLOCK_H: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    if i >= tl.load(count_ptr):
        return
    row = tl.load(index_ptr + i).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    if SCATTER:
        src_row, out_row = i, row
    else:
        src_row, out_row = row, i
    values = tl.load(src_ptr + src_row * stride_src + cols, mask=mask)
    if HAS_FACTOR:
        values = values.to(tl.float32) * tl.load(factor_ptr + i)
    tl.store(out_ptr + out_row * stride_out + cols, values.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(src, index, count, out, factor, scatter: bool) -> torch.Tensor:
    T, H = (src if scatter else out).shape
    assert index.shape == (T,) and src.stride(1) == 1 and out.stride(1) == 1 and src.shape[1] == out.shape[1]
    if T == 0 or H == 0:
        return out
    block = min(triton.next_power_of_2(H), 32 if interpreting() else 1024)
    count = count.reshape(1)
    _counted_rows_kernel[(T, triton.cdiv(H, block))](
        src, out, index, factor if factor is not None else count, count, H, src.stride(0), out.stride(0),
        SCATTER=scatter, HAS_FACTOR=factor is not None, BLOCK_H=block, num_warps=4)
    return out


def gather_rows(src: torch.Tensor, index: torch.Tensor, count: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[i] = src[index[i]] for i < count (module docstring). src [*, H], index [T] int64, out [T, H] in src's
    dtype, count one int element on the device. Returns out (rows ≥ count untouched)."""
    return _launch(src, index, count, out, None, scatter=False)


def scatter_rows(src: torch.Tensor, index: torch.Tensor, count: torch.Tensor, out: torch.Tensor,
                 factor: torch.Tensor | None = None) -> torch.Tensor:
    """out[index[i]] = src[i] · factor[i] for i < count (module docstring). src [T, H], index [T] int64 (distinct
    rows of out), out [*, H], factor [T] fp32 or None, count one int element on the device. Returns out."""
    return _launch(src, index, count, out, factor, scatter=True)
