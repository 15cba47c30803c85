"""Figures for the notebooks: one look for every provider, and files that do not change unless the data do.

Determinism: `save_figure` writes PNG and SVG with a fixed DPI, a fixed `svg.hashsalt` (matplotlib
otherwise draws random ids into every SVG), no Date/Software metadata, and a bundled font (DejaVu
Sans), so re-running a notebook on unchanged data leaves the files byte-identical and the commit
clean. The plotting helpers sort their inputs (providers in a fixed order, x ascending) so that the
order rows arrive in does not change the drawing either.

Conventions: x axes are log₂ with the actual sizes as tick labels (4096, 8192, …); medians are
drawn with p20–p80 error bars (the quantiles the seeds report); the compute floor is a black line
with the unreachable region below it shaded; every figure carries a caption saying where its numbers
come from (`fusedkern.study.results.provenance`). The tables the figures draw are in
`fusedkern.study.tables`.
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.ticker import FixedFormatter, FixedLocator, NullLocator

from fusedkern.study.results import check_one_row_each, check_one_workload, floor_provider, ignored_share
from fusedkern.study.tables import CHUNK_COST_PARTS, ROWCOUNT_IMPLS, ROWCOUNT_KERNELS, pivot, ratio_to, sort_providers

DPI = 120  # fixed: PNG bytes depend on it; 120 keeps a 10-inch figure readable on GitHub


_RC = {
    "svg.hashsalt": "fusedkern",  # fixed ids in the SVG (random per run otherwise)
    "svg.fonttype": "path",  # glyphs as paths: the SVG looks the same without the font installed
    "font.family": "DejaVu Sans",  # ships with matplotlib: same glyphs on every machine
    "font.size": 10,
    "axes.titlesize": 11,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "legend.fontsize": 8,
    "legend.frameon": False,
    "figure.dpi": DPI,
    "savefig.dpi": DPI,
    "path.simplify": False,  # simplification depends on the rendering; keep every vertex
}


_STYLES: dict[str, dict] = {
    "huggingface": dict(color="#7f7f7f", marker="s", label="Hugging Face (seed, A100)"),
    "huggingface_bf16": dict(color="#7f7f7f", marker="s", label="HF, bf16 logits"),
    "huggingface_fp32": dict(color="#8c564b", marker="s", label="HF, fp32-upcast logits"),
    "torch_fp32_upcast": dict(color="#bcbd22", marker="D", label="torch, fp32 upcast"),
    "liger": dict(color="#6baed6", marker="^", label="Liger (seed, A100)"),
    "liger-kernel 0.4.2": dict(color="#6baed6", marker="^", label="Liger 0.4.2"),
    "liger-kernel 0.8.5": dict(color="#1f77b4", marker="^", label="Liger 0.8.5"),
    # the preference sweep: Liger's DPO/KTO without reference log-probs, TRL's materialized fp32 loss
    "liger-kernel 0.8.5 ref-free": dict(color="#1f77b4", marker="^", label="Liger 0.8.5 (reference-free)"),
    "trl_fp32": dict(color="#8c564b", marker="s", label="TRL, fp32-upcast logits"),
    "cut_cross_entropy": dict(color="#2ca02c", marker="v", label="Cut Cross-Entropy"),
    # 2026's peers on Hopper (the H100 table): QuACK's and Liger's CuTe DSL kernels, Transformers' own loss (its
    # models' bf16 logits upcast to fp32: the fp32-upcast brown)
    "quack": dict(color="#00897b", marker="P", label="QuACK 0.6.1"),
    "quack-kernels 0.6.5": dict(color="#004d40", marker="P", label="QuACK 0.6.5"),
    "liger-kernel 0.8.5 CuTe SM90": dict(color="#08306b", marker="<", label="Liger 0.8.5 CuTe SM90"),
    "liger-kernel 0.8.5 CuTe SM90 log-probs": dict(color="#08306b", marker="<",
                                                   label="Liger 0.8.5 CuTe SM90 log-probs, τ 0.7 + entropy"),
    "transformers_loss": dict(color="#8c564b", marker="s", label="Transformers' loss (fp32 upcast)"),
    # TRL's own fused LM head (SFTTrainer's and GRPOTrainer's default since trl 1.16): the labelled rows only
    "trl 1.16.0 fused LM head": dict(color="#bcbd22", marker="p", label="TRL 1.16 fused LM head"),
    "trl 1.16.0 fused LM head log-probs": dict(color="#bcbd22", marker="p",
                                               label="TRL 1.16 fused LM head log-probs, τ 0.7 + entropy"),
    # the cross-entropy sweeps' default (impl="auto": the anchored pass on Hopper, the chunked strategy elsewhere and in
    # the files measured before), the preference sweeps' chunked strategy: the provider keeps its name so that every
    # committed file reads alike, and the label names neither strategy
    "fusedkern_chunked": dict(color="#d62728", marker="o", label="fusedkern", linewidth=2.2),
    "fusedkern_chunked_lean": dict(color="#ff9896", marker="o", label="fusedkern chunked (lean dW)"),
    # num_valid_tokens passed: as a host int (only the valid rows are computed) or as a device tensor
    # (the row-count GEMMs read it on the GPU: no host sync)
    "fusedkern_chunked_counted": dict(color="#7b0d1e", marker="D", label="fusedkern, count as host int",
                                      linewidth=2.0),
    "fusedkern_chunked_device_count": dict(color="#e6550d", marker="*", label="fusedkern, count as device tensor",
                                           linewidth=2.0),
    "fusedkern_chunked_lean_counted": dict(color="#fdae6b", marker="d", label="fusedkern lean, host count"),
    "fusedkern_fused": dict(color="#9467bd", marker="P", label="fusedkern fused"),
    # the loss-only pass on the Gluon statistics kernel, and the RL log-prob pass (temperature, entropy)
    "fusedkern_gluon": dict(color="#2ca02c", marker="h", label="fusedkern loss-only, Gluon", linewidth=2.2),
    "fusedkern_gluon_counted": dict(color="#2ca02c", marker="h", label="fusedkern loss-only, Gluon, host count",
                                    linewidth=2.2),
    "fusedkern_tile_pass": dict(color="#d62728", marker="o", label="fusedkern loss-only, tile pass"),
    "fusedkern_tile_pass_counted": dict(color="#7b0d1e", marker="D",
                                        label="fusedkern loss-only, tile pass, host count"),
    "fusedkern_logprobs": dict(color="#9467bd", marker="v", label="fusedkern log-probs, τ 0.7 + entropy"),
    "fusedkern_logprobs_counted": dict(color="#9467bd", marker="v",
                                       label="fusedkern log-probs, τ 0.7 + entropy, host count"),
    "fusedkern_logprobs_gluon": dict(color="#2ca02c", marker="v",
                                     label="fusedkern log-probs on Gluon, τ 0.7 + entropy"),
    "fusedkern_logprobs_gluon_counted": dict(color="#2ca02c", marker="v",
                                             label="fusedkern log-probs on Gluon, τ 0.7 + entropy, host count"),
    "fusedkern_logprobs_tile_pass": dict(color="#9467bd", marker="^",
                                         label="fusedkern log-probs on the tile pass, τ 0.7 + entropy"),
    "fusedkern_logprobs_tile_pass_counted": dict(
        color="#9467bd", marker="^", label="fusedkern log-probs on the tile pass, τ 0.7 + entropy, host count"),
    "fusedkern_generic": dict(color="#c49c94", marker="s", label="fusedkern log-prob path (4 GEMMs)"),
    "cublas_1gemm": dict(color="black", marker="", linestyle=":", label="1 cuBLAS GEMM"),
    "cublas_3gemm": dict(color="black", marker="", linestyle="--", label="floor: 3 cuBLAS GEMMs"),
    "cublas_1gemm_valid": dict(color="black", marker="", linestyle=":", label="1 cuBLAS GEMM on the valid rows"),
    "cublas_3gemm_valid": dict(color="black", marker="", linestyle="-.",
                               label="floor: 3 cuBLAS GEMMs on the valid rows"),
    "cublas_3gemm_real_grad": dict(color="#555555", marker="", linestyle="-.",
                                   label="3 cuBLAS GEMMs on the true ∂L/∂z"),
    "torch_linear_cross_entropy": dict(color="#ff7f0e", marker="X", label="torch F.linear_cross_entropy"),
}


_FALLBACK_COLORS = ("#17becf", "#e377c2", "#ff7f0e", "#c5b0d5", "#98df8a", "#c49c94")


def use_style() -> None:
    """Apply the project's rcParams (call once per notebook; `save_figure` re-applies the SVG salt)."""
    matplotlib.rcParams.update(_RC)


