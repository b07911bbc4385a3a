# SPDX-License-Identifier: Apache-2.0
"""Backport of vLLM PR #40898: DFlash drafters with sliding-window layers.

Two patches, because two kinds of process need them: the drafter model class
and the proposer (``dflash_sliding_window``, in workers) and the
speculators-format config fields (``dflash_speculators_window_fields``, where
vLLM parses the drafter config: the API server or the ``LLM`` process).
"""

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
FIELDS_NAME = "dflash_speculators_window_fields"
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

    from vllm_dflash.models.registry import register_model
    from vllm_dflash.spec_decode.dflash_proposer import DFlashSWAProposer

    if ARCH not in ModelRegistry.get_supported_archs():
        raise RuntimeError(f"vLLM has no {ARCH} architecture to replace")
    register_model(ARCH, MODEL_CLS)

    replace_attr(gpu_model_runner, "DFlashProposer", DFlashSWAProposer, NAME)


def fields_probe() -> bool:
    """Does vLLM's speculators conversion drop ``layer_types``? (0.20-0.23: yes.)"""
    from vllm.transformers_utils.configs.speculators import algos

    converted: dict = {}
    stock = algos.SUPPORTED_SPECULATORS_TYPES["dflash"]
    stock = getattr(stock, "__wrapped_original__", stock)
    stock(
        config_dict={
            "aux_hidden_state_layer_ids": [1],
            "mask_token_id": 3,
            "layer_types": ["sliding_attention"],
            "sliding_window": 8,
            "transformer_layer_config": {"num_hidden_layers": 1},
        },
        pre_trained_config=converted,
    )
    return "layer_types" not in converted


def fields_apply() -> None:
    from vllm.transformers_utils.configs.speculators import algos

    stock = algos.SUPPORTED_SPECULATORS_TYPES["dflash"]
    if not is_patched(stock, FIELDS_NAME):
        wrapped = _keep_window_fields(stock)
        wrapped.__vllm_dflash_patch__ = FIELDS_NAME
        algos.SUPPORTED_SPECULATORS_TYPES["dflash"] = wrapped


PATCH = Patch(
    name=NAME,
    kind=PatchKind.BACKPORT,
    targets=(
        "vllm.v1.worker.gpu_model_runner:DFlashProposer",
        "vllm.model_executor.models.registry:ModelRegistry.models.DFlashDraftModel",
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


FIELDS_PATCH = Patch(
    name=FIELDS_NAME,
    kind=PatchKind.BACKPORT,
    targets=(
        "vllm.transformers_utils.configs.speculators.algos:SUPPORTED_SPECULATORS_TYPES.dflash",
    ),
    summary="Speculators-format DFlash configs keep layer_types, sliding_window, "
    "use_sliding_window and max_window_layers.",
    why="0.20.x drops them when converting: a sliding-window drafter would load as "
    "all full attention.",
    upstream="vllm-project/vllm#40898 (closed unmerged)",
    versions=V020,
    platforms=ALL_PLATFORMS,
    probe=fields_probe,
    apply=fields_apply,
    future="Upstream with #40898's V1 port.",
)
