"""`linear_logprobs`: per-token log p(target) of a linear layer's softmax — at a sampling temperature,
optionally with the per-token entropy — without the logits.

The primitive of the preference/RL family (DPO, CPO, SimPO, ORPO, KTO, IPO, policy gradients): those
losses touch the logits only through masked sums or means of these log-probabilities (and, for RL, the
entropy), so one fused op that returns them and accepts any per-token upstream gradient serves them all.
It is the cross-entropy core with ε = 0, no class weights, no z-loss: log p_t = −ℓ_t (docs/design.md).

Temperature: the chunked row kernels multiply the softcapped logits by 1/τ in fp32 (a runtime scale, compiled
out at τ = 1) and their gradient by the same 1/τ. The kernel-free alternative — the same op on input/τ and
bias/τ with softcap c/τ, since s/τ = (c/τ)·tanh((z/τ)/(c/τ)) — rounds x/τ to bf16 once more, which puts its bf16
log-probs outside the 2× accuracy rule against float64 at small token counts (docs/design.md); it remains the fused
strategy's way (no scale in those kernels).

It stands beside cross-entropy on the core, not on top of it: its own custom operator (`logprobs_entropy`, with
`logprobs_entropy_backward`) runs a strategy's statistics pass (`dispatch.py`) with the temperature as the row
kernels' logit scale and the entropy and the logits' sum as extra row statistics, and its backward recomputes the
logits with that strategy's gradients, the entropy's term in the same pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fusedkern import _validation as V_
from fusedkern._validation import finish_checks, start_checks, validate_call
from fusedkern.autograd import (
    CHECKING_OP_TAGS,
    GradOptions,
    absent,
    cast_or_none,
    define_op,
    fake_grads,
    follows_autocast,
    or_absent,
    with_grads,
)
from fusedkern.anchored import kept_logprobs
from fusedkern.dispatch import ANCHORED, Call, choose, keeps_anchored_e, strategy
from fusedkern.engine import LossOptions, valid_rows_first
from fusedkern.sharded import full_weights


# ----------------------------------------------------------------------------------------------
# the operator: a strategy's statistics pass at a logit scale, with the entropy and the logits' sum where asked


@dataclass(frozen=True)
class LogprobsOptions:
    """`logprobs_entropy`'s and `logprobs_entropy_backward`'s options: the loss (ε = z-loss = 0, the temperature as
    its logit scale), the statistics pass's strategy (`dispatch.choose`: "chunked", "gluon", whose backward
    recomputes as "chunked", or "fused" at logit scale 1), the backward's chunks and gradients (`GradOptions`: none
    asked for in the forward), the statistics pass's whole-row chunks (`forward_chunk_tokens`; None: its 64 MiB
    tiles; the Gluon pass: at most that many tokens a launch), a host count to check (`count_int`, -1: none),
    whether the entropy is formed, and whether each row's logits' sum Σ_v s_v is (the mean logit's numerator; the
    chunked pass only)."""

    loss: LossOptions
    impl: str
    grads: GradOptions
    forward_chunk_tokens: int | None
    count_int: int = -1
    with_entropy: bool = False
    with_logit_sum: bool = False
    with_row_max: bool = False


def _logprobs_entropy(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, target: torch.Tensor,
                      check_target: torch.Tensor | None, count: torch.Tensor | None, o: LogprobsOptions
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token −log p_t [T] fp32 (0 where ignored) and row statistics [2, T] fp32 of s = softcap(z)·logit_scale
    (fp32, inside the row kernels), and with `with_entropy` each token's entropy H_t of softmax(s) [T] fp32 (0 where
    ignored; else [0]) from one more row statistic of the same pass; with `with_logit_sum` each row's Σ_v s_v [T]
    fp32 (else [0]), not differentiable, from the pass's label-smoothing sum. The backward takes both upstream
    gradients together and recomputes the logits (four GEMMs in all)."""
    checks = start_checks(target, w.shape[0], o.loss.ignore_index, check_target, count, o.count_int)
    T = x.shape[0]
    entropy = torch.empty(T if o.with_entropy else 0, device=x.device, dtype=torch.float32)
    logit_sum = torch.empty(T if o.with_logit_sum else 0, device=x.device, dtype=torch.float32)
    loss_tok, stats = strategy(o.impl).statistics(x, w, b, target, None, o.loss, o.forward_chunk_tokens,
                                                  entropy=entropy if o.with_entropy else None,
                                                  logit_sum=logit_sum if o.with_logit_sum else None,
                                                  row_max=o.with_row_max)
    finish_checks(checks)
    return loss_tok, stats, entropy, logit_sum


