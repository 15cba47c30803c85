"""The Gluon loss-only pass (fusedkern/kernels/gluon_logits_stats.py) and its dispatch in `linear_cross_entropy` and
`linear_logprobs` (cross-entropy, and log-probs at a temperature with or without the entropy, under no_grad).

CPU: which calls the dispatcher (`fusedkern/dispatch.py`) sends to it (options, dtypes, shapes, devices, `impl`),
that on CPU it is never taken and nothing changes, and its host side (launch chunks, partial slots, the tile pass's
merge) on a torch emulation of the kernel's partials; the sm_90a compile. GPU (an sm_90 device): the kernel through the
public functions against float64 within 2× torch's bf16 error, ragged and one-row shapes, ignored rows, extreme logits,
confident predictions, poisoned buffers, a host and a device `num_valid_tokens`, temperature and entropy, and that
impl="auto" actually launches it, with or without a gradient to follow. "auto" prefers the anchored pass wherever its
producer runs (tests/test_anchored_wiring.py) and takes this one where the anchored pass's buffers do not fit: every
test here stands the anchored pass aside (`gluon_is_autos_pass`)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fusedkern
from fusedkern import dispatch, reference
from fusedkern.chunked import LossOptions
from fusedkern.logprobs import linear_logprobs_with_stats
from tests._accuracy import assert_close_to_ref, rel_err, torch_linear_cross_entropy, torch_logprobs_entropy
from tests.conftest import DEVICE

ROOT = Path(__file__).resolve().parents[1]
g = dispatch._gluon_kernels()  # the kernel module, None where this Triton has no Gluon
needs_gluon = pytest.mark.skipif(g is None, reason="triton.experimental.gluon (Triton 3.6) cannot be imported")
ON_SM90 = DEVICE == "cuda" and torch.cuda.get_device_capability() == (9, 0)
needs_sm90 = pytest.mark.skipif(not ON_SM90, reason="the Gluon kernel needs an sm_90 (H100/H200) GPU")


def make_inputs(T, H, V, *, dtype=torch.bfloat16, ignore_frac=0.2, w_scale=2.0, device=DEVICE, seed=None):
    """x [T, H], w [V, H] (logits of std ≈ w_scale), targets with `ignore_frac` ignored; a fresh seed unless given
    (printed, so that a failing draw can be replayed)."""
    seed = seed if seed is not None else torch.randint(0, 2**31, ()).item()
    print(f"seed={seed}")
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(dtype)
    w = (torch.randn(V, H, generator=gen) * (w_scale / math.sqrt(H))).to(dtype)
    y = torch.randint(0, V, (T,), generator=gen)
    y[torch.rand(T, generator=gen) < ignore_frac] = -100
    y[0] = V - 1  # the ragged last column tile holds a target
    return x.to(device), w.to(device), y.to(device)


def emulated_partials(x2d, w, target, parts, target_logit, *, logit_scale=1.0, group_m=16, max_ctas=0):
    """`gluon_logits_stats.launch_partials` in torch (fp32 logits s = logit_scale·X·Wᵀ): per row and 256-wide column
    tile the max and Σ exp(s − max) − 1 with ties counted exactly (and with 4 planes Σ exp(s − max)·(s − max)), the
    target's logit where the target is a column."""
    s = (x2d.float() @ w.float().t()) * logit_scale  # (T, V)
    T, V = s.shape
    n = -(-V // g.BLOCK_N)
    tiles = torch.full((T, n * g.BLOCK_N), float("-inf"), dtype=torch.float32, device=s.device)
    tiles[:, :V] = s
    tiles = tiles.view(T, n, g.BLOCK_N)
    m = tiles.max(dim=-1).values
    is_max = tiles == m[..., None]
    rest = torch.where(is_max, 0.0, torch.exp(tiles - m[..., None])).sum(-1) + (is_max.sum(-1) - 1.0)
    parts[0][:, :n] = m
    parts[1][:, :n] = rest
    if parts.shape[0] == 4:
        shifted = tiles - m[..., None]
        parts[3][:, :n] = torch.where(shifted > -math.inf, torch.exp(shifted) * shifted, 0.0).sum(-1)
    hit = (target >= 0) & (target < V)
    target_logit[hit] = s[hit, target[hit]]


@pytest.fixture(autouse=True)
def gluon_is_autos_pass(monkeypatch):
    """impl="auto" as it chooses where the anchored pass does not fit the free memory: this module's tests are the
    Gluon statistics pass's."""
    monkeypatch.setattr(dispatch, "anchored_producer_reason", lambda x, w: "stood aside by this test module")


@pytest.fixture
def gluon_launches(monkeypatch):
    """Counts the Gluon kernel's launches (the real launcher on the GPU)."""
    calls = []
    real = g.launch_partials

    def counting(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(g, "launch_partials", counting)
    return calls


@pytest.fixture
def emulated_gluon(monkeypatch):
    """The Gluon dispatch taken on CPU too, with `emulated_partials` in place of the kernel: the host side end to end.
    Returns the list of launches (rows of each)."""
    calls = []

    def launch(x2d, *args, **kwargs):
        calls.append(x2d.shape[0])
        emulated_partials(x2d, *args, **kwargs)

    monkeypatch.setattr(g, "launch_partials", launch)
    monkeypatch.setattr(dispatch.Gluon, "unsupported", lambda self, call: None)
    return calls


# ------------------------------------------------------------------------------------------------ CPU: dispatch


def _stub_cuda_gluon(monkeypatch):
    """The Gluon kernel's own checks passing on CPU tensors seen as CUDA ones (this is CPU)."""
    stub = type("Stub", (), {"unsupported_reason": staticmethod(lambda x, w: None)})
    monkeypatch.setattr(dispatch, "_gluon_kernels", lambda: stub)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    monkeypatch.setattr(dispatch, "_chunked_needs_more_than_free", lambda *args: False)


@pytest.mark.parametrize("change,plain", [
    ({}, True), ({"bias": True}, False), ({"weight": True}, False), ({"label_smoothing": 0.1}, False),
    ({"z_loss": 1e-4}, False), ({"softcap": 30.0}, False), ({"logit_scale": 1 / 0.7}, True),
    ({"entropy": True}, True),
], ids=["plain", "bias", "class-weight", "smoothing", "z-loss", "softcap", "temperature", "entropy"])
def test_only_the_options_it_computes_are_eligible(monkeypatch, change, plain):
    _stub_cuda_gluon(monkeypatch)
    change = dict(change)
    b = torch.zeros(3) if change.pop("bias", False) else None
    cw = torch.ones(3) if change.pop("weight", False) else None
    entropy = change.pop("entropy", False)
    x, w = torch.zeros(2, 4), torch.zeros(3, 4)
    for ignore_index in (-100, 7):  # any ignore_index
        call = dispatch.Call(x, w, b, cw, LossOptions(ignore_index, **change), entropy)
        assert (dispatch.STRATEGIES["gluon"].unsupported(call) is None) is plain
        chosen = dispatch.choose("auto", call, statistics_only=True).name
        assert chosen == ("gluon" if plain else "chunked")
        assert dispatch.choose("auto", call).name == "chunked"  # a pass that forms gradients: the chunked GEMMs
        assert dispatch.choose("chunked", call, statistics_only=True).name == "chunked"


@pytest.mark.parametrize("impl,reason", [("gluon", "CUDA GPU"), ("fused", "entropy")])
def test_an_explicit_impl_that_cannot_run_the_call_says_why(impl, reason):
    x, w, y = make_inputs(5, 8, 11, dtype=torch.float32, seed=0)
    with torch.no_grad(), pytest.raises(ValueError, match=reason):
        if impl == "gluon":
            fusedkern.linear_cross_entropy(x, w, y, impl="gluon")
        else:
            dispatch.choose("fused", dispatch.Call(x, w, None, None, LossOptions(), with_entropy=True))


@pytest.mark.parametrize("call,grad", [(call, False) for call in ("mean", "sum", "none", "lse", "count", "logprobs",
                                                                  "logprobs-tau-entropy")]
                         + [("mean", True), ("none", True), ("logprobs-tau-entropy", True)])
def test_cpu_never_takes_the_gluon_pass_and_nothing_changes(monkeypatch, call, grad):
    """impl="auto" on CPU tensors: the Gluon module is never asked (it would raise here) and every output is bitwise
    the one of impl="chunked"."""
    x, w, y = make_inputs(21, 16, 70, dtype=torch.float32)

    def run(impl):
        xx = x.clone().requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            if call == "logprobs":
                out = fusedkern.linear_logprobs(xx, w, y, impl=impl)
            elif call == "logprobs-tau-entropy":
                out = torch.stack(fusedkern.linear_logprobs(xx, w, y, temperature=0.7, return_entropy=True,
                                                            impl=impl))
            elif call == "lse":
                out = torch.stack(fusedkern.linear_cross_entropy(xx, w, y, reduction="none", return_lse=True,
                                                                 impl=impl))
            elif call == "count":
                out = fusedkern.linear_cross_entropy(xx, w, y, num_valid_tokens=int((y != -100).sum()), impl=impl)
            else:
                out = fusedkern.linear_cross_entropy(xx, w, y, reduction=call, impl=impl)
        return out.detach()

    tile = run("chunked")

    def never(*args, **kwargs):
        raise AssertionError("the Gluon pass was asked on CPU")

    monkeypatch.setattr(dispatch, "_gluon_kernels", never)
    assert torch.equal(run("auto"), tile)


@needs_gluon
def test_kernel_module_refuses_what_it_cannot_run(monkeypatch):
    """`unsupported_reason`: dtype, rank, H % 64, contiguity, alignment, device; then the device's own rules."""
    bf = torch.bfloat16
    x, w = torch.zeros(8, 128, dtype=bf), torch.zeros(300, 128, dtype=bf)
    assert "CUDA" in g.unsupported_reason(x, w) and not g.is_supported(x, w)
    assert "bf16" in g.unsupported_reason(x.half(), w.half())
    assert "bf16" in g.unsupported_reason(x.float(), w.float())
    assert "bf16" in g.unsupported_reason(x, w.float())
    assert "multiple of 64" in g.unsupported_reason(torch.zeros(8, 96, dtype=bf), torch.zeros(300, 96, dtype=bf))
    assert "T, V > 0" in g.unsupported_reason(torch.zeros(0, 128, dtype=bf), w)
    assert "X [T, H]" in g.unsupported_reason(x[None], w)
    assert "X [T, H]" in g.unsupported_reason(x, torch.zeros(300, 64, dtype=bf))
    assert "contiguous" in g.unsupported_reason(torch.zeros(128, 8, dtype=bf).t(), w)
    shifted = torch.zeros(8 * 128 + 1, dtype=bf)[1:].view(8, 128)  # 2 bytes past a 16-byte boundary
    assert "aligned" in g.unsupported_reason(shifted, w)
    # the device: CUDA, compiled (not the interpreter), Triton 3.6, compute capability 9.0
    cuda = torch.device("cuda", 0)
    assert "CUDA" in g.device_reason(torch.device("cpu"))
    monkeypatch.setattr(g, "interpreting", lambda: True)
    assert "interpreter" in g.device_reason(cuda)
    monkeypatch.setattr(g, "interpreting", lambda: False)
    for capability, ok in (((9, 0), True), ((8, 0), False), ((8, 9), False), ((10, 0), False), ((12, 0), False)):
        monkeypatch.setattr(g, "_capability", lambda index, capability=capability: capability)
        assert (g.device_reason(cuda) is None) is ok, capability
        assert ok or "9.0" in g.device_reason(cuda)
    monkeypatch.setattr(g.triton, "__version__", "3.7.0")
    assert "3.6" in g.device_reason(cuda)


@needs_gluon
def test_launches_keep_the_partials_within_the_loss_only_budget():
    """Partials per row: the column tiles up to a power of two; tokens per launch: 12 bytes a slot within 64 MiB,
    balanced, at most chunk_tokens."""
    assert g.partial_slots(128256) == 512 and g.partial_slots(256) == 1 and g.partial_slots(257) == 2
    assert g.tokens_per_launch(4096, 128256) == 4096 and g.tokens_per_launch(8192, 128256) == 8192
    assert g.tokens_per_launch(32768, 128256) == 8192  # 10880 at most: 4 launches of 8192
    assert g.tokens_per_launch(12000, 128256) == 6000
    assert g.tokens_per_launch(300, 5000, chunk_tokens=128) == 100  # 3 launches, balanced
    # the entropy's plane: 16 bytes a slot, 8192 tokens at most at V = 128256 (10880 without)
    assert g.tokens_per_launch(10000, 128256) == 10000 and g.tokens_per_launch(10000, 128256, with_entropy=True) == 5000
    for T, V, chunk in ((1, 1, None), (5, 300, 2), (100_000, 256_000, None), (50_000, 32003, 7000)):
        for with_entropy, part_bytes in ((False, g.PART_BYTES), (True, g.PART_BYTES + g.ENTROPY_PART_BYTES)):
            C = g.tokens_per_launch(T, V, chunk, with_entropy=with_entropy)
            assert 1 <= C <= T and C * g.partial_slots(V) * part_bytes <= 64 << 20
            assert chunk is None or C <= chunk
    parts = g.empty_partials(3, 700, torch.device("cpu"))  # 3 column tiles, 4 slots: one holds no mass
    assert parts.shape == (3, 3, 4) and (parts[0, :, 3] == -math.inf).all() and (parts[1:, :, 3] == 0).all()
    assert (parts[2] == 0).all()
    parts = g.empty_partials(3, 700, torch.device("cpu"), with_entropy=True)
    assert parts.shape == (4, 3, 4) and (parts[0, :, 3] == -math.inf).all() and (parts[1:, :, 3] == 0).all()


# ------------------------------------------------------------------------------- CPU: the host side, emulated


@needs_gluon
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("T,V,chunk", [(21, 70, None), (23, 700, 8), (1, 257, None)],
                         ids=["one-tile", "3-tiles-3-launches", "one-row-one-past-a-tile"])
def test_host_side_matches_fp64(emulated_gluon, reduction, T, V, chunk):
    """loss (and lse) through the Gluon dispatch with the kernel emulated: launch chunks, unused partial slots and
    the tile pass's merge give the float64 loss to fp32 rounding."""
    x, w, y = make_inputs(T, 16, V, dtype=torch.float32)
    with torch.no_grad():
        loss, lse = fusedkern.linear_cross_entropy(x, w, y, reduction=reduction, return_lse=True, chunk_tokens=chunk)
    ref, ref_lse = reference.linear_cross_entropy_fp64(x.double(), w.double(), y, reduction=reduction, return_lse=True)
    assert emulated_gluon == ([T] if chunk is None else [8, 8, 7])
    assert rel_err(loss, ref) < 1e-6 and rel_err(lse, ref_lse) < 1e-6


@needs_gluon
def test_host_side_ignored_rows_count_and_logprobs(emulated_gluon):
    """All targets ignored (NaN mean, 0 sum, zeros), a host num_valid_tokens (only those rows launched), and
    linear_logprobs at temperature 1, which takes the same path."""
    x, w, y = make_inputs(19, 16, 300, dtype=torch.float32, ignore_frac=0.4)
    ignored = torch.full_like(y, -100)
    with torch.no_grad():
        assert torch.isnan(fusedkern.linear_cross_entropy(x, w, ignored))
        assert fusedkern.linear_cross_entropy(x, w, ignored, reduction="sum").item() == 0.0
        none, lse = fusedkern.linear_cross_entropy(x, w, ignored, reduction="none", return_lse=True)
        assert torch.equal(none, torch.zeros_like(none))
        assert rel_err(lse, reference.linear_cross_entropy_fp64(x.double(), w.double(), ignored, reduction="none",
                                                                return_lse=True)[1]) < 1e-6
        emulated_gluon.clear()
        n = int((y != -100).sum())
        for reduction in ("mean", "none"):
            counted = fusedkern.linear_cross_entropy(x, w, y, reduction=reduction, num_valid_tokens=n)
            ref = reference.linear_cross_entropy_fp64(x.double(), w.double(), y, reduction=reduction)
            assert rel_err(counted, ref) < 1e-6
        assert emulated_gluon == [n, n]
        logps = fusedkern.linear_logprobs(x, w, y)
    assert rel_err(logps, reference.linear_logprobs_fp64(x.double(), w.double(), y)) < 1e-6


@needs_gluon
@pytest.mark.parametrize("margin", [8.0, 16.0, 24.0])
def test_host_side_keeps_a_confident_loss_to_its_digits(emulated_gluon, margin):
    """The partials' format (Σ exp − 1, the max's own 1 never added) merged by the tile pass's merge: a target
    `margin` above the rest gives loss = δ ~ 1e-7 to 1e-5 relative, where lse − s_y in fp32 keeps none of it.
    All-equal logits (ties in every tile) give log V."""
    V = 700
    x = torch.ones(1, 1)
    w = torch.linspace(-1.0, 0.0, V).reshape(V, 1)
    w[V - 3] = margin  # in the last, ragged tile
    y = torch.tensor([V - 3])
    with torch.no_grad():
        loss = fusedkern.linear_cross_entropy(x, w, y, reduction="sum")
        ties, lse = fusedkern.linear_cross_entropy(x, torch.zeros(V, 1), y, reduction="sum", return_lse=True)
    ref = reference.linear_cross_entropy_fp64(x.double(), w.double(), y, reduction="sum")
    assert abs(loss.item() - ref.item()) <= 1e-5 * ref.item()
    assert abs(ties.item() - math.log(V)) <= 1e-6 and abs(lse.item() - math.log(V)) <= 1e-6


@needs_gluon
@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.6])
@pytest.mark.parametrize("count", ["dense", "host", "device"])
def test_host_side_logprobs_at_a_temperature_with_entropy(emulated_gluon, temperature, count):
    """linear_logprobs under no_grad through the Gluon dispatch, kernel emulated: the scale and the entropy's plane
    through the tile pass's merge give float64's log-probs and entropy to fp32 rounding, dense and with either count
    (a host count launches the valid rows only); without the entropy the same log-probs; with a gradient to follow
    the same pass and values."""
    x, w, y = make_inputs(23, 16, 700, dtype=torch.float32, ignore_frac=0.3)
    n = int((y != -100).sum())
    kw = {"dense": {}, "host": {"num_valid_tokens": n}, "device": {"num_valid_tokens": torch.tensor(n)}}[count]
    with torch.no_grad():
        logps, entropy = fusedkern.linear_logprobs(x, w, y, temperature=temperature, return_entropy=True,
                                                   chunk_tokens=8, **kw)
        alone = fusedkern.linear_logprobs(x, w, y, temperature=temperature, chunk_tokens=8, **kw)
    rows = n if count == "host" else 23
    C = -(-rows // -(-rows // 8))  # balanced launches of at most 8 rows, for each of the two calls
    assert emulated_gluon == [min(C, rows - r) for r in range(0, rows, C)] * 2
    ref_logps, ref_entropy = reference.linear_logprobs_entropy_fp64(x.double(), w.double(), y, temperature=temperature)
    assert rel_err(logps, ref_logps) < 1e-6 and rel_err(entropy, ref_entropy) < 1e-6
    assert rel_err(alone, ref_logps) < 1e-6
    assert torch.count_nonzero(entropy[y == -100]) == 0 and torch.count_nonzero(logps[y == -100]) == 0
    emulated_gluon.clear()
    xx = x.clone().requires_grad_()
    grad_logps, grad_entropy = fusedkern.linear_logprobs(xx, w, y, temperature=temperature, return_entropy=True,
                                                         chunk_tokens=8, **kw)
    (grad_logps.sum() + grad_entropy.sum()).backward()
    # with a gradient to follow: the same statistics pass (the backward recomputes the logits with the chunked
    # GEMMs), so the same log-probs and entropy: a policy and its reference model agree
    assert emulated_gluon == [min(C, rows - r) for r in range(0, rows, C)]
    assert torch.equal(grad_logps.detach(), logps) and torch.equal(grad_entropy.detach(), entropy)
    assert torch.isfinite(xx.grad).all()


@needs_gluon
def test_host_side_logprobs_with_stats_and_extreme_entropies(emulated_gluon):
    """linear_logprobs_with_stats (row max and lse of s/τ) through the same pass; equal logits give log V at any
    temperature, a one-hot-dominated row an entropy that keeps its relative digits (the entropy's statistic
    summed in tiles with the max's own term exactly 0)."""
    x, w, y = make_inputs(9, 16, 300, dtype=torch.float32, ignore_frac=0.0)
    with torch.no_grad():
        logps, entropy, row_max, row_lse = linear_logprobs_with_stats(x, w, y, temperature=0.5,
                                                                                return_entropy=True)
        flat = fusedkern.linear_logprobs(x, torch.zeros_like(w), y, temperature=0.3, return_entropy=True)[1]
    s = (x.double() @ w.double().t()) / 0.5
    ref_logps, ref_entropy = reference.linear_logprobs_entropy_fp64(x.double(), w.double(), y, temperature=0.5)
    assert rel_err(logps, ref_logps) < 1e-6 and rel_err(entropy, ref_entropy) < 1e-6
    assert rel_err(row_max, s.max(-1).values) < 1e-6 and rel_err(row_lse, torch.logsumexp(s, -1)) < 1e-6
    assert torch.allclose(flat.double(), torch.full((9,), math.log(300), dtype=torch.float64), rtol=1e-6)
    V = 700
    peaked = torch.linspace(-1.0, 0.0, V).reshape(V, 1)
    peaked[V - 3] = 12.0  # in the last, ragged tile
    with torch.no_grad():
        sharp = fusedkern.linear_logprobs(torch.ones(1, 1), peaked, torch.tensor([V - 3]), temperature=0.8,
                                          return_entropy=True)[1]
    expected = reference.linear_logprobs_entropy_fp64(torch.ones(1, 1, dtype=torch.float64), peaked.double(),
                                                      torch.tensor([V - 3]), temperature=0.8)[1]
    assert 0 < expected.item() < 1e-2 and abs(sharp.item() - expected.item()) <= 1e-5 * expected.item()


# -------------------------------------------------------------------------------------------- sm_90a compile


@needs_gluon
def test_kernel_compiles_for_sm90a_without_spills():
    """scripts/compile_sm90.py's Gluon cases (int64 and int32 targets, with the entropy): a cubin with no stack frame
    or spill, in H100's 227 KiB of shared memory, registers moved by setmaxnreg. ~7 s: a fresh process, compiler not
    interpreter."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "compile_sm90.py"), "--only", "gluon"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("sm_90a ok: gluon")]
    assert len(lines) == 3, done.stdout  # int64 and int32 targets, and the entropy's variant
    assert all(" stack=0 " in line and "0 bytes spill stores, 0 bytes spill loads" in line for line in lines), lines
    assert all(int(line.split(" smem=")[1].split()[0]) <= 232448 for line in lines), lines


# ----------------------------------------------------------------------------------------------------- GPU


def _loss_only(x, w, y, **kwargs):
    with torch.no_grad():
        return fusedkern.linear_cross_entropy(x, w, y, **kwargs)


def _check_loss_and_lse(x, w, y, reduction):
    """loss and lse of the no_grad call against float64, each within 2× torch's own error from the same bf16
    operands (loss: bf16 logits, fp32 softmax; lse: logsumexp of the bf16 logits in fp32)."""
    loss, lse = _loss_only(x, w, y, reduction=reduction, return_lse=True)
    ref, ref_lse = reference.linear_cross_entropy_fp64(x, w, y, reduction=reduction, return_lse=True)
    tch = torch_linear_cross_entropy(x, w, y, reduction=reduction, upcast_logits=True)
    tch_lse = torch.logsumexp(torch.nn.functional.linear(x, w).float(), dim=-1)
    _assert_fp32_within_2x_torch({"loss": (loss, ref, tch), "lse": (lse, ref_lse, tch_lse)})
    return loss, lse


def _assert_fp32_within_2x_torch(outputs: dict) -> None:
    """{name: (ours, float64 reference, torch's same-dtype result)}: fp32, within 2× torch's error (atol 1e-3)."""
    for name, (ours, ref, tch) in outputs.items():
        assert ours.dtype == torch.float32, name
        assert_close_to_ref(name, ours, ref, tch, atol=1e-3)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_gpu_loss_only_bf16_matches_fp64(monkeypatch, gluon_launches, reduction):
    """The realistic case (bf16, T = 2048, H = 1024, V = 32003: ragged last column tile), switch on: one launch of
    the Gluon kernel, loss and lse within 2× torch's bf16 error of float64; impl="chunked", impl="fused" or a
    mean/sum with a gradient (three GEMMs): never launched, and the tile pass agrees with it."""
    x, w, y = make_inputs(2048, 1024, 32003)
    loss, lse = _check_loss_and_lse(x, w, y, reduction)
    assert gluon_launches == [2048]
    tile_loss, tile_lse = _loss_only(x, w, y, reduction=reduction, return_lse=True, impl="chunked")
    _loss_only(x, w, y, reduction=reduction, impl="fused")
    fusedkern.linear_cross_entropy(x, w.clone().requires_grad_(), y, reduction=reduction)
    # a per-token loss with a gradient to follow computes its statistics on the same pass
    assert gluon_launches == ([2048, 2048] if reduction == "none" else [2048])
    # the tile pass rounds its logits to bf16, the Gluon pass keeps them in fp32: close, not equal
    assert rel_err(loss, tile_loss) < 1e-2 and rel_err(lse, tile_lse) < 1e-3


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("T,H,V", [(300, 512, 5000), (1, 64, 1000), (129, 128, 257), (5, 192, 100)],
                         ids=["ragged", "one-row", "one-past-the-tiles", "vocab-under-a-tile"])
def test_gpu_ragged_shapes(monkeypatch, gluon_launches, T, H, V):
    """T and V off the 128 × 256 tile (TMA zero-fills past them, the epilogue masks), down to one row and a
    vocabulary smaller than one tile."""
    x, w, y = make_inputs(T, H, V)
    for reduction in ("mean", "none"):
        _check_loss_and_lse(x, w, y, reduction)
    assert gluon_launches == [T, T]


@pytest.mark.gpu
@needs_sm90
def test_gpu_ignored_rows_launch_chunks_and_logprobs(monkeypatch, gluon_launches):
    """All targets ignored (NaN mean like torch, 0 sum, zero per-token loss, lse still every row's); chunk_tokens
    splits the launches; linear_logprobs at temperature 1 takes the Gluon pass too."""
    x, w, y = make_inputs(2048, 1024, 32003, ignore_frac=0.3)
    ignored = torch.full_like(y, -100)
    assert torch.isnan(_loss_only(x, w, ignored))
    assert _loss_only(x, w, ignored, reduction="sum").item() == 0.0
    none, lse = _loss_only(x, w, ignored, reduction="none", return_lse=True)
    assert torch.count_nonzero(none) == 0
    assert_close_to_ref("lse", lse, reference.linear_cross_entropy_fp64(x, w, ignored, return_lse=True)[1],
                        torch.logsumexp(torch.nn.functional.linear(x, w).float(), dim=-1), atol=1e-3)
    gluon_launches.clear()
    loss = _loss_only(x, w, y, reduction="none", chunk_tokens=1000)
    assert gluon_launches == [683, 683, 682]
    assert_close_to_ref("loss", loss, reference.linear_cross_entropy_fp64(x, w, y, reduction="none"),
                        torch_linear_cross_entropy(x, w, y, reduction="none", upcast_logits=True), atol=1e-3)
    with torch.no_grad():
        logps = fusedkern.linear_logprobs(x, w, y)
    assert len(gluon_launches) == 4
    assert_close_to_ref("logps", logps, reference.linear_logprobs_fp64(x, w, y),
                        -torch_linear_cross_entropy(x, w, y, reduction="none", upcast_logits=True), atol=1e-3)


@pytest.mark.gpu
@needs_sm90
def test_gpu_num_valid_tokens_host_int(monkeypatch, gluon_launches):
    """A host count launches the valid rows only; each row's loss is the dense call's (same K order and merge, so
    within an fp32 ulp or two), "none" puts zeros back at the ignored rows."""
    x, w, y = make_inputs(2048, 1024, 32003, ignore_frac=0.4)
    n = int((y != -100).sum())
    dense = _loss_only(x, w, y, reduction="none")
    counted = _loss_only(x, w, y, reduction="none", num_valid_tokens=n)
    mean = _loss_only(x, w, y, num_valid_tokens=n)
    assert gluon_launches == [2048, n, n]
    assert torch.allclose(counted, dense, rtol=1e-6, atol=1e-6) and torch.count_nonzero(counted[y == -100]) == 0
    assert torch.allclose(mean, dense.sum() / n, rtol=1e-6)
    assert_close_to_ref("loss", mean, reference.linear_cross_entropy_fp64(x, w, y),
                        torch_linear_cross_entropy(x, w, y, upcast_logits=True), atol=1e-3)


@pytest.mark.gpu
@needs_sm90
def test_gpu_extreme_logits(monkeypatch, gluon_launches):
    """Weights scaled up until logits reach ~±1e3: finite, and within 2× torch's bf16 error of float64."""
    x, w, y = make_inputs(512, 1024, 32003, w_scale=300.0)
    for reduction in ("sum", "none"):
        loss, lse = _check_loss_and_lse(x, w, y, reduction)
        assert torch.isfinite(loss).all() and torch.isfinite(lse).all()
    assert gluon_launches == [512, 512]


@pytest.mark.gpu
@needs_sm90
def test_gpu_confident_prediction_keeps_its_digits(monkeypatch, gluon_launches):
    """`test_gpu_confident_prediction_gradient_keeps_its_digits`' loss in bf16 (exact logits: one-hot features,
    bf16 weights): targets 8, 16, 24, 30 above the rest, δ = loss down to ~2e-9, within 1e-5 relative."""
    V, H = 32003, 64
    x = torch.zeros(4, H, device="cuda", dtype=torch.bfloat16)
    x[:, 0] = 1.0
    w = torch.zeros(V, H, device="cuda", dtype=torch.bfloat16)
    w[:, 0] = torch.linspace(-1.0, 0.0, V, device="cuda")
    y = torch.tensor([5, 17000, 30001, 123], device="cuda")
    for t, margin in enumerate([8.0, 16.0, 24.0, 30.0]):
        w[y[t], t + 1] = margin
        x[t, t + 1] = 1.0
    loss = _loss_only(x, w, y, reduction="none")
    ref = reference.linear_cross_entropy_fp64(x, w, y, reduction="none")
    assert gluon_launches == [4]
    assert ((loss.double() - ref).abs() <= 1e-5 * ref).all(), (loss, ref)


@pytest.mark.gpu
@needs_sm90
def test_gpu_every_output_is_written(monkeypatch, gluon_launches, poison_allocations):
    """Every buffer the package allocates starts as NaN (`poison_allocations`): the partials' slots the kernel owns,
    the per-token loss and the statistics must all be overwritten."""
    poison_allocations()
    x, w, y = make_inputs(300, 512, 5000)
    loss, lse = _check_loss_and_lse(x, w, y, "none")
    assert torch.isfinite(loss).all() and torch.isfinite(lse).all()
    assert gluon_launches == [300]


@pytest.mark.gpu
@needs_sm90
def test_gpu_partials_on_a_capped_grid_and_group_m(monkeypatch):
    """The kernel alone: every owned slot of NaN-poisoned partials written, the target logit written exactly where the
    target is a column; bitwise the same on 7 CTAs (each walks 8-9 tiles, every ring slot's phase wraps) and with
    GROUP_M 8 (the pending measurement's other tile order); close to the torch emulation."""
    T, H, V = 300, 512, 5000
    x, w, y = make_inputs(T, H, V)
    n = -(-V // g.BLOCK_N)
    outputs = []
    for group_m, max_ctas in ((16, 0), (16, 7), (8, 0), (8, 7)):
        parts = torch.full((3, T, g.partial_slots(V)), float("nan"), device="cuda")
        target_logit = torch.full((T,), float("nan"), device="cuda")
        g.launch_partials(x, w, y, parts, target_logit, group_m=group_m, max_ctas=max_ctas)
        torch.cuda.synchronize()
        assert torch.isfinite(parts[:2, :, :n]).all() and torch.isnan(parts[:2, :, n:]).all()
        assert torch.equal(torch.isfinite(target_logit), y != -100)
        outputs.append((parts[:2, :, :n], target_logit))
    for parts, target_logit in outputs[1:]:
        assert torch.equal(parts, outputs[0][0]) and torch.equal(target_logit.nan_to_num(), outputs[0][1].nan_to_num())
    ref = torch.zeros(3, T, g.partial_slots(V), device="cuda")
    ref_target = torch.zeros(T, device="cuda")
    emulated_partials(x, w, y, ref, ref_target)
    scale = (x.float() @ w.float().t()).abs().max().item()
    assert (outputs[0][0][0] - ref[0, :, :n]).abs().max().item() <= 1e-4 * scale + 1e-4
    assert (outputs[0][0][1] - ref[1, :, :n]).abs().max().item() <= 1e-3 * (1 + ref[1].abs().max().item())
    valid = y != -100
    assert (outputs[0][1][valid] - ref_target[valid]).abs().max().item() <= 1e-4 * scale + 1e-4


def _check_logprobs_entropy(x, w, y, temperature, **kwargs):
    """log-probs and entropy of the no_grad call against float64, each within 2× torch's own error from the same
    bf16 operands (bf16 logits, fp32 softmax at the temperature)."""
    with torch.no_grad():
        logps, entropy = fusedkern.linear_logprobs(x, w, y, temperature=temperature, return_entropy=True, **kwargs)
    ref_logps, ref_entropy = reference.linear_logprobs_entropy_fp64(x, w, y, temperature=temperature)
    tch_logps, tch_entropy = torch_logprobs_entropy(x, w, y, None, softcap=None, temperature=temperature, upcast=True)
    _assert_fp32_within_2x_torch({"logps": (logps, ref_logps, tch_logps),
                                  "entropy": (entropy, ref_entropy, tch_entropy)})
    return logps, entropy


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.5])
def test_gpu_logprobs_temperature_entropy_match_fp64(monkeypatch, gluon_launches, temperature):
    """The RL log-prob pass (bf16, T = 2048, H = 1024, V = 32003), switch on: one launch with the scale and the
    entropy's plane, log-probs and entropy within 2× torch's bf16 error of float64; with a gradient to follow, the
    same launch and the same values; impl="chunked": the tile pass, which agrees with it."""
    x, w, y = make_inputs(2048, 1024, 32003, ignore_frac=0.3)
    logps, entropy = _check_logprobs_entropy(x, w, y, temperature)
    assert gluon_launches == [2048]
    assert torch.count_nonzero(logps[y == -100]) == 0 and torch.count_nonzero(entropy[y == -100]) == 0
    with torch.no_grad():
        tile_logps, tile_entropy = fusedkern.linear_logprobs(x, w, y, temperature=temperature, return_entropy=True,
                                                             impl="chunked")
    grad_logps, grad_entropy = fusedkern.linear_logprobs(x, w.clone().requires_grad_(), y, temperature=temperature,
                                                         return_entropy=True)
    # with a gradient to follow: the same pass, the same log-probs (a policy and its reference agree)
    assert gluon_launches == [2048, 2048]
    assert torch.equal(grad_logps.detach(), logps) and torch.equal(grad_entropy.detach(), entropy)
    # the tile pass rounds its logits to bf16, the Gluon pass keeps them in fp32: close, not equal
    assert rel_err(logps, tile_logps) < 1e-2 and rel_err(entropy, tile_entropy) < 1e-2


@pytest.mark.gpu
@needs_sm90
def test_gpu_logprobs_counts_extremes_and_with_stats(monkeypatch, gluon_launches):
    """A host count (valid rows only launched) and a device count give the dense call's values; logits to ~±1e3 at
    τ 0.5 stay finite and within the 2× rule; `linear_logprobs_with_stats` (row max, lse) takes the same pass."""
    x, w, y = make_inputs(1024, 1024, 32003, ignore_frac=0.4)
    n = int((y != -100).sum())
    dense = _check_logprobs_entropy(x, w, y, 0.7)
    host = _check_logprobs_entropy(x, w, y, 0.7, num_valid_tokens=n)
    device = _check_logprobs_entropy(x, w, y, 0.7, num_valid_tokens=torch.tensor(n, device="cuda"))
    assert gluon_launches == [1024, n, 1024]
    for counted in (host, device):
        for a, b in zip(counted, dense):
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)
    big_x, big_w, big_y = make_inputs(512, 1024, 32003, w_scale=300.0)
    logps, entropy = _check_logprobs_entropy(big_x, big_w, big_y, 0.5)
    assert torch.isfinite(logps).all() and torch.isfinite(entropy).all()
    with torch.no_grad():
        s_logps, s_entropy, row_max, row_lse = linear_logprobs_with_stats(x, w, y, temperature=0.7, return_entropy=True)
    assert torch.equal(s_logps, dense[0]) and torch.equal(s_entropy, dense[1])
    # the Gluon pass keeps its logits in fp32: the reference is the exact product of the bf16 operands, not torch's
    # bf16-rounded logits (up to 0.03 apart at |s| ~ 12)
    s = (x.double() @ w.double().t()) / 0.7
    assert rel_err(row_max, s.max(-1).values) < 1e-5 and rel_err(row_lse, torch.logsumexp(s, -1)) < 1e-5


@pytest.mark.gpu
@needs_sm90
def test_gpu_entropy_plane_and_scale_leave_the_loss_partials_alone(poison_allocations):
    """The kernel alone, NaN-poisoned: with the entropy's plane every owned slot of the four planes is written, and
    planes 0-1 and the target logit are bitwise those of the entropy-free launch; at a scale the max and the target
    logit are the unscaled ones times the scale (exactly: one fp32 product) and the entropy's plane matches the torch
    emulation."""
    T, H, V = 300, 512, 5000
    x, w, y = make_inputs(T, H, V)
    n = -(-V // g.BLOCK_N)
    outputs = {}
    for planes, scale in ((3, 1.0), (4, 1.0), (4, 1 / 0.7)):
        parts = torch.full((planes, T, g.partial_slots(V)), float("nan"), device="cuda")
        target_logit = torch.full((T,), float("nan"), device="cuda")
        g.launch_partials(x, w, y, parts, target_logit, logit_scale=scale)
        torch.cuda.synchronize()
        owned = [0, 1, 3][: planes - 1]
        assert torch.isfinite(parts[owned, :, :n]).all() and torch.isnan(parts[owned, :, n:]).all()
        assert torch.equal(torch.isfinite(target_logit), y != -100)
        outputs[planes, scale] = parts, target_logit.nan_to_num()
    (p3, t3), (p4, t4), (p_scaled, t_scaled) = outputs.values()
    assert torch.equal(p3[:2, :, :n], p4[:2, :, :n]) and torch.equal(t3, t4)
    assert torch.equal(p_scaled[0, :, :n], p4[0, :, :n] * (1 / 0.7)) and torch.equal(t_scaled, t4 * (1 / 0.7))
    for (parts, _), scale in ((outputs[4, 1.0], 1.0), (outputs[4, 1 / 0.7], 1 / 0.7)):
        ref = torch.zeros(4, T, g.partial_slots(V), device="cuda")
        emulated_partials(x, w, y, ref, torch.zeros(T, device="cuda"), logit_scale=scale)
        assert (parts[3, :, :n] - ref[3, :, :n]).abs().max().item() <= 1e-3 * ref[3, :, :n].abs().max().item()


@pytest.mark.gpu
@needs_sm90
def test_gpu_mean_logits_take_the_chunked_pass(monkeypatch, gluon_launches):
    """`linear_logprobs_with_stats(return_mean_logits=True)`: the Gluon epilogue has no logits' sum, so the call runs
    the chunked pass (no launch) and its mean logit is fp64's within 2× torch's bf16 error; the same call without
    the mean takes the Gluon pass, and the two passes' log-probs agree closely."""
    x, w, y = make_inputs(2048, 1024, 32003, ignore_frac=0.3)
    with torch.no_grad():
        with_mean = linear_logprobs_with_stats(x, w, y, temperature=0.7, return_mean_logits=True)
        assert gluon_launches == []
        plain = linear_logprobs_with_stats(x, w, y, temperature=0.7)
    assert gluon_launches == [2048]
    ref = reference.mean_logits_fp64(x, w, temperature=0.7)
    tch = (torch.nn.functional.linear(x, w).float() / 0.7).mean(-1)
    _assert_fp32_within_2x_torch({"mean_logits": (with_mean[4], ref, tch)})
    assert rel_err(with_mean[0], plain[0]) < 1e-2


def test_gradient_of_confident_rows_after_the_gluon_statistics(emulated_gluon):
    """A per-token call with a gradient whose statistics came from the Gluon pass (fp32 logits) recomputes the logits
    in bf16 for its backward: rows confident in a target logit of ~100 (bf16 rounds it by up to a quarter) must still
    get p_y − 1 ≈ 0, which needs statistics of the same bf16 logits. dX and dW against fp64 within 2× torch's error."""
    x, w, y = make_inputs(24, 64, 300, seed=16, ignore_frac=0.1)
    x[:12] = x[:12] + (6.0 * w[torch.where(y[:12] != -100, y[:12], 0)].float()).to(x.dtype) * 6
    up = torch.randn(24, generator=torch.Generator().manual_seed(4))
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    (fusedkern.linear_logprobs(xl, wl, y) * up).sum().backward()
    assert emulated_gluon, "the statistics pass was not the Gluon one"
    f64 = [t.double().requires_grad_() for t in (x, w)]
    (reference.linear_logprobs_fp64(f64[0], f64[1], y) * up.double()).sum().backward()
    same = [t.clone().requires_grad_() for t in (x, w)]
    (torch_logprobs_entropy(same[0], same[1], y, None, softcap=None, temperature=1.0, upcast=True)[0] * up).sum() \
        .backward()
    assert_close_to_ref("dX", xl.grad, f64[0].grad, same[0].grad, atol=1e-3)
    assert_close_to_ref("dW", wl.grad, f64[1].grad, same[1].grad, atol=1e-3)
