# SPDX-License-Identifier: Apache-2.0
"""KV-cache specs of a hybrid target + DFlash drafter, built with vLLM's own code.

No model is built (no weights, no tensor-parallel group): each layer's spec comes
from the vLLM method the engine calls on that layer (``Attention.get_kv_cache_spec``,
``MambaBase.get_kv_cache_spec``) run on a stand-in carrying the attributes the
layer would have, the block size / mamba padding from
``Platform._align_hybrid_block_size``, and the layout from vLLM's
``get_kv_cache_groups`` / ``get_kv_cache_config_from_groups`` /
``get_max_concurrency_for_kv_cache_config``.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
SHAPES_27B = REPO / "fixtures" / "shapes" / "qwen3.6-27b"


def load_27b() -> tuple[dict, dict]:
    return (
        json.loads((SHAPES_27B / "target-config.json").read_text()),
        json.loads((SHAPES_27B / "drafter-config.json").read_text()),
    )


def _hf(d: dict) -> SimpleNamespace:
    return SimpleNamespace(**d)


def vllm_config_for(
    target: dict,
    num_spec: int,
    kv_cache_dtype: str,
    max_model_len: int = 8192,
    method: str = "dflash",
    mamba_cache_mode: str = "none",
) -> SimpleNamespace:
    """A stand-in VllmConfig with vLLM's real CacheConfig ('align': prefix caching
    on a hybrid target)."""
    from vllm.config import CacheConfig

    t = target.get("text_config") or target
    head = t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"]
    dtype = str(t.get("torch_dtype") or t.get("dtype") or "bfloat16")
    model_config = SimpleNamespace(
        dtype=getattr(torch, dtype),
        use_mla=False,
        architecture=target["architectures"][0],
        architectures=target["architectures"],
        model_impl="auto",
        convert_type="none",
        runner_type="generate",
        hf_config=_hf(target),
        hf_text_config=_hf(t),
        max_model_len=max_model_len,
        get_num_kv_heads=lambda parallel_config: t["num_key_value_heads"],
        get_head_size=lambda: head,
        get_mamba_chunk_size=lambda: 64,
    )
    cache_config = CacheConfig(cache_dtype=kv_cache_dtype)
    cache_config.block_size = 16
    cache_config.mamba_block_size = None
    cache_config.mamba_cache_mode = mamba_cache_mode
    return SimpleNamespace(
        model_config=model_config,
        cache_config=cache_config,
        parallel_config=SimpleNamespace(
            tensor_parallel_size=1,
            decode_context_parallel_size=1,
            prefill_context_parallel_size=1,
        ),
        speculative_config=SimpleNamespace(
            num_speculative_tokens=num_spec, method=method
        )
        if num_spec
        else None,
        scheduler_config=SimpleNamespace(
            disable_hybrid_kv_cache_manager=False,
            max_num_batched_tokens=8192,
        ),
    )


class _FlashAttnBlocks:
    """FlashAttention's kernel block sizes (its class needs CUDA to import)."""

    @staticmethod
    def get_supported_kernel_block_sizes():
        from vllm.v1.attention.backend import MultipleOf

        return [MultipleOf(16)]


def _attention_spec(vllm_config, kv_cache_dtype: str, num_kv_heads: int, head: int):
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.attention.backend import AttentionType

    layer = SimpleNamespace(
        attn_type=AttentionType.DECODER,
        kv_cache_dtype=kv_cache_dtype,
        kv_cache_torch_dtype=kv_cache_dtype_str_to_dtype(
            kv_cache_dtype, vllm_config.model_config
        ),
        sliding_window=None,  # sliding drafter layers keep full-size KV (plugin)
        num_kv_heads=num_kv_heads,
        head_size=head,
        head_size_v=head,
    )
    return Attention.get_kv_cache_spec(layer, vllm_config)


def drafter_kv_cache_dtype(drafter_layer_cache_config: Any) -> str:
    """The drafter attention's KV dtype, as ``Attention.__init__`` resolves it."""
    if drafter_layer_cache_config is None:
        return "auto"
    return drafter_layer_cache_config.cache_dtype


