"""Argument checks shared by every public function.

Each check raises `TypeError` (wrong type or dtype) or `ValueError` (wrong shape, range, device or
option) with a message that names the argument and says what was expected, so that a bad call
fails in Python rather than as a silent wrong answer or a crash inside a kernel.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from fusedkern._runtime import expected_device_type, interpreting

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int64, torch.int32)


def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(name: str, value, *, ndim: int | None = None, min_ndim: int | None = None,
                 dtypes: Sequence[torch.dtype] | None = None, allow_empty: bool = False) -> torch.Tensor:
    """A tensor of the expected rank and dtype, not empty."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if ndim is not None and value.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {tuple(value.shape)}")
    if min_ndim is not None and value.dim() < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dimension(s), got shape {tuple(value.shape)}")
    if dtypes is not None and value.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in ({_dtype_names(dtypes)}), got {value.dtype}")
    if not allow_empty and value.numel() == 0:
        raise ValueError(f"{name} must not be empty, got shape {tuple(value.shape)}")
    return value


def check_kernel_device(name: str, value: torch.Tensor) -> None:
    """The Triton kernels run on CUDA tensors (or CPU tensors under the interpreter)."""
    want = expected_device_type()
    if value.device.type != want:
        how = "Triton's interpreter is on (TRITON_INTERPRET=1)" if interpreting() else "kernels run on the GPU"
        raise ValueError(f"{name} must be on a {want} device because {how}; got a tensor on {value.device}")


def check_same_device(reference_name: str, reference: torch.Tensor, **others: torch.Tensor | None) -> None:
    """Each of `others` is None or a tensor on `reference`'s device (a non-tensor is a TypeError here,
    before anything reads its `.device`)."""
    for name, t in others.items():
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
        if t is not None and t.device != reference.device:
            raise ValueError(f"{name} must be on the same device as {reference_name} ({reference.device}), got {t.device}")


def check_same_dtype(reference_name: str, reference: torch.Tensor, **others: torch.Tensor | None) -> None:
    for name, t in others.items():
        if t is not None and t.dtype != reference.dtype:
            raise TypeError(f"{name} must have the same dtype as {reference_name} ({reference.dtype}), got {t.dtype}; "
                            f"call inside torch.autocast(device_type, dtype) to compute in one dtype with gradients "
                            f"in each parameter's own, or cast the operands first")


def check_shape(name: str, value: torch.Tensor, expected: Sequence[int], what: str) -> None:
    if tuple(value.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)} ({what}), got {tuple(value.shape)}")


class TargetRangeCheck:
    """The outcome of `check_target`'s range check, read when the caller has queued its kernels.

    Whether any target lies outside [0, V) is known only on the device. Reading it at once (a
    device→host sync) would block the host until the GPU has run everything queued so far, then
    leave the GPU idle while Python prepares the launches that follow (its cost: docs/results.md). Instead
    the flag is copied into pinned host memory behind an event;
    the caller queues its work, whose kernels read an out-of-range target as column 0 and never
    outside a row, then calls `raise_if_failed()`: by then the event has usually passed while the
    GPU still has that work to run. A bad target still raises before anything is returned."""

    def __init__(self, target: torch.Tensor, bad: torch.Tensor, num_classes: int, ignore_index: int, name: str):
        self._target, self._bad = target, bad
        self._message = f"{name} values must be in [0, {num_classes}) or equal ignore_index={ignore_index}"
        any_bad = bad.any()
        if target.is_cuda:
            self._flag = torch.empty((), dtype=torch.bool, pin_memory=True)
            self._flag.copy_(any_bad, non_blocking=True)  # queued on the target device's current stream
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(target.device))  # that stream, not the current device's
        else:
            self._flag, self._event = any_bad, None

    def raise_if_failed(self) -> None:
        if self._event is not None:
            self._event.synchronize()  # waits for the check only, not for the work queued after it
        if bool(self._flag):
            first = self._target[self._bad].flatten()[0].item()
            raise ValueError(f"{self._message}; found {first}")


class CountCheck:
    """`num_valid_tokens` against the target's own count, read like `TargetRangeCheck` (behind an event,
    after the kernels are queued): a wrong count raises before anything is returned, without a sync in
    the step. The kernels only ever see rows that exist, so a wrong count cannot read out of bounds."""

    def __init__(self, target: torch.Tensor, ignore_index: int, claimed: int | torch.Tensor):
        self._claimed = claimed
        self._count = (target != ignore_index).sum()
        differs = self._count != claimed
        if target.is_cuda:
            self._flag = torch.empty((), dtype=torch.bool, pin_memory=True)
            self._flag.copy_(differs, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(target.device))
        else:
            self._flag, self._event = differs, None

    def raise_if_failed(self) -> None:
        if self._event is not None:
            self._event.synchronize()
        if bool(self._flag):
            claimed = self._claimed.item() if isinstance(self._claimed, torch.Tensor) else self._claimed
            raise ValueError(f"num_valid_tokens={claimed} but target holds {self._count.item()} tokens that "
                             "are not ignore_index; pass (target != ignore_index).sum() computed where it is "
                             "free (e.g. on the CPU copy of the labels), or None")


