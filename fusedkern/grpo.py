"""GRPO's clipped policy-gradient loss over an LM head, without the logits (TRL GRPOTrainer semantics).

Built on `linear_logprobs` (per-token log-probs at the sampling temperature, optionally the entropy):
everything after it is an O(B·T) function in plain PyTorch (`grpo_loss_from_logps`), whose autograd hands
the fused backward one upstream gradient per token. Cost: four GEMMs for forward + backward — the logits
GEMM in the forward, then the recomputed logits, dX and dW in the backward — because the generic backward
only learns ∂L/∂logp_t after the forward has returned. A three-GEMM form exists: with token-level
importance sampling ∂L/∂logp_t is a function of that token's own logp_t (its ratio exp(logp_t − old_t),
clip bounds, advantage, reference log-prob and the loss type's normaliser, all known before the pass),
so the row kernel could write ∂L/∂z in place right after the row's statistics, as the chunked SimPO does
with its pair-level weights; not built yet.
"""

from __future__ import annotations

import torch

from fusedkern import _validation as V_
from fusedkern.integrations.fsdp import full_weights
from fusedkern.linear_cross_entropy import follows_autocast, validate_call
from fusedkern.logprobs import logprobs_unchecked, validate_logprobs_options

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
# TRL GRPOConfig's defaults: epsilon 0.2 (epsilon_high None = epsilon), beta 0.0, loss_type "dapo", temperature 1.0
DEFAULT_EPSILON, DEFAULT_BETA, DEFAULT_LOSS_TYPE = 0.2, 0.0, "dapo"
CLIP_METRIC_KEYS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
                    "clip_ratio/high_max")


def grpo_loss_from_logps(logps: torch.Tensor, mask: torch.Tensor, *, advantages: torch.Tensor,
                         old_logps: torch.Tensor | None = None, ref_logps: torch.Tensor | None = None,
                         beta: float = DEFAULT_BETA, epsilon: float = DEFAULT_EPSILON,
                         epsilon_high: float | None = None, loss_type: str = DEFAULT_LOSS_TYPE,
                         max_completion_length: int | None = None,
                         num_items_in_batch: float | torch.Tensor | None = None,
                         entropy: torch.Tensor | None = None):
    """GRPO loss and TRL's metrics from per-token log-probabilities (token-level importance sampling).

    logps [B, T] fp32 (0 where masked) · mask [B, T] bool (completion tokens) · advantages [B] or [B, T].
    r = exp(logp − old_logp) (old_logps None: on-policy, old = logp.detach(), r = 1 with r's gradient);
    per-token loss −min(r·A, clip(r, 1 − ε, 1 + ε_high)·A), plus β·k3 with k3 = exp(ref − logp) − (ref − logp) − 1
    when β ≠ 0. Reduction by loss_type: "grpo" mean over sequences of each sequence's token mean; "bnpo" token
    mean over the batch; "dapo" token sum / num_items_in_batch (TRL: the active tokens of the whole accumulated
    batch; default here: this batch's); "dr_grpo" token sum / (B·max_completion_length).
    Returns (loss 0-d, metrics: detached 0-d tensors named as TRL logs them — "kl" when β ≠ 0, "entropy" when
    `entropy` [B, T] is given, and the clip ratios).
    """
    eps_high = epsilon if epsilon_high is None else epsilon_high
    adv = (advantages.unsqueeze(1) if advantages.dim() == 1 else advantages).float()
    old = logps.detach() if old_logps is None else old_logps.float()
    m = mask.to(logps.dtype)
    n_tokens = m.sum()
    ratio = torch.exp(logps - old)
    per_token = -torch.min(ratio * adv, torch.clamp(ratio, 1 - epsilon, 1 + eps_high) * adv)
    if beta != 0.0:
        log_ref_ratio = ref_logps.float() - logps
        per_token_kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1
        per_token = per_token + beta * per_token_kl
    token_sum = (per_token * m).sum()
    if loss_type == "grpo":
        loss = ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = token_sum / n_tokens.clamp(min=1.0)
    elif loss_type == "dapo":
        count = n_tokens if num_items_in_batch is None else torch.as_tensor(num_items_in_batch, dtype=m.dtype,
                                                                             device=m.device)
        loss = token_sum / count.clamp(min=1.0)
    else:  # "dr_grpo"
        loss = token_sum / (logps.shape[0] * max_completion_length)

    def masked_mean(t):
        return ((t * m).sum() / n_tokens.clamp(min=1.0)).detach()

    with torch.no_grad():
        metrics = {}
        if beta != 0.0:
            metrics["kl"] = masked_mean(per_token_kl)
        if entropy is not None:
            metrics["entropy"] = masked_mean(entropy)
        low = ((ratio < 1 - epsilon) & (adv < 0)).to(m.dtype)
        high = ((ratio > 1 + eps_high) & (adv > 0)).to(m.dtype)
        metrics["clip_ratio/low_mean"] = masked_mean(low)
        metrics["clip_ratio/high_mean"] = masked_mean(high)
        metrics["clip_ratio/region_mean"] = masked_mean(torch.maximum(low, high))
        # per-sequence means; TRL's nanmin / nanmax skip the sequences with no token (NaN when all are empty)
        per_seq = m.sum(-1)
        has = per_seq > 0
        nan = torch.full_like(per_seq, float("nan"))
        low_seq = torch.where(has, (low * m).sum(-1) / per_seq.clamp(min=1.0), nan)
        high_seq = torch.where(has, (high * m).sum(-1) / per_seq.clamp(min=1.0), nan)
        inf = torch.full_like(per_seq, float("inf"))
        low_min = torch.where(has, low_seq, inf).min()
        high_max = torch.where(has, high_seq, -inf).max()
        metrics["clip_ratio/low_min"] = torch.where(has.any(), low_min, nan[0])
        metrics["clip_ratio/high_max"] = torch.where(has.any(), high_max, nan[0])
    return loss, metrics


