"""TRL's trainers on fusedkern's fused LM head: `patch()` once, before the trainer is built.

TRL 1.16 (the version tested, pinned by `fusedkern[trl]`) routes every loss of SFTTrainer, DPOTrainer,
KTOTrainer, GRPOTrainer and RLOOTrainer through one hook: the trainer calls
`trl.trainer.utils.add_fused_lm_head(model, temperature, cast_lm_head_to_fp32, outputs)` in its `__init__`
(on the policy, and on the reference model when there is one), and its loss code then calls
`model(..., labels=labels, fused_lm_head=True)` and reads per-token fields (`log_probs`, `entropy`,
`mean_logits`, `is_top1`) of a `FusedCausalLMOutput`. Every loss type, weighting, clipping and metric is
TRL's own code over those fields. So `patch()` replaces that one function, in TRL's module and in every TRL
module that imported it, by `add_fused_lm_head` below: the same signature and output, computed with
`fusedkern.logprobs.linear_logprobs_with_stats` (no [B, S, V] logits for the policy or the reference model;
the reference runs under TRL's `no_grad`, so fusedkern's loss-only path). Because the trainers' own loss
code runs unchanged, every loss type TRL has for them (DPO's lists of weighted types, GRPO's cispo, sapo,
luspo, vespo, sequence-level importance sampling, `delta`, the bias-corrected KL, …) is covered with TRL's
semantics and metric names, and a TRL release that keeps this documented hook keeps working.

TRL's own head is not raced: while patched, TRL's chunked log-prob function (`trl.trainer.utils`'
`_ChunkedLogProbFunction`, looked up by TRL's head at each call) is replaced by a guard that raises, so a
model that still carries TRL's head (built before `patch()`, or by code holding TRL's function) fails loudly
instead of training silently without fusedkern.

Trainers that compute the logits themselves get their loss function replaced while patched: CPOTrainer and
ORPOTrainer (`concatenated_forward`, trl.experimental), GKDTrainer (`compute_loss`, trl.experimental), and
DistillationTrainer's divergence (`_chunked_divergence_loss`, through `fusedkern.linear_distillation_loss`). A
trainer of these classes built while patched also gets fusedkern's loss bound on the instance at construction (its
`concatenated_forward` or `compute_loss`; for DistillationTrainer, TRL's `_compute_loss` with fusedkern's
divergence), so that, like the trainers whose model carries fusedkern's head, it stays fused after `unpatch()` or
the end of a `patched()` block.

Every change `patch()` makes is a `Patch` record (target object, attribute name, replacement, and what the target
held before), applied by `apply_patches` and undone by `undo_patches`; `unpatch()` undoes that list. `patch()`
checks TRL's version and the attributes it needs (`HOOKS`) first, logs one INFO line naming the trainers it covers,
and a TRL trainer it does not cover (OnlineDPOTrainer, RewardTrainer, …) warns when built while patched.
docs/integrations.md ("TRL") lists what each trainer covers and raises.

Liger-Kernel beside it: `use_liger_kernel=True` makes transformers' `Trainer.train()` apply Liger's kernels to the
policy when training starts. Its layer kernels (RoPE, RMSNorm, SwiGLU) replace parts of the body and leave the
model's forward, and so fusedkern's head, alone. Its fused linear cross-entropy would replace the model's forward
and drop the head: TRL 1.16's SFT, DPO, KTO, GRPO and RLOO trainers switch it off themselves, and a covered trainer
built while patched gets it switched off too (`liger_kernel_config={"fused_linear_cross_entropy": False}` unless
given; `ValueError` if asked for), so Liger brings the body and fusedkern the head. `check_trainer` raises where
Liger's loss would still replace the forward, or already has. `train()` applies Liger to the policy only: a covered
trainer built while patched applies the same layer kernels to its reference model when training starts
(`apply_liger_layers_to_reference`), so that both run the same kernels (DPO's first loss is log 2).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import logging
import sys
import types
import warnings
import weakref

import torch

from fusedkern.anticipated import linear_logprobs_anticipated
from fusedkern.distillation import linear_distillation_loss
from fusedkern.integrations.heads import check_model_head, resolve_head
from fusedkern.integrations.trl_sft import anticipated_pattern, forget_pattern, mark_sft_trainer
from fusedkern.logprobs import is_top1, linear_logprobs_with_stats

logger = logging.getLogger(__name__)

TRL_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
# the trainer modules whose __init__ installs the head (imported by `patch` so that their references are replaced)
TRAINER_MODULES = ("trl.trainer.sft_trainer", "trl.trainer.dpo_trainer", "trl.trainer.kto_trainer",
                   "trl.trainer.grpo_trainer", "trl.trainer.rloo_trainer")
HEAD_MARK = "fusedkern_trl_head"
LOSS_MARK = "fusedkern_trl_loss"  # on a loss function of fusedkern's that a trainer calls in place of TRL's
# the TRL release the tests pin (fusedkern[trl]); patch() accepts its minor release line without a warning
TESTED_TRL = "1.16.0"
# the trainers fusedkern covers on the tested TRL (the live list, read from TRL's modules, goes to patch()'s log line)
COVERED_TRAINERS = ("SFTTrainer", "DPOTrainer", "KTOTrainer", "GRPOTrainer", "RLOOTrainer", "DistillationTrainer",
                    "GKDTrainer", "CPOTrainer", "ORPOTrainer")
MISSING = object()  # a Patch's original where the target had no attribute of that name of its own


@dataclasses.dataclass(frozen=True)
class Hook:
    """An attribute of TRL that `patch()` replaces or reads: `path` (dotted, below `module`). Without a required one
    `patch()` raises; without an optional one, the trainers it serves are not covered."""

    module: str
    path: str
    serves: str
    required: bool = False

    @property
    def name(self) -> str:
        return f"{self.module}.{self.path}"

    def lookup(self):
        """The live object, or None where this TRL lacks it (no such module, or no such attribute; a class's
        attribute must be its own, not inherited, since the patch replaces it on that class)."""
        obj = _import_or_none(self.module)
        for part in self.path.split("."):
            obj = vars(obj).get(part) if isinstance(obj, type) else getattr(obj, part, None)
        return obj


HOOKS = (
    Hook("trl.trainer.utils", "add_fused_lm_head", "the log-prob head of SFT, DPO, KTO, GRPO and RLOO", True),
    Hook("trl.trainer.utils", "FusedCausalLMOutput", "the output of that head", True),
    Hook("trl.trainer.utils", "_ChunkedLogProbFunction", "TRL's own head, refused while patched"),
    Hook("trl.trainer.distillation_trainer", "_chunked_divergence_loss", "DistillationTrainer's divergence"),
    Hook("trl.trainer.distillation_trainer", "DistillationTrainer._compute_loss", "DistillationTrainer's loss"),
    Hook("trl.experimental.gkd", "GKDTrainer.compute_loss", "GKDTrainer's loss"),
    Hook("trl.experimental.cpo", "CPOTrainer.concatenated_forward", "CPOTrainer's loss"),
    Hook("trl.experimental.orpo", "ORPOTrainer.concatenated_forward", "ORPOTrainer's loss"),
)


@dataclasses.dataclass(frozen=True)
class Patch:
    """`target.name = replacement`, undone by putting back `original`: what the target's own namespace held
    (MISSING where the attribute was inherited or absent, so that undoing deletes it)."""

    target: object
    name: str
    replacement: object
    original: object = MISSING

    @classmethod
    def on(cls, target, name: str, replacement) -> Patch:
        """The patch of `target.name` by `replacement`, recording what the target holds now."""
        return cls(target, name, replacement, vars(target).get(name, MISSING))


def apply_patches(patches) -> None:
    """Apply every patch in order; if one fails, the ones already applied are undone before the error propagates."""
    done = []
    try:
        for p in patches:
            setattr(p.target, p.name, p.replacement)
            done.append(p)
    except BaseException:
        undo_patches(done)
        raise


def undo_patches(patches) -> None:
    """Undo the patches, last first. An attribute that other code replaced after the patch is left as it is (with
    a warning): putting back the original would drop that code's own patch."""
    for p in reversed(list(patches)):
        current = vars(p.target).get(p.name, MISSING)
        if current is not p.replacement:
            warnings.warn(f"{_describe(p.target)}.{p.name} was replaced by other code after "
                          "fusedkern.integrations.trl.patch(): left as it is", stacklevel=3)
        elif p.original is MISSING:
            delattr(p.target, p.name)
        else:
            setattr(p.target, p.name, p.original)


