"""SFTTrainer's loss anticipated by fusedkern's TRL head: the policy's head forms its gradient in the forward pass.

TRL 1.16's `SFTTrainer.compute_loss` reads the per-token log-probs of the fused head and reduces them itself:
loss_type "nll", −Σ_t logp_t / N, and "dft", −Σ_t exp(logp_t)·logp_t / N with exp(logp_t) detached, where N is
the batch's scored tokens or `num_items_in_batch` (gradient accumulation), times what the trainer multiplies in
(ranks, accumulation steps). So the upstream gradient that reaches the log-probs is s·a, for one scalar s, with
a_t = −1 (nll) or −exp(logp_t) (dft) on the scored tokens, packed or not. `fusedkern.anticipated` forms the
gradient of Σ_t a_t·logp_t in the forward (three vocabulary GEMMs instead of four) and, in backward, checks on the
device that the upstream is that pattern, rescaling by s, and recomputes exactly the rows where it is not.

`mark_sft_trainer` runs after `SFTTrainer.__init__` while fusedkern's TRL patch is on (a `Patch` of
`fusedkern.integrations.trl`): it records the pattern of the trainer's loss for the model that carries the head.
Only where the trainer computes its loss with TRL's own `SFTTrainer.compute_loss` (a subclass that overrides it,
GKDTrainer included, keeps the per-token head), with loss_type "nll" or "dft" and neither `compute_loss_func` nor
label smoothing of the nll (those run the fused head under no_grad for their metrics). The head reads the record at
each call (`anticipated_pattern`); `add_fused_lm_head` drops it, so a later trainer of another kind on the same
model gets the per-token head again. A wrong record costs GEMMs, never exactness: the backward's check recomputes
whatever the upstream does not match.
"""

from __future__ import annotations

import sys
import weakref

import torch

from fusedkern.anticipated import PATTERNS

#: model (the one whose forward carries fusedkern's head) → the anticipated pattern of its trainer's loss
_PATTERNS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def head_model(trainer):
    """The model that `add_fused_lm_head` was given: the base model under a PEFT wrapper."""
    model = trainer.model
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def sft_pattern(trainer) -> str | None:
    """The pattern ("nll" or "dft") of the upstream that this SFTTrainer's loss sends to its head's log-probs, or
    None where the trainer's loss is not TRL's own SFT loss over them (see the module docstring)."""
    module = sys.modules.get("trl.trainer.sft_trainer")
    sft_cls = getattr(module, "SFTTrainer", None)
    if sft_cls is None or not isinstance(trainer, sft_cls):
        return None
    if getattr(type(trainer), "compute_loss", None) is not vars(sft_cls).get("compute_loss"):
        return None  # a subclass's own loss (GKDTrainer's divergence, a user's)
    loss_type = getattr(trainer.args, "loss_type", None)
    if loss_type not in PATTERNS or getattr(trainer, "compute_loss_func", None) is not None:
        return None
    if loss_type == "nll" and getattr(trainer, "label_smoother", None) is not None:
        return None
    return loss_type


def mark_sft_trainer(trainer) -> None:
    """Record (or drop) the pattern of the trainer's loss for its head's model: run after `SFTTrainer.__init__`."""
    model = head_model(trainer)
    pattern = sft_pattern(trainer)
    if pattern is None:
        _PATTERNS.pop(model, None)
    else:
        _PATTERNS[model] = pattern


def forget_pattern(model) -> None:
    """Drop the model's record: `add_fused_lm_head` gives it a head for a trainer yet to say its loss."""
    _PATTERNS.pop(model, None)


def anticipated_pattern(model) -> str | None:
    """The pattern the head of `model` anticipates at this call: its trainer's, while gradients are recorded."""
    return _PATTERNS.get(model) if torch.is_grad_enabled() else None
