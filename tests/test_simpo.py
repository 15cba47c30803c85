"""linear_logprobs and linear_simpo_loss against the fp64 references and against autograd through
the materialized computation, every strategy (generic four-GEMM path, chunked "pairs" and "prepass")."""

from __future__ import annotations

import warnings

import pytest
import torch

import fusedkern
from fusedkern import reference
from fusedkern.simpo import plan_for
from tests._accuracy import assert_close_to_ref, rel_err
from tests.conftest import DEVICE
from tests.test_linear_cross_entropy import IMPLS, make_inputs

HP = dict(beta=2.0, gamma=1.0, alpha=0.5, label_smoothing=0.1)


def simpo_inputs(two_b, seq, H, V, dtype, *, bias=True, empty_response=False, device=DEVICE):
    x, w, y, b, _ = make_inputs(two_b * seq, H, V, dtype, ignore_frac=0.0, bias=bias, device=device)
    x, y = x.reshape(two_b, seq, H), y.reshape(two_b, seq)
    y[:, :2] = -100  # the prompt
    if empty_response:
        y[1] = -100  # chosen response 1 has no token
    return x, w, y, b


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_logprobs_match_fp64_with_per_token_upstream(impl, softcap):
    x, w, y, b, _ = make_inputs(29, 24, 97, torch.float32, bias=True)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    logp = fusedkern.linear_logprobs(leaves[0], leaves[1], y, linear_bias=leaves[2], softcap=softcap, impl=impl)
    f64 = [t.double().requires_grad_() for t in (x, w, b)]
    ref = reference.linear_logprobs_fp64(f64[0], f64[1], y, linear_bias=f64[2], softcap=softcap)
    assert logp.dtype == torch.float32 and logp.shape == y.shape
    assert torch.all(logp[y == -100] == 0)
    # PyTorch's fp32 log-softmax through autograd: the yardstick of the 2× rule
    same = [t.clone().requires_grad_() for t in (x, w, b)]
    z = torch.nn.functional.linear(same[0], same[1], same[2])
    z = softcap * torch.tanh(z / softcap) if softcap else z
    tch = torch.where(y == -100, 0.0, z.log_softmax(-1).gather(-1, y.clamp(min=0)[..., None])[..., 0])
    assert_close_to_ref("logp", logp, ref, tch, atol=1e-6)
    upstream = torch.randn(y.shape, dtype=torch.float64, device=x.device)
    grads_tch = torch.autograd.grad(tch, same, upstream.float())
    for name, g, gr, gt in zip(("dX", "dW", "db"), torch.autograd.grad(logp, leaves, upstream.float()),
                               torch.autograd.grad(ref, f64, upstream), grads_tch):
        assert_close_to_ref(name, g, gr, gt, atol=1e-6)


