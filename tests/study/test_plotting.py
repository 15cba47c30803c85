"""Figures are byte-identical across saves, and the helpers handle the shapes the notebooks give them.

The data here are made up on the spot to exercise the drawing code; they are never written to the
repository (every file goes to pytest's tmp_path).
"""

import hashlib
import subprocess
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402

from fusedkern.study import plotting, results, tables  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _results(shuffle: bool = False) -> pd.DataFrame:
    rows = []
    for provider, scale in (("cublas_3gemm", 1.0), ("fusedkern_chunked", 1.1), ("liger-kernel 0.8.5", 1.4),
                            ("huggingface_bf16", 1.2), ("some_new_provider", 2.0)):
        for x in (4096, 8192, 16384, 32768):
            ms = scale * x / 240.0
            rows.append(dict(op="ce", provider=provider, x_name="tokens", x=x, mode="full", ms_p20=ms * 0.98,
                             ms_p50=ms, ms_p80=ms * 1.03, peak_extra_mib=scale * x / 100, n_reps=10))
    df = pd.DataFrame(rows)
    return df.sample(frac=1.0, random_state=3).reset_index(drop=True) if shuffle else df


def _figure(df: pd.DataFrame):
    plotting.use_style()
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(13, 4), layout="constrained")
    plotting.plot_quantiles(a, df[df.provider != "cublas_3gemm"])
    floor = df[df.provider == "cublas_3gemm"]
    plotting.draw_floor(a, floor.x, floor.ms_p50)
    a.legend()
    plotting.plot_ratios(b, tables.ratio_to(df, "cublas_3gemm"), skip=["cublas_3gemm"])
    model = df.assign(mib=df.peak_extra_mib * 0.9)[["provider", "x", "mib"]]
    plotting.plot_memory(c, model, df)
    plotting.add_caption(fig, results.provenance({"gpu_name": "Test GPU", "torch": "2.x",
                                                   "date_utc": "2026-01-01T00:00:00+00:00"}, "test data"))
    return fig


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_two_saves_are_byte_identical(tmp_path):
    first = plotting.save_figure(_figure(_results()), tmp_path / "a" / "fig")
    second = plotting.save_figure(_figure(_results()), tmp_path / "b" / "fig")
    assert first.png.exists() and first.svg.exists()
    assert first.png.read_bytes() == second.png.read_bytes()
    assert first.svg.read_bytes() == second.svg.read_bytes()


def test_row_order_does_not_change_the_figure(tmp_path):
    first = plotting.save_figure(_figure(_results()), tmp_path / "sorted")
    second = plotting.save_figure(_figure(_results(shuffle=True)), tmp_path / "shuffled")
    assert _digest(first.png) == _digest(second.png)
    assert _digest(first.svg) == _digest(second.svg)


_SCRIPT = """
import sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
from fusedkern.study import plotting
plotting.use_style()
fig, ax = plt.subplots(figsize=(4, 3))
ax.plot([4096, 8192], [1.0, 2.0], label="x")
plotting.size_axis(ax, [4096, 8192])
ax.legend()
plotting.save_figure(fig, sys.argv[1])
"""


def test_separate_processes_write_identical_files(tmp_path):
    """SVG ids come from a hash salt, which must be fixed across processes, not only within one."""
    stems = [tmp_path / "p1" / "fig", tmp_path / "p2" / "fig"]
    procs = [subprocess.Popen([sys.executable, "-c", _SCRIPT, str(stem)], cwd=ROOT) for stem in stems]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    for suffix in (".png", ".svg"):
        a, b = (stem.with_name("fig" + suffix) for stem in stems)
        assert a.read_bytes() == b.read_bytes(), suffix


def test_svg_has_no_date_and_png_no_software_tag(tmp_path):
    fig, ax = plt.subplots()
    ax.plot([1, 2], [1, 2])
    saved = plotting.save_figure(fig, tmp_path / "meta")
    svg = saved.svg.read_text()
    assert "<dc:date>" not in svg
    assert b"Software" not in saved.png.read_bytes()[:4096]


def test_saved_figure_shows_its_png_and_hides_paths(tmp_path):
    fig, ax = plt.subplots()
    ax.plot([1, 2], [3, 4])
    saved = plotting.save_figure(fig, tmp_path / "shown")
    assert saved._repr_png_() == saved.png.read_bytes()
    assert str(tmp_path) not in repr(saved)
    assert not plt.get_fignums()  # closed: the inline backend will not draw it twice


