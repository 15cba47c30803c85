"""fusedkern.integrations.transformers.patch's behaviour on tiny random models (2 layers, hidden 32, vocab 64,
batch 2 × seq 8, fp32): the patched loss and gradients equal the unpatched model's (Transformers' own
ForCausalLMLoss on materialized logits) for the mean and for num_items_in_batch as an int and as a tensor,
shift_labels, logits_to_keep; the logits path without labels is untouched; class patching, subclasses, unpatch,
the context manager, options, eval mode (the warning for Trainer.evaluate's compute_metrics, eval_logits) and
the errors. Every architecture's equality is tests/test_integrations_architectures.py."""

from __future__ import annotations

import functools
import importlib.util
import inspect
import warnings

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

import fusedkern  # noqa: E402
from fusedkern.integrations import transformers as fk_hf  # noqa: E402

HAS_FUSED = importlib.util.find_spec("fusedkern.kernels.fused_ce") is not None

COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager")
ARCHS = {
    "Llama": {},
    "Mistral": {},
    "Qwen2": {},
    "Qwen3": dict(head_dim=8),
    # a softcap that bites: logits of size ~2 (initializer_range 0.3) capped at 1
    "Gemma2": dict(head_dim=8, final_logit_softcapping=1.0, initializer_range=0.3),
    "Phi3": dict(pad_token_id=0, bos_token_id=1, eos_token_id=2),
}
TOL = dict(rtol=1e-5, atol=1e-6)


def make_model(arch: str, seed: int = 0, **overrides) -> nn.Module:
    config = getattr(transformers, f"{arch}Config")(**{**COMMON, **ARCHS[arch], **overrides})
    torch.manual_seed(seed)
    return getattr(transformers, f"{arch}ForCausalLM")(config).train()


def make_batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, COMMON["vocab_size"], (2, 8), generator=g)
    labels = input_ids.clone()
    labels[0, :3] = -100   # a prompt
    labels[1, -2:] = -100  # padding
    return input_ids, labels


def inner_weight(model: nn.Module) -> torch.Tensor:
    return model.model.layers[0].mlp.down_proj.weight


def loss_and_grads(model: nn.Module, input_ids, labels, **kwargs):
    """(output, loss, grad of lm_head.weight, grad of an inner weight) of one forward + backward."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=input_ids, labels=labels, **kwargs)
    out.loss.backward()
    return out, out.loss.detach(), model.lm_head.weight.grad.clone(), inner_weight(model).grad.clone()


def assert_matches_unpatched(model, input_ids, labels, **kwargs):
    assert not fk_hf.is_patched(model)
    ref_out, ref_loss, ref_dw, ref_dinner = loss_and_grads(model, input_ids, labels, **kwargs)
    fk_hf.patch(model)
    out, loss, dw, dinner = loss_and_grads(model, input_ids, labels, **kwargs)
    assert ref_out.logits is not None and out.logits is None
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref_loss, **TOL)
    torch.testing.assert_close(dw, ref_dw, **TOL)
    torch.testing.assert_close(dinner, ref_dinner, **TOL)
    return loss


@pytest.mark.parametrize("num_items", [None, "int", "tensor"])
@pytest.mark.parametrize("arch", ["Llama", "Gemma2"])
def test_loss_and_grads_match_unpatched(arch, num_items):
    model = make_model(arch)
    input_ids, labels = make_batch()
    kwargs = {}
    if num_items is not None:  # 7 is not the number of valid targets (10): the division must be by this number
        kwargs["num_items_in_batch"] = 7 if num_items == "int" else torch.tensor(7)
    loss = assert_matches_unpatched(model, input_ids, labels, **kwargs)
    if num_items is None:  # the mean over the 10 valid shifted targets, not over all 16 positions
        assert (labels[:, 1:] != -100).sum() == 10
        assert torch.isfinite(loss)


def test_gemma2_softcap_is_applied():
    """The Gemma2 cases above would pass with the softcap ignored if the cap did not change the loss."""
    model = make_model("Gemma2")
    input_ids, labels = make_batch()
    with torch.no_grad():
        capped = model(input_ids=input_ids, labels=labels).loss
        model.config.final_logit_softcapping = None
        uncapped = model(input_ids=input_ids, labels=labels).loss
    assert (capped - uncapped).abs() > 1e-2


@pytest.mark.parametrize("impl", ["chunked"] + (["fused"] if HAS_FUSED else []))
def test_options_reach_fusedkern(impl):
    """patch's fusedkern options (strategy, z_loss, label smoothing) are those of linear_cross_entropy."""
    input_ids, labels = make_batch()
    model = make_model("Qwen2")
    options = dict(impl=impl, label_smoothing=0.1, z_loss=1e-2)
    fk_hf.patch(model, **options)
    _, loss, dw, dinner = loss_and_grads(model, input_ids, labels)
    model.zero_grad(set_to_none=True)
    hidden = model.model(input_ids=input_ids).last_hidden_state
    targets = torch.cat([labels[:, 1:], torch.full((2, 1), -100)], dim=1)
    ref = fusedkern.linear_cross_entropy(hidden, model.lm_head.weight, targets, **options)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), **TOL)
    torch.testing.assert_close(dw, model.lm_head.weight.grad, **TOL)
    torch.testing.assert_close(dinner, inner_weight(model).grad, **TOL)


