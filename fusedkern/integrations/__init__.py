"""Integrations of fusedkern with other libraries. Each submodule imports its library only when it is
itself imported, so `import fusedkern` never needs them.

- `fusedkern.integrations.transformers`: `patch` / `unpatch` / `patched` make the causal-LM loss of
  Hugging Face Transformers models (Llama, Mistral, Qwen2, Qwen3, Gemma2, Phi3) run through
  `fusedkern.linear_cross_entropy` without materializing the logits (docs/integrations.md).
- `fusedkern.integrations.fsdp`: DTensor and FSDP2-sharded LM-head weights (`full_weights`, which the
  public functions call, and `call_as_forward`, which runs a loss as a module's forward under its hooks).
"""
