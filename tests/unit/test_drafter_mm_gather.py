# SPDX-License-Identifier: Apache-2.0
"""dflash_no_drafter_mm_gather: vLLM's own ``GPUModelRunner._gather_mm_embeddings``
on a stand-in runner whose request's prefill chunk ends right before an image the
scheduler has not encoded. The drafter's look-ahead gather (shift 1) raises
"Encoder cache miss" in stock vLLM (the engine dies: tests/e2e/test_hybrid_images.py
with a two-image prompt); patched, a DFlash runner skips it (its drafter never reads
multimodal embeddings) and every other call is unchanged. With
``VLLM_DFLASH_DISABLE=dflash_no_drafter_mm_gather`` the patched-behaviour test fails
with the stock cache miss."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_dflash import envs
from vllm_dflash.spec_decode import drafter_mm_gather as dm


@pytest.fixture
def patched(isolated):
    isolated(dm.PATCH)
    assert dm.probe(), "this vLLM's look-ahead gather no longer misses"
    if dm.PATCH_NAME not in envs.disabled_patches():  # disabled: the stock code runs
        dm.apply()
        dm.apply()  # idempotent
    assert dm.probe()  # the probe asks the unpatched method
    return dm._runner_cls()


def test_stock_lookahead_gather_misses_the_encoder_cache(isolated):
    isolated(dm.PATCH)
    stock = dm.original(dm._runner_cls()._gather_mm_embeddings)
    runner, sched = dm.boundary_case()
    embeds, mask = stock(runner, sched, shift_computed_tokens=0)
    assert embeds == [] and not mask.any()  # the target's range holds no image
    with pytest.raises(AssertionError, match="Encoder cache miss"):
        stock(runner, sched, shift_computed_tokens=1)


def test_dflash_drafter_gather_skipped(patched):
    runner, sched = dm.boundary_case()
    embeds, mask = patched._gather_mm_embeddings(runner, sched, shift_computed_tokens=1)
    assert embeds == []
    assert mask.dtype == torch.bool and mask.shape == (4,) and not mask.any()


def test_other_calls_unchanged(patched):
    runner, sched = dm.boundary_case()
    # the target's own gather runs vLLM's code
    embeds, mask = patched._gather_mm_embeddings(runner, sched, shift_computed_tokens=0)
    assert embeds == [] and not mask.any()
    # another speculative method keeps vLLM's look-ahead (and its defect)
    runner.speculative_config = SimpleNamespace(
        method="eagle3", use_dflash=lambda: False
    )
    with pytest.raises(AssertionError, match="Encoder cache miss"):
        patched._gather_mm_embeddings(runner, sched, shift_computed_tokens=1)
    # with the image encoded, vLLM's gather returns its embeddings
    runner.encoder_cache = {"probe-image": torch.arange(8.0).view(4, 2)}
    embeds, mask = patched._gather_mm_embeddings(runner, sched, shift_computed_tokens=1)
    assert len(embeds) == 1 and embeds[0].shape == (1, 2) and mask.tolist() == [
        False, False, False, True,
    ]  # fmt: skip


def test_dflash_first_pass_ignores_mm_inputs():
    assert dm.dflash_first_pass_ignores_mm_inputs()
