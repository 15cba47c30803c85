"""The analytic memory model: its terms on known shapes, and its totals against the H200 anchors."""

from pathlib import Path

import pytest
import torch

from fusedkern.study import memory_model as mm
from fusedkern.chunk_plan import FUSED_EXTRA_BUDGET_BYTES

H, V = 4096, 128256
ANCHORS = Path(__file__).resolve().parents[2] / "data" / "reference" / "h200_anchors_2026-12-02.csv"


def _term(provider, name_part, tokens, **kw):
    found = [t for t in mm.terms(provider, tokens, H, V, **kw) if name_part in t.name]
    assert len(found) == 1, [t.name for t in mm.terms(provider, tokens, H, V, **kw)]
    return found[0]


def test_hf_bf16_logits_term_is_1002_mib_at_4096_tokens():
    term = _term("huggingface_bf16", "log-probabilities saved", 4096)
    assert term.nbytes == 4096 * 128256 * 2
    assert round(term.mib) == 1002
    assert term.formula == "T·V·e"


def test_fp32_upcast_buffers_are_twice_the_bf16_ones():
    bf16 = _term("huggingface_bf16", "log-probabilities saved", 8192)
    fp32 = _term("torch_fp32_upcast", "log-probabilities saved", 8192)
    assert fp32.nbytes == 2 * bf16.nbytes


def test_gradient_storage_is_subtracted():
    term = _term("huggingface_bf16", "measurement convention", 4096)
    assert term.nbytes == -(4096 * H + V * H) * 2


def test_default_chunk_is_largest_multiple_of_64_within_256_mib():
    c = mm.default_chunk_size(V, "bfloat16")
    assert c == 1024
    assert c * V * 2 <= 256 * mm.MIB < (c + 64) * V * 2
    assert mm.default_chunk_size(V, "float32") == 512
    assert mm.default_chunk_size(10**9, "float32") == 64  # never below one block of rows


def test_chunked_terms():
    acc = _term("fusedkern_chunked", "accumulator", 32768)
    assert acc.nbytes == V * H * 4
    # many tokens: the C = H = 4096 row buffer lives inside dW's own storage (V·H·e bytes): the peak
    # is the accumulator (+ per-token stats)
    assert _term("fusedkern_chunked", "inside dW", 32768).nbytes == 0
    assert "C = 4096" in _term("fusedkern_chunked", "inside dW", 32768).name
    assert mm.peak_extra_bytes("fusedkern_chunked", 32768, H, V) == V * H * 4 + 3 * 32768 * 4
    # a caller's chunk larger than dW's storage is a separate buffer next to the accumulator
    big = mm.peak_extra_bytes("fusedkern_chunked", 32768, H, V, chunk_size=8192)
    assert big == V * H * 4 + 8192 * V * 2 + 3 * 32768 * 4
    # few tokens (T·V·e ≤ 256 MiB + V·H·4): one chunk, no accumulator — the T×V buffer only
    for tokens in (4096, 8192):
        assert mm.peak_extra_bytes("fusedkern_chunked", tokens, H, V) == tokens * V * 2 + 3 * tokens * 4
    assert mm.peak_extra_bytes("fusedkern_chunked", 9216, H, V) > mm.peak_extra_bytes("fusedkern_chunked", 16384, H, V)
    # lean: the buffer next to dX and dW, which cancel against the convention's subtraction
    assert _term("fusedkern_chunked_lean", "chunk buffer", 32768).nbytes == 1024 * V * 2
    assert mm.peak_extra_bytes("fusedkern_chunked_lean", 32768, H, V) == 1024 * V * 2 + 3 * 32768 * 4
    # an fp32 weight needs no separate accumulator
    names = [t.name for t in mm.terms("fusedkern_chunked", 32768, H, V, dtype="float32")]
    assert not any("accumulator" in n for n in names)


def test_chunk_never_exceeds_tokens():
    assert _term("fusedkern_chunked_lean", "chunk buffer", 100, chunk_size=1024).nbytes == 100 * V * 2


@pytest.mark.parametrize("tokens", [1, 4096, 32768, 131072])
def test_fused_stays_within_its_16_mib_budget(tokens):
    # the accumulators shrink as the O(T + V) vectors grow: the sum stays within the budget
    assert 8 * mm.MIB < mm.peak_extra_bytes("fusedkern_fused", tokens, H, V) <= FUSED_EXTRA_BUDGET_BYTES


def test_fused_workspace_matches_the_kernel_budget():
    fused_ce = pytest.importorskip("fusedkern.kernels.fused_ce")
    for tokens in (4096, 32768):
        planned = fused_ce.workspace_bytes(tokens, V, H, torch.bfloat16)["backward"]
        assert planned <= _term("fusedkern_fused", "workspace", tokens).nbytes + 12 * tokens + 4 * V


def test_hf_simpo_baseline_holds_four_fp32_logits():
    tokens = 2 * 1024
    total = sum(t.nbytes for t in mm.terms("huggingface_fp32", tokens, H, V, op="simpo") if t.nbytes > 0)
    assert total == 4 * tokens * V * 4


