"""Measure the LM head + loss: every provider in one process, on the same inputs, same protocol.

    python -m fusedkern.bench ce --tokens 4096 8192 16384 32768 --workload dense masked_50
    python -m fusedkern.bench simpo --batch 2 4 8 16 --seq 1024 --head gemma2
    python -m fusedkern.bench accuracy --tokens 4096 32768

Why a harness of our own rather than the seed's (Liger-Kernel's scripts, `triton.testing.do_bench`):
the seed timed "forward" for providers that do very different work in it (Liger forms dX and dW
inside its forward), and it reported peak memory with the weights included. Here every provider is
timed in four modes — `loss_only` (no autograd), `forward` (autograd on, the seed's "forward"),
`backward` (forward untimed, `loss.backward()` timed) and `full` (both) — and memory is the peak
*above* the inputs and the gradients' own storage, so the numbers compare equal work.
The GEMM floors (`cublas_3gemm`, `cublas_1gemm`) run in the same process, so a ratio to them is
a ratio measured on the same GPU, clocks and library versions.

Protocol (`--protocol`, a `protocol` column in every row): `shuffled` (the default) runs, per size
and mode, one rep of every provider per round in a new random order each round (seeded by --seed,
so a run is reproducible); `fixed` interleaves the same way in a rotating fixed order (the former
`--interleave`, kept as a deprecated alias); `sequential` times one provider after the other. Run
order moves cuBLAS by 5–10 % on the H200 (reference README §6): whatever ran just before a GEMM-heavy
provider changes its clocks, and only a fresh order per round spreads that evenly.

Workloads (`--workload`, a `workload` column): `dense` (every target counts, the default) or
`masked_N`: N % of the targets are ignore_index, as contiguous prompt spans at the start of each
sequence as in SFT (ce: the tokens are cut into sequences of --seq tokens; simpo: every chosen and
rejected row). The GEMM floors stay the dense all-token floors whatever the workload (see
`FLOORS_NOTE`, written to the sidecar JSON). `prompt_random` is the SimPO workload of every run
before workloads existed (a prompt of random length in [S/8, S/2) per row). Heads (`--head`, a `head`
column): the vocabulary, hidden size and final-logit softcap of Llama 3, Qwen2.5-7B and Gemma 2.

Outputs: by default `<repository>/data/measured/<gpu>/<sweep>.csv` (anchored at the checkout this
module lives in, never the working directory); a CPU run, or a module outside a checkout, must name
--out. A run may write into a `data/measured/<device>/` folder only when <device> is the device it
runs on, and never replaces an existing file, unless --append (merge) or --overwrite is given.

Pieces: `PROVIDERS` (op -> name -> `Provider`, whose `build(inputs)` returns a `Step` per mode),
`time_step` (CUDA events per rep, p20/p50/p80), `time_steps_interleaved` (the shuffled and fixed
protocols), `measure_step` (one run: loss and peak extra memory), `run_sweep` / `run_accuracy` (rows
in the schema of `fusedkern.results`), `main` (CLI).
Competitors and fusedkern itself are imported inside the builders, so a provider whose package is
missing or unfinished is skipped (and logged) instead of breaking the module. On CPU the same code
runs at tiny shapes for the tests: wall-clock timing, NaN memory.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import inspect
import math
import os
import random
import re
import shlex
import sys
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from fusedkern.results import MODES, write_results

__all__ = [
    "MODES",
    "PROTOCOLS",
    "WORKLOADS",
    "HEADS",
    "FLOORS_NOTE",
    "Head",
    "Inputs",
    "Step",
    "Provider",
    "PROVIDERS",
    "ProviderUnavailable",
    "make_ce_inputs",
    "make_simpo_inputs",
    "ignored_fraction",
    "prompt_prefix_mask",
    "head_name",
    "time_step",
    "time_steps_interleaved",
    "measure_step",
    "run_sweep",
    "run_accuracy",
    "fp64_linear_cross_entropy_grads_chunked",
    "format_table",
    "main",
]

MIB = 2**20
IGNORE_INDEX = -100
# W ~ N(0, LOGIT_STD²/H) with x ~ N(0, 1) gives logits ~ N(0, LOGIT_STD²): with 2.0 the largest of
# 128256 logits is ≈ 2·sqrt(2·ln V) ≈ 10, the O(1–10) range of a trained LM head. (The seed's
# `nn.Linear` default init gives std ≈ 0.58, an untrained head on which bf16 rounding hides.)
LOGIT_STD = 2.0
# Floors: the GEMMs a provider cannot avoid in that mode (docs/design.md, reference README §3).
FLOOR_OF_MODE = {
    "loss_only": "cublas_1gemm",
    "forward": "cublas_1gemm",
    "backward": "cublas_3gemm",
    "full": "cublas_3gemm",
}
FLOORS_NOTE = (
    "cublas_1gemm and cublas_3gemm are the dense all-token floors whatever the workload: the logits GEMM "
    "and the three GEMMs over every one of the T tokens, with an N(0, 1) logits gradient G, the floor the "
    "project's targets compare against (a provider that skips ignored tokens may go below it). "
    "cublas_3gemm_real_grad does the same all-token GEMMs with the workload's true dL/dz as G (zero rows "
    "on ignored tokens, softcap's chain rule included)."
)

# How the providers' reps are ordered (module docstring): shuffled is the default of the timing sweeps.
PROTOCOLS = ("shuffled", "fixed", "sequential")
DEFAULT_PROTOCOL = "shuffled"
# The named workloads; `masked_N` takes any integer 0 ≤ N < 100. "prompt_random" (SimPO only) is the
# pre-workload SimPO input: a prompt of random length in [S/8, S/2) per row.
WORKLOADS = ("dense", "masked_30", "masked_50", "masked_70")
SIMPO_LEGACY_WORKLOAD = "prompt_random"
DEFAULT_SEQ = 1024


@dataclass(frozen=True)
class Head:
    """An LM head users train: vocabulary V, hidden size H, final-logit softcap c (None: none)."""

    vocab: int
    hidden: int
    softcap: float | None = None


# Reference README §6: the heads users train. The default sweep (V 128256, H 4096) is Llama 3's.
HEADS = {
    "llama3": Head(vocab=128256, hidden=4096),
    "qwen25_7b": Head(vocab=151936, hidden=3584),
    "gemma2": Head(vocab=256000, hidden=2304, softcap=30.0),
}
DEFAULT_HEAD = "llama3"


def head_name(vocab: int, hidden: int, softcap: float | None) -> str:
    """The `head` column: the name of the preset with exactly these dimensions and softcap, else "custom"."""
    for name, head in HEADS.items():
        if (head.vocab, head.hidden, head.softcap) == (vocab, hidden, softcap):
            return name
    return "custom"


def _say(message: str) -> None:
    """One log line on stderr that does not break a tqdm bar."""
    from tqdm import tqdm

    tqdm.write(message, file=sys.stderr)


# ----------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------


@dataclass
class Inputs:
    """One workload, shared by every provider of a sweep point (the gradients are cleared between)."""

    op: str  # "ce" or "simpo"
    x: torch.Tensor  # [T, H] (ce) or [2B, S, H] (simpo), leaf, requires grad
    w: torch.Tensor  # [V, H], leaf, requires grad
    target: torch.Tensor  # [T] or [2B, S] int64, IGNORE_INDEX where masked
    softcap: float | None = None  # final-logit softcap c (s = c·tanh(z/c)) every provider must apply

    @property
    def params(self) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.x, self.w)

    def x2d(self) -> torch.Tensor:
        return self.x.detach().reshape(-1, self.x.shape[-1])  # [T, H], a view

    def clear_grads(self) -> None:
        for p in self.params:
            p.grad = None

    def grad_bytes(self) -> int:
        """Bytes of the gradients' own storage (one tensor like each input that requires grad)."""
        return sum(p.numel() * p.element_size() for p in self.params if p.requires_grad)


def _randn(shape: tuple[int, ...], std: float, dtype: torch.dtype, device: torch.device, gen: torch.Generator):
    # Drawn in fp32 and rounded once, so bf16 and fp32 runs of one seed see the same values.
    return (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * std).to(dtype)


def _generator(device: torch.device, seed: int) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def ignored_fraction(workload: str) -> float:
    """The share of targets a workload ignores: "dense" 0, "masked_N" N/100 (0 ≤ N < 100).
    Raises ValueError for anything else ("prompt_random" is SimPO's, see `make_simpo_inputs`)."""
    if workload == "dense":
        return 0.0
    match = re.fullmatch(r"masked_(\d{1,2})", workload)
    if match is None:
        raise ValueError(f"unknown workload {workload!r}: use dense or masked_N with 0 <= N < 100 "
                         f"(e.g. {', '.join(WORKLOADS)})")
    return int(match.group(1)) / 100


