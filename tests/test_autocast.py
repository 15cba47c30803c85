"""Under torch.autocast the ops follow autocast's rules: the operands are cast to the autocast dtype as
F.linear would, the loss is computed exactly as on explicitly cast operands, and each gradient comes back
in its parameter's own dtype. Outside autocast, mixed dtypes are refused with a message saying how to call."""

from __future__ import annotations

import pytest
import torch

import fusedkern
from tests.conftest import DEVICE
from tests.test_linear_cross_entropy import IMPLS, make_inputs

ENTRY_POINTS = {
    "cross_entropy": lambda x, w, y, b, impl: fusedkern.linear_cross_entropy(x, w, y, linear_bias=b, impl=impl,
                                                                             label_smoothing=0.1),
    "logprobs": lambda x, w, y, b, impl: fusedkern.linear_logprobs(x, w, y, linear_bias=b, impl=impl).sum(),
    "simpo": lambda x, w, y, b, impl: fusedkern.linear_simpo_loss(x.reshape(2, -1, x.shape[-1]), w, y.reshape(2, -1),
                                                                  linear_bias=b, impl=impl)[0],
}


def _autocast_matches_explicit_cast(entry, impl, device, dtype):
    x, w, y, b, _ = make_inputs(16, 24, 53, torch.float32, bias=True, device=device)
    fn = ENTRY_POINTS[entry]
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]  # fp32 parameters, as in mixed-precision training
    with torch.autocast(device, dtype=dtype):
        loss = fn(*leaves[:2], y, leaves[2], impl)
    grads = torch.autograd.grad(loss, leaves)
    same = [t.clone().requires_grad_() for t in (x, w, b)]
    ref = fn(*(t.to(dtype) for t in same[:2]), y, same[2].to(dtype), impl)
    ref_grads = torch.autograd.grad(ref, same)
    # bit-equal, but for the order of the fused kernels' fp32 atomics on a GPU
    same_bits = torch.equal if device == "cpu" else lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    assert loss.dtype == torch.float32 and same_bits(loss, ref)
    for g, gr, leaf in zip(grads, ref_grads, leaves):
        assert g.dtype == leaf.dtype == torch.float32
        assert same_bits(g, gr)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_autocast_matches_explicitly_cast_operands(entry, impl):
    _autocast_matches_explicit_cast(entry, impl, DEVICE, torch.bfloat16)


def test_autocast_is_close_to_torch_autocast():
    x, w, y, _, _ = make_inputs(16, 24, 53, torch.float32, device=DEVICE)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        ours = fusedkern.linear_cross_entropy(xs[0], w, y)
        theirs = torch.nn.functional.cross_entropy(torch.nn.functional.linear(xs[1], w).float(), y)
    assert abs(ours.item() - theirs.item()) < 2e-2 * abs(theirs.item())
    ours.backward()
    theirs.backward()
    assert xs[0].grad.dtype == torch.float32
    assert torch.allclose(xs[0].grad, xs[1].grad, rtol=5e-2, atol=5e-3)


def test_mixed_dtypes_outside_autocast_say_how_to_call():
    x, w, y, _, _ = make_inputs(8, 16, 37, torch.float32, device=DEVICE)
    with pytest.raises(TypeError, match="torch.autocast"):
        fusedkern.linear_cross_entropy(x.to(torch.bfloat16), w, y)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_gpu_autocast_matches_explicitly_cast_operands(entry, impl):
    _autocast_matches_explicit_cast(entry, impl, "cuda", torch.bfloat16)
