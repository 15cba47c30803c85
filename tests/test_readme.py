"""README.md's usage block runs as written (on CPU through Triton's interpreter, tiny shapes), with the
names it leaves to the reader defined here: hidden, lm_head, labels, ref_c, ref_r and a tiny model."""

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def usage_block() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Use"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_usage_block_runs():
    transformers = pytest.importorskip("transformers")
    g = torch.Generator().manual_seed(0)
    batch, seq, hidden_size, vocab = 4, 6, 16, 40  # batch 4: two chosen/rejected pairs for the preference losses
    lm_head = torch.nn.Linear(hidden_size, vocab, bias=False)
    hidden = torch.randn(batch, seq, hidden_size, generator=g, requires_grad=True)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    labels[:, :2] = -100  # a prompt
    ref_c, ref_r = -torch.rand(batch // 2, generator=g) * 10, -torch.rand(batch // 2, generator=g) * 10
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden_size, intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    model = transformers.LlamaForCausalLM(config)
    teacher_head = torch.nn.Linear(2 * hidden_size, vocab, bias=False)  # a wider teacher, same vocabulary
    teacher_hidden = torch.randn(batch, seq, 2 * hidden_size, generator=g)
    scope = dict(hidden=hidden, lm_head=lm_head, labels=labels, ref_c=ref_c, ref_r=ref_r, model=model,
                 teacher_hidden=teacher_hidden, teacher_head=teacher_head)
    pytest.importorskip("trl")
    try:
        exec(compile(usage_block(), "README.md", "exec"), scope)
    finally:  # the block patches TRL for the whole process: undo it for the tests that share this worker
        import fusedkern.integrations.trl

        fusedkern.integrations.trl.unpatch()
    assert set(scope["metrics"]) >= {"rewards/chosen", "rewards/margins"}
    import fusedkern

    eager = fusedkern.linear_cross_entropy(hidden, lm_head.weight, labels)
    torch.testing.assert_close(scope["loss"], eager)  # the block ends with the compiled call
    assert scope["logps"].shape == (batch, seq)
    out = model(input_ids=torch.randint(0, vocab, (2, seq), generator=g), labels=labels[:2])
    assert out.logits is None and torch.isfinite(out.loss)  # the patched model computed its loss with fusedkern
