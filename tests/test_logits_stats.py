"""The logits GEMM with row statistics in its epilogue (`fusedkern.kernels.logits_stats`) and the loss-only
pass built on it (`chunked_loss(stats_in_epilogue=True)`): per-token loss and lse against fp64 for every
option, both load paths, odd shapes (V = 131: a 3-column last tile in the interpreter's 32-column tiles),
ignored targets, a dominant class, a −inf-masked vocabulary tail, and rows beyond the count left alone.
On CPU through Triton's interpreter; the GPU test runs the bf16 shapes of the study."""

from __future__ import annotations

import fusedkern._runtime  # noqa: F401  (first: picks GPU or the interpreter before the kernels import)

import pytest
import torch

from fusedkern import reference
from fusedkern.chunked import LossOptions, chunked_loss, lse_of
from fusedkern.kernels.ce_rows import merge_row_stats
from fusedkern.kernels.logits_stats import column_tiles, logits_stats_rows, stats_partials, tile_n
from tests._accuracy import assert_close_to_ref, rel_err
from tests.conftest import DEVICE
from tests.test_linear_cross_entropy import OPTION_SETS, make_inputs


def _fp64(x, w, y, b, cw, **opts):
    return reference.linear_cross_entropy_fp64(
        x.double(), w.double(), y, linear_bias=None if b is None else b.double(),
        weight=None if cw is None else cw.double(), reduction="none", return_lse=True, **opts)


@pytest.mark.parametrize("options", list(OPTION_SETS))
@pytest.mark.parametrize("chunk", [None, 8], ids=["one-launch", "chunks-of-8"])
def test_loss_only_in_epilogue_matches_fp64(options, chunk):
    opts = dict(OPTION_SETS[options])
    x, w, y, b, cw = make_inputs(23, 29, 131, torch.float32, bias=opts.pop("bias", False),
                                 weight=opts.pop("weight", False))
    loss, stats = chunked_loss(x, w, b, y, cw, LossOptions(**opts), chunk, stats_in_epilogue=True)
    ref, ref_lse = _fp64(x, w, y, b, cw, **opts)
    assert rel_err(loss, ref) < 1e-6 and rel_err(lse_of(stats), ref_lse) < 1e-6
    assert (loss[y == -100] == 0).all()


@pytest.mark.parametrize("impl", ["pointer", "tma"])
def test_fp16_both_load_paths_within_twice_torch(impl):
    """fp16 (bf16's tl.dot is wrong in the interpreter), V = 72: rows of 144 bytes, as a descriptor needs."""
    x, w, y, b, _ = make_inputs(37, 48, 72, torch.float16, bias=True, scale=3.0)
    parts, target_logit = stats_partials(37, 72, x.device, x.dtype)
    logits_stats_rows(x, w, b, y, torch.tensor([37], device=DEVICE), parts, target_logit, softcap=30.0,
                      label_smoothing=0.1, impl=impl)
    loss, stats = torch.empty(37, device=DEVICE), torch.empty(2, 37, device=DEVICE)
    merge_row_stats(parts, target_logit, y, 72, loss=loss, stats=stats, class_weight=None, class_weight_sum=None,
                    ignore_index=-100, label_smoothing=0.1, z_loss=0.0, softcap=30.0)
    ref, _ = _fp64(x, w, y, b, None, softcap=30.0, label_smoothing=0.1)
    same = reference.upcast_linear_cross_entropy(x, w, y, linear_bias=b, softcap=30.0, label_smoothing=0.1,
                                                 reduction="none")
    assert_close_to_ref(f"loss ({impl})", loss, ref, same)


def test_dominant_class_and_masked_vocabulary():
    """A target with p → 1 (its loss ~1e-6 comes from the other classes' mass, which `rest` keeps) and a
    vocabulary tail masked by a −inf bias (whole tiles with no mass), with ties at the max."""
    x, w, y, _, _ = make_inputs(19, 16, 131, torch.float32, ignore_frac=0.0, seed=3)
    y = y % 100  # targets in the unmasked columns
    b = torch.zeros(131, device=DEVICE)
    b[100:] = -float("inf")
    y[:10] = 7
    b[7] = 40.0  # rows 0–9: their target dominates
    w[5] = w[6]  # two equal columns: ties at a row's max where one of them wins
    loss, stats = chunked_loss(x, w, b, y, None, LossOptions(), stats_in_epilogue=True)
    ref, ref_lse = _fp64(x, w, y, b, None)
    assert torch.isfinite(loss).all() and torch.isfinite(lse_of(stats)).all()
    assert rel_err(loss, ref) < 1e-6 and rel_err(lse_of(stats), ref_lse) < 1e-6
    # rows 0–9: loss = log(1 + rest) ~ 1e-15–1e-12, which Σ exp − 1 in fp32 would round to 0 (fp64's own
    # lse − s_y at s_y ≈ 40 resolves only ~1e-14: hence the absolute tolerance)
    assert (ref[:10] < 1e-9).all() and (loss[:10] > 0).all()
    torch.testing.assert_close(loss[:10].double(), ref[:10], rtol=1e-3, atol=2e-14)


