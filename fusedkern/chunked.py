"""The chunked strategy: cuBLAS GEMMs over bounded token chunks + the Triton row kernel.

For a chunk of C tokens:  Z = X_c Wᵀ (+ b) into one reused [C, V] buffer → `ce_rows` computes lse/loss
and overwrites Z with G = ∂L/∂Z → dX_c = G W → dW += Gᵀ X_c (→ db += Σ G).  Forward+backward is
three GEMMs when the upstream gradient per token is known in the forward (scalar reductions), and
four (logits recomputed in backward from the saved lse) when it is not (`reduction="none"`,
log-probabilities). The buffer size does not grow with the number of tokens:
`chunk_tokens_for(V, ...)` picks the largest C (a multiple of 64) within a byte budget.

Weight-gradient accumulation over chunks:
- `"fp32"` (default for bf16/fp16 weights): cuBLAS accumulates Gᵀ X_c straight into one fp32 [V, H]
  buffer (bf16 operands, fp32 C/D, β = 1: `aten::addmm.dtype_out`), so dW loses no precision as the
  token count grows; cost: the fp32 accumulator's memory and its read+write per chunk.
- `"weight_dtype"` (memory-lean): accumulate into the weight-dtype dW itself; each chunk rounds the
  running sum to bf16 once, so the error grows slowly with the number of chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fusedkern.kernels.ce_rows import ce_rows

MIB = 1 << 20
GRAD_CHUNK_BUDGET_BYTES = 256 * MIB  # the logits/gradient buffer when gradients are formed
LOSS_CHUNK_BUDGET_BYTES = 64 * MIB  # the logits buffer for a loss-only (no-grad) forward


@dataclass(frozen=True)
class LossOptions:
    """The per-token loss of docs/design.md: ε, z-loss, softcap, ignore_index."""

    ignore_index: int = -100
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    softcap: float | None = None



def chunk_tokens_for(n_tokens: int, vocab: int, dtype: torch.dtype, budget_bytes: int) -> int:
    """Largest multiple of 64 tokens whose [C, V] logits fit `budget_bytes` (at least 64, at most T).

    At V = 128256 in bf16: 1024 tokens (250.5 MiB) for 256 MiB, 256 tokens (62.6 MiB) for 64 MiB.
    """
    per_token = vocab * torch.empty((), dtype=dtype).element_size()
    c = max(64, (budget_bytes // per_token) // 64 * 64)
    return max(1, min(c, n_tokens))


def _logits_into(buf: torch.Tensor, x_c: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """Z = x_c Wᵀ (+ b) written into the first rows of the reused buffer. (C, V)"""
    z = buf[: x_c.shape[0]]
    if b is None:
        torch.mm(x_c, w.t(), out=z)
    else:
        torch.addmm(b, x_c, w.t(), out=z)
    return z


def _accumulate_weight_grad(acc: torch.Tensor, g: torch.Tensor, x_c: torch.Tensor, first: bool) -> None:
    """acc (+)= gᵀ x_c.  (V, C) @ (C, H) → (V, H); acc may be fp32 while g, x_c are bf16/fp16."""
    gt = g.t()
    if acc.dtype == g.dtype:
        if first:
            torch.mm(gt, x_c, out=acc)
        else:
            acc.addmm_(gt, x_c)
    elif acc.is_cuda:
        # cuBLAS: bf16 operands, fp32 accumulate *and* fp32 C/D, β = 1 — no fp32 copy of g or x_c
        if first:
            torch.ops.aten.mm.dtype_out(gt, x_c, torch.float32, out=acc)
        else:
            torch.ops.aten.addmm.dtype_out(acc, gt, x_c, torch.float32, out=acc)
    else:  # CPU (tests): no mixed-dtype GEMM there; same math, upcast operands
        if first:
            torch.mm(gt.float(), x_c.float(), out=acc)
        else:
            acc.addmm_(gt.float(), x_c.float())


def _row_kernel_args(class_weight: torch.Tensor | None, opts: LossOptions) -> dict:
    return dict(
        class_weight=class_weight,
        class_weight_sum=None if class_weight is None else class_weight.sum().reshape(1),
        ignore_index=opts.ignore_index,
        label_smoothing=opts.label_smoothing,
        z_loss=opts.z_loss,
        softcap=opts.softcap,
    )


def lse_of(stats: torch.Tensor) -> torch.Tensor:
    """Per-token log-sum-exp [T] from the saved row statistics [2, T] = (max, log Σ exp(s − max))."""
    return stats[0] + stats[1]


def _run_chunks(x, w, b, target, class_weight, opts: LossOptions, C: int, *, loss_tok, stats, compute_stats: bool,
                grad, per_token_grad: bool, dx=None, dw=None, db=None) -> None:
    """The chunk loop shared by every chunked pass: logits GEMM → row kernel → gradient GEMMs."""
    T, V = x.shape[0], w.shape[0]
    buf = torch.empty((min(C, T), V), device=x.device, dtype=x.dtype)
    kernel_args = _row_kernel_args(class_weight, opts)
    for i, c0 in enumerate(range(0, T, C)):
        c1 = min(c0 + C, T)
        x_c = x[c0:c1]
        z = _logits_into(buf, x_c, w, b)
        ce_rows(z, target[c0:c1], loss=None if loss_tok is None else loss_tok[c0:c1], stats=stats[:, c0:c1],
                grad=grad[c0:c1] if per_token_grad else grad, compute_stats=compute_stats,
                per_token_grad=per_token_grad, **kernel_args)
        if grad is not None:
            chunk_grads(z, x_c, w, None if dx is None else dx[c0:c1], dw, db, first=i == 0)


def chunked_loss(x, w, b, target, class_weight, opts: LossOptions, chunk_tokens: int | None = None):
    """Per-token loss and row statistics, no gradient: one GEMM's work, a ≤ 64 MiB logits buffer.

    x [T, H] · w [V, H] · b [V] | None · target [T] → (loss_tok [T] fp32, stats [2, T] fp32; see `lse_of`)
    """
    T, V = x.shape[0], w.shape[0]
    C = chunk_tokens or chunk_tokens_for(T, V, x.dtype, LOSS_CHUNK_BUDGET_BYTES)
    loss_tok = torch.empty(T, device=x.device, dtype=torch.float32)
    stats = torch.empty((2, T), device=x.device, dtype=torch.float32)
    _run_chunks(x, w, b, target, class_weight, opts, C, loss_tok=loss_tok, stats=stats, compute_stats=True,
                grad=None, per_token_grad=False)
    return loss_tok, stats


def grad_buffers(x, w, b, need_dx, need_dw, need_db, weight_grad_accum):
    """dx [T, H] (x's dtype), dw [V, H] (fp32 accumulator or the weight's dtype), db [V] fp32."""
    dx = torch.empty_like(x) if need_dx else None
    dw = None
    if need_dw:
        acc_dtype = torch.float32 if weight_grad_accum == "fp32" else w.dtype
        dw = torch.empty(w.shape, device=w.device, dtype=acc_dtype)
    db = torch.zeros(w.shape[0], device=w.device, dtype=torch.float32) if need_db else None
    return dx, dw, db


def chunk_grads(g, x_c, w, dx_rows, dw, db, first: bool) -> None:
    """The two gradient GEMMs of one chunk (and the bias sum). g = ∂L/∂Z_c (C, V), x_c (C, H);
    dx_rows: the chunk's rows of dX (C, H) or None."""
    if dx_rows is not None:
        torch.mm(g, w, out=dx_rows)  # (C, V) @ (V, H) → (C, H)
    if dw is not None:
        _accumulate_weight_grad(dw, g, x_c, first)
    if db is not None:
        db += torch.sum(g, dim=0, dtype=torch.float32)


