# %% [markdown]
# # 10 · One training step: fusedkern, Transformers, Liger and CCE in a real optimizer step
#
# The other notebooks time the loss alone. Here the LM head and its loss sit inside a whole training
# step: `examples/train_sft.py --preset llama3-8b-2l`, a Llama-3-8B-shaped model (vocab 128256,
# hidden 4096, intermediate 14336, 32 heads / 8 KV heads) cut to **2 decoder layers** so that it fits
# one GPU with room for the unfused head; sequences of **8192 tokens**, **micro-batch 2 × gradient
# accumulation 2** (32768 tokens an optimizer step), **bf16 autocast over fp32 weights**, SDPA
# attention, **AdamW**. The data are synthetic SFT pairs: the prompt span and the padding are ignored
# (`-100`), about **50 % of the targets**. Every loss divides the sum over its targets by the step's
# count (`num_items_in_batch`), so all four runs take the same gradient.
#
# Only the head + loss differs between the rows (same seed, init and data):
#
# | impl | what computes the head and the loss |
# |---|---|
# | `fusedkern` | `fusedkern.integrations.transformers.patch(model)`: chunked over tokens, dW accumulated in fp32 |
# | `hf` | the unpatched model: bf16 logits, Transformers' own loss |
# | `liger` | Liger-Kernel 0.8.5's fused linear cross-entropy, applied to the head only |
# | `cce` | cut-cross-entropy 25.1.1's `linear_cross_entropy`; the 25.1.1 wheel has no `cce_patch`, so the model's forward calls the function as `cce_patch` would (column `head_patch`) |
#
# The table was measured on an **H100 80GB**, not on the H200 of the other notebooks
# (`data/measured/h100/README.md`), by `scripts/h200_train_table.sh` (retired; git history keeps it): one
# process per implementation (protocol `sequential`, so each peak memory is its own), in a shuffled order, 3 warm-up
# and 8 timed optimizer steps each. The model states alone — fp32 weights, fp32 gradients and AdamW's two fp32
# moments, 16 B a parameter — are computed below from the shapes; everything above them is
# activations, the head's working memory and the allocator.

# %% tags=["parameters"]
quick = False  # nothing to cut: one four-row table and one figure (kept for run_all.py's interface)
data_dir = "../data"
figures_dir = "../figures"
gpu = "h200"  # the study's GPU: its folder is read first, if it holds a training table
train_gpu = "h100"  # where the training table was measured (data/measured/h100/README.md)
train_table = "train_table.csv"
warmup_steps = 3  # the run's --warmup-steps (not a CSV column)
shapes = {"vocab": 128256, "hidden": 4096, "intermediate": 14336, "heads": 32, "kv_heads": 8}  # the llama3-8b-2l preset
impl_order = ["fusedkern", "liger", "cce", "hf"]
trl_table = "train_trl_table.csv"  # TRL's trainers on small models (scripts/gpu_train_table.sh, issue 43)
breakdown_table = "step_time_breakdown.csv"  # one profiled SFT step (scripts/gpu_step_profile.py)
# the head shapes' floors and per-token heads, timed side by side (data/measured/h100/README.md), newest first
side_by_side_files = ["side_by_side_1207b.csv", "side_by_side_1207.csv"]
side_by_side_phase = "before"  # the training table's phase whose head those files timed (b4ffb48's)

# %%
from pathlib import Path

data_dir, figures_dir = Path(data_dir), Path(figures_dir)
candidates = [data_dir / "measured" / g / train_table for g in dict.fromkeys([gpu, train_gpu])]
csv_path = next((p for p in candidates if p.exists()), None)
where = None if csv_path is None else f"data/measured/{csv_path.parent.name}/{train_table}"

# %%
import matplotlib.pyplot as plt
import pandas as pd
from IPython.display import Markdown, display
from matplotlib.patches import Patch

from fusedkern.study import plotting, step_profile

plotting.use_style()
pd.set_option("display.precision", 3)

STYLE_KEY = {"fusedkern": "fusedkern_chunked", "hf": "huggingface_bf16", "liger": "liger-kernel 0.8.5",
             "cce": "cut_cross_entropy"}  # colors shared with the other notebooks' figures

train = pd.read_csv(csv_path) if csv_path is not None else None
have = train is not None and len(train) > 0
if not have:
    print(f"Not measured yet: no {train_table} in " + " or ".join(p.parent.as_posix() for p in candidates)
          + ", so the table, the figure and the observations below are skipped (examples/train_sft.py --preset "
          "llama3-8b-2l writes its rows, one process per implementation).")
