"""Measure the LM head + loss: every provider in one process, on the same inputs, same protocol.

    python -m fusedkern.bench ce --tokens 4096 8192 16384 32768 --workload dense masked_50
    python -m fusedkern.bench simpo --batch 2 4 8 16 --seq 1024 --head gemma2
    python -m fusedkern.bench preference --loss-types sigmoid ipo kto --batch 2 4 8 16 --seq 1024 --modes full
    python -m fusedkern.bench distill --tokens 4096 8192 16384 --workload dense masked_50
    python -m fusedkern.bench accuracy --tokens 4096 32768

(`python -m fusedkern.study.bench` is the same command; `fusedkern.bench` is its short alias.)

Why a harness of our own rather than the seed's (Liger-Kernel's scripts, `triton.testing.do_bench`):
the seed timed "forward" for providers that do very different work in it (Liger forms dX and dW
inside its forward), and it reported peak memory with the weights included. Here every provider is
timed in four modes (`fusedkern.study.providers`) and memory is the peak *above* the inputs and the
gradients' own storage, so the numbers compare equal work. The GEMM floors (`cublas_3gemm`,
`cublas_1gemm`) run in the same process, so a ratio to them is a ratio measured on the same GPU,
clocks and library versions.

Protocol (`--protocol`, a `protocol` column in every row): `shuffled` (the default, seeded by --seed
so a run is reproducible), `fixed` (the former `--interleave`, kept as a deprecated alias) or
`sequential`; see `fusedkern.study.timing`. Workloads (`--workload`, a `workload` column) are
`fusedkern.study.workloads`'; the GEMM floors stay the dense all-token floors whatever the workload
(`FLOORS_NOTE`, written to the sidecar JSON). Heads (`--head`, a `head` column): the vocabulary,
hidden size and final-logit softcap of Llama 3, Qwen2.5-7B and Gemma 2.

Outputs: by default `<repository>/data/measured/<gpu>/<sweep>.csv` (anchored at the checkout this
module lives in, never the working directory); a CPU run, or a module outside a checkout, must name
--out. A run may write into a `data/measured/<device>/` folder only when <device> is the device it
runs on, and never replaces an existing file, unless --append (merge) or --overwrite is given.
The summary the command prints (`format_table`) is built from the row dicts without pandas, so the
benchmark runs where the study's extras are absent.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from fusedkern.preference import LOSS_TYPES
from fusedkern.study.providers import DISTILL_ARGS, DISTILL_FLOOR_OF_MODE, FLOORS_NOTE, PREFERENCE_LOSS_ARGS, PROVIDERS
from fusedkern.study.results import (ALL_LOSS_TYPES, FLOOR_OF_MODE, MODES, collect_environment, sidecar_path,
                                     write_results)
from fusedkern.study.sweeps import run_accuracy, run_sweep, say
from fusedkern.study.timing import DEFAULT_PROTOCOL, PROTOCOLS
from fusedkern.study.workloads import (DEFAULT_HEAD, DEFAULT_SEQ, HEADS, LOGIT_STD, SIMPO_LEGACY_WORKLOAD, WORKLOADS,
                                       check_workloads, head_name)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


EXIT_REFUSED = 2  # the exit status of a run refused before it measured anything (as argparse's errors)


def device_slug_of(device: str | torch.device | None = None) -> str:
    """Folder name for a device's outputs: "h200" for "NVIDIA H200", "cpu" for the CPU. Default: the
    device a run gets without --device (the first GPU when there is one)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type != "cuda":
        return device.type
    name = torch.cuda.get_device_name(device.index or 0).lower().replace("nvidia", "")
    return re.sub(r"[^a-z0-9]+", "_", name).strip("_") or "gpu"


def _repository_root() -> Path | None:
    """The checkout this module lives in (its pyproject.toml beside the package), None when installed."""
    root = Path(__file__).resolve().parents[2]
    is_checkout = (root / "pyproject.toml").is_file() and (root / "fusedkern" / "study" / "bench.py").is_file()
    return root if is_checkout else None


