"""fusedkern.anticipated: per-token log-probs whose forward forms the gradient of an anticipated upstream (SFT's
nll and DFT patterns). Against `linear_logprobs_with_stats` + autograd (fp32: equal outputs, gradients to fp32
rounding) and against the fp64 reference under the 2× rule of tests/_accuracy.py (bf16), for the anticipated
upstream at any scale (0 and negative included), an arbitrary upstream (the whole gradient recomputed), a mixed
one (the pattern plus a perturbation on a few rows: only those rows recomputed), ignored rows, an entropy gradient;
the device-side split of the upstream; and the GEMMs a step costs: three per chunk when the anticipation holds.
CPU: the kernels run in Triton's interpreter at tiny odd shapes."""

from __future__ import annotations

import math

import pytest
import torch

import fusedkern.anticipated as anticipated
from fusedkern import reference
from fusedkern.anticipated import linear_logprobs_anticipated, split_upstream
from fusedkern.logprobs import linear_logprobs_with_stats
from tests._accuracy import assert_close_to_ref, torch_logprobs_entropy
from tests.conftest import DEVICE

T, H, V = 13, 16, 83  # V > 64: two slices per row in the interpreter
CHUNK = 5  # three chunks, the last one short
PERTURBED = [4, 10]  # the rows a mixed upstream moves off the pattern


def make_inputs(dtype, *, bias=False, ignored=(2, 7), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) / math.sqrt(H) * 2).to(dtype)
    y = torch.randint(0, V, (T,), generator=g)
    y[list(ignored)] = -100
    b = (torch.randn(V, generator=g) * 0.5).to(dtype) if bias else None
    move = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    return move(x), move(w), move(y), move(b)


def pattern_of(kind: str, logp: torch.Tensor) -> torch.Tensor:
    """The upstream a loss of that kind sends per unit of its scalar: nll −1, dft −exp(logp) (detached)."""
    return -torch.ones_like(logp) if kind == "nll" else -logp.detach().exp()


def upstream(kind: str, which: str, logp: torch.Tensor, scale: float = 0.37) -> torch.Tensor:
    """The upstream gradient of the log-probs in each test case (computed from the returned log-probs, as a loss
    would): `pattern` s·a, `random` anything, `mixed` s·a plus a perturbation on PERTURBED."""
    if which == "pattern":
        return scale * pattern_of(kind, logp)
    if which == "random":
        return torch.randn(logp.shape, generator=torch.Generator().manual_seed(5), dtype=logp.dtype).to(logp.device)
    bump = torch.zeros_like(logp)
    bump[PERTURBED] = torch.tensor([0.5, -0.8], device=logp.device)
    return scale * pattern_of(kind, logp) + bump


def run(fn, inputs, kind, which, *, scale=0.37, entropy_weight=None, **kw):
    x, w, y, b = inputs
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in (x, w, b)]
    out = fn(leaves[0], leaves[1], y, linear_bias=leaves[2], return_entropy=True, chunk_tokens=CHUNK, **kw)
    logp, entropy = out[0], out[1]
    loss = (logp * upstream(kind, which, logp, scale)).sum()
    if entropy_weight is not None:
        loss = loss + (entropy * entropy_weight).sum()
    loss.backward()
    return [t.detach() for t in (out[0], out[1], out[2], out[3])], [None if t is None else t.grad for t in leaves]


