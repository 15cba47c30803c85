"""linear_distillation_loss against the fp64 materialized reference (`reference.linear_distillation_loss_fp64`):
loss and the student's dX/dW/db under the 2× rule of tests/_accuracy.py (yardstick: PyTorch's materialized
computation on logits in the inputs' dtype upcast to fp32, TRL's `generalized_jsd_loss` formula) for every β
convention, temperature, reduction, the hard-label mix, bias, no target, and each dtype; extreme logits,
ignored and all-ignored rows, the count forms, poisoned allocations, no teacher gradient, bad inputs.
CPU: Triton's interpreter at tiny odd shapes (V = 67 is two 32-column blocks and a tail)."""

from __future__ import annotations

import math

import pytest
import torch

import fusedkern
from fusedkern import reference
from tests._accuracy import assert_close_to_ref
from tests.conftest import DEVICE

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

T, HS, HT, V = 9, 16, 12, 67
ATOL = {torch.float32: 1e-6, torch.bfloat16: 1e-4, torch.float16: 1e-5}


def make_batch(dtype, *, seed=0, bias=True, logit_scale=1.0, ignored=(2, 5)):
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(T, HS, generator=g) * logit_scale
    ws = torch.randn(V, HS, generator=g) / math.sqrt(HS) * 2
    xt = torch.randn(T, HT, generator=g) * logit_scale
    wt = torch.randn(V, HT, generator=g) / math.sqrt(HT) * 2
    bs = torch.randn(V, generator=g) * 0.5 if bias else None
    bt = torch.randn(V, generator=g) * 0.5 if bias else None
    y = torch.randint(0, V, (T,), generator=g)
    y[list(ignored)] = -100
    cast = lambda t: None if t is None else t.to(dtype).to(DEVICE)  # noqa: E731
    return cast(xs), cast(ws), cast(bs), cast(xt), cast(wt), cast(bt), y.to(DEVICE)


def leaves(*ts, dtype=None):
    return [None if t is None else t.detach().to(dtype or t.dtype).clone().requires_grad_() for t in ts]


def check_against_fp64(dtype, *, seed=0, bias=True, with_target=True, logit_scale=1.0, ignored=(2, 5),
                       chunk_tokens=4, **options):
    xs, ws, bs, xt, wt, bt, y = make_batch(dtype, seed=seed, bias=bias, logit_scale=logit_scale, ignored=ignored)
    y = y if with_target else None
    reduction = options.get("reduction", "mean")
    upstream = torch.randn(T, generator=torch.Generator().manual_seed(seed + 7)) if reduction == "none" \
        else torch.tensor(1.7)
    ours = leaves(xs, ws, bs)
    loss = fusedkern.linear_distillation_loss(ours[0], ours[1], xt, wt, y, student_bias=ours[2], teacher_bias=bt,
                                              chunk_tokens=chunk_tokens, **options)
    assert loss.dtype == torch.float32
    f64 = leaves(xs, ws, bs, dtype=torch.float64)
    loss64 = reference.linear_distillation_loss_fp64(f64[0], f64[1], xt, wt, y, student_bias=f64[2], teacher_bias=bt,
                                                     **options)
    same = leaves(xs, ws, bs)
    loss_torch = reference.upcast_linear_distillation_loss(same[0], same[1], xt, wt, y, student_bias=same[2],
                                                           teacher_bias=bt, **options)
    atol = ATOL[dtype]
    assert_close_to_ref("loss", loss, loss64, loss_torch, atol=atol)
    grads = [torch.autograd.grad(out, [t for t in ts if t is not None], upstream.to(out.dtype).to(DEVICE)
                                 if reduction == "none" else upstream.to(out.dtype))
             for out, ts in ((loss, ours), (loss64, f64), (loss_torch, same))]
    names = ["dX", "dW", "db"][:len(grads[0])]
    for name, g, g64, gt in zip(names, *grads):
        assert g.dtype == xs.dtype
        assert_close_to_ref(name, g, g64, gt, atol=atol)
    return loss, grads[0]


