"""scripts/gpu_train_table.py and its driver, on CPU (issue 43 item 4): the tiny mode runs TRL's SFT, DPO and GRPO
steps with the four rows and writes the CSV the GPU run will write; a run out of memory exits 75 for the driver's
search; notebook 10 draws the table and the step's time breakdown from such CSVs (invented values, labelled fake,
under tmp_path)."""

from __future__ import annotations

import csv
import importlib.util
import math
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from tests import _interpreter

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_train_table.py"

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="needs TRL (pip install 'fusedkern[trl]')"),
    pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None,
                       reason="needs Liger-Kernel (pip install -e '.[liger]')"),
    pytest.mark.xdist_group("train_table"),  # one worker runs the 8B head's rows once for both tests that read them
]


def load_script(monkeypatch):
    """The script as a module (its import puts examples/ on sys.path and sets USE_HUB_KERNELS when unset: both
    undone after the test)."""
    monkeypatch.setenv("USE_HUB_KERNELS", "NO")
    monkeypatch.setattr(sys, "path", list(sys.path))
    spec = importlib.util.spec_from_file_location("gpu_train_table", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def run_tiny(tmp_path, *options, timeout=600):
    """`python scripts/gpu_train_table.py --tiny --seq 4` (on the tests' interpreter patch, tests/_interpreter.py):
    4 tokens a sequence (DPO: a 2-token prompt and completion; GRPO: completions of 1-2 tokens), every path of the
    default 8 at a quarter less CPU (the Liger rows' RoPE kernel runs a program per token). Its table's rows; the
    per-step rows (--steps-csv) in tmp_path / "steps.csv"."""
    out = tmp_path / "table.csv"
    env = dict(os.environ, TMPDIR=str(tmp_path))
    done = subprocess.run(_interpreter.script_command(SCRIPT, "--tiny", "--seq", 4, "--csv", out, "--steps-csv",
                                                      tmp_path / "steps.csv", *options), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    with open(out, newline="") as f:
        return list(csv.DictReader(f))


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def check_rows(rows, columns):
    assert rows and list(rows[0]) == list(columns)
    groups = {}
    for r in rows:
        groups.setdefault((r["model"], r["step"]), []).append(r)
        assert r["head"] == ("fusedkern" if r["row"].startswith("fusedkern") else "trl"), r
        assert r["liger_layers"] == ("yes" if r["row"].endswith("liger") else "no"), r
        assert r["protocol"] == "in_process" and r["device"] == "cpu"
        assert float(r["tokens_per_s"]) > 0 and math.isfinite(float(r["final_loss"]))
        per_item = 2 if r["step"] == "dpo" else 1
        assert int(r["tokens_per_step"]) == per_item * int(r["global_batch"]) * int(r["seq_len"])
        assert int(r["micro_batch"]) * int(r["grad_accum"]) == int(r["global_batch"])
    for (model, step), group in groups.items():
        assert sorted(r["row"] for r in group) == sorted(("trl", "trl_liger", "fusedkern", "fusedkern_liger"))
        firsts = [float(r["first_loss"]) for r in group]
        finals = [float(r["final_loss"]) for r in group]
        # same seed, init and data: every row starts at the same loss and takes the same step (fp32 on CPU)
        assert max(firsts) - min(firsts) < 1e-5, (model, step, firsts)
        assert max(finals) - min(finals) < 1e-4, (model, step, finals)
        if step == "dpo":
            assert abs(firsts[0] - math.log(2)) < 1e-5  # policy = reference at the first step
    return groups


@pytest.fixture(scope="module")
def run_of_the_8b_head(tmp_path_factory):
    """--tiny --model llama3-8b-2l: the Llama-3-8B-head model's (DPO) table rows and per-step rows, run once for the
    tests that read them."""
    tmp = tmp_path_factory.mktemp("table_8b")
    rows = run_tiny(tmp, "--model", "llama3-8b-2l")
    return rows, read_csv(tmp / "steps.csv")


@pytest.fixture(scope="module")
def rows_of_the_8b_head(run_of_the_8b_head):
    return run_of_the_8b_head[0]


def test_tiny_dpo_rows_of_the_8b_head(rows_of_the_8b_head, monkeypatch):
    """The Llama-3-8B-head model's DPO rows, each a TRL trainer with its own head or fusedkern's, with or without
    Liger's layer kernels (on CPU through the interpreter): the CSV's columns, the head each row ran, equal first
    (log 2) and final losses."""
    script = load_script(monkeypatch)
    assert set(check_rows(rows_of_the_8b_head, script.CSV_COLUMNS)) == {("llama3-8b-2l", "dpo")}


def test_tiny_step_rows_of_the_8b_head(run_of_the_8b_head, monkeypatch):
    """--steps-csv: one row per optimizer step of each run (its warm-up step, then the timed one, whose time is the
    table's p50); on CPU the allocator's columns are empty, Triton's too (its interpreter compiles nothing), and the
    free-memory check counts zero on fusedkern's head (off CUDA it never asks) and is empty on TRL's."""
    script = load_script(monkeypatch)
    rows, steps = run_of_the_8b_head
    assert steps and list(steps[0]) == list(script.STEP_COLUMNS)
    assert len(steps) == 2 * len(rows) == 8
    empty_on_cpu = ["peak_allocated_mib", "peak_reserved_mib", "reserved_mib", "inactive_split_mib",
                    *script.ALLOCATOR_COUNTERS, "triton_compiles", "triton_compile_ms", "triton_kernels"]
    for r in rows:
        mine = [s for s in steps if s["row"] == r["row"]]
        assert [(int(s["step_index"]), int(s["timed"])) for s in mine] == [(0, 0), (1, 1)]
        assert all(float(s["step_ms"]) > 0 and s["device"] == "cpu" and s["phase"] == r["phase"] for s in mine)
        assert mine[1]["step_ms"] == r["step_ms_p50"]  # one timed step: the table's median is its time
        assert all(s[c] == "" for s in mine for c in empty_on_cpu), mine
        fused = r["head"] == "fusedkern"
        assert {(s["e_alloc"], s["free_memory_checks"], s["free_memory_refusals"]) for s in mine} == {
            ("rounded", "0", "0") if fused else ("", "", "")}
        assert {(s["dynamo_graphs"], s["driver_memory_queries"]) for s in mine} == {("0", "0")}


def test_event_counters_and_e_allocation(monkeypatch):
    """EventCounters counts Triton's JIT cache misses (chained to a hook already set, whose answer is kept) with
    their names and time, fusedkern's free-memory checks and refusals, the driver's free-memory queries, and restores
    every hook and function on exit; e_allocation("exact") allocates E for exactly T rows until it exits."""
    import triton

    from fusedkern import anchored, dispatch

    script = load_script(monkeypatch)
    runtime = triton.knobs.runtime
    seen = []
    monkeypatch.setattr(runtime, "jit_cache_hook", lambda **kw: seen.append(kw["fn"].name) or None)
    monkeypatch.setattr(runtime, "jit_post_compile_hook", None)
    monkeypatch.setattr(dispatch, "fits_free_memory", lambda need, device: need < 10)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (5, 80))
    hooks, fits, mem_get_info = runtime.jit_cache_hook, dispatch.fits_free_memory, torch.cuda.mem_get_info
    info = dict(key="k", repr="r", compile={}, is_manual_warmup=False, already_compiled=False)
    with script.EventCounters() as counters:
        for name in ("_finish_rows_kernel", "_anchored_exp_kernel"):
            assert runtime.jit_cache_hook(fn=types.SimpleNamespace(name=name), **info) is None
            assert runtime.jit_post_compile_hook(fn=types.SimpleNamespace(name=name), **info) is None
        assert [dispatch.fits_free_memory(n, "cuda") for n in (5, 20, 30)] == [True, False, False]
        assert torch.cuda.mem_get_info() == (5, 80)
        values = counters.values()
    assert seen == ["_finish_rows_kernel", "_anchored_exp_kernel"]
    assert counters.kernels == seen and values["triton_compiles"] == 2 and values["triton_compile_s"] >= 0
    assert (values["free_memory_checks"], values["free_memory_refusals"], values["driver_memory_queries"]) == (3, 2, 1)
    assert (runtime.jit_cache_hook, runtime.jit_post_compile_hook) == (hooks, None)
    assert dispatch.fits_free_memory is fits and torch.cuda.mem_get_info is mem_get_info
    rounded = anchored.kept_e_rows
    with script.e_allocation("exact"):
        assert anchored.kept_e_rows(300) == 300
    assert anchored.kept_e_rows is rounded and rounded(300) == 384
    with pytest.raises(ValueError, match="e_alloc"), script.e_allocation("bogus"):
        pass


def test_step_probe_on_cuda_counters(monkeypatch):
    """StepProbe's CUDA columns from two memory_stats() snapshots (invented counters): each event counter's change
    over the step, the reserved bytes in MiB at its end; a counter this torch does not keep is written empty, not 0;
    Triton's compilations of the step with their kernels' names (each once)."""
    script = load_script(monkeypatch)
    counters = script.EventCounters()
    snapshots = iter([
        {"num_alloc_retries": 1, "num_device_alloc": 10, "num_device_free": 4, "num_ooms": 0,
         "reserved_bytes.all.peak": 2**30, "reserved_bytes.all.current": 2**30,
         "inactive_split_bytes.all.current": 0},
        {"num_alloc_retries": 2, "num_device_alloc": 13, "num_device_free": 9, "num_ooms": 0,
         "reserved_bytes.all.peak": 3 * 2**30, "reserved_bytes.all.current": 2 * 2**30,
         "inactive_split_bytes.all.current": 2**21}])
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda *a, **k: next(snapshots))
    probe = script.StepProbe(True, counters, triton_counted=True)
    probe.on_step_begin(None, None, None)
    counters.compiles, counters.compile_s, counters.kernels = 3, 0.25, ["b", "a", "b"]
    probe.on_step_end(None, None, None)
    (r,) = probe.records
    assert (r["alloc_retries"], r["device_allocs"], r["device_frees"], r["ooms"], r["sync_all_streams"]) == (
        1, 3, 5, 0, "")
    assert (r["peak_reserved_mib"], r["reserved_mib"], r["inactive_split_mib"]) == ("3072.0", "2048.0", "2.0")
    assert (r["triton_compiles"], r["triton_compile_ms"], r["triton_kernels"]) == (3, "250.0", "a b")
    assert set(r) | {"model", "step", "row", "workload", "protocol", "micro_batch", "grad_accum", "e_alloc", "phase",
                     "commit", "device", "step_index", "timed", "step_ms",
                     "peak_allocated_mib"} == set(script.STEP_COLUMNS)


