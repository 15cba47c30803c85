"""Where an SFT step's time goes (issue 48 item 2): one optimizer step of scripts/gpu_train_table.py's SFT run under
`torch.profiler`, for each small model and each of the table's four rows (TRL's head, TRL + Liger's layer kernels,
fusedkern, fusedkern + Liger's layers), its kernel time put in the categories of `fusedkern.study.step_profile`
(the head's GEMMs, the head's other kernels, attention, the other decoder-layer kernels, the optimizer, the rest),
and beside them the head's three-GEMM floor over the step's tokens, timed in the same process (cuBLAS on an N(0, 1)
logits gradient, CUDA events, × the gradient-accumulation steps): what a head *at* its floor would cost.

    python scripts/gpu_step_profile.py --checkpoints DIR --out step_time_breakdown.csv
    python scripts/gpu_step_profile.py --tiny --out FILE          # CPU: tiny shapes, operators' own CPU time

The model, data, trainer and rows are gpu_train_table.py's own (`build_trainer` through `run_one`, its checkpoints,
its micro-batches: 8 sequences of 2048 tokens × 2 accumulation steps on both models); the step profiled comes after
--warmup steps (compilation and autotuning), and every run of a call shares one process (a profile needs no peak
memory of its own). One CSV row per (model, row, category) with kernel_ms and the run's kernel total; one
`head_floor_3gemm` row per model. The profiled step's wall time (`step_wall_ms`) includes the profiler's overhead;
`gpu_busy_ms` is the time at least one kernel ran in it (their union): a step whose GPU is busy well under its wall
time waits on the host, and a faster head cannot shorten it.
The biggest kernels of each category are printed, so a misplaced one shows in the log.
"""

from __future__ import annotations

import argparse
import csv
import gc
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_train_table as table  # noqa: E402  (sets USE_HUB_KERNELS, puts examples/ on sys.path)
import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from fusedkern.study import step_profile  # noqa: E402

SMALL_MODELS = ("qwen3-0.6b", "llama-3.2-1b")
COLUMNS = ("model", "step", "row", "category", "kernel_ms", "kernel_total_ms", "step_wall_ms", "gpu_busy_ms",
           "layers", "hidden", "vocab", "seq_len", "micro_batch", "grad_accum", "tokens_per_step", "workload",
           "protocol", "device", "torch", "triton", "transformers", "trl", "liger_kernel", "commit", "phase", "note")


class ProfileOneStep(TrainerCallback):
    """Profiles the optimizer step after `warmup` steps, with `step_profile.scope_hooks` on the trained model."""

    def __init__(self, warmup: int, cuda: bool):
        self.warmup, self.cuda = warmup, cuda
        self.prof = None
        self.hooks = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.hooks = step_profile.scope_hooks(model).__enter__()

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.warmup:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            if self.cuda:
                torch.cuda.synchronize()
            self.prof = profile(activities=activities)
            self.prof.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        if self.prof is not None and state.global_step == self.warmup + 1:  # global_step counts this step now
            if self.cuda:
                torch.cuda.synchronize()
            self.prof.__exit__(None, None, None)

    def on_train_end(self, args, state, control, **kwargs):
        self.hooks.__exit__(None, None, None)


def floor_ms(shape, micro: int, seq: int, grad_accum: int, cuda: bool) -> float:
    """The head's three GEMMs (logits, dX, dW) over one micro-batch's tokens, p50 over timed reps, × grad_accum."""
    from fusedkern.reference import cublas_3gemm
    from fusedkern.study.providers import Step
    from fusedkern.study.timing import time_step
    from fusedkern.study.workloads import Inputs

    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    tokens = micro * seq
    x = torch.randn(tokens, shape.hidden, generator=gen, device=device).to(dtype)
    # σ 0.02: the models' own init (Transformers' initializer_range); a GEMM's time depends on its operands' values
    w = (torch.randn(shape.vocab, shape.hidden, generator=gen, device=device) * 0.02).to(dtype)
    grad = torch.randn(tokens, shape.vocab, generator=gen, device=device).to(dtype)

    def run(_):
        with torch.no_grad():
            cublas_3gemm(x, w, grad)

    inputs = Inputs(op="ce", x=x, w=w, target=torch.zeros(1, dtype=torch.long, device=device))
    timing = time_step(Step(run=run), inputs, warmup=3, reps=20, min_reps=10, max_case_s=2.0)
    return timing["ms_p50"] * grad_accum


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="the CSV to write (step_time_breakdown.csv)")
    p.add_argument("--checkpoints", default=None, help="gpu_train_table.py's checkpoint folder (--tiny: temporary)")
    p.add_argument("--model", nargs="+", choices=SMALL_MODELS, default=list(SMALL_MODELS))
    p.add_argument("--row", nargs="+", choices=table.ROWS, default=list(table.ROWS))
    p.add_argument("--warmup", type=int, default=2, help="optimizer steps before the profiled one")
    p.add_argument("--phase", default="after", help="the CSV's phase column (as gpu_train_table.py's)")
    p.add_argument("--budget-s", type=float, default=540.0, help="no run starts after this many seconds")
    p.add_argument("--top", type=int, default=6, help="kernels printed per category")
    p.add_argument("--tiny", action="store_true", help="tiny shapes on CPU")
    return p.parse_args(argv)


