"""Figures for the notebooks: one look for every provider, and files that do not change unless the data do.

Determinism: `save_figure` writes PNG and SVG with a fixed DPI, a fixed `svg.hashsalt` (matplotlib
otherwise draws random ids into every SVG), no Date/Software metadata, and a bundled font (DejaVu
Sans), so re-running a notebook on unchanged data leaves the files byte-identical and the commit
clean. The plotting helpers sort their inputs (providers in a fixed order, x ascending) so that the
order rows arrive in does not change the drawing either.

Conventions: x axes are log₂ with the actual sizes as tick labels (4096, 8192, …); medians are
drawn with p20–p80 error bars (the quantiles the seeds report); the compute floor is a black line
with the unreachable region below it shaded; every figure carries a caption saying where its numbers
come from (`provenance`).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.ticker import FixedFormatter, FixedLocator, NullLocator

__all__ = [
    "DPI",
    "PROVIDER_ORDER",
    "use_style",
    "style_for",
    "label_for",
    "sort_providers",
    "SavedFigure",
    "save_figure",
    "size_axis",
    "plot_quantiles",
    "draw_floor",
    "ratio_to",
    "plot_ratios",
    "plot_memory",
    "plot_seed_vs_ours",
    "provenance",
    "add_caption",
]

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

# The order providers appear in legends and tables: baselines, competitors, ours, the floor.
PROVIDER_ORDER = (
    "huggingface",
    "huggingface_bf16",
    "huggingface_fp32",
    "torch_fp32_upcast",
    "liger",
    "liger-kernel 0.4.2",
    "liger-kernel 0.8.5",
    "cut_cross_entropy",
    "fusedkern_chunked",
    "fusedkern_chunked_lean",
    "fusedkern_fused",
    "cublas_1gemm",
    "cublas_3gemm",
)

_STYLES: dict[str, dict] = {
    "huggingface": dict(color="#7f7f7f", marker="s", label="Hugging Face (seed, A100)"),
    "huggingface_bf16": dict(color="#7f7f7f", marker="s", label="HF, bf16 logits"),
    "huggingface_fp32": dict(color="#8c564b", marker="s", label="HF, fp32-upcast logits"),
    "torch_fp32_upcast": dict(color="#bcbd22", marker="D", label="torch, fp32 upcast"),
    "liger": dict(color="#aec7e8", marker="^", label="Liger (seed, A100)"),
    "liger-kernel 0.4.2": dict(color="#aec7e8", marker="^", label="Liger 0.4.2"),
    "liger-kernel 0.8.5": dict(color="#1f77b4", marker="^", label="Liger 0.8.5"),
    "cut_cross_entropy": dict(color="#2ca02c", marker="v", label="Cut Cross-Entropy"),
    "fusedkern_chunked": dict(color="#d62728", marker="o", label="fusedkern chunked", linewidth=2.2),
    "fusedkern_chunked_lean": dict(color="#ff9896", marker="o", label="fusedkern chunked (lean dW)"),
    "fusedkern_fused": dict(color="#9467bd", marker="P", label="fusedkern fused"),
    "cublas_1gemm": dict(color="black", marker="", linestyle=":", label="1 cuBLAS GEMM"),
    "cublas_3gemm": dict(color="black", marker="", linestyle="--", label="floor: 3 cuBLAS GEMMs"),
}
_FALLBACK_COLORS = ("#17becf", "#e377c2", "#ff7f0e", "#c5b0d5", "#98df8a", "#c49c94")


def use_style() -> None:
    """Apply the project's rcParams (call once per notebook; `save_figure` re-applies the SVG salt)."""
    matplotlib.rcParams.update(_RC)


def style_for(provider: str) -> dict:
    """Line style of `provider` (color, marker, linestyle, linewidth, label): the same in every figure.

    Unknown providers get a color chosen by a checksum of the name, so it is stable across runs.
    """
    base = dict(marker="o", linestyle="-", linewidth=1.5, label=provider)
    if provider in _STYLES:
        return {**base, **_STYLES[provider]}
    color = _FALLBACK_COLORS[zlib.crc32(provider.encode()) % len(_FALLBACK_COLORS)]
    return {**base, "color": color}


def label_for(provider: str) -> str:
    return style_for(provider)["label"]


def sort_providers(providers: Iterable[str]) -> list[str]:
    """Unique providers in `PROVIDER_ORDER`, unknown ones after them alphabetically."""
    rank = {p: i for i, p in enumerate(PROVIDER_ORDER)}
    return sorted(set(providers), key=lambda p: (rank.get(p, len(rank)), p))


# ----------------------------------------------------------------------------------------------
# Saving
# ----------------------------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------------------------
# Axes helpers
# ----------------------------------------------------------------------------------------------


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
    ax.plot(xs, ys, color="black", linestyle="--", linewidth=1.4, label=label, zorder=5)
    if shade:
        ax.fill_between(xs, np.full_like(ys, 1e-9), ys, color="0.85", alpha=0.6, linewidth=0, zorder=0,
                        label="below the floor")


def ratio_to(df: pd.DataFrame, baseline: str, *, value: str = "ms_p50",
             keys: Sequence[str] = ("op", "x_name", "x", "mode")) -> pd.DataFrame:
    """`value` of every row divided by the `baseline` provider's at the same keys.

    Returns columns keys + provider, value, baseline value and `ratio`, sorted; rows whose keys have
    no baseline row are dropped. To compare modes with different floors, select before calling.
    """
    keys = [k for k in keys if k in df.columns]
    base = df[df["provider"] == baseline][[*keys, value]].rename(columns={value: f"{value}_baseline"})
    out = df[[*keys, "provider", value]].merge(base, on=keys, how="inner")
    out["ratio"] = out[value] / out[f"{value}_baseline"]
    rank = {p: i for i, p in enumerate(sort_providers(out["provider"]))}
    out["_rank"] = out["provider"].map(rank)
    return out.sort_values(["_rank", *keys]).drop(columns="_rank").reset_index(drop=True)


