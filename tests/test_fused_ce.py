"""Tests of the "fused" strategy kernels (fusedkern/kernels/fused_ce.py).

On CPU the kernels run in Triton's interpreter (tiny shapes; fp32 and fp16, since the interpreter's
tl.dot mishandles bf16). Every output (loss_tok, lse, dx, dw, db) is compared with a float64 reference
computed here with plain torch from docs/design.md, under the rule

    |kernel − fp64| ≤ 2 · |torch in the same dtype − fp64| + atol      (max over the tensor)

where "torch in the same dtype" is the same formulas evaluated by torch in the test dtype, so the
kernel may not be less accurate than the obvious implementation. The GPU class (pytest -m gpu) checks
bf16/fp16/fp32 at realistic shapes with the same rule.
"""

from __future__ import annotations

import fusedkern._runtime  # noqa: F401  (first: picks GPU or the interpreter before the kernels import)

import math

import pytest
import torch

from fusedkern.kernels import fused_ce as fc
from fusedkern.kernels.fused_ce import fused_ce_backward, fused_ce_forward, workspace_bytes

CPU = not torch.cuda.is_available()
DEV = "cpu" if CPU else "cuda"
ATOL = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # × max |reference|
#: a larger block configuration: fewer interpreter program instances for the mid-size shapes
BIG = dict(BLOCK_T=32, BLOCK_V=64, BLOCK_H=32)


# ----------------------------------------------------------------------------------------------
# reference


def torch_ce(x, w, b, y, cw, **opts):
    """ℓ_t and lse_t of docs/design.md, evaluated by torch in the dtype of x (autograd-able)."""
    z = x @ w.T
    if b is not None:
        z = z + b
    return torch_ce_from_logits(z, y, cw, **opts)


def torch_ce_from_logits(z, y, cw, *, ignore_index, label_smoothing, z_loss, softcap):
    """ℓ_t and lse_t from the logits z [T, V], in z's dtype."""
    V = z.shape[1]
    s = softcap * torch.tanh(z / softcap) if softcap else z
    lse = torch.logsumexp(s, dim=-1)
    logp = s - lse[:, None]
    valid = y != ignore_index
    yc = torch.where(valid, y, torch.zeros_like(y))
    wv = cw.to(s.dtype) if cw is not None else torch.ones(V, dtype=s.dtype, device=s.device)
    nll = -logp.gather(1, yc[:, None])[:, 0] * wv[yc]
    smooth = -(logp * wv).sum(dim=-1)
    loss = (1.0 - label_smoothing) * nll + (label_smoothing / V) * smooth + z_loss * lse * lse
    return torch.where(valid, loss, torch.zeros_like(loss)), lse


def torch_loss_from_rounded_logits(x, w, b, y, cw, dtype, **opts):
    """(loss, lse) with the logits GEMM in `dtype` and everything after it in fp32: the yardstick of
    the kernel's fp32 loss and lse (a half-precision softmax would round the loss itself)."""
    with torch.no_grad():
        z = x.to(dtype) @ w.to(dtype).T
        if b is not None:
            z = z + b.to(dtype)
        return torch_ce_from_logits(z.float(), y, None if cw is None else cw.float(), **opts)


def torch_grads(x, w, b, y, cw, g, dtype, **opts):
    """(loss, lse, dx, dw, db) of Σ_t g_t·ℓ_t computed by torch in `dtype` (fp64 for the reference)."""
    xd = x.detach().to(dtype).requires_grad_()
    wd = w.detach().to(dtype).requires_grad_()
    bd = b.detach().to(dtype).requires_grad_() if b is not None else None
    cwd = cw.to(dtype) if cw is not None else None
    loss, lse = torch_ce(xd, wd, bd, y, cwd, **opts)
    (loss * g.to(dtype)).sum().backward()
    return loss.detach(), lse.detach(), xd.grad, wd.grad, (bd.grad if bd is not None else None)


def assert_close_rule(name, got, ref64, same, dtype):
    assert got is not None, name
    assert got.shape == ref64.shape, (name, got.shape, ref64.shape)
    assert torch.isfinite(got).all(), f"{name}: non-finite values (unwritten poison?)"
    err = (got.double() - ref64).abs().max().item()
    err_torch = (same.double() - ref64).abs().max().item()
    atol = ATOL[dtype] * max(ref64.abs().max().item(), 1e-3)
    assert err <= 2.0 * err_torch + atol, f"{name}: kernel error {err:.3e} > 2 × torch's {err_torch:.3e} + {atol:.3e}"


