# SPDX-License-Identifier: Apache-2.0
"""``"draft_length": "adaptive"`` end to end on vLLM's CPU backend.

Two engines, started together: the trained dense pair (sliding-window drafter,
k = 7) and the trained Qwen3.5-shaped hybrid pair (k = 4), each with the
adaptive draft length and a forced sequence of per-step lengths
(VLLM_DFLASH_DRAFT_LENGTH_SCHEDULE) that runs every transition: full blocks,
shorter ones, and steps that verify nothing (the drafter then only stores its
context), back to full. Checked: greedy output equals the float64 target's
(lossless), the drafts that were drafted equal the reference's (a drafter that
skipped its query pass must not have lost context; a draft head that computed
only the positions the next step verifies gives the reference's first ones),
drafts were still accepted,
and the scheduled lengths really varied (counted by the scheduler and by vLLM's
own spec-decode counters). The policy that chooses the lengths on its own is
tested in tests/unit/test_draft_length.py; its speed on the H200 in
benchmarks/results/.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import OfflineRunner
from tests.helpers.equivalence import compare, greedy_divergences
from tests.helpers.reference import Reference
from vllm_dflash.testing.trained import ensure_trained_models
from vllm_dflash.testing.trained_hybrid import ensure_trained_hybrid
from vllm_dflash.training.data import synthetic_prompts

pytestmark = pytest.mark.cpu_e2e

SCHEDULE = {"dense": (7, 0, 0, 3, 1, 5, 0, 2), "hybrid": (4, 0, 0, 2, 1, 3, 0)}
K = {"dense": 7, "hybrid": 4}
# step budgets: k drafting slots per sequence are reserved (8 sequences), the rest
# chunks the prompts (40 tokens)
BUDGET = {"dense": 96, "hybrid": 40}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    cache = os.environ.get("VLLM_DFLASH_FIXTURES")
    root = Path(cache) if cache else tmp_path_factory.mktemp("fixtures")
    dense = ensure_trained_models(root / "trained")
    hybrid = ensure_trained_hybrid(root / "trained-hybrid")
    return {
        "dense": (dense.target, dense.swa),
        "hybrid": (hybrid.target, hybrid.drafter),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory, pairs, tiny_models):
    runner = OfflineRunner(tmp_path_factory.mktemp("draft-length"), tiny_models)
    prompts = tuple(tuple(p) for p in synthetic_prompts(8, (5, 40), (4, 512), seed=777))
    configs = []
    for name in ("dense", "hybrid"):
        target, drafter = pairs[name]
        extra = ("--draft-length", "adaptive")
        if name == "hybrid":
            extra += ("--mm-limit", "0")
        configs.append(
            dict(
                drafter=drafter,
                target=target,
                k=K[name],
                max_tokens=48,
                max_num_batched_tokens=BUDGET[name],
                extra_args=extra,
                prompts=None if name == "hybrid" else prompts,
                env=(
                    (
                        "VLLM_DFLASH_DRAFT_LENGTH_SCHEDULE",
                        ",".join(map(str, SCHEDULE[name])),
                    ),
                ),
            )  # fmt: skip
        )
    results = dict(zip(("dense", "hybrid"), runner.run_many(configs), strict=True))
    for run in results.values():
        assert run.ok, run.log[-6000:]
    return results


@pytest.fixture(scope="module")
def refs(pairs):
    return {name: Reference.load(*pair) for name, pair in pairs.items()}


@pytest.mark.parametrize("name", ["dense", "hybrid"])
def test_adaptive_lossless(runs, refs, name):
    run = runs[name]
    div = greedy_divergences(refs[name], run.data["prompts"], run.data["outputs"])
    assert all(d["gap_rel_range"] < 1e-3 for d in div), div


@pytest.mark.parametrize("name", ["dense", "hybrid"])
def test_adaptive_drafts_equal_reference(runs, refs, name):
    stats = compare(refs[name], runs[name].data, runs[name].trace)
    assert stats.drafts >= 40, stats
    assert stats.token_rate >= 0.98, stats


@pytest.mark.parametrize("name", ["dense", "hybrid"])
def test_partial_draft_head(runs, refs, name):
    """Before a step that verifies 0 < d < k drafts the draft head computed d
    positions (dflash_partial_draft_head), and they are the reference's first d."""
    trace = runs[name].trace
    partial = [r for r in trace if len(r["draft_token_ids"]) < r["block"]]
    lengths = {len(r["draft_token_ids"]) for r in partial}
    assert len(partial) >= 10 and lengths <= set(SCHEDULE[name]) - {0, K[name]}, (
        len(partial),
        lengths,
    )
    assert runs[name].data["draft_lengths"]["rows"]["partial"] >= len(partial)
    stats = compare(refs[name], runs[name].data, partial)
    assert stats.token_rate >= 0.98, stats


@pytest.mark.parametrize("name", ["dense", "hybrid"])
def test_lengths_varied_and_drafts_accepted(runs, name):
    data = runs[name].data
    lengths = {int(d): n for d, n in data["draft_lengths"]["steps"].items()}
    assert set(lengths) == set(SCHEDULE[name]), lengths
    c = data["spec_decode"]
    drafts, tokens = (
        c["vllm:spec_decode_num_drafts"],
        c["vllm:spec_decode_num_draft_tokens"],
    )
    # shorter blocks were verified: fewer draft tokens than k per draft
    assert 0 < tokens < 0.8 * K[name] * drafts, c
    assert c["vllm:spec_decode_num_accepted_tokens"] > 0.2 * tokens, c
    # before a step that verifies 0 drafts the drafter only stored its context:
    # drafts were traced (one record per request per query pass) for the requests
    # of the other steps only (measured: 135 records for 140 such requests, dense;
    # 209 with dflash_context_only_pass disabled)
    rows = data["draft_lengths"]["rows"]
    assert rows["context"] > 0.2 * (rows["query"] + rows["context"]), rows
    assert len(runs[name].trace) <= rows["query"], (len(runs[name].trace), rows)
