# SPDX-License-Identifier: Apache-2.0
"""One Gated-DeltaNet metadata build per step, shared by every GDN KV-cache group.

vLLM splits a hybrid target's layers into KV-cache groups of equal size; the
Qwen3.6-27B-shaped pair has 15 (10 of them Gated-DeltaNet, 48 GDN layers / 5).
Each step ``GPUModelRunner._build_attention_metadata`` builds the metadata of
every group, and ``GDNAttentionMetadataBuilder.build`` with speculative decoding
is ~100 small torch calls (masks, sums, cumsums, index selects, copies into the
CUDA-graph buffers): ~10 ms of host time per step for the 10 groups, profiled on
an H200, while the GPU waits (2026-12-01, issue #16).

The groups' metadata differ only in the block table (which state slot each
request owns); vLLM already has the mechanism for that: a builder whose class
sets ``supports_update_block_table`` is built once per step and the runner asks
the other groups' builders for ``update_block_table(metadata, block_table, ...)``
(attention backends use it; GDN does not). This patch gives the GDN builder that
method in DFlash engines: it recomputes the group's state-slot indices (the
speculative ``[batch, 1 + k]`` slots, the non-speculative slot, and the GDN state
replay's slot when ``dflash_gdn_state_replay`` is on) from the group's block
table, the way ``build`` does, and reuses everything else.

CUDA graphs: a FULL graph of a group's layers reads the persistent buffers of
that group's builder, captured with them. The builders of one engine therefore
share the group-independent buffers (masks, token indices, query start locations,
accepted counts: written once per step by the group that builds), and each keeps
its own slot-index buffers, which ``update_block_table`` fills as ``build`` would.
``tests/unit/test_gdn_shared_metadata.py`` compares ``build`` with build-once +
update for every kind of batch, with and without CUDA graphs.

Only in DFlash engines (other engines build every group as vLLM does), and not in
the 'align' mamba cache mode (prefix caching: vLLM's per-block state copies),
where the slots depend on each request's sequence length.
"""

from __future__ import annotations

import copy
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from vllm_dflash.registry import V020_ONLY, Patch, PatchKind, replace_attr
from vllm_dflash.spec_decode import uses_dflash

NAME = "dflash_gdn_shared_metadata"
INFO_ATTR = "_vllm_dflash_gdn_info"
# Buffers that depend only on the batch, not on the group's block table.
SHARED_BUFFERS = (
    "spec_sequence_masks",
    "spec_token_indx",
    "non_spec_token_indx",
    "spec_query_start_loc",
    "non_spec_query_start_loc",
    "num_accepted_tokens",
)

_lock = threading.Lock()
# id(engine's VllmConfig) -> {(device, buffer name, shape, dtype): tensor}; an
# entry goes with its config (VllmConfig is not hashable: keyed by id)
_shared: dict[int, dict] = {}


@dataclass(frozen=True)
class BuildInfo:
    """How ``build`` chose a batch's state-slot indices (read by the update)."""

    spec_mask_cpu: torch.Tensor | None  # rows on the speculative path
    spec_prefix: bool  # they are the first num_spec_decodes rows
    full_spec: bool  # spec slots live in the builder's CUDA-graph buffer
    full_non_spec: bool  # non-spec slots live in the builder's CUDA-graph buffer
    num_spec_decodes: int
    num_decodes: int
    batch_size: int


def builder_applies(builder: Any) -> bool:
    return (
        uses_dflash(builder)
        and builder.vllm_config.cache_config.mamba_cache_mode != "align"
    )


def _same_storage(t: torch.Tensor | None, buf: torch.Tensor) -> bool:
    return t is not None and t.untyped_storage().data_ptr() == (
        buf.untyped_storage().data_ptr()
    )


def spec_columns(rows: torch.Tensor, num_columns: int) -> torch.Tensor:
    """``rows[:, :num_columns]``; a one-column block table (GDN state replay
    allocates one slot per request) repeats its column, so kernels that read the
    width as the verify length still see ``1 + k``."""
    out = rows[:, :num_columns]
    if out.shape[1] == num_columns:
        return out
    return out[:, :1].expand(-1, num_columns)


def build_info(
    builder: Any, metadata: Any, num_decode_draft_tokens_cpu: torch.Tensor | None
) -> BuildInfo:
    spec = metadata.spec_sequence_masks is not None
    mask = num_decode_draft_tokens_cpu >= 0 if spec else None
    n_spec = metadata.num_spec_decodes
    return BuildInfo(
        spec_mask_cpu=mask,
        spec_prefix=bool(spec and mask[:n_spec].all() and int(mask.sum()) == n_spec),
        full_spec=spec
        and _same_storage(
            metadata.spec_state_indices_tensor, builder.spec_state_indices_tensor
        ),
        full_non_spec=not spec
        and _same_storage(
            metadata.non_spec_state_indices_tensor,
            builder.non_spec_state_indices_tensor,
        ),
        num_spec_decodes=n_spec,
        num_decodes=metadata.num_decodes,
        batch_size=metadata.num_actual_tokens,
    )


