# SPDX-License-Identifier: Apache-2.0
"""dflash_lookahead_slots end to end: prefix caching, a shared 2-block prefix and
prompts whose end (or whose first query block's end) lies on a block boundary.

Without the fix each request's first draft writes (and then reads) its query
K/V through block-table entries it does not own; requests scheduled together
overwrite each other's, and the first drafts stop matching the reference.
"""

from __future__ import annotations

import pytest

from tests.helpers.equivalence import compare
from tests.helpers.reference import Reference

pytestmark = pytest.mark.cpu_e2e


def test_first_drafts_exact_with_shared_block_aligned_prefixes(offline, tiny_models):
    run = offline.run("dense", prefix_caching=True, prompt_set="shared-prefix")
    assert run.ok, run.log[-4000:]
    ref = Reference.load(tiny_models.target, tiny_models.dense)
    prompt_lens = {len(p) for p in run.data["prompts"]}
    first = [r for r in run.trace if r["num_tokens"] - 1 in prompt_lens]
    assert len(first) >= len(run.data["prompts"]), "no first draft traced"
    first_stats = compare(ref, run.data, first)
    stats = compare(ref, run.data, run.trace)
    assert first_stats.token_rate >= 0.99, (first_stats, stats)
    assert stats.token_rate >= 0.99, stats
