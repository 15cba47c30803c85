"""The output head of a model as the operands of fusedkern's fused loss, for the integrations that read it
(`fusedkern.integrations.transformers`, `fusedkern.integrations.trl`).

fusedkern never calls the head: it computes the loss from `input @ weight.T + bias`. `resolve_head(module)` says
which (weight, bias) the head's own forward would use, and refuses up front what it cannot reproduce:

- an `nn.Linear`: its weight and bias;
- PEFT's `ModulesToSaveWrapper` (`modules_to_save=["lm_head"]`): the active adapter's trained copy when adapters
  are enabled and that adapter has one, else the original module — what the wrapper's forward calls;
- PEFT's LoRA `Linear` (`target_modules=[..., "lm_head"]`): the base layer's weight plus each active adapter's
  low-rank term, logits = X·Wᵀ + b + Σ_a s_a·(D_a(X)·A_aᵀ)·B_aᵀ (+ s_a·b_B,a with `lora_bias`), with D_a the
  adapter's dropout. Without an active dropout (p = 0, eval mode) the term is folded into one weight,
  W_eff = W + Σ s_a·B_a·A_a: one [V, H] temporary and a rank-r GEMM per call; autograd of that sum carries the
  weight's gradient to A_a and B_a. With an active dropout the folded weight cannot be exact (the adapter sees
  D(X), the base sees X), so the low-rank features ride as extra input columns instead: the operands are
  X' = [X | s_a·D_a(X)·A_aᵀ ...] and W' = [W | B_a ...], whose product is the same logits exactly; the dropout
  mask is drawn by the adapter's own dropout module on the head's input, as PEFT's forward draws it.

Everything else — other PEFT tuners (IA³, LoHa, VeRA, …), LoRA variants (DoRA, …), a quantized or otherwise
non-`nn.Linear` base layer, `fan_in_fan_out`, merged adapters with adapters disabled, PEFT's trainable-token
wrapper, any other module — raises TypeError naming the class and what to do (merge the adapter into the weights,
or leave `lm_head` out of the PEFT config).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

__all__ = ["ResolvedHead", "resolve_head", "check_model_head", "peft_class_name"]

_MERGE_ADVICE = ("merge it into the weights (peft_model.merge_and_unload()) or leave lm_head out of the PEFT "
                 "config (target_modules, modules_to_save)")


def peft_class_name(module) -> str | None:
    """"PEFT's ClassName (module)" for a module (or class) of PEFT's, else None (PEFT is not imported for it)."""
    cls = module if isinstance(module, type) else type(module)
    return f"PEFT's {cls.__qualname__} ({cls.__module__})" if cls.__module__.split(".")[0] == "peft" else None


def _refuse(what: str, module, why: str) -> TypeError:
    name = peft_class_name(module) or type(module).__qualname__
    return TypeError(f"{what} cannot compute the logits of the output head {name}: {why}")


@dataclasses.dataclass(frozen=True)
class _Adapter:
    name: str
    lora_A: nn.Module  # nn.Linear(H, r, bias=False)
    lora_B: nn.Module  # nn.Linear(r, V, bias=lora_bias)
    dropout: nn.Module
    scaling: float
    cast_input: bool   # PEFT casts the adapter's input to lora_A's dtype (unless input casting is disabled)

    def dropout_active(self) -> bool:
        d = self.dropout
        return not isinstance(d, nn.Identity) and d.training and getattr(d, "p", 1.0) != 0

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """s·D(x)·Aᵀ [..., r] (the dropout drawn here, on the head's input, as PEFT's forward draws it)."""
        a = self.lora_A.weight
        if self.cast_input and x.dtype != a.dtype:
            x = x.to(a.dtype)
        return self.lora_A(self.dropout(x)) * self.scaling


@dataclasses.dataclass(frozen=True)
class ResolvedHead:
    """The operands of a head: `weight` [V, H] and `bias` of the linear layer its forward runs, and the LoRA
    adapters whose low-rank terms it adds (empty for a plain head)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    adapters: tuple[_Adapter, ...] = ()

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def operands(self, x: torch.Tensor, *, dropout: bool = True) -> tuple[torch.Tensor, torch.Tensor,
                                                                          torch.Tensor | None]:
        """(input, weight, bias) with input @ weight.T + bias = the head's logits for x [..., H]. `dropout=False`:
        the adapters' dropout is not applied (a metric computed beside the loss, without gradient)."""
        weight, bias = self.weight, self.bias
        if not self.adapters:
            return x, weight, bias
        lora_bias = [a.lora_B.bias * a.scaling for a in self.adapters if a.lora_B.bias is not None]
        for b in lora_bias:
            bias = b.to(weight.dtype) if bias is None else bias + b.to(bias.dtype)
        if dropout and any(a.dropout_active() for a in self.adapters):
            # [X | s·D(X)·Aᵀ ...] · [W | B ...]ᵀ: the adapters' features as extra columns (exact under dropout)
            features = [a.features(x).to(x.dtype) for a in self.adapters]
            x = torch.cat([x, *features], dim=-1)
            weight = torch.cat([weight, *(a.lora_B.weight.to(weight.dtype) for a in self.adapters)], dim=1)
            return x, weight, bias
        # W + Σ s·B·A, in the adapters' dtype (fp32 adapters over a bf16 base add their update in fp32) and outside
        # autocast (which would round the product to its dtype); then the base weight's dtype, as PEFT's output
        with torch.autocast(x.device.type, enabled=False):
            delta = sum(a.scaling * (a.lora_B.weight @ a.lora_A.weight) for a in self.adapters)
        return x, weight + delta.to(weight.dtype), bias


