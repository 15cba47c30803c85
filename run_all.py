#!/usr/bin/env python3
"""Re-execute the study notebooks (and, on a GPU, refresh the measurements they plot).

    python run_all.py                      # every notebook, rendered into notebooks/, figures into figures/
    python run_all.py --notebooks 02 04    # a selection, by number or name
    python run_all.py --quick --output-dir smoke/nb --figures-dir smoke/fig   # fast smoke run

The notebooks' sources are jupytext py:percent files (`notebooks/NN_name.py`). Each is converted to
a notebook, executed with papermill (its `parameters` cell receives quick, data_dir, figures_dir
and gpu), stripped of what changes from run to run (timestamps, durations, kernel versions, random
cell ids, split stream outputs) and written as `NN_name.ipynb`: re-running on unchanged data leaves
no diff. `--measure auto` (default) first runs the benchmark sweeps when a CUDA GPU is present
(`python -m fusedkern.bench ce|simpo|accuracy`, writing data/measured/<gpu>/); without a GPU the
notebooks re-draw every figure from the committed data and check correctness through Triton's
interpreter at small shapes.

`--quick --measure yes` is a smoke test of the measuring path (two sizes, few repetitions): its
sweeps go to a fresh temporary data folder (measured/<gpu>/ plus a copy of reference/), which the
notebooks of that run read and whose path is printed. The measurements in DATA_DIR are never
replaced by smoke data.

A notebook writes its figures into a temporary folder of its own; they replace those in
FIGURES_DIR, and its rendering is written into OUTPUT_DIR, only when the whole notebook ran. A
failing notebook leaves both as they were.

Exit status: 0 when every selected notebook ran, 1 when one failed (the message names the
notebook and the cell), 2 for bad arguments (an unknown notebook, a --gpu without
DATA_DIR/measured/<gpu>/, a non-positive --jobs or --cell-timeout).
"""

from __future__ import annotations

import argparse
import base64
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
NOTEBOOK_PATTERN = re.compile(r"^(\d\d)_[A-Za-z0-9_]+\.py$")
SWEEPS = ("ce", "simpo", "accuracy")  # the sweeps `python -m fusedkern.bench` runs, one CSV each
# --quick --measure yes: a smoke test of the measuring path (two sizes, few reps), not data to publish
QUICK_SWEEP_ARGS = {
    "ce": ["--tokens", "4096", "8192", "--reps", "5", "--min-reps", "3"],
    "simpo": ["--batch", "2", "4", "--reps", "5", "--min-reps", "3"],
    "accuracy": ["--tokens", "4096"],
}
DEFAULT_GPU = "h200"  # whose committed measurements the notebooks draw when nothing was measured now
KERNEL_NAME = "python3"
# The notebooks' kernels: notebooks 01 and 02 measure rounding errors, whose last bits follow every CPU GEMM. MKL
# (torch's CPU BLAS) picks its code path by the CPU and by the operands' memory alignment, which moves from run to
# run: COMPATIBLE fixes one path on every x86 CPU and any alignment (Intel's Conditional Numerical
# Reproducibility). One thread: a reduction split over threads rounds by the thread count, which machines differ
# in. The renders show those errors as bounds (notebook 02), so they do not rest on this alone.
REPRODUCIBLE_NUMERICS = {"MKL_CBWR": "COMPATIBLE", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                         "OPENBLAS_NUM_THREADS": "1"}


class NotebookFailed(Exception):
    """A notebook did not run to the end; the message says which one and where."""


class UsageError(Exception):
    """The arguments ask for something that does not exist (exit status 2)."""


# ----------------------------------------------------------------------------------------------
# Arguments and selection
# ----------------------------------------------------------------------------------------------


