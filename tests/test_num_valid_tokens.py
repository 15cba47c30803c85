"""`num_valid_tokens`: only the rows whose target is not ignore_index are computed — an int gathers them for
cuBLAS, a device tensor lets the row-count kernels skip the rest (`compacted.py`) — with the same loss and
gradients as the dense computation, judged against fp64."""

from __future__ import annotations

import os
import sys
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import fusedkern
import fusedkern.autograd
from fusedkern import compacted
from tests._accuracy import few_roundings_floors
from tests.conftest import run_twice_second_without_sync
from tests.test_linear_cross_entropy import IMPLS, check_against_reference, make_inputs


class _WithCount:
    """`fusedkern.linear_cross_entropy` with the count passed (an int, or a device tensor when
    `on_device`), for `check_against_reference`; records whether the row-count path ran."""

    def __init__(self, monkeypatch, on_device: bool = False):
        real = fusedkern.linear_cross_entropy
        real_counted = compacted.counted_loss_and_grads

        def with_count(input, linear_weight, target, **kw):
            n = (target != kw.get("ignore_index", -100)).sum()
            self.calls.append(n)
            return real(input, linear_weight, target, num_valid_tokens=n if on_device else int(n), **kw)

        def counted(*args, **kw):
            self.row_count_runs += 1
            return real_counted(*args, **kw)
        self.calls: list = []
        self.row_count_runs = 0
        monkeypatch.setattr(fusedkern, "linear_cross_entropy", with_count)
        monkeypatch.setattr(compacted, "counted_loss_and_grads", counted)


def _ignore_runs(T: int, runs: list[tuple[int, int]]) -> torch.Tensor:
    mask = torch.zeros(T, dtype=torch.bool)
    for a, b in runs:
        mask[a:b] = True
    return mask


