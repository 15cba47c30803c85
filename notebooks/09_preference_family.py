# %% [markdown]
# # 09 · The preference family: one per-token core, three GEMMs
#
# `fusedkern.linear_preference_loss` computes TRL's preference losses over an LM head without the
# [tokens, vocab] logits: DPO's `sigmoid`, `ipo`, `hinge` and `robust`, CPO, SimPO, ORPO and KTO
# (formulas and the TRL functions they were checked against: `fusedkern/preference.py`). This
# notebook first derives, in float64 on CPU, why all eight share one per-token gradient core — and
# why that lets a chunk of logits form its gradient in the forward pass (three GEMMs, not four).
# Then it reads the H100 sweep of every loss type against the three-GEMM floor, TRL's materialized
# fp32 computation and Liger-Kernel 0.8.5's chunked losses.
#
# Sections: (1) the shared core, checked against autograd; (2) when a chunk holds a whole pair;
# (3) the measured time ÷ floor per loss type; (4) peak extra memory; then what the data say.

# %% tags=["parameters"]
quick = False  # the float64 checks, the tables and the ratio figure only (no memory figure)
data_dir = "../data"
figures_dir = "../figures"
gpu = "h200"  # run_all's GPU folder; the preference sweep exists only under pref_gpu below
pref_gpu = "h100"  # the preference sweep was measured on an H100 80GB (data/measured/h100/README.md)
sweep = "preference_shuffled"  # data/measured/<pref_gpu>/<sweep>.csv (+ .json sidecar)
target = 1.10  # the target: time ÷ the three-GEMM floor
loss_types = ["sigmoid", "ipo", "hinge", "robust", "cpo", "simpo", "orpo", "kto"]
liger = "liger-kernel 0.8.5 ref-free"  # Liger's provider name in the CSV (reference-free, see section 3)
shown_providers = ["fusedkern_chunked", "fusedkern_chunked_lean", "trl_fp32", liger]
check_pairs, check_seq = 3, 5  # section 1: B pairs (2B rows) of S tokens

# %%
from pathlib import Path

data_dir, figures_dir = Path(data_dir), Path(figures_dir)
where = f"data/measured/{pref_gpu}"
csv_path = data_dir / "measured" / pref_gpu / f"{sweep}.csv"

# %%
import matplotlib.pyplot as plt
import pandas as pd
import torch
import torch.nn.functional as F
from IPython.display import display

from fusedkern import preference, reference
from fusedkern.formula import grouped_plan
from fusedkern.study import plotting, results, tables

plotting.use_style()
pd.set_option("display.precision", 3)
labels = {"fusedkern_chunked": "fusedkern default", "fusedkern_chunked_lean": "fusedkern lean (bf16 dW)"}


def label(provider: str) -> str:
    return labels.get(provider, plotting.label_for(provider))


