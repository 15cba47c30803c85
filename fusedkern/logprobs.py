"""`linear_logprobs`: per-token log p(target) of a linear layer's softmax, without the logits.

The primitive of the preference/RL family (DPO, CPO, SimPO, ORPO, KTO, IPO, policy gradients): those
losses touch the logits only through masked sums or means of these log-probabilities, so one fused
op that returns them and accepts any per-token upstream gradient serves them all. It is the
cross-entropy core with ε = 0, no class weights, no z-loss: log p_t = −ℓ_t (docs/design.md).
"""

from __future__ import annotations

import torch

from fusedkern.chunked import LossOptions
from fusedkern.integrations.fsdp import full_weights
from fusedkern.linear_cross_entropy import follows_autocast, loss_over_tokens, resolve_impl, validate_call


@follows_autocast
def linear_logprobs(input: torch.Tensor, linear_weight: torch.Tensor, target: torch.Tensor, *,
                    linear_bias: torch.Tensor | None = None, ignore_index: int = -100,
                    softcap: float | None = None, impl: str = "auto", chunk_tokens: int | None = None,
                    weight_grad_accum: str = "fp32", num_valid_tokens: int | None = None) -> torch.Tensor:
    """log_softmax(input @ linear_weightᵀ + linear_bias)[..., target], 0 where target == ignore_index.

    input [..., H] (fp32/fp16/bf16) · linear_weight [V, H] · target [...] int → float32 [...].
    Differentiable with respect to input, linear_weight and linear_bias; the backward recomputes the
    logits chunk by chunk (or tile by tile with impl="fused") from the saved log-sum-exp.
    num_valid_tokens: the count of non-ignored targets, when the caller has it on the host: only those
    rows are computed (see `linear_cross_entropy`).
    """
    linear_weight, linear_bias, _ = full_weights(input, linear_weight, target, linear_bias)  # DTensors gathered
    validate_call(input, linear_weight, target, linear_bias, ignore_index=ignore_index, softcap=softcap, impl=impl,
                  weight_grad_accum=weight_grad_accum, chunk_tokens=chunk_tokens, num_valid_tokens=num_valid_tokens)
    return logprobs_unchecked(input, linear_weight, target, linear_bias=linear_bias, ignore_index=ignore_index,
                              softcap=softcap, impl=impl, chunk_tokens=chunk_tokens,
                              weight_grad_accum=weight_grad_accum, num_valid_tokens=num_valid_tokens)


def logprobs_unchecked(input, linear_weight, target, *, linear_bias, ignore_index, softcap, impl, chunk_tokens,
                       weight_grad_accum, num_valid_tokens=None) -> torch.Tensor:
    """`linear_logprobs` after its arguments were validated by the caller (`linear_cross_entropy.validate_call`);
    the operator it calls checks the targets' range (and the count)."""
    x2d = input.reshape(-1, input.shape[-1])
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    y = target.reshape(-1).contiguous()  # the kernels index target[row] with no stride
    opts = LossOptions(ignore_index=ignore_index, softcap=None if softcap is None else float(softcap))
    impl = resolve_impl(impl, x2d, linear_weight, weight_grad_accum, chunk_tokens)
    nll_tok, _ = loss_over_tokens(x2d, linear_weight, linear_bias, y, None, opts, "none", impl, weight_grad_accum,
                                  chunk_tokens, num_valid_tokens, need_lse=False)
    return (-nll_tok).reshape(input.shape[:-1])