@pytest.mark.slow  # about 20 s on two shared cores: 12 runs, the Liger rows through the interpreter
def test_tiny_table_every_step_and_row(tmp_path, monkeypatch, rows_of_the_8b_head):
    """--tiny: every step and row of the GPU table on the Qwen3 model, in one process (Liger's process-wide patches
    undone between runs), beside the Llama 8B head's rows: SFT, DPO and the GRPO loss step on fixed completions, one
    CSV row each. (The Llama-3.2-1B model's runs are the same code on Llama's layers, which the 8B head's rows and
    tests/test_integrations_liger.py run.)"""
    script = load_script(monkeypatch)
    rows = run_tiny(tmp_path, "--model", "qwen3-0.6b")
    assert len(rows) == 12
    groups = check_rows(rows + rows_of_the_8b_head, script.CSV_COLUMNS)
    assert set(groups) == {("qwen3-0.6b", s) for s in ("sft", "dpo", "grpo")} | {("llama3-8b-2l", "dpo")}


def test_list_runs_and_out_of_memory_exit(tmp_path, monkeypatch, capsys):
    """--list-runs gives the driver its loop (model, step, row, global batch, first micro-batch); a run that runs out
    of memory exits 75 (the driver halves the micro-batch); another error propagates."""
    script = load_script(monkeypatch)
    threads = torch.get_num_threads()
    try:
        script.main(["--list-runs", "--checkpoints", str(tmp_path)])
        runs = [line.split() for line in capsys.readouterr().out.splitlines()]
        assert len(runs) == 2 * 3 * 4 + 4 and all(len(r) == 5 for r in runs)
        assert {r[1] for r in runs if r[0] == "llama3-8b-2l"} == {"dpo"}
        assert all(int(r[3]) % int(r[4]) == 0 for r in runs)

        def out_of_memory(*args, **kwargs):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

        monkeypatch.setattr(script, "run_one", out_of_memory)
        options = ["--tiny", "--checkpoints", str(tmp_path), "--model", "llama3-8b-2l", "--row", "trl"]
        with pytest.raises(SystemExit) as exited:
            script.main(options)
        assert exited.value.code == script.OOM_EXIT == 75
        monkeypatch.setattr(script, "run_one", lambda *a, **k: (_ for _ in ()).throw(ValueError("a bug")))
        with pytest.raises(ValueError, match="a bug"):
            script.main(options)
    finally:
        torch.set_num_threads(threads)