# A peer called on the valid rows only (`x[target != -100]` first): its parent's look, dashed. The bench names
# them `<key>_gather`, or `<label> +gather` where a provider's name is its distribution's label (Liger).
_GATHERED = re.compile(r"(.+?)(?:_gather| \+gather)")


def style_for(provider: str) -> dict:
    """Line style of `provider` (color, marker, linestyle, linewidth, label): the same in every figure.

    Unknown providers get a color chosen by a checksum of the name, so it is stable across runs.
    """
    base = dict(marker="o", linestyle="-", linewidth=1.5, label=provider)
    if provider in _STYLES:
        return {**base, **_STYLES[provider]}
    gathered = _GATHERED.fullmatch(provider)
    if gathered and gathered.group(1) in _STYLES:
        parent = {**base, **_STYLES[gathered.group(1)]}
        return {**parent, "linestyle": "--", "label": f"{parent['label']} + gather"}
    variant = re.fullmatch(r"(.+)_c(\d+)", provider)  # a chunk-size variant, e.g. fusedkern_chunked_c2048
    if variant and variant.group(1) in _STYLES:
        parent = {**base, **_STYLES[variant.group(1)]}
        return {**parent, "linestyle": ":", "linewidth": 1.2, "label": f"{parent['label']}, C = {variant.group(2)}"}
    color = _FALLBACK_COLORS[zlib.crc32(provider.encode()) % len(_FALLBACK_COLORS)]
    return {**base, "color": color}


def label_for(provider: str) -> str:
    return style_for(provider)["label"]


@dataclass(frozen=True)
class SavedFigure:
    """The two files of a saved figure. In a notebook, a cell ending with one shows the PNG itself
    (the exact bytes written to disk), so the rendered notebook and `figures/` never disagree."""

    png: Path
    svg: Path

    def _repr_png_(self) -> bytes:
        return self.png.read_bytes()

    def __repr__(self) -> str:  # file names only: absolute paths would differ between machines
        return f"SavedFigure({self.png.name}, {self.svg.name})"