def positive_int(text: str) -> int:
    """argparse type: an integer ≥ 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="run_all.py",
        description="Execute the study notebooks with papermill and write rendered copies and figures.",
        epilog="Example: python run_all.py --notebooks 02 04 --quick --output-dir smoke/nb --figures-dir smoke/fig",
    )
    parser.add_argument("--notebooks", nargs="+", metavar="NN", default=None,
                        help="which notebooks to run, by number (02) or name (02_correctness); default: all")
    parser.add_argument("--output-dir", type=Path, default=ROOT / "notebooks",
                        help="where the rendered .ipynb files go (default: notebooks/)")
    parser.add_argument("--figures-dir", type=Path, default=ROOT / "figures",
                        help="where the notebooks save their PNG and SVG figures (default: figures/)")
    parser.add_argument("--data-dir", type=Path, default=ROOT / "data",
                        help="the data the notebooks read: measured/<gpu>/ and reference/ (default: data/)")
    parser.add_argument("--quick", action="store_true",
                        help="fewer and smaller cases in every notebook (a smoke run, for tests)")
    parser.add_argument("--measure", choices=("auto", "yes", "no"), default="auto",
                        help="run the benchmark sweeps (python -m fusedkern.bench ce|simpo|accuracy) into "
                             "DATA_DIR/measured/<gpu>/ first: auto = when a CUDA GPU is present and not --quick "
                             "(default); yes with --quick runs reduced sweeps into a temporary data folder "
                             "(printed), never into DATA_DIR")
    parser.add_argument("--gpu", default=None,
                        help=f"which DATA_DIR/measured/<gpu>/ the notebooks plot; it must exist unless this run "
                             f"measures that GPU (default: the GPU measured now, else {DEFAULT_GPU})")
    parser.add_argument("--source-dir", type=Path, default=ROOT / "notebooks",
                        help="where the py:percent sources are (default: notebooks/)")
    parser.add_argument("--cell-timeout", type=positive_int, default=1800, metavar="S",
                        help="seconds one cell may run before the notebook counts as failed (default: 1800)")
    parser.add_argument("--jobs", type=positive_int, default=1, metavar="N",
                        help="notebooks executed at the same time (default: 1; each runs in its own kernel)")
    parser.add_argument("--fail-fast", action="store_true", help="stop at the first failing notebook")
    parser.add_argument("--list", action="store_true", help="list the notebooks and exit")
    return parser.parse_args(argv)


def discover(source_dir: Path) -> list[Path]:
    """The notebook sources `NN_name.py` in reading order."""
    return sorted(p for p in source_dir.glob("*.py") if NOTEBOOK_PATTERN.match(p.name))


def select(sources: list[Path], wanted: list[str] | None) -> list[Path]:
    """Sources matching `wanted` ("02", "2", "02_correctness" or "02_correctness.py"), in order."""
    if not wanted:
        return sources
    chosen = []
    for want in wanted:
        key = want.removesuffix(".py").removesuffix(".ipynb")
        if key.isdigit():
            key = f"{int(key):02d}"
        matches = [p for p in sources if p.stem == key or p.stem.split("_", 1)[0] == key]
        if not matches:
            names = ", ".join(p.stem for p in sources) or "(none)"
            raise UsageError(f"no notebook matches {want!r}; available: {names}")
        chosen += [m for m in matches if m not in chosen]
    return sorted(chosen)


# ----------------------------------------------------------------------------------------------
# Measurement (GPU only)
# ----------------------------------------------------------------------------------------------


def gpu_slug(name: str) -> str:
    """The folder name `fusedkern.bench` uses for a GPU: "NVIDIA H200" -> "h200",
    "NVIDIA A100-SXM4-80GB" -> "a100_sxm4_80gb"."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower().replace("nvidia", "")).strip("_") or "gpu"


def cuda_gpu_name() -> str | None:
    """The first CUDA GPU's name, or None without one (asks torch in a subprocess: no CUDA context here)."""
    code = "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def run_sweep(command: list[str]) -> int:
    """Run one benchmark command from the repository root; returns its exit status."""
    return subprocess.run(command, cwd=ROOT, env=_child_env()).returncode


def measure(data_dir: Path, gpu_name: str, quick: bool) -> str:
    """Run every sweep of `python -m fusedkern.bench` into data_dir/measured/<gpu>/; returns <gpu>."""
    slug = gpu_slug(gpu_name)
    out_dir = data_dir / "measured" / slug
    out_dir.mkdir(parents=True, exist_ok=True)
    for sweep in SWEEPS:
        command = [sys.executable, "-m", "fusedkern.bench", sweep, "--out", str(out_dir / f"{sweep}.csv")]
        if quick:
            command += QUICK_SWEEP_ARGS[sweep]
        print(f"run_all: measuring on {gpu_name}: {' '.join(command[1:])}", file=sys.stderr, flush=True)
        status = run_sweep(command)
        if status != 0:
            raise NotebookFailed(f"benchmark sweep {sweep!r} failed (exit {status}): {' '.join(command)}")
    return slug


