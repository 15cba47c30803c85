"""Probe on the H200: where a chunk's time goes besides the three GEMMs, and which row-kernel layout
streams the [C, V] logits fastest. Prints one line per measurement; JSON lines to $OUT/probe_rows.jsonl.

    python probes/probe_rows.py

Per chunk of C tokens (C = 1024: lean mode, C = 4096: default mode's buffer inside dW):
  1. the chunk's GEMMs one by one: logits, dX, dW written (β = 0), dW accumulated in bf16 (β = 1),
     dW accumulated into fp32 (β = 1, `addmm.dtype_out`);
  2. the row kernel as shipped (`ce_rows`: split stats kernel + split finish kernel), and with every
     other split count;
  3. the same two kernels launched on groups of G rows, so that the finish kernel re-reads a group
     that the stats kernel has just brought into L2 (50 MiB) — predicted: DRAM traffic 3 → 2 passes;
  4. one program per row, both passes in one kernel, the second pass in reverse column order (the
     most recently read blocks are the likeliest still in L2) — the layout of Liger-Kernel's row
     kernel; plain cross-entropy only (no options), enough to time it.
"""

import torch
import triton
import triton.language as tl

import fusedkern  # noqa: F401
from fusedkern.kernels import ce_rows as rows_mod
from fusedkern.kernels.ce_rows import ce_rows

from probe_common import ms_quantiles, recorder

H, V = 4096, 128256
record = recorder("probe_rows.jsonl")


