"""`python run_all.py` leaves `git status` clean: the main job's render of every notebook, redone here into a
temporary copy, equals the committed notebooks and figures byte for byte.

The render goes over a copy of the committed figures, as `python run_all.py` does over figures/ (a PNG whose SVG
is unchanged keeps its committed bytes: rasterization differs between CPUs in anti-aliased pixels). The only
difference allowed is the figures folder shown in each notebook's parameters cell, which is a temporary path here
and `../figures` in the committed render. A notebook whose source changed without a new render fails here too, and
so does a figure the render did not save again (its committed copy would pass unseen).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import _interpreter

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted(p.stem for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.py"))


@pytest.mark.slow  # about 1–2 minutes on two cores: every notebook at full size; CI runs it (no marker filter)
def test_main_job_renders_every_notebook_and_figure_as_committed(tmp_path):
    out, figs = tmp_path / "rendered", tmp_path / "figures"
    shutil.copytree(ROOT / "figures", figs)
    committed_figures = {p.name: p.read_bytes() for p in (ROOT / "figures").iterdir() if p.is_file()}
    copied_svg_inodes = {p.name: p.stat().st_ino for p in figs.glob("*.svg")}
    # run_all's staging folders stay under tmp_path; the kernels run on the tests' interpreter patch, which gives
    # the same bits (tests/_interpreter.py)
    env = _interpreter.notebook_env(tmp_path, dict(os.environ, TMPDIR=str(tmp_path)))
    start = time.perf_counter()
    done = subprocess.run([sys.executable, str(ROOT / "run_all.py"), "--measure", "no", "--jobs", "2",
                           "--output-dir", str(out), "--figures-dir", str(figs)],
                          cwd=ROOT, capture_output=True, text=True, timeout=1200, env=env)
    elapsed = time.perf_counter() - start
    assert done.returncode == 0, done.stderr[-6000:]
    assert sorted(p.stem for p in out.glob("*.ipynb")) == NOTEBOOKS
    shown = f'figures_dir = \\"{figs}\\"'
    changed = []
    for name in NOTEBOOKS:
        text = (out / f"{name}.ipynb").read_text()
        assert shown in text, name  # the parameters cell names the folder it was given
        if text.replace(shown, 'figures_dir = \\"../figures\\"') != (ROOT / "notebooks" / f"{name}.ipynb").read_text():
            changed.append(f"notebooks/{name}.ipynb")
    rendered = {p.name: p.read_bytes() for p in figs.iterdir() if p.is_file()}
    assert sorted(rendered) == sorted(committed_figures), "a notebook wrote a figure that is not committed"
    # every SVG was saved again (a new file over the copy), so the bytes compared below are this render's
    stale = [p.name for p in figs.glob("*.svg") if p.stat().st_ino == copied_svg_inodes.get(p.name)]
    assert not stale, f"not saved by the render: {stale}"
    changed += [f"figures/{n}" for n in sorted(rendered) if rendered[n] != committed_figures[n]]
    assert not changed, f"python run_all.py would modify {changed} (re-render and commit, or find what moved)"
    print(f"main job re-rendered {len(NOTEBOOKS)} notebooks and {len(rendered)} figures in {elapsed:.0f} s")
