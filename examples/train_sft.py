"""A short supervised fine-tuning loop whose loss comes from fusedkern (or, with --loss-impl, from the
model's own logits, Liger-Kernel's or cut-cross-entropy's fused head), on a random-init causal LM or a
local checkpoint, over synthetic prompt/response pairs or a local text file.

    python examples/train_sft.py --device cpu --steps 2                 # tiny random Llama, Triton interpreter
    python examples/train_sft.py --device cuda --preset small --steps 50
    python examples/train_sft.py --device cuda --model /path/to/checkpoint --text-file corpus.txt
    python examples/train_sft.py --device cuda --preset llama3-head --no-fusedkern   # the baseline
    python examples/train_sft.py --device cuda --preset llama3-8b-2l --loss-impl liger --steps 11 \
        --warmup-steps 3 --csv train_table.csv                          # one row of the training-step table

--loss-impl picks who computes the head and its loss; only that differs between runs (same seed, init
and data; bf16 autocast, SDPA attention, AdamW on fp32 weights):
  fusedkern  `fusedkern.integrations.transformers.patch(model)` (--fusedkern, the default)
  hf         the unpatched model: bf16 logits, Transformers' ForCausalLMLoss (--no-fusedkern)
  liger      `liger_kernel.transformers.apply_liger_kernel_to_llama(model=model, fused_linear_cross_entropy=True)`
             with rope, rms_norm, swiglu and cross_entropy off (pip install liger-kernel)
  cce        `cut_cross_entropy.transformers.cce_patch(model)` where it exists; the PyPI wheel of
             cut-cross-entropy 25.1.1 has no `transformers` subpackage (it ships only from git), so
             otherwise the model's forward calls `cut_cross_entropy.linear_cross_entropy(hidden,
             lm_head.weight, labels, shift=True)` as cce_patch does (pip install cut-cross-entropy)
All four take `num_items_in_batch` (the loss is the sum over targets divided by it), so every run
uses the same gradient accumulation. --csv appends one row per run (percentiles of the step time after
--warmup-steps, tokens/s, peak memory, versions, and whether the head's dW is accumulated in fp32).

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
import importlib
import math
import os
import sys
import time
import types
from collections.abc import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

import fusedkern

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # examples/presets.py, also when loaded by path
from presets import Preset, commit, version  # noqa: E402
from presets import append_csv as _append_csv  # noqa: E402

IGNORE_INDEX = -100
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


PRESETS = {
    "tiny": Preset(vocab=64, hidden=32, intermediate=64, layers=2, heads=4, kv_heads=2, seq_len=16, batch_size=2),
    "small": Preset(vocab=32000, hidden=512, intermediate=1536, layers=4, heads=8, kv_heads=4, seq_len=1024,
                    batch_size=8),
    # Llama-3-8B's head and layer shapes with a few decoder layers: the LM head dominates the memory
    "llama3-head": Preset(vocab=128256, hidden=4096, intermediate=14336, layers=2, heads=32, kv_heads=8,
                          seq_len=4096, batch_size=1),
    # the training-step table (data/measured/h100/train_table.csv): Llama-3-8B's shapes with 2 decoder layers
    # (--layers), 8192 tokens a sequence. Parameters: embedding and head 128256 × 4096 = 525.3 M each,
    # a layer 218.1 M (attention 41.9 M, MLP 3 × 4096 × 14336 = 176.2 M), 1486.8 M with 2 layers; fp32
    # weights + fp32 grads + AdamW's two fp32 states = 16 B a parameter = 23.8 GB (22.2 GiB), plus the
    # bf16 copies autocast caches (~3 GB). The unpatched (hf) head at 2 × 8192 = 16384 tokens: bf16
    # logits 4.2 GB, their fp32 upcast 8.4 GB, log-softmax 8.4 GB kept, its gradient 2 × 8.4 GB in
    # backward: ~25 GB at its peak; the two layers' saved activations ~3 GB a sequence. hf ≈ 57–60 GB
    # at micro-batch 2 (fits an 80 GB H100; micro-batch 3 ≈ 72 GB would not leave a margin); the fused
    # heads keep only ~the model states + layers, ≈ 30–35 GB.
    "llama3-8b-2l": Preset(vocab=128256, hidden=4096, intermediate=14336, layers=2, heads=32, kv_heads=8,
                           seq_len=8192, batch_size=2, rope_theta=500000.0),
}

LOSS_IMPLS = ("fusedkern", "hf", "liger", "cce")


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
        return PlainCausalLM(preset, args.loss_impl == "fusedkern")
    import transformers
    if args.model is not None:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True,
                                                                  torch_dtype=torch.float32)
    else:
        config = transformers.LlamaConfig(
            vocab_size=preset.vocab, hidden_size=preset.hidden, intermediate_size=preset.intermediate,
            num_hidden_layers=preset.layers, num_attention_heads=preset.heads, num_key_value_heads=preset.kv_heads,
            max_position_embeddings=max(preset.seq_len, 128), tie_word_embeddings=False,
            rope_theta=preset.rope_theta, attn_implementation="sdpa" if args.device == "cuda" else "eager")
        torch.manual_seed(args.seed)
        # initialized where it trains: on the GPU a 1.5 B-parameter init takes a fraction of the CPU's time
        with torch.device(args.device):
            model = transformers.LlamaForCausalLM(config)
    model._train_sft_head_patch = patch_head(model, args.loss_impl)
    return model


def _require(module: str, pip_name: str, impl: str):
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise SystemExit(f"--loss-impl {impl} needs {pip_name}, which is not importable here ({exc}): "
                         f"pip install {pip_name}") from exc


HEAD_PATCH = {  # what each --loss-impl does to the model (the CSV's head_patch column)
    "fusedkern": "fusedkern.integrations.transformers.patch(model)",
    "hf": "none (bf16 logits, Transformers' loss_function)",
    "liger": "apply_liger_kernel_to_llama(model=model, fused_linear_cross_entropy=True, rope/rms_norm/swiglu=False)",
    "cce": "cut_cross_entropy.transformers.cce_patch(model)",
    "cce_fallback": "forward calling cut_cross_entropy.linear_cross_entropy(shift=True) (no cce_patch in the wheel)",
}

# Is the head's weight gradient accumulated in fp32 (fp32_dw), and how: the CSV's fp32_dw and dw_accum
# columns, from each implementation's source at the versions the table uses.
DW_ACCUM = {
    "fusedkern": ("yes", "fp32 accumulator across token chunks (patch's weight_grad_accum='fp32', the default)"),
    "hf": ("no", "autocast's bf16 GEMM: fp32 accumulation inside one cuBLAS GEMM over all tokens, "
                 "the [vocab, hidden] dW written in bf16, then cast to the fp32 weight's grad"),
    "liger": ("yes", "liger-kernel 0.8.5 with fp32 params under AMP: grad_weight = zeros_like(weight) (fp32), "
                     "torch.addmm(..., out_dtype=torch.float32, out=grad_weight) per chunk (torch >= 2.8, sm80+)"),
    "cce": ("no", "cut-cross-entropy 25.1.1: dc = zeros_like(c, dtype=e.dtype) (bf16 under AMP), bf16 partial "
                  "products lock-added into it per token block, then dc.to(fp32); and filter_eps='high' skips "
                  "blocks of small gradient"),
}


def patch_head(model: nn.Module, impl: str) -> str:
    """Swap the model's head and loss for `impl`'s; returns the HEAD_PATCH key of what was done."""
    if impl == "hf":
        return "hf"
    if impl == "fusedkern":
        from fusedkern.integrations.transformers import patch
        patch(model)
        return "fusedkern"
    if impl == "liger":
        liger = _require("liger_kernel.transformers", "liger-kernel", impl)
        liger.apply_liger_kernel_to_llama(rope=False, cross_entropy=False, fused_linear_cross_entropy=True,
                                          rms_norm=False, swiglu=False, model=model)
        return "liger"
    if impl == "cce":
        cce = _require("cut_cross_entropy", "cut-cross-entropy", impl)
        try:  # on git installs; its Llama forward imports Transformers 4.x names, so it may fail on 5.x too
            from cut_cross_entropy.transformers import cce_patch
        except ImportError:
            model.forward = types.MethodType(_cce_forward(cce.linear_cross_entropy), model)
            return "cce_fallback"
        cce_patch(model)
        return "cce"
    raise ValueError(f"unknown loss implementation {impl!r}")


def _cce_forward(linear_cross_entropy):
    """LlamaForCausalLM's forward with cce_patch's loss (cut_cross_entropy.transformers.utils.apply_lce):
    `linear_cross_entropy(hidden, lm_head.weight, labels, shift=True)`, reduction 'sum' divided by
    `num_items_in_batch` when given, else 'mean'; logits None. Under autocast the hidden states (fp32:
    Llama's residual stream and final RMSNorm stay in the weights' dtype) are cast to the autocast dtype
    as autocast casts them for lm_head: CCE 25.1.1 has no autocast handling and its backward asserts
    bf16/fp16 embeddings; the fp32 classifier is cast to bf16 inside its kernels."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    def forward(self, input_ids=None, attention_mask=None, labels=None, num_items_in_batch=None, **kwargs):
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        hidden = outputs.last_hidden_state
        if labels is None:
            return CausalLMOutputWithPast(logits=self.lm_head(hidden), past_key_values=outputs.past_key_values)
        if torch.is_autocast_enabled(hidden.device.type) and hidden.dtype == torch.float32:
            hidden = hidden.to(torch.get_autocast_dtype(hidden.device.type))
        loss = linear_cross_entropy(hidden, self.lm_head.weight, labels.to(hidden.device), shift=True,
                                    reduction="mean" if num_items_in_batch is None else "sum")
        if num_items_in_batch is not None:
            loss = loss / num_items_in_batch
        return CausalLMOutputWithPast(loss=loss, logits=None, past_key_values=outputs.past_key_values)

    return forward


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
    p.add_argument("--loss-impl", choices=LOSS_IMPLS, default=None,
                   help="who computes the head and its loss (default fusedkern; see above)")
    p.add_argument("--fusedkern", action=argparse.BooleanOptionalAction, default=None,
                   help="aliases of --loss-impl fusedkern / --loss-impl hf")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="first steps left out of the summary and the CSV row (compilation, autotuning, "
                        "allocation); default 1, or 0 with --steps 1")
    p.add_argument("--csv", default=None, help="append one row of this run's summary to this CSV file")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("steps", "grad_accum", "seq_len", "batch_size", "layers"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be ≥ 1, got {value}")
    if args.fusedkern is not None:
        alias = "fusedkern" if args.fusedkern else "hf"
        if args.loss_impl not in (None, alias):
            p.error(f"--{'' if args.fusedkern else 'no-'}fusedkern contradicts --loss-impl {args.loss_impl}")
        args.loss_impl = alias
    args.loss_impl = args.loss_impl or "fusedkern"
    args.fusedkern = args.loss_impl == "fusedkern"
    if args.warmup_steps is None:
        args.warmup_steps = min(1, args.steps - 1)
    if not 0 <= args.warmup_steps < args.steps:
        p.error(f"--warmup-steps must be ≥ 0 and below --steps ({args.steps}), got {args.warmup_steps}")
    if args.loss_impl in ("liger", "cce") and args.arch != "llama":
        p.error(f"--loss-impl {args.loss_impl} patches a Hugging Face Llama: it needs --arch llama")
    package = {"liger": ("liger_kernel", "liger-kernel"), "cce": ("cut_cross_entropy", "cut-cross-entropy")}
    if args.loss_impl in package and importlib.util.find_spec(package[args.loss_impl][0]) is None:
        p.error(f"--loss-impl {args.loss_impl} needs {package[args.loss_impl][1]}, which is not installed: "
                f"pip install {package[args.loss_impl][1]}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but no CUDA GPU is visible")
    # importing fusedkern switched the interpreter on if no GPU is visible and the user had not decided
    if args.device == "cpu" and args.fusedkern and os.environ.get("TRITON_INTERPRET") != "1":
        p.error("--device cpu runs fusedkern's kernels through Triton's interpreter, which is on only when no GPU "
                "is visible or TRITON_INTERPRET=1 is set before Python starts")
    if args.arch == "llama" and not HAS_TRANSFORMERS:
        p.error("--arch llama needs Hugging Face Transformers (pip install -e '.[hf]' in a clone); or use --arch torch")
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
    head_patch = getattr(model, "_train_sft_head_patch", args.loss_impl)
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
          f"loss from {args.loss_impl} ({HEAD_PATCH[head_patch]})", flush=True)

    records = []
    bar = tqdm(range(args.steps), desc="train", unit="step", file=sys.stderr, dynamic_ncols=True)
    for step in bar:
        micro = [tuple(t.to(device) for t in next(batches)) for _ in range(args.grad_accum)]
        # the step's count of targets (labels shifted by one, as the loss shifts them), on the device:
        # every micro-batch's sum is divided by it, so the step's loss is the mean over all its targets
        num_items = sum((labels[:, 1:] != IGNORE_INDEX).sum() for _, _, labels in micro)
        if device.type == "cuda":
            torch.cuda.synchronize()
            # reset at every step: the peak over the timed steps is that of a reset at their start
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
    print_table(records, args.warmup_steps)
    if args.csv is not None:
        row = summary_row(args, preset, records, head_patch)
        append_csv(args.csv, row)
        print(f"appended to {args.csv}: " + ", ".join(f"{k}={row[k]}" for k in
                                                      ("loss_impl", "step_ms_p50", "tokens_per_s", "peak_mib")))
    return records


