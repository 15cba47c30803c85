"""fusedkern with a sharded LM head, in two CPU processes over gloo (fusedkern/sharded.py).

Two ranks are spawned once (the `ranks` fixture) and run every scenario on their own tokens, saving what
they got (losses, gradients as full tensors); each test recomputes its scenarios unsharded and compares:
- a raw DTensor weight (Shard(0) over an uneven vocab, Replicate) passed to linear_cross_entropy,
  linear_logprobs and linear_simpo_loss: each rank's loss is the single-process loss of its tokens, and
  the weight's gradient is the SUM over the ranks of each rank's gradient (DTensor's Partial reduced);
- FSDP2 `fully_shard` on a plain embedding + lm_head model and on a tiny patched Llama, with lm_head as
  its own unit and with the root only: losses and every gradient equal the unsharded model's, with the
  gradients AVERAGED over the ranks, as FSDP2 reduces them; read outside lm_head's own forward, a unit's
  weight is a raw DTensor and gets the sum (world size × FSDP's mean), the pitfall docs/integrations.md names;
- a DTensor input or target raises TypeError.
A rank that hangs (a collective the other never joins) fails the test after TIMEOUT_S.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import time

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

import fusedkern
from fusedkern._runtime import interpreting
from fusedkern.integrations.fsdp import call_as_forward

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)
if not interpreting():
    pytest.skip("the ranks run the kernels on CPU tensors, through Triton's interpreter (on when no GPU is visible)",
                allow_module_level=True)

# under pytest-xdist (--dist loadgroup) these tests go to one worker: the ranks are spawned once there
pytestmark = pytest.mark.xdist_group("fsdp_gloo")

# imported only where used: every spawned rank imports this module, and Transformers takes seconds
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None

WORLD_SIZE = 2
TIMEOUT_S = 120          # a hang fails the test instead of CI; a normal run takes a few seconds
VOCAB, HIDDEN = 11, 8    # 11 rows over 2 ranks: an uneven Shard(0)
LEAD = (2, 3)            # each rank's tokens [2, 3] (the public functions take any leading shape)
TOL = dict(rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# data: every rank builds all ranks' data from the same seed and keeps its own slice


def dtensor_data():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(VOCAB, HIDDEN, generator=g)
    b = torch.randn(VOCAB, generator=g)
    class_weight = torch.rand(VOCAB, generator=g) + 0.5
    x = torch.randn(WORLD_SIZE, *LEAD, HIDDEN, generator=g)
    y = torch.randint(0, VOCAB, (WORLD_SIZE, *LEAD), generator=g)
    y[0, 0, 0] = y[1, 1, 2] = -100
    return w, b, class_weight, x, y


def lm_batch(vocab: int):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (WORLD_SIZE, 2, 6), generator=g)
    labels = ids.clone()
    labels[0, 0, :2] = -100  # a prompt
    labels[1, 1, -3:] = -100  # padding
    return ids, labels


class TinyLM(nn.Module):
    """An embedding and an lm_head whose loss comes from fusedkern, run as lm_head's forward (FSDP2 then
    gathers the weight there) unless `weight_outside_forward`."""

    def __init__(self, weight_outside_forward: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=True)
        self.weight_outside_forward = weight_outside_forward

    def loss(self, hidden, labels):
        return fusedkern.linear_cross_entropy(hidden, self.lm_head.weight, labels, linear_bias=self.lm_head.bias)

    def forward(self, ids, labels):
        hidden = self.embed(ids)
        if self.weight_outside_forward:
            return self.loss(hidden, labels)
        return call_as_forward(self.lm_head, self.loss, hidden, labels)


def tiny_llama():
    import transformers
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                      attn_implementation="eager", tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).train()


LOSSES = ("ce_chunked", "ce_fused", "logprobs", "simpo")


def public_loss(name, x, w, y, b, class_weight):
    """One of the public entry points on one rank's tokens, as a scalar to differentiate."""
    if name == "logprobs":
        return fusedkern.linear_logprobs(x, w, y, linear_bias=b).sum()
    if name == "simpo":
        return fusedkern.linear_simpo_loss(x, w, y, linear_bias=b, beta=2.0, gamma=0.5, alpha=0.3)[0]
    impl = name.removeprefix("ce_")
    return fusedkern.linear_cross_entropy(x, w, y, linear_bias=b, weight=class_weight, impl=impl)


# ----------------------------------------------------------------------------------------------
# the ranks' side


