"""`fusedkern._runtime`: a Triton kernel's fp32 → bf16 conversion rounds to nearest even, bit for bit as torch does,
on the GPU and in the interpreter (where `round_bf16_like_the_gpu` replaces Triton 3.6's truncation)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

import fusedkern  # noqa: F401  (first: picks GPU or the interpreter before the kernel below is decorated)
from tests.conftest import DEVICE


@triton.jit
def _to_bf16_kernel(src_ptr, cast_ptr, stored_ptr, scalar_ptr, N, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    vals = tl.load(src_ptr + offs, mask=mask)
    tl.store(cast_ptr + offs, vals.to(tl.bfloat16), mask=mask)  # an explicit cast
    tl.store(stored_ptr + offs, vals, mask=mask)  # fp32 values stored into a bf16 tensor
    tl.store(scalar_ptr, tl.load(src_ptr) * 3.0)  # a scalar


def test_fp32_to_bf16_rounds_to_nearest_even_like_torch():
    # ties at 1 + 2^-8 (to even: 1) and 1 + 3·2^-8 (to even: 1 + 2^-6), a value truncation would take
    # down a whole ulp, specials, the largest fp32 (overflows to inf), a subnormal, −0, then random values
    edge = [1.00390625, 1.01171875, 1.0 + 2 ** -8 + 2 ** -20, float("nan"), float("inf"), -float("inf"),
            3.4e38, 1e-40, -0.0]
    src = torch.cat([torch.tensor(edge), torch.randn(4096 - len(edge)) * 10.0]).to(DEVICE)
    cast, stored = (torch.empty(src.shape, dtype=torch.bfloat16, device=DEVICE) for _ in range(2))
    scalar = torch.empty(1, dtype=torch.bfloat16, device=DEVICE)
    _to_bf16_kernel[(1,)](src, cast, stored, scalar, src.numel(), BLOCK=triton.next_power_of_2(src.numel()))
    expected = src.to(torch.bfloat16)
    for got in (cast, stored):
        assert torch.equal(got.view(torch.int16), expected.view(torch.int16))
    assert torch.equal(scalar.view(torch.int16), (src[:1] * 3.0).to(torch.bfloat16).view(torch.int16))


# Triton imported before fusedkern (Transformers, TRL, a user's own `import triton.language`): the kernels still run
# in the interpreter. A fresh process, because this one imported fusedkern first.
_TRITON_FIRST = """
import logging
import {first}
logging.basicConfig(level=logging.INFO)
import torch
import torch.nn.functional as F
import fusedkern
from fusedkern._runtime import interpreting
assert interpreting()
g = torch.Generator().manual_seed(0)
x, w, y = torch.randn(6, 8, generator=g), torch.randn(13, 8, generator=g), torch.randint(0, 13, (6,), generator=g)
want = F.cross_entropy(x @ w.T, y)
for impl in ("chunked", "fused"):
    got = fusedkern.linear_cross_entropy(x, w, y, impl=impl)
    assert abs(got.item() - want.item()) <= 1e-5 * abs(want.item()), (impl, got, want)
print("ok")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is switched on only without a GPU")
@pytest.mark.parametrize("first", ["triton.language", "triton.language.extra.libdevice"])
def test_kernels_run_when_triton_was_imported_first(first):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # fusedkern decides, as for a user
    done = subprocess.run([sys.executable, "-c", _TRITON_FIRST.format(first=first)], capture_output=True, text=True,
                          timeout=300, env=env, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
    assert "run in Triton's interpreter" in done.stderr and "helpers were made interpreted" in done.stderr  # logged