def plot_ratios(ax, ratios: pd.DataFrame, *, x: str = "x", baseline_label: str = "floor (= 1)",
                annotate: Sequence[str] | bool = True, skip: Sequence[str] = ()) -> None:
    """Ratio to the baseline vs x per provider, a line at 1 with the region below shaded, and the
    ratio written next to the points of the providers in `annotate` (True: all)."""
    shown = ratios[~ratios["provider"].isin(skip) & ratios["ratio"].notna()]
    if shown.empty:
        return
    for provider in sort_providers(shown["provider"]):
        part = shown[shown["provider"] == provider].sort_values(x)
        style = style_for(provider)
        ax.plot(part[x], part["ratio"], color=style["color"], marker=style["marker"] or "o",
                linestyle=style["linestyle"], linewidth=style["linewidth"], label=style["label"], markersize=5)
        if annotate is True or provider in (annotate or ()):
            for xv, r in zip(part[x], part["ratio"]):
                ax.annotate(f"{r:.2f}×", (xv, r), textcoords="offset points", xytext=(4, 4), fontsize=7,
                            color=style["color"])
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1.2, label=baseline_label)
    lo = min(0.9, float(shown["ratio"].min()) * 0.95)
    hi = float(shown["ratio"].max()) * 1.12
    ax.axhspan(lo, 1.0, color="0.85", alpha=0.6, linewidth=0, zorder=0)
    ax.set_ylim(lo, hi)
    size_axis(ax, shown[x], label=str(shown["x_name"].iloc[0]) if "x_name" in shown else None)
    ax.set_ylabel("× the baseline (median ms)")


def plot_memory(ax, model: pd.DataFrame | None, measured: pd.DataFrame | None = None, *, x: str = "x",
                value: str = "peak_extra_mib", log_y: bool = True) -> None:
    """Peak extra memory vs x: the analytic model as lines, measured points as markers on top.

    `model` and `measured` have columns provider, x and `value` (the model's may be named mib).
    """
    drawn_x: list = []
    values: list = []
    if model is not None and not model.empty:
        col = value if value in model else "mib"
        for provider in sort_providers(model["provider"]):
            part = model[model["provider"] == provider].sort_values(x)
            style = style_for(provider)
            ax.plot(part[x], part[col].clip(lower=0.01), color=style["color"], linestyle="-",
                    linewidth=1.2, alpha=0.8, label=f"{style['label']} (model)")
            drawn_x += list(part[x])
            values += list(part[col])
    if measured is not None and not measured.empty:
        for provider in sort_providers(measured["provider"]):
            part = measured[(measured["provider"] == provider) & measured[value].notna()].sort_values(x)
            if part.empty:
                continue
            style = style_for(provider)
            ax.plot(part[x], part[value].clip(lower=0.01), color=style["color"], marker=style["marker"] or "o",
                    linestyle="none", markersize=7, markerfacecolor="none", markeredgewidth=1.5,
                    label=f"{style['label']} (measured)")
            drawn_x += list(part[x])
            values += list(part[value])
    if drawn_x:
        size_axis(ax, drawn_x)
    if log_y:
        ax.set_yscale("log")
        v = np.asarray([max(float(t), 0.01) for t in values]) if values else np.asarray([1.0])
        ticks = [t for t in (0.1, 1, 10, 100, 1_000, 10_000, 100_000) if v.min() / 3 <= t <= v.max() * 3]
        if len(ticks) >= 2:
            ax.yaxis.set_major_locator(FixedLocator(ticks))
            ax.yaxis.set_major_formatter(FixedFormatter([f"{t:g}" for t in ticks]))
            ax.yaxis.set_minor_locator(NullLocator())
    ax.set_ylabel("peak extra memory, MiB")


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


# ----------------------------------------------------------------------------------------------
# Provenance
# ----------------------------------------------------------------------------------------------


def provenance(meta: Mapping | None, source: str | None = None) -> str:
    """One line naming where a figure's numbers come from: GPU, driver, CUDA, torch, triton, date
    (from a results sidecar JSON, see `fusedkern.results.collect_environment`) and the file."""
    meta = dict(meta or {})
    parts = []
    gpu = meta.get("gpu_name") or meta.get("gpu")
    if gpu:
        parts.append(str(gpu))
    for key, name in (("driver_version", "driver"), ("cuda_version", "CUDA"), ("torch", "torch"),
                      ("triton", "triton")):
        if meta.get(key):
            parts.append(f"{name} {meta[key]}")
    competitors = meta.get("competitors") or {}
    parts += [f"{k} {v}" for k, v in sorted(competitors.items()) if v]
    for key in ("dtype",):
        if meta.get(key):
            parts.append(str(meta[key]))
    for key, name in (("hidden", "H"), ("vocab", "V")):
        if meta.get(key):
            parts.append(f"{name}={meta[key]}")
    date = meta.get("date_utc") or meta.get("date")
    if date:
        parts.append(f"measured {str(date)[:10]}")
    commit = meta.get("git_commit")
    if commit:
        parts.append(f"commit {str(commit)[:10]}")
    if source:
        parts.append(f"data: {source}")
    return " · ".join(parts)


def add_caption(fig, text: str, *, width: int = 150) -> None:
    """A small grey caption under the figure (wrapped at `width` characters)."""
    import textwrap

    wrapped = "\n".join(textwrap.wrap(text, width=width, break_on_hyphens=False))
    fig.text(0.0, -0.01, wrapped, ha="left", va="top", fontsize=7, color="0.35", transform=fig.transFigure)
