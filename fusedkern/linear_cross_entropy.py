"""`linear_cross_entropy`: F.cross_entropy(input @ linear_weightᵀ + linear_bias, target) without the
[tokens, V] logits — the public function, its `nn.Module`, and the autograd wiring of both strategies.

Scalar reductions with `impl="chunked"` form the gradient in the forward pass (three GEMMs in all) and
the backward only rescales it by the upstream gradient; `reduction="none"` and `impl="fused"` save the
per-token statistics and recompute the logits in backward, which lets any per-token upstream gradient flow.

The kernels run inside custom operators (`torch.library.custom_op`, namespace `fusedkern`), each with a
fake implementation (output shapes and dtypes) and an autograd formula, so that `torch.compile` traces
a call as one node per operator with no graph break (`fullgraph=True` works). The argument checks stay
in Python before the operator call (they read only shapes, dtypes and Python values); the target range
and count checks, which read the device, run inside the operator bodies: started before the kernels
are queued and read after them (`_validation.TargetRangeCheck`), so that no step waits for the GPU.
Outside tracing (`call_op`) the same implementations and formulas run through a plain autograd.Function,
which costs less host time than the dispatcher, and the backward rescales the saved gradients in place.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from fusedkern import _validation as V_
from fusedkern.chunked import (
    LossOptions,
    chunked_grads,
    chunked_loss,
    chunked_loss_and_grads,
    lse_of,
    plan_for_grads,
)
from fusedkern.kernels.scale import scale_unless_one_
from fusedkern.integrations.fsdp import full_weights

IMPLS = ("auto", "chunked", "fused")
REDUCTIONS = ("mean", "sum", "none")
WEIGHT_GRAD_ACCUMS = ("fp32", "weight_dtype")


# ----------------------------------------------------------------------------------------------
# helpers shared by the autograd formulas


def _traced(*tensors: torch.Tensor) -> bool:
    """Whether torch.compile / export may be tracing this code rather than running it: compiling, a
    dispatch mode, or tensors that are not plain (fake, functional). Traced code must stay functional
    and reach the kernels only through the registered operators."""
    return (torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None
            or any(type(t) not in (torch.Tensor, nn.Parameter) for t in tensors))


def _rescaled(grad: torch.Tensor | None, scale: torch.Tensor, out_dtype: torch.dtype,
              out: torch.Tensor | None = None):
    """grad · scale in `out_dtype`, with no device→host sync: in place when the dtype already matches
    (the buffer is ours; skipped on the device when scale == 1, as after `loss.backward()`), else
    into `out` (storage of that dtype we own) or a new tensor, in one pass (read, scale, cast, write).
    While torch.compile traces the backward, an out-of-place multiply (computed in fp32, rounded once)."""
    if grad is None:
        return None
    if _traced(grad, scale):  # torch.compile traces the backward: no in-place Triton launch, same rounding
        return (grad * scale).to(out_dtype)
    if grad.dtype == out_dtype:
        return scale_unless_one_(grad, scale)
    if out is None:
        out = torch.empty(grad.shape, device=grad.device, dtype=out_dtype)
    return torch.mul(grad, scale, out=out)


def save_precomputed_grads(ctx, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, dx, dw, db,
                           dw_out: torch.Tensor | None = None) -> None:
    """For Functions that form their gradients in the forward pass: keep them for `rescaled_grads`.
    dw_out: dW's storage in the weight's dtype when dw is an fp32 accumulator (`chunked.grad_buffers`)."""
    ctx.save_for_backward(dx, dw, db, dw_out)
    ctx.grad_meta = (x.shape, x.dtype, w.dtype, None if b is None else b.dtype)
    ctx.used = False


def rescaled_grads(ctx, grad_loss: torch.Tensor, what: str):
    """(dx, dw, db) saved by `save_precomputed_grads`, times the upstream gradient, in the inputs'
    dtypes and shapes. In place on our own buffers, so a second backward is refused."""
    if ctx.used:
        raise RuntimeError(f"{what} rescales its saved gradients in place and supports one backward pass; "
                           "use reduction='none' / linear_logprobs for retain_graph")
    ctx.used = True
    dx, dw, db, dw_out = ctx.saved_tensors
    x_shape, x_dtype, w_dtype, b_dtype = ctx.grad_meta
    scale = grad_loss.float()
    dx = _rescaled(dx, scale, x_dtype)
    return (None if dx is None else dx.view(x_shape), _rescaled(dw, scale, w_dtype, out=dw_out),
            _rescaled(db, scale, b_dtype) if db is not None else None)


def first_order_only(backward):
    """A Function's backward that is not itself differentiable: `create_graph=True` (double backward, e.g.
    a gradient penalty) raises here rather than returning gradients whose own gradient would be silently
    dropped (the fused kernels) or would crash inside an `out=` GEMM (the chunked ones)."""

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        if torch.is_grad_enabled():
            raise RuntimeError(
                "fusedkern's losses support first-order gradients only: backward with create_graph=True "
                "(double backward, e.g. a gradient penalty) is not supported; compute such a term on "
                "materialized logits with torch.nn.functional.cross_entropy")
        device = next((g.device.type for g in grads if isinstance(g, torch.Tensor)), "cpu")
        with torch.autocast(device, enabled=False):  # the saved operands already are in the compute dtype
            return backward(ctx, *grads)

    return wrapper


def _cast(grad: torch.Tensor | None, dtype: torch.dtype):
    return None if grad is None else grad.to(dtype)


def mean_denominator(target: torch.Tensor, class_weight: torch.Tensor | None, ignore_index: int) -> torch.Tensor:
    """D of the mean: Σ_{t not ignored} w_{y_t} (the count without class weights), fp32 on device."""
    valid = target != ignore_index
    if class_weight is None:
        return valid.sum(dtype=torch.float32)
    # clamped: the target range check is read later (`TargetRangeCheck`), so no index may be out of range here
    safe_target = torch.where(valid, target, 0).clamp_(0, class_weight.shape[0] - 1)
    return (class_weight[safe_target] * valid).sum(dtype=torch.float32)


def _fused_ops():
    from fusedkern.kernels import fused_ce

    return fused_ce


# ----------------------------------------------------------------------------------------------
# custom operators: the kernels behind `torch.library.custom_op`, each with a fake implementation
# (shapes and dtypes only, for tracing) and an autograd formula. A gradient that is not asked for
# comes back as an empty [0] tensor (an operator returns tensors, never None). Outside tracing,
# `call_op` applies the same implementation and formula through a plain autograd.Function.


class _OpSpec(NamedTuple):
    impl: Callable
    setup_context: Callable | None  # None: an operator with no gradient (a backward's)
    backward: Callable | None


_EAGER: dict = {}


def register_op(op, impl: Callable, setup_context: Callable, backward: Callable) -> None:
    """The autograd formula of `op` (a `torch.library.custom_op` of `impl`), for the dispatcher and for `call_op`.

    The operators return their precomputed gradients as (non-differentiable) outputs; autograd would hand
    the backward a zero-filled gradient of each — a transient dX + dW (+1 GiB at V·H = 128256·4096, found
    on the H200) — so the formula sees None for outputs nothing flowed into."""

    def setup_without_zero_grads(ctx, inputs, output):
        ctx.set_materialize_grads(False)
        setup_context(ctx, inputs, output)

    op.register_autograd(backward, setup_context=setup_without_zero_grads)
    _EAGER[op] = _OpSpec(impl, setup_without_zero_grads, backward)


class _EagerOp(torch.autograd.Function):
    """An operator's implementation and autograd formula applied directly: the same computation as the
    registered operator, without the dispatcher's host time (~50 µs a call, measured on CPU)."""

    @staticmethod
    def forward(ctx, spec: _OpSpec, *args):
        output = spec.impl(*args)
        spec.setup_context(ctx, args, output)
        ctx.backward_fn = spec.backward
        return output

    @staticmethod
    def backward(ctx, *grads):
        ctx.needs_input_grad = ctx.needs_input_grad[1:]  # as the formula sees them: the operator's inputs
        return (None, *ctx.backward_fn(ctx, *grads))


