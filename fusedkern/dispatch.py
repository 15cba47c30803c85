"""Which strategy runs a call: the one place a strategy is named, checked and chosen.

Three strategies compute the same per-token statistics (loss ℓ_t, the (max, log Σ exp) row statistics, and the
entropy where asked) and the gradients of Σ_t g_t·ℓ_t (+ g^H_t·H_t) from them:

- `CHUNKED` (`chunked.py`): cuBLAS GEMMs over token chunks and the Triton row kernels, on the chunk engine. Where
  the upstream gradient is known in the forward (scalar reductions, formulas of the log-probs) it forms the
  gradients there: three GEMMs. Takes every option.
- `GLUON` (`kernels/gluon_logits_stats.py`): the statistics in the logits GEMM's epilogue (no logits buffer; sm_90,
  bf16, no bias, class weights, label smoothing, z-loss or softcap; a temperature and the entropy are fine; no logits'
  sum: a call that asks for TRL's mean_logits takes the chunked pass). It has no backward of its own: a gradient
  recomputes the logits with the chunked strategy's GEMMs behind that strategy's own statistics pass (its bf16
  logits need statistics of the same logits: `chunked.grads_on_own_statistics`).
- `ANCHORED` (`anchored.py`): anchored exponentials: the logits GEMM's epilogue (`kernels/gluon_anchored_exp.py`)
  writes E = exp(s − s_y − A) in bf16 and per-tile sums, a row kernel finishes each row, and dX, dW are two cuBLAS
  GEMMs over E: no row pass over [C, V] in HBM. No bias, class weights, label smoothing, z-loss, softcap or logits'
  sum. With E kept to the backward the entropy's gradient is formed over E; on the operators (E recomputed) it takes
  the chunked strategy whole.
  Its statistics are the pair (s_y, ℓ), or (max, lse − max) when the row max is asked for (`Call.with_row_max`).
- `FUSED` (`kernels/fused_ce.py`): Triton GEMM with an online log-sum-exp, logits recomputed in backward; O(T + V)
  extra memory. No logit scale, no entropy and no logits' sum. Its backward adds into dX, dW and db with fp32
  atomics: the one strategy whose gradients are not bitwise reproducible (docs/usage.md, "Determinism").

`impl="auto"` takes the anchored pass wherever its Gluon producer runs (sm_90, bf16, aligned operands, not under
torch.compile tracing), its options allow it and its buffers fit the free GPU memory (`anchored_for`), with and
without a gradient, so that a forward with gradient and one without compute the same statistics with the same kernel
(a policy and its reference model see equal log-probs). Elsewhere it takes the chunked GEMMs unless their buffers do
not fit the free GPU memory (then fused, except under `torch.use_deterministic_algorithms(True)`), and runs a
statistics-only forward on Gluon wherever it applies, for the same reason. The three-GEMM uses of the anchored pass
(cross-entropy's gradient formed in the forward, per-token log-probs with E kept to the backward) are routed by their
callers (`linear_cross_entropy`, `logprobs`), and the formula losses (preference, GRPO, SimPO) take their generic path
on those log-probs (`formula_on_anchored`). An explicit `impl` that cannot take the call raises ValueError saying
why; the fused backward under deterministic algorithms raises RuntimeError (a warning with `warn_only=True`), as
torch's own non-deterministic operations do.
"""

from __future__ import annotations

import abc
import functools
import warnings
from dataclasses import dataclass

import torch

from fusedkern import anchored
from fusedkern._validation import IMPLS as VALID_IMPLS
from fusedkern.autograd import is_traced
from fusedkern.chunked import chunked_grads, chunked_loss, grads_on_own_statistics, plan_for_grads
from fusedkern.engine import LossOptions

AUTO, ANCHORED, CHUNKED, FUSED, GLUON = "auto", "anchored", "chunked", "fused", "gluon"
IMPLS = (AUTO, ANCHORED, CHUNKED, FUSED, GLUON)


@dataclass(frozen=True)
class Call:
    """What a strategy's `unsupported` check reads: the flat operands and the options of one call."""

    x2d: torch.Tensor
    w: torch.Tensor
    b: torch.Tensor | None
    class_weight: torch.Tensor | None
    opts: LossOptions
    with_entropy: bool = False
    with_logit_sum: bool = False  # each row's Σ_v s_v (the mean logit of TRL's logits/* metrics)
    with_row_max: bool = False  # stats[0] must be each row's max (TRL's is_top1), not only a term of the lse


