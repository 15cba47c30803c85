"""GRPO's clipped policy-gradient loss over an LM head, without the logits (TRL GRPOTrainer semantics).

The generic path is `linear_logprobs` (per-token log-probs at the sampling temperature, optionally the
entropy) followed by an O(B·T) function in plain PyTorch (`grpo_loss_from_logps`), whose autograd hands the
fused backward one upstream gradient per token: four GEMMs for forward + backward (the logits GEMM in the
forward, then the recomputed logits, dX and dW in the backward), because that backward learns ∂L/∂logp_t
only after the forward has returned. But with token-level importance sampling ∂L/∂logp_t is a function of
that token's own logp_t (its ratio exp(logp_t − old_t), the clip bounds, its advantage and reference
log-prob) and of loss-type weights that depend on the mask alone, so the chunked strategy forms the
gradient in the forward pass instead (a formula over the chunk engine, `formula.py`, inside the custom operator
`fusedkern::grpo_chunked`): three GEMMs, eager and compiled alike, the default whenever it applies (chunked, a
gradient wanted, old/reference log-probs and advantages not requiring grad).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fusedkern import _validation as V_
from fusedkern.engine import LossOptions, plan_for_grads, token_chunks
from fusedkern.formula import FormulaSpec, run_formula
from fusedkern.sharded import full_weights
from fusedkern._validation import finish_checks, start_checks
from fusedkern.autograd import (
    CHECKING_OP_TAGS,
    GradOptions,
    absent,
    define_op,
    differentiable,
    follows_autocast,
    grads_formed_in_forward,
)
from fusedkern.dispatch import formula_on_anchored, forms_grads_in_forward
from fusedkern.logprobs import logprobs_unchecked, validate_logprobs_options

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
# TRL GRPOConfig's defaults: epsilon 0.2 (epsilon_high None = epsilon), beta 0.0, loss_type "dapo", temperature 1.0
DEFAULT_EPSILON, DEFAULT_BETA, DEFAULT_LOSS_TYPE = 0.2, 0.0, "dapo"
CLIP_METRIC_KEYS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
                    "clip_ratio/high_max")


def grpo_per_token_loss(logps: torch.Tensor, *, advantages: torch.Tensor, old_logps: torch.Tensor | None,
                        ref_logps: torch.Tensor | None, beta: float, epsilon: float, epsilon_high: float | None):
    """(per-token loss, ratio, per-token k3 KL or None), each shaped like logps: −min(r·A, clip(r, 1 − ε,
    1 + ε_high)·A) + β·k3, r = exp(logp − old) (old = logp.detach() when None), k3 = exp(ref − logp) − (ref −
    logp) − 1. advantages broadcast against logps (a [B, 1] column for [B] advantages). A function of each
    token's own log-prob: the chunked form (`formula.py`) differentiates it chunk by chunk."""
    eps_high = epsilon if epsilon_high is None else epsilon_high
    old = logps.detach() if old_logps is None else old_logps.float()
    ratio = torch.exp(logps - old)
    per_token = -torch.min(ratio * advantages, torch.clamp(ratio, 1 - epsilon, 1 + eps_high) * advantages)
    per_token_kl = None
    if beta != 0.0:
        log_ref_ratio = ref_logps.float() - logps
        per_token_kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1
        per_token = per_token + beta * per_token_kl
    return per_token, ratio, per_token_kl


