# SPDX-License-Identifier: Apache-2.0
"""FLEX_ATTENTION kernel tiles that Triton can compile for any KV block size (CUDA).

With torch >= 2.9 vLLM's FLEX_ATTENTION builds its block mask directly from the
block table ("direct build"): the block mask's KV block is the cache block size,
and ``get_kernel_options`` hands the same number to the Triton kernel as its KV
tile ``BLOCK_N``. The kernel does ``tl.arange(0, BLOCK_N)``, which Triton allows
for powers of two only. Hybrid targets (Qwen3.5/3.6: Gated-DeltaNet + attention)
get an attention block size aligned to the mamba state page, e.g. 304 tokens for
the tiny GPU hybrid and 480 for Qwen3.6-27B, so every FLEX forward fails to
compile: "arange's range must be a power of 2". Measured on an H200 (vLLM 0.20.1,
float32 DFlash on the tiny hybrid target: with DFlash vLLM asks for non-causal
attention on every layer, so the target's attention layers run FLEX too; block
304): the engine died at its first prefill.

The fix keeps the block mask as it is (KV blocks of ``block_size`` tokens) and
gives the kernel the largest power-of-two tile that divides it (304 -> 16, 480 ->
32): flex_attention walks each sparse KV block in ``SPARSE_KV_BLOCK_SIZE //
BLOCK_N`` tiles. Block sizes that are powers of two keep vLLM's options exactly.
"""

from __future__ import annotations

from typing import Any

from vllm_dflash.logger import init_logger
from vllm_dflash.registry import Patch, PatchKind, original, replace_attr

logger = init_logger(__name__)

PATCH_NAME = "dflash_flex_kernel_block_n"
# A hybrid target's attention block size on the H200 (tiny GPU hybrid fixture).
PROBE_BLOCK = 304


def _module():
    from vllm.v1.attention.backends import flex_attention

    return flex_attention


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def power_of_two_tile(n: int) -> int:
    """The largest power of two that divides ``n`` (``n`` itself if it is one)."""
    return n & -n


def compilable(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with every tile that is not a power of two replaced by the
    largest power of two dividing it."""
    out = dict(options)
    for key in ("BLOCK_M", "BLOCK_N"):
        tile = out.get(key)
        is_tile = isinstance(tile, int) and not isinstance(tile, bool)
        if is_tile and not is_power_of_two(tile):
            out[key] = power_of_two_tile(tile)
    return out


def _stock_options(block_n: int) -> dict[str, Any]:
    import torch

    stock = original(_module().get_kernel_options)
    query = torch.zeros(1, 1, 1, 8, dtype=torch.float32)
    return stock(query, 16, block_n, True)


def probe() -> bool:
    """vLLM's direct-build kernel options pass a non-power-of-two KV block to the
    kernel as its tile (BLOCK_N)."""
    try:
        m = _module()
    except Exception as e:  # no FLEX_ATTENTION in this vLLM/torch build
        logger.debug("%s probe: FLEX_ATTENTION does not import: %s", PATCH_NAME, e)
        return False
    if not hasattr(m, "get_kernel_options"):
        return False
    tile = _stock_options(PROBE_BLOCK).get("BLOCK_N")
    return isinstance(tile, int) and not is_power_of_two(tile)


def apply() -> None:
    m = _module()
    stock = original(m.get_kernel_options)

    def get_kernel_options(query, block_m, block_n, use_direct_build):
        return compilable(stock(query, block_m, block_n, use_direct_build))

    replace_attr(m, "get_kernel_options", get_kernel_options, PATCH_NAME)


PATCH = Patch(
    name=PATCH_NAME,
    kind=PatchKind.FIX,
    targets=("vllm.v1.attention.backends.flex_attention:get_kernel_options",),
    summary=(
        "FLEX_ATTENTION's Triton tiles are powers of two dividing the KV block (304 "
        "-> 16), so blocks sized for hybrid targets compile."
    ),
    why=(
        "Direct-build FLEX hands the cache block size to the kernel as BLOCK_N; a "
        "hybrid target's block (304, 480: aligned to the mamba page) is no power of "
        "two and every FLEX forward fails: 'arange's range must be a power of 2'. "
        "fp32 DFlash on hybrid targets runs FLEX on every attention layer."
    ),
    upstream="none (vLLM FLEX_ATTENTION direct build with non-power-of-two blocks)",
    versions=">=0.20.0,<0.24.0",
    platforms=("cuda",),
    probe=probe,
    apply=apply,
    future="Propose upstream; drop when get_kernel_options picks compilable tiles.",
    probe_false_reason=(
        "FLEX_ATTENTION's kernel options are already powers of two, or this vLLM "
        "has no FLEX_ATTENTION"
    ),
)
