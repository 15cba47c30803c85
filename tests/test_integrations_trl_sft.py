"""SFTTrainer through fusedkern's TRL patch at three GEMMs (fusedkern/integrations/trl_sft.py): the policy's head
anticipates the loss's upstream (nll, dft) and the backward finds it, on every micro-batch, under gradient
accumulation (num_items_in_batch) and with packing; the run matches TRL's own head metric by metric and parameter
by parameter (the comparison of tests/test_integrations_trl.py, same tiny Llama on CPU). A record that does not
fit the loss still trains exactly (the fallback recomputes the rows), and the trainers whose loss is not TRL's
SFT loss get no record."""

from __future__ import annotations

import pytest
import torch

import fusedkern.anticipated as anticipated
from tests import test_integrations_trl as base
from tests.test_integrations_trl import assert_same_run, build, train

pytestmark = base.pytestmark  # TRL installed, the interpreter on, one CPU thread
tiny = base.tiny  # the tiny Llama, its tokenizer and data (a module-scoped fixture)


@pytest.fixture(autouse=True)
def anticipate_sft(monkeypatch):
    """The anticipated head is opt-in (`patch(anticipate_sft=True)`); these tests build their trainers with the
    shared `build`, which patches with the defaults: the default is turned on for them."""
    import fusedkern.integrations.trl as fk_trl

    monkeypatch.setattr(fk_trl, "ANTICIPATE_SFT_DEFAULT", True)


@pytest.fixture
def splits(monkeypatch):
    """Every backward's split of the upstream: (pattern's scale s, residual rows) per call."""
    seen = []
    real = anticipated.split_upstream

    def spy(*args, **kwargs):
        split = real(*args, **kwargs)
        seen.append((split.s.item(), split.count.item()))
        return split
    monkeypatch.setattr(anticipated, "split_upstream", spy)
    return seen


def fused_calls(monkeypatch):
    import fusedkern.integrations.trl as fk_trl

    calls = {"anticipated": 0, "per_token": 0}
    for key, name in (("anticipated", "linear_logprobs_anticipated"), ("per_token", "linear_logprobs_with_stats")):
        real = getattr(fk_trl, name)

        def counted(*a, _real=real, _key=key, **k):
            calls[_key] += 1 if torch.is_grad_enabled() else 0
            return _real(*a, **k)
        monkeypatch.setattr(fk_trl, name, counted)
    return calls


def run_sft(tiny, monkeypatch, **config):
    plain = train(build("sft", tiny, False, **config), False)
    calls = fused_calls(monkeypatch)
    fused = train(build("sft", tiny, True, **config), True)
    return plain, fused, calls


@pytest.mark.parametrize("loss_type", ["nll", "dft"])
def test_sft_anticipated_with_gradient_accumulation(tiny, monkeypatch, splits, loss_type):
    """Two micro-batches a step (num_items_in_batch: s = 1/N of the whole step's tokens), two steps."""
    plain, fused, calls = run_sft(tiny, monkeypatch, gradient_accumulation_steps=2, loss_type=loss_type, max_steps=2)
    assert_same_run(plain, fused, ("entropy", "mean_token_accuracy", "num_tokens"))
    assert calls == {"anticipated": 4, "per_token": 0}
    # s = 1/N (a = −1 or −p): N the whole step's tokens, the same for both micro-batches of a step
    assert len(splits) == 4 and all(count == 0 and s > 0 for s, count in splits), splits
    assert splits[0][0] == splits[1][0] and splits[2][0] == splits[3][0]


def test_sft_anticipated_with_packing(tiny, monkeypatch, splits):
    plain, fused, calls = run_sft(tiny, monkeypatch, packing=True, max_length=16, max_steps=1, loss_type="dft")
    assert_same_run(plain, fused, ("mean_token_accuracy",))
    assert calls["anticipated"] >= 1 and calls["per_token"] == 0
    assert splits and all(count == 0 for _, count in splits), splits


def test_a_record_that_does_not_fit_the_loss_still_trains_exactly(tiny, monkeypatch, splits):
    """The nll loss on a head told to anticipate dft: every row is recomputed, and the step is TRL's."""
    from fusedkern.integrations import trl_sft

    plain = train(build("sft", tiny, False, max_steps=1), False)
    trainer = build("sft", tiny, True, max_steps=1)
    trl_sft._PATTERNS[trl_sft.head_model(trainer)] = "dft"
    fused = train(trainer, True)
    assert_same_run(plain, fused, ("entropy", "mean_token_accuracy"))
    assert splits and all(s == 0 and count > 0 for s, count in splits), splits


def test_only_trls_own_sft_loss_gets_a_record(tiny):
    import trl

    from fusedkern.integrations import trl_sft

    assert trl_sft.sft_pattern(build("sft", tiny, True)) == "nll"
    assert trl_sft.sft_pattern(build("sft", tiny, True, loss_type="dft")) == "dft"
    # label smoothing of the nll, a compute_loss_func: TRL runs the fused head under no_grad for the metrics
    smoothed = build("sft", tiny, True, label_smoothing_factor=0.1)
    assert trl_sft.sft_pattern(smoothed) is None
    assert trl_sft.anticipated_pattern(trl_sft.head_model(smoothed)) is None

    class OwnLoss(trl.SFTTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    trainer = build("sft", tiny, True)
    trainer.__class__ = OwnLoss
    assert trl_sft.sft_pattern(trainer) is None
    # the record lives with the model until another trainer gives it a head
    model = trl_sft.head_model(build("sft", tiny, True))
    assert trl_sft.anticipated_pattern(model) == "nll"
    with torch.no_grad():
        assert trl_sft.anticipated_pattern(model) is None
    import fusedkern.integrations.trl as fk_trl

    fk_trl.add_fused_lm_head(model)
    assert trl_sft.anticipated_pattern(model) is None


def test_the_per_token_head_is_the_default(tiny, monkeypatch):
    """Without anticipate_sft, SFTTrainer's loss runs on the per-token head (four GEMMs), the faster one where both
    were timed; the run is TRL's all the same."""
    import fusedkern.integrations.trl as fk_trl

    monkeypatch.setattr(fk_trl, "ANTICIPATE_SFT_DEFAULT", False)
    plain, fused, calls = run_sft(tiny, monkeypatch, max_steps=1)
    assert_same_run(plain, fused, ("entropy", "mean_token_accuracy"))
    assert calls["anticipated"] == 0 and calls["per_token"] >= 1
