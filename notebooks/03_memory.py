# %% [markdown]
# # 03 · Memory: a model of every provider's peak, next to the measured peaks
#
# What a loss implementation costs in memory is decided by which T×V (tokens × vocab) buffers are
# alive at the same moment. `fusedkern/study/memory_model.py` writes that down term by term for each
# provider; this notebook prints the terms, checks the model against measurements, and plots it
# over tokens (cross-entropy) and batch (SimPO).
#
# **What is counted.** "Peak extra" is the peak allocation during forward + backward *above* the
# inputs (x, W, targets) and the gradients' own storage (dX, dW): the memory an implementation
# adds on top of what any training step holds anyway. The seed pages instead reported the total
# (weights and gradients included, notebook 06), which hides the differences this notebook shows.

# %% tags=["parameters"]
quick = False  # fewer sizes
data_dir = "../data"  # holds measured/<gpu>/ and reference/
figures_dir = "../figures"
gpu = "h200"  # which data/measured/<gpu>/ to read
hidden = 4096
vocab = 128256
dtype = "bfloat16"
tokens = [4096, 8192, 16384, 32768]  # the measured cross-entropy sweep
batch = [2, 4, 8, 16]  # the measured SimPO sweep: rows (chosen + rejected) of `seq` tokens
seq = 1024
model_tokens = [2048, 4096, 8192, 16384, 32768, 65536]  # where the model lines are drawn
breakdown_tokens = 8192  # the size whose terms are listed
ce_providers = ["huggingface_bf16", "torch_fp32_upcast", "liger-kernel 0.4.2", "liger-kernel 0.8.5",
                "cut_cross_entropy", "fusedkern_chunked", "fusedkern_chunked_lean", "fusedkern_fused"]
simpo_providers = ["huggingface_fp32", "torch_fp32_upcast", "liger-kernel 0.8.5", "fusedkern_chunked",
                   "fusedkern_chunked_lean"]

# %%
from pathlib import Path

data_dir, figures_dir = Path(data_dir), Path(figures_dir)
measured_dir = data_dir / "measured" / gpu
anchors_csv = data_dir / "reference" / "h200_anchors_2026-12-02.csv"
if quick:
    model_tokens = [t for t in model_tokens if t in (4096, 32768)] or model_tokens[:2]
    tokens, batch = tokens[:2], batch[:2]

# %%
import matplotlib.pyplot as plt
import pandas as pd

from IPython.display import display

from fusedkern.study import memory_model, plotting, results, tables

plotting.use_style()
pd.set_option("display.float_format", "{:,.2f}".format)
pd.set_option("display.max_colwidth", 80)


def model_frame(providers, xs, *, op, to_tokens=lambda x: x):
    """The model's peak extra MiB for each provider at each x (x → tokens via `to_tokens`)."""
    return pd.DataFrame(
        {"provider": p, "x": x,
         "peak_extra_mib": memory_model.peak_extra_mib(p, to_tokens(x), hidden, vocab, dtype=dtype, op=op, seq=seq)}
        for p in providers for x in xs
    )


# %% [markdown]
# ## Where the memory goes
#
# The terms of each provider's peak at one size (symbols: T tokens, H hidden, V vocab, C rows per
# chunk, e bytes per element of the input dtype). Negative rows are the gradients' storage, which
# the measurement convention subtracts even when the peak comes before the gradients exist (the
# Hugging Face baselines peak inside `log_softmax`'s backward).

# %%
breakdown = pd.concat(
    [pd.DataFrame(memory_model.terms_table(p, breakdown_tokens, hidden, vocab, dtype=dtype)).assign(provider=p)
     for p in ce_providers],
    ignore_index=True,
)
print(f"cross-entropy, T = {breakdown_tokens}, H = {hidden}, V = {vocab}, {dtype}")
breakdown.set_index(["provider", "term"])[["formula", "mib"]]

# %% [markdown]
# Reading the table: the baselines hold three T×V buffers at their peak (in fp32 for the upcast,
# twice the bytes; the SimPO seed's baseline holds four fp32 ones), so they grow linearly with
# tokens. The lean and Liger paths hold one C×V buffer whose size does not depend on T. fusedkern's
# default uses the allowance of one fp32 V×H accumulator (2 GiB at this vocabulary) either way: up
# to 9216 tokens — as at T = 8192 here — all tokens go in one chunk with no accumulator, the buffer
# (C = T) setting the peak; beyond, the fp32 accumulator keeps dW's precision over many chunks and
# the 4096-token buffer lives inside dW's own storage, so the accumulator alone sets the peak
# (last section). The lean variant drops the accumulator and sums in bf16, as Liger does. The fused kernel keeps per-token statistics and an
# fp32 workspace for its gradient accumulators sized so that the two together stay within 16 MiB.

