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
DistillationTrainer's divergence (`_chunked_divergence_loss`, through `fusedkern.linear_distillation_loss`).
`unpatch()` restores every one of them. docs/integrations.md ("TRL") lists what each trainer covers and raises.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import types

import torch

from fusedkern.distillation import linear_distillation_loss
from fusedkern.logprobs import is_top1, linear_logprobs_with_stats

TRL_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
# the trainer modules whose __init__ installs the head (imported by `patch` so that their references are replaced)
TRAINER_MODULES = ("trl.trainer.sft_trainer", "trl.trainer.dpo_trainer", "trl.trainer.kto_trainer",
                   "trl.trainer.grpo_trainer", "trl.trainer.rloo_trainer")
HEAD_MARK = "fusedkern_trl_head"

_patch_state: dict = {}


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


def patch(*, weight_grad_accum: str = "fp32", chunk_tokens: int | None = None) -> None:
    """Make TRL's trainers built from now on compute their per-token log-probs with fusedkern (see the module
    docstring). Idempotent; a second call with other options replaces them. `unpatch()` restores TRL's head.

    weight_grad_accum, chunk_tokens: fusedkern's options (docs/usage.md)."""
    utils = _trl_utils()
    for name in TRAINER_MODULES:
        importlib.import_module(name)
    original = _patch_state.get("original", utils.add_fused_lm_head)
    if getattr(original, HEAD_MARK, False):
        raise RuntimeError("trl.trainer.utils.add_fused_lm_head is already fusedkern's without a record of TRL's")

    @functools.wraps(original)
    def head(model, temperature=1.0, cast_lm_head_to_fp32=False, outputs=("log_probs",)):
        return add_fused_lm_head(model, temperature=temperature, cast_lm_head_to_fp32=cast_lm_head_to_fp32,
                                 outputs=outputs, weight_grad_accum=weight_grad_accum, chunk_tokens=chunk_tokens)

    setattr(head, HEAD_MARK, True)
    if "original" in _patch_state:
        unpatch()
    replaced = []
    for mod_name, mod in list(sys.modules.items()):
        if (mod_name == "trl" or mod_name.startswith("trl.")) and isinstance(mod, types.ModuleType) \
                and mod.__dict__.get("add_fused_lm_head") is original:
            setattr(mod, "add_fused_lm_head", head)
            replaced.append(mod)
    guard_name = "_ChunkedLogProbFunction"  # TRL's head looks it up in its module at each call
    guarded = guard_name in utils.__dict__
    _patch_state.update(original=original, head=head, modules=replaced,
                        guarded=utils.__dict__.get(guard_name) if guarded else None, classes=[])
    if guarded:
        setattr(utils, guard_name, TRLHeadGuard)
    # DistillationTrainer's divergence: a module function of TRL's over both models' hidden states and heads
    distill = sys.modules.get("trl.trainer.distillation_trainer") or _import_or_none("trl.trainer.distillation_trainer")
    if distill is not None and "_chunked_divergence_loss" in distill.__dict__:
        original_divergence = distill.__dict__["_chunked_divergence_loss"]

        @functools.wraps(original_divergence)
        def divergence(*args, **kwargs):
            return fused_chunked_divergence_loss(*args, weight_grad_accum=weight_grad_accum, chunk_tokens=chunk_tokens,
                                                 **kwargs)

        _patch_state["divergence"] = (distill, original_divergence)
        distill._chunked_divergence_loss = divergence
    # CPO and ORPO (trl.experimental) compute the logits in their own concatenated_forward: replaced, and their
    # __init__ gives the model fusedkern's head (before accelerate wraps its forward in autocast)
    gkd = _import_or_none("trl.experimental.gkd")
    if gkd is not None and hasattr(gkd, "GKDTrainer"):
        _patch_state["gkd"] = (gkd.GKDTrainer, gkd.GKDTrainer.__dict__["compute_loss"])
        gkd.GKDTrainer.compute_loss = fused_gkd_compute_loss
    for cls in experimental_trainer_classes():
        original_init = cls.__dict__["__init__"]

        @functools.wraps(original_init)
        def init(self, *args, _original_init=original_init, **kwargs):
            _original_init(self, *args, **kwargs)
            target = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
            add_fused_lm_head(target, weight_grad_accum=weight_grad_accum, chunk_tokens=chunk_tokens)

        _patch_state["classes"].append((cls, original_init, cls.__dict__["concatenated_forward"]))
        cls.__init__ = init
        cls.concatenated_forward = fused_concatenated_forward


def unpatch() -> None:
    """Undo `patch()`: TRL's own `add_fused_lm_head` again (for trainers built afterwards)."""
    if "original" not in _patch_state:
        return
    for mod in _patch_state["modules"]:
        if mod.__dict__.get("add_fused_lm_head") is _patch_state["head"]:
            setattr(mod, "add_fused_lm_head", _patch_state["original"])
    if _patch_state["guarded"] is not None:
        setattr(_trl_utils(), "_ChunkedLogProbFunction", _patch_state["guarded"])
    if "gkd" in _patch_state:
        cls, original_compute_loss = _patch_state["gkd"]
        cls.compute_loss = original_compute_loss
    if "divergence" in _patch_state:
        module, original_divergence = _patch_state["divergence"]
        module._chunked_divergence_loss = original_divergence
    for cls, original_init, original_forward in _patch_state["classes"]:
        cls.__init__ = original_init
        cls.concatenated_forward = original_forward
    _patch_state.clear()