CASES = {  # name: (bias, softcap, temperature)
    "plain": (False, None, 1.0),
    "bias_softcap_temperature": (True, 3.0, 0.7),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("which,scale", [("pattern", 0.37), ("pattern", -2.5), ("pattern", 0.0), ("random", 1.0),
                                         ("mixed", 1.3)])
@pytest.mark.parametrize("kind", ["nll", "dft"])
def test_matches_logprobs_with_stats_fp32(kind, which, scale, case):
    bias, softcap, tau = CASES[case]
    inputs = make_inputs(torch.float32, bias=bias, seed=len(case))
    kw = dict(softcap=softcap, temperature=tau)
    got, got_grads = run(linear_logprobs_anticipated, inputs, kind, which, scale=scale, anticipate=kind, **kw)
    want, want_grads = run(linear_logprobs_with_stats, inputs, kind, which, scale=scale, **kw)
    for name, a, b in zip(("logp", "entropy", "row_max", "row_lse"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)
    assert torch.all(got[0][inputs[2] == -100] == 0)
    for name, a, b in zip(("dX", "dW", "db"), got_grads, want_grads):
        if b is None:
            assert a is None
            continue
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("kind", ["nll", "dft"])
def test_entropy_gradient_and_a_missing_logprob_gradient(kind):
    """An entropy bonus is not anticipated: its rows are recomputed with both upstreams (the whole gradient)."""
    inputs = make_inputs(torch.float32, bias=True)
    weight = torch.linspace(-1, 1, T, device=DEVICE)
    got = run(linear_logprobs_anticipated, inputs, kind, "pattern", entropy_weight=weight, anticipate=kind)
    want = run(linear_logprobs_with_stats, inputs, kind, "pattern", entropy_weight=weight)
    for a, b in zip(got[1], want[1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # the entropy alone (the log-probs reach no loss): their gradient arrives as None
    x, w, y, b = inputs
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
    _, entropy, _, _ = linear_logprobs_anticipated(leaves[0], leaves[1], y, linear_bias=leaves[2], return_entropy=True,
                                                   anticipate=kind, chunk_tokens=CHUNK)
    (entropy * weight).sum().backward()
    ref = [t.detach().clone().requires_grad_() for t in (x, w, b)]
    _, entropy_ref, _, _ = linear_logprobs_with_stats(ref[0], ref[1], y, linear_bias=ref[2], return_entropy=True,
                                                      chunk_tokens=CHUNK)
    (entropy_ref * weight).sum().backward()
    for a, b in zip(leaves, ref):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("which", ["pattern", "random", "mixed"])
@pytest.mark.parametrize("kind", ["nll", "dft"])
@pytest.mark.parametrize("chunk_tokens", [CHUNK, None], ids=["fp32_accumulator", "one_chunk"])
def test_bf16_matches_fp64_within_twice_torch(kind, which, chunk_tokens):
    """bf16: chunks of 5 put dW in the fp32 accumulator (the logits buffer in dW's own storage), one chunk writes
    dW directly; both against fp64 at 2× torch's own bf16 error (logits in bf16, the rest in fp32)."""
    dtype = torch.bfloat16
    x, w, y, b = make_inputs(dtype, bias=True, seed=3)
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
    logp, entropy, _, _ = linear_logprobs_anticipated(leaves[0], leaves[1], y, linear_bias=leaves[2],
                                                      return_entropy=True, anticipate=kind, chunk_tokens=chunk_tokens)
    up = upstream(kind, which, logp)  # from fusedkern's own log-probs: each computation gets the same upstream
    (logp * up).sum().backward()
    f64 = [t.detach().double().requires_grad_() for t in (x, w, b)]
    ref_logp, ref_entropy = reference.linear_logprobs_entropy_fp64(f64[0], f64[1], y, linear_bias=f64[2])
    (ref_logp * up.double()).sum().backward()
    same = [t.detach().clone().requires_grad_() for t in (x, w, b)]
    tch_logp, tch_entropy = torch_logprobs_entropy(same[0], same[1], y, same[2], softcap=None, temperature=1.0,
                                                   upcast=True)
    (tch_logp * up).sum().backward()
    assert_close_to_ref("logp", logp, ref_logp, tch_logp.detach(), atol=1e-3)
    assert_close_to_ref("entropy", entropy, ref_entropy, tch_entropy.detach(), atol=1e-3)
    for name, got, ref, tch in zip(("dX", "dW", "db"), leaves, f64, same):
        assert got.grad.dtype == dtype
        assert_close_to_ref(name, got.grad, ref.grad, tch.grad, atol=1e-3)


def test_split_upstream_on_the_device():
    """The residual rows are exactly those off the pattern; an upstream that fits no scale recomputes every row
    with a gradient; an NaN upstream is a residual row."""
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(T, generator=g) * 5
    valid = torch.ones(T, dtype=torch.bool)
    valid[[2, 7]] = False
    for kind in ("nll", "dft"):
        a = torch.where(valid, pattern_of(kind, logp), 0.0)
        for scale in (0.37, -2.5, 0.0, 1 / 4093):
            split = split_upstream(torch.where(valid, scale * pattern_of(kind, logp), 0.0), a, valid)
            assert split.count.item() == 0 and split.s.item() == pytest.approx(scale, rel=1e-6)
        mixed = scale * pattern_of(kind, logp)
        mixed[PERTURBED] += 0.25
        split = split_upstream(mixed, a, valid)
        assert split.count.item() == len(PERTURBED)
        assert sorted(split.order[:len(PERTURBED)].tolist()) == PERTURBED
        arbitrary = torch.randn(T, generator=g)
        split = split_upstream(arbitrary, a, valid)
        assert split.s.item() == 0 and split.count.item() == int(valid.sum())
        assert torch.all(split.factor == 1)
        bad = 0.37 * pattern_of(kind, logp)
        bad[5] = float("nan")
        assert split_upstream(bad, a, valid).count.item() == 1


@pytest.fixture
def gemm_calls(monkeypatch):
    """Every cuBLAS-path GEMM (torch.mm, torch.addmm, Tensor.addmm_) and every row-count GEMM's count of rows."""
    calls = {"cublas": 0, "rows": []}
    for owner, name in ((torch, "mm"), (torch, "addmm"), (torch.Tensor, "addmm_")):
        real = getattr(owner, name)

        def counted(*args, _real=real, **kwargs):
            calls["cublas"] += 1
            return _real(*args, **kwargs)
        monkeypatch.setattr(owner, name, counted)
    import fusedkern.compacted as compacted
    for module, name in ((compacted, "logits_rows"), (anticipated, "dw_rows"), (anticipated, "dx_rows")):
        real = getattr(module, name)

        def rows(*args, _real=real, _name=name, **kwargs):
            calls["rows"].append((_name, int(args[3 if _name == "logits_rows" else 2].item())))
            return _real(*args, **kwargs)
        monkeypatch.setattr(module, name, rows)
    return calls


@pytest.mark.parametrize("kind", ["nll", "dft"])
def test_three_gemms_per_chunk_when_the_anticipation_holds(kind, gemm_calls):
    inputs = make_inputs(torch.float32)
    n_chunks = math.ceil(T / CHUNK)
    run(linear_logprobs_anticipated, inputs, kind, "pattern", anticipate=kind)
    assert gemm_calls["cublas"] == 3 * n_chunks
    assert gemm_calls["rows"] and all(n == 0 for _, n in gemm_calls["rows"])  # launched, no rows to compute
    gemm_calls["cublas"], gemm_calls["rows"] = 0, []
    run(linear_logprobs_with_stats, inputs, kind, "pattern")
    assert gemm_calls["cublas"] == 4 * n_chunks  # the per-token head: the logits recomputed in backward
    gemm_calls["cublas"], gemm_calls["rows"] = 0, []
    run(linear_logprobs_anticipated, inputs, kind, "mixed", anticipate=kind)
    assert gemm_calls["cublas"] == 3 * n_chunks
    logits_rows = [n for name, n in gemm_calls["rows"] if name == "logits_rows"]
    assert logits_rows == [min(len(PERTURBED), CHUNK), 0, 0]  # the perturbed rows, sorted into the first chunk


def test_no_grad_is_the_reference_path_and_one_backward_only():
    x, w, y, _ = make_inputs(torch.float32)
    with torch.no_grad():
        got = linear_logprobs_anticipated(x, w, y, return_entropy=True)
        want = linear_logprobs_with_stats(x, w, y, return_entropy=True)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    xl = x.clone().requires_grad_()
    logp = linear_logprobs_anticipated(xl, w, y)[0]
    logp.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward"):
        logp.sum().backward()
    with pytest.raises(ValueError, match="anticipate"):
        linear_logprobs_anticipated(xl, w, y, anticipate="kl")


@pytest.mark.parametrize("frozen", ["weight", "input"])
def test_one_side_frozen(frozen):
    """A frozen head (PEFT's adapters on the body) or frozen activations: only the other gradient is formed."""
    x, w, y, _ = make_inputs(torch.float32)
    grads = []
    for fn, kw in ((linear_logprobs_anticipated, dict(anticipate="nll")), (linear_logprobs_with_stats, {})):
        xl = x.clone().requires_grad_(frozen != "input")
        wl = w.clone().requires_grad_(frozen != "weight")
        logp = fn(xl, wl, y, chunk_tokens=CHUNK, **kw)[0]
        (upstream("nll", "mixed", logp)).mul(logp).sum().backward()
        grads.append(xl.grad if frozen == "weight" else wl.grad)
        assert (wl.grad if frozen == "weight" else xl.grad) is None
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-6)


def test_all_rows_ignored():
    x, w, y, b = make_inputs(torch.float32, bias=True, ignored=range(T))
    got = run(linear_logprobs_anticipated, (x, w, y, b), "dft", "random", anticipate="dft")
    want = run(linear_logprobs_with_stats, (x, w, y, b), "dft", "random")
    assert torch.all(got[0][0] == 0)
    for a, b_ in zip(got[1], want[1]):
        assert torch.all(a == 0) and torch.all(b_ == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("count", [0, 3, T])
def test_counted_gather_and_scatter(count, dtype):
    """kernels/counted_rows.py: only the first `count` rows move; the scatter's factor is applied in fp32 and
    rounded once."""
    from fusedkern.kernels.counted_rows import gather_rows, scatter_rows

    g = torch.Generator().manual_seed(count)
    src = torch.randn(T, H, generator=g).to(dtype).to(DEVICE)
    index = torch.randperm(T, generator=g).to(DEVICE)
    n = torch.tensor([count], dtype=torch.int32, device=DEVICE)
    out = gather_rows(src, index, n, torch.full_like(src, 7.0))
    assert torch.equal(out[:count], src[index[:count]]) and torch.all(out[count:] == 7)
    factor = torch.rand(T, generator=g).to(DEVICE) + 0.5
    back = scatter_rows(out, index, n, torch.full_like(src, 7.0), factor)
    moved = index[:count]
    assert torch.equal(back[moved], (out[:count].float() * factor[:count, None]).to(dtype))
    untouched = torch.ones(T, dtype=torch.bool, device=DEVICE)
    untouched[moved] = False
    assert torch.all(back[untouched] == 7)
