"""fusedkern's TRL patch beside Liger-Kernel's layer kernels (issue 43 item 3).

Liger brings the body (RoPE, RMSNorm, SwiGLU), fusedkern the head: TRL's `use_liger_kernel=True` (applied by
`Trainer.train()`, with TRL's own `fused_linear_cross_entropy=False` in SFT, DPO and GRPO, and fusedkern's for the
other covered trainers) and `apply_liger_kernel_to_*(model=..., fused_linear_cross_entropy=False,
cross_entropy=False)` by hand. On CPU (Triton's interpreter, with `fusedkern.study.liger_layers.interpreted()`,
which makes Liger's RMSNorm and SwiGLU kernels runnable there: its docstring says why they are not as they are):
Liger's layers match PyTorch's; each trainer with Liger's layers and fusedkern's head runs fusedkern's head (its
calls counted), keeps Liger's layers in the model, and logs the same losses and metrics and makes the same updates
as TRL's own head with the same Liger layers; a Liger loss that would replace the head is switched off, refused or
reported by `check_trainer`. On a GPU: one SFT step with both under bf16 autocast. Liger's process-wide
replacements are undone after each test (`liger_patches_undone`)."""

from __future__ import annotations

import contextlib
import importlib.util
import math

import pytest
import torch

from fusedkern._runtime import interpreting

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="needs TRL (pip install 'fusedkern[trl]')"),
    pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None,
                       reason="needs Liger-Kernel (pip install -e '.[liger]': liger-kernel 0.8.5)"),
    pytest.mark.usefixtures("one_cpu_thread"),
]
cpu = pytest.mark.skipif(not interpreting(), reason="CPU tensors need Triton's interpreter (on when no GPU is visible)")

V = 80
METRIC_ATOL = 2e-5  # as tests/test_integrations_trl.py: TRL's metrics are differences of sums of ~−20 log-probs


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama (untied head) and Qwen3 (tied), saved, a word-level tokenizer and small datasets."""
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    words = ["<pad>", "<s>", "</s>"] + [f"w{i}" for i in range(V - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", bos_token="<s>")
    g = torch.Generator().manual_seed(0)

    def text(n):
        return " ".join(f"w{int(i)}" for i in torch.randint(0, V - 3, (n,), generator=g))

    n = 8
    prompts = [text(4 + i % 3) for i in range(n)]
    data = {
        "pref": Dataset.from_dict({"prompt": prompts, "chosen": [" " + text(2 + i % 2) for i in range(n)],
                                   "rejected": [" " + text(3) for i in range(n)]}),
        "sft": Dataset.from_dict({"prompt": prompts, "completion": [" " + text(3 + i % 2) for i in range(n)]}),
        "prompt": Dataset.from_dict({"prompt": prompts}),
    }
    shape = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    paths = {}
    for name, config, cls in (("llama", LlamaConfig(**shape), LlamaForCausalLM),
                              ("qwen3", Qwen3Config(**shape, head_dim=8, tie_word_embeddings=True), Qwen3ForCausalLM)):
        torch.manual_seed(0)
        paths[name] = str(tmp_path_factory.mktemp(f"tiny_{name}"))
        cls(config).save_pretrained(paths[name])
    return dict(tokenizer=tokenizer, data=data, paths=paths, out=str(tmp_path_factory.mktemp("liger_out")))


@pytest.fixture
def liger_cpu():
    """Liger's kernels runnable in the interpreter, and its process-wide replacements undone after the test."""
    from fusedkern.study.liger_layers import interpreted, liger_patches_undone

    with liger_patches_undone(), interpreted():
        yield