def _describe(target) -> str:
    return getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or repr(target)


@dataclasses.dataclass(frozen=True)
class _Applied:
    options: dict
    patches: tuple[Patch, ...]
    head: object  # the head function installed in TRL's modules
    original_head: object  # TRL's add_fused_lm_head
    covered: tuple[str, ...]  # names of the trainer classes whose losses run through fusedkern


_applied: _Applied | None = None


def _trl_utils():
    try:
        return importlib.import_module("trl.trainer.utils")
    except ImportError as e:
        raise ImportError("fusedkern.integrations.trl needs TRL 1.16: pip install -e '.[trl]' in a clone of "
                          "fusedkern's repository (no release on a package index), or pip install trl==1.16.0") from e


class TRLHeadGuard(torch.autograd.Function):
    """Stands in for TRL's chunked log-prob function while fusedkern's patch is on: TRL's own head never runs."""

    @staticmethod
    def forward(ctx, *args):
        raise RuntimeError("TRL's own fused LM head ran while fusedkern.integrations.trl is patched: this model got "
                           "TRL's head (`add_fused_lm_head`) before `patch()` or from code holding TRL's function. "
                           "Call fusedkern.integrations.trl.patch() before building the trainer.")

    @classmethod
    def apply(cls, *args, **kwargs):
        return cls.forward(None, *args)


def check_trl_version() -> list[Hook]:
    """The optional hooks (HOOKS) this TRL lacks. Raises RuntimeError where a required one is missing, whatever the
    version; warns where TRL's version is outside the tested minor release (TESTED_TRL's), naming the hooks the
    patch relies on: a release that keeps them with their meaning keeps working."""
    import trl

    version = str(getattr(trl, "__version__", "unknown"))
    missing = [hook for hook in HOOKS if hook.lookup() is None]
    needed = [hook for hook in missing if hook.required]
    if needed:
        raise RuntimeError(f"TRL {version} has no " + ", ".join(f"{h.name} ({h.serves})" for h in needed)
                           + f", which fusedkern.integrations.trl.patch() needs; it was tested with TRL {TESTED_TRL} "
                           f"(pip install trl=={TESTED_TRL})")
    if not _in_tested_range(version):
        tested = _minor(TESTED_TRL)
        lacking = "" if not missing else "; this TRL lacks " + ", ".join(
            f"{h.name} (not patched: {h.serves})" for h in missing)
        warnings.warn(f"fusedkern.integrations.trl was tested with TRL {TESTED_TRL} (it accepts {tested}.x); TRL "
                      f"{version} is installed. The patch relies on "
                      + ", ".join(h.name for h in HOOKS if h not in missing)
                      + f": check that they keep their TRL {tested} signatures and meaning{lacking}", stacklevel=3)
    return missing


def _minor(version: str) -> str:
    from packaging.version import Version

    return ".".join(str(n) for n in Version(version).release[:2])


def _in_tested_range(version: str) -> bool:
    from packaging.version import InvalidVersion

    try:
        return _minor(version) == _minor(TESTED_TRL)
    except InvalidVersion:
        return False


#: `patch(anticipate_sft=None)`'s value: SFTTrainer's nll/dft stays on the per-token head unless asked for, since the
#: anticipated head ran slower than the per-token one where it was timed (a small hidden size; docs/results.md)
ANTICIPATE_SFT_DEFAULT = False


