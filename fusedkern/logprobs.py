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
"""

from __future__ import annotations

import torch

from fusedkern import _validation as V_
from fusedkern.chunked import LossOptions
from fusedkern.sharded import full_weights
from fusedkern._validation import validate_call
from fusedkern.autograd import GradOptions, follows_autocast
from fusedkern.dispatch import Call, choose
from fusedkern.engine import valid_rows_first
from fusedkern.linear_cross_entropy import LogprobsOptions, logprobs_entropy, loss_over_tokens


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
    """`linear_logprobs` after its arguments were validated by the caller (`linear_cross_entropy.validate_call`,
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
    if chosen.scales_logits and (return_entropy or temperature != 1.0):
        logps, entropy = _tempered(x2d, linear_weight, linear_bias, y, ignore_index, softcap, logit_scale,
                                   return_entropy, weight_grad_accum, chunk_tokens, num_valid_tokens, chosen.name)
        lead = input.shape[:-1]
        return (logps.reshape(lead), entropy.reshape(lead)) if return_entropy else logps.reshape(lead)
    if temperature != 1.0:  # kernels without a scale: s/τ = (c/τ)·tanh((z/τ)/(c/τ)) on input/τ, bias/τ
        x2d = x2d * logit_scale
        linear_bias = None if linear_bias is None else linear_bias * logit_scale
        softcap = None if softcap is None else softcap * logit_scale
    opts = LossOptions(ignore_index=ignore_index, softcap=softcap)
    nll_tok, _ = loss_over_tokens(x2d, linear_weight, linear_bias, y, None, opts, "none", chosen.name,
                                  weight_grad_accum, chunk_tokens, num_valid_tokens, need_lse=False)
    return (-nll_tok).reshape(input.shape[:-1])


def _tempered(x2d, w, b, y, ignore_index, softcap, logit_scale, with_entropy, weight_grad_accum, chunk_tokens,
              num_valid_tokens, impl: str):
    """(logps [T], entropy [T] or [0]) through the `logprobs_entropy` operator (fp32 scale 1/τ in the row
    kernels, or in the Gluon pass's epilogue: impl, `dispatch.choose`'s strategy for the statistics). A host count
    gathers the valid rows (as `loss_over_tokens` does) and scatters the outputs back among zeros; a device count
    is checked and the rows computed densely. The statistics pass runs in the caller's chunks when given, with or
    without a gradient to follow, so that both give the same log-probs."""
    def options(count_int=-1):
        return LogprobsOptions(LossOptions(ignore_index, softcap=softcap, logit_scale=logit_scale), impl,
                               GradOptions(weight_grad_accum, chunk_tokens), chunk_tokens, count_int, with_entropy)

    if isinstance(num_valid_tokens, torch.Tensor):
        nll, _, entropy, _ = logprobs_entropy(x2d, w, b, y, None, num_valid_tokens, options())
        return -nll, entropy
    count_int = -1 if num_valid_tokens is None else num_valid_tokens
    if num_valid_tokens is None or not 0 < num_valid_tokens < y.shape[0]:
        nll, _, entropy, _ = logprobs_entropy(x2d, w, b, y, None, None, options(count_int))
        return -nll, entropy
    rows = valid_rows_first(y, ignore_index)[:num_valid_tokens]
    x_valid = x2d.index_select(0, rows)
    nll, _, entropy, _ = logprobs_entropy(x_valid, w, b, y.index_select(0, rows), y, None, options(count_int))
    scatter = lambda t: t.new_zeros(y.shape[0]).index_copy(0, rows, t)  # noqa: E731
    return -scatter(nll), scatter(entropy) if with_entropy else entropy


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
                with_logit_sum=return_mean_logits)
    # the statistics pass is the same with and without a gradient to follow: a policy and its reference model
    # (the same weights, one under no_grad) get equal log-probs
    impl = choose("auto", call, weight_grad_accum=weight_grad_accum, chunk_tokens=chunk_tokens, statistics_only=True,
                  fused_fallback=False).name
    nll, stats, entropy, logit_sum = logprobs_entropy(
        x2d, linear_weight, linear_bias, y, None, None,
        LogprobsOptions(call.opts, impl, GradOptions(weight_grad_accum, chunk_tokens), chunk_tokens,
                        with_entropy=return_entropy, with_logit_sum=return_mean_logits))
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
