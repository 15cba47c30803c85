"""The autograd plumbing of fusedkern's operators: custom operators with fake implementations and autograd
formulas (`define_op`: tensors plus one frozen options dataclass, flattened into the operator's scalars and
rebuilt in one place; the options every operator with gradients shares are one nested `GradOptions`), gradients
formed in the forward pass and rescaled in backward
(`save_precomputed_grads`, `rescaled_grads`), first-order-only backwards, and the autocast rule of the
public entry points (`follows_autocast`).

Why custom operators: `torch.compile` traces a call as one node per operator with no graph break
(`fullgraph=True` works). Outside tracing (`Op.__call__`) the same implementation and formula run through a
plain autograd.Function, which costs less host time than the dispatcher, and the backward rescales the
saved gradients in place. A gradient that is not asked for comes back as an empty [0] tensor
(`absent`): an operator returns tensors, never None.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import typing
from collections.abc import Callable, Sequence

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


# ----------------------------------------------------------------------------------------------
# operators: tensors plus one frozen options dataclass, flattened into the schema's scalars in one place


@dataclasses.dataclass(frozen=True)
class GradOptions:
    """What every operator that forms gradients is told, nested in its options dataclass (`define_op` flattens it):
    the chunk plan's inputs (`weight_grad_accum`, `chunk_tokens`), which gradients to form (`need_dx`, `need_dw`,
    `need_db`), and whether dW's own storage comes back as an output (`return_dw_out`: eager, where the backward
    writes dW into it; not while torch.compile traces). A per-token forward carries the plan's inputs for its
    backward and asks for no gradient; its backward operator gets the same options with the gradients set
    (`needing`)."""

    weight_grad_accum: str
    chunk_tokens: int | None
    need_dx: bool = False
    need_dw: bool = False
    need_db: bool = False
    return_dw_out: bool = False

    @classmethod
    def asked(cls, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, weight_grad_accum: str,
              chunk_tokens: int | None) -> GradOptions:
        """The gradients autograd will ask of x, w and b in this call (b may be None); dW's storage comes back when
        eager."""
        grad = torch.is_grad_enabled()
        return cls(weight_grad_accum, chunk_tokens, grad and x.requires_grad, grad and w.requires_grad,
                   grad and b is not None and b.requires_grad, return_dw_out=not torch.compiler.is_compiling())

    @property
    def wanted(self) -> bool:
        return self.need_dx or self.need_dw or self.need_db

    def needing(self, need_dx: bool, need_dw: bool, need_db: bool) -> GradOptions:
        return dataclasses.replace(self, need_dx=need_dx, need_dw=need_dw, need_db=need_db)

    def outputs(self, x: torch.Tensor, w: torch.Tensor, dx, dw, db, dw_out) -> tuple[torch.Tensor, ...]:
        """(dx, dw, db, dw_out) of a pass that formed them, as an operator returns them: [0] where not formed, db in
        fp32, dw_out only with `return_dw_out`."""
        return (or_absent(dx, x), or_absent(dw, w), or_absent(db, w, torch.float32),
                or_absent(dw_out if self.return_dw_out else None, w))

    def fake_outputs(self, x: torch.Tensor, w: torch.Tensor, rows: int, fp32_accumulator: bool,
                     need_db: bool) -> tuple[torch.Tensor, ...]:
        """`outputs`' shapes and dtypes, for an operator's fake implementation: dx [rows, H] in x's dtype, dw the
        fp32 accumulator or dW in w's, db [V] fp32 where `need_db`, dw_out [V, H] beside an accumulator."""
        (V, H), f32 = w.shape, torch.float32
        return (x.new_empty((rows, H)) if self.need_dx else absent(x),
                w.new_empty((V, H), dtype=f32 if fp32_accumulator else w.dtype) if self.need_dw else absent(w),
                w.new_empty((V,), dtype=f32) if need_db else absent(w, f32),
                w.new_empty((V, H)) if self.need_dw and fp32_accumulator and self.return_dw_out else absent(w))


_SCHEMA_TYPES = {int: "SymInt", float: "float", bool: "bool", str: "str"}


