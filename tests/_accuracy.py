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


def assert_close_to_ref(name: str, out, ref, torch_same_dtype, factor: float = 2.0, atol: float = 1e-6,
                        floor: float = 0.0):
    """out's error against ref at most factor × max(torch's same-dtype error, floor) + atol (floor: an error no
    same-dtype computation avoids, for results that hinge on a few roundings: `few_roundings_floors`)."""
    err, err_torch = rel_err(out, ref), max(rel_err(torch_same_dtype, ref), floor)
    if not err <= factor * err_torch + atol:
        o, r = out.detach().double().cpu().flatten(), ref.detach().double().cpu().flatten()
        worst = (o - r).abs().argsort(descending=True)[:5].tolist()
        floored = f" (floored at {floor:.3e})" if floor else ""
        raise AssertionError(f"{name}: error {err:.3e} > {factor}×torch {err_torch:.3e}{floored} + {atol:g}; "
                             f"worst elements (index, out, ref): {[(i, o[i].item(), r[i].item()) for i in worst]}")


def few_roundings_floors(x, w, y, *, b=None, **loss_kw) -> dict[str, float]:
    """Floors of the yardstick for gradients that hinge on a handful of roundings (one valid row: dX and dW are
    multiples of that row's logits gradient, dominated by its target's entry), where torch's own error is a
    sample of a few roundings that luck can bring near 0 (about 1 run in 300 below half the kernel's). Each floor is
    an error no same-dtype computation avoids: one unit roundoff of x's dtype, and the error of exact (fp64)
    gradients computed from the logits rounded to x's dtype (as torch's and the kernels' are), against fp64.
    loss_kw: `torch_linear_cross_entropy`'s (weight, reduction, label_smoothing, z_loss, ...)."""
    x64, w64 = x.detach().double(), w.detach().double()
    b64 = None if b is None else b.detach().double()
    s_rounded = F.linear(x, w, b).detach().double().requires_grad_()  # the logits as a same-dtype GEMM gives them
    s_exact = F.linear(x64, w64, b64).requires_grad_()
    eye = torch.eye(w.shape[0], dtype=torch.float64, device=w.device)  # the loss of given logits, through F.linear
    g_rounded, g_exact = (torch.autograd.grad(torch_linear_cross_entropy(s, eye, y, **loss_kw), s)[0]
                          for s in (s_rounded, s_exact))

    def grads(g):
        return {"dX": g @ w64, "dW": g.reshape(-1, g.shape[-1]).t() @ x64.reshape(-1, x64.shape[-1])}
    exact, unit_roundoff = grads(g_exact), torch.finfo(x.dtype).eps / 2
    return {name: max(unit_roundoff, rel_err(got, exact[name])) for name, got in grads(g_rounded).items()}


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


def torch_logprobs_entropy(x, w, y, b, *, softcap, temperature, upcast=False):
    """PyTorch's own computation in the inputs' dtype (upcast: the logits GEMM in that dtype, the rest fp32)."""
    s = F.linear(x, w, b)
    if upcast:
        s = s.float()
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    log_p = torch.log_softmax(s / temperature, dim=-1)
    valid = y != -100
    logp = log_p.gather(-1, torch.where(valid, y, 0)[:, None])[:, 0]
    entropy = -(log_p.exp() * log_p).sum(-1)
    return torch.where(valid, logp, 0), torch.where(valid, entropy, 0)
