# SPDX-License-Identifier: Apache-2.0
"""The drafter's RoPE table of the context K/V pass is cast to the K dtype and
cut to the rows a position can index, once.

vLLM 0.20.x's ``DFlashQwen3Model.precompute_and_store_context_kv`` hands its
whole RoPE table (``max_position_embeddings`` rows) to ``rotary_embedding`` on every
call, cast to the K dtype first where it is float32; on CUDA the op converts the
table to float32 on every call: a 100 us copy a step on the 27B-shaped pair (H100,
2026-12-07). ``DFlashDraftModel`` keeps the table cast and cut to the rows a context
position can index.
"""

from __future__ import annotations

import torch

from vllm_dflash.models.dflash_drafter import DFlashDraftModel


class _Inner(torch.nn.Module):
    """Stands in for vLLM's ``DFlashQwen3Model``: records the table each call
    passes to the rotary kernel (what vLLM's code would cast)."""

    def __init__(self, built: bool) -> None:
        super().__init__()
        if built:
            self._fused_kv_weight = torch.zeros(4, 4, dtype=torch.bfloat16)
        self._rope_cos_sin_cache = torch.randn(64, 8, dtype=torch.float32)
        self.seen: list[torch.Tensor] = []

    def precompute_and_store_context_kv(self, states, positions, slots=None):
        self.seen.append(self._rope_cos_sin_cache)


def _drafter(inner: _Inner, rows: int = 64) -> DFlashDraftModel:
    model = DFlashDraftModel.__new__(DFlashDraftModel)
    torch.nn.Module.__init__(model)
    model.model = inner
    model._rope_rows = rows
    return model


def test_rope_table_cast_once_to_the_k_dtype():
    inner = _Inner(built=True)
    table = inner._rope_cos_sin_cache
    drafter = _drafter(inner)
    for _ in range(3):
        drafter.precompute_and_store_context_kv(torch.zeros(2, 4), torch.arange(2))
    assert [t.dtype for t in inner.seen] == [torch.bfloat16] * 3
    assert inner.seen[0] is inner.seen[1] is inner.seen[2]  # no cast after the first
    assert torch.equal(inner.seen[0], table.to(torch.bfloat16))  # vLLM's own cast


def test_rope_table_cut_to_the_rows_a_position_can_index():
    inner = _Inner(built=True)
    table = inner._rope_cos_sin_cache  # 64 rows
    drafter = _drafter(inner, rows=16)
    for _ in range(2):
        drafter.precompute_and_store_context_kv(torch.zeros(2, 4), torch.arange(2))
    assert inner.seen[0] is inner.seen[1]
    assert inner.seen[0].shape == (16, 8) and inner.seen[0].is_contiguous()
    assert torch.equal(inner.seen[0], table[:16].to(torch.bfloat16))
    # a context longer than the table keeps every row
    inner = _Inner(built=True)
    _drafter(inner, rows=1000).precompute_and_store_context_kv(
        torch.zeros(2, 4), torch.arange(2)
    )
    assert inner.seen[0].shape == (64, 8)


def test_rope_table_left_alone_before_the_buffers_exist():
    inner = _Inner(built=False)  # dummy weights: vLLM builds them in the first call
    table = inner._rope_cos_sin_cache
    _drafter(inner).precompute_and_store_context_kv(torch.zeros(2, 4), torch.arange(2))
    assert inner.seen == [table]
