"""DPO with TRL's DPOTrainer on a random-init Llama over synthetic preference pairs, its per-token log-probs
(policy and reference) from fusedkern's fused head or TRL's own (alone, or with Liger-Kernel's layer kernels).

    python examples/train_dpo.py --device cpu --steps 2                       # tiny model, Triton interpreter
    python examples/train_dpo.py --device cuda --preset llama3-8b-2l --loss-impl trl --steps 11 \\
        --warmup-steps 3 --csv train_dpo.csv                                  # one row of the training table

--loss-impl picks who computes the log-probs; only that differs between runs (same seed, init and data):
  fusedkern  `fusedkern.integrations.trl.patch()` before the trainer is built (the default): TRL's
             `add_fused_lm_head` becomes fusedkern's, for the policy and the reference model
  trl        TRL 1.16's own chunked fused head (`trl.trainer.utils.add_fused_lm_head`, its default)
  liger      `DPOConfig(use_liger_kernel=True)` (pip install liger-kernel). In TRL 1.16 this applies only
             Liger's layer kernels (RoPE, RMSNorm, SwiGLU): TRL refuses Liger's fused linear cross-entropy in
             DPOTrainer, so the log-probs still come from TRL's own fused head. The row measures "TRL with Liger"
             as a TRL user gets it, not Liger's head.

The model is a LlamaForCausalLM with the preset's shapes (llama3-8b-2l: Llama-3-8B's head and 2 of its
decoder layers) and a word-level tokenizer built in memory (token i is the word "t{i}"), so nothing is
downloaded. Each pair is a prompt of --prompt-len tokens and two completions of --completion-len tokens:
a sequence of --seq-len tokens, half of its targets ignored (the prompt). Each optimizer step takes
--grad-accum micro-batches of --batch-size pairs (2 × batch-size rows: chosen and rejected). On CUDA the
step runs under TRL's default bf16 autocast on fp32 weights (AdamW); on CPU in fp32 with SGD. Prints TRL's
log of every step, then step time, tokens/s (prompt and completion tokens of both responses, per second)
and peak GPU memory; --csv appends one row.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
import tempfile
import time

import numpy as np
import torch

import fusedkern  # noqa: F401  (before TRL: picks the GPU or Triton's interpreter before any kernel is defined)
from transformers import TrainerCallback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # examples/presets.py, also when loaded by path
from presets import Preset, commit, version  # noqa: E402
from presets import append_csv as _append_csv  # noqa: E402

LOSS_IMPLS = ("fusedkern", "trl", "liger")


PRESETS = {
    "tiny": Preset(vocab=96, hidden=32, intermediate=64, layers=2, heads=4, kv_heads=2, seq_len=12, batch_size=2),
    # Llama-3-8B's head and layer shapes with 2 decoder layers, 2048 tokens a sequence (1024 prompt + 1024
    # completion), 1 pair (2 rows) a micro-batch; the reference model is a second copy (frozen, no grad)
    "llama3-8b-2l": Preset(vocab=128256, hidden=4096, intermediate=14336, layers=2, heads=32, kv_heads=8,
                           seq_len=2048, batch_size=1, rope_theta=500000.0),
}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help="tiny on CPU, llama3-8b-2l on CUDA")
    p.add_argument("--loss-impl", choices=LOSS_IMPLS, default="fusedkern")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup-steps", type=int, default=1, help="steps left out of the timing summary")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=None, help="pairs per micro-batch (overrides the preset)")
    p.add_argument("--seq-len", type=int, default=None, help="prompt + completion tokens (overrides the preset)")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--loss-type", default="sigmoid", help="DPOConfig.loss_type (comma-separated for a list)")
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=None, help="default 1e-5 (AdamW, CUDA) / 0.5 (SGD, CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--csv", default=None, help="append one summary row to this CSV file")
    args = p.parse_args(argv)
    if args.loss_impl == "liger" and importlib.util.find_spec("liger_kernel") is None:
        p.error("--loss-impl liger needs Liger-Kernel (pip install liger-kernel)")
    return args


def resolve_preset(args) -> Preset:
    preset = PRESETS[args.preset or ("tiny" if args.device == "cpu" else "llama3-8b-2l")]
    overrides = {k: v for k, v in (("batch_size", args.batch_size), ("seq_len", args.seq_len),
                                   ("layers", args.layers)) if v is not None}
    return dataclasses.replace(preset, **overrides)


def build_tokenizer(vocab: int):
    """A word-level tokenizer over the words t0 … t{vocab−4} and three special tokens, in memory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<s>": 1, "</s>": 2} | {f"t{i}": i + 3 for i in range(vocab - 3)}
    tok = Tokenizer(models.WordLevel(words, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", bos_token="<s>")


def synthetic_pairs(preset: Preset, n: int, seed: int):
    """n preference pairs of random words: prompt seq_len/2 tokens, completions seq_len/2 − 1 (+ EOS)."""
    from datasets import Dataset

    g = np.random.default_rng(seed)
    prompt_len = preset.seq_len // 2
    completion_len = preset.seq_len - prompt_len - 1

    def text(length):
        return " ".join(f"t{i}" for i in g.integers(0, preset.vocab - 3, length))

    rows = [(text(prompt_len), " " + text(completion_len), " " + text(completion_len)) for _ in range(n)]
    return Dataset.from_dict({k: [r[i] for r in rows] for i, k in enumerate(("prompt", "chosen", "rejected"))})


def build_model(preset: Preset, args, path: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=preset.vocab, hidden_size=preset.hidden, intermediate_size=preset.intermediate,
                         num_hidden_layers=preset.layers, num_attention_heads=preset.heads,
                         num_key_value_heads=preset.kv_heads, max_position_embeddings=max(preset.seq_len, 128),
                         rope_theta=preset.rope_theta, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2, attn_implementation="sdpa" if args.device == "cuda" else "eager")
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)  # the reference model is loaded from the same weights
    return model


class StepTimer(TrainerCallback):
    """Times each optimizer step, with the peak GPU memory since the step began."""

    def __init__(self, cuda: bool):
        self.cuda, self.records, self.start = cuda, [], None

    def on_step_begin(self, args, state, control, **kwargs):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self.cuda:
            torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / 2**20 if self.cuda else None
        self.records.append(dict(step=len(self.records), step_time_s=time.perf_counter() - self.start, peak_mib=peak))


def main(argv=None) -> list[dict]:
    """Train; returns one record per step: step, loss and TRL's metrics, step_time_s, tokens_per_s, peak_mib."""
    import trl

    args = parse_args(argv)
    preset = resolve_preset(args)
    cuda = args.device == "cuda"
    tokenizer = build_tokenizer(preset.vocab)
    n_pairs = args.steps * args.grad_accum * preset.batch_size
    data = synthetic_pairs(preset, n_pairs, args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(preset, args, tmp)
        ref_model = trl.trainer.utils.create_model_from_path(tmp, dtype="float32")
        config = trl.DPOConfig(
            output_dir=os.path.join(tmp, "out"), per_device_train_batch_size=preset.batch_size,
            gradient_accumulation_steps=args.grad_accum, max_steps=args.steps, logging_steps=1, report_to=[],
            save_strategy="no", seed=args.seed, disable_tqdm=True, use_cpu=not cuda, bf16=cuda,
            learning_rate=args.lr if args.lr is not None else (1e-5 if cuda else 0.5),
            optim="adamw_torch" if cuda else "sgd", lr_scheduler_type="constant", gradient_checkpointing=False,
            max_length=preset.seq_len + 8, loss_type=args.loss_type.split(","), beta=args.beta,
            use_liger_kernel=args.loss_impl == "liger")
        if args.loss_impl == "fusedkern":
            import fusedkern.integrations.trl as fk_trl
            fk_trl.patch()
        try:
            trainer = trl.DPOTrainer(model=model, ref_model=ref_model, args=config, train_dataset=data,
                                     processing_class=tokenizer)
            timer = StepTimer(cuda)
            trainer.add_callback(timer)
            print(f"DPO ({args.loss_type}) on {args.device}: LlamaForCausalLM "
                  f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, vocab {preset.vocab}, "
                  f"{preset.batch_size} pair(s) × {preset.seq_len} tokens a micro-batch, {args.grad_accum} a step, "
                  f"log-probs from {args.loss_impl}", flush=True)
            trainer.train()
        finally:
            if args.loss_impl == "fusedkern":
                fk_trl.unpatch()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    tokens = 2 * preset.seq_len * preset.batch_size * args.grad_accum
    records = [{**log, **t, "tokens_per_s": tokens / t["step_time_s"]} for log, t in zip(logs, timer.records)]
    print_table(records, args.warmup_steps)
    if args.csv is not None:
        row = summary_row(args, preset, records)
        append_csv(args.csv, row)
        print(f"appended to {args.csv}: " + ", ".join(f"{k}={row[k]}" for k in
                                                      ("loss_impl", "step_ms_p50", "tokens_per_s", "peak_mib")))
    return records


def print_table(records: list[dict], warmup_steps: int) -> None:
    print(f"{'step':>5} {'loss':>10} {'margin':>10} {'step ms':>10} {'tokens/s':>11} {'peak MiB':>10}")
    for r in records:
        peak = "-" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"
        print(f"{r['step']:>5} {r['loss']:>10.6f} {r.get('rewards/margins', float('nan')):>10.6f} "
              f"{r['step_time_s'] * 1e3:>10.1f} {r['tokens_per_s']:>11.0f} {peak:>10}")


CSV_COLUMNS = ("loss_impl", "preset", "layers", "seq_len", "batch_size", "grad_accum", "steps_timed", "step_ms_p20",
               "step_ms_p50", "step_ms_p80", "tokens_per_s", "peak_mib", "first_loss", "final_loss", "loss_type",
               "protocol", "workload", "device", "torch", "triton", "transformers", "trl", "liger_kernel", "commit",
               "autocast")


def summary_row(args, preset: Preset, records: list[dict]) -> dict:
    timed = records[args.warmup_steps:] or records
    times_ms = np.asarray([r["step_time_s"] * 1e3 for r in timed])
    p20, p50, p80 = (float(q) for q in np.quantile(times_ms, [0.2, 0.5, 0.8]))
    tokens = 2 * preset.seq_len * preset.batch_size * args.grad_accum
    peaks = [r["peak_mib"] for r in timed if r["peak_mib"] is not None]
    cuda = args.device == "cuda"
    return {
        "loss_impl": args.loss_impl, "preset": args.preset or ("tiny" if not cuda else "llama3-8b-2l"),
        "layers": preset.layers, "seq_len": preset.seq_len, "batch_size": preset.batch_size,
        "grad_accum": args.grad_accum, "steps_timed": len(timed), "step_ms_p20": f"{p20:.2f}",
        "step_ms_p50": f"{p50:.2f}", "step_ms_p80": f"{p80:.2f}", "tokens_per_s": f"{tokens / (p50 / 1e3):.1f}",
        "peak_mib": f"{max(peaks):.1f}" if peaks else "", "first_loss": f"{records[0]['loss']:.6f}",
        "final_loss": f"{records[-1]['loss']:.6f}", "loss_type": args.loss_type, "protocol": "sequential",
        "workload": "dpo_prompt_50", "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__, "triton": version("triton"), "transformers": version("transformers"),
        "trl": version("trl"), "liger_kernel": version("liger-kernel"), "commit": commit(),
        "autocast": "bf16, fp32 weights" if cuda else "none, fp32",
    }


def append_csv(path: str, row: dict) -> None:
    _append_csv(path, row, CSV_COLUMNS)


if __name__ == "__main__":
    main()
