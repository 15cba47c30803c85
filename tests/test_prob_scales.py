"""The row pass folded into the Triton GEMMs (`compacted.counted_loss_and_grads(row_pass_in_gemms=True)`):
the logits GEMM's epilogue writes scaled probabilities and row statistics, `prob_scales` turns them into
the gradient's per-tile scales, dX and dW scale their operand on the fly. Checked against fp64 through
`linear_cross_entropy` with a device count (dense and masked batches, class weights, both dW
accumulations), at extreme logits and confident targets, and the unit kernel against torch."""

from __future__ import annotations


import pytest
import torch

import fusedkern
from fusedkern import compacted
from fusedkern.chunked import LossOptions
from fusedkern.kernels.logits_stats import PROB_TILE, logits_stats_rows, stats_partials
from fusedkern.kernels.ce_rows import merge_row_stats
from fusedkern.kernels.prob_scales import prob_scales
from tests.conftest import DEVICE
from tests.test_linear_cross_entropy import check_against_reference, make_inputs
from tests.test_num_valid_tokens import LAYOUTS, _ignore_runs


@pytest.fixture
def row_pass_in_gemms(monkeypatch):
    """`linear_cross_entropy` with a device count, its counted pass forced to fold the row pass into the
    GEMMs; returns the list of calls that ran that pass."""
    real = compacted.counted_loss_and_grads
    runs: list = []

    def forced(*args, **kw):
        runs.append(1)
        return real(*args, **kw, row_pass_in_gemms=True)

    monkeypatch.setattr(compacted, "counted_loss_and_grads", forced)
    real_lce = fusedkern.linear_cross_entropy

    def with_count(input, linear_weight, target, **kw):
        n = (target != kw.get("ignore_index", -100)).sum()
        return real_lce(input, linear_weight, target, num_valid_tokens=n, **kw)

    monkeypatch.setattr(fusedkern, "linear_cross_entropy", with_count)
    return runs


CASES = [(layout, "mean", torch.float32, "fp32") for layout in LAYOUTS]
CASES += [("prompt_spans", "sum", torch.float32, "fp32"), ("at_chunk_edges", "mean", torch.float16, "fp32"),
          ("none_ignored", "mean", torch.float16, "weight_dtype"),
          ("prompt_spans", "sum", torch.float16, "weight_dtype")]


@pytest.mark.parametrize("layout,reduction,dtype,accum", CASES)
def test_matches_fp64(row_pass_in_gemms, layout, reduction, dtype, accum):
    """V = 37 spans two probability tiles (the second one partial); chunks of 4 rows: chunks wholly valid,
    partly valid and wholly ignored; class weights where prompts are masked."""
    x, w, y, _, cw = make_inputs(21, 16, 37, dtype, ignore_frac=0.0, weight=layout == "prompt_spans")
    y[_ignore_runs(21, LAYOUTS[layout]).to(y.device)] = -100
    check_against_reference(x, w, y, None, cw, reduction=reduction, impl="chunked", chunk_tokens=4,
                            weight_grad_accum=accum)
    assert row_pass_in_gemms, "the folded row pass did not run"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_confident_targets_and_extreme_logits(row_pass_in_gemms, dtype):
    """Large logits: most rows' target is their argmax with p ≈ 1 (the gradient p − 1 must keep its digits:
    expm1 at the target), others' target sits in a tile whose max is far below the row's lse (its scale
    underflows; the rewritten tile carries it)."""
    x, w, y, _, _ = make_inputs(19, 16, 70, dtype, ignore_frac=0.0, scale=12.0)
    z = x.double() @ w.double().t()
    y.copy_(z.argmax(1))
    y[::3] = z[::3].argmin(1)  # far from the max: p ≈ exp(−(max − min)), tile scale tiny
    y[5] = -100
    check_against_reference(x, w, y, None, None, reduction="mean", impl="chunked", chunk_tokens=8)
    assert row_pass_in_gemms


@pytest.mark.parametrize("options", [{"label_smoothing": 0.1}, {"softcap": 3.0}, {"z_loss": 1e-3}])
def test_options_it_does_not_compute_are_refused(options):
    x, w, y, _, _ = make_inputs(8, 16, 37, torch.float32)
    count = torch.tensor([8], device=DEVICE)
    with pytest.raises(ValueError, match="plain cross-entropy"):
        compacted.counted_loss_and_grads(x, w, None, y, None, LossOptions(**options), torch.ones(1, device=DEVICE),
                                         count, need_dx=True, need_dw=True, weight_grad_accum="fp32",
                                         row_pass_in_gemms=True)
    with pytest.raises(ValueError, match="plain cross-entropy"):
        compacted.counted_loss_and_grads(x, w, torch.zeros(37, device=DEVICE), y, None, LossOptions(),
                                         torch.ones(1, device=DEVICE), count, need_dx=True, need_dw=True,
                                         weight_grad_accum="fp32", row_pass_in_gemms=True)


