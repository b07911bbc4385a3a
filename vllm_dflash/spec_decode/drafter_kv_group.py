# SPDX-License-Identifier: Apache-2.0
"""The DFlash drafter's KV cache in the target's attention KV-cache group.

vLLM groups a hybrid model's layers by KV-cache spec and gives every group the
same number of layers (the smallest type's count), padding the others. The
Qwen3.6-27B-shaped pair has three types: 16 target attention layers (4 KV heads
of 256), 48 Gated-DeltaNet layers and the drafter's 5 attention layers (8 KV heads
of 128). The drafter's 5 make the group size 5: the target's 16 attention layers
take 4 groups (20 slots, 4 of them padding: vLLM warns "may waste at most 25.00%
KV cache memory") and every request pays for 5 drafter slots per block as well.

The drafter's KV bytes per token are the same as a target attention layer's (8 x
128 = 4 x 256), and so is everything else in the spec. This patch gives the
drafter layers the target's spec, so vLLM puts them in the target's type: one
group of 21 attention layers, no attention padding. A drafter layer's cache is a
block of the same bytes; after vLLM shapes it as the target's (4 heads of 256),
the patch re-views each block as the drafter's own (8 heads of 128) in the
layout its attention backend uses, and the drafter's own metadata builders get
its own head count and size. Only the drafter reads and writes its layers'
blocks, so any fixed layout of a block's bytes is exact.

Only in DFlash engines, only when the specs differ in nothing but the head count
and size at equal bytes per token, and not next to vLLM's speculative GDN state
copies (``merge_specs``). With
``dflash_gdn_state_replay`` the 27B-shaped pair holds 11% more 8k requests.

Not for vLLM's CUDA-graph memory estimate: ``profile_cudagraph_memory`` builds a
temporary KV cache of ``max_cudagraph_capture_size`` blocks *per layer slot of a
group* (``_init_minimal_kv_cache_for_profiling``), so a 21-layer group makes it
21 x 512 blocks of 2.1 MiB on the 27B-shaped pair (22.9 GiB, beside 53.5 GiB of
weights: out of memory on an 80 GB GPU, 2026-12-06). That cache is built with
vLLM's own grouping (5 layers a group there); the real cache is merged.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from vllm_dflash.logger import init_logger
from vllm_dflash.registry import V020_ONLY, Patch, PatchError, PatchKind, replace_attr
from vllm_dflash.spec_decode import uses_dflash

logger = init_logger(__name__)

NAME = "dflash_drafter_kv_shared_group"
TRUE_SHAPES_ATTR = "_vllm_dflash_drafter_kv_true_shapes"
PROFILING_ATTR = "_vllm_dflash_profiling_kv_cache"  # set while vLLM sizes graphs
_PROBE_BLOCKS, _PROBE_BLOCK_SIZE = 3, 16


def merge_specs(
    specs: dict[str, Any], drafter_layers: set[str]
) -> tuple[dict[str, Any], dict[str, tuple[int, int]]]:
    """(specs with mergeable drafter layers given the target's attention spec,
    {drafter layer: its own (num_kv_heads, head_size)})."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    if any(
        isinstance(spec, MambaSpec) and spec.num_speculative_blocks
        for spec in specs.values()
    ):
        # vLLM's 1 + k GDN state copies per request (dflash_gdn_state_replay
        # off): a larger group would multiply them (27B pair: 24.3 vs 26.9
        # requests of 8k), so the drafter keeps its own group
        return specs, {}
    target = {
        spec
        for name, spec in specs.items()
        if name not in drafter_layers and type(spec) is FullAttentionSpec
    }
    if len(target) != 1:
        return specs, {}
    (t,) = target
    out, true = dict(specs), {}
    for name in sorted(drafter_layers & specs.keys()):
        d = specs[name]
        if d == t or type(d) is not type(t) or d.head_size_v != d.head_size:
            continue
        as_target = dataclasses.replace(
            d,
            num_kv_heads=t.num_kv_heads,
            head_size=t.head_size,
            head_size_v=t.head_size_v,
        )
        if as_target != t or d.page_size_bytes != t.page_size_bytes:
            continue
        out[name] = t
        true[name] = (d.num_kv_heads, d.head_size)
    return out, true


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= size
    return tuple(reversed(strides))


