"""fusedkern.integrations.transformers.patch on one tiny random model (1 layer, hidden 32, vocab 64, batch 2 ×
seq 8, fp32, no download) of each of 26 causal-LM architectures: the patched loss and every parameter's gradient
equal the unpatched model's (Transformers' own forward on materialized logits), with ignored labels and
`num_items_in_batch`. The patch has no list of classes: these cases are what its detection was tested on —
tied and untied heads, head biases (Phi, GPT-J), Gemma-2/3's tanh cap, Cohere's `logit_scale`, Granite's
`logits_scaling`, MoE routers' auxiliary loss (Mixtral, Qwen2/3-MoE, OLMoE, GraniteMoE) — and each such
transform is checked to change the loss, so that a patch ignoring it would fail. Also: no [B, S, V] tensor in
a patched step; the folded transforms under fp16 autocast; PEFT LoRA on the body; what is refused, and when —
a forward that computes its loss without `self.loss_function` (at patch time), one that does something else
to the logits (at its first labelled call)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from transformers.modeling_outputs import CausalLMOutputWithPast  # noqa: E402

from fusedkern.integrations import transformers as fk_hf  # noqa: E402

# the 26 cases and their tiny models live with the study (notebook 11 tabulates the same comparison)
from fusedkern.study.architectures import COMMON, CASES, make_batch, make_model  # noqa: E402

# how to switch each transform off (for the check that it changes the loss)
NEUTRAL = {
    "softcap": lambda m: setattr(m.config, "final_logit_softcapping", None),
    "scale": lambda m: (setattr(m, "logit_scale", 1.0) if hasattr(m, "logit_scale")
                        else setattr(m.config, "logits_scaling", 1.0)),
}
TOL = dict(rtol=1e-5, atol=1e-6)


def run(model: nn.Module, input_ids, labels, **kwargs):
    """(output, loss, {parameter name: gradient}) of one forward + backward; the same dropout masks on each
    call (GPT-2 style configs train with dropout on)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    out = model(input_ids=input_ids, labels=labels, **kwargs)
    out.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return out, out.loss.detach(), grads


def assert_same(got, want):
    loss, grads = got
    ref_loss, ref_grads = want
    torch.testing.assert_close(loss, ref_loss, **TOL)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], **TOL, msg=lambda m, name=name: f"d {name}: {m}")


@pytest.mark.parametrize("name", list(CASES))
def test_patched_equals_unpatched(name):
    model = make_model(name)
    features = CASES[name][3]
    head = model.get_output_embeddings()
    assert ("tied" in features) == (head.weight is model.get_input_embeddings().weight)
    assert ("bias" in features) == (head.bias is not None)
    input_ids, labels = make_batch()
    num_items = torch.tensor(7)  # not the 10 valid targets: the sum must be divided by this number
    ref_out, ref_loss, ref_grads = run(model, input_ids, labels, num_items_in_batch=num_items)
    assert ref_out.logits is not None and len(ref_grads) == len(list(model.parameters()))
    fk_hf.patch(model)
    out, loss, grads = run(model, input_ids, labels, num_items_in_batch=num_items)
    assert out.logits is None and loss.dtype == torch.float32
    assert_same((loss, grads), (ref_loss, ref_grads))
    if "moe" in features:  # the router's auxiliary loss is returned and added, as unpatched
        torch.testing.assert_close(out.aux_loss, ref_out.aux_loss, **TOL)
    fk_hf.unpatch(model)
    for feature in set(features) & set(NEUTRAL):  # the transform matters: a patch ignoring it would fail above
        NEUTRAL[feature](model)
        with torch.no_grad():
            plain = model(input_ids=input_ids, labels=labels, num_items_in_batch=num_items).loss
        assert (plain - ref_loss).abs() > 1e-2, feature


