"""Sharded LM-head weights in the core: PyTorch's DTensor and FSDP2 (`torch.distributed.fsdp.fully_shard`).

A sharded weight meets fusedkern in two ways, handled here:
- Under FSDP2 a parameter is a full tensor only while FSDP holds it unsharded: inside the forward of the
  module that owns it (or of its FSDP root). `call_as_forward(lm_head, fn, hidden)` runs a loss as
  `lm_head`'s forward, through `lm_head(...)`, so that FSDP2's hooks all-gather the weight before it, and
  gather it again and reduce-scatter its gradient in backward (the Transformers patch calls the loss so).
- A DTensor weight passed to the public functions: `full_weights` gathers it with `full_tensor`, whose
  backward reduce-scatters the gradient back to the weight's own placements. The gradient is the sum over
  the ranks of each rank's gradient (DTensor's `Partial`), i.e. that of the sum of the ranks' losses.
  Under FSDP2 the gradient is FSDP2's own instead, the mean over the ranks; so a unit's weight read
  outside its forward (a sharded DTensor then) gets world size × what FSDP2 gives the other parameters:
  nothing on the tensor tells the two cases apart, so use `call_as_forward` (docs/integrations.md).
DTensor activations or targets are refused: each rank passes its own tokens as plain tensors.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _nn_module

__all__ = ["full_weights", "call_as_forward"]

_ABSENT = object()


def _dtensor_module():
    """torch.distributed.tensor if something imported it (a DTensor cannot exist otherwise), else None:
    importing it here would add seconds to `import fusedkern`."""
    return sys.modules.get("torch.distributed.tensor")


def _is_dtensor(t) -> bool:
    dt = _dtensor_module()
    return dt is not None and isinstance(t, dt.DTensor)


def _gathered(t: torch.Tensor | None) -> torch.Tensor | None:
    if not _is_dtensor(t):
        return t
    # the ranks' gradients differ (each saw its own tokens): they are summed as they go back to the shards
    return t.full_tensor(grad_placements=[_dtensor_module().Partial()] * t.device_mesh.ndim)


def full_weights(input, linear_weight, target, linear_bias=None, weight=None):
    """(linear_weight, linear_bias, weight) as full tensors: a DTensor (sharded by FSDP2, or a
    vocab-parallel head) is all-gathered differentiably; plain tensors come back unchanged.

    `input` and `target` must be plain tensors (this rank's tokens): a DTensor there raises TypeError."""
    if _dtensor_module() is None:
        return linear_weight, linear_bias, weight
    for name, t in (("input", input), ("target", target)):
        if _is_dtensor(t):
            raise TypeError(f"{name} is a DTensor ({t.placements} over {t.device_mesh}); fusedkern takes each rank's "
                            f"own tokens as a plain tensor: pass {name}.to_local(). The weight (and bias) may be DTensors: "
                            "they are gathered, and their gradients summed over the ranks back into the shards")
    return _gathered(linear_weight), _gathered(linear_bias), _gathered(weight)


def _has_forward_hooks(module: nn.Module) -> bool:
    return bool(module._forward_pre_hooks or module._forward_hooks or "_hf_hook" in module.__dict__
                or _nn_module._global_forward_pre_hooks or _nn_module._global_forward_hooks)


def call_as_forward(module: nn.Module, fn: Callable[..., Any], *args, **kwargs):
    """`fn(*args, **kwargs)` run as `module`'s forward: through `module(*args, **kwargs)`, so that the hooks
    registered on it run around `fn` as they would around the module's own forward — FSDP2's pre-forward
    all-gathers the module's parameters (`fn` reads `module.weight` as the full tensor) and registers the
    backward hooks that gather them again and reduce-scatter their gradients; accelerate's hook moves the
    inputs to the execution device. Forward hooks see `fn`'s result as the module's output. Without any
    hook on the module, `fn` is called directly.
    """
    if not _has_forward_hooks(module):
        return fn(*args, **kwargs)
    # accelerate's hook calls the module's own forward from `_old_forward`: fn goes there, under the hook
    slot = "_old_forward" if "_hf_hook" in module.__dict__ and "_old_forward" in module.__dict__ else "forward"
    previous = module.__dict__.get(slot, _ABSENT)
    module.__dict__[slot] = fn
    try:
        return module(*args, **kwargs)
    finally:
        if previous is _ABSENT:
            del module.__dict__[slot]
        else:
            module.__dict__[slot] = previous
