"""Probe on the H200: where the chunked strategy's time goes (GEMM chunking, fp32 dW accumulation,
the row kernel), before tuning. Prints a table; writes JSON lines to $OUT/probe.jsonl."""
import sys
import os
import torch
import fusedkern
from fusedkern.chunk_plan import GRAD_CHUNK_BUDGET_BYTES, chunk_rows
from fusedkern.kernels.ce_rows import ce_rows

from _probe_common import ms_quantiles, recorder

H, V = 4096, 128256
dev = "cuda"
rec = recorder("probe.jsonl")


def bench(fn):
    return ms_quantiles(fn, reps=10)  # (p50, p20, p80)


def peak(fn, base_extra=0):
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); m0 = torch.cuda.memory_allocated()
    fn(); torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - m0 - base_extra) / 2**20


sizes = [int(s) for s in sys.argv[1:]] or [4096, 8192, 16384, 32768]
torch.manual_seed(0)
w = (torch.randn(V, H, device=dev) / H**0.5).to(torch.bfloat16).requires_grad_()
print(torch.cuda.get_device_name(), torch.__version__, flush=True)
for T in sizes:
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16).requires_grad_()
    y = torch.randint(0, V, (T,), device=dev)
    G = torch.randn(T, V, device=dev, dtype=torch.bfloat16) * 1e-3
    xd, wd = x.detach(), w.detach()

    def three():
        torch.mm(xd, wd.t()); torch.mm(G, wd); torch.mm(G.t(), xd)
    rec(T=T, what="cublas_3gemm", ms=bench(three)[0])
    rec(T=T, what="cublas_1gemm", ms=bench(lambda: torch.mm(xd, wd.t()))[0])
    C = chunk_rows(T, V, 2, GRAD_CHUNK_BUDGET_BYTES)  # the lean chunk (bf16)
    acc = torch.empty(V, H, device=dev, dtype=torch.float32)
    accb = torch.empty(V, H, device=dev, dtype=torch.bfloat16)
    dx = torch.empty_like(xd)
    buf = torch.empty(C, V, device=dev, dtype=torch.bfloat16)

    def chunk_gemms(mode):
        def f():
            for i, c0 in enumerate(range(0, T, C)):
                xc = xd[c0:c0 + C]; g = G[c0:c0 + C]
                torch.mm(xc, wd.t(), out=buf)
                torch.mm(g, wd, out=dx[c0:c0 + C])
                if mode == "fp32":
                    if i == 0:
                        torch.ops.aten.mm.dtype_out(g.t(), xc, torch.float32, out=acc)
                    else:
                        torch.ops.aten.addmm.dtype_out(acc, g.t(), xc, torch.float32, out=acc)
                else:
                    if i == 0:
                        torch.mm(g.t(), xc, out=accb)
                    else:
                        accb.addmm_(g.t(), xc)
        return f
    rec(T=T, what=f"chunk{C}_gemms_fp32acc", ms=bench(chunk_gemms("fp32"))[0])
    rec(T=T, what=f"chunk{C}_gemms_bf16acc", ms=bench(chunk_gemms("bf16"))[0])
    # row kernel alone on one chunk (stats + in-place grad)
    z0 = torch.randn(C, V, device=dev, dtype=torch.bfloat16) * 3
    stats = torch.empty(2, C, device=dev); loss = torch.empty(C, device=dev); gs = torch.ones(1, device=dev)
    def rows():
        ce_rows(z0, y[:C], loss=loss, stats=stats, class_weight=None, class_weight_sum=None, grad=gs,
                ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None, compute_stats=True)
    ms = bench(rows)[0]
    rec(T=T, what=f"row_kernel_per_chunk{C}", ms=ms, GBps=3 * C * V * 2 / ms / 1e6)
    del acc, accb, buf, z0, G
    for accum in ["fp32", "weight_dtype"]:
        def full():
            x.grad = None; w.grad = None
            fusedkern.linear_cross_entropy(x, w, y, impl="chunked", weight_grad_accum=accum).backward()
        ms = bench(full)
        x.grad = None; w.grad = None
        pk = peak(full, base_extra=x.numel() * 2 + w.numel() * 2)
        rec(T=T, what=f"fusedkern_full_{accum}", ms=ms[0], p20=ms[1], p80=ms[2], peak_extra_mib=pk)
    x.grad = None; w.grad = None
    def lossonly():
        with torch.no_grad():
            fusedkern.linear_cross_entropy(x, w, y, impl="chunked")
    rec(T=T, what="fusedkern_loss_only", ms=bench(lossonly)[0], peak_extra_mib=peak(lossonly))
    # accuracy vs fp64 at this T (chunked fp64 truth)
    if T in (4096, 32768):
        ref_dw = torch.zeros(V, H, device=dev, dtype=torch.float64); ref_dx = torch.empty(T, H, device=dev, dtype=torch.float64)
        wd64 = wd.double(); ref_loss = 0.0
        for c0 in range(0, T, 1024):
            xc = xd[c0:c0 + 1024].double(); z = xc @ wd64.t(); p = torch.softmax(z, -1)
            ref_loss += (torch.logsumexp(z, -1) - z.gather(1, y[c0:c0+1024, None])[:, 0]).sum().item()
            p[torch.arange(p.shape[0]), y[c0:c0 + 1024]] -= 1; p /= T
            ref_dx[c0:c0 + 1024] = p @ wd64; ref_dw += p.t() @ xc
            del z, p
        ref_loss /= T
        err = lambda a, b: ((a.double() - b).norm() / b.norm()).item()
        for name, fn in [("fusedkern_fp32", lambda: fusedkern.linear_cross_entropy(x, w, y, weight_grad_accum="fp32")),
                         ("fusedkern_lean", lambda: fusedkern.linear_cross_entropy(x, w, y, weight_grad_accum="weight_dtype")),
                         ("torch_bf16", lambda: torch.nn.functional.cross_entropy(x @ w.t(), y))]:
            x.grad = None; w.grad = None
            l = fn(); l.backward()
            rec(T=T, what=f"acc_{name}", err_loss=abs(l.item() - ref_loss) / ref_loss, err_dx=err(x.grad, ref_dx), err_dw=err(w.grad, ref_dw))
        del ref_dw, ref_dx
    x.grad = None; w.grad = None
    del x, y, dx
    torch.cuda.empty_cache()