else:
    order = [i for i in impl_order if i in set(train.loss_impl)] + sorted(set(train.loss_impl) - set(impl_order))
    train = train.set_index("loss_impl").loc[order]
    first = train.iloc[0]
    tokens_per_step = int(first.batch_size * first.grad_accum * first.seq_len)
    labels = {"fusedkern": "fusedkern", "hf": "Transformers (bf16 logits)",
              "liger": f"Liger {first.liger_kernel} (fused head)", "cce": f"CCE {first.cut_cross_entropy}"}
    train["label"] = [labels.get(i, i) for i in train.index]
    train["short"] = [labels.get(i, i).split(" (")[0] for i in train.index]  # for the sentences below
    # tokens/s at the median step (the CSV's, from the unrounded p50) and at the p80 / p20 step times (the
    # slower step gives the lower rate)
    train["tok_s_p50"] = train.tokens_per_s
    assert ((tokens_per_step / (train.step_ms_p50 / 1e3)) / train.tokens_per_s - 1).abs().max() < 1e-4
    train["tok_s_lo"] = tokens_per_step / (train.step_ms_p80 / 1e3)
    train["tok_s_hi"] = tokens_per_step / (train.step_ms_p20 / 1e3)
    train["peak_gib"] = train.peak_mib / 1024
    steps = warmup_steps + int(first.steps_timed)
    for column in ("preset", "layers", "seq_len", "batch_size", "grad_accum", "protocol", "workload", "device",
                   "torch", "triton", "transformers", "commit", "autocast", "attention"):
        values = sorted(set(map(str, train[column])))
        print(f"{column}: {', '.join(values)}" + ("" if len(values) == 1 else "   <- differs between rows"))
    caption = (f"examples/train_sft.py --preset {first.preset} ({int(first.layers)} layers, seq {int(first.seq_len)}, "
               f"micro-batch {int(first.batch_size)} × grad-accum {int(first.grad_accum)}, {first.autocast}, AdamW) "
               f"on one {first.device}; {where}, protocol {first.protocol} (one process per implementation), "
               f"{int(first.steps_timed)} timed steps after {warmup_steps} warm-up; torch {first.torch}, "
               f"triton {first.triton}, transformers {first.transformers}; commit {first.commit}.")

# %%
# the model states: every parameter in fp32 with an fp32 gradient and AdamW's two fp32 moments
if have:
    h, kv = shapes["hidden"], shapes["hidden"] * shapes["kv_heads"] // shapes["heads"]
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * shapes["intermediate"] + 2 * h  # q, o; k, v; MLP; two norms
    n_params = 2 * shapes["vocab"] * h + int(first.layers) * per_layer + h  # embedding, head (untied), final norm
    states_gib = 16 * n_params / 2**30
    print(f"{n_params / 1e6:.1f} M parameters ({int(first.layers)} layers of {per_layer / 1e6:.1f} M, embedding "
          f"and head {shapes['vocab'] * h / 1e6:.1f} M each): 16 B each = {states_gib:.1f} GiB of model states")

# %% [markdown]
# ## The table
#
# Tokens/s counts every token of the step (ignored targets included: 32768 a step) at the median
# step time; the brackets are the p20–p80 step times over the timed steps. Peak GiB is
# `torch.cuda.max_memory_allocated` over the timed steps. *fp32 dW* says whether the head's weight
# gradient is accumulated in fp32 before it reaches the fp32 weight's `.grad` (column `dw_accum`
# says how; printed under the table). The losses are the step losses of step 1 and step
# 11 (after 10 AdamW updates).

# %%
if have:
    table = pd.DataFrame({
        "tokens/s": train.tok_s_p50.round(0).astype(int),
        "step ms p50 [p20–p80]": [f"{r.step_ms_p50:.1f} [{r.step_ms_p20:.1f}–{r.step_ms_p80:.1f}]"
                                  for r in train.itertuples()],
        "peak GiB": train.peak_gib.round(1),
        "fp32 dW": train.fp32_dw,
        "first loss": train.first_loss.round(4),
        f"final loss (step {steps})": train.final_loss.round(4),
    }).set_axis(pd.Index(train.label, name="impl"))
    display(table)
    for impl, r in train.iterrows():
        print(f"{impl:<10} head: {r.head_patch}\n{'':<10} dW:   {r.dw_accum}")

# %%
if have:
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.6), layout="constrained")
    xs = range(len(train))
    colors = [plotting.style_for(STYLE_KEY.get(i, i))["color"] for i in train.index]
    hatches = ["" if v == "yes" else "//" for v in train.fp32_dw]
    bars = ax_t.bar(xs, train.tok_s_p50 / 1e3, color=colors, hatch=hatches, edgecolor="white", linewidth=0.8,
                    yerr=[(train.tok_s_p50 - train.tok_s_lo) / 1e3, (train.tok_s_hi - train.tok_s_p50) / 1e3],
                    capsize=4, error_kw=dict(ecolor="0.2", linewidth=1))
    ax_t.bar_label(bars, labels=[f"{v / 1e3:.1f}k" for v in train.tok_s_p50], padding=3, fontsize=8)
    ax_t.set_ylabel("tokens/s, thousands (median; whiskers: p20–p80)")
    ax_t.set_title(f"Throughput ({tokens_per_step} tokens an optimizer step)")
    bars = ax_m.bar(xs, train.peak_gib, color=colors, hatch=hatches, edgecolor="white", linewidth=0.8)
    ax_m.bar_label(bars, labels=[f"{v:.1f}" for v in train.peak_gib], padding=3, fontsize=8)
    ax_m.axhline(states_gib, color="black", linestyle="--", linewidth=1,
                 label=f"model states: {states_gib:.1f} GiB (fp32 weights, grads, AdamW m and v)")
    ax_m.legend(loc="upper left", fontsize=7.5)
    ax_m.set_ylabel("peak GiB allocated (timed steps)")
    ax_m.set_title("Peak memory")
    for ax in (ax_t, ax_m):
        ax.set_xticks(list(xs), [label.replace(" (", "\n(") for label in train.label], fontsize=8.5)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.08)
        ax.grid(axis="x", visible=False)
    fig.legend(handles=[Patch(facecolor="0.6", edgecolor="white", label="head dW accumulated in fp32"),
                        Patch(facecolor="0.6", edgecolor="white", hatch="//", label="head dW not in fp32 (see dw_accum)")],
               loc="outside upper center", ncol=2, fontsize=8,
               title=f"One training step, Llama-3-8B shapes with {int(first.layers)} layers, {first.device}",
               title_fontproperties={"size": 11})
    plotting.add_caption(fig, caption)
    display(plotting.save_figure(fig, figures_dir / "10_training_step"))