def _check_per_token(name: str, t, shape, *, allow_rows: bool = False) -> None:
    """A float tensor of the completions' shape [B, T] (or [B] where `allow_rows`)."""
    V_.check_tensor(name, t, dtypes=(torch.float32, torch.float16, torch.bfloat16, torch.float64))
    shapes = (tuple(shape), (shape[0],)) if allow_rows else (tuple(shape),)
    if tuple(t.shape) not in shapes:
        raise ValueError(f"{name} must have shape {' or '.join(str(list(s)) for s in shapes)} (target's [B, T]), "
                         f"got {list(t.shape)}")


def validate_grpo_options(target, *, advantages, old_logps, ref_logps, beta, epsilon, epsilon_high, loss_type,
                          max_completion_length, num_items_in_batch) -> None:
    V_.check_choice("loss_type", loss_type, LOSS_TYPES)
    V_.check_real("beta", beta, low=0.0)
    V_.check_real("epsilon", epsilon, low=0.0)
    if epsilon_high is not None:
        V_.check_real("epsilon_high", epsilon_high, low=0.0)
    if target.dim() != 2:
        raise ValueError(f"target must be [B, T] (one row of completion tokens per sequence), got shape "
                         f"{list(target.shape)}")
    _check_per_token("advantages", advantages, target.shape, allow_rows=True)
    if old_logps is not None:
        _check_per_token("old_logps", old_logps, target.shape)
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("ref_logps ([B, T] reference-model log-probs) is required when beta != 0")
        _check_per_token("ref_logps", ref_logps, target.shape)
    if loss_type == "dr_grpo" and (max_completion_length is None
                                   or V_.check_int("max_completion_length", max_completion_length) <= 0):
        raise ValueError(f"loss_type='dr_grpo' divides by max_completion_length: pass a positive int, got "
                         f"{max_completion_length}")
    if num_items_in_batch is not None and not isinstance(num_items_in_batch, torch.Tensor):
        V_.check_real("num_items_in_batch", num_items_in_batch, low=0.0)
    tensors = dict(advantages=advantages, old_logps=old_logps, ref_logps=ref_logps)
    if isinstance(num_items_in_batch, torch.Tensor):
        tensors["num_items_in_batch"] = num_items_in_batch
    V_.check_same_device("target", target, **tensors)


