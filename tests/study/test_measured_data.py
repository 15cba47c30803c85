"""data/measured/<gpu>/README.md lists exactly the files of its folder, and every sidecar JSON has
its CSV: a file nobody can place, or a table row for a removed file, fails here."""

import re
from pathlib import Path

import pytest

MEASURED = Path(__file__).resolve().parents[2] / "data" / "measured"
FOLDERS = sorted(p for p in MEASURED.iterdir() if p.is_dir()) if MEASURED.is_dir() else []


def listed_files(readme: Path) -> set[str]:
    """The backticked names in the first cell of every table row."""
    names = set()
    for line in readme.read_text().splitlines():
        if line.startswith("| `"):
            names.update(re.findall(r"`([^`]+)`", line.split("|")[1]))
    return names


@pytest.mark.parametrize("folder", FOLDERS, ids=[p.name for p in FOLDERS])
def test_readme_lists_exactly_the_files(folder):
    files = {p.name for p in folder.iterdir() if p.is_file() and p.name != "README.md"}
    data_files = {name for name in files if not name.endswith(".json")}
    listed = listed_files(folder / "README.md")
    assert sorted(data_files - listed) == [], "files the README's table does not list"
    assert sorted(listed - data_files) == [], "README rows for files that are not there"
    orphans = [name for name in files if name.endswith(".json") and name[:-5] + ".csv" not in files]
    assert orphans == [], "sidecar JSON without its CSV"


@pytest.mark.parametrize("folder", FOLDERS, ids=[p.name for p in FOLDERS])
def test_every_measured_csv_names_its_protocol_and_workload(folder):
    """A ratio is only read within one protocol (sequential, fixed, shuffled) and one workload (dense, masked_*):
    every measured CSV carries both columns, filled on every row."""
    import pandas as pd

    for path in sorted(folder.glob("*.csv")):
        df = pd.read_csv(path, keep_default_na=False)
        missing = [c for c in ("protocol", "workload") if c not in df.columns]
        assert missing == [], f"{path.name} lacks {missing}"
        assert (df["protocol"] != "").all() and (df["workload"] != "").all(), f"{path.name} has empty cells"
