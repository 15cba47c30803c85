"""The preference op of the benchmark (`python -m fusedkern.bench preference`) on CPU at tiny shapes.

What must hold before the GPU run: every loss type's fusedkern provider gives TRL's materialized loss and
gradients on the same inputs (fusedkern's kernels run in Triton's interpreter: one full step per loss type);
the CLI writes rows with a `loss_type` column, the floors once per batch as loss_type "all", and
`tables.ratio_to` divides each loss type's rows by them; unknown loss types are refused with exit status 2;
Liger (CUDA only) is skipped with a reason, per loss type.
"""

from __future__ import annotations

import math

import pytest
import torch

from fusedkern.preference import LOSS_TYPES
from fusedkern.study import bench, sweeps, tables, workloads
from fusedkern.study import providers as prov
from fusedkern.study.results import SCHEMA_COLUMNS, load_results, read_rows, write_results

HIDDEN, VOCAB, SEQ = 32, 97, 8
CPU = dict(hidden=HIDDEN, vocab=VOCAB, dtype=torch.float32, device="cpu", warmup=1, reps=1, min_reps=1,
           progress=False, seq=SEQ)


pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def _inputs(batch: int = 2, workload: str = "masked_30"):
    return workloads.make_preference_inputs(batch, SEQ, HIDDEN, VOCAB, dtype=torch.float32, device="cpu",
                                            workload=workload)


def test_preference_inputs_share_simpo_tensors_and_carry_the_loss_tensors():
    inputs = _inputs(4)
    simpo = workloads.make_simpo_inputs(4, SEQ, HIDDEN, VOCAB, dtype=torch.float32, device="cpu", workload="masked_30")
    assert torch.equal(inputs.x, simpo.x) and torch.equal(inputs.target, simpo.target) and inputs.op == "preference"
    extras = inputs.extras
    assert extras["ref_chosen_logps"].shape == extras["ref_rejected_logps"].shape == (2,)
    assert extras["ref_logps"].shape == (4,) and extras["kto_labels"].sum() == 2 and extras["kl"].shape == (1,)
    assert torch.equal(_inputs(4).extras["ref_logps"], extras["ref_logps"])  # fixed per seed
    view = workloads.for_loss_type(inputs, "kto")
    assert view.x is inputs.x and view.loss_type == "kto" and inputs.loss_type is None


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_fusedkern_gives_trl_fp32_loss_and_gradients(loss_type):
    view = workloads.for_loss_type(_inputs(), loss_type)
    results = {}
    for key in ("trl_fp32", "fusedkern_chunked"):
        step = prov.PROVIDERS["preference"][key].build(view)["full"]
        loss = step.run(step.setup())
        results[key] = (float(loss), view.x.grad.clone(), view.w.grad.clone())
        view.clear_grads()
    (loss, dx, dw), (ref_loss, ref_dx, ref_dw) = results["fusedkern_chunked"], results["trl_fp32"]
    assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
    torch.testing.assert_close(dx, ref_dx, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(dw, ref_dw, rtol=1e-4, atol=1e-6)


def test_sweep_crosschecks_fusedkern_against_trl_and_times_floors_once():
    providers = ["cublas_3gemm", "trl_fp32", "fusedkern_chunked"]
    rows = sweeps.run_sweep("preference", [2], providers=providers, modes=["full"], loss_types=["sigmoid"], **CPU)
    assert sorted((r["provider"], r["loss_type"]) for r in rows) == [
        ("cublas_3gemm", "all"), ("fusedkern_chunked", "sigmoid"), ("trl_fp32", "sigmoid")]
    assert all(r["note"] == "" for r in rows)
    assert sweeps.loss_mismatches(rows, rel=1e-5, abs_tol=1e-6) == []
    broken = [{**r, "loss": r["loss"] + 1} if r["provider"] == "fusedkern_chunked" else r for r in rows]
    assert len(sweeps.loss_mismatches(broken)) == 1


def test_liger_is_skipped_per_loss_type_on_cpu_and_unknown_loss_types_are_refused():
    rows = sweeps.run_sweep("preference", [2], providers=["liger", "trl_fp32"], modes=["full"],
                            loss_types=["sigmoid", "ipo"], **CPU)
    assert {(r["provider"], r["loss_type"]) for r in rows} == {("trl_fp32", "sigmoid"), ("trl_fp32", "ipo")}
    assert prov.LIGER_PREFERENCE.keys() == set(LOSS_TYPES) - {"ipo"}  # Liger 0.8.5's DPO refuses ipo
    with pytest.raises(ValueError, match="bad loss types"):
        sweeps.run_sweep("preference", [2], providers=["trl_fp32"], loss_types=["dpo"], **CPU)
    with pytest.raises(ValueError, match="loss types are for the preference op"):
        sweeps.run_sweep("simpo", [2], providers=["cublas_3gemm"], loss_types=["sigmoid"], **CPU)
    assert "liger_ref_model" not in [p.key for p in prov.select_providers("preference", None)]


def test_cli_refuses_unknown_loss_types(tmp_path, capsys):
    out = tmp_path / "p.csv"
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["preference", "--loss-types", "sigmoid", "dpo", "--device", "cpu", "--out", str(out)])
    assert exit_info.value.code == bench.EXIT_REFUSED == 2
    assert "dpo" in capsys.readouterr().err and not out.exists()


