"""Tests of fusedkern.reference: the references every other test and benchmark trusts.

Each reference is checked against something written independently of it: cross-entropy against
`torch.nn.functional.cross_entropy` (softcap applied and z-loss added by hand on the torch side),
SimPO against a per-pair loop that re-derives TRL's CPO-SimPO formula, gradients against
`torch.autograd.gradcheck` (finite differences in float64) and against the hand-derived formulas
of docs/design.md that the kernels implement. CPU only, tiny shapes; the whole file runs in seconds.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from fusedkern import reference as ref

IGNORE = -100

# Option sets reused by several tests: (class weights?, ε, z_loss, softcap).
OPTION_SETS = {
    "plain": dict(use_class_weight=False, label_smoothing=0.0, z_loss=0.0, softcap=None),
    "all": dict(use_class_weight=True, label_smoothing=0.1, z_loss=1e-2, softcap=3.0),
    "smooth+weight": dict(use_class_weight=True, label_smoothing=0.3, z_loss=0.0, softcap=None),
    "zloss+softcap": dict(use_class_weight=False, label_smoothing=0.0, z_loss=0.2, softcap=2.0),
}


# ----------------------------------------------------------------------------------------------
# Helpers: the torch side of every comparison, and input makers
# ----------------------------------------------------------------------------------------------


def torch_cross_entropy(
    logits, target, *, weight, reduction, ignore_index, label_smoothing, z_loss, softcap
):
    """design.md's loss built from torch primitives: softcap by hand, `F.cross_entropy`, z-loss
    added by hand with the same denominator as torch's "mean". logits [..., V], target [...]."""
    vocab = logits.shape[-1]
    z = logits.reshape(-1, vocab)  # [T, V]
    y = target.reshape(-1)  # [T]
    s = softcap * torch.tanh(z / softcap) if softcap is not None else z
    ce = F.cross_entropy(
        s, y, weight=weight, ignore_index=ignore_index, reduction=reduction,
        label_smoothing=label_smoothing,
    )
    mask = y != ignore_index
    z_term = torch.where(mask, z_loss * torch.logsumexp(s, dim=-1) ** 2, torch.zeros((), dtype=s.dtype))  # [T]
    if reduction == "none":
        return (ce + z_term).reshape(target.shape)
    if reduction == "sum":
        return ce + z_term.sum()
    w_target = torch.ones_like(z_term) if weight is None else weight[torch.where(mask, y, 0)]
    denominator = torch.where(mask, w_target, torch.zeros_like(w_target)).sum()
    return ce + z_term.sum() / denominator


def make_target(shape, vocab, mask_kind, *, ignore_index=IGNORE, generator=None):
    """Random targets [shape]; mask_kind: "none" (nothing ignored), "some", or "all"."""
    target = torch.randint(0, vocab, shape, generator=generator)
    if mask_kind == "all":
        target.fill_(ignore_index)
    elif mask_kind == "some":
        flat = target.view(-1)
        flat[::3] = ignore_index  # a third of the tokens, the first one always among them
        if flat.numel() > 1:
            flat[1] = torch.randint(0, vocab, (1,), generator=generator).item()  # keep one token
    return target


def class_weight(vocab, dtype):
    # Positive and clearly non-uniform, so a wrong normalization cannot hide behind w = 1.
    return torch.rand(vocab, dtype=dtype) * 1.5 + 0.25


def assert_close_verbose(actual, expected, *, rtol, atol, what=""):
    """assert_close that also compares NaN positions and names what was compared on failure."""
    torch.testing.assert_close(
        actual, expected, rtol=rtol, atol=atol, equal_nan=True,
        msg=lambda m: f"{what}: {m}",
    )


