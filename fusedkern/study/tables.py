"""The study's tables (pandas): provider × size pivots, ratios to the GEMM floor, failures, the
comparison with the reference anchors, and the tables of notebooks 04, 07 and 08 (chunk trade-off,
where a chunk's time goes, host waits, row-count GEMMs). Providers come in one fixed order
(`PROVIDER_ORDER`), the same in tables and in the figures' legends.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np
import pandas as pd

from fusedkern.study.results import (ALL_LOSS_TYPES, LOSS_TYPE_COLUMN, WORKLOAD_COLUMNS, check_one_row_each,
                                     check_one_workload, floor_provider, select_workload)

# The order providers appear in legends and tables: baselines, competitors, ours, the floor.
PROVIDER_ORDER = (
    "huggingface",
    "huggingface_bf16",
    "huggingface_bf16_gather",
    "huggingface_fp32",
    "torch_fp32_upcast",
    "transformers_loss",
    "transformers_loss_gather",
    "liger",
    "liger-kernel 0.4.2",
    "liger-kernel 0.8.5",
    "liger-kernel 0.8.5 +gather",
    "liger-kernel 0.8.5 CuTe SM90",
    "liger-kernel 0.8.5 CuTe SM90 +gather",
    "liger-kernel 0.8.5 CuTe SM90 log-probs",
    "quack",
    "quack_gather",
    "quack-kernels 0.6.5",
    "quack-kernels 0.6.5 +gather",
    "trl 1.16.0 fused LM head",
    "trl 1.16.0 fused LM head log-probs",
    "cut_cross_entropy",
    "fusedkern_chunked",
    "fusedkern_chunked_counted",
    "fusedkern_chunked_device_count",
    "fusedkern_chunked_lean",
    "fusedkern_chunked_lean_counted",
    "fusedkern_fused",
    "fusedkern_generic",
    "fusedkern_gluon",
    "fusedkern_gluon_counted",
    "fusedkern_tile_pass",
    "fusedkern_tile_pass_counted",
    "fusedkern_logprobs",
    "fusedkern_logprobs_counted",
    "fusedkern_logprobs_gluon",
    "fusedkern_logprobs_gluon_counted",
    "fusedkern_logprobs_tile_pass",
    "fusedkern_logprobs_tile_pass_counted",
    "torch_linear_cross_entropy",
    "cublas_1gemm",
    "cublas_1gemm_valid",
    "cublas_3gemm",
    "cublas_3gemm_valid",
    "cublas_3gemm_real_grad",
)


def sort_providers(providers: Iterable[str]) -> list[str]:
    """Unique providers in `PROVIDER_ORDER` (a chunk-size variant `<provider>_c<N>` right after its
    parent, by N), unknown ones after them alphabetically."""
    rank = {p: i for i, p in enumerate(PROVIDER_ORDER)}

    def key(p: str):
        variant = re.fullmatch(r"(.+)_c(\d+)", p)  # chunk-size variants right after their parent, by size
        if variant and variant.group(1) in rank:
            return (rank[variant.group(1)], 1, int(variant.group(2)), p)
        return (rank.get(p, len(rank)), 0, 0, p)

    return sorted(set(providers), key=key)


def error_bound(err: float | None, floor: float) -> str:
    """A numerical error as the power of ten at or above it, never below `floor` (a power of ten):
    error_bound(6.9e-18, 1e-15) == "≤ 1e-15", error_bound(2.3e-4, 1e-6) == "≤ 1e-3"; "—" for none.

    For rendered tables: below a few ulps an error's digits depend on the CPU build (BLAS, SIMD
    math), so printing them would change the committed notebooks from one machine to the next.
    Keep the exact values in the data and the asserts.
    """
    if err is None or math.isnan(err):
        return "—"
    exponent = round(math.log10(floor))
    if err > floor:
        exponent = math.ceil(math.log10(err))
    return "≤ 1" if exponent == 0 else f"≤ 1e{exponent}"


def round_up_log(values: pd.Series, steps_per_decade: int = 4) -> pd.Series:
    """Each positive value rounded up to the next of `steps_per_decade` even steps per decade on a log axis.

    For drawn errors: a figure of exact errors changes from one CPU build to the next (BLAS and SIMD math
    move the last digits), which a quarter-decade step hides while keeping a 2× difference visible."""
    exponents = np.ceil(np.log10(values.astype(float)) * steps_per_decade - 1e-9) / steps_per_decade
    return pd.Series(np.power(10.0, exponents), index=values.index)


def ratio_to(df: pd.DataFrame, baseline: str, *, value: str = "ms_p50",
             keys: Sequence[str] = ("op", "x_name", "x", "mode", *WORKLOAD_COLUMNS, LOSS_TYPE_COLUMN)) -> pd.DataFrame:
    """`value` of every row divided by the `baseline` provider's at the same keys.

    Returns columns keys + provider, value, baseline value and `ratio`, sorted; rows whose keys have
    no baseline row are dropped. To compare modes with different floors, select before calling.
    The keys include workload and protocol where the data have them: each row is divided by the
    floor timed in its own workload's rounds. Two baseline rows at the same keys raise ValueError.
    loss_type (the preference sweep): a baseline row of loss_type "all" (the floors, timed once per batch)
    divides the rows of every loss type at its other keys.
    """
    keys = [k for k in keys if k in df.columns]
    base_rows = df[df["provider"] == baseline]
    on = [k for k in keys if not (k == LOSS_TYPE_COLUMN and len(base_rows)
                                  and (base_rows[k].fillna("").astype(str) == ALL_LOSS_TYPES).all())]
    check_one_row_each(base_rows, on, f"ratio_to({baseline!r})")
    base = base_rows[[*on, value]].rename(columns={value: f"{value}_baseline"})
    out = df[[*keys, "provider", value]].merge(base, on=on, how="inner")
    out["ratio"] = out[value] / out[f"{value}_baseline"]
    rank = {p: i for i, p in enumerate(sort_providers(out["provider"]))}
    out["_rank"] = out["provider"].map(rank)
    return out.sort_values(["_rank", *keys]).drop(columns="_rank").reset_index(drop=True)


def pivot(df: pd.DataFrame, mode: str, value: str = "ms_p50", *, workload: str | None = None,
          protocol: str | None = None) -> pd.DataFrame:
    """provider × x table of `value` in `mode`, providers in the figures' order.

    workload, protocol: take only those rows (`select_workload`). Rows that would share a cell — two
    workloads or protocols of one file, or the same point twice — raise ValueError instead of one
    of them being kept silently."""
    part = select_workload(df[df["mode"] == mode], workload, protocol)
    check_one_workload(part, f"pivot(mode={mode!r})")
    check_one_row_each(part, ("provider", "x"), f"pivot(mode={mode!r})")
    table = part.pivot_table(index="provider", columns="x", values=value, aggfunc="first", dropna=False)
    table = table.loc[sort_providers(table.index)]
    table.columns.name = str(part["x_name"].iloc[0]) if len(part) else "x"
    return table


_CHUNK_VARIANT = re.compile(r"fusedkern_chunked(?P<lean>_lean)?(?:_c(?P<chunk>\d+))?")


def ratio_tables(df: pd.DataFrame, modes: Sequence[str], *, workload: str | None = None,
                 protocol: str | None = None) -> dict[str, pd.DataFrame]:
    """Per mode, provider × x of ms_p50 ÷ that mode's floor (`floor_provider`), where the floor ran
    (of one workload and protocol: `pivot` raises on a mix)."""
    out = {}
    for mode in modes:
        if not (df["mode"] == mode).any():
            continue
        table = pivot(df, mode, workload=workload, protocol=protocol)
        floor = floor_provider(mode)
        if floor in table.index:
            out[mode] = table / table.loc[floor]
    return out


def two_floor_table(df: pd.DataFrame, workload: str, *, mode: str = "full",
                    floors: Sequence[str] = ("cublas_3gemm", "cublas_3gemm_valid")) -> pd.DataFrame:
    """provider × (floor, x) of ms_p50 ÷ each floor timed in the same workload's rounds: the dense
    all-token floor and the floor over the valid rows alone (where it ran), side by side."""
    table = pivot(df, mode, workload=workload)
    parts = {f"× {floor}": table / table.loc[floor] for floor in floors if floor in table.index}
    out = pd.concat(parts, axis=1)
    return out.drop(index=[f for f in floors if f in out.index and f != floors[0]])


def floor_summary(full: pd.DataFrame, ours: Sequence[str], label_for: Callable[[str], str], *,
                  at: Callable[[int], str], span: Callable[[int, int], str]) -> list[str]:
    """The latency notebooks' summary of a pivot of full-step medians (providers × sizes, with
    "cublas_3gemm"): every provider at the largest size in multiples of the three-GEMM floor, fastest
    first, then the range of each of `ours` over all sizes. at(x), span(lo, hi): how a size and a range
    of sizes read ("8192 tokens", "batch 2–16")."""
    ratio = full / full.loc["cublas_3gemm"]
    biggest = max(full.columns)
    lines = [f"At {at(biggest)}, forward + backward, in multiples of the three-GEMM floor "
             f"({full.loc['cublas_3gemm', biggest]:.1f} ms):"]
    for provider, r in ratio[biggest].drop("cublas_3gemm").dropna().sort_values().items():
        lines.append(f"  {label_for(provider):<32} {r:5.2f}×  ({full.loc[provider, biggest]:.1f} ms)")
    for provider in ours:
        if provider in ratio.index:
            row = ratio.loc[provider].dropna()
            lines.append(f"{label_for(provider)}: {row.min():.2f}–{row.max():.2f}× the floor over "
                         f"{span(int(row.index.min()), int(row.index.max()))}")
    return lines


def ahead_of(ratio: pd.DataFrame, provider: str) -> dict:
    """{x: the providers of a provider × x table (a ratio or ms pivot) with a lower value than `provider` at x,
    lowest first}; NaN cells (not measured) are never ahead."""
    out = {}
    for x in ratio.columns:
        column = ratio[x].drop(index=provider).dropna()
        out[x] = list(column[column < ratio.loc[provider, x]].sort_values().index)
    return out


def failed_rows(df: pd.DataFrame) -> pd.DataFrame:
    """The rows the harness could not measure (out of memory, errors), with their note."""
    columns = ["provider", "x", "mode", *(c for c in WORKLOAD_COLUMNS if c in df), "note"]
    notes = df[df["note"].fillna("") != ""][columns]
    return notes.sort_values(columns[:-1]).reset_index(drop=True)


def anchor_comparison(df: pd.DataFrame, anchors: pd.DataFrame, op: str, names: Mapping[str, str]) -> pd.DataFrame:
    """Our full-mode time and memory next to the reference anchors of the same providers.

    anchors: `data/reference/h200_anchors_*.csv`; names: anchor provider → our provider name.
    Returns (provider, x) rows with both measurements and the ratios ours / anchor (empty when none match)."""
    anchors = anchors[(anchors.op == op) & anchors.provider.isin(names)].copy()
    anchors["provider"] = anchors.provider.map(names)
    ours = df[df["mode"] == "full"]
    check_one_workload(ours, "anchor_comparison")
    ours = ours[["provider", "x", "ms_p50", "peak_extra_mib"]]
    both = ours.merge(anchors[["provider", "x", "full_ms", "full_peak_extra_mib"]], on=["provider", "x"])
    both["ms ours / anchor"] = both.ms_p50 / both.full_ms
    both["MiB ours / anchor"] = both.peak_extra_mib / both.full_peak_extra_mib
    return both.set_index(["provider", "x"]).sort_index()


def chunk_tradeoff_table(timing: pd.DataFrame, accuracy: pd.DataFrame | None, *,
                         default_chunk: int | Callable[[str, int], int], floor: pd.DataFrame) -> pd.DataFrame:
    """One row per (accumulation, chunk tokens, tokens): ms_p50, ratio to the floor of the same run,
    peak extra MiB, whether it is the provider's default plan, and, where measured, the relative dW
    error. `timing` holds the chunked variants (full mode), `floor` the `cublas_3gemm` full-mode rows;
    the unsuffixed providers ran with `default_chunk` tokens per chunk, a number or a function
    (provider, tokens) → chunk. Where a default coincides with a study point, the default row stays."""
    rows = []
    floor_ms = floor[(floor["provider"] == "cublas_3gemm") & (floor["mode"] == "full")].set_index("x")["ms_p50"]
    err = {}
    if accuracy is not None and "err_dw" in accuracy:
        err = {(p, x): e for p, x, e in accuracy[["provider", "x", "err_dw"]].itertuples(index=False)}
    chunk_of = default_chunk if callable(default_chunk) else (lambda provider, tokens: default_chunk)
    for r in timing[timing["mode"] == "full"].itertuples(index=False):
        m = _CHUNK_VARIANT.fullmatch(r.provider)
        if not m:
            continue
        rows.append(dict(accumulation="weight dtype (lean)" if m["lean"] else "fp32",
                         chunk_tokens=int(m["chunk"] or chunk_of(r.provider, int(r.x))), tokens=int(r.x),
                         default=not m["chunk"], ms_p50=r.ms_p50, ratio=r.ms_p50 / floor_ms.get(r.x, float("nan")),
                         peak_extra_mib=r.peak_extra_mib, err_dw=err.get((r.provider, r.x), float("nan"))))
    table = pd.DataFrame(rows).sort_values(["accumulation", "chunk_tokens", "tokens", "default"],
                                           ascending=[True, True, True, False])
    return table.drop_duplicates(["accumulation", "chunk_tokens", "tokens"]).reset_index(drop=True)


def chunk_error_table(accuracy: pd.DataFrame, *, default_chunk: int | Callable[[str, int], int]) -> pd.DataFrame:
    """(accumulation, chunk_tokens, tokens, err_dw) of the chunked variants in an accuracy sweep."""
    chunk_of = default_chunk if callable(default_chunk) else (lambda provider, tokens: default_chunk)
    rows = []
    for r in accuracy.itertuples(index=False):
        m = _CHUNK_VARIANT.fullmatch(r.provider)
        if m and not math.isnan(r.err_dw):
            rows.append(dict(accumulation="weight dtype (lean)" if m["lean"] else "fp32", tokens=int(r.x),
                             chunk_tokens=int(m["chunk"] or chunk_of(r.provider, int(r.x))), err_dw=r.err_dw))
    return pd.DataFrame(rows, columns=["accumulation", "chunk_tokens", "tokens", "err_dw"]).drop_duplicates(
        ["accumulation", "chunk_tokens", "tokens"]).sort_values(["accumulation", "chunk_tokens"])


CHUNK_COST_PARTS = (  # (probe label, bar label); the dW parts are the surcharge over writing dW once
    ("gemm_logits", "logits GEMM"),
    ("gemm_dx", "dX GEMM"),
    ("gemm_dw_write", "dW GEMM (write)"),
    ("dw_accumulate", "dW accumulate (β = 1) surcharge"),
    ("row_kernel", "row kernel (lse, loss, ∂L/∂z in place)"),
)


def chunk_cost_table(probe: pd.DataFrame) -> pd.DataFrame:
    """Per chunk size C and accumulation: ms of each part of a chunk, from the JSON lines of
    `probes/probe_rows.py` (each GEMM and the row kernel timed alone). The accumulate surcharge is
    (accumulating GEMM − writing GEMM); the row kernel is the shipped layout's net time."""
    rows = []
    for C, part in probe.groupby("C"):
        by = {r.what: r for r in part.itertuples(index=False)}
        shipped = next(r for w, r in by.items() if w.startswith("ce_rows_shipped"))
        for accumulation, gemm in (("bf16 (lean)", "gemm_dw_accum_bf16"), ("fp32", "gemm_dw_accum_fp32")):
            ms = {"gemm_logits": by["gemm_logits"].ms_p50, "gemm_dx": by["gemm_dx"].ms_p50,
                  "gemm_dw_write": by["gemm_dw_write"].ms_p50,
                  "dw_accumulate": by[gemm].ms_p50 - by["gemm_dw_write"].ms_p50,
                  "row_kernel": shipped.ms_p50_net}
            total = sum(ms.values())
            three = ms["gemm_logits"] + ms["gemm_dx"] + ms["gemm_dw_write"]
            rows.append(dict(chunk_tokens=int(C), accumulation=accumulation, **{k: round(v, 4) for k, v in ms.items()},
                             total_ms=round(total, 4), over_three_gemms=round(total / three, 4)))
    return pd.DataFrame(rows)


