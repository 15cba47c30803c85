import math

import pytest
import torch
import torch.nn.functional as F

from fusedkern.preference import PAIR_LOSS_TYPES, preference_loss_from_logps
from fusedkern.simpo import simpo_loss_from_logps


def _batch(B=3, S=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(2 * B, S, generator=g, dtype=torch.float64) * 2
    mask = torch.rand(2 * B, S, generator=g) > 0.3
    mask[:, 0] = True
    ref = -torch.rand(2, B, generator=g, dtype=torch.float64) * 5
    return logps * mask, mask, ref[0], ref[1]


def test_sigmoid_matches_dpo_formula_by_hand():
    logps, mask, rc, rr = _batch()
    B = 3
    loss, m = preference_loss_from_logps(logps, mask, loss_type="sigmoid", beta=0.2,
                                         ref_chosen_logps=rc, ref_rejected_logps=rr)
    s = logps.sum(-1)
    expect = sum(-math.log(1 / (1 + math.exp(-0.2 * ((s[i] - s[B + i]) - (rc[i] - rr[i])).item())))
                 for i in range(B)) / B
    assert loss.item() == pytest.approx(expect, rel=1e-12)
    assert m["rewards/chosen"].item() == pytest.approx((0.2 * (s[:B] - rc)).mean().item(), rel=1e-12)


def test_simpo_matches_existing_simpo_loss():
    logps, mask, _, _ = _batch()
    a, ma = preference_loss_from_logps(logps, mask, loss_type="simpo", beta=2.0, gamma=1.0, alpha=0.5)
    b, mb = simpo_loss_from_logps(logps, mask, beta=2.0, gamma=1.0, alpha=0.5)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=0)
    for k in mb:
        torch.testing.assert_close(ma[k], mb[k], rtol=1e-12, atol=0)


def test_orpo_log_odds_by_hand():
    logps, mask, _, _ = _batch()
    loss, m = preference_loss_from_logps(logps, mask, loss_type="orpo", beta=0.1)
    avg = logps.sum(-1) / mask.sum(-1)
    c, r = avg[:3], avg[3:]
    lo = (c - r) - (torch.log(1 - c.exp()) - torch.log(1 - r.exp()))
    nll = -logps[:3].sum() / mask[:3].sum()
    torch.testing.assert_close(loss, nll - 0.1 * F.logsigmoid(lo).mean(), rtol=1e-12, atol=0)
    torch.testing.assert_close(m["log_odds_chosen"], lo.mean(), rtol=1e-12, atol=0)


@pytest.mark.parametrize("loss_type", PAIR_LOSS_TYPES)
def test_gradient_reaches_only_response_tokens(loss_type):
    logps, mask, rc, rr = _batch(seed=1)
    logps = logps.clone().requires_grad_()
    loss, _ = preference_loss_from_logps(logps, mask, loss_type=loss_type, beta=0.5,
                                         ref_chosen_logps=rc, ref_rejected_logps=rr, alpha=0.3)
    (g,) = torch.autograd.grad(loss, logps)
    assert torch.isfinite(loss)
    assert (g[~mask] == 0).all() and (g[mask] != 0).any()


def test_bad_inputs():
    logps, mask, rc, rr = _batch()
    with pytest.raises(ValueError, match="loss_type"):
        preference_loss_from_logps(logps, mask, loss_type="dpo")
    with pytest.raises(ValueError, match="ref_chosen_logps"):
        preference_loss_from_logps(logps, mask, loss_type="sigmoid", ref_chosen_logps=rc[:2], ref_rejected_logps=rr)
    with pytest.raises(ValueError, match=r"\[2B, S\]"):
        preference_loss_from_logps(logps[:5], mask[:5], loss_type="cpo")
