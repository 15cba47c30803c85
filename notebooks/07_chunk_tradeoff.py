# %% [markdown]
# # 07 · Chunk size, accumulation precision, memory and time
#
# The chunked strategy has two knobs (notebook 01, §5): how many tokens a chunk holds (its logits
# buffer is C·V·2 bytes in bf16: 250.5 MiB at C = 1024, V = 128256) and the dtype the weight
# gradient is accumulated in across chunks (an fp32 [V, H] buffer, 2004 MiB, or the weight's own
# bf16). Each chunk costs one pass of the dW GEMM's output through memory (4.2 GB in fp32,
# 2.1 GB in bf16) and a GEMM tail, so fewer, larger chunks approach the three-GEMM floor — at the
# price of memory; bf16 accumulation rounds the running sum once per chunk, so its error grows with
# the number of chunks. With fp32 accumulation a chunk of up to H = 4096 tokens fits inside dW's own
# bf16 storage (idle until the accumulator is cast into it), so in that mode memory stays at the
# accumulator up to C = 4096, and the default plan takes C = 4096 (or one chunk of all tokens when
# they fit the accumulator's allowance; `fusedkern/chunk_plan.py`). Data: `chunk_study.csv` (full mode, same device call as `ce.csv`, whose
# floor and default-chunk rows it is divided by), `chunk_study_32k.csv` (the lean cells at 32768
# tokens that the first call's time cap cut, with their own floor) and `accuracy.csv`.

# %% tags=["parameters"]
quick = False
data_dir = "../data"
figures_dir = "../figures"
gpu = "h200"
hidden, vocab = 4096, 128256  # the study's LM head (the sidecar's values win when present)

# %%
from pathlib import Path

data_dir, figures_dir = Path(data_dir), Path(figures_dir)
measured = data_dir / "measured" / gpu

# %%
import pandas as pd
from IPython.display import display

from fusedkern.chunk_plan import grad_chunk_plan
from fusedkern.study import plotting, results, tables

plotting.use_style()
ce = results.load_measured(measured / "ce.csv")
study = results.load_measured(measured / "chunk_study.csv")
accuracy = results.load_measured(measured / "accuracy.csv")
have = ce is not None and study is not None

# %%
if have:
    timing = pd.concat([study, ce[ce["provider"].isin(["fusedkern_chunked", "fusedkern_chunked_lean"])]])
    meta = study.attrs["meta"]
    hidden, vocab = int(meta.get("hidden", hidden)), int(meta.get("vocab", vocab))

    def default_chunk(provider, tokens):
        """The chunk the unsuffixed providers ran with: `fusedkern/chunk_plan.py`'s plan."""
        return grad_chunk_plan(tokens, vocab, hidden, 2, need_dw=True,
                               fp32_accum=not provider.endswith("_lean")).chunk_tokens

    table = tables.chunk_tradeoff_table(timing, accuracy, default_chunk=default_chunk, floor=ce)
    table["source"] = "chunk_study.csv + ce.csv"
    sources = "chunk_study.csv + ce.csv + accuracy.csv"
    # the lean cells at 32768 tokens that chunk_study.csv's time cap cut, measured by a later device
    # call with its own floor (each ratio is to the floor of its own run); cells of both stay the first's
    late = results.load_measured(measured / "chunk_study_32k.csv")
    if late is not None:
        extra = tables.chunk_tradeoff_table(late, accuracy, default_chunk=default_chunk, floor=late)
        extra["source"] = "chunk_study_32k.csv"
        table = (pd.concat([table, extra]).drop_duplicates(["accumulation", "chunk_tokens", "tokens"], keep="first")
                 .sort_values(["accumulation", "chunk_tokens", "tokens"]).reset_index(drop=True))
        sources += f" + chunk_study_32k.csv (commit {str(late.attrs['meta'].get('git_commit', '?'))[:7]})"
    caption = results.provenance(study.attrs["meta"], f"data/measured/{gpu}/{sources}")
    print(caption)
    display(table.round({"ms_p50": 2, "ratio": 3, "peak_extra_mib": 1}))

# %%
if have:
    # time and memory at the largest size where both accumulations have every chunk size (a sweep cut
    # by its time cap leaves gaps); the dW error at the accuracy sweep's largest size
    counts = table.groupby("tokens")["chunk_tokens"].count()
    figure_tokens = int(counts[counts == counts.max()].index.max())
    errors = tables.chunk_error_table(accuracy, default_chunk=default_chunk) if accuracy is not None else None
    error_tokens = int(errors["tokens"].max()) if errors is not None and len(errors) else figure_tokens
    torch_err = None
    if accuracy is not None:
        hf = accuracy[(accuracy["provider"] == "huggingface_bf16") & (accuracy["x"] == error_tokens)]
        torch_err = float(hf["err_dw"].iloc[0]) if len(hf) else None
    fig = plotting.chunk_tradeoff_figure(table, tokens=figure_tokens, torch_err_dw=torch_err, caption=caption,
                                         errors=errors, error_tokens=error_tokens)
    display(plotting.save_figure(fig, figures_dir / "07_chunk_tradeoff"))

# %% [markdown]
# ## What the numbers say
#
# Computed from the table, so the text cannot drift from the data.

