"""fusedkern.chunk_plan: the chunk sizes the memory contract allows (no kernels run here)."""

from __future__ import annotations

import pytest

from fusedkern.chunk_plan import GRAD_CHUNK_BUDGET_BYTES, LOSS_CHUNK_BUDGET_BYTES, grad_chunk_plan, loss_tile

V, H = 128256, 4096  # the study's LM head


@pytest.mark.parametrize("tokens", [4096, 8192, 9216])
def test_default_mode_runs_few_tokens_as_one_chunk_without_accumulator(tokens):
    plan = grad_chunk_plan(tokens, V, H, 2, need_dw=True, fp32_accum=True)
    assert (plan.chunk_tokens, plan.fp32_accumulator, plan.buffer_in_dw_storage) == (tokens, False, False)
    assert tokens * V * 2 <= GRAD_CHUNK_BUDGET_BYTES + V * H * 4  # within the accumulator's allowance


@pytest.mark.parametrize("tokens", [9280, 16384, 32768])
def test_default_mode_puts_an_h_token_buffer_inside_dw_storage(tokens):
    plan = grad_chunk_plan(tokens, V, H, 2, need_dw=True, fp32_accum=True)
    assert (plan.chunk_tokens, plan.fp32_accumulator, plan.buffer_in_dw_storage) == (4096, True, True)
    assert plan.chunk_tokens * V <= V * H  # fits dW's own storage


def test_lean_mode_and_no_weight_grad_keep_the_256_mib_buffer():
    for kwargs in (dict(need_dw=True, fp32_accum=False), dict(need_dw=False, fp32_accum=True)):
        plan = grad_chunk_plan(32768, V, H, 2, **kwargs)
        assert plan == type(plan)(1024, False, False)
        assert 1024 * V * 2 <= GRAD_CHUNK_BUDGET_BYTES


def test_caller_chunk_is_respected():
    assert grad_chunk_plan(32768, V, H, 2, need_dw=True, fp32_accum=True, chunk_tokens=2048).buffer_in_dw_storage
    big = grad_chunk_plan(32768, V, H, 2, need_dw=True, fp32_accum=True, chunk_tokens=8192)
    assert big.fp32_accumulator and not big.buffer_in_dw_storage
    assert grad_chunk_plan(100, V, H, 2, need_dw=True, fp32_accum=False, chunk_tokens=512).chunk_tokens == 100


def test_loss_tile_fits_64_mib_and_keeps_gemms_large():
    C, Vs = loss_tile(32768, V, 2)
    assert (C, Vs) == (2048, 16384) and C * Vs * 2 <= LOSS_CHUNK_BUDGET_BYTES
    assert loss_tile(100, 1000, 4) == (100, 1000)  # a small problem is one whole-row chunk


def test_auto_counts_the_callers_chunk_tokens():
    """`resolve_impl`'s memory check sizes the buffer at the caller's chunk_tokens, not the default plan's."""
    import torch

    from fusedkern.dispatch import chunked_extra_bytes

    w = torch.empty(V, H, dtype=torch.bfloat16, device="meta", requires_grad=True)
    assert chunked_extra_bytes(32768, w, "weight_dtype", None) == 1024 * V * 2  # 256 MiB plan
    assert chunked_extra_bytes(32768, w, "weight_dtype", 8192) == 8192 * V * 2
    # fp32 accumulation, chunks bigger than H: the buffer no longer fits dW's storage, both count
    assert chunked_extra_bytes(32768, w, "fp32", 8192) == 8192 * V * 2 + V * H * 4
    assert chunked_extra_bytes(32768, w, "fp32", None) == V * H * 4  # default: buffer inside dW's storage


@pytest.mark.gpu
def test_gpu_auto_falls_back_to_fused_when_the_callers_chunk_does_not_fit():
    import torch

    from fusedkern.dispatch import resolve_impl

    # a tiny hidden size keeps the inputs small while one chunk of all tokens would need ~200 GB
    x = torch.empty(1 << 20, 1, device="cuda", dtype=torch.bfloat16)
    w = torch.empty(100_000, 1, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    assert resolve_impl("auto", x, w, "weight_dtype", None) == "chunked"
    assert resolve_impl("auto", x, w, "weight_dtype", 1 << 20) == "fused"