# ----------------------------------------------------------------------------------------------
# Cross-entropy core against torch, every option and combination
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("use_class_weight", [False, True])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
# An ignore_index inside [0, V) checks that ignored targets never index the class weights.
@pytest.mark.parametrize("mask_kind, ignore_index", [("none", IGNORE), ("some", IGNORE), ("all", IGNORE), ("some", 2)])
@pytest.mark.parametrize("z_loss", [0.0, 0.05])
@pytest.mark.parametrize("softcap", [None, 4.0])
def test_cross_entropy_from_logits_matches_torch(
    use_class_weight, label_smoothing, reduction, mask_kind, ignore_index, z_loss, softcap
):
    torch.manual_seed(0)
    vocab = 7
    logits = torch.randn(2, 5, vocab, dtype=torch.float64) * 3  # [2, 5, V], scale 3 exercises softcap
    target = make_target((2, 5), vocab, mask_kind, ignore_index=ignore_index)  # [2, 5]
    weight = class_weight(vocab, torch.float64) if use_class_weight else None
    options = dict(
        weight=weight, reduction=reduction, ignore_index=ignore_index,
        label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
    )

    loss, lse = ref.cross_entropy_from_logits(logits, target, return_lse=True, **options)
    expected = torch_cross_entropy(logits, target, **options)
    assert loss.shape == expected.shape
    assert_close_verbose(loss, expected, rtol=1e-12, atol=1e-12, what="loss")
    if reduction == "mean" and mask_kind == "all":
        assert torch.isnan(loss)  # torch's 0/0, kept on purpose

    # lse is returned for every token, ignored ones included, of the softcapped logits.
    s = softcap * torch.tanh(logits / softcap) if softcap is not None else logits
    assert lse.shape == target.shape and lse.dtype == torch.float64
    assert_close_verbose(lse, torch.logsumexp(s, dim=-1), rtol=1e-13, atol=1e-13, what="lse")


@pytest.mark.parametrize("options", OPTION_SETS.values(), ids=OPTION_SETS.keys())
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_cross_entropy_from_logits_fp32_matches_torch(options, reduction):
    torch.manual_seed(1)
    vocab = 33
    logits = torch.randn(17, vocab) * 4  # [T, V] fp32
    target = make_target((17,), vocab, "some")
    weight = class_weight(vocab, torch.float32) if options["use_class_weight"] else None
    kwargs = dict(
        weight=weight, reduction=reduction, ignore_index=IGNORE,
        label_smoothing=options["label_smoothing"], z_loss=options["z_loss"], softcap=options["softcap"],
    )
    loss = ref.cross_entropy_from_logits(logits, target, return_lse=False, **kwargs)
    assert loss.dtype == torch.float32
    assert_close_verbose(loss, torch_cross_entropy(logits, target, **kwargs), rtol=1e-5, atol=1e-5, what="loss")


def test_label_smoothing_normalization_with_class_weights():
    """Pins the normalization torch uses (design.md follows it): the smoothing term is
    (ε/V)·Σ_v w_v·(lse − s_v) per token, and "mean" divides everything by Σ w_y, not by the count."""
    torch.manual_seed(2)
    vocab, eps = 5, 0.4
    logits = torch.randn(6, vocab, dtype=torch.float64)
    target = torch.tensor([0, 1, IGNORE, 3, 4, 2])
    weight = class_weight(vocab, torch.float64)
    mask = target != IGNORE
    lse = torch.logsumexp(logits, dim=-1)
    y = torch.where(mask, target, 0)
    per_token = (1 - eps) * weight[y] * (lse - logits[torch.arange(6), y]) + (eps / vocab) * (
        weight * (lse[:, None] - logits)
    ).sum(-1)
    by_hand_mean = per_token[mask].sum() / weight[y][mask].sum()
    torch_mean = F.cross_entropy(logits, target, weight=weight, label_smoothing=eps)
    assert_close_verbose(torch_mean, by_hand_mean, rtol=1e-12, atol=1e-12, what="torch normalization")


# ----------------------------------------------------------------------------------------------
# The linear references against torch
# ----------------------------------------------------------------------------------------------


def make_linear_problem(*, batch_shape=(2, 3), hidden=8, vocab=11, dtype=torch.float32, bias=False,
                        mask_kind="some", seed=0):
    torch.manual_seed(seed)
    x = torch.randn(*batch_shape, hidden, dtype=dtype)  # [..., H]
    w = (torch.randn(vocab, hidden) / math.sqrt(hidden) * 2).to(dtype)  # [V, H], logits of O(2)
    b = torch.randn(vocab, dtype=dtype) if bias else None  # [V]
    target = make_target(batch_shape, vocab, mask_kind)  # [...]
    return x, w, b, target


