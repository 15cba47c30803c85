"""The head's part of a TRL SFT step (forward + backward of SFTTrainer's loss over the LM head, the entropy and top-1
metrics included), timed with the study's shuffled protocol (`fusedkern.study.timing`): fusedkern's anticipated head
(`fusedkern.anticipated`, three GEMMs; what `fusedkern.integrations.trl` gives SFTTrainer) for loss_type nll and dft,
the same with an upstream it did not anticipate (every row recomputed: the fallback's cost), fusedkern's per-token
head (`linear_logprobs_with_stats`, four GEMMs: the TRL patch before), TRL's own head
(`trl.kernels.ChunkedLogProbFunction`), fusedkern's scalar cross-entropy (the Transformers patch's three GEMMs), and
the floor: the three cuBLAS GEMMs over the scored rows with a pre-made logits gradient.

Every provider scores only the rows with a label (gathered inside the step, as both heads do), bf16, at the heads of
the issue's training table (Qwen3-0.6B, Llama-3.2-1B) and Llama-3-8B's; workloads "completion_50" (sequences of
2048 tokens whose first half is the prompt) and "packed" (every token scored). Writes a CSV with one row per
provider and point: ms p20/p50/p80, the ratio of p50 to the floor's p50 of the same process and point, the peak
memory above the inputs, and `protocol` / `workload` columns.

    python probes/probe_sft_head.py --csv sft_head.csv                  # CUDA
    python probes/probe_sft_head.py --tiny --csv sft_head_tiny.csv     # CPU smoke run (Triton's interpreter)
"""
from __future__ import annotations

import argparse
import csv
import random
import sys

import torch

from fusedkern.anticipated import linear_logprobs_anticipated
from fusedkern.linear_cross_entropy import linear_cross_entropy
from fusedkern.logprobs import is_top1, linear_logprobs_with_stats
from fusedkern.study.providers import Step
from fusedkern.study.timing import time_steps_interleaved
from fusedkern.study.workloads import IGNORE_INDEX, Inputs

HEADS = {"qwen3_0p6b": (151936, 1024), "llama32_1b": (128256, 2048), "llama3_8b": (128256, 4096)}
TOKENS = (8192, 16384)
WORKLOADS = ("completion_50", "packed")
SEQ = 2048
ROUNDS = 20
COLUMNS = ("impl", "head", "vocab", "hidden", "tokens", "scored", "dtype", "ms_p20", "ms_p50", "ms_p80", "n_reps",
           "ratio_p50_to_floor", "peak_extra_mib", "protocol", "workload")