# %% [markdown]
# ## What the data say
#
# Computed from the table above (the sentences are formatted from it, not typed in):

# %%
if have:
    ours = train.loc["fusedkern"] if "fusedkern" in train.index else None
    others = train.drop(index="fusedkern", errors="ignore")
    lines = []
    if ours is not None and len(others):
        best = others.tok_s_p50.idxmax()
        speed = ours.tok_s_p50 / others.loc[best, "tok_s_p50"]
        overlap = ours.tok_s_lo <= others.loc[best, "tok_s_hi"]
        lines.append(
            f"- **Throughput.** fusedkern runs {ours.tok_s_p50:,.0f} tokens/s, **{speed:.2f}×** the fastest other "
            f"implementation, {others.loc[best, 'short']} ({others.loc[best, 'tok_s_p50']:,.0f} tokens/s); its "
            f"p20–p80 range {'overlaps' if overlap else 'does not overlap'} that one's. Against the rest: "
            + ", ".join(f"{r.short} {ours.tok_s_p50 / r.tok_s_p50:.2f}×" for i, r in others.iterrows() if i != best)
            + ".")
        fp32 = others[others.fp32_dw == "yes"]
        rest = others[others.fp32_dw != "yes"]
        if len(fp32):
            lines.append(
                f"- **Memory, against the others that keep dW in fp32** ({', '.join(fp32.short)}): fusedkern's peak "
                f"{ours.peak_gib:.1f} GiB is "
                + ", ".join(f"{ours.peak_mib / r.peak_mib:.3f}× {r.short}'s {r.peak_gib:.1f} GiB" for r in fp32.itertuples())
                + f"; fusedkern's peak is {ours.peak_gib - states_gib:.1f} GiB above the {states_gib:.1f} GiB of "
                  f"model states. Against those without fp32 dW: "
                + ", ".join(f"{r.short} {r.peak_gib:.1f} GiB (fusedkern {ours.peak_mib / r.peak_mib:.2f}× that)"
                            for r in rest.itertuples())
                + ".")
    # the losses: same seed, init and data, so the first losses agree; which final loss stands apart?
    first_spread = train.first_loss.max() - train.first_loss.min()
    apart = {i: abs(train.final_loss[i] - train.final_loss.drop(index=i).median()) for i in train.index}
    odd = max(apart, key=apart.get)
    rest_final = train.final_loss.drop(index=odd)
    lines.append(
        f"- **Losses.** The first losses agree to {first_spread:.1e} (same seed, init and data under bf16 autocast). "
        f"After {steps} steps: " + ", ".join(f"{r.short} {r.final_loss:.3f}" for r in train.itertuples())
        + f". {train.loc[odd, 'short']} stands apart: {train.loc[odd, 'final_loss']:.2f} against "
          f"{rest_final.min():.2f}–{rest_final.max():.2f} for the others, whose losses went "
        + ("down" if (train.first_loss - train.final_loss).drop(index=odd).gt(0).all() else "both ways")
        + f" by {(train.first_loss - train.final_loss).drop(index=odd).min():.3f}–"
          f"{(train.first_loss - train.final_loss).drop(index=odd).max():.3f}, while its own went "
        + ("up" if train.loc[odd, "final_loss"] > train.loc[odd, "first_loss"] else "down")
        + f" by {abs(train.loc[odd, 'final_loss'] - train.loc[odd, 'first_loss']):.2f}.")
    if odd == "cce":
        lines.append(
            "- **Why CCE's loss differs: a hypothesis, not shown here.** cut-cross-entropy accumulates the head's "
            "dW in bf16 (partial products of every token block lock-added into a bf16 buffer, cast to fp32 at the "
            "end) and by default (`filter_eps=\"high\"`) skips the blocks whose gradient it deems small. Either "
            "could bias the head's update step after step. The Transformers row also hands a bf16 dW to the fp32 "
            "weight, but from one GEMM that accumulates in fp32 over all tokens, and its loss follows the fp32-dW "
            "rows — which points at the accumulation across blocks or the filtering rather than at bf16 storage "
            "alone. Not tested: a CCE run with `filter_eps=None` (and one with an fp32 dW accumulator) would tell; "
            "this is one run of 11 steps on random weights and synthetic data, one seed.")
    display(Markdown("\n".join(lines)))

# %% [markdown]
# ## What these data do not show
#
# - **One run each, 8 timed steps**, under one protocol: the p20–p80 brackets are the only measure of
#   spread; a second call could move the second digit of the ratios.
# - **Measured on the H100**, not the H200 of notebooks 02–08: absolute tokens/s do not carry over;
#   ratios between these rows do (same process layout, same card).
# - **A 2-layer model**: the head's share of the step is far larger than in the full 32-layer
#   Llama-3-8B, so the head's speed-up is diluted there; the memory saved by a fused head (the
#   unfused logits and their gradients) is the same in GiB but a smaller share of the peak.
# - **Random weights and synthetic data, 11 steps**: the losses compare the implementations with
#   each other, not how well any of them trains.

