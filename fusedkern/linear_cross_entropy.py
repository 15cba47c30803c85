"""`linear_cross_entropy`: F.cross_entropy(input @ linear_weightᵀ + linear_bias, target) without the
[tokens, V] logits — the public function, its `nn.Module`, and the custom operators of both strategies
(their plumbing: `fusedkern/autograd.py`; the argument checks: `fusedkern/_validation.py`).

Scalar reductions with `impl="chunked"` form the gradient in the forward pass (three GEMMs in all) and
the backward only rescales it by the upstream gradient; `reduction="none"` and `impl="fused"` save the
per-token statistics and recompute the logits in backward, which lets any per-token upstream gradient flow.

The kernels run inside custom operators (`torch.library.custom_op`, namespace `fusedkern`), each with a
fake implementation (output shapes and dtypes) and an autograd formula, so that `torch.compile` traces
a call as one node per operator with no graph break (`fullgraph=True` works). The argument checks stay
in Python before the operator call (they read only shapes, dtypes and Python values); the target range
and count checks, which read the device, run inside the operator bodies: started before the kernels
are queued and read after them (`_validation.TargetRangeCheck`), so that no step waits for the GPU.
Outside tracing (`autograd.Op`) the same implementations and formulas run through a plain autograd.Function,
which costs less host time than the dispatcher, and the backward rescales the saved gradients in place.

Size (> 400 lines): the public function, its module and the custom operators of both strategies; each
operator's fake implementation and autograd formula sit beside its body.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fusedkern._validation import (
    finish_checks,
    normalize_count,
    start_checks,
    validate_call,
    validate_loss_options,
    validate_strategy,
)
from fusedkern.autograd import (
    CHECKING_OP_TAGS,
    GradOptions,
    absent,
    cast_or_none,
    define_op,
    fake_grads,
    follows_autocast,
    grads_formed_in_forward,
    or_absent,
    recomputed_in_backward,
)
from fusedkern.chunked import LossOptions, chunked_loss_and_grads, lse_of, plan_for_grads
from fusedkern.engine import valid_rows_first
from fusedkern.anchored import AnchoredCrossEntropy, kept_logprobs
from fusedkern.dispatch import Call, anchored_for, choose, forms_grads_in_forward, keeps_anchored_e, strategy
from fusedkern.sharded import full_weights


# ----------------------------------------------------------------------------------------------
# helpers of the formulas


def mean_denominator(target: torch.Tensor, class_weight: torch.Tensor | None, ignore_index: int) -> torch.Tensor:
    """D of the mean: Σ_{t not ignored} w_{y_t} (the count without class weights), fp32 on device."""
    valid = target != ignore_index
    if class_weight is None:
        return valid.sum(dtype=torch.float32)
    # clamped: the target range check is read later (`TargetRangeCheck`), so no index may be out of range here
    safe_target = torch.where(valid, target, 0).clamp_(0, class_weight.shape[0] - 1)
    return (class_weight[safe_target] * valid).sum(dtype=torch.float32)


# ----------------------------------------------------------------------------------------------
# custom operators: the kernels behind `autograd.define_op`, each with a fake implementation (shapes and dtypes
# only, for tracing) and an autograd formula; their options travel in one frozen dataclass per operator


@dataclass(frozen=True)
class ChunkedScalarOptions:
    """`ce_chunked_scalar`'s options: the loss, its reduction ("mean"/"sum"), the gradients (`GradOptions`), the
    row-count path (`skip_ignored`, which forms no bias gradient: need_db False) and a host count to check
    (`count_int`, -1: none)."""

    loss: LossOptions
    reduction: str
    grads: GradOptions
    skip_ignored: bool = False
    count_int: int = -1


def _chunked_scalar(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, target: torch.Tensor,
                    class_weight: torch.Tensor | None, check_target: torch.Tensor | None,
                    count: torch.Tensor | None, rows: torch.Tensor | None, o: ChunkedScalarOptions
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chunked strategy, reduction mean/sum: loss and gradients in one pass (three GEMMs).

    x [T, H] · w [V, H] · b [V] | None · target [T] · class_weight [V] fp32 | None. Returns (loss 0-d fp32,
    lse [T] fp32, dx [T, H], dw [V, H]: the fp32 accumulator or dW in the weight's dtype (`chunked.grad_buffers`),
    db [V] fp32, dw_out [V, H]: dW's storage, content undefined, when dw is the accumulator and `return_dw_out`
    (eager: the backward writes dW into it)), the gradients of the loss itself, rescaled by the upstream
    gradient in backward. skip_ignored: rows sorted valid-first,
    `count` of them valid: the row-count kernels skip the rest (`compacted.py`; no lse, no db); with `rows`
    (`valid_rows_first`) only the target is sorted, x and dx stay in the caller's order and the sorted x
    lives in dx's storage (`compacted.counted_loss_and_grads`). rows without skip_ignored: the valid rows of
    a host count, target = target[rows]: only those rows are computed (`chunked.chunked_loss_and_grads`),
    dx keeps x's order (no lse)."""
    opts, g = o.loss, o.grads
    assert not (o.skip_ignored and g.need_db), "the row-count path forms no bias gradient"
    checks = start_checks(target, w.shape[0], opts.ignore_index, check_target, count, o.count_int)
    if o.reduction == "mean":
        denom = mean_denominator(target, class_weight, opts.ignore_index)
        grad_scale = (1.0 / denom).reshape(1)
    else:
        grad_scale = torch.ones(1, device=x.device, dtype=torch.float32)
    if o.skip_ignored:
        from fusedkern.compacted import counted_loss_and_grads

        loss_tok, dx, dw, dw_out = counted_loss_and_grads(
            x, w, b, target, class_weight, opts, grad_scale, count, need_dx=g.need_dx, need_dw=g.need_dw,
            weight_grad_accum=g.weight_grad_accum, chunk_tokens=g.chunk_tokens, rows=rows)
        lse, db = absent(x, torch.float32), None
    else:
        loss_tok, stats, grads = chunked_loss_and_grads(
            x, w, b, target, class_weight, opts, grad_scale, need_dx=g.need_dx, need_dw=g.need_dw,
            need_db=g.need_db, weight_grad_accum=g.weight_grad_accum, chunk_tokens=g.chunk_tokens, rows=rows)
        dx, dw, db, dw_out = grads.as_tuple()
        lse = absent(x, torch.float32) if rows is not None else lse_of(stats)
    loss = loss_tok.sum() / denom if o.reduction == "mean" else loss_tok.sum()
    finish_checks(checks)
    return (loss, lse, *g.outputs(x, w, dx, dw, db, dw_out))


