"""Vocabulary-parallel LM-head cross-entropy: fusedkern.distributed against a Megatron-style unfused baseline.

Each rank holds V/world rows of the head (hidden 4096, vocab 128256, bf16 by default). Per round every provider
runs one forward + backward in a new random order (seeded); a round's time is the slowest rank's (all-reduce
MAX of the per-rank CUDA-event times), reported as p20/p50/p80 over the rounds, with the extra memory per rank
(peak allocated during the step minus what the inputs and gradients hold). Providers:
  fusedkern       fusedkern.distributed.vocab_parallel_cross_entropy (chunked; fp32 dW accumulation)
  megatron_torch  logits [T, V/world] materialized in bf16, upcast to fp32, Megatron-LM's vocab-parallel CE
                  written in plain PyTorch (all-reduces of max, target logit and sum-exp; softmax saved for backward)
  gemm3_shard     the three cuBLAS GEMMs of one rank's shard (X·W_rᵀ, G·W_r, Gᵀ·X): the per-rank compute floor
  fusedkern_one_gpu  (world of one only) fusedkern.linear_cross_entropy on the whole head: what the
                  vocabulary-parallel path costs beyond the single-GPU op

    torchrun --nproc-per-node 8 scripts/bench_vocab_parallel.py --out vocab_parallel_world8.csv
    python scripts/bench_vocab_parallel.py --device cpu --tokens 16 --hidden 8 --vocab 37 --rounds 2   # smoke test

NVLink multicast stays off (NCCL_NVLS_ENABLE=0, set below unless the caller set it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fusedkern import linear_cross_entropy  # noqa: E402
from fusedkern.distributed import even_vocab_shard, vocab_parallel_cross_entropy  # noqa: E402

QUANTILES = torch.tensor([0.2, 0.5, 0.8], dtype=torch.float64)
PROVIDERS = ("fusedkern", "megatron_torch", "gemm3_shard", "fusedkern_one_gpu")


class _CopyToParallelRegion(torch.autograd.Function):
    """Megatron's copy into the tensor-parallel region: identity forward, all-reduce of dX in backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _MegatronVocabParallelCE(torch.autograd.Function):
    """Megatron-LM's vocab-parallel cross-entropy over fp32 logits of this rank's columns [T, V_r]."""

    @staticmethod
    def forward(ctx, logits, target, start, group):
        logits = logits.clone()  # Megatron subtracts the max in place on its own copy
        row_max = logits.max(dim=-1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        logits -= row_max[:, None]
        outside = (target < start) | (target >= start + logits.shape[1])
        local = torch.where(outside, 0, target - start)
        rows = torch.arange(logits.shape[0], device=logits.device)
        target_logit = torch.where(outside, 0.0, logits[rows, local])
        dist.all_reduce(target_logit, group=group)
        torch.exp(logits, out=logits)
        sum_exp = logits.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        logits /= sum_exp[:, None]  # the softmax, saved for backward
        ctx.save_for_backward(logits, outside, local)
        return torch.log(sum_exp) - target_logit

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, outside, local = ctx.saved_tensors
        rows = torch.arange(softmax.shape[0], device=softmax.device)
        grad = softmax  # in place, as Megatron does (the saved softmax is not needed again)
        grad[rows, local] -= (~outside).to(grad.dtype)
        grad *= grad_loss[:, None]
        return grad, None, None, None


def megatron_step(x, w, y, start, group):
    x_in = _CopyToParallelRegion.apply(x, group)
    logits = (x_in @ w.t()).float()
    return _MegatronVocabParallelCE.apply(logits, y, start, group).mean()


def gemm3_step(x, w, grad_buf):
    torch.mm(x, w.t(), out=grad_buf)
    torch.mm(grad_buf, w)
    torch.mm(grad_buf.t(), x)
    return None


def timed(device, fn) -> float:
    """Milliseconds of fn() on this rank: CUDA events on a GPU, the wall clock on a CPU."""
    if device.type == "cuda":
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    p.add_argument("--out", type=Path, help="CSV to write on rank 0 (and its .json provenance); default: print only")
    args = p.parse_args(argv)

    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29511")):
        os.environ.setdefault(key, value)  # a plain `python` launch is a world of one
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=5))
    dtype = getattr(torch, args.dtype)
    start, stop = even_vocab_shard(args.vocab, None)
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    w_full_rows = (torch.randn(stop - start, args.hidden, generator=gen) / args.hidden ** 0.5).to(device, dtype)
    rows = []
    order_rng = random.Random(args.seed)
    for tokens in args.tokens:
        x = torch.randn(tokens, args.hidden, generator=gen).to(device, dtype)
        y = torch.randint(0, args.vocab, (tokens,), generator=gen).to(device)  # every rank: the same tokens
        dist.broadcast(x, 0)
        dist.broadcast(y, 0)
        x.requires_grad_()
        w = w_full_rows.clone().requires_grad_()
        grad_buf = torch.empty(tokens, stop - start, device=device, dtype=dtype)

        def fusedkern_step():
            loss = vocab_parallel_cross_entropy(x, w, y, vocab_start=start, vocab_size=args.vocab)
            loss.backward()
            return loss

        def megatron():
            loss = megatron_step(x, w, y, start, None)
            loss.backward()
            return loss

        def one_gpu():
            loss = linear_cross_entropy(x, w, y)
            loss.backward()
            return loss

        steps = {"fusedkern": fusedkern_step, "megatron_torch": megatron,
                 "gemm3_shard": lambda: gemm3_step(x.detach(), w.detach(), grad_buf), "fusedkern_one_gpu": one_gpu}
        steps = {k: v for k, v in steps.items() if k in args.providers and (world == 1 or k != "fusedkern_one_gpu")}
        times = {k: [] for k in steps}
        peak, losses = {}, {}
        for name, fn in steps.items():  # warm-up (autotuning, allocations), then the extra memory of one step
            for _ in range(args.warmup):
                x.grad = w.grad = None
                loss = fn()
            losses[name] = None if loss is None else loss.item()
            x.grad = w.grad = None
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
                fn()
                torch.cuda.synchronize()
                grads = sum(t.grad.numel() * t.grad.element_size() for t in (x, w) if t.grad is not None)
                peak[name] = (torch.cuda.max_memory_allocated(device) - base - grads) / 2**20
        for _ in range(args.rounds):
            names = list(steps)
            order_rng.shuffle(names)  # the same order on every rank: the collectives must match
            for name in names:
                x.grad = w.grad = None
                dist.barrier()
                ms = torch.tensor([timed(device, steps[name])], dtype=torch.float64, device=device)
                dist.all_reduce(ms, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
                times[name].append(ms.item())
        for name, ts in times.items():
            q = torch.tensor(ts, dtype=torch.float64).quantile(QUANTILES).tolist()
            rows.append(dict(op="ce_vocab_parallel", provider=name, x_name="tokens", x=tokens, mode="full",
                             hidden=args.hidden, vocab=args.vocab, dtype=args.dtype, world_size=world,
                             shard_rows=stop - start, ms_p20=q[0], ms_p50=q[1], ms_p80=q[2], n_reps=len(ts),
                             peak_extra_mib=peak.get(name), loss=losses[name],
                             protocol="shuffled order each round, slowest rank per round",
                             workload="dense targets, fwd+bwd"))
        x = y = w = grad_buf = None  # free this size's tensors before the next (the closures above read them)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if "fusedkern" in losses and "megatron_torch" in losses:  # the same loss, or the timings mean nothing
            a, b = losses["fusedkern"], losses["megatron_torch"]
            if not abs(a - b) <= 1e-2 * abs(b):
                raise RuntimeError(f"fusedkern's loss {a} differs from the Megatron-style baseline's {b}")
    if rank == 0:
        import pandas as pd

        df = pd.DataFrame(rows)
        print(df.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
        if args.out is not None:
            from fusedkern.study.results import collect_environment

            df.to_csv(args.out, index=False, float_format="%.4f")
            meta = dict(seed=args.seed, warmup=args.warmup, environment=collect_environment())
            args.out.with_suffix(".json").write_text(json.dumps(meta, indent=1, default=str) + "\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
