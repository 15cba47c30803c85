"""`linear_logprobs`: per-token log p(target) of a linear layer's softmax, without the logits.

The primitive of the preference/RL family (DPO, CPO, SimPO, ORPO, KTO, IPO, policy gradients): those
losses touch the logits only through masked sums or means of these log-probabilities, so one fused
op that returns them and accepts any per-token upstream gradient serves them all. It is the
cross-entropy core with ε = 0, no class weights, no z-loss: log p_t = −ℓ_t (docs/design.md).
"""

from __future__ import annotations

import torch

from fusedkern.chunked import LossOptions, chunked_loss
from fusedkern.linear_cross_entropy import _PerTokenLoss, _fused_ops, _validate, resolve_impl


@torch.compiler.disable
def linear_logprobs(input: torch.Tensor, linear_weight: torch.Tensor, target: torch.Tensor, *,
                    linear_bias: torch.Tensor | None = None, ignore_index: int = -100,
                    softcap: float | None = None, impl: str = "auto", chunk_tokens: int | None = None,
                    weight_grad_accum: str = "fp32") -> torch.Tensor:
    """log_softmax(input @ linear_weightᵀ + linear_bias)[..., target], 0 where target == ignore_index.

    input [..., H] (fp32/fp16/bf16) · linear_weight [V, H] · target [...] int → float32 [...].
    Differentiable with respect to input, linear_weight and linear_bias; the backward recomputes the
    logits chunk by chunk (or tile by tile with impl="fused") from the saved log-sum-exp.
    """
    target_range = _validate(input, linear_weight, target, linear_bias, ignore_index=ignore_index, softcap=softcap,
                             impl=impl, weight_grad_accum=weight_grad_accum, chunk_tokens=chunk_tokens)
    logps = logprobs_unchecked(input, linear_weight, target, linear_bias=linear_bias, ignore_index=ignore_index,
                               softcap=softcap, impl=impl, chunk_tokens=chunk_tokens,
                               weight_grad_accum=weight_grad_accum)
    target_range.raise_if_failed()
    return logps


def logprobs_unchecked(input, linear_weight, target, *, linear_bias, ignore_index, softcap, impl, chunk_tokens,
                       weight_grad_accum) -> torch.Tensor:
    """`linear_logprobs` after its arguments were validated by the caller (`linear_cross_entropy._validate`),
    whose pending target range check the caller still has to read."""
    x2d = input.reshape(-1, input.shape[-1])
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    y = target.reshape(-1).contiguous()  # the kernels index target[row] with no stride
    opts = LossOptions(ignore_index=ignore_index, softcap=None if softcap is None else float(softcap))
    impl = resolve_impl(impl, x2d, linear_weight, weight_grad_accum)
    wants_grad = torch.is_grad_enabled() and (
        input.requires_grad or linear_weight.requires_grad or (linear_bias is not None and linear_bias.requires_grad))
    if wants_grad:
        nll_tok, _ = _PerTokenLoss.apply(x2d, linear_weight, linear_bias, y, None, opts, impl,
                                         weight_grad_accum, chunk_tokens)
    elif impl == "fused":
        nll_tok, _ = _fused_ops().fused_ce_forward(x2d, linear_weight, linear_bias, y, None,
                                                   ignore_index=ignore_index, label_smoothing=0.0, z_loss=0.0,
                                                   softcap=opts.softcap)
    else:
        nll_tok, _ = chunked_loss(x2d, linear_weight, linear_bias, y, None, opts, chunk_tokens)
    return (-nll_tok).reshape(input.shape[:-1])
