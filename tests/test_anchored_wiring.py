"""The anchored pass behind the public functions (`dispatch.py`: impl="anchored", and what impl="auto" takes where
the Gluon producer runs).

CPU: the producer is the torch reference and the row kernels run in Triton's interpreter; "auto" is made to take the
anchored pass by reporting its producer as available (`dispatch.anchored_producer_reason`). Each route is checked
against float64 within 2× torch's own error and shown to be the route taken: cross-entropy's gradient formed in the
forward (mean, sum, a host count's gathered rows), the per-token log-probs with E kept to the backward, their
entropy's gradient (the chunked recomputation), the recomputing backward when E does not fit, and the statistics pass
without a gradient, whose log-probs are the same bits as the pass with one (a policy and its reference model).
Bad combinations raise ValueError naming the option."""

from __future__ import annotations

import pytest
import torch

import fusedkern
from fusedkern import anchored, dispatch, logprobs, reference
from fusedkern.logprobs import is_top1, linear_logprobs_with_stats
from tests._accuracy import assert_close_to_ref, torch_linear_cross_entropy, torch_logprobs_entropy
from tests.conftest import DEVICE
from tests.test_gluon_loss_only import make_inputs


@pytest.fixture
def auto_is_anchored(monkeypatch):
    """impl="auto" takes the anchored pass here (on the torch reference producer), and every anchored entry point's
    calls are counted: {name: calls}."""
    monkeypatch.setattr(dispatch, "anchored_producer_reason", lambda x2d, w: None)
    calls = {}

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kwargs)
        return wrapper

    for name in ("anchored_loss_and_grads", "loss_only", "logprobs_forward", "logprobs_backward"):
        monkeypatch.setattr(anchored, name, counting(name, getattr(anchored, name)))
    return calls


def grads_of(fn, x, w, y, upstream=None, **kwargs):
    xl, wl = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    out = fn(xl, wl, y, **kwargs)
    first = out[0] if isinstance(out, tuple) else out
    (first * (1.0 if upstream is None else upstream)).sum().backward()
    return out, xl.grad, wl.grad


def check_ce(x, w, y, reduction, **kwargs):
    out, dx, dw = grads_of(fusedkern.linear_cross_entropy, x, w, y, reduction=reduction, **kwargs)
    ref, rdx, rdw = grads_of(reference.linear_cross_entropy_fp64, x.double(), w.double(), y, reduction=reduction)
    tch, tdx, tdw = grads_of(torch_linear_cross_entropy, x, w, y, reduction=reduction, upcast_logits=True)
    assert dx.dtype == x.dtype and dw.dtype == w.dtype
    assert_close_to_ref("loss", out, ref, tch.detach(), atol=1e-5)
    assert_close_to_ref("dX", dx, rdx, tdx, atol=1e-3)
    assert_close_to_ref("dW", dw, rdw, tdw, atol=1e-3)
    return out, dx, dw


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_auto_cross_entropy_forms_its_gradient_in_the_anchored_forward(reduction, auto_is_anchored,
                                                                       poison_allocations):
    x, w, y = make_inputs(37, 48, 1000)
    poison_allocations()
    out, _, _ = check_ce(x, w, y, reduction)
    assert auto_is_anchored == {"anchored_loss_and_grads": 1}
    with torch.no_grad():  # the same kernel without a gradient: the same bits
        assert torch.equal(fusedkern.linear_cross_entropy(x, w, y, reduction=reduction), out.detach())
    assert auto_is_anchored["loss_only"] == 1


def test_explicit_anchored_with_a_host_count_computes_the_valid_rows_only(auto_is_anchored):
    x, w, y = make_inputs(30, 32, 300, seed=3, ignore_frac=0.5)
    count = int((y != -100).sum())
    _, dx, _ = check_ce(x, w, y, "mean", impl="anchored", num_valid_tokens=count)
    assert auto_is_anchored == {"anchored_loss_and_grads": 1}
    assert not dx[y == -100].any()
    with pytest.raises(ValueError, match="num_valid_tokens"):
        fusedkern.linear_cross_entropy(x, w, y, impl="anchored", num_valid_tokens=count + 1)