@pytest.mark.parametrize("options", OPTION_SETS.values(), ids=OPTION_SETS.keys())
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("mask_kind, bias", [("none", False), ("some", True), ("all", True)])
def test_linear_references_match_torch(options, reduction, mask_kind, bias):
    x, w, b, target = make_linear_problem(bias=bias, mask_kind=mask_kind)
    vocab = w.shape[0]
    weight = class_weight(vocab, torch.float32) if options["use_class_weight"] else None
    kwargs = dict(
        reduction=reduction, ignore_index=IGNORE, label_smoothing=options["label_smoothing"],
        z_loss=options["z_loss"], softcap=options["softcap"],
    )

    loss64, lse64 = ref.linear_cross_entropy_fp64(x, w, target, linear_bias=b, weight=weight,
                                                  return_lse=True, **kwargs)
    logits64 = F.linear(x.double(), w.double(), None if b is None else b.double())
    expected64 = torch_cross_entropy(logits64, target, weight=None if weight is None else weight.double(), **kwargs)
    assert loss64.dtype == torch.float64 and lse64.dtype == torch.float64
    assert_close_verbose(loss64, expected64, rtol=1e-12, atol=1e-12, what="fp64 loss")

    loss32, lse32 = ref.upcast_linear_cross_entropy(x, w, target, linear_bias=b, weight=weight,
                                                    return_lse=True, **kwargs)
    expected32 = torch_cross_entropy(F.linear(x, w, b).float(), target, weight=weight, **kwargs)
    assert loss32.dtype == torch.float32 and lse32.dtype == torch.float32
    assert lse32.shape == target.shape and lse64.shape == target.shape
    assert loss32.shape == (target.shape if reduction == "none" else ())
    assert_close_verbose(loss32, expected32, rtol=1e-5, atol=1e-5, what="upcast loss")
    assert_close_verbose(loss32.double(), loss64, rtol=1e-4, atol=1e-4, what="upcast vs fp64")
    assert_close_verbose(lse32.double(), lse64, rtol=1e-5, atol=1e-5, what="upcast lse vs fp64")


def test_upcast_keeps_input_dtype_logits_then_upcasts():
    """bf16 input: the logits are rounded to bf16 by the GEMM, then upcast; the loss is fp32."""
    x, w, b, target = make_linear_problem(dtype=torch.bfloat16, bias=True, hidden=16, vocab=32)
    loss = ref.upcast_linear_cross_entropy(x, w, target, linear_bias=b)
    assert loss.dtype == torch.float32
    expected = F.cross_entropy(F.linear(x, w, b).float().reshape(-1, 32), target.reshape(-1))
    assert_close_verbose(loss, expected, rtol=1e-6, atol=1e-6, what="bf16 upcast")


def test_hf_baseline_is_bf16_cross_entropy_on_bf16_logits():
    x, w, _, target = make_linear_problem(dtype=torch.bfloat16, hidden=16, vocab=32)
    loss = ref.hf_linear_cross_entropy(x, w, target)
    assert loss.dtype == torch.bfloat16 and loss.shape == ()
    # Exactly nn.Linear then nn.CrossEntropyLoss, with nothing upcast.
    expected = torch.nn.CrossEntropyLoss()(torch.nn.functional.linear(x, w).reshape(-1, 32), target.reshape(-1))
    assert torch.equal(loss, expected)
    # bf16 logits carry ~3 significant digits: close to the exact loss, not equal to it.
    assert_close_verbose(loss.double(), ref.linear_cross_entropy_fp64(x, w, target), rtol=2e-2, atol=2e-2,
                         what="hf vs fp64")

    per_token = ref.hf_linear_cross_entropy(x, w, target, reduction="none")
    assert per_token.shape == target.shape and per_token.dtype == torch.bfloat16
    assert torch.all(per_token[target == IGNORE] == 0)
    assert_close_verbose(per_token.float().sum(), ref.hf_linear_cross_entropy(x, w, target, reduction="sum").float(),
                         rtol=2e-2, atol=2e-2, what="none vs sum")


def test_invalid_options_raise():
    logits = torch.randn(3, 4)
    target = torch.tensor([0, 1, 2])
    base = dict(weight=None, ignore_index=IGNORE, z_loss=0.0, return_lse=False)
    with pytest.raises(ValueError, match="reduction"):
        ref.cross_entropy_from_logits(logits, target, reduction="avg", label_smoothing=0.0, softcap=None, **base)
    with pytest.raises(ValueError, match="label_smoothing"):
        ref.cross_entropy_from_logits(logits, target, reduction="mean", label_smoothing=1.5, softcap=None, **base)
    with pytest.raises(ValueError, match="softcap"):
        ref.cross_entropy_from_logits(logits, target, reduction="mean", label_smoothing=0.0, softcap=0.0, **base)
    with pytest.raises(ValueError, match="even"):
        ref.simpo_from_logprobs(torch.zeros(3, 2), torch.ones(3, 2, dtype=torch.bool),
                                 beta=0.1, gamma=0.5, alpha=1.0, label_smoothing=0.0)


