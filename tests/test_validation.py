"""Bad input gets a clear error naming the argument — never a wrong answer or a crash in a kernel."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fusedkern
from tests.conftest import DEVICE

H, V, T = 8, 11, 5


def good():
    return dict(input=torch.randn(T, H, device=DEVICE), linear_weight=torch.randn(V, H, device=DEVICE),
                target=torch.randint(0, V, (T,), device=DEVICE))


def call_ce(**overrides):
    args = good()
    args.update(overrides)
    return fusedkern.linear_cross_entropy(args.pop("input"), args.pop("linear_weight"), args.pop("target"), **args)


CE_CASES = [
    (dict(input=[[1.0] * H]), TypeError, "input must be a torch.Tensor"),
    (dict(input=torch.randn(T, H, dtype=torch.float64)), TypeError, "input must have dtype"),
    (dict(input=torch.randn(T, 0)), ValueError, "input must not be empty"),  # a batch of no token is allowed
    (dict(input=torch.randn(T, H + 1)), ValueError, "linear_weight.shape"),
    (dict(linear_weight=torch.randn(V)), ValueError, "linear_weight must have 2"),
    (dict(linear_weight=torch.randn(V, H, dtype=torch.float16)), TypeError, "linear_weight must have the same dtype"),
    (dict(linear_weight=torch.randn(V, H, device="meta")), ValueError, "linear_weight must be on the same device"),
    (dict(target=torch.rand(T)), TypeError, "target must hold class indices"),
    (dict(target=[0] * T), TypeError, "target must be a torch.Tensor"),
    (dict(linear_bias=[0.0] * V), TypeError, "linear_bias must be a torch.Tensor"),
    (dict(weight=[1.0] * V), TypeError, "weight must be a torch.Tensor"),
    (dict(weight=torch.ones(V, dtype=torch.int64)), TypeError, "weight must have dtype"),  # fp64 is accepted (module.double())
    (dict(linear_bias=torch.randn(V, dtype=torch.float16)), TypeError, "linear_bias must have the same dtype"),
    (dict(label_smoothing=-0.1), ValueError, "label_smoothing must be >= 0"),
    (dict(target=torch.zeros(T + 1, dtype=torch.long)), ValueError, "target must have shape"),
    (dict(target=torch.full((T,), V)), ValueError, r"target values must be in \[0, 11\)"),
    (dict(target=torch.full((T,), -5)), ValueError, "ignore_index=-100; found -5"),
    (dict(linear_bias=torch.randn(V + 1)), ValueError, "linear_bias must have shape"),
    (dict(weight=torch.rand(V - 1)), ValueError, "weight must have shape"),
    (dict(reduction="avg"), ValueError, "reduction must be one of"),
    (dict(impl="cuda"), ValueError, "impl must be one of"),
    (dict(weight_grad_accum="bf16"), ValueError, "weight_grad_accum must be one of"),
    (dict(label_smoothing=1.5), ValueError, "label_smoothing must be <= 1"),
    (dict(label_smoothing=float("nan")), ValueError, "label_smoothing must be finite"),
    (dict(z_loss=-1e-4), ValueError, "z_loss must be >= 0"),
    (dict(softcap=0.0), ValueError, "softcap must be > 0"),
    (dict(softcap="30"), TypeError, "softcap must be a real number"),
    (dict(chunk_tokens=0), ValueError, "chunk_tokens must be a positive int"),
    (dict(chunk_tokens=2.5), TypeError, "chunk_tokens must be an int"),
    (dict(ignore_index=1.0), TypeError, "ignore_index must be an int"),
]


@pytest.mark.parametrize("overrides,error,message", CE_CASES, ids=[c[2][:30] for c in CE_CASES])
def test_linear_cross_entropy_rejects(overrides, error, message):
    for key in ("input", "linear_weight", "target", "linear_bias", "weight"):
        if isinstance(overrides.get(key), torch.Tensor) and overrides[key].device.type != "meta":
            overrides[key] = overrides[key].to(DEVICE)
    with pytest.raises(error, match=message):
        call_ce(**overrides)


def test_ignore_index_inside_the_vocabulary_is_accepted():
    call_ce(target=torch.full((T,), 3, device=DEVICE), ignore_index=3)


def test_tensors_on_the_wrong_device_for_the_kernels():
    wrong = "meta"
    with pytest.raises(ValueError, match="input must be on a"):
        call_ce(input=torch.randn(T, H, device=wrong), linear_weight=torch.randn(V, H, device=wrong),
                target=torch.zeros(T, dtype=torch.long, device=wrong))


def test_module_rejects_unknown_options_at_construction():
    with pytest.raises(ValueError, match="reduction"):
        fusedkern.LinearCrossEntropyLoss(reduction="batchmean")


def simpo_args(**overrides):
    args = dict(input=torch.randn(4, 3, H, device=DEVICE), linear_weight=torch.randn(V, H, device=DEVICE),
                target=torch.randint(0, V, (4, 3), device=DEVICE))
    args.update(overrides)
    return args


SIMPO_CASES = [
    (dict(input=torch.randn(3, 3, H)), ValueError, "odd first dimension"),
    (dict(input=torch.randn(12, H)), ValueError, "input must have 3"),
    (dict(target=torch.randint(0, V, (4, 4))), ValueError, "target must have shape"),
    (dict(beta=0.0), ValueError, "beta must be > 0"),
    (dict(alpha=-1.0), ValueError, "alpha must be >= 0"),
    (dict(label_smoothing=0.7), ValueError, "label_smoothing must be <= 0.5"),
    (dict(gamma=float("inf")), ValueError, "gamma must be finite"),
    (dict(target=[[0] * 3] * 4), TypeError, "target must be a torch.Tensor"),
    (dict(beta="0.1"), TypeError, "beta must be a real number"),
    (dict(impl="cuda"), ValueError, "impl must be one of"),
    (dict(weight_grad_accum="bf16"), ValueError, "weight_grad_accum must be one of"),
    (dict(chunk_tokens=0), ValueError, "chunk_tokens must be a positive int"),
]


@pytest.mark.parametrize("overrides,error,message", SIMPO_CASES, ids=[c[2][:30] for c in SIMPO_CASES])
def test_linear_simpo_loss_rejects(overrides, error, message):
    args = simpo_args(**{k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in overrides.items()})
    args["input"].requires_grad_()
    with pytest.raises(error, match=message):
        fusedkern.linear_simpo_loss(args.pop("input"), args.pop("linear_weight"), args.pop("target"), **args)


def test_linear_logprobs_rejects_bad_target():
    with pytest.raises(ValueError, match="target values"):
        fusedkern.linear_logprobs(torch.randn(T, H, device=DEVICE), torch.randn(V, H, device=DEVICE),
                                  torch.full((T,), V + 3, device=DEVICE))


# The range check is read after the kernels are queued (`TargetRangeCheck`), so every path must run
# with an out-of-range target without reading outside a row, then raise.
BAD_TARGET_PATHS = [
    dict(impl="chunked", grad=False),
    dict(impl="chunked", grad=True),
    dict(impl="chunked", grad=True, reduction="none"),
    dict(impl="chunked", grad=True, weight=True, label_smoothing=0.1),
    dict(impl="chunked", grad=True, weight_grad_accum="weight_dtype", reduction="sum"),
    dict(impl="fused", grad=False, weight=True),
    dict(impl="fused", grad=True, label_smoothing=0.1, weight=True),
]


@pytest.mark.parametrize("path", BAD_TARGET_PATHS, ids=lambda p: "-".join(f"{k}={v}" for k, v in p.items()))
@pytest.mark.parametrize("bad_value", [V, V + 10**6, -1])
def test_out_of_range_target_raises_on_every_path(path, bad_value):
    path = dict(path)
    grad, with_weight = path.pop("grad"), path.pop("weight", False)
    args = good()
    args["target"][1] = bad_value  # one bad token among valid ones
    x, w = args["input"].requires_grad_(grad), args["linear_weight"].requires_grad_(grad)
    if with_weight:
        path["weight"] = torch.rand(V, device=DEVICE)
    with pytest.raises(ValueError, match=f"found {bad_value}"):
        fusedkern.linear_cross_entropy(x, w, args["target"], **path)


@pytest.mark.parametrize("impl", ["chunked", "fused"])
def test_linear_simpo_loss_rejects_out_of_range_target(impl):
    args = simpo_args()
    args["target"][2, 1] = V + 7
    with pytest.raises(ValueError, match=f"found {V + 7}"):
        fusedkern.linear_simpo_loss(args["input"].requires_grad_(), args["linear_weight"], args["target"], impl=impl)


@pytest.mark.gpu
def test_gpu_out_of_range_target_raises_through_the_pinned_flag():
    x = torch.randn(64, H, device="cuda", requires_grad=True)
    w = torch.randn(V, H, device="cuda", requires_grad=True)
    target = torch.randint(0, V, (64,), device="cuda")
    target[40] = V
    with pytest.raises(ValueError, match=f"found {V}"):
        fusedkern.linear_cross_entropy(x, w, target)
    target[40] = 0  # the same call with good targets still works: the CUDA context is intact
    fusedkern.linear_cross_entropy(x, w, target).backward()
    assert torch.isfinite(w.grad).all()


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(beta=0.0), ValueError, "beta must be > 0"),
    (dict(gamma="1"), TypeError, "gamma must be a real number"),
    (dict(alpha=-0.5), ValueError, "alpha must be >= 0"),
    (dict(label_smoothing=0.6), ValueError, "label_smoothing must be <= 0.5"),
    (dict(impl="triton"), ValueError, "impl must be one of"),
    (dict(weight_grad_accum="bf16"), ValueError, "weight_grad_accum must be one of"),
    (dict(chunk_tokens=-8), ValueError, "chunk_tokens must be a positive int"),
    (dict(ignore_index=None), TypeError, "ignore_index must be an int"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_simpo_module_rejects_bad_settings_at_construction(kwargs, error, message):
    with pytest.raises(error, match=message):
        fusedkern.LinearSimPOLoss(**kwargs)


@pytest.mark.parametrize("count", [np.int64(4), np.int32(4), np.uint8(4), torch.tensor(4, dtype=torch.int16)],
                         ids=["numpy-int64", "numpy-int32", "numpy-uint8", "tensor-int16"])
@pytest.mark.parametrize("entry", ["cross_entropy", "logprobs"])
def test_num_valid_tokens_takes_any_integer_type(count, entry):
    """A numpy integer counts like the Python int; a one-element tensor of any integer dtype like an int64 one (a
    count on the targets' device takes the row-count path, whose rounding differs from the gathered rows')."""
    args = good()
    args["target"][1] = -100
    fn = fusedkern.linear_cross_entropy if entry == "cross_entropy" else fusedkern.linear_logprobs
    same = torch.tensor(4, device=DEVICE) if isinstance(count, torch.Tensor) else 4
    assert torch.equal(fn(**args, num_valid_tokens=count), fn(**args, num_valid_tokens=same))


@pytest.mark.parametrize("count, error", [(4.0, TypeError), (True, TypeError), (np.float32(4), TypeError),
                                          (torch.tensor(4.0), TypeError), (torch.tensor([4, 4]), TypeError),
                                          (np.int64(T + 1), ValueError), (-1, ValueError)])
def test_num_valid_tokens_refuses_what_is_not_a_count(count, error):
    with pytest.raises(error, match="num_valid_tokens"):
        fusedkern.linear_cross_entropy(**good(), num_valid_tokens=count)
