"""Sweeps: every provider of an op at every size, mode and workload, timed under one protocol
(`run_sweep`), and the accuracy sweep against the chunked fp64 truth (`run_accuracy`). Rows follow
the schema of `fusedkern.study.results`. On CPU the same code runs at tiny shapes for the tests:
wall-clock timing, NaN memory.
"""

from __future__ import annotations

import math
import random
import sys
import traceback
from typing import Callable

import torch

from fusedkern.reference import fp64_linear_cross_entropy_grads_chunked
from fusedkern.study.providers import (PROVIDERS, Provider, ProviderRefused, ProviderUnavailable, Refusal, Step,
                                      select_providers)
from fusedkern.study.results import ALL_LOSS_TYPES, MODES
from fusedkern.study.timing import (DEFAULT_PROTOCOL, PROTOCOLS, free_memory, measure_step, settle_gpu, time_step,
                                    time_steps_interleaved)
from fusedkern.study.workloads import (DEFAULT_SEQ, Inputs, check_workloads, for_loss_type, head_name,
                                       make_ce_inputs, make_inputs)

def say(message: str) -> None:
    """One log line on stderr that does not break a tqdm bar."""
    from tqdm import tqdm

    tqdm.write(message, file=sys.stderr)


def _nan_row(**fields) -> dict:
    return {"ms_p20": math.nan, "ms_p50": math.nan, "ms_p80": math.nan, "peak_extra_mib": math.nan,
            "n_reps": 0, "loss": math.nan, "note": "", **fields}


def _error_note(error: BaseException) -> str:
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return "OOM"
    first_line = (str(error).strip().splitlines() or [""])[0]
    return f"error: {type(error).__name__}: {first_line}"[:200]


def _entry_key(provider: Provider, loss_type: str | None) -> str:
    """A provider's name in one case: its key, or "<loss_type>/<key>" in a preference sweep."""
    return provider.key if loss_type is None else f"{loss_type}/{provider.key}"


def _build(provider: Provider, inputs: Inputs, skipped: dict[str, str]) -> dict[str, Step | Refusal] | None:
    """The provider's steps, or None (logged once per sweep, per loss type for preference) when it cannot run here.
    A peer that refuses this shape (`ProviderRefused`) gets a `Refusal` for every mode: it may take the next size."""
    name = _entry_key(provider, inputs.loss_type)
    if name in skipped:
        return None
    try:
        return provider.build(inputs)
    except ProviderRefused as error:
        say(f"provider {name} refuses this shape: {error}")
        return dict.fromkeys(MODES, Refusal(str(error)))
    except (ImportError, ProviderUnavailable) as error:
        skipped[name] = f"{type(error).__name__}: {error}"
        say(f"skipping provider {name}: {skipped[name]}")
        return None


def check_loss_types(op: str, loss_types: list[str] | tuple[str, ...] | None) -> list[str | None]:
    """The loss types a sweep of `op` runs: [None] for ce and simpo (which have none), the given ones (default:
    all of fusedkern.preference.LOSS_TYPES) for preference. Raises ValueError for an unknown or repeated one."""
    if op != "preference":
        if loss_types:
            raise ValueError(f"loss types are for the preference op, not {op!r}")
        return [None]
    from fusedkern.preference import LOSS_TYPES

    loss_types = list(LOSS_TYPES if loss_types is None else loss_types)
    unknown = [t for t in loss_types if t not in LOSS_TYPES]
    if unknown or not loss_types or len(set(loss_types)) != len(loss_types):
        raise ValueError(f"bad loss types {loss_types}: give distinct ones of {', '.join(LOSS_TYPES)}")
    return loss_types


def loss_mismatches(rows: list[dict], *, reference: str = "trl_fp32", rel: float = 0.02,
                    abs_tol: float = 0.05) -> list[str]:
    """The preference cross-check: each fusedkern row's loss against `reference`'s (TRL's materialized
    computation) at the same workload, x, mode and loss type; one line per pair farther apart than
    abs_tol + rel·|reference| (TRL rounds the logits to bf16 before its fp32 log_softmax, fusedkern does not:
    summed over ~1000 tokens a DPO log-ratio moves by O(0.1–1), βΔ by O(0.01–0.1)). A warning in the log,
    not a failure. Liger's rows are not checked: its DPO and KTO run reference-free (another loss value)."""
    wanted = {}
    for row in rows:
        if row.get("provider") == reference and not math.isnan(row.get("loss", math.nan)):
            wanted[(row["workload"], row["x"], row["mode"], row.get("loss_type"))] = row["loss"]
    out = []
    for row in rows:
        if not str(row.get("provider", "")).startswith("fusedkern") or math.isnan(row.get("loss", math.nan)):
            continue
        expected = wanted.get((row["workload"], row["x"], row["mode"], row.get("loss_type")))
        if expected is not None and abs(row["loss"] - expected) > abs_tol + rel * abs(expected):
            out.append(f"{row.get('loss_type')} {row['provider']} {row['x_name']}={row['x']} {row['mode']}: "
                       f"loss {row['loss']:.6f} vs {reference} {expected:.6f}")
    return out