# %% [markdown]
# ## In TRL: SFT, DPO and a GRPO loss step on models whose head is a large share
#
# `scripts/gpu_train_table.sh` trains inside TRL 1.16's own trainers: SFTTrainer on full sequences, DPOTrainer with
# half of each sequence prompt and a frozen reference copy, and GRPOTrainer's own loss on fixed completions and
# advantages (no generation). The models are a **Qwen3-0.6B-shaped** one (28 layers, hidden 1024, vocabulary 151936,
# tied embeddings) and a **Llama-3.2-1B-shaped** one (16 layers, hidden 2048, vocabulary 128256, tied), at random
# init from local checkpoints (the Llama-3-8B head with 2 layers of the table above can join them: DPO). Sequences
# of 2048 tokens, 32768 tokens an optimizer step, the largest micro-batch that fits (halved from an estimate while a
# run runs out of memory; gradient accumulation makes up the rest), bf16 autocast on fp32 weights, AdamW; one
# process per run, in a shuffled order. Four rows each:
#
# | row | what computes what |
# |---|---|
# | `trl` | TRL's own fused LM head (its default), PyTorch's layers |
# | `trl_liger` | TRL's head, Liger's layer kernels (`use_liger_kernel=True`: RoPE, RMSNorm, SwiGLU) |
# | `fusedkern` | fusedkern's head (`fusedkern.integrations.trl.patch()`), PyTorch's layers |
# | `fusedkern_liger` | fusedkern's head and Liger's layer kernels |
#
# The targets (issue 47), on every step: **fusedkern ≥ 1.05× TRL's head**, and **fusedkern + Liger's layers ≥ 1.04×
# TRL + Liger's layers**. The file's `phase` column names the tree a row measures: `before` is main at b4ffb48,
# before the head kernels that issue 47 asks for; `after` is main at 840b693, where `impl="auto"` takes the anchored
# pass on Hopper (so far the Qwen3-0.6B-shaped model, TRL's head and fusedkern only).

# %%
ROW_ORDER = ["trl", "trl_liger", "fusedkern", "fusedkern_liger"]
ROW_LABEL = {"trl": "TRL's head", "trl_liger": "TRL's head + Liger's layers", "fusedkern": "fusedkern",
             "fusedkern_liger": "fusedkern + Liger's layers"}
ROW_COLOR = {"trl": plotting.style_for("trl 1.16.0 fused LM head")["color"],
             "trl_liger": plotting.style_for("liger-kernel 0.8.5")["color"],
             "fusedkern": plotting.style_for("fusedkern_chunked")["color"],
             "fusedkern_liger": plotting.style_for("fusedkern_chunked_counted")["color"]}
TARGETS = {"fusedkern": ("trl", 1.05), "fusedkern_liger": ("trl_liger", 1.04)}  # row: (its baseline, target ratio)
STEP_ORDER = ["sft", "dpo", "grpo"]
trl_candidates = [data_dir / "measured" / g / trl_table for g in dict.fromkeys([train_gpu, gpu])]
trl_path = next((p for p in trl_candidates if p.exists()), None)
runs = pd.read_csv(trl_path, keep_default_na=False) if trl_path is not None else None
have_trl = runs is not None and len(runs) > 0
if not have_trl:
    display(Markdown(
        f"**Not yet measured.** There is no `{trl_table}` in "
        + " or ".join(f"`data/measured/{p.parent.name}`" for p in trl_candidates)
        + ": `scripts/gpu_train_table.sh OUTDIR` writes it on a GPU (its header gives the device calls and the "
          "wheels they carry). The table, the figure and the targets' verdicts appear here once it is committed."))
else:
    trl_where = f"data/measured/{trl_path.parent.name}/{trl_table}"
    if "phase" not in runs.columns:
        runs["phase"] = ""
    runs["phase"] = runs.phase.replace("", "unnamed")
    runs["tok_s"] = runs.tokens_per_s.astype(float)
    runs["peak_gib"] = pd.to_numeric(runs.peak_mib, errors="coerce") / 1024
    key = ["phase", "model", "step"]
    speed = runs.set_index([*key, "row"]).tok_s
    runs["vs_trl"] = [r.tok_s / speed.get((r.phase, r.model, r.step, "trl"), float("nan")) for r in runs.itertuples()]
    # each target row against its own baseline (fusedkern: TRL's head; fusedkern + Liger: TRL + Liger)
    runs["vs_base"] = [r.tok_s / speed.get((r.phase, r.model, r.step, TARGETS[r.row][0]), float("nan"))
                       if r.row in TARGETS else float("nan") for r in runs.itertuples()]
    phases = list(dict.fromkeys(runs.phase))
    models = list(dict.fromkeys(runs.model))
    groups = sorted(dict.fromkeys(zip(runs.phase, runs.model, runs.step)),
                    key=lambda g: (phases.index(g[0]), models.index(g[1]), STEP_ORDER.index(g[2])))
    runs["row_rank"] = [ROW_ORDER.index(r) if r in ROW_ORDER else len(ROW_ORDER) for r in runs.row]
    runs = runs.sort_values(["row_rank"], kind="stable").reset_index(drop=True)
    first = runs.iloc[0]
    for column in ("phase", "commit", "seq_len", "tokens_per_step", "protocol", "device", "torch", "triton",
                   "transformers", "trl", "liger_kernel", "autocast", "attention", "optimizer"):
        values = sorted(set(map(str, runs[column])))
        print(f"{column}: {', '.join(values)}" + ("" if len(values) == 1 else "   <- differs between rows"))
    trl_caption = (f"scripts/gpu_train_table.sh on one {first.device}; {trl_where}, protocol {first.protocol} (one "
                   f"process per run), {int(first.steps_timed)} timed steps after {int(first.warmup_steps)} warm-up; "
                   f"seq {int(first.seq_len)}, {first.autocast}, {first.optimizer}; torch {first.torch}, triton "
                   f"{first.triton}, transformers {first.transformers}, trl {first.trl}, liger-kernel "
                   f"{first.liger_kernel}; phases: "
                   + ", ".join(f"{p} ({', '.join(sorted(set(runs[runs.phase == p].commit)))})" for p in phases) + ".")

    def group_label(phase, model, step):
        return f"{model} {step}" + (f" ({phase})" if len(phases) > 1 else "")

