"""Hugging Face Transformers integration: the causal-LM loss of a model computed by
`fusedkern.linear_cross_entropy` straight from the last hidden states, without the [tokens, vocab] logits.

    from fusedkern.integrations.transformers import patch
    model = patch(AutoModelForCausalLM.from_pretrained(...))      # one instance
    patch(LlamaForCausalLM)                                      # or the class, before from_pretrained
    out = model(input_ids, labels=labels, num_items_in_batch=n)  # out.loss from fusedkern, out.logits None

`patch` replaces the model's `forward`: with labels it runs the decoder (`self.model`), keeps the
positions `logits_to_keep` selects, shifts the labels as Transformers' `ForCausalLMLoss` does (left by
one, `ignore_index` appended; or takes `shift_labels` as given), and calls fusedkern on
`lm_head.weight` (and its bias); Gemma2's `final_logit_softcapping` becomes fusedkern's `softcap`. The
loss is the mean over non-ignored targets, or their sum divided by `num_items_in_batch` (int or tensor,
divided on the device). The returned `CausalLMOutputWithPast` has `logits=None` then. Without labels
the original forward runs unchanged (logits as usual; `generate` is unaffected). docs/integrations.md
has the limitations.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

try:
    import transformers
    from transformers.modeling_outputs import CausalLMOutputWithPast
except ImportError as exc:  # pragma: no cover - exercised only without transformers
    raise ImportError("fusedkern.integrations.transformers needs Hugging Face Transformers: "
                      "pip install 'fusedkern[hf]' (transformers>=4.45)") from exc

try:  # Transformers >= 5: also handles 1-D / 2-D index tensors and boolean masks
    from transformers.modeling_utils import slice_logits_to_keep as _hf_slice_logits_to_keep
except ImportError:  # pragma: no cover - older Transformers
    _hf_slice_logits_to_keep = None

from fusedkern import _validation as V_
from fusedkern.integrations.fsdp import call_as_forward
from fusedkern._validation import validate_strategy
from fusedkern.linear_cross_entropy import linear_cross_entropy

__all__ = ["patch", "unpatch", "patched", "is_patched", "SUPPORTED_ARCHITECTURES"]

# Supported classes → the config attribute whose value is the final-logit softcap (None: no softcap).
SUPPORTED_ARCHITECTURES: dict[str, str | None] = {
    "LlamaForCausalLM": None,
    "MistralForCausalLM": None,
    "Qwen2ForCausalLM": None,
    "Qwen3ForCausalLM": None,
    "Gemma2ForCausalLM": "final_logit_softcapping",
    "Phi3ForCausalLM": None,
}

_MARK = "__fusedkern_patch__"  # attribute of our forward functions, holding their _PatchInfo
_ABSENT = object()             # "no entry in __dict__" (what unpatch restores by deleting)


@dataclasses.dataclass(frozen=True)
class _PatchInfo:
    original: Callable        # the unpatched forward function of the supported class (takes self)
    options: dict[str, Any]
    softcap_attr: str | None
    previous: Any             # what the patched __dict__ slot held before the first patch (or _ABSENT)


# ----------------------------------------------------------------------------------------------
# which classes, which forward


def _supported_classes() -> dict[type, str | None]:
    """The supported classes that this Transformers version has (e.g. no Qwen3 before 4.51)."""
    found = {}
    for name, softcap_attr in SUPPORTED_ARCHITECTURES.items():
        try:
            found[getattr(transformers, name)] = softcap_attr
        except (AttributeError, ImportError, RuntimeError):
            continue
    return found


def _unsupported(cls: type, why: str) -> TypeError:
    names = ", ".join(SUPPORTED_ARCHITECTURES)
    return TypeError(f"fusedkern.integrations.transformers cannot patch {cls.__module__}.{cls.__qualname__}: {why}. "
                     f"Supported: {names} (and subclasses that do not override forward)")


def _info(fn) -> _PatchInfo | None:
    """The _PatchInfo of one of our forwards (function or bound method), else None."""
    return getattr(getattr(fn, "__func__", fn), _MARK, None)


def _resolve(cls: type) -> tuple[Callable, str | None]:
    """(unpatched forward function, softcap config attribute) of a supported class or subclass."""
    supported = _supported_classes()
    if not any(issubclass(cls, s) for s in supported):
        raise _unsupported(cls, "not a supported causal-LM class")
    owner = next(k for k in cls.__mro__ if "forward" in k.__dict__)
    info = _info(owner.__dict__["forward"])
    if info is not None:  # a class on the way is patched already: start from what it wrapped
        return info.original, info.softcap_attr
    if owner not in supported:
        raise _unsupported(cls, f"its forward is overridden by {owner.__qualname__}, which fusedkern's forward would drop")
    return owner.__dict__["forward"], supported[owner]


def _check_options(impl, weight_grad_accum, chunk_tokens, label_smoothing, z_loss, eval_logits,
                   skip_ignored=True) -> dict[str, Any]:
    validate_strategy(impl, weight_grad_accum, chunk_tokens)
    options = dict(impl=impl, weight_grad_accum=weight_grad_accum, chunk_tokens=chunk_tokens,
                   label_smoothing=V_.check_real("label_smoothing", label_smoothing, low=0.0, high=1.0),
                   z_loss=V_.check_real("z_loss", z_loss, low=0.0))
    if not isinstance(eval_logits, bool):
        raise TypeError(f"eval_logits must be a bool, got {type(eval_logits).__name__}")
    if not isinstance(skip_ignored, bool):
        raise TypeError(f"skip_ignored must be a bool, got {type(skip_ignored).__name__}")
    options["eval_logits"], options["skip_ignored"] = eval_logits, skip_ignored
    return options


# ----------------------------------------------------------------------------------------------
# the loss and the replacement forward


def _keep_positions(hidden_states: torch.Tensor, logits_to_keep) -> torch.Tensor:
    """The positions whose logits the original forward would compute (Transformers' own slicing)."""
    if _hf_slice_logits_to_keep is not None:
        return _hf_slice_logits_to_keep(hidden_states, logits_to_keep)
    index = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    return hidden_states[:, index, :]


def _causal_lm_loss(hidden_states: torch.Tensor, lm_head: nn.Linear, labels: torch.Tensor,
                    shift_labels: torch.Tensor | None, num_items_in_batch, ignore_index: int,
                    softcap: float | None, options: dict[str, Any]) -> torch.Tensor:
    """Transformers' ForCausalLMLoss(lm_head(hidden_states), labels, ...) without the logits."""
    if shift_labels is None:
        labels = labels.to(hidden_states.device)
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    target = shift_labels.to(hidden_states.device).reshape(-1)
    x = hidden_states.reshape(-1, hidden_states.shape[-1])
    if x.shape[0] != target.shape[0]:
        raise ValueError(f"the labels give {target.shape[0]} targets but the model kept {x.shape[0]} positions "
                         f"(hidden states {tuple(hidden_states.shape)}); as in Transformers, labels (or shift_labels) "
                         "must cover exactly the positions that logits_to_keep keeps")
    weight, bias = lm_head.weight, lm_head.bias
    device_type = x.device.type
    autocast = contextlib.nullcontext()
    if torch.is_autocast_enabled(device_type):  # what nn.Linear would do under autocast: both operands cast
        dtype = torch.get_autocast_dtype(device_type)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
        autocast = torch.autocast(device_type, enabled=False)
    with autocast:
        loss = linear_cross_entropy(
            x, weight, target, linear_bias=bias, reduction="mean" if num_items_in_batch is None else "sum",
            ignore_index=ignore_index, label_smoothing=options["label_smoothing"], z_loss=options["z_loss"],
            softcap=softcap, impl=options["impl"], weight_grad_accum=options["weight_grad_accum"],
            chunk_tokens=options["chunk_tokens"],
            # counted on the device (no sync): prompt and padding rows then cost no GEMM work
            num_valid_tokens=(target != ignore_index).sum() if options["skip_ignored"] else None)
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):  # no .item(): divided on the device, no host sync
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def _make_forward(original: Callable, options: dict[str, Any], softcap_attr: str | None, previous: Any):
    """A forward with `original`'s signature (Trainer inspects it) that computes the loss with fusedkern."""
    signature = inspect.signature(original)  # the innermost function's (functools.wraps chains are followed)
    params = signature.parameters
    self_name = next(iter(params))
    var_keyword = next((p.name for p in params.values() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    keep_name = next((n for n in ("logits_to_keep", "num_logits_to_keep") if n in params), None)
    output_fields = [f.name for f in dataclasses.fields(CausalLMOutputWithPast) if f.name not in ("loss", "logits")]

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        if options["eval_logits"] and not self.training:
            return original(self, *args, **kwargs)
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError:  # let Transformers word the error
            return original(self, *args, **kwargs)
        arguments = dict(bound.arguments)
        del arguments[self_name]
        extra = dict(arguments.pop(var_keyword, {})) if var_keyword else {}
        labels = arguments.pop("labels", None)
        if labels is None:  # the normal logits path, exactly as Transformers runs it
            return original(self, *args, **kwargs)
        if not isinstance(self.lm_head, nn.Linear):
            raise TypeError(f"fusedkern's loss reads lm_head.weight directly and needs lm_head to be an nn.Linear, "
                            f"got {type(self.lm_head).__name__} (adapters or wrappers on lm_head are not supported)")
        logits_to_keep = arguments.pop(keep_name, 0) if keep_name else 0
        return_dict = arguments.pop("return_dict", None)
        return_dict = extra.pop("return_dict", return_dict)
        num_items_in_batch = extra.pop("num_items_in_batch", None)
        shift_labels = extra.pop("shift_labels", None)
        ignore_index = extra.pop("ignore_index", -100)

        outputs = self.model(**arguments, **extra, return_dict=True)
        hidden_states = _keep_positions(outputs[0], logits_to_keep)
        softcap = getattr(self.config, softcap_attr, None) if softcap_attr else None
        # as lm_head's forward, under its hooks: FSDP2 (fully_shard(lm_head)) gathers the weight only there
        loss = call_as_forward(self.lm_head, functools.partial(
            _causal_lm_loss, lm_head=self.lm_head, labels=labels, shift_labels=shift_labels,
            num_items_in_batch=num_items_in_batch, ignore_index=ignore_index, softcap=softcap, options=options),
            hidden_states)
        result = CausalLMOutputWithPast(loss=loss, logits=None,
                                        **{name: getattr(outputs, name, None) for name in output_fields})
        if return_dict is None:
            return_dict = getattr(self.config, "return_dict", True)
        return result if return_dict else result.to_tuple()

    setattr(forward, _MARK, _PatchInfo(original, options, softcap_attr, previous))
    return forward


# ----------------------------------------------------------------------------------------------
# public API


def _slot(model: nn.Module) -> str:
    """Where an instance's forward lives: accelerate's hooks (device_map=..., offloading) keep the model's
    own forward in `_old_forward` and call it from the `forward` they install; patch that one."""
    return "_old_forward" if "_hf_hook" in model.__dict__ and "_old_forward" in model.__dict__ else "forward"


def _target(model_or_class) -> tuple[Any, str, type]:
    """(object whose __dict__ gets the forward, attribute name, class to resolve)."""
    if isinstance(model_or_class, type):
        return model_or_class, "forward", model_or_class
    if isinstance(model_or_class, nn.Module):
        return model_or_class, _slot(model_or_class), type(model_or_class)
    raise TypeError(f"patch expects a Transformers causal-LM model instance or class, got {type(model_or_class).__name__}")


def patch(model_or_class, *, impl: str = "auto", weight_grad_accum: str = "fp32", chunk_tokens: int | None = None,
          label_smoothing: float = 0.0, z_loss: float = 0.0, eval_logits: bool = False, skip_ignored: bool = True):
    """Make `model(..., labels=...)` compute its causal-LM loss with `fusedkern.linear_cross_entropy`.

    Args:
        model_or_class: a model instance (only it is patched) or a class such as `LlamaForCausalLM`
            (every instance whose class does not override the patch, including those `from_pretrained`
            creates later). Supported: Llama, Mistral, Qwen2, Qwen3, Gemma2 and Phi3 `...ForCausalLM`
            and their subclasses that keep the inherited forward; anything else raises TypeError.
        impl, weight_grad_accum, chunk_tokens: fusedkern's strategy options (see `linear_cross_entropy`).
        label_smoothing, z_loss: extra loss terms of fusedkern (0 = Transformers' loss exactly).
        eval_logits: if True, a model in eval mode runs the original forward (logits and Transformers'
            loss), e.g. for `Trainer` evaluation with `compute_metrics`; training still skips the logits.
        skip_ignored: pass the count of non-ignored targets to fusedkern as a device tensor, so that
            prompt and padding positions cost no GEMM work (`num_valid_tokens`; no host sync). On the
            H200 it took a batch with half its targets ignored from 1.03–1.07× to 0.56–0.59× the dense
            floor, and costs 1–4 % on a batch with none ignored (docs/results.md): False for pretraining.

    With labels the output's `loss` comes from fusedkern and its `logits` is None. Without labels the
    original forward runs. Patching again replaces the options; `unpatch` restores the original.
    Returns `model_or_class` itself.
    """
    options = _check_options(impl, weight_grad_accum, chunk_tokens, label_smoothing, z_loss, eval_logits, skip_ignored)
    holder, slot, cls = _target(model_or_class)
    original, softcap_attr = _resolve(cls)
    current = holder.__dict__.get(slot, _ABSENT)
    info = _info(current)
    previous = info.previous if info is not None else current
    forward = _make_forward(original, options, softcap_attr, previous)
    if isinstance(holder, type):
        setattr(holder, slot, forward)
    else:
        holder.__dict__[slot] = types.MethodType(forward, holder)
    return model_or_class


def is_patched(model_or_class) -> bool:
    """Whether `model_or_class` runs fusedkern's forward (an instance also when its class was patched)."""
    holder, slot, cls = _target(model_or_class)
    if _info(holder.__dict__.get(slot)) is not None:
        return True
    return not isinstance(holder, type) and _info(getattr(cls, "forward", None)) is not None


def unpatch(model_or_class):
    """Undo `patch` on this instance or class (whatever it held before is restored); a no-op if it was not
    patched. An instance of a patched class stays patched until the class is unpatched. Returns the argument."""
    holder, slot, _ = _target(model_or_class)
    info = _info(holder.__dict__.get(slot))
    if info is None:
        return model_or_class
    _restore(holder, slot, info.previous)
    return model_or_class


def _restore(holder, slot: str, value) -> None:
    if isinstance(holder, type) and value is _ABSENT:
        delattr(holder, slot)
    elif isinstance(holder, type):
        setattr(holder, slot, value)
    elif value is _ABSENT:
        holder.__dict__.pop(slot, None)
    else:
        holder.__dict__[slot] = value


@contextlib.contextmanager
def patched(model_or_class, **options) -> Iterator[Any]:
    """`with patched(model): ...` — `patch(model, **options)` for the block, then the state before it."""
    holder, slot, _ = _target(model_or_class)
    before = holder.__dict__.get(slot, _ABSENT)
    patch(model_or_class, **options)
    try:
        yield model_or_class
    finally:
        if _info(before) is not None:  # it was already patched: put that patch back
            _restore(holder, slot, before)
        else:
            unpatch(model_or_class)