class VocabWatch(TorchDispatchMode):
    """The shapes of the tensors ops return whose last dimension is `vocab`."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.shapes = vocab, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.ndim >= 2 and t.shape[-1] == self.vocab:
                self.shapes.append(tuple(t.shape))
        return out


@pytest.mark.parametrize("name", ["Gemma3", "Cohere", "Phi", "GraniteMoe"])
def test_no_logits_tensor_in_a_patched_step(name):
    """No tensor of a training step (forward and backward) has the vocabulary as last dimension and as many
    rows as the batch has positions: the [B, S, V] logits, their upcast and their gradient never exist.
    The unpatched step has them (the check can fail)."""
    vocab = 61  # prime: no other dimension of the model is 61 (the weight is [61, 32])
    input_ids, labels = make_batch()
    input_ids, labels = input_ids % vocab, labels.where(labels < 0, labels % vocab)
    cls, config_cls, overrides, _ = CASES[name]
    config = getattr(transformers, config_cls)(**{**COMMON, **overrides, "vocab_size": vocab})
    model = getattr(transformers, cls)(config).train()
    positions = input_ids.numel()
    rows = {}
    for patched in (False, True):
        if patched:
            fk_hf.patch(model)
        watch = VocabWatch(vocab)
        with watch:
            model(input_ids=input_ids, labels=labels).loss.backward()
        rows[patched] = max((torch.Size(s[:-1]).numel() for s in watch.shapes), default=0)
    assert rows[False] >= positions > rows[True], rows


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


@pytest.mark.parametrize("name", ["Gemma2", "Cohere", "Granite", "Phi"])
def test_folded_transforms_under_fp16_autocast(name):
    """Under autocast the scale is applied to the hidden states before their cast (the unpatched model scales
    the rounded fp16 logits) and the cap in fp32: the loss equals the unpatched fp16 model's to fp16
    precision and the head's and an inner weight's gradients are within 2x the unpatched fp16 model's error
    against the same model in float64 (measured: 0.91-1.01x). fp16: bf16 dot is broken in Triton's CPU
    interpreter."""
    model = make_model(name)
    reference = make_model(name).double()
    input_ids, labels = make_batch()
    inner = next(n for n, p in model.named_parameters() if p.ndim == 2 and "embed" not in n and "head" not in n)

    def step(m, autocast: bool):
        m.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
            loss = m(input_ids=input_ids, labels=labels).loss
        loss.backward()
        grads = dict(m.named_parameters())
        return loss.detach(), m.get_output_embeddings().weight.grad.clone(), grads[inner].grad.clone()

    want = step(reference, autocast=False)
    baseline = step(model, autocast=True)
    got = step(fk_hf.patch(model), autocast=True)
    assert got[0].dtype == torch.float32
    torch.testing.assert_close(got[0], baseline[0], rtol=2e-3, atol=0)
    for what, g, b, w in zip(("d head", f"d {inner}"), got[1:], baseline[1:], want[1:]):
        err, torch_err = _relative_error(g, w), _relative_error(b, w)
        assert err <= 2 * torch_err, f"{name} {what}: fusedkern {err:.3g} vs torch fp16 {torch_err:.3g}"


@pytest.mark.parametrize("name", ["Mixtral", "GraniteMoe"])
def test_router_aux_loss_is_the_models_own(name):
    """The auxiliary loss reaches the loss with the model's coefficient (and not without router logits)."""
    model = fk_hf.patch(make_model(name))
    input_ids, labels = make_batch()
    with torch.no_grad():
        with_aux = model(input_ids=input_ids, labels=labels)
        without = model(input_ids=input_ids, labels=labels, output_router_logits=False)
    assert without.aux_loss is None and with_aux.aux_loss > 0
    torch.testing.assert_close(with_aux.loss - without.loss, 0.1 * with_aux.aux_loss, **TOL)


def test_trainable_logit_scale_gets_its_gradient():
    """A one-element tensor scale (here a Parameter in place of Cohere's float) is folded into the hidden
    states differentiably: its own gradient equals the unpatched model's."""
    model = make_model("Cohere")
    model.logit_scale = nn.Parameter(torch.tensor(0.7))
    input_ids, labels = make_batch()
    _, ref_loss, ref_grads = run(model, input_ids, labels)
    assert "logit_scale" in ref_grads
    fk_hf.patch(model)
    _, loss, grads = run(model, input_ids, labels)
    assert_same((loss, grads), (ref_loss, ref_grads))


def test_mean_and_logits_path_of_a_capped_model():
    """Without num_items_in_batch (the mean); without labels the logits are the original forward's."""
    model = make_model("Gemma3")
    input_ids, labels = make_batch()
    _, ref_loss, ref_grads = run(model, input_ids, labels)
    with torch.no_grad():
        ref_logits = model(input_ids=input_ids).logits
    fk_hf.patch(model)
    _, loss, grads = run(model, input_ids, labels)
    assert_same((loss, grads), (ref_loss, ref_grads))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=input_ids).logits, ref_logits, rtol=0, atol=0)


class _OwnForward(transformers.LlamaForCausalLM):
    """A user's subclass with its own forward: `op` is applied to the head's logits."""

    op = staticmethod(lambda logits: logits)

    def forward(self, input_ids=None, labels=None, **kwargs):
        logits = self.op(self.lm_head(self.model(input_ids=input_ids).last_hidden_state))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits)


def _own_forward_model(op) -> nn.Module:
    config = transformers.LlamaConfig(**COMMON)
    torch.manual_seed(0)
    model = _OwnForward(config).train()
    model.op = op
    return model


@pytest.mark.parametrize("op", [lambda z: torch.tanh(z / 3.0) * 2.0, lambda z: 0.5 * z.float()],
                         ids=["cap-2-of-z/3", "half"])