def _fake_logprobs_entropy(x, w, b, target, check_target, count, o: LogprobsOptions):
    T = x.shape[0]
    f32 = torch.float32
    return (x.new_empty((T,), dtype=f32), x.new_empty((2, T), dtype=f32),
            x.new_empty((T if o.with_entropy else 0,), dtype=f32),
            x.new_empty((T if o.with_logit_sum else 0,), dtype=f32))


def _setup_logprobs_entropy(ctx, tensors, o: LogprobsOptions, output):
    x, w, b, target = tensors[:4]
    ctx.save_for_backward(x, w, b, target, output[1], output[2])
    ctx.options = o
    ctx.mark_non_differentiable(output[1], output[3])


def _backward_logprobs_entropy(ctx, grad_loss_tok, _grad_stats, grad_entropy, _grad_logit_sum):
    x, w, b, target, stats, entropy = ctx.saved_tensors
    need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
    need_db = need_db and b is not None
    if grad_loss_tok is None and grad_entropy is None:
        return ()
    # an output nothing flowed into has no gradient (set_materialize_grads(False)): the log-probs' weight is 0,
    # an entropy used only as a metric passes [0] and the row kernel compiles its term out
    grad_tok = stats.new_zeros(stats.shape[1]) if grad_loss_tok is None else grad_loss_tok.float().contiguous()
    with_entropy = grad_entropy is not None and entropy.numel() > 0
    grad_h = grad_entropy.float().contiguous() if with_entropy else absent(entropy)
    dx, dw, db = logprobs_entropy_backward(x, w, b, target, stats, entropy if with_entropy else grad_h, grad_tok,
                                           grad_h, with_grads(ctx.options, need_dx, need_dw, need_db))
    return dx if need_dx else None, dw if need_dw else None, db if need_db else None


