"""Preference losses (TRL's DPO-family, ORPO, SimPO, CPO) as functions of per-token log-probabilities.

Every pair loss here depends on a pair only through (sum log-prob, token count) of its chosen and its
rejected response, so `preference_loss_from_logps` is the per-pair function that the fused LM-head
paths differentiate: autograd over [B]-sized tensors gives dL/d(sum logp) per response without any
host synchronization. The fused entry point (`linear_preference_loss`) is not built yet.
"""
import torch
import torch.nn.functional as F

PAIR_LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust", "orpo", "simpo", "cpo")
# Losses whose TRL implementation uses the average (not summed) log-prob of a response.
AVERAGED = frozenset({"ipo", "orpo", "simpo"})
NEEDS_REFERENCE = frozenset({"sigmoid", "ipo", "hinge", "robust"})


def preference_loss_from_logps(logps: torch.Tensor, mask: torch.Tensor, *, loss_type: str, beta: float = 0.1,
                               ref_chosen_logps: torch.Tensor | None = None,
                               ref_rejected_logps: torch.Tensor | None = None,
                               label_smoothing: float = 0.0, gamma: float = 0.5, alpha: float = 0.0):
    """Loss and TRL's metrics from logps [2B, S] (chosen rows first) and mask [2B, S] bool.

    A response with no token has sum 0 and average 0 (finite; only the other response gets a gradient).
    ref_*_logps [B] are summed reference log-probs (TRL's reference model); IPO averages both policy
    and reference by the response's token count. alpha adds alpha · (chosen NLL per token); ORPO
    always adds the NLL with weight 1.
    """
    if loss_type not in PAIR_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {PAIR_LOSS_TYPES}, got {loss_type!r}")
    if logps.dim() != 2 or logps.shape[0] % 2:
        raise ValueError(f"logps must be [2B, S] (chosen rows, then rejected), got shape {tuple(logps.shape)}")
    B = logps.shape[0] // 2
    counts = mask.sum(-1)
    sums = (logps * mask).sum(-1)
    logp = sums / counts.clamp(min=1) if loss_type in AVERAGED else sums
    chosen, rejected = logp[:B], logp[B:]
    if loss_type in NEEDS_REFERENCE:
        for name, ref in (("ref_chosen_logps", ref_chosen_logps), ("ref_rejected_logps", ref_rejected_logps)):
            if ref is None or tuple(ref.shape) != (B,):
                raise ValueError(f"{name} must be a [B] = [{B}] tensor for loss_type={loss_type!r}, got "
                                 f"{None if ref is None else tuple(ref.shape)}")
        ref_c, ref_r = ref_chosen_logps.to(logp.dtype), ref_rejected_logps.to(logp.dtype)
        if loss_type == "ipo":
            ref_c, ref_r = ref_c / counts[:B].clamp(min=1), ref_r / counts[B:].clamp(min=1)
        logits = (chosen - rejected) - (ref_c - ref_r)
        if loss_type == "sigmoid":
            losses = (-F.logsigmoid(beta * logits) * (1 - label_smoothing)
                      - F.logsigmoid(-beta * logits) * label_smoothing)
        elif loss_type == "robust":
            losses = ((-F.logsigmoid(beta * logits) * (1 - label_smoothing)
                       + F.logsigmoid(-beta * logits) * label_smoothing) / (1 - 2 * label_smoothing))
        elif loss_type == "hinge":
            losses = torch.relu(1 - beta * logits)
        else:
            losses = (logits - 1 / (2 * beta)) ** 2
        rewards_c, rewards_r = beta * (chosen - ref_c).detach(), beta * (rejected - ref_r).detach()
    else:
        rewards_c, rewards_r = (beta * chosen).detach(), (beta * rejected).detach()
    nll = -sums[:B].sum() / counts[:B].sum().clamp(min=1)
    metrics = {}
    if loss_type == "orpo":
        # ORPO: log odds of the average log-probs; TRL's odds_ratio_loss returns beta·logsigmoid(log_odds).
        log_odds = (chosen - rejected) - (torch.log1p(-torch.exp(chosen)) - torch.log1p(-torch.exp(rejected)))
        losses = -beta * F.logsigmoid(log_odds)
        metrics["log_odds_ratio"] = F.logsigmoid(log_odds).detach().mean()
        metrics["log_odds_chosen"] = log_odds.detach().mean()
    elif loss_type in ("simpo", "cpo"):
        z = beta * (chosen - rejected) - (gamma if loss_type == "simpo" else 0.0)
        losses = -F.logsigmoid(z) * (1 - label_smoothing) - F.logsigmoid(-z) * label_smoothing
    # ORPO's loss is NLL + odds-ratio term by definition (TRL: policy_nll_loss - losses.mean()).
    loss = losses.mean() + (1.0 if loss_type == "orpo" else alpha) * nll
    metrics.update({
        "rewards/chosen": rewards_c.mean(), "rewards/rejected": rewards_r.mean(),
        "rewards/margins": (rewards_c - rewards_r).mean(),
        "rewards/accuracies": (rewards_c > rewards_r).float().mean(),
        "logps/chosen": chosen.detach().mean(), "logps/rejected": rejected.detach().mean(),
        "nll_loss": nll.detach(),
    })
    return loss, metrics
