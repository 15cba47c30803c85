"""examples/train_sft.py runs on CPU at the tiny preset (Triton's interpreter), and its loss with
fusedkern equals the loss without it (the model's own logits) at the first step, where model and data
are the same; two micro-batches per step, so the num_items_in_batch normalization is in play. On a GPU
(marked): the same at the small preset under bf16 autocast, with a lower peak memory than the logits."""

from __future__ import annotations

import csv
import importlib
import importlib.machinery
import importlib.util
import math
import sys
import types
from pathlib import Path

import pytest
import torch

import fusedkern
from fusedkern._runtime import interpreting

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_sft.py"
TINY = ["--device", "cpu", "--preset", "tiny", "--seq-len", "12", "--grad-accum", "2", "--seed", "3"]


@pytest.fixture(scope="module")
def train_sft():
    spec = importlib.util.spec_from_file_location("train_sft", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


@pytest.mark.skipif(not interpreting(), reason="CPU tensors need Triton's interpreter (on when no GPU is visible)")
@pytest.mark.parametrize("arch", ["llama", "torch"])
def test_fusedkern_loss_equals_the_logits_loss_at_step_0(train_sft, arch, capsys, monkeypatch):
    if arch == "llama" and importlib.util.find_spec("transformers") is None:
        pytest.skip("needs Hugging Face Transformers (pip install -e '.[hf]' in a clone)")
    calls = []
    # count the calls where the model finds fusedkern: the patch's module for Llama, the package for torch
    host = importlib.import_module("fusedkern.integrations.transformers") if arch == "llama" else fusedkern
    real = host.linear_cross_entropy
    monkeypatch.setattr(host, "linear_cross_entropy", lambda *a, **k: calls.append(1) or real(*a, **k))
    fused = train_sft.main([*TINY, "--arch", arch, "--steps", "2"])
    printed = capsys.readouterr().out
    assert len(calls) == 2 * 2  # steps × micro-batches
    plain = train_sft.main([*TINY, "--arch", arch, "--steps", "1", "--no-fusedkern"])
    assert len(calls) == 4
    assert [r["step"] for r in fused] == [0, 1]
    assert all(math.isfinite(r["loss"]) and r["peak_mib"] is None for r in fused)
    assert fused[0]["loss"] == pytest.approx(plain[0]["loss"], rel=1e-5)
    assert fused[1]["loss"] != fused[0]["loss"]  # the optimizer step changed the model (and the batch changed)
    assert "step ms" in printed and "tokens/s" in printed and f"{fused[0]['loss']:.6f}" in printed


def test_bad_arguments_exit_with_a_message(train_sft, capsys):
    with pytest.raises(SystemExit):
        train_sft.main(["--device", "cpu", "--steps", "0"])
    assert "--steps must be ≥ 1" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "torch"])
def test_on_cuda_the_loss_matches_and_the_peak_memory_is_lower(train_sft, arch):
    if arch == "llama" and importlib.util.find_spec("transformers") is None:
        pytest.skip("needs Hugging Face Transformers (pip install -e '.[hf]' in a clone)")
    args = ["--device", "cuda", "--preset", "small", "--steps", "2", "--arch", arch]
    fused = train_sft.main(args)
    plain = train_sft.main([*args, "--no-fusedkern"])
    # bf16 autocast on both sides: the same bf16 GEMM inputs, the softmax in fp32 on both
    assert fused[0]["loss"] == pytest.approx(plain[0]["loss"], rel=1e-4)
    # the [tokens, 32000] logits, their fp32 upcast and their gradient are what fusedkern leaves out
    assert fused[1]["peak_mib"] < 0.8 * plain[1]["peak_mib"], (fused[1]["peak_mib"], plain[1]["peak_mib"])


# ----------------------------------------------------------------------------------------------
# --loss-impl, --warmup-steps, --csv (the training-step table's rows)


