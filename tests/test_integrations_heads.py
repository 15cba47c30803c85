"""PEFT adapters on the output head (fusedkern/integrations/heads.py), through both integrations.

The Transformers patch on a tiny random Llama (2 layers, hidden 32, vocab 64, fp32) under PEFT: LoRA on lm_head
(folded without dropout; as extra input columns under dropout, with the same mask as PEFT's; lora_bias; two active
adapters), modules_to_save=["lm_head"] (the saved copy, and the original under disable_adapter()): the loss and
every gradient — the adapter's A and B, the saved copy's weight — equal the unpatched PEFT model's. What stays
unsupported (patch(peft_model), DoRA, other tuners) raises TypeError before training, naming PEFT's class and
what to do. TRL: SFT and DPO with modules_to_save=["lm_head"] and CPO with LoRA on lm_head train as with TRL's
own head (or TRL's own CPO loss); check_trainer refuses DoRA on the head before training."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from torch import nn

from fusedkern._runtime import interpreting

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from fusedkern.integrations import heads  # noqa: E402
from fusedkern.integrations import transformers as fk_hf  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not interpreting(), reason="CPU tensors need Triton's interpreter (on when no GPU is visible)"),
    pytest.mark.usefixtures("one_cpu_thread"),
]

COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager")
TOL = dict(rtol=1e-5, atol=1e-6)


def make_base(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)).train()


def make_batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, COMMON["vocab_size"], (2, 8), generator=g)
    labels = input_ids.clone()
    labels[0, :3] = -100
    labels[1, -2:] = -100
    return input_ids, labels


def lora(**kwargs):
    """A LoRA config whose B starts non-zero (init_lora_weights=False), so that the adapter changes the logits."""
    return peft.LoraConfig(**{"r": 4, "lora_alpha": 8, "init_lora_weights": False, **kwargs})


def run(model, input_ids, labels):
    """(loss, {parameter: gradient}) of one step, from the same RNG state (the same dropout masks each time)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    out = model(input_ids=input_ids, labels=labels)
    out.loss.backward()
    return out, out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_patched_matches_peft(model, *, head_params=("lm_head",)):
    """The PEFT model unpatched, then with its base model patched: the same loss and gradients, the head's
    adapter parameters among them; fusedkern's loss ran (logits None)."""
    input_ids, labels = make_batch()
    _, ref_loss, ref_grads = run(model, input_ids, labels)
    assert any(all(p in name for p in head_params) for name in ref_grads), sorted(ref_grads)
    fk_hf.patch(model.get_base_model())
    try:
        out, loss, grads = run(model, input_ids, labels)
    finally:
        fk_hf.unpatch(model.get_base_model())
    assert out.logits is None
    torch.testing.assert_close(loss, ref_loss, **TOL)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], **TOL, msg=lambda m, name=name: f"d {name}: {m}")


@pytest.mark.parametrize("config", [
    dict(target_modules=["lm_head", "q_proj"]),                     # folded: W + s·B·A
    dict(target_modules=["lm_head"], lora_dropout=0.3),             # dropout: the extra-columns form
    dict(target_modules=["lm_head"], lora_bias=True, use_rslora=True),
], ids=["fold", "dropout", "lora_bias-rslora"])
def test_lora_on_the_head_matches_peft(config):
    model = peft.get_peft_model(make_base(), lora(**config))
    assert type(model.get_base_model().lm_head).__name__ == "Linear"  # PEFT's LoRA Linear, not nn.Linear
    assert_patched_matches_peft(model, head_params=("lm_head", "lora_B"))


def test_lora_dropout_changes_the_loss_and_eval_mode_folds():
    """The dropout case is not vacuous (the masks change the loss), and in eval mode the dropout is off: the folded
    form, equal to PEFT's eval forward."""
    model = peft.get_peft_model(make_base(), lora(target_modules=["lm_head"], lora_dropout=0.5))
    input_ids, labels = make_batch()
    _, with_dropout, _ = run(model, input_ids, labels)
    model.eval()
    with torch.no_grad():
        ref = model(input_ids=input_ids, labels=labels).loss
        fk_hf.patch(model.get_base_model(), eval_logits=False)
        got = model(input_ids=input_ids, labels=labels).loss
        fk_hf.unpatch(model.get_base_model())
    assert abs(with_dropout.item() - ref.item()) > 1e-3
    torch.testing.assert_close(got, ref, **TOL)


def test_two_active_lora_adapters_on_the_head():
    model = peft.get_peft_model(make_base(), lora(target_modules=["lm_head"]), adapter_name="a")
    model.add_adapter("b", lora(target_modules=["lm_head"], r=2, lora_dropout=0.2))
    model.base_model.set_adapter(["a", "b"])
    layer = model.get_base_model().lm_head
    assert layer.active_adapters == ["a", "b"]
    assert_patched_matches_peft(model, head_params=("lm_head", "lora_B.b"))


