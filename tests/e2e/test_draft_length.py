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
own spec-decode counters). A step before one that verifies d < k drafts runs the
drafter over a block of 1 + d positions (dflash_short_draft_block; its drafts are
the reference's for a block of d); a third engine, the dense pair with that patch
disabled, covers the full block with the partial draft head. The policy that chooses the lengths on its own is
tested in tests/unit/test_draft_length.py; its speed on the H200 in
docs/performance.md.
"""

from __future__ import annotations

import json
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
# step budgets (8 sequences, prompts up to 40 tokens). dense: 8 x (1 + 7) query
# tokens fit 96, so a step schedules all 96 (dflash_full_step_budget). hybrid: 8 x 5
# do not fit 39, so vLLM's reservation stays (39 - 8 x 4 = 7 tokens a step): decodes
# sit out steps while prompts are chunked, which the GDN slot fix needs to be
# tested (with 40 the whole budget, and no decode sat out).
BUDGET = {"dense": 96, "hybrid": 39}
# engine -> pair; "full-block": the dense pair with dflash_short_draft_block off
ENGINES = {"dense": "dense", "hybrid": "hybrid", "full-block": "dense"}


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
def step_log(tmp_path_factory) -> Path:
    """The dense engine's VLLM_DFLASH_STEP_LOG (core/step_log.py)."""
    return tmp_path_factory.mktemp("step-log") / "steps.jsonl"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, pairs, tiny_models, step_log):
    runner = OfflineRunner(tmp_path_factory.mktemp("draft-length"), tiny_models)
    prompts = tuple(tuple(p) for p in synthetic_prompts(8, (5, 40), (4, 512), seed=777))
    configs = []
    for engine, name in ENGINES.items():
        target, drafter = pairs[name]
        extra = ("--draft-length", "adaptive")
        if name == "hybrid":
            extra += ("--mm-limit", "0")
        env = (
            ("VLLM_DFLASH_DRAFT_LENGTH_SCHEDULE", ",".join(map(str, SCHEDULE[name]))),
        )
        if engine == "full-block":
            env += (("VLLM_DFLASH_DISABLE", "dflash_short_draft_block"),)
        if engine == "dense":
            env += (("VLLM_DFLASH_STEP_LOG", str(step_log)),)
        configs.append(
            dict(
                drafter=drafter,
                target=target,
                k=K[name],
                max_tokens=48,
                max_num_batched_tokens=BUDGET[name],
                extra_args=extra,
                prompts=None if name == "hybrid" else prompts,
                env=env,
            )
        )
    results = dict(zip(ENGINES, runner.run_many(configs), strict=True))
    for run in results.values():
        assert run.ok, run.log[-6000:]
    return results


@pytest.fixture(scope="module")
def refs(pairs):
    return {name: Reference.load(*pair) for name, pair in pairs.items()}


@pytest.mark.parametrize("engine", list(ENGINES))
def test_adaptive_lossless(runs, refs, engine):
    run = runs[engine]
    div = greedy_divergences(
        refs[ENGINES[engine]], run.data["prompts"], run.data["outputs"]
    )
    assert all(d["gap_rel_range"] < 1e-3 for d in div), div


@pytest.mark.parametrize("engine", list(ENGINES))
def test_adaptive_drafts_equal_reference(runs, refs, engine):
    stats = compare(refs[ENGINES[engine]], runs[engine].data, runs[engine].trace)
    assert stats.drafts >= 40, stats
    assert stats.token_rate >= 0.98, stats


def _shorter(trace: list[dict], k: int) -> list[dict]:
    return [r for r in trace if len(r["draft_token_ids"]) < k]


@pytest.mark.parametrize("name", ["dense", "hybrid"])
def test_short_draft_block(runs, refs, name):
    """Before a step that verifies 0 < d < k drafts the drafter ran a block of
    d masks (dflash_short_draft_block), and its drafts are the reference's for
    that block."""
    short = _shorter(runs[name].trace, K[name])
    blocks = {r["block"] for r in short}
    assert len(short) >= 10 and blocks <= set(SCHEDULE[name]) - {0, K[name]}, (
        len(short),
        blocks,
    )
    assert all(len(r["draft_token_ids"]) == r["block"] for r in short)
    stats = compare(refs[name], runs[name].data, short)
    assert stats.token_rate >= 0.98, stats
    # the block really was shorter: the full block's first d differ somewhere
    # (measured: 281 of 294 tokens equal, dense; 171 of 182, hybrid)
    full = compare(refs[name], runs[name].data, [dict(r, block=K[name]) for r in short])
    assert full.equal_tokens < full.tokens, full


def test_partial_draft_head(runs, refs):
    """With dflash_short_draft_block off, the drafter runs the full block and
    its head computes the d positions the next step verifies
    (dflash_partial_draft_head): the reference's first d of the full block."""
    run, k = runs["full-block"], K["dense"]
    partial = _shorter(run.trace, k)
    lengths = {len(r["draft_token_ids"]) for r in partial}
    assert len(partial) >= 10 and lengths <= set(SCHEDULE["dense"]) - {0, k}, (
        len(partial),
        lengths,
    )
    assert {r["block"] for r in partial} == {k}
    assert run.data["draft_lengths"]["rows"]["partial"] >= len(partial)
    stats = compare(refs["dense"], run.data, partial)
    assert stats.token_rate >= 0.98, stats


@pytest.mark.parametrize("engine", list(ENGINES))
def test_lengths_varied_and_drafts_accepted(runs, engine):
    data, name = runs[engine].data, ENGINES[engine]
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
    assert len(runs[engine].trace) <= rows["query"], (len(runs[engine].trace), rows)


def test_step_log_counts_what_was_verified(runs, step_log):
    """VLLM_DFLASH_STEP_LOG wrote one line per step of the dense engine: its
    decode steps verified the forced lengths, and its draft tokens add up to
    vLLM's own counter of verified drafts."""
    lines = [json.loads(x) for x in step_log.read_text().splitlines()]
    decode = [r for r in lines if r["decode"]]
    assert len(decode) >= 20 and any(not r["decode"] for r in lines), len(lines)
    assert {r["dmax"] for r in decode} <= set(SCHEDULE["dense"]), decode
    assert {r["dmax"] for r in decode} >= {0, 7}, decode
    assert all(r["ms"] > 0 and r["tokens"] >= r["reqs"] for r in lines)
    counters = runs["dense"].data["spec_decode"]
    assert (
        sum(r["drafts"] for r in lines) == counters["vllm:spec_decode_num_draft_tokens"]
    ), counters
