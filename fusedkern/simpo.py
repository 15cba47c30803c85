"""SimPO / CPO-SimPO preference loss over an LM head, without the logits.

Built the way the math suggests: `linear_logprobs` (the fused primitive) gives per-token target
log-probabilities of the [2B, S] batch; everything after that is an O(B·S) function in plain PyTorch
(`simpo_loss_from_logps`), whose autograd hands the fused backward one upstream gradient per token:
chosen token g = −β·σ(−z_i)/(B·n_w,i) − α/N_w, rejected token g = +β·σ(−z_i)/(B·n_l,i) (ε = 0).
That generic path costs four GEMMs (logits recomputed in backward). With the chunked strategy and
responses that fit a chunk, the chunk engine forms the same gradient in the forward pass (`simpo_spec`)
(three GEMMs when a chunk holds a whole pair, 3.5 otherwise: `plan_for`; with a softcap, the grouped tail of
`formula.py` over whole pairs), inside the custom operator `fusedkern::simpo_chunked` (traceable by torch.compile,
like the cross-entropy operators: compiled and eager run the same GEMMs).
Semantics follow TRL's CPOTrainer with loss_type="simpo" (docs/design.md).
"""

from __future__ import annotations

import functools
import logging
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fusedkern import _validation as V_
from fusedkern.chunk_plan import GradChunkPlan
from fusedkern.chunked import chunked_loss
from fusedkern.engine import Chunk, LossOptions, group_chunks, plan_for_grads
from fusedkern.formula import FormulaSpec, grouped_plan, grouped_tail_spec, run_formula
from fusedkern.sharded import full_weights
from fusedkern._validation import finish_checks, start_checks, validate_call, validate_strategy
from fusedkern.autograd import CHECKING_OP_TAGS, GradOptions, define_op, follows_autocast, grads_formed_in_forward
from fusedkern.dispatch import formula_on_anchored, forms_grads_in_forward
from fusedkern.logprobs import logprobs_unchecked

# TRL's CPOTrainer / Liger defaults. The SimPO paper's released configs instead use β in 2–10,
# γ = β·(0.25–0.8) and α = 0 (pure SimPO).
DEFAULT_BETA, DEFAULT_GAMMA, DEFAULT_ALPHA = 0.1, 0.5, 1.0
logger = logging.getLogger(__name__)


def simpo_loss_from_logps(logps: torch.Tensor, mask: torch.Tensor, *, beta: float = DEFAULT_BETA,
                          gamma: float = DEFAULT_GAMMA, alpha: float = DEFAULT_ALPHA,
                          label_smoothing: float = 0.0):
    """SimPO loss and TRL's metrics from per-token log-probabilities.

    logps [2B, S] (0 where masked) · mask [2B, S] bool (True = response token). Rows 0..B−1 chosen,
    B..2B−1 rejected. A response with no token has average log-prob 0 (documented choice: the pair
    stays finite and only its other response receives a gradient; public implementations give NaN).
    Returns (loss 0-d in logps' dtype, metrics dict of detached 0-d tensors in that dtype).

    Computed in float64 (O(B·S)): z = β(A_w − A_l) − γ carries every rounding of the averages into each gradient
    of the pair, β-fold (fp32 sums of S log-probabilities of size ~5 round by ~ulp(5·S) before the division by
    S); the per-token upstream gradient that autograd hands the fused backward is rounded to fp32 once.
    """
    out_dtype = logps.dtype
    logps = logps.double()
    B = logps.shape[0] // 2
    n_tokens = mask.sum(-1)  # [2B]
    sum_logps = (logps * mask).sum(-1)  # [2B]
    avg_logps = sum_logps / n_tokens.clamp(min=1)
    chosen, rejected = avg_logps[:B], avg_logps[B:]
    z = beta * (chosen - rejected) - gamma  # [B]
    pair_losses = -(1.0 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)
    nll = (-sum_logps[:B]).sum() / n_tokens[:B].sum().clamp(min=1)  # +0 over no token
    loss = pair_losses.mean() + alpha * nll
    rewards_chosen, rewards_rejected = (beta * chosen).detach(), (beta * rejected).detach()
    metrics = {
        "rewards/chosen": rewards_chosen.mean(),
        "rewards/rejected": rewards_rejected.mean(),
        "rewards/margins": (rewards_chosen - rewards_rejected).mean(),
        "rewards/accuracies": (rewards_chosen > rewards_rejected).double().mean(),
        "logps/chosen": chosen.detach().mean(),
        "logps/rejected": rejected.detach().mean(),
        "nll_loss": nll.detach(),
    }
    return loss.to(out_dtype), {key: value.to(out_dtype) for key, value in metrics.items()}


