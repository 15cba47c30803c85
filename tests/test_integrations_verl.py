"""fusedkern.integrations.verl against verl's own torch path (CPU, fp32, Triton's interpreter).

verl's actor computes its log-probs and entropy through `FusedLinearForPPO` (torch) or its Triton
`linear_cross_entropy` (CUDA only, so its reference here is the torch path, which computes the same quantities on
materialized logits). Patched, both run fusedkern: the same log-probs, entropy (and dtypes) and the same gradients
of the hidden states and of the weight, from upstream gradients on both outputs, at temperature 1 and 0.7, for
[T, H] and [B, S, H] inputs; verl's own Hugging Face forward (`dense_common.forward_with_torch_backend` and
`forward_with_triton_backend` on a tiny Llama) gives the unpatched torch backend's outputs and parameter
gradients; verl's torch functions never run while patched. The patch: every reference replaced and restored.

verl 0.9.1's package `__init__` imports Ray, tensordict and the rest of its trainer stack, and a plain
`pip install verl==0.9.1` pins transformers < 5.11 and pulls Ray: the suite does not install it
(requirements.txt), and these tests skip without it. With `pip install --no-deps verl==0.9.1` they run: if
`import verl` fails for a missing dependency, the three modules the hooks live in (which need only torch and
Transformers) are loaded on their own, under stand-ins for verl's packages."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

from fusedkern._runtime import interpreting
from fusedkern.integrations import verl as fk_verl

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("verl") is None,
                       reason="needs verl (not in requirements.txt: pip install --no-deps verl==0.9.1; "
                              "docs/integrations.md, verl)"),
    pytest.mark.skipif(not interpreting(), reason="CPU tensors need Triton's interpreter (on when no GPU is visible)"),
    pytest.mark.usefixtures("one_cpu_thread"),
]

DENSE = "verl.models.transformers.dense_common"
PACKAGES = ("verl", "verl.utils", "verl.utils.experimental", "verl.utils.kernel", "verl.models",
            "verl.models.transformers")
TOL = dict(rtol=1e-5, atol=1e-6)
GRAD_TOL = dict(rtol=1e-5, atol=1e-5)  # gradients of O(1): sums over the tokens and the vocabulary in fp32


def _purge_verl():
    for name in [n for n in sys.modules if n == "verl" or n.startswith("verl.")]:
        del sys.modules[name]


@pytest.fixture(scope="module")
def verl():
    """(torch_functional, linear_cross_entropy module, dense_common) — imported through verl's packages when they
    import, else under stand-in packages (empty modules with verl's paths) that skip their `__init__`."""
    names = (fk_verl.TORCH_FUNCTIONAL, fk_verl.KERNEL, DENSE)
    stubbed = False
    try:
        modules = [importlib.import_module(n) for n in names]
    except ImportError:  # Ray, tensordict, … are missing: only the hooks' modules, which need torch and Transformers
        _purge_verl()
        root = Path(importlib.util.find_spec("verl").submodule_search_locations[0])
        for name in PACKAGES:
            package = types.ModuleType(name)
            package.__path__ = [str(root.joinpath(*name.split(".")[1:]))]
            sys.modules[name] = package
        stubbed = True
        modules = [importlib.import_module(n) for n in names]
    yield types.SimpleNamespace(tf=modules[0], kernel=modules[1], dense=modules[2])
    fk_verl.unpatch()
    if stubbed:
        _purge_verl()


@pytest.fixture(autouse=True)
def unpatched():
    fk_verl.unpatch()
    yield
    fk_verl.unpatch()


@pytest.fixture
def verl_torch_path_refused(verl, monkeypatch):
    """While patched, verl's torch functions must not run: they raise; returns the list of fusedkern calls."""
    def refuse(*args, **kwargs):
        raise AssertionError("verl's own torch path ran while patched")

    calls = []
    real = fk_verl.linear_logprobs
    monkeypatch.setattr(fk_verl, "linear_logprobs", lambda *a, **k: calls.append(1) or real(*a, **k))

    @contextlib.contextmanager
    def guard():
        with monkeypatch.context() as m:
            m.setattr(verl.tf, "_fused_linear_for_ppo_fwd", refuse)
            m.setattr(verl.tf, "_fused_linear_for_ppo_bwd", refuse)
            with fk_verl.patched():
                yield
    return guard, calls


def inputs(shape, seed=0, V=48, H=24):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, H, generator=g).requires_grad_()
    weight = (0.4 * torch.randn(V, H, generator=g)).requires_grad_()
    ids = torch.randint(0, V, shape, generator=g)
    return hidden, weight, ids


