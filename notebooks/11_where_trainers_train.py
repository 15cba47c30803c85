# %% [markdown]
# # 11 · Where trainers train: distillation, the TRL path and any causal LM
#
# The other notebooks study the loss functions alone. Trainers reach fusedkern by three other roads, and
# this page checks each one on CPU in seconds (Triton's interpreter, tiny shapes, fixed seeds):
#
# 1. **`fusedkern.linear_distillation_loss`**, a student's LM head distilled from a teacher's (forward KL,
#    reverse KL or TRL's generalized JSD with its β) without either model's [T, V] logits: its error against
#    float64 beside PyTorch's own computation in the same dtype, then the memory it saves at real heads —
#    a *model* computed from the chunk rules the function runs with, not a measurement.
# 2. **`fusedkern.integrations.trl`**: TRL 1.16's trainers take their per-token log-probs (or their divergence)
#    from fusedkern's head. Which trainers `patch()` reroutes, read from the live patch; then one small DPO run
#    with TRL's own head and with fusedkern's, step by step.
# 3. **`fusedkern.integrations.transformers.patch`** on any causal LM: 26 architectures, the patched loss and
#    gradients against the unpatched model's.
#
# Everything here is computed when the notebook runs; nothing is read from measured data.

# %% tags=["parameters"]
quick = False  # fewer architectures and DPO steps (a smoke run)
data_dir = "../data"  # unused: everything is computed here (kept for run_all.py's interface)
figures_dir = "../figures"
gpu = "h200"  # unused (kept for run_all.py's interface)
seed = 0
betas = [0.0, 0.5, 1.0]  # forward KL, the generalized JSD's midpoint, reverse KL (TRL's convention)
dtypes = ["float32", "bfloat16", "float16"]
distill_shape = [9, 16, 12, 67]  # [T, H_student, H_teacher, V]: a V of 67 is two 32-column blocks and a tail
chunk_tokens = 4  # several chunks, the last one partial
factor = 2.0  # the accuracy rule: fusedkern's error at most twice PyTorch's same-dtype error, plus atol
atol = {"float32": 1e-6, "bfloat16": 1e-4, "float16": 1e-5}  # as tests/test_distillation.py
# errors are shown as a power of ten at or above them, at least this: fp32's digits below 1e-6 follow the CPU and
# BLAS; in bf16/fp16 the errors are set by rounding to the dtype, not by the CPU
shown_floor = {"float32": 1e-6, "bfloat16": 1e-3, "float16": 1e-4}
memory_tokens = [512, 1024, 2048, 4096, 8192, 16384, 32768, 65536]
memory_dtype_bytes = 2  # bf16 heads
dpo_steps = 3
architectures = None  # None: every case of fusedkern.study.architectures.CASES

# %%
from pathlib import Path

figures_dir = Path(figures_dir)
if quick:
    dtypes = dtypes[:2]
    dpo_steps = 2
    architectures = architectures or ["Llama", "Gemma2", "Cohere", "Phi", "Mixtral"]

# %%
import logging
import warnings

# Triton's interpreter evaluates masked-out lanes too (inf − inf there is harmless), tqdm looks for widgets and
# the tiny models' configs draw Transformers' advice: keep all of it, which names local paths and versions, out
# of the render (before the imports: tqdm warns when imported).
warnings.filterwarnings("ignore")

import matplotlib.pyplot as plt
import pandas as pd
import torch
import transformers
from IPython.display import display

from fusedkern._runtime import interpreting
from fusedkern.study import architectures as arch
from fusedkern.study import distill_accuracy, distill_memory, plotting, tables, trl_path

plotting.use_style()
pd.set_option("display.precision", 3)
transformers.logging.set_verbosity_error()
logging.getLogger("trl").setLevel(logging.ERROR)
print(f"kernels run {'through Triton’s interpreter on CPU' if interpreting() else 'on the GPU'}; "
      f"torch {torch.__version__.split('+')[0]}, transformers {transformers.__version__}")

# %% [markdown]
# ## 1 · Distillation against float64, beside PyTorch in the same dtype
#
# One batch of 9 tokens (about 20 % of the targets ignored), a student head of width 16 and a teacher of
# width 12 over a vocabulary of 67, in chunks of 4 tokens. For each β and dtype: the loss (mean over the
# valid tokens) and the student's dX and dW from `fusedkern.linear_distillation_loss`, from PyTorch's
# materialized computation (`reference.upcast_linear_distillation_loss`: both logits in the inputs' dtype,
# upcast, TRL's `generalized_jsd_loss` formula in fp32) and from the float64 reference. The rule is the
# project's: fusedkern's relative error at most twice PyTorch's, plus a small absolute term.
#
# In bf16 and fp16 both errors are set by the same thing — the gradients are returned in the inputs'
# dtype, and the logits are rounded to it before the loss — so the two columns agree to several digits:
# fusedkern's chunking adds nothing visible to what the dtype costs.