# %% [markdown]
# Tokens/s counts every token of the optimizer step (prompts included) at the median step time; × TRL is against
# the `trl` row of the same model, step and phase, × its baseline is each target row against the row its target
# names (fusedkern against TRL's head, fusedkern + Liger against TRL + Liger); peak GiB is
# `torch.cuda.max_memory_allocated` over the timed steps; the micro-batch (sequences, DPO: pairs) is the largest that
# fitted, × the gradient accumulation steps. The losses are the logged step losses of the first and the last step
# (same seed, init and data in every row).

# %%
if have_trl:
    order = {g: i for i, g in enumerate(groups)}
    shown = runs.assign(group=[order[(p, m, s)] for p, m, s in zip(runs.phase, runs.model, runs.step)])
    shown = shown.sort_values(["group", "row_rank"]).reset_index(drop=True)
    display(pd.DataFrame({
        "tokens/s": shown.tok_s.round(0).astype(int).values,
        "× TRL's head": shown.vs_trl.round(3).values,
        "× its baseline": [f"{v:.3f}" if v == v else "" for v in shown.vs_base],
        "peak GiB": shown.peak_gib.round(1).values,
        "micro-batch × accum": [f"{int(r.micro_batch)} × {int(r.grad_accum)}" for r in shown.itertuples()],
        "first loss": shown.first_loss.astype(float).round(4).values,
        "final loss": shown.final_loss.astype(float).round(4).values,
    }, index=pd.MultiIndex.from_arrays([[group_label(*groups[g]) for g in shown.group],
                                        [ROW_LABEL.get(r, r) for r in shown.row]], names=["model, step", "row"])))

# %%
if have_trl:
    fig, (ax_r, ax_m) = plt.subplots(1, 2, figsize=(13, 0.9 + 0.75 * len(groups)), layout="constrained")
    rows_present = [r for r in ROW_ORDER if r in set(runs.row)]
    height = 0.8 / len(rows_present)
    for i, group in enumerate(groups):
        part = runs[(runs.phase == group[0]) & (runs.model == group[1]) & (runs.step == group[2])].set_index("row")
        for j, row in enumerate(rows_present):
            if row not in part.index:
                continue
            y = i + (j - (len(rows_present) - 1) / 2) * height
            r = part.loc[row]
            label = ROW_LABEL[row] if i == 0 else None
            # bars from 1 (TRL's head) to the ratio: the difference is what the bar's length shows
            ax_r.barh(y, r.vs_trl - 1, left=1, height=height * 0.92, color=ROW_COLOR[row], label=label)
            goal = 0.0
            if row in TARGETS and TARGETS[row][0] in part.index:  # where the row's target puts it
                goal = part.loc[TARGETS[row][0], "vs_trl"] * TARGETS[row][1]
                ax_r.plot([goal] * 2, [y - height / 2, y + height / 2], color="black", linewidth=1.6,
                          label="the target (issue 47)" if i == 0 and row == "fusedkern" else None)
            ax_r.text(max(r.vs_trl, 1, goal) + 0.006, y, f"{r.vs_trl:.3f}× ({r.tok_s / 1e3:.1f}k/s)", va="center",
                      fontsize=7)
            ax_m.barh(y, r.peak_gib, height=height * 0.92, color=ROW_COLOR[row])
            ax_m.text(r.peak_gib + 0.3, y, f"{r.peak_gib:.1f} (mb {int(r.micro_batch)})", va="center", fontsize=7)
    for ax in (ax_r, ax_m):
        ax.set_yticks(range(len(groups)), [group_label(*g).replace(" ", "\n", 1) for g in groups], fontsize=8.5)
        ax.set_ylim(len(groups) - 0.5, -0.5)
        ax.grid(axis="y", visible=False)
    ax_r.axvline(1.0, color="black", linestyle="--", linewidth=1.0)
    ax_r.set_xlim(min(0.9, runs.vs_trl.min() - 0.03), runs.vs_trl.max() * 1.05 + 0.2)
    ax_r.set_xlabel("tokens/s ÷ TRL's head's (same model and step; median step)")
    ax_r.set_title("Throughput against TRL's own head")
    ax_m.set_xlim(0, runs.peak_gib.max() * 1.25)
    ax_m.set_xlabel("peak GiB allocated (timed steps); mb: the micro-batch that fitted")
    ax_m.set_title("Peak memory")
    fig.legend(*ax_r.get_legend_handles_labels(), loc="outside upper center", ncol=5, fontsize=8,
               title="TRL 1.16's trainers, seq 2048, bf16 autocast: the head's implementation and Liger's layers",
               title_fontproperties={"size": 11})
    plotting.add_caption(fig, trl_caption)
    display(plotting.save_figure(fig, figures_dir / "10_training_step_trl"))