F32_CASES = [
    dict(beta=0.0), dict(beta=1.0), dict(beta=0.5), dict(beta=0.2, temperature=2.0), dict(beta=0.0, temperature=0.5),
    dict(beta=1.0, temperature=3.0), dict(beta=0.5, reduction="sum"), dict(beta=0.0, reduction="none"),
    dict(beta=1.0, reduction="none"), dict(beta=0.7, reduction="none", temperature=1.5),
    dict(beta=0.5, weight_hard_loss=0.5, weight_soft_loss=0.5), dict(beta=0.0, weight_hard_loss=1.0, temperature=2.0),
    dict(beta=1.0, weight_hard_loss=0.3, reduction="sum"), dict(beta=0.5, weight_hard_loss=0.4, reduction="none"),
    dict(beta=0.5, weight_soft_loss=0.0, weight_hard_loss=1.0),
    dict(beta=0.5, student_softcap=3.0, teacher_softcap=2.5, weight_hard_loss=0.3, temperature=1.5),
    dict(beta=0.0, student_logit_scale=0.7, teacher_logit_scale=1.6, student_softcap=4.0),
    dict(beta=1.0, teacher_softcap=2.0, student_logit_scale=1.3, reduction="none"),
]


@pytest.mark.parametrize("options", F32_CASES, ids=[",".join(f"{k}={v}" for k, v in c.items()) for c in F32_CASES])
def test_fp32_matches_fp64(options):
    check_against_fp64(torch.float32, seed=len(str(options)), **options)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("options", [dict(beta=0.0), dict(beta=1.0, temperature=2.0),
                                     dict(beta=0.5, weight_hard_loss=0.5, weight_soft_loss=0.5, reduction="none"),
                                     dict(beta=0.5, student_softcap=3.0, teacher_softcap=2.5, teacher_logit_scale=1.2)],
                         ids=["fkl", "rkl-tau2", "jsd-hard-none", "jsd-softcaps"])
def test_half_precision_matches_fp64(dtype, options):
    check_against_fp64(dtype, seed=3, **options)


@pytest.mark.gpu
@pytest.mark.parametrize("options", [dict(beta=0.0), dict(beta=0.5, temperature=2.0),
                                     dict(beta=1.0, weight_hard_loss=0.5, weight_soft_loss=0.5)],
                         ids=["fkl", "jsd-tau2", "rkl-hard"])
def test_gpu_bf16_realistic(options):
    """A study-like chunk on the GPU (bf16, odd vocabulary, several chunks, a wider teacher, a quarter of the rows
    ignored): the compiled row kernel within 2× the upcast torch computation's error against float64."""
    g = torch.Generator().manual_seed(11)
    tokens, hs, ht, vocab = 2048, 1024, 1536, 32003
    xs, ws = torch.randn(tokens, hs, generator=g), torch.randn(vocab, hs, generator=g) / math.sqrt(hs) * 2
    xt, wt = torch.randn(tokens, ht, generator=g), torch.randn(vocab, ht, generator=g) / math.sqrt(ht) * 2
    y = torch.randint(0, vocab, (tokens,), generator=g)
    y[torch.rand(tokens, generator=g) < 0.25] = -100
    xs, ws, xt, wt = (t.to(torch.bfloat16).cuda() for t in (xs, ws, xt, wt))
    y = y.cuda()
    ours, f64, same = leaves(xs, ws), leaves(xs, ws, dtype=torch.float64), leaves(xs, ws)
    loss = fusedkern.linear_distillation_loss(ours[0], ours[1], xt, wt, y, chunk_tokens=512, **options)
    loss64 = reference.linear_distillation_loss_fp64(f64[0], f64[1], xt, wt, y, **options)
    loss_torch = reference.upcast_linear_distillation_loss(same[0], same[1], xt, wt, y, **options)
    assert_close_to_ref("loss", loss, loss64, loss_torch, atol=1e-4)
    grads = [torch.autograd.grad(out, ts) for out, ts in ((loss, ours), (loss64, f64), (loss_torch, same))]
    for name, g_ours, g64, g_torch in zip(("dX", "dW"), *grads):
        assert_close_to_ref(name, g_ours, g64, g_torch, atol=1e-4)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_no_target_every_row_counts_and_no_bias(beta):
    check_against_fp64(torch.float32, seed=11, bias=False, with_target=False, beta=beta, temperature=1.3)


