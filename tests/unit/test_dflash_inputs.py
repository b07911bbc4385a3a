# SPDX-License-Identifier: Apache-2.0
"""CPU defect 4: the vectorised DFlash input expansion vs a per-token loop."""

from __future__ import annotations

import pytest
import torch

from vllm_dflash.cpu.dflash_inputs import (
    _cdiv,
    _next_power_of_2,
    copy_and_expand_dflash_inputs,
)


def _loop_reference(next_ids, tpos, table, qsl, rejected, mask_id, bs, q, k):
    ids, qpos, qslot, ctx_pos, ctx_slot, tidx = [], [], [], [], [], []
    for r in range(len(qsl) - 1):
        s, e = int(qsl[r]), int(qsl[r + 1])
        for j in range(s, e):
            p = int(tpos[j])
            ctx_pos.append(p)
            ctx_slot.append(
                int(table[r, min(p // bs, table.shape[1] - 1)]) * bs + p % bs
            )
        last = int(tpos[e - 1 - (int(rejected[r]) if rejected is not None else 0)])
        for o in range(q):
            p = last + 1 + o
            qpos.append(p)
            qslot.append(int(table[r, min(p // bs, table.shape[1] - 1)]) * bs + p % bs)
            ids.append(int(next_ids[r]) if o == 0 else mask_id)
            if o > 0:
                tidx.append(r * q + o)
    return ids, qpos, qslot, ctx_pos, ctx_slot, tidx


@pytest.mark.parametrize("with_rejected", [False, True])
def test_matches_loop(with_rejected):
    g = torch.Generator().manual_seed(0)
    k, bs, q = 3, 4, 4
    ctx_lens = [5, 1, 4]
    qsl = torch.tensor([0] + list(torch.tensor(ctx_lens).cumsum(0)), dtype=torch.int32)
    starts = [7, 0, 12]
    tpos = torch.cat(
        [torch.arange(s, s + n) for s, n in zip(starts, ctx_lens, strict=True)]
    )
    table = torch.randint(1, 50, (6, 8), generator=g, dtype=torch.int32)
    rejected = torch.tensor([2, 0, 3], dtype=torch.int32) if with_rejected else None
    next_ids = torch.tensor([11, 22, 33], dtype=torch.int32)
    n_ctx = int(qsl[-1])
    out = {
        name: torch.full((32,), -7, dtype=dt)
        for name, dt in [
            ("ids", torch.int32), ("qpos", torch.int64), ("qslot", torch.int64),
            ("cpos", torch.int64), ("cslot", torch.int64), ("tidx", torch.int32),
        ]
    }  # fmt: skip
    copy_and_expand_dflash_inputs(
        next_token_ids_ptr=next_ids, target_positions_ptr=tpos,
        out_input_ids_ptr=out["ids"], out_context_positions_ptr=out["cpos"],
        out_query_positions_ptr=out["qpos"], out_context_slot_mapping_ptr=out["cslot"],
        out_query_slot_mapping_ptr=out["qslot"], out_token_indices_ptr=out["tidx"],
        block_table_ptr=table, block_table_stride=table.stride(0), query_start_loc_ptr=qsl,
        num_rejected_tokens_ptr=rejected if with_rejected else 0,
        parallel_drafting_token_id=3, block_size=bs, num_query_per_req=q,
        num_speculative_tokens=k, total_input_tokens=n_ctx, BLOCK_SIZE=16,
        HAS_NUM_REJECTED=with_rejected,
    )  # fmt: skip
    ids, qpos, qslot, cpos, cslot, tidx = _loop_reference(
        next_ids, tpos, table, qsl, rejected, 3, bs, q, k
    )
    nq = len(ctx_lens) * q
    assert out["ids"][:nq].tolist() == ids
    assert out["qpos"][:nq].tolist() == qpos
    assert out["qslot"][:nq].tolist() == qslot
    assert out["cpos"][:n_ctx].tolist() == cpos
    assert out["cslot"][:n_ctx].tolist() == cslot
    assert out["tidx"][: len(ctx_lens) * k].tolist() == tidx
    assert out["ids"][nq:].eq(-7).all()  # nothing written past the batch


def test_triton_shim_arithmetic():
    assert [_next_power_of_2(n) for n in (1, 2, 3, 5, 16, 17)] == [1, 2, 4, 8, 16, 32]
    assert _cdiv(17, 16) == 2 and _cdiv(16, 16) == 1