def _lora_types():
    """PEFT's LoRA Linear and the wrappers resolved here (PEFT is imported only once a PEFT module was seen)."""
    from peft.tuners.lora.layer import Linear as LoraLinear
    from peft.utils.other import AuxiliaryTrainingWrapper, ModulesToSaveWrapper

    return LoraLinear, ModulesToSaveWrapper, AuxiliaryTrainingWrapper


def resolve_head(module: nn.Module, what: str, *, linear_subclasses: bool = True) -> ResolvedHead:
    """The (weight, bias, LoRA adapters) of `module`'s forward; TypeError for what fusedkern cannot reproduce.

    what: who asks, for the messages ("fusedkern's TRL head"). linear_subclasses: whether a subclass of nn.Linear
    counts as nn.Linear (its forward may do something else: the TRL head accepts only nn.Linear itself)."""
    if type(module) is nn.Linear or (linear_subclasses and isinstance(module, nn.Linear)):
        return ResolvedHead(module.weight, module.bias)
    if peft_class_name(module) is None:
        kind = "a plain nn.Linear" if not linear_subclasses else "an nn.Linear"
        raise TypeError(f"{what} reads the output head's weight directly and needs it (get_output_embeddings()) to be "
                        f"{kind}, or PEFT's LoRA Linear or ModulesToSaveWrapper over one; got "
                        f"{type(module).__name__}")
    LoraLinear, ModulesToSaveWrapper, AuxiliaryTrainingWrapper = _lora_types()
    if type(module) is ModulesToSaveWrapper:
        # the wrapper's forward: the original module when adapters are disabled, no adapter is active or an active
        # one is not among the wrapper's; else the first active adapter's copy
        active = module.active_adapters
        if module.disable_adapters or not active or any(a not in module._adapters for a in active):
            inner = module.original_module
        else:
            inner = module.modules_to_save[active[0]]
        return resolve_head(inner, what, linear_subclasses=linear_subclasses)
    if isinstance(module, AuxiliaryTrainingWrapper):  # TrainableTokensWrapper (trainable_token_indices), …
        raise _refuse(what, module, f"fusedkern reproduces PEFT's LoRA and modules_to_save on the head only; "
                                    f"{_MERGE_ADVICE}")
    if type(module) is not LoraLinear:  # IA³, LoHa, VeRA, a LoRA layer over a quantized base (bnb), …
        raise _refuse(what, module, f"fusedkern reproduces PEFT's LoRA on an nn.Linear head and modules_to_save "
                                    f"only; {_MERGE_ADVICE}")
    return _resolve_lora(module, what)


def _resolve_lora(layer, what: str) -> ResolvedHead:
    """PEFT's LoRA Linear.forward, as operands: the base layer only when adapters are disabled or merged, else the
    base plus each active adapter that the layer holds (vanilla LoRA only)."""
    base = layer.base_layer
    if type(base) is not nn.Linear:
        raise _refuse(what, layer, f"its base layer is {type(base).__qualname__}, not an nn.Linear (a quantized or "
                                   f"wrapped base layer); {_MERGE_ADVICE}")
    if getattr(layer, "fan_in_fan_out", False):
        raise _refuse(what, layer, "fan_in_fan_out=True (a transposed weight) over an nn.Linear; set "
                                   "fan_in_fan_out=False in the LoraConfig")
    if layer.disable_adapters:
        if layer.merged:  # PEFT's forward would unmerge the weights first: a state fusedkern does not change
            raise _refuse(what, layer, "its adapters are merged into the base weight and disabled (PEFT's forward "
                                       "would unmerge them); call peft_model.unmerge_adapter() or enable the adapters")
        return ResolvedHead(base.weight, base.bias)
    if layer.merged:  # the merged weight holds the adapters
        return ResolvedHead(base.weight, base.bias)
    adapters = []
    for name in layer.active_adapters:
        if name not in layer.lora_A.keys():
            continue
        variant = getattr(layer, "lora_variant", {}).get(name)
        if variant is not None or getattr(layer, "use_dora", {}).get(name, False):
            kind = type(variant).__name__ if variant is not None else "DoRA"
            raise _refuse(what, layer, f"adapter {name!r} is a LoRA variant ({kind}: DoRA, aLoRA, …), whose term "
                                       f"is not a low-rank product; {_MERGE_ADVICE}")
        adapters.append(_Adapter(name, layer.lora_A[name], layer.lora_B[name], layer.lora_dropout[name],
                                 float(layer.scaling[name]), getattr(layer, "cast_input_dtype_enabled", True)))
    return ResolvedHead(base.weight, base.bias, tuple(adapters))


def check_model_head(model: nn.Module, what: str, *, linear_subclasses: bool = True) -> ResolvedHead:
    """resolve_head on the output head of `model` (a PEFT model's base model), to refuse before training."""
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return resolve_head(model.get_output_embeddings(), what, linear_subclasses=linear_subclasses)