class Strategy(abc.ABC):
    """A strategy's per-token statistics and gradients. `statistics` → (loss_tok [T] fp32, stats [2, T] fp32; the
    entropy and the logits' sum into the [T] buffers given, where the strategy supports them);
    `gradients` → (dx, dw, db) of Σ_t grad_tok[t]·ℓ_t (+ grad_entropy[t]·H_t) from the saved stats, None where not
    wanted. `forms_grads_in_forward`: the three-GEMM paths (gradient formed in the forward pass) run on it.
    `scales_logits`: its kernels take a logit scale (a temperature); without it the caller scales the operands."""

    name: str
    forms_grads_in_forward = False
    scales_logits = True

    def unsupported(self, call: Call) -> str | None:
        """Why this strategy cannot take the call, or None when it can."""
        return None

    @abc.abstractmethod
    def statistics(self, x, w, b, target, class_weight, opts: LossOptions, chunk_tokens, entropy=None,
                   logit_sum=None, row_max=False):
        """(loss_tok [T] fp32, stats [2, T] fp32) of every row; entropy / logit_sum: [T] buffers to fill, or None;
        row_max: stats[0] must be the row max (every strategy but the anchored one gives it always)."""

    def gradients(self, x, w, b, target, class_weight, opts: LossOptions, stats, grad_tok, *, need_dx, need_dw,
                  need_db, weight_grad_accum, chunk_tokens, entropy=None, grad_entropy=None):
        return chunked_grads(x, w, b, target, class_weight, opts, stats, grad_tok, need_dx=need_dx, need_dw=need_dw,
                             need_db=need_db, weight_grad_accum=weight_grad_accum, chunk_tokens=chunk_tokens,
                             entropy=entropy, grad_entropy=grad_entropy)


class Chunked(Strategy):
    name = CHUNKED
    forms_grads_in_forward = True

    def statistics(self, x, w, b, target, class_weight, opts, chunk_tokens, entropy=None, logit_sum=None,
                   row_max=False):
        return chunked_loss(x, w, b, target, class_weight, opts, chunk_tokens, entropy=entropy, logit_sum=logit_sum)


class Fused(Strategy):
    name = FUSED
    scales_logits = False

    def unsupported(self, call: Call) -> str | None:
        if call.with_entropy:
            return "the fused strategy has no entropy statistic"
        if call.with_logit_sum:
            return "the fused strategy has no logits' sum (mean_logits)"
        return None

    def statistics(self, x, w, b, target, class_weight, opts, chunk_tokens, entropy=None, logit_sum=None,
                   row_max=False):
        assert opts.logit_scale == 1.0 and entropy is None and logit_sum is None, \
            "the fused kernels take no logit scale, no entropy and no logits' sum"
        return _fused_kernels().fused_ce_forward(
            x, w, b, target, class_weight, ignore_index=opts.ignore_index, label_smoothing=opts.label_smoothing,
            z_loss=opts.z_loss, softcap=opts.softcap, return_stats=True)

    def gradients(self, x, w, b, target, class_weight, opts, stats, grad_tok, *, need_dx, need_dw, need_db,
                  weight_grad_accum, chunk_tokens, entropy=None, grad_entropy=None):
        alert_not_deterministic("impl='fused' forms dX, dW and db with fp32 atomic adds")
        return _fused_kernels().fused_ce_backward(
            x, w, b, target, class_weight, stats, grad_tok, ignore_index=opts.ignore_index,
            label_smoothing=opts.label_smoothing, z_loss=opts.z_loss, softcap=opts.softcap, need_dx=need_dx,
            need_dw=need_dw, need_db=need_db)


def plain_options_reason(what: str, call: Call) -> str | None:
    """Why a pass that computes plain cross-entropy statistics only (at a temperature, with the entropy) cannot take
    the call's options, or None."""
    opts = call.opts
    if call.b is not None or call.class_weight is not None or opts.label_smoothing or opts.z_loss \
            or opts.softcap is not None:
        return f"{what} takes no bias, class weights, label smoothing, z-loss or softcap"
    if call.with_logit_sum:
        return f"{what} has no logits' sum (mean_logits)"
    return None


