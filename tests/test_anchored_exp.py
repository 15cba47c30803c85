"""Anchored exponentials (fusedkern/anchored.py, kernels/anchored_rows.py, kernels/gluon_anchored_exp.py).

CPU (Triton's interpreter for the row kernels, the torch reference for the logits GEMM's producer): cross-entropy
(mean, sum, none) and per-token log-probs at a temperature with an upstream gradient, against float64 within 2×
torch's own bf16 error; ragged shapes and several chunks (the fp32 accumulator, E in dW's storage); ignored and
all-ignored rows; rows whose log-sum-exp lies past the anchor's reach, which the counted exact pass recomputes;
poisoned allocations; the identity r ⊙ E' = ∂L/∂z; the plan at the study's heads; bad arguments; the row max (the
producer's max plane, the merged row max against float64 within 2× torch's fp32 error, is_top1 from it against the
float64 argmax, flagged rows from the exact pass, ignored rows 0). The Gluon producer: its sm_90a compile (no spill,
with and without the row max's plane) and, on an sm_90 GPU, its outputs against the torch reference."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fusedkern import anchored, reference
from fusedkern.anchored import (
    CHUNK_MULTIPLE,
    AnchoredPlan,
    anchored_cross_entropy,
    anchored_logprobs,
    anchored_loss_and_grads,
    anchored_plan,
    kept_e_rows,
    logprobs_forward,
    loss_only,
)
from fusedkern.engine import LossOptions
from fusedkern.kernels.anchored_rows import (
    A2,
    CLAMP2,
    IGNORED,
    SUMS,
    SUMS_AND_E,
    TILE_N,
    column_tiles,
    e_row_stride,
    finish_rows,
    part_planes,
    producer_reference,
    target_anchors,
)
from fusedkern.logprobs import is_top1
from tests._accuracy import assert_close_to_ref, torch_linear_cross_entropy, torch_logprobs_entropy
from tests.conftest import DEVICE
from tests.test_gluon_loss_only import make_inputs

ROOT = Path(__file__).resolve().parents[1]
ON_SM90 = DEVICE == "cuda" and torch.cuda.get_device_capability() == (9, 0)


def extreme_rows(x, w, y, rows, gap):
    """Rows `rows` get one class `gap` nats above their target's logit (past the anchor's reach when gap > 86):
    x's first coordinate set to 8 and that class's weight to gap/8 there, the target's to 0."""
    x, w = x.clone(), w.clone()
    hot = (y[rows[0]].item() + 1) % w.shape[0]
    x[rows, 0] = 8.0
    w[:, 0] = 0.0
    w[hot, 0] = gap / 8.0
    return x, w, hot


def grads_of(fn, x, w, *args, upstream=None, **kwargs):
    """(output, dX, dW) of fn(x, w, *args) with `upstream` (or 1) on its first output."""
    xl, wl = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    out = fn(xl, wl, *args, **kwargs)
    first = out[0] if isinstance(out, tuple) else out
    (first * (1.0 if upstream is None else upstream)).sum().backward()
    return out, xl.grad, wl.grad


def check_ce(x, w, y, reduction, **kwargs):
    out, dx, dw = grads_of(anchored_cross_entropy, x, w, y, reduction=reduction, **kwargs)
    up = None if reduction != "none" else torch.linspace(-1.0, 2.0, y.numel(), device=y.device)
    if up is not None:
        out, dx, dw = grads_of(anchored_cross_entropy, x, w, y, reduction=reduction, upstream=up, **kwargs)
    ref, rdx, rdw = grads_of(reference.linear_cross_entropy_fp64, x.double(), w.double(), y, reduction=reduction,
                             upstream=None if up is None else up.double())
    tch, tdx, tdw = grads_of(torch_linear_cross_entropy, x, w, y, reduction=reduction, upcast_logits=True,
                             upstream=up)
    assert out.dtype == torch.float32 and dx.dtype == x.dtype and dw.dtype == w.dtype
    assert_close_to_ref("loss", out, ref, tch.detach(), atol=1e-5)
    assert_close_to_ref("dX", dx, rdx, tdx, atol=1e-3)
    assert_close_to_ref("dW", dw, rdw, tdw, atol=1e-3)
    return out, dx, dw


