"""Anchored exponentials: the gradient of cross-entropy and of per-token log-probs with no row pass over [C, V].

The chunked strategy writes the logits [C, V], reads them in a row pass, writes the gradient over them and reads it
in the dX and dW GEMMs: ~10–12 bytes of HBM traffic a logit beside the GEMMs, which at hidden 1024 weigh as much as a
third GEMM. Here each row's offset is known before the logits GEMM: the anchor a_t = s_t,y + A (the target's logit
from a gather-dot, `kernels/anchored_rows.target_anchors`). The GEMM's epilogue (`kernels/gluon_anchored_exp`, Gluon on
sm_90; `anchored_rows.producer_reference` in torch elsewhere) writes E = bf16(exp(s − a)) and per-(row, tile) sums of
exp(s − a) in fp32. A row kernel merges the sums in a fixed order (S_t, the loss ℓ_t = log(S_t·e^A), lse, the
entropy), writes the target's element E'[t, y] = e^−A − S_t and the row scale r_t = k·g_t/S_t, so that r ⊙ E' = ∂L/∂z
exactly, and x's rows scaled by r. Then

    dW (+)= E'ᵀ · (r ⊙ X)    (cuBLAS; the engine's fp32 accumulator across chunks)
    dX    = r ⊙ (E' · W)      (cuBLAS with an fp32 result, then one row scale into dX's dtype)

E is written once and read twice: ~6 bytes a logit, and no operand is transformed inside a GEMM (what the retired
Triton consumer GEMMs lost on, docs/design.md). A row whose log-sum-exp exceeds s_y + 86 nats would clamp (E ≤ 2^60):
its flag is exact (S ≥ 2^60), it gets r = 0 in the anchored GEMMs, and a counted exact pass (`exact_rows`: the row-count
GEMMs and the row kernels over the flagged rows only, sorted first and counted on the device, no host sync) computes
its loss and gradient. With no flagged row that pass is a few launches whose programs return at once.

Two uses:
- `anchored_loss_and_grads`: a loss whose upstream is known in the forward (cross-entropy's mean or sum): the
  gradients formed in the forward, three GEMMs, chunked as `anchored_plan` says.
- `AnchoredLogprobs`: per-token log-probs (and the entropy's value) whose upstream arrives in backward: E of every
  token kept from the forward to the backward (T·V·2 bytes, T rounded up by `kept_e_rows`), so the backward is the
  row kernel and two GEMMs — three GEMMs in all, where recomputing the logits takes four. The entropy's gradient is
  not formed here (the caller takes the chunked path for it).

Options: no bias, class weights, label smoothing, z-loss or softcap (those calls take the chunked strategy); a
temperature (logit scale k = 1/τ) is fine. stats: the pair (s_y, ℓ) with lse = stats[0] + stats[1], the same sum as
the chunked strategy's (max, log Σ) but stats[0] is not the row max. with_row_max: the producer also keeps each
(row, tile)'s max of the fp32 accumulator x·w_v (one more partial plane, one FMNMX an element), and `row_max` =
k·max_v x·w_v is the chunked strategy's row max of its fp32 logits (TRL's is_top1 reads it); the flagged rows' from
the exact pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton

from fusedkern._runtime import interpreting
from fusedkern._validation import check_real, finish_checks, start_checks, validate_call
from fusedkern.autograd import first_order_only, rescaled_grads, save_precomputed_grads
from fusedkern.chunk_plan import GRAD_CHUNK_BUDGET_BYTES, LOSS_CHUNK_BUDGET_BYTES, GradChunkPlan
from fusedkern.compacted import chunk_row_counts
from fusedkern.engine import Grads, LossOptions, accumulate_weight_grad, row_kernel_args
from fusedkern.kernels.anchored_rows import (
    SUMS,
    SUMS_AND_E,
    column_tiles,
    entropy_grad_rows,
    e_row_stride,
    finish_rows,
    part_planes,
    producer_reference,
    scale_rows,
    target_anchors,
)
from fusedkern.kernels.ce_rows import ce_rows
from fusedkern.kernels.counted_rows import gather_rows, scatter_rows
from fusedkern.kernels.rowcount_gemm import dw_rows, dx_rows, logits_rows

#: what the E buffer and the fp32 dW accumulator may take together beyond the inputs and the gradients
ANCHORED_EXTRA_BUDGET_BYTES = 2 << 30
#: chunk rows are a multiple of the producer's 128-row tile
CHUNK_MULTIPLE = 128
#: dX's fp32 scratch: the dX GEMM runs over row blocks of a chunk whose fp32 result fits it (1024 rows at hidden
#: 4096), so that it does not grow with the chunk; the exact pass gathers its rows into the same bytes
DX_SCRATCH_BYTES = 16 << 20
#: the per-token vectors and anchors beside the chunk buffers, bytes a token (loss, lse, s_y, r, S, anchor,
#: entropy, row max, flag, the exact pass's order and sorted copies)
ROW_VECTOR_BYTES = 64
#: the exact pass's row-count GEMMs run one config, compiled once and never tuned: they see rare rows (a count of
#: 0 in all but extreme batches), where tuning would time programs that return at once
ROWS_CONFIG = triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "EPI_SLICES": 2},
                            num_warps=8, num_stages=4)

#: producer(x [C, H], w [V, H], anchor [C], parts [planes, C, P], e [C, V] | None, *, logit_scale, epilogue, row_max)
Producer = Callable[..., None]


def default_producer(x: torch.Tensor, w: torch.Tensor) -> Producer:
    """The Gluon kernel where it runs (sm_90, bf16, aligned operands), else the torch reference."""
    if x.is_cuda:
        try:  # Gluon is imported only on CUDA, and only a Triton with its 3.6 API has it
            from fusedkern.kernels import gluon_anchored_exp
        except (ImportError, AttributeError):
            return producer_reference
        if gluon_anchored_exp.unsupported_reason(x, w) is None:
            return gluon_anchored_exp.launch
    return producer_reference


@dataclass(frozen=True)
class AnchoredPlan:
    """chunk_tokens: C · fp32_accumulator: dW summed over chunks in fp32 · e_in_dw_storage: E's [C, V] buffer is a
    view of dW's own storage (idle while the accumulator holds dW)."""

    chunk_tokens: int
    fp32_accumulator: bool
    e_in_dw_storage: bool

    def grad_plan(self) -> GradChunkPlan:
        """The engine's `Grads.allocate` reads its buffers off a `GradChunkPlan`."""
        return GradChunkPlan(self.chunk_tokens, self.fp32_accumulator, self.e_in_dw_storage)