def quick_data_dir(data_dir: Path) -> Path:
    """A fresh temporary data folder for smoke measurements, with a copy of data_dir/reference/
    (the notebooks read both); the committed measurements stay as they are."""
    quick_dir = Path(tempfile.mkdtemp(prefix="run_all-quick-data-"))
    if (data_dir / "reference").is_dir():
        shutil.copytree(data_dir / "reference", quick_dir / "reference")
    return quick_dir


def missing_gpu_folder(data_dir: Path, gpu: str) -> str | None:
    """None when data_dir/measured/<gpu>/ exists, else a message that lists the folders that do."""
    folder = data_dir / "measured" / gpu
    if folder.is_dir():
        return None
    measured = data_dir / "measured"
    present = sorted(p.name for p in measured.iterdir() if p.is_dir()) if measured.is_dir() else []
    return f"--gpu {gpu}: {folder} does not exist; measured GPUs in {measured}: {', '.join(present) or '(none)'}"


# ----------------------------------------------------------------------------------------------
# Notebooks
# ----------------------------------------------------------------------------------------------


def _child_env() -> dict[str, str]:
    """The environment for kernels and sweeps: the repository importable without installing it."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")  # silences a debugger warning in every kernel
    return env


def _param_path(path: Path, cwd: Path) -> str:
    """A path as the notebook should see it: relative to its working directory when inside the
    repository (so the rendered parameters cell is the same on every machine), else absolute."""
    path = path.resolve()
    try:
        path.relative_to(ROOT)
    except ValueError:
        return str(path)
    return os.path.relpath(path, cwd.resolve())


def load_source(path: Path):
    """The py:percent source as an nbformat notebook, with the kernel it runs on."""
    try:
        import jupytext
    except ImportError as exc:
        raise SystemExit("run_all: jupytext is required to read the notebook sources: pip install jupytext") from exc
    nb = jupytext.read(path, fmt="py:percent")
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": KERNEL_NAME}
    return nb


def _merge_streams(outputs: list) -> list:
    """Join consecutive stream outputs of the same name: how the kernel splits them varies by run."""
    merged: list = []
    for out in outputs:
        if (out.get("output_type") == "stream" and merged and merged[-1].get("output_type") == "stream"
                and merged[-1].get("name") == out.get("name")):
            merged[-1]["text"] = merged[-1]["text"] + out["text"]
        else:
            merged.append(out)
    return merged


def normalize(nb, source_name: str):
    """Strip what changes between runs of unchanged code on unchanged data, in place; returns nb."""
    nb.metadata = {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": KERNEL_NAME},
        "language_info": {"name": "python"},
        "fusedkern": {"generated_by": "run_all.py", "source": source_name,
                      "note": "generated file: edit the .py source and re-run run_all.py"},
    }
    count = 0
    for index, cell in enumerate(nb.cells):
        cell["id"] = f"cell-{index:03d}"
        tags = cell.get("metadata", {}).get("tags")
        cell["metadata"] = {"tags": tags} if tags else {}
        if cell.get("cell_type") != "code":
            cell.pop("outputs", None)
            cell.pop("execution_count", None)
            continue
        executed = bool(cell.get("execution_count"))
        count += 1
        cell["execution_count"] = count if executed else None
        outputs = _merge_streams(cell.get("outputs", []))
        for out in outputs:
            if "execution_count" in out:
                out["execution_count"] = cell["execution_count"]
            if out.get("metadata") == {} and out.get("output_type") == "stream":
                out.pop("metadata")
        cell["outputs"] = outputs
    return nb


def _cell_excerpt(source: str, lines: int = 6) -> str:
    body = source.strip().splitlines()
    shown = body[:lines] + (["..."] if len(body) > lines else [])
    return "\n".join("    | " + line for line in shown)


def _strip_ansi(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", text)


def _show_parameters(nb, params: dict) -> None:
    """Rewrite the injected-parameters cell to show `params` (the run itself saw staging paths)."""
    from papermill.translators import translate_parameters

    for cell in nb.cells:
        if "injected-parameters" in cell.get("metadata", {}).get("tags", []):
            cell["source"] = translate_parameters(KERNEL_NAME, "python", params, "Parameters")


def publish_figures(staged: Path, figures_dir: Path) -> dict[bytes, bytes]:
    """Move every file under `staged` to the same place under figures_dir, each replaced in one step.

    A PNG whose SVG twin is byte-identical to the published SVG is the same drawing: the published PNG is
    kept, because Agg's anti-aliasing differs by a level in a few pixels between CPUs (numpy's SIMD paths
    round the transformed coordinates differently). Returns {staged PNG bytes: kept PNG bytes} so that the
    notebook can show the kept file."""
    kept = {}
    for src in sorted(p for p in staged.rglob("*") if p.is_file()):
        dst = figures_dir / src.relative_to(staged)
        twin, published_twin = src.with_suffix(".svg"), dst.with_suffix(".svg")
        if (src.suffix == ".png" and dst.is_file() and twin.is_file() and published_twin.is_file()
                and twin.read_bytes() == published_twin.read_bytes()):
            kept[src.read_bytes()] = dst.read_bytes()
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(dst.name + ".tmp")
        shutil.copyfile(src, tmp)  # staged may be on another file system: copy next to dst, then rename
        os.replace(tmp, dst)
    return kept


def show_kept_figures(nb, kept: dict[bytes, bytes]) -> None:
    """Replace, in the notebook's outputs, each staged PNG that publish_figures kept by the kept file."""
    swap = {base64.b64encode(new).decode(): base64.b64encode(old).decode() for new, old in kept.items()}
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            shown = data.get("image/png")
            if isinstance(shown, str) and "".join(shown.split()) in swap:
                data["image/png"] = swap["".join(shown.split())]