def default_output(sweep: str, device_slug: str) -> Path | None:
    """<repository>/data/measured/<device>/<sweep>.csv for a GPU run inside a checkout (wherever the
    command runs from); None, so --out is required, on CPU (smoke runs do not belong in
    data/measured/) or when the package is not a checkout."""
    root = _repository_root()
    if device_slug == "cpu" or root is None:
        return None
    return root / "data" / "measured" / device_slug / f"{sweep}.csv"


def measured_folder_device(path: Path) -> str | None:
    """<device> when `path` lies under a `data/measured/<device>/` folder (the innermost such one), else None."""
    parts = Path(os.path.abspath(path)).parts
    for i in range(len(parts) - 3, 0, -1):  # parts[i+1] must be a folder: the file itself comes after it
        if parts[i - 1] == "data" and parts[i] == "measured":
            return parts[i + 1]
    return None


def check_output(out: Path, device_slug: str, *, append: bool, overwrite: bool) -> str | None:
    """Why writing `out` (and its sidecar JSON) is refused, or None when allowed.

    Refused without --overwrite: a `data/measured/<folder>/` that is not this run's device (a CPU run
    into data/measured/h200/, a --device cpu run on a GPU host into the GPU's folder, an A100 run into
    the H200's). Refused without --append or --overwrite: an existing CSV or sidecar."""
    folder = measured_folder_device(out)
    if folder is not None and folder != device_slug and not overwrite:
        return (f"refusing to write {out}: it is in data/measured/{folder}/ but this run measures on {device_slug!r} "
                f"(data/measured/<device>/ holds that device's measurements); pass --overwrite to write there anyway")
    if not (append or overwrite):
        existing = [p for p in (out, sidecar_path(out)) if p.exists()]
        if existing:
            return (f"refusing to replace {existing[0]}: it exists; pass --append to merge this run into it "
                    f"or --overwrite to replace it")
    return None


def _softcap_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"softcap must be a finite number ≥ 0 (0: none), got {text!r}")
    return value


