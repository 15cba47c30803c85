"""fusedkern.linear_cross_entropy against the fp64 reference, for every option, both strategies,
losses and gradients. On CPU the kernels run in Triton's interpreter at tiny shapes (fp32/fp16: bf16
`tl.dot` is broken there); the `gpu` tests repeat the checks in bf16 at realistic shapes."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fusedkern
from fusedkern import reference
from fusedkern.chunked import LossOptions, chunked_loss, lse_of
from tests._accuracy import assert_close_to_ref, rel_err, torch_linear_cross_entropy
from tests.conftest import DEVICE, run_twice_second_without_sync

HAS_FUSED = importlib.util.find_spec("fusedkern.kernels.fused_ce") is not None
IMPLS = ["chunked"] + (["fused"] if HAS_FUSED else [])
ATOL = {torch.float32: 1e-6, torch.float16: 1e-4, torch.bfloat16: 1e-3}

OPTION_SETS = {
    "plain": {},
    "bias": {"bias": True},
    "weight": {"weight": True},
    "smoothing": {"label_smoothing": 0.1},
    "z_loss": {"z_loss": 1e-2},
    "softcap": {"softcap": 2.5},
    "all": {"bias": True, "weight": True, "label_smoothing": 0.2, "z_loss": 1e-3, "softcap": 4.0},
}


def make_inputs(T, H, V, dtype, *, ignore_frac=0.2, scale=1.0, bias=False, weight=False, device=DEVICE, seed=None,
                lead_shape=None):
    g = torch.Generator().manual_seed(seed if seed is not None else torch.randint(0, 2**31, ()).item())
    x = (torch.randn(T, H, generator=g) * scale).to(dtype)
    w = (torch.randn(V, H, generator=g) / math.sqrt(H) * 2).to(dtype)
    y = torch.randint(0, V, (T,), generator=g)
    y[torch.rand(T, generator=g) < ignore_frac] = -100
    b = (torch.randn(V, generator=g) * 0.5).to(dtype) if bias else None
    cw = (torch.rand(V, generator=g) + 0.5) if weight else None
    if lead_shape is not None:
        x, y = x.reshape(*lead_shape, H), y.reshape(lead_shape)
    move = lambda t: None if t is None else t.to(device)
    return move(x), move(w), move(y), move(b), move(cw)


def check_against_reference(x, w, y, b, cw, *, reduction="mean", impl="chunked", upstream=None, floors=None,
                            **opts):
    """Loss, dX, dW, db of fusedkern vs fp64 truth, with torch's same-dtype error as the yardstick (floors: a
    gradient's name → the lowest yardstick, `_accuracy.few_roundings_floors`)."""
    impl_kw = {k: opts.pop(k) for k in ("chunk_tokens", "weight_grad_accum") if k in opts}
    leaves = [t.detach().clone().requires_grad_() for t in (x, w)] + ([b.detach().clone().requires_grad_()] if b is not None else [])
    loss = fusedkern.linear_cross_entropy(leaves[0], leaves[1], y, linear_bias=leaves[2] if b is not None else None,
                                          weight=cw, reduction=reduction, impl=impl, **impl_kw, **opts)
    f64 = [t.detach().double().requires_grad_() for t in leaves]
    ref = reference.linear_cross_entropy_fp64(f64[0], f64[1], y, linear_bias=f64[2] if b is not None else None,
                                              weight=None if cw is None else cw.double(), reduction=reduction, **opts)
    same = [t.detach().clone().requires_grad_() for t in leaves]
    tch = torch_linear_cross_entropy(same[0], same[1], y, b=same[2] if b is not None else None, weight=cw,
                                     reduction=reduction, **opts)
    if upstream is None:
        upstream = torch.randn(loss.shape, dtype=torch.float64, device=x.device) if reduction == "none" \
            else torch.tensor(1.7, dtype=torch.float64, device=x.device)
    atol = ATOL[x.dtype]
    with torch.no_grad():  # the loss's yardstick: half-precision logits, fp32 softmax (the loss is fp32)
        tch_loss = torch_linear_cross_entropy(x, w, y, b=b, weight=cw, reduction=reduction, upcast_logits=True, **opts)
    assert loss.dtype == torch.float32
    assert_close_to_ref("loss", loss, ref, tch_loss, atol=atol)
    if torch.isnan(ref).all():  # all targets ignored with "mean": NaN like torch; gradients are zero
        assert torch.isnan(loss).all()
        upstream = torch.ones_like(upstream)
        ref = torch.zeros_like(ref, requires_grad=True) if not ref.requires_grad else ref
    grads = torch.autograd.grad(loss, leaves, upstream.to(loss.dtype))
    grads_tch = torch.autograd.grad(tch, same, upstream.to(tch.dtype))
    if torch.isnan(ref).all():
        for g in grads:
            assert torch.count_nonzero(g) == 0
        return
    grads_ref = torch.autograd.grad(ref, f64, upstream)
    for name, g, gr, gt, leaf in zip(("dX", "dW", "db"), grads, grads_ref, grads_tch, leaves):
        assert g.dtype == leaf.dtype, (name, g.dtype, leaf.dtype)
        assert torch.isfinite(g).all(), f"{name} has non-finite values"
        assert_close_to_ref(name, g, gr, gt, atol=atol, floor=(floors or {}).get(name, 0.0))