# %%
model_ce = model_frame(ce_providers, model_tokens, op="ce")
table = model_ce[model_ce.x.isin(tokens)].pivot(index="provider", columns="x", values="peak_extra_mib")
table.loc[tables.sort_providers(table.index)].rename_axis(columns="tokens")

# %% [markdown]
# ## The model against independent measurements
#
# The H200 anchors in `data/reference/` were measured before fusedkern existed, with the same
# convention; the model, written from the implementations' source, should reproduce them.

# %%
anchors = pd.read_csv(anchors_csv)
anchor_names = {"cut-cross-entropy 25.1.1 (default filter_eps)": "cut_cross_entropy"}
anchors["provider"] = anchors["provider"].replace(anchor_names)
anchors = anchors[anchors.provider.isin(memory_model.PROVIDERS) & anchors.full_peak_extra_mib.notna()].copy()
anchors["tokens"] = anchors.x.where(anchors.x_name == "tokens", anchors.x * seq)
anchors["model_mib"] = [
    memory_model.peak_extra_mib(r.provider, int(r.tokens), hidden, vocab, dtype=dtype, op=r.op, seq=seq)
    for r in anchors.itertuples()
]
anchors["model / measured"] = anchors.model_mib / anchors.full_peak_extra_mib
check = anchors[["op", "provider", "x_name", "x", "full_peak_extra_mib", "model_mib", "model / measured"]]
check = check.rename(columns={"full_peak_extra_mib": "anchor_mib"})
worst = check.loc[(check["model / measured"] - 1).abs().idxmax()]
print(f"largest relative gap: {worst.provider} ({worst.op}, {worst.x_name} {worst.x}): model {worst.model_mib:.1f} "
      f"vs anchor {worst.anchor_mib:.1f} MiB")
check.sort_values(["op", "provider", "x"]).set_index(["op", "provider", "x"])

# %% [markdown]
# Every modelled provider lands within about 1 % of the anchors (Liger's SimPO: the model misses
# ~17 MiB of compiled-graph temporaries out of 2021), except Cut Cross-Entropy, whose fixed ~1.5 MiB
# workspace the model omits (it counts only the O(T) statistics): a large ratio of tiny numbers.
#
# ## Our measurements
#
# `data/measured/<gpu>/` holds this project's own runs (`python -m fusedkern.bench`); the `full`
# rows shown — the peak extra memory of forward + backward — come from the final runs `ce_final.csv`
# and `simpo_final.csv` (the cell below prints which file each size and mode comes from).

# %%
# each (size, mode) from the newest run that measured it: ce.csv (every mode), ce_final.csv (full and
# loss_only with the final code, every provider)
ce = results.load_measured_runs([measured_dir / "ce.csv", measured_dir / "ce_final.csv"])
# SimPO: three device calls, each (batch, mode) from the newest that measured it (notebook 05)
simpo = results.load_measured_runs([measured_dir / f"{name}.csv" for name in ("simpo", "simpo_8_16", "simpo_final")])
# The fused strategy's memory was re-measured after two fixes that postdate ce.csv (the dX pass's
# workspace was still referenced while the dW pass allocated its own: 32–33 MiB there; then the
# 16 MiB budget made to cover the O(T + V) vectors too): the newest fused run (ce_final.csv when
# present) replaces every fused row (sizes that run did not measure are left out rather than shown stale).
fused_runs = [(f"{name}.csv", results.load_measured(measured_dir / f"{name}.csv"))
              for name in ("fused_mem", "fused_budget", "ce_final") if (measured_dir / f"{name}.csv").exists()]
