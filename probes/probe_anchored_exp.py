"""Anchored exponentials on an H100 (issue 47 items 1-2): the Gluon producer's epilogue cost, and the whole pass.

--compile (CPU): the producer's variants lowered to sm_90a cubins; one line each, "sm_90a ok: anchored VARIANT regs=
stack= spill= smem=" (tests/test_anchored_exp.py runs it).

--gpu: in one process,
1. check: the producer against its torch reference (ragged T 300 × V 5000, the grid capped to 7 CTAs and full; E and
   the partials, ignored rows zero, poisoned outputs first); cross-entropy (mean, several chunks with the fp32
   accumulator), per-token log-probs at τ 0.7 with an upstream and the entropy, the no-grad pass, and rows past the
   anchor's reach, each against float64 with torch's same-dtype error beside it (the 2× rule) -> check.csv.
2. producer (item 2): at each head and token count, cuBLAS's bf16 logits GEMM (torch.mm into a buffer), the
   producer's epilogues NONE (main loop only), SUMS (the no-grad pass's; also with the row max's plane, and with the
   entropy's and the row max's: TRL's statistics with is_top1), SUMS_AND_E, SUMS_AND_E with the entropy,
   SUMS_AND_E in the grouped order's GROUP_M 8 (16 elsewhere), and the library's Gluon statistics kernel (tile max,
   Σ exp, target logit), in shuffled rounds -> producer.csv.
3. pass (item 1): the 3-GEMM floor (cuBLAS logits, dX = G·W, dW = Gᵀ·X on a pre-made G, allocated per call),
   fusedkern's default cross-entropy, the anchored cross-entropy (and at chunk 8192), per-token log-probs at τ 0.7
   with an upstream (fusedkern's default, anchored: E kept), and no-grad cross-entropy (one GEMM, fusedkern's default,
   anchored), fwd+bwd where a gradient flows, shuffled rounds, peak memory above the inputs -> pass.csv.
Each CSV row: section, provider, head, vocab, hidden, tokens, ms_p20/p50/p80, n_reps, ratio_p50 to the named floor
of the same block, peak_extra_mib, protocol ("shuffled"), workload, gpu.

    TRITON_INTERPRET=0 python probes/probe_anchored_exp.py --compile [--variants none,sums,...]
    python probes/probe_anchored_exp.py --gpu --out $OUT [--heads qwen3,llama1b,llama8b] [--tokens 8192,16384]
        [--rounds 10] [--sections check,producer,pass]
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import random
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # fusedkern, without an install

HEADS = {"qwen3": (151936, 1024), "llama1b": (128256, 2048), "llama8b": (128256, 4096)}
#: name → (EPILOGUE, ENTROPY, ROW_MAX)
VARIANTS = {"none": (0, False, False), "sums": (1, False, False), "sums_entropy": (1, True, False),
            "sums_and_e": (2, False, False), "sums_and_e_entropy": (2, True, False),
            "sums_row_max": (1, False, True), "sums_entropy_row_max": (1, True, True),
            "sums_and_e_row_max": (2, False, True), "sums_and_e_entropy_row_max": (2, True, True)}
COLUMNS = ("section", "provider", "head", "vocab", "hidden", "tokens", "ms_p20", "ms_p50", "ms_p80", "n_reps",
           "floor", "ratio_p50", "peak_extra_mib", "protocol", "workload", "gpu")


# ------------------------------------------------------------------------------------------------ compile


def compile_variant(epilogue: int, entropy: bool, row_max: bool = False):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from fusedkern.kernels import gluon_anchored_exp as k
    from fusedkern.kernels.gluon_logits_stats import shared_layouts

    a, b = shared_layouts()
    signature = {
        "x_desc": f"tensordesc<bf16[{k.BLOCK_M}, {k.BLOCK_K}],{a!r}>",
        "w_desc": f"tensordesc<bf16[{k.BLOCK_N}, {k.BLOCK_K}],{b!r}>",
        "e_desc": f"tensordesc<bf16[{k.E_BOX[0]}, {k.E_BOX[1]}],{k.e_layout()!r}>",
        "anchor_ptr": "*fp32", "part_ptr": "*fp32", "T": "i32", "V": "i32", "H": "i32", "part_stride": "i32",
        "plane_stride": "i32", "scale2": "fp32"}
    constexprs = dict(GROUP_M=k.GROUP_M, STAGES=k.stages_for(epilogue), EPILOGUE=epilogue, ENTROPY=entropy,
                      ROW_MAX=row_max, CONSUMER_REGS=k.CONSUMER_REGS, PRODUCER_REGS=k.PRODUCER_REGS)
    signature.update({n: "constexpr" for n in constexprs})
    names = k._anchored_exp_kernel.arg_names
    attrs = {(names.index(n), ): [["tt.divisibility", 16]]
             for n in ("part_ptr", "H", "part_stride")}  # what a launch specializes (the kernel's do_not_specialize)
    source = GluonASTSource(fn=k._anchored_exp_kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": k.NUM_WARPS, "maxnreg": k.MAXNREG})


def resources(compiled) -> str:
    """The Gluon probe's resource report (registers, stack, spills, shared memory) and the MUFU.EX2 count."""
    import triton
    from gluon_logits_stats import resources as stats_probe_resources  # probes/ is the script's own folder

    r = stats_probe_resources(compiled)
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as scratch:
        cubin = os.path.join(scratch, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        sass = subprocess.run([os.path.join(bindir, "cuobjdump"), "-sass", cubin], capture_output=True,
                              text=True).stdout
    return (f"regs={r['regs']} stack={r['stack']} spill={r['spill']} smem={r['smem']} "
            f"mufu_ex2={len(re.findall(r'MUFU[.]EX2', sass))}")


def compile_main(variants: list[str]) -> int:
    failed = 0
    for name in variants:
        try:
            compiled = compile_variant(*VARIANTS[name])
        except Exception as error:  # noqa: BLE001  (report which variant, go on with the others)
            print(f"FAILED anchored {name}: {type(error).__name__}: {str(error)[-2000:]}", flush=True)
            failed += 1
            continue
        line = resources(compiled)
        print(f"sm_90a ok: anchored {name} {line}", flush=True)
        failed += " stack=0 " not in f" {line} " or " spill=0 " not in f" {line} "
    return 1 if failed else 0


# ------------------------------------------------------------------------------------------------ GPU


def rel_err(out, ref) -> float:
    import torch

    out, ref = out.detach().double(), ref.detach().double()
    if torch.isnan(out).any():
        return float("nan")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-300)).item()


