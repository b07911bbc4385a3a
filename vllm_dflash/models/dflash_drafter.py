# SPDX-License-Identifier: Apache-2.0
"""DFlash drafter with sliding-window layers (backport of vLLM PR #40898).

Subclasses vLLM's ``DFlashQwen3ForCausalLM`` (the proposer asserts that type).
Sliding layers attend with window W through their attention impl while their
KV cache stays full size (the layer's ``sliding_window`` stays ``None`` for KV
planning, so no block holding precomputed context K/V is recycled); the
proposer gives them causal metadata. Full layers are unchanged (non-causal).
The fc input is cast to the fc weight dtype (fp32 target features); the RoPE
table of the context K/V pass is kept in the K dtype and cut to the rows a
position can index (once, not per step).
"""

from __future__ import annotations

import torch
from typing_extensions import override
from vllm.config import VllmConfig
from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM

from vllm_dflash.config.layer_types import SLIDING, resolve_layer_types
from vllm_dflash.logger import init_logger

logger = init_logger(__name__)


def _set_attention_window(attn, window: int) -> None:
    """Rebuild ``attn.impl`` with a sliding window; KV planning stays full."""
    impl = attn.impl
    attn.impl = type(impl)(
        attn.num_heads,
        attn.head_size,
        impl.scale,
        attn.num_kv_heads,
        None,  # alibi_slopes
        window,
        attn.kv_cache_dtype,
        None,  # logits_soft_cap
        attn.attn_type,
        None,  # kv_sharing_target_layer_name
    )
    attn.sliding_window = None  # -> FullAttentionSpec: KV stays full size


class DFlashDraftModel(DFlashQwen3ForCausalLM):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        layer_types, window = resolve_layer_types(self.config)
        self.layer_types = layer_types
        self.sliding_window = window
        self.sliding_attn_layer_names: frozenset[str] = frozenset()
        names = []
        for layer, kind in zip(self.model.layers, layer_types, strict=True):
            if kind == SLIDING:
                assert window is not None
                _set_attention_window(layer.self_attn.attn, window)
                names.append(layer.self_attn.attn.layer_name)
        self.sliding_attn_layer_names = frozenset(names)
        self._fc_dtype = vllm_config.model_config.dtype
        # the target's context length bounds every context position (a block of
        # k + 1 more rows: the positions of a query block at the context's end)
        spec = vllm_config.speculative_config
        margin = (spec.num_speculative_tokens or 0) + 1 if spec is not None else 1
        self._rope_rows: int = vllm_config.model_config.max_model_len + margin
        if names:
            logger.info(
                "DFlash drafter: %d sliding-window layer(s) (window %d), %d full.",
                len(names),
                window,
                len(layer_types) - len(names),
            )

    @override
    def combine_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.model.use_aux_hidden_state and hidden_states.dtype != self._fc_dtype:
            hidden_states = hidden_states.to(self._fc_dtype)
        return super().combine_hidden_states(hidden_states)

    @override
    def precompute_and_store_context_kv(
        self,
        context_states: torch.Tensor,
        context_positions: torch.Tensor,
        context_slot_mapping: torch.Tensor | None = None,
    ) -> None:
        self._rope_cache_in_kv_dtype()
        super().precompute_and_store_context_kv(
            context_states, context_positions, context_slot_mapping
        )

    def _rope_cache_in_kv_dtype(self) -> None:
        """vLLM 0.20.x's context K/V pass hands its whole RoPE table
        (``max_position_embeddings`` rows: 262,144 x 128 for the Qwen3.6 drafter)
        to ``rotary_embedding`` on every call. On CUDA that op reads a float32
        table and converts any other (the table is in the K dtype once the
        layers' RoPE has run): a 0.1 ms copy a step on an H100 at the 27B
        shapes. Where the table is still float32, vLLM's Python casts it to the K
        dtype first. Keep it cast to the K dtype (vLLM's own cast: the same
        values) and cut to the rows a position can index (``max_model_len``
        plus a block), once the fused buffers exist."""
        inner = self.model
        weight = getattr(inner, "_fused_kv_weight", None)
        cache = getattr(inner, "_rope_cos_sin_cache", None)
        if weight is None or cache is None:
            return
        rows = min(cache.shape[0], self._rope_rows)
        if cache.dtype == weight.dtype and cache.shape[0] == rows:
            return
        inner._rope_cos_sin_cache = cache[:rows].to(dtype=weight.dtype).contiguous()