@pytest.mark.parametrize("chunk_tokens,mode", [(None, "pairs"), (24, "pairs"), (12, "pairs"), (6, "prepass"), (5, "generic")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_simpo_matches_fp64_every_strategy(chunk_tokens, mode, dtype):
    x, w, y, b = simpo_inputs(6, 6, 16, 61, dtype, empty_response=True)
    assert plan_for(6, 6, w, True, "fp32", chunk_tokens)[0] == mode
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    loss, metrics = fusedkern.linear_simpo_loss(leaves[0], leaves[1], y, linear_bias=leaves[2], chunk_tokens=chunk_tokens, **HP)
    f64 = [t.double().requires_grad_() for t in (x, w, b)]
    ref, ref_metrics = reference.linear_simpo_loss_fp64(f64[0], f64[1], y, linear_bias=f64[2], **HP)
    # PyTorch's own same-dtype computation, materialized logits and autograd (the seed's HF baseline
    # upcasts logits to fp32; this is the yardstick for the accuracy rule)
    same = [t.clone().requires_grad_() for t in (x, w, b)]
    tch, _ = reference.hf_linear_simpo_loss(same[0], same[1], y, linear_bias=same[2], **HP)
    assert torch.isfinite(loss)
    atol = 1e-6 if dtype == torch.float32 else 1e-4
    assert_close_to_ref("loss", loss, ref, tch, atol=atol)
    metric_tol = 1e-5 if dtype == torch.float32 else 1e-3  # fp16: the logits themselves are rounded
    for key in metrics:
        assert abs(metrics[key].item() - ref_metrics[key].item()) <= metric_tol * max(1.0, abs(ref_metrics[key].item())), key
    upstream = torch.tensor(0.7, dtype=torch.float64)
    grads = torch.autograd.grad(loss, leaves, upstream.float())
    grads_ref = torch.autograd.grad(ref, f64, upstream)
    grads_tch = torch.autograd.grad(tch, same, upstream.float())
    for name, g, gr, gt in zip(("dX", "dW", "db"), grads, grads_ref, grads_tch):
        assert_close_to_ref(name, g, gr, gt, atol=atol)
    # the empty chosen response (row 1) receives no gradient; its rejected partner (row 4) does
    assert torch.count_nonzero(grads[0][1]) == 0 and torch.count_nonzero(grads[0][4]) > 0


@pytest.mark.parametrize("impl", IMPLS)
def test_pure_simpo_and_no_grad(impl):
    x, w, y, b = simpo_inputs(4, 5, 16, 40, torch.float32, bias=False)
    with torch.no_grad():
        loss, metrics = fusedkern.linear_simpo_loss(x, w, y, beta=2.5, gamma=1.0, alpha=0.0, impl=impl)
    ref, ref_metrics = reference.linear_simpo_loss_fp64(x.double(), w.double(), y, beta=2.5, gamma=1.0, alpha=0.0)
    tch, _ = reference.hf_linear_simpo_loss(x, w, y, beta=2.5, gamma=1.0, alpha=0.0)
    assert_close_to_ref("loss", loss, ref, tch, atol=1e-6)
    assert set(metrics) == set(reference.SIMPO_METRIC_KEYS)


def test_module_and_single_backward():
    x, w, y, b = simpo_inputs(4, 5, 16, 40, torch.float32)
    x.requires_grad_()
    module = fusedkern.LinearSimPOLoss(beta=2.0, gamma=0.5)
    assert "beta=2.0" in repr(module)
    loss, _ = module(x, w, y, b)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward"):
        loss.backward()


@pytest.mark.gpu
@pytest.mark.parametrize("chunk_tokens", [None, 4096])  # S = 1024 at V = 32003: pairs; 4096: pairs of 2
def test_gpu_simpo_bf16_realistic(chunk_tokens):
    x, w, y, b = simpo_inputs(4, 1024, 1024, 32003, torch.bfloat16, device="cuda")
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    loss, _ = fusedkern.linear_simpo_loss(leaves[0], leaves[1], y, linear_bias=leaves[2], chunk_tokens=chunk_tokens, **HP)
    f64 = [t.double().requires_grad_() for t in (x, w, b)]
    ref, _ = reference.linear_simpo_loss_fp64(f64[0], f64[1], y, linear_bias=f64[2], **HP)
    same = [t.clone().requires_grad_() for t in (x, w, b)]
    tch, _ = reference.hf_linear_simpo_loss(same[0], same[1], y, linear_bias=same[2], **HP)
    assert_close_to_ref("loss", loss, ref, tch, atol=1e-3)
    for name, g, gr, gt in zip(("dX", "dW", "db"), torch.autograd.grad(loss, leaves), torch.autograd.grad(ref, f64),
                               torch.autograd.grad(tch, same)):
        assert_close_to_ref(name, g, gr, gt, atol=1e-3)


# the option matrix with gradients, fp32: each frozen-leaf pattern with its own hyper-parameter set
# (TRL/Liger defaults, pure SimPO without the NLL term, the study's HP with smoothing) and, for the
# last, an empty *rejected* response (the matrix above empties a chosen one)
GRAD_PATTERNS = {
    "all-trl-defaults": ((True, True, True), dict(beta=0.1, gamma=0.5, alpha=1.0), False),
    "frozen-weight-pure-simpo": ((True, False, False), dict(beta=2.5, gamma=1.0, alpha=0.0), False),
    "frozen-input-empty-rejected": ((False, True, True), HP, True),
}


@pytest.mark.parametrize("pattern", list(GRAD_PATTERNS))
@pytest.mark.parametrize("accum", ["fp32", "weight_dtype"])
@pytest.mark.parametrize("impl", IMPLS)
def test_simpo_options_and_frozen_leaves_match_fp64(impl, accum, pattern):
    needs, hp, empty_rejected = GRAD_PATTERNS[pattern]
    x, w, y, b = simpo_inputs(4, 5, 16, 40, torch.float32)
    if empty_rejected:
        y[3] = -100  # rejected response of pair 1 has no token
    leaves = [t.clone().requires_grad_(need) for t, need in zip((x, w, b), needs)]
    loss, metrics = fusedkern.linear_simpo_loss(leaves[0], leaves[1], y, linear_bias=leaves[2], impl=impl,
                                                weight_grad_accum=accum, **hp)
    f64 = [t.double().requires_grad_(need) for t, need in zip((x, w, b), needs)]
    ref, ref_metrics = reference.linear_simpo_loss_fp64(f64[0], f64[1], y, linear_bias=f64[2], **hp)
    same = [t.clone().requires_grad_(need) for t, need in zip((x, w, b), needs)]
    tch, _ = reference.hf_linear_simpo_loss(same[0], same[1], y, linear_bias=same[2], **hp)
    assert torch.isfinite(loss)
    assert_close_to_ref("loss", loss, ref, tch, atol=1e-6)
    for key in metrics:
        assert abs(metrics[key].item() - ref_metrics[key].item()) <= 1e-5 * max(1.0, abs(ref_metrics[key].item())), key
    wanted = [i for i, need in enumerate(needs) if need]
    grads = torch.autograd.grad(loss, [leaves[i] for i in wanted])
    grads_ref = torch.autograd.grad(ref, [f64[i] for i in wanted])
    grads_tch = torch.autograd.grad(tch, [same[i] for i in wanted])
    for i, g, gr, gt in zip(wanted, grads, grads_ref, grads_tch):
        assert g.dtype == leaves[i].dtype
        assert_close_to_ref(("dX", "dW", "db")[i], g, gr, gt, atol=1e-6)
    if empty_rejected and 0 in wanted:  # the empty response gets no gradient, its chosen partner does
        assert torch.count_nonzero(grads[0][3]) == 0 and torch.count_nonzero(grads[0][1]) > 0


@pytest.mark.parametrize("impl", IMPLS)
def test_simpo_single_pair_without_bias(impl):
    """B = 1 (one chosen, one rejected row), no bias, ignore_index other than −100."""
    x, w, y, _ = simpo_inputs(2, 7, 16, 40, torch.float32, bias=False)
    y[y == -100] = 39  # a vocabulary id used as ignore_index: its tokens must be skipped, not scored
    x.requires_grad_()
    loss, _ = fusedkern.linear_simpo_loss(x, w, y, ignore_index=39, impl=impl, **HP)
    x64 = x.detach().double().requires_grad_()
    ref, _ = reference.linear_simpo_loss_fp64(x64, w.double(), y, ignore_index=39, **HP)
    same = x.detach().clone().requires_grad_()
    tch, _ = reference.hf_linear_simpo_loss(same, w, y, ignore_index=39, **HP)
    assert_close_to_ref("loss", loss, ref, tch, atol=1e-6)
    assert_close_to_ref("dX", torch.autograd.grad(loss, x)[0], torch.autograd.grad(ref, x64)[0],
                        torch.autograd.grad(tch, same)[0], atol=1e-6)


@pytest.mark.parametrize("chunk_tokens,mode", [(None, "pairs"), (6, "prepass"), (5, "generic")])
def test_every_output_element_is_written(poison_allocations, chunk_tokens, mode):
    """Poison every buffer the package allocates (NaN floats, −7 integers): a row that a SimPO or
    log-prob path forgets to write — the empty response's, a chunk's tail — surfaces as NaN or as a
    mismatch against fp64, instead of passing on zeros the allocator happened to hold."""
    x, w, y, b = simpo_inputs(6, 6, 16, 61, torch.float32, empty_response=True)
    assert plan_for(6, 6, w, True, "fp32", chunk_tokens)[0] == mode
    f64 = [t.double().requires_grad_() for t in (x, w, b)]
    ref, _ = reference.linear_simpo_loss_fp64(f64[0], f64[1], y, linear_bias=f64[2], **HP)
    grads_ref = torch.autograd.grad(ref, f64)
    ref_logp = reference.linear_logprobs_fp64(x.double(), w.double(), y, linear_bias=b.double())
    poison_allocations()  # after the references: they allocate too
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    loss, metrics = fusedkern.linear_simpo_loss(leaves[0], leaves[1], y, linear_bias=leaves[2],
                                                chunk_tokens=chunk_tokens, **HP)
    assert rel_err(loss, ref) < 1e-5 and all(torch.isfinite(v).all() for v in metrics.values())
    for name, g, gr in zip(("dX", "dW", "db"), torch.autograd.grad(loss, leaves), grads_ref):
        assert torch.isfinite(g).all(), name
        assert rel_err(g, gr) < 1e-5, name
    for impl in IMPLS:
        logp = fusedkern.linear_logprobs(x, w, y, linear_bias=b, impl=impl, chunk_tokens=chunk_tokens)
        assert torch.isfinite(logp).all() and rel_err(logp, ref_logp) < 1e-6, impl


@pytest.mark.parametrize("impl", IMPLS)
def test_module_forwards_every_setting(impl):
    """LinearSimPOLoss(**settings)(...) is linear_simpo_loss(..., **settings), bit for bit, metrics too."""
    x, w, y, b = simpo_inputs(4, 6, 16, 40, torch.float32)
    settings = dict(beta=1.5, gamma=0.3, alpha=0.25, label_smoothing=0.2, ignore_index=-100, impl=impl,
                    weight_grad_accum="weight_dtype", chunk_tokens=6)
    with torch.no_grad():
        loss_module, metrics_module = fusedkern.LinearSimPOLoss(**settings)(x, w, y, b)
        loss_function, metrics_function = fusedkern.linear_simpo_loss(x, w, y, linear_bias=b, **settings)
        loss_default, _ = fusedkern.linear_simpo_loss(x, w, y, linear_bias=b, impl=impl)
    assert torch.equal(loss_module, loss_function) and not torch.equal(loss_module, loss_default)
    assert all(torch.equal(metrics_module[k], metrics_function[k]) for k in metrics_function)


@pytest.mark.parametrize("impl,chunk_tokens", [("chunked", None), ("chunked", 20), ("chunked", 8), ("fused", None)],
                         ids=["chunked-pairs", "chunked-prepass", "chunked-generic", "fused"])
def test_fp32_large_beta_with_bias_within_twice_torchs_error(impl, chunk_tokens):
    """β = 10, γ = 3 amplify the margins' rounding tenfold; the fp32 gradients stay within 2× torch's fp32 error.
    (Outside the rule, 2–10× torch's, are draws with one to three tokens per response, where both errors rest on a
    few fp32 roundings of the logits: 2 of 150 such draws on the chunked path, 5 of 150 on the generic one;
    tests/test_property.py::test_simpo_large_beta_matches_fp64 covers the region with random shapes.)"""
    x, w, y, b = simpo_inputs(4, 17, 32, 131, torch.float32)
    hp = dict(beta=10.0, gamma=3.0, alpha=0.0)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    loss, _ = fusedkern.linear_simpo_loss(*leaves[:2], y, linear_bias=leaves[2], impl=impl, chunk_tokens=chunk_tokens,
                                          **hp)
    f64 = [t.detach().double().requires_grad_() for t in (x, w, b)]
    ref, _ = reference.linear_simpo_loss_fp64(*f64[:2], y, linear_bias=f64[2], **hp)
    same = [t.clone().requires_grad_() for t in (x, w, b)]
    tch, _ = reference.hf_linear_simpo_loss(*same[:2], y, linear_bias=same[2], **hp)
    # one scalar: torch's own error can be ~0 by chance, while both share the fp32 logits' rounding that
    # β = 10 amplifies to ~1e-6 (measured: ours equals torch's error on most draws, 1e-7 to 2e-6)
    assert_close_to_ref("loss", loss, ref, tch, atol=1e-5)
    for name, g, gr, gt in zip(("dX", "dW", "db"), torch.autograd.grad(loss, leaves), torch.autograd.grad(ref, f64),
                               torch.autograd.grad(tch, same)):
        assert_close_to_ref(name, g, gr, gt)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_simpo_softcap_matches_fp64(impl, dtype):
    """linear_simpo_loss(softcap=c): loss, metrics and gradients against the float64 SimPO of softcapped logits,
    within 2× PyTorch's same-dtype error (its logits in the input dtype, softcap and log-softmax in fp32)."""
    x, w, y, b = simpo_inputs(4, 6, 16, 61, dtype, empty_response=True)
    x, w = x * 2, w * 2  # logits of size ~10, so that a softcap of 3 bites
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    loss, metrics = fusedkern.linear_simpo_loss(leaves[0], leaves[1], y, linear_bias=leaves[2], impl=impl,
                                                softcap=3.0, **HP)
    f64 = [t.double().requires_grad_() for t in (x, w, b)]
    ref, ref_metrics = reference.linear_simpo_loss_fp64(f64[0], f64[1], y, linear_bias=f64[2], softcap=3.0, **HP)
    same = [t.clone().requires_grad_() for t in (x, w, b)]
    logits = torch.nn.functional.linear(same[0], same[1], same[2]).float()
    logps = reference.target_logprobs(logits, y, ignore_index=-100, softcap=3.0)
    tch, _ = reference.simpo_from_logprobs(logps, y != -100, **HP)
    assert set(metrics) == set(ref_metrics)
    atol = 1e-6 if dtype == torch.float32 else 1e-4
    assert_close_to_ref("loss", loss, ref, tch, atol=atol)
    unsoftcapped, _ = reference.linear_simpo_loss_fp64(f64[0], f64[1], y, linear_bias=f64[2], **HP)
    assert abs(unsoftcapped.item() - ref.item()) > 10 * atol  # the softcap changed the loss
    metric_tol = 1e-5 if dtype == torch.float32 else 1e-3
    for key in metrics:
        assert abs(metrics[key].item() - ref_metrics[key].item()) <= metric_tol * max(1.0, abs(ref_metrics[key].item())), key
    grads = torch.autograd.grad(loss, leaves)
    grads_ref = torch.autograd.grad(ref, f64)
    grads_tch = torch.autograd.grad(tch, same)
    for name, g, gr, gt in zip(("dX", "dW", "db"), grads, grads_ref, grads_tch):
        assert_close_to_ref(name, g, gr, gt, atol=atol)
    module = fusedkern.LinearSimPOLoss(softcap=3.0, impl=impl, **HP)
    assert "softcap=3.0" in repr(module)
    torch.testing.assert_close(module(x, w, y, b)[0], loss.detach(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="softcap"):
        fusedkern.LinearSimPOLoss(softcap=-1.0)
    with pytest.raises(ValueError, match="softcap"):
        fusedkern.linear_simpo_loss(x, w, y, softcap=0.0)


def test_chunk_tokens_shorter_than_a_response_warns():
    """chunk_tokens below a response's length cannot form the gradient in the forward pass: the four-GEMM
    fallback is said (once per call site, by Python's warning filter), not taken silently."""
    x, w, y, b = simpo_inputs(4, 6, 16, 40, torch.float32)
    x.requires_grad_()
    with pytest.warns(UserWarning, match="chunk_tokens=5: pass at least 6"):
        fusedkern.linear_simpo_loss(x, w, y, linear_bias=b, chunk_tokens=5, **HP)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fusedkern.linear_simpo_loss(x, w, y, linear_bias=b, chunk_tokens=12, **HP)  # a pair fits: three GEMMs
    assert not [w for w in caught if "linear_simpo_loss" in str(w.message)]
