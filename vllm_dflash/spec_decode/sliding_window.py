# SPDX-License-Identifier: Apache-2.0
"""Install the #40898 drafter model class and proposer in vLLM."""

from vllm_dflash.registry import (
    ALL_PLATFORMS,
    V020,
    Patch,
    PatchKind,
    code_reads,
    is_patched,
    replace_attr,
)

NAME = "dflash_sliding_window"
ARCH = "DFlashDraftModel"
MODEL_CLS = "vllm_dflash.models.dflash_drafter:DFlashDraftModel"
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
    """Does vLLM's own DFlash drafter read ``layer_types``? (0.20-0.23: no.)"""
    from vllm.model_executor.models import qwen3_dflash

    return not code_reads(qwen3_dflash, "layer_types")


def apply() -> None:
    from vllm import ModelRegistry
    from vllm.v1.worker import gpu_model_runner

    from vllm_dflash.spec_decode.dflash_proposer import DFlashSWAProposer

    if ARCH not in ModelRegistry.get_supported_archs():
        raise RuntimeError(f"vLLM has no {ARCH} architecture to replace")
    module, cls = MODEL_CLS.split(":")
    current = ModelRegistry.models[ARCH]
    if getattr(current, "module_name", None) != module:
        # Replacing vLLM's own entry is the point: drop it first so that
        # register_model does not warn "already registered" on every start.
        del ModelRegistry.models[ARCH]
        ModelRegistry.register_model(ARCH, MODEL_CLS)

    from vllm.transformers_utils.configs.speculators import algos

    stock = algos.SUPPORTED_SPECULATORS_TYPES["dflash"]
    if not is_patched(stock, NAME):
        wrapped = _keep_window_fields(stock)
        wrapped.__vllm_dflash_patch__ = NAME
        algos.SUPPORTED_SPECULATORS_TYPES["dflash"] = wrapped
    replace_attr(gpu_model_runner, "DFlashProposer", DFlashSWAProposer, NAME)


PATCH = Patch(
    name=NAME,
    kind=PatchKind.BACKPORT,
    targets=(
        "vllm.model_executor.models.registry:ModelRegistry.models.DFlashDraftModel",
        "vllm.v1.worker.gpu_model_runner:DFlashProposer",
        "vllm.transformers_utils.configs.speculators.algos:SUPPORTED_SPECULATORS_TYPES.dflash",
    ),
    summary=(
        "Drafter layer_types: sliding layers use window W with causal metadata and "
        "full-size KV (own metadata builder); full layers stay non-causal; fc "
        "input cast to fc dtype."
    ),
    why="Qwen3.5/3.6 DFlash drafters have sliding layers; 0.20.x ignores the window.",
    upstream="vllm-project/vllm#40898 (closed unmerged; V2-runner version in #47914)",
    versions=V020,
    platforms=ALL_PLATFORMS,
    probe=probe,
    apply=apply,
    future="Upstream to the V1 runner from patches/; drop when a release reads layer_types.",
)
