"""H200 benchmark of the row-count GEMMs (`fusedkern.kernels.rowcount_gemm`) against cuBLAS.

    python scripts/bench_rowcount_gemm.py --out rowcount_gemm.csv [--reps 20] [--counts 4096 2867 2048 1229]

Workload: one chunk of C = 4096 tokens, H = 4096, V = 128256, bf16 (the chunked strategy's default
chunk). For each count n (valid rows; 2867 ≈ 70 %, 1229 ≈ 30 % of the chunk) and each kernel
    logits       Z[:n] = X[:n] Wᵀ                      (bf16 out)
    dx           dX[:n] = G[:n] W                      (bf16 out)
    dw_fp32_acc  dW_fp32 += G[:n]ᵀ X[:n]               (β = 1 into the fp32 accumulator: the default mode)
    dw_bf16      dW = G[:n]ᵀ X[:n]                     (β = 0, bf16 out: the lean mode's first chunk)
three implementations are timed:
    triton        the row-count kernel; n lives on the GPU (no host sync)
    cublas_full   torch.mm over all C rows (what the chunked strategy does without knowing n)
    cublas_exact  torch.mm over exactly n rows (the ideal: needs n on the host, i.e. a sync)
Protocol: warm-up (which also autotunes the Triton kernels, at n = C; ≤ 4 configs each), then
--reps rounds; each round runs every (kernel, n, impl) cell once in a freshly shuffled order, each
call between its own CUDA events, one synchronize per round. Reported: p20/p50/p80 ms over the
rounds and TFLOP/s on the valid rows (2·n·V·H / p50, for every impl: cublas_full's extra rows count
as waste). Correctness (before timing): every impl's output on the valid rows against torch.mm in
fp32 (fp32 operands) — max_abs_err — and, for the Triton kernels, that rows ≥ n of logits/dX are
untouched (NaN-poisoned beforehand) and that the poisoned rows ≥ n of the inputs are not read.
Writes the CSV (columns: kernel, count, impl, ms_p20, ms_p50, ms_p80, tflops, max_abs_err, protocol,
workload) and prints a table. Needs ~12 GB of GPU memory; on the H200 it ran in ~25 s after start-up,
autotuning included.
"""

from __future__ import annotations

import argparse
import csv
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing

import torch  # noqa: E402

import fusedkern  # noqa: E402,F401  (picks GPU or interpreter before the kernels import)
from fusedkern.kernels import rowcount_gemm as rg  # noqa: E402

C, H, V = 4096, 4096, 128256
DTYPE = torch.bfloat16
WORKLOAD = f"C{C}_H{H}_V{V}_bf16"
KERNELS = ["logits", "dx", "dw_fp32_acc", "dw_bf16"]
IMPLS = ["triton", "cublas_full", "cublas_exact"]
COLUMNS = ["kernel", "count", "impl", "ms_p20", "ms_p50", "ms_p80", "tflops", "max_abs_err", "protocol", "workload"]


def make_buffers(seed: int = 0) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rnd = lambda *s, scale=1.0: (torch.randn(*s, device="cuda", generator=gen) * scale).to(DTYPE)  # noqa: E731
    return dict(
        x=rnd(C, H), w=rnd(V, H, scale=0.02), g=rnd(C, V, scale=1e-4),
        z=torch.empty(C, V, device="cuda", dtype=DTYPE),  # logits out (triton and cuBLAS share it)
        dx=torch.empty(C, H, device="cuda", dtype=DTYPE),
        dw32=torch.zeros(V, H, device="cuda", dtype=torch.float32),
        dw16=torch.empty(V, H, device="cuda", dtype=DTYPE),
    )


def make_call(kernel: str, impl: str, n: int, count: torch.Tensor, buf: dict):
    """The callable timed for one cell (no allocation, no sync inside)."""
    x, w, g = buf["x"], buf["w"], buf["g"]
    rows = C if impl == "cublas_full" else n
    if impl == "triton":
        return {
            "logits": lambda: rg.logits_rows(x, w, None, count, buf["z"]),
            "dx": lambda: rg.dx_rows(g, w, count, buf["dx"]),
            "dw_fp32_acc": lambda: rg.dw_rows(g, x, count, buf["dw32"], True),
            "dw_bf16": lambda: rg.dw_rows(g, x, count, buf["dw16"], False),
        }[kernel]
    xs, gs = x[:rows], g[:rows]
    return {
        "logits": lambda: torch.mm(xs, w.t(), out=buf["z"][:rows]),
        "dx": lambda: torch.mm(gs, w, out=buf["dx"][:rows]),
        "dw_fp32_acc": lambda: torch.ops.aten.addmm.dtype_out(buf["dw32"], gs.t(), xs, torch.float32, out=buf["dw32"]),
        "dw_bf16": lambda: torch.mm(gs.t(), xs, out=buf["dw16"]),
    }[kernel]


