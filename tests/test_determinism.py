"""Bitwise determinism (docs/usage.md, "Determinism"): the same call gives the same bits (the loss, every other
output, dX, dW and db) on every repeat, under `torch.use_deterministic_algorithms(True)`, and in a second process,
for every loss and every strategy `impl="auto"` takes: the chunked three-GEMM paths (cuBLAS), the per-token paths
(their statistics pass on the Gluon kernel on an sm_90 GPU, the logits recomputed in backward), the counted paths
(a host count's gathered rows, a device count's row-count GEMMs), the formula operators (DPO, SimPO, GRPO),
distillation, and loss-only passes. CPU: Triton's interpreter at tiny shapes; `gpu`: bf16 at realistic shapes.

The fused strategy's backward adds with atomics: its bits are checked on CPU only (the interpreter runs programs one
after another), and under deterministic algorithms it must refuse, and "auto" must not fall back to it.

`python -m tests.test_determinism cpu|cuda [--deterministic]` prints every case's checksum as JSON: the second
process of the cross-process tests.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

import fusedkern as fk
from fusedkern import anchored, compacted, dispatch, distillation, engine
from fusedkern.dispatch import Call
from fusedkern.engine import LossOptions
from tests.conftest import DEVICE

ROOT = Path(__file__).resolve().parents[1]
# one worker for the whole module (pytest-xdist --dist loadgroup): the second process starts once, beside it
pytestmark = [pytest.mark.xdist_group("determinism"), pytest.mark.usefixtures("one_cpu_thread")]


# ---------------------------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Size:
    """tokens: rows of a token-level case; seq: tokens per sequence of the sequence cases; chunk_tokens: the chunk
    of the cases that pass one (None: the default plan)."""

    tokens: int
    hidden: int
    vocab: int
    seq: int
    chunk_tokens: int | None


#: tiny: the interpreter's cost is per program (one per row in the row kernels). chunk_tokens 4 splits 8 tokens
#: into two chunks: bf16 dW accumulated in fp32 with the logits buffer inside dW's own storage, and a device count
#: of 5 gives one full and one partial chunk
CPU_SIZE = Size(tokens=8, hidden=16, vocab=48, seq=4, chunk_tokens=4)
#: V·T too big for one chunk (1 GiB of bf16 logits): the default plan's 2048-token chunks inside dW's own storage
#: beside the fp32 accumulator; 1024-token sequences, a chosen/rejected pair a chunk. About 1.5 GiB of buffers a case:
#: the weight and dW (256 MiB each), the fp32 accumulator (512 MiB) and two copies of dW to compare
GPU_SIZE = Size(tokens=8192, hidden=2048, vocab=65536, seq=1024, chunk_tokens=None)


@dataclass
class Case:
    """leaves: the tensors differentiated (named dx, dw, db in the outputs); run() → named outputs, "loss" first
    (the scalar differentiated; its gradients are taken when there are leaves). paths: the code paths the case must
    take (`PATHS`), absent: those it must not."""

    leaves: dict[str, torch.Tensor]
    run: Callable[[], dict[str, torch.Tensor]]
    paths: frozenset[str]
    absent: frozenset[str] = field(default_factory=frozenset)


#: the path names of `PATHS`: a mean/sum's three GEMMs on cuBLAS, and a backward that recomputes the logits (four)
THREE_CUBLAS_GEMMS = frozenset({"cuBLAS gradient GEMMs", "gradient formed in the forward"})
FOUR_GEMMS = frozenset({"recomputed gradients"})


def _generator(device: str, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _head(size: Size, device: str, seed: int, *, bias: bool = False):
    """x [T, H], w [V, H] bf16 leaves (logits of a few units), targets [T] (row t ignored where t % 3 == 0: 5 of 8
    valid on CPU), and a bias leaf or None."""
    g = _generator(device, seed)
    T, H, V = size.tokens, size.hidden, size.vocab
    x = torch.randn(T, H, device=device, generator=g).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(V, H, device=device, generator=g) * 2 / H ** 0.5).to(torch.bfloat16).requires_grad_()
    y = torch.randint(0, V, (T,), device=device, generator=g)
    y[torch.arange(T, device=device) % 3 == 0] = -100
    b = torch.randn(V, device=device, generator=g).to(torch.bfloat16).requires_grad_() if bias else None
    return x, w, y, b


def _like(t: torch.Tensor, seed: int) -> torch.Tensor:
    """Fixed random fp32 weights shaped like t: the upstream gradient of a per-token output."""
    return torch.randn(t.shape, device=t.device, generator=_generator(t.device.type, seed))


def _on_anchored(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether "auto" takes the anchored pass for plain options (its Gluon producer runs: sm_90, bf16)."""
    return dispatch.anchored_for("auto", Call(x.reshape(-1, x.shape[-1]), w, None, None, LossOptions()))