@pytest.mark.parametrize("chunk_tokens", [None, 1, 64])
def test_chunk_sizes_agree(chunk_tokens):
    """One chunk, one token per chunk (every row its own GEMM) and the default plan give the 2×-rule answer."""
    check_against_fp64(torch.float32, seed=5, beta=0.5, chunk_tokens=chunk_tokens)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_huge_logit_offsets_stay_accurate(beta):
    """Biases of ±3·10³ on top of O(1) logits: exp overflows fp32 without the max subtraction, and log p must
    be formed as (s − max) − log Σ (max + log Σ rounds to an ulp of 10³)."""
    xs, ws, bs, xt, wt, bt, y = make_batch(torch.float32, seed=13)
    ours, f64, same = leaves(xs, ws), leaves(xs, ws, dtype=torch.float64), leaves(xs, ws)
    kw = dict(beta=beta, temperature=0.8, weight_hard_loss=0.3)
    out = fusedkern.linear_distillation_loss(*ours, xt, wt, y, student_bias=bs + 3e3, teacher_bias=bt - 3e3, **kw)
    ref = reference.linear_distillation_loss_fp64(*f64, xt, wt, y, student_bias=bs + 3e3, teacher_bias=bt - 3e3, **kw)
    tch = reference.upcast_linear_distillation_loss(*same, xt, wt, y, student_bias=bs + 3e3, teacher_bias=bt - 3e3,
                                                    **kw)
    assert_close_to_ref("loss", out, ref, tch)
    for name, g, g64, gt in zip(("dX", "dW"), *(torch.autograd.grad(v, ts) for v, ts in ((out, ours), (ref, f64),
                                                                                         (tch, same)))):
        assert_close_to_ref(name, g, g64, gt)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_saturated_logits_stay_finite(beta, seed=13):
    """Logits ~10³ apart: p and q one-hot on different classes (JSD → log 2, the KLs ~10³ nats). Loss and the
    forward KL's gradient p − q obey the 2× rule. The reverse KL's and the JSD's gradients p·(c − Σ p c) are
    differences of O(D) numbers there, which fp32 keeps to a few ulp of D (torch's fp32 computation as well:
    4e-5 against ours 2.2e-4 in one row of D = 1385), so their largest error may pass twice torch's by that
    much: 4·ulp(D)/τ/N times |W| (dX) or |X| (dW)."""
    xs, ws, bs, xt, wt, bt, y = make_batch(torch.float32, seed=seed, logit_scale=150.0)
    ours, f64, same = leaves(xs, ws), leaves(xs, ws, dtype=torch.float64), leaves(xs, ws)
    kw = dict(beta=beta, temperature=0.8)
    out = fusedkern.linear_distillation_loss(*ours, xt, wt, y, **kw)
    ref = reference.linear_distillation_loss_fp64(*f64, xt, wt, y, **kw)
    tch = reference.upcast_linear_distillation_loss(*same, xt, wt, y, **kw)
    assert_close_to_ref("loss", out, ref, tch)
    grads = [torch.autograd.grad(v, ts) for v, ts in ((out, ours), (ref, f64), (tch, same))]
    n_valid = (y != -100).sum()
    d_max = reference.linear_distillation_loss_fp64(xs, ws, xt, wt, y, reduction="none", **kw).max()
    ulp_d = torch.finfo(torch.float32).eps * d_max / kw["temperature"] / n_valid
    for name, g, g64, gt, scale in zip(("dX", "dW"), *grads, (ws.abs().max(), xs.abs().max())):
        assert torch.isfinite(g).all()
        if beta == 0.0:
            assert_close_to_ref(name, g, g64, gt)
        else:
            err, err_torch = ((t.double() - g64).abs().max() for t in (g, gt))
            assert err <= 2 * err_torch + 4 * ulp_d * scale, (name, err.item(), err_torch.item())


def test_identical_student_and_teacher_give_zero_divergence():
    xs, ws, bs, _, _, _, y = make_batch(torch.float32, seed=2)
    for beta in (0.0, 0.4, 1.0):
        x, w = leaves(xs, ws)
        loss = fusedkern.linear_distillation_loss(x, w, xs, ws, y, student_bias=bs, teacher_bias=bs, beta=beta)
        loss.backward()
        assert abs(loss.item()) < 1e-6 and x.grad.abs().max() < 1e-6 and w.grad.abs().max() < 1e-6


def test_all_ignored_gives_zero_loss_and_zero_grads():
    """TRL clamps the mean's divisor at 1: every target ignored gives 0 (not NaN), and no gradient."""
    xs, ws, bs, xt, wt, bt, y = make_batch(torch.float32, seed=4, ignored=range(T))
    for reduction in ("mean", "sum", "none"):
        x, w, b = leaves(xs, ws, bs)
        loss = fusedkern.linear_distillation_loss(x, w, xt, wt, y, student_bias=b, teacher_bias=bt,
                                                  weight_hard_loss=0.5, reduction=reduction)
        loss.sum().backward()
        assert torch.equal(loss, torch.zeros_like(loss))
        assert not x.grad.any() and not w.grad.any() and not b.grad.any()