class Writer:
    def __init__(self, path: str, columns):
        self.path, self.columns = path, columns
        with open(path, "w", newline="") as f:
            csv.writer(f).writerow(columns)

    def rows(self, rows: list[dict]) -> None:
        with open(self.path, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=self.columns)
            for r in rows:
                w.writerow({k: r.get(k, "") for k in self.columns})


def check_section(out_dir: str, gpu: str) -> bool:
    """The producer against its reference, then the public functions against float64 (module docstring)."""
    import torch

    from fusedkern import reference
    from fusedkern.anchored import anchored_cross_entropy, anchored_logprobs
    from fusedkern.kernels import gluon_anchored_exp as g
    from fusedkern.kernels.anchored_rows import SUMS, SUMS_AND_E, column_tiles, producer_reference, target_anchors

    writer = Writer(os.path.join(out_dir, "check.csv"), ("case", "quantity", "err", "err_torch", "ratio", "ok",
                                                         "protocol", "workload", "gpu"))
    ok_all = True

    def record(case, quantity, err, err_torch, limit_ratio=2.0, atol=1e-6):
        nonlocal ok_all
        ratio = err / err_torch if err_torch > 0 else float("inf")
        ok = bool(err <= limit_ratio * err_torch + atol) if not math.isnan(err) else False
        ok_all &= ok
        writer.rows([dict(case=case, quantity=quantity, err=f"{err:.4e}", err_torch=f"{err_torch:.4e}",
                          ratio=f"{ratio:.3f}", ok=ok, protocol="accuracy_vs_fp64",
                          workload="per_case_random_inputs", gpu=gpu)])
        print(f"check {case:34s} {quantity:8s} err={err:.3e} torch={err_torch:.3e} ratio={ratio:.2f} "
              f"{'ok' if ok else 'FAIL'}", flush=True)

    def inputs(T, H, V, seed, ignore=0.2, w_scale=2.0):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        x = torch.randn(T, H, device="cuda", generator=gen).bfloat16()
        w = (torch.randn(V, H, device="cuda", generator=gen) * (w_scale / math.sqrt(H))).bfloat16()
        y = torch.randint(0, V, (T,), device="cuda", generator=gen)
        y[torch.rand(T, device="cuda", generator=gen) < ignore] = -100
        y[0] = V - 1
        return x, w, y

    # 1. the producer against its reference
    x, w, y = inputs(300, 512, 5000, 1)
    _, anchor = target_anchors(x, w, y, ignore_index=-100)
    for epilogue, ctas in ((SUMS_AND_E, 7), (SUMS_AND_E, 0), (SUMS, 7)):
        parts = torch.full((2, 300, column_tiles(5000)), float("nan"), device="cuda")
        ref_parts = torch.zeros_like(parts)
        e = torch.full((300, g.e_row_stride(5000)), float("nan"), device="cuda", dtype=torch.bfloat16)[:, :5000]
        ref_e = torch.zeros((300, 5000), device="cuda", dtype=torch.bfloat16)
        g.launch(x, w, anchor, parts, e, epilogue=epilogue, max_ctas=ctas)
        torch.cuda.synchronize()
        producer_reference(x, w, anchor, ref_parts, ref_e, epilogue=epilogue)
        case = f"producer ep={epilogue} ctas={ctas}"
        record(case, "sums", rel_err(parts[0], ref_parts[0]), 1e-6, atol=1e-6)
        record(case, "entropy", rel_err(parts[1], ref_parts[1]), 1e-6, atol=1e-6)
        if epilogue == SUMS_AND_E:
            record(case, "E", rel_err(e.float(), ref_e.float()), 4e-3, atol=0)
            record(case, "E_ignored0", float(e[y == -100].float().abs().sum().item()), 1.0, atol=0)

    def fp64_grads(fn, x, w, up, *args, **kw):
        xl, wl = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        out = fn(xl, wl, *args, **kw)
        first = out[0] if isinstance(out, tuple) else out
        (first * up).sum().backward()
        return first.detach(), xl.grad, wl.grad, (out[1] if isinstance(out, tuple) else None)

    def torch_ce(x, w, y, reduction):
        s = torch.nn.functional.linear(x, w).float()
        return torch.nn.functional.cross_entropy(s, y, reduction=reduction, ignore_index=-100)

    def torch_logprobs(x, w, y, tau):
        logsm = torch.log_softmax(torch.nn.functional.linear(x, w).float() / tau, -1)
        valid = y != -100
        lp = torch.where(valid, logsm.gather(1, torch.where(valid, y, 0)[:, None])[:, 0], 0)
        return lp, torch.where(valid, -(logsm.exp() * logsm).sum(-1), 0)

    def _fp64_lp(x, w, y, tau):
        logsm = torch.log_softmax((x @ w.t()) / tau, -1)
        valid = y != -100
        lp = torch.where(valid, logsm.gather(1, torch.where(valid, y, 0)[:, None])[:, 0], 0)
        return lp, torch.where(valid, -(logsm.exp() * logsm).sum(-1), 0)

    # 2. cross-entropy: mean, one chunk and chunks of 512 (fp32 accumulator); a ragged vocabulary
    for (T, H, V), chunk in (((2048, 1024, 32003), None), ((2048, 1024, 32003), 512), ((1024, 2048, 50000), None)):
        x, w, y = inputs(T, H, V, 2)
        one = torch.ones((), device="cuda")
        got = fp64_grads(anchored_cross_entropy, x, w, one, y, chunk_tokens=chunk)
        ref = fp64_grads(reference.linear_cross_entropy_fp64, x.double(), w.double(), one.double(), y)
        tch = fp64_grads(torch_ce, x, w, one, y, "mean")
        case = f"ce mean T{T} H{H} V{V} chunk{chunk}"
        for q, i in (("loss", 0), ("dX", 1), ("dW", 2)):
            record(case, q, rel_err(got[i], ref[i]), rel_err(tch[i], ref[i]), atol=1e-5 if i == 0 else 1e-3)
    # 3. per-token log-probs at τ 0.7 with an upstream and the entropy
    x, w, y = inputs(2048, 1024, 32003, 3)
    up = torch.randn(2048, device="cuda")
    got = fp64_grads(lambda a, b: anchored_logprobs(a, b, y, temperature=0.7, return_entropy=True), x, w, up)
    ref = fp64_grads(lambda a, b: _fp64_lp(a, b, y, 0.7), x.double(), w.double(), up.double())
    tch = fp64_grads(lambda a, b: torch_logprobs(a, b, y, 0.7), x, w, up)
    for q, i in (("logp", 0), ("dX", 1), ("dW", 2), ("entropy", 3)):
        record("logprobs tau0.7", q, rel_err(got[i], ref[i]), rel_err(tch[i], ref[i]), atol=1e-4 if i in (0, 3)
               else 1e-3)
    # 4. no gradient
    with torch.no_grad():
        loss = anchored_cross_entropy(x, w, y, reduction="none")
        lp, ent, _ = anchored_logprobs(x, w, y, temperature=0.7, return_entropy=True)
        ref_loss = reference.linear_cross_entropy_fp64(x.double(), w.double(), y, reduction="none")
        tch_loss = torch_ce(x, w, y, "none")
    record("no_grad ce none", "loss", rel_err(loss, ref_loss), rel_err(tch_loss, ref_loss), atol=1e-5)
    record("no_grad logprobs tau0.7", "logp", rel_err(lp, ref[0]), rel_err(tch[0], ref[0]), atol=1e-4)
    record("no_grad logprobs tau0.7", "entropy", rel_err(ent, ref[3]), rel_err(tch[3], ref[3]), atol=1e-4)
    # 5. rows past the anchor's reach: 3 rows with a class 100 nats above the target (the counted exact pass)
    x, w, y = inputs(1024, 1024, 32003, 4, ignore=0.0)
    rows = torch.tensor([5, 600, 1000], device="cuda")
    hot = (y[5].item() + 1) % 32003
    x[rows, 0] = 8.0
    w[:, 0] = 0.0
    w[hot, 0] = 12.5
    got = fp64_grads(anchored_cross_entropy, x, w, one, y, chunk_tokens=512)
    ref = fp64_grads(reference.linear_cross_entropy_fp64, x.double(), w.double(), one.double(), y)
    tch = fp64_grads(torch_ce, x, w, one, y, "mean")
    for q, i in (("loss", 0), ("dX", 1), ("dW", 2)):
        record("ce flagged rows", q, rel_err(got[i], ref[i]), rel_err(tch[i], ref[i]), atol=1e-5 if i == 0 else 1e-3)
    return ok_all


