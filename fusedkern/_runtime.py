"""Where the kernels run: on a CUDA GPU, or through Triton's interpreter on CPU tensors (tests, CI).

The interpreter is chosen by the environment variable TRITON_INTERPRET=1, which Triton reads when a
kernel is *decorated*, so it must be set before any module under `fusedkern.kernels` is imported.
`fusedkern/__init__.py` imports this module first; when no GPU is visible and the user has not
decided, it switches the interpreter on so that the same kernels run (slowly) on CPU.
Nothing here touches the CUDA driver at import time beyond `torch.cuda.is_available()`.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

logger = logging.getLogger(__name__)

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    logger.info("no CUDA GPU is visible: fusedkern's Triton kernels run in Triton's interpreter on CPU tensors "
                "(TRITON_INTERPRET=1; slow, for tests and small shapes)")


def interpret_triton_helpers_imported_earlier() -> int:
    """Turn the `@triton.jit` functions that Triton's own modules defined before the interpreter was switched on
    into interpreted ones; returns how many were replaced.

    Why: Triton chooses compiled or interpreted when a function is decorated. When `triton.language` was imported
    before fusedkern (by Transformers, TRL, `import triton.language`), its helpers (`tl.sum`'s combine function,
    `tl.max`, `tl.cdiv`, ...) are compiled-kernel objects, and every interpreted kernel that calls one raised
    "Cannot call @triton.jit'd outside of the scope of a kernel". Swapping them in Triton's modules and in
    `tl.tensor`'s methods makes the import order irrelevant; fusedkern's own kernels are decorated after the switch."""
    import sys

    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    swapped: dict[int, object] = {}

    def replace_in(namespace: dict, owner) -> None:
        for name, value in list(namespace.items()):
            if type(value) is JITFunction:
                if id(value) not in swapped:
                    swapped[id(value)] = InterpretedFunction(value.fn, version=value.version, debug=value.debug,
                                                             noinline=value.noinline,
                                                             do_not_specialize=value.do_not_specialize)
                setattr(owner, name, swapped[id(value)])

    for module_name, module in list(sys.modules.items()):
        if module is not None and module_name.split(".")[0] == "triton":
            replace_in(vars(module), module)
    if "triton.language" in sys.modules:
        tensor_class = sys.modules["triton.language"].core.tensor
        replace_in(dict(vars(tensor_class)), tensor_class)
    return len(swapped)


def interpreting() -> bool:
    """True when Triton kernels run in the interpreter (CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def round_bf16_like_the_gpu() -> None:
    """Make the interpreter round fp32 → bf16 to nearest even, as the GPU does (`cvt.rn.bf16.f32`).

    Why: Triton 3.6's interpreter truncates that conversion (a kernel's `.to(tl.bfloat16)` and a store of
    fp32 values into a bf16 tensor), so every bf16 value a kernel writes on CPU is up to one ulp further
    from the truth than the GPU's, enough for a rescaled bf16 gradient to fail the 2× accuracy rule in some
    random draws on CPU (docs/results.md, "Tests"). The other conversions are left to Triton;
    `tests/test_runtime.py` checks this one against torch on every run, so a Triton whose interpreter changes
    is noticed."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    truncating = builder.cast_impl
    if getattr(truncating, "rounds_bf16_to_nearest", False):
        return

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            data = np.asarray(src.data, dtype=np.float32)
            bits = torch.from_numpy(data.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            return interpreter.TensorHandle(bits.reshape(data.shape), dst_type.scalar)
        return truncating(self, src, dst_type)

    cast_impl.rounds_bf16_to_nearest = True
    builder.cast_impl = cast_impl


if interpreting():
    if swapped := interpret_triton_helpers_imported_earlier():
        logger.info("triton was imported before fusedkern: %d of its @triton.jit helpers were made interpreted",
                    swapped)
    round_bf16_like_the_gpu()


def autotune_configs(configs: list) -> list:
    """All configs on a GPU; only the first in the interpreter (autotuning needs a driver)."""
    return configs[:1] if interpreting() else configs


def expected_device_type() -> str:
    return "cpu" if interpreting() else "cuda"


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (launch geometry); 4 for CPU tensors under the
    interpreter, where geometry does not matter."""
    if device.type != "cuda":
        return 4
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())
