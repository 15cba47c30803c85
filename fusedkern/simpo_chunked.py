"""Chunked SimPO with the gradient formed in the forward pass: three GEMMs instead of four.

The generic path (`linear_logprobs` + autograd) needs the per-token upstream gradient, which for SimPO
depends on whole responses (z_i = β(A_w,i − A_l,i) − γ), so it computes the log-probabilities in one
pass and recomputes the logits in backward: four GEMMs. Here chunks hold whole responses, so a
response's average log-probability is known as soon as its chunk's statistics are, and the gradient
is written in place before the dX / dW GEMMs, exactly as for cross-entropy:

- "pairs": when a chunk can hold a chosen/rejected pair (2·S tokens ≤ C), each chunk holds whole
  pairs: three GEMMs in all.
- "prepass": otherwise (e.g. S = 1024 at V = 128256 with the 256 MiB buffer), a loss-only pass over the
  rejected half first gives every A_l (half a GEMM's work); then chunks of whole chosen responses,
  then of whole rejected ones (their partners' A_w now known): 3.5 GEMMs.
- a response longer than a chunk falls back to the generic four-GEMM path (the caller checks
  `plan_for`).

Per-token upstream gradient of ℓ_t = −log p_t (design.md): with dL/dz_i = [−(1−ε)σ(−z_i) + εσ(z_i)]/B,
chosen tokens get −β·dL/dz_i / n_w,i + α/N_w, rejected tokens +β·dL/dz_i / n_l,i.
"""

from __future__ import annotations

import torch

from fusedkern.chunk_plan import GradChunkPlan
from fusedkern.chunked import (
    LossOptions,
    logits_into,
    row_kernel_args,
    chunk_grads,
    chunked_loss,
    grad_buffers,
    logits_buffer,
    plan_for_grads,
)
from fusedkern.kernels.ce_rows import ce_rows
from fusedkern.autograd import first_order_only, rescaled_grads, save_precomputed_grads


