"""Chunked GRPO with the gradient formed in the forward pass: three GEMMs instead of four.

With token-level importance sampling, GRPO's loss is Σ_t c_t·ℓ_t(logp_t): each token's loss reads only its
own log-prob (its ratio to old_logp, its advantage and reference log-prob), and the weights c_t of every
loss_type (`grpo.grpo_token_weights`) depend on the mask alone. So ∂L/∂logp_t is known as soon as the
row statistics of its chunk are: per chunk of any C tokens, logits GEMM → row statistics (logp, and the
entropy when asked) → g_t by autograd of the O(C) per-token loss → the in-place logits gradient → dX and
dW GEMMs. The backward only rescales the saved gradients. Same cost trade-off as the chunked SimPO: the
chunk is read once more by the second row-kernel pass. Eager only (an autograd.Function): torch.compile
takes `linear_grpo_loss`'s generic four-GEMM path.
"""

from __future__ import annotations

import torch

from fusedkern import chunked
from fusedkern.kernels.ce_rows import ce_rows
from fusedkern._validation import finish_checks, start_checks
from fusedkern.autograd import first_order_only, rescaled_grads, save_precomputed_grads


class ChunkedGRPO(torch.autograd.Function):
    """forward(x [N, H], w [V, H], b [V] | None, target [N], opts, per_token_loss, weights [N] fp32,
    weight_grad_accum, chunk_tokens, with_entropy) → (loss 0-d, logp [N], entropy [N] or [0]), where
    per_token_loss(logp_c, rows) → ℓ for the chunk's rows (a slice) is `grpo.grpo_per_token_loss` bound to
    the chunk's old/reference log-probs and advantages; logp and entropy are not differentiable."""

    @staticmethod
    def forward(ctx, x, w, b, target, opts: chunked.LossOptions, per_token_loss, weights, weight_grad_accum,
                chunk_tokens, with_entropy):
        n = x.shape[0]
        # targets out of range raise after the kernels are queued, as in every operator (no sync before)
        checks = start_checks(target, w.shape[0], opts.ignore_index, None, None, -1)
        need_dx, need_dw = x.requires_grad, w.requires_grad
        need_db = b is not None and b.requires_grad
        plan = chunked.plan_for_grads(n, w, need_dw, weight_grad_accum, chunk_tokens)
        dx, dw, db, dw_out = chunked.grad_buffers(x, w, b, need_dx, need_dw, need_db, plan)
        buf = chunked.logits_buffer(min(plan.chunk_tokens, n), w.shape[0], x,
                                    dw_out if plan.buffer_in_dw_storage else None)
        kernel_args = chunked.row_kernel_args(None, opts)
        logp = torch.empty(n, device=x.device, dtype=torch.float32)
        entropy = torch.empty(n if with_entropy else 0, device=x.device, dtype=torch.float32)
        loss = torch.zeros((), device=x.device, dtype=torch.float32)
        for i, c0 in enumerate(range(0, n, plan.chunk_tokens)):
            c1 = min(c0 + plan.chunk_tokens, n)
            rows = slice(c0, c1)
            z = chunked.logits_into(buf, x[rows], w, b)
            nll = torch.empty(c1 - c0, device=x.device, dtype=torch.float32)
            stats = torch.empty((2, c1 - c0), device=x.device, dtype=torch.float32)
            ce_rows(z, target[rows], loss=nll, stats=stats, grad=None, compute_stats=True,
                    entropy=entropy[rows] if with_entropy else None, **kernel_args)
            with torch.enable_grad():
                logp_c = (-nll).requires_grad_()
                loss_c = (per_token_loss(logp_c, rows) * weights[rows]).sum()
                g_logp, = torch.autograd.grad(loss_c, logp_c)
            loss += loss_c.detach()
            logp[rows] = -nll
            # ℓ_t = −logp_t for the row kernel: its upstream weight is −∂L/∂logp_t
            ce_rows(z, target[rows], loss=None, stats=stats, grad=(-g_logp).contiguous(), compute_stats=False,
                    per_token_grad=True, **kernel_args)
            chunked.chunk_grads(z, x[rows], w, None if dx is None else dx[rows], dw, db, first=i == 0)
        finish_checks(checks)
        save_precomputed_grads(ctx, x, w, b, dx, dw, db, dw_out)
        ctx.mark_non_differentiable(logp, entropy)
        return loss, logp, entropy

    @staticmethod
    @first_order_only
    def backward(ctx, grad_loss, _grad_logp, _grad_entropy):
        return (*rescaled_grads(ctx, grad_loss, "linear_grpo_loss (chunked)"), *([None] * 7))