def _statistics_pass(x: torch.Tensor, w: torch.Tensor) -> str:
    """The statistics pass "auto" takes for plain options: the anchored pass's sums, else the Gluon kernel, where
    they apply (sm_90, bf16)."""
    if _on_anchored(x, w):
        return "anchored statistics"
    gluon = dispatch.strategy(dispatch.GLUON).unsupported(Call(x.reshape(-1, x.shape[-1]), w, None, None,
                                                                LossOptions()))
    return "Gluon statistics" if gluon is None else "chunked statistics"


def _three_gemms(x: torch.Tensor, w: torch.Tensor) -> frozenset[str]:
    """A mean/sum's gradient formed in the forward: on the anchored pass, else the chunked GEMMs."""
    return frozenset({"anchored gradient formed in the forward"}) if _on_anchored(x, w) else THREE_CUBLAS_GEMMS


def _formula(x: torch.Tensor, w: torch.Tensor) -> frozenset[str]:
    """A formula loss: its log-probs with E kept on the anchored pass, else the chunked engine's formula rows."""
    return frozenset({"anchored E kept"}) if _on_anchored(x, w) else frozenset({"formula"})


def _per_token(x: torch.Tensor, w: torch.Tensor) -> frozenset[str]:
    """A per-token call with a gradient: E kept to the backward on the anchored pass (the entropy's gradient over it
    too), else a statistics pass and the recomputed gradients."""
    if _on_anchored(x, w):
        return frozenset({"anchored E kept"})
    return frozenset({_statistics_pass(x, w), "recomputed gradients"})