def logprobs_references(x, w, y, temperature, up, up_entropy):
    """fp64 (logp, entropy, dX, dW) and torch's same-dtype ones for Σ up·logp + up_entropy·H."""
    f64 = [t.detach().double().requires_grad_() for t in (x, w)]
    ref_logp, ref_entropy = reference.linear_logprobs_entropy_fp64(f64[0], f64[1], y, temperature=temperature)
    (ref_logp * up.double() + ref_entropy * up_entropy.double()).sum().backward()
    same = [t.detach().clone().requires_grad_() for t in (x, w)]
    tch_logp, tch_entropy = torch_logprobs_entropy(same[0], same[1], y, None, softcap=None, temperature=temperature,
                                                   upcast=True)
    (tch_logp * up + tch_entropy * up_entropy).sum().backward()
    return (ref_logp, ref_entropy, f64[0].grad, f64[1].grad), (tch_logp, tch_entropy, same[0].grad, same[1].grad)


def check_logprobs(x, w, y, up, up_entropy=None, temperature=0.7):
    """`linear_logprobs` at τ with the entropy, Σ up·logp (+ up_entropy·H) backpropagated: log-probs, entropy, dX and
    dW within 2× torch's error of float64. Returns (logp, entropy)."""
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    logp, entropy = fusedkern.linear_logprobs(xl, wl, y, temperature=temperature, return_entropy=True)
    ((logp * up).sum() + ((entropy * up_entropy).sum() if up_entropy is not None else 0)).backward()
    up_h = torch.zeros_like(up) if up_entropy is None else up_entropy
    (ref_logp, ref_entropy, rdx, rdw), (t_logp, t_entropy, tdx, tdw) = logprobs_references(x, w, y, temperature, up,
                                                                                           up_h)
    assert_close_to_ref("logp", logp, ref_logp, t_logp.detach(), atol=1e-4)
    assert_close_to_ref("entropy", entropy, ref_entropy, t_entropy.detach(), atol=1e-4)
    assert_close_to_ref("dX", xl.grad, rdx, tdx, atol=1e-3)
    assert_close_to_ref("dW", wl.grad, rdw, tdw, atol=1e-3)
    return logp, entropy


@pytest.mark.parametrize("entropy_grad", [False, True], ids=["logp_grad", "logp_and_entropy_grads"])
@pytest.mark.parametrize("keep_e", [True, False], ids=["E_kept", "E_recomputed"])
def test_auto_logprobs_on_the_anchored_pass(entropy_grad, keep_e, auto_is_anchored, monkeypatch):
    """τ 0.7 with the entropy: E kept to the backward (three GEMMs; a gradient into the entropy takes one more pass
    over E) or, when it does not fit, recomputed there by the producer (four; with the entropy's gradient, the
    chunked strategy whole)."""
    if not keep_e:
        monkeypatch.setattr(logprobs, "keeps_anchored_e", lambda x2d, w: False)
    x, w, y = make_inputs(29, 64, 700, seed=6)
    gen = torch.Generator().manual_seed(1)
    up = torch.randn(29, generator=gen).to(x.device)
    up_entropy = torch.randn(29, generator=gen).to(x.device)
    logp, entropy = check_logprobs(x, w, y, up, up_entropy if entropy_grad else None)
    kept = {"logprobs_forward": 1, "logprobs_backward": 1}
    recomputed = {"loss_only": 1} | ({} if entropy_grad else {"anchored_loss_and_grads": 1})
    assert auto_is_anchored == (kept if keep_e else recomputed)
    with torch.no_grad():  # a reference model's pass: the same log-probs and entropy, bit for bit
        same_logp, same_entropy = fusedkern.linear_logprobs(x, w, y, temperature=0.7, return_entropy=True)
    assert torch.equal(same_logp, logp.detach()) and torch.equal(same_entropy, entropy.detach())


def test_logprobs_with_stats_gives_the_row_max_for_is_top1(auto_is_anchored):
    """TRL's head: the anchored pass's row max and lse give is_top1 as the float64 argmax does (rows made confident
    in their target included), with a gradient (E kept) and without."""
    x, w, y = make_inputs(40, 32, 300, seed=11, ignore_frac=0.1)
    valid = y != -100
    x[5:20] = x[5:20] + 4.0 * w[torch.where(valid, y, 0)[5:20]].float().to(x.dtype) * 8  # target is the argmax
    f64 = x.double() @ w.double().t()
    expected = (f64.argmax(-1) == y) & valid
    for grad in (True, False):
        xl = x.clone().requires_grad_(grad)
        logps, _, row_max, row_lse = linear_logprobs_with_stats(xl, w, y)
        top1 = is_top1(logps.detach(), row_max, row_lse) & valid
        assert torch.equal(top1, expected), (grad, top1.nonzero().flatten(), expected.nonzero().flatten())
        torch.testing.assert_close(row_max[valid].double(), f64.max(-1).values[valid], rtol=1e-5, atol=1e-4)
        if grad:
            logps.sum().backward()
    assert auto_is_anchored["logprobs_forward"] == 1 and auto_is_anchored["loss_only"] == 1