def save_figure(fig, path_stem: str | Path, *, close: bool = True) -> SavedFigure:
    """Write `fig` as `<path_stem>.png` and `<path_stem>.svg`, byte-identical for identical input.

    Creates the parent directory. Closes the figure (default) so the notebook's inline backend does
    not draw it a second time; return the SavedFigure from the cell to display it.
    """
    stem = Path(path_stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    png, svg = stem.with_name(stem.name + ".png"), stem.with_name(stem.name + ".svg")
    with matplotlib.rc_context({"svg.hashsalt": _RC["svg.hashsalt"]}):
        common = dict(dpi=DPI, bbox_inches="tight", pad_inches=0.15, facecolor="white")
        fig.savefig(png, format="png", metadata={"Software": None}, **common)
        fig.savefig(svg, format="svg", metadata={"Date": None, "Creator": None}, **common)
    if close:
        plt.close(fig)
    return SavedFigure(png, svg)


def _size_label(value: float) -> str:
    value = float(value)
    return f"{int(value)}" if value.is_integer() else f"{value:g}"


def size_axis(ax, sizes: Iterable[float], *, axis: str = "x", label: str | None = None, base: int = 2) -> None:
    """A log axis whose ticks are exactly `sizes`, labelled with the sizes themselves (no 2¹²)."""
    ticks = sorted({float(s) for s in sizes})
    if axis == "x":
        ax.set_xscale("log", base=base)
        target = ax.xaxis
    else:
        ax.set_yscale("log", base=base)
        target = ax.yaxis
    target.set_major_locator(FixedLocator(ticks))
    target.set_major_formatter(FixedFormatter([_size_label(t) for t in ticks]))
    target.set_minor_locator(NullLocator())
    if ticks:
        lo, hi = ticks[0], ticks[-1]
        pad = (hi / lo) ** 0.06 if hi > lo else 1.25
        (ax.set_xlim if axis == "x" else ax.set_ylim)(lo / pad, hi * pad)
    if label:
        (ax.set_xlabel if axis == "x" else ax.set_ylabel)(label)


def _ms_axis(ax, values: Iterable[float], label: str = "ms (median, p20–p80)") -> None:
    """Log y axis with round-number ticks covering `values`."""
    v = np.asarray([x for x in values if np.isfinite(x) and x > 0], dtype=float)
    ax.set_yscale("log")
    ax.set_ylabel(label)
    if v.size:
        candidates = [m * 10.0**k for k in range(-3, 7) for m in (1, 2, 5)]
        ticks = [t for t in candidates if v.min() / 1.3 <= t <= v.max() * 1.3]
        if len(ticks) >= 2:
            ax.yaxis.set_major_locator(FixedLocator(ticks))
            ax.yaxis.set_major_formatter(FixedFormatter([f"{t:g}" for t in ticks]))
            ax.yaxis.set_minor_locator(NullLocator())


def plot_quantiles(
    ax,
    df: pd.DataFrame,
    *,
    x: str = "x",
    y: str = "ms_p50",
    lo: str | None = "ms_p20",
    hi: str | None = "ms_p80",
    by: str = "provider",
    providers: Sequence[str] | None = None,
    log_y: bool = True,
    x_label: str | None = None,
    y_label: str | None = None,
    label_suffix: str = "",
    **line_kwargs,
) -> list[str]:
    """One line per provider: median `y` vs `x`, error bars from `lo` to `hi` (when given).

    Returns the providers drawn, in drawing order. Rows with a missing `y` (e.g. out of memory) are
    skipped. The x axis gets the actual sizes as ticks.
    """
    df = df[df[y].notna()]
    check_one_row_each(df, (by, x), "plot_quantiles")
    drawn = []
    for provider in providers if providers is not None else sort_providers(df[by]):
        part = df[df[by] == provider].sort_values(x)
        if part.empty:
            continue
        style = style_for(provider)
        kw = dict(color=style["color"], marker=style["marker"], linestyle=style["linestyle"],
                  linewidth=style["linewidth"], label=style["label"] + label_suffix, markersize=5, capsize=2)
        kw.update(line_kwargs)
        xs, ys = part[x].to_numpy(float), part[y].to_numpy(float)
        if lo and hi and lo in part and hi in part and part[lo].notna().all() and part[hi].notna().all():
            err = np.vstack([ys - part[lo].to_numpy(float), part[hi].to_numpy(float) - ys]).clip(min=0)
            ax.errorbar(xs, ys, yerr=err, **kw)
        else:
            kw.pop("capsize")
            ax.plot(xs, ys, **kw)
        drawn.append(provider)
    if not df.empty:
        if x_label is None and "x_name" in df:
            x_label = str(df["x_name"].iloc[0])
        size_axis(ax, df[x], label=x_label)
        if log_y:
            _ms_axis(ax, pd.concat([df[c] for c in (y, lo, hi) if c and c in df]), y_label or "ms (median, p20–p80)")
        elif y_label:
            ax.set_ylabel(y_label)
    return drawn


def draw_floor(ax, xs: Sequence[float], ys: Sequence[float], *, label: str = "floor: 3 cuBLAS GEMMs",
               shade: bool = True) -> None:
    """The compute floor as a black line, the region below it shaded (no fused op can be there
    without beating cuBLAS at its own GEMMs)."""
    order = np.argsort(np.asarray(xs, dtype=float))
    xs = np.asarray(xs, dtype=float)[order]
    ys = np.asarray(ys, dtype=float)[order]
    had_data = ax.has_data()
    lo, hi = ax.get_ylim()
    ax.plot(xs, ys, color="black", linestyle="--", linewidth=1.4, label=label, zorder=5)
    if shade:
        # the band starts far below the data; the y limits are then put back around the data
        ax.fill_between(xs, ys * 1e-3, ys, color="0.85", alpha=0.6, linewidth=0, zorder=0, label="below the floor")
        if had_data:
            ax.set_ylim(min(lo, float(ys.min()) / 1.3), max(hi, float(ys.max()) * 1.3))
        else:
            ax.set_ylim(float(ys.min()) / 1.3, float(ys.max()) * 1.3)


def plot_ratios(ax, ratios: pd.DataFrame, *, x: str = "x", baseline_label: str = "floor (= 1)",
                annotate: Sequence[str] | bool = True, skip: Sequence[str] = (), log_y: bool = True,
                direct_labels: bool = True, guides: Mapping[str, float] | None = None,
                ylim: tuple[float, float] | None = None, labels: Mapping[str, str] | None = None,
                percent_x: str | None = None) -> None:
    """Ratio to the baseline vs x per provider, a line at 1 with the region below shaded.

    annotate: providers whose every point gets its ratio written next to it (True: all).
    log_y: a log ratio axis (1×…1.5× keeps room when another provider sits at 4×).
    direct_labels: name each line at its right end with its last ratio, spaced so that close
    lines stay legible (then no legend is needed).
    guides: {label: ratio} drawn as dotted grey lines, labelled at the left (e.g. the ideal 0.5× of
    a workload that ignores half the targets); the y range includes them.
    ylim: fixed y limits (panels that should compare at a glance share them).
    labels: {provider: label} for this panel only (e.g. "fusedkern, no count" where counts matter).
    percent_x: x holds percentages (a share of ignored targets, say): a linear axis with this label instead of
    the log₂ size axis.
    """
    shown = ratios[~ratios["provider"].isin(skip) & ratios["ratio"].notna()]
    if shown.empty:
        return
    check_one_row_each(shown, ("provider", x), "plot_ratios")
    guides = dict(guides or {})
    # at each x the highest annotated point is labelled above, the others below: two close lines stay legible
    annotated = shown if annotate is True else shown[shown["provider"].isin(annotate or ())]
    highest = annotated.groupby(x)["ratio"].max().to_dict()
    ends = []
    for provider in sort_providers(shown["provider"]):
        part = shown[shown["provider"] == provider].sort_values(x)
        style = style_for(provider)
        if labels and provider in labels:
            style = {**style, "label": labels[provider]}
        ax.plot(part[x], part["ratio"], color=style["color"], marker=style["marker"] or "o",
                linestyle=style["linestyle"], linewidth=style["linewidth"], label=style["label"], markersize=5)
        ends.append((float(part[x].iloc[-1]), float(part["ratio"].iloc[-1]), style))
        if annotate is True or provider in (annotate or ()):
            for xv, r in zip(part[x], part["ratio"]):
                dy, va = (6, "bottom") if r >= highest[xv] else (-8, "top")
                ax.annotate(f"{r:.2f}×", (xv, r), textcoords="offset points", xytext=(0, dy), fontsize=7.5,
                            ha="center", va=va, color=style["color"], fontweight="bold")
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1.2, label=baseline_label)
    lo = min(0.95, float(shown["ratio"].min()) * 0.97, *(g * 0.97 for g in guides.values()))
    hi = float(shown["ratio"].max()) * (1.08 if log_y else 1.12)
    if ylim is not None:
        lo, hi = ylim
    ax.axhspan(lo, 1.0, color="0.85", alpha=0.6, linewidth=0, zorder=0)
    for name, value in guides.items():
        ax.axhline(value, color="0.35", linestyle=":", linewidth=1.3, zorder=1)
        ax.annotate(name, (0.01, value), xycoords=("axes fraction", "data"), textcoords="offset points",
                    xytext=(0, 3), fontsize=7.5, color="0.3", va="bottom", ha="left")
    if log_y:
        ax.set_yscale("log")
        candidates = (0.25, 0.3, 0.4, 0.5, 0.6, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 10.0, 15.0,
                      20.0)
        ticks = [t for t in candidates if lo <= t <= hi]
        ax.yaxis.set_major_locator(FixedLocator(ticks))
        ax.yaxis.set_major_formatter(FixedFormatter([f"{t:g}×" for t in ticks]))
        ax.yaxis.set_minor_locator(NullLocator())
    ax.set_ylim(lo, hi)
    if percent_x is not None:
        _percent_axis(ax, shown[x] / 100, percent_x)
    else:
        size_axis(ax, shown[x], label=str(shown["x_name"].iloc[0]) if "x_name" in shown else None)
    ax.set_ylabel("× the baseline (median ms)")
    if direct_labels:
        _label_line_ends(ax, ends)


