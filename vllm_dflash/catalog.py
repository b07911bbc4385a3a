# SPDX-License-Identifier: Apache-2.0
"""The ordered list of every runtime change vllm-dflash makes to vLLM.

Each record lives beside its code (``PATCH = Patch(...)`` in its module); this
module only orders them. Order matters only where a patch wraps a symbol another
one also wraps; each apply() is idempotent and each probe reads the unpatched
vLLM object.
"""

from vllm_dflash.attention import gdn_shared_metadata
from vllm_dflash.config import hybrid_prefix_caching, quantized_drafter, step_budget
from vllm_dflash.core import (
    adaptive_draft_length,
    draft_slot_budget,
    hybrid_cache_hit,
    lookahead_slots,
    stale_draft_placeholders,
    step_log,
)
from vllm_dflash.cpu import (
    attention,
    dflash_inputs,
    dist_name,
    expand,
    gdn,
    rejection,
    runner,
    seeded_sampling,
    weights,
)
from vllm_dflash.engine import stop_strings
from vllm_dflash.entrypoints import arg_parser, argv_rebuild
from vllm_dflash.layers import gdn_state_replay
from vllm_dflash.registry import Patch
from vllm_dflash.sample import min_tokens
from vllm_dflash.spec_decode import (
    aux_layers,
    context_end,
    context_only_pass,
    cudagraph_memory,
    drafter_kv_dtype,
    drafter_kv_group,
    drafter_mm_gather,
    flex_block_n,
    flex_cudagraph,
    flex_hybrid_kv,
    flex_recompile_limit,
    gdn_unscheduled_slot,
    gdn_zero_drafts,
    hybrid_accepted_sync,
    hybrid_align_accepted_order,
    jit_warmup,
    mrope_positions,
    partial_draft_head,
    prefill_alias,
    query_buffers,
    short_draft_block,
    sliding_window,
    step_profile,
    tp_graph_replay,
    trace,
)

PATCHES: tuple[Patch, ...] = (
    aux_layers.PATCH,
    sliding_window.PATCH,
    sliding_window.FIELDS_PATCH,
    lookahead_slots.PATCH,
    draft_slot_budget.PATCH,
    step_budget.PATCH,
    drafter_kv_dtype.PATCH,
    runner.PATCH,
    rejection.PATCH,
    rejection.RECOVERED_PATCH,
    expand.PATCH,
    seeded_sampling.PARTIAL_PATCH,
    seeded_sampling.MIXED_PATCH,
    dflash_inputs.PATCH,
    *gdn.PATCH_RECORDS,
    weights.PATCH,  # after cpu_gdn_conv1d_weight: wraps the same CPU dispatch
    mrope_positions.PATCH,
    context_end.PATCH,  # after mrope_positions: wraps the same first pass
    drafter_mm_gather.PATCH,
    hybrid_cache_hit.PATCH,
    hybrid_cache_hit.TRUNCATE_PATCH,
    hybrid_cache_hit.SHORTER_STEP_PATCH,
    hybrid_prefix_caching.PATCH,
    adaptive_draft_length.PATCH,
    gdn_zero_drafts.PATCH,
    # innermost of the _prepare_inputs wrappers: the next one writes the counts of
    # rows that return to the batch after it
    hybrid_align_accepted_order.PATCH,
    gdn_unscheduled_slot.PATCH,
    min_tokens.PATCH,  # after gdn_unscheduled_slot: wraps the same _update_states
    stale_draft_placeholders.PATCH,
    hybrid_accepted_sync.PATCH,
    gdn_shared_metadata.PATCH,
    gdn_state_replay.PATCH,  # after gdn_shared_metadata: wraps the same build
    drafter_kv_group.PATCH,
    attention.KV_UPDATE_PATCH,
    attention.NONCAUSAL_PATCH,
    dist_name.PATCH,
    arg_parser.ARG_PATCH,
    argv_rebuild.PATCH,
    prefill_alias.PATCH,
    tp_graph_replay.PATCH,
    cudagraph_memory.PATCH,  # after tp_graph_replay: wraps its profile wrapper
    query_buffers.PATCH,
    flex_cudagraph.PATCH,
    flex_hybrid_kv.PATCH,
    flex_block_n.PATCH,
    flex_recompile_limit.PATCH,
    arg_parser.VALIDATE_PATCH,
    stop_strings.PATCH,
    quantized_drafter.PATCH,
    adaptive_draft_length.CONFIG_PATCH,
    # The next three wrap DFlashProposer.propose, outermost last; all three
    # are applied on import of the model runner (``Patch.trigger``).
    context_only_pass.PATCH,
    partial_draft_head.PATCH,
    short_draft_block.PATCH,
    trace.PATCH,
    step_profile.PATCH,
    step_log.PATCH,
    jit_warmup.PATCH,
)