@triton.jit
def _one_row_two_passes(z_ptr, y_ptr, loss_ptr, V, stride, g, BLOCK: tl.constexpr, REVERSE: tl.constexpr,
                        UNROLL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    ptr = z_ptr + row * stride
    offs = tl.arange(0, BLOCK)
    m_l = tl.full((BLOCK,), -float("inf"), tl.float32)
    d_l = tl.zeros((BLOCK,), tl.float32)
    n_full = V // BLOCK
    for i in range(0, n_full):
        s = tl.load(ptr + i * BLOCK + offs).to(tl.float32)
        u = tl.exp(-tl.abs(s - m_l))
        d_l = tl.where(s > m_l, d_l * u + 1.0, d_l + u)
        m_l = tl.maximum(m_l, s)
    cols = n_full * BLOCK + offs
    mask = cols < V
    s = tl.load(ptr + cols, mask=mask, other=-float("inf")).to(tl.float32)
    u = tl.exp(-tl.abs(s - m_l))
    d_l = tl.where(mask, tl.where(s > m_l, d_l * u + 1.0, d_l + u), d_l)
    m_l = tl.maximum(m_l, s)
    m = tl.max(m_l, 0)
    d = tl.sum(tl.where(m_l != -float("inf"), d_l * tl.exp(m_l - m), 0.0), 0)
    log_d = tl.log(d)
    y = tl.load(y_ptr + row)
    s_y = tl.load(ptr + y).to(tl.float32)
    tl.store(loss_ptr + row, m + log_d - s_y)
    # second pass: the tail first, then full blocks last-to-first when REVERSE
    s = tl.load(ptr + cols, mask=mask, other=0.0).to(tl.float32)
    gr = g * tl.exp((s - m) - log_d) - tl.where(cols == y, g, 0.0)
    tl.store(ptr + cols, gr.to(z_ptr.dtype.element_ty), mask=mask)
    for j in range(0, n_full):
        i = n_full - 1 - j if REVERSE else j
        c = i * BLOCK + offs
        s = tl.load(ptr + c).to(tl.float32)
        gr = g * tl.exp((s - m) - log_d) - tl.where(c == y, g, 0.0)
        tl.store(ptr + c, gr.to(z_ptr.dtype.element_ty))



def main():
    torch.manual_seed(0)
    w = (torch.randn(V, H, device="cuda") / H**0.5).to(torch.bfloat16)
    common = dict(class_weight=None, class_weight_sum=None, ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
                  softcap=None)
    for C in (1024, 4096):
        x = torch.randn(C, H, device="cuda", dtype=torch.bfloat16)
        z = torch.empty(C, V, device="cuda", dtype=torch.bfloat16)
        dx = torch.empty(C, H, device="cuda", dtype=torch.bfloat16)
        dw = torch.zeros(V, H, device="cuda", dtype=torch.bfloat16)
        acc = torch.zeros(V, H, device="cuda", dtype=torch.float32)
        chunk_bytes = C * V * 2
        for name, fn in [
            ("gemm_logits", lambda: torch.mm(x, w.t(), out=z)),
            ("gemm_dx", lambda: torch.mm(z, w, out=dx)),
            ("gemm_dw_write", lambda: torch.mm(z.t(), x, out=dw)),
            ("gemm_dw_accum_bf16", lambda: dw.addmm_(z.t(), x)),
            ("gemm_dw_accum_fp32", lambda: torch.ops.aten.addmm.dtype_out(acc, z.t(), x, torch.float32, out=acc)),
        ]:
            p50, p20, p80 = ms_quantiles(fn)
            record(C=C, what=name, ms_p50=p50, ms_p20=p20, ms_p80=p80, tflops=2 * C * V * H / p50 / 1e9)
        acc = dw = None  # freed before the row-kernel cases (rebinding keeps the closures above well-defined)
        y = torch.randint(0, V, (C,), device="cuda")
        stats = torch.empty(2, C, device="cuda")
        loss = torch.empty(C, device="cuda")
        one = torch.ones(1, device="cuda")
        z.normal_().mul_(3)
        base = z.clone()

        def refresh():  # the kernels overwrite z; restoring it costs a copy, so time restore-only too
            z.copy_(base)

        copy_ms = ms_quantiles(refresh)[0]
        record(C=C, what="restore_copy", ms_p50=copy_ms, GBps=2 * chunk_bytes / copy_ms / 1e6)

        def timed(name, fn, passes=3):
            p50, p20, p80 = ms_quantiles(lambda: (refresh(), fn()))
            net = p50 - copy_ms
            record(C=C, what=name, ms_p50_net=net, ms_p20=p20 - copy_ms, ms_p80=p80 - copy_ms,
                   GBps_at_3_passes=passes * chunk_bytes / net / 1e6)

        original_split = rows_mod._split_for
        timed(f"ce_rows_shipped_split{original_split(C, V)}",
              lambda: ce_rows(z, y, loss=loss, stats=stats, grad=one, compute_stats=True, **common))
        for split in (1, 2, 4, 8, 16, 32):
            rows_mod._split_for = lambda c, v, s=split: s
            timed(f"ce_rows_split{split}", lambda: ce_rows(z, y, loss=loss, stats=stats, grad=one, compute_stats=True,
                                                             **common))
        rows_mod._split_for = original_split
        for group in (32, 64, 128, 256):
            def grouped(G=group):
                for g0 in range(0, C, G):
                    ce_rows(z[g0:g0 + G], y[g0:g0 + G], loss=loss[g0:g0 + G], stats=stats[:, g0:g0 + G], grad=one,
                            compute_stats=True, **common)
            timed(f"ce_rows_groups_of_{group}", grouped)
        ref_loss = loss.clone()
        refresh()
        ce_rows(z, y, loss=ref_loss, stats=stats, grad=one, compute_stats=True, **common)
        ref_grad = z.clone()
        for block, warps, reverse in [(2048, 8, True), (4096, 8, True), (4096, 16, True), (8192, 16, True),
                                      (8192, 32, True), (4096, 16, False)]:
            def one_row(b=block, nw=warps, r=reverse):
                _one_row_two_passes[(C,)](z, y, loss, V, z.stride(0), 1.0, BLOCK=b, REVERSE=r, UNROLL=1, num_warps=nw)
            refresh()
            one_row()
            err = (z.float() - ref_grad.float()).abs().max().item()
            timed(f"one_row_two_passes_b{block}_w{warps}_{'rev' if reverse else 'fwd'}", one_row)
            record(C=C, what="one_row_check", max_abs_grad_diff=err, max_loss_diff=(loss - ref_loss).abs().max().item())
        x = z = base = dx = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