# ----------------------------------------------------------------------------------------------
# Gradients: gradcheck, and design.md's hand-derived formulas
# ----------------------------------------------------------------------------------------------


def tiny_fp64_problem(*, batch_shape=(3,), hidden=4, vocab=5, bias=True, mask_kind="some", seed=0):
    x, w, b, target = make_linear_problem(batch_shape=batch_shape, hidden=hidden, vocab=vocab,
                                          dtype=torch.float64, bias=bias, mask_kind=mask_kind, seed=seed)
    leaves = [t.requires_grad_() for t in (x, w) + ((b,) if bias else ())]
    return leaves, target


@pytest.mark.parametrize("options", OPTION_SETS.values(), ids=OPTION_SETS.keys())
@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_cross_entropy_fp64_gradcheck(options, reduction):
    (x, w, b), target = tiny_fp64_problem()
    weight = class_weight(5, torch.float64) if options["use_class_weight"] else None

    def loss_fn(x, w, b):
        return ref.linear_cross_entropy_fp64(
            x, w, target, linear_bias=b, weight=weight, reduction=reduction, ignore_index=IGNORE,
            label_smoothing=options["label_smoothing"], z_loss=options["z_loss"], softcap=options["softcap"],
        )

    assert torch.autograd.gradcheck(loss_fn, (x, w, b))


@pytest.mark.parametrize("options", OPTION_SETS.values(), ids=OPTION_SETS.keys())
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_cross_entropy_gradient_matches_design_formula(options, reduction):
    """The logits gradient the kernels implement (design.md) equals autograd of the reference:
    ∂ℓ/∂s = [(1−ε)w_y + εW_sum/V + 2·z_loss·lse]·p − (1−ε)w_y·[v=y] − (ε/V)·w_v, times softcap'."""
    torch.manual_seed(3)
    vocab, eps, z_loss, cap = 6, options["label_smoothing"], options["z_loss"], options["softcap"]
    z = (torch.randn(8, vocab, dtype=torch.float64) * 3).requires_grad_()  # [T, V]
    target = make_target((8,), vocab, "some")
    w = class_weight(vocab, torch.float64) if options["use_class_weight"] else torch.ones(vocab, dtype=torch.float64)
    loss = ref.cross_entropy_from_logits(
        z, target, weight=w, reduction=reduction, ignore_index=IGNORE, label_smoothing=eps,
        z_loss=z_loss, softcap=cap, return_lse=False,
    )
    (grad_autograd,) = torch.autograd.grad(loss, z)

    with torch.no_grad():
        s = cap * torch.tanh(z / cap) if cap is not None else z
        lse = torch.logsumexp(s, dim=-1, keepdim=True)  # [T, 1]
        p = torch.exp(s - lse)  # [T, V]
        mask = target != IGNORE
        y = torch.where(mask, target, 0)
        w_y = w[y][:, None]  # [T, 1]
        onehot = F.one_hot(y, vocab).to(z.dtype)
        dl_ds = ((1 - eps) * w_y + eps * w.sum() / vocab + 2 * z_loss * lse) * p - (1 - eps) * w_y * onehot - (
            eps / vocab
        ) * w
        dl_dz = dl_ds * (1 - (s / cap) ** 2) if cap is not None else dl_ds
        g = mask.to(z.dtype)[:, None]  # upstream per-token weight: 1 for "sum", 1/D for "mean"
        if reduction == "mean":
            g = g / w[y][mask].sum()
        expected = g * dl_dz
    assert_close_verbose(grad_autograd, expected, rtol=1e-12, atol=1e-13, what="dL/dz")


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_logprobs_fp64_values_and_gradcheck(softcap):
    (x, w, b), target = tiny_fp64_problem(batch_shape=(2, 3))
    logp = ref.linear_logprobs_fp64(x, w, target, linear_bias=b, softcap=softcap)
    assert logp.shape == target.shape and logp.dtype == torch.float64
    # logp = −ℓ with ε = 0, no class weights, no z-loss; exactly 0 where ignored.
    expected = -torch_cross_entropy(F.linear(x, w, b), target, weight=None, reduction="none",
                                    ignore_index=IGNORE, label_smoothing=0.0, z_loss=0.0, softcap=softcap)
    assert_close_verbose(logp, expected, rtol=1e-12, atol=1e-12, what="logp")
    assert torch.all(logp[target == IGNORE] == 0)
    assert torch.autograd.gradcheck(
        lambda x, w, b: ref.linear_logprobs_fp64(x, w, target, linear_bias=b, softcap=softcap), (x, w, b)
    )