def label_line_ends(ax, df: pd.DataFrame, *, x: str = "x", value: str, fmt="{:.2f}") -> None:
    """Name each provider's line at its right end with its last `value` (formatted by `fmt`, a format
    string or a function), right
    of the axes and nudged apart vertically: a legend that sits next to the data. Call it after the
    axis scales and limits are final."""
    ends = []
    for provider in sort_providers(df["provider"]):
        part = df[(df["provider"] == provider) & df[value].notna()].sort_values(x)
        if not part.empty:
            ends.append((float(part[x].iloc[-1]), float(part[value].iloc[-1]), style_for(provider)))
    _label_line_ends(ax, ends, fmt=fmt)


def _label_line_ends(ax, ends: list, min_gap: float = 0.052, fmt: str = "{:.2f}×") -> None:
    """Write each line's label and last value just right of the axes, nudged apart vertically. A line whose last
    point lies outside the y range gets none (matplotlib would hide the label with its point)."""
    to_axes = ax.transAxes.inverted()
    placed = []
    y_lo, y_hi = sorted(ax.get_ylim())
    for xv, yv, style in ends:
        if not y_lo <= yv <= y_hi:
            continue
        ya = float(to_axes.transform(ax.transData.transform((xv, yv)))[1])
        placed.append([ya, xv, yv, style])
    placed.sort(key=lambda item: item[0])
    for i in range(1, len(placed)):
        placed[i][0] = max(placed[i][0], placed[i - 1][0] + min_gap)
    overflow = placed[-1][0] - 1.0 if placed else 0.0
    if overflow > 0:
        for item in placed:
            item[0] -= overflow
        for i in range(len(placed) - 2, -1, -1):
            placed[i][0] = min(placed[i][0], placed[i + 1][0] - min_gap)
    for ya, xv, yv, style in placed:
        text = fmt(yv) if callable(fmt) else fmt.format(yv)
        ax.annotate(f"{style['label']}  {text}", xy=(xv, yv), xycoords="data", xytext=(1.02, ya),
                    textcoords="axes fraction", va="center", ha="left", fontsize=7.5, color=style["color"],
                    arrowprops=dict(arrowstyle="-", color=style["color"], linewidth=0.6, alpha=0.7,
                                    shrinkA=0, shrinkB=3))


def plot_memory(ax, model: pd.DataFrame | None, measured: pd.DataFrame | None = None, *, x: str = "x",
                value: str = "peak_extra_mib", reference: pd.DataFrame | None = None,
                measured_label: str = "measured", reference_label: str = "reference", log_y: bool = True,
                legend_loc: str = "upper left") -> None:
    """Peak extra memory vs x: the analytic model as lines, measured points as hollow markers on top,
    and optional reference points (someone else's measurements) as crosses.

    Each frame has columns provider, x and `value` (the model's may call it `mib`). The legend has
    one entry per provider (its color) and one per kind of mark, instead of provider × kind.
    """
    from matplotlib.lines import Line2D

    drawn_x: list = []
    values: list = []
    providers: set = set()
    kinds: list = []

    def col(df: pd.DataFrame) -> str:
        return value if value in df else "mib"

    if model is not None and not model.empty:
        for provider in sort_providers(model["provider"]):
            part = model[model["provider"] == provider].sort_values(x)
            ax.plot(part[x], part[col(part)].clip(lower=0.01), color=style_for(provider)["color"], linestyle="-",
                    linewidth=1.4, alpha=0.85)
            drawn_x += list(part[x])
            values += list(part[col(part)])
            providers.add(provider)
        kinds.append(Line2D([], [], color="0.3", linewidth=1.4, label="model"))
    for frame, kind in ((measured, "measured"), (reference, "reference")):
        if frame is None or frame.empty:
            continue
        frame = frame[frame[col(frame)].notna()]
        if frame.empty:
            continue
        if kind == "measured":
            kw = dict(marker="o", markersize=7, markerfacecolor="none", markeredgewidth=1.6)
        else:
            kw = dict(marker="x", markersize=6, markeredgewidth=1.3)
        for provider in sort_providers(frame["provider"]):
            part = frame[frame["provider"] == provider].sort_values(x)
            ax.plot(part[x], part[col(part)].clip(lower=0.01), color=style_for(provider)["color"], linestyle="none",
                    **kw)
            drawn_x += list(part[x])
            values += list(part[col(part)])
            providers.add(provider)
        kinds.append(Line2D([], [], color="0.3", linestyle="none", label=measured_label if kind == "measured"
                            else reference_label, **kw))
    if drawn_x:
        size_axis(ax, drawn_x)
    if log_y:
        ax.set_yscale("log")
        v = np.asarray([max(float(t), 0.01) for t in values]) if values else np.asarray([1.0])
        ticks = [t for t in (0.01, 0.1, 1, 10, 100, 1_000, 10_000, 100_000) if v.min() / 3 <= t <= v.max() * 3]
        if len(ticks) < 4:  # less than ~3 decades: 1-3-10 steps
            ticks = [m * 10.0**k for k in range(-2, 6) for m in (1, 3) if v.min() / 1.5 <= m * 10.0**k <= v.max() * 1.5]
        if len(ticks) >= 2:
            ax.yaxis.set_major_locator(FixedLocator(ticks))
            ax.yaxis.set_major_formatter(FixedFormatter([f"{t:g}" for t in ticks]))
            ax.yaxis.set_minor_locator(NullLocator())
    ax.set_ylabel("peak extra memory, MiB")
    if legend_loc:
        handles = [Line2D([], [], color=style_for(p)["color"], linewidth=2.5, label=label_for(p))
                   for p in sort_providers(providers)]
        ax.legend(handles=handles + kinds, loc=legend_loc, ncol=2 if len(handles) > 6 else 1)