def test_size_axis_ticks_are_the_sizes():
    fig, ax = plt.subplots()
    plotting.size_axis(ax, [32768, 4096, 8192, 16384, 4096])
    assert list(ax.get_xticks()) == [4096, 8192, 16384, 32768]
    fig.canvas.draw()
    assert [t.get_text() for t in ax.get_xticklabels()] == ["4096", "8192", "16384", "32768"]
    plt.close(fig)


def test_ratio_to_divides_by_the_baseline_at_the_same_point():
    ratios = tables.ratio_to(_results(shuffle=True), "cublas_3gemm")
    chunked = ratios[ratios.provider == "fusedkern_chunked"]
    assert list(chunked.x) == [4096, 8192, 16384, 32768]
    assert chunked.ratio.to_numpy() == pytest.approx([1.1] * 4)
    assert (ratios[ratios.provider == "cublas_3gemm"].ratio == 1.0).all()


def test_ratio_to_drops_points_without_baseline():
    df = _results()
    df = df[~((df.provider == "cublas_3gemm") & (df.x == 4096))]
    assert 4096 not in set(tables.ratio_to(df, "cublas_3gemm").x)


def test_missing_values_are_skipped_not_plotted(tmp_path):
    df = _results()
    df.loc[(df.provider == "huggingface_bf16") & (df.x == 32768), ["ms_p20", "ms_p50", "ms_p80"]] = float("nan")
    fig, ax = plt.subplots()
    drawn = plotting.plot_quantiles(ax, df)
    assert "huggingface_bf16" in drawn
    plt.close(fig)


def test_styles_are_stable_and_ordered():
    assert plotting.style_for("some_new_provider") == plotting.style_for("some_new_provider")
    assert tables.sort_providers(["fusedkern_chunked", "zzz", "cublas_3gemm", "huggingface_bf16"]) == [
        "huggingface_bf16", "fusedkern_chunked", "cublas_3gemm", "zzz"]


def test_provenance_names_the_stack():
    meta = {"gpu_name": "NVIDIA H200", "driver_version": "570.1", "cuda_version": "13.0", "torch": "2.11.0",
            "triton": "3.6.0", "date_utc": "2026-12-02T10:00:00+00:00", "competitors": {"liger-kernel": "0.8.5",
                                                                                       "cut-cross-entropy": None}}
    text = results.provenance(meta, "data/measured/h200/ce.csv")
    for part in ("NVIDIA H200", "driver 570.1", "CUDA 13.0", "torch 2.11.0", "triton 3.6.0", "liger-kernel 0.8.5",
                 "measured 2026-12-02", "data/measured/h200/ce.csv"):
        assert part in text
    assert "cut-cross-entropy" not in text
    assert results.provenance(None) == ""


def test_chunk_size_variants_follow_their_parent():
    order = tables.sort_providers(["fusedkern_chunked_c8192", "fusedkern_chunked_lean", "fusedkern_chunked_c512",
                                     "fusedkern_chunked"])
    assert order == ["fusedkern_chunked", "fusedkern_chunked_c512", "fusedkern_chunked_c8192", "fusedkern_chunked_lean"]
    style = plotting.style_for("fusedkern_chunked_c512")
    assert style["color"] == plotting.style_for("fusedkern_chunked")["color"]
    assert style["label"].endswith("C = 512")


def test_chunk_tradeoff_table_keeps_the_default_row_where_it_meets_a_study_point():
    def row(provider, x, ms, mib, mode="full"):
        return dict(op="ce", provider=provider, x_name="tokens", x=x, mode=mode, ms_p50=ms, peak_extra_mib=mib)
    timing = pd.DataFrame([row("fusedkern_chunked", 32768, 160.0, 2004.0),
                           row("fusedkern_chunked_c4096", 32768, 161.0, 2004.0),
                           row("fusedkern_chunked_c512", 32768, 200.0, 2004.0),
                           row("fusedkern_chunked_lean", 32768, 170.0, 251.0)])
    floor = pd.DataFrame([row("cublas_3gemm", 32768, 150.0, 8016.0)])
    table = tables.chunk_tradeoff_table(
        timing, None, floor=floor, default_chunk=lambda provider, tokens: 1024 if provider.endswith("_lean") else 4096)
    fp32 = table[table["accumulation"] == "fp32"]
    assert list(fp32["chunk_tokens"]) == [512, 4096] and list(fp32["default"]) == [False, True]
    assert fp32[fp32["default"]]["ratio"].iloc[0] == pytest.approx(160.0 / 150.0)
    assert table[table["accumulation"] != "fp32"]["chunk_tokens"].tolist() == [1024]