@pytest.mark.parametrize("n_valid", [0, 1, 8, 13, 23])  # chunks of 8 rows: none, one, a chunk's edge, mid, all
def test_counted_loss_only_skips_the_ignored_rows(n_valid, poison_allocations):
    """Rows sorted valid-first and counted on the device: the valid rows' loss as without the count, 0 past
    it, and the rows past it never read (they hold NaN here)."""
    x, w, y, b, _ = make_inputs(23, 29, 131, torch.float32, ignore_frac=0.0, bias=True)
    y[n_valid:] = -100
    ref, ref_lse = _fp64(x, w, y, b, None, label_smoothing=0.1)
    x[n_valid:] = float("nan")
    poison_allocations()
    loss, stats = chunked_loss(x, w, b, y, None, LossOptions(label_smoothing=0.1), 8, stats_in_epilogue=True,
                               count=torch.tensor(n_valid, device=DEVICE))
    assert (loss[n_valid:] == 0).all()
    if n_valid:
        assert rel_err(loss[:n_valid], ref[:n_valid]) < 1e-6
        assert rel_err(lse_of(stats)[:n_valid], ref_lse[:n_valid]) < 1e-6


@pytest.mark.parametrize("counted", [False, True])
def test_entropy_at_a_temperature_matches_fp64(counted):
    """With the entropy's statistic (GRPO's log-probs and entropies, softcap then temperature): log-probs
    and entropies against fp64, 0 for ignored rows; counted, the rows sorted valid-first."""
    x, w, y, b, _ = make_inputs(23, 29, 131, torch.float32, bias=True, seed=5)
    if counted:
        rows = torch.argsort((y == -100).to(torch.uint8), stable=True)
        x, y = x[rows], y[rows]
    ref_logp, ref_ent = reference.linear_logprobs_entropy_fp64(x.double(), w.double(), y, linear_bias=b.double(),
                                                               softcap=4.0, temperature=0.7)
    entropy = torch.empty(23, device=DEVICE)
    loss, _ = chunked_loss(x, w, b, y, None, LossOptions(softcap=4.0, logit_scale=1 / 0.7), 8, entropy=entropy,
                           stats_in_epilogue=True, count=(y != -100).sum() if counted else None)
    assert rel_err(-loss, ref_logp) < 1e-6 and rel_err(entropy, ref_ent) < 1e-6
    assert (entropy[y == -100] == 0).all()


def test_rows_beyond_the_count_are_not_written():
    x, w, y, _, _ = make_inputs(21, 16, 70, torch.float32, ignore_frac=0.0)
    parts, target_logit = stats_partials(21, 70, x.device, x.dtype)
    parts[:, 9:] = float("nan")
    target_logit[9:] = float("nan")
    logits_stats_rows(x, w, None, y, torch.tensor(9, device=DEVICE), parts, target_logit)
    assert torch.isnan(parts[:, 9:]).all() and torch.isnan(target_logit[9:]).all()
    assert not torch.isnan(parts[:, :9]).any() and not torch.isnan(target_logit[:9]).any()
    used = column_tiles(70)
    assert (parts[0, :9, :used] > -float("inf")).all() and (parts[0, :9, used:] == -float("inf")).all()


