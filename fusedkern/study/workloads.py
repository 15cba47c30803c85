"""The benchmark's inputs: LM heads users train, the workloads (which targets are ignored) and the
seeded tensors every provider of a sweep point shares.

Workloads: `dense` (every target counts) or `masked_N`: N % of the targets are ignore_index, as
contiguous prompt spans at the start of each sequence as in SFT (ce: the tokens are cut into
sequences of `seq` tokens; simpo: every chosen and rejected row). `prompt_random` is the SimPO
workload of every run before workloads existed (a prompt of random length in [S/8, S/2) per row).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace

import torch

from fusedkern import linear_logprobs

IGNORE_INDEX = -100


# W ~ N(0, LOGIT_STD²/H) with x ~ N(0, 1) gives logits ~ N(0, LOGIT_STD²): with 2.0 the largest of
# 128256 logits is ≈ 2·sqrt(2·ln V) ≈ 10, the O(1–10) range of a trained LM head. (The seed's
# `nn.Linear` default init gives std ≈ 0.58, an untrained head on which bf16 rounding hides.)
LOGIT_STD = 2.0


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


# The heads users train (Llama 3, Qwen2.5-7B, Gemma 2, and the small models RL and preference training use most:
# Qwen3-0.6B, Llama-3.2-1B, whose head is a large share of the step). The default sweep (V 128256, H 4096) is Llama
# 3's.
HEADS = {
    "llama3": Head(vocab=128256, hidden=4096),
    "qwen25_7b": Head(vocab=151936, hidden=3584),
    "gemma2": Head(vocab=256000, hidden=2304, softcap=30.0),
    "qwen3_0p6b": Head(vocab=151936, hidden=1024),
    "llama32_1b": Head(vocab=128256, hidden=2048),
}


DEFAULT_HEAD = "llama3"


def head_name(vocab: int, hidden: int, softcap: float | None) -> str:
    """The `head` column: the name of the preset with exactly these dimensions and softcap, else "custom"."""
    for name, head in HEADS.items():
        if (head.vocab, head.hidden, head.softcap) == (vocab, hidden, softcap):
            return name
    return "custom"


@dataclass
class Inputs:
    """One workload, shared by every provider of a sweep point (the gradients are cleared between)."""

    op: str  # "ce", "simpo", "preference" or "distill"
    x: torch.Tensor  # [T, H] (ce) or [2B, S, H] (simpo, preference), leaf, requires grad
    w: torch.Tensor  # [V, H], leaf, requires grad
    target: torch.Tensor  # [T] or [2B, S] int64, IGNORE_INDEX where masked
    softcap: float | None = None  # final-logit softcap c (s = c·tanh(z/c)) every provider must apply
    # preference only: the loss type this view of the inputs is for ("all" for the GEMM floors) and the
    # loss's tensors besides x, W and target (`make_preference_inputs`), shared by every loss type
    loss_type: str | None = None
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

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


def make_preference_inputs(
    batch: int, seq: int, hidden: int, vocab: int, *, dtype: torch.dtype, device, seed: int = 0,
    workload: str = "dense", softcap: float | None = None,
) -> Inputs:
    """`make_simpo_inputs` (x [R, S, H], W, targets [R, S], R = `batch` rows, chosen rows first) plus, in
    `extras`, the tensors the preference losses take besides them, fixed per seed:

    - ref_chosen_logps, ref_rejected_logps [R/2] fp32: summed reference log-probs of each response, the
      policy's own (computed once, without gradients, by `fusedkern.linear_logprobs`) plus N(0, 2²) nats, so
      the log-ratios are a few nats and β·Δ = O(0.1–1), as early in training: no loss saturates (a
      saturated loss has a near-zero gradient, and GEMMs on zeros run faster than on real gradients);
    - ref_logps [R] fp32 (the same values per row) and kto_labels [R] bool, alternately desirable (half of
      them): KTO sees the R rows as unpaired sequences;
    - kl [1] fp32: KTO's KL estimate, a small positive number.
    The returned inputs have loss_type None; the sweep gives each loss type a view (`for_loss_type`)."""
    inputs = make_simpo_inputs(batch, seq, hidden, vocab, dtype=dtype, device=device, seed=seed, workload=workload,
                               softcap=softcap)
    device = inputs.x.device
    gen = _generator(device, seed + 1)  # x, W and targets stay those of the simpo op at the same seed
    with torch.no_grad():
        policy = linear_logprobs(inputs.x.detach(), inputs.w.detach(), inputs.target, softcap=softcap)
        policy = policy.float().sum(-1)  # [R]
    ref = policy + 2.0 * torch.randn(batch, generator=gen, device=device, dtype=torch.float32)  # [R]
    extras = {
        "ref_chosen_logps": ref[: batch // 2].contiguous(),
        "ref_rejected_logps": ref[batch // 2:].contiguous(),
        "ref_logps": ref,
        "kto_labels": torch.arange(batch, device=device) % 2 == 0,
        "kl": torch.rand(1, generator=gen, device=device, dtype=torch.float32) * 0.5,
    }
    return replace(inputs, op="preference", extras=extras)


def make_distill_inputs(tokens: int, hidden: int, vocab: int, *, dtype: torch.dtype, device, seed: int = 0,
                        workload: str = "dense", seq: int = DEFAULT_SEQ, softcap: float | None = None,
                        teacher_hidden: int | None = None) -> Inputs:
    """The student's x [T, H], W [V, H] and targets as `make_ce_inputs` (the masked workloads ignore the same
    prompt spans), plus in `extras` a teacher of its own: teacher_x [T, H_t] ~ N(0, 1) and teacher_w [V, H_t] ~
    N(0, LOGIT_STD²/H_t), no gradient (H_t = `teacher_hidden`, default H). `softcap`: both models' final softcap
    (a Gemma-2 head distilled from another)."""
    inputs = make_ce_inputs(tokens, hidden, vocab, dtype=dtype, device=device, seed=seed, workload=workload, seq=seq,
                            softcap=softcap)
    device = inputs.x.device
    gen = _generator(device, seed + 1)  # the student's tensors stay those of the ce op at the same seed
    hidden_t = teacher_hidden or hidden
    extras = {"teacher_x": _randn((tokens, hidden_t), 1.0, dtype, device, gen),
              "teacher_w": _randn((vocab, hidden_t), LOGIT_STD / math.sqrt(hidden_t), dtype, device, gen)}
    return replace(inputs, op="distill", extras=extras)


def for_loss_type(inputs: Inputs, loss_type: str) -> Inputs:
    """A view of preference inputs for one loss type: the same tensors (gradients shared and cleared alike)."""
    return replace(inputs, loss_type=loss_type)


def check_workloads(op: str, workloads: list[str] | tuple[str, ...]) -> list[str]:
    workloads = list(workloads)
    if not workloads:
        raise ValueError("give at least one workload")
    for workload in workloads:
        if op in ("simpo", "preference") and workload == SIMPO_LEGACY_WORKLOAD:
            continue
        ignored_fraction(workload)  # raises for an unknown one
    if len(set(workloads)) != len(workloads):
        raise ValueError(f"workloads repeat: {workloads}")
    return workloads


def make_inputs(op: str, x: int, *, hidden: int, vocab: int, dtype: torch.dtype, device: torch.device,
                 seq: int, seed: int, workload: str, softcap: float | None) -> Inputs:
    if op == "ce":
        return make_ce_inputs(x, hidden, vocab, dtype=dtype, device=device, seed=seed, workload=workload, seq=seq,
                              softcap=softcap)
    if op == "distill":
        return make_distill_inputs(x, hidden, vocab, dtype=dtype, device=device, seed=seed, workload=workload, seq=seq,
                                   softcap=softcap)
    if op == "preference":
        return make_preference_inputs(x, seq, hidden, vocab, dtype=dtype, device=device, seed=seed,
                                      workload=workload, softcap=softcap)
    return make_simpo_inputs(x, seq, hidden, vocab, dtype=dtype, device=device, seed=seed, workload=workload,
                             softcap=softcap)
