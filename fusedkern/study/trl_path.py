"""The TRL path of the study: which of TRL's trainers `fusedkern.integrations.trl.patch()` reroutes (read from
the live patch, not from a list), and one small DPO run twice, with TRL's own fused LM head and with fusedkern's:
a tiny random Llama, word-level tokenizer, fixed seeds, SGD, a few steps on CPU."""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
import tempfile
import warnings

import torch

DPO_SHAPES = {"vocab": 80, "hidden": 32, "intermediate": 64, "layers": 2, "heads": 4, "kv_heads": 2}


def tiny_llama_and_data(directory: str, *, seed: int = 0, pairs: int = 8, shapes: dict | None = None):
    """A saved random Llama and its tokenizer (words w0…), and a preference dataset of random words."""
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    s = {**DPO_SHAPES, **(shapes or {})}
    V = s["vocab"]
    words = ["<pad>", "<s>", "</s>"] + [f"w{i}" for i in range(V - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", bos_token="<s>")
    g = torch.Generator().manual_seed(seed)

    def text(n):
        return " ".join(f"w{int(i)}" for i in torch.randint(0, V - 3, (n,), generator=g))

    prompts = [text(4 + i % 3) for i in range(pairs)]
    data = Dataset.from_dict({"prompt": prompts, "chosen": [" " + text(2 + i % 2) for i in range(pairs)],
                              "rejected": [" " + text(3) for i in range(pairs)]})
    config = LlamaConfig(vocab_size=V, hidden_size=s["hidden"], intermediate_size=s["intermediate"],
                         num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                         num_key_value_heads=s["kv_heads"], max_position_embeddings=64, pad_token_id=0,
                         bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return tokenizer, data


@contextlib.contextmanager
def _quiet():
    """TRL's and Transformers' warnings and progress output off: the study's render must not depend on them."""
    import transformers

    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    logging.getLogger("trl").setLevel(logging.ERROR)
    sink = io.StringIO()  # Trainer prints its logs and tqdm bars (datasets, weight loading) on stdout / stderr
    with warnings.catch_warnings(), contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        warnings.simplefilter("ignore")
        try:
            yield
        finally:
            transformers.logging.set_verbosity(level)


def dpo_side_by_side(*, steps: int = 3, seed: int = 0, loss_type: str = "sigmoid", learning_rate: float = 0.5):
    """DPO on the tiny model with TRL's head, then with fusedkern's, from the same weights and data.

    Returns (logs, max_param_diff): logs maps "trl" and "fusedkern" to their per-step log dicts (TRL's
    metric names; run times dropped); max_param_diff is the largest |Δ| between the two trained models."""
    import trl
    from transformers import AutoModelForCausalLM

    import fusedkern.integrations.trl as fk_trl

    logs, params = {}, {}
    with tempfile.TemporaryDirectory() as tmp, _quiet():
        tokenizer, data = tiny_llama_and_data(tmp + "/model", seed=seed)
        for impl in ("trl", "fusedkern"):
            fused = impl == "fusedkern"
            args = trl.DPOConfig(output_dir=tmp + "/out", per_device_train_batch_size=2, max_steps=steps,
                                 learning_rate=learning_rate, optim="sgd", lr_scheduler_type="constant",
                                 logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", seed=seed,
                                 disable_tqdm=True, bf16=False, loss_type=[loss_type])
            with fk_trl.patched() if fused else contextlib.nullcontext():
                trainer = trl.DPOTrainer(model=AutoModelForCausalLM.from_pretrained(tmp + "/model"),
                                         ref_model=AutoModelForCausalLM.from_pretrained(tmp + "/model"),
                                         args=args, train_dataset=data, processing_class=tokenizer)
                if fused:
                    fk_trl.check_trainer(trainer)  # fusedkern's head is on the model, TRL's guarded
                trainer.train()
            logs[impl] = [{k: v for k, v in h.items() if k not in ("step_time", "train_runtime")}
                          for h in trainer.state.log_history if "loss" in h]
            params[impl] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    diff = max((params["fusedkern"][n] - p).abs().max().item() for n, p in params["trl"].items())
    return logs, diff


def trainer_coverage() -> list[dict]:
    """One row per TRL trainer: what `patch()` replaces for it and whether, patched now, TRL's module or class
    really holds fusedkern's function there (checked on the live objects; `unpatch()` after)."""
    import fusedkern.integrations.trl as fk_trl

    rows = []
    distill = importlib.import_module("trl.trainer.distillation_trainer")
    divergence = vars(distill).get("_chunked_divergence_loss")  # TRL's own, before the patch
    with fk_trl.patched():
        for module_name in fk_trl.TRAINER_MODULES:
            module = importlib.import_module(module_name)
            names = [n for n, v in vars(module).items() if n.endswith("Trainer") and isinstance(v, type)
                     and v.__module__ == module_name]
            head = vars(module).get("add_fused_lm_head")
            rows.append({"trainer": ", ".join(sorted(names)), "module": module_name,
                         "replaced": "add_fused_lm_head (the per-token log-prob head)",
                         "fusedkern_now": bool(getattr(head, fk_trl.HEAD_MARK, False))})
        fn = vars(distill).get("_chunked_divergence_loss")
        rows.append({"trainer": "DistillationTrainer", "module": distill.__name__,
                     "replaced": "_chunked_divergence_loss → linear_distillation_loss",
                     "fusedkern_now": fn is not divergence and getattr(fn, "__wrapped__", None) is divergence})
        gkd = importlib.import_module("trl.experimental.gkd")
        rows.append({"trainer": "GKDTrainer", "module": gkd.GKDTrainer.__module__,
                     "replaced": "compute_loss → linear_distillation_loss",
                     "fusedkern_now": gkd.GKDTrainer.compute_loss is fk_trl.fused_gkd_compute_loss})
        for cls in fk_trl.experimental_trainer_classes():
            rows.append({"trainer": cls.__name__, "module": cls.__module__,
                         "replaced": "concatenated_forward (fusedkern's head on the model)",
                         "fusedkern_now": cls.concatenated_forward is fk_trl.fused_concatenated_forward})
    return rows