def _fake_chunked_scalar(x, w, b, target, class_weight, check_target, count, rows, o: ChunkedScalarOptions):
    T, g = x.shape[0], o.grads
    planned_rows = T if rows is None or o.skip_ignored else rows.shape[0]
    fp32_accumulator = plan_for_grads(planned_rows, w, g.need_dw, g.weight_grad_accum, g.chunk_tokens).fp32_accumulator
    f32 = torch.float32
    return (x.new_empty((), dtype=f32),
            x.new_empty((0,) if o.skip_ignored or rows is not None else (T,), dtype=f32),
            *g.fake_outputs(x, w, T, fp32_accumulator, g.need_db and not o.skip_ignored))


ce_chunked_scalar = define_op(
    "fusedkern::ce_chunked_scalar", ["x", "w", "b?", "target", "class_weight?", "check_target?", "count?", "rows?"],
    ChunkedScalarOptions, 6, _chunked_scalar, _fake_chunked_scalar,
    *grads_formed_in_forward(lambda o: f"linear_cross_entropy (chunked, "
                                       f"{'counted rows' if o.skip_ignored else 'mean/sum'})"),
    tags=CHECKING_OP_TAGS)


@dataclass(frozen=True)
class PerTokenOptions:
    """`ce_per_token`'s and `ce_per_token_backward`'s options: the loss, the strategy of `dispatch.choose`
    ("chunked", "fused", or "gluon", whose backward recomputes as "chunked"), the backward's chunks and gradients
    (`GradOptions`: none asked for in the forward), the statistics pass's whole-row chunks (`forward_chunk_tokens`;
    None: its 64 MiB tiles; the Gluon pass: at most that many tokens a launch) and a host count to check
    (`count_int`, -1: none)."""

    loss: LossOptions
    impl: str
    grads: GradOptions
    forward_chunk_tokens: int | None
    count_int: int = -1


