"""The study modules behind notebook 11 (fusedkern/study/distill_memory.py, distill_accuracy.py, trl_path.py,
architectures.py): the distillation memory model's terms and chunk rules, the accuracy rows, the live TRL
coverage, one architecture patched against unpatched. CPU, a few seconds."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from fusedkern.chunk_plan import GRAD_CHUNK_BUDGET_BYTES
from fusedkern.distillation import distill_plan, shares_dw_storage
from fusedkern.study import architectures, distill_accuracy, distill_memory

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def test_materialized_bytes_counts_each_tv_tensor():
    # bf16: logits 2 + 2, upcasts 4 + 4, log-softmaxes 4 + 4, fp32 grad 4, grad cast 2 = 26 bytes an entry
    assert distill_memory.materialized_bytes(3, 5, 2, beta=0.0) == 3 * 5 * 26
    assert distill_memory.materialized_bytes(3, 5, 2, beta=1.0) == 3 * 5 * 26
    assert distill_memory.materialized_bytes(3, 5, 2, beta=0.5) == 3 * 5 * 30  # + the fp32 log-mixture
    assert distill_memory.materialized_bytes(3, 5, 4, beta=0.0) == 3 * 5 * 32


@pytest.mark.parametrize("tokens", [512, 1024, 2048, 8192, 65536])
@pytest.mark.parametrize("head", list(distill_memory.HEADS))
def test_fusedkern_bytes_follow_the_functions_chunk_plan(head, tokens):
    V, H = distill_memory.HEADS[head]["vocab"], distill_memory.HEADS[head]["hidden"]
    w = torch.empty((V, H), dtype=torch.bfloat16, device="meta")
    plan = distill_plan(tokens, w, w, True, "fp32", None)  # what linear_distillation_loss runs with
    shared = shares_dw_storage(plan, w)  # both buffers in dW's own storage, beside the fp32 accumulator
    want = (0 if plan.buffer_in_dw_storage else plan.chunk_tokens * V * 2) \
        + (0 if shared else plan.chunk_tokens * V * 2) + (V * H * 4 if plan.fp32_accumulator else 0)
    got = distill_memory.fusedkern_bytes(tokens, V, H, 2)
    assert got == want
    if shared:
        assert 2 * plan.chunk_tokens * V <= V * H and plan.chunk_tokens == H // 2 // 64 * 64
    elif plan.chunk_tokens == tokens:  # one chunk, no accumulator: both buffers within the accumulator's allowance
        assert not plan.fp32_accumulator and 2 * tokens * V * 2 <= GRAD_CHUNK_BUDGET_BYTES + V * H * 4
    else:  # the teacher's own buffer within the logits budget
        assert plan.chunk_tokens * V * 2 <= GRAD_CHUNK_BUDGET_BYTES


def test_memory_rows_flat_in_tokens_past_the_first_cap():
    rows = distill_memory.memory_rows([4096, 8192, 65536])
    for head in distill_memory.HEADS:
        fk = {r["tokens"]: r["fusedkern_bytes"] for r in rows if r["head"] == head}
        assert fk[4096] == fk[8192] == fk[65536]
        ratios = [r["ratio"] for r in rows if r["head"] == head]
        assert ratios == sorted(ratios) and ratios[-1] > 100


def test_distillation_errors_rows_and_rule():
    rows = distill_accuracy.distillation_errors([0.0, 0.5], ["float32"], tokens=5, student_hidden=8,
                                                teacher_hidden=6, vocab=33, seed=1, chunk_tokens=2)
    assert len(rows) == 2 * 3 * 2  # β × quantity × impl
    by = {(r["beta"], r["quantity"], r["impl"]): r["rel_err"] for r in rows}
    for beta in (0.0, 0.5):
        for q in distill_accuracy.QUANTITIES:
            assert 0 <= by[(beta, q, "fusedkern")] <= 2 * by[(beta, q, "torch")] + 1e-6
            assert by[(beta, q, "torch")] < 1e-5


def test_rel_err_is_relative_and_absolute_at_zero():
    assert distill_accuracy.rel_err(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 1.0])) == pytest.approx(2 ** -0.5)
    assert distill_accuracy.rel_err(torch.tensor([0.5]), torch.tensor([0.0])) == 0.5


def test_one_architecture_patched_equals_unpatched():
    row = architectures.patched_vs_unpatched("Gemma2")  # a tied head with a softcap: the patch must fold it
    assert row["equal"] and row["head"] == "tied, softcap" and row["gradients"] > 0
    assert row["grad_rel_diff"] < 1e-5


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="needs TRL")
def test_trainer_coverage_is_read_from_the_live_patch():
    from fusedkern.integrations import trl as fk_trl
    from fusedkern.study import trl_path

    rows = trl_path.trainer_coverage()
    names = {r["trainer"] for r in rows}
    assert {"SFTTrainer", "DPOTrainer", "GRPOTrainer", "DistillationTrainer", "GKDTrainer"} <= names
    assert all(r["fusedkern_now"] for r in rows)
    assert not fk_trl.is_patched()  # unpatched after reading