def build(kind, tiny, fused, arch="llama", by_hand=False, **config):
    """A TRL trainer of `kind` from the saved tiny model, built while fusedkern is patched or not; `by_hand` applies
    Liger's layer kernels to the model instance before the trainer is built."""
    import trl
    from transformers import AutoModelForCausalLM

    import fusedkern.integrations.trl as fk_trl
    from fusedkern.study.liger_layers import LAYERS_ONLY

    common = dict(output_dir=tiny["out"], per_device_train_batch_size=2, max_steps=2, learning_rate=0.5,
                  optim="sgd", lr_scheduler_type="constant", logging_steps=1, report_to=[], use_cpu=True,
                  save_strategy="no", seed=0, disable_tqdm=True, bf16=False)
    common.update(config)
    path = tiny["paths"][arch]
    # use_kernels=False: with the `kernels` package installed, Transformers 5.25 kernelizes by default, and a later
    # model.train() / eval() re-kernelizes and drops Liger's RMSNorm (test_hub_kernels_drop_liger_rms_norm)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, use_kernels=False)
    if by_hand:
        import liger_kernel.transformers as liger

        getattr(liger, f"apply_liger_kernel_to_{arch}")(model=model, **LAYERS_ONLY)
    kw = dict(model=model, processing_class=tiny["tokenizer"])
    if kind == "sft":
        cls, args, data = trl.SFTTrainer, trl.SFTConfig(**common), tiny["data"]["sft"]
    elif kind == "dpo":
        cls, args, data = trl.DPOTrainer, trl.DPOConfig(**common), tiny["data"]["pref"]
        kw["ref_model"] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, use_kernels=False)
    elif kind == "grpo":
        common.setdefault("num_generations", 2)
        common.setdefault("max_completion_length", 4)
        cls, args, data = trl.GRPOTrainer, trl.GRPOConfig(**common), tiny["data"]["prompt"]
        kw["reward_funcs"] = lambda completions, **_: [len(c) / 8.0 + (0.5 if "w1" in c else 0.0)
                                                       for c in completions]
    elif kind == "cpo":
        from trl.experimental.cpo import CPOConfig, CPOTrainer

        cls, args, data = CPOTrainer, CPOConfig(**common), tiny["data"]["pref"]
    else:
        raise AssertionError(kind)
    if fused:
        with fk_trl.patched():
            return cls(train_dataset=data, args=args, **kw)
    return cls(train_dataset=data, args=args, **kw)


def count_calls(monkeypatch):
    import fusedkern.integrations.trl as fk_trl

    calls = []
    for name in ("linear_logprobs_with_stats", "linear_logprobs_anticipated"):
        real = getattr(fk_trl, name)
        monkeypatch.setattr(fk_trl, name, lambda *a, _real=real, **k: calls.append(1) or _real(*a, **k))
    return calls


def train(trainer, fused):
    import fusedkern.integrations.trl as fk_trl

    if fused:
        fk_trl.check_trainer(trainer)
    trainer.train()
    steps = [h for h in trainer.state.log_history if "loss" in h]
    return steps, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def assert_same_run(plain, fused):
    (logs_p, params_p), (logs_f, params_f) = plain, fused
    assert len(logs_p) == len(logs_f) >= 1
    for a, b in zip(logs_p, logs_f):
        assert set(a) == set(b)
        for key, value in a.items():
            if key in ("step_time", "train_runtime") or not isinstance(value, float):
                continue
            if key.endswith("accuracies") and abs(a.get("rewards/margins", 1.0)) < 1e-4:
                continue  # two rewards equal up to rounding (policy = reference at step 0): a coin
            assert math.isfinite(b[key])
            assert b[key] == pytest.approx(value, rel=1e-4, abs=METRIC_ATOL), key
    for name, p in params_p.items():
        torch.testing.assert_close(params_f[name], p, rtol=1e-4, atol=2e-5, msg=name)


def assert_liger_layers(model, arch):
    """Liger's RMSNorm on every norm, its SwiGLU on every MLP and its RoPE in the model's modeling module."""
    from fusedkern.study.liger_layers import liger_layers

    layers = model.config.num_hidden_layers
    found = liger_layers(model)
    norms_per_layer = 4 if arch == "qwen3" else 2  # Qwen3's q_norm and k_norm too
    assert len(found["rms_norm"]) == norms_per_layer * layers + 1, found
    assert len(found["swiglu"]) == layers, found
    assert found["rope"] == [type(model).__module__], found