# ------------------------------------------------------------------------------------------------------ CPU


@pytest.mark.parametrize("reduction,chunk_tokens", [("mean", None), ("mean", 16), ("sum", 16), ("none", None)],
                         ids=["mean-one_chunk", "mean-chunks", "sum-chunks", "none"])
def test_cross_entropy_matches_fp64_within_twice_torch(reduction, chunk_tokens, poison_allocations):
    """Odd shapes (T 37, H 48, V 1000: the last column tile ragged), ignored rows; chunks of 16 put dW in the fp32
    accumulator and E in dW's own storage; "none" keeps E to the backward (its upstream arrives there). Every buffer
    poisoned first."""
    x, w, y = make_inputs(37, 48, 1000)
    poison_allocations()
    check_ce(x, w, y, reduction, chunk_tokens=chunk_tokens)


def test_lean_dw_and_a_vocabulary_e_must_pad():
    """weight_grad_accum="weight_dtype" (dW summed in bf16 across chunks) and V = 1003, whose E rows are padded to
    1008 elements for TMA: the same results within the rule."""
    x, w, y = make_inputs(33, 32, 1003, seed=5)
    assert e_row_stride(1003) == 1008
    check_ce(x, w, y, "mean", chunk_tokens=8, weight_grad_accum="weight_dtype")


def test_ignored_and_all_ignored_rows():
    """All ignored: sum 0 with zero gradients, mean NaN as torch's; ignored rows get exact zeros in dX."""
    x, w, y = make_inputs(20, 32, 300, seed=1)
    none = torch.full_like(y, -100)
    out, dx, dw = grads_of(anchored_cross_entropy, x, w, none, reduction="sum")
    assert out.item() == 0.0 and not dx.any() and not dw.any()
    mean = anchored_cross_entropy(x, w, none, reduction="mean")
    assert torch.isnan(mean)
    _, dx, _ = grads_of(anchored_cross_entropy, x, w, y, reduction="mean")
    assert not dx[y == -100].any() and dx[y != -100].abs().sum(-1).min() > 0


def test_rows_past_the_anchors_reach_take_the_exact_pass():
    """Rows 1 and 6 have a class 95 nats above their target (flagged: an element clamps), row 3 one 70 nats above
    (held by the anchor: unflagged); each chunk holds a flagged row. Loss, dX and dW within the rule, the flags as
    designed, and the flagged rows' loss past 90 nats (the clamp alone would stop it at (A2 + CLAMP2)·ln 2 = 86)."""
    x, w, y = make_inputs(24, 32, 400, seed=2, ignore_frac=0.0)
    x, w, hot = extreme_rows(x, w, y, [1, 6], 95.0)
    x[3, 0] = 8.0 * 70.0 / 95.0
    res = anchored_loss_and_grads(x, w, y, LossOptions(), torch.ones(1, device=x.device), need_dx=True,
                                  need_dw=True, plan=AnchoredPlan(5, True, True))
    assert res.flagged.nonzero().flatten().tolist() == [1, 6]
    assert res.loss[1].item() > 90.0 and res.loss[6].item() > 90.0 and 60.0 < res.loss[3].item() < 80.0
    out, dx, dw = check_ce(x, w, y, "sum", chunk_tokens=5)
    assert out.isfinite() and dx.isfinite().all() and dw.isfinite().all()


