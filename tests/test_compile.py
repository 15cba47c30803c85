"""torch.compile over the public functions: their kernels are custom operators (`torch.library.custom_op`,
namespace `fusedkern`) with fake implementations and autograd formulas, so that a compiled training step
traces with no graph break (`fullgraph=True`) and gives eager's loss and gradients — for every reduction,
both strategies, every loss option, `linear_logprobs` and `linear_simpo_loss` (its chunked modes and the
generic path). CPU tests: the kernels run in Triton's interpreter at tiny shapes, fp32."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

import fusedkern
from fusedkern.autograd import GradOptions, with_grads
from fusedkern.engine import LossOptions, valid_rows_first
from tests.conftest import DEVICE
from tests.test_linear_cross_entropy import IMPLS, make_inputs

lce = importlib.import_module("fusedkern.linear_cross_entropy")  # the module, not the re-exported function
chunked_mod = importlib.import_module("fusedkern.chunked")
engine = importlib.import_module("fusedkern.engine")
simpo_mod = importlib.import_module("fusedkern.simpo")
pref_mod = importlib.import_module("fusedkern.linear_preference")
grpo_mod = importlib.import_module("fusedkern.grpo")

T, H, V = 12, 16, 40
ALL_OPTIONS = dict(label_smoothing=0.2, z_loss=1e-3, softcap=4.0)


def _proj(device=DEVICE, dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Linear(H, H).to(device=device, dtype=dtype)


def _loss_and_grads(fn, proj, x, w, y, b, upstream):
    """fn(x, w, y, b)'s first output and the gradients of Σ upstream·output for proj's parameters, w and b."""
    proj.zero_grad()
    w = w.detach().clone().requires_grad_()
    b = None if b is None else b.detach().clone().requires_grad_()
    out = fn(x, w, y, b)
    loss = out[0] if isinstance(out, tuple) else out
    (loss * upstream).sum().backward()
    grads = [p.grad.clone() for p in proj.parameters()] + [w.grad] + ([] if b is None else [b.grad])
    return out, grads


def _assert_compiled_matches_eager(fn, proj, x, w, y, b, *, backend="aot_eager", upstream=0.7, rtol=1e-5, atol=1e-6):
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend, fullgraph=True)  # a graph break would raise here
    out_c, grads_c = _loss_and_grads(compiled, proj, x, w, y, b, upstream)
    out_e, grads_e = _loss_and_grads(fn, proj, x, w, y, b, upstream)
    outs_c, outs_e = (out_c, out_e) if isinstance(out_c, tuple) else ((out_c,), (out_e,))
    for oc, oe in zip(outs_c, outs_e):
        for a, e in (zip(oc.values(), oe.values()) if isinstance(oc, dict) else [(oc, oe)]):
            assert a.shape == e.shape and a.dtype == e.dtype
            assert torch.allclose(a, e, rtol=rtol, atol=atol, equal_nan=True), (a, e)
    for gc, ge in zip(grads_c, grads_e, strict=True):
        assert gc.dtype == ge.dtype and torch.allclose(gc, ge, rtol=rtol, atol=atol), (gc - ge).abs().max()


@pytest.mark.parametrize("options", ["plain", "all"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("impl", IMPLS)
def test_cross_entropy_fullgraph_matches_eager(impl, reduction, options):
    every = options == "all"
    x, w, y, b, cw = make_inputs(T, H, V, torch.float32, bias=every, weight=every, seed=1)
    proj = _proj()
    kw = dict(ALL_OPTIONS) if every else {}

    def step(x, w, y, b):
        return fusedkern.linear_cross_entropy(torch.tanh(proj(x)), w, y, linear_bias=b, weight=cw, impl=impl,
                                              reduction=reduction, **kw)
    upstream = torch.randn(T, device=x.device) if reduction == "none" else 0.7
    _assert_compiled_matches_eager(step, proj, x, w, y, b, upstream=upstream)


@pytest.mark.parametrize("impl", IMPLS)
def test_logprobs_fullgraph_matches_eager(impl):
    x, w, y, b, _ = make_inputs(T, H, V, torch.float32, bias=True, seed=2)
    proj = _proj()

    def step(x, w, y, b):
        return fusedkern.linear_logprobs(torch.tanh(proj(x)), w, y, linear_bias=b, impl=impl, softcap=4.0)
    _assert_compiled_matches_eager(step, proj, x, w, y, b, upstream=torch.randn(T, device=x.device))


# chunk_tokens with seq = 3: 12 tokens hold every pair ("pairs"), 4 hold one response ("prepass"),
# 2 hold less than a response (the generic path: linear_logprobs + autograd); "fused" is generic too
SIMPO_MODES = {"pairs": dict(), "prepass": dict(chunk_tokens=4), "generic": dict(chunk_tokens=2),
               "fused": dict(impl="fused")}


@pytest.mark.parametrize("mode", list(SIMPO_MODES))
def test_simpo_fullgraph_matches_eager(mode):
    x, w, y, b, _ = make_inputs(T, H, V, torch.float32, bias=True, seed=3)
    proj = _proj()
    two_b, seq = 4, 3
    if mode != "fused":
        assert simpo_mod.plan_for(two_b, seq, w, True, "fp32", SIMPO_MODES[mode].get("chunk_tokens"))[0] == mode

    def step(x, w, y, b):
        return fusedkern.linear_simpo_loss(torch.tanh(proj(x)).reshape(two_b, seq, H), w, y.reshape(two_b, seq),
                                           linear_bias=b, beta=2.0, gamma=0.5, **SIMPO_MODES[mode])
    _assert_compiled_matches_eager(step, proj, x, w, y, b)  # the loss and every metric


def _logits_passes(monkeypatch) -> list:
    """Records the logits elements each GEMM into the logits buffer (or a loss-only tile) forms: their sum over
    T·V is how many times the head's logits were formed (1 for three GEMMs: no logits recomputed in backward)."""
    formed = []
    real = engine.logits_into

    def counting(buf, x_c, w, b):
        z = real(buf, x_c, w, b)
        formed.append(z.numel())
        return z
    monkeypatch.setattr(engine, "logits_into", counting)
    monkeypatch.setattr(chunked_mod, "logits_into", counting)
    return formed