@cpu
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_liger_layer_kernels_match_pytorch_in_the_interpreter(tiny, liger_cpu, arch):
    """Liger's layer kernels on CPU tensors (the interpreter, with interpreted()): the loss and every parameter's
    gradient of a tiny model equal PyTorch's layers'."""
    import liger_kernel.transformers as liger
    from transformers import AutoModelForCausalLM

    from fusedkern.study.liger_layers import LAYERS_ONLY

    torch_model, liger_model = (AutoModelForCausalLM.from_pretrained(tiny["paths"][arch], dtype=torch.float32,
                                                                     use_kernels=False) for _ in range(2))
    getattr(liger, f"apply_liger_kernel_to_{arch}")(model=liger_model, **LAYERS_ONLY)
    assert_liger_layers(liger_model, arch)
    ids = torch.randint(3, V, (2, 9), generator=torch.Generator().manual_seed(1))
    losses = []
    for model in (torch_model, liger_model):
        loss = model(ids, labels=ids).loss
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(torch_model.named_parameters(), liger_model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


@cpu
def test_liger_kernels_need_interpreted_on_cpu():
    """What `interpreted()` works around, as found with Liger 0.8.5 and Triton 3.6: outside it, Liger's RMSNorm and
    SwiGLU kernels fail in the interpreter; inside it they give PyTorch's values. (If the first part fails, the
    interpreter runs Liger's kernels as they are and `interpreted()` can go.)"""
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    from triton.runtime.errors import InterpreterError

    from fusedkern.study.liger_layers import interpreted

    norm = LigerRMSNorm(32)
    x, a, b = torch.randn(4, 32), torch.randn(4, 16), torch.randn(4, 16)
    with pytest.raises(InterpreterError):
        norm(x)
    with pytest.raises(InterpreterError):
        LigerSiLUMulFunction.apply(a, b)
    with interpreted():
        y, c = norm(x), LigerSiLUMulFunction.apply(a, b)
    torch.testing.assert_close(y, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(c, torch.nn.functional.silu(a) * b)


@pytest.mark.skipif(importlib.util.find_spec("kernels") is None, reason="needs the kernels package")
def test_hub_kernels_drop_liger_rms_norm(tiny):
    """Why every model here (and in scripts/gpu_train_table.py, and on the GPU machine: USE_HUB_KERNELS=NO) is
    loaded without Hub kernels: with the `kernels` package installed, Transformers 5.25's from_pretrained kernelizes
    by default, and the next change of mode (`model.train()`, `eval()`) kernelizes again, which puts PyTorch's
    RMSNorm forward back over the one Liger bound on the instance; without kernels, Liger's stays."""
    import liger_kernel.transformers as liger
    from transformers import AutoModelForCausalLM

    from fusedkern.study.liger_layers import LAYERS_ONLY, liger_layers, liger_patches_undone

    with liger_patches_undone():
        for use_kernels in (None, False):
            model = AutoModelForCausalLM.from_pretrained(tiny["paths"]["llama"], **(
                {} if use_kernels is None else {"use_kernels": use_kernels}))
            liger.apply_liger_kernel_to_llama(model=model, **LAYERS_ONLY)
            assert len(liger_layers(model)["rms_norm"]) == 5
            model.train()
            assert len(liger_layers(model)["rms_norm"]) == (0 if use_kernels is None else 5)


@cpu
@pytest.mark.parametrize("kind,arch", [("sft", "llama"), ("sft", "qwen3"), ("dpo", "llama"), ("grpo", "qwen3")])
def test_use_liger_kernel_with_fusedkern_runs_fusedkerns_head(tiny, liger_cpu, monkeypatch, kind, arch):
    """TRL's `use_liger_kernel=True` on a trainer built while fusedkern is patched: Liger's layer kernels are in
    the policy after training, Liger's loss is off, fusedkern's head ran (counted) and is still the model's head, and
    every logged loss and metric and every update equals TRL's own head with the same Liger layers."""
    import fusedkern.integrations.trl as fk_trl

    config = dict(use_liger_kernel=True, max_steps=2 if kind == "sft" else 1)
    if kind == "grpo":
        config.update(temperature=0.7, beta=0.04)
    plain = train(build(kind, tiny, False, arch, **config), False)
    calls = count_calls(monkeypatch)
    trainer = build(kind, tiny, True, arch, **config)
    assert trainer.args.liger_kernel_config["fused_linear_cross_entropy"] is False
    fused = train(trainer, True)
    assert calls, "fusedkern's head never ran"
    assert fk_trl.has_fused_head(trainer.model)
    assert_liger_layers(trainer.model, arch)
    assert_same_run(plain, fused)


@cpu
def test_dpo_reference_runs_the_policys_liger_layers(tiny, liger_cpu):
    """`Trainer.train()` applies Liger's layer kernels to the policy only; a DPO trainer built while patched applies
    them to its reference model too when training starts, so at step 0 (lr 0: the same weights) both models give
    the same bits and the first loss is log 2 with zero rewards. PyTorch's RMSNorm and SwiGLU differ from Liger's in
    the last bits even in fp32 (3.6e-7 here), so the hidden-state comparison fails if the reference keeps PyTorch's
    layers; at this tiny shape the logged loss and rewards alone would not tell."""
    from fusedkern.study.liger_layers import liger_layers

    trainer = build("dpo", tiny, True, use_liger_kernel=True, max_steps=1, learning_rate=0.0)
    ref = trainer.ref_model
    assert not liger_layers(ref)["rms_norm"]  # built before training starts: PyTorch's layers still
    steps, _ = train(trainer, True)
    assert_liger_layers(trainer.model, "llama")
    assert_liger_layers(ref, "llama")
    assert steps[0]["rewards/chosen"] == steps[0]["rewards/rejected"] == 0.0
    assert steps[0]["loss"] == pytest.approx(math.log(2), rel=1e-7)
    ids = torch.randint(3, V, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        policy_hidden, ref_hidden = (m.base_model(ids).last_hidden_state for m in (trainer.model, ref))
    assert torch.equal(policy_hidden, ref_hidden)


@cpu
def test_layer_kernels_applied_by_hand_then_patched(tiny, liger_cpu, monkeypatch):
    """`apply_liger_kernel_to_llama(model=..., fused_linear_cross_entropy=False, cross_entropy=False)` before the
    trainer is built, then fusedkern's patch: an SFT run with fusedkern's head over Liger's layers equals TRL's own
    head over the same layers."""
    plain = train(build("sft", tiny, False, by_hand=True), False)
    calls = count_calls(monkeypatch)
    trainer = build("sft", tiny, True, by_hand=True)
    fused = train(trainer, True)
    assert calls
    assert_liger_layers(trainer.model, "llama")
    assert_same_run(plain, fused)


@cpu
def test_cpo_with_use_liger_kernel_keeps_fusedkerns_head(tiny, liger_cpu, monkeypatch):
    """CPOTrainer leaves Liger's default (its fused linear cross-entropy, which replaces the model's forward when
    training starts): built while patched, fusedkern switches it off, so the step runs fusedkern's loss over Liger's
    layers and the model keeps fusedkern's head. Asked for explicitly, it is refused at construction."""
    import fusedkern.integrations.trl as fk_trl

    trainer = build("cpo", tiny, True, use_liger_kernel=True, max_steps=1)
    assert trainer.args.liger_kernel_config == {"fused_linear_cross_entropy": False}
    calls = count_calls(monkeypatch)
    steps, _ = train(trainer, True)
    assert calls and all(math.isfinite(s["loss"]) for s in steps)
    assert fk_trl.has_fused_head(trainer.model)
    assert_liger_layers(trainer.model, "llama")
    with pytest.raises(ValueError, match="fused_linear_cross_entropy"):
        build("cpo", tiny, True, use_liger_kernel=True,
              liger_kernel_config={"fused_linear_cross_entropy": True})
    with pytest.raises(ValueError, match="fused_linear_cross_entropy"):  # TRL's own refusal, or fusedkern's first
        build("sft", tiny, True, use_liger_kernel=True, liger_kernel_config={"fused_linear_cross_entropy": True})


@cpu
def test_check_trainer_reports_a_liger_loss_that_would_replace_the_head(tiny, liger_cpu):
    """check_trainer raises where Liger's loss would replace the model's forward when training starts (the
    trainer's Liger options changed after it was built; Liger's default for Llama is its fused linear
    cross-entropy) and where it already has (applied to the trainer's model by hand)."""
    import liger_kernel.transformers as liger

    import fusedkern.integrations.trl as fk_trl

    trainer = build("sft", tiny, True, use_liger_kernel=True)
    fk_trl.check_trainer(trainer)
    for config in ({"fused_linear_cross_entropy": True}, {}, None):
        trainer.args.liger_kernel_config = config
        assert fk_trl.liger_loss_would_replace_forward(trainer)
        with pytest.raises(RuntimeError, match="Liger's fused linear cross-entropy"):
            fk_trl.check_trainer(trainer)
    trainer.args.liger_kernel_config = {"fused_linear_cross_entropy": False}
    trainer.args.use_liger_kernel = False
    liger.apply_liger_kernel_to_llama(model=trainer.model, rope=False, rms_norm=False, swiglu=False,
                                      fused_linear_cross_entropy=True)
    with pytest.raises(RuntimeError, match="forward is Liger's"):
        fk_trl.check_trainer(trainer)


@pytest.mark.gpu
def test_gpu_sft_step_with_liger_layers_and_fusedkern(tmp_path, monkeypatch):
    """One SFT step under bf16 autocast on a GPU, a small Qwen3 (tied head, vocab 4096), TRL's `use_liger_kernel`
    with fusedkern's head and with TRL's own: fusedkern's head ran, Liger's layers are in the model, and the losses
    and gradient norms are finite and agree within bf16 rounding. (GPU only: in Triton's interpreter Liger's SwiGLU
    and RoPE kernels give NaN on bf16 tensors, so the CPU tests run fp32.)"""
    import trl
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    import fusedkern.integrations.trl as fk_trl
    from fusedkern.study.liger_layers import liger_layers, liger_patches_undone

    vocab = 4096
    words = ["<pad>", "<s>", "</s>"] + [f"w{i}" for i in range(vocab - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", bos_token="<s>")
    g = torch.Generator().manual_seed(0)
    texts = [" ".join(f"w{int(i)}" for i in torch.randint(0, vocab - 3, (255,), generator=g)) for _ in range(8)]
    config = Qwen3Config(vocab_size=vocab, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(tmp_path / "model")
    runs = {}
    with liger_patches_undone():
        for fused in (False, True):
            calls = count_calls(monkeypatch) if fused else []
            model = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32, use_kernels=False)
            args = trl.SFTConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=1,
                                 learning_rate=1e-4, logging_steps=1, report_to=[], save_strategy="no", seed=0,
                                 disable_tqdm=True, bf16=True, use_liger_kernel=True, max_length=256)
            with fk_trl.patched() if fused else contextlib.nullcontext():
                trainer = trl.SFTTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"text": texts}),
                                         processing_class=tokenizer)
            if fused:
                fk_trl.check_trainer(trainer)
            trainer.train()
            found = liger_layers(trainer.model)
            assert found["rms_norm"] and found["swiglu"] and found["rope"], found
            runs[fused] = [h for h in trainer.state.log_history if "loss" in h][0]
            # a random init scores about log V a token: a finite step near it, not a NaN logged as 0
            assert 0.5 * math.log(vocab) < runs[fused]["loss"] < 1.5 * math.log(vocab), runs[fused]
            assert math.isfinite(runs[fused]["grad_norm"]) and math.isfinite(runs[fused]["entropy"]), runs[fused]
            if fused:
                assert calls and fk_trl.has_fused_head(trainer.model)
    assert runs[True]["loss"] == pytest.approx(runs[False]["loss"], rel=2e-2)
    assert runs[True]["grad_norm"] == pytest.approx(runs[False]["grad_norm"], rel=5e-2)