# %%
if have:
    biggest = figure_tokens
    at = table[table["tokens"] == biggest]
    for accumulation, part in at.groupby("accumulation"):
        best = part.loc[part["ratio"].idxmin()]
        default = part[part["default"]].iloc[0]
        print(f"dW in {accumulation}: default C = {int(default.chunk_tokens)}: {default.ratio:.3f}× with "
              f"{default.peak_extra_mib:.0f} MiB; "
              f"best C = {int(best.chunk_tokens)}: {best.ratio:.3f}× with {best.peak_extra_mib:.0f} MiB "
              f"({biggest} tokens)")
    if errors is not None:
        for accumulation, part in errors[errors["tokens"] == error_tokens].groupby("accumulation"):
            pairs = ", ".join(f"C = {int(c)}: {e:.2e}" for c, e in zip(part.chunk_tokens, part.err_dw))
            print(f"dW relative error at {error_tokens} tokens, {accumulation}: {pairs}"
                  + (f" (PyTorch bf16: {torch_err:.2e})" if torch_err else ""))

# %% [markdown]
# ## Where a chunk's time goes
#
# `probes/probe_rows.py` timed each piece of one chunk alone on the H200: the three GEMMs at the
# chunk's size, the dW GEMM accumulating (β = 1) into a bf16 or an fp32 dW instead of writing it,
# and the row kernel. Adding the pieces predicts the sweep's ratios well — lean (C = 1024, bf16)
# 1.10× against 1.10–1.13× measured (1.08–1.10× in `ce_final.csv`, after the host waits were
# removed); default beyond 9216 tokens (C = 4096, fp32) 1.07× against 1.07× (1.07 / 1.06× at 16384
# and 32768 tokens in `ce_final.csv`) — so these two surcharges *are* the remaining gap to the
# floor. The row kernel streams the
# chunk three times (read for the statistics, read + write for the gradient) at ~3.5 TB/s, close to
# what a device-to-device copy reaches (~3.8–4.1 TB/s in the same probe), so no layout of it can win
# much: the probe's alternatives (other row splits, one program per row with the second pass in
# reverse for L2 hits, row groups sized for L2) were within ±10 % of it or slower at C = 1024; at
# C = 4096 the one-program-per-row layout ran 12 % faster (0.78 against 0.89 ms net), which is 0.5 %
# of that chunk's ~19 ms — a lead not taken (that probe kernel has none of the loss options). The remaining
# ways down are a GEMM whose epilogue computes the row statistics (one fewer pass) and bigger chunks
# (fewer accumulations), which the lean mode's 256 MiB forbids.

# %%
probe_path = measured / "probe_rows.jsonl"
if probe_path.exists():
    costs = tables.chunk_cost_table(pd.read_json(probe_path, lines=True))
    display(costs)
    fig = plotting.chunk_cost_figure(costs, caption=f"data/measured/{gpu}/probe_rows.jsonl (probes/probe_rows.py, "
                                     "H200, bf16, H = 4096, V = 128256; each part timed alone, medians of 15)")
    display(plotting.save_figure(fig, figures_dir / "07_chunk_cost"))
else:
    print(f"Not measured yet: {probe_path.as_posix()} (run probes/probe_rows.py on a GPU)")

# %% [markdown]
# ## Hiding the row kernel under a GEMM: a second CUDA stream
#
# The row kernel is memory-bound and the GEMMs compute-bound, so running one beside the other looks
# free. `probes/probe_overlap.py` tried it on the H200 (`probe_overlap.jsonl`). The prediction,
# written before the run: a large cuBLAS GEMM holds every SM's registers and shared memory, so a
# second kernel's blocks find room only at the GEMM's wave tails — at most 30 % of the row kernel
# hidden, ≤ 1.5 % of a chunk. Measured: nothing hidden at all. A 4096-token logits GEMM and a row
# kernel launched together on two streams took the sum of their times; a chunk split in halves (each
# half's row kernel beside the other half's GEMM) ran within the spread of the shipped order; the
# loss-only pass with double-buffered tiles was at best level with the shipped tiles. The same probe
# found a race in the row kernel: the loss of a row could read the target's logit after another
# program of the row had overwritten it with its gradient (`chunk_check`: a loss 1.0 off with
# identical gradients). The statistics kernel now copies that logit out first; after the fix the two
# orders agree to 2e-6 (`probe_overlap_after_fix.jsonl`).

# %%
overlap_path = measured / "probe_overlap.jsonl"
if overlap_path.exists():
    overlap = pd.read_json(overlap_path, lines=True)
    after_path = measured / "probe_overlap_after_fix.jsonl"
    runs = {"before the fix": overlap} | ({"after the fix": pd.read_json(after_path, lines=True)}
                                         if after_path.exists() else {})
    print("one 4096-token logits GEMM and one row kernel over a [4096, V] chunk, alone and on two streams:")
    display(overlap[overlap.what.isin(["gemm_alone", "rows_alone", "gemm_and_rows_two_streams"])]
            .set_index("what")[["ms_p50", "ms_p20", "ms_p80"]].round(3))
    for name, run in runs.items():
        chunk_rows = run[run.what.str.startswith("chunk_") & (run.what != "chunk_check")]
        print(f"one chunk, shipped order vs split in halves on two streams ({name}):")
        display(chunk_rows.set_index(["C", "what"])[["ms_p50", "ms_p20", "ms_p80"]].round(3))
        print(f"same chunk, the two orders' results compared ({name}):")
        display(run[run.what == "chunk_check"].set_index("C")[["max_loss_diff", "max_dx_diff", "max_dw_diff"]])
    loss_rows = overlap[overlap.what.str.startswith("loss_") & (overlap.what != "loss_cublas_1gemm")]
    print("loss only, × cublas_1gemm of the same process:")
    display(loss_rows.pivot_table(index="what", columns="T", values="ratio", sort=False).round(3))
else:
    print(f"Not measured yet: {overlap_path.as_posix()} (run probes/probe_overlap.py on a GPU)")
