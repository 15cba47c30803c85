"""The chunk engine: the one loop under every chunked loss.

Per chunk of C token rows:  Z = X_c Wᵀ (+ b) into one reused [C, V] buffer → a *row pass* reads Z (the loss's
row statistics) and, when gradients are formed, overwrites it in place with G = ∂L/∂Z → dW (+)= Gᵀ X_c (the fp32
accumulator of `chunk_plan.py`) → dX_c = G W (→ db += Σ G). What differs between losses is only the row pass:

- `CrossEntropyRows`: the row kernels of `kernels/ce_rows.py` with an upstream gradient known per token or shared
  by every token (cross-entropy, log-probs, the entropy).
- `FormulaRows`: a loss given as a *formula* of the per-token log-probs (GRPO per token, the preference family
  per sequence or per pair): row statistics → log-probs → the formula's ∂L/∂logp for the chunk's rows → the
  in-place gradient. Exact when every row the formula couples lives in the same chunk (`group_chunks`).
- distillation (`distillation.py`) and the vocabulary shards (`distributed.py`) bring their own row pass.

And what differs between strategies is the GEMMs: `CublasGemms` (cuBLAS, every row), or the row-count GEMMs of
`kernels/rowcount_gemm.py` that skip the rows past a device-side count (`compacted.py`).

A loss-only pass may also split the vocabulary (`vocab_tile`): each chunk's logits are then formed one [C, Vs]
tile at a time in a buffer of that size, a *tiled row pass* (`CrossEntropyTiles`) takes each tile's partial row
statistics, and merges them once the chunk's last tile is done. No gradient is formed there: a tile's ∂L/∂Z needs
the statistics of every tile of its rows.

A chunk may gather several blocks of rows (a chosen and a rejected response of the same pairs); dX is written back
block by block, so it keeps x's order. dW's GEMM runs before dX's: a caller may pass x's rows living in dX's own
storage (`chunked.chunked_loss_and_grads` with `rows`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from fusedkern.chunk_plan import GradChunkPlan, grad_chunk_plan
from fusedkern.kernels.ce_rows import ce_rows, merge_row_stats, row_stats_tile, tile_partials


@dataclass(frozen=True)
class LossOptions:
    """The per-token loss of docs/design.md: ε, z-loss, softcap, ignore_index; logit_scale multiplies the
    softcapped logits in fp32 inside the row kernels (1/τ of a sampling temperature)."""

    ignore_index: int = -100
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    softcap: float | None = None
    logit_scale: float = 1.0


# ----------------------------------------------------------------------------------------------
# chunks


@dataclass(frozen=True)
class Chunk:
    """The token rows of one chunk: `blocks`, slices of x's rows, in the order the chunk holds them."""

    index: int
    blocks: tuple[slice, ...]

    @property
    def n_rows(self) -> int:
        return sum(s.stop - s.start for s in self.blocks)

    @property
    def rows(self) -> slice:
        """The chunk's rows as one slice (a chunk of one block, or of adjacent blocks)."""
        if not self.contiguous:
            raise ValueError("a chunk of separate blocks has no single row slice")
        return slice(self.blocks[0].start, self.blocks[-1].stop)

    @property
    def contiguous(self) -> bool:
        return all(a.stop == b.start for a, b in zip(self.blocks, self.blocks[1:]))

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """t's rows of this chunk along dim 0: a view when the blocks are adjacent, else a gathered copy."""
        if self.contiguous:
            return t[self.rows]
        return torch.cat([t[s] for s in self.blocks])

    def scatter(self, dst: torch.Tensor, values: torch.Tensor) -> None:
        """dst[rows of this chunk] = values (values in the chunk's row order)."""
        offset = 0
        for s in self.blocks:
            n = s.stop - s.start
            dst[s] = values[offset:offset + n]
            offset += n


