"""The accuracy rule shared by the kernel tests (flash-attention's): a kernel's error against the fp64
reference is at most twice the error of PyTorch's own same-dtype computation, plus a small atol."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64 (absolute when ref is 0); NaN anywhere fails."""
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    if torch.isnan(out).any() or torch.isnan(ref).any():
        return float("nan") if not torch.equal(torch.isnan(out), torch.isnan(ref)) else 0.0
    denom = ref.norm().item()
    diff = (out - ref).norm().item()
    return diff / denom if denom > 0 else diff


def assert_close_to_ref(name: str, out, ref, torch_same_dtype, factor: float = 2.0, atol: float = 1e-6):
    err, err_torch = rel_err(out, ref), rel_err(torch_same_dtype, ref)
    if not err <= factor * err_torch + atol:
        o, r = out.detach().double().cpu().flatten(), ref.detach().double().cpu().flatten()
        worst = (o - r).abs().argsort(descending=True)[:5].tolist()
        raise AssertionError(f"{name}: error {err:.3e} > {factor}×torch {err_torch:.3e} + {atol:g}; "
                             f"worst elements (index, out, ref): {[(i, o[i].item(), r[i].item()) for i in worst]}")


def torch_linear_cross_entropy(x, w, y, *, b=None, weight=None, reduction="mean", ignore_index=-100,
                               label_smoothing=0.0, z_loss=0.0, softcap=None, upcast_logits=False):
    """PyTorch's own computation in the inputs' dtype (logits, softmax and loss all in that dtype).

    upcast_logits: the logits GEMM in the inputs' dtype, everything after it in fp32 — the yardstick
    for a loss that is promised in fp32: a half-precision softmax rounds the loss itself (~1e-2 relative
    in fp16), which would let a kernel that rounds its fp32 loss to fp16 pass the 2× rule."""
    s = F.linear(x, w, b)
    if upcast_logits:
        s = s.float()
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    flat_s, flat_y = s.reshape(-1, s.shape[-1]), y.reshape(-1).long()  # F.cross_entropy takes int64 only
    cw = None if weight is None else weight.to(s.dtype)
    loss = F.cross_entropy(flat_s, flat_y, weight=cw, ignore_index=ignore_index,
                           label_smoothing=label_smoothing, reduction="none")
    if z_loss:
        loss = loss + z_loss * torch.logsumexp(flat_s, -1) ** 2 * (flat_y != ignore_index)
    if reduction == "none":
        return loss.reshape(y.shape)
    if reduction == "sum":
        return loss.sum()
    valid = flat_y != ignore_index
    denom = valid.sum() if cw is None else (cw[torch.where(valid, flat_y, 0)] * valid).sum()
    return loss.sum() / denom