def timed_rounds(providers: dict, rounds: int, warmup: int = 2) -> dict:
    """{name: [ms per rep]}: every provider warmed up, then `rounds` rounds in a new random order each, one rep a
    provider per round between CUDA events, read after the round."""
    import torch

    for fn in providers.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    times = {name: [] for name in providers}
    for _ in range(rounds):
        order = list(providers)
        random.shuffle(order)
        events = []
        for name in order:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            providers[name]()
            end.record()
            events.append((name, start, end))
        torch.cuda.synchronize()
        for name, start, end in events:
            times[name].append(start.elapsed_time(end))
    return times


def quantiles(ts: list[float]) -> tuple[float, float, float]:
    ts = sorted(ts)
    return ts[len(ts) // 5], ts[len(ts) // 2], ts[(4 * len(ts)) // 5]


def peak_extra_mib(fn) -> float:
    import torch

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def block_rows(section, times, floors: dict, head, V, H, T, gpu, workload, peaks=None) -> list[dict]:
    rows = []
    p50s = {n: quantiles(ts)[1] for n, ts in times.items()}
    for name, ts in times.items():
        p20, p50, p80 = quantiles(ts)
        floor = floors.get(name, "")
        rows.append(dict(section=section, provider=name, head=head, vocab=V, hidden=H, tokens=T, ms_p20=f"{p20:.4f}",
                         ms_p50=f"{p50:.4f}", ms_p80=f"{p80:.4f}", n_reps=len(ts), floor=floor,
                         ratio_p50=f"{p50 / p50s[floor]:.4f}" if floor else "",
                         peak_extra_mib=f"{peaks[name]:.1f}" if peaks and name in peaks else "",
                         protocol="shuffled", workload=workload, gpu=gpu))
        print(f"{section:8s} {head:8s} T={T:6d} {name:28s} p50={p50:9.3f} ms  "
              + (f"x{floor}={p50 / p50s[floor]:.3f}" if floor else ""), flush=True)
    return rows


def producer_inputs(T: int, H: int, V: int, seed: int, ignored_every: int = 0):
    """(x [T, H] bf16 N(0, 1), w [V, H] bf16 N(0, 0.02²), targets [T] (every `ignored_every`-th ignored), anchors
    [T]) on the GPU: the producer's inputs in the probes that time or check it."""
    import torch

    from fusedkern.kernels.anchored_rows import target_anchors

    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, H, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(V, H, device="cuda", generator=gen) * 0.02).bfloat16()
    y = torch.randint(0, V, (T,), device="cuda", generator=gen)
    if ignored_every:
        y[::ignored_every] = -100
    _, anchor = target_anchors(x, w, y, ignore_index=-100)
    return x, w, y, anchor


