"""The 2026 peers on every head of the head-floor targets, from the committed H100 data: fusedkern beside QuACK 0.6.5,
Liger 0.8.5's CuTe SM90 kernel and the bf16-logits baseline, each × the GEMM floor timed in its own process, on
H 4096 / V 128256 (Llama-3-8B's head), H 2048 / V 128256 (Llama-3.2-1B's) and H 1024 / V 151936 (Qwen3-0.6B's).

`peer_table` reads, newest first: the bench's tables (`peers3_ce_<head>.csv`, `scripts/gpu_peers.sh`: every peer in
one process a head and size), then the side-by-side probe's (`side_by_side_1207b.csv` with QuACK 0.6.5,
`side_by_side_1207.csv` with the H 2048 head; data/measured/h100/README.md). A cell is one of: `measured` (its ratio,
the file and the process), `refused` (the peer's own rule refuses that shape: a row the bench wrote as refused, or,
in the probe's files, which kept no row for it, the rule `providers` applies), `not measured`. `plot_peer_grid`
draws one pass as grouped bars, a refused cell as a hatched stub that says so; notebooks 04, 08 and 06 (the
headline) draw from the same table, and `standing` puts it in the README's words.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from fusedkern.study.providers import LIGER_CUTE_VOCAB_MULTIPLE, quack_chunk_size, quack_refusal
from fusedkern.study.workloads import HEADS, head_name

HEAD_SHAPES = ((4096, 128256), (2048, 128256), (1024, 151936))  # (hidden, vocab), the targets' heads
TOKENS = (4096, 8192, 16384, 32768)
PEERS = ("fusedkern", "QuACK 0.6.5", "Liger 0.8.5 CuTe SM90", "bf16 logits + CE")
PEER_STYLE = {"fusedkern": "fusedkern_chunked", "QuACK 0.6.5": "quack-kernels 0.6.5",
              "Liger 0.8.5 CuTe SM90": "liger-kernel 0.8.5 CuTe SM90", "bf16 logits + CE": "huggingface_bf16"}
#: the passes: (bench mode, its floor provider, the probe's check prefix, the probe's floor, what the ratio is × of)
PASSES = {"dense_ce": ("full", "cublas_3gemm", "perf_ce", "floor_3gemm", "the 3-GEMM floor"),
          "loss_only": ("loss_only", "cublas_1gemm", "loss_only", "floor_1gemm", "one GEMM")}
PASS_TITLE = {"dense_ce": "dense cross-entropy, forward + backward", "loss_only": "loss only (no gradient)"}
BENCH_PEER = {"fusedkern_chunked": "fusedkern", "quack-kernels 0.6.5": "QuACK 0.6.5",
              "liger-kernel 0.8.5 CuTe SM90": "Liger 0.8.5 CuTe SM90", "huggingface_bf16": "bf16 logits + CE"}
PROBE_PEER = {"fk_default": "fusedkern", "quack065": "QuACK 0.6.5", "liger085_cute_sm90": "Liger 0.8.5 CuTe SM90",
              "hf_bf16_seed": "bf16 logits + CE"}
PROBE_FILES = ("side_by_side_1207b.csv", "side_by_side_1207.csv")  # newest first
COLUMNS = ("hidden", "vocab", "tokens", "pass", "peer", "ratio", "status", "why", "source")


def refusal(peer: str, pass_: str, hidden: int, vocab: int, tokens: int) -> str | None:
    """Why `peer` refuses this shape by its own rule (as the bench's providers apply it), or None."""
    if peer == "Liger 0.8.5 CuTe SM90" and pass_ == "dense_ce" and vocab % LIGER_CUTE_VOCAB_MULTIPLE:
        return f"V % {LIGER_CUTE_VOCAB_MULTIPLE} ≠ 0"
    if peer == "QuACK 0.6.5" and pass_ == "dense_ce" and quack_refusal(tokens, hidden, quack_chunk_size(hidden)):
        return f"a chunk of {hidden} rows = H"
    return None


def _bench_cells(measured: Path) -> list[dict]:
    cells = []
    for hidden, vocab in HEAD_SHAPES:
        path = measured / f"peers3_ce_{head_name(vocab, hidden, None)}.csv"
        if not path.exists():
            continue
        df = pd.read_csv(path, keep_default_na=False)
        df = df[df.workload == "dense"]
        for pass_, (mode, floor, *_rest) in PASSES.items():
            part = df[df["mode"] == mode]
            floors = part[part.provider == floor].set_index("x").ms_p50.astype(float)
            for r in part[part.provider.isin(list(BENCH_PEER))].itertuples():
                refused = str(r.note).startswith("refused")
                ratio = float("nan") if refused or r.x not in floors else float(r.ms_p50) / floors[r.x]
                if not refused and ratio != ratio:
                    continue
                cells.append(dict(hidden=hidden, vocab=vocab, tokens=int(r.x), **{"pass": pass_},
                                  peer=BENCH_PEER[r.provider], ratio=ratio,
                                  status="refused" if refused else "measured",
                                  why=str(r.note).removeprefix("refused: ") if refused else "",
                                  source=f"{path.name} ({r.protocol})"))
    return cells


def _probe_cells(measured: Path, name: str) -> list[dict]:
    path = measured / name
    if not path.exists():
        return []
    df = pd.read_csv(path, keep_default_na=False)
    df = df[(df.workload == "dense") & df.provider.isin(list(PROBE_PEER))]
    cells = []
    for pass_, (_mode, _floor, prefix, _probe_floor, _of) in PASSES.items():
        for hidden, vocab in HEAD_SHAPES:
            check = prefix + ("" if (hidden, vocab) == (4096, 128256) else f"_h{hidden}_v{vocab}")
            part = df[df.check == check]
            for tokens, at in part.groupby("x"):
                # one process per size: the one with the most peers (QuACK's, where it ran), each ratio to its floor
                processes = at.groupby("note").provider.nunique().sort_values(ascending=False, kind="stable")
                process = processes.index[0]
                for r in at[at.note == process].itertuples():
                    cells.append(dict(hidden=hidden, vocab=vocab, tokens=int(tokens), **{"pass": pass_},
                                      peer=PROBE_PEER[r.provider], ratio=float(r.ratio_to_floor), status="measured",
                                      why="", source=f"{name} ({process.split(':')[0] or 'one process'})"))
    return cells


def peer_table(measured: str | Path) -> pd.DataFrame:
    """Every (head, tokens, pass, peer) of `HEAD_SHAPES` × `TOKENS` × `PASSES` × `PEERS` with its status. For each
    head and pass the newest source that has it gives all its cells (the bench's, else the newest probe file's), so
    one head's numbers never mix trees; a refusal the bench wrote is a cell."""
    measured = Path(measured)
    found: dict[tuple, dict] = {}
    taken: set[tuple] = set()  # (hidden, vocab, pass) that a newer source gave
    for cells in (_bench_cells(measured), *(_probe_cells(measured, name) for name in PROBE_FILES)):
        heads = {(c["hidden"], c["vocab"], c["pass"]) for c in cells} - taken
        for cell in cells:
            if (cell["hidden"], cell["vocab"], cell["pass"]) in heads:
                found.setdefault((cell["hidden"], cell["vocab"], cell["tokens"], cell["pass"], cell["peer"]), cell)
        taken |= heads
    rows = []
    for hidden, vocab in HEAD_SHAPES:
        for tokens in TOKENS:
            for pass_ in PASSES:
                for peer in PEERS:
                    cell = found.get((hidden, vocab, tokens, pass_, peer))
                    if cell is None:
                        why = refusal(peer, pass_, hidden, vocab, tokens)
                        cell = dict(hidden=hidden, vocab=vocab, tokens=tokens, **{"pass": pass_}, peer=peer,
                                    ratio=float("nan"), status="refused" if why else "not measured", why=why or "",
                                    source="its rule (providers.py)" if why else "")
                    rows.append(cell)
    table = pd.DataFrame(rows, columns=list(COLUMNS))
    # sizes where nothing at all was measured for a head are left out (4096 tokens: H 4096 only)
    measured_sizes = table[table.status == "measured"].groupby(["hidden", "tokens"]).size()
    keep = [(h, t) in measured_sizes.index for h, t in zip(table.hidden, table.tokens)]
    return table[keep].reset_index(drop=True)


def head_label(hidden: int, vocab: int) -> str:
    name = {"llama3": "Llama-3-8B", "llama32_1b": "Llama-3.2-1B", "qwen3_0p6b": "Qwen3-0.6B"}.get(
        head_name(vocab, hidden, None), "custom")
    return f"H {hidden} / V {vocab} ({name})"


def span(values: Sequence[float], fmt: str = ".2f") -> str:
    """"a–b", or "a" when both ends print the same."""
    values = [v for v in values if v == v]
    if not values:
        return "—"
    low, high = format(min(values), fmt), format(max(values), fmt)
    return low if low == high else f"{low}–{high}"


def standing(table: pd.DataFrame, pass_: str, hidden: int, vocab: int) -> dict[str, str]:
    """{peer: "a–b×" over the measured sizes, "refused (why)" or "not measured"} for one head and pass."""
    part = table[(table["pass"] == pass_) & (table.hidden == hidden) & (table.vocab == vocab)]
    out = {}
    for peer in PEERS:
        mine = part[part.peer == peer]
        measured = mine[mine.status == "measured"]
        if len(measured):
            out[peer] = f"{span(measured.ratio)}×"
        elif (mine.status == "refused").any():
            out[peer] = f"refused ({mine[mine.status == 'refused'].why.iloc[0]})"
        else:
            out[peer] = "not measured"
    return out


def plot_peer_grid(axes, table: pd.DataFrame, pass_: str, *, heads: Sequence[tuple[int, int]] = HEAD_SHAPES,
                   ylim: tuple[float, float] | None = None) -> None:
    """One panel per head of `heads` on `axes`: grouped bars of each peer's ratio at each size; a refused cell a
    hatched stub labelled "refused", a cell not measured a thin "n/m"."""
    from fusedkern.study.plotting import style_for

    part = table[table["pass"] == pass_]
    top = ylim[1] if ylim else max(1.1, float(part.ratio.max()) * 1.08)
    low = ylim[0] if ylim else 0.9
    width = 0.8 / len(PEERS)
    for ax, (hidden, vocab) in zip(axes, heads):
        mine = part[(part.hidden == hidden) & (part.vocab == vocab)]
        sizes = sorted(set(mine.tokens))
        for j, peer in enumerate(PEERS):
            color = style_for(PEER_STYLE[peer])["color"]
            for i, tokens in enumerate(sizes):
                cell = mine[(mine.tokens == tokens) & (mine.peer == peer)].iloc[0]
                x = i + (j - (len(PEERS) - 1) / 2) * width
                if cell.status == "measured":
                    ax.bar(x, cell.ratio - low, bottom=low, width=width * 0.92, color=color,
                           label=peer if i == 0 else None)
                    ax.text(x, min(cell.ratio, top) + 0.004, f"{cell.ratio:.2f}", ha="center", va="bottom",
                            fontsize=6, rotation=90)
                elif cell.status == "refused":
                    ax.bar(x, (top - low) * 0.12, bottom=low, width=width * 0.92, color="white", edgecolor=color,
                           hatch="///", linewidth=0.8)
                    ax.text(x, low + (top - low) * 0.13, "refused", ha="center", va="bottom", fontsize=6, rotation=90,
                            color=color)
                else:
                    ax.text(x, low + 0.004, "n/m", ha="center", va="bottom", fontsize=5.5, rotation=90, color="0.5")
        ax.axhline(1.0, color="black", linewidth=0.9, linestyle="--")
        ax.set_xticks(range(len(sizes)), [f"{t:,}" for t in sizes], fontsize=8)
        ax.set_xlim(-0.5, len(sizes) - 0.5)
        ax.set_ylim(low, top)
        ax.set_xlabel("tokens")
        ax.set_title(head_label(hidden, vocab), fontsize=9.5)
        ax.grid(axis="x", visible=False)
    axes[0].set_ylabel(f"× {PASSES[pass_][4]} (same process)")


def head_presets() -> dict[str, tuple[int, int]]:
    """The bench's --head name of each head shape (for the commands the notebooks print)."""
    return {head_name(v, h, None): (h, v) for h, v in HEAD_SHAPES if head_name(v, h, None) in HEADS}


def plot_head_sizes(ax, table: pd.DataFrame, pass_: str, tokens: int) -> None:
    """Each peer's ratio at `tokens` against the head's hidden size (one line a peer; the heads of `HEAD_SHAPES`): a
    refused head a hollow marker on the axis's top edge labelled "refused", one not measured left out."""
    from fusedkern.study.plotting import style_for

    part = table[(table["pass"] == pass_) & (table.tokens == tokens)]
    top = max(1.1, float(part.ratio.max()) * 1.1)
    for peer in PEERS:
        style = style_for(PEER_STYLE[peer])
        mine = part[part.peer == peer].sort_values("hidden")
        measured = mine[mine.status == "measured"]
        if len(measured):
            # lines join neighbouring heads only: a head not measured between two others is a gap, not a slope
            order = [h for h, _ in sorted(HEAD_SHAPES)]
            by_hidden = dict(zip(measured.hidden, measured.ratio))
            for a, b in zip(order, order[1:]):
                if a in by_hidden and b in by_hidden:
                    ax.plot([a, b], [by_hidden[a], by_hidden[b]], color=style["color"],
                            linewidth=2.2 if peer == "fusedkern" else 1.5)
            ax.plot(measured.hidden, measured.ratio, marker=style["marker"], color=style["color"], label=peer,
                    linestyle="none")
            for r in measured.itertuples():
                ax.annotate(f"{r.ratio:.2f}", (r.hidden, r.ratio), textcoords="offset points", xytext=(6, -3),
                            fontsize=7, color=style["color"])
        for r in mine[mine.status == "refused"].itertuples():
            ax.plot([r.hidden], [top * 0.985], marker=style["marker"], markerfacecolor="white",
                    markeredgecolor=style["color"], linestyle="none")
            ax.annotate(f"{peer}: refused ({r.why})", (r.hidden, top * 0.985), textcoords="offset points",
                        xytext=(8, -3), fontsize=7, color=style["color"])
    ax.axhline(1.0, color="black", linewidth=0.9, linestyle="--")
    ax.set_xscale("log", base=2)
    hiddens = [h for h, _ in sorted(HEAD_SHAPES)]
    ax.set_xticks(hiddens, [f"H {h}\nV {v}" for h, v in sorted(HEAD_SHAPES)], fontsize=8)
    ax.set_xlim(hiddens[0] / 1.3, hiddens[-1] * 1.3)
    ax.set_ylim(0.9, top)
    ax.set_xlabel("the head: hidden size, vocabulary")
    ax.set_ylabel(f"× {PASSES[pass_][4]} (same process)")
    ax.legend(fontsize=7.5, loc="center right")
