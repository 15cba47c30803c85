"""Tidy benchmark results: one CSV row per (op, provider, x, mode) plus a JSON sidecar of provenance.

Why a file format of our own: every number the project shows must be traceable to the run that
made it (GPU, driver, CUDA, torch, triton, competitor versions, commit, command line), and the
figures are regenerated from these files alone. The CSV follows the schema in docs/design.md;
extra columns (accuracy errors, a `note` such as "OOM") come after the schema columns, sorted.

Writing is deterministic: rows sorted, every float column printed with a fixed format, the JSON
with sorted keys. Writing the same rows with the same provenance twice gives identical bytes, so
a re-run that changed nothing leaves no diff. Reading back (`load_results`) needs pandas; writing
does not, so the benchmark runs where pandas is absent.
"""

from __future__ import annotations

import csv
import importlib.metadata
import io
import json
import math
import os
import platform
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

__all__ = [
    "SCHEMA_COLUMNS",
    "MODES",
    "COMPETITOR_DISTRIBUTIONS",
    "WORKLOAD_KEYS",
    "collect_environment",
    "write_results",
    "read_rows",
    "load_results",
    "sidecar_path",
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
# Columns that also tell rows apart when present (`fusedkern.bench` writes them in every row): one
# file may hold several workloads or protocols of the same provider, x and mode. "" when absent.
_OPTIONAL_KEY_COLUMNS = ("workload", "protocol")

_STR_COLUMNS = {"op", "provider", "x_name", "mode", "note", "workload", "protocol", "head"}
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
            *(str(row.get(c, "")) for c in _OPTIONAL_KEY_COLUMNS))


def _row_key(row: dict) -> tuple:
    return (*(row[c] for c in _ROW_KEY), *(row.get(c, "") for c in _OPTIONAL_KEY_COLUMNS))


def _check_rows(rows: list[dict]) -> None:
    for index, row in enumerate(rows):
        missing = [column for column in _REQUIRED_COLUMNS if column not in row]
        if missing:
            raise ValueError(f"rows[{index}] lacks the schema columns {missing}")


def _merge_rows(old: list[dict], new: list[dict]) -> list[dict]:
    """Old rows followed by new ones; a new row replaces an old one with the same key (op, provider,
    x_name, x, mode, and workload and protocol where present)."""
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
    df.attrs["meta"] = json.loads(json_path.read_text(encoding="utf-8")) if json_path.exists() else {}
    return df
