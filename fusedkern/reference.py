"""Reference implementations in plain PyTorch: the one place tests and benchmarks import them from.

What lives here, and what each is for:

- `hf_linear_cross_entropy`: the seed benchmark's Hugging Face baseline exactly as it ran
  (`nn.Linear` then `nn.CrossEntropyLoss` on logits in the input dtype, no fp32 upcast).
- `upcast_linear_cross_entropy`: the modern baseline (logits in the input dtype, then `.float()`)
  with every option of the contract in docs/design.md.
- `linear_cross_entropy_fp64`, `linear_logprobs_fp64`, `linear_simpo_loss_fp64`: exact references,
  everything in float64 and differentiable, so tests can take fp64 gradients with autograd.
- `hf_linear_simpo_loss`: the seed's SimPO baseline as Liger-Kernel's benchmark ran the Hugging Face
  side (TRL's CPO-SimPO on fp32-upcast logits).
- `cublas_3gemm`, `cublas_1gemm`: the GEMM floor the benchmarks compare the fused op to.
- `fp64_linear_cross_entropy_grads_chunked`: the benchmark's accuracy oracle, the fp64 mean
  cross-entropy and its gradients chunk by chunk where the whole fp64 logits would not fit.
- `cross_entropy_from_logits`, `target_logprobs`, `simpo_from_logprobs`, `logits_to_mean_ce_grad_`,
  `softcap_with_derivative_`: the building blocks, on logits or log-probs, shared with the benchmark.

The loss math follows docs/design.md exactly. The cross-entropy core is written with explicit
logsumexp arithmetic rather than `F.cross_entropy`, so that testing it against torch is an
independent check of both. Shapes: T tokens, H hidden, V vocab, B pairs, S sequence.

Size (> 400 lines): every reference of the project, on purpose: one place to import them from.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "hf_linear_cross_entropy",
    "upcast_linear_cross_entropy",
    "linear_cross_entropy_fp64",
    "linear_logprobs_fp64",
    "hf_linear_simpo_loss",
    "linear_simpo_loss_fp64",
    "cublas_3gemm",
    "cublas_1gemm",
    "fp64_linear_cross_entropy_grads_chunked",
    "cross_entropy_from_logits",
    "target_logprobs",
    "simpo_from_logprobs",
    "logits_to_mean_ce_grad_",
    "softcap_with_derivative_",
    "SIMPO_METRIC_KEYS",
]

_REDUCTIONS = ("none", "sum", "mean")

# TRL's CPOTrainer metric names, in the order TRL logs them.
SIMPO_METRIC_KEYS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
    "nll_loss",
)


# ----------------------------------------------------------------------------------------------
# Shared building blocks
# ----------------------------------------------------------------------------------------------


def _check_options(reduction: str, label_smoothing: float, softcap: float | None) -> None:
    # Minimal checks so that a typo in a test cannot silently select another formula.
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    _check_softcap(softcap)


def _check_softcap(softcap: float | None) -> None:
    if softcap is not None and not softcap > 0.0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap}")


def _apply_softcap(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """s = c·tanh(z/c) (Gemma 2's logit softcap), or z unchanged when c is None."""
    if softcap is None:
        return logits
    return softcap * torch.tanh(logits / softcap)


def _logsumexp(s: torch.Tensor) -> torch.Tensor:
    """lse over the last axis, [..., V] -> [...], written out instead of calling torch.logsumexp.

    The max shift is detached: it cancels exactly in the math, and detaching it keeps autograd from
    routing a (mathematically zero) gradient through `amax`, whose tie-breaking is arbitrary.
    """
    m = s.amax(dim=-1, keepdim=True).detach()  # [..., 1]
    return m.squeeze(-1) + torch.log(torch.exp(s - m).sum(dim=-1))  # [...]


def _safe_target(target: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask, target with ignored entries replaced by class 0 so that gathers stay in range)."""
    mask = target != ignore_index  # [...] bool
    return mask, torch.where(mask, target, torch.zeros_like(target))


def cross_entropy_from_logits(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    weight: torch.Tensor | None = None,
    reduction: str = "mean",
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    return_lse: bool = False,
):
    """Cross-entropy with every option of docs/design.md, computed in `logits.dtype`.

    logits: [..., V] raw logits z; target: [...] int64; weight: [V] class weights or None.
    Per token t with y_t != ignore_index:
        ℓ_t = (1−ε)·w_y·(lse − s_y) + (ε/V)·Σ_v w_v·(lse − s_v) + z_loss·lse²,   s = softcap(z)
    and ℓ_t = 0 for ignored tokens. "mean" divides Σ_t ℓ_t by D = Σ_{t not ignored} w_{y_t}
    (torch's normalization; all ignored gives 0/0 = NaN, as torch does).
    Returns the loss ([...] for "none", 0-d otherwise), or (loss, lse) with lse: [...] in
    `logits.dtype`, the lse of the softcapped logits for every token, ignored ones included.
    """
    _check_options(reduction, label_smoothing, softcap)
    vocab = logits.shape[-1]
    s = _apply_softcap(logits, softcap)  # [..., V]
    lse = _logsumexp(s)  # [...]

    mask, safe_target = _safe_target(target, ignore_index)
    s_target = s.gather(-1, safe_target.unsqueeze(-1)).squeeze(-1)  # [...]
    if weight is None:
        w = torch.ones(vocab, dtype=s.dtype, device=s.device)  # [V]
    else:
        w = weight.to(s.dtype)  # [V]
    w_target = w[safe_target]  # [...]

    loss = (1.0 - label_smoothing) * w_target * (lse - s_target)  # [...]
    if label_smoothing > 0.0:
        # (ε/V)·Σ_v w_v·(lse − s_v) = (ε/V)·(W_sum·lse − Σ_v w_v·s_v)
        smooth = w.sum() * lse - (s * w).sum(dim=-1)  # [...]
        loss = loss + (label_smoothing / vocab) * smooth
    if z_loss != 0.0:
        # Not class-weighted (design.md); it shares the "mean" denominator below.
        loss = loss + z_loss * lse * lse
    # torch.where, not a multiply: an ignored token's loss must be exactly 0 even if it were inf.
    loss = torch.where(mask, loss, torch.zeros_like(loss))  # [...]

    if reduction == "sum":
        loss = loss.sum()
    elif reduction == "mean":
        denominator = torch.where(mask, w_target, torch.zeros_like(w_target)).sum()
        loss = loss.sum() / denominator  # 0/0 = NaN when every token is ignored, like torch
    return (loss, lse) if return_lse else loss


def target_logprobs(
    logits: torch.Tensor, target: torch.Tensor, *, ignore_index: int, softcap: float | None
) -> torch.Tensor:
    """logp_t = s_{t,y_t} − lse_t, 0 where ignored. logits [..., V] -> [...] in logits.dtype."""
    s = _apply_softcap(logits, softcap)  # [..., V]
    mask, safe_target = _safe_target(target, ignore_index)
    logp = s.gather(-1, safe_target.unsqueeze(-1)).squeeze(-1) - _logsumexp(s)  # [...]
    return torch.where(mask, logp, torch.zeros_like(logp))


def _fp64_logits(
    input: torch.Tensor, linear_weight: torch.Tensor, linear_bias: torch.Tensor | None
) -> torch.Tensor:
    """z = x Wᵀ + b with every operand upcast to float64 first (no rounding before the matmul)."""
    bias64 = None if linear_bias is None else linear_bias.double()
    return F.linear(input.double(), linear_weight.double(), bias64)  # [..., V] float64


# ----------------------------------------------------------------------------------------------
# Cross-entropy
# ----------------------------------------------------------------------------------------------


def hf_linear_cross_entropy(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    *,
    linear_bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """The seed benchmark's Hugging Face baseline, exactly as it ran.

    `nn.Linear` then `nn.CrossEntropyLoss`: the logits stay in the input dtype (bf16 logits for
    bf16 input, no fp32 upcast) and the loss comes back in that dtype too.
    input [..., H], linear_weight [V, H], target [...] -> loss 0-d, or [...] for "none".
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    logits = F.linear(input, linear_weight, linear_bias)  # [..., V], input dtype
    loss = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),  # [T, V]
        target.reshape(-1),  # [T]
        ignore_index=ignore_index,
        reduction=reduction,
    )
    return loss.reshape(target.shape) if reduction == "none" else loss


