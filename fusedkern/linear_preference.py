"""`linear_preference_loss`: TRL's preference losses (DPO sigmoid/ipo/hinge/robust, CPO, SimPO, ORPO, KTO) over
an LM head, without the [tokens, vocab] logits.

Built as the math factors: per-token target log-probs of every response token (the fused core), then
`fusedkern.preference.preference_loss_from_logps`, an O(R·S) tail. Two ways to differentiate it:

- three GEMMs (the default, impl "auto"/"chunked", when a logits chunk holds a whole chosen/rejected pair;
  for KTO one sequence): the chunk engine forms the gradient in the forward pass
  (`formula.grouped_tail_spec`). Every loss here allows it: a response's upstream gradient is a closed form of its
  own pair's (Σ log p, token count) and of constants (reference log-probs, the detached KTO KL, the NLL's N_w
  from the targets), so it is exact once the chunk holding the pair has its statistics.
- four GEMMs otherwise (impl="fused", a response longer than half a chunk, reference log-probs that require
  grad, or under torch.compile): `linear_logprobs` (the forward's logits GEMM keeps only the log-sum-exp and
  the target logit), then autograd through the tail hands its backward one upstream gradient per token, and
  the backward recomputes the logits for dX and dW.
`linear_simpo_loss` keeps its own three-GEMM SimPO formula (float64 log-probs, and a 3.5-GEMM prepass mode for
chunks holding one response, which this module does not have); loss_type="simpo" gives the same result.
"""

from __future__ import annotations

import torch

from fusedkern import _validation as V_
from fusedkern.sharded import full_weights
from fusedkern.engine import LossOptions
from fusedkern.formula import formula_loss, grouped_plan, grouped_tail_spec
from fusedkern.autograd import follows_autocast, is_traced
from fusedkern.dispatch import forms_grads_in_forward
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
    # no pair (or no token) is allowed: the mean over no pair is NaN, as torch's mean of nothing
    V_.check_tensor("input", input, ndim=3, dtypes=V_.FLOAT_DTYPES,
                    allow_empty=isinstance(input, torch.Tensor) and input.shape[-1:] != (0,))
    # the preference arguments fail before any GEMM runs
    check_preference_args(input.shape[0], input.device, loss_type=loss_type, beta=beta, gamma=gamma, alpha=alpha,
                          label_smoothing=label_smoothing, reference_free=reference_free,
                          ref_chosen_logps=ref_chosen_logps, ref_rejected_logps=ref_rejected_logps,
                          ref_logps=ref_logps, kto_labels=kto_labels, kl=kl, desirable_weight=desirable_weight,
                          undesirable_weight=undesirable_weight)
    V_.validate_call(input, linear_weight, target, linear_bias, ignore_index=ignore_index, softcap=softcap, impl=impl,
                  weight_grad_accum=weight_grad_accum, chunk_tokens=chunk_tokens)
    grad = torch.is_grad_enabled()
    need = (grad and input.requires_grad, grad and linear_weight.requires_grad,
            grad and linear_bias is not None and linear_bias.requires_grad)
    kw = dict(loss_type=loss_type, beta=beta, ref_chosen_logps=ref_chosen_logps, ref_rejected_logps=ref_rejected_logps,
              reference_free=reference_free, ref_logps=ref_logps, kto_labels=kto_labels, kl=kl,
              desirable_weight=desirable_weight, undesirable_weight=undesirable_weight,
              label_smoothing=label_smoothing, gamma=gamma, alpha=alpha)
    mask = target != ignore_index
    refs_frozen = not any(t is not None and t.requires_grad for t in (ref_chosen_logps, ref_rejected_logps, ref_logps))
    # three GEMMs (gradient formed in the forward pass) where a chunk holds a whole pair (KTO: a sequence);
    # torch.compile traces the generic path, whose operators it knows
    if any(need) and refs_frozen and input.numel() and not is_traced(input, linear_weight) and \
            forms_grads_in_forward(impl, input.reshape(-1, input.shape[-1]), linear_weight, weight_grad_accum,
                                   chunk_tokens):
        paired = loss_type != "kto"
        n_rows, seq, hidden = input.shape
        per_chunk, grad_plan = grouped_plan(n_rows, seq, paired, linear_weight, need[1], weight_grad_accum,
                                             chunk_tokens)
        if per_chunk > 0:
            opts = LossOptions(ignore_index=ignore_index, softcap=None if softcap is None else float(softcap))
            spec = grouped_tail_spec(n_rows, seq, paired, per_chunk, grad_plan,
                                     lambda lp: preference_loss_from_logps(lp, mask, **kw)[0],
                                     "linear_preference_loss (chunked)")
            loss, logps, _ = formula_loss(input.reshape(-1, hidden), linear_weight, linear_bias,
                                          target.reshape(-1).contiguous(), opts, spec)
            return loss, preference_loss_from_logps(logps.view(n_rows, seq), mask, **kw)[1]
    logps = logprobs_unchecked(input, linear_weight, target, linear_bias=linear_bias, ignore_index=ignore_index,
                               softcap=softcap, impl=impl, chunk_tokens=chunk_tokens,
                               weight_grad_accum=weight_grad_accum)  # [R, S] float32, 0 where ignored
    return preference_loss_from_logps(logps, mask, **kw)