def test_logprobs_gradient_matches_design_formula():
    """∂logp_t/∂z_tv = ([v = y_t] − p_tv)·softcap', zero for ignored tokens, for any upstream g."""
    torch.manual_seed(4)
    vocab, cap = 7, 3.0
    z = (torch.randn(9, vocab, dtype=torch.float64) * 2).requires_grad_()
    target = make_target((9,), vocab, "some")
    upstream = torch.randn(9, dtype=torch.float64)  # g_t
    logp = ref.target_logprobs(z, target, ignore_index=IGNORE, softcap=cap)
    (grad_autograd,) = torch.autograd.grad(logp, z, grad_outputs=upstream)
    with torch.no_grad():
        s = cap * torch.tanh(z / cap)
        p = torch.softmax(s, dim=-1)
        mask = (target != IGNORE).to(z.dtype)[:, None]
        onehot = F.one_hot(torch.where(target != IGNORE, target, 0), vocab).to(z.dtype)
        expected = mask * upstream[:, None] * (onehot - p) * (1 - (s / cap) ** 2)
    assert_close_verbose(grad_autograd, expected, rtol=1e-12, atol=1e-13, what="dlogp/dz")


# ----------------------------------------------------------------------------------------------
# SimPO
# ----------------------------------------------------------------------------------------------


def trl_simpo_per_pair(x, w, b, target, *, beta, gamma, alpha, label_smoothing, ignore_index):
    """TRL's CPO-SimPO, re-derived straightforwardly, one pair at a time, in float64.

    Divides by the response length as TRL does (NaN for an all-ignored response): use it only where
    every response has a token. Returns (loss, metrics) with TRL's metric names.
    """
    logits = F.linear(x.double(), w.double(), None if b is None else b.double())  # [2B, S, V]
    log_probs = torch.log_softmax(logits, dim=-1)
    n_pairs, vocab = x.shape[0] // 2, w.shape[0]

    def average_logp(row):
        keep = target[row] != ignore_index  # [S]
        token_logps = log_probs[row][keep].gather(-1, target[row][keep][:, None]).squeeze(-1)
        return token_logps.sum() / keep.sum()

    losses, chosen, rejected = [], [], []
    for i in range(n_pairs):
        a_w, a_l = average_logp(i), average_logp(n_pairs + i)
        pi_logratio = a_w - a_l - gamma / beta  # TRL: logits = (π_w − π_l) − γ/β
        losses.append(-F.logsigmoid(beta * pi_logratio) * (1 - label_smoothing)
                      - F.logsigmoid(-beta * pi_logratio) * label_smoothing)
        chosen.append(a_w)
        rejected.append(a_l)
    nll = F.cross_entropy(logits[:n_pairs].reshape(-1, vocab), target[:n_pairs].reshape(-1), ignore_index=ignore_index)
    loss = torch.stack(losses).mean() + alpha * nll
    chosen, rejected = torch.stack(chosen), torch.stack(rejected)
    metrics = {
        "rewards/chosen": (beta * chosen).mean(),
        "rewards/rejected": (beta * rejected).mean(),
        "rewards/margins": (beta * chosen - beta * rejected).mean(),
        "rewards/accuracies": (beta * chosen > beta * rejected).double().mean(),
        "logps/chosen": chosen.mean(),
        "logps/rejected": rejected.mean(),
        "nll_loss": nll,
    }
    return loss, metrics


def make_simpo_problem(*, n_pairs=3, seq=6, hidden=8, vocab=13, dtype=torch.float64, bias=False,
                       ignore_index=IGNORE, seed=0):
    torch.manual_seed(seed)
    x = torch.randn(2 * n_pairs, seq, hidden, dtype=dtype)  # [2B, S, H]
    w = (torch.randn(vocab, hidden) / math.sqrt(hidden) * 2).to(dtype)  # [V, H]
    b = torch.randn(vocab, dtype=dtype) if bias else None
    target = torch.randint(0, vocab, (2 * n_pairs, seq))  # [2B, S]
    if ignore_index >= 0:
        target[target == ignore_index] = (ignore_index + 1) % vocab
    # A prompt prefix of varying length is ignored, as in real preference data (≥ 1 token remains).
    for row in range(2 * n_pairs):
        target[row, : row % (seq - 1)] = ignore_index
    return x, w, b, target