def reshape_for_layer(
    cache: torch.Tensor, backend: Any, merged: tuple[int, int], own: tuple[int, int]
) -> torch.Tensor:
    """``cache`` (shaped by ``backend`` for ``merged`` heads/size) viewed with the
    layer's ``own`` heads/size: the dims from the first head/size dim on are
    re-laid out contiguously over the same bytes (the dims before keep their
    strides: K/V, block, and for token-major layouts the token)."""
    probe_m = backend.get_kv_cache_shape(_PROBE_BLOCKS, _PROBE_BLOCK_SIZE, *merged)
    probe_o = backend.get_kv_cache_shape(_PROBE_BLOCKS, _PROBE_BLOCK_SIZE, *own)
    if len(probe_m) != cache.dim() or len(probe_o) != cache.dim():
        raise PatchError(
            f"{NAME}: {backend.get_name()} KV cache shape {tuple(cache.shape)} does "
            f"not match its get_kv_cache_shape {probe_m}"
        )
    differ = [
        i for i, (a, b) in enumerate(zip(probe_m, probe_o, strict=True)) if a != b
    ]
    if not differ:
        return cache
    first = differ[0]
    shape = list(cache.shape)
    for i in differ:
        shape[i] = probe_o[i]
    inner = cache.shape[first:]
    if cache.stride()[first:] != contiguous_strides(tuple(inner)):
        raise PatchError(
            f"{NAME}: {backend.get_name()} KV cache block is not contiguous from "
            f"dim {first} (strides {cache.stride()}); disable the patch with "
            f"VLLM_DFLASH_DISABLE={NAME}"
        )
    if math.prod(shape[first:]) != math.prod(inner):
        raise PatchError(f"{NAME}: {shape} and {tuple(cache.shape)} differ in size")
    return cache.as_strided(
        tuple(shape),
        cache.stride()[:first] + contiguous_strides(tuple(shape[first:])),
        cache.storage_offset(),
    )


def _applies(runner: Any) -> bool:
    drafter = getattr(runner, "drafter", None)
    return uses_dflash(runner) and bool(
        getattr(drafter, "_draft_attn_layer_names", None)
    )


def probe() -> bool:
    """vLLM groups layers by spec equality (equal bytes, other heads = other
    type) and does not merge the DFlash drafter's layers itself (the function
    ``patches/v0.20.1/0018`` adds)."""
    import vllm.v1.worker.utils as worker_utils
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    if hasattr(worker_utils, "share_drafter_kv_cache_group"):
        return False

    a = FullAttentionSpec(
        block_size=16, num_kv_heads=4, head_size=256, dtype=torch.bfloat16
    )
    b = FullAttentionSpec(
        block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16
    )
    return a.page_size_bytes == b.page_size_bytes and a != b


def own_spec(group_spec: Any, layer_spec: Any) -> Any:
    """The group's spec with the layer's own head count/size (for its metadata
    builders and its cache view), or None if the layer's spec is the group's."""
    if layer_spec is None or (layer_spec.num_kv_heads, layer_spec.head_size) == (
        group_spec.num_kv_heads,
        group_spec.head_size,
    ):
        return None
    return dataclasses.replace(
        group_spec,
        num_kv_heads=layer_spec.num_kv_heads,
        head_size=layer_spec.head_size,
        head_size_v=layer_spec.head_size_v,
    )


def runner_specs(runner: Any, specs: dict[str, Any]) -> dict[str, Any]:
    """The runner's KV specs with the drafter's layers merged where they can be,
    except for vLLM's CUDA-graph profiling cache (``profiling_cache``)."""
    if not _applies(runner):
        return specs
    if getattr(runner, PROFILING_ATTR, False):
        setattr(runner, TRUE_SHAPES_ATTR, {})
        return specs
    merged, true = merge_specs(specs, set(runner.drafter._draft_attn_layer_names))
    if true:
        first = next(iter(true))
        logger.info(
            "DFlash drafter KV in the target's attention KV-cache group: %d "
            "drafter layers (%d KV heads of %d) take the target's spec (%d of %d; "
            "same bytes per token)",
            len(true), *true[first], merged[first].num_kv_heads,
            merged[first].head_size,
        )  # fmt: skip
    setattr(runner, TRUE_SHAPES_ATTR, true)
    return merged


