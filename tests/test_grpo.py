"""linear_grpo_loss against the plain-PyTorch fp64 reference (`reference.grpo_loss_from_logps` on
`reference.linear_logprobs_entropy_fp64`): loss, dX/dW/db for every loss_type under the 2× rule of
tests/_accuracy.py, TRL's metrics, on-policy and KL cases, and bad inputs. CPU: Triton's interpreter at tiny
odd shapes; the old log-probs sit well inside or well outside the clip range, so no token's branch of the
min/clip can flip by rounding."""

from __future__ import annotations

import importlib
import math

import pytest
import torch

import fusedkern
from fusedkern import grpo as grpo_mod
from fusedkern import reference
from fusedkern.grpo import CLIP_METRIC_KEYS, grpo_loss_from_logps
from tests._accuracy import assert_close_to_ref
from tests.conftest import DEVICE

dispatch_mod = importlib.import_module("fusedkern.dispatch")

B, S, H, V = 3, 5, 16, 83
ATOL = {torch.float32: 1e-6, torch.bfloat16: 1e-3}
TAU, SOFTCAP = 0.8, 3.0


def make_batch(dtype, *, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) / math.sqrt(H) * 2).to(dtype)
    b = (torch.randn(V, generator=g) * 0.5).to(dtype) if bias else None
    y = torch.randint(0, V, (B, S), generator=g)
    y[0, :2] = -100  # prompt/padding positions
    y[2, 4] = -100
    adv = torch.randn(B, generator=g)
    with torch.no_grad():
        true, _ = reference.linear_logprobs_entropy_fp64(x.double(), w.double(), y, linear_bias=None if b is None
                                                         else b.double(), softcap=SOFTCAP, temperature=TAU)
    # ratios e^{±0.05} (inside the clip range of ε = 0.2 / 0.28) or e^{±0.5} (outside), never near its edges
    shift = torch.tensor([-0.5, -0.05, 0.05, 0.5], dtype=torch.float64)[torch.randint(0, 4, (B, S), generator=g)]
    old = (true - shift).float()
    ref = (true + 0.3 * torch.randn(B, S, generator=g, dtype=torch.float64)).float()
    move = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    return tuple(move(t) for t in (x, w, b, y, adv, old, ref))


def _leaves(ts, dtype=None):
    return [None if t is None else t.detach().to(dtype or t.dtype).clone().requires_grad_() for t in ts]


def torch_same_dtype_logps(x, w, b, y):
    """PyTorch's own computation in the inputs' dtype: logits, softcap, temperature and log-softmax."""
    s = torch.nn.functional.linear(x, w, b)
    s = SOFTCAP * torch.tanh(s / SOFTCAP)
    log_p = torch.log_softmax(s / TAU, dim=-1)
    valid = y != -100
    return torch.where(valid, log_p.gather(-1, torch.where(valid, y, 0).unsqueeze(-1)).squeeze(-1), 0)


LOSS_CASES = [("grpo", torch.float32), ("bnpo", torch.float32), ("dapo", torch.float32), ("dr_grpo", torch.float32),
              ("dapo", torch.bfloat16), ("grpo", torch.bfloat16)]