def _entries(chosen: list[Provider], loss_types: list[str | None]) -> list[tuple[Provider, str | None]]:
    """(provider, loss type) pairs of a case: the floors once (loss type "all" in a preference sweep, None
    otherwise), every other provider once per loss type."""
    entries = []
    for provider in chosen:
        if provider.is_floor:
            entries.append((provider, None if loss_types == [None] else ALL_LOSS_TYPES))
        else:
            entries.extend((provider, loss_type) for loss_type in loss_types)
    return entries


def _progress(total: int, enabled: bool, description: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=description, unit="case", file=sys.stderr, disable=not enabled, dynamic_ncols=True)


def _case_rng(seed: int, op: str, workload: str, x: int, mode: str) -> random.Random:
    """The shuffled protocol's order source for one case: a function of --seed and the case alone, so
    a run is reproducible and a case's orders do not depend on which other cases ran."""
    # The string keeps the module's former name: changing it would change every shuffled order.
    return random.Random(f"fusedkern.bench/{seed}/{op}/{workload}/{x}/{mode}")


def _resolve_protocol(protocol: str | None, interleave: bool | None) -> str:
    """`protocol`, or the deprecated `interleave` flag's meaning (True: fixed, False: sequential)."""
    if interleave is not None:
        implied = "fixed" if interleave else "sequential"
        if protocol is not None and protocol != implied:
            raise ValueError(f"interleave={interleave} (deprecated, means protocol {implied!r}) contradicts "
                             f"protocol={protocol!r}")
        protocol = implied
    protocol = DEFAULT_PROTOCOL if protocol is None else protocol
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; choose from {PROTOCOLS}")
    return protocol


