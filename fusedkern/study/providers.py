"""The providers the study times: the Hugging Face baselines, the competitors (Liger-Kernel,
cut-cross-entropy, QuACK, torch's F.linear_cross_entropy), fusedkern's variants and the cuBLAS GEMM
floors, each as a `Provider` whose `build(inputs)` returns a `Step` per timing mode.

Modes: `loss_only` (no autograd), `forward` (autograd on, the seed's "forward"), `backward` (forward
untimed, `loss.backward()` timed) and `full` (both). Competitors and fusedkern itself are imported
inside the builders, so a provider whose package is missing or unfinished is skipped (and logged)
instead of breaking the module. A peer that is installed but refuses a shape by its own rule (Liger's CuTe kernel
a vocabulary that is not a multiple of 256, QuACK 0.6.5 a gradient over a chunk of `hidden` rows) raises
`ProviderRefused`, or returns a `Refusal` for the modes it refuses: the sweep writes those rows with the note
"refused: <why>", so tables and figures show the refusal, not a gap.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from fusedkern.reference import logits_to_mean_ce_grad_, softcap_with_derivative_
from fusedkern.study.workloads import IGNORE_INDEX, Inputs

FLOORS_NOTE = (
    "cublas_1gemm and cublas_3gemm are the dense all-token floors whatever the workload: the logits GEMM "
    "and the three GEMMs over every one of the T tokens, with an N(0, 1) logits gradient G, the floor the "
    "project's targets compare against (a provider that skips ignored tokens may go below it). "
    "cublas_3gemm_real_grad does the same all-token GEMMs with the workload's true dL/dz as G (zero rows "
    "on ignored tokens, softcap's chain rule included)."
)


def _no_setup() -> None:
    return None


@dataclass(frozen=True)
class Step:
    """The unit of work of one mode: `setup()` runs untimed before each rep, `run(state)` is timed.

    `run` returns the detached loss (or None for the GEMM floors); its value is recorded once.
    """

    run: Callable[[Any], torch.Tensor | None]
    setup: Callable[[], Any] = _no_setup


def loss_steps(loss_fn: Callable[[], torch.Tensor]) -> dict[str, Step]:
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


class ProviderRefused(ProviderUnavailable):
    """An installed peer refuses this shape by its own rule (Liger's CuTe kernel a vocabulary that is not a multiple
    of 256): the sweep writes a row per mode with note "refused: <why>", so tables and figures show the refusal
    instead of a gap. A refusal of some modes only is a `Refusal` in place of their steps."""


@dataclass(frozen=True)
class Refusal:
    """In a provider's steps, a mode the peer refuses at this shape: the sweep writes its row as refused."""

    reason: str


@dataclass(frozen=True)
class Provider:
    """A named way to compute the op; `build(inputs)` returns its steps by mode.

    `label()` is the name written to the CSV: the key, except for Liger, whose two versions share
    one file and so carry theirs ("liger-kernel 0.8.5"). Every competitor's version is also in
    the sidecar JSON.
    """

    key: str
    build: Callable[[Inputs], dict[str, Step]]
    version_label: Callable[[], str] | None = None  # the CSV's name when it is not the key (Liger)
    is_floor: bool = False
    accuracy: bool = True  # whether it takes part in the accuracy sweep (floors compute no loss)

    def label(self) -> str:
        return self.version_label() if self.version_label is not None else self.key


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
        return loss_steps(lambda: hf_linear_cross_entropy(inp.x, inp.w, inp.target))

    def softcapped() -> torch.Tensor:
        # As Hugging Face's Gemma 2 head: softcap on the logits in their dtype, then the same
        # cross-entropy as the seed's baseline (no fp32 upcast).
        logits = _softcapped(torch.nn.functional.linear(inp.x, inp.w), inp.softcap)  # [T, V]
        return torch.nn.functional.cross_entropy(logits, inp.target, ignore_index=IGNORE_INDEX)

    return loss_steps(softcapped)


def _ce_transformers_loss(inp: Inputs) -> dict[str, Step]:
    """Transformers' causal-LM loss as its models run it: the head's logits in the inputs' dtype (the softcap
    applied there, as Gemma 2's head does), upcast to fp32, then `fixed_cross_entropy` (mean over the valid
    tokens; the label shift left out: the workload's targets are already next tokens)."""
    try:
        from transformers.loss.loss_utils import fixed_cross_entropy
    except ImportError as error:
        raise ProviderUnavailable(f"transformers has no loss_utils.fixed_cross_entropy ({error})") from error

    def loss_fn() -> torch.Tensor:
        logits = _softcapped(torch.nn.functional.linear(inp.x, inp.w), inp.softcap)
        return fixed_cross_entropy(logits.float(), inp.target, ignore_index=IGNORE_INDEX)

    return loss_steps(loss_fn)


def _ce_upcast(inp: Inputs) -> dict[str, Step]:
    from fusedkern.reference import upcast_linear_cross_entropy

    return loss_steps(lambda: upcast_linear_cross_entropy(inp.x, inp.w, inp.target, softcap=inp.softcap))


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
            return loss_steps(lambda: linear_cross_entropy(
                inp.x, inp.w, inp.target, num_valid_tokens=(inp.target != IGNORE_INDEX).sum(), **kwargs))
        return loss_steps(lambda: linear_cross_entropy(inp.x, inp.w, inp.target, **kwargs))

    return build


def _on_gluon(inner: Callable[[Inputs], dict[str, Step]]) -> Callable[[Inputs], dict[str, Step]]:
    """`inner` (a provider built with impl="gluon") made unavailable where the Gluon statistics kernel
    (`kernels/gluon_logits_stats.py`) cannot take the operands, instead of raising in the timed step."""

    def build(inp: Inputs) -> dict[str, Step]:
        from fusedkern.kernels import gluon_logits_stats

        reason = gluon_logits_stats.unsupported_reason(inp.x2d(), inp.w)
        if reason is not None or inp.softcap is not None:
            raise ProviderUnavailable(f"the Gluon loss-only pass: {reason or 'no softcap'}")
        return {"loss_only": inner(inp)["loss_only"]}

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
        return loss_steps(lambda: LigerFusedLinearCrossEntropyFunction.apply(inp.x, inp.w, inp.target))

    # mean over non-ignored tokens, ignore -100
    loss_module = LigerFusedLinearCrossEntropyLoss(
        **_softcap_kwargs(LigerFusedLinearCrossEntropyLoss, inp, "LigerFusedLinearCrossEntropyLoss"))
    return loss_steps(lambda: loss_module(inp.w, inp.x, inp.target))


