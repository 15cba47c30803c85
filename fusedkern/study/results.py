"""Tidy benchmark results: one CSV row per (op, provider, x, mode) plus a JSON sidecar of provenance.

Why a file format of our own: every number the project shows must be traceable to the run that
made it (GPU, driver, CUDA, torch, triton, competitor versions, commit, command line), and the
figures are regenerated from these files alone. The CSV follows the schema in docs/design.md;
extra columns (accuracy errors, a `note` such as "OOM") come after the schema columns, sorted.

Writing is deterministic: rows sorted, every float column printed with a fixed format, the JSON
with sorted keys. Writing the same rows with the same provenance twice gives identical bytes, so
a re-run that changed nothing leaves no diff. Reading back (`load_results`) needs pandas; writing
does not, so the benchmark runs where pandas is absent (pandas is imported inside the readers).

A sidecar may also hold `{"runs": [...]}`, one record per bench process of a device call that ran each size
in its own process; `load_results` reads it as one record (`runs_meta`).

The notebooks' side: `load_measured` (a missing file is said, not raised), `load_measured_runs`
(several device calls merged so that a ratio never mixes two runs), the workload/protocol selection
every table and figure goes through, and `provenance` lines naming GPU, stack, commit and file.
"""

from __future__ import annotations

import csv
import importlib.metadata
import io
import json
import math
import os
import platform
import re
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pandas is imported inside the readers: writing results must not need it
    import pandas as pd

__all__ = [
    "SCHEMA_COLUMNS",
    "MODES",
    "COMPETITOR_DISTRIBUTIONS",
    "WORKLOAD_KEYS",
    "collect_environment",
    "write_results",
    "read_rows",
    "load_results",
    "runs_meta",
    "sidecar_path",
    "WORKLOAD_COLUMNS",
    "LOSS_TYPE_COLUMN",
    "ALL_LOSS_TYPES",
    "FLOOR_OF_MODE",
    "floor_provider",
    "workloads_in",
    "select_workload",
    "check_one_workload",
    "check_one_row_each",
    "ignored_share",
    "load_measured",
    "load_measured_runs",
    "provenance",
    "runs_provenance",
]

# Column order of docs/design.md; `loss` is optional in a row (written empty when absent).
SCHEMA_COLUMNS = (
    "op",
    "provider",
    "x_name",
    "x",
    "mode",
    "ms_p20",
    "ms_p50",
    "ms_p80",
    "peak_extra_mib",
    "n_reps",
    "loss",
)
_REQUIRED_COLUMNS = SCHEMA_COLUMNS[:-1]
# Rows are sorted by work done, not alphabetically: loss only < forward < backward < full.
MODES = ("loss_only", "forward", "backward", "full")
_MODE_RANK = {mode: rank for rank, mode in enumerate(MODES)}
_ROW_KEY = ("op", "provider", "x_name", "x", "mode")
# Columns that also tell rows apart when present (the benchmark writes them in every row): one file
# may hold several workloads or protocols of the same provider, x and mode; "" when absent.
# `workload` (dense, masked_30, ...: which share of the targets is ignored), `protocol` (sequential,
# fixed (was "interleaved"), shuffled). A file without them holds one workload under one protocol.
WORKLOAD_COLUMNS = ("workload", "protocol")
# The preference sweep's rows also differ by `loss_type` (sigmoid, ..., kto; "all" for the GEMM floors, timed
# once per batch for every loss type): a key column where present, like the workload columns.
LOSS_TYPE_COLUMN = "loss_type"
ALL_LOSS_TYPES = "all"  # the floors' loss_type: timed once per batch, they serve every loss type
_KEY_COLUMNS = (*WORKLOAD_COLUMNS, LOSS_TYPE_COLUMN)

_STR_COLUMNS = {"op", "provider", "x_name", "mode", "note", "workload", "protocol", "head", LOSS_TYPE_COLUMN}
_INT_COLUMNS = {"x", "n_reps"}
# Fixed formats: 0.1 µs resolution for times is below run-to-run noise; 0.1 MiB for memory;
# the loss to 1e-6 is enough to tell providers apart (bf16 losses differ in the 3rd digit).
_FLOAT_FORMATS = {
    "ms_p20": "{:.4f}",
    "ms_p50": "{:.4f}",
    "ms_p80": "{:.4f}",
    "peak_extra_mib": "{:.1f}",
    "loss": "{:.6f}",
}
_ERROR_FORMAT = "{:.4e}"  # err_* columns: relative errors span 1e-16 (fp64) to 1e-2 (bf16)
_OTHER_FLOAT_FORMAT = "{:.6g}"