# %% [markdown]
# The targets' verdicts, step by step, and what they add up to:

# %%
if have_trl:
    lines, verdicts = [], []
    for group in groups:
        part = runs[(runs.phase == group[0]) & (runs.model == group[1]) & (runs.step == group[2])].set_index("row")
        said = []
        for row, (base, goal) in TARGETS.items():
            if row in part.index and base in part.index:
                ratio = part.loc[row, "vs_base"]
                verdicts.append((group[0], row, ratio >= goal))
                said.append(f"{ROW_LABEL[row]} {ratio:.3f}× {ROW_LABEL[base]} (target ≥ {goal}: "
                            + ("**met**" if ratio >= goal else "**missed**") + ")")
        firsts = part.first_loss.astype(float)
        said.append(f"first losses agree to {firsts.max() - firsts.min():.1e}")
        lines.append(f"- **{group_label(*group)}.** " + "; ".join(said) + ".")
    for phase in phases:
        # a phase may measure only some rows (a later tree's first call): each verdict counts the steps it has
        said, absent = [], []
        for row, (base, goal) in TARGETS.items():
            met = [m for p, r, m in verdicts if p == phase and r == row]
            if not met:
                absent.append(ROW_LABEL[row])
                continue
            ratios = runs[(runs.phase == phase) & (runs.row == row)].vs_base.dropna()
            said.append(f"{ROW_LABEL[row]} meets its ≥ {goal}× on {sum(met)} of {len(met)} steps (at "
                        f"{ratios.min():.3f}–{ratios.max():.3f}× {ROW_LABEL[base]})")
        plain = ("every target met on every step" if all(m for p, _, m in verdicts if p == phase) else
                 "the targets are **missed**: " + ", ".join(said))
        if absent:
            plain += f"; not measured in this phase: {', '.join(absent)}"
        lines.append(f"- **Phase {phase}**: {plain}.")
    display(Markdown("\n".join(lines)))

# %% [markdown]
# ## Where a step's time goes, and what the head can buy
#
# A training step is the head *and* everything else: the decoder layers (their GEMMs, norms, RoPE, MLP), the
# attention, the optimizer and the trainer's own work. `scripts/gpu_step_profile.py` profiles one SFT optimizer step
# of each small model with `torch.profiler` (the same models, data, trainer and micro-batches as the table above,
# after two warm-up steps) and puts every kernel in one category (`fusedkern/study/step_profile.py`): the head's
# GEMMs, the head's other kernels (everything the causal LM's forward runs outside its backbone, forward and
# backward), attention, the decoder layers' other kernels, the optimizer, and the rest (embedding, final norm, the
# trainer's loss code, gradient accumulation, clipping, copies). Beside it, it times the head's three-GEMM floor over
# the step's tokens in the same process.
#
# **Amdahl's bound**: if the head ran *at* its floor and nothing else changed, a step of T ms whose head takes h ms
# would take T − h + floor: the step's speed-up is at most T / (T − h + floor). That is the whole prize a faster head
# can give a step; everything else in the step is the layers', the attention's and the optimizer's.

# %%
CATEGORY_COLOR = {"head_gemm": "#b2182b", "head_other": "#ef8a62", "attention": "#67a9cf",
                  "layers_other": "#2166ac", "optimizer": "#7f7f7f", "rest": "#d9d9d9"}
breakdown_path = data_dir / "measured" / train_gpu / breakdown_table
breakdown = pd.read_csv(breakdown_path, keep_default_na=False) if breakdown_path.exists() else None
have_breakdown = breakdown is not None and len(breakdown) > 0
if not have_breakdown:
    display(Markdown(
        f"**Not yet measured.** There is no `{breakdown_table}` in `data/measured/{train_gpu}`: "
        "`scripts/gpu_step_profile.py --checkpoints DIR --out step_time_breakdown.csv` writes it on a GPU (with the "
        "wheels of the training table). Until then the bound below is an estimate from the head's microbenchmarks, "
        "not a profile of the step."))
else:
    breakdown["kernel_ms"] = breakdown.kernel_ms.astype(float)
    if "gpu_busy_ms" not in breakdown.columns:  # files profiled before the GPU's busy time was measured
        breakdown["gpu_busy_ms"] = ""
    floor_rows = breakdown[breakdown.category == step_profile.FLOOR_CATEGORY]
    floors = floor_rows.set_index("model").kernel_ms
    floors_by_phase = floor_rows.set_index(["phase", "model"]).kernel_ms
    parts = breakdown[breakdown.category != step_profile.FLOOR_CATEGORY]
    for column in ("phase", "commit", "device", "torch", "triton", "transformers", "trl", "liger_kernel"):
        print(f"{column}: {', '.join(sorted(set(map(str, breakdown[column]))))}")