def _sequences(size: Size, device: str, seed: int, rows: int):
    """x [R, S, H], w [V, H] bf16 leaves and y [R, S] with the first half of every sequence a prompt (ignored, and
    `_head`'s every third row besides), for R·S = size.tokens."""
    x, w, y, _ = _head(size, device, seed)
    y = y.reshape(rows, -1)
    y[:, : y.shape[1] // 2] = -100
    return x.detach().reshape(rows, y.shape[1], -1).requires_grad_(), w, y


def ce_mean(size, device):
    x, w, y, _ = _head(size, device, 1)
    return Case({"x": x, "w": w}, lambda: {"loss": fk.linear_cross_entropy(x, w, y, chunk_tokens=size.chunk_tokens)},
                _three_gemms(x, w), FOUR_GEMMS)


def ce_sum_every_option(size, device):
    x, w, y, b = _head(size, device, 2, bias=True)
    cw = torch.rand(size.vocab, device=device, generator=_generator(device, 20)) + 0.5

    def run():
        return {"loss": fk.linear_cross_entropy(x, w, y, linear_bias=b, weight=cw, reduction="sum",
                                                label_smoothing=0.1, z_loss=1e-4, softcap=30.0,
                                                chunk_tokens=size.chunk_tokens)}
    return Case({"x": x, "w": w, "b": b}, run, THREE_CUBLAS_GEMMS, FOUR_GEMMS)


def ce_per_token(size, device):
    x, w, y, _ = _head(size, device, 3)
    upstream = _like(y, 30)

    def run():
        loss, lse = fk.linear_cross_entropy(x, w, y, reduction="none", return_lse=True,
                                            chunk_tokens=size.chunk_tokens)
        return {"loss": (loss * upstream).sum(), "per_token": loss, "lse": lse}
    return Case({"x": x, "w": w}, run, _per_token(x, w))


def ce_host_count(size, device):
    x, w, y, _ = _head(size, device, 4)
    n = int((y != -100).sum())
    return Case({"x": x, "w": w},
                lambda: {"loss": fk.linear_cross_entropy(x, w, y, num_valid_tokens=n, chunk_tokens=size.chunk_tokens)},
                _three_gemms(x, w), FOUR_GEMMS | {"row-count GEMMs"})


def ce_device_count(size, device):
    x, w, y, _ = _head(size, device, 5)
    n = (y != -100).sum()
    return Case({"x": x, "w": w},
                lambda: {"loss": fk.linear_cross_entropy(x, w, y, num_valid_tokens=n, chunk_tokens=size.chunk_tokens)},
                frozenset({"row-count GEMMs", "gradient formed in the forward"}),
                FOUR_GEMMS | {"cuBLAS gradient GEMMs"})


def ce_fused(size, device):
    x, w, y, b = _head(size, device, 6, bias=True)
    return Case({"x": x, "w": w, "b": b},
                lambda: {"loss": fk.linear_cross_entropy(x, w, y, linear_bias=b, label_smoothing=0.1, impl="fused")},
                frozenset({"fused statistics", "fused gradients"}))


def ce_loss_only(size, device):
    x, w, y, _ = _head(size, device, 7)

    def run():
        with torch.no_grad():
            loss, lse = fk.linear_cross_entropy(x, w, y, reduction="none", return_lse=True)
        return {"loss": loss, "lse": lse}
    return Case({}, run, frozenset({_statistics_pass(x, w)}))


def ce_loss_only_options(size, device):
    """Options the Gluon pass does not take: the chunked statistics pass (the tile pass at the GPU's vocabulary)."""
    x, w, y, b = _head(size, device, 8, bias=True)

    def run():
        with torch.no_grad():
            return {"loss": fk.linear_cross_entropy(x, w, y, linear_bias=b, label_smoothing=0.1, z_loss=1e-4)}
    return Case({}, run, frozenset({"chunked statistics"}))


def logprobs_entropy(size, device):
    x, w, y, _ = _head(size, device, 9)
    up_logp, up_entropy = _like(y, 90), _like(y, 91)

    def run():
        logp, entropy = fk.linear_logprobs(x, w, y, temperature=0.7, return_entropy=True,
                                           chunk_tokens=size.chunk_tokens)
        return {"loss": (logp * up_logp).sum() + (entropy * up_entropy).sum(), "logp": logp, "entropy": entropy}
    return Case({"x": x, "w": w}, run, _per_token(x, w))


def logprobs_host_count(size, device):
    x, w, y, _ = _head(size, device, 10)
    n, upstream = int((y != -100).sum()), _like(y, 100)

    def run():
        logp = fk.linear_logprobs(x, w, y, num_valid_tokens=n, chunk_tokens=size.chunk_tokens)
        return {"loss": (logp * upstream).sum(), "logp": logp}
    return Case({"x": x, "w": w}, run, _per_token(x, w))


def logprobs_loss_only(size, device):
    x, w, y, _ = _head(size, device, 11)

    def run():
        with torch.no_grad():
            logp, entropy = fk.linear_logprobs(x, w, y, temperature=0.7, return_entropy=True)
        return {"loss": logp.sum(), "logp": logp, "entropy": entropy}
    return Case({}, run, frozenset({_statistics_pass(x, w)}))


def _metrics(loss: torch.Tensor, metrics: dict) -> dict[str, torch.Tensor]:
    return {"loss": loss, **{f"metric {k}": v for k, v in metrics.items()}}


def dpo(size, device):
    x, w, y = _sequences(size, device, 12, rows=size.tokens // size.seq)
    g = _generator(device, 120)
    # near the policy's summed log-probs (log V a response token, half of each sequence): sigmoids off saturation
    ref_chosen, ref_rejected = (-(y.shape[1] // 2) * math.log(size.vocab) + 4 * torch.randn(
        x.shape[0] // 2, device=device, generator=g) for _ in range(2))

    def run():
        return _metrics(*fk.linear_preference_loss(x, w, y, loss_type="sigmoid", beta=0.1,
                                                   ref_chosen_logps=ref_chosen, ref_rejected_logps=ref_rejected,
                                                   chunk_tokens=size.chunk_tokens and 2 * size.chunk_tokens))
    return Case({"x": x, "w": w}, run, _formula(x, w), FOUR_GEMMS)


def simpo(size, device):
    x, w, y = _sequences(size, device, 13, rows=size.tokens // size.seq)
    chunk = size.chunk_tokens and 2 * size.chunk_tokens  # a chunk holds a chosen/rejected pair
    return Case({"x": x, "w": w}, lambda: _metrics(*fk.linear_simpo_loss(x, w, y, chunk_tokens=chunk)),
                _formula(x, w), FOUR_GEMMS)


def grpo(size, device):
    x, w, y = _sequences(size, device, 14, rows=size.tokens // size.seq)
    g = _generator(device, 140)
    advantages = torch.randn(x.shape[0], device=device, generator=g)
    # about the policy's own log-probs: some ratios inside the clip range, some outside
    old, ref = (-math.log(size.vocab) - 2 + torch.randn(y.shape, device=device, generator=g) for _ in range(2))
    items = int((y != -100).sum())

    def run():
        return _metrics(*fk.linear_grpo_loss(x, w, y, advantages=advantages, old_logps=old, ref_logps=ref, beta=0.04,
                                             loss_type="dapo", num_items_in_batch=items, temperature=0.7,
                                             compute_entropy=True, chunk_tokens=size.chunk_tokens))
    return Case({"x": x, "w": w}, run, _formula(x, w), FOUR_GEMMS)


def distill(size, device):
    x, w, y, _ = _head(size, device, 15)
    xt, wt, _, _ = _head(size, device, 150)

    def run():
        loss, entropy = fk.linear_distillation_loss(x, w, xt.detach(), wt.detach(), y, beta=0.5, temperature=2.0,
                                                    return_entropy=True, chunk_tokens=size.chunk_tokens)
        return {"loss": loss, "entropy": entropy}
    return Case({"x": x, "w": w}, run, frozenset({"distillation rows"}))


#: every case; the fused one runs on CPU only (on a GPU its backward's atomics make the bits vary)
CASES: dict[str, Callable[[Size, str], Case]] = {f.__name__.replace("_", "-"): f for f in (
    ce_mean, ce_sum_every_option, ce_per_token, ce_host_count, ce_device_count, ce_fused, ce_loss_only,
    ce_loss_only_options, logprobs_entropy, logprobs_host_count, logprobs_loss_only, dpo, simpo, grpo, distill)}
GPU_CASES = [name for name in CASES if name != "ce-fused"]
#: cases whose gradients refuse to run under deterministic algorithms
REFUSED_UNDER_DETERMINISTIC_ALGORITHMS = {"ce-fused"}


# ---------------------------------------------------------------------------------------------- running them


def _anchored_grads(*args, per_token_grad: bool = False, **kwargs) -> str:
    """`anchored.anchored_loss_and_grads`' use: cross-entropy's gradient formed in the forward, or a backward's
    recomputation of E (the `Anchored` strategy's, with a per-token upstream)."""
    return "anchored recomputed gradients" if per_token_grad else "anchored gradient formed in the forward"


def _row_pass(row_pass, *args, **kwargs) -> str | None:
    """The cross-entropy row pass's kind: a backward's (the logits recomputed), a three-GEMM forward's (the gradient
    formed in the forward pass), or a statistics pass's (not named here: `Chunked.statistics` is)."""
    if not row_pass.compute_stats:
        return "recomputed gradients"
    return None if row_pass.grad is None else "gradient formed in the forward"


#: the code paths a case is checked to take: (owner, attribute) called on the path, and the path's name, or a
#: function of the call's arguments giving it
PATHS = [
    (engine.CublasGemms, "grads", "cuBLAS gradient GEMMs"),
    (compacted.RowCountGemms, "grads", "row-count GEMMs"),
    (engine.CrossEntropyRows, "__call__", _row_pass),
    (dispatch.Chunked, "statistics", "chunked statistics"),
    (dispatch.Gluon, "statistics", "Gluon statistics"),
    (dispatch.Fused, "statistics", "fused statistics"),
    (dispatch.Fused, "gradients", "fused gradients"),
    (engine.FormulaRows, "__call__", "formula"),
    (anchored, "anchored_loss_and_grads", _anchored_grads),
    (anchored, "logprobs_forward", "anchored E kept"),
    (anchored, "loss_only", "anchored statistics"),
    (distillation.DistillRows, "__call__", "distillation rows"),
]


@pytest.fixture
def paths_taken(monkeypatch) -> set[str]:
    """The names of the `PATHS` called during the test."""
    taken: set[str] = set()
    for owner, attribute, name in PATHS:
        original = getattr(owner, attribute)

        def spy(*args, _name=name, _original=original, **kwargs):
            if (path := _name(*args, **kwargs) if callable(_name) else _name) is not None:
                taken.add(path)
            return _original(*args, **kwargs)
        monkeypatch.setattr(owner, attribute, functools.wraps(original)(spy))
    return taken


def compute(case: Case) -> dict[str, torch.Tensor]:
    """Every output of one call and the gradients of its loss (dx, dw, db), detached copies. A gradient of zeros
    fails: equal zeros would say nothing about the bits."""
    outputs = case.run()
    grads = torch.autograd.grad(outputs["loss"], list(case.leaves.values())) if case.leaves else ()
    assert all(bool(g.any()) for g in grads), "a gradient is all zeros"
    named = {**outputs, **{"d" + name: g for name, g in zip(case.leaves, grads)}}
    return {name: t.detach().clone() for name, t in named.items()}


@contextlib.contextmanager
def deterministic_algorithms(warn_only: bool = False):
    was = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=was_warn_only)


def assert_same_bits(first: dict[str, torch.Tensor], again: dict[str, torch.Tensor], what: str) -> None:
    """Every output bitwise equal (bytes compared: a NaN equals itself), else which differ, in how many elements."""
    assert list(first) == list(again), what
    for name, a in first.items():
        b = again[name]
        assert (a.dtype, a.shape) == (b.dtype, b.shape), f"{what}: {name} is {a.dtype} {a.shape} vs {b.dtype} {b.shape}"
        if not torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
            differ = (a != b) & ~(a.isnan() & b.isnan())
            worst = (a.double() - b.double()).abs().nan_to_num(float("inf")).max().item()
            raise AssertionError(f"{what}: {name} differs in {int(differ.sum())} of {a.numel()} elements "
                                 f"(largest difference {worst:.3e})")


def digest(outputs: dict[str, torch.Tensor]) -> str:
    """sha256 of every output's name, dtype, shape and bytes."""
    h = hashlib.sha256()
    for name, t in outputs.items():
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def case_digests(device: str, names, size: Size) -> dict[str, str]:
    return {name: digest(compute(CASES[name](size, device))) for name in names}


def _second_process(device: str, extra_env: dict[str, str] | None = None, *,
                    deterministic: bool = False) -> subprocess.Popen:
    """`main` in a new process: every case's checksum (under deterministic algorithms when asked)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           **(extra_env or {})}
    command = [sys.executable, "-m", "tests.test_determinism", device] + ["--deterministic"] * deterministic
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _digests_of(process: subprocess.Popen, timeout_s: int) -> dict[str, str]:
    out, err = process.communicate(timeout=timeout_s)
    assert process.returncode == 0, f"the second process failed (exit {process.returncode}):\n{err[-4000:]}"
    return json.loads(out.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------- CPU


@pytest.fixture(scope="module")
def second_process_cpu():
    """A second process computing every case's checksum on CPU, started at the module's first use so that it runs
    beside the module's tests; called, it returns the checksums."""
    if DEVICE != "cpu":
        pytest.skip("the interpreter's cases run where there is no GPU: the GPU's are test_gpu_*")
    process = _second_process("cpu")
    digests: dict[str, str] = {}

    def get() -> dict[str, str]:
        if not digests:
            digests.update(_digests_of(process, timeout_s=600))
        return digests
    yield get
    if process.poll() is None:
        process.kill()
        process.communicate()


#: each case's checksum in this process, from its repeat test (the cross-process test computes those not run)
_FIRST_DIGESTS: dict[str, str] = {}


@pytest.mark.parametrize("name", list(CASES))
def test_same_bits_on_repeat_and_under_deterministic_algorithms(name, paths_taken, second_process_cpu):
    case = CASES[name](CPU_SIZE, "cpu")
    first = compute(case)
    assert case.paths <= paths_taken and not case.absent & paths_taken, f"{name} took {sorted(paths_taken)}"
    if name in REFUSED_UNDER_DETERMINISTIC_ALGORITHMS:
        assert_same_bits(first, compute(case), f"{name}, repeated")
    else:
        with deterministic_algorithms():
            again = compute(case)
        assert_same_bits(first, again, f"{name}, repeated under torch.use_deterministic_algorithms(True)")
    _FIRST_DIGESTS[name] = digest(first)


def test_second_process_gives_the_same_bits(second_process_cpu):
    """Every case's checksum here (from the repeat tests when they ran first) equals the second process's."""
    ours = {name: _FIRST_DIGESTS.get(name) or digest(compute(CASES[name](CPU_SIZE, "cpu"))) for name in CASES}
    theirs = second_process_cpu()
    assert sorted(name for name in CASES if ours[name] != theirs[name]) == []


def test_auto_does_not_fall_back_to_the_fused_strategy_under_deterministic_algorithms(monkeypatch):
    """With too little free memory for the chunked buffers "auto" takes the fused strategy, whose backward adds with
    atomics; under deterministic algorithms it keeps the chunked one."""
    x, w, _, _ = _head(CPU_SIZE, "cpu", 16)
    monkeypatch.setattr(dispatch, "_chunked_needs_more_than_free", lambda *args: True)
    call = Call(x, w, None, None, LossOptions())
    assert dispatch.choose("auto", call).name == dispatch.resolve_impl("auto", x, w, "fp32", None) == "fused"
    with deterministic_algorithms():
        assert dispatch.choose("auto", call).name == dispatch.resolve_impl("auto", x, w, "fp32", None) == "chunked"
        assert dispatch.forms_grads_in_forward("auto", x, w, "fp32", None)


def test_fused_gradients_refuse_under_deterministic_algorithms():
    """impl="fused": its forward (no atomics) runs under deterministic algorithms, its backward raises (torch's
    convention) or, with warn_only, warns and runs."""
    x, w, y, _ = _head(CPU_SIZE, "cpu", 17)
    with deterministic_algorithms():
        loss = fk.linear_cross_entropy(x, w, y, impl="fused")
        with pytest.raises(RuntimeError, match="impl='fused'.*atomic.*use_deterministic_algorithms"):
            loss.backward()
        with torch.no_grad():
            assert torch.equal(fk.linear_cross_entropy(x, w, y, impl="fused"), loss.detach())
    with deterministic_algorithms(warn_only=True), pytest.warns(UserWarning, match="impl='fused'"):
        fk.linear_cross_entropy(x, w, y, impl="fused").backward()
    assert x.grad is not None and w.grad is not None


#: where a kernel may add with atomics, and why its results are still reproducible or opt-in
ATOMICS_ALLOWED = {
    # the fused strategy's backward: not deterministic, never chosen under deterministic algorithms, refused there
    ("fused_ce.py", "tl.atomic_add"),
    # dW's β = 1 into the fp32 accumulator by a TMA reduce-add: each output tile has one program in a launch, and
    # the chunks' launches follow one another on one stream, so every element is added to in a fixed order
    ("gemm_tiles.py", "desc.atomic_add"),
}


def test_atomics_only_where_reproducible_or_opt_in():
    """A kernel that reduces with atomics (split-K, `tl.atomic_add`) would make the bits vary from run to run: every
    atomic in the package is in `ATOMICS_ALLOWED`, with its reason."""
    found = set()
    for path in sorted((ROOT / "fusedkern").rglob("*.py")):
        for line in path.read_text().splitlines():
            code = line.split("#")[0]
            for match in re.finditer(r"[\w.]*\batomic_\w+\(", code):
                found.add((path.name, match.group(0).rstrip("(")))
    assert found == ATOMICS_ALLOWED, f"atomics outside the allowed list: {sorted(found - ATOMICS_ALLOWED)}"


# ---------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("name", GPU_CASES)
def test_gpu_same_bits_on_repeat(name, paths_taken):
    """Three calls, bitwise equal, on the path the case names (the first call tunes the kernels' configs, the
    row-count dX GEMM then switches to its tuned pair of widths)."""
    case = CASES[name](GPU_SIZE, "cuda")
    first = compute(case)
    assert case.paths <= paths_taken and not case.absent & paths_taken, f"{name} took {sorted(paths_taken)}"
    for i in range(2):
        assert_same_bits(first, compute(case), f"{name}, repeat {i + 2}")


@pytest.mark.gpu
def test_gpu_second_process_under_deterministic_algorithms_gives_the_same_bits():
    """Two processes compute every GPU case, the second under torch.use_deterministic_algorithms(True) (with the
    CUBLAS_WORKSPACE_CONFIG torch asks for, read when a process starts, and the same 32 MiB cuBLAS workspace as
    the default on an sm_90 GPU): no path refuses, and the bits agree. Triton's autotuner picks the row kernels'
    tile config by timing in each process and the statistics' last bits depend on that config, so both processes
    share its choice through Triton's cache (TRITON_CACHE_AUTOTUNING=1, docs/usage.md, "Determinism")."""
    env = {"TRITON_CACHE_AUTOTUNING": "1"}
    first = _digests_of(_second_process("cuda", env), timeout_s=900)
    again = _digests_of(_second_process("cuda", {**env, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"},
                                        deterministic=True), timeout_s=900)
    assert set(first) == set(GPU_CASES)
    assert sorted(name for name in first if first[name] != again[name]) == []


def main(device: str, deterministic: bool) -> None:
    torch.set_num_threads(1)  # as the tests' one_cpu_thread: CPU GEMMs on another thread count may sum otherwise
    torch.use_deterministic_algorithms(deterministic)
    names, size = (GPU_CASES, GPU_SIZE) if device == "cuda" else (list(CASES), CPU_SIZE)
    names = [name for name in names if not (deterministic and name in REFUSED_UNDER_DETERMINISTIC_ALGORITHMS)]
    print(json.dumps(case_digests(device, names, size)))


if __name__ == "__main__":
    main(sys.argv[1], "--deterministic" in sys.argv[2:])