def check(kernel: str, impl: str, n: int, count: torch.Tensor, buf: dict) -> tuple[float, bool]:
    """(max |out − fp32 reference| on the valid rows, contract held) for one cell. For the Triton
    kernels the inputs' rows ≥ n are NaN-poisoned (must not be read) and so is the output (rows ≥ n
    of logits/dX must stay untouched)."""
    x, w, g = buf["x"], buf["w"], buf["g"]
    if impl == "triton":
        x, g = x.clone(), g.clone()
        x[n:], g[n:] = float("nan"), float("nan")
        local = dict(buf, x=x, g=g)
    else:
        local = dict(buf)
    for name in ("z", "dx", "dw16"):
        local[name].fill_(float("nan"))
    local["dw32"].zero_()
    make_call(kernel, impl, n, count, local)()
    torch.cuda.synchronize()
    out = {"logits": local["z"], "dx": local["dx"], "dw_fp32_acc": local["dw32"], "dw_bf16": local["dw16"]}[kernel]
    ok = True
    if kernel in ("logits", "dx"):
        if impl == "triton":
            ok = bool(torch.isnan(out[n:]).all())
        out = out[:n]
        ref = (x[:n].float() @ w.float().t()) if kernel == "logits" else (g[:n].float() @ w.float())
    else:
        # cublas_full sums over all C tokens: compared with that product (in the chunked strategy the
        # ignored rows of G are zero, which makes it the valid rows' product)
        rows = C if impl == "cublas_full" else n
        ref = g[:rows].float().t() @ x[:rows].float()
        ok = bool(torch.isfinite(out).all())
    err = (out.float() - ref).abs().max().item() if out.numel() else 0.0
    del ref
    return err, ok


TUNED = {"logits": rg._LOGITS[False], "dx": rg._DX[False], "dw_fp32_acc": rg._DW[(False, True)],
         "dw_bf16": rg._DW[(False, False)]}


def sweep(args, counts: dict, buf: dict) -> None:
    """Every autotune candidate of each kernel at each count: p50 of 10 synchronized reps."""
    out = Path(args.out)
    path = out.with_name(out.stem + "_sweep.csv")
    rows = []
    for kernel in args.kernels:
        for config in TUNED[kernel].configs:
            for n in args.counts:
                x, w, g, cnt = buf["x"], buf["w"], buf["g"], counts[n]
                fn = {
                    "logits": lambda: rg.logits_rows(x, w, None, cnt, buf["z"], config=config),
                    "dx": lambda: rg.dx_rows(g, w, cnt, buf["dx"], config=config),
                    "dw_fp32_acc": lambda: rg.dw_rows(g, x, cnt, buf["dw32"], True, config=config),
                    "dw_bf16": lambda: rg.dw_rows(g, x, cnt, buf["dw16"], False, config=config),
                }[kernel]
                try:
                    fn()
                    torch.cuda.synchronize()
                except Exception as error:  # noqa: BLE001  (a config that does not fit: report, go on)
                    print(f"sweep {kernel} {config}: {type(error).__name__}: {str(error)[:200]}", flush=True)
                    break
                t = []
                for _ in range(10):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    fn()
                    end.record()
                    torch.cuda.synchronize()
                    t.append(start.elapsed_time(end))
                p50 = quantiles(t)[1]
                tflops = 2.0 * n * V * H / (p50 * 1e-3) / 1e12
                rows.append(dict(kernel=kernel, count=n, config=str(config), ms_p50=f"{p50:.4f}",
                                 tflops=f"{tflops:.1f}", protocol="sequential", workload=WORKLOAD))
                print(f"sweep {kernel:<12} n={n:>5} {p50:8.3f} ms {tflops:6.1f} TFLOP/s  {config}", flush=True)
    buf["dw32"].zero_()
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["kernel", "count", "config", "ms_p50", "tflops", "protocol",
                                               "workload"])
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}", flush=True)