def print_table(records: list[dict], warmup_steps: int = 1) -> None:
    print(f"{'step':>5} {'loss':>10} {'step ms':>10} {'tokens/s':>11} {'peak MiB':>10}")
    for r in records:
        peak = "-" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"
        print(f"{r['step']:>5} {r['loss']:>10.6f} {r['step_time_s'] * 1e3:>10.1f} {r['tokens_per_s']:>11.0f} {peak:>10}")
    rest = records[warmup_steps:]
    if rest and warmup_steps > 0:  # the first steps pay for compilation, autotuning and allocation
        time_s = sum(r["step_time_s"] for r in rest) / len(rest)
        peak = max((r["peak_mib"] for r in rest if r["peak_mib"] is not None), default=None)
        print(f"steps {rest[0]['step']}–{rest[-1]['step']}: {time_s * 1e3:.1f} ms per step, "
              f"{sum(r['tokens_per_s'] for r in rest) / len(rest):.0f} tokens/s"
              + ("" if peak is None else f", peak {peak:.0f} MiB"))


# ----------------------------------------------------------------------------------------------
# the CSV row


CSV_COLUMNS = ("loss_impl", "preset", "layers", "seq_len", "batch_size", "grad_accum", "steps_timed",
               "step_ms_p20", "step_ms_p50", "step_ms_p80", "tokens_per_s", "peak_mib", "first_loss",
               "final_loss", "protocol", "workload", "device", "torch", "triton", "transformers", "liger_kernel",
               "cut_cross_entropy", "commit", "fp32_dw", "dw_accum", "head_patch", "autocast", "attention")