# %% [markdown]
# ## (1) The shared per-token core
#
# Each loss reads the policy's per-token target log-probs ℓ_{r,t} = log softmax(z_{r,t})[y_{r,t}]
# only through two statistics per row r (a response): its sum S_r = Σ_t ℓ_{r,t} over the response
# tokens and its token count n_r (a constant of the targets), or the average A_r = S_r / n_r. So
#
# ∂L/∂ℓ_{r,t} = c_r  for every response token t of row r (0 on ignored tokens), with c_r = ∂L/∂S_r,
#
# and since ∂ℓ_t/∂z_t = onehot(y_t) − softmax(z_t), the logits gradient is
#
# **∂L/∂z_t = g_t · (softmax(z_t) − onehot(y_t)),  g_t = −c_{r(t)}**
#
# — cross-entropy's gradient scaled per token. c_r depends only on row r's pair (its own and its
# partner's S and n), on constants (reference log-probs, β, γ, ε, KTO's detached KL) and, for the
# NLL term of CPO/SimPO/ORPO, on N_w = the number of chosen tokens in the batch, known from the
# targets. With σ the logistic function, B pairs (rows w = chosen, l = its rejected partner),
# Δ = (S_w − S_w^ref) − (S_l − S_l^ref), and `d` the derivative of the per-pair loss in its argument:
#
# | loss_type | per-pair loss (mean over B pairs) | c_w | c_l |
# |---|---|---|---|
# | `sigmoid` (DPO) | −(1−ε)logσ(βΔ) − ε logσ(−βΔ) | d·β/B, d = −(1−ε)σ(−βΔ) + εσ(βΔ) | −c_w |
# | `robust` | (−(1−ε)logσ(βΔ) + ε logσ(−βΔ))/(1−2ε) | d·β/B, d = −((1−ε)σ(−βΔ) + εσ(βΔ))/(1−2ε) | −c_w |
# | `hinge` | relu(1 − βΔ) | −β·[1 − βΔ > 0]/B | −c_w |
# | `ipo` | (Δ_avg − 1/(2β))², log-ratios divided by n | 2(Δ_avg − 1/(2β))/(B n_w) | −2(Δ_avg − 1/(2β))/(B n_l) |
# | `cpo` | smoothed −logσ(β(S_w − S_l)) + α·NLL | d·β/B − α/N_w | −d·β/B |
# | `simpo` | smoothed −logσ(β(A_w − A_l) − γ) + α·NLL | d·β/(B n_w) − α/N_w | −d·β/(B n_l) |
# | `orpo` | −β logσ(o) + α·NLL, o = (A_w − A_l) − (log(1−e^{A_w}) − log(1−e^{A_l})) | −βσ(−o)/((1−e^{A_w}) B n_w) − α/N_w | βσ(−o)/((1−e^{A_l}) B n_l) |
# | `kto` (N unpaired sequences) | w_d σ(−β(r − z₀)) or w_u σ(β(r − z₀)), r = S − S^ref | ∓β w σ(β(r − z₀))σ(−β(r − z₀))/N (− desirable, + undesirable) | — |
#
# (`smoothed` is the sigmoid row's form, with `d` as there; NLL = −Σ_chosen S_w / N_w.) The cell
# below writes each c from these formulas and compares it with autograd's gradient of
# `fusedkern.preference.preference_loss_from_logps` with respect to the per-token log-probs, in
# float64, on random log-probs with a random prompt prefix ignored in every row. The loss itself is
# checked against the independent float64 reference `fusedkern.reference.preference_from_logprobs`.

# %%
sig = torch.sigmoid
gen = torch.Generator().manual_seed(0)
B, S, R = check_pairs, check_seq, 2 * check_pairs
logps0 = -3.0 * torch.rand(R, S, generator=gen, dtype=torch.float64) - 0.05  # ℓ < 0
prompt = torch.randint(0, S - 1, (R,), generator=gen)  # each row ignores a random prefix, keeps ≥ 1 token
mask = torch.arange(S)[None, :] >= prompt[:, None]
n = mask.sum(-1).to(torch.float64)
ref = -2.0 * n + 0.5 * torch.randn(R, generator=gen, dtype=torch.float64)  # summed reference log-probs
kto_labels = torch.tensor([True, False, True, True, False, False])
kl = torch.tensor([0.3], dtype=torch.float64)
beta, gamma, eps = 0.5, 0.5, 0.1  # β larger than TRL's 0.1 so that every σ here is far from 0 and 1


def loss_args(loss_type):
    kw = dict(loss_type=loss_type, beta=beta)
    if loss_type in preference.DPO_LOSS_TYPES:
        kw.update(ref_chosen_logps=ref[:B], ref_rejected_logps=ref[B:])
    if loss_type in ("sigmoid", "robust", "cpo", "simpo"):
        kw.update(label_smoothing=eps)
    if loss_type == "simpo":
        kw.update(gamma=gamma)
    if loss_type == "kto":
        kw.update(ref_logps=ref, kto_labels=kto_labels, kl=kl)
    return kw


