"""Preference losses (TRL's DPO family, CPO, SimPO, ORPO, KTO) as functions of per-token log-probabilities.

Every loss here depends on a response only through (sum of its target log-probs, its token count), so
`preference_loss_from_logps` is the O(B·S) tail that the fused LM-head path (`fusedkern.linear_preference`)
differentiates: autograd over [2B]-sized tensors hands the fused backward one upstream gradient per token,
with no host synchronization. Formulas written from the papers and checked against TRL (the stored
snapshot v1.9.0+26, and v0.20.0 where TRL changed), one line each:

- sigmoid (DPO): −logσ(β·Δ), Δ = (S_w − S_w^ref) − (S_l − S_l^ref) on summed log-probs — DPOTrainer._compute_loss.
  label_smoothing ε gives the conservative form −(1−ε)logσ(βΔ) − ε·logσ(−βΔ) of TRL ≤ 0.2x's dpo_loss (TRL v1
  dropped ε for "sigmoid"; ε = 0, the default, is the same loss in both).
- robust: (−(1−ε)logσ(βΔ) + ε·logσ(−βΔ)) / (1 − 2ε), ε ∈ [0, 0.5) — DPOTrainer._compute_loss, same in v0.20 dpo_loss.
- hinge: relu(1 − βΔ) — DPOTrainer._compute_loss.
- ipo: (Δ_avg − 1/(2β))², each log-ratio (policy − reference, both summed) divided by its response's token
  count — DPOTrainer._compute_loss (v0.20 averaged policy and reference log-probs: the same Δ_avg).
- DPO metrics: rewards/chosen = β·(S_w − S_w^ref) (summed, for IPO too, as TRL v1 logs them; v0.20 logged the
  averages for IPO), rewards/rejected, rewards/margins, rewards/accuracies (chosen > rejected), logps/chosen
  and logps/rejected = summed log-probs — DPOTrainer._compute_loss. Its entropy, logits/* and
  mean_token_accuracy need the logits, which the fused path never forms: not computed.
- reference_free=True: the reference log-ratio is 0 (TRL ≤ 0.2x DPOConfig.reference_free); sigmoid, hinge and
  ipo then are CPOTrainer.cpo_loss's loss types of those names (ipo on averaged log-probs, as
  CPOTrainer.concatenated_forward averages for ipo), with CPO's metrics: rewards = β·logps.
- cpo: CPOTrainer's "sigmoid", −(1−ε)logσ(β(S_w − S_l)) − ε·logσ(−β(S_w − S_l)) + α·NLL, α = cpo_alpha = 1.0 by
  default — CPOTrainer.cpo_loss / get_batch_loss_metrics; CPOConfig defaults β = 0.1, ε = 0, cpo_alpha = 1.0.
- simpo: z = β(A_w − A_l) − γ on averaged log-probs A (TRL: logits − γ/β inside logσ(β·)), smoothing as cpo,
  + α·NLL, γ = simpo_gamma = 0.5, α = 1.0 — CPOTrainer.cpo_loss with loss_type "simpo"; rewards = β·A.
- NLL (cpo, simpo, orpo, and any type with α > 0, RPO-style as TRL v0.20's rpo_alpha or TRL v1's "sft" loss
  weight): token mean of −log p over the chosen responses' targets — CPOTrainer.concatenated_forward's
  cross_entropy_loss. ORPOTrainer.concatenated_forward takes its NLL over prompt and response tokens alike:
  here it covers the tokens the target does not ignore, so pass the prompt's targets to match TRL there (the
  odds term then sees them too).
- orpo: log_odds = (A_w − A_l) − (log(1 − e^A_w) − log(1 − e^A_l)) (stable log1mexp), loss =
  NLL − β·mean(logσ(log_odds)); metrics log_odds_ratio = mean logσ(log_odds), log_odds_chosen = mean log_odds,
  rewards = β·A — ORPOTrainer.odds_ratio_loss / get_batch_loss_metrics; ORPOConfig β = 0.1.
- kto: per sequence, desirable: w_d·(1 − σ(β(r − z0))), undesirable: w_u·(1 − σ(β(z0 − r))), r = S − S^ref
  (summed), z0 = the caller's KL estimate detached and clamped ≥ 0, loss = mean over all sequences; metrics kl,
  rewards/chosen|rejected (mean β·r per group), logps/chosen|rejected (mean S per group), rewards/margins —
  KTOTrainer._compute_loss; KTOConfig β = 0.1, desirable_weight = undesirable_weight = 1.0.
- CPO's AlphaPO transform (CPOConfig.alpha) and the DPO types beyond these four (exo_pair, nca_pair, bco_pair,
  sppo_hard, aot, apo_*, discopop, sigmoid_norm), ld_alpha, f-divergences and WPO weighting are not provided.

Documented choices where TRL returns NaN: a response with no token has sum 0 and average 0 (finite; for the
pair losses only its partner gets a gradient); an ORPO pair with an empty response contributes 0 to the
odds-ratio term and its metrics (log(1 − e⁰) = −∞ otherwise); an empty chosen half gives NLL 0; a KTO batch
with no desirable (undesirable) sequence gives NaN for that group's metric means (TRL leaves them out) and a
finite loss.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from fusedkern import _validation as V_

PAIR_LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust", "orpo", "simpo", "cpo")
LOSS_TYPES = PAIR_LOSS_TYPES + ("kto",)
DPO_LOSS_TYPES = frozenset({"sigmoid", "ipo", "hinge", "robust"})  # take reference log-probs
# TRL's defaults (DPOConfig, CPOConfig, ORPOConfig, KTOConfig: beta 0.1; CPOConfig simpo_gamma 0.5, cpo_alpha 1.0)
DEFAULT_BETA, DEFAULT_GAMMA = 0.1, 0.5
# the NLL weight when alpha is None: the trainers that always add the NLL (CPO, SimPO via CPO, ORPO) use 1
DEFAULT_ALPHA = {"cpo": 1.0, "simpo": 1.0, "orpo": 1.0}


def check_preference_args(n_rows: int, device: torch.device, *, loss_type: str, beta, gamma, alpha,
                          label_smoothing, reference_free, ref_chosen_logps, ref_rejected_logps, ref_logps,
                          kto_labels, kl, desirable_weight, undesirable_weight) -> float:
    """Every check of the preference arguments that needs only shapes, dtypes and Python values (no host sync).
    n_rows: the number of sequences (2B for the pair losses, N for KTO). Returns the NLL weight alpha resolves to."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    V_.check_real("beta", beta, low=0.0, low_inclusive=False)
    V_.check_real("gamma", gamma)
    if not isinstance(reference_free, bool):
        raise TypeError(f"reference_free must be a bool, got {type(reference_free).__name__}")
    if loss_type == "robust":  # the 1/(1 − 2ε) factor
        V_.check_real("label_smoothing", label_smoothing, low=0.0, high=0.5, high_inclusive=False)
    else:
        V_.check_real("label_smoothing", label_smoothing, low=0.0, high=0.5)
    unused = {}
    if loss_type == "kto":
        if alpha not in (None, 0, 0.0):
            raise ValueError(f"alpha (the NLL weight) is not part of the KTO loss; got alpha={alpha}")
        V_.check_real("desirable_weight", desirable_weight, low=0.0)
        V_.check_real("undesirable_weight", undesirable_weight, low=0.0)
        if reference_free:
            raise ValueError("reference_free applies to the DPO loss types, not to loss_type='kto'")
        _check_per_sequence("ref_logps", ref_logps, n_rows, device, loss_type)
        if not isinstance(kto_labels, torch.Tensor):
            raise TypeError(f"kto_labels must be a bool tensor of shape [N] = [{n_rows}] (True = desirable) for "
                            f"loss_type='kto', got {type(kto_labels).__name__}")
        if kto_labels.dtype != torch.bool:
            raise TypeError(f"kto_labels must have dtype bool (True = desirable), got {kto_labels.dtype}")
        if tuple(kto_labels.shape) != (n_rows,):
            raise ValueError(f"kto_labels must have one label per sequence, shape [N] = [{n_rows}], got "
                             f"{tuple(kto_labels.shape)}")
        _check_device("kto_labels", kto_labels, device)
        if not isinstance(kl, torch.Tensor):
            raise TypeError("kl must be a one-element float tensor for loss_type='kto' (TRL: the mean over mismatched "
                            f"completions of policy − reference log-probs), got {type(kl).__name__}")
        if kl.numel() != 1 or not kl.is_floating_point():
            raise ValueError(f"kl must be a one-element float tensor, got {kl.dtype} of shape {tuple(kl.shape)}")
        _check_device("kl", kl, device)
        unused = {"ref_chosen_logps": ref_chosen_logps, "ref_rejected_logps": ref_rejected_logps}
        alpha = 0.0
    else:
        if n_rows % 2:
            raise ValueError(f"loss_type={loss_type!r} needs [2B, ...] rows (the B chosen responses, then the B "
                             f"rejected ones); got an odd number of rows {n_rows}")
        alpha = DEFAULT_ALPHA.get(loss_type, 0.0) if alpha is None else V_.check_real("alpha", alpha, low=0.0)
        if reference_free and loss_type not in DPO_LOSS_TYPES:
            raise ValueError(f"reference_free applies to {sorted(DPO_LOSS_TYPES)}; loss_type={loss_type!r} "
                             "uses no reference model anyway")
        if loss_type in DPO_LOSS_TYPES and not reference_free:
            _check_per_sequence("ref_chosen_logps", ref_chosen_logps, n_rows // 2, device, loss_type)
            _check_per_sequence("ref_rejected_logps", ref_rejected_logps, n_rows // 2, device, loss_type)
        else:
            unused = {"ref_chosen_logps": ref_chosen_logps, "ref_rejected_logps": ref_rejected_logps}
        unused.update(ref_logps=ref_logps, kto_labels=kto_labels, kl=kl)
    for name, value in unused.items():
        if value is not None:  # a reference passed to a loss that ignores it is a mistake, not a no-op
            why = "reference_free=True" if reference_free else f"loss_type={loss_type!r}"
            raise ValueError(f"{name} is not used with {why}; pass None")
    return float(alpha)


def _check_per_sequence(name, value, n, device, loss_type):
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a float tensor of shape [{n}] (summed reference log-probs, one per "
                        f"sequence) for loss_type={loss_type!r}, got {type(value).__name__}")
    if not value.is_floating_point():
        raise TypeError(f"{name} must be a float tensor, got {value.dtype}")
    if tuple(value.shape) != (n,):
        raise ValueError(f"{name} must have shape [{n}] (one summed reference log-prob per sequence) for "
                         f"loss_type={loss_type!r}, got {tuple(value.shape)}")
    _check_device(name, value, device)


def _check_device(name, value, device):
    if value.device != torch.device(device):
        raise ValueError(f"{name} must be on the log-probs' device ({device}), got {value.device}")


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 − eˣ) for x ≤ 0 without cancellation: log(−expm1 x) near 0, log1p(−eˣ) below −ln 2."""
    return torch.where(x < -math.log(2.0), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def preference_loss_from_logps(logps: torch.Tensor, mask: torch.Tensor, *, loss_type: str,
                               beta: float = DEFAULT_BETA, ref_chosen_logps: torch.Tensor | None = None,
                               ref_rejected_logps: torch.Tensor | None = None, reference_free: bool = False,
                               ref_logps: torch.Tensor | None = None, kto_labels: torch.Tensor | None = None,
                               kl: torch.Tensor | None = None, desirable_weight: float = 1.0,
                               undesirable_weight: float = 1.0, label_smoothing: float = 0.0,
                               gamma: float = DEFAULT_GAMMA, alpha: float | None = None):
    """Loss (0-d) and TRL's metrics (dict of detached 0-d tensors) from per-token log-probs.

    logps [R, S] float, mask [R, S] bool (True = response token; logps there are used, elsewhere ignored).
    Pair losses: R = 2B, rows 0..B−1 chosen, B..2B−1 rejected, paired by index; ref_*_logps [B] are summed
    reference log-probs (DPO types unless reference_free). KTO: R = N sequences, kto_labels [N] bool
    (True = desirable), ref_logps [N] summed reference log-probs, kl a one-element tensor (detached, clamped
    ≥ 0 here). alpha: NLL weight; None = the trainer's default (1 for cpo, simpo, orpo; 0 otherwise).
    The formulas, defaults and metric names, with the TRL function each was checked against: module docstring.
    """
    V_.check_tensor("logps", logps, ndim=2, dtypes=V_.FLOAT_DTYPES + (torch.float64,), allow_empty=True)
    V_.check_tensor("mask", mask, ndim=2, dtypes=(torch.bool,), allow_empty=True)
    if mask.shape != logps.shape:
        raise ValueError(f"mask must have logps' shape {tuple(logps.shape)}, got {tuple(mask.shape)}")
    alpha = check_preference_args(
        logps.shape[0], logps.device, loss_type=loss_type, beta=beta, gamma=gamma, alpha=alpha,
        label_smoothing=label_smoothing, reference_free=reference_free, ref_chosen_logps=ref_chosen_logps,
        ref_rejected_logps=ref_rejected_logps, ref_logps=ref_logps, kto_labels=kto_labels, kl=kl,
        desirable_weight=desirable_weight, undesirable_weight=undesirable_weight)
    # Computed in float64 (O(R·S)), as simpo_loss_from_logps: β·(sums or averages) carries the rounding of every
    # fp32 sum of S log-probabilities into each gradient of the pair, β-fold; the per-token upstream gradient
    # autograd hands the fused backward is rounded to logps' dtype once, by the cast below.
    out_dtype, logps = logps.dtype, logps.double()
    counts = mask.sum(-1).to(logps.dtype)  # [R] response lengths
    sums = torch.where(mask, logps, torch.zeros_like(logps)).sum(-1)  # [R]
    if loss_type == "kto":
        loss, metrics = _kto(sums, ref_logps.to(logps.dtype), kto_labels, kl, beta, desirable_weight,
                             undesirable_weight)
        return loss.to(out_dtype), {key: value.to(out_dtype) for key, value in metrics.items()}
    B = logps.shape[0] // 2
    avgs = sums / counts.clamp(min=1)  # [2B]: an empty response averages to 0
    n_chosen_tokens = counts[:B].sum()
    nll = (-sums[:B]).sum() / n_chosen_tokens.clamp(min=1)  # +0 over no token, as torch's sum of nothing
    eps = label_smoothing
    metrics = {}
    if loss_type in DPO_LOSS_TYPES:
        if reference_free:  # CPOTrainer's loss types: no reference, IPO on averages
            ref_c = ref_r = torch.zeros_like(sums[:B])
        else:
            ref_c, ref_r = ref_chosen_logps.to(logps.dtype), ref_rejected_logps.to(logps.dtype)
        ratio_c, ratio_r = sums[:B] - ref_c, sums[B:] - ref_r  # summed log-ratios [B]
        if loss_type == "ipo":
            delta = ratio_c / counts[:B].clamp(min=1) - ratio_r / counts[B:].clamp(min=1)
            losses = (delta - 1 / (2 * beta)) ** 2
        else:
            delta = ratio_c - ratio_r
            if loss_type == "sigmoid":
                losses = -(1 - eps) * F.logsigmoid(beta * delta) - eps * F.logsigmoid(-beta * delta)
            elif loss_type == "robust":
                losses = (-(1 - eps) * F.logsigmoid(beta * delta) + eps * F.logsigmoid(-beta * delta)) / (1 - 2 * eps)
            else:  # hinge
                losses = torch.relu(1 - beta * delta)
        if reference_free and loss_type == "ipo":
            shown_c, shown_r = avgs[:B], avgs[B:]
        else:
            shown_c, shown_r = sums[:B], sums[B:]
        rewards_c, rewards_r = beta * (shown_c - ref_c), beta * (shown_r - ref_r)
    elif loss_type == "cpo":
        z = beta * (sums[:B] - sums[B:])
        losses = -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
        shown_c, shown_r = sums[:B], sums[B:]
        rewards_c, rewards_r = beta * shown_c, beta * shown_r
    elif loss_type == "simpo":
        z = beta * (avgs[:B] - avgs[B:]) - gamma
        losses = -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
        shown_c, shown_r = avgs[:B], avgs[B:]
        rewards_c, rewards_r = beta * shown_c, beta * shown_r
    else:  # orpo
        both = (counts[:B] > 0) & (counts[B:] > 0)  # a pair with an empty response has no odds ratio
        c = torch.where(both, avgs[:B], torch.full_like(avgs[:B], -1.0))
        r = torch.where(both, avgs[B:], torch.full_like(avgs[B:], -1.0))
        zero = torch.zeros_like(c)
        log_odds = torch.where(both, (c - r) - (log1mexp(c) - log1mexp(r)), zero)
        ratio = torch.where(both, F.logsigmoid(log_odds), zero)
        losses = -beta * ratio
        metrics["log_odds_ratio"] = ratio.detach().mean()
        metrics["log_odds_chosen"] = log_odds.detach().mean()
        shown_c, shown_r = avgs[:B], avgs[B:]
        rewards_c, rewards_r = beta * shown_c, beta * shown_r
    loss = losses.mean() + alpha * nll if alpha else losses.mean()
    rewards_c, rewards_r = rewards_c.detach(), rewards_r.detach()
    metrics = {
        "rewards/chosen": rewards_c.mean(), "rewards/rejected": rewards_r.mean(),
        "rewards/margins": (rewards_c - rewards_r).mean(),
        "rewards/accuracies": (rewards_c > rewards_r).to(logps.dtype).mean(),
        "logps/chosen": shown_c.detach().mean(), "logps/rejected": shown_r.detach().mean(),
        "nll_loss": nll.detach(), **metrics,
    }
    return loss.to(out_dtype), {key: value.to(out_dtype) for key, value in metrics.items()}


def _kto(sums, ref, desirable, kl, beta, desirable_weight, undesirable_weight):
    """KTOTrainer._compute_loss on summed log-probs: sums, ref [N], desirable [N] bool, kl one element."""
    z0 = kl.detach().reshape(()).to(sums.dtype).clamp(min=0)
    ratio = sums - ref  # [N]
    # TRL writes 1 − σ(x); σ(−x) is the same value without the cancellation as σ(x) → 1
    losses = torch.where(desirable, desirable_weight * torch.sigmoid(-beta * (ratio - z0)),
                         undesirable_weight * torch.sigmoid(-beta * (z0 - ratio)))
    rewards = (beta * ratio).detach()
    d = desirable.to(sums.dtype)
    n_d, n_u = d.sum(), (1 - d).sum()  # a group with no sequence: 0/0 = NaN, TRL leaves its metric out

    def group_mean(values, weights, n):
        return (values * weights).sum() / n
    rewards_c, rewards_r = group_mean(rewards, d, n_d), group_mean(rewards, 1 - d, n_u)
    metrics = {
        "kl": z0, "rewards/chosen": rewards_c, "rewards/rejected": rewards_r,
        "rewards/margins": rewards_c - rewards_r,
        "logps/chosen": group_mean(sums.detach(), d, n_d), "logps/rejected": group_mean(sums.detach(), 1 - d, n_u),
    }
    return losses.mean(), metrics
