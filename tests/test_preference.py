"""Preference losses: `preference_loss_from_logps` by hand formulas (TRL's), and `linear_preference_loss` for
every loss_type against the fp64 reference with materialized logits (`reference.linear_preference_loss_fp64`),
loss, metrics and dX/dW/db, fp32 and bf16 under the 2× rule (`tests/_accuracy.py`), with a bias, a softcap
and all-ignored responses; bad inputs."""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

import fusedkern
from fusedkern import reference
from fusedkern.preference import LOSS_TYPES, PAIR_LOSS_TYPES, preference_loss_from_logps
from fusedkern.formula import grouped_plan
from fusedkern.linear_preference import preference_chunked
from fusedkern.simpo import simpo_loss_from_logps
from tests._accuracy import assert_close_to_ref
from tests.conftest import DEVICE
from tests.test_linear_cross_entropy import ATOL, IMPLS, make_inputs

B, S, H, V = 3, 7, 24, 67  # pairs, sequence, hidden, vocabulary: odd, tiny
N_KTO = 5  # unpaired sequences
# the matrix runs the generic four-GEMM path (impl="fused": linear_logprobs, then autograd through the tail);
# the default three-GEMM chunks get their own cases below
FAST_IMPL = "fused" if "fused" in IMPLS else "chunked"

# loss_type cases: TRL's hyper-parameter names; each exercises its own options
CASES = {
    "sigmoid": dict(loss_type="sigmoid", beta=0.5, label_smoothing=0.1, alpha=0.3),  # cDPO smoothing + RPO NLL
    "ipo": dict(loss_type="ipo", beta=0.5),
    "hinge": dict(loss_type="hinge", beta=0.5),
    "robust": dict(loss_type="robust", beta=0.5, label_smoothing=0.2),
    "cpo": dict(loss_type="cpo", beta=0.5, label_smoothing=0.1),
    "simpo": dict(loss_type="simpo", beta=2.0, gamma=1.0, label_smoothing=0.1, alpha=0.5),
    "orpo": dict(loss_type="orpo", beta=0.5),
    "kto": dict(loss_type="kto", beta=0.5, desirable_weight=1.3, undesirable_weight=0.7),
    "ipo-reference-free": dict(loss_type="ipo", beta=0.5, reference_free=True, alpha=1.0),  # CPO's ipo
    "hinge-reference-free": dict(loss_type="hinge", beta=0.5, reference_free=True),  # CPO's hinge
}


def rows_of(case):
    return N_KTO if case["loss_type"] == "kto" else 2 * B


def inputs(case, dtype, *, seed=0, bias=True):
    """x [R, S, H], w, y [R, S] (a 2-token prompt ignored, row 1's response empty), b, and the loss's
    tensors (reference log-probs near the policy's, KTO labels and KL)."""
    R = rows_of(case)
    x, w, y, b, _ = make_inputs(R * S, H, V, dtype, ignore_frac=0.0, bias=bias, seed=seed)
    x, y = x.reshape(R, S, H), y.reshape(R, S)
    y[:, :2] = -100
    y[1] = -100
    g = torch.Generator().manual_seed(seed + 1)
    extra = {}
    if case["loss_type"] == "kto":
        extra = dict(ref_logps=(-25 + 4 * torch.randn(R, generator=g)).to(DEVICE),
                     kto_labels=torch.tensor([True, False, True, True, False], device=DEVICE),
                     kl=torch.tensor(0.4, device=DEVICE))
    elif case["loss_type"] in ("sigmoid", "ipo", "hinge", "robust") and not case.get("reference_free"):
        extra = dict(ref_chosen_logps=(-25 + 4 * torch.randn(B, generator=g)).to(DEVICE),
                     ref_rejected_logps=(-25 + 4 * torch.randn(B, generator=g)).to(DEVICE))
    return x, w, y, b, extra


