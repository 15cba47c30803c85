"""Timing and peak memory of one step: CUDA events per rep in stream order, p20/p50/p80 over reps,
the shuffled and fixed protocols (every provider's reps interleaved per round), and the peak
allocation above the inputs and the gradients' own storage.

Protocols: `shuffled` runs one rep of every provider per round in a new random order each round;
`fixed` interleaves the same way in a rotating fixed order; `sequential` times one provider after
the other. Run order moves cuBLAS by 5–10 % on the H200 (docs/results.md): whatever ran just
before a GEMM-heavy provider changes its clocks, and only a fresh order per round spreads that evenly.
Shuffling spreads it within a process, not between processes: the floor of one size moved 1.7–9.6 % between
the processes of one call on the H100, so a ratio is only read against the floor of its own process
(docs/design.md, "The primed protocol": queuing the same GEMMs before every rep did not steady it).
"""

from __future__ import annotations

import gc
import math
import random
import time
from collections.abc import Callable, Mapping

import numpy as np
import torch

from fusedkern.study.providers import Step
from fusedkern.study.workloads import Inputs

MIB = 2**20


# How the providers' reps are ordered (module docstring): shuffled is the default of the timing sweeps.
PROTOCOLS = ("shuffled", "fixed", "sequential")


DEFAULT_PROTOCOL = "shuffled"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def settle_gpu(device: torch.device, seconds: float = 3.0) -> None:
    """Run bf16 GEMMs for `seconds` before the first timed case, so that it cannot get the clock boost
    of an idle GPU that later cases (after seconds of sustained load) no longer have. A precaution: the
    floor is timed first at each size, and the H200 gave it 8.35 ms in one call and 9.45 ms in another
    at 2048 tokens; the effect of this warm-up alone was not isolated."""
    if device.type != "cuda":
        return
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize(device)
    del a


