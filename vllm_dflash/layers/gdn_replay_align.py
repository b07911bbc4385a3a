# SPDX-License-Identifier: Apache-2.0
"""Gated-DeltaNet state replay in the 'align' mamba cache mode (prefix caching).

With prefix caching a hybrid target runs vLLM's 'align' mode: a request's GDN
state lives in the block of its last token, and a block whose end the request
passes keeps the state at that boundary (the prefix cache hands it to later
requests). vLLM 0.20.x moves the state between blocks in two places of
``vllm.v1.worker.mamba_utils``, both written for its ``1 + k`` speculative
state copies (``num_speculative_blocks = k``):

* ``preprocess_mamba`` (before a step): the step's last token is in another
  block than the state: copy the state of the last accepted token (speculative
  copy ``num_accepted - 1``) there and set the accepted count to 1;
* ``postprocess_mamba`` (after a step): the accepted tokens passed a block
  boundary: copy the speculative copy at the boundary into that block.

With ``dflash_gdn_state_replay`` a request has one state, still before the last
verify, plus the verify's records in the ring of the same page, pending until
the next step commits the accepted ones. So here:

* ``preprocess_mamba`` moves the whole page (conv state, GDN state, ring) and
  keeps the accepted count: the next step's commit and conv update read it as if
  the page had not moved;
* ``postprocess_mamba`` copies the page to the boundary block, shifts the conv
  state by the tokens up to the boundary (vLLM's conv copy), commits the records
  up to the boundary there and marks that ring done; the running page keeps its
  pending records. Where the boundary is the last accepted token (the running
  block), the commit is in place and the count becomes 1, as in vLLM.

So a cached block always holds the state at its boundary and no pending record,
the same state vLLM would have copied there. Only in engines where
``dflash_gdn_state_replay`` replays (DFlash on a GDN target); every other engine
runs vLLM's functions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vllm_dflash.layers.ops import gdn_replay

# (layer) -> whether the layer replays (gdn_state_replay._layer_replays)
LayerReplays = Callable[[Any], bool]
# (layer) -> its ring layout (gdn_state_replay.layer_layout)
LayerLayout = Callable[[Any], gdn_replay.RingLayout]


def page_copy_spec(
    state: torch.Tensor, block_ids: list[int], cur_block_idx: int, _num_accepted: int
) -> Any:
    """vLLM ``MambaStateCopyFunc`` for a layer's first state tensor: the whole page
    of block ``cur_block_idx`` (vLLM lays a layer's state tensors out one after
    the other in the block's page, the first at its start; ``stride(0)`` is the
    page)."""
    from vllm.model_executor.layers.mamba.mamba_utils import MambaCopySpec

    page = state[block_ids[cur_block_idx]]
    return MambaCopySpec(start_addr=page.data_ptr(), num_elements=state.stride(0))


_REPLAYS_ATTR = "_vllm_dflash_engine_replays"  # on the runner's copy buffers


def engine_replays(
    kv_cache_config: Any,
    copy_bufs: Any,
    forward_context: dict[str, Any],
    replays: LayerReplays,
) -> bool:
    """Whether the engine's GDN layers replay (decided once per runner: its copy
    buffers live as long as its KV-cache config)."""
    known = getattr(copy_bufs, _REPLAYS_ATTR, None)
    if known is None:
        group = kv_cache_config.kv_cache_groups[copy_bufs.mamba_group_ids[0]]
        known = replays(forward_context[group.layer_names[0]])
        setattr(copy_bufs, _REPLAYS_ATTR, known)
    return known


def preprocess(
    stock: Callable[..., None],
    scheduler_output: Any,
    kv_cache_config: Any,
    cache_config: Any,
    mamba_state_idx: dict[str, int],
    input_batch: Any,
    requests: dict[str, Any],
    forward_context: dict[str, Any],
    mamba_state_copy_funcs: tuple[Any, ...],
    copy_bufs: Any,
) -> None:
    """vLLM's ``preprocess_mamba`` moving whole pages, accepted counts kept."""
    n = input_batch.num_reqs
    counts = input_batch.num_accepted_tokens_cpu[:n].copy()
    stock(
        scheduler_output, kv_cache_config, cache_config, mamba_state_idx,
        input_batch, requests, forward_context, (page_copy_spec,), copy_bufs,
    )  # fmt: skip
    input_batch.num_accepted_tokens_cpu[:n] = counts