def _option_fields(cls) -> list[tuple[tuple[str, ...], str]]:
    """(attribute path, schema type) of each scalar of an options dataclass, in field order; a field that is
    itself a dataclass (e.g. the loss's own options) contributes its scalars in its place."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out += [((f.name, *path), schema) for path, schema in _option_fields(tp)]
            continue
        args = typing.get_args(tp)
        optional = len(args) == 2 and type(None) in args  # X | None
        base = next(a for a in args if a is not type(None)) if optional else tp
        if base not in _SCHEMA_TYPES:
            raise TypeError(f"{cls.__name__}.{f.name}: an operator option is an int, float, bool or str (or None "
                            f"of one) or a dataclass of them, got {tp}")
        out.append(((f.name,), _SCHEMA_TYPES[base] + ("?" if optional else "")))
    return out


def _builder(cls) -> Callable:
    """build(values: iterator) → cls(...) from the scalars in `_option_fields` order (nested dataclasses rebuilt)."""
    hints = typing.get_type_hints(cls)
    parts = [(f.name, _builder(hints[f.name]) if dataclasses.is_dataclass(hints[f.name]) else None)
             for f in dataclasses.fields(cls)]

    def build(values):
        return cls(**{name: next(values) if sub is None else sub(values) for name, sub in parts})

    return build


class Op:
    """A fusedkern operator: a `torch.library.custom_op` whose arguments are tensors and one frozen options
    dataclass, called as `op(*tensors, options)`.

    The options are flattened into the operator's scalar arguments (its schema is built from the dataclass's
    fields) and rebuilt here, so `impl(*tensors, options)`, `fake(*tensors, options)`,
    `setup_context(ctx, tensors, options, output)` and `backward(ctx, *grads)` never see a positional list. The
    backward returns the gradients of the leading tensors (x, w, b); every other input gets None here, and it
    sees `ctx.needs_input_grad` of the tensors only. While torch.compile (or export) traces, the call is the
    registered operator (one graph node); otherwise the same implementation and formula run through a plain
    autograd.Function (`_EagerOp`), which costs less host time than the dispatcher, and with no gradient asked
    for, the implementation alone.

    The operators return their precomputed gradients as (non-differentiable) outputs; autograd would hand the
    backward a zero-filled gradient of each (a transient dX + dW), so the formula sees None for outputs nothing
    flowed into. An operator without `backward` has no gradient of its own (a backward's)."""

    def __init__(self, name: str, tensor_args: Sequence[str], options_cls: type, outputs: int, impl: Callable,
                 fake: Callable, setup_context: Callable | None = None, backward: Callable | None = None,
                 tags: Sequence[torch.Tag] = ()):
        fields = _option_fields(options_cls)
        names = [a.rstrip("?") for a in tensor_args] + [path[-1] for path, _ in fields]
        if len(set(names)) != len(names):
            raise ValueError(f"{name}: argument names repeat: {names}")
        args = [f"Tensor? {a[:-1]}" if a.endswith("?") else f"Tensor {a}" for a in tensor_args]
        args += [f"{schema} {path[-1]}" for path, schema in fields]
        returns = "Tensor" if outputs == 1 else f"({', '.join(['Tensor'] * outputs)})"
        self.options_cls, self.n_tensors, self._paths = options_cls, len(tensor_args), [p for p, _ in fields]
        self.impl, self._setup_context = impl, setup_context
        self._build = _builder(options_cls)
        self.backward = None if backward is None else first_order_only(backward)
        n = self.n_tensors
        self.custom_op = torch.library.custom_op(
            name, lambda *a: impl(*a[:n], self._build(iter(a[n:]))), mutates_args=(),
            schema=f"({', '.join(args)}) -> {returns}", tags=tuple(tags))
        self.custom_op.register_fake(lambda *a: fake(*a[:n], self._build(iter(a[n:]))))
        if backward is not None:
            self.custom_op.register_autograd(
                self._backward, setup_context=lambda ctx, inputs, output: self.setup_context(
                    ctx, inputs[:n], self._build(iter(inputs[n:])), output))

    def flat_args(self, *args) -> tuple:
        """The registered operator's arguments for `op(*tensors, options)`: the tensors, then the options'
        scalars (what `torch.library.opcheck` takes)."""
        *tensors, options = args
        assert len(tensors) == self.n_tensors and isinstance(options, self.options_cls), (len(tensors), options)
        flat = list(tensors)
        for path in self._paths:
            value = options
            for name in path:
                value = getattr(value, name)
            flat.append(value)
        return tuple(flat)

    def setup_context(self, ctx, tensors, options, output) -> None:
        ctx.set_materialize_grads(False)
        self._setup_context(ctx, tensors, options, output)

    def _backward(self, ctx, *grads):
        """The formula's gradients of the leading tensors, then one None for each further input as autograd
        counts them (the registered operator's flat scalars, or `_EagerOp`'s options)."""
        needs = ctx.needs_input_grad
        ctx.needs_input_grad = needs[:self.n_tensors]  # as the formula sees them: the tensors only
        try:
            result = tuple(self.backward(ctx, *grads))
        finally:
            ctx.needs_input_grad = needs
        return result + (None,) * (len(needs) - len(result))

    def __call__(self, *args):
        *tensors, options = args
        present = [t for t in tensors if t is not None]
        if is_traced(*present):
            return self.custom_op(*self.flat_args(*args))
        if self.backward is not None and torch.is_grad_enabled() and any(t.requires_grad for t in present):
            return _EagerOp.apply(*tensors, (self, options))
        return self.impl(*tensors, options)


def define_op(name: str, tensor_args: Sequence[str], options_cls: type, outputs: int, impl: Callable,
              fake: Callable, setup_context: Callable | None = None, backward: Callable | None = None,
              tags: Sequence[torch.Tag] = ()) -> Op:
    """An `Op` named `name` ("fusedkern::..."): tensor_args name its tensors, a trailing "?" for one that may be
    None; options_cls is the frozen dataclass of everything else; outputs: how many tensors it returns."""
    return Op(name, tensor_args, options_cls, outputs, impl, fake, setup_context, backward, tags)


class _EagerOp(torch.autograd.Function):
    """An operator's implementation and autograd formula applied directly: the same computation as the
    registered operator, without the dispatcher's host time. forward(*tensors, (op, options))."""

    @staticmethod
    def forward(ctx, *args):
        *tensors, (op, options) = args
        output = op.impl(*tensors, options)
        op.setup_context(ctx, tuple(tensors), options, output)
        ctx.op = op
        return output

    @staticmethod
    def backward(ctx, *grads):
        return ctx.op._backward(ctx, *grads)


# the keys the dispatcher excludes while an operator's body runs (below autograd)
_AUTOGRAD_KEYS = (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.AutogradOther,
                  torch._C.DispatchKey.AutogradNestedTensor, torch._C.DispatchKey.ADInplaceOrView)


@contextlib.contextmanager
def differentiable():
    """`torch.enable_grad()` that also works inside an operator's body: the dispatcher runs a registered operator's
    implementation below autograd (its keys excluded), where a formula that differentiates its own small tail
    (`torch.autograd.grad` of an O(R·S) function of the log-probs) would record nothing. The keys are included
    again for the block; outside an operator (eager) nothing else changes."""
    with contextlib.ExitStack() as stack:
        for key in _AUTOGRAD_KEYS:
            stack.enter_context(torch._C._SetExcludeDispatchKeyGuard(key, False))
        stack.enter_context(torch.enable_grad())
        yield


def grads_formed_in_forward(what: str | Callable[[typing.Any], str]) -> tuple[Callable, Callable]:
    """(setup_context, backward) for `define_op` of an operator that forms its gradients in the forward pass and
    returns (loss, outputs without gradient ..., dx, dw, db, dw_out): the last four are saved
    (`save_output_grads`, by the options' `grads`: a `GradOptions`) and the backward rescales them by the
    loss's upstream gradient. what: the loss's name in errors (or a function of the options giving it)."""

    def setup_context(ctx, tensors, options, output):
        x, w, b = tensors[:3]
        grads = options.grads
        save_output_grads(ctx, x, w, b, grads.need_dx, grads.need_dw, grads.need_db and b is not None, *output[-4:])
        ctx.mark_non_differentiable(*output[1:])
        ctx.what = what if isinstance(what, str) else what(options)

    def backward(ctx, grad_loss, *_):
        return rescaled_grads(ctx, grad_loss, ctx.what)

    return setup_context, backward


def recomputed_in_backward(backward_op: Callable) -> tuple[Callable, Callable]:
    """(setup_context, backward) for `define_op` of an operator over (x, w, b, target, class_weight, ...) that returns
    (per-token loss [T], row statistics [2, T]) and whose gradients recompute the logits: the five tensors and the
    statistics are saved, and the backward calls `backward_op(x, w, b, target, class_weight, stats, grad_tok,
    options)` with the gradients asked for set in the options' `grads` (`with_grads`), which returns (dx, dw, db),
    [0] where not wanted."""

    def setup_context(ctx, tensors, options, output):
        ctx.save_for_backward(*tensors[:5], output[1])
        ctx.options = options
        ctx.mark_non_differentiable(output[1])

    def backward(ctx, grad_loss_tok, _grad_stats):
        x, w, b, target, class_weight, stats = ctx.saved_tensors
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        need_db = need_db and b is not None
        dx, dw, db = backward_op(x, w, b, target, class_weight, stats, grad_loss_tok.float().contiguous(),
                                 with_grads(ctx.options, need_dx, need_dw, need_db))
        return dx if need_dx else None, dw if need_dw else None, db if need_db else None

    return setup_context, backward


def with_grads(options, need_dx: bool, need_dw: bool, need_db: bool):
    """An operator's options (a dataclass with a `grads: GradOptions` field) asking for these gradients: what its
    forward hands its backward operator."""
    return dataclasses.replace(options, grads=options.grads.needing(need_dx, need_dw, need_db))


def fake_grads(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, grads: GradOptions) -> tuple:
    """(dx, dw, db) as a backward operator returns them: in x's, w's and b's shapes and dtypes, [0] where `grads`
    does not ask for them (the fake implementation of such an operator)."""
    return (torch.empty_like(x) if grads.need_dx else absent(x),
            torch.empty_like(w) if grads.need_dw else absent(w),
            torch.empty_like(b) if grads.need_db and b is not None else absent(w))


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