# every option × every reduction in fp32 for the chunked strategy; fp16 and the fused strategy on the
# plain and all-options sets (the fused kernels' own option matrix is in tests/test_fused_ce.py)
OPTION_CASES = [("chunked", torch.float32, r, o) for o in OPTION_SETS for r in ("mean", "sum", "none")]
OPTION_CASES += [("chunked", torch.float16, r, o) for o in ("plain", "all") for r in ("mean", "none")]
OPTION_CASES += [(impl, dt, r, o) for impl in IMPLS[1:] for dt in (torch.float32, torch.float16)
                 for o in ("plain", "all") for r in ("mean", "none")]
OPTION_CASES += [(impl, torch.float32, "sum", o) for impl in IMPLS[1:] for o in ("plain", "all")]


@pytest.mark.parametrize("impl,dtype,reduction,options", OPTION_CASES,
                         ids=[f"{i}-{str(d)[6:]}-{r}-{o}" for i, d, r, o in OPTION_CASES])
def test_every_option_matches_fp64(impl, dtype, reduction, options):
    opts = dict(OPTION_SETS[options])
    x, w, y, b, cw = make_inputs(23, 29, 131, dtype, bias=opts.pop("bias", False), weight=opts.pop("weight", False))
    chunk = {"chunk_tokens": 16} if impl == "chunked" else {}
    check_against_reference(x, w, y, b, cw, reduction=reduction, impl=impl, **chunk, **opts)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", ["single_token_1d", "leading_3d", "all_ignored", "none_ignored", "large_logits",
                                  "non_contiguous", "prime_shapes", "int32_targets"])
def test_odd_cases(impl, case):
    dtype = torch.float32
    if case == "single_token_1d":
        x, w, y, b, cw = make_inputs(1, 7, 13, dtype, ignore_frac=0.0)
        x, y = x[0], y[0]
    elif case == "leading_3d":
        x, w, y, b, cw = make_inputs(12, 16, 70, dtype, lead_shape=(3, 4))
    elif case == "all_ignored":
        x, w, y, b, cw = make_inputs(9, 16, 70, dtype, ignore_frac=1.1)
    elif case == "none_ignored":
        x, w, y, b, cw = make_inputs(9, 16, 70, dtype, ignore_frac=0.0)
    elif case == "large_logits":  # |z| ~ 1e3: the online max must keep exp() finite
        x, w, y, b, cw = make_inputs(9, 16, 70, dtype, scale=300.0)
    elif case == "non_contiguous":
        x, w, y, b, cw = make_inputs(10, 16, 70, dtype)
        x = torch.cat([x, x], dim=1)[:, ::2]  # stride 2 along hidden
        w = w.t().contiguous().t()  # column-major weight
    elif case == "int32_targets":  # accepted like int64 (F.cross_entropy takes int64 only)
        x, w, y, b, cw = make_inputs(17, 16, 70, dtype, bias=True)
        y = y.to(torch.int32)
    else:
        x, w, y, b, cw = make_inputs(23, 31, 127, dtype, bias=True)
    for reduction in ("mean", "none"):
        check_against_reference(x, w, y, b, cw, reduction=reduction, impl=impl)


