"""`linear_preference_loss`: TRL's preference losses (DPO sigmoid/ipo/hinge/robust, CPO, SimPO, ORPO, KTO) over
an LM head, without the [tokens, vocab] logits.

Built as the math factors: `linear_logprobs` (the fused per-token core) gives the target log-probs of every
response token; `fusedkern.preference.preference_loss_from_logps` is an O(R·S) tail whose autograd hands the
core one upstream gradient per token. Cost: four GEMMs — the forward's logits GEMM (log-sum-exp and target
logit only), then in backward the logits recomputed, dX and dW — against `linear_simpo_loss`'s three, which
forms the gradient in the forward pass. Every loss here could get that three-GEMM form: each response's
upstream gradient is a closed form of its pair's (Σ log p, token count) per response (plus the reference
log-probs, and for KTO its own sequence's and the detached KL), so a chunk holding whole pairs (whole
sequences for KTO) can form ∂L/∂z before its logits leave; the NLL term's 1/N_w needs only the targets.
Not built yet: with loss_type="simpo" this path costs four GEMMs, `linear_simpo_loss` three (same result).
"""

from __future__ import annotations

import torch

from fusedkern import _validation as V_
from fusedkern.integrations.fsdp import full_weights
from fusedkern.linear_cross_entropy import follows_autocast, validate_call
from fusedkern.logprobs import logprobs_unchecked
from fusedkern.preference import DEFAULT_BETA, DEFAULT_GAMMA, check_preference_args, preference_loss_from_logps


@follows_autocast
def linear_preference_loss(input: torch.Tensor, linear_weight: torch.Tensor, target: torch.Tensor, *,
                           loss_type: str, beta: float = DEFAULT_BETA,
                           ref_chosen_logps: torch.Tensor | None = None,
                           ref_rejected_logps: torch.Tensor | None = None, reference_free: bool = False,
                           ref_logps: torch.Tensor | None = None, kto_labels: torch.Tensor | None = None,
                           kl: torch.Tensor | None = None, desirable_weight: float = 1.0,
                           undesirable_weight: float = 1.0, label_smoothing: float = 0.0,
                           gamma: float = DEFAULT_GAMMA, alpha: float | None = None,
                           linear_bias: torch.Tensor | None = None, ignore_index: int = -100,
                           softcap: float | None = None, impl: str = "auto", weight_grad_accum: str = "fp32",
                           chunk_tokens: int | None = None):
    """A preference loss of `input @ linear_weightᵀ (+ linear_bias)` with TRL's semantics → (loss, metrics).

    input [R, S, H] (fp32/fp16/bf16) · linear_weight [V, H] · target [R, S] (already shifted; prompt and
    padding = ignore_index). Pair losses (`loss_type` "sigmoid" = DPO, "ipo", "hinge", "robust", "cpo",
    "simpo", "orpo"): R = 2B, rows 0..B−1 chosen, B..2B−1 rejected; the DPO types take ref_chosen_logps and
    ref_rejected_logps [B] (summed reference log-probs) unless reference_free. "kto": R = N unpaired sequences,
    kto_labels [N] bool (True = desirable), ref_logps [N], kl a one-element tensor (the caller's estimate from
    mismatched completions; detached, clamped ≥ 0). alpha: weight of the chosen-token NLL (None: 1 for cpo,
    simpo, orpo; 0 otherwise). softcap: z → c·tanh(z/c) before the softmax. Returns (loss 0-d float32,
    metrics: dict of detached 0-d tensors under TRL's names). Formulas: `fusedkern.preference`.
    """
    linear_weight, linear_bias, _ = full_weights(input, linear_weight, target, linear_bias)  # DTensors gathered
    V_.check_tensor("input", input, ndim=3, dtypes=V_.FLOAT_DTYPES)
    # the preference arguments fail before any GEMM runs
    check_preference_args(input.shape[0], input.device, loss_type=loss_type, beta=beta, gamma=gamma, alpha=alpha,
                          label_smoothing=label_smoothing, reference_free=reference_free,
                          ref_chosen_logps=ref_chosen_logps, ref_rejected_logps=ref_rejected_logps,
                          ref_logps=ref_logps, kto_labels=kto_labels, kl=kl, desirable_weight=desirable_weight,
                          undesirable_weight=undesirable_weight)
    validate_call(input, linear_weight, target, linear_bias, ignore_index=ignore_index, softcap=softcap, impl=impl,
                  weight_grad_accum=weight_grad_accum, chunk_tokens=chunk_tokens)
    logps = logprobs_unchecked(input, linear_weight, target, linear_bias=linear_bias, ignore_index=ignore_index,
                               softcap=softcap, impl=impl, chunk_tokens=chunk_tokens,
                               weight_grad_accum=weight_grad_accum)  # [R, S] float32, 0 where ignored
    return preference_loss_from_logps(
        logps, target != ignore_index, loss_type=loss_type, beta=beta, ref_chosen_logps=ref_chosen_logps,
        ref_rejected_logps=ref_rejected_logps, reference_free=reference_free, ref_logps=ref_logps,
        kto_labels=kto_labels, kl=kl, desirable_weight=desirable_weight, undesirable_weight=undesirable_weight,
        label_smoothing=label_smoothing, gamma=gamma, alpha=alpha)