def group_indices(builder: Any, metadata: Any, info: BuildInfo, table: torch.Tensor):
    """The state-slot fields of ``metadata`` for another group's block table."""
    from vllm.v1.attention.backends.utils import NULL_BLOCK_ID

    out = copy.copy(metadata)
    k1 = builder.num_spec + 1
    if info.spec_mask_cpu is not None:
        n = info.num_spec_decodes
        rows = table[:n] if info.spec_prefix else table[info.spec_mask_cpu]
        spec_idx = spec_columns(rows, k1)
        if info.full_spec:
            buf = builder.spec_state_indices_tensor
            buf[:n].copy_(spec_idx, non_blocking=True)
            spec_idx = buf[: info.batch_size]
            spec_idx[n:].fill_(NULL_BLOCK_ID)
        out.spec_state_indices_tensor = spec_idx
        if metadata.non_spec_state_indices_tensor is not None:
            out.non_spec_state_indices_tensor = table[~info.spec_mask_cpu, 0]
    elif metadata.non_spec_state_indices_tensor is not None:
        non_spec = table[:, 0]
        if info.full_non_spec:
            buf = builder.non_spec_state_indices_tensor
            buf[: info.num_decodes].copy_(non_spec, non_blocking=True)
            non_spec = buf[: info.batch_size]
            non_spec[info.num_decodes :].fill_(NULL_BLOCK_ID)
        out.non_spec_state_indices_tensor = non_spec
    replay = getattr(metadata, "replay_state_indices", None)
    if replay is not None:
        out.replay_state_indices = table[: replay.shape[0], 0]
    return out


def share_buffers(builder: Any) -> None:
    """Point the builder's group-independent CUDA-graph buffers at its engine's."""
    config = builder.vllm_config
    with _lock:
        engine = _shared.get(id(config))
        if engine is None:
            engine = _shared[id(config)] = {}
            weakref.finalize(config, _shared.pop, id(config), None)
        for name in SHARED_BUFFERS:
            mine = getattr(builder, name)
            key = (str(mine.device), name, tuple(mine.shape), mine.dtype)
            setattr(builder, name, engine.setdefault(key, mine))


def probe() -> bool:
    """vLLM's GDN builder has no update_block_table (builds every group).

    (That the runner reuses a build through ``update_block_table`` is checked by
    tests/unit/test_gdn_shared_metadata.py: the probe runs while the runner's
    module may still be importing.)"""
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder

    return not GDNAttentionMetadataBuilder.supports_update_block_table


def apply() -> None:
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder

    stock_init = GDNAttentionMetadataBuilder.__init__
    stock_build = GDNAttentionMetadataBuilder.build

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        stock_init(self, kv_cache_spec, layer_names, vllm_config, device)
        if builder_applies(self):
            self.supports_update_block_table = True
            share_buffers(self)

    def build(
        self,
        common_prefix_len,
        common_attn_metadata,
        num_accepted_tokens=None,
        num_decode_draft_tokens_cpu=None,
        fast_build=False,
    ):
        metadata = stock_build(
            self,
            common_prefix_len,
            common_attn_metadata,
            num_accepted_tokens=num_accepted_tokens,
            num_decode_draft_tokens_cpu=num_decode_draft_tokens_cpu,
            fast_build=fast_build,
        )
        if self.supports_update_block_table:
            setattr(
                metadata,
                INFO_ATTR,
                build_info(self, metadata, num_decode_draft_tokens_cpu),
            )
        return metadata

    def update_block_table(self, metadata, blk_table, slot_mapping):
        return group_indices(self, metadata, getattr(metadata, INFO_ATTR), blk_table)

    replace_attr(GDNAttentionMetadataBuilder, "__init__", __init__, NAME)
    replace_attr(GDNAttentionMetadataBuilder, "build", build, NAME)
    replace_attr(
        GDNAttentionMetadataBuilder, "update_block_table", update_block_table, NAME
    )


PATCH = Patch(
    name=NAME,
    kind=PatchKind.FEATURE,
    targets=(
        "vllm.v1.attention.backends.gdn_attn:GDNAttentionMetadataBuilder.__init__",
        "vllm.v1.attention.backends.gdn_attn:GDNAttentionMetadataBuilder.build",
        "vllm.v1.attention.backends.gdn_attn:GDNAttentionMetadataBuilder"
        ".update_block_table",
    ),
    summary=(
        "DFlash on hybrid targets: the GDN attention metadata is built once per step "
        "and shared by every GDN KV-cache group (vLLM's update_block_table); only "
        "the state-slot indices are per group."
    ),
    why=(
        "vLLM builds it for each of the 10 GDN groups of Qwen3.6-27B: ~10 ms of host "
        "time per DFlash step on an H200 while the GPU waits."
    ),
    upstream=(
        "none (vLLM's attention backends use update_block_table; GDN does not); "
        "our diff: patches/v0.20.1/0016-gdn-shared-metadata.diff"
    ),
    versions=V020_ONLY,  # the 0.20.x GDN layer, builder and runner
    platforms=("cuda", "cpu"),
    probe=probe,
    apply=apply,
    future="Propose upstream (GDNAttentionMetadataBuilder.update_block_table).",
    probe_false_reason="vLLM's GDN builder already supports update_block_table",
)
