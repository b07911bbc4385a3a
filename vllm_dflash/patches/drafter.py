# SPDX-License-Identifier: Apache-2.0
"""Install the #40898 drafter model class and proposer in vLLM."""

import inspect

from vllm_dflash.patches.registry import replace_attr

PATCH = "dflash_sliding_window"
ARCH = "DFlashDraftModel"
MODEL_CLS = "vllm_dflash.model.drafter:DFlashDraftModel"


def probe() -> bool:
    from vllm.model_executor.models import qwen3_dflash

    # Upstream support would have to read layer_types in the drafter model.
    return "layer_types" not in inspect.getsource(qwen3_dflash)


def apply() -> None:
    from vllm import ModelRegistry
    from vllm.v1.worker import gpu_model_runner

    from vllm_dflash.proposer import DFlashSWAProposer

    if ARCH not in ModelRegistry.get_supported_archs():
        raise RuntimeError(f"vLLM has no {ARCH} architecture to replace")
    ModelRegistry.register_model(ARCH, MODEL_CLS)
    replace_attr(gpu_model_runner, "DFlashProposer", DFlashSWAProposer, PATCH)
