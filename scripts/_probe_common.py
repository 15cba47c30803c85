"""What the GPU probes in scripts/ share: CUDA-event timing of one callable and a JSON-lines record.

    from _probe_common import ms_quantiles, recorder      (the scripts run as `python scripts/x.py`)
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


def recorder(jsonl_name: str):
    """A `record(**fields)` that prints one line and appends the fields to $OUT/<jsonl_name>."""
    path = os.path.join(os.environ.get("OUT", "/tmp"), jsonl_name)

    def record(**fields) -> None:
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items()), flush=True)
        with open(path, "a") as out:
            out.write(json.dumps(fields) + "\n")

    return record