# %%
T, HS, HT, V = distill_shape
errors = pd.DataFrame(distill_accuracy.distillation_errors(
    betas, dtypes, tokens=T, student_hidden=HS, teacher_hidden=HT, vocab=V, seed=seed, chunk_tokens=chunk_tokens,
    device="cpu" if interpreting() else "cuda"))
wide = errors.pivot_table(index=["dtype", "beta", "quantity"], columns="impl", values="rel_err", sort=False)
wide["limit"] = factor * wide["torch"] + wide.index.get_level_values("dtype").map(atol).to_numpy()
wide["within rule"] = wide["fusedkern"] <= wide["limit"]
# shown as bounds: the power of ten at or above each error, at least the dtype's floor (below it the digits
# follow the CPU and the BLAS code path); the exact values are what the rule is applied to
shown = pd.DataFrame({impl: [tables.error_bound(e, shown_floor[d]) for e, d in
                             zip(wide[impl], wide.index.get_level_values("dtype"))]
                      for impl in ("fusedkern", "torch")}, index=wide.index)
shown = shown.unstack("quantity")
shown["within rule (all three)"] = wide["within rule"].groupby(level=["dtype", "beta"], sort=False).all().map(
    {True: "yes", False: "NO"})
display(shown)

# %%
markers = {"fusedkern": ("o", "#d62728"), "torch": ("s", "#7f7f7f")}
labels = {"fusedkern": "fusedkern (chunked)", "torch": "PyTorch materialized (same dtype, fp32 loss)"}
fig, axes = plt.subplots(len(dtypes), 3, figsize=(13, 3.2 * len(dtypes)), layout="constrained", squeeze=False)
for i, dtype in enumerate(dtypes):
    for j, q in enumerate(distill_accuracy.QUANTITIES):
        ax = axes[i, j]
        part = errors[(errors.dtype == dtype) & (errors.quantity == q)]
        for k, impl in enumerate(("fusedkern", "torch")):
            sel = part[part.impl == impl]
            xs = [betas.index(b) + (k - 0.5) * 0.15 for b in sel.beta]
            bound = tables.round_up_log(sel.rel_err.clip(lower=shown_floor[dtype]), steps_per_decade=1)
            marker, color = markers[impl]
            ax.scatter(xs, bound.to_numpy(), marker=marker, color=color, s=30, label=labels[impl])
        ax.set_yscale("log")
        ax.axhspan(shown_floor[dtype] / 100, shown_floor[dtype], color="#e8e8e8", zorder=0,
                   label="rounding noise (at or below the floor)" if (i, j) == (0, 0) else None)
        ax.set_ylim(shown_floor[dtype] / 100, shown_floor[dtype] * 100)
        ax.set_xticks(range(len(betas)), [f"β = {b:g}" for b in betas])
        ax.set_title(f"{dtype} — {q}: relative error vs float64 (bound)")
axes[0, 0].legend(loc="upper left", fontsize=7)
plotting.add_caption(fig, f"T = {T}, H_student = {HS}, H_teacher = {HT}, V = {V}, chunks of {chunk_tokens} tokens, "
                          f"seed {seed}; kernels {'through Triton’s interpreter on CPU' if interpreting() else 'on GPU'}. "
                          "β = 0: forward KL(teacher‖student), β = 1: reverse KL, β = 0.5: generalized JSD (TRL). "
                          "Each error is drawn as the table's bound: the power of ten at or above it, at least "
                          + ", ".join(f"{shown_floor[d]:g} ({d})" for d in dtypes) + ".")
display(plotting.save_figure(fig, figures_dir / "11_distillation_errors"))

# %%
assert wide["within rule"].all(), wide[~wide["within rule"]]