def _assert_three_gemms_compiled_and_eager(monkeypatch, step, proj, x, w, y, b, op_name: str, n_logits: int):
    """step's compiled (fullgraph) and eager runs match, the graph holds `op_name` and none of the generic path's
    per-token operators, and each forms the logits once: the same three GEMMs compiled and eager."""
    torch._dynamo.reset()
    explained = torch._dynamo.explain(step)(x, w.clone().requires_grad_(), y, b)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
    code = explained.graphs[0].code
    assert f"fusedkern.{op_name}" in code
    assert "fusedkern.ce_per_token" not in code and "fusedkern.logprobs_entropy" not in code
    formed = _logits_passes(monkeypatch)
    _assert_compiled_matches_eager(step, proj, x, w, y, b)  # compiled first, then eager
    assert sum(formed) == 2 * n_logits, (sum(formed), n_logits)
    formed.clear()
    _loss_and_grads(step, proj, x, w, y, b, 0.7)
    assert sum(formed) == n_logits


def test_simpo_softcap_fullgraph_three_gemms(monkeypatch):
    x, w, y, b, _ = make_inputs(T, H, V, torch.float32, bias=True, seed=13)
    proj = _proj()

    def step(x, w, y, b):
        return fusedkern.linear_simpo_loss(torch.tanh(proj(x)).reshape(4, 3, H), w, y.reshape(4, 3), linear_bias=b,
                                           beta=2.0, gamma=0.5, softcap=3.0)
    _assert_three_gemms_compiled_and_eager(monkeypatch, step, proj, x, w, y, b, "simpo_chunked", T * V)