def patch(*, weight_grad_accum: str = "fp32", chunk_tokens: int | None = None,
          anticipate_sft: bool | None = None) -> None:
    """Make TRL's trainers built from now on compute their losses with fusedkern (see the module docstring).
    Idempotent: a second call with the same options changes nothing; one with other options replaces them.
    `unpatch()` undoes it; trainers built meanwhile keep fusedkern's loss.

    TRL is checked first (`check_trl_version`): RuntimeError where an attribute the patch needs is missing, a
    warning outside the tested minor release. One INFO line on this module's logger names the covered trainers.
    weight_grad_accum, chunk_tokens: fusedkern's options (docs/usage.md). anticipate_sft: SFTTrainer's nll and dft
    losses form their gradient in the forward pass (three vocabulary GEMMs instead of four, `fusedkern.anticipated`;
    exact for any upstream); None takes `ANTICIPATE_SFT_DEFAULT`."""
    global _applied
    if anticipate_sft is None:
        anticipate_sft = ANTICIPATE_SFT_DEFAULT
    options = dict(weight_grad_accum=weight_grad_accum, chunk_tokens=chunk_tokens, anticipate_sft=bool(anticipate_sft))
    if _applied is not None and _applied.options == options:
        return
    _trl_utils()
    check_trl_version()
    if _applied is not None:
        unpatch()
    applied = _plan(options)
    apply_patches(applied.patches)
    _applied = applied
    logger.info("fusedkern.integrations.trl: TRL %s patched; %s compute their losses with fusedkern",
                importlib.import_module("trl").__version__, ", ".join(applied.covered))


def _plan(all_options: dict) -> _Applied:
    """The patches of `patch(**options)` on the TRL modules loaded now (the trainer modules imported first)."""
    options = {k: v for k, v in all_options.items() if k != "anticipate_sft"}  # the head's own options
    utils = _trl_utils()
    trainer_modules = [m for m in map(_import_or_none, TRAINER_MODULES) if m is not None]
    original = utils.add_fused_lm_head
    if getattr(original, HEAD_MARK, False):
        raise RuntimeError("trl.trainer.utils.add_fused_lm_head is already fusedkern's without a record of TRL's")

    @functools.wraps(original)
    def head(model, temperature=1.0, cast_lm_head_to_fp32=False, outputs=("log_probs",)):
        return add_fused_lm_head(model, temperature=temperature, cast_lm_head_to_fp32=cast_lm_head_to_fp32,
                                 outputs=outputs, **options)

    setattr(head, HEAD_MARK, True)
    # the head, in TRL's utils and in every TRL module that imported it
    patches = [Patch.on(mod, "add_fused_lm_head", head) for mod in _trl_modules()
               if vars(mod).get("add_fused_lm_head") is original]
    covered = [name for mod in trainer_modules if any(p.target is mod for p in patches)
               for name, value in vars(mod).items()
               if isinstance(value, type) and name.endswith("Trainer") and value.__module__ == mod.__name__]
    if "_ChunkedLogProbFunction" in vars(utils):  # TRL's head looks it up in its module at each call
        patches.append(Patch.on(utils, "_ChunkedLogProbFunction", TRLHeadGuard))
    # DistillationTrainer: its divergence is a module function of TRL's over both models' hidden states and heads
    distill = _import_or_none("trl.trainer.distillation_trainer")
    distill_cls = getattr(distill, "DistillationTrainer", None)
    if distill_cls is not None and "_chunked_divergence_loss" in vars(distill):
        original_divergence = vars(distill)["_chunked_divergence_loss"]

        @functools.wraps(original_divergence)
        def divergence(*args, **kwargs):
            return fused_chunked_divergence_loss(*args, **options, **kwargs)

        setattr(divergence, LOSS_MARK, True)
        patches.append(Patch.on(distill, "_chunked_divergence_loss", divergence))
        step = vars(distill_cls).get("_compute_loss")
        if isinstance(step, types.FunctionType) and step.__globals__ is vars(distill):
            fused_step = _with_globals(step, _chunked_divergence_loss=divergence)
            setattr(fused_step, LOSS_MARK, True)
            patches.append(Patch.on(distill_cls, "__init__", _init_then(
                distill_cls, functools.partial(_bind, name="_compute_loss", function=fused_step, expected=step))))
        covered.append(distill_cls.__name__)
    # GKDTrainer (trl.experimental; an SFTTrainer, so its model gets the head): its compute_loss
    gkd_cls = getattr(_import_or_none("trl.experimental.gkd"), "GKDTrainer", None)
    if gkd_cls is not None and "compute_loss" in vars(gkd_cls):
        patches += [Patch.on(gkd_cls, "compute_loss", fused_gkd_compute_loss),
                    Patch.on(gkd_cls, "__init__", _init_then(
                        gkd_cls, functools.partial(_bind, name="compute_loss", function=fused_gkd_compute_loss)))]
        covered.append(gkd_cls.__name__)
    # CPO and ORPO (trl.experimental) compute the logits in their own concatenated_forward: replaced, and their
    # __init__ gives the model fusedkern's head (before accelerate wraps its forward in autocast)
    for cls in experimental_trainer_classes():
        if "concatenated_forward" not in vars(cls):
            continue

        def give_head(trainer):
            target = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model
            add_fused_lm_head(target, **options)
            _bind(trainer, "concatenated_forward", fused_concatenated_forward)

        patches += [Patch.on(cls, "concatenated_forward", fused_concatenated_forward),
                    Patch.on(cls, "__init__", _init_then(cls, give_head))]
        covered.append(cls.__name__)
    # SFTTrainer: its loss's upstream is anticipated by the policy's head (trl_sft.py), recorded after its __init__
    sft_cls = getattr(_import_or_none("trl.trainer.sft_trainer"), "SFTTrainer", None)
    if all_options.get("anticipate_sft") and sft_cls is not None and "__init__" in vars(sft_cls):
        patches.append(Patch.on(sft_cls, "__init__", _init_then(sft_cls, mark_sft_trainer)))
    # any other TRL trainer built while patched warns (transformers' Trainer.__init__: every TRL trainer calls it)
    base = importlib.import_module("transformers").Trainer
    patches.append(Patch.on(base, "__init__", _warn_uncovered_init(base.__init__, tuple(covered))))
    return _Applied(all_options, tuple(patches), head, original, tuple(covered))


def _trl_modules() -> list[types.ModuleType]:
    return [mod for name, mod in list(sys.modules.items())
            if (name == "trl" or name.startswith("trl.")) and isinstance(mod, types.ModuleType)]


def _init_then(cls, after):
    """`cls.__init__` followed by `after(trainer)`: what a trainer of `cls` built while patched gets."""
    original_init = cls.__init__

    @functools.wraps(original_init)
    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        after(self)

    return init


