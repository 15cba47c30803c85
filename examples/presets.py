"""What examples/train_sft.py and examples/train_dpo.py share: the model-shape preset and the CSV row's
provenance (package versions, commit) and writer. Each example puts its own folder on sys.path first, so this
imports both when an example runs as a script and when it is loaded from its path (tests/test_examples.py)."""

from __future__ import annotations

import csv
import dataclasses
import importlib.metadata
import os
import subprocess


@dataclasses.dataclass(frozen=True)
class Preset:
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    seq_len: int
    batch_size: int
    rope_theta: float = 10000.0


def version(distribution: str) -> str:
    """The installed version of `distribution`, "" where it is not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return ""


def commit() -> str:
    """The repository's short HEAD, "" outside a git checkout."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=os.path.dirname(os.path.abspath(__file__)),
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def append_csv(path: str, row: dict, columns: tuple[str, ...]) -> None:
    """Append `row` (header first if the file is new or empty), one line."""
    new = not os.path.exists(path) or os.path.getsize(path) == 0
    with open(path, "a", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        if new:
            writer.writeheader()
        writer.writerow(row)