def summary_row(args, preset: Preset, records: list[dict], head_patch: str) -> dict:
    timed = records[args.warmup_steps:]
    times_ms = [r["step_time_s"] * 1e3 for r in timed]
    p20, p50, p80 = (float(q) for q in np.quantile(np.asarray(times_ms), [0.2, 0.5, 0.8]))
    tokens = args.grad_accum * preset.batch_size * preset.seq_len
    peaks = [r["peak_mib"] for r in timed if r["peak_mib"] is not None]
    fp32_dw, dw_accum = DW_ACCUM[args.loss_impl]
    if args.device == "cpu":
        fp32_dw, dw_accum = "n/a", "CPU run (no autocast; fp32 throughout)"
    cuda = args.device == "cuda"
    return {
        "loss_impl": args.loss_impl, "preset": args.preset or ("tiny" if args.device == "cpu" else "small"),
        "layers": preset.layers, "seq_len": preset.seq_len, "batch_size": preset.batch_size,
        "grad_accum": args.grad_accum, "steps_timed": len(timed),
        "step_ms_p20": f"{p20:.2f}", "step_ms_p50": f"{p50:.2f}",
        "step_ms_p80": f"{p80:.2f}", "tokens_per_s": f"{tokens / (p50 / 1e3):.1f}",
        "peak_mib": f"{max(peaks):.1f}" if peaks else "",
        "first_loss": f"{records[0]['loss']:.6f}", "final_loss": f"{records[-1]['loss']:.6f}",
        "protocol": "sequential", "workload": "sft_masked_50" if args.text_file is None else "text_windows",
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__, "triton": version("triton"), "transformers": version("transformers"),
        "liger_kernel": version("liger-kernel"), "cut_cross_entropy": version("cut-cross-entropy"),
        "commit": commit(), "fp32_dw": fp32_dw, "dw_accum": dw_accum, "head_patch": HEAD_PATCH[head_patch],
        "autocast": "bf16, fp32 weights" if cuda else "none, fp32",
        "attention": ("sdpa" if cuda else "eager") if args.arch == "llama" else "torch TransformerEncoder",
    }


def append_csv(path: str, row: dict) -> None:
    """Append `row` (header first if the file is new or empty), one line."""
    _append_csv(path, row, CSV_COLUMNS)


if __name__ == "__main__":
    main()
