# SPDX-License-Identifier: Apache-2.0
"""Unit-level checks of the two backports (the e2e tests prove them end to end)."""

from __future__ import annotations

from types import SimpleNamespace

from vllm_dflash.spec_decode import aux_layers
from vllm_dflash.spec_decode import sliding_window as drafter


def _speculators_dict() -> dict:
    return {
        "speculators_model_type": "dflash",
        "aux_hidden_state_layer_ids": [1, 16, 31, 46, 61],
        "mask_token_id": 248070,
        "layer_types": ["sliding_attention"] * 4 + ["full_attention"],
        "use_sliding_window": True,
        "sliding_window": 2048,
        "max_window_layers": 5,
        "transformer_layer_config": {"num_hidden_layers": 5, "hidden_size": 64},
    }


def test_speculators_conversion_keeps_window_fields(isolated):
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    isolated(drafter.FIELDS_PATCH)
    assert drafter.fields_probe() is True  # 0.20-0.23 drop the fields
    drafter.fields_apply()
    cfg = SpeculatorsConfig.extract_transformers_pre_trained_config(_speculators_dict())
    assert cfg["layer_types"] == ["sliding_attention"] * 4 + ["full_attention"]
    assert cfg["sliding_window"] == 2048 and cfg["use_sliding_window"] is True
    assert cfg["max_window_layers"] == 5
    assert cfg["dflash_config"]["target_layer_ids"] == [1, 16, 31, 46, 61]


def test_speculators_layer_ids_are_shifted_once(isolated):
    """Speculators configs land in eagle_aux_hidden_state_layer_ids: also shifted."""
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    isolated(aux_layers.PATCH)
    aux_layers.apply()
    cfg = SpeculatorsConfig.extract_transformers_pre_trained_config(_speculators_dict())
    runner = SimpleNamespace(
        speculative_config=SimpleNamespace(
            method="dflash",
            draft_model_config=SimpleNamespace(hf_config=SimpleNamespace(**cfg)),
        )
    )
    assert GPUModelRunner._get_eagle3_aux_layers_from_config(runner) == (
        2,
        17,
        32,
        47,
        62,
    )