SIMPO_HPARAMS = {
    "trl-defaults": dict(beta=0.1, gamma=0.5),
    "paper-config": dict(beta=2.5, gamma=1.375),
}


@pytest.mark.parametrize("hparams", SIMPO_HPARAMS.values(), ids=SIMPO_HPARAMS.keys())
@pytest.mark.parametrize("label_smoothing", [0.0, 0.25])
@pytest.mark.parametrize("alpha", [1.0, 0.0])
@pytest.mark.parametrize("bias, ignore_index", [(False, IGNORE), (True, 3)])
def test_simpo_fp64_matches_trl_rederivation(hparams, label_smoothing, alpha, bias, ignore_index):
    x, w, b, target = make_simpo_problem(bias=bias, ignore_index=ignore_index)
    kwargs = dict(alpha=alpha, label_smoothing=label_smoothing, ignore_index=ignore_index, **hparams)
    leaves = [t.requires_grad_() for t in (x, w) + ((b,) if bias else ())]

    loss, metrics = ref.linear_simpo_loss_fp64(x, w, target, linear_bias=b, **kwargs)
    expected_loss, expected_metrics = trl_simpo_per_pair(x, w, b, target, **kwargs)
    assert loss.dtype == torch.float64 and loss.shape == ()
    assert_close_verbose(loss, expected_loss, rtol=1e-12, atol=1e-12, what="loss")
    assert tuple(metrics) == ref.SIMPO_METRIC_KEYS
    for key in ref.SIMPO_METRIC_KEYS:
        assert_close_verbose(metrics[key], expected_metrics[key].detach(), rtol=1e-12, atol=1e-12, what=key)

    grads = torch.autograd.grad(loss, leaves)
    expected_grads = torch.autograd.grad(expected_loss, leaves)
    for name, got, want in zip(("input", "weight", "bias"), grads, expected_grads):
        assert_close_verbose(got, want, rtol=1e-10, atol=1e-12, what=f"grad {name}")


@pytest.mark.parametrize("bias", [False, True])
def test_hf_simpo_matches_fp64(bias):
    x, w, b, target = make_simpo_problem(dtype=torch.float32, bias=bias)
    loss, metrics = ref.hf_linear_simpo_loss(x, w, target, linear_bias=b, beta=2.0, gamma=1.0)
    loss64, metrics64 = ref.linear_simpo_loss_fp64(x, w, target, linear_bias=b, beta=2.0, gamma=1.0)
    assert loss.dtype == torch.float32
    assert_close_verbose(loss.double(), loss64, rtol=1e-5, atol=1e-5, what="loss")
    assert tuple(metrics) == ref.SIMPO_METRIC_KEYS
    for key in ref.SIMPO_METRIC_KEYS:
        value = metrics[key]
        assert value.shape == () and not value.requires_grad and value.dtype == torch.float32
        assert_close_verbose(value.double(), metrics64[key], rtol=1e-5, atol=1e-5, what=key)


def test_hf_simpo_upcasts_bf16_logits():
    x, w, b, target = make_simpo_problem(dtype=torch.bfloat16)
    x.requires_grad_()
    loss, metrics = ref.hf_linear_simpo_loss(x, w, target)
    assert loss.dtype == torch.float32 and metrics["nll_loss"].dtype == torch.float32
    loss.backward()
    assert x.grad.dtype == torch.bfloat16 and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("empty_side", ["chosen", "rejected"])