def _bind(trainer, name: str, function, expected=None) -> None:
    """Bind `function` as the trainer's own `name`, so that its loss stays fusedkern's after `unpatch()` — unless
    the trainer's class overrides that attribute (`expected`: what the class resolves it to when it does not;
    default `function`, the class patch)."""
    if getattr(type(trainer), name, None) is (function if expected is None else expected):
        setattr(trainer, name, types.MethodType(function, trainer))


def _with_globals(function: types.FunctionType, **names) -> types.FunctionType:
    """A copy of `function` (the same code) whose global `names` are the given objects; its other globals are its
    module's at the time of the copy."""
    copy = types.FunctionType(function.__code__, {**function.__globals__, **names}, function.__name__,
                              function.__defaults__, function.__closure__)
    copy.__kwdefaults__ = function.__kwdefaults__
    return functools.update_wrapper(copy, function)


def _trl_trainer_name(cls) -> str | None:
    """The name of the nearest TRL class in `cls`'s MRO (a user's subclass of a TRL trainer is that trainer; a
    deprecated alias of a trainer keeps its name), None for a class outside TRL."""
    for c in cls.__mro__:
        module = getattr(c, "__module__", None) or ""
        if module == "trl" or module.startswith("trl."):
            return c.__name__
    return None


def _warn_uncovered_init(original_init, covered: tuple[str, ...]):
    """transformers' `Trainer.__init__`, warning first when the trainer is a TRL trainer that the patch does not
    cover (its loss code is not fusedkern's and may compute the full logits); a covered trainer's Liger options are
    kept to Liger's layer kernels after it (`liger_layers_only`)."""

    @functools.wraps(original_init)
    def init(self, *args, **kwargs):
        name = _trl_trainer_name(type(self))
        if name is not None and name not in covered:
            warnings.warn(f"fusedkern.integrations.trl does not cover {name} (it covers {', '.join(covered)}): built "
                          "while patched, it still trains with its own loss code, which may run without fusedkern; "
                          "check_trainer(trainer) raises where its model lacks fusedkern's head", stacklevel=3)
        original_init(self, *args, **kwargs)
        if name is not None and name in covered:
            liger_layers_only(self)
            if getattr(self.args, "use_liger_kernel", False):  # the subclass sets ref_model after this __init__
                self.add_callback(_liger_reference_callback()(self))

    return init


def liger_layers_only(trainer) -> None:
    """With `args.use_liger_kernel`, keep Liger to its layer kernels: `fused_linear_cross_entropy=False` in
    `args.liger_kernel_config` unless it is given (as TRL 1.16's SFT, DPO, KTO, GRPO and RLOO trainers do
    themselves; CPO, ORPO, GKD and DistillationTrainer leave Liger's default, which replaces the model's forward when
    training starts and would drop fusedkern's head). ValueError if it is given as True."""
    args = getattr(trainer, "args", None)
    if not getattr(args, "use_liger_kernel", False):
        return
    config = dict(getattr(args, "liger_kernel_config", None) or {})
    if config.get("fused_linear_cross_entropy"):
        raise ValueError(f"{type(trainer).__name__}: liger_kernel_config={{'fused_linear_cross_entropy': True}} "
                         "replaces the model's forward with Liger's loss when training starts, which would drop "
                         "fusedkern's head; with fusedkern.integrations.trl patched, leave it out (Liger's layer "
                         "kernels still apply) or set it to False")
    if "fused_linear_cross_entropy" not in config:
        args.liger_kernel_config = {**config, "fused_linear_cross_entropy": False}
        logger.info("%s: use_liger_kernel=True applies Liger's layer kernels only (fused_linear_cross_entropy=False):"
                    " fusedkern's head computes the log-probs", type(trainer).__name__)


def apply_liger_layers_to_reference(trainer) -> bool:
    """Apply to `trainer.ref_model` the Liger kernels that `Trainer.train()` applies to the policy under
    `args.use_liger_kernel` (Liger's `_apply_liger_kernel_to_instance(model=...)` with `args.liger_kernel_config`, as
    transformers calls it; `fused_linear_cross_entropy=False`, so the reference keeps its fused head): `train()`
    patches `self.model` only, and a reference model running PyTorch's RMSNorm and SwiGLU gives other bits than the
    policy at the same weights (DPO's first loss off log 2). False, applying nothing, without `use_liger_kernel`, a
    reference model, or a `PreTrainedModel` under its wrappers (transformers skips such a policy too)."""
    args = getattr(trainer, "args", None)
    ref_model = getattr(trainer, "ref_model", None)
    if not getattr(args, "use_liger_kernel", False) or ref_model is None:
        return False
    from liger_kernel.transformers import _apply_liger_kernel_to_instance
    from transformers import PreTrainedModel

    accelerator = getattr(trainer, "accelerator", None)
    model = ref_model if accelerator is None else accelerator.unwrap_model(ref_model)
    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not isinstance(model, PreTrainedModel):
        return False
    _apply_liger_kernel_to_instance(model=model, **{**(args.liger_kernel_config or {}),
                                                    "fused_linear_cross_entropy": False})
    return True


@functools.cache
def _liger_reference_callback():
    """The callback class (transformers' `TrainerCallback`, imported when first needed) that a covered trainer with
    `use_liger_kernel=True` gets when built while patched: at `on_train_begin`, after `train()` applied Liger to the
    policy, `apply_liger_layers_to_reference` gives the reference model, if any, the same kernels."""
    from transformers import TrainerCallback

    class LigerLayersOnReference(TrainerCallback):
        def __init__(self, trainer):
            self.trainer = weakref.ref(trainer)  # the trainer holds its callbacks: no cycle through this one

        def on_train_begin(self, args, state, control, **kwargs):
            trainer = self.trainer()
            if trainer is not None and apply_liger_layers_to_reference(trainer):
                logger.info("%s: Liger's layer kernels applied to the reference model too, as to the policy",
                            type(trainer).__name__)

    return LigerLayersOnReference


def liger_loss_would_replace_forward(trainer) -> bool:
    """Whether `Trainer.train()` would apply Liger's fused linear cross-entropy to the trainer's model (replacing its
    forward, and with it fusedkern's head): `args.use_liger_kernel` with `fused_linear_cross_entropy` True in
    `args.liger_kernel_config`, or absent there and True by default in Liger's function for the model's type. False
    without Liger installed (`train()` raises its own ImportError then)."""
    args = getattr(trainer, "args", None)
    if not getattr(args, "use_liger_kernel", False):
        return False
    config = dict(getattr(args, "liger_kernel_config", None) or {})
    if "fused_linear_cross_entropy" in config:
        return bool(config["fused_linear_cross_entropy"])
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError:
        return False
    model = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model
    apply = MODEL_TYPE_TO_APPLY_LIGER_FN.get(getattr(getattr(model, "config", None), "model_type", None))
    parameter = None if apply is None else inspect.signature(apply).parameters.get("fused_linear_cross_entropy")
    return parameter is not None and parameter.default is True