def c_formula(loss_type, logps):
    """c_r = ∂L/∂S_r from the table above (α = 1 for cpo/simpo/orpo, w_d = w_u = 1)."""
    s = torch.where(mask, logps, 0.0).sum(-1)
    a = s / n
    if loss_type == "kto":
        x = beta * (s - ref - kl.clamp(min=0))
        slope = beta * sig(x) * sig(-x) / R
        return torch.where(kto_labels, -slope, slope)
    nw, nl, Nw = n[:B], n[B:], n[:B].sum()
    alpha = preference.DEFAULT_ALPHA.get(loss_type, 0.0)
    nll = -alpha / Nw
    if loss_type in ("sigmoid", "robust", "hinge"):
        delta = (s[:B] - ref[:B]) - (s[B:] - ref[B:])
        z = beta * delta
        d = {"sigmoid": -(1 - eps) * sig(-z) + eps * sig(z),
             "robust": -((1 - eps) * sig(-z) + eps * sig(z)) / (1 - 2 * eps),
             "hinge": -((1 - z) > 0).to(z.dtype)}[loss_type]
        cw = d * beta / B
        cl = -cw
    elif loss_type == "ipo":
        delta = (s[:B] - ref[:B]) / nw - (s[B:] - ref[B:]) / nl
        d = 2 * (delta - 1 / (2 * beta))
        cw, cl = d / (B * nw), -d / (B * nl)
    elif loss_type == "cpo":
        z = beta * (s[:B] - s[B:])
        d = -(1 - eps) * sig(-z) + eps * sig(z)
        cw, cl = d * beta / B + nll, -d * beta / B
    elif loss_type == "simpo":
        z = beta * (a[:B] - a[B:]) - gamma
        d = -(1 - eps) * sig(-z) + eps * sig(z)
        cw, cl = d * beta / (B * nw) + nll, -d * beta / (B * nl)
    else:  # orpo
        aw, al = a[:B], a[B:]
        o = (aw - al) - (preference.log1mexp(aw) - preference.log1mexp(al))
        cw = -beta * sig(-o) / ((1 - aw.exp()) * B * nw) + nll
        cl = beta * sig(-o) / ((1 - al.exp()) * B * nl)
    return torch.cat([cw, cl])


rows = []
for loss_type in loss_types:
    logps = logps0.clone().requires_grad_(True)
    loss, _ = preference.preference_loss_from_logps(logps, mask, **loss_args(loss_type))
    (grad,) = torch.autograd.grad(loss, logps)
    c = c_formula(loss_type, logps0)
    per_token = torch.where(mask, c[:, None].expand(R, S), 0.0)
    ref_loss, _ = reference.preference_from_logprobs(logps0, mask, **loss_args(loss_type))
    grad_err = float((grad - per_token).abs().max() / grad.abs().max())
    loss_err = float((loss.detach() - ref_loss).abs() / ref_loss.abs())
    constant = bool(all(torch.unique(grad[r][mask[r]]).numel() == 1 for r in range(R)))
    rows.append(dict(loss_type=loss_type, loss=float(loss.detach()), max_abs_c=float(c.abs().max()),
                     **{"one upstream value per row": constant,
                        "|autograd − formula| / max": tables.error_bound(grad_err, 1e-15),
                        "|loss − reference| / |loss|": tables.error_bound(loss_err, 1e-15)}))
    assert constant and grad_err < 1e-12 and loss_err < 1e-12, (loss_type, grad_err, loss_err)
print(f"float64, B = {B} pairs ({R} rows; KTO: {R} unpaired sequences), S = {S} tokens, β = {beta}, "
      f"ε = {eps} (sigmoid, robust, cpo, simpo), γ = {gamma}, KTO KL = {float(kl):g}")
display(pd.DataFrame(rows).set_index("loss_type").round(4))

# %% [markdown]
# And through the logits: with a small vocabulary (V = 11), autograd's ∂L/∂z of
# log_softmax → gather → the loss equals g_t·(softmax − onehot), g_t = −c_r from the formulas.

