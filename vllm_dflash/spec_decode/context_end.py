# SPDX-License-Identifier: Apache-2.0
"""DFlash drafter metadata stops at ``max_model_len``.

``DFlashProposer.set_inputs_first_pass`` (0.20.x) lays out the query block (the
newest token and k mask tokens) at positions ``last + 1 .. last + 1 + k`` and
gives the drafter sequence lengths ``seq_len + 1 + k``, with no bound. For a
request within ``k + 1`` tokens of ``max_model_len`` the block reaches past the
context. Three things then go wrong:

* The drafter's attention metadata counts blocks the request's block table does
  not have: the table is ``cdiv(max_model_len, block_size)`` wide.
  * FLEX_ATTENTION (float32 on CUDA) with a sliding-window drafter layer builds its
    window mask over ``cdiv(max_seq_len, block_size)`` logical blocks. The
    pages are sliced to the table's width, so the two shapes disagree and the
    build raises: "The size of tensor a (16) must match the size of tensor b (17)".
  * Under vLLM's asynchronous scheduling that exception is hidden behind the
    next step. That step reads the failed step's ``-1`` draft placeholders, and
    the target's embedding ends the engine with a device-side assert. This was
    measured on an H100 (2026-12-07) with the tiny hybrid pair through
    ``vllm serve``, a request generating up to ``max_model_len``.
  * Other backends get sequence lengths the block table does not cover.
* The input-expansion kernel clamps the block index to the table's last column.
  So the K/V of every query position past the context overwrites the drafter's
  cached K/V of an earlier position in the request's last block.

The patch leaves every request that fits untouched. Only when the step's
host-side upper bound of the drafter's sequence lengths passes
``max_model_len`` (no device sync) does it change the block:

* the query tokens at positions ``>= max_model_len`` get vLLM's padding slot, so
  their K/V is not written;
* the drafter's sequence lengths are capped at ``max_model_len``.

This is what vLLM's EAGLE proposer does for the same positions. Drafts at
those positions can never be verified, because the scheduler does not schedule
tokens past ``max_model_len``. The drafts before them are exact drafts of a
block without its out-of-context members. Output is unchanged: verification
decides it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from vllm_dflash.registry import Patch, PatchKind, original, replace_attr

PATCH_NAME = "dflash_context_end_cap"


def cap_at_context_end(
    cad: Any, query_positions: torch.Tensor, max_model_len: int
) -> Any:
    """``cad`` (the drafter's CommonAttentionMetadata) without the query tokens
    past ``max_model_len``: their slots padded (in place, in the proposer's slot
    buffer), sequence lengths capped. Vectorised; no host sync."""
    from vllm.v1.spec_decode.utils import PADDING_SLOT_ID

    cad.slot_mapping.masked_fill_(query_positions >= max_model_len, PADDING_SLOT_ID)
    upper = cad.seq_lens_cpu_upper_bound
    return dataclasses.replace(
        cad,
        seq_lens=cad.seq_lens.clamp(max=max_model_len),
        max_seq_len=min(cad.max_seq_len, max_model_len),
        seq_lens_cpu_upper_bound=(
            upper.clamp(max=max_model_len) if upper is not None else None
        ),
    )


def run_first_pass(
    method, max_model_len: int, last_position: int, k: int = 3, block_size: int = 16
) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """Run a ``set_inputs_first_pass`` (stock or patched) on a stand-in proposer
    (CPU tensors, the vectorised input expansion) for one request whose newest
    context token sits at ``last_position``, with k drafts. Returns the query
    positions, the query slots and the drafter metadata it built."""
    import numpy as np
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.spec_decode import dflash

    from vllm_dflash.cpu.dflash_inputs import TRITON_SHIM, _Launcher

    q = 1 + k
    width = -(-max_model_len // block_size)

    class _Stub(dflash.DFlashProposer):
        def __init__(self) -> None:  # no vLLM config: the buffers the pass uses
            self.num_speculative_tokens = k
            self.max_model_len = max_model_len
            self.block_size = block_size
            self.device = torch.device("cpu")
            self.parallel_drafting_token_id = 0
            self.input_ids = torch.zeros(q, dtype=torch.int32)
            self.positions = torch.zeros(q, dtype=torch.int64)
            self._slot_mapping_buffer = torch.zeros(q, dtype=torch.int64)
            self._context_positions_buffer = torch.zeros(q, dtype=torch.int64)
            self._context_slot_mapping_buffer = torch.zeros(q, dtype=torch.int64)
            self.arange = torch.arange(2, dtype=torch.int32)
            self.token_arange_np = np.arange(2)

    seq_len = last_position + 1
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    cad = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl,
        seq_lens=torch.tensor([seq_len], dtype=torch.int32), num_reqs=1,
        num_actual_tokens=1, max_query_len=1, max_seq_len=seq_len,
        block_table_tensor=torch.arange(1, width + 1, dtype=torch.int32)[None],
        slot_mapping=torch.zeros(1, dtype=torch.int64), causal=True,
        seq_lens_cpu_upper_bound=torch.tensor([seq_len], dtype=torch.int32),
    )  # fmt: skip
    saved = dflash.copy_and_expand_dflash_inputs_kernel, dflash.triton
    dflash.copy_and_expand_dflash_inputs_kernel = _Launcher()
    if not hasattr(dflash.triton, "next_power_of_2"):  # no Triton driver (CPU)
        dflash.triton = TRITON_SHIM
    try:
        stub = _Stub()
        _, _, new_cad = method(
            stub, torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
            torch.tensor([last_position]), torch.zeros(1, 4), None, cad, None,
        )  # fmt: skip
    finally:
        dflash.copy_and_expand_dflash_inputs_kernel, dflash.triton = saved
    return stub.positions.clone(), new_cad.slot_mapping.clone(), new_cad


def probe() -> bool:
    """Does the stock first pass give the drafter sequence lengths past
    ``max_model_len`` for a request at the context's end?"""
    from vllm.v1.spec_decode import dflash

    stock = original(dflash.DFlashProposer.set_inputs_first_pass)
    _, _, cad = run_first_pass(stock, max_model_len=64, last_position=62)
    return int(cad.seq_lens.max()) > 64 or cad.max_seq_len > 64


def apply() -> None:
    from vllm.v1.spec_decode import dflash

    stock = dflash.DFlashProposer.set_inputs_first_pass

    def set_inputs_first_pass(self, *args, **kwargs):
        num_query, indices, new_cad = stock(self, *args, **kwargs)
        # max_seq_len: the host's upper bound of the step (no device read)
        if new_cad.max_seq_len > self.max_model_len:
            new_cad = cap_at_context_end(
                new_cad, self.positions[:num_query], self.max_model_len
            )
        return num_query, indices, new_cad

    replace_attr(
        dflash.DFlashProposer,
        "set_inputs_first_pass",
        set_inputs_first_pass,
        PATCH_NAME,
    )


PATCH = Patch(
    name=PATCH_NAME,
    kind=PatchKind.FIX,
    targets=("vllm.v1.spec_decode.dflash:DFlashProposer.set_inputs_first_pass",),
    summary=(
        "DFlash at the context's end: query tokens past max_model_len get padding "
        "slots and the drafter's sequence lengths stop at max_model_len."
    ),
    why=(
        "0.20.x gives the drafter seq_len + 1 + k unbounded: FLEX_ATTENTION's "
        "sliding-window mask build raises on a request within k + 1 tokens of "
        "max_model_len (under async scheduling: a device-side assert one step later), "
        "and the out-of-context K/V overwrites the request's last cached block."
    ),
    upstream="none (vLLM 0.20.x DFlash; EAGLE pads these slots: exceeds_max_model_len)",
    # 0.20.0-0.20.2 share this proposer; 0.21.0 changed it (not verified there).
    versions=">=0.20.0,<0.21.0",
    platforms=("cuda", "cpu", "rocm"),
    probe=probe,
    apply=apply,
    future="Upstream: bound the DFlash query block at max_model_len as EAGLE does.",
    probe_false_reason="the proposer already stops the drafter at max_model_len",
)