def test_labels_none_gives_the_unpatched_logits():
    input_ids, _ = make_batch()
    for arch in ARCHS:
        model = make_model(arch)
        with torch.no_grad():
            ref, ref_last = model(input_ids=input_ids), model(input_ids=input_ids, logits_to_keep=1)
            fk_hf.patch(model)
            out, last = model(input_ids=input_ids), model(input_ids=input_ids, logits_to_keep=1)
        assert out.loss is None and last.logits.shape == (2, 1, COMMON["vocab_size"])
        torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=0)
        torch.testing.assert_close(last.logits, ref_last.logits, rtol=0, atol=0)


def test_shift_labels():
    """Transformers takes `shift_labels` as the already-shifted targets (labels then only switch the loss on)."""
    input_ids, labels = make_batch()
    shift_labels = torch.roll(labels, -1, dims=1)
    shift_labels[:, -1] = -100
    shift_labels[0, 4] = -100
    assert_matches_unpatched(make_model("Qwen2"), input_ids, labels, shift_labels=shift_labels)


def test_logits_to_keep_with_labels():
    """Like Transformers: the loss covers the kept positions, with labels given for those positions."""
    input_ids, labels = make_batch()
    model = make_model("Llama")
    assert_matches_unpatched(model, input_ids, labels[:, -4:], logits_to_keep=4)
    with pytest.raises(ValueError, match="logits_to_keep"):
        model(input_ids=input_ids, labels=labels, logits_to_keep=4)  # 8 labels a row for 4 kept positions
    fk_hf.unpatch(model)
    with pytest.raises((ValueError, RuntimeError)):  # Transformers refuses it as well
        model(input_ids=input_ids, labels=labels, logits_to_keep=4)


def test_return_dict_false_and_signature_kept():
    input_ids, labels = make_batch()
    model = make_model("Mistral")
    signature = inspect.signature(model.forward)
    with torch.no_grad():
        ref = model(input_ids=input_ids, labels=labels, return_dict=False)
        fk_hf.patch(model)
        out = model(input_ids=input_ids, labels=labels, return_dict=False)
    assert isinstance(out, tuple) and out[0].ndim == 0
    torch.testing.assert_close(out[0], ref[0], **TOL)
    # Trainer reads the signature (dataset columns to keep, whether loss kwargs such as num_items_in_batch pass)
    assert inspect.signature(model.forward) == signature
    assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())