def make_inputs(T, H, V, dtype, *, bias=False, class_weight=False, ignore="some", ignore_index=-100,
                logit_scale=3.0, seed=0, device=DEV):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(device=device, dtype=dtype)
    w = (torch.randn(V, H, generator=gen) * (logit_scale / math.sqrt(H))).to(device=device, dtype=dtype)
    b = (torch.randn(V, generator=gen) * 0.5).to(device=device, dtype=dtype) if bias else None
    cw = (torch.rand(V, generator=gen) * 1.8 + 0.2).to(device) if class_weight else None
    y = torch.randint(0, V, (T,), generator=gen)
    if ignore == "some":
        y[torch.rand(T, generator=gen) < 0.3] = ignore_index
        if T > 1:
            y[0] = ignore_index
    elif ignore == "all":
        y[:] = ignore_index
    g = torch.randn(T, generator=gen)  # non-uniform upstream gradient, signs mixed
    g[:: 5] = 0.0
    return x, w, b, y.to(device), cw, g.to(device)


def check(T, H, V, dtype, *, bias=False, class_weight=False, ignore="some", ignore_index=-100,
          label_smoothing=0.0, z_loss=0.0, softcap=None, need=(True, True, True), logit_scale=3.0, seed=0,
          block_config=None, n_split=None, max_workspace_bytes=None, x_stride_pad=0, w_stride_pad=0):
    x, w, b, y, cw, g = make_inputs(T, H, V, dtype, bias=bias, class_weight=class_weight, ignore=ignore,
                                    ignore_index=ignore_index, logit_scale=logit_scale, seed=seed)
    opts = dict(ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap)
    xk, wk = x, w
    if x_stride_pad:  # a view with a row stride larger than H
        xk = torch.full((T, H + x_stride_pad), float("nan"), dtype=dtype, device=x.device)[:, :H]
        xk.copy_(x)
    if w_stride_pad:
        wk = torch.full((V, H + w_stride_pad), float("nan"), dtype=dtype, device=w.device)[:, :H]
        wk.copy_(w)

    loss, lse = fused_ce_forward(xk, wk, b, y, cw, **opts, block_config=block_config, n_split=n_split)
    need_dx, need_dw, need_db = need
    dx, dw, db = fused_ce_backward(xk, wk, b, y, cw, lse, g, **opts, need_dx=need_dx, need_dw=need_dw,
                                   need_db=need_db, block_config=block_config,
                                   max_workspace_bytes=max_workspace_bytes)

    ref = torch_grads(x, w, b, y, cw, g, torch.float64, **opts)
    same = torch_grads(x, w, b, y, cw, g, dtype, **opts)
    assert loss.dtype == torch.float32 and lse.dtype == torch.float32
    same_loss, same_lse = torch_loss_from_rounded_logits(x, w, b, y, cw, dtype, **opts)
    assert_close_rule("loss_tok", loss, ref[0], same_loss, dtype)
    assert_close_rule("lse", lse, ref[1], same_lse, dtype)
    ignored = y == ignore_index
    assert (loss[ignored] == 0).all()
    for name, got, want, r, s in (("dx", dx, need_dx, ref[2], same[2]), ("dw", dw, need_dw, ref[3], same[3]),
                                  ("db", db, need_db and bias, ref[4], same[4])):
        if not want:
            assert got is None, name
            continue
        assert got.dtype == dtype, (name, got.dtype)
        assert_close_rule(name, got, r, s, dtype)
    if need_dx and dx is not None:
        assert (dx[ignored] == 0).all()
    return loss, lse, dx, dw, db


DTYPES = [torch.float32, torch.float16]
OPTIONS = {
    "plain": dict(),
    "bias": dict(bias=True),
    "class_weight": dict(class_weight=True),
    "smoothing": dict(label_smoothing=0.1),
    "smoothing_class_weight": dict(label_smoothing=0.25, class_weight=True),
    "z_loss": dict(z_loss=0.05),
    "softcap": dict(softcap=4.0),
    "all": dict(bias=True, class_weight=True, label_smoothing=0.1, z_loss=1e-2, softcap=6.0),
}


# ----------------------------------------------------------------------------------------------
# CPU (interpreter) tests


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_each_option(option, dtype):
    check(23, 37, 101, dtype, **OPTIONS[option])


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("T,H,V,cfg", [
    (1, 17, 31, None),  # one token: dW/db stored directly (single writer)
    (16, 64, 256, None),  # every dimension a multiple of every block
    (37, 79, 293, BIG),  # primes
    (40, 80, 300, BIG),  # the largest test shape
    (5, 3, 7, None),  # H and V smaller than one block
])
def test_shapes_all_options(T, H, V, cfg, dtype):
    check(T, H, V, dtype, block_config=cfg, **OPTIONS["all"])