def test_modules_to_save_head_matches_peft_and_disabled_adapter_reads_the_original():
    model = peft.get_peft_model(make_base(), lora(target_modules=["q_proj"], modules_to_save=["lm_head"]))
    wrapper = model.get_base_model().lm_head
    with torch.no_grad():  # the saved copy differs from the original
        wrapper.modules_to_save["default"].weight.add_(0.05 * torch.randn_like(wrapper.original_module.weight))
    assert_patched_matches_peft(model, head_params=("lm_head.modules_to_save",))
    input_ids, labels = make_batch()
    with model.disable_adapter(), torch.no_grad():
        ref = model(input_ids=input_ids, labels=labels).loss
        fk_hf.patch(model.get_base_model(), eval_logits=False)
        got = model(input_ids=input_ids, labels=labels).loss
        fk_hf.unpatch(model.get_base_model())
        assert heads.resolve_head(wrapper, "test").weight is wrapper.original_module.weight
    torch.testing.assert_close(got, ref, **TOL)
    assert heads.resolve_head(wrapper, "test").weight is wrapper.modules_to_save["default"].weight


def test_operands_reproduce_the_lora_layers_forward():
    """resolve_head(...).operands(x): input @ weight.T + bias is the LoRA layer's own output, in both forms."""
    model = peft.get_peft_model(make_base(), lora(target_modules=["lm_head"], lora_dropout=0.25, lora_bias=True))
    layer = model.get_base_model().lm_head
    x = torch.randn(3, 5, 32)
    for train in (True, False):
        layer.train(train)
        torch.manual_seed(3)
        want = layer(x)
        torch.manual_seed(3)
        xi, w, b = heads.resolve_head(layer, "test").operands(x)
        assert xi.shape[-1] == (32 + 4 if train else 32)  # the extra columns only under an active dropout
        torch.testing.assert_close(xi @ w.T + b, want, **TOL)


def test_unsupported_heads_refused_before_training():
    base = make_base()
    peft_model = peft.get_peft_model(copy.deepcopy(base), lora(target_modules=["lm_head"]))
    with pytest.raises(TypeError, match=r"PEFT.s PeftModel.*get_base_model\(\)"):
        fk_hf.patch(peft_model)
    dora = peft.get_peft_model(copy.deepcopy(base), lora(target_modules=["lm_head"], use_dora=True))
    with pytest.raises(TypeError, match=r"PEFT's Linear \(peft\.tuners\.lora.*DoRA.*merge_and_unload"):
        fk_hf.patch(dora.get_base_model())
    assert not fk_hf.is_patched(dora.get_base_model())
    ia3 = peft.get_peft_model(copy.deepcopy(base), peft.IA3Config(target_modules=["lm_head"],
                                                                  feedforward_modules=[]))
    with pytest.raises(TypeError, match=r"PEFT's Linear \(peft\.tuners\.ia3.*merge_and_unload"):
        fk_hf.patch(ia3.get_base_model())
    # a class patched before PEFT wrapped its head: the first labelled call refuses, naming the class
    fk_hf.patch(type(base))
    try:
        input_ids, labels = make_batch()
        with pytest.raises(TypeError, match="DoRA"):
            dora(input_ids=input_ids, labels=labels)
    finally:
        fk_hf.unpatch(type(base))


# ---------------------------------------------------------------------------------------------------------------
# TRL: trainers whose model has a PEFT head, against TRL's own head (or TRL's own CPO loss)

trl_available = importlib.util.find_spec("trl") is not None
if trl_available:
    from test_integrations_trl import assert_same_run, build, run_pair, tiny  # noqa: F401 (tiny: a fixture)

needs_trl = pytest.mark.skipif(not trl_available, reason="needs TRL (pip install -e '.[trl]')")


@needs_trl
@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_trl_modules_to_save_head_matches_trls_head(tiny, monkeypatch, kind):
    """modules_to_save=["lm_head"]: TRL's head reads the wrapper's weight (the saved copy; the original under DPO's
    disabled-adapter reference), fusedkern resolves the same; the steps agree, the saved copy trained."""
    config = lora(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"], init_lora_weights=True)
    plain, fused, calls = run_pair(kind, tiny, monkeypatch, peft_config=config, max_steps=1)
    assert_same_run(plain, fused, ("entropy",))
    assert calls
    saved = [n for n in fused[1] if "lm_head.modules_to_save" in n]
    assert saved


@needs_trl
def test_trl_cpo_with_lora_on_the_head_matches_trls_cpo(tiny, monkeypatch):
    """TRL's SFT/DPO/GRPO/KTO/RLOO refuse a PEFT adapter on lm_head themselves; CPO (trl.experimental) does not, and
    computes its logits through PEFT's forward: fusedkern's head with the adapter's term gives the same step."""
    config = lora(r=4, target_modules=["lm_head", "q_proj"], lora_dropout=0.0)
    plain, fused, calls = run_pair("cpo", tiny, monkeypatch, peft_config=config, cpo_alpha=0.5, max_steps=1)
    assert_same_run(plain, fused, ("rewards/chosen", "logps/chosen", "logits/chosen", "nll_loss"))
    assert any("lm_head.lora_A" in n for n in fused[1])


@needs_trl
def test_trl_check_trainer_refuses_dora_on_the_head(tiny):
    import fusedkern.integrations.trl as fk_trl

    trainer = build("cpo", tiny, True, peft_config=lora(target_modules=["lm_head"], use_dora=True), max_steps=1)
    with pytest.raises(TypeError, match=r"trainer\.model.*DoRA.*merge_and_unload"):
        fk_trl.check_trainer(trainer)