LAYOUTS = {
    "prompt_spans": [(0, 5), (12, 18)],  # contiguous prompts, as in SFT
    "at_chunk_edges": [(3, 5), (7, 9), (15, 17)],  # with chunk_tokens=4: runs across chunk boundaries
    "one_valid": [(0, 10), (11, 21)],
    "none_ignored": [],
    "all_ignored": [(0, 21)],
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_matches_fp64_on_masked_batches(monkeypatch, impl, reduction, layout):
    x, w, y, b, cw = make_inputs(21, 16, 37, torch.float32, ignore_frac=0.0, bias=True, weight=layout == "prompt_spans")
    y[_ignore_runs(21, LAYOUTS[layout]).to(y.device)] = -100
    counter = _WithCount(monkeypatch)
    check_against_reference(x, w, y, b, cw, reduction=reduction, impl=impl, chunk_tokens=4, label_smoothing=0.1)
    assert counter.calls, "the count was not passed"


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("accum,dtype", [("fp32", torch.float32), ("fp32", torch.float16),
                                         ("weight_dtype", torch.float16)])
def test_device_count_skips_ignored_rows_and_matches_fp64(monkeypatch, reduction, layout, accum, dtype):
    """The row-count kernels (GEMMs and row kernels reading the count on the device) on sorted rows:
    chunks wholly valid, partly valid and wholly ignored; a class weight and label smoothing."""
    x, w, y, _, cw = make_inputs(21, 16, 37, dtype, ignore_frac=0.0, weight=layout == "prompt_spans")
    y[_ignore_runs(21, LAYOUTS[layout]).to(y.device)] = -100
    counter = _WithCount(monkeypatch, on_device=True)
    loss_kw = dict(reduction=reduction, label_smoothing=0.1, z_loss=1e-3)
    # one valid row: dX, dW hinge on a few roundings, so torch's error alone is a lucky-prone yardstick (_accuracy)
    floors = few_roundings_floors(x, w, y, weight=cw, **loss_kw) if layout == "one_valid" else {}
    check_against_reference(x, w, y, None, cw, impl="chunked", chunk_tokens=4, weight_grad_accum=accum,
                            floors=floors, **loss_kw)
    assert counter.row_count_runs == 1


def test_device_count_with_a_frozen_bias_and_one_chunk(monkeypatch):
    x, w, y, b, _ = make_inputs(21, 16, 37, torch.float32, ignore_frac=0.5, bias=True)
    counter = _WithCount(monkeypatch, on_device=True)
    leaves = [t.clone().requires_grad_() for t in (x, w)]
    loss = fusedkern.linear_cross_entropy(*leaves, y, linear_bias=b, softcap=3.0)
    ref = fusedkern.reference.linear_cross_entropy_fp64(x.double(), w.double(), y, linear_bias=b.double(), softcap=3.0)
    assert counter.row_count_runs == 1 and abs(loss.item() - ref.item()) < 1e-5
    grads = torch.autograd.grad(loss, leaves)
    leaves64 = [t.double().requires_grad_() for t in (x, w)]
    ref = fusedkern.reference.linear_cross_entropy_fp64(*leaves64, y, linear_bias=b.double(), softcap=3.0)
    for g, gr in zip(grads, torch.autograd.grad(ref, leaves64)):
        assert torch.allclose(g.double(), gr, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("case", ["none", "bias_grad", "fused", "no_grad"])
def test_device_count_elsewhere_computes_densely(monkeypatch, case):
    x, w, y, b, _ = make_inputs(12, 16, 37, torch.float32, ignore_frac=0.5, bias=True)
    counter = _WithCount(monkeypatch, on_device=True)
    kw = dict(reduction="none" if case == "none" else "mean", impl="fused" if case == "fused" else "chunked")
    x.requires_grad_()
    bias = b.clone().requires_grad_() if case == "bias_grad" else b
    with torch.set_grad_enabled(case != "no_grad"):
        got = fusedkern.linear_cross_entropy(x, w, y, linear_bias=bias, **kw)
    expected = fusedkern.reference.linear_cross_entropy_fp64(x.double(), w.double(), y, linear_bias=b.double(),
                                                             reduction=kw["reduction"])
    assert counter.row_count_runs == 0
    assert torch.allclose(got.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_ignored_rows_get_exact_zeros(poison_allocations, impl):
    x, w, y, _, _ = make_inputs(21, 16, 37, torch.float32, ignore_frac=0.0)
    ignored = _ignore_runs(21, LAYOUTS["prompt_spans"]).to(y.device)
    y[ignored] = -100
    x.requires_grad_()
    poison_allocations()
    loss = fusedkern.linear_cross_entropy(x, w, y, reduction="none", impl=impl, chunk_tokens=4,
                                          num_valid_tokens=int((~ignored).sum()))
    assert torch.all(loss[ignored] == 0) and torch.isfinite(loss).all()
    loss.sum().backward()
    assert torch.all(x.grad[ignored] == 0) and torch.isfinite(x.grad).all()


def test_module_forwards_the_count():
    x, w, y, _, _ = make_inputs(12, 16, 37, torch.float32, ignore_frac=0.5)
    n = int((y != -100).sum())
    module = fusedkern.LinearCrossEntropyLoss(label_smoothing=0.1)
    assert torch.equal(module(x, w, y, num_valid_tokens=n),
                       fusedkern.linear_cross_entropy(x, w, y, label_smoothing=0.1, num_valid_tokens=n))


@pytest.mark.parametrize("bad,error,match", [(-1, ValueError, "num_valid_tokens must be in"),
                                             (13, ValueError, "num_valid_tokens must be in"),
                                             (2.0, TypeError, "num_valid_tokens must be an int")])
def test_count_out_of_range_is_refused(bad, error, match):
    x, w, y, _, _ = make_inputs(12, 16, 37, torch.float32)
    with pytest.raises(error, match=match):
        fusedkern.linear_cross_entropy(x, w, y, num_valid_tokens=bad)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("on_device", [False, True])
def test_wrong_count_raises_after_the_work(impl, on_device):
    x, w, y, _, _ = make_inputs(12, 16, 37, torch.float32, ignore_frac=0.0)
    y[:4] = -100
    x.requires_grad_()
    count = torch.tensor(7, device=x.device) if on_device else 7
    with pytest.raises(ValueError, match="num_valid_tokens=7 but target holds 8"):
        fusedkern.linear_cross_entropy(x, w, y, impl=impl, num_valid_tokens=count)


@pytest.mark.parametrize("count,error", [(torch.tensor([1, 2]), TypeError), (torch.tensor(2.0), TypeError)])
def test_count_tensor_must_hold_one_int(count, error):
    x, w, y, _, _ = make_inputs(12, 16, 37, torch.float32)
    with pytest.raises(error, match="num_valid_tokens"):
        fusedkern.linear_cross_entropy(x, w, y, num_valid_tokens=count.to(x.device))


def test_lse_of_every_token_is_still_returned():
    x, w, y, _, _ = make_inputs(12, 16, 37, torch.float32, ignore_frac=0.5)
    n = int((y != -100).sum())
    loss, lse = fusedkern.linear_cross_entropy(x, w, y, return_lse=True, num_valid_tokens=n)
    ref_loss, ref_lse = fusedkern.linear_cross_entropy(x, w, y, return_lse=True)
    assert torch.equal(loss, ref_loss) and torch.equal(lse, ref_lse)


@pytest.mark.parametrize("impl", IMPLS)
def test_logprobs_with_the_count_match_the_dense_ones(impl):
    x, w, y, b, _ = make_inputs(21, 16, 37, torch.float32, ignore_frac=0.0, bias=True)
    y[_ignore_runs(21, LAYOUTS["at_chunk_edges"]).to(y.device)] = -100
    n = int((y != -100).sum())
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    dense = fusedkern.linear_logprobs(*leaves[:2], y, linear_bias=leaves[2], impl=impl, chunk_tokens=4)
    upstream = torch.randn(21, device=x.device)
    grads_dense = torch.autograd.grad(dense, leaves, upstream)
    counted = fusedkern.linear_logprobs(*leaves[:2], y, linear_bias=leaves[2], impl=impl, chunk_tokens=4,
                                        num_valid_tokens=n)
    grads = torch.autograd.grad(counted, leaves, upstream)
    assert torch.allclose(counted, dense, rtol=1e-6, atol=1e-6) and torch.all(counted[y == -100] == 0)
    for g, gd in zip(grads, grads_dense):
        assert torch.allclose(g, gd, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="num_valid_tokens"):
        fusedkern.linear_logprobs(x, w, y, num_valid_tokens=n - 1)


# ---------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_gpu_masked_bf16_matches_fp64(monkeypatch, impl, reduction):
    x, w, y, b, _ = make_inputs(2048, 256, 4099, torch.bfloat16, ignore_frac=0.0, bias=True, device="cuda")
    y.view(4, 512)[:, :256] = -100  # half of every sequence is its prompt
    _WithCount(monkeypatch)
    check_against_reference(x, w, y, b, None, reduction=reduction, impl=impl, chunk_tokens=512)


@pytest.mark.gpu
@pytest.mark.parametrize("accum", ["fp32", "weight_dtype"])
@pytest.mark.parametrize("V", [4099, 4096])  # the row-count GEMMs' pointer path and their TMA path
def test_gpu_device_count_bf16_matches_fp64(monkeypatch, accum, V):
    x, w, y, _, _ = make_inputs(2048, 256, V, torch.bfloat16, ignore_frac=0.0, device="cuda")
    y.view(4, 512)[:, :300] = -100  # chunks of 512 rows: full, partial and empty ones after sorting
    counter = _WithCount(monkeypatch, on_device=True)
    check_against_reference(x, w, y, None, None, impl="chunked", chunk_tokens=512, weight_grad_accum=accum)
    assert counter.row_count_runs == 1


@pytest.mark.gpu
@pytest.mark.parametrize("on_device", [False, True])
def test_gpu_masked_step_never_waits_for_the_gpu(on_device):
    """The sort, the gather, the count check and the scatter of dX add no synchronizing call to a step."""
    x, w, y, _, _ = make_inputs(2048, 256, 4096, torch.bfloat16, ignore_frac=0.0, device="cuda", seed=5)
    y.view(4, 512)[:, :256] = -100
    n = (y != -100).sum() if on_device else int((y != -100).sum())
    x.requires_grad_(); w.requires_grad_()

    def step():
        x.grad = w.grad = None
        fusedkern.linear_cross_entropy(x, w, y, chunk_tokens=512, num_valid_tokens=n).backward()

    run_twice_second_without_sync(step)
    assert torch.isfinite(w.grad).all() and torch.all(x.grad.view(4, 512, -1)[:, :256] == 0)


def _inside_triton_interpreter() -> bool:
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.endswith(os.path.join("triton", "runtime", "interpreter.py")):
            return True
        frame = frame.f_back
    return False


class _LiveBytes(TorchDispatchMode):
    """The peak of the bytes held by the storages that torch ops create while the mode is on, counted at
    every op (a storage is live while any tensor on it is). Copies made inside Triton's interpreter (each
    launch copies its arguments) are not counted: they are the CPU emulation's, not the path's."""

    def __init__(self):
        super().__init__()
        self.refs: list = []
        self.peak_bytes = 0

    def _live_bytes(self) -> int:
        storages, alive = {}, []
        for ref in self.refs:
            t = ref()
            if t is not None:
                alive.append(ref)
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        self.refs = alive
        return sum(storages.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not _inside_triton_interpreter():
            self.refs += [weakref.ref(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            self.peak_bytes = max(self.peak_bytes, self._live_bytes())
        return out


def _peak_bytes_of_a_step(monkeypatch, x, w, y, **kw) -> int:
    # the operators run eagerly under the mode (not as one opaque dispatcher call), so that every
    # allocation inside them is seen
    monkeypatch.setattr(fusedkern.autograd, "_get_current_dispatch_mode", lambda: None)
    x.grad = w.grad = None
    with _LiveBytes() as mode:
        fusedkern.linear_cross_entropy(x, w, y, impl="chunked", **kw).backward()
    return mode.peak_bytes


@pytest.mark.parametrize("on_device", [False, True])
@pytest.mark.parametrize("chunk_tokens", [None, 16])
def test_the_count_holds_no_copy_of_x_beside_dx(monkeypatch, on_device, chunk_tokens):
    """Issue 31: with the count the peak was above the dense path's: a device count kept a sorted copy of x
    (T·H·e) beside dX, a host count the n gathered rows beside their own dX (2·n·H·e where the dense path
    holds dX's T·H·e). The rows now go into dX's own storage and are put back in order through idle
    storage (the logits buffer, here) or, when none is large enough (chunks of 16 rows: 16·V < T·H), a copy
    made once the logits buffer is freed. Either way the peak is the dense path's plus the sort's row index
    and sorted target (16·T bytes) and a few small tensors. 3/4 of the rows valid: a host count's plan is
    then no smaller than the dense one's in chunks of 16. fp32: the dense path's CPU GEMMs make no upcast
    copies of their own."""
    T, H, V = 64, 32, 48
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=gen, requires_grad=True)
    w = torch.randn(V, H, generator=gen, requires_grad=True)
    y = torch.randint(0, V, (T,), generator=gen)
    y[torch.randperm(T, generator=gen)[: T // 4]] = -100
    n = (y != -100).sum()
    dense = _peak_bytes_of_a_step(monkeypatch, x, w, y, chunk_tokens=chunk_tokens)
    counted = _peak_bytes_of_a_step(monkeypatch, x, w, y, chunk_tokens=chunk_tokens,
                                    num_valid_tokens=n if on_device else int(n))
    assert dense >= T * V * 4 if chunk_tokens is None else dense >= T * H * 4  # the mode saw the buffers
    assert counted <= dense + 16 * T + 512, (counted - dense, T * H * 4)