def run_dtensor(rank, mesh):
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    w, b, class_weight, x, y = dtensor_data()
    out = {}
    for placement, names in ((Shard(0), LOSSES), (Replicate(), LOSSES[:1])):
        for name in names:
            w_d = distribute_tensor(w, mesh, [placement]).requires_grad_()
            b_d = distribute_tensor(b, mesh, [placement]).requires_grad_()
            x_r = x[rank].clone().requires_grad_()
            loss = public_loss(name, x_r, w_d, y[rank], b_d, distribute_tensor(class_weight, mesh, [Replicate()]))
            loss.backward()
            assert isinstance(w_d.grad, DTensor) and isinstance(b_d.grad, DTensor)
            out[f"{placement!r}/{name}"] = dict(loss=loss.detach(), dx=x_r.grad, dw=w_d.grad.full_tensor(),
                                                db=b_d.grad.full_tensor(), placements=str(w_d.grad.placements))
    return out


def run_refusals(rank, mesh):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    w, _, _, x, y = dtensor_data()
    messages = {}
    for name, args in (("input", (distribute_tensor(x[rank], mesh, [Shard(0)]), w, y[rank])),
                       ("target", (x[rank], w, distribute_tensor(y[rank], mesh, [Replicate()])))):
        for fn in ("linear_cross_entropy", "linear_logprobs", "linear_simpo_loss"):
            try:
                getattr(fusedkern, fn)(*args)
            except TypeError as exc:
                messages[f"{fn}/{name}"] = str(exc)
            else:
                messages[f"{fn}/{name}"] = None
    return messages


def shard(model, mesh, lm_head_unit: bool, layers=()):
    from torch.distributed.fsdp import fully_shard
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    if lm_head_unit:
        fully_shard(model.lm_head, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def full_grads(model):
    return {name: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            for name, p in model.named_parameters()}


TINY_LM_MODES = ("unit", "root", "unit_outside")  # lm_head its own unit / the root only / a unit read outside
LLAMA_MODES = ("unit", "root")                    # each decoder layer and lm_head their own units / the root only


def run_tiny_lm(rank, mesh):
    ids, labels = lm_batch(VOCAB)
    out = {}
    for mode in TINY_LM_MODES:
        model = shard(TinyLM(weight_outside_forward=mode == "unit_outside"), mesh, lm_head_unit=mode != "root")
        loss = model(ids[rank], labels[rank])
        loss.backward()
        out[mode] = dict(loss=loss.detach(), grads=full_grads(model))
    return out


def run_llama(rank, mesh):
    from fusedkern.integrations.transformers import patch
    ids, labels = lm_batch(VOCAB)
    out = {}
    for mode in LLAMA_MODES:
        model = tiny_llama()
        if mode == "unit":  # patched before fully_shard here, after it below
            patch(model)
        model = shard(model, mesh, lm_head_unit=mode == "unit", layers=model.model.layers if mode == "unit" else ())
        if mode == "root":
            patch(model)
        result = model(input_ids=ids[rank], labels=labels[rank])
        result.loss.backward()
        out[mode] = dict(loss=result.loss.detach(), logits=result.logits, grads=full_grads(model))
    return out


def run_rank(rank: int, folder: str) -> None:
    """One rank of every scenario (spawned): its results go to folder/rank{rank}.pt."""
    torch.set_num_threads(1)  # two ranks (and maybe another test's two) share the CI machine's cores
    # a file rendezvous: a free port picked by the parent could be taken by another test's ranks before
    # these bind it
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(folder, 'rendezvous')}", rank=rank,
                            world_size=WORLD_SIZE)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (WORLD_SIZE,))
        results = dict(dtensor=run_dtensor(rank, mesh), refusals=run_refusals(rank, mesh),
                       tiny_lm=run_tiny_lm(rank, mesh), llama=run_llama(rank, mesh) if HAS_TRANSFORMERS else None)
        torch.save(results, os.path.join(folder, f"rank{rank}.pt"))
        dist.barrier()  # no rank tears the group down while the other may still use it
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# the test process's side


