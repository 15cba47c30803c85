"""fusedkern.study.peers: the table notebooks 04, 06 and 08 draw the 2026 peers from. Each cell is measured (its
ratio, file and process), refused (a row the bench wrote as refused, or the peer's own rule where the probe kept no
row) or not measured; the bench's table wins over the probe's and the newest probe file over the older one, head by
head; the README states the committed standing."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import matplotlib
import pytest

from fusedkern.study import peers

matplotlib.use("Agg")
ROOT = Path(__file__).resolve().parents[2]
PROBE_COLUMNS = ["check", "x_name", "x", "workload", "protocol", "hidden", "vocab", "provider", "ms_p20", "ms_p50",
                 "ms_p80", "ratio_to_floor", "floor", "extra_mib", "note"]


def write(path: Path, columns: list[str], rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows([{c: r.get(c, "") for c in columns} for r in rows])


def probe_row(check, x, provider, ratio, note):
    return dict(check=check, x_name="tokens", x=x, workload="dense", protocol="shuffled", provider=provider,
                ms_p50=10 * ratio, ratio_to_floor=ratio, note=note)


def bench_row(provider, x, mode, ms, note=""):
    return dict(op="ce", provider=provider, x_name="tokens", x=x, mode=mode, ms_p50=ms, workload="dense",
                protocol="shuffled", head="qwen3_0p6b", note=note)


@pytest.fixture
def measured(tmp_path):
    """Invented numbers (FAKE): the newer probe file has H 4096 (two processes at 8192 tokens, one with QuACK) and
    H 1024; the older one H 1024 (to be ignored) and H 2048; the bench's file H 1024."""
    write(tmp_path / "side_by_side_1207b.csv", PROBE_COLUMNS, [
        probe_row("perf_ce", 8192, "fk_default", 1.10, "process A"),
        probe_row("perf_ce", 8192, "floor_3gemm", 1.0, "process A"),
        probe_row("perf_ce", 8192, "fk_default", 1.20, "process I: QuACK"),
        probe_row("perf_ce", 8192, "quack065", 1.05, "process I: QuACK"),
        probe_row("perf_ce", 4096, "fk_default", 1.30, "process A"),
        probe_row("loss_only", 8192, "quack065", 0.97, "process I: QuACK"),
        probe_row("perf_ce_h1024_v151936", 8192, "fk_default", 1.7, "process H"),
    ])
    write(tmp_path / "side_by_side_1207.csv", PROBE_COLUMNS, [
        probe_row("perf_ce_h1024_v151936", 32768, "fk_default", 1.5, ""),
        probe_row("perf_ce_h2048_v128256", 16384, "fk_default", 1.25, ""),
    ])
    bench_columns = ["op", "provider", "x_name", "x", "mode", "ms_p50", "workload", "protocol", "head", "note"]
    write(tmp_path / "peers3_ce_qwen3_0p6b.csv", bench_columns, [
        bench_row("cublas_3gemm", 16384, "full", 20.0), bench_row("fusedkern_chunked", 16384, "full", 30.0),
        bench_row("quack-kernels 0.6.5", 16384, "full", 22.0),
        bench_row("liger-kernel 0.8.5 CuTe SM90", 16384, "full", "", "refused: needs V % 256"),
        bench_row("cublas_1gemm", 16384, "loss_only", 7.0), bench_row("fusedkern_chunked", 16384, "loss_only", 10.5),
    ])
    return tmp_path


def cell(table, hidden, tokens, pass_, peer):
    (row,) = table[(table.hidden == hidden) & (table.tokens == tokens) & (table["pass"] == pass_)
                   & (table.peer == peer)].itertuples()
    return row


def test_cells_sources_and_refusals(measured):
    table = peers.peer_table(measured)
    ours = cell(table, 4096, 8192, "dense_ce", "fusedkern")
    assert ours.ratio == 1.20 and ours.source == "side_by_side_1207b.csv (process I)"  # QuACK's process
    assert cell(table, 4096, 8192, "dense_ce", "QuACK 0.6.5").ratio == 1.05
    refused = cell(table, 4096, 4096, "dense_ce", "QuACK 0.6.5")  # a chunk of 4096 rows: QuACK's rule
    assert refused.status == "refused" and "4096 rows" in refused.why and math.isnan(refused.ratio)
    assert cell(table, 4096, 8192, "dense_ce", "Liger 0.8.5 CuTe SM90").status == "not measured"
    # H 1024: the bench's file only (the probes' H 1024 rows are another source, left out)
    assert cell(table, 1024, 16384, "dense_ce", "fusedkern").ratio == pytest.approx(1.5)
    assert cell(table, 1024, 16384, "dense_ce", "QuACK 0.6.5").ratio == pytest.approx(1.1)
    liger = cell(table, 1024, 16384, "dense_ce", "Liger 0.8.5 CuTe SM90")
    assert liger.status == "refused" and liger.why == "needs V % 256" and liger.source.startswith("peers3_ce")
    assert cell(table, 1024, 16384, "loss_only", "fusedkern").ratio == pytest.approx(1.5)
    assert not ((table.hidden == 1024) & (table.tokens.isin([8192, 32768]))).any()
    # H 2048 from the older probe file, the only one that has it
    assert cell(table, 2048, 16384, "dense_ce", "fusedkern").ratio == 1.25
    assert peers.standing(table, "dense_ce", 4096, 128256) == {
        "fusedkern": "1.20–1.30×", "QuACK 0.6.5": "1.05×", "Liger 0.8.5 CuTe SM90": "not measured",
        "bf16 logits + CE": "not measured"}
    assert peers.standing(table, "dense_ce", 1024, 151936)["Liger 0.8.5 CuTe SM90"] == "refused (needs V % 256)"


def test_the_figures_draw_every_status(measured):
    import matplotlib.pyplot as plt

    table = peers.peer_table(measured)
    fig, axes = plt.subplots(1, 3)
    peers.plot_peer_grid(axes, table, "dense_ce")
    texts = [t.get_text() for ax in axes for t in ax.texts]
    assert "refused" in texts and "n/m" in texts and "1.05" in texts
    fig, ax = plt.subplots()
    peers.plot_head_sizes(ax, table, "dense_ce", 16384)
    assert any("refused" in t.get_text() for t in ax.texts)
    plt.close("all")


def test_no_data_is_not_measured(tmp_path):
    assert peers.peer_table(tmp_path).empty


def test_readme_states_the_committed_standing():
    """The README's first screen names QuACK 0.6.5, and results.md's "At a glance", which it points to, gives the
    standing the committed data hold."""
    table = peers.peer_table(ROOT / "data" / "measured" / "h100")
    readme = (ROOT / "README.md").read_text()
    assert "QuACK 0.6.5" in readme[:readme.index("## Quickstart")] and "At a glance" in readme
    results = (ROOT / "docs" / "results.md").read_text()
    start = results.index("## At a glance")
    first_screen = results[start:results.index("\n## ", start + 1)]
    for pass_, hidden, vocab in (("dense_ce", 4096, 128256), ("dense_ce", 1024, 151936), ("loss_only", 4096, 128256),
                                 ("loss_only", 1024, 151936)):
        said = peers.standing(table, pass_, hidden, vocab)
        for peer in ("fusedkern", "QuACK 0.6.5"):
            assert said[peer] in first_screen, (pass_, hidden, peer, said[peer])