def off_mask_as_policy(t: torch.Tensor, logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """t (old or reference log-probs) with the policy's own detached log-probs off the mask, so that padding
    holding any value (−inf, −1e4) gives ratio 1 and KL 0 there rather than an inf·0 = NaN in the loss."""
    return torch.where(mask, t.float(), logps.detach())


def grpo_token_weights(mask: torch.Tensor, *, loss_type: str, max_completion_length: int | None = None,
                       num_items_in_batch: float | torch.Tensor | None = None) -> torch.Tensor:
    """c [B, T] fp32 with loss = Σ c·per-token loss, 0 off the mask: "grpo" 1/(B·n_b) (the mean over sequences
    of each one's token mean, n_b clamped at 1), "bnpo" 1/N, "dapo" 1/num_items_in_batch (default N),
    "dr_grpo" 1/(B·max_completion_length); N = the batch's completion tokens (clamped at 1). A given
    num_items_in_batch is used as it is (positive: `check_num_items_in_batch`), as TRL divides by it."""
    m = mask.to(torch.float32)
    if loss_type == "grpo":
        return m / (m.sum(-1, keepdim=True).clamp(min=1.0) * mask.shape[0])
    if loss_type == "bnpo" or (loss_type == "dapo" and num_items_in_batch is None):
        return m / m.sum().clamp(min=1.0)
    if loss_type == "dapo":
        return m / torch.as_tensor(num_items_in_batch, dtype=m.dtype, device=m.device).reshape(())
    return m / (mask.shape[0] * max_completion_length)  # "dr_grpo"


def grpo_metrics(ratio: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor, *, epsilon: float,
                 epsilon_high: float | None, per_token_kl: torch.Tensor | None = None,
                 entropy: torch.Tensor | None = None) -> dict:
    """TRL's logged metrics as detached 0-d tensors: "kl" (when given), "entropy" (when given), the clip ratios."""
    eps_high = epsilon if epsilon_high is None else epsilon_high
    with torch.no_grad():
        m = mask.to(torch.float32)
        n_tokens = m.sum()

        def masked_mean(t):
            return (t * m).sum() / n_tokens.clamp(min=1.0)

        metrics = {}
        if per_token_kl is not None:
            metrics["kl"] = masked_mean(per_token_kl)
        if entropy is not None:
            metrics["entropy"] = masked_mean(entropy)
        low = ((ratio < 1 - epsilon) & (advantages < 0)).to(m.dtype)
        high = ((ratio > 1 + eps_high) & (advantages > 0)).to(m.dtype)
        metrics["clip_ratio/low_mean"] = masked_mean(low)
        metrics["clip_ratio/high_mean"] = masked_mean(high)
        metrics["clip_ratio/region_mean"] = masked_mean(torch.maximum(low, high))
        # per-sequence means; TRL's nanmin / nanmax skip the sequences with no token (NaN when all are empty)
        per_seq = m.sum(-1)
        has = per_seq > 0
        nan = torch.full_like(per_seq, float("nan"))
        inf = torch.full_like(per_seq, float("inf"))
        low_seq = (low * m).sum(-1) / per_seq.clamp(min=1.0)
        high_seq = (high * m).sum(-1) / per_seq.clamp(min=1.0)
        metrics["clip_ratio/low_min"] = torch.where(has.any(), torch.where(has, low_seq, inf).min(), nan[0])
        metrics["clip_ratio/high_max"] = torch.where(has.any(), torch.where(has, high_seq, -inf).max(), nan[0])
    return metrics


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
    check_num_items_in_batch(num_items_in_batch)
    adv = (advantages.unsqueeze(1) if advantages.dim() == 1 else advantages).float()
    old_logps, ref_logps = (None if t is None else off_mask_as_policy(t, logps, mask) for t in (old_logps, ref_logps))
    per_token, ratio, per_token_kl = grpo_per_token_loss(logps, advantages=adv, old_logps=old_logps,
                                                         ref_logps=ref_logps, beta=beta, epsilon=epsilon,
                                                         epsilon_high=epsilon_high)
    weights = grpo_token_weights(mask, loss_type=loss_type, max_completion_length=max_completion_length,
                                 num_items_in_batch=num_items_in_batch)
    loss = (per_token * weights).sum()
    return loss, grpo_metrics(ratio, mask, adv, epsilon=epsilon, epsilon_high=epsilon_high,
                              per_token_kl=per_token_kl, entropy=entropy)


def _check_per_token(name: str, t, shape, *, allow_rows: bool = False) -> None:
    """A float tensor of the completions' shape [B, T] (or [B] where `allow_rows`)."""
    V_.check_tensor(name, t, dtypes=(torch.float32, torch.float16, torch.bfloat16, torch.float64))
    shapes = (tuple(shape), (shape[0],)) if allow_rows else (tuple(shape),)
    if tuple(t.shape) not in shapes:
        raise ValueError(f"{name} must have shape {' or '.join(str(list(s)) for s in shapes)} (target's [B, T]), "
                         f"got {list(t.shape)}")


def check_num_items_in_batch(num_items_in_batch) -> None:
    """None, a positive finite Python number, or a one-element real tensor (its value is read on the device:
    `NumItemsCheck`). The "dapo" loss divides the token sum by it, so zero or a negative count is refused
    rather than replaced: TRL's normalizer, the accumulated batch's active tokens (at least 1) over the number
    of processes, is always positive, and may be below 1."""
    n = num_items_in_batch
    if n is None:
        return
    if isinstance(n, torch.Tensor):
        if n.numel() != 1 or n.dtype == torch.bool or n.is_complex():
            raise TypeError("num_items_in_batch as a tensor must hold one real count, got "
                            f"{n.dtype} of shape {tuple(n.shape)}")
        return
    if V_.check_real("num_items_in_batch", n) <= 0:
        raise ValueError(f"num_items_in_batch must be > 0 (the \"dapo\" loss divides the token sum by it: the "
                         f"accumulated batch's active-token count, or None for this batch's), got {n}")


class NumItemsCheck:
    """A tensor num_items_in_batch's value (> 0 and finite), read like `_validation.CountCheck`: the flag is
    copied to pinned host memory behind an event before the loss's kernels are queued and read after them,
    so a bad count raises before anything is returned without a device→host sync in the step."""

    def __init__(self, n: torch.Tensor):
        self._n = n
        bad = ~(torch.isfinite(n) & (n > 0)).reshape(())
        if n.is_cuda:
            self._flag = torch.empty((), dtype=torch.bool, pin_memory=True)
            self._flag.copy_(bad, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(n.device))
        else:
            self._flag, self._event = bad, None

    @classmethod
    def start(cls, num_items_in_batch) -> NumItemsCheck | None:
        """The pending check of a tensor count in eager mode; None otherwise (a Python number is checked at
        once; under torch.compile nothing reads the flag, and a zero count gives an inf/NaN loss, not a
        clamped one)."""
        if not isinstance(num_items_in_batch, torch.Tensor) or torch.compiler.is_compiling():
            return None
        return cls(num_items_in_batch)

    def raise_if_failed(self) -> None:
        if self._event is not None:
            self._event.synchronize()
        if bool(self._flag):
            raise ValueError(f"num_items_in_batch must be > 0 and finite (the \"dapo\" loss divides the token sum "
                             f"by it), got a tensor holding {self._n.reshape(()).item()}")


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
    check_num_items_in_batch(num_items_in_batch)
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
    Returns (loss 0-d fp32, metrics dict of detached 0-d tensors, see `grpo_loss_from_logps`). Three GEMMs in
    forward + backward on the chunked path (gradient formed in the forward pass, the backward rescales it:
    one backward per call), else four (this module's header says when). A sequence with no completion
    token adds 0.
    """
    linear_weight, linear_bias, _ = full_weights(input, linear_weight, target, linear_bias)  # DTensors gathered
    V_.validate_call(input, linear_weight, target, linear_bias, ignore_index=ignore_index, softcap=softcap, impl=impl,
                  weight_grad_accum=weight_grad_accum, chunk_tokens=chunk_tokens)
    validate_logprobs_options(temperature, compute_entropy, impl, entropy_name="compute_entropy")
    validate_grpo_options(target, advantages=advantages, old_logps=old_logps, ref_logps=ref_logps, beta=beta,
                          epsilon=epsilon, epsilon_high=epsilon_high, loss_type=loss_type,
                          max_completion_length=max_completion_length, num_items_in_batch=num_items_in_batch)
    hp = dict(beta=beta, epsilon=epsilon, epsilon_high=epsilon_high)
    norm = dict(loss_type=loss_type, max_completion_length=max_completion_length,
                num_items_in_batch=num_items_in_batch)
    mask = target != ignore_index
    count_check = NumItemsCheck.start(num_items_in_batch)
    if forms_gradient_in_forward(input, linear_weight, linear_bias, advantages, old_logps, ref_logps, impl=impl,
                                 weight_grad_accum=weight_grad_accum, chunk_tokens=chunk_tokens, softcap=softcap,
                                 temperature=temperature):
        result = _chunked(input, linear_weight, linear_bias, target, mask, advantages, old_logps, ref_logps, hp,
                          norm, ignore_index=ignore_index, softcap=softcap, temperature=temperature,
                          compute_entropy=compute_entropy, weight_grad_accum=weight_grad_accum,
                          chunk_tokens=chunk_tokens)
    else:
        out = logprobs_unchecked(input, linear_weight, target, linear_bias=linear_bias, ignore_index=ignore_index,
                                 softcap=softcap, impl=impl, chunk_tokens=chunk_tokens,
                                 weight_grad_accum=weight_grad_accum, temperature=temperature,
                                 return_entropy=compute_entropy)
        logps, entropy = out if compute_entropy else (out, None)
        result = grpo_loss_from_logps(logps, mask, advantages=advantages, old_logps=old_logps, ref_logps=ref_logps,
                                      entropy=None if entropy is None else entropy.detach(), **hp, **norm)
    if count_check is not None:
        count_check.raise_if_failed()
    return result


def forms_gradient_in_forward(input, linear_weight, linear_bias, advantages, old_logps, ref_logps, *, impl,
                              weight_grad_accum, chunk_tokens, softcap=None, temperature=1.0) -> bool:
    """Whether `linear_grpo_loss` takes the three-GEMM chunked path (`grpo_chunked`, eager and compiled alike): a
    gradient is wanted, the strategy is chunked, the anchored pass does not take the log-probs
    (`dispatch.formula_on_anchored`: three GEMMs on the generic path) and no gradient is asked of the per-token
    inputs (the chunked form treats them as constants)."""
    params = [t for t in (input, linear_weight, linear_bias) if t is not None]
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in params)):
        return False
    if any(t is not None and t.requires_grad for t in (advantages, old_logps, ref_logps)):
        return False
    x2d = input.reshape(-1, input.shape[-1])
    return forms_grads_in_forward(impl, x2d, linear_weight, weight_grad_accum, chunk_tokens) \
        and not formula_on_anchored(impl, input, linear_weight, linear_bias, softcap=softcap, temperature=temperature)


@dataclass(frozen=True)
class GRPOOptions:
    """`grpo_chunked`'s options: the loss's hyperparameters and normalization (`grpo_loss_from_logps`; a Python
    num_items_in_batch here, a tensor one travels as a tensor), the logits' options (softcap, 1/temperature), the
    entropy and the gradients (`GradOptions`)."""

    loss_type: str
    beta: float
    epsilon: float
    epsilon_high: float | None
    max_completion_length: int | None
    num_items_in_batch: float | None
    ignore_index: int
    softcap: float | None
    logit_scale: float
    with_entropy: bool
    grads: GradOptions


def _grpo_plan(x: torch.Tensor, w: torch.Tensor, o: GRPOOptions):
    g = o.grads
    return plan_for_grads(x.shape[0] * x.shape[1], w, g.need_dw, g.weight_grad_accum, g.chunk_tokens)


def _grpo_chunked(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, target: torch.Tensor,
                  advantages: torch.Tensor, old_logps: torch.Tensor | None, ref_logps: torch.Tensor | None,
                  num_items_tensor: torch.Tensor | None, o: GRPOOptions
                  ) -> tuple[torch.Tensor, ...]:
    """GRPO as a formula over the engine: each token's ∂L/∂logp from its own log-prob, formed in the forward pass
    (three GEMMs). x [B, T, H] · w [V, H] · b [V] | None · target [B, T] · advantages [B] or [B, T] · old_logps,
    ref_logps [B, T] or None · num_items_tensor: a tensor num_items_in_batch (None: the options' number, if any).
    Returns (loss 0-d fp32, logp [B, T] fp32, entropy [B, T] fp32 or [0], dx [B·T, H], dw, db, dw_out as
    `linear_cross_entropy.ce_chunked_scalar` returns them)."""
    checks = start_checks(target, w.shape[0], o.ignore_index, None, None, -1)
    x2d = x.reshape(-1, x.shape[-1])
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    y = target.reshape(-1).contiguous()
    mask = target != o.ignore_index
    hp = dict(beta=o.beta, epsilon=o.epsilon, epsilon_high=o.epsilon_high)
    adv = (advantages.unsqueeze(1) if advantages.dim() == 1 else advantages).float().expand(target.shape)
    adv_flat, mask_flat = adv.reshape(-1), mask.reshape(-1)
    flat = [None if t is None else t.float().reshape(-1) for t in (old_logps, ref_logps)]

    def per_token_loss(logp_c, rows):
        m = mask_flat[rows]
        old_c, ref_c = (None if t is None else off_mask_as_policy(t[rows], logp_c, m) for t in flat)
        return grpo_per_token_loss(logp_c, advantages=adv_flat[rows], old_logps=old_c, ref_logps=ref_c, **hp)[0]

    count = num_items_tensor if num_items_tensor is not None else o.num_items_in_batch
    weights = grpo_token_weights(mask, loss_type=o.loss_type, max_completion_length=o.max_completion_length,
                                 num_items_in_batch=count).reshape(-1)

    def formula(chunk, logp):  # ∂L/∂logp_t of each token of the chunk: a function of its own log-prob
        rows = chunk.rows
        with differentiable():  # inside the operator's body: below autograd
            logp_c = logp[rows].detach().requires_grad_()
            loss_c = (per_token_loss(logp_c, rows) * weights[rows]).sum()
            return torch.autograd.grad(loss_c, logp_c)[0]

    def loss(logp, _entropy):
        return (per_token_loss(logp, slice(None)) * weights).sum()

    plan = _grpo_plan(x, w, o)
    spec = FormulaSpec(formula, loss, token_chunks(x2d.shape[0], plan.chunk_tokens), plan,
                       with_entropy=o.with_entropy)
    opts = LossOptions(o.ignore_index, softcap=o.softcap, logit_scale=o.logit_scale)
    loss, logp, entropy, grads = run_formula(x2d, w, b, y, opts, spec, need_dx=o.grads.need_dx,
                                             need_dw=o.grads.need_dw, need_db=o.grads.need_db)
    finish_checks(checks)
    entropy = absent(x, torch.float32) if entropy is None else entropy.view(target.shape)
    return (loss, logp.view(target.shape), entropy, *o.grads.outputs(x, w, *grads.as_tuple()))


def _fake_grpo_chunked(x, w, b, target, advantages, old_logps, ref_logps, num_items_tensor, o: GRPOOptions):
    B, T, _ = x.shape
    fp32_accumulator = _grpo_plan(x, w, o).fp32_accumulator
    f32 = torch.float32
    return (x.new_empty((), dtype=f32), x.new_empty((B, T), dtype=f32),
            x.new_empty((B, T) if o.with_entropy else (0,), dtype=f32),
            *o.grads.fake_outputs(x, w, B * T, fp32_accumulator, o.grads.need_db and b is not None))


grpo_chunked = define_op(
    "fusedkern::grpo_chunked",
    ["x", "w", "b?", "target", "advantages", "old_logps?", "ref_logps?", "num_items_tensor?"],
    GRPOOptions, 7, _grpo_chunked, _fake_grpo_chunked, *grads_formed_in_forward("linear_grpo_loss"),
    tags=CHECKING_OP_TAGS)


def _chunked(input, w, b, target, mask, advantages, old_logps, ref_logps, hp, norm, *, ignore_index, softcap,
             temperature, compute_entropy, weight_grad_accum, chunk_tokens):
    """`linear_grpo_loss` through `grpo_chunked`: (loss, metrics) as the generic path gives them."""
    n = norm["num_items_in_batch"]
    o = GRPOOptions(norm["loss_type"], float(hp["beta"]), float(hp["epsilon"]),
                    None if hp["epsilon_high"] is None else float(hp["epsilon_high"]), norm["max_completion_length"],
                    None if n is None or isinstance(n, torch.Tensor) else float(n), ignore_index,
                    None if softcap is None else float(softcap), 1.0 / float(temperature), compute_entropy,
                    GradOptions.asked(input, w, b, weight_grad_accum, chunk_tokens))
    loss, logps, entropy, *_ = grpo_chunked(input, w, b, target, advantages, old_logps, ref_logps,
                                            n if isinstance(n, torch.Tensor) else None, o)
    adv = (advantages.unsqueeze(1) if advantages.dim() == 1 else advantages).float().expand(target.shape)
    old, ref = (None if t is None else off_mask_as_policy(t, logps, mask) for t in (old_logps, ref_logps))
    _, ratio, per_token_kl = grpo_per_token_loss(logps, advantages=adv, old_logps=old, ref_logps=ref, **hp)
    return loss, grpo_metrics(ratio, mask, adv, epsilon=hp["epsilon"], epsilon_high=hp["epsilon_high"],
                              per_token_kl=per_token_kl, entropy=entropy if compute_entropy else None)
