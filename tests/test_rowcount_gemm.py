"""Row-count GEMMs (`fusedkern.kernels.rowcount_gemm`): the logits, dX and dW GEMMs on only the first
n = count rows, count read on the device.

On CPU the kernels run through Triton's interpreter at tiny odd shapes (C = 37, H = 48, V = 70, tiles
of 16 × 32 × 16, so every dimension has a masked tail and each persistent program walks several
tiles). Every case poisons the inputs' rows ≥ n and the outputs with NaN: rows < n must match the
fp64 product within twice the error of PyTorch's own same-dtype product (`tests/_accuracy.py`), rows
≥ n of logits/dX must still hold NaN (not written), dW must not see the poisoned tokens. The TMA
kernels run in the interpreter too (impl="tma", at V = 72: descriptors need 16-byte row strides),
which checks their descriptor offsets and extents; whether they lower for sm_90, warp-specialized
candidates included, is checked by compiling them (tests/test_compile_sm90.py). GPU tests (`pytest -m
gpu`) run realistic bf16 shapes through both paths, under CUDA's sync-debug mode (a host
synchronization raises).
"""

from __future__ import annotations

import fusedkern._runtime  # noqa: F401  (first: picks GPU or the interpreter before the kernels import)

import pytest
import torch

from fusedkern.kernels import rowcount_gemm as rg
from fusedkern.kernels.gemm_tiles import launch_persistent
from fusedkern.kernels.rowcount_gemm import dw_rows, dx_rows, logits_rows
from tests._accuracy import assert_close_to_ref
from tests.conftest import DEVICE

C, H, V = 37, 48, 70
V_TMA = 72  # fp16 rows of 144 bytes: a TMA descriptor needs 16-byte aligned row strides
COUNTS = [0, 1, 20, C]
DTYPES = [torch.float32, torch.float16]
NAN = float("nan")