# Meta keys that define the workload: runs appended to one file must agree on them.
WORKLOAD_KEYS = ("sweep", "hidden", "vocab", "softcap", "dtype", "seq", "seed", "logit_std", "device")

# Distributions whose installed versions go into the provenance (None when absent).
COMPETITOR_DISTRIBUTIONS = ("liger-kernel", "cut-cross-entropy", "quack-kernels", "nvidia-cutlass-dsl")


# ----------------------------------------------------------------------------------------------
# Provenance
# ----------------------------------------------------------------------------------------------


def _distribution_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _run(command: list[str], cwd: Path | None = None) -> str | None:
    """Stripped stdout of a short helper command (nvidia-smi, git); None when absent or failing."""
    try:
        done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


def _portable_arg(arg: str) -> str:
    """A command-line argument as provenance records it: an absolute path inside the repository becomes
    relative to it, any other absolute path only its file name (the measuring machine's folders mean
    nothing elsewhere)."""
    if not arg.startswith("/"):
        return arg
    path = Path(arg)
    root = Path(__file__).resolve().parent.parent
    try:
        return str(path.resolve().relative_to(root))
    except ValueError:
        return path.name


def _git_state() -> tuple[str | None, bool | None]:
    """(commit, dirty) of the checkout this package lives in.

    FUSEDKERN_GIT_COMMIT, when the caller sets it, wins (dirty unknown): a GPU machine may receive
    a copy of the working tree whose `.git` is missing or stale (it once reported the session's
    starting commit, with every later change as "dirty").
    """
    if os.environ.get("FUSEDKERN_GIT_COMMIT"):
        return os.environ["FUSEDKERN_GIT_COMMIT"], None
    repo = Path(__file__).resolve().parents[1]
    commit = _run(["git", "rev-parse", "HEAD"], cwd=repo)
    if not commit:
        return None, None
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo)
    return commit, None if status is None else status != ""