def _per_token(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, target: torch.Tensor,
               class_weight: torch.Tensor | None, check_target: torch.Tensor | None, count: torch.Tensor | None,
               o: PerTokenOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss ℓ_t [T] fp32 and row statistics [2, T] fp32 (`chunked.lse_of`); the backward
    recomputes the logits (four GEMMs in all) and accepts any upstream ∂L/∂ℓ_t. Used by reduction='none',
    by impl='fused', and (no gradient) by every loss-only call."""
    checks = start_checks(target, w.shape[0], o.loss.ignore_index, check_target, count, o.count_int)
    loss_tok, stats = strategy(o.impl).statistics(x, w, b, target, class_weight, o.loss, o.forward_chunk_tokens)
    finish_checks(checks)
    return loss_tok, stats


def _fake_per_token(x, w, b, target, class_weight, check_target, count, o: PerTokenOptions):
    T = x.shape[0]
    return x.new_empty((T,), dtype=torch.float32), x.new_empty((2, T), dtype=torch.float32)


def _per_token_backward(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, target: torch.Tensor,
                        class_weight: torch.Tensor | None, stats: torch.Tensor, grad_tok: torch.Tensor,
                        o: PerTokenOptions) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of Σ_t grad_tok[t]·ℓ_t (grad_tok [T] fp32), recomputing the logits from the saved
    statistics: (dx [T, H], dw [V, H], db [V]) in the dtypes of x, w, b; empty where not needed."""
    g = o.grads
    dx, dw, db = strategy(o.impl).gradients(
        x, w, b, target, class_weight, o.loss, stats, grad_tok, need_dx=g.need_dx, need_dw=g.need_dw,
        need_db=g.need_db, weight_grad_accum=g.weight_grad_accum, chunk_tokens=g.chunk_tokens)
    return (or_absent(cast_or_none(dx, x.dtype), x), or_absent(cast_or_none(dw, w.dtype), w),
            absent(w) if db is None else db.to(b.dtype))


ce_per_token_backward = define_op(
    "fusedkern::ce_per_token_backward", ["x", "w", "b?", "target", "class_weight?", "stats", "grad_tok"],
    PerTokenOptions, 3, _per_token_backward,
    lambda x, w, b, target, class_weight, stats, grad_tok, o: fake_grads(x, w, b, o.grads))
ce_per_token = define_op(
    "fusedkern::ce_per_token", ["x", "w", "b?", "target", "class_weight?", "check_target?", "count?"], PerTokenOptions, 2,
    _per_token, _fake_per_token, *recomputed_in_backward(ce_per_token_backward), tags=CHECKING_OP_TAGS)


# ----------------------------------------------------------------------------------------------
# the public function


def _loss_and_lse(x2d, w, b, y, class_weight, opts: LossOptions, reduction: str, impl: str, weight_grad_accum: str,
                  chunk_tokens, checks=(None, None, -1), rows=None):
    """(loss: 0-d for mean/sum, [T] for "none"; lse [T]) for flat inputs: the strategy dispatch.
    checks: (check_target, count, count_int) of `start_checks`. rows: [n] the only rows of x2d to compute (a
    host `num_valid_tokens`), y already gathered, loss over those n rows: the chunked mean/sum with gradients
    gathers them into dX's own storage (no lse), the other paths a copy that autograd scatters back."""
    grads = GradOptions.asked(x2d, w, b, weight_grad_accum, chunk_tokens)
    # these operators take no logit scale (a temperature reaches the kernels through `logprobs.logprobs_entropy`),
    # so the Gluon pass, which would accept one, must not be handed one here either
    assert opts.logit_scale == 1.0, "cross-entropy's operators take no logit scale"
    check_target, count, count_int = checks
    if grads.wanted and reduction != "none" and not grads.need_db and count is None \
            and anchored_for(impl, Call(x2d, w, b, class_weight, opts)):
        # the anchored pass forms the gradients in the forward (three GEMMs, no row pass over the logits); a
        # host count's rows are gathered here and autograd scatters their dX back
        x_rows = x2d if rows is None else x2d.index_select(0, rows)
        return AnchoredCrossEntropy.apply(x_rows, w, y, opts, reduction, weight_grad_accum, chunk_tokens, None,
                                          checks if rows is not None else None)
    if reduction == "none" and grads.wanted and not grads.need_db and keeps_anchored_e(x2d, w) \
            and anchored_for(impl, Call(x2d, w, b, class_weight, opts)):
        # per-token losses whose upstream arrives in backward: E kept to it (three GEMMs)
        nll, _, stats = kept_logprobs(x2d if rows is None else x2d.index_select(0, rows), w, y, opts, False, checks)
        return nll, lse_of(stats)
    if grads.wanted and reduction != "none" and forms_grads_in_forward(impl, x2d, w, weight_grad_accum,
                                                                      chunk_tokens):
        loss, lse, *_ = ce_chunked_scalar(x2d, w, b, y, class_weight, check_target, count, rows,
                                          ChunkedScalarOptions(opts, reduction, grads, count_int=count_int))
        return loss, lse
    if rows is not None:
        x2d = x2d.index_select(0, rows)
    # the statistics pass is the same with and without a gradient to follow (a backward recomputes the logits):
    # the same strategy and chunks, so both give the same statistics
    impl = choose(impl, Call(x2d, w, b, class_weight, opts), weight_grad_accum=weight_grad_accum,
                  chunk_tokens=chunk_tokens, statistics_only=True).name
    loss_tok, stats = ce_per_token(x2d, w, b, y, class_weight, check_target, count,
                                   PerTokenOptions(opts, impl, GradOptions(weight_grad_accum, chunk_tokens),
                                                   chunk_tokens, count_int))
    lse = lse_of(stats)
    if reduction == "none":
        return loss_tok, lse
    if reduction == "sum":
        return loss_tok.sum(), lse
    return loss_tok.sum() / mean_denominator(y, class_weight, opts.ignore_index), lse


def empty_batch_loss(x2d, w, b, y, class_weight, opts: LossOptions, reduction: str, need_lse: bool):
    """(loss, lse [0] or None) of a batch with no token, as torch gives them: 0 for "sum", NaN for "mean", an
    empty tensor for "none"; gradients of zeros (and of the right shapes) through the [0, V] logits, which cost
    nothing to form. The kernels are not launched: a grid of zero rows is not a launch Triton accepts."""
    z = torch.nn.functional.linear(x2d, w, b).float()
    if opts.softcap is not None:
        z = opts.softcap * torch.tanh(z / opts.softcap)
    lse = torch.logsumexp(z, dim=-1)  # [0]; its z-loss term, like every per-token term, sums to nothing
    loss = torch.nn.functional.cross_entropy(z, y.long(), weight=class_weight, ignore_index=opts.ignore_index,
                                             reduction=reduction, label_smoothing=opts.label_smoothing)
    return loss, (lse.detach() if need_lse else None)


def loss_over_tokens(x2d, w, b, y, class_weight, opts: LossOptions, reduction: str, impl: str, weight_grad_accum: str,
                     chunk_tokens, num_valid_tokens: int | torch.Tensor | None, need_lse: bool):
    """(loss, lse [T] or None) for flat, validated inputs; the operators check the targets (and the count).

    `num_valid_tokens` (see `linear_cross_entropy`), when no lse is asked for: an int gathers exactly the
    valid rows (cuBLAS over them; chunked mean/sum with gradients gathers them into dX's own storage and
    returns dX in x's order, zero in ignored rows; other calls gather a copy that autograd scatters back);
    a device tensor sorts them first, into dX's own storage, and lets the row-count kernels skip the rest
    (`compacted.py`; chunked mean/sum with gradients, else the dense computation). The mean's denominator is the same over the valid rows, and
    "none" puts them back among zeros."""
    if y.numel() == 0:
        return empty_batch_loss(x2d, w, b, y, class_weight, opts, reduction, need_lse)

    def dense(count=None, count_int=-1):
        return _loss_and_lse(x2d, w, b, y, class_weight, opts, reduction, impl, weight_grad_accum, chunk_tokens,
                             (None, count, count_int))

    if num_valid_tokens is None:
        return dense()
    on_device = isinstance(num_valid_tokens, torch.Tensor)
    count, count_int = (num_valid_tokens, -1) if on_device else (None, num_valid_tokens)
    if need_lse:
        return dense(count, count_int)
    if on_device:
        grads = GradOptions.asked(x2d, w, b, weight_grad_accum, chunk_tokens)
        counted = (reduction != "none" and (grads.need_dx or grads.need_dw) and not grads.need_db
                   and forms_grads_in_forward(impl, x2d, w, weight_grad_accum, chunk_tokens))
        if not counted:
            return dense(count)
        rows = valid_rows_first(y, opts.ignore_index)
        # x goes in unsorted with `rows`: the operator sorts it into dX's own storage (no T×H copy beside dX)
        loss, *_ = ce_chunked_scalar(
            x2d, w, b, y.index_select(0, rows), class_weight, None, num_valid_tokens, rows,
            ChunkedScalarOptions(opts, reduction, grads, skip_ignored=True))
        return loss, None
    if not 0 < num_valid_tokens < y.shape[0]:
        return dense(count_int=count_int)
    rows = valid_rows_first(y, opts.ignore_index)[:num_valid_tokens]
    loss, _ = _loss_and_lse(x2d, w, b, y.index_select(0, rows), class_weight, opts, reduction, impl,
                            weight_grad_accum, chunk_tokens, (y, None, count_int), rows)
    if reduction == "none":
        loss = loss.new_zeros(y.shape[0]).index_copy(0, rows, loss)
    return loss, None


@follows_autocast
def linear_cross_entropy(input: torch.Tensor, linear_weight: torch.Tensor, target: torch.Tensor, *,
                         linear_bias: torch.Tensor | None = None, weight: torch.Tensor | None = None,
                         reduction: str = "mean", ignore_index: int = -100, label_smoothing: float = 0.0,
                         z_loss: float = 0.0, softcap: float | None = None, return_lse: bool = False,
                         impl: str = "auto", weight_grad_accum: str = "fp32", chunk_tokens: int | None = None,
                         num_valid_tokens: int | None = None):
    """Cross-entropy of a linear layer's output without materializing the logits.

    Computes `F.cross_entropy(input @ linear_weight.T + linear_bias, target, weight=weight,
    reduction=reduction, ignore_index=ignore_index, label_smoothing=label_smoothing)` plus
    `z_loss · lse²` per token, with optional softcap z → c·tanh(z/c) before the softmax
    (docs/design.md has the exact formula and its gradient). Traceable by torch.compile with no graph
    break (the kernels are custom operators; docs/usage.md says what differs from eager there).

    Args:
        input: [..., H] activations, float32 / float16 / bfloat16.
        linear_weight: [V, H] LM-head weight, same dtype as input.
        target: [...] int64/int32 class indices (input's leading shape); `ignore_index` is skipped.
        linear_bias: optional [V] bias, same dtype as input.
        weight: optional [V] class weights (torch's `weight`).
        reduction: "mean" (over non-ignored tokens, class-weighted like torch), "sum" or "none".
        label_smoothing: ε in [0, 1].  z_loss: coefficient of lse² (≥ 0).  softcap: c > 0 or None.
        return_lse: also return the per-token log-sum-exp [...] (float32, not differentiable).
        impl: "chunked" (cuBLAS GEMMs over bounded token chunks + Triton row kernel; three GEMMs for
            mean/sum), "fused" (Triton GEMM + online LSE, no logits buffer; logits recomputed in
            backward), "gluon" (statistics in the logits GEMM's epilogue, sm_90, plain options; a gradient
            takes the chunked GEMMs) or "auto" ("chunked" unless its buffers do not fit free GPU memory, and
            "gluon" for the statistics-only passes it supports). `fusedkern/dispatch.py` says what each takes.
        weight_grad_accum: "fp32" (dW accumulated across chunks in one fp32 [V, H] buffer: no loss of
            precision with many tokens) or "weight_dtype" (memory-lean: accumulate in the weight's dtype).
        chunk_tokens: tokens per chunk. Default (`chunk_plan.grad_chunk_plan`): with fp32 dW accumulation,
            all tokens in one chunk while the buffer fits the accumulator's allowance (9216 tokens at
            V = 128256, H = 4096), else chunks of H tokens inside dW's own storage; in lean mode, for an
            fp32 weight or without dW, the largest multiple of 64 keeping the buffer ≤ 256 MiB.
        num_valid_tokens: how many targets are not `ignore_index`, so that only those rows are computed
            (same loss and gradients, dX zero at ignored rows). An int, when the caller has it on the
            host without a sync (a data collator counts it on the CPU copy of the labels): those rows
            are gathered and cuBLAS runs the three GEMMs over them alone. A one-element int tensor on
            the device, e.g. `(target != -100).sum()`: the rows are sorted valid-first on the device and
            Triton GEMMs that read the count skip the rest (chunked strategy, mean/sum, no bias
            gradient; other calls compute densely). Either is checked against the target on the device
            behind an event: a wrong count raises ValueError before returning, with no sync in the
            step. Not used with `return_lse=True` (every token's lse is asked for).

    Returns:
        the loss (float32; 0-d for mean/sum, input's leading shape for "none"), and the lse when
        `return_lse`. All targets ignored with "mean" gives NaN and zero gradients, like torch.
    """
    linear_weight, linear_bias, weight = full_weights(input, linear_weight, target, linear_bias, weight)  # DTensors
    validate_call(input, linear_weight, target, linear_bias, weight=weight, reduction=reduction,
                  ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
                  impl=impl, weight_grad_accum=weight_grad_accum, chunk_tokens=chunk_tokens,
                  num_valid_tokens=num_valid_tokens)
    num_valid_tokens = normalize_count(num_valid_tokens, target)  # a numpy or tensor count as the kernels take it
    lead_shape = input.shape[:-1]
    x2d = input.reshape(-1, input.shape[-1])
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    y = target.reshape(-1).contiguous()  # the kernels index target[row] with no stride
    class_weight = None if weight is None else weight.float().contiguous()
    opts = LossOptions(ignore_index, float(label_smoothing), float(z_loss), None if softcap is None else float(softcap))
    loss, lse = loss_over_tokens(x2d, linear_weight, linear_bias, y, class_weight, opts, reduction, impl,
                                 weight_grad_accum, chunk_tokens, num_valid_tokens, need_lse=return_lse)
    if reduction == "none":
        loss = loss.reshape(lead_shape)
    return (loss, lse.reshape(lead_shape)) if return_lse else loss


class LinearCrossEntropyLoss(nn.Module):
    """`nn.Module` form of `linear_cross_entropy`: options at construction, tensors at call.

    Example:
        >>> loss_fn = LinearCrossEntropyLoss(ignore_index=-100, label_smoothing=0.1)
        >>> loss = loss_fn(hidden_states, lm_head.weight, labels)   # [B, S, H], [V, H], [B, S]
    """

    def __init__(self, weight: torch.Tensor | None = None, *, reduction: str = "mean", ignore_index: int = -100,
                 label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: float | None = None,
                 return_lse: bool = False, impl: str = "auto", weight_grad_accum: str = "fp32",
                 chunk_tokens: int | None = None):
        super().__init__()
        validate_loss_options(weight=weight, reduction=reduction, ignore_index=ignore_index,
                              label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap)
        validate_strategy(impl, weight_grad_accum, chunk_tokens)
        self.register_buffer("weight", weight)
        self.reduction, self.ignore_index, self.label_smoothing = reduction, ignore_index, label_smoothing
        self.z_loss, self.softcap, self.return_lse = z_loss, softcap, return_lse
        self.impl, self.weight_grad_accum, self.chunk_tokens = impl, weight_grad_accum, chunk_tokens

    def forward(self, input, linear_weight, target, linear_bias=None, num_valid_tokens: int | None = None):
        return linear_cross_entropy(
            input, linear_weight, target, linear_bias=linear_bias, weight=self.weight, reduction=self.reduction,
            ignore_index=self.ignore_index, label_smoothing=self.label_smoothing, z_loss=self.z_loss,
            softcap=self.softcap, return_lse=self.return_lse, impl=self.impl,
            weight_grad_accum=self.weight_grad_accum, chunk_tokens=self.chunk_tokens,
            num_valid_tokens=num_valid_tokens)

    def extra_repr(self) -> str:
        return (f"reduction={self.reduction!r}, ignore_index={self.ignore_index}, label_smoothing={self.label_smoothing}, "
                f"z_loss={self.z_loss}, softcap={self.softcap}, impl={self.impl!r}, weight_grad_accum={self.weight_grad_accum!r}")
