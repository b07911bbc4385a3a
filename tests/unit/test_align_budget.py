# SPDX-License-Identifier: Apache-2.0
"""Hybrid prefix caching ('align') with a step budget below the block size stalls
long prompts forever in vLLM 0.20.x; the plugin refuses it at start-up."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_dflash.config import hybrid_prefix_caching as align_budget

pytest.importorskip("vllm.v1.core.sched.scheduler")


def _sched(budget: int, block: int = 16, align: bool = True, method: str | None = None):
    spec = SimpleNamespace(method=method) if method else None
    return SimpleNamespace(
        vllm_config=SimpleNamespace(speculative_config=spec),
        need_mamba_block_aligned_split=align,
        cache_config=SimpleNamespace(block_size=block),
        max_num_scheduled_tokens=budget,
        scheduler_config=SimpleNamespace(max_num_batched_tokens=budget + 24),
    )


def test_stock_split_rounds_small_budget_to_zero():
    assert align_budget.probe()  # the defect: a 40-token prompt gets 0 tokens


def test_refuses_budget_below_block():
    with pytest.raises(
        align_budget.AlignBudgetError, match="max_num_batched_tokens >= 40"
    ):
        align_budget.check(_sched(8))
    align_budget.check(_sched(16))  # enough
    align_budget.check(_sched(8, align=False))  # no align mode: no constraint