def _forward_is_ligers(model) -> bool:
    """Whether the model's forward is one of Liger's (its fused linear cross-entropy, applied to the instance)."""
    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    func = getattr(model.forward, "__func__", model.forward)
    return (getattr(func, "__module__", None) or "").startswith("liger_kernel")


def unpatch() -> None:
    """Undo `patch()`: the recorded patches, last first (TRL's own functions again for trainers built afterwards;
    trainers built while patched keep fusedkern's loss). A TRL module imported while patched copied fusedkern's
    head from TRL's utils: it gets TRL's head back too. No-op when not patched."""
    global _applied
    if _applied is None:
        return
    applied, _applied = _applied, None
    recorded = {(id(p.target), p.name) for p in applied.patches}
    copied = [Patch(mod, "add_fused_lm_head", applied.head, applied.original_head) for mod in _trl_modules()
              if vars(mod).get("add_fused_lm_head") is applied.head and (id(mod), "add_fused_lm_head") not in recorded]
    undo_patches(list(applied.patches) + copied)


def is_patched() -> bool:
    return _applied is not None


@contextlib.contextmanager
def patched(**options):
    """`patch(**options)` for the duration of a `with` block; on exit the state before it comes back (unpatched,
    or patched with the enclosing options). Trainers built inside keep fusedkern's loss after the block."""
    before = None if _applied is None else dict(_applied.options)
    patch(**options)
    try:
        yield
    finally:
        if before is None:
            unpatch()
        else:
            patch(**before)


def has_fused_head(model) -> bool:
    """Whether `model` (or the model under a PEFT wrapper) carries fusedkern's TRL head."""
    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    seen = 0
    forward = model.forward
    while forward is not None and seen < 16:  # through accelerate's wrappers (autocast, fp32 outputs)
        func = getattr(forward, "__func__", forward)
        if getattr(func, HEAD_MARK, False):
            return True
        forward = getattr(func, "__wrapped__", None) or getattr(func, "model_forward", None)
        seen += 1
    return False


def _is_fused_loss(method) -> bool:
    func = getattr(method, "__func__", method)
    return func is fused_concatenated_forward or func is fused_gkd_compute_loss or getattr(func, LOSS_MARK, False)


def _own_loss_attribute(trainer) -> str | None:
    """The attribute through which `trainer` computes the logits itself (a class hook of HOOKS: DistillationTrainer's
    `_compute_loss`, GKDTrainer's `compute_loss`, CPO's and ORPO's `concatenated_forward`), None for the trainers
    whose loss goes through the model's head."""
    for hook in HOOKS:
        cls_name, _, attr = hook.path.partition(".")
        cls = getattr(sys.modules.get(hook.module), cls_name, None) if attr else None
        if isinstance(cls, type) and isinstance(trainer, cls):
            return attr
    return None


def check_trainer(trainer) -> None:
    """Raise RuntimeError unless the trainer will compute its loss with fusedkern when it trains: its model (and
    reference model, if any) carries fusedkern's head, and where it computes the logits itself (CPO, ORPO, GKD,
    DistillationTrainer) its loss function is fusedkern's — bound at construction when built while patched; and
    `use_liger_kernel=True` would not apply Liger's fused linear cross-entropy (`liger_loss_would_replace_forward`). A
    DistillationTrainer built before `patch()` has fusedkern's divergence only while the patch is on (TRL looks the
    function up at each step); CPO, ORPO and GKD trainers built before `patch()` lack the head."""
    name = type(trainer).__name__
    if liger_loss_would_replace_forward(trainer):
        raise RuntimeError(f"{name} would apply Liger's fused linear cross-entropy when training starts "
                           "(use_liger_kernel=True; liger_kernel_config's fused_linear_cross_entropy is on or "
                           "Liger's default): it replaces the model's forward and drops fusedkern's head; set "
                           "liger_kernel_config={'fused_linear_cross_entropy': False} (Liger's layer kernels only), "
                           "or build the trainer while patched, which does so")
    attr = _own_loss_attribute(trainer)
    if attr is not None and not _is_fused_loss(getattr(trainer, attr)):
        distill = sys.modules.get("trl.trainer.distillation_trainer")
        if attr == "_compute_loss" and is_patched() and _is_fused_loss(vars(distill).get("_chunked_divergence_loss")):
            return
        raise RuntimeError(f"{name}.{attr} is TRL's own: this trainer was built while fusedkern.integrations.trl was "
                           "not patched and would train without fusedkern; build it after patch() or inside patched()")
    if attr == "_compute_loss":  # DistillationTrainer: no head, the divergence reads both heads' weights
        return
    trl_name = _trl_trainer_name(type(trainer))
    note = "" if trl_name is None or trl_name in COVERED_TRAINERS else \
        f" ({trl_name} is not among the trainers it covers: {', '.join(COVERED_TRAINERS)})"
    for role in ("model", "ref_model"):
        model = getattr(trainer, role, None)
        if model is not None and not has_fused_head(model):
            if _forward_is_ligers(model):
                raise RuntimeError(f"trainer.{role}'s forward is Liger's (apply_liger_kernel_to_*(model=..., "
                                   "fused_linear_cross_entropy=True) after the trainer was built), which replaced "
                                   "fusedkern's fused LM head: apply Liger with fused_linear_cross_entropy=False "
                                   "(its layer kernels only)")
            raise RuntimeError(f"trainer.{role} does not carry fusedkern's fused LM head: call "
                               f"fusedkern.integrations.trl.patch() before building the trainer{note}")
        if model is not None:  # a head the fused head cannot read (a PEFT tuner other than LoRA, ...): TypeError now
            check_model_head(model, f"fusedkern's TRL head (trainer.{role})", linear_subclasses=False)