def check_target(target: torch.Tensor, expected_shape: Sequence[int], num_classes: int, ignore_index: int,
                 name: str = "target") -> TargetRangeCheck:
    """Integer class indices of the input's leading shape, each in [0, V) or equal to ignore_index.

    Type, dtype and shape are checked at once; the range check is returned pending (see
    `TargetRangeCheck`): call `raise_if_failed()` before returning anything computed from `target`.
    """
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(target).__name__}")
    if target.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must hold class indices with dtype int64 or int32, got {target.dtype}")
    check_shape(name, target, expected_shape, "the leading dimensions of input")
    bad = ((target < 0) | (target >= num_classes)) & (target != ignore_index)
    return TargetRangeCheck(target, bad, num_classes, ignore_index, name)


def check_choice(name: str, value, choices: Sequence) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(repr(c) for c in choices)}; got {value!r}")


def check_real(name: str, value, *, low: float | None = None, high: float | None = None,
               low_inclusive: bool = True, high_inclusive: bool = True) -> float:
    """A finite Python number within [low, high] (open ends where *_inclusive is False)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if low is not None and (value < low or (value == low and not low_inclusive)):
        raise ValueError(f"{name} must be {'>=' if low_inclusive else '>'} {low}, got {value}")
    if high is not None and (value > high or (value == high and not high_inclusive)):
        raise ValueError(f"{name} must be {'<=' if high_inclusive else '<'} {high}, got {value}")
    return float(value)


def check_int(name: str, value) -> int:
    """A Python int (not a bool). Settings that reach the kernels and operators as they are (ignore_index,
    chunk_tokens) take nothing else: a numpy integer would fail there. A count goes through `normalize_count`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return value


def normalize_count(num_valid_tokens, target: torch.Tensor):
    """`num_valid_tokens` as the kernels take it: None, a Python int (from any integer type, or from a one-element
    integer tensor on the CPU when the targets live elsewhere: reading it costs no sync), or a one-element int64 /
    int32 tensor on the targets' device. Anything else raises, naming the argument."""
    if num_valid_tokens is None:
        return None
    if not isinstance(num_valid_tokens, torch.Tensor):
        if isinstance(num_valid_tokens, (bool, np.bool_)):
            raise TypeError(f"num_valid_tokens must be an integer count, got {type(num_valid_tokens).__name__}")
        try:
            return operator.index(num_valid_tokens)  # int, numpy integers, anything with __index__
        except TypeError:
            raise TypeError("num_valid_tokens must be an integer count (an int, a numpy integer or a one-element "
                            f"integer tensor) or None, got {type(num_valid_tokens).__name__}") from None
    if num_valid_tokens.numel() != 1 or num_valid_tokens.dtype.is_floating_point or num_valid_tokens.is_complex() \
            or num_valid_tokens.dtype == torch.bool:
        raise TypeError("num_valid_tokens as a tensor must hold one integer count, got "
                        f"{num_valid_tokens.dtype} of shape {tuple(num_valid_tokens.shape)}")
    if num_valid_tokens.device != target.device and num_valid_tokens.device.type == "cpu":
        return int(num_valid_tokens.item())
    check_same_device("target", target, num_valid_tokens=num_valid_tokens)
    if num_valid_tokens.dtype not in INDEX_DTYPES:
        num_valid_tokens = num_valid_tokens.to(torch.int64)
    return num_valid_tokens


# ----------------------------------------------------------------------------------------------
# the entry points' checks (shared by linear_cross_entropy, logprobs, simpo, the preference losses and
# fusedkern.distributed)


IMPLS = ("auto", "anchored", "chunked", "fused", "gluon")  # `dispatch.py` says what each runs


REDUCTIONS = ("mean", "sum", "none")


WEIGHT_GRAD_ACCUMS = ("fp32", "weight_dtype")


def start_checks(target: torch.Tensor, num_classes: int, ignore_index: int, whole_target: torch.Tensor | None,
                 count: torch.Tensor | None, count_int: int) -> list:
    """The device-side checks of a call, started (flag copied behind an event) before its kernels are
    queued; `finish_checks` reads them after. whole_target: the call's whole target when the operator
    sees only some of its rows (num_valid_tokens as an int), else None (= target). count / count_int:
    the caller's num_valid_tokens as a device tensor / an int (−1: none). The count check raises first."""
    full = target if whole_target is None else whole_target
    checks = []
    if count is not None:
        checks.append(CountCheck(full, ignore_index, count))
    elif count_int >= 0:
        checks.append(CountCheck(full, ignore_index, count_int))
    checks.append(check_target(full, full.shape, num_classes, ignore_index))
    return checks