@follows_autocast
def linear_grpo_loss(input: torch.Tensor, linear_weight: torch.Tensor, target: torch.Tensor, *,
                     advantages: torch.Tensor, old_logps: torch.Tensor | None = None,
                     ref_logps: torch.Tensor | None = None, beta: float = DEFAULT_BETA,
                     epsilon: float = DEFAULT_EPSILON, epsilon_high: float | None = None,
                     loss_type: str = DEFAULT_LOSS_TYPE, max_completion_length: int | None = None,
                     num_items_in_batch: float | torch.Tensor | None = None, temperature: float = 1.0,
                     compute_entropy: bool = False, linear_bias: torch.Tensor | None = None,
                     ignore_index: int = -100, softcap: float | None = None, impl: str = "auto",
                     chunk_tokens: int | None = None, weight_grad_accum: str = "fp32"):
    """TRL GRPOTrainer's loss of an LM head's completions, without the [B·T, V] logits.

    input [B, T, H] (fp32/fp16/bf16: the policy's hidden states at the completion positions, already shifted
    so that input[b, t] predicts target[b, t]) · linear_weight [V, H] · target [B, T] completion token ids,
    `ignore_index` where TRL's completion_mask is 0. advantages [B] (or [B, T]); old_logps [B, T] (None:
    on-policy, TRL's case num_iterations = 1); ref_logps [B, T] when beta ≠ 0. The policy's log-probs are
    taken at `temperature` (TRL divides the logits by the sampling temperature; softcap before it). Options
    and defaults are TRL's GRPOConfig names: epsilon (ε_low), epsilon_high (None = epsilon), beta,
    loss_type in "grpo" / "bnpo" / "dr_grpo" / "dapo", max_completion_length (dr_grpo), num_items_in_batch
    (dapo; TRL passes the accumulated batch's active-token count, divided by the number of processes).
    compute_entropy: also log "entropy" (the masked mean of each token's entropy at that temperature;
    chunked strategy, no extra GEMM).
    Returns (loss 0-d fp32, metrics dict of detached 0-d tensors, see `grpo_loss_from_logps`). Four GEMMs in
    forward + backward (this module's header says why). A sequence with no completion token adds 0.
    """
    linear_weight, linear_bias, _ = full_weights(input, linear_weight, target, linear_bias)  # DTensors gathered
    validate_call(input, linear_weight, target, linear_bias, ignore_index=ignore_index, softcap=softcap, impl=impl,
                  weight_grad_accum=weight_grad_accum, chunk_tokens=chunk_tokens)
    validate_logprobs_options(temperature, compute_entropy, impl, entropy_name="compute_entropy")
    validate_grpo_options(target, advantages=advantages, old_logps=old_logps, ref_logps=ref_logps, beta=beta,
                          epsilon=epsilon, epsilon_high=epsilon_high, loss_type=loss_type,
                          max_completion_length=max_completion_length, num_items_in_batch=num_items_in_batch)
    out = logprobs_unchecked(input, linear_weight, target, linear_bias=linear_bias, ignore_index=ignore_index,
                             softcap=softcap, impl=impl, chunk_tokens=chunk_tokens,
                             weight_grad_accum=weight_grad_accum, temperature=temperature,
                             return_entropy=compute_entropy)
    logps, entropy = out if compute_entropy else (out, None)
    return grpo_loss_from_logps(logps, target != ignore_index, advantages=advantages, old_logps=old_logps,
                                ref_logps=ref_logps, beta=beta, epsilon=epsilon, epsilon_high=epsilon_high,
                                loss_type=loss_type, max_completion_length=max_completion_length,
                                num_items_in_batch=num_items_in_batch,
                                entropy=None if entropy is None else entropy.detach())
