# SPDX-License-Identifier: Apache-2.0
"""DFlash proposer with per-layer attention metadata (backport of PR #40898).

Full drafter layers get non-causal metadata (every block token sees the whole
context and block); sliding layers get causal metadata built by the same
builder, so with their window W a query at position p sees p-W+1..p. Works
with any number of draft attention groups.
"""

from __future__ import annotations

from dataclasses import replace

from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.spec_decode.dflash import DFlashProposer
from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

from vllm_dflash.logger import init_logger

logger = init_logger(__name__)

# Backends whose drafts were checked against the float64 reference (GPU check,
# benchmarks/results): non-causal blocks on all three; sliding windows on
# FLASH_ATTN and CPU_ATTN only. FLEX_ATTENTION (vLLM's choice for fp32 on CUDA)
# matched the reference 99.6% exact on full layers but 89.0% with sliding layers
# (FLASH_ATTN bf16: 96%), so a sliding drafter is not allowed on it.
CAPABLE_BACKENDS = ("FLASH_ATTN", "FLEX_ATTENTION", "CPU_ATTN")
SLIDING_CAPABLE_BACKENDS = ("FLASH_ATTN", "CPU_ATTN")


class DFlashSWAProposer(DFlashProposer):
    sliding_attn_layer_names: frozenset[str] = frozenset()

    def load_model(self, target_model) -> None:
        super().load_model(target_model)
        self.sliding_attn_layer_names = frozenset(
            getattr(self.model, "sliding_attn_layer_names", frozenset())
        )

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
            for group in self.draft_attn_groups:
                names = [
                    n for n in group.layer_names if n in self.sliding_attn_layer_names
                ]
                if not names:
                    continue
                md = group.get_metadata_builder().build_for_drafting(
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
