"""Hugging Face Transformers integration: the causal-LM loss of a model computed by
`fusedkern.linear_cross_entropy` straight from the last hidden states, without the [tokens, vocab] logits.

    from fusedkern.integrations.transformers import patch
    model = patch(AutoModelForCausalLM.from_pretrained(...))      # one instance
    patch(LlamaForCausalLM)                                      # or the class, before from_pretrained
    out = model(input_ids, labels=labels, num_items_in_batch=n)  # out.loss from fusedkern, out.logits None

No list of architectures: with labels, the patched forward runs the model's own forward, with two
stand-ins for that call only. The output head (`get_output_embeddings()`: an `nn.Linear`, or PEFT's LoRA
`Linear` or `ModulesToSaveWrapper` over one, whose operands `integrations/heads.py` resolves) returns a
`DeferredLogits` that records what the forward does to the logits: scaling by a number or a 0-d tensor
(Cohere's `logit_scale`, Granite's `logits_scaling`), tanh capping (Gemma-2/3's
`final_logit_softcapping`), `.float()`; any other operation raises TypeError naming it. The model's
`loss_function` is replaced by one that, given the deferred logits, computes Transformers'
`ForCausalLMLoss` with fusedkern (the scale folded into the hidden states, the cap as `softcap`). Whatever
the forward adds to that loss (a MoE router's auxiliary loss) it adds itself, as it does unpatched. The
returned output has `logits=None`. Without labels the original forward runs unchanged (`generate` is
unaffected). docs/integrations.md has the tested architectures and the limitations.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
import numbers
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

try:
    from transformers.modeling_utils import PreTrainedModel
    from transformers.utils import ModelOutput
except ImportError as exc:  # pragma: no cover - exercised only without transformers
    raise ImportError("fusedkern.integrations.transformers needs Hugging Face Transformers: "
                      "pip install -e '.[hf]' in a clone of fusedkern's repository (no release on a package "
                      "index), or pip install 'transformers>=4.45'") from exc

try:
    from transformers.loss.loss_utils import LOSS_MAPPING
except ImportError:  # pragma: no cover - older Transformers
    LOSS_MAPPING = {}

from fusedkern import _validation as V_
from fusedkern.integrations.fsdp import call_as_forward
from fusedkern.integrations.heads import peft_class_name, resolve_head
from fusedkern._validation import validate_strategy
from fusedkern.linear_cross_entropy import linear_cross_entropy

__all__ = ["patch", "unpatch", "patched", "is_patched", "DeferredLogits"]

_MARK = "__fusedkern_patch__"  # attribute of our forward functions, holding their _PatchInfo
_ABSENT = object()             # "no entry in __dict__" (what unpatch restores by deleting)
_WHO = "fusedkern's loss"      # who reads the output head, in resolve_head's messages
_EVAL_WARNING = ("fusedkern's patched forward returns logits=None for a labelled batch, in eval mode too: "
                 "Trainer.evaluate's compute_metrics (or anything reading the logits) gets no predictions. "
                 "Pass eval_logits=True to patch() to run the original forward in eval mode (logits and "
                 "Transformers' loss), or eval_logits=False to keep the fused loss there and silence this warning")


@dataclasses.dataclass(frozen=True)
class _PatchInfo:
    original: Callable        # the unpatched forward function of the class (takes self)
    options: dict[str, Any]
    previous: Any             # what the patched __dict__ slot held before the first patch (or _ABSENT)


# ----------------------------------------------------------------------------------------------
# which classes, which forward


def _unsupported(cls: type, why: str) -> TypeError:
    return TypeError(f"fusedkern.integrations.transformers cannot patch {cls.__module__}.{cls.__qualname__}: {why}. "
                     "It patches a Transformers causal LM (a PreTrainedModel whose forward takes labels) whose "
                     "logits are a linear head over the decoder's last hidden state and whose forward computes "
                     "the loss with self.loss_function (docs/integrations.md)")


def _info(fn) -> _PatchInfo | None:
    """The _PatchInfo of one of our forwards (function or bound method), else None."""
    return getattr(getattr(fn, "__func__", fn), _MARK, None)


def _source(fn: Callable) -> str | None:
    try:
        return inspect.getsource(inspect.unwrap(fn))
    except (OSError, TypeError):
        return None


def _check_loss_function_used(cls: type, owner: type) -> None:
    """A forward that computes its loss some other way (`CrossEntropyLoss()` on the logits, as Bart's
    causal LM does) would bypass the fused loss: refused now rather than at the first labelled call.
    The forward's source is read along the MRO while it delegates to `super().forward`."""
    mro = cls.__mro__
    for klass in mro[mro.index(owner):]:
        fn = klass.__dict__.get("forward")
        if fn is None:
            continue
        source = _source(fn)
        if source is None or "loss_function(" in source:  # no source (compiled, generated): the call checks
            return
        if "super()" not in source:
            raise _unsupported(cls, f"{klass.__qualname__}.forward computes no loss with self.loss_function (a loss "
                                    "of its own, which fusedkern would have to reproduce, or no head)")
    raise _unsupported(cls, "no forward in its MRO calls self.loss_function")


