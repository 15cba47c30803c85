"""Where a training step's time goes (fusedkern.study.step_profile, scripts/gpu_step_profile.py): every kernel of a
hand-built trace lands in its category, backward kernels in their forward operator's; a real CPU trace of a tiny
Llama puts the LM head, SDPA, the layers, the optimizer and the embedding where they belong; the script's --tiny run
writes the CSV notebook 10 reads; Amdahl's bound."""

from __future__ import annotations

import csv
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fusedkern.study import step_profile as sp
from fusedkern.study.step_profile import Op

ROOT = Path(__file__).resolve().parents[2]


def scope(i, name, parent=None, thread=1):
    return Op(id=i, name=sp.scope_name(name), parent=parent, thread=thread)


def test_classify_a_hand_built_trace():
    """Forward on thread 1, backward on thread 2 (as on a GPU): each kernel's category, by scope, name and the
    forward operator its backward node came from."""
    ops = [
        scope(0, sp.MODEL), scope(1, sp.BACKBONE, parent=0), scope(2, sp.LAYER, parent=1),
        Op(3, "aten::linear", parent=2, thread=1, sequence_nr=10, kernels=(("nvjet_hsh_256x128", 5.0),)),
        Op(4, "aten::_scaled_dot_product_flash_attention", parent=2, thread=1, sequence_nr=11,
           kernels=(("pytorch_flash::flash_fwd_kernel", 7.0),)),
        Op(5, "aten::embedding", parent=1, thread=1, sequence_nr=12, kernels=(("indexSelectLargeIndex", 1.0),)),
        # the head: outside the backbone, inside the model's forward
        Op(6, "aten::mm", parent=0, thread=1, sequence_nr=13, kernels=(("sm90_xmma_gemm_bf16", 11.0),)),
        Op(7, "fusedkern::logprobs", parent=0, thread=1, sequence_nr=14,
           kernels=(("_ce_rows_kernel", 3.0), ("_logits_partials_kernel", 4.0))),
        # the trainer's loss code after the forward
        Op(8, "aten::mean", thread=1, sequence_nr=15, kernels=(("reduce_kernel", 0.5),)),
        # backward, thread 2: a layer's, the attention's, the head's, one whose node is unknown, AccumulateGrad
        Op(20, sp.BACKWARD_PREFIX + "MmBackward0", thread=2, fwd_thread=1, sequence_nr=10),
        Op(21, "aten::mm", parent=20, thread=2, kernels=(("nvjet_hsh_128x256", 9.0),)),
        Op(22, sp.BACKWARD_PREFIX + "FlashBackward0", thread=2, fwd_thread=1, sequence_nr=11),
        Op(23, "aten::_flash_attention_backward", parent=22, thread=2, kernels=(("flash_bwd_kernel", 13.0),)),
        Op(24, sp.BACKWARD_PREFIX + "LogprobsBackward", thread=2, fwd_thread=1, sequence_nr=14),
        Op(25, "aten::mul", parent=24, thread=2, kernels=(("elementwise_kernel", 2.0),)),
        Op(26, "aten::mm", parent=24, thread=2, kernels=(("nvjet_tss_dw", 6.0),)),
        Op(27, sp.BACKWARD_PREFIX + "MulBackward0", thread=2, fwd_thread=1, sequence_nr=99),
        Op(28, "aten::mul", parent=27, thread=2, kernels=(("elementwise_kernel", 0.25),)),
        Op(29, sp.BACKWARD_PREFIX + "torch::autograd::AccumulateGrad", thread=2),
        Op(30, "aten::add_", parent=29, thread=2, kernels=(("vectorized_elementwise_kernel", 1.5),)),
        Op(40, "Optimizer.step#AdamW.step", thread=1),
        Op(41, "aten::_fused_adamw_", parent=40, thread=1, kernels=(("fused_adamw_kernel", 8.0),)),
        # a backward node's own event repeats its forward's sequence number: it must not stand for the forward
        Op(42, "MmBackward0", parent=20, thread=2, sequence_nr=10),
    ]
    totals, ranked = sp.classify(ops, unclaimed_us=0.75)
    assert totals == {"head_gemm": 11.0 + 4.0 + 6.0, "head_other": 3.0 + 2.0, "attention": 7.0 + 13.0,
                      "layers_other": 5.0 + 9.0, "optimizer": 8.0,
                      "rest": 1.0 + 0.5 + 0.25 + 1.5 + 0.75}
    assert ranked[0] == ("attention", "flash_bwd_kernel", 13.0)
    assert sum(us for _, _, us in ranked) == pytest.approx(sum(totals.values()) - 0.75)
    with pytest.raises(ValueError, match="own id"):
        sp.classify([Op(1, "a"), Op(1, "b")])