def _masked_percent(workload: str) -> int:
    return round(ignored_fraction(workload) * 100)


def prompt_prefix_mask(tokens: int, seq: int, workload: str, device=None) -> torch.Tensor:
    """[tokens] bool, True where a target is ignored: the tokens are cut into sequences of `seq`
    (the last one may be shorter) and the first ⌊N·len/100⌋ tokens of each sequence, its prompt, are
    ignored, as in SFT. "dense": none. A sequence never loses all its tokens (N < 100)."""
    if seq < 1:
        raise ValueError(f"seq must be ≥ 1, got {seq}")
    percent = _masked_percent(workload)
    positions = torch.arange(tokens, device=device)  # [T]
    starts = positions // seq * seq  # [T], first token of each one's sequence
    lengths = (tokens - starts).clamp(max=seq)  # [T], that sequence's length
    return positions - starts < lengths * percent // 100


def make_ce_inputs(tokens: int, hidden: int, vocab: int, *, dtype: torch.dtype, device, seed: int = 0,
                   workload: str = "dense", seq: int = DEFAULT_SEQ, softcap: float | None = None) -> Inputs:
    """x [T, H] ~ N(0, 1), W [V, H] ~ N(0, LOGIT_STD²/H), uniform targets [T].

    workload "dense" ignores none (as in the seed); "masked_N" treats the T tokens as sequences of
    `seq` tokens and ignores the first N % of each (`prompt_prefix_mask`). x, W and the kept targets
    are the same for every workload of one seed."""
    device = torch.device(device)
    ignored_fraction(workload)  # validates
    gen = _generator(device, seed)
    x = _randn((tokens, hidden), 1.0, dtype, device, gen).requires_grad_()
    w = _randn((vocab, hidden), LOGIT_STD / math.sqrt(hidden), dtype, device, gen).requires_grad_()
    target = torch.randint(vocab, (tokens,), generator=gen, device=device)
    target = target.masked_fill(prompt_prefix_mask(tokens, seq, workload, device), IGNORE_INDEX)
    return Inputs("ce", x, w, target, softcap=softcap)