def formula_cases(x, w, y):
    """(name, loss of (x, w)) for each formula loss on sequences x [R, S, H], y [R, S]."""
    R, S = y.shape
    gen = torch.Generator().manual_seed(5)
    ref = -3.0 * S + torch.randn(R // 2, generator=gen)
    adv, old = torch.randn(R, generator=gen), -6.0 + torch.randn(R, S, generator=gen)
    return [
        ("dpo", lambda xl, wl: fusedkern.linear_preference_loss(xl, wl, y, loss_type="sigmoid", beta=0.1,
                                                                ref_chosen_logps=ref, ref_rejected_logps=ref + 1)[0]),
        ("simpo", lambda xl, wl: fusedkern.linear_simpo_loss(xl, wl, y)[0]),
        ("grpo", lambda xl, wl: fusedkern.linear_grpo_loss(xl, wl, y, advantages=adv, old_logps=old, beta=0.0,
                                                           temperature=0.7, compute_entropy=True)[0]),
    ]


@pytest.mark.parametrize("case", ["dpo", "simpo", "grpo"])
def test_formula_losses_take_the_anchored_log_probs(case, auto_is_anchored, monkeypatch):
    """Preference, SimPO and GRPO on "auto" take the log-probs with E kept (three GEMMs) and their formula in torch;
    loss and gradients as the chunked engine's formula rows give them, to the bf16 rounding of its logits."""
    x, w, y = make_inputs(48, 32, 300, seed=14, ignore_frac=0.3)
    x, y = x.reshape(6, 8, 32), y.reshape(6, 8)
    loss_fn = dict(formula_cases(x, w, y))[case]
    out, dx, dw = grads_of(lambda xl, wl, _: loss_fn(xl, wl), x, w, None)
    assert auto_is_anchored == {"logprobs_forward": 1, "logprobs_backward": 1}
    monkeypatch.setattr(dispatch, "anchored_producer_reason", lambda x2d, w: "the chunked engine's rows")
    ref, rdx, rdw = grads_of(lambda xl, wl, _: loss_fn(xl, wl), x, w, None)
    # the chunked rows read bf16 logits, the anchored pass the GEMM's fp32 accumulator: a bf16 rounding apart
    torch.testing.assert_close(out, ref, rtol=3e-3, atol=1e-5)
    torch.testing.assert_close(dx.float(), rdx.float(), rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(dw.float(), rdw.float(), rtol=2e-2, atol=2e-3)


def test_auto_stays_off_the_anchored_pass_where_its_producer_does_not_run():
    x, w, y = make_inputs(8, 32, 64, seed=2)
    call = dispatch.Call(x, w, None, None, dispatch.LossOptions())
    assert dispatch.choose("auto", call).name == ("anchored" if dispatch.anchored_producer_reason(x, w) is None
                                                   else "chunked")
    if DEVICE == "cpu":
        assert "CUDA" in dispatch.anchored_producer_reason(x, w)


@pytest.mark.parametrize("option,match", [({"linear_bias": "bias"}, "bias"), ({"label_smoothing": 0.1}, "smoothing"),
                                          ({"z_loss": 1e-4}, "z-loss"), ({"softcap": 30.0}, "softcap")])
def test_explicit_anchored_refuses_what_it_cannot_compute(option, match):
    x, w, y = make_inputs(8, 32, 64, seed=2)
    if "linear_bias" in option:
        option = {"linear_bias": torch.zeros(64, device=x.device, dtype=x.dtype)}
    with pytest.raises(ValueError, match=f"impl='anchored'.*{match}"):
        fusedkern.linear_cross_entropy(x, w, y, impl="anchored", **option)


@pytest.mark.parametrize("reduction,chunk_tokens", [("sum", 16), ("none", None)])
def test_dx_in_row_blocks_and_the_exact_pass_in_the_scratch(reduction, chunk_tokens, monkeypatch,
                                                             poison_allocations):
    """dX's scratch cut to 8 rows (dX in blocks of 8 rows; the exact pass's gathered rows, 16 a chunk, in the same
    bytes), r ⊙ x in dX's own rows, chunks of 16 (the fp32 accumulator, E in dW's storage) or E kept, two rows past
    the anchor's reach: against fp64 within the rule."""
    from tests.test_anchored_exp import extreme_rows

    monkeypatch.setattr(anchored, "CHUNK_MULTIPLE", 8)
    monkeypatch.setattr(anchored, "DX_SCRATCH_BYTES", 8 * 48 * 4)
    x, w, y = make_inputs(37, 48, 500, seed=13, ignore_frac=0.2)
    x, w, _ = extreme_rows(x, w, y, [2, 30], 95.0)
    poison_allocations()
    out, dx, dw = grads_of(fusedkern.linear_cross_entropy, x, w, y, reduction=reduction, impl="anchored",
                           chunk_tokens=chunk_tokens, upstream=torch.linspace(-1, 1, 37) if reduction == "none"
                           else None)
    f64 = [t.double().requires_grad_() for t in (x, w)]
    ref = reference.linear_cross_entropy_fp64(f64[0], f64[1], y, reduction=reduction)
    (ref * (torch.linspace(-1, 1, 37).double() if reduction == "none" else 1.0)).sum().backward()
    torch.testing.assert_close(out.double(), ref.detach(), rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(dx.double(), f64[0].grad, rtol=5e-2, atol=2e-2)
    torch.testing.assert_close(dw.double(), f64[1].grad, rtol=5e-2, atol=2e-2)


def test_entropy_gradient_on_e_with_confident_and_flagged_rows(auto_is_anchored, poison_allocations):
    """The entropy's gradient formed over the kept E: rows confident in their target (p_y − 1 ≈ 0 must stay ≈ 0),
    two rows 95 nats past the anchor's reach (the exact pass with both terms), ignored rows: against fp64."""
    from tests.test_anchored_exp import extreme_rows

    x, w, y = make_inputs(40, 32, 300, seed=15, ignore_frac=0.2)
    x[5:15] = x[5:15] + (8.0 * w[torch.where(y[5:15] != -100, y[5:15], 0)].float()).to(x.dtype) * 8
    x, w, _ = extreme_rows(x, w, y, [20, 33], 95.0)
    gen = torch.Generator().manual_seed(2)
    up, up_entropy = torch.randn(40, generator=gen), torch.randn(40, generator=gen)
    poison_allocations()
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    logp, entropy = fusedkern.linear_logprobs(xl, wl, y, temperature=0.7, return_entropy=True)
    ((logp * up).sum() + (entropy * up_entropy).sum()).backward()
    (_, _, rdx, rdw), (_, _, tdx, tdw) = logprobs_references(x, w, y, 0.7, up, up_entropy)
    torch.testing.assert_close(xl.grad.double(), rdx, rtol=5e-2, atol=2e-2)
    torch.testing.assert_close(wl.grad.double(), rdw, rtol=5e-2, atol=2e-2)
    assert not xl.grad[y == -100].any()
    assert auto_is_anchored == {"logprobs_forward": 1, "logprobs_backward": 1}


def test_every_row_has_its_lse_ignored_rows_included():
    """return_lse gives every row's log-sum-exp, as the chunked strategy does: an ignored row is anchored on column
    0, and one whose column-0 logit lies 95 nats below the rest (past the anchor's reach) takes the exact pass, whose
    bf16 logits give the chunked strategy's accuracy."""
    x, w, y = make_inputs(24, 32, 300, seed=12, ignore_frac=0.4)
    y[3] = -100
    x, w = x.clone(), w.clone()
    x[3, 0], w[:, 0] = 8.0, 0.0
    w[0, 0] = -95.0 / 8.0  # column 0 alone, 95 nats under every other logit of row 3
    for grad in (False, True):
        xl = x.clone().requires_grad_(grad)
        loss, lse = fusedkern.linear_cross_entropy(xl, w, y, reduction="none", return_lse=True, impl="anchored")
        ref = torch.logsumexp(x.double() @ w.double().t(), -1)
        held = torch.arange(24, device=x.device) != 3
        torch.testing.assert_close(lse[held].double(), ref[held], rtol=1e-5, atol=1e-4)
        # the exact pass rounds its logits to bf16 as the chunked strategy does: within a bf16 rounding of |lse|
        assert abs(lse[3].item() - ref[3].item()) < 2 ** -8 * abs(ref[3].item()), (lse[3].item(), ref[3].item())
        assert not loss[y == -100].any()
        if grad:
            (loss * torch.linspace(-1, 1, 24, device=x.device)).sum().backward()
            assert not xl.grad[y == -100].any()


# ------------------------------------------------------------------------------------------------------ GPU

ON_SM90 = DEVICE == "cuda" and torch.cuda.get_device_capability() == (9, 0)
needs_sm90 = pytest.mark.skipif(not ON_SM90, reason="the anchored pass's Gluon producer needs an sm_90 (H100/H200) GPU")


@pytest.fixture
def anchored_calls(monkeypatch):
    """{name: calls} of the anchored entry points, with "auto" choosing as it does (no stub)."""
    calls = {}
    for name in ("anchored_loss_and_grads", "loss_only", "logprobs_forward", "logprobs_backward"):
        original = getattr(anchored, name)

        def wrapper(*args, _name=name, _original=original, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _original(*args, **kwargs)
        monkeypatch.setattr(anchored, name, wrapper)
    return calls


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_gpu_auto_cross_entropy_on_the_anchored_pass(reduction, anchored_calls):
    """Realistic bf16 shapes (a ragged vocabulary, a fifth of the rows ignored): "auto" takes the anchored pass
    (mean/sum: the gradient formed in the forward; none: E kept) and every output is within 2× torch's error."""
    from tests.test_linear_cross_entropy import check_against_reference, make_inputs as lce_inputs

    x, w, y, _, _ = lce_inputs(2048, 1024, 32003, torch.bfloat16, device="cuda", seed=21)
    check_against_reference(x, w, y, None, None, reduction=reduction, impl="auto")
    assert anchored_calls == ({"anchored_loss_and_grads": 1} if reduction != "none"
                              else {"logprobs_forward": 1, "logprobs_backward": 1})
    with torch.no_grad():  # a loss-only call: the anchored sums, the same bits
        loss, lse = fusedkern.linear_cross_entropy(x, w, y, reduction=reduction, return_lse=True)
    xl = x.clone().requires_grad_()
    loss_g, lse_g = fusedkern.linear_cross_entropy(xl, w, y, reduction=reduction, return_lse=True)
    assert torch.equal(loss, loss_g.detach()) and torch.equal(lse, lse_g)
    ref = torch.logsumexp(x.double() @ w.double().t(), -1)  # every row's, ignored ones included
    torch.testing.assert_close(lse.double(), ref, rtol=2e-6, atol=1e-5)


@pytest.mark.gpu
@needs_sm90
def test_gpu_auto_logprobs_and_trl_statistics_on_the_anchored_pass(anchored_calls):
    """τ 0.7 with the entropy and an upstream on both (E kept; the entropy's gradient recomputed), is_top1 from
    `linear_logprobs_with_stats` as float64's argmax says (near-ties aside), a reference model's no-grad pass the
    same bits."""
    x, w, y = make_inputs(1536, 512, 32003, seed=22)
    x[:300] = x[:300] + (4.0 * w[torch.where(y[:300] != -100, y[:300], 0)]).to(x.dtype) * 8  # confident rows
    gen = torch.Generator(device="cuda").manual_seed(3)
    up, up_entropy = torch.randn(1536, device="cuda", generator=gen), torch.randn(1536, device="cuda", generator=gen)
    check_logprobs(x, w, y, up, up_entropy)
    assert anchored_calls == {"logprobs_forward": 1, "logprobs_backward": 1}
    xl = x.clone().requires_grad_()
    logps, _, row_max, row_lse = linear_logprobs_with_stats(xl, w, y)
    logps.sum().backward()
    with torch.no_grad():
        same, _, max_ng, lse_ng = linear_logprobs_with_stats(x, w, y)
    assert torch.equal(same, logps.detach()) and torch.equal(max_ng, row_max) and torch.equal(lse_ng, row_lse)
    s64 = x.double() @ w.double().t()
    top2 = s64.topk(2, -1).values
    valid = (y != -100) & (top2[:, 0] - top2[:, 1] > 1e-3)
    expected = s64.argmax(-1) == y
    got = is_top1(logps.detach(), row_max, row_lse)
    assert expected[:300][valid[:300]].all() and torch.equal(got[valid], expected[valid])


@pytest.mark.gpu
@needs_sm90
def test_gpu_rows_past_the_anchor_and_every_output_written(poison_allocations, anchored_calls):
    """Rows 100 nats past their target (the exact pass) in a poisoned allocator: loss, lse and gradients within
    the rule everywhere, nothing left unwritten."""
    from tests.test_anchored_exp import extreme_rows
    from tests.test_linear_cross_entropy import check_against_reference

    x, w, y = make_inputs(1024, 256, 5000, seed=23)
    x, w, _ = extreme_rows(x, w, y, [3, 700], 100.0)
    poison_allocations()
    check_against_reference(x, w, y, None, None, reduction="sum", impl="auto")
    check_against_reference(x, w, y, None, None, reduction="none", impl="auto")
    assert anchored_calls["anchored_loss_and_grads"] == 1 and anchored_calls["logprobs_forward"] == 1