def test_measured_runs_merge_per_size_and_mode(tmp_path):
    from fusedkern.study.results import write_results

    def rows(provider_ms: dict, modes, xs):
        return [dict(op="ce", provider=p, x_name="tokens", x=x, mode=m, ms_p20=ms, ms_p50=ms, ms_p80=ms,
                     peak_extra_mib=1.0, n_reps=5, loss=float("nan"), note="")
                for p, ms in provider_ms.items() for m in modes for x in xs]

    meta = dict(sweep="ce", hidden=8, vocab=16, dtype="bfloat16")
    # older run: every mode at 1 and 2; newer run: full only, at 2 and 3 (a different floor value)
    write_results(rows({"cublas_3gemm": 10.0, "cublas_1gemm": 4.0, "fusedkern_chunked": 11.0},
                       ["full", "loss_only"], [1, 2]), tmp_path / "old.csv",
                  meta=meta, environment={"date_utc": "2026-12-01T00:00:00+00:00"})
    write_results(rows({"cublas_3gemm": 20.0, "fusedkern_chunked": 21.0}, ["full"], [2, 3]), tmp_path / "new.csv",
                  meta=meta, environment={"date_utc": "2026-12-03T00:00:00+00:00"})
    merged = results.load_measured_runs([tmp_path / "new.csv", tmp_path / "old.csv"])
    source = {(int(r.x), r.mode, r.provider): r.source for r in merged.itertuples()}
    assert source[(1, "full", "fusedkern_chunked")] == "old.csv"  # only the old run measured x = 1
    assert source[(2, "full", "fusedkern_chunked")] == "new.csv"  # the newer run wins where both measured
    assert source[(2, "full", "cublas_3gemm")] == "new.csv"  # ... with its own floor: ratios never mix runs
    assert source[(2, "loss_only", "fusedkern_chunked")] == "old.csv"  # a mode the new run skipped stays
    assert (3, "loss_only", "fusedkern_chunked") not in source
    assert len(merged) == len(set(zip(merged.x, merged["mode"], merged.provider)))  # one row per point
    assert set(merged.attrs["meta"]["sources"]) == {"old.csv", "new.csv"}
    lines, caption = results.runs_provenance(merged, "data/measured/x")
    assert any("old.csv (tokens 1, 2; loss_only, full)" in line for line in lines)
    assert any("new.csv (tokens 2, 3; full)" in line for line in lines)
    assert "old.csv: commit" in caption and "new.csv: commit" in caption


def test_host_waits_and_protocol_figures_draw_what_they_are_given(tmp_path):
    probe = pd.DataFrame([
        dict(case="cublas_3gemm", ms_p50=10.0), dict(case="default_shipped", ms_p50=10.3, ratio=1.03),
        dict(case="default_sync_target_check", ms_p50=10.9, ratio=1.09),
        dict(case="lean_shipped", ms_p50=10.7, ratio=1.07),
        dict(case="lean_sync_target_check", ms_p50=11.8, ratio=1.18), dict(case="cublas_3gemm_again", ms_p50=10.1)])
    waits = tables.host_waits_table(probe)
    assert waits.set_index(["variant", "mode"]).extra_ms.round(6).to_dict() == {
        ("shipped", "default"): 0.0, ("sync_target_check", "default"): 0.6,
        ("shipped", "lean"): 0.0, ("sync_target_check", "lean"): 1.1}
    fig = plotting.host_waits_figure(waits, caption="test")
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["shipped", "sync target check"]
    assert sorted(round(p.get_width(), 6) for p in ax.patches) == [0.0, 0.0, 0.6, 1.1]
    plt.close(fig)

    sequential, interleaved = _results(), _results()
    interleaved.loc[interleaved.provider == "cublas_3gemm", "ms_p50"] *= 0.9  # a faster floor when interleaved
    fig = plotting.protocol_figure(sequential, interleaved, floors=["cublas_3gemm"], caption="test")
    lines = [line for line in fig.axes[0].get_lines() if line.get_linestyle() in ("-", "--")]
    assert len(lines) == 2 * 4  # four non-floor providers, two protocols each
    dashed = [line for line in lines if line.get_linestyle() == "--" and line.get_color() == plotting.style_for(
        "fusedkern_chunked")["color"]]
    assert dashed and all(abs(y - 1.1 / 0.9) < 1e-9 for y in dashed[0].get_ydata())
    plt.close(fig)


