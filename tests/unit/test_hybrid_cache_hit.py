# SPDX-License-Identifier: Apache-2.0
"""Hybrid prefix-cache hits with EAGLE-style speculation (DFlash): on a real
vLLM KVCacheManager (full attention + Mamba 'align' groups, no model), the hit
never claims tokens a full-attention group does not hold."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.conftest import skip_unless_needed
from vllm_dflash.config import hybrid_prefix_caching
from vllm_dflash.core import hybrid_cache_hit as hits

pytest.importorskip("vllm.v1.core.kv_cache_coordinator")


@pytest.fixture
def fixes(monkeypatch):
    """``fixes(*names)``: the fixes active in this process for the test."""
    return lambda *names: monkeypatch.setattr(hits, "_active", set(names))


def test_stock_hit_claims_a_block_attention_lacks(fixes):
    skip_unless_needed(hits.NAME)
    fixes()
    hit, covered = hits._hit(two_attention_types=False)
    assert hit == 16 and covered == [8, 16]  # tokens 8..16 would read no K/V
    assert hits.probe()
    assert not hits.exact_hits()


def test_no_mamba_margin_makes_the_hit_exact(fixes):
    skip_unless_needed(hits.NAME)
    fixes(hits.NAME)
    hit, covered = hits._hit(two_attention_types=False)
    assert covered[:-1] == [hit]
    # a second full-attention type still keeps blocks past the hit without
    # the truncation fix
    hit, covered = hits._hit(two_attention_types=True)
    assert covered[1] > hit
    assert not hits.exact_hits()
    assert hits.probe()  # the probe reads vLLM's coordinator


def test_truncation_cuts_every_attention_group(fixes):
    skip_unless_needed(hits.TRUNCATE_NAME)
    fixes(hits.NAME, hits.TRUNCATE_NAME)
    assert hits.truncation_probe()
    for two in (False, True):
        hit, covered = hits._hit(two_attention_types=two)
        assert all(tokens == hit for tokens in covered[:-1]), (two, hit, covered)
    assert hits.exact_hits()


def test_only_dflash_schedulers_get_the_fixes(monkeypatch, fixes, isolated):
    """The fixes go on the coordinator of a DFlash engine's scheduler, once; an
    engine with another method (or none) keeps vLLM's coordinator."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import MambaSpec

    isolated(hits.PATCH)
    isolated(hits.TRUNCATE_PATCH)

    def stock_init(self, vllm_config, coordinator) -> None:
        self.vllm_config = vllm_config
        self.kv_cache_manager = SimpleNamespace(coordinator=coordinator)

    monkeypatch.setattr(Scheduler, "__init__", stock_init)
    fixes()
    hits.apply()
    hits.truncation_apply()
    hits.apply()  # idempotent: one wrapper each
    hits.truncation_apply()
    assert Scheduler.__init__.__wrapped_original__.__wrapped_original__ is stock_init

    def start(method: str):
        coordinator = hits._manager(hits._specs(False)).coordinator
        config = SimpleNamespace(speculative_config=SimpleNamespace(method=method))
        Scheduler.__init__(Scheduler.__new__(Scheduler), config, coordinator)
        mamba = {
            i
            for i, group in enumerate(coordinator.attention_groups)
            if isinstance(group[0], MambaSpec)
        }
        return coordinator, mamba

    coordinator, mamba = start("eagle3")
    assert mamba <= coordinator.eagle_attn_group_indices
    assert "find_longest_cache_hit" not in vars(coordinator)
    coordinator, mamba = start("dflash")
    assert not mamba & coordinator.eagle_attn_group_indices
    assert "find_longest_cache_hit" in vars(coordinator)


def _scheduler(async_scheduling: bool = False) -> SimpleNamespace:
    """A DFlash scheduler in 'align' mode whose budget holds a block."""
    return SimpleNamespace(
        vllm_config=SimpleNamespace(
            speculative_config=SimpleNamespace(method="dflash")
        ),
        need_mamba_block_aligned_split=True,
        cache_config=SimpleNamespace(block_size=16),
        max_num_scheduled_tokens=64,
        scheduler_config=SimpleNamespace(
            max_num_batched_tokens=64, async_scheduling=async_scheduling
        ),
    )


def test_refusal_follows_exact_hits(monkeypatch):
    sched = _scheduler()
    monkeypatch.setattr(hybrid_prefix_caching, "exact_hits", lambda: False)
    with pytest.raises(hybrid_prefix_caching.AlignBudgetError, match=hits.NAME):
        hybrid_prefix_caching.check(sched)
    monkeypatch.setattr(hybrid_prefix_caching, "exact_hits", lambda: True)
    hybrid_prefix_caching.check(sched)


def test_doctor_states_the_mode(monkeypatch):
    from vllm_dflash.entrypoints.cli import main

    monkeypatch.setattr(hits, "exact_hits", lambda: True)
    assert main._hybrid_prefix_caching().startswith("lossless")
    assert "one GDN state" in main._hybrid_prefix_caching()
    monkeypatch.setenv("VLLM_DFLASH_DISABLE", "dflash_gdn_state_replay")
    assert "1 + k GDN states" in main._hybrid_prefix_caching()
    monkeypatch.setattr(hits, "exact_hits", lambda: False)
    assert main._hybrid_prefix_caching().startswith("refused")


def test_shorter_step_keeps_the_blocks():
    """vLLM's 'align' Mamba manager asserts on a step needing fewer blocks than
    the request holds; with dflash_align_shorter_step_blocks it keeps them."""
    assert hits.shorter_step_probe()  # stock: AssertionError
    hits._shorter_step(hits.keep_blocks_on_shorter_steps)  # no error


def test_refusal_without_the_async_order_fix(monkeypatch):
    from vllm_dflash.spec_decode import hybrid_align_accepted_order as order

    sched = _scheduler(async_scheduling=True)
    monkeypatch.setattr(hybrid_prefix_caching, "exact_hits", lambda: True)
    monkeypatch.setenv("VLLM_DFLASH_DISABLE", order.NAME)
    with pytest.raises(hybrid_prefix_caching.AlignBudgetError, match="--no-async"):
        hybrid_prefix_caching.check(sched)
    sched.scheduler_config.async_scheduling = False  # synchronous: no refusal
    hybrid_prefix_caching.check(sched)
    sched.scheduler_config.async_scheduling = True
    monkeypatch.delenv("VLLM_DFLASH_DISABLE")
    if order.PATCH.applies_to_version():
        hybrid_prefix_caching.check(sched)
