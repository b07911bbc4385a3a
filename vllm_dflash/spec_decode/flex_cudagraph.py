# SPDX-License-Identifier: Apache-2.0
"""No FULL CUDA graphs for DFlash verification batches on FLEX_ATTENTION (CUDA).

Measured on the H200 (vLLM 0.20.1, float32, where vLLM picks FLEX_ATTENTION;
H200, 2026-12-01, 1e82751): DFlash with CUDA graphs dies with
``CUDA error: an illegal memory access`` inside the replay of the target's FULL
decode graph (``CUDA_LAUNCH_BLOCKING=1``: ``gpu_model_runner._model_forward`` ->
``cuda_graph.py`` replay) at the first verification batches, greedy and sampled
alike. Eager runs, ``cudagraph_mode=PIECEWISE`` and no-speculation FULL graphs
(one-token decode batches) do not crash. FLEX_ATTENTION's metadata builder claims
``AttentionCGSupport.ALWAYS``, so vLLM captures FULL graphs for the uniform
(1 + k)-token verification batches; with DFlash's drafter builders in the same
process these replays read out of bounds.

The patch reports FLEX_ATTENTION's support as ``UNIFORM_SINGLE_TOKEN_DECODE`` when the
speculative method is DFlash: vLLM's own resolution
(``CompilationConfig.resolve_cudagraph_mode_and_sizes``) then chooses PIECEWISE
graphs for the verification batches (its "not supported with spec-decode" branch),
which is the configuration that runs. bf16 (FLASH_ATTN) is untouched.
"""

from __future__ import annotations

from vllm_dflash.logger import init_logger
from vllm_dflash.registry import Patch, PatchKind, replace_attr
from vllm_dflash.spec_decode import uses_dflash

logger = init_logger(__name__)

PATCH_NAME = "dflash_flex_full_cudagraph"


def _builder():
    from vllm.v1.attention.backends.flex_attention import (
        FlexAttentionMetadataBuilder,
    )

    return FlexAttentionMetadataBuilder


def _stock_fn():
    """The unpatched ``get_cudagraph_support`` function (of the builder or a base)."""
    b = _builder()
    ours = getattr(b.__dict__.get("get_cudagraph_support"), "__func__", None)
    stock = getattr(ours, "_vllm_dflash_stock", None)
    return stock or b.get_cudagraph_support.__func__


def _stock_support(vllm_config=None, kv_cache_spec=None):
    return _stock_fn()(_builder(), vllm_config, kv_cache_spec)


def probe() -> bool:
    """FLEX_ATTENTION still asks for FULL graphs of spec-decode (uniform) batches."""
    from vllm.v1.attention.backend import AttentionCGSupport

    return _stock_support().value >= AttentionCGSupport.UNIFORM_BATCH.value


def apply() -> None:
    from vllm.v1.attention.backend import AttentionCGSupport

    b = _builder()
    cap = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    stock = _stock_fn()

    def get_cudagraph_support(cls, vllm_config, kv_cache_spec):
        support = stock(cls, vllm_config, kv_cache_spec)
        if uses_dflash(vllm_config) and support.value > cap.value:
            logger.info(
                "vllm-dflash: FLEX_ATTENTION with DFlash: no FULL CUDA graphs for "
                "verification batches (illegal memory access on replay); "
                "PIECEWISE is used for them (%s).",
                PATCH_NAME,
            )
            return cap
        return support

    get_cudagraph_support._vllm_dflash_stock = stock
    replace_attr(
        b, "get_cudagraph_support", classmethod(get_cudagraph_support), PATCH_NAME
    )


PATCH = Patch(
    name=PATCH_NAME,
    kind=PatchKind.FIX,
    targets=(
        "vllm.v1.attention.backends.flex_attention:"
        "FlexAttentionMetadataBuilder.get_cudagraph_support",
    ),
    summary="DFlash on FLEX_ATTENTION: PIECEWISE (not FULL) CUDA graphs for verification batches.",
    why=(
        "fp32 DFlash (vLLM picks FLEX_ATTENTION) with CUDA graphs dies with an illegal "
        "memory access replaying the target's FULL graph of a verification batch."
    ),
    upstream="none (vLLM FLEX_ATTENTION FULL-graph defect with spec decode)",
    versions=">=0.20.0,<0.24.0",
    platforms=("cuda",),
    probe=probe,
    apply=apply,
    future="Report upstream with the reproduction; drop when FLEX FULL graphs replay safely.",
    probe_false_reason="FLEX_ATTENTION does not claim FULL graphs for spec-decode batches",
)