def _rand(*shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


def _poison_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """A copy of t whose rows ≥ n are NaN: a kernel that reads them leaks NaN into its result."""
    t = t.clone()
    t[n:] = NAN
    return t


def _count(n: int, dtype=torch.int64) -> torch.Tensor:
    return torch.tensor(n, dtype=dtype, device=DEVICE)


def _check_rows(name, out, n, ref64, torch_same):
    """rows < n: the 2× rule against fp64; rows ≥ n: untouched (still NaN)."""
    assert torch.isnan(out[n:]).all(), f"{name}: rows ≥ n were written"
    if n:
        assert torch.isfinite(out[:n]).all(), f"{name}: rows < n not all written"
        assert_close_to_ref(name, out[:n], ref64[:n], torch_same[:n])


# ----------------------------------------------------------------------------------------------
# interpreter (CPU) and GPU alike, at the tiny shapes


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n", COUNTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_logits(dtype, n, bias):
    x = _poison_rows(_rand(C, H, dtype=dtype, seed=1), n)
    w = _rand(V, H, dtype=dtype, seed=2)
    b = _rand(V, dtype=dtype, seed=3) if bias else None
    out = torch.full((C, V), NAN, dtype=dtype, device=DEVICE)
    assert logits_rows(x, w, b, _count(n), out, impl="pointer") is out
    ref = x[:n].double() @ w.double().T + (b.double() if bias else 0)
    same = torch.addmm(b, x[:n], w.T) if bias else x[:n] @ w.T
    _check_rows("logits", out, n, ref, same)


@pytest.mark.parametrize("n", COUNTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dx(dtype, n):
    g = _poison_rows(_rand(C, V, dtype=dtype, seed=4), n)
    w = _rand(V, H, dtype=dtype, seed=5)
    out = torch.full((C, H), NAN, dtype=dtype, device=DEVICE)
    assert dx_rows(g, w, _count(n, torch.int32), out, impl="pointer") is out
    _check_rows("dx", out, n, g[:n].double() @ w.double(), g[:n] @ w)


def _dw_case(dtype, out_dtype, n, accumulate, v=V, impl="pointer"):
    g = _poison_rows(_rand(C, v, dtype=dtype, seed=6), n)
    x = _poison_rows(_rand(C, H, dtype=dtype, seed=7), n)
    if accumulate:
        init = _rand(v, H, dtype=out_dtype, seed=8)
        out = init.clone()
    else:
        init = torch.zeros(v, H, dtype=out_dtype, device=DEVICE)
        out = torch.full((v, H), NAN, dtype=out_dtype, device=DEVICE)
    assert dw_rows(g, x, _count(n), out, accumulate, impl=impl) is out
    if n == 0:
        assert torch.equal(out, init), "n = 0: accumulate leaves out as it was, a write leaves zeros"
        return
    gt, xs = g[:n].T, x[:n]
    ref = init.double() + gt.double() @ xs.double()
    if out_dtype == torch.float32:  # the yardstick: fp32 products and sum (what cuBLAS does with an fp32 C/D)
        same = init + gt.float() @ xs.float()
    else:
        same = init.addmm(gt, xs) if accumulate else gt @ xs
    assert_close_to_ref("dw", out, ref, same)


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("n", COUNTS)
@pytest.mark.parametrize("dtype,out_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float32),
                                             (torch.float16, torch.float16)])
def test_dw(dtype, out_dtype, n, accumulate):
    _dw_case(dtype, out_dtype, n, accumulate)


@pytest.mark.parametrize("n", [0, 20, C])
@pytest.mark.parametrize("dtype", DTYPES)
def test_tma_path(dtype, n):
    """The descriptor kernels (forced): token extent n zero-fills the rows ≥ n and clips the stores."""
    x = _poison_rows(_rand(C, H, dtype=dtype, seed=11), n)
    w = _rand(V_TMA, H, dtype=dtype, seed=12)
    b = _rand(V_TMA, dtype=torch.float32, seed=13)  # a bias of another dtype than x
    z = torch.full((C, V_TMA), NAN, dtype=dtype, device=DEVICE)
    logits_rows(x, w, b, _count(n), z, impl="tma")
    _check_rows("logits/tma", z, n, x[:n].double() @ w.double().T + b.double(),
                torch.addmm(b.to(dtype), x[:n], w.T))
    g = _poison_rows(_rand(C, V_TMA, dtype=dtype, seed=14), n)
    dx = torch.full((C, H), NAN, dtype=dtype, device=DEVICE)
    dx_rows(g, w, _count(n), dx, impl="tma")
    _check_rows("dx/tma", dx, n, g[:n].double() @ w.double(), g[:n] @ w)
    for accumulate in (False, True):
        _dw_case(dtype, torch.float32, n, accumulate, v=V_TMA, impl="tma")
    _dw_case(dtype, dtype, n, True, v=V_TMA, impl="tma")


def _narrow_wins_host(n, c, h, sms, bm, wide_n):
    """`rowcount_gemm._narrow_wins` in Python."""
    cdiv = lambda a, b: -(-a // b)  # noqa: E731
    p_w, p_n = min(sms, cdiv(c, bm) * cdiv(h, wide_n)), min(sms, cdiv(c, bm) * cdiv(h, wide_n // 2))
    waves_w, waves_n = cdiv(cdiv(n, bm) * cdiv(h, wide_n), p_w), cdiv(cdiv(n, bm) * cdiv(h, wide_n // 2), p_n)
    return waves_n * rg._NARROW_COST_PCT.value < waves_w * 100


@pytest.mark.parametrize("impl", ["pointer", "tma"])
def test_dx_wide_narrow_pair(impl):
    """dX launches a wide kernel and its half-width partner; for every n exactly one of them works
    (the one with fewer whole waves), and the pair's result is right for either."""
    dtype, v = torch.float16, V_TMA
    g, w = _rand(C, v, dtype=dtype, seed=61), _rand(v, H, dtype=dtype, seed=62)
    wide = rg._DX[False].configs[0]
    narrow = rg._narrow_partner(wide)
    assert narrow is not None and narrow.kwargs["BLOCK_N"] * 2 == wide.kwargs["BLOCK_N"]
    sms = rg.sm_count(g.device)
    args = lambda cnt, out: (g, w, out, cnt, C, v, H, *g.stride(), *w.stride(), *out.stride(), sms)  # noqa: E731
    flags = dict(USE_TMA=impl == "tma", DOT_PRECISION="tf32")
    picked = set()
    for n in (1, 20, C):
        cnt = _count(n)
        outs = []
        for pick, config in ((1, wide), (2, narrow)):
            out = torch.full((C, H), NAN, dtype=dtype, device=DEVICE)
            launch_persistent(rg._DX[False], C, H, g.device, args(cnt, out), dict(flags, PICK=pick), config)
            outs.append(out)
        narrow_won = _narrow_wins_host(n, C, H, sms, wide.kwargs["BLOCK_M"], wide.kwargs["BLOCK_N"])
        picked.add(narrow_won)
        did, idle = (outs[1], outs[0]) if narrow_won else (outs[0], outs[1])
        assert torch.isnan(idle).all(), f"n={n}: both kernels of the pair wrote"
        _check_rows("dx pair", did, n, g[:n].double() @ w.double(), g[:n] @ w)
        # and through the public launcher (first call tunes, later ones run the pair)
        for _ in range(2):
            out = torch.full((C, H), NAN, dtype=dtype, device=DEVICE)
            dx_rows(g, w, cnt, out, impl=impl)
            _check_rows("dx_rows", out, n, g[:n].double() @ w.double(), g[:n] @ w)
    if DEVICE == "cpu":
        assert picked == {False, True}, "the interpreter's shapes exercise both widths"


def test_count_is_clamped():
    """count > C means every row, count < 0 none (no host check is possible: the kernels clamp)."""
    x, w = _rand(C, H, dtype=torch.float32, seed=21), _rand(V, H, dtype=torch.float32, seed=22)
    out = torch.full((C, V), NAN, device=DEVICE)
    logits_rows(x, w, None, _count(10 * C), out)
    _check_rows("logits", out, C, x.double() @ w.double().T, x @ w.T)
    out.fill_(NAN)
    logits_rows(x, w, None, _count(-5, torch.int32), out)
    assert torch.isnan(out).all()


def test_strided_views_and_explicit_config():
    """Row strides wider than the rows (views into larger buffers); the columns beyond each view and the
    rows ≥ n are left alone; an explicit config (no autotuning) gives the same result."""
    n = 29
    xb = _poison_rows(_rand(C, H + 5, dtype=torch.float16, seed=31), n)
    x = xb[:, 2:H + 2]
    w = _rand(V + 3, H, dtype=torch.float16, seed=32)[:V]
    zb = torch.full((C, V + 9), NAN, dtype=torch.float16, device=DEVICE)
    z = zb[:, :V]
    logits_rows(x, w, None, _count(n), z)
    _check_rows("logits", z, n, x[:n].double() @ w.double().T, x[:n] @ w.T)
    assert torch.isnan(zb[:, V:]).all()
    z2 = torch.full((C, V), NAN, dtype=torch.float16, device=DEVICE)
    logits_rows(x, w, None, _count(n), z2, config=rg._cfg(32, 64, 32, 4, 1, group=1, slices=4))
    assert torch.allclose(z2[:n].float(), z[:n].float(), atol=2e-2, rtol=2e-3) and torch.isnan(z2[n:]).all()
    # dW over strided operands, accumulating into a strided fp32 view
    g = _poison_rows(_rand(C, V + 6, dtype=torch.float16, seed=33), n)[:, 3:V + 3]
    acc_b = torch.zeros(V, H + 4, device=DEVICE)
    dw_rows(g, x, _count(n), acc_b[:, :H], True)
    ref = g[:n].double().T @ x[:n].double()
    assert_close_to_ref("dw", acc_b[:, :H], ref, g[:n].float().T @ x[:n].float())
    assert (acc_b[:, H:] == 0).all()


def test_validation():
    x, w = _rand(C, H, dtype=torch.float32, seed=41), _rand(V, H, dtype=torch.float32, seed=42)
    out = torch.empty(C, V, device=DEVICE)
    with pytest.raises(TypeError, match="int32 or int64"):
        logits_rows(x, w, None, torch.tensor(3.0, device=DEVICE), out)
    with pytest.raises(ValueError, match="one-element"):
        logits_rows(x, w, None, torch.tensor([1, 2], device=DEVICE), out)
    with pytest.raises(ValueError, match="shape"):
        logits_rows(x, w, None, _count(3), out[:, :-1])
    with pytest.raises(TypeError, match="w must be"):
        logits_rows(x, w.half(), None, _count(3), out)
    with pytest.raises(ValueError, match="impl must be"):
        logits_rows(x, w, None, _count(3), out, impl="cublas")
    with pytest.raises(ValueError, match="impl='tma'"):  # V = 70 fp32 rows: 280 bytes, not 16-aligned
        logits_rows(x, w, None, _count(3), out, impl="tma")
    with pytest.raises(ValueError, match="shape"):
        dw_rows(torch.empty(C, V, device=DEVICE), x, _count(3), torch.empty(H, V, device=DEVICE), False)
    if DEVICE == "cpu":
        assert not rg.tma_eligible((x, w), (out,))  # the interpreter takes the pointer kernels under impl="auto"


def test_empty_chunk():
    """C = 0: nothing to do; dW written with zeros (an empty sum) or left as it was."""
    g, x = torch.empty(0, V, device=DEVICE), torch.empty(0, H, device=DEVICE)
    out = torch.full((V, H), NAN, device=DEVICE)
    dw_rows(g, x, _count(0), out, True)
    assert torch.isnan(out).all()
    dw_rows(g, x, _count(0), out, False)
    assert (out == 0).all()


# ----------------------------------------------------------------------------------------------
# GPU: realistic bf16 shapes, both paths, no host synchronization


@pytest.mark.gpu
@pytest.mark.parametrize("v", [8192, 8003])  # 8192: TMA under impl="auto"; 8003 (unaligned rows): pointers
def test_gpu_bf16_no_sync(v):
    c, h = 1000, 1024
    dt = torch.bfloat16
    x, w = _rand(c, h, dtype=dt, seed=51), _rand(v, h, dtype=dt, seed=52) * 0.05
    b = _rand(v, dtype=dt, seed=53)
    g = _rand(c, v, dtype=dt, seed=54) * 0.05
    z, dx = torch.empty(c, v, dtype=dt, device="cuda"), torch.empty(c, h, dtype=dt, device="cuda")
    acc = torch.empty(v, h, device="cuda")
    assert rg.tma_eligible((x, w), (z,)) == (v % 8 == 0)
    for n in (c, 517, 1, 0):
        xs, gs = _poison_rows(x, n), _poison_rows(g, n)
        cnt = _count(n)
        z.fill_(NAN)
        dx.fill_(NAN)
        acc.fill_(0.5)
        logits_rows(xs, w, b, cnt, z)  # the first call of each kernel autotunes (synchronizes)
        dx_rows(gs, w, cnt, dx)
        dw_rows(gs, xs, cnt, acc, True)
        torch.cuda.synchronize()
        z.fill_(NAN)
        dx.fill_(NAN)
        acc.fill_(0.5)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            logits_rows(xs, w, b, cnt, z)
            dx_rows(gs, w, cnt, dx)
            dw_rows(gs, xs, cnt, acc, True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        _check_rows("logits", z, n, xs[:n].double() @ w.double().T + b.double(), torch.addmm(b, xs[:n], w.T))
        _check_rows("dx", dx, n, gs[:n].double() @ w.double(), gs[:n] @ w)
        ref = 0.5 + gs[:n].double().T @ xs[:n].double()
        same = torch.ops.aten.addmm.dtype_out(torch.full_like(acc, 0.5), gs[:n].T, xs[:n], torch.float32,
                                              out=torch.empty_like(acc))
        if n:
            assert_close_to_ref("dw", acc, ref, same)
        else:
            assert (acc == 0.5).all()