def test_cli_writes_every_loss_type_and_ratio_to_divides_by_the_shared_floor(tmp_path, capsys):
    out = tmp_path / "preference_shuffled.csv"
    argv = ["preference", "--batches", "2", "4", "--seq", str(SEQ), "--hidden", str(HIDDEN), "--vocab", str(VOCAB),
            "--dtype", "float32", "--device", "cpu", "--providers", "cublas_1gemm", "cublas_3gemm", "trl_fp32",
            "--modes", "forward", "full", "--warmup", "1", "--reps", "2", "--min-reps", "1", "--no-progress",
            "--out", str(out), "--loss-types", *LOSS_TYPES]
    assert bench.main(argv) == 0
    df = load_results(out)
    assert list(df.columns[:len(SCHEMA_COLUMNS)]) == list(SCHEMA_COLUMNS)
    assert {"loss_type", "protocol", "workload", "head", "note"} <= set(df.columns)
    assert set(df["protocol"]) == {"shuffled"} and set(df["op"]) == {"preference"}
    trl = df[df["provider"] == "trl_fp32"]
    assert set(trl["loss_type"]) == set(LOSS_TYPES) and len(trl) == len(LOSS_TYPES) * 2 * 2
    floors = df[df["provider"].str.startswith("cublas")]
    assert set(floors["loss_type"]) == {"all"} and len(floors) == 2 * 2  # 1gemm forward, 3gemm full; 2 batches
    assert not trl["loss"].isna().any()
    meta = df.attrs["meta"]
    assert meta["loss_types"] == list(LOSS_TYPES) and meta["sweep"] == "preference"
    assert meta["loss_args"] == {"robust": {"label_smoothing": 0.1}}
    full = df[df["mode"] == "full"]
    ratios = tables.ratio_to(full, "cublas_3gemm")
    trl_ratios = ratios[ratios["provider"] == "trl_fp32"]
    assert len(trl_ratios) == len(LOSS_TYPES) * 2 and set(trl_ratios["loss_type"]) == set(LOSS_TYPES)
    for _, r in trl_ratios.iterrows():
        floor = full[(full["provider"] == "cublas_3gemm") & (full["x"] == r["x"])]["ms_p50"].item()
        assert r["ratio"] == pytest.approx(r["ms_p50"] / floor)
    table = capsys.readouterr().out
    assert "-- loss_type kto" in table and "full: ms_p50 (× cublas_3gemm)" in table


def test_rows_differing_only_in_loss_type_are_kept_and_merged_apart(tmp_path):
    base = {"op": "preference", "provider": "p", "x_name": "batch", "x": 2, "mode": "full", "ms_p20": 1.0,
            "ms_p50": 1.0, "ms_p80": 1.0, "peak_extra_mib": math.nan, "n_reps": 1, "note": "", "workload": "dense",
            "protocol": "shuffled"}
    meta = {"sweep": "preference", "hidden": HIDDEN, "vocab": VOCAB}
    env = {"date_utc": "2026-01-01T00:00:00+00:00"}
    path = tmp_path / "p.csv"
    write_results([{**base, "loss_type": "sigmoid"}, {**base, "loss_type": "kto"}], path, meta=meta, environment=env)
    write_results([{**base, "loss_type": "kto", "ms_p50": 2.0}], path, meta=meta, environment=env, append=True)
    assert sorted((r["loss_type"], r["ms_p50"]) for r in read_rows(path)) == [("kto", 2.0), ("sigmoid", 1.0)]


def test_preference_inputs_do_not_saturate_the_losses():
    """The reference log-probs sit a few nats from the policy's own, so every loss has a real gradient (a
    saturated KTO or DPO loss would time GEMMs on near-zero gradients, which run faster)."""
    inp = workloads.make_preference_inputs(4, 6, 8, 50, dtype=torch.float32, device="cpu", seed=3)
    logits = inp.x.detach() @ inp.w.detach().T
    policy = torch.log_softmax(logits, -1).gather(-1, inp.target.clamp_min(0)[..., None])[..., 0]
    policy = policy.masked_fill(inp.target == -100, 0).sum(-1)
    gap = inp.extras["ref_logps"] - policy
    assert gap.abs().max() < 10 and gap.abs().max() > 0  # nats: near, not equal
    torch.testing.assert_close(torch.cat([inp.extras["ref_chosen_logps"], inp.extras["ref_rejected_logps"]]),
                               inp.extras["ref_logps"])
