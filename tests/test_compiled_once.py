"""A training loop whose micro-batches score a different number of tokens each (GRPO's completions, packed SFT)
compiles and tunes every Triton kernel once, not once per token count.

Triton specializes a kernel on its arguments: a pointer on its 16-byte alignment, an int on being 1 or a multiple of
16. A per-row vector that is a row of a [planes, T] buffer, or a slice of a per-chunk count vector, is aligned or not
as T varies, and each new key is a compile (0.2–0.5 s in timed GRPO steps on an H100). The row-count GEMMs also
autotuned per exact token extent: a run of every candidate config at each new last-chunk length.

The kernels run in the interpreter here, which neither compiles nor specializes, so each launch's arguments are
recorded and bound the way Triton binds them for an sm_90 target (`create_function_from_signature`, the JIT's own
specialization): the keys a path needs at one token count must cover every other count's."""

from __future__ import annotations

import pytest
import torch
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import make_backend
from triton.runtime import interpreter
from triton.runtime.jit import JITFunction, create_function_from_signature

import fusedkern
from fusedkern import dispatch
from fusedkern._runtime import interpreting
from fusedkern.kernels import gemm_tiles, rowcount_gemm

pytestmark = pytest.mark.skipif(not interpreting(), reason="records the interpreter's launches")

H, V = 32, 67
BASE_T = 32  # every key a path needs, at a token count aligned every way
OTHER_T = (17, 18)  # odd and even, neither a multiple of 4 or 16: every [·, T] row past the first unaligned in fp32


class LaunchKeys:
    """The compile key of each kernel launch (name, specialization, options) for an sm_90 target."""

    def __init__(self):
        self.backend = make_backend(GPUTarget("cuda", 90, 32))
        self.binders = {}
        self.keys: set = set()

    def record(self, kernel, args, kwargs) -> None:
        binder = self.binders.get(kernel)
        if binder is None:
            options = {k: kernel.kwargs.get(k) for k in ("do_not_specialize", "do_not_specialize_on_alignment")}
            jit = JITFunction(kernel.fn, **options)
            binder = self.binders[kernel] = create_function_from_signature(jit.signature, jit.params, self.backend)
        _, specialization, options = binder(*args, **kwargs)
        # as the JIT keys them: the options parsed into the backend's (an autotuned launch passes every default)
        self.keys.add((kernel.fn.__name__, tuple(map(str, specialization)), str(self.backend.parse_options(options))))


@pytest.fixture
def launches(monkeypatch):
    """(keys, tunings): the compile keys of the launches since the last clear, and the row-count GEMMs' autotuned
    launches (a launch without a config runs the autotuner)."""
    keys, tunings = LaunchKeys(), []
    run = interpreter.InterpretedFunction.run

    def recording(self, *args, grid, warmup, **kwargs):
        keys.record(self, args, kwargs)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    def launch(tuned, rows, cols, device, args, flags, config):
        if config is None:
            tunings.append((tuned.fn.fn.__name__, args[4] if len(args) > 4 else None))
        return gemm_tiles.launch_persistent(tuned, rows, cols, device, args, flags, config)

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", recording)
    monkeypatch.setattr(rowcount_gemm, "launch_persistent", launch)
    monkeypatch.setattr(rowcount_gemm, "_CHOSEN", {})
    return keys, tunings


def inputs(T: int):
    gen = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(V, H, generator=gen) / 4).to(torch.bfloat16).requires_grad_()
    y = torch.randint(0, V, (T,), generator=gen)
    y[torch.rand(T, generator=gen) < 0.3] = -100
    y[0] = 5
    return x, w, y


def logprobs_entropy_step(x, w, y, impl):
    logp, entropy = fusedkern.linear_logprobs(x, w, y.clamp(min=0), impl=impl, temperature=0.7, return_entropy=True)
    (logp.sum() + 0.1 * entropy.sum()).backward()


def grpo_step(x, w, y, impl):
    mask = y != -100
    loss, _ = fusedkern.linear_grpo_loss(x[None], w, y[None], advantages=torch.ones(1), impl=impl, temperature=0.7,
                                         compute_entropy=True, old_logps=torch.zeros(1, y.shape[0]),
                                         num_items_in_batch=mask.sum())
    loss.backward()


def dpo_step(x, w, y, impl):
    pairs, targets = torch.stack([x, x.flip(0)]), torch.stack([y, y.flip(0)])  # a chosen and a rejected sequence
    loss, _ = fusedkern.linear_preference_loss(pairs, w, targets, loss_type="sigmoid", reference_free=True, impl=impl)
    loss.backward()


def distillation_step(x, w, y, impl):
    """GKD's loss against a teacher head of another hidden size (impl: the chunked strategy is the only one)."""
    teacher = torch.cat([x.detach(), x.detach()], 1)
    loss = fusedkern.linear_distillation_loss(x, w, teacher, torch.cat([w.detach(), w.detach()], 1) / 2, y, beta=0.5,
                                              weight_hard_loss=0.5, weight_soft_loss=0.5)
    loss.backward()


STEPS = {
    "logprobs": lambda x, w, y, impl: fusedkern.linear_logprobs(x, w, y.clamp(min=0), impl=impl,
                                                                temperature=0.7).sum().backward(),
    "logprobs_entropy": logprobs_entropy_step,
    "ce_mean": lambda x, w, y, impl: fusedkern.linear_cross_entropy(x, w, y, impl=impl).backward(),
    "ce_device_count": lambda x, w, y, impl: fusedkern.linear_cross_entropy(
        x, w, y, impl=impl, reduction="sum", num_valid_tokens=(y != -100).sum()).backward(),
    "grpo": grpo_step,
    "dpo": dpo_step,
}