def test_patch_by_class_before_from_pretrained(tmp_path):
    input_ids, labels = make_batch()
    make_model("Phi3").save_pretrained(tmp_path)
    cls = transformers.Phi3ForCausalLM
    original = cls.__dict__["forward"]
    ref = cls.from_pretrained(tmp_path, attn_implementation="eager")
    _, ref_loss, ref_dw, ref_dinner = loss_and_grads(ref, input_ids, labels, num_items_in_batch=torch.tensor(5))
    try:
        assert fk_hf.patch(cls) is cls
        model = cls.from_pretrained(tmp_path, attn_implementation="eager")
        assert fk_hf.is_patched(cls) and fk_hf.is_patched(model) and fk_hf.is_patched(ref)
        assert not fk_hf.is_patched(transformers.LlamaForCausalLM)
        out, loss, dw, dinner = loss_and_grads(model, input_ids, labels, num_items_in_batch=torch.tensor(5))
        assert out.logits is None
        torch.testing.assert_close(loss, ref_loss, **TOL)
        torch.testing.assert_close(dw, ref_dw, **TOL)
        torch.testing.assert_close(dinner, ref_dinner, **TOL)
        fk_hf.patch(cls, impl="chunked")  # patching again changes the options, still one wrapper deep
        assert fk_hf._info(cls.__dict__["forward"]).original is original
    finally:
        fk_hf.unpatch(cls)
    assert cls.__dict__["forward"] is original and not fk_hf.is_patched(model)


def test_subclasses():
    class Tuned(transformers.LlamaForCausalLM):  # keeps the inherited forward
        pass

    class Custom(transformers.LlamaForCausalLM):  # its own forward, delegating: the stand-ins reach the parent's
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    try:
        fk_hf.patch(Tuned)
        assert fk_hf.is_patched(Tuned) and not fk_hf.is_patched(transformers.LlamaForCausalLM)
    finally:
        fk_hf.unpatch(Tuned)
    assert "forward" not in Tuned.__dict__
    input_ids, labels = make_batch()
    config = transformers.LlamaConfig(**COMMON)
    torch.manual_seed(0)
    model = Custom(config).train()
    ref_loss = model(input_ids=input_ids, labels=labels, num_items_in_batch=5).loss
    try:
        fk_hf.patch(Custom)
        out = model(input_ids=input_ids, labels=labels, num_items_in_batch=5)
    finally:
        fk_hf.unpatch(Custom)
    assert out.logits is None
    torch.testing.assert_close(out.loss, ref_loss, **TOL)


@pytest.mark.parametrize("bad", [transformers.BartForCausalLM, transformers.LlamaModel, nn.Linear(2, 2), "llama"],
                         ids=["bart-own-loss", "llama-base-model", "linear", "str"])
def test_unsupported_raises_type_error(bad):
    with pytest.raises(TypeError) as err:
        fk_hf.patch(bad)
    if not isinstance(bad, str):  # the message says what the patch needs
        assert "linear head over the decoder's last hidden state" in str(err.value)


def test_unpatch_and_context_manager():
    model = make_model("Qwen3")
    fk_hf.unpatch(model)  # not patched: a no-op
    with fk_hf.patched(model, impl="chunked") as m:
        assert m is model and fk_hf.is_patched(model)
    assert not fk_hf.is_patched(model) and "forward" not in model.__dict__
    fk_hf.patch(model, impl="chunked")
    with fk_hf.patched(model, impl="fused", z_loss=1e-4):
        assert fk_hf._info(model.forward).options["impl"] == "fused"
    assert fk_hf._info(model.forward).options["impl"] == "chunked"
    assert fk_hf.unpatch(model) is model and not fk_hf.is_patched(model)


def test_bad_options_and_lm_head():
    model = make_model("Llama")
    with pytest.raises(ValueError, match="impl"):
        fk_hf.patch(model, impl="logits")
    with pytest.raises(ValueError, match="label_smoothing"):
        fk_hf.patch(model, label_smoothing=1.5)
    assert not fk_hf.is_patched(model)
    fk_hf.patch(model)
    model.lm_head = nn.Sequential(model.lm_head)
    input_ids, labels = make_batch()
    with pytest.raises(TypeError, match="nn.Linear"):
        model(input_ids=input_ids, labels=labels)


def test_eval_logits_option():
    input_ids, labels = make_batch()
    model = make_model("Llama").eval()
    with torch.no_grad():
        ref = model(input_ids=input_ids, labels=labels)
        fk_hf.patch(model, eval_logits=True)
        out = model(input_ids=input_ids, labels=labels)  # eval mode: the original forward
        assert out.logits is not None
        torch.testing.assert_close(out.loss, ref.loss, rtol=0, atol=0)
        fused = model.train()(input_ids=input_ids, labels=labels)
    assert fused.logits is None
    torch.testing.assert_close(fused.loss, ref.loss, **TOL)
    with pytest.raises(TypeError, match="eval_logits"):
        fk_hf.patch(model, eval_logits="yes")


