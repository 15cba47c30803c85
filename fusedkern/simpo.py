"""SimPO / CPO-SimPO preference loss over an LM head, without the logits.

Built the way the math suggests: `linear_logprobs` (the fused primitive) gives per-token target
log-probabilities of the [2B, S] batch; everything after that is an O(B·S) function in plain PyTorch
(`simpo_loss_from_logps`), whose autograd hands the fused backward one upstream gradient per token:
chosen token g = −β·σ(−z_i)/(B·n_w,i) − α/N_w, rejected token g = +β·σ(−z_i)/(B·n_l,i) (ε = 0).
That generic path costs four GEMMs (logits recomputed in backward). With the chunked strategy and
responses that fit a chunk, `fusedkern/simpo_chunked.py` forms the same gradient in the forward pass
(three GEMMs when a chunk holds a whole pair, 3.5 otherwise).
Semantics follow TRL's CPOTrainer with loss_type="simpo" (docs/design.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fusedkern import _validation as V_
from fusedkern.chunked import LossOptions
from fusedkern.linear_cross_entropy import follows_autocast, resolve_impl, validate_call, validate_strategy
from fusedkern.logprobs import logprobs_unchecked
from fusedkern.simpo_chunked import ChunkedSimPO, plan_for

# TRL's CPOTrainer / Liger defaults. The SimPO paper's released configs instead use β in 2–10,
# γ = β·(0.25–0.8) and α = 0 (pure SimPO).
DEFAULT_BETA, DEFAULT_GAMMA, DEFAULT_ALPHA = 0.1, 0.5, 1.0


def simpo_loss_from_logps(logps: torch.Tensor, mask: torch.Tensor, *, beta: float = DEFAULT_BETA,
                          gamma: float = DEFAULT_GAMMA, alpha: float = DEFAULT_ALPHA,
                          label_smoothing: float = 0.0):
    """SimPO loss and TRL's metrics from per-token log-probabilities.

    logps [2B, S] (0 where masked) · mask [2B, S] bool (True = response token). Rows 0..B−1 chosen,
    B..2B−1 rejected. A response with no token has average log-prob 0 (documented choice: the pair
    stays finite and only its other response receives a gradient; public implementations give NaN).
    Returns (loss 0-d, metrics dict of detached 0-d tensors).
    """
    B = logps.shape[0] // 2
    n_tokens = mask.sum(-1)  # [2B]
    sum_logps = (logps * mask).sum(-1)  # [2B]
    avg_logps = sum_logps / n_tokens.clamp(min=1)
    chosen, rejected = avg_logps[:B], avg_logps[B:]
    z = beta * (chosen - rejected) - gamma  # [B]
    pair_losses = -(1.0 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)
    nll = -sum_logps[:B].sum() / n_tokens[:B].sum().clamp(min=1)
    loss = pair_losses.mean() + alpha * nll
    rewards_chosen, rewards_rejected = (beta * chosen).detach(), (beta * rejected).detach()
    metrics = {
        "rewards/chosen": rewards_chosen.mean(),
        "rewards/rejected": rewards_rejected.mean(),
        "rewards/margins": (rewards_chosen - rewards_rejected).mean(),
        "rewards/accuracies": (rewards_chosen > rewards_rejected).float().mean(),
        "logps/chosen": chosen.detach().mean(),
        "logps/rejected": rejected.detach().mean(),
        "nll_loss": nll.detach(),
    }
    return loss, metrics


def _validate_hyperparameters(beta, gamma, alpha, label_smoothing):
    V_.check_real("beta", beta, low=0.0, low_inclusive=False)
    V_.check_real("gamma", gamma)
    V_.check_real("alpha", alpha, low=0.0)
    V_.check_real("label_smoothing", label_smoothing, low=0.0, high=0.5)


def _validate_simpo(input, target, beta, gamma, alpha, label_smoothing):
    V_.check_tensor("input", input, ndim=3, dtypes=V_.FLOAT_DTYPES)
    if input.shape[0] % 2:
        raise ValueError(f"input must be [2B, S, H] with the B chosen rows first and the B rejected rows "
                         f"second; got an odd first dimension {input.shape[0]}")
    _validate_hyperparameters(beta, gamma, alpha, label_smoothing)


@torch.compiler.disable
@follows_autocast
def linear_simpo_loss(input: torch.Tensor, linear_weight: torch.Tensor, target: torch.Tensor, *,
                      linear_bias: torch.Tensor | None = None, beta: float = DEFAULT_BETA,
                      gamma: float = DEFAULT_GAMMA, alpha: float = DEFAULT_ALPHA, label_smoothing: float = 0.0,
                      ignore_index: int = -100, impl: str = "auto", weight_grad_accum: str = "fp32",
                      chunk_tokens: int | None = None):
    """CPO-SimPO loss of an LM head: L = mean_i[−(1−ε)logσ(z_i) − ε·logσ(−z_i)] + α·NLL_chosen,
    z_i = β(A_w,i − A_l,i) − γ, A = length-normalized log-probability of the response.

    input [2B, S, H] (chosen rows first) · linear_weight [V, H] · target [2B, S] (already shifted;
    prompt and padding tokens = ignore_index). β > 0, γ, α ≥ 0 (α = 0: pure SimPO), ε ∈ [0, 0.5].
    Returns (loss, metrics) with TRL's metric names (rewards/chosen, rewards/rejected,
    rewards/margins, rewards/accuracies, logps/chosen, logps/rejected, nll_loss).
    """
    _validate_simpo(input, target, beta, gamma, alpha, label_smoothing)
    hp = dict(beta=float(beta), gamma=float(gamma), alpha=float(alpha), label_smoothing=float(label_smoothing))
    wants_grad = torch.is_grad_enabled() and (
        input.requires_grad or linear_weight.requires_grad or (linear_bias is not None and linear_bias.requires_grad))
    # validated once for every path; the range check is read after the kernels are queued
    target_range = validate_call(input, linear_weight, target, linear_bias, ignore_index=ignore_index, impl=impl,
                                 weight_grad_accum=weight_grad_accum, chunk_tokens=chunk_tokens)
    if wants_grad and impl != "fused":
        two_b, seq, _ = input.shape
        plan = plan_for(two_b, seq, linear_weight, linear_weight.requires_grad, weight_grad_accum, chunk_tokens)
        if resolve_impl(impl, input.reshape(-1, input.shape[-1]), linear_weight, weight_grad_accum) == "chunked" \
                and plan[0] != "generic":
            # three (or 3.5) GEMMs: the gradient is formed in the forward pass (fusedkern/simpo_chunked.py)
            def loss_fn(logp, mask):
                return simpo_loss_from_logps(logp, mask, **hp)[0]
            opts = LossOptions(ignore_index=ignore_index)
            loss, logps = ChunkedSimPO.apply(input, linear_weight, linear_bias, target, opts, hp,
                                             weight_grad_accum, plan, loss_fn)
            _, metrics = simpo_loss_from_logps(logps, target != ignore_index, **hp)
            target_range.raise_if_failed()
            return loss, metrics
    logps = logprobs_unchecked(input, linear_weight, target, linear_bias=linear_bias, ignore_index=ignore_index,
                               softcap=None, impl=impl, chunk_tokens=chunk_tokens, weight_grad_accum=weight_grad_accum)
    result = simpo_loss_from_logps(logps, target != ignore_index, beta=beta, gamma=gamma, alpha=alpha,
                                   label_smoothing=label_smoothing)
    target_range.raise_if_failed()
    return result


class LinearSimPOLoss(nn.Module):
    """`nn.Module` form of `linear_simpo_loss`.

    Example:
        >>> loss_fn = LinearSimPOLoss(beta=2.0, gamma=1.0, alpha=0.0)     # the paper's style of config
        >>> loss, metrics = loss_fn(hidden_states, lm_head.weight, labels)  # [2B, S, H], [V, H], [2B, S]
    """

    def __init__(self, *, beta: float = DEFAULT_BETA, gamma: float = DEFAULT_GAMMA, alpha: float = DEFAULT_ALPHA,
                 label_smoothing: float = 0.0, ignore_index: int = -100, impl: str = "auto",
                 weight_grad_accum: str = "fp32", chunk_tokens: int | None = None):
        super().__init__()
        # bad settings fail here, where the loss is configured, not at the first training step
        _validate_hyperparameters(beta, gamma, alpha, label_smoothing)
        V_.check_int("ignore_index", ignore_index)
        validate_strategy(impl, weight_grad_accum, chunk_tokens)
        self.beta, self.gamma, self.alpha, self.label_smoothing = beta, gamma, alpha, label_smoothing
        self.ignore_index, self.impl, self.weight_grad_accum, self.chunk_tokens = ignore_index, impl, weight_grad_accum, chunk_tokens

    def forward(self, input, linear_weight, target, linear_bias=None):
        return linear_simpo_loss(input, linear_weight, target, linear_bias=linear_bias, beta=self.beta,
                                 gamma=self.gamma, alpha=self.alpha, label_smoothing=self.label_smoothing,
                                 ignore_index=self.ignore_index, impl=self.impl,
                                 weight_grad_accum=self.weight_grad_accum, chunk_tokens=self.chunk_tokens)

    def extra_repr(self) -> str:
        return f"beta={self.beta}, gamma={self.gamma}, alpha={self.alpha}, label_smoothing={self.label_smoothing}"