@pytest.mark.parametrize("loss_type,dtype", LOSS_CASES, ids=[f"{t}-{str(d)[6:]}" for t, d in LOSS_CASES])
def test_loss_and_grads_match_fp64(loss_type, dtype):
    x, w, b, y, adv, old, ref_lp = make_batch(dtype, seed=len(loss_type))
    kw = dict(advantages=adv, old_logps=old, ref_logps=ref_lp, beta=0.04, epsilon=0.2, epsilon_high=0.28,
              loss_type=loss_type, max_completion_length=7)
    leaves = _leaves((x, w, b))
    loss, metrics = fusedkern.linear_grpo_loss(leaves[0], leaves[1], y, linear_bias=leaves[2], temperature=TAU,
                                               softcap=SOFTCAP, chunk_tokens=4, **kw)
    f64 = _leaves((x, w, b), torch.float64)
    logps64, _ = reference.linear_logprobs_entropy_fp64(f64[0], f64[1], y, linear_bias=f64[2], softcap=SOFTCAP,
                                                        temperature=TAU)
    ref_kw = {**kw, "advantages": adv.double(), "old_logps": old.double(), "ref_logps": ref_lp.double()}
    loss64 = reference.grpo_loss_from_logps(logps64, y != -100, **ref_kw)
    same = _leaves((x, w, b))
    loss_tch, _ = grpo_loss_from_logps(torch_same_dtype_logps(*same[:3], y), y != -100, **kw)
    with torch.no_grad():  # the value's yardstick: torch's logits in the input dtype, fp32 after
        s = torch.nn.functional.linear(x, w, b).float()
        s = SOFTCAP * torch.tanh(s / SOFTCAP)
        lp = torch.log_softmax(s / TAU, -1).gather(-1, torch.where(y != -100, y, 0).unsqueeze(-1)).squeeze(-1)
        loss_upcast, _ = grpo_loss_from_logps(torch.where(y != -100, lp, 0), y != -100, **kw)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    atol = ATOL[dtype]
    assert_close_to_ref("loss", loss, loss64, loss_upcast, atol=atol)
    wanted = [t for t in leaves if t is not None]
    grads = torch.autograd.grad(loss, wanted)
    grads64 = torch.autograd.grad(loss64, [t for t in f64 if t is not None])
    grads_tch = torch.autograd.grad(loss_tch, [t for t in same if t is not None])
    for name, g, g64, gt, leaf in zip(("dX", "dW", "db"), grads, grads64, grads_tch, wanted):
        assert g.dtype == leaf.dtype and g.shape == leaf.shape
        assert_close_to_ref(name, g, g64, gt, atol=atol)
    assert set(metrics) == {"kl", *CLIP_METRIC_KEYS}


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_three_gemm_path_matches_the_generic_one(loss_type, monkeypatch):
    """The chunked path forms the gradient in the forward pass (no logits recomputed: the per-token backward is
    never called) and gives the generic four-GEMM path's loss, metrics and gradients; several chunks, entropy."""
    x, w, b, y, adv, old, ref_lp = make_batch(torch.float32, seed=9)
    kw = dict(advantages=adv, old_logps=old, ref_logps=ref_lp, beta=0.04, loss_type=loss_type, temperature=TAU,
              softcap=SOFTCAP, compute_entropy=True, chunk_tokens=4)
    results = []
    for chunked in (True, False):
        with monkeypatch.context() as mp:
            if chunked:
                mp.setattr(dispatch_mod, "chunked_grads", lambda *a, **k: pytest.fail("logits recomputed in backward"))
            else:
                mp.setattr(grpo_mod, "forms_gradient_in_forward", lambda *a, **k: False)
            leaves = _leaves((x, w, b))
            loss, metrics = fusedkern.linear_grpo_loss(leaves[0], leaves[1], y, linear_bias=leaves[2], **kw)
            results.append((loss, metrics, torch.autograd.grad(1.7 * loss, leaves)))
    (loss_c, met_c, grads_c), (loss_g, met_g, grads_g) = results
    torch.testing.assert_close(loss_c, loss_g, rtol=1e-6, atol=1e-7)
    assert met_c.keys() == met_g.keys()
    for key in met_c:
        torch.testing.assert_close(met_c[key], met_g[key], rtol=1e-5, atol=1e-7, equal_nan=True)
    for a, e in zip(grads_c, grads_g):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-7)
    assert grpo_mod.forms_gradient_in_forward(*_leaves((x, w)), None, adv, old, ref_lp, impl="auto",
                                              weight_grad_accum="fp32", chunk_tokens=None)
    assert not grpo_mod.forms_gradient_in_forward(*_leaves((x, w)), None, adv, old.requires_grad_(), ref_lp,
                                                  impl="auto", weight_grad_accum="fp32", chunk_tokens=None)


def test_padding_values_off_the_mask_do_not_reach_the_loss():
    """old/reference log-probs off the completion mask may hold anything (−1e4 padding): ratio 1, KL 0 there."""
    x, w, b, y, adv, old, ref_lp = make_batch(torch.float32, seed=10)
    off = y == -100
    clean = fusedkern.linear_grpo_loss(x, w, y, advantages=adv, old_logps=old, ref_logps=ref_lp, beta=0.1)[0]
    for chunked in (True, False):
        leaves = _leaves((x, w)) if chunked else (x, w)
        loss, metrics = fusedkern.linear_grpo_loss(*leaves, y, advantages=adv, old_logps=old.masked_fill(off, -1e4),
                                                   ref_logps=ref_lp.masked_fill(off, -1e4), beta=0.1)
        torch.testing.assert_close(loss.detach(), clean, rtol=1e-6, atol=1e-7)
        assert all(torch.isfinite(v) for v in metrics.values())
        if chunked:
            assert all(torch.isfinite(g).all() for g in torch.autograd.grad(loss, leaves))