def call_op(op, *args):
    """`op(*args)` while torch.compile (or export) traces, so that the graph holds the operator; else the
    same implementation and formula through `_EagerOp` (no autograd node when no gradient is asked for)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if _traced(*tensors):
        return op(*args)
    spec = _EAGER[op]
    if spec.backward is not None and torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return _EagerOp.apply(spec, *args)
    return spec.impl(*args)


def _empty(like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return like.new_empty((0,), dtype=dtype)


def _or_empty(t: torch.Tensor | None, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return _empty(like, dtype) if t is None else t


def start_checks(target: torch.Tensor, num_classes: int, ignore_index: int, check_target: torch.Tensor | None,
                 count: torch.Tensor | None, count_int: int) -> list:
    """The device-side checks of a call, started (flag copied behind an event) before its kernels are
    queued; `finish_checks` reads them after. check_target: the call's whole target when the operator
    sees only some of its rows (num_valid_tokens as an int), else None (= target). count / count_int:
    the caller's num_valid_tokens as a device tensor / an int (−1: none). The count check raises first."""
    full = target if check_target is None else check_target
    checks = []
    if count is not None:
        checks.append(V_.CountCheck(full, ignore_index, count))
    elif count_int >= 0:
        checks.append(V_.CountCheck(full, ignore_index, count_int))
    checks.append(V_.check_target(full, full.shape, num_classes, ignore_index))
    return checks


