"""What the GPU probes in probes/ share: CUDA-event timing of one callable and a JSON-lines record.

    from probe_common import ms_quantiles, recorder      (the probes run as `python probes/x.py`)

`ms_quantiles` syncs after every rep (a kernel's own time, launch latency included);
`ms_quantiles_back_to_back` times reps queued back to back, as the benchmark does.
"""
import json
import os

import torch


def ms_quantiles(fn, warmup: int = 3, reps: int = 15) -> tuple[float, float, float]:
    """(p50, p20, p80) ms of `fn`, each rep synchronized and bracketed by its own CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2], times[len(times) // 5], times[(4 * len(times)) // 5]


def ms_quantiles_back_to_back(fn, warmup: int = 3, reps: int = 20) -> tuple[float, float, float]:
    """(p50, p20, p80) ms of `fn` timed like `fusedkern.bench`: reps queued back to back, each between
    its own CUDA events, one sync at the end — so the host may run ahead and launch gaps show only
    where `fn` itself waits for the GPU."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    times = sorted(start.elapsed_time(end) for start, end in events)
    return times[len(times) // 2], times[len(times) // 5], times[(4 * len(times)) // 5]


def recorder(jsonl_name: str):
    """A `record(**fields)` that prints one line and appends the fields to $OUT/<jsonl_name>."""
    path = os.path.join(os.environ.get("OUT", "/tmp"), jsonl_name)

    def record(**fields) -> None:
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items()), flush=True)
        with open(path, "a") as out:
            out.write(json.dumps(fields) + "\n")

    return record
