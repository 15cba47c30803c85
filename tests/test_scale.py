"""`kernels/scale.py`: the in-place rescale of precomputed gradients that skips s == 1 on the device, and the
scaled cast of the fp32 dW accumulator into the weight's dtype."""

from __future__ import annotations

import pytest
import torch

from fusedkern.kernels.scale import scale_into, scale_unless_one_
from tests.conftest import DEVICE

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _ulp_distance(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units in the last place (same-sign finite values)."""
    bits = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[a.dtype]
    return int((a.view(bits).long() - b.view(bits).long()).abs().max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 4095, 4096 * 9 + 17])  # one element, below one block, more blocks than programs
def test_scale_one_leaves_every_bit_alone(dtype, n):
    t = torch.randn(n, device=DEVICE).to(dtype)
    t[::7] = float("nan")  # a pass computing t·1 would keep these too; bit equality below is the check
    before = t.clone()
    assert scale_unless_one_(t, torch.ones((), device=DEVICE)) is t
    assert torch.equal(t.view(torch.uint8), before.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [0.5, 3.0, -1e-3, 0.0])
@pytest.mark.parametrize("shape", [(1,), (3, 5), (4096 * 9 + 17,)])
def test_scale_is_the_fp32_product_rounded_once(dtype, scale, shape):
    t = torch.randn(shape, device=DEVICE).to(dtype)
    # not `t.mul_(s)`: on CUDA PyTorch first rounds an fp32 0-d s to t's dtype (−1e-3 in bf16 is
    # −1.0014e-3), which the H200 showed as 1-ulp differences; the kernel keeps s in fp32
    expected = (t.float() * torch.tensor(scale, dtype=torch.float32)).to(dtype)
    scale_unless_one_(t, torch.tensor([scale], device=DEVICE))
    # bit-exact in the interpreter too: `fusedkern._runtime` makes it round fp32 → bf16 like the GPU
    assert _ulp_distance(t, expected) == 0


def test_scale_rejects_what_it_cannot_do():
    with pytest.raises(ValueError, match="contiguous"):
        scale_unless_one_(torch.randn(4, 4, device=DEVICE).t(), torch.ones((), device=DEVICE))
    with pytest.raises(ValueError, match="one element"):
        scale_unless_one_(torch.randn(4, device=DEVICE), torch.ones(2, device=DEVICE))
    empty = torch.empty(0, device=DEVICE)
    assert scale_unless_one_(empty, torch.full((), 2.0, device=DEVICE)) is empty


@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("scale", [1.0, 0.37, -2.5e-4])
@pytest.mark.parametrize("n", [1, 4095, 4096 * 9 + 17])
def test_scale_into_is_torch_mul_bit_for_bit(out_dtype, scale, n):
    """fp32 src · fp32 s rounded once to out's dtype: bitwise what `torch.mul(src, s, out=out)` writes, every element
    written (out poisoned with NaN first), NaN and ±inf carried through, s = 1 included (a cast, not a skip)."""
    src = torch.randn(n, device=DEVICE) * 50
    src[::5] = float("nan")
    src[1::11] = float("inf")
    src[2::13] = -3e38  # overflows bf16 / fp16 after the product: ±inf, as torch's cast gives
    s = torch.tensor(scale, device=DEVICE)
    out = torch.full((n,), float("nan"), device=DEVICE).to(out_dtype)
    expected = torch.mul(src, s, out=torch.empty(n, device=DEVICE, dtype=out_dtype))
    assert scale_into(src, s, out) is out
    assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8))


def test_scale_into_rejects_what_it_cannot_do():
    src, s = torch.randn(4, 4, device=DEVICE), torch.ones((), device=DEVICE)
    with pytest.raises(ValueError, match="shape"):
        scale_into(src, s, torch.empty(16, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous"):
        scale_into(src.t(), s, torch.empty(4, 4, device=DEVICE))
    with pytest.raises(ValueError, match="one element"):
        scale_into(src, torch.ones(2, device=DEVICE), torch.empty(4, 4, device=DEVICE))


def test_the_fp32_accumulator_reaches_the_weight_dtype_through_scale_into(monkeypatch):
    """A bf16 weight with dW accumulated in fp32 over several chunks: backward casts the accumulator into dW's
    own bf16 storage with `scale_into` (one call, fp32 → bf16, the upstream gradient as s), and the result is
    bitwise torch's `mul` of the same accumulator."""
    import fusedkern
    import fusedkern.autograd

    T, H, V = 24, 16, 40
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(T, H, generator=gen).to(DEVICE, torch.bfloat16)
    w = (torch.randn(V, H, generator=gen) * 0.3).to(DEVICE, torch.bfloat16)
    y = torch.randint(0, V, (T,), generator=gen).to(DEVICE)
    calls, accumulators = [], []
    real = fusedkern.autograd.scale_into

    def recording(src, s, out):
        calls.append((src.dtype, out.dtype, tuple(out.shape)))
        accumulators.append((src.clone(), s.clone()))
        return real(src, s, out)

    monkeypatch.setattr(fusedkern.autograd, "scale_into", recording)
    wl = w.clone().requires_grad_()
    (fusedkern.linear_cross_entropy(x, wl, y, chunk_tokens=8) * 0.75).backward()
    assert calls == [(torch.float32, torch.bfloat16, (V, H))]
    (acc, s), = accumulators
    assert torch.equal(wl.grad.view(torch.int16), torch.mul(acc, s).to(torch.bfloat16).view(torch.int16))


@pytest.mark.gpu
def test_gpu_scale_kernel_at_an_lm_heads_size():
    """Both uses of `_scale_kernel` on a GPU at a realistic size (an eighth of Llama-3's [128256, 4096] head: more
    blocks than programs, so the grid-stride loop wraps many times): the backward's fp32 → bf16 cast with s ≠ 1 and
    s = 1 equal to torch's `mul` value for value (NaN where it has NaN: a NaN's payload bits may differ between the
    two conversions), the in-place rescale the fp32 product rounded once, and s = 1 leaving every bit."""
    exact = dict(rtol=0, atol=0, equal_nan=True)
    n = 128256 * 4096 // 8
    src = torch.randn(n, device="cuda") * 50
    src[::97] = float("nan")
    for scale in (0.37, 1.0):
        s = torch.tensor(scale, device="cuda")
        out = torch.full((n,), float("nan"), device="cuda", dtype=torch.bfloat16)
        expected = torch.mul(src, s, out=torch.empty(n, device="cuda", dtype=torch.bfloat16))
        torch.testing.assert_close(scale_into(src, s, out), expected, **exact)
    t = src.to(torch.bfloat16)
    expected = (t.float() * 0.37).to(torch.bfloat16)
    torch.testing.assert_close(scale_unless_one_(t, torch.tensor([0.37], device="cuda")), expected, **exact)
    before = t.clone()
    scale_unless_one_(t, torch.ones((), device="cuda"))
    assert torch.equal(t.view(torch.int16), before.view(torch.int16))