def profiling_cache(runner: Any, stock: Any) -> Any:
    """vLLM's ``_init_minimal_kv_cache_for_profiling`` with vLLM's own grouping
    (its cache has a fixed block count per layer slot of a group)."""
    if not _applies(runner):
        return stock(runner)
    # the engine asked for the (merged) specs before profiling and does not ask
    # again: the real cache's re-view needs the drafter shapes found then
    true = getattr(runner, TRUE_SHAPES_ATTR, None)
    setattr(runner, PROFILING_ATTR, True)
    try:
        return stock(runner)
    finally:
        setattr(runner, PROFILING_ATTR, False)
        if true is not None:
            setattr(runner, TRUE_SHAPES_ATTR, true)


def apply() -> None:
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    stock_spec = GPUModelRunner.get_kv_cache_spec
    stock_reshape = GPUModelRunner._reshape_kv_cache_tensors
    stock_draft_backend = SpecDecodeBaseProposer.initialize_attn_backend
    stock_profiling_cache = GPUModelRunner._init_minimal_kv_cache_for_profiling

    def get_kv_cache_spec(self):
        return runner_specs(self, stock_spec(self))

    def _reshape_kv_cache_tensors(self, kv_cache_raw_tensors, kernel_block_sizes):
        caches = stock_reshape(self, kv_cache_raw_tensors, kernel_block_sizes)
        true = getattr(self, TRUE_SHAPES_ATTR, None)
        if not true:
            return caches
        for groups in self.attn_groups:
            for group in groups:
                spec = group.kv_cache_spec
                for name in group.layer_names:
                    if name in true and name in caches:
                        caches[name] = reshape_for_layer(
                            caches[name],
                            group.backend,
                            (spec.num_kv_heads, spec.head_size),
                            true[name],
                        )
        return caches

    def initialize_attn_backend(self, kv_cache_config, kernel_block_sizes=None):
        stock_draft_backend(self, kv_cache_config, kernel_block_sizes)
        if getattr(self.vllm_config.speculative_config, "method", None) != "dflash":
            return
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

        layers = get_layers_from_vllm_config(self.vllm_config, AttentionLayerBase)
        kernel = (
            kernel_block_sizes[self.kv_cache_gid]
            if kernel_block_sizes is not None
            and 0 <= self.kv_cache_gid < len(kernel_block_sizes)
            else None
        )
        for group in self.draft_attn_groups:
            spec = own_spec(
                group.kv_cache_spec,
                layers[group.layer_names[0]].get_kv_cache_spec(self.vllm_config),
            )
            if spec is not None:  # builders see the drafter's own heads
                group.kv_cache_spec = spec
                group.create_metadata_builders(
                    self.vllm_config, self.device, kernel_block_size=kernel
                )

    def _init_minimal_kv_cache_for_profiling(self):
        return profiling_cache(self, stock_profiling_cache)

    replace_attr(GPUModelRunner, "get_kv_cache_spec", get_kv_cache_spec, NAME)
    replace_attr(
        GPUModelRunner,
        "_init_minimal_kv_cache_for_profiling",
        _init_minimal_kv_cache_for_profiling,
        NAME,
    )
    replace_attr(
        GPUModelRunner, "_reshape_kv_cache_tensors", _reshape_kv_cache_tensors, NAME
    )
    replace_attr(
        SpecDecodeBaseProposer,
        "initialize_attn_backend",
        initialize_attn_backend,
        NAME,
    )


PATCH = Patch(
    name=NAME,
    kind=PatchKind.FEATURE,
    targets=(
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner.get_kv_cache_spec",
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner._reshape_kv_cache_tensors",
        "vllm.v1.worker.gpu_model_runner:"
        "GPUModelRunner._init_minimal_kv_cache_for_profiling",
        "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer"
        ".initialize_attn_backend",
    ),
    summary=(
        "DFlash: drafter layers whose KV differs from the target's attention only in "
        "head count/size (same bytes per token) join the target's KV-cache group; "
        "their blocks are re-viewed with the drafter's own heads."
    ),
    why=(
        "A separate drafter group sets vLLM's hybrid group size to the drafter's "
        "layer count: on Qwen3.6-27B 4 padding layers (25% of attention KV) and "
        "fewer concurrent requests."
    ),
    upstream=(
        "none (vLLM groups layers by exact spec equality); our diff: "
        "patches/v0.20.1/0018-drafter-kv-shared-group.diff"
    ),
    versions=V020_ONLY,
    platforms=("cuda", "cpu"),
    probe=probe,
    apply=apply,
    future="Propose upstream: group attention specs by page layout, not head shape.",
    probe_false_reason=(
        "vLLM already groups specs of equal bytes per token, or merges the drafter's "
        "layers itself"
    ),
)
