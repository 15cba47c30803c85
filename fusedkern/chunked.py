"""The chunked strategy: cuBLAS GEMMs over bounded token chunks + the Triton row kernel.

For a chunk of C tokens:  Z = X_c Wᵀ (+ b) into one reused [C, V] buffer → `ce_rows` computes lse/loss
and overwrites Z with G = ∂L/∂Z → dX_c = G W → dW += Gᵀ X_c (→ db += Σ G).  Forward+backward is
three GEMMs when the upstream gradient per token is known in the forward (scalar reductions), and
four (logits recomputed in backward from the saved lse) when it is not (`reduction="none"`,
log-probabilities). The buffer size does not grow with the number of tokens; `chunk_plan.py` picks
the largest chunk that the memory contract allows (1024 tokens in lean mode, 4096 — inside dW's own
storage — with the fp32 accumulator, all tokens at once when they fit the accumulator's allowance).
A loss-only forward uses [C, Vs] tiles (a vocabulary slice) within 64 MiB and merges row statistics (the engine's
loop with `vocab_tile`).

Weight-gradient accumulation over chunks:
- `"fp32"` (default for bf16/fp16 weights): cuBLAS accumulates Gᵀ X_c straight into one fp32 [V, H]
  buffer (bf16 operands, fp32 C/D, β = 1: `aten::addmm.dtype_out`), so dW loses no precision as the
  token count grows; cost: the fp32 accumulator's memory and its read+write per chunk. With a
  single chunk there is no accumulator: one GEMM writes dW (fp32 inside cuBLAS, one rounding).
- `"weight_dtype"` (memory-lean): accumulate into the weight-dtype dW itself; each chunk rounds the
  running sum to bf16 once, so the error grows slowly with the number of chunks.
"""

from __future__ import annotations

import torch

from fusedkern import engine
from fusedkern.chunk_plan import loss_tile
from fusedkern.engine import (  # noqa: F401  (the strategy's building blocks, named here for its callers)
    CrossEntropyRows,
    CrossEntropyTiles,
    Grads,
    LossOptions,
    accumulate_weight_grad,
    logits_buffer,
    logits_into,
    plan_for_grads,
    row_kernel_args,
    token_chunks,
)


def lse_of(stats: torch.Tensor) -> torch.Tensor:
    """Per-token log-sum-exp [T] from the saved row statistics [2, T] = (max, log Σ exp(s − max))."""
    return stats[0] + stats[1]


def _run_chunks(x, w, b, target, class_weight, opts: LossOptions, C: int, *, loss_tok, stats, compute_stats: bool,
                grad, per_token_grad: bool, grads: Grads | None = None, entropy=None, grad_entropy=None,
                buffer=None, logit_sum=None) -> None:
    """The engine's loop with the cross-entropy row pass over chunks of C tokens."""
    row_pass = CrossEntropyRows(target, row_kernel_args(class_weight, opts), loss_tok, stats,
                                compute_stats=compute_stats, grad=grad, per_token_grad=per_token_grad,
                                entropy=entropy, grad_entropy=grad_entropy, logit_sum=logit_sum)
    engine.run(x, w, b, token_chunks(x.shape[0], C), row_pass, grads=grads, buffer=buffer)


def chunked_loss(x, w, b, target, class_weight, opts: LossOptions, chunk_tokens: int | None = None, *,
                 tile: tuple[int, int] | None = None, entropy: torch.Tensor | None = None,
                 logit_sum: torch.Tensor | None = None):
    """Per-token loss and row statistics, no gradient: one GEMM's work within 64 MiB.

    x [T, H] · w [V, H] · b [V] | None · target [T] → (loss_tok [T] fp32, stats [2, T] fp32; see `lse_of`).
    chunk_tokens: whole-row chunks of that many tokens. Otherwise [C, Vs] tiles, `chunk_plan.loss_tile`
    (or `tile` = (C, Vs), for tests). entropy: a [T] fp32 buffer to receive each token's entropy of
    softmax(s) (0 where ignored), or None (the statistic is compiled out). logit_sum: a [T] fp32 buffer to receive
    each row's Σ_v s_v (the mean logit's numerator; no class weights, ε = 0), or None.
    """
    T, V = x.shape[0], w.shape[0]
    loss_tok = torch.empty(T, device=x.device, dtype=torch.float32)
    stats = torch.empty((2, T), device=x.device, dtype=torch.float32)
    if chunk_tokens:
        C, Vs = chunk_tokens, V
    else:
        C, Vs = tile or loss_tile(T, V, x.element_size())
    if Vs >= V:
        _run_chunks(x, w, b, target, class_weight, opts, C, loss_tok=loss_tok, stats=stats, compute_stats=True,
                    grad=None, per_token_grad=False, entropy=entropy, logit_sum=logit_sum)
    else:
        row_pass = CrossEntropyTiles(target, class_weight, opts, V, Vs, loss_tok, stats, entropy, logit_sum)
        engine.run(x, w, b, token_chunks(T, C), row_pass, vocab_tile=Vs)
    return loss_tok, stats


