"""Test set-up: CPU runs the Triton kernels through the interpreter (fusedkern._runtime switches it on
before any kernel module is imported); tests marked `gpu` need CUDA and are skipped without it."""

import contextlib
import fcntl
import gc
import os
import tempfile
import warnings

import pytest
import torch

import fusedkern  # noqa: F401  (imports _runtime first)
from fusedkern._runtime import interpreting
from tests import _interpreter

DEVICE = "cpu" if interpreting() else "cuda"

if interpreting():
    # `pytest` runs two workers (addopts: -n 2) on the CI's two cores: torch on one intra-op thread each, and so the
    # subprocesses the tests start (examples, scripts, notebooks). More threads than cores made tiny ops wait on
    # thread-pool wake-ups (half the CPU time of the Transformers tests).
    torch.set_num_threads(1)
    for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_name, "1")
    if _interpreter.supported():
        _interpreter.install()


#: `--gpu-quick`: one GPU accuracy test of each kernel the library ships, at a realistic bf16 shape, with every
#: option on where the test has such a case (node ids; ≤ 3 min on an H100 from a cold Triton cache):
#: ce_rows and the cuBLAS chunked path, the fused strategy, the row-count GEMMs (TMA and pointer paths), the
#: compacted device-count path, the SimPO and preference losses built on them, the Gluon loss-only pass (sm_90) and
#: the gradients' rescale and cast (`kernels/scale.py`); and two bitwise-determinism checks where the bits are
#: likeliest to move: the row-count GEMMs (TMA reduce-add into fp32 dW, dX's tile width switching after its first
#: call) and the Gluon statistics pass with a temperature, the entropy and the recomputed backward
GPU_QUICK = (
    "tests/test_linear_cross_entropy.py::test_gpu_bf16_realistic[none-all-chunked]",
    "tests/test_linear_cross_entropy.py::test_gpu_bf16_realistic[mean-all-fused]",
    "tests/test_fused_ce.py::TestGPU::test_bf16_realistic[all]",
    "tests/test_rowcount_gemm.py::test_gpu_bf16_no_sync[8192]",
    "tests/test_rowcount_gemm.py::test_gpu_bf16_no_sync[8003]",
    "tests/test_num_valid_tokens.py::test_gpu_device_count_bf16_matches_fp64[4096-fp32]",
    "tests/test_num_valid_tokens.py::test_gpu_masked_bf16_matches_fp64[mean-chunked]",
    "tests/test_simpo.py::test_gpu_simpo_bf16_realistic[None]",
    "tests/test_preference.py::test_gpu_bf16_realistic[sigmoid]",
    "tests/test_distillation.py::test_gpu_bf16_realistic[jsd-tau2]",
    "tests/test_gluon_loss_only.py::test_gpu_loss_only_bf16_matches_fp64[none]",
    "tests/test_scale.py::test_gpu_scale_kernel_at_an_lm_heads_size",
    "tests/test_determinism.py::test_gpu_same_bits_on_repeat[ce-device-count]",
    "tests/test_determinism.py::test_gpu_same_bits_on_repeat[logprobs-entropy]",
)


def pytest_addoption(parser):
    parser.addoption("--gpu-quick", action="store_true",
                     help="run only GPU_QUICK (tests/conftest.py): each shipped kernel's GPU accuracy test")


def pytest_collection_finish(session):
    """What collection imported (torch, Transformers, TRL: millions of objects) goes into the collector's permanent
    generation: Accelerate calls gc.collect() whenever a Trainer is built or freed (0.2 s a call over all of it),
    and the TRL tests build a hundred."""
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config, items):
    if config.getoption("--gpu-quick"):
        keep = [item for item in items if item.nodeid in GPU_QUICK]
        config.hook.pytest_deselected(items=[item for item in items if item.nodeid not in GPU_QUICK])
        items[:] = keep
    if torch.cuda.is_available() and not interpreting():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _is_out_of_memory(error: BaseException) -> bool:
    text = str(error)
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and ("CUBLAS_STATUS_ALLOC_FAILED" in text or "out of memory" in text))


@contextlib.contextmanager
def _flock(path: str, mode: int):
    with open(path, "a") as handle:
        fcntl.flock(handle, mode)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """`pytest -n N` runs N workers on one GPU: two memory-heavy tests at once can run out of memory where either
    alone fits (seen on an H100 with 3 workers). Every GPU test runs under a shared lock; one that runs out of memory
    is run again alone (an exclusive lock: the others finish their current test and wait). A gate lock taken before
    either keeps the waiting rerun ahead of new tests. A test that runs out of memory alone fails."""
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if DEVICE != "cuda" or "gpu" not in item.keywords or not run_id:
        return (yield)
    base = os.path.join(tempfile.gettempdir(), f"fusedkern-gpu-tests-{run_id}")
    with _flock(base + ".gate", fcntl.LOCK_EX):
        shared = open(base + ".lock", "a")
        fcntl.flock(shared, fcntl.LOCK_SH)
    try:
        return (yield)
    except BaseException as error:
        if not _is_out_of_memory(error):
            raise
        message = str(error).splitlines()[0][:200]
    finally:
        fcntl.flock(shared, fcntl.LOCK_UN)
        shared.close()
    gc.collect()
    torch.cuda.empty_cache()
    with _flock(base + ".gate", fcntl.LOCK_EX), _flock(base + ".lock", fcntl.LOCK_EX):
        warnings.warn(f"{item.nodeid} ran out of GPU memory beside other workers ({message}); run again alone")
        item.user_properties.append(("rerun_alone_after_out_of_memory", message))
        return item.runtest()


@pytest.fixture(autouse=True)
def release_gpu_memory(request):
    """After each GPU test, the memory torch's caching allocator kept goes back to the driver: pytest -n N runs N
    processes on one GPU, and one worker's cached peak (46 GiB seen on an H100) made the others run out."""
    yield
    if DEVICE == "cuda" and "gpu" in request.keywords:
        torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def one_cpu_thread():
    """Torch on one intra-op thread for a module's tests (`pytestmark = pytest.mark.usefixtures(...)`): tiny
    ops on a busy CPU turn 0.2 ms into ~200 ms of thread-pool wake-ups. (In the interpreter the whole session is on
    one thread already; this keeps such a module on one where the kernels run on a GPU.)"""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture
def poison_allocations(monkeypatch):
    """Call it to make every later `torch.empty` / `torch.empty_like` return NaN-filled floats and −7
    integers (until the test ends): an element the package allocates but never writes then surfaces
    as NaN or a wrong value, instead of passing on whatever zeros the allocator held."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-7)

    def enable() -> None:
        monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(real_empty(*a, **k)))
        monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(real_empty_like(*a, **k)))
    return enable


def run_twice_second_without_sync(step) -> None:
    """step() once (autotuning and first allocations may synchronize), then again under CUDA's sync-debug
    mode "error": a host synchronization in a warmed-up training step raises."""
    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
