# SPDX-License-Identifier: Apache-2.0
"""FLEX_ATTENTION reads the hybrid (attention + mamba/GDN) KV-cache layout (CUDA).

In a model with attention and mamba layers (Qwen3.5/3.6: GDN + gated attention),
``GPUModelRunner._update_hybrid_attention_mamba_layout`` re-strides every attention
layer whose backend's cache shape is ``(2, num_blocks, block_size, heads, dim)`` so
that K and V of one block are adjacent: the memory becomes
``(num_blocks, 2, block_size, heads, dim)`` (one page per block, as the mamba state
pages). FLASH_ATTN and TRITON_ATTN read that through the strides; FLEX_ATTENTION's
``forward`` does ``key_cache.view(-1, heads, dim)``, which fails ("view size is not
compatible with input tensor's size and stride"). fp32 DFlash on a hybrid target
needs FLEX (the only CUDA backend with non-causal attention and fp32) for the drafter:
it dies at the drafter's first forward.

The fix reads the interleaved cache without copying it. Seen as rows of
``(heads, dim)``, the cache is ``2 * num_blocks * block_size`` rows: K of block ``p``
at rows ``2p*bs ...`` and V of block ``p`` at ``(2p+1)*bs ...``. So
``key = rows[: (2N-1)*bs]`` and ``value = rows[bs:]`` (two views, one tensor
``(2, (2N-1)*bs, heads, dim)``) hold K(p, t) and V(p, t) at the same row
``2p*bs + t``. The metadata builder, for a group whose cache is interleaved, builds
with a doubled block table (``2 * block_table``) and ``2N - 1`` cache blocks: the
odd (V) "blocks" map to no logical block, so the mask never lets them through and
the block-sparse kernel never loads them. Everything stays in ``build()`` (outside
CUDA graphs); ``forward`` adds only two views.

The builder finds the layout where the runner put it: the layer's bound KV cache
(``compilation_config.static_forward_context[layer].kv_cache``), checked by its
strides at each build; ``forward`` checks the metadata and the cache agree.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import torch

from vllm_dflash.logger import init_logger
from vllm_dflash.registry import Patch, PatchKind, original, replace_attr

logger = init_logger(__name__)

PATCH_NAME = "dflash_flex_hybrid_kv_layout"
# Set on the FlexAttentionMetadata of a group whose KV cache is interleaved.
INTERLEAVED_ATTR = "vllm_dflash_kv_interleaved"


def _module():
    from vllm.v1.attention.backends import flex_attention

    return flex_attention


# --- the layout --------------------------------------------------------------


def is_interleaved(kv_cache: Any) -> bool:
    """Whether ``kv_cache`` (2, N, bs, h, d) has the hybrid layout: K and V of a
    block adjacent, i.e. the memory is (N, 2, bs, h, d) contiguous."""
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() != 5:
        return False
    if kv_cache.shape[0] != 2:
        return False
    _, _, bs, h, d = kv_cache.shape
    hidden = bs * h * d
    return kv_cache.stride() == (hidden, 2 * hidden, h * d, d, 1)


def paired_rows(kv_cache: torch.Tensor) -> torch.Tensor:
    """The interleaved cache as (2, (2N-1)*bs, h, d): [0] K, [1] V, both with
    block ``p`` at rows ``2p*bs ...`` (a view, no copy)."""
    _, n, bs, h, d = kv_cache.shape
    return torch.as_strided(
        kv_cache,
        size=(2, (2 * n - 1) * bs, h, d),
        stride=(bs * h * d, h * d, d, 1),
        storage_offset=kv_cache.storage_offset(),
    )


class LayoutFinder:
    """The KV cache the runner bound to a builder's layers."""

    def __init__(self, builder: Any) -> None:
        self.builder = builder

    def kv_cache(self) -> torch.Tensor | None:
        cc = getattr(self.builder.vllm_config, "compilation_config", None)
        layers = getattr(cc, "static_forward_context", None) or {}
        for name in self.builder.layer_names:
            kv = getattr(layers.get(name), "kv_cache", None)
            if isinstance(kv, (list, tuple)):  # per virtual engine (older vLLM)
                kv = kv[0] if kv else None
            if isinstance(kv, torch.Tensor) and kv.dim() == 5:
                return kv
        return None

    def interleaved_blocks(self) -> int | None:
        """N when the builder's cache is interleaved, else None."""
        kv = self.kv_cache()
        return kv.shape[1] if kv is not None and is_interleaved(kv) else None


