"""examples/train_sft.py runs on CPU at the tiny preset (Triton's interpreter), and its loss with
fusedkern equals the loss without it (the model's own logits) at the first step, where model and data
are the same; two micro-batches per step, so the num_items_in_batch normalization is in play. On a GPU
(marked): the same at the small preset under bf16 autocast, with a lower peak memory than the logits."""

from __future__ import annotations

import importlib
import importlib.util
import math
import sys
from pathlib import Path

import pytest

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
        pytest.skip("needs Hugging Face Transformers (pip install 'fusedkern[hf]')")
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
        pytest.skip("needs Hugging Face Transformers (pip install 'fusedkern[hf]')")
    args = ["--device", "cuda", "--preset", "small", "--steps", "2", "--arch", arch]
    fused = train_sft.main(args)
    plain = train_sft.main([*args, "--no-fusedkern"])
    # bf16 autocast on both sides: the same bf16 GEMM inputs, the softmax in fp32 on both
    assert fused[0]["loss"] == pytest.approx(plain[0]["loss"], rel=1e-4)
    # the [tokens, 32000] logits, their fp32 upcast and their gradient are what fusedkern leaves out
    assert fused[1]["peak_mib"] < 0.8 * plain[1]["peak_mib"], (fused[1]["peak_mib"], plain[1]["peak_mib"])