def test_gradient_identity_r_times_e_prime_is_dl_dz():
    """The row kernel's outputs on the reference producer's E: r ⊙ E' equals g·k·(softmax(s) − onehot) in fp64 to
    E's bf16 rounding; the target element is the only one replaced."""
    x, w, y = make_inputs(9, 32, 300, seed=4, dtype=torch.float32)
    k = 1 / 0.7
    s_y, anchor = target_anchors(x, w, y, ignore_index=-100, logit_scale=k)
    T, V = 9, 300
    parts = torch.empty((1, T, column_tiles(V)), device=x.device)
    e = torch.empty((T, V), device=x.device, dtype=torch.bfloat16)
    producer_reference(x, w, anchor, parts, e, logit_scale=k, epilogue=SUMS_AND_E)
    before = e.clone()
    vec = [torch.empty(T, device=x.device) for _ in range(4)]
    flagged = torch.empty(T, device=x.device, dtype=torch.int8)
    g = torch.linspace(0.5, 1.5, T, device=x.device)
    finish_rows(parts, s_y, y, V, ignore_index=-100, sums=vec[0], loss=vec[1], lse=vec[2], flagged=flagged,
                grad=g, r=vec[3], e=e, logit_scale=k)
    valid = y != -100
    changed = (e != before).nonzero()
    assert set(map(tuple, changed.tolist())) <= {(t, y[t].item()) for t in range(T) if valid[t]}
    s = (x.double() @ w.double().t()) * k
    p = torch.softmax(s, -1)
    want = g.double()[:, None] * k * (p - torch.nn.functional.one_hot(torch.where(valid, y, 0), V))
    want[~valid] = 0
    got = vec[3].double()[:, None] * e.double()
    torch.testing.assert_close(got, want, rtol=8e-3, atol=1e-9)
    assert_loss = torch.where(valid, torch.logsumexp(s, -1) - s.gather(1, torch.where(valid, y, 0)[:, None])[:, 0], 0)
    torch.testing.assert_close(vec[1].double(), assert_loss, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_with_upstream_and_entropy(temperature, poison_allocations):
    """Per-token log-probs at a temperature with an arbitrary upstream in backward (E kept from the forward), the
    entropy's value: against float64 within 2× torch's error (logits in bf16, the rest fp32)."""
    x, w, y = make_inputs(29, 64, 700, seed=6)
    up = torch.randn(29, generator=torch.Generator().manual_seed(1)).to(x.device)
    poison_allocations()
    (logp, entropy, lse), dx, dw = grads_of(anchored_logprobs, x, w, y, temperature=temperature,
                                            return_entropy=True, upstream=up)
    f64 = [t.detach().double().requires_grad_() for t in (x, w)]
    s = (f64[0] @ f64[1].t()) / temperature
    logsm = torch.log_softmax(s, -1)
    valid = y != -100
    ref_logp = torch.where(valid, logsm.gather(1, torch.where(valid, y, 0)[:, None])[:, 0], 0)
    ref_entropy = torch.where(valid, -(logsm.exp() * logsm).sum(-1), 0)
    (ref_logp * up.double()).sum().backward()
    same = [t.detach().clone().requires_grad_() for t in (x, w)]
    tch_logp, tch_entropy = torch_logprobs_entropy(same[0], same[1], y, None, softcap=None, temperature=temperature,
                                                   upcast=True)
    (tch_logp * up).sum().backward()
    assert_close_to_ref("logp", logp, ref_logp, tch_logp.detach(), atol=1e-4)
    assert_close_to_ref("entropy", entropy, ref_entropy, tch_entropy.detach(), atol=1e-4)
    torch.testing.assert_close(lse[valid].double(), torch.logsumexp(s, -1)[valid].detach(), rtol=1e-5, atol=1e-4)
    for name, got, ref, tch in zip(("dX", "dW"), (dx, dw), f64, same):
        assert_close_to_ref(name, got, ref.grad, tch.grad, atol=1e-3)


def test_logprobs_flagged_rows_and_one_backward():
    """A flagged row in the per-token path: its log-prob from the forward's exact pass, its gradient from the
    backward's; a second backward through the same call raises."""
    x, w, y = make_inputs(12, 32, 260, seed=8, ignore_frac=0.0)
    x, w, _ = extreme_rows(x, w, y, [4], 100.0)
    up = torch.linspace(-1, 1, 12, device=x.device)
    (logp, _, _), dx, dw = grads_of(anchored_logprobs, x, w, y, upstream=up)
    f64 = [t.detach().double().requires_grad_() for t in (x, w)]
    ref = reference.linear_logprobs_fp64(f64[0], f64[1], y)
    (ref * up.double()).sum().backward()
    assert logp[4].item() < -90.0  # the clamp alone would stop it at −86
    torch.testing.assert_close(logp.double(), ref.detach(), rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(dx.double(), f64[0].grad, rtol=5e-2, atol=2e-2)
    torch.testing.assert_close(dw.double(), f64[1].grad, rtol=5e-2, atol=2e-2)
    xl = x.clone().requires_grad_()
    logp, _, _ = anchored_logprobs(xl, w, y)
    logp.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward"):
        logp.sum().backward()


def test_kept_e_is_allocated_for_a_rounded_row_count(poison_allocations, monkeypatch):
    """A per-token forward allocates E and its partial sums for `kept_e_rows(T)` rows (≤ 12.5 % more from 1024 rows
    on, nine sizes between 4096 and 8192 rows), so that micro-batches of varying scored tokens ask the caching
    allocator for few sizes; E's view has the strides of an exact allocation, so the log-probs, the entropy and the
    gradients are the same bits as with one of exactly T rows, and the poisoned rows past T are never read."""
    assert [kept_e_rows(t) for t in (0, 1, 128, 129, 1000, 1025, 4097, 8192)] == [0, 128, 128, 256, 1024, 1152, 4608,
                                                                                   8192]
    for t in range(1, 20000, 37):
        k = kept_e_rows(t)
        assert k >= t and k % CHUNK_MULTIPLE == 0 and (k <= 1.125 * t or k - t < CHUNK_MULTIPLE), (t, k)
    assert len({kept_e_rows(t) for t in range(4096, 8193)}) == 9
    x, w, y = make_inputs(150, 32, 300, seed=12)
    up = torch.linspace(-1.0, 2.0, 150, device=x.device)
    poison_allocations()
    e, _ = logprobs_forward(x, w, y, LossOptions(), with_entropy=True, with_row_max=True)
    assert e.shape == (150, 300) and e.untyped_storage().nbytes() == kept_e_rows(150) * e_row_stride(300) * 2 > (
        150 * e_row_stride(300) * 2)
    rounded = grads_of(anchored_logprobs, x, w, y, return_entropy=True, upstream=up)
    monkeypatch.setattr(anchored, "kept_e_rows", lambda rows: rows)
    exact = grads_of(anchored_logprobs, x, w, y, return_entropy=True, upstream=up)
    for u, v in zip((*rounded[0], *rounded[1:]), (*exact[0], *exact[1:])):
        assert torch.equal(u, v)


def test_same_bits_twice():
    """No atomics: two runs of the same call give the same loss, dX and dW bits."""
    x, w, y = make_inputs(30, 32, 500, seed=9)
    a = grads_of(anchored_cross_entropy, x, w, y, chunk_tokens=8)
    b = grads_of(anchored_cross_entropy, x, w, y, chunk_tokens=8)
    for u, v in zip(a, b):
        assert torch.equal(u, v)


def test_plan_at_the_study_heads():
    """Beside the fp32 accumulator E takes what the 2 GiB allowance leaves (4096-token chunks at hidden 1024 and
    2048), or lives in dW's own storage where that holds more (hidden 4096); a batch whose E fits the chunked
    strategy's allowance runs as one chunk with no accumulator."""
    assert anchored_plan(16384, 151936, 1024, need_dw=True, fp32_accum=True) == AnchoredPlan(4096, True, False)
    assert anchored_plan(8192, 128256, 2048, need_dw=True, fp32_accum=True) == AnchoredPlan(4096, True, False)
    assert anchored_plan(16384, 128256, 4096, need_dw=True, fp32_accum=True) == AnchoredPlan(4096, True, True)
    assert anchored_plan(2048, 151936, 1024, need_dw=True, fp32_accum=True) == AnchoredPlan(2048, False, False)
    assert anchored_plan(16384, 128256, 4096, need_dw=True, fp32_accum=True, chunk_tokens=8192).chunk_tokens == 8192


def test_anchor_constants_keep_the_arithmetic_in_range():
    """The clamp keeps every E and every row sum finite in fp32 at a 2^18 vocabulary, the anchor keeps the row's
    significant mass (40 nats below its target) above the flush to zero, and an ignored row's anchor zeroes it."""
    assert 2.0 ** CLAMP2 * 2**18 < torch.finfo(torch.float32).max / 2**20
    assert -40 * 1.4426950408889634 - A2 > -126
    assert torch.exp2(torch.tensor(50.0) - IGNORED).item() == 0.0


def test_bad_arguments_raise():
    x, w, y = make_inputs(8, 32, 64, seed=3)
    with pytest.raises(ValueError, match="reduction"):
        anchored_cross_entropy(x, w, y, reduction="max")
    with pytest.raises(ValueError, match="temperature"):
        anchored_logprobs(x, w, y, temperature=0.0)
    with pytest.raises(ValueError, match="hidden"):
        anchored_cross_entropy(x[:, :16], w, y)
    with pytest.raises(TypeError, match="target"):
        anchored_cross_entropy(x, w, y.float())
    with pytest.raises(TypeError, match="return_entropy"):
        anchored_logprobs(x, w, y, return_entropy=1)
    bad = y.clone()
    bad[2] = 64
    with pytest.raises(ValueError, match="target"):
        anchored_cross_entropy(x, w, bad)


def negative_last_tile(x, w):
    """Every logit of the last (ragged) column tile negative, below the 0 that its columns past V would give: x's
    first coordinate 1 and those classes' weights (−1, 0, …). A tile max taken over the padding would read 0."""
    x, w = x.clone(), w.clone()
    first = (column_tiles(w.shape[0]) - 1) * TILE_N
    x[:, 0] = 1.0
    w[first:] = 0.0
    w[first:, 0] = -1.0
    return x, w


def tile_max_fp64(x, w, T, V):
    """[T, tiles] float64: each row's max of x·w_v over each column tile's columns below V."""
    n = column_tiles(V)
    acc = torch.nn.functional.pad(x.double() @ w.double().t(), (0, n * TILE_N - V), value=float("-inf"))
    return acc.view(T, n, TILE_N).amax(-1)


@pytest.mark.parametrize("entropy", [False, True])
def test_reference_producer_max_plane(entropy):
    """The max plane is parts' last: each tile's max of the fp32 accumulator x·w_v (not tempered, no anchor) against
    float64 to fp32 rounding, the ragged tail's padding excluded (its logits all −1 here); the other planes the same
    bits as without it."""
    T, H, V = 6, 32, 600  # three column tiles, the last 88 columns wide
    x, w, y = make_inputs(T, H, V, seed=21, dtype=torch.float32)
    x, w = negative_last_tile(x, w)
    _, anchor = target_anchors(x, w, y, ignore_index=-100, logit_scale=1.3)
    planes = part_planes(entropy=entropy, row_max=True)
    parts = torch.full((planes, T, column_tiles(V)), float("nan"), device=x.device)
    plain = torch.full((planes - 1, T, column_tiles(V)), float("nan"), device=x.device)
    producer_reference(x, w, anchor, parts, None, logit_scale=1.3, epilogue=SUMS, row_max=True)
    producer_reference(x, w, anchor, plain, None, logit_scale=1.3, epilogue=SUMS)
    assert torch.equal(parts[:-1], plain)
    ref = tile_max_fp64(x, w, T, V)
    assert (ref[:, -1] < 0).all()
    torch.testing.assert_close(parts[-1].double(), ref, rtol=4e-7, atol=1e-6)
    with pytest.raises(AssertionError, match="planes"):
        producer_reference(x, w, anchor, parts[:1], None, epilogue=SUMS, row_max=True)


def row_max_case(seed):
    """bf16 inputs (T 40, H 32, V 600, τ 0.7, a fifth of the rows ignored) whose first 16 targets are the float64
    argmax; the float64 tempered logits s."""
    x, w, y = make_inputs(40, 32, 600, seed=seed)
    s = (x.double() @ w.double().t()) / 0.7
    y[:16] = s[:16].argmax(-1)
    return x, w, y, s


def check_row_max(res, x, w, y, s):
    """row_max within 2× torch's fp32 error of float64's, 0 on ignored rows; is_top1 from it equals the float64
    argmax test on every valid row that holds no near-tie (another logit within 1e-3 of the target's)."""
    valid = y != -100
    ref = s.max(-1).values
    tch = ((x.float() @ w.float().t()) / 0.7).max(-1).values
    assert res.row_max.dtype == torch.float32 and torch.equal(res.row_max[~valid], torch.zeros_like(ref[~valid]))
    assert_close_to_ref("row_max", res.row_max[valid], ref[valid], tch[valid], atol=1e-6)
    logp = -res.loss
    top1 = is_top1(logp, res.row_max, res.lse)
    target_logit = s.gather(1, torch.where(valid, y, 0)[:, None])[:, 0]
    near = ((s - target_logit[:, None]).abs() < 1e-3).sum(-1) > 1  # the target itself is one
    clear = valid & ~near
    assert clear[:16].sum() >= 10 and clear[16:].sum() >= 10
    assert torch.equal(top1[clear], (s.argmax(-1) == y)[clear])
    assert top1[:16][clear[:16]].all()


def test_row_max_of_each_entry_point_matches_fp64_and_is_top1():
    """loss_only (several launches), logprobs_forward (E kept, with the entropy's plane) and anchored_loss_and_grads
    (chunks of 16) with with_row_max: each row max within the rule; without it, None."""
    x, w, y, s = row_max_case(22)
    opts = LossOptions(logit_scale=1 / 0.7)
    res = loss_only(x, w, y, opts, with_row_max=True, chunk_tokens=16)
    check_row_max(res, x, w, y, s)
    _, kept = logprobs_forward(x, w, y, opts, with_row_max=True, with_entropy=True)
    check_row_max(kept, x, w, y, s)
    grads = anchored_loss_and_grads(x, w, y, opts, torch.ones(1, device=x.device), need_dx=True, need_dw=False,
                                    plan=AnchoredPlan(16, False, False), with_row_max=True)
    check_row_max(grads, x, w, y, s)
    assert loss_only(x, w, y, opts).row_max is None


def test_row_max_of_flagged_rows_from_the_exact_pass():
    """Rows 3 and 9 have a class 100 nats above their target (flagged): their row max is that class's logit, from
    the exact pass's bf16 logits (the anchored pass writes 0 there), and is_top1 is False; the other rows as in the
    rule."""
    x, w, y, _ = row_max_case(23)
    y[3] = 5 if y[3] == -100 else y[3]
    x, w, hot = extreme_rows(x, w, y, [3, 9], 100.0)
    s = (x.double() @ w.double().t()) / 0.7
    y[:16] = torch.where(torch.arange(16, device=y.device) % 6 == 3, y[:16], s[:16].argmax(-1))
    y[9] = 7
    res = loss_only(x, w, y, LossOptions(logit_scale=1 / 0.7), with_row_max=True)
    assert res.flagged.nonzero().flatten().tolist() == [3, 9]
    torch.testing.assert_close(res.row_max[[3, 9]].double(), s[[3, 9]].max(-1).values, rtol=4e-3, atol=0)
    assert res.row_max[3].item() > 100.0 and not is_top1(-res.loss, res.row_max, res.lse)[[3, 9]].any()
    keep = torch.ones_like(y, dtype=torch.bool)
    keep[[3, 9]] = False
    sub = loss_only(x[keep], w, y[keep], LossOptions(logit_scale=1 / 0.7), with_row_max=True)
    assert torch.equal(res.row_max[keep], sub.row_max)


# ------------------------------------------------------------------------------------------- the Gluon kernel


def test_producer_compiles_for_sm90a_without_spills():
    """probes/probe_anchored_exp.py --compile: the kernel's launch variants (sums and E with the entropy, without
    and with the row max's plane; the main loop alone) lowered to sm_90a cubins with no stack frame or spill, in the
    H100's 227 KiB of shared memory."""
    pytest.importorskip("triton.experimental.gluon")
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "probes" / "probe_anchored_exp.py"), "--compile",
                           "--variants", "sums_and_e_entropy,sums_and_e_entropy_row_max,none"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("sm_90a ok: anchored")]
    assert len(lines) == 3, done.stdout
    assert all(" stack=0 " in line and " spill=0 " in line for line in lines), lines
    assert all(int(line.split(" smem=")[1].split()[0]) <= 232448 for line in lines), lines


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="the Gluon producer needs an sm_90 (H100/H200) GPU")
@pytest.mark.parametrize("epilogue", [SUMS, SUMS_AND_E])
def test_gpu_producer_matches_the_reference(epilogue, poison_allocations):
    """Ragged T and V (300 × 5000) on a capped grid of 7 CTAs (every ring slot's phase wraps), with the entropy's
    plane: E bitwise the reference's rounding of the same fp32 exponentials up to one bf16 ulp, the partials within
    fp32 rounding of the reference's, ignored rows anchored on column 0."""
    from fusedkern.kernels import gluon_anchored_exp as g

    x, w, y = make_inputs(300, 512, 5000, seed=11)
    poison_allocations()
    _, anchor = target_anchors(x, w, y, ignore_index=-100)
    parts = torch.empty((2, 300, column_tiles(5000)), device=x.device)
    ref_parts = torch.empty_like(parts)
    e = torch.empty((300, e_row_stride(5000)), device=x.device, dtype=torch.bfloat16)[:, :5000]
    ref_e = torch.empty((300, 5000), device=x.device, dtype=torch.bfloat16)
    g.launch(x, w, anchor, parts, e, epilogue=epilogue, max_ctas=7)
    producer_reference(x, w, anchor, ref_parts, ref_e, epilogue=epilogue)
    torch.testing.assert_close(parts, ref_parts, rtol=2e-5, atol=1e-30)
    if epilogue == SUMS_AND_E:
        torch.testing.assert_close(e.float(), ref_e.float(), rtol=8e-3, atol=1e-30)
        # an ignored row is anchored on column 0 (its lse is formed too): its column-0 element is 2^-A2
        first = e[y == -100][:, 0].float()
        torch.testing.assert_close(first, torch.full_like(first, 2.0 ** -A2), rtol=8e-3, atol=0.0)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="the Gluon producer needs an sm_90 (H100/H200) GPU")
