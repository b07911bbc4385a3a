# SPDX-License-Identifier: Apache-2.0
"""dflash_flex_recompile_limit: a DFlash engine's FLEX_ATTENTION metadata builder
raises torch.compile's recompile limit from vLLM's 16 to 64; other engines keep
16. With ``VLLM_DFLASH_DISABLE=dflash_flex_recompile_limit`` the DFlash test fails
(the limit stays 16). The failure the limit prevents (FailOnRecompileLimitHit in
the drafter's forward, float32 on CUDA) is reproduced on a GPU by
``benchmarks/gpu/device_run.sh prefix_crash`` (its ``limit_off`` engine).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_dflash import envs


def _config(method: str | None) -> SimpleNamespace:
    spec = None if method is None else SimpleNamespace(method=method)
    return SimpleNamespace(speculative_config=spec)


@pytest.fixture
def builder(monkeypatch, isolated):
    try:
        from vllm.v1.attention.backends.flex_attention import (
            FlexAttentionMetadataBuilder,
        )
    except Exception as exc:  # pragma: no cover - depends on the vLLM build
        pytest.skip(f"vLLM's FLEX_ATTENTION backend does not import here: {exc}")
    from vllm_dflash.spec_decode import flex_recompile_limit as frl

    isolated(frl.PATCH)
    # vLLM's module sets 16 on import; start each test there
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 16)
    assert frl.probe(), "this vLLM's FLEX_ATTENTION already allows 64 variants"
    built: list = []

    def stock(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        built.append(vllm_config)  # vLLM's builder needs a whole engine config

    monkeypatch.setattr(FlexAttentionMetadataBuilder, "__init__", stock)
    if frl.PATCH_NAME not in envs.disabled_patches():  # disabled: the stock code runs
        frl.apply()
        frl.apply()  # idempotent

    def build(method: str | None) -> None:
        b = object.__new__(FlexAttentionMetadataBuilder)
        FlexAttentionMetadataBuilder.__init__(b, None, [], _config(method), "cpu")

    build.calls = built
    return build


def test_dflash_engine_gets_room(builder):
    builder("dflash")
    assert len(builder.calls) == 1  # vLLM's __init__ ran
    assert torch._dynamo.config.recompile_limit == 64


@pytest.mark.parametrize("method", [None, "eagle3", "mtp"])
def test_other_engines_keep_vllms_limit(builder, method):
    builder(method)
    assert len(builder.calls) == 1
    assert torch._dynamo.config.recompile_limit == 16


def test_never_lowers_a_larger_limit(monkeypatch):
    from vllm_dflash.spec_decode.flex_recompile_limit import raise_limit

    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 200)
    assert not raise_limit(_config("dflash"))
    assert torch._dynamo.config.recompile_limit == 200
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 16)
    assert raise_limit(_config("dflash"))
    assert not raise_limit(_config("dflash"))  # once is enough
    assert torch._dynamo.config.recompile_limit == 64