def plot_seed_vs_ours(ax, seed: pd.DataFrame, ours: pd.DataFrame | None, *, x: str = "x",
                      seed_value: str = "p50", ours_value: str = "ms_p50", seed_suffix: str = " — A100 (seed)",
                      ours_suffix: str = " — H200 (ours)") -> None:
    """The seed's reported medians (hollow markers, thin dashed lines) beside ours (solid lines)."""
    all_x: list = []
    all_y: list = []
    for provider in sort_providers(seed["provider"]):
        part = seed[seed["provider"] == provider].sort_values(x)
        style = style_for(provider)
        ax.plot(part[x], part[seed_value], color=style["color"], marker=style["marker"], linestyle="--",
                linewidth=1.0, markerfacecolor="white", label=style["label"].split(" (")[0] + seed_suffix)
        all_x += list(part[x])
        all_y += list(part[seed_value])
    if ours is not None and not ours.empty:
        for provider in sort_providers(ours["provider"]):
            part = ours[(ours["provider"] == provider) & ours[ours_value].notna()].sort_values(x)
            style = style_for(provider)
            ax.plot(part[x], part[ours_value], color=style["color"], marker=style["marker"],
                    linestyle=style["linestyle"], linewidth=style["linewidth"], label=style["label"] + ours_suffix)
            all_x += list(part[x])
            all_y += list(part[ours_value])
    if all_x:
        size_axis(ax, all_x)
        _ms_axis(ax, all_y, "ms (median)")


def add_caption(fig, text: str, *, width: int = 150) -> None:
    """A small grey caption under the figure (wrapped at `width` characters)."""
    import textwrap

    wrapped = "\n".join(textwrap.wrap(text, width=width, break_on_hyphens=False))
    fig.text(0.0, -0.01, wrapped, ha="left", va="top", fontsize=7, color="0.35", transform=fig.transFigure)


def latency_figure(df: pd.DataFrame, *, mode: str = "full", x_label: str, title: str, caption: str,
                   annotate: Sequence[str] = (), guides: Mapping[str, float] | None = None):
    """Two panels: median ms vs x per provider with the mode's GEMM floor drawn as a line over a
    shaded band (left), and every provider's time divided by the floor's (right; `guides` as in
    `plot_ratios`). `df` must hold one workload and protocol (`select_workload`)."""
    part = df[(df["mode"] == mode) & df["ms_p50"].notna()]
    check_one_workload(part, "latency_figure")
    floor = floor_provider(mode)
    fig, (ax_ms, ax_ratio) = plt.subplots(1, 2, figsize=(13, 5), layout="constrained")
    plotting_rows = part[part["provider"] != floor]
    plot_quantiles(ax_ms, plotting_rows, x_label=x_label)
    floor_rows = part[part["provider"] == floor].sort_values("x")
    if not floor_rows.empty:
        draw_floor(ax_ms, floor_rows["x"], floor_rows["ms_p50"], label=label_for(floor))
        _ms_axis(ax_ms, part["ms_p50"].tolist() + part["ms_p80"].dropna().tolist())
    ax_ms.set_title(f"{title}: median ms ({mode})")
    ax_ms.legend(loc="upper left")
    if floor_rows.empty:
        ax_ratio.text(0.5, 0.5, f"no {floor} rows: no ratio to draw", ha="center", va="center",
                      transform=ax_ratio.transAxes)
        ax_ratio.set_axis_off()
    else:
        ratios = ratio_to(part, floor)
        plot_ratios(ax_ratio, ratios, annotate=annotate, skip=[floor], baseline_label=label_for(floor) + " (= 1)",
                    guides=guides)
        ax_ratio.set_xlabel(x_label)
        ax_ratio.set_ylabel(f"× {floor} (median ms)")
        ax_ratio.set_title("time ÷ the GEMM floor (lower is better; 1 = the floor)")
    add_caption(fig, caption)
    return fig


def modes_figure(df: pd.DataFrame, *, modes: Sequence[str], x_label: str, title: str, caption: str):
    """One panel per mode: median ms vs x per provider, with that mode's GEMM floor."""
    check_one_workload(df, "modes_figure")
    modes = [m for m in modes if (df["mode"] == m).any()]
    ncols = 2 if len(modes) > 1 else 1
    nrows = max(1, math.ceil(len(modes) / ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.5 * ncols, 4.2 * nrows), layout="constrained", squeeze=False)
    for ax, mode in zip(axes.flat, modes):
        part = df[(df["mode"] == mode) & df["ms_p50"].notna()]
        floor = floor_provider(mode)
        plot_quantiles(ax, part[part["provider"] != floor], x_label=x_label)
        floor_rows = part[part["provider"] == floor].sort_values("x")
        if not floor_rows.empty:
            draw_floor(ax, floor_rows["x"], floor_rows["ms_p50"], label=label_for(floor))
            _ms_axis(ax, part["ms_p50"].tolist() + part["ms_p80"].dropna().tolist())
        ax.set_title(f"{title} — {mode}")
    for ax in list(axes.flat)[len(modes):]:
        ax.set_axis_off()
    handles, labels = [], []
    for ax in axes.flat:
        for h, label in zip(*ax.get_legend_handles_labels()):
            if label not in labels:
                handles.append(h)
                labels.append(label)
    fig.legend(handles, labels, loc="outside right upper")
    add_caption(fig, caption)
    return fig


def annotate_ratio(ax, df: pd.DataFrame, numerator: str, denominator: str, *, x: str = "x", value: str = "ms_p50",
                   fmt: str = "{:.2f}×", color: str | None = None) -> pd.Series:
    """Write numerator ÷ denominator (same x) above the numerator's points; returns the ratios by x."""
    num = df[df["provider"] == numerator].set_index(x)[value]
    den = df[df["provider"] == denominator].set_index(x)[value]
    ratios = (num / den).dropna().sort_index()
    for xv, r in ratios.items():
        ax.annotate(fmt.format(r), (xv, num[xv]), textcoords="offset points", xytext=(0, 7), ha="center",
                    fontsize=8, fontweight="bold", color=color or style_for(numerator)["color"])
    return ratios