def upcast_linear_cross_entropy(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    *,
    linear_bias: torch.Tensor | None = None,
    **options,
):
    """The modern baseline: logits GEMM in the input dtype, then `.float()`, then the loss in fp32.

    input [..., H], linear_weight [V, H], target [...] int64, linear_bias [V]; options: those of
    `cross_entropy_from_logits`, with its defaults (weight [V] class weights, reduction, ignore_index,
    label_smoothing, z_loss, softcap, return_lse). Returns loss (fp32; [...] for "none") or (loss, lse)
    with lse [...] fp32. Materializes the [T, V] logits twice (input dtype and fp32): this is the memory
    it costs.
    """
    return cross_entropy_from_logits(F.linear(input, linear_weight, linear_bias).float(), target, **options)


def linear_cross_entropy_fp64(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    *,
    linear_bias: torch.Tensor | None = None,
    **options,
):
    """Exact reference: every operand upcast to float64 before the matmul, loss in float64.

    Same signature and semantics as `upcast_linear_cross_entropy`; loss (and lse) are float64.
    Differentiable: autograd gives float64-accurate gradients, cast back to each input's dtype.
    """
    return cross_entropy_from_logits(_fp64_logits(input, linear_weight, linear_bias), target, **options)


def linear_logprobs_fp64(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    *,
    linear_bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    softcap: float | None = None,
) -> torch.Tensor:
    """Per-token target log-probabilities in float64: logp_t = s_{t,y_t} − lse_t, 0 where ignored.

    input [..., H], linear_weight [V, H], target [...] -> [...] float64, differentiable.
    """
    _check_softcap(softcap)
    return target_logprobs(
        _fp64_logits(input, linear_weight, linear_bias),
        target,
        ignore_index=ignore_index,
        softcap=softcap,
    )


