"""Analytic peak extra memory of each provider, for forward + backward (the benchmarks' `full` mode).

"Extra" follows the measurement convention of `data/measured/` and the H200 anchors: the peak
allocation during forward + backward *above* the inputs (x, W, targets) and the gradients' own
storage (dX, and dW in the weight's dtype). Gradient storage is subtracted even when the peak
happens before the gradients are allocated (as for the Hugging Face baselines, whose peak is inside
`log_softmax`'s backward): the model does the same, with an explicit negative term, so that its
numbers compare one to one with the measured column.

Each provider is a list of `Term`s: a name, a size in bytes and the formula, so that a notebook can
print where the memory goes. Symbols: T tokens, H hidden, V vocab, C chunk rows, e bytes per
element of the input dtype. Only the terms that scale with T·V, V·H or T are modelled; allocator
rounding, cuBLAS workspaces and scalars are not (a few MiB at most).

Providers (the names used in the results CSVs):

- `huggingface_bf16` — the cross-entropy seed's baseline: `nn.Linear` then `nn.CrossEntropyLoss` on
  logits in the input dtype. Peak inside `log_softmax`'s backward: the saved log-probabilities, the
  dense gradient w.r.t. them and the gradient w.r.t. the logits, three T×V buffers (3·T·V·e).
- `torch_fp32_upcast` (and `huggingface_fp32` for cross-entropy) — the same with the logits upcast
  to fp32 first: the same three buffers in fp32 (3·T·V·4).
- `huggingface_fp32` for SimPO — the SimPO seed's baseline (`reference.hf_linear_simpo_loss`): one
  fp32 log-softmax over all rows for the log-probabilities and a second one over the chosen half
  for the NLL term, each with its own gradient path: 4·T·V·4 at the peak.
- `fusedkern_chunked` — the plan of `fusedkern/chunk_plan.py`: when every token fits in
  256 MiB + V·H·4, one T×V buffer and no accumulator (one dW GEMM, fp32 inside cuBLAS); otherwise
  an fp32 V×H accumulator for dW (bf16/fp16 weights) and a C = H row buffer inside dW's own storage
  (0 extra; a caller's bigger chunk adds its C·V·e). Plus per-token fp32 loss and (max, log-sum)
  statistics.
- `fusedkern_chunked_lean` — the chunk buffer only (dW accumulated in the weight's dtype, in place).
- `fusedkern_fused` — no logits buffer: the backward's fp32 accumulator workspace (an upper bound:
  what 16 MiB leaves after the O(T + V) vectors, `chunk_plan.fused_accumulator_budget`) plus per-token
  coefficients (12·T), the saved LSE and loss (8·T) and the per-class fp32 vector (4·V).
- `liger-kernel 0.8.5` — one reused C×V buffer, C = min(next_pow2(⌈T / ⌈V/H⌉⌉), T); dW
  accumulated in place in the weight's dtype (its default `accum_dtype=None`).
- `liger-kernel 0.4.2` — same chunk rule, but each chunk is upcast to fp32 and the previous chunk's
  gradient is still referenced while the next chunk's logits are formed: 2·C·V·e + C·V·4.
- `cut_cross_entropy` — per-token fp32 LSE (O(T)); its fixed workspace (~1.5 MiB measured) is not
  modelled.
- `fusedkern_chunked[_lean]_counted` — `num_valid_tokens` as a host int, n of the T targets valid: the
  plan over the n valid rows, gathered into dX's own storage and put back in order through idle
  storage, plus the row order and gathered target ((T + n)·8). (Before that, the gathered rows and
  their own dX were live together beside dW: plan(n) + (2n − T)·H·e, above the dense path once
  n > T/2 in lean mode.)
- `fusedkern_chunked[_lean]_device_count` — `num_valid_tokens` as a device tensor: the plan over all T
  rows (the host does not know n), x sorted into dX's own storage and put back through idle storage
  (`compacted.counted_loss_and_grads`), so only the row order and the sorted target (2·T·8) add to
  the dense path's terms. (Before that, a sorted copy of x beside dX added T·H·e: the H100's
  1034.2 MiB against the dense 1002.2 at Llama-3's head, 4096 tokens.)
- `cublas_3gemm`, `cublas_1gemm` — the timing floors, not losses: the logits GEMM's T×V output (the
  floor's pre-made logits gradient G exists before the measured region; dX and dW count as
  gradient storage).

SimPO (`op="simpo"`): T = batch·seq (batch counts chosen and rejected rows, as the seed did); the
terms are those of cross-entropy except for the Hugging Face baseline (above) and Liger, whose
preference base runs one chosen/rejected pair (2·seq tokens) at a time through `torch.func`: the
pair's fp32 log-softmax plus the pair's weight-sized gradient before it is added to the accumulator
(approximate: the compiled graph's other temporaries, ~17 MiB on the H200, are not modelled).

Where a provider's implementation is not public in detail (the baselines' autograd graphs), the
buffers listed are the ones whose sizes reproduce the H200 measurements exactly; the tests check
the model against `data/reference/h200_anchors_2026-12-02.csv`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fusedkern.chunk_plan import GRAD_CHUNK_BUDGET_BYTES, chunk_rows, fused_accumulator_budget, grad_chunk_plan

__all__ = [
    "MIB",
    "PROVIDERS",
    "Term",
    "element_size",
    "default_chunk_size",
    "liger_chunk_size",
    "terms",
    "peak_extra_bytes",
    "peak_extra_mib",
    "terms_table",
]

MIB = 2**20

PROVIDERS = (
    "huggingface_bf16",
    "torch_fp32_upcast",
    "huggingface_fp32",
    "fusedkern_chunked",
    "fusedkern_chunked_lean",
    "fusedkern_fused",
    "liger-kernel 0.8.5",
    "liger-kernel 0.4.2",
    "cut_cross_entropy",
    "cublas_3gemm",
    "cublas_1gemm",
    "fusedkern_chunked_counted",
    "fusedkern_chunked_lean_counted",
    "fusedkern_chunked_device_count",
    "fusedkern_chunked_lean_device_count",
)
_COUNTED = PROVIDERS[-4:]

_ELEMENT_SIZE = {
    "float64": 8,
    "fp64": 8,
    "float32": 4,
    "fp32": 4,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "bfloat16": 2,
    "bf16": 2,
}



@dataclass(frozen=True)
class Term:
    """One contribution to the peak: what it is, its size in bytes and the formula for it."""

    name: str
    nbytes: int
    formula: str

    @property
    def mib(self) -> float:
        return self.nbytes / MIB


def element_size(dtype) -> int:
    """Bytes per element of `dtype`: a torch dtype or a name such as "bfloat16" or "bf16"."""
    name = str(dtype).removeprefix("torch.")
    try:
        return _ELEMENT_SIZE[name]
    except KeyError:
        raise ValueError(f"dtype: unsupported {dtype!r}; expected one of {sorted(_ELEMENT_SIZE)}") from None


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def default_chunk_size(vocab: int, dtype="bfloat16", budget_bytes: int = GRAD_CHUNK_BUDGET_BYTES) -> int:
    """The lean mode's chunk rows: the largest multiple of 64 with C·V·e ≤ 256 MiB (at least 64).
    (The default mode's chunk is `chunk_plan.grad_chunk_plan`'s.)"""
    return chunk_rows(math.inf, vocab, element_size(dtype), budget_bytes)


def liger_chunk_size(tokens: int, hidden: int, vocab: int, version: str = "0.8.5") -> int:
    """Liger-Kernel's cross-entropy chunk rows: next_pow2(⌈T / ⌈V/H⌉⌉), capped at T from 0.8 on.

    The rule bounds the logits chunk by roughly the size of the input (T·H); both versions use it.
    """
    inc_factor = math.ceil(vocab / hidden)
    rows = _next_power_of_2(math.ceil(tokens / inc_factor))
    return rows if version.startswith("0.4") else min(rows, tokens)


def _check_sizes(**sizes: int) -> None:
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")


def _grad_storage(tokens: int, hidden: int, vocab: int, e: int) -> list[Term]:
    """dX and dW in the input dtype: live at the peak of every chunked provider."""
    return [
        Term("dX (gradient storage, live at the peak)", tokens * hidden * e, "T·H·e"),
        Term("dW (gradient storage, live at the peak)", vocab * hidden * e, "V·H·e"),
    ]


def _minus_grad_storage(tokens: int, hidden: int, vocab: int, e: int) -> Term:
    return Term(
        "− gradient storage (dX, dW): excluded by the measurement convention",
        -(tokens * hidden + vocab * hidden) * e,
        "−(T·H + V·H)·e",
    )


def _per_token_stats(tokens: int, count: int, what: str) -> Term:
    return Term(f"per-token fp32 {what}", count * tokens * 4, f"{count}·T·4" if count > 1 else "T·4")


def terms(
    provider: str,
    tokens: int,
    hidden: int,
    vocab: int,
    *,
    dtype="bfloat16",
    chunk_size: int | None = None,
    op: str = "ce",
    seq: int = 1024,
    valid_tokens: int | None = None,
) -> list[Term]:
    """The terms of `provider`'s peak extra memory in full mode (forward + backward).

    tokens: T, all rows of the LM head (for SimPO: batch·seq, chosen and rejected together).
    chunk_size: the rows per chunk for `fusedkern_chunked*` (default: `default_chunk_size`).
    op: "ce" or "simpo" (only Liger differs between the two). seq: SimPO sequence length.
    valid_tokens: n, the non-ignored targets, for the `num_valid_tokens` providers (default: all T).
    """
    _check_sizes(tokens=tokens, hidden=hidden, vocab=vocab, seq=seq)
    if op not in ("ce", "simpo"):
        raise ValueError(f"op: expected 'ce' or 'simpo', got {op!r}")
    e = element_size(dtype)
    T, H, V = tokens, hidden, vocab

    if provider == "huggingface_bf16":
        return [
            Term("log-probabilities saved by log_softmax", T * V * e, "T·V·e"),
            Term("dense gradient w.r.t. the log-probabilities", T * V * e, "T·V·e"),
            Term("gradient w.r.t. the logits (log_softmax backward)", T * V * e, "T·V·e"),
            _minus_grad_storage(T, H, V, e),
        ]
    if provider == "huggingface_fp32" and op == "simpo":
        half = T // 2
        return [
            Term("fp32 log-probabilities of all rows (saved by log_softmax)", T * V * 4, "T·V·4"),
            Term("fp32 log-probabilities of the chosen rows (saved by cross_entropy)", half * V * 4, "(T/2)·V·4"),
            Term("fp32 dense gradient w.r.t. the log-probabilities", T * V * 4, "T·V·4"),
            Term("fp32 gradient w.r.t. the upcast logits", T * V * 4, "T·V·4"),
            Term("fp32 gradient of the chosen rows' NLL", half * V * 4, "(T/2)·V·4"),
            _minus_grad_storage(T, H, V, e),
        ]
    if provider in ("torch_fp32_upcast", "huggingface_fp32"):
        return [
            Term("fp32 log-probabilities saved by log_softmax", T * V * 4, "T·V·4"),
            Term("fp32 dense gradient w.r.t. the log-probabilities", T * V * 4, "T·V·4"),
            Term("fp32 gradient w.r.t. the upcast logits", T * V * 4, "T·V·4"),
            _minus_grad_storage(T, H, V, e),
        ]
    if provider in _COUNTED:
        lean = "lean" in provider
        n = T if valid_tokens is None else valid_tokens
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= T:
            raise ValueError(f"valid_tokens: expected 0 ≤ valid_tokens ≤ tokens = {T}, got {valid_tokens!r}")
        dense_name = "fusedkern_chunked_lean" if lean else "fusedkern_chunked"
        if provider.endswith("_device_count"):
            # the plan is the dense one (the host does not know n); x is sorted into dX's own storage and
            # put back through idle storage (`compacted.counted_loss_and_grads`)
            out = terms(dense_name, T, H, V, dtype=dtype, chunk_size=chunk_size) + [
                Term("row order and sorted target (int64)", 16 * T, "2·T·8")]
            plan = grad_chunk_plan(T, V, H, e, need_dw=True, fp32_accum=not lean and e < 4, chunk_tokens=chunk_size)
            idle = max(V * H if plan.fp32_accumulator else 0, plan.chunk_tokens * V)
            if idle < T * H:  # dX waits in a copy, made once the C×V buffer is freed
                out.append(Term("copy of dX while it is put back in order, beyond the freed buffer",
                                (T * H - plan.chunk_tokens * V) * e, "(T·H − C·V)·e"))
            return out
        if n in (0, T):  # `num_valid_tokens` of none or of every row: the dense computation
            return terms(dense_name, T, H, V, dtype=dtype, chunk_size=chunk_size)
        # the dense plan over the n valid rows, gathered into dX's own storage (dX is allocated whole, as
        # in the dense path) and put back in order through idle storage (`chunked.chunked_loss_and_grads`)
        return terms(dense_name, n, H, V, dtype=dtype, chunk_size=chunk_size) + [
            Term("row order (T) and gathered target (n), int64", 8 * (T + n), "(T + n)·8")]
    if provider in ("fusedkern_chunked", "fusedkern_chunked_lean"):
        plan = grad_chunk_plan(T, V, H, e, need_dw=True, fp32_accum=provider == "fusedkern_chunked" and e < 4,
                               chunk_tokens=chunk_size)
        rows = plan.chunk_tokens
        chunk = Term(f"reused logits chunk buffer (C = {rows})", rows * V * e, "C·V·e")
        stats = _per_token_stats(T, 3, "loss and (max, log-sum) statistics")
        if not plan.fp32_accumulator:
            # dW is formed in its own storage (lean, fp32 weight, or a single chunk): the buffer is
            # live next to dX and dW
            return [chunk, stats] + _grad_storage(T, H, V, e) + [_minus_grad_storage(T, H, V, e)]
        if plan.buffer_in_dw_storage:
            chunk = Term(f"logits chunk buffer (C = {rows}) inside dW's own storage", 0, "0")
        out = [Term("fp32 dW accumulator", V * H * 4, "V·H·4"), chunk, stats]
        pairs_per_chunk = rows // (2 * seq)
        if op == "simpo" and 1 <= pairs_per_chunk < T // (2 * seq):
            # a chunk of k pairs gathers its chosen and rejected rows into one input (the dW GEMM needs
            # them contiguous); with one chunk for every pair the input already is in that order
            k = pairs_per_chunk
            out.append(Term(f"chunk input: {k} pairs' rows gathered", 2 * k * seq * H * e, "2·k·S·H·e"))
        return out
    if provider == "fusedkern_fused":
        return [
            Term("fp32 accumulator workspace (the kernel's budget)", fused_accumulator_budget(T, V),
                 "16 MiB − (48·T + 8·V + 256 KiB)"),
            _per_token_stats(T, 5, "row coefficients, LSE and loss"),
            Term("fp32 per-class vector", V * 4, "V·4"),
        ]
    if provider in ("liger-kernel 0.8.5", "liger-kernel 0.4.2") and op == "simpo":
        pair = 2 * seq
        return [
            Term(f"fp32 log-softmax of one pair ({pair} tokens)", pair * V * 4, "2·S·V·4"),
            Term("the pair's weight gradient before accumulation", V * H * e, "V·H·e"),
            _per_token_stats(T, 1, "target log-probability"),
        ]
    if provider == "liger-kernel 0.8.5":
        rows = liger_chunk_size(T, H, V, "0.8.5")
        return [
            Term(f"reused logits chunk buffer (C = {rows})", rows * V * e, "C·V·e"),
            _per_token_stats(T, 1, "loss"),
        ]
    if provider == "liger-kernel 0.4.2":
        rows = liger_chunk_size(T, H, V, "0.4.2")
        out = [
            Term(f"logits chunk (C = {rows})", rows * V * e, "C·V·e"),
            Term("previous chunk's gradient, still referenced", rows * V * e, "C·V·e"),
        ]
        if e < 4:
            out.append(Term("fp32 upcast of the chunk", rows * V * 4, "C·V·4"))
        return out + [_per_token_stats(T, 1, "loss")]
    if provider == "cut_cross_entropy":
        return [_per_token_stats(T, 1, "LSE")]
    if provider in ("cublas_3gemm", "cublas_1gemm"):
        return [Term("output of the logits GEMM", T * V * e, "T·V·e")]
    raise ValueError(f"provider: unknown {provider!r}; expected one of {list(PROVIDERS)}")


def peak_extra_bytes(provider: str, tokens: int, hidden: int, vocab: int, **kwargs) -> int:
    """Sum of `terms(...)`, floored at 0 (see `terms` for the arguments)."""
    return max(0, sum(t.nbytes for t in terms(provider, tokens, hidden, vocab, **kwargs)))


def peak_extra_mib(provider: str, tokens: int, hidden: int, vocab: int, **kwargs) -> float:
    """`peak_extra_bytes` in MiB, the unit of the results' `peak_extra_mib` column."""
    return peak_extra_bytes(provider, tokens, hidden, vocab, **kwargs) / MIB