# %%
V = 11
z0 = 2.0 * torch.randn(R, S, V, generator=gen, dtype=torch.float64)
y = torch.randint(0, V, (R, S), generator=gen)
probs, onehot = z0.softmax(-1), F.one_hot(y, V).to(torch.float64)
logit_errors = {}
for loss_type in loss_types:
    z = z0.clone().requires_grad_(True)
    lp = z.log_softmax(-1).gather(-1, y[..., None]).squeeze(-1)
    loss, _ = preference.preference_loss_from_logps(lp, mask, **loss_args(loss_type))
    (dz,) = torch.autograd.grad(loss, z)
    g = torch.where(mask, -c_formula(loss_type, lp.detach())[:, None].expand(R, S), 0.0)
    expected = g[..., None] * (probs - onehot)
    logit_errors[loss_type] = float((dz - expected).abs().max() / dz.abs().max())
    assert logit_errors[loss_type] < 1e-12, (loss_type, logit_errors[loss_type])
print("max |autograd ∂L/∂z − g·(softmax − onehot)| / max |∂L/∂z|:")
print("  " + ", ".join(f"{k} {tables.error_bound(v, 1e-15)}" for k, v in logit_errors.items()))

# %% [markdown]
# ## (2) Why this permits three GEMMs — and when it does not
#
# The fused cross-entropy computes, per chunk of tokens, the logits (GEMM 1), then softmax − onehot
# in place, then dX = G·W (GEMM 2) and dW += Gᵀ·X (GEMM 3), and drops the logits. For a preference
# loss, G = g·(softmax − onehot) needs g, and g needs the pair's two sums S_w, S_l: it is known in
# the forward only when **the chunk holds both rows of a pair** (KTO: one sequence). Otherwise the
# path falls back to four GEMMs: a forward that keeps only the log-sum-exp and the target logit
# (GEMM 1), autograd through the O(R·S) tail for g, and a backward that recomputes the logits
# (GEMM 2) before dX and dW (GEMMs 3 and 4). Unlike `linear_simpo_loss`, `linear_preference_loss`
# has no 3.5-GEMM prepass mode (notebook 05).
#
# `fusedkern.formula.grouped_plan` decides; here it is asked for the measured shapes
# (seq 1024, the Llama-3 head: V 128256, H 4096, bf16), for the default (fp32 dW accumulation) and
# the lean mode (dW in bf16, ≤ 256 MiB of logits buffer: 1024-token chunks). A weight on the meta
# device suffices, nothing is allocated.

# %%
w_meta = torch.empty(128256, 4096, dtype=torch.bfloat16, device="meta")
plan_rows = []
for mode, accum in (("default", "fp32"), ("lean", "weight_dtype")):
    for paired, what in ((True, "pairs (7 types)"), (False, "KTO")):
        for batch in (2, 4, 8, 16):
            per_chunk, grad_plan = grouped_plan(batch, 1024, paired, w_meta, True, accum, None)
            plan_rows.append(dict(mode=mode, loss=what, batch=batch, chunk_tokens=grad_plan.chunk_tokens,
                                  groups_per_chunk=per_chunk, GEMMs=3 if per_chunk else 4))
plans = pd.DataFrame(plan_rows)
display(plans.pivot_table(index=["mode", "loss"], columns="batch", values=["chunk_tokens", "GEMMs"],
                          aggfunc="first"))

# %% [markdown]
# The lean mode's 1024-token chunk cannot hold a 2048-token pair, so every pair loss in lean mode
# runs four GEMMs (expect ≈ 4/3 of the default's time, plus the fallback's own overheads), while
# KTO's single 1024-token sequences fit a lean chunk and keep three. That is what section 3 shows.