class Gluon(Strategy):
    name = GLUON

    def unsupported(self, call: Call) -> str | None:
        if (reason := plain_options_reason("the Gluon pass", call)) is not None:
            return reason  # a logits' sum takes the chunked pass, whose row kernels carry it
        if not call.x2d.is_cuda:
            return f"the Gluon pass runs on a CUDA GPU, not on {call.x2d.device.type} tensors"
        if is_traced(call.x2d, call.w):  # fake tensors have no address to check TMA's alignment on
            return "the Gluon pass does not run under torch.compile tracing"
        kernels = _gluon_kernels()
        if kernels is None:
            return "this Triton has no Gluon API the kernel was written for"
        return kernels.unsupported_reason(call.x2d, call.w)

    def gradients(self, x, w, b, target, class_weight, opts, stats, grad_tok, *, need_dx, need_dw, need_db,
                  weight_grad_accum, chunk_tokens, entropy=None, grad_entropy=None):
        # the forward's statistics are of fp32 logits, the recomputation's logits bf16: statistics of those
        return grads_on_own_statistics(x, w, b, target, class_weight, opts, grad_tok, need_dx=need_dx,
                                       need_dw=need_dw, need_db=need_db, weight_grad_accum=weight_grad_accum,
                                       chunk_tokens=chunk_tokens, grad_entropy=grad_entropy)

    def statistics(self, x, w, b, target, class_weight, opts, chunk_tokens, entropy=None, logit_sum=None,
                   row_max=False):
        assert logit_sum is None, "the Gluon pass has no logits' sum"
        return _gluon_kernels().loss_only(x, w, target, opts.ignore_index, chunk_tokens, logit_scale=opts.logit_scale,
                                          entropy=entropy)


class Anchored(Strategy):
    """The anchored pass as a strategy: its statistics pass keeps the partial sums only (`anchored.loss_only`), and a
    gradient recomputes E with the producer (four GEMMs, ~6 bytes of HBM a logit); the three-GEMM uses (the
    gradient formed in the forward, E kept to the backward) are routed by their callers through `anchored_for`."""

    name = ANCHORED

    def unsupported(self, call: Call) -> str | None:
        if (reason := plain_options_reason("the anchored pass", call)) is not None:
            return reason
        if is_traced(call.x2d, call.w):
            return "the anchored pass does not run under torch.compile tracing"
        return None

    def statistics(self, x, w, b, target, class_weight, opts, chunk_tokens, entropy=None, logit_sum=None,
                   row_max=False):
        assert b is None and class_weight is None and logit_sum is None
        res = anchored.loss_only(x, w, target, opts, with_entropy=entropy is not None, chunk_tokens=chunk_tokens,
                                    with_row_max=row_max)
        if entropy is not None:
            entropy.copy_(res.entropy)
        return res.loss, anchored.row_stats(res)

    def gradients(self, x, w, b, target, class_weight, opts, stats, grad_tok, *, need_dx, need_dw, need_db,
                  weight_grad_accum, chunk_tokens, entropy=None, grad_entropy=None):
        if grad_entropy is not None:  # the entropy's gradient is not formed on recomputed E: the chunked strategy's
            return grads_on_own_statistics(x, w, b, target, class_weight, opts, grad_tok, need_dx=need_dx,
                                           need_dw=need_dw, need_db=need_db, weight_grad_accum=weight_grad_accum,
                                           chunk_tokens=chunk_tokens, grad_entropy=grad_entropy)
        plan = anchored.anchored_plan(x.shape[0], w.shape[0], w.shape[1], need_dw=need_dw,
                                      fp32_accum=weight_grad_accum == "fp32" and w.dtype != torch.float32,
                                      chunk_tokens=chunk_tokens)
        res = anchored.anchored_loss_and_grads(x, w, target, opts, grad_tok, per_token_grad=True, need_dx=need_dx,
                                               need_dw=need_dw, plan=plan)
        return res.grads.dx, (res.grads.weight_grad() if need_dw else None), None


STRATEGIES: dict[str, Strategy] = {s.name: s for s in (Anchored(), Chunked(), Fused(), Gluon())}
assert set(IMPLS) == {AUTO, *STRATEGIES} == set(VALID_IMPLS), "a strategy is registered here and validated there"


def _fused_kernels():
    from fusedkern.kernels import fused_ce

    return fused_ce


@functools.cache
def _gluon_kernels():
    """`kernels.gluon_logits_stats`, or None where this Triton cannot import it (no Gluon, another API)."""
    try:
        from fusedkern.kernels import gluon_logits_stats
    except (ImportError, AttributeError):
        return None
    return gluon_logits_stats


def strategy(name: str) -> Strategy:
    return STRATEGIES[name]