def make_simpo_inputs(
    batch: int, seq: int, hidden: int, vocab: int, *, dtype: torch.dtype, device, seed: int = 0,
    workload: str = SIMPO_LEGACY_WORKLOAD, softcap: float | None = None,
) -> Inputs:
    """x [batch, S, H], targets [batch, S]: rows 0..batch/2−1 chosen, the rest rejected.

    `batch` counts rows (chosen + rejected), as the seed's x-axis did: batch 2 is one pair.
    workload "prompt_random" (this function's default, what every SimPO run before workloads
    measured): each row starts with a prompt of random length in [S/8, S/2) marked IGNORE_INDEX, so
    the length normalization of SimPO sees responses of different lengths. "dense" (the sweep's
    default): no target ignored. "masked_N": the first ⌊N·S/100⌋ targets of every row ignored.
    """
    if batch % 2:
        raise ValueError(f"batch counts chosen + rejected rows and must be even, got {batch}")
    if workload != SIMPO_LEGACY_WORKLOAD:
        ignored_fraction(workload)  # validates
    device = torch.device(device)
    gen = _generator(device, seed)
    x = _randn((batch, seq, hidden), 1.0, dtype, device, gen).requires_grad_()
    w = _randn((vocab, hidden), LOGIT_STD / math.sqrt(hidden), dtype, device, gen).requires_grad_()
    target = torch.randint(vocab, (batch, seq), generator=gen, device=device)
    positions = torch.arange(seq, device=device)  # [S]
    if workload == SIMPO_LEGACY_WORKLOAD:
        low = seq // 8
        prompt_len = torch.randint(low, max(low + 1, seq // 2), (batch, 1), generator=gen, device=device)
    else:
        prompt_len = torch.full((batch, 1), seq * _masked_percent(workload) // 100, device=device)
    target = torch.where(positions < prompt_len, torch.full_like(target, IGNORE_INDEX), target)
    return Inputs("simpo", x, w, target, softcap=softcap)


# ----------------------------------------------------------------------------------------------
# Steps and providers
# ----------------------------------------------------------------------------------------------


def _no_setup() -> None:
    return None


@dataclass(frozen=True)
class Step:
    """The unit of work of one mode: `setup()` runs untimed before each rep, `run(state)` is timed.

    `run` returns the detached loss (or None for the GEMM floors); its value is recorded once.
    """

    run: Callable[[Any], torch.Tensor | None]
    setup: Callable[[], Any] = _no_setup


def _loss_steps(loss_fn: Callable[[], torch.Tensor]) -> dict[str, Step]:
    """The four modes of a provider given as a function that returns a scalar loss."""

    def loss_only(_):
        with torch.no_grad():
            return loss_fn()

    def forward(_):
        return loss_fn().detach()  # the graph is freed here, inside the timed region, as in the seed

    def backward(loss):
        loss.backward()
        return loss.detach()

    def full(_):
        loss = loss_fn()
        loss.backward()
        return loss.detach()

    return {
        "loss_only": Step(loss_only),
        "forward": Step(forward),
        "backward": Step(backward, setup=loss_fn),
        "full": Step(full),
    }


class ProviderUnavailable(RuntimeError):
    """A provider cannot run in this environment (package missing, torch too old, no GPU)."""


@dataclass(frozen=True)
class Provider:
    """A named way to compute the op; `build(inputs)` returns its steps by mode.

    `label()` is the name written to the CSV: the key, except for Liger, whose two versions share
    one file and so carry theirs ("liger-kernel 0.8.5"). Every competitor's version is also in
    the sidecar JSON.
    """

    key: str
    build: Callable[[Inputs], dict[str, Step]]
    label: Callable[[], str]
    is_floor: bool = False
    accuracy: bool = True  # whether it takes part in the accuracy sweep (floors compute no loss)


def _key_label(key: str) -> Callable[[], str]:
    return lambda: key


def _dist_label(distribution: str) -> Callable[[], str]:
    def label() -> str:
        try:
            return f"{distribution} {importlib.metadata.version(distribution)}"
        except importlib.metadata.PackageNotFoundError:
            return distribution

    return label


def _require_cuda(inputs: Inputs, what: str) -> None:
    if inputs.x.device.type != "cuda":
        raise ProviderUnavailable(f"{what} runs only on CUDA tensors")


def _softcap_kwargs(fn: Callable, inputs: Inputs, what: str) -> dict[str, float]:
    """{"softcap": c} when the workload has one and `fn` (a function or class) takes it, {} without a
    softcap; a provider that cannot apply it is unavailable (it would compute another loss)."""
    if inputs.softcap is None:
        return {}
    if "softcap" not in inspect.signature(fn).parameters:
        raise ProviderUnavailable(f"{what} takes no softcap")
    return {"softcap": inputs.softcap}


def _no_softcap(inputs: Inputs, what: str) -> None:
    if inputs.softcap is not None:
        raise ProviderUnavailable(f"{what} has no logit softcap")


def _softcapped(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """c·tanh(z/c) in the logits' dtype, the three ops Hugging Face's Gemma 2 applies; z when c is None."""
    return logits if softcap is None else torch.tanh(logits / softcap) * softcap


# Cross-entropy providers -----------------------------------------------------------------------


def _ce_hf_bf16(inp: Inputs) -> dict[str, Step]:
    from fusedkern.reference import hf_linear_cross_entropy

    if inp.softcap is None:
        return _loss_steps(lambda: hf_linear_cross_entropy(inp.x, inp.w, inp.target))

    def softcapped() -> torch.Tensor:
        # As Hugging Face's Gemma 2 head: softcap on the logits in their dtype, then the same
        # cross-entropy as the seed's baseline (no fp32 upcast).
        logits = _softcapped(torch.nn.functional.linear(inp.x, inp.w), inp.softcap)  # [T, V]
        return torch.nn.functional.cross_entropy(logits, inp.target, ignore_index=IGNORE_INDEX)

    return _loss_steps(softcapped)


def _ce_upcast(inp: Inputs) -> dict[str, Step]:
    from fusedkern.reference import upcast_linear_cross_entropy

    return _loss_steps(lambda: upcast_linear_cross_entropy(inp.x, inp.w, inp.target, softcap=inp.softcap))


def _ce_fusedkern(counted: str | None = None, **options) -> Callable[[Inputs], dict[str, Step]]:
    """counted: pass `num_valid_tokens` so that only the valid rows are computed — "host": an int counted
    once per case outside the timed steps, as a trainer's data collator counts it on the CPU copy of the
    labels; "device": `(target != ignore_index).sum()` on the device, inside the timed step."""
    def build(inp: Inputs) -> dict[str, Step]:
        from fusedkern import linear_cross_entropy

        kwargs = {**options, **_softcap_kwargs(linear_cross_entropy, inp, "fusedkern.linear_cross_entropy")}
        if counted == "host":
            kwargs["num_valid_tokens"] = int((inp.target != IGNORE_INDEX).sum())
        if counted == "device":
            return _loss_steps(lambda: linear_cross_entropy(
                inp.x, inp.w, inp.target, num_valid_tokens=(inp.target != IGNORE_INDEX).sum(), **kwargs))
        return _loss_steps(lambda: linear_cross_entropy(inp.x, inp.w, inp.target, **kwargs))

    return build


def _ce_liger(inp: Inputs) -> dict[str, Step]:
    _require_cuda(inp, "Liger-Kernel")
    try:  # the public module, what users call
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    except (ImportError, AttributeError):
        # 0.4.2's `liger_kernel.transformers` package imports Hugging Face model code that newer
        # transformers removed. Its module is a thin wrapper over this Function, with these defaults.
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

        _no_softcap(inp, "Liger-Kernel's bare Function (positional arguments differ between versions)")
        return _loss_steps(lambda: LigerFusedLinearCrossEntropyFunction.apply(inp.x, inp.w, inp.target))

    # mean over non-ignored tokens, ignore -100
    loss_module = LigerFusedLinearCrossEntropyLoss(
        **_softcap_kwargs(LigerFusedLinearCrossEntropyLoss, inp, "LigerFusedLinearCrossEntropyLoss"))
    return _loss_steps(lambda: loss_module(inp.w, inp.x, inp.target))


def _ce_cut_cross_entropy(inp: Inputs) -> dict[str, Step]:
    _require_cuda(inp, "cut-cross-entropy")
    from cut_cross_entropy import linear_cross_entropy

    # Default filter_eps ("high"): the setting a user gets, and the one its README benchmarks.
    kwargs = _softcap_kwargs(linear_cross_entropy, inp, "cut_cross_entropy.linear_cross_entropy")
    return _loss_steps(lambda: linear_cross_entropy(inp.x, inp.w, inp.target, **kwargs))


def _ce_torch_linear_cross_entropy(chunked: bool) -> Callable[[Inputs], dict[str, Step]]:
    """torch ≥ 2.13's `F.linear_cross_entropy`. chunked: with `options=LinearCrossEntropyOptions()`,
    its chunked path that never forms the [T, V] logits (gradients formed in forward, like Liger);
    without options (the `_unfused` provider) it runs its reference path: linear, then cross_entropy."""

    def build(inp: Inputs) -> dict[str, Step]:
        import torch.nn.functional as F

        if not hasattr(F, "linear_cross_entropy"):
            raise ProviderUnavailable(f"torch {torch.__version__} has no F.linear_cross_entropy")
        _no_softcap(inp, "F.linear_cross_entropy")
        # Its ignore_index defaults to None (no masking); pass -100 like every other provider.
        kwargs: dict[str, Any] = {"ignore_index": IGNORE_INDEX}
        if chunked:
            options = getattr(torch.nn, "LinearCrossEntropyOptions", None)
            if options is None:
                raise ProviderUnavailable(
                    f"torch {torch.__version__} has no torch.nn.LinearCrossEntropyOptions: F.linear_cross_entropy "
                    "would run its unfused reference path (provider torch_linear_cross_entropy_unfused)")
            # Defaults: acc_policy and chunking_method "auto", resolved per device and dtype at call time.
            # The chunked path needs mean/sum/none, no label smoothing and int64 targets (ours), else it
            # falls back to the reference path with a warning.
            kwargs["options"] = options()
        return _loss_steps(lambda: F.linear_cross_entropy(inp.x, inp.w, inp.target, **kwargs))

    return build


def _ce_quack(inp: Inputs) -> dict[str, Step]:
    """QuACK (`quack-kernels`, Dao-AILab; the 0.6 API): `chunked_linear_cross_entropy` at its defaults
    (chunks of 4096 tokens, tuned GEMMs), the call its `LinearCrossEntropy` module makes when given a
    chunk size. Like Liger it forms dX and dW inside its forward (whatever the grad mode)."""
    _require_cuda(inp, "QuACK")
    _no_softcap(inp, "QuACK's chunked_linear_cross_entropy")
    tokens, hidden = inp.x.shape
    if tokens % 8 or hidden % 8 or inp.w.shape[0] % 8:
        raise ProviderUnavailable("QuACK's chunked path needs tokens, hidden and vocab multiples of 8 (TMA)")
    try:
        from quack.linear_cross_entropy import chunked_linear_cross_entropy
    except ImportError as error:
        if error.name == "quack":
            raise  # not installed: skipped, like the other optional providers
        # Its CUTLASS DSL installed with `pip --target` is found only through a .pth file that
        # PYTHONPATH does not run (reference README §6).
        raise ProviderUnavailable(f"quack failed to import ({error}); with pip --target, put "
                                  "<target>/nvidia_cutlass_dsl/dsl_packages on PYTHONPATH too") from error
    except Exception as error:  # noqa: BLE001 - the CuTe DSL fails in many ways where it cannot run
        raise ProviderUnavailable(f"quack failed to import: {type(error).__name__}: {error}") from error

    return _loss_steps(lambda: chunked_linear_cross_entropy(inp.x, inp.w, inp.target, ignore_index=IGNORE_INDEX))


def _three_gemm_steps(x2d: torch.Tensor, w: torch.Tensor, grad_logits: torch.Tensor) -> dict[str, Step]:
    """The floor's steps given a pre-made logits gradient G [T, V]."""
    from fusedkern.reference import cublas_3gemm

    def full(_):
        with torch.no_grad():
            cublas_3gemm(x2d, w, grad_logits)

    def backward(_):
        # The backward floor when G is formed in forward: dX = G W and dW = Gᵀ x only.
        with torch.no_grad():
            grad_logits @ w
            grad_logits.T @ x2d

    return {"backward": Step(backward), "full": Step(full)}


def _cublas_3gemm(inp: Inputs) -> dict[str, Step]:
    x2d, w = inp.x2d(), inp.w.detach()
    # A pre-made logits gradient G of N(0, 1) values (the reference floor's convention); the GPU's
    # GEMM time does depend on the values through power, see `_cublas_3gemm_real_grad`.
    return _three_gemm_steps(x2d, w, torch.randn(x2d.shape[0], w.shape[0], dtype=x2d.dtype, device=x2d.device))


def _logits_to_mean_ce_grad_(logits: torch.Tensor, target: torch.Tensor, valid: torch.Tensor, count: torch.Tensor,
                             lse: torch.Tensor | None = None, dsoftcap: torch.Tensor | None = None) -> torch.Tensor:
    """In place: logits [C, V] → ∂(mean cross-entropy)/∂z = (softmax − one-hot)/count on the valid rows,
    0 on ignored ones. target [C] (any value where not valid), valid [C] bool, count 0-d, lse [C] if known.
    With a softcap pass the softcapped logits s and dsoftcap = ds/dz = 1 − tanh²(z/c) [C, V]: the result
    is then (softmax(s) − one-hot)·ds/dz."""
    lse = torch.logsumexp(logits, dim=-1) if lse is None else lse
    grad = logits.sub_(lse[:, None]).exp_()  # softmax
    rows = torch.arange(logits.shape[0], device=logits.device)
    grad[rows, torch.where(valid, target, 0)] -= valid.to(grad.dtype)  # − one-hot where the token counts
    if dsoftcap is not None:
        grad.mul_(dsoftcap)
    return grad.mul_((valid.to(grad.dtype) / count)[:, None])


def _softcap_with_derivative_(logits: torch.Tensor, softcap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: z [C, V] → s = c·tanh(z/c); returns (s, ds/dz = 1 − tanh²(z/c))."""
    tanh = logits.div_(softcap).tanh_()
    derivative = 1.0 - tanh.square()
    return tanh.mul_(softcap), derivative


def _mean_ce_logits_grad(inp: Inputs, chunk_rows: int = 1024) -> torch.Tensor:
    """G = ∂(mean cross-entropy)/∂z [T, V] in the inputs' dtype for this workload, its softcap included
    (computed in fp32, chunk by chunk, untimed)."""
    x2d, w = inp.x2d(), inp.w.detach()
    target = inp.target.reshape(-1)
    valid = target != IGNORE_INDEX
    count = valid.sum().clamp(min=1).to(torch.float32)
    grad = torch.empty(x2d.shape[0], w.shape[0], dtype=x2d.dtype, device=x2d.device)
    with torch.no_grad():
        for c0 in range(0, x2d.shape[0], chunk_rows):
            c1 = min(c0 + chunk_rows, x2d.shape[0])
            logits = (x2d[c0:c1] @ w.T).float()  # [C, V]
            dsoftcap = None
            if inp.softcap is not None:
                logits, dsoftcap = _softcap_with_derivative_(logits, inp.softcap)
            grad[c0:c1] = _logits_to_mean_ce_grad_(logits, target[c0:c1], valid[c0:c1], count,
                                                   dsoftcap=dsoftcap).to(x2d.dtype)
    return grad


def _cublas_3gemm_real_grad(inp: Inputs) -> dict[str, Step]:
    """The three GEMMs of `_cublas_3gemm` with the workload's true ∂L/∂z as G (for SimPO, the mean
    cross-entropy's: the same softmax − one-hot structure, other per-row scales; ignored tokens give zero
    rows, but the GEMMs still run over all T tokens). On the H200 a GEMM's
    time depends on its operands' values (power): a profile measured the chunked path's GEMMs 5 % faster
    than the same shapes on the logits (data/measured/h200/profile_ce.csv), so this floor is expected
    to be the stricter one."""
    return _three_gemm_steps(inp.x2d(), inp.w.detach(), _mean_ce_logits_grad(inp))


def _cublas_1gemm(inp: Inputs) -> dict[str, Step]:
    from fusedkern.reference import cublas_1gemm

    x2d, w = inp.x2d(), inp.w.detach()

    def logits_only(_):
        with torch.no_grad():
            cublas_1gemm(x2d, w)

    return {"loss_only": Step(logits_only), "forward": Step(logits_only)}


# SimPO providers ------------------------------------------------------------------------------


def _hf_simpo_fp32_softcapped(x: torch.Tensor, w: torch.Tensor, target: torch.Tensor, softcap: float) -> torch.Tensor:
    """`reference.hf_linear_simpo_loss` (TRL defaults β 0.1, γ 0.5, α 1) with the softcap a Gemma 2 head
    applies to its logits before the loss: the same fp32 logits, log_softmax, gather and second
    cross-entropy pass over the chosen half."""
    import torch.nn.functional as F

    from fusedkern.reference import _simpo_from_logprobs

    n_pairs = x.shape[0] // 2
    logits = _softcapped(F.linear(x, w).float(), softcap)  # [2B, S, V] fp32
    mask = target != IGNORE_INDEX  # [2B, S]
    safe_target = torch.where(mask, target, 0)
    logps = logits.log_softmax(dim=-1).gather(-1, safe_target.unsqueeze(-1)).squeeze(-1)  # [2B, S]
    chosen_nll = F.cross_entropy(logits[:n_pairs].reshape(-1, logits.shape[-1]), target[:n_pairs].reshape(-1),
                                 ignore_index=IGNORE_INDEX, reduction="sum") / mask[:n_pairs].sum().clamp_min(1)
    return _simpo_from_logprobs(logps, mask, beta=0.1, gamma=0.5, alpha=1.0, label_smoothing=0.0,
                                chosen_nll=chosen_nll)[0]


def _simpo_hf_fp32(inp: Inputs) -> dict[str, Step]:
    from fusedkern.reference import hf_linear_simpo_loss

    if inp.softcap is not None:
        return _loss_steps(lambda: _hf_simpo_fp32_softcapped(inp.x, inp.w, inp.target, inp.softcap))
    return _loss_steps(lambda: hf_linear_simpo_loss(inp.x, inp.w, inp.target)[0])


def _simpo_fusedkern(**options) -> Callable[[Inputs], dict[str, Step]]:
    def build(inp: Inputs) -> dict[str, Step]:
        from fusedkern import linear_simpo_loss

        kwargs = {**options, **_softcap_kwargs(linear_simpo_loss, inp, "fusedkern.linear_simpo_loss")}
        return _loss_steps(lambda: linear_simpo_loss(inp.x, inp.w, inp.target, **kwargs)[0])

    return build


def _simpo_fusedkern_generic(inp: Inputs) -> dict[str, Step]:
    """SimPO through the generic log-prob primitive: logits recomputed in backward (four GEMMs)."""
    from fusedkern import linear_logprobs
    from fusedkern.simpo import simpo_loss_from_logps

    kwargs = _softcap_kwargs(linear_logprobs, inp, "fusedkern.linear_logprobs")

    def loss_fn():
        logps = linear_logprobs(inp.x, inp.w, inp.target, **kwargs)
        return simpo_loss_from_logps(logps, inp.target != -100)[0]

    return _loss_steps(loss_fn)


def _simpo_liger(inp: Inputs) -> dict[str, Step]:
    _require_cuda(inp, "Liger-Kernel")
    from liger_kernel.chunked_loss import LigerFusedLinearSimPOLoss

    # Defaults β=0.1, γ=0.5, α=1 with the NLL term on: CPO-SimPO as in TRL and fusedkern. Left at
    # compiled=True (torch.compile of its per-chunk step) like the seed; warm-up absorbs the compile.
    softcap = _softcap_kwargs(LigerFusedLinearSimPOLoss, inp, "LigerFusedLinearSimPOLoss")
    loss_module = LigerFusedLinearSimPOLoss(**softcap)

    def loss_fn() -> torch.Tensor:
        out = loss_module(inp.w, inp.x, inp.target)
        return out[0] if isinstance(out, tuple) else out  # 0.8.5 returns (loss, metrics)

    return _loss_steps(loss_fn)


PROVIDERS: dict[str, dict[str, Provider]] = {
    "ce": {
        p.key: p
        for p in (
            Provider("cublas_1gemm", _cublas_1gemm, _key_label("cublas_1gemm"), is_floor=True, accuracy=False),
            Provider("cublas_3gemm", _cublas_3gemm, _key_label("cublas_3gemm"), is_floor=True, accuracy=False),
            Provider("cublas_3gemm_real_grad", _cublas_3gemm_real_grad, _key_label("cublas_3gemm_real_grad"),
                     is_floor=True, accuracy=False),
            Provider("huggingface_bf16", _ce_hf_bf16, _key_label("huggingface_bf16")),
            Provider("torch_fp32_upcast", _ce_upcast, _key_label("torch_fp32_upcast")),
            Provider("fusedkern_chunked", _ce_fusedkern(impl="chunked"), _key_label("fusedkern_chunked")),
            Provider(
                "fusedkern_chunked_lean",
                _ce_fusedkern(impl="chunked", weight_grad_accum="weight_dtype"),
                _key_label("fusedkern_chunked_lean"),
            ),
            Provider("fusedkern_fused", _ce_fusedkern(impl="fused"), _key_label("fusedkern_fused")),
            Provider("fusedkern_chunked_counted", _ce_fusedkern(counted="host", impl="chunked"),
                     _key_label("fusedkern_chunked_counted")),
            Provider("fusedkern_chunked_lean_counted",
                     _ce_fusedkern(counted="host", impl="chunked", weight_grad_accum="weight_dtype"),
                     _key_label("fusedkern_chunked_lean_counted")),
            Provider("fusedkern_chunked_device_count", _ce_fusedkern(counted="device", impl="chunked"),
                     _key_label("fusedkern_chunked_device_count")),
            Provider("fusedkern_chunked_lean_device_count",
                     _ce_fusedkern(counted="device", impl="chunked", weight_grad_accum="weight_dtype"),
                     _key_label("fusedkern_chunked_lean_device_count")),
            # the chunk-size study: time and memory against the 256 MiB default chunk (1024 tokens at V = 128256)
            *(
                Provider(f"fusedkern_chunked{suffix}_c{c}", _ce_fusedkern(impl="chunked", chunk_tokens=c, weight_grad_accum=accum),
                         _key_label(f"fusedkern_chunked{suffix}_c{c}"))
                for c in (512, 2048, 4096, 8192)
                for suffix, accum in (("", "fp32"), ("_lean", "weight_dtype"))
            ),
            Provider("liger", _ce_liger, _dist_label("liger-kernel")),
            Provider("cut_cross_entropy", _ce_cut_cross_entropy, _key_label("cut_cross_entropy")),
            Provider("quack", _ce_quack, _key_label("quack")),
            # torch ≥ 2.13: with LinearCrossEntropyOptions() (chunked, no [T, V] logits) and without (unfused)
            Provider("torch_linear_cross_entropy", _ce_torch_linear_cross_entropy(chunked=True),
                     _key_label("torch_linear_cross_entropy")),
            Provider("torch_linear_cross_entropy_unfused", _ce_torch_linear_cross_entropy(chunked=False),
                     _key_label("torch_linear_cross_entropy_unfused")),
        )
    },
    "simpo": {
        p.key: p
        for p in (
            Provider("cublas_1gemm", _cublas_1gemm, _key_label("cublas_1gemm"), is_floor=True, accuracy=False),
            Provider("cublas_3gemm", _cublas_3gemm, _key_label("cublas_3gemm"), is_floor=True, accuracy=False),
            Provider("cublas_3gemm_real_grad", _cublas_3gemm_real_grad, _key_label("cublas_3gemm_real_grad"),
                     is_floor=True, accuracy=False),
            Provider("huggingface_fp32", _simpo_hf_fp32, _key_label("huggingface_fp32")),
            Provider("fusedkern_chunked", _simpo_fusedkern(impl="chunked"), _key_label("fusedkern_chunked")),
            Provider(
                "fusedkern_chunked_lean",
                _simpo_fusedkern(impl="chunked", weight_grad_accum="weight_dtype"),
                _key_label("fusedkern_chunked_lean"),
            ),
            # chunks of 2048 tokens hold a whole chosen/rejected pair at seq 1024: three GEMMs, 501 MiB
            Provider("fusedkern_chunked_c2048", _simpo_fusedkern(impl="chunked", chunk_tokens=2048),
                     _key_label("fusedkern_chunked_c2048")),
            Provider("fusedkern_chunked_lean_c2048",
                     _simpo_fusedkern(impl="chunked", chunk_tokens=2048, weight_grad_accum="weight_dtype"),
                     _key_label("fusedkern_chunked_lean_c2048")),
            Provider("fusedkern_generic", _simpo_fusedkern_generic, _key_label("fusedkern_generic")),
            Provider("liger", _simpo_liger, _dist_label("liger-kernel")),
        )
    },
}


def _select_providers(op: str, names: list[str] | None, *, accuracy: bool = False) -> list[Provider]:
    registry = PROVIDERS[op]
    if names is None:
        return [p for p in registry.values() if p.accuracy or not accuracy]
    unknown = [n for n in names if n not in registry]
    if unknown:
        raise ValueError(f"unknown {op} providers {unknown}; choose from {sorted(registry)}")
    return [registry[n] for n in names]


# ----------------------------------------------------------------------------------------------
# Timing and memory
# ----------------------------------------------------------------------------------------------


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


def _free_memory(device: torch.device) -> None:
    """Between providers: return everything the last one left to the driver.

    GPU only: a full gc pass costs ~0.5 s with torch and the competitors imported, and on CPU
    there is no memory measurement for garbage to disturb.
    """
    if device.type == "cuda":
        gc.collect()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _warm_up(step: Step, inputs: Inputs, *, warmup: int, reps: int, min_reps: int, max_case_s: float) -> int:
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
    n_reps = _warm_up(step, inputs, warmup=warmup, reps=reps, min_reps=min_reps, max_case_s=max_case_s)
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
    another GEMM-heavy step ran 5–10 % slower than after a light Triton kernel, reference README §6).
    `order_log`, when given, receives each round's order (the steps that ran in it).

    Returns {name: timing dict as `time_step`'s}, or {name: the exception} for a step that failed
    in its warm-up (the others still run)."""
    counts: dict[str, int] = {}
    failures: dict[str, BaseException] = {}
    for name, step in steps.items():
        try:
            counts[name] = _warm_up(step, inputs, warmup=warmup, reps=reps, min_reps=min_reps, max_case_s=max_case_s)
        except Exception as error:  # noqa: BLE001 - reported per step by the caller
            failures[name] = error
            inputs.clear_grads()
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


# ----------------------------------------------------------------------------------------------
# Sweeps
# ----------------------------------------------------------------------------------------------


def _nan_row(**fields) -> dict:
    return {"ms_p20": math.nan, "ms_p50": math.nan, "ms_p80": math.nan, "peak_extra_mib": math.nan,
            "n_reps": 0, "loss": math.nan, "note": "", **fields}


def _error_note(error: BaseException) -> str:
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return "OOM"
    first_line = (str(error).strip().splitlines() or [""])[0]
    return f"error: {type(error).__name__}: {first_line}"[:200]


def _build(provider: Provider, inputs: Inputs, skipped: dict[str, str]) -> dict[str, Step] | None:
    """The provider's steps, or None (logged once per sweep) when it cannot run here."""
    if provider.key in skipped:
        return None
    try:
        return provider.build(inputs)
    except (ImportError, ProviderUnavailable) as error:
        skipped[provider.key] = f"{type(error).__name__}: {error}"
        _say(f"skipping provider {provider.key}: {skipped[provider.key]}")
        return None


def _progress(total: int, enabled: bool, description: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=description, unit="case", file=sys.stderr, disable=not enabled, dynamic_ncols=True)


def _case_rng(seed: int, op: str, workload: str, x: int, mode: str) -> random.Random:
    """The shuffled protocol's order source for one case: a function of --seed and the case alone, so
    a run is reproducible and a case's orders do not depend on which other cases ran."""
    return random.Random(f"fusedkern.bench/{seed}/{op}/{workload}/{x}/{mode}")


def _resolve_protocol(protocol: str | None, interleave: bool | None) -> str:
    """`protocol`, or the deprecated `interleave` flag's meaning (True: fixed, False: sequential)."""
    if interleave is not None:
        implied = "fixed" if interleave else "sequential"
        if protocol is not None and protocol != implied:
            raise ValueError(f"interleave={interleave} (deprecated, means protocol {implied!r}) contradicts "
                             f"protocol={protocol!r}")
        protocol = implied
    protocol = DEFAULT_PROTOCOL if protocol is None else protocol
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; choose from {PROTOCOLS}")
    return protocol


def _check_workloads(op: str, workloads: list[str] | tuple[str, ...]) -> list[str]:
    workloads = list(workloads)
    if not workloads:
        raise ValueError("give at least one workload")
    for workload in workloads:
        if op == "simpo" and workload == SIMPO_LEGACY_WORKLOAD:
            continue
        ignored_fraction(workload)  # raises for an unknown one
    if len(set(workloads)) != len(workloads):
        raise ValueError(f"workloads repeat: {workloads}")
    return workloads


def _make_inputs(op: str, x: int, *, hidden: int, vocab: int, dtype: torch.dtype, device: torch.device,
                 seq: int, seed: int, workload: str, softcap: float | None) -> Inputs:
    if op == "ce":
        return make_ce_inputs(x, hidden, vocab, dtype=dtype, device=device, seed=seed, workload=workload, seq=seq,
                              softcap=softcap)
    return make_simpo_inputs(x, seq, hidden, vocab, dtype=dtype, device=device, seed=seed, workload=workload,
                             softcap=softcap)


def run_sweep(
    op: str,
    xs: list[int],
    *,
    hidden: int = 4096,
    vocab: int = 128256,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device | None = None,
    seq: int = DEFAULT_SEQ,
    providers: list[str] | None = None,
    modes: tuple[str, ...] | list[str] = MODES,
    warmup: int = 2,
    reps: int = 20,
    min_reps: int = 5,
    max_case_s: float = 1.5,
    seed: int = 0,
    progress: bool = True,
    protocol: str | None = None,
    workloads: list[str] | tuple[str, ...] = ("dense",),
    softcap: float | None = None,
    head: str | None = None,
    interleave: bool | None = None,
    checkpoint: Callable[[list[dict]], None] | None = None,
) -> list[dict]:
    """Time and measure every provider of `op` ("ce" or "simpo") at every x, in every mode, for every workload.

    xs: token counts (ce) or batch rows (simpo, with `seq` tokens each). Inputs are made once per
    (workload, x) and shared by all providers; for ce `seq` is the sequence length the masked
    workloads cut the tokens into. Returns rows in the schema of `fusedkern.results` plus `note`
    ("" when fine, "OOM", or "error: ..."), `protocol`, `workload` and `head` (default: the preset
    that matches hidden/vocab/softcap, else "custom"); a provider/mode that errors (other than OOM)
    is not retried at larger x of that workload.

    protocol (default "shuffled"): per x and mode, every provider's reps interleaved
    (`time_steps_interleaved`), in a new random order every round ("shuffled", seeded by `seed`) or a
    rotating fixed order ("fixed"); all providers' steps then live at once. "sequential": one
    provider after the other. `interleave` is the deprecated flag (True = "fixed", False =
    "sequential"). `checkpoint(rows)` is called after each provider (each x when interleaving), so a
    run cut short by a time limit still leaves what it finished.
    """
    if op not in PROVIDERS:
        raise ValueError(f"op must be one of {sorted(PROVIDERS)}, got {op!r}")
    bad_modes = [m for m in modes if m not in MODES]
    if bad_modes:
        raise ValueError(f"unknown modes {bad_modes}; choose from {MODES}")
    protocol = _resolve_protocol(protocol, interleave)
    workloads = _check_workloads(op, workloads)
    head = head or head_name(vocab, hidden, softcap)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    chosen = _select_providers(op, providers)
    x_name = "tokens" if op == "ce" else "batch"
    rows: list[dict] = []
    skipped: dict[str, str] = {}
    failed: set[tuple[str, str, str]] = set()  # (workload, provider key, mode)

    def record(provider: Provider, workload: str, x: int, mode: str, measure: Callable[[], dict]) -> None:
        """One row: `measure()`'s fields, or NaNs and a note when it raises."""
        label = provider.label()
        base = {"op": op, "provider": label, "x_name": x_name, "x": x, "mode": mode, "protocol": protocol,
                "workload": workload, "head": head}
        row = {**base, "note": ""}
        try:
            row.update(measure())
        except Exception as error:  # noqa: BLE001 - one broken provider must not end the run
            row = _nan_row(**base, note=_error_note(error))
            if row["note"] != "OOM":
                failed.add((workload, provider.key, mode))
                _say("".join(traceback.format_exception(error)).rstrip())  # the GPU run is one-shot: keep it all
        rows.append(row)
        _say(f"{op} {workload:<9} {x_name}={x:<6} {label:<28} {mode:<9} p50 {row['ms_p50']:9.3f} ms  "
             f"extra {row['peak_extra_mib']:9.1f} MiB  n={row['n_reps']:<3} loss {row['loss']:.5f} {row['note']}")

    def timed_then_measured(steps: dict, mode: str, inputs: Inputs, timing: dict | BaseException | None):
        def measure() -> dict:
            # Timing first: its warm-up absorbs compilation and autotuning, whose scratch
            # allocations must not count as the provider's memory.
            if isinstance(timing, BaseException):
                raise timing
            fields = dict(timing) if timing is not None else time_step(
                steps[mode], inputs, warmup=warmup, reps=reps, min_reps=min_reps, max_case_s=max_case_s)
            fields["loss"], fields["peak_extra_mib"] = measure_step(steps[mode], inputs, mode)
            inputs.clear_grads()
            return fields
        return measure

    settle_gpu(device)
    total = len(workloads) * len(xs) * len(chosen) * len(modes)
    with _progress(total, progress, f"{op} sweep ({protocol})") as bar:
        for workload in workloads:
            for x in xs:
                inputs = _make_inputs(op, x, hidden=hidden, vocab=vocab, dtype=dtype, device=device, seq=seq,
                                      seed=seed, workload=workload, softcap=softcap)
                if protocol != "sequential":
                    built = {p: steps for p in chosen if (steps := _build(p, inputs, skipped)) is not None}
                    for mode in modes:
                        bar.set_postfix_str(f"{workload} {x_name}={x} {mode}, {protocol}")
                        todo = {p: st for p, st in built.items()
                                if mode in st and (workload, p.key, mode) not in failed}
                        rng = _case_rng(seed, op, workload, x, mode) if protocol == "shuffled" else None
                        try:
                            timings = time_steps_interleaved({p.key: st[mode] for p, st in todo.items()}, inputs,
                                                             warmup=warmup, reps=reps, min_reps=min_reps,
                                                             max_case_s=max_case_s, rng=rng)
                        except Exception as error:  # noqa: BLE001 - e.g. OOM with every step alive
                            timings = {p.key: error for p in todo}
                        for p, st in todo.items():
                            record(p, workload, x, mode, timed_then_measured(st, mode, inputs, timings[p.key]))
                        bar.update(len(chosen))
                    del built
                else:
                    for provider in chosen:
                        bar.set_postfix_str(f"{workload} {x_name}={x} {provider.key}")
                        steps = _build(provider, inputs, skipped)
                        for mode in modes:
                            bar.update(1)
                            if steps is not None and mode in steps and (workload, provider.key, mode) not in failed:
                                record(provider, workload, x, mode, timed_then_measured(steps, mode, inputs, None))
                        del steps
                        _free_memory(device)
                        if checkpoint is not None:
                            checkpoint(rows)
                del inputs
                _free_memory(device)
                if protocol != "sequential" and checkpoint is not None:  # sequential checkpoints after each provider
                    checkpoint(rows)
    return rows


def fp64_linear_cross_entropy_grads_chunked(
    x: torch.Tensor,
    w: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = IGNORE_INDEX,
    chunk_tokens: int = 1024,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact mean cross-entropy of `x @ w.T` (softcapped to c·tanh(z/c) when `softcap` is given) and its
    gradients, in float64, chunk by chunk.

    x [..., H], w [V, H], target [...] int64 -> (loss 0-d, dX shaped like x, dW [V, H]), float64.
    The truth the accuracy sweep compares against at 32768 × 128256, where the whole fp64 logits
    (34 GB) and autograd's copies of them would not fit: per chunk of `chunk_tokens` tokens the
    logits are formed in float64 ([C, V], 1 GB at C = 1024), turned in place into
    G = (softmax − onehot)/N (N = non-ignored tokens, ignored rows 0), then dX_chunk = G W and
    dW += Gᵀ x_chunk. Same math as `fusedkern.reference.linear_cross_entropy_fp64` (mean
    reduction; all tokens ignored gives NaN like torch), which the tests check it against.
    """
    hidden = x.shape[-1]
    x2d = x.detach().reshape(-1, hidden)  # [T, H]
    flat_target = target.reshape(-1)  # [T]
    w64 = w.detach().double()  # [V, H]
    mask = flat_target != ignore_index  # [T]
    n_valid = mask.sum().double()  # 0-d
    loss_sum = torch.zeros((), dtype=torch.float64, device=x.device)
    grad_x = torch.empty(x2d.shape, dtype=torch.float64, device=x.device)  # [T, H]
    grad_w = torch.zeros_like(w64)  # [V, H]
    for start in range(0, x2d.shape[0], chunk_tokens):
        stop = min(start + chunk_tokens, x2d.shape[0])
        x_chunk = x2d[start:stop].double()  # [C, H]
        valid = mask[start:stop]  # [C]
        safe_target = torch.where(valid, flat_target[start:stop], 0)  # [C], in range for gathers
        logits = x_chunk @ w64.T  # [C, V]
        dsoftcap = None
        if softcap is not None:
            logits, dsoftcap = _softcap_with_derivative_(logits, softcap)  # s [C, V], ds/dz [C, V]
        lse = torch.logsumexp(logits, dim=-1)  # [C]
        picked = logits.gather(1, safe_target[:, None]).squeeze(1)  # [C]
        loss_sum += torch.where(valid, lse - picked, 0.0).sum()
        grad = _logits_to_mean_ce_grad_(logits, safe_target, valid, n_valid, lse, dsoftcap)  # [C, V], in place
        grad_x[start:stop] = grad @ w64
        grad_w.addmm_(grad.T, x_chunk)
    return loss_sum / n_valid, grad_x.reshape(x.shape), grad_w


def _relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    """‖value − reference‖_F / ‖reference‖_F, in float64."""
    return float(torch.linalg.vector_norm(value.double() - reference) / torch.linalg.vector_norm(reference))


def run_accuracy(
    tokens: list[int],
    *,
    hidden: int = 4096,
    vocab: int = 128256,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device | None = None,
    providers: list[str] | None = None,
    seed: int = 0,
    chunk_tokens: int = 1024,
    progress: bool = True,
    workloads: list[str] | tuple[str, ...] = ("dense",),
    seq: int = DEFAULT_SEQ,
    softcap: float | None = None,
    head: str | None = None,
    checkpoint: Callable[[list[dict]], None] | None = None,
) -> list[dict]:
    """Errors of each cross-entropy provider against the fp64 truth, mean reduction, mode "full".

    Adds to the schema err_loss = |loss − ref|/|ref|, err_dx, err_dw (relative Frobenius
    errors, see `_relative_error`), `note`, `workload`, `head` and `protocol` ("sequential": the
    providers run one after the other, untimed). The same-dtype PyTorch computation
    (`huggingface_bf16` for bf16 inputs) and the fp32 upcast are among the providers: they are
    the yardstick for what "accurate" means in this dtype. Times are not measured (NaN, n_reps 0);
    peak_extra_mib comes from the same single run. The truth applies `softcap` like the providers.
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    workloads = _check_workloads("ce", workloads)
    head = head or head_name(vocab, hidden, softcap)
    chosen = _select_providers("ce", providers, accuracy=True)
    floors = [p.key for p in chosen if p.is_floor]
    if floors:
        raise ValueError(f"the GEMM floors compute no loss and cannot be checked for accuracy: {floors}")
    rows: list[dict] = []
    skipped: dict[str, str] = {}
    cases = [(workload, n_tokens) for workload in workloads for n_tokens in tokens]
    with _progress(len(cases) * len(chosen), progress, "accuracy") as bar:
        for workload, n_tokens in cases:
            inputs = make_ce_inputs(n_tokens, hidden, vocab, dtype=dtype, device=device, seed=seed,
                                    workload=workload, seq=seq, softcap=softcap)
            ref_loss, ref_dx, ref_dw = fp64_linear_cross_entropy_grads_chunked(
                inputs.x, inputs.w, inputs.target, chunk_tokens=chunk_tokens, softcap=softcap
            )
            for provider in chosen:
                bar.set_postfix_str(f"{workload} tokens={n_tokens} {provider.key}")
                bar.update(1)
                steps = _build(provider, inputs, skipped)
                if steps is None:
                    continue
                row = _nan_row(op="ce", provider=provider.label(), x_name="tokens", x=n_tokens, mode="full",
                               protocol="sequential", workload=workload, head=head)
                try:
                    row["loss"], row["peak_extra_mib"] = measure_step(steps["full"], inputs, "full")
                    row["err_loss"] = abs(row["loss"] - float(ref_loss)) / abs(float(ref_loss))
                    row["err_dx"] = _relative_error(inputs.x.grad, ref_dx)
                    row["err_dw"] = _relative_error(inputs.w.grad, ref_dw)
                except Exception as error:  # noqa: BLE001 - one broken provider must not end the run
                    row["note"] = _error_note(error)
                    _say(traceback.format_exc().rstrip())
                rows.append(row)
                errors = " ".join(f"{k} {row.get(k, math.nan):.3e}" for k in ("err_loss", "err_dx", "err_dw"))
                _say(f"accuracy {workload:<9} tokens={n_tokens:<6} {row['provider']:<28} {errors} {row['note']}")
                inputs.clear_grads()
                del steps
                _free_memory(device)
                if checkpoint is not None:
                    checkpoint(rows)
            del inputs, ref_dx, ref_dw
            _free_memory(device)
    return rows


# ----------------------------------------------------------------------------------------------
# Summary table
# ----------------------------------------------------------------------------------------------


def format_table(rows: list[dict]) -> str:
    """A plain-text summary: per mode, provider × x of ms_p50 and the ratio to that mode's floor
    (cublas_1gemm for loss_only/forward, cublas_3gemm for backward/full, timed in the same case);
    for accuracy rows, provider × x of err_loss / err_dx / err_dw. Rows of several workloads or
    protocols get one block each."""
    if not rows:
        return "(no rows)"
    groups: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        groups.setdefault((row.get("workload", ""), row.get("protocol", "")), []).append(row)
    if len(groups) > 1:
        return "\n\n".join(f"== workload {workload}, protocol {protocol}\n{_format_block(block)}"
                            for (workload, protocol), block in groups.items())
    return _format_block(rows)


def _format_block(rows: list[dict]) -> str:
    xs = sorted({r["x"] for r in rows})
    x_name = rows[0]["x_name"]
    width = max(len(r["provider"]) for r in rows) + 2
    lines: list[str] = []
    if any("err_dx" in r for r in rows):
        lines.append(f"relative errors vs fp64 (loss / dX / dW), {x_name}:")
        lines.append(" " * width + "".join(f"{x:>32}" for x in xs))
        for provider in sorted({r["provider"] for r in rows}):
            cells = []
            for x in xs:
                match = [r for r in rows if r["provider"] == provider and r["x"] == x]
                errors = [match[0].get(k, math.nan) if match else math.nan for k in ("err_loss", "err_dx", "err_dw")]
                cells.append(" ".join(f"{e:10.2e}" for e in errors))
            lines.append(f"{provider:<{width}}" + "".join(f"{c:>32}" for c in cells))
        return "\n".join(lines)
    for mode in [m for m in MODES if any(r["mode"] == m for r in rows)]:
        mode_rows = [r for r in rows if r["mode"] == mode]
        floor = {r["x"]: r["ms_p50"] for r in mode_rows if r["provider"] == FLOOR_OF_MODE[mode]}
        lines.append(f"\n{mode}: ms_p50 (× {FLOOR_OF_MODE[mode]}), by {x_name}")
        lines.append(" " * width + "".join(f"{x:>20}" for x in xs))
        for provider in sorted({r["provider"] for r in mode_rows}):
            cells = []
            for x in xs:
                match = [r for r in mode_rows if r["provider"] == provider and r["x"] == x]
                if not match:
                    cells.append("-")
                elif math.isnan(match[0]["ms_p50"]):
                    cells.append(match[0]["note"][:18] or "nan")
                else:
                    ms = match[0]["ms_p50"]
                    ratio = ms / floor[x] if x in floor else math.nan
                    cells.append(f"{ms:9.2f} ({ratio:5.2f}×)")
            lines.append(f"{provider:<{width}}" + "".join(f"{c:>20}" for c in cells))
    return "\n".join(lines).lstrip("\n")


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
EXIT_REFUSED = 2  # the exit status of a run refused before it measured anything (as argparse's errors)


def _device_slug(device: str | torch.device | None = None) -> str:
    """Folder name for a device's outputs: "h200" for "NVIDIA H200", "cpu" for the CPU. Default: the
    device a run gets without --device (the first GPU when there is one)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type != "cuda":
        return device.type
    name = torch.cuda.get_device_name(device.index or 0).lower().replace("nvidia", "")
    return re.sub(r"[^a-z0-9]+", "_", name).strip("_") or "gpu"


def _repository_root() -> Path | None:
    """The checkout this module lives in (its pyproject.toml beside the package), None when installed."""
    root = Path(__file__).resolve().parents[1]
    return root if (root / "pyproject.toml").is_file() and (root / "fusedkern" / "bench.py").is_file() else None


def default_output(sweep: str, device_slug: str) -> Path | None:
    """<repository>/data/measured/<device>/<sweep>.csv for a GPU run inside a checkout (wherever the
    command runs from); None, so --out is required, on CPU (smoke runs do not belong in
    data/measured/) or when the package is not a checkout."""
    root = _repository_root()
    if device_slug == "cpu" or root is None:
        return None
    return root / "data" / "measured" / device_slug / f"{sweep}.csv"


def measured_folder_device(path: Path) -> str | None:
    """<device> when `path` lies under a `data/measured/<device>/` folder (the innermost such one), else None."""
    parts = Path(os.path.abspath(path)).parts
    for i in range(len(parts) - 3, 0, -1):  # parts[i+1] must be a folder: the file itself comes after it
        if parts[i - 1] == "data" and parts[i] == "measured":
            return parts[i + 1]
    return None


def check_output(out: Path, device_slug: str, *, append: bool, overwrite: bool) -> str | None:
    """Why writing `out` (and its sidecar JSON) is refused, or None when allowed.

    Refused without --overwrite: a `data/measured/<folder>/` that is not this run's device (a CPU run
    into data/measured/h200/, a --device cpu run on a GPU host into the GPU's folder, an A100 run into
    the H200's). Refused without --append or --overwrite: an existing CSV or sidecar."""
    folder = measured_folder_device(out)
    if folder is not None and folder != device_slug and not overwrite:
        return (f"refusing to write {out}: it is in data/measured/{folder}/ but this run measures on {device_slug!r} "
                f"(data/measured/<device>/ holds that device's measurements); pass --overwrite to write there anyway")
    if not (append or overwrite):
        from fusedkern.results import sidecar_path

        existing = [p for p in (out, sidecar_path(out)) if p.exists()]
        if existing:
            return (f"refusing to replace {existing[0]}: it exists; pass --append to merge this run into it "
                    f"or --overwrite to replace it")
    return None


def _softcap_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"softcap must be a finite number ≥ 0 (0: none), got {text!r}")
    return value


def _workload_arg(op: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        try:
            _check_workloads(op, [text])
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        return text
    return parse


def _parser() -> argparse.ArgumentParser:
    heads = ", ".join(f"{name} (V {h.vocab}, H {h.hidden}{f', softcap {h.softcap:g}' if h.softcap else ''})"
                      for name, h in HEADS.items())
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--head", choices=sorted(HEADS),
                        help=f"an LM head users train, sets --vocab/--hidden/--softcap (given ones win): {heads}; "
                             f"the `head` column names the preset the run's V, H and softcap match, else custom")
    common.add_argument("--hidden", type=int, help="H (default: the head's, else 4096)")
    common.add_argument("--vocab", type=int, help="V (default: the head's, else 128256, Llama 3)")
    common.add_argument("--softcap", type=_softcap_arg, metavar="C",
                        help="final-logit softcap z -> C·tanh(z/C), as Gemma 2 (default: the head's, else none; "
                             "0: none); providers without one are skipped")
    common.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16", help="input and weight dtype")
    common.add_argument("--providers", nargs="+", metavar="NAME",
                        help="registry keys to run (default: all of the op, listed below)")
    common.add_argument("--out", type=Path,
                        help="results CSV (JSON sidecar beside it); default on a GPU "
                             "<repository>/data/measured/<gpu>/<sweep>.csv (not relative to the working directory); "
                             "required on CPU")
    common.add_argument("--append", action="store_true",
                        help="merge into an existing CSV (e.g. a second competitor version); rows with the same "
                             "op, provider, x, mode, workload and protocol are replaced")
    common.add_argument("--overwrite", action="store_true",
                        help="replace an existing CSV, and allow writing into another device's data/measured/<device>/")
    common.add_argument("--seed", type=int, default=0, help="inputs, and the shuffled protocol's orders")
    common.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    common.add_argument("--no-progress", action="store_true", help="no progress bar (the per-case log lines stay)")

    timing = argparse.ArgumentParser(add_help=False)
    timing.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    timing.add_argument("--warmup", type=int, default=2, help="untimed reps per case (≥ 1)")
    timing.add_argument("--reps", type=int, default=20, help="most timed reps per case")
    timing.add_argument("--min-reps", type=int, default=5, help="fewest timed reps per case")
    timing.add_argument("--max-case-s", type=float, default=1.5,
                        help="wall-time budget per case that sets the rep count between the two")
    timing.add_argument("--protocol", choices=PROTOCOLS,
                        help="per size and mode: shuffled (default) interleaves the providers' reps, one each per "
                             "round in a new random order every round (seeded by --seed); fixed interleaves them "
                             "in a rotating fixed order; sequential times one provider after the other")
    timing.add_argument("--interleave", action="store_true",
                        help="deprecated alias of --protocol fixed")

    def add_workloads(sub: argparse.ArgumentParser, op: str, seq_help: str) -> None:
        legacy = f"; {SIMPO_LEGACY_WORKLOAD}: the SimPO input of earlier runs" if op == "simpo" else ""
        sub.add_argument("--workload", nargs="+", type=_workload_arg(op), default=["dense"], metavar="NAME",
                         help=f"one or several of {', '.join(WORKLOADS)} (any masked_N, 0 <= N < 100): N %% of the "
                              f"targets ignored as a prompt prefix of each sequence{legacy} (default: dense)")
        sub.add_argument("--seq", type=int, default=DEFAULT_SEQ, help=seq_help)

    registry = "; ".join(f"{op}: {', '.join(PROVIDERS[op])}" for op in PROVIDERS)
    parser = argparse.ArgumentParser(
        prog="python -m fusedkern.bench",
        description="Benchmark the LM head + loss (fusedkern vs baselines and competitors).",
        epilog=f"providers — {registry}. The accuracy sweep takes the ce providers without the cublas floors. "
               f"Exit status 2: refused before measuring (bad arguments, or an output it must not write).",
    )
    sub = parser.add_subparsers(dest="sweep", required=True)
    ce = sub.add_parser("ce", parents=[common, timing], help="cross-entropy timing and memory sweep",
                        epilog=f"providers: {', '.join(PROVIDERS['ce'])}")
    ce.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    add_workloads(ce, "ce", "tokens per sequence for the masked workloads: the first N %% of each is ignored "
                            "(default: %(default)s)")
    simpo = sub.add_parser("simpo", parents=[common, timing], help="SimPO timing and memory sweep",
                           epilog=f"providers: {', '.join(PROVIDERS['simpo'])}")
    simpo.add_argument("--batch", type=int, nargs="+", default=[2, 4, 8, 16],
                       help="rows of the input, chosen + rejected (2 = one pair), as in the seed")
    add_workloads(simpo, "simpo", "tokens per row (default: %(default)s)")
    accuracy_providers = ", ".join(p.key for p in PROVIDERS["ce"].values() if p.accuracy)
    accuracy = sub.add_parser("accuracy", parents=[common], help="cross-entropy errors against an fp64 truth",
                              epilog=f"providers: {accuracy_providers}")
    accuracy.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768])
    accuracy.add_argument("--chunk-tokens", type=int, default=1024, help="tokens per fp64 reference chunk")
    add_workloads(accuracy, "ce", "tokens per sequence for the masked workloads (default: %(default)s)")
    return parser


def _resolve_head(args: argparse.Namespace) -> tuple[int, int, float | None]:
    """(hidden, vocab, softcap): the explicit flags, else the --head preset's, else Llama 3's without softcap."""
    preset = HEADS[args.head or DEFAULT_HEAD]
    hidden = preset.hidden if args.hidden is None else args.hidden
    vocab = preset.vocab if args.vocab is None else args.vocab
    softcap = (preset.softcap if args.head else None) if args.softcap is None else (args.softcap or None)
    return hidden, vocab, softcap


def _refuse(message: str) -> int:
    print(f"python -m fusedkern.bench: error: {message}", file=sys.stderr)
    return EXIT_REFUSED


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    args = parser.parse_args(argv)
    dtype = _DTYPES[args.dtype]
    hidden, vocab, softcap = _resolve_head(args)
    head = head_name(vocab, hidden, softcap)
    protocol = "sequential"  # the accuracy sweep: providers one after the other, untimed
    if args.sweep != "accuracy":
        if args.interleave:
            _say("--interleave is deprecated: use --protocol fixed")
            if args.protocol not in (None, "fixed"):
                parser.error(f"--interleave (= --protocol fixed) contradicts --protocol {args.protocol}")
            args.protocol = "fixed"
        protocol = args.protocol or DEFAULT_PROTOCOL

    device_slug = _device_slug(args.device)
    out = args.out if args.out is not None else default_output(args.sweep, device_slug)
    if out is None:
        why = "on CPU" if device_slug == "cpu" else "outside a checkout of the repository"
        return _refuse(f"give --out {why}: the default data/measured/<gpu>/{args.sweep}.csv holds GPU measurements "
                       f"of this repository")
    refusal = check_output(out, device_slug, append=args.append, overwrite=args.overwrite)
    if refusal:
        return _refuse(refusal)

    meta: dict[str, Any] = {"sweep": args.sweep, "hidden": hidden, "vocab": vocab, "softcap": softcap, "head": head,
                            "dtype": args.dtype, "seed": args.seed, "logit_std": LOGIT_STD, "device": device_slug,
                            "protocol": protocol, "workloads": list(args.workload), "seq": args.seq,
                            "floors": FLOORS_NOTE}
    command = shlex.join(["python", "-m", "fusedkern.bench", *argv])
    common = dict(hidden=hidden, vocab=vocab, dtype=dtype, device=args.device, providers=args.providers,
                  seed=args.seed, progress=not args.no_progress, workloads=args.workload, seq=args.seq,
                  softcap=softcap, head=head)

    from fusedkern.results import collect_environment

    environment = collect_environment(command)

    def save(rows: list[dict]) -> None:
        if rows:
            write_results(rows, out, meta=meta, environment=environment, append=args.append)

    started = time.perf_counter()
    if args.sweep == "accuracy":
        meta["chunk_tokens"] = args.chunk_tokens
        rows = run_accuracy(args.tokens, chunk_tokens=args.chunk_tokens, checkpoint=save, **common)
    else:
        timing = dict(modes=args.modes, warmup=args.warmup, reps=args.reps, min_reps=args.min_reps,
                      max_case_s=args.max_case_s, protocol=protocol, checkpoint=save)
        meta.update(warmup=args.warmup, reps=args.reps, min_reps=args.min_reps, max_case_s=args.max_case_s)
        xs = args.tokens if args.sweep == "ce" else args.batch
        rows = run_sweep(args.sweep, xs, **common, **timing)
    print(format_table(rows))
    print(f"\n{args.sweep}: {len(rows)} rows -> {out if rows else '(nothing written)'} "
          f"in {time.perf_counter() - started:.1f} s")
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
