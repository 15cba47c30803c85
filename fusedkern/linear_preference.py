"""`linear_preference_loss`: TRL's preference losses (DPO sigmoid/ipo/hinge/robust, CPO, SimPO, ORPO, KTO) over
an LM head, without the [tokens, vocab] logits.

Built as the math factors: per-token target log-probs of every response token (the fused core), then
`fusedkern.preference.preference_loss_from_logps`, an O(R·S) tail. Two ways to differentiate it:

- three GEMMs (the default, impl "auto"/"chunked", when a logits chunk holds a whole chosen/rejected pair;
  for KTO one sequence): the chunk engine forms the gradient in the forward pass
  (`formula.grouped_tail_spec`). Every loss here allows it: a response's upstream gradient is a closed form of its
  own pair's (Σ log p, token count) and of constants (reference log-probs, the detached KTO KL, the NLL's N_w
  from the targets), so it is exact once the chunk holding the pair has its statistics.
- four GEMMs otherwise (impl="fused", a response longer than half a chunk, or reference log-probs that
  require grad): `linear_logprobs` (the forward's logits GEMM keeps only the log-sum-exp and
  the target logit), then autograd through the tail hands its backward one upstream gradient per token, and
  the backward recomputes the logits for dX and dW.
The three-GEMM path runs inside the custom operator `fusedkern::preference_chunked` (its options: the loss's
hyperparameters; its tensors: the reference log-probs, KTO's labels and KL), so torch.compile traces the same GEMMs.
`linear_simpo_loss` keeps its own three-GEMM SimPO formula (float64 log-probs, and a 3.5-GEMM prepass mode for
chunks holding one response, which this module does not have); loss_type="simpo" gives the same result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fusedkern import _validation as V_
from fusedkern.sharded import full_weights
from fusedkern._validation import finish_checks, start_checks
from fusedkern.engine import LossOptions
from fusedkern.formula import grouped_plan, grouped_tail_spec, run_formula
from fusedkern.autograd import CHECKING_OP_TAGS, GradOptions, define_op, follows_autocast, grads_formed_in_forward
from fusedkern.dispatch import formula_on_anchored, forms_grads_in_forward
from fusedkern.logprobs import logprobs_unchecked
from fusedkern.preference import DEFAULT_BETA, DEFAULT_GAMMA, check_preference_args, preference_loss_from_logps


@dataclass(frozen=True)
class PreferenceOptions:
    """`preference_chunked`'s options: the loss's hyperparameters (`preference.preference_loss_from_logps`; alpha
    resolved by `check_preference_args`), the logits' options and the gradients (`GradOptions`)."""

    loss_type: str
    beta: float
    reference_free: bool
    desirable_weight: float
    undesirable_weight: float
    label_smoothing: float
    gamma: float
    alpha: float
    ignore_index: int
    softcap: float | None
    grads: GradOptions

    @property
    def paired(self) -> bool:
        """A chosen/rejected pair couples two rows (a chunk holds whole pairs); KTO's loss couples one sequence."""
        return self.loss_type != "kto"

    def loss_kwargs(self, ref_chosen_logps, ref_rejected_logps, ref_logps, kto_labels, kl) -> dict:
        return dict(loss_type=self.loss_type, beta=self.beta, ref_chosen_logps=ref_chosen_logps,
                    ref_rejected_logps=ref_rejected_logps, reference_free=self.reference_free, ref_logps=ref_logps,
                    kto_labels=kto_labels, kl=kl, desirable_weight=self.desirable_weight,
                    undesirable_weight=self.undesirable_weight, label_smoothing=self.label_smoothing,
                    gamma=self.gamma, alpha=self.alpha)


def _grouped_plan(x: torch.Tensor, w: torch.Tensor, o: PreferenceOptions):
    n_rows, seq, _ = x.shape
    g = o.grads
    return grouped_plan(n_rows, seq, o.paired, w, g.need_dw, g.weight_grad_accum, g.chunk_tokens)