class _CacheConfigView:
    """The builder's cache_config as the stock build must see it for an
    interleaved cache: ``2N - 1`` blocks of the doubled block table."""

    def __init__(self, cache_config: Any, num_blocks: int) -> None:
        self._cache_config = cache_config
        self.num_gpu_blocks = num_blocks

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache_config, name)


class DoubledBlockTable:
    """2 * block_table in a persistent buffer of the builder (stable address)."""

    ATTR = "_vllm_dflash_doubled_block_table"

    def __init__(self, builder: Any) -> None:
        self.builder = builder

    def __call__(self, block_table: torch.Tensor) -> torch.Tensor:
        buf = getattr(self.builder, self.ATTR, None)
        if buf is None or buf.numel() < block_table.numel():
            max_seqs = self.builder.vllm_config.scheduler_config.max_num_seqs
            rows = max(max_seqs, block_table.shape[0])
            buf = torch.empty(
                rows * block_table.shape[1],
                dtype=block_table.dtype,
                device=block_table.device,
            )
            setattr(self.builder, self.ATTR, buf)
        out = buf[: block_table.numel()].view(block_table.shape)
        return torch.mul(block_table, 2, out=out)


def build_interleaved(stock, builder, common_prefix_len, cad, fast_build, n: int):
    """The stock build over the doubled block table and 2N-1 cache blocks."""
    total = 2 * n - 1
    p2l = builder.persistent_physical_to_logical
    if p2l is not None and p2l.shape[-1] != total:
        builder.persistent_physical_to_logical = None  # sized for another layout
    doubled = DoubledBlockTable(builder)(cad.block_table_tensor)
    cad = replace(cad, block_table_tensor=doubled)
    real = builder.cache_config
    builder.cache_config = _CacheConfigView(real, total)
    try:
        out = stock(builder, common_prefix_len, cad, fast_build)
    finally:
        builder.cache_config = real
    if out.num_blocks != total or out.physical_to_logical.shape[-1] != total:
        raise RuntimeError(
            f"{PATCH_NAME}: FLEX_ATTENTION's build no longer sizes its block map by "
            f"cache_config.num_gpu_blocks ({out.num_blocks} blocks, want {total})"
        )
    setattr(out, INTERLEAVED_ATTR, True)
    return out


# --- probe and apply ---------------------------------------------------------


class _ReachedKernel(Exception):
    """The stock forward got past reading the KV cache."""


class _BlockMaskStandIn:
    @property
    def BLOCK_SIZE(self):  # noqa: N802 - BlockMask's attribute
        raise _ReachedKernel


def _stock_forward_reads(kv_cache: torch.Tensor) -> bool:
    """Run the unpatched FlexAttentionImpl.forward on ``kv_cache`` up to the
    kernel: True if it reads the cache, False if that raises RuntimeError."""
    m = _module()
    _, _, _, h, d = kv_cache.shape
    impl = m.FlexAttentionImpl(h, d, d**-0.5, h, None, None, "auto")
    meta = SimpleNamespace(
        num_actual_tokens=1, sliding_window=None, mm_prefix_range=None,
        logical_mask_mod=None, block_sparsity_hint=None, direct_build=True,
        block_mask=_BlockMaskStandIn(),
    )  # fmt: skip
    query = torch.zeros(1, h, d, dtype=kv_cache.dtype)
    forward = original(m.FlexAttentionImpl.forward)
    try:
        forward(impl, SimpleNamespace(), query, None, None, kv_cache, meta,
                torch.empty_like(query))  # fmt: skip
    except _ReachedKernel:
        return True
    except RuntimeError as e:
        logger.debug("%s probe: stock FLEX forward: %s", PATCH_NAME, e)
        return False
    raise RuntimeError("FLEX_ATTENTION forward ran past the stand-in block mask")