# %% [markdown]
# ## (3) Measured: time ÷ the three-GEMM floor
#
# `python -m fusedkern.bench preference` (the command is in the sidecar JSON) on one NVIDIA H100
# 80GB — not the H200 of the other notebooks, so only ratios formed within this file are
# meaningful — batch 2, 4, 8, 16 rows of 1024 tokens (chosen + rejected: batch 2 is one pair; KTO
# sees the rows as unpaired sequences), hidden 4096, vocab 128256, bf16, forward + backward,
# shuffled protocol. The floor (`cublas_3gemm`: logits, dX, dW over all tokens) was timed once per
# batch in the same rounds as every loss type (its `loss_type` is `all`), and `tables.ratio_to`
# divides every loss type's rows by it.
#
# Liger's DPO (`sigmoid`, `hinge`, `robust`) and KTO rows are **reference-free**: Liger 0.8.5 takes
# no reference log-prob tensors (only a reference model's hidden states and head), so the sweep ran
# it with `use_ref_model=False` — the same GEMM work as fusedkern given precomputed reference
# log-probs, but a different loss value. Liger has no IPO (its DPO raises for `ipo`): no Liger row
# there.

# %%
df = results.load_measured(csv_path)
have = df is not None
if not have:
    print("run_all.py does not measure this sweep: it comes from `scripts/gpu_calls.sh OUT preference` "
          "(`python -m fusedkern.bench preference ...`, data/measured/h100/README.md). Sections 3 and 4 are skipped.")
if have:
    meta = df.attrs["meta"]
    df = df[df["mode"] == "full"]
    caption = results.provenance(meta, f"{where}/{sweep}.csv (protocol {meta.get('protocol')})")
    print(caption)
    print("command:", meta.get("command"))
    print("providers:", ", ".join(tables.sort_providers(df.provider)), "| loss types:",
          ", ".join(sorted(set(df.loss_type))))
    ratios = tables.ratio_to(df, "cublas_3gemm")
    ratios = ratios[ratios.provider != "cublas_3gemm"]
    # the floor row ("all") divided every loss type's rows of the same batch, never another batch's
    assert set(ratios.loss_type) <= set(loss_types) and len(ratios) == (df.provider != "cublas_3gemm").sum()
    ratio_table = ratios.pivot_table(index=["loss_type", "provider"], columns="x", values="ratio", aggfunc="first")
    ratio_table = ratio_table.reindex([(lt, p) for lt in loss_types for p in tables.sort_providers(ratios.provider)
                                       if (lt, p) in ratio_table.index])
    ratio_table.columns.name = "batch"
    floors = df[df.provider == "cublas_3gemm"].set_index("x")["ms_p50"]
    print("the floor, median ms per batch: " + ", ".join(f"{int(x)}: {v:.1f}" for x, v in floors.items()))
    print("forward + backward ÷ the 3-GEMM floor of the same batch:")
    display(ratio_table.round(2))

# %%
if have:
    present = [lt for lt in loss_types if lt in set(ratios.loss_type)]
    shown = ratios[ratios.provider.isin(shown_providers)]
    ylim = (0.9, float(shown.ratio.max()) * 1.08)
    ncols = 4
    nrows = -(-len(present) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(15, 3.4 * nrows + 0.8), layout="constrained",
                             sharey=True, squeeze=False)
    for ax, loss_type in zip(axes.flat, present):
        part = shown[shown.loss_type == loss_type]
        plotting.plot_ratios(ax, part, annotate=["fusedkern_chunked"], direct_labels=False, ylim=ylim,
                             guides={f"issue target {target:.2f}×": target}, labels=labels)
        ax.set_title(loss_type + ("  (no Liger: it has no IPO)" if liger not in set(part.provider) else ""))
        if not ax.get_subplotspec().is_first_col():
            ax.set_ylabel("")
        else:
            ax.set_ylabel("× the 3-GEMM floor")
    for ax in axes.flat[len(present):]:
        ax.set_visible(False)
    handles, names = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="outside upper center", ncol=len(names), fontsize=8.5,
               title=f"Preference losses, {meta.get('head')} head (H {meta.get('hidden')}, V {meta.get('vocab')}, "
                     f"{meta.get('dtype')}), rows of {meta.get('seq')} tokens: forward + backward ÷ the 3-GEMM floor",
               title_fontproperties={"size": 11})
    plotting.add_caption(fig, caption + ". Liger's sigmoid/hinge/robust/kto rows are reference-free.", width=190)
    display(plotting.save_figure(fig, figures_dir / "09_preference_ratios"))

