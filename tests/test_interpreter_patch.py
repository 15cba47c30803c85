"""`tests/_interpreter.py`, the tests' faster Triton interpreter: installed where it applies, the same outputs bit for
bit as Triton's own interpreter on kernels that call jit helpers, fewer patches of `triton.language`, launches on
their own thread, the language left as Triton leaves it after a launch, and a kernel's error reaching the caller."""

from __future__ import annotations

import threading

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter
from triton.runtime.errors import InterpreterError

import fusedkern
from fusedkern._runtime import interpreting
from tests import _interpreter

pytestmark = pytest.mark.skipif(not (interpreting() and _interpreter.supported()),
                                reason="the tests' interpreter patch applies to Triton 3.6's interpreter only")


def _calls():
    """Losses and gradients through kernels that call jit helpers: cross-entropy (both strategies, every option,
    fp16), log-probs with entropy, distillation."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 16, generator=g)
    w = torch.randn(37, 16, generator=g) / 4
    y = torch.randint(0, 37, (5,), generator=g)
    y[1] = -100

    def leaves(dtype=torch.float32):
        return (t.to(dtype).clone().requires_grad_() for t in (x, w))

    out = []
    for impl, dtype in (("chunked", torch.float32), ("fused", torch.float16)):
        xs, ws = leaves(dtype)
        loss = fusedkern.linear_cross_entropy(xs, ws, y, impl=impl, label_smoothing=0.1, z_loss=1e-3, softcap=8.0)
        loss.backward()
        out += [loss.detach(), xs.grad, ws.grad]
    xs, ws = leaves()
    logp, entropy = fusedkern.linear_logprobs(xs, ws, y.clamp(min=0), return_entropy=True)
    (logp.sum() + entropy.sum()).backward()
    out += [logp.detach(), entropy.detach(), xs.grad, ws.grad]
    xs, ws = leaves()
    loss = fusedkern.linear_distillation_loss(xs, ws, x.flip(0), w.flip(1), y, beta=0.5)
    loss.backward()
    out += [loss.detach(), xs.grad, ws.grad]
    return out


def _count_language_patches(monkeypatch) -> list:
    """Records the thread of every patch of `triton.language` Triton makes (at least one a launch)."""
    calls = []
    real = _interpreter._REAL_PATCH_LANG

    def counting(fn):
        calls.append(threading.get_ident())
        return real(fn)

    monkeypatch.setattr(_interpreter, "_REAL_PATCH_LANG", counting)
    return calls


def test_installed_by_conftest():
    assert _interpreter.installed()


def test_same_bits_as_tritons_interpreter_with_fewer_patches(monkeypatch):
    patches = _count_language_patches(monkeypatch)
    with _interpreter.triton_as_released():
        assert not _interpreter.installed()
        interpreter._patch_lang = _interpreter._REAL_PATCH_LANG  # the counting one, as Triton calls it
        want = _calls()
    triton_patches, patches[:] = len(patches), []
    got = _calls()
    assert _interpreter.installed()
    assert len(want) == len(got) == 13
    for i, (a, b) in enumerate(zip(want, got)):
        assert a is not None and a.dtype == b.dtype and torch.equal(a, b), i
    assert 0 < len(patches) < triton_patches / 10, (len(patches), triton_patches)
    assert threading.get_ident() not in patches  # every launch ran on the launch thread


def test_language_restored_after_a_launch_as_by_triton():
    before = dict(vars(tl))
    fusedkern.linear_cross_entropy(torch.randn(3, 8), torch.randn(11, 8), torch.tensor([1, 2, 3]))
    assert _interpreter._covered == []
    after = vars(tl)
    assert [k for k in before if after.get(k) is not before[k]] == []
    assert tl.core.is_builtin(tl.load) and tl.core.is_builtin(tl.tensor.__add__)



@triton.jit
def _refusing_kernel(out_ptr, N: tl.constexpr):
    tl.static_assert(N > 4, "N must exceed 4")
    tl.store(out_ptr, N)


def test_a_kernels_error_reaches_the_caller():
    out = torch.zeros(1, dtype=torch.int32)
    _refusing_kernel[(1,)](out, 5)
    assert out.item() == 5
    with pytest.raises(InterpreterError, match="N must exceed 4"):
        _refusing_kernel[(1,)](out, 3)