# %%
if have_breakdown:
    bd_models = list(dict.fromkeys(parts.model))
    bd_phases = list(dict.fromkeys(parts.phase))
    # rows profiled before step_profile left the named ranges out of `rest` hold their spans there (the note says
    # how many ms no operator claimed): those are the forward's kernels counted again, not time, so they go
    unclaimed_ms = parts.note.str.extract(r"includes ([0-9.]+) ms of device kernels no operator claims")[0]
    stale = (parts.category == "rest") & (parts.gpu_busy_ms == "") & unclaimed_ms.notna()
    parts = parts.assign(kernel_ms=parts.kernel_ms - unclaimed_ms.astype(float).where(stale, 0.0))
    fig, axes = plt.subplots(1, len(bd_models), figsize=(6.5 * len(bd_models), 1.2 + 0.5 * len(bd_phases) * 4),
                             layout="constrained", squeeze=False)
    summary = []
    for ax, model in zip(axes[0], bd_models):
        mine = parts[parts.model == model].pivot_table(index=["phase", "row"], columns="category", values="kernel_ms",
                                                       aggfunc="sum")
        order = [(p, r) for p in bd_phases for r in ROW_ORDER if (p, r) in mine.index]
        mine = mine.loc[order, list(step_profile.CATEGORIES)]
        left = pd.Series(0.0, index=mine.index)
        for category in step_profile.CATEGORIES:
            ax.barh(range(len(mine)), mine[category], left=left, color=CATEGORY_COLOR[category],
                    label=step_profile.LABELS[category] if model == bd_models[0] else None)
            left += mine[category]
        floor = floors[floors.index == model]
        walls = parts[parts.model == model].groupby(["phase", "row"]).step_wall_ms.first().astype(float)
        # where the profile measured the GPU's busy time: the rest of the profiled step's wall time, the GPU idle
        busy = parts[parts.model == model].groupby(["phase", "row"]).gpu_busy_ms.first()
        idle = pd.Series({key: walls[key] - float(busy[key]) for key in mine.index if busy.get(key, "") != ""},
                         dtype=float).reindex(mine.index, fill_value=0.0)
        ax.barh(range(len(mine)), idle, left=left, color="white", edgecolor="0.45", hatch="///", linewidth=0.5,
                label="GPU idle, waiting on the host (profiled step)" if model == bd_models[0] else None)
        left += idle
        for y, (key, r) in enumerate(mine.iterrows()):
            head = r.head_gemm + r.head_other
            phase_floor = float(floors_by_phase.get((key[0], model), floor.iloc[0]))
            # the head's kernels run on the step's one stream, so the wall time loses what they lose
            bound = step_profile.amdahl_bound(walls[key], head, phase_floor)
            summary.append((key[0], model, key[1], walls[key], head, phase_floor, bound, left[key] - idle[key]))
            ax.text(left[key] * 1.01, y, f"head {head:.0f} ms = {head / phase_floor:.2f}× its floor, "
                    f"{head / walls[key]:.0%} of the step; at its floor: ≤ {bound:.3f}×", va="center", fontsize=7.5)
        ax.set_yticks(range(len(mine)), [f"{ROW_LABEL[row]} ({phase})" for phase, row in mine.index], fontsize=8)
        ax.set_ylim(len(mine) - 0.5, -0.5)
        ax.set_xlim(0, left.max() * 1.6)
        ax.set_xlabel("kernel time in one optimizer step (and the GPU's idle time where measured), ms")
        ax.set_title(f"{model}: SFT, one step (head's 3-GEMM floor {floor.iloc[0]:.0f} ms)", fontsize=10)
        ax.grid(axis="y", visible=False)
    fig.legend(loc="outside upper center", ncol=4, fontsize=8)
    plotting.add_caption(fig, f"scripts/gpu_step_profile.py on one {breakdown.device.iloc[0]}; "
                              f"data/measured/{train_gpu}/{breakdown_table} (torch.profiler, one SFT optimizer step "
                              "after two warm-up steps; the floor timed in the same process; phases: "
                              + ", ".join(f"{p} ({', '.join(sorted(set(parts[parts.phase == p].commit)))})"
                                          for p in bd_phases)
                              + "). The bound: step / (step − head + floor), on the profiled step's wall time.")
    display(plotting.save_figure(fig, figures_dir / "10_step_time_breakdown"))
    bounds = pd.DataFrame(summary, columns=["phase", "model", "row", "step wall ms", "head ms", "floor ms",
                                            "Amdahl bound", "step kernel ms"])
    display(bounds.round(3).set_index(["phase", "model", "row"]))
    display(Markdown(
        "**How the bars are counted.** Each category is the kernels its operators launched. The profiler also puts "
        "the named ranges that `step_profile.scope_hooks` opens (around the model, its backbone and each layer) on "
        "the device's timeline; the rows profiled before `step_profile` left them out counted their spans as "
        "kernels no operator claims (about 0.35–0.5 s a step, the forward counted again). Those spans are taken "
        "out of `rest` here, from each row's note; rows profiled since carry the GPU's busy time (`gpu_busy_ms`, "
        "the union of the kernels' intervals) instead."))

# %% [markdown]
# The same bound from the head's microbenchmarks (in the profile's place until it is committed): the head's three-GEMM floor and the
# per-token head with a gradient (what TRL's SFT runs, fusedkern's `linear_logprobs` with the entropy at τ 0.7)
# timed side by side in one process on the same head shapes (`side_by_side_1207b.csv`, the Qwen3-0.6B-shaped head;
# `side_by_side_1207.csv`, the Llama-3.2-1B-shaped one; both on the H100, weights N(0, 0.02²)), scaled linearly to
# the step's 32768 tokens, against the SFT steps of the table. It estimates the head's time in the step from a
# microbenchmark; the profile above measures it.