# %% [markdown]
# ## 2 · The memory a fused head saves for distillation (a model)
#
# A materialized distillation loss holds, at its backward's peak, both models' [T, V] logits in the
# inputs' dtype, their fp32 upcasts, both fp32 log-softmaxes, the fp32 gradient of the student's logits and
# its cast back — T·V·(3e + 20) bytes, plus T·V·4 for the generalized JSD's log-mixture
# (`fusedkern/study/distill_memory.py` lists each term). fusedkern holds two [C, V] chunk buffers — both live
# in dW's own storage when several chunks of a bf16 head accumulate dW in fp32 (C = H/2 tokens each) — and then
# the fp32 [V, H] dW accumulator: flat in T. Both sides exclude dX and dW, which every
# implementation returns, and the inputs. These are byte counts from formulas and from the chunk rules
# `linear_distillation_loss` runs with (`fusedkern.chunk_plan`), **not measured peaks**; notebook 03 checks
# the same kind of model for cross-entropy against measurements.

# %%
mem = pd.DataFrame(distill_memory.memory_rows(memory_tokens, elt=memory_dtype_bytes, beta=0.5))
mem["materialized_gib"] = mem.materialized_bytes / 2**30
mem["fusedkern_gib"] = mem.fusedkern_bytes / 2**30
table = mem.pivot_table(index="tokens", columns="head", values=["materialized_gib", "fusedkern_gib", "ratio"],
                        sort=False)
display(table.round(2))

# %%
colors = {"Llama-3-8B": "#1f77b4", "Qwen2.5-7B": "#2ca02c", "Gemma-2-9B": "#9467bd"}
fig, ax = plt.subplots(figsize=(8, 4.8), layout="constrained")
for head, part in mem.groupby("head", sort=False):
    shape = distill_memory.HEADS[head]
    ax.plot(part.tokens, part.materialized_gib, "-", marker="s", ms=4, color=colors[head],
            label=f"{head} (V {shape['vocab']}, H {shape['hidden']}): materialized")
    ax.plot(part.tokens, part.fusedkern_gib, "--", marker="o", ms=4, color=colors[head],
            label=f"{head}: fusedkern chunk buffers + fp32 dW accumulator")
plotting.size_axis(ax, memory_tokens, label="tokens T")
ax.set_yscale("log")
ax.set_ylabel("extra memory, GiB (model)")
ax.set_title("Distillation's extra memory beyond inputs, dX and dW: a model, bf16 heads, β = 0.5")
ax.legend(fontsize=7, loc="upper left")
plotting.add_caption(fig, "Computed by fusedkern.study.distill_memory from formulas and fusedkern.chunk_plan's rules; "
                          "not measured. Materialized: T·V·(3e + 24) bytes at β = 0.5 (e = 2). fusedkern: the student's "
                          "and the teacher's [C, V] buffers (both in dW's storage when several chunks accumulate dW in fp32) and "
                          "the fp32 [V, H] accumulator when there are several chunks.")
display(plotting.save_figure(fig, figures_dir / "11_distillation_memory"))

# %%
at = mem.set_index(["head", "tokens"])
llama_8k = at.loc[("Llama-3-8B", 8192)]
flat_from = {head: int(part.tokens[part.fusedkern_bytes == part.fusedkern_bytes.max()].min())
             for head, part in mem.groupby("head", sort=False)}
print(f"Llama-3 head at 8192 tokens: materialized {llama_8k.materialized_gib:.1f} GiB, fusedkern "
      f"{llama_8k.fusedkern_gib:.2f} GiB ({llama_8k.ratio:.0f}× less); fusedkern's bytes are flat from "
      + ", ".join(f"{t} tokens ({h})" for h, t in flat_from.items()) + " on")

# %% [markdown]
# Below a few thousand tokens the ratio is small — about 2× for Qwen2.5 and Gemma-2 at 1024 tokens, 3.3× for
# Llama-3 at 2048 — where the teacher's buffer first caps the chunk below T: the plan then turns on the fp32
# [V, H] dW accumulator (2–3.4 GiB at these heads), which a single chunk, like the materialized computation,
# does without (its one dW GEMM accumulates in fp32 inside the GEMM). From there fusedkern's side is flat and
# the materialized side grows by V·30 bytes a token: at 8192 tokens the Llama-3 head's materialized
# computation needs about twice the memory of the 8B model's bf16 weights (15 GiB).

# %% [markdown]
# ## 3 · The TRL path
#
# `fusedkern.integrations.trl.patch()` replaces one TRL hook for the trainers whose loss code reads per-token
# log-probs from TRL's fused head, and the loss function of the trainers that compute logits themselves. The
# table is read from the live objects while patched (`fusedkern.study.trl_path.trainer_coverage`): which TRL
# module or class now holds fusedkern's function. What each trainer covers in detail, and what raises
# (`use_weighting=True` in DPO, an encoder-decoder in CPO/ORPO, …),
# is in docs/integrations.md ("TRL"), each case tested in tests/test_integrations_trl.py.