@pytest.mark.parametrize("epilogue,entropy", [(SUMS, False), (SUMS, True), (SUMS_AND_E, True)])
def test_gpu_producer_row_max_plane_matches_the_reference(epilogue, entropy, poison_allocations):
    """ROW_MAX: ragged T and V (300 × 5000, the last tile's logits all negative) on a capped grid of 7 CTAs and on
    the full grid: the max plane within fp32 rounding of the reference's (and of float64's), the other planes and E
    as without it (the reference's), the rows and row max of loss_only on the GPU as on the reference producer."""
    from fusedkern.kernels import gluon_anchored_exp as g

    T, V = 300, 5000
    x, w, y = make_inputs(T, 512, V, seed=13)
    x, w = negative_last_tile(x, w)
    poison_allocations()
    _, anchor = target_anchors(x, w, y, ignore_index=-100)
    planes = part_planes(entropy=entropy, row_max=True)
    ref_parts = torch.empty((planes, T, column_tiles(V)), device=x.device)
    ref_e = torch.empty((T, V), device=x.device, dtype=torch.bfloat16)
    producer_reference(x, w, anchor, ref_parts, ref_e, epilogue=epilogue, row_max=True)
    for max_ctas in (7, 0):
        parts = torch.full_like(ref_parts, float("nan"))
        e = torch.empty((T, e_row_stride(V)), device=x.device, dtype=torch.bfloat16)[:, :V]
        g.launch(x, w, anchor, parts, e, epilogue=epilogue, max_ctas=max_ctas, row_max=True)
        torch.testing.assert_close(parts[:-1], ref_parts[:-1], rtol=2e-5, atol=1e-30)
        torch.testing.assert_close(parts[-1], ref_parts[-1], rtol=2e-5, atol=1e-5)
        torch.testing.assert_close(parts[-1].double(), tile_max_fp64(x, w, T, V), rtol=2e-5, atol=1e-5)
        if epilogue == SUMS_AND_E:
            torch.testing.assert_close(e.float(), ref_e.float(), rtol=8e-3, atol=1e-30)
    opts = LossOptions(logit_scale=1 / 0.7)
    gpu = loss_only(x, w, y, opts, with_row_max=True, with_entropy=entropy, producer=g.launch)
    ref = loss_only(x, w, y, opts, with_row_max=True, with_entropy=entropy, producer=producer_reference)
    assert torch.equal(gpu.flagged, ref.flagged)
    torch.testing.assert_close(gpu.row_max, ref.row_max, rtol=2e-5, atol=1e-5)
    torch.testing.assert_close(gpu.lse, ref.lse, rtol=2e-5, atol=1e-5)


