"""The distill op of the benchmark (`python -m fusedkern.bench distill`) on CPU at tiny shapes.

What must hold before a GPU run: the distill inputs share the ce op's student tensors and carry a teacher;
fusedkern's providers give the materialized fp32 computation's loss and gradients (plain and with Liger's
hard-label mix), and TRL's own fused divergence agrees on the loss (it keeps fp32 logits: equal in fp32
inputs), also with a softcapped head; the floors do their GEMMs; Liger (CUDA only) is refused with a reason;
the CLI writes rows with x_name "tokens" and prints the ratio to the distill floors.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fusedkern._runtime import interpreting
from fusedkern.study import bench, workloads
from fusedkern.study import providers as prov
from fusedkern.study.results import read_rows

HIDDEN, VOCAB, TOKENS, SEQ = 16, 67, 12, 4

# CPU tensors through Triton's interpreter: on a GPU machine the benchmark itself is the test
pytestmark = [pytest.mark.usefixtures("one_cpu_thread"),
              pytest.mark.skipif(not interpreting(), reason="CPU tests of the bench (kernels under the interpreter)")]


def _inputs(workload: str = "masked_50", dtype=torch.float32):
    return workloads.make_distill_inputs(TOKENS, HIDDEN, VOCAB, dtype=dtype, device="cpu", workload=workload, seq=SEQ)


def test_distill_inputs_share_the_ce_student_and_carry_a_teacher():
    inputs = _inputs()
    ce = workloads.make_ce_inputs(TOKENS, HIDDEN, VOCAB, dtype=torch.float32, device="cpu", workload="masked_50",
                                  seq=SEQ)
    assert inputs.op == "distill" and torch.equal(inputs.x, ce.x) and torch.equal(inputs.target, ce.target)
    xt, wt = inputs.extras["teacher_x"], inputs.extras["teacher_w"]
    assert xt.shape == (TOKENS, HIDDEN) and wt.shape == (VOCAB, HIDDEN) and not wt.requires_grad
    assert not torch.equal(xt, inputs.x)
    assert torch.equal(_inputs().extras["teacher_w"], wt)  # fixed per seed
    assert workloads.make_inputs("distill", TOKENS, hidden=HIDDEN, vocab=VOCAB, dtype=torch.float32, device="cpu",
                                 seq=SEQ, seed=0, workload="dense", softcap=None).op == "distill"


def _full(key: str, inputs) -> tuple[float, torch.Tensor, torch.Tensor]:
    step = prov.PROVIDERS["distill"][key].build(inputs)["full"]
    loss = float(step.run(step.setup()))
    result = (loss, inputs.x.grad.clone(), inputs.w.grad.clone())
    inputs.clear_grads()
    return result


@pytest.mark.parametrize("suffix,softcap", [("", None), ("_hard_mix", None), ("", 2.0)])
def test_fusedkern_gives_the_materialized_loss_and_gradients(suffix, softcap):
    inputs = replace(_inputs(), softcap=softcap)
    loss, dx, dw = _full(f"fusedkern_chunked{suffix}", inputs)
    ref_loss, ref_dx, ref_dw = _full(f"torch_fp32_upcast{suffix}", inputs)
    assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
    torch.testing.assert_close(dx, ref_dx, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(dw, ref_dw, rtol=1e-4, atol=1e-6)
    assert not dx[inputs.target == -100].any()


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_trl_chunked_divergence_agrees_on_the_loss_and_gradients(softcap):
    inputs = replace(_inputs(), softcap=softcap)
    trl_loss, trl_dx, trl_dw = _full("trl_chunked_divergence", inputs)
    loss, dx, dw = _full("fusedkern_chunked", inputs)
    assert trl_loss == pytest.approx(loss, rel=1e-5)
    torch.testing.assert_close(trl_dx, dx, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(trl_dw, dw, rtol=1e-4, atol=1e-6)


def test_floors_and_refusals():
    inputs = _inputs()
    two = prov.PROVIDERS["distill"]["cublas_2gemm"].build(inputs)
    four = prov.PROVIDERS["distill"]["cublas_4gemm"].build(inputs)
    assert set(two) == {"loss_only", "forward"} and set(four) == {"backward", "full"}
    for steps in (two, four):
        for step in steps.values():
            assert step.run(step.setup()) is None
    with pytest.raises(prov.ProviderUnavailable, match="CUDA"):
        prov.PROVIDERS["distill"]["liger"].build(inputs)


def test_cli_writes_distill_rows(tmp_path, capsys):
    out = tmp_path / "distill.csv"
    status = bench.main(["distill", "--tokens", "8", "--hidden", str(HIDDEN), "--vocab", str(VOCAB), "--out", str(out),
                         "--modes", "full", "--warmup", "0", "--reps", "1", "--min-reps", "1", "--no-progress",
                         "--providers", "cublas_4gemm", "fusedkern_chunked", "torch_fp32_upcast",
                         "--dtype", "float32"])
    assert status == 0
    rows = read_rows(out)
    assert {r["provider"] for r in rows} == {"cublas_4gemm", "fusedkern_chunked", "torch_fp32_upcast"}
    assert all(r["op"] == "distill" and r["x_name"] == "tokens" and int(r["x"]) == 8 for r in rows)
    losses = {r["provider"]: float(r["loss"]) for r in rows if r["provider"] != "cublas_4gemm"}
    assert losses["fusedkern_chunked"] == pytest.approx(losses["torch_fp32_upcast"], rel=1e-5)
    assert "× cublas_4gemm" in capsys.readouterr().out