def spawn_ranks(folder: str) -> None:
    """Run every scenario on WORLD_SIZE ranks, their results into `folder`. A rank's exception fails the test
    with its traceback; ranks still running after TIMEOUT_S are killed and the test fails."""
    context = mp.start_processes(run_rank, args=(folder,), nprocs=WORLD_SIZE, join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    while not context.join(timeout=max(deadline - time.monotonic(), 0.0)):
        if time.monotonic() >= deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                    process.join()
            pytest.fail(f"the ranks did not finish within {TIMEOUT_S} s (a hang)")


@pytest.fixture(scope="session")
def ranks(tmp_path_factory) -> list:
    """Every rank's results (a dict per rank). The ranks take seconds to start, so they run once per test
    session, and under pytest-xdist once for all its workers: the first to get here spawns them into the
    run's shared temporary folder while the others wait on a lock."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        folder = tmp_path_factory.mktemp("fsdp_ranks")
        spawn_ranks(str(folder))
    else:
        shared = tmp_path_factory.getbasetemp().parent  # this run's folder, above each worker's own
        folder = shared / "fsdp_ranks"
        with open(shared / "fsdp_ranks.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (folder / "done").exists():
                folder.mkdir(exist_ok=True)
                spawn_ranks(str(folder))
                (folder / "done").touch()
    return [torch.load(folder / f"rank{r}.pt", weights_only=False) for r in range(WORLD_SIZE)]


def unsharded_grads(model, loss_of_rank):
    """The ranks' losses, and every parameter's gradient of their mean over the ranks (what FSDP2 leaves),
    on one unsharded model."""
    model.zero_grad(set_to_none=True)
    losses = [loss_of_rank(r) for r in range(WORLD_SIZE)]
    (sum(losses) / WORLD_SIZE).backward()
    return [loss.detach() for loss in losses], {name: p.grad for name, p in model.named_parameters()}


def test_dtensor_weight_gradient_is_the_sum_over_ranks(ranks):
    ranks = [result["dtensor"] for result in ranks]
    w, b, class_weight, x, y = dtensor_data()
    assert len(ranks[0]) == len(LOSSES) + 1
    for key in ranks[0]:
        placement, name = key.split("/")
        w_ref, b_ref = w.clone().requires_grad_(), b.clone().requires_grad_()
        losses, dxs = [], []
        for r in range(WORLD_SIZE):
            x_r = x[r].clone().requires_grad_()
            loss = public_loss(name, x_r, w_ref, y[r], b_ref, class_weight)
            loss.backward()
            losses.append(loss.detach())
            dxs.append(x_r.grad)
        for r in range(WORLD_SIZE):
            got = ranks[r][key]
            torch.testing.assert_close(got["loss"], losses[r], **TOL, msg=f"{key} rank {r}: loss")
            torch.testing.assert_close(got["dx"], dxs[r], **TOL, msg=f"{key} rank {r}: dX")
            # w_ref.grad accumulated every rank's gradient: the sum, which is what the DTensor must hold
            torch.testing.assert_close(got["dw"], w_ref.grad, **TOL, msg=f"{key} rank {r}: dW is not the sum")
            torch.testing.assert_close(got["db"], b_ref.grad, **TOL, msg=f"{key} rank {r}: db is not the sum")
            assert got["placements"] == f"({placement},)", f"{key}: the gradient's placements {got['placements']}"


def test_dtensor_input_or_target_raises_type_error(ranks):
    ranks = [result["refusals"] for result in ranks]
    for r, messages in enumerate(ranks):
        assert len(messages) == 6
        for key, message in messages.items():
            assert message is not None, f"rank {r}: {key} as a DTensor was accepted"
            assert key.split("/")[1] in message and "to_local()" in message, message


def test_fsdp2_tiny_lm_matches_unsharded(ranks):
    ranks = [result["tiny_lm"] for result in ranks]
    ids, labels = lm_batch(VOCAB)
    model = TinyLM()
    losses, grads = unsharded_grads(model, lambda r: model(ids[r], labels[r]))
    for mode in TINY_LM_MODES:
        for r in range(WORLD_SIZE):
            got = ranks[r][mode]
            torch.testing.assert_close(got["loss"], losses[r], **TOL, msg=f"{mode} rank {r}: loss")
            assert got["grads"].keys() == grads.keys()
            for name, grad in grads.items():
                # read outside lm_head's forward, lm_head's weight and bias are raw DTensors: the sum over ranks
                scale = WORLD_SIZE if mode == "unit_outside" and name.startswith("lm_head.") else 1
                torch.testing.assert_close(got["grads"][name], scale * grad, **TOL, msg=f"{mode} rank {r}: {name}")


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs Hugging Face Transformers (pip install -e '.[hf]' in a clone)")
def test_fsdp2_patched_llama_matches_unpatched_unsharded(ranks):
    ranks = [result["llama"] for result in ranks]
    ids, labels = lm_batch(VOCAB)
    model = tiny_llama()  # unpatched: Transformers' own loss on materialized logits
    losses, grads = unsharded_grads(model, lambda r: model(input_ids=ids[r], labels=labels[r]).loss)
    for mode in LLAMA_MODES:
        for r in range(WORLD_SIZE):
            got = ranks[r][mode]
            assert got["logits"] is None  # the patched path ran
            torch.testing.assert_close(got["loss"], losses[r], **TOL, msg=f"{mode} rank {r}: loss")
            assert got["grads"].keys() == grads.keys()
            for name, grad in grads.items():
                torch.testing.assert_close(got["grads"][name], grad, **TOL, msg=f"{mode} rank {r}: {name}")


def test_unsharded_reference_differs_between_ranks():
    """The ranks' batches differ, so that a sum and a mean of their gradients, or one rank's gradient,
    cannot be mistaken for each other in the tests above."""
    ids, labels = lm_batch(VOCAB)
    model = TinyLM()
    grads = []
    for r in range(WORLD_SIZE):
        model.zero_grad(set_to_none=True)
        model(ids[r], labels[r]).backward()
        grads.append(model.lm_head.weight.grad.clone())
    assert not torch.allclose(grads[0], grads[1], rtol=1e-2, atol=1e-3)