def test_liger_chunk_rule():
    assert mm.liger_chunk_size(4096, H, V) == 128  # ceil(V/H) = 32 -> 4096/32
    assert mm.liger_chunk_size(32768, H, V) == 1024
    assert mm.liger_chunk_size(3, H, V, "0.8.5") == 1  # capped at T from 0.8 on
    assert mm.liger_chunk_size(40, 8, 1000, "0.4.2") == 1  # ceil(40/125) -> 1


def test_floor_providers_hold_the_logits_output():
    for p in ("cublas_3gemm", "cublas_1gemm"):
        assert round(mm.peak_extra_mib(p, 4096, H, V)) == 1002


def test_every_provider_is_modelled():
    for p in mm.PROVIDERS:
        assert mm.peak_extra_mib(p, 4096, H, V) >= 0


def test_terms_table_ends_with_total():
    rows = mm.terms_table("huggingface_bf16", 4096, H, V)
    assert rows[-1]["term"] == "peak extra"
    assert rows[-1]["mib"] == pytest.approx(sum(r["mib"] for r in rows[:-1]))


@pytest.mark.parametrize(
    "bad",
    [
        dict(provider="nope"),
        dict(tokens=0),
        dict(tokens=2.5),
        dict(dtype="int8"),
        dict(op="dpo"),
    ],
)
def test_bad_arguments_name_the_argument(bad):
    args = dict(provider="huggingface_bf16", tokens=4096, hidden=H, vocab=V)
    kwargs = {}
    for k, v in bad.items():
        (args if k in args else kwargs)[k] = v
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        mm.terms(args["provider"], args["tokens"], args["hidden"], args["vocab"], **kwargs)


def test_torch_dtypes_are_accepted():
    torch = pytest.importorskip("torch")
    assert mm.element_size(torch.bfloat16) == 2
    assert mm.element_size(torch.float32) == 4


# Anchors measured on an H200 (data/reference/): the model lands within 2 % or 2 MiB of each of them
# (the largest gaps are the documented approximations: Liger's SimPO temporaries, 17 MiB of 2021,
# and CCE's fixed workspace of ~1.5 MiB).
_ANCHOR_PROVIDERS = {
    "huggingface_bf16": ("huggingface_bf16", 0.02, 2.0),
    "torch_fp32_upcast": ("torch_fp32_upcast", 0.02, 2.0),
    "liger-kernel 0.8.5": ("liger-kernel 0.8.5", 0.02, 2.0),
    "liger-kernel 0.4.2": ("liger-kernel 0.4.2", 0.02, 2.0),
    "cut-cross-entropy 25.1.1 (default filter_eps)": ("cut_cross_entropy", 0.0, 2.0),
}


def _anchor_rows():
    import csv

    with open(ANCHORS, newline="") as f:
        for row in csv.DictReader(f):
            if row["provider"] in _ANCHOR_PROVIDERS and row["full_peak_extra_mib"]:
                yield row


@pytest.mark.parametrize("row", list(_anchor_rows()), ids=lambda r: f"{r['op']}-{r['provider']}-{r['x']}")
def test_model_matches_h200_anchors(row):
    provider, rtol, atol = _ANCHOR_PROVIDERS[row["provider"]]
    x = int(row["x"])
    tokens = x if row["x_name"] == "tokens" else x * 1024  # SimPO: batch sequences of 1024 tokens
    model = mm.peak_extra_mib(provider, tokens, H, V, op=row["op"], seq=1024)
    measured = float(row["full_peak_extra_mib"])
    assert model == pytest.approx(measured, rel=rtol, abs=atol)


# This project's own H200 measurements (data/measured/h200/), when committed. Every provider is held
# to 2 % / 2 MiB except fusedkern_fused, whose measured peak (~32 MiB) is about twice the kernel's
# documented workspace: the backward kept the dX pass's workspace referenced (by its launch
# arguments) while the dW pass allocated its own. Fixed in fused_ce.py after the last H200 call, so
# the committed data still shows the gap; re-measure, then add the provider here.
MEASURED = Path(__file__).resolve().parents[2] / "data" / "measured" / "h200"
_EXACT = {"huggingface_bf16", "torch_fp32_upcast", "huggingface_fp32", "fusedkern_chunked", "fusedkern_chunked_lean",
          "liger-kernel 0.8.5", "liger-kernel 0.4.2", "cut_cross_entropy", "cublas_3gemm", "cublas_1gemm"}


def _measured_rows():
    import csv

    for sweep in ("ce", "simpo"):
        path = MEASURED / f"{sweep}.csv"
        if not path.exists():
            continue
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                if row["mode"] == "full" and row["peak_extra_mib"] and row["provider"] in _EXACT:
                    yield row