def _workload_arg(op: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        try:
            check_workloads(op, [text])
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        return text
    return parse


def build_parser() -> argparse.ArgumentParser:
    heads = ", ".join(f"{name} (V {h.vocab}, H {h.hidden}{f', softcap {h.softcap:g}' if h.softcap else ''})"
                      for name, h in HEADS.items())
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--head", choices=sorted(HEADS),
                        help=f"an LM head users train, sets --vocab/--hidden/--softcap (given ones win): {heads}; "
                             f"the `head` column names the preset the run's V, H and softcap match, else custom")
    common.add_argument("--hidden", type=int, help="H (default: the head's, else 4096)")
    common.add_argument("--vocab", type=int, help="V (default: the head's, else 128256, Llama 3)")
    common.add_argument("--softcap", type=_softcap_arg, metavar="C",
                        help="final-logit softcap z -> C·tanh(z/C), as Gemma 2 (default: the head's, else none; "
                             "0: none); providers without one are skipped")
    common.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16", help="input and weight dtype")
    common.add_argument("--providers", nargs="+", metavar="NAME",
                        help="registry keys to run (default: all of the op, listed below)")
    common.add_argument("--out", type=Path,
                        help="results CSV (JSON sidecar beside it); default on a GPU "
                             "<repository>/data/measured/<gpu>/<sweep>.csv (not relative to the working directory); "
                             "required on CPU")
    common.add_argument("--append", action="store_true",
                        help="merge into an existing CSV (e.g. a second competitor version); rows with the same "
                             "op, provider, x, mode, workload and protocol are replaced")
    common.add_argument("--overwrite", action="store_true",
                        help="replace an existing CSV, and allow writing into another device's data/measured/<device>/")
    common.add_argument("--seed", type=int, default=0, help="inputs, and the shuffled protocol's orders")
    common.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    common.add_argument("--no-progress", action="store_true", help="no progress bar (the per-case log lines stay)")

    timing = argparse.ArgumentParser(add_help=False)
    timing.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    timing.add_argument("--warmup", type=int, default=2, help="untimed reps per case (≥ 1)")
    timing.add_argument("--reps", type=int, default=20, help="most timed reps per case")
    timing.add_argument("--min-reps", type=int, default=5, help="fewest timed reps per case")
    timing.add_argument("--max-case-s", type=float, default=1.5,
                        help="wall-time budget per case that sets the rep count between the two")
    timing.add_argument("--protocol", choices=PROTOCOLS,
                        help="per size and mode: shuffled (default) interleaves the providers' reps, one each per "
                             "round in a new random order every round (seeded by --seed); fixed interleaves them "
                             "in a rotating fixed order; sequential times one provider after the other")
    timing.add_argument("--interleave", action="store_true",
                        help="deprecated alias of --protocol fixed")

    def add_workloads(sub: argparse.ArgumentParser, op: str, seq_help: str) -> None:
        legacy = f"; {SIMPO_LEGACY_WORKLOAD}: the SimPO input of earlier runs" if op == "simpo" else ""
        sub.add_argument("--workload", nargs="+", type=_workload_arg(op), default=["dense"], metavar="NAME",
                         help=f"one or several of {', '.join(WORKLOADS)} (any masked_N, 0 <= N < 100): N %% of the "
                              f"targets ignored as a prompt prefix of each sequence{legacy} (default: dense)")
        sub.add_argument("--seq", type=int, default=DEFAULT_SEQ, help=seq_help)

    registry = "; ".join(f"{op}: {', '.join(PROVIDERS[op])}" for op in PROVIDERS)
    parser = argparse.ArgumentParser(
        prog="python -m fusedkern.bench",
        description="Benchmark the LM head + loss (fusedkern vs baselines and competitors).",
        epilog=f"providers — {registry}. The accuracy sweep takes the ce providers without the cublas floors. "
               f"Exit status 2: refused before measuring (bad arguments, or an output it must not write).",
    )
    sub = parser.add_subparsers(dest="sweep", required=True)
    ce = sub.add_parser("ce", parents=[common, timing], help="cross-entropy timing and memory sweep",
                        epilog=f"providers: {', '.join(PROVIDERS['ce'])}")
    ce.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    add_workloads(ce, "ce", "tokens per sequence for the masked workloads: the first N %% of each is ignored "
                            "(default: %(default)s)")
    simpo = sub.add_parser("simpo", parents=[common, timing], help="SimPO timing and memory sweep",
                           epilog=f"providers: {', '.join(PROVIDERS['simpo'])}")
    simpo.add_argument("--batch", type=int, nargs="+", default=[2, 4, 8, 16],
                       help="rows of the input, chosen + rejected (2 = one pair), as in the seed")
    add_workloads(simpo, "simpo", "tokens per row (default: %(default)s)")
    preference = sub.add_parser(
        "preference", parents=[common, timing], help="preference losses (DPO family, CPO, SimPO, ORPO, KTO) sweep",
        epilog=f"providers: {', '.join(PROVIDERS['preference'])} (liger_ref_model only when named). The floors are "
               f"timed once per batch (loss_type 'all'), the others once per loss type.")
    preference.add_argument("--batch", "--batches", dest="batch", type=int, nargs="+", default=[2, 4, 8, 16],
                            help="rows of the input, chosen + rejected (2 = one pair) as in the simpo sweep; KTO "
                                 "takes them as that many unpaired sequences, half desirable")
    preference.add_argument("--loss-types", nargs="+", choices=LOSS_TYPES, default=list(LOSS_TYPES),
                            metavar="TYPE", help=f"of {', '.join(LOSS_TYPES)} (default: all)")
    add_workloads(preference, "preference", "tokens per row (default: %(default)s)")
    distill = sub.add_parser("distill", parents=[common, timing],
                             help="distillation (generalized JSD, beta 0.5, temperature 1) timing and memory sweep",
                             epilog=f"providers: {', '.join(PROVIDERS['distill'])}. The teacher has the student's "
                                    "hidden size and vocabulary; the floors are cublas_2gemm (both logits GEMMs) and "
                                    "cublas_4gemm (those and the student's dX, dW).")
    distill.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192, 16384])
    add_workloads(distill, "distill", "tokens per sequence for the masked workloads (default: %(default)s)")
    accuracy_providers = ", ".join(p.key for p in PROVIDERS["ce"].values() if p.accuracy)
    accuracy = sub.add_parser("accuracy", parents=[common], help="cross-entropy errors against an fp64 truth",
                              epilog=f"providers: {accuracy_providers}")
    accuracy.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768])
    accuracy.add_argument("--chunk-tokens", type=int, default=1024, help="tokens per fp64 reference chunk")
    add_workloads(accuracy, "ce", "tokens per sequence for the masked workloads (default: %(default)s)")
    return parser


