"""`fusedkern.integrations.transformers.patch` across causal-LM architectures: one tiny random model of each
(1 layer, hidden 32, vocab 64, batch 2 × seq 8, fp32, no download), its loss and every parameter's gradient
patched against unpatched (Transformers' own forward on materialized logits), with ignored labels and
`num_items_in_batch`. The same 26 cases as tests/test_integrations_architectures.py, which asserts them."""

from __future__ import annotations

import torch
from torch import nn

COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager")
GPT_STYLE = dict(n_embd=32, n_layer=1, n_head=4, n_positions=64)
TOKEN_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
MOE = dict(output_router_logits=True, router_aux_loss_coef=0.1, num_experts_per_tok=2)
CAPPED = dict(head_dim=8, final_logit_softcapping=1.0, initializer_range=0.3)  # a cap of 1 bites logits of ~2

# name → (model class, config class, config overrides, what the head does beyond a plain matmul)
CASES = {
    "Llama": ("LlamaForCausalLM", "LlamaConfig", {}, ()),
    "Mistral": ("MistralForCausalLM", "MistralConfig", {}, ()),
    "Qwen2": ("Qwen2ForCausalLM", "Qwen2Config", {}, ()),
    "Qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(head_dim=8), ()),
    "Qwen2Moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig",
                 dict(num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=16, **MOE), ("moe",)),
    "Qwen3Moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                 dict(head_dim=8, num_experts=4, moe_intermediate_size=16, **MOE), ("moe",)),
    "Mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(num_local_experts=4, **MOE), ("moe",)),
    "Olmoe": ("OlmoeForCausalLM", "OlmoeConfig", dict(num_experts=4, **MOE), ("moe",)),
    "Gemma": ("GemmaForCausalLM", "GemmaConfig", dict(head_dim=8), ("tied",)),
    "Gemma2": ("Gemma2ForCausalLM", "Gemma2Config", CAPPED, ("tied", "softcap")),
    "Gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", CAPPED, ("tied", "softcap")),
    "Phi3": ("Phi3ForCausalLM", "Phi3Config", TOKEN_IDS, ()),
    "Phi": ("PhiForCausalLM", "PhiConfig", {}, ("bias",)),
    "Olmo2": ("Olmo2ForCausalLM", "Olmo2Config", TOKEN_IDS, ()),
    "Cohere": ("CohereForCausalLM", "CohereConfig", dict(logit_scale=0.5, **TOKEN_IDS), ("tied", "scale")),
    "Cohere2": ("Cohere2ForCausalLM", "Cohere2Config", dict(logit_scale=0.5, **TOKEN_IDS), ("tied", "scale")),
    "Granite": ("GraniteForCausalLM", "GraniteConfig", dict(logits_scaling=4.0), ("scale",)),
    "GraniteMoe": ("GraniteMoeForCausalLM", "GraniteMoeConfig", dict(logits_scaling=4.0, num_local_experts=4, **MOE),
                   ("scale", "moe")),
    "GPTNeoX": ("GPTNeoXForCausalLM", "GPTNeoXConfig", {}, ()),
    "StableLm": ("StableLmForCausalLM", "StableLmConfig", {}, ()),
    "Starcoder2": ("Starcoder2ForCausalLM", "Starcoder2Config", {}, ("tied",)),
    "GPT2": ("GPT2LMHeadModel", "GPT2Config", GPT_STYLE, ("tied",)),
    "GPTBigCode": ("GPTBigCodeForCausalLM", "GPTBigCodeConfig", GPT_STYLE, ("tied",)),
    "GPTJ": ("GPTJForCausalLM", "GPTJConfig", dict(GPT_STYLE, rotary_dim=4), ("bias",)),
    "Falcon": ("FalconForCausalLM", "FalconConfig", {}, ("tied",)),
    "Bloom": ("BloomForCausalLM", "BloomConfig", dict(n_layer=1, n_head=4), ("tied",)),
}
RTOL, ATOL = 1e-5, 1e-6  # the test's tolerance: fp32 rounding of two summation orders


def make_model(name: str, seed: int = 0) -> nn.Module:
    import transformers

    cls, config_cls, overrides, _ = CASES[name]
    config = getattr(transformers, config_cls)(**{**COMMON, **overrides})
    torch.manual_seed(seed)
    return getattr(transformers, cls)(config).train()


def make_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [2, 8] and labels with a prompt (3 ignored) and padding (2 ignored): 11 targets."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, COMMON["vocab_size"], (2, 8), generator=g)
    labels = input_ids.clone()
    labels[0, :3] = -100
    labels[1, -2:] = -100
    return input_ids, labels


def loss_and_grads(model: nn.Module, input_ids, labels, **kwargs):
    """(loss, {parameter name: gradient}) of one forward + backward, the same dropout masks on each call."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    out = model(input_ids=input_ids, labels=labels, **kwargs)
    out.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), grads


def _max_excess(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got − want| / (ATOL + RTOL·|want|): at most 1 where torch.testing.assert_close would pass."""
    return ((got - want).abs() / (ATOL + RTOL * want.abs())).max().item()


def patched_vs_unpatched(name: str, num_items_in_batch: int = 7) -> dict:
    """One architecture: its head's features, the patched/unpatched loss difference, the largest gradient
    difference (relative to its norm) and whether loss and every gradient agree within RTOL/ATOL."""
    from fusedkern.integrations import transformers as fk_hf

    model = make_model(name)
    input_ids, labels = make_batch()
    count = torch.tensor(num_items_in_batch)  # not the 11 targets: the sum is divided by this number
    ref_loss, ref_grads = loss_and_grads(model, input_ids, labels, num_items_in_batch=count)
    with fk_hf.patched(model):
        loss, grads = loss_and_grads(model, input_ids, labels, num_items_in_batch=count)
    same_params = grads.keys() == ref_grads.keys()
    excess = max([_max_excess(loss, ref_loss)] + [_max_excess(grads[n], g) for n, g in ref_grads.items()
                                                  if n in grads])
    grad_rel = max(((grads[n] - g).norm() / g.norm().clamp(min=1e-30)).item() for n, g in ref_grads.items()
                   if n in grads)
    return {"architecture": name, "class": CASES[name][0], "head": ", ".join(CASES[name][3]) or "plain",
            "loss_rel_diff": abs((loss - ref_loss) / ref_loss).item(), "grad_rel_diff": grad_rel,
            "gradients": len(ref_grads), "equal": same_params and excess <= 1.0}
