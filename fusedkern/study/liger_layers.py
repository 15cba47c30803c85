"""Liger-Kernel's layer kernels (RoPE, RMSNorm, SwiGLU) beside fusedkern's head, on CPU and several runs in one
process: what tests/test_integrations_liger.py and the training table's tiny mode (scripts/gpu_train_table.py
--tiny) need. Liger is optional (`pip install -e '.[liger]'`); it is imported only inside these functions.

- `interpreted()`: Liger 0.8.5's RMSNorm and SwiGLU kernels do not run in Triton 3.6's interpreter as they are,
  for two reasons of the interpreter's. It passes a Python float kernel argument on as a Python float (the compiled
  launcher passes an fp32 scalar), and the kernels call `.to(tl.float32)` on `eps` and on SwiGLU's multiplier
  (AttributeError). And it implements none of libdevice's functions, where RMSNorm takes its `rsqrt` from (the call
  returns None). Inside the block, float arguments are fp32 scalars, as on the GPU, and RMSNorm's `rsqrt` is
  `1 / sqrt`. Liger's RoPE kernel runs without either. The GPU runs Liger's kernels as they are. fp32 only: on bf16
  tensors Liger's SwiGLU and RoPE kernels give NaN in the interpreter (not on a GPU), so CPU runs stay in fp32.
- `liger_patches_undone()`: `apply_liger_kernel_to_*` replaces attributes of Transformers' modeling modules (the
  RoPE function, the RMSNorm and MLP classes; with `cross_entropy=True`, torch's `F.cross_entropy`) for the whole
  process, beside the modules of the model instance it is given. On exit of the block they are what they were, so a
  later run in the same process runs PyTorch's layers again.
- `liger_layers(model)`: which of a model's layers run Liger's kernels.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys

import triton.language as tl  # the interpreter runs a jit function only where its globals hold triton.language

from fusedkern._runtime import interpreting

#: `apply_liger_kernel_to_*` / `liger_kernel_config` options for Liger's layer kernels only: no Liger loss, so the
#: model's forward (and a fused head installed on it) stays as it is
LAYERS_ONLY = {"fused_linear_cross_entropy": False, "cross_entropy": False}


@functools.cache
def _rsqrt():
    import triton

    @triton.jit
    def rsqrt(x):
        return 1.0 / tl.sqrt(x)

    return rsqrt


@contextlib.contextmanager
def interpreted():
    """Liger's RMSNorm and SwiGLU kernels runnable on CPU tensors in Triton's interpreter, for the block (see the
    module docstring). RuntimeError where the interpreter is not on (a GPU runs Liger's kernels as they are)."""
    import numpy as np
    from triton.runtime import interpreter

    if not interpreting():
        raise RuntimeError("interpreted() is for CPU tensors under Triton's interpreter (TRITON_INTERPRET=1)")
    rms_norm = importlib.import_module("liger_kernel.ops.rms_norm")
    convert, rsqrt = interpreter._implicit_cvt, rms_norm.rsqrt

    def implicit_cvt(arg):
        if isinstance(arg, float):  # as the compiled launcher passes it: an fp32 scalar
            return tl.tensor(interpreter.TensorHandle(np.array([arg], dtype=np.float32), tl.float32), tl.float32)
        return convert(arg)

    interpreter._implicit_cvt, rms_norm.rsqrt = implicit_cvt, _rsqrt()
    try:
        yield
    finally:
        interpreter._implicit_cvt, rms_norm.rsqrt = convert, rsqrt


def _modeling_modules(model_types) -> dict:
    for model_type in model_types:
        importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    return {name: module for name, module in list(sys.modules.items())
            if module is not None and name.startswith("transformers.models.")
            and name.rpartition(".")[2].startswith("modeling_")}


@contextlib.contextmanager
def liger_patches_undone(model_types=("llama", "qwen3")):
    """On exit, every attribute of the loaded `transformers.models.*.modeling_*` modules (those of `model_types`
    imported first, so that their state before the block is known) and torch's `F.cross_entropy` is back to what it
    was before the block: Liger's process-wide replacements are undone (its instance patches stay on their models)."""
    import torch.nn.functional as F

    modules = _modeling_modules(model_types)
    before = {name: dict(vars(module)) for name, module in modules.items()}
    cross_entropy = F.cross_entropy
    try:
        yield
    finally:
        for name, module in modules.items():
            for attr, value in before[name].items():
                if vars(module).get(attr) is not value:
                    setattr(module, attr, value)
        F.cross_entropy = cross_entropy


def _liger_module(function) -> str:
    """The module a function is defined in when it is one of Liger's, else ""."""
    function = getattr(function, "__func__", function)
    module = getattr(function, "__module__", None) or ""
    return module if module.startswith("liger_kernel") else ""


def liger_layers(model) -> dict[str, list[str]]:
    """{"rms_norm": [module names], "swiglu": [...], "other": [...], "rope": [modeling module names]}: the model's
    modules whose forward is Liger's (patched on the instance, or built from Liger's classes), by the Liger module
    it comes from, and the modeling module of the model's class when its RoPE function is Liger's (a process-wide
    replacement)."""
    found = {"rms_norm": [], "swiglu": [], "other": [], "rope": []}
    for name, module in model.named_modules():
        source = _liger_module(module.forward).rpartition(".")[2]
        if source:
            found[source if source in found else "other"].append(name)
    modeling = sys.modules.get(type(model).__module__)
    if modeling is not None and _liger_module(getattr(modeling, "apply_rotary_pos_emb", None)):
        found["rope"].append(modeling.__name__)
    return found