def probe() -> bool:
    """The stock FLEX forward cannot read an interleaved (hybrid) KV cache."""
    try:
        _module()
    except Exception as e:  # no FLEX_ATTENTION in this vLLM/torch build
        logger.debug("%s probe: FLEX_ATTENTION does not import: %s", PATCH_NAME, e)
        return False
    n, bs, h, d = 3, 2, 1, 2
    interleaved = torch.zeros(n, 2, bs, h, d).transpose(0, 1)
    assert is_interleaved(interleaved)
    if not _stock_forward_reads(interleaved.contiguous()):
        raise RuntimeError("the stock FLEX forward fails on a contiguous cache")
    return not _stock_forward_reads(interleaved)


def apply() -> None:
    m = _module()
    stock_build = original(m.FlexAttentionMetadataBuilder.build)
    stock_forward = original(m.FlexAttentionImpl.forward)

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        n = LayoutFinder(self).interleaved_blocks()
        if n is None:
            return stock_build(
                self, common_prefix_len, common_attn_metadata, fast_build
            )
        return build_interleaved(
            stock_build, self, common_prefix_len, common_attn_metadata, fast_build, n
        )

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, *a, **kw):
        if attn_metadata is not None and self.attn_type == m.AttentionType.DECODER:
            flagged = getattr(attn_metadata, INTERLEAVED_ATTR, False)
            if is_interleaved(kv_cache) != flagged:
                raise RuntimeError(
                    f"{PATCH_NAME}: FLEX_ATTENTION metadata built for "
                    f"{'an interleaved' if flagged else 'a contiguous'} KV cache, "
                    f"layer {getattr(layer, 'layer_name', '?')} has "
                    f"{'a contiguous' if flagged else 'an interleaved'} one"
                )
            if flagged:
                kv_cache = paired_rows(kv_cache)
        return stock_forward(
            self, layer, query, key, value, kv_cache, attn_metadata, *a, **kw
        )

    replace_attr(m.FlexAttentionMetadataBuilder, "build", build, PATCH_NAME)
    replace_attr(m.FlexAttentionImpl, "forward", forward, PATCH_NAME)


PATCH = Patch(
    name=PATCH_NAME,
    kind=PatchKind.FIX,
    targets=(
        "vllm.v1.attention.backends.flex_attention:FlexAttentionMetadataBuilder.build",
        "vllm.v1.attention.backends.flex_attention:FlexAttentionImpl.forward",
    ),
    summary=(
        "FLEX_ATTENTION reads the hybrid (attention + mamba) KV-cache layout, K/V "
        "interleaved per block, through views (no copy): doubled block table, "
        "2N-1 cache blocks, odd ones masked."
    ),
    why=(
        "In hybrid models (Qwen3.5/3.6 GDN targets) the runner interleaves K/V per "
        "block; FLEX's forward views the cache as contiguous and raises 'view size "
        "is not compatible'. fp32 DFlash drafters on such targets run on FLEX and "
        "die at the first draft."
    ),
    upstream="none (vLLM FLEX_ATTENTION + hybrid KV layout; patches/v0.20.1/0011)",
    versions=">=0.20.0,<0.24.0",
    platforms=("cuda",),
    probe=probe,
    apply=apply,
    future="Propose patches/v0.20.1/0011 upstream; drop when FLEX reads the layout.",
    probe_false_reason=(
        "FLEX_ATTENTION reads an interleaved (hybrid) KV cache, or this vLLM has none"
    ),
)