def test_loss_impl_flags_and_their_aliases(train_sft, capsys):
    parse = train_sft.parse_args
    assert parse(["--device", "cpu", "--no-fusedkern"]).loss_impl == "hf"
    assert parse(["--device", "cpu", "--loss-impl", "hf", "--no-fusedkern"]).loss_impl == "hf"
    args = parse(["--device", "cpu", "--loss-impl", "hf", "--steps", "5", "--warmup-steps", "3", "--csv", "x.csv"])
    assert (args.loss_impl, args.fusedkern, args.warmup_steps, args.csv) == ("hf", False, 3, "x.csv")
    assert parse(["--device", "cpu", "--no-fusedkern", "--steps", "1"]).warmup_steps == 0
    for argv, message in ((["--loss-impl", "liger", "--fusedkern"], "--fusedkern contradicts --loss-impl liger"),
                          (["--no-fusedkern", "--steps", "2", "--warmup-steps", "2"], "--warmup-steps must be"),
                          (["--loss-impl", "cce", "--arch", "torch"], "it needs --arch llama")):
        with pytest.raises(SystemExit):
            parse(["--device", "cpu", *argv])
        assert message in capsys.readouterr().err
    preset = train_sft.PRESETS["llama3-8b-2l"]
    assert (preset.vocab, preset.hidden, preset.intermediate, preset.heads, preset.kv_heads, preset.seq_len,
            preset.rope_theta) == (128256, 4096, 14336, 32, 8, 8192, 500000.0)


@pytest.mark.parametrize("impl,package", [("liger", "liger-kernel"), ("cce", "cut-cross-entropy")])
def test_a_missing_competitor_is_a_clear_error(train_sft, impl, package, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in (
        "liger_kernel", "cut_cross_entropy") else real(name, *a))
    with pytest.raises(SystemExit):
        train_sft.main(["--device", "cpu", "--loss-impl", impl, "--steps", "1"])
    err = capsys.readouterr().err
    assert f"--loss-impl {impl} needs {package}, which is not installed: pip install {package}" in err


@pytest.mark.skipif(not interpreting(), reason="CPU tensors need Triton's interpreter (on when no GPU is visible)")
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs Hugging Face Transformers")
def test_csv_rows_of_hf_and_fusedkern(train_sft, tmp_path, capsys):
    path = tmp_path / "table.csv"
    for impl in ("hf", "fusedkern"):
        train_sft.main([*TINY, "--loss-impl", impl, "--steps", "2", "--warmup-steps", "1", "--csv", str(path)])
    assert f"appended to {path}: loss_impl=fusedkern" in capsys.readouterr().out
    with open(path, newline="") as f:
        assert next(csv.reader(f)) == list(train_sft.CSV_COLUMNS)
    with open(path, newline="") as f:
        hf, fk = list(csv.DictReader(f))
    for column in ("loss_impl", "preset", "layers", "seq_len", "batch_size", "grad_accum", "steps_timed", "step_ms_p20",
                   "step_ms_p50", "step_ms_p80", "tokens_per_s", "peak_mib", "final_loss", "first_loss", "protocol",
                   "workload", "device", "torch", "triton", "transformers", "commit", "fp32_dw"):
        assert column in hf
    assert (hf["loss_impl"], fk["loss_impl"]) == ("hf", "fusedkern")
    assert (fk["preset"], fk["layers"], fk["seq_len"], fk["batch_size"], fk["grad_accum"], fk["steps_timed"]) == (
        "tiny", "2", "12", "2", "2", "1")
    assert (fk["protocol"], fk["workload"], fk["device"], fk["peak_mib"], fk["fp32_dw"]) == (
        "sequential", "sft_masked_50", "cpu", "", "n/a")  # no autocast on CPU: the dW question does not arise
    assert fk["torch"] == torch.__version__ and fk["transformers"]
    assert float(fk["step_ms_p20"]) <= float(fk["step_ms_p50"]) <= float(fk["step_ms_p80"])
    tokens = 2 * 2 * 12  # grad-accum × batch × seq
    # tokens/s is written to 0.1 (abs), from the unrounded p50 that the CSV gives to 0.01 ms (rel)
    assert float(fk["tokens_per_s"]) == pytest.approx(tokens / (float(fk["step_ms_p50"]) / 1e3), rel=1e-3, abs=0.05)
    assert float(fk["first_loss"]) == pytest.approx(float(hf["first_loss"]), rel=1e-5)
    # on CUDA the row states each implementation's dW accumulation
    assert {k: v[0] for k, v in train_sft.DW_ACCUM.items()} == {"fusedkern": "yes", "hf": "no", "liger": "yes",
                                                                 "cce": "no"}


