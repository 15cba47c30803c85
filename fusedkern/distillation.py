"""`linear_distillation_loss`: a student's LM head distilled from a teacher's (forward KL, reverse KL or
generalized JSD at a temperature, optionally mixed with the hard-label cross-entropy) without either model's
[tokens, V] logits — the public function, its `nn.Module`, the chunk loop and its custom operators.

The chunked strategy of `chunked.py`, with a second logits GEMM: per chunk of C tokens, Z_s = X_s W_sᵀ and
Z_t = X_t W_tᵀ into two reused [C, V] buffers, `kernels.distill_rows` writes each token's loss and
overwrites Z_s with G = ∂L/∂Z_s, then dX_s = G W_s and dW_s (+)= Gᵀ X_s (fp32 accumulator as `chunked.py`).
Four GEMMs in all for mean/sum (the upstream gradient per token is known in the forward; the backward only
rescales); reduction "none" recomputes both logits in backward (six). The teacher gets no gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fusedkern._validation import (
    FLOAT_DTYPES,
    REDUCTIONS,
    check_choice,
    check_int,
    check_kernel_device,
    check_real,
    check_same_device,
    check_same_dtype,
    check_shape,
    check_tensor,
    check_target_type,
    finish_checks,
    normalize_count,
    start_checks,
    validate_strategy,
)
from fusedkern.autograd import (
    CHECKING_OP_TAGS,
    GradOptions,
    absent,
    cast_or_none,
    define_op,
    fake_grads,
    grads_formed_in_forward,
    or_absent,
    with_grads,
)
from fusedkern.chunk_plan import (
    CHUNK_MULTIPLE,
    GRAD_CHUNK_BUDGET_BYTES,
    LOSS_CHUNK_BUDGET_BYTES,
    GradChunkPlan,
    chunk_rows,
)
from fusedkern import engine
from fusedkern.engine import Chunk, Grads, logits_buffer, logits_into, plan_for_grads, token_chunks, valid_rows_first
from fusedkern.sharded import full_weights
from fusedkern.kernels.distill_rows import distill_rows


@dataclass(frozen=True)
class DistillOptions:
    """ℓ_t = weight_soft_loss·D_β(softmax(z_s/τ) ‖ softmax(z_t/τ)) + weight_hard_loss·CE(z_s, y_t); each model's
    logits z = softcap·tanh(h·logit_scale/softcap) of its head's output h (TRL DistillationTrainer's order)."""

    beta: float = 0.5
    temperature: float = 1.0
    ignore_index: int = -100
    weight_hard_loss: float = 0.0
    weight_soft_loss: float = 1.0
    student_logit_scale: float = 1.0
    student_softcap: float | None = None
    teacher_logit_scale: float = 1.0
    teacher_softcap: float | None = None


# ----------------------------------------------------------------------------------------------
# the chunk loop


def distill_plan(n_tokens: int, ws: torch.Tensor, wt: torch.Tensor, need_dw: bool, weight_grad_accum: str,
                 chunk_tokens: int | None) -> GradChunkPlan:
    """`chunked.plan_for_grads` for the student, with C sized for two [C, V] buffers, the student's and the
    teacher's. With fp32 accumulation of a bf16/fp16 dW (teacher in the same dtype): one chunk of every token when
    both buffers fit the accumulator's allowance (2·T·V·e ≤ 256 MiB + V·H·4: one dW GEMM, no accumulator), else both
    buffers in dW's own storage (idle until the accumulator is cast into it): C = H/2 tokens at no memory beyond the
    accumulator (`shares_dw_storage`). Otherwise C is capped so that the teacher's buffer stays within the 256 MiB
    logits budget."""
    plan = plan_for_grads(n_tokens, ws, need_dw, weight_grad_accum, chunk_tokens)
    if chunk_tokens:
        return plan
    (V, H), e = ws.shape, ws.element_size()
    if need_dw and weight_grad_accum == "fp32" and ws.dtype != torch.float32 and wt.dtype == ws.dtype:
        if 2 * n_tokens * V * e <= GRAD_CHUNK_BUDGET_BYTES + V * H * 4:
            return plan_for_grads(n_tokens, ws, need_dw, weight_grad_accum, n_tokens)
        half = H // 2 // CHUNK_MULTIPLE * CHUNK_MULTIPLE
        if half:
            shared = plan_for_grads(n_tokens, ws, need_dw, weight_grad_accum, half)
            if shares_dw_storage(shared, ws):
                return shared
    cap = chunk_rows(n_tokens, wt.shape[0], wt.element_size(), GRAD_CHUNK_BUDGET_BYTES)
    return plan if plan.chunk_tokens <= cap else plan_for_grads(n_tokens, ws, need_dw, weight_grad_accum, cap)


def shares_dw_storage(plan: GradChunkPlan, ws: torch.Tensor) -> bool:
    """Whether both [C, V] logits buffers fit dW's own storage (V·H elements) under an fp32 accumulator."""
    return plan.fp32_accumulator and 2 * plan.chunk_tokens * ws.shape[0] <= ws.numel()


