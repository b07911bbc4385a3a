# SPDX-License-Identifier: Apache-2.0
"""DFlash proposer with per-layer attention metadata (backport of PR #40898).

Full drafter layers get non-causal metadata (every block token sees the whole
context and block); sliding layers get causal metadata (from the same builder, or from one of
their own where the backend's builder keeps shared buffers), so with their
window W a query at position p sees p-W+1..p. Works with any number of draft
attention groups.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from types import MappingProxyType

from typing_extensions import override
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.spec_decode.dflash import DFlashProposer
from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

from vllm_dflash.logger import init_logger
from vllm_dflash.registry import raise_if_failed

logger = init_logger(__name__)

# Backends whose drafts were checked against the float64 reference (GPU check,
# benchmarks/results; FLEX_ATTENTION with sliding layers: on CPU tensors,
# tests/unit/test_flex_sliding.py) for non-causal blocks and sliding windows.
CAPABLE_BACKENDS = ("FLASH_ATTN", "FLEX_ATTENTION", "CPU_ATTN")
SLIDING_CAPABLE_BACKENDS = ("FLASH_ATTN", "FLEX_ATTENTION", "CPU_ATTN")


class DFlashSWAProposer(DFlashProposer):
    sliding_attn_layer_names: frozenset[str] = frozenset()
    # draft_attn_groups index -> metadata builder used for that group's sliding layers
    sliding_builders: Mapping[int, object] = MappingProxyType({})

    @override
    def load_model(self, target_model) -> None:
        raise_if_failed()  # a worker-side DFlash patch that could not apply
        super().load_model(target_model)
        self.sliding_attn_layer_names = frozenset(
            getattr(self.model, "sliding_attn_layer_names", frozenset())
        )

    @override
    def initialize_attn_backend(self, kv_cache_config, kernel_block_sizes=None) -> None:
        super().initialize_attn_backend(kv_cache_config, kernel_block_sizes)
        for group in self.draft_attn_groups:
            name = group.backend.get_name()
            sliding = any(n in self.sliding_attn_layer_names for n in group.layer_names)
            allowed = SLIDING_CAPABLE_BACKENDS if sliding else CAPABLE_BACKENDS
            if name not in allowed:
                what = "sliding-window layers" if sliding else "non-causal blocks"
                raise ValueError(
                    f"DFlash drafter layers {sorted(group.layer_names)} use attention "
                    f"backend {name}, which vllm-dflash has not verified for {what} "
                    f"(verified: {', '.join(allowed)}); start vLLM with --dtype bfloat16 "
                    "--attention-backend FLASH_ATTN (GPU) or use the CPU backend."
                )
        self.sliding_builders = self.make_sliding_builders()

    def make_sliding_builders(self) -> dict[int, object]:
        """A metadata builder of their own for each group's sliding layers.

        Some builders keep buffers that every metadata object they build points
        into: FLEX_ATTENTION's block masks view the builder's kv_indices and
        kv_num_blocks, and a sliding layer rebuilds its mask (window-pruned) at
        forward time, so a full layer sharing the builder would attend only to
        the window's blocks (on the H200 in fp32, where vLLM picks FLEX_ATTENTION:
        drafts 89.0% = reference)."""
        builders: dict[int, object] = {}
        for i, group in enumerate(self.draft_attn_groups):
            names = [n for n in group.layer_names if n in self.sliding_attn_layer_names]
            if names:
                base = group.get_metadata_builder()
                builders[i] = group.backend.get_builder_cls()(
                    base.kv_cache_spec, names, self.vllm_config, self.device
                )
        return builders

    @override
    def build_per_group_and_layer_attn_metadata(
        self, cad: CommonAttentionMetadata, draft_index: int = 0
    ) -> tuple[list[object], dict[str, object]]:
        per_group, per_layer = (
            SpecDecodeBaseProposer.build_per_group_and_layer_attn_metadata(
                self, cad, draft_index
            )
        )
        if self.sliding_attn_layer_names:
            causal_cad = replace(cad, causal=True)
            for i, group in enumerate(self.draft_attn_groups):
                names = [
                    n for n in group.layer_names if n in self.sliding_attn_layer_names
                ]
                if not names:
                    continue
                builder = self.sliding_builders.get(i) or group.get_metadata_builder()
                md = builder.build_for_drafting(
                    common_attn_metadata=causal_cad, draft_index=draft_index
                )
                for n in names:
                    per_layer[n] = md
        for layer_name, md in per_layer.items():
            want = layer_name in self.sliding_attn_layer_names
            if getattr(md, "causal", None) is not want:
                raise ValueError(
                    f"DFlash layer {layer_name}: attention metadata "
                    f"{type(md).__name__} cannot express causal={want}; use "
                    "--attention-backend FLASH_ATTN (GPU) or the CPU backend."
                )
        return per_group, per_layer