def logit_scale_of(text_config) -> float:
    """The model's multiplier of the logits before any softcap, as TRL reads it (Cohere's logit_scale,
    output_multiplier, Falcon-H1's lm_head_multiplier, Granite's 1/logits_scaling, HyperCLOVA X's
    logits_scaling); 1.0 when none."""
    scale = getattr(text_config, "logit_scale", None)
    if scale is None:
        scale = getattr(text_config, "output_multiplier", None)
    if scale is None:
        scale = getattr(text_config, "lm_head_multiplier", None)
    if scale is None and getattr(text_config, "logits_scaling", None) is not None:
        scaling = text_config.logits_scaling
        scale = scaling if text_config.model_type == "hyperclovax" else 1 / scaling
    return 1.0 if scale is None else float(scale)


def add_fused_lm_head(model, temperature: float = 1.0, cast_lm_head_to_fp32: bool = False,
                      outputs: tuple[str, ...] = ("log_probs",), *, weight_grad_accum: str = "fp32",
                      chunk_tokens: int | None = None) -> None:
    """fusedkern's `trl.trainer.utils.add_fused_lm_head`: `model(..., labels=labels, fused_lm_head=True)` returns
    TRL's `FusedCausalLMOutput` (log_probs, entropy, mean_logits, is_top1, label_mask, loss, aux_loss), computed
    by fusedkern over the positions whose label is not −100; without `fused_lm_head` the original forward runs.

    Raises ValueError for what it cannot reproduce: `log_sum_sq_probs` (DPOConfig(use_weighting=True), WPO),
    a logit scale together with a softcap. `mean_logits` under a final logit softcap is a row sum of the log-probs'
    own pass (`linear_logprobs_with_stats(return_mean_logits=True)`); without one, x · mean(W). At each call,
    TypeError for an `lm_head` that is neither a plain nn.Linear nor PEFT's LoRA Linear or ModulesToSaveWrapper over
    one (those are resolved by `fusedkern.integrations.heads`; other PEFT tuners, DoRA, a quantized base are refused)
    and for DeepSpeed ZeRO-3 parameters."""
    transformers = importlib.import_module("transformers")
    from packaging.version import Version
    outputs = tuple(outputs)
    unknown = [o for o in outputs if o not in TRL_OUTPUTS]
    if unknown:
        raise ValueError(f"outputs must be among {TRL_OUTPUTS}, got {unknown}")
    if "log_sum_sq_probs" in outputs:
        raise ValueError("outputs 'log_sum_sq_probs' (DPOConfig(use_weighting=True), WPO's weights) has no fused "
                         "form in fusedkern; train without use_weighting or unpatch")
    if not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature must be a number > 0, got {temperature!r}")
    text_config = model.config.get_text_config()
    softcap = getattr(text_config, "final_logit_softcapping", None)
    logit_scale = logit_scale_of(text_config)
    if softcap is not None and logit_scale != 1.0:
        raise ValueError(f"a logit scale ({logit_scale}) before a final logit softcap ({softcap}) has no fused form "
                         "in fusedkern")
    if not logit_scale > 0:
        raise ValueError(f"the model's logit scale must be > 0 for fusedkern, got {logit_scale}")
    # no softcap: s = scale·z/τ is a temperature of τ/scale; with a softcap, scale is 1
    effective_temperature = float(temperature) / logit_scale
    want_entropy = "entropy" in outputs
    want_stats = "is_top1" in outputs
    want_mean = "mean_logits" in outputs
    # under a softcap the mean logit is a function of every logit: a row sum the statistics pass carries beside the
    # log-sum-exp (no GEMM of its own); without one it is linear in x, one GEMV (`mean_logits_of`), which leaves the
    # statistics pass free to take the Gluon kernel as the reference model's does
    row_mean = want_mean and softcap is not None
    original_forward = model.forward
    forget_pattern(model)  # a trainer that anticipates its loss's upstream records it after this (trl_sft.py)
    backbone_attr = "base_model"
    if text_config is not model.config and Version(transformers.__version__) < Version("5.0.0"):
        backbone_attr = "model"

    # keeps the original signature: `generate` validates its model kwargs against it
    @functools.wraps(type(model).forward)
    def fused_forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None,
                      mean_logits_at_every_position=False, distill_from=None, **kwargs):
        if not fused_lm_head:
            for key, value in (("labels", labels), ("shift_labels", shift_labels),
                               ("num_items_in_batch", num_items_in_batch)):
                if value is not None:
                    kwargs[key] = value
            return original_forward(*args, **kwargs)
        kwargs["use_cache"] = False
        if getattr(text_config, "output_router_logits", False):
            kwargs.setdefault("output_router_logits", True)
        # looked up at each call (FSDP and PEFT replace modules): a plain nn.Linear, or PEFT's LoRA Linear or
        # ModulesToSaveWrapper over one, resolved to what its forward uses (heads.py); anything else raises TypeError
        head = resolve_head(self.get_output_embeddings(), "fusedkern's TRL head", linear_subclasses=False)
        weight, bias = head.weight, head.bias
        if hasattr(weight, "ds_id"):
            raise TypeError("fusedkern's TRL head does not support DeepSpeed ZeRO-3 parameters (its backward "
                            "recomputes the logits from lm_head.weight)")
        labels = (labels[:, 1:] if shift_labels is None else shift_labels).to(weight.device)
        mask = labels != -100
        # only the scored positions reach the GEMMs. Finding them is a host sync; made before the backbone's kernels
        # are queued, it waits for the previous step's work and the backbone follows at once, where after the
        # backbone (TRL's own head) the GPU would sit idle while the host prepares the head's launches
        rows = mask.reshape(-1).nonzero().squeeze(-1)
        backbone_outputs = getattr(self, backbone_attr)(*args, **kwargs)
        hidden = backbone_outputs.last_hidden_state
        if shift_labels is None:
            hidden = hidden[:, :-1]
        every_mean = None
        if mean_logits_at_every_position:  # [B, S] (CPO's and ORPO's logits/* metrics average over all positions)
            every_mean = mean_logits_of(*head.operands(backbone_outputs.last_hidden_state.to(weight.device),
                                                       dropout=False), effective_temperature)
        hidden = hidden.to(weight.device)
        x = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows)
        y = labels.reshape(-1).index_select(0, rows)
        x, weight, bias = head.operands(x)  # a LoRA adapter's low-rank term, folded or as extra columns
        autocast_ctx = contextlib.nullcontext()
        if cast_lm_head_to_fp32:
            x, weight = x.float(), weight.float()
            bias = None if bias is None else bias.float()
            autocast_ctx = torch.autocast(x.device.type, enabled=False)
        if distill_from is not None:  # GKD: the divergence from a teacher inside the student's (wrapped) forward
            return distill_output(x, weight, bias, rows, mask, distill_from, softcap, logit_scale, num_items_in_batch,
                                  weight_grad_accum, chunk_tokens)
        with autocast_ctx:
            if rows.numel() > 0:
                pattern = anticipated_pattern(self)  # SFTTrainer's nll/dft: the gradient formed in the forward
                head_logprobs = linear_logprobs_with_stats if pattern is None else functools.partial(
                    linear_logprobs_anticipated, anticipate=pattern)
                if row_mean:  # the softcapped mean logit from the same pass (DPO's and KTO's logits/* metrics)
                    head_logprobs = functools.partial(linear_logprobs_with_stats, return_mean_logits=True)
                logps, entropy, row_max, row_lse, *row_means = head_logprobs(
                    x, weight, y, linear_bias=bias, softcap=softcap, temperature=effective_temperature,
                    return_entropy=want_entropy, weight_grad_accum=weight_grad_accum, chunk_tokens=chunk_tokens)
            else:  # an all-masked micro-batch still gives a differentiable zero connected to the model
                logps = x.float().sum(-1)
                entropy, row_max, row_lse = (logps if want_entropy else None), logps.detach(), logps.detach()
                row_means = [logps.detach()]
            # (CPO's and ORPO's every-position means, when asked for, already hold these rows' means)
            if row_mean:
                mean_logits = row_means[0]
            else:
                mean_logits = mean_logits_of(x, weight, bias, effective_temperature) \
                    if want_mean and every_mean is None else None

        def scatter(t):
            return None if t is None else t.new_zeros(mask.shape).masked_scatter(mask, t)

        log_probs = scatter(logps)
        top1 = scatter(is_top1(logps.detach(), row_max, row_lse)) if want_stats else None
        loss = -log_probs.sum() / (mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch)
        aux_loss = None
        if kwargs.get("output_router_logits"):
            from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
            num_experts = getattr(text_config, "num_experts", None) or getattr(text_config, "num_local_experts")
            aux_loss = load_balancing_loss_func(backbone_outputs.router_logits, num_experts,
                                                text_config.num_experts_per_tok, kwargs.get("attention_mask"))
            loss = loss + getattr(text_config, "router_aux_loss_coef", 0.0) * aux_loss
        output_cls = _trl_utils().FusedCausalLMOutput
        return output_cls(loss=loss, log_probs=log_probs, entropy=scatter(entropy) if want_entropy else None,
                          log_sum_sq_probs=None, mean_logits=every_mean if every_mean is not None else
                          scatter(mean_logits), is_top1=top1, label_mask=mask, aux_loss=aux_loss)

    setattr(fused_forward, HEAD_MARK, True)
    model.forward = types.MethodType(fused_forward, model)


