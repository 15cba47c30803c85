"""fusedkern.integrations.trl: TRL 1.16's trainers run a few SGD steps on a tiny random Llama (vocab 80,
hidden 32, 2 layers, fp32, CPU through Triton's interpreter) with TRL's own fused head and with fusedkern's,
side by side from the same weights and data: every logged loss and metric and every updated parameter agree
within fp32 tolerance; fusedkern's head actually ran (its calls counted) and allocated no tensor shaped like
the logits; what it cannot reproduce raises. The patch itself: a list of records that unpatch() undoes, trainers
built while patched that stay fused after it, TRL's version and hooks checked, uncovered trainers warned."""

from __future__ import annotations

import contextlib
import copy
import importlib
import importlib.util
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fusedkern.logprobs
from fusedkern._runtime import interpreting

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="needs TRL (pip install 'fusedkern[trl]')"),
    pytest.mark.skipif(not interpreting(), reason="CPU tensors need Triton's interpreter (on when no GPU is visible)"),
    pytest.mark.usefixtures("one_cpu_thread"),
]

V = 80  # no other dimension of the model or the batches is 80: a tensor with a last dim of 80 holds logits
METRIC_ATOL = 2e-5  # per-token log-probs of ~−20 agree to ~1e-6; TRL's metrics are differences of such sums


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

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
        "kto": Dataset.from_dict({"prompt": prompts, "completion": [" " + text(2 + i % 3) for i in range(n)],
                                  "label": [i % 2 == 0 for i in range(n)]}),
        "sft": Dataset.from_dict({"prompt": prompts, "completion": [" " + text(3 + i % 2) for i in range(n)]}),
        "prompt": Dataset.from_dict({"prompt": prompts}),
        "chat": Dataset.from_dict({"messages": [[{"role": "user", "content": p}, {"role": "assistant",
                                                                                 "content": text(3)}]
                                                for p in prompts]}),
    }
    config = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    path = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    # a teacher of another width (the heads share the vocabulary only), for the distillation trainer
    teacher_config = LlamaConfig(**{**config.to_dict(), "hidden_size": 48, "num_hidden_layers": 1})
    torch.manual_seed(1)
    teacher_path = tmp_path_factory.mktemp("tiny_teacher")
    LlamaForCausalLM(teacher_config).save_pretrained(teacher_path)
    return dict(tokenizer=tokenizer, data=data, path=str(path), teacher=str(teacher_path),
                out=str(tmp_path_factory.mktemp("trl_out")))