def execute(source: Path, output_dir: Path, parameters: dict, cell_timeout: int) -> Path:
    """Execute one notebook source; only when it ran to the end, move its figures into
    parameters["figures_dir"] and write its normalized rendering. Raises NotebookFailed."""
    import nbformat
    import papermill
    from papermill.exceptions import PapermillExecutionError

    nb = load_source(source)
    cwd = source.parent
    # The notebook saves its figures into a folder of its own, so a failure half-way replaces none.
    # A failed run's partial render and figures are kept there for diagnosis.
    work = Path(tempfile.mkdtemp(prefix=f"run_all-{source.stem}-"))
    staged = work / "figures"
    partial = work / (source.stem + ".failed.ipynb")
    shown = {k: _param_path(v, cwd) if isinstance(v, Path) else v for k, v in parameters.items()}
    params = dict(shown, figures_dir=str(staged)) if "figures_dir" in parameters else shown
    try:
        executed = papermill.execute_notebook(
            nb, str(partial), parameters=params, kernel_name=KERNEL_NAME, cwd=str(cwd), progress_bar=False,
            log_output=False, request_save_on_cell_execute=False, execution_timeout=cell_timeout,
            extra_arguments=["--IPKernelApp.log_level=ERROR"],  # no TCP-transport warning per kernel
        )
    except PapermillExecutionError as err:
        # cell numbers count papermill's injected-parameters cell, as in the rendered notebook
        cell_no = err.cell_index if err.cell_index is not None else "?"
        tb = _strip_ansi("\n".join(err.traceback or []))
        tail = "\n".join("    " + line for line in tb.strip().splitlines()[-12:])
        raise NotebookFailed(
            f"notebook {source.name} failed in cell {cell_no} (In [{err.exec_count}]):\n"
            f"{_cell_excerpt(err.source or '')}\n  {err.ename}: {_strip_ansi(str(err.evalue))}\n{tail}\n"
            f"  partial render with every output up to the failure: {partial}"
        ) from None
    except Exception as err:  # kernel died, timeout, missing kernel: still name the notebook
        raise NotebookFailed(f"notebook {source.name} failed: {type(err).__name__}: {err} (partial output in {work})"
                             ) from None
    _show_parameters(executed, shown)
    if "figures_dir" in parameters:
        show_kept_figures(executed, publish_figures(staged, Path(parameters["figures_dir"])))
    output_dir.mkdir(parents=True, exist_ok=True)
    target = output_dir / (source.stem + ".ipynb")
    tmp = target.with_name(target.name + ".tmp")
    nbformat.write(normalize(executed, source.name), str(tmp))
    os.replace(tmp, target)
    shutil.rmtree(work, ignore_errors=True)
    return target


