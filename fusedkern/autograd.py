"""The autograd plumbing of fusedkern's operators: custom operators with fake implementations and autograd
formulas (`register_op`, `call_op`), gradients formed in the forward pass and rescaled in backward
(`save_precomputed_grads`, `rescaled_grads`), first-order-only backwards, and the autocast rule of the
public entry points (`follows_autocast`).

Why custom operators: `torch.compile` traces a call as one node per operator with no graph break
(`fullgraph=True` works). Outside tracing (`call_op`) the same implementation and formula run through a
plain autograd.Function, which costs less host time than the dispatcher, and the backward rescales the
saved gradients in place. A gradient that is not asked for comes back as an empty [0] tensor
(`absent`): an operator returns tensors, never None.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from fusedkern.kernels.scale import scale_into, scale_unless_one_


def is_traced(*tensors: torch.Tensor) -> bool:
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
    if is_traced(grad, scale):  # torch.compile traces the backward: no in-place Triton launch, same rounding
        return (grad * scale).to(out_dtype)
    if grad.dtype == out_dtype:
        return scale_unless_one_(grad, scale)
    if out is None:
        out = torch.empty(grad.shape, device=grad.device, dtype=out_dtype)
    return scale_into(grad, scale, out)


def save_precomputed_grads(ctx, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, dx, dw, db,
                           dw_out: torch.Tensor | None = None) -> None:
    """For Functions that form their gradients in the forward pass: keep them for `rescaled_grads`.
    dw_out: dW's storage in the weight's dtype when dw is an fp32 accumulator (`chunked.grad_buffers`)."""
    ctx.save_for_backward(dx, dw, db, dw_out)
    ctx.grad_meta = (x.shape, x.dtype, w.dtype, None if b is None else b.dtype)
    ctx.used = False


def save_output_grads(ctx, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, need_dx: bool, need_dw: bool,
                      need_db: bool, dx, dw, db, dw_out) -> None:
    """`save_precomputed_grads` for an operator that returned (dx, dw, db, dw_out) as outputs, empty where
    not computed (dw_out is 2-D when it holds dW's storage)."""
    save_precomputed_grads(ctx, x, w, b, dx if need_dx else None, dw if need_dw else None, db if need_db else None,
                           dw_out if dw_out.dim() == 2 else None)


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


def cast_or_none(grad: torch.Tensor | None, dtype: torch.dtype):
    return None if grad is None else grad.to(dtype)


# the forward operators read their checks' host flags behind an event: no CUDA graph may capture them
# (under mode="reduce-overhead" inductor leaves a graph holding one uncaptured, or partitions around it)
CHECKING_OP_TAGS = (torch.Tag.cudagraph_unsafe,)


class _OpSpec(NamedTuple):
    impl: Callable
    setup_context: Callable | None  # None: an operator with no gradient (a backward's)
    backward: Callable | None


_EAGER: dict = {}


def register_op(op, impl: Callable, setup_context: Callable, backward: Callable) -> None:
    """The autograd formula of `op` (a `torch.library.custom_op` of `impl`), for the dispatcher and for `call_op`.

    The operators return their precomputed gradients as (non-differentiable) outputs; autograd would hand
    the backward a zero-filled gradient of each — a transient dX + dW (+1 GiB at V·H = 128256·4096 in
    bf16) — so the formula sees None for outputs nothing flowed into."""

    def setup_without_zero_grads(ctx, inputs, output):
        ctx.set_materialize_grads(False)
        setup_context(ctx, inputs, output)

    op.register_autograd(backward, setup_context=setup_without_zero_grads)
    _EAGER[op] = _OpSpec(impl, setup_without_zero_grads, backward)


def register_op_without_grad(op, impl: Callable) -> None:
    """`call_op` for an operator with no gradient of its own (a backward's)."""
    _EAGER[op] = _OpSpec(impl, None, None)


class _EagerOp(torch.autograd.Function):
    """An operator's implementation and autograd formula applied directly: the same computation as the
    registered operator, without the dispatcher's host time."""

    @staticmethod
    def forward(ctx, spec: _OpSpec, *args):
        output = spec.impl(*args)
        spec.setup_context(ctx, args, output)
        ctx.backward_fn = spec.backward
        return output

    @staticmethod
    def backward(ctx, *grads):
        if not getattr(ctx, "inputs_only", False):  # once: a retained graph's second backward sees them trimmed
            ctx.needs_input_grad = ctx.needs_input_grad[1:]  # as the formula sees them: the operator's inputs
            ctx.inputs_only = True
        return (None, *ctx.backward_fn(ctx, *grads))


def call_op(op, *args):
    """`op(*args)` while torch.compile (or export) traces, so that the graph holds the operator; else the
    same implementation and formula through `_EagerOp` (no autograd node when no gradient is asked for)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if is_traced(*tensors):
        return op(*args)
    spec = _EAGER[op]
    if spec.backward is not None and torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return _EagerOp.apply(spec, *args)
    return spec.impl(*args)


def absent(like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return like.new_empty((0,), dtype=dtype)


def or_absent(t: torch.Tensor | None, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return absent(like, dtype) if t is None else t


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
