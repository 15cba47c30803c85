"""Vocabulary-parallel LM-head losses over torch.distributed: cross-entropy and per-token log-probs when each
rank of a process group holds a contiguous shard of the head's vocabulary rows (tensor parallelism).

Per chunk of C tokens, rank r (shard W_r [V_r, H], columns v_r … v_r + V_r − 1):
  Z_r = X_c W_rᵀ (+ b_r) [C, V_r] → the row kernel's partial statistics of its columns (max, Σ exp − 1,
  Σ w·s, the target logit where the target falls in the shard) in its own slots of a [3, C, P] array
  → one all-reduce (a sum: every slot has one owner, the other ranks hold 0) → every rank merges the
  same statistics into the whole vocabulary's lse and loss → its shard of ∂L/∂Z in place (the row kernel
  at the shard's column offset) → dX_c += G_r W_r (all-reduced, asynchronously per chunk, so it overlaps
  the next chunk) and dW_r += G_rᵀ X_c (local). No [tokens, V] tensor exists anywhere; each rank's extra
  memory is the single-GPU plan's for its shard (`chunk_plan.py`).

Trade-off against Megatron-LM's vocab-parallel cross-entropy (three all-reduces of T floats: max, sum-exp,
target logit, over a materialized fp32 [T, V_r] logits tensor): one all-reduce of (3P + 1)·C floats per
chunk (P = the power of two ≥ world · slices per row)
in exchange for reusing the single-GPU kernels unchanged; dX's all-reduce (2·T·H bytes in bf16) is the
same in both and dominates. docs/design.md ("Vocabulary parallelism") derives the volumes.

Scalar reductions with gradients form them in the forward pass (three GEMMs, as on one GPU); "none" and
the log-probs recompute the logits in backward from the saved statistics (four GEMMs). The passes and the sequence-
parallel gather are custom operators (`autograd.define_op`), as on one GPU; their options name the process group
(`VocabShard.group_name`), since an operator's options are scalars.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from fusedkern import _validation as V_
from fusedkern import engine
from fusedkern.engine import Chunk, Grads, LossOptions, plan_for_grads, row_kernel_args, token_chunks
from fusedkern.kernels.ce_rows import ce_rows, gpu_split, merge_row_stats, row_stats_tile, tile_partials
from fusedkern._validation import (
    check_target_type,
    finish_checks,
    start_checks,
    validate_loss_options,
    validate_strategy,
)
from fusedkern.autograd import (
    CHECKING_OP_TAGS,
    GradOptions,
    absent,
    define_op,
    fake_grads,
    follows_autocast,
    grads_formed_in_forward,
    or_absent,
    recomputed_in_backward,
)
from fusedkern.linear_cross_entropy import mean_denominator


def process_group(group_name: str):
    """The process group of that name. Operator options hold scalars only, so the operators name their group, as
    torch's own functional collectives do in their schemas, and resolve it with torch's function for that."""
    return dist.distributed_c10d._resolve_process_group(group_name)


@dataclass(frozen=True)
class VocabShard:
    """This rank's rows of the head: vocabulary indices start … start + rows − 1 of vocab_size, in the process
    group named `group_name` of `world` ranks. Slots of the statistics exchange are laid out for `slot_cols`
    columns per rank."""

    group_name: str
    rank: int
    world: int
    start: int
    rows: int
    vocab_size: int

    @property
    def group(self):
        return process_group(self.group_name)

    @property
    def slot_cols(self) -> int:
        # the same on every rank (the slices per row must agree), whatever the shards' actual sizes
        return -(-self.vocab_size // self.world)


def even_vocab_shard(vocab_size: int, group=None) -> tuple[int, int]:
    """(start, stop) of this rank's rows when `vocab_size` rows are split as evenly as possible over the
    group, the first ranks taking one row more (a convenience; any contiguous split works)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    base, extra = divmod(vocab_size, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def exchange_floats_per_token(chunk_tokens: int, vocab_size: int, world: int) -> int:
    """fp32 values per token in a chunk's statistics all-reduce on a GPU: 3P + 1, P = the power of two
    ≥ world · slices per row (`ce_rows.gpu_split` of the chunk and the per-rank slot width)."""
    cols = -(-vocab_size // world)
    return 3 * (1 << (world * gpu_split(chunk_tokens, cols) - 1).bit_length()) + 1


def _resolve_shard(linear_weight: torch.Tensor, group, vocab_start: int | None, vocab_size: int | None) -> VocabShard:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("fusedkern.distributed needs an initialized torch.distributed process group "
                           "(torch.distributed.init_process_group)")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    rows = linear_weight.shape[0]
    if (vocab_start is None) != (vocab_size is None):
        raise ValueError("pass both vocab_start and vocab_size (this rank's first row and the whole vocabulary), "
                         "or neither (then the shard sizes are exchanged, which waits for the device)")
    if vocab_start is None:
        # one small exchange of the shard sizes: a host synchronization, once per call
        sizes = torch.zeros(world, dtype=torch.int64, device=linear_weight.device)
        sizes[rank] = rows
        dist.all_reduce(sizes, group=group)
        sizes = sizes.tolist()
        vocab_start, vocab_size = sum(sizes[:rank]), sum(sizes)
    vocab_start, vocab_size = V_.check_int("vocab_start", vocab_start), V_.check_int("vocab_size", vocab_size)
    if not (0 <= vocab_start and vocab_start + rows <= vocab_size):
        raise ValueError(f"linear_weight's {rows} rows starting at vocab_start={vocab_start} must lie inside "
                         f"the vocabulary of vocab_size={vocab_size}")
    group_name = (dist.group.WORLD if group is None else group).group_name
    return VocabShard(group_name, rank, world, vocab_start, rows, vocab_size)


def _validate(input, linear_weight, target, linear_bias, weight, shard_rows: int, reduction, ignore_index,
              label_smoothing, z_loss, softcap, weight_grad_accum, chunk_tokens, sequence_parallel) -> None:
    V_.check_tensor("input", input, min_ndim=1, dtypes=V_.FLOAT_DTYPES)
    V_.check_tensor("linear_weight", linear_weight, ndim=2, dtypes=V_.FLOAT_DTYPES)
    V_.check_kernel_device("input", input)
    V_.check_same_device("input", input, linear_weight=linear_weight, target=target, linear_bias=linear_bias,
                         weight=weight)
    V_.check_same_dtype("input", input, linear_weight=linear_weight, linear_bias=linear_bias)
    if input.shape[-1] != linear_weight.shape[1]:
        raise ValueError(f"input's last dimension ({input.shape[-1]}) must equal linear_weight.shape[1] (hidden); "
                         f"linear_weight is this rank's [vocab rows, hidden] = {tuple(linear_weight.shape)}")
    if linear_bias is not None:
        V_.check_tensor("linear_bias", linear_bias, ndim=1)
        V_.check_shape("linear_bias", linear_bias, (shard_rows,), "this rank's shard of the bias")
    validate_loss_options(weight=weight, reduction=reduction, ignore_index=ignore_index,
                          label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap)
    check_target_type(target, input.shape[:-1])
    validate_strategy("chunked", weight_grad_accum, chunk_tokens)
    if not isinstance(sequence_parallel, bool):
        raise TypeError(f"sequence_parallel must be a bool, got {type(sequence_parallel).__name__}")


# ----------------------------------------------------------------------------------------------
# the chunk loop


def _exchange_stats(parts: torch.Tensor, target_logit: torch.Tensor, group) -> None:
    """Sum the ranks' disjoint slots of (parts, target_logit) in one all-reduce."""
    flat = torch.cat([parts.reshape(-1), target_logit])
    dist.all_reduce(flat, group=group)
    parts.view(-1).copy_(flat[: parts.numel()])
    target_logit.copy_(flat[parts.numel():])


class ShardRows:
    """The engine's row pass over this rank's vocabulary shard: (with compute_stats) the shard's partial statistics,
    exchanged with every rank in one all-reduce and merged into the whole vocabulary's lse and loss; then (with
    grad) the shard's columns of ∂L/∂Z in place, at the shard's column offset."""

    def __init__(self, y, class_weight, opts: LossOptions, shard: VocabShard, *, loss_tok, stats,
                 compute_stats: bool, grad, per_token_grad: bool):
        self.y, self.class_weight, self.opts, self.shard = y, class_weight, opts, shard
        self.kernel_args = row_kernel_args(class_weight, opts)
        self.loss_tok, self.stats, self.compute_stats = loss_tok, stats, compute_stats
        self.grad, self.per_token_grad = grad, per_token_grad

    def __call__(self, z, x_c, chunk: Chunk) -> None:
        r, shard, opts = chunk.rows, self.shard, self.opts
        y_c = self.y[r]
        if self.compute_stats:
            parts, target_logit, split = tile_partials(z.shape[0], shard.world * shard.slot_cols, shard.slot_cols,
                                                       z.device)
            parts[0, :, : shard.world * split] = 0.0  # other ranks' slots: 0 in the sum (padding stays −inf)
            row_stats_tile(z, y_c, parts, target_logit, tile_index=shard.rank, split=split, col_base=shard.start,
                           class_weight=self.class_weight, softcap=opts.softcap, label_smoothing=opts.label_smoothing)
            _exchange_stats(parts, target_logit, shard.group)
            merge_row_stats(parts, target_logit, y_c, shard.vocab_size, loss=self.loss_tok[r],
                            stats=self.stats[:, r], **self.kernel_args)
        if self.grad is None:
            return
        ce_rows(z, y_c, loss=None, stats=self.stats[:, r], grad=self.grad[r] if self.per_token_grad else self.grad,
                compute_stats=False, per_token_grad=self.per_token_grad, col_base=shard.start,
                vocab_total=shard.vocab_size, **self.kernel_args)


def _shard_chunks(x, w, b, y, class_weight, opts: LossOptions, shard: VocabShard, C: int, *, loss_tok, stats,
                  compute_stats: bool, grad, per_token_grad: bool, grads: Grads | None = None,
                  reduce_dx: bool = True) -> None:
    """The engine's loop over the shard: logits GEMM → (statistics exchange →) row kernel → gradient GEMMs, chunk
    by chunk. reduce_dx: all-reduce each chunk's rows of dX (asynchronously, awaited before returning)."""
    pending = []

    def reduce_chunk_dx(chunk: Chunk) -> None:
        if grads is not None and grads.dx is not None and reduce_dx and shard.world > 1:
            pending.append(dist.all_reduce(grads.dx[chunk.rows], group=shard.group, async_op=True))

    row_pass = ShardRows(y, class_weight, opts, shard, loss_tok=loss_tok, stats=stats, compute_stats=compute_stats,
                         grad=grad, per_token_grad=per_token_grad)
    engine.run(x, w, b, token_chunks(x.shape[0], C), row_pass, grads=grads if grad is not None else None,
               after_chunk=reduce_chunk_dx)
    for work in pending:
        work.wait()


def _shard_grads(x, w, b, y, class_weight, opts, shard, g: GradOptions, reduce_dx, **chunk_args):
    """(dx, dw, db, dw_out) of a pass over the chunks with the gradients `g` asks for, in `engine.Grads`' form."""
    plan = plan_for_grads(x.shape[0], w, g.need_dw, g.weight_grad_accum, g.chunk_tokens)
    grads = Grads.allocate(x, w, b, g.need_dx, g.need_dw, g.need_db, plan)
    _shard_chunks(x, w, b, y, class_weight, opts, shard, plan.chunk_tokens, grads=grads, reduce_dx=reduce_dx,
                  **chunk_args)
    return grads.as_tuple()


# ----------------------------------------------------------------------------------------------
# operators (`autograd.define_op`): the shard travels in the options by its process group's name


def _row_buffers(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token loss [T] and (max, log Σ exp) statistics [2, T] the chunks fill, fp32."""
    T = x.shape[0]
    return (torch.empty(T, device=x.device, dtype=torch.float32),
            torch.empty((2, T), device=x.device, dtype=torch.float32))


@dataclass(frozen=True)
class ScalarOptions:
    """`vp_ce_scalar`'s options: the loss, its reduction ("mean"/"sum"), the shard, the gradients (`GradOptions`),
    and whether each chunk's dX is all-reduced (not with sequence parallelism: the gather's backward reduce-scatters
    it)."""

    loss: LossOptions
    reduction: str
    shard: VocabShard
    grads: GradOptions
    reduce_dx: bool


def _scalar(x, w, b, y, class_weight, o: ScalarOptions):
    """mean / sum with gradients formed in the forward pass (rescaled by the upstream gradient in backward): (loss
    0-d fp32, lse [T] fp32, dx, dw, db, dw_out) as `linear_cross_entropy`'s `ce_chunked_scalar` returns them."""
    shard, g = o.shard, o.grads
    checks = start_checks(y, shard.vocab_size, o.loss.ignore_index, None, None, -1)
    if o.reduction == "mean":
        denom = mean_denominator(y, class_weight, o.loss.ignore_index)
        grad_scale = (1.0 / denom).reshape(1)
    else:
        grad_scale = torch.ones(1, device=x.device, dtype=torch.float32)
    loss_tok, stats = _row_buffers(x)
    grads = _shard_grads(x, w, b, y, class_weight, o.loss, shard, g, o.reduce_dx, loss_tok=loss_tok, stats=stats,
                         compute_stats=True, grad=grad_scale, per_token_grad=False)
    loss = loss_tok.sum() / denom if o.reduction == "mean" else loss_tok.sum()
    finish_checks(checks)
    return (loss, stats[0] + stats[1], *g.outputs(x, w, *grads))


def _fake_scalar(x, w, b, y, class_weight, o: ScalarOptions):
    T, g = x.shape[0], o.grads
    fp32_accumulator = plan_for_grads(T, w, g.need_dw, g.weight_grad_accum, g.chunk_tokens).fp32_accumulator
    return (x.new_empty((), dtype=torch.float32), x.new_empty((T,), dtype=torch.float32),
            *g.fake_outputs(x, w, T, fp32_accumulator, g.need_db and b is not None))


vp_ce_scalar = define_op("fusedkern::vp_ce_scalar", ["x", "w", "b?", "y", "class_weight?"], ScalarOptions, 6,
                         _scalar, _fake_scalar, *grads_formed_in_forward("vocab_parallel_cross_entropy"),
                         tags=CHECKING_OP_TAGS)


@dataclass(frozen=True)
class PerTokenOptions:
    """`vp_per_token`'s and `vp_per_token_backward`'s options: the loss, the shard, the chunks and gradients
    (`GradOptions`: none asked for in the forward) and whether each chunk's dX is all-reduced."""

    loss: LossOptions
    shard: VocabShard
    grads: GradOptions
    reduce_dx: bool


def _per_token(x, w, b, y, class_weight, o: PerTokenOptions):
    """Per-token loss [T] and row statistics [2, T] (fp32); the backward recomputes each shard's logits chunk from
    the saved statistics (`vp_per_token_backward`)."""
    checks = start_checks(y, o.shard.vocab_size, o.loss.ignore_index, None, None, -1)
    loss_tok, stats = _row_buffers(x)
    C = plan_for_grads(x.shape[0], w, False, o.grads.weight_grad_accum, o.grads.chunk_tokens).chunk_tokens
    _shard_chunks(x, w, b, y, class_weight, o.loss, o.shard, C, loss_tok=loss_tok, stats=stats, compute_stats=True,
                  grad=None, per_token_grad=False)
    finish_checks(checks)
    return loss_tok, stats


def _fake_per_token(x, w, b, y, class_weight, o: PerTokenOptions):
    T = x.shape[0]
    return x.new_empty((T,), dtype=torch.float32), x.new_empty((2, T), dtype=torch.float32)


def _per_token_backward(x, w, b, y, class_weight, stats, grad_tok, o: PerTokenOptions):
    """Gradients of Σ_t grad_tok[t]·ℓ_t over this rank's shard: (dx [T, H] summed over the shards, dw [V_r, H],
    db [V_r]) in the dtypes of x, w, b; [0] where not wanted."""
    dx, dw, db, dw_out = _shard_grads(x, w, b, y, class_weight, o.loss, o.shard, o.grads, o.reduce_dx, loss_tok=None,
                                      stats=stats, compute_stats=False, grad=grad_tok, per_token_grad=True)
    if dw_out is not None:
        dw = dw_out.copy_(dw)
    return or_absent(dx, x), or_absent(dw, w), absent(w) if db is None else db.to(b.dtype)


vp_per_token_backward = define_op(
    "fusedkern::vp_per_token_backward", ["x", "w", "b?", "y", "class_weight?", "stats", "grad_tok"], PerTokenOptions,
    3, _per_token_backward, lambda x, w, b, y, class_weight, stats, grad_tok, o: fake_grads(x, w, b, o.grads))
vp_per_token = define_op("fusedkern::vp_per_token", ["x", "w", "b?", "y", "class_weight?"], PerTokenOptions, 2,
                         _per_token, _fake_per_token, *recomputed_in_backward(vp_per_token_backward),
                         tags=CHECKING_OP_TAGS)


@dataclass(frozen=True)
class GroupOptions:
    """The process group of a collective operator, by name (`VocabShard.group_name`), and its size."""

    group_name: str
    world: int


def _gather_tokens(local: torch.Tensor, o: GroupOptions) -> torch.Tensor:
    """Sequence parallelism: the ranks' token shards [T_r, ...] all-gathered along dim 0 (equal T_r on every rank)."""
    out = local.new_empty((o.world * local.shape[0], *local.shape[1:]))
    dist.all_gather_into_tensor(out, local.contiguous(), group=process_group(o.group_name))
    return out


def _reduce_scatter_tokens(grad: torch.Tensor, o: GroupOptions) -> torch.Tensor:
    """The gather's backward: the ranks' partial gradients of the gathered tensor, summed, this rank's rows kept."""
    local = grad.new_empty((grad.shape[0] // o.world, *grad.shape[1:]))
    dist.reduce_scatter_tensor(local, grad.contiguous(), group=process_group(o.group_name))
    return local


def _setup_gather(ctx, tensors, o: GroupOptions, output):
    ctx.options = o


reduce_scatter_tokens = define_op(
    "fusedkern::reduce_scatter_tokens", ["grad"], GroupOptions, 1, _reduce_scatter_tokens,
    lambda grad, o: grad.new_empty((grad.shape[0] // o.world, *grad.shape[1:])))
gather_tokens = define_op(
    "fusedkern::gather_tokens", ["local"], GroupOptions, 1, _gather_tokens,
    lambda local, o: local.new_empty((o.world * local.shape[0], *local.shape[1:])), _setup_gather,
    lambda ctx, grad: (reduce_scatter_tokens(grad, ctx.options),))


# ----------------------------------------------------------------------------------------------
# public functions


def _flat_inputs(input, target, sequence_parallel: bool, group):
    x2d = input.reshape(-1, input.shape[-1])
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    y = target.reshape(-1).contiguous()
    world = dist.get_world_size(group)
    if sequence_parallel and world > 1:
        options = GroupOptions((dist.group.WORLD if group is None else group).group_name, world)
        x2d, y = gather_tokens(x2d, options), gather_tokens(y, options)
    return x2d, y


@follows_autocast
def vocab_parallel_cross_entropy(input: torch.Tensor, linear_weight: torch.Tensor, target: torch.Tensor, *,
                                 group=None, linear_bias: torch.Tensor | None = None,
                                 weight: torch.Tensor | None = None, reduction: str = "mean",
                                 ignore_index: int = -100, label_smoothing: float = 0.0, z_loss: float = 0.0,
                                 softcap: float | None = None, vocab_start: int | None = None,
                                 vocab_size: int | None = None, sequence_parallel: bool = False,
                                 chunk_tokens: int | None = None, weight_grad_accum: str = "fp32",
                                 return_lse: bool = False):
    """`fusedkern.linear_cross_entropy` with the head's vocabulary rows sharded over `group`.

    Args:
        input: [..., H] activations, the same tokens on every rank (or, with sequence_parallel, this rank's
            equal-sized share of them along the flattened leading dimensions).
        linear_weight: [V_r, H] this rank's contiguous rows of the head (sizes may differ by rank).
        target: [...] class indices of the whole vocabulary (input's leading shape).
        group: the process group the vocabulary is sharded over (None: the default group).
        linear_bias: this rank's [V_r] rows of the bias.  weight: [vocab_size] class weights (every rank).
        reduction, ignore_index, label_smoothing, z_loss, softcap, chunk_tokens, weight_grad_accum,
            return_lse: as in `linear_cross_entropy` (the chunked strategy on each rank's shard).
        vocab_start, vocab_size: this rank's first row and the whole vocabulary's size. Without them the
            ranks exchange their shard sizes, which waits for the device once per call; pass them in a
            training loop (`even_vocab_shard` gives the even split).
        sequence_parallel: input and target are this rank's token shard: they are all-gathered (every rank
            computes the loss of all tokens over its vocabulary shard) and dX is reduce-scattered back.

    Returns:
        the loss (fp32, the same on every rank; 0-d for mean/sum, the gathered leading shape for "none"),
        and the lse when `return_lse`. Gradients: dX is summed over the vocabulary shards (all-reduced, or
        reduce-scattered with sequence_parallel), each rank gets dW and db of its own rows.
    """
    shard = _resolve_shard(linear_weight, group, vocab_start, vocab_size)
    _validate(input, linear_weight, target, linear_bias, weight, shard.rows, reduction, ignore_index,
              label_smoothing, z_loss, softcap, weight_grad_accum, chunk_tokens, sequence_parallel)
    if weight is not None:
        V_.check_shape("weight", weight, (shard.vocab_size,), "one class weight per entry of the whole vocabulary")
    x2d, y = _flat_inputs(input, target, sequence_parallel, group)
    class_weight = None if weight is None else weight.float().contiguous()
    opts = LossOptions(ignore_index, float(label_smoothing), float(z_loss), None if softcap is None else float(softcap))
    reduce_dx = not sequence_parallel  # with sequence parallelism the gather's backward reduce-scatters dX
    grads = GradOptions.asked(x2d, linear_weight, linear_bias, weight_grad_accum, chunk_tokens)
    if reduction != "none" and grads.wanted:
        loss, lse, *_ = vp_ce_scalar(x2d, linear_weight, linear_bias, y, class_weight,
                                     ScalarOptions(opts, reduction, shard, grads, reduce_dx))
    else:
        options = PerTokenOptions(opts, shard, GradOptions(weight_grad_accum, chunk_tokens), reduce_dx)
        loss, stats = vp_per_token(x2d, linear_weight, linear_bias, y, class_weight, options)
        lse = stats[0] + stats[1]
        if reduction == "sum":
            loss = loss.sum()
        elif reduction == "mean":
            loss = loss.sum() / mean_denominator(y, class_weight, ignore_index)
    lead_shape = y.shape if sequence_parallel else input.shape[:-1]  # sequence parallel: all ranks' tokens, flat
    if reduction == "none":
        loss = loss.reshape(lead_shape)
    return (loss, lse.reshape(lead_shape)) if return_lse else loss


@follows_autocast
def vocab_parallel_logprobs(input: torch.Tensor, linear_weight: torch.Tensor, target: torch.Tensor, *,
                            group=None, linear_bias: torch.Tensor | None = None, ignore_index: int = -100,
                            softcap: float | None = None, vocab_start: int | None = None,
                            vocab_size: int | None = None, sequence_parallel: bool = False,
                            chunk_tokens: int | None = None, weight_grad_accum: str = "fp32") -> torch.Tensor:
    """`fusedkern.linear_logprobs` with the vocabulary sharded over `group` (arguments as in
    `vocab_parallel_cross_entropy`): per-token log p(target), 0 where ignored, differentiable. The
    preference losses take it from here: `fusedkern.preference.preference_loss_from_logps`."""
    nll = vocab_parallel_cross_entropy(input, linear_weight, target, group=group, linear_bias=linear_bias,
                                       reduction="none", ignore_index=ignore_index, softcap=softcap,
                                       vocab_start=vocab_start, vocab_size=vocab_size,
                                       sequence_parallel=sequence_parallel, chunk_tokens=chunk_tokens,
                                       weight_grad_accum=weight_grad_accum)
    return -nll