def step(fn, hidden, weight, ids, temperature, seed=1):
    """Outputs of fn and the gradients of hidden and weight from random upstream gradients on both outputs."""
    hidden.grad = weight.grad = None
    log_probs, entropy = fn(hidden, weight, ids, temperature)
    g = torch.Generator().manual_seed(seed)
    up_lp = torch.randn(log_probs.shape, generator=g)
    up_ent = torch.randn(entropy.shape, generator=g)
    ((log_probs * up_lp).sum() + (entropy.float() * up_ent).sum()).backward()
    return log_probs.detach(), entropy.detach(), hidden.grad.clone(), weight.grad.clone()


def assert_same(got, want):
    for name, a, b in zip(("log_probs", "entropy", "d hidden", "d weight"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape, b.shape)
        tol = GRAD_TOL if name.startswith("d ") else TOL
        torch.testing.assert_close(a, b, **tol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("shape", [(13,), (2, 7)], ids=["2d", "3d"])
def test_fused_linear_for_ppo_matches_verls_torch_path(verl, verl_torch_path_refused, temperature, shape):
    guard, calls = verl_torch_path_refused
    module = verl.tf.FusedLinearForPPO(chunk_size=4)  # built before the patch: the class's forward is patched
    hidden, weight, ids = inputs(shape)
    want = step(module.forward, hidden, weight, ids, temperature)
    with guard():
        got = step(module.forward, hidden, weight, ids, temperature)
        liger = step(verl.tf.FusedLinearForPPO(impl_backend="liger").forward, hidden, weight, ids, temperature)
    assert_same(got, want)
    assert_same(liger, want)
    assert len(calls) == 2
    assert want[0].shape == ids.shape and want[0].dtype == torch.float32


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_linear_cross_entropy_matches_the_torch_path(verl, verl_torch_path_refused, temperature, reduction):
    """verl's Triton kernel (CUDA only) against the torch path's log-probs and entropy (float32, flattened), with
    verl's reductions of the log-probs; the hidden states' gradient in their own [B, S, H] shape."""
    guard, calls = verl_torch_path_refused
    hidden, weight, ids = inputs((2, 9), seed=2)

    def reference(h, w, y, t):
        log_probs, entropy = verl.tf.FusedLinearForPPOFunction.apply(h, w, y, t, 5)
        log_probs, entropy = log_probs.reshape(-1), entropy.reshape(-1).float()
        if reduction == "sum":
            log_probs = log_probs.sum()
        elif reduction == "mean":
            log_probs = log_probs.mean()
        return log_probs, entropy

    want = step(reference, hidden, weight, ids, temperature)
    with guard():
        got = step(lambda h, w, y, t: verl.kernel.linear_cross_entropy(h, w, y, t, reduction), hidden, weight, ids,
                   temperature)
    assert_same(got, want)
    assert got[2].shape == hidden.shape and got[1].shape == (ids.numel(),)
    assert len(calls) == 1


def test_under_bf16_autocast_dtypes_and_values_follow_verl(verl):
    """Under bf16 autocast verl's torch path computes the logits in bf16, and returns the entropy in the hidden
    states' dtype (fp32 here, its output buffer's): so does the patch, with values within bf16 rounding; bf16
    hidden states give a bf16 entropy."""
    module = verl.tf.FusedLinearForPPO()
    hidden, weight, ids = inputs((3, 5), seed=3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = module(hidden, weight, ids, 0.8)
        with fk_verl.patched():
            got = module(hidden, weight, ids, 0.8)
    assert [t.dtype for t in got] == [t.dtype for t in want] == [torch.float32, torch.float32]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=3e-2, atol=3e-2)
    half = hidden.detach().bfloat16()
    want = module(half, weight.detach().bfloat16(), ids, 0.8)
    with fk_verl.patched():
        got = module(half, weight.detach().bfloat16(), ids, 0.8)
    assert [t.dtype for t in got] == [t.dtype for t in want] == [torch.float32, torch.bfloat16]
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), rtol=3e-2, atol=3e-2)