def test_a_config_with_another_column_tile_is_refused():
    """The scales are per PROB_TILE columns: probabilities tiled otherwise would be scaled wrongly."""
    import triton

    x, w, y, _, _ = make_inputs(8, 16, 37, torch.float32)
    parts, target_logit = stats_partials(8, 37, x.device, x.dtype)
    config = triton.Config(dict(BLOCK_M=16, BLOCK_N=2 * PROB_TILE, BLOCK_K=16, GROUP_M=2), num_warps=4, num_stages=1)
    with pytest.raises(ValueError, match="BLOCK_N = PROB_TILE"):
        logits_stats_rows(x, w, None, y, torch.tensor([8], device=DEVICE), parts, target_logit, config=config,
                          probs=torch.empty(8, 37, device=DEVICE))


def test_every_output_element_is_written(poison_allocations):
    """With every allocation NaN-poisoned, the folded pass's loss and gradients are finite and equal to
    the row-kernel pass's (dX of the ignored rows: exact zeros)."""
    x, w, y, _, _ = make_inputs(21, 16, 37, torch.float32, ignore_frac=0.0)
    y[_ignore_runs(21, LAYOUTS["prompt_spans"]).to(y.device)] = -100
    rows = torch.argsort((y == -100).to(torch.int8), stable=True)
    xs, ys = x[rows].contiguous(), y[rows].contiguous()
    count = (ys != -100).sum().reshape(1)
    scale = torch.full((1,), 0.25, device=DEVICE)
    poison_allocations()
    outs = [compacted.counted_loss_and_grads(xs, w, None, ys, None, LossOptions(), scale, count, need_dx=True,
                                             need_dw=True, weight_grad_accum="fp32", chunk_tokens=8,
                                             row_pass_in_gemms=folded) for folded in (True, False)]
    for got, want in zip(outs[0][:3], outs[1][:3]):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.count_nonzero(outs[0][1][int(count):]) == 0


@pytest.mark.parametrize("with_weight", [False, True])
def test_scales_and_the_rewritten_tile_match_torch(with_weight):
    """S[t, j] = c_t·exp(m_tj − lse_t), and the target's tile holds exp(s − lse) − [v = y] with S = c_t there:
    S·P̃ is the gradient of the loss, for every tile; rows past the count are untouched."""
    C, H, V = 6, 16, 75
    x, w, y, _, cw = make_inputs(C, H, V, torch.float32, ignore_frac=0.0, weight=with_weight, scale=3.0)
    y[2] = -100
    count = torch.tensor([5], device=DEVICE)
    parts, target_logit = stats_partials(C, V, x.device, x.dtype)
    probs = torch.full((C, V), 7.0, device=DEVICE)
    stats = torch.full((2, C), 5.0, device=DEVICE)
    loss = torch.zeros(C, device=DEVICE)
    logits_stats_rows(x, w, None, y, count, parts, target_logit, probs=probs)
    merge_row_stats(parts, target_logit, y, V, loss=loss, stats=stats, class_weight=cw, class_weight_sum=None,
                    ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None, row_count=count)
    grad_scale = torch.tensor([0.5], device=DEVICE)
    scales = prob_scales(probs, parts[0], stats, y, target_logit, grad_scale, count, parts[1], tile=PROB_TILE,
                         class_weight=cw)
    z = (x.double() @ w.double().t())[:5]
    p = torch.softmax(z, dim=1)
    valid = (y[:5] != -100)
    coef = 0.5 * (cw.double()[y[:5].clamp(min=0)] if with_weight else torch.ones(5, dtype=torch.float64))
    coef = coef * valid
    onehot = torch.zeros_like(p)
    onehot[valid, y[:5][valid]] = 1.0
    grad = coef[:, None] * (p - onehot)
    tile_of = torch.arange(V, device=DEVICE) // PROB_TILE
    got = scales[:5].double()[:, tile_of] * probs[:5].double()
    torch.testing.assert_close(got, grad, rtol=1e-5, atol=1e-7)
    assert (probs[5:] == 7.0).all() and (stats[:, 5:] == 5.0).all()
    assert (probs[2] == 0).all(), "an ignored row's probabilities are written as zeros"


# ---------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("accum", ["fp32", "weight_dtype"])
@pytest.mark.parametrize("V,masked", [(4096, False), (4096, True), (4099, True)])  # TMA paths; pointer paths
def test_gpu_bf16_matches_fp64(row_pass_in_gemms, accum, V, masked):
    """bf16 at the H200's tiles (128-column probability tiles, TMA where the rows are 16-byte aligned):
    dense, and with chunks of 512 rows full, partial and empty after sorting."""
    x, w, y, _, _ = make_inputs(2048, 256, V, torch.bfloat16, ignore_frac=0.0, device="cuda")
    if masked:
        y.view(4, 512)[:, :300] = -100
    check_against_reference(x, w, y, None, None, impl="chunked", chunk_tokens=512, weight_grad_accum=accum)
    assert row_pass_in_gemms


@pytest.mark.gpu
def test_gpu_confident_targets_bf16(row_pass_in_gemms):
    x, w, y, _, _ = make_inputs(1024, 256, 4096, torch.bfloat16, ignore_frac=0.1, scale=8.0, device="cuda")
    z = x.float() @ w.float().t()
    keep = y != -100
    y[keep] = z.argmax(1)[keep]
    check_against_reference(x, w, y, None, None, impl="chunked", chunk_tokens=512)
    assert row_pass_in_gemms