# ----------------------------------------------------------------------------------------------
# SimPO (TRL CPOTrainer, loss_type="simpo")
# ----------------------------------------------------------------------------------------------


def simpo_from_logprobs(
    logps: torch.Tensor,
    mask: torch.Tensor,
    *,
    beta: float = 0.1,
    gamma: float = 0.5,
    alpha: float = 1.0,
    label_smoothing: float = 0.0,
    chosen_nll: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The O(B·S) part of CPO-SimPO: per-token log-probs -> (loss, metrics), in `logps.dtype`.

    logps [2B, S] target log-probs (any value where masked: they are zeroed here), mask [2B, S]
    bool (True = token counts). Rows 0..B−1 are chosen, B..2B−1 rejected, paired by index.
    A_i = Σ_t logp_it / max(n_i, 1): an all-ignored response gets A = 0 instead of the NaN every
    public implementation produces, so the pair stays finite and only the other response gets a
    gradient. NLL = −Σ_{chosen non-ignored} logp / max(N_w, 1), or `chosen_nll` when given (the
    Hugging Face path computes it with its own cross-entropy pass, as TRL does: same value).
    """
    if logps.shape[0] % 2 != 0:
        raise ValueError(f"SimPO needs an even leading dimension (chosen then rejected), got {logps.shape[0]}")
    n_pairs = logps.shape[0] // 2
    logps = torch.where(mask, logps, torch.zeros_like(logps))  # [2B, S]
    n_tokens = mask.sum(dim=-1).clamp_min(1).to(logps.dtype)  # [2B]
    avg_logps = logps.sum(dim=-1) / n_tokens  # [2B], A (length-normalized)
    chosen_avg, rejected_avg = avg_logps[:n_pairs], avg_logps[n_pairs:]  # [B], [B]

    # TRL writes logits = (A_w − A_l) − γ/β and then logσ(β·logits): the same z = β(A_w − A_l) − γ.
    z = beta * (chosen_avg - rejected_avg) - gamma  # [B]
    losses = -(1.0 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)  # [B]

    if chosen_nll is None:
        n_chosen_tokens = mask[:n_pairs].sum().clamp_min(1).to(logps.dtype)  # 0-d, max(N_w, 1)
        nll = -logps[:n_pairs].sum() / n_chosen_tokens  # 0-d
    else:
        nll = chosen_nll
    # Same order of terms as the Hugging Face side of Liger's benchmark: nll·α + mean(losses).
    loss = nll * alpha + losses.mean()

    chosen_rewards = (beta * chosen_avg).detach()  # [B]
    rejected_rewards = (beta * rejected_avg).detach()  # [B]
    metrics = {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).to(logps.dtype).mean(),
        "logps/chosen": chosen_avg.detach().mean(),
        "logps/rejected": rejected_avg.detach().mean(),
        "nll_loss": nll.detach(),
    }
    return loss, metrics


def hf_linear_simpo_loss(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    *,
    linear_bias: torch.Tensor | None = None,
    beta: float = 0.1,
    gamma: float = 0.5,
    alpha: float = 1.0,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The seed's SimPO baseline, as Liger-Kernel's benchmark ran the Hugging Face (TRL) side.

    Logits GEMM in the input dtype, `.float()` on the whole [2B, S, V] logits, `log_softmax`,
    gather of the targets, length-normalized average, TRL's CPO-SimPO loss, plus α·NLL from a
    separate cross-entropy over the chosen half of the fp32 logits (TRL's second pass, kept because
    its time and memory are part of what the baseline costs).
    input [2B, S, H] (first B rows chosen, last B rejected), target [2B, S].
    Returns (loss fp32 0-d, metrics: dict of detached fp32 0-d tensors, keys SIMPO_METRIC_KEYS).

    Differences from the code that ran, both only where that code returned NaN: all-ignored
    responses average to 0 (max(n, 1)) and an all-ignored chosen half gives NLL = 0 (the
    cross-entropy is summed, then divided by max(N_w, 1)). TRL's "logits/chosen" and
    "logits/rejected" means are not computed.
    """
    if input.shape[0] % 2 != 0:
        raise ValueError(f"SimPO needs an even leading dimension (chosen then rejected), got {input.shape[0]}")
    n_pairs = input.shape[0] // 2
    logits_fp32 = F.linear(input, linear_weight, linear_bias).float()  # [2B, S, V]
    mask, safe_target = _safe_target(target, ignore_index)  # [2B, S]
    logps = logits_fp32.log_softmax(dim=-1).gather(-1, safe_target.unsqueeze(-1)).squeeze(-1)  # [2B, S]

    chosen_nll_sum = F.cross_entropy(
        logits_fp32[:n_pairs].reshape(-1, logits_fp32.shape[-1]),  # [B·S, V]
        target[:n_pairs].reshape(-1),  # [B·S]
        ignore_index=ignore_index,
        reduction="sum",
    )
    chosen_nll = chosen_nll_sum / mask[:n_pairs].sum().clamp_min(1)  # 0-d, /max(N_w, 1)
    return simpo_from_logprobs(
        logps, mask, beta=beta, gamma=gamma, alpha=alpha, label_smoothing=label_smoothing,
        chosen_nll=chosen_nll,
    )


def linear_simpo_loss_fp64(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    *,
    linear_bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    softcap: float | None = None,
    **simpo_args,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Exact CPO-SimPO reference: the semantics of `hf_linear_simpo_loss` (plus a logit softcap), with
    every operand upcast to float64 before the matmul. simpo_args: beta, gamma, alpha, label_smoothing,
    with `simpo_from_logprobs`' defaults (TRL's). Loss and metrics are float64; the loss is
    differentiable (float64 gradients through autograd).
    """
    logps = linear_logprobs_fp64(
        input, linear_weight, target, linear_bias=linear_bias, ignore_index=ignore_index, softcap=softcap
    )  # [2B, S] float64
    return simpo_from_logprobs(logps, target != ignore_index, **simpo_args)


# ----------------------------------------------------------------------------------------------
# The GEMM floor
# ----------------------------------------------------------------------------------------------


def cublas_3gemm(
    x2d: torch.Tensor, w: torch.Tensor, grad_logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The floor of the fused op, forward + backward: the three GEMMs it cannot avoid.

    logits = x Wᵀ [T, V], dX = G W [T, H], dW = Gᵀ x [V, H], each 2·T·H·V FLOPs (cuBLAS on a GPU).
    x2d [T, H], w [V, H], grad_logits G [T, V] (any values: only the GEMM work is measured).
    A fused op that forms G while the logits are computed does exactly this work plus an O(T·V)
    epilogue; one that recomputes the logits in backward does a fourth GEMM.
    """
    logits = x2d @ w.T  # [T, V]
    grad_input = grad_logits @ w  # [T, H]
    grad_weight = grad_logits.T @ x2d  # [V, H]
    return logits, grad_input, grad_weight


def cublas_1gemm(x2d: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The floor of the loss-only (no-grad) op: the logits GEMM alone, x [T, H] @ Wᵀ -> [T, V]."""
    return x2d @ w.T


# ----------------------------------------------------------------------------------------------
# The benchmark's accuracy oracle (fp64, chunked)
# ----------------------------------------------------------------------------------------------


def softcap_with_derivative_(logits: torch.Tensor, softcap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: z [C, V] → s = c·tanh(z/c); returns (s, ds/dz = 1 − tanh²(z/c))."""
    tanh = logits.div_(softcap).tanh_()
    derivative = 1.0 - tanh.square()
    return tanh.mul_(softcap), derivative


def logits_to_mean_ce_grad_(logits: torch.Tensor, target: torch.Tensor, valid: torch.Tensor, count: torch.Tensor,
                             lse: torch.Tensor | None = None, dsoftcap: torch.Tensor | None = None) -> torch.Tensor:
    """In place: logits [C, V] → ∂(mean cross-entropy)/∂z = (softmax − one-hot)/count on the valid rows,
    0 on ignored ones. target [C] (any value where not valid), valid [C] bool, count 0-d, lse [C] if known.
    With a softcap pass the softcapped logits s and dsoftcap = ds/dz = 1 − tanh²(z/c) [C, V]: the result
    is then (softmax(s) − one-hot)·ds/dz."""
    lse = torch.logsumexp(logits, dim=-1) if lse is None else lse
    grad = logits.sub_(lse[:, None]).exp_()  # softmax
    rows = torch.arange(logits.shape[0], device=logits.device)
    grad[rows, torch.where(valid, target, 0)] -= valid.to(grad.dtype)  # − one-hot where the token counts
    if dsoftcap is not None:
        grad.mul_(dsoftcap)
    return grad.mul_((valid.to(grad.dtype) / count)[:, None])


def fp64_linear_cross_entropy_grads_chunked(
    x: torch.Tensor,
    w: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    chunk_tokens: int = 1024,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact mean cross-entropy of `x @ w.T` (softcapped to c·tanh(z/c) when `softcap` is given) and its
    gradients, in float64, chunk by chunk.

    x [..., H], w [V, H], target [...] int64 -> (loss 0-d, dX shaped like x, dW [V, H]), float64.
    The truth the accuracy sweep compares against at 32768 × 128256, where the whole fp64 logits
    (34 GB) and autograd's copies of them would not fit: per chunk of `chunk_tokens` tokens the
    logits are formed in float64 ([C, V], 1 GB at C = 1024), turned in place into
    G = (softmax − onehot)/N (N = non-ignored tokens, ignored rows 0), then dX_chunk = G W and
    dW += Gᵀ x_chunk. Same math as `linear_cross_entropy_fp64` (mean
    reduction; all tokens ignored gives NaN like torch), which the tests check it against.
    """
    hidden = x.shape[-1]
    x2d = x.detach().reshape(-1, hidden)  # [T, H]
    flat_target = target.reshape(-1)  # [T]
    w64 = w.detach().double()  # [V, H]
    mask = flat_target != ignore_index  # [T]
    n_valid = mask.sum().double()  # 0-d
    loss_sum = torch.zeros((), dtype=torch.float64, device=x.device)
    grad_x = torch.empty(x2d.shape, dtype=torch.float64, device=x.device)  # [T, H]
    grad_w = torch.zeros_like(w64)  # [V, H]
    for start in range(0, x2d.shape[0], chunk_tokens):
        stop = min(start + chunk_tokens, x2d.shape[0])
        x_chunk = x2d[start:stop].double()  # [C, H]
        valid = mask[start:stop]  # [C]
        safe_target = torch.where(valid, flat_target[start:stop], 0)  # [C], in range for gathers
        logits = x_chunk @ w64.T  # [C, V]
        dsoftcap = None
        if softcap is not None:
            logits, dsoftcap = softcap_with_derivative_(logits, softcap)  # s [C, V], ds/dz [C, V]
        lse = torch.logsumexp(logits, dim=-1)  # [C]
        picked = logits.gather(1, safe_target[:, None]).squeeze(1)  # [C]
        loss_sum += torch.where(valid, lse - picked, 0.0).sum()
        grad = logits_to_mean_ce_grad_(logits, safe_target, valid, n_valid, lse, dsoftcap)  # [C, V], in place
        grad_x[start:stop] = grad @ w64
        grad_w.addmm_(grad.T, x_chunk)
    return loss_sum / n_valid, grad_x.reshape(x.shape), grad_w


# ----------------------------------------------------------------------------------------------
# Preference losses: TRL's DPOTrainer (sigmoid, ipo, hinge, robust), CPOTrainer (cpo, simpo),
# ORPOTrainer (orpo), KTOTrainer (kto) — written from the formulas, independently of
# fusedkern.preference (softplus rather than logsigmoid, per-group masks rather than slices), so
# the tests compare two derivations. Same conventions: summed log-probs S, averages A = S/max(n, 1),
# an ORPO pair with an empty response contributes 0, NLL over the chosen targets /max(N_w, 1).
# ----------------------------------------------------------------------------------------------


def preference_from_logprobs(
    logps: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str,
    beta: float = 0.1,
    gamma: float = 0.5,
    alpha: float | None = None,
    label_smoothing: float = 0.0,
    reference_free: bool = False,
    ref_chosen_logps: torch.Tensor | None = None,
    ref_rejected_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    kto_labels: torch.Tensor | None = None,
    kl: torch.Tensor | None = None,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token log-probs [R, S] (mask [R, S] bool) -> (loss 0-d, metrics) in `logps.dtype`, for
    loss_type in sigmoid/ipo/hinge/robust/cpo/simpo/orpo (R = 2B, chosen rows first) and kto (R = N,
    kto_labels [N] bool, ref_logps [N], kl one element). alpha None: 1 for cpo/simpo/orpo, else 0."""
    dt = logps.dtype
    logps = torch.where(mask, logps, torch.zeros_like(logps))
    n = mask.to(dt).sum(dim=-1)  # [R]
    s = logps.sum(dim=-1)  # [R]
    a = s / torch.clamp(n, min=1.0)  # [R]
    eps = label_smoothing

    def smoothed(z):  # −(1−ε)·logσ(z) − ε·logσ(−z) with −logσ(x) = softplus(−x)
        return (1 - eps) * F.softplus(-z) + eps * F.softplus(z)

    if loss_type == "kto":
        z0 = torch.clamp(kl.detach().reshape(()).to(dt), min=0.0)
        want = kto_labels
        r = s - ref_logps.to(dt)  # [N]
        per_seq = torch.zeros_like(r)
        per_seq = per_seq + want.to(dt) * desirable_weight * torch.sigmoid(-beta * (r - z0))  # 1 − σ(x) = σ(−x)
        per_seq = per_seq + (~want).to(dt) * undesirable_weight * torch.sigmoid(-beta * (z0 - r))
        reward = beta * r.detach()
        chosen_reward = reward[want].sum() / want.to(dt).sum()
        rejected_reward = reward[~want].sum() / (~want).to(dt).sum()
        return per_seq.mean(), {
            "kl": z0,
            "rewards/chosen": chosen_reward,
            "rewards/rejected": rejected_reward,
            "rewards/margins": chosen_reward - rejected_reward,
            "logps/chosen": s.detach()[want].sum() / want.to(dt).sum(),
            "logps/rejected": s.detach()[~want].sum() / (~want).to(dt).sum(),
        }

    pairs = logps.shape[0] // 2
    chosen = torch.arange(logps.shape[0], device=logps.device) < pairs  # [2B]
    s_w, s_l, a_w, a_l, n_w, n_l = s[chosen], s[~chosen], a[chosen], a[~chosen], n[chosen], n[~chosen]
    nll = -(s_w.sum()) / torch.clamp(n_w.sum(), min=1.0)
    if alpha is None:
        alpha = 1.0 if loss_type in ("cpo", "simpo", "orpo") else 0.0
    extra = {}
    if loss_type in ("sigmoid", "ipo", "hinge", "robust"):
        if reference_free:
            rw = rl = torch.zeros_like(s_w)
        else:
            rw, rl = ref_chosen_logps.to(dt), ref_rejected_logps.to(dt)
        if loss_type == "ipo":
            h = (s_w - rw) / torch.clamp(n_w, min=1.0) - (s_l - rl) / torch.clamp(n_l, min=1.0)
            per_pair = (h - 1.0 / (2.0 * beta)) ** 2
        else:
            h = (s_w - rw) - (s_l - rl)
            if loss_type == "sigmoid":
                per_pair = smoothed(beta * h)
            elif loss_type == "robust":
                per_pair = ((1 - eps) * F.softplus(-beta * h) - eps * F.softplus(beta * h)) / (1 - 2 * eps)
            else:
                per_pair = torch.clamp(1 - beta * h, min=0.0)
        lw, ll = (a_w, a_l) if (reference_free and loss_type == "ipo") else (s_w, s_l)
        reward_w, reward_l = beta * (lw - rw), beta * (ll - rl)
    elif loss_type == "cpo":
        per_pair = smoothed(beta * (s_w - s_l))
        lw, ll = s_w, s_l
        reward_w, reward_l = beta * s_w, beta * s_l
    elif loss_type == "simpo":
        per_pair = smoothed(beta * (a_w - a_l) - gamma)
        lw, ll = a_w, a_l
        reward_w, reward_l = beta * a_w, beta * a_l
    elif loss_type == "orpo":
        ok = (n_w > 0) & (n_l > 0)
        pw, pl = torch.where(ok, a_w, -torch.ones_like(a_w)), torch.where(ok, a_l, -torch.ones_like(a_l))

        def log_one_minus_p(x):  # log(1 − eˣ), x < 0
            return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))
        odds = (pw - log_one_minus_p(pw)) - (pl - log_one_minus_p(pl))
        odds = odds * ok.to(dt)
        log_sig = -F.softplus(-odds) * ok.to(dt)
        per_pair = -beta * log_sig
        extra = {"log_odds_ratio": log_sig.detach().mean(), "log_odds_chosen": odds.detach().mean()}
        lw, ll = a_w, a_l
        reward_w, reward_l = beta * a_w, beta * a_l
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}")
    reward_w, reward_l = reward_w.detach(), reward_l.detach()
    loss = per_pair.mean() + alpha * nll
    return loss, {
        "rewards/chosen": reward_w.mean(),
        "rewards/rejected": reward_l.mean(),
        "rewards/margins": (reward_w - reward_l).mean(),
        "rewards/accuracies": (reward_w > reward_l).to(dt).mean(),
        "logps/chosen": lw.detach().mean(),
        "logps/rejected": ll.detach().mean(),
        "nll_loss": nll.detach(),
        **extra,
    }