def _preference_chunked(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, target: torch.Tensor,
                        ref_chosen_logps: torch.Tensor | None, ref_rejected_logps: torch.Tensor | None,
                        ref_logps: torch.Tensor | None, kto_labels: torch.Tensor | None, kl: torch.Tensor | None,
                        o: PreferenceOptions
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The preference loss as a formula over the engine (`formula.grouped_tail_spec`): chunks of whole pairs (KTO:
    sequences), the gradient formed in the forward pass. x [R, S, H] · w [V, H] · b [V] | None · target [R, S] and
    the loss's per-sequence tensors (None where its loss type takes none). Returns (loss 0-d fp32, logp [R, S]
    fp32, dx [R·S, H], dw, db, dw_out as `linear_cross_entropy.ce_chunked_scalar` returns them)."""
    checks = start_checks(target, w.shape[0], o.ignore_index, None, None, -1)
    n_rows, seq, hidden = x.shape
    mask = target != o.ignore_index
    kw = o.loss_kwargs(ref_chosen_logps, ref_rejected_logps, ref_logps, kto_labels, kl)
    per_chunk, grad_plan = _grouped_plan(x, w, o)
    spec = grouped_tail_spec(n_rows, seq, o.paired, per_chunk, grad_plan,
                             lambda lp: preference_loss_from_logps(lp, mask, **kw)[0])
    loss, logp, _, grads = run_formula(x.reshape(-1, hidden), w, b, target.reshape(-1).contiguous(),
                                       LossOptions(ignore_index=o.ignore_index, softcap=o.softcap), spec,
                                       need_dx=o.grads.need_dx, need_dw=o.grads.need_dw, need_db=o.grads.need_db)
    finish_checks(checks)
    return (loss, logp.view(n_rows, seq), *o.grads.outputs(x, w, *grads.as_tuple()))


def _fake_preference_chunked(x, w, b, target, ref_chosen_logps, ref_rejected_logps, ref_logps, kto_labels, kl,
                             o: PreferenceOptions):
    n_rows, seq, _ = x.shape
    fp32_accumulator = _grouped_plan(x, w, o)[1].fp32_accumulator
    return (x.new_empty((), dtype=torch.float32), x.new_empty((n_rows, seq), dtype=torch.float32),
            *o.grads.fake_outputs(x, w, n_rows * seq, fp32_accumulator, o.grads.need_db and b is not None))


preference_chunked = define_op(
    "fusedkern::preference_chunked",
    ["x", "w", "b?", "target", "ref_chosen_logps?", "ref_rejected_logps?", "ref_logps?", "kto_labels?", "kl?"],
    PreferenceOptions, 6, _preference_chunked, _fake_preference_chunked,
    *grads_formed_in_forward("linear_preference_loss (chunked)"), tags=CHECKING_OP_TAGS)


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
    resolved_alpha = check_preference_args(
        input.shape[0], input.device, loss_type=loss_type, beta=beta, gamma=gamma, alpha=alpha,
        label_smoothing=label_smoothing, reference_free=reference_free, ref_chosen_logps=ref_chosen_logps,
        ref_rejected_logps=ref_rejected_logps, ref_logps=ref_logps, kto_labels=kto_labels, kl=kl,
        desirable_weight=desirable_weight, undesirable_weight=undesirable_weight)
    V_.validate_call(input, linear_weight, target, linear_bias, ignore_index=ignore_index, softcap=softcap, impl=impl,
                  weight_grad_accum=weight_grad_accum, chunk_tokens=chunk_tokens)
    grads = GradOptions.asked(input, linear_weight, linear_bias, weight_grad_accum, chunk_tokens)
    kw = dict(loss_type=loss_type, beta=beta, ref_chosen_logps=ref_chosen_logps, ref_rejected_logps=ref_rejected_logps,
              reference_free=reference_free, ref_logps=ref_logps, kto_labels=kto_labels, kl=kl,
              desirable_weight=desirable_weight, undesirable_weight=undesirable_weight,
              label_smoothing=label_smoothing, gamma=gamma, alpha=alpha)
    mask = target != ignore_index
    refs_frozen = not any(t is not None and t.requires_grad for t in (ref_chosen_logps, ref_rejected_logps, ref_logps))
    # three GEMMs (gradient formed in the forward pass, eager and compiled alike) where a chunk holds a whole pair
    # (KTO: a sequence)
    if grads.wanted and refs_frozen and input.numel() and \
            forms_grads_in_forward(impl, input.reshape(-1, input.shape[-1]), linear_weight, weight_grad_accum,
                                   chunk_tokens) and \
            not formula_on_anchored(impl, input, linear_weight, linear_bias, softcap=softcap):
        o = PreferenceOptions(
            loss_type, float(beta), reference_free, float(desirable_weight), float(undesirable_weight),
            float(label_smoothing), float(gamma), resolved_alpha, ignore_index,
            None if softcap is None else float(softcap), grads)
        if _grouped_plan(input, linear_weight, o)[0] > 0:
            loss, logps, *_ = preference_chunked(input, linear_weight, linear_bias, target, ref_chosen_logps,
                                                 ref_rejected_logps, ref_logps, kto_labels, kl, o)
            return loss, preference_loss_from_logps(logps, mask, **kw)[1]
    logps = logprobs_unchecked(input, linear_weight, target, linear_bias=linear_bias, ignore_index=ignore_index,
                               softcap=softcap, impl=impl, chunk_tokens=chunk_tokens,
                               weight_grad_accum=weight_grad_accum)  # [R, S] float32, 0 where ignored
    return preference_loss_from_logps(logps, mask, **kw)