# ---- breakdown at one size: which chunked GEMM loses time, and does the operand layout matter?
T = int(os.environ.get("BREAKDOWN_T", "16384"))
C = 1024
x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
G = torch.randn(T, V, device=dev, dtype=torch.bfloat16) * 1e-3
wd = w.detach()
buf = torch.empty(C, V, device=dev, dtype=torch.bfloat16)
dx = torch.empty(T, H, device=dev, dtype=torch.bfloat16)
acc = torch.empty(V, H, device=dev, dtype=torch.float32)
accT = torch.empty(H, V, device=dev, dtype=torch.float32)
accb = torch.empty(V, H, device=dev, dtype=torch.bfloat16)
chunks = [(c0, c0 + C) for c0 in range(0, T, C)]
variants = {
    "mono_logits": lambda: torch.mm(x, wd.t()),
    "mono_dx": lambda: torch.mm(G, wd),
    "mono_dw": lambda: torch.mm(G.t(), x),
    "chunk_logits": lambda: [torch.mm(x[a:b], wd.t(), out=buf) for a, b in chunks],
    "chunk_dx": lambda: [torch.mm(G[a:b], wd, out=dx[a:b]) for a, b in chunks],
    "chunk_dxT": lambda: [torch.mm(wd.t(), G[a:b].t()) for a, b in chunks],
    "chunk_dw_bf16_beta0": lambda: [torch.mm(G[a:b].t(), x[a:b], out=accb) for a, b in chunks],
    "chunk_dw_bf16_beta1": lambda: [accb.addmm_(G[a:b].t(), x[a:b]) for a, b in chunks],
    "chunk_dw_fp32_beta1": lambda: [torch.ops.aten.addmm.dtype_out(acc, G[a:b].t(), x[a:b], torch.float32, out=acc) for a, b in chunks],
    "chunk_dwT_fp32_beta1": lambda: [torch.ops.aten.addmm.dtype_out(accT, x[a:b].t(), G[a:b], torch.float32, out=accT) for a, b in chunks],
    "cast_fp32_to_bf16": lambda: acc.to(torch.bfloat16),
    "scale_cast": lambda: torch.mul(acc, torch.ones((), device=dev), out=accb),
}
for name, fn in variants.items():
    ms = bench(fn, warmup=2, reps=5)
    rec(T=T, what=f"breakdown_{name}", ms=ms[0], lo=ms[1], hi=ms[2])
