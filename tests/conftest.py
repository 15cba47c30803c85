"""Test set-up: CPU runs the Triton kernels through the interpreter (fusedkern._runtime switches it on
before any kernel module is imported); tests marked `gpu` need CUDA and are skipped without it."""

import pytest
import torch

import fusedkern  # noqa: F401  (imports _runtime first)
from fusedkern._runtime import interpreting

DEVICE = "cpu" if interpreting() else "cuda"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available() and not interpreting():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    return DEVICE