def fake_trl_table(path: Path) -> None:
    """An invented train_trl_table.csv (FAKE numbers, for the notebook's code path only)."""
    script_columns = ["model", "step", "row", "workload", "protocol", "layers", "hidden", "vocab", "tied", "seq_len",
                      "global_batch", "micro_batch", "micro_batch_first", "grad_accum", "tokens_per_step",
                      "steps_timed", "warmup_steps", "step_ms_p20", "step_ms_p50", "step_ms_p80", "tokens_per_s",
                      "peak_mib", "first_loss", "final_loss", "head", "liger_layers", "device", "torch", "triton",
                      "transformers", "trl", "liger_kernel", "commit", "autocast", "attention", "optimizer"]
    speed = {"trl": 1.0, "trl_liger": 1.05, "fusedkern": 1.1, "fusedkern_liger": 1.16}
    rows = []
    for model, steps in (("qwen3-0.6b", ("sft", "dpo", "grpo")), ("llama-3.2-1b", ("sft", "dpo", "grpo")),
                         ("llama3-8b-2l", ("dpo",))):
        for step in steps:
            for row, s in speed.items():
                tokens = 32768 if model != "llama3-8b-2l" else 8192
                ms = 500.0 / s
                rows.append(dict(zip(script_columns, [
                    model, step, row, "fake", "sequential", 28, 1024, 151936, True, 2048, 16, 8, 8, 2, tokens, 6, 2,
                    ms * 0.98, ms, ms * 1.02, tokens / (ms / 1e3), 40000.0 / s, 0.693147 if step == "dpo" else 12.0,
                    0.69 if step == "dpo" else 11.9, "fusedkern" if row.startswith("fusedkern") else "trl",
                    "yes" if row.endswith("liger") else "no", "FAKE GPU (test data)", "0.0", "0.0", "0.0", "0.0",
                    "0.0", "fake", "bf16, fp32 weights", "sdpa", "adamw_torch_fused"])))
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=script_columns)
        writer.writeheader()
        writer.writerows(rows)