# %%
coverage = pd.DataFrame(trl_path.trainer_coverage())
display(coverage.set_index("trainer"))
assert coverage.fusedkern_now.all(), coverage

# %% [markdown]
# ### One DPO run, TRL's head against fusedkern's
#
# A tiny random Llama (vocab 80, hidden 32, 2 layers, fp32) and 8 random preference pairs, DPO's sigmoid
# loss with a reference model, SGD at learning rate 0.5 (large, so that the steps move the logged numbers),
# batch 2, seed 0; the same weights and data twice, once as TRL builds it and once under `patch()`. Every
# metric is TRL's own code over the head's per-token outputs, so the two runs log the same names; the values
# agree to fp32 rounding (the log-probs are sums of ~10 per-token terms, computed in another order).

# %%
logs, max_param_diff = trl_path.dpo_side_by_side(steps=dpo_steps, seed=seed)
keys = ["loss", "rewards/margins", "rewards/chosen", "logps/chosen", "logps/rejected", "entropy", "grad_norm"]
side = pd.concat({impl: pd.DataFrame(rows).set_index("step")[keys] for impl, rows in logs.items()}, axis=1)
side = side.swaplevel(axis=1)[keys]
display(side.map(lambda v: f"{v:.4f}"))
metrics = sorted(set(logs["trl"][0]) - {"step", "epoch"})
worst = max(abs(f[k] - t[k]) / (1e-4 * abs(t[k]) + 2e-5) for t, f in zip(logs["trl"], logs["fusedkern"])
            for k in metrics)
print(f"{len(metrics)} logged metrics a step, the same names in both runs: "
      f"{sorted(logs['trl'][0]) == sorted(logs['fusedkern'][0])}; every one within 1e-4 relative + 2e-5: "
      f"{worst <= 1}; largest parameter difference after {dpo_steps} steps "
      f"{tables.error_bound(max_param_diff, 1e-6)}")
assert worst <= 1 and max_param_diff < 1e-5

# %% [markdown]
# ## 4 · Any causal LM: 26 architectures, patched against unpatched
#
# `fusedkern.integrations.transformers.patch(model)` has no list of supported classes: it finds the output
# head and the logit transforms the model's forward applies, and refuses what it cannot reproduce. These are
# the cases its detection was tested on (`fusedkern.study.architectures.CASES`, the same as
# tests/test_integrations_architectures.py): tied and untied heads, head biases (Phi, GPT-J), Gemma-2/3's tanh
# softcap, Cohere's `logit_scale`, Granite's `logits_scaling`, MoE routers' auxiliary loss. One tiny random
# model each (1 layer, hidden 32, vocab 64, batch 2 × seq 8, 5 of 16 labels ignored, `num_items_in_batch` 7,
# fp32): one forward and backward unpatched, then patched. "equal" means the loss and every parameter's
# gradient agree within rtol 1e-5, atol 1e-6; differences are shown as bounds (floor 1e-6).

# %%
names = architectures or list(arch.CASES)
rows = pd.DataFrame([arch.patched_vs_unpatched(name) for name in names]).set_index("architecture")
archs = rows[["class", "head", "gradients"]].copy()
archs["loss Δ (relative)"] = rows.loss_rel_diff.map(lambda e: tables.error_bound(e, 1e-6))
archs["largest gradient Δ (relative)"] = rows.grad_rel_diff.map(lambda e: tables.error_bound(e, 1e-6))
archs["equal"] = rows.equal.map({True: "yes", False: "NO"})
display(archs)
print(f"{int(rows.equal.sum())} of {len(rows)} architectures: patched loss and gradients equal the unpatched ones")
assert rows.equal.all(), rows[~rows.equal]

# %% [markdown]
# ## What this page does not show
#
# - Speed and measured memory of distillation on a GPU: the memory above is a model; no distillation
#   sweep has been measured for the study yet.
# - TRL's other trainers run side by side only in the tests (tests/test_integrations_trl.py, ~90 s); one DPO
#   run stands for them here because the notebook must stay a few seconds.
# - The architectures at real sizes: the check is structural (which head, which transforms), which a tiny
#   model exercises fully; numerics at scale are the loss functions' own, studied in notebooks 02–08.