def mean_logits_of(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float):
    """Mean over the vocabulary of the logits (x Wᵀ + b)/τ at each row of x [..., H], without gradient: x · mean_v W
    (+ mean b), one GEMV; operands rounded to the autocast dtype first, as the logits GEMM would."""
    with torch.no_grad():
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        # the mean accumulates in fp32 without an fp32 copy of the [V, H] weight
        mean = x.to(dtype).float() @ weight.to(dtype).mean(0, dtype=torch.float32)
        if bias is not None:
            mean = mean + bias.to(dtype).float().mean()
        return mean / temperature


def fused_concatenated_forward(self, model, batch):
    """CPOTrainer's / ORPOTrainer's `concatenated_forward` (trl.experimental) through fusedkern's head: the same
    (chosen_logps, rejected_logps, chosen_logits, rejected_logits, nll_loss[, aux_loss]) with, in place of the
    [B, S, V] logits, their mean over the vocabulary at each position — the trainers use those tensors only for
    the logits/* metrics, as `.mean()`, which is the same number. One backbone pass: ORPO's NLL labels (prompt and
    response) hold its response labels, so one set of per-token log-probs serves both."""
    if self.is_encoder_decoder:
        raise TypeError(f"fusedkern's {type(self).__name__} path covers decoder-only models, not encoder-decoder")
    if not has_fused_head(model):
        raise RuntimeError(f"this {type(self).__name__} was built before fusedkern.integrations.trl.patch(): its model "
                           "has no fused head; build the trainer after patch()")
    orpo = hasattr(self, "padding_value")
    concatenated = self.concatenated_inputs(batch, is_encoder_decoder=False,
                                            padding_value=self.padding_value if orpo else self.pad_token_id,
                                            device=self.accelerator.device)
    len_chosen = batch["chosen_labels"].shape[0]
    input_ids, attention_mask = concatenated["concatenated_input_ids"], concatenated["concatenated_attention_mask"]
    response_labels = concatenated["concatenated_labels"]
    labels = torch.where(attention_mask == 1, input_ids, -100) if orpo else response_labels
    if orpo and not torch.equal(torch.where(response_labels != -100, labels, -100), response_labels):
        raise ValueError("ORPOTrainer's response labels are not its input ids at the attended positions: fusedkern's "
                         "single-pass ORPO path cannot reproduce this batch")
    kwargs = {"output_router_logits": True} if self.aux_loss_enabled else {}
    outputs = model(input_ids, attention_mask=attention_mask, use_cache=False, labels=labels, fused_lm_head=True,
                    mean_logits_at_every_position=True, **kwargs)
    log_probs = outputs.log_probs  # [2B, S − 1], 0 where the shifted label is ignored
    response = response_labels[:, 1:] != -100
    per_seq = (log_probs * response).sum(-1)
    if orpo or self.loss_type in ("ipo", "simpo"):
        per_seq = per_seq / response.sum(-1)
    if orpo:  # nn.CrossEntropyLoss's mean over the chosen rows' non-ignored (prompt and response) targets
        nll = -log_probs[:len_chosen].sum() / outputs.label_mask[:len_chosen].sum()
    elif self.cpo_alpha == 0:
        nll = torch.tensor(0.0).to(self.accelerator.device)
    else:
        nll = -(log_probs[:len_chosen] * response[:len_chosen]).sum() / response[:len_chosen].sum()
    mean_logits = outputs.mean_logits[:, :-1] if orpo else outputs.mean_logits
    result = (per_seq[:len_chosen], per_seq[len_chosen:], mean_logits[:len_chosen], mean_logits[len_chosen:], nll)
    return result + (outputs.aux_loss,) if self.aux_loss_enabled else result