def terms_table(provider: str, tokens: int, hidden: int, vocab: int, **kwargs) -> list[dict]:
    """The terms as rows (term, formula, MiB), ending with the total: ready for a DataFrame."""
    parts = terms(provider, tokens, hidden, vocab, **kwargs)
    rows = [{"term": t.name, "formula": t.formula, "mib": t.mib} for t in parts]
    total = peak_extra_mib(provider, tokens, hidden, vocab, **kwargs)
    rows.append({"term": "peak extra", "formula": "sum, ≥ 0", "mib": total})
    return rows


def vocab_parallel_per_rank(tokens: int, hidden: int, vocab: int, world: int, dtype="bfloat16") -> dict:
    """Bytes per rank of a vocabulary-parallel head (docs/design.md, "Vocabulary parallelism"), V/world rows each.

    exchange: fusedkern's statistics all-reduces of one step; dx: the dX all-reduce (both implementations);
    megatron_exchange: Megatron-LM's three [T] fp32 all-reduces. fusedkern_extra: the single-GPU chunked
    plan's peak extra on the shard; megatron_extra: the plain-PyTorch Megatron-style baseline of
    scripts/bench_vocab_parallel.py (the fp32 upcast of the [T, V_r] logits and the working copy that
    becomes the saved softmax, alive together)."""
    from fusedkern.distributed import exchange_floats_per_token

    _check_sizes(tokens=tokens, hidden=hidden, vocab=vocab, world=world)
    e = element_size(dtype)
    rows = -(-vocab // world)
    plan = grad_chunk_plan(tokens, rows, hidden, e, need_dw=True, fp32_accum=e < 4)
    return dict(
        world_size=world, tokens=tokens, shard_rows=rows, chunk_tokens=plan.chunk_tokens,
        exchange_bytes=exchange_floats_per_token(plan.chunk_tokens, vocab, world) * 4 * tokens,
        megatron_exchange_bytes=3 * 4 * tokens, dx_bytes=tokens * hidden * e,
        fusedkern_extra_bytes=peak_extra_bytes("fusedkern_chunked", tokens, hidden, rows, dtype=dtype),
        megatron_extra_bytes=2 * 4 * tokens * rows,
    )