# derandomize + a drawn seed: the same examples on every run (CI cannot flake) and any failure
# reproduces from its printed arguments. A free seed found (1 in ~150 at T = 1, H = 1, V = 2) inputs
# whose single dX element is an ill-conditioned two-term sum, where torch's own error is sometimes
# lucky and a 2× bound on one element is a coin toss for any implementation.
@settings(max_examples=16, deadline=None, derandomize=True)
@given(T=st.integers(1, 33), H=st.integers(1, 40), V=st.integers(2, 150), fp16=st.booleans(),
       ignore_frac=st.sampled_from([0.0, 0.3, 1.1]), smoothing=st.sampled_from([0.0, 0.15]),
       z_loss=st.sampled_from([0.0, 1e-2]), softcap=st.sampled_from([None, 3.0]), bias=st.booleans(),
       weight=st.booleans(), reduction=st.sampled_from(["mean", "sum", "none"]), chunk=st.sampled_from([None, 8]),
       impl=st.sampled_from(IMPLS), accum=st.sampled_from(["fp32", "weight_dtype"]), lead=st.booleans(),
       int32=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_random_shapes_and_options(T, H, V, fp16, ignore_frac, smoothing, z_loss, softcap, bias, weight, reduction, chunk,
                                   impl, accum, lead, int32, seed):
    dtype = torch.float16 if fp16 else torch.float32
    torch.manual_seed(seed)  # the upstream gradient of reduction="none"
    lead_shape = (1, T) if lead else None  # a [B, S, H] input
    x, w, y, b, cw = make_inputs(T, H, V, dtype, ignore_frac=ignore_frac, bias=bias, weight=weight, seed=seed,
                                 lead_shape=lead_shape)
    check_against_reference(x, w, y.to(torch.int32) if int32 else y, b, cw, reduction=reduction, impl=impl,
                            label_smoothing=smoothing, z_loss=z_loss, softcap=softcap, chunk_tokens=chunk,
                            weight_grad_accum=accum)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("accum", ["fp32", "weight_dtype"])
def test_weight_grad_accumulation_modes(accum, reduction):
    """Both dW accumulations over 5 chunks, with each reduction: the scalar ones form the gradient in
    the forward, "none" in a backward that recomputes the logits."""
    x, w, y, b, cw = make_inputs(40, 24, 90, torch.float16, bias=True)
    check_against_reference(x, w, y, b, cw, reduction=reduction, weight_grad_accum=accum, chunk_tokens=8)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("which", ["input", "weight", "bias"])
def test_only_some_inputs_require_grad(impl, which):
    x, w, y, b, _ = make_inputs(11, 16, 50, torch.float32, bias=True)
    x.requires_grad_(which == "input"); w.requires_grad_(which == "weight"); b.requires_grad_(which == "bias")
    loss = fusedkern.linear_cross_entropy(x, w, y, linear_bias=b, impl=impl)
    loss.backward()
    f64 = [t.detach().double().requires_grad_(t.requires_grad) for t in (x, w, b)]
    reference.linear_cross_entropy_fp64(f64[0], f64[1], y, linear_bias=f64[2]).backward()
    same = [t.detach().clone().requires_grad_(t.requires_grad) for t in (x, w, b)]
    torch_linear_cross_entropy(same[0], same[1], y, b=same[2]).backward()
    for name, t, r, tch in zip(("dX", "dW", "db"), (x, w, b), f64, same):
        assert (t.grad is None) == (not t.requires_grad)
        if t.grad is not None:
            assert_close_to_ref(name, t.grad, r.grad, tch.grad, atol=ATOL[torch.float32])


@pytest.mark.parametrize("impl", IMPLS)
def test_no_grad_gives_the_same_loss_and_lse(impl):
    x, w, y, b, _ = make_inputs(20, 16, 64, torch.float32, bias=True)
    xg = x.clone().requires_grad_()
    with torch.no_grad():
        loss, lse = fusedkern.linear_cross_entropy(xg, w, y, linear_bias=b, return_lse=True, impl=impl)
    assert loss.grad_fn is None
    ref, ref_lse = reference.linear_cross_entropy_fp64(x, w, y, linear_bias=b, return_lse=True)
    assert rel_err(loss, ref) < 1e-6 and rel_err(lse, ref_lse) < 1e-6
    loss_g, lse_g = fusedkern.linear_cross_entropy(xg, w, y, linear_bias=b, return_lse=True, impl=impl)
    assert torch.allclose(loss, loss_g.detach(), rtol=1e-6) and torch.allclose(lse, lse_g, rtol=1e-6)
    assert not lse_g.requires_grad


@pytest.mark.parametrize("dtype,chunk", [(torch.float32, 8), (torch.float16, 8), (torch.float16, 32)],
                         ids=["fp32", "fp16-buffer-in-dW-storage", "fp16-buffer-beside-accumulator"])
def test_every_output_element_is_written(poison_allocations, dtype, chunk):
    """Poison every buffer the package allocates; a missed store would surface as NaN. fp16 with
    chunk ≤ H puts the logits buffer inside dW's storage (the fp32 accumulator is cast over it)."""
    poison_allocations()
    for reduction in ("mean", "none"):
        x, w, y, b, cw = make_inputs(19 if chunk < 19 else 45, 17, 67, dtype, bias=True, weight=True)
        check_against_reference(x, w, y, b, cw, reduction=reduction, chunk_tokens=chunk, label_smoothing=0.1)
    with torch.no_grad():  # the loss-only forward's vocabulary tiles (merged partial statistics)
        x, w, y, b, cw = make_inputs(19, 17, 67, dtype, bias=True, weight=True)
        loss, stats = chunked_loss(x, w, b, y, cw, LossOptions(label_smoothing=0.1), tile=(8, 16))
        ref = reference.linear_cross_entropy_fp64(x.double(), w.double(), y, linear_bias=b.double(),
                                                  weight=cw.double(), reduction="none", label_smoothing=0.1)
        assert torch.isfinite(stats).all() and rel_err(loss, ref) < (1e-6 if dtype == torch.float32 else 2e-3)


@pytest.mark.parametrize("options", ["plain", "all"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_loss_does_not_race_with_the_in_place_gradient(monkeypatch, options, reduction):
    """The row kernel's finish pass runs SPLIT programs per row, each overwriting its slice of the
    logits with ∂L/∂z. On the GPU they run concurrently, so the program that writes the loss may find
    the target's column already holding a gradient (seen on the H200: a loss 1.0 off, right gradients,
    `probe_overlap.jsonl`). The interpreter runs them in order and cannot race: here the target columns
    are overwritten between the statistics and the finish launches, as a racing program would; the
    loss must not change."""
    from fusedkern.kernels import ce_rows as rows_mod
    real_finish = rows_mod._launch_finish

    def finish_after_a_racing_program(logits, target, *args, **kw):
        if logits is not None and kw["grad"] is not None and kw["compute_stats"]:
            rows = torch.nonzero((target >= 0) & (target < logits.shape[1])).flatten()
            logits[rows, target[rows]] = 1e3
        return real_finish(logits, target, *args, **kw)

    monkeypatch.setattr(rows_mod, "_launch_finish", finish_after_a_racing_program)
    opts = dict(OPTION_SETS[options])
    x, w, y, b, cw = make_inputs(21, 16, 70, torch.float32, bias=opts.pop("bias", False),
                                 weight=opts.pop("weight", False))
    loss = fusedkern.linear_cross_entropy(x.clone().requires_grad_(), w.clone().requires_grad_(), y, linear_bias=b,
                                          weight=cw, reduction=reduction, chunk_tokens=8, **opts)
    ref = reference.linear_cross_entropy_fp64(x.double(), w.double(), y, linear_bias=None if b is None else b.double(),
                                              weight=None if cw is None else cw.double(), reduction=reduction, **opts)
    assert rel_err(loss, ref) < 1e-5


@pytest.mark.parametrize("options", list(OPTION_SETS))
@pytest.mark.parametrize("tile", [(8, 16), (23, 64), (5, 130)], ids=["5-tiles", "one-chunk", "whole-rows"])
def test_loss_only_vocabulary_tiles_match_fp64(options, tile):
    """Loss-only forward over [C, Vs] tiles (V = 131: the last slice is 3 columns wide): per-token loss
    and lse from partial statistics merged across slices, every option."""
    opts = dict(OPTION_SETS[options])
    x, w, y, b, cw = make_inputs(23, 29, 131, torch.float32, bias=opts.pop("bias", False),
                                 weight=opts.pop("weight", False))
    loss, stats = chunked_loss(x, w, b, y, cw, LossOptions(**opts), tile=tile)
    ref, ref_lse = reference.linear_cross_entropy_fp64(
        x.double(), w.double(), y, linear_bias=None if b is None else b.double(),
        weight=None if cw is None else cw.double(), reduction="none", return_lse=True, **opts)
    assert rel_err(loss, ref) < 1e-6 and rel_err(lse_of(stats), ref_lse) < 1e-6


def test_module_matches_function_and_double_backward_is_refused():
    x, w, y, _, _ = make_inputs(10, 16, 40, torch.float32)
    x.requires_grad_()
    module = fusedkern.LinearCrossEntropyLoss(label_smoothing=0.1, z_loss=1e-3)
    assert "label_smoothing=0.1" in repr(module)
    loss = module(x, w, y)
    assert torch.equal(loss, fusedkern.linear_cross_entropy(x, w, y, label_smoothing=0.1, z_loss=1e-3))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward"):
        loss.backward()


def test_works_under_torch_compile():
    """A compiled model that calls the op: one graph, no break (`fullgraph=True`; the kernels are custom
    operators), gradients as in eager. tests/test_compile.py covers every path and option."""
    torch._dynamo.reset()
    x, w, y, _, _ = make_inputs(12, 16, 40, torch.float32)
    proj = torch.nn.Linear(16, 16).to(x.device)

    def model(x, w, y):
        return fusedkern.linear_cross_entropy(torch.tanh(proj(x)), w, y, label_smoothing=0.05)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    wc = w.clone().requires_grad_()
    loss_c = compiled(x, wc, y)
    loss_c.backward()
    grads_c = [p.grad.clone() for p in proj.parameters()] + [wc.grad]
    proj.zero_grad()
    we = w.clone().requires_grad_()
    loss_e = model(x, we, y)
    loss_e.backward()
    grads_e = [p.grad for p in proj.parameters()] + [we.grad]
    assert torch.allclose(loss_c, loss_e)
    for gc, ge in zip(grads_c, grads_e):
        assert torch.allclose(gc, ge, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("options", ["plain", "all"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_gpu_bf16_realistic(impl, options, reduction):
    opts = dict(OPTION_SETS[options])
    x, w, y, b, cw = make_inputs(2048, 1024, 32003, torch.bfloat16, bias=opts.pop("bias", False),
                                 weight=opts.pop("weight", False), device="cuda", seed=1)
    check_against_reference(x, w, y, b, cw, reduction=reduction, impl=impl, **opts)


@pytest.mark.gpu
def test_gpu_loss_does_not_race_beside_another_stream(monkeypatch):
    """`test_loss_does_not_race_with_the_in_place_gradient` where the race happened: on the GPU, with a
    GEMM on a second stream making the row kernel's scheduling irregular (how `probe_overlap.py` caught
    it). The forward + backward's loss and the tile pass's loss-only pass round the same bf16 logits, so a raced
    row (its loss off by about a logit) would show as a gap of ~1/T in the mean; rounding alone is ~1e-7. (The
    anchored and Gluon passes, impl="auto"'s on sm_90, keep their logits in fp32: a systematic 1e-5 from the bf16
    rounding here, so both calls are pinned to the chunked strategy, whose in-place gradient this is about.)"""
    x, w, y, _, _ = make_inputs(8192, 1024, 32768, torch.bfloat16, ignore_frac=0.0, device="cuda", seed=3)
    side = torch.cuda.Stream()
    busy = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        loss_only = fusedkern.linear_cross_entropy(x, w, y, chunk_tokens=2048, impl="chunked")  # no in-place gradient
    gaps = []
    for _ in range(20):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(4):
                torch.mm(busy, busy)
        loss = fusedkern.linear_cross_entropy(x, w.clone().requires_grad_(), y, chunk_tokens=2048, impl="chunked")
        gaps.append((loss - loss_only).abs().item())
    torch.cuda.synchronize()
    assert max(gaps) < 1e-5, gaps


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [None, 2048], ids=["one-chunk", "buffer-in-dW-storage"])
def test_gpu_default_plan_bf16(chunk):
    """The default mode's two plans at H = 4096: one chunk without accumulator, and 8 chunks whose
    logits buffer lives inside dW's storage while the fp32 accumulator collects dW."""
    T = 8192 if chunk is None else 16384
    x, w, y, b, cw = make_inputs(T, 4096, 32003, torch.bfloat16, device="cuda", seed=3)
    check_against_reference(x, w, y, b, cw, chunk_tokens=chunk)


@pytest.mark.gpu
@pytest.mark.parametrize("accum", ["fp32", "weight_dtype"])
def test_gpu_chunked_step_never_waits_for_the_gpu(accum):
    """A forward + backward of the chunked strategy calls no synchronizing CUDA operation (PyTorch's
    sync debug mode raises on `.item()`, `bool(tensor)`, blocking copies): the target range check is
    read behind an event (`TargetRangeCheck`), the rescale by ∂L/∂loss is decided on the device.
    Four chunks, so the chunk loop and the dW accumulation run too."""
    x, w, y, _, _ = make_inputs(2048, 256, 4099, torch.bfloat16, device="cuda", seed=5)
    x.requires_grad_(); w.requires_grad_()

    def step():
        x.grad = w.grad = None
        fusedkern.linear_cross_entropy(x, w, y, weight_grad_accum=accum, chunk_tokens=512).backward()

    run_twice_second_without_sync(step)
    assert torch.isfinite(w.grad).all()


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["chunked", "auto"])
def test_gpu_row_kernels_compile_once_across_token_counts(impl):
    """A training loop whose micro-batches score a different number of tokens each (GRPO's) compiles the row kernels
    once, not once per residue of the token count: their per-row vectors are rows of [2, T] buffers, whose alignment
    follows T, and a specialization on it recompiled them for 0.2–0.5 s in timed GRPO steps on an H100. So do the
    row-count GEMMs, whose last chunk holds any count, and the Gluon producer (tests/test_compiled_once.py checks
    every kernel's compile key on the CPU)."""
    from fusedkern.kernels import anchored_rows, ce_rows, rowcount_gemm

    kernels = [ce_rows._row_stats_kernel.fn, ce_rows._row_finish_kernel.fn, anchored_rows._finish_rows_kernel,
               rowcount_gemm._logits_kernel, rowcount_gemm._dx_kernel, rowcount_gemm._dw_kernel]
    if impl == "auto" and torch.cuda.get_device_capability() == (9, 0):  # the anchored pass's Gluon producer
        from fusedkern.kernels import gluon_anchored_exp
        kernels.append(gluon_anchored_exp._anchored_exp_kernel)

    def compiled() -> int:
        return sum(len(cache[0]) for kernel in kernels for cache in kernel.device_caches.values())

    def step(T):
        x, w, y, _, _ = make_inputs(T, 256, 4099, torch.bfloat16, device="cuda", seed=T)
        x.requires_grad_(), w.requires_grad_()
        logp = fusedkern.linear_logprobs(x, w, y, impl=impl, temperature=0.7)
        logp.sum().backward()
        y[::3] = -100  # the row-count GEMMs: a device count over the valid rows sorted first
        fusedkern.linear_cross_entropy(x, w, y, impl=impl, reduction="sum", num_valid_tokens=(y != -100).sum(),
                                       chunk_tokens=512).backward()
        torch.cuda.synchronize()

    for _ in range(2):  # every specialization the path needs at an aligned count, the autotuning, dX's tile pair
        step(1024)
    before = compiled()
    for T in (1025, 1026, 1027, 1029, 1030):
        step(T)
    assert compiled() == before, f"{compiled() - before} recompilations of the row kernels across token counts"


@pytest.mark.parametrize("weight_grad_accum, chunk_tokens", [("weight_dtype", 8), ("fp32", 8), ("fp32", None)])
@pytest.mark.parametrize("loss", ["cross_entropy", "simpo"])
def test_chunked_grads_become_dot_grad_without_a_copy(monkeypatch, loss, weight_grad_accum, chunk_tokens):
    """The gradients formed in the forward pass are handed to autograd as the only reference, so `.grad`
    is the op's own buffer: a copy would add a whole [V, H] dW to the peak (found on the H200: +1 GiB)."""
    from fusedkern.engine import Grads

    formed = []
    allocate = Grads.allocate

    def recording(*args, **kwargs):
        grads = allocate(*args, **kwargs)
        formed.extend(t.data_ptr() for t in grads.as_tuple() if t is not None)
        return grads

    monkeypatch.setattr(Grads, "allocate", recording)
    H, V = 16, 40
    x = torch.randn(4, 8, H, dtype=torch.float16, device=DEVICE).requires_grad_()
    w = (torch.randn(V, H, device=DEVICE) / 4).to(torch.float16).requires_grad_()
    y = torch.randint(0, V, (4, 8), device=DEVICE)
    opts = dict(weight_grad_accum=weight_grad_accum, chunk_tokens=chunk_tokens)
    if loss == "simpo":
        fusedkern.linear_simpo_loss(x, w, y, impl="chunked", **opts)[0].backward()
    else:
        fusedkern.linear_cross_entropy(x, w, y, impl="chunked", **opts).backward()
    assert w.grad.data_ptr() in formed and x.grad.data_ptr() in formed


@pytest.mark.gpu
@pytest.mark.parametrize("impl, budget_mib", [("fused", 16), ("chunked", 256)])
def test_gpu_extra_memory_within_budget(impl, budget_mib):
    """Peak allocation of forward+backward above the inputs and the gradients' own storage, at the
    benchmark's shape: the fused strategy within 16 MiB, lean chunked within 256 MiB."""
    T, H, V = 4096, 4096, 128256
    x, w, y, _, _ = make_inputs(T, H, V, torch.bfloat16, device="cuda", seed=4)
    x.requires_grad_(); w.requires_grad_()
    # a first call autotunes the Triton kernels, whose benchmarking allocates scratch (an L2-flush
    # buffer, restore copies of in-place arguments): the benchmark measures after warm-up too
    fusedkern.linear_cross_entropy(x, w, y, impl=impl, weight_grad_accum="weight_dtype").backward()
    x.grad = w.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fusedkern.linear_cross_entropy(x, w, y, impl=impl, weight_grad_accum="weight_dtype").backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before - x.grad.nbytes - w.grad.nbytes
    assert extra <= budget_mib * 2**20, f"{impl}: {extra / 2**20:.2f} MiB extra > {budget_mib} MiB"


@pytest.mark.gpu
@pytest.mark.parametrize("accum", ["fp32", "weight_dtype"])
def test_gpu_weight_grad_precision_many_tokens(accum):
    """32768 tokens in 1024-token chunks (32 accumulations): fp32 accumulation must stay within 2×
    torch's own bf16 error. The lean mode rounds the running dW to bf16 once per chunk, so its error
    grows with the chunk count: bounded here at 4× torch's error (the H200 measured 2.8× at the
    benchmark shape, 4.67e-3 against 1.70e-3 in `accuracy_final.csv`); its dX is unaffected (2×)."""
    x, w, y, b, cw = make_inputs(32768, 512, 32003, torch.bfloat16, device="cuda", seed=2)
    if accum == "fp32":
        check_against_reference(x, w, y, b, cw, weight_grad_accum=accum, chunk_tokens=1024)
        return
    leaves = [t.clone().requires_grad_() for t in (x, w)]
    fusedkern.linear_cross_entropy(*leaves, y, weight_grad_accum=accum, chunk_tokens=1024).backward()
    f64 = [t.double().requires_grad_() for t in (x, w)]
    reference.linear_cross_entropy_fp64(*f64, y).backward()
    same = [t.clone().requires_grad_() for t in (x, w)]
    torch_linear_cross_entropy(*same, y).backward()
    dx_err, dw_err = rel_err(leaves[0].grad, f64[0].grad), rel_err(leaves[1].grad, f64[1].grad)
    dx_torch, dw_torch = rel_err(same[0].grad, f64[0].grad), rel_err(same[1].grad, f64[1].grad)
    print(f"lean: dX rel err {dx_err:.3e} (torch {dx_torch:.3e}), dW {dw_err:.3e} (torch {dw_torch:.3e}, "
          f"{dw_err / dw_torch:.2f}×)")
    assert dx_err <= 2.0 * dx_torch + ATOL[torch.bfloat16]
    assert dw_err <= 4.0 * dw_torch, f"lean dW error {dw_err:.3e} > 4× torch's {dw_torch:.3e}"


def _confident_loss(x, w, y, impl, path):
    """Σ over tokens of the per-token loss through one public path (sum, none, or −log-probs)."""
    if path == "sum":
        return fusedkern.linear_cross_entropy(x, w, y, reduction="sum", impl=impl)
    if path == "none":
        return fusedkern.linear_cross_entropy(x, w, y, reduction="none", impl=impl).sum()
    return -fusedkern.linear_logprobs(x, w, y, impl=impl).sum()


@pytest.mark.parametrize("path", ["sum", "none", "logprobs"])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("V", [17, 131], ids=["one-slice", "two-slices"])  # the interpreter splits rows when V > 64
@pytest.mark.parametrize("margin", [4.0, 12.0, 20.0])
def test_confident_prediction_gradient_keeps_its_digits(margin, V, impl, path):
    """A target logit `margin` above the rest: p_y = 1 − δ with δ down to ~1e-8. The target's
    gradient p_y − 1 = −δ and the loss ≈ δ must keep fp32's relative precision: the row kernel and the
    fused forward carry Σexp − 1 (not Σexp ≈ 1, where δ would keep ~log10(1/δ) fewer digits), and
    p_y − 1 is formed with expm1. Every strategy, through the scalar, per-token and log-prob paths."""
    x = torch.ones(1, 1, dtype=torch.float32)
    w = torch.linspace(-1.0, 0.0, V).reshape(V, 1)
    w[V - 3] = margin  # in the second slice when there are two
    y = torch.tensor([V - 3])
    w_leaf = w.clone().requires_grad_()
    loss = _confident_loss(x, w_leaf, y, impl, path)
    loss.backward()
    w64 = w.double().requires_grad_()
    loss64 = reference.linear_cross_entropy_fp64(x.double(), w64, y, reduction="sum")
    loss64.backward()
    delta = -w64.grad[V - 3, 0].item()  # 1 − p_y
    assert 0 < delta < 1
    assert abs(w_leaf.grad[V - 3, 0].item() + delta) <= 1e-5 * delta  # ~100 ulp of δ, vs ~δ⁻¹·ulp(1) naively
    torch.testing.assert_close(w_leaf.grad.double(), w64.grad, rtol=1e-5, atol=0)
    assert abs(loss.item() - loss64.item()) <= 1e-5 * loss64.item()  # the loss ≈ δ too, not lse − z_y rounded


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["chunked", "fused"])
def test_gpu_confident_prediction_gradient_keeps_its_digits(impl):
    """The same on the GPU with the compiled kernels at a real vocabulary: four tokens whose target
    sits 8, 16, 24, 30 above the other logits (in [−1, 0]): δ = 1 − p_y from ~0.9 down to ~2e-9, which
    p_y − 1 formed naively in fp32 rounds to 0. fp32 operands (exact logits)."""
    V, H = 32003, 64
    x = torch.zeros(4, H, device="cuda")
    x[:, 0] = 1.0
    w = torch.zeros(V, H, device="cuda")
    w[:, 0] = torch.linspace(-1.0, 0.0, V, device="cuda")
    y = torch.tensor([5, 17000, 30001, 123], device="cuda")
    for t, margin in enumerate([8.0, 16.0, 24.0, 30.0]):
        w[y[t], t + 1] = margin  # token t's target column alone gets `margin` from its own feature
        x[t, t + 1] = 1.0
    w_leaf = w.clone().requires_grad_()
    loss = fusedkern.linear_cross_entropy(x, w_leaf, y, reduction="sum", impl=impl)
    loss.backward()
    w64 = w.double().requires_grad_()
    loss64 = reference.linear_cross_entropy_fp64(x.double(), w64, y, reduction="sum")
    loss64.backward()
    delta = -w64.grad[y, torch.arange(1, 5, device="cuda")]  # 1 − p_y of each token, from its own feature
    got = -w_leaf.grad[y, torch.arange(1, 5, device="cuda")].double()
    assert (delta > 0).all() and (delta < 1).all()
    assert ((got - delta).abs() <= 1e-5 * delta).all(), (got, delta)
    assert abs(loss.item() - loss64.item()) <= 1e-5 * loss64.item()


@pytest.mark.parametrize("loss", ["cross_entropy", "simpo"])
def test_backward_fills_no_zero_gradients(loss):
    """The operators return their precomputed gradients as non-differentiable outputs; autograd must not
    hand the backward zero-filled gradients of them (a transient dX + dW: +1 GiB on the H200 at the
    benchmark shape). The only fill in the backward is autograd's own scalar ∂loss/∂loss = 1."""
    from torch.profiler import ProfilerActivity, profile

    H, V = 16, 40
    x = torch.randn(4, 8, H, dtype=torch.float16, device=DEVICE).requires_grad_()
    w = (torch.randn(V, H, device=DEVICE) / 4).to(torch.float16).requires_grad_()
    y = torch.randint(0, V, (4, 8), device=DEVICE)
    if loss == "simpo":
        out = fusedkern.linear_simpo_loss(x, w, y, impl="chunked")[0]
    else:
        out = fusedkern.linear_cross_entropy(x, w, y, impl="chunked")
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        out.backward()
    fills = [(e.key, e.input_shapes) for e in prof.key_averages(group_by_input_shape=True)
             if e.key in ("aten::zeros", "aten::zeros_like", "aten::fill_", "aten::zero_")
             and any(len(shape) > 0 for shape in e.input_shapes if isinstance(shape, list))]
    assert not fills, f"backward filled tensors: {fills}"
    assert w.grad is not None and x.grad is not None