def _validate_hyperparameters(beta, gamma, alpha, label_smoothing):
    V_.check_real("beta", beta, low=0.0, low_inclusive=False)
    V_.check_real("gamma", gamma)
    V_.check_real("alpha", alpha, low=0.0)
    V_.check_real("label_smoothing", label_smoothing, low=0.0, high=0.5)


def _validate_simpo(input, target, beta, gamma, alpha, label_smoothing):
    # no pair (or no token) is allowed: the mean over no pair is NaN, as torch's mean of nothing
    V_.check_tensor("input", input, ndim=3, dtypes=V_.FLOAT_DTYPES,
                   allow_empty=isinstance(input, torch.Tensor) and input.shape[-1:] != (0,))
    if input.shape[0] % 2:
        raise ValueError(f"input must be [2B, S, H] with the B chosen rows first and the B rejected rows "
                         f"second; got an odd first dimension {input.shape[0]}")
    _validate_hyperparameters(beta, gamma, alpha, label_smoothing)


def plan_for(n_rows: int, seq: int, w: torch.Tensor, need_dw: bool, weight_grad_accum: str,
             chunk_tokens: int | None) -> tuple[str, int, GradChunkPlan]:
    """How the chunks hold SimPO's responses: (mode, pairs or responses per chunk, the chunk plan of
    `chunk_plan.grad_chunk_plan`).

    - "pairs": a chunk holds whole chosen/rejected pairs (2·S tokens ≤ C): three GEMMs in all.
    - "prepass": a chunk holds whole responses but not a pair: a loss-only pass over the rejected half first gives
      every A_l (half a GEMM's work), then chunks of chosen responses, then of rejected ones (their partners' A_w
      now known): 3.5 GEMMs.
    - "generic": a response longer than a chunk: the four-GEMM path (logits recomputed in backward)."""
    grad_plan = plan_for_grads(n_rows * seq, w, need_dw, weight_grad_accum, chunk_tokens)
    C = grad_plan.chunk_tokens
    if C >= 2 * seq:
        return "pairs", max(1, min(C // (2 * seq), n_rows // 2)), grad_plan
    if C >= seq:
        return "prepass", C // seq, grad_plan
    return "generic", 0, grad_plan


def _upstream_per_token(a_self, a_partner, n_self, n_chosen_total, *, chosen: bool, beta, gamma, alpha,
                        label_smoothing, n_pairs):
    """g_t = ∂L/∂ℓ_t (ℓ = −log p) for the tokens of k responses. a_* [k] float64, n_self [k] → [k, 1] float64
    (broadcast over S). With dL/dz_i = [−(1−ε)σ(−z_i) + εσ(z_i)]/B: chosen tokens get −β·dL/dz_i / n_w,i + α/N_w,
    rejected tokens +β·dL/dz_i / n_l,i."""
    a_w, a_l = (a_self, a_partner) if chosen else (a_partner, a_self)
    z = beta * (a_w - a_l) - gamma
    dl_dz = (-(1.0 - label_smoothing) * torch.sigmoid(-z) + label_smoothing * torch.sigmoid(z)) / n_pairs
    dl_da_self = beta * dl_dz if chosen else -beta * dl_dz
    g = -dl_da_self / n_self.clamp(min=1)
    if chosen:
        g = g + alpha / n_chosen_total.clamp(min=1)
    return g[:, None]


def simpo_spec(target: torch.Tensor, ignore_index: int, plan: tuple, hp: dict, loss_fn,
               rejected_logps=None) -> FormulaSpec:
    """SimPO as a formula over the engine (`formula.FormulaSpec`), for target [2B, S] and `plan_for`'s plan.

    Log-probs in float64 (`engine.logprobs_fp64`): z_i = β(A_w − A_l) − γ, so at β = 10 the fp32 rounding of each
    log-probability would move every gradient of the pair by ~β·ulp relative. rejected_logps(): the prepass's
    per-token log-probs of the rejected half [B·S] (mode "prepass" only)."""
    mode, per_chunk, grad_plan = plan
    two_b, seq = target.shape
    n_pairs = two_b // 2
    mask = target != ignore_index
    n_tokens = mask.sum(-1)  # [2B]
    n_chosen_total = n_tokens[:n_pairs].sum()
    upstream = functools.partial(_upstream_per_token, n_chosen_total=n_chosen_total, n_pairs=n_pairs,
                                 **hp)

    def mean_logp(logp, r0, r1):  # A of responses r0..r1−1
        return logp.view(two_b, seq)[r0:r1].sum(-1) / n_tokens[r0:r1].clamp(min=1)

    if mode == "pairs":
        chunks = group_chunks(n_pairs, per_chunk, seq, paired=True)

        def formula(chunk, logp):
            i0, i1 = chunk.blocks[0].start // seq, chunk.blocks[0].stop // seq
            a_w, a_l = mean_logp(logp, i0, i1), mean_logp(logp, n_pairs + i0, n_pairs + i1)
            g_w = upstream(a_w, a_l, n_tokens[i0:i1], chosen=True)
            g_l = upstream(a_l, a_w, n_tokens[n_pairs + i0:n_pairs + i1], chosen=False)
            return -torch.cat([g_w, g_l]).expand(-1, seq).reshape(-1)  # ∂L/∂log p = −∂L/∂ℓ
    else:  # "prepass": chosen chunks first (partners from the prepass), then rejected ones
        a_rejected = (rejected_logps().double().view(n_pairs, seq).sum(-1)
                      / n_tokens[n_pairs:].clamp(min=1))
        chunks = [Chunk(i, (slice(r0 * seq, min(r0 + per_chunk, end) * seq),))
                  for i, (r0, end) in enumerate((r, e) for s0, e in ((0, n_pairs), (n_pairs, two_b))
                                                for r in range(s0, e, per_chunk))]

        def formula(chunk, logp):
            r0, r1 = chunk.blocks[0].start // seq, chunk.blocks[0].stop // seq
            chosen = r0 < n_pairs
            i0, i1 = (r0, r1) if chosen else (r0 - n_pairs, r1 - n_pairs)
            partner = a_rejected[i0:i1] if chosen else mean_logp(logp, i0, i1)
            g = upstream(mean_logp(logp, r0, r1), partner, n_tokens[r0:r1], chosen=chosen)
            return -g.expand(-1, seq).reshape(-1)

    return FormulaSpec(formula, lambda logp, _: loss_fn(logp.view(two_b, seq), mask), chunks,
                       grad_plan, logp_dtype=torch.float64)


@dataclass(frozen=True)
class SimPOOptions:
    """`simpo_chunked`'s options: SimPO's hyperparameters, the softcap (None: `simpo_spec`'s float64 formula in
    `plan_for`'s modes; a softcap: the grouped-tail formula over whole pairs) and the gradients (`GradOptions`)."""

    ignore_index: int
    beta: float
    gamma: float
    alpha: float
    label_smoothing: float
    softcap: float | None
    grads: GradOptions

    @property
    def hyperparameters(self) -> dict:
        return dict(beta=self.beta, gamma=self.gamma, alpha=self.alpha, label_smoothing=self.label_smoothing)


def _simpo_chunked(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, target: torch.Tensor, o: SimPOOptions
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """SimPO over chunks of whole responses with the gradient formed in the forward pass (a formula over the
    engine: `simpo_spec`, or with a softcap the grouped tail of `formula.grouped_tail_spec` on float32 log-probs).

    x [2B, S, H] · w [V, H] · b [V] | None · target [2B, S]. Returns (loss 0-d fp32, logp [2B, S] fp32,
    dx [2B·S, H], dw, db, dw_out as `linear_cross_entropy.ce_chunked_scalar` returns them)."""
    checks = start_checks(target, w.shape[0], o.ignore_index, None, None, -1)
    two_b, seq, hidden = x.shape
    hp = o.hyperparameters
    opts = LossOptions(ignore_index=o.ignore_index, softcap=o.softcap)
    x2d, y = x.reshape(-1, hidden), target.reshape(-1).contiguous()  # the kernels index target[row] with no stride
    mask = target != o.ignore_index
    g = o.grads
    if o.softcap is None:
        plan = plan_for(two_b, seq, w, g.need_dw, g.weight_grad_accum, g.chunk_tokens)

        def rejected_logps():  # the prepass: a loss-only pass over the rejected half; its fp32 −ℓ_t
            rejected = slice(two_b // 2 * seq, two_b * seq)
            return -chunked_loss(x2d[rejected], w, b, y[rejected], None, opts)[0]

        spec = simpo_spec(target, o.ignore_index, plan, hp,
                          lambda logp, mask: simpo_loss_from_logps(logp, mask, **hp)[0], rejected_logps)
    else:
        per_chunk, grad_plan = grouped_plan(two_b, seq, True, w, g.need_dw, g.weight_grad_accum, g.chunk_tokens)
        spec = grouped_tail_spec(two_b, seq, True, per_chunk, grad_plan,
                                 lambda lp: simpo_loss_from_logps(lp, mask, **hp)[0])
    # the loss from the log-probabilities (float64 without a softcap), rounded once
    loss, logp, _, grads = run_formula(x2d, w, b, y, opts, spec, need_dx=g.need_dx, need_dw=g.need_dw,
                                       need_db=g.need_db)
    finish_checks(checks)
    return (loss, logp.view(two_b, seq).float(), *g.outputs(x, w, *grads.as_tuple()))


def _fake_simpo_chunked(x, w, b, target, o: SimPOOptions):
    two_b, seq, _ = x.shape
    g = o.grads
    fp32_accumulator = plan_for(two_b, seq, w, g.need_dw, g.weight_grad_accum, g.chunk_tokens)[2].fp32_accumulator
    return (x.new_empty((), dtype=torch.float32), x.new_empty((two_b, seq), dtype=torch.float32),
            *g.fake_outputs(x, w, two_b * seq, fp32_accumulator, g.need_db and b is not None))


simpo_chunked = define_op(
    "fusedkern::simpo_chunked", ["x", "w", "b?", "target"], SimPOOptions, 6, _simpo_chunked, _fake_simpo_chunked,
    *grads_formed_in_forward(lambda o: "linear_simpo_loss (chunked)" if o.softcap is None
                             else "linear_simpo_loss (chunked, softcap)"),
    tags=CHECKING_OP_TAGS)


def _warn_four_gemms(seq: int, plan_tokens: int, chunk_tokens: int | None) -> None:
    """A response longer than a chunk: the gradient cannot be formed in the forward pass, and the generic
    path recomputes the logits in backward (four GEMMs instead of three). Said once per call site when the
    user's chunk_tokens causes it (a warning: the setting does not do what it was likely meant to), logged
    when the default chunk is too short."""
    if torch.compiler.is_compiling():  # dynamo cannot trace warnings.warn (a graph break under fullgraph=True)
        return
    message = (f"linear_simpo_loss: a response of {seq} tokens does not fit a chunk of {plan_tokens} tokens, so the "
               "gradient takes the generic four-GEMM path (logits recomputed in backward) instead of three GEMMs")
    if chunk_tokens is not None:
        warnings.warn(f"{message}; chunk_tokens={chunk_tokens}: pass at least {seq} (one response), or {2 * seq} "
                      "(a chosen/rejected pair) for the fastest plan", stacklevel=3)
    else:
        logger.info(message)


@follows_autocast
def linear_simpo_loss(input: torch.Tensor, linear_weight: torch.Tensor, target: torch.Tensor, *,
                      linear_bias: torch.Tensor | None = None, beta: float = DEFAULT_BETA,
                      gamma: float = DEFAULT_GAMMA, alpha: float = DEFAULT_ALPHA, label_smoothing: float = 0.0,
                      ignore_index: int = -100, impl: str = "auto", weight_grad_accum: str = "fp32",
                      chunk_tokens: int | None = None, softcap: float | None = None):
    """CPO-SimPO loss of an LM head: L = mean_i[−(1−ε)logσ(z_i) − ε·logσ(−z_i)] + α·NLL_chosen,
    z_i = β(A_w,i − A_l,i) − γ, A = length-normalized log-probability of the response.

    input [2B, S, H] (chosen rows first) · linear_weight [V, H] · target [2B, S] (already shifted;
    prompt and padding tokens = ignore_index). β > 0, γ, α ≥ 0 (α = 0: pure SimPO), ε ∈ [0, 0.5].
    softcap: logits z → c·tanh(z/c) before the softmax (Gemma 2's final softcap).
    Returns (loss, metrics) with TRL's metric names (rewards/chosen, rewards/rejected,
    rewards/margins, rewards/accuracies, logps/chosen, logps/rejected, nll_loss).
    """
    linear_weight, linear_bias, _ = full_weights(input, linear_weight, target, linear_bias)  # DTensors gathered
    _validate_simpo(input, target, beta, gamma, alpha, label_smoothing)
    hp = dict(beta=float(beta), gamma=float(gamma), alpha=float(alpha), label_smoothing=float(label_smoothing))
    grads = GradOptions.asked(input, linear_weight, linear_bias, weight_grad_accum, chunk_tokens)
    # validated once for every path; the operators check the targets' range
    validate_call(input, linear_weight, target, linear_bias, ignore_index=ignore_index, softcap=softcap, impl=impl,
                  weight_grad_accum=weight_grad_accum, chunk_tokens=chunk_tokens)
    softcap = None if softcap is None else float(softcap)
    mask = target != ignore_index
    if grads.wanted and target.numel() > 0:
        two_b, seq, _ = input.shape
        plan = plan_for(two_b, seq, linear_weight, grads.need_dw, weight_grad_accum, chunk_tokens)
        chunked = forms_grads_in_forward(impl, input.reshape(-1, input.shape[-1]), linear_weight, weight_grad_accum,
                                         chunk_tokens) \
            and not formula_on_anchored(impl, input, linear_weight, linear_bias, softcap=softcap)
        if chunked and plan[0] == "generic":
            _warn_four_gemms(seq, plan[2].chunk_tokens, chunk_tokens)
        # three (or 3.5) GEMMs: the gradient is formed in the forward pass (`simpo_spec`); with a softcap, SimPO's
        # tail as a formula over whole pairs (float32 log-probs)
        if chunked and (plan[0] != "generic" if softcap is None else
                        grouped_plan(two_b, seq, True, linear_weight, grads.need_dw, weight_grad_accum,
                                     chunk_tokens)[0] > 0):
            loss, logps, *_ = simpo_chunked(input, linear_weight, linear_bias, target,
                                            SimPOOptions(ignore_index, **hp, softcap=softcap, grads=grads))
            _, metrics = simpo_loss_from_logps(logps, mask, **hp)
            return loss, metrics
    logps = logprobs_unchecked(input, linear_weight, target, linear_bias=linear_bias, ignore_index=ignore_index,
                               softcap=softcap, impl=impl, chunk_tokens=chunk_tokens, weight_grad_accum=weight_grad_accum)
    return simpo_loss_from_logps(logps, mask, beta=beta, gamma=gamma, alpha=alpha,
                                 label_smoothing=label_smoothing)


class LinearSimPOLoss(nn.Module):
    """`nn.Module` form of `linear_simpo_loss`.

    Example:
        >>> loss_fn = LinearSimPOLoss(beta=2.0, gamma=1.0, alpha=0.0)     # the paper's style of config
        >>> loss, metrics = loss_fn(hidden_states, lm_head.weight, labels)  # [2B, S, H], [V, H], [2B, S]
    """

    def __init__(self, *, beta: float = DEFAULT_BETA, gamma: float = DEFAULT_GAMMA, alpha: float = DEFAULT_ALPHA,
                 label_smoothing: float = 0.0, ignore_index: int = -100, impl: str = "auto",
                 weight_grad_accum: str = "fp32", chunk_tokens: int | None = None, softcap: float | None = None):
        super().__init__()
        # bad settings fail here, where the loss is configured, not at the first training step
        _validate_hyperparameters(beta, gamma, alpha, label_smoothing)
        V_.check_int("ignore_index", ignore_index)
        validate_strategy(impl, weight_grad_accum, chunk_tokens)
        if softcap is not None:
            V_.check_real("softcap", softcap, low=0.0, low_inclusive=False)
        self.beta, self.gamma, self.alpha, self.label_smoothing = beta, gamma, alpha, label_smoothing
        self.ignore_index, self.impl, self.weight_grad_accum, self.chunk_tokens = ignore_index, impl, weight_grad_accum, chunk_tokens
        self.softcap = softcap

    def forward(self, input, linear_weight, target, linear_bias=None):
        return linear_simpo_loss(input, linear_weight, target, linear_bias=linear_bias, beta=self.beta,
                                 gamma=self.gamma, alpha=self.alpha, label_smoothing=self.label_smoothing,
                                 ignore_index=self.ignore_index, impl=self.impl,
                                 weight_grad_accum=self.weight_grad_accum, chunk_tokens=self.chunk_tokens,
                                 softcap=self.softcap)

    def extra_repr(self) -> str:
        extra = f", softcap={self.softcap}" if self.softcap is not None else ""
        return (f"beta={self.beta}, gamma={self.gamma}, alpha={self.alpha}, "
                f"label_smoothing={self.label_smoothing}{extra}")
