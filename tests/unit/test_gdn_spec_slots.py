# SPDX-License-Identifier: Apache-2.0
"""GDN state slots of speculative decodes: all-zero-draft batches
(dflash_gdn_zero_draft_decodes) and decodes that sat out a step
(dflash_gdn_slot_after_unscheduled_step). The engine runs that go wrong without
them are in tests/e2e/test_draft_length.py (hybrid, red with either disabled)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from vllm_dflash.spec_decode import gdn_unscheduled_slot as slot
from vllm_dflash.spec_decode import gdn_zero_drafts as zero


def test_zero_draft_batch_stays_speculative():
    t = torch.tensor([-1, 0, 0, -1])
    got = zero.keep_speculative(t)
    assert got.tolist() == [-1, 1, 0, -1] and t.tolist() == [-1, 0, 0, -1]
    assert (got >= 0).tolist() == (t >= 0).tolist()  # same speculative rows
    for unchanged in ([-1, 2, 0], [-1, -1], [3, 1]):
        x = torch.tensor(unchanged)
        assert zero.keep_speculative(x) is x
    assert zero.keep_speculative(None) is None
    assert zero.probe()


class _Buf:
    def __init__(self, n: int) -> None:
        self.np = np.ones(n, dtype=np.int32)
        # the device copy: newer than np for rows vLLM corrected on the GPU
        self.gpu = torch.full((n,), 7, dtype=torch.int32)


def _runner(req_ids, counts):
    batch = SimpleNamespace(
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        num_accepted_tokens_cpu=np.array(counts, dtype=np.int32),
    )
    batch.num_reqs = len(req_ids)
    return SimpleNamespace(
        input_batch=batch, num_accepted_tokens=_Buf(8), num_accepted_tokens_event=None
    )


def _out(scheduled, finished=(), resumed=()):
    return SimpleNamespace(
        num_scheduled_tokens={r: 1 for r in scheduled},
        finished_req_ids=set(finished),
        scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=set(resumed)),
    )


def test_unscheduled_decode_keeps_its_accepted_count():
    runner = _runner(["a", "b", "c"], [3, 1, 5])
    slot.save_unscheduled(runner, _out(["b"]))  # a and c sit out
    assert getattr(runner, slot._SAVED) == {"a": 3, "c": 5}  # b: 1 needs nothing
    # a comes back (vLLM's add_request set its count to 1); c was preempted
    runner.input_batch.req_id_to_index = {"b": 0, "a": 1, "c": 2}
    runner.input_batch.num_accepted_tokens_cpu[:] = 1
    slot.restore_returning(runner, _out(["a", "b", "c"], resumed=["c"]))
    assert runner.num_accepted_tokens.np[:3].tolist() == [1, 3, 1]
    assert runner.input_batch.num_accepted_tokens_cpu.tolist() == [1, 3, 1]
    # only the returning row is written on the device (dflash_hybrid_no_accepted_sync
    # leaves the other rows' device counts newer than the host's)
    assert runner.num_accepted_tokens.gpu[:3].tolist() == [7, 3, 7]
    assert getattr(runner, slot._SAVED) == {}


def test_finished_requests_are_forgotten():
    runner = _runner(["a"], [4])
    slot.save_unscheduled(runner, _out([]))
    assert getattr(runner, slot._SAVED) == {"a": 4}
    runner.input_batch.req_id_to_index = {}
    slot.save_unscheduled(runner, _out([], finished=["a"]))
    assert getattr(runner, slot._SAVED) == {}
    assert slot.probe()