def _liger_cute_import(module: str, name: str):
    """`name` of `liger_kernel.ops.cutedsl.ops.<module>` (Liger ≥ 0.8.5's CuTe DSL kernels for Hopper): Liger not
    installed raises ImportError (skipped, like the other optional providers); a CuTe DSL that cannot load here
    raises ProviderUnavailable."""
    try:
        return getattr(importlib.import_module(f"liger_kernel.ops.cutedsl.ops.{module}"), name)
    except ImportError as error:
        if error.name == "liger_kernel":
            raise
        raise ProviderUnavailable(f"Liger's CuTe kernel failed to import ({error}): it needs nvidia-cutlass-dsl") \
            from error
    except Exception as error:  # noqa: BLE001 - the CuTe DSL fails in many ways where it cannot run
        raise ProviderUnavailable(f"Liger's CuTe kernel failed to import: {type(error).__name__}: {error}") from error


# Liger 0.8.5's CuTe SM90 fused linear cross-entropy refuses (raises) any V with V % TILE_N != 0 (TILE_N = 256 in
# liger_kernel/ops/cutedsl/ops/_fused_linear_cross_entropy_forward_sm90.py): Qwen's 151936 is 128 past a multiple
LIGER_CUTE_VOCAB_MULTIPLE = 256


def _ce_liger_cute_sm90(inp: Inputs) -> dict[str, Step]:
    """Liger-Kernel's CuTe DSL kernel for Hopper (`liger_kernel.ops.cutedsl`, ≥ 0.8.5): sm_90, bf16, mean,
    no bias, no softcap; it writes the [T, V] bf16 logits once. Needs `nvidia-cutlass-dsl` (as QuACK)."""
    _require_cuda(inp, "Liger's CuTe SM90 kernel")
    _no_softcap(inp, "Liger's CuTe SM90 kernel")
    if torch.cuda.get_device_capability(inp.x.device) != (9, 0):
        raise ProviderUnavailable("Liger's CuTe SM90 kernel runs on compute capability 9.0 only")
    liger_fused_linear_cross_entropy_sm90 = _liger_cute_import("fused_linear_cross_entropy_sm90",
                                                                "liger_fused_linear_cross_entropy_sm90")
    if inp.x.dtype != torch.bfloat16:
        raise ProviderUnavailable("Liger's CuTe SM90 kernel takes bf16 only")
    if inp.w.shape[0] % LIGER_CUTE_VOCAB_MULTIPLE:
        raise ProviderRefused(f"Liger's CuTe SM90 kernel needs a vocabulary that is a multiple of "
                              f"{LIGER_CUTE_VOCAB_MULTIPLE} (its tile N), not {inp.w.shape[0]}")

    def loss():
        # it takes token counts that are multiples of 128 only: a caller pads (timed, as the caller pays it)
        x, target = pad_rows(inp.x.reshape(-1, inp.x.shape[-1]), inp.target.reshape(-1), 128)
        return liger_fused_linear_cross_entropy_sm90(x, inp.w, target, IGNORE_INDEX, "mean")

    return loss_steps(loss)