def valid_rows_first(target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Row indices with every non-ignored row first, in order (a stable sort on the device: no host sync)."""
    return torch.argsort((target == ignore_index).to(torch.uint8), stable=True)


def token_chunks(n_tokens: int, chunk_tokens: int) -> list[Chunk]:
    """Consecutive chunks of `chunk_tokens` rows (the last one shorter)."""
    return [Chunk(i, (slice(c0, min(c0 + chunk_tokens, n_tokens)),))
            for i, c0 in enumerate(range(0, n_tokens, chunk_tokens))]


def group_chunks(n_groups: int, groups_per_chunk: int, seq: int, paired: bool) -> list[Chunk]:
    """Chunks of whole groups of `seq` rows: a group is one sequence, or (paired) a chosen sequence g and its
    rejected partner n_groups + g, laid out [chosen 0..n−1, rejected 0..n−1]. A chunk holds groups i0..i1−1: their
    chosen rows, then their rejected rows."""
    chunks = []
    for i, g0 in enumerate(range(0, n_groups, groups_per_chunk)):
        g1 = min(g0 + groups_per_chunk, n_groups)
        blocks = [slice(g0 * seq, g1 * seq)]
        if paired:
            blocks.append(slice((n_groups + g0) * seq, (n_groups + g1) * seq))
        chunks.append(Chunk(i, tuple(blocks)))
    return chunks


# ----------------------------------------------------------------------------------------------
# buffers


def plan_for_grads(n_tokens: int, w: torch.Tensor, need_dw: bool, weight_grad_accum: str,
                   chunk_tokens: int | None) -> GradChunkPlan:
    """`chunk_plan.grad_chunk_plan` for this weight: fp32 accumulation only applies to a bf16/fp16 weight."""
    vocab, hidden = w.shape
    fp32_accum = weight_grad_accum == "fp32" and w.dtype != torch.float32
    return grad_chunk_plan(n_tokens, vocab, hidden, w.element_size(), need_dw=need_dw, fp32_accum=fp32_accum,
                           chunk_tokens=chunk_tokens)


def logits_buffer(rows: int, vocab: int, like: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """The reused [rows, V] buffer in `like`'s dtype: a view of `scratch` (dW's own storage, idle while
    an fp32 accumulator collects dW) when given, else a new allocation."""
    if scratch is not None:
        assert scratch.dtype == like.dtype and scratch.numel() >= rows * vocab
        return scratch.view(-1)[: rows * vocab].view(rows, vocab)
    return torch.empty((rows, vocab), device=like.device, dtype=like.dtype)


@dataclass
class Grads:
    """The gradients a pass forms: dx [T, H] (x's dtype) · dw [V, H]: the fp32 accumulator when
    `plan.fp32_accumulator`, else dW itself in the weight's dtype · db [V] fp32 · dw_out: dW's own storage in the
    weight's dtype when dw is the fp32 accumulator (also the logits buffer's home when
    `plan.buffer_in_dw_storage`), else None. Each is None when not wanted."""

    dx: torch.Tensor | None
    dw: torch.Tensor | None
    db: torch.Tensor | None
    dw_out: torch.Tensor | None
    plan: GradChunkPlan

    @classmethod
    def allocate(cls, x, w, b, need_dx: bool, need_dw: bool, need_db: bool, plan: GradChunkPlan) -> Grads:
        dx = torch.empty_like(x) if need_dx else None
        dw = dw_out = None
        if need_dw:
            dw = torch.empty(w.shape, device=w.device, dtype=torch.float32 if plan.fp32_accumulator else w.dtype)
            if plan.fp32_accumulator:
                dw_out = torch.empty_like(w, memory_format=torch.contiguous_format)  # viewed flat as the buffer
        db = torch.zeros(w.shape[0], device=w.device, dtype=torch.float32) if need_db and b is not None else None
        return cls(dx, dw, db, dw_out, plan)

    @property
    def scratch(self) -> torch.Tensor | None:
        """Storage for the logits buffer, or None to allocate one (`logits_buffer`)."""
        return self.dw_out if self.plan.buffer_in_dw_storage else None

    @property
    def wanted(self) -> bool:
        return self.dx is not None or self.dw is not None or self.db is not None

    def as_tuple(self):
        return self.dx, self.dw, self.db, self.dw_out

    def weight_grad(self) -> torch.Tensor | None:
        """dW in the weight's dtype (cast from the accumulator into dW's own storage when there is one)."""
        return self.dw if self.dw_out is None else self.dw_out.copy_(self.dw)


def accumulate_weight_grad(acc: torch.Tensor, g: torch.Tensor, x_c: torch.Tensor, first: bool) -> None:
    """acc (+)= gᵀ x_c.  (V, C) @ (C, H) → (V, H); acc may be fp32 while g, x_c are bf16/fp16."""
    gt = g.t()
    if acc.dtype == g.dtype:
        if first:
            torch.mm(gt, x_c, out=acc)
        else:
            acc.addmm_(gt, x_c)
    elif acc.is_cuda:
        # cuBLAS: bf16 operands, fp32 accumulate *and* fp32 C/D, β = 1 — no fp32 copy of g or x_c
        if first:
            torch.ops.aten.mm.dtype_out(gt, x_c, torch.float32, out=acc)
        else:
            torch.ops.aten.addmm.dtype_out(acc, gt, x_c, torch.float32, out=acc)
    else:  # CPU (tests): no mixed-dtype GEMM there; same math, upcast operands
        if first:
            torch.mm(gt.float(), x_c.float(), out=acc)
        else:
            acc.addmm_(gt.float(), x_c.float())


# ----------------------------------------------------------------------------------------------
# GEMM strategies


def logits_into(buf: torch.Tensor, x_c: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """Z = x_c Wᵀ (+ b) written into the first rows of the reused buffer. (C, V)"""
    z = buf[: x_c.shape[0]]
    if x_c.device.type == "cpu" and x_c.dtype == torch.bfloat16 and not x_c.is_contiguous():
        # torch's CPU bf16 GEMM (AVX512-BF16 machines) reads one element past each row of a row-strided
        # A with an odd inner size: NaN in the gap between rows becomes NaN logits
        x_c = x_c.contiguous()
    if b is None:
        torch.mm(x_c, w.t(), out=z)
    else:
        torch.addmm(b, x_c, w.t(), out=z)
    return z


class CublasGemms:
    """The three GEMMs of a chunk through cuBLAS (torch.mm), over every row."""

    def logits(self, buf, x_c, w, b, chunk: Chunk) -> torch.Tensor:
        return logits_into(buf, x_c, w, b)

    def grads(self, grads: Grads, g, x_c, w, chunk: Chunk, first: bool) -> None:
        """dW first (x_c may live in dX's storage), then dX block by block, then the bias sum."""
        if grads.dw is not None:
            accumulate_weight_grad(grads.dw, g, x_c, first)
        if grads.dx is not None:
            offset = 0
            for s in chunk.blocks:
                n = s.stop - s.start
                torch.mm(g[offset:offset + n], w, out=grads.dx[s])  # (n, V) @ (V, H) → (n, H)
                offset += n
        if grads.db is not None:
            grads.db += torch.sum(g, dim=0, dtype=torch.float32)


RowPass = Callable[[torch.Tensor, torch.Tensor, Chunk], None]


def vocab_tiles(vocab: int, vocab_tile: int) -> list[slice]:
    """The vocabulary's columns in consecutive slices of `vocab_tile` (the last one narrower)."""
    return [slice(v0, min(v0 + vocab_tile, vocab)) for v0 in range(0, vocab, vocab_tile)]


def run(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, chunks: Sequence[Chunk], row_pass, *,
        grads: Grads | None = None, gemms=None, buffer: torch.Tensor | None = None,
        after_chunk: Callable[[Chunk], None] | None = None, vocab_tile: int | None = None) -> None:
    """The chunk loop: logits GEMM → `row_pass(z, x_c, chunk)` (in place: z becomes ∂L/∂Z when gradients are
    formed) → the gradient GEMMs into `grads`. buffer: the reused [≥ C, V] logits buffer (default: sized for the
    largest chunk, in `grads.scratch` when the plan puts it there). after_chunk: called once a chunk's gradients
    are queued (the vocabulary shards' dX all-reduce).

    vocab_tile: Vs < V splits each chunk's logits GEMM over `vocab_tiles` (a loss-only pass: no `grads`) into a
    buffer of C·Vs elements; `row_pass` is then a tiled row pass: `row_pass.start(chunk)` before the chunk's first
    tile, `row_pass.tile(z, chunk, k, cols)` for its k-th tile z [n, Vs] of columns `cols`, and
    `row_pass.merge(chunk)` after its last."""
    gemms = gemms or CUBLAS
    vocab = w.shape[0]
    tiles = None if vocab_tile is None or vocab_tile >= vocab else vocab_tiles(vocab, vocab_tile)
    assert tiles is None or grads is None, "a pass over vocabulary tiles forms no gradient"
    if buffer is None:
        rows = max(c.n_rows for c in chunks)
        buffer = (logits_buffer(rows, vocab, x, None if grads is None else grads.scratch) if tiles is None else
                  torch.empty(rows * vocab_tile, device=x.device, dtype=x.dtype))
    form_grads = grads is not None and grads.wanted
    for i, chunk in enumerate(chunks):
        x_c = chunk.take(x)
        if tiles is None:
            z = gemms.logits(buffer, x_c, w, b, chunk)
            row_pass(z, x_c, chunk)
        else:
            n = chunk.n_rows
            row_pass.start(chunk)
            for k, cols in enumerate(tiles):
                tile = buffer[: n * (cols.stop - cols.start)].view(n, cols.stop - cols.start)
                z = gemms.logits(tile, x_c, w[cols], None if b is None else b[cols], chunk)
                row_pass.tile(z, chunk, k, cols)
            row_pass.merge(chunk)
        if form_grads:
            gemms.grads(grads, z, x_c, w, chunk, first=i == 0)
        if after_chunk is not None:
            after_chunk(chunk)
        del x_c, z  # a gathered chunk must not coexist with the next one


CUBLAS = CublasGemms()


# ----------------------------------------------------------------------------------------------
# row passes


def row_kernel_args(class_weight: torch.Tensor | None, opts: LossOptions) -> dict:
    return dict(
        class_weight=class_weight,
        class_weight_sum=None if class_weight is None else class_weight.sum().reshape(1),
        ignore_index=opts.ignore_index,
        label_smoothing=opts.label_smoothing,
        z_loss=opts.z_loss,
        softcap=opts.softcap,
        logit_scale=opts.logit_scale,
    )


@dataclass
class CrossEntropyRows:
    """The row pass of cross-entropy and log-probs (`ce_rows`) over single-block chunks.

    compute_stats: form loss_tok / stats; else read the saved stats (a backward). grad: None (statistics only),
    a [1] upstream gradient shared by every token, or with per_token_grad a [T] one. entropy / grad_entropy: [T]
    buffers of the entropy statistic and its upstream gradient, or None. row_counts: [n_chunks] int32 valid rows
    of each chunk (the row-count path: rows past it are skipped). logit_sum: a [T] buffer of each row's Σ_v s_v
    (`ce_rows`' logit_sum: a statistics pass without class weights or label smoothing), or None."""

    target: torch.Tensor
    kernel_args: dict
    loss_tok: torch.Tensor | None
    stats: torch.Tensor
    compute_stats: bool = True
    grad: torch.Tensor | None = None
    per_token_grad: bool = False
    entropy: torch.Tensor | None = None
    grad_entropy: torch.Tensor | None = None
    row_counts: torch.Tensor | None = None
    logit_sum: torch.Tensor | None = None

    def __call__(self, z, x_c, chunk: Chunk) -> None:
        r = chunk.rows

        def part(t):
            return None if t is None else t[r]

        ce_rows(z, self.target[r], loss=part(self.loss_tok), stats=self.stats[:, r],
                grad=self.grad[r] if self.per_token_grad else self.grad, compute_stats=self.compute_stats,
                per_token_grad=self.per_token_grad, entropy=part(self.entropy), grad_entropy=part(self.grad_entropy),
                logit_sum=part(self.logit_sum),
                **({} if self.row_counts is None else {"row_count": self.row_counts[chunk.index:chunk.index + 1]}),
                **self.kernel_args)


@dataclass
class CrossEntropyTiles:
    """The tiled row pass of a loss-only cross-entropy pass (`run` with `vocab_tile`) over single-block chunks: each
    tile's partial row statistics (`ce_rows.row_stats_tile`), then one merge into the chunk's loss_tok, stats and,
    when given, entropy and logit_sum ([T] buffers; see `CrossEntropyRows`). class_weight: as `row_kernel_args`
    holds it (the tiles read their columns of it)."""

    target: torch.Tensor
    class_weight: torch.Tensor | None
    opts: LossOptions
    vocab: int
    vocab_tile: int
    loss_tok: torch.Tensor
    stats: torch.Tensor
    entropy: torch.Tensor | None = None
    logit_sum: torch.Tensor | None = None

    def __post_init__(self):
        self.kernel_args = row_kernel_args(self.class_weight, self.opts)
        self.partials = None  # the chunk being tiled: (parts, target_logit, split)

    def start(self, chunk: Chunk) -> None:
        self.partials = tile_partials(chunk.n_rows, self.vocab, self.vocab_tile, self.loss_tok.device,
                                      entropy=self.entropy is not None)

    def tile(self, z, chunk: Chunk, k: int, cols: slice) -> None:
        r, opts = chunk.rows, self.opts
        parts, target_logit, split = self.partials
        row_stats_tile(z, self.target[r], parts, target_logit, tile_index=k, split=split, col_base=cols.start,
                       class_weight=self.class_weight, softcap=opts.softcap, label_smoothing=opts.label_smoothing,
                       logit_scale=opts.logit_scale, sum_logits=self.logit_sum is not None)

    def merge(self, chunk: Chunk) -> None:
        r = chunk.rows
        (parts, target_logit, _), self.partials = self.partials, None
        merge_row_stats(parts, target_logit, self.target[r], self.vocab, loss=self.loss_tok[r], stats=self.stats[:, r],
                        entropy=None if self.entropy is None else self.entropy[r],
                        logit_sum=None if self.logit_sum is None else self.logit_sum[r], **self.kernel_args)


#: formula(chunk, logp) → ∂L/∂logp for the chunk's rows [n_rows] (any float dtype); logp: every row's log-prob
#: so far ([T], the formula's dtype), this chunk's rows just filled in
Formula = Callable[[Chunk, torch.Tensor], torch.Tensor]


def logprobs_fp64(z: torch.Tensor, y_rows: torch.Tensor, stats: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Per-token log-probabilities [C] in float64 from the chunk's logits (before the gradient overwrites them)
    and row statistics: (s_y − m) − log Σ exp(s − m), 0 where ignored. For a formula whose gradient is a steep
    function of a sum of log-probs (SimPO at a large β): s_y − m and the sum over a response are exact or
    float64, and only log Σ keeps its fp32 rounding. Without softcap or logit scale (s = z)."""
    V = z.shape[1]
    valid = y_rows != ignore_index
    safe = torch.where(valid & (y_rows >= 0) & (y_rows < V), y_rows, 0)  # the operator reports bad targets
    s_y = z.gather(1, safe[:, None].long())[:, 0].double()
    return torch.where(valid, (s_y - stats[0].double()) - stats[1].double(), 0.0)


@dataclass
class FormulaRows:
    """The row pass of a loss given as a formula of per-token log-probs: statistics (and the entropy when asked)
    → log-probs into `logp` → the formula's ∂L/∂logp → the in-place gradient. logp [T] (float32, or float64 for
    `logprobs_fp64`), entropy [T] fp32 or None; both are filled in x's row order."""

    target: torch.Tensor
    kernel_args: dict
    formula: Formula
    logp: torch.Tensor
    entropy: torch.Tensor | None = None

    def __call__(self, z, x_c, chunk: Chunk) -> None:
        y_c = chunk.take(self.target)
        C = z.shape[0]
        nll = torch.empty(C, device=z.device, dtype=torch.float32)
        stats = torch.empty((2, C), device=z.device, dtype=torch.float32)
        entropy = None if self.entropy is None else torch.empty(C, device=z.device, dtype=torch.float32)
        ce_rows(z, y_c, loss=nll, stats=stats, grad=None, compute_stats=True, entropy=entropy, **self.kernel_args)
        if self.logp.dtype == torch.float64:
            chunk.scatter(self.logp, logprobs_fp64(z, y_c, stats, self.kernel_args["ignore_index"]))
        else:
            chunk.scatter(self.logp, -nll)
        if entropy is not None:
            chunk.scatter(self.entropy, entropy)
        g_logp = self.formula(chunk, self.logp)
        # ℓ = −log p is what the row kernel differentiates: the upstream gradient flips sign
        g_tok = (-g_logp).float().contiguous()
        ce_rows(z, y_c, loss=None, stats=stats, grad=g_tok, compute_stats=False, per_token_grad=True,
                **self.kernel_args)


def formula_loss_and_grads(x, w, b, target, opts: LossOptions, formula: Formula, chunks: Sequence[Chunk],
                           plan: GradChunkPlan, *, need_dx: bool, need_dw: bool, need_db: bool,
                           logp_dtype: torch.dtype = torch.float32, with_entropy: bool = False,
                           logp_fill: float = 0.0):
    """Per-token log-probs (and entropy) of every row and the gradients of the formula's loss, in one pass of three
    GEMMs. Returns (logp [T] logp_dtype, entropy [T] fp32 or None, grads: `Grads`). logp_fill: what rows not yet
    computed hold when the formula reads them (a benign value for formulas that see every row)."""
    grads = Grads.allocate(x, w, b, need_dx, need_dw, need_db, plan)
    logp = torch.full((x.shape[0],), logp_fill, device=x.device, dtype=logp_dtype)
    entropy = torch.zeros(x.shape[0], device=x.device, dtype=torch.float32) if with_entropy else None
    row_pass = FormulaRows(target, row_kernel_args(None, opts), formula, logp, entropy)
    run(x, w, b, chunks, row_pass, grads=grads)
    return logp, entropy, grads