@pytest.mark.parametrize("ignore", ["none", "some", "all"])
@pytest.mark.parametrize("ignore_index", [-100, 3])  # 3: an in-vocabulary id used as ignore_index
def test_ignore_masks(ignore, ignore_index):
    check(19, 24, 70, torch.float32, ignore=ignore, ignore_index=ignore_index, bias=True, label_smoothing=0.1,
          z_loss=0.01)


def test_all_ignored_gives_exact_zeros():
    _, lse, dx, dw, db = check(20, 16, 40, torch.float16, ignore="all", bias=True, label_smoothing=0.2)
    assert torch.isfinite(lse).all()
    assert (dx == 0).all() and (dw == 0).all() and (db == 0).all()


@pytest.mark.parametrize("need", [(True, False, False), (False, True, False), (False, False, True),
                                  (True, False, True), (False, True, True)],
                         ids=["dx", "dw", "db", "dx+db", "dw+db"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
def test_need_flags(need, dtype):
    check(21, 20, 50, dtype, bias=True, softcap=5.0, need=need)


def test_need_nothing_returns_nones():
    x, w, b, y, cw, g = make_inputs(4, 8, 10, torch.float32, bias=True)
    lse = torch.zeros(4)
    out = fused_ce_backward(x, w, b, y, cw, lse, g, ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
                            softcap=None, need_dx=False, need_dw=False, need_db=False)
    assert out == (None, None, None)
    # need_db without a bias: nothing to compute either
    out = fused_ce_backward(x, w, None, y, cw, lse, g, ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
                            softcap=None, need_dx=False, need_dw=False, need_db=True)
    assert out == (None, None, None)


@pytest.mark.parametrize("budget,what", [
    (4 * 16 * 30, "two passes: T-chunks of 16 rows for dX, V-chunks of 32 rows for dW"),
    (4 * 40 * 30 + 4 * 64 * 30, "one pass: whole fp32 dX, V-chunks of 64 rows for dW"),
    (1 << 30, "one pass, one launch"),
])
def test_workspace_plans_fp16(budget, what):
    # fp16 operands need fp32 accumulators: every plan of _plan_backward must give the same gradients
    check(40, 30, 150, torch.float16, bias=True, class_weight=True, label_smoothing=0.1, max_workspace_bytes=budget)


def test_workspace_two_passes_dx_only_and_dw_only():
    check(40, 30, 100, torch.float16, bias=True, need=(True, False, True), max_workspace_bytes=4 * 16 * 30)
    check(40, 30, 100, torch.float16, bias=True, need=(False, True, True), max_workspace_bytes=4 * 16 * 30)


def test_plan_backward():
    P = fc._plan_backward
    bf16, f32 = torch.bfloat16, torch.float32
    # LM sizes, bf16, 16 MiB: two passes, each accumulator ≤ 16 MiB
    passes, store = P(32768, 128256, 4096, bf16, bf16, True, True, 16 << 20, 128, 256, 64)
    assert not store
    assert passes == [(fc._MODE_DX, "T", 1024), (fc._MODE_DW, "V", 1024)]
    # small T: the fp32 dX fits, one pass over V-chunks
    passes, _ = P(256, 128256, 4096, bf16, bf16, True, True, 16 << 20, 128, 256, 64)
    assert passes[0][:2] == (fc._MODE_SINGLE, "V") and 4 * 256 * 4096 + 4 * passes[0][2] * 4096 <= 16 << 20
    # fp32: accumulate into the outputs, one launch
    assert P(32768, 128256, 4096, f32, f32, True, True, 16 << 20, 128, 256, 64) == ([(fc._MODE_SINGLE, "T", 32768)], False)
    # one token block: dW stored directly
    assert P(48, 128256, 4096, bf16, bf16, True, True, 16 << 20, 128, 256, 64)[1] is True
    for tokens in (4096, 32768):  # the default budget holds everything, vectors included, within 16 MiB
        ws = workspace_bytes(tokens, 128256, 4096, bf16)
        assert ws["backward"] + 8 * tokens <= 16 << 20  # + the forward's saved (max, log-sum) statistics
        assert ws["forward"] <= 16 << 20


def test_v_chunks_fill_whole_waves():
    # 14.6 MiB of accumulators allow 768 rows; at 4096 tokens (32 blocks of 128) that is 192 programs on
    # 132 SMs (73 % of the last wave busy), so the plan takes 512 rows (128 programs, one wave, 97 %)
    budget = 14 * 2**20 + 600 * 1024
    assert fc._v_chunk_rows(budget, 4096, 256, 128256, 4096, None, 128) == 768
    assert fc._v_chunk_rows(budget, 4096, 256, 128256, 4096, 132, 128) == 512
    assert fc._v_chunk_rows(budget, 4096, 256, 128256, 32768, 132, 128) == 768  # 1536 programs: 97 %


@pytest.mark.parametrize("n_split", [1, 2, 5])
def test_forward_splits_agree(n_split):
    # the split combine (max / rescaled sum-exp / target logit / smoothing sum) for several splits;
    # large logits (~±60) check the online max
    check(9, 16, 150, torch.float32, n_split=n_split, label_smoothing=0.3, class_weight=True, logit_scale=60.0,
          need=(True, False, False))


def test_huge_logits_fp32():
    # |z| ~ 1e3: exp would overflow without the running max; softcap saturates the other case
    check(12, 20, 64, torch.float32, logit_scale=1000.0, bias=True)
    check(12, 20, 64, torch.float32, logit_scale=1000.0, softcap=30.0, z_loss=1e-4)


def test_strided_inputs():
    # row strides larger than H (views into wider buffers padded with NaN)
    check(13, 24, 45, torch.float16, x_stride_pad=5, w_stride_pad=3, bias=True, softcap=5.0)


@pytest.mark.parametrize("budget", [None, 4 * 16 * 30])
def test_grouped_launch_order(budget):
    # GROUP_T = 2 token blocks per group over 3 token blocks: a full group and a partial one
    cfg = dict(BLOCK_T=16, BLOCK_V=32, BLOCK_H=16, GROUP_T=2)
    check(40, 30, 70, torch.float16, block_config=cfg, bias=True, max_workspace_bytes=budget)


def test_interpreter_default_blocks_tail_masks():
    # the interpreter's default (16, 32, 16) blocks with every dimension one past a block multiple
    check(17, 33, 65, torch.float16, bias=True, class_weight=True, label_smoothing=0.1, z_loss=1e-3, softcap=8.0)


def test_empty_batch():
    x, w, b, y, cw, g = make_inputs(1, 8, 10, torch.float32, bias=True)
    x, y, g = x[:0], y[:0], g[:0]
    loss, lse = fused_ce_forward(x, w, b, y, cw, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None)
    assert loss.shape == (0,) and lse.shape == (0,)
    dx, dw, db = fused_ce_backward(x, w, b, y, cw, lse, g, ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
                                   softcap=None, need_dx=True, need_dw=True, need_db=True)
    assert dx.shape == (0, 8) and (dw == 0).all() and (db == 0).all()


# ----------------------------------------------------------------------------------------------
# GPU tests (pytest -m gpu on a CUDA machine)


@pytest.mark.gpu
@pytest.mark.skipif(CPU, reason="needs a CUDA GPU")
class TestGPU:
    V = 32000 + 3  # realistic and odd

    @pytest.mark.parametrize("option", ["plain", "all", "smoothing_class_weight", "softcap"])
    def test_bf16_realistic(self, option):
        check(1024, 4096, self.V, torch.bfloat16, logit_scale=4.0, **OPTIONS[option])

    def test_bf16_one_pass(self):
        # a budget large enough for the whole fp32 dX: V-chunked single pass
        check(1024, 4096, self.V, torch.bfloat16, bias=True, label_smoothing=0.1, max_workspace_bytes=64 << 20)

    def test_bf16_few_tokens_store_path(self):
        check(48, 4096, self.V, torch.bfloat16, bias=True, softcap=30.0)

    def test_bf16_two_passes_many_chunks(self):
        # T not a multiple of the blocks, several T- and V-chunks
        check(3001, 1024, 8191, torch.bfloat16, bias=True, class_weight=True, label_smoothing=0.1, z_loss=1e-4,
              max_workspace_bytes=2 << 20)

    def test_fp16_realistic(self):
        check(1024, 4096, self.V, torch.float16, **OPTIONS["all"])

    def test_fp32(self):
        check(512, 1024, 8003, torch.float32, **OPTIONS["all"])

    def test_padding_rows_skipped(self):
        # whole ignored token blocks take the early exit
        check(1024, 1024, 8003, torch.bfloat16, ignore="all", bias=True)
