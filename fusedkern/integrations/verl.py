"""verl's actor on fusedkern's fused head: `patch()` once, before the actor computes log-probs.

verl (0.9.1, the version tested) computes the actor's per-token log-probs and entropy at the rollout temperature in
two places when `use_fused_kernels` is on, both over the last hidden states and the head's weight, without the
logits:

- `verl.utils.experimental.torch_functional.FusedLinearForPPO` (`fused_kernels_backend="torch"`, and "liger"):
  `forward(hidden_states, vocab_weights, input_ids, temperature)` → (log_probs fp32, entropy in the hidden states'
  dtype),
  [T] or [B, S] as the input; the Hugging Face models' forward (`verl.models.transformers.dense_common` and the
  vision-language ones) builds one at each call;
- `verl.utils.kernel.linear_cross_entropy.linear_cross_entropy` (`fused_kernels_backend="triton"`, and Megatron's
  fused forward): `(hidden, weight, labels, temperature, reduction, dist_process_group)` → (log-probs fp32 over
  the flattened tokens, or their sum or mean; entropy fp32 per token).

`patch()` replaces both with fusedkern — `FusedLinearForPPO.forward` on the class (every instance, however it was
imported) and `linear_cross_entropy` in verl's kernel module and in every loaded verl module that imported it —
computed by `fusedkern.linear_logprobs(..., temperature=τ, return_entropy=True)`: the same outputs (shapes and
dtypes), differentiable in the hidden states and the weight through both outputs, as verl's are. `unpatch()`
restores verl's functions. verl's hooks import these names at each call, so models built before `patch()` use
fusedkern from then on.

Differences: a target of −100 gives a log-prob and entropy of 0 (fusedkern's ignore_index; verl's labels are
rolled input ids, never negative). A tensor-parallel `dist_process_group` of more than one rank (Megatron with its
vocabulary sharded over tensor-parallel ranks) runs verl's own kernel, with a warning: fusedkern has no
vocabulary-parallel entropy. docs/integrations.md ("verl") has the tests and the install.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import sys
import types
import warnings

import torch

from fusedkern.logprobs import linear_logprobs

__all__ = ["patch", "unpatch", "patched", "is_patched", "fused_linear_for_ppo", "fused_linear_cross_entropy",
           "TESTED_VERL"]

TESTED_VERL = "0.9.1"  # the verl release the tests ran (fusedkern[verl] pins it); its minor line is accepted
TORCH_FUNCTIONAL = "verl.utils.experimental.torch_functional"
KERNEL = "verl.utils.kernel.linear_cross_entropy"
MARK = "fusedkern_verl"  # on fusedkern's replacements
_MISSING = object()


def fused_linear_for_ppo(hidden_states: torch.Tensor, vocab_weights: torch.Tensor, input_ids: torch.Tensor,
                         temperature: float = 1.0, *, weight_grad_accum: str = "fp32",
                         chunk_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's `FusedLinearForPPO.forward` through fusedkern: log_softmax((hidden_states @ vocab_weightsᵀ)/τ) at
    input_ids (float32) and the entropy of that distribution (in hidden_states' dtype: verl stores it in a buffer
    of that dtype), shaped like input_ids ([T] or [B, S])."""
    if hidden_states.ndim not in (2, 3):
        raise ValueError(f"hidden_states must be 2D or 3D, got shape {tuple(hidden_states.shape)}")
    if input_ids.shape != hidden_states.shape[:-1]:
        raise ValueError(f"input_ids shape {tuple(input_ids.shape)} must match hidden_states shape "
                         f"{tuple(hidden_states.shape[:-1])}")
    log_probs, entropy = linear_logprobs(hidden_states, vocab_weights, input_ids.to(torch.int64),
                                         temperature=float(temperature), return_entropy=True,
                                         weight_grad_accum=weight_grad_accum, chunk_tokens=chunk_tokens)
    return log_probs, entropy.to(hidden_states.dtype)


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                               temperature: float = 1.0, reduction: str = "none", dist_process_group=None, *,
                               weight_grad_accum: str = "fp32", chunk_tokens: int | None = None,
                               original=None) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's Triton `linear_cross_entropy` through fusedkern: the tokens flattened, (log-probs float32 [N] — or
    their sum, or their mean over the N tokens, for reduction "sum" / "mean" — and the entropy float32 [N]) at
    temperature τ. A `dist_process_group` of more than one rank runs `original` (verl's kernel), with a warning."""
    if not isinstance(reduction, str) or reduction.lower() not in ("none", "sum", "mean"):
        raise ValueError(f"Invalid reduction: {reduction}")
    if dist_process_group is not None and torch.distributed.get_world_size(dist_process_group) > 1:
        if original is None:
            raise ValueError("dist_process_group spans several ranks: fusedkern has no vocabulary-parallel log-probs "
                             "with entropy; call verl's own linear_cross_entropy (pass original=) for tensor "
                             "parallelism")
        _warn_vocab_parallel()
        return original(hidden, weight, labels, temperature, reduction, dist_process_group)
    x = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1).to(torch.int64)
    log_probs, entropy = linear_logprobs(x, weight, y, temperature=float(temperature), return_entropy=True,
                                         weight_grad_accum=weight_grad_accum, chunk_tokens=chunk_tokens)
    reduction = reduction.lower()
    if reduction == "sum":
        log_probs = log_probs.sum()
    elif reduction == "mean":
        log_probs = log_probs.sum() / y.numel()
    return log_probs, entropy


@functools.cache
def _warn_vocab_parallel() -> None:  # once per process
    warnings.warn("fusedkern.integrations.verl: linear_cross_entropy over a tensor-parallel group of more than one "
                  "rank (a vocabulary-sharded head) runs verl's own kernel: fusedkern has no vocabulary-parallel "
                  "entropy", stacklevel=3)