def test_simpo_all_ignored_response_is_finite_and_isolated(empty_side):
    """design.md: an all-ignored response averages to A = 0, the pair stays finite, and only the
    other response of that pair gets a gradient. TRL's formula gives NaN there."""
    x, w, b, target = make_simpo_problem(n_pairs=3)
    n_pairs = 3
    empty_row, partner_row = (1, n_pairs + 1) if empty_side == "chosen" else (n_pairs + 1, 1)
    target[empty_row] = IGNORE
    x.requires_grad_()
    w.requires_grad_()

    loss, metrics = ref.linear_simpo_loss_fp64(x, w, target, beta=2.0, gamma=1.0)
    assert torch.isfinite(loss) and all(torch.isfinite(v) for v in metrics.values())
    loss.backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(w.grad).all()
    assert torch.all(x.grad[empty_row] == 0)
    assert x.grad[partner_row].abs().sum() > 0
    # The public formula (division by the length) is undefined here: the reason for max(n, 1).
    trl_loss, _ = trl_simpo_per_pair(x.detach(), w.detach(), None, target, beta=2.0, gamma=1.0, alpha=1.0,
                                     label_smoothing=0.0, ignore_index=IGNORE)
    assert torch.isnan(trl_loss)

    hf_loss, _ = ref.hf_linear_simpo_loss(x.detach().float(), w.detach().float(), target, beta=2.0, gamma=1.0)
    assert_close_verbose(hf_loss.double(), loss.detach(), rtol=1e-5, atol=1e-5, what="hf on empty response")


def test_simpo_all_chosen_ignored_gives_zero_nll():
    x, w, _, target = make_simpo_problem(n_pairs=2)
    target[:2] = IGNORE  # every chosen token ignored: N_w = 0
    for simpo in (ref.linear_simpo_loss_fp64, ref.hf_linear_simpo_loss):
        loss, metrics = simpo(x, w, target)
        assert torch.isfinite(loss) and metrics["nll_loss"] == 0, simpo.__name__
        assert metrics["logps/chosen"] == 0 and metrics["rewards/chosen"] == 0, simpo.__name__


@pytest.mark.parametrize("options, label_smoothing", [("paired", 0.0), ("all-ignored", 0.3)])
def test_simpo_fp64_gradcheck(options, label_smoothing):
    x, w, b, target = make_simpo_problem(n_pairs=2, seq=3, hidden=3, vocab=5, bias=True)
    if options == "all-ignored":
        target[2] = IGNORE  # a rejected response with no tokens
    leaves = [t.requires_grad_() for t in (x, w, b)]
    # fast_mode checks random projections of the Jacobian (~20x faster here); the exact per-token
    # formula and the TRL re-derivation's gradients are compared element-wise in other tests.
    assert torch.autograd.gradcheck(
        lambda x, w, b: ref.linear_simpo_loss_fp64(x, w, target, linear_bias=b, beta=2.0, gamma=1.0,
                                                   alpha=0.5, label_smoothing=label_smoothing)[0],
        leaves,
        fast_mode=True,
    )


@pytest.mark.parametrize("label_smoothing", [0.0, 0.3])
@pytest.mark.parametrize("alpha", [1.0, 0.0])
def test_simpo_per_token_gradient_matches_design_formula(label_smoothing, alpha):
    """Autograd of logps -> loss equals the per-token upstream gradient the kernel's backward uses.

    design.md (ε = 0): chosen g = −β·σ(−z_i)/(B·n_w,i) − α/N_w, rejected g = +β·σ(−z_i)/(B·n_l,i).
    For ε > 0 the σ(−z) factor generalizes to (1−ε)·σ(−z) − ε·σ(z) (= −∂/∂z of the pair loss).
    """
    torch.manual_seed(5)
    n_pairs, seq, beta, gamma = 3, 7, 2.0, 1.0
    logps = (-torch.rand(2 * n_pairs, seq, dtype=torch.float64) * 5).requires_grad_()  # [2B, S]
    mask = torch.rand(2 * n_pairs, seq) > 0.3
    mask[0] = False  # one all-ignored chosen response: its tokens get no gradient at all
    mask[n_pairs + 2, 0] = True  # and at least one token everywhere else
    loss, _ = ref.simpo_from_logprobs(logps, mask, beta=beta, gamma=gamma, alpha=alpha,
                                       label_smoothing=label_smoothing)
    (grad_autograd,) = torch.autograd.grad(loss, logps)

    with torch.no_grad():
        maskf = mask.to(torch.float64)
        n = maskf.sum(-1).clamp_min(1)  # [2B], max(n, 1)
        avg = (logps * maskf).sum(-1) / n
        z = beta * (avg[:n_pairs] - avg[n_pairs:]) - gamma  # [B]
        if label_smoothing == 0.0:
            pull = torch.sigmoid(-z)  # design.md's σ(−z_i), literally
        else:
            pull = (1 - label_smoothing) * torch.sigmoid(-z) - label_smoothing * torch.sigmoid(z)
        n_chosen_tokens = maskf[:n_pairs].sum().clamp_min(1)
        g_chosen = -beta * pull[:, None] / (n_pairs * n[:n_pairs, None]) - alpha / n_chosen_tokens
        g_rejected = beta * pull[:, None] / (n_pairs * n[n_pairs:, None])
        expected = torch.cat([g_chosen, g_rejected]).expand(-1, seq) * maskf  # masked tokens: 0
    assert_close_verbose(grad_autograd, expected, rtol=1e-12, atol=1e-14, what="dL/dlogp")
    assert torch.all(grad_autograd[0] == 0)