class DistillRows:
    """The engine's row pass of distillation: the teacher's logits GEMM for the chunk's rows into its own buffer,
    then `kernels.distill_rows` (each token's loss, and with grad the student's ∂L/∂Z_s in place)."""

    def __init__(self, xt, wt, bt, target, opts: DistillOptions, buf_t: torch.Tensor, *, loss_tok, grad,
                 per_token_grad: bool, entropy=None):
        self.xt, self.wt, self.bt, self.target, self.opts, self.buf_t = xt, wt, bt, target, opts, buf_t
        self.loss_tok, self.grad, self.per_token_grad, self.entropy = loss_tok, grad, per_token_grad, entropy

    def __call__(self, zs, xs_c, chunk: Chunk) -> None:
        r, opts = chunk.rows, self.opts
        zt = logits_into(self.buf_t, self.xt[r], self.wt, self.bt)
        grad = None if self.grad is None else (self.grad[r] if self.per_token_grad else self.grad)
        distill_rows(zs, zt, None if self.target is None else self.target[r], self.loss_tok[r], grad,
                     beta=opts.beta, temperature=opts.temperature, weight_soft=opts.weight_soft_loss,
                     weight_hard=opts.weight_hard_loss, ignore_index=opts.ignore_index,
                     per_token_grad=self.per_token_grad, student_logit_scale=opts.student_logit_scale,
                     student_softcap=opts.student_softcap, teacher_logit_scale=opts.teacher_logit_scale,
                     teacher_softcap=opts.teacher_softcap, entropy=None if self.entropy is None else self.entropy[r])


def _run_chunks(xs, ws, bs, xt, wt, bt, target, opts: DistillOptions, C: int, *, loss_tok, grad,
                per_token_grad: bool, grads: Grads | None = None, entropy=None) -> None:
    """The engine's loop with the distillation row pass over chunks of C tokens (with grad: the student's
    gradients into `grads`). Both logits buffers sit in dW's own storage when the plan says so
    (`shares_dw_storage`), the student's first."""
    rows, V = min(C, xs.shape[0]), ws.shape[0]
    buf_s = buf_t = None
    if grads is not None and grads.dw_out is not None and shares_dw_storage(grads.plan, ws):
        flat = grads.dw_out.view(-1)
        buf_s, buf_t = flat[: rows * V].view(rows, V), flat[rows * V: 2 * rows * V].view(rows, V)
    row_pass = DistillRows(xt, wt, bt, target, opts, logits_buffer(rows, V, xt) if buf_t is None else buf_t,
                           loss_tok=loss_tok, grad=grad, per_token_grad=per_token_grad, entropy=entropy)
    engine.run(xs, ws, bs, token_chunks(xs.shape[0], C), row_pass, grads=grads, buffer=buf_s)


def clamped_mean_divisor(target: torch.Tensor | None, n_tokens: int, ignore_index: int) -> torch.Tensor | float:
    """The mean's divisor: the rows whose target is not ignored, at least 1 (TRL's clamp: all ignored gives
    a loss of 0, not NaN), or every row without a target."""
    if target is None:
        return float(max(n_tokens, 1))
    return (target != ignore_index).sum(dtype=torch.float32).clamp_(min=1.0)


# ----------------------------------------------------------------------------------------------
# custom operators (`autograd.define_op`; see `linear_cross_entropy.py` for the pattern: fake implementation +
# autograd formula, options in one frozen dataclass per operator)


