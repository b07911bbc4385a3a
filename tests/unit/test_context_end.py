# SPDX-License-Identifier: Apache-2.0
"""dflash_context_end_cap: a request within k + 1 tokens of ``max_model_len``.

The stock first pass gives the drafter sequence lengths past ``max_model_len``
and writes the out-of-context query K/V over the request's last cached block.
On vLLM's real FLEX_ATTENTION metadata (CPU tensors) a sliding-window drafter
layer then fails to build its mask. That was the CUDA engine death of
``test_generation_up_to_the_context_end`` on an H100 (2026-12-07). With
``VLLM_DFLASH_DISABLE=dflash_context_end_cap`` the patched-path tests fail.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.unit.test_flex_sliding import WINDOW, _proposer, flex_available  # noqa: F401
from vllm_dflash import envs
from vllm_dflash.registry import original
from vllm_dflash.spec_decode import context_end

dflash = pytest.importorskip("vllm.v1.spec_decode.dflash")

LIMIT = 64  # max_model_len: a 4-block table at 16-token blocks


@pytest.fixture
def passes(isolated):
    """(stock, patched) first passes; patched is stock when the patch is off."""
    isolated(context_end.PATCH)
    stock = original(dflash.DFlashProposer.set_inputs_first_pass)
    if context_end.PATCH_NAME not in envs.disabled_patches():
        context_end.apply()
        context_end.apply()  # idempotent
    return stock, dflash.DFlashProposer.set_inputs_first_pass


def test_probe_sees_the_stock_pass_run_past_the_context():
    assert context_end.probe()


def test_block_past_the_context_is_padded_and_capped(passes):
    stock, patched = passes
    pos, stock_slots, stock_cad = context_end.run_first_pass(stock, LIMIT, 62)
    assert pos.tolist() == [63, 64, 65, 66]
    assert stock_cad.max_seq_len == 67  # the defect: past max_model_len
    # and positions 64..66 land on slots 64..66: positions 48..50's K/V
    assert stock_slots.tolist() == [79, 64, 65, 66]
    pos, slots, cad = context_end.run_first_pass(patched, LIMIT, 62)
    assert slots.tolist() == [79, -1, -1, -1]  # vLLM's PADDING_SLOT_ID
    assert cad.seq_lens.tolist() == [LIMIT] and cad.max_seq_len == LIMIT
    assert cad.seq_lens_cpu_upper_bound.tolist() == [LIMIT]


def test_requests_that_fit_are_untouched(passes):
    stock, patched = passes
    for last in (40, 59):  # the block ends at 44 and at 63 (the last position)
        a = context_end.run_first_pass(stock, LIMIT, last)
        c = context_end.run_first_pass(patched, LIMIT, last)
        assert a[1].tolist() == c[1].tolist()
        assert a[2].seq_lens.tolist() == c[2].seq_lens.tolist()
        assert a[2].max_seq_len == c[2].max_seq_len == last + 5


def _sliding_mask(cad):
    """vLLM's FLEX_ATTENTION sliding-window mask for the drafter's block, built
    as FlexAttentionImpl does at forward time."""
    p = _proposer(own_builders=True)
    meta = p.sliding_builders[0].build_for_drafting(replace(cad, causal=True), 0)
    meta.sliding_window = WINDOW
    meta.mask_mod = meta.get_mask_mod()
    return meta._build_block_mask_direct()


def test_flex_sliding_mask_builds_at_the_context_end(passes, flex_available):  # noqa: F811
    stock, patched = passes
    *_, stock_cad = context_end.run_first_pass(stock, LIMIT, 62)
    with pytest.raises(RuntimeError, match="must match the size"):
        _sliding_mask(stock_cad)  # what killed the CUDA engine (async: one step later)
    *_, cad = context_end.run_first_pass(patched, LIMIT, 62)
    mask = _sliding_mask(cad)
    # the window (6) of the last in-context query reaches back into block 3 only
    assert mask.kv_num_blocks.flatten().tolist()[0] >= 1