# %%
def head_at_shape(hidden, vocab):
    """(floor ms a token, fusedkern's per-token head with a gradient × that floor, file, tokens) at the largest size
    a committed side-by-side file timed for this head, or None."""
    check = "logprobs_train" + ("" if (hidden, vocab) == (4096, 128256) else f"_h{hidden}_v{vocab}")
    for name in side_by_side_files:
        path = data_dir / "measured" / train_gpu / name
        if not path.exists():
            continue
        sbs = pd.read_csv(path, keep_default_na=False)
        sbs = sbs[sbs.check == check]
        if sbs.empty:
            continue
        x = int(sbs.x.max())
        at = sbs[sbs.x == x].set_index("provider").ms_p50.astype(float)
        return at["floor_3gemm"] / x, at["fk"] / at["floor_3gemm"], name, x
    return None


estimates = []  # (model, row, head share of the step, Amdahl's bound): from the microbenchmarks
if have_trl:
    lines = []
    # a later phase runs another head, whose ratio to the floor these files did not time
    sft = runs[(runs.step == "sft") & runs.row.isin(["fusedkern", "fusedkern_liger"])
               & (runs.phase == side_by_side_phase)]
    for (phase, model), part in sft.groupby(["phase", "model"], sort=False):
        found = head_at_shape(int(part.hidden.iloc[0]), int(part.vocab.iloc[0]))
        if found is None:
            lines.append(f"- **{model}**: no side-by-side timing of its head is committed: no estimate.")
            continue
        per_token, ratio, source, x = found
        tokens = int(part.tokens_per_step.iloc[0])
        floor, head = per_token * tokens, per_token * tokens * ratio
        said = []
        for r in part.itertuples():
            step_ms = float(r.step_ms_p50)
            bound = step_profile.amdahl_bound(step_ms, head, floor)
            estimates.append((model, r.row, head / step_ms, bound))
            said.append(f"{ROW_LABEL[r.row]}: head ≈ {head / step_ms:.0%} of a {step_ms:.0f} ms step, bound "
                        f"**{bound:.3f}×**")
        lines.append(f"- **{model}** ({phase}; H {int(part.hidden.iloc[0])}, V {int(part.vocab.iloc[0])}): the floor "
                     f"{floor:.0f} ms over {tokens} tokens, the head ≈ {ratio:.2f}× that = {head:.0f} ms "
                     f"(`{source}`, {x} tokens); " + "; ".join(said) + ".")
    display(Markdown("\n".join(lines)))

# %% [markdown]
# ## What the head can buy, and what it cannot

# %%
if have_trl:
    if have_breakdown:
        # the bound is what a head at its floor would buy over the head the table's first phase ran
        shares = [(m, row, head / total, bound) for phase, m, row, total, head, floor, bound, _ in summary
                  if row.startswith("fusedkern") and phase == bd_phases[0]]
        how = f"profiled, phase {bd_phases[0]}"
    else:
        shares, how = estimates, "estimated from the microbenchmarks"
    def span(values, fmt):
        """"a–b" of a series, or "a" when its ends agree at this format."""
        low, high = format(values.min(), fmt), format(values.max(), fmt)
        return low if low == high else f"{low}–{high}"

    plain = pd.DataFrame(shares, columns=["model", "row", "share", "bound"])
    with_liger, without = plain[plain.row.str.endswith("liger")], plain[~plain.row.str.endswith("liger")]
    liger_gain = runs[runs.row == "trl_liger"].vs_trl
    lines = []
    if len(plain):
        lines.append(
            f"- **The head is a small part of the step** ({how}): {span(without.share, '.0%')} of an SFT step with "
            f"PyTorch's layers, {span(with_liger.share, '.0%')} with Liger's. A head *at* its floor would make those "
            f"steps at most {span(without.bound, '.3f')}× faster without Liger's layers and "
            f"{span(with_liger.bound, '.3f')}× with them: the whole prize a faster head can give.")
        latest = runs[(runs.phase == phases[-1]) & (runs.row == "fusedkern")].vs_base
        lines.append(
            "- **So the targets of issue 47 (≥ 1.05× TRL's head, ≥ 1.04× TRL + Liger, on every step) need most of "
            f"the head's excess over its floor gone.** In phase {phases[-1]} fusedkern's head runs the steps at "
            f"{span(latest, '.3f')}× TRL's own head.")
        short = [(m, row, b) for m, row, _, b in shares if b < TARGETS[row][1]]
        if short:
            lines.append(
                "- **Out of reach even at the floor**: " + "; ".join(
                    f"{m} SFT, {ROW_LABEL[row]}: ≤ {b:.3f}× against a target of {TARGETS[row][1]}×"
                    for m, row, b in short)
                + ". There a head at its floor would not meet the target alone (the bound is against fusedkern's "
                  "own step, which is within "
                + f"{(runs[(runs.phase == phases[-1]) & (runs.step == 'sft')].vs_base - 1).abs().max():.1%} of its "
                  "baseline's in these SFT rows).")
    lines.append(
        f"- **What the head cannot buy is the rest of the step**: Liger's layer kernels alone moved the same steps "
        f"by {span(liger_gain, '.2f')}× over TRL's head with PyTorch's layers, because the "
        "decoder layers, not the head, hold most of a step's time on these models.")
    display(Markdown("\n".join(lines)))