def fake_breakdown(path: Path) -> None:
    """An invented step_time_breakdown.csv (FAKE numbers) in the schema scripts/gpu_step_profile.py writes."""
    from fusedkern.study.step_profile import CATEGORIES, FLOOR_CATEGORY

    common = dict(step="sft", layers=28, hidden=1024, vocab=151936, seq_len=2048, micro_batch=8, grad_accum=2,
                  tokens_per_step=32768, workload="sft_full", device="FAKE GPU (test data)", torch="0.0",
                  triton="0.0", transformers="0.0", trl="0.0", liger_kernel="0.0", commit="fake", phase="fake",
                  note="")
    rows = []
    for model in ("qwen3-0.6b", "llama-3.2-1b"):
        for row, layers_ms in (("trl", 300.0), ("trl_liger", 150.0), ("fusedkern", 300.0), ("fusedkern_liger", 150.0)):
            parts = dict(zip(CATEGORIES, (40.0, 40.0, 60.0, layers_ms, 20.0, 10.0)))
            rows += [dict(common, model=model, row=row, category=c, kernel_ms=ms, kernel_total_ms=sum(parts.values()),
                          step_wall_ms=sum(parts.values()) * 1.02, protocol="profiled_step") for c, ms in parts.items()]
        rows.append(dict(common, model=model, row="floor", category=FLOOR_CATEGORY, kernel_ms=40.0, kernel_total_ms="",
                         step_wall_ms="", protocol="timed_reps"))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def test_notebook_10_draws_the_trl_table(tmp_path):
    """With a train_trl_table.csv and a step_time_breakdown.csv in data/measured/h100/ (invented), notebook 10 shows
    the table, the figures (10_training_step_trl, 10_step_time_breakdown), each target's verdict and Amdahl's
    bound from the profile."""
    data = tmp_path / "data"
    shutil.copytree(ROOT / "data" / "reference", data / "reference")
    fake_trl_table(data / "measured" / "h100" / "train_trl_table.csv")
    fake_breakdown(data / "measured" / "h100" / "step_time_breakdown.csv")
    out, figs = tmp_path / "rendered", tmp_path / "figures"
    env = dict(os.environ, TMPDIR=str(tmp_path))
    done = subprocess.run([sys.executable, str(ROOT / "run_all.py"), "--notebooks", "10", "--measure", "no",
                           "--data-dir", str(data), "--output-dir", str(out), "--figures-dir", str(figs)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-6000:]
    for name in ("10_training_step_trl", "10_step_time_breakdown"):
        assert (figs / f"{name}.png").exists() and (figs / f"{name}.svg").exists()
    text = (out / "10_training_step.ipynb").read_text()
    assert "Not yet measured.** There is no `train_trl_table.csv`" not in text
    assert "Not yet measured.** There is no `step_time_breakdown.csv`" not in text
    # fake speeds: fusedkern 1.1 / TRL 1.0, fusedkern + Liger 1.16 / TRL + Liger 1.05
    assert "fusedkern 1.100× TRL's head (target ≥ 1.05: **met**)" in text
    assert "fusedkern + Liger's layers 1.105× TRL's head + Liger's layers (target ≥ 1.04: **met**)" in text
    assert "every target met on every step" in text
    # the profile: a head of 80 ms in steps of 470 ms (PyTorch's layers) and 320 ms (Liger's), its floor 40 ms
    assert "× faster without Liger's layers and " in text and "× with them" in text  # bound on the step's wall time
