"""Elementwise fp32 math shared by the row kernels (`ce_rows`, `distill_rows`) and the fused kernels
(`fused_ce`): a tanh that also runs in Triton's interpreter (no libdevice there), the softcapped and scaled
logit, and expm1 / log1p without the cancellation of their naive forms, on which the target's p_y − 1 and
the log-sum-exp's log(1 + rest) depend."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def tanh(u, USE_LIBDEVICE: tl.constexpr):
    """tanh in fp32. libdevice on the GPU; in the interpreter (no libdevice there) a series near 0
    and the exp form elsewhere, both accurate to a few ulp of fp32."""
    if USE_LIBDEVICE:
        return libdevice.tanh(u)
    else:
        a = tl.abs(u)
        t = tl.exp(-2.0 * a)
        big = (1.0 - t) / (1.0 + t)
        a2 = a * a
        # Taylor series up to u^9: error < 1e-9 relative for |u| < 0.125, where 1 - t would cancel
        small = a * (1.0 + a2 * (-1.0 / 3.0 + a2 * (2.0 / 15.0 + a2 * (-17.0 / 315.0 + a2 * (62.0 / 2835.0)))))
        r = tl.where(a < 0.125, small, big)
        return tl.where(u < 0, -r, r)


@triton.jit
def softcapped(z, softcap, logit_scale, HAS_SOFTCAP: tl.constexpr, HAS_SCALE: tl.constexpr,
               USE_LIBDEVICE: tl.constexpr):
    """s = softcap(z)·scale in fp32 (scale = 1/τ, a sampling temperature; HAS_SCALE compiles it in)."""
    if HAS_SOFTCAP:
        s = softcap * tanh(z / softcap, USE_LIBDEVICE)
    else:
        s = z
    if HAS_SCALE:
        s = s * logit_scale
    return s


@triton.jit
def expm1(u):
    """exp(u) − 1 in fp32 without the cancellation of the naive form near u = 0 (where p_y → 1 makes
    the target's p_y − 1 lose its digits): a Taylor series for |u| < 0.35 (error < 1e-9 relative),
    exp(u) − 1 beyond (≤ ~3 ulp there). Plain tl ops, the same on the GPU and in the interpreter."""
    series = u * (1.0 + u * (1.0 / 2.0 + u * (1.0 / 6.0 + u * (1.0 / 24.0 + u * (1.0 / 120.0 + u * (
        1.0 / 720.0 + u * (1.0 / 5040.0 + u * (1.0 / 40320.0))))))))
    return tl.where(tl.abs(u) < 0.35, series, tl.exp(u) - 1.0)


@triton.jit
def log1p(x):
    """log(1 + x) in fp32 for x ≥ 0, accurate where 1 + x rounds (Goldberg's trick: the rounding of
    1 + x is divided back out)."""
    u = 1.0 + x
    rounded = tl.where(u == 1.0, 1.0, u - 1.0)  # never 0: no 0/0 in the branch that is not taken
    return tl.where(u == 1.0, x, tl.log(u) * (x / rounded))