def _preference_extra(loss_type: str, n_rows: int) -> dict:
    g = torch.Generator().manual_seed(14)
    if loss_type == "kto":
        return dict(ref_logps=-10 * torch.rand(n_rows, generator=g), kto_labels=torch.arange(n_rows) % 2 == 0,
                    kl=torch.tensor([0.3]))
    if loss_type in ("sigmoid", "ipo", "hinge", "robust"):
        return dict(ref_chosen_logps=-10 * torch.rand(n_rows // 2, generator=g),
                    ref_rejected_logps=-10 * torch.rand(n_rows // 2, generator=g))
    return {}


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "orpo", "kto"])
@pytest.mark.parametrize("softcap", [None, 3.0], ids=["plain", "softcap"])
def test_preference_fullgraph_three_gemms(monkeypatch, loss_type, softcap):
    """DPO's family, ORPO and KTO compile to their operator: the gradient formed in the forward pass, as eager,
    the loss and every metric eager's."""
    x, w, y, b, _ = make_inputs(T, H, V, torch.float32, bias=True, seed=15)
    rows, seq = (6, 2) if loss_type == "kto" else (4, 3)
    extra = {k: v.to(DEVICE) for k, v in _preference_extra(loss_type, rows).items()}
    proj = _proj()

    def step(x, w, y, b):
        return fusedkern.linear_preference_loss(torch.tanh(proj(x)).reshape(rows, seq, H), w, y.reshape(rows, seq),
                                                linear_bias=b, loss_type=loss_type, beta=0.5, softcap=softcap,
                                                chunk_tokens=2 * seq, **extra)
    _assert_three_gemms_compiled_and_eager(monkeypatch, step, proj, x, w, y, b, "preference_chunked", T * V)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_grpo_fullgraph_three_gemms(monkeypatch, loss_type):
    """GRPO at a temperature with a softcap, the entropy, old and reference log-probs, a tensor
    num_items_in_batch (dapo): compiled to its operator, eager's loss, metrics and gradients."""
    x, w, y, b, _ = make_inputs(T, H, V, torch.float32, bias=True, seed=16)
    g = torch.Generator().manual_seed(17)
    adv = torch.randn(3, generator=g).to(DEVICE)
    old, ref = (-4 * torch.rand(3, 4, generator=g)).to(DEVICE), (-4 * torch.rand(3, 4, generator=g)).to(DEVICE)
    n_items = torch.tensor(7.0, device=DEVICE)
    proj = _proj()

    def step(x, w, y, b):
        return fusedkern.linear_grpo_loss(
            torch.tanh(proj(x)).reshape(3, 4, H), w, y.reshape(3, 4), linear_bias=b, advantages=adv, old_logps=old,
            ref_logps=ref, beta=0.04, loss_type=loss_type, temperature=0.8, softcap=3.0, compute_entropy=True,
            num_items_in_batch=n_items if loss_type == "dapo" else None, chunk_tokens=4)
    _assert_three_gemms_compiled_and_eager(monkeypatch, step, proj, x, w, y, b, "grpo_chunked", T * V)


@pytest.mark.parametrize("on_device", [False, True], ids=["int", "tensor"])
def test_num_valid_tokens_under_compile(on_device):
    x, w, y, _, _ = make_inputs(T, H, V, torch.float32, ignore_frac=0.0, seed=4)
    y[2:6] = -100
    n = (y != -100).sum() if on_device else int((y != -100).sum())
    proj = _proj()

    def step(x, w, y, b):  # with a device count: the row-count kernels (chunked, mean, no bias gradient)
        return fusedkern.linear_cross_entropy(torch.tanh(proj(x)), w, y, num_valid_tokens=n, chunk_tokens=4)
    _assert_compiled_matches_eager(step, proj, x, w, y, None)


def test_return_lse_no_grad_and_autocast_under_compile():
    x, w, y, b, _ = make_inputs(T, H, V, torch.float32, bias=True, seed=5)
    proj = _proj()

    def with_lse(x, w, y, b):
        loss, lse = fusedkern.linear_cross_entropy(torch.tanh(proj(x)), w, y, linear_bias=b, return_lse=True)
        return loss + 0.1 * lse.sum()
    _assert_compiled_matches_eager(with_lse, proj, x, w, y, b)

    def under_autocast(x, w, y, b):
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            return fusedkern.linear_cross_entropy(torch.tanh(proj(x)), w, y, linear_bias=b)
    _assert_compiled_matches_eager(under_autocast, proj, x, w, y, b)

    torch._dynamo.reset()
    with torch.no_grad():  # the loss-only pass
        loss_only = torch.compile(lambda x: fusedkern.linear_cross_entropy(x, w, y, linear_bias=b), fullgraph=True,
                                  backend="aot_eager")(x)
        assert torch.allclose(loss_only, fusedkern.linear_cross_entropy(x, w, y, linear_bias=b), rtol=1e-6)


def test_one_graph_with_the_operators_in_it():
    x, w, y, _, _ = make_inputs(T, H, V, torch.float32, seed=6)
    proj = _proj()

    def step(x, w, y):
        ce = fusedkern.linear_cross_entropy(torch.tanh(proj(x)), w, y)
        logps = fusedkern.linear_logprobs(torch.tanh(proj(x)), w, y, impl="fused")
        simpo, _ = fusedkern.linear_simpo_loss(torch.tanh(proj(x)).reshape(4, 3, H), w, y.reshape(4, 3))
        return ce + logps.sum() + simpo
    torch._dynamo.reset()
    explained = torch._dynamo.explain(step)(x, w.clone().requires_grad_(), y)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
    code = explained.graphs[0].code
    for op in ("ce_chunked_scalar", "logprobs_entropy", "simpo_chunked"):
        assert f"fusedkern.{op}" in code
        # they read host flags behind an event: CUDA graphs (mode="reduce-overhead") must leave them out
        assert torch.Tag.cudagraph_unsafe in getattr(torch.ops.fusedkern, op).default.tags


def test_dynamic_shapes_recompile_once_and_match():
    w = make_inputs(T, H, V, torch.float32, seed=7)[1]
    proj = _proj()

    def step(x, w, y, b):
        return fusedkern.linear_cross_entropy(torch.tanh(proj(x)), w, y, label_smoothing=0.1)
    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    for tokens in (12, 7):  # the second call recompiles with a symbolic token count
        x, _, y, _, _ = make_inputs(tokens, H, V, torch.float32, seed=tokens)
        out_c, grads_c = _loss_and_grads(compiled, proj, x, w, y, None, 1.0)
        out_e, grads_e = _loss_and_grads(step, proj, x, w, y, None, 1.0)
        assert torch.allclose(out_c, out_e, rtol=1e-6)
        assert all(torch.allclose(a, e, rtol=1e-5, atol=1e-6) for a, e in zip(grads_c, grads_e))


def test_inductor_matches_eager():
    """Inductor (C++ on CPU) compiles everything around the operators; one case, the step with every option."""
    x, w, y, b, cw = make_inputs(T, H, V, torch.float32, bias=True, weight=True, seed=8)
    proj = _proj()

    def step(x, w, y, b):
        return fusedkern.linear_cross_entropy(torch.tanh(proj(x)), w, y, linear_bias=b, weight=cw, **ALL_OPTIONS)
    _assert_compiled_matches_eager(step, proj, x, w, y, b, backend="inductor", rtol=1e-4, atol=1e-5)


def test_bad_targets_and_counts_raise_under_compile():
    """The device-side checks run inside the operators, in the compiled graph too."""
    x, w, y, _, _ = make_inputs(T, H, V, torch.float32, seed=9)
    wl = w.clone().requires_grad_()
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, w, y, n: fusedkern.linear_cross_entropy(x, w, y, num_valid_tokens=n),
                             backend="aot_eager", fullgraph=True)
    bad = y.clone()
    bad[3] = V + 2
    with pytest.raises(ValueError, match=f"found {V + 2}"):
        compiled(x, wl, bad, None)
    with pytest.raises(ValueError, match="num_valid_tokens"):
        compiled(x, wl, y, (y != -100).sum() + 1)