def _resolve(cls: type) -> Callable:
    """The unpatched forward function of a causal-LM class (the nearest in its MRO)."""
    if not (isinstance(cls, type) and issubclass(cls, PreTrainedModel)):
        peft = peft_class_name(cls)
        if peft is not None:  # PeftModelForCausalLM: its forward calls the Transformers model's, which is patchable
            raise _unsupported(cls, f"not a Transformers PreTrainedModel but {peft}, a wrapper around one: patch "
                                    "peft_model.get_base_model() (the model under the adapters; the wrapper's forward "
                                    "calls its forward, adapters included)")
        raise _unsupported(cls, "not a Transformers PreTrainedModel")
    owner = next(k for k in cls.__mro__ if "forward" in k.__dict__)
    info = _info(owner.__dict__["forward"])
    if info is not None:  # a class on the way is patched already: start from what it wrapped
        return info.original
    original = owner.__dict__["forward"]
    params = inspect.signature(original).parameters
    if "labels" not in params and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        raise _unsupported(cls, "its forward takes no labels (a base model without the LM head?)")
    _check_loss_function_used(cls, owner)
    return original


def _check_options(impl, weight_grad_accum, chunk_tokens, label_smoothing, z_loss, eval_logits,
                   skip_ignored=True) -> dict[str, Any]:
    validate_strategy(impl, weight_grad_accum, chunk_tokens)
    options = dict(impl=impl, weight_grad_accum=weight_grad_accum, chunk_tokens=chunk_tokens,
                   label_smoothing=V_.check_real("label_smoothing", label_smoothing, low=0.0, high=1.0),
                   z_loss=V_.check_real("z_loss", z_loss, low=0.0))
    if eval_logits is not None and not isinstance(eval_logits, bool):
        raise TypeError(f"eval_logits must be None, True or False, got {type(eval_logits).__name__}")
    if not isinstance(skip_ignored, bool):
        raise TypeError(f"skip_ignored must be a bool, got {type(skip_ignored).__name__}")
    options["eval_logits"], options["skip_ignored"] = eval_logits, skip_ignored
    return options


# ----------------------------------------------------------------------------------------------
# the deferred logits: what the forward does to lm_head's output, recorded instead of computed

_SCALE_NAMES = {"mul": False, "multiply": False, "__mul__": False, "__rmul__": False, "mul_": False,
                "div": True, "divide": True, "true_divide": True, "__truediv__": True, "div_": True}