def producer_section(writer, head, V, H, T, rounds, gpu):
    import torch

    from fusedkern.kernels import gluon_anchored_exp as g
    from fusedkern.kernels import gluon_logits_stats as stats
    from fusedkern.kernels.anchored_rows import NONE, SUMS, SUMS_AND_E, column_tiles

    x, w, y, anchor = producer_inputs(T, H, V, seed=T + H)
    logits = torch.empty(T, V, device="cuda", dtype=torch.bfloat16)
    e = torch.empty((T, g.e_row_stride(V)), device="cuda", dtype=torch.bfloat16)[:, :V]
    parts1 = torch.empty((1, T, column_tiles(V)), device="cuda")
    parts2 = torch.empty((2, T, column_tiles(V)), device="cuda")
    parts3 = torch.empty((3, T, column_tiles(V)), device="cuda")
    sparts = stats.empty_partials(T, V, x.device)
    tl = torch.empty(T, device="cuda")
    providers = {
        "cublas_mm": lambda: torch.mm(x, w.t(), out=logits),
        "anchored_none": lambda: g.launch(x, w, anchor, parts1, None, epilogue=NONE),
        "anchored_sums": lambda: g.launch(x, w, anchor, parts1, None, epilogue=SUMS),
        "anchored_sums_entropy": lambda: g.launch(x, w, anchor, parts2, None, epilogue=SUMS),
        "anchored_sums_row_max": lambda: g.launch(x, w, anchor, parts2, None, epilogue=SUMS, row_max=True),
        "anchored_sums_entropy_row_max": lambda: g.launch(x, w, anchor, parts3, None, epilogue=SUMS, row_max=True),
        "anchored_sums_and_e": lambda: g.launch(x, w, anchor, parts1, e, epilogue=SUMS_AND_E),
        "anchored_sums_and_e_entropy": lambda: g.launch(x, w, anchor, parts2, e, epilogue=SUMS_AND_E),
        "anchored_sums_and_e_g8": lambda: g.launch(x, w, anchor, parts1, e, epilogue=SUMS_AND_E, group_m=8),
        "gluon_stats": lambda: stats.launch_partials(x, w, y, sparts, tl),
    }
    times = timed_rounds(providers, rounds)
    writer.rows(block_rows("producer", times, {n: "cublas_mm" for n in providers}, head, V, H, T, gpu,
                           "dense_w0.02"))


