"""One process times the same losses on two trees of fusedkern, the current one and an earlier one, with their GEMM
floors, in the study's shuffled protocol (`fusedkern.study.timing`): what a refactor did to speed, with every ratio
formed inside one process. The earlier tree is a copy of its `fusedkern/` renamed `fusedkern_base`
(`scripts/baseline_tree.sh REV DIR` writes it) so that both import side by side.

Workloads (hidden 4096, vocab 128256, bf16, forward + backward; x ~ N(0, 1), W ~ N(0, σ²) with σ = 2/√H as the
study's inputs, or σ = 0.02 with --weight-std 0.02): dense cross-entropy, half the targets ignored with the count on
the host, per-token log-probs at τ 0.7 with the entropy (upstream Σ logp + 0.01·Σ H: four GEMMs), SimPO and DPO at
B 4 × S 1024, GRPO (dapo) at 8 × 1024, distillation (generalized JSD β 0.5, student and teacher heads alike).
Floors: three GEMMs (logits, dX, dW over every row, or over the valid rows), four for the per-token pass and for
distillation (the teacher's logits GEMM). Prints and writes a CSV: one row per (workload, impl) with ms p20/p50/p80
and the ratio to the floor's p50, `protocol` and `workload` columns.

    python probes/probe_before_after.py --baseline .baseline --out before_after.csv [--tokens 8192 16384]
"""
from __future__ import annotations

import argparse
import csv
import importlib
import math
import random
import sys

import torch

H, V = 4096, 128256
ROUNDS = 15


def floor_step(x, w, buffer, rows: int, gemms: int):
    """The GEMMs an implementation cannot avoid: logits [rows, V] (+ the teacher's, or the per-token pass's
    recomputation, for `gemms` = 4), dX and dW, in bf16 with fp32 accumulation. buffer: [≥ rows, V], shared."""
    xs = x[:rows].detach()
    wd = w.detach()
    g = buffer[:rows]

    def run(_):
        torch.mm(xs, wd.t(), out=g)
        if gemms == 4:
            torch.mm(xs, wd.t(), out=g)
        torch.mm(g, wd)
        torch.ops.aten.mm.dtype(g.t(), xs, torch.float32)
        return None

    return run


def full_step(loss_fn, leaves):
    def run(_):
        for t in leaves:
            t.grad = None
        loss = loss_fn()
        loss.backward()
        return loss.detach()

    return run