@dataclasses.dataclass(frozen=True, eq=False)
class DeferredLogits:
    """Stands for `head(hidden_states)` inside a patched forward; records the operations applied to it.

    logits = cap · tanh(k · (hidden_states @ W.T + b)) when `capped`, else k · (hidden_states @ W.T + b),
    with k = (the numbers the logits were multiplied by) / (those they were divided by) × each 0-d tensor
    factor in `tensor_factors`. The loss folds k into the hidden states (and the bias) and passes `cap` as
    fusedkern's `softcap`. Any other operation raises TypeError: the patch cannot reproduce it."""

    hidden_states: torch.Tensor
    head: nn.Linear
    model_name: str
    dtype: torch.dtype
    scale_num: float = 1.0
    scale_den: float = 1.0
    tensor_factors: tuple = ()    # ((tensor, divide: bool), ...): 0-d factors before the tanh, kept differentiable
    capped: bool = False
    cap_num: float = 1.0
    cap_den: float = 1.0

    # what code may read about the logits without computing them
    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.hidden_states.shape[:-1], self.head.out_features))

    @property
    def device(self) -> torch.device:
        return self.hidden_states.device

    @property
    def ndim(self) -> int:
        return self.hidden_states.dim()

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:
        return self.ndim

    # the operations that fold into fusedkern's loss
    def float(self) -> DeferredLogits:  # the loss is computed in fp32 anyway
        return dataclasses.replace(self, dtype=torch.float32)

    def contiguous(self, *args, **kwargs) -> DeferredLogits:
        return self

    def to(self, *args, **kwargs) -> DeferredLogits:
        targets = [*args, *kwargs.values()]
        dtypes = [t for t in targets if isinstance(t, torch.dtype)]
        devices = [torch.device(t) for t in targets if isinstance(t, (str, torch.device))]
        here = self.device
        if any(d != torch.float32 for d in dtypes) or len(dtypes) + len(devices) != len(targets) or \
                any(d.type != here.type or d.index not in (None, here.index) for d in devices):
            raise self._refuse(f"logits.to({', '.join(map(repr, targets))})")
        return dataclasses.replace(self, dtype=torch.float32) if dtypes else self

    def tanh(self) -> DeferredLogits:
        if self.capped:
            raise self._refuse("a second tanh on the logits")
        return dataclasses.replace(self, capped=True)

    def _scaled(self, factor, divide: bool, op: str) -> DeferredLogits:
        if isinstance(factor, torch.Tensor) and factor.numel() == 1 and not isinstance(factor, DeferredLogits):
            if self.capped:  # the cap is fusedkern's float softcap: it cannot carry a gradient
                if factor.requires_grad:
                    raise self._refuse(f"{op} by a tensor that requires grad after the tanh (a trainable cap)")
                factor = factor.item()
            else:
                return dataclasses.replace(self, tensor_factors=(*self.tensor_factors, (factor.reshape(()), divide)))
        if not isinstance(factor, numbers.Real) or isinstance(factor, bool) or not math.isfinite(factor) or factor == 0:
            what = f"a tensor of shape {tuple(factor.shape)}" if isinstance(factor, torch.Tensor) else repr(factor)
            raise self._refuse(f"{op} of the logits by {what} (only a finite non-zero number or a one-element "
                               "tensor folds into the hidden states)")
        factor = float(factor)
        if self.capped:
            num, den = (self.cap_num, self.cap_den * factor) if divide else (self.cap_num * factor, self.cap_den)
            return dataclasses.replace(self, cap_num=num, cap_den=den)
        num, den = (self.scale_num, self.scale_den * factor) if divide else (self.scale_num * factor, self.scale_den)
        return dataclasses.replace(self, scale_num=num, scale_den=den)

    def __mul__(self, other):
        return self._scaled(other, False, "multiplication")

    __rmul__ = __mul__

    def __truediv__(self, other):
        return self._scaled(other, True, "division")

    def mul(self, other):
        return self._scaled(other, False, "multiplication")

    def div(self, other):
        return self._scaled(other, True, "division")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        deferred = [a for a in (*args, *kwargs.values()) if isinstance(a, DeferredLogits)]
        if name == "tanh" and len(args) == 1 and not kwargs:
            return args[0].tanh()
        if name in _SCALE_NAMES and len(args) == 2 and not kwargs and len(deferred) == 1:
            this, other = (args[0], args[1]) if isinstance(args[0], DeferredLogits) else (args[1], args[0])
            if _SCALE_NAMES[name] and this is not args[0]:
                raise this._refuse(f"torch.{name} with the logits as the divisor")
            return this._scaled(other, _SCALE_NAMES[name], name)
        raise deferred[0]._refuse(f"torch's {name}")

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise self._refuse(f"logits.{name}")

    def __getitem__(self, index):
        raise self._refuse(f"indexing of the logits ([{index!r}])")

    def __add__(self, other):
        raise self._refuse("an arithmetic operation other than scaling (addition, subtraction, ...)")

    __radd__ = __sub__ = __rsub__ = __rtruediv__ = __pow__ = __add__

    def __neg__(self):
        raise self._refuse("negation of the logits")

    def _refuse(self, what: str) -> TypeError:
        return TypeError(f"fusedkern cannot reproduce {self.model_name}.forward: it applies {what} to the output "
                         "head's logits, which the fused loss never materializes (it folds only scaling by a number "
                         "or a one-element tensor, one tanh cap and .float()); unpatch this model")

    # the fold
    def folded_scale(self) -> float:
        """k: the product of the numeric factors before the tanh, times the cap when capped (b·tanh(a·z)
        is fusedkern's softcap b applied to (a·b)·z)."""
        if self.capped:
            return (self.scale_num * self.cap_num) / (self.scale_den * self.cap_den)
        return self.scale_num / self.scale_den

    def softcap(self) -> float | None:
        if not self.capped:
            return None
        cap = self.cap_num / self.cap_den
        if not cap > 0:
            raise self._refuse(f"a tanh cap of {cap} (fusedkern's softcap must be positive)")
        return cap

    def scale(self, t: torch.Tensor) -> torch.Tensor:
        """t · k, with the tensor factors applied in order (differentiable: a trainable scale gets its gradient)."""
        k = self.folded_scale()
        if k != 1.0:
            t = t * k
        for factor, divide in self.tensor_factors:
            factor = factor.to(t.device)
            t = t / factor if divide else t * factor
        return t