def test_subclass_with_its_own_forward(op):
    """The operations are read from what the forward does, not from the class: a cap b·tanh(a·z) with
    a·b ≠ 1 folds as fusedkern's softcap b on (a·b)·z."""
    model = _own_forward_model(op)
    input_ids, labels = make_batch()
    _, ref_loss, ref_grads = run(model, input_ids, labels)
    fk_hf.patch(model)
    out, loss, grads = run(model, input_ids, labels)
    assert out.logits is None
    assert_same((loss, grads), (ref_loss, ref_grads))


@pytest.mark.parametrize("op, what", [
    (lambda z: z + 1.0, "addition"),
    (lambda z: 1.0 / z, "other than scaling"),
    (lambda z: z[..., :32], "indexing"),
    (lambda z: z.logsumexp(-1), "logits.logsumexp"),
    (lambda z: torch.softmax(z, -1), "softmax"),
    (lambda z: z * torch.ones(64), "tensor of shape"),
    (lambda z: torch.tanh(torch.tanh(z)), "second tanh"),
    (lambda z: torch.tanh(z) * -2.0, "must be positive"),
    (lambda z: z.to(torch.bfloat16), "logits.to"),
])
def test_unreproducible_logit_ops_raise_at_the_first_labelled_call(op, what):
    model = fk_hf.patch(_own_forward_model(op))
    input_ids, labels = make_batch()
    with pytest.raises(TypeError, match=what) as err:
        model(input_ids=input_ids, labels=labels)
    assert "_OwnForward.forward" in str(err.value)
    assert fk_hf.is_patched(model) and "lm_head" not in model.__dict__  # the stand-ins are gone


def test_forward_that_skips_loss_function_raises():
    class NoLoss(transformers.LlamaForCausalLM):
        def forward(self, input_ids=None, labels=None, **kwargs):
            logits = self.lm_head(self.model(input_ids=input_ids).last_hidden_state)
            if labels is not None and kwargs.get("use_the_models_loss"):  # never given here
                return self.loss_function(logits, labels, self.config.vocab_size)
            return CausalLMOutputWithPast(logits=logits)

    config = transformers.LlamaConfig(**COMMON)
    model = fk_hf.patch(NoLoss(config))
    input_ids, labels = make_batch()
    with pytest.raises(TypeError, match="never called self.loss_function"):
        model(input_ids=input_ids, labels=labels)


class _NoLabels(transformers.LlamaForCausalLM):
    def forward(self, input_ids):
        return super().forward(input_ids=input_ids)


@pytest.mark.parametrize("cls, what", [
    (_NoLabels, "its forward takes no labels"),
    (transformers.BartForCausalLM, "BartForCausalLM.forward computes no loss with self.loss_function"),
    (transformers.LlamaModel, "LlamaModel.forward computes no loss with self.loss_function"),  # no head
    (nn.Linear, "not a Transformers PreTrainedModel"),
])
def test_refused_at_patch_time(cls, what):
    with pytest.raises(TypeError, match=what):
        fk_hf.patch(cls)


def test_custom_loss_function_is_refused():
    """A loss set on the model (or a config.loss_type other than causal-LM) is not Transformers'
    ForCausalLMLoss, which is what fusedkern computes: refused rather than silently replaced."""
    model = fk_hf.patch(make_model("Qwen2"))
    model.loss_function = lambda logits, labels, vocab_size, **kwargs: logits.float().mean()
    input_ids, labels = make_batch()
    with pytest.raises(TypeError, match="ForCausalLMLoss"):
        model(input_ids=input_ids, labels=labels)


def test_lora_on_the_body():
    """PEFT LoRA adapters on the attention: the patched base model's loss and the adapters' gradients equal
    the unpatched model's (the head stays a plain nn.Linear)."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(make_model("Qwen3"), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                                      init_lora_weights=False))
    input_ids, labels = make_batch()
    _, ref_loss, ref_grads = run(model, input_ids, labels)
    assert ref_grads and all("lora_" in name for name in ref_grads)
    fk_hf.patch(model.get_base_model())
    out, loss, grads = run(model, input_ids, labels)
    assert out.logits is None
    assert_same((loss, grads), (ref_loss, ref_grads))


def test_torch_compile_of_a_patched_model():
    """torch.compile over the patched forward (the stand-ins are Python objects dynamo traces or breaks on):
    same loss and gradients. aot_eager: dynamo and autograd's tracing without a C++ compiler on CI."""
    model = make_model("Gemma2")
    input_ids, labels = make_batch()
    _, ref_loss, ref_grads = run(model, input_ids, labels)
    compiled = torch.compile(fk_hf.patch(model), backend="aot_eager")
    out, loss, grads = run(compiled, input_ids, labels)
    assert out.logits is None
    grads = {name.removeprefix("_orig_mod."): grad for name, grad in grads.items()}
    assert_same((loss, grads), (ref_loss, ref_grads))