def _two_workloads() -> pd.DataFrame:
    """One file's worth of rows with two workloads (dense, masked_50) of the same providers and x:
    the masked floor is the same dense GEMMs timed again, fusedkern's counted run takes half."""
    dense = _results().assign(workload="dense", protocol="shuffled")
    masked = _results().assign(workload="masked_50", protocol="shuffled")
    masked.loc[masked.provider == "cublas_3gemm", "ms_p50"] *= 0.95
    masked.loc[masked.provider == "fusedkern_chunked", "ms_p50"] *= 0.5
    return pd.concat([dense, masked], ignore_index=True)


def test_processes_figure_puts_each_process_in_its_column_with_its_spread():
    """`processes_figure`: one column per process (workload) in the given order, each provider's median with its
    p20–p80 as error bars, the median written beside it."""
    df = _two_workloads()
    with pytest.raises(ValueError, match="one size"):
        plotting.processes_figure(df, providers=["cublas_3gemm"], caption="test", title="t")
    df = df[df.x == df.x.max()].copy()
    df["ms_p20"], df["ms_p80"] = df["ms_p50"] * 0.98, df["ms_p50"] * 1.03
    fig = plotting.processes_figure(df, providers=["cublas_3gemm", "fusedkern_chunked"], caption="test", title="t")
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["dense", "masked_50"] and ax.get_xlabel() == "bench process"
    floor = df[(df.provider == "cublas_3gemm") & (df["mode"] == "full")].set_index("workload").ms_p50
    medians = [line for line in ax.get_lines() if line.get_color() == plotting.style_for("cublas_3gemm")["color"]
               and len(line.get_ydata()) == 2 and line.get_linestyle() in ("None", "none", "")]
    assert medians and list(medians[0].get_ydata()) == [floor["dense"], floor["masked_50"]]
    assert sorted(t.get_text() for t in ax.texts) == sorted(f"{v:.1f}" for v in df[
        df.provider.isin(["cublas_3gemm", "fusedkern_chunked"]) & (df["mode"] == "full")].ms_p50)
    plt.close(fig)


def test_pivot_refuses_to_mix_workloads_and_selects_one_when_asked():
    df = _two_workloads()
    with pytest.raises(ValueError, match="mix 2 workload/protocol pairs.*dense/shuffled.*masked_50/shuffled"):
        tables.pivot(df, "full")  # aggfunc="first" used to keep one workload's value without a word
    dense = tables.pivot(df, "full", workload="dense")
    masked = tables.pivot(df, "full", workload="masked_50", protocol="shuffled")
    assert dense.loc["fusedkern_chunked", 4096] == pytest.approx(1.1 * 4096 / 240)
    assert masked.loc["fusedkern_chunked", 4096] == pytest.approx(0.5 * 1.1 * 4096 / 240)
    with pytest.raises(ValueError, match="no rows with workload = 'masked_70'"):
        tables.pivot(df, "full", workload="masked_70")
    with pytest.raises(ValueError, match="no 'workload' column"):
        tables.pivot(_results(), "full", workload="dense")
    with pytest.raises(ValueError, match="mix"):
        tables.ratio_tables(df, ["full"])
    assert tables.ratio_tables(df, ["full"], workload="masked_50")["full"].loc["fusedkern_chunked", 8192] == \
        pytest.approx(0.5 * 1.1 / 0.95)
    # the same point twice without a workload column: also refused, not silently deduplicated
    with pytest.raises(ValueError, match="share their provider, x"):
        tables.pivot(pd.concat([_results(), _results()]), "full")
    # a file without the columns pivots as before
    assert tables.pivot(_results(), "full").shape == (5, 4)


def test_ratio_to_divides_each_workload_by_its_own_floor_and_figures_refuse_a_mix():
    df = _two_workloads()
    ratios = tables.ratio_to(df, "cublas_3gemm")
    assert len(ratios) == len(df)  # no cross join of the workloads
    at = ratios.set_index(["provider", "workload", "x"])["ratio"]
    assert at[("fusedkern_chunked", "dense", 4096)] == pytest.approx(1.1)
    assert at[("fusedkern_chunked", "masked_50", 4096)] == pytest.approx(0.5 * 1.1 / 0.95)
    with pytest.raises(ValueError, match="mix"):
        plotting.latency_figure(df, x_label="tokens", title="t", caption="c")
    fig, ax = plt.subplots()
    with pytest.raises(ValueError, match="mix"):
        plotting.plot_quantiles(ax, df)
    with pytest.raises(ValueError, match="mix"):
        plotting.plot_ratios(ax, ratios)
    plt.close(fig)
    assert [w for w, _ in results.workloads_in(df)] == ["dense", "masked_50"]
    assert results.workloads_in(_results()) == [("", "")]
    assert [results.ignored_share(w) for w in ("dense", "masked_30", "masked_70")] == [0.0, 0.3, 0.7]