def test_poisoned_allocations_are_all_written(poison_allocations):
    poison_allocations()
    for reduction in ("mean", "none"):
        check_against_fp64(torch.float32, seed=6, beta=0.5, weight_hard_loss=0.2, reduction=reduction)


def test_teacher_gets_no_gradient():
    xs, ws, bs, xt, wt, bt, y = make_batch(torch.float32, seed=8)
    x, w, xt_leaf, wt_leaf, bt_leaf = leaves(xs, ws, xt, wt, bt)
    for reduction in ("mean", "none"):
        loss = fusedkern.linear_distillation_loss(x, w, xt_leaf, wt_leaf, y, teacher_bias=bt_leaf, reduction=reduction)
        loss.sum().backward()
    assert xt_leaf.grad is None and wt_leaf.grad is None and bt_leaf.grad is None
    assert x.grad is not None and w.grad is not None


def test_count_forms_give_the_same_loss_and_grads():
    xs, ws, bs, xt, wt, bt, y = make_batch(torch.float32, seed=9)
    n = int((y != -100).sum())
    results = []
    for count in (None, n, torch.tensor(n, device=DEVICE)):
        for reduction in ("mean", "none"):
            x, w = leaves(xs, ws)
            loss = fusedkern.linear_distillation_loss(x, w, xt, wt, y, beta=0.3, weight_hard_loss=0.2,
                                                      reduction=reduction, num_valid_tokens=count)
            loss.sum().backward()
            results.append((reduction, loss.detach(), x.grad, w.grad))
    base = {r[0]: r for r in results[:2]}
    for reduction, loss, dx, dw in results[2:]:
        _, loss0, dx0, dw0 = base[reduction]
        torch.testing.assert_close(loss, loss0, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(dx, dx0, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(dw, dw0, rtol=1e-5, atol=1e-6)
        assert not dx[y == -100].any()
    for wrong in (n - 1, torch.tensor(n + 1, device=DEVICE)):
        with pytest.raises(ValueError, match="num_valid_tokens"):
            fusedkern.linear_distillation_loss(xs, ws, xt, wt, y, num_valid_tokens=wrong)


def test_empty_batch_and_integer_count_types():
    """No token: 0 for mean and sum, an empty "none", zero gradients of the right shapes; a numpy count works."""
    import numpy as np

    xs, ws, bs, xt, wt, bt, y = make_batch(torch.float32, seed=14)
    for reduction in ("mean", "sum", "none"):
        x, w = leaves(xs[:0], ws)
        loss = fusedkern.linear_distillation_loss(x, w, xt[:0], wt, y[:0], reduction=reduction, weight_hard_loss=0.5)
        loss.sum().backward()
        assert loss.shape == ((0,) if reduction == "none" else ()) and not loss.any()
        assert x.grad.shape == (0, HS) and not w.grad.any()
    n = int((y != -100).sum())
    torch.testing.assert_close(fusedkern.linear_distillation_loss(xs, ws, xt, wt, y, num_valid_tokens=np.int64(n)),
                               fusedkern.linear_distillation_loss(xs, ws, xt, wt, y))


def test_module_and_leading_shape():
    xs, ws, bs, xt, wt, bt, y = make_batch(torch.float32, seed=10)
    module = fusedkern.LinearDistillationLoss(beta=0.3, temperature=2.0, reduction="none")
    assert "beta=0.3" in repr(module) and "teacher_softcap=None" in repr(module)
    out = module(xs.reshape(3, 3, HS), ws, xt.reshape(3, 3, HT), wt, y.reshape(3, 3), student_bias=bs)
    flat = fusedkern.linear_distillation_loss(xs, ws, xt, wt, y, student_bias=bs, beta=0.3, temperature=2.0,
                                              reduction="none")
    assert out.shape == (3, 3)
    torch.testing.assert_close(out.reshape(-1), flat)


def test_autocast_computes_in_the_autocast_dtype():
    xs, ws, bs, xt, wt, bt, y = make_batch(torch.float32, seed=12)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        inside = fusedkern.linear_distillation_loss(xs, ws, xt, wt, y, beta=0.5)
    cast = [t.to(torch.bfloat16) for t in (xs, ws, xt, wt)]
    torch.testing.assert_close(inside, fusedkern.linear_distillation_loss(*cast, y, beta=0.5))


def test_bad_inputs_raise_naming_the_argument():
    xs, ws, bs, xt, wt, bt, y = make_batch(torch.float32, seed=1)
    call = lambda **kw: fusedkern.linear_distillation_loss(  # noqa: E731
        kw.pop("xs", xs), kw.pop("ws", ws), kw.pop("xt", xt), kw.pop("wt", wt), kw.pop("y", y), **kw)
    cases = [
        (dict(beta=1.5), ValueError, "beta"), (dict(beta=-0.1), ValueError, "beta"),
        (dict(temperature=0.0), ValueError, "temperature"), (dict(temperature=float("inf")), ValueError, "temperature"),
        (dict(reduction="tokenmean"), ValueError, "reduction"),
        (dict(weight_hard_loss=-1.0), ValueError, "weight_hard_loss"),
        (dict(wt=wt[:-1]), ValueError, "vocabulary"), (dict(xt=xt[:-1]), ValueError, "teacher_hidden"),
        (dict(xs=xs[:, :-1]), ValueError, "student_hidden"), (dict(ws=ws.double()), TypeError, "student_weight"),
        (dict(xt=xt.half()), TypeError, "teacher_weight"), (dict(y=y[:-1]), ValueError, "target"),
        (dict(y=y.float()), TypeError, "target"), (dict(y=None, weight_hard_loss=0.5), ValueError, "target"),
        (dict(y=None, num_valid_tokens=3), ValueError, "num_valid_tokens"),
        (dict(num_valid_tokens=T + 1), ValueError, "num_valid_tokens"),
        (dict(student_bias=bs[:-1]), ValueError, "student_bias"), (dict(xs=xs.tolist()), TypeError, "student_hidden"),
        (dict(y=torch.where(y == -100, y, V)), ValueError, "target"),
        (dict(student_softcap=0.0), ValueError, "student_softcap"),
        (dict(teacher_logit_scale=-1.0), ValueError, "teacher_logit_scale"),
    ]
    for kwargs, error, name in cases:
        with pytest.raises(error, match=name):
            call(**kwargs)
    with pytest.raises(ValueError, match="temperature"):
        fusedkern.LinearDistillationLoss(temperature=-1.0)


def test_teacher_in_another_dtype():
    """Each side is one dtype; the sides may differ (an fp32 teacher for a bf16 student): the 2× rule holds."""
    xs, ws, bs, _, _, _, y = make_batch(torch.bfloat16, seed=15)
    _, _, _, xt, wt, bt, _ = make_batch(torch.float32, seed=15)
    ours, f64, same = leaves(xs, ws), leaves(xs, ws, dtype=torch.float64), leaves(xs, ws)
    out = fusedkern.linear_distillation_loss(*ours, xt, wt, y, teacher_bias=bt, beta=0.5)
    ref = reference.linear_distillation_loss_fp64(*f64, xt, wt, y, teacher_bias=bt, beta=0.5)
    tch = reference.upcast_linear_distillation_loss(*same, xt, wt, y, teacher_bias=bt, beta=0.5)
    assert_close_to_ref("loss", out, ref, tch, atol=ATOL[torch.bfloat16])
    for name, g, g64, gt in zip(("dX", "dW"), *(torch.autograd.grad(v, ts) for v, ts in ((out, ours), (ref, f64),
                                                                                         (tch, same)))):
        assert_close_to_ref(name, g, g64, gt, atol=ATOL[torch.bfloat16])


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_fullgraph_compile_matches_eager(reduction):
    """The kernels are custom operators with fake implementations: torch.compile traces a step with no graph break
    (the entropy output included)."""
    xs, ws, bs, xt, wt, bt, y = make_batch(torch.float32, seed=16)
    proj = torch.nn.Linear(HS, HS).to(DEVICE)

    def step(x, w):
        loss, entropy = fusedkern.linear_distillation_loss(torch.tanh(proj(x)), w, xt, wt, y, beta=0.3,
                                                           temperature=2.0, weight_hard_loss=0.2, reduction=reduction,
                                                           return_entropy=True)
        return loss + 0.01 * entropy  # the entropy is detached: its output's fake shape is what this checks
    torch._dynamo.reset()
    results = []
    for fn in (step, torch.compile(step, backend="aot_eager", fullgraph=True)):
        proj.zero_grad()
        w = ws.detach().clone().requires_grad_()
        out = fn(xs, w)
        out.sum().backward()
        results.append((out.detach(), w.grad, proj.weight.grad.clone()))
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


def _entropy_of(student_logits, temperature, valid):
    log_p = torch.log_softmax(student_logits / temperature, dim=-1)
    return torch.where(valid, -(log_p.exp() * log_p).sum(-1), 0.0)


ENTROPY_CASES = [(torch.float32, c) for c in ("mean-grad", "none-grad", "no-grad", "counted", "softcap")] + [
    (torch.bfloat16, "mean-grad"), (torch.bfloat16, "softcap")]


@pytest.mark.parametrize("dtype,case", ENTROPY_CASES, ids=[f"{c}-{str(d)[6:]}" for d, c in ENTROPY_CASES])
def test_entropy_matches_fp64(dtype, case):
    """`return_entropy`: the student's entropy at τ (after its softcap), 0 where ignored, under the 2× rule; the
    loss is the one without it."""
    xs, ws, bs, xt, wt, bt, y = make_batch(dtype, seed=17)
    kw = dict(beta=0.4, temperature=1.7, reduction="none" if case == "none-grad" else "mean",
              student_softcap=3.0 if case == "softcap" else None)
    if case == "counted":
        kw["num_valid_tokens"] = int((y != -100).sum())
    x, w = leaves(xs, ws)
    with torch.set_grad_enabled(case != "no-grad"):
        loss, entropy = fusedkern.linear_distillation_loss(x, w, xt, wt, y, student_bias=bs, return_entropy=True, **kw)
    assert entropy.dtype == torch.float32 and entropy.shape == y.shape and not entropy.requires_grad
    torch.testing.assert_close(loss, fusedkern.linear_distillation_loss(xs, ws, xt, wt, y, student_bias=bs, **kw))
    z = reference.model_logits(torch.nn.functional.linear(xs.double(), ws.double(), bs.double()), 1.0,
                               kw["student_softcap"])
    z_same = reference.model_logits(torch.nn.functional.linear(xs, ws, bs).float(), 1.0, kw["student_softcap"])
    valid = y != -100
    assert_close_to_ref("entropy", entropy, _entropy_of(z, 1.7, valid), _entropy_of(z_same, 1.7, valid),
                        atol=ATOL[dtype])
    assert not entropy[~valid].any()


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_same_conventions_as_trl_chunked_divergence(beta):
    """TRL 1.16's own fused divergence (`trl.kernels.chunked_divergence.ChunkedDivergenceFunction`, what its
    DistillationTrainer calls) gives the same per-token divergence, entropy and student gradients for the same
    β, temperature, logit scales and softcaps (fp32, where both keep fp32 logits): the conventions match."""
    trl_kernels = pytest.importorskip("trl.kernels.chunked_divergence")
    xs, ws, bs, xt, wt, bt, y = make_batch(torch.float32, seed=18, ignored=())
    kw = dict(beta=beta, temperature=1.4)
    scales = dict(student_logit_scale=0.8, student_softcap=3.0, teacher_logit_scale=1.3, teacher_softcap=2.5)
    x, w, b = leaves(xs, ws, bs)
    loss, entropy = fusedkern.linear_distillation_loss(x, w, xt, wt, student_bias=b, teacher_bias=bt, reduction="none",
                                                       return_entropy=True, **kw, **scales)
    x2, w2, b2 = leaves(xs, ws, bs)
    trl_loss, trl_entropy = trl_kernels.ChunkedDivergenceFunction.apply(
        x2, w2, b2, xt, wt, bt, beta, kw["temperature"], scales["student_logit_scale"], scales["student_softcap"],
        scales["teacher_logit_scale"], scales["teacher_softcap"])
    torch.testing.assert_close(loss, trl_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(entropy, trl_entropy, rtol=1e-5, atol=1e-6)
    upstream = torch.randn(T, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    for ours, theirs in zip(torch.autograd.grad(loss, (x, w, b), upstream),
                            torch.autograd.grad(trl_loss, (x2, w2, b2), upstream)):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-6)


def test_dtensor_heads_are_gathered(tmp_path):
    """FSDP2-sharded heads (DTensors, here Shard(0) over one gloo rank): the same loss and gradients as plain
    tensors, the student's weight gradient a DTensor of the same placement."""
    if DEVICE != "cpu":
        pytest.skip("a single-rank gloo mesh over CPU tensors (the kernels' device under the interpreter)")
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    xs, ws, bs, xt, wt, bt, y = make_batch(torch.float32, seed=19)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        w_dt = distribute_tensor(ws, mesh, [Shard(0)]).requires_grad_()
        loss = fusedkern.linear_distillation_loss(xs, w_dt, xt, distribute_tensor(wt, mesh, [Shard(0)]), y, beta=0.5)
        loss.backward()
        w = leaves(ws)[0]
        plain = fusedkern.linear_distillation_loss(xs, w, xt, wt, y, beta=0.5)
        plain.backward()
        torch.testing.assert_close(loss, plain)
        assert w_dt.grad.placements == (Shard(0),)
        torch.testing.assert_close(w_dt.grad.full_tensor(), w.grad)
    finally:
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore::UserWarning")  # trl.experimental's import warning
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_batchmean_is_trls_generalized_jsd_loss(beta):
    """reduction="batchmean" is TRL's `generalized_jsd_loss` default on the materialized logits, loss and the
    student's gradients: without labels the sum over the batch's first dimension (B of [B, S, H], not the B·S
    rows "mean" divides by), with labels the mean over the labelled rows. fp32, temperature 1.5."""
    gkd = pytest.importorskip("trl.experimental.gkd")
    B, S = 2, 5
    g = torch.Generator().manual_seed(21)
    xs, xt = torch.randn(B, S, HS, generator=g), torch.randn(B, S, HT, generator=g)
    ws, wt = torch.randn(V, HS, generator=g) / math.sqrt(HS) * 2, torch.randn(V, HT, generator=g) / math.sqrt(HT) * 2
    bs, bt = torch.randn(V, generator=g) * 0.5, torch.randn(V, generator=g) * 0.5
    y = torch.randint(0, V, (B, S), generator=g)
    y[0, :2] = -100
    xs, xt, ws, wt, bs, bt, y = (t.to(DEVICE) for t in (xs, xt, ws, wt, bs, bt, y))
    tau = 1.5
    for target in (None, y):
        ours = leaves(xs, ws, bs)
        loss = fusedkern.linear_distillation_loss(ours[0], ours[1], xt, wt, target, student_bias=ours[2],
                                                  teacher_bias=bt, beta=beta, temperature=tau,
                                                  reduction="batchmean", chunk_tokens=4)
        theirs = leaves(xs, ws, bs)
        want = gkd.GKDTrainer.generalized_jsd_loss(torch.nn.functional.linear(theirs[0], theirs[1], theirs[2]),
                                                   torch.nn.functional.linear(xt, wt, bt), labels=target,
                                                   beta=beta, temperature=tau, reduction="batchmean")
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
        for a, e in zip(torch.autograd.grad(loss, ours), torch.autograd.grad(want, theirs)):
            torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-6)
        mean = fusedkern.linear_distillation_loss(xs, ws, xt, wt, target, student_bias=bs, teacher_bias=bt,
                                                  beta=beta, temperature=tau)
        # "mean" divides by the rows: B·S of them without labels, the labelled ones with
        torch.testing.assert_close(loss, mean * (S if target is None else 1), rtol=1e-5, atol=1e-6)
        if target is None:
            module = fusedkern.LinearDistillationLoss(beta=beta, temperature=tau, reduction="batchmean")
            torch.testing.assert_close(module(xs, ws, xt, wt, student_bias=bs, teacher_bias=bt), loss.detach(),
                                       rtol=1e-6, atol=0)
    empty = fusedkern.linear_distillation_loss(xs[:0], ws, xt[:0], wt, reduction="batchmean")
    assert empty.item() == 0.0  # TRL's divisor is at least 1


@pytest.mark.filterwarnings("ignore::UserWarning")  # trl.experimental's import warning
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_trl_gkd_loss_is_trls_batchmean(beta):
    """The TRL integration's GKD loss (`distill_output`, over the labelled rows only) equals GKDTrainer's
    `generalized_jsd_loss` on the materialized logits with the shifted labels: its default "batchmean" (the
    mean over the labelled rows), the sum over num_items_in_batch when given, and 0 with no labelled row."""
    gkd = pytest.importorskip("trl.experimental.gkd")
    fk_trl = pytest.importorskip("fusedkern.integrations.trl")
    B, S = 2, 5
    g = torch.Generator().manual_seed(22)
    xs, xt = torch.randn(B, S, HS, generator=g).to(DEVICE), torch.randn(B, S, HT, generator=g).to(DEVICE)
    ws = (torch.randn(V, HS, generator=g) / math.sqrt(HS) * 2).to(DEVICE)
    wt = (torch.randn(V, HT, generator=g) / math.sqrt(HT) * 2).to(DEVICE)
    labels = torch.randint(0, V, (B, S), generator=g).to(DEVICE)
    labels[0, :3] = -100
    for lab, n_items in ((labels, None), (labels, torch.tensor(11.0)), (torch.full_like(labels, -100), None)):
        mask = lab != -100
        rows = mask.reshape(-1).nonzero().squeeze(-1)
        w = ws.clone().requires_grad_()
        x = xs.reshape(-1, HS).index_select(0, rows).detach().requires_grad_()
        teacher = dict(hidden=xt, weight=wt, bias=None, logit_scale=1.0, softcap=None, beta=beta, temperature=1.0)
        out = fk_trl.distill_output(x, w, None, rows, mask, teacher, softcap=None, logit_scale=1.0,
                                    num_items_in_batch=n_items, weight_grad_accum="fp32", chunk_tokens=None)
        w2 = ws.clone().requires_grad_()
        want = gkd.GKDTrainer.generalized_jsd_loss(xs @ w2.T, xt @ wt.T, labels=lab, beta=beta,
                                                   num_items_in_batch=n_items)
        torch.testing.assert_close(out.loss, want, rtol=1e-5, atol=1e-6)
        if rows.numel():
            torch.testing.assert_close(torch.autograd.grad(out.loss, w)[0], torch.autograd.grad(want, w2)[0],
                                       rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_both_buffers_in_dw_storage_give_the_same_grads(monkeypatch, reduction):
    """Several chunks of a bf16 head with fp32 dW accumulation: the plan puts the student's and the teacher's
    [C, V] buffers in dW's own storage (C = H/2), which the accumulator's cast overwrites at the end; the loss and
    gradients are bitwise those of the same chunks in buffers of their own (chunk_tokens given), and within the
    accuracy rule of float64."""
    from fusedkern import distillation

    # chunks of 64, 64 and 2 rows (C = H/2 at the smallest H whose half is a chunk multiple); V: two column blocks
    n, h, v = 130, 128, 61
    g = torch.Generator().manual_seed(5)
    xs, xt = (torch.randn(n, h, generator=g).to(torch.bfloat16).to(DEVICE) for _ in range(2))
    ws, wt = ((torch.randn(v, h, generator=g) / math.sqrt(h) * 2).to(torch.bfloat16).to(DEVICE) for _ in range(2))
    y = torch.randint(0, v, (n,), generator=g).to(DEVICE)
    y[::7] = -100
    monkeypatch.setattr(distillation, "GRAD_CHUNK_BUDGET_BYTES", 0)  # past one chunk's allowance at this size
    plan = distillation.distill_plan(n, ws, wt, True, "fp32", None)
    assert plan.chunk_tokens == 64 and plan.fp32_accumulator and distillation.shares_dw_storage(plan, ws)
    upstream = torch.randn(n, generator=g).to(DEVICE) if reduction == "none" else torch.tensor(1.3)
    results = []
    for chunk_tokens in (None, 64):
        x_leaf, w_leaf = leaves(xs, ws)
        loss = fusedkern.linear_distillation_loss(x_leaf, w_leaf, xt, wt, y, beta=0.5, reduction=reduction,
                                                  chunk_tokens=chunk_tokens)
        loss.backward(upstream if reduction == "none" else None)
        results.append((loss.detach(), x_leaf.grad, w_leaf.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    f64 = leaves(xs, ws, dtype=torch.float64)
    loss64 = reference.linear_distillation_loss_fp64(f64[0], f64[1], xt, wt, y, beta=0.5, reduction=reduction)
    same = leaves(xs, ws)
    loss_torch = reference.upcast_linear_distillation_loss(same[0], same[1], xt, wt, y, beta=0.5, reduction=reduction)
    assert_close_to_ref("loss", results[0][0], loss64, loss_torch, atol=1e-4)
    for out, ts in ((loss64, f64), (loss_torch, same)):
        out.backward(upstream.to(out.dtype) if reduction == "none" else None)
    for name, ours, t64, tt in zip(("dX", "dW"), results[0][1:], f64, same):
        assert_close_to_ref(name, ours, t64.grad, tt.grad, atol=1e-4)