def boundary_rows(
    scheduler_output: Any,
    input_batch: Any,
    requests: dict[str, Any],
    mamba_state_idx: dict[str, int],
    block_size: int,
) -> list[tuple[int, str, int, int, int]]:
    """(row, request, running block, boundary block, tokens past the running
    state) of every row whose accepted tokens reached a block boundary this step:
    the rows ``postprocess_mamba`` copies a state for. Rows without drafts have
    nothing pending and vLLM copies nothing for them (their one token ends at the
    boundary only in the block that holds their state, whose count is 1)."""
    spec_tokens = scheduler_output.scheduled_spec_decode_tokens
    out = []
    for i, req_id in enumerate(input_batch.req_ids):
        req_state = requests[req_id]
        num_drafts = len(spec_tokens.get(req_id, ()))
        running = (
            req_state.num_computed_tokens
            + scheduler_output.num_scheduled_tokens[req_id]
            - num_drafts
        )
        computed = running + int(input_batch.num_accepted_tokens_cpu[i]) - 1
        aligned = computed // block_size * block_size
        if num_drafts and aligned >= running:
            out.append(
                (i, req_id, mamba_state_idx[req_id], aligned // block_size - 1,
                 aligned - running)
            )  # fmt: skip
    return out


def postprocess(
    scheduler_output: Any,
    kv_cache_config: Any,
    input_batch: Any,
    requests: dict[str, Any],
    mamba_state_idx: dict[str, int],
    forward_context: dict[str, Any],
    mamba_state_copy_funcs: tuple[Any, ...],
    copy_bufs: Any,
    collect: Callable[..., None],
    memcpy: Callable[..., None],
    layout_of: LayerLayout,
) -> None:
    """vLLM's ``postprocess_mamba`` for replay pages (see the module docstring).
    ``collect``/``memcpy``: vLLM's ``collect_mamba_copy_meta`` and
    ``batch_memcpy``."""
    group_ids = copy_bufs.mamba_group_ids
    block_size = copy_bufs.mamba_spec.block_size
    rows = boundary_rows(
        scheduler_output, input_batch, requests, mamba_state_idx, block_size
    )
    if not rows:
        return

    def collect_all(funcs: tuple[Any, ...], moved_only: bool) -> None:
        for _, req_id, src, dest, bias in rows:
            if moved_only and src == dest:
                continue
            collect(
                copy_bufs, kv_cache_config, funcs, group_ids, src, dest, bias,
                requests[req_id], forward_context,
            )  # fmt: skip

    # the page (ring included) to the boundary block, then the conv state there
    # shifted to the boundary: one upload of both tables, two launches in order
    copy_bufs.offset = 0
    collect_all((page_copy_spec,), moved_only=True)
    pages = copy_bufs.offset
    collect_all(mamba_state_copy_funcs[:1], moved_only=False)
    launch_in_two(copy_bufs, pages, memcpy)

    counts = [bias + 1 for *_, bias in rows]
    for gid in group_ids:
        dests = [
            requests[req_id].block_ids[gid][dest] for _, req_id, _, dest, _ in rows
        ]
        names = kv_cache_config.kv_cache_groups[gid].layer_names
        commit_at(forward_context, names, dests, counts, layout_of)
    for i, _, src, dest, _ in rows:
        if src == dest:  # the running state is now the boundary's
            input_batch.num_accepted_tokens_cpu[i] = 1


def launch_in_two(copy_bufs: Any, first: int, memcpy: Callable[..., None]) -> None:
    """Copy entries ``[0, first)``, then ``[first, offset)`` of ``copy_bufs``: one
    host-to-device upload (refilling the pinned tables while an upload may still
    read them would race), two launches on the stream, in order."""
    n = copy_bufs.offset
    if n == 0:
        return
    src = copy_bufs.src_ptrs.copy_to_gpu(n)
    dst = copy_bufs.dst_ptrs.copy_to_gpu(n)
    sizes = copy_bufs.sizes.copy_to_gpu(n)
    for lo, hi in ((0, first), (first, n)):
        if hi > lo:
            memcpy(src[lo:hi], dst[lo:hi], sizes[lo:hi])


def commit_at(
    forward_context: dict[str, Any],
    layer_names: list[str],
    slots: list[int],
    counts: list[int],
    layout_of: LayerLayout,
) -> None:
    """Commit the first ``counts[j]`` records of slot ``slots[j]`` into its state,
    in every layer, and mark those rings done (nothing pending)."""
    first = forward_context[layer_names[0]].kv_cache[1]
    idx = torch.tensor(slots, dtype=torch.int32).to(first.device)
    num = torch.tensor(counts, dtype=torch.int32).to(first.device)
    for name in layer_names:
        layer = forward_context[name]
        state, ring = layer.kv_cache[1], layer.kv_cache[2]
        gates = gdn_replay.Gates(layer.A_log, layer.dt_bias, 20.0, True)
        gdn_replay.commit(state, ring, layout_of(layer), idx, num, gates)
        ring[:, 0].index_fill_(0, idx.long(), 0.0)