# %% [markdown]
# ## (4) Peak extra memory
#
# The harness's peak allocation beyond the inputs, per provider and batch. fusedkern's and TRL's do
# not depend on the loss type (one value per batch, drawn as a line); Liger's does, so its line is
# the largest over the loss types it has, with the smallest as a band.

# %%
if have:
    mem = df.pivot_table(index=["provider", "loss_type"], columns="x", values="peak_extra_mib", aggfunc="first")
    mem = mem.loc[[(p, lt) for p in tables.sort_providers(df.provider) for lt in ["all", *loss_types]
                   if (p, lt) in mem.index]]
    mem.columns.name = "batch"
    print("peak extra memory, MiB:")
    display(mem.round(0))

# %%
if have and not quick:
    spread = df.groupby(["provider", "x"])["peak_extra_mib"].agg(["min", "max"]).reset_index()
    fig, ax = plt.subplots(figsize=(7.5, 4.6), layout="constrained")
    for provider in tables.sort_providers(spread.provider):
        part = spread[spread.provider == provider].sort_values("x")
        style = plotting.style_for(provider)
        ax.plot(part.x, part["max"], color=style["color"], marker=style["marker"] or "o",
                linestyle=style["linestyle"], linewidth=style["linewidth"], label=label(provider))
        if (part["max"] > part["min"]).any():
            ax.fill_between(part.x, part["min"], part["max"], color=style["color"], alpha=0.18, linewidth=0)
    plotting.size_axis(ax, spread.x, label=f"batch (rows of {meta.get('seq')} tokens)")
    ax.set_yscale("log")
    ax.set_ylabel("peak extra memory, MiB (log)")
    ax.set_title("Preference losses: peak extra memory (forward + backward)")
    ax.legend(loc="upper left")
    plotting.add_caption(fig, caption, width=110)
    display(plotting.save_figure(fig, figures_dir / "09_preference_memory"))

# %% [markdown]
# ## What the data say
#
# Computed from the tables above, so this text cannot drift from the data.