def _fake_module(monkeypatch, name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__dict__.update(attrs)
    monkeypatch.setitem(sys.modules, name, module)
    return module


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs Hugging Face Transformers")
def test_liger_is_applied_to_the_head_only(train_sft, monkeypatch):
    # Liger's kernels need a GPU: a stand-in records the call (the model stays unpatched)
    calls = []
    _fake_module(monkeypatch, "liger_kernel")
    _fake_module(monkeypatch, "liger_kernel.transformers", apply_liger_kernel_to_llama=lambda **k: calls.append(k))
    train_sft.main([*TINY, "--loss-impl", "liger", "--steps", "1"])
    assert len(calls) == 1
    model = calls[0].pop("model")
    assert type(model).__name__ == "LlamaForCausalLM"
    assert calls[0] == dict(rope=False, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=False,
                            swiglu=False)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs Hugging Face Transformers")
def test_cce_without_cce_patch_calls_linear_cross_entropy_as_cce_patch_does(train_sft, monkeypatch, tmp_path):
    # CCE's kernels do not run in Triton's interpreter: a torch stand-in with its signature checks the
    # plumbing (shift, reduction, num_items_in_batch) against the unpatched model's loss
    seen = []

    def linear_cross_entropy(e, c, targets, ignore_index=-100, softcap=None, reduction="mean", shift=False, **kw):
        seen.append((reduction, shift, kw))
        assert shift
        logits = (e[:, :-1] @ c.T).float()
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets[:, 1:].flatten(), reduction=reduction,
                                                 ignore_index=ignore_index)

    _fake_module(monkeypatch, "cut_cross_entropy", linear_cross_entropy=linear_cross_entropy)  # no .transformers
    path = tmp_path / "t.csv"
    cce = train_sft.main([*TINY, "--loss-impl", "cce", "--steps", "2", "--csv", str(path)])
    hf = train_sft.main([*TINY, "--loss-impl", "hf", "--steps", "2"])
    assert seen == [("sum", True, {})] * 4  # steps × micro-batches, each divided by num_items_in_batch
    assert [r["loss"] for r in cce] == pytest.approx([r["loss"] for r in hf], rel=1e-5)
    with open(path, newline="") as f:
        (row,) = csv.DictReader(f)
    assert row["loss_impl"] == "cce" and "no cce_patch in the wheel" in row["head_patch"]


DPO_EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_dpo.py"


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="needs TRL (pip install -e '.[trl]' in a clone)")
@pytest.mark.skipif(not interpreting(), reason="CPU tensors need Triton's interpreter (on when no GPU is visible)")
def test_train_dpo_fusedkern_equals_trl_head(monkeypatch, tmp_path):
    """examples/train_dpo.py on CPU: two SGD steps of TRL's DPOTrainer with fusedkern's head (counted) and with
    TRL's own, same losses and margins; the CSV rows name the implementation, protocol and workload; --loss-impl
    liger refuses clearly where Liger-Kernel is not installed."""
    spec = importlib.util.spec_from_file_location("train_dpo", DPO_EXAMPLE)
    train_dpo = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, train_dpo)  # dataclasses look their module up there
    spec.loader.exec_module(train_dpo)
    import fusedkern.integrations.trl as fk_trl

    calls = []
    real = fk_trl.linear_logprobs_with_stats
    monkeypatch.setattr(fk_trl, "linear_logprobs_with_stats", lambda *a, **k: calls.append(1) or real(*a, **k))
    path = tmp_path / "dpo.csv"
    tiny = ["--device", "cpu", "--steps", "2", "--csv", str(path)]
    fused = train_dpo.main([*tiny, "--loss-impl", "fusedkern"])
    assert len(calls) == 2 * 2 and not fk_trl.is_patched()  # policy + reference per step; unpatched afterwards
    trl_head = train_dpo.main([*tiny, "--loss-impl", "trl"])
    assert len(calls) == 4
    for a, b in zip(fused, trl_head, strict=True):
        for key in ("loss", "rewards/margins", "logps/chosen", "logps/rejected"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-5), key
    assert fused[1]["logps/chosen"] != fused[0]["logps/chosen"]
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["loss_impl"] for r in rows] == ["fusedkern", "trl"]
    assert all(r["protocol"] == "sequential" and r["workload"] == "dpo_prompt_50" for r in rows)
    if importlib.util.find_spec("liger_kernel") is None:
        with pytest.raises(SystemExit):
            train_dpo.main([*tiny, "--loss-impl", "liger"])