def chunked_loss_and_grads(x, w, b, target, class_weight, opts: LossOptions, grad_scale: torch.Tensor, *,
                           need_dx: bool, need_dw: bool, need_db: bool, weight_grad_accum: str,
                           chunk_tokens: int | None = None, rows: torch.Tensor | None = None):
    """Loss and gradients in one pass (three GEMMs) for a loss whose per-token weight is known.

    grad_scale: [1] fp32 on device, ∂L/∂ℓ_t shared by every non-ignored token (1/D for the mean).
    Returns (loss_tok [T], stats [2, T], grads: `engine.Grads`); the caller rescales by the final upstream
    gradient (into grads.dw_out when given: its content until then is the last logits chunk).

    rows: [n] indices of the only rows to compute (the valid ones of `num_valid_tokens`), target [n]
    already gathered, or None for every row. The loss and stats are then over those n rows (plan
    included) while dx keeps x's [T, H] in x's order, 0 at the other rows: the gathered rows live in
    dX's own storage (each chunk's dW GEMM reads them before its dX GEMM overwrites them) and wait in
    idle storage (dW's own, or the logits buffer) while dX is put in order, so that the pass holds no
    [n, H] buffer beyond dX (docs/design.md, "The counted paths' memory").
    """
    n = x.shape[0] if rows is None else rows.shape[0]
    plan = plan_for_grads(n, w, need_dw, weight_grad_accum, chunk_tokens)
    loss_tok = torch.empty(n, device=x.device, dtype=torch.float32)
    stats = torch.empty((2, n), device=x.device, dtype=torch.float32)
    grads = Grads.allocate(x, w, b, need_dx, need_dw, need_db, plan)
    if rows is None:
        _run_chunks(x, w, b, target, class_weight, opts, plan.chunk_tokens, loss_tok=loss_tok, stats=stats,
                    compute_stats=True, grad=grad_scale, per_token_grad=False, grads=grads)
        return loss_tok, stats, grads
    dx = grads.dx
    xs = x.index_select(0, rows) if dx is None else torch.index_select(x, 0, rows, out=dx[:n])
    buf = logits_buffer(min(plan.chunk_tokens, n), w.shape[0], x, grads.scratch)
    rows_grads = Grads(None if dx is None else dx[:n], grads.dw, grads.db, grads.dw_out, plan)
    _run_chunks(xs, w, b, target, class_weight, opts, plan.chunk_tokens, loss_tok=loss_tok, stats=stats,
                compute_stats=True, grad=grad_scale, per_token_grad=False, grads=rows_grads, buffer=buf)
    if dx is not None:
        held = next((s for s in (grads.dw_out, buf) if s is not None and s.numel() >= n * x.shape[1]), None)
        del buf  # too small to hold dX's rows: freed before their copy is made
        held = xs.clone() if held is None else held.view(-1)[: xs.numel()].view_as(xs).copy_(xs)
        dx.zero_().index_copy_(0, rows, held)
    return loss_tok, stats, grads


def chunked_grads(x, w, b, target, class_weight, opts: LossOptions, stats: torch.Tensor, grad_tok: torch.Tensor, *,
                  need_dx: bool, need_dw: bool, need_db: bool, weight_grad_accum: str,
                  chunk_tokens: int | None = None, entropy: torch.Tensor | None = None,
                  grad_entropy: torch.Tensor | None = None):
    """Backward with a per-token upstream gradient: recompute each logits chunk (statistics saved),
    then the two gradient GEMMs. stats [2, T] from the forward; grad_tok [T] fp32 = ∂L/∂ℓ_t; with
    entropy [T] (the forward's) and grad_entropy [T] fp32 = ∂L/∂H_t, the entropy's gradient joins in the
    same pass (no extra GEMM). Returns (dx, dw in the weight's dtype, db fp32)."""
    plan = plan_for_grads(x.shape[0], w, need_dw, weight_grad_accum, chunk_tokens)
    grads = Grads.allocate(x, w, b, need_dx, need_dw, need_db, plan)
    _run_chunks(x, w, b, target, class_weight, opts, plan.chunk_tokens, loss_tok=None, stats=stats,
                compute_stats=False, grad=grad_tok, per_token_grad=True, grads=grads, entropy=entropy,
                grad_entropy=grad_entropy)
    return grads.dx, grads.weight_grad(), grads.db


def grads_on_own_statistics(x, w, b, target, class_weight, opts: LossOptions, grad_tok: torch.Tensor, *,
                            need_dx: bool, need_dw: bool, need_db: bool, weight_grad_accum: str,
                            chunk_tokens: int | None = None, grad_entropy: torch.Tensor | None = None):
    """`chunked_grads` behind this strategy's own statistics pass, for a backward whose forward statistics came from
    fp32 logits (the Gluon and anchored passes): the recomputed logits are bf16, and a confident row's p_y − 1 ≈ 0
    needs statistics of those same logits (with fp32 ones it becomes their rounding, ~1e-1 at |s| ~ 100). One GEMM
    more than `chunked_grads`. grad_entropy: the entropy's term, its entropy from the same pass."""
    entropy = None if grad_entropy is None else torch.empty(x.shape[0], device=x.device, dtype=torch.float32)
    _, stats = chunked_loss(x, w, b, target, class_weight, opts, chunk_tokens, entropy=entropy)
    return chunked_grads(x, w, b, target, class_weight, opts, stats, grad_tok, need_dx=need_dx, need_dw=need_dw,
                         need_db=need_db, weight_grad_accum=weight_grad_accum, chunk_tokens=chunk_tokens,
                         entropy=entropy, grad_entropy=grad_entropy)