# ----------------------------------------------------------------------------------------------
# The GEMM floor helpers
# ----------------------------------------------------------------------------------------------


def test_cublas_helpers_compute_the_three_gemms():
    torch.manual_seed(6)
    x = torch.randn(5, 4, dtype=torch.float64)  # [T, H]
    w = torch.randn(7, 4, dtype=torch.float64)  # [V, H]
    g = torch.randn(5, 7, dtype=torch.float64)  # [T, V]
    logits, grad_input, grad_weight = ref.cublas_3gemm(x, w, g)
    assert_close_verbose(logits, torch.einsum("th,vh->tv", x, w), rtol=1e-12, atol=1e-12, what="logits")
    assert_close_verbose(grad_input, torch.einsum("tv,vh->th", g, w), rtol=1e-12, atol=1e-12, what="dX")
    assert_close_verbose(grad_weight, torch.einsum("tv,th->vh", g, x), rtol=1e-12, atol=1e-12, what="dW")
    assert torch.equal(ref.cublas_1gemm(x, w), logits)


# ----------------------------------------------------------------------------------------------
# Randomized properties
# ----------------------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(
    batch_shape=st.lists(st.integers(1, 4), min_size=1, max_size=2).map(tuple),
    hidden=st.integers(1, 6),
    vocab=st.integers(2, 9),
    use_class_weight=st.booleans(),
    bias=st.booleans(),
    label_smoothing=st.sampled_from([0.0, 0.1, 1.0]),
    z_loss=st.sampled_from([0.0, 1e-3, 0.5]),
    softcap=st.sampled_from([None, 1.0, 30.0]),
    reduction=st.sampled_from(["none", "sum", "mean"]),
    ignore_prob=st.sampled_from([0.0, 0.4, 1.0]),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_fp64_and_upcast_match_torch(batch_shape, hidden, vocab, use_class_weight, bias,
                                              label_smoothing, z_loss, softcap, reduction, ignore_prob, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*batch_shape, hidden, generator=gen, dtype=torch.float64)
    w = torch.randn(vocab, hidden, generator=gen, dtype=torch.float64)
    b = torch.randn(vocab, generator=gen, dtype=torch.float64) if bias else None
    target = torch.randint(0, vocab, batch_shape, generator=gen)
    target[torch.rand(batch_shape, generator=gen) < ignore_prob] = IGNORE
    weight = torch.rand(vocab, generator=gen, dtype=torch.float64) + 0.1 if use_class_weight else None
    kwargs = dict(weight=weight, reduction=reduction, ignore_index=IGNORE, label_smoothing=label_smoothing,
                  z_loss=z_loss, softcap=softcap)

    x.requires_grad_()
    loss64 = ref.linear_cross_entropy_fp64(x, w, target, linear_bias=b, **kwargs)
    expected = torch_cross_entropy(F.linear(x, w, b), target, **kwargs)
    assert_close_verbose(loss64, expected, rtol=1e-10, atol=1e-10, what="fp64 vs torch")

    loss32 = ref.upcast_linear_cross_entropy(x.float(), w.float(), target, linear_bias=None if b is None else b.float(),
                                             **{**kwargs, "weight": None if weight is None else weight.float()})
    assert_close_verbose(loss32.double(), loss64, rtol=1e-4, atol=1e-4, what="upcast vs fp64")

    # Ignored tokens contribute nothing: zero loss and zero gradient into their input rows.
    ignored = target == IGNORE
    if reduction == "none":
        assert torch.all(loss64[ignored] == 0)
    total = loss64.sum()
    if torch.isfinite(total):
        (grad_x,) = torch.autograd.grad(total, x)
        assert torch.all(grad_x[ignored] == 0)