@pytest.mark.parametrize("impl", ["chunked", "anchored"])
@pytest.mark.parametrize("step", sorted(STEPS))
def test_every_kernel_compiles_and_tunes_once_across_token_counts(launches, monkeypatch, step, impl):
    if impl == "anchored":  # the anchored pass on its torch reference producer (the Gluon one needs an sm_90 GPU)
        monkeypatch.setattr(dispatch, "anchored_producer_reason", lambda x2d, w: None)
        impl = "auto"
    keys, tunings = launches
    for _ in range(2):  # a loop's warm-up: dX's first call of a problem class tunes, its second runs the tile pair
        STEPS[step](*inputs(BASE_T), impl)
    needed, tuned = set(keys.keys), len(tunings)
    assert needed, "no Triton kernel ran"
    for T in OTHER_T:
        keys.keys.clear()
        STEPS[step](*inputs(T), impl)
        new = keys.keys - needed
        assert not new, f"T={T}: {len(new)} new compile keys of {sorted({k[0] for k in new})}"
    assert len(tunings) == tuned, f"the row-count GEMMs autotuned again: {tunings[tuned:]}"


@pytest.mark.parametrize("step, impl", [("ce_mean", "fused"), ("distillation", "chunked")])
def test_the_other_strategies_compile_once_across_token_counts(launches, step, impl):
    """impl="fused" (the ≤ 16 MiB strategy, one kernel a pass; its autotuner keys on a power-of-two bucket of T) and
    the distillation loss's row kernels."""
    keys, _ = launches
    run = distillation_step if step == "distillation" else STEPS[step]
    for _ in range(2):
        run(*inputs(BASE_T), impl)
    needed = set(keys.keys)
    for T in OTHER_T:
        keys.keys.clear()
        run(*inputs(T), impl)
        new = keys.keys - needed
        assert not new, f"T={T}: {len(new)} new compile keys of {sorted({k[0] for k in new})}"


def test_a_new_key_is_seen(launches):
    """The recorder sees what Triton would compile anew: the row kernel's per-row vectors at an odd count are
    unaligned, which the kernel's own options leave out of its key, and which a kernel without them keys on."""
    from fusedkern.kernels import ce_rows

    keys, _ = launches
    kernel = ce_rows._row_stats_kernel.fn
    saved = dict(kernel.kwargs)
    try:
        kernel.kwargs.pop("do_not_specialize_on_alignment")
        keys.binders.clear()
        STEPS["logprobs"](*inputs(BASE_T), "chunked")
        needed = set(keys.keys)
        keys.keys.clear()
        STEPS["logprobs"](*inputs(17), "chunked")
        assert {k[0] for k in keys.keys - needed} == {"_row_stats_kernel"}
    finally:
        kernel.kwargs.clear()
        kernel.kwargs.update(saved)


class GluonRecorder:
    """Stands in for a Gluon kernel (which needs an sm_90 GPU): each launch's compile key, and nothing run."""

    def __init__(self, kernel, keys: LaunchKeys):
        self.kernel, self.keys = kernel, keys
        self.binder = create_function_from_signature(kernel.signature, kernel.params, keys.backend)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            _, specialization, options = self.binder(*args, **kwargs)
            self.keys.keys.add((self.kernel.fn.__name__, tuple(map(str, specialization)),
                                str(self.keys.backend.parse_options(options))))
        return launch


def anchored_passes(T: int) -> None:
    """The anchored pass's three callers of the Gluon producer (whose outputs stay unwritten here: the row kernels
    after it flag every row, and the exact pass computes them): the gradient pass over several chunks of a balanced
    plan, the per-token log-probs with E kept, the no-grad pass over several launches; and the statistics kernel's
    loss-only pass over several launches."""
    from fusedkern import anchored
    from fusedkern.engine import LossOptions
    from fusedkern.kernels import gluon_anchored_exp, gluon_logits_stats

    x, w, y = inputs(T)
    x, w = x.detach(), w.detach()
    x, w = torch.cat([x, x], 1), torch.cat([w, w], 1)  # H 64: the TMA boxes' K
    opts, launch = LossOptions(logit_scale=1 / 0.7), gluon_anchored_exp.launch
    plan = anchored.anchored_plan(T, V, 2 * H, need_dw=True, fp32_accum=True, chunk_tokens=T // 2 + 1)
    anchored.anchored_loss_and_grads(x, w, y, opts, torch.ones(1), need_dx=True, need_dw=True, plan=plan,
                                     producer=launch)
    anchored.logprobs_forward(x, w, y, opts, producer=launch, with_entropy=True)
    anchored.loss_only(x, w, y, opts, producer=launch, chunk_tokens=T // 3 + 1)
    gluon_logits_stats.loss_only(x, w, y, -100, chunk_tokens=T // 3 + 1)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the row kernels read the producer's unwritten outputs
def test_the_gluon_kernels_compile_once_across_token_counts(launches, monkeypatch):
    pytest.importorskip("triton.experimental.gluon")
    from fusedkern.kernels import gluon_anchored_exp, gluon_logits_stats

    keys, _ = launches
    for module, name in ((gluon_anchored_exp, "_anchored_exp_kernel"), (gluon_logits_stats, "_logits_partials_kernel")):
        monkeypatch.setattr(module, name, GluonRecorder(getattr(module, name), keys))
    for _ in range(2):
        anchored_passes(BASE_T)
    needed = set(keys.keys)
    assert {"_anchored_exp_kernel", "_logits_partials_kernel"} <= {k[0] for k in needed}
    for T in OTHER_T:
        keys.keys.clear()
        anchored_passes(T)
        new = keys.keys - needed
        assert not new, f"T={T}: {len(new)} new compile keys of {sorted({k[0] for k in new})}"