if ce is not None and fused_runs:
    newest_name, newest = max(fused_runs, key=lambda item: str(item[1].attrs["meta"].get("date_utc", "")))
    fused_full = newest[(newest.provider == "fusedkern_fused") & (newest["mode"] == "full")].assign(source=newest_name)
    stale = ce.provider == "fusedkern_fused"
    print(f"fusedkern_fused memory at tokens {sorted(int(x) for x in fused_full.x)}: from "
          f"{results.provenance(newest.attrs['meta'], newest_name)}")
    meta = ce.attrs["meta"]
    ce = pd.concat([ce[~stale], fused_full], ignore_index=True)
    ce.attrs["meta"] = meta
    ce.attrs["meta"]["sources"].setdefault(newest_name, newest.attrs["meta"])

def measured_full(df):
    """Full-mode peaks of the loss implementations (the GEMM floors are timing references only)."""
    if df is None:
        return None
    keep = (df["mode"] == "full") & df["peak_extra_mib"].notna() & ~df["provider"].str.startswith("cublas_")
    return df[keep][["provider", "x", "peak_extra_mib"]]


def model_vs_measured(df, *, op, to_tokens):
    rows = measured_full(df)
    rows = rows[rows.provider.isin(memory_model.PROVIDERS)].copy()
    rows["model_mib"] = [
        memory_model.peak_extra_mib(r.provider, to_tokens(int(r.x)), hidden, vocab, dtype=dtype, op=op, seq=seq)
        for r in rows.itertuples()
    ]
    rows["model / measured"] = rows.model_mib / rows.peak_extra_mib
    return rows.set_index(["provider", "x"]).sort_index()


for name, df, to_tokens in (("ce", ce, lambda x: x), ("simpo", simpo, lambda b: b * seq)):
    if df is None:
        continue
    print("\n".join(results.runs_provenance(df, f"data/measured/{gpu}")[0]))
    table = model_vs_measured(df, op=name, to_tokens=to_tokens)
    display(table)
    # a gap of more than 5 % and 2 MiB means the model misses (or invents) a buffer: say which
    off = table[((table["model / measured"] - 1).abs() > 0.05) & ((table.model_mib - table.peak_extra_mib).abs() > 2)]
    for provider, part in off.groupby(level="provider"):
        print(f"model off for {provider}: model {part.model_mib.min():.1f}–{part.model_mib.max():.1f} MiB, "
              f"measured {part.peak_extra_mib.min():.1f}–{part.peak_extra_mib.max():.1f} MiB")
    if off.empty:
        print(f"{name}: the model is within 5 % (or 2 MiB) of every measured peak")

# %% [markdown]
# ## Over tokens and batch
#
# Lines: the model. Hollow markers: our measurements (when present). Crosses: the H200 reference
# anchors. The y axis is logarithmic: the baselines' peaks grow with tokens while the chunked and
# fused implementations stay flat.

# %%
fig, (ax_ce, ax_simpo) = plt.subplots(1, 2, figsize=(13, 5.2), layout="constrained")
ref_ce = anchors[anchors.op == "ce"].rename(columns={"full_peak_extra_mib": "peak_extra_mib"})
plotting.plot_memory(ax_ce, model_ce, measured_full(ce), reference=ref_ce[["provider", "x", "peak_extra_mib"]],
                     measured_label=f"measured ({gpu}, this project)", reference_label="H200 anchor (reference)")
ax_ce.set_xlabel(f"tokens (H = {hidden}, V = {vocab}, {dtype})")
ax_ce.set_title("Cross-entropy: peak extra memory, forward + backward")

model_simpo = model_frame(simpo_providers, batch, op="simpo", to_tokens=lambda b: b * seq)
ref_simpo = anchors[anchors.op == "simpo"].rename(columns={"full_peak_extra_mib": "peak_extra_mib"})
plotting.plot_memory(ax_simpo, model_simpo, measured_full(simpo),
                     reference=ref_simpo[["provider", "x", "peak_extra_mib"]],
                     measured_label=f"measured ({gpu}, this project)", reference_label="H200 anchor (reference)")
ax_simpo.set_xlabel(f"batch (rows of {seq} tokens, chosen + rejected)")
ax_simpo.set_title("SimPO: peak extra memory, forward + backward")

sources = [results.runs_provenance(df, f"data/measured/{gpu}")[1] for df in (ce, simpo) if df is not None]
caption = ("Model: fusedkern/study/memory_model.py. Reference anchors: data/reference/h200_anchors_2026-12-02.csv "
           "(H200, torch 2.11, measured before this project). ")
caption += ("Measured: " + " | ".join(sources)) if sources else "No measurement of this project's own yet."
plotting.add_caption(fig, caption)
plotting.save_figure(fig, figures_dir / "03_memory")