def host_waits_table(probe: pd.DataFrame) -> pd.DataFrame:
    """`probes/probe_host.py`'s JSON lines, one row per (variant, mode) of the fusedkern steps:
    ms_p50, its ratio to the floor of the same process, and extra_ms over the code as shipped."""
    steps = probe[probe.case.str.match(r"^(default|lean)_")].copy()
    steps[["mode", "variant"]] = steps.case.str.split("_", n=1, expand=True)
    shipped_ms = steps[steps.variant == "shipped"].set_index("mode").ms_p50
    steps["extra_ms"] = steps.ms_p50 - steps["mode"].map(shipped_ms)
    return steps[["variant", "mode", "ms_p50", "ratio", "extra_ms"]].reset_index(drop=True)


ROWCOUNT_IMPLS = (  # (impl in rowcount_gemm.csv, label, color)
    ("triton", "row-count GEMM (Triton, n read on the device)", "#e6550d"),
    ("cublas_exact", "cuBLAS on exactly the n valid rows (n on the host)", "#525252"),
    ("cublas_full", "cuBLAS on all rows", "#bdbdbd"),
)


ROWCOUNT_KERNELS = {"logits": "logits  X·Wᵀ", "dx": "dX  G·W", "dw_bf16": "dW  Gᵀ·X into bf16",
                     "dw_fp32_acc": "dW  Gᵀ·X accumulated into fp32"}