def _float_tensors_to(loss_args: dict, dtype: torch.dtype) -> dict:
    """The loss arguments with every floating-point tensor among them (reference log-probs, kl) cast to dtype."""
    return {k: (v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
            for k, v in loss_args.items()}


def linear_preference_loss_fp64(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    *,
    linear_bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    softcap: float | None = None,
    **loss_args,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Exact reference of `fusedkern.linear_preference_loss`: the logits materialized in float64,
    then `preference_from_logprobs` in float64 (reference log-probs and kl cast to float64).
    Differentiable; input [R, S, H], linear_weight [V, H], target [R, S]."""
    logps = linear_logprobs_fp64(input, linear_weight, target, linear_bias=linear_bias,
                                 ignore_index=ignore_index, softcap=softcap)  # [R, S] float64
    return preference_from_logprobs(logps, target != ignore_index, **_float_tensors_to(loss_args, torch.float64))


def upcast_linear_preference_loss(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    *,
    linear_bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    softcap: float | None = None,
    **loss_args,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """TRL's own computation: logits GEMM in the input dtype, `.float()` on the whole [R, S, V] logits,
    (softcap,) log_softmax, gather, then `preference_from_logprobs` in float32. The same-dtype
    yardstick of the accuracy rule, and what a materializing trainer costs."""
    logits = F.linear(input, linear_weight, linear_bias).float()  # [R, S, V]
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    mask, safe_target = _safe_target(target, ignore_index)
    logps = logits.log_softmax(dim=-1).gather(-1, safe_target.unsqueeze(-1)).squeeze(-1)  # [R, S]
    return preference_from_logprobs(logps, mask, **_float_tensors_to(loss_args, torch.float32))


# ----------------------------------------------------------------------------------------------
# Policy-gradient family: tempered log-probs, entropy, GRPO (TRL GRPOTrainer), from the formulas
# ----------------------------------------------------------------------------------------------


def linear_logprobs_entropy_fp64(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    *,
    linear_bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    softcap: float | None = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p_t(y_t), H_t) in float64 under p = softmax(softcap(x Wᵀ + b) / τ), both 0 where ignored.

    Softcap first, then the temperature (Gemma-2 sampling in vLLM, verl's log-probs). H_t = −Σ_v p_v log p_v.
    input [..., H], linear_weight [V, H], target [...] -> two [...] float64 tensors, differentiable.
    """
    _check_softcap(softcap)
    s = _apply_softcap(_fp64_logits(input, linear_weight, linear_bias), softcap) / float(temperature)  # [..., V]
    log_p = s - torch.logsumexp(s, dim=-1, keepdim=True)
    mask, safe_target = _safe_target(target, ignore_index)
    logp = log_p.gather(-1, safe_target.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    zero = torch.zeros_like(logp)
    return torch.where(mask, logp, zero), torch.where(mask, entropy, zero)


def mean_logits_fp64(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    *,
    linear_bias: torch.Tensor | None = None,
    softcap: float | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """(1/V)·Σ_v softcap(x Wᵀ + b)_v / τ in float64, every row (TRL's `mean_logits`: the mean of the logits the
    softmax sees). input [..., H], linear_weight [V, H] -> [...] float64."""
    _check_softcap(softcap)
    return (_apply_softcap(_fp64_logits(input, linear_weight, linear_bias), softcap) / float(temperature)).mean(-1)


def grpo_loss_from_logps(
    logps: torch.Tensor,
    mask: torch.Tensor,
    *,
    advantages: torch.Tensor,
    old_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    beta: float = 0.0,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    loss_type: str = "dapo",
    max_completion_length: int | None = None,
    num_items_in_batch: float | None = None,
) -> torch.Tensor:
    """TRL GRPOTrainer's loss (token-level importance sampling), written from its formulas in plain PyTorch.

    logps, mask [B, T]; advantages [B] or [B, T]. ratio r = exp(logp − old) (old = logp.detach() when None),
    per-token loss −min(r·A, clip(r, 1 − ε, 1 + ε_high)·A) + β·(exp(ref − logp) − (ref − logp) − 1);
    "grpo": mean over sequences of each one's token mean; "bnpo": token mean over the batch; "dapo": token
    sum / num_items_in_batch (the batch's token count by default); "dr_grpo": token sum / (B·max_completion_length).
    """
    eps_high = epsilon if epsilon_high is None else epsilon_high
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    old = logps.detach() if old_logps is None else old_logps
    m = mask.to(logps.dtype)
    ratio = torch.exp(logps - old)
    per_token = -torch.min(ratio * adv, torch.clamp(ratio, 1 - epsilon, 1 + eps_high) * adv)
    if beta != 0.0:
        d = ref_logps - logps
        per_token = per_token + beta * (torch.exp(d) - d - 1)
    total = (per_token * m).sum()
    if loss_type == "grpo":
        return ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return total / m.sum().clamp(min=1.0)
    if loss_type == "dapo":
        # a given count divides as given: TRL's divisor, spread over ranks, may be below 1
        return total / (m.sum().clamp(min=1.0) if num_items_in_batch is None else float(num_items_in_batch))
    if loss_type == "dr_grpo":
        return total / (logps.shape[0] * max_completion_length)
    raise ValueError(f"unknown loss_type {loss_type!r}")


# ----------------------------------------------------------------------------------------------
# Distillation (a student's LM head against a teacher's): TRL's `generalized_jsd_loss` convention
# ----------------------------------------------------------------------------------------------

__all__ += ["distillation_from_logits", "model_logits", "linear_distillation_loss_fp64",
            "upcast_linear_distillation_loss"]


def distillation_from_logits(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                             target: torch.Tensor | None = None, *, beta: float = 0.5, temperature: float = 1.0,
                             ignore_index: int = -100, reduction: str = "mean", weight_hard_loss: float = 0.0,
                             weight_soft_loss: float = 1.0) -> torch.Tensor:
    """ℓ_t = weight_soft_loss·D_β(softmax(z_s/τ), softmax(z_t/τ)) + weight_hard_loss·CE(z_s, y_t), in the logits' dtype.

    D as TRL's GKD `generalized_jsd_loss` (F.kl_div with log targets): β = 0 KL(teacher‖student), β = 1
    KL(student‖teacher), else β·KL(q‖m) + (1 − β)·KL(p‖m) with m = (1 − β)p + βq (p student, q teacher).
    The hard-label cross-entropy uses the student's logits without temperature (Liger's distillation base).
    Rows whose target is ignore_index count nothing; "mean" divides by the valid rows, at least 1 (TRL's
    clamp: all ignored gives 0), or by the number of rows without a target."""
    lp = F.log_softmax(student_logits / temperature, dim=-1)
    lq = F.log_softmax(teacher_logits / temperature, dim=-1)
    if beta == 0:
        div = F.kl_div(lp, lq, reduction="none", log_target=True).sum(-1)
    elif beta == 1:
        div = F.kl_div(lq, lp, reduction="none", log_target=True).sum(-1)
    else:
        b = torch.tensor(beta, dtype=lp.dtype, device=lp.device)
        lm = torch.logsumexp(torch.stack([lp + torch.log1p(-b), lq + torch.log(b)]), dim=0)
        div = (b * F.kl_div(lm, lq, reduction="none", log_target=True)
               + (1 - b) * F.kl_div(lm, lp, reduction="none", log_target=True)).sum(-1)
    loss = weight_soft_loss * div
    if target is not None:
        valid, safe = _safe_target(target, ignore_index)
        if weight_hard_loss:
            ce = torch.logsumexp(student_logits, -1) - student_logits.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
            loss = loss + weight_hard_loss * ce
        loss = torch.where(valid, loss, torch.zeros_like(loss))
        count = valid.sum()
    else:
        count = torch.tensor(loss.numel(), device=loss.device)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / count.clamp(min=1)


def model_logits(head_output: torch.Tensor, logit_scale: float = 1.0, softcap: float | None = None) -> torch.Tensor:
    """A model's logits from its head's output, in TRL DistillationTrainer's order: ·logit_scale, then softcap."""
    z = head_output * logit_scale if logit_scale != 1.0 else head_output
    return z if softcap is None else softcap * torch.tanh(z / softcap)


def linear_distillation_loss_fp64(student_hidden: torch.Tensor, student_weight: torch.Tensor,
                                  teacher_hidden: torch.Tensor, teacher_weight: torch.Tensor,
                                  target: torch.Tensor | None = None, *, student_bias: torch.Tensor | None = None,
                                  teacher_bias: torch.Tensor | None = None, student_logit_scale: float = 1.0,
                                  student_softcap: float | None = None, teacher_logit_scale: float = 1.0,
                                  teacher_softcap: float | None = None, **options) -> torch.Tensor:
    """Exact reference of `fusedkern.linear_distillation_loss`: both heads' logits and the loss in float64,
    differentiable (autograd gives the fp64 gradients of the student's operands)."""
    zs = model_logits(_fp64_logits(student_hidden, student_weight, student_bias), student_logit_scale, student_softcap)
    zt = model_logits(_fp64_logits(teacher_hidden, teacher_weight, teacher_bias), teacher_logit_scale, teacher_softcap)
    return distillation_from_logits(zs, zt, target, **options)


def upcast_linear_distillation_loss(student_hidden: torch.Tensor, student_weight: torch.Tensor,
                                    teacher_hidden: torch.Tensor, teacher_weight: torch.Tensor,
                                    target: torch.Tensor | None = None, *, student_bias: torch.Tensor | None = None,
                                    teacher_bias: torch.Tensor | None = None, student_logit_scale: float = 1.0,
                                    student_softcap: float | None = None, teacher_logit_scale: float = 1.0,
                                    teacher_softcap: float | None = None, **options) -> torch.Tensor:
    """The materialized baseline: both [T, V] logits in the inputs' dtype, then `.float()` and the loss in
    fp32 (what a trainer computing TRL's `generalized_jsd_loss` on upcast logits does); the teacher's
    logits under no_grad. Each model's logit scale and softcap are applied in fp32."""
    zs = model_logits(F.linear(student_hidden, student_weight, student_bias).float(), student_logit_scale,
                      student_softcap)
    with torch.no_grad():
        zt = model_logits(F.linear(teacher_hidden, teacher_weight, teacher_bias).float(), teacher_logit_scale,
                          teacher_softcap)
    return distillation_from_logits(zs, zt, target, **options)
