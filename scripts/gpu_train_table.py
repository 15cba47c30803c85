"""The training table of issue 43 (item 4): TRL 1.16's SFT, DPO and GRPO steps on models whose LM head is a large
share of the step, with four rows each -- TRL's own fused head, TRL with Liger's layer kernels, fusedkern's head,
fusedkern's head with Liger's layer kernels.

    python scripts/gpu_train_table.py --checkpoints DIR --write-checkpoints [--model ...]   # random init, no Hub
    python scripts/gpu_train_table.py --checkpoints DIR --model qwen3-0.6b --step sft --row fusedkern \\
        --csv train_trl_table.csv                                   # one (model, step, row): one CSV row
    python scripts/gpu_train_table.py --tiny --csv FILE             # CPU: tiny shapes, 2 steps, every run

scripts/gpu_train_table.sh drives it on the GPU: one process per (model, step, row), so each peak memory is its own,
in a shuffled order, halving the micro-batch when a run runs out of memory (exit status 75).

The models (`MODELS`), loaded from local checkpoints written at random init (bf16 on disk, fp32 in training):
  qwen3-0.6b     Qwen3-0.6B's shapes: 28 layers, hidden 1024, vocab 151936, tied embeddings
  llama-3.2-1b   Llama-3.2-1B's: 16 layers, hidden 2048, vocab 128256, tied
  llama3-8b-2l   Llama-3-8B's head and 2 of its layers (untied), as scripts/gpu_train_dpo.sh: DPO only by default
The steps, each at --seq tokens a sequence (2048), a fixed number of sequences an optimizer step (the global batch:
the same data for every row, so the losses compare) in micro-batches of the largest size that fits (the driver's
search) with gradient accumulation over the rest, bf16 autocast on fp32 weights, AdamW (fused), no gradient
checkpointing, SDPA attention:
  sft   SFTTrainer on full sequences of random tokens (every target scored)        workload sft_full
  dpo   DPOTrainer, a frozen reference copy, half of each sequence prompt        workload dpo_prompt_50
  grpo  GRPOTrainer's own loss (dapo, beta 0) on fixed completions and advantages, no generation: the trainer's
        `_generate_and_score_completions` returns a prepared batch (half prompt; completion lengths drawn between
        half and all of the completion span; advantages normalized in each group of 2)   workload grpo_prompt_50
The rows: trl (TRL's head), trl_liger (use_liger_kernel=True: Liger's RoPE, RMSNorm and SwiGLU; TRL keeps its
head), fusedkern (fusedkern.integrations.trl.patch() before the trainer is built), fusedkern_liger (both).

Each run appends one CSV row: tokens/s at the median step time (step_ms_p20/p50/p80 over the timed steps after
--warmup), peak MiB (torch.cuda.max_memory_allocated over the timed steps), first and final logged loss, the batch
layout, protocol and workload, versions, commit and --phase; with --steps-csv, one row per optimizer step beside it
(STEP_COLUMNS: the step's time and what the caching allocator, Triton's JIT and fusedkern's free-memory check did in
it). Hub kernels stay off (USE_HUB_KERNELS=NO, use_kernels=False): Transformers 5.25 would otherwise kernelize the
layers where the `kernels` package is installed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import os
import sys
import tempfile
import time
import types
from pathlib import Path

os.environ.setdefault("USE_HUB_KERNELS", "NO")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import fusedkern  # noqa: E402,F401  (before TRL: picks the GPU or Triton's interpreter before any kernel is defined)
from fusedkern._runtime import interpreting  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))  # the examples' provenance helpers, tokenizer and step timer
from presets import append_csv, commit, version  # noqa: E402
from train_dpo import StepTimer, build_tokenizer  # noqa: E402

OOM_EXIT = 75  # a run that ran out of GPU memory: the driver retries it with half the micro-batch
STEPS = ("sft", "dpo", "grpo")
ROWS = ("trl", "trl_liger", "fusedkern", "fusedkern_liger")
WORKLOADS = {"sft": "sft_full", "dpo": "dpo_prompt_50", "grpo": "grpo_prompt_50"}
NUM_GENERATIONS = 2  # GRPO's group size: advantages are normalized within groups of this many completions


@dataclasses.dataclass(frozen=True)
class Shape:
    arch: str  # "qwen3" or "llama"
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    rope_theta: float
    #: step -> (global batch, first micro-batch): sequences an optimizer step (DPO: pairs; 32768 tokens a step at
    #: seq 2048 for the two small models) and the micro-batch the driver's search starts from, halved while a run
    #: runs out of memory. The first micro-batches are estimates of what fits 80 GB (about 16384 tokens of
    #: activations beside the fp32 weights, gradients and AdamW moments), not measured: --micro-batch starts higher
    batches: dict
    steps: tuple = STEPS  # the steps run by default


MODELS = {
    "qwen3-0.6b": Shape("qwen3", 151936, 1024, 3072, 28, 16, 8, 128, True, 1e6,
                        {"sft": (16, 8), "dpo": (8, 4), "grpo": (16, 8)}),
    "llama-3.2-1b": Shape("llama", 128256, 2048, 8192, 16, 32, 8, 64, True, 5e5,
                          {"sft": (16, 8), "dpo": (8, 4), "grpo": (16, 8)}),
    # scripts/gpu_train_dpo.sh's setup: 1 pair a micro-batch, 2 micro-batches a step
    "llama3-8b-2l": Shape("llama", 128256, 4096, 14336, 2, 32, 8, 128, False, 5e5,
                          {"sft": (2, 2), "dpo": (2, 1), "grpo": (2, 2)}, steps=("dpo",)),
}
#: --tiny: the same architectures and head ties at a size the interpreter runs in seconds (distinct vocabularies)
TINY = {
    "qwen3-0.6b": Shape("qwen3", 96, 32, 64, 2, 2, 1, 16, True, 1e6, {"sft": (2, 1), "dpo": (2, 1), "grpo": (2, 1)}),
    "llama-3.2-1b": Shape("llama", 112, 32, 64, 2, 2, 1, 16, True, 5e5,
                          {"sft": (2, 1), "dpo": (2, 1), "grpo": (2, 1)}),
    "llama3-8b-2l": Shape("llama", 128, 32, 64, 2, 2, 1, 16, False, 5e5,
                          {"sft": (2, 1), "dpo": (2, 1), "grpo": (2, 1)}, steps=("dpo",)),
}

CSV_COLUMNS = ("model", "step", "row", "workload", "protocol", "layers", "hidden", "vocab", "tied", "seq_len",
               "global_batch", "micro_batch", "micro_batch_first", "grad_accum", "tokens_per_step", "steps_timed",
               "warmup_steps", "step_ms_p20", "step_ms_p50", "step_ms_p80", "tokens_per_s", "peak_mib", "first_loss",
               "final_loss", "head", "liger_layers", "device", "torch", "triton", "transformers", "trl",
               "liger_kernel", "commit", "autocast", "attention", "optimizer", "phase")
#: --steps-csv: one row per optimizer step of each run (warm-up steps included, `timed` 0), with what the caching
#: allocator, Triton's JIT, TorchDynamo and fusedkern's free-memory check did during it, so that a slow step can be
#: matched with its events. The allocator's columns are empty off CUDA, Triton's under its interpreter (which compiles
#: nothing), the free-memory columns for the rows with TRL's head
STEP_COLUMNS = ("model", "step", "row", "workload", "protocol", "micro_batch", "grad_accum", "e_alloc", "phase",
                "commit", "device", "step_index", "timed", "step_ms", "peak_allocated_mib", "peak_reserved_mib",
                "reserved_mib", "inactive_split_mib", "alloc_retries", "device_allocs", "device_frees",
                "sync_all_streams", "ooms", "triton_compiles", "triton_compile_ms", "triton_kernels", "dynamo_graphs",
                "free_memory_checks", "free_memory_refusals", "driver_memory_queries")
#: the step CSV's columns from torch.cuda.memory_stats()'s event counters, each the counter's change over the step:
#: failed cudaMallocs that flushed the cache and retried (a device synchronization each), cudaMalloc / cudaFree
#: calls (cuMemMap / cuMemUnmap with expandable segments), synchronize_and_free_events calls, out-of-memory errors
ALLOCATOR_COUNTERS = {"alloc_retries": "num_alloc_retries", "device_allocs": "num_device_alloc",
                      "device_frees": "num_device_free", "sync_all_streams": "num_sync_all_streams",
                      "ooms": "num_ooms"}
E_ALLOCS = ("rounded", "exact")


class EventCounters:
    """While entered, counts process-wide: Triton JIT compilations (a kernel's in-process cache missed: compiled, or
    loaded from the disk cache) with their kernels' names and wall time, through Triton's jit_cache_hook and
    jit_post_compile_hook (chained to hooks already set, whose answers are kept); fusedkern's free-memory checks
    (`fusedkern.dispatch.fits_free_memory`, whose refusals send the anchored head to another path) and their
    refusals; the driver's free-memory queries (`torch.cuda.mem_get_info`). Everything is restored on exit."""

    def __init__(self):
        self.compiles, self.compile_s, self.kernels = 0, 0.0, []
        self.checks = self.refusals = self.driver_queries = 0
        self._compile_start = None

    def values(self) -> dict:
        return dict(triton_compiles=self.compiles, triton_compile_s=self.compile_s, triton_kernel_count=len(
            self.kernels), free_memory_checks=self.checks, free_memory_refusals=self.refusals,
            driver_memory_queries=self.driver_queries)

    def __enter__(self):
        import triton

        from fusedkern import dispatch

        self._runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
        if self._runtime is not None:
            self._hooks = (self._runtime.jit_cache_hook, self._runtime.jit_post_compile_hook)
            before, after = self._hooks

            def on_miss(**kw):
                self.compiles += 1
                self.kernels.append(kw["fn"].name)
                self._compile_start = time.perf_counter()
                return before(**kw) if before is not None else None

            def on_compiled(**kw):
                if self._compile_start is not None:
                    self.compile_s += time.perf_counter() - self._compile_start
                    self._compile_start = None
                return after(**kw) if after is not None else None

            self._runtime.jit_cache_hook, self._runtime.jit_post_compile_hook = on_miss, on_compiled
        self._dispatch, self._fits, self._mem_get_info = dispatch, dispatch.fits_free_memory, torch.cuda.mem_get_info
        fits, mem_get_info = self._fits, self._mem_get_info

        def counted_fits(need, device):
            self.checks += 1
            ok = fits(need, device)
            self.refusals += not ok
            return ok

        def counted_mem_get_info(*args, **kwargs):
            self.driver_queries += 1
            return mem_get_info(*args, **kwargs)

        dispatch.fits_free_memory, torch.cuda.mem_get_info = counted_fits, counted_mem_get_info
        return self

    def __exit__(self, *exc):
        self._dispatch.fits_free_memory, torch.cuda.mem_get_info = self._fits, self._mem_get_info
        if self._runtime is not None:
            self._runtime.jit_cache_hook, self._runtime.jit_post_compile_hook = self._hooks
        return False