def test_loss_types_normalise_as_trl_does():
    """The same per-token losses, reduced four ways (by hand on a fixed 2×3 batch)."""
    logps = torch.zeros(2, 3, requires_grad=True)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    adv = torch.tensor([1.0, -2.0])  # on-policy: r = 1, per-token loss −A
    expected = {"grpo": (-1.0 + 2.0) / 2, "bnpo": (-2.0 + 2.0) / 3, "dapo": (-2.0 + 2.0) / 3,
                "dr_grpo": (-2.0 + 2.0) / (2 * 4)}
    for loss_type, value in expected.items():
        loss, metrics = grpo_loss_from_logps(logps, mask, advantages=adv, loss_type=loss_type,
                                             max_completion_length=4)
        assert loss.item() == pytest.approx(value), loss_type
        assert metrics["clip_ratio/region_mean"].item() == 0.0
    loss, _ = grpo_loss_from_logps(logps, mask, advantages=adv, loss_type="dapo", num_items_in_batch=6)
    assert loss.item() == pytest.approx(0.0)
    grpo, _ = grpo_loss_from_logps(logps, mask, advantages=adv, loss_type="grpo")
    grad, = torch.autograd.grad(grpo, logps)  # on-policy gradient: −A/(B·n_b) on each sequence's tokens
    torch.testing.assert_close(grad, torch.tensor([[-0.25, -0.25, 0.0], [1.0, 0.0, 0.0]]))


def test_on_policy_metrics_and_entropy():
    """old_logps=None is TRL's on-policy step (ratio 1, no clipping); compute_entropy logs the masked mean
    entropy at the temperature; clip ratios count exactly the tokens pushed past ε on the advantage's side."""
    x, w, b, y, adv, old, _ = make_batch(torch.float32, seed=3)
    mask = y != -100
    loss, metrics = fusedkern.linear_grpo_loss(x, w, y, linear_bias=b, advantages=adv, temperature=TAU,
                                               softcap=SOFTCAP, compute_entropy=True, loss_type="grpo")
    counts = mask.sum(-1).clamp(min=1)
    torch.testing.assert_close(loss, -(adv * (mask.sum(-1) > 0)).mean(), rtol=1e-6, atol=1e-7)
    assert all(metrics[k].item() == 0.0 for k in CLIP_METRIC_KEYS) and "kl" not in metrics
    _, ent64 = reference.linear_logprobs_entropy_fp64(x.double(), w.double(), y, linear_bias=b.double(),
                                                      softcap=SOFTCAP, temperature=TAU)
    torch.testing.assert_close(metrics["entropy"].double(), (ent64 * mask).sum() / mask.sum(), rtol=1e-5, atol=0)
    _, metrics = fusedkern.linear_grpo_loss(x, w, y, linear_bias=b, advantages=adv, old_logps=old, temperature=TAU,
                                            softcap=SOFTCAP, epsilon=0.2, epsilon_high=0.28)
    lp64, _ = reference.linear_logprobs_entropy_fp64(x.double(), w.double(), y, linear_bias=b.double(),
                                                     softcap=SOFTCAP, temperature=TAU)
    ratio = torch.exp(lp64 - old.double())
    low = (ratio < 0.8) & (adv[:, None] < 0) & mask
    high = (ratio > 1.28) & (adv[:, None] > 0) & mask
    assert metrics["clip_ratio/low_mean"].item() == pytest.approx(low.sum().item() / mask.sum().item())
    assert metrics["clip_ratio/high_mean"].item() == pytest.approx(high.sum().item() / mask.sum().item())
    assert metrics["clip_ratio/region_mean"].item() == pytest.approx((low | high).sum().item() / mask.sum().item())
    assert metrics["clip_ratio/low_min"].item() == pytest.approx((low.sum(-1) / counts).min().item())
    assert metrics["clip_ratio/high_max"].item() == pytest.approx((high.sum(-1) / counts).max().item())


