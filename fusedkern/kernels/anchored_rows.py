"""Triton: the row kernels around the anchored-exponential logits GEMM (`gluon_anchored_exp`), O(T·H + T·V/256) work.

    target_anchors(x, w, target, ...)  → s_y [T] fp32 (k·x_t·w_y, an fp32 dot) and the anchor a = log2(e)·s_y + A2
                                         (IGNORED where the target is ignored or not a column): before the GEMM
    finish_rows(parts, ...)            → per row, from the partials Σ e of the row's column tiles (merged in a fixed
                                         order, no atomics): S, the loss ℓ = log(S·2^A2) = lse − s_y (log1p of
                                         S·2^A2 − 1, exact to fp32 for a confident row), lse, the entropy from Σ e·arg,
                                         the flag of a row the anchor cannot hold (S ≥ 2^CLAMP2: an element was
                                         clamped), with the producer's max plane the row max k·max_v x·w_v; with a
                                         gradient g_t (∂L/∂ℓ_t): the row scale r_t = k·g_t/S_t, the target's element
                                         of E replaced by 2^-A2 − S_t and x's row scaled, sx = r_t·x_t
    scale_rows(src, r, out)            → out = r ⊙ src (fp32 [C, H] → out's dtype), dX's row scale

Why these are exact: with E[t, v] = exp(s_v − s_y)·2^-A2 (the GEMM's epilogue) and S_t = Σ_v E[t, v] (in fp32,
before E's rounding), softmax(s)_v = E[t, v]/S_t, so r_t·E[t, v] = k·g_t·p_v, and at the target
r_t·(2^-A2 − S_t) = k·g_t·(p_y − 1): r ⊙ E' is ∂L/∂z, and dX = r ⊙ (E'·W), dW = E'ᵀ·(r ⊙ X) need no pass over E.
Flagged and ignored rows get r = 0 (their E row is finite: nothing flows from it) and no fix.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedkern._runtime import interpreting
from fusedkern.kernels.device_math import expm1, log1p

#: the anchor's margin above the target's logit and the clamp of e's exponent, log2 units (`gluon_anchored_exp`):
#: E ≤ 2^CLAMP2, and a row is exact while lse − s_y < (A2 + CLAMP2)·ln 2 (86 nats); 2^A2 and 2^CLAMP2 are exact fp32
#: powers of two
A2, CLAMP2 = 64.0, 60.0
#: the anchor of a row with no target: every e is 2^(−1e30) = 0
IGNORED = 1.0e30
LOG2E, LN2 = 1.4426950408889634, 0.6931471805599453
#: the producer's column tile: one partial per TILE_N columns of a row
TILE_N = 256
#: the producer's epilogue: the main loop alone (a never-true store keeps it), the partial sums only, sums and E
NONE, SUMS, SUMS_AND_E = 0, 1, 2


def part_planes(*, entropy: bool, row_max: bool) -> int:
    """fp32 planes of the producer's partials: Σ e, then Σ e·arg with the entropy, then the tile max of the
    accumulator x·w_v with the row max (the last plane)."""
    return 1 + bool(entropy) + bool(row_max)


def entropy_plane(parts: torch.Tensor, row_max: bool) -> bool:
    """Whether `parts` holds the entropy's plane, from its plane count and whether it holds the row max's."""
    planes = parts.shape[0]
    assert planes in (1 + row_max, 2 + row_max), f"{planes} planes of partials with row_max={row_max}"
    return planes == 2 + row_max


def column_tiles(vocab: int) -> int:
    """Partials per row: one per TILE_N-wide column tile."""
    return -(-vocab // TILE_N)


def e_row_stride(vocab: int) -> int:
    """E's row stride in elements: V rounded up to 8 (TMA needs 16-byte aligned rows; cuBLAS reads the [C, V] view)."""
    return -(-vocab // 8) * 8


def producer_reference(x2d: torch.Tensor, w: torch.Tensor, anchor: torch.Tensor, parts: torch.Tensor,
                       e: torch.Tensor | None, *, logit_scale: float = 1.0, epilogue: int = SUMS_AND_E,
                       row_max: bool = False) -> None:
    """`gluon_anchored_exp.launch` in torch (any device): the same outputs from fp32 logits, exp2 in fp32 with results
    below 2^-126 flushed to 0 as the kernel's ex2.approx.ftz does. What the CPU tests and the GPU probe compare the
    kernel with, and the producer of the pipeline where the kernel cannot run (`fusedkern/anchored.py`). row_max:
    parts' last plane gets each tile's max of the fp32 accumulator x·w_v over its columns below V."""
    (T, _), V = x2d.shape, w.shape[0]
    n = column_tiles(V)
    entropy = entropy_plane(parts, row_max)
    acc = x2d.float() @ w.float().t()
    arg = torch.clamp_max(acc * (logit_scale * LOG2E) - anchor[:, None], CLAMP2)
    val = torch.exp2(arg)
    val = torch.where(val < 2.0 ** -126, 0.0, val)
    pad = n * TILE_N - V
    tiles = torch.nn.functional.pad(val, (0, pad)).view(T, n, TILE_N)
    parts[0, :, :n] = tiles.sum(-1)
    if entropy:
        prod = torch.where(val > 0, val * arg, 0.0)
        parts[1, :, :n] = torch.nn.functional.pad(prod, (0, pad)).view(T, n, TILE_N).sum(-1)
    if row_max:
        padded = torch.nn.functional.pad(acc, (0, pad), value=float("-inf"))
        parts[-1, :, :n] = padded.view(T, n, TILE_N).amax(-1)
    if epilogue == SUMS_AND_E:
        e.copy_(val.to(torch.bfloat16))


@triton.jit
def _target_anchor_kernel(x_ptr, w_ptr, target_ptr, sy_ptr, anchor_ptr, V, H, stride_x, stride_w, ignore_index,
                          logit_scale, A2: tl.constexpr, IGNORED: tl.constexpr, LOG2E: tl.constexpr,
                          BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    y = tl.load(target_ptr + t).to(tl.int64)
    valid = (y != ignore_index) & (y >= 0) & (y < V)
    # an ignored row is anchored on column 0, so its lse is formed too (the chunked strategy gives every row's); an
    # out-of-range target (an error the caller reports) reads column 0 as well, never outside the weight
    anchored = valid | (y == ignore_index)
    y = tl.where(valid, y, 0)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        mask = cols < H
        xv = tl.load(x_ptr + t * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        wv = tl.load(w_ptr + y * stride_w + cols, mask=mask, other=0.0).to(tl.float32)
        acc += xv * wv
    s_y = tl.sum(acc, axis=0) * logit_scale
    tl.store(sy_ptr + t, tl.where(anchored, s_y, 0.0))
    tl.store(anchor_ptr + t, tl.where(anchored, s_y * LOG2E + A2, IGNORED))


def target_anchors(x: torch.Tensor, w: torch.Tensor, target: torch.Tensor, *, ignore_index: int,
                   logit_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(s_y [T] fp32: k·x_t·w_{y_t}, on an ignored row column 0's logit k·x_t·w_0 (its anchor, for its lse), 0 where
    the target is out of range; anchor [T] fp32 in log2 units: log2(e)·s_y + A2, IGNORED where out of range). x [T, H],
    w [V, H] with unit inner stride, target [T]."""
    T, H = x.shape
    assert w.shape[1] == H and x.stride(1) == 1 and w.stride(1) == 1 and target.shape == (T, )
    s_y = torch.empty(T, device=x.device, dtype=torch.float32)
    anchor = torch.empty(T, device=x.device, dtype=torch.float32)
    if T:
        block = min(triton.next_power_of_2(H), 32 if interpreting() else 1024)
        _target_anchor_kernel[(T, )](x, w, target.contiguous(), s_y, anchor, w.shape[0], H, x.stride(0), w.stride(0),
                                     ignore_index, float(logit_scale), A2=A2, IGNORED=IGNORED, LOG2E=LOG2E,
                                     BLOCK_H=block, num_warps=4)
    return s_y, anchor


# the plane offsets are T·P (they follow the token count, as the per-row vectors' alignment does when they are rows
# of [planes, T] buffers): compiled once for every token count, not once per residue of it (a GRPO loop's
# micro-batches score different counts). Each per-row value is read or written one element a row.
@triton.jit(do_not_specialize=["plane_stride", "max_plane_offset"],
            do_not_specialize_on_alignment=["s_y_ptr", "target_ptr", "sum_ptr", "loss_ptr", "lse_ptr", "flag_ptr",
                                            "entropy_ptr", "max_ptr", "grad_ptr", "r_ptr"])
def _finish_rows_kernel(
    part_ptr,  # (planes, C, P) fp32: Σ e per column tile (plane 0), Σ e·arg (plane 1, HAS_ENTROPY), the tile's
    #            max of x·w_v (the last plane, at max_plane_offset; ROW_MAX)
    s_y_ptr, target_ptr,  # (C,) the target's logit k·x·w_y (fp32) and class
    sum_ptr,  # (C,) fp32: S, written (COMPUTE_STATS) or read
    loss_ptr, lse_ptr, flag_ptr, entropy_ptr,  # (C,) out when COMPUTE_STATS: ℓ, lse, int8 flag, entropy
    max_ptr,  # (C,) fp32 out when ROW_MAX: k·max_v x·w_v
    grad_ptr,  # (C,) or (1,) fp32 ∂L/∂ℓ (HAS_GRAD)
    r_ptr,  # (C,) fp32 out: the row scale k·g/S (0 on ignored and flagged rows) (HAS_GRAD)
    e_ptr,  # E [C, *] bf16: the target's element replaced (HAS_GRAD)
    x_ptr, sx_ptr,  # x [C, H] and sx [C, H] = r·x (HAS_SX)
    n_tiles, part_stride, plane_stride, max_plane_offset, V, H, stride_e, stride_x, stride_sx, ignore_index,
    logit_scale, A2: tl.constexpr, CLAMP2: tl.constexpr, LN2: tl.constexpr,
    COMPUTE_STATS: tl.constexpr, HAS_ENTROPY: tl.constexpr, ROW_MAX: tl.constexpr, HAS_GRAD: tl.constexpr,
    PER_TOKEN_GRAD: tl.constexpr, HAS_SX: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    y = tl.load(target_ptr + t).to(tl.int64)
    valid = (y != ignore_index) & (y >= 0) & (y < V)
    if COMPUTE_STATS:
        acc = tl.zeros([BLOCK_P], dtype=tl.float32)
        acc_b = tl.zeros([BLOCK_P], dtype=tl.float32)
        acc_m = tl.full([BLOCK_P], float("-inf"), dtype=tl.float32)
        for p0 in range(0, n_tiles, BLOCK_P):  # fixed order: the same bits on every run
            idx = p0 + tl.arange(0, BLOCK_P)
            mask = idx < n_tiles
            acc += tl.load(part_ptr + t * part_stride + idx, mask=mask, other=0.0)
            if HAS_ENTROPY:
                acc_b += tl.load(part_ptr + plane_stride + t * part_stride + idx, mask=mask, other=0.0)
            if ROW_MAX:  # a max is exact in any order
                acc_m = tl.maximum(acc_m, tl.load(part_ptr + max_plane_offset + t * part_stride + idx, mask=mask,
                                                  other=float("-inf")))
        S = tl.sum(acc, axis=0)
        tl.store(sum_ptr + t, S)
        # ℓ = log Σ_v exp(s_v − s_y) = log1p(S·2^A2 − 1): the 2^A2 scale is exact, and the target's own term is the 1
        # (to the fp32 difference between the GEMM's s_y and the dot's), so a confident row keeps its digits
        u = tl.maximum(S * tl.exp2(A2) - 1.0, 0.0)
        loss = log1p(u)
        # a clamped element alone reaches 2^CLAMP2; NaN is flagged too. An ignored row (anchored on column 0) is
        # flagged as well when the anchor cannot hold it: the exact pass gives its lse
        flagged = (valid | (y == ignore_index)) & ~(S < tl.exp2(CLAMP2))
        ok = valid & ~flagged
        tl.store(loss_ptr + t, tl.where(ok, loss, 0.0))
        tl.store(lse_ptr + t, tl.where((valid | (y == ignore_index)) & ~flagged, tl.load(s_y_ptr + t) + loss, 0.0))
        tl.store(flag_ptr + t, flagged.to(tl.int8))
        if HAS_ENTROPY:
            # H = lse − Σ p·s = ℓ − Σ_v p_v (s_v − s_y), and arg = log2(e)·(s − s_y) − A2
            mean_gap = (tl.sum(acc_b, axis=0) / tl.where(S > 0, S, 1.0) + A2) * LN2
            tl.store(entropy_ptr + t, tl.where(ok, loss - mean_gap, 0.0))
        if ROW_MAX:
            # the max of the accumulator, scaled as the chunked strategy scales its fp32 logits (k > 0): no anchor in
            # it, so it carries the logits' own rounding only; flagged rows get the exact pass's
            tl.store(max_ptr + t, tl.where(ok, tl.max(acc_m, axis=0) * logit_scale, 0.0))
    else:
        S = tl.load(sum_ptr + t)
        ok = valid & (S < tl.exp2(CLAMP2))
    if HAS_GRAD:
        if PER_TOKEN_GRAD:
            g = tl.load(grad_ptr + t)
        else:
            g = tl.load(grad_ptr)
        r = tl.where(ok, logit_scale * g / tl.where(ok, S, 1.0), 0.0)
        tl.store(r_ptr + t, r)
        # E'[t, y] = (p_y − 1)·S/… : r·(2^-A2 − S) = k·g·(p_y − 1)
        safe_y = tl.where(ok, y, 0)
        tl.store(e_ptr + t * stride_e + safe_y, (tl.exp2(-A2) - S).to(e_ptr.dtype.element_ty), mask=ok)
        if HAS_SX:
            for h0 in range(0, H, BLOCK_H):
                cols = h0 + tl.arange(0, BLOCK_H)
                mask = cols < H
                xv = tl.load(x_ptr + t * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
                tl.store(sx_ptr + t * stride_sx + cols, (r * xv).to(sx_ptr.dtype.element_ty), mask=mask)


def finish_rows(parts: torch.Tensor | None, s_y: torch.Tensor, target: torch.Tensor, vocab: int, *, ignore_index: int,
                sums: torch.Tensor, loss: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                flagged: torch.Tensor | None = None, entropy: torch.Tensor | None = None,
                grad: torch.Tensor | None = None, r: torch.Tensor | None = None, e: torch.Tensor | None = None,
                x: torch.Tensor | None = None, sx: torch.Tensor | None = None, logit_scale: float = 1.0,
                row_max: torch.Tensor | None = None) -> None:
    """One program per row of a chunk of C rows (module docstring).

    parts: [planes, C, P] fp32 (the producer's, `part_planes`; None to read `sums` instead, a backward) · s_y,
    target: [C] · sums: [C] fp32, S, written from parts or read · loss, lse, flagged (int8), entropy, row_max: [C]
    outputs when parts are given (entropy needs parts' entropy plane; row_max, k·max_v x·w_v on rows neither ignored
    nor flagged and 0 on those, needs the max plane, parts' last) · grad: None, [1] (shared) or [C] fp32 ∂L/∂ℓ ·
    with grad: r [C] fp32 out, e the chunk's E [C, V] (bf16 view, unit column stride) whose target elements are
    replaced, and x / sx [C, H] to form sx = r ⊙ x (or None)."""
    C = target.shape[0]
    if C == 0:
        return
    compute = parts is not None
    has_entropy = compute and entropy is not None
    has_max = compute and row_max is not None
    assert not compute or (parts.shape[1] == C and parts.stride(2) == 1)
    assert not has_entropy or entropy_plane(parts, has_max)
    assert not has_max or (row_max.shape == (C, ) and row_max.dtype == torch.float32 and parts.shape[0] >= 2)
    assert row_max is None or compute, "the row max is formed from the producer's partials"
    assert not compute or all(t is not None for t in (loss, lse, flagged))
    has_grad = grad is not None
    assert not has_grad or (r is not None and e is not None and e.stride(1) == 1)
    has_sx = has_grad and sx is not None
    assert not has_sx or (x is not None and x.stride(1) == 1 and sx.stride(1) == 1 and x.shape == sx.shape)
    per_token = has_grad and grad.numel() == C and C != 1
    dummy = sums
    H = x.shape[1] if has_sx else 1
    n_tiles = column_tiles(vocab)
    block_h = min(triton.next_power_of_2(H), 32 if interpreting() else 1024)
    block_p = min(triton.next_power_of_2(n_tiles), 16 if interpreting() else 1024)
    _finish_rows_kernel[(C, )](
        parts if compute else dummy, s_y, target, sums, loss if compute else dummy, lse if compute else dummy,
        flagged if compute else dummy, entropy if has_entropy else dummy, row_max if has_max else dummy,
        grad if has_grad else dummy, r if has_grad else dummy, e if has_grad else dummy, x if has_sx else dummy,
        sx if has_sx else dummy, n_tiles, parts.stride(1) if compute else 0, parts.stride(0) if compute else 0,
        (parts.shape[0] - 1) * parts.stride(0) if has_max else 0, vocab, H, e.stride(0) if has_grad else 0,
        x.stride(0) if has_sx else 0, sx.stride(0) if has_sx else 0, ignore_index, float(logit_scale), A2=A2,
        CLAMP2=CLAMP2, LN2=LN2, COMPUTE_STATS=compute, HAS_ENTROPY=has_entropy, ROW_MAX=has_max, HAS_GRAD=has_grad,
        PER_TOKEN_GRAD=per_token, HAS_SX=has_sx, BLOCK_P=block_p, BLOCK_H=block_h, num_warps=4)


@triton.jit
def _entropy_grad_rows_kernel(e_ptr, sum_ptr, loss_ptr, entropy_ptr, target_ptr, grad_ptr, grad_entropy_ptr, V,
                              stride_e, ignore_index, logit_scale, A2: tl.constexpr, CLAMP2: tl.constexpr,
                              LN2: tl.constexpr, BLOCK_V: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    y = tl.load(target_ptr + t).to(tl.int64)
    S = tl.load(sum_ptr + t)
    ok = (y != ignore_index) & (y >= 0) & (y < V) & (S < tl.exp2(CLAMP2))
    loss = tl.load(loss_ptr + t)
    H = tl.load(entropy_ptr + t)
    g = tl.load(grad_ptr + t)
    gh = tl.load(grad_entropy_ptr + t)
    inv_s = 1.0 / tl.where(ok, S, 1.0)
    # log p_v = ln(e_v) − ln S with ln S = ℓ − A2·ln 2 (ℓ = log(S·2^A2)); the target's own p_y = e^−ℓ, p_y − 1 =
    # expm1(−ℓ) exactly (its E element is 2^−A2 only to the GEMM's rounding of s_y)
    log_shift = A2 * LN2 - loss
    p_y = tl.exp(-loss)
    g_y = g * expm1(-loss) - gh * p_y * (H - loss)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        mask = cols < V
        ev = tl.load(e_ptr + t * stride_e + cols, mask=mask, other=0.0).to(tl.float32)
        p = ev * inv_s
        log_p = tl.where(ev > 0, tl.log(tl.where(ev > 0, ev, 1.0)) + log_shift, 0.0)
        gz = tl.where(cols == y, g_y, p * (g - gh * (log_p + H)))
        gz = tl.where(ok, gz * logit_scale, 0.0)
        tl.store(e_ptr + t * stride_e + cols, gz.to(e_ptr.dtype.element_ty), mask=mask)


def entropy_grad_rows(e: torch.Tensor, sums: torch.Tensor, loss: torch.Tensor, entropy: torch.Tensor,
                      target: torch.Tensor, grad: torch.Tensor, grad_entropy: torch.Tensor, *, ignore_index: int,
                      logit_scale: float = 1.0) -> None:
    """E [T, V] (bf16, unit column stride) replaced in place by ∂L/∂z of L = Σ_t g_t·ℓ_t + g^H_t·H_t: k·(g·(p − 1[y])
    − g^H·p·(log p + H)) with p = E/S (E's rounding, as torch's bf16 softmax has its logits'), log p = ln E − ln S;
    0 on ignored and flagged rows (the exact pass forms theirs). sums, loss, entropy: the forward's S, ℓ, H [T] fp32;
    grad, grad_entropy [T] fp32. The entropy's gradient on E: one read and one write of E, no GEMM."""
    T, V = e.shape
    assert e.stride(1) == 1 and all(v.shape == (T, ) for v in (sums, loss, entropy, target, grad, grad_entropy))
    if T:
        block = min(triton.next_power_of_2(V), 64 if interpreting() else 2048)
        _entropy_grad_rows_kernel[(T, )](e, sums, loss, entropy, target, grad, grad_entropy, V, e.stride(0),
                                         ignore_index, float(logit_scale), A2=A2, CLAMP2=CLAMP2, LN2=LN2,
                                         BLOCK_V=block, num_warps=8)


@triton.jit
def _scale_rows_kernel(src_ptr, r_ptr, out_ptr, H, stride_src, stride_out, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    r = tl.load(r_ptr + t)
    v = tl.load(src_ptr + t * stride_src + cols, mask=mask, other=0.0)
    tl.store(out_ptr + t * stride_out + cols, (r * v).to(out_ptr.dtype.element_ty), mask=mask)


def scale_rows(src: torch.Tensor, r: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[t, :] = r[t]·src[t, :] in fp32, rounded once to out's dtype. src [C, H] fp32, r [C] fp32, out [C, H]."""
    C, H = src.shape
    assert out.shape == (C, H) and r.shape == (C, ) and src.stride(1) == 1 and out.stride(1) == 1
    if C and H:
        block = min(triton.next_power_of_2(H), 32 if interpreting() else 1024)
        _scale_rows_kernel[(C, triton.cdiv(H, block))](src, r, out, H, src.stride(0), out.stride(0), BLOCK_H=block,
                                                        num_warps=4)
    return out