@contextlib.contextmanager
def e_allocation(mode: str):
    """--e-alloc: "rounded" leaves fusedkern's kept E (and its partial sums) allocated for `kept_e_rows(T)` rows;
    "exact" allocates them for exactly T rows, as before that rounding (a diagnostic: the same results, other
    allocation sizes)."""
    from fusedkern import anchored

    if mode not in E_ALLOCS:
        raise ValueError(f"e_alloc must be one of {E_ALLOCS}, got {mode!r}")
    rounded = anchored.kept_e_rows
    if mode == "exact":
        anchored.kept_e_rows = lambda rows: rows
    try:
        yield
    finally:
        anchored.kept_e_rows = rounded


class StepProbe(TrainerCallback):
    """Per optimizer step (added after the StepTimer, whose step_end synchronizes first): the change of the caching
    allocator's event counters (ALLOCATOR_COUNTERS) and its peak reserved bytes (the StepTimer resets the peaks as the
    step begins), its reserved and inactive-split bytes at the step's end, and what `counters` (EventCounters) and
    TorchDynamo (its unique graphs, when loaded) counted during the step."""

    def __init__(self, cuda: bool, counters: EventCounters, triton_counted: bool):
        self.cuda, self.counters, self.triton_counted = cuda, counters, triton_counted
        self.records, self.before = [], None

    def snapshot(self) -> dict:
        snap = self.counters.values()
        dynamo = sys.modules.get("torch._dynamo.utils")  # loaded by whatever compiles; nothing to count otherwise
        snap["dynamo_graphs"] = dynamo.counters["stats"]["unique_graphs"] if dynamo is not None else 0
        if self.cuda:
            stats = torch.cuda.memory_stats()
            # a counter this torch does not keep stays None, written empty rather than as a measured 0
            snap.update({name: stats.get(key) for name, key in ALLOCATOR_COUNTERS.items()})
            snap.update(peak_reserved=stats.get("reserved_bytes.all.peak"),
                        reserved=stats.get("reserved_bytes.all.current"),
                        inactive_split=stats.get("inactive_split_bytes.all.current"))
        return snap

    def on_step_begin(self, args, state, control, **kwargs):
        self.before = self.snapshot()

    def on_step_end(self, args, state, control, **kwargs):
        after, before = self.snapshot(), self.before
        first_kernel = before["triton_kernel_count"]
        names = sorted(set(self.counters.kernels[first_kernel:after["triton_kernel_count"]]))
        record = {"triton_compiles": after["triton_compiles"] - before["triton_compiles"],
                  "triton_compile_ms": f"{(after['triton_compile_s'] - before['triton_compile_s']) * 1e3:.1f}",
                  "triton_kernels": " ".join(names)} if self.triton_counted else {
            "triton_compiles": "", "triton_compile_ms": "", "triton_kernels": ""}
        for key in ("dynamo_graphs", "free_memory_checks", "free_memory_refusals", "driver_memory_queries"):
            record[key] = after[key] - before[key]
        for name in ALLOCATOR_COUNTERS:
            kept = self.cuda and after[name] is not None and before[name] is not None
            record[name] = after[name] - before[name] if kept else ""
        mib = {"peak_reserved_mib": "peak_reserved", "reserved_mib": "reserved", "inactive_split_mib": "inactive_split"}
        for column, key in mib.items():
            record[column] = f"{after[key] / 2**20:.1f}" if self.cuda and after[key] is not None else ""
        self.records.append(record)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoints", default=None, help="folder of the models' checkpoints (--tiny: a temporary one)")
    p.add_argument("--write-checkpoints", action="store_true", help="write the missing checkpoints and exit")
    p.add_argument("--model", nargs="+", choices=sorted(MODELS), default=None, help="default: all")
    p.add_argument("--step", nargs="+", choices=STEPS, default=None, help="default: each model's steps")
    p.add_argument("--row", nargs="+", choices=ROWS, default=list(ROWS))
    p.add_argument("--csv", default=None, help="append one row per run to this CSV file")
    p.add_argument("--steps-csv", default=None, help="append one row per optimizer step of each run to this CSV "
                   "file (STEP_COLUMNS: step time, the allocator's events, Triton compilations, free-memory checks)")
    p.add_argument("--e-alloc", choices=E_ALLOCS, default="rounded", help="fusedkern's kept E allocated for "
                   "kept_e_rows(T) rows (rounded, the library's) or exactly T (a diagnostic of the allocator)")
    p.add_argument("--seq", type=int, default=None, help="tokens a sequence (2048; --tiny 8)")
    p.add_argument("--steps", type=int, default=None, help="timed optimizer steps (6; --tiny 1)")
    p.add_argument("--warmup", type=int, default=None, help="optimizer steps before the timed ones (2; --tiny 1)")
    p.add_argument("--micro-batch", type=int, default=None, help="sequences (DPO: pairs) a micro-batch; default "
                   "the model's first micro-batch for the step (MODELS)")
    p.add_argument("--micro-batch-first", type=int, default=None, help="the micro-batch the driver's search began "
                   "at (recorded in the CSV; default --micro-batch)")
    p.add_argument("--global-batch", type=int, default=None, help="sequences (DPO: pairs) an optimizer step")
    p.add_argument("--protocol", default=None, help="the CSV's protocol column (default sequential; --tiny "
                   "in_process)")
    p.add_argument("--phase", default="after", help="the CSV's phase column: which tree the rows measure beside "
                   "the others of the committed table (\"before\": b4ffb48, before the head-floor kernels of issue 47; "
                   "default \"after\")")
    p.add_argument("--tiny", action="store_true", help="tiny shapes on CPU, every selected run in this process")
    p.add_argument("--list-runs", action="store_true", help="print the selected runs, one a line: model, step, row, "
                   "global batch, first micro-batch (what scripts/gpu_train_table.sh loops over), and exit")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.checkpoints is None and not args.tiny:
        p.error("--checkpoints DIR is needed (or --tiny)")
    args.shapes = TINY if args.tiny else MODELS
    args.seq = args.seq or (8 if args.tiny else 2048)
    args.steps = args.steps if args.steps is not None else (1 if args.tiny else 6)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 2)
    args.protocol = args.protocol or ("in_process" if args.tiny else "sequential")
    args.model = args.model or list(MODELS)
    args.cuda = torch.cuda.is_available() and not interpreting()
    if not args.cuda:
        torch.set_num_threads(1)  # tiny ops: thread-pool wake-ups would cost more than the work
    return args


