"""`t *= s` for a device scalar s that costs no memory pass when s == 1, and no sync; and `out = src · s` cast
to out's dtype in one vectorized pass (the fp32 dW accumulator into the weight's dtype).

Why: the chunked strategies form dX and dW in the forward pass, so their backward only multiplies
them by the upstream ∂L/∂loss — which `loss.backward()` sets to 1. Learning that on the host is a
device→host read that waits for the whole forward to finish and leaves the GPU idle while Python
prepares what follows (docs/design.md, "Strategies", gives its cost); multiplying anyway is a read and a
write of dW (2 GiB of traffic for a bf16 [128256, 4096] weight). Here every program reads s on the device and
returns before touching the tensor when it is 1: one launch of programs that exit at once, no sync.

Trade-off: with s ≠ 1 it is a plain bandwidth-bound multiply like `t.mul_(s)`, computed in fp32 and
rounded once to t's dtype (what PyTorch's mul_ does for a bf16 tensor and an fp32 scalar).

`scale_into`: PyTorch's `torch.mul(fp32, s, out=bf16)` takes its generic, non-vectorized elementwise path when
the output's dtype differs from the inputs', well below the memory's speed; the same bytes (4 read + 2 written an
element) in wide vector loads and stores move at the memory's speed, in about half torch's time (docs/design.md,
"a roofline of the chunked step", has the profile and the timing).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedkern._runtime import sm_count

BLOCK = 4096  # elements per program per step (8 KiB of bf16: one wide vector load per thread)
PROGRAMS_PER_SM = 8  # a grid-stride loop over this many programs keeps every SM's loads in flight


@triton.jit
def _scale_kernel(
    src_ptr,  # (N,) contiguous fp32 / fp16 / bf16, read
    out_ptr,  # (N,) contiguous, written: src · s rounded once to its dtype (src_ptr itself: in place)
    scale_ptr,  # (1,) fp32 device scalar s
    N,  # number of elements
    BLOCK: tl.constexpr,
    SKIP_ONE: tl.constexpr,  # s == 1 (plain loss.backward(), in place): nothing is read or written
):
    scale = tl.load(scale_ptr)
    if not SKIP_ONE or scale != 1.0:
        pid = tl.program_id(0).to(tl.int64)
        step = tl.num_programs(0).to(tl.int64) * BLOCK
        for start in range(pid * BLOCK, N, step):
            offs = start + tl.arange(0, BLOCK)  # (BLOCK,) int64: N may exceed 2^31
            mask = offs < N
            vals = tl.load(src_ptr + offs, mask=mask)
            tl.store(out_ptr + offs, (vals.to(tl.float32) * scale).to(out_ptr.dtype.element_ty), mask=mask)


def scale_unless_one_(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """t *= scale in place (t contiguous, float); skipped on the device when scale == 1. Returns t.

    t: any shape, contiguous · scale: one-element float tensor on t's device (read by the kernel)."""
    if not t.is_contiguous():
        raise ValueError(f"scale_unless_one_ needs a contiguous tensor, got strides {t.stride()}")
    scale32 = _device_scale(scale)
    if t.numel():
        _scale_kernel[_grid(t)](t, t, scale32, t.numel(), BLOCK=BLOCK, SKIP_ONE=True)
    return t


def _device_scale(scale: torch.Tensor) -> torch.Tensor:
    """The one-element scale as the kernels read it: fp32, shape (1,)."""
    if scale.numel() != 1:
        raise ValueError(f"scale must hold one element, got shape {tuple(scale.shape)}")
    return scale.reshape(1).to(torch.float32)


def _grid(t: torch.Tensor) -> tuple[int]:
    """Grid-stride programs over t's elements: enough to keep every SM's loads in flight, no more than blocks."""
    return (min(triton.cdiv(t.numel(), BLOCK), sm_count(t.device) * PROGRAMS_PER_SM),)


def scale_into(src: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = src · scale, computed in fp32 and rounded once to out's dtype (bitwise `torch.mul(src, scale,
    out=out)` for an fp32 src and scale). Returns out.

    src, out: the same shape, both contiguous, float, not overlapping · scale: one-element float tensor on src's
    device (read by the kernel: no sync)."""
    if src.shape != out.shape:
        raise ValueError(f"out must have src's shape {tuple(src.shape)}, got {tuple(out.shape)}")
    if not (src.is_contiguous() and out.is_contiguous()):
        raise ValueError(f"scale_into needs contiguous tensors, got strides {src.stride()} and {out.stride()}")
    scale32 = _device_scale(scale)
    if src.numel():
        _scale_kernel[_grid(src)](src, out, scale32, src.numel(), BLOCK=BLOCK, SKIP_ONE=False)
    return out