class _DeferredHead:
    """Stands for the output head during a patched call: calling it returns DeferredLogits; attributes
    (weight, bias, out_features, ...) are the real head's."""

    def __init__(self, head: nn.Linear, model_name: str):
        self.__dict__["_head"], self.__dict__["_model_name"] = head, model_name

    def __call__(self, hidden_states, *args, **kwargs):
        if args or kwargs or not isinstance(hidden_states, torch.Tensor):
            raise TypeError(f"fusedkern cannot reproduce {self._model_name}.forward: it calls the output head with "
                            "arguments other than one hidden-states tensor")
        head = self._head
        device_type = hidden_states.device.type
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
        else:
            dtype = torch.promote_types(hidden_states.dtype, head.weight.dtype)
        return DeferredLogits(hidden_states, head, self._model_name, dtype)

    def __getattr__(self, name):
        return getattr(self._head, name)


# ----------------------------------------------------------------------------------------------
# the loss and the replacement forward


def _causal_lm_loss(hidden_states: torch.Tensor, logits: DeferredLogits, labels: torch.Tensor | None,
                    shift_labels: torch.Tensor | None, num_items_in_batch, ignore_index: int,
                    options: dict[str, Any]) -> torch.Tensor:
    """Transformers' ForCausalLMLoss(logits, labels, ...) without the logits."""
    if shift_labels is None:
        labels = labels.to(hidden_states.device)
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    target = shift_labels.to(hidden_states.device).reshape(-1)
    x = hidden_states.reshape(-1, hidden_states.shape[-1])  # the head's input (a LoRA dropout's mask drawn on it)
    if x.shape[0] != target.shape[0]:
        raise ValueError(f"the labels give {target.shape[0]} targets but the model kept {x.shape[0]} positions "
                         f"(hidden states {tuple(hidden_states.shape)}); as in Transformers, labels (or shift_labels) "
                         "must cover exactly the positions that logits_to_keep keeps")
    # the head's operands: its weight and bias, or for PEFT's wrappers what their forward uses (a LoRA adapter's
    # low-rank term folded into the weight, or as extra input columns under dropout; heads.py)
    x, weight, bias = resolve_head(logits.head, _WHO).operands(x)
    # the logits' scale k folded into the operand that is cheap to scale: k·(xWᵀ + b) = (k·x)Wᵀ + k·b;
    # autograd carries k into dx, dW and db (and into a trainable scale's own gradient)
    x = logits.scale(x)
    bias = None if bias is None else logits.scale(bias)
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
            softcap=logits.softcap(), impl=options["impl"], weight_grad_accum=options["weight_grad_accum"],
            chunk_tokens=options["chunk_tokens"],
            # counted on the device (no sync): prompt and padding rows then cost no GEMM work
            num_valid_tokens=(target != ignore_index).sum() if options["skip_ignored"] else None)
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):  # no .item(): divided on the device, no host sync
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