def runs_of(args) -> list[tuple[str, str, str]]:
    """(model, step, row) for every selected model, its steps (or --step) and --row, in that order."""
    return [(model, step, row) for model in args.model
            for step in (args.step or args.shapes[model].steps) for row in args.row]


# ---------------------------------------------------------------------------------------------------- checkpoints

def config_of(shape: Shape, seq: int):
    from transformers import LlamaConfig, Qwen3Config

    common = dict(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                  num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                  num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim, tie_word_embeddings=shape.tied,
                  max_position_embeddings=max(2 * seq, 128), rope_theta=shape.rope_theta, rms_norm_eps=1e-6,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return Qwen3Config(**common) if shape.arch == "qwen3" else LlamaConfig(**common)


def write_checkpoint(path: Path, shape: Shape, seq: int, seed: int, cuda: bool) -> None:
    """A random-init model of `shape` (Transformers' own init, seeded) saved in bf16 with its tokenizer; skipped
    where `path` already holds one."""
    from transformers import AutoModelForCausalLM

    if (path / "config.json").exists():
        return
    start = time.perf_counter()
    torch.manual_seed(seed)
    with torch.device("cuda" if cuda else "cpu"):
        model = AutoModelForCausalLM.from_config(config_of(shape, seq), dtype=torch.float32)
    model.to(torch.bfloat16).save_pretrained(path)
    build_tokenizer(shape.vocab).save_pretrained(path)
    n = sum(p.numel() for p in model.parameters())
    del model
    print(f"checkpoint {path.name}: {n / 1e6:.1f} M parameters in {time.perf_counter() - start:.1f} s", flush=True)


def load_model(path: Path, cuda: bool):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, use_kernels=False,
                                                attn_implementation="sdpa" if cuda else "eager")


