"""A peer that refuses a shape shows as refused, not missing (issue 48 item 3): a provider that refuses the shape,
or some of its modes, gets rows with note "refused: ..." in the sweep (both protocols, and the accuracy sweep) and
runs where it accepts; QuACK 0.6.5's chunk rule and the chunk the study passes it; the gathered peers carry a
refusal; the small heads of the training table are bench presets."""

from __future__ import annotations

import math

import pytest
import torch

from fusedkern.study import bench, sweeps, workloads
from fusedkern.study import providers as prov

CPU = dict(hidden=16, vocab=40, dtype=torch.float32, device="cpu", warmup=1, reps=1, min_reps=1, progress=False)


def picky(inputs):
    """Refuses 8 tokens, takes 16; refuses its gradient modes at 16 (as QuACK at a chunk of `hidden` rows)."""
    if inputs.x.shape[0] == 8:
        raise prov.ProviderRefused("no 8 here")
    steps = prov.loss_steps(lambda: torch.nn.functional.cross_entropy(inputs.x @ inputs.w.T, inputs.target))
    return {mode: step if mode == "loss_only" else prov.Refusal("no gradient at 16") for mode, step in steps.items()}


@pytest.mark.parametrize("protocol", ["shuffled", "sequential"])
def test_refused_shapes_and_modes_become_rows(monkeypatch, protocol):
    registry = {**prov.PROVIDERS["ce"], "picky": prov.Provider("picky", picky, lambda: "picky 1.0")}
    monkeypatch.setitem(prov.PROVIDERS, "ce", registry)
    rows = sweeps.run_sweep("ce", [8, 16], providers=["picky", "cublas_1gemm"], modes=["loss_only", "full"],
                            protocol=protocol, **CPU)
    mine = {(r["x"], r["mode"]): r for r in rows if r["provider"] == "picky 1.0"}
    assert set(mine) == {(8, "loss_only"), (8, "full"), (16, "loss_only"), (16, "full")}
    assert mine[(8, "loss_only")]["note"] == mine[(8, "full")]["note"] == "refused: no 8 here"
    assert mine[(16, "full")]["note"] == "refused: no gradient at 16" and math.isnan(mine[(16, "full")]["ms_p50"])
    assert mine[(16, "loss_only")]["note"] == "" and mine[(16, "loss_only")]["ms_p50"] > 0


def test_accuracy_sweep_writes_a_refused_row(monkeypatch):
    registry = {**prov.PROVIDERS["ce"], "picky": prov.Provider("picky", picky, lambda: "picky 1.0")}
    monkeypatch.setitem(prov.PROVIDERS, "ce", registry)
    rows = sweeps.run_accuracy([8, 16], providers=["picky"], hidden=16, vocab=40, dtype=torch.float32, device="cpu",
                               progress=False)
    assert [r["note"] for r in rows] == ["refused: no 8 here", "refused: no gradient at 16"]


@pytest.mark.parametrize("tokens, hidden, chunk, refused", [
    (8192, 4096, 8192, False), (16384, 4096, 8192, False), (32768, 4096, 8192, False),
    (4096, 4096, 8192, True),  # one chunk of 4096 rows
    (12288, 4096, 8192, True),  # the last chunk: 4096 rows
    (4000, 4096, 8192, True),  # 4000 rows padded to 4096
    (32768, 4096, 4096, True),  # QuACK's default chunk at hidden 4096
    (8192, 1024, 4096, False), (32768, 2048, 4096, False), (1024, 1024, 4096, True), (5120, 1024, 4096, True),
])
def test_quack_chunk_rule(tokens, hidden, chunk, refused):
    reason = prov.quack_refusal(tokens, hidden, chunk)
    assert (reason is not None) is refused
    if refused:
        assert f"a chunk of {hidden} rows" in reason


def test_quack_chunk_the_study_passes():
    assert prov.quack_chunk_size(4096) == 8192
    assert prov.quack_chunk_size(1024) == prov.quack_chunk_size(2048) == prov.QUACK_CHUNK == 4096


def test_a_gathered_peer_carries_a_refusal():
    built = prov._gathered(picky)
    inputs = workloads.make_ce_inputs(32, 16, 40, dtype=torch.float32, device="cpu", workload="masked_50", seq=8)
    steps = built(inputs)  # 16 valid rows: the gradient modes refused, the loss-only pass runs
    assert isinstance(steps["full"], prov.Refusal) and isinstance(steps["backward"], prov.Refusal)
    keep = inputs.target != workloads.IGNORE_INDEX
    expected = torch.nn.functional.cross_entropy(inputs.x.detach()[keep] @ inputs.w.detach().T, inputs.target[keep])
    with torch.no_grad():
        assert torch.allclose(steps["loss_only"].run(None), expected)
    with pytest.raises(prov.ProviderRefused, match="no 8 here"):
        built(workloads.make_ce_inputs(16, 16, 40, dtype=torch.float32, device="cpu", workload="masked_50", seq=8))


def test_the_small_heads_are_presets():
    def resolve(*flags):
        return bench.resolve_head(bench.build_parser().parse_args(["ce", *flags]))

    assert resolve("--head", "qwen3_0p6b") == (1024, 151936, None)
    assert resolve("--head", "llama32_1b") == (2048, 128256, None)
    assert workloads.head_name(151936, 1024, None) == "qwen3_0p6b"
    assert workloads.head_name(128256, 2048, None) == "llama32_1b"


def test_liger_cute_vocabulary_rule_is_liger_s_own():
    """The refusal's multiple is the tile N Liger's CuTe kernel checks, read from its source (importing it needs the
    CuTe DSL)."""
    import ast
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("liger_kernel")
    if spec is None:
        pytest.skip("needs Liger-Kernel")
    source = Path(spec.origin).parent / "ops" / "cutedsl" / "ops" / "_fused_linear_cross_entropy_forward_sm90.py"
    if not source.exists():
        pytest.skip("this Liger-Kernel has no CuTe SM90 kernel")
    values = {node.targets[0].id: node.value.value for node in ast.parse(source.read_text()).body
              if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
              and isinstance(node.value, ast.Constant)}
    assert values["TILE_N"] == prov.LIGER_CUTE_VOCAB_MULTIPLE
    assert 151936 % prov.LIGER_CUTE_VOCAB_MULTIPLE and not 128256 % prov.LIGER_CUTE_VOCAB_MULTIPLE