def chunk_tradeoff_figure(table: pd.DataFrame, *, tokens: int, torch_err_dw: float | None, caption: str,
                          errors: pd.DataFrame | None = None, error_tokens: int | None = None):
    """Time ÷ floor, peak extra memory and dW error against chunk size, at one token count (the
    error panel at `error_tokens` from `errors` = `chunk_error_table(...)` when given)."""
    at = table[table["tokens"] == tokens]
    if errors is not None:
        error_tokens = error_tokens or tokens
        err_at = errors[errors["tokens"] == error_tokens]
    else:
        error_tokens, err_at = tokens, at
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    colors = {"fp32": _STYLES["fusedkern_chunked"]["color"],
              "weight dtype (lean)": _STYLES["fusedkern_chunked_lean"]["color"]}
    for accumulation, part in at.groupby("accumulation", sort=True):
        style = dict(color=colors.get(accumulation, "gray"), marker="o", label=f"dW accumulated in {accumulation}")
        axes[0].plot(part["chunk_tokens"], part["ratio"], **style)
        axes[1].plot(part["chunk_tokens"], part["peak_extra_mib"], **style)
    for accumulation, part in err_at.groupby("accumulation", sort=True):
        style = dict(color=colors.get(accumulation, "gray"), marker="o", label=f"dW accumulated in {accumulation}")
        if part["err_dw"].notna().any():
            axes[2].plot(part["chunk_tokens"], part["err_dw"], **style)
    axes[0].axhline(1.0, color="black", linestyle="--", linewidth=1, label="floor: 3 cuBLAS GEMMs")
    axes[1].axhline(256, color="gray", linestyle=":", linewidth=1, label="256 MiB")
    if torch_err_dw is not None:
        axes[2].axhline(torch_err_dw, color="gray", linestyle=":", linewidth=1, label="PyTorch bf16 (one GEMM)")
    titles = ("forward + backward ÷ floor", "peak extra memory, MiB", "dW relative error vs fp64")
    for ax, title, n in zip(axes, titles, (tokens, tokens, error_tokens)):
        size_axis(ax, sorted(at["chunk_tokens"].unique()), label="tokens per chunk")
        ax.set_title(f"{title} ({n} tokens)")
        ax.legend(fontsize=8)
    axes[1].set_yscale("log")
    add_caption(fig, caption)
    fig.tight_layout()
    return fig


def chunk_cost_figure(costs: pd.DataFrame, *, caption: str):
    """Stacked horizontal bars: one per (chunk size, accumulation), parts of `chunk_cost_table`, each
    normalized to that chunk's three GEMMs (= 1) so that chunk sizes compare."""
    fig, ax = plt.subplots(figsize=(11, 0.9 + 0.75 * len(costs)), layout="constrained")
    colors = plt.get_cmap("tab10").colors
    labels = []
    for i, r in enumerate(costs.itertuples(index=False)):
        three = r.gemm_logits + r.gemm_dx + r.gemm_dw_write
        left = 0.0
        for j, (key, name) in enumerate(CHUNK_COST_PARTS):
            width = getattr(r, key) / three
            ax.barh(i, width, left=left, color=colors[j], label=name if i == 0 else None, edgecolor="white")
            left += width
        ax.text(left + 0.01, i, f"{r.over_three_gemms:.3f}× = 1 + {100 * r.dw_accumulate / three:.1f} % dW accumulate"
                f" + {100 * r.row_kernel / three:.1f} % row kernel  ({r.total_ms:.2f} ms)", va="center", fontsize=9)
        labels.append(f"C = {r.chunk_tokens}, dW {r.accumulation}")
    ax.set_yticks(range(len(costs)), labels)
    ax.invert_yaxis()
    ax.axvline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xlim(0, 1.95)
    ax.set_xticks([0, 0.25, 0.5, 0.75, 1.0, 1.25])
    ax.set_xlabel("time per chunk ÷ that chunk's three GEMMs (each part timed alone)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=3, fontsize=8, frameon=False)
    ax.set_title("Where a chunk's time goes besides the three GEMMs")
    add_caption(fig, caption)
    return fig


def host_waits_figure(waits: pd.DataFrame, *, caption: str):
    """`host_waits_table` as grouped horizontal bars: per variant (the code as shipped, then with each
    old host wait put back) the step's ms over the shipped one, one bar per mode, each labelled with
    the variant's ratio to the floor of the same process."""
    variants = list(dict.fromkeys(waits.variant))
    modes = list(dict.fromkeys(waits["mode"]))
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.7 * len(variants)), layout="constrained")
    colors = {"default": style_for("fusedkern_chunked")["color"], "lean": style_for("fusedkern_chunked_lean")["color"]}
    height = 0.8 / len(modes)
    for j, mode in enumerate(modes):
        part = waits[waits["mode"] == mode].set_index("variant")
        for i, variant in enumerate(variants):
            extra_ms = part.loc[variant, "extra_ms"]
            y = i + (j - (len(modes) - 1) / 2) * height
            ax.barh(y, extra_ms, height=height * 0.9, color=colors.get(mode, "0.5"),
                    label=f"{mode} mode" if i == 0 else None)
            ax.text(max(extra_ms, 0) + 0.03, y, f"{part.loc[variant, 'ratio']:.3f}× floor", va="center", fontsize=8)
    ax.set_yticks(range(len(variants)), [v.replace("_", " ") for v in variants])
    ax.invert_yaxis()
    ax.axvline(0, color="black", lw=0.8)
    ax.set_xlabel("ms per forward + backward over the code as shipped (median of back-to-back reps)")
    ax.set_title("What each host wait cost (4096 tokens; each old sync put back alone)")
    ax.legend(loc="lower right", fontsize=8)
    add_caption(fig, caption)
    return fig


def processes_figure(df: pd.DataFrame, *, providers: Sequence[str], caption: str, title: str, mode: str = "full"):
    """One size timed in several bench processes (one per workload): each provider's median ms with its p20–p80,
    one column per process (`workload`), so that a provider whose work is the same in every process shows how far
    the processes' conditions moved it."""
    if df["x"].nunique() != 1:
        raise ValueError(f"processes_figure draws one size, got x = {sorted(df['x'].unique())}")
    processes = list(dict.fromkeys(df["workload"]))
    fig, ax = plt.subplots(figsize=(8.5, 4.6), layout="constrained")
    width = 0.8 / len(providers)
    for j, provider in enumerate(providers):
        style = style_for(provider)
        rows = df[(df["provider"] == provider) & (df["mode"] == mode)].set_index("workload")
        xs = [i + (j - (len(providers) - 1) / 2) * width for i, p in enumerate(processes) if p in rows.index]
        shown = [p for p in processes if p in rows.index]
        mid = rows.loc[shown, "ms_p50"].to_numpy()
        err = [mid - rows.loc[shown, "ms_p20"].to_numpy(), rows.loc[shown, "ms_p80"].to_numpy() - mid]
        ax.errorbar(xs, mid, yerr=err, color=style["color"], marker=style["marker"] or "o", linestyle="none",
                    capsize=3, markersize=6, label=style["label"])
        for x, value in zip(xs, mid):
            ax.annotate(f"{value:.1f}", (x, value), textcoords="offset points", xytext=(7, -3), fontsize=8)
    ax.set_xticks(range(len(processes)), processes, fontsize=8)
    ax.set_xlabel("bench process")
    ax.set_ylabel(f"{mode} step, ms (median, p20–p80)")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="best")
    add_caption(fig, caption)
    return fig


