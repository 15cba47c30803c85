"""run_all.py: the quick run renders the sweep notebooks and their figures; a failing notebook fails loudly.

Everything is written under pytest's tmp_path: the committed notebooks/ and figures/ are never
touched. The measured CSVs these tests use are invented on the spot (`write_fake_measurements`,
shaped like the reference anchors) so that the notebooks' measured-data code paths run without a
GPU; they are labelled as fake in their provenance and never leave tmp_path.
"""

from __future__ import annotations

import base64
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests import _interpreter

ROOT = Path(__file__).resolve().parents[2]
RUN_ALL = ROOT / "run_all.py"
NOTEBOOKS = sorted(p.stem for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.py"))

_FAKE_ENV = {"gpu_name": "FAKE GPU (test data)", "torch": "0.0", "triton": "0.0",
             "date_utc": "2000-01-01T00:00:00+00:00",
             "driver_version": None, "cuda_version": None, "competitors": {}, "git_commit": None}
# (provider, ms at 4096 tokens in full mode, extra MiB at 4096 tokens, grows with tokens?)
_FAKE_CE = [
    ("cublas_1gemm", 5.5, 0.0, False), ("cublas_3gemm", 17.5, 0.0, False), ("huggingface_bf16", 21.0, 1972.0, True),
    ("torch_fp32_upcast", 24.0, 4978.0, True), ("liger-kernel 0.8.5", 46.0, 31.0, True),
    ("fusedkern_chunked", 19.0, 2254.0, False), ("fusedkern_chunked_lean", 18.8, 250.0, False),
    ("fusedkern_fused", 25.0, 0.1, True), ("cut_cross_entropy", 78.0, 1.5, False),
]
_FAKE_SIMPO = [
    ("cublas_1gemm", 2.8, 0.0, False), ("cublas_3gemm", 8.7, 0.0, False), ("huggingface_fp32", 11.9, 1988.0, True),
    ("liger-kernel 0.8.5", 14.4, 2021.0, False), ("fusedkern_chunked", 12.0, 2254.0, False),
    ("fusedkern_chunked_lean", 11.8, 250.0, False),
]
_MODE_SHARE = {"loss_only": 0.3, "forward": 0.35, "backward": 0.65, "full": 1.0}


def _fake_rows(op, x_name, xs, providers, unit):
    rows = []
    for provider, ms, mib, grows in providers:
        for x in xs:
            scale = x / unit
            for mode, share in _MODE_SHARE.items():
                if provider == "cublas_1gemm" and mode in ("backward", "full"):
                    continue
                if provider == "cublas_3gemm" and mode in ("loss_only", "forward"):
                    continue
                base = 17.5 if provider == "cublas_1gemm" else ms  # 1 GEMM ≈ a third of the 3-GEMM floor
                t = base * scale * (share if provider != "cublas_1gemm" else 1 / 3)
                rows.append(dict(op=op, provider=provider, x_name=x_name, x=x, mode=mode, ms_p20=t * 0.98,
                                 ms_p50=t, ms_p80=t * 1.03, peak_extra_mib=mib * (scale if grows else 1.0),
                                 n_reps=10, loss=12.6, note=""))
    return rows


def write_fake_measurements(data_dir: Path, gpu: str = "h200") -> Path:
    """Invented ce/simpo/accuracy CSVs (+ sidecars) under data_dir/measured/<gpu>/, for tests only."""
    from fusedkern.study.results import write_results

    out = data_dir / "measured" / gpu
    meta = {"hidden": 4096, "vocab": 128256, "dtype": "bfloat16", "note": "FAKE DATA for tests"}
    write_results(_fake_rows("ce", "tokens", [4096, 8192, 16384, 32768], _FAKE_CE, 4096), out / "ce.csv",
                  meta=meta, environment=_FAKE_ENV)
    write_results(_fake_rows("simpo", "batch", [2, 4, 8, 16], _FAKE_SIMPO, 2), out / "simpo.csv",
                  meta={**meta, "seq": 1024}, environment=_FAKE_ENV)
    acc = []
    for provider, err in (("huggingface_bf16", 3e-3), ("torch_fp32_upcast", 1e-4), ("fusedkern_chunked", 1e-4),
                          ("fusedkern_fused", 5e-5), ("liger-kernel 0.8.5", 2e-4)):
        for x in (4096, 32768):
            acc.append(dict(op="ce", provider=provider, x_name="tokens", x=x, mode="full", ms_p20=math.nan,
                            ms_p50=math.nan, ms_p80=math.nan, peak_extra_mib=100.0, n_reps=0, loss=12.6,
                            err_loss=err / 10, err_dx=err, err_dw=err * 2, note=""))
    write_results(acc, out / "accuracy.csv", meta=meta, environment=_FAKE_ENV)
    return out


def _run(*args: str, timeout: int = 900, tmp: Path | None = None,
         patched_kernels: bool = False) -> subprocess.CompletedProcess:
    """run_all.py in a subprocess; with `tmp`, its temporary folders (staged figures, the partial
    render of a failed notebook) go under tmp too; with `patched_kernels` (and `tmp`), the notebooks' kernels
    run on the tests' interpreter patch (tests/_interpreter.py)."""
    env = dict(os.environ)
    if tmp is not None:
        (tmp / "tmp").mkdir(exist_ok=True)
        env["TMPDIR"] = str(tmp / "tmp")
        if patched_kernels:
            env = _interpreter.notebook_env(tmp, env)
    return subprocess.run([sys.executable, str(RUN_ALL), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)


def _import_run_all():
    sys.path.insert(0, str(ROOT))
    try:
        import run_all
    finally:
        sys.path.remove(str(ROOT))
    return run_all


def _write_notebook(path: Path, *cells: str) -> None:
    """A py:percent source whose first cell is the parameters cell run_all.py fills in."""
    params = 'quick = False\ndata_dir = "data"\nfigures_dir = "figures"\ngpu = "h200"\n'
    path.write_text("\n\n".join(['# %% tags=["parameters"]\n' + params, *("# %%\n" + c for c in cells)]) + "\n")


def test_help():
    done = _run("--help", timeout=120)
    assert done.returncode == 0
    for option in ("--notebooks", "--output-dir", "--figures-dir", "--data-dir", "--quick", "--measure"):
        assert option in done.stdout


#: the notebooks that draw the invented measurements (ce, simpo, accuracy); every notebook renders on the committed
#: data in tests/study/test_study_renders.py
ON_FAKE_DATA = ["02", "03", "04", "05", "06", "07"]


@pytest.mark.slow  # about 40 s: the kernels start and import torch; still part of the default run
def test_quick_run_renders_the_sweep_notebooks_and_figures(tmp_path):
    """The study's notebooks that draw the seed sweeps, in quick mode, on invented measurements (so every plotting
    path of those sweeps runs)."""
    data = tmp_path / "data"
    shutil.copytree(ROOT / "data" / "reference", data / "reference")
    write_fake_measurements(data)
    out, figs = tmp_path / "rendered", tmp_path / "figures"
    start = time.perf_counter()
    done = _run("--quick", "--jobs", "2", "--measure", "no", "--notebooks", *ON_FAKE_DATA, "--output-dir", str(out),
                "--figures-dir", str(figs), "--data-dir", str(data), tmp=tmp_path, patched_kernels=True)
    elapsed = time.perf_counter() - start
    assert done.returncode == 0, done.stderr[-6000:]
    assert sorted(p.stem[:2] for p in out.glob("*.ipynb")) == ON_FAKE_DATA
    check_clean_render(out / "04_latency_tokens.ipynb")
    pngs = sorted(p.stem for p in figs.glob("*.png"))
    assert "headline" in pngs
    assert {p.stem for p in figs.glob("*.svg")} == set(pngs)
    for stem in ("03_memory", "04_ce_latency", "05_simpo_latency", "06_seed_protocol"):
        assert stem in pngs, pngs
    print(f"quick run: {elapsed:.0f} s, figures: {pngs}")


def check_clean_render(path: Path) -> None:
    """A render carries no timestamps, durations or random ids, and names its parameters; a measurement its data
    folder lacks is said, not crashed on."""
    text = path.read_text()
    nb = json.loads(text)
    assert "papermill" not in text and '"execution"' not in text
    assert set(nb["metadata"]) == {"kernelspec", "language_info", "fusedkern"}
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert [c["execution_count"] for c in code] == list(range(1, len(code) + 1))
    assert [c["id"] for c in nb["cells"]] == [f"cell-{i:03d}" for i in range(len(nb["cells"]))]
    tags = [c["metadata"].get("tags", []) for c in nb["cells"]]
    assert ["parameters"] in tags and ["injected-parameters"] in tags
    # the missing measurement is said, not crashed on
    assert "Not measured yet" in text


def test_failing_notebook_exits_nonzero_and_names_it(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "01_fine.py").write_text('# %% tags=["parameters"]\nquick = False\n\n# %%\nprint("fine")\n')
    (src / "02_broken.py").write_text(
        '# %% tags=["parameters"]\nquick = False\n\n# %%\nx = 1\n\n# %%\nraise RuntimeError("kaboom in cell")\n'
    )
    done = _run("--source-dir", str(src), "--measure", "no", "--output-dir", str(tmp_path / "out"),
                "--figures-dir", str(tmp_path / "fig"), "--data-dir", str(tmp_path / "data"), tmp=tmp_path)
    assert done.returncode == 1
    assert "02_broken" in done.stderr
    assert "RuntimeError" in done.stderr and "kaboom in cell" in done.stderr
    assert "raise RuntimeError" in done.stderr  # the failing cell's source is quoted
    assert (tmp_path / "out" / "01_fine.ipynb").exists()  # the others still render
    assert not (tmp_path / "out" / "02_broken.ipynb").exists()


def test_failing_notebook_replaces_none_of_its_figures(tmp_path):
    """Figures are staged per notebook: one that fails half-way leaves figures/ and its render as they
    were, while a notebook that ran publishes its figures (and its render names the real folder)."""
    src, out, figs = tmp_path / "src", tmp_path / "out", tmp_path / "figures"
    src.mkdir()
    save = 'from pathlib import Path\nPath(figures_dir).mkdir(parents=True, exist_ok=True)\n'
    _write_notebook(src / "01_draws.py", save + 'Path(figures_dir, "01_fig.png").write_text("new")')
    _write_notebook(src / "02_breaks.py", save + 'Path(figures_dir, "02_fig.png").write_text("new")',
                    'raise RuntimeError("half-way")')
    figs.mkdir()
    out.mkdir()
    (figs / "02_fig.png").write_text("old")
    (out / "02_breaks.ipynb").write_text("old")
    done = _run("--source-dir", str(src), "--measure", "no", "--jobs", "2", "--output-dir", str(out),
                "--figures-dir", str(figs), "--data-dir", str(tmp_path / "data"), tmp=tmp_path, timeout=120)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "half-way" in done.stderr
    assert (figs / "02_fig.png").read_text() == "old"
    assert (out / "02_breaks.ipynb").read_text() == "old"
    assert (figs / "01_fig.png").read_text() == "new"
    assert sorted(p.name for p in figs.iterdir()) == ["01_fig.png", "02_fig.png"]
    render = json.loads((out / "01_draws.ipynb").read_text())
    injected = next(c for c in render["cells"] if "injected-parameters" in c["metadata"].get("tags", []))
    assert f'figures_dir = "{figs}"' in "".join(injected["source"])


def test_unknown_notebook_is_a_usage_error(tmp_path):
    done = _run("--notebooks", "99", "--measure", "no", "--output-dir", str(tmp_path), timeout=120)
    assert done.returncode == 2
    assert "99" in done.stderr and "01_derivation" in done.stderr


@pytest.mark.parametrize("option, value", [("--jobs", "0"), ("--cell-timeout", "-5"), ("--jobs", "two")])
def test_non_positive_counts_are_usage_errors(option, value, capsys):
    run_all = _import_run_all()
    with pytest.raises(SystemExit) as exit_:
        run_all.parse_args([option, value])
    assert exit_.value.code == 2
    assert option in capsys.readouterr().err


def test_unknown_gpu_is_a_usage_error_before_anything_is_written(tmp_path):
    """A mistyped --gpu must not render "Not measured yet" over the notebooks."""
    src, data, out, figs = tmp_path / "src", tmp_path / "data", tmp_path / "out", tmp_path / "figures"
    src.mkdir()
    _write_notebook(src / "01_plot.py", 'print("plotted")')
    for gpu in ("h200", "a100"):
        (data / "measured" / gpu).mkdir(parents=True)
    done = _run("--source-dir", str(src), "--gpu", "h2000", "--measure", "no", "--output-dir", str(out),
                "--figures-dir", str(figs), "--data-dir", str(data), tmp=tmp_path, timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    assert str(data / "measured" / "h2000") in done.stderr
    assert "a100, h200" in done.stderr
    assert not out.exists() and not figs.exists()


def test_quick_measuring_run_leaves_the_committed_measurements_alone(tmp_path, monkeypatch):
    """--quick --measure yes on a GPU: the smoke sweeps go to a temporary data folder, which the
    notebooks then read; DATA_DIR/measured/<gpu>/ keeps its CSVs. (GPU and sweeps faked.)"""
    run_all = _import_run_all()
    data = tmp_path / "data"
    committed = data / "measured" / "h200" / "ce.csv"
    committed.parent.mkdir(parents=True)
    committed.write_text("committed\n")
    (data / "reference").mkdir()
    (data / "reference" / "anchors.csv").write_text("reference\n")
    sweeps, notebooks = [], []

    def fake_sweep(command):
        out = Path(command[command.index("--out") + 1])
        out.write_text("smoke\n")
        sweeps.append(out)
        return 0

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(run_all, "cuda_gpu_name", lambda: "NVIDIA H200")
    monkeypatch.setattr(run_all, "run_sweep", fake_sweep)
    monkeypatch.setattr(run_all, "execute", lambda source, output_dir, parameters, cell_timeout:
                        notebooks.append((source.stem, parameters)))
    status = run_all.main(["--quick", "--measure", "yes", "--notebooks", "03", "--data-dir", str(data),
                           "--output-dir", str(tmp_path / "out"), "--figures-dir", str(tmp_path / "figures")])
    assert status == 0
    assert committed.read_text() == "committed\n"
    assert sorted(p.name for p in committed.parent.iterdir()) == ["ce.csv"]
    assert [p.name for p in sweeps] == ["ce.csv", "simpo.csv", "accuracy.csv"]
    [(stem, parameters)] = notebooks
    assert stem == "03_memory" and parameters["gpu"] == "h200"
    smoke = Path(parameters["data_dir"])
    assert smoke.resolve() != data.resolve() and data.resolve() not in smoke.resolve().parents
    assert all(p.parent == smoke / "measured" / "h200" for p in sweeps)
    assert (smoke / "reference" / "anchors.csv").read_text() == "reference\n"


def test_error_bound():
    from fusedkern.study.tables import error_bound

    assert error_bound(6.9e-18, 1e-15) == error_bound(0.0, 1e-15) == "≤ 1e-15"
    assert error_bound(1.6e-7, 1e-6) == error_bound(1e-6, 1e-6) == "≤ 1e-6"
    assert error_bound(2.3e-4, 1e-6) == "≤ 1e-3"
    assert error_bound(1.0, 1e-6) == "≤ 1"
    assert error_bound(math.nan, 1e-6) == error_bound(None, 1e-6) == "—"


def _outputs(notebook: str, cell_marker: str | None = None) -> str:
    """The text of a committed render's outputs (of the code cells whose source holds cell_marker)."""
    nb = json.loads((ROOT / "notebooks" / f"{notebook}.ipynb").read_text())
    parts = []
    for cell in nb["cells"]:
        if cell["cell_type"] != "code" or (cell_marker and cell_marker not in "".join(cell["source"])):
            continue
        for out in cell.get("outputs", []):
            parts.append("".join(out.get("text", "")))
            parts += ["".join(v) for k, v in out.get("data", {}).items() if k.startswith("text/")]
    return "\n".join(parts)


def test_rendered_errors_are_bounds_not_rounding_digits():
    """Rounding errors (float64 ~1e-17, fp32 through the interpreter) have digits that vary between
    CPU builds: the committed renders show them as bounds, so a fresh clone re-renders them unchanged."""
    raw = re.compile(r"\d\.\de[-+]\d\d")  # how errors used to be printed: 6.9e-18, 1.6e-07, 0.0e+00
    assert not raw.findall(_outputs("01_derivation")), "notebook 01 prints the digits of rounding errors"
    table = _outputs("02_correctness", "display(table)")
    assert "≤ 1e-6" in table and not raw.findall(table)
    confident = _outputs("02_correctness", "display(confident_shown)")
    rows = [re.findall(r"<td>(.*?)</td>", row) for row in re.findall(r"<tr>(.*?)</tr>", confident, re.S)]
    rows = [cells for cells in rows if cells]
    assert len(rows) == 6
    assert all(cell.startswith("≤") for cells in rows for cell in cells[1:]), rows  # cells[0]: 1 − p_y itself


def test_selection_and_slug():
    run_all = _import_run_all()
    sources = run_all.discover(ROOT / "notebooks")
    assert [p.stem for p in run_all.select(sources, ["4", "02_correctness", "02"])] == [
        "02_correctness", "04_latency_tokens"]
    assert run_all.gpu_slug("NVIDIA H200") == "h200"
    assert run_all.gpu_slug("NVIDIA A100-SXM4-80GB") == "a100_sxm4_80gb"


if __name__ == "__main__":  # invented measurements somewhere, for manual checks: python tests/study/test_run_all.py DIR
    target = Path(sys.argv[1])
    shutil.copytree(ROOT / "data" / "reference", target / "reference", dirs_exist_ok=True)
    print(write_fake_measurements(target))


def test_publish_keeps_a_png_whose_svg_is_unchanged(tmp_path):
    run_all = _import_run_all()
    staged, published = tmp_path / "staged", tmp_path / "published"
    staged.mkdir(), published.mkdir()
    for folder, png, svg in ((published, b"old raster", b"<svg a/>"), (staged, b"new raster", b"<svg a/>")):
        (folder / "same.png").write_bytes(png), (folder / "same.svg").write_bytes(svg)
    (published / "moved.png").write_bytes(b"old"), (published / "moved.svg").write_bytes(b"<svg old/>")
    (staged / "moved.png").write_bytes(b"new"), (staged / "moved.svg").write_bytes(b"<svg new/>")
    (staged / "fresh.png").write_bytes(b"first"), (staged / "fresh.svg").write_bytes(b"<svg f/>")
    kept = run_all.publish_figures(staged, published)
    assert kept == {b"new raster": b"old raster"}
    assert (published / "same.png").read_bytes() == b"old raster"
    assert (published / "moved.png").read_bytes() == b"new" and (published / "moved.svg").read_bytes() == b"<svg new/>"
    assert (published / "fresh.png").read_bytes() == b"first"
    nb = {"cells": [{"outputs": [{"data": {"image/png": base64.b64encode(b"new raster").decode() + "\n"}}]}]}
    nb = type("Nb", (), {"cells": nb["cells"]})()
    run_all.show_kept_figures(nb, kept)
    assert nb.cells[0]["outputs"][0]["data"]["image/png"] == base64.b64encode(b"old raster").decode()