def resolve_head(args: argparse.Namespace) -> tuple[int, int, float | None]:
    """(hidden, vocab, softcap): the explicit flags, else the --head preset's, else Llama 3's without softcap."""
    preset = HEADS[args.head or DEFAULT_HEAD]
    hidden = preset.hidden if args.hidden is None else args.hidden
    vocab = preset.vocab if args.vocab is None else args.vocab
    softcap = (preset.softcap if args.head else None) if args.softcap is None else (args.softcap or None)
    return hidden, vocab, softcap


def _refuse(message: str) -> int:
    print(f"python -m fusedkern.bench: error: {message}", file=sys.stderr)
    return EXIT_REFUSED


def format_table(rows: list[dict]) -> str:
    """A plain-text summary: per mode, provider × x of ms_p50 and the ratio to that mode's floor
    (cublas_1gemm for loss_only/forward, cublas_3gemm for backward/full, timed in the same case);
    for accuracy rows, provider × x of err_loss / err_dx / err_dw. Rows of several workloads or
    protocols get one block each."""
    if not rows:
        return "(no rows)"
    groups: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        groups.setdefault((row.get("workload", ""), row.get("protocol", "")), []).append(row)
    if len(groups) > 1:
        return "\n\n".join(f"== workload {workload}, protocol {protocol}\n{_format_loss_types(block)}"
                            for (workload, protocol), block in groups.items())
    return _format_loss_types(rows)


def _format_loss_types(rows: list[dict]) -> str:
    """One block per loss type (preference rows), each with the floors (loss_type "all") timed beside it."""
    loss_types = [t for t in dict.fromkeys(r.get("loss_type") for r in rows) if t not in (None, ALL_LOSS_TYPES)]
    if not loss_types:
        return _format_block(rows)
    blocks = [_format_block([r for r in rows if r.get("loss_type") in (t, ALL_LOSS_TYPES)]) for t in loss_types]
    return "\n\n".join(f"-- loss_type {t}\n{block}" for t, block in zip(loss_types, blocks))


