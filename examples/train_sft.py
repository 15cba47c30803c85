"""A short supervised fine-tuning loop whose loss comes from fusedkern (or, with --no-fusedkern, from the
model's own logits), on a random-init causal LM or a local checkpoint, over synthetic prompt/response
pairs or a local text file.

    python examples/train_sft.py --device cpu --steps 2                 # tiny random Llama, Triton interpreter
    python examples/train_sft.py --device cuda --preset small --steps 50
    python examples/train_sft.py --device cuda --model /path/to/checkpoint --text-file corpus.txt
    python examples/train_sft.py --device cuda --preset llama3-head --no-fusedkern   # the baseline

A Hugging Face Llama is patched with `fusedkern.integrations.transformers.patch`, so that
`model(input_ids, labels=..., num_items_in_batch=...)` computes its loss without the [tokens, vocab]
logits; without Transformers (or with --arch torch) a small plain-torch LM calls
`fusedkern.linear_cross_entropy` itself. Each optimizer step accumulates --grad-accum micro-batches,
each loss the sum over its targets divided by the step's count of targets (`num_items_in_batch`, as
Transformers' Trainer passes it), so the step's gradient is that of the mean over all its targets.
On CUDA the forward runs under bf16 autocast (fp32 weights, fp32 dW accumulation in fusedkern).
Prints the loss of every step, then a table of step time, tokens/s and peak GPU memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import os
import sys
import time
import types
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

import fusedkern

IGNORE_INDEX = -100
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


@dataclasses.dataclass(frozen=True)
class Preset:
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    seq_len: int
    batch_size: int


PRESETS = {
    "tiny": Preset(vocab=64, hidden=32, intermediate=64, layers=2, heads=4, kv_heads=2, seq_len=16, batch_size=2),
    "small": Preset(vocab=32000, hidden=512, intermediate=1536, layers=4, heads=8, kv_heads=4, seq_len=1024,
                    batch_size=8),
    # Llama-3-8B's head and layer shapes with a few decoder layers: the LM head dominates the memory
    "llama3-head": Preset(vocab=128256, hidden=4096, intermediate=14336, layers=2, heads=32, kv_heads=8,
                          seq_len=4096, batch_size=1),
}


# ----------------------------------------------------------------------------------------------
# models


class PlainCausalLM(nn.Module):
    """A small causal LM in plain torch (embedding, causal-attention blocks, lm_head) with Transformers'
    loss convention: labels shifted left by one inside, `num_items_in_batch` → sum / count."""

    def __init__(self, preset: Preset, use_fusedkern: bool):
        super().__init__()
        self.use_fusedkern = use_fusedkern
        self.embed = nn.Embedding(preset.vocab, preset.hidden)
        layer = nn.TransformerEncoderLayer(preset.hidden, preset.heads, preset.intermediate, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, preset.layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(preset.hidden)
        self.lm_head = nn.Linear(preset.hidden, preset.vocab, bias=False)

    def forward(self, input_ids, labels, num_items_in_batch=None, attention_mask=None):
        # attention_mask is not needed: the batches are right-padded, so under the causal mask no real
        # token attends to padding, and the padding's own targets are ignored
        seq_len = input_ids.shape[1]
        causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=input_ids.device).triu(1)
        hidden = self.norm(self.blocks(self.embed(input_ids), mask=causal, is_causal=True))
        target = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]
        reduction = "mean" if num_items_in_batch is None else "sum"
        if self.use_fusedkern:
            loss = fusedkern.linear_cross_entropy(hidden, self.lm_head.weight, target, reduction=reduction,
                                                  ignore_index=IGNORE_INDEX)
        else:
            logits = self.lm_head(hidden).float()
            loss = F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction=reduction,
                                   ignore_index=IGNORE_INDEX)
        if num_items_in_batch is not None:
            loss = loss / num_items_in_batch
        return types.SimpleNamespace(loss=loss)


def build_model(args, preset: Preset) -> nn.Module:
    if args.arch == "torch":
        torch.manual_seed(args.seed)
        return PlainCausalLM(preset, args.fusedkern)
    import transformers
    if args.model is not None:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True,
                                                                  torch_dtype=torch.float32)
    else:
        config = transformers.LlamaConfig(
            vocab_size=preset.vocab, hidden_size=preset.hidden, intermediate_size=preset.intermediate,
            num_hidden_layers=preset.layers, num_attention_heads=preset.heads, num_key_value_heads=preset.kv_heads,
            max_position_embeddings=max(preset.seq_len, 128), tie_word_embeddings=False,
            attn_implementation="sdpa" if args.device == "cuda" else "eager")
        torch.manual_seed(args.seed)
        model = transformers.LlamaForCausalLM(config)
    if args.fusedkern:
        from fusedkern.integrations.transformers import patch
        patch(model)
    return model


# ----------------------------------------------------------------------------------------------
# data


def synthetic_sft(preset: Preset, vocab: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Endless (input_ids, attention_mask, labels) batches of prompt + response pairs, right-padded: the
    labels are IGNORE_INDEX on the prompt and the padding (about half the targets), as in SFT."""
    g = torch.Generator().manual_seed(seed)
    b, s = preset.batch_size, preset.seq_len
    while True:
        ids = torch.randint(0, vocab, (b, s), generator=g)
        lengths = torch.randint(max(2, s // 2), s + 1, (b,), generator=g)
        prompts = (lengths.float() * torch.empty(b).uniform_(0.2, 0.6, generator=g)).long().clamp(min=1)
        positions = torch.arange(s)
        mask = (positions < lengths[:, None]).long()
        labels = ids.masked_fill((positions < prompts[:, None]) | (mask == 0), IGNORE_INDEX)
        yield ids.masked_fill(mask == 0, 0), mask, labels


def text_windows(path: str, preset: Preset, tokenizer, seed: int):
    """Endless batches of random windows of a local text file (every target counted: language modelling);
    token ids from the checkpoint's tokenizer, or the file's bytes without one."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    tokens = torch.tensor(tokenizer(text)["input_ids"] if tokenizer is not None else list(text.encode("utf-8")))
    b, s = preset.batch_size, preset.seq_len
    if tokens.numel() <= s:
        raise ValueError(f"--text-file {path} has {tokens.numel()} tokens, fewer than --seq-len + 1 = {s + 1}")
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, tokens.numel() - s, (b,), generator=g)
        ids = torch.stack([tokens[i:i + s] for i in starts.tolist()])
        yield ids, torch.ones_like(ids), ids.clone()


# ----------------------------------------------------------------------------------------------
# the loop


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--grad-accum", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="model and batch shape of a random-init model (default: tiny on cpu, small on cuda)")
    p.add_argument("--seq-len", type=int, default=None, help="overrides the preset's sequence length")
    p.add_argument("--batch-size", type=int, default=None, help="overrides the preset's micro-batch size")
    p.add_argument("--layers", type=int, default=None, help="overrides the preset's decoder layers")
    p.add_argument("--model", default=None, help="a local Transformers checkpoint folder instead of random init")
    p.add_argument("--text-file", default=None, help="train on windows of this local text file (else synthetic SFT)")
    p.add_argument("--arch", choices=("llama", "torch"), default="llama" if HAS_TRANSFORMERS else "torch",
                   help="random-init Hugging Face Llama (needs transformers) or a plain-torch LM")
    p.add_argument("--fusedkern", action=argparse.BooleanOptionalAction, default=True,
                   help="the loss from fusedkern (default) or from the model's own logits")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("steps", "grad_accum", "seq_len", "batch_size", "layers"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be ≥ 1, got {value}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but no CUDA GPU is visible")
    # importing fusedkern switched the interpreter on if no GPU is visible and the user had not decided
    if args.device == "cpu" and args.fusedkern and os.environ.get("TRITON_INTERPRET") != "1":
        p.error("--device cpu runs fusedkern's kernels through Triton's interpreter, which is on only when no GPU "
                "is visible or TRITON_INTERPRET=1 is set before Python starts")
    if args.arch == "llama" and not HAS_TRANSFORMERS:
        p.error("--arch llama needs Hugging Face Transformers (pip install 'fusedkern[hf]'); or use --arch torch")
    if args.model is not None and args.arch != "llama":
        p.error("--model loads a Transformers checkpoint: it needs --arch llama (any supported causal LM)")
    return args


def resolve_preset(args) -> Preset:
    preset = PRESETS[args.preset or ("tiny" if args.device == "cpu" else "small")]
    overrides = {k: v for k, v in (("seq_len", args.seq_len), ("batch_size", args.batch_size),
                                   ("layers", args.layers)) if v is not None}
    if args.text_file is not None and args.model is None:
        overrides["vocab"] = max(preset.vocab, 256)  # the file's bytes are the tokens
    return dataclasses.replace(preset, **overrides)


def main(argv=None) -> list[dict]:
    """Train; returns one record per step: step, loss, step_time_s, tokens_per_s, peak_mib (None on CPU)."""
    args = parse_args(argv)
    preset = resolve_preset(args)
    device = torch.device(args.device)
    model = build_model(args, preset).to(device).train()
    vocab = model.get_output_embeddings().weight.shape[0] if hasattr(model, "get_output_embeddings") else preset.vocab
    tokenizer = None
    if args.text_file is not None and args.model is not None:
        import transformers
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    batches = (text_windows(args.text_file, preset, tokenizer, args.seed) if args.text_file is not None
               else synthetic_sft(preset, vocab, args.seed))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.device == "cuda")
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{type(model).__name__}: {n_params / 1e6:.2f} M parameters, vocab {vocab}, micro-batch "
          f"{preset.batch_size} × {preset.seq_len} tokens, {args.grad_accum} per step, on {args.device}, "
          f"loss from {'fusedkern' if args.fusedkern else 'the logits'}", flush=True)

    records = []
    bar = tqdm(range(args.steps), desc="train", unit="step", file=sys.stderr, dynamic_ncols=True)
    for step in bar:
        micro = [tuple(t.to(device) for t in next(batches)) for _ in range(args.grad_accum)]
        # the step's count of targets (labels shifted by one, as the loss shifts them), on the device:
        # every micro-batch's sum is divided by it, so the step's loss is the mean over all its targets
        num_items = sum((labels[:, 1:] != IGNORE_INDEX).sum() for _, _, labels in micro)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        step_loss = torch.zeros((), device=device)
        for ids, mask, labels in micro:
            with autocast:
                loss = model(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=num_items).loss
            loss.backward()
            step_loss += loss.detach()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = step_loss.item()  # waits for the step: the time below is the step's
        elapsed = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None
        tokens = args.grad_accum * preset.batch_size * preset.seq_len
        records.append(dict(step=step, loss=value, step_time_s=elapsed, tokens_per_s=tokens / elapsed, peak_mib=peak))
        bar.set_postfix(loss=f"{value:.4f}")
        tqdm.write(f"step {step}: loss {value:.6f}" + ("" if peak is None else f", peak {peak:.0f} MiB"))
        if not math.isfinite(value):
            raise RuntimeError(f"step {step}: the loss is {value}")
    bar.close()
    print_table(records)
    return records


def print_table(records: list[dict]) -> None:
    print(f"{'step':>5} {'loss':>10} {'step ms':>10} {'tokens/s':>11} {'peak MiB':>10}")
    for r in records:
        peak = "-" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"
        print(f"{r['step']:>5} {r['loss']:>10.6f} {r['step_time_s'] * 1e3:>10.1f} {r['tokens_per_s']:>11.0f} {peak:>10}")
    if len(records) > 1:  # the first step pays for compilation, autotuning and allocation
        rest = records[1:]
        time_s = sum(r["step_time_s"] for r in rest) / len(rest)
        peak = max((r["peak_mib"] for r in rest if r["peak_mib"] is not None), default=None)
        print(f"steps 1–{records[-1]['step']}: {time_s * 1e3:.1f} ms per step, "
              f"{sum(r['tokens_per_s'] for r in rest) / len(rest):.0f} tokens/s"
              + ("" if peak is None else f", peak {peak:.0f} MiB"))


if __name__ == "__main__":
    main()
