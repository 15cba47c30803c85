"""Integrations of fusedkern with other libraries. Each submodule imports its library only when it is
itself imported, so `import fusedkern` never needs them.

- `fusedkern.integrations.transformers`: `patch` / `unpatch` / `patched` make the causal-LM loss of
  any Hugging Face Transformers causal LM whose logits are a linear head (scaled or capped) run through
  `fusedkern.linear_cross_entropy` without materializing the logits (docs/integrations.md).
- `fusedkern.integrations.trl`: `patch` / `unpatch` / `patched` make TRL's trainers (SFT, DPO, KTO, GRPO,
  RLOO, CPO, ORPO, GKD, distillation) take their per-token log-probs from fusedkern's fused head instead of
  TRL's own chunked one.
- `fusedkern.integrations.fsdp`: DTensor and FSDP2-sharded LM-head weights (`full_weights`, which the
  public functions call, and `call_as_forward`, which runs a loss as a module's forward under its hooks).
"""
