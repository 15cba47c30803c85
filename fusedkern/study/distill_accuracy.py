"""Accuracy of `fusedkern.linear_distillation_loss` against the float64 reference, beside PyTorch's own
materialized computation in the same dtype (`reference.upcast_linear_distillation_loss`): the relative error of
the loss and of the student's dX and dW, per β and dtype, on one fixed random batch."""

from __future__ import annotations

import math

import torch

import fusedkern
from fusedkern import reference

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANTITIES = ("loss", "dX", "dW")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """‖got − want‖ / ‖want‖ in float64 (absolute when want is 0)."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    denom = want.norm().item()
    diff = (got - want).norm().item()
    return diff / denom if denom > 0 else diff


def make_batch(dtype: torch.dtype, *, tokens: int, student_hidden: int, teacher_hidden: int, vocab: int, seed: int,
               device: str = "cpu") -> dict:
    """A student and a teacher head (std 2/√H: logits of order 1–3) with ~20 % of the targets ignored."""
    g = torch.Generator().manual_seed(seed)
    batch = {
        "xs": torch.randn(tokens, student_hidden, generator=g),
        "ws": torch.randn(vocab, student_hidden, generator=g) * (2 / math.sqrt(student_hidden)),
        "xt": torch.randn(tokens, teacher_hidden, generator=g),
        "wt": torch.randn(vocab, teacher_hidden, generator=g) * (2 / math.sqrt(teacher_hidden)),
    }
    y = torch.randint(0, vocab, (tokens,), generator=g)
    y[torch.rand(tokens, generator=g) < 0.2] = -100
    batch = {k: v.to(device=device, dtype=dtype) for k, v in batch.items()}
    batch["y"] = y.to(device)
    return batch


def _loss_and_grads(fn, batch: dict, dtype: torch.dtype, **options) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    xs = batch["xs"].detach().to(dtype).clone().requires_grad_()
    ws = batch["ws"].detach().to(dtype).clone().requires_grad_()
    loss = fn(xs, ws, batch["xt"], batch["wt"], batch["y"], **options)
    loss.backward()
    return loss.detach(), xs.grad, ws.grad


def distillation_errors(betas, dtypes, *, tokens: int, student_hidden: int, teacher_hidden: int, vocab: int,
                        seed: int, chunk_tokens: int | None = None, device: str = "cpu") -> list[dict]:
    """One row per β, dtype, quantity and implementation ("fusedkern" or "torch"): its error vs float64."""
    rows = []
    for dtype_name in dtypes:
        dtype = DTYPES[dtype_name]
        batch = make_batch(dtype, tokens=tokens, student_hidden=student_hidden, teacher_hidden=teacher_hidden,
                           vocab=vocab, seed=seed, device=device)
        for beta in betas:
            want = _loss_and_grads(reference.linear_distillation_loss_fp64, batch, torch.float64, beta=beta)
            runs = {
                "fusedkern": _loss_and_grads(fusedkern.linear_distillation_loss, batch, dtype, beta=beta,
                                             chunk_tokens=chunk_tokens),
                "torch": _loss_and_grads(reference.upcast_linear_distillation_loss, batch, dtype, beta=beta),
            }
            for impl, got in runs.items():
                for quantity, g, w in zip(QUANTITIES, got, want):
                    rows.append({"beta": beta, "dtype": dtype_name, "quantity": quantity, "impl": impl,
                                 "rel_err": rel_err(g, w)})
    return rows
