"""Preference losses with the gradient formed in the forward pass: three GEMMs instead of four.

Every loss of `fusedkern.preference` is L = Σ over pairs (KTO: over sequences) of a term that reads only
its own pair's (sequence's) log-probs, plus the chosen NLL whose normalizer N_w comes from the targets
alone; the KTO KL is a detached constant. So ∂L/∂log p on the tokens of a chunk holding whole pairs
(whole sequences) is exact as soon as that chunk's log-probs are known, whatever the other rows hold:
it is autograd of the O(R·S) tail (`preference_loss_from_logps`) evaluated with the chunk's rows filled
in, an R·S-sized computation per chunk next to the chunk's three GEMMs. The per-token gradient is then
written into the logits chunk in place and the dX / dW GEMMs follow, as for SimPO
(`fusedkern/simpo_chunked.py`, whose chunks also hold whole pairs). When a chunk cannot hold one pair
(one sequence) the caller falls back to the generic four-GEMM path (`preference_plan`).
"""

from __future__ import annotations

import torch

from fusedkern import chunked
from fusedkern.kernels.ce_rows import ce_rows
from fusedkern._validation import finish_checks, start_checks
from fusedkern.autograd import first_order_only, rescaled_grads, save_precomputed_grads


def preference_plan(n_rows: int, seq: int, paired: bool, w: torch.Tensor, need_dw: bool, weight_grad_accum: str,
                    chunk_tokens: int | None):
    """(groups per chunk, the chunk plan): a group is a chosen/rejected pair (paired) or one sequence (KTO);
    0 groups when a chunk cannot hold one (then the generic path runs)."""
    grad_plan = chunked.plan_for_grads(n_rows * seq, w, need_dw, weight_grad_accum, chunk_tokens)
    group_rows = 2 if paired else 1
    n_groups = n_rows // group_rows
    return min(grad_plan.chunk_tokens // (group_rows * seq), n_groups), grad_plan


class ChunkedPreference(torch.autograd.Function):
    """forward(x [R, S, H], w [V, H], b [V] | None, target [R, S], opts, paired, plan = `preference_plan(...)`,
    tail) → (loss, logp [R, S]); tail(logp [R, S]) → loss is the O(R·S) loss on per-token log-probs. The
    gradients are formed here; backward rescales them by grad_output."""

    @staticmethod
    def forward(ctx, x3d, w, b, target2d, opts: chunked.LossOptions, paired: bool, plan: tuple, tail):
        per_chunk, grad_plan = plan
        n_rows, seq, hidden = x3d.shape
        checks = start_checks(target2d, w.shape[0], opts.ignore_index, None, None, -1)
        x = x3d.reshape(-1, hidden)
        y = target2d.reshape(-1).contiguous()  # the kernels index target[row] with no stride
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        need_db = need_db and b is not None
        dx, dw, db, dw_out = chunked.grad_buffers(x, w, b, need_dx, need_dw, need_db, grad_plan)
        scratch = dw_out if grad_plan.buffer_in_dw_storage else None
        # rows not yet computed hold a benign −1 per token (ORPO's log(1 − e^A) is −∞ at A = 0); their terms'
        # gradients are never read, and every row is overwritten before the loss is taken
        logp = torch.full((n_rows, seq), -1.0, device=x.device, dtype=torch.float32)
        kernel_args = chunked.row_kernel_args(None, opts)
        n_groups = n_rows // 2 if paired else n_rows
        buf = chunked.logits_buffer((2 if paired else 1) * per_chunk * seq, w.shape[0], x, scratch)
        first = True
        for i0 in range(0, n_groups, per_chunk):
            i1 = min(i0 + per_chunk, n_groups)
            # the chunk's sequence rows: pairs i0..i1−1 (their chosen rows, then their rejected rows) or
            # sequences i0..i1−1; each block is contiguous in x, so dX is written in place
            blocks = [(i0, i1), (n_groups + i0, n_groups + i1)] if paired else [(i0, i1)]
            tok = [slice(r0 * seq, r1 * seq) for r0, r1 in blocks]
            if len(blocks) == 1 or i1 - i0 == n_groups:
                x_c, y_c = x[tok[0].start:tok[-1].stop], y[tok[0].start:tok[-1].stop]
            else:
                x_c, y_c = torch.cat([x[t] for t in tok]), torch.cat([y[t] for t in tok])
            z = chunked.logits_into(buf, x_c, w, b)
            C = z.shape[0]
            nll = torch.empty(C, device=x.device, dtype=torch.float32)
            stats = torch.empty((2, C), device=x.device, dtype=torch.float32)
            ce_rows(z, y_c, loss=nll, stats=stats, grad=None, compute_stats=True, **kernel_args)
            offset = 0
            for (r0, r1), t in zip(blocks, tok):
                logp[r0:r1] = -nll[offset:offset + (t.stop - t.start)].view(r1 - r0, seq)
                offset += t.stop - t.start
            with torch.enable_grad():  # ∂L/∂log p, exact on this chunk's rows (module docstring)
                filled = logp.clone().requires_grad_()
                (g_all,) = torch.autograd.grad(tail(filled), filled)
            # ℓ = −log p is what the row kernel differentiates: the upstream gradient flips sign
            g_tok = torch.cat([-g_all[r0:r1].reshape(-1) for r0, r1 in blocks]).float().contiguous()
            ce_rows(z, y_c, loss=None, stats=stats, grad=g_tok, compute_stats=False, per_token_grad=True,
                    **kernel_args)
            if dx is not None:
                offset = 0
                for t in tok:
                    n = t.stop - t.start
                    torch.mm(z[offset:offset + n], w, out=dx[t])
                    offset += n
            chunked.chunk_grads(z, x_c, w, None, dw, db, first)
            first = False
            del x_c, y_c, z  # the next chunk's gathered rows must not coexist with these
        save_precomputed_grads(ctx, x3d, w, b, dx, dw, db, dw_out)
        finish_checks(checks)
        ctx.mark_non_differentiable(logp)
        return tail(logp), logp

    @staticmethod
    @first_order_only
    def backward(ctx, grad_loss, grad_logp):
        return (*rescaled_grads(ctx, grad_loss, "linear_preference_loss (chunked)"), None, None, None, None, None)