def build_specs(
    target: dict,
    drafter: dict | None,
    vllm_config,
    drafter_layer_cache_config: Any = None,
    gdn_replay: bool = False,
    drafter_kv_shared: bool = False,
) -> dict:
    """{layer name: KVCacheSpec} in model order (target layers, then drafter).

    ``gdn_replay``: as a DFlash engine with ``dflash_gdn_state_replay`` builds
    them (the patch's shape calculators, block-size step and layer spec);
    otherwise as vLLM does (the patch's pieces pass vLLM's values through).
    ``drafter_kv_shared``: the drafter layers' specs as
    ``dflash_drafter_kv_shared_group`` merges them."""
    from vllm_dflash.layers import gdn_state_replay as replay

    for piece in ("calculators", "platform"):
        replay._apply_piece(piece)
    spec = vllm_config.speculative_config
    if spec is not None and not gdn_replay:
        spec.method = "mtp"  # any method but DFlash: vLLM's layout, untouched
    assert not gdn_replay or replay.config_replays(vllm_config)
    from vllm.model_executor.layers.mamba.abstract import MambaBase
    from vllm.model_executor.models import ModelRegistry
    from vllm.platforms.interface import Platform

    Platform._align_hybrid_block_size(vllm_config, _FlashAttnBlocks)
    cache = vllm_config.cache_config
    if cache.mamba_block_size is None:  # set by the config's verify step in vLLM
        cache.mamba_block_size = vllm_config.model_config.max_model_len
    model_cls, _ = ModelRegistry.resolve_model_cls(
        vllm_config.model_config.architecture, model_config=vllm_config.model_config
    )
    gdn = SimpleNamespace(
        get_state_shape=lambda: model_cls.get_mamba_state_shape_from_config(
            vllm_config
        ),
        get_state_dtype=lambda: model_cls.get_mamba_state_dtype_from_config(
            vllm_config
        ),
        mamba_type="gdn_attention",
    )
    t = target.get("text_config") or target
    head = t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"]
    specs = {}
    for i, kind in enumerate(t["layer_types"]):
        name = f"language_model.model.layers.{i}"
        if kind == "linear_attention":
            specs[f"{name}.linear_attn"] = (
                replay.replay_kv_cache_spec(
                    lambda: MambaBase.get_kv_cache_spec(gdn, vllm_config)
                )
                if gdn_replay
                else MambaBase.get_kv_cache_spec(gdn, vllm_config)
            )
        else:
            specs[f"{name}.self_attn.attn"] = _attention_spec(
                vllm_config, cache.cache_dtype, t["num_key_value_heads"], head
            )
    drafter_names: set[str] = set()
    if drafter is not None:
        d_head = drafter.get("head_dim") or (
            drafter["hidden_size"] // drafter["num_attention_heads"]
        )
        dtype = drafter_kv_cache_dtype(drafter_layer_cache_config)
        n = len(t["layer_types"])
        for i in range(drafter["num_hidden_layers"]):
            name = f"model.layers.{n + i}.self_attn.attn"
            drafter_names.add(name)
            specs[name] = _attention_spec(
                vllm_config, dtype, drafter["num_key_value_heads"], d_head
            )
    if drafter_kv_shared:
        from vllm_dflash.spec_decode.drafter_kv_group import merge_specs

        specs, _ = merge_specs(specs, drafter_names)
    return specs


def layout(vllm_config, specs: dict, available: int) -> dict:
    """vLLM's KV-cache groups, number of blocks and max concurrency."""
    from vllm.v1.core.kv_cache_utils import (
        get_kv_cache_config_from_groups,
        get_kv_cache_groups,
        get_max_concurrency_for_kv_cache_config,
    )

    groups = get_kv_cache_groups(vllm_config, dict(specs))
    cfg = get_kv_cache_config_from_groups(vllm_config, groups, available)
    return {
        "groups": groups,
        "num_blocks": cfg.num_blocks,
        "page": groups[0].kv_cache_spec.page_size_bytes,
        "block_size": vllm_config.cache_config.block_size,
        "max_concurrency": get_max_concurrency_for_kv_cache_config(vllm_config, cfg),
    }