def protocol_figure(sequential: pd.DataFrame, interleaved: pd.DataFrame, *, floors: Sequence[str],
                    caption: str, mode: str = "full"):
    """One panel per floor: each provider's ratio to that floor with the providers timed one after
    the other (solid) and with their reps interleaved (dashed), for the providers both runs have."""
    fig, axes = plt.subplots(1, len(floors), figsize=(6.2 * len(floors), 4.8), layout="constrained", squeeze=False)
    seq_ms, inter_ms = pivot(sequential, mode), pivot(interleaved, mode)
    providers = [p for p in inter_ms.index if p in seq_ms.index and not p.startswith("cublas_")]
    for ax, floor in zip(axes[0], floors):
        for provider in providers:
            style = style_for(provider)
            for table, linestyle in ((seq_ms, "-"), (inter_ms, "--")):
                ratio = (table.loc[provider] / table.loc[floor]).dropna()
                ax.plot(ratio.index, ratio.values, color=style["color"], marker=style["marker"] or "o",
                        linestyle=linestyle, linewidth=1.6, markersize=4.5)
        ax.axhline(1.0, color="black", lw=1.0, ls=":")
        size_axis(ax, seq_ms.columns, label=str(seq_ms.columns.name))
        ax.set_ylabel(f"× {label_for(floor)}")
        ax.set_title(f"÷ {label_for(floor)}", fontsize=10)
    handles = [plt.Line2D([], [], color=style_for(p)["color"], marker=style_for(p)["marker"] or "o", label=label_for(p))
               for p in providers]
    handles += [plt.Line2D([], [], color="0.3", ls="-", label="providers one after the other"),
                plt.Line2D([], [], color="0.3", ls="--", label="reps interleaved")]
    axes[0][-1].legend(handles=handles, fontsize=8, loc="upper right")
    fig.suptitle("The same providers, two timing protocols: forward + backward time ÷ the floor of the same run")
    add_caption(fig, caption)
    return fig


def _percent_axis(ax, shares: Iterable[float], label: str) -> None:
    ticks = sorted({float(s) for s in shares})
    ax.xaxis.set_major_locator(FixedLocator([100 * t for t in ticks]))
    ax.xaxis.set_major_formatter(FixedFormatter([f"{100 * t:g} %" for t in ticks]))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlim(100 * ticks[0] - 4, 100 * ticks[-1] + 4)
    ax.set_xlabel(label)


def ignored_share_figure(ratios: pd.DataFrame, *, tokens: Sequence[int], caption: str, title: str,
                         providers: Sequence[str] | None = None):
    """One panel per token count: time ÷ the dense three-GEMM floor against the share of ignored
    targets, one line per provider, with the ideal 1 − share (only the valid rows' three GEMMs) as
    a dotted line over a shaded band, and the dense floor (= 1) dashed.

    ratios: `ratio_to` rows (provider, x, workload, ratio) over several workloads; the share is read
    from the workload's name (`ignored_share`). Each (provider, x, workload) must appear once."""
    ratios = ratios[ratios["ratio"].notna()].copy()
    ratios["share"] = ratios["workload"].map(ignored_share)
    check_one_row_each(ratios, ("provider", "x", "workload"), "ignored_share_figure")
    if providers is not None:
        ratios = ratios[ratios["provider"].isin(providers)]
    fig, axes = plt.subplots(1, len(tokens), figsize=(6.6 * len(tokens), 5.0), layout="constrained",
                             sharey=True, squeeze=False)
    hi = float(ratios["ratio"].max()) * 1.08 if len(ratios) else 1.5
    for ax, n in zip(axes[0], tokens):
        at = ratios[ratios["x"] == n]
        shares = sorted(at["share"].unique())
        if not shares:
            ax.text(0.5, 0.5, f"nothing measured at {n} tokens", ha="center", va="center", transform=ax.transAxes)
            continue
        grid = np.array([0.0, max(shares)])
        ax.fill_between(100 * grid, 0, 1 - grid, color="0.85", alpha=0.6, linewidth=0, zorder=0)
        ax.plot(100 * grid, 1 - grid, color="black", linestyle=":", linewidth=1.4, zorder=2)
        ax.annotate("ideal: the valid rows' 3 GEMMs (1 − share)", (100 * grid[-1], 1 - grid[-1]),
                    textcoords="offset points", xytext=(-4, -12), ha="right", va="top", fontsize=7.5, color="0.25")
        ax.axhline(1.0, color="black", linestyle="--", linewidth=1.2, zorder=2)
        ax.annotate("dense floor: 3 cuBLAS GEMMs on all tokens (= 1)", (0.7, 1.0), xycoords=("axes fraction", "data"),
                    textcoords="offset points", xytext=(0, -4), fontsize=7.5, color="0.25", va="top", ha="center")
        ends = []
        for provider in sort_providers(at["provider"]):
            part = at[at["provider"] == provider].sort_values("share")
            style = style_for(provider)
            ax.plot(100 * part["share"], part["ratio"], color=style["color"], marker=style["marker"] or "o",
                    linestyle=style["linestyle"], linewidth=style["linewidth"], markersize=6, zorder=3)
            ends.append((100 * float(part["share"].iloc[-1]), float(part["ratio"].iloc[-1]), style))
        _percent_axis(ax, shares, "share of targets ignored (a prompt prefix of every 1024-token sequence)")
        ax.set_ylim(0, hi)
        ax.set_title(f"{n} tokens")
        _label_line_ends(ax, ends, min_gap=0.045)
    axes[0][0].set_ylabel("forward + backward ÷ the dense 3-GEMM floor (lower is better)")
    fig.suptitle(title)
    add_caption(fig, caption)
    return fig


@dataclass(frozen=True)
class RatioPanel:
    """One panel of `ratio_panels_figure`: `ratios` (`tables.ratio_to` rows) of `providers`, drawn by
    `plot_ratios` in that panel's words.

    other_call: {x: note} for points that come from another device call than the rest of the line (ratios are
    formed inside each call; the points are shaded and the note written above them). ylim: the y range, so that
    one provider several times slower does not flatten the rest; its points above the range are named, with
    their ratios, at the top of the panel. labels, annotate, guides, percent_x: as in `plot_ratios`."""

    ratios: pd.DataFrame
    providers: Sequence[str]
    title: str
    ylabel: str
    baseline_label: str
    x: str = "x"
    labels: Mapping[str, str] | None = None
    annotate: Sequence[str] = ()
    other_call: Mapping[float, str] | None = None
    ylim: tuple[float, float] | None = None
    guides: Mapping[str, float] | None = None
    percent_x: str | None = None