def test_no_grad_pass_keeps_sums_only_and_matches_fp64():
    """Under no_grad the producer writes no E (epilogue SUMS); loss, lse, log-probs at τ 0.7 and the entropy within
    the rule, a flagged row recomputed exactly, several launches (chunk_tokens=7)."""
    x, w, y = make_inputs(26, 32, 513, seed=12)
    x, w, _ = extreme_rows(x, w, y, [2], 100.0)
    seen = []

    def producer(*args, **kwargs):
        seen.append((args[4], kwargs["epilogue"]))
        producer_reference(*args, **kwargs)

    with torch.no_grad():
        loss, lse = anchored_cross_entropy(x, w, y, reduction="none", return_lse=True, producer=producer,
                                           chunk_tokens=7)
        logp, entropy, _ = anchored_logprobs(x, w, y, temperature=0.7, return_entropy=True, producer=producer)
    assert len(seen) == 5 and all(e is None and ep == SUMS for e, ep in seen)
    valid = y != -100
    ref = reference.linear_cross_entropy_fp64(x.double(), w.double(), y, reduction="none")
    assert_close_to_ref("loss", loss, ref, torch_linear_cross_entropy(x, w, y, reduction="none", upcast_logits=True),
                        atol=1e-5)
    s = x.double() @ w.double().t()
    # the flagged row from bf16 logits (the exact pass is the chunked strategy's): bf16's rounding at |lse| ~ 100
    torch.testing.assert_close(lse[valid].double(), torch.logsumexp(s, -1)[valid], rtol=4e-3, atol=1e-4)
    logsm = torch.log_softmax(s / 0.7, -1)
    ref_logp = torch.where(valid, logsm.gather(1, torch.where(valid, y, 0)[:, None])[:, 0], 0)
    ref_entropy = torch.where(valid, -(logsm.exp() * logsm).sum(-1), 0)
    tch_logp, tch_entropy = torch_logprobs_entropy(x, w, y, None, softcap=None, temperature=0.7, upcast=True)
    assert_close_to_ref("logp", logp, ref_logp, tch_logp, atol=1e-4)
    assert_close_to_ref("entropy", entropy, ref_entropy, tch_entropy, atol=1e-4)
