"""README.md's usage block and docs/usage.md's opening block run as written (on CPU through Triton's interpreter,
tiny shapes), with the names they leave to the reader defined here: hidden, lm_head, labels, ref_c, ref_r, a teacher
and a tiny model."""

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def first_python_block(path: Path, after: str = "") -> str:
    text = path.read_text()
    section = text[text.index(after):] if after else text
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.fixture
def scope():
    transformers = pytest.importorskip("transformers")
    g = torch.Generator().manual_seed(0)
    batch, seq, hidden_size, vocab = 4, 6, 16, 40  # batch 4: two chosen/rejected pairs for the preference losses
    lm_head = torch.nn.Linear(hidden_size, vocab, bias=False)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    labels[:, :2] = -100  # a prompt
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden_size, intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    return dict(hidden=torch.randn(batch, seq, hidden_size, generator=g, requires_grad=True), lm_head=lm_head,
                labels=labels, ref_c=-torch.rand(batch // 2, generator=g) * 10,
                ref_r=-torch.rand(batch // 2, generator=g) * 10, model=transformers.LlamaForCausalLM(config),
                teacher_head=torch.nn.Linear(2 * hidden_size, vocab, bias=False),  # a wider teacher, same vocabulary
                teacher_hidden=torch.randn(batch, seq, 2 * hidden_size, generator=g))


def test_readme_usage_block_runs(scope):
    pytest.importorskip("trl")
    try:
        exec(compile(first_python_block(ROOT / "README.md", "## Use"), "README.md", "exec"), scope)
    finally:  # the block patches TRL for the whole process: undo it for the tests that share this worker
        import fusedkern.integrations.trl

        fusedkern.integrations.trl.unpatch()
    assert scope["hidden"].grad is not None and torch.isfinite(scope["loss"])
    g = torch.Generator().manual_seed(1)
    out = scope["model"](input_ids=torch.randint(0, 40, (2, 6), generator=g), labels=scope["labels"][:2])
    assert out.logits is None and torch.isfinite(out.loss)  # the patched model computed its loss with fusedkern


def test_usage_doc_opening_block_runs(scope):
    exec(compile(first_python_block(ROOT / "docs" / "usage.md"), "docs/usage.md", "exec"), scope)
    assert set(scope["metrics"]) >= {"rewards/chosen", "rewards/margins"}
    assert scope["logps"].shape == scope["labels"].shape
    import fusedkern

    eager = fusedkern.linear_cross_entropy(scope["hidden"], scope["lm_head"].weight, scope["labels"])
    torch.testing.assert_close(scope["loss"], eager)  # the block ends with the compiled call