@dataclass(frozen=True)
class DistillScalarOptions:
    """`distill_scalar`'s options: the loss, its reduction ("mean"/"sum"), the student's gradients (`GradOptions`), a
    host count to check (`count_int`, -1: none) and whether the student's entropy is formed."""

    loss: DistillOptions
    reduction: str
    grads: GradOptions
    count_int: int = -1
    with_entropy: bool = False


@dataclass(frozen=True)
class DistillPerTokenOptions:
    """`distill_per_token`'s and `distill_per_token_backward`'s options: the loss, the chunks and gradients
    (`GradOptions`: none asked for in the forward; `chunk_tokens` None: the loss-only budget forward, the backward's
    plan), a host count to check (`count_int`, -1: none) and whether the student's entropy is formed."""

    loss: DistillOptions
    grads: GradOptions
    count_int: int = -1
    with_entropy: bool = False


DISTILL_TENSORS = ["xs", "ws", "bs?", "xt", "wt", "bt?", "target?"]


def _distill_scalar(xs: torch.Tensor, ws: torch.Tensor, bs: torch.Tensor | None, xt: torch.Tensor, wt: torch.Tensor,
                    bt: torch.Tensor | None, target: torch.Tensor | None, check_target: torch.Tensor | None,
                    count: torch.Tensor | None, o: DistillScalarOptions
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """mean/sum with gradients: loss and the student's gradients in one pass (four GEMMs). Returns (loss 0-d
    fp32, entropy [T] fp32 (with_entropy; else [0]), dx, dw (fp32 accumulator or dW), db fp32, dw_out) as
    `linear_cross_entropy._chunked_scalar`."""
    ignore_index = o.loss.ignore_index
    checks = [] if target is None else start_checks(target, ws.shape[0], ignore_index, check_target, count,
                                                    o.count_int)
    T = xs.shape[0]
    if o.reduction == "mean":
        grad_scale = (1.0 / torch.as_tensor(clamped_mean_divisor(target, T, ignore_index), device=xs.device,
                                            dtype=torch.float32)).reshape(1)
    else:
        grad_scale = torch.ones(1, device=xs.device, dtype=torch.float32)
    g = o.grads
    plan = distill_plan(T, ws, wt, g.need_dw, g.weight_grad_accum, g.chunk_tokens)
    loss_tok = torch.empty(T, device=xs.device, dtype=torch.float32)
    entropy = torch.empty(T if o.with_entropy else 0, device=xs.device, dtype=torch.float32)
    grads = Grads.allocate(xs, ws, bs, g.need_dx, g.need_dw, g.need_db, plan)
    _run_chunks(xs, ws, bs, xt, wt, bt, target, o.loss, plan.chunk_tokens, loss_tok=loss_tok, grad=grad_scale,
                per_token_grad=False, grads=grads, entropy=entropy if o.with_entropy else None)
    dx, dw, db, dw_out = grads.as_tuple()
    loss = loss_tok.sum() * grad_scale[0] if o.reduction == "mean" else loss_tok.sum()
    finish_checks(checks)
    return (loss, entropy, *g.outputs(xs, ws, dx, dw, db, dw_out))


def _fake_distill_scalar(xs, ws, bs, xt, wt, bt, target, check_target, count, o: DistillScalarOptions):
    T, g = xs.shape[0], o.grads
    fp32_accumulator = distill_plan(T, ws, wt, g.need_dw, g.weight_grad_accum, g.chunk_tokens).fp32_accumulator
    f32 = torch.float32
    return (xs.new_empty((), dtype=f32), xs.new_empty((T if o.with_entropy else 0,), dtype=f32),
            *g.fake_outputs(xs, ws, T, fp32_accumulator, g.need_db))


distill_scalar = define_op("fusedkern::distill_scalar", [*DISTILL_TENSORS, "check_target?", "count?"],
                           DistillScalarOptions, 6, _distill_scalar, _fake_distill_scalar,
                           *grads_formed_in_forward("linear_distillation_loss (mean/sum)"), tags=CHECKING_OP_TAGS)


def _distill_per_token(xs: torch.Tensor, ws: torch.Tensor, bs: torch.Tensor | None, xt: torch.Tensor,
                       wt: torch.Tensor, bt: torch.Tensor | None, target: torch.Tensor | None,
                       check_target: torch.Tensor | None, count: torch.Tensor | None, o: DistillPerTokenOptions
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token loss ℓ_t [T] fp32, the student's entropy [T] fp32 (with_entropy; else [0])), no gradient
    formed: chunks whose two buffers fit the 64 MiB loss-only budget each (or `chunk_tokens`). The backward
    recomputes both logits and accepts any ∂L/∂ℓ_t."""
    checks = [] if target is None else start_checks(target, ws.shape[0], o.loss.ignore_index, check_target, count,
                                                    o.count_int)
    T, V = xs.shape[0], ws.shape[0]
    C = o.grads.chunk_tokens or chunk_rows(T, V, max(xs.element_size(), xt.element_size()), LOSS_CHUNK_BUDGET_BYTES)
    loss_tok = torch.empty(T, device=xs.device, dtype=torch.float32)
    entropy = torch.empty(T if o.with_entropy else 0, device=xs.device, dtype=torch.float32)
    _run_chunks(xs, ws, bs, xt, wt, bt, target, o.loss, C, loss_tok=loss_tok, grad=None, per_token_grad=False,
                entropy=entropy if o.with_entropy else None)
    finish_checks(checks)
    return loss_tok, entropy


def _fake_distill_per_token(xs, ws, bs, xt, wt, bt, target, check_target, count, o: DistillPerTokenOptions):
    T = xs.shape[0]
    return xs.new_empty((T,), dtype=torch.float32), xs.new_empty((T if o.with_entropy else 0,), dtype=torch.float32)


def _setup_distill_per_token(ctx, tensors, o: DistillPerTokenOptions, output):
    ctx.save_for_backward(*tensors[:7])
    ctx.options = o
    ctx.mark_non_differentiable(output[1])


def _backward_distill_per_token(ctx, grad_loss_tok, _grad_entropy):
    xs, ws, bs, xt, wt, bt, target = ctx.saved_tensors
    need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
    need_db = need_db and bs is not None
    dx, dw, db = distill_per_token_backward(xs, ws, bs, xt, wt, bt, target, grad_loss_tok.float().contiguous(),
                                            with_grads(ctx.options, need_dx, need_dw, need_db))
    return dx if need_dx else None, dw if need_dw else None, db if need_db else None


def _distill_per_token_backward(xs: torch.Tensor, ws: torch.Tensor, bs: torch.Tensor | None, xt: torch.Tensor,
                                wt: torch.Tensor, bt: torch.Tensor | None, target: torch.Tensor | None,
                                grad_tok: torch.Tensor, o: DistillPerTokenOptions
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of Σ_t grad_tok[t]·ℓ_t with both logits recomputed: (dx, dw, db) in the student's dtypes."""
    g = o.grads
    plan = distill_plan(xs.shape[0], ws, wt, g.need_dw, g.weight_grad_accum, g.chunk_tokens)
    grads = Grads.allocate(xs, ws, bs, g.need_dx, g.need_dw, g.need_db, plan)
    loss_tok = torch.empty(xs.shape[0], device=xs.device, dtype=torch.float32)
    _run_chunks(xs, ws, bs, xt, wt, bt, target, o.loss, plan.chunk_tokens, loss_tok=loss_tok, grad=grad_tok,
                per_token_grad=True, grads=grads)
    dx, dw, db = grads.dx, grads.weight_grad(), grads.db
    return (or_absent(cast_or_none(dx, xs.dtype), xs), or_absent(cast_or_none(dw, ws.dtype), ws),
            absent(ws) if db is None else db.to(bs.dtype))


distill_per_token = define_op("fusedkern::distill_per_token", [*DISTILL_TENSORS, "check_target?", "count?"],
                              DistillPerTokenOptions, 2, _distill_per_token, _fake_distill_per_token,
                              _setup_distill_per_token, _backward_distill_per_token, tags=CHECKING_OP_TAGS)
distill_per_token_backward = define_op("fusedkern::distill_per_token_backward", [*DISTILL_TENSORS, "grad_tok"],
                                       DistillPerTokenOptions, 3, _distill_per_token_backward,
                                       lambda xs, ws, bs, xt, wt, bt, target, grad_tok, o: fake_grads(xs, ws, bs,
                                                                                                      o.grads))


# ----------------------------------------------------------------------------------------------
# validation and dispatch


# "batchmean": TRL's `generalized_jsd_loss` reduction (and torch's `kl_div`): the sum over the batch's first
# dimension, not over its rows; see `batchmean_divisor`
DISTILL_REDUCTIONS = (*REDUCTIONS, "batchmean")


def batchmean_divisor(lead_shape: torch.Size, has_target: bool) -> int | None:
    """The divisor of the "sum" that gives TRL's `generalized_jsd_loss(..., reduction="batchmean")`: without
    labels TRL divides by the logits' first dimension, the batch size B of [B, S, V] (at least 1; 1 for a single
    row); with labels it first keeps the labelled rows, and divides by their count (at least 1): "mean" here, so
    None."""
    if has_target:
        return None
    return max(lead_shape[0], 1) if len(lead_shape) else 1


def validate_distillation_options(*, beta, temperature, ignore_index, reduction, weight_hard_loss, weight_soft_loss,
                                  student_logit_scale=1.0, student_softcap=None, teacher_logit_scale=1.0,
                                  teacher_softcap=None, weight_grad_accum="fp32", chunk_tokens=None) -> None:
    """The settings that do not depend on the call's tensors (checked again by `LinearDistillationLoss`)."""
    check_real("beta", beta, low=0.0, high=1.0)
    for side in ("student", "teacher"):
        scale, softcap = (student_logit_scale, student_softcap) if side == "student" else (teacher_logit_scale,
                                                                                            teacher_softcap)
        check_real(f"{side}_logit_scale", scale, low=0.0, low_inclusive=False)
        if softcap is not None:
            check_real(f"{side}_softcap", softcap, low=0.0, low_inclusive=False)
    check_real("temperature", temperature, low=0.0, low_inclusive=False)
    check_int("ignore_index", ignore_index)
    check_choice("reduction", reduction, DISTILL_REDUCTIONS)
    check_real("weight_hard_loss", weight_hard_loss, low=0.0)
    check_real("weight_soft_loss", weight_soft_loss, low=0.0)
    validate_strategy("auto", weight_grad_accum, chunk_tokens)


def validate_distillation_call(student_hidden, student_weight, teacher_hidden, teacher_weight, target, student_bias,
                               teacher_bias, num_valid_tokens, **options) -> None:
    validate_distillation_options(**options)
    for side, hidden, weight, bias in (("student", student_hidden, student_weight, student_bias),
                                       ("teacher", teacher_hidden, teacher_weight, teacher_bias)):
        # a batch of no token is allowed (0 for mean and sum, as TRL's clamped mean); an empty hidden size is not
        check_tensor(f"{side}_hidden", hidden, min_ndim=1, dtypes=FLOAT_DTYPES,
                     allow_empty=isinstance(hidden, torch.Tensor) and hidden.shape[-1:] != (0,))
        check_tensor(f"{side}_weight", weight, ndim=2, dtypes=FLOAT_DTYPES)
        check_kernel_device(f"{side}_hidden", hidden)
        check_same_device("student_hidden", student_hidden, **{f"{side}_hidden": hidden, f"{side}_weight": weight,
                                                               f"{side}_bias": bias})
        check_same_dtype(f"{side}_hidden", hidden, **{f"{side}_weight": weight, f"{side}_bias": bias})
        vocab, hidden_size = weight.shape
        if hidden.shape[-1] != hidden_size:
            raise ValueError(f"{side}_hidden's last dimension ({hidden.shape[-1]}) must equal {side}_weight.shape[1] "
                             f"(hidden = {hidden_size}); {side}_weight is [vocab, hidden] = {tuple(weight.shape)}")
        if bias is not None:
            check_tensor(f"{side}_bias", bias, ndim=1)
            check_shape(f"{side}_bias", bias, (vocab,), f"one entry per vocabulary row of {side}_weight")
    if teacher_weight.shape[0] != student_weight.shape[0]:
        raise ValueError(f"teacher_weight must have the student's vocabulary size {student_weight.shape[0]} "
                         f"(rows of student_weight), got {teacher_weight.shape[0]}; a different vocabulary needs a "
                         "token mapping first")
    check_shape("teacher_hidden", teacher_hidden, (*student_hidden.shape[:-1], teacher_hidden.shape[-1]),
                "the leading dimensions of student_hidden")
    if target is None:
        if options["weight_hard_loss"]:
            raise ValueError("weight_hard_loss > 0 needs target (the hard labels)")
        if num_valid_tokens is not None:
            raise ValueError("num_valid_tokens needs target (it counts the targets that are not ignore_index)")
        return
    check_same_device("student_hidden", student_hidden, target=target)
    check_target_type(target, student_hidden.shape[:-1])
    count = normalize_count(num_valid_tokens, target)
    if isinstance(count, int) and not 0 <= count <= target.numel():
        raise ValueError(f"num_valid_tokens must be in [0, {target.numel()}] (the number of targets), a device "
                         f"tensor holding it, or None; got {num_valid_tokens}")


def _loss(xs, ws, bs, xt, wt, bt, y, opts: DistillOptions, reduction, weight_grad_accum, chunk_tokens,
          checks=(None, None, -1), with_entropy: bool = False):
    """(loss: 0-d for mean/sum, [T] for "none"; the student's entropy [T] fp32, detached, or [0]) for flat,
    validated inputs: the operator dispatch."""
    grads = GradOptions.asked(xs, ws, bs, weight_grad_accum, chunk_tokens)
    check_target, count, count_int = checks
    if reduction != "none" and grads.wanted:
        loss, entropy, *_ = distill_scalar(xs, ws, bs, xt, wt, bt, y, check_target, count,
                                           DistillScalarOptions(opts, reduction, grads, count_int, with_entropy))
        return loss, entropy
    loss_tok, entropy = distill_per_token(
        xs, ws, bs, xt, wt, bt, y, check_target, count,
        DistillPerTokenOptions(opts, GradOptions(weight_grad_accum, chunk_tokens), count_int, with_entropy))
    if reduction == "none":
        return loss_tok, entropy
    if reduction == "sum":
        return loss_tok.sum(), entropy
    return loss_tok.sum() / clamped_mean_divisor(y, xs.shape[0], opts.ignore_index), entropy


def empty_distillation_loss(student_hidden: torch.Tensor, student_weight: torch.Tensor,
                            student_bias: torch.Tensor | None, reduction: str, return_entropy: bool):
    """A batch of no token: 0 for mean (TRL's clamped divisor) and sum, an empty tensor for "none", with zero
    gradients of the right shapes through the [0, V] logits, which cost nothing (the kernels are not launched:
    Triton takes no grid of zero rows)."""
    per_token = torch.nn.functional.linear(student_hidden, student_weight, student_bias).float().sum(-1) * 0.0
    loss = per_token if reduction == "none" else per_token.sum()
    return (loss, per_token.detach()) if return_entropy else loss


def _autocast_dtype(t: torch.Tensor) -> torch.dtype | None:
    if t.device.type in ("cuda", "cpu") and torch.is_autocast_enabled(t.device.type):
        return torch.get_autocast_dtype(t.device.type)
    return None


def linear_distillation_loss(student_hidden: torch.Tensor, student_weight: torch.Tensor, teacher_hidden: torch.Tensor,
                             teacher_weight: torch.Tensor, target: torch.Tensor | None = None, *,
                             student_bias: torch.Tensor | None = None, teacher_bias: torch.Tensor | None = None,
                             beta: float = 0.5, temperature: float = 1.0, ignore_index: int = -100,
                             reduction: str = "mean", weight_hard_loss: float = 0.0, weight_soft_loss: float = 1.0,
                             student_logit_scale: float = 1.0, student_softcap: float | None = None,
                             teacher_logit_scale: float = 1.0, teacher_softcap: float | None = None,
                             return_entropy: bool = False, weight_grad_accum: str = "fp32",
                             chunk_tokens: int | None = None, num_valid_tokens: int | torch.Tensor | None = None):
    """Distillation of a student's LM head from a teacher's without either model's [T, V] logits.

    Computes, per token t, ℓ_t = weight_soft_loss·D_β(p_t, q_t) + weight_hard_loss·CE(z_s, y_t) with
    p = softmax(z_s/τ), q = softmax(z_t/τ), z_s = student_hidden @ student_weightᵀ (+ student_bias), z_t
    likewise for the teacher. D follows TRL's GKD `generalized_jsd_loss`: β = 0 forward KL(q‖p) (teacher‖student),
    β = 1 reverse KL(p‖q), in between the generalized JSD β·KL(q‖m) + (1 − β)·KL(p‖m), m = (1 − β)p + βq
    (Liger's `LigerFusedLinearJSDLoss` uses the same β; its defaults weight_hard_loss = weight_soft_loss = 0.5
    mix in the cross-entropy, here off by default as in TRL). The hard-label cross-entropy uses the student's
    logits without temperature (as Liger's). The teacher gets no gradient.

    Args:
        student_hidden: [..., H_s] student activations, float32 / float16 / bfloat16.
        student_weight: [V, H_s] the student's LM head, student_hidden's dtype. student_bias: optional [V].
        teacher_hidden: [..., H_t] teacher activations (same leading shape; H_t may differ from H_s).
        teacher_weight: [V, H_t] the teacher's LM head (same V), teacher_hidden's dtype. teacher_bias: optional [V].
        target: optional [...] int64/int32 labels: rows at `ignore_index` count nothing; None: every row counts.
        beta: in [0, 1], see above.  temperature: τ > 0, divides both models' logits in the divergence.
        reduction: "mean" (over the rows not ignored, at least 1: all ignored gives 0, as TRL), "sum", "none",
            or "batchmean", TRL's `generalized_jsd_loss` default: without target the sum over the batch's first
            dimension (the sum / B of a [B, S, H] input, at least 1), with target the same as "mean" (TRL keeps
            the labelled rows first).
        weight_hard_loss / weight_soft_loss: ≥ 0, the weights of the cross-entropy and the divergence (Liger's names).
        student_logit_scale, student_softcap, teacher_logit_scale, teacher_softcap: each model's own logit
            transform, as TRL's DistillationTrainer applies them: z = c·tanh(h·scale / c) of the head's output h
            (scale > 0: Cohere's `logit_scale`; c > 0 or None: Gemma's final softcap), before the temperature.
        return_entropy: also return the student's per-token entropy −Σ p log p at τ (input's leading shape,
            float32, detached, 0 where ignored): the metric TRL's DistillationTrainer logs, from the same pass.
        weight_grad_accum, chunk_tokens: as `linear_cross_entropy` (the chunk also bounds the teacher's buffer).
            The weights and biases may be DTensors (FSDP2-sharded heads): gathered as `linear_cross_entropy` does.
        num_valid_tokens: the targets that are not ignore_index, as `linear_cross_entropy`: an int gathers
            those rows and computes only them; a device tensor is checked against the target (no host sync)
            and the rows are computed densely. Either wrong count raises ValueError.

    Returns:
        the loss in float32: 0-d for mean/sum/batchmean, the input's leading shape for "none"; with
        `return_entropy`, (loss, entropy).
    """
    options = dict(beta=beta, temperature=temperature, ignore_index=ignore_index, reduction=reduction,
                   weight_hard_loss=weight_hard_loss, weight_soft_loss=weight_soft_loss,
                   student_logit_scale=student_logit_scale, student_softcap=student_softcap,
                   teacher_logit_scale=teacher_logit_scale, teacher_softcap=teacher_softcap,
                   weight_grad_accum=weight_grad_accum, chunk_tokens=chunk_tokens)
    autocast = _autocast_dtype(student_hidden) if isinstance(student_hidden, torch.Tensor) else None
    if autocast is not None:  # as F.linear under autocast: every floating operand in the autocast dtype
        def cast(t):
            return t.to(autocast) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
        with torch.autocast(student_hidden.device.type, enabled=False):
            return linear_distillation_loss(
                cast(student_hidden), cast(student_weight), cast(teacher_hidden), cast(teacher_weight), target,
                student_bias=cast(student_bias), teacher_bias=cast(teacher_bias), num_valid_tokens=num_valid_tokens,
                return_entropy=return_entropy, **options)
    # DTensor heads (FSDP2-sharded, vocab-parallel) gathered, the student's differentiably
    student_weight, student_bias, _ = full_weights(student_hidden, student_weight, target, student_bias)
    with torch.no_grad():
        teacher_weight, teacher_bias, _ = full_weights(teacher_hidden, teacher_weight, target, teacher_bias)
    validate_distillation_call(student_hidden, student_weight, teacher_hidden, teacher_weight, target, student_bias,
                               teacher_bias, num_valid_tokens, **options)
    if target is not None:
        num_valid_tokens = normalize_count(num_valid_tokens, target)  # numpy / CPU-tensor counts as the kernels take it
    lead_shape = student_hidden.shape[:-1]
    batch_divisor = None
    if reduction == "batchmean":  # the sum scaled once after the operators, which know mean, sum and none
        batch_divisor = batchmean_divisor(lead_shape, target is not None)
        reduction = "mean" if batch_divisor is None else "sum"
    if lead_shape.numel() == 0:
        return empty_distillation_loss(student_hidden, student_weight, student_bias, reduction, return_entropy)
    xs = student_hidden.reshape(-1, student_hidden.shape[-1])
    xt = teacher_hidden.detach().reshape(-1, teacher_hidden.shape[-1])
    xs, xt = (x if x.stride(-1) == 1 else x.contiguous() for x in (xs, xt))
    wt, bt = teacher_weight.detach(), None if teacher_bias is None else teacher_bias.detach()
    y = None if target is None else target.reshape(-1).contiguous()

    def real(v):
        return None if v is None else float(v)
    opts = DistillOptions(float(beta), float(temperature), ignore_index, float(weight_hard_loss),
                          float(weight_soft_loss), float(student_logit_scale), real(student_softcap),
                          float(teacher_logit_scale), real(teacher_softcap))
    args = (student_weight, student_bias, opts, reduction, weight_grad_accum, chunk_tokens)
    if isinstance(num_valid_tokens, int) and 0 < num_valid_tokens < y.shape[0]:
        rows = valid_rows_first(y, ignore_index)[:num_valid_tokens]
        loss, entropy = _loss(xs.index_select(0, rows), args[0], args[1], xt.index_select(0, rows), wt, bt,
                              y.index_select(0, rows), *args[2:], checks=(y, None, num_valid_tokens),
                              with_entropy=return_entropy)
        if reduction == "none":
            loss = loss.new_zeros(y.shape[0]).index_copy(0, rows, loss)
        if return_entropy:
            entropy = entropy.new_zeros(y.shape[0]).index_copy(0, rows, entropy)
    else:
        count = num_valid_tokens if isinstance(num_valid_tokens, torch.Tensor) else None
        count_int = num_valid_tokens if isinstance(num_valid_tokens, int) else -1
        loss, entropy = _loss(xs, args[0], args[1], xt, wt, bt, y, *args[2:], checks=(None, count, count_int),
                              with_entropy=return_entropy)
    if reduction == "none":
        loss = loss.reshape(lead_shape)
    if batch_divisor is not None:
        loss = loss / batch_divisor
    return (loss, entropy.reshape(lead_shape)) if return_entropy else loss


class LinearDistillationLoss(nn.Module):
    """`nn.Module` form of `linear_distillation_loss`: options at construction, tensors at call.

    Example:
        >>> loss_fn = LinearDistillationLoss(beta=0.5, temperature=2.0)
        >>> loss = loss_fn(student_h, student.lm_head.weight, teacher_h, teacher.lm_head.weight, labels)
    """

    def __init__(self, *, beta: float = 0.5, temperature: float = 1.0, ignore_index: int = -100,
                 reduction: str = "mean", weight_hard_loss: float = 0.0, weight_soft_loss: float = 1.0,
                 student_logit_scale: float = 1.0, student_softcap: float | None = None,
                 teacher_logit_scale: float = 1.0, teacher_softcap: float | None = None,
                 return_entropy: bool = False, weight_grad_accum: str = "fp32", chunk_tokens: int | None = None):
        super().__init__()
        self.options = dict(beta=beta, temperature=temperature, ignore_index=ignore_index, reduction=reduction,
                            weight_hard_loss=weight_hard_loss, weight_soft_loss=weight_soft_loss,
                            student_logit_scale=student_logit_scale, student_softcap=student_softcap,
                            teacher_logit_scale=teacher_logit_scale, teacher_softcap=teacher_softcap,
                            weight_grad_accum=weight_grad_accum, chunk_tokens=chunk_tokens)
        validate_distillation_options(**self.options)
        self.return_entropy = return_entropy

    def forward(self, student_hidden, student_weight, teacher_hidden, teacher_weight, target=None, student_bias=None,
                teacher_bias=None, num_valid_tokens: int | torch.Tensor | None = None):
        return linear_distillation_loss(student_hidden, student_weight, teacher_hidden, teacher_weight, target,
                                        student_bias=student_bias, teacher_bias=teacher_bias,
                                        num_valid_tokens=num_valid_tokens, return_entropy=self.return_entropy,
                                        **self.options)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items())