def finish_checks(checks: list) -> None:
    for check in checks:
        check.raise_if_failed()


def _chunked_scalar(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, target: torch.Tensor,
                    class_weight: torch.Tensor | None, ignore_index: int, label_smoothing: float, z_loss: float,
                    softcap: float | None, reduction: str, weight_grad_accum: str, chunk_tokens: int | None,
                    need_dx: bool, need_dw: bool, need_db: bool, return_dw_out: bool, skip_ignored: bool,
                    check_target: torch.Tensor | None, count: torch.Tensor | None, count_int: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chunked strategy, reduction mean/sum: loss and gradients in one pass (three GEMMs).

    x [T, H] · w [V, H] · b [V] | None · target [T] · class_weight [V] fp32 | None. Returns (loss 0-d fp32,
    lse [T] fp32, dx [T, H], dw [V, H]: the fp32 accumulator or dW in the weight's dtype (`chunked.grad_buffers`),
    db [V] fp32, dw_out [V, H]: dW's storage, content undefined, when dw is the accumulator and `return_dw_out`
    (eager: the backward writes dW into it)), the gradients of the loss itself, rescaled by the upstream
    gradient in backward. skip_ignored: rows sorted valid-first,
    `count` of them valid: the row-count kernels skip the rest (`compacted.py`; no lse, no db)."""
    checks = start_checks(target, w.shape[0], ignore_index, check_target, count, count_int)
    opts = LossOptions(ignore_index, label_smoothing, z_loss, softcap)
    if reduction == "mean":
        denom = mean_denominator(target, class_weight, ignore_index)
        grad_scale = (1.0 / denom).reshape(1)
    else:
        grad_scale = torch.ones(1, device=x.device, dtype=torch.float32)
    if skip_ignored:
        from fusedkern.compacted import counted_loss_and_grads

        loss_tok, dx, dw, dw_out = counted_loss_and_grads(
            x, w, b, target, class_weight, opts, grad_scale, count, need_dx=need_dx, need_dw=need_dw,
            weight_grad_accum=weight_grad_accum, chunk_tokens=chunk_tokens)
        lse, db = _empty(x, torch.float32), None
    else:
        loss_tok, stats, dx, dw, db, dw_out = chunked_loss_and_grads(
            x, w, b, target, class_weight, opts, grad_scale, need_dx=need_dx, need_dw=need_dw, need_db=need_db,
            weight_grad_accum=weight_grad_accum, chunk_tokens=chunk_tokens)
        lse = lse_of(stats)
    loss = loss_tok.sum() / denom if reduction == "mean" else loss_tok.sum()
    finish_checks(checks)
    return (loss, lse, _or_empty(dx, x), _or_empty(dw, w), _or_empty(db, w, torch.float32),
            _or_empty(dw_out if return_dw_out else None, w))


# the forward operators read their checks' host flags behind an event: no CUDA graph may capture them
# (under mode="reduce-overhead" inductor leaves a graph holding one uncaptured, or partitions around it)
CHECKING_OP_TAGS = (torch.Tag.cudagraph_unsafe,)
ce_chunked_scalar = torch.library.custom_op("fusedkern::ce_chunked_scalar", _chunked_scalar, mutates_args=(),
                                            tags=CHECKING_OP_TAGS)


@ce_chunked_scalar.register_fake
def _(x, w, b, target, class_weight, ignore_index, label_smoothing, z_loss, softcap, reduction, weight_grad_accum,
      chunk_tokens, need_dx, need_dw, need_db, return_dw_out, skip_ignored, check_target, count, count_int):
    (T, H), V = x.shape, w.shape[0]
    fp32_accumulator = plan_for_grads(T, w, need_dw, weight_grad_accum, chunk_tokens).fp32_accumulator
    f32 = torch.float32
    return (x.new_empty((), dtype=f32), x.new_empty((0,) if skip_ignored else (T,), dtype=f32),
            x.new_empty((T, H)) if need_dx else _empty(x),
            w.new_empty((V, H), dtype=f32 if fp32_accumulator else w.dtype) if need_dw else _empty(w),
            w.new_empty((V,), dtype=f32) if need_db and not skip_ignored else _empty(w, f32),
            w.new_empty((V, H)) if need_dw and fp32_accumulator and return_dw_out else _empty(w))


def save_output_grads(ctx, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, need_dx: bool, need_dw: bool,
                      need_db: bool, dx, dw, db, dw_out) -> None:
    """`save_precomputed_grads` for an operator that returned (dx, dw, db, dw_out) as outputs, empty where
    not computed (dw_out is 2-D when it holds dW's storage)."""
    save_precomputed_grads(ctx, x, w, b, dx if need_dx else None, dw if need_dw else None, db if need_db else None,
                           dw_out if dw_out.dim() == 2 else None)


def _setup_chunked_scalar(ctx, inputs, output):
    x, w, b = inputs[:3]
    need_dx, need_dw, need_db, _, skip_ignored = inputs[12:17]
    save_output_grads(ctx, x, w, b, need_dx, need_dw, need_db and not skip_ignored, *output[2:])
    ctx.mark_non_differentiable(*output[1:])
    ctx.what = f"linear_cross_entropy (chunked, {'counted rows' if skip_ignored else 'mean/sum'})"


@first_order_only
def _backward_chunked_scalar(ctx, grad_loss, *_):
    return (*rescaled_grads(ctx, grad_loss, ctx.what), *([None] * 17))


register_op(ce_chunked_scalar, _chunked_scalar, _setup_chunked_scalar, _backward_chunked_scalar)


def _per_token(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, target: torch.Tensor,
               class_weight: torch.Tensor | None, ignore_index: int, label_smoothing: float, z_loss: float,
               softcap: float | None, impl: str, weight_grad_accum: str, chunk_tokens: int | None,
               forward_chunk_tokens: int | None, check_target: torch.Tensor | None, count: torch.Tensor | None,
               count_int: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss ℓ_t [T] fp32 and row statistics [2, T] fp32 (`chunked.lse_of`); the backward
    recomputes the logits (four GEMMs in all) and accepts any upstream ∂L/∂ℓ_t. Used by reduction='none',
    by impl='fused', by linear_logprobs, and (no gradient) by every loss-only call.
    forward_chunk_tokens: whole-row chunks of the loss-only pass (None: its 64 MiB tiles); chunk_tokens:
    the backward's chunks."""
    checks = start_checks(target, w.shape[0], ignore_index, check_target, count, count_int)
    if impl == "fused":
        loss_tok, stats = _fused_ops().fused_ce_forward(
            x, w, b, target, class_weight, ignore_index=ignore_index, label_smoothing=label_smoothing,
            z_loss=z_loss, softcap=softcap, return_stats=True)
    else:
        loss_tok, stats = chunked_loss(x, w, b, target, class_weight,
                                       LossOptions(ignore_index, label_smoothing, z_loss, softcap), forward_chunk_tokens)
    finish_checks(checks)
    return loss_tok, stats


ce_per_token = torch.library.custom_op("fusedkern::ce_per_token", _per_token, mutates_args=(), tags=CHECKING_OP_TAGS)


@ce_per_token.register_fake
def _(x, w, b, target, class_weight, ignore_index, label_smoothing, z_loss, softcap, impl, weight_grad_accum,
      chunk_tokens, forward_chunk_tokens, check_target, count, count_int):
    T = x.shape[0]
    return x.new_empty((T,), dtype=torch.float32), x.new_empty((2, T), dtype=torch.float32)


def _setup_per_token(ctx, inputs, output):
    x, w, b, target, class_weight, ignore_index, label_smoothing, z_loss, softcap, impl, accum, chunk_tokens = inputs[:12]
    ctx.save_for_backward(x, w, b, target, class_weight, output[1])
    ctx.options = (ignore_index, label_smoothing, z_loss, softcap, impl, accum, chunk_tokens)
    ctx.mark_non_differentiable(output[1])


@first_order_only
def _backward_per_token(ctx, grad_loss_tok, _grad_stats):
    x, w, b, target, class_weight, stats = ctx.saved_tensors
    need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
    dx, dw, db = call_op(ce_per_token_backward, x, w, b, target, class_weight, stats,
                         grad_loss_tok.float().contiguous(), *ctx.options, need_dx, need_dw, need_db and b is not None)
    return (dx if need_dx else None, dw if need_dw else None, db if need_db and b is not None else None,
            *([None] * 13))


register_op(ce_per_token, _per_token, _setup_per_token, _backward_per_token)


def _per_token_backward(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, target: torch.Tensor,
                        class_weight: torch.Tensor | None, stats: torch.Tensor, grad_tok: torch.Tensor,
                        ignore_index: int, label_smoothing: float, z_loss: float, softcap: float | None,
                        impl: str, weight_grad_accum: str, chunk_tokens: int | None, need_dx: bool, need_dw: bool,
                        need_db: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of Σ_t grad_tok[t]·ℓ_t (grad_tok [T] fp32), recomputing the logits from the saved
    statistics: (dx [T, H], dw [V, H], db [V]) in the dtypes of x, w, b; empty where not needed."""
    if impl == "fused":
        dx, dw, db = _fused_ops().fused_ce_backward(
            x, w, b, target, class_weight, stats, grad_tok, ignore_index=ignore_index,
            label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
            need_dx=need_dx, need_dw=need_dw, need_db=need_db)
    else:
        dx, dw, db = chunked_grads(
            x, w, b, target, class_weight, LossOptions(ignore_index, label_smoothing, z_loss, softcap), stats,
            grad_tok, need_dx=need_dx, need_dw=need_dw, need_db=need_db, weight_grad_accum=weight_grad_accum,
            chunk_tokens=chunk_tokens)
    return (_or_empty(_cast(dx, x.dtype), x), _or_empty(_cast(dw, w.dtype), w),
            _empty(w) if db is None else db.to(b.dtype))


ce_per_token_backward = torch.library.custom_op("fusedkern::ce_per_token_backward", _per_token_backward,
                                              mutates_args=())
_EAGER[ce_per_token_backward] = _OpSpec(_per_token_backward, None, None)  # no gradient of its own


@ce_per_token_backward.register_fake
def _(x, w, b, target, class_weight, stats, grad_tok, ignore_index, label_smoothing, z_loss, softcap, impl,
      weight_grad_accum, chunk_tokens, need_dx, need_dw, need_db):
    return (torch.empty_like(x) if need_dx else _empty(x), torch.empty_like(w) if need_dw else _empty(w),
            torch.empty_like(b) if need_db and b is not None else _empty(w))


def _logprobs_entropy(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, target: torch.Tensor,
                      ignore_index: int, softcap: float | None, logit_scale: float, with_entropy: bool,
                      weight_grad_accum: str, chunk_tokens: int | None, forward_chunk_tokens: int | None,
                      check_target: torch.Tensor | None, count: torch.Tensor | None,
                      count_int: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_per_token` for `linear_logprobs` at a temperature (chunked, no class weights, ε = z-loss = 0):
    s = softcap(z)·logit_scale in fp32 inside the row kernels, and with `with_entropy` each token's entropy
    H_t of softmax(s) [T] fp32 (0 where ignored; else [0]) from one more row statistic of the same pass.
    The backward takes both upstream gradients together (four GEMMs in all, as for `_per_token`)."""
    checks = start_checks(target, w.shape[0], ignore_index, check_target, count, count_int)
    entropy = torch.empty(x.shape[0] if with_entropy else 0, device=x.device, dtype=torch.float32)
    loss_tok, stats = chunked_loss(x, w, b, target, None, LossOptions(ignore_index, softcap=softcap,
                                                                      logit_scale=logit_scale),
                                   forward_chunk_tokens, entropy=entropy if with_entropy else None)
    finish_checks(checks)
    return loss_tok, stats, entropy


logprobs_entropy = torch.library.custom_op("fusedkern::logprobs_entropy", _logprobs_entropy, mutates_args=(),
                                           tags=CHECKING_OP_TAGS)


@logprobs_entropy.register_fake
def _(x, w, b, target, ignore_index, softcap, logit_scale, with_entropy, weight_grad_accum, chunk_tokens,
      forward_chunk_tokens, check_target, count, count_int):
    T = x.shape[0]
    f32 = torch.float32
    return (x.new_empty((T,), dtype=f32), x.new_empty((2, T), dtype=f32),
            x.new_empty((T if with_entropy else 0,), dtype=f32))


def _setup_logprobs_entropy(ctx, inputs, output):
    x, w, b, target, ignore_index, softcap, logit_scale, _, accum, chunk_tokens = inputs[:10]
    ctx.save_for_backward(x, w, b, target, output[1], output[2])
    ctx.options = (ignore_index, softcap, logit_scale, accum, chunk_tokens)
    ctx.mark_non_differentiable(output[1])


@first_order_only
def _backward_logprobs_entropy(ctx, grad_loss_tok, _grad_stats, grad_entropy):
    x, w, b, target, stats, entropy = ctx.saved_tensors
    need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
    need_db = need_db and b is not None
    if grad_loss_tok is None and grad_entropy is None:
        return (None,) * 14
    # an output nothing flowed into has no gradient (set_materialize_grads(False)): the log-probs' weight is 0,
    # an entropy used only as a metric passes [0] and the row kernel compiles its term out
    grad_tok = stats.new_zeros(stats.shape[1]) if grad_loss_tok is None else grad_loss_tok.float().contiguous()
    with_entropy = grad_entropy is not None and entropy.numel() > 0
    grad_h = grad_entropy.float().contiguous() if with_entropy else _empty(entropy)
    dx, dw, db = call_op(logprobs_entropy_backward, x, w, b, target, stats, entropy if with_entropy else grad_h,
                         grad_tok, grad_h, *ctx.options, need_dx, need_dw, need_db)
    return (dx if need_dx else None, dw if need_dw else None, db if need_db else None, *([None] * 11))


register_op(logprobs_entropy, _logprobs_entropy, _setup_logprobs_entropy, _backward_logprobs_entropy)


def _logprobs_entropy_backward(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, target: torch.Tensor,
                               stats: torch.Tensor, entropy: torch.Tensor, grad_tok: torch.Tensor,
                               grad_entropy: torch.Tensor, ignore_index: int, softcap: float | None,
                               logit_scale: float, weight_grad_accum: str, chunk_tokens: int | None, need_dx: bool,
                               need_dw: bool, need_db: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of Σ_t grad_tok[t]·ℓ_t + grad_entropy[t]·H_t, recomputing the logits chunk by chunk: one
    in-place gradient per chunk carries both terms, so the entropy costs no GEMM. entropy and grad_entropy
    [0]: no entropy term. Shapes as `_per_token_backward`."""
    with_entropy = grad_entropy.numel() > 0
    opts = LossOptions(ignore_index, softcap=softcap, logit_scale=logit_scale)
    dx, dw, db = chunked_grads(x, w, b, target, None, opts, stats, grad_tok, need_dx=need_dx, need_dw=need_dw,
                               need_db=need_db, weight_grad_accum=weight_grad_accum, chunk_tokens=chunk_tokens,
                               entropy=entropy if with_entropy else None,
                               grad_entropy=grad_entropy if with_entropy else None)
    return (_or_empty(_cast(dx, x.dtype), x), _or_empty(_cast(dw, w.dtype), w),
            _empty(w) if db is None else db.to(b.dtype))


logprobs_entropy_backward = torch.library.custom_op("fusedkern::logprobs_entropy_backward",
                                                    _logprobs_entropy_backward, mutates_args=())
_EAGER[logprobs_entropy_backward] = _OpSpec(_logprobs_entropy_backward, None, None)  # no gradient of its own


@logprobs_entropy_backward.register_fake
def _(x, w, b, target, stats, entropy, grad_tok, grad_entropy, ignore_index, softcap, logit_scale, weight_grad_accum,
      chunk_tokens, need_dx, need_dw, need_db):
    return (torch.empty_like(x) if need_dx else _empty(x), torch.empty_like(w) if need_dw else _empty(w),
            torch.empty_like(b) if need_db and b is not None else _empty(w))


# ----------------------------------------------------------------------------------------------
# validation and dispatch


def follows_autocast(fn):
    """A public entry point `fn(input, linear_weight, ..., linear_bias=...)` under `torch.autocast`: inside an
    autocast region on the input's device the floating operands are cast to the autocast dtype, as
    `F.linear` would (a differentiable cast: each gradient comes back in its parameter's own dtype, as with
    torch's own autocast), and the call runs with autocast off, so that its GEMMs, fp32 dW accumulation
    and kernels run exactly as outside. Outside autocast nothing changes (mixed dtypes are refused)."""

    @functools.wraps(fn)
    def wrapper(input, linear_weight, *args, **kwargs):
        if not isinstance(input, torch.Tensor) or input.device.type not in ("cuda", "cpu") \
                or not torch.is_autocast_enabled(input.device.type):  # (other devices are refused later)
            return fn(input, linear_weight, *args, **kwargs)
        dtype = torch.get_autocast_dtype(input.device.type)

        def cast(t):
            return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
        if "linear_bias" in kwargs:
            kwargs["linear_bias"] = cast(kwargs["linear_bias"])
        with torch.autocast(input.device.type, enabled=False):
            return fn(cast(input), cast(linear_weight), *args, **kwargs)

    return wrapper


def validate_call(input, linear_weight, target, linear_bias, *, weight=None, reduction="mean",
              ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None, impl="auto",
              weight_grad_accum="fp32", chunk_tokens=None, num_valid_tokens=None) -> None:
    """Every argument check that needs only shapes, dtypes and Python values (torch.compile traces them
    into guards). The checks that read the device — targets in range, the count — run inside the
    operators (`start_checks`)."""
    V_.check_tensor("input", input, min_ndim=1, dtypes=V_.FLOAT_DTYPES)
    V_.check_tensor("linear_weight", linear_weight, ndim=2, dtypes=V_.FLOAT_DTYPES)
    V_.check_kernel_device("input", input)
    V_.check_same_device("input", input, linear_weight=linear_weight, target=target, linear_bias=linear_bias, weight=weight)
    V_.check_same_dtype("input", input, linear_weight=linear_weight, linear_bias=linear_bias)
    vocab, hidden = linear_weight.shape
    if input.shape[-1] != hidden:
        raise ValueError(f"input's last dimension ({input.shape[-1]}) must equal linear_weight.shape[1] "
                         f"(hidden = {hidden}); linear_weight is [vocab, hidden] = {tuple(linear_weight.shape)}")
    if linear_bias is not None:
        V_.check_tensor("linear_bias", linear_bias, ndim=1)
        V_.check_shape("linear_bias", linear_bias, (vocab,), "one entry per vocabulary row of linear_weight")
    validate_loss_options(weight=weight, reduction=reduction, ignore_index=ignore_index,
                          label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap)
    if weight is not None:
        V_.check_shape("weight", weight, (vocab,), "one class weight per vocabulary entry")
    check_target_type(target, input.shape[:-1])
    validate_strategy(impl, weight_grad_accum, chunk_tokens)
    if isinstance(num_valid_tokens, torch.Tensor):
        if num_valid_tokens.numel() != 1 or num_valid_tokens.dtype not in V_.INDEX_DTYPES:
            raise TypeError("num_valid_tokens as a tensor must hold one int64/int32 count, got "
                            f"{num_valid_tokens.dtype} of shape {tuple(num_valid_tokens.shape)}")
        V_.check_same_device("target", target, num_valid_tokens=num_valid_tokens)
    elif num_valid_tokens is not None and not 0 <= V_.check_int("num_valid_tokens", num_valid_tokens) <= target.numel():
        raise ValueError(f"num_valid_tokens must be in [0, {target.numel()}] (the number of targets), a device "
                         f"tensor holding it, or None; got {num_valid_tokens}")


def check_target_type(target, expected_shape) -> None:
    """`_validation.check_target` without its range check (which reads the device: the operators run it)."""
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a torch.Tensor, got {type(target).__name__}")
    if target.dtype not in V_.INDEX_DTYPES:
        raise TypeError(f"target must hold class indices with dtype int64 or int32, got {target.dtype}")
    V_.check_shape("target", target, expected_shape, "the leading dimensions of input")


def validate_loss_options(*, weight=None, reduction="mean", ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
                          softcap=None) -> None:
    """The loss settings that do not depend on the call's tensors (checked again by `LinearCrossEntropyLoss`
    at construction). Class weights may be fp64 (they are used in fp32; `module.double()` casts the buffer);
    they get no gradient, so one that requires it is refused like torch does."""
    if weight is not None:
        V_.check_tensor("weight", weight, ndim=1, dtypes=(*V_.FLOAT_DTYPES, torch.float64))
        if weight.requires_grad and torch.is_grad_enabled():
            raise ValueError("weight (the class weights) must not require grad: no gradient flows to them "
                             "(torch.nn.functional.cross_entropy refuses it too); pass weight.detach()")
    V_.check_choice("reduction", reduction, REDUCTIONS)
    V_.check_int("ignore_index", ignore_index)
    V_.check_real("label_smoothing", label_smoothing, low=0.0, high=1.0)
    V_.check_real("z_loss", z_loss, low=0.0)
    if softcap is not None:
        V_.check_real("softcap", softcap, low=0.0, low_inclusive=False)


def validate_strategy(impl, weight_grad_accum, chunk_tokens) -> None:
    """The strategy settings shared by every entry point and `nn.Module` constructor."""
    V_.check_choice("impl", impl, IMPLS)
    V_.check_choice("weight_grad_accum", weight_grad_accum, WEIGHT_GRAD_ACCUMS)
    if chunk_tokens is not None and (V_.check_int("chunk_tokens", chunk_tokens) <= 0):
        raise ValueError(f"chunk_tokens must be a positive int or None, got {chunk_tokens}")


def resolve_impl(impl: str, x2d: torch.Tensor, w: torch.Tensor, weight_grad_accum: str,
                 chunk_tokens: int | None) -> str:
    """'auto' → 'chunked' (the faster strategy), unless its buffers — at the caller's `chunk_tokens` when
    given — do not fit the free GPU memory: then 'fused', which needs only O(tokens) extra. Under
    torch.compile 'auto' is 'chunked': the free memory is a driver query, not something a graph can hold."""
    if impl != "auto":
        return impl
    if x2d.is_cuda and not torch.compiler.is_compiling():
        need = chunked_extra_bytes(x2d.shape[0], w, weight_grad_accum, chunk_tokens)
        if not _cached_bytes_cover(need, x2d.device) and torch.cuda.mem_get_info(x2d.device)[0] < need:
            return "fused"
    return "chunked"


def chunked_extra_bytes(n_tokens: int, w: torch.Tensor, weight_grad_accum: str, chunk_tokens: int | None) -> int:
    """Bytes the chunked strategy allocates beyond inputs and gradients: its logits buffer (none when it
    lives in dW's storage) and the fp32 dW accumulator."""
    vocab, hidden = w.shape
    plan = plan_for_grads(n_tokens, w, w.requires_grad, weight_grad_accum, chunk_tokens)
    need = 0 if plan.buffer_in_dw_storage else plan.chunk_tokens * vocab * w.element_size()
    if plan.fp32_accumulator:
        need += vocab * hidden * 4
    return need


def _cached_bytes_cover(need: int, device: torch.device) -> bool:
    """Whether PyTorch's caching allocator already holds `need` free bytes (reserved − allocated: no
    driver call). In a training loop the previous step's buffers are there, so 'auto' asks the
    driver (`cudaMemGetInfo`, which can synchronize and cost far more than the few µs of this
    check) only on the first steps."""
    return need <= torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def valid_rows_first(target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Row indices with every non-ignored row first, in order (a stable sort on the device: no host sync)."""
    return torch.argsort((target == ignore_index).to(torch.uint8), stable=True)


def _loss_and_lse(x2d, w, b, y, class_weight, opts: LossOptions, reduction: str, impl: str, weight_grad_accum: str,
                  chunk_tokens, checks=(None, None, -1)):
    """(loss: 0-d for mean/sum, [T] for "none"; lse [T]) for flat inputs: the strategy dispatch.
    checks: (check_target, count, count_int) of `start_checks`."""
    grad = torch.is_grad_enabled()
    need_dx, need_dw = grad and x2d.requires_grad, grad and w.requires_grad
    need_db = grad and b is not None and b.requires_grad
    wants_grad = need_dx or need_dw or need_db
    loss_options = (opts.ignore_index, opts.label_smoothing, opts.z_loss, opts.softcap)
    if impl == "chunked" and reduction != "none" and wants_grad:
        loss, lse, *_ = call_op(ce_chunked_scalar, x2d, w, b, y, class_weight, *loss_options, reduction,
                                weight_grad_accum, chunk_tokens, need_dx, need_dw, need_db,
                                not torch.compiler.is_compiling(), False, *checks)
        return loss, lse
    loss_tok, stats = call_op(ce_per_token, x2d, w, b, y, class_weight, *loss_options, impl, weight_grad_accum,
                              chunk_tokens, None if wants_grad else chunk_tokens, *checks)
    lse = lse_of(stats)
    if reduction == "none":
        return loss_tok, lse
    if reduction == "sum":
        return loss_tok.sum(), lse
    return loss_tok.sum() / mean_denominator(y, class_weight, opts.ignore_index), lse


def loss_over_tokens(x2d, w, b, y, class_weight, opts: LossOptions, reduction: str, impl: str, weight_grad_accum: str,
                     chunk_tokens, num_valid_tokens: int | torch.Tensor | None, need_lse: bool):
    """(loss, lse [T] or None) for flat, validated inputs; the operators check the targets (and the count).

    `num_valid_tokens` (see `linear_cross_entropy`), when no lse is asked for: an int gathers exactly the
    valid rows (cuBLAS over them; autograd scatters dX back, zero in ignored rows); a device tensor sorts
    them first and lets the row-count kernels skip the rest (`compacted.py`; chunked mean/sum with
    gradients, else the dense computation). The mean's denominator is the same over the valid rows, and
    "none" puts them back among zeros."""
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
        grad = torch.is_grad_enabled()
        need_dx, need_dw = grad and x2d.requires_grad, grad and w.requires_grad
        counted = (impl == "chunked" and reduction != "none" and (need_dx or need_dw)
                   and not (b is not None and b.requires_grad and grad))
        if not counted:
            return dense(count)
        rows = valid_rows_first(y, opts.ignore_index)
        loss, *_ = call_op(
            ce_chunked_scalar, x2d.index_select(0, rows), w, b, y.index_select(0, rows), class_weight, opts.ignore_index,
            opts.label_smoothing, opts.z_loss, opts.softcap, reduction, weight_grad_accum, chunk_tokens, need_dx,
            need_dw, False, not torch.compiler.is_compiling(), True, None, num_valid_tokens, -1)
        return loss, None
    if not 0 < num_valid_tokens < y.shape[0]:
        return dense(count_int=count_int)
    rows = valid_rows_first(y, opts.ignore_index)[:num_valid_tokens]
    loss, _ = _loss_and_lse(x2d.index_select(0, rows), w, b, y.index_select(0, rows), class_weight, opts, reduction,
                            impl, weight_grad_accum, chunk_tokens, (y, None, count_int))
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
            backward) or "auto" ("chunked" unless its buffers do not fit free GPU memory).
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
    lead_shape = input.shape[:-1]
    x2d = input.reshape(-1, input.shape[-1])
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    y = target.reshape(-1).contiguous()  # the kernels index target[row] with no stride
    class_weight = None if weight is None else weight.float().contiguous()
    opts = LossOptions(ignore_index, float(label_smoothing), float(z_loss), None if softcap is None else float(softcap))
    impl = resolve_impl(impl, x2d, linear_weight, weight_grad_accum, chunk_tokens)
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