def chunked_loss_and_grads(x, w, b, target, class_weight, opts: LossOptions, grad_scale: torch.Tensor, *,
                           need_dx: bool, need_dw: bool, need_db: bool, weight_grad_accum: str,
                           chunk_tokens: int | None = None):
    """Loss and gradients in one pass (three GEMMs) for a loss whose per-token weight is known.

    grad_scale: [1] fp32 on device, ∂L/∂ℓ_t shared by every non-ignored token (1/D for the mean).
    Returns (loss_tok [T], stats [2, T], dx [T, H] | None, dw [V, H] fp32 or weight dtype | None,
    db [V] fp32 | None); the caller rescales by the final upstream gradient.
    """
    T, V = x.shape[0], w.shape[0]
    C = chunk_tokens or chunk_tokens_for(T, V, x.dtype, GRAD_CHUNK_BUDGET_BYTES)
    loss_tok = torch.empty(T, device=x.device, dtype=torch.float32)
    stats = torch.empty((2, T), device=x.device, dtype=torch.float32)
    dx, dw, db = grad_buffers(x, w, b, need_dx, need_dw, need_db, weight_grad_accum)
    _run_chunks(x, w, b, target, class_weight, opts, C, loss_tok=loss_tok, stats=stats, compute_stats=True,
                grad=grad_scale, per_token_grad=False, dx=dx, dw=dw, db=db)
    return loss_tok, stats, dx, dw, db


def chunked_grads(x, w, b, target, class_weight, opts: LossOptions, stats: torch.Tensor, grad_tok: torch.Tensor, *,
                  need_dx: bool, need_dw: bool, need_db: bool, weight_grad_accum: str,
                  chunk_tokens: int | None = None):
    """Backward with a per-token upstream gradient: recompute each logits chunk (statistics saved),
    then the two gradient GEMMs. stats [2, T] from the forward; grad_tok [T] fp32 = ∂L/∂ℓ_t.
    Returns (dx, dw, db) like `chunked_loss_and_grads` (dw fp32 when accumulating in fp32)."""
    T, V = x.shape[0], w.shape[0]
    C = chunk_tokens or chunk_tokens_for(T, V, x.dtype, GRAD_CHUNK_BUDGET_BYTES)
    dx, dw, db = grad_buffers(x, w, b, need_dx, need_dw, need_db, weight_grad_accum)
    _run_chunks(x, w, b, target, class_weight, opts, C, loss_tok=None, stats=stats, compute_stats=False,
                grad=grad_tok, per_token_grad=True, dx=dx, dw=dw, db=db)
    return dx, dw, db
