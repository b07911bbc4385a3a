# SPDX-License-Identifier: Apache-2.0
"""DFlash at tensor_parallel_size=2 on vLLM's CPU backend (two CPU workers, one
core each, gloo): lossless and drafts equal to the float64 reference, for a dense
and a sliding-window drafter. The GPU counterpart (2x H200) is in tests/gpu."""

from __future__ import annotations

import os

import pytest

from tests.helpers.equivalence import compare, greedy_divergences
from tests.helpers.reference import Reference

pytestmark = [
    pytest.mark.cpu_e2e,
    pytest.mark.skipif(
        len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPU cores (one per rank)"
    ),
]


@pytest.fixture(scope="module")
def tp_runs(offline):
    """Both DFlash engines at TP=2, started together (CI time). Lossless is judged
    against the float64 target's greedy continuation (near-ties excused), which
    stands in for a no-speculation TP=2 engine."""
    names = ["dense", "swa"]
    return dict(
        zip(
            names, offline.run_many([dict(drafter=n, tp=2) for n in names]), strict=True
        )
    )


@pytest.mark.parametrize("drafter", ["dense", "swa"])
def test_tp2_lossless_and_reference_equal(tp_runs, tiny_models, drafter):
    run = tp_runs[drafter]
    assert run.ok, run.log[-4000:]
    ref = Reference.load(tiny_models.target, getattr(tiny_models, drafter))
    div = greedy_divergences(ref, run.data["prompts"], run.data["outputs"])
    # float32 all-reduce order differs from the reference's sum: rare near-ties.
    assert all(d["gap_rel_range"] < 0.01 for d in div), div
    stats = compare(ref, run.data, run.trace)
    assert stats.drafts >= 200, stats
    assert stats.token_rate >= 0.98, stats