def rowcount_table(bench: pd.DataFrame) -> pd.DataFrame:
    """`scripts/bench_rowcount_gemm.py`'s rows as one row per (kernel, valid rows n): each impl's
    median ms and the Triton kernel's time ÷ cuBLAS on exactly n rows and ÷ cuBLAS on all rows."""
    check_one_row_each(bench, ("kernel", "count", "impl", "protocol", "shape"), "rowcount_table")
    check_one_workload(bench.drop(columns="workload", errors="ignore"), "rowcount_table")
    ms = bench.pivot_table(index=["kernel", "count", "workload"], columns="impl", values="ms_p50", aggfunc="first")
    order = {k: i for i, k in enumerate(ROWCOUNT_KERNELS)}
    ms = ms.reset_index()
    ms["_k"] = ms["kernel"].map(order)
    ms = ms.sort_values(["_k", "count"], ascending=[True, False]).drop(columns="_k")
    ms = ms.set_index(["kernel", "count", "workload"])
    ms = ms[[impl for impl, _, _ in ROWCOUNT_IMPLS if impl in ms.columns]]
    ms.columns.name = None
    out = ms.rename(columns={impl: f"{impl} ms" for impl in ms.columns})
    out["triton ÷ cuBLAS exact-n"] = ms["triton"] / ms["cublas_exact"]
    out["triton ÷ cuBLAS all rows"] = ms["triton"] / ms["cublas_full"]
    out["n ÷ all rows"] = out.index.get_level_values("count") / bench["count"].max()
    return out