def test_loaders_keep_workloads_apart(tmp_path):
    from fusedkern.study.results import write_results

    df = _two_workloads()
    rows = [dict(r, loss=float("nan"), note="") for r in df.to_dict("records")]
    meta = dict(sweep="ce", hidden=8, vocab=16, dtype="bfloat16")
    write_results(rows, tmp_path / "both.csv", meta=meta, environment={"date_utc": "2026-12-04T00:00:00+00:00"})
    masked_70 = [dict(r, workload="masked_70") for r in rows if r["workload"] == "masked_50"]
    write_results(masked_70, tmp_path / "other.csv", meta=meta, environment={"date_utc": "2026-12-03T00:00:00+00:00"})
    assert set(results.load_measured(tmp_path / "both.csv", workload="masked_50").workload) == {"masked_50"}
    assert results.load_measured(tmp_path / "both.csv", workload="dense").attrs["meta"]["hidden"] == 8
    # a file of another workload adds to the merge instead of replacing the newer file's points
    merged = results.load_measured_runs([tmp_path / "both.csv", tmp_path / "other.csv"])
    assert sorted(merged.workload.unique()) == ["dense", "masked_50", "masked_70"]
    assert len(merged) == 3 * len(df) // 2
    assert set(merged[merged.workload == "masked_70"].source) == {"other.csv"}


def test_notebook_08_figures_draw_what_they_are_given(tmp_path):
    df = _two_workloads()
    ratios = tables.ratio_to(df, "cublas_3gemm")
    fig = plotting.ignored_share_figure(ratios[ratios.provider != "cublas_3gemm"], tokens=[4096, 32768],
                                        caption="test", title="test")
    ax = fig.axes[0]
    red = plotting.style_for("fusedkern_chunked")["color"]
    line = next(ln for ln in ax.get_lines() if ln.get_color() == red)
    assert list(line.get_xdata()) == [0.0, 50.0]
    assert list(line.get_ydata()) == pytest.approx([1.1, 0.5 * 1.1 / 0.95])
    ideal = next(ln for ln in ax.get_lines() if ln.get_linestyle() == ":")
    assert list(ideal.get_ydata()) == pytest.approx([1.0, 0.5])
    plt.close(fig)

    bench = pd.DataFrame([dict(kernel=k, count=n, impl=impl, ms_p20=ms * 0.99, ms_p50=ms, ms_p80=ms * 1.01,
                               protocol="shuffled", workload=w, shape="s")
                          for k in ("logits", "dx") for n, w in ((4096, "dense"), (2048, "masked_50"))
                          for impl, ms in (("triton", n / 1000 * 1.1), ("cublas_exact", n / 1000),
                                           ("cublas_full", 4.096))])
    table = tables.rowcount_table(bench)
    assert table.loc[("dx", 2048, "masked_50"), "triton ÷ cuBLAS exact-n"] == pytest.approx(1.1)
    assert table.loc[("dx", 2048, "masked_50"), "triton ÷ cuBLAS all rows"] == pytest.approx(2.048 * 1.1 / 4.096)
    fig = plotting.rowcount_figure(bench, caption="test")
    assert len(fig.axes[0].patches) == 6  # 3 impls × 2 counts
    plt.close(fig)


def test_round_up_log_steps_quarter_decades():
    from fusedkern.study.tables import round_up_log

    got = round_up_log(pd.Series([1e-7, 1.01e-7, 1.7e-7, 9.9e-3]))
    want = [1e-7, 10 ** -6.75, 10 ** -6.75, 1e-2]
    assert np.allclose(got.to_numpy(), want, rtol=1e-12)