def check_supported(impl: str, call: Call) -> None:
    """An explicit impl that cannot take the call raises ValueError naming why (before any kernel runs)."""
    if impl in STRATEGIES and (reason := STRATEGIES[impl].unsupported(call)) is not None:
        raise ValueError(f"impl={impl!r} cannot run this call: {reason}; use impl='auto' (or 'chunked')")


def choose(impl: str, call: Call, *, weight_grad_accum: str = "fp32", chunk_tokens: int | None = None,
           statistics_only: bool = False, fused_fallback: bool = True) -> Strategy:
    """The strategy for a call. impl "auto": "anchored" where `anchored_for` says; else "fused" when the chunked
    buffers (at the caller's `chunk_tokens` when given) do not fit the free GPU memory and `fused_fallback` allows
    it; else, for a statistics-only forward (`statistics_only`: no gradient is formed in this pass; a backward may
    recompute the logits), "gluon" wherever it applies; else "chunked". Never "fused" under deterministic
    algorithms (`fused_fallback_allowed`). An explicit impl is checked (`check_supported`) and kept."""
    if impl != AUTO:
        check_supported(impl, call)
        return STRATEGIES[impl]
    if anchored_for(impl, call):
        return STRATEGIES[ANCHORED]
    if fused_fallback and fused_fallback_allowed() and STRATEGIES[FUSED].unsupported(call) is None \
            and _chunked_needs_more_than_free(call.x2d, call.w, weight_grad_accum, chunk_tokens):
        return STRATEGIES[FUSED]
    if statistics_only and STRATEGIES[GLUON].unsupported(call) is None:
        return STRATEGIES[GLUON]
    return STRATEGIES[CHUNKED]


def anchored_for(impl: str, call: Call) -> bool:
    """Whether a call runs on the anchored pass: impl "anchored" (checked: ValueError where it cannot), or "auto"
    where the strategy takes the call's options, its Gluon producer runs on these operands (sm_90, bf16, aligned; the
    torch reference producer, which an explicit impl="anchored" falls back to elsewhere, is a test oracle, not a
    path "auto" takes) and the pass's buffers (≤ 2 GiB) fit the free GPU memory."""
    if impl == ANCHORED:
        check_supported(impl, call)
        return True
    if impl != AUTO or STRATEGIES[ANCHORED].unsupported(call) is not None:
        return False
    if anchored_producer_reason(call.x2d, call.w) is not None:
        return False
    return not call.x2d.is_cuda or fits_free_memory(anchored.ANCHORED_EXTRA_BUDGET_BYTES, call.x2d.device)