def pass_section(writer, head, V, H, T, rounds, gpu):
    import torch

    import fusedkern
    from fusedkern.anchored import anchored_cross_entropy, anchored_logprobs
    from fusedkern.logprobs import linear_logprobs_with_stats

    gen = torch.Generator(device="cuda").manual_seed(T + 7 * H)
    x = torch.randn(T, H, device="cuda", generator=gen).bfloat16().requires_grad_()
    w = (torch.randn(V, H, device="cuda", generator=gen) * 0.02).bfloat16().requires_grad_()
    y = torch.randint(0, V, (T,), device="cuda", generator=gen)
    up = torch.randn(T, device="cuda", generator=gen) / T
    G = torch.randn(T, V, device="cuda", generator=gen).bfloat16()

    def clear():
        x.grad = None
        w.grad = None

    def floor3():
        with torch.no_grad():
            torch.mm(x, w.t())
            torch.mm(G, w)
            torch.mm(G.t(), x)

    def floor1():
        with torch.no_grad():
            torch.mm(x, w.t())

    def fk_ce():
        clear()
        fusedkern.linear_cross_entropy(x, w, y).backward()

    def an_ce(chunk=None):
        def run():
            clear()
            anchored_cross_entropy(x, w, y, chunk_tokens=chunk).backward()
        return run

    def fk_lp():
        clear()
        logp, _, _, _ = linear_logprobs_with_stats(x, w, y, temperature=0.7, return_entropy=True)
        (logp * up).sum().backward()

    def an_lp():
        clear()
        logp, _, _ = anchored_logprobs(x, w, y, temperature=0.7, return_entropy=True)
        (logp * up).sum().backward()

    def fk_nograd():
        with torch.no_grad():
            fusedkern.linear_cross_entropy(x, w, y)

    def an_nograd():
        with torch.no_grad():
            anchored_cross_entropy(x, w, y)

    def fk_lp_nograd():
        with torch.no_grad():
            linear_logprobs_with_stats(x, w, y, temperature=0.7, return_entropy=True)

    def an_lp_nograd():
        with torch.no_grad():
            anchored_logprobs(x, w, y, temperature=0.7, return_entropy=True)

    providers = {"floor_3gemm": floor3, "floor_1gemm": floor1, "fusedkern_ce": fk_ce, "anchored_ce": an_ce(),
                 "anchored_ce_c8192": an_ce(8192), "fusedkern_logprobs_grad": fk_lp, "anchored_logprobs_grad": an_lp,
                 "fusedkern_ce_nograd": fk_nograd, "anchored_ce_nograd": an_nograd,
                 "fusedkern_logprobs_nograd": fk_lp_nograd, "anchored_logprobs_nograd": an_lp_nograd}
    if T <= 8192:
        del providers["anchored_ce_c8192"]  # the same plan as anchored_ce there
    floors = {n: ("floor_1gemm" if "nograd" in n or n == "floor_1gemm" else "floor_3gemm") for n in providers}
    peaks = {}
    for name, fn in providers.items():
        if name.startswith("floor"):
            continue
        fn()  # compile and tune first, outside the peak
        peaks[name] = peak_extra_mib(fn)
    clear()
    times = timed_rounds(providers, rounds)
    writer.rows(block_rows("pass", times, floors, head, V, H, T, gpu, "dense_w0.02_tau0.7", peaks))