def _format_block(rows: list[dict]) -> str:
    xs = sorted({r["x"] for r in rows})
    x_name = rows[0]["x_name"]
    width = max(len(r["provider"]) for r in rows) + 2
    lines: list[str] = []
    if any("err_dx" in r for r in rows):
        lines.append(f"relative errors vs fp64 (loss / dX / dW), {x_name}:")
        lines.append(" " * width + "".join(f"{x:>32}" for x in xs))
        for provider in sorted({r["provider"] for r in rows}):
            cells = []
            for x in xs:
                match = [r for r in rows if r["provider"] == provider and r["x"] == x]
                errors = [match[0].get(k, math.nan) if match else math.nan for k in ("err_loss", "err_dx", "err_dw")]
                cells.append(" ".join(f"{e:10.2e}" for e in errors))
            lines.append(f"{provider:<{width}}" + "".join(f"{c:>32}" for c in cells))
        return "\n".join(lines)
    floor_of_mode = DISTILL_FLOOR_OF_MODE if rows[0].get("op") == "distill" else FLOOR_OF_MODE
    for mode in [m for m in MODES if any(r["mode"] == m for r in rows)]:
        mode_rows = [r for r in rows if r["mode"] == mode]
        floor = {r["x"]: r["ms_p50"] for r in mode_rows if r["provider"] == floor_of_mode[mode]}
        lines.append(f"\n{mode}: ms_p50 (× {floor_of_mode[mode]}), by {x_name}")
        lines.append(" " * width + "".join(f"{x:>20}" for x in xs))
        for provider in sorted({r["provider"] for r in mode_rows}):
            cells = []
            for x in xs:
                match = [r for r in mode_rows if r["provider"] == provider and r["x"] == x]
                if not match:
                    cells.append("-")
                elif math.isnan(match[0]["ms_p50"]):
                    cells.append(match[0]["note"][:18] or "nan")
                else:
                    ms = match[0]["ms_p50"]
                    ratio = ms / floor[x] if x in floor else math.nan
                    cells.append(f"{ms:9.2f} ({ratio:5.2f}×)")
            lines.append(f"{provider:<{width}}" + "".join(f"{c:>20}" for c in cells))
    return "\n".join(lines).lstrip("\n")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    dtype = _DTYPES[args.dtype]
    hidden, vocab, softcap = resolve_head(args)
    head = head_name(vocab, hidden, softcap)
    protocol = "sequential"  # the accuracy sweep: providers one after the other, untimed
    if args.sweep != "accuracy":
        if args.interleave:
            say("--interleave is deprecated: use --protocol fixed")
            if args.protocol not in (None, "fixed"):
                parser.error(f"--interleave (= --protocol fixed) contradicts --protocol {args.protocol}")
            args.protocol = "fixed"
        protocol = args.protocol or DEFAULT_PROTOCOL

    device_slug = device_slug_of(args.device)
    out = args.out if args.out is not None else default_output(args.sweep, device_slug)
    if out is None:
        why = "on CPU" if device_slug == "cpu" else "outside a checkout of the repository"
        return _refuse(f"give --out {why}: the default data/measured/<gpu>/{args.sweep}.csv holds GPU measurements "
                       f"of this repository")
    refusal = check_output(out, device_slug, append=args.append, overwrite=args.overwrite)
    if refusal:
        return _refuse(refusal)

    meta: dict[str, Any] = {"sweep": args.sweep, "hidden": hidden, "vocab": vocab, "softcap": softcap, "head": head,
                            "dtype": args.dtype, "seed": args.seed, "logit_std": LOGIT_STD, "device": device_slug,
                            "protocol": protocol, "workloads": list(args.workload), "seq": args.seq,
                            "floors": FLOORS_NOTE}
    command = shlex.join(["python", "-m", "fusedkern.bench", *argv])
    common = dict(hidden=hidden, vocab=vocab, dtype=dtype, device=args.device, providers=args.providers,
                  seed=args.seed, progress=not args.no_progress, workloads=args.workload, seq=args.seq,
                  softcap=softcap, head=head)

    environment = collect_environment(command)

    def save(rows: list[dict]) -> None:
        if rows:
            write_results(rows, out, meta=meta, environment=environment, append=args.append)

    started = time.perf_counter()
    if args.sweep == "accuracy":
        meta["chunk_tokens"] = args.chunk_tokens
        rows = run_accuracy(args.tokens, chunk_tokens=args.chunk_tokens, checkpoint=save, **common)
    else:
        timing = dict(modes=args.modes, warmup=args.warmup, reps=args.reps, min_reps=args.min_reps,
                      max_case_s=args.max_case_s, protocol=protocol, checkpoint=save)
        meta.update(warmup=args.warmup, reps=args.reps, min_reps=args.min_reps, max_case_s=args.max_case_s)
        xs = args.tokens if args.sweep in ("ce", "distill") else args.batch
        if args.sweep == "distill":
            meta.update(distill_args=DISTILL_ARGS, floors="cublas_2gemm: both models' logits GEMMs; cublas_4gemm: "
                        "those and the student's dX = G W, dW = G^T X on an N(0, 1) G, over all T tokens")
        if args.sweep == "preference":
            meta.update(loss_types=list(args.loss_types), loss_args=PREFERENCE_LOSS_ARGS,
                        floors=FLOORS_NOTE + " In the preference sweep they are timed once per batch, in the same "
                               "rounds as every loss type, with loss_type 'all'.")
            timing["loss_types"] = args.loss_types
        rows = run_sweep(args.sweep, xs, **common, **timing)
    print(format_table(rows))
    print(f"\n{args.sweep}: {len(rows)} rows -> {out if rows else '(nothing written)'} "
          f"in {time.perf_counter() - started:.1f} s")
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