def plan_for(n_rows: int, seq: int, w: torch.Tensor, need_dw: bool, weight_grad_accum: str,
             chunk_tokens: int | None) -> tuple[str, int, GradChunkPlan]:
    """(mode, responses or pairs per chunk, the chunk plan of `chunk_plan.grad_chunk_plan`):
    ("pairs", pairs per chunk, …) | ("prepass", responses per chunk, …) | ("generic", 0, …)."""
    grad_plan = plan_for_grads(n_rows * seq, w, need_dw, weight_grad_accum, chunk_tokens)
    C = grad_plan.chunk_tokens
    if C >= 2 * seq:
        return "pairs", max(1, min(C // (2 * seq), n_rows // 2)), grad_plan
    if C >= seq:
        return "prepass", C // seq, grad_plan
    return "generic", 0, grad_plan


def _upstream_per_token(a_self, a_partner, n_self, n_chosen_total, *, chosen: bool, beta, gamma, alpha,
                        label_smoothing, n_pairs):
    """g_t = ∂L/∂ℓ_t for the tokens of k responses. a_* [k] float64, n_self [k] → [k, 1] float64 (broadcast
    over S; the caller rounds it to fp32 once, for the kernel)."""
    a_w, a_l = (a_self, a_partner) if chosen else (a_partner, a_self)
    z = beta * (a_w - a_l) - gamma
    dl_dz = (-(1.0 - label_smoothing) * torch.sigmoid(-z) + label_smoothing * torch.sigmoid(z)) / n_pairs
    dl_da_self = beta * dl_dz if chosen else -beta * dl_dz
    g = -dl_da_self / n_self.clamp(min=1)  # ℓ = −log p, so the sign flips
    if chosen:
        g = g + alpha / n_chosen_total.clamp(min=1)
    return g[:, None]


def _logprobs_fp64(z, y_rows, stats, ignore_index: int) -> torch.Tensor:
    """Per-token log-probabilities [C] in float64 from the chunk's logits (before the gradient overwrites them)
    and row statistics: (s_y − m) − log Σ exp(s − m), 0 where ignored.

    Why not the kernel's fp32 −ℓ_t: SimPO's gradient depends on z_i = β(A_w − A_l) − γ, so at β = 10 the
    fp32 rounding of each log-probability (an ulp of |log p| ~ 5, about 5e-7) moves every gradient of the pair
    by ~β·5e-7 relative, which dominates dX and dW. Here s_y − m and the sum over the response are exact or
    float64, and only log Σ keeps its fp32 rounding (of a smaller number): 1.6e-7 mean absolute error per token
    against PyTorch's fp32 log_softmax's 2.5e-7 (fp32, T = 64 × 20 seeds, H = 16, V = 131). What stays is the fp32
    logits' own rounding, which PyTorch shares: with one to three tokens per response the comparison with
    PyTorch's error still rests on a few roundings each side."""
    V = z.shape[1]
    valid = y_rows != ignore_index
    safe = torch.where(valid & (y_rows >= 0) & (y_rows < V), y_rows, 0)  # the operator reports bad targets
    s_y = z.gather(1, safe[:, None].long())[:, 0].double()
    return torch.where(valid, (s_y - stats[0].double()) - stats[1].double(), 0.0)


def _process_chunk(x_rows, y_rows, w, b, kernel_args, buf, a_partner, n_self, n_chosen_total, *, chosen, seq,
                   hp, n_pairs, dx_rows, dw, db, first):
    """One chunk of whole responses of one half: logits → stats → A → g → in-place gradient → dX, dW.
    Returns the chunk's per-token log-probabilities [k·S] and its responses' A [k]."""
    z = logits_into(buf, x_rows, w, b)
    C = z.shape[0]
    nll = torch.empty(C, device=z.device, dtype=torch.float32)
    stats = torch.empty((2, C), device=z.device, dtype=torch.float32)
    ce_rows(z, y_rows, loss=nll, stats=stats, grad=None, compute_stats=True, **kernel_args)
    logp = _logprobs_fp64(z, y_rows, stats, kernel_args["ignore_index"])
    a_self = logp.view(-1, seq).sum(-1) / n_self.clamp(min=1)
    g = _upstream_per_token(a_self, a_partner, n_self, n_chosen_total, chosen=chosen, n_pairs=n_pairs, **hp)
    g_tok = g.expand(-1, seq).reshape(-1).float().contiguous()
    ce_rows(z, y_rows, loss=None, stats=stats, grad=g_tok, compute_stats=False, per_token_grad=True, **kernel_args)
    chunk_grads(z, x_rows, w, dx_rows, dw, db, first)
    return logp, a_self


class ChunkedSimPO(torch.autograd.Function):
    """SimPO loss with gradients formed in the forward pass; backward rescales them by grad_output.

    forward(x [2B, S, H], w [V, H], b [V] | None, target [2B, S], opts, hp = dict(beta, gamma, alpha,
    label_smoothing), weight_grad_accum, plan = `plan_for(...)`, loss_fn) → (loss, logp [2B, S]), where
    loss_fn(logp, mask) → loss is the O(B·S) SimPO function evaluated on the detached log-probs.
    """

    @staticmethod
    def forward(ctx, x3d, w, b, target2d, opts: LossOptions, hp: dict, weight_grad_accum: str, plan: tuple, loss_fn):
        mode, per_chunk, grad_plan = plan
        two_b, seq, hidden = x3d.shape
        n_pairs = two_b // 2
        x = x3d.reshape(-1, hidden)
        y = target2d.reshape(-1).contiguous()  # the kernels index target[row] with no stride
        need_dx, need_dw = x3d.requires_grad, w.requires_grad
        need_db = b is not None and b.requires_grad
        dx, dw, db, dw_out = grad_buffers(x, w, b, need_dx, need_dw, need_db, grad_plan)
        scratch = dw_out if grad_plan.buffer_in_dw_storage else None
        mask = target2d != opts.ignore_index
        n_tokens = mask.sum(-1)  # [2B]
        n_chosen_total = n_tokens[:n_pairs].sum()
        logp = torch.empty(two_b * seq, device=x.device, dtype=torch.float64)  # see _logprobs_fp64
        kernel_args = row_kernel_args(None, opts)
        common = dict(seq=seq, hp=hp, n_pairs=n_pairs)

        def rows(r0, r1):  # token rows of responses r0..r1−1
            return slice(r0 * seq, r1 * seq)

        def dx_of(r):
            return None if dx is None else dx[r]

        first = True
        if mode == "pairs":
            buf = logits_buffer(2 * per_chunk * seq, w.shape[0], x, scratch)
            for i0 in range(0, n_pairs, per_chunk):
                i1 = min(i0 + per_chunk, n_pairs)
                k = i1 - i0
                rw, rl = rows(i0, i1), rows(n_pairs + i0, n_pairs + i1)
                if k == n_pairs:  # one chunk holds every pair: the input already is chosen-then-rejected
                    x_c, y_c = x, y
                else:
                    x_c = torch.cat([x[rw], x[rl]])  # (2kS, H): chosen then rejected halves of k pairs
                    y_c = torch.cat([y[rw], y[rl]])
                n_c = torch.cat([n_tokens[i0:i1], n_tokens[n_pairs + i0:n_pairs + i1]])
                # statistics of both halves first, so each half's gradient sees its partner's A
                z = logits_into(buf, x_c, w, b)
                nll = torch.empty(2 * k * seq, device=x.device, dtype=torch.float32)
                stats = torch.empty((2, 2 * k * seq), device=x.device, dtype=torch.float32)
                ce_rows(z, y_c, loss=nll, stats=stats, grad=None, compute_stats=True, **kernel_args)
                logp_c = _logprobs_fp64(z, y_c, stats, opts.ignore_index)
                a = logp_c.view(2 * k, seq).sum(-1) / n_c.clamp(min=1)
                g_w = _upstream_per_token(a[:k], a[k:], n_c[:k], n_chosen_total, chosen=True, n_pairs=n_pairs, **hp)
                g_l = _upstream_per_token(a[k:], a[:k], n_c[k:], n_chosen_total, chosen=False, n_pairs=n_pairs, **hp)
                g_tok = torch.cat([g_w, g_l]).expand(-1, seq).reshape(-1).float().contiguous()
                ce_rows(z, y_c, loss=None, stats=stats, grad=g_tok, compute_stats=False, per_token_grad=True,
                        **kernel_args)
                if dx is not None:
                    torch.mm(z[:k * seq], w, out=dx[rw])
                    torch.mm(z[k * seq:], w, out=dx[rl])
                chunk_grads(z, x_c, w, None, dw, db, first)
                logp[rw], logp[rl] = logp_c[:k * seq], logp_c[k * seq:]
                first = False
                del x_c, y_c, z  # the next chunk's gathered rows must not coexist with these
        else:  # "prepass": every A_l from a loss-only pass, then chosen chunks, then rejected chunks
            r_rej = rows(n_pairs, two_b)
            nll_rejected, _ = chunked_loss(x[r_rej], w, b, y[r_rej], None, opts)
            # the loss-only pass keeps no logits: these A_l rest on its fp32 −ℓ_t (summed in float64); the rejected
            # chunks below recompute their own from the logits (_logprobs_fp64)
            a_rejected = (-nll_rejected).double().view(n_pairs, seq).sum(-1) / n_tokens[n_pairs:].clamp(min=1)
            a_chosen = torch.empty_like(a_rejected)
            buf = logits_buffer(per_chunk * seq, w.shape[0], x, scratch)
            for chosen, offset in ((True, 0), (False, n_pairs)):
                for i0 in range(0, n_pairs, per_chunk):
                    i1 = min(i0 + per_chunk, n_pairs)
                    r = rows(offset + i0, offset + i1)
                    partner = a_rejected[i0:i1] if chosen else a_chosen[i0:i1]
                    logp[r], a_self = _process_chunk(
                        x[r], y[r], w, b, kernel_args, buf, partner, n_tokens[offset + i0:offset + i1],
                        n_chosen_total, chosen=chosen, dx_rows=dx_of(r), dw=dw, db=db, first=first, **common)
                    if chosen:
                        a_chosen[i0:i1] = a_self
                    first = False

        save_precomputed_grads(ctx, x3d, w, b, dx, dw, db, dw_out)
        logp2d = logp.view(two_b, seq)
        loss = loss_fn(logp2d, mask).float()  # from the float64 log-probabilities, rounded once
        logp2d = logp2d.float()
        ctx.mark_non_differentiable(logp2d)
        return loss, logp2d

    @staticmethod
    @first_order_only
    def backward(ctx, grad_loss, grad_logp):
        return (*rescaled_grads(ctx, grad_loss, "linear_simpo_loss (chunked)"), None, None, None, None, None, None)