# ---------------------------------------------------------------------------------------------------------- data

def random_words(g: np.random.Generator, vocab: int, n: int) -> str:
    return " ".join(f"t{i}" for i in g.integers(0, vocab - 3, n))


def sft_data(shape: Shape, seq: int, n: int, seed: int):
    """n pre-tokenized sequences of exactly `seq` random token ids (no padding; every target scored)."""
    from datasets import Dataset

    g = np.random.default_rng(seed)
    return Dataset.from_dict({"input_ids": g.integers(3, shape.vocab, (n, seq)).tolist()})


def dpo_data(shape: Shape, seq: int, n: int, seed: int):
    """n preference pairs of random words: a prompt of seq/2 tokens, completions of seq/2 - 1 (+ EOS)."""
    from datasets import Dataset

    g = np.random.default_rng(seed)
    prompt, completion = seq // 2, seq - seq // 2 - 1
    rows = [(random_words(g, shape.vocab, prompt), " " + random_words(g, shape.vocab, completion),
             " " + random_words(g, shape.vocab, completion)) for _ in range(n)]
    return Dataset.from_dict({k: [r[i] for r in rows] for i, k in enumerate(("prompt", "chosen", "rejected"))})


def grpo_batch(shape: Shape, seq: int, n: int, seed: int, generation: int) -> dict:
    """One generation batch of n fixed completions: what GRPOTrainer's `_generate_and_score_completions` returns
    (prompt and completion ids and masks, advantages, the batch's completion-token count), drawn from (seed,
    generation) so that every row trains on the same batches."""
    g = torch.Generator().manual_seed(seed * 1000 + generation)
    prompt, completion = seq // 2, seq - seq // 2
    lengths = torch.randint(completion // 2, completion + 1, (n,), generator=g)
    completion_mask = (torch.arange(completion)[None, :] < lengths[:, None]).long()
    rewards = torch.randn(n // NUM_GENERATIONS, NUM_GENERATIONS, generator=g)
    advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).reshape(-1)
    return {"prompt_ids": torch.randint(3, shape.vocab, (n, prompt), generator=g),
            "prompt_mask": torch.ones(n, prompt, dtype=torch.long),
            "completion_ids": torch.randint(3, shape.vocab, (n, completion), generator=g),
            "completion_mask": completion_mask, "advantages": advantages,
            "num_items_in_batch": completion_mask.sum().float()}


# ---------------------------------------------------------------------------------------------------------- runs

def build_trainer(step: str, row: str, shape: Shape, path: Path, args, global_batch: int, micro: int, out: str):
    import trl

    from fusedkern.integrations import trl as fk_trl

    cuda = args.cuda
    grad_accum = global_batch // micro
    total = args.warmup + args.steps
    common = dict(output_dir=out, per_device_train_batch_size=micro, gradient_accumulation_steps=grad_accum,
                  max_steps=total, logging_steps=1, report_to=[], save_strategy="no", seed=args.seed,
                  disable_tqdm=True, use_cpu=not cuda, bf16=cuda, learning_rate=1e-5 if cuda else 0.1,
                  optim="adamw_torch_fused" if cuda else "sgd", lr_scheduler_type="constant",
                  gradient_checkpointing=False, use_liger_kernel=row.endswith("liger"))
    tokenizer = build_tokenizer(shape.vocab)
    model = load_model(path, cuda)
    kw = dict(model=model, processing_class=tokenizer)
    if step == "sft":
        cls, config = trl.SFTTrainer, trl.SFTConfig(max_length=args.seq, **common)
        kw["train_dataset"] = sft_data(shape, args.seq, total * global_batch, args.seed)
    elif step == "dpo":
        cls, config = trl.DPOTrainer, trl.DPOConfig(max_length=args.seq + 8, loss_type=["sigmoid"], beta=0.1,
                                                    **common)
        kw["ref_model"] = load_model(path, cuda)
        kw["train_dataset"] = dpo_data(shape, args.seq, total * global_batch, args.seed)
    else:
        cls = trl.GRPOTrainer
        config = trl.GRPOConfig(num_generations=NUM_GENERATIONS, max_completion_length=args.seq - args.seq // 2,
                                loss_type="dapo", beta=0.0, **common)
        kw["train_dataset"] = _prompts(total * global_batch)
        kw["reward_funcs"] = _no_reward
    with fk_trl.patched() if row.startswith("fusedkern") else contextlib.nullcontext():
        trainer = cls(args=config, **kw)
    if step == "grpo":  # no generation: each generation batch is a prepared one (GRPOTrainer's loss runs as is)
        generations = iter(range(10**9))

        def fixed(self, inputs):
            batch = grpo_batch(shape, args.seq, global_batch, args.seed, next(generations))
            return {k: v.to(self.accelerator.device) for k, v in batch.items()}

        trainer._generate_and_score_completions = types.MethodType(fixed, trainer)
    if row.startswith("fusedkern"):
        fk_trl.check_trainer(trainer)
    return trainer


def _prompts(n: int):
    from datasets import Dataset

    return Dataset.from_dict({"prompt": ["t1 t2"] * n})


def _no_reward(completions, **kwargs):
    raise AssertionError("the table's GRPO step generates nothing, so nothing is rewarded")


def _is_out_of_memory(error: BaseException) -> bool:
    text = str(error)
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and ("CUBLAS_STATUS_ALLOC_FAILED" in text or "out of memory" in text))


