"""Per-token log-probs whose gradient is formed in the forward pass for an *anticipated* upstream: three GEMMs.

`linear_logprobs_with_stats` learns the upstream gradient g_t = ∂L/∂logp_t only in backward, so its gradient path
recomputes the logits there: four vocabulary GEMMs per chunk. A supervised loss already tells its upstream in the
forward, up to one scalar: SFT's nll, L = −Σ_t logp_t / N, has g_t = −1/N on every scored token, and DFT's,
L = −Σ_t p_t·logp_t / N with p_t = exp(logp_t) detached, has g_t = −p_t/N. Call a the anticipated pattern
(nll: a_t = −1; dft: a_t = −p_t; 0 on ignored rows). The forward forms the gradients of Σ_t a_t·logp_t in the
chunk engine's one pass (logits GEMM → row pass → dW into the fp32 accumulator, dX, db) and keeps them.

In backward the upstream g that arrives is checked against the pattern on the device, with no host sync:

- s = g_k / a_k at the scored row k of largest |a_k| (nll: any scored row, exactly), and the residual
  r = g − s·a. A row *matches* when |r_t| ≤ 8 fp32 ulps of |g_t| (the rounding of the upstream's own product,
  DFT's c·p_t, against s·a_t's): its gradient is taken as s·a_t's, within those ulps of g_t's. Every other row (a
  NaN or infinite upstream included) is a *residual row*. When more than half the scored rows are residual rows,
  the pattern does not fit: s = 0 and every row with g_t ≠ 0 is a residual row (the whole gradient recomputed, as
  the four-GEMM path would). An entropy gradient (none in SFT, whose entropy is a metric) takes that same path.
- The saved gradients are rescaled by s on the device (skipped when s = 1), the fp32 dW accumulator before the
  residual is added to it and rounded once into dW's dtype after (with no residual row, in one rescale-and-cast).
- The residual rows are sorted first and counted on the device, and a counted pass over them — the engine with the
  row-count GEMMs of `kernels/rowcount_gemm.py`, the logits recomputed from the saved statistics, the rows
  gathered and scattered by `kernels/counted_rows.py` — adds Σ_t r_t·∂logp_t/∂W (and db) into the rescaled sums
  and replaces dX of each residual row by its whole gradient (the pass's r_t-weighted row times g_t/r_t; with s = 0
  that factor is 1), so no row's dX is a difference of two rounded terms.

When the upstream is the anticipated one, the count is 0: the backward is the rescale of dX and dW that every
three-GEMM loss has, plus a few launches per chunk whose programs return at once (no GEMM work, no row moved; with a
bias gradient, a masked sum over each chunk's buffer). When it is not, the result is still the gradient of
Σ_t g_t·logp_t, at the cost of three more GEMMs over the residual rows. Memory: dX, dW (and the fp32 accumulator)
live from the forward to the backward, as in every three-GEMM loss; the backward adds a [T, H] buffer (the residual
rows of x, then their dX) and one logits buffer (in dW's own storage when the plan puts it there).

The log-probs, entropy and row statistics are the engine's chunks' (the gradient pass's), which agree with
`linear_logprobs_with_stats`' statistics pass to fp32 rounding (its tiles merge a row in another order); under
`no_grad`, or while torch.compile traces, the call is `linear_logprobs_with_stats` itself. One backward per call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fusedkern import engine
from fusedkern._validation import finish_checks, start_checks, validate_call
from fusedkern.autograd import first_order_only, follows_autocast, is_traced
from fusedkern.chunk_plan import GradChunkPlan
from fusedkern.compacted import RowCountGemms, chunk_row_counts
from fusedkern.engine import Chunk, CrossEntropyRows, Grads, LossOptions, logits_buffer, plan_for_grads
from fusedkern.kernels.ce_rows import ce_rows
from fusedkern.kernels.counted_rows import gather_rows, scatter_rows
from fusedkern.kernels.rowcount_gemm import dw_rows, dx_rows
from fusedkern.kernels.scale import scale_into, scale_unless_one_
from fusedkern.dispatch import Call, anchored_for, keeps_anchored_e
from fusedkern.logprobs import linear_logprobs_with_stats, validate_logprobs_options
from fusedkern.sharded import full_weights

#: the upstream patterns a forward may anticipate: SFTTrainer's loss types
PATTERNS = ("nll", "dft")
#: a row matches the pattern when |g − s·a| ≤ MATCH_ULPS fp32 ulps of |g| (the upstream's own rounding)
MATCH_ULPS = 8


# ----------------------------------------------------------------------------------------------
# the forward: the engine's pass with the pattern's gradient


@dataclass
class PatternRows:
    """The row pass of the forward: statistics (and the entropy) → log-probs → the in-place gradient of
    Σ_t a_t·logp_t, i.e. the row kernel's ∂ℓ/∂z (ℓ = −logp) weighted by −a_t: 1 for nll (one launch computes both
    when no entropy is asked), p_t for dft (known once the chunk's log-probs are). Fills nll [T], stats [2, T],
    entropy [T] (or None) and the pattern a [T] (0 on ignored rows) in x's row order."""

    target: torch.Tensor
    kernel_args: dict
    pattern: str
    nll: torch.Tensor
    stats: torch.Tensor
    entropy: torch.Tensor | None
    a: torch.Tensor
    one: torch.Tensor

    def __call__(self, z, x_c, chunk: Chunk) -> None:
        r = chunk.rows
        y = self.target[r]
        entropy = None if self.entropy is None else self.entropy[r]
        stats = self.stats[:, r]
        if self.pattern == "nll" and entropy is None:
            ce_rows(z, y, loss=self.nll[r], stats=stats, grad=self.one, compute_stats=True, **self.kernel_args)
            return
        # the statistics first (the entropy's gradient term stays compiled out of the gradient launch)
        ce_rows(z, y, loss=self.nll[r], stats=stats, grad=None, compute_stats=True, entropy=entropy,
                **self.kernel_args)
        if self.pattern == "nll":
            ce_rows(z, y, loss=None, stats=stats, grad=self.one, compute_stats=False, **self.kernel_args)
            return
        valid = y != self.kernel_args["ignore_index"]
        p = torch.exp(-self.nll[r])  # exp(logp) as the loss computes it from the returned log-probs
        self.a[r] = torch.where(valid, -p, 0.0)
        ce_rows(z, y, loss=None, stats=stats, grad=torch.where(valid, p, 0.0), compute_stats=False,
                per_token_grad=True, **self.kernel_args)


def anticipated_pass(x, w, b, target, opts: LossOptions, pattern: str, plan: GradChunkPlan, *, need_dx: bool,
                     need_dw: bool, need_db: bool, with_entropy: bool):
    """(logp [T] fp32, entropy [T] fp32 or None, stats [2, T] fp32, a [T] fp32, grads: `engine.Grads`) of one engine
    pass whose gradients are those of Σ_t a_t·logp_t."""
    T = x.shape[0]
    valid = target != opts.ignore_index
    grads = Grads.allocate(x, w, b, need_dx, need_dw, need_db, plan)
    nll = torch.empty(T, device=x.device, dtype=torch.float32)
    stats = torch.empty((2, T), device=x.device, dtype=torch.float32)
    entropy = torch.empty(T, device=x.device, dtype=torch.float32) if with_entropy else None
    a = torch.where(valid, -1.0, 0.0).float() if pattern == "nll" else torch.zeros(T, device=x.device)
    one = torch.ones(1, device=x.device, dtype=torch.float32)
    row_pass = PatternRows(target, engine.row_kernel_args(None, opts), pattern, nll, stats, entropy, a, one)
    engine.run(x, w, b, engine.token_chunks(T, plan.chunk_tokens), row_pass, grads=grads)
    return -nll, entropy, stats, a, grads


# ----------------------------------------------------------------------------------------------
# the backward: the device-side check and the counted residual pass


@dataclass
class UpstreamSplit:
    """g = s·a + r on the scored rows, decided on the device. s [1] fp32 · residual [T] bool: the rows the counted
    pass recomputes · r [T] fp32 = g − s·a (what that pass weights its rows by) · factor [T] fp32: g/r on residual
    rows (1 elsewhere), what turns a residual row's r-weighted dX into its whole dX · count: [1] int32, the residual
    rows · order [T]: residual rows first (stable)."""

    s: torch.Tensor
    r: torch.Tensor
    residual: torch.Tensor
    factor: torch.Tensor
    count: torch.Tensor
    order: torch.Tensor


def split_upstream(g: torch.Tensor, a: torch.Tensor, valid: torch.Tensor,
                   grad_entropy: torch.Tensor | None = None) -> UpstreamSplit:
    """Compare the upstream g [T] fp32 with the pattern a [T] on the device (module docstring): no host sync."""
    tol = MATCH_ULPS * torch.finfo(torch.float32).eps

    def residual_rows(s):
        r = g - s * a
        # NaN or ±inf upstream: never a match (a NaN compares False, and |inf| ≤ tol·inf would hold)
        return r, valid & ~((r.abs() <= tol * g.abs()) & torch.isfinite(g))

    zero = g.new_zeros(1)
    if grad_entropy is None:
        k = torch.argmax(a.abs()).reshape(1)  # a = 0 on ignored rows: a scored row whenever any has a ≠ 0
        a_k, g_k = a.index_select(0, k), g.index_select(0, k)
        s1 = torch.where(a_k != 0, g_k / torch.where(a_k != 0, a_k, 1.0), zero)
        _, first = residual_rows(s1)
        s = torch.where(2 * first.sum() > valid.sum(), zero, s1)  # the pattern does not fit: recompute every row
        r, residual = residual_rows(s)
    else:  # the entropy's gradient is not anticipated: the whole gradient is recomputed where either flows
        s, r = zero, g
        residual = valid & ~((g == 0) & (grad_entropy == 0))
    factor = torch.where(residual & (r != 0), g / torch.where(r != 0, r, 1.0), 1.0)
    order = torch.argsort((~residual).to(torch.uint8), stable=True)
    return UpstreamSplit(s, r, residual, factor, residual.sum(dtype=torch.int32).reshape(1), order)


class ResidualGemms(RowCountGemms):
    """The row-count GEMMs of the residual pass: dW adds into the rescaled sum from the first chunk on (never
    overwrites it), dX is written into the chunk's own rows of x's sorted copy, and db adds the chunk's first
    counts[i] rows (a masked sum: the rows past the count hold another chunk's logits)."""

    def grads(self, grads: Grads, g, x_c, w, chunk: Chunk, first: bool) -> None:
        n_i = self.counts[chunk.index:chunk.index + 1]
        if grads.dw is not None:  # before dX: dX's GEMM writes over the chunk's x
            dw_rows(g, x_c, n_i, grads.dw, accumulate=True)
        if grads.dx is not None:
            dx_rows(g, w, n_i, grads.dx[chunk.rows])
        if grads.db is not None:
            live = torch.arange(g.shape[0], device=g.device) < n_i
            grads.db += torch.where(live[:, None], g, 0).sum(0, dtype=torch.float32)


def residual_pass(x, w, b, target, stats, entropy, split: UpstreamSplit, grad_entropy, opts: LossOptions,
                  plan: GradChunkPlan, *, dx, dw, db, scratch) -> None:
    """Add the residual rows' gradients (module docstring) to the rescaled dW / db, and replace their rows of dX.
    The rows are sorted residual-first on the device; the engine with `ResidualGemms` and the counted gather and
    scatter skip every row past the count. scratch: idle storage for the logits buffer (dW's own, when the plan put
    the buffer there), or None to allocate one."""
    T = x.shape[0]
    order = split.order
    C = plan.chunk_tokens
    counts = chunk_row_counts(split.count, T, C)
    # the residual rows of x, in order; their dX are written over them, chunk by chunk (rows past the count: unset)
    xs = gather_rows(x, order, split.count, torch.empty_like(x))
    with_entropy = grad_entropy is not None
    row_pass = CrossEntropyRows(
        target.index_select(0, order), engine.row_kernel_args(None, opts), None, stats.index_select(1, order),
        compute_stats=False, grad=(-split.r).index_select(0, order), per_token_grad=True,  # ℓ = −logp
        entropy=entropy.index_select(0, order) if with_entropy else None,
        grad_entropy=grad_entropy.index_select(0, order) if with_entropy else None, row_counts=counts)
    grads = Grads(xs if dx is not None else None, dw, db, None, plan)
    buffer = logits_buffer(min(C, T), w.shape[0], x, scratch)
    engine.run(xs, w, b, engine.token_chunks(T, C), row_pass, grads=grads, gemms=ResidualGemms(counts),
               buffer=buffer)
    if dx is not None:  # each residual row's r-weighted dX times g/r: its whole dX (with the entropy, s = 0: 1)
        scatter_rows(xs, order, split.count, dx, None if with_entropy else split.factor.index_select(0, order))


class AnticipatedLogprobs(torch.autograd.Function):
    """forward(x [T, H], w [V, H], b [V] | None, target [T], opts, pattern, plan, with_entropy) → (logp [T] fp32,
    entropy [T] fp32 or [0], stats [2, T] fp32, not differentiable)."""

    @staticmethod
    def forward(ctx, x, w, b, target, opts: LossOptions, pattern: str, plan: GradChunkPlan, with_entropy: bool):
        ctx.set_materialize_grads(False)  # an output nothing flowed into (a metric's entropy) brings None, not zeros
        checks = start_checks(target, w.shape[0], opts.ignore_index, None, None, -1)
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        need_db = need_db and b is not None
        logp, entropy, stats, a, grads = anticipated_pass(x, w, b, target, opts, pattern, plan, need_dx=need_dx,
                                                          need_dw=need_dw, need_db=need_db, with_entropy=with_entropy)
        finish_checks(checks)
        entropy = logp.new_empty(0) if entropy is None else entropy
        ctx.save_for_backward(x, w, b, target, stats, entropy, a, grads.dx, grads.dw, grads.db, grads.dw_out)
        ctx.opts, ctx.plan, ctx.used = opts, plan, False
        ctx.mark_non_differentiable(stats)
        return logp, entropy, stats

    @staticmethod
    @first_order_only
    def backward(ctx, grad_logp, grad_entropy, _grad_stats):
        if ctx.used:
            raise RuntimeError("linear_logprobs_anticipated rescales its saved gradients in place and supports one "
                               "backward pass; use linear_logprobs_with_stats for retain_graph")
        ctx.used = True
        x, w, b, target, stats, entropy, a, dx, dw, db, dw_out = ctx.saved_tensors
        if grad_logp is None and grad_entropy is None:
            return (None,) * 8
        opts, T = ctx.opts, x.shape[0]
        g = a.new_zeros(T) if grad_logp is None else grad_logp.float().reshape(T)
        ge = None if grad_entropy is None or entropy.numel() == 0 else grad_entropy.float().reshape(T)
        split = split_upstream(g, a, target != opts.ignore_index, ge)
        one = split.s.new_ones(1)
        counted = split.count > 0
        if dx is not None:
            scale_unless_one_(dx, split.s)
        if dw is not None:
            if dw_out is None:  # dW itself (one chunk, or no fp32 accumulation): rescaled before the residual adds
                scale_unless_one_(dw, split.s)
            else:  # the fp32 accumulator: rescaled in place only when a residual will be added (else in the cast)
                scale_unless_one_(dw, torch.where(counted, split.s, one))
        if db is not None:
            db.mul_(split.s)
        residual_pass(x, w, b, target, stats, entropy, split, ge, opts, ctx.plan, dx=dx, dw=dw, db=db,
                      scratch=dw_out if ctx.plan.buffer_in_dw_storage else None)
        if dw is not None and dw_out is not None:
            dw = scale_into(dw, torch.where(counted, one, split.s), dw_out)
        return dx, dw, None if db is None else db.to(b.dtype), None, None, None, None, None


# ----------------------------------------------------------------------------------------------
# the public function


@follows_autocast
def linear_logprobs_anticipated(input: torch.Tensor, linear_weight: torch.Tensor, target: torch.Tensor, *,
                                anticipate: str = "nll", linear_bias: torch.Tensor | None = None,
                                ignore_index: int = -100, softcap: float | None = None, temperature: float = 1.0,
                                return_entropy: bool = False, weight_grad_accum: str = "fp32",
                                chunk_tokens: int | None = None):
    """`linear_logprobs_with_stats` — (logps, entropy or None, row_max, row_lse), each float32 shaped like target —
    whose forward also forms the gradient of Σ_t a_t·logp_t for the anticipated upstream pattern a (`anticipate`:
    "nll", a_t = −1, or "dft", a_t = −exp(logp_t), on the scored rows): three vocabulary GEMMs in all when the
    upstream that reaches the log-probs in backward is s·a for any scalar s (SFT's loss, 0 and negative s included),
    and the exact gradient of any other upstream through a counted pass over the rows that differ (module
    docstring). Differentiable in input, linear_weight and linear_bias; one backward pass per call."""
    if anticipate not in PATTERNS:
        raise ValueError(f"anticipate must be one of {PATTERNS}, got {anticipate!r}")
    linear_weight, linear_bias, _ = full_weights(input, linear_weight, target, linear_bias)  # DTensors gathered
    validate_call(input, linear_weight, target, linear_bias, ignore_index=ignore_index, softcap=softcap,
                  impl="chunked", weight_grad_accum=weight_grad_accum, chunk_tokens=chunk_tokens)
    validate_logprobs_options(temperature, return_entropy, "chunked")
    wants_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (input, linear_weight, linear_bias))
    x2d = input.reshape(-1, input.shape[-1])
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    opts = LossOptions(ignore_index, softcap=None if softcap is None else float(softcap),
                       logit_scale=1.0 / float(temperature))
    # the anchored pass with E kept takes any upstream at three GEMMs: nothing to anticipate
    if not wants_grad or target.numel() == 0 or is_traced(input, linear_weight) or (
            anchored_for("auto", Call(x2d, linear_weight, linear_bias, None, opts, return_entropy, with_row_max=True))
            and keeps_anchored_e(x2d, linear_weight)):
        return linear_logprobs_with_stats(input, linear_weight, target, linear_bias=linear_bias,
                                          ignore_index=ignore_index, softcap=softcap, temperature=temperature,
                                          return_entropy=return_entropy, weight_grad_accum=weight_grad_accum,
                                          chunk_tokens=chunk_tokens)
    y = target.reshape(-1).contiguous()  # the kernels index target[row] with no stride
    plan = plan_for_grads(x2d.shape[0], linear_weight, linear_weight.requires_grad, weight_grad_accum, chunk_tokens)
    logp, entropy, stats = AnticipatedLogprobs.apply(x2d, linear_weight, linear_bias, y, opts, anticipate, plan,
                                                     return_entropy)
    lead = input.shape[:-1]
    return (logp.reshape(lead), entropy.reshape(lead) if return_entropy else None, stats[0].reshape(lead),
            (stats[0] + stats[1]).reshape(lead))