def finish_checks(checks: list) -> None:
    for check in checks:
        check.raise_if_failed()


def validate_call(input, linear_weight, target, linear_bias, *, weight=None, reduction="mean",
              ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None, impl="auto",
              weight_grad_accum="fp32", chunk_tokens=None, num_valid_tokens=None) -> None:
    """Every argument check that needs only shapes, dtypes and Python values (torch.compile traces them
    into guards). The checks that read the device — targets in range, the count — run inside the
    operators (`start_checks`)."""
    # a batch of no token is allowed (torch returns 0 for a sum, NaN for a mean); an empty hidden size is not
    check_tensor("input", input, min_ndim=1, dtypes=FLOAT_DTYPES,
                 allow_empty=isinstance(input, torch.Tensor) and input.shape[-1:] != (0,))
    check_tensor("linear_weight", linear_weight, ndim=2, dtypes=FLOAT_DTYPES)
    check_kernel_device("input", input)
    check_same_device("input", input, linear_weight=linear_weight, target=target, linear_bias=linear_bias, weight=weight)
    check_same_dtype("input", input, linear_weight=linear_weight, linear_bias=linear_bias)
    vocab, hidden = linear_weight.shape
    if input.shape[-1] != hidden:
        raise ValueError(f"input's last dimension ({input.shape[-1]}) must equal linear_weight.shape[1] "
                         f"(hidden = {hidden}); linear_weight is [vocab, hidden] = {tuple(linear_weight.shape)}")
    if linear_bias is not None:
        check_tensor("linear_bias", linear_bias, ndim=1)
        check_shape("linear_bias", linear_bias, (vocab,), "one entry per vocabulary row of linear_weight")
    validate_loss_options(weight=weight, reduction=reduction, ignore_index=ignore_index,
                          label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap)
    if weight is not None:
        check_shape("weight", weight, (vocab,), "one class weight per vocabulary entry")
    check_target_type(target, input.shape[:-1])
    validate_strategy(impl, weight_grad_accum, chunk_tokens)
    num_valid_tokens = normalize_count(num_valid_tokens, target)
    if isinstance(num_valid_tokens, int) and not 0 <= num_valid_tokens <= target.numel():
        raise ValueError(f"num_valid_tokens must be in [0, {target.numel()}] (the number of targets), a device "
                         f"tensor holding it, or None; got {num_valid_tokens}")


def check_target_type(target, expected_shape) -> None:
    """`_validation.check_target` without its range check (which reads the device: the operators run it)."""
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a torch.Tensor, got {type(target).__name__}")
    if target.dtype not in INDEX_DTYPES:
        raise TypeError(f"target must hold class indices with dtype int64 or int32, got {target.dtype}")
    check_shape("target", target, expected_shape, "the leading dimensions of input")


def validate_loss_options(*, weight=None, reduction="mean", ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
                          softcap=None) -> None:
    """The loss settings that do not depend on the call's tensors (checked again by `LinearCrossEntropyLoss`
    at construction). Class weights may be fp64 (they are used in fp32; `module.double()` casts the buffer);
    they get no gradient, so one that requires it is refused like torch does."""
    if weight is not None:
        check_tensor("weight", weight, ndim=1, dtypes=(*FLOAT_DTYPES, torch.float64))
        if weight.requires_grad and torch.is_grad_enabled():
            raise ValueError("weight (the class weights) must not require grad: no gradient flows to them "
                             "(torch.nn.functional.cross_entropy refuses it too); pass weight.detach()")
    check_choice("reduction", reduction, REDUCTIONS)
    check_int("ignore_index", ignore_index)
    check_real("label_smoothing", label_smoothing, low=0.0, high=1.0)
    check_real("z_loss", z_loss, low=0.0)
    if softcap is not None:
        check_real("softcap", softcap, low=0.0, low_inclusive=False)


def validate_strategy(impl, weight_grad_accum, chunk_tokens) -> None:
    """The strategy settings shared by every entry point and `nn.Module` constructor."""
    check_choice("impl", impl, IMPLS)
    check_choice("weight_grad_accum", weight_grad_accum, WEIGHT_GRAD_ACCUMS)
    if chunk_tokens is not None and (check_int("chunk_tokens", chunk_tokens) <= 0):
        raise ValueError(f"chunk_tokens must be a positive int or None, got {chunk_tokens}")
