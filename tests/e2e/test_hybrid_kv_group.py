# SPDX-License-Identifier: Apache-2.0
"""dflash_drafter_kv_shared_group on vLLM's CPU backend: a drafter whose KV heads
differ from the hybrid target's attention (1 KV head of 64 vs 2 of 32: the same
bytes per token, as z-lab/Qwen3.6-27B-DFlash's 8 x 128 vs the target's 4 x 256)
joins the target's attention KV-cache group, its blocks re-viewed with its own
heads. Its drafts must still equal the float64 reference exactly (a wrong view of
the context K/V it precomputes changes them) and the output must equal the
target's. The drafter is random (seeded): the check is the drafts, not their
acceptance."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from tests.conftest import OfflineRunner
from tests.helpers.equivalence import compare
from tests.helpers.reference import Reference
from vllm_dflash.spec_decode.drafter_kv_group import NAME
from vllm_dflash.testing.tiny_hybrid import text_spec
from vllm_dflash.testing.tiny_models import build_drafter
from vllm_dflash.testing.trained_hybrid import (
    TRAINED_HYBRID_DRAFTER,
    TRAINED_HYBRID_TARGET,
    ensure_trained_hybrid,
)

pytestmark = pytest.mark.cpu_e2e

TEXT_ONLY = ("--mm-limit", "0")
WIDE_KV = replace(
    TRAINED_HYBRID_DRAFTER,
    name="drafter-hybrid-kv1x64",
    num_heads=2,
    num_kv_heads=1,
    head_dim=64,
    seed=31,
    init_std=0.3,
)
MERGED_LOG = "DFlash drafter KV in the target's attention KV-cache group"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    cache = os.environ.get("VLLM_DFLASH_FIXTURES")
    hybrid = ensure_trained_hybrid(
        Path(cache) if cache else tmp_path_factory.mktemp("hybrid-fixtures")
    )
    drafter = tmp_path_factory.mktemp("wide-kv") / WIDE_KV.name
    build_drafter(drafter, WIDE_KV, text_spec(TRAINED_HYBRID_TARGET))
    return hybrid, drafter


def test_drafter_with_other_heads_shares_the_target_group(tmp_path_factory, pair):
    hybrid, drafter = pair
    runner = OfflineRunner(tmp_path_factory.mktemp("kv-group-runs"), hybrid)
    base, run = runner.run_many(
        [
            dict(drafter=None, extra_args=TEXT_ONLY, max_num_batched_tokens=40),
            dict(drafter=drafter, extra_args=TEXT_ONLY, max_num_batched_tokens=40),
        ]
    )
    assert base.ok and run.ok, run.log[-6000:]
    assert MERGED_LOG in run.log, f"{NAME} did not merge the drafter's KV group"
    assert run.data["outputs"] == base.data["outputs"], "DFlash changed output"
    stats = compare(Reference.load(hybrid.target, drafter), run.data, run.trace)
    assert stats.drafts >= 64, stats
    assert stats.token_rate >= 0.99, stats
