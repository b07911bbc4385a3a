# SPDX-License-Identifier: Apache-2.0
"""Install the #40898 drafter model class and proposer in vLLM."""

import inspect

from vllm_dflash.patches.registry import is_patched, replace_attr

PATCH = "dflash_sliding_window"
ARCH = "DFlashDraftModel"
MODEL_CLS = "vllm_dflash.model.drafter:DFlashDraftModel"
# Speculators-format drafters carry these at the top level; 0.20.x drops them.
WINDOW_FIELDS = (
    "layer_types",
    "use_sliding_window",
    "sliding_window",
    "max_window_layers",
)


def _keep_window_fields(stock):
    def update_dflash(config_dict: dict, pre_trained_config: dict) -> None:
        stock(config_dict=config_dict, pre_trained_config=pre_trained_config)
        for key in WINDOW_FIELDS:
            if key in config_dict and key not in pre_trained_config:
                pre_trained_config[key] = config_dict[key]

    update_dflash.__wrapped_original__ = stock
    return update_dflash


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

    from vllm.transformers_utils.configs.speculators import algos

    stock = algos.SUPPORTED_SPECULATORS_TYPES["dflash"]
    if not is_patched(stock, PATCH):
        wrapped = _keep_window_fields(stock)
        wrapped.__vllm_dflash_patch__ = PATCH
        algos.SUPPORTED_SPECULATORS_TYPES["dflash"] = wrapped
    replace_attr(gpu_model_runner, "DFlashProposer", DFlashSWAProposer, PATCH)