def _gpu_facts() -> dict[str, Any]:
    import torch

    facts: dict[str, Any] = {"gpu_name": None, "gpu_memory_gib": None, "driver_version": None}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        facts["gpu_name"] = props.name
        facts["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
    smi = _run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"])
    if smi:
        name, _, driver = smi.splitlines()[0].rpartition(",")
        facts["driver_version"] = driver.strip()
        facts["gpu_name"] = facts["gpu_name"] or name.strip()
    elif torch.cuda.is_available():
        # Without nvidia-smi, torch knows only the CUDA API level the driver supports.
        api = torch._C._cuda_getDriverVersion()
        facts["driver_version"] = f"CUDA driver API {api // 1000}.{api % 1000 // 10} (nvidia-smi absent)"
    return facts


def collect_environment(command: str | None = None) -> dict[str, Any]:
    """Provenance of a measurement, gathered now. Works without a GPU (GPU fields are then None).

    Keys: gpu_name, gpu_memory_gib, driver_version, cuda_version (the CUDA torch was built with),
    torch, triton, python, platform, competitors {distribution: version or None}, git_commit,
    git_dirty, date_utc (ISO 8601, seconds), command (default: this process's command line).
    """
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    commit, dirty = _git_state()
    if command is None:
        command = shlex.join([Path(sys.executable).name, *(_portable_arg(a) for a in sys.argv)])
    return {
        **_gpu_facts(),
        "cuda_version": torch.version.cuda,
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "competitors": {name: _distribution_version(name) for name in COMPETITOR_DISTRIBUTIONS},
        "git_commit": commit,
        "git_dirty": dirty,
        "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command,
    }


# ----------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------


def sidecar_path(csv_path: str | os.PathLike) -> Path:
    """The provenance JSON beside a results CSV: same stem, `.json`."""
    return Path(csv_path).with_suffix(".json")


def _is_missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _format_value(column: str, value: Any) -> str:
    if _is_missing(value):
        return ""  # pandas reads an empty field as NaN
    if column in _STR_COLUMNS or isinstance(value, str):
        return str(value)
    if column in _INT_COLUMNS:
        if float(value) != int(value):
            raise ValueError(f"column {column!r} must hold integers, got {value!r}")
        return str(int(value))
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    value = float(value)  # numpy and 0-d torch scalars included
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if column in _FLOAT_FORMATS:
        return _FLOAT_FORMATS[column].format(value)
    if column.startswith("err_"):
        return _ERROR_FORMAT.format(value)
    return _OTHER_FLOAT_FORMAT.format(value)


def _columns(rows: list[dict]) -> list[str]:
    extra = sorted({column for row in rows for column in row} - set(SCHEMA_COLUMNS))
    return [*SCHEMA_COLUMNS, *extra]


def _sort_key(row: dict) -> tuple:
    mode = row["mode"]
    return (row["op"], row["x_name"], row["provider"], int(row["x"]), _MODE_RANK.get(mode, len(MODES)), mode,
            *(str(row.get(c, "")) for c in _KEY_COLUMNS))


def _row_key(row: dict) -> tuple:
    return (*(row[c] for c in _ROW_KEY), *(row.get(c, "") for c in _KEY_COLUMNS))


def _check_rows(rows: list[dict]) -> None:
    for index, row in enumerate(rows):
        missing = [column for column in _REQUIRED_COLUMNS if column not in row]
        if missing:
            raise ValueError(f"rows[{index}] lacks the schema columns {missing}")


def _merge_rows(old: list[dict], new: list[dict]) -> list[dict]:
    """Old rows followed by new ones; a new row replaces an old one with the same key (op, provider,
    x_name, x, mode, and workload, protocol and loss_type where present)."""
    new_keys = {_row_key(row) for row in new}
    return [row for row in old if _row_key(row) not in new_keys] + list(new)


def _write_text(path: Path, text: str) -> None:
    # Write then rename, so that a run killed mid-write never leaves a truncated file behind.
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_results(
    rows: list[dict],
    csv_path: str | os.PathLike,
    *,
    meta: dict,
    environment: dict | None = None,
    append: bool = False,
) -> Path:
    """Write `rows` to `csv_path` and the provenance to the sidecar JSON; returns the CSV path.

    rows: dicts with at least the schema columns (`loss` and any extra columns optional).
    meta: facts about the sweep (hidden, vocab, dtype, seed, ...) stored at the top level of the
    JSON beside `environment` (default: `collect_environment()` now; pass a dict to pin it).
    append: merge into an existing CSV: rows with the same (op, provider, x_name, x, mode, and
    workload and protocol where present) are replaced, the others kept; the earlier run's
    provenance stays at the top of the JSON and this run's goes to its list `appended_runs`; the
    WORKLOAD_KEYS in `meta` must agree.
    """
    _check_rows(rows)
    csv_path = Path(csv_path)
    json_path = sidecar_path(csv_path)
    record = {**(collect_environment() if environment is None else environment), **meta}
    if append and csv_path.exists():
        old_record = json.loads(json_path.read_text(encoding="utf-8")) if json_path.exists() else {}
        conflicts = {
            k: (old_record[k], meta[k])
            for k in WORKLOAD_KEYS
            if k in meta and k in old_record and old_record[k] != meta[k]
        }
        if conflicts:
            raise ValueError(f"cannot append to {csv_path}: the workloads differ (old, new): {conflicts}")
        rows = _merge_rows(read_rows(csv_path), rows)
        appended = old_record.get("appended_runs", [])
        # A run that checkpoints after each sweep point appends the same record again: keep one.
        if record != old_record and record not in appended:
            appended = [*appended, record]
        record = {**old_record, "appended_runs": appended}

    rows = sorted(rows, key=_sort_key)
    columns = _columns(rows)
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    lines: list[list[str]] = [columns]
    lines += [[_format_value(c, row.get(c)) for c in columns] for row in rows]
    text = io.StringIO()
    csv.writer(text, lineterminator="\n").writerows(lines)
    _write_text(csv_path, text.getvalue())
    _write_text(json_path, json.dumps(record, indent=2, sort_keys=True) + "\n")
    return csv_path


# ----------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------


def _parse_value(column: str, text: str) -> Any:
    if column in _STR_COLUMNS:
        return text
    if text == "":
        return math.nan
    if column in _INT_COLUMNS:
        return int(text)
    try:
        return float(text)
    except ValueError:
        return text  # an extra column that holds text


def read_rows(csv_path: str | os.PathLike) -> list[dict]:
    """The rows of a results CSV as dicts, typed as `write_results` takes them (no pandas)."""
    with open(csv_path, newline="", encoding="utf-8") as f:
        return [{c: _parse_value(c, v) for c, v in row.items()} for row in csv.DictReader(f)]


def load_results(csv_path: str | os.PathLike):
    """A results CSV as a pandas DataFrame, with its sidecar JSON in `df.attrs["meta"]`.

    Empty numeric fields are NaN, an empty `note` is "". `attrs["meta"]` is {} when the CSV has
    no sidecar (a file not written by `write_results`).
    """
    import pandas as pd

    # Only an empty field is missing: a provider spelled "NA" or "None" stays a string.
    df = pd.read_csv(csv_path, dtype={c: str for c in _STR_COLUMNS}, keep_default_na=False, na_values=[""])
    for column in _STR_COLUMNS & set(df.columns):
        df[column] = df[column].fillna("")
    json_path = sidecar_path(csv_path)
    meta = json.loads(json_path.read_text(encoding="utf-8")) if json_path.exists() else {}
    df.attrs["meta"] = runs_meta(meta)
    return df


def runs_meta(meta: Mapping) -> dict:
    """A sidecar as one record. `{"runs": [record, ...]}` (one record per bench process, as a device call that ran
    each size in its own process leaves them) becomes the keys every run agrees on (GPU, stack, commit, ...), the
    newest run's `date_utc` (what `load_measured_runs` orders files by) and `runs` itself; any other sidecar is
    returned as it is."""
    runs = meta.get("runs")
    if not isinstance(runs, list) or not runs or set(meta) != {"runs"}:
        return dict(meta)
    shared = {k: v for k, v in runs[0].items() if all(k in r and r[k] == v for r in runs[1:])}
    dates = [str(r["date_utc"]) for r in runs if r.get("date_utc")]
    if dates:
        shared["date_utc"] = max(dates)
    shared["runs"] = runs
    return shared


# ----------------------------------------------------------------------------------------------
# Reading measured files for the notebooks (pandas), and where their numbers come from
# ----------------------------------------------------------------------------------------------


# The floor each timing mode is compared with (docs/design.md, "The floor"): the loss alone
# needs the logits GEMM; forward + backward needs three GEMMs (logits, dX, dW).
FLOOR_OF_MODE = {
    "loss_only": "cublas_1gemm",
    "forward": "cublas_1gemm",
    "backward": "cublas_3gemm",
    "full": "cublas_3gemm",
}


def floor_provider(mode: str) -> str:
    """The GEMM floor a mode's times are divided by: cublas_1gemm (loss_only, forward) or cublas_3gemm."""
    return FLOOR_OF_MODE[mode]


def workloads_in(df: pd.DataFrame) -> list[tuple[str, str]]:
    """The distinct (workload, protocol) pairs of `df`, sorted; "" for a column the file lacks."""
    import pandas as pd

    if df.empty:
        return []
    cols = [df[c].fillna("").astype(str) if c in df else pd.Series("", index=df.index) for c in WORKLOAD_COLUMNS]
    return sorted(set(zip(*cols)))


def select_workload(df: pd.DataFrame, workload: str | None = None, protocol: str | None = None) -> pd.DataFrame:
    """The rows of one workload and/or protocol (None: that column is not filtered). Asking for a
    value that `df` does not hold, or filtering on a column it lacks, raises ValueError: an empty
    selection would otherwise draw an empty figure without a word."""
    out = df
    for column, wanted in zip(WORKLOAD_COLUMNS, (workload, protocol)):
        if wanted is None:
            continue
        if column not in out:
            raise ValueError(f"cannot select {column} = {wanted!r}: the data have no {column!r} column")
        have = sorted(set(out[column].fillna("")))
        out = out[out[column].fillna("") == wanted]
        if out.empty:
            raise ValueError(f"no rows with {column} = {wanted!r} (the data hold {have})")
    return out


def check_one_workload(df: pd.DataFrame, what: str = "this table") -> None:
    """Raise ValueError when `df` mixes workloads or protocols: a table, ratio or line drawn from it
    would silently take one of them (or zigzag between them). Select first (`select_workload`)."""
    found = workloads_in(df)
    if len(found) > 1:
        listed = ", ".join(f"{w or '?'}/{p or '?'}" for w, p in found)
        raise ValueError(f"{what} would mix {len(found)} workload/protocol pairs ({listed}): "
                         "select one with select_workload(df, workload=..., protocol=...) or pass workload=")


def check_one_row_each(df: pd.DataFrame, keys: Sequence[str], what: str) -> None:
    """Raise ValueError when two rows share `keys` (one would be dropped or both drawn as one line)."""
    keys = [k for k in keys if k in df]
    if not keys or df.empty:
        return
    duplicated = df.duplicated(keys, keep=False)
    if duplicated.any():
        check_one_workload(df, what)
        first = df.loc[duplicated, keys].iloc[0].to_dict()
        raise ValueError(f"{what}: {int(duplicated.sum())} rows share their {', '.join(keys)} (e.g. {first})")


def ignored_share(workload: str) -> float:
    """The share of targets a workload ignores: "dense" → 0.0, "masked_30" → 0.3."""
    if workload in ("", "dense"):
        return 0.0
    match = re.fullmatch(r"masked_(\d+)", workload)
    if not match:
        raise ValueError(f"unknown workload {workload!r} (expected dense or masked_<percent>)")
    return int(match.group(1)) / 100


def load_measured(path: str | Path, *, workload: str | None = None,
                  protocol: str | None = None) -> pd.DataFrame | None:
    """`load_results(path)`, or None after saying that the file is not there yet.

    The notebooks call this for every measured CSV so that a checkout without measurements still
    renders: the plots that need the file are skipped, the rest of the notebook runs. workload,
    protocol: keep only those rows (`select_workload`; a value the file lacks raises).
    """
    path = Path(path)
    if not path.exists():
        print(f"Not measured yet: {path.as_posix()} is missing, so the figures and tables that need it are "
              "skipped. Produce it on a GPU with `python run_all.py --measure yes` "
              "(or `python -m fusedkern.bench`).")
        return None
    df = load_results(path)
    if workload is None and protocol is None:
        return df
    meta = df.attrs.get("meta", {})
    out = select_workload(df, workload, protocol).reset_index(drop=True)
    out.attrs["meta"] = meta
    return out


def _point_keys(df: pd.DataFrame) -> list[tuple]:
    """Per row: (x, mode, workload, protocol), "" for a workload column the file lacks."""
    import pandas as pd

    extra = [df[c].fillna("").astype(str) if c in df else pd.Series("", index=df.index) for c in WORKLOAD_COLUMNS]
    return list(zip(df["x"], df["mode"], *extra))


def load_measured_runs(paths: Sequence[str | Path]) -> pd.DataFrame | None:
    """Several result CSVs of one sweep, measured in different device calls, as one table in which
    every (x, mode, workload, protocol) comes from a single run: the rows of the *last* file that
    measured that mode's GEMM floor (`floor_provider`) at that point, "last" by the sidecars'
    measurement date. A later run of some modes (say full and loss_only with the final code)
    replaces those modes and keeps the others from the earlier run; a run cut short replaces only
    what it measured; a file of other workloads (say masked_30) adds to one of masked_50. Ratios to
    the floor therefore never mix two runs. Adds a `source` column (the file name per row);
    `attrs["meta"]` is the newest file's sidecar with `sources` = {file: its metadata}."""
    frames = [(Path(p), load_measured(p)) for p in paths]
    frames = [(p, df) for p, df in frames if df is not None]
    if not frames:
        return None
    frames.sort(key=lambda item: str(item[1].attrs.get("meta", {}).get("date_utc", "")))
    chosen: dict = {}  # (x, mode, workload, protocol) -> file name
    for path, df in frames:
        floor_rows = df[[p == floor_provider(m) for p, m in zip(df.provider, df["mode"])]]
        for key in _point_keys(floor_rows):
            chosen[key] = path.name
    parts = []
    for path, df in frames:
        keep = df[[chosen.get(key) == path.name for key in _point_keys(df)]].copy()
        keep["source"] = path.name
        parts.append(keep)
    import pandas as pd

    merged = pd.concat(parts, ignore_index=True)
    merged.attrs["meta"] = dict(frames[-1][1].attrs.get("meta", {}))
    merged.attrs["meta"]["sources"] = {p.name: df.attrs.get("meta", {}) for p, df in frames}
    return merged


def provenance(meta: Mapping | None, source: str | None = None) -> str:
    """One line naming where a figure's numbers come from: GPU, driver, CUDA, torch, triton, date
    (from a results sidecar JSON, see `collect_environment`) and the file."""
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


def runs_provenance(df: pd.DataFrame, where: str) -> tuple[list[str], str]:
    """For a `load_measured_runs` table: one provenance line per run that contributes rows, naming
    its modes and x values, and a one-line figure caption naming every such run's commit and date.
    where: the folder the files are in, as the reader should see it (e.g. "data/measured/h200")."""
    meta = df.attrs["meta"]
    lines, runs = [], []
    for name, run_meta in meta["sources"].items():
        rows = df[df.source == name]
        if rows.empty:
            continue
        xs = ", ".join(str(int(x)) for x in sorted(rows.x.unique()))
        modes = ", ".join(m for m in FLOOR_OF_MODE if m in set(rows["mode"]))
        lines.append(provenance(run_meta, f"{where}/{name} ({rows.x_name.iloc[0]} {xs}; {modes})"))
        commit, date = str(run_meta.get("git_commit", "?"))[:7], str(run_meta.get("date_utc", "?"))[:10]
        runs.append(f"{name}: commit {commit}, {date}")
    shared = {k: v for k, v in meta.items() if k not in ("git_commit", "date_utc", "sources")}
    return lines, provenance(shared, f"{where}/ — " + "; ".join(runs))
