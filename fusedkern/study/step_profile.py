"""Where one training step's time goes: every kernel of a `torch.profiler` trace of one optimizer step, put in one
category, and the step speed-up a head at its floor would give (Amdahl's bound).

The categories (`CATEGORIES`):

- `head_gemm`, `head_other`: the LM head and its loss inside the model's forward (the GEMMs of the logits, dX and
  dW, and every other kernel: the row pass, casts, slicing the hidden states and labels), forward and backward;
- `attention`: the attention core of the decoder layers (SDPA's flash / memory-efficient kernels);
- `layers_other`: every other kernel of the decoder layers (projections, MLP, norms, RoPE: PyTorch's or Liger's);
- `optimizer`: inside `Optimizer.step` / `Optimizer.zero_grad` (torch names these ranges itself);
- `rest`: the embedding, the final norm, the trainer's loss code outside the model, gradient accumulation into
  `.grad`, gradient clipping, copies, and any kernel the trace does not tie to an operator.

Where a kernel belongs is read from named ranges that `scope_hooks` opens around the model's forward, its backbone
(the base model: embedding, decoder layers, final norm) and each decoder layer: the head is what runs inside the
model's forward but outside its backbone. This holds for TRL's head and fusedkern's alike: both replace the causal
LM's forward by one that calls the backbone, then computes the per-token log-probs from its last hidden state (TRL's
`add_fused_lm_head`; `fusedkern.integrations.trl`). A backward kernel takes the range of the forward operator that
recorded its autograd node (the profiler's `sequence_nr` and forward thread), so the backward of a decoder layer
counts as that layer and the head's backward as the head.

`classify` works on `Op` records, which `ops_from_profile` builds from a profiler (CUDA kernels attached to the
operator that launched them; on CPU, each operator's self time stands for its kernels), so a test can also build a
trace by hand.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

CATEGORIES = ("head_gemm", "head_other", "attention", "layers_other", "optimizer", "rest")
LABELS = {"head_gemm": "head: GEMMs", "head_other": "head: other kernels", "attention": "attention",
          "layers_other": "decoder layers: other kernels", "optimizer": "optimizer (AdamW)", "rest": "rest"}
#: the CSV's category of the head's three-GEMM floor over the step's tokens (timed beside the profile, not a part of
#: the step's kernels)
FLOOR_CATEGORY = "head_floor_3gemm"

SCOPE_PREFIX = "fk_scope::"
MODEL, BACKBONE, LAYER = "model", "backbone", "layer"

BACKWARD_PREFIX = "autograd::engine::evaluate_function: "
# kernel names of GEMMs: cuBLAS / CUTLASS / nvjet, and fusedkern's own GEMM kernels with epilogues
GEMM_KERNEL = re.compile(r"gemm|matmul|cutlass|cublas|nvjet|xmma|wgmma|^_logits_kernel$|^_logits_partials_kernel$|"
                         r"^_dx_kernel$|^_dw_kernel$|^_fused_ce_(fwd|bwd)_kernel$", re.IGNORECASE)
# operators whose kernels are GEMMs (on CPU the operator is its own kernel)
GEMM_OP = re.compile(r"^aten::(mm|addmm_?|bmm|baddbmm|addbmm|matmul|linear|_scaled_mm)$")
ATTENTION = re.compile(r"scaled_dot_product|flash_attention|efficient_attention|cudnn_attention|flash_attn|fmha|"
                       r"flash_fwd|flash_bwd", re.IGNORECASE)


@dataclass(frozen=True)
class Op:
    """One CPU-side event of a trace: an operator or a named range.

    `parent`: the id of the enclosing event on the same thread (None at the top). `sequence_nr`: the autograd
    sequence number an operator recorded (its node's, for a backward `evaluate_function` event; -1 when none).
    `fwd_thread`: for a backward event, the thread whose forward recorded the node. `kernels`: (name, µs) of the
    device kernels this event launched itself."""

    id: int
    name: str
    parent: int | None = None
    sequence_nr: int = -1
    thread: int = 0
    fwd_thread: int = 0
    kernels: tuple[tuple[str, float], ...] = ()


def scope_name(scope: str) -> str:
    return SCOPE_PREFIX + scope


class scope_hooks:
    """Named ranges around a causal LM's forward (`model`), its backbone (`backbone`, `model.base_model`) and each
    decoder layer (`layer`, every module of `model.base_model.layers`), opened by forward pre-hooks and closed by
    forward hooks; a context manager that removes the hooks on exit."""

    def __init__(self, model):
        import torch

        self._torch = torch
        backbone = getattr(model, "base_model", None)
        layers = getattr(backbone, "layers", None)
        if backbone is None or backbone is model or layers is None:
            raise TypeError(f"{type(model).__name__}: expected a causal LM with a base_model holding .layers")
        self._targets = [(model, MODEL), (backbone, BACKBONE), *((layer, LAYER) for layer in layers)]
        self._handles = []
        self._open: dict[int, list] = {}

    def __enter__(self):
        for module, scope in self._targets:
            self._handles.append(module.register_forward_pre_hook(self._opener(scope)))
            self._handles.append(module.register_forward_hook(self._closer()))
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for stack in self._open.values():  # a forward that raised leaves its range open
            while stack:
                stack.pop().__exit__(None, None, None)
        return False

    def _opener(self, scope: str):
        def pre_hook(module, args):
            ranges = self._open.setdefault(id(module), [])
            ranges.append(self._torch.profiler.record_function(scope_name(scope)))
            ranges[-1].__enter__()
        return pre_hook

    def _closer(self):
        def hook(module, args, output):
            ranges = self._open.get(id(module))
            if ranges:
                ranges.pop().__exit__(None, None, None)
        return hook


def ops_from_profile(prof, *, device_kernels: bool) -> tuple[list[Op], float]:
    """The trace's CPU-side events as `Op`s, and the µs of device kernels no event claims (0 on CPU).

    device_kernels: take each event's CUDA kernels (a GPU trace); else each event's own CPU time stands for its
    kernels (a CPU trace, as the tests run)."""
    from torch.autograd import DeviceType

    events = [e for e in prof.events() if e.device_type == DeviceType.CPU]
    index = {id(e): i for i, e in enumerate(events)}
    ops = []
    claimed = 0.0
    for i, e in enumerate(events):
        if device_kernels:
            kernels = tuple((k.name, float(k.duration)) for k in e.kernels)
        else:
            kernels = ((e.name, float(e.self_cpu_time_total)),)
        claimed += sum(us for _, us in kernels)
        parent = index.get(id(e.cpu_parent)) if e.cpu_parent is not None else None
        ops.append(Op(id=i, name=e.name, parent=parent, sequence_nr=int(e.sequence_nr), thread=int(e.thread),
                      fwd_thread=int(e.fwd_thread), kernels=kernels))
    unclaimed = 0.0
    if device_kernels:
        device_us = sum(end - start for start, end, _ in _device_intervals(prof))
        unclaimed = max(0.0, device_us - claimed)
    return ops, unclaimed


def _device_intervals(prof) -> list[tuple[float, float, str]]:
    """(start, end) µs and name of every device kernel, copy and memset of the trace. The named ranges
    (`scope_hooks`, `record_function`) also appear on the device's timeline, each spanning the kernels inside it:
    counted as kernels, they would add the whole forward again."""
    from torch.autograd import DeviceType

    return [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
            if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]


def device_busy_us(prof) -> float:
    """µs during which at least one device kernel, copy or memset of the trace ran (the union of their intervals,
    so concurrent streams count once): the profiled step's wall time minus this is the time the GPU sat idle,
    waiting on the host."""
    return sum(end - start for start, end, _, _ in _busy_spans(prof))


def idle_gaps(prof, min_us: float = 500.0) -> list[tuple[float, float, str, str]]:
    """The device's idle gaps of at least `min_us` between its first and last kernel, largest first: (µs, where the
    gap starts in µs after the first kernel began, the kernel before the gap, the kernel after it). The kernel after
    a gap is what the GPU waited for the host to launch."""
    spans = _busy_spans(prof)
    gaps = [(nxt[0] - cur[1], cur[1] - spans[0][0], cur[3], nxt[2]) for cur, nxt in zip(spans, spans[1:])]
    return sorted((g for g in gaps if g[0] >= min_us), reverse=True)


def host_during_gap(prof, at_us: float, gap_us: float, depth: int = 4) -> str:
    """What the host did while the GPU sat idle in a gap (`idle_gaps`' position and length): "waited in A ← B ← …"
    when a CPU event that began well before the gap ended as it opened (a synchronization: the host blocked until
    the GPU ran out of work, then had nothing queued), else "busy in A ← B ← …" for the innermost CPU event that
    spans at least half of the gap (the host too slow to keep the GPU fed), else "not in any recorded event".
    Chains go from the innermost event out, `depth` names at most."""
    from torch.autograd import DeviceType

    spans = _busy_spans(prof)
    opened = spans[0][0] + at_us if spans else at_us
    closed = opened + gap_us
    cpu = [e for e in prof.events() if e.device_type == DeviceType.CPU]
    # 100 µs: the host's return from a wait lags the GPU's last kernel by a few µs, and the waiting event began
    # before the GPU drained
    waited = [e for e in cpu if e.time_range.start < opened - 100
              and opened - 100 <= e.time_range.end <= opened + min(300.0, gap_us / 2)]
    if waited:
        return "waited in " + _chain_names(max(waited, key=lambda e: e.time_range.start), depth)
    busy = [e for e in cpu if min(e.time_range.end, closed) - max(e.time_range.start, opened) >= gap_us / 2]
    if busy:
        return "busy in " + _chain_names(max(busy, key=lambda e: e.time_range.start), depth)
    return "not in any recorded event"


def _chain_names(event, depth: int) -> str:
    names = []
    while event is not None and len(names) < depth:
        names.append(event.name)
        event = event.cpu_parent
    return " ← ".join(names)


def _busy_spans(prof) -> list[tuple[float, float, str, str]]:
    """The union of the device's intervals as (start, end, its first kernel, the kernel that ends it), in order."""
    spans: list[tuple[float, float, str, str]] = []
    for start, end, name in sorted(_device_intervals(prof)):
        if spans and start <= spans[-1][1]:
            s0, e0, first, last = spans[-1]
            spans[-1] = (s0, end, first, name) if end > e0 else (s0, e0, first, last)
        else:
            spans.append((start, end, name, name))
    return spans


def _chain(op: Op, by_id: dict[int, Op]) -> list[Op]:
    """op and its enclosing events, innermost first."""
    out = [op]
    while out[-1].parent is not None:
        out.append(by_id[out[-1].parent])
    return out


def classify(ops: Sequence[Op], *, unclaimed_us: float = 0.0) -> tuple[dict[str, float], list[tuple[str, str, float]]]:
    """µs per category (`CATEGORIES`, every key present) of every kernel in `ops`, and (category, kernel, µs) of
    each kernel name, summed, largest first. `unclaimed_us` (device time no operator claims) joins `rest`."""
    by_id = {op.id: op for op in ops}
    if len(by_id) != len(ops):
        raise ValueError("ops: every Op needs its own id")
    forward: dict[tuple[int, int], tuple[int, Op]] = {}  # (thread, sequence_nr) -> (depth, innermost forward op)
    for op in ops:
        if op.sequence_nr < 0:
            continue
        chain = _chain(op, by_id)
        if any(node.name.startswith(BACKWARD_PREFIX) for node in chain):
            continue  # a backward node's own events repeat its sequence number
        key = (op.thread, op.sequence_nr)
        if key not in forward or len(chain) > forward[key][0]:
            forward[key] = (len(chain), op)
    totals = dict.fromkeys(CATEGORIES, 0.0)
    totals["rest"] += unclaimed_us
    per_kernel: dict[tuple[str, str], float] = {}
    for op in ops:
        if not op.kernels:
            continue
        chain = _chain(op, by_id)
        for node in chain:  # a backward kernel: add the chain of the forward operator that recorded its node
            if node.name.startswith(BACKWARD_PREFIX):
                origin = forward.get((node.fwd_thread, node.sequence_nr))
                if origin is not None:
                    chain = chain + _chain(origin[1], by_id)
                break
        for name, us in op.kernels:
            category = _category(name, chain)
            totals[category] += us
            per_kernel[(category, name)] = per_kernel.get((category, name), 0.0) + us
    ranked = sorted(((c, n, us) for (c, n), us in per_kernel.items()), key=lambda t: -t[2])
    return totals, ranked


def _category(kernel: str, chain: Iterable[Op]) -> str:
    chain = list(chain)
    names = [op.name for op in chain]
    if any(n.startswith("Optimizer.") for n in names):
        return "optimizer"
    if any("AccumulateGrad" in n for n in names):
        return "rest"
    scopes = {n[len(SCOPE_PREFIX):] for n in names if n.startswith(SCOPE_PREFIX)}
    if MODEL in scopes and BACKBONE not in scopes:
        gemm = GEMM_KERNEL.search(kernel) or GEMM_OP.match(chain[0].name) or GEMM_OP.match(kernel)
        return "head_gemm" if gemm else "head_other"
    if LAYER in scopes:
        if ATTENTION.search(kernel) or any(ATTENTION.search(n) for n in names):
            return "attention"
        return "layers_other"
    return "rest"


def amdahl_bound(step_ms: float, head_ms: float, floor_ms: float) -> float:
    """The step's speed-up if its head took `floor_ms` instead of `head_ms`: step / (step − head + floor)."""
    if not (0 <= head_ms <= step_ms) or floor_ms < 0:
        raise ValueError(f"need 0 <= head_ms <= step_ms and floor_ms >= 0, got step {step_ms}, head {head_ms}, "
                         f"floor {floor_ms}")
    return step_ms / (step_ms - head_ms + floor_ms)