def is_patched() -> bool:
    return "original" in _patch_state


@contextlib.contextmanager
def patched(**options):
    """`patch(**options)` for the duration of a `with` block (trainers built inside keep fusedkern's head; the
    guard against TRL's own head is lifted on exit)."""
    was = is_patched()
    patch(**options)
    try:
        yield
    finally:
        if not was:
            unpatch()


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


def check_trainer(trainer) -> None:
    """Raise RuntimeError unless the trainer's model (and reference model, if any) carries fusedkern's head —
    e.g. after code that re-installs TRL's head on an existing trainer. A DistillationTrainer has no head: its
    divergence is fusedkern's while the patch is on (TRL looks the function up at each step)."""
    distill = sys.modules.get("trl.trainer.distillation_trainer")
    if distill is not None and isinstance(trainer, distill.DistillationTrainer):
        if not is_patched():
            raise RuntimeError("DistillationTrainer computes its divergence with fusedkern only while "
                               "fusedkern.integrations.trl is patched")
        return
    for role in ("model", "ref_model"):
        model = getattr(trainer, role, None)
        if model is not None and not has_fused_head(model):
            raise RuntimeError(f"trainer.{role} does not carry fusedkern's fused LM head: call "
                               "fusedkern.integrations.trl.patch() before building the trainer")


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
    `mean_logits` under a final logit softcap, a logit scale together with a softcap. At each call, TypeError for
    an `lm_head` that is not a plain nn.Linear (a LoRA adapter or modules_to_save wrapper on the head, whose
    weight TRL's own head would read without the adapter) and for DeepSpeed ZeRO-3 parameters."""
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
    if softcap is not None and "mean_logits" in outputs:
        raise ValueError("outputs 'mean_logits' (the trainer's logits/* metrics) under a final logit softcap "
                         f"({softcap}) has no fused form in fusedkern: the mean of softcapped logits needs them all")
    # no softcap: s = scale·z/τ is a temperature of τ/scale; with a softcap, scale is 1
    effective_temperature = float(temperature) / logit_scale
    want_entropy = "entropy" in outputs
    want_stats = "is_top1" in outputs
    want_mean = "mean_logits" in outputs
    original_forward = model.forward
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
        backbone_outputs = getattr(self, backbone_attr)(*args, **kwargs)
        if shift_labels is None:
            hidden, labels = backbone_outputs.last_hidden_state[:, :-1], labels[:, 1:]
        else:
            hidden, labels = backbone_outputs.last_hidden_state, shift_labels
        lm_head = self.get_output_embeddings()  # looked up at each call: FSDP and PEFT replace modules
        if type(lm_head) is not torch.nn.Linear:
            raise TypeError(f"fusedkern's TRL head needs the model's lm_head to be a plain nn.Linear, got "
                            f"{type(lm_head).__name__} (a LoRA adapter or modules_to_save on lm_head is not "
                            "reproduced: leave lm_head out of the PEFT config)")
        weight, bias = lm_head.weight, lm_head.bias
        if hasattr(weight, "ds_id"):
            raise TypeError("fusedkern's TRL head does not support DeepSpeed ZeRO-3 parameters (its backward "
                            "recomputes the logits from lm_head.weight)")
        every_mean = None
        if mean_logits_at_every_position:  # [B, S] (CPO's and ORPO's logits/* metrics average over all positions)
            every_mean = mean_logits_of(backbone_outputs.last_hidden_state.to(weight.device), weight, bias,
                                        effective_temperature)
        hidden = hidden.to(weight.device)
        labels = labels.to(weight.device)
        mask = labels != -100
        autocast_ctx = contextlib.nullcontext()
        if cast_lm_head_to_fp32:
            hidden, weight = hidden.float(), weight.float()
            bias = None if bias is None else bias.float()
            autocast_ctx = torch.autocast(hidden.device.type, enabled=False)
        # only the scored positions reach the GEMMs (a host sync, as TRL's own head on a Triton device)
        rows = mask.reshape(-1).nonzero().squeeze(-1)
        x = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows)
        y = labels.reshape(-1).index_select(0, rows)
        if distill_from is not None:  # GKD: the divergence from a teacher inside the student's (wrapped) forward
            return distill_output(x, weight, bias, rows, mask, distill_from, softcap, logit_scale, num_items_in_batch,
                                  weight_grad_accum, chunk_tokens)
        with autocast_ctx:
            if rows.numel() > 0:
                logps, entropy, row_max, row_lse = linear_logprobs_with_stats(
                    x, weight, y, linear_bias=bias, softcap=softcap, temperature=effective_temperature,
                    return_entropy=want_entropy, weight_grad_accum=weight_grad_accum, chunk_tokens=chunk_tokens)
            else:  # an all-masked micro-batch still gives a differentiable zero connected to the model
                logps = x.float().sum(-1)
                entropy, row_max, row_lse = (logps if want_entropy else None), logps.detach(), logps.detach()
            # (CPO's and ORPO's every-position means, when asked for, already hold these rows' means)
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