def run_one(model_name: str, step: str, row: str, args, callbacks=(), step_rows: list | None = None) -> dict:
    """Train one (model, step, row); its CSV row. `callbacks`: more TrainerCallbacks for the trainer, after the step
    timer and the step probe (scripts/gpu_step_profile.py profiles a step through one). step_rows: a list that gets
    the run's per-step rows (STEP_COLUMNS)."""
    from fusedkern.integrations import trl as fk_trl
    from fusedkern.study import liger_layers

    shape = args.shapes[model_name]
    global_batch, first_micro = shape.batches[step]
    global_batch = args.global_batch or global_batch
    micro = args.micro_batch or first_micro
    if global_batch % micro:
        raise SystemExit(f"the micro-batch {micro} does not divide the global batch {global_batch}")
    path = Path(args.checkpoints) / model_name
    liger = row.endswith("liger")
    # Liger's kernels on CPU tensors need the interpreter's shims; its process-wide replacements are undone after
    # the run (--tiny runs every row in one process)
    on_cpu = liger_layers.interpreted() if liger and not args.cuda else contextlib.nullcontext()
    e_alloc = getattr(args, "e_alloc", "rounded")
    with tempfile.TemporaryDirectory() as out, liger_layers.liger_patches_undone((shape.arch,)), on_cpu, \
            EventCounters() as counters, e_allocation(e_alloc):
        trainer = build_trainer(step, row, shape, path, args, global_batch, micro, out)
        timer = StepTimer(args.cuda)
        trainer.add_callback(timer)
        probe = StepProbe(args.cuda, counters, triton_counted=not interpreting())
        trainer.add_callback(probe)
        for callback in callbacks:
            trainer.add_callback(callback)
        print(f"{model_name} {step} {row}: global batch {global_batch}, micro-batch {micro}, seq {args.seq}",
              flush=True)
        trainer.train()
        layers = liger_layers.liger_layers(trainer.model)
        if liger and not (layers["rms_norm"] and layers["swiglu"] and layers["rope"]):
            raise RuntimeError(f"{row}: Liger's layer kernels are not all in the model: {layers}")
        head = "fusedkern" if fk_trl.has_fused_head(trainer.model) else "trl"
        logs = [h for h in trainer.state.log_history if "loss" in h]
    if len(logs) != len(timer.records) or len(probe.records) != len(timer.records):
        raise RuntimeError(f"{len(logs)} logged steps and {len(probe.records)} probed for {len(timer.records)} "
                           "timed ones")
    rows_per_item = 2 if step == "dpo" else 1  # DPO: a chosen and a rejected row per pair
    tokens = rows_per_item * global_batch * args.seq
    timed = timer.records[args.warmup:] or timer.records
    p20, p50, p80 = (float(q) for q in np.quantile([r["step_time_s"] * 1e3 for r in timed], [0.2, 0.5, 0.8]))
    peaks = [r["peak_mib"] for r in timed if r["peak_mib"] is not None]
    result = {
        "model": model_name, "step": step, "row": row, "workload": WORKLOADS[step], "protocol": args.protocol,
        "layers": shape.layers, "hidden": shape.hidden, "vocab": shape.vocab, "tied": shape.tied,
        "seq_len": args.seq, "global_batch": global_batch, "micro_batch": micro,
        "micro_batch_first": args.micro_batch_first or micro, "grad_accum": global_batch // micro,
        "tokens_per_step": tokens, "steps_timed": len(timed), "warmup_steps": args.warmup,
        "step_ms_p20": f"{p20:.2f}", "step_ms_p50": f"{p50:.2f}", "step_ms_p80": f"{p80:.2f}",
        "tokens_per_s": f"{tokens / (p50 / 1e3):.1f}", "peak_mib": f"{max(peaks):.1f}" if peaks else "",
        "first_loss": f"{logs[0]['loss']:.6f}", "final_loss": f"{logs[-1]['loss']:.6f}", "head": head,
        "liger_layers": "yes" if liger else "no",
        "device": torch.cuda.get_device_name() if args.cuda else "cpu", "torch": torch.__version__,
        "triton": version("triton"), "transformers": version("transformers"), "trl": version("trl"),
        "liger_kernel": version("liger-kernel"), "commit": commit(),
        "autocast": "bf16, fp32 weights" if args.cuda else "none, fp32",
        "attention": "sdpa" if args.cuda else "eager", "optimizer": "adamw_torch_fused" if args.cuda else "sgd",
        "phase": args.phase,
    }
    print(f"{model_name} {step} {row}: {float(result['tokens_per_s']):.0f} tokens/s, p50 {p50:.1f} ms, peak "
          f"{result['peak_mib'] or '-'} MiB, loss {result['first_loss']} -> {result['final_loss']} ({head} head)",
          flush=True)
    same = {"model": model_name, "step": step, "row": row, "workload": result["workload"],
            "protocol": result["protocol"], "micro_batch": micro, "grad_accum": global_batch // micro,
            "e_alloc": e_alloc if head == "fusedkern" else "", "phase": args.phase, "commit": result["commit"],
            "device": result["device"]}
    for i, (t, events) in enumerate(zip(timer.records, probe.records)):
        peak = "" if t["peak_mib"] is None else f"{t['peak_mib']:.1f}"
        line = dict(same, step_index=i, timed=int(i >= args.warmup), step_ms=f"{t['step_time_s'] * 1e3:.2f}",
                    peak_allocated_mib=peak, **events)
        if head != "fusedkern":  # TRL's head asks fusedkern's check nothing: its zeros would read as measured
            line.update(free_memory_checks="", free_memory_refusals="")
        v = {k: "-" if x == "" else x for k, x in line.items()}  # "-": not measured here
        print(f"  step {i}{'' if line['timed'] else ' (warm-up)'}: {v['step_ms']} ms, cudaMalloc {v['device_allocs']}"
              f" / cudaFree {v['device_frees']} / retries {v['alloc_retries']}, reserved {v['reserved_mib']} MiB, "
              f"Triton compiles {v['triton_compiles']} ({v['triton_compile_ms']} ms), free-memory checks "
              f"{v['free_memory_checks']} (refused {v['free_memory_refusals']}), driver queries "
              f"{v['driver_memory_queries']}", flush=True)
        if step_rows is not None:
            step_rows.append(line)
    return result


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.list_runs:
        for model_name, step, row in runs_of(args):
            global_batch, first_micro = args.shapes[model_name].batches[step]
            print(model_name, step, row, args.global_batch or global_batch, args.micro_batch or first_micro)
        return []
    with contextlib.ExitStack() as stack:
        if args.checkpoints is None:
            args.checkpoints = stack.enter_context(tempfile.TemporaryDirectory())
        for model_name in args.model:
            write_checkpoint(Path(args.checkpoints) / model_name, args.shapes[model_name], args.seq, args.seed,
                             args.cuda)
        if args.write_checkpoints:
            return []
        runs = runs_of(args)
        results = []
        for model_name, step, row in runs:
            step_rows = []
            try:
                result = run_one(model_name, step, row, args, step_rows=step_rows)
            except BaseException as error:
                if not _is_out_of_memory(error):
                    raise
                print(f"out of memory: {model_name} {step} {row}: {str(error).splitlines()[0][:200]}", flush=True)
                raise SystemExit(OOM_EXIT) from None
            results.append(result)
            if args.csv is not None:
                append_csv(args.csv, result, CSV_COLUMNS)
            if args.steps_csv is not None:
                for line in step_rows:
                    append_csv(args.steps_csv, line, STEP_COLUMNS)
            gc.collect()
            if args.cuda:
                torch.cuda.empty_cache()
    return results


if __name__ == "__main__":
    main()
