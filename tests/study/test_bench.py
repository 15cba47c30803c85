"""The benchmark harness and the results files, on CPU at tiny shapes (seconds, no GPU).

What must hold before the lead spends GPU time: every provider that can run on CPU produces a row
per mode with the same loss as the fp64 reference; errors become rows with a note instead of
ending the run; the chunked fp64 truth of the accuracy sweep equals autograd in fp64; the CSV and
JSON round-trip, keep the schema of docs/design.md, and are byte-identical when nothing changed;
the CLI parses and writes both files. CUDA timing and memory are exercised only on the GPU.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch

from fusedkern import reference
from fusedkern.study import bench, results, sweeps, timing, workloads
from fusedkern.study import providers as prov  # tests name their provider lists `providers`
from fusedkern.study.results import SCHEMA_COLUMNS, load_results, read_rows, sidecar_path, write_results

HIDDEN, VOCAB = 32, 97  # a prime vocab: no block size divides it
CPU = dict(hidden=HIDDEN, vocab=VOCAB, dtype=torch.float32, device="cpu", warmup=1, reps=2, min_reps=1,
           progress=False)
CPU_ONE_REP = {**CPU, "reps": 1}  # fusedkern's kernels run in Triton's interpreter: ~0.3 s a call
CE_TORCH_PROVIDERS = ["cublas_1gemm", "cublas_3gemm", "huggingface_bf16", "torch_fp32_upcast"]
HAS_TORCH_LCE = hasattr(torch.nn.functional, "linear_cross_entropy")
HAS_TORCH_LCE_OPTIONS = hasattr(torch.nn, "LinearCrossEntropyOptions")
if HAS_TORCH_LCE:
    CE_TORCH_PROVIDERS.append("torch_linear_cross_entropy_unfused")
if HAS_TORCH_LCE_OPTIONS:
    CE_TORCH_PROVIDERS.append("torch_linear_cross_entropy")
FLOOR_MODES = {"cublas_1gemm": {"loss_only", "forward"}, "cublas_3gemm": {"backward", "full"}}


pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def _fusedkern_ready() -> bool:
    try:
        from fusedkern import linear_cross_entropy, linear_simpo_loss  # noqa: F401
    except ImportError:
        return False
    return True


needs_fusedkern = pytest.mark.skipif(not _fusedkern_ready(), reason="fusedkern's public API is not importable yet")


def _fp64_ce_loss(tokens: int, seed: int = 0) -> float:
    inputs = workloads.make_ce_inputs(tokens, HIDDEN, VOCAB, dtype=torch.float32, device="cpu", seed=seed)
    return float(reference.linear_cross_entropy_fp64(inputs.x, inputs.w, inputs.target))


# ----------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------


def test_ce_inputs_are_lm_like_and_reproducible():
    a = workloads.make_ce_inputs(512, 256, 1000, dtype=torch.float32, device="cpu", seed=3)
    b = workloads.make_ce_inputs(512, 256, 1000, dtype=torch.float32, device="cpu", seed=3)
    assert torch.equal(a.x, b.x) and torch.equal(a.w, b.w) and torch.equal(a.target, b.target)
    logits_std = float((a.x @ a.w.T).detach().std())
    assert abs(logits_std - workloads.LOGIT_STD) < 0.1  # logits O(1–10), as the module promises
    assert a.x.requires_grad and a.w.requires_grad and a.target.dtype == torch.int64
    assert a.grad_bytes() == (512 * 256 + 1000 * 256) * 4


def test_simpo_inputs_mask_a_prompt_prefix():
    inputs = workloads.make_simpo_inputs(4, 16, HIDDEN, VOCAB, dtype=torch.float32, device="cpu")
    assert inputs.x.shape == (4, 16, HIDDEN) and inputs.target.shape == (4, 16)
    ignored = inputs.target == workloads.IGNORE_INDEX
    prefix_len = ignored.sum(dim=1)
    for row, n in zip(ignored, prefix_len):
        assert row[:n].all() and not row[n:].any()  # a prefix, then the response
    assert (prefix_len >= 16 // 8).all() and (prefix_len < 16 // 2).all()
    with pytest.raises(ValueError, match="even"):
        workloads.make_simpo_inputs(3, 16, HIDDEN, VOCAB, dtype=torch.float32, device="cpu")


# ----------------------------------------------------------------------------------------------
# Sweeps
# ----------------------------------------------------------------------------------------------


def _check_timing_rows(rows: list[dict], providers: list[str], xs: list[int], modes=results.MODES) -> None:
    expected = {(p, x, m) for p in providers for x in xs for m in modes if m in FLOOR_MODES.get(p, set(modes))}
    assert {(r["provider"], r["x"], r["mode"]) for r in rows} == expected
    for row in rows:
        assert set(SCHEMA_COLUMNS) <= set(row)
        assert row["note"] == "", row
        assert 0 < row["ms_p20"] <= row["ms_p50"] <= row["ms_p80"]
        assert row["n_reps"] >= 1
        assert math.isnan(row["peak_extra_mib"])  # no allocator statistics on CPU


def test_ce_sweep_every_cpu_provider_and_mode():
    rows = sweeps.run_sweep("ce", [8, 16], providers=CE_TORCH_PROVIDERS, **CPU)
    _check_timing_rows(rows, CE_TORCH_PROVIDERS, [8, 16])
    for row in rows:
        if row["provider"] in FLOOR_MODES:
            assert math.isnan(row["loss"])  # the floors compute no loss
        else:
            assert row["loss"] == pytest.approx(_fp64_ce_loss(row["x"]), rel=1e-5)
    assert {r["x_name"] for r in rows} == {"tokens"} and {r["op"] for r in rows} == {"ce"}


def test_ce_sweep_peers_on_the_valid_rows_and_their_floor():
    """Masked workloads: every peer also on the valid rows only (+gather, the host sync inside the step) gives
    the same mean over the valid tokens; Transformers' fp32-upcast loss agrees with the bf16 seed baseline's
    definition; the valid-row floor runs and computes no loss."""
    providers = ["cublas_3gemm", "cublas_3gemm_valid", "huggingface_bf16", "transformers_loss",
                 "huggingface_bf16_gather", "transformers_loss_gather"]
    rows = sweeps.run_sweep("ce", [16], providers=providers, workloads=["dense", "masked_50"], seq=8,
                            modes=["full"], **CPU_ONE_REP)
    assert sorted((r["provider"], r["workload"]) for r in rows) == sorted(
        (p, w) for p in providers for w in ("dense", "masked_50"))
    for workload in ("dense", "masked_50"):
        case = [r for r in rows if r["workload"] == workload]
        losses = [r["loss"] for r in case if not r["provider"].startswith("cublas")]
        assert losses == pytest.approx([losses[0]] * 4, rel=1e-5)
        assert all(math.isnan(r["loss"]) for r in case if r["provider"].startswith("cublas"))


def test_two_floor_table_divides_by_each_floor_of_its_workload():
    import pandas as pd

    from fusedkern.study import tables

    rows = [dict(op="ce", provider=p, x_name="tokens", x=4096, mode="full", ms_p50=ms, workload=w,
                 protocol="shuffled")
            for w in ("masked_50", "dense")
            for p, ms in (("cublas_3gemm", 16.0), ("cublas_3gemm_valid", 8.0), ("fusedkern_chunked_counted", 10.0))]
    table = tables.two_floor_table(pd.DataFrame(rows), "masked_50")
    assert table.loc["fusedkern_chunked_counted", ("× cublas_3gemm", 4096)] == pytest.approx(10 / 16)
    assert table.loc["fusedkern_chunked_counted", ("× cublas_3gemm_valid", 4096)] == pytest.approx(10 / 8)
    assert "cublas_3gemm_valid" not in table.index and table.loc["cublas_3gemm"].iloc[0] == 1.0


@needs_fusedkern
def test_ce_sweep_fusedkern_chunked():
    providers = ["fusedkern_chunked", "fusedkern_chunked_lean"]
    rows = sweeps.run_sweep("ce", [8], providers=providers, **CPU_ONE_REP)
    _check_timing_rows(rows, providers, [8])
    assert all(r["loss"] == pytest.approx(_fp64_ce_loss(8), rel=1e-5) for r in rows)


def test_simpo_sweep_matches_the_fp64_reference():
    providers = ["huggingface_fp32", "cublas_3gemm"]
    if _fusedkern_ready():
        providers.append("fusedkern_chunked")
    rows = sweeps.run_sweep("simpo", [2, 4], seq=8, providers=providers, modes=["loss_only", "full"], **CPU_ONE_REP)
    _check_timing_rows(rows, providers, [2, 4], modes=("loss_only", "full"))
    assert {r["workload"] for r in rows} == {"dense"}  # the sweep's default: every target counts
    for row in rows:
        if row["provider"] == "cublas_3gemm":
            continue
        inputs = workloads.make_simpo_inputs(row["x"], 8, HIDDEN, VOCAB, dtype=torch.float32, device="cpu",
                                         workload="dense")
        expected = float(reference.linear_simpo_loss_fp64(inputs.x, inputs.w, inputs.target)[0])
        assert row["loss"] == pytest.approx(expected, rel=1e-5), row
    assert {r["x_name"] for r in rows} == {"batch"}


def test_a_failing_provider_becomes_rows_with_a_note(monkeypatch):
    calls = []

    def broken(inputs):
        def loss_fn():
            calls.append(inputs.x.shape[0])
            raise RuntimeError("kernel exploded\nsecond line")

        return prov.loss_steps(loss_fn)

    registry = {**prov.PROVIDERS["ce"], "broken": prov.Provider("broken", broken, lambda: "broken")}
    monkeypatch.setitem(prov.PROVIDERS, "ce", registry)
    rows = sweeps.run_sweep("ce", [8, 16], providers=["broken", "huggingface_bf16"], modes=["full"], **CPU)
    broken_rows = [r for r in rows if r["provider"] == "broken"]
    assert len(broken_rows) == 1  # not retried at the larger size
    assert broken_rows[0]["note"] == "error: RuntimeError: kernel exploded"
    assert math.isnan(broken_rows[0]["ms_p50"]) and broken_rows[0]["n_reps"] == 0
    assert calls == [8]
    assert len([r for r in rows if r["provider"] == "huggingface_bf16"]) == 2  # the others carry on


def test_unavailable_provider_is_skipped_and_unknown_one_rejected(monkeypatch):
    def unavailable(inputs):
        raise prov.ProviderUnavailable("not here")

    registry = {**prov.PROVIDERS["ce"], "absent": prov.Provider("absent", unavailable, lambda: "absent")}
    monkeypatch.setitem(prov.PROVIDERS, "ce", registry)
    rows = sweeps.run_sweep("ce", [8], providers=["absent", "cublas_3gemm"], **CPU)
    assert {r["provider"] for r in rows} == {"cublas_3gemm"}
    with pytest.raises(ValueError, match="unknown ce providers"):
        sweeps.run_sweep("ce", [8], providers=["nope"], **CPU)
    with pytest.raises(ValueError, match="unknown modes"):
        sweeps.run_sweep("ce", [8], providers=["cublas_3gemm"], modes=["sideways"], **CPU)


def test_time_step_adapts_the_rep_count():
    inputs = workloads.make_ce_inputs(8, HIDDEN, VOCAB, dtype=torch.float32, device="cpu")
    step = prov.PROVIDERS["ce"]["cublas_1gemm"].build(inputs)["loss_only"]
    assert timing.time_step(step, inputs, warmup=1, reps=50, min_reps=3, max_case_s=0.0)["n_reps"] == 3
    assert timing.time_step(step, inputs, warmup=1, reps=7, min_reps=3, max_case_s=60.0)["n_reps"] == 7


def test_interleaved_timing_rotates_and_keeps_each_rep_count():
    inputs = workloads.make_ce_inputs(8, HIDDEN, VOCAB, dtype=torch.float32, device="cpu")
    order = []

    def spy(name, fail=False):
        def run(state):
            if fail:
                raise RuntimeError("warm-up failure")
            order.append(name)
        return prov.Step(run=run)

    steps = {"a": spy("a"), "b": spy("b"), "c": spy("c"), "broken": spy("broken", fail=True)}
    timings = timing.time_steps_interleaved(steps, inputs, warmup=1, reps=4, min_reps=4, max_case_s=60.0)
    assert isinstance(timings["broken"], RuntimeError)  # reported, and the others still ran
    assert [timings[k]["n_reps"] for k in "abc"] == [4, 4, 4]
    timed = order[3:]  # after one warm-up rep each
    assert timed == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]  # round r starts at step r mod 3


@pytest.mark.parametrize("protocol", ["shuffled", "fixed"])
def test_interleaved_sweep_has_the_rows_of_the_sequential_one(protocol):
    kwargs = dict(providers=["cublas_3gemm", "huggingface_bf16", "torch_fp32_upcast"], modes=["loss_only", "full"],
                  **CPU_ONE_REP)
    sequential = sweeps.run_sweep("ce", [8, 16], protocol="sequential", **kwargs)
    interleaved = sweeps.run_sweep("ce", [8, 16], protocol=protocol, **kwargs)

    def key(r):
        return r["provider"], r["x"], r["mode"]
    assert sorted(map(key, interleaved)) == sorted(map(key, sequential))
    assert {r["protocol"] for r in sequential} == {"sequential"} and {r["protocol"] for r in interleaved} == {protocol}
    losses = {key(r): r["loss"] for r in sequential}
    for row in interleaved:
        assert row["n_reps"] >= 1 and row["ms_p50"] > 0 and row["note"] == ""
        assert row["loss"] == pytest.approx(losses[key(row)], nan_ok=True)
    # the deprecated flag still means the fixed protocol
    assert {r["protocol"] for r in sweeps.run_sweep("ce", [8], interleave=True, **kwargs)} == {"fixed"}


def test_backward_mode_times_only_the_backward():
    inputs = workloads.make_ce_inputs(8, HIDDEN, VOCAB, dtype=torch.float32, device="cpu")
    forwards, backwards = [], []

    class Spy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            forwards.append(torch.is_grad_enabled())
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            backwards.append(1)
            return g

    steps = prov.loss_steps(lambda: reference.hf_linear_cross_entropy(Spy.apply(inputs.x), inputs.w, inputs.target))
    state = steps["backward"].setup()  # the untimed part: the forward
    assert len(forwards) == 1 and backwards == []
    steps["backward"].run(state)
    assert len(forwards) == 1 and backwards == [1] and inputs.x.grad is not None


# ----------------------------------------------------------------------------------------------
# Accuracy and the fp64 truth
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_tokens", [1, 5, 64])
def test_fp64_chunked_reference_equals_autograd(chunk_tokens):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(13, HIDDEN, generator=gen).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(VOCAB, HIDDEN, generator=gen) / 3).to(torch.bfloat16).requires_grad_()
    target = torch.randint(VOCAB, (13,), generator=gen)
    target[[2, 7]] = workloads.IGNORE_INDEX
    loss, dx, dw = reference.fp64_linear_cross_entropy_grads_chunked(x, w, target, chunk_tokens=chunk_tokens)

    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    expected = reference.linear_cross_entropy_fp64(x64, w64, target)
    expected.backward()
    assert loss.dtype == dx.dtype == dw.dtype == torch.float64
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-13, atol=0)
    torch.testing.assert_close(dx, x64.grad, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(dw, w64.grad, rtol=1e-12, atol=1e-15)
    assert (dx[[2, 7]] == 0).all()  # ignored tokens get no gradient


def test_fp64_chunked_reference_all_ignored_is_nan_like_torch():
    x = torch.randn(4, HIDDEN)
    w = torch.randn(VOCAB, HIDDEN)
    target = torch.full((4,), workloads.IGNORE_INDEX)
    loss, _, _ = reference.fp64_linear_cross_entropy_grads_chunked(x, w, target)
    assert math.isnan(float(loss))


def test_accuracy_sweep_rows():
    providers = ["huggingface_bf16", "torch_fp32_upcast"] + (["fusedkern_chunked"] if _fusedkern_ready() else [])
    kwargs = {k: v for k, v in CPU.items() if k not in ("warmup", "reps", "min_reps")}
    rows = sweeps.run_accuracy([8, 16], providers=providers, chunk_tokens=5, **kwargs)
    assert {(r["provider"], r["x"]) for r in rows} == {(p, x) for p in providers for x in (8, 16)}
    for row in rows:
        assert row["mode"] == "full" and row["note"] == "" and row["n_reps"] == 0
        for key in ("err_loss", "err_dx", "err_dw"):
            assert 0 <= row[key] < 1e-5, row  # fp32 against fp64
    with pytest.raises(ValueError, match="floors"):
        sweeps.run_accuracy([8], providers=["cublas_3gemm"], **kwargs)


# ----------------------------------------------------------------------------------------------
# Results files
# ----------------------------------------------------------------------------------------------

ENVIRONMENT = {"gpu_name": "test", "date_utc": "2026-01-01T00:00:00+00:00", "command": "pytest"}
META = {"sweep": "ce", "hidden": HIDDEN, "vocab": VOCAB, "dtype": "float32"}


def _rows() -> list[dict]:
    rows = []
    for provider in ("b_provider", "a, quoted provider"):
        for x in (16, 8):
            for mode in reversed(results.MODES):
                rows.append({"op": "ce", "provider": provider, "x_name": "tokens", "x": x, "mode": mode,
                             "ms_p20": 1.0 / 3, "ms_p50": 0.5, "ms_p80": 2.0 / 3, "peak_extra_mib": math.nan,
                             "n_reps": 7, "loss": 4.123456789, "err_dx": 1.23456789e-7, "note": ""})
    rows[0]["note"] = "OOM"
    return rows


def test_write_then_load_round_trip(tmp_path):
    path = write_results(_rows(), tmp_path / "ce.csv", meta=META, environment=ENVIRONMENT)
    df = load_results(path)
    assert list(df.columns) == [*SCHEMA_COLUMNS, "err_dx", "note"]
    assert df.attrs["meta"] == {**ENVIRONMENT, **META}
    assert len(df) == len(_rows())
    assert df["ms_p50"].eq(0.5).all() and df["peak_extra_mib"].isna().all()
    assert df["loss"].iloc[0] == pytest.approx(4.123457) and df["err_dx"].iloc[0] == pytest.approx(1.2346e-7)
    assert df["x"].dtype.kind == "i" and df["n_reps"].dtype.kind == "i"
    assert sorted(df["note"]) == [""] * (len(df) - 1) + ["OOM"]
    assert "a, quoted provider" in set(df["provider"])
    # Sorted: provider, then x, then mode by amount of work.
    first = df[df["provider"] == "a, quoted provider"]
    assert list(first["x"]) == [8] * 4 + [16] * 4
    assert list(first["mode"][:4]) == list(results.MODES)


def test_write_is_deterministic(tmp_path):
    shuffled = _rows()
    random.Random(0).shuffle(shuffled)
    a = write_results(_rows(), tmp_path / "a.csv", meta=META, environment=ENVIRONMENT)
    b = write_results(shuffled, tmp_path / "b.csv", meta=META, environment=ENVIRONMENT)
    assert a.read_bytes() == b.read_bytes()
    assert sidecar_path(a).read_bytes() == sidecar_path(b).read_bytes()
    # Reading back and writing again changes nothing either.
    c = write_results(read_rows(a), tmp_path / "c.csv", meta=META, environment=ENVIRONMENT)
    assert c.read_bytes() == a.read_bytes()


def test_write_rejects_rows_without_the_schema(tmp_path):
    row = _rows()[0]
    del row["ms_p50"]
    with pytest.raises(ValueError, match="ms_p50"):
        write_results([row], tmp_path / "x.csv", meta=META, environment=ENVIRONMENT)


def test_append_merges_rows_and_keeps_both_provenances(tmp_path):
    path = tmp_path / "ce.csv"
    write_results(_rows(), path, meta=META, environment=ENVIRONMENT)
    new = [{**_rows()[1], "provider": "liger-kernel 0.4.2"}, {**_rows()[1], "ms_p50": 9.0}]
    later = {**ENVIRONMENT, "date_utc": "2026-01-02T00:00:00+00:00"}
    for _ in range(2):  # a checkpointing run appends the same record after every sweep point
        write_results(new, path, meta=META, environment=later, append=True)
    rows = read_rows(path)
    assert len(rows) == len(_rows()) + 1
    replaced = [r for r in rows if r["provider"] == "b_provider" and r["x"] == 16 and r["mode"] == "backward"]
    assert [r["ms_p50"] for r in replaced] == [9.0]
    record = json.loads(sidecar_path(path).read_text())
    assert record["date_utc"] == ENVIRONMENT["date_utc"]
    assert [run["date_utc"] for run in record["appended_runs"]] == [later["date_utc"]]
    with pytest.raises(ValueError, match="workloads differ"):
        write_results(new, path, meta={**META, "vocab": 128}, environment=later, append=True)


def test_collect_environment_without_gpu():
    from fusedkern.study.results import collect_environment

    env = collect_environment("python -m fusedkern.bench ce")
    assert env["torch"] == torch.__version__ and env["command"] == "python -m fusedkern.bench ce"
    assert set(env["competitors"]) == {"liger-kernel", "cut-cross-entropy", "quack-kernels", "nvidia-cutlass-dsl"}
    assert env["date_utc"].endswith("+00:00")
    json.dumps(env)  # serializable as it stands


# ----------------------------------------------------------------------------------------------
# Command line and summary
# ----------------------------------------------------------------------------------------------

TINY_CE_ARGV = ["ce", "--tokens", "8", "--hidden", "16", "--vocab", "31", "--dtype", "float32", "--device", "cpu",
                "--providers", "huggingface_bf16", "cublas_3gemm", "--modes", "loss_only", "full", "--warmup", "1",
                "--reps", "2", "--min-reps", "1", "--no-progress"]


def test_cli_help_lists_the_providers(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for key in [*prov.PROVIDERS["ce"], *prov.PROVIDERS["simpo"]]:
        assert key in text
    for sweep in ("ce", "simpo", "accuracy"):
        with pytest.raises(SystemExit):
            bench.main([sweep, "--help"])
        assert "--hidden" in capsys.readouterr().out


@pytest.mark.parametrize("flags, protocol", [([], "shuffled"), (["--protocol", "fixed"], "fixed"),
                                             (["--protocol", "sequential"], "sequential"), (["--interleave"], "fixed")])
def test_cli_writes_csv_json_and_a_table(tmp_path, capsys, flags, protocol):
    out = tmp_path / "ce.csv"
    argv = [*TINY_CE_ARGV, "--out", str(out), *flags]
    assert bench.main(argv) == 0
    df = load_results(out)
    assert set(df["provider"]) == {"huggingface_bf16", "cublas_3gemm"}
    assert set(df["protocol"]) == {protocol} and set(df["workload"]) == {"dense"} and set(df["head"]) == {"custom"}
    meta = df.attrs["meta"]
    assert meta["command"].startswith("python -m fusedkern.bench ce --tokens 8")
    assert (meta["hidden"], meta["vocab"], meta["dtype"], meta["softcap"]) == (16, 31, "float32", None)
    assert meta["protocol"] == protocol and meta["workloads"] == ["dense"] and meta["device"] == "cpu"
    assert "dense all-token" in meta["floors"]  # what the floors are, whatever the workload
    table = capsys.readouterr().out
    assert "full: ms_p50 (× cublas_3gemm)" in table and "( 1.00×)" in table


def test_format_table_accuracy():
    rows = [{"op": "ce", "provider": "p", "x_name": "tokens", "x": 8, "mode": "full", "err_loss": 1e-3,
             "err_dx": 2e-3, "err_dw": 3e-3}]
    text = bench.format_table(rows)
    assert "relative errors" in text and "1.00e-03" in text and "3.00e-03" in text


@pytest.mark.parametrize("op", ["ce", "simpo"])
def test_real_grad_floor_multiplies_the_true_logits_gradient(op):
    # the stricter floor's G is ∂(mean CE)/∂z of the workload (ignored tokens: zero rows)
    if op == "ce":
        inputs = workloads.make_ce_inputs(7, HIDDEN, VOCAB, dtype=torch.float32, device="cpu", seed=3)
    else:
        inputs = workloads.make_simpo_inputs(2, 8, HIDDEN, VOCAB, dtype=torch.float32, device="cpu", seed=3)
    z = (inputs.x2d() @ inputs.w.detach().T).requires_grad_()
    torch.nn.functional.cross_entropy(z, inputs.target.reshape(-1), ignore_index=workloads.IGNORE_INDEX).backward()
    grad = prov.mean_ce_logits_grad(inputs, chunk_rows=3)  # several chunks, a ragged last one
    torch.testing.assert_close(grad, z.grad, rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------------------------
# Protocols, workloads, heads, providers, protected outputs
# ----------------------------------------------------------------------------------------------


def _spy_steps(names, log, fail=()):
    def spy(name):
        def run(state):
            if name in fail:
                raise RuntimeError("warm-up failure")
            log.append(name)
        return prov.Step(run=run)
    return {name: spy(name) for name in names}


def test_shuffled_timing_draws_a_new_order_every_round_reproducibly():
    import random as stdlib_random

    inputs = workloads.make_ce_inputs(8, HIDDEN, VOCAB, dtype=torch.float32, device="cpu")
    names = ["a", "b", "c", "d"]

    def orders(seed):
        log, rounds = [], []
        timings = timing.time_steps_interleaved(_spy_steps(names, log), inputs, warmup=1, reps=8, min_reps=8,
                                               max_case_s=60.0, rng=stdlib_random.Random(seed), order_log=rounds)
        assert [timings[k]["n_reps"] for k in names] == [8] * 4
        assert log[4:] == [name for order in rounds for name in order]  # what ran is what was logged
        return rounds

    rounds = orders(1)
    assert len(rounds) == 8 and all(sorted(order) == names for order in rounds)  # every step once per round
    assert len({tuple(order) for order in rounds}) > 1  # the order changes between rounds
    fixed = [names[r % 4:] + names[:r % 4] for r in range(8)]
    assert rounds != fixed  # not the rotation of the fixed protocol
    assert orders(1) == rounds  # reproducible by seed
    assert orders(2) != rounds


def test_shuffled_and_fixed_give_each_step_the_same_reps(monkeypatch):
    # rep counts that differ per step (as the per-case time budget sets them): a step drops out of
    # the rounds once it has its reps, in either order
    import random as stdlib_random

    inputs = workloads.make_ce_inputs(8, HIDDEN, VOCAB, dtype=torch.float32, device="cpu")
    wanted = {"a": 2, "b": 5, "c": 3}
    for rng in (None, stdlib_random.Random(0)):
        log = []
        steps = _spy_steps(list(wanted), log)
        name_of = {id(step): name for name, step in steps.items()}
        monkeypatch.setattr(timing, "warm_up", lambda step, inputs, **_: wanted[name_of[id(step)]])
        timings = timing.time_steps_interleaved(steps, inputs, rng=rng)
        assert {k: timings[k]["n_reps"] for k in wanted} == wanted
        assert {k: log.count(k) for k in wanted} == wanted


def test_sweep_default_protocol_is_shuffled_and_seeded(monkeypatch):
    log = []

    def spy(name):
        def build(inputs):
            def loss_fn():
                log.append(name)
                return inputs.x.sum() * 0
            return {"loss_only": prov.loss_steps(loss_fn)["loss_only"]}
        return prov.Provider(name, build, lambda: name)

    names = ["p0", "p1", "p2", "p3", "p4"]
    monkeypatch.setitem(prov.PROVIDERS, "ce", {**prov.PROVIDERS["ce"], **{n: spy(n) for n in names}})

    def run(seed):
        log.clear()
        rows = sweeps.run_sweep("ce", [8], providers=names, modes=["loss_only"], seed=seed,
                               **{**CPU, "reps": 6, "min_reps": 6})
        assert {r["protocol"] for r in rows} == {"shuffled"}
        assert {r["n_reps"] for r in rows} == {6}
        timed = log[len(names):len(names) + 6 * len(names)]  # after one warm-up rep each, before the memory runs
        return [timed[i:i + len(names)] for i in range(0, len(timed), len(names))]

    rounds = run(seed=0)
    assert all(sorted(order) == names for order in rounds) and len({tuple(o) for o in rounds}) > 1
    assert run(seed=0) == rounds and run(seed=1) != rounds


@pytest.mark.parametrize("percent", [30, 50, 70])
def test_ce_masked_workload_ignores_a_prompt_prefix_of_each_sequence(percent):
    tokens, seq = 3 * 40 + 25, 40  # three full sequences and a shorter last one
    dense = workloads.make_ce_inputs(tokens, HIDDEN, VOCAB, dtype=torch.float32, device="cpu", seed=4)
    masked = workloads.make_ce_inputs(tokens, HIDDEN, VOCAB, dtype=torch.float32, device="cpu", seed=4,
                                  workload=f"masked_{percent}", seq=seq)
    assert (dense.target != workloads.IGNORE_INDEX).all()
    assert torch.equal(masked.x, dense.x) and torch.equal(masked.w, dense.w)
    ignored = masked.target == workloads.IGNORE_INDEX
    assert torch.equal(masked.target[~ignored], dense.target[~ignored])  # the kept targets are the dense ones
    for start in range(0, tokens, seq):
        part = ignored[start:start + seq]
        n = len(part) * percent // 100
        assert part[:n].all() and not part[n:].any()  # a contiguous prefix, then the response
    assert abs(float(ignored.float().mean()) - percent / 100) < 0.02


def test_ce_masked_workload_shorter_than_a_sequence_and_bad_names():
    inputs = workloads.make_ce_inputs(8, HIDDEN, VOCAB, dtype=torch.float32, device="cpu", workload="masked_50")
    assert (inputs.target[:4] == workloads.IGNORE_INDEX).all() and (inputs.target[4:] != workloads.IGNORE_INDEX).all()
    for bad in ("masked_100", "masked", "sparse", "prompt_random"):
        with pytest.raises(ValueError, match="workload"):
            workloads.make_ce_inputs(8, HIDDEN, VOCAB, dtype=torch.float32, device="cpu", workload=bad)


@pytest.mark.parametrize("workload, prefix", [("dense", 0), ("masked_30", 6), ("masked_50", 10), ("masked_70", 14)])
def test_simpo_masked_workload_ignores_the_first_share_of_every_row(workload, prefix):
    inputs = workloads.make_simpo_inputs(4, 20, HIDDEN, VOCAB, dtype=torch.float32, device="cpu", workload=workload)
    ignored = inputs.target == workloads.IGNORE_INDEX
    assert ignored[:, :prefix].all() and not ignored[:, prefix:].any()


def test_sweep_rows_carry_workload_protocol_and_head_and_masked_losses_are_right():
    rows = sweeps.run_sweep("ce", [8, 16], providers=["huggingface_bf16", "cublas_3gemm"], modes=["full"], seq=8,
                           workloads=["dense", "masked_50"], **CPU_ONE_REP)
    assert {(r["workload"], r["provider"], r["x"]) for r in rows} == {
        (w, p, x) for w in ("dense", "masked_50") for p in ("huggingface_bf16", "cublas_3gemm") for x in (8, 16)}
    assert {r["protocol"] for r in rows} == {"shuffled"} and {r["head"] for r in rows} == {"custom"}
    for row in rows:
        if row["provider"] == "huggingface_bf16":
            inputs = workloads.make_ce_inputs(row["x"], HIDDEN, VOCAB, dtype=torch.float32, device="cpu",
                                          workload=row["workload"], seq=8)
            ignored = (inputs.target == workloads.IGNORE_INDEX).float().mean()
            assert ignored == (0.5 if row["workload"] != "dense" else 0)
            expected = float(reference.linear_cross_entropy_fp64(inputs.x.detach(), inputs.w.detach(), inputs.target))
            assert row["loss"] == pytest.approx(expected, rel=1e-5)
    table = bench.format_table(rows)
    assert "== workload dense, protocol shuffled" in table and "== workload masked_50, protocol shuffled" in table
    accuracy = sweeps.run_accuracy([8], providers=["torch_fp32_upcast"], workloads=["masked_30"], seq=8,
                                  hidden=HIDDEN, vocab=VOCAB, dtype=torch.float32, device="cpu", progress=False)
    assert [(r["workload"], r["protocol"], r["head"]) for r in accuracy] == [("masked_30", "sequential", "custom")]
    assert accuracy[0]["err_dx"] < 1e-5


def test_append_keeps_rows_of_other_workloads_and_protocols(tmp_path):
    path = tmp_path / "ce.csv"
    base = {"op": "ce", "provider": "p", "x_name": "tokens", "x": 8, "mode": "full", "ms_p20": 1.0, "ms_p50": 1.0,
            "ms_p80": 1.0, "peak_extra_mib": math.nan, "n_reps": 3, "note": "", "head": "custom"}
    write_results([{**base, "workload": "dense", "protocol": "shuffled"}], path, meta=META, environment=ENVIRONMENT)
    write_results([{**base, "workload": "masked_50", "protocol": "shuffled"},
                   {**base, "workload": "dense", "protocol": "fixed"}], path, meta=META, environment=ENVIRONMENT,
                  append=True)
    write_results([{**base, "workload": "dense", "protocol": "shuffled", "ms_p50": 2.0}], path, meta=META,
                  environment=ENVIRONMENT, append=True)
    rows = read_rows(path)
    assert sorted((r["workload"], r["protocol"], r["ms_p50"]) for r in rows) == [
        ("dense", "fixed", 1.0), ("dense", "shuffled", 2.0), ("masked_50", "shuffled", 1.0)]


def test_heads_set_the_dimensions_and_name_the_head_column():
    def resolve(*flags):
        return bench.resolve_head(bench.build_parser().parse_args(["ce", *flags]))

    assert resolve() == (4096, 128256, None)
    assert resolve("--head", "llama3") == (4096, 128256, None)
    assert resolve("--head", "qwen25_7b") == (3584, 151936, None)
    assert resolve("--head", "gemma2") == (2304, 256000, 30.0)
    assert resolve("--head", "gemma2", "--softcap", "0") == (2304, 256000, None)  # 0: none
    assert resolve("--head", "gemma2", "--vocab", "97") == (2304, 97, 30.0)  # a given flag wins
    assert resolve("--softcap", "15") == (4096, 128256, 15.0)
    assert workloads.head_name(256000, 2304, 30.0) == "gemma2" and workloads.head_name(128256, 4096, None) == "llama3"
    assert workloads.head_name(151936, 3584, None) == "qwen25_7b"
    assert workloads.head_name(256000, 2304, None) == "custom"
    for sweep in ("ce", "simpo", "accuracy"):
        args = bench.build_parser().parse_args([sweep, "--head", "gemma2", "--workload", "dense", "masked_70"])
        assert args.workload == ["dense", "masked_70"]
    with pytest.raises(SystemExit):
        bench.build_parser().parse_args(["ce", "--workload", "masked_x"])


SOFTCAP = 3.0  # small enough to bend logits of std LOGIT_STD


def test_softcapped_ce_providers_and_truth():
    rows = sweeps.run_sweep("ce", [8], providers=["huggingface_bf16", "torch_fp32_upcast", "cublas_3gemm_real_grad"]
                           + (["torch_linear_cross_entropy"] if HAS_TORCH_LCE_OPTIONS else []),
                           modes=["full"], softcap=SOFTCAP, **CPU_ONE_REP)
    inputs = workloads.make_ce_inputs(8, HIDDEN, VOCAB, dtype=torch.float32, device="cpu")
    x, w = inputs.x.detach(), inputs.w.detach()
    expected = float(reference.linear_cross_entropy_fp64(x, w, inputs.target, softcap=SOFTCAP))
    plain = float(reference.linear_cross_entropy_fp64(x, w, inputs.target))
    assert abs(expected - plain) > 1e-2  # the softcap matters at this scale
    losses = {r["provider"]: r["loss"] for r in rows}
    assert set(losses) == {"huggingface_bf16", "torch_fp32_upcast", "cublas_3gemm_real_grad"}  # torch: no softcap
    assert losses["huggingface_bf16"] == pytest.approx(expected, rel=1e-5)
    assert losses["torch_fp32_upcast"] == pytest.approx(expected, rel=1e-5)

    loss, dx, dw = reference.fp64_linear_cross_entropy_grads_chunked(inputs.x, inputs.w, inputs.target, chunk_tokens=3,
                                                                 softcap=SOFTCAP)
    x64 = inputs.x.detach().double().requires_grad_()
    w64 = inputs.w.detach().double().requires_grad_()
    truth = reference.linear_cross_entropy_fp64(x64, w64, inputs.target, softcap=SOFTCAP)
    truth.backward()
    torch.testing.assert_close(loss, truth.detach(), rtol=1e-13, atol=0)
    torch.testing.assert_close(dx, x64.grad, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(dw, w64.grad, rtol=1e-12, atol=1e-15)


def test_softcapped_simpo_baseline():
    from fusedkern.reference import simpo_from_logprobs

    rows = sweeps.run_sweep("simpo", [2], seq=8, providers=["huggingface_fp32"], modes=["full"], softcap=SOFTCAP,
                           workloads=["masked_30"], **CPU_ONE_REP)
    inputs = workloads.make_simpo_inputs(2, 8, HIDDEN, VOCAB, dtype=torch.float32, device="cpu", workload="masked_30")
    logps = reference.linear_logprobs_fp64(inputs.x.detach(), inputs.w.detach(), inputs.target, softcap=SOFTCAP)
    expected, _ = simpo_from_logprobs(logps, inputs.target != workloads.IGNORE_INDEX, beta=0.1, gamma=0.5, alpha=1.0,
                                       label_smoothing=0.0)
    assert [r["loss"] for r in rows] == [pytest.approx(float(expected), rel=1e-5)]


@pytest.mark.skipif(not HAS_TORCH_LCE_OPTIONS, reason="torch without LinearCrossEntropyOptions")
def test_torch_linear_cross_entropy_takes_the_chunked_path(monkeypatch):
    calls = []
    real = torch.nn.functional.linear_cross_entropy

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "linear_cross_entropy", spy)
    inputs = workloads.make_ce_inputs(8, HIDDEN, VOCAB, dtype=torch.float32, device="cpu")
    for key, chunked in (("torch_linear_cross_entropy", True), ("torch_linear_cross_entropy_unfused", False)):
        calls.clear()
        prov.PROVIDERS["ce"][key].build(inputs)["loss_only"].run(None)
        assert calls[0]["ignore_index"] == workloads.IGNORE_INDEX
        assert isinstance(calls[0].get("options"), torch.nn.LinearCrossEntropyOptions) is chunked


def test_quack_provider_is_skipped_with_a_reason_on_cpu(capsys):
    assert "quack" in prov.PROVIDERS["ce"]
    rows = sweeps.run_sweep("ce", [8], providers=["quack", "cublas_3gemm"], modes=["full"], **CPU_ONE_REP)
    assert {r["provider"] for r in rows} == {"cublas_3gemm"}
    assert "skipping provider quack: ProviderUnavailable: QuACK runs only on CUDA tensors" in capsys.readouterr().err


def test_cli_refuses_another_devices_measured_folder(tmp_path, capsys):
    out = tmp_path / "data" / "measured" / "h200" / "ce.csv"  # a CPU run must not land among the H200's files
    assert bench.main([*TINY_CE_ARGV, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "data/measured/h200/" in err and "'cpu'" in err and "--overwrite" in err
    assert not out.parent.exists()
    assert bench.main([*TINY_CE_ARGV, "--out", str(out), "--append"]) == 2  # appending is writing too
    assert bench.main([*TINY_CE_ARGV, "--out", str(out), "--overwrite"]) == 0
    assert out.exists() and sidecar_path(out).exists()
    own = tmp_path / "data" / "measured" / "cpu" / "ce.csv"  # the run's own device folder is fine
    assert bench.main([*TINY_CE_ARGV, "--out", str(own)]) == 0


def test_cli_refuses_a_cpu_run_into_a_gpu_folder_on_a_gpu_host(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA H200")
    assert bench.device_slug_of() == "h200" and bench.device_slug_of("cpu") == "cpu"
    out = tmp_path / "data" / "measured" / "h200" / "ce.csv"
    assert bench.main([*TINY_CE_ARGV, "--out", str(out)]) == 2  # TINY_CE_ARGV has --device cpu
    assert "data/measured/h200/" in capsys.readouterr().err and not out.parent.exists()
    # the GPU's default output is anchored at the repository, not the working directory
    monkeypatch.chdir(tmp_path)
    default = bench.default_output("ce", "h200")
    assert default.is_absolute() and default == Path(bench.__file__).resolve().parents[2] / "data/measured/h200/ce.csv"


def test_cli_never_replaces_an_existing_file_unasked(tmp_path, capsys):
    out = tmp_path / "runs" / "ce.csv"
    assert bench.main([*TINY_CE_ARGV, "--out", str(out)]) == 0
    before = out.read_bytes()
    capsys.readouterr()
    assert bench.main([*TINY_CE_ARGV, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert str(out) in err and "--append" in err and "--overwrite" in err
    assert out.read_bytes() == before
    out.unlink()  # a sidecar left alone counts as an existing output too
    assert bench.main([*TINY_CE_ARGV, "--out", str(out)]) == 2
    assert bench.main([*TINY_CE_ARGV, "--out", str(out), "--overwrite"]) == 0
    assert bench.main([*TINY_CE_ARGV, "--out", str(out), "--append", "--workload", "masked_50"]) == 0
    assert set(load_results(out)["workload"]) == {"dense", "masked_50"}


def test_cli_on_cpu_needs_out_and_leaves_nothing_in_the_working_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert bench.main(TINY_CE_ARGV) == 2
    assert "--out" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("path, folder", [("a/data/measured/h200/ce.csv", "h200"),
                                          ("data/measured/cpu/sub/x.csv", "cpu"),
                                          ("a/data/measured/ce.csv", None), ("a/measured/h200/ce.csv", None),
                                          ("a/data/other/h200/ce.csv", None)])
def test_measured_folder_device(path, folder):
    assert bench.measured_folder_device(Path(path)) == folder


def test_trl_fused_lm_head_providers_match_fp64():
    """TRL's fused LM head (trl ≥ 1.16, its torch fold on CPU) as the bench calls it: the SFT loss equals the seed
    baseline's (the mean over the labelled tokens), dense, half ignored and softcapped, with and without a
    gradient; the log-prob objective at τ 0.7 with the entropy equals fusedkern's; the vocabulary tile is the one
    `add_fused_lm_head` uses."""
    pytest.importorskip("trl.kernels")
    trl_utils = pytest.importorskip("trl.trainer.utils")
    assert getattr(trl_utils, "_CHUNKED_LOGPROB_CHUNK_SIZE", prov.TRL_VOCAB_TILE) == prov.TRL_VOCAB_TILE
    pair = ["huggingface_bf16", "trl_fused_lm_head"]
    for options in ({"workloads": ["dense", "masked_50"], "modes": ["full", "loss_only"]},
                    {"modes": ["full"], "softcap": SOFTCAP}):
        rows = sweeps.run_sweep("ce", [16], providers=pair, seq=8, **options, **CPU_ONE_REP)
        assert len(rows) == 2 * len(options.get("workloads", [1])) * len(options["modes"])
        for key in {(r["workload"], r["mode"]) for r in rows}:
            case = [r for r in rows if (r["workload"], r["mode"]) == key]
            assert [r["note"] for r in case] == ["", ""] and any(r["provider"].startswith("trl ") for r in case)
            assert case[0]["loss"] == pytest.approx(case[1]["loss"], rel=1e-5), case
    logprobs = sweeps.run_sweep("ce", [16], providers=["fusedkern_logprobs", "trl_logprobs"], seq=8,
                                workloads=["masked_50"], modes=["loss_only"], **CPU_ONE_REP)
    assert len(logprobs) == 2 and logprobs[0]["loss"] == pytest.approx(logprobs[1]["loss"], rel=1e-5)


def test_log_prob_providers_pin_their_pass_and_agree(monkeypatch):
    """The log-prob providers at τ 0.7 with the entropy: the default (impl="auto") and the tile-pass pin
    (impl="chunked") give the same loss dense and counted; the Gluon pin is skipped on CPU with its reason, not run
    on another pass."""
    import importlib

    logprobs = importlib.import_module("fusedkern.logprobs")  # the module: where the providers' calls choose
    seen = []
    real = logprobs.choose
    monkeypatch.setattr(logprobs, "choose", lambda impl, *args, **kwargs: seen.append(impl) or real(impl, *args,
                                                                                                   **kwargs))
    names = ["fusedkern_logprobs", "fusedkern_logprobs_tile_pass", "fusedkern_logprobs_counted",
             "fusedkern_logprobs_tile_pass_counted", "fusedkern_logprobs_gluon"]
    rows = sweeps.run_sweep("ce", [16], providers=names, seq=8, workloads=["masked_50"], modes=["loss_only"],
                            **CPU_ONE_REP)
    assert sorted(r["provider"] for r in rows) == sorted(names[:4])
    assert all(r["note"] == "" for r in rows)
    assert max(r["loss"] for r in rows) == pytest.approx(min(r["loss"] for r in rows), rel=1e-6)
    assert "auto" in seen and "chunked" in seen  # each provider asks for its own strategy


def test_pad_rows_keeps_the_mean_and_the_gradient():
    """`providers.pad_rows` (Liger's CuTe kernel takes 128-multiple token counts; the bench pads the gathered rows as
    a caller would): zero rows with ignored targets up to the multiple, the same mean loss and dX, and nothing done
    at a multiple."""
    inputs = workloads.make_ce_inputs(13, HIDDEN, VOCAB, dtype=torch.float32, device="cpu", workload="masked_50", seq=8)
    x = inputs.x.detach().reshape(-1, HIDDEN).clone().requires_grad_()
    padded_x, padded_y = prov.pad_rows(x, inputs.target.reshape(-1), 8)
    assert padded_x.shape == (16, HIDDEN) and (padded_x[13:] == 0).all() and (padded_y[13:] == prov.IGNORE_INDEX).all()
    loss = torch.nn.functional.cross_entropy(padded_x @ inputs.w.detach().t(), padded_y, ignore_index=prov.IGNORE_INDEX)
    loss.backward()
    x_ref = x.detach().clone().requires_grad_()
    ref = torch.nn.functional.cross_entropy(x_ref @ inputs.w.detach().t(), inputs.target.reshape(-1),
                                            ignore_index=prov.IGNORE_INDEX)
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(x.grad, x_ref.grad)
    same = prov.pad_rows(padded_x, padded_y, 8)
    assert same[0] is padded_x and same[1] is padded_y
