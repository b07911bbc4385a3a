# SPDX-License-Identifier: Apache-2.0
"""Room in torch.compile's cache for DFlash's FLEX_ATTENTION variants (CUDA).

vLLM's FLEX_ATTENTION backend runs every attention forward through one compiled
function (``flex_attention_compiled = torch.compile(flex_attention,
fullgraph=True)``) and, on import, sets ``torch._dynamo.config.recompile_limit =
16``: at most 16 compiled variants of that one frame per process. Each mask
function (its code object), each constant of the call (the kernel options'
tiles, ``enable_gqa``) and each shape that is still static gives a variant of its
own, and with ``fullgraph=True`` the 17th is a hard failure
(``FailOnRecompileLimitHit``), not a fallback.

A DFlash engine on FLEX (float32 on CUDA, where FLASH_ATTN cannot run) puts three
kinds of layers through that frame: the target's attention layers, the drafter's
full-attention layers and the drafter's sliding-window layers (an ``and_mask``),
each with its own KV block layout, tiles and query lengths (decodes, verifies of
1 + k tokens, prefill chunks), each first compiled static and then dynamic.
Measured on an H100 (vLLM 0.20.1, float32, tiny hybrid pair with sliding-window
drafter layers, prompts of 640-729 tokens at batches 1/8/32; 2026-12-07, code
94ed3a5): the drafter's forward hit the limit in the third batch. With vLLM's
synchronous scheduler the engine died with ``FailOnRecompileLimitHit``; with its
asynchronous scheduler the failed drafting step left the next step's draft
placeholders (-1) in the input ids, and the target died with a device-side
assert in its embedding (docs/hybrid.md, "FLEX_ATTENTION's compile cache").

The patch raises the limit to ``RECOMPILE_LIMIT`` in the processes of DFlash
engines that build FLEX_ATTENTION metadata (when the first builder is made, before
any forward). Engines without DFlash, and other backends, keep vLLM's 16.
"""

from __future__ import annotations

from typing import Any

from vllm_dflash.logger import init_logger
from vllm_dflash.registry import Patch, PatchKind, is_patched, original, replace_attr
from vllm_dflash.spec_decode import uses_dflash

logger = init_logger(__name__)

PATCH_NAME = "dflash_flex_recompile_limit"
# Compiled variants of vLLM's flex_attention frame a DFlash engine may need.
RECOMPILE_LIMIT = 64


def _builder():
    from vllm.v1.attention.backends.flex_attention import (
        FlexAttentionMetadataBuilder,
    )

    return FlexAttentionMetadataBuilder


def raise_limit(vllm_config: Any) -> bool:
    """For a DFlash engine, raise dynamo's recompile limit to ``RECOMPILE_LIMIT``
    (never lower it). Returns whether it changed the limit."""
    import torch

    config = torch._dynamo.config
    if not uses_dflash(vllm_config) or config.recompile_limit >= RECOMPILE_LIMIT:
        return False
    logger.info(
        "vllm-dflash: FLEX_ATTENTION with DFlash: torch.compile recompile limit "
        "%d -> %d (target, drafter and sliding-window variants of one frame; %s).",
        config.recompile_limit,
        RECOMPILE_LIMIT,
        PATCH_NAME,
    )
    config.recompile_limit = RECOMPILE_LIMIT
    return True


def probe() -> bool:
    """vLLM's FLEX_ATTENTION still caps the compiled variants below what DFlash
    needs (the module sets the limit on import)."""
    try:
        _builder()
    except Exception as e:  # no FLEX_ATTENTION in this vLLM/torch build
        logger.debug("%s probe: FLEX_ATTENTION does not import: %s", PATCH_NAME, e)
        return False
    import torch

    # raised in this process already: by this patch (still needed) or by another
    return (
        is_patched(_builder().__init__, PATCH_NAME)
        or torch._dynamo.config.recompile_limit < RECOMPILE_LIMIT
    )


def apply() -> None:
    b = _builder()
    stock = original(b.__init__)

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        stock(self, kv_cache_spec, layer_names, vllm_config, device)
        raise_limit(vllm_config)

    replace_attr(b, "__init__", __init__, PATCH_NAME)


PATCH = Patch(
    name=PATCH_NAME,
    kind=PatchKind.FIX,
    targets=(
        "vllm.v1.attention.backends.flex_attention:FlexAttentionMetadataBuilder.__init__",
    ),
    summary=(
        f"DFlash engines on FLEX_ATTENTION: torch.compile recompile limit 16 -> "
        f"{RECOMPILE_LIMIT} (room for the drafter's mask variants)."
    ),
    why=(
        "vLLM compiles FLEX_ATTENTION with fullgraph=True and a recompile limit of 16 "
        "per process; the target's, the drafter's and its sliding-window layers' "
        "variants exceed it on long prompts and the drafter's forward fails "
        "(FailOnRecompileLimitHit; under async scheduling a device-side assert)."
    ),
    upstream="none (vLLM issue #27178: FLEX_ATTENTION hits recompile_limit)",
    versions=">=0.20.0,<0.24.0",
    platforms=("cuda",),
    probe=probe,
    apply=apply,
    future=(
        "Drop when vLLM's FLEX_ATTENTION compiles without per-variant recompiles or "
        "sets a limit that fits DFlash."
    ),
    probe_false_reason=(
        f"vLLM's recompile limit is already >= {RECOMPILE_LIMIT}, or this vLLM has "
        "no FLEX_ATTENTION"
    ),
)
