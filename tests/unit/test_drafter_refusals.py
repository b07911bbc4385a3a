# SPDX-License-Identifier: Apache-2.0
"""Drafter checks behind upstream bugs: vllm#48113 (fc features vs target
layers) and vllm#51581/#53116 (quantized drafters), as one-line errors."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from vllm_dflash.config import quantized_drafter
from vllm_dflash.config.drafter_validation import (
    validate_dflash,
)
from vllm_dflash.config.layer_types import DrafterConfigError
from vllm_dflash.registry import PatchState, evaluate

TARGET = SimpleNamespace(num_hidden_layers=6, vocab_size=512, hidden_size=128)


def _drafter(**kw) -> SimpleNamespace:
    cfg = dict(
        hidden_size=128,
        num_hidden_layers=2,
        vocab_size=512,
        block_size=8,
        dflash_config={"mask_token_id": 3, "target_layer_ids": [1, 3, 4]},
    )
    cfg.update(kw)
    return SimpleNamespace(**cfg)


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_fc_width_differs_from_target_hidden():
    with pytest.raises(DrafterConfigError) as e:
        validate_dflash(_drafter(target_hidden_size=64), TARGET, 4)
    msg = _one_line(e)
    assert "3 x 64 = 192 features" in msg and "3 layers x hidden_size 128 = 384" in msg


def test_fc_sized_by_drafter_layers_when_ids_come_from_eagle_field():
    # vLLM sizes fc by the drafter's own layer count (2) when dflash_config has no
    # target_layer_ids, while the target captures the 3 eagle aux layers.
    cfg = _drafter(
        dflash_config={"mask_token_id": 3},
        eagle_aux_hidden_state_layer_ids=[1, 3, 4],
    )
    with pytest.raises(DrafterConfigError) as e:
        validate_dflash(cfg, TARGET, 4)
    assert "2 x 128 = 256 features" in _one_line(e)


def test_matching_drafter_passes():
    validate_dflash(_drafter(), TARGET, 4)
    validate_dflash(_drafter(target_hidden_size=128), TARGET, 4)


def _refusal_state() -> PatchState:
    state = evaluate(quantized_drafter.PATCH, apply=False).state
    if state is PatchState.NOT_NEEDED:
        pytest.skip("this vLLM's DFlash drafter honours quant_method")
    return state


def test_quantized_checkpoint_refused_before_loading(tmp_path):
    state = _refusal_state()
    (tmp_path / "config.json").write_text(
        json.dumps({"quantization_config": {"quant_method": "fp8"}})
    )
    spec = {"method": "dflash", "model": str(tmp_path), "num_speculative_tokens": 4}
    with pytest.raises(DrafterConfigError) as e:
        quantized_drafter.check_raw(spec, quantized_drafter._raw_config(spec))
    assert "quantization='fp8'" in _one_line(e), state


def test_online_quantization_and_hub_drafters_refused():
    state = _refusal_state()
    with pytest.raises(DrafterConfigError):
        quantized_drafter.check_raw(
            {"method": "dflash", "model": "org/x-dflash", "quantization": "fp8"}, None
        )
    draft = SimpleNamespace(
        model="org/x-dflash",
        quantization=None,
        hf_config=SimpleNamespace(
            quantization_config={"quant_method": "compressed-tensors"}
        ),
    )
    vllm_config = SimpleNamespace(
        speculative_config=SimpleNamespace(method="dflash", draft_model_config=draft)
    )
    with pytest.raises(DrafterConfigError) as e:
        quantized_drafter.check_vllm_config(vllm_config)
    assert "compressed-tensors" in _one_line(e), state


def test_probe_sees_the_raw_weight_bypass():
    # vLLM 0.20-0.23 concatenate a quantized projection's stored int8 codes.
    assert quantized_drafter.bypass_quant_method() is True
