"""Where the kernels run: on a CUDA GPU, or through Triton's interpreter on CPU tensors (tests, CI).

The interpreter is chosen by the environment variable TRITON_INTERPRET=1, which Triton reads when a
kernel is *decorated*, so it must be set before any module under `fusedkern.kernels` is imported.
`fusedkern/__init__.py` imports this module first; when no GPU is visible and the user has not
decided, it switches the interpreter on so that the same kernels run (slowly) on CPU.
Nothing here touches the CUDA driver at import time beyond `torch.cuda.is_available()`.
"""

from __future__ import annotations

import functools
import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def interpreting() -> bool:
    """True when Triton kernels run in the interpreter (CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


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