def test_trial_runs_on_the_same_buffers_leave_the_loss_exact():
    """The autotuner runs every candidate on the real `parts` before the winner's run. Candidates of one
    column tile write the same slots and overwrite them; a candidate of another width would leave slots
    the merge reads as extra mass (on an H100, 128- and 256-wide candidates put +log 1.5 ≈ 0.41 nat on every
    row of a chunk that autotuned), so `config=` of another BLOCK_N is refused."""
    import triton

    x, w, y, b, _ = make_inputs(40, 16, 131, torch.float32, ignore_frac=0.0, bias=True, seed=11)
    count = torch.tensor(40, device=DEVICE)
    parts, target_logit = stats_partials(40, 131, x.device, x.dtype)
    width = tile_n(x.dtype)
    for bm in (16, 32, 16):  # trial runs of two candidates, then the winner's
        config = triton.Config({"BLOCK_M": bm, "BLOCK_N": width, "BLOCK_K": 16, "GROUP_M": 2}, num_warps=4,
                               num_stages=1)
        logits_stats_rows(x, w, b, y, count, parts, target_logit, config=config)
    loss, stats = torch.empty(40, device=DEVICE), torch.empty(2, 40, device=DEVICE)
    merge_row_stats(parts, target_logit, y, 131, loss=loss, stats=stats, class_weight=None, class_weight_sum=None,
                    ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None)
    ref, ref_lse = _fp64(x, w, y, b, None)
    assert rel_err(loss, ref) < 1e-6 and rel_err(lse_of(stats), ref_lse) < 1e-6
    wider = triton.Config({"BLOCK_M": 16, "BLOCK_N": 2 * width, "BLOCK_K": 16, "GROUP_M": 2}, num_warps=4,
                          num_stages=1)
    with pytest.raises(ValueError, match="BLOCK_N"):
        logits_stats_rows(x, w, b, y, count, parts, target_logit, config=wider)


def test_bad_arguments_raise():
    x, w, y, _, _ = make_inputs(8, 16, 40, torch.float32)
    parts, target_logit = stats_partials(8, 40, x.device, x.dtype)
    count = torch.tensor(8, device=DEVICE)
    with pytest.raises(ValueError, match="parts must be"):
        logits_stats_rows(x, w, None, y, count, parts[:, :, :1].contiguous(), target_logit)
    with pytest.raises(ValueError, match="w must be"):
        logits_stats_rows(x, w[:, :8], None, y, count, parts, target_logit)
    with pytest.raises(TypeError, match="count must be"):
        logits_stats_rows(x, w, None, y, count.float(), parts, target_logit)
    with pytest.raises(ValueError, match="impl must be"):
        logits_stats_rows(x, w, None, y, count, parts, target_logit, impl="cublas")
    with pytest.raises(ValueError, match="impl='tma'"):  # rows of 15 fp16: not 16-byte aligned
        logits_stats_rows(x[:, :15].half(), w[:, :15].half(), None, y, count, parts, target_logit, impl="tma")
    with pytest.raises(ValueError, match="class_weight must be"):
        logits_stats_rows(x, w, None, y, count, parts, target_logit, class_weight=torch.ones(40, dtype=torch.float64,
                                                                                          device=DEVICE))
    with pytest.raises(ValueError, match="count needs"):
        chunked_loss(x, w, None, y, None, LossOptions(), count=count)


@pytest.mark.gpu
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_gpu_bf16_study_shape_within_twice_torch(softcap):
    """bf16, 4096 tokens of the Llama-3 head (TMA path): the loss and lse against fp64 within 2× torch's
    bf16 computation, and no less exact than the loss-only tile pass (which rounds its logits to bf16
    before their statistics; the epilogue takes them in fp32)."""
    torch.manual_seed(0)
    T, H, V = 4096, 4096, 128256
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(V, H, device="cuda") * 0.02).to(torch.bfloat16)
    y = torch.randint(0, V, (T,), device="cuda")
    y[: T // 2] = -100
    opts = LossOptions(softcap=softcap, label_smoothing=0.1)
    loss, stats = chunked_loss(x, w, None, y, None, opts, stats_in_epilogue=True)
    tiles, tile_stats = chunked_loss(x, w, None, y, None, opts)
    rows = torch.arange(0, T, 64, device="cuda")  # an fp64 [T, V] would need 4 GB: every 64th token
    ref, ref_lse = _fp64(x[rows], w, y[rows], None, None, softcap=softcap, label_smoothing=0.1)
    same = reference.upcast_linear_cross_entropy(x[rows], w, y[rows], softcap=softcap, label_smoothing=0.1,
                                                 reduction="none")
    assert_close_to_ref("loss", loss[rows], ref, same)
    assert rel_err(lse_of(stats)[rows], ref_lse) < 1e-5
    assert rel_err(loss[rows], ref) <= rel_err(tiles[rows], ref) + 1e-6
    assert rel_err(lse_of(stats)[rows], ref_lse) <= rel_err(lse_of(tile_stats)[rows], ref_lse) + 1e-6