def free_memory(device: torch.device) -> None:
    """Between providers: return everything the last one left to the driver.

    GPU only: a full gc pass costs ~0.5 s with torch and the competitors imported, and on CPU
    there is no memory measurement for garbage to disturb.
    """
    if device.type == "cuda":
        gc.collect()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def warm_up(step: Step, inputs: Inputs, *, warmup: int, reps: int, min_reps: int, max_case_s: float) -> int:
    """Untimed reps (at least one: it compiles and autotunes); returns the rep count that fits
    `max_case_s` of wall time (setup included, judged from the last warm-up rep), in [min_reps, reps]."""
    wall_s_per_rep = 0.0
    for _ in range(max(warmup, 1)):
        inputs.clear_grads()
        start = time.perf_counter()
        step.run(step.setup())
        _sync(inputs.x.device)
        wall_s_per_rep = time.perf_counter() - start
    return int(min(reps, max(min_reps, max_case_s // max(wall_s_per_rep, 1e-9))))


class _RepTimer:
    """Times single reps of steps: CUDA events in stream order on a GPU (read after one sync at the
    end, so reps run back to back as in training), `time.perf_counter` on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pending: list = []  # (key, begin event, end event) on CUDA
        self.times_ms: dict = {}

    def run(self, key, step: Step, inputs: Inputs) -> None:
        inputs.clear_grads()
        state = step.setup()
        if self.cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            step.run(state)
            end.record()
            self.pending.append((key, begin, end))
        else:
            start = time.perf_counter()
            step.run(state)
            self.times_ms.setdefault(key, []).append((time.perf_counter() - start) * 1e3)
        del state  # the backward mode's graph is already freed; drop the reference too

    def results(self, device: torch.device) -> dict:
        """{key: {"ms_p20", "ms_p50", "ms_p80", "n_reps"}}."""
        if self.pending:
            torch.cuda.synchronize(device)
            for key, begin, end in self.pending:
                self.times_ms.setdefault(key, []).append(begin.elapsed_time(end))
            self.pending = []
        out = {}
        for key, times in self.times_ms.items():
            p20, p50, p80 = np.quantile(np.asarray(times), [0.2, 0.5, 0.8])
            out[key] = {"ms_p20": float(p20), "ms_p50": float(p50), "ms_p80": float(p80), "n_reps": len(times)}
        return out


def time_step(
    step: Step,
    inputs: Inputs,
    *,
    warmup: int = 2,
    reps: int = 20,
    min_reps: int = 5,
    max_case_s: float = 1.5,
) -> dict[str, float | int]:
    """Time `step.run` per rep; returns ms_p20, ms_p50, ms_p80 and n_reps.

    Gradients are set to None and `step.setup()` runs before each rep, untimed. On CUDA each rep
    is bracketed by its own pair of events (GPU time in stream order, CPU launch gaps included, as
    do_bench measures); on CPU by `time.perf_counter`. The rep count adapts to the cost: as many
    as fit in `max_case_s` of wall time (setup included, judged from the last warm-up rep), between
    `min_reps` and `reps`, so the 600 ms cases do not starve the budget of the 5 ms ones.
    """
    n_reps = warm_up(step, inputs, warmup=warmup, reps=reps, min_reps=min_reps, max_case_s=max_case_s)
    timer = _RepTimer(inputs.x.device)
    for _ in range(n_reps):
        timer.run(0, step, inputs)
    result = timer.results(inputs.x.device)[0]
    inputs.clear_grads()
    return result


def time_steps_interleaved(
    steps: Mapping[str, Step],
    inputs: Inputs,
    *,
    warmup: int = 2,
    reps: int = 20,
    min_reps: int = 5,
    max_case_s: float = 1.5,
    rng: random.Random | None = None,
    order_log: list[list[str]] | None = None,
    on_warmed: Callable[[str, float], None] | None = None,
) -> dict[str, dict[str, float | int] | BaseException]:
    """`time_step` for several steps on the same inputs, their reps interleaved: round r runs one
    rep of every step that still needs one (each step gets the rep count its own warm-up sets, as in
    `time_step`). A GPU's clock drifts with its power and temperature over seconds of sustained load
    (on the H200 the three-GEMM floor timed 18.85 ms before and 19.77 ms after the fusedkern steps of
    `probe_host.jsonl`); timed one after the other, providers see different conditions. Interleaved,
    every step sees the same drift.

    Order within a round: rng None (the `fixed` protocol): the steps in their given order, rotated to
    start from step r mod n. With an rng (the `shuffled` protocol): a fresh random permutation every
    round, drawn from `rng`, so no step always follows the same one (on the H200 a cuBLAS GEMM after
    another GEMM-heavy step ran 5–10 % slower than after a light Triton kernel).
    `order_log`, when given, receives each round's order (the steps that ran in it). `on_warmed(name, seconds)`
    is told each step's warm-up wall time as it ends (compilation and autotuning: where a cut-short GPU run went).

    Returns {name: timing dict as `time_step`'s}, or {name: the exception} for a step that failed
    in its warm-up (the others still run)."""
    counts: dict[str, int] = {}
    failures: dict[str, BaseException] = {}
    for name, step in steps.items():
        started = time.perf_counter()
        try:
            counts[name] = warm_up(step, inputs, warmup=warmup, reps=reps, min_reps=min_reps, max_case_s=max_case_s)
        except Exception as error:  # noqa: BLE001 - reported per step by the caller
            failures[name] = error
            inputs.clear_grads()
        if on_warmed is not None:
            on_warmed(name, time.perf_counter() - started)
    names = list(counts)
    timer = _RepTimer(inputs.x.device)
    for r in range(max(counts.values(), default=0)):
        order = rng.sample(names, len(names)) if rng is not None else names[r % len(names):] + names[:r % len(names)]
        order = [name for name in order if r < counts[name]]
        if order_log is not None:
            order_log.append(order)
        for name in order:
            timer.run(name, steps[name], inputs)
    inputs.clear_grads()
    return {**timer.results(inputs.x.device), **failures}


def measure_step(step: Step, inputs: Inputs, mode: str) -> tuple[float, float]:
    """Run `step` once; returns (loss, peak_extra_mib).

    peak_extra_mib = peak allocation during the run − allocation before it (the inputs and
    whatever the builder made, such as the floor's pre-made G) − in backward/full modes the bytes
    of the gradients' own storage (`Inputs.grad_bytes`), which any implementation must allocate.
    In `backward` mode the peak window opens after the untimed forward, so what the forward saved
    for backward counts, the forward's own transient peak does not. NaN on CPU (no allocator
    statistics). The gradients are left in place for the caller (the accuracy sweep reads them).
    """
    device = inputs.x.device
    inputs.clear_grads()
    # No gc pass here: garbage alive before the run stays alive through it and cancels out.
    if device.type != "cuda":
        loss = step.run(step.setup())
        return (math.nan if loss is None else float(loss)), math.nan

    before = torch.cuda.memory_allocated(device)
    state = step.setup()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    loss = step.run(state)
    del state
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    grads = inputs.grad_bytes() if mode in ("backward", "full") else 0
    return (math.nan if loss is None else float(loss)), (peak - before - grads) / MIB
