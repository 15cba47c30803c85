"""Losses given as formulas of per-token log-probs, with the gradient formed in the forward pass: three GEMMs.

A loss that touches the logits only through per-token log-probs (GRPO per token, the preference family per
sequence or per pair) needs four GEMMs when its upstream gradient reaches the head only in backward. But where a
chunk holds every row that the formula couples (a token, a sequence, a chosen/rejected pair), ∂L/∂logp of the
chunk's rows is exact as soon as the chunk's statistics are known: the engine's `FormulaRows` forms it there and
writes the logits gradient in place, and the backward only rescales the saved gradients (one backward per call).
Each loss runs its formula inside its own operator (`autograd.define_op`: SimPO, the preference family, GRPO), so
that torch.compile traces the same three GEMMs as eager.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from fusedkern.autograd import differentiable
from fusedkern.chunk_plan import GradChunkPlan
from fusedkern.engine import Chunk, Formula, LossOptions, formula_loss_and_grads, group_chunks, plan_for_grads


@dataclass(frozen=True)
class FormulaSpec:
    """formula: ∂L/∂logp of a chunk's rows (`engine.Formula`). loss(logp [T], entropy [T] | None) → the 0-d loss
    from every row's log-probs. chunks: the engine's chunks (each holding whole coupled groups) over `plan`.
    logp_dtype: float64 where the formula's gradient is steep in a sum of log-probs. logp_fill: what rows not yet
    computed hold when the formula reads them."""

    formula: Formula
    loss: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]
    chunks: Sequence[Chunk]
    plan: GradChunkPlan
    logp_dtype: torch.dtype = torch.float32
    with_entropy: bool = False
    logp_fill: float = 0.0


def run_formula(x, w, b, target, opts: LossOptions, spec: FormulaSpec, *, need_dx: bool, need_dw: bool,
                need_db: bool):
    """The loss of `spec` over the engine with its gradients formed in the forward pass: (loss 0-d fp32, logp [T] in
    spec.logp_dtype, entropy [T] fp32 or None, grads: `engine.Grads`). The body of a loss's operator (`simpo.py`,
    `linear_preference.py`, `grpo.py`), which checks the targets and returns the gradients for its backward to
    rescale (`autograd.grads_formed_in_forward`)."""
    logp, entropy, grads = formula_loss_and_grads(
        x, w, b, target, opts, spec.formula, spec.chunks, spec.plan, need_dx=need_dx, need_dw=need_dw,
        need_db=need_db and b is not None, logp_dtype=spec.logp_dtype, with_entropy=spec.with_entropy,
        logp_fill=spec.logp_fill)
    return spec.loss(logp, entropy).float(), logp, entropy, grads


def grouped_plan(n_rows: int, seq: int, paired: bool, w: torch.Tensor, need_dw: bool, weight_grad_accum: str,
                 chunk_tokens: int | None):
    """(groups per chunk, the chunk plan) for rows of `seq` tokens coupled in groups: a chosen/rejected pair
    (paired, rows g and n_rows/2 + g) or one sequence; 0 groups when a chunk cannot hold one (then the caller takes
    its generic four-GEMM path)."""
    grad_plan = plan_for_grads(n_rows * seq, w, need_dw, weight_grad_accum, chunk_tokens)
    group_rows = 2 if paired else 1
    return min(grad_plan.chunk_tokens // (group_rows * seq), n_rows // group_rows), grad_plan


def grouped_tail_spec(n_rows: int, seq: int, paired: bool, per_chunk: int, plan, tail) -> FormulaSpec:
    """A loss given as tail(logp [R, S]) → 0-d, an O(R·S) function that couples rows only within a group (the
    preference family: a pair, or KTO's sequence), as a formula over the engine: a chunk of whole groups has its
    ∂L/∂log p exact by autograd of the tail with the chunk's rows filled in, whatever the other rows hold. Rows not
    yet computed hold a benign −1 (ORPO's log(1 − e^A) is −∞ at A = 0)."""

    def formula(chunk, logp):
        with differentiable():
            filled = logp.view(n_rows, seq).clone().requires_grad_()
            (g_all,) = torch.autograd.grad(tail(filled), filled)
        return chunk.take(g_all.reshape(-1))

    n_groups = n_rows // 2 if paired else n_rows
    return FormulaSpec(formula, lambda logp, _: tail(logp.view(n_rows, seq)),
                       group_chunks(n_groups, per_chunk, seq, paired), plan, logp_fill=-1.0)