# %% [markdown]
# The chunked implementations' memory is set by the chunk (C·V) and, for fusedkern's default, the
# fp32 dW accumulator allowance — constants in T. fusedkern's default spends that allowance on one
# chunk of every token while T·V·2 fits it (1002 MiB at 4096 tokens), then on the fp32 accumulator
# with a 4096-token buffer inside dW's own storage (2004 MiB from 9280 tokens on). At 32768 tokens
# the model puts the bf16 baseline at 22 GiB extra and the fp32 upcast at 46 GiB, fusedkern's
# default at 2 GiB, its lean path at 250 MiB and the fused one at ≤ 16 MiB (`ce.csv` measured it at
# 33 MiB: the backward kept its dX workspace alive while the dW pass allocated its own; the newer
# runs, after that fix and the budget covering the O(T + V) vectors too, measure 13–15 MiB).
# Which to choose is a latency question: notebooks 04 and 05.

# %% [markdown]
# ## Past one GPU: a vocabulary-parallel head, per rank
#
# With the head's rows split over N ranks (`fusedkern.distributed`, docs/design.md "Vocabulary
# parallelism"), each rank runs the single-GPU plan on its V/N rows, and the ranks exchange only per-token
# row statistics: one all-reduce per chunk of (3P + 1) fp32 values per token, P the power of two ≥ N ·
# slices per row. dX's all-reduce (T·H·e bytes) is the same for every vocabulary-parallel implementation
# and dominates the traffic; what differs is the memory each rank keeps. The Megatron-style baseline
# (`scripts/bench_vocab_parallel.py`, plain PyTorch) holds the fp32 upcast of its [T, V/N] logits and the
# working copy that becomes the saved softmax; fusedkern holds one bounded chunk and, by default, the fp32
# dW accumulator of its shard. Model only: the multi-GPU measurement waits for a machine with several GPUs.

# %%
vp = pd.DataFrame([memory_model.vocab_parallel_per_rank(t, hidden, vocab, n, dtype)
                   for n in (1, 2, 4, 8) for t in tokens])
vp_table = pd.DataFrame({
    "ranks": vp.world_size, "tokens": vp.tokens, "rows per rank": vp.shard_rows,
    "stats exchange (KiB)": vp.exchange_bytes / 1024, "Megatron's (KiB)": vp.megatron_exchange_bytes / 1024,
    "dX all-reduce (MiB)": vp.dx_bytes / 2**20, "stats / dX (%)": 100 * vp.exchange_bytes / vp.dx_bytes,
    "fusedkern extra (MiB)": vp.fusedkern_extra_bytes / 2**20,
    "Megatron-style extra (MiB)": vp.megatron_extra_bytes / 2**20,
})
display(vp_table.round(1))

# %%
fig, ax = plt.subplots(figsize=(7.5, 4.6), layout="constrained")
for column, style in (("fusedkern_extra_bytes", dict(marker="o", label="fusedkern (default, fp32 dW)")),
                      ("megatron_extra_bytes", dict(marker="s", ls="--", label="Megatron-style, plain PyTorch"))):
    for t, alpha in zip(tokens, (0.4, 0.6, 0.8, 1.0)):
        part = vp[vp.tokens == t]
        ax.plot(part.world_size, part[column] / 2**30, alpha=alpha, color="C0" if "fused" in column else "C3",
                **(style if t == tokens[-1] else {k: v for k, v in style.items() if k != "label"}))
        if column == "megatron_extra_bytes":
            ax.annotate(f"{t} tok", (part.world_size.iloc[0], part[column].iloc[0] / 2**30), fontsize=8,
                        xytext=(4, 0), textcoords="offset points")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xticks([1, 2, 4, 8], ["1", "2", "4", "8"])
ax.set_xlabel(f"ranks sharing the vocabulary (V = {vocab}, H = {hidden}, {dtype})")
ax.set_ylabel("peak extra memory per rank (GiB)")
ax.set_title("Vocabulary-parallel head: memory per rank (model)")
ax.legend(loc="lower left")
plotting.add_caption(fig, "Model: fusedkern/study/memory_model.py (vocab_parallel_per_rank); lighter lines: fewer tokens "
                          f"({', '.join(map(str, tokens))}).")
plotting.save_figure(fig, figures_dir / "03_vocab_parallel_memory")