@pytest.fixture(scope="module")
def tiny_softcapped(tiny, tmp_path_factory):
    """`tiny` with a Gemma-2 model in place of the Llama (same vocabulary and tokenizer): a final logit softcap
    small enough (0.3) that the mean of the softcapped logits is far from the softcap of the mean."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                          pad_token_id=0, bos_token_id=1, eos_token_id=2, final_logit_softcapping=0.3)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_gemma2")
    Gemma2ForCausalLM(config).save_pretrained(path)
    return {**tiny, "path": str(path)}


def reward_len(completions, **kwargs):
    """A reward with spread within each group (GRPO's advantages are zero without it)."""
    return [float(len(c)) / 8.0 + (0.5 if "w1" in c else 0.0) for c in completions]


def build(kind, tiny, fused, **config):
    """(trainer class, trainer) for `kind`, TRL's head or fusedkern's, from the saved tiny model."""
    import trl
    from transformers import AutoModelForCausalLM

    import fusedkern.integrations.trl as fk_trl

    common = dict(output_dir=tiny["out"], per_device_train_batch_size=2, max_steps=2, learning_rate=0.5,
                  optim="sgd", lr_scheduler_type="constant", logging_steps=1, report_to=[], use_cpu=True,
                  save_strategy="no", seed=0, disable_tqdm=True, bf16=False)
    common.update(config)
    peft_config = common.pop("peft_config", None)
    model = AutoModelForCausalLM.from_pretrained(tiny["path"])
    kw = dict(model=model, processing_class=tiny["tokenizer"], peft_config=peft_config)
    if kind == "dpo":
        cls, args, data = trl.DPOTrainer, trl.DPOConfig(**common), tiny["data"]["pref"]
        if peft_config is None:
            kw["ref_model"] = AutoModelForCausalLM.from_pretrained(tiny["path"])
    elif kind == "kto":
        cls, args, data = trl.KTOTrainer, trl.KTOConfig(**common), tiny["data"]["kto"]
        kw["ref_model"] = AutoModelForCausalLM.from_pretrained(tiny["path"])
    elif kind in ("cpo", "orpo"):
        module = importlib.import_module(f"trl.experimental.{kind}")
        prefix = kind.upper()
        cls, args = getattr(module, f"{prefix}Trainer"), getattr(module, f"{prefix}Config")(**common)
        data = tiny["data"]["pref"]
    elif kind == "distill":
        common.setdefault("max_completion_length", 4)
        cls, args, data = trl.DistillationTrainer, trl.DistillationConfig(**common), tiny["data"]["sft"]
        kw.update(model=tiny["path"], teacher_model=tiny["teacher"])
    elif kind == "gkd":
        from trl.experimental.gkd import GKDConfig, GKDTrainer

        common.setdefault("lmbda", 0.0)  # off-policy: the dataset's completions
        cls, args, data = GKDTrainer, GKDConfig(max_length=32, **common), tiny["data"]["chat"]
        tokenizer = copy.deepcopy(tiny["tokenizer"])
        tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
        kw.update(model=tiny["path"], teacher_model=tiny["teacher"], processing_class=tokenizer)
    elif kind == "sft":
        cls, args, data = trl.SFTTrainer, trl.SFTConfig(**common), tiny["data"]["sft"]
    elif kind == "reward":  # a trainer the patch does not cover (a sequence-classification model)
        cls, args, data = trl.RewardTrainer, trl.RewardConfig(**common), tiny["data"]["pref"]
        kw["model"] = tiny["path"]
    elif kind in ("grpo", "rloo"):
        common.setdefault("num_generations", 2)
        common.setdefault("max_completion_length", 4)
        cls = trl.GRPOTrainer if kind == "grpo" else trl.RLOOTrainer
        args = (trl.GRPOConfig if kind == "grpo" else trl.RLOOConfig)(**common)
        data = tiny["data"]["prompt"]
        kw["model"] = tiny["path"]
        kw["reward_funcs"] = reward_len
    else:
        raise AssertionError(kind)
    kw = {k: v for k, v in kw.items() if v is not None or k != "peft_config"}
    with fk_trl.patched() if fused else contextlib.nullcontext():
        trainer = cls(train_dataset=data, args=args, **kw)
    return trainer


def count_calls(monkeypatch):
    import fusedkern.integrations.trl as fk_trl

    calls = []
    for name in ("linear_logprobs_with_stats", "linear_logprobs_anticipated"):  # (SFT's anticipated head: the second)
        real = getattr(fk_trl, name)
        monkeypatch.setattr(fk_trl, name, lambda *a, _real=real, **k: calls.append(1) or _real(*a, **k))
    return calls


def train(trainer, fused):
    import fusedkern.integrations.trl as fk_trl

    if fused:
        with fk_trl.patched():  # the guard against TRL's own head is on while training
            fk_trl.check_trainer(trainer)
            trainer.train()
    else:
        trainer.train()
    steps = [h for h in trainer.state.log_history if "loss" in h]
    return steps, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def assert_same_run(plain, fused, keys_at_least=()):
    (logs_p, params_p), (logs_f, params_f) = plain, fused
    assert len(logs_p) == len(logs_f) >= 1
    for a, b in zip(logs_p, logs_f):
        assert set(a) == set(b)  # the same metric names
        for key in keys_at_least:
            assert key in a, f"TRL did not log {key}"
        for key, value in a.items():
            if key in ("step_time", "train_runtime") or not isinstance(value, float):
                continue
            if key.endswith("accuracies") and abs(a.get("rewards/margins", 1.0)) < 1e-4:
                continue  # chosen > rejected between two rewards equal up to rounding (policy = reference): a coin
            assert math.isfinite(b[key])
            assert b[key] == pytest.approx(value, rel=1e-4, abs=METRIC_ATOL), key
    moved = 0
    for name, p in params_p.items():
        torch.testing.assert_close(params_f[name], p, rtol=1e-4, atol=2e-5, msg=name)
        moved += 1
    assert moved > 0


def run_pair(kind, tiny, monkeypatch, **config):
    plain = train(build(kind, tiny, False, **config), False)
    calls = count_calls(monkeypatch)
    fused = train(build(kind, tiny, True, **config), True)
    assert calls, "fusedkern's head never ran"
    return plain, fused, calls


@pytest.mark.parametrize("loss_type", [["sigmoid"], ["ipo", "hinge", "robust"]])
def test_dpo_matches_trl(tiny, monkeypatch, loss_type):
    weights = None if len(loss_type) == 1 else [0.5, 0.3, 0.2]
    plain, fused, calls = run_pair("dpo", tiny, monkeypatch, loss_type=loss_type, loss_weights=weights,
                                   label_smoothing=0.1 if "robust" in loss_type else 0.0)
    assert_same_run(plain, fused, ("rewards/chosen", "rewards/margins", "logps/chosen", "logps/rejected",
                                   "logits/chosen", "entropy", "mean_token_accuracy"))
    assert len(calls) == 2 * 2  # policy and reference, per step
    assert plain[0][-1]["loss"] != plain[0][0]["loss"]


def test_dpo_precomputed_reference_and_grad_accumulation(tiny, monkeypatch):
    """TRL 1.16's DPOConfig has no reference_free flag; precompute_ref_log_probs runs the reference through the
    head once, under no_grad, before training."""
    plain, fused, calls = run_pair("dpo", tiny, monkeypatch, precompute_ref_log_probs=True,
                                   gradient_accumulation_steps=2, per_device_train_batch_size=1, max_steps=1,
                                   ld_alpha=0.5, f_divergence_type="js_divergence")
    assert_same_run(plain, fused, ("rewards/margins",))
    assert len(calls) > 2  # the precomputation pass, then the policy's two micro-batches


def test_dpo_bf16_autocast_within_bf16_tolerance(tiny, monkeypatch):
    """TRL's default bf16=True: on CPU the step runs under bf16 autocast, and fusedkern's head runs inside it
    (the operands cast as nn.Linear would) — a step equal to TRL's own within bf16 rounding."""
    plain = train(build("dpo", tiny, False, bf16=True, max_steps=1), False)
    fused = train(build("dpo", tiny, True, bf16=True, max_steps=1), True)
    for key in ("loss", "logps/chosen", "logps/rejected", "entropy"):
        assert fused[0][0][key] == pytest.approx(plain[0][0][key], rel=2e-2, abs=1e-3), key
    for name, p in plain[1].items():
        torch.testing.assert_close(fused[1][name], p, rtol=2e-2, atol=2e-3, msg=name)


def test_dpo_peft_lora_reference_through_disabled_adapter(tiny, monkeypatch):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    plain, fused, calls = run_pair("dpo", tiny, monkeypatch, peft_config=lora, max_steps=1)
    assert_same_run(plain, fused, ("rewards/chosen",))
    assert len(calls) == 2  # the reference is the same model with its adapter off, through fusedkern too
    assert any("lora" in n for n in fused[1])


@pytest.mark.parametrize("loss_type", ["nll", "dft"])
def test_sft_matches_trl_completion_only(tiny, monkeypatch, loss_type):
    plain, fused, _ = run_pair("sft", tiny, monkeypatch, gradient_accumulation_steps=2,  # num_items_in_batch
                               loss_type=loss_type, max_steps=2 if loss_type == "nll" else 1)
    assert_same_run(plain, fused, ("entropy", "mean_token_accuracy", "num_tokens"))


def test_sft_packing_padding_free(tiny, monkeypatch):
    plain, fused, _ = run_pair("sft", tiny, monkeypatch, packing=True, max_length=16, max_steps=1)
    assert_same_run(plain, fused, ("mean_token_accuracy",))


@pytest.mark.parametrize("options", [
    dict(loss_type="dapo", delta=1.5),  # two-sided clipping; the bias-corrected KL (TRL's default)
    dict(loss_type="grpo", use_bias_correction_kl=False, entropy_coef=0.05),  # an entropy bonus: entropy's gradient
    dict(loss_type="cispo"),
    dict(loss_type="sapo"),
    dict(loss_type="luspo", importance_sampling_level="sequence"),
    dict(loss_type="bnpo"),
    dict(loss_type="dr_grpo"),
    dict(loss_type="vespo"),
])
def test_grpo_matches_trl(tiny, monkeypatch, options):
    plain, fused, _ = run_pair("grpo", tiny, monkeypatch, temperature=0.7, max_steps=1, beta=0.04, **options)
    assert_same_run(plain, fused, ("kl", "entropy"))


def test_kto_matches_trl(tiny, monkeypatch):
    plain, fused, _ = run_pair("kto", tiny, monkeypatch, max_steps=1, per_device_train_batch_size=4)
    assert_same_run(plain, fused, ("logps/chosen",))


@pytest.mark.parametrize("kind", ["dpo", "kto"])
def test_dpo_and_kto_on_a_softcapped_model_match_trl(tiny_softcapped, monkeypatch, kind):
    """Gemma-2's final logit softcap: the trainers' logits/* metrics read TRL's mean_logits, the mean over the
    vocabulary of the softcapped logits, which fusedkern's head takes from the log-probs' own pass (a row sum beside
    the log-sum-exp): every metric and parameter as TRL's own head gives them."""
    config = dict(max_steps=2) if kind == "dpo" else dict(max_steps=1, per_device_train_batch_size=4)
    plain, fused, calls = run_pair(kind, tiny_softcapped, monkeypatch, **config)
    assert_same_run(plain, fused, ("logits/chosen", "logits/rejected", "logps/chosen", "rewards/chosen"))
    assert all(abs(log["logits/chosen"]) > 1e-3 for log in fused[0])  # a mean the test can tell apart
    # policy and reference per step (KTO: both again for the KL estimate on mismatched pairs)
    assert len(calls) == (2 if kind == "dpo" else 4) * len(fused[0])


def test_rloo_matches_trl(tiny, monkeypatch):
    plain, fused, _ = run_pair("rloo", tiny, monkeypatch, max_steps=1, beta=0.04)
    assert_same_run(plain, fused, ("entropy",))


@pytest.mark.parametrize("loss_type", ["sigmoid", "simpo", "ipo", "hinge"])
def test_cpo_matches_trl(tiny, monkeypatch, loss_type):
    """TRL's cpo_alpha is the weight of the chosen NLL (fusedkern.linear_preference_loss calls it alpha)."""
    plain, fused, calls = run_pair("cpo", tiny, monkeypatch, loss_type=loss_type, cpo_alpha=0.5, max_steps=1)
    assert_same_run(plain, fused, ("rewards/chosen", "logps/chosen", "logits/chosen", "nll_loss"))
    assert len(calls) == 1


def test_orpo_matches_trl(tiny, monkeypatch):
    plain, fused, calls = run_pair("orpo", tiny, monkeypatch, max_steps=2)
    assert_same_run(plain, fused, ("log_odds_ratio", "nll_loss", "logits/chosen"))
    assert len(calls) == 2


@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_distillation_trainer_matches_trl(tiny, monkeypatch, beta):
    """DistillationTrainer (on-policy generation, then the divergence over student and teacher heads) with
    fusedkern.linear_distillation_loss in place of TRL's chunked divergence: forward KL and the generalized JSD."""
    import fusedkern.integrations.trl as fk_trl

    plain = train(build("distill", tiny, False, beta=beta, temperature=0.8), False)
    calls = []
    real = fk_trl.linear_distillation_loss
    monkeypatch.setattr(fk_trl, "linear_distillation_loss", lambda *a, **k: calls.append(1) or real(*a, **k))
    fused = train(build("distill", tiny, True, beta=beta, temperature=0.8), True)
    assert len(calls) == 2  # one micro-batch a step
    assert_same_run(plain, fused, ("entropy",))


def test_gkd_matches_trl(tiny, monkeypatch):
    """GKDTrainer (trl.experimental): its compute_loss materializes both models' logits; patched, the teacher's
    backbone runs under the accelerator's autocast and the divergence inside the student's forward."""
    import fusedkern.integrations.trl as fk_trl

    plain = train(build("gkd", tiny, False, beta=0.5), False)
    calls = []
    real = fk_trl.linear_distillation_loss
    monkeypatch.setattr(fk_trl, "linear_distillation_loss", lambda *a, **k: calls.append(1) or real(*a, **k))
    fused = train(build("gkd", tiny, True, beta=0.5), True)
    assert len(calls) == 2
    assert_same_run(plain, fused)


class LogitsWatch(TorchDispatchMode):
    """Records every tensor an op returns whose last dimension is the vocabulary."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.ndim >= 2 and t.shape[-1] == V:
                self.shapes.append(tuple(t.shape))
        return out


@pytest.mark.parametrize("kind", ["dpo", "sft"])
def test_no_logits_tensor_in_a_training_step(tiny, kind):
    """Every [rows, V] tensor of fusedkern's training step has fewer rows than the batch has label positions
    (only valid targets, chunked); TRL's own head on CPU holds [all positions, V] — the check can fail."""
    import fusedkern.integrations.trl as fk_trl

    rows = []
    for fused in (False, True):
        trainer = build(kind, tiny, fused, max_steps=1)
        decoder = trainer.model.model
        positions = []
        hook = decoder.register_forward_pre_hook(
            lambda m, a, k: positions.append(k["input_ids"].shape[0] * (k["input_ids"].shape[1] - 1)),
            with_kwargs=True)
        watch = LogitsWatch()
        with fk_trl.patched() if fused else contextlib.nullcontext(), watch:
            trainer.train()
        hook.remove()
        assert positions
        rows.append(max((math.prod(s[:-1]) for s in watch.shapes), default=0) >= min(positions))
    assert rows == [True, False]


def test_patch_replaces_every_reference_and_unpatch_restores():
    import transformers
    import trl.trainer.dpo_trainer as dpo_module
    import trl.trainer.utils as utils

    import fusedkern.integrations.trl as fk_trl

    import trl.trainer.distillation_trainer as distill_module
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.gkd import GKDTrainer

    original = utils.add_fused_lm_head
    originals = (distill_module._chunked_divergence_loss, GKDTrainer.compute_loss, CPOTrainer.concatenated_forward,
                 CPOTrainer.__init__, GKDTrainer.__init__, distill_module.DistillationTrainer.__init__,
                 transformers.Trainer.__init__)
    fk_trl.patch()
    try:
        assert fk_trl.is_patched()
        assert dpo_module.add_fused_lm_head is utils.add_fused_lm_head is not original
        assert utils._ChunkedLogProbFunction is fk_trl.TRLHeadGuard
        assert GKDTrainer.compute_loss is fk_trl.fused_gkd_compute_loss
        assert CPOTrainer.concatenated_forward is fk_trl.fused_concatenated_forward
        assert distill_module._chunked_divergence_loss is not originals[0]
        assert transformers.Trainer.__init__ is not originals[-1]
        # every change is one record of the list that unpatch() undoes
        targets = {(p.target, p.name) for p in fk_trl._applied.patches}
        assert {(utils, "add_fused_lm_head"), (dpo_module, "add_fused_lm_head"), (CPOTrainer, "__init__"),
                (transformers.Trainer, "__init__"), (distill_module, "_chunked_divergence_loss")} <= targets
        assert all(getattr(p.target, p.name) is p.replacement for p in fk_trl._applied.patches)
        fk_trl.patch(chunk_tokens=64)  # again, other options: still one layer over TRL's
        assert fk_trl.is_patched() and fk_trl._applied.options["chunk_tokens"] == 64
    finally:
        fk_trl.unpatch()
    assert dpo_module.add_fused_lm_head is original and utils.add_fused_lm_head is original
    assert utils._ChunkedLogProbFunction is not fk_trl.TRLHeadGuard and not fk_trl.is_patched()
    assert (distill_module._chunked_divergence_loss, GKDTrainer.compute_loss, CPOTrainer.concatenated_forward,
            CPOTrainer.__init__, GKDTrainer.__init__, distill_module.DistillationTrainer.__init__,
            transformers.Trainer.__init__) == originals
    fk_trl.unpatch()  # a second unpatch does nothing


def test_patch_twice_is_idempotent_and_patched_restores_the_enclosing_state(monkeypatch):
    import sys
    import types

    import trl.trainer.utils as utils

    import fusedkern.integrations.trl as fk_trl

    original = utils.add_fused_lm_head
    with fk_trl.patched():
        applied = fk_trl._applied
        fk_trl.patch()  # the same options: nothing re-applied
        assert fk_trl._applied is applied
        head = utils.add_fused_lm_head
        with fk_trl.patched():  # nested, same options
            assert utils.add_fused_lm_head is head
        assert fk_trl._applied is applied and utils.add_fused_lm_head is head
        with fk_trl.patched(chunk_tokens=64):  # nested, other options: the enclosing ones come back on exit
            assert fk_trl._applied.options["chunk_tokens"] == 64
        assert fk_trl.is_patched() and fk_trl._applied.options == applied.options
        # a TRL module imported while patched copies fusedkern's head: unpatch() gives it TRL's back
        copied = types.ModuleType("trl._fusedkern_test_copy")
        copied.add_fused_lm_head = utils.add_fused_lm_head
        monkeypatch.setitem(sys.modules, copied.__name__, copied)
    assert not fk_trl.is_patched()
    assert utils.add_fused_lm_head is original and copied.add_fused_lm_head is original


def test_patch_records_apply_and_undo():
    import types

    from fusedkern.integrations.trl import MISSING, Patch, apply_patches, undo_patches

    class Base:
        def f(self):
            return "base"

    class Child(Base):
        pass

    module = types.ModuleType("m")
    module.g = "g"
    patches = [Patch.on(module, "g", "G"), Patch.on(Child, "f", lambda self: "patched")]
    assert patches[1].original is MISSING  # inherited: undoing deletes Child's own attribute
    apply_patches(patches)
    assert module.g == "G" and Child().f() == "patched"
    undo_patches(patches)
    assert module.g == "g" and Child().f() == "base" and "f" not in vars(Child)
    # a failing patch undoes the ones applied before it
    with pytest.raises(AttributeError):
        apply_patches([Patch.on(module, "g", "G"), Patch(object(), "x", 1)])
    assert module.g == "g"
    # an attribute that other code replaced after the patch is left to that code
    apply_patches(patches[:1])
    module.g = "other"
    with pytest.warns(UserWarning, match="replaced by other code"):
        undo_patches(patches[:1])
    assert module.g == "other"


def test_trl_head_installed_before_patch_raises_when_run(tiny):
    """A trainer built before patch() carries TRL's head: check_trainer says so, and running it while the patch
    is on raises instead of silently training without fusedkern."""
    import fusedkern.integrations.trl as fk_trl

    trainer = build("sft", tiny, False, max_steps=1)
    with pytest.raises(RuntimeError, match="does not carry fusedkern"):
        fk_trl.check_trainer(trainer)
    with fk_trl.patched(), pytest.raises(RuntimeError, match="TRL's own fused LM head ran"):
        trainer.train()


def spy(monkeypatch, *names):
    """Count the calls of fusedkern functions that fusedkern.integrations.trl looks up at each use."""
    import fusedkern.integrations.trl as fk_trl

    calls = []
    for name in names:
        real = getattr(fk_trl, name)
        monkeypatch.setattr(fk_trl, name, lambda *a, _real=real, **k: calls.append(1) or _real(*a, **k))
    return calls


@pytest.mark.parametrize("kind", ["cpo", "orpo", "gkd", "distill", "sft", "dpo", "kto", "grpo", "rloo"])
def test_trainer_built_while_patched_stays_fused_after_the_block(tiny, monkeypatch, kind):
    """A trainer built inside `patched()` and trained after the block still trains with fusedkern: its model keeps
    fusedkern's head, and CPO's, ORPO's and GKD's losses and DistillationTrainer's divergence were bound on the
    instance at construction; check_trainer says so before training. A covered trainer built while patched does
    not warn."""
    import warnings

    import fusedkern.integrations.trl as fk_trl

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = build(kind, tiny, True, max_steps=1, **({"per_device_train_batch_size": 4} if kind == "kto" else {}))
    assert not any("does not cover" in str(w.message) for w in caught)
    assert not fk_trl.is_patched()
    fk_trl.check_trainer(trainer)
    calls = spy(monkeypatch, "linear_logprobs_with_stats", "linear_logprobs_anticipated", "linear_distillation_loss")
    trainer.train()
    assert calls, "fusedkern did not run"
    assert all(math.isfinite(h["loss"]) for h in trainer.state.log_history if "loss" in h)


def test_check_trainer_refuses_a_trainer_whose_loss_is_trls(tiny):
    """A trainer that computes the logits itself and whose loss function is TRL's own would train without
    fusedkern: check_trainer raises — a CPO trainer whose bound loss is gone, a DistillationTrainer built before
    patch() once unpatched (while patched, its divergence is fusedkern's), a GKD trainer built before patch()."""
    import fusedkern.integrations.trl as fk_trl

    cpo = build("cpo", tiny, True, max_steps=1)
    del cpo.concatenated_forward  # the instance's binding gone: TRL's class method
    with pytest.raises(RuntimeError, match="concatenated_forward is TRL's own"):
        fk_trl.check_trainer(cpo)
    distill = build("distill", tiny, False, max_steps=1)
    with pytest.raises(RuntimeError, match="_compute_loss is TRL's own"):
        fk_trl.check_trainer(distill)
    with fk_trl.patched():
        fk_trl.check_trainer(distill)
    gkd = build("gkd", tiny, False, max_steps=1)
    with pytest.raises(RuntimeError, match="compute_loss is TRL's own"):
        fk_trl.check_trainer(gkd)
    with fk_trl.patched(), pytest.raises(RuntimeError, match="does not carry fusedkern"):
        fk_trl.check_trainer(gkd)


def test_uncovered_trainer_built_while_patched_warns(tiny):
    """RewardTrainer is not covered: built while patched it warns (and check_trainer says its model has no
    fusedkern head); built after unpatch(), it does not warn."""
    import warnings

    import fusedkern.integrations.trl as fk_trl

    with pytest.warns(UserWarning, match="does not cover RewardTrainer"):
        trainer = build("reward", tiny, True, max_steps=1)
    with pytest.raises(RuntimeError, match="RewardTrainer is not among the trainers it covers"):
        fk_trl.check_trainer(trainer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build("reward", tiny, False, max_steps=1)
    assert not any("does not cover" in str(w.message) for w in caught)


def test_patch_logs_the_covered_trainers_once(caplog):
    import logging

    import fusedkern.integrations.trl as fk_trl

    with caplog.at_level(logging.INFO, logger="fusedkern.integrations.trl"):
        with fk_trl.patched():
            fk_trl.patch()  # idempotent: no second line
    lines = [r.getMessage() for r in caplog.records if r.name == "fusedkern.integrations.trl"]
    assert len(lines) == 1 and "patched" in lines[0]
    for name in fk_trl.COVERED_TRAINERS:
        assert name in lines[0]


def test_patch_checks_trls_version_and_hooks(monkeypatch):
    """Outside the tested minor release: a warning naming the hooks the patch replaces and the tested version,
    and the trainers whose hook is missing not covered; a required hook missing: RuntimeError, nothing patched."""
    import warnings

    import transformers
    import trl
    import trl.trainer.distillation_trainer as distill_module
    import trl.trainer.utils as utils

    import fusedkern.integrations.trl as fk_trl

    with warnings.catch_warnings():  # a patch release of the tested minor: no warning
        warnings.simplefilter("error", UserWarning)
        monkeypatch.setattr(trl, "__version__", "1.16.7")
        with fk_trl.patched():
            pass
    monkeypatch.setattr(trl, "__version__", "1.17.0")
    monkeypatch.delattr(distill_module, "_chunked_divergence_loss")
    with pytest.warns(UserWarning, match=r"tested with TRL 1\.16\.0.*TRL 1\.17\.0 is installed.*"
                                         r"trl\.trainer\.utils\.add_fused_lm_head.*lacks "
                                         r"trl\.trainer\.distillation_trainer\._chunked_divergence_loss"):
        with fk_trl.patched():
            assert "DistillationTrainer" not in fk_trl._applied.covered
            assert "CPOTrainer" in fk_trl._applied.covered
    monkeypatch.undo()
    init = transformers.Trainer.__init__
    monkeypatch.delattr(utils, "add_fused_lm_head")
    with pytest.raises(RuntimeError, match=r"no trl\.trainer\.utils\.add_fused_lm_head .*tested with TRL 1\.16\.0"):
        fk_trl.patch()
    assert not fk_trl.is_patched() and transformers.Trainer.__init__ is init


def test_refusals(tiny):
    import fusedkern.integrations.trl as fk_trl
    from transformers import AutoModelForCausalLM

    with pytest.raises(ValueError, match="use_weighting"):
        build("dpo", tiny, True, use_weighting=True)
    model = AutoModelForCausalLM.from_pretrained(tiny["path"])
    for bad in (dict(outputs=("logits",)), dict(temperature=0.0)):
        with pytest.raises(ValueError):
            fk_trl.add_fused_lm_head(copy.deepcopy(model), **bad)
    softcapped = copy.deepcopy(model)
    softcapped.config.final_logit_softcapping = 30.0
    fk_trl.add_fused_lm_head(copy.deepcopy(softcapped), outputs=("log_probs", "mean_logits"))  # DPO's, KTO's
    softcapped.config.logit_scale = 0.5
    with pytest.raises(ValueError, match="logit scale"):
        fk_trl.add_fused_lm_head(softcapped)
    # TRL itself refuses a PEFT adapter on lm_head; a head that is not a plain nn.Linear reaching the head anyway
    # (a subclass with its own forward) raises rather than being read through its weight
    wrapped = copy.deepcopy(model)
    wrapped.lm_head = type("ScaledHead", (torch.nn.Linear,), {})(32, V, bias=False)
    fk_trl.add_fused_lm_head(wrapped)
    with pytest.raises(TypeError, match="plain nn.Linear"):
        wrapped(input_ids=torch.tensor([[3, 4, 5]]), labels=torch.tensor([[3, 4, 5]]), fused_lm_head=True)


def test_head_finds_the_scored_positions_before_the_backbone_runs(tiny, monkeypatch):
    """The scored positions are found (a host sync on a GPU) before the backbone's forward is queued, so the sync
    does not leave the GPU idle between the backbone's last kernel and the head's first; the outputs are the ones
    of the head that found them after."""
    import fusedkern.integrations.trl as fk_trl
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny["path"])
    fk_trl.add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    order = []
    model.model.register_forward_pre_hook(lambda module, args: order.append("backbone"))
    nonzero = torch.Tensor.nonzero
    monkeypatch.setattr(torch.Tensor, "nonzero", lambda self, *a, **k: order.append("nonzero") or nonzero(self, *a,
                                                                                                      **k))
    ids = torch.tensor([[3, 4, 5, 6, 7], [8, 9, 10, 11, 12]])
    labels = torch.tensor([[-100, -100, 5, 6, 7], [-100, 9, 10, -100, 12]])
    out = model(input_ids=ids, labels=labels, fused_lm_head=True)
    assert order == ["nonzero", "backbone"]
    logits = AutoModelForCausalLM.from_pretrained(tiny["path"])(input_ids=ids).logits[:, :-1].double()
    expected = torch.log_softmax(logits, -1).gather(-1, labels[:, 1:].clamp(min=0)[..., None])[..., 0]
    mask = labels[:, 1:] != -100
    torch.testing.assert_close(out.log_probs.double(), torch.where(mask, expected, 0.0), atol=2e-5, rtol=0)
    assert torch.equal(out.label_mask, mask)


def test_head_softcap_scale_temperature_and_empty_rows(tiny):
    """fusedkern's head against TRL's on one model: Gemma-2's softcap, Granite's logits_scaling, a temperature,
    and a batch whose labels are all ignored (a differentiable zero)."""
    import trl.trainer.utils as utils
    from transformers import AutoModelForCausalLM

    import fusedkern.integrations.trl as fk_trl

    base = AutoModelForCausalLM.from_pretrained(tiny["path"])
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, V, (3, 9), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100
    for extra, outputs in ((dict(final_logit_softcapping=0.05), ("log_probs", "entropy", "mean_logits", "is_top1")),
                           (dict(logits_scaling=0.25), ("log_probs", "entropy", "mean_logits", "is_top1"))):
        theirs, ours = copy.deepcopy(base), copy.deepcopy(base)
        for m in (theirs, ours):
            for k, v in extra.items():
                setattr(m.config, k, v)
        utils.add_fused_lm_head(theirs, temperature=0.6, outputs=outputs)
        fk_trl.add_fused_lm_head(ours, temperature=0.6, outputs=outputs)
        a = theirs(input_ids=ids, labels=labels, fused_lm_head=True)
        b = ours(input_ids=ids, labels=labels, fused_lm_head=True)
        for field in outputs + ("loss",):
            torch.testing.assert_close(getattr(b, field), getattr(a, field), rtol=1e-5, atol=2e-6, msg=field)
        if "final_logit_softcapping" in extra:  # the mean of the softcapped logits, far from the raw logits' mean
            with torch.no_grad():
                hidden = ours.model(input_ids=ids).last_hidden_state[:, :-1]
                raw_mean = (hidden @ ours.lm_head.weight.T / 0.6).mean(-1)
            assert (b.mean_logits - raw_mean)[labels[:, 1:] != -100].abs().max() > 1e-3
        (a.loss + a.entropy.sum()).backward()
        (b.loss + b.entropy.sum()).backward()
        for (name, p), q in zip(theirs.named_parameters(), ours.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
    out = ours(input_ids=ids, labels=torch.full_like(labels, -100), fused_lm_head=True)
    assert out.loss.item() == 0.0 and out.log_probs.abs().sum().item() == 0.0
    out.loss.backward()  # connected to the model


def test_is_top1_against_argmax():
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(40, 16, generator=g), torch.randn(V, 16, generator=g)
    logits = x @ w.T / 0.9
    target = torch.randint(0, V, (40,), generator=g)
    target[:20] = logits[:20].argmax(-1)
    logps, _, row_max, row_lse = fusedkern.logprobs.linear_logprobs_with_stats(x, w, target, temperature=0.9)
    assert torch.equal(fusedkern.logprobs.is_top1(logps, row_max, row_lse), logits.argmax(-1) == target)
    torch.testing.assert_close(logps, torch.log_softmax(logits.double(), -1).gather(1, target[:, None])[:, 0].float(),
                               rtol=0, atol=2e-6)


def test_head_under_bf16_autocast_within_twice_trls_error(tiny):
    """Under bf16 autocast (how accelerate runs the wrapped forward with bf16=True) fusedkern's head casts its
    operands as TRL's head and nn.Linear do: its log-probs' error against fp64 is within 2× that of TRL's own
    bf16 head (the logits GEMM in bf16 for both)."""
    import trl.trainer.utils as utils
    from transformers import AutoModelForCausalLM

    import fusedkern.integrations.trl as fk_trl

    theirs = AutoModelForCausalLM.from_pretrained(tiny["path"])
    ours = copy.deepcopy(theirs)
    utils.add_fused_lm_head(theirs, outputs=("log_probs", "entropy"))
    fk_trl.add_fused_lm_head(ours, outputs=("log_probs", "entropy"))
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, V, (4, 16), generator=g)
    labels = ids.clone()
    labels[:, :5] = -100
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = theirs(input_ids=ids, labels=labels, fused_lm_head=True)
        b = ours(input_ids=ids, labels=labels, fused_lm_head=True)
        hidden = ours.model(input_ids=ids).last_hidden_state[:, :-1]
    mask = labels[:, 1:] != -100
    logits = hidden.double() @ ours.lm_head.weight.double().T
    ref = torch.log_softmax(logits, -1).gather(-1, labels[:, 1:].clamp(min=0)[..., None])[..., 0]
    err_trl = (a.log_probs.double() - ref)[mask].abs().max().item()
    err_fk = (b.log_probs.double() - ref)[mask].abs().max().item()
    assert 0 < err_trl < 0.1 and err_fk <= 2 * err_trl, (err_fk, err_trl)
