# SPDX-License-Identifier: Apache-2.0
"""fp8 KV cache + DFlash on a hybrid target (vllm#42692 backport, issue #22 item 5).

The drafter's decoder layers are built by vLLM's own ``DFlashQwen3DecoderLayer``
(stock or patched); the cache config they hand their attention decides the
drafter's KV dtype, and the KV specs of the Qwen3.6-27B-shaped pair are built and
laid out with vLLM's own functions (``tests/helpers/kv_specs.py``): stock 0.20.1
asserts in ``unify_kv_cache_spec_page_size``, patched it lays out.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.helpers import kv_specs
from vllm_dflash.registry import original
from vllm_dflash.spec_decode import drafter_kv_dtype as patch

qwen3_dflash = pytest.importorskip("vllm.model_executor.models.qwen3_dflash")
Layer = qwen3_dflash.DFlashQwen3DecoderLayer

GIB = 1024**3
# KV memory of the H200 runs (0.85 x 140.4 GiB - weights - peak), back-solved
# from their "Maximum concurrency for 8,192 tokens" lines (docs/hybrid.md).
AVAILABLE_DFLASH = int(61.57 * GIB)


@pytest.fixture
def patched():
    stock = Layer.__dict__["__init__"]
    patch.apply()
    patch.apply()  # idempotent
    yield Layer.__init__
    Layer.__init__ = stock


def _drafter_layer_cache_config(init, vllm_config, monkeypatch) -> object:
    """Build one drafter decoder layer with ``init``; return the cache config its
    attention received (attention, MLP, norms are stand-ins: no TP group needed)."""
    seen = {}

    def attention(**kwargs):
        seen.update(kwargs)
        return torch.nn.Identity()

    monkeypatch.setattr(qwen3_dflash, "DFlashQwen3Attention", attention)
    monkeypatch.setattr(qwen3_dflash, "Qwen3MLP", lambda **kw: torch.nn.Identity())
    monkeypatch.setattr(qwen3_dflash, "RMSNorm", lambda *a, **kw: torch.nn.Identity())
    _, drafter = kv_specs.load_27b()
    config = SimpleNamespace(**drafter, rope_parameters={"rope_theta": 1e7})
    layer = Layer.__new__(Layer)
    init(layer, vllm_config, config=config, prefix="model.layers.64")
    return seen["cache_config"]


def _vllm_config(kv_cache_dtype: str):
    target, _ = kv_specs.load_27b()
    vc = kv_specs.vllm_config_for(target, num_spec=15, kv_cache_dtype=kv_cache_dtype)
    vc.cache_config.sliding_window = 4096  # a target-level window must not leak
    vc.cache_config.calculate_kv_scales = True
    return vc


def test_probe_sees_the_defect():
    assert patch.probe()  # 0.20.x/0.21.x; 0.22+ are checked by the matrix (doctor)


def test_drafter_layers_get_the_engine_kv_dtype(patched, monkeypatch):
    vc = _vllm_config("fp8")
    stock = _drafter_layer_cache_config(original(Layer.__init__), vc, monkeypatch)
    assert stock is None  # -> kv_cache_dtype "auto": bf16 pages next to fp8
    got = _drafter_layer_cache_config(patched, vc, monkeypatch)
    assert got.cache_dtype == "fp8"
    assert got.sliding_window is None and got.calculate_kv_scales is False
    # the engine's own cache config is untouched
    assert vc.cache_config.sliding_window == 4096
    assert vc.cache_config.calculate_kv_scales is True


def _layout(kv_cache_dtype: str, drafter_cache_config, available: int) -> dict:
    target, drafter = kv_specs.load_27b()
    vc = kv_specs.vllm_config_for(target, num_spec=15, kv_cache_dtype=kv_cache_dtype)
    specs = kv_specs.build_specs(target, drafter, vc, drafter_cache_config)
    return kv_specs.layout(vc, specs, available)


def test_hybrid_fp8_kv_unifies_only_with_the_patch(patched, monkeypatch):
    vc = _vllm_config("fp8")
    stock_cc = _drafter_layer_cache_config(original(Layer.__init__), vc, monkeypatch)
    patched_cc = _drafter_layer_cache_config(patched, vc, monkeypatch)
    monkeypatch.undo()
    # red: vLLM 0.20.1's page-size unification asserts (vllm#43626, #46480)
    with pytest.raises(AssertionError):
        _layout("fp8", stock_cc, AVAILABLE_DFLASH)
    # green: every layer has one page; 15 groups as with bf16, block 960 (fp8)
    fp8 = _layout("fp8", patched_cc, AVAILABLE_DFLASH)
    assert fp8["block_size"] == 960
    assert len(fp8["groups"]) == 15
    pages = {g.kv_cache_spec.page_size_bytes for g in fp8["groups"]}
    assert pages == {1_966_080}
    dtypes = {
        g.layer_names[0].split(".layers.")[0]: g.kv_cache_spec.dtype
        for g in fp8["groups"]
        if g.layer_names[0].endswith(".attn")
    }
    # fp8 storage (uint8) for the drafter ("model") as for the target
    assert dtypes == {"model": torch.uint8, "language_model.model": torch.uint8}
    bf16 = _layout("auto", None, AVAILABLE_DFLASH)
    assert round(bf16["max_concurrency"], 1) == 26.9  # the H200 measurement
    assert fp8["max_concurrency"] > bf16["max_concurrency"]


def test_bf16_kv_layout_unchanged(patched, monkeypatch):
    """--kv-cache-dtype auto: the patched drafter's specs equal stock's."""
    vc = _vllm_config("auto")
    stock_cc = _drafter_layer_cache_config(original(Layer.__init__), vc, monkeypatch)
    patched_cc = _drafter_layer_cache_config(patched, vc, monkeypatch)
    monkeypatch.undo()
    target, drafter = kv_specs.load_27b()
    specs = []
    for cc in (stock_cc, patched_cc):
        vc = kv_specs.vllm_config_for(target, num_spec=15, kv_cache_dtype="auto")
        specs.append(kv_specs.build_specs(target, drafter, vc, cc))
    assert specs[0] == specs[1]
