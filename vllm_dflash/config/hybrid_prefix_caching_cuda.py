# SPDX-License-Identifier: Apache-2.0
"""Refuse DFlash + prefix caching on a hybrid target in 16-bit on CUDA.

Measured 2026-12-05 on one H100 (vLLM 0.20.1, the Qwen3.6-27B-shaped pair,
bfloat16, CUDA graphs, dummy weights): the engine died at start-up with "an
illegal memory access" in FlashAttention's forward
(``hopper/flash_fwd_launch_template.h``) while vLLM profiled CUDA-graph memory.
Prefix caching puts the hybrid target in mamba cache mode 'align' (attention
block size 480 on that pair, vLLM's speculative GDN state copies, the drafter's
KV in its own group); the same engine without prefix caching starts and runs.
The tiny hybrid pair in float32 (FlexAttention) is lossless with prefix caching
on the H200, and every CPU test is.

Located on 2026-12-06 (H100, ``CUDA_LAUNCH_BLOCKING=1``): vLLM's speculative GDN
kernel in the eager warm-up before the first FULL CUDA graph capture, reading state
column ``0 - 1`` because ``dflash_gdn_zero_draft_decodes`` made that warm-up batch
speculative with the runner's zero accepted counts; that patch now raises them to
1 (``tests/unit/test_gdn_spec_slots.py``). Until an engine has started and run
lossless on a GPU with the fix, the 16-bit CUDA combination stays refused before
any weights load, in one line naming what works. ``VLLM_DFLASH_DISABLE=dflash_hybrid_prefix_caching_cuda_refusal``
lifts the refusal (to reproduce or investigate the crash).
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_dflash.config.layer_types import DrafterConfigError
from vllm_dflash.envs import disabled_patches

NAME = "dflash_hybrid_prefix_caching_cuda_refusal"


class HybridPrefixCachingCudaError(DrafterConfigError):
    """DFlash + prefix caching on a hybrid target, 16-bit, CUDA (a one-line
    ``vllm serve: error:``, exit status 2, like the drafter-config refusals)."""


def _on_cuda() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cuda()


def check(vllm_config: Any) -> None:
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    if not (cache.enable_prefix_caching and getattr(model, "is_hybrid", False)):
        return
    if model.dtype == torch.float32 or NAME in disabled_patches() or not _on_cuda():
        return
    dtype = str(model.dtype).removeprefix("torch.")
    raise HybridPrefixCachingCudaError(
        f"DFlash with prefix caching on a hybrid (mamba/Gated-DeltaNet) target in "
        f"{dtype} on CUDA is refused: the engine crashed at start-up (illegal "
        "memory access, 2026-12-05); its fix is not yet verified on a GPU. Run "
        "with --no-enable-prefix-caching, or --dtype float32 (verified lossless)."
    )
