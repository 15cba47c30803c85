"""`num_valid_tokens`: only the rows whose target is not ignore_index are computed (gathered on the device,
dX scattered back), with the same loss and gradients as the dense computation, judged against fp64."""

from __future__ import annotations

import pytest
import torch

import fusedkern
from tests.conftest import DEVICE
from tests.test_linear_cross_entropy import IMPLS, check_against_reference, make_inputs


class _WithCount:
    """`fusedkern.linear_cross_entropy` with the count passed, for `check_against_reference`."""

    def __init__(self, monkeypatch):
        real = fusedkern.linear_cross_entropy

        def with_count(input, linear_weight, target, **kw):
            n = int((target != kw.get("ignore_index", -100)).sum())
            self.calls.append(n)
            return real(input, linear_weight, target, num_valid_tokens=n, **kw)
        self.calls: list[int] = []
        monkeypatch.setattr(fusedkern, "linear_cross_entropy", with_count)


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
def test_wrong_count_raises_after_the_work(impl):
    x, w, y, _, _ = make_inputs(12, 16, 37, torch.float32, ignore_frac=0.0)
    y[:4] = -100
    with pytest.raises(ValueError, match="num_valid_tokens=7 but target holds 8"):
        fusedkern.linear_cross_entropy(x, w, y, impl=impl, num_valid_tokens=7)


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
def test_gpu_masked_step_never_waits_for_the_gpu():
    """The gather, the count check and the scatter of dX add no synchronizing call to a training step."""
    x, w, y, _, _ = make_inputs(2048, 256, 4099, torch.bfloat16, ignore_frac=0.0, device="cuda", seed=5)
    y.view(4, 512)[:, :256] = -100
    n = int((y != -100).sum())
    x.requires_grad_(); w.requires_grad_()

    def step():
        x.grad = w.grad = None
        fusedkern.linear_cross_entropy(x, w, y, chunk_tokens=512, num_valid_tokens=n).backward()

    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.isfinite(w.grad).all() and torch.all(x.grad.view(4, 512, -1)[:, :256] == 0)