# ----------------------------------------------------------------------------------------------------------------
# the patch


@dataclasses.dataclass(frozen=True)
class _Patch:
    target: object
    name: str
    replacement: object
    original: object  # what the target's own namespace held (_MISSING: inherited or absent, deleted on undo)


@dataclasses.dataclass(frozen=True)
class _Applied:
    options: dict
    patches: tuple[_Patch, ...]
    original_lce: object
    fused_lce: object


_applied: _Applied | None = None


def _import(name: str):
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise ImportError(f"fusedkern.integrations.verl needs verl's {name} (tested with verl {TESTED_VERL}): "
                          f"pip install verl=={TESTED_VERL} (or `pip install -e '.[verl]'` in a clone of fusedkern's "
                          f"repository); importing it failed: {e}") from e


def check_verl_version() -> str:
    """verl's installed version; a warning outside the tested minor release (TESTED_VERL's)."""
    from importlib import metadata

    from packaging.version import InvalidVersion, Version

    try:
        version = metadata.version("verl")
    except metadata.PackageNotFoundError:
        version = "unknown"
    try:
        same = Version(version).release[:2] == Version(TESTED_VERL).release[:2]
    except InvalidVersion:
        same = False
    if not same:
        minor = ".".join(TESTED_VERL.split(".")[:2])
        warnings.warn(f"fusedkern.integrations.verl was tested with verl {TESTED_VERL} (it accepts {minor}.x); verl "
                      f"{version} is installed. The patch replaces {TORCH_FUNCTIONAL}.FusedLinearForPPO.forward and "
                      f"{KERNEL}.linear_cross_entropy: check that they keep their verl {minor} signatures and "
                      "meaning", stacklevel=3)
    return version


def _verl_modules() -> list[types.ModuleType]:
    return [m for name, m in list(sys.modules.items())
            if (name == "verl" or name.startswith("verl.")) and isinstance(m, types.ModuleType)]


def patch(*, weight_grad_accum: str = "fp32", chunk_tokens: int | None = None) -> None:
    """Make verl's fused actor log-probs (`FusedLinearForPPO` and the Triton `linear_cross_entropy`) fusedkern's,
    from now on, in this process (each worker process calls it: verl's workers are Ray actors). Idempotent with
    the same options; other options replace them. ImportError without verl's modules; a warning for a verl outside
    the tested minor release. weight_grad_accum, chunk_tokens: fusedkern's options (docs/usage.md)."""
    global _applied
    options = dict(weight_grad_accum=weight_grad_accum, chunk_tokens=chunk_tokens)
    if _applied is not None and _applied.options == options:
        return
    torch_functional, kernel = _import(TORCH_FUNCTIONAL), _import(KERNEL)
    check_verl_version()
    if _applied is not None:
        unpatch()
    cls = torch_functional.FusedLinearForPPO

    def forward(self, hidden_states, vocab_weights, input_ids, temperature=1.0):
        return fused_linear_for_ppo(hidden_states, vocab_weights, input_ids, temperature, **options)

    original_lce = kernel.linear_cross_entropy
    if getattr(original_lce, MARK, False):
        raise RuntimeError(f"{KERNEL}.linear_cross_entropy is already fusedkern's without a record of verl's")

    @functools.wraps(original_lce)
    def lce(hidden, weight, labels, temperature=1.0, reduction="none", dist_process_group=None):
        return fused_linear_cross_entropy(hidden, weight, labels, temperature, reduction, dist_process_group,
                                          original=original_lce, **options)

    forward.__qualname__ = f"{cls.__qualname__}.forward"
    forward.__doc__ = fused_linear_for_ppo.__doc__
    for fn in (forward, lce):
        setattr(fn, MARK, True)
    patches = [_Patch(cls, "forward", forward, vars(cls).get("forward", _MISSING))]
    patches += [_Patch(m, "linear_cross_entropy", lce, original_lce) for m in _verl_modules()
                if vars(m).get("linear_cross_entropy") is original_lce]
    for p in patches:
        setattr(p.target, p.name, p.replacement)
    _applied = _Applied(options, tuple(patches), original_lce, lce)


def unpatch() -> None:
    """Undo `patch()`: verl's FusedLinearForPPO.forward and linear_cross_entropy again, in every verl module that
    holds fusedkern's (modules imported while patched copied it too). An attribute that other code replaced after
    `patch()` is left as it is, with a warning. No-op when not patched."""
    global _applied
    if _applied is None:
        return
    applied, _applied = _applied, None
    recorded = {(id(p.target), p.name) for p in applied.patches}
    copied = [_Patch(m, "linear_cross_entropy", applied.fused_lce, applied.original_lce) for m in _verl_modules()
              if vars(m).get("linear_cross_entropy") is applied.fused_lce
              and (id(m), "linear_cross_entropy") not in recorded]
    for p in reversed([*applied.patches, *copied]):
        if vars(p.target).get(p.name, _MISSING) is not p.replacement:
            warnings.warn(f"{getattr(p.target, '__name__', p.target)}.{p.name} was replaced by other code after "
                          "fusedkern.integrations.verl.patch(): left as it is", stacklevel=2)
        elif p.original is _MISSING:
            delattr(p.target, p.name)
        else:
            setattr(p.target, p.name, p.original)


def is_patched() -> bool:
    return _applied is not None


@contextlib.contextmanager
def patched(**options):
    """`with patched(**options): ...` — `patch(**options)` for the block; on exit the state before it (unpatched,
    or patched with the enclosing options)."""
    before = None if _applied is None else dict(_applied.options)
    patch(**options)
    try:
        yield
    finally:
        if before is None:
            unpatch()
        else:
            patch(**before)