def test_eager_rescales_in_place_and_compiled_graph_does_not(monkeypatch):
    """Eager keeps the in-place rescale of the saved gradients (no copy of dW, skipped when the upstream
    gradient is 1); the compiled backward multiplies out of place, as a traced graph must."""
    x, w, y, _, _ = make_inputs(T, H, V, torch.float32, seed=10)
    calls = []
    import fusedkern.autograd

    real = fusedkern.autograd.scale_unless_one_
    monkeypatch.setattr(fusedkern.autograd, "scale_unless_one_", lambda t, s: calls.append(t.shape) or real(t, s))
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    fusedkern.linear_cross_entropy(xl, wl, y).backward()
    assert len(calls) == 2  # dX and dW
    calls.clear()
    torch._dynamo.reset()
    xc, wc = x.clone().requires_grad_(), w.clone().requires_grad_()
    torch.compile(fusedkern.linear_cross_entropy, backend="aot_eager", fullgraph=True)(xc, wc, y).backward()
    assert calls == [] and torch.allclose(xc.grad, xl.grad) and torch.allclose(wc.grad, wl.grad)


def _opcheck_cases():
    """{case: (operator, its flat arguments)}: each operator called as the library calls it, `op(*tensors,
    options)`, flattened into the registered operator's arguments (`autograd.Op.flat_args`)."""
    x, w, y, b, cw = make_inputs(T, H, V, torch.float32, bias=True, weight=True, seed=11)
    xh, wh = x.half(), w.half()
    loss = LossOptions(-100, 0.1, 1e-3, 4.0)
    rows_first = valid_rows_first(y, -100)
    n = (y != -100).sum()

    def scalar(reduction, chunk_tokens, need_db, return_dw_out, skip_ignored=False, count_int=-1):
        grads = GradOptions("fp32", chunk_tokens, True, True, need_db, return_dw_out)
        return lce.ChunkedScalarOptions(loss, reduction, grads, skip_ignored, count_int)

    def per_token(impl):
        return lce.PerTokenOptions(loss, impl, GradOptions("fp32", None), None)

    every_grad = GradOptions("fp32", None, True, True, True, True)

    stats = lce.ce_per_token(x, w, b, y, cw, None, None, per_token("chunked"))[1]
    simpo_x = x.reshape(4, 3, H)
    simpo = simpo_mod.SimPOOptions(-100, 2.0, 0.5, 1.0, 0.0, None, every_grad)
    extra = _preference_extra("sigmoid", 4)
    dpo = pref_mod.PreferenceOptions("sigmoid", 0.5, False, 1.0, 1.0, 0.0, 0.5, 0.0, -100, 3.0,
                                     dataclasses.replace(every_grad, chunk_tokens=6))
    kto_extra = _preference_extra("kto", 6)
    kto = dataclasses.replace(dpo, loss_type="kto", softcap=None, grads=dataclasses.replace(every_grad, chunk_tokens=2))
    g = torch.Generator().manual_seed(18)
    grpo = grpo_mod.GRPOOptions("dapo", 0.04, 0.2, 0.28, None, None, -100, 3.0, 1.25, True,
                                dataclasses.replace(every_grad, chunk_tokens=4))
    grpo_tensors = (torch.randn(3, generator=g), -4 * torch.rand(3, 4, generator=g),
                    -4 * torch.rand(3, 4, generator=g), torch.tensor(7.0))
    cases = {
        "chunked_scalar": (lce.ce_chunked_scalar, (x, w, b, y, cw, None, None, None, scalar("mean", None, True, True))),
        # fp16 in 4-token chunks: an fp32 dW accumulator, the logits buffer inside dW's storage (dw_out, whose
        # scratch content is no output to compare: the compiled path does not ask for it)
        "chunked_scalar_accumulator": (lce.ce_chunked_scalar, (xh, wh, None, y, None, None, None, None,
                                                               scalar("sum", 4, False, False, count_int=int(n)))),
        "chunked_scalar_counted": (lce.ce_chunked_scalar, (x[rows_first], w, None, y[rows_first], None, None, n, None,
                                                           scalar("mean", 4, False, True, skip_ignored=True))),
        "per_token_chunked": (lce.ce_per_token, (x, w, b, y, cw, None, n, per_token("chunked"))),
        "per_token_fused": (lce.ce_per_token, (x, w, b, y, cw, None, None, per_token("fused"))),
        "per_token_backward": (lce.ce_per_token_backward, (x, w, b, y, cw, stats, torch.randn(T, device=x.device),
                                                           with_grads(per_token("chunked"), True, True, True))),
        "simpo_chunked": (simpo_mod.simpo_chunked, (simpo_x, w, b, y.reshape(4, 3), simpo)),
        "simpo_chunked_softcap": (simpo_mod.simpo_chunked, (simpo_x, w, b, y.reshape(4, 3),
                                                            dataclasses.replace(simpo, softcap=3.0))),
        "preference_dpo": (pref_mod.preference_chunked, (simpo_x, w, b, y.reshape(4, 3), extra["ref_chosen_logps"],
                                                         extra["ref_rejected_logps"], None, None, None, dpo)),
        "preference_kto": (pref_mod.preference_chunked, (x.reshape(6, 2, H), w, b, y.reshape(6, 2), None, None,
                                                         *kto_extra.values(), kto)),
        "grpo": (grpo_mod.grpo_chunked, (x.reshape(3, 4, H), w, b, y.reshape(3, 4), *grpo_tensors, grpo)),
    }
    return {case: (op, op.flat_args(*args)) for case, (op, args) in cases.items()}