def keeps_anchored_e(x2d: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether an anchored per-token call keeps E of every token from its forward to its backward
    (`anchored.AnchoredLogprobs`: three GEMMs; else the operators' `Anchored` strategy, whose backward recomputes E:
    four): a gradient will follow, the call is not traced (E lives outside the custom operators), and E [T, V] bf16,
    beside the pass's own ≤ 2 GiB, fits the free memory (always, off CUDA); E's rows as allocated (`kept_e_rows`)."""
    if not (torch.is_grad_enabled() and (x2d.requires_grad or w.requires_grad)) or is_traced(x2d, w):
        return False
    T, V = x2d.shape[0], w.shape[0]
    kept = anchored.kept_e_rows(T) * anchored.e_row_stride(V) * 2
    return not x2d.is_cuda or fits_free_memory(kept + anchored.ANCHORED_EXTRA_BUDGET_BYTES, x2d.device)


def formula_on_anchored(impl: str, input: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, *,
                        softcap: float | None = None, temperature: float = 1.0) -> bool:
    """Whether a loss given as a formula of the per-token log-probs (preference, GRPO, SimPO) takes its generic path
    on the anchored pass — the log-probs with E kept to the backward (three GEMMs), the formula in torch on [T] values
    — rather than the chunked engine's formula rows: impl "auto" where the anchored pass takes the call and keeps E."""
    if impl != AUTO or not input.numel():
        return False
    x2d = input.reshape(-1, input.shape[-1])
    opts = LossOptions(softcap=softcap, logit_scale=1.0 / float(temperature))
    return keeps_anchored_e(x2d, w) and anchored_for(impl, Call(x2d, w, b, None, opts))


def fits_free_memory(need: int, device: torch.device) -> bool:
    """Whether `need` bytes are free on a CUDA device: in the caching allocator's reserve, else per the driver."""
    return _cached_bytes_cover(need, device) or torch.cuda.mem_get_info(device)[0] >= need


def anchored_producer_reason(x2d: torch.Tensor, w: torch.Tensor) -> str | None:
    """Why the anchored pass's Gluon producer cannot take these operands (None when it can)."""
    if not x2d.is_cuda:
        return f"the anchored pass's Gluon producer runs on a CUDA GPU, not on {x2d.device.type} tensors"
    try:  # Gluon is imported only on CUDA, and only a Triton with its 3.6 API has it
        from fusedkern.kernels import gluon_anchored_exp
    except (ImportError, AttributeError):
        return "this Triton has no Gluon API the kernel was written for"
    return gluon_anchored_exp.unsupported_reason(x2d, w)


def resolve_impl(impl: str, x2d: torch.Tensor, w: torch.Tensor, weight_grad_accum: str,
                 chunk_tokens: int | None) -> str:
    """'auto' → 'chunked' (the faster strategy for a pass that forms gradients), unless its buffers do not fit
    the free GPU memory: then 'fused', which needs only O(tokens) extra (never under deterministic algorithms:
    `fused_fallback_allowed`). An explicit impl is returned as is."""
    if impl != AUTO:
        return impl
    if fused_fallback_allowed() and _chunked_needs_more_than_free(x2d, w, weight_grad_accum, chunk_tokens):
        return FUSED
    return CHUNKED


def fused_fallback_allowed() -> bool:
    """Whether "auto" may fall back to the fused strategy when memory is short: not under
    `torch.use_deterministic_algorithms(True)`, since the fused backward adds with atomics (the chunked strategy then
    runs, and may run out of memory instead)."""
    return not torch.are_deterministic_algorithms_enabled()


def alert_not_deterministic(what: str) -> None:
    """Under `torch.use_deterministic_algorithms(True)`, refuse a computation whose bits vary from run to run: a
    RuntimeError, or a warning with `warn_only=True` (torch's own convention for its non-deterministic operations)."""
    if not torch.are_deterministic_algorithms_enabled():
        return
    message = (f"{what}, which is not deterministic, and torch.use_deterministic_algorithms(True) is set: use "
               f"impl='chunked' (or 'auto'), whose results are bitwise reproducible (docs/usage.md, 'Determinism')")
    if torch.is_deterministic_algorithms_warn_only_enabled():
        warnings.warn(message, UserWarning, stacklevel=3)
    else:
        raise RuntimeError(message)


def forms_grads_in_forward(impl: str, x2d: torch.Tensor, w: torch.Tensor, weight_grad_accum: str,
                           chunk_tokens: int | None) -> bool:
    """Whether a pass with gradients may take a three-GEMM path (the gradient formed in the forward pass on the
    chunk engine): a strategy that forms them ("gluon" has no backward: its calls with gradients take the chunked
    GEMMs)."""
    name = resolve_impl(impl, x2d, w, weight_grad_accum, chunk_tokens)
    return STRATEGIES[CHUNKED if name == GLUON else name].forms_grads_in_forward


def _chunked_needs_more_than_free(x2d, w, weight_grad_accum, chunk_tokens) -> bool:
    if not x2d.is_cuda or torch.compiler.is_compiling():
        return False  # under torch.compile: the free memory is a driver query, not something a graph can hold
    need = chunked_extra_bytes(x2d.shape[0], w, weight_grad_accum, chunk_tokens)
    return not _cached_bytes_cover(need, x2d.device) and torch.cuda.mem_get_info(x2d.device)[0] < need


def chunked_extra_bytes(n_tokens: int, w: torch.Tensor, weight_grad_accum: str, chunk_tokens: int | None) -> int:
    """Bytes the chunked strategy allocates beyond inputs and gradients: its logits buffer (none when it
    lives in dW's storage) and the fp32 dW accumulator."""
    vocab, hidden = w.shape
    plan = plan_for_grads(n_tokens, w, w.requires_grad, weight_grad_accum, chunk_tokens)
    need = 0 if plan.buffer_in_dw_storage else plan.chunk_tokens * vocab * w.element_size()
    if plan.fp32_accumulator:
        need += vocab * hidden * 4
    return need


def _cached_bytes_cover(need: int, device: torch.device) -> bool:
    """Whether PyTorch's caching allocator already holds `need` free bytes (reserved − allocated: no
    driver call). In a training loop the previous step's buffers are there, so 'auto' asks the
    driver (`cudaMemGetInfo`, which can synchronize and cost far more than this check) only on the first steps."""
    return need <= torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