def ratio_panels_figure(panels: Sequence[RatioPanel], *, title: str, caption: str, height: float = 5.4):
    """Side by side, each panel's providers as ratio lines (`plot_ratios`, log y, each line named at its end);
    panels may have different floors and x axes. Providers without a row in a panel are left out of it."""
    fig, axes = plt.subplots(1, len(panels), figsize=(8.2 * len(panels), height), layout="constrained",
                             squeeze=False)
    for ax, panel in zip(axes[0], panels):
        shown = panel.ratios[panel.ratios["provider"].isin(panel.providers)]
        if shown.empty:
            ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
            ax.set_axis_off()
            continue
        plot_ratios(ax, shown, x=panel.x, baseline_label=panel.baseline_label, annotate=panel.annotate,
                    labels=panel.labels, percent_x=panel.percent_x, ylim=panel.ylim, guides=panel.guides)
        panel_title = panel.title
        if panel.ylim is not None:
            above = shown[shown["ratio"] > panel.ylim[1]]
            unit = " %" if panel.percent_x else ""
            notes = [f"{(panel.labels or {}).get(p, label_for(p))} "
                     + ", ".join(f"{r:.2f}× at {v:g}{unit}" for v, r in zip(part[panel.x], part["ratio"]))
                     for p in sort_providers(above["provider"])
                     for part in [above[above["provider"] == p].sort_values(panel.x)]]
            if notes:
                panel_title += "\nabove the axis: " + "; ".join(notes)
        for xv, note in sorted((panel.other_call or {}).items()):
            # 0.35 of a log₂ step either side (size axes): the band covers the point, clear of its neighbours
            ax.axvspan(xv / 2**0.35, xv * 2**0.35, color="0.92", linewidth=0, zorder=0)
            ax.annotate(note, (xv / 2**0.35, 1.0), xycoords=("data", "axes fraction"), textcoords="offset points",
                        xytext=(3, -4), ha="left", va="top", fontsize=7, color="0.35")
        ax.set_ylabel(panel.ylabel)
        ax.set_title(panel_title, fontsize=10)
    fig.suptitle(title)
    add_caption(fig, caption)
    return fig


def grouped_ratio_bars(ax, df: pd.DataFrame, *, groups: Sequence, group: str = "group", value: str = "ratio",
                       providers: Sequence[str] | None = None, guides: Mapping[str, float] | None = None,
                       xlim: tuple[float, float] | None = None, missing: str = "not measured") -> None:
    """Horizontal bars: one block per entry of `groups` (top to bottom), one bar per provider in it,
    each labelled with its value (`{:.2f}×`); a group without rows says `missing`. A dashed line at
    1 (the floor) and dotted `guides` ({label: value})."""
    check_one_row_each(df, (group, "provider"), "grouped_ratio_bars")
    providers = list(providers) if providers is not None else sort_providers(df["provider"])
    height = 0.8 / max(1, len(providers))
    labelled = set(ax.get_legend_handles_labels()[1])
    for i, g in enumerate(groups):
        part = df[df[group] == g].set_index("provider")
        if part.empty:
            ax.text(0.02, i, missing, transform=ax.get_yaxis_transform(), va="center", fontsize=8, color="0.4",
                    style="italic")
            continue
        for j, provider in enumerate(providers):
            if provider not in part.index or pd.isna(part.loc[provider, value]):
                continue
            v = float(part.loc[provider, value])
            y = i + (j - (len(providers) - 1) / 2) * height
            label = label_for(provider)
            ax.barh(y, v, height=height * 0.92, color=style_for(provider)["color"],
                    label=label if label not in labelled else None)
            labelled.add(label)
            ax.text(v + 0.01, y, f"{v:.2f}×", va="center", fontsize=7.5)
    ax.set_yticks(range(len(groups)), [str(g) for g in groups])
    ax.set_ylim(len(groups) - 0.5, -0.5)
    ax.axvline(1.0, color="black", linestyle="--", linewidth=1.1)
    for name, v in (guides or {}).items():
        ax.axvline(v, color="0.35", linestyle=":", linewidth=1.3)
        ax.annotate(name, (v, 0.0), xycoords=("data", "axes fraction"), textcoords="offset points", xytext=(3, 3),
                    fontsize=7.5, color="0.3", va="bottom", ha="left")
    if xlim is not None:
        ax.set_xlim(*xlim)
    ax.grid(axis="y", visible=False)


def rowcount_figure(bench: pd.DataFrame, *, caption: str):
    """One panel per GEMM of a chunk: median ms (p20–p80 bars) of the Triton row-count kernel, cuBLAS
    on exactly the valid rows and cuBLAS on all rows, per valid-row count n; above each Triton bar its
    ratio to cuBLAS on exactly n rows."""
    kernels = [k for k in ROWCOUNT_KERNELS if k in set(bench["kernel"])]
    fig, axes = plt.subplots(1, len(kernels), figsize=(3.9 * len(kernels), 4.2), layout="constrained", sharey=True,
                             squeeze=False)
    counts = sorted(bench["count"].unique(), reverse=True)
    total = max(counts)
    width = 0.27
    for ax, kernel in zip(axes[0], kernels):
        part = bench[bench["kernel"] == kernel].set_index(["impl", "count"])
        for j, (impl, label, color) in enumerate(ROWCOUNT_IMPLS):
            pos = np.arange(len(counts)) + (j - 1) * width
            ys = np.array([part.loc[(impl, n), "ms_p50"] for n in counts])
            lo = ys - np.array([part.loc[(impl, n), "ms_p20"] for n in counts])
            hi = np.array([part.loc[(impl, n), "ms_p80"] for n in counts]) - ys
            ax.bar(pos, ys, width * 0.95, color=color, label=label, yerr=np.vstack([lo, hi]).clip(min=0),
                   error_kw=dict(elinewidth=0.8, capsize=1.5, ecolor="0.2"))
        for i, n in enumerate(counts):
            r = part.loc[("triton", n), "ms_p50"] / part.loc[("cublas_exact", n), "ms_p50"]
            top = max(part.loc[(impl, n), "ms_p80"] for impl, _, _ in ROWCOUNT_IMPLS[:2])
            ax.text(i - width, top + 0.12, f"{r:.2f}×", ha="center", va="bottom", fontsize=7.5, fontweight="bold",
                    color=ROWCOUNT_IMPLS[0][2])
        ax.set_xticks(range(len(counts)), [f"{n}\n({100 * (1 - n / total):.0f} % ign.)" for n in counts])
        ax.set_xlabel(f"valid rows n of {total}")
        ax.set_title(ROWCOUNT_KERNELS[kernel], fontsize=10)
        ax.grid(axis="x", visible=False)
    axes[0][0].set_ylabel("ms (median, p20–p80)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    # the legend carries the title: a suptitle and an "outside upper" legend would overlap
    fig.legend(handles, labels, loc="outside upper center", ncol=3, fontsize=8,
               title="The row-count GEMMs against cuBLAS, one chunk (bold: Triton ÷ cuBLAS on exactly n rows)",
               title_fontproperties={"size": 11})
    add_caption(fig, caption)
    return fig