def test_advantages_per_token_and_empty_sequence():
    """[B, T] advantages equal [B] ones broadcast; a sequence with no completion token contributes 0 and
    gets no gradient (its hidden states' gradient is 0)."""
    x, w, b, y, adv, old, _ = make_batch(torch.float32, seed=4)
    y[1] = -100
    results = []
    for a in (adv, adv[:, None].expand(B, S).contiguous()):
        leaves = _leaves((x, w, b))
        loss, _ = fusedkern.linear_grpo_loss(leaves[0], leaves[1], y, linear_bias=leaves[2], advantages=a,
                                             old_logps=old, loss_type="grpo")
        results.append((loss, *torch.autograd.grad(loss, leaves)))
    for a, e in zip(*results):
        torch.testing.assert_close(a, e, rtol=0, atol=0)
    assert torch.count_nonzero(results[0][1][1]) == 0 and torch.isfinite(results[0][0])


def test_bad_inputs_raise():
    x, w, b, y, adv, old, ref_lp = make_batch(torch.float32)
    call = lambda **kw: fusedkern.linear_grpo_loss(x, w, y, **{"advantages": adv, **kw})  # noqa: E731
    for bad in (0.0, -0.5):
        with pytest.raises(ValueError, match="temperature"):
            call(temperature=bad)
    with pytest.raises(ValueError, match="loss_type"):
        call(loss_type="ppo")
    with pytest.raises(ValueError, match="old_logps"):
        call(old_logps=old[:, :-1])
    with pytest.raises(ValueError, match="advantages"):
        call(advantages=adv[:-1])
    with pytest.raises(ValueError, match="advantages"):
        call(advantages=torch.zeros(B, S + 1))
    with pytest.raises(TypeError, match="advantages"):
        call(advantages=[1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="ref_logps"):
        call(beta=0.1)
    with pytest.raises(ValueError, match="ref_logps"):
        call(beta=0.1, ref_logps=ref_lp.reshape(-1))
    with pytest.raises(ValueError, match="max_completion_length"):
        call(loss_type="dr_grpo")
    with pytest.raises(ValueError, match="epsilon"):
        call(epsilon=-0.1)
    with pytest.raises(ValueError, match="target"):
        fusedkern.linear_grpo_loss(x.reshape(-1, H), w, y.reshape(-1), advantages=adv)
    with pytest.raises(ValueError, match="compute_entropy"):
        call(compute_entropy=True, impl="fused")
    bad = y.clone()
    bad[1, 1] = V + 3
    for leaves in (_leaves((x, w)), (x, w)):  # the three-GEMM path and the generic one check the targets
        with pytest.raises(ValueError, match=f"found {V + 3}"):
            fusedkern.linear_grpo_loss(*leaves, bad, advantages=adv)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the zero count's weights before it raises
def test_num_items_in_batch_is_never_clamped():
    """"dapo" divides the token sum by num_items_in_batch as given: zero, a negative or a non-finite count
    raises naming it (a Python number at once, a tensor after the kernels are queued, on both paths), and a
    positive count below 1 (TRL's normalizer over several processes) divides as it is."""
    x, w, b, y, adv, old, _ = make_batch(torch.float32, seed=5)
    call = lambda leaves, n: fusedkern.linear_grpo_loss(*leaves, y, advantages=adv, old_logps=old,  # noqa: E731
                                                        loss_type="dapo", num_items_in_batch=n)
    for leaves in (_leaves((x, w)), (x, w)):  # the three-GEMM path and the generic one
        for bad in (0, 0.0, -3, float("nan")):
            with pytest.raises(ValueError, match="num_items_in_batch must be"):
                call(leaves, bad)
        for bad in (torch.tensor(0), torch.tensor(-2.0), torch.tensor([float("inf")])):
            with pytest.raises(ValueError, match="num_items_in_batch must be > 0 and finite"):
                call(leaves, bad.to(DEVICE))
        with pytest.raises(TypeError, match="num_items_in_batch"):
            call(leaves, torch.tensor([1.0, 2.0], device=DEVICE))
        with pytest.raises(TypeError, match="num_items_in_batch"):
            call(leaves, "4")
        total, _ = call(leaves, 1)
        for n in (0.5, torch.tensor(0.5, device=DEVICE)):
            half, _ = call(leaves, n)
            torch.testing.assert_close(half, 2 * total, rtol=1e-6, atol=0)
    logps = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="num_items_in_batch"):
        grpo_loss_from_logps(logps, torch.ones(1, 2, dtype=torch.bool), advantages=torch.ones(1),
                             loss_type="dapo", num_items_in_batch=0)