def main(argv=None) -> list[dict]:
    opts = parse_args(argv)
    start = time.perf_counter()
    table_argv = ["--model", *opts.model, "--step", "sft", "--row", *opts.row, "--steps", "1",
                  "--warmup", str(opts.warmup), "--phase", opts.phase]
    table_argv += ["--checkpoints", opts.checkpoints] if opts.checkpoints else []
    table_argv += ["--tiny"] if opts.tiny else []
    args = table.parse_args(table_argv)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as scratch:
        args.checkpoints = args.checkpoints or scratch
        for model_name in args.model:
            table.write_checkpoint(Path(args.checkpoints) / model_name, args.shapes[model_name], args.seq, args.seed,
                                   args.cuda)
        for model_name in args.model:
            shape = args.shapes[model_name]
            for row in args.row:
                if time.perf_counter() - start > opts.budget_s:
                    print(f"skipped (budget): {model_name} {row}", flush=True)
                    continue
                rows += profile_run(model_name, row, args, opts)
            global_batch, micro = shape.batches["sft"]
            done = [r for r in rows if r["model"] == model_name]
            if done:
                ms = floor_ms(shape, micro, args.seq, global_batch // micro, args.cuda)
                rows.append({**{k: done[0][k] for k in COLUMNS if k not in ("row", "category", "kernel_ms")},
                             "row": "floor", "category": step_profile.FLOOR_CATEGORY, "kernel_ms": f"{ms:.3f}",
                             "kernel_total_ms": "", "step_wall_ms": "", "gpu_busy_ms": "", "protocol": "timed_reps",
                             "note": f"cuBLAS logits, dX and dW GEMMs over {micro * args.seq} tokens, p50 of timed "
                                     f"reps, x {global_batch // micro} micro-batches"})
                print(f"{model_name}: the head's 3-GEMM floor over the step's tokens {ms:.2f} ms", flush=True)
    with open(opts.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    print(f"{len(rows)} rows -> {opts.out} in {time.perf_counter() - start:.0f} s", flush=True)
    return rows


def profile_run(model_name: str, row: str, args, opts) -> list[dict]:
    """One profiled SFT step of (model, row): its CSV rows, one per category."""
    callback = ProfileOneStep(opts.warmup, args.cuda)
    result = table.run_one(model_name, "sft", row, args, callbacks=[callback])
    if callback.prof is None:
        raise RuntimeError(f"{model_name} {row}: the step after {opts.warmup} warm-up steps was not profiled")
    ops, unclaimed = step_profile.ops_from_profile(callback.prof, device_kernels=args.cuda)
    totals, ranked = step_profile.classify(ops, unclaimed_us=unclaimed)
    busy_ms = step_profile.device_busy_us(callback.prof) / 1e3 if args.cuda else float("nan")
    gaps = step_profile.idle_gaps(callback.prof) if args.cuda else []
    hosts = [step_profile.host_during_gap(callback.prof, at, gap) for gap, at, _, _ in gaps]
    del callback, ops
    gc.collect()
    if args.cuda:
        torch.cuda.empty_cache()
    total_ms = sum(totals.values()) / 1e3
    print(f"{model_name} sft {row}: kernels {total_ms:.1f} ms, the GPU busy {busy_ms:.1f} ms, in a step of "
          f"{float(result['step_ms_p50']):.1f} ms (profiled)", flush=True)
    if gaps:
        print(f"  idle gaps ≥ 0.5 ms: {len(gaps)}, {sum(g for g, *_ in gaps) / 1e3:.1f} ms", flush=True)
        for (gap, at, before, after), host in zip(gaps, hosts):  # every one: where, between which kernels, and
            # what the host did meanwhile
            print(f"    {gap / 1e3:6.2f} ms at +{at / 1e3:7.1f} ms: {before[:70]} → {after[:70]}; host {host[:160]}",
                  flush=True)
    for category in step_profile.CATEGORIES:
        top = [(n, us) for c, n, us in ranked if c == category][:opts.top]
        print(f"  {category:<13} {totals[category] / 1e3:9.2f} ms  " + "; ".join(
            f"{n[:60]} {us / 1e3:.2f}" for n, us in top), flush=True)
    common = {k: result[k] for k in ("model", "step", "row", "layers", "hidden", "vocab", "seq_len", "micro_batch",
                                     "grad_accum", "tokens_per_step", "workload", "device", "torch", "triton",
                                     "transformers", "trl", "liger_kernel", "commit", "phase")}
    return [{**common, "category": category, "kernel_ms": f"{totals[category] / 1e3:.3f}",
             "kernel_total_ms": f"{total_ms:.3f}", "step_wall_ms": result["step_ms_p50"],
             "gpu_busy_ms": f"{busy_ms:.3f}", "protocol": "profiled_step",
             "note": f"includes {unclaimed / 1e3:.3f} ms of device kernels no operator claims"
             if category == "rest" and unclaimed else ""} for category in step_profile.CATEGORIES]


if __name__ == "__main__":
    main()
