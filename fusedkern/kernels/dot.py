"""Device helpers shared by the Triton GEMM kernels (`fused_ce`, `rowcount_gemm`).

Triton's interpreter computes `tl.dot` on bf16 operands wrongly (values off by 1e9): there the operands
are widened to fp32 first, which gives the same products (bf16 × bf16 and fp16 × fp16 are exact in
fp32) with fp32 accumulation, as the tensor cores do. The GPU path is untouched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedkern._runtime import interpreting

WIDEN_DOT_OPERANDS = tl.constexpr(interpreting())


@triton.jit
def dot_fp32_acc(a, b, acc, DOT_PRECISION: tl.constexpr):
    """acc + a @ b with fp32 accumulation; operands widened to fp32 in the interpreter."""
    if WIDEN_DOT_OPERANDS:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


def dot_precision(dtype: torch.dtype) -> str:
    """`dot_fp32_acc`'s DOT_PRECISION for operands of `dtype`: exact fp32 products for fp32 operands, like
    torch's default (TF32 off for matmuls); "tf32" means nothing to 16-bit operands."""
    return "ieee" if dtype == torch.float32 else "tf32"