def run_sweep(
    op: str,
    xs: list[int],
    *,
    hidden: int = 4096,
    vocab: int = 128256,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device | None = None,
    seq: int = DEFAULT_SEQ,
    providers: list[str] | None = None,
    modes: tuple[str, ...] | list[str] = MODES,
    warmup: int = 2,
    reps: int = 20,
    min_reps: int = 5,
    max_case_s: float = 1.5,
    seed: int = 0,
    progress: bool = True,
    protocol: str | None = None,
    workloads: list[str] | tuple[str, ...] = ("dense",),
    softcap: float | None = None,
    head: str | None = None,
    interleave: bool | None = None,
    checkpoint: Callable[[list[dict]], None] | None = None,
    loss_types: list[str] | tuple[str, ...] | None = None,
) -> list[dict]:
    """Time and measure every provider of `op` ("ce", "simpo" or "preference") at every x, in every mode, for
    every workload.

    xs: token counts (ce) or batch rows (simpo, preference: chosen + rejected rows, or KTO's unpaired
    sequences, with `seq` tokens each). preference: every provider but the floors runs once per loss type
    (`loss_types`, default all of fusedkern.preference.LOSS_TYPES), on a view of the same inputs; its rows
    carry a `loss_type` column ("all" for the floors, timed once per x and mode in the same rounds).
    Inputs are made once per (workload, x) and shared by all providers; for ce `seq` is the sequence length the masked
    workloads cut the tokens into. Returns rows in the schema of `fusedkern.study.results` plus `note`
    ("" when fine, "OOM", or "error: ..."), `protocol`, `workload` and `head` (default: the preset
    that matches hidden/vocab/softcap, else "custom"); a provider/mode that errors (other than OOM)
    is not retried at larger x of that workload.

    protocol (default "shuffled"): per x and mode, every provider's reps interleaved
    (`time_steps_interleaved`), in a new random order every round ("shuffled", seeded by `seed`) or a
    rotating fixed order ("fixed"); all providers' steps then live at once. "sequential": one
    provider after the other. `interleave` is the deprecated flag (True = "fixed", False =
    "sequential"). `checkpoint(rows)` is called after each provider (each x when interleaving), so a
    run cut short by a time limit still leaves what it finished.
    """
    if op not in PROVIDERS:
        raise ValueError(f"op must be one of {sorted(PROVIDERS)}, got {op!r}")
    bad_modes = [m for m in modes if m not in MODES]
    if bad_modes:
        raise ValueError(f"unknown modes {bad_modes}; choose from {MODES}")
    protocol = _resolve_protocol(protocol, interleave)
    workloads = check_workloads(op, workloads)
    head = head or head_name(vocab, hidden, softcap)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    chosen = select_providers(op, providers)
    loss_types = check_loss_types(op, loss_types)
    entries = _entries(chosen, loss_types)
    x_name = "tokens" if op in ("ce", "distill") else "batch"
    rows: list[dict] = []
    skipped: dict[str, str] = {}
    failed: set[tuple[str, str, str]] = set()  # (workload, entry key, mode)

    def record(provider: Provider, loss_type: str | None, workload: str, x: int, mode: str,
               measure: Callable[[], dict] | Refusal) -> None:
        """One row: `measure()`'s fields, or NaNs and a note when it raises or is a refusal."""
        label = provider.label()
        base = {"op": op, "provider": label, "x_name": x_name, "x": x, "mode": mode, "protocol": protocol,
                "workload": workload, "head": head}
        if loss_type is not None:
            base["loss_type"] = loss_type
        row = {**base, "note": ""}
        try:
            if isinstance(measure, Refusal):
                row = _nan_row(**base, note=f"refused: {measure.reason}"[:200])
            else:
                row.update(measure())
        except Exception as error:  # noqa: BLE001 - one broken provider must not end the run
            row = _nan_row(**base, note=_error_note(error))
            if row["note"] != "OOM":
                failed.add((workload, _entry_key(provider, loss_type), mode))
                say("".join(traceback.format_exception(error)).rstrip())  # the GPU run is one-shot: keep it all
        rows.append(row)
        kind = "" if loss_type is None else f"{loss_type:<8}"
        say(f"{op} {workload:<9} {x_name}={x:<6} {kind}{label:<28} {mode:<9} p50 {row['ms_p50']:9.3f} ms  "
             f"extra {row['peak_extra_mib']:9.1f} MiB  n={row['n_reps']:<3} loss {row['loss']:.5f} {row['note']}")

    def timed_then_measured(steps: dict, mode: str, inputs: Inputs, timing: dict | BaseException | None):
        def measure() -> dict:
            # Timing first: its warm-up absorbs compilation and autotuning, whose scratch
            # allocations must not count as the provider's memory.
            if isinstance(timing, BaseException):
                raise timing
            fields = dict(timing) if timing is not None else time_step(
                steps[mode], inputs, warmup=warmup, reps=reps, min_reps=min_reps, max_case_s=max_case_s)
            fields["loss"], fields["peak_extra_mib"] = measure_step(steps[mode], inputs, mode)
            inputs.clear_grads()
            return fields
        return measure

    settle_gpu(device)
    total = len(workloads) * len(xs) * len(entries) * len(modes)
    with _progress(total, progress, f"{op} sweep ({protocol})") as bar:
        for workload in workloads:
            for x in xs:
                inputs = make_inputs(op, x, hidden=hidden, vocab=vocab, dtype=dtype, device=device, seq=seq,
                                      seed=seed, workload=workload, softcap=softcap)
                views = {t: inputs if t is None else for_loss_type(inputs, t) for _, t in entries}
                if protocol != "sequential":
                    built = {(p, t): steps for p, t in entries
                             if (steps := _build(p, views[t], skipped)) is not None}
                    for mode in modes:
                        bar.set_postfix_str(f"{workload} {x_name}={x} {mode}, {protocol}")
                        todo = {(p, t): st for (p, t), st in built.items()
                                if mode in st and (workload, _entry_key(p, t), mode) not in failed}
                        for (p, t), st in list(todo.items()):
                            if isinstance(st[mode], Refusal):
                                record(p, t, workload, x, mode, st[mode])
                                del todo[(p, t)]
                        rng = _case_rng(seed, op, workload, x, mode) if protocol == "shuffled" else None
                        try:
                            named = {_entry_key(p, t): st[mode] for (p, t), st in todo.items()}
                            timings = time_steps_interleaved(
                                named, inputs, warmup=warmup, reps=reps, min_reps=min_reps, max_case_s=max_case_s,
                                rng=rng, on_warmed=lambda name, seconds, case=f"{workload} {x_name}={x} {mode}": say(
                                    f"{op} {case}: {name} warmed up in {seconds:.1f} s"))
                        except Exception as error:  # noqa: BLE001 - e.g. OOM with every step alive
                            timings = {_entry_key(p, t): error for p, t in todo}
                        for (p, t), st in todo.items():
                            record(p, t, workload, x, mode,
                                   timed_then_measured(st, mode, views[t], timings[_entry_key(p, t)]))
                        bar.update(len(entries))
                    del built
                else:
                    for provider, loss_type in entries:
                        bar.set_postfix_str(f"{workload} {x_name}={x} {_entry_key(provider, loss_type)}")
                        steps = _build(provider, views[loss_type], skipped)
                        for mode in modes:
                            bar.update(1)
                            key = (workload, _entry_key(provider, loss_type), mode)
                            if steps is not None and mode in steps and key not in failed:
                                step = steps[mode]
                                record(provider, loss_type, workload, x, mode, step if isinstance(step, Refusal)
                                       else timed_then_measured(steps, mode, views[loss_type], None))
                        del steps
                        free_memory(device)
                        if checkpoint is not None:
                            checkpoint(rows)
                del inputs, views
                free_memory(device)
                if op == "preference":
                    for line in loss_mismatches([r for r in rows if r["workload"] == workload and r["x"] == x]):
                        say(f"CROSS-CHECK FAILED: {line}")
                if protocol != "sequential" and checkpoint is not None:  # sequential checkpoints after each provider
                    checkpoint(rows)
    return rows


