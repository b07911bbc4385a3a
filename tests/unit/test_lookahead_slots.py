# SPDX-License-Identifier: Apache-2.0
"""dflash_lookahead_slots (vLLM #42971 + #43733): a new request's first draft
writes its query K/V only into blocks the request owns.

Real vLLM Scheduler + KVCacheManager (prefix caching on) and BlockTable on CPU,
no engine: request C caches a 4-block prefix and keeps its row after a condense
moved it; request B reuses C's first prefix block and lands in C's old row.
Every block B does not own is filled with a sentinel; B's first draft writes its
``[newest, mask x k]`` K/V through the DFlash input expansion's slot mapping.
"""

from __future__ import annotations

import pytest
import torch

from vllm_dflash.core import lookahead_slots as lookahead
from vllm_dflash.registry import PatchState, evaluate

K = 4  # num_speculative_tokens: the query block is K + 1 tokens
B = 16  # block size
NUM_BLOCKS = 32
SENTINEL = -7.0
PREFIX = [100 + i for i in range(4 * B)]  # shared prefix: 4 full blocks


def _requests(prompts: dict[str, list[int]]):
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    hasher = get_request_block_hasher(B, sha256)
    return {
        rid: Request(rid, p, SamplingParams(max_tokens=8), None, block_hasher=hasher)
        for rid, p in prompts.items()
    }


def _first_draft_slots(
    table_row: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Query-block slots of one request's first draft (the DFlash input expansion
    vLLM-CPU runs: vllm_dflash.cpu.dflash_inputs, same arithmetic as the kernel)."""
    from vllm_dflash.cpu.dflash_inputs import copy_and_expand_dflash_inputs

    n, q = positions.numel(), K + 1
    out = {
        name: torch.zeros(size, dtype=torch.int64)
        for name, size in (
            ("ids", q),
            ("ctx_pos", n),
            ("q_pos", q),
            ("ctx_slots", n),
            ("q_slots", q),
            ("idx", K),
        )
    }
    copy_and_expand_dflash_inputs(
        next_token_ids_ptr=torch.tensor([1]),
        target_positions_ptr=positions,
        out_input_ids_ptr=out["ids"],
        out_context_positions_ptr=out["ctx_pos"],
        out_query_positions_ptr=out["q_pos"],
        out_context_slot_mapping_ptr=out["ctx_slots"],
        out_query_slot_mapping_ptr=out["q_slots"],
        out_token_indices_ptr=out["idx"],
        block_table_ptr=table_row,
        block_table_stride=table_row.shape[-1],
        query_start_loc_ptr=torch.tensor([0, n]),
        num_rejected_tokens_ptr=0,
        parallel_drafting_token_id=0,
        block_size=B,
        num_query_per_req=q,
        num_speculative_tokens=K,
        total_input_tokens=n,
    )
    assert out["q_pos"].tolist() == list(
        range(int(positions[-1]) + 1, int(positions[-1]) + q + 1)
    )
    return out["q_slots"]


@pytest.mark.parametrize(
    "prompt_len",
    [3 * B, 3 * B - K],
    ids=["prompt-ends-on-block", "query-block-ends-on-block"],
)
def test_first_draft_writes_only_owned_blocks(prompt_len: int) -> None:
    from vllm.v1.worker.block_table import BlockTable

    state = evaluate(lookahead.PATCH, apply=True).state
    assert state in (PatchState.APPLIED, PatchState.NOT_NEEDED, PatchState.DISABLED)
    sched = lookahead.build_scheduler(
        K, B, num_blocks=NUM_BLOCKS, prefix_caching=True, stock=False
    )
    reqs = _requests({"X": [5] * 20, "C": PREFIX + [7] * 8, "B": PREFIX[:prompt_len]})
    sched.add_request(reqs["X"])
    sched.add_request(reqs["C"])
    first = {r.req_id: r.block_ids[0] for r in sched.schedule().scheduled_new_reqs}
    sched.add_request(reqs["B"])
    out = sched.schedule()
    (new_b,) = out.scheduled_new_reqs
    owned = list(new_b.block_ids[0])
    # EAGLE-style methods drop the last matched block: B reuses one of C's.
    assert owned[0] == first["C"][0], "B should reuse C's cached prefix block"

    # The model runner's block table: X in row 0, C in row 1; X finishes, the
    # condense moves C to row 0 (row 1 keeps C's ids) and B is added at row 1.
    bt = BlockTable(B, 4, NUM_BLOCKS, 256, False, torch.device("cpu"), B, 1)
    bt.add_row(first["X"], 0)
    bt.add_row(first["C"], 1)
    bt.clear_row(0)
    bt.move_row(1, 0)
    bt.add_row(owned, 1)

    computed = new_b.num_computed_tokens
    positions = torch.arange(computed, prompt_len)
    assert out.num_scheduled_tokens["B"] == prompt_len - computed
    slots = _first_draft_slots(bt.block_table.cpu[1:2].clone(), positions)

    kv = torch.full((NUM_BLOCKS, B), SENTINEL)
    kv[owned] = 0.0
    kv.view(-1)[slots] = 1.0  # the drafter's K/V write (do_kv_cache_update)
    not_owned = [b for b in range(NUM_BLOCKS) if b not in owned]
    hit = [b for b in not_owned if (kv[b] != SENTINEL).any()]
    assert not hit, (
        f"B's first draft (positions {prompt_len}..{prompt_len + K}) wrote K/V into "
        f"blocks {hit} it does not own (owns {owned}; C's blocks {first['C']}): "
        f"{state.value}"
    )
    assert (kv.view(-1)[slots] == 1.0).all()


def test_probe_writes_nothing_to_the_vllm_log() -> None:
    """The probe runs in every engine core, DFlash or not (on import of the
    scheduler module). Its stand-in VllmConfig and Scheduler log INFO lines and,
    on CPU, vLLM's block-size WARNING, about a configuration that is not the
    user's: none of it may reach the log."""
    import logging

    import vllm.logger  # noqa: F401  (configures the "vllm" tree before we hook it)

    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    tree = logging.getLogger("vllm")
    handler, level = Keep(logging.DEBUG), tree.level
    tree.addHandler(handler)
    tree.setLevel(logging.INFO)
    try:
        lookahead.probe()
        stock = len(records)
        lookahead.build_scheduler(lookahead._PROBE_K, lookahead._PROBE_BLOCK)
    finally:
        tree.removeHandler(handler)
        tree.setLevel(level)
    assert stock == 0, [r.getMessage() for r in records[:stock]]
    # the same construction unsilenced does log (the check above can fail):
    # vLLM's IR-priority INFO line, and on CPU its block-size WARNING
    assert len(records) > 0
    assert tree.level == level