# %%
if have:
    by = ratios.pivot_table(index=["loss_type", "x"], columns="provider", values="ratio", aggfunc="first")
    default = by["fusedkern_chunked"]
    print(f"fusedkern default, forward + backward ÷ the 3-GEMM floor, over batch "
          f"{', '.join(str(int(x)) for x in sorted(ratios.x.unique()))}:")
    for loss_type in [lt for lt in loss_types if lt in default.index.get_level_values(0)]:
        row = default.loc[loss_type]
        lean = by["fusedkern_chunked_lean"].loc[loss_type]
        print(f"  {loss_type:<8} max {row.max():.2f}× (batch {int(row.idxmax())}), min {row.min():.2f}×; "
              f"lean {lean.min():.2f}–{lean.max():.2f}× (lean ÷ default {(lean / row).min():.2f}–{(lean / row).max():.2f})")
    with_liger = by[liger].dropna().index
    faster = default.loc[with_liger] < by.loc[with_liger, liger]
    print(f"Faster than Liger 0.8.5 (reference-free) at {int(faster.sum())} of {len(faster)} (loss type, batch) "
          f"cells{'' if faster.all() else ': slower at ' + ', '.join(f'{lt} batch {int(x)}' for lt, x in faster[~faster].index)}; "
          f"Liger ÷ default {(by.loc[with_liger, liger] / default.loc[with_liger]).min():.2f}–"
          f"{(by.loc[with_liger, liger] / default.loc[with_liger]).max():.2f}.")
    per_type = faster.groupby(level=0).all()
    print("  at every batch, per loss type: " + ", ".join(f"{lt} {'yes' if ok else 'no'}" for lt, ok in per_type.items()))
    trl = by["trl_fp32"]
    print(f"Faster than TRL's fp32 computation at {int((default < trl).sum())} of {len(default)} cells "
          f"(TRL ÷ default {(trl / default).min():.2f}–{(trl / default).max():.2f}).")
    over = default[default > target]
    print(f"Cells of the default above the issue's {target:.2f}×: {len(over)} of {len(default)}")
    for x in sorted(ratios.x.unique()):
        at = over[over.index.get_level_values(1) == x]
        if len(at):
            print(f"  batch {int(x)}: " + ", ".join(f"{lt} {v:.2f}×" for (lt, _), v in at.items()))
    within = default[default <= target]
    print("  within the target: " + (", ".join(f"{lt} batch {int(x)} {v:.2f}×" for (lt, x), v in within.items())
                                    or "none"))
    kto, pairs = by.loc["kto"], by.drop(index="kto", level=0)
    print(f"Lean ÷ default: pair losses {(pairs['fusedkern_chunked_lean'] / pairs['fusedkern_chunked']).min():.2f}–"
          f"{(pairs['fusedkern_chunked_lean'] / pairs['fusedkern_chunked']).max():.2f} (4 GEMMs: a pair does not fit a "
          f"1024-token chunk), KTO {(kto['fusedkern_chunked_lean'] / kto['fusedkern_chunked']).min():.2f}–"
          f"{(kto['fusedkern_chunked_lean'] / kto['fusedkern_chunked']).max():.2f} (3 GEMMs: a sequence fits).")
    peak = df.pivot_table(index="provider", columns="x", values="peak_extra_mib", aggfunc="max")
    top = int(peak.columns.max())
    print(f"Peak extra memory at batch {top} (largest over loss types): " + ", ".join(
        f"{label(p)} {peak.loc[p, top]:.0f} MiB" for p in tables.sort_providers(peak.index)))

# %% [markdown]
# The loss column is a sanity check: fusedkern (both modes) and TRL compute the same loss and agree
# to the printed digits; Liger agrees for CPO, SimPO and ORPO (no reference there) and differs for
# the reference-free DPO types and KTO, as it should.

# %%
if have:
    losses = df[df.provider != "cublas_3gemm"].pivot_table(index=["loss_type", "provider"], columns="x",
                                                           values="loss", aggfunc="first")
    losses.columns.name = "batch"
    display(losses.round(4))
    ours = losses.xs("fusedkern_chunked", level="provider")
    for other in ("fusedkern_chunked_lean", "trl_fp32", liger):
        theirs = losses.xs(other, level="provider")
        rel = ((theirs - ours.loc[theirs.index]).abs() / ours.loc[theirs.index].abs().clip(lower=1e-3)).max(axis=1)
        print(f"{label(other)} vs the default, max relative loss difference per loss type: "
              + ", ".join(f"{lt} {v:.0e}" for lt, v in rel.items()))
    kto_losses = losses.xs("kto", level="loss_type").stack()
    if (kto_losses.round(4) == 0.5).all():
        print("Every KTO loss reads 0.5000: with these inputs every sequence's σ(β(r − z₀)) is saturated at 0 or 1 "
              "(half the rows desirable), so the timed KTO gradient is ≈ 0, and GEMMs on zeros run faster than on real "
              "gradients: these KTO timings flatter every provider.")

# %% [markdown]
# ## What these data do not show
#
# - **One device call, one GPU (H100), one protocol.** The ratios are within this file; the H200
#   notebooks' ratios are not directly comparable (same compute, more memory bandwidth there).
# - **Liger with a reference model** (`liger_ref_model`: one logits GEMM more per chunk, what a Liger
#   user without precomputed reference log-probs pays) was not measured here.
# - **No masked workload**: every target counts (a real preference batch ignores its prompt tokens,
#   notebook 08's subject for cross-entropy).
# - **Only forward + backward** (`full`); the one-GEMM floor `cublas_1gemm` requested by the command
#   has no rows in the file.