def workloads(fk, tokens: int, weight_std: float, device):
    """{workload: (floor step, {impl: step}) for impl in 'new', 'base'} built on fresh inputs."""
    gen = torch.Generator(device=device).manual_seed(tokens)

    def randn(*shape, std=1.0):
        return (torch.randn(shape, generator=gen, device=device) * std).to(torch.bfloat16)

    x = randn(tokens, H).requires_grad_()
    w = randn(V, H, std=weight_std).requires_grad_()
    y = torch.randint(0, V, (tokens,), generator=gen, device=device)
    half = y.clone()
    half[torch.rand(tokens, generator=gen, device=device) < 0.5] = -100
    n_valid = int((half != -100).sum())
    B, S = 4, 1024
    pref_x = x[: 2 * B * S].detach().view(2 * B, S, H).requires_grad_()
    pref_y = y[: 2 * B * S].view(2 * B, S).clone()
    pref_y[:, : S // 2] = -100  # prompts
    refs = torch.randn(2, B, generator=gen, device=device) * 10 - 300
    grpo_x = x[: 8 * S].detach().view(8, S, H).requires_grad_()
    grpo_y = pref_y  # [8, S]: 2B = 8 completions, half of each a prompt
    adv = torch.randn(8, generator=gen, device=device)
    old = -torch.rand(8, S, generator=gen, device=device) * 5
    xt = randn(tokens, H)
    wt = randn(V, H, std=weight_std)
    out = {}
    for name, mod in fk.items():
        def ce(mod=mod):
            return mod.linear_cross_entropy(x, w, y)

        def masked(mod=mod):
            return mod.linear_cross_entropy(x, w, half, num_valid_tokens=n_valid)

        def logprobs(mod=mod):
            logps, entropy = mod.linear_logprobs(x, w, y, temperature=0.7, return_entropy=True)
            return logps.sum() / tokens + 0.01 * entropy.sum() / tokens

        def simpo(mod=mod):
            return mod.linear_simpo_loss(pref_x, w, pref_y, beta=2.0, gamma=1.0)[0]

        def dpo(mod=mod):
            return mod.linear_preference_loss(pref_x, w, pref_y, loss_type="sigmoid", ref_chosen_logps=refs[0],
                                              ref_rejected_logps=refs[1])[0]

        def grpo(mod=mod):
            return mod.linear_grpo_loss(grpo_x, w, grpo_y, advantages=adv, old_logps=old)[0]

        def distill(mod=mod):
            return mod.linear_distillation_loss(x, w, xt, wt, y, beta=0.5)

        for workload, fn, leaves in (("ce_dense", ce, (x, w)), ("ce_masked_50_host_count", masked, (x, w)),
                                     ("logprobs_tau0.7_entropy_grad", logprobs, (x, w)),
                                     ("simpo_b4", simpo, (pref_x, w)), ("dpo_sigmoid_b4", dpo, (pref_x, w)),
                                     ("grpo_dapo_8x1024", grpo, (grpo_x, w)), ("distill_jsd0.5", distill, (x, w))):
            out.setdefault(workload, {})[name] = full_step(fn, leaves)
    buffer = torch.empty(tokens, V, device=device, dtype=torch.bfloat16)
    floors = {"ce_dense": floor_step(x, w, buffer, tokens, 3),
              "ce_masked_50_host_count": floor_step(x, w, buffer, n_valid, 3),
              "logprobs_tau0.7_entropy_grad": floor_step(x, w, buffer, tokens, 4),
              "simpo_b4": floor_step(x, w, buffer, 2 * B * S, 3),
              "dpo_sigmoid_b4": floor_step(x, w, buffer, 2 * B * S, 3),
              "grpo_dapo_8x1024": floor_step(x, w, buffer, 8 * S, 3),
              "distill_jsd0.5": floor_step(x, w, buffer, tokens, 4)}
    return {k: (floors[k], v) for k, v in out.items()}, x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="folder holding the earlier tree as fusedkern_base/")
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192])
    parser.add_argument("--weight-std", type=float, default=None, help="default 2/sqrt(H), the study's")
    args = parser.parse_args()
    sys.path.insert(0, args.baseline)
    from fusedkern.study.providers import Step
    from fusedkern.study.timing import time_steps_interleaved
    from fusedkern.study.workloads import Inputs

    fk = {"new": importlib.import_module("fusedkern"), "base": importlib.import_module("fusedkern_base")}
    std = args.weight_std or 2.0 / math.sqrt(H)
    device = torch.device("cuda")
    rows = []
    for tokens in args.tokens:
        cases, x = workloads(fk, tokens, std, device)
        for workload, (floor, impls) in cases.items():
            steps = {"floor": Step(run=floor), **{name: Step(run=run) for name, run in impls.items()}}
            dummy = Inputs(op="ce", x=x, w=x, target=torch.zeros(1, dtype=torch.long, device=device))
            timings = time_steps_interleaved(steps, dummy, warmup=2, reps=ROUNDS, min_reps=ROUNDS, max_case_s=1e9,
                                             rng=random.Random(tokens))
            base_ms = timings["floor"]["ms_p50"] if isinstance(timings["floor"], dict) else float("nan")
            for impl, t in timings.items():
                if isinstance(t, BaseException):
                    row = dict(workload=workload, tokens=tokens, impl=impl, note=repr(t)[:200])
                else:
                    row = dict(workload=workload, tokens=tokens, impl=impl, ms_p20=round(t["ms_p20"], 4),
                               ms_p50=round(t["ms_p50"], 4), ms_p80=round(t["ms_p80"], 4),
                               x_floor_p50=round(t["ms_p50"] / base_ms, 4), note="")
                row.update(protocol="shuffled", weight_std=round(std, 5))
                rows.append(row)
                print(row, flush=True)
            with open(args.out, "w", newline="") as f:  # rewritten after each workload: a cut call keeps them
                fields = ["workload", "tokens", "impl", "ms_p20", "ms_p50", "ms_p80", "x_floor_p50", "protocol",
                          "weight_std", "note"]
                writer = csv.DictWriter(f, fieldnames=fields)
                writer.writeheader()
                writer.writerows(rows)


if __name__ == "__main__":
    main()
