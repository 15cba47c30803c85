"""fusedkern: an LM head fused with its loss in Triton, never materializing the [tokens, vocab] logits:
cross-entropy, per-token log-probs, the preference and RL family (DPO, IPO, CPO, SimPO, ORPO, KTO, GRPO)
and distillation (forward/reverse KL, generalized JSD).

Public API: `linear_cross_entropy` / `LinearCrossEntropyLoss`, `linear_logprobs`, `linear_grpo_loss`,
`linear_preference_loss`, `linear_simpo_loss` / `LinearSimPOLoss`,
`linear_distillation_loss` / `LinearDistillationLoss`. References and baselines: `fusedkern.reference`.
Integrations (Transformers, TRL, FSDP2): `fusedkern.integrations`. Benchmarks: `python -m fusedkern.bench --help`.
"""

from fusedkern import _runtime  # noqa: F401  (first: picks GPU or Triton's interpreter before kernels import)
from fusedkern.distillation import LinearDistillationLoss, linear_distillation_loss
from fusedkern.grpo import linear_grpo_loss
from fusedkern.linear_cross_entropy import LinearCrossEntropyLoss, linear_cross_entropy
from fusedkern.linear_preference import linear_preference_loss
from fusedkern.logprobs import linear_logprobs
from fusedkern.simpo import LinearSimPOLoss, linear_simpo_loss

__all__ = [
    "linear_cross_entropy",
    "LinearCrossEntropyLoss",
    "linear_logprobs",
    "linear_grpo_loss",
    "linear_preference_loss",
    "linear_simpo_loss",
    "LinearSimPOLoss",
    "linear_distillation_loss",
    "LinearDistillationLoss",
]
__version__ = "0.1.0"
