"""A model (not a measurement) of the extra memory of a distillation loss over a student's and a teacher's LM
heads: the materialized computation's [T, V] tensors against `fusedkern.linear_distillation_loss`'s chunk
buffers, from the chunk plan the function runs with (`fusedkern.distillation.distill_plan`).

Materialized (the baseline of `reference.upcast_linear_distillation_loss`, TRL's `generalized_jsd_loss` on
upcast logits): at the backward's peak, autograd holds the student's logits in the inputs' dtype and their
fp32 upcast, the teacher's likewise (its upcast feeds the loss), both fp32 log-softmaxes, the fp32 gradient of
the student's logits and its cast back into the inputs' dtype: T·V·(3e + 20) bytes, e the inputs' element size.
A generalized JSD (0 < β < 1) also keeps the fp32 log-mixture: + T·V·4. Counted without dX and dW (the
gradients every implementation returns) and without the inputs.

fusedkern: the student's [C, V] logits buffer (in dW's own storage when the plan says so: no extra bytes),
the teacher's [C, V] buffer (also in dW's storage when both fit it under an fp32 accumulator:
`distillation.shares_dw_storage`), and the fp32 [V, H] dW accumulator when the plan has one.
"""

from __future__ import annotations

import torch

from fusedkern.distillation import distill_plan, shares_dw_storage

# V, H of the heads the study names (config.json of each model)
HEADS = {
    "Llama-3-8B": {"vocab": 128256, "hidden": 4096},
    "Qwen2.5-7B": {"vocab": 152064, "hidden": 3584},
    "Gemma-2-9B": {"vocab": 256000, "hidden": 3584},
}


def materialized_bytes(tokens: int, vocab: int, elt: int, *, beta: float = 0.5) -> int:
    """The materialized computation's [T, V] tensors at the backward's peak (module docstring)."""
    per_entry = 3 * elt + 20 + (4 if 0 < beta < 1 else 0)
    return tokens * vocab * per_entry


def fusedkern_bytes(tokens: int, vocab: int, hidden: int, elt: int, *, weight_grad_accum: str = "fp32") -> int:
    """fusedkern's chunk buffers and accumulator for a forward+backward: the plan `distillation.distill_plan` gives
    the function (on shape-only heads; the teacher's H does not enter it)."""
    head = torch.empty(vocab, hidden, dtype={2: torch.bfloat16, 4: torch.float32}[elt], device="meta")
    plan = distill_plan(tokens, head, head, True, weight_grad_accum, None)
    C = plan.chunk_tokens
    student = 0 if plan.buffer_in_dw_storage else C * vocab * elt
    teacher = 0 if shares_dw_storage(plan, head) else C * vocab * elt
    accumulator = vocab * hidden * 4 if plan.fp32_accumulator else 0
    return student + teacher + accumulator


def memory_rows(tokens: list[int], *, elt: int = 2, beta: float = 0.5, heads: dict | None = None) -> list[dict]:
    """One row per head and token count: bytes of each side and their ratio."""
    rows = []
    for head, shape in (heads or HEADS).items():
        for T in tokens:
            mat = materialized_bytes(T, shape["vocab"], elt, beta=beta)
            fk = fusedkern_bytes(T, shape["vocab"], shape["hidden"], elt)
            rows.append({"head": head, "vocab": shape["vocab"], "hidden": shape["hidden"], "tokens": T,
                         "materialized_bytes": mat, "fusedkern_bytes": fk, "ratio": mat / fk})
    return rows