class _Call:
    """One labelled call of a patched model: the stand-ins installed on the model for its duration."""

    def __init__(self, model: nn.Module, options: dict[str, Any]):
        self.model, self.options, self.losses = model, options, 0
        self.name = type(model).__qualname__
        self.head, self.parent, self.attr = _output_head(model)

    def loss_function(self, logits=None, labels=None, vocab_size=None, num_items_in_batch=None, ignore_index=-100,
                      shift_labels=None, **kwargs):
        if not isinstance(logits, DeferredLogits):
            raise TypeError(f"fusedkern cannot reproduce {self.name}.forward: the logits it passes to "
                            f"self.loss_function are a {type(logits).__name__}, not the output head's "
                            f"({self.attr}) own output; unpatch this model")
        if vocab_size is not None and vocab_size != logits.head.out_features:
            raise ValueError(f"{self.name}.forward passes vocab_size={vocab_size} to its loss but the output head has "
                             f"{logits.head.out_features} outputs (Transformers would fail reshaping the logits)")
        if labels is None and shift_labels is None:
            raise ValueError("the loss needs labels or shift_labels")
        self.losses += 1
        # as the head's forward, under its hooks: FSDP2 (fully_shard(lm_head)) gathers the weight only there
        return call_as_forward(logits.head, functools.partial(
            _causal_lm_loss, logits=logits, labels=labels, shift_labels=shift_labels,
            num_items_in_batch=num_items_in_batch, ignore_index=ignore_index, options=self.options),
            logits.hidden_states)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        model, parent = self.model, self.parent
        if LOSS_MAPPING.get("ForCausalLM") is not None and model.loss_function is not LOSS_MAPPING["ForCausalLM"]:
            raise TypeError(f"{self.name}.loss_function is {getattr(model.loss_function, '__name__', model.loss_function)}"
                            ", not Transformers' ForCausalLMLoss (config.loss_type or a loss_function set on the model):"
                            " fusedkern computes only the causal-LM cross-entropy; unpatch this model")
        saved = [(model, "_loss_function", model.__dict__.get("_loss_function", _ABSENT)),
                 (parent, self.attr, parent.__dict__.get(self.attr, _ABSENT))]
        # instance __dict__ entries: found before nn.Module's _modules lookup, and nothing is registered
        model.__dict__["_loss_function"] = self.loss_function
        parent.__dict__[self.attr] = _DeferredHead(self.head, self.name)
        try:
            yield
        finally:
            for holder, attr, value in saved:
                if value is _ABSENT:
                    holder.__dict__.pop(attr, None)
                else:
                    holder.__dict__[attr] = value


def _output_head(model: nn.Module) -> tuple[nn.Module, nn.Module, str]:
    """(head, the module that holds it, its attribute name there). The head is an nn.Linear or PEFT's LoRA Linear
    or ModulesToSaveWrapper over one (heads.py); anything else raises TypeError, naming the class."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    resolve_head(head, _WHO)
    for name, child in model._modules.items():
        if child is head:
            return head, model, name
    for name, module in model.named_modules():
        if module is head:
            parent_name, _, attr = name.rpartition(".")
            return head, model.get_submodule(parent_name), attr
    raise TypeError(f"the output head of {type(model).__qualname__} is not one of its submodules")


def _without_logits(output):
    """The model's output with the deferred logits removed (logits=None; a tuple drops them, as
    Transformers' to_tuple drops None)."""
    if isinstance(output, ModelOutput):
        return type(output)(**{k: v for k, v in output.items() if not isinstance(v, DeferredLogits)})
    if isinstance(output, tuple):
        return tuple(v for v in output if not isinstance(v, DeferredLogits))
    return output