def test_evaluation_warns_once_that_logits_are_none():
    """Issue 32 4(b): in eval mode under no_grad (an evaluation loop) a labelled batch gets logits=None;
    the default says so once per patch; eval_logits=False keeps the fused loss without the warning; a
    training step, or eval mode with grad (a loop that never called .train()), does not warn."""
    input_ids, labels = make_batch()
    model = fk_hf.patch(make_model("Llama"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model(input_ids=input_ids, labels=labels)          # training
        model.eval()(input_ids=input_ids, labels=labels)   # eval mode, grad on
    with torch.no_grad():
        with pytest.warns(UserWarning, match="compute_metrics.*eval_logits=True"):
            out = model(input_ids=input_ids, labels=labels)
        assert out.logits is None
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            model(input_ids=input_ids, labels=labels)      # once
            fk_hf.patch(model, eval_logits=False)
            model(input_ids=input_ids, labels=labels)
            model(input_ids=input_ids)                     # no labels: the logits, nothing to say


@pytest.mark.parametrize("eval_logits", [None, True])
def test_trainer_evaluate_with_compute_metrics(tmp_path, eval_logits):
    """Trainer.evaluate with compute_metrics on a patched model: by default a warning (its predictions
    are empty); with eval_logits=True, compute_metrics gets the logits and the loss is Transformers'."""
    input_ids, labels = make_batch()
    rows = [dict(input_ids=input_ids[i], labels=labels[i]) for i in range(2)]
    seen = []

    def compute_metrics(prediction):
        seen.append(prediction.predictions)
        return {}

    model = make_model("Llama")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_eval_batch_size=2, report_to=[],
                                          use_cpu=True, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, eval_dataset=rows, compute_metrics=compute_metrics)
    ref = trainer.evaluate()["eval_loss"]
    fk_hf.patch(model, eval_logits=eval_logits)
    if eval_logits is None:
        with pytest.warns(UserWarning, match="compute_metrics"):
            trainer.evaluate()
        assert seen[-1] is None or len(seen[-1]) == 0  # what the warning is about
    else:
        assert trainer.evaluate()["eval_loss"] == pytest.approx(ref, rel=1e-6)
        assert seen[-1].shape == (2, 8, COMMON["vocab_size"])


def test_accelerate_hooked_instance():
    """accelerate's hooks move the model's forward to `_old_forward` and call it from their own."""
    input_ids, labels = make_batch()
    model = make_model("Llama")
    with torch.no_grad():
        ref = model(input_ids=input_ids, labels=labels).loss
    model._hf_hook = object()
    model._old_forward = model.forward
    model.forward = functools.partial(lambda module, *a, **k: module._old_forward(*a, **k), model)
    hook_forward = model.forward
    fk_hf.patch(model)
    assert model.forward is hook_forward and fk_hf.is_patched(model)
    with torch.no_grad():
        out = model(input_ids=input_ids, labels=labels)
    assert out.logits is None
    torch.testing.assert_close(out.loss, ref, **TOL)
    fk_hf.unpatch(model)
    assert fk_hf._info(model._old_forward) is None


def test_autocast_fp16():
    """Under autocast the head runs in the autocast dtype, as nn.Linear would (fp16: bf16 tl.dot is broken
    in Triton's CPU interpreter)."""
    input_ids, labels = make_batch()
    model = make_model("Llama")
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        ref = model(input_ids=input_ids, labels=labels).loss
        fk_hf.patch(model)
        out = model(input_ids=input_ids, labels=labels).loss
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref.float(), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("skip_ignored", [True, False])
def test_skip_ignored_passes_the_device_count(monkeypatch, skip_ignored):
    """By default the patch hands fusedkern the count of non-ignored targets as a device tensor (its
    row-count path skips prompt and padding rows, no host sync); skip_ignored=False computes densely."""
    seen = []
    real = fk_hf.linear_cross_entropy

    def spy(*args, **kwargs):
        seen.append(kwargs.get("num_valid_tokens"))
        return real(*args, **kwargs)
    monkeypatch.setattr(fk_hf, "linear_cross_entropy", spy)
    input_ids, labels = make_batch()
    model = make_model("Llama")
    ref_loss = model(input_ids=input_ids, labels=labels).loss
    fk_hf.patch(model, skip_ignored=skip_ignored)
    loss = model(input_ids=input_ids, labels=labels).loss
    torch.testing.assert_close(loss, ref_loss, **TOL)
    if skip_ignored:
        assert torch.is_tensor(seen[0]) and seen[0].item() == 10  # 16 targets: 3 prompt, 2 padding, 1 shifted out
    else:
        assert seen == [None]
    with pytest.raises(TypeError, match="skip_ignored"):
        fk_hf.patch(model, skip_ignored="yes")


REAL_HEADS = {  # the heads users train, with one small decoder layer: the head dominates the model
    "Llama": dict(vocab_size=128256, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8),
    "Qwen2": dict(vocab_size=151936, hidden_size=3584, num_attention_heads=28, num_key_value_heads=4),
    "Gemma2": dict(vocab_size=256000, hidden_size=2304, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                   final_logit_softcapping=30.0),
}


def real_head_config(arch: str, **overrides):
    """REAL_HEADS[arch]'s config with one decoder layer: SDPA attention where the architecture has it, else
    eager (Gemma-2's softcapped attention has no SDPA path in Transformers 5, which refuses to build it)."""
    sdpa = getattr(transformers, f"{arch}ForCausalLM")._supports_sdpa
    return getattr(transformers, f"{arch}Config")(**{
        **COMMON, **ARCHS[arch], **REAL_HEADS[arch], "intermediate_size": 1024, "num_hidden_layers": 1,
        "max_position_embeddings": 2048, "initializer_range": 0.02,
        "attn_implementation": "sdpa" if sdpa else "eager", **overrides})


@pytest.mark.parametrize("arch", list(REAL_HEADS))
def test_real_head_configs_build(arch):
    """The GPU test's configs, shrunk, build and train patched on the CPU with the attention they ask for."""
    small = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64)
    if "head_dim" in REAL_HEADS[arch]:
        small["head_dim"] = 8
    config = real_head_config(arch, **small)
    torch.manual_seed(0)
    model = getattr(transformers, f"{arch}ForCausalLM")(config).train()
    assert model.config._attn_implementation == ("eager" if arch == "Gemma2" else "sdpa")
    assert_matches_unpatched(model, *make_batch())


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-300)).item()