def guarded(what: str, fn, *args) -> bool:
    """fn(*args); an exception is printed and the next block runs (False), unless CUDA's context is gone."""
    import traceback

    try:
        result = fn(*args)
        return True if result is None else bool(result)
    except Exception:  # noqa: BLE001  (report the block, go on with the next)
        print(f"FAILED {what}:\n{traceback.format_exc()[-3000:]}", flush=True)
        if "CUDA error" in traceback.format_exc():
            raise
        return False


def gpu_main(args) -> int:
    import torch

    out_dir = args.out or os.environ.get("OUT", ".")
    os.makedirs(out_dir, exist_ok=True)
    gpu = torch.cuda.get_device_name()
    random.seed(0)
    sections = args.sections.split(",")
    ok = True
    if "check" in sections:
        t0 = time.time()
        ok = guarded("check", check_section, out_dir, gpu)
        print(f"check: {'passed' if ok else 'FAILED'} in {time.time() - t0:.0f} s", flush=True)
    heads = args.heads.split(",")
    tokens = [int(t) for t in args.tokens.split(",")]
    if "producer" in sections:
        writer = Writer(os.path.join(out_dir, "producer.csv"), COLUMNS)
        for head in heads:
            V, H = HEADS[head]
            for T in tokens:
                t0 = time.time()
                ok &= guarded(f"producer {head} {T}", producer_section, writer, head, V, H, T, args.rounds, gpu)
                torch.cuda.empty_cache()
                print(f"producer {head} {T}: {time.time() - t0:.0f} s", flush=True)
    if "pass" in sections:
        writer = Writer(os.path.join(out_dir, "pass.csv"), COLUMNS)
        for head in heads:
            V, H = HEADS[head]
            for T in tokens:
                t0 = time.time()
                ok &= guarded(f"pass {head} {T}", pass_section, writer, head, V, H, T, args.rounds, gpu)
                torch.cuda.empty_cache()
                print(f"pass {head} {T}: {time.time() - t0:.0f} s", flush=True)
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--out", default=None)
    parser.add_argument("--heads", default=",".join(HEADS))
    parser.add_argument("--tokens", default="8192,16384")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--sections", default="check,producer,pass")
    args = parser.parse_args()
    if args.compile:
        os.environ["TRITON_INTERPRET"] = "0"
        return compile_main(args.variants.split(","))
    if args.gpu:
        return gpu_main(args)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