def test_classify_a_real_cpu_trace_of_a_tiny_llama():
    """torch.profiler on CPU (each operator's self time stands for its kernels): the LM head and its loss inside the
    model's forward, SDPA in the layers, the layers' other work, AdamW, the embedding in the rest."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, attn_implementation="sdpa")
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, 97, (2, 8))
    with sp.scope_hooks(model), profile(activities=[ProfilerActivity.CPU]) as prof:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
    assert not model._forward_pre_hooks and not model._forward_hooks  # removed on exit
    ops, unclaimed = sp.ops_from_profile(prof, device_kernels=False)
    totals, ranked = sp.classify(ops, unclaimed_us=unclaimed)
    assert unclaimed == 0 and all(totals[c] > 0 for c in sp.CATEGORIES), totals
    where = {}
    for category, name, _ in ranked:
        where.setdefault(name, set()).add(category)
    assert "attention" in where["aten::_scaled_dot_product_flash_attention_for_cpu"]
    assert where["aten::embedding"] == {"rest"}
    assert {"head_gemm", "layers_other"} <= where["aten::mm"]
    assert "head_other" in where["aten::_log_softmax"]  # the model's own loss, inside its forward


def test_scope_hooks_need_a_causal_lm():
    with pytest.raises(TypeError, match="base_model"):
        sp.scope_hooks(torch.nn.Linear(2, 2))


def test_amdahl_bound():
    assert sp.amdahl_bound(400.0, 80.0, 40.0) == pytest.approx(400 / 360)
    assert sp.amdahl_bound(100.0, 0.0, 0.0) == 1.0
    with pytest.raises(ValueError, match="head_ms"):
        sp.amdahl_bound(100.0, 120.0, 10.0)


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="needs TRL (pip install 'fusedkern[trl]')")
def test_script_tiny_writes_the_breakdown(tmp_path):
    """scripts/gpu_step_profile.py --tiny: one profiled SFT step of TRL's trainer with fusedkern's head (CPU,
    interpreter), one CSV row per category with the run's kernel total, and the head's floor row."""
    out = tmp_path / "breakdown.csv"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_step_profile.py"), "--tiny", "--model",
                           "qwen3-0.6b", "--row", "fusedkern", "--out", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    steps = [r for r in rows if r["row"] == "fusedkern"]
    assert [r["category"] for r in steps] == list(sp.CATEGORIES)
    assert all(r["protocol"] and r["workload"] == "sft_full" for r in rows)
    total = float(steps[0]["kernel_total_ms"])
    assert sum(float(r["kernel_ms"]) for r in steps) == pytest.approx(total, abs=0.01)
    kernel = {r["category"]: float(r["kernel_ms"]) for r in steps}
    assert kernel["head_other"] > 0 and kernel["layers_other"] > 0 and kernel["optimizer"] > 0
    assert total <= float(steps[0]["step_wall_ms"]) * 1.05
    (floor,) = [r for r in rows if r["category"] == sp.FLOOR_CATEGORY]
    assert float(floor["kernel_ms"]) > 0 and floor["model"] == "qwen3-0.6b"


def test_device_busy_counts_overlaps_once_and_skips_named_ranges():
    """The GPU's busy time is the union of its kernels' intervals; a named range on the device's timeline (a
    `record_function` around the forward) spans kernels and is neither busy time nor an unclaimed kernel."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def event(start, end, *, annotation=False, device=DeviceType.CUDA, name="k"):
        return SimpleNamespace(device_type=device, time_range=SimpleNamespace(start=start, end=end),
                               is_user_annotation=annotation, kernels=(), cpu_parent=None, name=name,
                               sequence_nr=-1, thread=0, fwd_thread=0, self_cpu_time_total=0.0)

    # two streams overlapping on 4-6, a gap 10-12, a range 0-100 around all of it
    events = [event(0, 6), event(4, 10, name="a"), event(12, 15, name="b"), event(13, 14),
              event(0, 100, annotation=True), event(1015, 1020, name="c")]
    prof = SimpleNamespace(events=lambda: events)
    assert sp.device_busy_us(prof) == 18
    assert sp.idle_gaps(prof, min_us=500) == [(1000, 15, "b", "c")]
    assert sp.idle_gaps(prof, min_us=1) == [(1000, 15, "b", "c"), (2, 10, "a", "b")]
    _, unclaimed = sp.ops_from_profile(prof, device_kernels=True)
    assert unclaimed == 6 + 6 + 3 + 1 + 5


def test_host_during_gap_names_the_wait_or_the_work():
    """A gap that opens as a host event ends, which began before it, is a wait (a sync: `aten::item` under the
    trainer's loss); a gap the host spends inside one event is the host's own work; else nothing is named."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def event(name, start, end, *, device=DeviceType.CPU, parent=None):
        return SimpleNamespace(device_type=device, time_range=SimpleNamespace(start=start, end=end), name=name,
                               cpu_parent=parent, is_user_annotation=False)

    loss = event("compute_loss", 0, 5000)
    item = event("aten::item", 200, 2002, parent=loss)
    launch = event("optimizer.step", 4000, 9000)
    events = [event("k1", 100, 2000, device=DeviceType.CUDA), event("k2", 3000, 3100, device=DeviceType.CUDA),
              event("k3", 8000, 8100, device=DeviceType.CUDA), loss, item, launch,
              event("aten::_local_scalar_dense", 250, 2001, parent=item)]
    prof = SimpleNamespace(events=lambda: events)
    (first, at1, *_), (second, at2, *_) = sorted(sp.idle_gaps(prof, min_us=500), key=lambda g: g[1])
    assert (first, at1, second, at2) == (1000, 1900, 4900, 3000)
    assert sp.host_during_gap(prof, at1, first) == "waited in aten::_local_scalar_dense ← aten::item ← compute_loss"
    assert sp.host_during_gap(prof, at2, second, depth=1) == "busy in optimizer.step"
    assert sp.host_during_gap(SimpleNamespace(events=lambda: events[:3]), at2, second) == "not in any recorded event"