def _timed_execute(source: Path, output_dir: Path, parameters: dict, cell_timeout: int) -> tuple[float, str | None]:
    """`execute`, returning (seconds, error message or None): picklable, for worker processes."""
    start = time.perf_counter()
    try:
        execute(source, output_dir, parameters, cell_timeout)
    except NotebookFailed as err:
        return time.perf_counter() - start, str(err)
    return time.perf_counter() - start, None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sources = discover(args.source_dir)
    if not sources:
        print(f"run_all: no notebook sources (NN_name.py) in {args.source_dir}", file=sys.stderr)
        return 2
    try:
        selected = select(sources, args.notebooks)
    except UsageError as err:
        print(f"run_all: {err}", file=sys.stderr)
        return 2
    if args.list:
        print("\n".join(p.stem for p in selected))
        return 0

    gpu_name = None
    if args.measure == "yes" or (args.measure == "auto" and not args.quick):
        gpu_name = cuda_gpu_name()
        if gpu_name is None and args.measure == "yes":
            print("run_all: --measure yes needs a CUDA GPU, and none is visible", file=sys.stderr)
            return 1
    measuring = gpu_slug(gpu_name) if gpu_name is not None else None
    gpu = args.gpu or measuring or DEFAULT_GPU
    # An explicit --gpu names measurements to plot: a typo must not render "Not measured yet" over
    # the committed notebooks. Checked before anything is measured or written.
    if args.gpu is not None and args.gpu != measuring:
        if measuring is not None and args.quick:  # the smoke data folder holds only the GPU measured now
            problem = f"--gpu {args.gpu}: a --quick measuring run plots only the GPU it measures ({measuring})"
        else:
            problem = missing_gpu_folder(args.data_dir, args.gpu)
        if problem:
            print(f"run_all: {problem}", file=sys.stderr)
            return 2

    data_dir = args.data_dir
    if gpu_name is not None:
        if args.quick:
            data_dir = quick_data_dir(args.data_dir)
            print(f"run_all: --quick measurements are a smoke test; they go to {data_dir}, "
                  f"not {args.data_dir}", file=sys.stderr)
        try:
            measure(data_dir, gpu_name, args.quick)
        except NotebookFailed as err:
            print(f"run_all: {err}", file=sys.stderr)
            return 1

    os.environ.update(_child_env())  # the kernels papermill starts inherit this environment
    os.environ.update(REPRODUCIBLE_NUMERICS)  # (not the sweeps': they time the GPU and leave its host alone)
    parameters = {"quick": bool(args.quick), "data_dir": data_dir, "figures_dir": args.figures_dir, "gpu": gpu}
    from tqdm import tqdm

    failures: list[str] = []
    timings: dict[str, float] = {}
    bar = tqdm(total=len(selected), desc="notebooks", unit="nb", file=sys.stderr)
    job = (args.output_dir, parameters, args.cell_timeout)

    def record(source: Path, seconds: float, error: str | None) -> bool:
        """Book one finished notebook; True when the run should stop (--fail-fast)."""
        timings[source.stem] = seconds
        bar.update(1)
        if error is not None:
            failures.append(error)
            tqdm.write(f"run_all: FAILED {error}", file=sys.stderr)
        return error is not None and args.fail_fast

    if args.jobs == 1:
        for source in selected:
            bar.set_postfix_str(source.stem)
            if record(source, *_timed_execute(source, *job)):
                break
    else:
        from concurrent.futures import ProcessPoolExecutor, as_completed

        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            futures = {pool.submit(_timed_execute, source, *job): source for source in selected}
            for future in as_completed(futures):
                if record(futures[future], *future.result()):
                    for other in futures:
                        other.cancel()
                    break
    bar.close()

    for stem, seconds in sorted(timings.items()):
        print(f"  {stem:<24} {seconds:6.1f} s", file=sys.stderr)
    if failures:
        print(f"run_all: {len(failures)} of {len(selected)} notebooks failed:", file=sys.stderr)
        for message in failures:
            print("  - " + message.splitlines()[0], file=sys.stderr)
        return 1
    print(f"run_all: {len(selected)} notebooks rendered into {args.output_dir}, figures in {args.figures_dir}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