def pad_rows(x2d: torch.Tensor, target: torch.Tensor, multiple: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x2d [n, H] and target [n] with zero rows and ignored targets appended up to a multiple of `multiple` rows
    (returned as they are when n already is one): the copy a caller makes for a kernel that takes only such row
    counts. The mean over the valid targets is unchanged, and x2d's gradient flows back through the copy."""
    pad = -x2d.shape[0] % multiple
    if pad == 0:
        return x2d, target
    return (torch.cat([x2d, x2d.new_zeros(pad, x2d.shape[1])]),
            torch.cat([target, target.new_full((pad, ), IGNORE_INDEX)]))


# The RL log-prob pass: per-token log p(target) at a sampling temperature and the entropy (verl's and
# TRL's GRPO quantities), reduced the same way for every provider so that their losses compare.
LOGPROB_TEMPERATURE = 0.7
LOGPROB_ENTROPY_COEF = 0.01


def _logprob_objective(logps: torch.Tensor, entropy: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    count = (target != IGNORE_INDEX).sum().clamp(min=1)
    return (-logps.float().sum() - LOGPROB_ENTROPY_COEF * entropy.float().sum()) / count


def _logprobs_fusedkern(counted: str | None = None, impl: str = "auto") -> Callable[[Inputs], dict[str, Step]]:
    """`linear_logprobs` at LOGPROB_TEMPERATURE with the entropy; counted as in `_ce_fusedkern`."""
    def build(inp: Inputs) -> dict[str, Step]:
        from fusedkern import linear_logprobs

        _no_softcap(inp, "the log-prob pass (timed without softcap, as Liger's kernel takes none)")
        kwargs = {"temperature": LOGPROB_TEMPERATURE, "return_entropy": True, "impl": impl}
        if counted == "host":
            kwargs["num_valid_tokens"] = int((inp.target != IGNORE_INDEX).sum())

        def loss():
            logps, entropy = linear_logprobs(inp.x, inp.w, inp.target, **kwargs)
            return _logprob_objective(logps, entropy, inp.target)

        return loss_steps(loss)

    return build


#: the vocabulary width of the tiles `trl.trainer.utils.add_fused_lm_head` projects (trl 1.16; tests/test_bench.py
#: checks it against the installed TRL's)
TRL_VOCAB_TILE = 32768


def _trl_fused_lm_head(temperature: float = 1.0, with_entropy: bool = False) -> Callable[[Inputs], dict[str, Step]]:
    """TRL's fused LM head (`trl.kernels.ChunkedLogProbFunction`, trl ≥ 1.16: what SFTTrainer's default
    `loss_type="nll"` and GRPOTrainer run through `add_fused_lm_head`), called as that head's forward calls it after
    the backbone: on a CUDA device only the rows with a label (`x[mask]`, the host sync included in the step), a
    softcap as the model's `final_logit_softcapping`, the per-token outputs scattered back among zeros; the loss
    −Σ log p / count (its SFT loss), or with the entropy `_logprob_objective` at `temperature`."""

    def build(inp: Inputs) -> dict[str, Step]:
        try:
            from trl.kernels import ChunkedLogProbFunction
        except ImportError as error:
            if error.name in ("trl", "transformers"):
                raise  # not installed: skipped, like the other optional providers
            raise ProviderUnavailable(f"trl has no kernels.ChunkedLogProbFunction ({error})") from error
        x2d, target = inp.x.reshape(-1, inp.x.shape[-1]), inp.target.reshape(-1)
        outputs = ("log_probs", "entropy") if with_entropy else ("log_probs", )

        def loss():
            mask = target != IGNORE_INDEX
            compact = x2d.is_cuda  # as TRL: compacted on Triton devices, every row scored elsewhere
            rows_x, rows_y = (x2d[mask], target[mask]) if compact else (x2d, target.clamp(min=0))
            log_probs, entropy, *_ = ChunkedLogProbFunction.apply(rows_x, inp.w, None, rows_y, temperature,
                                                                  TRL_VOCAB_TILE, inp.softcap, 1.0, outputs)

            def back(values):
                if compact:
                    return values.new_zeros(mask.shape).masked_scatter(mask, values)
                return values.masked_fill(~mask, 0)

            if with_entropy:
                return _logprob_objective(back(log_probs), back(entropy), target)
            return -back(log_probs).sum() / mask.sum().clamp(min=1)

        return loss_steps(loss)

    return build


def _logprobs_liger_cute_sm90(inp: Inputs) -> dict[str, Step]:
    """Liger-Kernel's CuTe DSL fused scaled cross-entropy for Hopper (≥ 0.8.5): per-token NLL at a temperature
    and the entropy (bf16), no logits in HBM; sm_90, bf16, no bias, no softcap; validates the targets' range
    with a host sync, as users get it by default."""
    _require_cuda(inp, "Liger's CuTe SM90 scaled cross-entropy")
    _no_softcap(inp, "Liger's CuTe SM90 scaled cross-entropy")
    if torch.cuda.get_device_capability(inp.x.device) != (9, 0) or inp.x.dtype != torch.bfloat16:
        raise ProviderUnavailable("Liger's CuTe SM90 scaled cross-entropy needs compute capability 9.0 and bf16")
    scaled_ce = _liger_cute_import("fused_scaled_cross_entropy_sm90", "LigerFusedScaledCrossEntropySM90Function")
    x2d, target = inp.x.reshape(-1, inp.x.shape[-1]), inp.target.reshape(-1)

    def loss():
        nll, entropy = scaled_ce.apply(
            x2d, inp.w, target, LOGPROB_TEMPERATURE, IGNORE_INDEX, 1, True)
        return _logprob_objective(-nll, entropy, target)

    return loss_steps(loss)


def _gathered(build: Callable[[Inputs], dict[str, Step]]) -> Callable[[Inputs], dict[str, Step]]:
    """A peer called on the valid rows only, the two lines a user can write: `keep = target != -100`, then
    the peer on `x[keep]`, `target[keep]` — inside the timed step, the host sync of the boolean index
    included (dX reaches x through the index's backward). A peer that refuses the kept shape is unavailable."""
    def wrapped(inp: Inputs) -> dict[str, Step]:
        if inp.op != "ce":
            raise ProviderUnavailable("+gather is timed for cross-entropy only")

        def kept() -> Inputs:
            keep = inp.target != IGNORE_INDEX
            return replace(inp, x=inp.x[keep], target=inp.target[keep])

        # untimed: a peer that cannot take this shape raises ProviderUnavailable here, or refuses some modes
        refused = {mode: step for mode, step in build(kept()).items() if isinstance(step, Refusal)}
        if "backward" in refused:  # its loss function comes with the backward step: only its loss-only pass runs
            return {"loss_only": Step(lambda _: build(kept())["loss_only"].run(None)), **refused}
        return {**loss_steps(lambda: build(kept())["backward"].setup()), **refused}

    return wrapped


def _ce_cut_cross_entropy(inp: Inputs) -> dict[str, Step]:
    _require_cuda(inp, "cut-cross-entropy")
    from cut_cross_entropy import linear_cross_entropy

    # Default filter_eps ("high"): the setting a user gets, and the one its README benchmarks.
    kwargs = _softcap_kwargs(linear_cross_entropy, inp, "cut_cross_entropy.linear_cross_entropy")
    return loss_steps(lambda: linear_cross_entropy(inp.x, inp.w, inp.target, **kwargs))


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
        return loss_steps(lambda: F.linear_cross_entropy(inp.x, inp.w, inp.target, **kwargs))

    return build


QUACK_CHUNK = 4096  # chunked_linear_cross_entropy's default chunk_size (tokens)


def quack_chunk_size(hidden: int) -> int:
    """The chunk the study passes to QuACK: its default 4096 tokens, but 8192 at hidden 4096 (see `quack_refusal`),
    the call a QuACK 0.6.5 user at that hidden size must write."""
    return 2 * QUACK_CHUNK if hidden == QUACK_CHUNK else QUACK_CHUNK


def quack_refusal(tokens: int, hidden: int, chunk: int) -> str | None:
    """Why QuACK 0.6.5's scaled-exp pipeline refuses a gradient at this shape, or None. Each chunk's dX GEMM
    ([rows, hidden] out) scales its output by a per-row vector whose orientation QuACK's epilogue infers from the
    shape, and raises "operand 'v': m == n makes row/col inference ambiguous" when a chunk has exactly `hidden` rows:
    full chunks have `chunk` rows, the last one its rows rounded up to 128 (`scaled_exp_linear_cross_entropy_fwd`).
    Its eval pass (no gradient) has no such chunk."""
    if tokens <= chunk:
        rows = {-(-tokens // 128) * 128}
    else:
        rest = tokens - (-(-tokens // chunk) - 1) * chunk
        rows = {chunk, -(-rest // 128) * 128}
    if hidden in rows:
        return (f"QuACK's scaled-exp dX GEMM cannot take a chunk of {hidden} rows = hidden ({tokens} tokens in chunks "
                f"of {chunk}): it raises 'm == n makes row/col inference ambiguous'")
    return None


def _ce_quack(inp: Inputs) -> dict[str, Step]:
    """QuACK (`quack-kernels`, Dao-AILab; the 0.6 API): `chunked_linear_cross_entropy`, the call its
    `LinearCrossEntropy` module makes when given a chunk size, with the tuned GEMMs. 0.6.5 takes its "scaled-exp"
    pipeline by itself where eligible (SM90, bf16, V % 128 == 0): with a gradient it forms dX and dW inside its
    forward (whatever the grad mode), without one (loss_only) it runs its eval pass, one GEMM with an lse and target
    logit epilogue. The chunk is `quack_chunk_size(H)`; the modes with a gradient are refused where
    `quack_refusal` says so (0.6.5 only: earlier versions have no scaled-exp pipeline)."""
    _require_cuda(inp, "QuACK")
    _no_softcap(inp, "QuACK's chunked_linear_cross_entropy")
    tokens, hidden = inp.x.shape
    if tokens % 8 or hidden % 8 or inp.w.shape[0] % 8:
        raise ProviderRefused("QuACK's chunked path needs tokens, hidden and vocab multiples of 8 (TMA)")
    try:
        from quack import linear_cross_entropy as quack_lce
    except ImportError as error:
        if error.name == "quack":
            raise  # not installed: skipped, like the other optional providers
        # Its CUTLASS DSL installed with `pip --target` is found only through a .pth file that
        # PYTHONPATH does not run.
        raise ProviderUnavailable(f"quack failed to import ({error}); with pip --target, put "
                                  "<target>/nvidia_cutlass_dsl/dsl_packages on PYTHONPATH too") from error
    except Exception as error:  # noqa: BLE001 - the CuTe DSL fails in many ways where it cannot run
        raise ProviderUnavailable(f"quack failed to import: {type(error).__name__}: {error}") from error

    chunk = quack_chunk_size(hidden)
    steps = loss_steps(lambda: quack_lce.chunked_linear_cross_entropy(inp.x, inp.w, inp.target, chunk_size=chunk,
                                                                      ignore_index=IGNORE_INDEX))
    supported = getattr(quack_lce, "scaled_exp_lce_supported", None)
    reason = quack_refusal(tokens, hidden, chunk)
    if reason is not None and supported is not None and supported(inp.x, inp.w, chunk, "mean"):
        steps = {mode: step if mode == "loss_only" else Refusal(reason) for mode, step in steps.items()}
    return steps


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


def mean_ce_logits_grad(inp: Inputs, chunk_rows: int = 1024) -> torch.Tensor:
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
                logits, dsoftcap = softcap_with_derivative_(logits, inp.softcap)
            grad[c0:c1] = logits_to_mean_ce_grad_(logits, target[c0:c1], valid[c0:c1], count,
                                                   dsoftcap=dsoftcap).to(x2d.dtype)
    return grad


def _cublas_3gemm_real_grad(inp: Inputs) -> dict[str, Step]:
    """The three GEMMs of `_cublas_3gemm` with the workload's true ∂L/∂z as G (for SimPO, the mean
    cross-entropy's: the same softmax − one-hot structure, other per-row scales; ignored tokens give zero
    rows, but the GEMMs still run over all T tokens). On the H200 a GEMM's
    time depends on its operands' values (power): a profile measured the chunked path's GEMMs 5 % faster
    than the same shapes on the logits (data/measured/h200/profile_ce.csv), so this floor is expected
    to be the stricter one."""
    return _three_gemm_steps(inp.x2d(), inp.w.detach(), mean_ce_logits_grad(inp))


def _cublas_3gemm_valid(inp: Inputs) -> dict[str, Step]:
    """The floor over the valid rows alone: `_cublas_3gemm` on x[target != -100] (gathered untimed), what a
    path that skips every ignored row without any overhead would cost."""
    return _cublas_3gemm(replace(inp, x=inp.x2d()[inp.target.reshape(-1) != IGNORE_INDEX]))


def _cublas_1gemm_valid(inp: Inputs) -> dict[str, Step]:
    """The loss-only floor over the valid rows alone: the logits GEMM of x[target != -100] (gathered untimed)."""
    return _cublas_1gemm(replace(inp, x=inp.x2d()[inp.target.reshape(-1) != IGNORE_INDEX]))


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

    from fusedkern.reference import simpo_from_logprobs

    n_pairs = x.shape[0] // 2
    logits = _softcapped(F.linear(x, w).float(), softcap)  # [2B, S, V] fp32
    mask = target != IGNORE_INDEX  # [2B, S]
    safe_target = torch.where(mask, target, 0)
    logps = logits.log_softmax(dim=-1).gather(-1, safe_target.unsqueeze(-1)).squeeze(-1)  # [2B, S]
    chosen_nll = F.cross_entropy(logits[:n_pairs].reshape(-1, logits.shape[-1]), target[:n_pairs].reshape(-1),
                                 ignore_index=IGNORE_INDEX, reduction="sum") / mask[:n_pairs].sum().clamp_min(1)
    return simpo_from_logprobs(logps, mask, beta=0.1, gamma=0.5, alpha=1.0, label_smoothing=0.0,
                                chosen_nll=chosen_nll)[0]


def _simpo_hf_fp32(inp: Inputs) -> dict[str, Step]:
    from fusedkern.reference import hf_linear_simpo_loss

    if inp.softcap is not None:
        return loss_steps(lambda: _hf_simpo_fp32_softcapped(inp.x, inp.w, inp.target, inp.softcap))
    return loss_steps(lambda: hf_linear_simpo_loss(inp.x, inp.w, inp.target)[0])


def _simpo_fusedkern(**options) -> Callable[[Inputs], dict[str, Step]]:
    def build(inp: Inputs) -> dict[str, Step]:
        from fusedkern import linear_simpo_loss

        kwargs = {**options, **_softcap_kwargs(linear_simpo_loss, inp, "fusedkern.linear_simpo_loss")}
        return loss_steps(lambda: linear_simpo_loss(inp.x, inp.w, inp.target, **kwargs)[0])

    return build


def _simpo_fusedkern_generic(inp: Inputs) -> dict[str, Step]:
    """SimPO through the generic log-prob primitive: logits recomputed in backward (four GEMMs)."""
    from fusedkern import linear_logprobs
    from fusedkern.simpo import simpo_loss_from_logps

    kwargs = _softcap_kwargs(linear_logprobs, inp, "fusedkern.linear_logprobs")

    def loss_fn():
        logps = linear_logprobs(inp.x, inp.w, inp.target, **kwargs)
        return simpo_loss_from_logps(logps, inp.target != -100)[0]

    return loss_steps(loss_fn)


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

    return loss_steps(loss_fn)


# Preference providers ---------------------------------------------------------------------------
# Each is built per loss type (`Inputs.loss_type`, one of fusedkern.preference.LOSS_TYPES) on the inputs of
# `workloads.make_preference_inputs`. TRL's defaults everywhere (β 0.1; SimPO γ 0.5; NLL weight α 1 for cpo,
# simpo and orpo, 0 otherwise); "robust" with label smoothing 0.1 (at 0 it is "sigmoid").

PREFERENCE_LOSS_ARGS: dict[str, dict[str, float]] = {"robust": {"label_smoothing": 0.1}}


def preference_loss_args(inp: Inputs) -> dict[str, Any]:
    """The keyword arguments of `fusedkern.linear_preference_loss` (and of the reference losses) for the
    inputs' loss type: its reference log-probs (DPO types: per pair; KTO: per sequence, labels, kl)."""
    from fusedkern.preference import DPO_LOSS_TYPES, LOSS_TYPES

    loss_type = inp.loss_type
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown preference loss type {loss_type!r}; choose from {LOSS_TYPES}")
    kwargs: dict[str, Any] = {"loss_type": loss_type, **PREFERENCE_LOSS_ARGS.get(loss_type, {})}
    if loss_type in DPO_LOSS_TYPES:
        kwargs.update(ref_chosen_logps=inp.extras["ref_chosen_logps"],
                      ref_rejected_logps=inp.extras["ref_rejected_logps"])
    elif loss_type == "kto":
        kwargs.update(ref_logps=inp.extras["ref_logps"], kto_labels=inp.extras["kto_labels"], kl=inp.extras["kl"])
    return kwargs


def _preference_fusedkern(**options) -> Callable[[Inputs], dict[str, Step]]:
    def build(inp: Inputs) -> dict[str, Step]:
        from fusedkern import linear_preference_loss

        kwargs = {**preference_loss_args(inp), **options,
                  **_softcap_kwargs(linear_preference_loss, inp, "fusedkern.linear_preference_loss")}
        return loss_steps(lambda: linear_preference_loss(inp.x, inp.w, inp.target, **kwargs)[0])

    return build


def _preference_trl_fp32(inp: Inputs) -> dict[str, Step]:
    """TRL's materialized computation: logits x Wᵀ in the inputs' dtype, `.float()` on all [R, S, V] of them,
    log_softmax, gather the targets, masked per-row sums, then the loss (`reference.upcast_linear_preference_loss`)."""
    from fusedkern.reference import upcast_linear_preference_loss

    kwargs = preference_loss_args(inp)
    return loss_steps(lambda: upcast_linear_preference_loss(inp.x, inp.w, inp.target, softcap=inp.softcap,
                                                            **kwargs)[0])


# Liger-Kernel 0.8.5's chunked preference losses by our loss type: (class name, constructor kwargs). Liger has
# no IPO (its LigerFusedLinearDPOLoss refuses loss_type="ipo"), so the sweep has no Liger row for "ipo".
LIGER_PREFERENCE = {
    "sigmoid": ("LigerFusedLinearDPOLoss", {"loss_type": "sigmoid"}),
    "hinge": ("LigerFusedLinearDPOLoss", {"loss_type": "hinge"}),
    "robust": ("LigerFusedLinearDPOLoss", {"loss_type": "robust", **PREFERENCE_LOSS_ARGS["robust"]}),
    "cpo": ("LigerFusedLinearCPOLoss", {}),
    "simpo": ("LigerFusedLinearSimPOLoss", {}),
    "orpo": ("LigerFusedLinearORPOLoss", {}),
    "kto": ("LigerFusedLinearKTOLoss", {}),
}
LIGER_REFERENCE_TYPES = frozenset({"sigmoid", "hinge", "robust", "kto"})  # Liger's types with a reference


def _preference_liger(ref_model: bool) -> Callable[[Inputs], dict[str, Step]]:
    """Liger-Kernel's chunked fused-linear loss for the inputs' loss type, at its defaults (compiled=True,
    chunk_size=1; β 0.1; CPO/SimPO/ORPO with their NLL term, as TRL).

    Liger's DPO and KTO take no reference log-probs: only a reference model's hidden states and head
    (ref_input, ref_weight), run without grad inside its forward. ref_model False (provider `liger`): they run
    reference-free (use_ref_model=False: the log-ratios are the policy's log-probs), the same GEMM work as
    fusedkern given precomputed reference log-probs, but another loss value for those types (the CSV's loss
    column differs; CPO, SimPO and ORPO have no reference anyway). ref_model True (`liger_ref_model`, DPO
    types and KTO only): the policy's own x and W, detached, as the reference model, one logits GEMM more per
    chunk (what a Liger user without precomputed reference log-probs pays)."""

    def build(inp: Inputs) -> dict[str, Step]:
        _require_cuda(inp, "Liger-Kernel")
        if inp.loss_type not in LIGER_PREFERENCE:
            raise ProviderUnavailable(f"Liger-Kernel has no chunked loss for loss_type {inp.loss_type!r}")
        if ref_model and inp.loss_type not in LIGER_REFERENCE_TYPES:
            raise ProviderUnavailable(f"Liger-Kernel's {inp.loss_type} loss takes no reference model")
        import liger_kernel.chunked_loss as liger

        name, options = LIGER_PREFERENCE[inp.loss_type]
        cls = getattr(liger, name)
        options = {**options, **_softcap_kwargs(cls, inp, name)}
        if inp.loss_type in LIGER_REFERENCE_TYPES:
            options["use_ref_model"] = ref_model
        loss_module = cls(**options)
        call: dict[str, Any] = {"lin_weight": inp.w, "_input": inp.x, "target": inp.target}  # KTO orders x first
        if inp.loss_type == "kto":
            call.update(preference_labels=inp.extras["kto_labels"], kl=inp.extras["kl"])
        if ref_model:
            call.update(ref_input=inp.x.detach(), ref_weight=inp.w.detach())

        def loss_fn() -> torch.Tensor:
            out = loss_module(**call)
            return out[0] if isinstance(out, tuple) else out  # 0.8.5 returns (loss, metrics...)

        return loss_steps(loss_fn)

    return build


# Distillation providers ------------------------------------------------------------------------
# On `workloads.make_distill_inputs`: the student's x, W and targets, the teacher's in extras (no gradient).
# TRL's GKD defaults: β 0.5 (the generalized JSD), τ 1; the loss is the mean over the targets not ignored. A
# head's softcap (`--head gemma2`) applies to both models, as TRL's DistillationTrainer applies each model's own.

DISTILL_ARGS: dict[str, float] = {"beta": 0.5, "temperature": 1.0}
# Liger's LigerFusedLinearJSDLoss defaults: half cross-entropy on the hard labels, half divergence
DISTILL_HARD_MIX = {"weight_hard_loss": 0.5, "weight_soft_loss": 0.5}


def _teacher(inp: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    return inp.extras["teacher_x"], inp.extras["teacher_w"]


def _distill_steps(loss: Callable, inp: Inputs, options: dict) -> dict[str, Step]:
    """`loss(student x, w, teacher x, w, target)` with `DISTILL_ARGS`, `options` and both models' softcap."""
    xt, wt = _teacher(inp)
    kwargs = {**DISTILL_ARGS, **options, "student_softcap": inp.softcap, "teacher_softcap": inp.softcap}
    return loss_steps(lambda: loss(inp.x, inp.w, xt, wt, inp.target, **kwargs))


def _distill_fusedkern(**options) -> Callable[[Inputs], dict[str, Step]]:
    def build(inp: Inputs) -> dict[str, Step]:
        from fusedkern import linear_distillation_loss

        return _distill_steps(linear_distillation_loss, inp, options)

    return build


def _distill_torch_fp32(**options) -> Callable[[Inputs], dict[str, Step]]:
    """The materialized computation: both [T, V] logits in the inputs' dtype, `.float()`, then TRL's GKD
    `generalized_jsd_loss` formula (`reference.upcast_linear_distillation_loss`); the teacher's under no_grad."""
    def build(inp: Inputs) -> dict[str, Step]:
        from fusedkern.reference import upcast_linear_distillation_loss

        return _distill_steps(upcast_linear_distillation_loss, inp, options)

    return build


def _distill_liger(**options) -> Callable[[Inputs], dict[str, Step]]:
    """Liger-Kernel's `LigerFusedLinearJSDLoss` (chunked_loss; compiled=True, its default, as the seed ran Liger):
    β as TRL's (0 forward KL, 1 reverse KL), the soft loss divided by the targets not ignored. Pure divergence
    (weight_hard_loss 0, weight_soft_loss 1) unless `options` say otherwise."""
    def build(inp: Inputs) -> dict[str, Step]:
        _require_cuda(inp, "Liger-Kernel")
        _no_softcap(inp, "LigerFusedLinearJSDLoss")
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

        xt, wt = _teacher(inp)
        kwargs = {"weight_hard_loss": 0.0, "weight_soft_loss": 1.0, **DISTILL_ARGS, "ignore_index": IGNORE_INDEX,
                  **options}
        # Liger's releases differ: some take no beta or no hard/soft weights (another loss), some no biases
        missing = [k for k in kwargs if k not in inspect.signature(LigerFusedLinearJSDLoss).parameters]
        if missing:
            raise ProviderUnavailable(f"this LigerFusedLinearJSDLoss takes no {', '.join(missing)}")
        loss_module = LigerFusedLinearJSDLoss(**kwargs)
        biases = (None, None) if "student_bias" in inspect.signature(loss_module.forward).parameters else ()

        def loss_fn() -> torch.Tensor:
            out = loss_module(inp.x, inp.w, xt, wt, inp.target, *biases)
            return out[0] if isinstance(out, tuple) else out

        return loss_steps(loss_fn)

    return build


def _distill_trl_chunked(inp: Inputs) -> dict[str, Step]:
    """TRL's own fused divergence (`trl.kernels.chunked_divergence.ChunkedDivergenceFunction`, what its
    DistillationTrainer calls): the valid rows gathered (a host sync, as TRL does on Triton devices), fp32
    [4096, 32768] tiles of both models' logits, then the mean over the valid rows."""
    try:
        from trl.kernels.chunked_divergence import ChunkedDivergenceFunction
    except ImportError as error:
        raise ProviderUnavailable(f"trl has no kernels.chunked_divergence ({error})") from error
    xt, wt = _teacher(inp)

    def loss_fn() -> torch.Tensor:
        keep = inp.target.reshape(-1) != IGNORE_INDEX
        divergence, _entropy = ChunkedDivergenceFunction.apply(
            inp.x[keep], inp.w, None, xt[keep], wt, None, DISTILL_ARGS["beta"], DISTILL_ARGS["temperature"],
            1.0, inp.softcap, 1.0, inp.softcap)  # each model's logit scale and final softcap
        return divergence.sum() / keep.sum().clamp(min=1)

    return loss_steps(loss_fn)


def _distill_floor(n_logits: int) -> Callable[[Inputs], dict[str, Step]]:
    """The GEMM floors of distillation: both models' logits GEMMs (n_logits = 2: loss only), and those plus the
    student's dX = G W and dW = Gᵀ X (four GEMMs: forward + backward; the backward mode times the last two) on a
    pre-made N(0, 1) G."""
    def build(inp: Inputs) -> dict[str, Step]:
        x2d, w = inp.x2d(), inp.w.detach()
        xt, wt = _teacher(inp)

        def logits(_):
            with torch.no_grad():
                x2d @ w.T
                xt @ wt.T

        if n_logits == 2:
            return {"loss_only": Step(logits), "forward": Step(logits)}
        steps = _three_gemm_steps(x2d, w, torch.randn(x2d.shape[0], w.shape[0], dtype=x2d.dtype, device=x2d.device))

        def full(state):
            logits(state)
            steps["backward"].run(state)

        return {"backward": steps["backward"], "full": Step(full)}

    return build


def _dist_label_suffix(distribution: str, suffix: str) -> Callable[[], str]:
    base = _dist_label(distribution)
    return lambda: f"{base()} {suffix}"


# The floors, timed in the same rounds as the implementations: one GEMM (loss only), three GEMMs (forward +
# backward, on a random G), and three on the true ∂L/∂z (a GEMM's time depends on its operands' values).
_FLOORS = (Provider("cublas_1gemm", _cublas_1gemm, is_floor=True, accuracy=False),
           Provider("cublas_3gemm", _cublas_3gemm, is_floor=True, accuracy=False))
_REAL_GRAD_FLOOR = Provider("cublas_3gemm_real_grad", _cublas_3gemm_real_grad, is_floor=True, accuracy=False)
_VALID_FLOORS = (Provider("cublas_3gemm_valid", _cublas_3gemm_valid, is_floor=True, accuracy=False),
                 Provider("cublas_1gemm_valid", _cublas_1gemm_valid, is_floor=True, accuracy=False))

PROVIDERS: dict[str, dict[str, Provider]] = {
    "ce": {
        p.key: p
        for p in (
            *_FLOORS, _REAL_GRAD_FLOOR, *_VALID_FLOORS,
            Provider("huggingface_bf16", _ce_hf_bf16),
            Provider("torch_fp32_upcast", _ce_upcast),
            Provider("transformers_loss", _ce_transformers_loss),
            Provider("fusedkern_chunked", _ce_fusedkern(impl="auto")),
            Provider("fusedkern_chunked_lean", _ce_fusedkern(impl="chunked", weight_grad_accum="weight_dtype")),
            Provider("fusedkern_fused", _ce_fusedkern(impl="fused")),
            Provider("fusedkern_chunked_counted", _ce_fusedkern(counted="host", impl="auto")),
            Provider("fusedkern_chunked_lean_counted",
                     _ce_fusedkern(counted="host", impl="chunked", weight_grad_accum="weight_dtype")),
            Provider("fusedkern_chunked_device_count", _ce_fusedkern(counted="device", impl="auto")),
            Provider("fusedkern_chunked_lean_device_count",
                     _ce_fusedkern(counted="device", impl="chunked", weight_grad_accum="weight_dtype")),
            # the chunk-size study: time and memory against the 256 MiB default chunk (1024 tokens at V = 128256)
            *(
                Provider(f"fusedkern_chunked{suffix}_c{c}",
                         _ce_fusedkern(impl="chunked", chunk_tokens=c, weight_grad_accum=accum))
                for c in (512, 2048, 4096, 8192)
                for suffix, accum in (("", "fp32"), ("_lean", "weight_dtype"))
            ),
            Provider("liger", _ce_liger, _dist_label("liger-kernel")),
            Provider("cut_cross_entropy", _ce_cut_cross_entropy),
            Provider("quack", _ce_quack, _dist_label("quack-kernels")),
            Provider("liger_cute_sm90", _ce_liger_cute_sm90, _dist_label_suffix("liger-kernel", "CuTe SM90")),
            # TRL's own fused LM head: what SFTTrainer and GRPOTrainer use by default since trl 1.16 (it scores the
            # labelled rows only, so on a masked workload it is its own "+gather")
            Provider("trl_fused_lm_head", _trl_fused_lm_head(), _dist_label_suffix("trl", "fused LM head")),
            # the loss-only pass pinned to either kernel (fusedkern_chunked takes the library's default, impl="auto")
            Provider("fusedkern_gluon", _on_gluon(_ce_fusedkern(impl="gluon")), accuracy=False),
            Provider("fusedkern_gluon_counted", _on_gluon(_ce_fusedkern(counted="host", impl="gluon")),
                     accuracy=False),
            Provider("fusedkern_tile_pass", _ce_fusedkern(impl="chunked"), accuracy=False),
            Provider("fusedkern_tile_pass_counted", _ce_fusedkern(counted="host", impl="chunked"), accuracy=False),
            # the RL log-prob pass (temperature, entropy): fusedkern's (the library's default, and pinned to the Gluon
            # pass or the tile pass) and Liger's per-token kernels
            Provider("fusedkern_logprobs", _logprobs_fusedkern(), accuracy=False),
            Provider("fusedkern_logprobs_counted", _logprobs_fusedkern(counted="host"), accuracy=False),
            Provider("fusedkern_logprobs_gluon", _on_gluon(_logprobs_fusedkern(impl="gluon")), accuracy=False),
            Provider("fusedkern_logprobs_gluon_counted", _on_gluon(_logprobs_fusedkern(counted="host", impl="gluon")),
                     accuracy=False),
            Provider("fusedkern_logprobs_tile_pass", _logprobs_fusedkern(impl="chunked"), accuracy=False),
            Provider("fusedkern_logprobs_tile_pass_counted", _logprobs_fusedkern(counted="host", impl="chunked"),
                     accuracy=False),
            Provider("trl_logprobs", _trl_fused_lm_head(LOGPROB_TEMPERATURE, with_entropy=True),
                     _dist_label_suffix("trl", "fused LM head log-probs"), accuracy=False),
            Provider("liger_cute_sm90_logprobs", _logprobs_liger_cute_sm90,
                     _dist_label_suffix("liger-kernel", "CuTe SM90 log-probs"), accuracy=False),
            # the peers on the valid rows only (masked workloads; dense, the same as without the gather)
            Provider("huggingface_bf16_gather", _gathered(_ce_hf_bf16)),
            Provider("transformers_loss_gather", _gathered(_ce_transformers_loss)),
            Provider("liger_gather", _gathered(_ce_liger), _dist_label_suffix("liger-kernel", "+gather")),
            Provider("liger_cute_sm90_gather", _gathered(_ce_liger_cute_sm90),
                     _dist_label_suffix("liger-kernel", "CuTe SM90 +gather")),
            Provider("quack_gather", _gathered(_ce_quack), _dist_label_suffix("quack-kernels", "+gather")),
            Provider("cut_cross_entropy_gather", _gathered(_ce_cut_cross_entropy)),
            # torch ≥ 2.13: with LinearCrossEntropyOptions() (chunked, no [T, V] logits) and without (unfused)
            Provider("torch_linear_cross_entropy", _ce_torch_linear_cross_entropy(chunked=True)),
            Provider("torch_linear_cross_entropy_unfused", _ce_torch_linear_cross_entropy(chunked=False)),
        )
    },
    "simpo": {
        p.key: p
        for p in (
            *_FLOORS, _REAL_GRAD_FLOOR,
            Provider("huggingface_fp32", _simpo_hf_fp32),
            Provider("fusedkern_chunked", _simpo_fusedkern(impl="chunked")),
            Provider("fusedkern_chunked_lean", _simpo_fusedkern(impl="chunked", weight_grad_accum="weight_dtype")),
            # chunks of 2048 tokens hold a whole chosen/rejected pair at seq 1024: three GEMMs, 501 MiB
            Provider("fusedkern_chunked_c2048", _simpo_fusedkern(impl="chunked", chunk_tokens=2048)),
            Provider("fusedkern_chunked_lean_c2048",
                     _simpo_fusedkern(impl="chunked", chunk_tokens=2048, weight_grad_accum="weight_dtype")),
            Provider("fusedkern_generic", _simpo_fusedkern_generic),
            Provider("liger", _simpo_liger, _dist_label("liger-kernel")),
        )
    },
    # built once per loss type; the floors (the simpo op's, on the same 2B × S tokens) once per batch
    "preference": {
        p.key: p
        for p in (
            *_FLOORS,
            Provider("trl_fp32", _preference_trl_fp32),
            Provider("fusedkern_chunked", _preference_fusedkern(impl="chunked")),
            Provider("fusedkern_chunked_lean", _preference_fusedkern(impl="chunked", weight_grad_accum="weight_dtype")),
            # every loss without a reference model: see _preference_liger
            Provider("liger", _preference_liger(ref_model=False), _dist_label_suffix("liger-kernel", "ref-free")),
            Provider("liger_ref_model", _preference_liger(ref_model=True),
                     _dist_label_suffix("liger-kernel", "ref-model")),
        )
    },
    # on `workloads.make_distill_inputs`; β 0.5, τ 1 (DISTILL_ARGS); "_hard_mix": Liger's default half CE, half JSD
    "distill": {
        p.key: p
        for p in (
            Provider("cublas_2gemm", _distill_floor(2), is_floor=True, accuracy=False),
            Provider("cublas_4gemm", _distill_floor(4), is_floor=True, accuracy=False),
            Provider("torch_fp32_upcast", _distill_torch_fp32()),
            Provider("fusedkern_chunked", _distill_fusedkern()),
            Provider("fusedkern_chunked_lean", _distill_fusedkern(weight_grad_accum="weight_dtype")),
            Provider("trl_chunked_divergence", _distill_trl_chunked, _dist_label_suffix("trl", "chunked_divergence")),
            Provider("liger", _distill_liger(), _dist_label("liger-kernel")),
            Provider("torch_fp32_upcast_hard_mix", _distill_torch_fp32(**DISTILL_HARD_MIX)),
            Provider("fusedkern_chunked_hard_mix", _distill_fusedkern(**DISTILL_HARD_MIX)),
            Provider("liger_hard_mix", _distill_liger(**DISTILL_HARD_MIX),
                     _dist_label_suffix("liger-kernel", "hard mix")),
        )
    },
}

# The floor each mode of the distill sweep is compared to (the other ops': `results.FLOOR_OF_MODE`).
DISTILL_FLOOR_OF_MODE = {"loss_only": "cublas_2gemm", "forward": "cublas_2gemm", "backward": "cublas_4gemm",
                         "full": "cublas_4gemm"}

# Not in a default preference run: it times what a Liger user pays without precomputed reference log-probs.
PREFERENCE_DEFAULT_EXCLUDED = ("liger_ref_model",)


def select_providers(op: str, names: list[str] | None, *, accuracy: bool = False) -> list[Provider]:
    registry = PROVIDERS[op]
    if names is None:
        excluded = PREFERENCE_DEFAULT_EXCLUDED if op == "preference" else ()
        return [p for p in registry.values() if (p.accuracy or not accuracy) and p.key not in excluded]
    unknown = [n for n in names if n not in registry]
    if unknown:
        raise ValueError(f"unknown {op} providers {unknown}; choose from {sorted(registry)}")
    return [registry[n] for n in names]
