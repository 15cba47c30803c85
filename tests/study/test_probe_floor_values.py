"""probes/probe_floor_values.py (one floor, two harnesses): its preallocated and per-call floors compute the same
products, and its summary splits the two harnesses' floor ratio into the weight-scale and allocation factors and
reads each fusedkern ratio under both (the GPU run is the lead's; its --tiny CPU run takes a minute, too long here)."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def probe():
    spec = importlib.util.spec_from_file_location("probe_floor_values", ROOT / "probes" / "probe_floor_values.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_preallocated_and_per_call_floors_compute_the_same(probe):
    g = torch.Generator().manual_seed(0)
    x, w, grad = torch.randn(8, 4, generator=g), torch.randn(6, 4, generator=g), torch.randn(8, 6, generator=g)
    out = {"logits": torch.full((8, 6), math.nan), "dx": torch.full((8, 4), math.nan),
           "dw": torch.full((6, 4), math.nan)}
    probe.floor_step(x, w, grad, 3, out).run(None)
    assert torch.allclose(out["logits"], x @ w.T) and torch.allclose(out["dx"], grad @ w)
    assert torch.allclose(out["dw"], grad.T @ x)
    assert probe.floor_step(x, w, grad, 1, None).run(None) is None  # a floor records no loss


def test_summary_splits_the_floor_ratio(probe):
    std = round(probe.LOGIT_STD / math.sqrt(1024), 5)
    base = dict(hidden=1024, vocab=151936, tokens=8192)
    rows = []
    for gemms, (p, i, scale_ms, alloc_ms) in ((1, (3.3, 3.5, 3.4, 3.36)), (3, (9.6, 9.8, 9.9, 9.5))):
        for harness, s, floor_out, ms in (("project", std, "preallocated", p), ("independent", 0.02, "per_call", i),
                                          ("cross", std, "per_call", scale_ms), ("cross", 0.02, "preallocated",
                                                                                 alloc_ms)):
            rows.append(dict(base, harness=harness, impl=f"floor_{gemms}gemm", weight_std=s, floor_out=floor_out,
                             ms_p50=ms))
    rows += [dict(base, harness="project", impl="ce_full", weight_std=std, floor_out="", ms_p50=16.0,
                  x_floor_p50=1.6667, x_floor_other_harness=1.6327)]
    lines = probe.summary(rows)
    assert f"project 3.300 ms, independent 3.500 ms ({3.3 / 3.5:.3f}x)" in lines[0]
    assert f"over 0.02 (per call) {3.4 / 3.5:.3f}x" in lines[0] and f"(sigma 0.02) {3.36 / 3.5:.3f}x" in lines[0]
    assert f"({9.6 / 9.8:.3f}x)" in lines[1]
    assert "ce_full" in lines[2] and f"({(1.6667 / 1.6327 - 1) * 100:+.1f} %)" in lines[2]


def test_bad_head_argument(probe):
    with pytest.raises(SystemExit):
        probe.main(["--out", "x.csv", "--heads", "1024x151936"])