@pytest.mark.gpu
@pytest.mark.parametrize("arch", list(REAL_HEADS))
def test_patched_real_heads_under_bf16_autocast_on_gpu(arch):
    """A realistic head (the architecture's vocabulary and hidden size, one decoder layer, 2 × 1024 tokens,
    a third of them prompt or padding) under bf16 autocast with fp32 weights: the patched model's loss,
    lm_head gradient and an inner gradient are within 2× the unpatched bf16 model's error against the
    same model in float64 (no autocast)."""
    config = real_head_config(arch)
    torch.manual_seed(0)
    model = getattr(transformers, f"{arch}ForCausalLM")(config).train().cuda()
    reference = getattr(transformers, f"{arch}ForCausalLM")(config).train().cuda().double()
    reference.load_state_dict(model.state_dict())
    g = torch.Generator(device="cuda").manual_seed(1)
    input_ids = torch.randint(0, config.vocab_size, (2, 1024), device="cuda", generator=g)
    labels = input_ids.clone()
    labels[0, :300] = -100   # a prompt
    labels[1, -400:] = -100  # padding

    def run(m, autocast: bool):
        m.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = m(input_ids=input_ids, labels=labels).loss
        loss.backward()
        return loss.detach(), m.lm_head.weight.grad.clone(), inner_weight(m).grad.clone()

    want = run(reference, autocast=False)
    baseline = run(model, autocast=True)
    fk_hf.patch(model)
    got = run(model, autocast=True)
    for name, g_, b_, w_ in zip(("loss", "d lm_head", "d inner"), got, baseline, want):
        assert g_.dtype == torch.float32, name
        err, torch_err = _relative_error(g_, w_), _relative_error(b_, w_)
        assert err <= 2 * torch_err + 1e-6, f"{arch} {name}: fusedkern {err:.3g} vs torch bf16 {torch_err:.3g}"
