"""Row kernel of the distillation loss: per token, the divergence between the student's and the teacher's
softmax(z / τ) over a chunk of both models' logits, and ∂L/∂z_student written over the student's logits.

Each model's logit z is its head's output after its logit scale and final softcap (TRL's order), computed here.
One program per row walks the vocabulary in BLOCK_V blocks: pass 1 keeps per-lane online (max, Σ exp) of
s = z_s/τ, u = z_t/τ (and of z_s itself for the hard-label cross-entropy), pass 2 sums the divergence from
exact log-probabilities (and the student's expectation R that its gradient needs), pass 3 overwrites the
student's row with the gradient. Forward KL needs no R: its gradient p − q is written in pass 2.
Trade-off: each row is read two or three times (the two GEMMs per chunk cost ~2·H/elt times more per element at
H = 4096) in exchange for exact log-probabilities in every term: the divergence is summed as Σ q (log q − log p)
rather than from moments (Σ q u − lse), which would cancel when student and teacher agree. Math: docs/design.md.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from fusedkern._runtime import interpreting
from fusedkern.kernels.device_math import log1p, tanh

FORWARD_KL, REVERSE_KL, JSD = 0, 1, 2
BLOCK_V = 32 if interpreting() else 2048  # the interpreter: a small block keeps the masked tail exercised


def divergence_mode(beta: float) -> int:
    """TRL's `generalized_jsd_loss` convention: β = 0 is KL(teacher‖student), β = 1 KL(student‖teacher),
    anything between the generalized JSD with mixture m = (1 − β)·p_student + β·p_teacher."""
    return FORWARD_KL if beta == 0.0 else REVERSE_KL if beta == 1.0 else JSD


@triton.jit
def _model_logit(h, scale, softcap, HAS_SOFTCAP: tl.constexpr, USE_LIBDEVICE: tl.constexpr):
    """The model's logit from the head's output h, in TRL's order: h·scale (Cohere's logit_scale), then
    softcap·tanh(·/softcap) (Gemma's final softcap). The temperature divides the result."""
    u = h * scale
    if HAS_SOFTCAP:
        u = softcap * tanh(u / softcap, USE_LIBDEVICE)
    return u


@triton.jit
def _model_logit_slope(z, scale, softcap, HAS_SOFTCAP: tl.constexpr):
    """∂z/∂h at the model's logit z = `_model_logit(h)`: scale·(1 − (z/softcap)²)."""
    if HAS_SOFTCAP:
        r = z / softcap
        return scale * (1.0 - r * r)
    else:
        return scale


@triton.jit
def _online(m, d, x, mask):
    """One step of a per-lane online (max m, Σ exp(x − m)); x = −inf (and masked lanes) carry no mass."""
    m_new = tl.where(mask, tl.maximum(m, x), m)
    scale = tl.where(m_new == -float("inf"), 1.0, tl.exp(m - m_new))
    add = tl.where(mask & (x != -float("inf")), tl.exp(x - m_new), 0.0)
    return m_new, d * scale + add


@triton.jit
def _max_logsum(m, d):
    """(max, log Σ exp(x − max)) over the lanes' (m, d), kept apart: log p = (x − max) − logsum keeps fp32's
    precision where max + logsum would round to an ulp of the max (6e-5 at |x| ~ 10³)."""
    mx = tl.max(m, axis=0)
    total = tl.sum(tl.where(m == -float("inf"), 0.0, d * tl.exp(m - mx)), axis=0)
    return mx, tl.log(total)


@triton.jit
def _xlogy_diff(p, a, b):
    """p·(a − b), 0 where p = 0 (a class one distribution does not reach adds nothing, even at a = −inf)."""
    return tl.where(p == 0.0, 0.0, p * (a - b))


@triton.jit
def _log_mixture(lp, lq, log_1m_beta, log_beta):
    """log((1 − β)e^lp + β e^lq) without overflow: max + log1p(e^−|a − b|); −inf when both are."""
    a = lp + log_1m_beta
    b = lq + log_beta
    mx = tl.maximum(a, b)
    mn = tl.minimum(a, b)
    return tl.where(mx == -float("inf"), -float("inf"), mx + log1p(tl.exp(mn - mx)))


@triton.jit
def _row_logprobs(zs_row, zt_row, cols, mask, inv_temperature, max_s, logsum_s, max_t, logsum_t,
                  s_scale, s_softcap, t_scale, t_softcap, S_SOFTCAP: tl.constexpr, T_SOFTCAP: tl.constexpr,
                  USE_LIBDEVICE: tl.constexpr):
    """At `cols` of a row: the student's logit z and the log-probabilities log p (student) and log q (teacher)
    at temperature τ, from each model's max and log-sum of pass 1."""
    z = _model_logit(tl.load(zs_row + cols, mask=mask, other=0.0).to(tl.float32), s_scale, s_softcap, S_SOFTCAP,
                     USE_LIBDEVICE)
    lp = (z * inv_temperature - max_s) - logsum_s
    u = _model_logit(tl.load(zt_row + cols, mask=mask, other=0.0).to(tl.float32), t_scale, t_softcap, T_SOFTCAP,
                     USE_LIBDEVICE)
    lq = (u * inv_temperature - max_t) - logsum_t
    return z, lp, lq


@triton.jit
def _distill_rows_kernel(
    # pointers
    zs_ptr,  # (C, V) student dtype. In: student logits. Out (WRITE_GRAD): ∂L/∂z_student, in place
    zt_ptr,  # (C, V) teacher dtype, read only
    target_ptr,  # (C,) class indices (HAS_TARGET)
    loss_ptr,  # (C,) fp32 out: w_soft·D + w_hard·CE per token, 0 where ignored
    entropy_ptr,  # (C,) fp32 out (HAS_ENTROPY): the student's entropy −Σ p log p at τ, 0 where ignored
    grad_ptr,  # (1,) or (C,) fp32: ∂L/∂ℓ_t shared by every row, or per row (PER_TOKEN_GRAD)
    # shapes and strides
    V, stride_s, stride_t,
    # options
    inv_temperature, beta, log_beta, log_1m_beta, one_m_beta, weight_soft, weight_hard, ignore_index,
    s_scale, s_softcap, t_scale, t_softcap,  # each model's logit_scale and final softcap (`_model_logit`)
    # meta-parameters
    MODE: tl.constexpr, HAS_TARGET: tl.constexpr, HAS_HARD: tl.constexpr, WRITE_GRAD: tl.constexpr,
    PER_TOKEN_GRAD: tl.constexpr, HAS_ENTROPY: tl.constexpr, S_SOFTCAP: tl.constexpr, T_SOFTCAP: tl.constexpr,
    USE_LIBDEVICE: tl.constexpr, BLOCK_V: tl.constexpr,
):
    # int64: row · stride reaches 32768 · 128256 > 2^31 for a big chunk
    row = tl.program_id(0).to(tl.int64)
    zs_row = zs_ptr + row * stride_s
    zt_row = zt_ptr + row * stride_t
    offs = tl.arange(0, BLOCK_V)  # (BLOCK_V,)
    y = 0
    if HAS_TARGET:
        y_raw = tl.load(target_ptr + row).to(tl.int64)
        if y_raw == ignore_index:  # an ignored row: no loss, no gradient
            tl.store(loss_ptr + row, 0.0)
            if HAS_ENTROPY:
                tl.store(entropy_ptr + row, 0.0)
            if WRITE_GRAD:
                for start in range(0, V, BLOCK_V):
                    cols = start + offs
                    tl.store(zs_row + cols, tl.zeros((BLOCK_V,), tl.float32).to(zs_ptr.dtype.element_ty),
                             mask=cols < V)
            return
        # an out-of-range target reads column 0: the caller's pending range check raises before returning
        y = tl.where((y_raw >= 0) & (y_raw < V), y_raw, 0)
    # 1. online (max, Σ exp) per lane of s = z_s/τ, u = z_t/τ and (hard label) z_s, z the models' logits
    m_s = tl.full((BLOCK_V,), -float("inf"), tl.float32)
    d_s = tl.zeros((BLOCK_V,), tl.float32)
    m_t = tl.full((BLOCK_V,), -float("inf"), tl.float32)
    d_t = tl.zeros((BLOCK_V,), tl.float32)
    m_z = tl.full((BLOCK_V,), -float("inf"), tl.float32)
    d_z = tl.zeros((BLOCK_V,), tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        mask = cols < V
        z = _model_logit(tl.load(zs_row + cols, mask=mask, other=0.0).to(tl.float32), s_scale, s_softcap,
                         S_SOFTCAP, USE_LIBDEVICE)
        u = _model_logit(tl.load(zt_row + cols, mask=mask, other=0.0).to(tl.float32), t_scale, t_softcap,
                         T_SOFTCAP, USE_LIBDEVICE) * inv_temperature
        m_s, d_s = _online(m_s, d_s, z * inv_temperature, mask)
        m_t, d_t = _online(m_t, d_t, u, mask)
        if HAS_HARD:
            m_z, d_z = _online(m_z, d_z, z, mask)
    max_s, logsum_s = _max_logsum(m_s, d_s)
    max_t, logsum_t = _max_logsum(m_t, d_t)
    if HAS_HARD:
        # before pass 2 may overwrite the row (forward KL)
        z_y = _model_logit(tl.load(zs_row + y).to(tl.float32), s_scale, s_softcap, S_SOFTCAP, USE_LIBDEVICE)
        max_z, logsum_z = _max_logsum(m_z, d_z)
    # 2. the divergence from exact log-probabilities, and R = Σ p (log p − log m) for the JSD's gradient
    div = tl.zeros((BLOCK_V,), tl.float32)
    r_lane = tl.zeros((BLOCK_V,), tl.float32)
    ent_lane = tl.zeros((BLOCK_V,), tl.float32)
    g_row = tl.load(grad_ptr + row) if PER_TOKEN_GRAD else tl.load(grad_ptr)
    soft_scale = g_row * weight_soft * inv_temperature  # ∂L/∂s → ∂L/∂z_s: the 1/τ of s = z_s/τ
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        mask = cols < V
        z, lp, lq = _row_logprobs(zs_row, zt_row, cols, mask, inv_temperature, max_s, logsum_s, max_t, logsum_t,
                                  s_scale, s_softcap, t_scale, t_softcap, S_SOFTCAP, T_SOFTCAP, USE_LIBDEVICE)
        p = tl.exp(lp)
        q = tl.exp(lq)
        if HAS_ENTROPY:
            ent_lane += tl.where(mask & (p != 0.0), -p * lp, 0.0)
        if MODE == 0:  # KL(q‖p)
            div += tl.where(mask, _xlogy_diff(q, lq, lp), 0.0)
            if WRITE_GRAD:
                g = soft_scale * (p - q)
                if HAS_HARD:
                    g += g_row * weight_hard * (tl.exp((z - max_z) - logsum_z) - tl.where(cols == y, 1.0, 0.0))
                g = g * _model_logit_slope(z, s_scale, s_softcap, S_SOFTCAP)  # chain rule: z = f(head output)
                tl.store(zs_row + cols, g.to(zs_ptr.dtype.element_ty), mask=mask)
        elif MODE == 1:  # KL(p‖q)
            div += tl.where(mask, _xlogy_diff(p, lp, lq), 0.0)
        else:  # β KL(q‖m) + (1 − β) KL(p‖m)
            lm = _log_mixture(lp, lq, log_1m_beta, log_beta)
            kl_p = _xlogy_diff(p, lp, lm)
            div += tl.where(mask, beta * _xlogy_diff(q, lq, lm) + one_m_beta * kl_p, 0.0)
            r_lane += tl.where(mask, kl_p, 0.0)
    div_row = tl.sum(div, axis=0)
    r_row = tl.sum(r_lane, axis=0)
    loss = weight_soft * div_row
    if HAS_HARD:
        loss += weight_hard * ((max_z - z_y) + logsum_z)
    tl.store(loss_ptr + row, loss)
    if HAS_ENTROPY:
        tl.store(entropy_ptr + row, tl.sum(ent_lane, axis=0))
    # 3. ∂D/∂s_v = p_v (c_v − Σ p c) with c = log p − log q (reverse KL) or (1 − β)(log p − log m) (JSD);
    # pass 2 has read every column of the row, so overwriting it now is safe
    if WRITE_GRAD and MODE != 0:
        for start in range(0, V, BLOCK_V):
            cols = start + offs
            mask = cols < V
            z, lp, lq = _row_logprobs(zs_row, zt_row, cols, mask, inv_temperature, max_s, logsum_s, max_t,
                                      logsum_t, s_scale, s_softcap, t_scale, t_softcap, S_SOFTCAP, T_SOFTCAP,
                                      USE_LIBDEVICE)
            p = tl.exp(lp)
            # p·((log p − log x) − Σ): the difference of two O(1) logs first, then one product
            if MODE == 1:
                gs = tl.where(p == 0.0, 0.0, p * ((lp - lq) - div_row))
            else:
                lm = _log_mixture(lp, lq, log_1m_beta, log_beta)
                gs = one_m_beta * tl.where(p == 0.0, 0.0, p * ((lp - lm) - r_row))
            g = soft_scale * gs
            if HAS_HARD:
                g += g_row * weight_hard * (tl.exp((z - max_z) - logsum_z) - tl.where(cols == y, 1.0, 0.0))
            g = g * _model_logit_slope(z, s_scale, s_softcap, S_SOFTCAP)  # chain rule: z = f(head output)
            tl.store(zs_row + cols, g.to(zs_ptr.dtype.element_ty), mask=mask)


def distill_rows(zs: torch.Tensor, zt: torch.Tensor, target: torch.Tensor | None, loss: torch.Tensor,
                 grad: torch.Tensor | None, *, beta: float, temperature: float, weight_soft: float,
                 weight_hard: float, ignore_index: int, per_token_grad: bool = False, student_logit_scale: float = 1.0,
                 student_softcap: float | None = None, teacher_logit_scale: float = 1.0,
                 teacher_softcap: float | None = None, entropy: torch.Tensor | None = None) -> None:
    """Per-token loss of a chunk into `loss` [C] fp32 and, when `grad` is given, ∂L/∂z_student over `zs`.

    zs [C, V] student logits (overwritten with the gradient when `grad` is given) · zt [C, V] teacher
    logits · target [C] or None (every row counts; no hard-label term then) · grad: [1] fp32 ∂L/∂ℓ_t shared
    by every row, or [C] per row with `per_token_grad`. ℓ_t = weight_soft·D_β(τ) + weight_hard·CE(z_s, y), on
    each model's logits `_model_logit(head output)` (its logit scale, then its softcap). entropy: a [C] fp32
    buffer for the student's entropy at τ (TRL's DistillationTrainer logs it), or None (compiled out)."""
    C, V = zs.shape
    assert zt.shape == (C, V) and zs.stride(1) == 1 and zt.stride(1) == 1
    mode = divergence_mode(beta)
    has_hard = weight_hard != 0.0
    assert target is not None or not has_hard
    _distill_rows_kernel[(C,)](
        zs, zt, loss if target is None else target, loss, loss if entropy is None else entropy,
        loss if grad is None else grad,
        V, zs.stride(0), zt.stride(0),
        1.0 / temperature, beta, math.log(beta) if beta > 0 else 0.0, math.log1p(-beta) if beta < 1 else 0.0,
        1.0 - beta,
        weight_soft, weight_hard, ignore_index,
        student_logit_scale, student_softcap or 1.0, teacher_logit_scale, teacher_softcap or 1.0,
        MODE=mode, HAS_TARGET=target is not None, HAS_HARD=has_hard, WRITE_GRAD=grad is not None,
        PER_TOKEN_GRAD=per_token_grad, HAS_ENTROPY=entropy is not None, S_SOFTCAP=student_softcap is not None,
        T_SOFTCAP=teacher_softcap is not None, USE_LIBDEVICE=not interpreting(), BLOCK_V=BLOCK_V,
        num_warps=1 if interpreting() else 8,
    )
