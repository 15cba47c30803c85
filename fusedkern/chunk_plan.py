"""How the chunked strategy sizes its logits buffer: pure integer rules, no torch, so that the launchers
(`chunked.py`, `simpo_chunked.py`) and the study's memory model (`study/memory_model.py`) share one definition.

Memory contract (docs/design.md, "Memory"): the extra memory of a forward+backward is at most a
256 MiB logits buffer, plus one fp32 V×H accumulator when dW is accumulated in fp32 for a bf16/fp16
weight; a loss-only forward stays within 64 MiB. Bigger chunks are faster (fewer, larger GEMMs; the
fp32 accumulator is read and written once per chunk), so each plan takes the largest chunk that the
contract allows:

- lean mode, an fp32 weight, or no dW: C = the largest multiple of 64 rows with C·V·e ≤ 256 MiB
  (1024 tokens at V = 128256 in bf16).
- fp32 accumulation and all T tokens fit in 256 MiB + V·H·4 bytes: one chunk and *no accumulator*:
  the single dW GEMM accumulates in fp32 inside cuBLAS and rounds once into dW, the precision of
  fp32 accumulation, and the buffer uses the accumulator's allowance (T ≤ 9216 at 128256 × 4096).
- fp32 accumulation with more tokens: the accumulator, and the buffer *inside dW's own storage*
  (V·H·e bytes, idle until the accumulator is cast into it at the end): C = H tokens (4096), at no
  memory beyond the accumulator.
- the fused strategy (no logits buffer): its fp32 gradient accumulators get what the 16 MiB
  budget leaves after the per-token and per-class vectors (`fused_accumulator_budget`).
- loss only: tiles of C × Vs logits (C tokens × a vocabulary slice) within 64 MiB, with row
  statistics merged across slices; a slice keeps the GEMM compute-bound (a 256 × 128256 chunk would
  re-read all of W for every 256 tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1 << 20
GRAD_CHUNK_BUDGET_BYTES = 256 * MIB  # the logits/gradient buffer when gradients are formed
LOSS_CHUNK_BUDGET_BYTES = 64 * MIB  # the logits buffer of a loss-only forward
CHUNK_MULTIPLE = 64  # rows per chunk are a multiple of 64: whole GEMM tiles
FUSED_EXTRA_BUDGET_BYTES = 16 * MIB  # everything a fused forward+backward allocates beyond inputs and grads
LOSS_TILE_TOKENS = 2048  # token rows of a loss-only tile (the vocabulary slice takes the rest)


def chunk_rows(n_tokens: int, vocab: int, elt: int, budget_bytes: int) -> int:
    """Largest multiple of 64 tokens whose [C, V] logits (elt bytes each) fit `budget_bytes`
    (at least 64, at most n_tokens). 1024 for 256 MiB and 256 for 64 MiB at V = 128256 in bf16."""
    c = max(CHUNK_MULTIPLE, (budget_bytes // (vocab * elt)) // CHUNK_MULTIPLE * CHUNK_MULTIPLE)
    return max(1, min(c, n_tokens))


@dataclass(frozen=True)
class GradChunkPlan:
    """chunk_tokens: C, tokens per chunk (≤ T). fp32_accumulator: dW is summed over chunks in a separate
    fp32 [V, H] buffer (only with several chunks). buffer_in_dw_storage: the [C, V] logits buffer is a
    view of dW's own storage (weight dtype) rather than an allocation."""

    chunk_tokens: int
    fp32_accumulator: bool
    buffer_in_dw_storage: bool


def grad_chunk_plan(n_tokens: int, vocab: int, hidden: int, elt: int, *, need_dw: bool, fp32_accum: bool,
                    chunk_tokens: int | None = None) -> GradChunkPlan:
    """The plan of a forward+backward (see the module docstring).

    elt: bytes per element of the logits and of the weight (they share a dtype). fp32_accum: the caller
    asked for fp32 accumulation *and* the weight is bf16/fp16 (for an fp32 weight dW is fp32 anyway).
    chunk_tokens: the caller's C, or None for the largest the memory contract allows.
    """
    T, V, H = n_tokens, vocab, hidden
    if not (need_dw and fp32_accum):
        C = min(chunk_tokens, T) if chunk_tokens else chunk_rows(T, V, elt, GRAD_CHUNK_BUDGET_BYTES)
        return GradChunkPlan(C, False, False)
    if chunk_tokens:
        C = min(chunk_tokens, T)
    elif T * V * elt <= GRAD_CHUNK_BUDGET_BYTES + V * H * 4:
        C = T
    else:
        in_storage_rows = H // CHUNK_MULTIPLE * CHUNK_MULTIPLE  # C·V·e ≤ V·H·e
        C = min(T, max(chunk_rows(T, V, elt, GRAD_CHUNK_BUDGET_BYTES), in_storage_rows))
    if C >= T:
        return GradChunkPlan(T, False, False)
    return GradChunkPlan(C, True, C <= H)


def loss_tile(n_tokens: int, vocab: int, elt: int, budget_bytes: int = LOSS_CHUNK_BUDGET_BYTES) -> tuple[int, int]:
    """(C, Vs): token rows and vocabulary columns of a loss-only logits tile, C·Vs·elt ≤ budget.

    C = min(T, 2048) rows; Vs = the rest of the budget, a multiple of 64 columns (at most V).
    At V = 128256 in bf16: 2048 × 16384 (64 MiB, 8 slices)."""
    C = min(n_tokens, LOSS_TILE_TOKENS)
    vs = max(CHUNK_MULTIPLE, (budget_bytes // (C * elt)) // CHUNK_MULTIPLE * CHUNK_MULTIPLE)
    return C, min(vs, vocab)


def fused_vector_bytes(n_tokens: int, vocab: int) -> int:
    """Bytes of the fused strategy's O(T + V) vectors, an upper bound: per token, the saved (max,
    log-sum) statistics, loss, lse, three gradient coefficients and their temporaries (≤ 48 bytes);
    per class, the fp32 bias-gradient accumulator and class weights (≤ 8 bytes); plus 256 KiB for the
    small tensors of the launches (docs/design.md, "The fused strategy's roofline", compares it with
    the measured memory)."""
    return 48 * n_tokens + 8 * vocab + 256 * 1024


def fused_accumulator_budget(n_tokens: int, vocab: int, budget_bytes: int = FUSED_EXTRA_BUDGET_BYTES) -> int:
    """Bytes left for the fused backward's fp32 accumulators so that its whole extra memory stays
    within `budget_bytes`: 14.6 MiB at 4096 tokens and 13.3 MiB at 32768 (V = 128256). Never below
    1 MiB (beyond ~300k tokens the vectors alone pass the budget; the accumulators then stay small)."""
    return max(MIB, budget_bytes - fused_vector_bytes(n_tokens, vocab))