@pytest.mark.parametrize("row", list(_measured_rows()), ids=lambda r: f"{r['op']}-{r['provider']}-{r['x']}")
def test_model_matches_our_h200_measurements(row):
    x = int(row["x"])
    tokens = x if row["x_name"] == "tokens" else x * 1024
    model = mm.peak_extra_mib(row["provider"], tokens, H, V, op=row["op"], seq=1024)
    assert model == pytest.approx(float(row["peak_extra_mib"]), rel=0.02, abs=2.0)


# `num_valid_tokens` (issue 31): the H100's Llama-3 rows at 4096 tokens, half of every sequence ignored
# (data/measured/h100/), and the H200's Gemma-2 rows at 8192 dense tokens (data/measured/h200/). Those runs
# predate x being sorted into dX's own storage: their device-count rows hold one more T·H·e (the sorted copy of
# x beside dX), which the model no longer has: what the next GPU run should measure is the row minus that. (Their
# host-count rows, at n = T/2 and n = T, held (2n − T)·H·e = 0 more.)
_H100 = Path(__file__).resolve().parents[2] / "data" / "measured" / "h100"
_HEADS = {"llama3": (4096, 128256), "gemma2": (2304, 256000)}
_COUNT_ROWS = [(_H100 / "ce_llama3_masked_50.csv", "fusedkern_chunked"),
               (_H100 / "ce_llama3_masked_50.csv", "fusedkern_chunked_counted"),
               (_H100 / "ce_llama3_masked_50.csv", "fusedkern_chunked_device_count"),
               (_H100 / "ce_llama3_dense.csv", "fusedkern_chunked_lean"),
               (MEASURED / "ce_gemma2_shuffled.csv", "fusedkern_chunked"),
               (MEASURED / "ce_gemma2_shuffled.csv", "fusedkern_chunked_counted"),
               (MEASURED / "ce_gemma2_shuffled.csv", "fusedkern_chunked_device_count")]


@pytest.mark.parametrize("path,provider", _COUNT_ROWS, ids=lambda v: getattr(v, "stem", v))
def test_model_matches_the_counted_paths_measured(path, provider):
    import csv

    with open(path, newline="") as f:
        (row,) = [r for r in csv.DictReader(f) if r["provider"] == provider and r["mode"] == "full"]
    hidden, vocab = _HEADS[row["head"]]
    tokens = int(row["x"])
    valid = tokens // 2 if row["workload"] == "masked_50" else tokens  # half of every sequence, exactly
    measured = float(row["peak_extra_mib"])
    if provider.endswith("_device_count"):
        measured -= tokens * hidden * 2 / mm.MIB  # the sorted copy of x those runs still made (bf16)
    model = mm.peak_extra_mib(provider, tokens, hidden, vocab, valid_tokens=valid)
    assert model == pytest.approx(measured, rel=0.01, abs=1.0)


@pytest.mark.parametrize("head,tokens", [("llama3", 4096), ("gemma2", 6144), ("llama3", 32768)])
@pytest.mark.parametrize("lean", [False, True])
def test_counted_paths_peak_no_higher_than_the_dense_path(head, tokens, lean):
    """Issue 31 item 2: the counted paths' peak no larger than the dense path's, up to the row order and
    sorted target (≤ 2·T·8 bytes) and, for a device count in lean mode past T·H > C·V, dX's copy while it is
    put back in order (T·H·e − C·V·e: 5.5 MiB at 32768 tokens of Llama-3)."""
    hidden, vocab = _HEADS[head]
    suffix = "_lean" if lean else ""
    dense = mm.peak_extra_bytes(f"fusedkern_chunked{suffix}", tokens, hidden, vocab)
    for frac in (0.3, 0.5, 0.7):
        n = int(tokens * frac)
        host = mm.peak_extra_bytes(f"fusedkern_chunked{suffix}_counted", tokens, hidden, vocab, valid_tokens=n)
        assert host <= dense + 16 * tokens
        device = mm.peak_extra_bytes(f"fusedkern_chunked{suffix}_device_count", tokens, hidden, vocab, valid_tokens=n)
        copy = max(0, tokens * hidden - 1024 * vocab) * 2 if lean else 0
        assert device <= dense + 16 * tokens + copy


def test_counted_terms_at_llama3_4096():
    n = 2048
    counted = {t.formula: t.nbytes for t in mm.terms("fusedkern_chunked_counted", 4096, H, V, valid_tokens=n)}
    assert counted["C·V·e"] == n * V * 2  # the plan over the valid rows: one chunk of 2048
    assert counted["(T + n)·8"] == (4096 + n) * 8
    device = mm.terms("fusedkern_chunked_device_count", 4096, H, V, valid_tokens=n)
    assert sum(t.nbytes for t in device) - mm.peak_extra_bytes("fusedkern_chunked", 4096, H, V) == 16 * 4096


@pytest.mark.parametrize("bad", [-1, 4097, 2.5, True])
def test_valid_tokens_out_of_range_is_refused(bad):
    with pytest.raises(ValueError, match="valid_tokens"):
        mm.terms("fusedkern_chunked_counted", 4096, H, V, valid_tokens=bad)