def check_against_fp64(case, dtype, *, impl=FAST_IMPL, softcap=None, x=None, w=None, y=None, b=None, extra=None,
                       seed=0, chunk_tokens=None):
    """Loss, metrics and every gradient of linear_preference_loss vs the fp64 reference; torch's own
    computation (logits in `dtype`, then fp32) is the yardstick of the 2× rule. With a bias; returns the gradients."""
    if x is None:
        x, w, y, b, extra = inputs(case, dtype, seed=seed)
    kw = {**case, **extra, "softcap": softcap}
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    loss, metrics = fusedkern.linear_preference_loss(leaves[0], leaves[1], y, linear_bias=leaves[2], impl=impl,
                                                     chunk_tokens=chunk_tokens, **kw)
    f64 = [t.double().requires_grad_() for t in (x, w, b)]
    ref, ref_metrics = reference.linear_preference_loss_fp64(f64[0], f64[1], y, linear_bias=f64[2], **kw)
    same = [t.clone().requires_grad_() for t in (x, w, b)]
    tch, tch_metrics = reference.upcast_linear_preference_loss(same[0], same[1], y, linear_bias=same[2], **kw)
    atol = ATOL[dtype]
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert_close_to_ref("loss", loss, ref, tch, atol=atol)
    assert set(metrics) == set(ref_metrics)
    # the inputs' values are exact in fp64 and the core accumulates in fp32: metrics are fp32-accurate in bf16
    # too (at the CPU shapes within 2e-5; at the GPU's, whose sums run over ~1000 tokens, within 2× torch's error)
    for key, value in metrics.items():
        want = ref_metrics[key].item()
        allowed = max(2e-5 * max(1.0, abs(want)), 2 * abs(tch_metrics[key].item() - want))
        assert abs(value.item() - want) <= allowed, (key, value.item(), want, tch_metrics[key].item())
    upstream = 0.7
    grads = torch.autograd.grad(loss, leaves, torch.tensor(upstream))
    grads_ref = torch.autograd.grad(ref, f64, torch.tensor(upstream, dtype=torch.float64))
    grads_tch = torch.autograd.grad(tch, same, torch.tensor(upstream))
    for name, g, gr, gt, leaf in zip(("dX", "dW", "db"), grads, grads_ref, grads_tch, leaves):
        assert g.dtype == leaf.dtype, name
        assert_close_to_ref(name, g, gr, gt, atol=atol)
    return grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_every_loss_type_matches_fp64(name, dtype):
    grads = check_against_fp64(CASES[name], dtype)
    # row 1's response is empty: no gradient reaches it; its partner (pair losses) or the others (KTO) get one
    # (ORPO: the pair has no odds ratio and the NLL covers chosen rows, so the partner gets none either;
    # a hinge pair past its margin has no gradient at all)
    assert torch.count_nonzero(grads[0][1]) == 0
    partner = torch.count_nonzero(grads[0][0 if name == "kto" else 1 + B])
    assert partner == 0 if name == "orpo" else (partner > 0 or name.startswith("hinge"))


@pytest.mark.parametrize("name", ["sigmoid", "orpo", "kto"])
def test_softcap_matches_fp64(name):
    check_against_fp64(CASES[name], torch.float32, softcap=3.0)


@pytest.mark.parametrize("name", [n for n in CASES if "reference-free" not in n])
def test_three_gemm_path_matches_fp64(name):
    """The default strategy forms the gradient in the forward pass over chunks of whole pairs (KTO: whole
    sequences): one pair (two sequences) per chunk here, so the gradient of every chunk is taken while the
    other rows are not yet known; KTO's odd row count leaves a partial last chunk. With a softcap."""
    with mock.patch.object(preference_chunked, "impl", wraps=preference_chunked.impl) as spy:
        check_against_fp64(CASES[name], torch.float32, impl="auto", softcap=2.5, chunk_tokens=2 * S, seed=9)
    assert spy.call_count == 1