# the cases the end-to-end tests above compile already skip opcheck's slowest part (AOT dispatch)
FAKE_ONLY = {"chunked_scalar_accumulator", "chunked_scalar_counted", "per_token_chunked", "simpo_chunked_softcap",
             "preference_kto"}


@pytest.mark.parametrize("case", list(_opcheck_cases()))
def test_opcheck(case):
    """torch.library.opcheck: schema, autograd registration, fake tensors vs real outputs, AOT dispatch."""
    op, args = _opcheck_cases()[case]
    if op is not lce.ce_per_token_backward:  # x, w, b ask for gradients (the backward has none of its own)
        args = tuple(a.detach().clone().requires_grad_() if i < 3 and a is not None else a for i, a in enumerate(args))
    if case == "chunked_scalar_accumulator":
        assert lce.plan_for_grads(T, args[1], True, "fp32", 4).fp32_accumulator
    utils = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(op.custom_op, args,
                          test_utils=utils if case in FAKE_ONLY else (*utils, "test_aot_dispatch_dynamic"))


# ---------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_gpu_bf16_inductor_fullgraph_matches_eager(impl, reduction):
    """A bf16 step with every option, compiled by inductor with fullgraph=True: eager's loss and gradients
    (up to the rounding of inductor's own fused kernels around the operators)."""
    Tg, Hg, Vg = 1024, 256, 4099
    x, w, y, b, cw = make_inputs(Tg, Hg, Vg, torch.bfloat16, bias=True, weight=True, device="cuda", seed=12)
    torch.manual_seed(0)
    proj = torch.nn.Linear(Hg, Hg).to(device="cuda", dtype=torch.bfloat16)

    def step(x, w, y, b):
        return fusedkern.linear_cross_entropy(torch.tanh(proj(x)), w, y, linear_bias=b, weight=cw, impl=impl,
                                              reduction=reduction, chunk_tokens=256, **ALL_OPTIONS)
    upstream = torch.randn(Tg, device="cuda") if reduction == "none" else 0.7
    torch._dynamo.reset()
    explained = torch._dynamo.explain(step)(x, w, y, b)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    out_c, grads_c = _loss_and_grads(compiled, proj, x, w, y, b, upstream)
    out_e, grads_e = _loss_and_grads(step, proj, x, w, y, b, upstream)
    assert torch.allclose(out_c, out_e, rtol=2e-2, atol=2e-2)
    for gc, ge in zip(grads_c, grads_e, strict=True):
        assert gc.dtype == ge.dtype == torch.bfloat16
        assert (gc.float() - ge.float()).norm() <= 3e-2 * ge.float().norm(), (gc.float() - ge.float()).norm()