@pytest.fixture(scope="module")
def tiny_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).train()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_verls_hf_forward_through_the_patch(verl, verl_torch_path_refused, tiny_llama, backend):
    """verl's own model forward (what its monkey patch installs on a Hugging Face model with use_fused_kernels):
    patched, the torch and the Triton backends give the unpatched torch backend's log-probs, entropy and every
    parameter's gradient."""
    guard, calls = verl_torch_path_refused
    model = tiny_llama
    ids = torch.randint(0, 48, (2, 10), generator=torch.Generator().manual_seed(4))

    def run(forward):
        model.zero_grad(set_to_none=True)
        out = forward(model, input_ids=ids, return_dict=True, temperature=0.8)
        g = torch.Generator().manual_seed(5)
        ((out.log_probs * torch.randn(out.log_probs.shape, generator=g)).sum()
         + (out.entropy.float() * torch.randn(out.entropy.shape, generator=g)).sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return out.log_probs.detach(), out.entropy.detach(), grads

    want = run(verl.dense.forward_with_torch_backend)
    with guard():
        got = run(getattr(verl.dense, f"forward_with_{backend}_backend"))
    assert calls
    for a, b in zip(got[:2], want[:2]):
        torch.testing.assert_close(a.reshape(b.shape).float(), b.float(), **TOL)
    assert got[2].keys() == want[2].keys() and "lm_head.weight" in want[2]
    for name, grad in want[2].items():
        torch.testing.assert_close(got[2][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_patch_replaces_every_reference_and_unpatch_restores(verl):
    original_forward = verl.tf.FusedLinearForPPO.__dict__["forward"]
    original_lce = verl.kernel.linear_cross_entropy
    importer = types.ModuleType("verl._fusedkern_probe")  # a verl module that imported the kernel at its top
    importer.linear_cross_entropy = original_lce
    sys.modules[importer.__name__] = importer
    try:
        fk_verl.patch()
        assert fk_verl.is_patched()
        fused = verl.kernel.linear_cross_entropy
        assert getattr(fused, fk_verl.MARK) and importer.linear_cross_entropy is fused
        assert getattr(verl.tf.FusedLinearForPPO.forward, fk_verl.MARK)
        late = types.ModuleType("verl._fusedkern_late")  # imported while patched: it copied fusedkern's
        late.linear_cross_entropy = fused
        sys.modules[late.__name__] = late
        fk_verl.patch()  # the same options: nothing changes
        assert verl.kernel.linear_cross_entropy is fused
        with fk_verl.patched(chunk_tokens=8):  # other options, then back to the enclosing patch
            assert verl.kernel.linear_cross_entropy is not fused
        assert fk_verl._applied.options["chunk_tokens"] is None
        fk_verl.unpatch()
        assert not fk_verl.is_patched()
        assert verl.tf.FusedLinearForPPO.__dict__["forward"] is original_forward
        assert verl.kernel.linear_cross_entropy is original_lce
        assert importer.linear_cross_entropy is original_lce and late.linear_cross_entropy is original_lce
        fk_verl.unpatch()  # a no-op
    finally:
        sys.modules.pop("verl._fusedkern_probe", None)
        sys.modules.pop("verl._fusedkern_late", None)


def test_vocab_parallel_group_runs_verls_kernel_with_a_warning(monkeypatch):
    hidden, weight, ids = inputs((6,))
    group = object()
    seen = []

    def verls(*args):
        seen.append(args)
        return "verl's"

    monkeypatch.setattr(torch.distributed, "get_world_size", lambda g=None: 2 if g is group else 1)
    fk_verl._warn_vocab_parallel.cache_clear()
    with pytest.warns(UserWarning, match="vocabulary-parallel"):
        assert fk_verl.fused_linear_cross_entropy(hidden, weight, ids, 1.0, "none", group, original=verls) == "verl's"
    assert seen and seen[0][-1] is group
    single = object()  # a group of one rank (Megatron without tensor parallelism): fusedkern's
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        log_probs, entropy = fk_verl.fused_linear_cross_entropy(hidden, weight, ids, 1.0, "none", single)
    assert log_probs.shape == entropy.shape == (6,)
    with pytest.raises(ValueError, match="reduction"):
        fk_verl.fused_linear_cross_entropy(hidden, weight, ids, 1.0, "batchmean")


def test_version_outside_the_tested_line_warns(monkeypatch):
    from importlib import metadata

    monkeypatch.setattr(metadata, "version", lambda name: "0.10.0" if name == "verl" else "0")
    with pytest.warns(UserWarning, match=r"tested with verl 0\.9\.1.*FusedLinearForPPO\.forward"):
        assert fk_verl.check_verl_version() == "0.10.0"
    monkeypatch.setattr(metadata, "version", lambda name: "0.9.3")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        fk_verl.check_verl_version()