def anchored_plan(n_tokens: int, vocab: int, hidden: int, *, need_dw: bool, fp32_accum: bool,
                  chunk_tokens: int | None = None, budget_bytes: int = ANCHORED_EXTRA_BUDGET_BYTES) -> AnchoredPlan:
    """One chunk when E of every token fits the chunked strategy's allowance (256 MiB + the accumulator it saves);
    else chunks of the most rows whose E and partial sums fit the budget beside the fp32 accumulator, dX's scratch
    and the per-token vectors, or the rows that fit dW's own storage when that is more (hidden 4096: the accumulator
    alone is ~2 GiB; then the partial sums take what the budget leaves), balanced over the chunks."""
    T, V, H = n_tokens, vocab, hidden
    row_bytes = e_row_stride(V) * 2
    parts_row_bytes = column_tiles(V) * 4 * 3  # the sums, the entropy's and the row max's planes at most
    accumulate = need_dw and fp32_accum
    if chunk_tokens:
        C = min(chunk_tokens, T)
    elif T * row_bytes <= GRAD_CHUNK_BUDGET_BYTES + (V * H * 4 if accumulate else 0):
        C = T
    else:
        acc_bytes = V * H * 4 if accumulate else 0
        left = budget_bytes - acc_bytes - DX_SCRATCH_BYTES - T * ROW_VECTOR_BYTES
        most = max(CHUNK_MULTIPLE, left // (row_bytes + parts_row_bytes) // CHUNK_MULTIPLE * CHUNK_MULTIPLE)
        in_storage = (V * H * 2) // row_bytes // CHUNK_MULTIPLE * CHUNK_MULTIPLE if accumulate else 0
        if in_storage > most:  # E lives in dW's storage: the budget holds the partial sums alone
            in_storage = min(in_storage, max(CHUNK_MULTIPLE, left // parts_row_bytes // CHUNK_MULTIPLE
                                             * CHUNK_MULTIPLE))
        most = max(most, in_storage)
        chunks = -(-T // most)
        C = min(most, -(-(-(-T // chunks)) // CHUNK_MULTIPLE) * CHUNK_MULTIPLE)
    if C >= T:
        return AnchoredPlan(T, False, False)
    in_storage = accumulate and C * row_bytes <= V * H * 2
    return AnchoredPlan(C, accumulate, in_storage)


def kept_e_rows(rows: int) -> int:
    """The rows a per-token forward allocates its kept E (and its partial sums) for: `rows` rounded up to a multiple
    of an eighth of the power of two at or below it, at least CHUNK_MULTIPLE (≤ 12.5 % more from 1024 rows on, eight
    sizes an octave). Its rows are a micro-batch's scored tokens, which change from one micro-batch to the next (GRPO's
    completions of random lengths): E of exactly T·V·2 bytes (GBs at a 151936 vocabulary), kept from the forward to
    the backward, would ask the caching allocator for a new size at every call, splitting its cached blocks until a
    request fits none of them (a cudaMalloc, or a flush of the cache and a retry, which synchronizes the device). The
    buffer's first T rows are E's view with the same strides, so no result changes; the rows past T are never read."""
    granule = max(CHUNK_MULTIPLE, (1 << max(rows.bit_length() - 1, 0)) // 8)
    return -(-rows // granule) * granule


def e_buffer(rows: int, vocab: int, like: torch.Tensor, scratch: torch.Tensor | None = None,
             alloc_rows: int | None = None) -> torch.Tensor:
    """E's [rows, V] bf16 view of a buffer with `e_row_stride(V)` per row (TMA's 16-byte rows): in `scratch` (dW's
    own storage) when given, else at the start of a new buffer of max(rows, alloc_rows) rows (`kept_e_rows`)."""
    stride = e_row_stride(vocab)
    if scratch is not None:
        assert scratch.dtype == torch.bfloat16 and scratch.numel() >= rows * stride
        flat = scratch.view(-1)[: rows * stride]
    else:
        flat = torch.empty(max(rows, alloc_rows or 0) * stride, device=like.device,
                           dtype=torch.bfloat16)[: rows * stride]
    return flat.view(rows, stride)[:, :vocab]


def dx_scratch(rows: int, hidden: int, device) -> torch.Tensor:
    """dX's flat fp32 scratch: DX_SCRATCH_BYTES (at least one 128-row block, at most `rows` rows)."""
    block = min(rows, max(CHUNK_MULTIPLE, DX_SCRATCH_BYTES // (hidden * 4) // CHUNK_MULTIPLE * CHUNK_MULTIPLE))
    return torch.empty(block * hidden, device=device, dtype=torch.float32)


def scaled_dx(e: torch.Tensor, w: torch.Tensor, r: torch.Tensor, dx: torch.Tensor, scratch: torch.Tensor) -> None:
    """dx = r ⊙ (E'·W) over row blocks that fit the fp32 `scratch`: one cuBLAS GEMM a block with an fp32 result,
    rounded once into dx's dtype by the row scale."""
    n, H = dx.shape
    block = scratch.numel() // H
    for b0 in range(0, n, block):
        b1 = min(b0 + block, n)
        scale_rows(mm_fp32_out(e[b0:b1], w, scratch[: (b1 - b0) * H].view(b1 - b0, H)), r[b0:b1], dx[b0:b1])


def scratch_rows(scratch: torch.Tensor, most: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """The exact pass's gathered rows [≤ most, H] in `dtype`, over the bytes of dX's scratch (idle by then)."""
    elt = torch.empty(0, dtype=dtype).element_size()
    rows = min(most, scratch.numel() * 4 // (hidden * elt))
    return scratch.view(torch.uint8)[: rows * hidden * elt].view(dtype).view(rows, hidden)


def mm_fp32_out(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = a @ b with fp32 accumulation and an fp32 result (bf16 operands: cuBLAS's mixed-dtype GEMM on CUDA)."""
    if a.is_cuda:
        return torch.ops.aten.mm.dtype_out(a, b, torch.float32, out=out)
    return torch.mm(a.float(), b.float(), out=out)


# ----------------------------------------------------------------------------------------------
# the counted exact pass over the flagged rows


def exact_rows(x, w, target, opts: LossOptions, flagged: torch.Tensor, grad: torch.Tensor | None, *,
               per_token_grad: bool, loss: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor | None,
               dx: torch.Tensor | None, dw: torch.Tensor | None, chunk_tokens: int, buffer: torch.Tensor,
               rows_buffer: torch.Tensor, row_max: torch.Tensor | None = None,
               grad_entropy: torch.Tensor | None = None) -> None:
    """The rows the anchor could not hold, computed exactly with no host sync: flagged [T] int8 rows are sorted
    first and counted on the device; per chunk of `chunk_tokens` sorted rows, the row-count GEMMs and row kernels
    work on the counted rows only (a chunk past the count returns at once). Their loss, lse (and entropy, and row_max:
    the row kernel's max of the tempered logits) replace the anchored ones; with grad (∂L/∂ℓ: [1] shared, or [T]
    with per_token_grad) their dW adds into `dw` (the accumulator or dW itself) and their dX rows are written into
    `dx`. buffer: a [≥ C, V] logits buffer (E's, idle by now; any row stride); rows_buffer: [≥ C, H] in x's dtype."""
    T = x.shape[0]
    flag = flagged.bool()
    order = torch.argsort((~flag).to(torch.uint8), stable=True)
    count = flag.sum(dtype=torch.int32).reshape(1)
    C = chunk_tokens
    counts = chunk_row_counts(count, T, C)
    loss_s = torch.zeros(T, device=x.device, dtype=torch.float32)
    stats_s = torch.zeros((2, T), device=x.device, dtype=torch.float32)
    entropy_s = None if entropy is None else torch.zeros(T, device=x.device, dtype=torch.float32)
    target_s = target.index_select(0, order)
    grad_s = grad.index_select(0, order) if grad is not None and per_token_grad else grad
    # ∂L/∂H_t [T] with a per-token grad: the flagged rows' entropy term, formed beside their loss's
    grad_entropy_s = None if grad_entropy is None else grad_entropy.index_select(0, order)
    kernel_args = row_kernel_args(None, opts)
    config = None if interpreting() else ROWS_CONFIG  # the interpreter runs its own small config
    for i, c0 in enumerate(range(0, T, C)):
        c1 = min(c0 + C, T)
        n_i = counts[i:i + 1]
        idx = order[c0:c1]
        xb = gather_rows(x, idx, n_i, rows_buffer[: c1 - c0])
        z = buffer[: c1 - c0]
        logits_rows(xb, w, None, n_i, z, config=config)
        ce_rows(z, target_s[c0:c1], loss=loss_s[c0:c1], stats=stats_s[:, c0:c1],
                grad=None if grad is None else (grad_s[c0:c1] if per_token_grad else grad_s),
                compute_stats=True, per_token_grad=per_token_grad and grad is not None, row_count=n_i,
                entropy=None if entropy_s is None else entropy_s[c0:c1],
                grad_entropy=None if grad_entropy_s is None or grad is None else grad_entropy_s[c0:c1], **kernel_args)
        if grad is None:
            continue
        if dw is not None:  # before dX: dX's GEMM writes over the gathered rows
            dw_rows(z, xb, n_i, dw, accumulate=True, config=config)
        if dx is not None:
            dx_rows(z, w, n_i, xb, config=config)
            scatter_rows(xb, idx, n_i, dx, None)
    inverse = torch.argsort(order)
    loss.copy_(torch.where(flag, loss_s.index_select(0, inverse), loss))
    lse.copy_(torch.where(flag, (stats_s[0] + stats_s[1]).index_select(0, inverse), lse))
    if entropy is not None:
        entropy.copy_(torch.where(flag, entropy_s.index_select(0, inverse), entropy))
    if row_max is not None:
        row_max.copy_(torch.where(flag, stats_s[0].index_select(0, inverse), row_max))


# ----------------------------------------------------------------------------------------------
# the pass with the gradient formed in the forward


@dataclass
class AnchoredResult:
    """loss [T] fp32 (ℓ_t, 0 where ignored) · lse [T] fp32 · s_y [T] fp32 · entropy [T] fp32 or None · flagged [T]
    int8 · sums [T] fp32 (S_t) · grads: the engine's `Grads` (dx, dw: the fp32 accumulator or dW, dw_out), or None ·
    row_max [T] fp32 (max_v s_v of the tempered logits, 0 where ignored) when asked for (with_row_max), else None."""

    loss: torch.Tensor
    lse: torch.Tensor
    s_y: torch.Tensor
    entropy: torch.Tensor | None
    flagged: torch.Tensor
    sums: torch.Tensor
    grads: Grads | None
    row_max: torch.Tensor | None = None


def _row_vectors(T: int, device, with_entropy: bool, with_row_max: bool):
    """loss, lse, r, entropy (or None), flagged (int8), row_max (or None): [T] each."""
    def f32():
        return torch.empty(T, device=device, dtype=torch.float32)

    return (f32(), f32(), f32(), (f32() if with_entropy else None), torch.empty(T, device=device, dtype=torch.int8),
            f32() if with_row_max else None)


def anchored_loss_and_grads(x: torch.Tensor, w: torch.Tensor, target: torch.Tensor, opts: LossOptions,
                            grad: torch.Tensor, *, per_token_grad: bool = False, need_dx: bool, need_dw: bool,
                            plan: AnchoredPlan, producer: Producer | None = None,
                            with_entropy: bool = False, with_row_max: bool = False) -> AnchoredResult:
    """Loss, statistics and the gradients of Σ_t g_t·ℓ_t in one pass (three GEMMs), g = grad ([1] shared or [T] with
    per_token_grad, fp32 on x's device), chunked by `plan`. x [T, H], w [V, H] bf16 (fp16/fp32 on the reference
    producer), target [T]. The caller casts an fp32 accumulator into dW (`Grads.weight_grad`) and rescales."""
    T, H = x.shape
    V = w.shape[0]
    producer = producer or default_producer(x, w)
    s_y, anchor = target_anchors(x, w, target, ignore_index=opts.ignore_index, logit_scale=opts.logit_scale)
    grads = Grads.allocate(x, w, None, need_dx, need_dw, False, plan.grad_plan())
    C = plan.chunk_tokens
    e_all = e_buffer(C, V, x, grads.scratch)
    parts = torch.empty((part_planes(entropy=with_entropy, row_max=with_row_max), C, column_tiles(V)), device=x.device,
                        dtype=torch.float32)
    sums = torch.empty(T, device=x.device, dtype=torch.float32)
    loss, lse, r, entropy, flagged, row_max = _row_vectors(T, x.device, with_entropy, with_row_max)
    # r ⊙ x lives in dX's own rows of the chunk (dW's GEMM reads it before dX's overwrites it); dX's fp32 result
    # goes through a scratch of DX_SCRATCH_BYTES, one block of rows at a time, whose bytes also hold the exact pass's
    # gathered rows
    scratch = dx_scratch(C, H, x.device)
    sx_own = None if need_dx or not need_dw else torch.empty((C, H), device=x.device, dtype=x.dtype)
    for i, c0 in enumerate(range(0, T, C)):
        c1 = min(c0 + C, T)
        n = c1 - c0
        e = e_all[:n]
        sx = grads.dx[c0:c1] if need_dx else (sx_own[:n] if need_dw else None)
        producer(x[c0:c1], w, anchor[c0:c1], parts[:, :n], e, logit_scale=opts.logit_scale, epilogue=SUMS_AND_E,
                 row_max=with_row_max)
        finish_rows(parts[:, :n], s_y[c0:c1], target[c0:c1], V, ignore_index=opts.ignore_index, sums=sums[c0:c1],
                    loss=loss[c0:c1], lse=lse[c0:c1], flagged=flagged[c0:c1],
                    entropy=None if entropy is None else entropy[c0:c1],
                    grad=grad[c0:c1] if per_token_grad else grad, r=r[c0:c1], e=e, x=x[c0:c1],
                    sx=sx if need_dw else None, logit_scale=opts.logit_scale,
                    row_max=None if row_max is None else row_max[c0:c1])
        if need_dw:
            accumulate_weight_grad(grads.dw, e, sx, first=i == 0)
        if need_dx:
            scaled_dx(e, w, r[c0:c1], grads.dx[c0:c1], scratch)
    rows_buffer = scratch_rows(scratch, C, H, x.dtype)
    exact_rows(x, w, target, opts, flagged, grad, per_token_grad=per_token_grad, loss=loss, lse=lse, entropy=entropy,
               dx=grads.dx, dw=grads.dw, chunk_tokens=rows_buffer.shape[0], buffer=e_all, rows_buffer=rows_buffer,
               row_max=row_max)
    return AnchoredResult(loss, lse, s_y, entropy, flagged, sums, grads, row_max)


# ----------------------------------------------------------------------------------------------
# no gradient: the partial sums alone


def loss_only(x: torch.Tensor, w: torch.Tensor, target: torch.Tensor, opts: LossOptions, *,
              producer: Producer | None = None, with_entropy: bool = False,
              chunk_tokens: int | None = None, with_row_max: bool = False) -> AnchoredResult:
    """Loss, lse (and the entropy) with no gradient: the producer's epilogue keeps its partial sums and writes no E
    (one GEMM's work beside a gather-dot and a row kernel), in launches whose partials stay within the loss-only
    pass's 64 MiB; the flagged rows by the exact pass over a logits buffer within the chunked strategy's 256 MiB."""
    T, H = x.shape
    V = w.shape[0]
    producer = producer or default_producer(x, w)
    s_y, anchor = target_anchors(x, w, target, ignore_index=opts.ignore_index, logit_scale=opts.logit_scale)
    planes = part_planes(entropy=with_entropy, row_max=with_row_max)
    C = chunk_tokens or max(CHUNK_MULTIPLE, LOSS_CHUNK_BUDGET_BYTES // (column_tiles(V) * 4 * planes))
    C = min(T, C)
    parts = torch.empty((planes, C, column_tiles(V)), device=x.device, dtype=torch.float32)
    sums = torch.empty(T, device=x.device, dtype=torch.float32)
    loss, lse, _, entropy, flagged, row_max = _row_vectors(T, x.device, with_entropy, with_row_max)
    for c0 in range(0, T, C):
        c1 = min(c0 + C, T)
        producer(x[c0:c1], w, anchor[c0:c1], parts[:, : c1 - c0], None, logit_scale=opts.logit_scale,
                 epilogue=SUMS, row_max=with_row_max)
        finish_rows(parts[:, : c1 - c0], s_y[c0:c1], target[c0:c1], V, ignore_index=opts.ignore_index,
                    sums=sums[c0:c1], loss=loss[c0:c1], lse=lse[c0:c1], flagged=flagged[c0:c1],
                    entropy=None if entropy is None else entropy[c0:c1], logit_scale=opts.logit_scale,
                    row_max=None if row_max is None else row_max[c0:c1])
    del parts
    Cf = min(T, max(CHUNK_MULTIPLE, GRAD_CHUNK_BUDGET_BYTES // (e_row_stride(V) * 2)))
    exact_rows(x, w, target, opts, flagged, None, per_token_grad=False, loss=loss, lse=lse, entropy=entropy, dx=None,
               dw=None, chunk_tokens=Cf, buffer=e_buffer(Cf, V, x),
               rows_buffer=torch.empty((Cf, H), device=x.device, dtype=x.dtype), row_max=row_max)
    return AnchoredResult(loss, lse, s_y, entropy, flagged, sums, None, row_max)


# ----------------------------------------------------------------------------------------------
# per-token log-probs: E kept from the forward to the backward


def logprobs_forward(x: torch.Tensor, w: torch.Tensor, target: torch.Tensor, opts: LossOptions, *,
                     producer: Producer | None = None, with_entropy: bool = False, with_row_max: bool = False):
    """The forward of `AnchoredLogprobs`: E of every token [T, V] (kept), and an `AnchoredResult` without gradients
    (the flagged rows' statistics from the counted exact pass)."""
    T, H = x.shape
    V = w.shape[0]
    producer = producer or default_producer(x, w)
    s_y, anchor = target_anchors(x, w, target, ignore_index=opts.ignore_index, logit_scale=opts.logit_scale)
    # both T-sized buffers at a rounded size (`kept_e_rows`): the views below have the strides of exact ones
    alloc = kept_e_rows(T)
    e = e_buffer(T, V, x, alloc_rows=alloc)
    planes, P = part_planes(entropy=with_entropy, row_max=with_row_max), column_tiles(V)
    parts = torch.empty(planes * alloc * P, device=x.device, dtype=torch.float32)[: planes * T * P].view(planes, T, P)
    sums = torch.empty(T, device=x.device, dtype=torch.float32)
    loss, lse, _, entropy, flagged, row_max = _row_vectors(T, x.device, with_entropy, with_row_max)
    producer(x, w, anchor, parts, e, logit_scale=opts.logit_scale, epilogue=SUMS_AND_E, row_max=with_row_max)
    finish_rows(parts, s_y, target, V, ignore_index=opts.ignore_index, sums=sums, loss=loss, lse=lse,
                flagged=flagged, entropy=entropy, logit_scale=opts.logit_scale, row_max=row_max)
    del parts
    # E is kept: the exact pass gets a logits buffer of its own, within the chunked strategy's 256 MiB
    C = min(T, max(CHUNK_MULTIPLE, GRAD_CHUNK_BUDGET_BYTES // (e_row_stride(V) * 2)))
    exact_rows(x, w, target, opts, flagged, None, per_token_grad=False, loss=loss, lse=lse, entropy=entropy, dx=None,
               dw=None, chunk_tokens=C, buffer=e_buffer(C, V, x),
               rows_buffer=torch.empty((C, H), device=x.device, dtype=x.dtype), row_max=row_max)
    return e, AnchoredResult(loss, lse, s_y, entropy, flagged, sums, None, row_max)


def logprobs_backward(x: torch.Tensor, w: torch.Tensor, target: torch.Tensor, opts: LossOptions, e: torch.Tensor,
                      res: AnchoredResult, grad_loss: torch.Tensor, *, need_dx: bool, need_dw: bool,
                      grad_entropy: torch.Tensor | None = None):
    """The gradients of Σ_t g_t·ℓ_t (g = grad_loss [T] fp32) from the kept E: the row kernel (the target's element,
    r, r ⊙ x), dW = E'ᵀ·(r ⊙ X) in one GEMM over every token, dX = r ⊙ (E'·W); the flagged rows by the counted exact
    pass (over E's storage, which it no longer needs). Returns (dx, dw) in the inputs' dtypes (None where not
    wanted). grad_entropy: [T] fp32 ∂L/∂H_t (the forward kept the entropy): E is replaced by the whole ∂L/∂z in one
    pass over it (`entropy_grad_rows`), and the GEMMs read it with no row scale."""
    T, H = x.shape
    V = w.shape[0]
    if grad_entropy is not None:
        return _entropy_backward(x, w, target, opts, e, res, grad_loss, grad_entropy, need_dx=need_dx,
                                 need_dw=need_dw)
    r = torch.empty(T, device=x.device, dtype=torch.float32)
    dx = torch.empty_like(x) if need_dx else None
    sx = dx if need_dx else torch.empty_like(x)  # r ⊙ x in dX's own storage: dW's GEMM reads it before dX's writes
    finish_rows(None, res.s_y, target, V, ignore_index=opts.ignore_index, sums=res.sums, grad=grad_loss, r=r, e=e,
                x=x, sx=sx if need_dw else None, logit_scale=opts.logit_scale)
    # one GEMM over every token: fp32 inside cuBLAS, rounded once into dW's dtype (the flagged rows, if any, add to it)
    dw = torch.mm(e.t(), sx) if need_dw else None
    scratch = dx_scratch(T, H, x.device)
    if need_dx:
        scaled_dx(e, w, r, dx, scratch)
    # E is dead once both GEMMs have read it: the exact pass's logits buffer over its storage
    loss, lse = res.loss.clone(), res.lse.clone()  # the exact pass rewrites the flagged rows' values: the same bits
    rows_buffer = scratch_rows(scratch, T, H, x.dtype)
    exact_rows(x, w, target, opts, res.flagged, grad_loss, per_token_grad=True, loss=loss, lse=lse, entropy=None,
               dx=dx, dw=dw, chunk_tokens=rows_buffer.shape[0], buffer=e, rows_buffer=rows_buffer)
    return dx, dw


def _entropy_backward(x, w, target, opts: LossOptions, e, res: AnchoredResult, grad_loss, grad_entropy, *,
                      need_dx: bool, need_dw: bool):
    """`logprobs_backward` with the entropy's term: ∂L/∂z written over E, dW = Eᵀ·X and dX = E·W (cuBLAS, fp32
    inside, one rounding each), the flagged rows by the exact pass with both terms."""
    entropy_grad_rows(e, res.sums, res.loss, res.entropy, target, grad_loss, grad_entropy,
                      ignore_index=opts.ignore_index, logit_scale=opts.logit_scale)
    dw = torch.mm(e.t(), x) if need_dw else None
    dx = torch.mm(e, w) if need_dx else None
    scratch = dx_scratch(x.shape[0], x.shape[1], x.device)
    rows_buffer = scratch_rows(scratch, x.shape[0], x.shape[1], x.dtype)
    loss, lse, entropy = res.loss.clone(), res.lse.clone(), res.entropy.clone()
    exact_rows(x, w, target, opts, res.flagged, grad_loss, per_token_grad=True, loss=loss, lse=lse, entropy=entropy,
               dx=dx, dw=dw, chunk_tokens=rows_buffer.shape[0], buffer=e, rows_buffer=rows_buffer,
               grad_entropy=grad_entropy)
    return dx, dw


class AnchoredLogprobs(torch.autograd.Function):
    """forward(x [T, H], w [V, H], target [T], opts, with_entropy, producer, with_row_max=False) → (logp [T] fp32,
    entropy [T] fp32 or [0], stats [2, T] fp32, not differentiable: `row_stats`). E of every token is kept to the
    backward (three GEMMs in all), a gradient into the entropy too (one more pass over E: `entropy_grad_rows`)."""

    @staticmethod
    def forward(ctx, x, w, target, opts: LossOptions, with_entropy: bool, producer, with_row_max: bool = False):
        e, res = logprobs_forward(x, w, target, opts, producer=producer, with_entropy=with_entropy,
                                  with_row_max=with_row_max)
        stats = row_stats(res)
        entropy = res.entropy if with_entropy else res.loss.new_empty(0)
        ctx.save_for_backward(x, w, target, e, stats, entropy)
        ctx.res, ctx.opts, ctx.used = res, opts, False
        ctx.mark_non_differentiable(stats)
        ctx.set_materialize_grads(False)
        return -res.loss, entropy, stats

    @staticmethod
    @first_order_only
    def backward(ctx, grad_logp, grad_entropy, _grad_stats):
        if ctx.used:
            raise RuntimeError("AnchoredLogprobs supports one backward pass (its kept E is rewritten in place)")
        ctx.used = True
        x, w, target, e, stats, entropy = ctx.saved_tensors
        if grad_logp is None and grad_entropy is None:
            return None, None, None, None, None, None, None
        need_dx, need_dw = ctx.needs_input_grad[:2]
        grad_loss = stats.new_zeros(stats.shape[1]) if grad_logp is None else -grad_logp.float().contiguous()
        with_entropy = grad_entropy is not None and entropy.numel() > 0
        dx, dw = logprobs_backward(x, w, target, ctx.opts, e, ctx.res, grad_loss, need_dx=need_dx, need_dw=need_dw,
                                   grad_entropy=grad_entropy.float().contiguous() if with_entropy else None)
        return dx, dw, None, None, None, None, None


def kept_logprobs(x2d, w, y, opts: LossOptions, with_entropy: bool, checks=(None, None, -1),
                  with_row_max: bool = False):
    """(−log p [T], entropy [T] or [0], stats [2, T]: `row_stats`) through `AnchoredLogprobs` (E kept to the
    backward); checks: `start_checks`' (whole_target, count, count_int)."""
    started = start_checks(y, w.shape[0], opts.ignore_index, *checks)
    logp, entropy, stats = AnchoredLogprobs.apply(x2d, w, y, opts, with_entropy, None, with_row_max)
    finish_checks(started)
    return -logp, entropy, stats


def row_stats(res: AnchoredResult) -> torch.Tensor:
    """[2, T] fp32 row statistics whose sum is the lse, shaped as the chunked strategy's (max, log Σ exp(s − max)):
    (max, lse − max) when the row max was formed, else (s_y, ℓ). Either way p_v = exp((s_v − stats[0]) − stats[1])
    to fp32 rounding, which is what a recomputed gradient reads."""
    first = res.s_y if res.row_max is None else res.row_max
    return torch.stack((first, res.lse - first))


# ----------------------------------------------------------------------------------------------
# the entry points


class AnchoredCrossEntropy(torch.autograd.Function):
    """forward(x [T, H], w [V, H], target [T], opts, reduction ("mean" / "sum"), weight_grad_accum, chunk_tokens,
    producer, checks) → (loss 0-d fp32, lse [T] fp32, not differentiable): the gradients formed in the forward for
    an upstream of 1, rescaled in backward. checks: `start_checks`' (whole_target, count, count_int) for a call
    whose rows were gathered or counted by the caller; None: the target's own range check. The mean is Σℓ / N as
    every strategy forms it, so a call with and one without gradients give the same bits."""

    @staticmethod
    def forward(ctx, x, w, target, opts: LossOptions, reduction: str, weight_grad_accum: str, chunk_tokens,
                producer, checks=None):
        checks = start_checks(target, w.shape[0], opts.ignore_index, *(checks or (None, None, -1)))
        valid = (target != opts.ignore_index).sum(dtype=torch.float32).reshape(1)
        grad = 1.0 / valid if reduction == "mean" else torch.ones(1, device=x.device, dtype=torch.float32)
        need_dx, need_dw = ctx.needs_input_grad[:2]
        fp32_accum = weight_grad_accum == "fp32" and w.dtype != torch.float32
        plan = anchored_plan(x.shape[0], w.shape[0], w.shape[1], need_dw=need_dw, fp32_accum=fp32_accum,
                             chunk_tokens=chunk_tokens)
        res = anchored_loss_and_grads(x, w, target, opts, grad, need_dx=need_dx, need_dw=need_dw, plan=plan,
                                      producer=producer)
        grads = res.grads
        save_precomputed_grads(ctx, x, w, None, grads.dx, grads.dw, None, grads.dw_out)
        finish_checks(checks)
        ctx.mark_non_differentiable(res.lse)
        loss = res.loss.sum() / valid[0] if reduction == "mean" else res.loss.sum()
        return loss, res.lse

    @staticmethod
    @first_order_only
    def backward(ctx, grad_loss, _grad_lse):
        dx, dw, _ = rescaled_grads(ctx, grad_loss, "anchored_cross_entropy")
        return dx, dw, None, None, None, None, None, None, None


def _validated(input, linear_weight, target, *, reduction, ignore_index, temperature, weight_grad_accum,
               chunk_tokens):
    validate_call(input, linear_weight, target, None, reduction=reduction, ignore_index=ignore_index,
                  impl="chunked", weight_grad_accum=weight_grad_accum, chunk_tokens=chunk_tokens)
    check_real("temperature", temperature, low=0.0, low_inclusive=False)
    x2d = input.reshape(-1, input.shape[-1])
    if x2d.stride(-1) != 1 or x2d.stride(0) != x2d.shape[1]:
        x2d = x2d.contiguous()
    return x2d, linear_weight.contiguous(), target.reshape(-1).contiguous()


def anchored_cross_entropy(input: torch.Tensor, linear_weight: torch.Tensor, target: torch.Tensor, *,
                           reduction: str = "mean", ignore_index: int = -100, weight_grad_accum: str = "fp32",
                           chunk_tokens: int | None = None, producer: Producer | None = None,
                           return_lse: bool = False):
    """Cross-entropy of input [..., H] · linear_weight [V, H]ᵀ against target [...] on anchored exponentials (module
    docstring): mean or sum with the gradients formed in the forward (three GEMMs); "none" through
    `AnchoredLogprobs` (E kept to the backward). No bias, class weights, smoothing, z-loss or softcap. producer: the
    logits GEMM (default: the Gluon kernel where it runs, else the torch reference)."""
    x2d, w, y = _validated(input, linear_weight, target, reduction=reduction, ignore_index=ignore_index,
                           temperature=1.0, weight_grad_accum=weight_grad_accum, chunk_tokens=chunk_tokens)
    opts = LossOptions(ignore_index)
    if not (torch.is_grad_enabled() and (x2d.requires_grad or w.requires_grad)):
        checks = start_checks(y, w.shape[0], ignore_index, None, None, -1)
        res = loss_only(x2d, w, y, opts, producer=producer, chunk_tokens=chunk_tokens)
        finish_checks(checks)
        loss = res.loss.reshape(target.shape)
        if reduction != "none":
            loss = loss.sum() / (y != ignore_index).sum() if reduction == "mean" else loss.sum()
        return (loss, res.lse.reshape(target.shape)) if return_lse else loss
    if reduction == "none":
        checks = start_checks(y, w.shape[0], ignore_index, None, None, -1)
        logp, _, stats = AnchoredLogprobs.apply(x2d, w, y, opts, False, producer)
        lse = stats[0] + stats[1]
        finish_checks(checks)
        loss = (-logp).reshape(target.shape)
    else:
        loss, lse = AnchoredCrossEntropy.apply(x2d, w, y, opts, reduction, weight_grad_accum, chunk_tokens, producer)
    return (loss, lse.reshape(target.shape)) if return_lse else loss


def anchored_logprobs(input: torch.Tensor, linear_weight: torch.Tensor, target: torch.Tensor, *,
                      ignore_index: int = -100, temperature: float = 1.0, return_entropy: bool = False,
                      producer: Producer | None = None):
    """(logp [...] fp32 of softmax(s/τ) at the target, 0 where ignored; the entropy [...] fp32 or None, a value with
    no gradient; lse [...] fp32) on anchored exponentials, E of every token kept from forward to backward: three
    GEMMs with a gradient (module docstring)."""
    x2d, w, y = _validated(input, linear_weight, target, reduction="none", ignore_index=ignore_index,
                           temperature=temperature, weight_grad_accum="fp32", chunk_tokens=None)
    if not isinstance(return_entropy, bool):
        raise TypeError(f"return_entropy must be a bool, got {type(return_entropy).__name__}")
    checks = start_checks(y, w.shape[0], ignore_index, None, None, -1)
    opts = LossOptions(ignore_index, logit_scale=1.0 / float(temperature))
    if torch.is_grad_enabled() and (x2d.requires_grad or w.requires_grad):
        logp, entropy, stats = AnchoredLogprobs.apply(x2d, w, y, opts, return_entropy, producer)
        lse = stats[0] + stats[1]
    else:  # no gradient: no E
        res = loss_only(x2d, w, y, opts, producer=producer, with_entropy=return_entropy)
        logp, entropy, lse = -res.loss, res.entropy, res.lse
    finish_checks(checks)
    lead = target.shape
    return logp.reshape(lead), entropy.reshape(lead) if return_entropy else None, lse.reshape(lead)