def make_inputs(tokens: int, vocab: int, hidden: int, workload: str, device, dtype, seq: int) -> Inputs:
    gen = torch.Generator(device).manual_seed(0)
    x = torch.randn(tokens, hidden, generator=gen, device=device).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=gen, device=device) * (2.0 / hidden ** 0.5)).to(dtype).requires_grad_()
    target = torch.randint(vocab, (tokens,), generator=gen, device=device)
    if workload == "completion_50":
        target = target.masked_fill((torch.arange(tokens, device=device) % seq) < seq // 2, IGNORE_INDEX)
    return Inputs("ce", x, w, target)


def sft_loss(log_probs: torch.Tensor, count: torch.Tensor, loss_type: str) -> torch.Tensor:
    """SFTTrainer.compute_loss's reduction (TRL 1.16) of the scattered log-probs."""
    per_token = -log_probs
    if loss_type == "dft":
        per_token = per_token * log_probs.exp().detach()
    return per_token.sum() / count.clamp(min=1)


def steps_for(inp: Inputs) -> dict[str, Step]:
    x, w, target = inp.x, inp.w, inp.target
    mask = target != IGNORE_INDEX

    def rows():
        index = mask.nonzero().squeeze(-1)  # the heads' compaction (a host sync in both)
        return index, x.index_select(0, index), target.index_select(0, index)

    def scatter(values):
        return values.new_zeros(mask.shape).masked_scatter(mask, values)

    def fusedkern_head(fn, loss_type, **kw):
        def run(_):
            _, xs, ys = rows()
            logps, entropy, row_max, row_lse = fn(xs, w, ys, return_entropy=True, **kw)
            metrics = (entropy.detach().sum(), scatter(is_top1(logps.detach(), row_max, row_lse)).sum())
            loss = sft_loss(scatter(logps), mask.sum(), loss_type)
            loss.backward()
            return metrics[0]
        return Step(run)

    def trl_head(loss_type):
        from trl.kernels import ChunkedLogProbFunction
        from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

        def run(_):
            _, xs, ys = rows()
            logps, entropy, _, _, top1 = ChunkedLogProbFunction.apply(
                xs, w, None, ys, 1.0, _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0, ("log_probs", "entropy", "is_top1"))
            metrics = (entropy.detach().sum(), scatter(top1).sum())
            sft_loss(scatter(logps), mask.sum(), loss_type).backward()
            return metrics[0]
        return Step(run)

    def ce_sum(_):
        _, xs, ys = rows()
        loss = linear_cross_entropy(xs, w, ys, reduction="sum") / mask.sum().clamp(min=1)
        loss.backward()
        return loss.detach()

    grad_logits = torch.randn(int(mask.sum()), w.shape[0], device=x.device, dtype=x.dtype)  # the floor's G

    def floor(_):
        with torch.no_grad():
            _, xs, _ = rows()
            xs @ w.detach().t()
            grad_logits @ w.detach()
            grad_logits.t() @ xs

    steps = {
        "fusedkern_anticipated_nll": fusedkern_head(linear_logprobs_anticipated, "nll", anticipate="nll"),
        "fusedkern_anticipated_dft": fusedkern_head(linear_logprobs_anticipated, "dft", anticipate="dft"),
        "fusedkern_anticipated_mismatch": fusedkern_head(linear_logprobs_anticipated, "nll", anticipate="dft"),
        "fusedkern_per_token_nll": fusedkern_head(linear_logprobs_with_stats, "nll"),
        "fusedkern_ce_sum": Step(ce_sum),
        "cublas_3gemm_scored": Step(floor),
    }
    try:
        steps["trl_head_nll"] = trl_head("nll")
        steps["trl_head_dft"] = trl_head("dft")
    except ImportError as error:
        print(f"TRL's head skipped: {error}", file=sys.stderr)
    return steps


def peak_extra_mib(step: Step, inp: Inputs) -> float:
    """Peak allocation of one rep above what was allocated before it (CUDA only; NaN elsewhere)."""
    if inp.x.device.type != "cuda":
        return float("nan")
    inp.clear_grads()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step.run(step.setup())
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    inp.clear_grads()
    return peak / 2**20


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--csv", required=True)
    parser.add_argument("--tiny", action="store_true", help="a CPU smoke run at tiny shapes")
    parser.add_argument("--heads", nargs="*", default=list(HEADS))
    parser.add_argument("--tokens", nargs="*", type=int, default=list(TOKENS))
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    args = parser.parse_args(argv)
    if args.tiny:
        device, dtype, seq, points = "cpu", torch.float32, 8, [("tiny", 83, 16, 24)]
    else:
        if not torch.cuda.is_available():
            sys.exit("probe_sft_head.py times on a CUDA GPU (--tiny: a CPU smoke run)")
        device, dtype, seq = "cuda", torch.bfloat16, SEQ
        points = [(h, *HEADS[h], t) for h in args.heads for t in args.tokens]
    rng = random.Random(0)
    with open(args.csv, "w", newline="") as f:
        out = csv.DictWriter(f, fieldnames=COLUMNS)
        out.writeheader()
        for head, vocab, hidden, tokens in points:
            for workload in WORKLOADS:
                inp = make_inputs(tokens, vocab, hidden, workload, device, dtype, seq)
                steps = steps_for(inp)
                peaks = {name: peak_extra_mib(step, inp) for name, step in steps.items()}
                timings = time_steps_interleaved(steps, inp, warmup=3, reps=args.rounds, min_reps=args.rounds,
                                                 max_case_s=1e9, rng=rng)
                floor = timings.get("cublas_3gemm_scored")
                for name, t in timings.items():
                    if isinstance(t, BaseException):
                        raise t
                    out.writerow(dict(
                        impl=name, head=head, vocab=vocab, hidden=hidden, tokens=tokens,
                        scored=int((inp.target != IGNORE_INDEX).sum()), dtype=str(dtype).removeprefix("torch."),
                        ms_p20=f"{t['ms_p20']:.4f}", ms_p50=f"{t['ms_p50']:.4f}", ms_p80=f"{t['ms_p80']:.4f}",
                        n_reps=t["n_reps"], ratio_p50_to_floor=f"{t['ms_p50'] / floor['ms_p50']:.4f}",
                        peak_extra_mib=f"{peaks[name]:.1f}", protocol="shuffled", workload=workload))
                f.flush()
                del inp, steps
                if device == "cuda":
                    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