def distill_output(x, weight, bias, rows, mask, distill_from: dict, softcap, logit_scale, num_items_in_batch,
                   weight_grad_accum, chunk_tokens):
    """FusedCausalLMOutput whose loss is GKD's `generalized_jsd_loss` of the student rows x against the teacher's
    (distill_from: the teacher's shifted last hidden states, head, logit scale and softcap, beta, temperature):
    the sum over the valid positions divided by num_items_in_batch, else TRL's default reduction "batchmean" of
    the labelled rows (jsd[mask]), which divides by their count (0 for none)."""
    teacher_hidden = distill_from["hidden"].to(weight.device)
    xt = teacher_hidden.reshape(-1, teacher_hidden.shape[-1]).index_select(0, rows)
    if rows.numel() == 0:
        loss = x.float().sum()
    else:  # x holds the labelled rows only, so "batchmean" with no target divides by their count, as TRL
        loss = linear_distillation_loss(
            x, weight, xt, distill_from["weight"], None, student_bias=bias, teacher_bias=distill_from["bias"],
            beta=float(distill_from["beta"]), temperature=float(distill_from["temperature"]),
            reduction="batchmean" if num_items_in_batch is None else "sum",
            student_logit_scale=logit_scale, student_softcap=softcap, teacher_logit_scale=distill_from["logit_scale"],
            teacher_softcap=distill_from["softcap"], weight_grad_accum=weight_grad_accum, chunk_tokens=chunk_tokens)
    if num_items_in_batch is not None:
        loss = loss / num_items_in_batch
    return _trl_utils().FusedCausalLMOutput(loss=loss, label_mask=mask)


def fused_gkd_compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
    """GKDTrainer's `compute_loss` (trl.experimental) without either model's logits: the teacher's backbone under
    no_grad and the accelerator's autocast (as its prepared forward would run it), then the student's forward with
    fusedkern's head computing `fusedkern.linear_distillation_loss` — the generalized JSD of TRL's
    `generalized_jsd_loss` with the trainer's beta at temperature 1 (as GKD's compute_loss calls it), each model's
    own logit scale and softcap, over the positions whose shifted label is not −100."""
    if not has_fused_head(model):
        raise RuntimeError("this GKDTrainer was built before fusedkern.integrations.trl.patch(): its model has no "
                           "fused head; build the trainer after patch()")
    self.teacher_model.eval()
    teacher = self.accelerator.unwrap_model(self.teacher_model)
    teacher_head = teacher.get_output_embeddings()
    if type(teacher_head) is not torch.nn.Linear:
        raise TypeError(f"fusedkern's GKD path needs the teacher's lm_head to be a plain nn.Linear, got "
                        f"{type(teacher_head).__name__}")
    teacher_config = teacher.config.get_text_config()
    with torch.no_grad(), self.accelerator.autocast():
        teacher_hidden = teacher.base_model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                                            use_cache=False).last_hidden_state
    distill_from = dict(hidden=teacher_hidden[:, :-1], weight=teacher_head.weight, bias=teacher_head.bias,
                        logit_scale=logit_scale_of(teacher_config),
                        softcap=getattr(teacher_config, "final_logit_softcapping", None), beta=self.beta,
                        temperature=1.0)
    outputs = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], labels=inputs["labels"],
                    fused_lm_head=True, num_items_in_batch=num_items_in_batch, distill_from=distill_from)
    return (outputs.loss, outputs) if return_outputs else outputs.loss


def experimental_trainer_classes():
    """CPOTrainer and ORPOTrainer of trl.experimental (empty where this TRL has neither)."""
    classes = []
    for module, name in (("trl.experimental.cpo", "CPOTrainer"), ("trl.experimental.orpo", "ORPOTrainer")):
        try:
            classes.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            continue
    return classes


def _import_or_none(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def fused_chunked_divergence_loss(student_hidden_states, teacher_hidden_states, student_lm_head_weight,
                                  teacher_lm_head_weight, completion_mask, beta, num_items_in_batch=None,
                                  student_lm_head_bias=None, teacher_lm_head_bias=None, student_logit_scale=1.0,
                                  teacher_logit_scale=1.0, student_final_logit_softcapping=None,
                                  teacher_final_logit_softcapping=None, temperature=1.0, *,
                                  weight_grad_accum: str = "fp32", chunk_tokens: int | None = None):
    """TRL DistillationTrainer's `_chunked_divergence_loss` through `fusedkern.linear_distillation_loss`: the same
    arguments and (loss, student entropy summed over the valid positions, their count). The divergence (β, τ, each
    model's logit scale then softcap) and the student's entropy at τ (the metric) come from one fused pass over the
    valid rows only."""
    valid = completion_mask.reshape(-1) != 0
    n_valid = valid.sum()
    rows = valid.nonzero().squeeze(-1)  # a host sync, as TRL's own compaction on a Triton device
    h_s = student_hidden_states.reshape(-1, student_hidden_states.shape[-1]).index_select(0, rows)
    h_t = teacher_hidden_states.reshape(-1, teacher_hidden_states.shape[-1]).index_select(0, rows)
    loss, entropy = linear_distillation_loss(
        h_s, student_lm_head_weight, h_t, teacher_lm_head_weight, None, student_bias=student_lm_head_bias,
        teacher_bias=teacher_lm_head_bias, beta=float(beta), temperature=float(temperature), reduction="sum",
        student_logit_scale=float(student_logit_scale), student_softcap=student_final_logit_softcapping,
        teacher_logit_scale=float(teacher_logit_scale), teacher_softcap=teacher_final_logit_softcapping,
        return_entropy=True, weight_grad_accum=weight_grad_accum, chunk_tokens=chunk_tokens)
    entropy_sum = entropy.sum()
    if num_items_in_batch is None:
        loss = loss / n_valid.clamp(min=1)
    else:
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss, entropy_sum, n_valid