def test_floor_summary_reads_the_pivot():
    full = pd.DataFrame({4096: [10.0, 11.0, 30.0, 12.0], 8192: [20.0, 21.0, 44.0, np.nan]},
                        index=["cublas_3gemm", "fusedkern_chunked", "liger", "fusedkern_fused"])
    lines = tables.floor_summary(full, ("fusedkern_chunked", "fusedkern_fused", "absent"), str.upper,
                                 at=lambda x: f"{x} tokens", span=lambda lo, hi: f"{lo}–{hi} tokens")
    assert lines[0] == "At 8192 tokens, forward + backward, in multiples of the three-GEMM floor (20.0 ms):"
    assert lines[1:3] == [f"  {'FUSEDKERN_CHUNKED':<32}  1.05×  (21.0 ms)", f"  {'LIGER':<32}  2.20×  (44.0 ms)"]
    assert lines[3:] == ["FUSEDKERN_CHUNKED: 1.05–1.10× the floor over 4096–8192 tokens",
                         "FUSEDKERN_FUSED: 1.20–1.20× the floor over 4096–4096 tokens"]


def test_a_sidecar_of_several_runs_reads_as_one_record(tmp_path):
    """A device call that ran each size in its own bench process leaves {"runs": [...]}: the reader keeps what the
    runs agree on, the newest date (load_measured_runs orders files by it) and the runs themselves."""
    import json

    df = _results()
    df.assign(loss=float("nan"), note="").to_csv(tmp_path / "peers.csv", index=False)
    runs = [{"gpu_name": "NVIDIA H100", "torch": "2.11", "git_commit": "abc", "date_utc": date, "command": cmd}
            for date, cmd in (("2026-12-06T23:16:10+00:00", "bench --tokens 8192"),
                              ("2026-12-06T23:21:59+00:00", "bench --tokens 16384"))]
    (tmp_path / "peers.json").write_text(json.dumps({"runs": runs}))
    meta = results.load_results(tmp_path / "peers.csv").attrs["meta"]
    assert meta["date_utc"] == "2026-12-06T23:21:59+00:00" and meta["git_commit"] == "abc"
    assert "command" not in meta and meta["runs"] == runs
    assert "NVIDIA H100" in results.provenance(meta) and "commit abc" in results.provenance(meta)
    assert results.runs_meta({"date_utc": "x", "runs": []}) == {"date_utc": "x", "runs": []}  # an ordinary sidecar


def test_gathered_peers_look_like_their_parent_dashed():
    for gathered, parent in (("quack_gather", "quack"), ("liger-kernel 0.8.5 CuTe SM90 +gather",
                                                           "liger-kernel 0.8.5 CuTe SM90"),
                             ("huggingface_bf16_gather", "huggingface_bf16")):
        style, base = plotting.style_for(gathered), plotting.style_for(parent)
        assert style["color"] == base["color"] and style["linestyle"] == "--"
        assert style["label"] == base["label"] + " + gather"
    assert tables.sort_providers(["quack_gather", "fusedkern_chunked", "quack"]) == [
        "quack", "quack_gather", "fusedkern_chunked"]


def test_ahead_of_lists_the_lower_ratios_and_skips_missing_cells():
    ratio = pd.DataFrame({8192: [1.10, 1.05, 1.20], 16384: [1.10, np.nan, 1.02]}, index=["ours", "a", "b"])
    assert tables.ahead_of(ratio, "ours") == {8192: ["a"], 16384: ["b"]}


def test_ratio_panels_name_points_above_the_axis_and_mark_another_call(tmp_path):
    df = _results()
    ratios = tables.ratio_to(df, "cublas_3gemm")
    panel = plotting.RatioPanel(ratios, ["fusedkern_chunked", "some_new_provider", "liger-kernel 0.8.5"], "panel",
                                "× floor", "floor (= 1)", annotate=["fusedkern_chunked", "liger-kernel 0.8.5"],
                                ylim=(0.97, 1.6), other_call={4096: "another call"})
    fig = plotting.ratio_panels_figure([panel], title="t", caption="c")
    ax = fig.axes[0]
    assert ax.get_title() == "panel\nabove the axis: some_new_provider " + ", ".join(
        f"2.00× at {x}" for x in (4096, 8192, 16384, 32768))
    texts = [t.get_text() for t in ax.texts]
    assert "another call" in texts
    assert not any(t.startswith("some_new_provider") for t in texts)  # no line-end label for a line off the axis
    # the higher of two annotated providers is labelled above its points, the lower below
    above = [t for t in ax.texts if t.get_text() == "1.40×"]
    below = [t for t in ax.texts if t.get_text() == "1.10×"]
    assert above and below and {t.get_va() for t in above} == {"bottom"} and {t.get_va() for t in below} == {"top"}
    plotting.save_figure(fig, tmp_path / "panels")