def quantiles(times: list[float]) -> tuple[float, float, float]:
    t = sorted(times)
    pick = lambda q: t[min(len(t) - 1, int(round(q * (len(t) - 1))))]  # noqa: E731
    return pick(0.2), pick(0.5), pick(0.8)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="CSV path")
    parser.add_argument("--reps", type=int, default=20, help="shuffled rounds (one timed call per cell each)")
    parser.add_argument("--counts", type=int, nargs="+", default=[4096, 2867, 2048, 1229])
    parser.add_argument("--kernels", nargs="+", default=KERNELS, choices=KERNELS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sweep", action="store_true",
                        help="also time every autotune config of each Triton kernel at each count (sequential "
                             "reps, not shuffled) and write them to <out stem>_sweep.csv")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    t_start = time.time()
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 references in true fp32
    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}; "
          f"triton {__import__('triton').__version__}; {WORKLOAD}", flush=True)
    buf = make_buffers(args.seed)
    counts = {n: torch.tensor(n, device="cuda", dtype=torch.int64) for n in args.counts}
    print(f"TMA path (impl='auto'): logits {rg.tma_eligible((buf['x'], buf['w']), (buf['z'],))}, "
          f"dx {rg.tma_eligible((buf['g'], buf['w']), (buf['dx'],))}, "
          f"dw {rg.tma_eligible((buf['g'], buf['x']), (buf['dw32'],))}", flush=True)

    # 1. autotune at n = C (the first call of each Triton kernel), then warm every cell
    cells = [(k, n, impl) for k in args.kernels for n in args.counts for impl in IMPLS]
    full = torch.tensor(C, device="cuda", dtype=torch.int64)
    for kernel in args.kernels:
        t0 = time.time()
        make_call(kernel, "triton", C, full, buf)()
        torch.cuda.synchronize()
        print(f"autotune {kernel}: {time.time() - t0:.1f} s", flush=True)
    for name, tuned in TUNED.items():
        if name in args.kernels:
            timings = getattr(tuned, "configs_timings", None) or {}
            print(f"  {name}: best {getattr(tuned, 'best_config', None)}", flush=True)
            for config, t in timings.items():
                print(f"      {t[0] if isinstance(t, (list, tuple)) else t:8.3f} ms  {config}", flush=True)
    if args.sweep:
        sweep(args, counts, buf)

    # 2. correctness, every cell
    errors, ok_all = {}, True
    for kernel, n, impl in cells:
        err, ok = check(kernel, impl, n, counts[n], buf)
        errors[(kernel, n, impl)] = err
        ok_all &= ok
        if not ok:
            print(f"CONTRACT FAILED: {kernel} n={n} {impl}", flush=True)
    buf["dw32"].zero_()
    torch.cuda.synchronize()
    print(f"correctness checked ({time.time() - t_start:.0f} s so far)", flush=True)

    # 3. timing: warm-up, then shuffled rounds
    calls = {cell: make_call(cell[0], cell[2], cell[1], counts[cell[1]], buf) for cell in cells}
    for _ in range(2):
        for fn in calls.values():
            fn()
    torch.cuda.synchronize()
    rng = random.Random(args.seed)
    times = {cell: [] for cell in cells}
    for _ in range(args.reps):
        order = list(cells)
        rng.shuffle(order)
        events = []
        for cell in order:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            calls[cell]()
            end.record()
            events.append((cell, start, end))
        torch.cuda.synchronize()
        for cell, start, end in events:
            times[cell].append(start.elapsed_time(end))

    # 4. report
    rows = []
    for kernel, n, impl in cells:
        p20, p50, p80 = quantiles(times[(kernel, n, impl)])
        tflops = 2.0 * n * V * H / (p50 * 1e-3) / 1e12
        rows.append(dict(kernel=kernel, count=n, impl=impl, ms_p20=f"{p20:.4f}", ms_p50=f"{p50:.4f}",
                         ms_p80=f"{p80:.4f}", tflops=f"{tflops:.1f}", max_abs_err=f"{errors[(kernel, n, impl)]:.3e}",
                         protocol="shuffled", workload=WORKLOAD))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    p50 = {(r["kernel"], r["count"], r["impl"]): float(r["ms_p50"]) for r in rows}
    print(f"\n{'kernel':<12} {'count':>5} {'impl':<13} {'p20 ms':>8} {'p50 ms':>8} {'p80 ms':>8} {'TFLOP/s':>8} "
          f"{'max|err|':>10} {'vs full':>8} {'vs exact':>8}")
    for r in rows:
        key = (r["kernel"], r["count"])
        print(f"{r['kernel']:<12} {r['count']:>5} {r['impl']:<13} {r['ms_p20']:>8} {r['ms_p50']:>8} {r['ms_p80']:>8} "
              f"{r['tflops']:>8} {r['max_abs_err']:>10} {p50[(*key, 'cublas_full')] / float(r['ms_p50']):>7.2f}x "
              f"{p50[(*key, 'cublas_exact')] / float(r['ms_p50']):>7.2f}x")
    print("\n('vs full' / 'vs exact': that cuBLAS time / this time; > 1 means faster)")
    print(f"wrote {out} ({len(rows)} rows) in {time.time() - t_start:.0f} s; contract {'OK' if ok_all else 'FAILED'}")
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