def _make_forward(original: Callable, options: dict[str, Any], previous: Any):
    """A forward with `original`'s signature (Trainer inspects it) that computes the loss with fusedkern."""
    signature = inspect.signature(original)  # the innermost function's (functools.wraps chains are followed)
    params = signature.parameters
    var_keyword = next((p.name for p in params.values() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    warned = []  # once per patch: the eval-mode warning was given

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        eval_logits = options["eval_logits"]
        if eval_logits and not self.training:
            return original(self, *args, **kwargs)
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError:  # let Transformers word the error
            return original(self, *args, **kwargs)
        labels = bound.arguments.get("labels")
        if labels is None and var_keyword:
            labels = bound.arguments.get(var_keyword, {}).get("labels")
        if labels is None:  # the normal logits path, exactly as Transformers runs it
            return original(self, *args, **kwargs)
        # evaluation (eval mode, no grad: what Trainer.evaluate runs) is where a caller may want the logits
        if eval_logits is None and not self.training and not torch.is_grad_enabled() and not warned:
            warned.append(True)
            warnings.warn(_EVAL_WARNING, UserWarning, stacklevel=2)
        call = _Call(self, options)
        with call.installed():
            output = original(self, *args, **kwargs)
        if call.losses == 0:
            raise TypeError(f"fusedkern cannot reproduce {call.name}.forward: given labels, it never called "
                            "self.loss_function with the output head's logits; unpatch this model")
        return _without_logits(output)

    setattr(forward, _MARK, _PatchInfo(original, options, previous))
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
          label_smoothing: float = 0.0, z_loss: float = 0.0, eval_logits: bool | None = None, skip_ignored: bool = True):
    """Make `model(..., labels=...)` compute its causal-LM loss with `fusedkern.linear_cross_entropy`.

    Args:
        model_or_class: a model instance (only it is patched) or a class such as `LlamaForCausalLM`
            (every instance whose class does not override the patch, including those `from_pretrained`
            creates later). Any Transformers causal LM whose logits are an `nn.Linear` head over the last
            hidden state, possibly scaled and tanh-capped, and whose forward computes the loss with
            `self.loss_function`; docs/integrations.md lists the architectures tested. A class whose
            forward computes its loss otherwise raises TypeError here; one whose forward does something
            else to the logits raises TypeError at its first labelled call, naming the operation.
        impl, weight_grad_accum, chunk_tokens: fusedkern's strategy options (see `linear_cross_entropy`).
        label_smoothing, z_loss: extra loss terms of fusedkern (0 = Transformers' loss exactly).
        eval_logits: True: a model in eval mode runs the original forward (logits and Transformers'
            loss), e.g. for `Trainer` evaluation with `compute_metrics`; training still skips the logits.
            False: the fused loss (logits=None) in eval mode too. None (the default): as False, and the
            first labelled call in eval mode under `torch.no_grad` (an evaluation loop) warns once that its
            logits are None (`Trainer.evaluate`'s `compute_metrics` would get no predictions).
        skip_ignored: pass the count of non-ignored targets to fusedkern as a device tensor, so that
            prompt and padding positions cost no GEMM work (`num_valid_tokens`; no host sync). It speeds
            up batches with many ignored targets and costs a little on batches with none (the numbers:
            docs/integrations.md): False for pretraining.

    With labels the output's `loss` comes from fusedkern (plus whatever the model's forward adds to it,
    such as a MoE router's auxiliary loss) and its `logits` is None. Without labels the original forward
    runs. Patching again replaces the options; `unpatch` restores the original. Returns `model_or_class`.
    """
    options = _check_options(impl, weight_grad_accum, chunk_tokens, label_smoothing, z_loss, eval_logits, skip_ignored)
    holder, slot, cls = _target(model_or_class)
    original = _resolve(cls)
    if not isinstance(holder, type):  # an instance: a head the loss cannot read (a PEFT tuner, ...) refused now
        _output_head(holder)
    current = holder.__dict__.get(slot, _ABSENT)
    info = _info(current)
    previous = info.previous if info is not None else current
    forward = _make_forward(original, options, previous)
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