def _relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    """‖value − reference‖_F / ‖reference‖_F, in float64."""
    return float(torch.linalg.vector_norm(value.double() - reference) / torch.linalg.vector_norm(reference))


def run_accuracy(
    tokens: list[int],
    *,
    hidden: int = 4096,
    vocab: int = 128256,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device | None = None,
    providers: list[str] | None = None,
    seed: int = 0,
    chunk_tokens: int = 1024,
    progress: bool = True,
    workloads: list[str] | tuple[str, ...] = ("dense",),
    seq: int = DEFAULT_SEQ,
    softcap: float | None = None,
    head: str | None = None,
    checkpoint: Callable[[list[dict]], None] | None = None,
) -> list[dict]:
    """Errors of each cross-entropy provider against the fp64 truth, mean reduction, mode "full".

    Adds to the schema err_loss = |loss − ref|/|ref|, err_dx, err_dw (relative Frobenius
    errors, see `_relative_error`), `note`, `workload`, `head` and `protocol` ("sequential": the
    providers run one after the other, untimed). The same-dtype PyTorch computation
    (`huggingface_bf16` for bf16 inputs) and the fp32 upcast are among the providers: they are
    the yardstick for what "accurate" means in this dtype. Times are not measured (NaN, n_reps 0);
    peak_extra_mib comes from the same single run. The truth applies `softcap` like the providers.
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    workloads = check_workloads("ce", workloads)
    head = head or head_name(vocab, hidden, softcap)
    chosen = select_providers("ce", providers, accuracy=True)
    floors = [p.key for p in chosen if p.is_floor]
    if floors:
        raise ValueError(f"the GEMM floors compute no loss and cannot be checked for accuracy: {floors}")
    rows: list[dict] = []
    skipped: dict[str, str] = {}
    cases = [(workload, n_tokens) for workload in workloads for n_tokens in tokens]
    with _progress(len(cases) * len(chosen), progress, "accuracy") as bar:
        for workload, n_tokens in cases:
            inputs = make_ce_inputs(n_tokens, hidden, vocab, dtype=dtype, device=device, seed=seed,
                                    workload=workload, seq=seq, softcap=softcap)
            ref_loss, ref_dx, ref_dw = fp64_linear_cross_entropy_grads_chunked(
                inputs.x, inputs.w, inputs.target, chunk_tokens=chunk_tokens, softcap=softcap
            )
            for provider in chosen:
                bar.set_postfix_str(f"{workload} tokens={n_tokens} {provider.key}")
                bar.update(1)
                steps = _build(provider, inputs, skipped)
                if steps is None:
                    continue
                row = _nan_row(op="ce", provider=provider.label(), x_name="tokens", x=n_tokens, mode="full",
                               protocol="sequential", workload=workload, head=head)
                try:
                    if isinstance(steps["full"], Refusal):
                        raise ProviderRefused(steps["full"].reason)
                    row["loss"], row["peak_extra_mib"] = measure_step(steps["full"], inputs, "full")
                    row["err_loss"] = abs(row["loss"] - float(ref_loss)) / abs(float(ref_loss))
                    row["err_dx"] = _relative_error(inputs.x.grad, ref_dx)
                    row["err_dw"] = _relative_error(inputs.w.grad, ref_dw)
                except ProviderRefused as error:
                    row["note"] = f"refused: {error}"[:200]
                except Exception as error:  # noqa: BLE001 - one broken provider must not end the run
                    row["note"] = _error_note(error)
                    say(traceback.format_exc().rstrip())
                rows.append(row)
                errors = " ".join(f"{k} {row.get(k, math.nan):.3e}" for k in ("err_loss", "err_dx", "err_dw"))
                say(f"accuracy {workload:<9} tokens={n_tokens:<6} {row['provider']:<28} {errors} {row['note']}")
                inputs.clear_grads()
                del steps
                free_memory(device)
                if checkpoint is not None:
                    checkpoint(rows)
            del inputs, ref_dx, ref_dw
            free_memory(device)
    return rows