def _logprobs_entropy_backward(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, target: torch.Tensor,
                               stats: torch.Tensor, entropy: torch.Tensor, grad_tok: torch.Tensor,
                               grad_entropy: torch.Tensor, o: LogprobsOptions
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of Σ_t grad_tok[t]·ℓ_t + grad_entropy[t]·H_t (ℓ = −log p), recomputing the logits with the options'
    strategy (`Strategy.gradients`: the chunked GEMMs chunk by chunk, one in-place gradient per chunk carrying both
    terms, so the entropy costs no GEMM; "fused": its own kernels). entropy and grad_entropy [0]: no entropy term.
    (dx [T, H], dw [V, H], db [V]) in the dtypes of x, w, b; [0] where not wanted."""
    with_entropy = grad_entropy.numel() > 0
    g = o.grads
    dx, dw, db = strategy(o.impl).gradients(
        x, w, b, target, None, o.loss, stats, grad_tok, need_dx=g.need_dx, need_dw=g.need_dw, need_db=g.need_db,
        weight_grad_accum=g.weight_grad_accum, chunk_tokens=g.chunk_tokens, entropy=entropy if with_entropy else None,
        grad_entropy=grad_entropy if with_entropy else None)
    return (or_absent(cast_or_none(dx, x.dtype), x), or_absent(cast_or_none(dw, w.dtype), w),
            absent(w) if db is None else db.to(b.dtype))


logprobs_entropy_backward = define_op(
    "fusedkern::logprobs_entropy_backward", ["x", "w", "b?", "target", "stats", "entropy", "grad_tok", "grad_entropy"],
    LogprobsOptions, 3, _logprobs_entropy_backward,
    lambda x, w, b, target, stats, entropy, grad_tok, grad_entropy, o: fake_grads(x, w, b, o.grads))
logprobs_entropy = define_op("fusedkern::logprobs_entropy", ["x", "w", "b?", "target", "check_target?", "count?"],
                             LogprobsOptions, 4, _logprobs_entropy, _fake_logprobs_entropy, _setup_logprobs_entropy,
                             _backward_logprobs_entropy, tags=CHECKING_OP_TAGS)


# ----------------------------------------------------------------------------------------------
# the public functions


@follows_autocast
def linear_logprobs(input: torch.Tensor, linear_weight: torch.Tensor, target: torch.Tensor, *,
                    linear_bias: torch.Tensor | None = None, ignore_index: int = -100,
                    softcap: float | None = None, temperature: float = 1.0, return_entropy: bool = False,
                    impl: str = "auto", chunk_tokens: int | None = None, weight_grad_accum: str = "fp32",
                    num_valid_tokens: int | None = None):
    """log_softmax(softcap(input @ linear_weightᵀ + linear_bias) / temperature)[..., target], 0 where
    target == ignore_index; with `return_entropy`, also the entropy of that same distribution per token.

    input [..., H] (fp32/fp16/bf16) · linear_weight [V, H] · target [...] int → float32 [...].
    softcap (c·tanh(z/c)) is applied before the temperature, as Gemma-2's sampling in vLLM and verl's
    log-probs do: s = softcap(z), p = softmax(s/τ).
    temperature: τ > 0 (RL frameworks compute the policy's log-probs at the sampling temperature).
    return_entropy: return (logps, entropy) with entropy_t = −Σ_v p_v log p_v [...] float32 (0 where
        ignored), both differentiable; the backward takes both upstream gradients in one pass, so the
        entropy costs one more row statistic and no GEMM. Chunked strategy only: impl="fused" with
        return_entropy=True raises ValueError ("auto" picks "chunked").
    Differentiable with respect to input, linear_weight and linear_bias; the backward recomputes the
    logits chunk by chunk (or tile by tile with impl="fused") from the saved log-sum-exp (four GEMMs).
    num_valid_tokens: the count of non-ignored targets, when the caller has it on the host: only those
    rows are computed (see `linear_cross_entropy`).
    """
    linear_weight, linear_bias, _ = full_weights(input, linear_weight, target, linear_bias)  # DTensors gathered
    validate_call(input, linear_weight, target, linear_bias, ignore_index=ignore_index, softcap=softcap, impl=impl,
                  weight_grad_accum=weight_grad_accum, chunk_tokens=chunk_tokens, num_valid_tokens=num_valid_tokens)
    validate_logprobs_options(temperature, return_entropy, impl)
    num_valid_tokens = V_.normalize_count(num_valid_tokens, target)  # a numpy or tensor count as the kernels take it
    return logprobs_unchecked(input, linear_weight, target, linear_bias=linear_bias, ignore_index=ignore_index,
                              softcap=softcap, impl=impl, chunk_tokens=chunk_tokens,
                              weight_grad_accum=weight_grad_accum, num_valid_tokens=num_valid_tokens,
                              temperature=temperature, return_entropy=return_entropy)


def validate_logprobs_options(temperature, return_entropy, impl: str, entropy_name: str = "return_entropy") -> None:
    """The options `linear_logprobs` adds to `linear_cross_entropy.validate_call`'s (entropy_name: what the
    caller calls the entropy flag)."""
    V_.check_real("temperature", temperature, low=0.0, low_inclusive=False)
    if not isinstance(return_entropy, bool):
        raise TypeError(f"{entropy_name} must be a bool, got {type(return_entropy).__name__}")
    if return_entropy and impl == "fused":
        raise ValueError(f"{entropy_name}=True needs impl='chunked' (or 'auto'): the fused strategy has no entropy "
                         "statistic")


def logprobs_unchecked(input, linear_weight, target, *, linear_bias, ignore_index, softcap, impl, chunk_tokens,
                       weight_grad_accum, num_valid_tokens=None, temperature: float = 1.0,
                       return_entropy: bool = False):
    """`linear_logprobs` after its arguments were validated by the caller (`_validation.validate_call`,
    `validate_logprobs_options`); the operator it calls checks the targets' range (and the count)."""
    x2d = input.reshape(-1, input.shape[-1])
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    y = target.reshape(-1).contiguous()  # the kernels index target[row] with no stride
    softcap = None if softcap is None else float(softcap)
    logit_scale = 1.0 / float(temperature)
    call = Call(x2d, linear_weight, linear_bias, None, LossOptions(ignore_index, softcap=softcap,
                                                                   logit_scale=logit_scale), return_entropy)
    chosen = choose(impl, call, weight_grad_accum=weight_grad_accum, chunk_tokens=chunk_tokens, statistics_only=True)
    if chosen.scales_logits and (return_entropy or temperature != 1.0):  # 1/τ in the row kernels, in fp32
        opts = call.opts

        def strategy_for(x_rows):
            return chosen.name
    else:
        if temperature != 1.0:  # kernels without a scale: s/τ = (c/τ)·tanh((z/τ)/(c/τ)) on input/τ, bias/τ
            x2d = x2d * logit_scale
            linear_bias = None if linear_bias is None else linear_bias * logit_scale
            softcap = None if softcap is None else softcap * logit_scale
        opts = LossOptions(ignore_index=ignore_index, softcap=softcap)

        def strategy_for(x_rows):  # the plain per-token pass: chosen for the rows it computes
            return choose(impl, Call(x_rows, linear_weight, linear_bias, None, opts),
                          weight_grad_accum=weight_grad_accum, chunk_tokens=chunk_tokens, statistics_only=True).name
    logps, entropy = _over_tokens(x2d, linear_weight, linear_bias, y, opts, strategy_for, return_entropy,
                                  weight_grad_accum, chunk_tokens, num_valid_tokens)
    lead = input.shape[:-1]
    return (logps.reshape(lead), entropy.reshape(lead)) if return_entropy else logps.reshape(lead)


def _over_tokens(x2d, w, b, y, opts: LossOptions, strategy_for, with_entropy: bool, weight_grad_accum, chunk_tokens,
                 num_valid_tokens):
    """(logps [T], entropy [T] or [0]) of flat inputs through the `logprobs_entropy` operator; strategy_for(x_rows)
    names the statistics pass's strategy for the rows computed. A host count gathers the valid rows and scatters
    the outputs back among zeros; a device count is checked and the rows computed densely. The statistics pass runs
    in the caller's chunks when given, with or without a gradient to follow, so that both give the same
    log-probs. A batch with no token launches no kernel (a grid of zero rows is not a launch Triton accepts): its
    outputs are empty, and its gradients zeros through the [0, V] logits, which cost nothing to form."""
    if y.numel() == 0:
        logps = torch.nn.functional.linear(x2d, w, b).float().sum(-1)
        return logps, logps if with_entropy else absent(logps)

    def nll_and_entropy(x_rows, y_rows, check_target, count, count_int):
        name = strategy_for(x_rows)
        if name == ANCHORED and keeps_anchored_e(x_rows, w):
            nll, entropy, _ = kept_logprobs(x_rows, w, y_rows, opts, with_entropy, (check_target, count, count_int))
            return nll, entropy
        options = LogprobsOptions(opts, name, GradOptions(weight_grad_accum, chunk_tokens), chunk_tokens, count_int,
                                  with_entropy)
        nll, _, entropy, _ = logprobs_entropy(x_rows, w, b, y_rows, check_target, count, options)
        return nll, entropy

    if isinstance(num_valid_tokens, torch.Tensor):
        nll, entropy = nll_and_entropy(x2d, y, None, num_valid_tokens, -1)
        return -nll, entropy
    count_int = -1 if num_valid_tokens is None else num_valid_tokens
    if num_valid_tokens is None or not 0 < num_valid_tokens < y.shape[0]:
        nll, entropy = nll_and_entropy(x2d, y, None, None, count_int)
        return -nll, entropy
    rows = valid_rows_first(y, opts.ignore_index)[:num_valid_tokens]
    y_valid = y.index_select(0, rows)
    nll, entropy = nll_and_entropy(x2d.index_select(0, rows), y_valid, y, None, count_int)
    scatter = lambda t: t.new_zeros(y.shape[0]).index_copy(0, rows, t)  # noqa: E731
    return -scatter(nll), scatter(entropy) if with_entropy else entropy  # −0.0 where ignored, as the dense pass gives


@follows_autocast
def linear_logprobs_with_stats(input: torch.Tensor, linear_weight: torch.Tensor, target: torch.Tensor, *,
                               linear_bias: torch.Tensor | None = None, ignore_index: int = -100,
                               softcap: float | None = None, temperature: float = 1.0, return_entropy: bool = False,
                               weight_grad_accum: str = "fp32", chunk_tokens: int | None = None,
                               return_mean_logits: bool = False):
    """`linear_logprobs` (chunked strategy) that also returns each row's statistics from the same pass:
    (logps, entropy or None, row_max, row_lse), each float32 shaped like target. row_max = max_v s_v and row_lse
    = log Σ_v exp(s_v) of the tempered logits s = softcap(z)/τ, without gradient (meaningless where ignored).

    The target is its row's most likely token when logps ≥ row_max − row_lse up to the rounding of the two
    (`is_top1`: a few fp32 ulps of |row_lse|, measured ≤ 1 ulp); a trainer's top-1 accuracy comes from these
    without a [tokens, vocab] tensor.

    return_mean_logits: a fifth output, mean_logits = (1/V)·Σ_v s_v of every row (TRL's `mean_logits`: the mean of
    the softcapped, tempered logits), float32 without gradient, from a row sum the same pass carries beside the
    log-sum-exp (no extra GEMM; the log-probs and statistics are the same bits as without it). The Gluon pass has
    no such sum, so such a call takes the chunked pass: where a policy and its reference model must see the same
    log-probs, ask for it on both or on neither, or only where neither can take the Gluon pass (a softcap)."""
    linear_weight, linear_bias, _ = full_weights(input, linear_weight, target, linear_bias)  # DTensors gathered
    validate_call(input, linear_weight, target, linear_bias, ignore_index=ignore_index, softcap=softcap,
                  impl="chunked", weight_grad_accum=weight_grad_accum, chunk_tokens=chunk_tokens)
    validate_logprobs_options(temperature, return_entropy, "chunked")
    if not isinstance(return_mean_logits, bool):
        raise TypeError(f"return_mean_logits must be a bool, got {type(return_mean_logits).__name__}")
    x2d = input.reshape(-1, input.shape[-1])
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    y = target.reshape(-1).contiguous()
    softcap = None if softcap is None else float(softcap)
    logit_scale = 1.0 / float(temperature)
    call = Call(x2d, linear_weight, linear_bias, None, LossOptions(ignore_index, softcap=softcap,
                                                                   logit_scale=logit_scale), return_entropy,
                with_logit_sum=return_mean_logits, with_row_max=True)
    # the statistics pass is the same with and without a gradient to follow: a policy and its reference model
    # (the same weights, one under no_grad) get equal log-probs
    impl = choose("auto", call, weight_grad_accum=weight_grad_accum, chunk_tokens=chunk_tokens, statistics_only=True,
                  fused_fallback=False).name
    if impl == ANCHORED and keeps_anchored_e(x2d, linear_weight):
        nll, entropy, stats = kept_logprobs(x2d, linear_weight, y, call.opts, return_entropy, (None, None, -1),
                                            with_row_max=True)
    else:
        nll, stats, entropy, logit_sum = logprobs_entropy(
            x2d, linear_weight, linear_bias, y, None, None,
            LogprobsOptions(call.opts, impl, GradOptions(weight_grad_accum, chunk_tokens), chunk_tokens,
                            with_entropy=return_entropy, with_logit_sum=return_mean_logits, with_row_max=True))
    lead = input.shape[:-1]
    stats = stats.detach()
    out = (-nll.reshape(lead), entropy.reshape(lead) if return_entropy else None, stats[0].reshape(lead),
           (stats[0] + stats[1]).reshape(lead))
    return (*out, (logit_sum / linear_weight.shape[0]).reshape(lead)) if return_mean_logits else out


def is_top1(logps: torch.Tensor, row_max: torch.Tensor, row_lse: torch.Tensor) -> torch.Tensor:
    """Whether each target is its row's most likely token, from `linear_logprobs_with_stats`' outputs: its
    log-prob within 4 fp32 ulps (of |row_max| + |row_lse| + 1) of the row's largest (log p of the maximum,
    row_max − row_lse, and the kernel's log-prob of the same token differ by rounding, ≤ 1 ulp measured). A
    logit within that tolerance of the maximum counts as top-1, and a tie counts for the target (argmax
    would pick the first index)."""
    tol = 4 * torch.finfo(torch.float32).eps * (row_max.abs() + row_lse.abs() + 1)
    return logps >= (row_max - row_lse) - tol
