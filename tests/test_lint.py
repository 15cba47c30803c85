"""The repository passes `ruff check` (its rules: pyproject.toml's [tool.ruff]), so the README's test
command lints too. ruff is in requirements.txt; without it this test fails rather than skips."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_passes():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"ruff check found:\n{result.stdout}{result.stderr}"