@pytest.mark.parametrize("dtype,chunk_pairs", [(torch.bfloat16, 2), (torch.float16, 1)], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", ["sigmoid", "kto"])
def test_three_gemm_path_half_precision_matches_fp64(name, dtype, chunk_pairs):
    """Half-precision weights: dW accumulates in fp32; with one pair per chunk the logits buffer lives in
    dW's own storage (the chunk plan's buffer_in_dw_storage)."""
    w_like = torch.empty(V, H, dtype=dtype)
    assert grouped_plan(2 * B, S, True, w_like, True, "fp32", 2 * chunk_pairs * S)[1].buffer_in_dw_storage \
        == (chunk_pairs == 1)
    with mock.patch.object(preference_chunked, "impl", wraps=preference_chunked.impl) as spy:
        check_against_fp64(CASES[name], dtype, impl="auto", chunk_tokens=2 * chunk_pairs * S, seed=11)
    assert spy.call_count == 1


def test_generic_path_when_a_chunk_cannot_hold_a_pair():
    """chunk_tokens < 2·S: no chunk holds a pair, so the four-GEMM path runs (same loss and gradients)."""
    x, w, y, b, extra = inputs(CASES["sigmoid"], torch.float32)
    assert grouped_plan(2 * B, S, True, w, True, "fp32", 2 * S - 1)[0] == 0
    with mock.patch.object(preference_chunked, "impl", wraps=preference_chunked.impl) as spy:
        check_against_fp64(CASES["sigmoid"], torch.float32, impl="chunked", chunk_tokens=2 * S - 1,
                           x=x, w=w, y=y, b=b, extra=extra)
    assert spy.call_count == 0


@pytest.mark.parametrize("name", ["sigmoid", "simpo", "orpo", "kto"])
def test_all_ignored_responses_are_defined(name):
    """Every response empty (documented: sums and averages 0, an ORPO pair without both responses
    contributes 0, NLL 0): a finite loss equal to the reference's, and zero gradients everywhere."""
    case = CASES[name]
    x, w, y, b, extra = inputs(case, torch.float32, seed=3)
    y[:] = -100
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    loss, metrics = fusedkern.linear_preference_loss(leaves[0], leaves[1], y, linear_bias=leaves[2], impl=FAST_IMPL,
                                                     **case, **extra)
    ref, ref_metrics = reference.linear_preference_loss_fp64(x.double(), w.double(), y, linear_bias=b.double(),
                                                             **case, **extra)
    assert torch.isfinite(loss) and abs(loss.item() - ref.item()) <= 1e-6 * max(1.0, abs(ref.item()))
    for key, value in metrics.items():
        assert torch.isfinite(value), key
        assert abs(value.item() - ref_metrics[key].item()) <= 1e-6 * max(1.0, abs(ref_metrics[key].item())), key
    for label, g in zip(("dX", "dW", "db"), torch.autograd.grad(loss, leaves)):
        assert torch.count_nonzero(g) == 0, label


@pytest.mark.parametrize("impl", [FAST_IMPL, "auto"])
def test_simpo_equals_linear_simpo_loss(impl):
    """loss_type="simpo" (generic four GEMMs, or the generic three-GEMM chunks) is linear_simpo_loss."""
    hp = dict(beta=2.0, gamma=1.0, alpha=0.5, label_smoothing=0.1)
    x, w, y, b, _ = inputs(CASES["simpo"], torch.float32, seed=5)
    a = [t.clone().requires_grad_() for t in (x, w, b)]
    c = [t.clone().requires_grad_() for t in (x, w, b)]
    loss_a, m_a = fusedkern.linear_preference_loss(a[0], a[1], y, linear_bias=a[2], loss_type="simpo",
                                                   impl=impl, **hp)
    loss_c, m_c = fusedkern.linear_simpo_loss(c[0], c[1], y, linear_bias=c[2], **hp)
    torch.testing.assert_close(loss_a, loss_c, rtol=1e-6, atol=1e-7)
    assert set(m_a) == set(m_c)
    for key in m_c:
        torch.testing.assert_close(m_a[key], m_c[key], rtol=1e-6, atol=1e-7, msg=key)
    for name, ga, gc in zip(("dX", "dW", "db"), torch.autograd.grad(loss_a, a), torch.autograd.grad(loss_c, c)):
        torch.testing.assert_close(ga, gc, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
def test_gpu_bf16_realistic(name):
    """bf16 at 4 pairs (KTO: 8 sequences) × seq 1024, H 1024, V 32003, the default strategy; reference
    log-probs within a few nats of the policy's, as in training."""
    R, seq = 8, 1024
    x, w, y, b, _ = make_inputs(R * seq, 1024, 32003, torch.bfloat16, ignore_frac=0.0, bias=True, device="cuda",
                                seed=7)
    x, y = x.reshape(R, seq, -1), y.reshape(R, seq)
    y[:, :128] = -100  # the prompt
    y[1, :] = -100  # an empty response
    with torch.no_grad():
        sums = reference.linear_logprobs_fp64(x, w, y, linear_bias=b).sum(-1)  # [R] float64
    g = torch.Generator(device="cuda").manual_seed(8)
    near = (sums + 5 * torch.randn(R, generator=g, device="cuda", dtype=torch.float64)).float()
    if name == "kto":
        extra = dict(ref_logps=near, kl=torch.tensor(0.4, device="cuda"),
                     kto_labels=torch.tensor([True, False, True, True, False, False, True, False], device="cuda"))
    elif CASES[name]["loss_type"] in ("sigmoid", "ipo", "hinge", "robust") and not CASES[name].get("reference_free"):
        extra = dict(ref_chosen_logps=near[:R // 2], ref_rejected_logps=near[R // 2:])
    else:
        extra = {}
    check_against_fp64(CASES[name], torch.bfloat16, impl="auto", x=x, w=w, y=y, b=b, extra=extra)


# ------------------------------------------------------------------ preference_loss_from_logps by hand


def _batch(rows=2 * B, seq=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(rows, seq, generator=g, dtype=torch.float64) * 2
    mask = torch.rand(rows, seq, generator=g) > 0.3
    mask[:, 0] = True
    ref = -torch.rand(2, rows // 2, generator=g, dtype=torch.float64) * 5
    return logps * mask, mask, ref[0], ref[1]


def _sigmoid(v):
    return 1 / (1 + math.exp(-v))


def test_sigmoid_matches_dpo_formula_by_hand():
    logps, mask, rc, rr = _batch()
    loss, m = preference_loss_from_logps(logps, mask, loss_type="sigmoid", beta=0.2,
                                         ref_chosen_logps=rc, ref_rejected_logps=rr)
    s = logps.sum(-1)
    expect = sum(-math.log(_sigmoid(0.2 * ((s[i] - s[B + i]) - (rc[i] - rr[i])).item())) for i in range(B)) / B
    assert loss.item() == pytest.approx(expect, rel=1e-12)
    assert m["rewards/chosen"].item() == pytest.approx((0.2 * (s[:B] - rc)).mean().item(), rel=1e-12)
    assert m["logps/chosen"].item() == pytest.approx(s[:B].mean().item(), rel=1e-12)


def test_ipo_averages_log_ratios_and_reports_sums():
    """TRL v1 DPOTrainer: IPO divides each (policy − reference) log-ratio by its length; rewards stay summed."""
    logps, mask, rc, rr = _batch(seed=2)
    loss, m = preference_loss_from_logps(logps, mask, loss_type="ipo", beta=0.25,
                                         ref_chosen_logps=rc, ref_rejected_logps=rr)
    s, n = logps.sum(-1), mask.sum(-1).double()
    d = (s[:B] - rc) / n[:B] - (s[B:] - rr) / n[B:]
    torch.testing.assert_close(loss, ((d - 2.0) ** 2).mean(), rtol=1e-12, atol=0)
    torch.testing.assert_close(m["rewards/rejected"], (0.25 * (s[B:] - rr)).mean(), rtol=1e-12, atol=0)


def test_reference_free_is_cpo():
    """reference_free sigmoid = CPOTrainer's sigmoid ("cpo") at the same NLL weight; CPO's ipo uses averages."""
    logps, mask, _, _ = _batch(seed=4)
    a, ma = preference_loss_from_logps(logps, mask, loss_type="sigmoid", reference_free=True, beta=0.3, alpha=1.0,
                                       label_smoothing=0.05)
    c, mc = preference_loss_from_logps(logps, mask, loss_type="cpo", beta=0.3, label_smoothing=0.05)  # alpha 1
    torch.testing.assert_close(a, c, rtol=1e-12, atol=0)
    for k in mc:
        torch.testing.assert_close(ma[k], mc[k], rtol=1e-12, atol=0)
    loss, m = preference_loss_from_logps(logps, mask, loss_type="ipo", reference_free=True, beta=0.3)
    avg = logps.sum(-1) / mask.sum(-1)
    torch.testing.assert_close(loss, ((avg[:B] - avg[B:] - 1 / 0.6) ** 2).mean(), rtol=1e-12, atol=0)
    torch.testing.assert_close(m["rewards/chosen"], 0.3 * avg[:B].mean(), rtol=1e-12, atol=0)


def test_simpo_matches_existing_simpo_loss():
    logps, mask, _, _ = _batch()
    a, ma = preference_loss_from_logps(logps, mask, loss_type="simpo", beta=2.0, gamma=1.0, alpha=0.5)
    b, mb = simpo_loss_from_logps(logps, mask, beta=2.0, gamma=1.0, alpha=0.5)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=0)
    for k in mb:
        torch.testing.assert_close(ma[k], mb[k].double(), rtol=1e-7, atol=0)  # (accuracies: fp32 there)


def test_orpo_log_odds_by_hand():
    logps, mask, _, _ = _batch()
    loss, m = preference_loss_from_logps(logps, mask, loss_type="orpo", beta=0.1)  # NLL weight 1 by default
    avg = logps.sum(-1) / mask.sum(-1)
    c, r = avg[:B], avg[B:]
    lo = (c - r) - (torch.log(1 - c.exp()) - torch.log(1 - r.exp()))
    nll = -logps[:B].sum() / mask[:B].sum()
    torch.testing.assert_close(loss, nll - 0.1 * F.logsigmoid(lo).mean(), rtol=1e-12, atol=0)
    torch.testing.assert_close(m["log_odds_chosen"], lo.mean(), rtol=1e-12, atol=0)
    torch.testing.assert_close(m["log_odds_ratio"], F.logsigmoid(lo).mean(), rtol=1e-12, atol=0)


def test_kto_by_hand():
    """KTOTrainer: summed log-ratios, KL detached and clamped at 0, weights per group, mean over all sequences."""
    logps, mask, _, _ = _batch(rows=N_KTO + 1, seed=6)
    logps, mask = logps[:N_KTO].clone().requires_grad_(), mask[:N_KTO]
    ref = -torch.rand(N_KTO, dtype=torch.float64) * 4
    labels = torch.tensor([True, True, False, True, False])
    for kl_value, z0 in ((0.3, 0.3), (-0.2, 0.0)):
        kl = torch.tensor(kl_value, dtype=torch.float64, requires_grad=True)
        loss, m = preference_loss_from_logps(logps, mask, loss_type="kto", beta=0.4, ref_logps=ref, kto_labels=labels,
                                             kl=kl, desirable_weight=1.5, undesirable_weight=0.5)
        r = (logps.detach().sum(-1) - ref).tolist()
        expect = sum(1.5 * (1 - _sigmoid(0.4 * (r[i] - z0))) if labels[i] else 0.5 * (1 - _sigmoid(0.4 * (z0 - r[i])))
                     for i in range(N_KTO)) / N_KTO
        assert loss.item() == pytest.approx(expect, rel=1e-12)
        assert m["kl"].item() == z0
        assert m["rewards/chosen"].item() == pytest.approx(0.4 * sum(r[i] for i in (0, 1, 3)) / 3, rel=1e-12)
        assert torch.autograd.grad(loss, kl, allow_unused=True)[0] is None  # detached, as in TRL
    assert "rewards/accuracies" not in m  # KTO has no pairs


@pytest.mark.parametrize("loss_type", PAIR_LOSS_TYPES)
def test_gradient_reaches_only_response_tokens(loss_type):
    logps, mask, rc, rr = _batch(seed=1)
    logps = logps.clone().requires_grad_()
    dpo = loss_type in ("sigmoid", "ipo", "hinge", "robust")
    refs = dict(ref_chosen_logps=rc, ref_rejected_logps=rr) if dpo else {}
    loss, _ = preference_loss_from_logps(logps, mask, loss_type=loss_type, beta=0.5, alpha=0.3, **refs)
    (g,) = torch.autograd.grad(loss, logps)
    assert torch.isfinite(loss)
    assert (g[~mask] == 0).all() and (g[mask] != 0).any()


# ------------------------------------------------------------------ bad inputs


def test_bad_inputs_raise_naming_the_argument():
    x, w, y, b, extra = inputs(CASES["sigmoid"], torch.float32)
    rc, rr = extra["ref_chosen_logps"], extra["ref_rejected_logps"]
    lp = fusedkern.linear_preference_loss
    with pytest.raises(ValueError, match="loss_type"):
        lp(x, w, y, loss_type="dpo")
    with pytest.raises(ValueError, match="odd number of rows 5"):
        lp(x[:5], w, y[:5], loss_type="simpo")
    with pytest.raises(ValueError, match="ref_chosen_logps"):
        lp(x, w, y, loss_type="sigmoid", ref_chosen_logps=rc[:2], ref_rejected_logps=rr)
    with pytest.raises(ValueError, match="ref_rejected_logps"):
        lp(x, w, y, loss_type="ipo", ref_chosen_logps=rc, ref_rejected_logps=rr[:, None])
    with pytest.raises(TypeError, match="ref_chosen_logps"):
        lp(x, w, y, loss_type="hinge", ref_rejected_logps=rr)
    with pytest.raises(ValueError, match="ref_chosen_logps is not used"):
        lp(x, w, y, loss_type="simpo", ref_chosen_logps=rc)
    with pytest.raises(ValueError, match="label_smoothing"):
        lp(x, w, y, loss_type="robust", label_smoothing=0.5, ref_chosen_logps=rc, ref_rejected_logps=rr)
    with pytest.raises(ValueError, match="beta"):
        lp(x, w, y, loss_type="cpo", beta=0.0)
    with pytest.raises(ValueError, match="reference_free"):
        lp(x, w, y, loss_type="orpo", reference_free=True)
    labels, ref6, kl = (torch.ones(6, dtype=torch.bool, device=DEVICE), torch.zeros(6, device=DEVICE),
                        torch.tensor(0.1, device=DEVICE))
    with pytest.raises(ValueError, match="kto_labels"):
        lp(x, w, y, loss_type="kto", ref_logps=ref6, kl=kl, kto_labels=labels[:5])
    with pytest.raises(TypeError, match="kto_labels"):
        lp(x, w, y, loss_type="kto", ref_logps=ref6, kl=kl, kto_labels=labels.float())
    with pytest.raises(TypeError, match="kto_labels"):
        lp(x, w, y, loss_type="kto", ref_logps=ref6, kl=kl, kto_labels=[True] * 6)
    with pytest.raises(TypeError, match="kl"):
        lp(x, w, y, loss_type="kto", ref_logps=ref6, kto_labels=labels)
    with pytest.raises(ValueError, match="kl"):
        lp(x, w, y, loss_type="kto", ref_logps=ref6, kto_labels=labels, kl=ref6[:2])
    with pytest.raises(ValueError, match="ref_logps"):
        lp(x, w, y, loss_type="kto", ref_logps=ref6[:5], kto_labels=labels, kl=kl)
    with pytest.raises(ValueError, match="alpha"):
        lp(x, w, y, loss_type="kto", ref_logps=ref6, kto_labels=labels, kl=kl, alpha=0.5)
    with pytest.raises(ValueError, match="input"):
        lp(x[0], w, y[0], loss_type="cpo")
    with pytest.raises(ValueError, match=r"\[2B, \.\.\.\]"):
        preference_loss_from_logps(torch.zeros(5, 3), torch.ones(5, 3, dtype=torch.bool), loss_type="cpo")
    assert set(LOSS_TYPES) == set(PAIR_LOSS_TYPES) | {"kto"}


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_empty_batch_follows_torch(loss_type):
    """No pair (KTO: no sequence) is a mean over nothing: NaN loss and metrics, as torch's mean of an empty tensor,
    with zero gradients of the inputs' shapes; the NLL term, a sum over no token, is +0."""
    w = torch.randn(V, H, requires_grad=True)
    x = torch.randn(0, S, H, requires_grad=True)
    y = torch.zeros(0, S, dtype=torch.long)
    kw = dict(reference_free=True) if loss_type in ("sigmoid", "ipo", "hinge", "robust") else {}
    if loss_type == "kto":
        kw = dict(kto_labels=torch.zeros(0, dtype=torch.bool), ref_logps=torch.zeros(0), kl=torch.zeros(1))
    loss, metrics = fusedkern.linear_preference_loss(x, w, y, loss_type=loss_type, **kw)
    assert loss.dtype == torch.float32 and torch.isnan(loss)
    loss.backward()
    assert x.grad.shape == x.shape and torch.equal(w.grad, torch.zeros_like(w))
    if "nll_loss" in metrics:
        nll = metrics["nll_loss"]
        assert nll.item() == 0.0 and not torch.signbit(nll)
    assert all(torch.isnan(v) for k, v in metrics.items() if k.startswith("rewards/"))
