"""The chunked strategy: cuBLAS GEMMs over bounded token chunks + the Triton row kernel.

For a chunk of C tokens:  Z = X_c Wᵀ (+ b) into one reused [C, V] buffer → `ce_rows` computes lse/loss
and overwrites Z with G = ∂L/∂Z → dX_c = G W → dW += Gᵀ X_c (→ db += Σ G).  Forward+backward is
three GEMMs when the upstream gradient per token is known in the forward (scalar reductions), and
four (logits recomputed in backward from the saved lse) when it is not (`reduction="none"`,
log-probabilities). The buffer size does not grow with the number of tokens; `chunk_plan.py` picks
the largest chunk that the memory contract allows (1024 tokens in lean mode, 4096 — inside dW's own
storage — with the fp32 accumulator, all tokens at once when they fit the accumulator's allowance).
A loss-only forward uses [C, Vs] tiles (a vocabulary slice) within 64 MiB and merges row statistics.

Weight-gradient accumulation over chunks:
- `"fp32"` (default for bf16/fp16 weights): cuBLAS accumulates Gᵀ X_c straight into one fp32 [V, H]
  buffer (bf16 operands, fp32 C/D, β = 1: `aten::addmm.dtype_out`), so dW loses no precision as the
  token count grows; cost: the fp32 accumulator's memory and its read+write per chunk. With a
  single chunk there is no accumulator: one GEMM writes dW (fp32 inside cuBLAS, one rounding).
- `"weight_dtype"` (memory-lean): accumulate into the weight-dtype dW itself; each chunk rounds the
  running sum to bf16 once, so the error grows slowly with the number of chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fusedkern.chunk_plan import GradChunkPlan, grad_chunk_plan, loss_tile
from fusedkern.kernels.ce_rows import ce_rows, merge_row_stats, row_stats_tile, tile_partials


@dataclass(frozen=True)
class LossOptions:
    """The per-token loss of docs/design.md: ε, z-loss, softcap, ignore_index; logit_scale multiplies the
    softcapped logits in fp32 inside the row kernels (1/τ of `linear_logprobs`' temperature)."""

    ignore_index: int = -100
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    softcap: float | None = None
    logit_scale: float = 1.0


def plan_for_grads(n_tokens: int, w: torch.Tensor, need_dw: bool, weight_grad_accum: str,
                   chunk_tokens: int | None) -> GradChunkPlan:
    """`chunk_plan.grad_chunk_plan` for this weight: fp32 accumulation only applies to a bf16/fp16 weight."""
    vocab, hidden = w.shape
    fp32_accum = weight_grad_accum == "fp32" and w.dtype != torch.float32
    return grad_chunk_plan(n_tokens, vocab, hidden, w.element_size(), need_dw=need_dw, fp32_accum=fp32_accum,
                           chunk_tokens=chunk_tokens)


def logits_buffer(rows: int, vocab: int, like: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """The reused [rows, V] buffer in `like`'s dtype: a view of `scratch` (dW's own storage, idle while
    an fp32 accumulator collects dW) when given, else a new allocation."""
    if scratch is not None:
        assert scratch.dtype == like.dtype and scratch.numel() >= rows * vocab
        return scratch.view(-1)[: rows * vocab].view(rows, vocab)
    return torch.empty((rows, vocab), device=like.device, dtype=like.dtype)


def logits_into(buf: torch.Tensor, x_c: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """Z = x_c Wᵀ (+ b) written into the first rows of the reused buffer. (C, V)"""
    z = buf[: x_c.shape[0]]
    if x_c.device.type == "cpu" and x_c.dtype == torch.bfloat16 and not x_c.is_contiguous():
        # torch's CPU bf16 GEMM (AVX512-BF16 machines) reads one element past each row of a row-strided
        # A with an odd inner size: NaN in the gap between rows becomes NaN logits
        x_c = x_c.contiguous()
    if b is None:
        torch.mm(x_c, w.t(), out=z)
    else:
        torch.addmm(b, x_c, w.t(), out=z)
    return z


def accumulate_weight_grad(acc: torch.Tensor, g: torch.Tensor, x_c: torch.Tensor, first: bool) -> None:
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


def row_kernel_args(class_weight: torch.Tensor | None, opts: LossOptions) -> dict:
    return dict(
        class_weight=class_weight,
        class_weight_sum=None if class_weight is None else class_weight.sum().reshape(1),
        ignore_index=opts.ignore_index,
        label_smoothing=opts.label_smoothing,
        z_loss=opts.z_loss,
        softcap=opts.softcap,
        logit_scale=opts.logit_scale,
    )


def lse_of(stats: torch.Tensor) -> torch.Tensor:
    """Per-token log-sum-exp [T] from the saved row statistics [2, T] = (max, log Σ exp(s − max))."""
    return stats[0] + stats[1]


def _run_chunks(x, w, b, target, class_weight, opts: LossOptions, C: int, *, loss_tok, stats, compute_stats: bool,
                grad, per_token_grad: bool, dx=None, dw=None, db=None, scratch=None, entropy=None,
                grad_entropy=None) -> None:
    """The chunk loop shared by every chunked pass: logits GEMM → row kernel → gradient GEMMs.
    scratch: storage to hold the logits buffer (see `logits_buffer`), or None to allocate it.
    entropy [T] / grad_entropy [T]: the per-token entropy and its upstream gradient (`ce_rows`), or None."""
    T, V = x.shape[0], w.shape[0]
    buf = logits_buffer(min(C, T), V, x, scratch)
    kernel_args = row_kernel_args(class_weight, opts)
    for i, c0 in enumerate(range(0, T, C)):
        c1 = min(c0 + C, T)
        x_c = x[c0:c1]
        z = logits_into(buf, x_c, w, b)
        ce_rows(z, target[c0:c1], loss=None if loss_tok is None else loss_tok[c0:c1], stats=stats[:, c0:c1],
                grad=grad[c0:c1] if per_token_grad else grad, compute_stats=compute_stats,
                per_token_grad=per_token_grad, entropy=None if entropy is None else entropy[c0:c1],
                grad_entropy=None if grad_entropy is None else grad_entropy[c0:c1], **kernel_args)
        if grad is not None:
            chunk_grads(z, x_c, w, None if dx is None else dx[c0:c1], dw, db, first=i == 0)


def _run_tiles(x, w, b, target, class_weight, opts: LossOptions, C: int, Vs: int, *, loss_tok, stats,
               entropy=None) -> None:
    """Loss-only pass over [C, Vs] logits tiles: per chunk of C tokens, every vocabulary slice's GEMM
    and partial statistics, then one merge into lse and loss (`ce_rows.merge_row_stats`)."""
    T, V = x.shape[0], w.shape[0]
    buf = torch.empty(min(C, T) * min(Vs, V), device=x.device, dtype=x.dtype)
    kernel_args = row_kernel_args(class_weight, opts)
    for c0 in range(0, T, C):
        c1 = min(c0 + C, T)
        x_c, y_c = x[c0:c1], target[c0:c1]
        parts, target_logit, split = tile_partials(c1 - c0, V, Vs, x.device, entropy=entropy is not None)
        for k, v0 in enumerate(range(0, V, Vs)):
            v1 = min(v0 + Vs, V)
            tile = logits_into(buf[: (c1 - c0) * (v1 - v0)].view(c1 - c0, v1 - v0), x_c, w[v0:v1],
                                None if b is None else b[v0:v1])
            row_stats_tile(tile, y_c, parts, target_logit, tile_index=k, split=split, col_base=v0,
                           class_weight=class_weight, softcap=opts.softcap, label_smoothing=opts.label_smoothing,
                           logit_scale=opts.logit_scale)
        merge_row_stats(parts, target_logit, y_c, V, loss=loss_tok[c0:c1], stats=stats[:, c0:c1],
                        entropy=None if entropy is None else entropy[c0:c1], **kernel_args)


def chunked_loss(x, w, b, target, class_weight, opts: LossOptions, chunk_tokens: int | None = None, *,
                 tile: tuple[int, int] | None = None, entropy: torch.Tensor | None = None):
    """Per-token loss and row statistics, no gradient: one GEMM's work within 64 MiB.

    x [T, H] · w [V, H] · b [V] | None · target [T] → (loss_tok [T] fp32, stats [2, T] fp32; see `lse_of`).
    chunk_tokens: whole-row chunks of that many tokens. Otherwise [C, Vs] tiles, `chunk_plan.loss_tile`
    (or `tile` = (C, Vs), for tests). entropy: a [T] fp32 buffer to receive each token's entropy of
    softmax(s) (0 where ignored), or None (the statistic is compiled out).
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
                    grad=None, per_token_grad=False, entropy=entropy)
    else:
        _run_tiles(x, w, b, target, class_weight, opts, C, Vs, loss_tok=loss_tok, stats=stats, entropy=entropy)
    return loss_tok, stats


def grad_buffers(x, w, b, need_dx, need_dw, need_db, plan: GradChunkPlan):
    """(dx, dw, db, dw_out): dx [T, H] (x's dtype) · dw [V, H]: the fp32 accumulator when
    `plan.fp32_accumulator`, else dW itself in the weight's dtype · db [V] fp32 · dw_out: dW's own storage
    in the weight's dtype when dw is the fp32 accumulator (also the logits buffer's home when
    `plan.buffer_in_dw_storage`), else None."""
    dx = torch.empty_like(x) if need_dx else None
    dw = dw_out = None
    if need_dw:
        dw = torch.empty(w.shape, device=w.device, dtype=torch.float32 if plan.fp32_accumulator else w.dtype)
        if plan.fp32_accumulator:
            dw_out = torch.empty_like(w, memory_format=torch.contiguous_format)  # also the logits buffer's home: viewed flat
    db = torch.zeros(w.shape[0], device=w.device, dtype=torch.float32) if need_db else None
    return dx, dw, db, dw_out


def chunk_grads(g, x_c, w, dx_rows, dw, db, first: bool) -> None:
    """The two gradient GEMMs of one chunk (and the bias sum). g = ∂L/∂Z_c (C, V), x_c (C, H);
    dx_rows: the chunk's rows of dX (C, H) or None. dW's GEMM runs first: x_c may be dx_rows itself
    (`chunked_loss_and_grads` with `rows` gathers x into dX's own storage)."""
    if dw is not None:
        accumulate_weight_grad(dw, g, x_c, first)
    if dx_rows is not None:
        torch.mm(g, w, out=dx_rows)  # (C, V) @ (V, H) → (C, H)
    if db is not None:
        db += torch.sum(g, dim=0, dtype=torch.float32)


def chunked_loss_and_grads(x, w, b, target, class_weight, opts: LossOptions, grad_scale: torch.Tensor, *,
                           need_dx: bool, need_dw: bool, need_db: bool, weight_grad_accum: str,
                           chunk_tokens: int | None = None, rows: torch.Tensor | None = None):
    """Loss and gradients in one pass (three GEMMs) for a loss whose per-token weight is known.

    grad_scale: [1] fp32 on device, ∂L/∂ℓ_t shared by every non-ignored token (1/D for the mean).
    Returns (loss_tok [T], stats [2, T], dx [T, H] | None, dw [V, H] | None, db [V] fp32 | None,
    dw_out | None) with dw and dw_out as in `grad_buffers`; the caller rescales by the final upstream
    gradient (into dw_out when given: its content until then is the last logits chunk).

    rows: [n] indices of the only rows to compute (the valid ones of `num_valid_tokens`), target [n]
    already gathered, or None for every row. The loss and stats are then over those n rows (plan
    included) while dx keeps x's [T, H] in x's order, 0 at the other rows: the gathered rows live in
    dX's own storage (each chunk's dW GEMM reads them before its dX GEMM overwrites them) and wait in
    idle storage (dW's own, or the logits buffer) while dX is put in order, so that the pass holds no
    [n, H] buffer beyond dX (docs/design.md, "The counted paths' memory").
    """
    if rows is not None:
        return _loss_and_grads_of_rows(x, w, b, target, class_weight, opts, grad_scale, rows, need_dx=need_dx,
                                       need_dw=need_dw, need_db=need_db, weight_grad_accum=weight_grad_accum,
                                       chunk_tokens=chunk_tokens)
    T = x.shape[0]
    plan = plan_for_grads(T, w, need_dw, weight_grad_accum, chunk_tokens)
    loss_tok = torch.empty(T, device=x.device, dtype=torch.float32)
    stats = torch.empty((2, T), device=x.device, dtype=torch.float32)
    dx, dw, db, dw_out = grad_buffers(x, w, b, need_dx, need_dw, need_db, plan)
    _run_chunks(x, w, b, target, class_weight, opts, plan.chunk_tokens, loss_tok=loss_tok, stats=stats,
                compute_stats=True, grad=grad_scale, per_token_grad=False, dx=dx, dw=dw, db=db,
                scratch=dw_out if plan.buffer_in_dw_storage else None)
    return loss_tok, stats, dx, dw, db, dw_out


def _loss_and_grads_of_rows(x, w, b, target, class_weight, opts: LossOptions, grad_scale: torch.Tensor,
                            rows: torch.Tensor, *, need_dx: bool, need_dw: bool, need_db: bool,
                            weight_grad_accum: str, chunk_tokens: int | None):
    """`chunked_loss_and_grads` over x[rows] only (see its `rows`)."""
    n, V = rows.shape[0], w.shape[0]
    plan = plan_for_grads(n, w, need_dw, weight_grad_accum, chunk_tokens)
    loss_tok = torch.empty(n, device=x.device, dtype=torch.float32)
    stats = torch.empty((2, n), device=x.device, dtype=torch.float32)
    dx, dw, db, dw_out = grad_buffers(x, w, b, need_dx, need_dw, need_db, plan)
    xs = x.index_select(0, rows) if dx is None else torch.index_select(x, 0, rows, out=dx[:n])
    buf = logits_buffer(min(plan.chunk_tokens, n), V, x, dw_out if plan.buffer_in_dw_storage else None)
    _run_chunks(xs, w, b, target, class_weight, opts, plan.chunk_tokens, loss_tok=loss_tok, stats=stats,
                compute_stats=True, grad=grad_scale, per_token_grad=False, dx=None if dx is None else dx[:n],
                dw=dw, db=db, scratch=buf)
    if dx is not None:
        held = next((s for s in (dw_out, buf) if s is not None and s.numel() >= n * x.shape[1]), None)
        del buf  # too small to hold dX's rows: freed before their copy is made
        held = xs.clone() if held is None else held.view(-1)[: xs.numel()].view_as(xs).copy_(xs)
        dx.zero_().index_copy_(0, rows, held)
    return loss_tok, stats, dx, dw, db, dw_out


def chunked_grads(x, w, b, target, class_weight, opts: LossOptions, stats: torch.Tensor, grad_tok: torch.Tensor, *,
                  need_dx: bool, need_dw: bool, need_db: bool, weight_grad_accum: str,
                  chunk_tokens: int | None = None, entropy: torch.Tensor | None = None,
                  grad_entropy: torch.Tensor | None = None):
    """Backward with a per-token upstream gradient: recompute each logits chunk (statistics saved),
    then the two gradient GEMMs. stats [2, T] from the forward; grad_tok [T] fp32 = ∂L/∂ℓ_t; with
    entropy [T] (the forward's) and grad_entropy [T] fp32 = ∂L/∂H_t, the entropy's gradient joins in the
    same pass (no extra GEMM). Returns (dx, dw in the weight's dtype, db fp32)."""
    plan = plan_for_grads(x.shape[0], w, need_dw, weight_grad_accum, chunk_tokens)
    dx, dw, db, dw_out = grad_buffers(x, w, b, need_dx, need_dw, need_db, plan)
    _run_chunks(x, w, b, target, class_weight, opts, plan.chunk_tokens, loss_tok=None, stats=stats,
                compute_stats=False, grad=grad_tok, per_token_grad=True, dx=dx, dw=dw, db=db,
                scratch=dw_out if plan.buffer_in_dw_storage else None, entropy=entropy, grad_entropy=grad_entropy)
    if dw_out is not None:
        dw = dw_out.copy_(dw)
    return dx, dw, db
